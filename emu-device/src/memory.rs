//! A port's view of its frontend's memory: the memory table (mmap'd regions
//! from SET_MEM_TABLE), the device IOTLB (entries from IOTLB UPDATE), and the
//! translation of device addresses into [`VolatileSlice`]s.
//!
//! Address spaces:
//! - *frontend virtual addresses* (`uaddr`): what the frontend's own process
//!   sees; the memory table says where each region lives there.
//! - *guest physical addresses* (`gpa`): the memory table's `guest_phys_addr`;
//!   the backing [`GuestMemoryMmap`] is laid out in this space.
//! - *I/O virtual addresses* (IOVA): what a device uses when ACCESS_PLATFORM is
//!   negotiated. The [`IotlbTable`] maps IOVA ranges to `uaddr` ranges (as the
//!   frontend sends them) with permissions. It is the port's one
//!   translator: [`PortMemory`] looks every IOVA up in it, then finds the
//!   `uaddr` in the memory table; a miss is a [`TranslateError::Miss`].
//!
//! Without ACCESS_PLATFORM, buffer addresses are guest physical and ring
//! addresses are frontend virtual addresses (vhost-user convention).

use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::iter::FusedIterator;
use std::os::unix::fs::MetadataExt;

use thiserror::Error;
use uapi::{IotlbMessage, VhostAccess};
use vm_memory::bitmap::BS;
use vm_memory::guest_memory::{GuestMemorySliceIterator, Result as GuestMemoryResult};
use vm_memory::iommu::{Error as IommuError, IovaRange};
use vm_memory::{
    Address, FileOffset, GuestAddress, GuestMemory, GuestMemoryBackend, GuestMemoryError,
    GuestMemoryMmap, GuestMemoryRegion, GuestRegionMmap, MemoryRegionAddress, MmapRegion,
    Permissions, VolatileSlice,
};

/// Errors of the memory table.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum MemError {
    /// A memory table region is malformed (zero size, overflow, overlap).
    #[error("invalid memory region {index}: {reason}")]
    InvalidRegion {
        /// Index of the region in the message.
        index: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// Mapping a region failed.
    #[error("cannot map memory region {index}: {reason}")]
    Map {
        /// Index of the region in the message.
        index: usize,
        /// The OS error.
        reason: String,
    },
    /// No memory table has been set yet.
    #[error("no memory table")]
    NoMemory,
}

/// One region of the memory table, as the frontend described it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionDesc {
    /// Guest physical address of the region's first byte.
    pub gpa: u64,
    /// Size in bytes.
    pub size: u64,
    /// The frontend's virtual address of the region's first byte.
    pub uaddr: u64,
    /// Offset of the region in its file.
    pub mmap_offset: u64,
}

/// The mapped memory table of one frontend.
#[derive(Debug, Clone)]
pub struct MemoryTable {
    regions: Vec<RegionDesc>,
    mmap: GuestMemoryMmap,
}

impl MemoryTable {
    /// Maps `files[i]` for `regions[i]` (shared, read-write).
    ///
    /// Refuses regions that are empty, overflow, overlap, or reach past the
    /// end of their file (touching such a mapping would raise SIGBUS).
    pub fn map(regions: &[RegionDesc], files: Vec<File>) -> Result<Self, MemError> {
        if regions.len() != files.len() {
            return Err(MemError::InvalidRegion {
                index: regions.len().min(files.len()),
                reason: format!(
                    "{} regions but {} file descriptors",
                    regions.len(),
                    files.len()
                ),
            });
        }
        let mut mapped = Vec::with_capacity(regions.len());
        for (index, (r, file)) in regions.iter().zip(files).enumerate() {
            let bad = |reason: &str| MemError::InvalidRegion {
                index,
                reason: reason.to_string(),
            };
            if r.size == 0 {
                return Err(bad("zero size"));
            }
            if r.gpa.checked_add(r.size).is_none()
                || r.uaddr.checked_add(r.size).is_none()
                || r.mmap_offset.checked_add(r.size).is_none()
            {
                return Err(bad("address overflow"));
            }
            let size = usize::try_from(r.size).map_err(|_| bad("too large"))?;
            let meta = file.metadata().map_err(|e| MemError::Map {
                index,
                reason: e.to_string(),
            })?;
            if meta.file_type().is_file() && r.mmap_offset + r.size > meta.size() {
                return Err(bad("region reaches past the end of its file"));
            }
            let region = MmapRegion::from_file(FileOffset::new(file, r.mmap_offset), size)
                .map_err(|e| MemError::Map {
                    index,
                    reason: e.to_string(),
                })?;
            let region =
                GuestRegionMmap::new(region, GuestAddress(r.gpa)).ok_or_else(|| MemError::Map {
                    index,
                    reason: "region does not fit the guest address space".into(),
                })?;
            mapped.push(region);
        }
        let mmap = GuestMemoryMmap::from_regions(mapped).map_err(|e| MemError::InvalidRegion {
            index: 0,
            reason: e.to_string(),
        })?;
        Ok(MemoryTable {
            regions: regions.to_vec(),
            mmap,
        })
    }

