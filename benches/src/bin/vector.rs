//! `vector-transfer`: DIMMnet-2's submatrix transfer (paper sections 2.1
//! and 5), every figure beside its baselines from the same run.
//!
//! A [`ROWS`] x (z + 1) matrix of doubles (rows padded by one, as the
//! paper did) for z in 256, 1024 and 4096; its m x n submatrix (n = 1 and
//! 16, m from 64 to 4096) moves into another port's matrix of the same
//! shape. The ways of moving it (JSON series names in brackets):
//!
//! * (a) `vector_write`, (b) `vector_read`: one request naming both
//!   sides' patterns ([`Shape::pattern`] on either side; the driver's
//!   [`Vector`] write and read): port 0 writes its submatrix into port 1's
//!   matrix, or port 1 reads port 0's into its own (receiver-driven, as
//!   the paper's MPI used it). Cold and warm, as the host copies.
//! * (c) `pack_write_unpack`: the host packs the submatrix into a
//!   contiguous buffer, one RDMA WRITE moves it, the target's host unpacks
//!   it; with `contig_write` (the WRITE alone: the paper's "Contig") and
//!   `pack`, `unpack` and `contig_copy` on their own (figures 3 to 6: the
//!   paper's pack/unpack bandwidth against a copy of the same bytes
//!   contiguous). "cold": before each timed sample every cache line the
//!   step touches (both submatrices, the packed and landing bytes) is
//!   flushed and a 64 MiB buffer is streamed through, emptying this
//!   thread's TLB and private caches (the paper's dummy access; see
//!   [`Evictor`] for what stays warm);
//!   "warm": the same again right after an untimed one.
//! * (d) `one_pass_copy`: the same strided-to-strided move by one core in
//!   one pass, the physical limit.
//! * (e) `openmpi_vector`, `mpich_vector`: Open MPI and MPICH send the
//!   same `MPI_Type_vector` by ping-pong between two ranks of this host
//!   (`benches/mpi/vector_pingpong.c`, built with each MPI's `mpicc` into
//!   the target folder at run time, run by its own launcher);
//!   `openmpi_contig`, `mpich_contig`: the same bytes contiguous. An MPI
//!   that is not installed is reported "missing" (under CI=true the
//!   program fails instead).
//!
//! All of it once with 4 KiB pages and once with 2 MiB huge pages (the
//! driver's DMA arena is on huge pages when `vm.nr_hugepages` reserves
//! enough; the MPI program maps its matrices with `MAP_HUGETLB`); each pass
//! says which pages were really used. The 4 KiB pass opens its contexts
//! with `HugePages::Never`, so huge pages reserved on the machine do not
//! change it.
//!
//! Both ports are driven by this one process (two driver contexts: two
//! vhost-user frontends, each with its own memory, as `latency` does); the
//! emulated NIC is a child process. Every figure is checked: the target's
//! submatrix holds the source's values and nothing around it was written.
//! One JSON document goes to stdout; the exit status is non-zero if a check
//! failed or a measurement could not be made (a missing MPI or huge pages
//! outside CI are reported, not failed). Latency is the time of one whole
//! transfer (MPI: half a round trip), bandwidth the bytes over its median.
//! The targets (vector write at most 1.3 times the one-pass copy; Open MPI
//! at least 2 and 1.5 times the vector write at n = 1 and 16, z = 4096;
//! pack + write + unpack at least 3 times the vector write at n = 1) are
//! reported, not enforced.

use std::error::Error;
use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use pindown_benches::mpi::{self, Flavor, RunSpec};
use pindown_benches::output::OutputArgs;
use pindown_benches::rdma::{run_device_if_asked, run_one, Mode};
use pindown_benches::stats::Summary;
use pindown_benches::submatrix::{
    self, check_packed, copy_strided, pack, unpack, Evictor, Matrix, Shape, ELEMENT, ROWS,
};
use pindown_benches::sys::{LockBudget, Machine};
use pindown_driver::arena::HugePages;
use pindown_driver::verbs::opcode::{Nop, Vector, Write};
use pindown_driver::verbs::{
    CompletionQueue, Context, ContextConfig, MemoryRegion, QueuePair, RemoteWindow,
};
use pindown_driver::DmaBuffer;
use pindown_emu_device::testing::DeviceProcess;
use pindown_uapi::Access;
use serde::Serialize;

#[derive(Parser, Debug)]
#[command(
    name = "vector-transfer",
    version,
    about = "DIMMnet-2's submatrix transfer: vector write/read, host pack + RDMA write + \
             unpack, the one-pass copy, Open MPI and MPICH, with 4 KiB and 2 MiB pages \
             (JSON on stdout)"
)]
struct Args {
    /// A short run for CI (a few sizes and samples; well under a minute).
    #[arg(long)]
    quick: bool,
    /// How the device and driver wait (default: poll, as MPI does).
    #[arg(long, value_enum, default_value = "poll")]
    mode: Mode,
    /// Page sizes (default: both, 4 KiB first).
    #[arg(long, value_enum, value_delimiter = ',')]
    pages: Vec<Pages>,
    /// Matrix row lengths z (default: 256, 1024, 4096; --quick: 256, 4096).
    #[arg(long, value_delimiter = ',')]
    z: Vec<usize>,
    /// Submatrix row lengths n (default: 1, 16).
    #[arg(long, value_delimiter = ',')]
    n: Vec<usize>,
    /// Submatrix row counts m (default: 64 to 4096 doubling; --quick: 64,
    /// 4096).
    #[arg(long, value_delimiter = ',')]
    m: Vec<usize>,
    /// Timed samples of each warm figure (default 200, 20 with --quick).
    #[arg(long)]
    samples: Option<usize>,
    /// Timed samples of each cold figure (default 30, 5 with --quick).
    #[arg(long)]
    cold_samples: Option<usize>,
    /// Leave the MPI baselines out.
    #[arg(long)]
    no_mpi: bool,
    /// Print how many 2 MiB pages the huge-page pass of this plan needs
    /// reserved (`vm.nr_hugepages`) and exit.
    #[arg(long)]
    huge_pages_wanted: bool,
    #[command(flatten)]
    output: OutputArgs,
}

