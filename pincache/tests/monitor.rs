//! Automatic invalidation: memory unmapped behind the cache's back, then
//! mapped again at the same address, must never hit the stale region.

mod common;

use pindown_pincache::{
    CacheConfig, MemoryMonitor, MlockPinner, Monitor, NoopPinner, PinCache, WriteFence,
};

const PAGE: usize = 4096;

/// The scenarios run one after another: invalidation is process-wide, and
/// parallel tests would unmap and reuse each other's addresses.
#[test]
fn unmapped_memory_is_never_hit_again() {
    plain_munmap_then_map_again_misses();
    the_unmap_hook_invalidates_before_the_pages_go();
    a_region_in_use_when_unmapped_is_retired_and_never_hit_again();
    a_region_retired_then_unmapped_releases_only_its_own_pins();
    a_region_retired_by_a_removal_leaves_the_next_region_watched();
    a_cache_dropped_with_a_leaked_retired_region_releases_only_its_pins();
    mremap_moving_a_mapping_invalidates_the_old_range();
    memory_the_monitor_cannot_watch_is_pinned_but_never_cached();
}

fn monitored_cache() -> PinCache<MlockPinner> {
    PinCache::new(
        MlockPinner::new(),
        CacheConfig {
            max_pinned_bytes: Some(256 * PAGE),
            monitor: Monitor::Required,
            ..CacheConfig::default()
        },
    )
    .expect("the userfaultfd monitor runs here (root)")
}

/// Reads what the pinned memory holds through the region, proving which
/// mapping the cache's region belongs to.
fn first_byte(addr: usize) -> u8 {
    // SAFETY: the test maps the page before reading it.
    unsafe { std::ptr::read_volatile(addr as *const u8) }
}

fn plain_munmap_then_map_again_misses() {
    let cache = monitored_cache();
    let len = 4 * PAGE;
    let buffer = common::map_anonymous(len);
    let addr = buffer as usize;
    // SAFETY: the mapping is ours and writable.
    unsafe { buffer.write(0xAA) };
    drop(cache.pin(addr, len).unwrap());
    assert_eq!(cache.pinner().locked_len(), len);
    let events_before = MemoryMonitor::global().unwrap().events_seen();

    common::unmap_plain(buffer, len);
    let again = common::map_anonymous_at(buffer, len);
    assert_eq!(first_byte(again as usize), 0, "a fresh mapping");

    let registration = cache.pin(addr, len).unwrap();
    let stats = cache.stats();
    assert_eq!(stats.misses, 2, "the stale region was not hit");
    assert_eq!(stats.hits, 0);
    assert_eq!(stats.invalidations, 1);
    assert!(MemoryMonitor::global().unwrap().events_seen() > events_before);
    // The new mapping really is locked now (the stale bookkeeping is gone).
    assert_eq!(cache.pinner().locked_len(), len);
    assert!(pindown_pincache::locked_bytes().unwrap() >= len as u64);
    drop(registration);
    drop(cache);
    common::unmap_plain(again, len);
}

fn the_unmap_hook_invalidates_before_the_pages_go() {
    let cache = monitored_cache();
    let unmonitored = PinCache::new(MlockPinner::new(), CacheConfig::default()).unwrap();
    let len = 2 * PAGE;
    let buffer = common::map_anonymous(len);
    let addr = buffer as usize;
    drop(cache.pin(addr, len).unwrap());
    drop(unmonitored.pin(addr, PAGE).unwrap());

    // SAFETY: nothing uses the mapping afterwards.
    unsafe { pindown_pincache::unmap(buffer, len) }.unwrap();
    assert_eq!(cache.stats().invalidations, 1);
    assert_eq!(
        unmonitored.stats().invalidations,
        1,
        "every cache hears of the hook"
    );
    assert_eq!(cache.pinner().locked_len(), 0);

    let again = common::map_anonymous_at(buffer, len);
    drop(cache.pin(addr, len).unwrap());
    drop(unmonitored.pin(addr, PAGE).unwrap());
    assert_eq!(cache.stats().misses, 2);
    assert_eq!(unmonitored.stats().misses, 2);
    drop(cache);
    drop(unmonitored);
    common::unmap_plain(again, len);
}

