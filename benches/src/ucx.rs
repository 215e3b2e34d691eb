//! The UCX peer of `pin-cost`: UCX's registration cache (`ucs_rcache` of
//! libucs) driven by the project's own C program `benches/ucx/rcache.c`
//! (compiled into this crate as text), built with the C compiler at run
//! time against the installed UCX ([`build`]) and run on this host
//! ([`run`]). Its mem_reg/mem_dereg callbacks pin with `mlock` and unpin
//! with `munlock`, as pindown's `MlockPinner` does, so that both caches pay
//! the same pin; the program's header comment says what each figure is.

use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::child::LineChild;
use crate::mpi::find_in_path;

/// The program's source.
const SOURCE: &str = include_str!("../ucx/rcache.c");

/// The header of UCX's registration cache (Debian package libucx-dev); the
/// report's peer list checks the same file, and `build.rs` (which ignores
/// the UCX test without it) names it again.
pub const RCACHE_HEADER: &str = "/usr/include/ucs/memory/rcache.h";

/// The C compiler the program is built with.
pub const COMPILER: &str = "cc";

/// How long the program may print nothing before it is stopped.
const SILENCE_TIMEOUT: Duration = Duration::from_secs(120);

/// How much of a failed run's stderr an error shows (its last lines).
const STDERR_LINES_SHOWN: usize = 20;

/// Why the UCX peer cannot be built here: the header or the compiler is
/// missing.
pub fn missing() -> Option<String> {
    if !Path::new(RCACHE_HEADER).is_file() {
        Some(format!(
            "{RCACHE_HEADER} is missing (Debian package libucx-dev)"
        ))
    } else if find_in_path(COMPILER).is_none() {
        Some(format!("{COMPILER} is not on PATH (Debian package gcc)"))
    } else {
        None
    }
}

/// The compiler flags `pkg-config` gives for UCX (`--cflags` and
/// `--libs-only-L`), none if it or UCX's `.pc` file is absent: the
/// libraries themselves are always `-lucs -lucm`.
fn pkg_config_flags() -> Vec<String> {
    let Ok(output) = Command::new("pkg-config")
        .args(["--cflags", "--libs-only-L", "ucx"])
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
    else {
        return Vec::new();
    };
    if !output.status.success() {
        return Vec::new();
    }
    String::from_utf8_lossy(&output.stdout)
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

/// Writes the program's source into `dir` and compiles it (`cc -O2`,
/// `-lucs -lucm`); returns the executable's path (`dir/rcache`).
pub fn build(dir: &Path) -> io::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let source = dir.join("rcache.c");
    std::fs::write(&source, SOURCE)?;
    let binary = dir.join("rcache");
    let output = Command::new(COMPILER)
        .args(["-O2", "-Wall"])
        .args(pkg_config_flags())
        .arg("-o")
        .arg(&binary)
        .arg(&source)
        .args(["-lucs", "-lucm"])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| io::Error::new(e.kind(), format!("{COMPILER}: {e}")))?;
    if !output.status.success() {
        return Err(io::Error::other(format!(
            "{COMPILER} rcache.c failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        )));
    }
    Ok(binary)
}

/// What to measure: region sizes and repetitions (as `pin-cost`'s own).
#[derive(Clone, Debug, Serialize)]
pub struct RunSpec {
    /// Region sizes, in pages.
    pub pages: Vec<usize>,
    /// Misses timed per size, at least.
    pub min_reps: usize,
    /// Misses timed per size, at most.
    pub max_reps: usize,
    /// Stop adding misses once this much time went into one size.
    pub budget_ms: u64,
    /// Hits timed per batch.
    pub hit_batch: usize,
    /// Batches of hits per size.
    pub hit_batches: usize,
}

/// The program's first line.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct Header {
    /// UCX's API version of the headers it was built with ("1.13").
    pub ucx_api: String,
    /// Its page size.
    pub page_size: usize,
    /// The UCM events the cache subscribed to.
    pub ucm_events: String,
    /// What mem_reg does ("mlock").
    pub pin: String,
}

/// One region size; times are medians, in microseconds unless named `_ns`.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct SizePoint {
    /// Region size in pages.
    pub pages: usize,
    /// The same in bytes.
    pub bytes: usize,
    /// Misses timed.
    pub reps: usize,
    /// `ucs_rcache_get` of a region not cached (registers: `mlock`) plus
    /// `ucs_rcache_region_put`.
    pub miss_us: f64,
    /// `ucs_rcache_region_invalidate` of the idle region (deregisters:
    /// `munlock`).
    pub invalidate_us: f64,
    /// Miss and invalidate together.
    pub miss_plus_invalidate_us: f64,
    /// Raw `mlock` of the region, in the same process, interleaved.
    pub raw_mlock_us: f64,
    /// Raw `munlock`.
    pub raw_munlock_us: f64,
    /// Raw `mlock` + `munlock`.
    pub raw_mlock_munlock_us: f64,
    /// What the cache adds to a miss: `miss_us - raw_mlock_us`.
    pub miss_overhead_us: f64,
    /// A hit (`get` of the cached region plus `put`), in nanoseconds.
    pub hit_ns: f64,
    /// Batches of hits timed.
    pub hit_batches: usize,
    /// Every check of the size passed (the program exits on a failed one).
    pub verified: bool,
}

