//! A cache of transfer descriptors for repeated transfers (GASNet on
//! TCA/PEACH2, section 4.4).
//!
//! Building the descriptor of a DMA transfer (there: a PEACH2 descriptor;
//! here: a work request with its registrations and windows resolved) costs
//! time, and HPC programs repeat the same transfers (same source, same
//! destination, same size) over and over, so a library keeps the
//! descriptors it built and reuses them. [`DescriptorCache`] is that cache,
//! generic over the key `K` (for example `(source, destination, size)`),
//! the descriptor `V` and the promoted form `P`:
//!
//! * **Replacement chosen at run time** ([`Replacement`]): least recently
//!   used, least frequently used (ties go to the least recently used), or
//!   first come (entries are handed out until the cache is full; later keys
//!   are built for the one transfer and not kept, nothing is ever evicted).
//! * **Promotion** ([`CacheConfig::promote_after`]): the paper builds a
//!   descriptor in host memory first and builds it again in the NIC's
//!   internal memory (faster to start, scarcer, slower to build) once it
//!   has been used a given number of times. Here the caller's `promote`
//!   closure builds the promoted form `P` (for example a prebuilt work
//!   request kept in the ring) from the descriptor on the lookup that makes
//!   the entry's use count reach the threshold; the entry keeps both, and
//!   later lookups hand out both ([`Cached::Promoted`]). `None` turns
//!   promotion off.
//! * **Eviction and invalidation hand the values back** ([`Evicted`]), so
//!   the caller releases what they hold (registrations, ring slots).
//! * **Counters** ([`CacheCounters`]): every lookup is exactly one hit or
//!   one miss.
//!
//! Lookups, insertions and evictions take O(log n) time: the entries live
//! in a hash map, and their replacement order in a `BTreeMap` keyed by
//! (use count, last use) for LFU and by last use for LRU.
//!
//! ```
//! use pindown_messaging::gasnet::descriptor_cache::{
//!     CacheConfig, Cached, DescriptorCache, Outcome, Replacement,
//! };
//!
//! // Keys: (source, destination, size); descriptors: a String here.
//! let mut cache: DescriptorCache<(u64, u64, u32), String, u32> =
//!     DescriptorCache::new(CacheConfig {
//!         capacity: 2,
//!         policy: Replacement::Lru,
//!         promote_after: Some(3),
//!     });
//! let build = |k: &(u64, u64, u32)| format!("{k:?}");
//! let promote = |_: &(u64, u64, u32), v: &String| v.len() as u32;
//! for use_number in 1..=4 {
//!     let lookup = cache.lookup_or_insert_with((0x1000, 0x2000, 64), build, promote);
//!     match use_number {
//!         1 => assert_eq!(lookup.outcome, Outcome::Miss),
//!         2 => assert_eq!(lookup.outcome, Outcome::Hit),
//!         _ => assert!(matches!(lookup.entry, Cached::Promoted(_, _))),
//!     }
//! }
//! assert_eq!(cache.counters().promotions, 1);
//! assert_eq!(cache.counters().hits + cache.counters().misses, cache.counters().lookups);
//! ```

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;

/// Which entry a full cache gives up for a new key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Replacement {
    /// Least recently used: the entry whose last lookup is oldest.
    Lru,
    /// Least frequently used: the entry with the fewest uses since it was
    /// inserted; among equals, the least recently used.
    Lfu,
    /// First come, first served: entries are given out until the cache is
    /// full, and then kept; a new key's descriptor is built for its one
    /// transfer and not cached ([`Outcome::Bypass`]).
    FirstCome,
}

/// A cache's settings, chosen at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheConfig {
    /// Most entries held. 0 caches nothing (every lookup builds and hands
    /// out an uncached descriptor).
    pub capacity: usize,
    /// Which entry a full cache gives up.
    pub policy: Replacement,
    /// Promote an entry on the lookup that makes its use count (the miss
    /// that inserted it is use 1) reach this many; `Some(0)` and `Some(1)`
    /// both promote at insertion. `None`: promotion off.
    pub promote_after: Option<u32>,
}

