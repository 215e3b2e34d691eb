//! Reference counts over ranges of an address space.
//!
//! `mlock`, `munlock`, userfaultfd registration and device translation
//! entries do not nest: unlocking a range unlocks it whatever else still
//! needs it. When two cached regions overlap (a merged region next to the
//! in-use regions it replaced, or a request that straddles a region), the
//! layer that calls the kernel must count references per page and act only on
//! the pages whose count goes from zero to one or from one to zero. This type
//! does that counting in O(log n + k) per call, storing runs of equal counts.

use std::collections::BTreeMap;
use std::ops::Range;

/// Disjoint runs `[start, end)` with a reference count of at least one.
#[derive(Debug, Default, Clone)]
pub struct RangeRefCounts {
    runs: BTreeMap<usize, (usize, u64)>,
}

impl RangeRefCounts {
    /// An empty map: every address has count zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one reference to every address in `range`; returns the sub-ranges
    /// that had none before (those that now need the real operation).
    pub fn acquire(&mut self, range: Range<usize>) -> Vec<Range<usize>> {
        let mut fresh = Vec::new();
        if range.is_empty() {
            return fresh;
        }
        self.split_at(range.start);
        self.split_at(range.end);
        let mut cursor = range.start;
        let inside: Vec<usize> = self.runs.range(range.clone()).map(|(s, _)| *s).collect();
        for start in inside {
            if cursor < start {
                fresh.push(cursor..start);
            }
            let run = self.runs.get_mut(&start).expect("run listed above");
            run.1 += 1;
            cursor = run.0;
        }
        if cursor < range.end {
            fresh.push(cursor..range.end);
        }
        for gap in &fresh {
            self.runs.insert(gap.start, (gap.end, 1));
        }
        self.coalesce(range);
        fresh
    }

    /// Drops one reference from every address in `range`; returns the
    /// sub-ranges whose count reached zero. Addresses that had no reference
    /// are left alone (and reported by a debug assertion).
    pub fn release(&mut self, range: Range<usize>) -> Vec<Range<usize>> {
        self.release_inner(range, true)
    }

    /// Like [`release`](Self::release), for ranges that [`clear`](Self::clear)
    /// may have emptied meanwhile: unreferenced addresses are skipped quietly.
    pub fn release_lenient(&mut self, range: Range<usize>) -> Vec<Range<usize>> {
        self.release_inner(range, false)
    }

    /// Drops every reference in `range`; returns whether there was any.
    pub fn clear(&mut self, range: Range<usize>) -> bool {
        if range.is_empty() {
            return false;
        }
        self.split_at(range.start);
        self.split_at(range.end);
        let inside: Vec<usize> = self.runs.range(range).map(|(s, _)| *s).collect();
        for start in &inside {
            self.runs.remove(start);
        }
        !inside.is_empty()
    }

    fn release_inner(&mut self, range: Range<usize>, strict: bool) -> Vec<Range<usize>> {
        let mut freed: Vec<Range<usize>> = Vec::new();
        if range.is_empty() {
            return freed;
        }
        self.split_at(range.start);
        self.split_at(range.end);
        let inside: Vec<usize> = self.runs.range(range.clone()).map(|(s, _)| *s).collect();
        let mut covered = 0;
        for start in inside {
            let (end, count) = self.runs[&start];
            covered += end - start;
            if count == 1 {
                self.runs.remove(&start);
                match freed.last_mut() {
                    Some(last) if last.end == start => last.end = end,
                    _ => freed.push(start..end),
                }
            } else {
                self.runs.insert(start, (end, count - 1));
            }
        }
        debug_assert!(
            !strict || covered == range.len(),
            "release of unreferenced range"
        );
        self.coalesce(range);
        freed
    }

    /// The reference count at `address`.
    pub fn count_at(&self, address: usize) -> u64 {
        match self.runs.range(..=address).next_back() {
            Some((_, &(end, count))) if address < end => count,
            _ => 0,
        }
    }

    /// Whether no address holds a reference.
    pub fn is_empty(&self) -> bool {
        self.runs.is_empty()
    }

    /// The ranges with at least one reference, in order (adjacent runs of
    /// different counts are listed apart).
    pub fn ranges(&self) -> Vec<Range<usize>> {
        self.runs.iter().map(|(&s, &(e, _))| s..e).collect()
    }

    /// Whether any address of `range` holds a reference.
    pub fn overlaps(&self, range: Range<usize>) -> bool {
        !range.is_empty()
            && self
                .runs
                .range(..range.end)
                .next_back()
                .is_some_and(|(_, &(end, _))| end > range.start)
    }

    /// Total length of the ranges with at least one reference.
    pub fn covered_len(&self) -> usize {
        self.runs.iter().map(|(s, (e, _))| e - s).sum()
    }

    /// Makes `at` a run boundary if it falls inside a run.
    fn split_at(&mut self, at: usize) {
        if let Some((&start, &(end, count))) = self.runs.range(..at).next_back() {
            if at < end {
                self.runs.insert(start, (at, count));
                self.runs.insert(at, (end, count));
            }
        }
    }

    /// Joins contiguous runs of equal count from just before `range` to its end.
    fn coalesce(&mut self, range: Range<usize>) {
        let first = self
            .runs
            .range(..range.start)
            .next_back()
            .map(|(s, _)| *s)
            .unwrap_or(range.start);
        let starts: Vec<usize> = self
            .runs
            .range(first..=range.end)
            .map(|(s, _)| *s)
            .collect();
        let mut current: Option<usize> = None;
        for start in starts {
            let (end, count) = self.runs[&start];
            if let Some(prev) = current {
                let (prev_end, prev_count) = self.runs[&prev];
                if prev_end == start && prev_count == count {
                    self.runs.remove(&start);
                    self.runs.insert(prev, (end, count));
                    continue;
                }
            }
            current = Some(start);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn overlapping_acquires_report_only_new_parts() {
        let mut refs = RangeRefCounts::new();
        assert_eq!(refs.acquire(0..8), vec![0..8]);
        assert_eq!(refs.acquire(4..12), vec![8..12]);
        assert_eq!(refs.count_at(5), 2);
        assert_eq!(refs.release(0..8), vec![0..4]);
        assert_eq!(refs.release(4..12), vec![4..12]);
        assert!(refs.is_empty());
    }

    proptest! {
        #[test]
        fn matches_a_per_address_model(ops in prop::collection::vec((0usize..40, 1usize..12, any::<bool>()), 1..60)) {
            let mut refs = RangeRefCounts::new();
            let mut model = [0u64; 64];
            let mut held: Vec<Range<usize>> = Vec::new();
            for (start, len, acquire) in ops {
                if acquire || held.is_empty() {
                    let range = start..start + len;
                    let fresh = refs.acquire(range.clone());
                    for a in range.clone() {
                        let was_zero = model[a] == 0;
                        prop_assert_eq!(was_zero, fresh.iter().any(|r| r.contains(&a)));
                        model[a] += 1;
                    }
                    held.push(range);
                } else {
                    let range = held.swap_remove(start % held.len());
                    let freed = refs.release(range.clone());
                    for a in range.clone() {
                        model[a] -= 1;
                        prop_assert_eq!(model[a] == 0, freed.iter().any(|r| r.contains(&a)));
                    }
                }
                for (a, expected) in model.iter().enumerate() {
                    prop_assert_eq!(refs.count_at(a), *expected);
                }
            }
        }
    }
}
