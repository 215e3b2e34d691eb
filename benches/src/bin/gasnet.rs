//! `gasnet`: the GASNet-on-TCA paper's experiments (section 5) with
//! `pindown_messaging::gasnet`, beside Open MPI and MPICH doing the same on
//! this machine, in one run. Two rank processes, each on its own port of
//! one emulated NIC (started here, as `fmpl` does).
//!
//! * **Short-AM round trip**: a short request whose handler replies with a
//!   short reply, the round trip the target names.
//! * **Long-AM ping-pong** (figures 7-8): one-way latency (median round
//!   trip / 2) and bandwidth from 8 B to 4 MiB: `request_long` into the
//!   peer's segment, whose handler checks the bytes, answered the same way;
//!   beside the raw RDMA write ping-pong of the same sizes
//!   (`pindown_benches::raw_write`, measured by the same ranks) and each
//!   MPI's blocking ping-pong (`benches/mpi/gasnet_compare.c`).
//! * **Get latency**: a blocking `get` of each size from the peer's
//!   segment, native (RDMA READ) and by message (the paper's get over a
//!   write-only fabric), beside `MPI_Get` + `MPI_Win_flush` under a
//!   passive-target lock.
//! * **Halo exchange** (figures 9-10): an N x N x N array of doubles per
//!   rank in its segment; the three faces (block: x = const, block-stride:
//!   y = const, stride: z = const) by ping-pong, each way one
//!   `put_strided_nb` of the face into the peer's ghost plane and a short
//!   AM right behind it that says it is there (the paper's form; the AM
//!   arrives after the face's bytes, so neither waits for the other);
//!   beside each MPI sending the same faces with `MPI_Type_vector` and
//!   `MPI_Type_create_subarray` (`benches/mpi/halo.c`). Both check every
//!   ghost element before and after the timed loop.
//! * **Himeno** (table 2): the Himeno kernel decomposed over i on 2 ranks,
//!   the halo of p sent by `put_strided_nb` into the neighbour's ghost
//!   plane plus a short AM, the residual summed by short AMs; beside
//!   `benches/mpi/himeno.c`. Iterations per second, and the residual gosa
//!   and the sum of p of both, which must agree (`agree`).
//!
//! * **Descriptor cache** (section 4.4): LRU, LFU and first come on a
//!   stencil's fixed transfers among cold ones, with promotion; hit rates,
//!   evictions, promotions and the time per lookup (in this process); and
//!   repeated blocking puts of 4 KiB, 64 KiB and 1 MiB with the endpoint's
//!   cache off, on, and promoting after two uses (`repeated_puts`).
//!
//! Ratios and the targets: halo exchange at least 1.5x faster than
//! MPI with derived datatypes for every N (per face, against each MPI's
//! `MPI_Type_vector` figure), and the short-AM round trip at most 2x our
//! own 8-byte RDMA write round trip (the 8-byte long-AM ping-pong's ratio
//! is reported beside it). They are reported, not enforced; the
//! program fails when data arrived wrong or the Himeno results disagree.
//!
//! `--quick` runs few sizes and iterations (under a minute).
//! `GASNET_DEVICE_ARGS` passes options to the device (`--poll`, ...).
//! Memory: the halo at N = 512 holds 1 GiB per rank (and as much in each
//! MPI run), Himeno L about 1 GiB per rank; the full run includes both.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::error::Error;
use std::process::ExitCode;
use std::rc::Rc;
use std::time::Instant;

use pindown_benches::child::run_ranks;
use pindown_benches::mpi::{self, Flavor, GasnetMode, Program};
use pindown_benches::raw_write::{self, fill, stamp, stamped, whole};
use pindown_benches::stats::Summary;
use pindown_benches::traces::SplitMix64;
use pindown_driver::launch::{device_socket, Job};
use pindown_driver::verbs::Context;
use pindown_messaging::gasnet::descriptor_cache::{CacheConfig, DescriptorCache, Replacement};
use pindown_messaging::gasnet::{Config, Endpoint, GetMode, Handlers};
use serde_json::{json, Value};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("--device") => return pindown_emu_device::cli::main(args),
        Some("--rank") => {
            return match rank_main(&args[1..]) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("gasnet rank: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        _ => {}
    }
    if args.iter().any(|a| a == "--help" || a == "-h") {
        eprintln!(
            "usage: gasnet [--quick] [sizes=B,..] [iterations=K] [ns=N,..] \
             [halo_iterations=K] [himeno=XS:20,S:5,..]\n\
             prints one JSON document (see the source's header); key=value \
             arguments override the plan of --quick or of the full run"
        );
        return ExitCode::SUCCESS;
    }
    let quick = args.iter().any(|a| a == "--quick");
    let mut plan = Plan::new(quick);
    let overrides: Vec<String> = args.iter().filter(|a| a.contains('=')).cloned().collect();
    if let Some(bad) = args.iter().find(|a| !a.contains('=') && *a != "--quick") {
        eprintln!("gasnet: unknown argument {bad} (--help)");
        return ExitCode::from(2);
    }
    if let Err(e) = plan.apply(&overrides) {
        eprintln!("gasnet: {e}");
        return ExitCode::from(2);
    }
    match run(quick, plan) {
        Ok(report) => {
            println!("{}", serde_json::to_string_pretty(&report).expect("json"));
            if report["verified"] == true {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("gasnet: {e}");
            ExitCode::FAILURE
        }
    }
}

/// A Himeno grid (the benchmark's names and sizes, i x j x k).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Grid {
    name: &'static str,
    ni: usize,
    nj: usize,
    nk: usize,
}

const GRIDS: [Grid; 4] = [
    Grid {
        name: "XS",
        ni: 32,
        nj: 32,
        nk: 64,
    },
    Grid {
        name: "S",
        ni: 64,
        nj: 64,
        nk: 128,
    },
    Grid {
        name: "M",
        ni: 128,
        nj: 128,
        nk: 256,
    },
    Grid {
        name: "L",
        ni: 256,
        nj: 256,
        nk: 512,
    },
];

fn grid(name: &str) -> Result<Grid, String> {
    GRIDS
        .into_iter()
        .find(|g| g.name == name)
        .ok_or(format!("no Himeno grid {name:?}"))
}

/// What one run measures.
#[derive(Clone, Debug)]
struct Plan {
    /// Ping-pong and get sizes (bytes).
    sizes: Vec<usize>,
    /// Timed iterations per size (fewer above 64 KiB, as the MPI programs).
    iterations: usize,
    /// Halo N.
    ns: Vec<usize>,
    /// Timed halo round trips per (N, face) (fewer for faces above 64 KiB).
    halo_iterations: usize,
    /// Himeno grids and their iteration counts.
    himeno: Vec<(Grid, usize)>,
    /// How gets move (`get=native|message`), for the rank processes.
    get: GetMode,
}

