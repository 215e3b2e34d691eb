//! Seeded fault injection for datagrams: loss, duplication, reordering and
//! delay, reproducible for a seed.
//!
//! The kernels the fabric runs on have no netem, so the device injects
//! faults itself, separately on the way out and on the way in. A
//! [`FaultInjector`] takes datagrams with [`push`](FaultInjector::push) and
//! hands them back, changed by its [`Faults`], with
//! [`pop_ready`](FaultInjector::pop_ready) once their time has come.
//!
//! For each datagram pushed, in this order, drawing from one seeded random
//! stream:
//!
//! 1. with probability `loss` it is dropped;
//! 2. it is held for a delay drawn uniformly from `0..=delay`;
//! 3. with probability `reorder` it is held for a further
//!    `reorder_hold`, so datagrams pushed after it overtake it;
//! 4. with probability `duplicate` a second copy is queued, with its own
//!    delay drawn as in 2.
//!
//! The same seed and the same sequence of `push`/`pop_ready` calls at the
//! same instants give the same output.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::fmt;
use std::str::FromStr;
use std::time::{Duration, Instant};

/// The fault rates of one direction.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Faults {
    /// Probability that a datagram is dropped.
    pub loss: f64,
    /// Probability that a datagram is delivered twice.
    pub duplicate: f64,
    /// Probability that a datagram is held back by `reorder_hold`.
    pub reorder: f64,
    /// Largest delay added to each datagram (uniformly drawn).
    pub delay: Duration,
    /// The extra hold of a reordered datagram.
    pub reorder_hold: Duration,
    /// Seed of the random stream.
    pub seed: u64,
}

impl Faults {
    /// The default hold of a reordered datagram.
    pub const DEFAULT_REORDER_HOLD: Duration = Duration::from_millis(1);

    /// No faults at all.
    pub const NONE: Faults = Faults {
        loss: 0.0,
        duplicate: 0.0,
        reorder: 0.0,
        delay: Duration::ZERO,
        reorder_hold: Self::DEFAULT_REORDER_HOLD,
        seed: 0,
    };

    /// `true` when no datagram is ever changed.
    pub fn is_none(&self) -> bool {
        self.loss == 0.0 && self.duplicate == 0.0 && self.reorder == 0.0 && self.delay.is_zero()
    }
}

impl Default for Faults {
    fn default() -> Self {
        Self::NONE
    }
}

/// Why a fault specification does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FaultsParseError {
    /// An item without `=`.
    #[error("expected key=value, got {0:?}")]
    NotKeyValue(String),
    /// A key this parser does not know.
    #[error("unknown fault {0:?} (known: loss, dup, reorder, delay, hold, seed)")]
    UnknownKey(String),
    /// A probability that is not a number in 0..=1.
    #[error("{key}: {value:?} is not a probability between 0 and 1")]
    BadProbability {
        /// The key.
        key: String,
        /// The text given.
        value: String,
    },
    /// A duration that does not parse.
    #[error("{key}: {value:?} is not a duration like 200us, 5ms, 1s or 700ns")]
    BadDuration {
        /// The key.
        key: String,
        /// The text given.
        value: String,
    },
    /// A seed that is not an unsigned 64-bit integer.
    #[error("seed: {0:?} is not an unsigned 64-bit integer")]
    BadSeed(String),
}

/// A duration such as `3s`, `500ms`, `100us` or `20ns` (whole numbers).
pub fn parse_duration(text: &str) -> Option<Duration> {
    let digits_end = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(digits_end);
    let number: u64 = number.parse().ok()?;
    match unit {
        "ns" => Some(Duration::from_nanos(number)),
        "us" => Some(Duration::from_micros(number)),
        "ms" => Some(Duration::from_millis(number)),
        "s" => Some(Duration::from_secs(number)),
        _ => None,
    }
}

fn format_duration(duration: Duration) -> String {
    let nanos = duration.as_nanos();
    if nanos.is_multiple_of(1_000_000_000) {
        format!("{}s", nanos / 1_000_000_000)
    } else if nanos.is_multiple_of(1_000_000) {
        format!("{}ms", nanos / 1_000_000)
    } else if nanos.is_multiple_of(1_000) {
        format!("{}us", nanos / 1_000)
    } else {
        format!("{nanos}ns")
    }
}

impl FromStr for Faults {
    type Err = FaultsParseError;

