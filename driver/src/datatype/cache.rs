//! The descriptor cache: compiled patterns of committed types, kept by
//! `(type, count)` so a type sent again with the same count costs a hash
//! look-up instead of a compile (TCA/PEACH2's descriptor cache, with its
//! replacement policies chosen at run time and its promotion of
//! descriptors used often).

use std::collections::HashMap;
use std::sync::Arc;

use pindown_uapi::pattern::Pattern;

use super::compile::Committed;
use super::DatatypeError;

/// Which entry a full cache gives up for a new one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Policy {
    /// The least recently used.
    Lru,
    /// The least frequently used (hits plus the first use); among equals,
    /// the least recently used.
    Lfu,
    /// The first inserted (FIFO).
    Fifo,
    /// None: entries are given first come, first served until the cache
    /// is full; later descriptors are compiled for each use and not kept.
    FirstCome,
}

/// A cache's settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheConfig {
    /// Replacement policy.
    pub policy: Policy,
    /// Entries held at most (0: nothing is kept).
    pub capacity: usize,
    /// Uses after which an entry counts as hot ([`Lookup::hot`]);
    /// `None`: never.
    pub promote_after: Option<u64>,
}

impl Default for CacheConfig {
    /// LRU, 256 entries, hot after 16 uses.
    fn default() -> Self {
        CacheConfig {
            policy: Policy::Lru,
            capacity: 256,
            promote_after: Some(16),
        }
    }
}

/// Counters of a cache. They add up: `lookups == hits + misses`, `misses
/// == insertions + bypasses + failures`, and `insertions == evictions +
/// entries held`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Calls of [`DescriptorCache::get`].
    pub lookups: u64,
    /// Look-ups that found their entry.
    pub hits: u64,
    /// Look-ups that compiled.
    pub misses: u64,
    /// Compiled descriptors kept.
    pub insertions: u64,
    /// Entries given up for newer ones.
    pub evictions: u64,
    /// Compiled descriptors not kept (capacity 0, or [`Policy::FirstCome`]
    /// when full).
    pub bypasses: u64,
    /// Compiles that failed (nothing kept).
    pub failures: u64,
    /// Entries that became hot.
    pub promotions: u64,
}

/// A compiled descriptor: the pattern and its encoding.
#[derive(Debug)]
pub struct Descriptor {
    /// The pattern.
    pub pattern: Pattern,
    /// Its encoding in the device ABI.
    pub encoded: Vec<u8>,
}

/// What [`DescriptorCache::get`] returns.
#[derive(Clone, Debug)]
pub struct Lookup {
    /// The descriptor.
    pub descriptor: Arc<Descriptor>,
    /// Whether it was in the cache.
    pub hit: bool,
    /// Whether its entry is hot: used at least
    /// [`CacheConfig::promote_after`] times (a frontend may then move it
    /// to faster memory, as TCA/PEACH2 moves hot descriptors into the
    /// NIC's own memory).
    pub hot: bool,
}

struct Entry {
    /// Kept so the type (and its id) outlive the entry.
    _datatype: Committed,
    descriptor: Arc<Descriptor>,
    uses: u64,
    last_use: u64,
    inserted: u64,
    hot: bool,
}

/// Compiled patterns of committed types by `(type id, count)`. Eviction
/// scans the entries (O(capacity)); look-ups are a hash probe. Not
/// synchronized: share it behind a lock.
///
/// ```
/// use pindown_driver::datatype::{CacheConfig, Datatype, DescriptorCache};
///
/// let column = Datatype::vector(4096, 1, 4097, &Datatype::f64())?.commit()?;
/// let mut cache = DescriptorCache::new(CacheConfig::default());
/// let descriptor = cache.get(&column, 1)?.descriptor;
/// assert_eq!(descriptor.pattern.len, 4096 * 8);
/// assert!(cache.get(&column, 1)?.hit);
/// assert_eq!((cache.stats().hits, cache.stats().misses), (1, 1));
/// # Ok::<(), pindown_driver::datatype::DatatypeError>(())
/// ```
pub struct DescriptorCache {
    config: CacheConfig,
    entries: HashMap<(u64, u64), Entry>,
    stats: CacheStats,
    clock: u64,
}