impl Plan {
    fn new(quick: bool) -> Plan {
        if quick {
            Plan {
                sizes: vec![8, 4096, 65536, 1 << 20],
                iterations: 200,
                ns: vec![4, 16, 64],
                halo_iterations: 100,
                himeno: vec![(GRIDS[0], 20)],
                get: GetMode::Native,
            }
        } else {
            Plan {
                sizes: (3..=22).map(|s| 1usize << s).collect(),
                iterations: 1000,
                ns: vec![4, 8, 16, 32, 64, 128, 256, 512],
                halo_iterations: 1000,
                // The paper runs 1000 iterations; M and L fewer here, to
                // keep the run bounded (iterations per second is the
                // figure).
                himeno: vec![
                    (GRIDS[0], 1000),
                    (GRIDS[1], 300),
                    (GRIDS[2], 60),
                    (GRIDS[3], 10),
                ],
                get: GetMode::Native,
            }
        }
    }

    /// The rank processes' arguments.
    fn args(&self) -> Vec<String> {
        let list = |v: &[usize]| v.iter().map(usize::to_string).collect::<Vec<_>>().join(",");
        let himeno: Vec<String> = self
            .himeno
            .iter()
            .map(|(g, n)| format!("{}:{n}", g.name))
            .collect();
        vec![
            format!("sizes={}", list(&self.sizes)),
            format!("iterations={}", self.iterations),
            format!("ns={}", list(&self.ns)),
            format!("halo_iterations={}", self.halo_iterations),
            format!("himeno={}", himeno.join(",")),
            format!(
                "get={}",
                match self.get {
                    GetMode::Native => "native",
                    GetMode::ByMessage => "message",
                }
            ),
        ]
    }

    fn parse(args: &[String]) -> Result<Plan, Box<dyn Error>> {
        let mut plan = Plan::new(true);
        plan.apply(args)?;
        Ok(plan)
    }

    /// Overrides from `key=value` arguments (`sizes=8,64`, `iterations=K`,
    /// `ns=4,8`, `halo_iterations=K`, `himeno=XS:20,S:5`,
    /// `get=native|message`).
    fn apply(&mut self, args: &[String]) -> Result<(), Box<dyn Error>> {
        let plan = self;
        for arg in args {
            let (key, value) = arg.split_once('=').ok_or(format!("bad argument {arg}"))?;
            let list = || -> Result<Vec<usize>, String> {
                value
                    .split(',')
                    .map(|v| v.parse().map_err(|_| format!("{key}: {v:?}")))
                    .collect()
            };
            match key {
                "sizes" => plan.sizes = list()?,
                "ns" => plan.ns = list()?,
                "iterations" => plan.iterations = value.parse()?,
                "halo_iterations" => plan.halo_iterations = value.parse()?,
                "himeno" => {
                    plan.himeno = value
                        .split(',')
                        .map(|item| {
                            let (name, n) = item.split_once(':').ok_or("himeno=NAME:ITERATIONS")?;
                            Ok((grid(name)?, n.parse().map_err(|_| "himeno iterations")?))
                        })
                        .collect::<Result<_, String>>()?
                }
                "get" => {
                    plan.get = match value {
                        "native" => GetMode::Native,
                        "message" => GetMode::ByMessage,
                        other => return Err(format!("get={other}").into()),
                    }
                }
                _ => return Err(format!("unknown key {key}").into()),
            }
        }
        Ok(())
    }
}

/// Iterations for `bytes`, scaled down above 64 KiB as the MPI programs do.
fn iterations_for(bytes: usize, base: usize) -> usize {
    if bytes <= 64 << 10 {
        base
    } else {
        (base * (64 << 10) / bytes).max(base.min(20))
    }
}

// ---- the launcher ----

fn device_args() -> Vec<String> {
    std::env::var("GASNET_DEVICE_ARGS")
        .map(|a| a.split_whitespace().map(String::from).collect())
        .unwrap_or_default()
}

fn ranks(exe: &std::path::Path, mode: &str, plan: &Plan) -> Result<Vec<Value>, Box<dyn Error>> {
    let device_args = device_args();
    let device_args: Vec<&str> = device_args.iter().map(String::as_str).collect();
    run_ranks(exe, 2, mode, &plan.args(), &device_args)
}

fn run(quick: bool, plan: Plan) -> Result<Value, Box<dyn Error>> {
    let exe = std::env::current_exe()?;
    eprintln!("gasnet: long-AM ping-pong, raw RDMA write ping-pong, native get");
    let am = ranks(&exe, "am", &plan)?;
    eprintln!("gasnet: get by message");
    let by_message = ranks(
        &exe,
        "get",
        &Plan {
            get: GetMode::ByMessage,
            ..plan.clone()
        },
    )?;
    eprintln!("gasnet: repeated puts through the descriptor cache");
    let mut puts = Vec::new();
    for mode in ["puts-off", "puts-cached", "puts-promoted"] {
        puts.extend(ranks(&exe, mode, &plan)?);
    }
    eprintln!("gasnet: halo exchange");
    let halo = ranks(&exe, "halo", &plan)?;
    eprintln!("gasnet: Himeno");
    let himeno = ranks(&exe, "himeno", &plan)?;
    let pick = |figures: &[Value], test: &str| -> Vec<Value> {
        figures
            .iter()
            .filter(|f| f["test"] == test)
            .cloned()
            .collect()
    };
    let ours = json!({
        "am_short_round_trip": pick(&am, "am_short_round_trip"),
        "am_pingpong": pick(&am, "am_pingpong"),
        "rdma_write_pingpong": pick(&am, "rdma_write_pingpong"),
        "get_native": pick(&am, "get"),
        "get_by_message": pick(&by_message, "get"),
        "halo": halo,
        "himeno": himeno,
        "repeated_puts": puts,
    });

    let mut peers = serde_json::Map::new();
    let mut notes = vec![format!(
        "Himeno iterations per grid: {:?} (the paper: 1000)",
        plan.himeno
            .iter()
            .map(|(g, n)| format!("{}:{n}", g.name))
            .collect::<Vec<_>>()
    )];
    let dir = tempfile::tempdir()?;
    let list = |v: &[usize]| v.iter().map(usize::to_string).collect::<Vec<_>>().join(",");
    for flavor in Flavor::ALL {
        if let Some(missing) = flavor.missing() {
            if mpi::under_ci() {
                return Err(format!("{}: {missing}", flavor.name()).into());
            }
            notes.push(format!("{} not measured: {missing}", flavor.name()));
            continue;
        }
        eprintln!("gasnet: {}", flavor.name());
        let compare = mpi::build(flavor, Program::GasnetCompare, dir.path())?;
        let sizes = format!("sizes={}", list(&plan.sizes));
        let iterations = format!("iterations={}", plan.iterations);
        let pingpong = mpi::run_gasnet_compare(
            flavor,
            &compare,
            GasnetMode::PingPong,
            &[&sizes, &iterations],
        )?;
        let get =
            mpi::run_gasnet_compare(flavor, &compare, GasnetMode::Get, &[&sizes, &iterations])?;
        let halo_binary = mpi::build(flavor, Program::Halo, dir.path())?;
        let ns = format!("sizes={}", list(&plan.ns));
        let halo_iterations = format!("iterations={}", plan.halo_iterations);
        let halo = mpi::run_halo(
            flavor,
            &halo_binary,
            2,
            &["pattern=pingpong", &ns, &halo_iterations],
        )?;
        let himeno_binary = mpi::build(flavor, Program::Himeno, dir.path())?;
        let mut himeno = Vec::new();
        for (grid, n) in &plan.himeno {
            himeno.extend(mpi::run_himeno(
                flavor,
                &himeno_binary,
                2,
                &[&format!("sizes={}", grid.name), &format!("iterations={n}")],
            )?);
        }
        peers.insert(
            flavor.name().to_string(),
            json!({"pingpong": pingpong, "get": get, "halo": halo, "himeno": himeno}),
        );
    }

    eprintln!("gasnet: descriptor cache");
    let cache = descriptor_cache_figures(quick);
    let mut verified = true;
    let targets = targets(&ours, &peers, &mut verified);
    Ok(json!({
        "benchmark": "gasnet",
        "quick": quick,
        "plan": plan.args(),
        "pindown": ours,
        "mpi": peers,
        "descriptor_cache": cache,
        "targets": targets,
        "notes": notes,
        "verified": verified,
    }))
}

