//! `barrier-wait`: how long a barrier waits behind a transfer in flight.
//!
//! Revoking a window and invalidating an IOTLB range are barriers: the
//! device answers only once no access through them is in flight. Transfers
//! run in guarded steps of [`STEP_BYTES`], so the design promises that a
//! barrier waits for at most about one step of each transfer in flight,
//! however long the transfer.
//!
//! The program starts the emulated NIC (this executable again, with
//! `--device`) with two ports, opened by this process: port 0 writes 16 MiB
//! at a time into a window of port 1. Each trial posts two 16 MiB writes,
//! waits until the first one's bytes reach a random offset in the first
//! half of the target (so the copy is under way, with at least 8 MiB still
//! to go), then times, on port 1:
//!
//! * `revoke`: `MemoryWindow::revoke` of the window the write goes
//!   through (post, the device's barrier, completion seen);
//! * `invalidate`: the IOTLB INVALIDATE of the target's pages that the
//!   driver's pinner sends on unpin (`Transport::iotlb_unmap`, sent and
//!   acknowledged); the mapping is restored afterwards, untimed;
//! * `invalidate_own_transfer`: the same INVALIDATE while port 1's own
//!   16 MiB writes read those pages (port 1 writing into a window of
//!   port 0).
//!
//! Next to each, from the same run and interleaved with it, the same call
//! with nothing in flight (`idle`), and one thread's `memcpy` of a 16 MiB
//! buffer into another, timed step by step (256 KiB) and whole. `excess` is
//! what the writes in flight add (in-flight minus idle, at the median, the
//! 99th percentile and the maximum), also in units of the median step
//! `memcpy`. `writes_cut` counts the trials whose writes all failed: the
//! barrier stopped the first one while it was copying (every write must
//! complete, with success or an error; the program checks that). One JSON
//! document goes to stdout.

use std::error::Error;
use std::hint::black_box;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use pindown_driver::transport::{IotlbAccess, Transport};
use pindown_driver::verbs::opcode::Write;
use pindown_driver::verbs::{CompletionQueue, Context, MemoryRegion, MemoryWindow, QueuePair};
use pindown_driver::DmaBuffer;
use pindown_emu_device::rdma::STEP_BYTES;
use pindown_uapi::Access;
use serde::Serialize;

use pindown_benches::child::DeviceChild;
use pindown_benches::output::OutputArgs;
use pindown_benches::rdma::{run_device, Mode, TIMEOUT};
use pindown_benches::stats::Summary;
use pindown_benches::sys::{LockBudget, Machine};
use pindown_benches::traces::SplitMix64;

/// Command line. `--device` (first) is how this program starts the NIC.
#[derive(Parser, Debug)]
#[command(
    name = "barrier-wait",
    version,
    about = "Wait of a window revoke and of an IOTLB invalidation behind a 16 MiB write \
             in flight, next to the same with nothing in flight and a memcpy of one step \
             (JSON on stdout)"
)]
struct Args {
    /// Trials of each kind.
    #[arg(long, default_value_t = 300)]
    trials: usize,
    /// A short run (30 trials of each kind).
    #[arg(long)]
    quick: bool,
    /// How device and driver wait for work.
    #[arg(long, value_enum, default_value_t = Mode::Event)]
    mode: Mode,
    #[command(flatten)]
    output: OutputArgs,
}

/// Bytes of each write, of the target buffer and of the window.
const TRANSFER_BYTES: usize = 16 << 20;
/// Each port's DMA arena: the buffer plus the rings.
const ARENA_BYTES: usize = 24 << 20;
/// Writes posted per trial: the barrier comes during the first; the second
/// keeps a copy in flight should the first end before the barrier starts.
const WRITES: usize = 2;

/// One kind of barrier, timed in flight and idle (microseconds).
#[derive(Debug, Serialize)]
struct Timed {
    in_flight_us: Summary,
    idle_us: Summary,
    /// In-flight minus idle (median, p99, max), in microseconds.
    excess_us: Excess,
    /// The same in units of the median `memcpy` of one step.
    excess_steps: Excess,
    /// In-flight trials whose writes all failed: the barrier landed while
    /// the first one was copying, and cut it short.
    writes_cut: usize,
}

