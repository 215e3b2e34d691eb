//! Replaying a [`Trace`] against a [`PinCache`], and the `memcpy`
//! baselines transfers are set against ([`Copier`], [`Memcpy`]).

use std::time::{Duration, Instant};

use pindown_pincache::{CacheError, CacheStats, PinCache, Pinner};
use serde::Serialize;

use crate::sys::Mapping;
use crate::traces::Trace;

/// Where buffer number `id` lives: `base + id * stride`, `len` bytes long.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Address of buffer 0 (page aligned).
    pub base: usize,
    /// Distance between consecutive buffers.
    pub stride: usize,
    /// Length of each buffer (the transfer size).
    pub len: usize,
}

impl Layout {
    /// Buffers of `len` bytes, each followed by at least one page that no
    /// buffer uses, so that no two buffers share or touch a page and a cache
    /// that merges adjacent regions still sees one region per buffer.
    pub fn gapped(base: usize, len: usize, page_size: usize) -> Self {
        let pages = len.div_ceil(page_size).max(1);
        Self {
            base,
            stride: (pages + 1) * page_size,
            len,
        }
    }

    /// Address of buffer `id`.
    #[inline]
    pub fn addr(&self, id: usize) -> usize {
        self.base + id * self.stride
    }

    /// Bytes of address space that buffers `0..buffers` span.
    pub fn span(&self, buffers: usize) -> usize {
        buffers * self.stride
    }
}

/// What a replay counted and how long its measured part took.
#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq)]
pub struct Outcome {
    /// Measured transfers (the trace's accesses, not its warm-up).
    pub transfers: u64,
    /// Cache hits during the measured part.
    pub hits: u64,
    /// Cache misses during the measured part.
    pub misses: u64,
    /// Regions evicted during the measured part.
    pub evictions: u64,
    /// Wall-clock time of the measured part, in nanoseconds.
    pub elapsed_ns: u64,
}

impl Outcome {
    /// `hits / (hits + misses)`; 0 when nothing was looked up.
    pub fn hit_rate(&self) -> f64 {
        CacheStats {
            hits: self.hits,
            misses: self.misses,
            ..CacheStats::default()
        }
        .hit_rate()
    }

    /// `misses / transfers`; 0 for an empty trace.
    pub fn miss_fraction(&self) -> f64 {
        if self.transfers == 0 {
            0.0
        } else {
            self.misses as f64 / self.transfers as f64
        }
    }

    /// Average time per transfer, in nanoseconds.
    pub fn ns_per_transfer(&self) -> f64 {
        if self.transfers == 0 {
            0.0
        } else {
            self.elapsed_ns as f64 / self.transfers as f64
        }
    }
}

/// Counter difference `after - before` as `u64`.
fn delta(after: u64, before: u64) -> u64 {
    after.saturating_sub(before)
}

fn counted(before: &CacheStats, after: &CacheStats) -> (u64, u64, u64) {
    (
        delta(after.hits, before.hits),
        delta(after.misses, before.misses),
        delta(after.evictions, before.evictions),
    )
}

/// Replays `trace` against `cache`: pins each warm-up buffer once (untimed,
/// uncounted), then for each access pins the buffer, calls `transfer` with
/// its address and releases it. The counts are the difference of
/// [`PinCache::stats`] across the measured part.
pub fn replay<P, F>(
    cache: &PinCache<P>,
    trace: &Trace,
    layout: &Layout,
    mut transfer: F,
) -> Result<Outcome, CacheError>
where
    P: Pinner + 'static,
    F: FnMut(usize),
{
    for &id in &trace.warmup {
        drop(cache.pin(layout.addr(id), layout.len)?);
    }
    let before = cache.stats();
    let start = Instant::now();
    for &id in &trace.accesses {
        let addr = layout.addr(id);
        let registration = cache.pin(addr, layout.len)?;
        transfer(addr);
        drop(registration);
    }
    let elapsed = start.elapsed();
    let after = cache.stats();
    let (hits, misses, evictions) = counted(&before, &after);
    Ok(Outcome {
        transfers: trace.accesses.len() as u64,
        hits,
        misses,
        evictions,
        elapsed_ns: duration_ns(elapsed),
    })
}

