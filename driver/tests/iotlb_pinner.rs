//! `IotlbPinner` logic against a recording transport: mlock plus IOTLB
//! entries, reference counts over overlapping pins, failure roll-back, and
//! use inside a real `PinCache`.

use std::collections::BTreeMap;
use std::sync::Arc;

use parking_lot::Mutex;
use pindown_driver::transport::QueueIndex;
use pindown_driver::{
    page_size, CompletionEvent, DmaArena, IotlbAccess, IotlbPinner, MemoryTableRegion, QueueLayout,
    Transport, TransportError,
};
use pindown_pincache::{CacheConfig, PageRange, PinCache, PinError, Pinner};

#[derive(Debug, Clone, PartialEq, Eq)]
enum Call {
    Map {
        iova: u64,
        len: u64,
        uaddr: u64,
        access: IotlbAccess,
    },
    Unmap {
        iova: u64,
        len: u64,
    },
}

/// Records IOTLB calls, keeps the resulting translation table per page, and
/// fails maps on request.
#[derive(Default)]
struct Recorder {
    calls: Mutex<Vec<Call>>,
    /// page -> number of live entries covering it (must stay 0 or 1).
    table: Mutex<BTreeMap<u64, u32>>,
    fail_map_at: Mutex<Option<u64>>,
}

impl Recorder {
    fn take_calls(&self) -> Vec<Call> {
        std::mem::take(&mut *self.calls.lock())
    }
    fn mapped_pages(&self) -> Vec<u64> {
        self.table.lock().keys().copied().collect()
    }
}

