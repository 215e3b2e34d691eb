//! Properties of the hit-rate experiments that must hold exactly, checked
//! with the cache that `pin-hitrate` drives.

use pindown_benches::replay::{replay, Copier, Layout};
use pindown_benches::sys::Mapping;
use pindown_benches::traces::{self, intended_misses};
use pindown_pincache::{page_size, CacheConfig, MlockPinner, NoopPinner, PinCache, Policy};

const TRANSFER: usize = 8 * 1024;

/// NoopPinner never touches memory, so any page-aligned addresses do.
fn fake_layout() -> Layout {
    Layout::gapped(0x4000_0000, TRANSFER, page_size())
}

fn noop_cache(policy: Policy, capacity: usize, merge: bool) -> PinCache<NoopPinner> {
    let config = CacheConfig {
        max_entries: capacity,
        max_pinned_bytes: Some(capacity * TRANSFER * 2),
        policy,
        merge,
        ..CacheConfig::default()
    };
    PinCache::new(NoopPinner, config).expect("cache")
}

#[test]
fn pm_experiment_misses_exactly_the_intended_fraction() {
    for policy in Policy::ALL {
        for fraction in [0.0, 0.1, 0.25, 0.5, 0.75, 1.0] {
            let trace = traces::pm_miss_fraction(1000, fraction, 16, 7);
            let cache = noop_cache(policy, trace.buffers, false);
            let out = replay(&cache, &trace, &fake_layout(), |_| {}).expect("replay");
            let intended = intended_misses(1000, fraction) as u64;
            assert_eq!(out.misses, intended, "{policy} {fraction}");
            assert_eq!(out.hits, 1000 - intended, "{policy} {fraction}");
            assert_eq!(out.evictions, 0, "{policy} {fraction}");
            assert_eq!(out.transfers, 1000);
        }
    }
}

#[test]
fn sequential_sweep_larger_than_the_cache_never_hits() {
    for policy in [Policy::Lru, Policy::Fifo] {
        for merge in [false, true] {
            let trace = traces::sequential(100, 2000);
            let cache = noop_cache(policy, 64, merge);
            let out = replay(&cache, &trace, &fake_layout(), |_| {}).expect("replay");
            assert_eq!(out.hits, 0, "{policy} merge={merge}");
            assert_eq!(out.misses, 2000);
            assert_eq!(out.evictions, 2000 - 64);
        }
    }
}

#[test]
fn working_set_that_fits_misses_only_once_per_buffer() {
    for policy in Policy::ALL {
        let traces = [
            traces::sequential(100, 2000),
            traces::uniform(100, 2000, 3),
            traces::hot_cold(100, 2000, 0.1, 0.9, 3),
        ];
        for trace in &traces {
            let distinct = {
                let mut ids = trace.accesses.clone();
                ids.sort_unstable();
                ids.dedup();
                ids.len() as u64
            };
            let cache = noop_cache(policy, 100, false);
            let out = replay(&cache, trace, &fake_layout(), |_| {}).expect("replay");
            assert_eq!(out.misses, distinct, "{policy} {}", trace.name);
            assert_eq!(out.evictions, 0, "{policy} {}", trace.name);
        }
    }
}

#[test]
fn hot_set_that_fits_beats_uniform_under_lfu() {
    let hot = traces::hot_cold(1000, 20_000, 0.1, 0.9, 5);
    let uniform = traces::uniform(1000, 20_000, 5);
    let rate = |trace| {
        let cache = noop_cache(Policy::Lfu, 200, false);
        replay(&cache, trace, &fake_layout(), |_| {})
            .expect("replay")
            .hit_rate()
    };
    let (h, u) = (rate(&hot), rate(&uniform));
    assert!(h > 0.8 && u < 0.3, "hot_cold {h}, uniform {u}");
}

#[test]
fn mlock_replay_with_copies_on_real_memory() {
    let trace = traces::pm_miss_fraction(200, 0.5, 8, 11);
    let page = page_size();
    let probe = Layout::gapped(0, TRANSFER, page);
    let mapping = Mapping::new(probe.span(trace.buffers)).expect("mmap");
    let layout = Layout::gapped(mapping.addr(), TRANSFER, page);
    let mut copier = Copier::new(&mapping, TRANSFER);
    let config = CacheConfig {
        max_entries: trace.buffers,
        max_pinned_bytes: Some(trace.buffers * TRANSFER),
        merge: false,
        ..CacheConfig::default()
    };
    let cache = PinCache::new(MlockPinner::new(), config).expect("cache");
    let mut copies = 0;
    let out = replay(&cache, &trace, &layout, |addr| {
        copier.copy(addr);
        copies += 1;
    })
    .expect("replay (RLIMIT_MEMLOCK of at least 1 MiB needed)");
    assert_eq!(copies, 200);
    assert_eq!(out.misses, 100);
    assert_eq!(out.hits, 100);
    assert_eq!(cache.stats().pinned_entries, trace.buffers);
    drop(cache);
}
