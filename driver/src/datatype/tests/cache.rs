//! The descriptor cache: which entries each policy keeps, and counters
//! that add up exactly.

use std::sync::Arc;

use crate::datatype::{CacheConfig, CacheStats, Committed, Datatype, DescriptorCache, Policy};

fn types(n: usize) -> Vec<Committed> {
    (0..n)
        .map(|i| {
            Datatype::vector(4, 1, 2 + i as i64, &Datatype::f64())
                .unwrap()
                .commit()
                .unwrap()
        })
        .collect()
}

fn cache(policy: Policy, capacity: usize) -> DescriptorCache {
    DescriptorCache::new(CacheConfig {
        policy,
        capacity,
        promote_after: None,
    })
}

/// The invariants every cache keeps.
fn check_sums(cache: &DescriptorCache) {
    let s = cache.stats();
    assert_eq!(s.lookups, s.hits + s.misses, "{s:?}");
    assert_eq!(s.misses, s.insertions + s.bypasses + s.failures, "{s:?}");
    assert_eq!(s.insertions, s.evictions + cache.len() as u64, "{s:?}");
}

/// Looks up `(t[i], 1)` for each `i` of `sequence` and returns which of
/// the types are held afterwards.
fn run(cache: &mut DescriptorCache, t: &[Committed], sequence: &[usize]) -> Vec<bool> {
    for &i in sequence {
        let lookup = cache.get(&t[i], 1).unwrap();
        assert_eq!(lookup.descriptor.pattern, t[i].pattern(1).unwrap());
        assert_eq!(
            lookup.descriptor.encoded,
            lookup.descriptor.pattern.encode()
        );
        check_sums(cache);
    }
    t.iter().map(|t| cache.contains(t, 1)).collect()
}

fn stats(lookups: u64, hits: u64, insertions: u64, evictions: u64, bypasses: u64) -> CacheStats {
    CacheStats {
        lookups,
        hits,
        misses: lookups - hits,
        insertions,
        evictions,
        bypasses,
        failures: 0,
        promotions: 0,
    }
}

#[test]
fn lru_evicts_the_least_recently_used() {
    let t = types(3);
    let mut c = cache(Policy::Lru, 2);
    // A, B, A, C: B is the least recently used.
    assert_eq!(run(&mut c, &t, &[0, 1, 0, 2]), [true, false, true]);
    assert_eq!(c.stats(), stats(4, 1, 3, 1, 0));
}

#[test]
fn lfu_evicts_the_least_frequently_used() {
    let t = types(3);
    let mut c = cache(Policy::Lfu, 2);
    // A, A, B, B, B, A, C: A and B have 3 uses each; among equals the
    // least recently used (B) goes.
    assert_eq!(run(&mut c, &t, &[0, 0, 1, 1, 1, 0, 2]), [true, false, true]);
    assert_eq!(c.stats(), stats(7, 4, 3, 1, 0));
    // B comes back (1 use) and pushes out C (1 use, older) rather than
    // A (3 uses), where LRU would push out A.
    assert_eq!(run(&mut c, &t, &[1]), [true, true, false]);
    let mut lru = cache(Policy::Lru, 2);
    assert_eq!(
        run(&mut lru, &t, &[0, 0, 1, 1, 1, 0, 2, 1]),
        [false, true, true]
    );
}

#[test]
fn fifo_evicts_the_first_inserted() {
    let t = types(3);
    let mut c = cache(Policy::Fifo, 2);
    // A, B, A, C: A came first, although it was used last but one.
    assert_eq!(run(&mut c, &t, &[0, 1, 0, 2]), [false, true, true]);
    assert_eq!(c.stats(), stats(4, 1, 3, 1, 0));
}

#[test]
fn first_come_keeps_the_first_entries_and_bypasses_later_ones() {
    let t = types(3);
    let mut c = cache(Policy::FirstCome, 2);
    assert_eq!(run(&mut c, &t, &[0, 1, 2, 2, 0, 1]), [true, true, false]);
    assert_eq!(c.stats(), stats(6, 2, 2, 0, 2));
}

#[test]
fn capacity_zero_keeps_nothing() {
    let t = types(1);
    let mut c = cache(Policy::Lru, 0);
    assert_eq!(run(&mut c, &t, &[0, 0]), [false]);
    assert_eq!(c.stats(), stats(2, 0, 0, 0, 2));
}

#[test]
fn hits_share_the_descriptor_and_counts_are_separate_keys() {
    let t = types(1);
    let mut c = cache(Policy::Lru, 4);
    let first = c.get(&t[0], 3).unwrap();
    let again = c.get(&t[0].clone(), 3).unwrap();
    assert!(!first.hit && again.hit);
    assert!(Arc::ptr_eq(&first.descriptor, &again.descriptor));
    let other = c.get(&t[0], 4).unwrap();
    assert!(!other.hit);
    assert_eq!(other.descriptor.pattern, t[0].pattern(4).unwrap());
    // The same type committed again is another type.
    let recommitted = t[0].datatype().commit().unwrap();
    assert!(!c.get(&recommitted, 3).unwrap().hit);
    assert_eq!(c.stats(), stats(4, 1, 3, 0, 0));
    check_sums(&c);
}

#[test]
fn entries_turn_hot_once_after_enough_uses() {
    let t = types(2);
    let mut c = DescriptorCache::new(CacheConfig {
        policy: Policy::Lru,
        capacity: 4,
        promote_after: Some(3),
    });
    let hot: Vec<bool> = (0..5).map(|_| c.get(&t[0], 1).unwrap().hot).collect();
    assert_eq!(hot, [false, false, true, true, true]);
    assert!(!c.get(&t[1], 1).unwrap().hot);
    assert_eq!(c.stats().promotions, 1);
    check_sums(&c);
}

#[test]
fn failed_compiles_are_counted_and_not_kept() {
    let wide = Datatype::hvector(2, 1, i64::MAX / 2, &Datatype::byte())
        .unwrap()
        .commit()
        .unwrap();
    let mut c = cache(Policy::Lfu, 2);
    assert!(c.get(&wide, 4).is_err());
    assert!(c.get(&wide, 1).is_ok());
    let s = c.stats();
    assert_eq!((s.failures, s.insertions, c.len()), (1, 1, 1));
    check_sums(&c);
}

#[test]
fn policy_changes_at_run_time() {
    let t = types(3);
    let mut c = cache(Policy::Lru, 2);
    run(&mut c, &t, &[0, 1, 0]);
    c.set_policy(Policy::Fifo);
    assert_eq!(c.config().policy, Policy::Fifo);
    assert_eq!(run(&mut c, &t, &[2]), [false, true, true]);
}
