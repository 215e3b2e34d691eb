//! `pin-cost`: cost of a pin-down cache miss and hit with the `mlock`
//! pinner, by region size, next to raw `mlock`/`munlock`, with a
//! least-squares fit `miss_us = a + b * pages` (the form of table 2 of the PM
//! pin-down cache paper), and the per-`munmap` cost of invalidation next to a
//! plain `munmap` (the cases of the criterion group `unmap`, see
//! [`pindown_benches::unmap`]). Prints one JSON document on stdout.
//!
//! The peer, under `ucx`: UCX's registration cache (`ucs_rcache`) with an
//! `mlock` pin, the same sizes and repetitions, measured by the C program
//! `benches/ucx/rcache.c` built and run at run time (see
//! [`pindown_benches::ucx`]). Without UCX's headers or a C compiler it is
//! reported `missing` with the reason; under CI=true that fails the program,
//! as does a UCX run that fails.
//!
//! Every figure is a median over many repetitions timed with
//! `std::time::Instant`. Raw and cached repetitions are interleaved so that
//! drift in the machine affects both alike; so are the `munmap` cases, in
//! batches.

use std::error::Error;
use std::time::{Duration, Instant};

use clap::Parser;
use pindown_pincache::{page_size, CacheConfig, MlockPinner, PinCache};
use serde::Serialize;

use pindown_benches::mpi::under_ci;
use pindown_benches::output::OutputArgs;
use pindown_benches::replay::duration_ns;
use pindown_benches::stats::{fit_line, median, LineFit};
use pindown_benches::sys::{mlock, munlock, LockBudget, Machine, Mapping};
use pindown_benches::ucx;
use pindown_benches::unmap::{UnmapCase, UnmapRun};

/// Command line.
#[derive(Parser, Debug)]
#[command(
    name = "pin-cost",
    version,
    about = "Miss and hit cost of the pin-down cache with mlock (JSON on stdout)"
)]
struct Args {
    /// Fewer repetitions (a few seconds in all).
    #[arg(long)]
    quick: bool,
    /// Largest region, in pages: sizes 1, 2, 4, ... up to this are measured.
    #[arg(long, default_value_t = 4096)]
    max_pages: usize,
    #[command(flatten)]
    output: OutputArgs,
}

/// Repetition limits for one region size.
#[derive(Clone, Copy, Debug, Serialize)]
struct RepPolicy {
    min_reps: usize,
    max_reps: usize,
    /// Stop adding repetitions once this much time went into one size.
    budget_ms: u64,
    /// Hits timed per batch (a single hit is below the clock's resolution).
    hit_batch: usize,
    hit_batches: usize,
    /// Unmappings timed per `munmap` case.
    unmap_reps: u64,
    /// Unmappings of one case in a row before the next case's turn.
    unmap_batch: u64,
}

/// Medians for one region size; times in microseconds unless named `_ns`.
#[derive(Debug, Serialize)]
struct SizeResult {
    pages: usize,
    bytes: usize,
    reps: usize,
    /// `cache.pin` of a region not in the cache plus the release.
    miss_us: f64,
    /// `cache.invalidate` of that region afterwards (unpins it).
    invalidate_us: f64,
    /// Miss, release and invalidate: comparable with raw mlock + munlock.
    miss_plus_invalidate_us: f64,
    raw_mlock_us: f64,
    raw_munlock_us: f64,
    raw_mlock_munlock_us: f64,
    /// What the cache adds to a miss: `miss_us - raw_mlock_us`.
    miss_overhead_us: f64,
    /// A hit (pin of the cached region plus release), in nanoseconds.
    hit_ns: f64,
}

#[derive(Debug, Serialize)]
struct Skipped {
    pages: usize,
    reason: String,
}

#[derive(Debug, Serialize)]
struct Fits {
    /// `miss_us = a + b * pages`.
    miss_us: Option<LineFit>,
    miss_plus_invalidate_us: Option<LineFit>,
    raw_mlock_us: Option<LineFit>,
    raw_mlock_munlock_us: Option<LineFit>,
}