    /// The regions as described by the frontend.
    pub fn regions(&self) -> &[RegionDesc] {
        &self.regions
    }

    /// The mapped memory, laid out at guest physical addresses.
    pub fn mmap(&self) -> &GuestMemoryMmap {
        &self.mmap
    }

    /// Guest physical address of the frontend virtual range
    /// `[uaddr, uaddr + len)`, which must lie inside one region.
    pub fn uaddr_to_gpa(&self, uaddr: u64, len: u64) -> Option<u64> {
        let end = uaddr.checked_add(len)?;
        self.regions
            .iter()
            .find(|r| uaddr >= r.uaddr && end <= r.uaddr + r.size)
            .map(|r| r.gpa + (uaddr - r.uaddr))
    }

    /// Splits the frontend virtual range `[uaddr, uaddr + len)` into pieces
    /// backed by regions: `(offset in the range, gpa, length)`. Parts that no
    /// region backs are left out.
    pub fn uaddr_segments(&self, uaddr: u64, len: u64) -> Vec<(u64, u64, u64)> {
        let Some(end) = uaddr.checked_add(len) else {
            return Vec::new();
        };
        let mut out: Vec<(u64, u64, u64)> = self
            .regions
            .iter()
            .filter_map(|r| {
                let s = uaddr.max(r.uaddr);
                let e = end.min(r.uaddr + r.size);
                (s < e).then(|| (s - uaddr, r.gpa + (s - r.uaddr), e - s))
            })
            .collect();
        out.sort_unstable();
        out
    }
}

/// Where a translation missed: the first address without an IOTLB entry,
/// and the access that was wanted. The port asks its frontend for the
/// mapping (an IOTLB MISS) and retries once the UPDATE arrives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Miss {
    /// First address without an entry.
    pub iova: u64,
    /// The access that was attempted.
    pub access: Permissions,
}

/// Why a device address range cannot be accessed (the result of a failed
/// translation; nothing was read or written).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum TranslateError {
    /// Part of the range has no IOTLB entry (yet).
    #[error("IOTLB miss at {:#x} for {:?} access", .0.iova, .0.access)]
    Miss(Miss),
    /// The range is mapped, but not with the access wanted.
    #[error("the IOTLB entry at {iova:#x} does not allow {access:?} access")]
    Denied {
        /// First address without the permission.
        iova: u64,
        /// The access that was attempted.
        access: Permissions,
    },
    /// The address is not backed by the memory table (an IOTLB entry
    /// pointing outside it, or a guest physical address no region holds).
    #[error("address {addr:#x} is not backed by the memory table")]
    Unbacked {
        /// The device address that did not resolve.
        addr: u64,
    },
    /// `addr + len` does not fit in 64 bits.
    #[error("address range {addr:#x}+{len:#x} wraps around")]
    Wraps {
        /// Start of the range.
        addr: u64,
        /// Its length.
        len: u64,
    },
}

impl TranslateError {
    /// What to ask the frontend for: the entry that misses, or the access
    /// that an entry denies (an UPDATE may grant it). Nothing for the
    /// failures no UPDATE can fix.
    pub fn ask(&self) -> Option<Miss> {
        match *self {
            TranslateError::Miss(miss) => Some(miss),
            TranslateError::Denied { iova, access } => Some(Miss { iova, access }),
            TranslateError::Unbacked { .. } | TranslateError::Wraps { .. } => None,
        }
    }
}

/// Why an IOTLB update was refused (the table is unchanged).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum IotlbError {
    /// The IOVA range is empty or `iova + len` does not fit in 64 bits.
    #[error("IOTLB range {iova:#x}+{len:#x} is empty or wraps around")]
    BadRange {
        /// Start of the range.
        iova: u64,
        /// Its length.
        len: u64,
    },
    /// `uaddr + len` does not fit in 64 bits.
    #[error("IOTLB target {uaddr:#x}+{len:#x} wraps around")]
    BadTarget {
        /// The frontend address.
        uaddr: u64,
        /// The length.
        len: u64,
    },
    /// An update that grants no access (an invalidation is its own message).
    #[error("IOTLB update of {iova:#x}+{len:#x} grants no access")]
    NoAccess {
        /// Start of the range.
        iova: u64,
        /// Its length.
        len: u64,
    },
}

/// One IOTLB entry: `[iova, iova + len)` maps to `[uaddr, uaddr + len)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IotlbEntry {
    /// Length of the mapping in bytes (never 0).
    pub len: u64,
    /// Frontend virtual address the IOVA maps to.
    pub uaddr: u64,
    /// Allowed accesses (never [`Permissions::No`]).
    pub perm: Permissions,
    /// Insertion order (pieces of a split entry keep it).
    seq: u64,
}

