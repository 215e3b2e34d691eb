//! `fabric`: RDMA writes between two device processes joined over UDP,
//! each figure beside a raw UDP baseline between the same two hosts in the
//! same run, and what the fabric's state costs per device and per peer.
//!
//! The hosts are two network namespaces joined by a veth pair (as root),
//! else the loopback address (the report says which, and why). One device
//! process (this executable again, `--device`) runs in each; the driver's
//! two contexts live in this process and reach the devices over their unix
//! sockets. For each mode (event-driven, busy-poll):
//!
//! * raw UDP round trips of 64-byte and 8-byte payloads between the hosts
//!   (spinning on non-blocking sockets in busy-poll mode, blocking `recv`
//!   in event mode), and a raw UDP bulk transfer of 1400-byte datagrams
//!   (received bytes per second), measured before the devices start;
//! * 8-byte writes from node 0 into a window of node 1, one at a time,
//!   post to completion seen, every one checked where it landed; as a
//!   multiple of the UDP round trip;
//! * streams of writes of 4 KiB to 16 MiB ([`IN_FLIGHT`] in flight), in
//!   GB/s, over the UDP bulk transfer;
//! * the same streams of 1 MiB and more with injected loss (`--loss`,
//!   default 1 % of the datagrams each device receives), over the lossless
//!   figure.
//!
//! Memory: the reliable endpoint with 2 to 1,024 peers (its own accounting
//! and the heap it takes, counted by this program's allocator), and the
//! resident memory of a device process with no fabric, 2 peers and 1,024
//! peers (made-up addresses; nothing is sent).
//!
//! One JSON document goes to stdout, progress to stderr. The targets (write
//! round trip within 1.5x of the UDP round trip; 1 MiB and larger streams
//! at least 0.8 of the UDP bulk transfer, and at least 0.5 of the lossless
//! figure under 1 % loss; at most 64 bytes per peer and 1 MiB fixed per
//! device; no per-peer receive buffers) are reported, not enforced. The
//! exit status is non-zero if a check failed or a figure could not be
//! measured.

use std::alloc::{GlobalAlloc, Layout, System};
use std::error::Error;
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use pindown_benches::child::DeviceChild;
use pindown_benches::fabric::{
    endpoint_memory, fabric_status, rss_bytes, udp_bulk, udp_round_trips, Batching, EndpointMemory,
    Hosts, HostsReport, UdpWait,
};
use pindown_benches::output::OutputArgs;
use pindown_benches::rdma::{
    fill_pattern, first_difference, gb_per_s, run_device, run_many, run_one, Mode, IN_FLIGHT,
};
use pindown_benches::stats::Summary;
use pindown_benches::sys::{LockBudget, Machine};
use pindown_driver::verbs::opcode::Write;
use pindown_driver::verbs::Context;
use pindown_uapi::Access;
use serde::Serialize;

/// Heap bytes allocated now, by every thread of this process.
static HEAP_IN_USE: AtomicUsize = AtomicUsize::new(0);

/// The system allocator, counting the bytes it has handed out and not
/// had back (for the endpoint's memory figures).
struct CountingAllocator;

// SAFETY: every method forwards to `System` with the caller's arguments
// unchanged and only adds bookkeeping on an atomic counter, so the
// `GlobalAlloc` contract holds as it does for `System`.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded; the caller upholds `alloc`'s contract.
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            HEAP_IN_USE.fetch_add(layout.size(), Ordering::Relaxed);
        }
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded; the caller upholds `alloc_zeroed`'s contract.
        let ptr = unsafe { System.alloc_zeroed(layout) };
        if !ptr.is_null() {
            HEAP_IN_USE.fetch_add(layout.size(), Ordering::Relaxed);
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded; `ptr` came from this allocator with `layout`.
        unsafe { System.dealloc(ptr, layout) };
        HEAP_IN_USE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded; `ptr` came from this allocator with `layout`.
        let new = unsafe { System.realloc(ptr, layout, new_size) };
        if !new.is_null() {
            HEAP_IN_USE.fetch_add(new_size, Ordering::Relaxed);
            HEAP_IN_USE.fetch_sub(layout.size(), Ordering::Relaxed);
        }
        new
    }
}

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

