//! The real mlock pinner: the kernel's locked-memory count follows the cache.
//! One test function, because VmLck is per process.

mod common;

use pindown_pincache::{
    locked_bytes, memlock_limit, CacheConfig, CacheError, MlockPinner, PinCache, PinError,
};

const PAGE: usize = 4096;

#[test]
fn vmlck_rises_with_pins_merges_and_falls_back_on_unpin() {
    let limit = memlock_limit().unwrap() as usize;
    assert!(
        limit >= 256 * 1024,
        "tests need at least 256 KiB of RLIMIT_MEMLOCK"
    );
    let len = 64 * PAGE;
    let buffer = common::map_anonymous(len);
    let base = buffer as usize;
    let before = locked_bytes().unwrap();

    let cache = PinCache::new(
        MlockPinner::new(),
        CacheConfig {
            max_pinned_bytes: Some(32 * PAGE),
            max_entries: 4,
            ..CacheConfig::default()
        },
    )
    .unwrap();
    {
        let _a = cache.pin(base + 100, 3 * PAGE).unwrap();
        assert_eq!(locked_bytes().unwrap(), before + 4 * PAGE as u64);
        // Overlapping the held region: merged into one pin of 6 pages; the
        // held region stays locked underneath, and no page is counted twice.
        let _b = cache.pin(base + 2 * PAGE, 4 * PAGE).unwrap();
        assert_eq!(locked_bytes().unwrap(), before + 6 * PAGE as u64);
        assert_eq!(cache.pinner().locked_len(), 6 * PAGE);
    }
    // Released: still cached and locked.
    assert_eq!(locked_bytes().unwrap(), before + 6 * PAGE as u64);
    let stats = cache.stats();
    assert_eq!(
        (stats.misses, stats.pinned_entries, stats.pinned_bytes),
        (2, 1, 6 * PAGE)
    );

    // A hit needs no new lock.
    drop(cache.pin(base + PAGE, PAGE).unwrap());
    assert_eq!(cache.stats().hits, 1);

    // Filling the byte limit evicts the idle region and unlocks it.
    {
        let _far = cache.pin(base + 32 * PAGE, 30 * PAGE).unwrap();
        assert_eq!(cache.stats().evictions, 1);
        assert_eq!(locked_bytes().unwrap(), before + 30 * PAGE as u64);
        // Nothing idle is left: the limit is reported by name, nothing changes.
        match cache.pin(base, 8 * PAGE) {
            Err(CacheError::LimitReached { limit, .. }) => {
                assert_eq!(limit, pindown_pincache::Limit::PinnedBytes)
            }
            other => panic!("expected LimitReached, got {:?}", other.map(|r| r.region())),
        }
        assert_eq!(locked_bytes().unwrap(), before + 30 * PAGE as u64);
    }

    // Invalidation unlocks idle regions at once.
    assert_eq!(cache.invalidate(base + 40 * PAGE, 1), 1);
    assert_eq!(locked_bytes().unwrap(), before);

    // Beyond RLIMIT_MEMLOCK, the error says so. Root's CAP_IPC_LOCK would
    // lift the limit, so the pin runs on a thread that dropped it.
    let big_len = (limit + 16 * PAGE).next_multiple_of(PAGE);
    let big = common::map_anonymous(big_len) as usize;
    let unlimited = PinCache::new(
        MlockPinner::new(),
        CacheConfig {
            max_pinned_bytes: Some(big_len),
            ..CacheConfig::default()
        },
    )
    .unwrap();
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                drop_ipc_lock_capability();
                match unlimited.pin(big, big_len) {
                    Err(CacheError::Pin(error @ PinError::MemlockLimit { .. })) => {
                        assert!(error.to_string().contains("RLIMIT_MEMLOCK"), "{error}");
                    }
                    other => panic!(
                        "expected a memlock error, got {:?}",
                        other.map(|r| r.region())
                    ),
                }
            })
            .join()
            .unwrap();
    });
    assert_eq!(
        unlimited.stats().pinned_entries,
        0,
        "a failed pin leaves nothing behind"
    );
    assert_eq!(locked_bytes().unwrap(), before);
    common::unmap_plain(big as *mut u8, big_len);

    // Unmapped memory: a clear error, not a limit error.
    match unlimited.pin(big, PAGE) {
        Err(CacheError::Pin(PinError::Unmapped { .. })) => {}
        other => panic!("expected Unmapped, got {:?}", other.map(|r| r.region())),
    }
    drop(unlimited);

    drop(cache);
    assert_eq!(
        locked_bytes().unwrap(),
        before,
        "dropping the cache unlocks everything"
    );
    common::unmap_plain(buffer, len);
}

/// Clears CAP_IPC_LOCK from the calling thread's effective capabilities
/// (capabilities are per thread), so RLIMIT_MEMLOCK applies to it.
fn drop_ipc_lock_capability() {
    const CAP_IPC_LOCK: u32 = 14;
    const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    let mut header = Header {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let mut data = [Data::default(); 2];
    // SAFETY: capget fills the two data words for this thread.
    let got = unsafe { libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) };
    assert_eq!(got, 0, "capget failed");
    data[0].effective &= !(1 << CAP_IPC_LOCK);
    // SAFETY: capset reads the header and data we own; it only lowers this
    // thread's effective set.
    let set = unsafe { libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()) };
    assert_eq!(set, 0, "capset failed");
}
