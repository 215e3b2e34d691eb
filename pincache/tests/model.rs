//! Model-based randomized tests: the cache against a plain reference model.
//!
//! Without merging, the model predicts every outcome exactly (hit or miss,
//! which regions are evicted, which error); with merging, the invariants are
//! checked after every step: limits hold, held regions stay pinned, every
//! registration contains its request, no region pinned before an
//! invalidation of its range is handed out after it, and pins and unpins
//! balance when the cache is dropped.

mod common;

use std::sync::Arc;

use common::TrackingPinner;
use parking_lot::Mutex;
use pindown_pincache::{CacheConfig, CacheError, Limit, PageRange, PinCache, Policy, Registration};
use proptest::prelude::*;

const PAGE: usize = 4096;
const BASE: usize = 0x10_0000_0000;

#[derive(Clone, Debug)]
enum Op {
    Pin { offset: usize, len: usize },
    Release { which: usize },
    Invalidate { offset: usize, len: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (0..48 * PAGE, 0..5 * PAGE).prop_map(|(offset, len)| Op::Pin { offset, len }),
        4 => any::<usize>().prop_map(|which| Op::Release { which }),
        1 => (0..48 * PAGE, 1..8 * PAGE).prop_map(|(offset, len)| Op::Invalidate { offset, len }),
    ]
}

#[derive(Clone, Debug)]
struct ModelRegion {
    id: u64,
    range: PageRange,
    holds: usize,
    /// LRU: last use; LFU: uses; FIFO: insertion.
    key: u64,
    age: u64,
}

/// The reference: a list of regions, searched and evicted by brute force.
#[derive(Default)]
struct Model {
    indexed: Vec<ModelRegion>,
    retired: Vec<ModelRegion>,
    clock: u64,
    next_id: u64,
    evictions: u64,
}

enum Outcome {
    Hit(u64),
    Miss(u64),
    Error(Limit),
    TooLarge,
    Empty,
}

impl Model {
    fn pinned(&self) -> (usize, usize) {
        let all = self.indexed.iter().chain(&self.retired);
        (all.clone().map(|r| r.range.len).sum(), all.count())
    }

    fn touch(&mut self, policy: Policy, position: usize) {
        self.clock += 1;
        let region = &mut self.indexed[position];
        match policy {
            Policy::Lru => region.key = self.clock,
            Policy::Lfu => region.key += 1,
            Policy::Fifo => {}
        }
    }

    fn pin(
        &mut self,
        policy: Policy,
        max_bytes: usize,
        max_entries: usize,
        addr: usize,
        len: usize,
    ) -> Outcome {
        if len == 0 {
            return Outcome::Empty;
        }
        if let Some(position) = self
            .indexed
            .iter()
            .position(|r| r.range.contains(addr, len))
        {
            self.touch(policy, position);
            self.indexed[position].holds += 1;
            return Outcome::Hit(self.indexed[position].id);
        }
        let first = addr / PAGE * PAGE;
        let last = (addr + len).div_ceil(PAGE) * PAGE;
        let range = PageRange {
            start: first,
            len: last - first,
        };
        if range.len > max_bytes {
            return Outcome::TooLarge;
        }
        let overlaps = |r: &ModelRegion| r.range.start < last && first < r.range.end();
        let credit: Vec<&ModelRegion> = self
            .indexed
            .iter()
            .filter(|r| overlaps(r) && r.holds == 0)
            .collect();
        let credit_bytes: usize = credit.iter().map(|r| r.range.len).sum();
        let credit_entries = credit.len();
        let fits = |model: &Model| {
            let (bytes, entries) = model.pinned();
            bytes - credit_bytes + range.len <= max_bytes && entries - credit_entries < max_entries
        };
        while !fits(self) {
            let victim = self
                .indexed
                .iter()
                .enumerate()
                .filter(|(_, r)| r.holds == 0 && !overlaps(r))
                .min_by_key(|(_, r)| (r.key, r.age))
                .map(|(position, _)| position);
            match victim {
                Some(position) => {
                    self.indexed.remove(position);
                    self.evictions += 1;
                }
                None => {
                    let (bytes, _) = self.pinned();
                    return Outcome::Error(if bytes - credit_bytes + range.len > max_bytes {
                        Limit::PinnedBytes
                    } else {
                        Limit::Entries
                    });
                }
            }
        }
        let (replaced, kept): (Vec<_>, Vec<_>) = self.indexed.drain(..).partition(|r| overlaps(r));
        self.indexed = kept;
        self.retired
            .extend(replaced.into_iter().filter(|r| r.holds > 0));
        self.clock += 1;
        self.next_id += 1;
        self.indexed.push(ModelRegion {
            id: self.next_id,
            range,
            holds: 1,
            key: match policy {
                Policy::Lru => self.clock,
                Policy::Lfu => 1,
                Policy::Fifo => self.clock,
            },
            age: self.clock,
        });
        Outcome::Miss(self.next_id)
    }