impl Default for CacheConfig {
    /// 256 entries, LRU, promotion after 8 uses.
    fn default() -> Self {
        CacheConfig {
            capacity: 256,
            policy: Replacement::Lru,
            promote_after: Some(8),
        }
    }
}

/// What a lookup found. Every lookup is one hit ([`Outcome::Hit`],
/// [`Outcome::PromotedHit`]) or one miss ([`Outcome::Miss`],
/// [`Outcome::Bypass`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// The key was cached, not promoted before this lookup.
    Hit,
    /// The key was cached and already promoted.
    PromotedHit,
    /// The key was not cached: its descriptor was built and inserted
    /// (possibly evicting another, see [`Lookup::evicted`]).
    Miss,
    /// The key was not cached and is not kept (a full first-come cache, or
    /// capacity 0): its descriptor was built for this transfer only.
    Bypass,
}

impl Outcome {
    /// Whether the key was found.
    pub fn is_hit(self) -> bool {
        matches!(self, Outcome::Hit | Outcome::PromotedHit)
    }
}

/// The descriptor a lookup hands out.
#[derive(Debug, PartialEq, Eq)]
pub enum Cached<'a, V, P> {
    /// A cached descriptor, not promoted.
    Entry(&'a V),
    /// A cached descriptor and its promoted form.
    Promoted(&'a V, &'a P),
    /// A descriptor built for this transfer only ([`Outcome::Bypass`]);
    /// the caller owns (and releases) it.
    Uncached(V),
}

impl<V, P> Cached<'_, V, P> {
    /// The descriptor, cached or not.
    pub fn value(&self) -> &V {
        match self {
            Cached::Entry(v) | Cached::Promoted(v, _) => v,
            Cached::Uncached(v) => v,
        }
    }

    /// The promoted form, if the entry has one.
    pub fn promoted(&self) -> Option<&P> {
        match self {
            Cached::Promoted(_, p) => Some(p),
            _ => None,
        }
    }

    /// Whether the entry is promoted.
    pub fn is_promoted(&self) -> bool {
        matches!(self, Cached::Promoted(_, _))
    }
}

/// An entry that left the cache, handed back so that the caller releases
/// what it holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Evicted<K, V, P> {
    /// Its key.
    pub key: K,
    /// Its descriptor.
    pub value: V,
    /// Its promoted form, if it was promoted.
    pub promoted: Option<P>,
    /// Its uses since it was inserted.
    pub uses: u64,
}

/// The result of [`DescriptorCache::lookup_or_insert_with`].
#[derive(Debug)]
pub struct Lookup<'a, K, V, P> {
    /// The descriptor to use.
    pub entry: Cached<'a, V, P>,
    /// Hit or miss.
    pub outcome: Outcome,
    /// Whether this lookup promoted the entry (its `promote` closure ran).
    pub promoted_now: bool,
    /// The entry evicted to make room for this key, if any.
    pub evicted: Option<Evicted<K, V, P>>,
}

/// Event counts since the cache was made. `hits + misses == lookups`;
/// `misses == inserted + bypasses`; entries held `== inserted - evictions
/// - invalidations - removals`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CacheCounters {
    /// Lookups.
    pub lookups: u64,
    /// Lookups that found their key (promoted or not).
    pub hits: u64,
    /// Lookups that found their key promoted.
    pub promoted_hits: u64,
    /// Lookups that did not find their key.
    pub misses: u64,
    /// Misses whose descriptor was not kept.
    pub bypasses: u64,
    /// Entries inserted.
    pub inserted: u64,
    /// Entries given up for new keys.
    pub evictions: u64,
    /// Entries promoted.
    pub promotions: u64,
    /// Entries removed by [`DescriptorCache::invalidate`].
    pub invalidations: u64,
    /// Entries removed by [`DescriptorCache::remove`] or
    /// [`DescriptorCache::clear`].
    pub removals: u64,
}

/// One cached descriptor.
#[derive(Debug)]
struct Slot<V, P> {
    value: V,
    promoted: Option<P>,
    uses: u64,
    /// Its key in [`DescriptorCache::order`].
    rank: Rank,
}

