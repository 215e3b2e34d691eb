//! The cost of one `munmap` of a one-page mapping, plain or with the
//! invalidation of a cached region, for the criterion group `unmap` and for
//! `pin-cost`.
//!
//! Each repetition maps one page, faults it in, prepares it as its
//! [`UnmapCase`] says (untimed) and then times the unmapping alone. The time
//! of one unmapping includes the cost of reading the clock once.

use std::io;
use std::time::{Duration, Instant};

use pindown_pincache::{page_size, CacheConfig, MlockPinner, Monitor, PinCache};

use crate::sys::{self, Mapping};

/// What is unmapped, and how.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnmapCase {
    /// `munmap` of a plain mapping.
    Munmap,
    /// `munmap` of an mlocked mapping.
    MunmapMlocked,
    /// `pindown_pincache::unmap` (the in-process hook) of a region that a
    /// `PinCache<MlockPinner>` holds idle.
    PincacheUnmap,
    /// As [`UnmapCase::PincacheUnmap`], with a cache created with
    /// `Monitor::Required` (the userfaultfd monitor running).
    PincacheUnmapMonitored,
    /// A plain `munmap` of a region that a monitored cache holds idle: the
    /// userfaultfd monitor catches it.
    MunmapCaughtByMonitor,
}

impl UnmapCase {
    /// Every case, plain `munmap` first.
    pub const ALL: [UnmapCase; 5] = [
        UnmapCase::Munmap,
        UnmapCase::MunmapMlocked,
        UnmapCase::PincacheUnmap,
        UnmapCase::PincacheUnmapMonitored,
        UnmapCase::MunmapCaughtByMonitor,
    ];

    /// Name of the case, as in the criterion group and the JSON.
    pub fn name(self) -> &'static str {
        match self {
            UnmapCase::Munmap => "munmap",
            UnmapCase::MunmapMlocked => "munmap_mlocked",
            UnmapCase::PincacheUnmap => "pincache_unmap",
            UnmapCase::PincacheUnmapMonitored => "pincache_unmap_monitored",
            UnmapCase::MunmapCaughtByMonitor => "munmap_caught_by_monitor",
        }
    }

    /// Whether the case needs the userfaultfd monitor.
    pub fn monitored(self) -> bool {
        matches!(
            self,
            UnmapCase::PincacheUnmapMonitored | UnmapCase::MunmapCaughtByMonitor
        )
    }

    /// Whether the case unmaps through the `pindown_pincache::unmap` hook.
    fn through_hook(self) -> bool {
        matches!(
            self,
            UnmapCase::PincacheUnmap | UnmapCase::PincacheUnmapMonitored
        )
    }

    /// Whether the case unmaps a region held by a cache.
    fn cached(self) -> bool {
        matches!(
            self,
            UnmapCase::PincacheUnmap
                | UnmapCase::PincacheUnmapMonitored
                | UnmapCase::MunmapCaughtByMonitor
        )
    }
}

/// One case, ready to be timed: holds the cache the case needs, if any.
pub struct UnmapRun {
    case: UnmapCase,
    cache: Option<PinCache<MlockPinner>>,
}

impl UnmapRun {
    /// Prepares `case`; a cache it needs may pin at most `max_pinned_bytes`.
    /// Fails if that cache cannot be created, for instance because the
    /// userfaultfd monitor cannot start.
    pub fn new(
        case: UnmapCase,
        max_pinned_bytes: usize,
    ) -> Result<Self, pindown_pincache::CacheError> {
        let cache = if case.cached() {
            let config = CacheConfig {
                max_pinned_bytes: Some(max_pinned_bytes),
                monitor: if case.monitored() {
                    Monitor::Required
                } else {
                    Monitor::Off
                },
                ..CacheConfig::default()
            };
            Some(PinCache::new(MlockPinner::new(), config)?)
        } else {
            None
        };
        Ok(Self { case, cache })
    }

    /// The case this run times.
    pub fn case(&self) -> UnmapCase {
        self.case
    }

    /// Times `iters` unmappings, handing each one's time to `record`.
    pub fn time(&self, iters: u64, mut record: impl FnMut(Duration)) -> io::Result<()> {
        for _ in 0..iters {
            let mapping = Mapping::new(page_size())?;
            self.prepare(&mapping)?;
            let (addr, len) = mapping.into_raw();
            let start = Instant::now();
            if self.case.through_hook() {
                hook_unmap(addr, len)?;
            } else {
                plain_munmap(addr, len)?;
            }
            record(start.elapsed());
        }
        Ok(())
    }

    /// Times `iters` unmappings; returns their summed time.
    pub fn total(&self, iters: u64) -> io::Result<Duration> {
        let mut total = Duration::ZERO;
        self.time(iters, |d| total += d)?;
        Ok(total)
    }

    /// Locks the mapping, or has the cache pin and release it (leaving it
    /// idle in the cache), as the case says.
    fn prepare(&self, mapping: &Mapping) -> io::Result<()> {
        let (addr, len) = (mapping.addr(), mapping.len());
        match &self.cache {
            Some(cache) => {
                drop(cache.pin(addr, len).map_err(io::Error::other)?);
                Ok(())
            }
            None if self.case == UnmapCase::MunmapMlocked => sys::mlock(addr, len),
            None => Ok(()),
        }
    }

    /// Checks that every region this run left in its cache was invalidated
    /// by the unmapping (not evicted, not left behind); the error says what
    /// was found. The monitor applies events on its own thread, so this
    /// waits up to a second for it.
    pub fn check_invalidated(&self) -> Result<(), String> {
        let Some(cache) = &self.cache else {
            return Ok(());
        };
        let deadline = Instant::now() + Duration::from_secs(1);
        while cache.stats().pinned_entries != 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        let stats = cache.stats();
        if stats.pinned_entries != 0 || stats.evictions != 0 {
            return Err(format!(
                "unmapped regions were not all invalidated: {} still pinned, {} evicted",
                stats.pinned_entries, stats.evictions
            ));
        }
        Ok(())
    }
}

/// `munmap` of a mapping given up with [`Mapping::into_raw`].
fn plain_munmap(addr: usize, len: usize) -> io::Result<()> {
    // SAFETY: the mapping was just made by `UnmapRun::time` and given up with
    // `into_raw`; nothing refers to it any more.
    unsafe { sys::munmap(addr, len) }
}

/// `pindown_pincache::unmap` of a mapping given up with [`Mapping::into_raw`].
fn hook_unmap(addr: usize, len: usize) -> io::Result<()> {
    // SAFETY: as for `plain_munmap`; the cache's regions there are dropped
    // by the hook before the pages go.
    unsafe { pindown_pincache::unmap(addr as *mut u8, len) }
}