fn a_region_in_use_when_unmapped_is_retired_and_never_hit_again() {
    let cache = monitored_cache();
    let len = 3 * PAGE;
    let buffer = common::map_anonymous(len);
    let addr = buffer as usize;
    let held = cache.pin(addr, len).unwrap();
    common::unmap_plain(buffer, len);
    let again = common::map_anonymous_at(buffer, len);
    let fresh = cache.pin(addr + PAGE, PAGE).unwrap();
    assert_ne!(
        fresh.region(),
        held.region(),
        "a new region, not the retired one"
    );
    let stats = cache.stats();
    assert_eq!((stats.misses, stats.retired_entries), (2, 1));
    drop(held);
    assert_eq!(
        cache.stats().retired_entries,
        0,
        "unpinned at its last release"
    );
    drop(fresh);
    drop(cache);
    common::unmap_plain(again, len);
}

/// A region invalidated while held (retired, out of the index), whose
/// memory is then unmapped in two parts, each mapped again and pinned by a
/// new region: releasing the old region must leave the new ones' pins.
fn a_region_retired_then_unmapped_releases_only_its_own_pins() {
    let cache = monitored_cache();
    let len = 4 * PAGE;
    // Two holes, one after the other, each mapped again and pinned.
    let (held, buffer, second_again) = retired_with_a_hole(&cache, len);
    let addr = buffer as usize;
    let fresh_second = cache.pin(addr + PAGE, PAGE).unwrap();
    // SAFETY: as above.
    let fourth = unsafe { buffer.add(3 * PAGE) };
    common::unmap_plain(fourth, PAGE);
    let fourth_again = common::map_anonymous_at(fourth, PAGE);
    let fresh_fourth = cache.pin(addr + 3 * PAGE, PAGE).unwrap();
    // Pages 0 and 2 are the old region's alone; 1 and 3 the new regions'.
    assert_eq!(cache.pinner().locked_len(), len);
    drop(held);
    assert_eq!(
        cache.pinner().locked_len(),
        2 * PAGE,
        "the new regions' pages stay locked"
    );
    assert_eq!(cache.stats().retired_entries, 0);
    drop((fresh_second, fresh_fourth));
    drop(cache);
    common::unmap_plain(buffer, PAGE);
    common::unmap_plain(second_again, PAGE);
    // SAFETY: as above.
    common::unmap_plain(unsafe { buffer.add(2 * PAGE) }, PAGE);
    common::unmap_plain(fourth_again, PAGE);
}

/// A removal (MADV_DONTNEED through the crate's helper) clears the
/// monitor's watches and retires a held region; a new region there
/// watches the pages again. The old region's release must not unwatch
/// them: else a later munmap goes unseen and the cache hits a stale region.
fn a_region_retired_by_a_removal_leaves_the_next_region_watched() {
    let cache = monitored_cache();
    let len = 4 * PAGE;
    let buffer = common::map_anonymous(len);
    let addr = buffer as usize;
    let held = cache.pin(addr, len).unwrap();
    // SAFETY: the mapping is ours; its contents may go (locked pages make
    // the kernel refuse, after the watches are cleared: what matters here).
    let _ = unsafe { pindown_pincache::madvise_dontneed(buffer, len) };
    assert_eq!(cache.stats().retired_entries, 1);
    let fresh = cache.pin(addr, len).unwrap();
    drop(held);
    drop(fresh);
    common::unmap_plain(buffer, len);
    let again = common::map_anonymous_at(buffer, len);
    let misses = cache.stats().misses;
    drop(cache.pin(addr, len).unwrap());
    assert_eq!(
        cache.stats().misses,
        misses + 1,
        "memory mapped again after a munmap must miss, not hit the old region"
    );
    drop(cache);
    common::unmap_plain(again, len);
}