    fn release(&mut self, id: u64) {
        if let Some(region) = self.indexed.iter_mut().find(|r| r.id == id) {
            region.holds -= 1;
        } else {
            let position = self
                .retired
                .iter()
                .position(|r| r.id == id)
                .expect("held region exists");
            self.retired[position].holds -= 1;
            if self.retired[position].holds == 0 {
                self.retired.remove(position);
            }
        }
    }

    fn invalidate(&mut self, addr: usize, len: usize) {
        let first = addr / PAGE * PAGE;
        let last = (addr + len).div_ceil(PAGE) * PAGE;
        let (gone, kept): (Vec<_>, Vec<_>) = self
            .indexed
            .drain(..)
            .partition(|r| r.range.start < last && first < r.range.end());
        self.indexed = kept;
        self.retired
            .extend(gone.into_iter().filter(|r| r.holds > 0));
    }
}

/// A cache over a fresh tracking pinner, and the pinner's log.
fn tracked_cache(config: CacheConfig) -> (PinCache<TrackingPinner>, Arc<Mutex<common::PinLog>>) {
    let pinner = TrackingPinner::default();
    let log = pinner.log.clone();
    (PinCache::new(pinner, config).unwrap(), log)
}

fn sorted_ranges(mut ranges: Vec<PageRange>) -> Vec<PageRange> {
    ranges.sort();
    ranges
}

