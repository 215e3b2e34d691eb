//! Invalidation when memory goes away: the in-process hook and the
//! userfaultfd safety net.
//!
//! A cached registration of memory that is unmapped and mapped again at the
//! same address would hand the device a stale translation: the classic
//! registration-cache bug. Two mechanisms prevent it.
//!
//! * **The hook**, [`unmap`] (and [`madvise_dontneed`]): the program, or the
//!   allocator it uses, unmaps through pincache. Every cache in the process
//!   drops the overlapping regions *before* the pages go, and the range is
//!   unregistered from userfaultfd first so the kernel has no event to wait
//!   for. The cost is the invalidation plus the system calls, with no
//!   cross-thread wake-up.
//! * **The safety net**, [`MemoryMonitor`]: caches configured with
//!   [`Monitor::Required`](crate::Monitor) (or `WhereAvailable`, where it
//!   runs) register their pinned ranges with one process-wide
//!   userfaultfd in write-protect mode (no page is ever write-protected, so
//!   no fault is ever delivered; only the non-cooperative events are). An
//!   `munmap`, `mremap` or `madvise(MADV_DONTNEED|MADV_REMOVE)` the hook did
//!   not see blocks in the kernel until the monitor thread has read its event.
//!   The monitor raises a pending count before it reads, and hits fall back
//!   to the slow path, which waits for the monitor, while it is up, so the
//!   thread that unmapped can never hit the stale region afterwards. One
//!   thread reads events and does nothing else (no lock but its queue's, no
//!   allocation); a second applies them. The unmapping thread may hold a
//!   cache's lock or the allocator's (glibc trims the heap inside `free`):
//!   a monitor that invalidated before reading the next event would wait
//!   for that lock while the thread waits for the read.
//!
//! A range the kernel will not watch (write protection of shmem and
//! hugetlbfs needs Linux 5.19, other file mappings never have it; memory
//! another userfaultfd owns) stays pinned while it is held but is not
//! cached: its region leaves the index at once and is unpinned at its
//! last release ([`CacheStats::unwatched`](crate::CacheStats::unwatched)
//! counts them), so nothing stale can be hit. A child of `fork()` does
//! not use the parent's monitor at all: its descriptor would change the
//! parent's registrations, and its threads stayed in the parent.

use std::collections::VecDeque;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{OnceLock, Weak};
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use crate::page_refs::RangeRefCounts;
use crate::pinner::PageRange;
use crate::uffd::{Gone, RawMessage, Userfaultfd};

/// Something that holds translations of memory and must drop them when the
/// memory goes away. Every [`PinCache`](crate::PinCache) is one.
pub trait InvalidationTarget: Send + Sync {
    /// Drops every translation overlapping `[start, start + len)`; returns
    /// how many were dropped. `unmapped`: the memory itself is gone (unmapped,
    /// or about to be), not just its contents.
    fn invalidate_range(&self, start: usize, len: usize, unmapped: bool) -> usize;
}

/// Every live cache of the process, for the hook and the monitor.
static TARGETS: Mutex<Vec<(u64, Weak<dyn InvalidationTarget>)>> = Mutex::new(Vec::new());
static NEXT_TARGET: AtomicU64 = AtomicU64::new(1);

/// Batches of events the monitor's reader has started reading and its
/// applier has not finished applying: hits take the slow path while any is.
static EVENTS_PENDING: AtomicU64 = AtomicU64::new(0);

/// Ranges the reader has read and the applier has not applied yet, in
/// order; `None` closes a batch. Allocated once: the reader never
/// allocates.
struct Inbox {
    queue: Mutex<VecDeque<Option<(usize, usize, bool)>>>,
    filled: Condvar,
}

/// Entries the inbox holds at most.
const INBOX_ENTRIES: usize = 4096;

static MONITOR: OnceLock<Result<MemoryMonitor, String>> = OnceLock::new();

/// Keeps a target registered; dropping it unregisters.
#[derive(Debug)]
pub struct Subscription {
    id: u64,
}

impl Drop for Subscription {
    fn drop(&mut self) {
        TARGETS.lock().retain(|(id, _)| *id != self.id);
    }
}

/// Registers `target` to be told when memory goes away through [`unmap`],
/// [`madvise_dontneed`], or the monitor.
pub fn subscribe(target: Weak<dyn InvalidationTarget>) -> Subscription {
    let id = NEXT_TARGET.fetch_add(1, Ordering::Relaxed);
    TARGETS.lock().push((id, target));
    Subscription { id }
}

/// Tells every registered target that `[start, start + len)` is going away
/// (`unmapped`: the mapping itself, else only its contents). Returns how many
/// translations were dropped in all.
pub fn invalidate_everywhere(start: usize, len: usize, unmapped: bool) -> usize {
    let targets: Vec<_> = TARGETS
        .lock()
        .iter()
        .filter_map(|(_, weak)| weak.upgrade())
        .collect();
    targets
        .iter()
        .map(|target| target.invalidate_range(start, len, unmapped))
        .sum()
}