/// The page size a pass runs with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
enum Pages {
    /// 4 KiB pages.
    #[value(name = "4k")]
    #[serde(rename = "4k")]
    Small,
    /// 2 MiB huge pages.
    #[value(name = "huge")]
    #[serde(rename = "huge")]
    Huge,
}

/// Bytes of a huge page.
const HUGE_PAGE: usize = 2 << 20;
/// Arena bytes beyond the buffers (rings, alignment).
const ARENA_SLACK: usize = 16 << 20;
/// Bytes the evictor streams through before a cold sample (besides
/// flushing the sample's own lines): 16384 pages of 4 KiB, past this
/// thread's TLB, and many times its private caches.
const EVICTION_BYTES: usize = 64 << 20;
/// How long every port is left idle before a figure, so that the
/// device's polling threads (which sleep after a millisecond without work)
/// are asleep.
const PORTS_IDLE: std::time::Duration = std::time::Duration::from_millis(3);
/// Huge pages left for the MPI libraries' own use (UCX, under MPICH
/// here, takes huge pages for its buffers when there are free ones).
const MPI_HUGE_PAGE_MARGIN: usize = 64;
/// How much of everything one run does.
#[derive(Clone, Debug, Serialize)]
struct Plan {
    quick: bool,
    mode: Mode,
    pages: Vec<Pages>,
    z: Vec<usize>,
    n: Vec<usize>,
    m: Vec<usize>,
    warm_samples: usize,
    cold_samples: usize,
    mpi_iterations: usize,
    mpi_warmup: usize,
    last_level_cache_bytes: Option<usize>,
    eviction_bytes: usize,
    /// 2 MiB pages the huge-page pass needs reserved (`vm.nr_hugepages`).
    huge_pages_wanted: usize,
}

impl Plan {
    fn new(args: &Args) -> Result<Plan, Box<dyn Error>> {
        let quick = args.quick;
        let or = |chosen: &[usize], default: &[usize]| {
            if chosen.is_empty() {
                default.to_vec()
            } else {
                chosen.to_vec()
            }
        };
        let (z, m) = if quick {
            (vec![256, 4096], vec![64, 4096])
        } else {
            (
                vec![256, 1024, 4096],
                (6..=12).map(|p| 1usize << p).collect(),
            )
        };
        let llc = submatrix::last_level_cache_bytes();
        let plan = Plan {
            quick,
            mode: args.mode,
            pages: if args.pages.is_empty() {
                vec![Pages::Small, Pages::Huge]
            } else {
                args.pages.clone()
            },
            z: or(&args.z, &z),
            n: or(&args.n, &[1, 16]),
            m: or(&args.m, &m),
            warm_samples: args.samples.unwrap_or(if quick { 20 } else { 200 }).max(1),
            cold_samples: args
                .cold_samples
                .unwrap_or(if quick { 5 } else { 30 })
                .max(1),
            mpi_iterations: if quick { 20 } else { 200 },
            mpi_warmup: if quick { 3 } else { 20 },
            last_level_cache_bytes: llc,
            eviction_bytes: EVICTION_BYTES,
            huge_pages_wanted: 0,
        };
        for &z in &plan.z {
            for &n in &plan.n {
                for &m in &plan.m {
                    if Shape::new(z, m, n).is_none() {
                        return Err(format!(
                            "an {m} x {n} submatrix does not fit a {ROWS} x ({z} + 1) matrix"
                        )
                        .into());
                    }
                }
            }
        }
        Ok(Plan {
            huge_pages_wanted: plan.huge_pages_wanted(),
            ..plan
        })
    }

    fn max_z(&self) -> usize {
        self.z.iter().copied().max().unwrap_or(0)
    }

    fn max_m(&self) -> usize {
        self.m.iter().copied().max().unwrap_or(0)
    }

    /// Bytes of the largest packed submatrix.
    fn max_packed_bytes(&self) -> usize {
        self.max_m() * self.n.iter().copied().max().unwrap_or(0) * ELEMENT
    }

    /// Huge pages a huge-page pass needs reserved: the two arenas, or the
    /// MPI program's matrices and contiguous buffers on two ranks, whichever
    /// is more (they do not live at the same time).
    fn huge_pages_wanted(&self) -> usize {
        let arenas = 2 * self.arena_bytes() / HUGE_PAGE;
        let per_buffer = |bytes: usize| bytes.div_ceil(HUGE_PAGE);
        let contig = self.max_m() * self.n.iter().copied().max().unwrap_or(0) * ELEMENT + ELEMENT;
        let rank = 2 * per_buffer(Shape::matrix_bytes(self.max_z())) + 2 * per_buffer(contig);
        arenas.max(2 * rank) + MPI_HUGE_PAGE_MARGIN
    }

    /// Bytes of each port's DMA arena: its matrix, its packed buffer and
    /// the rings, in whole huge pages.
    fn arena_bytes(&self) -> usize {
        (Shape::matrix_bytes(self.max_z()) + self.max_packed_bytes() + ARENA_SLACK)
            .next_multiple_of(HUGE_PAGE)
    }
}

/// One point of a series: one submatrix size.
#[derive(Clone, Debug, Serialize)]
struct Point {
    m: usize,
    bytes: usize,
    /// Time of one whole transfer, in microseconds (MPI: half a round
    /// trip; its p99 and max are not reported, so they are null).
    us: Summary,
    /// Bytes over the median time, in 10^6 bytes per second (the paper's
    /// MByte/s).
    mb_per_s: f64,
    verified: bool,
}

/// How a series came out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
enum Status {
    Measured,
    /// What it needs is not there (reported, not failed, outside CI).
    Missing,
    /// It was tried and did not work.
    Failed,
}