#[derive(Parser, Debug)]
#[command(
    name = "fabric",
    version,
    about = "RDMA writes between two device processes over UDP (two network namespaces, \
             or loopback) against raw UDP between the same hosts, and the fabric's memory \
             per device and per peer (JSON on stdout)"
)]
struct Args {
    /// A short run (a few seconds).
    #[arg(long)]
    quick: bool,
    /// Only this mode (default: both, event-driven first).
    #[arg(long, value_enum)]
    mode: Option<Mode>,
    /// Write sizes of the bandwidth figures, in bytes (default: 4 KiB to
    /// 16 MiB in powers of 4; 64 KiB and 1 MiB with --quick).
    #[arg(long, value_delimiter = ',')]
    sizes: Vec<u32>,
    /// Timed requests (and UDP round trips) per latency figure (default:
    /// 5000, 200 with --quick).
    #[arg(long)]
    samples: Option<usize>,
    /// Faults the devices inject into the datagrams they receive for the
    /// lossy figures.
    #[arg(long, default_value = "loss=0.01,seed=7")]
    loss: String,
    /// Leave the lossy figures out.
    #[arg(long)]
    no_loss: bool,
    /// Both devices on 127.0.0.1 of this namespace, even as root.
    #[arg(long)]
    loopback: bool,
    /// Peer counts of the endpoint's memory figures (default: 2, 4, 16,
    /// 64, 256, 1024).
    #[arg(long, value_delimiter = ',')]
    peers: Vec<usize>,
    /// A further option for both devices (repeatable), e.g.
    /// `--device-arg=--spin-us=200`.
    #[arg(long = "device-arg", value_name = "ARG", allow_hyphen_values = true)]
    device_args: Vec<String>,
    #[command(flatten)]
    output: OutputArgs,
}

/// Bandwidth sizes of a full run and of a quick one.
const SIZES: [u32; 7] = [
    4 << 10,
    16 << 10,
    64 << 10,
    256 << 10,
    1 << 20,
    4 << 20,
    16 << 20,
];
const QUICK_SIZES: [u32; 2] = [64 << 10, 1 << 20];
/// Largest write size accepted.
const MAX_SIZE: u32 = 64 << 20;
/// Peer counts of the memory figures.
const PEERS: [usize; 6] = [2, 4, 16, 64, 256, 1024];
/// Peers of the device whose resident memory is compared with 2 peers'.
const RSS_PEERS: usize = 1024;
/// The raw UDP payloads of the round trips, and the bulk datagram.
const UDP_PAYLOADS: [usize; 2] = [64, 8];
const UDP_DATAGRAM: usize = 1400;
/// The write of the latency figure.
const LATENCY_BYTES: u32 = 8;
const WRITE_SEED: u64 = 0xfab_1000;
/// Timed samples a latency figure keeps however long they take.
const MIN_SAMPLES: usize = 10;
/// Room in each context's DMA arena beyond the buffers (rings).
const ARENA_SLACK: usize = 8 << 20;

/// The targets (reported, not enforced).
mod targets {
    /// 8-byte write round trip over the raw UDP round trip (64 bytes), at
    /// most.
    pub const WRITE_OVER_UDP_ROUND_TRIP: f64 = 1.5;
    /// Streams of 1 MiB and more over the raw UDP bulk transfer, at least.
    pub const BANDWIDTH_OVER_UDP_BULK: f64 = 0.8;
    /// The same under loss over without, at least.
    pub const LOSSY_OVER_LOSSLESS: f64 = 0.5;
    /// Bytes of state per peer, at most.
    pub const PER_PEER_BYTES: f64 = 64.0;
    /// Fixed bytes per device process, at most.
    pub const FIXED_BYTES: f64 = 1024.0 * 1024.0;
}

/// How much of everything one run does.
#[derive(Clone, Debug, Serialize)]
struct Plan {
    quick: bool,
    modes: Vec<Mode>,
    latency_bytes: u32,
    latency_samples: usize,
    latency_warmup: usize,
    udp_payloads: Vec<usize>,
    udp_datagram: usize,
    bandwidth_bytes: Vec<u32>,
    /// Bytes written per timed bandwidth round (at least four writes).
    bandwidth_bytes_per_round: u64,
    bandwidth_rounds: usize,
    in_flight: usize,
    /// Time one figure may take: a latency figure stops taking samples
    /// (keeping at least [`MIN_SAMPLES`]) and a bandwidth figure stops
    /// starting rounds (keeping at least one) once it is spent, so that a
    /// loaded machine cannot stretch a run without bound; the sample
    /// counts say what was taken.
    figure_seconds: f64,
    /// Faults each device injects into what it receives, lossy figures.
    lossy_fault_in: Option<String>,
    lossy_bandwidth_bytes: Vec<u32>,
    endpoint_peers: Vec<usize>,
    rss_peers: usize,
    device_args: Vec<String>,
}