/// The descriptor cache (section 4.4) on the paper's case: a stencil's
/// fixed transfers (`HOT` keys, each used once per iteration) among
/// transfers that do not repeat much (uniform over `COLD` keys, `cold_per_iteration`
/// of them per iteration), with room for `CAPACITY` descriptors; each
/// policy's hits, evictions and promotions (after `PROMOTE_AFTER` uses),
/// and the time per lookup on this machine. The hot transfers are what a
/// cache must keep: LFU and first come keep them, LRU loses them to the
/// cold stream when it is long enough.
fn descriptor_cache_figures(quick: bool) -> Value {
    const HOT: u64 = 6;
    const COLD: u64 = 4096;
    const CAPACITY: usize = 16;
    const PROMOTE_AFTER: u32 = 8;
    let iterations = if quick { 2_000 } else { 20_000 };
    let mut figures = Vec::new();
    for cold_per_iteration in [2u64, 16] {
        for policy in [Replacement::Lru, Replacement::Lfu, Replacement::FirstCome] {
            // Keys: (source, destination, size), as the endpoint's.
            let mut cache: DescriptorCache<(u64, u64, u64), u64, u64> =
                DescriptorCache::new(CacheConfig {
                    capacity: CAPACITY,
                    policy,
                    promote_after: Some(PROMOTE_AFTER),
                });
            let mut rng = SplitMix64::new(0x9a5e7);
            let mut hot_hits = 0u64;
            let start = Instant::now();
            for _ in 0..iterations {
                for i in 0..HOT + cold_per_iteration {
                    let key = if i < HOT {
                        (0x1000 * i, 0x10_0000 + 0x1000 * i, 8 << 10)
                    } else {
                        let k = 1 + HOT + rng.below(COLD as usize) as u64;
                        (0x1000 * k, 0x10_0000 + 0x1000 * k, 64)
                    };
                    let lookup =
                        cache.lookup_or_insert_with(key, |k| k.0 ^ k.1, |_, v| v.rotate_left(7));
                    if i < HOT && lookup.outcome.is_hit() {
                        hot_hits += 1;
                    }
                }
            }
            let elapsed = start.elapsed().as_secs_f64();
            let c = cache.counters();
            figures.push(json!({
                "policy": format!("{policy:?}"),
                "capacity": CAPACITY,
                "hot_transfers": HOT,
                "cold_per_iteration": cold_per_iteration,
                "iterations": iterations,
                "lookups": c.lookups,
                "hits": c.hits,
                "hit_rate": c.hits as f64 / c.lookups as f64,
                "hot_hit_rate": hot_hits as f64 / (HOT * iterations) as f64,
                "promoted_hits": c.promoted_hits,
                "misses": c.misses,
                "bypasses": c.bypasses,
                "evictions": c.evictions,
                "promotions": c.promotions,
                "ns_per_lookup": elapsed * 1e9 / c.lookups as f64,
            }));
        }
    }
    Value::Array(figures)
}

fn number(v: &Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}

/// The ratios and the targets; clears `verified` when a figure is
/// missing, data arrived wrong or Himeno results disagree.
fn targets(
    ours: &Value,
    peers: &serde_json::Map<String, Value>,
    verified: &mut bool,
) -> Vec<Value> {
    let mut out = Vec::new();
    let list = |v: &Value| v.as_array().cloned().unwrap_or_default();
    // AM round trips over the 8-byte RDMA write round trip: the short
    // request and reply (the target), and the long-AM ping-pong of 8 bytes.
    let at8 = |figures: &Value| list(figures).into_iter().find(|f| f["bytes"] == 8);
    let short = list(&ours["am_short_round_trip"]).into_iter().next();
    match (
        short,
        at8(&ours["am_pingpong"]),
        at8(&ours["rdma_write_pingpong"]),
    ) {
        (Some(short), Some(long), Some(raw)) => {
            let raw_round_trip = 2.0 * number(&raw["latency_us"]);
            let ratio = number(&short["round_trip_us"]) / raw_round_trip;
            out.push(
                json!({"target": "AM round trip <= 2x the 8-byte RDMA write round trip",
                "am_round_trip_us": short["round_trip_us"],
                "rdma_write_round_trip_us": raw_round_trip,
                "ratio": ratio, "met": ratio <= 2.0}),
            );
            let long_round_trip = 2.0 * number(&long["latency_us"]);
            out.push(
                json!({"figure": "8-byte long-AM round trip over the 8-byte RDMA write round trip",
                "am_round_trip_us": long_round_trip,
                "rdma_write_round_trip_us": raw_round_trip,
                "ratio": long_round_trip / raw_round_trip}),
            );
        }
        _ => *verified = false,
    }
    // Halo speedup per (N, face) against each MPI's vector datatype.
    let halo = list(&ours["halo"]);
    if halo.is_empty() {
        *verified = false;
    }
    for figure in &halo {
        if figure["verified"] != true {
            *verified = false;
        }
    }
    for (name, peer) in peers {
        let theirs = list(&peer["halo"]);
        let mut all_met = true;
        let mut points = Vec::new();
        for figure in &halo {
            let find = |datatype: &str| {
                theirs
                    .iter()
                    .find(|t| {
                        t["n"] == figure["n"]
                            && t["face"] == figure["face"]
                            && t["datatype"] == datatype
                    })
                    .map(|t| number(&t["time_us"]))
            };
            let ours_us = number(&figure["time_us"]);
            if let Some(vector_us) = find("vector") {
                let speedup = vector_us / ours_us;
                all_met &= speedup >= 1.5;
                points.push(
                    json!({"n": figure["n"], "face": figure["face"], "ours_us": ours_us,
                    "mpi_vector_us": vector_us, "mpi_subarray_us": find("subarray"),
                    "speedup": speedup, "met": speedup >= 1.5}),
                );
            }
        }
        out.push(json!({"target": format!("halo exchange >= 1.5x faster than {name} with derived datatypes, every N"),
            "met": all_met && !points.is_empty(), "points": points}));
        // AM ping-pong and get against the MPI's, per size.
        let ratio_list = |ours: &Value, theirs: &Value| -> Vec<Value> {
            list(ours)
                .into_iter()
                .filter_map(|f| {
                    let t = list(theirs)
                        .into_iter()
                        .find(|t| t["bytes"] == f["bytes"])?;
                    Some(json!({"bytes": f["bytes"], "ours_us": f["latency_us"],
                        "mpi_us": t["latency_us"],
                        "ratio": number(&f["latency_us"]) / number(&t["latency_us"])}))
                })
                .collect()
        };
        out.push(
            json!({"figure": format!("long-AM one-way latency over {name}'s ping-pong"),
            "points": ratio_list(&ours["am_pingpong"], &peer["pingpong"])}),
        );
        out.push(
            json!({"figure": format!("native get latency over {name}'s MPI_Get"),
            "points": ratio_list(&ours["get_native"], &peer["get"])}),
        );
        // Himeno: speed and agreement.
        for figure in list(&ours["himeno"]) {
            let Some(theirs) = list(&peer["himeno"])
                .into_iter()
                .find(|t| t["size"] == figure["size"] && t["iterations"] == figure["iterations"])
            else {
                *verified = false;
                continue;
            };
            let (a, b) = (number(&figure["gosa"]), number(&theirs["gosa"]));
            let (pa, pb) = (number(&figure["p_sum"]), number(&theirs["p_sum"]));
            // Same arithmetic in the same order: gosa agrees to float
            // rounding of the sum, p to the digits printed.
            let agree = (a - b).abs() <= 1e-5 * a.abs().max(b.abs())
                && (pa - pb).abs() <= 1e-10 * pa.abs().max(pb.abs());
            *verified &= agree;
            out.push(json!({"figure": format!("Himeno {} against {name}", figure["size"].as_str().unwrap_or("?")),
                "iterations": figure["iterations"],
                "ours_iterations_per_s": figure["iterations_per_s"],
                "mpi_iterations_per_s": theirs["iterations_per_s"],
                "speedup": number(&figure["iterations_per_s"]) / number(&theirs["iterations_per_s"]),
                "ours_gosa": a, "mpi_gosa": b, "ours_p_sum": pa, "mpi_p_sum": pb,
                "agree": agree}));
        }
    }
    for key in [
        "am_short_round_trip",
        "am_pingpong",
        "get_native",
        "get_by_message",
        "himeno",
    ] {
        if list(&ours[key]).is_empty() {
            *verified = false;
        }
    }
    out
}

