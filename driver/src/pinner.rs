//! Registration of memory for DMA: the pin-down cache's pinner for a device
//! behind an IOTLB.
//!
//! [`IotlbPinner`] implements [`pindown_pincache::Pinner`]: pinning a page range
//! asks its [`Locate`] where the device finds those bytes (making them
//! reachable first if need be), locks the range in memory (`mlock`, through
//! [`pindown_pincache::MlockPinner`]) and installs device IOTLB entries for
//! it through the [`Transport`]: the IOVA of a byte is its virtual address
//! here, the entry's target (`uaddr`) is where the device finds it, which
//! [`Identity`] says is the same address (memory the device maps as this
//! process does: the DMA arena, any memory inside a guest). Unpinning
//! removes the entries first, so the device can no longer reach the pages,
//! then unlocks them.
//!
//! The cache may pin a merged region over regions that are still pinned, so
//! pins overlap. IOTLB entries do not nest (an INVALIDATE removes the
//! translation whatever else still needs it), so the pinner counts references
//! per page ([`pindown_pincache::RangeRefCounts`]) and installs an entry only for
//! pages whose count goes from zero to one, and removes one only for pages
//! whose count drops to zero. Device entries therefore never overlap. The
//! pinner remembers the target of every entry it installed, tells its
//! [`Locate`] when an entry comes and goes (so that memory is never reused
//! while the device can reach it), and says which installed ranges are
//! read-only ([`IotlbPinner::writable`]).
//!
//! On the host the device can only reach memory it has mapped: with
//! [`Identity`], registered ranges must lie in memory shared with it (the
//! [`DmaArena`](crate::DmaArena)); elsewhere the device refuses the IOTLB
//! update and the pin fails. The verbs layer's locator,
//! [`DeviceReach`](crate::reach::DeviceReach), reaches any mapped memory.
//! Ring memory must not be registered through the pinner: its entry belongs
//! to the transport, and an unpin would remove it.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use pindown_pincache::{MlockPinner, PageRange, PinError, Pinner, RangeRefCounts};

use crate::transport::{IotlbAccess, Transport, TransportError};

/// One piece of a pinned range as the device reaches it: the IOVA range
/// `[iova, iova + len)` is found at `uaddr` in the device's memory table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    /// First IOVA (the virtual address of the byte in this process).
    pub iova: u64,
    /// Bytes.
    pub len: u64,
    /// Where the device finds the first byte (an address inside a region of
    /// the memory table).
    pub uaddr: u64,
    /// Whether this process may write there (the device gets a read-only
    /// entry otherwise).
    pub writable: bool,
}

/// Where the device finds the bytes of a range: the translation an
/// [`IotlbPinner`] installs.
pub trait Locate: Send + Sync {
    /// The pieces of the page-aligned `range`, in address order, covering
    /// it exactly; memory the device cannot reach yet is made reachable
    /// first.
    fn locate(&self, range: PageRange) -> Result<Vec<Placement>, PinError>;

    /// The device can now reach `placement` (its IOTLB entry is installed).
    fn device_mapped(&self, placement: &Placement) {
        let _ = placement;
    }

    /// The device can no longer reach `placement` (its IOTLB entry is gone,
    /// and the device has finished every access through it).
    fn device_unmapped(&self, placement: &Placement) {
        let _ = placement;
    }

    /// The memory of `range` went away (unmapped, or about to be).
    fn forget(&self, range: PageRange) {
        let _ = range;
    }
}

/// The device finds every byte at its own address: memory it maps exactly
/// as this process does.
#[derive(Clone, Copy, Debug, Default)]
pub struct Identity;

impl Locate for Identity {
    fn locate(&self, range: PageRange) -> Result<Vec<Placement>, PinError> {
        Ok(vec![Placement {
            iova: range.start as u64,
            len: range.len as u64,
            uaddr: range.start as u64,
            writable: true,
        }])
    }
}

impl<L: Locate + ?Sized> Locate for std::sync::Arc<L> {
    fn locate(&self, range: PageRange) -> Result<Vec<Placement>, PinError> {
        (**self).locate(range)
    }
    fn device_mapped(&self, placement: &Placement) {
        (**self).device_mapped(placement)
    }
    fn device_unmapped(&self, placement: &Placement) {
        (**self).device_unmapped(placement)
    }
    fn forget(&self, range: PageRange) {
        (**self).forget(range)
    }
}

