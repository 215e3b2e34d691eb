//! The region table: region descriptors by id, and per-reader-slot counters.
//!
//! Ids index chunks of [`CHUNK`] regions. A chunk holds the descriptors the
//! readers check (range, state, the pinner's token) and, for every reader
//! slot, a column of counters only that slot's thread writes: the reference
//! count and the policy's use mark. A hit therefore writes no cache line that
//! another thread writes. Chunks are allocated zeroed, so the columns of slots
//! that never touch a chunk cost no resident memory, and they live until the
//! table is dropped, so readers never see one freed.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicI64, AtomicPtr, AtomicU64, AtomicU8, AtomicUsize, Ordering};

use crate::rcu::{self, MAX_READERS, SHARED_SLOT};

/// Regions per chunk.
pub(crate) const CHUNK: usize = 256;
/// Chunks per table: at most `CHUNK * MAX_CHUNKS` regions exist at once.
pub(crate) const MAX_CHUNKS: usize = 16384;

/// Lifecycle of a region id.
pub(crate) mod state {
    /// Unused, or waiting in limbo for a grace period.
    pub const FREE: u8 = 0;
    /// In the index, pinned; hits may take references.
    pub const LIVE: u8 = 1;
    /// In the index, pinned, being checked for eviction or invalidation; hits back off.
    pub const DYING: u8 = 2;
    /// Out of the index, still pinned for holders; unpinned at the last release.
    pub const RETIRED: u8 = 3;
    /// Unpinned, out of the index, waiting for a grace period before reuse.
    pub const UNPINNED: u8 = 4;
}

/// What readers need to know about a region. The index maps pages to
/// entry addresses, so a hit reaches the entry, and through it its counters,
/// without going through the id.
pub(crate) struct Entry<T> {
    pub start: AtomicUsize,
    pub end: AtomicUsize,
    pub state: AtomicU8,
    /// The region's id; fixed when the chunk is made.
    pub id: u32,
    /// This id's counter in column 0; column `slot` is `slot * CHUNK` further.
    counters: *const Counter,
    token: UnsafeCell<Option<T>>,
}

// SAFETY: an entry is shared by all threads by design: its fields are
// atomics, its counter pointer is only read (it points into the owning
// chunk's mapping), and its token follows the protocol of RegionTable below.
unsafe impl<T: Send + Sync> Sync for Entry<T> {}
// SAFETY: as above.
unsafe impl<T: Send + Sync> Send for Entry<T> {}

impl<T> Entry<T> {
    /// The counter of reader `slot` for this region.
    #[inline(always)]
    pub(crate) fn counter(&self, slot: usize) -> &Counter {
        debug_assert!(slot < MAX_READERS);
        // SAFETY: `counters` points into the chunk's counter mapping, which
        // holds MAX_READERS columns of CHUNK counters and lives as long as
        // the entry (both belong to the chunk).
        unsafe { &*self.counters.add(slot * CHUNK) }
    }

    /// The value the index stores for this entry: its address.
    pub(crate) fn index_value(&self) -> u64 {
        self as *const Self as u64
    }
}

/// One reader slot's counters for one region.
#[repr(C)]
pub(crate) struct Counter {
    /// References taken minus released through this slot (may be negative).
    pub refs: AtomicI64,
    /// LRU: latest use stamp; LFU: uses through this slot.
    pub usage: AtomicU64,
}

impl Counter {
    /// Adds `delta` to the reference count, from the thread owning `slot`.
    #[inline(always)]
    pub(crate) fn add_ref(&self, slot: usize, delta: i64) {
        if slot == SHARED_SLOT {
            self.refs.fetch_add(delta, Ordering::SeqCst);
        } else {
            let now = self.refs.load(Ordering::Relaxed);
            self.refs.store(now.wrapping_add(delta), Ordering::Relaxed);
        }
    }
}

struct Chunk<T> {
    entries: Box<[Entry<T>]>,
    /// `MAX_READERS` columns of `CHUNK` counters, column `slot` at
    /// `slot * CHUNK`, in an anonymous mapping: zero until written, and a
    /// column costs memory only once its thread touches it.
    counters: memmap2::MmapMut,
}