    /// Parses `loss=0.05,dup=0.01,reorder=0.05,delay=200us,hold=1ms,seed=7`;
    /// every item is optional (missing ones are zero, `hold` is
    /// [`Faults::DEFAULT_REORDER_HOLD`]); the empty string is no faults.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let mut faults = Faults::NONE;
        for item in text
            .split(',')
            .map(str::trim)
            .filter(|item| !item.is_empty())
        {
            let Some((key, value)) = item.split_once('=') else {
                return Err(FaultsParseError::NotKeyValue(item.to_owned()));
            };
            let (key, value) = (key.trim(), value.trim());
            let probability = || {
                value
                    .parse::<f64>()
                    .ok()
                    .filter(|p| (0.0..=1.0).contains(p))
                    .ok_or_else(|| FaultsParseError::BadProbability {
                        key: key.to_owned(),
                        value: value.to_owned(),
                    })
            };
            let duration = || {
                parse_duration(value).ok_or_else(|| FaultsParseError::BadDuration {
                    key: key.to_owned(),
                    value: value.to_owned(),
                })
            };
            match key {
                "loss" => faults.loss = probability()?,
                "dup" | "duplicate" => faults.duplicate = probability()?,
                "reorder" => faults.reorder = probability()?,
                "delay" => faults.delay = duration()?,
                "hold" => faults.reorder_hold = duration()?,
                "seed" => {
                    faults.seed = value
                        .parse()
                        .map_err(|_| FaultsParseError::BadSeed(value.to_owned()))?
                }
                _ => return Err(FaultsParseError::UnknownKey(key.to_owned())),
            }
        }
        Ok(faults)
    }
}

impl fmt::Display for Faults {
    /// The form [`FromStr`] parses.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "loss={},dup={},reorder={},delay={},hold={},seed={}",
            self.loss,
            self.duplicate,
            self.reorder,
            format_duration(self.delay),
            format_duration(self.reorder_hold),
            self.seed
        )
    }
}

/// A small seeded random stream (SplitMix64): reproducible, not for
/// secrets.
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A stream starting from `seed`.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number uniformly drawn from `[0, 1)`.
    pub fn next_f64(&mut self) -> f64 {
        // 53 random bits: every value is exactly representable.
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// `true` with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && self.next_f64() < p
    }

    /// A duration uniformly drawn from `0..=max` (nanosecond grain).
    pub fn duration_up_to(&mut self, max: Duration) -> Duration {
        let max_nanos = u64::try_from(max.as_nanos()).unwrap_or(u64::MAX);
        if max_nanos == 0 {
            return Duration::ZERO;
        }
        Duration::from_nanos(self.next_u64() % max_nanos.saturating_add(1))
    }
}

/// What an injector did, counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FaultStats {
    /// Datagrams pushed.
    pub pushed: u64,
    /// Datagrams dropped by `loss`.
    pub lost: u64,
    /// Extra copies queued by `duplicate`.
    pub duplicated: u64,
    /// Datagrams held back by `reorder`.
    pub reordered: u64,
    /// Datagrams dropped because [`FaultInjector::MAX_HELD`] were held.
    pub overflowed: u64,
    /// Datagrams handed back by `pop_ready`.
    pub released: u64,
}

/// Applies [`Faults`] to a stream of datagrams; see the module docs.
#[derive(Debug)]
pub struct FaultInjector {
    faults: Faults,
    random: SplitMix64,
    /// Held datagrams, earliest release first; ties in push order.
    held: BinaryHeap<Reverse<(Instant, u64, HeldDatagram)>>,
    pushes: u64,
    stats: FaultStats,
}

/// A datagram waiting in the injector (ordered by the heap key only).
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct HeldDatagram(Vec<u8>);

impl FaultInjector {
    /// Most datagrams held at once; beyond it pushes are dropped (and
    /// counted), so a fast sender cannot grow the injector without bound.
    pub const MAX_HELD: usize = 65_536;

    /// An injector applying `faults`, seeded with `faults.seed`.
    pub fn new(faults: Faults) -> Self {
        Self {
            faults,
            random: SplitMix64::new(faults.seed),
            held: BinaryHeap::new(),
            pushes: 0,
            stats: FaultStats::default(),
        }
    }

    /// The faults applied.
    pub fn faults(&self) -> &Faults {
        &self.faults
    }

    /// What was done so far.
    pub fn stats(&self) -> &FaultStats {
        &self.stats
    }

    /// Datagrams held now.
    pub fn held(&self) -> usize {
        self.held.len()
    }

    fn hold(&mut self, release: Instant, datagram: Vec<u8>) {
        if self.held.len() >= Self::MAX_HELD {
            self.stats.overflowed += 1;
            return;
        }
        self.pushes += 1;
        self.held
            .push(Reverse((release, self.pushes, HeldDatagram(datagram))));
    }

    /// Takes one datagram sent (or received) at `now`.
    pub fn push(&mut self, now: Instant, datagram: &[u8]) {
        self.stats.pushed += 1;
        if self.random.chance(self.faults.loss) {
            self.stats.lost += 1;
            return;
        }
        let mut release = now + self.random.duration_up_to(self.faults.delay);
        if self.random.chance(self.faults.reorder) {
            self.stats.reordered += 1;
            release += self.faults.reorder_hold;
        }
        if self.random.chance(self.faults.duplicate) {
            self.stats.duplicated += 1;
            let copy_release = now + self.random.duration_up_to(self.faults.delay);
            self.hold(copy_release, datagram.to_vec());
        }
        self.hold(release, datagram.to_vec());
    }