impl Plan {
    fn new(args: &Args) -> Result<Plan, String> {
        let quick = args.quick;
        let (samples, bytes_per_round, rounds, figure_seconds) = if quick {
            (200, 2 << 20, 3, 5.0)
        } else {
            (5_000, 64 << 20, 7, 30.0)
        };
        let latency_samples = args.samples.unwrap_or(samples).max(1);
        let bandwidth_bytes = match (args.sizes.is_empty(), quick) {
            (false, _) => args.sizes.clone(),
            (true, true) => QUICK_SIZES.to_vec(),
            (true, false) => SIZES.to_vec(),
        };
        if let Some(bad) = bandwidth_bytes.iter().find(|&&b| b == 0 || b > MAX_SIZE) {
            return Err(format!("--sizes: {bad} is not between 1 and {MAX_SIZE}"));
        }
        let mut lossy: Vec<u32> = bandwidth_bytes
            .iter()
            .copied()
            .filter(|&b| b >= 1 << 20)
            .collect();
        if lossy.is_empty() {
            lossy = bandwidth_bytes.iter().copied().max().into_iter().collect();
        }
        let peers = if args.peers.is_empty() {
            PEERS.to_vec()
        } else {
            args.peers.clone()
        };
        if let Some(bad) = peers.iter().find(|&&p| p == 0 || p > usize::from(u16::MAX)) {
            return Err(format!("--peers: {bad} is not between 1 and 65535"));
        }
        Ok(Plan {
            quick,
            modes: args.mode.map_or(Mode::ALL.to_vec(), |m| vec![m]),
            latency_bytes: LATENCY_BYTES,
            latency_samples,
            latency_warmup: (latency_samples / 10).max(10),
            udp_payloads: UDP_PAYLOADS.to_vec(),
            udp_datagram: UDP_DATAGRAM,
            bandwidth_bytes,
            bandwidth_bytes_per_round: bytes_per_round,
            bandwidth_rounds: rounds,
            in_flight: IN_FLIGHT,
            figure_seconds,
            lossy_fault_in: (!args.no_loss).then(|| args.loss.clone()),
            lossy_bandwidth_bytes: if args.no_loss { Vec::new() } else { lossy },
            endpoint_peers: peers,
            rss_peers: RSS_PEERS,
            device_args: args.device_args.clone(),
        })
    }

    fn writes_per_round(&self, bytes: u32) -> u64 {
        (self.bandwidth_bytes_per_round / u64::from(bytes)).max(4)
    }

    fn bulk_datagrams(&self) -> u64 {
        (self.bandwidth_bytes_per_round / self.udp_datagram as u64).max(64)
    }

    /// The largest buffer a write needs.
    fn span(&self) -> usize {
        let largest = self
            .bandwidth_bytes
            .iter()
            .chain(&self.lossy_bandwidth_bytes)
            .copied()
            .max()
            .unwrap_or(0);
        (largest.max(4096) as usize).next_multiple_of(4096)
    }
}

/// A raw UDP round trip.
#[derive(Debug, Serialize)]
struct UdpRoundTrip {
    payload_bytes: usize,
    us: Summary,
    /// Every echo was the datagram sent.
    verified: bool,
}

/// The raw UDP bulk transfer.
#[derive(Debug, Serialize)]
struct UdpBulk {
    /// How datagrams were handed to the kernel.
    batching: Batching,
    datagram_bytes: usize,
    datagrams_per_round: u64,
    /// Bytes received per second.
    gb_per_s: Summary,
    /// Datagrams received over datagrams sent, over all rounds.
    delivered_fraction: f64,
}

/// The raw UDP figures of one mode.
#[derive(Debug, Serialize)]
struct UdpBaseline {
    /// `"spin"` (non-blocking sockets polled) or `"block"`.
    wait: &'static str,
    round_trips: Vec<UdpRoundTrip>,
    /// One `send` and one `recv` per datagram (the baseline).
    bulk: Option<UdpBulk>,
    /// Segmentation offload both ways (GSO/GRO through `quinn-udp`, as
    /// the fabric's link sends and receives): the kernel's best.
    bulk_segmented: Option<UdpBulk>,
}

/// The 8-byte write latency.
#[derive(Debug, Serialize)]
struct LatencyFigure {
    bytes: u32,
    /// Post to completion seen, in microseconds.
    us: Summary,
    /// Median over the median UDP round trip of 64 bytes.
    over_udp_64_round_trip: f64,
    /// Median over the median UDP round trip of 8 bytes.
    over_udp_8_round_trip: f64,
    p99_over_median: f64,
    /// Every write was seen in the target's memory after its completion.
    verified: bool,
}

/// One bandwidth figure.
#[derive(Debug, Serialize)]
struct BandwidthFigure {
    bytes: u32,
    writes_per_round: u64,
    gb_per_s: Summary,
    /// Median over the plain UDP bulk transfer's median.
    over_udp_bulk: f64,
    /// Median over the segmented UDP bulk transfer's median.
    over_udp_bulk_segmented: f64,
    /// Lossy figures: median over the lossless figure's median of the
    /// same size (`null` without one).
    over_lossless: Option<f64>,
    /// The target's bytes are the source's after the last round.
    verified: bool,
}

/// The figures of one pair of devices.
#[derive(Debug, Default, Serialize)]
struct PairReport {
    /// Both devices' options beyond the fabric's.
    device_args: Vec<String>,
    latency: Option<LatencyFigure>,
    bandwidth: Vec<BandwidthFigure>,
    /// The fabric link's counters of node 0 and node 1 at the end.
    counters: Vec<std::collections::BTreeMap<String, u64>>,
    /// Resident memory of the two device processes at the end, in bytes.
    rss_bytes: Vec<u64>,
    error: Option<String>,
}

#[derive(Debug, Serialize)]
struct ModeReport {
    mode: Mode,
    udp: UdpBaseline,
    udp_error: Option<String>,
    lossless: PairReport,
    /// Both devices inject `plan.lossy_fault_in` into what they receive.
    lossy: Option<PairReport>,
}

