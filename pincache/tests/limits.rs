//! Limits, errors, policies and scale.

mod common;

use common::TrackingPinner;
use pindown_pincache::{CacheConfig, CacheError, Limit, NoopPinner, PageRange, PinCache, Policy};

const PAGE: usize = 4096;
const BASE: usize = 0x30_0000_0000;

fn cache_with(policy: Policy, entries: usize) -> PinCache<TrackingPinner> {
    PinCache::new(
        TrackingPinner::default(),
        CacheConfig {
            max_pinned_bytes: Some(1 << 30),
            max_entries: entries,
            policy,
            merge: false,
            ..CacheConfig::default()
        },
    )
    .unwrap()
}

/// Pins regions A, B, C (one page each, apart), applies `hits` (indices),
/// pins D, and returns which of A, B, C was evicted.
fn victim(policy: Policy, hits: &[usize], switch_to: Option<Policy>) -> usize {
    let cache = cache_with(policy, 3);
    let region = |i: usize| BASE + i * 4 * PAGE;
    for i in 0..3 {
        drop(cache.pin(region(i), PAGE).unwrap());
    }
    if let Some(next) = switch_to {
        cache.set_policy(next);
    }
    for &i in hits {
        drop(cache.pin(region(i), PAGE).unwrap());
    }
    drop(cache.pin(region(3), PAGE).unwrap());
    assert_eq!(cache.stats().evictions, 1);
    let log = cache.pinner().log.lock();
    let still: Vec<usize> = log.pinned.iter().map(|(r, _)| r.start).collect();
    let gone: Vec<usize> = (0..3).filter(|&i| !still.contains(&region(i))).collect();
    assert_eq!(gone.len(), 1);
    gone[0]
}

#[test]
fn each_policy_evicts_its_own_victim() {
    // Uses: A x3, B, C. Last use order A < B < C; counts A=4, B=2, C=2.
    let hits = [0, 0, 0, 1, 2];
    assert_eq!(victim(Policy::Lru, &hits, None), 0);
    assert_eq!(
        victim(Policy::Lfu, &hits, None),
        1,
        "least used, oldest of the ties"
    );
    assert_eq!(victim(Policy::Fifo, &hits, None), 0);
    // Uses: B x3, C, A. Last use order B < C < A; counts A=2, B=4, C=2.
    let hits = [1, 1, 1, 2, 0];
    assert_eq!(victim(Policy::Lru, &hits, None), 1);
    assert_eq!(victim(Policy::Lfu, &hits, None), 0);
    assert_eq!(victim(Policy::Fifo, &hits, None), 0);
    // Switching at run time: FIFO from then on ignores the uses.
    assert_eq!(victim(Policy::Lru, &hits, Some(Policy::Fifo)), 0);
    assert_eq!(victim(Policy::Fifo, &[0, 0, 1], Some(Policy::Lru)), 2);
}

#[test]
fn the_entry_limit_is_reported_by_name_and_in_use_regions_stay() {
    let cache = cache_with(Policy::Lru, 2);
    let a = cache.pin(BASE, PAGE).unwrap();
    let b = cache.pin(BASE + 8 * PAGE, PAGE).unwrap();
    match cache.pin(BASE + 16 * PAGE, PAGE) {
        Err(
            error @ CacheError::LimitReached {
                limit: Limit::Entries,
                ..
            },
        ) => {
            let message = error.to_string();
            assert!(message.contains("max_entries"), "{message}");
            // Both pinned regions are held: the message counts them.
            assert!(message.contains("2 of the 2 pinned regions"), "{message}");
            assert!(
                matches!(
                    error,
                    CacheError::LimitReached {
                        in_use: 2,
                        entries: 2,
                        ..
                    }
                ),
                "{error:?}"
            );
        }
        other => panic!(
            "expected the entry limit, got {:?}",
            other.map(|r| r.region())
        ),
    }
    assert_eq!(cache.stats().evictions, 0);
    assert_eq!(cache.pinner().log.lock().pinned.len(), 2);
    drop(a);
    // Now one is idle: the same request succeeds by evicting it.
    let c = cache.pin(BASE + 16 * PAGE, PAGE).unwrap();
    assert_eq!(cache.stats().evictions, 1);
    assert!(cache
        .pinner()
        .log
        .lock()
        .pinned
        .iter()
        .any(|(r, _)| *r == b.region()));
    drop((b, c));
}

#[test]
fn bad_requests_get_clear_errors_and_change_nothing() {
    let cache = cache_with(Policy::Lru, 4);
    assert!(matches!(
        cache.pin(BASE, 0),
        Err(CacheError::EmptyRange { .. })
    ));
    assert!(matches!(
        cache.pin(usize::MAX - 10, 100),
        Err(CacheError::OutOfRange { .. })
    ));
    assert!(matches!(
        cache.pin(1 << 60, PAGE),
        Err(CacheError::OutOfRange { .. })
    ));
    let small = PinCache::new(
        NoopPinner,
        CacheConfig {
            max_pinned_bytes: Some(4 * PAGE),
            ..CacheConfig::default()
        },
    )
    .unwrap();
    assert!(matches!(
        small.pin(BASE, 5 * PAGE),
        Err(CacheError::TooLarge { .. })
    ));
    assert_eq!(cache.stats().pinned_entries, 0);
    assert_eq!(cache.pinner().log.lock().pins, 0);
    for bad in [
        CacheConfig {
            max_entries: 0,
            ..CacheConfig::default()
        },
        CacheConfig {
            max_pinned_bytes: Some(100),
            ..CacheConfig::default()
        },
    ] {
        assert!(matches!(
            PinCache::new(NoopPinner, bad),
            Err(CacheError::InvalidConfig(_))
        ));
    }
}

