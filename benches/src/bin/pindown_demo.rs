//! `pindown-demo`: the stack end to end. Starts the emulated NIC (this
//! executable again, with `--device`) on a temporary socket directory with
//! two ports, then two ranks, each its own driver process (this executable
//! with `--rank N`), as an MPI job would run them.
//!
//! Rank 1 registers a buffer, binds a window over it and hands the window's
//! text (`node:port:key:len`) to rank 0 through this process. Rank 0 then:
//!
//! * writes and reads transfers of 8 B to 16 MiB at odd offsets; rank 1
//!   checks every written byte, rank 0 every byte read;
//! * runs fetch-adds, compare-swaps and swaps on a word of the window and
//!   checks every returned value and the word itself;
//! * times 8-byte writes, post to completion seen (median and p99);
//! * times streams of 1 MiB and 16 MiB writes (GB/s) next to a `memcpy` of
//!   the same size in the same process;
//! * registers the local memory of every transfer anew, as a messaging
//!   library does, and reports the pin-down cache's hits and misses.
//!
//! All of it runs twice: event-driven (device and driver sleep when idle)
//! and busy-polling (device `--poll`, driver spin `Duration::MAX`), each on
//! a device of its own. One JSON document goes to stdout; progress and a
//! summary go to stderr when it is a terminal. The exit status is non-zero
//! if any check failed.

use std::error::Error;
use std::io::{BufRead, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use clap::Parser;
use indicatif::ProgressBar;
use pindown_driver::verbs::opcode::{CompareSwap, FetchAdd, Read, Swap, Write};
use pindown_driver::verbs::{CompletionQueue, Context, QueuePair, RemoteWindow};
use pindown_driver::DmaBuffer;
use pindown_uapi::Access;
use serde::{Deserialize, Serialize};

use pindown_benches::child::{DeviceChild, LineChild};
use pindown_benches::output::OutputArgs;
use pindown_benches::rdma::{
    die_with_parent, first_difference, gb_per_s, pattern, run_device, run_many, run_one,
    targets as rdma_targets, Mode, IN_FLIGHT,
};
use pindown_benches::replay::Memcpy;
use pindown_benches::stats::Summary;
use pindown_benches::sys::{LockBudget, Machine};

/// Command line. `--device` (first) and `--rank` are how this program
/// starts its own children.
#[derive(Parser, Debug)]
#[command(
    name = "pindown-demo",
    version,
    about = "Writes, reads and atomics between two ranks through the emulated NIC, \
             with latency, bandwidth and pin-cache figures (JSON on stdout)"
)]
struct Args {
    /// A short run, for CI (well under 15 s).
    #[arg(long)]
    quick: bool,
    /// Only this mode (default: both, event first).
    #[arg(long, value_enum)]
    mode: Option<Mode>,
    /// Run as rank N (0 initiates, 1 owns the window) on --socket.
    #[arg(long, hide = true, requires_all = ["socket", "mode"])]
    rank: Option<u8>,
    /// The device socket of a rank.
    #[arg(long, hide = true)]
    socket: Option<PathBuf>,
    /// Print the whole report as JSON on stdout instead of the summary.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    output: OutputArgs,
}

/// Bytes of each of the target's regions, and of the initiator's source and
/// sink: the largest transfer plus room for odd offsets.
const REGION_BYTES: usize = (16 << 20) + (64 << 10);
/// The target's read region (filled with the pattern of [`READ_SEED`]).
const READ_BASE: u64 = 0;
/// The target's write region (zeroed at start).
const WRITE_BASE: u64 = 17 << 20;
/// The word the atomics work on (zero at start).
const COUNTER_OFFSET: u64 = 34 << 20;
/// The target's buffer, all of it in one window.
const TARGET_BYTES: usize = (34 << 20) + 4096;
/// DMA arenas: the target's buffer, or the initiator's source and sink, plus
/// the rings.
const TARGET_ARENA: usize = 40 << 20;
const INITIATOR_ARENA: usize = 40 << 20;
/// Pattern seeds.
const READ_SEED: u64 = 0x5eed_0001;
const WRITE_SEED: u64 = 0x5eed_1000;
/// Added by each fetch-add.
const ADD: u64 = 3;
/// Ports of the device: rank N uses port N.
const PORTS: usize = 2;
/// The most a rank may stay silent.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(60);
/// Phases rank 0 announces (the progress bar's steps per mode).
const PHASES: u64 = 5;

/// A bandwidth stream: `writes_per_round` writes of `bytes` each.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
struct Stream {
    bytes: u32,
    writes_per_round: u64,
}