impl Transport for Recorder {
    fn device_features(&self) -> u64 {
        0
    }
    fn negotiate_features(&self, wanted: u64) -> Result<u64, TransportError> {
        Ok(wanted)
    }
    fn features(&self) -> u64 {
        0
    }
    fn ring_layout(&self) -> pindown_uapi::RingLayout {
        pindown_uapi::RingLayout {
            queue_pairs: 0,
            rdma_queue_pairs: 0,
        }
    }
    fn register_memory(&self, _regions: &[MemoryTableRegion<'_>]) -> Result<(), TransportError> {
        Ok(())
    }
    fn setup_queue(&self, index: QueueIndex, _layout: &QueueLayout) -> Result<(), TransportError> {
        Err(TransportError::QueueNotSetUp(index))
    }
    fn enable_queue(&self, index: QueueIndex, _enabled: bool) -> Result<(), TransportError> {
        Err(TransportError::QueueNotSetUp(index))
    }
    fn notify(&self, index: QueueIndex) -> Result<(), TransportError> {
        Err(TransportError::QueueNotSetUp(index))
    }
    fn completion_event(&self, index: QueueIndex) -> Result<CompletionEvent, TransportError> {
        Err(TransportError::QueueNotSetUp(index))
    }
    fn iotlb_enabled(&self) -> bool {
        true
    }
    fn iotlb_map(
        &self,
        iova: u64,
        len: u64,
        uaddr: u64,
        access: IotlbAccess,
    ) -> Result<(), TransportError> {
        if *self.fail_map_at.lock() == Some(iova) {
            return Err(TransportError::Rejected {
                request: "IOTLB_MSG",
                status: 1,
            });
        }
        self.calls.lock().push(Call::Map {
            iova,
            len,
            uaddr,
            access,
        });
        let page = page_size() as u64;
        let mut table = self.table.lock();
        for p in (iova..iova + len).step_by(page as usize) {
            let count = table.entry(p / page).or_insert(0);
            *count += 1;
            assert_eq!(*count, 1, "overlapping IOTLB entries for page {p:#x}");
        }
        Ok(())
    }
    fn iotlb_unmap(&self, iova: u64, len: u64) -> Result<(), TransportError> {
        self.calls.lock().push(Call::Unmap { iova, len });
        let page = page_size() as u64;
        let mut table = self.table.lock();
        for p in (iova..iova + len).step_by(page as usize) {
            table.remove(&(p / page));
        }
        Ok(())
    }
}

fn pages(arena: &DmaArena, first: usize, count: usize) -> PageRange {
    PageRange {
        start: arena.addr() as usize + first * page_size(),
        len: count * page_size(),
    }
}

#[test]
fn pin_locks_and_maps_unpin_invalidates_and_unlocks() {
    let arena = DmaArena::new(1 << 20).unwrap();
    let recorder = Arc::new(Recorder::default());
    let pinner = IotlbPinner::new(Arc::clone(&recorder));
    let range = pages(&arena, 2, 3);
    let token = pinner.pin(range).unwrap();
    assert_eq!(token, range.start as u64, "token is the IOVA");
    assert_eq!(
        recorder.take_calls(),
        vec![Call::Map {
            iova: range.start as u64,
            len: range.len as u64,
            uaddr: range.start as u64,
            access: IotlbAccess::ReadWrite
        }]
    );
    assert_eq!(pinner.locked_len(), range.len);
    assert_eq!(pinner.mapped_len(), range.len);
    pinner.unpin(range, token);
    assert_eq!(
        recorder.take_calls(),
        vec![Call::Unmap {
            iova: range.start as u64,
            len: range.len as u64
        }]
    );
    assert_eq!(pinner.locked_len(), 0);
    assert_eq!(pinner.mapped_len(), 0);
}

#[test]
fn overlapping_pins_share_entries_per_page() {
    let arena = DmaArena::new(1 << 20).unwrap();
    let recorder = Arc::new(Recorder::default());
    let pinner = IotlbPinner::new(Arc::clone(&recorder));
    let p = page_size() as u64;
    let base = arena.addr();
    let a = pages(&arena, 0, 4); // pages 0..4
    let b = pages(&arena, 2, 4); // pages 2..6, overlaps a
    let merged = pages(&arena, 0, 8); // over both, as the cache merges
    let ta = pinner.pin(a).unwrap();
    let tb = pinner.pin(b).unwrap();
    let tm = pinner.pin(merged).unwrap();
    assert_eq!(
        recorder.take_calls(),
        vec![
            Call::Map {
                iova: base,
                len: 4 * p,
                uaddr: base,
                access: IotlbAccess::ReadWrite
            },
            Call::Map {
                iova: base + 4 * p,
                len: 2 * p,
                uaddr: base + 4 * p,
                access: IotlbAccess::ReadWrite
            },
            Call::Map {
                iova: base + 6 * p,
                len: 2 * p,
                uaddr: base + 6 * p,
                access: IotlbAccess::ReadWrite
            },
        ],
        "only pages without an entry get one"
    );
    // Releasing the old regions removes nothing: the merged pin covers them.
    pinner.unpin(a, ta);
    pinner.unpin(b, tb);
    assert_eq!(recorder.take_calls(), vec![]);
    assert_eq!(recorder.mapped_pages().len(), 8);
    assert_eq!(pinner.locked_len(), 8 * p as usize);
    pinner.unpin(merged, tm);
    assert_eq!(
        recorder.take_calls(),
        vec![Call::Unmap {
            iova: base,
            len: 8 * p
        }]
    );
    assert!(recorder.mapped_pages().is_empty());
    assert_eq!(pinner.locked_len(), 0);
}

#[test]
fn a_failed_map_rolls_everything_back() {
    let arena = DmaArena::new(1 << 20).unwrap();
    let recorder = Arc::new(Recorder::default());
    let pinner = IotlbPinner::new(Arc::clone(&recorder));
    let p = page_size() as u64;
    let base = arena.addr();
    let middle = pages(&arena, 2, 1);
    let tm = pinner.pin(middle).unwrap();
    recorder.take_calls();
    // Pinning pages 0..5 needs entries for 0..2 and 3..5; the second fails.
    *recorder.fail_map_at.lock() = Some(base + 3 * p);
    let err = pinner.pin(pages(&arena, 0, 5)).unwrap_err();
    assert!(matches!(err, PinError::Device { .. }), "{err}");
    assert!(err.to_string().contains("IOTLB update failed"), "{err}");
    assert_eq!(
        recorder.take_calls(),
        vec![
            Call::Map {
                iova: base,
                len: 2 * p,
                uaddr: base,
                access: IotlbAccess::ReadWrite
            },
            Call::Unmap {
                iova: base,
                len: 2 * p
            },
        ]
    );
    // Only the earlier pin remains, locked and mapped.
    assert_eq!(recorder.mapped_pages().len(), 1);
    assert_eq!(pinner.mapped_len(), p as usize);
    assert_eq!(pinner.locked_len(), p as usize);
    *recorder.fail_map_at.lock() = None;
    pinner.unpin(middle, tm);
    assert!(recorder.mapped_pages().is_empty());
    assert_eq!(pinner.locked_len(), 0);
}

#[test]
fn forgetting_unmapped_memory_invalidates_its_entries() {
    let arena = DmaArena::new(1 << 20).unwrap();
    let recorder = Arc::new(Recorder::default());
    let pinner = IotlbPinner::new(Arc::clone(&recorder));
    let p = page_size() as u64;
    let base = arena.addr();
    let range = pages(&arena, 0, 4);
    let token = pinner.pin(range).unwrap();
    recorder.take_calls();
    let gone = pages(&arena, 1, 2);
    pinner.forget(gone);
    assert_eq!(
        recorder.take_calls(),
        vec![Call::Unmap {
            iova: base + p,
            len: 2 * p
        }]
    );
    pinner.unpin_unmapped(range, token, &[gone]);
    assert_eq!(
        recorder.take_calls(),
        vec![
            Call::Unmap { iova: base, len: p },
            Call::Unmap {
                iova: base + 3 * p,
                len: p
            },
        ]
    );
    assert!(recorder.mapped_pages().is_empty());
    assert_eq!(pinner.mapped_len(), 0);
}

#[test]
fn the_pin_down_cache_drives_the_pinner() {
    let arena = DmaArena::new(1 << 20).unwrap();
    let recorder = Arc::new(Recorder::default());
    let cache = PinCache::new(
        IotlbPinner::new(Arc::clone(&recorder)),
        CacheConfig {
            max_entries: 4,
            ..CacheConfig::default()
        },
    )
    .unwrap();
    let buffer = arena.alloc(3 * page_size(), page_size()).unwrap();
    {
        let registration = cache.pin(buffer.iova() as usize + 100, 5000).unwrap();
        assert_eq!(*registration.token(), registration.region().start as u64);
        assert!(registration
            .region()
            .contains(buffer.iova() as usize + 100, 5000));
    }
    let maps_after_miss = recorder.take_calls();
    assert_eq!(maps_after_miss.len(), 1, "{maps_after_miss:?}");
    {
        // A hit: no device call.
        let _hit = cache.pin(buffer.iova() as usize + 200, 100).unwrap();
    }
    assert!(recorder.take_calls().is_empty());
    // Invalidation before freeing removes the device entry.
    cache.invalidate(buffer.iova() as usize, buffer.len());
    let calls = recorder.take_calls();
    assert!(
        calls.iter().all(|c| matches!(c, Call::Unmap { .. })) && !calls.is_empty(),
        "{calls:?}"
    );
    assert!(recorder.mapped_pages().is_empty());
}
