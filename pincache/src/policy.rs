//! Replacement policies and the eviction order.
//!
//! Hits never touch the eviction order (that would be a shared write on every
//! hit); they only raise their own slot's use mark (see `table`). The writer
//! keeps the regions ordered by the key it last *knew* and corrects it lazily:
//! it takes the smallest known key, reads the region's real key, and if the
//! region was used since (real key larger, as keys only grow), puts it back
//! under the real key and looks again. The first region whose known key is
//! still its real key has the smallest real key of all, so the order evicted
//! is exactly the policy's, at O(log n) per correction.

use std::collections::BTreeSet;
use std::fmt;
use std::str::FromStr;

/// Which idle region a miss evicts first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Policy {
    /// Least recently used (PM's choice).
    #[default]
    Lru,
    /// Least frequently used; ties go to the oldest region.
    Lfu,
    /// First come, first evicted, whatever the use since.
    Fifo,
}

impl Policy {
    /// All policies, in the order benchmarks report them.
    pub const ALL: [Policy; 3] = [Policy::Lru, Policy::Lfu, Policy::Fifo];

    pub(crate) fn to_u8(self) -> u8 {
        match self {
            Policy::Lru => 0,
            Policy::Lfu => 1,
            Policy::Fifo => 2,
        }
    }

    pub(crate) fn from_u8(value: u8) -> Policy {
        match value {
            1 => Policy::Lfu,
            2 => Policy::Fifo,
            _ => Policy::Lru,
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Policy::Lru => "lru",
            Policy::Lfu => "lfu",
            Policy::Fifo => "fifo",
        })
    }
}

/// An unknown policy name.
#[derive(Debug, thiserror::Error)]
#[error("unknown replacement policy {0:?}: expected lru, lfu or fifo")]
pub struct UnknownPolicy(pub String);

impl FromStr for Policy {
    type Err = UnknownPolicy;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        match name.to_ascii_lowercase().as_str() {
            "lru" => Ok(Policy::Lru),
            "lfu" => Ok(Policy::Lfu),
            "fifo" | "fcfs" => Ok(Policy::Fifo),
            _ => Err(UnknownPolicy(name.to_owned())),
        }
    }
}

/// Position of a region in the eviction order: key, then age.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Rank {
    pub key: u64,
    pub age: u64,
    pub id: u32,
}

/// The writer's view of the eviction order of the regions in the index.
///
/// Newly pinned regions are only appended to a list; they join the ordered
/// set when an eviction needs the order, so a miss that evicts nothing pays
/// no ordered insertion.
#[derive(Default)]
pub(crate) struct EvictionOrder {
    order: BTreeSet<Rank>,
    /// Regions inserted since the last eviction, not yet in `order`.
    fresh: Vec<u32>,
    /// Known rank by region id, and whether it is in `order` (else in `fresh`).
    known: Vec<Option<(Rank, bool)>>,
    len: usize,
}

impl EvictionOrder {
    /// Adds a region (or moves it to a new rank).
    pub(crate) fn insert(&mut self, rank: Rank) {
        self.remove(rank.id);
        let index = rank.id as usize;
        if self.known.len() <= index {
            self.known.resize(index + 1, None);
        }
        self.known[index] = Some((rank, false));
        self.fresh.push(rank.id);
        self.len += 1;
        if self.fresh.len() > 2 * self.len + 64 {
            // Mostly ranks of regions gone since: drop them.
            self.settle();
        }
    }

    /// Takes a region out of the order; returns its rank.
    pub(crate) fn remove(&mut self, id: u32) -> Option<Rank> {
        let (rank, in_order) = self.known.get_mut(id as usize)?.take()?;
        if in_order {
            self.order.remove(&rank);
        }
        self.len -= 1;
        Some(rank)
    }

    /// Moves the fresh regions still waiting into the ordered set.
    fn settle(&mut self) {
        let mut fresh = std::mem::take(&mut self.fresh);
        for &id in &fresh {
            if let Some((rank, in_order @ false)) = &mut self.known[id as usize] {
                *in_order = true;
                self.order.insert(*rank);
            }
        }
        fresh.clear();
        self.fresh = fresh;
    }

    /// Sizes the order for `regions` regions up front, so that misses do
    /// not grow (and fault in) its memory.
    pub(crate) fn with_capacity(regions: usize) -> Self {
        let mut fresh = vec![0u32; regions];
        fresh.clear();
        EvictionOrder {
            order: BTreeSet::new(),
            fresh,
            known: vec![None; regions],
            len: 0,
        }
    }

    /// Removes and returns the region with the smallest real key, given the
    /// real key of any region. Returns `None` when the order is empty.
    pub(crate) fn pop_first(&mut self, mut real_key: impl FnMut(u32) -> u64) -> Option<Rank> {
        self.settle();
        loop {
            let first = self.order.pop_first()?;
            let real = real_key(first.id);
            if real > first.key {
                let corrected = Rank { key: real, ..first };
                self.known[first.id as usize] = Some((corrected, true));
                self.order.insert(corrected);
                continue;
            }
            self.known[first.id as usize] = None;
            self.len -= 1;
            return Some(first);
        }
    }

    /// Re-keys every region, for a change of policy.
    pub(crate) fn rekey(&mut self, mut key: impl FnMut(Rank) -> u64) {
        self.settle();
        let ranks: Vec<Rank> = std::mem::take(&mut self.order).into_iter().collect();
        for rank in ranks {
            let rekeyed = Rank {
                key: key(rank),
                ..rank
            };
            self.known[rank.id as usize] = Some((rekeyed, true));
            self.order.insert(rekeyed);
        }
    }

    /// The ids of the regions in the order (fresh or ordered), in no
    /// particular order.
    pub(crate) fn ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.known.iter().filter_map(|k| k.map(|(rank, _)| rank.id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lazy_correction_yields_the_true_minimum() {
        let mut order = EvictionOrder::default();
        for id in 0..4 {
            order.insert(Rank {
                key: 10,
                age: u64::from(id),
                id,
            });
        }
        // Regions 0 and 1 were used since they were ranked.
        let real = |id: u32| if id < 2 { 50 + u64::from(id) } else { 10 };
        assert_eq!(order.pop_first(real).map(|r| r.id), Some(2));
        assert_eq!(order.pop_first(real).map(|r| r.id), Some(3));
        assert_eq!(order.pop_first(real).map(|r| r.id), Some(0));
        assert_eq!(order.pop_first(real).map(|r| r.id), Some(1));
        assert_eq!(order.pop_first(real), None);
    }

    #[test]
    fn policies_parse_by_name() {
        for policy in Policy::ALL {
            assert_eq!(policy.to_string().parse::<Policy>().unwrap(), policy);
        }
        assert!("random".parse::<Policy>().is_err());
    }
}
