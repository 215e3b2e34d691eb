//! # pincache: a pin-down cache for userspace drivers
//!
//! Zero-copy transfers need the memory they touch pinned (resident, and known
//! to the device), and pinning is slow: a system call, page walks, a device
//! translation entry. The pin-down cache of PM (Tezuka et al.) keeps pinned
//! regions after use and unpins lazily, only when a limit forces it: the
//! process's locked-memory limit, or the device's translation-table entries.
//!
//! ```
//! use pindown_pincache::{CacheConfig, MlockPinner, PinCache};
//!
//! let cache = PinCache::new(MlockPinner::new(), CacheConfig::default())?;
//! let buffer = vec![0u8; 64 * 1024];
//! {
//!     let registration = cache.pin(buffer.as_ptr() as usize, buffer.len())?; // miss: mlock
//!     assert!(registration.region().contains(buffer.as_ptr() as usize, buffer.len()));
//! } // released: still pinned, now idle
//! let _again = cache.pin(buffer.as_ptr() as usize, 4096)?; // hit: no system call
//! assert_eq!(cache.stats().hits, 1);
//! # drop(_again);
//! cache.invalidate(buffer.as_ptr() as usize, buffer.len()); // before freeing
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! * A [`Pinner`] does the pinning ([`MlockPinner`] on the host; a driver
//!   supplies ones that also install device translations). The cache decides
//!   when to call it.
//! * A hit takes no lock and makes no system call, and writes only cache lines
//!   of its own thread: see [`cache`](crate::PinCache) for the protocol.
//! * Limits in bytes and entries; regions in use are never evicted; when
//!   nothing idle is left, `pin` fails with [`CacheError::LimitReached`]
//!   naming the limit.
//! * Policies [`Policy::Lru`], [`Policy::Lfu`], [`Policy::Fifo`], switchable
//!   at run time.
//! * Overlapping and adjacent regions merge into one pin, up to a bound.
//! * Invalidation: explicit ([`PinCache::invalidate`]), through the hook
//!   ([`unmap`]), or automatic through the userfaultfd monitor
//!   ([`CacheConfig::monitor`]).
//! * [`WriteFence`]: holds writers off a range while a driver replaces its
//!   mapping (moving private pages into memory shared with a device).

#![warn(missing_docs)]

mod cache;
mod config;
mod fence;
mod index;
mod mlock;
pub mod monitor;
mod page_refs;
mod pinner;
mod policy;
mod rcu;
mod stats;
mod table;
mod uffd;

pub use cache::{page_size, PinCache, Registration};
pub use config::{CacheConfig, CacheError, Limit, Monitor};
pub use fence::WriteFence;
pub use mlock::{locked_bytes, memlock_limit, raise_memlock_limit, MlockPinner};
pub use monitor::{madvise_dontneed, unmap, MemoryMonitor};
pub use page_refs::RangeRefCounts;
pub use pinner::{NoopPinner, PageRange, PinError, Pinner};
pub use policy::{Policy, UnknownPolicy};
pub use stats::CacheStats;