/// What one run does.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Plan {
    quick: bool,
    /// Sizes of the verified writes and reads.
    transfer_bytes: Vec<u32>,
    fetch_adds: u64,
    latency_writes: usize,
    latency_warmup: usize,
    /// Sizes of the bandwidth streams and writes per timed round.
    bandwidth: Vec<Stream>,
    bandwidth_rounds: usize,
    /// Writes in flight in a bandwidth stream.
    in_flight: usize,
}

impl Plan {
    fn new(quick: bool) -> Plan {
        let (fetch_adds, latency_writes, [mib, mib16], bandwidth_rounds) = if quick {
            (2_000, 5_000, [128, 12], 5)
        } else {
            (10_000, 20_000, [512, 48], 11)
        };
        let bandwidth = vec![
            Stream {
                bytes: 1 << 20,
                writes_per_round: mib,
            },
            Stream {
                bytes: 16 << 20,
                writes_per_round: mib16,
            },
        ];
        Plan {
            quick,
            transfer_bytes: vec![8, 100, 4096, 65_537, 1 << 20, 16 << 20],
            fetch_adds,
            latency_writes,
            latency_warmup: latency_writes / 10,
            bandwidth,
            bandwidth_rounds,
            in_flight: IN_FLIGHT,
        }
    }
}

/// One verified transfer.
#[derive(Debug, Serialize, Deserialize)]
struct TransferReport {
    op: String,
    bytes: u32,
    remote_offset: u64,
    local_offset: u64,
    /// Post to completion seen.
    us: f64,
    verified: bool,
}

/// The atomics and what they returned.
#[derive(Debug, Serialize, Deserialize)]
struct AtomicsReport {
    fetch_adds: u64,
    add: u64,
    /// Every fetch-add returned the sum of the ones before it.
    fetch_add_values_ok: bool,
    /// The word as the target read it after the fetch-adds.
    counter_after_adds: Option<u64>,
    compare_swap_old: u64,
    compare_swap_refused_old: u64,
    swap_old: u64,
    /// The word as the target read it at the end (11 expected).
    counter_final: Option<u64>,
    ok: bool,
    /// Post to completion seen, in microseconds.
    fetch_add_latency_us: Summary,
}

/// A stream of writes of one size next to `memcpy` of that size.
#[derive(Debug, Serialize, Deserialize)]
struct BandwidthReport {
    bytes: u32,
    writes_per_round: u64,
    rounds: usize,
    in_flight: usize,
    /// GB/s of each round of writes.
    gb_per_s: Summary,
    /// GB/s of rank 0's `memcpy` of the same size, in rounds taken between
    /// the rounds of writes (so under the same conditions, device threads
    /// included).
    memcpy_gb_per_s: Summary,
    /// Median write GB/s over median `memcpy` GB/s of the same process.
    over_memcpy: f64,
    /// Median write GB/s over the median of the `memcpy` timed before any
    /// device ran (`memcpy_idle`): the single-thread `memcpy` bandwidth.
    #[serde(default)]
    over_idle_memcpy: Option<f64>,
    /// The last write's bytes were checked by the target.
    verified: bool,
}

/// `memcpy` alone, timed by this process before any device runs.
#[derive(Debug, Serialize)]
struct MemcpyReport {
    bytes: u32,
    copies_per_round: u64,
    rounds: usize,
    gb_per_s: Summary,
}

/// The initiator's pin-down cache at the end of the run.
#[derive(Debug, Serialize, Deserialize)]
struct PinCacheReport {
    registrations: u64,
    hits: u64,
    misses: u64,
    hit_rate: f64,
    evictions: u64,
    invalidations: u64,
    merges: u64,
    pinned_bytes: usize,
    pinned_entries: usize,
}

/// The checks of one mode.
#[derive(Debug, Default, Serialize, Deserialize)]
struct Verification {
    checks: u64,
    failed: u64,
    failures: Vec<String>,
}

impl Verification {
    fn record(&mut self, ok: bool, what: impl FnOnce() -> String) -> bool {
        self.checks += 1;
        if !ok {
            self.failed += 1;
            self.failures.push(what());
        }
        ok
    }

    fn passed(&self) -> bool {
        self.failed == 0 && self.checks > 0
    }
}

/// What rank 0 reports for one mode.
#[derive(Debug, Serialize, Deserialize)]
struct ModeReport {
    /// `ContextConfig::spin` in microseconds; `null` for busy polling.
    driver_spin_us: Option<f64>,
    verification: Verification,
    transfers: Vec<TransferReport>,
    atomics: AtomicsReport,
    /// 8-byte writes, post to completion seen, in microseconds.
    write_8b_latency_us: Summary,
    bandwidth: Vec<BandwidthReport>,
    pin_cache: PinCacheReport,
    elapsed_s: f64,
}

