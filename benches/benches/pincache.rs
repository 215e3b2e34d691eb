//! Criterion benchmarks of the pin-down cache.
//!
//! * `hit/{noop,mlock}`: `pin` of a cached region plus the release.
//! * `hit_vs_entries/{entries}`: a hit with `NoopPinner` on a cache holding
//!   1,000, 10,000 or 100,000 one-page regions, each hit on one of them
//!   picked at random (a seeded sequence made before timing). Hit cost should
//!   stay nearly flat as the entry count grows a hundredfold.
//! * `hit_two_threads/*`: time per hit of each thread when one thread or two
//!   threads hit at once (their own regions, or the same region). A thread
//!   keeps at least half its single-thread throughput when its time per hit
//!   is at most twice the single-thread time.
//! * `miss_mlock/{pages}` against `raw_mlock_munlock/{pages}`: a miss with
//!   `mlock` followed by `invalidate` (which unpins), versus the bare
//!   system calls. Sizes beyond what this process can lock (found by a probe
//!   at start, see [`LockBudget`]) are skipped with a note.
//! * `miss_noop/1`, `miss_noop_evict/1`: the cache's own cost of a one-page
//!   miss, without and with the eviction of an idle region.
//! * `unmap/*`: one `munmap` of a one-page mapping, plain or mlocked, and of
//!   one whose region the cache holds (idle), invalidated through the
//!   `pindown_pincache::unmap` hook or caught by the userfaultfd monitor.
//!
//! Targets (measured, not asserted): hit <= 15 ns, `miss_noop/1` <= 0.1 us.

use std::hint::black_box;
use std::sync::{Barrier, OnceLock};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use pindown_benches::sys::{self, LockBudget, Mapping};
use pindown_benches::traces::SplitMix64;
use pindown_benches::unmap::{UnmapCase, UnmapRun};
use pindown_pincache::{page_size, CacheConfig, MlockPinner, NoopPinner, PinCache, Pinner, Policy};

/// Sizes, in pages, of the `miss_mlock` and `raw_mlock_munlock` benchmarks.
const MISS_PAGES: [usize; 5] = [1, 16, 256, 1024, 4096];

/// What this process can lock: probed once for the largest miss region plus
/// 1 MiB for the other benchmarks' few pages.
fn lock_budget() -> &'static LockBudget {
    static BUDGET: OnceLock<LockBudget> = OnceLock::new();
    BUDGET.get_or_init(|| {
        let largest = MISS_PAGES.iter().max().copied().unwrap_or(1) * page_size();
        let budget = LockBudget::probe(largest as u64 + (1 << 20));
        if let Some(e) = &budget.probe_error {
            eprintln!(
                "note: cannot lock {} bytes ({e}); using {} bytes (soft RLIMIT_MEMLOCK {:?} \
                 less {} locked)",
                budget.wanted, budget.lockable_bytes, budget.soft_limit, budget.locked_before
            );
        }
        budget
    })
}

/// A cache whose byte limit is the lockable budget, set explicitly: the
/// default (the soft RLIMIT_MEMLOCK) is too low for a process that may lock
/// more with CAP_IPC_LOCK.
fn mlock_cache(config: CacheConfig) -> PinCache<MlockPinner> {
    let config = CacheConfig {
        max_pinned_bytes: Some(lock_budget().max_pinned_bytes()),
        ..config
    };
    PinCache::new(MlockPinner::new(), config).expect("cache")
}

fn warm<P: Pinner + 'static>(cache: &PinCache<P>, addr: usize, len: usize) {
    drop(cache.pin(addr, len).expect("warm-up pin"));
}

fn bench_hit(c: &mut Criterion) {
    let page = page_size();
    let len = 2 * page;
    let mapping = Mapping::new(4 * page).expect("mmap");
    let addr = mapping.addr() + page;
    let mut group = c.benchmark_group("hit");

    let noop = PinCache::new(NoopPinner, CacheConfig::default()).expect("cache");
    warm(&noop, addr, len);
    group.bench_function("noop", |b| {
        b.iter(|| drop(black_box(noop.pin(black_box(addr), len))))
    });

    let mlock = mlock_cache(CacheConfig::default());
    warm(&mlock, addr, len);
    group.bench_function("mlock", |b| {
        b.iter(|| drop(black_box(mlock.pin(black_box(addr), len))))
    });
    group.finish();
    drop(mlock);
}

