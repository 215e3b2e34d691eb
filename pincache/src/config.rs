//! Cache configuration, limits and errors.

use crate::pinner::PinError;
use crate::policy::Policy;

/// How a [`PinCache`](crate::PinCache) is sized and behaves.
#[derive(Clone, Debug)]
pub struct CacheConfig {
    /// Most bytes pinned at once. `None`: the process's soft RLIMIT_MEMLOCK.
    /// Regions count in full even where they overlap, the safe direction.
    pub max_pinned_bytes: Option<usize>,
    /// Most regions pinned at once: the device's translation-table size
    /// (PM's Myrinet interface had 1024 entries).
    pub max_entries: usize,
    /// Replacement policy; can be changed later with
    /// [`PinCache::set_policy`](crate::PinCache::set_policy).
    pub policy: Policy,
    /// Merge a missing request with the cached regions it overlaps or
    /// touches into one pin, saving translation entries.
    pub merge: bool,
    /// Largest region a merge may build. `None`: a quarter of the pinned-byte
    /// limit. A request larger than this is pinned as it is, never merged.
    pub max_merged_bytes: Option<usize>,
    /// Whether pinned ranges are watched by the process-wide userfaultfd
    /// monitor, so that an `munmap`, `mremap` or `madvise(MADV_DONTNEED)`
    /// the program does not route through [`crate::unmap`] still
    /// invalidates them.
    pub monitor: Monitor,
}

/// Whether a cache watches its pinned ranges for unmaps
/// ([`CacheConfig::monitor`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Monitor {
    /// Not watched: the program invalidates (or routes its unmaps through
    /// [`crate::unmap`]) before memory goes.
    #[default]
    Off,
    /// Watched where userfaultfd allows it; elsewhere the cache is made
    /// unwatched and says so ([`PinCache::monitored`](crate::PinCache::monitored);
    /// [`MemoryMonitor::global`](crate::MemoryMonitor::global) tells why).
    WhereAvailable,
    /// Watched, or the cache is not made
    /// ([`CacheError::InvalidConfig`] naming why).
    Required,
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            max_pinned_bytes: None,
            max_entries: 1024,
            policy: Policy::Lru,
            merge: true,
            max_merged_bytes: None,
            monitor: Monitor::Off,
        }
    }
}

/// Which limit stopped a pin.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Limit {
    /// `max_pinned_bytes`.
    PinnedBytes,
    /// `max_entries`.
    Entries,
}

impl std::fmt::Display for Limit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Limit::PinnedBytes => "max_pinned_bytes",
            Limit::Entries => "max_entries",
        })
    }
}

/// Why the cache could not hand out a registration.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// A zero-length request.
    #[error("cannot pin an empty range at {addr:#x}")]
    EmptyRange {
        /// The requested address.
        addr: usize,
    },
    /// A request outside the addresses the cache can index.
    #[error("cannot pin [{addr:#x}, +{len}): the cache indexes addresses below {limit:#x}")]
    OutOfRange {
        /// The requested address.
        addr: usize,
        /// The requested length.
        len: usize,
        /// First address the cache cannot index.
        limit: usize,
    },
    /// A request larger than the pinned-byte limit itself.
    #[error("cannot pin {bytes} bytes: more than max_pinned_bytes ({max}) allows")]
    TooLarge {
        /// Page-rounded size of the request.
        bytes: usize,
        /// The configured limit.
        max: usize,
    },
    /// A limit is reached and every pinned region is in use.
    #[error(
        "{limit} reached: pinning {bytes} more bytes needs room, but {in_use} of the \
         {entries} pinned regions ({pinned_bytes} bytes) are in use and nothing idle is left to \
         evict (max_pinned_bytes {max_bytes}, max_entries {max_entries}); release registrations \
         or raise the limit"
    )]
    LimitReached {
        /// The limit that stopped the pin.
        limit: Limit,
        /// Page-rounded size that was to be pinned.
        bytes: usize,
        /// Bytes pinned now.
        pinned_bytes: usize,
        /// Regions pinned now.
        entries: usize,
        /// Regions pinned now that are in use.
        in_use: usize,
        /// The byte limit.
        max_bytes: usize,
        /// The entry limit.
        max_entries: usize,
    },
    /// The configuration cannot work.
    #[error("invalid cache configuration: {0}")]
    InvalidConfig(String),
    /// The pinner failed.
    #[error(transparent)]
    Pin(#[from] PinError),
}
