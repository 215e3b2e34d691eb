//! The pin-down cache.
//!
//! # Protocol
//!
//! A *hit* runs without locks or system calls and writes only its own
//! thread's cache lines: it enters an RCU read-side section, finds the region
//! in the radix index, adds one to its slot's reference count, issues the
//! reader half of an asymmetric fence, and checks that the region is still
//! `LIVE`. A writer that wants to evict or invalidate a region first marks it
//! `DYING`, issues the heavy half of the fence (`membarrier`), and only then
//! sums the reference counts. Either the writer sees the reader's reference or
//! the reader sees `DYING` and backs off; never neither.
//!
//! A release subtracts one in its slot and checks the state the same way: a
//! release that finds the region `RETIRED` (out of the index, waiting for its
//! holders) takes the writer lock and unpins the region if it was the last.
//!
//! Misses, evictions, merges and invalidations run under one writer lock.
//! Region ids and index nodes that readers may still see are reused only after
//! an RCU grace period, batched so that its cost is shared by many misses.

use std::collections::{HashMap, HashSet};
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Weak};

use crossbeam_utils::CachePadded;
use parking_lot::Mutex;

use crate::config::{CacheConfig, CacheError, Limit, Monitor};
use crate::index::{RadixIndex, PAGE_LIMIT};
use crate::mlock::memlock_limit;
use crate::monitor::{self, InvalidationTarget, Subscription};
use crate::pinner::{PageRange, Pinner};
use crate::policy::{EvictionOrder, Policy, Rank};
use crate::rcu::{self, ReadGuard, MAX_READERS, SHARED_SLOT};
use crate::stats::CacheStats;
use crate::table::{state, Entry, RegionTable, CHUNK, MAX_CHUNKS};

/// Region ids found near a request; rarely more than a few.
type Neighbours = smallvec::SmallVec<[u32; 4]>;

/// Most region ids a new cache prepares up front.
const RESERVED_IDS: usize = 1 << 17;

/// Retired ids collected before one grace period recycles them all.
const LIMBO_BATCH: usize = 64;

/// A thread-safe pin-down cache over a [`Pinner`].
///
/// `pin` returns a [`Registration`] for a region that contains the request:
/// a cached one (a hit) or a newly pinned one (a miss). Dropping the
/// registration releases the region, which stays pinned and cached, idle,
/// until the policy evicts it to make room or [`invalidate`](Self::invalidate)
/// removes it.
pub struct PinCache<P: Pinner + 'static> {
    shared: Arc<Shared<P>>,
}

struct Limits {
    max_bytes: usize,
    max_entries: usize,
    merge: bool,
    max_merged_bytes: usize,
}

struct Shared<P: Pinner> {
    index: RadixIndex,
    table: RegionTable<P::Token>,
    policy: AtomicU8,
    /// The writer's tick, for the LRU use stamps of hits.
    tick: AtomicU64,
    /// Hits per reader slot.
    hits: Box<[CachePadded<AtomicU64>]>,
    page_shift: u32,
    limits: Limits,
    writer: Mutex<Writer>,
    pinner: P,
    subscription: Mutex<Option<Subscription>>,
    /// Whether pinned ranges are watched by the userfaultfd monitor.
    monitored: AtomicBool,
}

/// State only the writer (holder of the lock) touches.
#[derive(Default)]
struct Writer {
    order: EvictionOrder,
    free_ids: Vec<u32>,
    /// Unpinned ids waiting for a grace period.
    limbo: Vec<u32>,
    next_id: u32,
    /// Advanced by every miss; LRU keys are `tick << 24`.
    tick: u64,
    pinned_bytes: usize,
    pinned_entries: usize,
    /// Regions invalidated while held (out of the index, pinned until
    /// their last release).
    retired: HashSet<u32>,
    /// Invalidated regions whose memory was (partly) unmapped: those
    /// parts (a retired region may meet several unmappings).
    unmapped: HashMap<u32, Vec<PageRange>>,
    /// Invalidated regions whose watches the memory monitor cleared (the
    /// memory unmapped, or its contents removed): those parts, which the
    /// region must not unwatch again (they may be another region's now).
    unwatched: HashMap<u32, Vec<PageRange>>,
    age: u64,
    misses: u64,
    locked_hits: u64,
    evictions: u64,
    invalidations: u64,
    merges: u64,
    /// Regions the monitor could not watch, pinned uncached.
    unwatched_regions: u64,
}