/// A quantity against m for one method, cache state, z and n.
#[derive(Clone, Debug, Serialize)]
struct Series {
    method: &'static str,
    /// "cold" or "warm" (null for ping-pongs, which are warm by nature).
    cache: Option<&'static str>,
    z: usize,
    n: usize,
    status: Status,
    reason: Option<String>,
    points: Vec<Point>,
}

/// What a pass's MPI runs were.
#[derive(Debug, Serialize)]
struct MpiReport {
    mpi: Flavor,
    status: Status,
    reason: Option<String>,
    /// The library's own name and version.
    library: Option<String>,
    /// Whether every run had all its matrices on huge pages.
    huge_pages: Option<bool>,
}

/// One page size.
#[derive(Debug, Serialize)]
struct PassReport {
    pages: Pages,
    /// Whether both ports' DMA arenas really were on 2 MiB huge pages.
    arena_huge_pages: Option<bool>,
    /// Whether the driver figures of this pass were measured (missing:
    /// huge pages are not reserved; under CI=true that fails the run).
    status: Status,
    /// Why not.
    reason: Option<String>,
    series: Vec<Series>,
    mpi: Vec<MpiReport>,
}

impl PassReport {
    fn series_mut(
        &mut self,
        method: &'static str,
        cache: Option<&'static str>,
        z: usize,
        n: usize,
    ) -> &mut Series {
        let at = self
            .series
            .iter()
            .position(|s| s.method == method && s.cache == cache && s.z == z && s.n == n);
        let at = at.unwrap_or_else(|| {
            self.series.push(Series {
                method,
                cache,
                z,
                n,
                status: Status::Measured,
                reason: None,
                points: Vec::new(),
            });
            self.series.len() - 1
        });
        &mut self.series[at]
    }

    fn record(
        &mut self,
        method: &'static str,
        cache: Option<&'static str>,
        shape: Shape,
        point: Point,
    ) {
        self.series_mut(method, cache, shape.z, shape.n)
            .points
            .push(point);
    }

    fn fail(&mut self, method: &'static str, z: usize, n: usize, reason: String) {
        let series = self.series_mut(method, None, z, n);
        series.status = Status::Failed;
        series.reason = Some(reason);
    }

    fn find(&self, method: &str, cache: Option<&str>, z: usize, n: usize) -> Option<&Series> {
        self.series
            .iter()
            .find(|s| s.method == method && s.cache == cache && s.z == z && s.n == n)
    }
}

/// Which series make each of the paper's figures.
#[derive(Debug, Serialize)]
struct FigureIndex {
    figure: &'static str,
    what: &'static str,
    n: usize,
    /// `us` (latency) or `mb_per_s` (bandwidth) of the points.
    quantity: &'static str,
    /// Series as `method cache` (or `method` for the ping-pongs).
    series: &'static [&'static str],
}

const FIGURES: &[FigureIndex] = &[
    FigureIndex {
        figure: "3",
        what: "pack bandwidth against m, per z",
        n: 1,
        quantity: "mb_per_s",
        series: &[
            "pack cold",
            "pack warm",
            "contig_copy cold",
            "contig_copy warm",
        ],
    },
    FigureIndex {
        figure: "4",
        what: "pack bandwidth against m, per z",
        n: 16,
        quantity: "mb_per_s",
        series: &[
            "pack cold",
            "pack warm",
            "contig_copy cold",
            "contig_copy warm",
        ],
    },
    FigureIndex {
        figure: "5",
        what: "unpack bandwidth against m, per z",
        n: 1,
        quantity: "mb_per_s",
        series: &[
            "unpack cold",
            "unpack warm",
            "contig_copy cold",
            "contig_copy warm",
        ],
    },
    FigureIndex {
        figure: "6",
        what: "unpack bandwidth against m, per z",
        n: 16,
        quantity: "mb_per_s",
        series: &[
            "unpack cold",
            "unpack warm",
            "contig_copy cold",
            "contig_copy warm",
        ],
    },
    FigureIndex {
        figure: "10",
        what: "submatrix transfer latency against m, per z",
        n: 1,
        quantity: "us",
        series: TRANSFER_SERIES,
    },
    FigureIndex {
        figure: "11",
        what: "submatrix transfer latency against m, per z",
        n: 16,
        quantity: "us",
        series: TRANSFER_SERIES,
    },
    FigureIndex {
        figure: "12",
        what: "submatrix transfer bandwidth against m, per z",
        n: 1,
        quantity: "mb_per_s",
        series: TRANSFER_SERIES,
    },
    FigureIndex {
        figure: "13",
        what: "submatrix transfer bandwidth against m, per z",
        n: 16,
        quantity: "mb_per_s",
        series: TRANSFER_SERIES,
    },
];

const TRANSFER_SERIES: &[&str] = &[
    "vector_write cold",
    "vector_write warm",
    "vector_read cold",
    "vector_read warm",
    "contig_write warm",
    "pack_write_unpack cold",
    "pack_write_unpack warm",
    "one_pass_copy cold",
    "one_pass_copy warm",
    "openmpi_vector",
    "openmpi_contig",
    "mpich_vector",
    "mpich_contig",
];

/// A target and how this run stands against it (reported, not enforced).
#[derive(Debug, Serialize)]
struct Target {
    pages: Pages,
    what: String,
    /// "at most" or "at least".
    bound: &'static str,
    target: f64,
    /// Null when a series it needs is missing.
    measured: Option<f64>,
    met: Option<bool>,
    missing: Option<String>,
}

/// A ratio of two measured series at the largest m (informative).
#[derive(Debug, Serialize)]
struct Ratio {
    pages: Pages,
    what: String,
    z: usize,
    n: usize,
    m: usize,
    value: f64,
}