/// In-flight minus idle, at three points of the distributions.
#[derive(Debug, Serialize)]
struct Excess {
    median: f64,
    p99: f64,
    max: f64,
}

impl Excess {
    fn between(in_flight: &Summary, idle: &Summary, unit: f64) -> Excess {
        Excess {
            median: (in_flight.median - idle.median) / unit,
            p99: (in_flight.p99 - idle.p99) / unit,
            max: (in_flight.max - idle.max) / unit,
        }
    }
}

#[derive(Debug, Serialize)]
struct Report {
    machine: Machine,
    mode: Mode,
    trials: usize,
    transfer_bytes: usize,
    step_bytes: u64,
    revoke: Timed,
    invalidate: Timed,
    /// The INVALIDATE of a port's pages while that port's own 16 MiB
    /// write reads them (idle: the same as `invalidate`).
    invalidate_own_transfer: Timed,
    /// One thread's `memcpy` of one step (256 KiB) of a 16 MiB copy,
    /// microseconds.
    memcpy_step_us: Summary,
    /// One thread's `memcpy` of a whole transfer (16 MiB, step by step),
    /// microseconds.
    memcpy_transfer_us: Summary,
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// A port's queue pair and its completion queue.
struct Endpoint<'a> {
    qp: QueuePair<'a>,
    cq: CompletionQueue<'a>,
}

impl<'a> Endpoint<'a> {
    fn new(context: &'a Context) -> Result<Self, Box<dyn Error>> {
        let mut cq = context.create_completion_queue();
        let qp = context.create_queue_pair(&mut cq)?;
        Ok(Endpoint { qp, cq })
    }
}

/// The two ports and their buffers.
struct Bench<'a> {
    owner: &'a Context,
    /// Port 0's queue pair.
    initiator: Endpoint<'a>,
    /// Port 1's queue pair.
    own: Endpoint<'a>,
    /// Port 1's buffer: where port 0 writes, and the source of port 1's
    /// own writes.
    target: &'a DmaBuffer,
    target_region: &'a MemoryRegion<'a>,
    /// Port 0's buffer: the source of its writes, and where port 1 writes.
    source: &'a DmaBuffer,
    source_region: &'a MemoryRegion<'a>,
    random: SplitMix64,
}

impl<'a> Bench<'a> {
    /// Posts on `qp` [`WRITES`] 16 MiB writes from `from` into `window`,
    /// which covers `landing`, and waits until the first one's bytes reach
    /// a random offset in the first half of `landing`. `from` must hold no
    /// zero byte.
    fn start_writes(
        random: &mut SplitMix64,
        qp: &mut QueuePair<'_>,
        from: &MemoryRegion<'_>,
        window: &MemoryWindow<'_>,
        landing: &DmaBuffer,
    ) -> Result<(), Box<dyn Error>> {
        let watch = random.below(TRANSFER_BYTES / 2);
        landing.write_at(watch, &[0]);
        let local = from.local(0, TRANSFER_BYTES as u32)?;
        let write = Write::new(local, window.remote().at(0)).build().signaled();
        qp.post(&[write; WRITES])?;
        let deadline = Instant::now() + TIMEOUT;
        let mut byte = [0u8];
        loop {
            landing.read_at(watch, &mut byte);
            if byte[0] != 0 {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err("the write never reached the watched byte".into());
            }
            std::hint::spin_loop();
        }
    }

    /// Port 0's writes into port 1's window `window`.
    fn start_peer_writes(&mut self, window: &MemoryWindow<'_>) -> Result<(), Box<dyn Error>> {
        Self::start_writes(
            &mut self.random,
            &mut self.initiator.qp,
            self.source_region,
            window,
            self.target,
        )
    }

    /// Port 1's writes from the pages it invalidates into port 0's window
    /// `window`.
    fn start_own_writes(&mut self, window: &MemoryWindow<'_>) -> Result<(), Box<dyn Error>> {
        Self::start_writes(
            &mut self.random,
            &mut self.own.qp,
            self.target_region,
            window,
            self.source,
        )
    }