#[derive(Debug, Serialize)]
struct Ratios {
    /// Hit cost over the miss cost of a one-page region.
    hit_over_miss_1page: Option<f64>,
    hit_over_miss_plus_invalidate_1page: Option<f64>,
    hit_over_raw_mlock_munlock_1page: Option<f64>,
}

/// The figures this program's output is meant to be set against.
#[derive(Debug, Serialize)]
struct Reference {
    source: &'static str,
    miss_a_us: f64,
    miss_b_us_per_page: f64,
    hit_us: f64,
    hit_over_miss_1page: f64,
}

/// One `munmap` case: median time per unmapping.
#[derive(Debug, Serialize)]
struct UnmapCaseResult {
    case: &'static str,
    /// Unmappings timed.
    reps: usize,
    /// `null` if the case could not run (see `error`).
    median_us: Option<f64>,
    /// `median_us` over the plain `munmap`'s.
    over_munmap: Option<f64>,
    /// Why the case did not run, or what the invalidation check found.
    error: Option<String>,
}

/// The figure the hook is meant to be set against.
#[derive(Debug, Serialize)]
struct UnmapReference {
    source: &'static str,
    /// UCX's in-process memory hooks: invalidation of a one-page mlocked
    /// region, per unmapping.
    ucx_hook_1page_mlocked_us: f64,
    target: &'static str,
    /// Most `pincache_unmap_monitored` may cost to meet the target.
    target_us: f64,
    /// `pincache_unmap_monitored` over the UCX figure.
    pincache_unmap_monitored_over_ucx: Option<f64>,
    /// `null` if the monitored case did not run.
    target_met: Option<bool>,
}

/// Per-`munmap` cost of invalidation next to a plain `munmap`.
#[derive(Debug, Serialize)]
struct UnmapReport {
    /// One-page mappings, each unmapped once.
    bytes: usize,
    cases: Vec<UnmapCaseResult>,
    /// Why the userfaultfd monitor could not start, if it could not.
    monitor_unavailable: Option<String>,
    reference: UnmapReference,
}

/// UCX's in-process memory hooks invalidate a one-page mlocked region in
/// this many microseconds (measured on the machines these programs run on).
const UCX_HOOK_US: f64 = 2.4;
/// The hook with the monitor running should cost at most this many times
/// [`UCX_HOOK_US`].
const UCX_TARGET_FACTOR: f64 = 2.0;

/// How the UCX peer came out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
enum PeerStatus {
    Measured,
    /// What it needs is not installed (reported, not failed, outside CI).
    Missing,
    /// It was tried and did not work.
    Failed,
}

/// UCX's registration cache on the same sizes, with the same pin.
#[derive(Debug, Serialize)]
struct UcxReport {
    status: PeerStatus,
    /// Why it was not measured.
    reason: Option<String>,
    /// What is measured.
    library: &'static str,
    /// The program's header (UCX API version, events, pin).
    header: Option<ucx::Header>,
    sizes: Vec<ucx::SizePoint>,
    /// Hit cost of a one-page region, in microseconds.
    hit_us: Option<f64>,
    fit: UcxFits,
    /// Hit cost over the miss cost of a one-page region.
    hit_over_miss_1page: Option<f64>,
}

#[derive(Debug, Serialize)]
struct UcxFits {
    /// `miss_us = a + b * pages`.
    miss_us: Option<LineFit>,
    miss_plus_invalidate_us: Option<LineFit>,
}

impl UcxReport {
    fn not_measured(status: PeerStatus, reason: String) -> Self {
        UcxReport {
            status,
            reason: Some(reason),
            library: UCX_LIBRARY,
            header: None,
            sizes: Vec::new(),
            hit_us: None,
            fit: UcxFits {
                miss_us: None,
                miss_plus_invalidate_us: None,
            },
            hit_over_miss_1page: None,
        }
    }

    fn measured(run: ucx::Run) -> Self {
        let fit = |y: fn(&ucx::SizePoint) -> f64| {
            let points: Vec<(f64, f64)> =
                run.sizes.iter().map(|s| (s.pages as f64, y(s))).collect();
            fit_line(&points)
        };
        let one = run.sizes.iter().find(|s| s.pages == 1);
        UcxReport {
            status: PeerStatus::Measured,
            reason: None,
            library: UCX_LIBRARY,
            hit_us: one.map(|s| s.hit_ns / 1e3),
            hit_over_miss_1page: one.map(|s| s.hit_ns / 1e3 / s.miss_us),
            fit: UcxFits {
                miss_us: fit(|s| s.miss_us),
                miss_plus_invalidate_us: fit(|s| s.miss_plus_invalidate_us),
            },
            header: Some(run.header),
            sizes: run.sizes,
        }
    }
}

