//! Process-wide read-copy-update for the cache's hit path.
//!
//! Every thread that looks up a cache gets a small integer, its *reader slot*,
//! for as long as it lives. The slot indexes two things that only that thread
//! writes: its reader record here (am I inside a lookup, and since which
//! epoch?) and its column of per-region counters in each cache. A hit thus
//! writes only cache lines its own thread owns.
//!
//! Ordering between a reader's plain stores and a writer's checks is made with
//! an *asymmetric fence*: readers issue only a compiler fence, and writers,
//! which are on the slow path anyway, call `membarrier(2)` with
//! `MEMBARRIER_CMD_PRIVATE_EXPEDITED`, which runs a full memory barrier on
//! every CPU currently running a thread of this process. Where the kernel does
//! not offer it, both sides fall back to `SeqCst` fences.
//!
//! Threads beyond [`MAX_READERS`] share one overflow slot, whose counters are
//! updated with atomic read-modify-writes and whose lookups take the cache
//! lock instead of entering a read-side section.

use std::cell::Cell;
use std::sync::atomic::{compiler_fence, fence, AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;

use crossbeam_utils::CachePadded;
use parking_lot::Mutex;

/// Number of reader slots; the last one is the shared overflow slot.
pub(crate) const MAX_READERS: usize = 128;

/// The overflow slot, shared by all threads that found no free slot.
pub(crate) const SHARED_SLOT: usize = MAX_READERS - 1;

/// Reader records: 0 when quiescent, `epoch << 1 | 1` inside a read-side section.
static READERS: [CachePadded<AtomicU64>; MAX_READERS] =
    [const { CachePadded::new(AtomicU64::new(0)) }; MAX_READERS];

/// Grace-period epoch, advanced by every `synchronize`.
static EPOCH: AtomicU64 = AtomicU64::new(1);

/// One past the highest slot ever handed out: writers scan only this far.
static HIGH_WATER: AtomicUsize = AtomicUsize::new(0);

/// Free slots, handed out lowest first so `HIGH_WATER` stays small.
static FREE_SLOTS: Mutex<Vec<usize>> = Mutex::new(Vec::new());

/// Whether `membarrier` private expedited is registered for this process.
static EXPEDITED: AtomicBool = AtomicBool::new(false);
static MEMBARRIER_INIT: OnceLock<bool> = OnceLock::new();

/// `membarrier` commands (linux/membarrier.h).
const MEMBARRIER_CMD_QUERY: libc::c_long = 0;
const MEMBARRIER_CMD_PRIVATE_EXPEDITED: libc::c_long = 1 << 3;
const MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED: libc::c_long = 1 << 4;

fn membarrier(cmd: libc::c_long) -> libc::c_long {
    // SAFETY: membarrier takes two integer arguments and touches no memory of
    // ours; an unsupported command returns -1 with errno set.
    unsafe { libc::syscall(libc::SYS_membarrier, cmd, 0 as libc::c_long) }
}

/// Registers this process for expedited membarrier once; returns whether the
/// asymmetric fence is in use. Called when a cache is created, before any of
/// its readers run.
pub(crate) fn init() -> bool {
    *MEMBARRIER_INIT.get_or_init(|| {
        let supported = membarrier(MEMBARRIER_CMD_QUERY);
        let ok = supported >= 0
            && supported & MEMBARRIER_CMD_PRIVATE_EXPEDITED != 0
            && membarrier(MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED) == 0;
        EXPEDITED.store(ok, Ordering::SeqCst);
        ok
    })
}

/// The reader half of the asymmetric fence.
#[inline(always)]
pub(crate) fn light_barrier() {
    if EXPEDITED.load(Ordering::Relaxed) {
        compiler_fence(Ordering::SeqCst);
    } else {
        fence(Ordering::SeqCst);
    }
}

/// The writer half of the asymmetric fence: after it returns, every store a
/// reader made before its light barrier is visible here, and every load a
/// reader makes after its light barrier sees the stores made before this call.
///
/// When no thread but the caller holds a reader slot, there is no reader to
/// order against: a full fence orders the caller's stores before its check of
/// the slot count, and a thread taking a slot does so with a sequentially
/// consistent increment before its first read-side section, so it either is
/// counted here or sees every store made before this call.
pub(crate) fn heavy_barrier() {
    fence(Ordering::SeqCst);
    let mine = usize::from(
        SLOT_ID
            .try_with(Cell::get)
            .is_ok_and(|slot| slot < SHARED_SLOT),
    );
    if LIVE_READERS.load(Ordering::SeqCst) <= mine {
        return;
    }
    if EXPEDITED.load(Ordering::Relaxed) {
        if membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED) == 0 {
            return;
        }
        // Registration cannot be lost, so this is not expected; stay correct.
        EXPEDITED.store(false, Ordering::SeqCst);
    }
    fence(Ordering::SeqCst);
}

/// Threads holding a reader slot other than the shared one.
static LIVE_READERS: AtomicUsize = AtomicUsize::new(0);

/// Marks a thread that has no slot yet.
const NO_SLOT: usize = usize::MAX;

struct SlotHolder(usize);

impl SlotHolder {
    fn acquire() -> Self {
        let mut free = FREE_SLOTS.lock();
        let lowest = free.iter().enumerate().min_by_key(|(_, slot)| **slot);
        let slot = if let Some((position, _)) = lowest {
            free.swap_remove(position)
        } else {
            let next = HIGH_WATER.load(Ordering::Relaxed);
            if next < SHARED_SLOT {
                HIGH_WATER.store(next + 1, Ordering::SeqCst);
                next
            } else {
                HIGH_WATER.store(MAX_READERS, Ordering::SeqCst);
                SHARED_SLOT
            }
        };
        if slot != SHARED_SLOT {
            LIVE_READERS.fetch_add(1, Ordering::SeqCst);
            // Pairs with the fence in `heavy_barrier`: the count is published
            // before any load of this thread's first read-side section.
            fence(Ordering::SeqCst);
        }
        SLOT_ID.with(|id| id.set(slot));
        SlotHolder(slot)
    }
}