/// A new region pinned and ready to enter the index, with the regions it
/// replaces split into those nobody holds and those still held.
struct Prepared<T> {
    token: T,
    idle: Neighbours,
    busy: Neighbours,
}

/// A pinned region held for use; dropping it releases the region.
pub struct Registration<'a, P: Pinner + 'static> {
    cache: &'a PinCache<P>,
    entry: &'a Entry<P::Token>,
    region: PageRange,
    /// Registrations are `Send` but may be released on any thread; keep
    /// `!Sync` off so a shared reference cannot race with the drop.
    _not_sync: PhantomData<std::cell::Cell<()>>,
}

impl<P: Pinner + 'static> Registration<'_, P> {
    /// The pinned region that contains the request (page aligned, possibly
    /// larger than the request).
    pub fn region(&self) -> PageRange {
        self.region
    }

    /// Whether the region is still the cache's entry for its pages: false
    /// once it was invalidated (its memory unmapped, or
    /// [`PinCache::invalidate`]) or is being evicted or invalidated while
    /// held. Unmap events the monitor has read are applied first. A registration of the same range made then maps the pages
    /// anew; holders that keep registrations across uses (descriptor and
    /// window caches) check this before reusing one.
    pub fn is_current(&self) -> bool {
        // An unmap the monitor has read (munmap returns once it has) but
        // not applied yet must count: wait for it, as lookups do.
        monitor::wait_for_pending_events();
        self.entry.state.load(Ordering::Acquire) == state::LIVE
    }

    /// The pinner's token for the region.
    pub fn token(&self) -> &P::Token {
        // SAFETY: this registration holds a reference to the region until it
        // is dropped, which outlives the returned borrow.
        unsafe { self.cache.shared.table.token(self.entry.id) }
    }
}

impl<P: Pinner + 'static> Drop for Registration<'_, P> {
    fn drop(&mut self) {
        self.cache.shared.release(self.entry);
    }
}

impl<P: Pinner + 'static> std::fmt::Debug for Registration<'_, P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("region", &self.region)
            .finish()
    }
}