/// The device IOTLB of one port, and the port's one translator: IOVA
/// ranges mapped to frontend virtual addresses, as the frontend sent them.
///
/// Entries never overlap: an update replaces whatever it overlaps, and an
/// update or invalidation that covers part of an entry splits it, keeping
/// the parts outside the range. The table holds at most `max_entries`
/// entries; beyond that the oldest (first inserted) entry is evicted, which
/// only costs a later miss. An update, an invalidation and an eviction cost
/// O(log n) per entry they touch; a lookup is one O(log n) search and
/// allocates nothing.
#[derive(Debug, Clone)]
pub struct IotlbTable {
    /// Entries by first IOVA.
    entries: BTreeMap<u64, IotlbEntry>,
    /// `(seq, iova)` of every entry, oldest first (the eviction order).
    age: BTreeSet<(u64, u64)>,
    max_entries: usize,
    next_seq: u64,
}

impl IotlbTable {
    /// An empty table holding at most `max_entries` entries (at least 1).
    pub fn new(max_entries: usize) -> Self {
        IotlbTable {
            entries: BTreeMap::new(),
            age: BTreeSet::new(),
            max_entries: max_entries.max(1),
            next_seq: 0,
        }
    }

    /// The bound on entries.
    pub fn max_entries(&self) -> usize {
        self.max_entries
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the table is empty.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Iterates over `(iova, entry)` in IOVA order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, &IotlbEntry)> {
        self.entries.iter().map(|(k, v)| (*k, v))
    }

    /// Maps `[iova, iova + len)` to `[uaddr, uaddr + len)` with `perm`,
    /// replacing the overlapped parts of older entries. Returns how many
    /// entries were evicted to stay within the bound.
    ///
    /// Refused: an empty range, a range whose end does not fit in 64 bits
    /// (on either side), and `Permissions::No`.
    pub fn update(
        &mut self,
        iova: u64,
        len: u64,
        uaddr: u64,
        perm: Permissions,
    ) -> Result<usize, IotlbError> {
        if len == 0 || iova.checked_add(len).is_none() {
            return Err(IotlbError::BadRange { iova, len });
        }
        if uaddr.checked_add(len).is_none() {
            return Err(IotlbError::BadTarget { uaddr, len });
        }
        if perm == Permissions::No {
            return Err(IotlbError::NoAccess { iova, len });
        }
        self.remove_range(iova, iova + len);
        let seq = self.next_seq;
        self.next_seq += 1;
        self.insert(
            iova,
            IotlbEntry {
                len,
                uaddr,
                perm,
                seq,
            },
        );
        Ok(self.evict())
    }

    /// Removes every mapping of `[iova, iova + len)`; the parts of entries
    /// outside the range stay. A range reaching past the end of the address
    /// space (`len == 0` included, the wrapped form of 2^64) invalidates up
    /// to the end. Returns how many entries were evicted (splitting an entry
    /// in two may exceed the bound).
    pub fn invalidate(&mut self, iova: u64, len: u64) -> usize {
        let end = match iova.checked_add(len) {
            Some(end) if len != 0 => end,
            _ => u64::MAX,
        };
        self.remove_range(iova, end);
        self.evict()
    }

    /// Removes all entries.
    pub fn clear(&mut self) {
        self.entries.clear();
        self.age.clear();
    }

    /// The entry holding `iova`, with its first IOVA.
    pub fn lookup(&self, iova: u64) -> Option<(u64, &IotlbEntry)> {
        self.entries
            .range(..=iova)
            .next_back()
            .filter(|(start, e)| iova - **start < e.len)
            .map(|(start, e)| (*start, e))
    }

    /// Translates `iova` for `access`: the frontend virtual address it maps
    /// to, and how many bytes from there on the same entry maps.
    pub fn translate(&self, iova: u64, access: Permissions) -> Result<(u64, u64), TranslateError> {
        let (start, e) = self
            .lookup(iova)
            .ok_or(TranslateError::Miss(Miss { iova, access }))?;
        if !e.perm.allow(access) {
            return Err(TranslateError::Denied { iova, access });
        }
        let offset = iova - start;
        Ok((e.uaddr + offset, e.len - offset))
    }

    fn insert(&mut self, iova: u64, e: IotlbEntry) {
        self.age.insert((e.seq, iova));
        self.entries.insert(iova, e);
    }

    fn remove(&mut self, iova: u64) -> Option<IotlbEntry> {
        let e = self.entries.remove(&iova)?;
        self.age.remove(&(e.seq, iova));
        Some(e)
    }

    /// Evicts the oldest entries beyond the bound.
    fn evict(&mut self) -> usize {
        let mut evicted = 0;
        while self.entries.len() > self.max_entries {
            let Some((_, iova)) = self.age.pop_first() else {
                break;
            };
            self.entries.remove(&iova);
            evicted += 1;
        }
        evicted
    }