impl<T> Chunk<T> {
    #[inline(always)]
    fn counters(&self) -> &[Counter] {
        // SAFETY: the mapping is page aligned (so aligned for Counter), holds
        // exactly MAX_READERS * CHUNK counters, starts zeroed (a valid
        // Counter), and is only accessed through these atomics while the
        // chunk lives.
        unsafe {
            std::slice::from_raw_parts(
                self.counters.as_ptr().cast::<Counter>(),
                MAX_READERS * CHUNK,
            )
        }
    }
}

pub(crate) struct RegionTable<T> {
    chunks: Box<[AtomicPtr<Chunk<T>>]>,
}

// SAFETY: tokens are written only by the writer while no reader can reach
// the entry (state FREE/UNPINNED after a grace period) and read by holders of
// a reference, so sharing the table shares `&T` across threads (T: Sync) and
// moves T between threads (T: Send). The entries' counter pointers point
// into mappings the table owns and are only read.
unsafe impl<T: Send + Sync> Sync for RegionTable<T> {}
// SAFETY: as above.
unsafe impl<T: Send + Sync> Send for RegionTable<T> {}

impl<T> RegionTable<T> {
    pub(crate) fn new() -> Self {
        RegionTable {
            chunks: (0..MAX_CHUNKS)
                .map(|_| AtomicPtr::new(std::ptr::null_mut()))
                .collect(),
        }
    }

    /// Makes the first `ids` ids usable now, and commits the counter column
    /// of the calling thread's reader `slot` for them, so that the misses
    /// that fill a new cache do not take page faults. Writer only.
    pub(crate) fn reserve(&self, ids: usize, slot: usize) {
        let page_counters = 4096 / std::mem::size_of::<Counter>();
        for chunk in 0..ids.div_ceil(CHUNK).min(MAX_CHUNKS) {
            self.ensure_chunk(chunk);
            for column in (0..CHUNK).step_by(page_counters) {
                let id = (chunk * CHUNK + column) as u32;
                self.counter(slot, id).usage.store(0, Ordering::Relaxed);
            }
        }
    }

    /// Makes ids `[0, (chunk + 1) * CHUNK)` usable. Writer only.
    pub(crate) fn ensure_chunk(&self, chunk: usize) {
        if !self.chunks[chunk].load(Ordering::Acquire).is_null() {
            return;
        }
        let counters =
            memmap2::MmapMut::map_anon(MAX_READERS * CHUNK * std::mem::size_of::<Counter>())
                .expect("cannot map the region table's counters");
        let base = counters.as_ptr().cast::<Counter>();
        let entries = (0..CHUNK)
            .map(|column| Entry {
                start: AtomicUsize::new(0),
                end: AtomicUsize::new(0),
                state: AtomicU8::new(state::FREE),
                id: (chunk * CHUNK + column) as u32,
                // SAFETY: column < CHUNK, inside the mapping's first column.
                counters: unsafe { base.add(column) },
                token: UnsafeCell::new(None),
            })
            .collect();
        let chunk_box = Box::new(Chunk { entries, counters });
        self.chunks[chunk].store(Box::into_raw(chunk_box), Ordering::Release);
    }

    #[inline(always)]
    fn chunk(&self, id: u32) -> &Chunk<T> {
        let pointer = self.chunks[id as usize / CHUNK].load(Ordering::Acquire);
        debug_assert!(!pointer.is_null());
        // SAFETY: ids are handed out only after `ensure_chunk` published
        // their chunk, and chunks are freed only when the table is dropped.
        unsafe { &*pointer }
    }

    /// The entry whose [`Entry::index_value`] is `value`.
    ///
    /// # Safety
    /// `value` must come from `index_value` of an entry of this table.
    #[inline(always)]
    pub(crate) unsafe fn entry_at(&self, value: u64) -> &Entry<T> {
        // SAFETY: per the contract, the value is the address of an entry of
        // a chunk of this table; chunks live until the table is dropped.
        unsafe { &*(value as *const Entry<T>) }
    }