/// The IOTLB entries installed, by first IOVA (they never overlap).
#[derive(Debug, Default)]
struct Installed(BTreeMap<u64, Placement>);

impl Installed {
    fn insert(&mut self, placement: Placement) {
        self.0.insert(placement.iova, placement);
    }

    /// Removes `[start, end)` from the entries, splitting those that reach
    /// out of it; returns the parts removed.
    fn remove(&mut self, start: u64, end: u64) -> Vec<Placement> {
        let mut removed = Vec::new();
        while let Some((&at, &entry)) = self.0.range(..end).next_back() {
            let entry_end = at + entry.len;
            if entry_end <= start {
                break;
            }
            self.0.remove(&at);
            let cut_start = at.max(start);
            let cut_end = entry_end.min(end);
            removed.push(Placement {
                iova: cut_start,
                len: cut_end - cut_start,
                uaddr: entry.uaddr + (cut_start - at),
                writable: entry.writable,
            });
            if entry_end > end {
                self.insert(Placement {
                    iova: end,
                    len: entry_end - end,
                    uaddr: entry.uaddr + (end - at),
                    writable: entry.writable,
                });
            }
            if at < start {
                self.insert(Placement {
                    len: start - at,
                    ..entry
                });
                break;
            }
        }
        removed.reverse();
        removed
    }

    /// Whether every installed byte of `[start, end)` is writable (bytes
    /// without an entry count as not writable).
    fn writable(&self, start: u64, end: u64) -> bool {
        let mut cursor = start;
        if let Some((&at, entry)) = self.0.range(..=start).next_back() {
            if at + entry.len > start {
                if !entry.writable {
                    return false;
                }
                cursor = at + entry.len;
            }
        }
        if cursor >= end {
            return true;
        }
        for (&at, entry) in self.0.range(cursor..end) {
            if at != cursor || !entry.writable {
                return false;
            }
            cursor = at + entry.len;
        }
        cursor >= end
    }
}

/// Pins with `mlock` plus device IOTLB entries at the targets its
/// [`Locate`] gives. The token is the IOVA of the range's first byte (its
/// virtual address).
#[derive(Debug)]
pub struct IotlbPinner<T: Transport, L: Locate = Identity> {
    transport: T,
    locate: L,
    mlock: MlockPinner,
    mapped: Mutex<RangeRefCounts>,
    installed: Mutex<Installed>,
    access: IotlbAccess,
    unmap_failures: AtomicU64,
}

impl<T: Transport> IotlbPinner<T> {
    /// A pinner installing read/write identity entries through `transport`
    /// (pass an `Arc` of the transport to share it).
    pub fn new(transport: T) -> Self {
        Self::with_access(transport, IotlbAccess::ReadWrite)
    }

    /// A pinner installing identity entries with the given access.
    pub fn with_access(transport: T, access: IotlbAccess) -> Self {
        Self::with_locate(transport, Identity, access)
    }
}

impl<T: Transport, L: Locate> IotlbPinner<T, L> {
    /// A pinner installing entries at the targets `locate` gives, with the
    /// given access (read-only where the memory is).
    pub fn with_locate(transport: T, locate: L, access: IotlbAccess) -> Self {
        Self {
            transport,
            locate,
            mlock: MlockPinner::new(),
            mapped: Mutex::new(RangeRefCounts::new()),
            installed: Mutex::new(Installed::default()),
            access,
            unmap_failures: AtomicU64::new(0),
        }
    }

    /// The transport entries go through.
    pub fn transport(&self) -> &T {
        &self.transport
    }

    /// Where the pinner learns the targets of its entries.
    pub fn locator(&self) -> &L {
        &self.locate
    }

    /// Bytes currently covered by device entries installed by this pinner.
    pub fn mapped_len(&self) -> usize {
        self.mapped.lock().covered_len()
    }

    /// Bytes this pinner holds locked.
    pub fn locked_len(&self) -> usize {
        self.mlock.locked_len()
    }

    /// Whether every byte of `[iova, iova + len)` has a device entry that
    /// lets the device write.
    pub fn writable(&self, iova: u64, len: u64) -> bool {
        len > 0
            && iova
                .checked_add(len)
                .is_some_and(|end| self.installed.lock().writable(iova, end))
    }