/// What one run printed.
#[derive(Clone, Debug, Serialize)]
pub struct Run {
    /// The header.
    pub header: Header,
    /// One point per size, in the order of [`RunSpec::pages`].
    pub sizes: Vec<SizePoint>,
}

/// One line of the program's output.
#[derive(Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
enum Line {
    Header(Header),
    Size(SizePoint),
    Done {},
    Error { message: String },
}

/// Runs `binary` (built by [`build`]) with `spec` and reads what it prints.
/// Fails when it reports a failed check or an error, prints nothing for two
/// minutes, exits other than with success, or leaves a size out; the error
/// names the program and shows the end of its stderr.
pub fn run(binary: &Path, spec: &RunSpec) -> io::Result<Run> {
    let pages: Vec<String> = spec.pages.iter().map(usize::to_string).collect();
    let args = [
        format!("pages={}", pages.join(",")),
        format!("min_reps={}", spec.min_reps),
        format!("max_reps={}", spec.max_reps),
        format!("budget_ms={}", spec.budget_ms),
        format!("hit_batch={}", spec.hit_batch),
        format!("hit_batches={}", spec.hit_batches),
    ];
    let name = format!("{} {}", binary.display(), args.join(" "));
    let mut command = Command::new(binary);
    command.args(&args).stderr(Stdio::piped());
    let mut child = LineChild::spawn(name.clone(), command)
        .map_err(|e| io::Error::new(e.kind(), format!("{name}: cannot start: {e}")))?;
    let (mut header, mut sizes, mut done) = (None, Vec::new(), false);
    loop {
        let line = match child.next_or_end(SILENCE_TIMEOUT) {
            Ok(Some(line)) => line,
            Ok(None) => break,
            Err(e) => {
                let _ = child.wait_for_exit(Duration::ZERO);
                return Err(child.failure(&e.to_string(), STDERR_LINES_SHOWN));
            }
        };
        match serde_json::from_str(&line) {
            Ok(Line::Header(h)) => header = Some(h),
            Ok(Line::Size(point)) => sizes.push(point),
            Ok(Line::Done {}) => done = true,
            Ok(Line::Error { message }) => {
                let _ = child.wait_for_exit(SILENCE_TIMEOUT);
                return Err(child.failure(&message, STDERR_LINES_SHOWN));
            }
            Err(e) => {
                let _ = child.wait_for_exit(Duration::ZERO);
                return Err(child.failure(&format!("printed {line:?}: {e}"), STDERR_LINES_SHOWN));
            }
        }
    }
    match child.wait_for_exit(SILENCE_TIMEOUT) {
        Ok(status) if status.success() => {}
        Ok(status) => {
            return Err(child.failure(&format!("exited with {status}"), STDERR_LINES_SHOWN))
        }
        Err(e) => return Err(child.failure(&e.to_string(), STDERR_LINES_SHOWN)),
    }
    let header = header.ok_or_else(|| io::Error::other(format!("{name}: printed no header")))?;
    let printed: Vec<usize> = sizes.iter().map(|s| s.pages).collect();
    if !done || printed != spec.pages {
        return Err(io::Error::other(format!(
            "{name}: printed sizes {printed:?} (done: {done}), not {:?}",
            spec.pages
        )));
    }
    Ok(Run { header, sizes })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_lines_parse_by_kind() {
        let header: Line = serde_json::from_str(
            r#"{"kind":"header","ucx_api":"1.13","page_size":4096,"ucm_events":"vm_unmapped","pin":"mlock"}"#,
        )
        .unwrap();
        assert!(matches!(header, Line::Header(h) if h.ucx_api == "1.13" && h.page_size == 4096));
        let error: Line =
            serde_json::from_str(r#"{"kind":"error","message":"hit: a hit registered"}"#).unwrap();
        assert!(matches!(error, Line::Error { message } if message.contains("registered")));
        let done: Line =
            serde_json::from_str(r#"{"kind":"done","registrations":3,"deregistrations":3}"#)
                .unwrap();
        assert!(matches!(done, Line::Done {}));
    }
}
