//! The MPI baselines: the project's own C programs (`benches/mpi/*.c` and
//! the header they share, `benches/mpi/common.h`, compiled into this
//! crate's binaries as text), built with an MPI's own compiler wrapper at
//! run time and run on ranks of this host by that MPI's
//! own launcher ([`build`], [`launch`]). Each prints one JSON object per
//! line on rank 0.
//!
//! * [`Program::VectorPingPong`] (`vector_pingpong.c`), the baseline of
//!   `vector-transfer`: sends `MPI_Type_vector(m, n, z + 1, MPI_DOUBLE)` by
//!   ping-pong between two ranks, and the same bytes contiguously, checks
//!   every element that arrived; [`run`] reads it.
//! * [`Program::FmplCompare`] (`fmpl_compare.c`), the peer of the
//!   `messaging` crate's FMPL figures: ping-pong latency and bandwidth, the
//!   paper's table 2 (receives posted ahead), barrier, broadcast and
//!   allreduce, each checking its data; [`run_fmpl_compare`] reads it. Its
//!   header comment says what each figure measures.
//! * The peers of the `gasnet` benchmark (GASNet on TCA/PEACH2, section
//!   5), each checking its data and describing its figures in its header
//!   comment: [`Program::GasnetCompare`] (`gasnet_compare.c`: ping-pong
//!   latency and bandwidth, passive-target `MPI_Get` latency; read by
//!   [`run_gasnet_compare`]), [`Program::Halo`] (`halo.c`: the faces of an
//!   N^3 array of doubles as block, block-stride and stride transfers with
//!   `MPI_Type_vector` and `MPI_Type_create_subarray`; [`run_halo`]) and
//!   [`Program::Himeno`] (`himeno.c`: the Himeno stencil decomposed over i,
//!   iterations per second and the residual gosa; [`run_himeno`]).

use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::child::LineChild;

/// One of the project's MPI programs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Program {
    /// `benches/mpi/vector_pingpong.c`.
    VectorPingPong,
    /// `benches/mpi/fmpl_compare.c`.
    FmplCompare,
    /// `benches/mpi/gasnet_compare.c`.
    GasnetCompare,
    /// `benches/mpi/halo.c`.
    Halo,
    /// `benches/mpi/himeno.c`.
    Himeno,
}

impl Program {
    /// The file's name without `.c`.
    pub fn name(self) -> &'static str {
        match self {
            Program::VectorPingPong => "vector_pingpong",
            Program::FmplCompare => "fmpl_compare",
            Program::GasnetCompare => "gasnet_compare",
            Program::Halo => "halo",
            Program::Himeno => "himeno",
        }
    }

    /// The program's source.
    pub fn source(self) -> &'static str {
        match self {
            Program::VectorPingPong => include_str!("../mpi/vector_pingpong.c"),
            Program::FmplCompare => include_str!("../mpi/fmpl_compare.c"),
            Program::GasnetCompare => include_str!("../mpi/gasnet_compare.c"),
            Program::Halo => include_str!("../mpi/halo.c"),
            Program::Himeno => include_str!("../mpi/himeno.c"),
        }
    }
}