impl<P: Pinner + 'static> PinCache<P> {
    /// A cache that pins through `pinner` within the limits of `config`.
    pub fn new(pinner: P, config: CacheConfig) -> Result<Self, CacheError> {
        rcu::init();
        let page_size = page_size();
        let max_bytes = match config.max_pinned_bytes {
            Some(bytes) => bytes,
            None => memlock_limit()
                .map(|limit| usize::try_from(limit).unwrap_or(usize::MAX))
                .map_err(|e| {
                    CacheError::InvalidConfig(format!("cannot read RLIMIT_MEMLOCK: {e}"))
                })?,
        };
        if max_bytes < page_size {
            return Err(CacheError::InvalidConfig(format!(
                "max_pinned_bytes ({max_bytes}) is below one page ({page_size})"
            )));
        }
        let id_capacity = CHUNK * MAX_CHUNKS - LIMBO_BATCH;
        if config.max_entries == 0 || config.max_entries > id_capacity {
            return Err(CacheError::InvalidConfig(format!(
                "max_entries must be between 1 and {id_capacity}, not {}",
                config.max_entries
            )));
        }
        let max_merged_bytes = config
            .max_merged_bytes
            .unwrap_or(max_bytes / 4)
            .max(page_size)
            .min(max_bytes);
        let shared = Arc::new(Shared {
            index: RadixIndex::new(),
            table: RegionTable::new(),
            policy: AtomicU8::new(config.policy.to_u8()),
            tick: AtomicU64::new(0),
            hits: (0..MAX_READERS)
                .map(|_| CachePadded::new(AtomicU64::new(0)))
                .collect(),
            page_shift: page_size.trailing_zeros(),
            limits: Limits {
                max_bytes,
                max_entries: config.max_entries,
                merge: config.merge,
                max_merged_bytes,
            },
            writer: Mutex::new(Writer {
                order: EvictionOrder::with_capacity(config.max_entries),
                ..Writer::default()
            }),
            pinner,
            subscription: Mutex::new(None),
            monitored: AtomicBool::new(false),
        });
        // The table mirrors the device's: reserve it now, not miss by miss.
        shared
            .table
            .reserve(config.max_entries.min(RESERVED_IDS), rcu::current_slot());
        let watched = match config.monitor {
            Monitor::Off => false,
            Monitor::WhereAvailable => monitor::MemoryMonitor::global().is_ok(),
            Monitor::Required => {
                monitor::MemoryMonitor::global().map_err(|e| {
                    CacheError::InvalidConfig(format!(
                        "the userfaultfd monitor is unavailable: {e}"
                    ))
                })?;
                true
            }
        };
        shared.monitored.store(watched, Ordering::Release);
        let weak: Weak<dyn InvalidationTarget> = Arc::downgrade(&shared) as _;
        *shared.subscription.lock() = Some(monitor::subscribe(weak));
        Ok(PinCache { shared })
    }

    /// Pins `[addr, addr + len)` or finds it pinned, and holds it until the
    /// returned registration is dropped.
    #[inline]
    pub fn pin(&self, addr: usize, len: usize) -> Result<Registration<'_, P>, CacheError> {
        let entry = match self.shared.try_hit(addr, len) {
            Some(entry) => entry,
            None => self.shared.table.entry(self.shared.pin_slow(addr, len)?),
        };
        let start = entry.start.load(Ordering::Relaxed);
        Ok(Registration {
            cache: self,
            entry,
            region: PageRange {
                start,
                len: entry.end.load(Ordering::Relaxed) - start,
            },
            _not_sync: PhantomData,
        })
    }

    /// Drops every cached region overlapping `[addr, addr + len)`: idle ones
    /// are unpinned now, ones in use when their last registration is
    /// released. No later `pin` returns them. Returns how many regions were
    /// invalidated. Call it before memory is unmapped or freed.
    pub fn invalidate(&self, addr: usize, len: usize) -> usize {
        self.shared.invalidate(addr, len, false, false)
    }

    /// Whether the userfaultfd monitor watches this cache's pinned ranges
    /// ([`CacheConfig::monitor`]).
    pub fn monitored(&self) -> bool {
        self.shared.subscribed()
    }

    /// Counters of the cache's activity and occupancy.
    pub fn stats(&self) -> CacheStats {
        self.shared.stats()
    }

    /// The replacement policy in force.
    pub fn policy(&self) -> Policy {
        Policy::from_u8(self.shared.policy.load(Ordering::Relaxed))
    }

    /// Switches the replacement policy. Use history restarts: every cached
    /// region counts as used once, now, and ties go to the oldest.
    pub fn set_policy(&self, policy: Policy) {
        let shared = &*self.shared;
        let mut writer = shared.writer.lock();
        shared.policy.store(policy.to_u8(), Ordering::Relaxed);
        writer.tick += 1;
        let tick = writer.tick;
        shared.tick.store(tick, Ordering::Relaxed);
        writer.order.rekey(|rank| {
            shared.table.reset_usage(rank.id);
            let key = shared.initial_usage(policy, tick);
            match policy {
                Policy::Fifo => rank.age,
                _ => key,
            }
        });
    }

    /// The pinner this cache drives.
    pub fn pinner(&self) -> &P {
        &self.shared.pinner
    }

    /// The limits in force: (max pinned bytes, max entries, max merged bytes).
    pub fn limits(&self) -> (usize, usize, usize) {
        let limits = &self.shared.limits;
        (
            limits.max_bytes,
            limits.max_entries,
            limits.max_merged_bytes,
        )
    }
}

impl<P: Pinner + 'static> std::fmt::Debug for PinCache<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinCache")
            .field("policy", &self.policy())
            .field("stats", &self.stats())
            .finish()
    }
}

/// Adds `part` to a region's list of lost parts, merged with those it
/// overlaps or touches, so the list never holds more parts than there are
/// disjoint ones.
fn add_part(parts: &mut Vec<PageRange>, part: PageRange) {
    let (mut start, mut end) = (part.start, part.end());
    loop {
        let before = parts.len();
        parts.retain(|other| {
            let touches = other.start <= end && start <= other.end();
            if touches {
                start = start.min(other.start);
                end = end.max(other.end());
            }
            !touches
        });
        if parts.len() == before {
            break;
        }
    }
    parts.push(PageRange {
        start,
        len: end - start,
    });
}

/// The system page size.
pub fn page_size() -> usize {
    // SAFETY: sysconf has no memory effects.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if size > 0 {
        size as usize
    } else {
        4096
    }
}

impl<P: Pinner> Shared<P> {
    fn page_size(&self) -> usize {
        1 << self.page_shift
    }

    fn address_limit(&self) -> usize {
        PAGE_LIMIT << self.page_shift
    }