    /// Removes `[start, end)` from every entry, splitting the entries that
    /// reach out of it. Entries do not overlap, so the ones concerned are
    /// the last few starting before `end`, visited from the right.
    fn remove_range(&mut self, start: u64, end: u64) {
        if start >= end {
            return;
        }
        while let Some((&k, &e)) = self.entries.range(..end).next_back() {
            let e_end = k + e.len;
            if e_end <= start {
                break;
            }
            self.remove(k);
            if e_end > end {
                self.insert(
                    end,
                    IotlbEntry {
                        len: e_end - end,
                        uaddr: e.uaddr + (end - k),
                        ..e
                    },
                );
            }
            if k < start {
                self.insert(
                    k,
                    IotlbEntry {
                        len: start - k,
                        ..e
                    },
                );
                break;
            }
        }
    }
}

/// A port's memory as the device accesses it: the frontend's memory table
/// and, when ACCESS_PLATFORM is negotiated, the port's IOTLB in front of
/// it. Device addresses are IOVAs then, guest physical addresses otherwise.
///
/// Every access of the device to a port's memory translates here: the RDMA
/// engine through [`translate`](Self::translate), the rings (virtio-queue)
/// through this type's [`GuestMemory`] implementation. There is no other
/// copy of the IOTLB. It lives behind the port's access gate: lookups
/// happen inside a guarded step, updates and invalidations under the
/// barrier.
#[derive(Debug)]
pub struct PortMemory {
    table: MemoryTable,
    iommu: bool,
    iotlb: IotlbTable,
}

impl PortMemory {
    /// The memory of `table`, translated through `iotlb` when `iommu` is
    /// set.
    pub fn new(table: MemoryTable, iommu: bool, iotlb: IotlbTable) -> Self {
        PortMemory {
            table,
            iommu,
            iotlb,
        }
    }

    /// The memory table.
    pub fn table(&self) -> &MemoryTable {
        &self.table
    }

    /// Whether device addresses are IOVAs (ACCESS_PLATFORM).
    pub fn iommu_enabled(&self) -> bool {
        self.iommu
    }

    /// The IOTLB.
    pub fn iotlb(&self) -> &IotlbTable {
        &self.iotlb
    }

    /// The IOTLB, to change it (under the port's barrier).
    pub fn iotlb_mut(&mut self) -> &mut IotlbTable {
        &mut self.iotlb
    }

    /// Gives the IOTLB back (to carry it over to a new memory table).
    pub fn into_iotlb(self) -> IotlbTable {
        self.iotlb
    }

    /// The memory of `[addr, addr + len)` for `access`, as slices in this
    /// process, one per IOTLB entry and memory region crossed. The first
    /// address that does not translate ends the iteration with its
    /// [`TranslateError`].
    pub fn translate(&self, addr: u64, len: u64, access: Permissions) -> Slices<'_> {
        match addr.checked_add(len) {
            Some(end) => Slices {
                memory: self,
                addr,
                end,
                access,
                failed: None,
            },
            None => Slices {
                memory: self,
                addr,
                end: addr,
                access,
                failed: Some(TranslateError::Wraps { addr, len }),
            },
        }
    }

    /// Whether all of `[addr, addr + len)` translates for `access`.
    pub fn check(&self, addr: u64, len: u64, access: Permissions) -> Result<(), TranslateError> {
        self.translate(addr, len, access)
            .try_for_each(|slice| slice.map(drop))
    }

    /// The slice at `addr`, up to `end`, as far as one IOTLB entry and one
    /// memory region reach.
    fn slice(
        &self,
        addr: u64,
        end: u64,
        access: Permissions,
    ) -> Result<VolatileSlice<'_, ()>, TranslateError> {
        let unbacked = TranslateError::Unbacked { addr };
        let mut limit = end - addr;
        let gpa = if self.iommu {
            let (uaddr, run) = self.iotlb.translate(addr, access)?;
            limit = limit.min(run);
            let region = self
                .table
                .regions()
                .iter()
                .find(|r| uaddr >= r.uaddr && uaddr - r.uaddr < r.size)
                .ok_or(unbacked)?;
            let offset = uaddr - region.uaddr;
            limit = limit.min(region.size - offset);
            region.gpa + offset
        } else {
            addr
        };
        let region = self
            .table
            .mmap()
            .find_region(GuestAddress(gpa))
            .ok_or(unbacked)?;
        let offset = gpa - region.start_addr().raw_value();
        limit = limit.min(region.len() - offset);
        let len = usize::try_from(limit).map_err(|_| unbacked)?;
        region
            .get_slice(MemoryRegionAddress(offset), len)
            .map_err(|_| unbacked)
    }
}

/// The slices of a translated range (see [`PortMemory::translate`]).
#[derive(Debug)]
pub struct Slices<'a> {
    memory: &'a PortMemory,
    addr: u64,
    end: u64,
    access: Permissions,
    failed: Option<TranslateError>,
}

impl<'a> Iterator for Slices<'a> {
    type Item = Result<VolatileSlice<'a, ()>, TranslateError>;

    fn next(&mut self) -> Option<Self::Item> {
        if let Some(error) = self.failed.take() {
            return Some(Err(error));
        }
        if self.addr >= self.end {
            return None;
        }
        match self.memory.slice(self.addr, self.end, self.access) {
            Ok(slice) => {
                self.addr += slice.len() as u64;
                Some(Ok(slice))
            }
            Err(error) => {
                self.addr = self.end;
                Some(Err(error))
            }
        }
    }
}