impl Drop for SlotHolder {
    fn drop(&mut self) {
        // Anything this thread still does during its exit uses the shared slot.
        let _ = SLOT_ID.try_with(|id| id.set(SHARED_SLOT));
        if self.0 != SHARED_SLOT {
            READERS[self.0].store(0, Ordering::Release);
            LIVE_READERS.fetch_sub(1, Ordering::SeqCst);
            FREE_SLOTS.lock().push(self.0);
        }
    }
}

thread_local! {
    /// This thread's slot once it has one; read on every hit.
    static SLOT_ID: Cell<usize> = const { Cell::new(NO_SLOT) };
    /// Owns the slot and returns it when the thread exits.
    static SLOT: SlotHolder = SlotHolder::acquire();
    static STAMP: Cell<u64> = const { Cell::new(0) };
}

/// This thread's reader slot; [`SHARED_SLOT`] for overflow threads and for
/// code running during thread-local destruction.
#[inline(always)]
pub(crate) fn current_slot() -> usize {
    match SLOT_ID.try_with(Cell::get) {
        Ok(NO_SLOT) => SLOT.try_with(|holder| holder.0).unwrap_or(SHARED_SLOT),
        Ok(slot) => slot,
        Err(_) => SHARED_SLOT,
    }
}

/// Orders a reference-count update of the shared slot (an atomic
/// read-modify-write) against a writer's check, whichever barrier it uses.
#[inline(always)]
pub(crate) fn barrier_after_update(slot: usize) {
    if slot == SHARED_SLOT {
        fence(Ordering::SeqCst);
    } else {
        light_barrier();
    }
}

/// One past the highest reader slot in use: counters beyond it are zero.
#[inline]
pub(crate) fn slots_in_use() -> usize {
    HIGH_WATER.load(Ordering::Acquire)
}

/// A use stamp for LRU: the cache's `tick` (advanced by each of its misses)
/// in the high 40 bits, and this thread's use sequence in the low 24 bits.
/// A thread's stamps increase within one tick of one cache whatever other
/// caches it uses, except once every 2^24 uses of the thread, when the
/// sequence wraps (one misordered pair among concurrent uses, harmless).
#[inline(always)]
pub(crate) fn use_stamp(tick: u64) -> u64 {
    let seq = STAMP
        .try_with(|cell| {
            let next = cell.get().wrapping_add(1);
            cell.set(next);
            next
        })
        .unwrap_or(0);
    (tick << 24) | (seq & ((1 << 24) - 1))
}

/// A read-side critical section: while it lives, nothing the writer retires
/// afterwards is reused.
pub(crate) struct ReadGuard {
    slot: usize,
}

impl ReadGuard {
    /// Enters a read-side section in `slot`, which must be this thread's own
    /// (never [`SHARED_SLOT`]).
    #[inline(always)]
    pub(crate) fn enter(slot: usize) -> Self {
        debug_assert_ne!(slot, SHARED_SLOT);
        let epoch = EPOCH.load(Ordering::Relaxed);
        READERS[slot].store((epoch << 1) | 1, Ordering::Relaxed);
        light_barrier();
        ReadGuard { slot }
    }
}

impl Drop for ReadGuard {
    #[inline(always)]
    fn drop(&mut self) {
        READERS[self.slot].store(0, Ordering::Release);
    }
}

/// Waits until every read-side section that began before the call has ended.
/// Must not be called from inside a read-side section.
pub(crate) fn synchronize() {
    let epoch = EPOCH.fetch_add(1, Ordering::SeqCst) + 1;
    heavy_barrier();
    let slots = slots_in_use().min(SHARED_SLOT);
    for record in READERS.iter().take(slots) {
        let mut spins = 0u32;
        loop {
            let value = record.load(Ordering::Acquire);
            if value & 1 == 0 || (value >> 1) >= epoch {
                break;
            }
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

    #[test]
    fn threads_get_distinct_slots_and_return_them() {
        init();
        let mine = current_slot();
        let other = std::thread::spawn(current_slot).join().unwrap();
        assert_ne!(mine, other);
        assert!(slots_in_use() > mine.max(other));
    }

    #[test]
    fn synchronize_waits_for_a_reader_that_started_before_it() {
        init();
        let inside = Arc::new(AtomicBool::new(false));
        let release = Arc::new(AtomicBool::new(false));
        let reader = {
            let (inside, release) = (inside.clone(), release.clone());
            std::thread::spawn(move || {
                let _guard = ReadGuard::enter(current_slot());
                inside.store(true, Ordering::SeqCst);
                while !release.load(Ordering::SeqCst) {
                    std::hint::spin_loop();
                }
            })
        };
        while !inside.load(Ordering::SeqCst) {
            std::hint::spin_loop();
        }
        let done = Arc::new(AtomicBool::new(false));
        let writer = {
            let done = done.clone();
            std::thread::spawn(move || {
                synchronize();
                done.store(true, Ordering::SeqCst);
            })
        };
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!done.load(Ordering::SeqCst), "grace period ended early");
        release.store(true, Ordering::SeqCst);
        reader.join().unwrap();
        writer.join().unwrap();
        assert!(done.load(Ordering::SeqCst));
    }

    #[test]
    fn use_stamps_increase_within_a_tick_and_across_ticks() {
        let a = use_stamp(5);
        let b = use_stamp(5);
        let c = use_stamp(6);
        assert!(a < b && b < c);
        assert!(use_stamp(6) > c);
    }
}