    fn initial_usage(&self, policy: Policy, tick: u64) -> u64 {
        match policy {
            Policy::Lru => tick << 24,
            Policy::Lfu => 1,
            Policy::Fifo => 0,
        }
    }

    /// The lock-free hit path. `None` means: take the slow path.
    #[inline(always)]
    fn try_hit(&self, addr: usize, len: usize) -> Option<&Entry<P::Token>> {
        let slot = rcu::current_slot();
        if slot == SHARED_SLOT || len == 0 || monitor::event_pending() {
            return None;
        }
        let end = addr.checked_add(len)?;
        if end > self.address_limit() {
            return None;
        }
        let guard = ReadGuard::enter(slot);
        let value = self.index.lookup(addr >> self.page_shift)?;
        // SAFETY: the index holds only `index_value`s of this table's entries.
        let entry = unsafe { self.table.entry_at(value) };
        if entry.start.load(Ordering::Relaxed) > addr || entry.end.load(Ordering::Relaxed) < end {
            return None;
        }
        let counter = entry.counter(slot);
        counter.add_ref(slot, 1);
        rcu::light_barrier();
        if entry.state.load(Ordering::Relaxed) != state::LIVE {
            counter.add_ref(slot, -1);
            rcu::light_barrier();
            drop(guard);
            self.release_slow(entry.id);
            return None;
        }
        match Policy::from_u8(self.policy.load(Ordering::Relaxed)) {
            Policy::Lru => counter.usage.store(
                rcu::use_stamp(self.tick.load(Ordering::Relaxed)),
                Ordering::Relaxed,
            ),
            Policy::Lfu => counter
                .usage
                .store(counter.usage.load(Ordering::Relaxed) + 1, Ordering::Relaxed),
            Policy::Fifo => {}
        }
        let hits = &self.hits[slot];
        hits.store(hits.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
        drop(guard);
        Some(entry)
    }

    /// Releases one reference to a region from the current thread.
    #[inline(always)]
    fn release(&self, entry: &Entry<P::Token>) {
        let slot = rcu::current_slot();
        entry.counter(slot).add_ref(slot, -1);
        rcu::barrier_after_update(slot);
        if entry.state.load(Ordering::Relaxed) != state::LIVE {
            self.release_slow(entry.id);
        }
    }

    /// Unpins region `id` if it is retired and nobody holds it. Safe to call
    /// for any id at any time: it acts only on what it finds under the lock.
    #[cold]
    fn release_slow(&self, id: u32) {
        let mut writer = self.writer.lock();
        if self.table.entry(id).state.load(Ordering::Relaxed) == state::RETIRED
            && self.table.refs(id) == 0
        {
            writer.retired.remove(&id);
            self.unpin_region(&mut writer, id);
        }
    }

    /// Takes one reference under the writer lock (the region is LIVE and
    /// cannot change state while the lock is held).
    fn take_locked(&self, id: u32) {
        let slot = rcu::current_slot();
        let counter = self.table.counter(slot, id);
        counter.add_ref(slot, 1);
        if Policy::from_u8(self.policy.load(Ordering::Relaxed)) == Policy::Lfu {
            counter.usage.fetch_add(1, Ordering::Relaxed);
        } else {
            let stamp = rcu::use_stamp(self.tick.load(Ordering::Relaxed));
            counter.usage.fetch_max(stamp, Ordering::Relaxed);
        }
    }

    fn range_of(&self, id: u32) -> PageRange {
        let entry = self.table.entry(id);
        let start = entry.start.load(Ordering::Relaxed);
        PageRange {
            start,
            len: entry.end.load(Ordering::Relaxed) - start,
        }
    }

    /// The id of the region an index value names.
    fn indexed_id(&self, value: Option<u64>) -> Option<u32> {
        // SAFETY: the index holds only `index_value`s of this table's entries.
        value.map(|value| unsafe { self.table.entry_at(value) }.id)
    }

    /// Indexed regions that overlap `[start, end)`, or also touch it when
    /// `touching`, in address order.
    fn neighbours(&self, start: usize, end: usize, touching: bool) -> Neighbours {
        let (first, last) = (start >> self.page_shift, end >> self.page_shift);
        let mut found = Neighbours::new();
        let mut push = |id: u32| {
            if found.last() != Some(&id) {
                found.push(id);
            }
        };
        if touching && first > 0 {
            if let Some(id) = self.indexed_id(self.index.lookup(first - 1)) {
                push(id);
            }
        }
        let mut page = first;
        while let Some(id) = self.indexed_id(self.index.first_in(page, last)) {
            push(id);
            page = self.range_of(id).end() >> self.page_shift;
        }
        if touching && last < PAGE_LIMIT {
            if let Some(id) = self.indexed_id(self.index.lookup(last)) {
                push(id);
            }
        }
        found
    }

    #[cold]
    fn pin_slow(&self, addr: usize, len: usize) -> Result<u32, CacheError> {
        if len == 0 {
            return Err(CacheError::EmptyRange { addr });
        }
        let limit = self.address_limit();
        let end = match addr.checked_add(len) {
            Some(end) if end <= limit => end,
            _ => return Err(CacheError::OutOfRange { addr, len, limit }),
        };
        let page = self.page_size();
        let first = addr & !(page - 1);
        let last = end.next_multiple_of(page);
        if last - first > self.limits.max_bytes {
            return Err(CacheError::TooLarge {
                bytes: last - first,
                max: self.limits.max_bytes,
            });
        }
        monitor::wait_for_pending_events();
        let mut writer = self.writer.lock();

        // Another thread may have pinned it meanwhile.
        if let Some(id) = self.indexed_id(self.index.lookup(addr >> self.page_shift)) {
            if self.range_of(id).contains(addr, len) {
                self.take_locked(id);
                writer.locked_hits += 1;
                return Ok(id);
            }
        }

        // What the new region covers, and which indexed regions it replaces:
        // merged with everything it overlaps or touches while that stays
        // within `max_merged_bytes` and fits the limits; else the request
        // alone, replacing what it overlaps.
        let alone = PageRange {
            start: first,
            len: last - first,
        };
        let near = self.neighbours(first, last, self.limits.merge);
        let merged = self.merged_region(alone, &near);
        let first_try = match merged {
            // Any failure of the merged range falls back to the request
            // alone: beyond the limits, or pages of a cached neighbour the
            // pinner refuses (unmapped or made inaccessible since, while
            // its idle entry stayed), which this request does not need.
            Some(merged) => self
                .prepare(&mut writer, merged, &near)
                .ok()
                .map(|prepared| (merged, near.clone(), prepared)),
            None => None,
        };
        let (target, replaced, Prepared { token, idle, busy }) = match first_try {
            Some(done) => done,
            None => {
                let overlapping: Neighbours = near
                    .into_iter()
                    .filter(|&id| {
                        let range = self.range_of(id);
                        range.start < last && first < range.end()
                    })
                    .collect();
                let prepared = self.prepare(&mut writer, alone, &overlapping)?;
                (alone, overlapping, prepared)
            }
        };
        // A region the monitor cannot watch is used, never cached.
        let unwatched = self.subscribed() && !monitor::MemoryMonitor::watch_global(target);

        for &id in &replaced {
            let range = self.range_of(id);
            self.index.remove(
                range.start >> self.page_shift,
                range.end() >> self.page_shift,
            );
        }
        if replaced.len() > 1 || (replaced.len() == 1 && self.range_of(replaced[0]) != target) {
            writer.merges += replaced.len() as u64;
        }
        for &id in &busy {
            self.table
                .entry(id)
                .state
                .store(state::RETIRED, Ordering::Release);
            writer.retired.insert(id);
        }
        for &id in &idle {
            self.unpin_region(&mut writer, id);
        }

        let (id, never_used) = self.alloc_id(&mut writer)?;
        let entry = self.table.entry(id);
        entry.start.store(target.start, Ordering::Relaxed);
        entry.end.store(target.end(), Ordering::Relaxed);
        self.table.set_token(id, token);
        if !never_used {
            self.table.reset_usage(id);
        }
        // The insertion is a use: its key lives in the rank until hits raise
        // the marks above it.
        let policy = Policy::from_u8(self.policy.load(Ordering::Relaxed));
        writer.tick += 1;
        let tick = writer.tick;
        self.tick.store(tick, Ordering::Relaxed);
        let key = self.initial_usage(policy, tick);
        if unwatched {
            // Out of the index from the start: unpinned at its last
            // release, as an invalidated region is.
            entry.state.store(state::RETIRED, Ordering::Release);
            writer.retired.insert(id);
            writer.unwatched_regions += 1;
        } else {
            entry.state.store(state::LIVE, Ordering::Release);
            self.index.insert(
                target.start >> self.page_shift,
                target.end() >> self.page_shift,
                entry.index_value(),
            );
            writer.age += 1;
            let age = writer.age;
            writer.order.insert(Rank {
                key: if policy == Policy::Fifo { age } else { key },
                age,
                id,
            });
        }
        writer.pinned_bytes += target.len;
        writer.pinned_entries += 1;
        writer.misses += 1;
        self.table
            .counter(rcu::current_slot(), id)
            .add_ref(rcu::current_slot(), 1);
        Ok(id)
    }

    /// Makes room for `target` and pins it, with the regions it replaces
    /// held back from eviction and counted as freed if idle. Returns the
    /// token and the replaced regions split into idle and busy; on failure,
    /// everything is as it was (but for evictions).
    fn prepare(
        &self,
        writer: &mut Writer,
        target: PageRange,
        replaced: &[u32],
    ) -> Result<Prepared<P::Token>, CacheError> {
        if target.len > self.limits.max_bytes {
            return Err(CacheError::TooLarge {
                bytes: target.len,
                max: self.limits.max_bytes,
            });
        }
        let mut replaced_ranks: smallvec::SmallVec<[Rank; 4]> = smallvec::SmallVec::new();
        for &id in replaced {
            replaced_ranks.extend(writer.order.remove(id));
            self.table
                .entry(id)
                .state
                .store(state::DYING, Ordering::Relaxed);
        }
        let (mut idle, mut busy) = (Neighbours::new(), Neighbours::new());
        if !replaced.is_empty() {
            rcu::heavy_barrier();
            for &id in replaced {
                if self.table.refs(id) == 0 {
                    idle.push(id);
                } else {
                    busy.push(id);
                }
            }
        }
        let credit_bytes: usize = idle.iter().map(|&id| self.range_of(id).len).sum();
        let pinned = self
            .make_room(writer, target.len, credit_bytes, idle.len())
            .and_then(|()| self.pinner.pin(target).map_err(CacheError::from));
        match pinned {
            Ok(token) => Ok(Prepared { token, idle, busy }),
            Err(error) => {
                for rank in replaced_ranks {
                    self.table
                        .entry(rank.id)
                        .state
                        .store(state::LIVE, Ordering::Release);
                    writer.order.insert(rank);
                }
                Err(error)
            }
        }
    }

    /// The region a miss on `alone` pins when merged with the regions
    /// `near` it overlaps or touches, if merging applies and stays within
    /// `max_merged_bytes`.
    fn merged_region(&self, alone: PageRange, near: &Neighbours) -> Option<PageRange> {
        if !self.limits.merge || near.is_empty() {
            return None;
        }
        let start = near
            .iter()
            .map(|&id| self.range_of(id).start)
            .fold(alone.start, usize::min);
        let end = near
            .iter()
            .map(|&id| self.range_of(id).end())
            .fold(alone.end(), usize::max);
        let merged = PageRange {
            start,
            len: end - start,
        };
        (merged != alone && merged.len <= self.limits.max_merged_bytes.max(alone.len))
            .then_some(merged)
    }

    /// Evicts idle regions in policy order until `bytes` more bytes and one
    /// more entry fit, counting `credit_*` as already freed.
    fn make_room(
        &self,
        writer: &mut Writer,
        bytes: usize,
        credit_bytes: usize,
        credit_entries: usize,
    ) -> Result<(), CacheError> {
        let limits = &self.limits;
        let fits = |pinned: usize, entries: usize| {
            pinned + bytes <= limits.max_bytes && entries < limits.max_entries
        };
        let policy = Policy::from_u8(self.policy.load(Ordering::Relaxed));
        loop {
            let mut pinned = writer.pinned_bytes - credit_bytes;
            let mut entries = writer.pinned_entries - credit_entries;
            if fits(pinned, entries) {
                return Ok(());
            }
            let mut doomed: Vec<Rank> = Vec::new();
            let mut kept: Vec<Rank> = Vec::new();
            while !fits(pinned, entries) {
                let table = &self.table;
                let next = writer.order.pop_first(|id| match policy {
                    Policy::Fifo => 0,
                    Policy::Lru => table.usage(id, false),
                    Policy::Lfu => 1 + table.usage(id, true),
                });
                let Some(rank) = next else { break };
                if self.table.refs(rank.id) != 0 {
                    kept.push(rank);
                    continue;
                }
                self.table
                    .entry(rank.id)
                    .state
                    .store(state::DYING, Ordering::Relaxed);
                pinned -= self.range_of(rank.id).len;
                entries -= 1;
                doomed.push(rank);
            }
            if !doomed.is_empty() {
                rcu::heavy_barrier();
            }
            let mut evicted = 0;
            for rank in doomed {
                if self.table.refs(rank.id) == 0 {
                    let range = self.range_of(rank.id);
                    self.index.remove(
                        range.start >> self.page_shift,
                        range.end() >> self.page_shift,
                    );
                    self.unpin_region(writer, rank.id);
                    writer.evictions += 1;
                    evicted += 1;
                } else {
                    self.table
                        .entry(rank.id)
                        .state
                        .store(state::LIVE, Ordering::Release);
                    kept.push(rank);
                }
            }
            for rank in kept {
                writer.order.insert(rank);
            }
            if evicted == 0 {
                let pinned = writer.pinned_bytes - credit_bytes;
                let entries = writer.pinned_entries - credit_entries;
                if fits(pinned, entries) {
                    return Ok(());
                }
                // Every pinned region is either in the eviction order or
                // one this pin replaces (the idle ones are credited): the
                // rest hold references.
                let idle = writer
                    .order
                    .ids()
                    .filter(|&id| self.table.refs(id) == 0)
                    .count();
                let in_use = writer
                    .pinned_entries
                    .saturating_sub(idle)
                    .saturating_sub(credit_entries);
                return Err(CacheError::LimitReached {
                    limit: if pinned + bytes > limits.max_bytes {
                        Limit::PinnedBytes
                    } else {
                        Limit::Entries
                    },
                    bytes,
                    pinned_bytes: writer.pinned_bytes,
                    entries: writer.pinned_entries,
                    in_use,
                    max_bytes: limits.max_bytes,
                    max_entries: limits.max_entries,
                });
            }
        }
    }

    /// Unpins a region nobody holds and that is out of the index.
    fn unpin_region(&self, writer: &mut Writer, id: u32) {
        let range = self.range_of(id);
        let unmapped = writer.unmapped.remove(&id);
        let unwatched = writer.unwatched.remove(&id);
        self.release_pins(
            id,
            unmapped.as_deref(),
            unwatched.as_deref(),
            self.subscribed(),
        );
        self.table
            .entry(id)
            .state
            .store(state::UNPINNED, Ordering::Release);
        writer.pinned_bytes -= range.len;
        writer.pinned_entries -= 1;
        writer.limbo.push(id);
    }

    /// Whether the monitor watches this cache's regions: it was asked to,
    /// and this is not a child of `fork()` of the process that started it.
    fn subscribed(&self) -> bool {
        self.monitored.load(Ordering::Acquire) && !monitor::inherited()
    }

    /// A region id nobody can still see, and whether it was never used
    /// (its counters are still zero).
    fn alloc_id(&self, writer: &mut Writer) -> Result<(u32, bool), CacheError> {
        if let Some(id) = writer.free_ids.pop() {
            return Ok((id, false));
        }
        let capacity = (CHUNK * MAX_CHUNKS) as u32;
        if writer.limbo.len() >= LIMBO_BATCH
            || (writer.next_id == capacity && !writer.limbo.is_empty())
        {
            rcu::synchronize();
            for &id in &writer.limbo {
                self.table
                    .entry(id)
                    .state
                    .store(state::FREE, Ordering::Relaxed);
            }
            let limbo = std::mem::take(&mut writer.limbo);
            writer.free_ids.extend(limbo);
            if let Some(id) = writer.free_ids.pop() {
                return Ok((id, false));
            }
        }
        if writer.next_id == capacity {
            return Err(CacheError::InvalidConfig(format!(
                "more than {capacity} regions pinned or held at once"
            )));
        }
        let id = writer.next_id;
        self.table.ensure_chunk(id as usize / CHUNK);
        writer.next_id += 1;
        Ok((id, true))
    }

    /// Gives back region `id`'s pin and (if `monitored`) watch of its
    /// range, but for the parts already unmapped (their pins are void) and
    /// the parts whose watches the monitor cleared.
    fn release_pins(
        &self,
        id: u32,
        unmapped: Option<&[PageRange]>,
        unwatched: Option<&[PageRange]>,
        monitored: bool,
    ) {
        let range = self.range_of(id);
        if let Some(token) = self.table.take_token(id) {
            match unmapped {
                Some(gone) => self.pinner.unpin_unmapped(range, token, gone),
                None => self.pinner.unpin(range, token),
            }
        }
        if monitored {
            match unwatched {
                Some(cleared) => range
                    .minus_all(cleared)
                    .into_iter()
                    .for_each(monitor::MemoryMonitor::unwatch_global),
                None => monitor::MemoryMonitor::unwatch_global(range),
            }
        }
    }

    /// Invalidates the regions overlapping `[addr, addr + len)`; `unmapped`:
    /// the memory itself is gone, not only its contents; `watches_cleared`:
    /// the memory monitor has cleared the watches there (it reports every
    /// unmapping and removal so).
    fn invalidate(&self, addr: usize, len: usize, unmapped: bool, watches_cleared: bool) -> usize {
        if len == 0 {
            return 0;
        }
        let page = self.page_size();
        let first = addr & !(page - 1);
        let last = addr
            .saturating_add(len)
            .min(self.address_limit())
            .next_multiple_of(page);
        if first >= last {
            return 0;
        }
        let mut writer = self.writer.lock();
        let gone = PageRange {
            start: first,
            len: last - first,
        };
        let doomed = self.neighbours(first, last, false);
        if unmapped {
            self.pinner.forget(gone);
        }
        if unmapped || watches_cleared {
            // Every region pinned there learns what it lost: those in the
            // index (doomed now) and those retired earlier and still held,
            // which the index no longer finds. Each gives back only the
            // rest of its range, never pins or watches made there since.
            let retired_there: Vec<u32> = writer
                .retired
                .iter()
                .copied()
                .filter(|&id| self.range_of(id).overlaps(gone))
                .collect();
            for id in doomed.iter().copied().chain(retired_there) {
                if unmapped {
                    add_part(writer.unmapped.entry(id).or_default(), gone);
                }
                if watches_cleared {
                    add_part(writer.unwatched.entry(id).or_default(), gone);
                }
            }
        }
        if doomed.is_empty() {
            return 0;
        }
        for &id in &doomed {
            writer.order.remove(id);
            self.table
                .entry(id)
                .state
                .store(state::DYING, Ordering::Relaxed);
        }
        rcu::heavy_barrier();
        for &id in &doomed {
            let range = self.range_of(id);
            self.index.remove(
                range.start >> self.page_shift,
                range.end() >> self.page_shift,
            );
            if self.table.refs(id) == 0 {
                self.unpin_region(&mut writer, id);
            } else {
                self.table
                    .entry(id)
                    .state
                    .store(state::RETIRED, Ordering::Release);
                writer.retired.insert(id);
            }
        }
        writer.invalidations += doomed.len() as u64;
        doomed.len()
    }

    fn stats(&self) -> CacheStats {
        let writer = self.writer.lock();
        let lock_free_hits: u64 = self.hits.iter().map(|h| h.load(Ordering::Relaxed)).sum();
        CacheStats {
            hits: lock_free_hits + writer.locked_hits,
            misses: writer.misses,
            evictions: writer.evictions,
            invalidations: writer.invalidations,
            unwatched: writer.unwatched_regions,
            merges: writer.merges,
            pinned_bytes: writer.pinned_bytes,
            pinned_entries: writer.pinned_entries,
            retired_entries: writer.retired.len(),
            max_pinned_bytes: self.limits.max_bytes,
            max_entries: self.limits.max_entries,
            index_nodes: self.index.node_count(),
        }
    }
}

impl<P: Pinner> InvalidationTarget for Shared<P> {
    fn invalidate_range(&self, start: usize, len: usize, unmapped: bool) -> usize {
        // The monitor calls this once it has cleared the watches there.
        self.invalidate(start, len, unmapped, true)
    }
}

impl<P: Pinner> Drop for Shared<P> {
    fn drop(&mut self) {
        let monitored = self.subscribed();
        drop(self.subscription.lock().take());
        let writer = self.writer.get_mut();
        let (mut unmapped, mut unwatched) = (
            std::mem::take(&mut writer.unmapped),
            std::mem::take(&mut writer.unwatched),
        );
        for id in 0..writer.next_id {
            let current = self.table.entry(id).state.load(Ordering::Relaxed);
            if matches!(current, state::LIVE | state::DYING | state::RETIRED) {
                let (gone, cleared) = (unmapped.remove(&id), unwatched.remove(&id));
                self.release_pins(id, gone.as_deref(), cleared.as_deref(), monitored);
            }
        }
    }
}