/// The header every program includes (`#include "common.h"`): its name and
/// its text.
const COMMON_HEADER: (&str, &str) = ("common.h", include_str!("../mpi/common.h"));

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

    /// The launcher's arguments for `ranks` ranks on this host (Open MPI
    /// refuses to run as root without being told, and to put more ranks on
    /// this host than it has slots).
    fn launch_args(self, ranks: usize) -> Vec<String> {
        let mut args = Vec::new();
        match self {
            Flavor::OpenMpi => {
                args.push("--oversubscribe");
                if crate::sys::is_root() {
                    args.push("--allow-run-as-root");
                }
                args.push("-np");
            }
            Flavor::Mpich => args.push("-n"),
        }
        let mut args: Vec<String> = args.into_iter().map(String::from).collect();
        args.push(ranks.to_string());
        args
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

/// Writes `program`'s source and the header the programs share into `dir`
/// and compiles it with `flavor`'s wrapper (`-O2`, `-I dir`); returns the
/// executable's path (`dir/NAME-FLAVOR`).
pub fn build(flavor: Flavor, program: Program, dir: &Path) -> io::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    // Each flavor its own copy of the source, so that builds of both into
    // one folder at the same time do not write one file together.
    let stem = format!("{}-{}", program.name(), flavor.name());
    let source = dir.join(format!("{stem}.c"));
    std::fs::write(&source, program.source())?;
    // The header is one file for every build into `dir`: written under a
    // name of this build's own and renamed over it, so that a compiler of
    // another build reading it at the same time sees a whole file.
    let (header_name, header_text) = COMMON_HEADER;
    let header_draft = dir.join(format!(".{stem}.{}.{header_name}", std::process::id()));
    std::fs::write(&header_draft, header_text)?;
    std::fs::rename(&header_draft, dir.join(header_name))?;
    let binary = dir.join(&stem);
    let output = Command::new(flavor.compiler())
        .args(["-O2", "-Wall", "-I"])
        .arg(dir)
        .arg("-o")
        .arg(&binary)
        .arg(&source)
        .arg("-lm")
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

/// How long a launched program may print nothing before it is stopped.
const SILENCE_TIMEOUT: Duration = Duration::from_secs(300);

/// How much of a failed launch's stderr an error shows (its last lines).
const STDERR_LINES_SHOWN: usize = 30;

/// Launches `binary` (built by [`build`] for `flavor`) on `ranks` ranks of
/// this host with `args`, and returns the lines it printed on stdout. Fails
/// when it printed nothing for `silence` (it is stopped then), or exited
/// other than with success; the error names the MPI, the command and the
/// end of its stderr.
pub fn launch(
    flavor: Flavor,
    binary: &Path,
    ranks: usize,
    args: &[String],
    silence: Duration,
) -> io::Result<Vec<String>> {
    let launch_args = flavor.launch_args(ranks);
    let mut command = Command::new(flavor.launcher());
    command
        .args(&launch_args)
        .arg(binary)
        .args(args)
        .stderr(Stdio::piped());
    let name = format!(
        "{}: {} {} {} {}",
        flavor.name(),
        flavor.launcher(),
        launch_args.join(" "),
        binary.display(),
        args.join(" ")
    );
    let mut child = LineChild::spawn(name.clone(), command)
        .map_err(|e| io::Error::new(e.kind(), format!("{name}: cannot start: {e}")))?;
    let mut lines = Vec::new();
    loop {
        match child.next_or_end(silence) {
            Ok(Some(line)) => lines.push(line),
            Ok(None) => break,
            Err(e) => {
                // Stopped (not waited for: it said nothing for too long)
                // before its stderr is read.
                let _ = child.wait_for_exit(Duration::ZERO);
                return Err(child.failure(&e.to_string(), STDERR_LINES_SHOWN));
            }
        }
    }
    match child.wait_for_exit(silence) {
        Ok(status) if status.success() => Ok(lines),
        Ok(status) => Err(child.failure(&format!("exited with {status}"), STDERR_LINES_SHOWN)),
        Err(e) => Err(child.failure(&e.to_string(), STDERR_LINES_SHOWN)),
    }
}

/// Launches `binary` (built by [`build`] for `flavor` from
/// [`Program::VectorPingPong`]) on two ranks of this host with `spec`, and
/// reads what it prints.
pub fn run(flavor: Flavor, binary: &Path, spec: &RunSpec) -> io::Result<Run> {
    let ms: Vec<String> = spec.ms.iter().map(usize::to_string).collect();
    let args = [
        format!("z={}", spec.z),
        format!("n={}", spec.n),
        format!("m={}", ms.join(",")),
        format!("iterations={}", spec.iterations),
        format!("warmup={}", spec.warmup),
        format!("huge={}", u8::from(spec.huge_pages)),
        format!("corrupt={}", u8::from(spec.corrupt_one_element)),
    ];
    let lines = launch(flavor, binary, 2, &args, SILENCE_TIMEOUT)?;
    let bad = |what: &str| io::Error::other(format!("{} vector_pingpong: {what}", flavor.name()));
    let parse_error = |line: &str, e: serde_json::Error| bad(&format!("printed {line:?}: {e}"));
    let (first, rest) = lines.split_first().ok_or_else(|| bad("printed nothing"))?;
    let header: Header = serde_json::from_str(first).map_err(|e| parse_error(first, e))?;
    let points = rest
        .iter()
        .map(|line| serde_json::from_str(line).map_err(|e| parse_error(line, e)))
        .collect::<io::Result<Vec<Point>>>()?;
    if points.len() != 2 * spec.ms.len() {
        return Err(bad(&format!(
            "printed {} points, not 2 per size of {:?}",
            points.len(),
            spec.ms
        )));
    }
    Ok(Run { header, points })
}

/// A mode of [`Program::FmplCompare`] (its first argument).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FmplMode {
    /// Blocking send/receive ping-pong between 2 ranks: one-way latency
    /// and bandwidth per size.
    PingPong,
    /// The paper's table 2 on 2 ranks: receives posted ahead, the gaps
    /// between posting them and between sends, and the send's latency.
    Preposted,
    /// `MPI_Barrier`.
    Barrier,
    /// `MPI_Bcast` from rank 0, per size.
    Bcast,
    /// `MPI_Allreduce` of doubles with `MPI_SUM`, per size.
    Allreduce,
}