/// An entry's place in the replacement order: the smallest goes first.
/// LRU: (0, last use); LFU: (uses, last use); first come: (0, insertion).
type Rank = (u64, u64);

/// A cache of descriptors `V` (and their promoted forms `P`) keyed by `K`;
/// see the [module documentation](self).
#[derive(Debug)]
pub struct DescriptorCache<K, V, P = ()> {
    config: CacheConfig,
    entries: HashMap<K, Slot<V, P>>,
    /// Replacement order: rank to key. Ranks are unique (the second part is
    /// a tick no two events share).
    order: BTreeMap<Rank, K>,
    tick: u64,
    counters: CacheCounters,
}

impl<K: Eq + Hash + Clone, V, P> DescriptorCache<K, V, P> {
    /// An empty cache.
    pub fn new(config: CacheConfig) -> Self {
        DescriptorCache {
            config,
            entries: HashMap::with_capacity(config.capacity.min(1 << 16)),
            order: BTreeMap::new(),
            tick: 0,
            counters: CacheCounters::default(),
        }
    }

    /// Its settings.
    pub fn config(&self) -> CacheConfig {
        self.config
    }

    /// Its counters.
    pub fn counters(&self) -> CacheCounters {
        self.counters
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether it holds no entry.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Whether `key` is cached.
    pub fn contains(&self, key: &K) -> bool {
        self.entries.contains_key(key)
    }

    /// Whether `key` is cached and promoted.
    pub fn is_promoted(&self, key: &K) -> bool {
        self.entries.get(key).is_some_and(|s| s.promoted.is_some())
    }

    /// The uses of `key` since it was inserted (0 if not cached).
    pub fn uses(&self, key: &K) -> u64 {
        self.entries.get(key).map_or(0, |s| s.uses)
    }

    /// `key`'s descriptor without counting a use or changing the order.
    pub fn peek(&self, key: &K) -> Option<Cached<'_, V, P>> {
        self.entries.get(key).map(|s| match &s.promoted {
            Some(p) => Cached::Promoted(&s.value, p),
            None => Cached::Entry(&s.value),
        })
    }

    /// The entry the policy would give up next (first come: none, it never
    /// evicts).
    pub fn next_victim(&self) -> Option<&K> {
        match self.config.policy {
            Replacement::FirstCome => None,
            Replacement::Lru | Replacement::Lfu => self.order.values().next(),
        }
    }

    /// The descriptor for `key`: the cached one (a hit), or one `build`
    /// makes (a miss), inserted if the policy finds room (evicting an
    /// entry if needed, handed back in [`Lookup::evicted`]) and handed out
    /// uncached otherwise. Counts a use; `promote` builds the promoted form
    /// on the use that reaches [`CacheConfig::promote_after`] (at most once
    /// per entry; never for an uncached descriptor).
    pub fn lookup_or_insert_with(
        &mut self,
        key: K,
        build: impl FnOnce(&K) -> V,
        promote: impl FnOnce(&K, &V) -> P,
    ) -> Lookup<'_, K, V, P> {
        self.counters.lookups += 1;
        self.tick += 1;
        let tick = self.tick;
        let policy = self.config.policy;
        let threshold = self.config.promote_after.map(|n| u64::from(n.max(1)));
        // Looked up twice on a hit: a borrow returned from one branch
        // cannot end before the other branch inserts.
        if self.entries.contains_key(&key) {
            let slot = self.entries.get_mut(&key).expect("contained");
            self.counters.hits += 1;
            let outcome = if slot.promoted.is_some() {
                self.counters.promoted_hits += 1;
                Outcome::PromotedHit
            } else {
                Outcome::Hit
            };
            slot.uses += 1;
            let rank = Self::rank_for(policy, slot.uses, tick, slot.rank);
            if rank != slot.rank {
                let k = self.order.remove(&slot.rank).expect("ranked entry");
                self.order.insert(rank, k);
                slot.rank = rank;
            }
            let promoted_now = slot.promoted.is_none() && threshold.is_some_and(|t| slot.uses >= t);
            if promoted_now {
                slot.promoted = Some(promote(&key, &slot.value));
                self.counters.promotions += 1;
            }
            return Lookup {
                entry: Self::cached(slot),
                outcome,
                promoted_now,
                evicted: None,
            };
        }

