//! `pin-hitrate`: hit rates and per-transfer cost of the pin-down cache on
//! reproducible access traces, with the real `mlock` pinner on real memory.
//!
//! For each replacement policy and cache capacity it replays a sequential
//! sweep, a uniform random trace and a hot-set/cold-tail trace over a working
//! set larger than the cache, and then the PM paper's experiment (a stream of
//! transfers of which a chosen fraction miss). Each transfer pins its buffer
//! through the cache, copies it into a destination buffer (standing in for
//! the NIC's DMA read) and releases it; the same copies without the cache are
//! timed in the same run as the baseline.
//!
//! Prints one JSON document on stdout; progress goes to stderr when it is a
//! terminal (and `--quiet` is not given).

use std::error::Error;
use std::time::Instant;

use clap::Parser;
use pindown_pincache::{page_size, CacheConfig, MlockPinner, Monitor, PinCache, Policy};
use serde::Serialize;

use pindown_benches::output::OutputArgs;
use pindown_benches::replay::{duration_ns, replay, transfers_only, Copier, Layout, Outcome};
use pindown_benches::stats::median;
use pindown_benches::sys::{max_map_count, LockBudget, Machine, Mapping};
use pindown_benches::traces::{self, derive_seed, Trace};

/// Command line.
#[derive(Parser, Debug)]
#[command(
    name = "pin-hitrate",
    version,
    about = "Hit rate and per-transfer cost of the pin-down cache (JSON on stdout)"
)]
struct Args {
    /// Smaller traces, for CI (a few seconds).
    #[arg(long)]
    quick: bool,
    /// Seed of the access traces; the same seed gives the same traces.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    #[command(flatten)]
    output: OutputArgs,
}

/// Transfer size: PM's experiment used 8 KiB transfers.
const TRANSFER_BYTES: usize = 8 * 1024;
/// Miss fractions of the PM experiment.
const PM_MISS_FRACTIONS: [f64; 5] = [0.0, 0.25, 0.5, 0.75, 1.0];
/// Hot-set trace: this share of the buffers...
const HOT_BUFFER_FRACTION: f64 = 0.1;
/// ...receives this share of the accesses.
const HOT_ACCESS_FRACTION: f64 = 0.9;

/// Sizes of one run.
#[derive(Clone, Debug, Serialize)]
struct Params {
    quick: bool,
    seed: u64,
    pinner: &'static str,
    transfer_bytes: usize,
    buffer_stride: usize,
    merge: bool,
    working_set_buffers: usize,
    capacities_entries: Vec<usize>,
    capacities_requested: Vec<usize>,
    transfers_per_run: usize,
    hot_buffer_fraction: f64,
    hot_access_fraction: f64,
    pm_transfers: usize,
    pm_transfers_requested: usize,
    pm_hot_buffers: usize,
    pm_repetitions: usize,
    /// Whether the lockable-memory budget or vm.max_map_count shrank a
    /// cache or the PM stream below the requested size.
    limited_by_system_limits: bool,
}

#[derive(Serialize)]
struct Baseline {
    /// memcpy of one transfer from a buffer that stays in the CPU caches.
    memcpy_ns_per_transfer: f64,
    memcpy_mb_per_s: f64,
}

#[derive(Serialize)]
struct TraceResult {
    trace: &'static str,
    policy: String,
    capacity_entries: usize,
    working_set_buffers: usize,
    capacity_over_working_set: f64,
    transfers: u64,
    hit_rate: f64,
    hits: u64,
    misses: u64,
    evictions: u64,
    ns_per_transfer: f64,
    memcpy_ns_per_transfer: f64,
    vs_memcpy: f64,
    mb_per_s: f64,
    memcpy_mb_per_s: f64,
    /// Time to drop the cache afterwards (unpins what it still holds).
    teardown_us: f64,
}