// ---- the rank processes ----

/// Handler indices.
const H_ARRIVE: u8 = 1;
const H_NOTIFY: u8 = 2;
const H_DONE: u8 = 3;
const H_GOSA: u8 = 4;
const H_SUM: u8 = 5;
const H_PING: u8 = 6;
const H_PONG: u8 = 7;

/// What the handlers record.
#[derive(Default)]
struct State {
    /// The last long message's number (args[0]) and whether its bytes were
    /// right.
    arrived: Cell<u64>,
    wrong: Cell<u64>,
    /// Notices per source (halo planes that arrived).
    notified: RefCell<Vec<u64>>,
    done: Cell<bool>,
    /// Residuals (iteration, source) -> value.
    gosa: RefCell<HashMap<(u32, u32), f32>>,
    /// Sums of p per source.
    sums: RefCell<HashMap<u32, f64>>,
    /// The last short reply's number.
    ponged: Cell<u64>,
    /// Short requests that could not be answered.
    unanswered: Cell<u64>,
}

fn handlers(state: &Rc<State>, size: usize) -> Handlers {
    *state.notified.borrow_mut() = vec![0; size];
    let mut h = Handlers::new();
    let s = state.clone();
    h.register(H_ARRIVE, move |_token, args, payload| {
        let n = u64::from(args[0]);
        let last = args[1] != 0;
        if !stamped(payload, n) || (last && !whole(payload, n)) {
            s.wrong.set(s.wrong.get() + 1);
        }
        s.arrived.set(n);
    });
    let s = state.clone();
    h.register(H_NOTIFY, move |token, args, _| {
        let mut notified = s.notified.borrow_mut();
        let source = token.source() as usize;
        notified[source] = notified[source].max(u64::from(args[0]));
    });
    let s = state.clone();
    h.register(H_DONE, move |_, _, _| s.done.set(true));
    let s = state.clone();
    h.register(H_GOSA, move |token, args, _| {
        s.gosa
            .borrow_mut()
            .insert((args[0], token.source()), f32::from_bits(args[1]));
    });
    let s = state.clone();
    h.register(H_PING, move |token, args, _| {
        if token.reply_short(H_PONG, args).is_err() {
            s.unanswered.set(s.unanswered.get() + 1);
        }
    });
    let s = state.clone();
    h.register(H_PONG, move |_, args, _| s.ponged.set(u64::from(args[0])));
    let s = state.clone();
    h.register(H_SUM, move |token, args, _| {
        let bits = u64::from(args[0]) | (u64::from(args[1]) << 32);
        s.sums
            .borrow_mut()
            .insert(token.source(), f64::from_bits(bits));
    });
    h
}