/// A registration leaked (mem::forget) on a region retired and then partly
/// unmapped: dropping the cache releases that region's pins but for the
/// unmapped part, whose pages another region now pins.
fn a_cache_dropped_with_a_leaked_retired_region_releases_only_its_pins() {
    let cache = monitored_cache();
    let len = 4 * PAGE;
    let (held, buffer, second_again) = retired_with_a_hole(&cache, len);
    drop(cache.pin(buffer as usize + PAGE, PAGE).unwrap());
    std::mem::forget(held);
    let dropped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(cache)));
    assert!(
        dropped.is_ok(),
        "the cache's drop released pins it did not hold"
    );
    common::unmap_plain(buffer, PAGE);
    common::unmap_plain(second_again, PAGE);
    // SAFETY: the rest of the mapping made above.
    common::unmap_plain(unsafe { buffer.add(2 * PAGE) }, 2 * PAGE);
}

/// Maps `len` bytes, pins them (the registration returned), invalidates
/// them while held (the region retires), then unmaps the second page and
/// maps it again; returns the registration, the mapping and the new page.
fn retired_with_a_hole(
    cache: &PinCache<MlockPinner>,
    len: usize,
) -> (
    pindown_pincache::Registration<'_, MlockPinner>,
    *mut u8,
    *mut u8,
) {
    let buffer = common::map_anonymous(len);
    let addr = buffer as usize;
    let held = cache.pin(addr, len).unwrap();
    assert_eq!(cache.invalidate(addr, len), 1);
    assert_eq!(cache.stats().retired_entries, 1);
    // SAFETY: a page of the mapping made above.
    let second = unsafe { buffer.add(PAGE) };
    common::unmap_plain(second, PAGE);
    (held, buffer, common::map_anonymous_at(second, PAGE))
}

fn mremap_moving_a_mapping_invalidates_the_old_range() {
    let cache = monitored_cache();
    let len = 2 * PAGE;
    let buffer = common::map_anonymous(len);
    let addr = buffer as usize;
    drop(cache.pin(addr, len).unwrap());
    // Make room to move to, then move the mapping there.
    let target = common::map_anonymous(len);
    // SAFETY: both mappings are ours; MREMAP_FIXED replaces `target`.
    let moved = unsafe {
        libc::mremap(
            buffer.cast(),
            len,
            len,
            libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
            target.cast::<libc::c_void>(),
        )
    };
    assert_eq!(moved, target.cast());
    let again = common::map_anonymous_at(buffer, len);
    drop(cache.pin(addr, len).unwrap());
    let stats = cache.stats();
    assert_eq!(stats.misses, 2);
    assert!(stats.invalidations >= 1);
    drop(cache);
    common::unmap_plain(again, len);
    common::unmap_plain(target, len);
}

/// Memory another userfaultfd holds (here a write fence's) cannot be
/// watched: a registration of it is served, but its region is never hit
/// afterwards, since an unmap of it would go unseen.
fn memory_the_monitor_cannot_watch_is_pinned_but_never_cached() {
    let cache = PinCache::new(
        NoopPinner,
        CacheConfig {
            monitor: Monitor::Required,
            ..CacheConfig::default()
        },
    )
    .unwrap();
    let len = 4 * PAGE;
    let buffer = common::map_anonymous(len);
    let addr = buffer as usize;
    let fence = WriteFence::raise(addr, len).expect("a fence over fresh anonymous memory");
    for _ in 0..2 {
        drop(cache.pin(addr, len).unwrap());
    }
    let stats = cache.stats();
    assert_eq!(
        (stats.hits, stats.misses, stats.unwatched),
        (0, 2, 2),
        "each registration pinned anew, none cached"
    );
    assert_eq!(
        (
            stats.pinned_entries,
            stats.retired_entries,
            stats.pinned_bytes
        ),
        (0, 0, 0),
        "unpinned at their release"
    );
    // Held, it stays pinned until released.
    let held = cache.pin(addr, len).unwrap();
    assert_eq!(cache.stats().pinned_entries, 1);
    drop(held);
    assert_eq!(cache.stats().pinned_entries, 0);
    drop(fence);
    // Watchable again: cached again.
    drop(cache.pin(addr, len).unwrap());
    drop(cache.pin(addr, len).unwrap());
    let stats = cache.stats();
    assert_eq!((stats.hits, stats.unwatched), (1, 3));
    drop(cache);
    common::unmap_plain(buffer, len);
}
