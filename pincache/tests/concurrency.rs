//! Several threads pinning, releasing and invalidating one cache at once:
//! held regions stay pinned, counters add up, nothing leaks.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Barrier;

use common::TrackingPinner;
use pindown_pincache::{CacheConfig, CacheError, PinCache, Policy, Registration};

const PAGE: usize = 4096;
const BASE: usize = 0x20_0000_0000;

/// A small deterministic generator, one per thread.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, bound: usize) -> usize {
        (self.next() % bound as u64) as usize
    }
}

fn hammer(policy: Policy, merge: bool, threads: usize, steps: usize) {
    let pinner = TrackingPinner::default();
    let log = pinner.log.clone();
    let cache = PinCache::new(
        pinner,
        CacheConfig {
            max_pinned_bytes: Some(40 * PAGE),
            max_entries: 12,
            policy,
            merge,
            max_merged_bytes: Some(8 * PAGE),
            ..CacheConfig::default()
        },
    )
    .unwrap();
    let successes = AtomicU64::new(0);
    let start = Barrier::new(threads);
    std::thread::scope(|scope| {
        for seed in 0..threads {
            let (cache, log, successes, start) = (&cache, &log, &successes, &start);
            scope.spawn(move || {
                let mut random = XorShift(
                    0x9E37_79B9_7F4A_7C15 ^ (seed as u64 + 1).wrapping_mul(0x1234_5678_9ABC_DEF1),
                );
                let mut held: Vec<(Registration<'_, TrackingPinner>, usize, usize)> = Vec::new();
                start.wait();
                for step in 0..steps {
                    let choice = random.below(100);
                    if choice < 55 {
                        let addr = BASE + random.below(64 * PAGE);
                        let len = 1 + random.below(3 * PAGE);
                        match cache.pin(addr, len) {
                            Ok(registration) => {
                                assert!(registration.region().contains(addr, len));
                                successes.fetch_add(1, Ordering::Relaxed);
                                held.push((registration, addr, len));
                            }
                            Err(CacheError::LimitReached { .. }) => {}
                            Err(other) => panic!("unexpected error: {other}"),
                        }
                    } else if choice < 97 {
                        if !held.is_empty() {
                            let which = random.below(held.len());
                            drop(held.swap_remove(which));
                        }
                    } else {
                        cache.invalidate(BASE + random.below(64 * PAGE), PAGE);
                    }
                    if held.len() > 3 {
                        drop(held.swap_remove(0));
                    }
                    if step % 64 == 0 {
                        // Every region held right now is pinned right now.
                        let log = log.lock();
                        for (registration, _, _) in &held {
                            let serial = *registration.token();
                            assert!(
                                log.pinned
                                    .iter()
                                    .any(|&(r, s)| s == serial && r == registration.region()),
                                "a held region was unpinned"
                            );
                        }
                    }
                }
            });
        }
    });
    let stats = cache.stats();
    assert_eq!(
        stats.hits + stats.misses,
        successes.load(Ordering::Relaxed),
        "every successful pin is a hit or a miss"
    );
    assert_eq!(
        stats.retired_entries, 0,
        "a released retired region stayed pinned"
    );
    {
        let log = log.lock();
        assert_eq!(stats.pinned_entries, log.pinned.len());
        assert_eq!(
            stats.pinned_bytes,
            log.pinned.iter().map(|(r, _)| r.len).sum::<usize>()
        );
        assert!(stats.pinned_entries <= 12 && stats.pinned_bytes <= 40 * PAGE);
        assert_eq!(log.pins - log.unpins, log.pinned.len() as u64);
    }
    drop(cache);
    let log = log.lock();
    assert_eq!(log.pins, log.unpins, "pins and unpins balance after drop");
    assert!(log.pinned.is_empty());
}

#[test]
fn lru_with_merging_under_four_threads() {
    hammer(Policy::Lru, true, 4, 20_000);
}

#[test]
fn lfu_without_merging_under_four_threads() {
    hammer(Policy::Lfu, false, 4, 20_000);
}

#[test]
fn fifo_under_three_threads() {
    hammer(Policy::Fifo, true, 3, 20_000);
}

#[test]
fn many_threads_beyond_the_reader_slots_still_work() {
    // More threads at once than there are reader slots: the last ones share
    // the overflow slot and take the locked path.
    hammer(Policy::Lru, true, 140, 200);
}
