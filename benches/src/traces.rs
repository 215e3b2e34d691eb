//! Reproducible access traces.
//!
//! A trace is a list of buffer numbers; [`crate::replay::Layout`] turns a
//! number into an address. Every generator takes an explicit seed and uses
//! [`SplitMix64`], whose output is fixed by its definition, so a seed names
//! the same trace on every machine and in every version of this crate (which
//! a general-purpose RNG crate does not promise for its default generator).

/// The SplitMix64 generator: 64 bits of state, one add and a mixing function
/// per output. Good enough statistically for picking buffers, and its output
/// for a given seed never changes.
#[derive(Clone, Debug)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator whose sequence is determined by `seed`.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform integer in `0..n` (`n > 0`), without modulo bias.
    pub fn below(&mut self, n: usize) -> usize {
        assert!(n > 0, "below(0) has no value to return");
        let n = n as u64;
        // Rejection on the low part of the 128-bit product (Lemire's method).
        loop {
            let m = u128::from(self.next_u64()) * u128::from(n);
            let low = m as u64;
            if low >= n || low >= n.wrapping_neg() % n {
                return (m >> 64) as usize;
            }
        }
    }

    /// A uniform float in `[0, 1)` with 53 random bits.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Shuffles `items` in place (Fisher-Yates).
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i + 1);
            items.swap(i, j);
        }
    }
}

/// Derives a per-trace seed from the run's seed and a label, so that traces
/// of different kinds made from one seed are not correlated.
pub fn derive_seed(seed: u64, label: &str) -> u64 {
    // FNV-1a over the label, mixed with the seed through one SplitMix64 step.
    let mut h: u64 = 0xCBF2_9CE4_8422_2325;
    for b in label.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01B3);
    }
    SplitMix64::new(seed ^ h).next_u64()
}

/// An access trace over buffers numbered `0..buffers`.
#[derive(Clone, Debug)]
pub struct Trace {
    /// Short name of the access pattern (`"sequential"`, `"uniform"`, ...).
    pub name: &'static str,
    /// Number of distinct buffers the trace may touch (ids are `0..buffers`).
    pub buffers: usize,
    /// Accesses replayed before measuring; they are neither timed nor
    /// counted in the statistics.
    pub warmup: Vec<usize>,
    /// The measured accesses: one transfer each.
    pub accesses: Vec<usize>,
}

impl Trace {
    /// Number of measured transfers.
    pub fn transfers(&self) -> usize {
        self.accesses.len()
    }
}

/// Cyclic sweep `0, 1, ..., working_set - 1, 0, 1, ...` of `transfers`
/// accesses. With LRU or FIFO and a cache smaller than `working_set`, every
/// access misses.
pub fn sequential(working_set: usize, transfers: usize) -> Trace {
    assert!(working_set > 0);
    Trace {
        name: "sequential",
        buffers: working_set,
        warmup: Vec::new(),
        accesses: (0..transfers).map(|i| i % working_set).collect(),
    }
}

/// `transfers` accesses drawn uniformly from `working_set` buffers.
pub fn uniform(working_set: usize, transfers: usize, seed: u64) -> Trace {
    assert!(working_set > 0);
    let mut rng = SplitMix64::new(seed);
    Trace {
        name: "uniform",
        buffers: working_set,
        warmup: Vec::new(),
        accesses: (0..transfers).map(|_| rng.below(working_set)).collect(),
    }
}

/// Number of hot buffers for [`hot_cold`]: `hot_buffer_fraction` of the
/// working set, at least one and leaving at least one cold buffer.
pub fn hot_set_size(working_set: usize, hot_buffer_fraction: f64) -> usize {
    let hot = (working_set as f64 * hot_buffer_fraction).round() as usize;
    hot.clamp(1, working_set.saturating_sub(1).max(1))
}