fn rank_main(args: &[String]) -> Result<(), Box<dyn Error>> {
    let mode = args.first().ok_or("a mode")?.clone();
    let plan = Plan::parse(&args[1..])?;
    let mut job = Job::from_environment()?;
    let segment_bytes = match mode.as_str() {
        "am" | "get" => plan.sizes.iter().copied().max().unwrap_or(8),
        "puts-off" | "puts-cached" | "puts-promoted" => {
            PUT_SIZES.iter().copied().max().unwrap_or(8)
        }
        "halo" => plan.ns.iter().map(|n| n * n * n * 8).max().unwrap_or(4096),
        "himeno" => plan
            .himeno
            .iter()
            .map(|(g, _)| himeno_local_floats(g, job.size() as usize, 0) * 4)
            .max()
            .unwrap_or(4096),
        other => return Err(format!("unknown mode {other}").into()),
    }
    .next_multiple_of(4096)
    .max(1 << 20);
    let mut context_config = pindown_messaging::context_config();
    // The segment, rings and staging live in the arena; the segment and
    // the sources are registered.
    context_config.arena_bytes = segment_bytes + (64 << 20);
    context_config.cache.max_pinned_bytes = Some(2 * segment_bytes + (256 << 20));
    let context = Context::open(device_socket(&job)?, context_config)?;
    let state = Rc::new(State::default());
    let config = Config {
        segment_bytes,
        get: plan.get,
        get_bounce_bytes: 256 << 10,
        ..Config::default()
    };
    let config = Config {
        descriptor_cache: match mode.as_str() {
            "puts-cached" => Some(CacheConfig {
                capacity: 64,
                policy: Replacement::Lru,
                promote_after: None,
            }),
            "puts-promoted" => Some(CacheConfig {
                capacity: 64,
                policy: Replacement::Lru,
                promote_after: Some(2),
            }),
            _ => None,
        },
        ..config
    };
    let handlers = handlers(&state, job.size() as usize);
    let raw = if mode == "am" {
        // The raw RDMA write ping-pong first, on its own queue pair.
        let sizes: Vec<raw_write::Size> = plan
            .sizes
            .iter()
            .map(|&bytes| {
                let iterations = iterations_for(bytes, plan.iterations);
                raw_write::Size {
                    bytes,
                    warmup: (iterations / 10).max(1),
                    iterations,
                }
            })
            .collect();
        let spin = pindown_messaging::Config::default().spin;
        Some(raw_write::ping_pong(
            &context,
            &mut job,
            "gasnet-raw",
            &sizes,
            spin,
        )?)
    } else {
        None
    };
    let mut ep = Endpoint::new(&context, &mut job, config, handlers)?;
    ep.barrier()?;
    let mut figures = Vec::new();
    if let Some(raw) = raw {
        for (&bytes, mut times) in plan.sizes.iter().zip(raw) {
            if ep.rank() == 0 {
                let s = Summary::of(&mut times);
                figures.push(json!({"test": "rdma_write_pingpong", "bytes": bytes,
                    "iterations": times.len(), "latency_us": s.median,
                    "bandwidth_gbs": bytes as f64 / s.median / 1e3}));
            }
        }
        figures.extend(am_pingpong(&mut ep, &state, &plan)?);
        figures.extend(short_round_trip(&mut ep, &state, &plan)?);
    }
    match mode.as_str() {
        "am" | "get" => figures.extend(get_latency(&mut ep, &state, &plan)?),
        "halo" => figures.extend(halo(&mut ep, &state, &plan)?),
        "himeno" => figures.extend(himeno(&mut ep, &state, &plan)?),
        "puts-off" | "puts-cached" | "puts-promoted" => {
            figures.extend(repeated_puts(&mut ep, &mode, &plan)?)
        }
        _ => unreachable!("checked above"),
    }
    ep.barrier()?;
    if ep.rank() == 0 {
        for figure in figures {
            println!("{figure}");
        }
    }
    Ok(())
}

/// Sizes of the repeated puts through the descriptor cache.
const PUT_SIZES: [usize; 3] = [4096, 64 << 10, 1 << 20];

/// Repeated blocking puts of one buffer to one place in rank 1's segment
/// (what a stencil's halo does each iteration), by rank 0, for each of
/// [`PUT_SIZES`]: the descriptor cache off, on (a hit skips the
/// pin-down cache's lookup), or promoting after two uses (prebuilt work
/// requests). The last put of each size is read back and compared.
fn repeated_puts(
    ep: &mut Endpoint<'_>,
    mode: &str,
    plan: &Plan,
) -> Result<Vec<Value>, Box<dyn Error>> {
    let mut figures = Vec::new();
    if ep.rank() != 0 {
        return Ok(figures);
    }
    for &bytes in &PUT_SIZES {
        let iterations = iterations_for(bytes, plan.iterations);
        let mut source = vec![0u8; bytes];
        let mut times = Vec::with_capacity(iterations);
        for n in 0..(iterations + iterations / 10 + 1) as u64 {
            stamp(&mut source, n);
            let start = Instant::now();
            ep.put(1, 0, &source)?;
            if n > (iterations / 10) as u64 {
                times.push(start.elapsed().as_secs_f64() * 1e6);
            }
        }
        fill(&mut source, u64::MAX);
        ep.put(1, 0, &source)?;
        let mut back = vec![0u8; bytes];
        ep.get(1, 0, &mut back)?;
        if back != source {
            return Err(format!("{mode}: a put of {bytes} bytes did not land as sent").into());
        }
        let s = Summary::of(&mut times);
        let cache = ep.descriptor_counters();
        figures.push(
            json!({"test": "repeated_puts", "cache": mode, "bytes": bytes,
            "iterations": times.len(), "latency_us": s.median,
            "hits": cache.map(|c| c.hits), "promoted_hits": cache.map(|c| c.promoted_hits),
            "prebuilt_writes": ep.counters().prebuilt_writes}),
        );
    }
    Ok(figures)
}

/// The long-AM ping-pong: rank 0 writes `bytes` into rank 1's segment
/// with a long request (numbered), whose handler checks them; rank 1
/// answers the same way when it has seen the number.
fn am_pingpong(
    ep: &mut Endpoint<'_>,
    state: &Rc<State>,
    plan: &Plan,
) -> Result<Vec<Value>, Box<dyn Error>> {
    let me = ep.rank();
    let peer = 1 - me;
    let mut figures = Vec::new();
    let mut n = 0u64;
    for &bytes in &plan.sizes {
        let iterations = iterations_for(bytes, plan.iterations);
        let warmup = (iterations / 10).max(1);
        let last = n + (warmup + iterations) as u64;
        let first_timed = n + warmup as u64 + 1;
        let mut payload = vec![0u8; bytes];
        let mut times = Vec::with_capacity(iterations);
        while n < last {
            n += 1;
            if n == last {
                fill(&mut payload, n);
            } else {
                stamp(&mut payload, n);
            }
            let args = [n as u32, u32::from(n == last)];
            if me == 0 {
                let start = Instant::now();
                ep.request_long(peer, H_ARRIVE, &args, &payload, 0)?;
                ep.wait_until(|_| state.arrived.get() == n)?;
                let elapsed = start.elapsed();
                if n >= first_timed {
                    times.push(elapsed.as_secs_f64() * 1e6 / 2.0);
                }
            } else {
                ep.wait_until(|_| state.arrived.get() == n)?;
                ep.request_long(peer, H_ARRIVE, &args, &payload, 0)?;
            }
        }
        if state.wrong.get() != 0 {
            return Err(format!(
                "rank {me}: {} long messages arrived wrong",
                state.wrong.get()
            )
            .into());
        }
        if me == 0 {
            let s = Summary::of(&mut times);
            figures.push(
                json!({"test": "am_pingpong", "bytes": bytes, "iterations": iterations,
                "latency_us": s.median, "latency_us_p99": s.p99,
                "bandwidth_gbs": bytes as f64 / s.median / 1e3}),
            );
        }
    }
    ep.barrier()?;
    Ok(figures)
}

/// The short-AM round trip (GASNet's canonical one): rank 0 sends a short
/// request, rank 1's handler answers with a short reply from inside the
/// handler; rank 0 waits for the reply's handler to have run.
fn short_round_trip(
    ep: &mut Endpoint<'_>,
    state: &Rc<State>,
    plan: &Plan,
) -> Result<Vec<Value>, Box<dyn Error>> {
    let iterations = plan.iterations;
    let warmup = (iterations / 10).max(1);
    let mut figures = Vec::new();
    if ep.rank() == 0 {
        let mut times = Vec::with_capacity(iterations);
        for n in 1..=(warmup + iterations) as u64 {
            let start = Instant::now();
            ep.request_short(1, H_PING, &[n as u32])?;
            ep.wait_until(|_| state.ponged.get() == n)?;
            if n > warmup as u64 {
                times.push(start.elapsed().as_secs_f64() * 1e6);
            }
        }
        ep.request_short(1, H_DONE, &[])?;
        let s = Summary::of(&mut times);
        figures.push(
            json!({"test": "am_short_round_trip", "iterations": iterations,
            "round_trip_us": s.median, "round_trip_us_p99": s.p99}),
        );
    } else {
        ep.wait_until(|_| state.done.get())?;
        state.done.set(false);
        if state.unanswered.get() != 0 {
            return Err(format!("{} short requests not answered", state.unanswered.get()).into());
        }
    }
    ep.barrier()?;
    Ok(figures)
}