/// One mode as the parent saw it.
#[derive(Debug, Serialize)]
struct ModeOutcome {
    mode: Mode,
    device_args: Vec<&'static str>,
    /// Whether every check of the mode passed (false if it did not finish).
    verified: bool,
    /// Why the mode did not finish.
    error: Option<String>,
    #[serde(flatten)]
    report: Option<ModeReport>,
}

/// A target figure and whether this run met it (reported, not enforced).
#[derive(Debug, Serialize)]
struct Target {
    name: &'static str,
    mode: Mode,
    target: f64,
    measured: Option<f64>,
    met: Option<bool>,
}

#[derive(Serialize)]
struct Report {
    program: &'static str,
    version: &'static str,
    /// Every check of every mode passed.
    verified: bool,
    plan: Plan,
    machine: Machine,
    /// Single-thread `memcpy` of the bandwidth sizes on an idle machine.
    memcpy_idle: Vec<MemcpyReport>,
    modes: Vec<ModeOutcome>,
    targets: Vec<Target>,
    elapsed_s: f64,
}

fn main() -> ExitCode {
    let mut raw = std::env::args_os().skip(1);
    if raw.next().as_deref() == Some(std::ffi::OsStr::new("--device")) {
        return run_device(raw);
    }
    let args = Args::parse();
    match args.rank {
        None => parent(&args),
        Some(rank) => rank_main(rank, &args),
    }
}

// ---------------------------------------------------------------- parent

