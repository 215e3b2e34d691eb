//! What a cache reports about itself.

/// A snapshot of a cache's counters. Hits are counted per thread without
/// shared writes, so keeping statistics on costs the hit path nothing
/// measurable.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Requests served by a region already pinned.
    pub hits: u64,
    /// Requests that pinned a new region.
    pub misses: u64,
    /// Idle regions unpinned to make room.
    pub evictions: u64,
    /// Regions dropped because their memory went away (or was said to).
    pub invalidations: u64,
    /// Cached regions absorbed into a larger merged region.
    pub merges: u64,
    /// Regions the unmap monitor could not watch (see
    /// [`Monitor`](crate::Monitor)): pinned for their request, never
    /// cached.
    pub unwatched: u64,
    /// Bytes pinned now, counting every pinned region in full.
    pub pinned_bytes: usize,
    /// Regions pinned now (indexed and retired).
    pub pinned_entries: usize,
    /// Pinned regions out of the index, waiting for their last release.
    pub retired_entries: usize,
    /// The byte limit.
    pub max_pinned_bytes: usize,
    /// The entry limit.
    pub max_entries: usize,
    /// Radix-index nodes allocated (4 KiB each).
    pub index_nodes: usize,
}

impl CacheStats {
    /// Hits over all requests; 0 before any request.
    pub fn hit_rate(&self) -> f64 {
        let total = self.hits + self.misses;
        if total == 0 {
            0.0
        } else {
            self.hits as f64 / total as f64
        }
    }
}