/// A hot set with a cold tail: each access goes with probability
/// `hot_access_fraction` to one of the first [`hot_set_size`] buffers and
/// otherwise to one of the rest, uniformly within each part. The classic
/// setting is 90% of the accesses to 10% of the buffers.
pub fn hot_cold(
    working_set: usize,
    transfers: usize,
    hot_buffer_fraction: f64,
    hot_access_fraction: f64,
    seed: u64,
) -> Trace {
    assert!(
        working_set >= 2,
        "a hot set and a cold tail need two buffers"
    );
    let hot = hot_set_size(working_set, hot_buffer_fraction);
    let cold = working_set - hot;
    let mut rng = SplitMix64::new(seed);
    let accesses = (0..transfers)
        .map(|_| {
            if rng.unit() < hot_access_fraction {
                rng.below(hot)
            } else {
                hot + rng.below(cold)
            }
        })
        .collect();
    Trace {
        name: "hot_cold",
        buffers: working_set,
        warmup: Vec::new(),
        accesses,
    }
}

/// Number of misses [`pm_miss_fraction`] places in `transfers` transfers:
/// `miss_fraction * transfers` rounded to the nearest integer.
pub fn intended_misses(transfers: usize, miss_fraction: f64) -> usize {
    assert!(
        (0.0..=1.0).contains(&miss_fraction),
        "a fraction is in [0, 1]"
    );
    ((transfers as f64) * miss_fraction).round() as usize
}

/// The experiment of the PM pin-down cache paper: a stream of transfers of
/// which a chosen fraction miss the cache.
///
/// Buffers `0..hot_buffers` form the hot set; the warm-up pins each of them
/// once, so afterwards they are cached. Exactly
/// [`intended_misses`]`(transfers, miss_fraction)` transfers, at seeded random
/// positions, each use a fresh buffer (`hot_buffers`, `hot_buffers + 1`, ...)
/// that no earlier access touched; the others cycle over the hot set.
///
/// The measured miss count equals the intended one exactly as long as
/// nothing is evicted, that is when the cache holds `trace.buffers` entries
/// (whatever the policy).
pub fn pm_miss_fraction(
    transfers: usize,
    miss_fraction: f64,
    hot_buffers: usize,
    seed: u64,
) -> Trace {
    assert!(hot_buffers > 0);
    let misses = intended_misses(transfers, miss_fraction);
    let mut is_miss = vec![false; transfers];
    is_miss[..misses].fill(true);
    SplitMix64::new(seed).shuffle(&mut is_miss);
    let mut next_fresh = hot_buffers;
    let mut next_hot = 0;
    let accesses = is_miss
        .iter()
        .map(|&miss| {
            if miss {
                next_fresh += 1;
                next_fresh - 1
            } else {
                next_hot = (next_hot + 1) % hot_buffers;
                next_hot
            }
        })
        .collect();
    Trace {
        name: "pm_miss_fraction",
        buffers: hot_buffers + misses,
        warmup: (0..hot_buffers).collect(),
        accesses,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_known_values() {
        // Reference outputs of SplitMix64 for seed 1234567.
        let mut r = SplitMix64::new(1234567);
        assert_eq!(r.next_u64(), 6457827717110365317);
        assert_eq!(r.next_u64(), 3203168211198807973);
    }

    #[test]
    fn below_stays_in_range_and_covers_it() {
        let mut r = SplitMix64::new(7);
        let mut seen = [false; 10];
        for _ in 0..1000 {
            let v = r.below(10);
            seen[v] = true;
        }
        assert!(seen.iter().all(|&s| s));
    }

    #[test]
    fn same_seed_same_trace() {
        assert_eq!(uniform(100, 500, 9).accesses, uniform(100, 500, 9).accesses);
        assert_ne!(
            uniform(100, 500, 9).accesses,
            uniform(100, 500, 10).accesses
        );
    }

    #[test]
    fn pm_trace_counts() {
        let t = pm_miss_fraction(1000, 0.25, 8, 1);
        let fresh = t.accesses.iter().filter(|&&b| b >= 8).count();
        assert_eq!(fresh, 250);
        assert_eq!(t.buffers, 258);
        let mut ids: Vec<_> = t.accesses.iter().filter(|&&b| b >= 8).collect();
        ids.dedup();
        assert_eq!(ids.len(), 250, "fresh buffers are never reused");
    }

    #[test]
    fn hot_cold_mostly_hot() {
        let t = hot_cold(1000, 100_000, 0.1, 0.9, 3);
        let hot = t.accesses.iter().filter(|&&b| b < 100).count();
        let share = hot as f64 / 100_000.0;
        assert!((share - 0.9).abs() < 0.01, "{share}");
    }
}