/// A device process's resident memory.
#[derive(Debug, Serialize)]
struct DeviceRss {
    /// Fabric peers (0: no fabric link).
    peers: usize,
    rss_bytes: u64,
    /// The link's own accounting (status line): fixed bytes and bytes per
    /// peer.
    link_memory_fixed: Option<u64>,
    link_memory_per_peer: Option<u64>,
    /// The link's own datagram buffers (status line), fixed bytes beside
    /// the endpoint's.
    link_memory_buffers: Option<u64>,
}

#[derive(Debug, Serialize)]
struct MemoryReport {
    endpoint: Vec<EndpointMemory>,
    device_rss: Vec<DeviceRss>,
    /// Resident memory of a device with 2 peers over one without a
    /// fabric, in bytes (the pool's pages are counted only once touched).
    device_fabric_fixed_rss_bytes: Option<f64>,
    /// Resident memory growth from 2 to `rss_peers` peers, per peer, in
    /// bytes: page granular, and an upper bound, since it includes the
    /// command line's own cost (the `--fabric-peer` arguments, their
    /// parse, the link's address tables and heap the parse freed but the
    /// allocator kept).
    device_rss_per_peer_bytes: Option<f64>,
    /// The per-peer heap the endpoint took with the most peers, over its
    /// own per-peer figure.
    heap_per_peer_over_accounted: Option<f64>,
    error: Option<String>,
}

/// A target and whether this run met it (reported, not enforced).
#[derive(Debug, Serialize)]
struct Target {
    what: String,
    /// `"ratio"` or `"bytes"`.
    unit: &'static str,
    /// `"at_most"` or `"at_least"`.
    bound: &'static str,
    target: f64,
    measured: Option<f64>,
    met: bool,
}

#[derive(Serialize)]
struct Report {
    program: &'static str,
    version: &'static str,
    verified: bool,
    /// `"netns"` or `"loopback"`.
    hosts: &'static str,
    hosts_detail: HostsReport,
    plan: Plan,
    machine: Machine,
    modes: Vec<ModeReport>,
    memory: MemoryReport,
    targets: Vec<Target>,
    elapsed_s: f64,
}

