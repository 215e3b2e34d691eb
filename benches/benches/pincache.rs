//! Criterion benchmarks of the pin-down cache.
//!
//! * `hit/{noop,mlock}`: `pin` of a cached region plus the release.
//! * `hit_two_threads/*`: time per hit of each thread when one thread or two
//!   threads hit at once (their own regions, or the same region). A thread
//!   keeps at least half its single-thread throughput when its time per hit
//!   is at most twice the single-thread time.
//! * `miss_mlock/{pages}` against `raw_mlock_munlock/{pages}`: a miss with
//!   `mlock` followed by `invalidate` (which unpins), versus the bare
//!   system calls. Sizes beyond `RLIMIT_MEMLOCK` are skipped with a note.
//! * `miss_noop/1`, `miss_noop_evict/1`: the cache's own cost of a one-page
//!   miss, without and with the eviction of an idle region.
//! * `unmap/*`: one `munmap` of a one-page mapping, plain or mlocked, and of
//!   one whose region the cache holds (idle), invalidated through the
//!   `pincache::unmap` hook or caught by the userfaultfd monitor.
//!
//! Targets (measured, not asserted): hit <= 15 ns, `miss_noop/1` <= 0.1 us.

use std::hint::black_box;
use std::sync::{Barrier, OnceLock};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use pincache::{CacheConfig, MlockPinner, NoopPinner, PinCache, Pinner, Policy};
use pindown_benches::sys::{self, ensure_memlock, page_size, Mapping};

/// Sizes, in pages, of the `miss_mlock` and `raw_mlock_munlock` benchmarks.
const MISS_PAGES: [usize; 5] = [1, 16, 256, 1024, 4096];

/// Bytes that may still be locked: `RLIMIT_MEMLOCK`, raised to 1 GiB first
/// where that is allowed (root with `CAP_SYS_RESOURCE`).
fn memlock_budget() -> u64 {
    static BUDGET: OnceLock<u64> = OnceLock::new();
    *BUDGET.get_or_init(|| {
        let report = ensure_memlock(1 << 30);
        if let Some(e) = &report.error {
            eprintln!(
                "note: RLIMIT_MEMLOCK stays at {:?} bytes ({e})",
                report.soft_after
            );
        }
        report.budget()
    })
}