impl FusedIterator for Slices<'_> {}

/// A [`PortMemory`] lent to code that drops errors on the floor (virtio-queue
/// ends a descriptor chain early when a descriptor cannot be read): the
/// first translation that fails through it is kept, so that the caller can
/// return it as its result.
#[derive(Debug)]
pub struct Watched<'a> {
    memory: &'a PortMemory,
    failure: Cell<Option<TranslateError>>,
}

impl<'a> Watched<'a> {
    /// Watches the translations made through it.
    pub fn new(memory: &'a PortMemory) -> Self {
        Watched {
            memory,
            failure: Cell::new(None),
        }
    }

    /// The first translation that failed through this view.
    pub fn failure(&self) -> Option<TranslateError> {
        self.failure.get()
    }
}

/// The slices of a range accessed through [`GuestMemory`].
#[derive(Debug)]
pub struct GuestSlices<'a> {
    slices: Slices<'a>,
    watch: Option<&'a Cell<Option<TranslateError>>>,
}

impl<'a> Iterator for GuestSlices<'a> {
    type Item = GuestMemoryResult<VolatileSlice<'a, ()>>;

    fn next(&mut self) -> Option<Self::Item> {
        let item = self.slices.next()?;
        Some(item.map_err(|error| {
            if let Some(watch) = self.watch {
                if watch.get().is_none() {
                    watch.set(Some(error));
                }
            }
            guest_error(error)
        }))
    }
}

impl FusedIterator for GuestSlices<'_> {}

impl<'a> GuestMemorySliceIterator<'a, BS<'a, ()>> for GuestSlices<'a> {}

fn guest_error(error: TranslateError) -> GuestMemoryError {
    match error {
        TranslateError::Miss(Miss { iova, .. }) | TranslateError::Denied { iova, .. } => {
            GuestMemoryError::IommuError(IommuError::CannotResolve {
                iova_range: IovaRange {
                    base: GuestAddress(iova),
                    length: 1,
                },
                reason: error.to_string(),
            })
        }
        TranslateError::Unbacked { addr } => {
            GuestMemoryError::InvalidGuestAddress(GuestAddress(addr))
        }
        TranslateError::Wraps { .. } => GuestMemoryError::GuestAddressOverflow,
    }
}

impl GuestMemory for PortMemory {
    type PhysicalMemory = GuestMemoryMmap;
    type Bitmap = ();

    fn check_range(&self, addr: GuestAddress, count: usize, access: Permissions) -> bool {
        self.check(addr.0, count as u64, access).is_ok()
    }

    fn get_slices<'a>(
        &'a self,
        addr: GuestAddress,
        count: usize,
        access: Permissions,
    ) -> GuestMemoryResult<impl GuestMemorySliceIterator<'a, BS<'a, ()>>> {
        Ok(GuestSlices {
            slices: self.translate(addr.0, count as u64, access),
            watch: None,
        })
    }

    fn physical_memory(&self) -> Option<&GuestMemoryMmap> {
        (!self.iommu).then(|| self.table.mmap())
    }
}

impl GuestMemory for Watched<'_> {
    type PhysicalMemory = GuestMemoryMmap;
    type Bitmap = ();

    fn check_range(&self, addr: GuestAddress, count: usize, access: Permissions) -> bool {
        match self.memory.check(addr.0, count as u64, access) {
            Ok(()) => true,
            Err(error) => {
                if self.failure.get().is_none() {
                    self.failure.set(Some(error));
                }
                false
            }
        }
    }

    fn get_slices<'a>(
        &'a self,
        addr: GuestAddress,
        count: usize,
        access: Permissions,
    ) -> GuestMemoryResult<impl GuestMemorySliceIterator<'a, BS<'a, ()>>> {
        Ok(GuestSlices {
            slices: self.memory.translate(addr.0, count as u64, access),
            watch: Some(&self.failure),
        })
    }
}

/// The [`Permissions`] of a vhost IOTLB permission, if it is one.
pub fn perm_from_vhost(perm: u8) -> Option<Permissions> {
    let access = IotlbMessage {
        perm,
        ..IotlbMessage::default()
    }
    .access()?;
    Some(match access {
        VhostAccess::No => Permissions::No,
        VhostAccess::ReadOnly => Permissions::Read,
        VhostAccess::WriteOnly => Permissions::Write,
        VhostAccess::ReadWrite => Permissions::ReadWrite,
    })
}