        self.counters.misses += 1;
        let value = build(&key);
        let full = self.entries.len() >= self.config.capacity;
        if self.config.capacity == 0 || (full && policy == Replacement::FirstCome) {
            self.counters.bypasses += 1;
            return Lookup {
                entry: Cached::Uncached(value),
                outcome: Outcome::Bypass,
                promoted_now: false,
                evicted: None,
            };
        }
        let evicted = if full {
            let (_, victim) = self.order.pop_first().expect("a full cache has entries");
            let slot = self.entries.remove(&victim).expect("ordered key is cached");
            self.counters.evictions += 1;
            Some(Evicted {
                key: victim,
                value: slot.value,
                promoted: slot.promoted,
                uses: slot.uses,
            })
        } else {
            None
        };
        self.counters.inserted += 1;
        let promoted_now = threshold.is_some_and(|t| t <= 1);
        let promoted = if promoted_now {
            self.counters.promotions += 1;
            Some(promote(&key, &value))
        } else {
            None
        };
        let rank = Self::rank_for(policy, 1, tick, (0, tick));
        self.order.insert(rank, key.clone());
        let slot = self.entries.entry(key).or_insert(Slot {
            value,
            promoted,
            uses: 1,
            rank,
        });
        Lookup {
            entry: Self::cached(slot),
            outcome: Outcome::Miss,
            promoted_now,
            evicted,
        }
    }

    /// Removes every entry `pred` accepts (memory that went away, a window
    /// revoked) and hands them back.
    pub fn invalidate(&mut self, mut pred: impl FnMut(&K, &V) -> bool) -> Vec<Evicted<K, V, P>> {
        let keys: Vec<K> = self
            .entries
            .iter()
            .filter(|(k, s)| pred(k, &s.value))
            .map(|(k, _)| k.clone())
            .collect();
        let gone: Vec<Evicted<K, V, P>> = keys.into_iter().filter_map(|k| self.take(k)).collect();
        self.counters.invalidations += gone.len() as u64;
        gone
    }

    /// Removes `key`'s entry and hands it back.
    pub fn remove(&mut self, key: &K) -> Option<Evicted<K, V, P>> {
        let gone = self.take(key.clone());
        if gone.is_some() {
            self.counters.removals += 1;
        }
        gone
    }

    /// Removes every entry and hands them back.
    pub fn clear(&mut self) -> Vec<Evicted<K, V, P>> {
        self.order.clear();
        let gone: Vec<Evicted<K, V, P>> = self
            .entries
            .drain()
            .map(|(key, slot)| Evicted {
                key,
                value: slot.value,
                promoted: slot.promoted,
                uses: slot.uses,
            })
            .collect();
        self.counters.removals += gone.len() as u64;
        gone
    }

    fn take(&mut self, key: K) -> Option<Evicted<K, V, P>> {
        let slot = self.entries.remove(&key)?;
        self.order.remove(&slot.rank);
        Some(Evicted {
            key,
            value: slot.value,
            promoted: slot.promoted,
            uses: slot.uses,
        })
    }

    /// An entry's rank after a use at `tick` bringing it to `uses`.
    fn rank_for(policy: Replacement, uses: u64, tick: u64, old: Rank) -> Rank {
        match policy {
            Replacement::Lru => (0, tick),
            Replacement::Lfu => (uses, tick),
            Replacement::FirstCome => old,
        }
    }

    fn cached(slot: &Slot<V, P>) -> Cached<'_, V, P> {
        match &slot.promoted {
            Some(p) => Cached::Promoted(&slot.value, p),
            None => Cached::Entry(&slot.value),
        }
    }
}