    /// The next datagram due at or before `now`, if any.
    pub fn pop_ready(&mut self, now: Instant) -> Option<Vec<u8>> {
        let Reverse((release, _, _)) = self.held.peek()?;
        if *release > now {
            return None;
        }
        let Reverse((_, _, HeldDatagram(datagram))) = self.held.pop()?;
        self.stats.released += 1;
        Some(datagram)
    }

    /// When the next held datagram is due.
    pub fn next_ready(&self) -> Option<Instant> {
        self.held.peek().map(|Reverse((release, _, _))| *release)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_display_round_trip() {
        let faults: Faults = "loss=0.05,dup=0.01,reorder=0.05,delay=200us,seed=7"
            .parse()
            .unwrap();
        assert_eq!(faults.loss, 0.05);
        assert_eq!(faults.duplicate, 0.01);
        assert_eq!(faults.reorder, 0.05);
        assert_eq!(faults.delay, Duration::from_micros(200));
        assert_eq!(faults.reorder_hold, Faults::DEFAULT_REORDER_HOLD);
        assert_eq!(faults.seed, 7);
        assert_eq!(faults.to_string().parse::<Faults>().unwrap(), faults);
        assert_eq!("".parse::<Faults>().unwrap(), Faults::NONE);
        assert!(Faults::NONE.is_none());
    }

    #[test]
    fn parse_rejects_bad_input() {
        assert!(matches!(
            "loss=1.5".parse::<Faults>(),
            Err(FaultsParseError::BadProbability { .. })
        ));
        assert!(matches!(
            "loss=nan".parse::<Faults>(),
            Err(FaultsParseError::BadProbability { .. })
        ));
        assert!(matches!(
            "delay=5h".parse::<Faults>(),
            Err(FaultsParseError::BadDuration { .. })
        ));
        assert!(matches!(
            "jitter=1".parse::<Faults>(),
            Err(FaultsParseError::UnknownKey(_))
        ));
        assert!(matches!(
            "loss".parse::<Faults>(),
            Err(FaultsParseError::NotKeyValue(_))
        ));
        assert!(matches!(
            "seed=-1".parse::<Faults>(),
            Err(FaultsParseError::BadSeed(_))
        ));
    }

    fn run(faults: Faults, count: u32) -> (Vec<(Duration, u32)>, FaultStats) {
        let start = Instant::now();
        let mut injector = FaultInjector::new(faults);
        let mut out = Vec::new();
        for i in 0..count {
            let now = start + Duration::from_micros(u64::from(i) * 10);
            injector.push(now, &i.to_le_bytes());
            while let Some(datagram) = injector.pop_ready(now) {
                out.push((
                    now - start,
                    u32::from_le_bytes(datagram.try_into().unwrap()),
                ));
            }
        }
        while let Some(at) = injector.next_ready() {
            let datagram = injector.pop_ready(at).unwrap();
            out.push((at - start, u32::from_le_bytes(datagram.try_into().unwrap())));
        }
        (out, *injector.stats())
    }

    #[test]
    fn deterministic_for_a_seed_and_rates_roughly_hold() {
        let faults: Faults = "loss=0.1,dup=0.05,reorder=0.1,delay=50us,seed=42"
            .parse()
            .unwrap();
        let (first, stats) = run(faults, 20_000);
        let (second, _) = run(faults, 20_000);
        assert_eq!(first, second);
        let (other_seed, _) = run(Faults { seed: 43, ..faults }, 20_000);
        assert_ne!(first, other_seed);

        assert_eq!(stats.pushed, 20_000);
        assert_eq!(stats.released, stats.pushed - stats.lost + stats.duplicated);
        assert_eq!(first.len() as u64, stats.released);
        // 10 % +- 1.5 %, 5 % +- 1 % of 20 000 draws.
        assert!((1_700..=2_300).contains(&stats.lost), "{stats:?}");
        assert!((800..=1_200).contains(&stats.duplicated), "{stats:?}");
        assert!((1_500..=2_100).contains(&stats.reordered), "{stats:?}");
        let out_of_order = first.windows(2).filter(|w| w[1].1 < w[0].1).count();
        assert!(out_of_order > 0);
    }

    #[test]
    fn no_faults_is_the_identity() {
        let (out, stats) = run(Faults::NONE, 1_000);
        let expected: Vec<_> = (0..1_000u32)
            .map(|i| (Duration::from_micros(u64::from(i) * 10), i))
            .collect();
        assert_eq!(out, expected);
        assert_eq!(stats.released, 1_000);
    }

    #[test]
    fn delays_stay_within_bounds() {
        let faults = Faults {
            delay: Duration::from_micros(30),
            reorder: 0.2,
            reorder_hold: Duration::from_micros(500),
            seed: 9,
            ..Faults::NONE
        };
        let (out, _) = run(faults, 5_000);
        assert_eq!(out.len(), 5_000);
        for (released, i) in out {
            // Released at a push instant or at the due time itself.
            let pushed = Duration::from_micros(u64::from(i) * 10);
            assert!(released >= pushed);
            assert!(released <= pushed + Duration::from_micros(530) + Duration::from_micros(10));
        }
    }
}