fn main() -> ExitCode {
    let mut raw = std::env::args_os();
    let _program = raw.next();
    if raw.next().as_deref() == Some(std::ffi::OsStr::new("--device")) {
        return run_device(raw);
    }
    let args = Args::parse();
    match run(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("fabric: not every figure was measured and checked (\"verified\": false)");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("fabric: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Progress on stderr unless `--quiet`.
macro_rules! progress {
    ($args:expr, $($fmt:tt)*) => {
        if !$args.output.quiet {
            eprintln!("fabric: {}", format_args!($($fmt)*));
        }
    };
}

fn run(args: &Args) -> Result<bool, Box<dyn Error>> {
    let started = Instant::now();
    let plan = Plan::new(args)?;
    // First, while no other thread allocates.
    progress!(args, "endpoint memory");
    let memory_endpoint = plan
        .endpoint_peers
        .iter()
        .map(|&peers| endpoint_memory(peers, &|| Some(HEAP_IN_USE.load(Ordering::Relaxed))))
        .collect::<Result<Vec<_>, _>>()?;
    let arena = plan.span() + ARENA_SLACK;
    let machine = Machine::collect(LockBudget::probe(2 * arena as u64));
    let exe = std::env::current_exe()?;
    let hosts = Hosts::set_up(args.loopback);
    progress!(
        args,
        "hosts: {}{}",
        hosts.kind(),
        hosts
            .report()
            .fallback_reason
            .map_or(String::new(), |r| format!(" ({r})"))
    );
    let mut modes = Vec::new();
    for &mode in &plan.modes {
        modes.push(measure_mode(args, &exe, &hosts, mode, &plan, arena));
    }
    progress!(args, "device memory");
    let memory = device_memory(&exe, &plan, memory_endpoint);
    let verified = memory.error.is_none()
        && modes.iter().all(|m| {
            let pair_ok = |p: &PairReport| {
                p.error.is_none()
                    && p.latency.as_ref().is_none_or(|l| l.verified)
                    && p.bandwidth.iter().all(|b| b.verified)
            };
            m.udp_error.is_none()
                && m.udp.round_trips.iter().all(|r| r.verified)
                && pair_ok(&m.lossless)
                && m.lossy.as_ref().is_none_or(pair_ok)
        });
    let report = Report {
        program: "fabric",
        version: env!("CARGO_PKG_VERSION"),
        verified,
        hosts: hosts.kind(),
        hosts_detail: hosts.report(),
        targets: targets(&modes, &memory),
        plan,
        machine,
        modes,
        memory,
        elapsed_s: started.elapsed().as_secs_f64(),
    };
    drop(hosts);
    if !args.output.quiet {
        summarize(&report);
    }
    args.output.emit_json(&report)?;
    Ok(verified)
}

fn measure_mode(
    args: &Args,
    exe: &std::path::Path,
    hosts: &Hosts,
    mode: Mode,
    plan: &Plan,
    arena: usize,
) -> ModeReport {
    let wait = match mode {
        Mode::Poll => UdpWait::Spin,
        Mode::Event => UdpWait::Block,
    };
    let mut udp = UdpBaseline {
        wait: match wait {
            UdpWait::Spin => "spin",
            UdpWait::Block => "block",
        },
        round_trips: Vec::new(),
        bulk: None,
        bulk_segmented: None,
    };
    progress!(args, "{mode}: raw UDP");
    let udp_error = udp_baseline(hosts, plan, wait, &mut udp)
        .err()
        .map(|e| format!("raw UDP baseline: {e}"));
    let udp_rtt = |payload: usize| {
        udp.round_trips
            .iter()
            .find(|r| r.payload_bytes == payload)
            .map_or(f64::NAN, |r| r.us.median)
    };
    let median = |bulk: &Option<UdpBulk>| bulk.as_ref().map_or(f64::NAN, |b| b.gb_per_s.median);
    let baselines = Baselines {
        udp_64_us: udp_rtt(64),
        udp_8_us: udp_rtt(8),
        bulk_gb_per_s: median(&udp.bulk),
        bulk_segmented_gb_per_s: median(&udp.bulk_segmented),
    };
    progress!(args, "{mode}: fabric writes");
    let lossless = measure_pair(
        exe,
        hosts,
        mode,
        plan,
        arena,
        &[],
        true,
        &plan.bandwidth_bytes,
        &baselines,
        None,
    );
    let lossy = plan.lossy_fault_in.as_ref().map(|spec| {
        progress!(args, "{mode}: fabric writes under {spec}");
        measure_pair(
            exe,
            hosts,
            mode,
            plan,
            arena,
            &["--fault-in".to_string(), spec.clone()],
            false,
            &plan.lossy_bandwidth_bytes,
            &baselines,
            Some(&lossless),
        )
    });
    ModeReport {
        mode,
        udp,
        udp_error,
        lossless,
        lossy,
    }
}

fn udp_baseline(
    hosts: &Hosts,
    plan: &Plan,
    wait: UdpWait,
    udp: &mut UdpBaseline,
) -> Result<(), Box<dyn Error>> {
    let a = hosts.bind_udp(0, 0)?;
    let b = hosts.bind_udp(1, 0)?;
    for &payload in &plan.udp_payloads {
        let (us, verified) = udp_round_trips(
            &a,
            &b,
            payload,
            plan.latency_warmup,
            plan.latency_samples,
            wait,
        )?;
        udp.round_trips.push(UdpRoundTrip {
            payload_bytes: payload,
            us,
            verified,
        });
    }
    udp.bulk = Some(bulk_rounds(&a, &b, plan, wait, Batching::Plain)?);
    // Segmented sends change the sockets' options: sockets of its own.
    let (a, b) = (hosts.bind_udp(0, 0)?, hosts.bind_udp(1, 0)?);
    udp.bulk_segmented = Some(bulk_rounds(&a, &b, plan, wait, Batching::Segmented)?);
    Ok(())
}

/// The rounds of one raw UDP bulk transfer (after one short untimed).
fn bulk_rounds(
    a: &std::net::UdpSocket,
    b: &std::net::UdpSocket,
    plan: &Plan,
    wait: UdpWait,
    batching: Batching,
) -> Result<UdpBulk, Box<dyn Error>> {
    let count = plan.bulk_datagrams();
    udp_bulk(a, b, plan.udp_datagram, count.min(256), wait, batching)?;
    let (mut rates, mut sent, mut received) = (Vec::new(), 0u64, 0u64);
    for _ in 0..plan.bandwidth_rounds {
        let round = udp_bulk(a, b, plan.udp_datagram, count, wait, batching)?;
        rates.push(round.gb_per_s(plan.udp_datagram));
        sent += round.sent;
        received += round.received;
    }
    Ok(UdpBulk {
        batching,
        datagram_bytes: plan.udp_datagram,
        datagrams_per_round: count,
        gb_per_s: Summary::of(&mut rates),
        delivered_fraction: received as f64 / sent.max(1) as f64,
    })
}

/// The raw UDP medians of a mode the figures are divided by.
struct Baselines {
    udp_64_us: f64,
    udp_8_us: f64,
    bulk_gb_per_s: f64,
    bulk_segmented_gb_per_s: f64,
}

/// A random-enough nonzero fabric token for one pair of devices.
fn token() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64);
    format!("{:x}", (nanos ^ u64::from(std::process::id()) << 40) | 1)
}

/// Starts node 0 in host 0 and node 1 in host 1, joined over UDP.
fn start_pair(
    exe: &std::path::Path,
    hosts: &Hosts,
    mode: Mode,
    plan: &Plan,
    extra: &[String],
) -> Result<[DeviceChild; 2], Box<dyn Error>> {
    let ports = [hosts.free_port(0)?, hosts.free_port(1)?];
    let token = token();
    let start = |node: usize| -> Result<DeviceChild, Box<dyn Error>> {
        let other = 1 - node;
        let mut args: Vec<String> = vec![
            "--node".into(),
            node.to_string(),
            "--fabric-listen".into(),
            std::net::SocketAddr::new(hosts.address(node), ports[node]).to_string(),
            "--fabric-peer".into(),
            format!(
                "{other}={}",
                std::net::SocketAddr::new(hosts.address(other), ports[other])
            ),
            "--fabric-token".into(),
            token.clone(),
        ];
        args.extend(mode.device_args().iter().map(|a| a.to_string()));
        args.extend(extra.iter().cloned());
        args.extend(plan.device_args.iter().cloned());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Ok(DeviceChild::start_in(
            exe,
            "--device",
            1,
            &args,
            hosts.netns(node),
        )?)
    };
    Ok([start(0)?, start(1)?])
}

/// Runs the writes of one pair of devices: the latency figure if asked
/// for, and the streams of `sizes`.
#[allow(clippy::too_many_arguments)]
fn measure_pair(
    exe: &std::path::Path,
    hosts: &Hosts,
    mode: Mode,
    plan: &Plan,
    arena: usize,
    extra: &[String],
    latency: bool,
    sizes: &[u32],
    baselines: &Baselines,
    lossless: Option<&PairReport>,
) -> PairReport {
    let mut report = PairReport {
        device_args: mode
            .device_args()
            .iter()
            .map(|a| a.to_string())
            .chain(extra.iter().cloned())
            .chain(plan.device_args.iter().cloned())
            .collect(),
        ..PairReport::default()
    };
    let mut devices = match start_pair(exe, hosts, mode, plan, extra) {
        Ok(devices) => devices,
        Err(e) => {
            report.error = Some(format!("devices: {e}"));
            return report;
        }
    };
    let result = writes(
        &devices,
        mode,
        plan,
        arena,
        latency,
        sizes,
        baselines,
        lossless,
        &mut report,
    );
    for device in &devices {
        if let Ok(counters) = fabric_status(&device.dir().join("control.sock")) {
            report.counters.push(counters);
        }
        if let Ok(rss) = rss_bytes(device.pid()) {
            report.rss_bytes.push(rss);
        }
    }
    if let Err(e) = result {
        let gone: Vec<String> = devices.iter_mut().filter_map(|d| d.post_mortem()).collect();
        report.error = Some(if gone.is_empty() {
            e.to_string()
        } else {
            format!("{e} ({})", gone.join("; "))
        });
    }
    report
}

#[allow(clippy::too_many_arguments)]
fn writes(
    devices: &[DeviceChild; 2],
    mode: Mode,
    plan: &Plan,
    arena: usize,
    latency: bool,
    sizes: &[u32],
    baselines: &Baselines,
    lossless: Option<&PairReport>,
    report: &mut PairReport,
) -> Result<(), Box<dyn Error>> {
    let initiator = Context::open(devices[0].socket(0), mode.context_config(arena))?;
    let owner = Context::open(devices[1].socket(0), mode.context_config(arena))?;
    let span = plan.span();
    let source = initiator.alloc(span, 4096)?;
    let mut bytes = vec![0u8; span];
    fill_pattern(WRITE_SEED, 0, &mut bytes);
    source.write_at(0, &bytes);
    let word = initiator.alloc(64, 64)?;
    let target = owner.alloc(span, 4096)?;
    let source_region = initiator.register_buffer(&source)?;
    let word_region = initiator.register_buffer(&word)?;
    let target_region = owner.register_buffer(&target)?;
    let window = owner.bind_window(&target_region, 0, span as u64, Access::REMOTE_WRITE)?;
    let remote = window.remote();
    if remote.node != 1 {
        return Err(format!("the window is on node {}, not 1", remote.node).into());
    }
    let mut cq = initiator.create_completion_queue();
    let mut qp = initiator.create_queue_pair(&mut cq)?;

    if latency {
        let len = plan.latency_bytes as usize;
        let mut samples = Vec::with_capacity(plan.latency_samples);
        let mut verified = true;
        let mut landed = vec![0u8; len];
        let began = Instant::now();
        for i in 0..(plan.latency_warmup + plan.latency_samples) as u64 {
            if samples.len() >= MIN_SAMPLES && began.elapsed().as_secs_f64() > plan.figure_seconds {
                break;
            }
            let value = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
            word.write_at(0, &value.to_le_bytes()[..len.min(8)]);
            let entry = Write::new(word_region.local(0, plan.latency_bytes)?, remote.at(0))
                .build()
                .user_data(i);
            let start = Instant::now();
            run_one(&mut qp, &mut cq, entry)?;
            let elapsed = start.elapsed();
            target.read_at(0, &mut landed);
            verified &= landed[..len.min(8)] == value.to_le_bytes()[..len.min(8)];
            if i >= plan.latency_warmup as u64 {
                samples.push(elapsed.as_secs_f64() * 1e6);
            }
        }
        let us = Summary::of(&mut samples);
        report.latency = Some(LatencyFigure {
            bytes: plan.latency_bytes,
            over_udp_64_round_trip: us.median / baselines.udp_64_us,
            over_udp_8_round_trip: us.median / baselines.udp_8_us,
            p99_over_median: us.p99 / us.median,
            us,
            verified,
        });
    }

    for &size in sizes {
        let writes = plan.writes_per_round(size);
        target.write_at(0, &vec![0u8; size as usize]);
        let mut stream = |count: u64| -> Result<Duration, Box<dyn Error>> {
            let start = Instant::now();
            run_many(
                &mut qp,
                &mut cq,
                count,
                plan.in_flight,
                |_| Ok(&source_region),
                |region| Ok(Write::new(region.local(0, size)?, remote.at(0)).build()),
            )?;
            Ok(start.elapsed())
        };
        stream(writes.min(4))?;
        let total = f64::from(size) * writes as f64;
        let mut rates: Vec<f64> = Vec::with_capacity(plan.bandwidth_rounds);
        let began = Instant::now();
        for _ in 0..plan.bandwidth_rounds {
            if !rates.is_empty() && began.elapsed().as_secs_f64() > plan.figure_seconds {
                break;
            }
            rates.push(gb_per_s(total, stream(writes)?.as_secs_f64()));
        }
        let rate = Summary::of(&mut rates);
        let mut landed = vec![0u8; size as usize];
        target.read_at(0, &mut landed);
        let over_lossless = lossless.map(|l| {
            l.bandwidth
                .iter()
                .find(|b| b.bytes == size)
                .map_or(f64::NAN, |b| rate.median / b.gb_per_s.median)
        });
        report.bandwidth.push(BandwidthFigure {
            bytes: size,
            writes_per_round: writes,
            over_udp_bulk: rate.median / baselines.bulk_gb_per_s,
            over_udp_bulk_segmented: rate.median / baselines.bulk_segmented_gb_per_s,
            over_lossless: over_lossless.filter(|r| r.is_finite()),
            gb_per_s: rate,
            verified: first_difference(WRITE_SEED, 0, &landed).is_none(),
        });
    }
    Ok(())
}

/// The endpoint's figures (measured first) and the device processes'
/// resident memory with no fabric, 2 peers and `plan.rss_peers` peers.
fn device_memory(
    exe: &std::path::Path,
    plan: &Plan,
    endpoint: Vec<EndpointMemory>,
) -> MemoryReport {
    let mut report = MemoryReport {
        heap_per_peer_over_accounted: endpoint
            .iter()
            .max_by_key(|e| e.peers)
            .map(|e| e.heap_per_peer_bytes / e.per_peer_bytes as f64),
        endpoint,
        device_rss: Vec::new(),
        device_fabric_fixed_rss_bytes: None,
        device_rss_per_peer_bytes: None,
        error: None,
    };
    let result = (|| -> Result<(), Box<dyn Error>> {
        for peers in [0, 2, plan.rss_peers] {
            report.device_rss.push(device_rss(exe, peers)?);
        }
        Ok(())
    })();
    if let Err(e) = result {
        report.error = Some(format!("device resident memory: {e}"));
        return report;
    }
    let rss = |peers: usize| {
        report
            .device_rss
            .iter()
            .find(|d| d.peers == peers)
            .map(|d| d.rss_bytes as f64)
    };
    if let (Some(none), Some(two), Some(many)) = (rss(0), rss(2), rss(plan.rss_peers)) {
        report.device_fabric_fixed_rss_bytes = Some(two - none);
        report.device_rss_per_peer_bytes = Some((many - two) / (plan.rss_peers - 2) as f64);
    }
    report
}

/// How long a device is left to settle before its memory is read.
const SETTLE: Duration = Duration::from_millis(300);

fn device_rss(exe: &std::path::Path, peers: usize) -> Result<DeviceRss, Box<dyn Error>> {
    let mut args: Vec<String> = Vec::new();
    if peers > 0 {
        args.extend([
            "--node".into(),
            "0".into(),
            "--fabric-listen".into(),
            "127.0.0.1:0".into(),
            "--fabric-token".into(),
            token(),
        ]);
        for node in 1..=peers {
            args.push("--fabric-peer".into());
            // Made-up addresses: nothing is sent to them.
            args.push(format!("{node}=127.0.0.1:{}", 20_000 + node));
        }
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let device = DeviceChild::start_in(exe, "--device", 1, &args, None)?;
    std::thread::sleep(SETTLE);
    let rss = rss_bytes(device.pid())?;
    let status = fabric_status(&device.dir().join("control.sock")).unwrap_or_default();
    Ok(DeviceRss {
        peers,
        rss_bytes: rss,
        link_memory_fixed: status.get("memory_fixed").copied(),
        link_memory_per_peer: status.get("memory_per_peer").copied(),
        link_memory_buffers: status.get("memory_buffers").copied(),
    })
}

fn target(
    what: String,
    unit: &'static str,
    at_most: bool,
    target: f64,
    measured: Option<f64>,
) -> Target {
    let measured = measured.filter(|m| m.is_finite());
    Target {
        what,
        unit,
        bound: if at_most { "at_most" } else { "at_least" },
        target,
        met: measured.is_some_and(|m| if at_most { m <= target } else { m >= target }),
        measured,
    }
}

fn targets(modes: &[ModeReport], memory: &MemoryReport) -> Vec<Target> {
    let mut out = Vec::new();
    for m in modes {
        let mode = m.mode;
        out.push(target(
            format!("{mode}: 8 B write round trip over raw UDP 64 B round trip"),
            "ratio",
            true,
            targets::WRITE_OVER_UDP_ROUND_TRIP,
            m.lossless
                .latency
                .as_ref()
                .map(|l| l.over_udp_64_round_trip),
        ));
        for b in m.lossless.bandwidth.iter().filter(|b| b.bytes >= 1 << 20) {
            out.push(target(
                format!("{mode}: {} B writes over raw UDP bulk transfer", b.bytes),
                "ratio",
                false,
                targets::BANDWIDTH_OVER_UDP_BULK,
                Some(b.over_udp_bulk),
            ));
        }
        if let Some(lossy) = &m.lossy {
            for b in &lossy.bandwidth {
                out.push(target(
                    format!("{mode}: {} B writes under loss over lossless", b.bytes),
                    "ratio",
                    false,
                    targets::LOSSY_OVER_LOSSLESS,
                    b.over_lossless,
                ));
            }
        }
    }
    let most = memory.endpoint.iter().max_by_key(|e| e.peers);
    out.push(target(
        "endpoint state per peer".into(),
        "bytes",
        true,
        targets::PER_PEER_BYTES,
        most.map(|e| e.per_peer_bytes as f64),
    ));
    out.push(target(
        "endpoint heap per peer, measured (most peers)".into(),
        "bytes",
        true,
        targets::PER_PEER_BYTES,
        most.map(|e| e.heap_per_peer_bytes),
    ));
    out.push(target(
        "endpoint fixed state per device".into(),
        "bytes",
        true,
        targets::FIXED_BYTES,
        most.map(|e| e.fixed_bytes as f64),
    ));
    let link = memory.device_rss.iter().find(|d| d.peers > 0);
    out.push(target(
        "endpoint fixed state plus the link's datagram buffers per device".into(),
        "bytes",
        true,
        targets::FIXED_BYTES,
        link.and_then(|d| Some((d.link_memory_fixed? + d.link_memory_buffers?) as f64)),
    ));
    out.push(target(
        "device resident memory of the fabric (2 peers over none)".into(),
        "bytes",
        true,
        targets::FIXED_BYTES,
        memory.device_fabric_fixed_rss_bytes,
    ));
    // A receive buffer per peer would cost at least one datagram's
    // payload per peer.
    out.push(target(
        "no per-peer receive buffers: endpoint heap per peer below one datagram".into(),
        "bytes",
        true,
        UDP_DATAGRAM as f64 - 1.0,
        most.map(|e| e.heap_per_peer_bytes),
    ));
    out
}

fn summarize(report: &Report) {
    eprintln!("fabric: hosts {}", report.hosts);
    for m in &report.modes {
        for r in &m.udp.round_trips {
            eprintln!(
                "{} raw UDP {:>3} B round trip ({}): median {:.1} us",
                m.mode, r.payload_bytes, m.udp.wait, r.us.median
            );
        }
        for b in m.udp.bulk.iter().chain(&m.udp.bulk_segmented) {
            eprintln!(
                "{} raw UDP bulk ({:?}): {:.3} GB/s ({:.1} % delivered)",
                m.mode,
                b.batching,
                b.gb_per_s.median,
                100.0 * b.delivered_fraction
            );
        }
        for (name, pair) in
            std::iter::once(("lossless", &m.lossless)).chain(m.lossy.as_ref().map(|p| ("lossy", p)))
        {
            if let Some(l) = &pair.latency {
                eprintln!(
                    "{} {name} 8 B write: median {:.1} us, p99 {:.1} us ({:.2}x UDP 64 B)",
                    m.mode, l.us.median, l.us.p99, l.over_udp_64_round_trip
                );
            }
            for b in &pair.bandwidth {
                eprintln!(
                    "{} {name} writes {:>8} B: {:.3} GB/s ({:.2}x UDP bulk, {:.2}x segmented{})",
                    m.mode,
                    b.bytes,
                    b.gb_per_s.median,
                    b.over_udp_bulk,
                    b.over_udp_bulk_segmented,
                    b.over_lossless
                        .map_or(String::new(), |r| format!(", {r:.2}x lossless"))
                );
            }
            if let Some(e) = &pair.error {
                eprintln!("{} {name}: error: {e}", m.mode);
            }
        }
    }
    for t in &report.targets {
        let verdict = if t.met { "met" } else { "MISSED" };
        eprintln!(
            "target {}: {} {} {} ({verdict})",
            t.what,
            t.measured.map_or("none".into(), |m| format!("{m:.3}")),
            t.bound,
            t.target
        );
    }
}