#[derive(Serialize)]
struct Report {
    program: &'static str,
    version: &'static str,
    /// Every measured point was checked and right.
    verified: bool,
    /// Every series that was tried worked (missing ones aside).
    complete: bool,
    plan: Plan,
    machine: Machine,
    /// How the two ports and the device run.
    setup: &'static str,
    figures: &'static [FigureIndex],
    passes: Vec<PassReport>,
    targets: Vec<Target>,
    ratios: Vec<Ratio>,
    elapsed_s: f64,
}

fn main() -> ExitCode {
    run_device_if_asked();
    let args = Args::parse();
    match run(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!(
                "vector-transfer: a check failed or a figure could not be made \
                 (\"verified\"/\"complete\": false)"
            );
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("vector-transfer: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<bool, Box<dyn Error>> {
    let started = Instant::now();
    let plan = Plan::new(args)?;
    if args.huge_pages_wanted {
        println!("{}", plan.huge_pages_wanted);
        return Ok(true);
    }
    let machine = Machine::collect(LockBudget::probe(2 * plan.arena_bytes() as u64));
    let exe = std::env::current_exe()?;
    let mpi_builds = if args.no_mpi {
        Vec::new()
    } else {
        build_mpi_programs(&exe)?
    };
    let bar = args.output.progress_bar(plan.pages.len() as u64 * 2);
    let mut passes = Vec::new();
    for &pages in &plan.pages {
        bar.set_message(format!("{pages:?} pages: driver"));
        let mut pass = PassReport {
            pages,
            arena_huge_pages: None,
            status: Status::Measured,
            reason: None,
            series: Vec::new(),
            mpi: Vec::new(),
        };
        let outcome = measure_driver(&exe, &plan, &mut pass);
        let (status, reason) = match outcome {
            Ok(None) => (Status::Measured, None),
            Ok(Some(missing)) => (Status::Missing, Some(missing)),
            Err(e) => (Status::Failed, Some(e.to_string())),
        };
        if let Some(reason) = &reason {
            if mpi::under_ci() {
                return Err(format!("{pages:?} pages: {reason}").into());
            }
            bar.suspend(|| eprintln!("vector-transfer: {pages:?} pages: {reason}"));
        }
        pass.status = status;
        pass.reason = reason;
        bar.inc(1);
        bar.set_message(format!("{pages:?} pages: MPI"));
        for build in &mpi_builds {
            measure_mpi(build, &plan, &mut pass);
        }
        bar.inc(1);
        passes.push(pass);
    }
    bar.finish_and_clear();
    let verified = passes
        .iter()
        .flat_map(|p| &p.series)
        .flat_map(|s| &s.points)
        .all(|p| p.verified);
    let complete = passes.iter().all(|p| {
        p.status != Status::Failed
            && p.series.iter().all(|s| s.status != Status::Failed)
            && p.mpi.iter().all(|m| m.status != Status::Failed)
    });
    let report = Report {
        program: "vector-transfer",
        version: env!("CARGO_PKG_VERSION"),
        verified,
        complete,
        targets: targets(&plan, &passes),
        ratios: ratios(&plan, &passes),
        plan,
        machine,
        setup: "one process drives both ports (two driver contexts, each its own vhost-user \
                frontend and memory); the emulated NIC is a child process; the MPI ranks are \
                two processes started by each MPI's launcher",
        figures: FIGURES,
        passes,
        elapsed_s: started.elapsed().as_secs_f64(),
    };
    if args.output.chatty() {
        summarize(&report);
    }
    args.output.emit_json(&report)?;
    Ok(verified && complete)
}

// ------------------------------------------------------------------ driver

/// Which port posts a request.
#[derive(Clone, Copy)]
enum Port {
    /// Port 0, whose matrix is the source.
    Source,
    /// Port 1, whose matrix is the target.
    Target,
}

/// The two ports' buffers and queue pairs.
struct Bench<'c> {
    /// Port 0's queue pair: writes.
    qp: QueuePair<'c>,
    cq: CompletionQueue<'c>,
    /// Port 1's queue pair: vector reads.
    reader_qp: QueuePair<'c>,
    reader_cq: CompletionQueue<'c>,
    /// A window over port 0's matrix (remote read).
    source_window: RemoteWindow,
    /// A window over port 1's matrix (remote write).
    target_window: RemoteWindow,
    /// Port 0's packed buffer, registered as `packed_region`.
    packed: &'c DmaBuffer,
    packed_region: MemoryRegion<'c>,
    /// Port 1's landing buffer for the packed bytes, behind `landing_window`.
    landing: &'c DmaBuffer,
    landing_window: RemoteWindow,
    evictor: Evictor,
    warm_samples: usize,
    cold_samples: usize,
}

/// The figures of the driver and the host copies in one pass: a device of
/// its own, port 0 the source, port 1 the target. `Ok(Some(why))`: the
/// pass's pages are not to be had, nothing was measured.
fn measure_driver(
    exe: &std::path::Path,
    plan: &Plan,
    pass: &mut PassReport,
) -> Result<Option<String>, Box<dyn Error>> {
    let device = DeviceProcess::start(exe, 2, plan.mode.device_args())?;
    let config = ContextConfig {
        huge_pages: match pass.pages {
            Pages::Small => HugePages::Never,
            Pages::Huge => HugePages::Try,
        },
        ..plan.mode.context_config(plan.arena_bytes())
    };
    let owner = Context::open(device.socket(1), config.clone())?;
    let initiator = Context::open(device.socket(0), config)?;
    let huge = owner.arena_uses_huge_pages() && initiator.arena_uses_huge_pages();
    pass.arena_huge_pages = Some(huge);
    match (pass.pages, huge) {
        (Pages::Huge, false) => {
            let pages = plan.huge_pages_wanted();
            return Ok(Some(format!(
                "the DMA arenas are not on huge pages: reserve at least {pages} (as root: \
                 sysctl vm.nr_hugepages={pages}); not measured"
            )));
        }
        (Pages::Small, true) => {
            return Err("the DMA arenas took huge pages in the 4 KiB pass; not measured".into())
        }
        _ => {}
    }
    let matrix_bytes = Shape::matrix_bytes(plan.max_z());
    let packed_bytes = plan.max_packed_bytes();
    let source = initiator.alloc(matrix_bytes, HUGE_PAGE)?;
    let packed = initiator.alloc(packed_bytes, HUGE_PAGE)?;
    let target = owner.alloc(matrix_bytes, HUGE_PAGE)?;
    let landing = owner.alloc(packed_bytes, HUGE_PAGE)?;
    let source_region = initiator.register_buffer(&source)?;
    let source_bound =
        initiator.bind_window(&source_region, 0, source.len() as u64, Access::REMOTE_READ)?;
    let target_region = owner.register_buffer(&target)?;
    let target_bound =
        owner.bind_window(&target_region, 0, target.len() as u64, Access::REMOTE_WRITE)?;
    let landing_region = owner.register_buffer(&landing)?;
    let landing_bound = owner.bind_window(
        &landing_region,
        0,
        landing.len() as u64,
        Access::REMOTE_WRITE,
    )?;
    let packed_region = initiator.register_buffer(&packed)?;
    let mut cq = initiator.create_completion_queue();
    let qp = initiator.create_queue_pair(&mut cq)?;
    let mut reader_cq = owner.create_completion_queue();
    let reader_qp = owner.create_queue_pair(&mut reader_cq)?;
    let mut bench = Bench {
        qp,
        cq,
        reader_qp,
        reader_cq,
        source_window: source_bound.remote(),
        target_window: target_bound.remote(),
        packed: &packed,
        packed_region,
        landing: &landing,
        landing_window: landing_bound.remote(),
        evictor: Evictor::new(plan.eviction_bytes),
        warm_samples: plan.warm_samples,
        cold_samples: plan.cold_samples,
    };
    for &z in &plan.z {
        // SAFETY: both buffers hold the largest matrix, are page aligned,
        // and only this thread touches them while no request is in flight.
        let (from, to) = unsafe {
            (
                Matrix::new(source.as_ptr(), z),
                Matrix::new(target.as_ptr(), z),
            )
        };
        from.fill_source();
        for &n in &plan.n {
            for &m in &plan.m {
                let shape = Shape::new(z, m, n).expect("checked by Plan::new");
                let footprint = from
                    .blocks(shape)
                    .chain(to.blocks(shape))
                    .chain([
                        (packed.as_ptr().cast_const(), shape.bytes()),
                        (landing.as_ptr().cast_const(), shape.bytes()),
                    ])
                    .collect();
                // SAFETY: the matrices, `packed` and `landing` are mapped
                // until after `bench` is dropped (below).
                unsafe { bench.evictor.set_footprint(footprint) };
                for cache in ["cold", "warm"] {
                    let cold = cache == "cold";
                    let point = bench.vector_write(&source_region, &to, shape, cold)?;
                    pass.record("vector_write", Some(cache), shape, point);
                    let point = bench.vector_read(&target_region, &to, shape, cold)?;
                    pass.record("vector_read", Some(cache), shape, point);
                    let host = [
                        ("pack", bench.pack(&from, shape, cold)),
                        ("unpack", bench.unpack(&from, &to, shape, cold)),
                        ("contig_copy", bench.contig_copy(&from, shape, cold)),
                        (
                            "one_pass_copy",
                            bench.one_pass_copy(&from, &to, shape, cold),
                        ),
                    ];
                    for (method, point) in host {
                        pass.record(method, Some(cache), shape, point);
                    }
                    let point = bench.pack_write_unpack(&from, &to, shape, cold)?;
                    pass.record("pack_write_unpack", Some(cache), shape, point);
                }
                let point = bench.contig_write(&from, shape)?;
                pass.record("contig_write", Some("warm"), shape, point);
            }
        }
    }
    drop(bench);
    drop((landing_bound, target_bound, source_bound));
    Ok(None)
}

fn point(shape: Shape, mut micros: Vec<f64>, verified: bool) -> Point {
    let us = Summary::of(&mut micros);
    Point {
        m: shape.m,
        bytes: shape.bytes(),
        mb_per_s: shape.bytes() as f64 / us.median,
        us,
        verified,
    }
}

impl<'c> Bench<'c> {
    /// Times `step` `samples` times in microseconds: cold, each after an
    /// eviction; warm, after one untimed step. `prepare` runs untimed
    /// before each step (resets what the step's check looks at); `port`
    /// is the port whose queue pair the step uses, if any.
    ///
    /// First every port is left idle for [`PORTS_IDLE`], so that their
    /// polling threads go to sleep and only the port the figure uses polls
    /// (two polling ports and this thread would be three busy threads on
    /// a 2-core machine).
    ///
    /// After an eviction (milliseconds of streaming) an untimed NOP goes
    /// through `port`'s queue pair: the device's polling threads sleep
    /// after a millisecond without work, and a cold figure is meant to
    /// count cold caches, not the device waking up. The NOP touches the
    /// rings only.
    fn time<E>(
        &mut self,
        cold: bool,
        port: Option<Port>,
        mut prepare: impl FnMut(),
        mut step: impl FnMut(&mut Self) -> Result<(), E>,
    ) -> Result<Vec<f64>, E> {
        std::thread::sleep(PORTS_IDLE);
        let samples = if cold {
            self.cold_samples
        } else {
            prepare();
            step(self)?;
            self.warm_samples
        };
        let mut micros = Vec::with_capacity(samples);
        for _ in 0..samples {
            prepare();
            if cold {
                self.evictor.evict();
                if let Some(port) = port {
                    self.wake(port);
                }
            }
            let start = Instant::now();
            step(self)?;
            micros.push(start.elapsed().as_secs_f64() * 1e6);
        }
        Ok(micros)
    }

    fn time_infallible(
        &mut self,
        cold: bool,
        prepare: impl FnMut(),
        mut step: impl FnMut(&mut Self),
    ) -> Vec<f64> {
        let result: Result<_, std::convert::Infallible> = self.time(cold, None, prepare, |b| {
            step(b);
            Ok(())
        });
        match result {
            Ok(micros) => micros,
        }
    }

    /// Runs one NOP through `port`'s queue pair. A device that has gone
    /// away shows up in the next timed request, so an error here is left
    /// to it.
    fn wake(&mut self, port: Port) {
        let (qp, cq) = self.queue_pair(port);
        let _ = run_one(qp, cq, Nop::new().build());
    }

    /// `port`'s queue pair and completion queue.
    fn queue_pair(&mut self, port: Port) -> (&mut QueuePair<'c>, &mut CompletionQueue<'c>) {
        match port {
            Port::Source => (&mut self.qp, &mut self.cq),
            Port::Target => (&mut self.reader_qp, &mut self.reader_cq),
        }
    }

    /// Port 0's pack of the submatrix into its packed buffer.
    fn pack(&mut self, from: &Matrix, shape: Shape, cold: bool) -> Point {
        let packed = self.packed.as_ptr();
        // SAFETY (here and below): the packed and landing buffers hold the
        // largest packed submatrix, do not overlap the matrices, and only
        // this thread touches them while no request is in flight.
        let clear = || unsafe { std::ptr::write_bytes(packed, 0, shape.bytes()) };
        let micros = self.time_infallible(cold, clear, |_| unsafe { pack(from, shape, packed) });
        // SAFETY: as above.
        let wrong = unsafe { check_packed(packed, shape) };
        point(shape, micros, wrong == 0)
    }

    /// Port 1's unpack of its landing buffer into its matrix.
    fn unpack(&mut self, from: &Matrix, to: &Matrix, shape: Shape, cold: bool) -> Point {
        let landing = self.landing.as_ptr();
        // SAFETY: as in `pack`.
        unsafe { pack(from, shape, landing) };
        let micros = self.time_infallible(
            cold,
            || to.reset_target(shape),
            |_| unsafe { unpack(landing, shape, to) },
        );
        point(shape, micros, to.check_target(shape) == 0)
    }

    /// The same bytes contiguous, from port 0's packed buffer to port 1's
    /// landing buffer by one core (the paper's "Contig" of figures 3-6).
    fn contig_copy(&mut self, from: &Matrix, shape: Shape, cold: bool) -> Point {
        let (packed, landing) = (self.packed.as_ptr(), self.landing.as_ptr());
        // SAFETY: as in `pack`.
        unsafe { pack(from, shape, packed) };
        let clear = || unsafe { std::ptr::write_bytes(landing, 0, shape.bytes()) };
        let micros = self.time_infallible(cold, clear, |_| unsafe {
            std::ptr::copy_nonoverlapping(packed, landing, shape.bytes())
        });
        // SAFETY: as in `pack`.
        let wrong = unsafe { check_packed(landing, shape) };
        point(shape, micros, wrong == 0)
    }

    /// (d) Port 0's submatrix into port 1's, strided to strided, in one
    /// pass by one core.
    fn one_pass_copy(&mut self, from: &Matrix, to: &Matrix, shape: Shape, cold: bool) -> Point {
        let micros = self.time_infallible(
            cold,
            || to.reset_target(shape),
            |_| copy_strided(from, to, shape),
        );
        point(shape, micros, to.check_target(shape) == 0)
    }

    /// One RDMA WRITE of the packed bytes into port 1's landing buffer.
    fn write_packed(&mut self, shape: Shape) -> Result<(), Box<dyn Error>> {
        let local = self.packed_region.local(0, shape.bytes() as u32)?;
        let entry = Write::new(local, self.landing_window.at(0)).build();
        run_one(&mut self.qp, &mut self.cq, entry)?;
        Ok(())
    }

    /// (a) Port 0's submatrix into port 1's matrix, one VECTOR_WRITE
    /// naming both patterns; `source_region` is port 0's matrix.
    fn vector_write(
        &mut self,
        source_region: &MemoryRegion<'_>,
        to: &Matrix,
        shape: Shape,
        cold: bool,
    ) -> Result<Point, Box<dyn Error>> {
        let pattern = shape.pattern();
        let whole = source_region.local(0, source_region.len() as u32)?;
        let write = Vector::write(whole, pattern.clone(), self.target_window.at(0), pattern)?;
        self.time_vector(&write, Port::Source, to, shape, cold)
    }

    /// (b) The same, receiver-driven: port 1 reads port 0's submatrix into
    /// its own matrix with one VECTOR_READ; `target_region` is port 1's
    /// matrix.
    fn vector_read(
        &mut self,
        target_region: &MemoryRegion<'_>,
        to: &Matrix,
        shape: Shape,
        cold: bool,
    ) -> Result<Point, Box<dyn Error>> {
        let pattern = shape.pattern();
        let whole = target_region.local(0, target_region.len() as u32)?;
        let read = Vector::read(whole, pattern.clone(), self.source_window.at(0), pattern)?;
        self.time_vector(&read, Port::Target, to, shape, cold)
    }

    /// Times `vector` posted on `port`'s queue pair, one at a time, and
    /// checks the submatrix of `to` it moved.
    fn time_vector(
        &mut self,
        vector: &Vector<'_>,
        port: Port,
        to: &Matrix,
        shape: Shape,
        cold: bool,
    ) -> Result<Point, Box<dyn Error>> {
        let micros = self.time(
            cold,
            Some(port),
            || to.reset_target(shape),
            |bench| {
                let (qp, cq) = bench.queue_pair(port);
                run_one(qp, cq, vector.build())?;
                Ok::<(), Box<dyn Error>>(())
            },
        )?;
        Ok(point(shape, micros, to.check_target(shape) == 0))
    }

    /// (c) Pack on port 0, one RDMA WRITE, unpack on port 1.
    fn pack_write_unpack(
        &mut self,
        from: &Matrix,
        to: &Matrix,
        shape: Shape,
        cold: bool,
    ) -> Result<Point, Box<dyn Error>> {
        let (packed, landing) = (self.packed.as_ptr(), self.landing.as_ptr());
        let micros = self.time(
            cold,
            Some(Port::Source),
            || to.reset_target(shape),
            |bench| {
                // SAFETY: as in `pack`; the write has completed before the
                // unpack reads the landing buffer.
                unsafe { pack(from, shape, packed) };
                bench.write_packed(shape)?;
                unsafe { unpack(landing, shape, to) };
                Ok::<(), Box<dyn Error>>(())
            },
        )?;
        Ok(point(shape, micros, to.check_target(shape) == 0))
    }

    /// The RDMA WRITE of (c) alone: the packed bytes into port 1's landing
    /// buffer (the paper's "Contig" of figures 10-13), warm.
    fn contig_write(&mut self, from: &Matrix, shape: Shape) -> Result<Point, Box<dyn Error>> {
        let (packed, landing) = (self.packed.as_ptr(), self.landing.as_ptr());
        // SAFETY: as in `pack`.
        unsafe { pack(from, shape, packed) };
        let clear = || unsafe { std::ptr::write_bytes(landing, 0, shape.bytes()) };
        let micros = self.time(false, Some(Port::Source), clear, |bench| {
            bench.write_packed(shape)
        })?;
        // SAFETY: as in `pack`; the last write has completed.
        let wrong = unsafe { check_packed(landing, shape) };
        Ok(point(shape, micros, wrong == 0))
    }
}

// --------------------------------------------------------------------- MPI

/// An MPI and its build of the program, or why there is none.
struct MpiBuild {
    flavor: Flavor,
    binary: Result<std::path::PathBuf, (Status, String)>,
}

/// Builds the MPI program with each MPI's wrapper into `mpi/` beside this
/// executable (in the target folder). A missing MPI fails under CI=true.
fn build_mpi_programs(exe: &std::path::Path) -> Result<Vec<MpiBuild>, Box<dyn Error>> {
    let dir = exe
        .parent()
        .ok_or("the executable has no folder")?
        .join("mpi");
    let mut builds = Vec::new();
    for flavor in Flavor::ALL {
        let binary = match flavor.missing() {
            Some(reason) if mpi::under_ci() => {
                return Err(
                    format!("{}: {reason} (CI=true: .ci/run installs it)", flavor.name()).into(),
                )
            }
            Some(reason) => Err((Status::Missing, reason)),
            None => mpi::build(flavor, mpi::Program::VectorPingPong, &dir)
                .map_err(|e| (Status::Failed, e.to_string())),
        };
        builds.push(MpiBuild { flavor, binary });
    }
    Ok(builds)
}

/// The ping-pongs of one MPI in one pass, one launch per (z, n).
fn measure_mpi(build: &MpiBuild, plan: &Plan, pass: &mut PassReport) {
    let name = build.flavor.name();
    let (vector, contig): (&'static str, &'static str) = match build.flavor {
        Flavor::OpenMpi => ("openmpi_vector", "openmpi_contig"),
        Flavor::Mpich => ("mpich_vector", "mpich_contig"),
    };
    let mut report = MpiReport {
        mpi: build.flavor,
        status: Status::Measured,
        reason: None,
        library: None,
        huge_pages: None,
    };
    let binary = match &build.binary {
        Ok(binary) => binary,
        Err((status, reason)) => {
            report.status = *status;
            report.reason = Some(reason.clone());
            for &z in &plan.z {
                for &n in &plan.n {
                    for method in [vector, contig] {
                        let series = pass.series_mut(method, None, z, n);
                        series.status = *status;
                        series.reason = Some(reason.clone());
                    }
                }
            }
            pass.mpi.push(report);
            return;
        }
    };
    for &z in &plan.z {
        for &n in &plan.n {
            let spec = RunSpec {
                z,
                n,
                ms: plan.m.clone(),
                iterations: plan.mpi_iterations,
                warmup: plan.mpi_warmup,
                huge_pages: pass.pages == Pages::Huge,
                corrupt_one_element: false,
            };
            match mpi::run(build.flavor, binary, &spec) {
                Ok(run) => {
                    report.library = Some(run.header.library.clone());
                    report.huge_pages =
                        Some(report.huge_pages.unwrap_or(true) && run.header.huge_pages);
                    for p in run.points {
                        let method = if p.kind == "vector" { vector } else { contig };
                        let us = Summary {
                            samples: p.iterations,
                            median: p.one_way_us_median,
                            p99: f64::NAN,
                            mean: p.one_way_us_mean,
                            min: p.one_way_us_min,
                            max: f64::NAN,
                        };
                        let shape = Shape::new(z, p.m, n).expect("the sizes asked for");
                        let point = Point {
                            m: p.m,
                            bytes: p.bytes as usize,
                            us,
                            // Computed here from the median, as for every
                            // other series (the program prints rounded
                            // figures).
                            mb_per_s: shape.bytes() as f64 / p.one_way_us_median,
                            verified: p.verified && p.bytes as usize == shape.bytes(),
                        };
                        pass.record(method, None, shape, point);
                    }
                }
                Err(e) => {
                    let reason = format!("{name}, z = {z}, n = {n}: {e}");
                    eprintln!("vector-transfer: {reason}");
                    report.status = Status::Failed;
                    report.reason = Some(reason.clone());
                    pass.fail(vector, z, n, reason.clone());
                    pass.fail(contig, z, n, reason);
                }
            }
        }
    }
    pass.mpi.push(report);
}

// ----------------------------------------------------------------- results

/// The median time of `method cache` at (z, n, m), or why there is none.
fn median_us(
    pass: &PassReport,
    method: &str,
    cache: Option<&str>,
    z: usize,
    n: usize,
    m: usize,
) -> Result<f64, String> {
    let label = match cache {
        Some(cache) => format!("{method} {cache}"),
        None => method.to_string(),
    };
    let series = pass
        .find(method, cache, z, n)
        .ok_or_else(|| format!("{label}: not measured in this run (z = {z}, n = {n})"))?;
    if series.status != Status::Measured {
        return Err(format!(
            "{label}: {}",
            series.reason.as_deref().unwrap_or("not measured")
        ));
    }
    series
        .points
        .iter()
        .find(|p| p.m == m)
        .map(|p| p.us.median)
        .ok_or_else(|| format!("{label}: no point at m = {m}"))
}

/// A series by method and cache state.
type SeriesKey = (&'static str, Option<&'static str>);

fn targets(plan: &Plan, passes: &[PassReport]) -> Vec<Target> {
    let m = plan.max_m();
    let mut targets = Vec::new();
    for pass in passes {
        let mut add =
            |what: String, bound: &'static str, target: f64, ratio: Result<f64, String>| {
                let (measured, met, missing) = match ratio {
                    Ok(value) => {
                        let met = if bound == "at most" {
                            value <= target
                        } else {
                            value >= target
                        };
                        (Some(value), Some(met), None)
                    }
                    Err(why) => (None, None, Some(why)),
                };
                targets.push(Target {
                    pages: pass.pages,
                    what,
                    bound,
                    target,
                    measured,
                    met,
                    missing,
                });
            };
        let ratio = |a: (&str, Option<&str>), b: (&str, Option<&str>), z, n| {
            Ok(median_us(pass, a.0, a.1, z, n, m)? / median_us(pass, b.0, b.1, z, n, m)?)
        };
        for &z in &plan.z {
            for &n in &plan.n {
                add(
                    format!("vector_write time over one_pass_copy warm, z = {z}, n = {n}, m = {m}"),
                    "at most",
                    1.3,
                    ratio(
                        ("vector_write", Some("warm")),
                        ("one_pass_copy", Some("warm")),
                        z,
                        n,
                    ),
                );
            }
        }
        for (n, target) in [(1, 2.0), (16, 1.5)] {
            add(
                format!("openmpi_vector time over vector_write warm, z = 4096, n = {n}, m = {m}"),
                "at least",
                target,
                ratio(
                    ("openmpi_vector", None),
                    ("vector_write", Some("warm")),
                    4096,
                    n,
                ),
            );
        }
        add(
            format!("pack_write_unpack cold time over vector_write cold, z = 4096, n = 1, m = {m}"),
            "at least",
            3.0,
            ratio(
                ("pack_write_unpack", Some("cold")),
                ("vector_write", Some("cold")),
                4096,
                1,
            ),
        );
    }
    targets
}

