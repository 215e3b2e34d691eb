//! The lookup index: a radix tree over page numbers, read without locks.
//!
//! Shaped like an x86-64 page table: four levels of 512 slots cover 2^36
//! pages (a 48-bit address space of 4 KiB pages). A slot holds nothing, a
//! child node, or the value (the cache stores a pointer to the region's
//! descriptor) of the one region that covers the slot's whole span, so a
//! lookup is at most four dependent loads whatever the number of regions.
//! Regions in the index never overlap; the cache guarantees that.
//!
//! Readers walk the tree inside an RCU read-side section with acquire loads;
//! the single writer (under the cache lock) stores slots with release order.
//! Nodes are never freed while the index lives, so a reader never follows a
//! dangling pointer; an emptied node stays for the next region in its span.

use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

const BITS: u32 = 9;
const FANOUT: usize = 1 << BITS;
const LEVELS: u32 = 4;
const MASK: usize = FANOUT - 1;

/// Pages the index can address: page numbers are below this.
pub(crate) const PAGE_LIMIT: usize = 1 << (BITS * LEVELS);

const NODE_TAG: u64 = 1;

struct Node {
    slots: [AtomicU64; FANOUT],
}

impl Node {
    fn new_boxed() -> Box<Node> {
        // SAFETY: a Node is an array of AtomicU64, for which all-zero bytes
        // are a valid value (empty slots).
        unsafe { Box::<Node>::new_zeroed().assume_init() }
    }
}

/// Log2 of the pages covered by one slot of a node at `level` (0 is the root).
fn slot_shift(level: u32) -> u32 {
    BITS * (LEVELS - 1 - level)
}

/// The slots of a node at `level` based at page `base` that `[first, end)`
/// touches (shifts, not divisions: this is on every miss).
fn slot_bounds(level: u32, base: usize, first: usize, end: usize) -> (usize, usize, usize) {
    let shift = slot_shift(level);
    let span = 1usize << shift;
    let lo = (first - base) >> shift;
    let hi = ((end - base + span - 1) >> shift).min(FANOUT);
    (lo, hi, span)
}

/// A radix tree from page numbers to region values: non-zero, even `u64`s.
pub(crate) struct RadixIndex {
    /// Inline, one dependent load fewer on every lookup.
    root: Node,
    /// Every node below the root; they live until the index is dropped.
    children: Mutex<Vec<Box<Node>>>,
}

impl RadixIndex {
    pub(crate) fn new() -> Self {
        RadixIndex {
            root: Node {
                slots: [const { AtomicU64::new(0) }; FANOUT],
            },
            children: Mutex::new(Vec::new()),
        }
    }

    /// The value of the region covering `page`, if any. `page` must be below
    /// [`PAGE_LIMIT`].
    #[inline(always)]
    pub(crate) fn lookup(&self, page: usize) -> Option<u64> {
        let mut node: &Node = &self.root;
        let mut shift = BITS * (LEVELS - 1);
        loop {
            let value = node.slots[(page >> shift) & MASK].load(Ordering::Acquire);
            if value & NODE_TAG == 0 {
                return if value == 0 { None } else { Some(value) };
            }
            // SAFETY: a tagged slot holds a pointer to a node owned by
            // `self.children`; nodes are never freed while `self` lives and
            // were fully initialised before the release store published them.
            node = unsafe { &*((value & !NODE_TAG) as *const Node) };
            shift -= BITS;
        }
    }

    /// Maps pages `[first, end)` to `value` (non-zero and even). The range
    /// must not overlap a region already in the index. Only the cache's
    /// writer calls this.
    pub(crate) fn insert(&self, first: usize, end: usize, value: u64) {
        debug_assert!(first < end && end <= PAGE_LIMIT);
        debug_assert!(value != 0 && value & NODE_TAG == 0);
        self.fill(&self.root, 0, 0, first, end, value);
    }

    /// Removes the pages `[first, end)` that `insert` mapped.
    pub(crate) fn remove(&self, first: usize, end: usize) {
        debug_assert!(first < end && end <= PAGE_LIMIT);
        self.fill(&self.root, 0, 0, first, end, 0);
    }

