//! What the RDMA measurements share: the two ways of waiting for
//! completions, requests run one at a time or several in flight, the byte
//! patterns transfers are verified with, and running the emulated NIC from
//! a program's own executable.
//!
//! The `pindown-demo` program and the criterion benchmark `rdma` both use
//! these, so that the benchmark times what the demo reports.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::fmt;
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use pindown_driver::verbs::{CompletionQueue, ContextConfig, Entry, QueuePair, VerbsError};
use pindown_uapi::{Completion, CompletionError};
use serde::{Deserialize, Serialize};

use crate::traces::SplitMix64;

/// How the device and the driver wait for work.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// The device sleeps on doorbells after a short spin; the driver polls
    /// for its default spin time, then sleeps on the completion eventfd.
    Event,
    /// The device busy-polls its rings (`--poll`); the driver never sleeps
    /// (`ContextConfig::spin = Duration::MAX`).
    Poll,
}

impl Mode {
    /// Both modes, event-driven first.
    pub const ALL: [Mode; 2] = [Mode::Event, Mode::Poll];

    /// `"event"` or `"poll"`.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Event => "event",
            Mode::Poll => "poll",
        }
    }

    /// The device's command-line options for this mode.
    pub fn device_args(self) -> &'static [&'static str] {
        match self {
            Mode::Event => &[],
            Mode::Poll => &["--poll"],
        }
    }

    /// A driver configuration for this mode with an arena of `arena_bytes`.
    pub fn context_config(self, arena_bytes: usize) -> ContextConfig {
        let default = ContextConfig::default();
        ContextConfig {
            arena_bytes,
            spin: match self {
                Mode::Event => default.spin,
                Mode::Poll => Duration::MAX,
            },
            ..default
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The targets the figure programs report their results against
/// (measured and reported, never enforced).
pub mod targets {
    /// Busy-poll: median of an 8-byte write or fetch-add, post to
    /// completion, in microseconds (at most).
    pub const POLL_MEDIAN_US: f64 = 1.0;
    /// Busy-poll: 99th percentile over the median (at most).
    pub const POLL_P99_OVER_MEDIAN: f64 = 2.0;
    /// Event-driven while traffic flows (within the spin window): median,
    /// in microseconds (at most).
    pub const EVENT_MEDIAN_US: f64 = 1.3;
    /// Streams of 1 MiB and 16 MiB writes over one thread's `memcpy` of the
    /// same size on an idle machine (at least).
    pub const BANDWIDTH_OVER_MEMCPY: f64 = 0.9;
}

/// Writes in flight in the bandwidth streams of the demo and the benchmark.
pub const IN_FLIGHT: usize = 4;

/// How long one request may take before the programs give up on it.
pub const TIMEOUT: Duration = Duration::from_secs(10);

/// Why a request could not be run.
#[derive(Debug)]
pub enum RdmaError {
    /// The driver failed (or the device went away).
    Verbs(VerbsError),
    /// The request completed with an error.
    Failed(CompletionError),
}

impl fmt::Display for RdmaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RdmaError::Verbs(e) => write!(f, "{e}"),
            RdmaError::Failed(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for RdmaError {}

impl From<VerbsError> for RdmaError {
    fn from(e: VerbsError) -> Self {
        RdmaError::Verbs(e)
    }
}

/// Posts `entry` (signaled) on `qp` and waits for its completion on `cq`
/// (the queue pair's completion queue, holding nothing else): the time of
/// this call is the latency from post to completion seen. An error
/// completion is returned as [`RdmaError::Failed`].
pub fn run_one(
    qp: &mut QueuePair<'_>,
    cq: &mut CompletionQueue<'_>,
    entry: Entry<'_>,
) -> Result<Completion, RdmaError> {
    qp.post(&[entry.signaled()])?;
    let completion = cq
        .wait(TIMEOUT)?
        .next()
        .expect("wait yields at least one completion");
    completion.result().map_err(RdmaError::Failed)?;
    Ok(completion)
}

/// Runs `count` requests on `qp` with at most `depth` in flight, reaping
/// them from `cq`. `hold(i)` makes a value held until request `i` has
/// completed, such as the registration of its local memory, and
/// `build(&held)` builds the request from it (its `user_data` is set to
/// `i`). Requests complete in the order they were posted.
pub fn run_many<G>(
    qp: &mut QueuePair<'_>,
    cq: &mut CompletionQueue<'_>,
    count: u64,
    depth: usize,
    mut hold: impl FnMut(u64) -> Result<G, RdmaError>,
    build: impl for<'g> Fn(&'g G) -> Result<Entry<'g>, RdmaError>,
) -> Result<(), RdmaError> {
    let depth = depth.max(1);
    let mut held: VecDeque<(u64, G)> = VecDeque::with_capacity(depth);
    let mut posted = 0u64;
    let mut done = 0u64;
    while done < count {
        while posted < count && held.len() < depth {
            let guard = hold(posted)?;
            qp.post(&[build(&guard)?.user_data(posted).signaled()])?;
            held.push_back((posted, guard));
            posted += 1;
        }
        for completion in cq.wait(TIMEOUT)? {
            completion.result().map_err(RdmaError::Failed)?;
            while held
                .front()
                .is_some_and(|(i, _)| *i <= completion.user_data)
            {
                held.pop_front();
            }
            done += 1;
        }
    }
    Ok(())
}

/// Bytes per second over `secs` seconds, in GB/s (10^9 bytes per second).
pub fn gb_per_s(bytes: f64, secs: f64) -> f64 {
    if secs > 0.0 {
        bytes / secs / 1e9
    } else {
        0.0
    }
}

/// The SplitMix64 step between consecutive outputs.
const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// The pattern of `seed`: the little-endian bytes of the [`SplitMix64`]
/// stream of `seed`. Byte `p` of the pattern depends only on `seed` and `p`,
/// so any range of it can be made and checked on its own.
fn pattern_words(seed: u64, start: u64) -> (SplitMix64, usize) {
    let word = start / 8;
    // The generator's state after `word` steps: its next output is word
    // number `word` of the stream.
    let generator = SplitMix64::new(seed.wrapping_add(word.wrapping_mul(GOLDEN)));
    (generator, (start % 8) as usize)
}

/// Fills `out` with bytes `start..start + out.len()` of the pattern of
/// `seed`.
pub fn fill_pattern(seed: u64, start: u64, out: &mut [u8]) {
    let (mut words, skip) = pattern_words(seed, start);
    let mut filled = 0;
    let mut first = true;
    while filled < out.len() {
        let bytes = words.next_u64().to_le_bytes();
        let from = if first { skip } else { 0 };
        first = false;
        let n = (8 - from).min(out.len() - filled);
        out[filled..filled + n].copy_from_slice(&bytes[from..from + n]);
        filled += n;
    }
}

/// Bytes `start..start + len` of the pattern of `seed`.
pub fn pattern(seed: u64, start: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0; len];
    fill_pattern(seed, start, &mut out);
    out
}

/// Where `bytes` first differs from bytes `start..` of the pattern of
/// `seed`; `None` if it does not.
pub fn first_difference(seed: u64, start: u64, bytes: &[u8]) -> Option<usize> {
    let expected = pattern(seed, start, bytes.len());
    bytes.iter().zip(&expected).position(|(a, b)| a != b)
}

/// The environment variable that makes a benchmark executable run the
/// device instead (see [`run_device_if_asked`]).
pub const DEVICE_ENV: &str = "PINDOWN_BENCH_DEVICE";

/// Asks the kernel to send this process SIGTERM when its parent exits, so
/// that a device or rank started by a program that is killed does not
/// outlive it.
pub fn die_with_parent() {
    // SAFETY: prctl(PR_SET_PDEATHSIG) takes a signal number and changes
    // only this process's attributes; no memory is passed.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) };
}

/// Runs the emulated NIC with command-line `args` (without a program name)
/// until SIGTERM or SIGINT, dying with the parent process. If the parent
/// died first (so that nobody else will clean up), a `--socket-dir` holding
/// nothing but the device's log is removed on the way out.
pub fn run_device<I: IntoIterator<Item = OsString>>(args: I) -> ExitCode {
    let parent = std::os::unix::process::parent_id();
    die_with_parent();
    let args: Vec<OsString> = args.into_iter().collect();
    let code = pindown_emu_device::cli::main(
        std::iter::once(OsString::from("pindown-emu-device")).chain(args.clone()),
    );
    if std::os::unix::process::parent_id() != parent {
        let dir = args
            .iter()
            .position(|a| a == "--socket-dir")
            .and_then(|i| args.get(i + 1));
        if let Some(dir) = dir {
            remove_if_only_log(Path::new(dir));
        }
    }
    code
}

/// Removes `dir` if the only thing in it is `device.log`.
fn remove_if_only_log(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let only_log = entries
        .filter_map(Result::ok)
        .all(|e| e.file_name() == "device.log");
    if only_log {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// When [`DEVICE_ENV`] is set, runs the device with this process's
/// arguments and exits; otherwise returns at once, after setting
/// [`DEVICE_ENV`] so that children started from
/// [`std::env::current_exe`] (for instance through
/// `pindown_emu_device::testing::DeviceProcess`) run the device. Call it first in
/// `main`, before any thread starts.
pub fn run_device_if_asked() {
    if std::env::var_os(DEVICE_ENV).is_some() {
        let code = run_device(std::env::args_os().skip(1));
        std::process::exit(if code == ExitCode::SUCCESS { 0 } else { 1 });
    }
    // No other thread exists yet, so nothing reads the environment while
    // it changes.
    std::env::set_var(DEVICE_ENV, "1");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_ranges_agree_with_the_whole() {
        let whole = pattern(7, 0, 100);
        for start in [0usize, 1, 7, 8, 9, 31] {
            for len in [0usize, 1, 5, 8, 13, 60] {
                let part = pattern(7, start as u64, len);
                assert_eq!(part, whole[start..start + len], "{start} {len}");
                assert_eq!(first_difference(7, start as u64, &part), None);
            }
        }
        assert_ne!(pattern(8, 0, 16), whole[..16]);
        let mut bad = whole.clone();
        bad[42] ^= 1;
        assert_eq!(first_difference(7, 0, &bad), Some(42));
    }

    #[test]
    fn mode_configurations() {
        assert_eq!(Mode::Poll.context_config(1 << 20).spin, Duration::MAX);
        assert_ne!(Mode::Event.context_config(1 << 20).spin, Duration::MAX);
        assert_eq!(Mode::Poll.device_args(), ["--poll"]);
        assert!(Mode::Event.device_args().is_empty());
        assert_eq!(Mode::Event.context_config(1 << 20).arena_bytes, 1 << 20);
    }
}