/// What the `ucx` figures are of.
const UCX_LIBRARY: &str = "UCX ucs_rcache (libucs), mem_reg = mlock, mem_dereg = munlock";

/// Builds and runs the UCX peer on `pages`; a missing or failed peer is
/// reported, or fails the program under CI=true.
fn measure_ucx(pages: &[usize], reps: &RepPolicy) -> Result<UcxReport, Box<dyn Error>> {
    let outcome = match ucx::missing() {
        Some(reason) => UcxReport::not_measured(PeerStatus::Missing, reason),
        None if pages.is_empty() => UcxReport::not_measured(
            PeerStatus::Failed,
            "no region size could be measured (see skipped)".to_string(),
        ),
        None => {
            let dir = tempfile::tempdir()?;
            let spec = ucx::RunSpec {
                pages: pages.to_vec(),
                min_reps: reps.min_reps,
                max_reps: reps.max_reps,
                budget_ms: reps.budget_ms,
                hit_batch: reps.hit_batch,
                hit_batches: reps.hit_batches,
            };
            match ucx::build(dir.path()).and_then(|binary| ucx::run(&binary, &spec)) {
                Ok(run) => UcxReport::measured(run),
                Err(e) => UcxReport::not_measured(PeerStatus::Failed, e.to_string()),
            }
        }
    };
    if let Some(reason) = &outcome.reason {
        if under_ci() {
            return Err(format!("UCX peer {:?}: {reason} (CI=true)", outcome.status).into());
        }
        eprintln!("pin-cost: UCX peer {:?}: {reason}", outcome.status);
    }
    Ok(outcome)
}

#[derive(Serialize)]
struct Report {
    program: &'static str,
    version: &'static str,
    machine: Machine,
    repetitions: RepPolicy,
    sizes: Vec<SizeResult>,
    skipped: Vec<Skipped>,
    /// Hit cost of a one-page region, in microseconds.
    hit_us: Option<f64>,
    fit: Fits,
    ratios: Ratios,
    reference_pm_table2: Reference,
    /// The peer: UCX's registration cache on the same sizes.
    ucx: UcxReport,
    unmap: UnmapReport,
    elapsed_s: f64,
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// Times raw mlock/munlock and cache miss/invalidate of `pages` pages at
/// `addr`, interleaved.
fn measure_size(
    cache: &PinCache<MlockPinner>,
    addr: usize,
    pages: usize,
    reps: &RepPolicy,
) -> Result<SizeResult, Box<dyn Error>> {
    let len = pages * page_size();
    let (mut lock, mut unlock, mut raw) = (Vec::new(), Vec::new(), Vec::new());
    let (mut miss, mut inval, mut miss_inval) = (Vec::new(), Vec::new(), Vec::new());
    let started = Instant::now();
    let budget = Duration::from_millis(reps.budget_ms);
    let mut n = 0;
    while n < reps.min_reps || (n < reps.max_reps && started.elapsed() < budget) {
        let t0 = Instant::now();
        mlock(addr, len)?;
        let t1 = Instant::now();
        munlock(addr, len)?;
        let t2 = Instant::now();
        lock.push(us(t1 - t0));
        unlock.push(us(t2 - t1));
        raw.push(us(t2 - t0));

        let t0 = Instant::now();
        drop(cache.pin(addr, len)?);
        let t1 = Instant::now();
        cache.invalidate(addr, len);
        let t2 = Instant::now();
        miss.push(us(t1 - t0));
        inval.push(us(t2 - t1));
        miss_inval.push(us(t2 - t0));
        n += 1;
    }

    // Hits: warm the region once, then time batches of hits.
    drop(cache.pin(addr, len)?);
    let mut hits: Vec<f64> = (0..reps.hit_batches)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..reps.hit_batch {
                drop(std::hint::black_box(cache.pin(addr, len)));
            }
            duration_ns(t.elapsed()) as f64 / reps.hit_batch as f64
        })
        .collect();
    cache.invalidate(addr, len);

    let raw_mlock_us = median(&mut lock);
    let miss_us = median(&mut miss);
    Ok(SizeResult {
        pages,
        bytes: len,
        reps: n,
        miss_us,
        invalidate_us: median(&mut inval),
        miss_plus_invalidate_us: median(&mut miss_inval),
        raw_mlock_us,
        raw_munlock_us: median(&mut unlock),
        raw_mlock_munlock_us: median(&mut raw),
        miss_overhead_us: miss_us - raw_mlock_us,
        hit_ns: median(&mut hits),
    })
}

