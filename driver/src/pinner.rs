//! Registration of memory for DMA: the pin-down cache's pinner for a device
//! behind an IOTLB.
//!
//! [`IotlbPinner`] implements [`pindown_pincache::Pinner`]: pinning a page range
//! locks it in memory (`mlock`, through [`pindown_pincache::MlockPinner`]) and
//! installs a device IOTLB entry for it through the [`Transport`] (read and
//! write access, identity IOVA); unpinning removes the entry first, so the
//! device can no longer reach the pages, then unlocks them.
//!
//! The cache may pin a merged region over regions that are still pinned, so
//! pins overlap. IOTLB entries do not nest (an INVALIDATE removes the
//! translation whatever else still needs it), so the pinner counts references
//! per page ([`pindown_pincache::RangeRefCounts`]) and installs an entry only for
//! pages whose count goes from zero to one, and removes one only for pages
//! whose count drops to zero. Device entries therefore never overlap.
//!
//! On the host the device can only reach memory it has mapped: registered
//! ranges must lie in memory shared with it (the [`DmaArena`](crate::DmaArena)
//! or another registered region); elsewhere the device refuses the IOTLB
//! update and the pin fails. Ring memory must not be registered through the
//! pinner: its entry belongs to the transport, and an unpin would remove it.

use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use pindown_pincache::{MlockPinner, PageRange, PinError, Pinner, RangeRefCounts};

use crate::transport::{IotlbAccess, Transport};

/// Pins with `mlock` plus a device IOTLB entry. The token is the IOVA of
/// the range's first byte (its virtual address).
#[derive(Debug)]
pub struct IotlbPinner<T: Transport> {
    transport: T,
    mlock: MlockPinner,
    mapped: Mutex<RangeRefCounts>,
    access: IotlbAccess,
    unmap_failures: AtomicU64,
}

impl<T: Transport> IotlbPinner<T> {
    /// A pinner installing read/write entries through `transport` (pass an
    /// `Arc` of the transport to share it).
    pub fn new(transport: T) -> Self {
        Self::with_access(transport, IotlbAccess::ReadWrite)
    }

    /// A pinner installing entries with the given access.
    pub fn with_access(transport: T, access: IotlbAccess) -> Self {
        Self {
            transport,
            mlock: MlockPinner::new(),
            mapped: Mutex::new(RangeRefCounts::new()),
            access,
            unmap_failures: AtomicU64::new(0),
        }
    }

    /// The transport entries go through.
    pub fn transport(&self) -> &T {
        &self.transport
    }

    /// Bytes currently covered by device entries installed by this pinner.
    pub fn mapped_len(&self) -> usize {
        self.mapped.lock().covered_len()
    }

    /// Bytes this pinner holds locked.
    pub fn locked_len(&self) -> usize {
        self.mlock.locked_len()
    }

    /// How many IOTLB invalidations the transport failed to deliver (the
    /// device was gone); unpinning cannot fail, so they are only counted.
    pub fn unmap_failures(&self) -> u64 {
        self.unmap_failures.load(Ordering::Relaxed)
    }

    fn unmap(&self, range: std::ops::Range<usize>) {
        if self
            .transport
            .iotlb_unmap(range.start as u64, (range.end - range.start) as u64)
            .is_err()
        {
            self.unmap_failures.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl<T: Transport> Pinner for IotlbPinner<T> {
    type Token = u64;

    fn pin(&self, range: PageRange) -> Result<u64, PinError> {
        self.mlock.pin(range)?;
        let mut mapped = self.mapped.lock();
        let fresh = mapped.acquire(range.start..range.end());
        for (done, part) in fresh.iter().enumerate() {
            let result = self.transport.iotlb_map(
                part.start as u64,
                (part.end - part.start) as u64,
                part.start as u64,
                self.access,
            );
            if let Err(err) = result {
                for undo in &fresh[..done] {
                    self.unmap(undo.clone());
                }
                mapped.release(range.start..range.end());
                drop(mapped);
                self.mlock.unpin(range, ());
                return Err(PinError::Device {
                    range,
                    reason: format!("IOTLB update failed: {err}"),
                });
            }
        }
        Ok(range.start as u64)
    }

    fn unpin(&self, range: PageRange, _token: u64) {
        let freed = self.mapped.lock().release(range.start..range.end());
        for part in freed {
            self.unmap(part);
        }
        self.mlock.unpin(range, ());
    }

    fn forget(&self, unmapped: PageRange) {
        // The pages are gone: the device must not reach whatever is mapped
        // there next, so its entries go now, whatever their counts.
        if self.mapped.lock().clear(unmapped.start..unmapped.end()) {
            self.unmap(unmapped.start..unmapped.end());
        }
        self.mlock.forget(unmapped);
    }

    fn unpin_unmapped(&self, range: PageRange, _token: u64, unmapped: PageRange) {
        {
            let mut mapped = self.mapped.lock();
            for rest in range.minus(unmapped) {
                for part in mapped.release_lenient(rest.start..rest.end()) {
                    self.unmap(part);
                }
            }
        }
        self.mlock.unpin_unmapped(range, (), unmapped);
    }
}
