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
//!   frontend sends them) with permissions; a mirror of it, translated to
//!   `gpa`, drives vm-memory's [`IommuMemory`].
//!
//! Without ACCESS_PLATFORM, buffer addresses are guest physical and ring
//! addresses are frontend virtual addresses (vhost-user convention).

use std::collections::BTreeMap;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, RwLock, RwLockReadGuard};

use thiserror::Error;

use crate::sigbus::Guarded;
use vm_memory::iommu::{Error as IommuError, IotlbIterator, IovaRange};
use vm_memory::{
    FileOffset, GuestAddress, GuestMemory, GuestMemoryMmap, GuestRegionMmap, Iommu, IommuMemory,
    Iotlb, MmapRegion, Permissions, VolatileSlice,
};

/// Guest memory of one port as the queues and the RDMA engine see it: IOVAs
/// translated through the port's IOTLB when the IOMMU is enabled, guest
/// physical addresses otherwise.
pub type PortMemory = IommuMemory<GuestMemoryMmap, PortIommu>;

/// Most regions one memory table may have: one file descriptor per region,
/// and a vhost-user message carries at most this many.
pub const MAX_REGIONS: usize = vhost::vhost_user::message::MAX_ATTACHED_FD_ENTRIES;

/// Default bound on the bytes one port may map (`--max-mapped-bytes-per-port`).
///
/// 64 GiB is far above what the test guests (hundreds of MiB) and the
/// driver's DMA arena (64 MiB by default) need, and small enough that the
/// 128 TiB of a 47-bit user address space hold the memory tables of 1024
/// ports (the most `--ports` allows) twice over, an old table and its
/// replacement each.
pub const DEFAULT_MAX_MAPPED_BYTES_PER_PORT: u64 = 64 << 30;