impl FmplMode {
    /// Every mode.
    pub const ALL: [FmplMode; 5] = [
        FmplMode::PingPong,
        FmplMode::Preposted,
        FmplMode::Barrier,
        FmplMode::Bcast,
        FmplMode::Allreduce,
    ];

    /// The argument that selects it, also its figures' `"test"`.
    pub fn name(self) -> &'static str {
        match self {
            FmplMode::PingPong => "pingpong",
            FmplMode::Preposted => "preposted",
            FmplMode::Barrier => "barrier",
            FmplMode::Bcast => "bcast",
            FmplMode::Allreduce => "allreduce",
        }
    }

    /// Whether it runs on exactly two ranks (otherwise on any number).
    pub fn needs_two_ranks(self) -> bool {
        matches!(self, FmplMode::PingPong | FmplMode::Preposted)
    }
}

/// Launches `binary` (built by [`build`] for `flavor` from
/// [`Program::FmplCompare`]) on `ranks` ranks in `mode`, with `extra_args`
/// (`key=value`, see the program's header: `sizes=8,64`, `iterations=K`,
/// `warmup=W`, `posted=1,600`, `order=reverse|in_order|both`, `repeats=R`,
/// `corrupt=1`), and returns its figures: one JSON object each, whose
/// `"mpi"` is `flavor`'s name and `"test"` the mode's. A failed data check
/// makes the program exit with status 3, so it is an error here.
pub fn run_fmpl_compare(
    flavor: Flavor,
    binary: &Path,
    ranks: usize,
    mode: FmplMode,
    extra_args: &[&str],
) -> io::Result<Vec<Value>> {
    if mode.needs_two_ranks() && ranks != 2 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("fmpl_compare {} runs on 2 ranks, not {ranks}", mode.name()),
        ));
    }
    let args: Vec<String> = std::iter::once(mode.name())
        .chain(extra_args.iter().copied())
        .map(String::from)
        .collect();
    run_figures(flavor, binary, ranks, "fmpl_compare", mode.name(), &args)
}

