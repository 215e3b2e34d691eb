//! `latency`: how long one request takes, post to completion seen, and how
//! fast streams of writes go, each beside its baseline from the same run.
//!
//! The emulated NIC runs as a child (this executable again); this process
//! opens two ports: port 0 posts, port 1 owns a window over its buffer. For
//! each mode (event-driven, busy-poll) and each memory kind (the DMA arena;
//! a heap `Vec`):
//!
//! * writes and reads of 8 B, 64 B, 256 B, 1 KiB and 4 KiB and 8-byte
//!   fetch-adds, one at a time, each timed from post to completion seen
//!   (median and p99), and each median as a multiple of a cache-line round
//!   trip between two threads on the two cores, measured before the mode's
//!   device starts;
//! * streams of writes of 4 KiB to 16 MiB ([`IN_FLIGHT`] in flight) in GB/s,
//!   as a fraction of one thread's `memcpy` of the same size, timed before
//!   any device runs and again between the rounds.
//!
//! Every figure is checked: the bytes written arrive, the bytes read are
//! the window's, every fetch-add returns the sum of the ones before it. One
//! JSON document goes to stdout; the exit status is non-zero if a check
//! failed. The targets (busy-poll 8-byte write and fetch-add median at most
//! 1.0 us with p99 at most twice the median, event-driven at most 1.3 us,
//! 1 MiB and 16 MiB streams at least 0.9 of `memcpy`) are reported, not
//! enforced.

use std::error::Error;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use pindown_benches::memory_kind::{MemoryKind, TestBuffer};
use pindown_benches::output::OutputArgs;
use pindown_benches::ping_pong;
use pindown_benches::rdma::{
    fill_pattern, first_difference, gb_per_s, pattern, run_device_if_asked, run_many, run_one,
    targets, Mode, IN_FLIGHT,
};
use pindown_benches::replay::Memcpy;
use pindown_benches::stats::Summary;
use pindown_benches::sys::{LockBudget, Machine};
use pindown_driver::verbs::opcode::{FetchAdd, Read, Write};
use pindown_driver::verbs::{CompletionQueue, Context, Entry, QueuePair, RemoteWindow};
use pindown_emu_device::testing::DeviceProcess;
use pindown_uapi::queue::MAX_INLINE;
use pindown_uapi::Access;
use serde::Serialize;

#[derive(Parser, Debug)]
#[command(
    name = "latency",
    version,
    about = "RDMA latency (write, read, fetch-add) against a cache-line ping-pong, and \
             write bandwidth against memcpy, through the emulated NIC (JSON on stdout)"
)]
struct Args {
    /// A short run (a few seconds).
    #[arg(long)]
    quick: bool,
    /// Only this mode (default: both, event-driven first).
    #[arg(long, value_enum)]
    mode: Option<Mode>,
    /// Memory kinds to measure (default: arena).
    #[arg(long, value_enum, value_delimiter = ',')]
    memory: Vec<MemoryKind>,
    /// Operations whose latency is measured (default: all).
    #[arg(long, value_enum, value_delimiter = ',')]
    ops: Vec<Op>,
    /// Transfer sizes of the latency figures, in bytes (default: 8, 64,
    /// 256, 1024, 4096; fetch-adds are always 8 bytes).
    #[arg(long, value_delimiter = ',')]
    sizes: Vec<u32>,
    /// Timed requests per latency figure (default: 20000, 3000 with --quick).
    #[arg(long)]
    samples: Option<usize>,
    /// Leave the bandwidth figures out.
    #[arg(long)]
    no_bandwidth: bool,
    #[command(flatten)]
    output: OutputArgs,
}

/// The operations of the latency figures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Op {
    /// WRITE: the device reads the source (DMA).
    Write,
    /// WRITE sent inline: the bytes travel in the send queue (sizes up to
    /// `pindown_uapi::queue::MAX_INLINE`).
    WriteInline,
    /// READ.
    Read,
    /// 8-byte FETCH_ADD.
    FetchAdd,
}