/// Errors of the memory table and of address translation.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum MemError {
    /// The table as a whole is unacceptable (no regions, too many, or not
    /// one file descriptor per region).
    #[error("invalid memory table: {0}")]
    Table(String),
    /// A memory table region is malformed (zero size, overflow, overlap,
    /// past the end of its file, a backing that is not a regular file).
    #[error("invalid memory region {index}: {reason}")]
    InvalidRegion {
        /// Index of the region in the message.
        index: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// Mapping the table would exceed the port's bound on mapped bytes.
    #[error("memory table of {total} bytes exceeds the port's limit of {max} mapped bytes")]
    Limit {
        /// Bytes the table would map (each region rounded up to pages).
        total: u64,
        /// The bound (`--max-mapped-bytes-per-port`).
        max: u64,
    },
    /// Mapping a region failed.
    #[error("cannot map memory region {index}: {reason}")]
    Map {
        /// Index of the region in the message.
        index: usize,
        /// The OS error.
        reason: String,
    },
    /// The range is not (fully) mapped by the IOTLB.
    #[error("IOTLB miss at {iova:#x}")]
    Miss {
        /// First unmapped address.
        iova: u64,
    },
    /// The range is mapped, but not with the requested permission.
    #[error("access denied at {iova:#x}")]
    Denied {
        /// First address without the permission.
        iova: u64,
    },
    /// The range is not backed by the memory table.
    #[error("address range {addr:#x}+{len:#x} is not backed by frontend memory")]
    Unbacked {
        /// Start of the range.
        addr: u64,
        /// Its length.
        len: u64,
    },
    /// `addr + len` overflows, or an entry is empty.
    #[error("invalid address range {addr:#x}+{len:#x}")]
    BadRange {
        /// Start of the range.
        addr: u64,
        /// Its length.
        len: u64,
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
///
/// Which backings are accepted, and why:
/// - Only regular files (memfds, tmpfs and hugetlbfs files, files on
///   disk): their size is known, so every region is checked to lie inside
///   its file. Character devices (`/dev/zero`, `/dev/mem`), pipes, sockets,
///   directories and block devices are refused: they have no size to check
///   a region against, and some map without bound.
/// - A memfd sealed with `F_SEAL_SHRINK` (QEMU's memfd backend seals by
///   default) cannot shrink, so its pages cannot go away under the device.
/// - Every other regular file can shrink (or, on hugetlbfs, fail to supply
///   a page) after it was mapped. Such mappings are watched by the SIGBUS
///   guard ([`crate::sigbus`]): a lost page becomes a zero page and the
///   mapping is marked poisoned, which [`MemoryTable::poisoned_region`]
///   reports so that the port resets instead of the device dying.
#[derive(Debug, Clone)]
pub struct MemoryTable {
    regions: Vec<RegionDesc>,
    mmap: GuestMemoryMmap,
    /// The SIGBUS guard of each region that can shrink (`None`: sealed).
    guards: Vec<Option<Guarded>>,
    mapped_bytes: u64,
}

impl Drop for MemoryTable {
    fn drop(&mut self) {
        // Drop our references first, so that mappings nobody uses any more
        // are unmapped now rather than at the next table.
        self.guards.clear();
        self.mmap = GuestMemoryMmap::new();
        crate::sigbus::release_unused();
    }
}

/// What the device learnt about the file behind one region.
#[derive(Debug, Clone, Copy)]
struct Backing {
    /// File size in bytes.
    size: u64,
    /// Page size of the mapping (the huge page size on hugetlbfs).
    page: u64,
    /// Whether the file can shrink (or lose pages) after it is mapped.
    shrinkable: bool,
}

/// Describes a file type for an error message.
fn file_kind(t: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_fifo() {
        "a pipe"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_dir() {
        "a directory"
    } else {
        "not a regular file"
    }
}

fn system_page() -> u64 {
    // SAFETY: sysconf has no memory effects.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(page).unwrap_or(4096).max(4096)
}

/// Checks the file behind a region: regular, its size, its page size, and
/// whether it is sealed against shrinking.
fn inspect(file: &File) -> Result<Backing, String> {
    let meta = file.metadata().map_err(|e| format!("fstat failed: {e}"))?;
    if !meta.file_type().is_file() {
        return Err(format!(
            "the file descriptor is {}; only regular files (memfd, tmpfs, hugetlbfs) are accepted",
            file_kind(meta.file_type())
        ));
    }
    let fd = file.as_raw_fd();
    // SAFETY: a zeroed statfs is a valid value; fstatfs writes into it and
    // only reads the descriptor, which `file` keeps open.
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let hugetlb = unsafe { libc::fstatfs(fd, &mut fs) } == 0 && fs.f_type == libc::HUGETLBFS_MAGIC;
    let page = if hugetlb {
        u64::try_from(fs.f_bsize).unwrap_or(0).max(system_page())
    } else {
        system_page()
    };
    // SAFETY: F_GET_SEALS reads the seals of a descriptor we hold; it
    // fails (EINVAL) for files that cannot be sealed.
    let seals = unsafe { libc::fcntl(fd, libc::F_GET_SEALS) };
    let sealed = seals >= 0 && seals & libc::F_SEAL_SHRINK != 0;
    Ok(Backing {
        size: meta.size(),
        page,
        // A sealed hugetlbfs file cannot shrink, but a hole punched into it
        // may find the huge page pool empty when touched again.
        shrinkable: !sealed || hugetlb,
    })
}

impl MemoryTable {
    /// Maps `files[i]` for `regions[i]` (shared, read-write), without a
    /// bound on the bytes mapped. See [`MemoryTable::map_limited`].
    pub fn map(regions: &[RegionDesc], files: Vec<File>) -> Result<Self, MemError> {
        Self::map_limited(regions, files, u64::MAX)
    }

    /// Maps `files[i]` for `regions[i]` (shared, read-write), mapping at
    /// most `max_bytes` in all.
    ///
    /// Refuses a table with no region, more than [`MAX_REGIONS`], or not
    /// exactly one file per region; regions that are empty, overflow,
    /// overlap another (in guest physical or in frontend addresses), start
    /// at a file offset that is not page aligned, or reach past the end of
    /// their file; files that are not regular files; and tables larger
    /// than `max_bytes`. Nothing is mapped unless everything is accepted.
    pub fn map_limited(
        regions: &[RegionDesc],
        files: Vec<File>,
        max_bytes: u64,
    ) -> Result<Self, MemError> {
        if regions.is_empty() {
            return Err(MemError::Table("no regions".into()));
        }
        if regions.len() > MAX_REGIONS {
            return Err(MemError::Table(format!(
                "{} regions, at most {MAX_REGIONS} allowed",
                regions.len()
            )));
        }
        if regions.len() != files.len() {
            return Err(MemError::Table(format!(
                "{} regions but {} file descriptors",
                regions.len(),
                files.len()
            )));
        }
        for (index, r) in regions.iter().enumerate() {
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
            if usize::try_from(r.size).is_err() {
                return Err(bad("too large"));
            }
            for (other, o) in regions[..index].iter().enumerate() {
                let overlap = |a: u64, b: u64| a < b + o.size && b < a + r.size;
                if overlap(r.gpa, o.gpa) {
                    return Err(bad(&format!(
                        "overlaps region {other} in guest physical addresses"
                    )));
                }
                if overlap(r.uaddr, o.uaddr) {
                    return Err(bad(&format!(
                        "overlaps region {other} in frontend addresses"
                    )));
                }
            }
        }
        let mut backings = Vec::with_capacity(files.len());
        let mut total: u64 = 0;
        for (index, (r, file)) in regions.iter().zip(&files).enumerate() {
            let bad = |reason: String| MemError::InvalidRegion { index, reason };
            let b = inspect(file).map_err(bad)?;
            if r.mmap_offset % b.page != 0 {
                return Err(bad(format!(
                    "file offset {:#x} is not a multiple of the page size {:#x}",
                    r.mmap_offset, b.page
                )));
            }
            if b.page > system_page() && r.size % b.page != 0 {
                return Err(bad(format!(
                    "size {:#x} is not a multiple of the huge page size {:#x}",
                    r.size, b.page
                )));
            }
            if r.mmap_offset + r.size > b.size {
                return Err(bad(format!(
                    "offset {:#x} + size {:#x} reaches past the end of its file ({:#x} bytes)",
                    r.mmap_offset, r.size, b.size
                )));
            }
            let rounded = r.size.div_ceil(b.page).saturating_mul(b.page);
            total = total.saturating_add(rounded);
            backings.push(b);
        }
        if total > max_bytes {
            return Err(MemError::Limit {
                total,
                max: max_bytes,
            });
        }
        let mut mapped = Vec::with_capacity(regions.len());
        let mut guards = Vec::with_capacity(regions.len());
        for (index, ((r, file), b)) in regions.iter().zip(files).zip(&backings).enumerate() {
            let map_error = |reason: String| MemError::Map { index, reason };
            // Checked above: the size fits usize.
            let size = r.size as usize;
            let region = MmapRegion::from_file(FileOffset::new(file, r.mmap_offset), size)
                .map_err(|e| map_error(e.to_string()))?;
            let region = std::sync::Arc::new(region);
            guards.push(if b.shrinkable {
                let page = usize::try_from(b.page).unwrap_or(usize::MAX);
                Some(
                    crate::sigbus::guard(std::sync::Arc::clone(&region), page)
                        .map_err(|e| map_error(e.to_string()))?,
                )
            } else {
                None
            });
            let region = GuestRegionMmap::with_arc(region, GuestAddress(r.gpa))
                .ok_or_else(|| map_error("region does not fit the guest address space".into()))?;
            mapped.push(region);
        }
        let mmap = GuestMemoryMmap::from_regions(mapped)
            .map_err(|e| MemError::Table(format!("regions rejected by the memory map: {e}")))?;
        Ok(MemoryTable {
            regions: regions.to_vec(),
            mmap,
            guards,
            mapped_bytes: total,
        })
    }

    /// Bytes mapped for this table (each region rounded up to its pages).
    pub fn mapped_bytes(&self) -> u64 {
        self.mapped_bytes
    }

    /// How many regions can shrink under the device and are watched by the
    /// SIGBUS guard (the others are memfds sealed against shrinking).
    pub fn guarded_regions(&self) -> usize {
        self.guards.iter().flatten().count()
    }

    /// The first region whose file shrank (or lost pages) after it was
    /// mapped: the device touched a lost page and now sees zeros there.
    /// The port must stop using this memory.
    pub fn poisoned_region(&self) -> Option<usize> {
        self.guards
            .iter()
            .position(|g| g.as_ref().is_some_and(Guarded::poisoned))
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

/// One IOTLB entry: `[iova, iova + len)` maps to `[uaddr, uaddr + len)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IotlbEntry {
    /// Length of the mapping in bytes (never 0).
    pub len: u64,
    /// Frontend virtual address the IOVA maps to.
    pub uaddr: u64,
    /// Allowed accesses.
    pub perm: Permissions,
    seq: u64,
}

/// One translated piece of an IOVA range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Translation {
    /// IOVA of the piece.
    pub iova: u64,
    /// Frontend virtual address it maps to.
    pub uaddr: u64,
    /// Length of the piece.
    pub len: u64,
}

/// The device IOTLB of one port: non-overlapping IOVA ranges mapped to
/// frontend virtual addresses, bounded in entries (the oldest entry is
/// evicted first; an evicted entry only costs a later miss).
#[derive(Debug, Clone)]
pub struct IotlbTable {
    entries: BTreeMap<u64, IotlbEntry>,
    max_entries: usize,
    next_seq: u64,
}

impl IotlbTable {
    /// An empty table holding at most `max_entries` entries (at least 1).
    pub fn new(max_entries: usize) -> Self {
        IotlbTable {
            entries: BTreeMap::new(),
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

    /// Maps `[iova, iova + len)` to `[uaddr, uaddr + len)`, replacing any
    /// overlapping mappings. Returns how many entries were evicted.
    pub fn update(
        &mut self,
        iova: u64,
        len: u64,
        uaddr: u64,
        perm: Permissions,
    ) -> Result<usize, MemError> {
        if len == 0 || iova.checked_add(len).is_none() || uaddr.checked_add(len).is_none() {
            return Err(MemError::BadRange { addr: iova, len });
        }
        if perm == Permissions::No {
            self.invalidate(iova, len);
            return Ok(0);
        }
        self.remove_range(iova, iova + len);
        let seq = self.next_seq;
        self.next_seq += 1;
        self.entries.insert(
            iova,
            IotlbEntry {
                len,
                uaddr,
                perm,
                seq,
            },
        );
        let mut evicted = 0;
        while self.entries.len() > self.max_entries {
            let oldest = self
                .entries
                .iter()
                .min_by_key(|(_, e)| e.seq)
                .map(|(k, _)| *k);
            match oldest {
                Some(k) => {
                    self.entries.remove(&k);
                    evicted += 1;
                }
                None => break,
            }
        }
        Ok(evicted)
    }

    /// Removes every mapping of `[iova, iova + len)`; parts of entries
    /// outside the range stay. `len == 0` or an overflowing range
    /// invalidates up to the end of the address space.
    pub fn invalidate(&mut self, iova: u64, len: u64) {
        let end = if len == 0 {
            u64::MAX
        } else {
            iova.saturating_add(len)
        };
        self.remove_range(iova, end);
    }

    /// Removes all entries.
    pub fn clear(&mut self) {
        self.entries.clear();
    }

    fn remove_range(&mut self, start: u64, end: u64) {
        if start >= end {
            return;
        }
        let mut hit: Vec<u64> = Vec::new();
        if let Some((&k, e)) = self.entries.range(..start).next_back() {
            if k + e.len > start {
                hit.push(k);
            }
        }
        hit.extend(self.entries.range(start..end).map(|(k, _)| *k));
        for k in hit {
            let Some(e) = self.entries.remove(&k) else {
                continue;
            };
            let e_end = k + e.len;
            if k < start {
                self.entries.insert(
                    k,
                    IotlbEntry {
                        len: start - k,
                        ..e
                    },
                );
            }
            if e_end > end {
                self.entries.insert(
                    end,
                    IotlbEntry {
                        len: e_end - end,
                        uaddr: e.uaddr + (end - k),
                        ..e
                    },
                );
            }
        }
    }

    /// Translates `[iova, iova + len)` for `access` into frontend virtual
    /// address pieces. Fails with the first unmapped or forbidden address.
    pub fn translate(
        &self,
        iova: u64,
        len: u64,
        access: Permissions,
    ) -> Result<Vec<Translation>, MemError> {
        let end = iova
            .checked_add(len)
            .ok_or(MemError::BadRange { addr: iova, len })?;
        let mut out = Vec::new();
        let mut cur = iova;
        while cur < end {
            let (k, e) = self
                .entries
                .range(..=cur)
                .next_back()
                .filter(|(k, e)| **k + e.len > cur)
                .ok_or(MemError::Miss { iova: cur })?;
            if !e.perm.allow(access) {
                return Err(MemError::Denied { iova: cur });
            }
            let piece_end = end.min(k + e.len);
            out.push(Translation {
                iova: cur,
                uaddr: e.uaddr + (cur - k),
                len: piece_end - cur,
            });
            cur = piece_end;
        }
        Ok(out)
    }

    /// Builds vm-memory's IOTLB (IOVA to guest physical) for this table
    /// over `table`. Parts that the memory table does not back are left
    /// out, so accessing them is a miss.
    pub fn to_vm_iotlb(&self, table: &MemoryTable) -> Iotlb {
        let mut tlb = Iotlb::new();
        for (iova, e) in self.iter() {
            for (off, gpa, len) in table.uaddr_segments(e.uaddr, e.len) {
                if let Ok(len) = usize::try_from(len) {
                    // Entries never overflow (checked at insertion).
                    let _ =
                        tlb.set_mapping(GuestAddress(iova + off), GuestAddress(gpa), len, e.perm);
                }
            }
        }
        tlb
    }
}

/// A failed access recorded by [`PortIommu`] so the port can ask the
/// frontend for the mapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    /// First address that failed.
    pub iova: u64,
    /// Access that was attempted.
    pub access: Permissions,
    /// Whether the address was mapped (but without the permission).
    pub denied: bool,
}

/// The IOMMU of a port as vm-memory sees it: a read-mostly IOTLB mirror plus
/// a record of faults (misses are never waited for; the caller sends an
/// IOTLB MISS and retries after the UPDATE).
#[derive(Debug, Default)]
pub struct PortIommu {
    tlb: RwLock<Iotlb>,
    faults: Mutex<Vec<Fault>>,
    events: AtomicU64,
}

impl PortIommu {
    /// Replaces the IOTLB mirror.
    pub fn set_tlb(&self, tlb: Iotlb) {
        *self.tlb.write().unwrap_or_else(|e| e.into_inner()) = tlb;
    }

    /// Takes the faults recorded since the last call.
    pub fn take_faults(&self) -> Vec<Fault> {
        std::mem::take(&mut *self.faults.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Whether faults were recorded and not taken yet.
    pub fn has_faults(&self) -> bool {
        !self
            .faults
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty()
    }

    /// Number of faults seen so far (a counter that only grows: compare
    /// it before and after an access to detect a miss).
    pub fn fault_count(&self) -> u64 {
        self.events.load(Ordering::Relaxed)
    }

    /// Whether `[iova, iova + length)` is mapped but not with `access`
    /// (as opposed to a miss: some part is not mapped at all).
    pub fn denied(&self, iova: u64, length: usize, access: Permissions) -> bool {
        if length == 0 || iova.checked_add(length as u64).is_none() {
            return false;
        }
        let guard = self.tlb.read().unwrap_or_else(|e| e.into_inner());
        match Iotlb::lookup(guard, GuestAddress(iova), length, access) {
            Ok(_) => false,
            Err(fails) => fails.misses.is_empty() && !fails.access_fails.is_empty(),
        }
    }

    fn record(&self, fault: Fault) {
        self.events.fetch_add(1, Ordering::Relaxed);
        let mut f = self.faults.lock().unwrap_or_else(|e| e.into_inner());
        if f.len() < 64 && !f.contains(&fault) {
            f.push(fault);
        }
    }
}

impl Iommu for PortIommu {
    type IotlbGuard<'a> = RwLockReadGuard<'a, Iotlb>;

    fn translate(
        &self,
        iova: GuestAddress,
        length: usize,
        access: Permissions,
    ) -> Result<IotlbIterator<Self::IotlbGuard<'_>>, IommuError> {
        let fail = |reason: &str| IommuError::CannotResolve {
            iova_range: IovaRange { base: iova, length },
            reason: reason.to_string(),
        };
        // Iotlb::lookup computes `iova + length` unchecked, and an empty
        // range would confuse its gap search: refuse both here.
        let len = length as u64;
        if length == 0 || iova.0.checked_add(len).is_none() {
            return Err(fail("empty or overflowing range"));
        }
        let guard = self.tlb.read().unwrap_or_else(|e| e.into_inner());
        match Iotlb::lookup(guard, iova, length, access) {
            Ok(it) => Ok(it),
            Err(fails) => {
                if let Some(m) = fails.misses.first() {
                    self.record(Fault {
                        iova: m.base.0,
                        access,
                        denied: false,
                    });
                } else if let Some(a) = fails.access_fails.first() {
                    self.record(Fault {
                        iova: a.base.0,
                        access,
                        denied: true,
                    });
                }
                Err(fail("not mapped with the requested access"))
            }
        }
    }
}

/// Creates the port memory for `table`, with the IOMMU enabled or not.
pub fn new_port_memory(table: &MemoryTable, iotlb: &IotlbTable, iommu: bool) -> PortMemory {
    let port_iommu = PortIommu::default();
    port_iommu.set_tlb(iotlb.to_vm_iotlb(table));
    IommuMemory::new(table.mmap().clone(), port_iommu, iommu, ())
}

/// Returns volatile slices covering `[addr, addr + len)` of `mem` for
/// `access`, or an error (memory untouched) if any byte is not accessible.
///
/// With the IOMMU enabled `addr` is an IOVA; otherwise a guest physical
/// address. A miss is also recorded in the IOMMU's faults, so the port
/// asks the frontend for the mapping.
pub fn slices(
    mem: &PortMemory,
    addr: u64,
    len: usize,
    access: Permissions,
) -> Result<Vec<VolatileSlice<'_, ()>>, MemError> {
    let bad = MemError::BadRange {
        addr,
        len: len as u64,
    };
    if addr.checked_add(len as u64).is_none() {
        return Err(bad);
    }
    if len == 0 {
        return Ok(Vec::new());
    }
    if !mem.check_range(GuestAddress(addr), len, access) {
        if mem.get_iommu_enabled() {
            let faults = mem.iommu().take_faults();
            let first = faults.first().copied();
            // Keep them for the port, which sends the MISS messages.
            let mut kept = mem.iommu().faults.lock().unwrap_or_else(|e| e.into_inner());
            kept.extend(faults);
            drop(kept);
            return Err(match first {
                Some(f) if f.denied => MemError::Denied { iova: f.iova },
                Some(f) => MemError::Miss { iova: f.iova },
                None => MemError::Unbacked {
                    addr,
                    len: len as u64,
                },
            });
        }
        return Err(MemError::Unbacked {
            addr,
            len: len as u64,
        });
    }
    let iter = mem
        .get_slices(GuestAddress(addr), len, access)
        .map_err(|_| bad.clone())?;
    let mut out = Vec::new();
    let mut total = 0usize;
    for s in iter {
        let s = s.map_err(|_| bad.clone())?;
        total += s.len();
        out.push(s);
    }
    if total != len {
        return Err(bad);
    }
    Ok(out)
}

/// Converts a vhost IOTLB permission byte (VHOST_ACCESS_*) to [`Permissions`].
pub fn perm_from_vhost(perm: u8) -> Option<Permissions> {
    match perm {
        0 => Some(Permissions::No),
        1 => Some(Permissions::Read),
        2 => Some(Permissions::Write),
        3 => Some(Permissions::ReadWrite),
        _ => None,
    }
}

/// Converts [`Permissions`] to a vhost IOTLB permission byte.
pub fn perm_to_vhost(perm: Permissions) -> u8 {
    perm as u8
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use vm_memory::Bytes;

    const R: Permissions = Permissions::Read;
    const W: Permissions = Permissions::Write;
    const RW: Permissions = Permissions::ReadWrite;

    #[test]
    fn translate_single_entry() {
        let mut t = IotlbTable::new(16);
        t.update(0x1000, 0x1000, 0x7f00_0000, RW).unwrap();
        let tr = t.translate(0x1800, 0x100, R).unwrap();
        assert_eq!(
            tr,
            vec![Translation {
                iova: 0x1800,
                uaddr: 0x7f00_0800,
                len: 0x100
            }]
        );
        assert_eq!(t.translate(0x1800, 0, R).unwrap(), vec![]);
    }

    #[test]
    fn translate_crosses_entries() {
        let mut t = IotlbTable::new(16);
        t.update(0x1000, 0x1000, 0xa000, RW).unwrap();
        t.update(0x2000, 0x1000, 0x5000, RW).unwrap();
        let tr = t.translate(0x1f00, 0x200, W).unwrap();
        assert_eq!(
            tr,
            vec![
                Translation {
                    iova: 0x1f00,
                    uaddr: 0xaf00,
                    len: 0x100
                },
                Translation {
                    iova: 0x2000,
                    uaddr: 0x5000,
                    len: 0x100
                },
            ]
        );
    }

    #[test]
    fn translate_gap_is_a_miss() {
        let mut t = IotlbTable::new(16);
        t.update(0x1000, 0x1000, 0xa000, RW).unwrap();
        t.update(0x3000, 0x1000, 0xb000, RW).unwrap();
        assert_eq!(
            t.translate(0x1f00, 0x2000, R),
            Err(MemError::Miss { iova: 0x2000 })
        );
        assert_eq!(t.translate(0x0, 1, R), Err(MemError::Miss { iova: 0 }));
        assert_eq!(
            t.translate(0x3fff, 2, R),
            Err(MemError::Miss { iova: 0x4000 })
        );
    }

    #[test]
    fn translate_checks_permissions() {
        let mut t = IotlbTable::new(16);
        t.update(0x1000, 0x1000, 0xa000, R).unwrap();
        t.update(0x2000, 0x1000, 0xb000, W).unwrap();
        assert!(t.translate(0x1000, 0x1000, R).is_ok());
        assert_eq!(
            t.translate(0x1000, 0x10, W),
            Err(MemError::Denied { iova: 0x1000 })
        );
        assert_eq!(
            t.translate(0x1ff0, 0x20, R),
            Err(MemError::Denied { iova: 0x2000 })
        );
        assert_eq!(
            t.translate(0x1ff0, 0x20, RW),
            Err(MemError::Denied { iova: 0x1ff0 })
        );
    }

    #[test]
    fn overflow_and_empty_are_refused() {
        let mut t = IotlbTable::new(16);
        assert!(t.update(u64::MAX - 1, 4, 0, RW).is_err());
        assert!(t.update(0, 0, 0, RW).is_err());
        assert!(t.update(0, 4, u64::MAX, RW).is_err());
        assert!(t.translate(u64::MAX, 2, R).is_err());
        assert!(t.is_empty());
    }

    #[test]
    fn update_replaces_overlap_and_invalidate_splits() {
        let mut t = IotlbTable::new(16);
        t.update(0x0, 0x4000, 0x10000, RW).unwrap();
        t.update(0x1000, 0x1000, 0x90000, R).unwrap();
        assert_eq!(t.len(), 3);
        assert_eq!(t.translate(0x1000, 1, R).unwrap()[0].uaddr, 0x90000);
        assert_eq!(t.translate(0x2000, 1, R).unwrap()[0].uaddr, 0x12000);
        assert_eq!(t.translate(0x0fff, 1, R).unwrap()[0].uaddr, 0x10fff);
        t.invalidate(0x800, 0x2000);
        assert_eq!(t.translate(0x7ff, 1, R).unwrap()[0].uaddr, 0x107ff);
        assert_eq!(
            t.translate(0x800, 1, R),
            Err(MemError::Miss { iova: 0x800 })
        );
        assert_eq!(
            t.translate(0x27ff, 1, R),
            Err(MemError::Miss { iova: 0x27ff })
        );
        assert_eq!(t.translate(0x2800, 1, R).unwrap()[0].uaddr, 0x12800);
        t.invalidate(0, 0);
        assert!(t.is_empty());
    }

    #[test]
    fn oldest_entries_are_evicted() {
        let mut t = IotlbTable::new(2);
        t.update(0x1000, 0x1000, 0x1000, RW).unwrap();
        t.update(0x3000, 0x1000, 0x3000, RW).unwrap();
        assert_eq!(t.update(0x2000, 0x1000, 0x2000, RW).unwrap(), 1);
        assert_eq!(t.len(), 2);
        assert!(t.translate(0x1000, 1, R).is_err());
        assert!(t.translate(0x2000, 0x2000, R).is_ok());
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

    fn region(gpa: u64, uaddr: u64, size: u64) -> RegionDesc {
        RegionDesc {
            gpa,
            size,
            uaddr,
            mmap_offset: 0,
        }
    }

    fn file_of(size: u64) -> File {
        let f = tempfile::tempfile().unwrap();
        f.set_len(size).unwrap();
        f
    }

    fn refusal(regions: &[RegionDesc], files: Vec<File>) -> String {
        MemoryTable::map(regions, files).unwrap_err().to_string()
    }

    #[test]
    fn tables_without_one_fd_per_region_are_refused() {
        let r = region(0, 0x10000, 0x1000);
        assert!(refusal(&[], vec![]).contains("no regions"));
        assert!(refusal(&[r], vec![]).contains("1 regions but 0 file descriptors"));
        assert!(refusal(&[r], vec![file_of(0x1000), file_of(0x1000)])
            .contains("1 regions but 2 file descriptors"));
        let n = MAX_REGIONS as u64 + 1;
        let many: Vec<RegionDesc> = (0..n).map(|i| region(i << 20, i << 20, 0x1000)).collect();
        let files = (0..n).map(|_| file_of(0x1000)).collect();
        assert!(refusal(&many, files).contains("33 regions, at most 32"));
    }

    #[test]
    fn overlapping_regions_are_refused() {
        let a = region(0x10000, 0x7000_0000, 0x2000);
        let gpa = region(0x11000, 0x9000_0000, 0x2000);
        let e = refusal(&[a, gpa], vec![file_of(0x2000), file_of(0x2000)]);
        assert!(
            e.contains("region 1") && e.contains("guest physical"),
            "{e}"
        );
        let user = region(0x40000, 0x7000_1fff, 0x1000);
        let e = refusal(&[a, user], vec![file_of(0x2000), file_of(0x1000)]);
        assert!(
            e.contains("region 1") && e.contains("frontend addresses"),
            "{e}"
        );
        // Adjacent is fine.
        let next = region(0x12000, 0x7000_2000, 0x1000);
        assert!(MemoryTable::map(&[a, next], vec![file_of(0x2000), file_of(0x1000)]).is_ok());
    }

    #[test]
    fn regions_must_lie_inside_page_aligned_regular_files() {
        let r = region(0, 0x10000, 0x1000);
        let e = refusal(
            &[RegionDesc {
                mmap_offset: 0x1000,
                ..r
            }],
            vec![file_of(0x1800)],
        );
        assert!(e.contains("past the end of its file"), "{e}");
        let e = refusal(
            &[RegionDesc {
                mmap_offset: 0x800,
                ..r
            }],
            vec![file_of(0x4000)],
        );
        assert!(e.contains("not a multiple of the page size"), "{e}");

        let zero = File::open("/dev/zero").unwrap();
        let e = refusal(&[r], vec![zero]);
        assert!(e.contains("a character device"), "{e}");
        let (reader, _writer) = pipe();
        assert!(refusal(&[r], vec![reader]).contains("a pipe"));
        let (sock, _peer) = std::os::unix::net::UnixStream::pair().unwrap();
        let sock = File::from(std::os::fd::OwnedFd::from(sock));
        assert!(refusal(&[r], vec![sock]).contains("a socket"));
        let dir = File::open(std::env::temp_dir()).unwrap();
        assert!(refusal(&[r], vec![dir]).contains("a directory"));
    }

    fn pipe() -> (File, File) {
        let mut fds = [0; 2];
        // SAFETY: pipe writes two new descriptors into `fds`, which we own.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        use std::os::fd::FromRawFd;
        // SAFETY: both descriptors were just created and are owned by nobody else.
        unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) }
    }

    #[test]
    fn the_bound_on_mapped_bytes_counts_whole_pages() {
        let a = region(0, 0x10000, 0x1000);
        let b = region(0x10000, 0x20000, 0x1001);
        let files = || vec![file_of(0x2000), file_of(0x2000)];
        let e = MemoryTable::map_limited(&[a, b], files(), 0x2fff).unwrap_err();
        assert_eq!(
            e,
            MemError::Limit {
                total: 0x3000,
                max: 0x2fff
            }
        );
        let t = MemoryTable::map_limited(&[a, b], files(), 0x3000).unwrap();
        assert_eq!(t.mapped_bytes(), 0x3000);
    }

    #[test]
    fn sealed_memfds_need_no_guard_and_shrinking_files_poison_their_region() {
        let sealed = memfd::MemfdOptions::default()
            .allow_sealing(true)
            .create("sealed")
            .unwrap();
        sealed.as_file().set_len(0x2000).unwrap();
        sealed.add_seal(memfd::FileSeal::SealShrink).unwrap();
        let open = file_of(0x2000);
        let table = MemoryTable::map(
            &[region(0, 0x10000, 0x2000), region(0x10000, 0x20000, 0x2000)],
            vec![sealed.into_file(), open.try_clone().unwrap()],
        )
        .unwrap();
        assert_eq!(table.guarded_regions(), 1);
        assert_eq!(table.poisoned_region(), None);
        open.set_len(0).unwrap();
        let mut b = [1u8; 4];
        table
            .mmap()
            .read_slice(&mut b, GuestAddress(0x11000))
            .unwrap();
        assert_eq!(b, [0; 4], "a lost page reads as zeros");
        assert_eq!(table.poisoned_region(), Some(1));
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
    fn slices_follow_the_iotlb() {
        let table = memfd_table(0x10_0000, 0x7f00_0000, 0x4000);
        let mut tlb = IotlbTable::new(16);
        // IOVA 0x2000..0x3000 -> uaddr page 3, IOVA 0x3000..0x4000 -> page 0 (read-only).
        tlb.update(0x2000, 0x1000, 0x7f00_3000, RW).unwrap();
        tlb.update(0x3000, 0x1000, 0x7f00_0000, R).unwrap();
        let mem = new_port_memory(&table, &tlb, true);

        let s = slices(&mem, 0x2ff0, 0x20, Permissions::Read).unwrap();
        assert_eq!(s.iter().map(|s| s.len()).sum::<usize>(), 0x20);
        assert_eq!(s.len(), 2);

        let w = slices(&mem, 0x2800, 0x10, Permissions::Write).unwrap();
        w[0].write_slice(&[7u8; 16], 0).unwrap();
        let mut back = [0u8; 16];
        table
            .mmap()
            .read_slice(&mut back, GuestAddress(0x10_3800))
            .unwrap();
        assert_eq!(back, [7u8; 16]);

        // Write into the read-only part: denied, memory untouched.
        assert_eq!(
            slices(&mem, 0x3000, 0x10, Permissions::Write).unwrap_err(),
            MemError::Denied { iova: 0x3000 }
        );
        // Unmapped: a miss, recorded for the port.
        mem.iommu().take_faults();
        assert_eq!(
            slices(&mem, 0x5000, 0x10, Permissions::Read).unwrap_err(),
            MemError::Miss { iova: 0x5000 }
        );
        assert_eq!(mem.iommu().take_faults()[0].iova, 0x5000);
        assert!(slices(&mem, u64::MAX, 2, Permissions::Read).is_err());

        // Without the IOMMU, addresses are guest physical.
        let phys = new_port_memory(&table, &tlb, false);
        assert!(slices(&phys, 0x10_0000, 0x4000, Permissions::Write).is_ok());
        assert!(slices(&phys, 0x10_3fff, 2, Permissions::Read).is_err());
    }
}