impl DescriptorCache {
    /// An empty cache.
    pub fn new(config: CacheConfig) -> DescriptorCache {
        DescriptorCache {
            config,
            entries: HashMap::with_capacity(config.capacity.min(1 << 16)),
            stats: CacheStats::default(),
            clock: 0,
        }
    }

    /// Its settings.
    pub fn config(&self) -> CacheConfig {
        self.config
    }

    /// Changes the replacement policy (entries stay).
    pub fn set_policy(&mut self, policy: Policy) {
        self.config.policy = policy;
    }

    /// Its counters.
    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether it holds no entry.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Whether `(datatype, count)` is held (no counter changes).
    pub fn contains(&self, datatype: &Committed, count: u64) -> bool {
        self.entries.contains_key(&(datatype.id(), count))
    }

    /// Drops every entry (counters stay).
    pub fn clear(&mut self) {
        self.entries.clear();
    }

    fn is_hot(&self, uses: u64) -> bool {
        self.config.promote_after.is_some_and(|after| uses >= after)
    }

    /// The descriptor of `count` elements of `datatype`: from the cache,
    /// or compiled and kept by the policy.
    pub fn get(&mut self, datatype: &Committed, count: u64) -> Result<Lookup, DatatypeError> {
        self.clock += 1;
        self.stats.lookups += 1;
        let key = (datatype.id(), count);
        let promote_after = self.config.promote_after;
        if let Some(entry) = self.entries.get_mut(&key) {
            self.stats.hits += 1;
            entry.uses += 1;
            entry.last_use = self.clock;
            if !entry.hot && promote_after.is_some_and(|after| entry.uses >= after) {
                entry.hot = true;
                self.stats.promotions += 1;
            }
            return Ok(Lookup {
                descriptor: entry.descriptor.clone(),
                hit: true,
                hot: entry.hot,
            });
        }
        self.stats.misses += 1;
        let pattern = match datatype.pattern(count) {
            Ok(pattern) => pattern,
            Err(error) => {
                self.stats.failures += 1;
                return Err(error);
            }
        };
        let descriptor = Arc::new(Descriptor {
            encoded: pattern.encode(),
            pattern,
        });
        let hot = self.is_hot(1);
        if hot {
            self.stats.promotions += 1;
        }
        let full = self.entries.len() >= self.config.capacity;
        if self.config.capacity == 0 || (full && self.config.policy == Policy::FirstCome) {
            self.stats.bypasses += 1;
            return Ok(Lookup {
                descriptor,
                hit: false,
                hot,
            });
        }
        if full {
            self.evict();
        }
        self.stats.insertions += 1;
        self.entries.insert(
            key,
            Entry {
                _datatype: datatype.clone(),
                descriptor: descriptor.clone(),
                uses: 1,
                last_use: self.clock,
                inserted: self.clock,
                hot,
            },
        );
        Ok(Lookup {
            descriptor,
            hit: false,
            hot,
        })
    }

    /// Gives up one entry chosen by the policy.
    fn evict(&mut self) {
        let victim = match self.config.policy {
            Policy::Lru => self
                .entries
                .iter()
                .min_by_key(|(_, entry)| entry.last_use)
                .map(|(key, _)| *key),
            Policy::Lfu => self
                .entries
                .iter()
                .min_by_key(|(_, entry)| (entry.uses, entry.last_use))
                .map(|(key, _)| *key),
            Policy::Fifo | Policy::FirstCome => self
                .entries
                .iter()
                .min_by_key(|(_, entry)| entry.inserted)
                .map(|(key, _)| *key),
        };
        if let Some(key) = victim {
            self.entries.remove(&key);
            self.stats.evictions += 1;
        }
    }
}