fn parent(args: &Args) -> ExitCode {
    match run_parent(args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("pindown-demo: not every check passed (\"verified\": false)");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("pindown-demo: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run_parent(args: &Args) -> Result<bool, Box<dyn Error>> {
    let started = Instant::now();
    let exe = std::env::current_exe()?;
    let plan = Plan::new(args.quick);
    let modes = args.mode.map_or(Mode::ALL.to_vec(), |m| vec![m]);
    let machine = Machine::collect(LockBudget::probe(INITIATOR_ARENA as u64));
    let bar = args.output.progress_bar(modes.len() as u64 * PHASES);
    bar.set_message("memcpy baseline");
    let memcpy_idle = idle_memcpy(&plan)?;
    let mut outcomes = Vec::new();
    for mode in modes {
        bar.set_message(format!("{mode}: starting the device"));
        let result = run_mode(&exe, mode, args.quick, &bar).map(|mut report| {
            for b in &mut report.bandwidth {
                b.over_idle_memcpy = memcpy_idle
                    .iter()
                    .find(|m| m.bytes == b.bytes)
                    .map(|m| b.gb_per_s.median / m.gb_per_s.median);
            }
            report
        });
        if let Err(e) = &result {
            // An error, unlike progress, is shown even with --quiet.
            bar.suspend(|| eprintln!("pindown-demo: {mode}: {e}"));
        }
        let outcome = ModeOutcome {
            mode,
            device_args: mode.device_args().to_vec(),
            verified: result.as_ref().is_ok_and(|r| r.verification.passed()),
            error: result.as_ref().err().map(ToString::to_string),
            report: result.ok(),
        };
        outcomes.push(outcome);
    }
    bar.finish_and_clear();
    let report = Report {
        program: "pindown-demo",
        version: env!("CARGO_PKG_VERSION"),
        verified: outcomes.iter().all(|o| o.verified),
        targets: targets(&outcomes),
        plan,
        machine,
        memcpy_idle,
        modes: outcomes,
        elapsed_s: started.elapsed().as_secs_f64(),
    };
    if args.json {
        args.output.emit_json(&report)?;
    } else {
        args.output.write_json_file(&report)?;
        print!("{}", summary(&report));
    }
    Ok(report.verified)
}

/// The bandwidth sizes' `memcpy` with nothing else running: rounds of
/// copies after one untimed round.
fn idle_memcpy(plan: &Plan) -> Result<Vec<MemcpyReport>, Box<dyn Error>> {
    let mut reports = Vec::new();
    for &Stream {
        bytes,
        writes_per_round: copies,
    } in &plan.bandwidth
    {
        let mut memcpy = Memcpy::new(bytes as usize)?;
        memcpy.time(copies);
        let total = f64::from(bytes) * copies as f64;
        let mut rates: Vec<f64> = (0..plan.bandwidth_rounds)
            .map(|_| gb_per_s(total, memcpy.time(copies).as_secs_f64()))
            .collect();
        reports.push(MemcpyReport {
            bytes,
            copies_per_round: copies,
            rounds: plan.bandwidth_rounds,
            gb_per_s: Summary::of(&mut rates),
        });
    }
    Ok(reports)
}

/// One mode: a device of its own, rank 1, then rank 0, whose questions to
/// rank 1 this process passes on until rank 0 reports.
fn run_mode(
    exe: &Path,
    mode: Mode,
    quick: bool,
    bar: &ProgressBar,
) -> Result<ModeReport, Box<dyn Error>> {
    let mut device = DeviceChild::start(exe, "--device", PORTS, mode.device_args())?;
    let result = drive_ranks(exe, &device, mode, quick, bar);
    match (result, device.post_mortem()) {
        (Ok(report), None) => Ok(report),
        (Ok(_), Some(gone)) => Err(gone.into()),
        (Err(e), Some(gone)) => Err(format!("{e}; {gone}").into()),
        (Err(e), None) => Err(e),
    }
}

fn rank_command(exe: &Path, rank: u8, socket: &Path, mode: Mode, quick: bool) -> Command {
    let mut command = Command::new(exe);
    command
        .arg("--rank")
        .arg(rank.to_string())
        .arg("--socket")
        .arg(socket)
        .arg("--mode")
        .arg(mode.name());
    if quick {
        command.arg("--quick");
    }
    command
}

fn drive_ranks(
    exe: &Path,
    device: &DeviceChild,
    mode: Mode,
    quick: bool,
    bar: &ProgressBar,
) -> Result<ModeReport, Box<dyn Error>> {
    let mut target = LineChild::spawn(
        "rank 1",
        rank_command(exe, 1, &device.socket(1), mode, quick),
    )?;
    let first = target.next(ANSWER_TIMEOUT)?;
    let window = first
        .strip_prefix("window ")
        .ok_or_else(|| format!("rank 1 said {first:?} instead of its window"))?;
    let mut initiator = LineChild::spawn(
        "rank 0",
        rank_command(exe, 0, &device.socket(0), mode, quick),
    )?;
    initiator.send(&format!("window {window}"))?;
    let report: ModeReport = loop {
        let line = initiator.next(ANSWER_TIMEOUT)?;
        let (word, rest) = line.split_once(' ').unwrap_or((&line, ""));
        match word {
            "ask" => {
                let answer = target.ask(rest, ANSWER_TIMEOUT)?;
                initiator.send(&answer)?;
            }
            "progress" => {
                bar.set_message(format!("{mode}: {rest}"));
                bar.inc(1);
            }
            "result" => break serde_json::from_str(rest)?,
            "error" => return Err(format!("rank 0: {rest}").into()),
            _ => return Err(format!("rank 0 said {line:?}").into()),
        }
    };
    target.send("exit")?;
    for (name, rank) in [("rank 0", initiator), ("rank 1", target)] {
        let status = rank.finish(ANSWER_TIMEOUT)?;
        if !status.success() {
            return Err(format!("{name} exited with {status}").into());
        }
    }
    Ok(report)
}

/// The figures the stack is meant to reach, against this run.
fn targets(outcomes: &[ModeOutcome]) -> Vec<Target> {
    let mut targets = Vec::new();
    for outcome in outcomes {
        let report = outcome.report.as_ref();
        for (name, bytes) in [
            (
                "1 MiB writes over single-thread memcpy on an idle machine (at least)",
                1u32 << 20,
            ),
            (
                "16 MiB writes over single-thread memcpy on an idle machine (at least)",
                16 << 20,
            ),
        ] {
            let ratio = report.and_then(|r| {
                r.bandwidth
                    .iter()
                    .find(|b| b.bytes == bytes)
                    .and_then(|b| b.over_idle_memcpy)
            });
            targets.push(Target {
                name,
                mode: outcome.mode,
                target: rdma_targets::BANDWIDTH_OVER_MEMCPY,
                measured: ratio,
                met: ratio.map(|r| r >= rdma_targets::BANDWIDTH_OVER_MEMCPY),
            });
        }
        let limit = match outcome.mode {
            Mode::Poll => rdma_targets::POLL_MEDIAN_US,
            Mode::Event => rdma_targets::EVENT_MEDIAN_US,
        };
        for (name, median) in [
            (
                "8-byte write median latency, us (at most)",
                report.map(|r| r.write_8b_latency_us.median),
            ),
            (
                "8-byte fetch-add median latency, us (at most)",
                report.map(|r| r.atomics.fetch_add_latency_us.median),
            ),
        ] {
            targets.push(Target {
                name,
                mode: outcome.mode,
                target: limit,
                measured: median,
                met: median.map(|m| m <= limit),
            });
        }
    }
    targets
}

/// What ran, whether every check passed, and the key figures beside
/// their baselines: the default output.
fn summary(report: &Report) -> String {
    let mut out = String::new();
    let mut line = |text: String| {
        out.push_str(&text);
        out.push('\n');
    };
    let machine = &report.machine;
    line(format!(
        "pindown-demo {}: two ranks (processes) on one emulated NIC, {} CPUs, {}{}",
        report.version,
        machine.cpus,
        machine.kernel,
        if report.plan.quick { ", quick run" } else { "" }
    ));
    for outcome in &report.modes {
        line(String::new());
        let Some(r) = &outcome.report else {
            line(format!(
                "{}: FAILED to run: {}",
                outcome.mode,
                outcome.error.as_deref().unwrap_or("no report")
            ));
            continue;
        };
        line(format!(
            "{} mode: {} ({} checks of bytes, words and counters, {} failed)",
            outcome.mode,
            if outcome.verified {
                "verified"
            } else {
                "NOT verified"
            },
            r.verification.checks,
            r.verification.failed
        ));
        for failure in &r.verification.failures {
            line(format!("  FAILED {failure}"));
        }
        line(format!(
            "  8-byte RDMA write: {:.2} us median, {:.2} us p99; fetch-add {:.2} us median",
            r.write_8b_latency_us.median,
            r.write_8b_latency_us.p99,
            r.atomics.fetch_add_latency_us.median
        ));
        for b in &r.bandwidth {
            line(format!(
                "  {} MiB writes: {:.2} GB/s, {:.2}x memcpy running alongside, {}",
                b.bytes >> 20,
                b.gb_per_s.median,
                b.over_memcpy,
                b.over_idle_memcpy
                    .map_or("idle memcpy not measured".to_string(), |x| format!(
                        "{x:.2}x memcpy on an idle machine"
                    ))
            ));
        }
        line(format!(
            "  atomics: {} fetch-adds, then compare-and-swap and swap; counter {} ({})",
            r.atomics.fetch_adds,
            r.atomics
                .counter_final
                .map_or("not read".to_string(), |c| c.to_string()),
            if r.atomics.ok { "exact" } else { "WRONG" }
        ));
        line(format!(
            "  pin-down cache: {} registrations, {:.1} % hits ({} misses), {} MiB pinned",
            r.pin_cache.registrations,
            100.0 * r.pin_cache.hit_rate,
            r.pin_cache.misses,
            r.pin_cache.pinned_bytes >> 20
        ));
    }
    let met = report
        .targets
        .iter()
        .filter(|t| t.met == Some(true))
        .count();
    line(String::new());
    line(format!(
        "targets: {met} of {} met{}",
        report.targets.len(),
        report
            .targets
            .iter()
            .filter(|t| t.met != Some(true))
            .map(|t| format!(
                "\n  not met: {} ({}): {} against {}",
                t.name,
                t.mode,
                t.measured
                    .map_or("not measured".to_string(), |m| format!("{m:.2}")),
                t.target
            ))
            .collect::<String>()
    ));
    line(format!(
        "{} in {:.1} s; the whole report: --json",
        if report.verified {
            "everything verified"
        } else {
            "NOT everything verified"
        },
        report.elapsed_s
    ));
    out
}

// ---------------------------------------------------------------- ranks

/// Runs rank `rank`; errors go to stderr (and, for rank 0, to the parent).
fn rank_main(rank: u8, args: &Args) -> ExitCode {
    die_with_parent();
    let (Some(socket), Some(mode)) = (args.socket.as_deref(), args.mode) else {
        eprintln!("pindown-demo: --rank needs --socket and --mode");
        return ExitCode::FAILURE;
    };
    let result = match rank {
        0 => initiator(socket, mode, &Plan::new(args.quick)),
        1 => target(socket, mode),
        _ => Err(format!("there is no rank {rank}").into()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pindown-demo: rank {rank}: {e}");
            if rank == 0 {
                say(format_args!("error {e}"));
            }
            ExitCode::FAILURE
        }
    }
}

/// One line to the parent.
fn say(line: impl std::fmt::Display) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// The next line from the parent; an error at end of input.
fn hear() -> Result<String, Box<dyn Error>> {
    let mut line = String::new();
    if std::io::stdin().lock().read_line(&mut line)? == 0 {
        return Err("the parent closed the pipe".into());
    }
    Ok(line.trim_end().to_owned())
}

/// Asks rank 1 (through the parent) and returns its answer.
fn ask(question: impl std::fmt::Display) -> Result<String, Box<dyn Error>> {
    say(format_args!("ask {question}"));
    hear()
}

/// Rank 1: owns the window. Fills its read region with the pattern, zeroes
/// the rest, binds one window over all of it, then answers questions about
/// its memory until told to exit.
fn target(socket: &Path, mode: Mode) -> Result<(), Box<dyn Error>> {
    let context = Context::open(socket, mode.context_config(TARGET_ARENA))?;
    let buffer = context.alloc(TARGET_BYTES, 4096)?;
    buffer.fill(0);
    buffer.write_at(READ_BASE as usize, &pattern(READ_SEED, 0, REGION_BYTES));
    let region = context.register_buffer(&buffer)?;
    let access = Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC;
    let window = context.bind_window(&region, 0, TARGET_BYTES as u64, access)?;
    say(format_args!("window {}", window.remote()));
    loop {
        let line = hear()?;
        let words: Vec<&str> = line.split_whitespace().collect();
        let number = |i: usize| -> Result<u64, Box<dyn Error>> {
            let word = words.get(i).ok_or("missing operand")?;
            Ok(word.parse()?)
        };
        match words.first().copied() {
            Some("verify") => {
                let (offset, len, seed) = (number(1)?, number(2)?, number(3)?);
                let mut landed = vec![0u8; len as usize];
                buffer.read_at(offset as usize, &mut landed);
                match first_difference(seed, 0, &landed) {
                    None => say("ok"),
                    Some(at) => say(format_args!("bad: first wrong byte at {at}")),
                }
            }
            Some("counter") => {
                let mut word = [0u8; 8];
                buffer.read_at(number(1)? as usize, &mut word);
                say(format_args!("value {}", u64::from_le_bytes(word)));
            }
            Some("exit") => return Ok(()),
            _ => return Err(format!("unknown command {line:?}").into()),
        }
    }
}

/// Rank 0's state: its port, queue pair and completion queue, its buffers,
/// the peer's window and the checks so far.
struct Initiator<'c> {
    context: &'c Context,
    qp: QueuePair<'c>,
    cq: CompletionQueue<'c>,
    source: DmaBuffer,
    sink: DmaBuffer,
    window: RemoteWindow,
    checks: Verification,
}

/// Rank 0: receives the window, then runs the plan and reports.
fn initiator(socket: &Path, mode: Mode, plan: &Plan) -> Result<(), Box<dyn Error>> {
    let started = Instant::now();
    let config = mode.context_config(INITIATOR_ARENA);
    let driver_spin_us = (config.spin != Duration::MAX).then_some(config.spin.as_secs_f64() * 1e6);
    let context = Context::open(socket, config)?;
    let line = hear()?;
    let window: RemoteWindow = line
        .strip_prefix("window ")
        .ok_or_else(|| format!("expected the window, got {line:?}"))?
        .parse()?;
    let mut cq = context.create_completion_queue();
    let qp = context.create_queue_pair(&mut cq)?;
    let mut me = Initiator {
        source: context.alloc(REGION_BYTES, 4096)?,
        sink: context.alloc(REGION_BYTES, 4096)?,
        context: &context,
        qp,
        cq,
        window,
        checks: Verification::default(),
    };
    say("progress writes and reads");
    let mut transfers = Vec::new();
    for (i, &len) in plan.transfer_bytes.iter().enumerate() {
        transfers.push(me.verified_write(i as u64, len)?);
    }
    for (i, &len) in plan.transfer_bytes.iter().enumerate() {
        transfers.push(me.verified_read(i as u64, len)?);
    }
    say("progress atomics");
    let atomics = me.atomics(plan.fetch_adds)?;
    say("progress 8-byte write latency");
    let write_8b_latency_us = me.write_latency(plan)?;
    say("progress bandwidth");
    let mut bandwidth = Vec::new();
    for stream in &plan.bandwidth {
        bandwidth.push(me.bandwidth(plan, *stream)?);
    }
    say("progress pin cache");
    let stats = me.context.registration_stats();
    let report = ModeReport {
        driver_spin_us,
        transfers,
        atomics,
        write_8b_latency_us,
        bandwidth,
        pin_cache: PinCacheReport {
            registrations: stats.hits + stats.misses,
            hits: stats.hits,
            misses: stats.misses,
            hit_rate: stats.hit_rate(),
            evictions: stats.evictions,
            invalidations: stats.invalidations,
            merges: stats.merges,
            pinned_bytes: stats.pinned_bytes,
            pinned_entries: stats.pinned_entries,
        },
        verification: me.checks,
        elapsed_s: started.elapsed().as_secs_f64(),
    };
    say(format_args!("result {}", serde_json::to_string(&report)?));
    Ok(())
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

impl Initiator<'_> {
    /// Writes `len` bytes of a pattern from an odd offset of the source to
    /// an odd offset of the write region; rank 1 checks them.
    fn verified_write(&mut self, i: u64, len: u32) -> Result<TransferReport, Box<dyn Error>> {
        let (seed, skew, offset) = (WRITE_SEED + i, 5 + 7 * i, WRITE_BASE + 3 + 4097 * i);
        self.source
            .write_at(skew as usize, &pattern(seed, 0, len as usize));
        // Registered for this transfer only, as a messaging library would.
        let region =
            self.context
                .register_buffer_part(&self.source, skew as usize, len as usize)?;
        let entry = Write::new(region.local(0, len)?, self.window.at(offset)).build();
        let start = Instant::now();
        let done = run_one(&mut self.qp, &mut self.cq, entry.user_data(i))?;
        let us = micros(start.elapsed());
        drop(region);
        self.checks.record(done.byte_len == len, || {
            format!("write of {len} B: completion says {} B", done.byte_len)
        });
        let answer = ask(format_args!("verify {offset} {len} {seed}"))?;
        let verified = self
            .checks
            .record(answer == "ok", || format!("write of {len} B: {answer}"));
        Ok(TransferReport {
            op: "write".into(),
            bytes: len,
            remote_offset: offset,
            local_offset: skew,
            us,
            verified,
        })
    }

    /// Reads `len` bytes of the read region (the pattern of [`READ_SEED`])
    /// into an odd offset of the cleared sink and checks them.
    fn verified_read(&mut self, i: u64, len: u32) -> Result<TransferReport, Box<dyn Error>> {
        let (skew, offset) = (3 + 5 * i, READ_BASE + 11 + 4099 * i);
        self.sink.write_at(skew as usize, &vec![0; len as usize]);
        let region = self
            .context
            .register_buffer_part(&self.sink, skew as usize, len as usize)?;
        let entry = Read::new(region.local(0, len)?, self.window.at(offset)).build();
        let start = Instant::now();
        let done = run_one(&mut self.qp, &mut self.cq, entry.user_data(100 + i))?;
        let us = micros(start.elapsed());
        drop(region);
        self.checks.record(done.byte_len == len, || {
            format!("read of {len} B: completion says {} B", done.byte_len)
        });
        let mut landed = vec![0u8; len as usize];
        self.sink.read_at(skew as usize, &mut landed);
        let wrong = first_difference(READ_SEED, offset - READ_BASE, &landed);
        let verified = self.checks.record(wrong.is_none(), || {
            format!("read of {len} B: first wrong byte at {wrong:?}")
        });
        Ok(TransferReport {
            op: "read".into(),
            bytes: len,
            remote_offset: offset,
            local_offset: skew,
            us,
            verified,
        })
    }

    /// The word rank 1 sees at [`COUNTER_OFFSET`].
    fn counter(&mut self) -> Result<Option<u64>, Box<dyn Error>> {
        let answer = ask(format_args!("counter {COUNTER_OFFSET}"))?;
        Ok(answer.strip_prefix("value ").and_then(|v| v.parse().ok()))
    }

    /// Fetch-adds (each timed), then a compare-swap that succeeds, one that
    /// is refused and a swap; every old value and the word are checked.
    fn atomics(&mut self, adds: u64) -> Result<AtomicsReport, Box<dyn Error>> {
        let word = self.window.at(COUNTER_OFFSET);
        let start_value = self.counter()?;
        self.checks.record(start_value == Some(0), || {
            format!("counter starts at {start_value:?}, not 0")
        });
        let mut in_order = true;
        let mut latency = Vec::with_capacity(adds as usize);
        for k in 0..adds {
            let start = Instant::now();
            let done = run_one(
                &mut self.qp,
                &mut self.cq,
                FetchAdd::new(word, ADD).build().user_data(k),
            )?;
            latency.push(micros(start.elapsed()));
            in_order &= done.value == k * ADD;
        }
        self.checks
            .record(in_order, || "a fetch-add returned a wrong old value".into());
        let after_adds = self.counter()?;
        let sum = adds * ADD;
        self.checks.record(after_adds == Some(sum), || {
            format!("counter after {adds} fetch-adds is {after_adds:?}, not {sum}")
        });
        let cas = run_one(
            &mut self.qp,
            &mut self.cq,
            CompareSwap::new(word, sum, 7).build(),
        )?
        .value;
        let refused = run_one(
            &mut self.qp,
            &mut self.cq,
            CompareSwap::new(word, 1, 9).build(),
        )?
        .value;
        let swap = run_one(&mut self.qp, &mut self.cq, Swap::new(word, 11).build())?.value;
        let final_value = self.counter()?;
        let swaps_ok = (cas, refused, swap, final_value) == (sum, 7, 7, Some(11));
        self.checks.record(swaps_ok, || {
            format!(
                "compare-swap/swap returned {cas}, {refused}, {swap} (expected {sum}, 7, 7); \
                 word ends at {final_value:?} (expected 11)"
            )
        });
        Ok(AtomicsReport {
            fetch_adds: adds,
            add: ADD,
            fetch_add_values_ok: in_order,
            counter_after_adds: after_adds,
            compare_swap_old: cas,
            compare_swap_refused_old: refused,
            swap_old: swap,
            counter_final: final_value,
            ok: in_order && after_adds == Some(sum) && swaps_ok,
            fetch_add_latency_us: Summary::of(&mut latency),
        })
    }

    /// 8-byte writes one at a time, each registered anew and timed from
    /// post to completion seen.
    fn write_latency(&mut self, plan: &Plan) -> Result<Summary, Box<dyn Error>> {
        let seed = WRITE_SEED + 500;
        self.source.write_at(0, &pattern(seed, 0, 8));
        let target = self.window.at(WRITE_BASE);
        let mut samples = Vec::with_capacity(plan.latency_writes);
        for i in 0..plan.latency_warmup + plan.latency_writes {
            let region = self.context.register_buffer_part(&self.source, 0, 8)?;
            let entry = Write::new(region.local(0, 8)?, target).build();
            let start = Instant::now();
            run_one(&mut self.qp, &mut self.cq, entry.user_data(i as u64))?;
            let elapsed = start.elapsed();
            drop(region);
            if i >= plan.latency_warmup {
                samples.push(micros(elapsed));
            }
        }
        let answer = ask(format_args!("verify {WRITE_BASE} 8 {seed}"))?;
        self.checks.record(answer == "ok", || {
            format!("8-byte latency writes: {answer}")
        });
        Ok(Summary::of(&mut samples))
    }

    /// Rounds of `writes` writes of `bytes` (each registered anew, up to
    /// `plan.in_flight` at once), each round followed by as many `memcpy`s
    /// of the same size.
    fn bandwidth(
        &mut self,
        plan: &Plan,
        stream: Stream,
    ) -> Result<BandwidthReport, Box<dyn Error>> {
        let Stream {
            bytes,
            writes_per_round: writes,
        } = stream;
        let seed = WRITE_SEED + 600 + u64::from(bytes.trailing_zeros());
        self.source.write_at(0, &pattern(seed, 0, bytes as usize));
        let target = self.window.at(WRITE_BASE);
        let context = self.context;
        let (qp, cq) = (&mut self.qp, &mut self.cq);
        let source = &self.source;
        let mut stream = || {
            let start = Instant::now();
            run_many(
                qp,
                cq,
                writes,
                plan.in_flight,
                |_| Ok(context.register_buffer_part(source, 0, bytes as usize)?),
                |region| Ok(Write::new(region.local(0, bytes)?, target).build()),
            )?;
            Ok::<_, Box<dyn Error>>(start.elapsed())
        };
        let mut memcpy = Memcpy::new(bytes as usize)?;
        // One untimed round of each: faults, caches, registrations.
        stream()?;
        memcpy.time(writes);
        let total = bytes as f64 * writes as f64;
        let (mut rdma, mut copy) = (Vec::new(), Vec::new());
        for _ in 0..plan.bandwidth_rounds {
            rdma.push(gb_per_s(total, stream()?.as_secs_f64()));
            copy.push(gb_per_s(total, memcpy.time(writes).as_secs_f64()));
        }
        let (rdma, copy) = (Summary::of(&mut rdma), Summary::of(&mut copy));
        let answer = ask(format_args!("verify {WRITE_BASE} {bytes} {seed}"))?;
        let verified = self
            .checks
            .record(answer == "ok", || format!("{bytes}-byte stream: {answer}"));
        Ok(BandwidthReport {
            bytes,
            writes_per_round: writes,
            rounds: plan.bandwidth_rounds,
            in_flight: plan.in_flight,
            gb_per_s: rdma,
            memcpy_gb_per_s: copy,
            over_memcpy: rdma.median / copy.median,
            over_idle_memcpy: None,
            verified,
        })
    }
}