impl<K: Eq + Hash + Clone, V> DescriptorCache<K, V, ()> {
    /// [`lookup_or_insert_with`](Self::lookup_or_insert_with) for a cache
    /// whose promotion is only a mark ([`DescriptorCache::is_promoted`],
    /// [`Cached::is_promoted`]): nothing is built at promotion.
    pub fn get_or_insert_with(
        &mut self,
        key: K,
        build: impl FnOnce(&K) -> V,
    ) -> Lookup<'_, K, V, ()> {
        self.lookup_or_insert_with(key, build, |_, _| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small seeded generator (xorshift64*), so that the random
    /// sequences are the same on every run.
    struct Rng(u64);

    impl Rng {
        fn below(&mut self, n: u64) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
        }
    }

    /// The policies' definitions, written the slow obvious way: a list of
    /// (key, uses, last use, inserted at, promoted), scanned for the
    /// victim.
    struct Reference {
        config: CacheConfig,
        entries: Vec<(u32, u64, u64, u64, bool)>,
        clock: u64,
    }

    /// What the reference says one lookup does.
    #[derive(Debug, PartialEq)]
    struct Step {
        outcome: Outcome,
        evicted: Option<u32>,
        promoted_now: bool,
    }

    impl Reference {
        fn new(config: CacheConfig) -> Self {
            Reference {
                config,
                entries: Vec::new(),
                clock: 0,
            }
        }

        fn access(&mut self, key: u32) -> Step {
            self.clock += 1;
            let threshold = self.config.promote_after.map(|n| u64::from(n.max(1)));
            if let Some(e) = self.entries.iter_mut().find(|e| e.0 == key) {
                let outcome = if e.4 {
                    Outcome::PromotedHit
                } else {
                    Outcome::Hit
                };
                e.1 += 1;
                e.2 = self.clock;
                let promoted_now = !e.4 && threshold.is_some_and(|t| e.1 >= t);
                e.4 |= promoted_now;
                return Step {
                    outcome,
                    evicted: None,
                    promoted_now,
                };
            }
            let full = self.entries.len() >= self.config.capacity;
            if self.config.capacity == 0 || (full && self.config.policy == Replacement::FirstCome) {
                return Step {
                    outcome: Outcome::Bypass,
                    evicted: None,
                    promoted_now: false,
                };
            }
            let mut evicted = None;
            if full {
                // The victim by definition: LRU the oldest last use; LFU
                // the fewest uses, then the oldest last use.
                let victim = (0..self.entries.len())
                    .min_by_key(|&i| {
                        let e = self.entries[i];
                        match self.config.policy {
                            Replacement::Lru => (0, e.2),
                            Replacement::Lfu => (e.1, e.2),
                            Replacement::FirstCome => unreachable!(),
                        }
                    })
                    .unwrap();
                evicted = Some(self.entries.remove(victim).0);
            }
            let promoted_now = threshold.is_some_and(|t| t <= 1);
            self.entries
                .push((key, 1, self.clock, self.clock, promoted_now));
            Step {
                outcome: Outcome::Miss,
                evicted,
                promoted_now,
            }
        }
    }

    fn cache(capacity: usize, policy: Replacement, promote_after: Option<u32>) -> Cache {
        DescriptorCache::new(CacheConfig {
            capacity,
            policy,
            promote_after,
        })
    }

    /// Keys u32; descriptors name their key; promoted forms name it too,
    /// so a test sees that the right closure ran on the right entry.
    type Cache = DescriptorCache<u32, String, (u32, String)>;

    fn access(c: &mut Cache, key: u32) -> Step {
        let lookup = c.lookup_or_insert_with(key, |k| format!("d{k}"), |k, v| (*k, v.clone()));
        assert_eq!(lookup.entry.value(), &format!("d{key}"));
        if let Some(p) = lookup.entry.promoted() {
            assert_eq!(p, &(key, format!("d{key}")));
        }
        if let Some(e) = &lookup.evicted {
            assert_eq!(e.value, format!("d{}", e.key));
            assert_ne!(e.key, key);
        }
        Step {
            outcome: lookup.outcome,
            evicted: lookup.evicted.map(|e| e.key),
            promoted_now: lookup.promoted_now,
        }
    }