fn ratios(plan: &Plan, passes: &[PassReport]) -> Vec<Ratio> {
    let m = plan.max_m();
    let pairs: [(&str, SeriesKey, SeriesKey); 6] = [
        (
            "pack_write_unpack cold time over one_pass_copy warm",
            ("pack_write_unpack", Some("cold")),
            ("one_pass_copy", Some("warm")),
        ),
        (
            "pack_write_unpack cold time over contig_write warm",
            ("pack_write_unpack", Some("cold")),
            ("contig_write", Some("warm")),
        ),
        (
            "unpack cold time over contig_copy cold (the paper: bandwidth 9-14 % of it)",
            ("unpack", Some("cold")),
            ("contig_copy", Some("cold")),
        ),
        (
            "openmpi_vector time over pack_write_unpack cold",
            ("openmpi_vector", None),
            ("pack_write_unpack", Some("cold")),
        ),
        (
            "mpich_vector time over pack_write_unpack cold",
            ("mpich_vector", None),
            ("pack_write_unpack", Some("cold")),
        ),
        (
            "openmpi_vector time over openmpi_contig",
            ("openmpi_vector", None),
            ("openmpi_contig", None),
        ),
    ];
    let mut out = Vec::new();
    for pass in passes {
        for &z in &plan.z {
            for &n in &plan.n {
                for (what, a, b) in &pairs {
                    let value = median_us(pass, a.0, a.1, z, n, m)
                        .and_then(|x| Ok(x / median_us(pass, b.0, b.1, z, n, m)?));
                    if let Ok(value) = value {
                        out.push(Ratio {
                            pages: pass.pages,
                            what: what.to_string(),
                            z,
                            n,
                            m,
                            value,
                        });
                    }
                }
            }
        }
    }
    out
}