/// The vhost IOTLB permission of an access.
pub fn perm_to_vhost(perm: Permissions) -> VhostAccess {
    match perm {
        Permissions::No => VhostAccess::No,
        Permissions::Read => VhostAccess::ReadOnly,
        Permissions::Write => VhostAccess::WriteOnly,
        Permissions::ReadWrite => VhostAccess::ReadWrite,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::io::Write;
    use vm_memory::Bytes;

    const R: Permissions = Permissions::Read;
    const W: Permissions = Permissions::Write;
    const RW: Permissions = Permissions::ReadWrite;

    fn miss(iova: u64, access: Permissions) -> TranslateError {
        TranslateError::Miss(Miss { iova, access })
    }

    /// The frontend address of `iova`, if mapped for `access`.
    fn uaddr(t: &IotlbTable, iova: u64, access: Permissions) -> Result<u64, TranslateError> {
        t.translate(iova, access).map(|(uaddr, _)| uaddr)
    }

    #[test]
    fn translate_single_entry() {
        let mut t = IotlbTable::new(16);
        t.update(0x1000, 0x1000, 0x7f00_0000, RW).unwrap();
        assert_eq!(t.translate(0x1800, R), Ok((0x7f00_0800, 0x800)));
        assert_eq!(t.translate(0x1fff, W), Ok((0x7f00_0fff, 1)));
        assert_eq!(t.translate(0x2000, R), Err(miss(0x2000, R)));
        assert_eq!(t.translate(0xfff, W), Err(miss(0xfff, W)));
    }

    #[test]
    fn translate_checks_permissions() {
        let mut t = IotlbTable::new(16);
        t.update(0x1000, 0x1000, 0xa000, R).unwrap();
        t.update(0x2000, 0x1000, 0xb000, W).unwrap();
        assert!(t.translate(0x1000, R).is_ok());
        let denied = |iova, access| TranslateError::Denied { iova, access };
        assert_eq!(t.translate(0x1000, W), Err(denied(0x1000, W)));
        assert_eq!(t.translate(0x2000, R), Err(denied(0x2000, R)));
        assert_eq!(t.translate(0x1ff0, RW), Err(denied(0x1ff0, RW)));
    }

    #[test]
    fn wrapping_empty_and_permissionless_updates_are_refused() {
        let mut t = IotlbTable::new(16);
        assert!(matches!(
            t.update(u64::MAX - 1, 4, 0, RW),
            Err(IotlbError::BadRange { .. })
        ));
        assert!(matches!(
            t.update(0, 0, 0, RW),
            Err(IotlbError::BadRange { .. })
        ));
        assert!(matches!(
            t.update(0, 4, u64::MAX, RW),
            Err(IotlbError::BadTarget { .. })
        ));
        assert!(matches!(
            t.update(0, 4, 0, Permissions::No),
            Err(IotlbError::NoAccess { .. })
        ));
        assert!(t.is_empty());
        // The last mappable byte is u64::MAX - 1 (the end must fit).
        t.update(u64::MAX - 0x1000, 0x1000, 0, R).unwrap();
        assert_eq!(t.translate(u64::MAX - 1, R), Ok((0xfff, 1)));
    }

    #[test]
    fn update_replaces_overlap_and_invalidate_splits() {
        let mut t = IotlbTable::new(16);
        t.update(0x0, 0x4000, 0x10000, RW).unwrap();
        t.update(0x1000, 0x1000, 0x90000, R).unwrap();
        assert_eq!(t.len(), 3);
        assert_eq!(uaddr(&t, 0x1000, R), Ok(0x90000));
        assert_eq!(uaddr(&t, 0x2000, R), Ok(0x12000));
        assert_eq!(uaddr(&t, 0x0fff, R), Ok(0x10fff));
        t.invalidate(0x800, 0x2000);
        assert_eq!(uaddr(&t, 0x7ff, R), Ok(0x107ff));
        assert_eq!(uaddr(&t, 0x800, R), Err(miss(0x800, R)));
        assert_eq!(uaddr(&t, 0x27ff, R), Err(miss(0x27ff, R)));
        assert_eq!(uaddr(&t, 0x2800, R), Ok(0x12800));
        // len 0 is 2^64 wrapped: everything from the IOVA on.
        t.invalidate(0x2900, 0);
        assert_eq!(uaddr(&t, 0x28ff, R), Ok(0x128ff));
        assert_eq!(uaddr(&t, 0x2900, R), Err(miss(0x2900, R)));
        t.invalidate(0, u64::MAX);
        assert!(t.is_empty());
    }

    #[test]
    fn oldest_entries_are_evicted() {
        let mut t = IotlbTable::new(2);
        t.update(0x1000, 0x1000, 0x1000, RW).unwrap();
        t.update(0x3000, 0x1000, 0x3000, RW).unwrap();
        assert_eq!(t.update(0x2000, 0x1000, 0x2000, RW).unwrap(), 1);
        assert_eq!(t.len(), 2);
        assert!(t.translate(0x1000, R).is_err());
        assert!(t.translate(0x2000, R).is_ok() && t.translate(0x3000, R).is_ok());
        // Splitting an entry in two evicts the oldest piece.
        assert_eq!(t.invalidate(0x2400, 0x100), 1);
        assert_eq!(t.len(), 2);
        assert!(t.translate(0x3000, R).is_err());
        assert!(t.translate(0x2000, R).is_ok() && t.translate(0x2500, R).is_ok());
    }

    /// A byte-per-byte model of the IOTLB: what every address maps to.
    #[derive(Debug, Clone, Copy)]
    enum Op {
        Update {
            at: u64,
            len: u64,
            uaddr: u64,
            perm: u8,
        },
        Invalidate {
            at: u64,
            len: u64,
        },
    }

    /// Addresses near 0 and near the top of the address space (where ranges
    /// wrap).
    fn address() -> impl Strategy<Value = u64> {
        prop_oneof![0u64..256, (0u64..256).prop_map(|o| u64::MAX - o)]
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (address(), 0u64..80, 0u64..1 << 20, 0u8..4)
                .prop_map(|(at, len, uaddr, perm)| Op::Update { at, len, uaddr, perm }),
            1 => (address(), prop_oneof![0u64..80, Just(u64::MAX)])
                .prop_map(|(at, len)| Op::Invalidate { at, len }),
        ]
    }

    fn perm(p: u8) -> Permissions {
        [Permissions::No, R, W, RW][p as usize]
    }

    fn apply(model: &mut BTreeMap<u64, (u64, Permissions)>, op: Op) -> bool {
        match op {
            Op::Update {
                at,
                len,
                uaddr,
                perm: p,
            } => {
                if len == 0 || at.checked_add(len).is_none() || p == 0 {
                    return false;
                }
                for i in 0..len {
                    model.insert(at + i, (uaddr + i, perm(p)));
                }
                true
            }
            Op::Invalidate { at, len } => {
                let end = at.checked_add(len).filter(|_| len != 0).unwrap_or(u64::MAX);
                let doomed: Vec<u64> = model.range(at..end).map(|(k, _)| *k).collect();
                for k in doomed {
                    model.remove(&k);
                }
                true
            }
        }
    }

    fn check_shape(t: &IotlbTable) -> Result<(), TestCaseError> {
        let mut last_end = 0u64;
        for (i, (iova, e)) in t.iter().enumerate() {
            prop_assert!(e.len > 0 && e.perm != Permissions::No);
            prop_assert!(i == 0 || iova >= last_end, "entries overlap at {:#x}", iova);
            prop_assert!(t.age.contains(&(e.seq, iova)));
            last_end = iova + e.len;
        }
        prop_assert_eq!(t.age.len(), t.len());
        prop_assert!(t.len() <= t.max_entries());
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

        /// With room for every entry, the table maps exactly what the model
        /// maps, byte for byte, with the right permissions; entries never
        /// overlap.
        #[test]
        fn iotlb_matches_a_byte_model(ops in proptest::collection::vec(op(), 1..40)) {
            let mut t = IotlbTable::new(1 << 20);
            let mut model = BTreeMap::new();
            for op in ops {
                let accepted = apply(&mut model, op);
                match op {
                    Op::Update { at, len, uaddr, perm: p } => {
                        prop_assert_eq!(t.update(at, len, uaddr, perm(p)).is_ok(), accepted);
                    }
                    Op::Invalidate { at, len } => {
                        prop_assert_eq!(t.invalidate(at, len), 0);
                    }
                }
                check_shape(&t)?;
            }
            let probes = (0u64..300).chain((0u64..300).map(|o| u64::MAX - o));
            for iova in probes {
                match model.get(&iova) {
                    Some(&(u, p)) => {
                        let (got, run) = t.translate(iova, p).unwrap();
                        prop_assert_eq!(got, u);
                        // The whole run maps contiguously, as the model says.
                        for i in [0, run / 2, run - 1] {
                            prop_assert_eq!(model.get(&(iova + i)), Some(&(u + i, p)));
                        }
                        if p != RW {
                            let other = if p == R { W } else { R };
                            prop_assert_eq!(
                                t.translate(iova, other),
                                Err(TranslateError::Denied { iova, access: other })
                            );
                        }
                    }
                    None => prop_assert_eq!(t.translate(iova, R), Err(miss(iova, R))),
                }
            }
        }

        /// With a small bound, the table stays within it and whatever it
        /// still maps agrees with the model (eviction only forgets).
        #[test]
        fn a_bounded_iotlb_only_forgets(
            ops in proptest::collection::vec(op(), 1..60),
            max in 1usize..6,
        ) {
            let mut t = IotlbTable::new(max);
            let mut model = BTreeMap::new();
            for op in ops {
                apply(&mut model, op);
                match op {
                    Op::Update { at, len, uaddr, perm: p } => {
                        let _ = t.update(at, len, uaddr, perm(p));
                    }
                    Op::Invalidate { at, len } => {
                        t.invalidate(at, len);
                    }
                }
                check_shape(&t)?;
            }
            for (iova, e) in t.iter() {
                for i in [0, e.len - 1] {
                    prop_assert_eq!(model.get(&(iova + i)), Some(&(e.uaddr + i, e.perm)));
                }
            }
        }
    }

    fn memfd_table(gpa: u64, uaddr: u64, size: u64) -> MemoryTable {
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(&vec![0u8; size as usize]).unwrap();
        MemoryTable::map(
            &[RegionDesc {
                gpa,
                size,
                uaddr,
                mmap_offset: 0,
            }],
            vec![f],
        )
        .unwrap()
    }

    #[test]
    fn memory_table_refuses_bad_regions() {
        let f = tempfile::tempfile().unwrap();
        f.set_len(0x1000).unwrap();
        let r = RegionDesc {
            gpa: 0,
            size: 0x2000,
            uaddr: 0,
            mmap_offset: 0,
        };
        // Past the end of the file.
        assert!(MemoryTable::map(&[r], vec![f.try_clone().unwrap()]).is_err());
        // Zero size.
        let z = RegionDesc { size: 0, ..r };
        assert!(MemoryTable::map(&[z], vec![f.try_clone().unwrap()]).is_err());
        // Overflow.
        let o = RegionDesc {
            gpa: u64::MAX,
            size: 0x1000,
            ..r
        };
        assert!(MemoryTable::map(&[o], vec![f.try_clone().unwrap()]).is_err());
        // Missing fd.
        assert!(MemoryTable::map(&[r], vec![]).is_err());
    }

    #[test]
    fn uaddr_translation_through_the_table() {
        let table = memfd_table(0x10_0000, 0x7f00_0000, 0x4000);
        assert_eq!(table.uaddr_to_gpa(0x7f00_1000, 0x100), Some(0x10_1000));
        assert_eq!(table.uaddr_to_gpa(0x7f00_3f00, 0x200), None);
        assert_eq!(
            table.uaddr_segments(0x7eff_f000, 0x2000),
            vec![(0x1000, 0x10_0000, 0x1000)]
        );
    }

    #[test]
    fn port_memory_translates_through_the_iotlb() {
        let table = memfd_table(0x10_0000, 0x7f00_0000, 0x4000);
        let mut tlb = IotlbTable::new(16);
        // IOVA 0x2000..0x3000 -> uaddr page 3, IOVA 0x3000..0x4000 -> page 0 (read-only),
        // IOVA 0x8000 -> outside the memory table.
        tlb.update(0x2000, 0x1000, 0x7f00_3000, RW).unwrap();
        tlb.update(0x3000, 0x1000, 0x7f00_0000, R).unwrap();
        tlb.update(0x8000, 0x1000, 0x6000_0000, RW).unwrap();
        let mem = PortMemory::new(table.clone(), true, tlb);

        let pieces: Vec<_> = mem.translate(0x2ff0, 0x20, R).collect();
        assert_eq!(pieces.len(), 2);
        assert_eq!(
            pieces
                .iter()
                .map(|s| s.as_ref().unwrap().len())
                .sum::<usize>(),
            0x20
        );
        assert_eq!(mem.translate(0x2000, 0, W).count(), 0);

        for slice in mem.translate(0x2800, 0x10, W) {
            slice.unwrap().write_slice(&[7u8; 16], 0).unwrap();
        }
        let mut back = [0u8; 16];
        table
            .mmap()
            .read_slice(&mut back, GuestAddress(0x10_3800))
            .unwrap();
        assert_eq!(back, [7u8; 16]);

        let denied = TranslateError::Denied {
            iova: 0x3000,
            access: W,
        };
        assert_eq!(mem.check(0x2ff0, 0x20, W), Err(denied));
        assert_eq!(mem.check(0x5000, 0x10, R), Err(miss(0x5000, R)));
        assert_eq!(mem.check(0x3ff0, 0x20, R), Err(miss(0x4000, R)));
        assert_eq!(
            mem.check(0x8000, 1, R),
            Err(TranslateError::Unbacked { addr: 0x8000 })
        );
        assert_eq!(
            mem.check(u64::MAX, 2, R),
            Err(TranslateError::Wraps {
                addr: u64::MAX,
                len: 2
            })
        );

        // Through vm-memory's traits (as virtio-queue reads rings) a failure
        // is an error, and a watched view keeps the first one.
        assert!(mem.read_obj::<u64>(GuestAddress(0x2000)).is_ok());
        assert!(mem.read_obj::<u64>(GuestAddress(0x5000)).is_err());
        let watched = Watched::new(&mem);
        assert!(watched.read_obj::<u64>(GuestAddress(0x2008)).is_ok());
        assert_eq!(watched.failure(), None);
        assert!(watched.write_obj(1u64, GuestAddress(0x3000)).is_err());
        assert!(watched.read_obj::<u64>(GuestAddress(0x5000)).is_err());
        assert_eq!(watched.failure(), Some(denied));

        // Without the IOMMU, addresses are guest physical.
        let phys = PortMemory::new(table, false, mem.into_iotlb());
        assert!(phys.check(0x10_0000, 0x4000, W).is_ok());
        assert_eq!(
            phys.check(0x10_3fff, 2, R),
            Err(TranslateError::Unbacked { addr: 0x10_4000 })
        );
    }

    #[test]
    fn vhost_permissions_convert_both_ways() {
        for p in [Permissions::No, R, W, RW] {
            assert_eq!(perm_from_vhost(perm_to_vhost(p) as u8), Some(p));
        }
        assert_eq!(perm_from_vhost(4), None);
    }
}