#[test]
fn a_failing_pinner_leaves_the_cache_as_it_was() {
    let cache = cache_with(Policy::Lru, 4);
    drop(cache.pin(BASE, PAGE).unwrap());
    cache.pinner().log.lock().refuse = Some(PageRange {
        start: BASE + 4 * PAGE,
        len: PAGE,
    });
    assert!(matches!(
        cache.pin(BASE + 4 * PAGE, 10),
        Err(CacheError::Pin(_))
    ));
    drop(cache.pin(BASE, PAGE).unwrap());
    let stats = cache.stats();
    assert_eq!((stats.hits, stats.misses, stats.pinned_entries), (1, 1, 1));
}

#[test]
fn a_cached_neighbour_the_pinner_now_refuses_does_not_fail_the_request() {
    let cache = PinCache::new(
        TrackingPinner::default(),
        CacheConfig {
            max_pinned_bytes: Some(1 << 30),
            merge: true,
            ..CacheConfig::default()
        },
    )
    .unwrap();
    // The upper neighbour is cached idle, then its pages go (freed or
    // made inaccessible): pinning it again fails from now on.
    drop(cache.pin(BASE + 4 * PAGE, 4 * PAGE).unwrap());
    cache.pinner().log.lock().refuse = Some(PageRange {
        start: BASE + 4 * PAGE,
        len: 4 * PAGE,
    });
    // The region right below would merge with it; merged, the pinner
    // refuses: the request alone is pinned, every time.
    for _ in 0..2 {
        let below = cache
            .pin(BASE, 4 * PAGE)
            .expect("the request alone is pinned");
        assert_eq!(below.region().start, BASE);
        assert_eq!(below.region().len, 4 * PAGE);
    }
}

#[test]
fn merges_stay_bounded() {
    let cache = PinCache::new(
        TrackingPinner::default(),
        CacheConfig {
            max_pinned_bytes: Some(1 << 30),
            max_merged_bytes: Some(8 * PAGE),
            ..CacheConfig::default()
        },
    )
    .unwrap();
    // Adjacent one-page requests, left to right: merged up to 8 pages, then a new region.
    for i in 0..20 {
        let registration = cache.pin(BASE + i * PAGE, PAGE).unwrap();
        assert!(registration.region().len <= 8 * PAGE);
        assert!(registration.region().contains(BASE + i * PAGE, PAGE));
    }
    let stats = cache.stats();
    assert!(stats.merges > 0);
    assert!(
        stats.pinned_entries >= 3,
        "20 pages in regions of at most 8"
    );
    assert_eq!(
        stats.pinned_bytes,
        20 * PAGE,
        "merged regions replace their parts"
    );
}

#[test]
fn a_hundred_thousand_entries_all_hit_and_the_index_stays_small() {
    const ENTRIES: usize = 100_000;
    let cache = PinCache::new(
        NoopPinner,
        CacheConfig {
            max_pinned_bytes: Some(1 << 40),
            max_entries: ENTRIES,
            merge: false,
            ..CacheConfig::default()
        },
    )
    .unwrap();
    for i in 0..ENTRIES {
        drop(cache.pin(BASE + 2 * i * PAGE, PAGE).unwrap());
    }
    for i in (0..ENTRIES).rev() {
        let registration = cache.pin(BASE + 2 * i * PAGE + 7, 100).unwrap();
        assert_eq!(registration.region().start, BASE + 2 * i * PAGE);
    }
    // Between the regions nothing is cached.
    let stats = cache.stats();
    assert_eq!(
        (stats.misses, stats.hits, stats.pinned_entries),
        (ENTRIES as u64, ENTRIES as u64, ENTRIES)
    );
    // 200,000 pages span 391 leaf nodes of 512 pages, plus the levels above.
    assert!(
        stats.index_nodes <= 2 * ENTRIES * 2 / 512 + 8,
        "{} nodes",
        stats.index_nodes
    );
    drop(cache.pin(BASE + PAGE, 1).unwrap());
    assert_eq!(cache.stats().misses, ENTRIES as u64 + 1);
}

#[test]
fn a_full_table_of_held_regions_counts_every_one_as_in_use() {
    // 1,024 regions, all held; one of them released later.
    let cache = cache_with(Policy::Lru, 1024);
    let mut held: Vec<_> = (0..1024)
        .map(|i| cache.pin(BASE + i * 2 * PAGE, PAGE).unwrap())
        .collect();
    let error = cache.pin(BASE + 4096 * PAGE, PAGE).unwrap_err();
    assert!(
        matches!(
            error,
            CacheError::LimitReached {
                limit: Limit::Entries,
                in_use: 1024,
                entries: 1024,
                ..
            }
        ),
        "{error:?}"
    );
    let message = error.to_string();
    assert!(
        message.contains("1024 of the 1024 pinned regions"),
        "{message}"
    );
    // One released: the next pin evicts it instead of failing.
    drop(held.pop());
    let next = cache.pin(BASE + 4096 * PAGE, PAGE).unwrap();
    assert_eq!(cache.stats().evictions, 1);
    drop(next);
}