    #[inline(always)]
    pub(crate) fn entry(&self, id: u32) -> &Entry<T> {
        &self.chunk(id).entries[id as usize % CHUNK]
    }

    #[inline(always)]
    pub(crate) fn counter(&self, slot: usize, id: u32) -> &Counter {
        &self.chunk(id).counters()[slot * CHUNK + id as usize % CHUNK]
    }

    /// Sum of the reference counts over all reader slots. Exact only after a
    /// heavy barrier, or under the writer lock for a region out of the index.
    pub(crate) fn refs(&self, id: u32) -> i64 {
        let chunk = self.chunk(id);
        let column = id as usize % CHUNK;
        let used = rcu::slots_in_use().min(SHARED_SLOT);
        let mut total = chunk.counters()[SHARED_SLOT * CHUNK + column]
            .refs
            .load(Ordering::Relaxed);
        for slot in 0..used {
            total = total.wrapping_add(
                chunk.counters()[slot * CHUNK + column]
                    .refs
                    .load(Ordering::Relaxed),
            );
        }
        total
    }

    /// Maximum (LRU) or sum (LFU) of the use marks over all reader slots.
    pub(crate) fn usage(&self, id: u32, sum: bool) -> u64 {
        let chunk = self.chunk(id);
        let column = id as usize % CHUNK;
        let used = rcu::slots_in_use().min(SHARED_SLOT);
        let marks = (0..used).chain(std::iter::once(SHARED_SLOT)).map(|slot| {
            chunk.counters()[slot * CHUNK + column]
                .usage
                .load(Ordering::Relaxed)
        });
        if sum {
            marks.fold(0u64, u64::wrapping_add)
        } else {
            marks.max().unwrap_or(0)
        }
    }

    /// Clears the use marks of a region that is about to be reused. Writer
    /// only, after a grace period.
    pub(crate) fn reset_usage(&self, id: u32) {
        let chunk = self.chunk(id);
        let column = id as usize % CHUNK;
        let used = rcu::slots_in_use().min(SHARED_SLOT);
        for slot in (0..used).chain(std::iter::once(SHARED_SLOT)) {
            chunk.counters()[slot * CHUNK + column]
                .usage
                .store(0, Ordering::Relaxed);
        }
    }

    /// Stores the token of a region that no reader can reach. Writer only.
    pub(crate) fn set_token(&self, id: u32, token: T) {
        // SAFETY: the region is FREE and past a grace period, so no reader
        // holds or can take a reference to it; the writer lock excludes other
        // writers.
        unsafe { *self.entry(id).token.get() = Some(token) };
    }

    /// Takes the token of a region whose last reference is gone. Writer only.
    pub(crate) fn take_token(&self, id: u32) -> Option<T> {
        // SAFETY: called under the writer lock when the region's reference
        // count is zero and its state is no longer LIVE, so no `&T` handed to
        // a holder is alive and none can be created.
        unsafe { (*self.entry(id).token.get()).take() }
    }

    /// The token of a region the caller holds a reference to.
    ///
    /// # Safety
    /// The caller must hold a reference to region `id` for as long as it uses
    /// the returned borrow.
    pub(crate) unsafe fn token(&self, id: u32) -> &T {
        // SAFETY: per the contract, the region is referenced, so the writer
        // will not take or replace the token while the borrow lives.
        unsafe {
            (*self.entry(id).token.get())
                .as_ref()
                .expect("pinned region has a token")
        }
    }
}

impl<T> Drop for RegionTable<T> {
    fn drop(&mut self) {
        for chunk in self.chunks.iter() {
            let pointer = chunk.load(Ordering::Acquire);
            if !pointer.is_null() {
                // SAFETY: the pointer came from Box::into_raw in ensure_chunk
                // and is dropped once, here, when no reader can exist.
                drop(unsafe { Box::from_raw(pointer) });
            }
        }
    }
}
