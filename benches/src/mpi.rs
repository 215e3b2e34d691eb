//! The MPI baseline of the submatrix transfer: the project's own C program
//! (`benches/mpi/vector_pingpong.c`, compiled into this crate's binaries
//! as text) built with an MPI's own compiler wrapper at run time and run
//! on two ranks of this host by that MPI's own launcher. The program sends
//! `MPI_Type_vector(m, n, z + 1, MPI_DOUBLE)` by ping-pong, and the same
//! bytes contiguously, checks every element that arrived, and prints one
//! JSON object per line, which [`run`] reads.

use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::child::LineChild;

/// The program's source.
pub const SOURCE: &str = include_str!("../mpi/vector_pingpong.c");

/// An MPI implementation as Debian installs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Flavor {
    /// Open MPI (`openmpi-bin`, `libopenmpi-dev`).
    OpenMpi,
    /// MPICH (`mpich`, `libmpich-dev`).
    Mpich,
}

impl Flavor {
    /// Both, Open MPI first.
    pub const ALL: [Flavor; 2] = [Flavor::OpenMpi, Flavor::Mpich];

    /// `"openmpi"` or `"mpich"`.
    pub fn name(self) -> &'static str {
        match self {
            Flavor::OpenMpi => "openmpi",
            Flavor::Mpich => "mpich",
        }
    }

    /// The compiler wrapper.
    pub fn compiler(self) -> &'static str {
        match self {
            Flavor::OpenMpi => "mpicc.openmpi",
            Flavor::Mpich => "mpicc.mpich",
        }
    }

    /// The launcher.
    pub fn launcher(self) -> &'static str {
        match self {
            Flavor::OpenMpi => "mpirun.openmpi",
            Flavor::Mpich => "mpiexec.mpich",
        }
    }

    /// The Debian packages that provide both.
    pub fn packages(self) -> &'static str {
        match self {
            Flavor::OpenMpi => "openmpi-bin libopenmpi-dev",
            Flavor::Mpich => "mpich libmpich-dev",
        }
    }

    /// The launcher's arguments for two ranks on this host (Open MPI
    /// refuses to run as root without being told, and to put two ranks on
    /// fewer than two slots).
    fn launch_args(self) -> Vec<&'static str> {
        match self {
            Flavor::OpenMpi => {
                let mut args = vec!["--oversubscribe"];
                if crate::sys::is_root() {
                    args.push("--allow-run-as-root");
                }
                args.extend(["-np", "2"]);
                args
            }
            Flavor::Mpich => vec!["-n", "2"],
        }
    }

    /// Why this MPI cannot be used: the first of its tools not on `PATH`.
    pub fn missing(self) -> Option<String> {
        [self.compiler(), self.launcher()]
            .into_iter()
            .find(|tool| find_in_path(tool).is_none())
            .map(|tool| {
                format!(
                    "{tool} is not on PATH (Debian packages {})",
                    self.packages()
                )
            })
    }
}

/// Whether CI=true (a missing MPI then fails instead of being reported).
pub fn under_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

/// The first `PATH` entry holding an executable file `name`.
pub fn find_in_path(name: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| {
            p.metadata()
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// Writes [`SOURCE`] into `dir` and compiles it with `flavor`'s wrapper
/// (`-O2`); returns the executable's path.
pub fn build(flavor: Flavor, dir: &Path) -> io::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let source = dir.join("vector_pingpong.c");
    std::fs::write(&source, SOURCE)?;
    let binary = dir.join(format!("vector_pingpong-{}", flavor.name()));
    let output = Command::new(flavor.compiler())
        .args(["-O2", "-Wall", "-o"])
        .arg(&binary)
        .arg(&source)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", flavor.compiler())))?;
    if !output.status.success() {
        return Err(io::Error::other(format!(
            "{} failed ({}): {}",
            flavor.compiler(),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        )));
    }
    Ok(binary)
}

/// One run's parameters: the matrix's `z`, the submatrix's `n` and its
/// row counts `ms`, round trips timed per size and untimed before them,
/// and whether the matrices should be on 2 MiB huge pages.
#[derive(Clone, Debug, Serialize)]
pub struct RunSpec {
    /// Elements of a matrix row before padding.
    pub z: usize,
    /// Elements of each submatrix row.
    pub n: usize,
    /// Submatrix rows, one measurement each.
    pub ms: Vec<usize>,
    /// Timed round trips per measurement.
    pub iterations: usize,
    /// Untimed round trips before them.
    pub warmup: usize,
    /// Ask for huge pages (the program falls back to normal pages and says
    /// so).
    pub huge_pages: bool,
    /// Rank 1 sends one wrong element (for tests of the check).
    pub corrupt_one_element: bool,
}

/// The program's first line.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct Header {
    /// `MPI_Get_library_version`, its first line.
    pub library: String,
    /// Whether every matrix of both ranks is on huge pages.
    pub huge_pages: bool,
}