/// Launches one of the programs that print one JSON figure per line on
/// rank 0 (each with `"mpi"` and `"test"`), on `ranks` ranks with `args`,
/// and returns the figures: an error unless each names `flavor` and
/// `test`, or when there is none. A failed data check makes the programs
/// exit with status 3, so it is an error here.
pub fn run_figures(
    flavor: Flavor,
    binary: &Path,
    ranks: usize,
    program: &str,
    test: &str,
    args: &[String],
) -> io::Result<Vec<Value>> {
    let lines = launch(flavor, binary, ranks, args, SILENCE_TIMEOUT)?;
    let bad =
        |what: String| io::Error::other(format!("{} {program} {test}: {what}", flavor.name()));
    let mut figures = Vec::with_capacity(lines.len());
    for line in &lines {
        let figure: Value =
            serde_json::from_str(line).map_err(|e| bad(format!("printed {line:?}: {e}")))?;
        let field = |key: &str| figure.get(key).and_then(Value::as_str);
        if field("mpi") != Some(flavor.name()) || field("test") != Some(test) {
            return Err(bad(format!(
                "printed {line:?}, not a {test} figure of {}",
                flavor.name()
            )));
        }
        figures.push(figure);
    }
    if figures.is_empty() {
        return Err(bad("printed no figure".into()));
    }
    Ok(figures)
}

/// A mode of [`Program::GasnetCompare`] (its first argument, also its
/// figures' `"test"`); both run on 2 ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GasnetMode {
    /// Blocking send/receive ping-pong: one-way latency (`latency_us`) and
    /// bandwidth per size, the peer of the long-AM ping-pong.
    PingPong,
    /// `MPI_Get` + `MPI_Win_flush` under a shared passive-target lock:
    /// latency per size, the peer of `get`.
    Get,
}

impl GasnetMode {
    /// Both modes.
    pub const ALL: [GasnetMode; 2] = [GasnetMode::PingPong, GasnetMode::Get];

    /// The argument that selects it.
    pub fn name(self) -> &'static str {
        match self {
            GasnetMode::PingPong => "pingpong",
            GasnetMode::Get => "get",
        }
    }
}

/// Launches `binary` (built by [`build`] for `flavor` from
/// [`Program::GasnetCompare`]) on 2 ranks in `mode` with `extra_args`
/// (`sizes=8,64`, `iterations=K`, `warmup=W`, `corrupt=1`), and returns
/// one figure per size.
pub fn run_gasnet_compare(
    flavor: Flavor,
    binary: &Path,
    mode: GasnetMode,
    extra_args: &[&str],
) -> io::Result<Vec<Value>> {
    let args: Vec<String> = std::iter::once(mode.name())
        .chain(extra_args.iter().copied())
        .map(String::from)
        .collect();
    run_figures(flavor, binary, 2, "gasnet_compare", mode.name(), &args)
}

/// Launches `binary` (built by [`build`] for `flavor` from
/// [`Program::Halo`]) on `ranks` ranks with `extra_args`
/// (`pattern=pingpong|exchange`, `sizes=4,8`, `faces=block,blockstride,
/// stride`, `types=vector,subarray`, `iterations=K`, `warmup=W`,
/// `corrupt=1`), and returns one figure per (N, face, datatype); each has
/// `"test": "halo"`.
pub fn run_halo(
    flavor: Flavor,
    binary: &Path,
    ranks: usize,
    extra_args: &[&str],
) -> io::Result<Vec<Value>> {
    let args: Vec<String> = extra_args.iter().copied().map(String::from).collect();
    run_figures(flavor, binary, ranks, "halo", "halo", &args)
}

/// Launches `binary` (built by [`build`] for `flavor` from
/// [`Program::Himeno`]) on `ranks` ranks with `extra_args` (`sizes=XS,S`,
/// `iterations=NN`, `warmup=W`), and returns one figure per size; each has
/// `"test": "himeno"`, `"iterations_per_s"` and `"gosa"`.
pub fn run_himeno(
    flavor: Flavor,
    binary: &Path,
    ranks: usize,
    extra_args: &[&str],
) -> io::Result<Vec<Value>> {
    let args: Vec<String> = extra_args.iter().copied().map(String::from).collect();
    run_figures(flavor, binary, ranks, "himeno", "himeno", &args)
}