#[derive(Serialize)]
struct PmResult {
    intended_miss_fraction: f64,
    intended_misses: usize,
    measured_misses: u64,
    measured_miss_fraction: f64,
    measured_hit_rate: f64,
    exact: bool,
    policy: String,
    capacity_entries: usize,
    transfers: u64,
    evictions: u64,
    repetitions: usize,
    /// Median over repetitions of (pin + copy + release) / transfers.
    ns_per_transfer: f64,
    /// Median over repetitions of copy / transfers, same trace.
    memcpy_ns_per_transfer: f64,
    vs_memcpy: f64,
    mb_per_s: f64,
    memcpy_mb_per_s: f64,
    /// Median over repetitions of the cache's teardown (unpinning every
    /// region the run left cached) per transfer: the deferred unpin cost.
    unpin_ns_per_transfer: f64,
}

#[derive(Serialize)]
struct Report {
    program: &'static str,
    version: &'static str,
    config: Params,
    machine: Machine,
    baseline: Baseline,
    results: Vec<TraceResult>,
    pm_experiment: Vec<PmResult>,
    elapsed_s: f64,
}

/// MB/s (10^6 bytes per second) for `bytes` moved in `ns` nanoseconds.
fn mb_per_s(bytes: f64, ns: f64) -> f64 {
    if ns > 0.0 {
        bytes * 1e3 / ns
    } else {
        0.0
    }
}

/// Bytes one pinned transfer buffer takes (whole pages).
fn entry_bytes() -> usize {
    TRANSFER_BYTES.div_ceil(page_size()) * page_size()
}

/// A cache of `capacity` entries whose byte limit is set explicitly (the
/// default would be the soft RLIMIT_MEMLOCK, which a process with
/// CAP_IPC_LOCK is not held to): room for every entry, within the budget.
fn cache_config(policy: Policy, capacity: usize, budget: &LockBudget) -> CacheConfig {
    let wanted = capacity.saturating_mul(entry_bytes()).saturating_mul(2);
    CacheConfig {
        max_pinned_bytes: Some(wanted.min(budget.max_pinned_bytes())),
        max_entries: capacity,
        policy,
        merge: false,
        monitor: Monitor::Off,
        ..CacheConfig::default()
    }
}

/// Median time of one copy from a single buffer that stays cache-resident.
fn hot_memcpy_ns(copier: &mut Copier<'_>, addr: usize) -> f64 {
    const BATCH: usize = 1000;
    let mut samples: Vec<f64> = (0..41)
        .map(|_| {
            let start = Instant::now();
            for _ in 0..BATCH {
                copier.copy(addr);
            }
            duration_ns(start.elapsed()) as f64 / BATCH as f64
        })
        .collect();
    median(&mut samples)
}

fn params(args: &Args, entry_budget: usize) -> Params {
    let page = page_size();
    let (working_set, capacities, transfers, pm_transfers, pm_reps) = if args.quick {
        (512, vec![16, 64, 256], 10_000, 4_000, 3)
    } else {
        (2048, vec![64, 256, 1024], 50_000, 20_000, 5)
    };
    let pm_hot = 16;
    // With less lockable memory than wanted, size everything to it; a
    // shorter PM stream is repeated more often to keep the timed total.
    let pm_requested = pm_transfers;
    // Each pinned buffer between unpinned gaps splits the mapping into two
    // more VMAs: stay well inside vm.max_map_count.
    let vma_budget = (max_map_count().saturating_sub(4096) / 2).saturating_sub(pm_hot);
    let pm_transfers = pm_transfers
        .min(entry_budget.saturating_sub(pm_hot))
        .min(vma_budget);
    let pm_reps = if pm_transfers < pm_requested {
        (pm_requested * pm_reps)
            .div_ceil(pm_transfers.max(1))
            .clamp(pm_reps, 100)
    } else {
        pm_reps
    };
    let limited = pm_transfers < pm_requested || capacities.iter().any(|&c| c > entry_budget);
    Params {
        quick: args.quick,
        seed: args.seed,
        pinner: "mlock",
        transfer_bytes: TRANSFER_BYTES,
        buffer_stride: Layout::gapped(0, TRANSFER_BYTES, page).stride,
        merge: false,
        working_set_buffers: working_set,
        capacities_entries: capacities
            .iter()
            .map(|&c| c.min(entry_budget).max(1))
            .collect(),
        capacities_requested: capacities,
        transfers_per_run: transfers,
        hot_buffer_fraction: HOT_BUFFER_FRACTION,
        hot_access_fraction: HOT_ACCESS_FRACTION,
        pm_transfers,
        pm_transfers_requested: pm_requested,
        pm_hot_buffers: pm_hot,
        pm_repetitions: pm_reps,
        limited_by_system_limits: limited,
    }
}