/// A cache with room to spare within the memlock budget.
fn mlock_cache(config: CacheConfig) -> PinCache<MlockPinner> {
    let bytes = usize::try_from(memlock_budget()).unwrap_or(usize::MAX);
    let config = CacheConfig {
        max_pinned_bytes: Some(bytes),
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
    let budget = memlock_budget();
    let sizes: Vec<usize> = MISS_PAGES
        .iter()
        .copied()
        .filter(|&pages| {
            let fits = (pages * page) as u64 <= budget;
            if !fits {
                eprintln!(
                    "miss_mlock/{pages}, raw_mlock_munlock/{pages}: skipped, {} bytes exceed \
                     RLIMIT_MEMLOCK ({budget} bytes available)",
                    pages * page
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

    let mut group = c.benchmark_group("miss_mlock");
    for &pages in &sizes {
        let len = pages * page;
        if pages >= 256 {
            group.sample_size(20);
        }
        group.bench_with_input(BenchmarkId::from_parameter(pages), &len, |b, &len| {
            b.iter(|| {
                drop(black_box(cache.pin(addr, len).expect("miss")));
                cache.invalidate(addr, len);
            })
        });
    }
    group.finish();

    let mut group = c.benchmark_group("raw_mlock_munlock");
    for &pages in &sizes {
        let len = pages * page;
        if pages >= 256 {
            group.sample_size(20);
        }
        group.bench_with_input(BenchmarkId::from_parameter(pages), &len, |b, &len| {
            b.iter(|| {
                sys::mlock(black_box(addr), len).expect("mlock");
                sys::munlock(addr, len).expect("munlock");
            })
        });
    }
    group.finish();
}

/// Base of the made-up addresses of the NoopPinner miss benchmarks: nothing
/// is mapped there, and NoopPinner never touches memory.
const FAKE_BASE: usize = 0x1000_0000;

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
                    // One page in every two: regions never touch, never merge.
                    let addr = FAKE_BASE + 2 * i * page;
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
        warm(&cache, FAKE_BASE + 2 * i * page, page);
    }
    let mut next = ENTRIES;
    let mut group = c.benchmark_group("miss_noop_evict");
    group.bench_function(BenchmarkId::from_parameter(1), |b| {
        b.iter(|| {
            let addr = FAKE_BASE + 2 * next * page;
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

/// Maps one page, faults it in and hands it to `prepare`; then times the
/// `unmap` of it. Repeats `iters` times; returns the summed unmap times
/// (each includes the cost of reading the clock once).
fn timed_unmaps(
    iters: u64,
    mut prepare: impl FnMut(usize, usize),
    mut unmap: impl FnMut(usize, usize),
) -> Duration {
    let mut total = Duration::ZERO;
    for _ in 0..iters {
        let (addr, len) = Mapping::new(page_size()).expect("mmap").into_raw();
        prepare(addr, len);
        let start = Instant::now();
        unmap(addr, len);
        total += start.elapsed();
    }
    total
}

fn plain_munmap(addr: usize, len: usize) {
    // SAFETY: the mapping was just made by `timed_unmaps` and given up with
    // `into_raw`; nothing refers to it any more.
    unsafe { sys::munmap(addr, len) }.expect("munmap");
}

fn hook_unmap(addr: usize, len: usize) {
    // SAFETY: as for `plain_munmap`; the cache's regions there are dropped
    // by the hook before the pages go.
    unsafe { pincache::unmap(addr as *mut u8, len) }.expect("pincache::unmap");
}

fn bench_unmap(c: &mut Criterion) {
    let mut group = c.benchmark_group("unmap");
    group.bench_function("munmap", |b| {
        b.iter_custom(|iters| timed_unmaps(iters, |_, _| {}, plain_munmap))
    });
    group.bench_function("munmap_mlocked", |b| {
        b.iter_custom(|iters| {
            timed_unmaps(
                iters,
                |addr, len| sys::mlock(addr, len).expect("mlock"),
                plain_munmap,
            )
        })
    });

    let cache = mlock_cache(CacheConfig::default());
    group.bench_function("pincache_unmap", |b| {
        b.iter_custom(|iters| timed_unmaps(iters, |addr, len| warm(&cache, addr, len), hook_unmap))
    });
    check_invalidated("pincache_unmap", &cache);
    drop(cache);

    let monitored = PinCache::new(
        MlockPinner::new(),
        CacheConfig {
            max_pinned_bytes: Some(usize::try_from(memlock_budget()).unwrap_or(usize::MAX)),
            monitor: true,
            ..CacheConfig::default()
        },
    );
    match monitored {
        Ok(cache) => {
            group.bench_function("pincache_unmap_monitored", |b| {
                b.iter_custom(|iters| {
                    timed_unmaps(iters, |addr, len| warm(&cache, addr, len), hook_unmap)
                })
            });
            group.bench_function("munmap_caught_by_monitor", |b| {
                b.iter_custom(|iters| {
                    timed_unmaps(iters, |addr, len| warm(&cache, addr, len), plain_munmap)
                })
            });
            check_invalidated("munmap_caught_by_monitor", &cache);
        }
        Err(e) => eprintln!("unmap with the userfaultfd monitor: skipped ({e})"),
    }
    group.finish();
}

/// Every region the unmap benchmarks pinned must be gone from the cache.
fn check_invalidated<P: Pinner + 'static>(name: &str, cache: &PinCache<P>) {
    // The monitor applies events on its own thread: give it a moment.
    let deadline = Instant::now() + Duration::from_secs(1);
    while cache.stats().pinned_entries != 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    let stats = cache.stats();
    if stats.pinned_entries != 0 || stats.evictions != 0 {
        eprintln!(
            "{name}: unmapped regions were not all invalidated: {} still pinned, {} evicted",
            stats.pinned_entries, stats.evictions
        );
    }
}

criterion_group!(
    benches,
    bench_hit,
    bench_hit_two_threads,
    bench_miss_mlock,
    bench_miss_noop,
    bench_unmap
);
criterion_main!(benches);