    fn check_counters(c: &Cache) {
        let n = c.counters();
        assert_eq!(n.hits + n.misses, n.lookups);
        assert_eq!(n.misses, n.inserted + n.bypasses);
        assert_eq!(
            c.len() as u64,
            n.inserted - n.evictions - n.invalidations - n.removals
        );
        assert!(c.len() <= c.config().capacity);
    }

    #[test]
    fn lru_evicts_the_least_recently_used() {
        let mut c = cache(3, Replacement::Lru, None);
        for k in [1, 2, 3, 1] {
            access(&mut c, k);
        }
        // 2 is now the oldest use, though 1 came first.
        assert_eq!(c.next_victim(), Some(&2));
        assert_eq!(access(&mut c, 4).evicted, Some(2));
        assert_eq!(access(&mut c, 5).evicted, Some(3));
        assert!(c.contains(&1) && c.contains(&4) && c.contains(&5));
        check_counters(&c);
    }

    #[test]
    fn lfu_evicts_the_least_frequently_used_then_the_oldest() {
        let mut c = cache(3, Replacement::Lfu, None);
        for k in [1, 1, 1, 2, 2, 3] {
            access(&mut c, k);
        }
        // 3 has one use.
        assert_eq!(access(&mut c, 4).evicted, Some(3));
        // 4 now has one use; used again, it ties with 2 (two uses) and 2
        // is older.
        access(&mut c, 4);
        assert_eq!(access(&mut c, 5).evicted, Some(2));
        assert_eq!(c.uses(&1), 3);
        check_counters(&c);
    }

    #[test]
    fn first_come_keeps_the_first_keys_and_bypasses_the_rest() {
        let mut c = cache(2, Replacement::FirstCome, None);
        assert_eq!(access(&mut c, 1).outcome, Outcome::Miss);
        assert_eq!(access(&mut c, 2).outcome, Outcome::Miss);
        let step = access(&mut c, 3);
        assert_eq!(step.outcome, Outcome::Bypass);
        assert_eq!(step.evicted, None);
        // Not kept: a miss again.
        assert_eq!(access(&mut c, 3).outcome, Outcome::Bypass);
        assert_eq!(access(&mut c, 1).outcome, Outcome::Hit);
        assert_eq!(c.next_victim(), None);
        assert!(!c.contains(&3));
        let uncached = c.lookup_or_insert_with(9, |k| format!("d{k}"), |k, v| (*k, v.clone()));
        assert_eq!(uncached.entry, Cached::Uncached("d9".to_string()));
        check_counters(&c);
        assert_eq!(c.counters().bypasses, 3);
    }

    #[test]
    fn promotion_happens_at_exactly_the_threshold() {
        for threshold in 1..=5u32 {
            let mut c = cache(4, Replacement::Lru, Some(threshold));
            for use_number in 1..=threshold + 2 {
                let step = access(&mut c, 7);
                assert_eq!(
                    step.promoted_now,
                    use_number == threshold,
                    "threshold {threshold}, use {use_number}"
                );
                assert_eq!(c.is_promoted(&7), use_number >= threshold);
                let expected = match use_number {
                    1 => Outcome::Miss,
                    n if n > threshold => Outcome::PromotedHit,
                    _ => Outcome::Hit,
                };
                assert_eq!(step.outcome, expected, "threshold {threshold}");
            }
            assert_eq!(c.counters().promotions, 1);
            assert_eq!(c.counters().promoted_hits, 2);
            assert!(matches!(c.peek(&7), Some(Cached::Promoted(_, (7, _)))));
        }
    }

    #[test]
    fn promotion_off_never_promotes() {
        let mut c = cache(2, Replacement::Lfu, None);
        for _ in 0..1000 {
            let step = access(&mut c, 1);
            assert!(!step.promoted_now);
            assert_ne!(step.outcome, Outcome::PromotedHit);
        }
        assert!(!c.is_promoted(&1));
        assert_eq!(c.counters().promotions, 0);
        assert_eq!(c.counters().hits, 999);
    }