    /// How many IOTLB invalidations the transport failed to deliver (the
    /// device was gone); unpinning cannot fail, so they are only counted.
    pub fn unmap_failures(&self) -> u64 {
        self.unmap_failures.load(Ordering::Relaxed)
    }

    /// Removes the device's entries of `range`: once the transport has
    /// answered, the device has finished every access through them.
    fn unmap(&self, range: std::ops::Range<usize>) {
        if self
            .transport
            .iotlb_unmap(range.start as u64, (range.end - range.start) as u64)
            .is_err()
        {
            self.unmap_failures.fetch_add(1, Ordering::Relaxed);
        }
        let removed = self
            .installed
            .lock()
            .remove(range.start as u64, range.end as u64);
        for placement in &removed {
            self.locate.device_unmapped(placement);
        }
    }

    /// Installs the entries of the part `part` of a range placed as
    /// `placements`; on failure removes those installed for it.
    fn map_part(
        &self,
        part: &std::ops::Range<usize>,
        placements: &[Placement],
    ) -> Result<(), TransportError> {
        let (start, end) = (part.start as u64, part.end as u64);
        for placement in placements {
            let from = placement.iova.max(start);
            let to = (placement.iova + placement.len).min(end);
            if from >= to {
                continue;
            }
            let piece = Placement {
                iova: from,
                len: to - from,
                uaddr: placement.uaddr + (from - placement.iova),
                writable: placement.writable,
            };
            let access = match (self.access, piece.writable) {
                (access, true) => access,
                _ => IotlbAccess::ReadOnly,
            };
            if let Err(err) = self
                .transport
                .iotlb_map(piece.iova, piece.len, piece.uaddr, access)
            {
                if from > start {
                    self.unmap(part.start..from as usize);
                }
                return Err(err);
            }
            self.installed.lock().insert(piece);
            self.locate.device_mapped(&piece);
        }
        Ok(())
    }
}

impl<T: Transport, L: Locate> Pinner for IotlbPinner<T, L> {
    type Token = u64;

    fn pin(&self, range: PageRange) -> Result<u64, PinError> {
        let placements = self.locate.locate(range)?;
        self.mlock.pin(range)?;
        let mut mapped = self.mapped.lock();
        let fresh = mapped.acquire(range.start..range.end());
        for (done, part) in fresh.iter().enumerate() {
            if let Err(err) = self.map_part(part, &placements) {
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
        self.locate.forget(unmapped);
    }

    fn unpin_unmapped(&self, range: PageRange, _token: u64, unmapped: &[PageRange]) {
        {
            let mut mapped = self.mapped.lock();
            for rest in range.minus_all(unmapped) {
                for part in mapped.release_lenient(rest.start..rest.end()) {
                    self.unmap(part);
                }
            }
        }
        self.mlock.unpin_unmapped(range, (), unmapped);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(iova: u64, len: u64, uaddr: u64, writable: bool) -> Placement {
        Placement {
            iova,
            len,
            uaddr,
            writable,
        }
    }

    #[test]
    fn installed_entries_split_where_removed() {
        let mut installed = Installed::default();
        installed.insert(piece(0x1000, 0x3000, 0x9000, true));
        installed.insert(piece(0x4000, 0x1000, 0x2000, false));
        assert!(installed.writable(0x1000, 0x4000));
        assert!(!installed.writable(0x1000, 0x5000));
        assert!(!installed.writable(0x800, 0x2000), "no entry below 0x1000");
        assert!(installed.writable(0x1800, 0x2000), "inside one entry");
        let removed = installed.remove(0x2000, 0x4800);
        assert_eq!(
            removed,
            vec![
                piece(0x2000, 0x2000, 0xa000, true),
                piece(0x4000, 0x800, 0x2000, false)
            ]
        );
        assert!(installed.writable(0x1000, 0x2000));
        assert!(!installed.writable(0x1000, 0x2001));
        assert_eq!(
            installed.remove(0, u64::MAX),
            vec![
                piece(0x1000, 0x1000, 0x9000, true),
                piece(0x4800, 0x800, 0x2800, false)
            ]
        );
        assert!(installed.0.is_empty());
    }
}