fn run_exact(
    policy: Policy,
    max_pages: usize,
    max_entries: usize,
    ops: Vec<Op>,
) -> Result<(), TestCaseError> {
    let max_bytes = max_pages * PAGE;
    let (cache, log) = tracked_cache(CacheConfig {
        max_pinned_bytes: Some(max_bytes),
        max_entries,
        policy,
        merge: false,
        ..CacheConfig::default()
    });
    let mut model = Model::default();
    let mut held: Vec<(Registration<'_, TrackingPinner>, u64)> = Vec::new();
    // Model id -> cache token (serial), learnt on misses.
    let mut serial_of: std::collections::HashMap<u64, u64> = Default::default();
    for op in ops {
        match op {
            Op::Pin { offset, len } => {
                let addr = BASE + offset;
                let expected = model.pin(policy, max_bytes, max_entries, addr, len);
                let got = cache.pin(addr, len);
                match (expected, got) {
                    (Outcome::Hit(id), Ok(registration)) => {
                        prop_assert_eq!(
                            Some(registration.token()),
                            serial_of.get(&id),
                            "hit on the wrong region"
                        );
                        held.push((registration, id));
                    }
                    (Outcome::Miss(id), Ok(registration)) => {
                        prop_assert!(
                            !serial_of.values().any(|s| s == registration.token()),
                            "expected a miss"
                        );
                        prop_assert!(registration.region().contains(addr, len));
                        serial_of.insert(id, *registration.token());
                        held.push((registration, id));
                    }
                    (Outcome::Error(limit), Err(CacheError::LimitReached { limit: got, .. })) => {
                        prop_assert_eq!(limit, got)
                    }
                    (Outcome::TooLarge, Err(CacheError::TooLarge { .. })) => {}
                    (Outcome::Empty, Err(CacheError::EmptyRange { .. })) => {}
                    (_, got) => prop_assert!(
                        false,
                        "model and cache disagree: cache said {:?}",
                        got.map(|r| r.region())
                    ),
                }
            }
            Op::Release { which } => {
                if !held.is_empty() {
                    let (registration, id) = held.swap_remove(which % held.len());
                    drop(registration);
                    model.release(id);
                }
            }
            Op::Invalidate { offset, len } => {
                cache.invalidate(BASE + offset, len);
                model.invalidate(BASE + offset, len);
            }
        }
        let stats = cache.stats();
        let (bytes, entries) = model.pinned();
        prop_assert_eq!(stats.pinned_bytes, bytes);
        prop_assert_eq!(stats.pinned_entries, entries);
        prop_assert_eq!(stats.evictions, model.evictions);
        let expected: Vec<PageRange> = model
            .indexed
            .iter()
            .chain(&model.retired)
            .map(|r| r.range)
            .collect();
        let pinned: Vec<PageRange> = log.lock().pinned.iter().map(|(r, _)| *r).collect();
        prop_assert_eq!(sorted_ranges(pinned), sorted_ranges(expected));
    }
    drop(held);
    drop(cache);
    let log = log.lock();
    prop_assert_eq!(log.pins, log.unpins);
    prop_assert!(log.pinned.is_empty());
    Ok(())
}

fn run_invariants(
    policy: Policy,
    max_pages: usize,
    max_entries: usize,
    merged_pages: usize,
    ops: Vec<Op>,
) -> Result<(), TestCaseError> {
    let max_bytes = max_pages * PAGE;
    let (cache, log) = tracked_cache(CacheConfig {
        max_pinned_bytes: Some(max_bytes),
        max_entries,
        policy,
        merge: true,
        max_merged_bytes: Some(merged_pages * PAGE),
        ..CacheConfig::default()
    });
    let mut held: Vec<Registration<'_, TrackingPinner>> = Vec::new();
    // (invalidated range, last serial handed out before the invalidation)
    let mut invalidated: Vec<(usize, usize, u64)> = Vec::new();
    // Regions grow by merging only up to the bound, or to fit one request.
    let mut largest_request = 0;
    for op in ops {
        match op {
            Op::Pin { offset, len } => match cache.pin(BASE + offset, len) {
                Ok(registration) => {
                    let region = registration.region();
                    prop_assert!(region.contains(BASE + offset, len));
                    let rounded =
                        (BASE + offset + len).div_ceil(PAGE) * PAGE - (BASE + offset) / PAGE * PAGE;
                    largest_request = largest_request.max(rounded);
                    prop_assert!(region.len <= (merged_pages * PAGE).max(largest_request));
                    for &(start, end, serial) in &invalidated {
                        if region.start < end && start < region.end() {
                            prop_assert!(
                                *registration.token() > serial,
                                "stale region {} after invalidation",
                                region
                            );
                        }
                    }
                    held.push(registration);
                }
                Err(CacheError::LimitReached { .. }) => {
                    // Legitimate only when every idle region left is one the
                    // request would have replaced (overlapping it).
                    let first = (BASE + offset) / PAGE * PAGE;
                    let last = (BASE + offset + len).div_ceil(PAGE) * PAGE;
                    for &(range, serial) in &log.lock().pinned {
                        let is_held = held.iter().any(|r| *r.token() == serial);
                        let overlaps = range.start < last && first < range.end();
                        prop_assert!(
                            is_held || overlaps,
                            "limit reported while {} is idle",
                            range
                        );
                    }
                }
                Err(CacheError::TooLarge { .. }) => {
                    prop_assert!(len.div_ceil(PAGE) * PAGE + PAGE > max_bytes)
                }
                Err(CacheError::EmptyRange { .. }) => prop_assert_eq!(len, 0),
                Err(other) => prop_assert!(false, "unexpected error {}", other),
            },
            Op::Release { which } => {
                if !held.is_empty() {
                    drop(held.swap_remove(which % held.len()));
                }
            }
            Op::Invalidate { offset, len } => {
                cache.invalidate(BASE + offset, len);
                let first = (BASE + offset) / PAGE * PAGE;
                let last = (BASE + offset + len).div_ceil(PAGE) * PAGE;
                invalidated.push((first, last, log.lock().next_serial));
            }
        }
        let log = log.lock();
        let pinned_bytes: usize = log.pinned.iter().map(|(r, _)| r.len).sum();
        prop_assert!(pinned_bytes <= max_bytes, "byte limit exceeded");
        prop_assert!(log.pinned.len() <= max_entries, "entry limit exceeded");
        let stats = cache.stats();
        prop_assert_eq!(stats.pinned_bytes, pinned_bytes);
        prop_assert_eq!(stats.pinned_entries, log.pinned.len());
        for registration in &held {
            let serial = *registration.token();
            prop_assert!(
                log.pinned
                    .iter()
                    .any(|&(r, s)| s == serial && r == registration.region()),
                "held region {} was unpinned",
                registration.region()
            );
        }
    }
    drop(held);
    drop(cache);
    let log = log.lock();
    prop_assert_eq!(log.pins, log.unpins);
    prop_assert!(log.pinned.is_empty());
    Ok(())
}

fn policy() -> impl Strategy<Value = Policy> {
    prop_oneof![Just(Policy::Lru), Just(Policy::Lfu), Just(Policy::Fifo)]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn without_merging_the_cache_behaves_exactly_like_the_model(
        policy in policy(),
        max_pages in 4usize..24,
        max_entries in 1usize..8,
        ops in prop::collection::vec(op(), 1..120),
    ) {
        run_exact(policy, max_pages, max_entries, ops)?;
    }

    #[test]
    fn with_merging_the_invariants_hold(
        policy in policy(),
        max_pages in 4usize..32,
        max_entries in 1usize..8,
        merged_pages in 1usize..16,
        ops in prop::collection::vec(op(), 1..120),
    ) {
        run_invariants(policy, max_pages, max_entries, merged_pages, ops)?;
    }
}