    #[test]
    fn eviction_hands_back_the_promoted_form() {
        let mut c = cache(1, Replacement::Lru, Some(2));
        access(&mut c, 1);
        access(&mut c, 1);
        let lookup = c.lookup_or_insert_with(2, |k| format!("d{k}"), |k, v| (*k, v.clone()));
        let evicted = lookup.evicted.expect("1 evicted");
        assert_eq!(
            evicted,
            Evicted {
                key: 1,
                value: "d1".to_string(),
                promoted: Some((1, "d1".to_string())),
                uses: 2
            }
        );
    }

    #[test]
    fn invalidate_removes_what_the_predicate_accepts() {
        let mut c = cache(8, Replacement::Lfu, Some(2));
        for k in 0..8 {
            access(&mut c, k);
            access(&mut c, k);
        }
        let mut gone: Vec<u32> = c
            .invalidate(|k, v| {
                assert_eq!(v, &format!("d{k}"));
                k % 2 == 1
            })
            .into_iter()
            .inspect(|e| assert!(e.promoted.is_some()))
            .map(|e| e.key)
            .collect();
        gone.sort_unstable();
        assert_eq!(gone, vec![1, 3, 5, 7]);
        assert!((0..8).all(|k| c.contains(&k) == (k % 2 == 0)));
        // The order forgot them too: filling up evicts only live keys.
        for k in 100..110 {
            if let Some(e) = access(&mut c, k).evicted {
                assert!(e % 2 == 0 || e >= 100, "evicted {e}");
            }
        }
        assert_eq!(c.remove(&100), None);
        check_counters(&c);
        let n = c.clear().len();
        assert_eq!(n, 8);
        assert!(c.is_empty());
        check_counters(&c);
    }

    #[test]
    fn capacity_zero_caches_nothing() {
        let mut c = cache(0, Replacement::Lru, Some(1));
        for _ in 0..3 {
            let step = access(&mut c, 1);
            assert_eq!(step.outcome, Outcome::Bypass);
            assert!(!step.promoted_now);
        }
        assert!(c.is_empty());
        check_counters(&c);
    }

    #[test]
    fn unit_promoted_form_is_a_mark() {
        let mut c: DescriptorCache<u8, u8> = DescriptorCache::new(CacheConfig {
            capacity: 1,
            policy: Replacement::Lru,
            promote_after: Some(2),
        });
        assert!(!c.get_or_insert_with(1, |k| *k).entry.is_promoted());
        assert!(c.get_or_insert_with(1, |k| *k).entry.is_promoted());
        assert!(c.is_promoted(&1));
    }

    /// Every policy against its reference on random sequences (seeded):
    /// the same outcome, victim and promotion on every lookup.
    #[test]
    fn every_policy_matches_its_reference_on_random_sequences() {
        let policies = [Replacement::Lru, Replacement::Lfu, Replacement::FirstCome];
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for seed_round in 0..60 {
            let policy = policies[seed_round % 3];
            let capacity = rng.below(6) as usize;
            let promote_after = match rng.below(4) {
                0 => None,
                _ => Some(rng.below(5) as u32),
            };
            let keys = 1 + rng.below(12) as u32;
            let config = CacheConfig {
                capacity,
                policy,
                promote_after,
            };
            let mut c: Cache = DescriptorCache::new(config);
            let mut reference = Reference::new(config);
            let mut evictions = 0;
            for i in 0..2000 {
                // Skewed keys, so that LFU and LRU choose differently.
                let key = if rng.below(3) == 0 {
                    rng.below(u64::from(keys)) as u32
                } else {
                    rng.below(u64::from(keys).div_ceil(3)) as u32
                };
                let expected = reference.access(key);
                let got = access(&mut c, key);
                assert_eq!(got, expected, "{config:?}, lookup {i} of key {key}");
                evictions += u64::from(got.evicted.is_some());
                for e in &reference.entries {
                    assert_eq!(c.is_promoted(&e.0), e.4);
                    assert_eq!(c.uses(&e.0), e.1);
                }
                assert_eq!(c.len(), reference.entries.len());
            }
            check_counters(&c);
            assert_eq!(c.counters().evictions, evictions);
        }
    }
}
