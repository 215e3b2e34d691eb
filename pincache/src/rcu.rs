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
pub(crate) fn heavy_barrier() {
    if EXPEDITED.load(Ordering::Relaxed) {
        if membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED) == 0 {
            return;
        }
        // Registration cannot be lost, so this is not expected; stay correct.
        EXPEDITED.store(false, Ordering::SeqCst);
    }
    fence(Ordering::SeqCst);
}

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
        SlotHolder(slot)
    }
}

impl Drop for SlotHolder {
    fn drop(&mut self) {
        if self.0 != SHARED_SLOT {
            READERS[self.0].store(0, Ordering::Release);
            FREE_SLOTS.lock().push(self.0);
        }
    }
}

thread_local! {
    static SLOT: SlotHolder = SlotHolder::acquire();
    static STAMP: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
}

/// This thread's reader slot; [`SHARED_SLOT`] for overflow threads and for
/// code running during thread-local destruction.
#[inline(always)]
pub(crate) fn current_slot() -> usize {
    SLOT.try_with(|s| s.0).unwrap_or(SHARED_SLOT)
}

/// One past the highest reader slot in use: counters beyond it are zero.
#[inline]
pub(crate) fn slots_in_use() -> usize {
    HIGH_WATER.load(Ordering::Acquire)
}

/// The use clock: advanced by every miss of any cache, so that the use
/// stamps of one thread increase across all the caches it uses.
static USE_TICK: AtomicU64 = AtomicU64::new(1);

/// Advances the use clock; returns the new tick.
pub(crate) fn advance_tick() -> u64 {
    USE_TICK.fetch_add(1, Ordering::Relaxed) + 1
}

/// The current tick of the use clock.
#[inline(always)]
pub(crate) fn current_tick() -> u64 {
    USE_TICK.load(Ordering::Relaxed)
}

/// A strictly increasing use stamp within this thread for a given `tick`:
/// `tick` in the high bits, a per-thread sequence in the low 24 bits.
#[inline(always)]
pub(crate) fn use_stamp(tick: u64) -> u64 {
    STAMP
        .try_with(|cell| {
            let (last_tick, seq) = cell.get();
            let seq = if last_tick == tick {
                (seq + 1).min((1 << 24) - 1)
            } else {
                1
            };
            cell.set((tick, seq));
            (tick << 24) | seq
        })
        .unwrap_or(tick << 24)
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
    }
}