/// One measurement: `kind` "vector" (the derived datatype) or "contig"
/// (the same bytes as `m * n` doubles).
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct Point {
    /// "vector" or "contig".
    pub kind: String,
    /// Elements of a matrix row before padding.
    pub z: usize,
    /// Elements of each submatrix row.
    pub n: usize,
    /// Submatrix rows.
    pub m: usize,
    /// Bytes moved each way.
    pub bytes: f64,
    /// Timed round trips.
    pub iterations: usize,
    /// Half the median round trip, in microseconds.
    pub one_way_us_median: f64,
    /// Half the fastest round trip.
    pub one_way_us_min: f64,
    /// Half the mean round trip.
    pub one_way_us_mean: f64,
    /// Bytes over the median one-way time, in 10^6 bytes per second.
    pub mb_per_s: f64,
    /// Wrong elements both ranks found after the first exchange.
    pub mismatches: u64,
    /// No wrong element.
    pub verified: bool,
}

/// What one launch printed.
#[derive(Clone, Debug, Serialize)]
pub struct Run {
    /// The header.
    pub header: Header,
    /// A vector and a contig point per size, in the order of `ms`.
    pub points: Vec<Point>,
}

/// How long one launch may take.
const RUN_TIMEOUT: Duration = Duration::from_secs(300);

/// Launches `binary` (built by [`build`] for `flavor`) on two ranks of this
/// host with `spec`, and reads what it prints.
pub fn run(flavor: Flavor, binary: &Path, spec: &RunSpec) -> io::Result<Run> {
    let ms: Vec<String> = spec.ms.iter().map(usize::to_string).collect();
    let mut command = Command::new(flavor.launcher());
    command
        .args(flavor.launch_args())
        .arg(binary)
        .arg(format!("z={}", spec.z))
        .arg(format!("n={}", spec.n))
        .arg(format!("m={}", ms.join(",")))
        .arg(format!("iterations={}", spec.iterations))
        .arg(format!("warmup={}", spec.warmup))
        .arg(format!("huge={}", u8::from(spec.huge_pages)))
        .arg(format!("corrupt={}", u8::from(spec.corrupt_one_element)));
    let name = format!("{} {}", flavor.launcher(), binary.display());
    let mut child = LineChild::spawn(name.clone(), command)?;
    let bad = |line: &str, e: serde_json::Error| {
        io::Error::other(format!("{name} printed {line:?}: {e}"))
    };
    let line = child.next(RUN_TIMEOUT)?;
    let header: Header = serde_json::from_str(&line).map_err(|e| bad(&line, e))?;
    let mut points = Vec::with_capacity(2 * spec.ms.len());
    while points.len() < 2 * spec.ms.len() {
        let line = child.next(RUN_TIMEOUT)?;
        points.push(serde_json::from_str(&line).map_err(|e| bad(&line, e))?);
    }
    let status = child.finish(RUN_TIMEOUT)?;
    if !status.success() {
        return Err(io::Error::other(format!("{name} exited with {status}")));
    }
    Ok(Run { header, points })
}