/// Transfer sizes of the latency figures.
const LATENCY_BYTES: [u32; 5] = [8, 64, 256, 1024, 4096];
/// The largest size `--sizes` takes (reads start at three times the size
/// into the 16 MiB read region).
const MAX_LATENCY_BYTES: u32 = 1 << 20;
/// Transfer sizes of the bandwidth figures.
const BANDWIDTH_BYTES: [u32; 4] = [4 << 10, 64 << 10, 1 << 20, 16 << 20];
/// The window: a read region (the pattern of [`READ_SEED`]), a write
/// region and the fetch-add word.
const READ_BASE: usize = 0;
const WRITE_BASE: usize = 16 << 20;
const COUNTER_OFFSET: usize = 32 << 20;
const WINDOW_BYTES: usize = (32 << 20) + 4096;
/// The initiator's source (pattern) and sink.
const SOURCE_BYTES: usize = 16 << 20;
/// DMA arenas of both ports: their buffers plus rings.
const ARENA_BYTES: usize = 48 << 20;
const READ_SEED: u64 = 0x1a7e_0001;
const WRITE_SEED: u64 = 0x1a7e_1000;

/// How much of everything one run does.
#[derive(Clone, Debug, Serialize)]
struct Plan {
    quick: bool,
    #[serde(skip)]
    ops: Vec<Op>,
    latency_bytes: Vec<u32>,
    bandwidth_bytes: Vec<u32>,
    latency_samples: usize,
    latency_warmup: usize,
    ping_pong_samples: usize,
    /// Bytes written per timed bandwidth round (at least four writes).
    bandwidth_bytes_per_round: u64,
    bandwidth_rounds: usize,
    in_flight: usize,
}

impl Plan {
    fn new(args: &Args) -> Plan {
        let quick = args.quick;
        let (samples, bandwidth_bytes_per_round, bandwidth_rounds) = if quick {
            (3_000, 64 << 20, 5)
        } else {
            (20_000, 256 << 20, 11)
        };
        let latency_samples = args.samples.unwrap_or(samples).max(1);
        let or_all = |chosen: &[Op]| {
            if chosen.is_empty() {
                vec![Op::Write, Op::WriteInline, Op::Read, Op::FetchAdd]
            } else {
                chosen.to_vec()
            }
        };
        Plan {
            quick,
            ops: or_all(&args.ops),
            latency_bytes: if args.sizes.is_empty() {
                LATENCY_BYTES.to_vec()
            } else {
                args.sizes.clone()
            },
            bandwidth_bytes: if args.no_bandwidth {
                Vec::new()
            } else {
                BANDWIDTH_BYTES.to_vec()
            },
            latency_samples,
            latency_warmup: latency_samples / 10,
            ping_pong_samples: latency_samples,
            bandwidth_bytes_per_round,
            bandwidth_rounds,
            in_flight: IN_FLIGHT,
        }
    }

    fn writes_per_round(&self, bytes: u32) -> u64 {
        (self.bandwidth_bytes_per_round / u64::from(bytes)).max(4)
    }
}

/// One latency figure.
#[derive(Debug, Serialize)]
struct LatencyFigure {
    op: &'static str,
    bytes: u32,
    /// Post to completion seen, in microseconds.
    us: Summary,
    /// The cache-line round trip measured just before (device and driver
    /// idle), in microseconds: the two cores' distance may change between
    /// figures on a virtual machine.
    ping_pong_us: Summary,
    /// Median over the median cache-line round trip.
    median_over_ping_pong: f64,
    /// p99 over median.
    p99_over_median: f64,
    verified: bool,
}

/// One bandwidth figure.
#[derive(Debug, Serialize)]
struct BandwidthFigure {
    bytes: u32,
    writes_per_round: u64,
    gb_per_s: Summary,
    /// One thread's `memcpy` of the same size between the rounds.
    memcpy_gb_per_s: Summary,
    over_memcpy: f64,
    /// Over the `memcpy` timed before any device ran.
    over_idle_memcpy: f64,
    verified: bool,
}

/// The figures of one memory kind in one mode.
#[derive(Debug, Serialize)]
struct KindReport {
    memory: MemoryKind,
    /// Whether the two contexts' DMA arenas are on 2 MiB huge pages (they
    /// are when `vm.nr_hugepages` reserves enough; heap memory is on the
    /// pages its process had, rehomed into 4 KiB shared memory).
    arena_huge_pages: Option<bool>,
    /// Why the kind could not be measured.
    error: Option<String>,
    latency: Vec<LatencyFigure>,
    bandwidth: Vec<BandwidthFigure>,
}