/// Set in a child of `fork()` (by an atfork handler the monitor installs
/// when it starts): the monitor's descriptor is the parent's, whose
/// registrations every userfaultfd call would change, and its threads did
/// not come along. The child's caches go unwatched.
static INHERITED: AtomicBool = AtomicBool::new(false);

/// Whether the monitor is between reading events and applying them.
#[inline(always)]
pub(crate) fn event_pending() -> bool {
    EVENTS_PENDING.load(Ordering::Acquire) > 0
}

/// Whether this process is a child of `fork()` of the process that
/// started the monitor (see [`INHERITED`]).
pub(crate) fn inherited() -> bool {
    INHERITED.load(Ordering::Acquire)
}

/// The atfork child handler: the monitor is the parent's from now on.
extern "C" fn monitor_left_in_parent() {
    INHERITED.store(true, Ordering::Release);
    // A batch the parent's reader had in hand will never be applied here.
    EVENTS_PENDING.store(0, Ordering::Release);
}

/// Waits until the monitor has applied the events it has read.
pub(crate) fn wait_for_pending_events() {
    let mut spins = 0u32;
    while event_pending() {
        spins += 1;
        if spins < 100 {
            std::hint::spin_loop();
        } else if spins < 200 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

/// Unmaps `[addr, addr + len)` after every cache in the process has dropped
/// its regions there: the hook to route `munmap` through.
///
/// # Safety
/// As for `munmap(2)`: nothing may use the memory afterwards.
pub unsafe fn unmap(addr: *mut u8, len: usize) -> io::Result<()> {
    forget_range(addr as usize, len, true);
    // SAFETY: the caller vouches that the mapping may go.
    if unsafe { libc::munmap(addr.cast(), len) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Discards the contents of `[addr, addr + len)` with
/// `madvise(MADV_DONTNEED)` after every cache has dropped its regions there.
///
/// # Safety
/// As for `madvise(2)` with `MADV_DONTNEED`: the contents are lost.
pub unsafe fn madvise_dontneed(addr: *mut u8, len: usize) -> io::Result<()> {
    forget_range(addr as usize, len, false);
    // SAFETY: the caller vouches that the contents may go.
    if unsafe { libc::madvise(addr.cast(), len, libc::MADV_DONTNEED) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Stops watching `[start, start + len)` (one unregistration for the whole
/// range, so the kernel has no event to wait for) and invalidates it
/// everywhere.
fn forget_range(start: usize, len: usize, unmapped: bool) {
    if let Some(Ok(monitor)) = MONITOR.get() {
        monitor.forget(start, len);
    }
    invalidate_everywhere(start, len, unmapped);
}

/// The process-wide userfaultfd monitor.
pub struct MemoryMonitor {
    uffd: Userfaultfd,
    /// How many pinned regions need each address watched.
    watched: Mutex<RangeRefCounts>,
    events: AtomicU64,
}

/// Queues `entry` for the applier, waiting (without allocating) while the
/// inbox is full.
fn push(inbox: &Inbox, entry: Option<(usize, usize, bool)>) {
    loop {
        {
            let mut queue = inbox.queue.lock();
            if queue.len() < INBOX_ENTRIES {
                queue.push_back(entry);
                inbox.filled.notify_one();
                return;
            }
        }
        std::thread::yield_now();
    }
}

impl MemoryMonitor {
    /// The monitor, started on first use. Fails where userfaultfd or its
    /// unmap/remove/remap events and write-protect mode are unavailable (a
    /// kernel before 5.7; before 5.11 also without CAP_SYS_PTRACE while
    /// `vm.unprivileged_userfaultfd` is 0: later kernels give any process
    /// a descriptor for user-mode faults, which is all the monitor needs),
    /// with the reason.
    pub fn global() -> io::Result<&'static MemoryMonitor> {
        let monitor = MONITOR.get_or_init(|| {
            let uffd = Userfaultfd::open().map_err(|e| format!("userfaultfd: {e}"))?;
            Ok(MemoryMonitor {
                uffd,
                watched: Mutex::new(RangeRefCounts::new()),
                events: AtomicU64::new(0),
            })
        });
        match monitor {
            Ok(_) if inherited() => Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "the userfaultfd monitor belongs to the parent of this fork() child; \
                 the child's caches go unwatched",
            )),
            Ok(monitor) => {
                monitor.start();
                Ok(monitor)
            }
            Err(reason) => Err(io::Error::new(io::ErrorKind::Unsupported, reason.clone())),
        }
    }

    /// Starts the monitor's two threads: the reader, which only reads
    /// events (so that a thread blocked in `munmap` until its event is read
    /// never waits for a lock or the allocator, which it may hold), and
    /// the applier, which invalidates.
    fn start(&'static self) {
        static STARTED: OnceLock<()> = OnceLock::new();
        STARTED.get_or_init(|| {
            // SAFETY: the handler only stores to two atomics, which is
            // async-signal-safe as a child handler of fork() must be.
            let installed =
                unsafe { libc::pthread_atfork(None, None, Some(monitor_left_in_parent)) };
            assert_eq!(installed, 0, "pthread_atfork failed: {installed}");
            let inbox: &'static Inbox = Box::leak(Box::new(Inbox {
                queue: Mutex::new(VecDeque::with_capacity(INBOX_ENTRIES)),
                filled: Condvar::new(),
            }));
            std::thread::Builder::new()
                .name("pincache-monitor".into())
                .spawn(move || self.read_events(inbox))
                .expect("cannot start the pincache monitor thread");
            std::thread::Builder::new()
                .name("pincache-apply".into())
                .spawn(move || self.apply_events(inbox))
                .expect("cannot start the pincache monitor's applier thread");
        });
    }

    /// Events read so far (unmaps, removes, remaps).
    pub fn events_seen(&self) -> u64 {
        self.events.load(Ordering::Relaxed)
    }

    /// Watches `range` for the cache that just pinned it. Ranges the kernel
    /// cannot watch (file-backed mappings other than shmem and hugetlbfs) are
    /// left unwatched; returns whether the range is watched.
    pub fn watch(&self, range: PageRange) -> bool {
        if inherited() {
            return false;
        }
        let mut watched = self.watched.lock();
        let fresh = watched.acquire(range.start..range.end());
        let mut all = true;
        for part in fresh {
            if self.uffd.register(part.start, part.len()).is_err() {
                all = false;
            }
        }
        all
    }

    /// Stops watching `range` for a cache that unpinned it. Parts forgotten
    /// since (unmapped) are skipped.
    pub fn unwatch(&self, range: PageRange) {
        if inherited() {
            return;
        }
        let mut watched = self.watched.lock();
        for part in watched.release_lenient(range.start..range.end()) {
            // A range already unmapped is no longer registered.
            let _ = self.uffd.unregister(part.start, part.len());
        }
    }

    /// Watches `range` if the monitor is running; whether it is watched.
    pub(crate) fn watch_global(range: PageRange) -> bool {
        match MONITOR.get() {
            Some(Ok(monitor)) => monitor.watch(range),
            _ => false,
        }
    }

    /// Unwatches `range` if the monitor is running.
    pub(crate) fn unwatch_global(range: PageRange) {
        if let Some(Ok(monitor)) = MONITOR.get() {
            monitor.unwatch(range);
        }
    }

    /// The memory of `[start, start + len)` is going away: unregister it now
    /// and forget every watch on it.
    fn forget(&self, start: usize, len: usize) {
        if inherited() {
            return;
        }
        let mut watched = self.watched.lock();
        if watched.clear(start..start.saturating_add(len)) {
            let _ = self.uffd.unregister(start, len);
        }
    }

    /// The reader: reads every event as soon as it comes and hands the
    /// ranges to the applier. It takes no lock but the inbox's and never
    /// allocates.
    fn read_events(&self, inbox: &Inbox) {
        let mut buffer = [RawMessage::default(); 64];
        loop {
            if self.uffd.wait().is_err() {
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
            EVENTS_PENDING.fetch_add(1, Ordering::SeqCst);
            loop {
                let count = match self.uffd.read(&mut buffer) {
                    Ok(0) | Err(_) => break,
                    Ok(count) => count,
                };
                self.events.fetch_add(count as u64, Ordering::Relaxed);
                for message in &buffer[..count] {
                    if let Gone::Range {
                        start,
                        end,
                        unmapped,
                    } = message.gone()
                    {
                        if end > start {
                            push(inbox, Some((start as usize, end as usize, unmapped)));
                        }
                    }
                }
            }
            push(inbox, None);
        }
    }

    /// The applier: forgets and invalidates each range, in order, and
    /// lowers the pending count at the end of each batch.
    fn apply_events(&self, inbox: &Inbox) {
        loop {
            let next = {
                let mut queue = inbox.queue.lock();
                while queue.is_empty() {
                    inbox.filled.wait(&mut queue);
                }
                queue.pop_front().expect("not empty")
            };
            match next {
                Some((start, end, unmapped)) => {
                    self.watched.lock().clear(start..end);
                    invalidate_everywhere(start, end - start, unmapped);
                }
                None => {
                    EVENTS_PENDING.fetch_sub(1, Ordering::SeqCst);
                }
            }
        }
    }
}