    fn fill(&self, node: &Node, level: u32, base: usize, first: usize, end: usize, code: u64) {
        let (lo, hi, span) = slot_bounds(level, base, first, end);
        for index in lo..hi {
            let slot_start = base + index * span;
            let slot_end = slot_start + span;
            let whole = first <= slot_start && slot_end <= end;
            let current = node.slots[index].load(Ordering::Relaxed);
            if current & NODE_TAG != 0 {
                // SAFETY: see `lookup`; we are the only writer.
                let child = unsafe { &*((current & !NODE_TAG) as *const Node) };
                self.fill(
                    child,
                    level + 1,
                    slot_start,
                    first.max(slot_start),
                    end.min(slot_end),
                    code,
                );
            } else if whole || level == LEVELS - 1 {
                debug_assert!(
                    code == 0 || current == 0,
                    "overlapping regions in the index"
                );
                node.slots[index].store(code, Ordering::Release);
            } else if code != 0 {
                debug_assert_eq!(current, 0, "overlapping regions in the index");
                let child = Node::new_boxed();
                let pointer = &*child as *const Node as u64;
                self.children.lock().push(child);
                self.fill(
                    // SAFETY: the node was just boxed and moved into
                    // `children`, which never drops it while `self` lives.
                    unsafe { &*(pointer as *const Node) },
                    level + 1,
                    slot_start,
                    first.max(slot_start),
                    end.min(slot_end),
                    code,
                );
                node.slots[index].store(pointer | NODE_TAG, Ordering::Release);
            }
        }
    }

    /// The value of the first region found covering a page in `[from, end)`,
    /// scanning upwards and skipping empty subtrees. Writer only.
    pub(crate) fn first_in(&self, from: usize, end: usize) -> Option<u64> {
        if from >= end {
            return None;
        }
        Self::first_in_node(&self.root, 0, 0, from, end.min(PAGE_LIMIT))
    }

    fn first_in_node(node: &Node, level: u32, base: usize, from: usize, end: usize) -> Option<u64> {
        let (lo, hi, span) = slot_bounds(level, base, from, end);
        for index in lo..hi {
            let value = node.slots[index].load(Ordering::Relaxed);
            if value == 0 {
                continue;
            }
            if value & NODE_TAG == 0 {
                return Some(value);
            }
            let slot_start = base + index * span;
            // SAFETY: see `lookup`.
            let child = unsafe { &*((value & !NODE_TAG) as *const Node) };
            let found = Self::first_in_node(
                child,
                level + 1,
                slot_start,
                from.max(slot_start),
                end.min(slot_start + span),
            );
            if found.is_some() {
                return found;
            }
        }
        None
    }

    /// Number of nodes below the root (memory held by the index).
    pub(crate) fn node_count(&self) -> usize {
        self.children.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(id: u64) -> u64 {
        id << 3
    }

    #[test]
    fn lookups_find_the_covering_region_only() {
        let index = RadixIndex::new();
        index.insert(10, 20, v(1));
        index.insert(20, 20 + (1 << 20), v(2));
        index.insert(PAGE_LIMIT - 3, PAGE_LIMIT, v(3));
        assert_eq!(index.lookup(9), None);
        assert_eq!(index.lookup(10), Some(v(1)));
        assert_eq!(index.lookup(19), Some(v(1)));
        assert_eq!(index.lookup(20), Some(v(2)));
        assert_eq!(index.lookup(19 + (1 << 20)), Some(v(2)));
        assert_eq!(index.lookup(20 + (1 << 20)), None);
        assert_eq!(index.lookup(PAGE_LIMIT - 1), Some(v(3)));
        index.remove(20, 20 + (1 << 20));
        assert_eq!(index.lookup(5000), None);
        assert_eq!(index.lookup(10), Some(v(1)));
        assert_eq!(index.first_in(0, 10), None);
        assert_eq!(index.first_in(0, 11), Some(v(1)));
        assert_eq!(index.first_in(20, PAGE_LIMIT), Some(v(3)));
    }

    #[test]
    fn a_region_reinserted_over_emptied_nodes_is_found_everywhere() {
        let index = RadixIndex::new();
        index.insert(3, 4, v(7));
        index.remove(3, 4);
        index.insert(0, 1 << 18, v(8));
        for page in [0, 3, 511, 512, (1 << 18) - 1] {
            assert_eq!(index.lookup(page), Some(v(8)), "page {page}");
        }
        assert_eq!(index.lookup(1 << 18), None);
    }
}