    /// Waits for the completions of the writes posted on `endpoint`;
    /// whether they all failed (the barrier cut the first short).
    fn finish_writes(endpoint: &mut Endpoint<'_>) -> Result<bool, Box<dyn Error>> {
        let mut seen = 0;
        let mut failed = 0;
        while seen < WRITES {
            for completion in endpoint.cq.wait(TIMEOUT)? {
                failed += usize::from(!completion.is_success());
                seen += 1;
            }
        }
        Ok(failed == WRITES)
    }

    fn bind(&self) -> Result<MemoryWindow<'a>, Box<dyn Error>> {
        Ok(self.owner.bind_window(
            self.target_region,
            0,
            TRANSFER_BYTES as u64,
            Access::REMOTE_WRITE,
        )?)
    }

    /// The IOTLB INVALIDATE of port 1's buffer, timed.
    fn invalidate(&self) -> Result<Duration, Box<dyn Error>> {
        let transport = self.owner.transport();
        let start = Instant::now();
        transport.iotlb_unmap(self.target.iova(), TRANSFER_BYTES as u64)?;
        Ok(start.elapsed())
    }

    /// Maps port 1's buffer for the device again (the pin-down cache still
    /// holds it).
    fn restore(&self) -> Result<(), Box<dyn Error>> {
        let iova = self.target.iova();
        self.owner.transport().iotlb_map(
            iova,
            TRANSFER_BYTES as u64,
            iova,
            IotlbAccess::ReadWrite,
        )?;
        Ok(())
    }
}

/// One thread's `memcpy` of a 16 MiB buffer into another, one step at a
/// time, as the device copies a transfer: the time of each step, and of
/// each whole pass (microseconds).
fn memcpy_steps(passes: usize) -> (Vec<f64>, Vec<f64>) {
    let step = STEP_BYTES as usize;
    let from = vec![0xa5u8; TRANSFER_BYTES];
    let mut to = vec![1u8; TRANSFER_BYTES];
    let (mut steps, mut wholes) = (Vec::new(), Vec::new());
    for _ in 0..passes {
        let pass = Instant::now();
        for at in (0..TRANSFER_BYTES).step_by(step) {
            let start = Instant::now();
            to[at..at + step].copy_from_slice(black_box(&from[at..at + step]));
            black_box(&mut to);
            steps.push(us(start.elapsed()));
        }
        wholes.push(us(pass.elapsed()));
    }
    (steps, wholes)
}