/// Times every [`UnmapCase`] `reps.unmap_reps` times, in turns of
/// `reps.unmap_batch`; a case whose cache cannot be created is reported with
/// the reason and skipped.
fn measure_unmap(budget: &LockBudget, reps: &RepPolicy) -> UnmapReport {
    let mut samples: Vec<Vec<f64>> = UnmapCase::ALL.iter().map(|_| Vec::new()).collect();
    let mut errors: Vec<Option<String>> = UnmapCase::ALL.iter().map(|_| None).collect();
    let mut monitor_unavailable = None;
    let mut done = 0;
    while done < reps.unmap_reps {
        let n = reps.unmap_batch.min(reps.unmap_reps - done);
        for (i, &case) in UnmapCase::ALL.iter().enumerate() {
            if errors[i].is_some() {
                continue;
            }
            // A fresh cache for each turn, so that the hook finds only this
            // case's cache in the process, as in the criterion group.
            let run = match UnmapRun::new(case, budget.max_pinned_bytes()) {
                Ok(run) => run,
                Err(e) => {
                    if case.monitored() {
                        monitor_unavailable.get_or_insert_with(|| e.to_string());
                    }
                    errors[i] = Some(e.to_string());
                    continue;
                }
            };
            errors[i] = match run.time(n, |d| samples[i].push(us(d))) {
                Ok(()) => run.check_invalidated().err(),
                Err(e) => Some(e.to_string()),
            };
        }
        done += n;
    }

    let medians: Vec<Option<f64>> = samples
        .iter_mut()
        .map(|s| (!s.is_empty()).then(|| median(s)))
        .collect();
    let plain = UnmapCase::ALL
        .iter()
        .position(|&case| case == UnmapCase::Munmap)
        .and_then(|i| medians[i]);
    let cases: Vec<UnmapCaseResult> = UnmapCase::ALL
        .iter()
        .zip(medians.iter().zip(samples.iter().zip(errors)))
        .map(|(case, (&median_us, (s, error)))| UnmapCaseResult {
            case: case.name(),
            reps: s.len(),
            median_us,
            over_munmap: median_us.zip(plain).map(|(m, p)| m / p),
            error,
        })
        .collect();
    let monitored_hook = cases
        .iter()
        .find(|c| c.case == UnmapCase::PincacheUnmapMonitored.name())
        .and_then(|c| c.median_us);
    let target_us = UCX_TARGET_FACTOR * UCX_HOOK_US;
    UnmapReport {
        bytes: page_size(),
        cases,
        monitor_unavailable,
        reference: UnmapReference {
            source: "UCX in-process memory hooks, measured on these machines",
            ucx_hook_1page_mlocked_us: UCX_HOOK_US,
            target: "pincache_unmap_monitored within 2x of the UCX hook",
            target_us,
            pincache_unmap_monitored_over_ucx: monitored_hook.map(|m| m / UCX_HOOK_US),
            target_met: monitored_hook.map(|m| m <= target_us),
        },
    }
}

fn fit_of(sizes: &[SizeResult], y: impl Fn(&SizeResult) -> f64) -> Option<LineFit> {
    let points: Vec<(f64, f64)> = sizes.iter().map(|s| (s.pages as f64, y(s))).collect();
    fit_line(&points)
}