/// Entry counts of the `hit_vs_entries` benchmarks.
const HIT_ENTRIES: [usize; 3] = [1_000, 10_000, 100_000];
/// Pre-generated lookups per `hit_vs_entries` benchmark, cycled through (a
/// power of two; the same for every entry count, so that reading the next
/// address costs the same in each).
const HIT_LOOKUPS: usize = 1 << 16;

/// Base of the made-up addresses of the NoopPinner benchmarks: nothing is
/// mapped there, and NoopPinner never touches memory.
const FAKE_BASE: usize = 0x1000_0000;

/// Address of the `i`-th fake one-page region: one page in every two, so
/// that regions never touch (and could not merge).
#[inline]
fn fake_region(i: usize, page: usize) -> usize {
    FAKE_BASE + 2 * i * page
}

fn bench_hit_vs_entries(c: &mut Criterion) {
    let page = page_size();
    let mut group = c.benchmark_group("hit_vs_entries");
    for entries in HIT_ENTRIES {
        let cache = PinCache::new(
            NoopPinner,
            CacheConfig {
                max_entries: entries,
                max_pinned_bytes: Some(2 * entries * page),
                merge: false,
                ..CacheConfig::default()
            },
        )
        .expect("cache");
        for i in 0..entries {
            warm(&cache, fake_region(i, page), page);
        }
        let mut rng = SplitMix64::new(entries as u64);
        let lookups: Vec<usize> = (0..HIT_LOOKUPS)
            .map(|_| fake_region(rng.below(entries), page))
            .collect();
        let before = cache.stats();
        group.bench_function(BenchmarkId::from_parameter(entries), |b| {
            let mut next = 0;
            b.iter(|| {
                let addr = lookups[next];
                next = (next + 1) & (HIT_LOOKUPS - 1);
                drop(black_box(cache.pin(black_box(addr), page)));
            })
        });
        let after = cache.stats();
        if after.misses != before.misses || after.pinned_entries != entries {
            eprintln!(
                "hit_vs_entries/{entries}: {} misses while timing, {} entries cached",
                after.misses - before.misses,
                after.pinned_entries
            );
        }
    }
    group.finish();
}