/// Get latency: rank 1 stamps its segment and waits (serving gets by
/// message); rank 0 gets each size, checks the first and the last get.
fn get_latency(
    ep: &mut Endpoint<'_>,
    state: &Rc<State>,
    plan: &Plan,
) -> Result<Vec<Value>, Box<dyn Error>> {
    const SEED: u64 = 0x6e7;
    let me = ep.rank();
    let largest = plan.sizes.iter().copied().max().unwrap_or(8);
    if me == 1 {
        fill(&mut ep.segment()[..largest], SEED);
    }
    ep.barrier()?;
    let mut figures = Vec::new();
    if me == 0 {
        let mode = match plan.get {
            GetMode::Native => "native",
            GetMode::ByMessage => "message",
        };
        let mut buffer = vec![0u8; largest];
        for &bytes in &plan.sizes {
            let iterations = iterations_for(bytes, plan.iterations);
            let warmup = (iterations / 10).max(1);
            let destination = &mut buffer[..bytes];
            let mut times = Vec::with_capacity(iterations);
            for i in 0..warmup + iterations + 2 {
                if i == 0 || i == warmup + iterations + 1 {
                    destination.fill(0);
                    ep.get(1, 0, destination)?;
                    if !whole(destination, SEED) {
                        return Err(
                            format!("a get of {bytes} bytes ({mode}) read wrong bytes").into()
                        );
                    }
                    continue;
                }
                let start = Instant::now();
                ep.get(1, 0, destination)?;
                let elapsed = start.elapsed();
                if i > warmup {
                    times.push(elapsed.as_secs_f64() * 1e6);
                }
            }
            let s = Summary::of(&mut times);
            figures.push(json!({"test": "get", "mode": mode, "bytes": bytes,
                "iterations": iterations, "latency_us": s.median, "latency_us_p99": s.p99,
                "bandwidth_gbs": bytes as f64 / s.median / 1e3}));
        }
        ep.request_short(1, H_DONE, &[])?;
    } else {
        ep.wait_until(|_| state.done.get())?;
    }
    Ok(figures)
}

// ---- halo ----

/// A face of the N^3 array: its name, its planes' distance (elements),
/// and its strided shape (GASNet VIS: counts in bytes first, strides in
/// bytes), the same on both sides.
#[derive(Clone, Copy)]
enum Face {
    Block,
    BlockStride,
    Stride,
}

impl Face {
    const ALL: [Face; 3] = [Face::Block, Face::BlockStride, Face::Stride];

    fn name(self) -> &'static str {
        match self {
            Face::Block => "block",
            Face::BlockStride => "blockstride",
            Face::Stride => "stride",
        }
    }

    fn plane_stride(self, n: usize) -> usize {
        match self {
            Face::Block => n * n,
            Face::BlockStride => n,
            Face::Stride => 1,
        }
    }

    /// (counts, strides) in bytes.
    fn shape(self, n: u64) -> (Vec<u64>, Vec<u64>) {
        match self {
            Face::Block => (vec![n * n * 8], vec![]),
            Face::BlockStride => (vec![n * 8, n], vec![n * n * 8]),
            Face::Stride => (vec![8, n * n], vec![n * 8]),
        }
    }

    /// Element (x, y, z) of plane `p`, for `i, j` in 0..n.
    fn element(self, p: usize, i: usize, j: usize) -> (usize, usize, usize) {
        match self {
            Face::Block => (p, i, j),
            Face::BlockStride => (i, p, j),
            Face::Stride => (i, j, p),
        }
    }
}

const SENTINEL: f64 = -1.0;

/// What rank `r`'s element (x, y, z) holds (as `halo.c`).
fn value_at(r: u32, n: usize, (x, y, z): (usize, usize, usize)) -> f64 {
    f64::from(r) * 1e9 + ((x * n + y) * n + z) as f64 + 0.5
}

/// Numbers every bit pattern of which is a value: what the segment may
/// be viewed as.
trait Plain: Copy {}
impl Plain for f32 {}
impl Plain for f64 {}

/// The first `count` values of type `T` in the segment.
fn segment_values<'a, T: Plain>(ep: &'a mut Endpoint<'_>, count: usize) -> &'a mut [T] {
    let segment = ep.segment();
    let size = std::mem::size_of::<T>();
    assert!(segment.len() >= count * size);
    assert_eq!(
        segment.as_ptr().align_offset(std::mem::align_of::<T>()),
        0,
        "the segment is page-aligned"
    );
    // SAFETY: the segment holds at least `count` values (asserted),
    // aligned for `T` (asserted); every bit pattern is a valid `T`
    // (`Plain`); the slice borrows the endpoint mutably, so no other
    // reference of this process touches the segment meanwhile (peers
    // write only ghost planes, and only between the notices the program
    // waits for).
    unsafe { std::slice::from_raw_parts_mut(segment.as_mut_ptr().cast::<T>(), count) }
}

/// The first `count` doubles of the segment.
fn doubles<'a>(ep: &'a mut Endpoint<'_>, count: usize) -> &'a mut [f64] {
    segment_values(ep, count)
}

/// Puts plane `from` of `face` of this rank's array into plane `to` of
/// `target`'s, with notice `n` behind it ([`put_notified`]).
fn put_face(
    ep: &mut Endpoint<'_>,
    target: u32,
    face: Face,
    n_size: usize,
    from: usize,
    to: usize,
    n: u64,
) -> Result<(), Box<dyn Error>> {
    let stride = (face.plane_stride(n_size) * 8) as u64;
    let (counts, strides) = face.shape(n_size as u64);
    let (from, to) = (from as u64 * stride, to as u64 * stride);
    put_notified(ep, target, to, from, &strides, &counts, n)
}

/// Puts the pattern (`strides`, `counts`) of this rank's segment at
/// `from` into `target`'s at `to`, and a notice numbered `n` right behind
/// it (it arrives after the bytes), then waits for the put. The source
/// is an interior plane: nothing of this process writes it during the
/// put (handlers only record notices), and peers write only this rank's
/// ghost planes.
fn put_notified(
    ep: &mut Endpoint<'_>,
    target: u32,
    to: u64,
    from: u64,
    strides: &[u64],
    counts: &[u64],
    n: u64,
) -> Result<(), Box<dyn Error>> {
    let put = ep.put_strided_nb(target, to, strides, from, strides, counts)?;
    ep.request_short(target, H_NOTIFY, &[n as u32])?;
    ep.wait(put)?;
    Ok(())
}