fn main() -> Result<(), Box<dyn Error>> {
    let args = Args::parse();
    let started = Instant::now();
    let page = page_size();
    let max_pages = args.max_pages.max(1);
    // One region is locked at a time: by the raw calls or by the cache.
    let budget = LockBudget::probe((max_pages * page) as u64);

    let mut skipped = Vec::new();
    let mut candidates = Vec::new();
    let mut pages = 1;
    while pages <= max_pages {
        if budget.allows((pages * page) as u64) {
            candidates.push(pages);
        } else {
            skipped.push(Skipped {
                pages,
                reason: format!(
                    "exceeds the lockable budget ({} bytes, from {})",
                    budget.lockable_bytes, budget.source
                ),
            });
        }
        pages *= 2;
    }
    let largest = candidates.last().copied().unwrap_or(1);
    let mapping = Mapping::new(largest * page)?;

    let reps = if args.quick {
        RepPolicy {
            min_reps: 11,
            max_reps: 201,
            budget_ms: 40,
            hit_batch: 1000,
            hit_batches: 31,
            unmap_reps: 300,
            unmap_batch: 50,
        }
    } else {
        RepPolicy {
            min_reps: 21,
            max_reps: 2001,
            budget_ms: 250,
            hit_batch: 1000,
            hit_batches: 101,
            unmap_reps: 2000,
            unmap_batch: 50,
        }
    };
    let config = CacheConfig {
        max_pinned_bytes: Some(budget.max_pinned_bytes()),
        max_entries: 16,
        merge: false,
        ..CacheConfig::default()
    };
    let cache = PinCache::new(MlockPinner::new(), config)?;

    let bar = args.output.progress_bar(candidates.len() as u64 + 2);
    let mut sizes = Vec::new();
    for &pages in &candidates {
        bar.set_message(format!("{pages} pages"));
        match measure_size(&cache, mapping.addr(), pages, &reps) {
            Ok(r) => sizes.push(r),
            Err(e) => {
                // Leave nothing locked behind before the next size.
                cache.invalidate(mapping.addr(), pages * page);
                let _ = munlock(mapping.addr(), pages * page);
                skipped.push(Skipped {
                    pages,
                    reason: e.to_string(),
                });
            }
        }
        bar.inc(1);
    }
    // No other cache may be live while the unmappings are timed: the hook
    // would visit it too.
    drop(cache);
    drop(mapping);
    // The peer on the sizes measured here, with nothing of ours locked.
    bar.set_message("UCX rcache");
    let measured: Vec<usize> = sizes.iter().map(|s| s.pages).collect();
    let ucx = bar.suspend(|| measure_ucx(&measured, &reps))?;
    bar.inc(1);
    bar.set_message("munmap");
    let unmap = measure_unmap(&budget, &reps);
    bar.inc(1);
    bar.finish_and_clear();

    let one = sizes.iter().find(|s| s.pages == 1);
    let hit_us = one.map(|s| s.hit_ns / 1e3);
    let ratio = |f: fn(&SizeResult) -> f64| one.map(|s| s.hit_ns / 1e3 / f(s));
    let report = Report {
        program: "pin-cost",
        version: env!("CARGO_PKG_VERSION"),
        machine: Machine::collect(budget),
        repetitions: reps,
        fit: Fits {
            miss_us: fit_of(&sizes, |s| s.miss_us),
            miss_plus_invalidate_us: fit_of(&sizes, |s| s.miss_plus_invalidate_us),
            raw_mlock_us: fit_of(&sizes, |s| s.raw_mlock_us),
            raw_mlock_munlock_us: fit_of(&sizes, |s| s.raw_mlock_munlock_us),
        },
        ratios: Ratios {
            hit_over_miss_1page: ratio(|s| s.miss_us),
            hit_over_miss_plus_invalidate_1page: ratio(|s| s.miss_plus_invalidate_us),
            hit_over_raw_mlock_munlock_1page: ratio(|s| s.raw_mlock_munlock_us),
        },
        reference_pm_table2: Reference {
            source: "PM pin-down cache paper, table 2",
            miss_a_us: 90.8,
            miss_b_us_per_page: 12.3,
            hit_us: 0.6,
            hit_over_miss_1page: 0.6 / (90.8 + 12.3),
        },
        sizes,
        skipped,
        hit_us,
        ucx,
        unmap,
        elapsed_s: started.elapsed().as_secs_f64(),
    };
    args.output.emit_json(&report)
}