/// Runs `iters` hits on each of `addrs` (one thread per address) started
/// together; returns the longest per-thread time.
fn concurrent_hits<P: Pinner + 'static>(
    cache: &PinCache<P>,
    addrs: &[usize],
    len: usize,
    iters: u64,
) -> Duration {
    let barrier = Barrier::new(addrs.len());
    std::thread::scope(|s| {
        let handles: Vec<_> = addrs
            .iter()
            .map(|&addr| {
                let barrier = &barrier;
                s.spawn(move || {
                    // Register this thread with the cache before timing.
                    warm(cache, addr, len);
                    barrier.wait();
                    let start = Instant::now();
                    for _ in 0..iters {
                        drop(black_box(cache.pin(black_box(addr), len)));
                    }
                    start.elapsed()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("hit thread"))
            .max()
            .unwrap_or_default()
    })
}

fn bench_hit_two_threads(c: &mut Criterion) {
    let page = page_size();
    let len = 2 * page;
    let mapping = Mapping::new(16 * page).expect("mmap");
    // Regions far enough apart to share no cache line of metadata by layout.
    let a = mapping.addr();
    let b = mapping.addr() + 8 * page;
    let cache = PinCache::new(NoopPinner, CacheConfig::default()).expect("cache");
    warm(&cache, a, len);
    warm(&cache, b, len);

    let mut group = c.benchmark_group("hit_two_threads");
    let cases: [(&str, Vec<usize>); 3] = [
        ("one_thread", vec![a]),
        ("own_regions", vec![a, b]),
        ("same_region", vec![a, a]),
    ];
    for (name, addrs) in &cases {
        group.bench_function(*name, |bench| {
            bench.iter_custom(|iters| concurrent_hits(&cache, addrs, len, iters))
        });
    }
    group.finish();
}

fn bench_miss_mlock(c: &mut Criterion) {
    let page = page_size();
    let budget = lock_budget();
    let sizes: Vec<usize> = MISS_PAGES
        .iter()
        .copied()
        .filter(|&pages| {
            let fits = budget.allows((pages * page) as u64);
            if !fits {
                eprintln!(
                    "miss_mlock/{pages}, raw_mlock_munlock/{pages}: skipped, {} bytes exceed \
                     the lockable budget ({} bytes, from {})",
                    pages * page,
                    budget.lockable_bytes,
                    budget.source
                );
            }
            fits
        })
        .collect();
    let Some(&largest) = sizes.last() else {
        return;
    };
    let mapping = Mapping::new(largest * page).expect("mmap");
    let addr = mapping.addr();
    let cache = mlock_cache(CacheConfig {
        merge: false,
        ..CacheConfig::default()
    });

    bench_by_pages(c, "miss_mlock", &sizes, |len| {
        drop(black_box(cache.pin(addr, len).expect("miss")));
        cache.invalidate(addr, len);
    });
    bench_by_pages(c, "raw_mlock_munlock", &sizes, |len| {
        sys::mlock(black_box(addr), len).expect("mlock");
        sys::munlock(addr, len).expect("munlock");
    });
}

/// A group `name` with one benchmark per size in `sizes` (pages), each timing
/// `routine(bytes)`; large sizes take fewer samples.
fn bench_by_pages(c: &mut Criterion, name: &str, sizes: &[usize], mut routine: impl FnMut(usize)) {
    let page = page_size();
    let mut group = c.benchmark_group(name);
    for &pages in sizes {
        if pages >= 256 {
            group.sample_size(20);
        }
        group.bench_with_input(
            BenchmarkId::from_parameter(pages),
            &(pages * page),
            |b, &len| b.iter(|| routine(len)),
        );
    }
    group.finish();
}

fn bench_miss_noop(c: &mut Criterion) {
    let page = page_size();
    // Each cache serves this many misses, then a new one is made (untimed).
    const CHUNK: u64 = 16 * 1024;
    let mut group = c.benchmark_group("miss_noop");
    group.bench_function(BenchmarkId::from_parameter(1), |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            let mut done = 0;
            while done < iters {
                let n = (iters - done).min(CHUNK) as usize;
                let config = CacheConfig {
                    max_entries: n + 1,
                    max_pinned_bytes: Some((n + 1) * page),
                    ..CacheConfig::default()
                };
                let cache = PinCache::new(NoopPinner, config).expect("cache");
                let start = Instant::now();
                for i in 0..n {
                    let addr = fake_region(i, page);
                    drop(black_box(cache.pin(black_box(addr), page)));
                }
                total += start.elapsed();
                drop(cache);
                done += n as u64;
            }
            total
        })
    });
    group.finish();

    // Steady state of a full cache: every pin misses (LRU over far more
    // regions than fit) and evicts one idle region.
    const ENTRIES: usize = 1024;
    const DISTINCT: usize = 1 << 20;
    let cache = PinCache::new(
        NoopPinner,
        CacheConfig {
            max_entries: ENTRIES,
            max_pinned_bytes: Some(ENTRIES * page),
            policy: Policy::Lru,
            ..CacheConfig::default()
        },
    )
    .expect("cache");
    for i in 0..ENTRIES {
        warm(&cache, fake_region(i, page), page);
    }
    let mut next = ENTRIES;
    let mut group = c.benchmark_group("miss_noop_evict");
    group.bench_function(BenchmarkId::from_parameter(1), |b| {
        b.iter(|| {
            let addr = fake_region(next, page);
            next = (next + 1) % DISTINCT;
            drop(black_box(cache.pin(black_box(addr), page)));
        })
    });
    group.finish();
    let stats = cache.stats();
    if stats.hits != 0 {
        eprintln!("miss_noop_evict: {} unexpected hits", stats.hits);
    }
}

fn bench_unmap(c: &mut Criterion) {
    let mut group = c.benchmark_group("unmap");
    for case in UnmapCase::ALL {
        let run = match UnmapRun::new(case, lock_budget().max_pinned_bytes()) {
            Ok(run) => run,
            Err(e) => {
                eprintln!("unmap/{}: skipped ({e})", case.name());
                continue;
            }
        };
        group.bench_function(case.name(), |b| {
            b.iter_custom(|iters| run.total(iters).expect("unmap"))
        });
        if let Err(e) = run.check_invalidated() {
            eprintln!("unmap/{}: {e}", case.name());
        }
    }
    group.finish();
}

criterion_group!(
    benches,
    bench_hit,
    bench_hit_vs_entries,
    bench_hit_two_threads,
    bench_miss_mlock,
    bench_miss_noop,
    bench_unmap
);
criterion_main!(benches);