fn halo(
    ep: &mut Endpoint<'_>,
    state: &Rc<State>,
    plan: &Plan,
) -> Result<Vec<Value>, Box<dyn Error>> {
    let me = ep.rank();
    let peer = 1 - me;
    let mut figures = Vec::new();
    let mut n = 0u64;
    let notified = |state: &State| state.notified.borrow()[peer as usize];
    for &size in &plan.ns {
        let count = size * size * size;
        for face in Face::ALL {
            let bytes = size * size * 8;
            let iterations = iterations_for(bytes, plan.halo_iterations);
            let warmup = (iterations / 10).max(1);
            // One round trip: rank 0's plane N-2 into rank 1's ghost 0,
            // rank 1's plane 1 into rank 0's ghost N-1.
            let round = |ep: &mut Endpoint<'_>, n: u64| -> Result<(), Box<dyn Error>> {
                if me == 0 {
                    put_face(ep, peer, face, size, size - 2, 0, n)?;
                    ep.wait_until(|_| notified(state) >= n)?;
                } else {
                    ep.wait_until(|_| notified(state) >= n)?;
                    put_face(ep, peer, face, size, 1, size - 1, n)?;
                }
                Ok(())
            };
            let checked = |ep: &mut Endpoint<'_>, n: u64| -> Result<(), Box<dyn Error>> {
                let array = doubles(ep, count);
                for x in 0..size {
                    for y in 0..size {
                        for z in 0..size {
                            array[(x * size + y) * size + z] = value_at(me, size, (x, y, z));
                        }
                    }
                }
                for p in [0, size - 1] {
                    for i in 0..size {
                        for j in 0..size {
                            let (x, y, z) = face.element(p, i, j);
                            array[(x * size + y) * size + z] = SENTINEL;
                        }
                    }
                }
                ep.barrier()?;
                round(ep, n)?;
                let array = doubles(ep, count);
                let mut wrong = 0u64;
                // Rank 0 received into ghost N-1 (rank 1's plane 1), rank
                // 1 into ghost 0 (rank 0's plane N-2); the other ghost is
                // untouched, the planes next to them are this rank's.
                let (got, sent_plane, other) = if me == 0 {
                    (size - 1, 1, 0)
                } else {
                    (0, size - 2, size - 1)
                };
                for i in 0..size {
                    for j in 0..size {
                        let at = |p| {
                            let e = face.element(p, i, j);
                            (e, array[(e.0 * size + e.1) * size + e.2])
                        };
                        let (_, v) = at(got);
                        wrong +=
                            u64::from(v != value_at(peer, size, face.element(sent_plane, i, j)));
                        let (_, v) = at(other);
                        wrong += u64::from(v != SENTINEL);
                        for p in [1, size - 2] {
                            let (e, v) = at(p);
                            wrong += u64::from(v != value_at(me, size, e));
                        }
                    }
                }
                if wrong != 0 {
                    return Err(format!(
                        "rank {me}: halo N={size} {}: {wrong} elements wrong",
                        face.name()
                    )
                    .into());
                }
                ep.barrier()?;
                Ok(())
            };
            n += 1;
            checked(ep, n)?;
            let mut times = Vec::with_capacity(iterations);
            for i in 0..warmup + iterations {
                n += 1;
                let start = Instant::now();
                round(ep, n)?;
                if i >= warmup {
                    times.push(start.elapsed().as_secs_f64() * 1e6 / 2.0);
                }
            }
            n += 1;
            checked(ep, n)?;
            if me == 0 {
                let s = Summary::of(&mut times);
                figures.push(json!({"test": "halo", "pattern": "pingpong", "n": size,
                    "face": face.name(), "bytes": bytes, "iterations": iterations,
                    "time_us": s.median, "time_us_p99": s.p99,
                    "bandwidth_gbs": bytes as f64 / s.median / 1e3, "verified": true}));
            }
        }
    }
    Ok(figures)
}

// ---- Himeno ----

/// This rank's interior i-planes: (first global plane, count), as
/// `himeno.c` deals them.
fn share_of(ni: usize, ranks: usize, r: usize) -> (usize, usize) {
    let interior = ni - 2;
    let (base, extra) = (interior / ranks, interior % ranks);
    (1 + r * base + r.min(extra), base + usize::from(r < extra))
}

/// Floats of rank `r`'s local array (its planes and two ghosts).
fn himeno_local_floats(g: &Grid, ranks: usize, r: usize) -> usize {
    (share_of(g.ni, ranks, r).1 + 2) * g.nj * g.nk
}

/// The Himeno arrays but p (which lives in the segment).
struct Coefficients {
    a: [Vec<f32>; 4],
    b: [Vec<f32>; 3],
    c: [Vec<f32>; 3],
    bnd: Vec<f32>,
    wrk1: Vec<f32>,
    wrk2: Vec<f32>,
}

/// The first `count` floats of the segment.
fn floats<'a>(ep: &'a mut Endpoint<'_>, count: usize) -> &'a mut [f32] {
    segment_values(ep, count)
}

/// One Jacobi sweep (the Himeno kernel, with `himeno.c`'s arithmetic in
/// its order), then wrk2 copied into p; returns this rank's part of gosa.
/// Row by row: each (i, j) takes the k-rows of p and of the coefficients
/// it reads as slices of exactly `nk`, so the inner loop has no bounds
/// checks to make.
fn sweep(k: &mut Coefficients, p: &mut [f32], li: usize, nj: usize, nk: usize) -> f32 {
    let omega = 0.8f32;
    let mut gosa = 0.0f32;
    let at = |i: usize, j: usize| (i * nj + j) * nk;
    for i in 1..li - 1 {
        for j in 1..nj - 1 {
            let x = at(i, j);
            let row = |v, i, j| k_row(v, at(i, j), nk);
            let p: &[f32] = p;
            let (pc, pip, pim) = (row(p, i, j), row(p, i + 1, j), row(p, i - 1, j));
            let (pjp, pjm) = (row(p, i, j + 1), row(p, i, j - 1));
            let (pipjp, pipjm) = (row(p, i + 1, j + 1), row(p, i + 1, j - 1));
            let (pimjp, pimjm) = (row(p, i - 1, j + 1), row(p, i - 1, j - 1));
            let c = |v| k_row(v, x, nk);
            let (a0, a1, a2, a3) = (c(&k.a[0]), c(&k.a[1]), c(&k.a[2]), c(&k.a[3]));
            let (b0, b1, b2) = (c(&k.b[0]), c(&k.b[1]), c(&k.b[2]));
            let (c0, c1, c2) = (c(&k.c[0]), c(&k.c[1]), c(&k.c[2]));
            let (bnd, wrk1) = (c(&k.bnd), c(&k.wrk1));
            let wrk2 = &mut k.wrk2[x..x + nk];
            for kk in 1..nk - 1 {
                let s0 = a0[kk] * pip[kk]
                    + a1[kk] * pjp[kk]
                    + a2[kk] * pc[kk + 1]
                    + b0[kk] * (pipjp[kk] - pipjm[kk] - pimjp[kk] + pimjm[kk])
                    + b1[kk] * (pjp[kk + 1] - pjm[kk + 1] - pjp[kk - 1] + pjm[kk - 1])
                    + b2[kk] * (pip[kk + 1] - pim[kk + 1] - pip[kk - 1] + pim[kk - 1])
                    + c0[kk] * pim[kk]
                    + c1[kk] * pjm[kk]
                    + c2[kk] * pc[kk - 1]
                    + wrk1[kk];
                let ss = (s0 * a3[kk] - pc[kk]) * bnd[kk];
                gosa += ss * ss;
                wrk2[kk] = pc[kk] + omega * ss;
            }
        }
    }
    for i in 1..li - 1 {
        for j in 1..nj - 1 {
            let x = at(i, j);
            p[x + 1..x + nk - 1].copy_from_slice(&k.wrk2[x + 1..x + nk - 1]);
        }
    }
    gosa
}