fn summarize(report: &Report) {
    for pass in &report.passes {
        if let Some(reason) = &pass.reason {
            eprintln!("{:?} pages: {:?}: {reason}", pass.pages, pass.status);
        }
        for series in &pass.series {
            let cache = series.cache.unwrap_or("");
            match series.status {
                Status::Measured => {
                    for p in &series.points {
                        eprintln!(
                            "{:?} {} {cache} z={} n={} m={}: {:.1} us, {:.1} MB/s{}",
                            pass.pages,
                            series.method,
                            series.z,
                            series.n,
                            p.m,
                            p.us.median,
                            p.mb_per_s,
                            if p.verified { "" } else { " (WRONG BYTES)" }
                        );
                    }
                }
                _ => eprintln!(
                    "{:?} {} {cache} z={} n={}: {:?}: {}",
                    pass.pages,
                    series.method,
                    series.z,
                    series.n,
                    series.status,
                    series.reason.as_deref().unwrap_or("")
                ),
            }
        }
    }
    for t in &report.targets {
        match (t.measured, t.met) {
            (Some(v), Some(met)) => eprintln!(
                "target {:?} {}: {v:.2} ({} {}: {})",
                t.pages,
                t.what,
                t.bound,
                t.target,
                if met { "met" } else { "MISSED" }
            ),
            _ => eprintln!(
                "target {:?} {}: missing ({})",
                t.pages,
                t.what,
                t.missing.as_deref().unwrap_or("")
            ),
        }
    }
}