/// Time of the same transfers as [`replay`] without any cache: the baseline.
pub fn transfers_only<F: FnMut(usize)>(trace: &Trace, layout: &Layout, mut transfer: F) -> u64 {
    let start = Instant::now();
    for &id in &trace.accesses {
        transfer(layout.addr(id));
    }
    duration_ns(start.elapsed())
}

/// Nanoseconds in `d`, saturating.
pub fn duration_ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Copies `len` bytes from addresses inside one [`Mapping`] into a private
/// destination buffer: the "transfer" of the hit-rate experiments (what a
/// NIC's DMA engine would read).
pub struct Copier<'m> {
    lo: usize,
    hi: usize,
    dst: Vec<u8>,
    _mapping: &'m Mapping,
}

impl<'m> Copier<'m> {
    /// A copier of `len`-byte transfers out of `mapping`.
    pub fn new(mapping: &'m Mapping, len: usize) -> Self {
        Self {
            lo: mapping.addr(),
            hi: mapping.addr() + mapping.len(),
            dst: vec![0; len],
            _mapping: mapping,
        }
    }

    /// Copies the transfer that starts at `addr`.
    ///
    /// # Panics
    /// If `addr..addr + len` is not inside the mapping.
    #[inline]
    pub fn copy(&mut self, addr: usize) {
        let len = self.dst.len();
        assert!(
            addr >= self.lo && addr.checked_add(len).is_some_and(|end| end <= self.hi),
            "transfer outside the mapping"
        );
        // SAFETY: the source range was checked to lie inside the mapping,
        // which `_mapping` keeps alive and which is readable; a private Vec
        // cannot overlap the mapping.
        unsafe { copy_out(addr, &mut self.dst) };
    }
}

/// Copies `dst.len()` bytes from `addr` into `dst`, opaquely to the
/// optimiser (the copy is never elided or merged with another).
///
/// # Safety
/// `addr..addr + dst.len()` must be readable and must not overlap `dst`.
#[inline]
unsafe fn copy_out(addr: usize, dst: &mut [u8]) {
    let len = dst.len();
    let to = std::hint::black_box(dst.as_mut_ptr());
    // SAFETY: the caller guarantees the source is readable and apart from
    // `dst`, which has `len` writable bytes.
    unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, to, len) };
    std::hint::black_box(dst);
}

/// One thread's `memcpy` of `len` bytes between two buffers of its own,
/// both faulted in beforehand: the baseline of the RDMA bandwidth figures.
#[derive(Debug)]
pub struct Memcpy {
    from: Mapping,
    to: Vec<u8>,
}

impl Memcpy {
    /// Buffers for copies of `len` bytes (at least one).
    pub fn new(len: usize) -> std::io::Result<Self> {
        let len = len.max(1);
        let from = Mapping::new(len)?;
        let mut to = vec![0u8; len];
        // Fault the destination in: a fresh zeroed Vec is not yet backed.
        to.fill(1);
        Ok(Self { from, to })
    }

    /// Bytes per copy.
    pub fn len(&self) -> usize {
        self.to.len()
    }

    /// Whether a copy moves nothing (never: at least one byte).
    pub fn is_empty(&self) -> bool {
        self.to.is_empty()
    }

    /// One copy.
    #[inline]
    pub fn copy(&mut self) {
        // SAFETY: `from` is a live readable mapping of at least `to.len()`
        // bytes (whole pages), and a private Vec cannot overlap it.
        unsafe { copy_out(self.from.addr(), &mut self.to) };
    }

    /// Time of `copies` copies in a row.
    pub fn time(&mut self, copies: u64) -> Duration {
        let start = Instant::now();
        for _ in 0..copies {
            self.copy();
        }
        start.elapsed()
    }
}