/// The `nk` floats of `v` from `start`.
fn k_row(v: &[f32], start: usize, nk: usize) -> &[f32] {
    &v[start..start + nk]
}

/// The Himeno run on every rank: per iteration, the sweep; the residual
/// summed over the ranks by short AMs (which also tells every rank that
/// every other has finished reading its ghost planes); then each boundary
/// plane put into the neighbour's ghost plane by `put_strided` and a
/// notice, and the neighbours' notices awaited. (MPI's order is sweep,
/// halo, sum; the sum first here lets the puts go straight into the ghost
/// planes, as one-sided writes cannot wait for the neighbour to finish
/// reading. The arithmetic is the same.)
fn himeno(
    ep: &mut Endpoint<'_>,
    state: &Rc<State>,
    plan: &Plan,
) -> Result<Vec<Value>, Box<dyn Error>> {
    let me = ep.rank() as usize;
    let ranks = ep.size() as usize;
    let mut figures = Vec::new();
    let mut n = 0u32;
    for &(g, iterations) in &plan.himeno {
        if g.ni - 2 < ranks {
            return Err(format!("Himeno {}: more ranks than i-planes", g.name).into());
        }
        let (first, count) = share_of(g.ni, ranks, me);
        let (nj, nk) = (g.nj, g.nk);
        let li = count + 2;
        let plane = nj * nk;
        let total = li * plane;
        let filled = |v: f32| vec![v; total];
        let mut k = Coefficients {
            a: [filled(1.0), filled(1.0), filled(1.0), filled(1.0 / 6.0)],
            b: [filled(0.0), filled(0.0), filled(0.0)],
            c: [filled(1.0), filled(1.0), filled(1.0)],
            bnd: filled(1.0),
            wrk1: filled(0.0),
            wrk2: filled(0.0),
        };
        let denominator = ((g.ni - 2) * (g.ni - 2)) as f32;
        {
            let p = floats(ep, total);
            for i in 0..li {
                let gi = first - 1 + i;
                p[i * plane..(i + 1) * plane].fill((gi * gi) as f32 / denominator);
            }
        }
        let left = me.checked_sub(1);
        let right = (me + 1 < ranks).then_some(me + 1);
        ep.barrier()?;
        let (mut calc, mut halo, mut reduce) = (0.0f64, 0.0f64, 0.0f64);
        let start = Instant::now();
        let mut gosa = 0.0f32;
        for _ in 0..iterations {
            n += 1;
            let t0 = Instant::now();
            let mine = sweep(&mut k, floats(ep, total), li, nj, nk);
            let t1 = Instant::now();
            for r in (0..ranks).filter(|&r| r != me) {
                ep.request_short(r as u32, H_GOSA, &[n, mine.to_bits()])?;
            }
            ep.wait_until(|_| {
                let got = state.gosa.borrow();
                (0..ranks).all(|r| r == me || got.contains_key(&(n, r as u32)))
            })?;
            {
                let mut got = state.gosa.borrow_mut();
                gosa = 0.0;
                for r in 0..ranks {
                    gosa += if r == me {
                        mine
                    } else {
                        got.remove(&(n, r as u32)).unwrap_or(f32::NAN)
                    };
                }
            }
            let t2 = Instant::now();
            if let Some(r) = right {
                // My last interior plane into the right neighbour's ghost 0.
                put_plane(ep, r as u32, count * plane * 4, 0, plane * 4, u64::from(n))?;
            }
            if let Some(l) = left {
                // My first interior plane into the left neighbour's last
                // ghost (its own plane count).
                let (_, their_count) = share_of(g.ni, ranks, l);
                put_plane(
                    ep,
                    l as u32,
                    plane * 4,
                    (their_count + 1) * plane * 4,
                    plane * 4,
                    u64::from(n),
                )?;
            }
            ep.wait_until(|_| {
                let notified = state.notified.borrow();
                left.is_none_or(|l| notified[l] >= u64::from(n))
                    && right.is_none_or(|r| notified[r] >= u64::from(n))
            })?;
            let t3 = Instant::now();
            calc += (t1 - t0).as_secs_f64();
            reduce += (t2 - t1).as_secs_f64();
            halo += (t3 - t2).as_secs_f64();
        }
        ep.barrier()?;
        let seconds = start.elapsed().as_secs_f64();
        // The sum of p over this rank's interior, gathered on rank 0 in
        // rank order.
        let p = floats(ep, total);
        let mut p_sum = 0.0f64;
        for i in 1..li - 1 {
            for j in 1..nj - 1 {
                for kk in 1..nk - 1 {
                    p_sum += f64::from(p[(i * nj + j) * nk + kk]);
                }
            }
        }
        if me != 0 {
            let bits = p_sum.to_bits();
            ep.request_short(0, H_SUM, &[bits as u32, (bits >> 32) as u32])?;
        } else {
            ep.wait_until(|_| state.sums.borrow().len() == ranks - 1)?;
            let mut sums = state.sums.borrow_mut();
            for r in 1..ranks {
                p_sum += sums.remove(&(r as u32)).unwrap_or(f64::NAN);
            }
            let points = ((g.ni - 2) * (g.nj - 2) * (g.nk - 2)) as f64;
            figures.push(json!({"test": "himeno", "ranks": ranks, "size": g.name,
                "ni": g.ni, "nj": g.nj, "nk": g.nk, "iterations": iterations,
                "seconds": seconds, "iterations_per_s": iterations as f64 / seconds,
                "mflops": 34.0 * points * iterations as f64 / seconds / 1e6,
                "calc_s": calc, "halo_s": halo, "allreduce_s": reduce,
                "gosa": f64::from(gosa), "p_sum": p_sum}));
        }
        ep.barrier()?;
    }
    Ok(figures)
}

/// Puts `bytes` (one i-plane, `nk * 4`-byte rows) from segment offset
/// `from` into `target`'s segment at `to`, with notice `n` behind it
/// ([`put_notified`]).
fn put_plane(
    ep: &mut Endpoint<'_>,
    target: u32,
    from: usize,
    to: usize,
    bytes: usize,
    n: u64,
) -> Result<(), Box<dyn Error>> {
    put_notified(ep, target, to as u64, from as u64, &[], &[bytes as u64], n)
}