fn main() -> Result<(), Box<dyn Error>> {
    let args = Args::parse();
    let started = Instant::now();
    let page = page_size();
    let entry_bytes = entry_bytes() as u64;

    // The largest run pins the PM experiment's hot set plus all its fresh
    // buffers at once (the 100% miss stream); the largest cache of the trace
    // runs holds fewer. Find out whether that much can be locked.
    let full = params(&args, usize::MAX);
    let most_entries = (full.pm_hot_buffers + full.pm_transfers)
        .max(full.capacities_entries.iter().copied().max().unwrap_or(0));
    let budget = LockBudget::probe(most_entries as u64 * entry_bytes);
    let entry_budget = usize::try_from(budget.lockable_bytes / entry_bytes).unwrap_or(usize::MAX);
    let p = params(&args, entry_budget);
    if p.pm_transfers == 0 || entry_budget < 2 {
        return Err(format!(
            "{} lockable bytes hold {entry_budget} transfer buffers: too few to measure",
            budget.lockable_bytes
        )
        .into());
    }

    let buffers = p.working_set_buffers.max(p.pm_hot_buffers + p.pm_transfers);
    let layout0 = Layout::gapped(0, TRANSFER_BYTES, page);
    let mapping = Mapping::new(layout0.span(buffers))?;
    let layout = Layout::gapped(mapping.addr(), TRANSFER_BYTES, page);
    let mut copier = Copier::new(&mapping, TRANSFER_BYTES);

    let hot_ns = hot_memcpy_ns(&mut copier, layout.addr(0));
    let baseline = Baseline {
        memcpy_ns_per_transfer: hot_ns,
        memcpy_mb_per_s: mb_per_s(TRANSFER_BYTES as f64, hot_ns),
    };

    let ws = p.working_set_buffers;
    let n = p.transfers_per_run;
    let trace_set: Vec<Trace> = vec![
        traces::sequential(ws, n),
        traces::uniform(ws, n, derive_seed(p.seed, "uniform")),
        traces::hot_cold(
            ws,
            n,
            HOT_BUFFER_FRACTION,
            HOT_ACCESS_FRACTION,
            derive_seed(p.seed, "hot_cold"),
        ),
    ];

    let steps = trace_set.len() * Policy::ALL.len() * p.capacities_entries.len()
        + PM_MISS_FRACTIONS.len() * p.pm_repetitions;
    let bar = args.output.progress_bar(steps as u64);

    let mut results = Vec::new();
    for trace in &trace_set {
        for policy in Policy::ALL {
            for &capacity in &p.capacities_entries {
                bar.set_message(format!("{} {policy} {capacity}", trace.name));
                let copy_ns = transfers_only(trace, &layout, |a| copier.copy(a));
                let cache =
                    PinCache::new(MlockPinner::new(), cache_config(policy, capacity, &budget))?;
                let out = replay(&cache, trace, &layout, |a| copier.copy(a))?;
                let t = Instant::now();
                drop(cache);
                let teardown = duration_ns(t.elapsed());
                results.push(trace_result(
                    trace, policy, capacity, ws, out, copy_ns, teardown,
                ));
                bar.inc(1);
            }
        }
    }

    let mut pm = Vec::new();
    for fraction in PM_MISS_FRACTIONS {
        let trace = traces::pm_miss_fraction(
            p.pm_transfers,
            fraction,
            p.pm_hot_buffers,
            derive_seed(p.seed, "pm"),
        );
        // Room for every buffer the trace touches: nothing is evicted, so the
        // miss count is exactly the intended one whatever the policy.
        let capacity = trace.buffers;
        let policy = Policy::Lru;
        let mut run_ns = Vec::new();
        let mut copy_ns = Vec::new();
        let mut unpin_ns = Vec::new();
        let mut last = Outcome::default();
        for _ in 0..p.pm_repetitions {
            bar.set_message(format!("pm {:.0}% misses", fraction * 100.0));
            copy_ns.push(transfers_only(&trace, &layout, |a| copier.copy(a)) as f64);
            let cache = PinCache::new(MlockPinner::new(), cache_config(policy, capacity, &budget))?;
            last = replay(&cache, &trace, &layout, |a| copier.copy(a))?;
            run_ns.push(last.elapsed_ns as f64);
            let t = Instant::now();
            drop(cache);
            unpin_ns.push(duration_ns(t.elapsed()) as f64);
            bar.inc(1);
        }
        let transfers = trace.transfers() as f64;
        let per = |v: &mut Vec<f64>| median(v) / transfers;
        let (run, copy, unpin) = (per(&mut run_ns), per(&mut copy_ns), per(&mut unpin_ns));
        let intended = traces::intended_misses(trace.transfers(), fraction);
        pm.push(PmResult {
            intended_miss_fraction: fraction,
            intended_misses: intended,
            measured_misses: last.misses,
            measured_miss_fraction: last.miss_fraction(),
            measured_hit_rate: last.hit_rate(),
            exact: last.misses == intended as u64,
            policy: policy.to_string(),
            capacity_entries: capacity,
            transfers: last.transfers,
            evictions: last.evictions,
            repetitions: p.pm_repetitions,
            ns_per_transfer: run,
            memcpy_ns_per_transfer: copy,
            vs_memcpy: run / copy,
            mb_per_s: mb_per_s(TRANSFER_BYTES as f64, run),
            memcpy_mb_per_s: mb_per_s(TRANSFER_BYTES as f64, copy),
            unpin_ns_per_transfer: unpin,
        });
    }
    bar.finish_and_clear();
    drop(copier);
    drop(mapping);

    let report = Report {
        program: "pin-hitrate",
        version: env!("CARGO_PKG_VERSION"),
        config: p,
        machine: Machine::collect(budget),
        baseline,
        results,
        pm_experiment: pm,
        elapsed_s: started.elapsed().as_secs_f64(),
    };
    args.output.emit_json(&report)
}

fn trace_result(
    trace: &Trace,
    policy: Policy,
    capacity: usize,
    working_set: usize,
    out: Outcome,
    copy_ns: u64,
    teardown_ns: u64,
) -> TraceResult {
    let transfers = out.transfers.max(1) as f64;
    let run = out.ns_per_transfer();
    let copy = copy_ns as f64 / transfers;
    TraceResult {
        trace: trace.name,
        policy: policy.to_string(),
        capacity_entries: capacity,
        working_set_buffers: working_set,
        capacity_over_working_set: capacity as f64 / working_set as f64,
        transfers: out.transfers,
        hit_rate: out.hit_rate(),
        hits: out.hits,
        misses: out.misses,
        evictions: out.evictions,
        ns_per_transfer: run,
        memcpy_ns_per_transfer: copy,
        vs_memcpy: run / copy,
        mb_per_s: mb_per_s(TRANSFER_BYTES as f64, run),
        memcpy_mb_per_s: mb_per_s(TRANSFER_BYTES as f64, copy),
        teardown_us: teardown_ns as f64 / 1e3,
    }
}