fn measure(args: &Args, device: &DeviceChild) -> Result<Report, Box<dyn Error>> {
    let trials = if args.quick { 30 } else { args.trials.max(1) };
    let config = args.mode.context_config(ARENA_BYTES);
    let initiator = Context::open(device.socket(0), config.clone())?;
    let owner = Context::open(device.socket(1), config)?;
    let target = owner.alloc(TRANSFER_BYTES, 4096)?;
    target.fill(0);
    let source = initiator.alloc(TRANSFER_BYTES, 4096)?;
    source.fill(0xa5);
    // Registered once, outside the timed parts.
    let source_region = initiator.register_buffer(&source)?;
    let target_region = owner.register_buffer(&target)?;
    let source_window = initiator.bind_window(
        &source_region,
        0,
        TRANSFER_BYTES as u64,
        Access::REMOTE_WRITE,
    )?;
    let mut bench = Bench {
        owner: &owner,
        initiator: Endpoint::new(&initiator)?,
        own: Endpoint::new(&owner)?,
        target: &target,
        target_region: &target_region,
        source: &source,
        source_region: &source_region,
        random: SplitMix64::new(0xba44_1e45),
    };

    // A first write, to fault every page in on both sides.
    let window = bench.bind()?;
    bench.start_peer_writes(&window)?;
    if Bench::finish_writes(&mut bench.initiator)? {
        return Err("writes with no barrier in their way failed".into());
    }
    window.revoke()?;

    let mut revoke = (Vec::new(), Vec::new(), 0usize);
    let mut invalidate = (Vec::new(), Vec::new(), 0usize);
    let mut own = (Vec::new(), 0usize);
    let bar = args.output.progress_bar(trials as u64);
    for _ in 0..trials {
        // Revoke, in flight.
        let window = bench.bind()?;
        bench.start_peer_writes(&window)?;
        let start = Instant::now();
        window.revoke()?;
        revoke.0.push(us(start.elapsed()));
        revoke.2 += usize::from(Bench::finish_writes(&mut bench.initiator)?);
        // Revoke, idle.
        let window = bench.bind()?;
        let start = Instant::now();
        window.revoke()?;
        revoke.1.push(us(start.elapsed()));

        // Invalidate, in flight.
        let window = bench.bind()?;
        bench.start_peer_writes(&window)?;
        invalidate.0.push(us(bench.invalidate()?));
        invalidate.2 += usize::from(Bench::finish_writes(&mut bench.initiator)?);
        bench.restore()?;
        // Invalidate, idle.
        invalidate.1.push(us(bench.invalidate()?));
        bench.restore()?;
        window.revoke()?;

        // Invalidate behind port 1's own write from the pages it
        // invalidates (into port 0's window).
        target.fill(0xa5);
        bench.start_own_writes(&source_window)?;
        own.0.push(us(bench.invalidate()?));
        own.1 += usize::from(Bench::finish_writes(&mut bench.own)?);
        bench.restore()?;
        source.fill(0xa5);
        bar.inc(1);
    }
    bar.finish_and_clear();
    drop(bench);
    drop(source_window);
    target_region.deregister()?;
    source_region.deregister()?;

    let (mut step_us, mut whole_us) = memcpy_steps(trials.clamp(10, 100));
    let memcpy_step_us = Summary::of(&mut step_us);
    let unit = memcpy_step_us.median;
    let timed = |(mut in_flight, mut idle, cut): (Vec<f64>, Vec<f64>, usize)| {
        let in_flight_us = Summary::of(&mut in_flight);
        let idle_us = Summary::of(&mut idle);
        Timed {
            excess_us: Excess::between(&in_flight_us, &idle_us, 1.0),
            excess_steps: Excess::between(&in_flight_us, &idle_us, unit),
            in_flight_us,
            idle_us,
            writes_cut: cut,
        }
    };
    Ok(Report {
        machine: Machine::collect(LockBudget::probe(ARENA_BYTES as u64)),
        mode: args.mode,
        trials,
        transfer_bytes: TRANSFER_BYTES,
        step_bytes: STEP_BYTES,
        invalidate_own_transfer: timed((own.0, invalidate.1.clone(), own.1)),
        revoke: timed(revoke),
        invalidate: timed(invalidate),
        memcpy_step_us,
        memcpy_transfer_us: Summary::of(&mut whole_us),
    })
}

fn main() -> ExitCode {
    let mut raw = std::env::args_os().skip(1);
    if raw.next().as_deref() == Some(std::ffi::OsStr::new("--device")) {
        return run_device(raw);
    }
    let args = Args::parse();
    let run = || -> Result<(), Box<dyn Error>> {
        let exe = std::env::current_exe()?;
        let mut device = DeviceChild::start(&exe, "--device", 2, args.mode.device_args())?;
        let report = match (measure(&args, &device), device.post_mortem()) {
            (Ok(report), None) => report,
            (Ok(_), Some(gone)) => return Err(gone.into()),
            (Err(e), Some(gone)) => return Err(format!("{e}; {gone}").into()),
            (Err(e), None) => return Err(e),
        };
        if args.output.chatty() {
            eprintln!(
                "max wait: revoke {:.0} us in flight, {:.0} us idle; invalidate {:.0} us in \
                 flight, {:.0} us idle, {:.0} us behind the port's own write; memcpy of one \
                 step: {:.0} us",
                report.revoke.in_flight_us.max,
                report.revoke.idle_us.max,
                report.invalidate.in_flight_us.max,
                report.invalidate.idle_us.max,
                report.invalidate_own_transfer.in_flight_us.max,
                report.memcpy_step_us.median
            );
        }
        args.output.emit_json(&report)
    };
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("barrier-wait: {e}");
            ExitCode::FAILURE
        }
    }
}