#[derive(Debug, Serialize)]
struct ModeReport {
    mode: Mode,
    device_args: Vec<&'static str>,
    /// Cache-line round trip between the two cores, in microseconds,
    /// measured just before the mode's device started (each latency figure
    /// has its own, measured just before it).
    ping_pong_us: Summary,
    kinds: Vec<KindReport>,
}

#[derive(Debug, Serialize)]
struct IdleMemcpy {
    bytes: u32,
    gb_per_s: Summary,
}

/// A target and whether this run met it (reported, not enforced).
#[derive(Debug, Serialize)]
struct Target {
    what: String,
    target: f64,
    measured: f64,
    met: bool,
}

#[derive(Serialize)]
struct Report {
    program: &'static str,
    version: &'static str,
    verified: bool,
    plan: Plan,
    machine: Machine,
    memcpy_idle: Vec<IdleMemcpy>,
    modes: Vec<ModeReport>,
    targets: Vec<Target>,
    elapsed_s: f64,
}

fn main() -> ExitCode {
    run_device_if_asked();
    let args = Args::parse();
    match run(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("latency: not every check passed (\"verified\": false)");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("latency: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<bool, Box<dyn Error>> {
    let started = Instant::now();
    let plan = Plan::new(args);
    if let Some(bad) = plan
        .latency_bytes
        .iter()
        .find(|&&b| b == 0 || b > MAX_LATENCY_BYTES)
    {
        return Err(format!("--sizes: {bad} is not between 1 and {MAX_LATENCY_BYTES}").into());
    }
    let modes = args.mode.map_or(Mode::ALL.to_vec(), |m| vec![m]);
    let kinds = if args.memory.is_empty() {
        vec![MemoryKind::Arena]
    } else {
        args.memory.clone()
    };
    let machine = Machine::collect(LockBudget::probe(2 * ARENA_BYTES as u64));
    let bar = args
        .output
        .progress_bar((modes.len() * (1 + kinds.len())) as u64);
    bar.set_message("memcpy");
    let memcpy_idle = plan
        .bandwidth_bytes
        .iter()
        .map(|&bytes| {
            let mut memcpy = Memcpy::new(bytes as usize)?;
            let copies = plan.writes_per_round(bytes);
            Ok(IdleMemcpy {
                bytes,
                gb_per_s: time_memcpy(&mut memcpy, copies, plan.bandwidth_rounds),
            })
        })
        .collect::<Result<Vec<_>, Box<dyn Error>>>()?;
    let exe = std::env::current_exe()?;
    let mut reports = Vec::new();
    for mode in modes {
        bar.set_message(format!("{mode}: ping-pong"));
        let ping_pong_us =
            ping_pong::round_trips(plan.ping_pong_samples / 10, plan.ping_pong_samples);
        bar.inc(1);
        let device = DeviceProcess::start(&exe, 2, mode.device_args())?;
        let mut kind_reports = Vec::new();
        for &kind in &kinds {
            bar.set_message(format!("{mode}: {kind}"));
            let report = measure_kind(&device, mode, kind, &plan, &memcpy_idle);
            if let Some(e) = &report.error {
                bar.suspend(|| eprintln!("latency: {mode}, {kind}: {e}"));
            }
            kind_reports.push(report);
            bar.inc(1);
        }
        drop(device);
        reports.push(ModeReport {
            mode,
            device_args: mode.device_args().to_vec(),
            ping_pong_us,
            kinds: kind_reports,
        });
    }
    bar.finish_and_clear();
    let verified = reports.iter().all(|m| {
        m.kinds.iter().all(|k| {
            k.error.is_none()
                && k.latency.iter().all(|f| f.verified)
                && k.bandwidth.iter().all(|f| f.verified)
        })
    });
    let report = Report {
        program: "latency",
        version: env!("CARGO_PKG_VERSION"),
        verified,
        targets: targets(&reports),
        plan,
        machine,
        memcpy_idle,
        modes: reports,
        elapsed_s: started.elapsed().as_secs_f64(),
    };
    if args.output.chatty() {
        summarize(&report);
    }
    args.output.emit_json(&report)?;
    Ok(verified)
}

/// `rounds` rounds of `copies` copies, after one untimed round, in GB/s.
fn time_memcpy(memcpy: &mut Memcpy, copies: u64, rounds: usize) -> Summary {
    memcpy.time(copies);
    let total = memcpy.len() as f64 * copies as f64;
    let mut rates: Vec<f64> = (0..rounds)
        .map(|_| gb_per_s(total, memcpy.time(copies).as_secs_f64()))
        .collect();
    Summary::of(&mut rates)
}

fn targets(modes: &[ModeReport]) -> Vec<Target> {
    let mut targets = Vec::new();
    for mode in modes {
        for kind in &mode.kinds {
            let label = |what: &str| format!("{}, {}: {what}", mode.mode, kind.memory);
            for figure in kind
                .latency
                .iter()
                .filter(|f| f.bytes == 8 && f.op != "read")
            {
                let limit = match mode.mode {
                    Mode::Poll => targets::POLL_MEDIAN_US,
                    Mode::Event => targets::EVENT_MEDIAN_US,
                };
                targets.push(Target {
                    what: label(&format!("{} 8 B median us", figure.op)),
                    target: limit,
                    measured: figure.us.median,
                    met: figure.us.median <= limit,
                });
                if mode.mode == Mode::Poll {
                    targets.push(Target {
                        what: label(&format!("{} 8 B p99 over median", figure.op)),
                        target: targets::POLL_P99_OVER_MEDIAN,
                        measured: figure.p99_over_median,
                        met: figure.p99_over_median <= targets::POLL_P99_OVER_MEDIAN,
                    });
                }
            }
            for figure in kind.bandwidth.iter().filter(|f| f.bytes >= 1 << 20) {
                targets.push(Target {
                    what: label(&format!("{} B writes over idle memcpy", figure.bytes)),
                    target: targets::BANDWIDTH_OVER_MEMCPY,
                    measured: figure.over_idle_memcpy,
                    met: figure.over_idle_memcpy >= targets::BANDWIDTH_OVER_MEMCPY,
                });
            }
        }
    }
    targets
}

fn summarize(report: &Report) {
    for mode in &report.modes {
        eprintln!(
            "{}: cache-line round trip {:.3} us",
            mode.mode, mode.ping_pong_us.median
        );
        for kind in &mode.kinds {
            for f in &kind.latency {
                eprintln!(
                    "{} {} {:>12} {:>5} B: median {:.3} us ({:.1}x a {:.3} us round trip), p99 {:.3} us",
                    mode.mode,
                    kind.memory,
                    f.op,
                    f.bytes,
                    f.us.median,
                    f.median_over_ping_pong,
                    f.ping_pong_us.median,
                    f.us.p99
                );
            }
            for f in &kind.bandwidth {
                eprintln!(
                    "{} {} write stream {:>8} B: {:.1} GB/s ({:.2} of memcpy)",
                    mode.mode, kind.memory, f.bytes, f.gb_per_s.median, f.over_idle_memcpy
                );
            }
        }
    }
    for t in &report.targets {
        let verdict = if t.met { "met" } else { "MISSED" };
        eprintln!(
            "target {}: {:.3} against {} ({verdict})",
            t.what, t.measured, t.target
        );
    }
}

/// The figures of one memory kind: two ports of `device`, port 0 posting,
/// port 1 owning a window over its buffer.
fn measure_kind(
    device: &DeviceProcess,
    mode: Mode,
    kind: MemoryKind,
    plan: &Plan,
    idle: &[IdleMemcpy],
) -> KindReport {
    let mut report = KindReport {
        memory: kind,
        arena_huge_pages: None,
        error: None,
        latency: Vec::new(),
        bandwidth: Vec::new(),
    };
    let result = (|| -> Result<(), Box<dyn Error>> {
        let owner = Context::open(device.socket(1), mode.context_config(ARENA_BYTES))?;
        let initiator = Context::open(device.socket(0), mode.context_config(ARENA_BYTES))?;
        report.arena_huge_pages =
            Some(owner.arena_uses_huge_pages() && initiator.arena_uses_huge_pages());
        let target = TestBuffer::new(&owner, kind, WINDOW_BYTES)?;
        target.write_at(READ_BASE, &pattern(READ_SEED, 0, 16 << 20));
        let target_region = target.register_part(&owner, 0, target.len())?;
        let access = Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC;
        let bound = owner.bind_window(&target_region, 0, target.len() as u64, access)?;
        let source = TestBuffer::new(&initiator, kind, SOURCE_BYTES)?;
        let mut bytes = vec![0u8; SOURCE_BYTES];
        fill_pattern(WRITE_SEED, 0, &mut bytes);
        source.write_at(0, &bytes);
        let sink = TestBuffer::new(&initiator, kind, SOURCE_BYTES)?;
        let mut cq = initiator.create_completion_queue();
        let qp = initiator.create_queue_pair(&mut cq)?;
        let mut bench = Bench {
            initiator: &initiator,
            qp,
            cq,
            window: bound.remote(),
            target: &target,
            source: &source,
            sink: &sink,
        };
        for &bytes in &plan.latency_bytes {
            if plan.ops.contains(&Op::Write) {
                report
                    .latency
                    .push(bench.write_latency(plan, bytes, false)?);
            }
            if plan.ops.contains(&Op::WriteInline) && bytes <= MAX_INLINE {
                report.latency.push(bench.write_latency(plan, bytes, true)?);
            }
            if plan.ops.contains(&Op::Read) {
                report.latency.push(bench.read_latency(plan, bytes)?);
            }
        }
        if plan.ops.contains(&Op::FetchAdd) {
            report.latency.push(bench.fetch_add_latency(plan)?);
        }
        for &bytes in &plan.bandwidth_bytes {
            let idle = idle
                .iter()
                .find(|m| m.bytes == bytes)
                .map_or(f64::NAN, |m| m.gb_per_s.median);
            report.bandwidth.push(bench.bandwidth(plan, bytes, idle)?);
        }
        Ok(())
    })();
    if let Err(e) = result {
        report.error = Some(format!("{kind} memory in {mode} mode: {e}"));
    }
    report
}

/// A timed latency figure before it is checked.
struct Timed {
    us: Summary,
    ping_pong: Summary,
    /// Every completion carried the value expected.
    values_ok: bool,
}

/// Port 0's queue pair and the buffers of both ports.
struct Bench<'a, 'c> {
    initiator: &'c Context,
    qp: QueuePair<'c>,
    cq: CompletionQueue<'c>,
    window: RemoteWindow,
    target: &'a TestBuffer,
    source: &'a TestBuffer,
    sink: &'a TestBuffer,
}

impl Bench<'_, '_> {
    /// Times the request `make(i)` builds (through `region`, the local
    /// memory it names), one at a time: `plan.latency_warmup` untimed, then
    /// `plan.latency_samples` timed, in microseconds; `check(i, value)`
    /// checks the value of completion `i`. First measures the cache-line
    /// round trip, once the device and the driver are idle.
    fn time<'r>(
        &mut self,
        plan: &Plan,
        mut make: impl FnMut(u64) -> Result<Entry<'r>, Box<dyn Error>>,
        mut check: impl FnMut(u64, u64) -> bool,
    ) -> Result<Timed, Box<dyn Error>> {
        let ping_pong = quiet_ping_pong(plan);
        let mut samples = Vec::with_capacity(plan.latency_samples);
        let mut ok = true;
        for i in 0..(plan.latency_warmup + plan.latency_samples) as u64 {
            let entry = make(i)?.user_data(i);
            let start = Instant::now();
            let done = run_one(&mut self.qp, &mut self.cq, entry)?;
            let elapsed = start.elapsed();
            ok &= check(i, done.value);
            if i >= plan.latency_warmup as u64 {
                samples.push(micros(elapsed));
            }
        }
        Ok(Timed {
            us: Summary::of(&mut samples),
            ping_pong,
            values_ok: ok,
        })
    }

    fn figure(op: &'static str, bytes: u32, timed: Timed, ok: bool) -> LatencyFigure {
        LatencyFigure {
            op,
            bytes,
            median_over_ping_pong: timed.us.median / timed.ping_pong.median,
            p99_over_median: timed.us.p99 / timed.us.median,
            us: timed.us,
            ping_pong_us: timed.ping_pong,
            verified: ok && timed.values_ok,
        }
    }

    /// Writes from the source (inline: the bytes travel in the send
    /// queue; only arena memory is sent inline).
    fn write_latency(
        &mut self,
        plan: &Plan,
        bytes: u32,
        inline: bool,
    ) -> Result<LatencyFigure, Box<dyn Error>> {
        self.target.write_at(WRITE_BASE, &vec![0u8; bytes as usize]);
        let initiator = self.initiator;
        let region = self.source.register_part(initiator, 0, bytes as usize)?;
        let at = self.window.at(WRITE_BASE as u64);
        let build = |_| {
            let entry = Write::new(region.local(0, bytes)?, at).build();
            Ok(if inline { entry.inline() } else { entry })
        };
        let timed = self.time(plan, build, |_, _| true)?;
        let mut landed = vec![0u8; bytes as usize];
        self.target.read_at(WRITE_BASE, &mut landed);
        let ok = first_difference(WRITE_SEED, 0, &landed).is_none();
        let op = if inline { "write_inline" } else { "write" };
        Ok(Self::figure(op, bytes, timed, ok))
    }

    fn read_latency(&mut self, plan: &Plan, bytes: u32) -> Result<LatencyFigure, Box<dyn Error>> {
        self.sink.write_at(0, &vec![0u8; bytes as usize]);
        let initiator = self.initiator;
        let region = self.sink.register_part(initiator, 0, bytes as usize)?;
        // A different part of the read region for each size.
        let offset = READ_BASE as u64 + u64::from(bytes) * 3;
        let at = self.window.at(offset);
        let build = |_| Ok(Read::new(region.local(0, bytes)?, at).build());
        let timed = self.time(plan, build, |_, _| true)?;
        let mut landed = vec![0u8; bytes as usize];
        self.sink.read_at(0, &mut landed);
        let ok = first_difference(READ_SEED, offset, &landed).is_none();
        Ok(Self::figure("read", bytes, timed, ok))
    }

    fn fetch_add_latency(&mut self, plan: &Plan) -> Result<LatencyFigure, Box<dyn Error>> {
        let mut word = [0u8; 8];
        self.target.read_at(COUNTER_OFFSET, &mut word);
        let start = u64::from_le_bytes(word);
        let at = self.window.at(COUNTER_OFFSET as u64);
        let timed = self.time(
            plan,
            |_| Ok(FetchAdd::new(at, 1).build()),
            |i, old| old == start + i,
        )?;
        self.target.read_at(COUNTER_OFFSET, &mut word);
        let count = (plan.latency_warmup + plan.latency_samples) as u64;
        let ok = u64::from_le_bytes(word) == start + count;
        Ok(Self::figure("fetch_add", 8, timed, ok))
    }

    fn bandwidth(
        &mut self,
        plan: &Plan,
        bytes: u32,
        idle: f64,
    ) -> Result<BandwidthFigure, Box<dyn Error>> {
        let writes = plan.writes_per_round(bytes);
        self.target.write_at(WRITE_BASE, &vec![0u8; bytes as usize]);
        let initiator = self.initiator;
        let region = self.source.register_part(initiator, 0, bytes as usize)?;
        let at = self.window.at(WRITE_BASE as u64);
        let (qp, cq) = (&mut self.qp, &mut self.cq);
        let mut stream = || -> Result<Duration, Box<dyn Error>> {
            let start = Instant::now();
            run_many(
                qp,
                cq,
                writes,
                plan.in_flight,
                |_| Ok(&region),
                |region| Ok(Write::new(region.local(0, bytes)?, at).build()),
            )?;
            Ok(start.elapsed())
        };
        let mut memcpy = Memcpy::new(bytes as usize)?;
        stream()?;
        memcpy.time(writes);
        let total = f64::from(bytes) * writes as f64;
        let (mut rdma, mut copy) = (Vec::new(), Vec::new());
        for _ in 0..plan.bandwidth_rounds {
            rdma.push(gb_per_s(total, stream()?.as_secs_f64()));
            copy.push(gb_per_s(total, memcpy.time(writes).as_secs_f64()));
        }
        let (rdma, copy) = (Summary::of(&mut rdma), Summary::of(&mut copy));
        let mut landed = vec![0u8; bytes as usize];
        self.target.read_at(WRITE_BASE, &mut landed);
        let verified = first_difference(WRITE_SEED, 0, &landed).is_none();
        Ok(BandwidthFigure {
            bytes,
            writes_per_round: writes,
            over_memcpy: rdma.median / copy.median,
            over_idle_memcpy: rdma.median / idle,
            gb_per_s: rdma,
            memcpy_gb_per_s: copy,
            verified,
        })
    }
}

/// The cache-line round trip once the device's threads have gone to
/// sleep (a port that polls sleeps after a millisecond without work).
fn quiet_ping_pong(plan: &Plan) -> Summary {
    std::thread::sleep(QUIET);
    let samples = plan.ping_pong_samples;
    ping_pong::round_trips(samples / 10, samples)
}

/// How long the device and the driver are left idle before a ping-pong.
const QUIET: Duration = Duration::from_millis(5);

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}
