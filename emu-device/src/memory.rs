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
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;

use thiserror::Error;

use crate::sigbus::Guarded;
use pindown_uapi::{IotlbMessage, VhostAccess};
use vm_memory::bitmap::BS;
use vm_memory::guest_memory::{GuestMemorySliceIterator, Result as GuestMemoryResult};
use vm_memory::iommu::{Error as IommuError, IovaRange};
use vm_memory::{
    Address, FileOffset, GuestAddress, GuestMemory, GuestMemoryBackend, GuestMemoryError,
    GuestMemoryMmap, GuestMemoryRegion, GuestRegionMmap, MemoryRegionAddress, MmapRegion,
    Permissions, VolatileSlice,
};

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

/// Errors of the memory table.
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
/// - Only regular files of memory file systems (memfds, tmpfs and
///   hugetlbfs files): their size is known, so every region is checked to
///   lie inside its file. Character devices (`/dev/zero`, `/dev/mem`),
///   pipes, sockets, directories and block devices are refused: they have
///   no size to check a region against, and some map without bound. Files
///   of disk, network or FUSE file systems are refused too: a page fault on
///   them waits for that storage (or for the frontend serving it), and the
///   device must never wait on a frontend.
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
    /// The file behind each region: (device, inode).
    files: Vec<(u64, u64)>,
    /// The mapping of each region (shared with a later table that keeps
    /// the region).
    mappings: Vec<std::sync::Arc<MmapRegion>>,
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
/// The (device, inode) of each file.
fn files_of(files: &[File]) -> std::io::Result<Vec<(u64, u64)>> {
    files
        .iter()
        .map(|f| f.metadata().map(|m| (m.dev(), m.ino())))
        .collect()
}

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
    if unsafe { libc::fstatfs(fd, &mut fs) } != 0 {
        return Err(format!(
            "fstatfs failed: {}",
            std::io::Error::last_os_error()
        ));
    }
    // Only memory file systems: a page fault on a file of a disk, network
    // or FUSE file system can wait as long as that storage (or the
    // frontend serving it) likes, while the faulting step holds the gates
    // of two ports.
    let hugetlb = fs.f_type == libc::HUGETLBFS_MAGIC;
    if !hugetlb && fs.f_type != libc::TMPFS_MAGIC {
        return Err(format!(
            "the file is on a file system of type {:#x}; only memory file systems \
             (memfd, tmpfs, hugetlbfs) are accepted",
            fs.f_type
        ));
    }
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
    /// most `max_bytes` in all. See [`MemoryTable::map_after`].
    pub fn map_limited(
        regions: &[RegionDesc],
        files: Vec<File>,
        max_bytes: u64,
    ) -> Result<Self, MemError> {
        Self::map_after(regions, files, max_bytes, None)
    }

    /// Maps `files[i]` for `regions[i]` (shared, read-write), mapping at
    /// most `max_bytes` in all. A region that `previous` has too, with the
    /// same description and the same file (device and inode), keeps its
    /// mapping (and its SIGBUS guard): a table that grows by one region
    /// maps one region, and the pages the device faulted in stay.
    ///
    /// Refuses a table with no region, more than [`MAX_REGIONS`], or not
    /// exactly one file per region; regions that are empty, overflow,
    /// overlap another (in guest physical or in frontend addresses), start
    /// at a file offset that is not page aligned, or reach past the end of
    /// their file; files that are not regular files; and tables larger
    /// than `max_bytes`. Nothing is mapped unless everything is accepted.
    pub fn map_after(
        regions: &[RegionDesc],
        files: Vec<File>,
        max_bytes: u64,
        previous: Option<&MemoryTable>,
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
        let file_ids =
            files_of(&files).map_err(|e| MemError::Table(format!("fstat failed: {e}")))?;
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
        let mut mappings = Vec::with_capacity(regions.len());
        for (index, ((r, file), b)) in regions.iter().zip(files).zip(&backings).enumerate() {
            let map_error = |reason: String| MemError::Map { index, reason };
            let kept = previous.and_then(|old| {
                (0..old.regions.len())
                    .find(|&j| old.regions[j] == *r && old.files[j] == file_ids[index])
                    .map(|j| (old.mappings[j].clone(), old.guards[j].clone()))
            });
            let (region, guard) = match kept {
                Some(kept) => kept,
                None => {
                    // Checked above: the size fits usize.
                    let size = r.size as usize;
                    let region = MmapRegion::from_file(FileOffset::new(file, r.mmap_offset), size)
                        .map_err(|e| map_error(e.to_string()))?;
                    let region = std::sync::Arc::new(region);
                    let guard = if b.shrinkable {
                        let page = usize::try_from(b.page).unwrap_or(usize::MAX);
                        Some(
                            crate::sigbus::guard(std::sync::Arc::clone(&region), page)
                                .map_err(|e| map_error(e.to_string()))?,
                        )
                    } else {
                        None
                    };
                    (region, guard)
                }
            };
            guards.push(guard);
            mappings.push(std::sync::Arc::clone(&region));
            let region = GuestRegionMmap::with_arc(region, GuestAddress(r.gpa))
                .ok_or_else(|| map_error("region does not fit the guest address space".into()))?;
            mapped.push(region);
        }
        // The frontend may list regions in any order; the memory map wants
        // them by guest physical address.
        mapped.sort_by_key(|region| region.start_addr());
        let mmap = GuestMemoryMmap::from_regions(mapped)
            .map_err(|e| MemError::Table(format!("regions rejected by the memory map: {e}")))?;
        Ok(MemoryTable {
            regions: regions.to_vec(),
            mmap,
            guards,
            mapped_bytes: total,
            files: file_ids,
            mappings,
        })
    }

    /// Whether `regions` backed by `files` keep every region of this table
    /// (same description, same file), adding others or not.
    pub fn is_kept_by(&self, regions: &[RegionDesc], files: &[File]) -> bool {
        let Ok(ids) = files_of(files) else {
            return false;
        };
        self.regions.iter().zip(&self.files).all(|(old, id)| {
            regions
                .iter()
                .zip(&ids)
                .any(|(new, new_id)| new == old && new_id == id)
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

    /// Whether `regions` backed by `files` describe this very table: the
    /// same regions of the same files (QEMU sends one table per queue
    /// pair). Same addresses over other files are another table.
    pub fn is_same(&self, regions: &[RegionDesc], files: &[File]) -> bool {
        self.regions == regions && files_of(files).is_ok_and(|ids| ids == self.files)
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

    /// Bytes the entries cover: the memory the frontend's driver has
    /// pinned and handed to the device (entries never overlap).
    pub fn covered_bytes(&self) -> u64 {
        self.entries.values().map(|e| e.len).sum()
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
            // The bytes the entries cover are the bytes the model maps.
            prop_assert_eq!(t.covered_bytes(), model.len() as u64);
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
        let mut f = tempfile::tempfile_in("/dev/shm").unwrap();
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
    fn a_table_that_keeps_regions_keeps_their_mappings_in_any_order() {
        let file = |fill: u8| {
            let mut f = tempfile::tempfile_in("/dev/shm").unwrap();
            f.write_all(&[fill; 0x2000]).unwrap();
            f
        };
        let desc = |gpa: u64| RegionDesc {
            gpa,
            size: 0x2000,
            uaddr: gpa,
            mmap_offset: 0,
        };
        let (a, b) = (file(1), file(2));
        let dup = |f: &File| f.try_clone().unwrap();
        let first = MemoryTable::map(&[desc(0x10_0000)], vec![dup(&a)]).unwrap();
        // One region more, listed first (tables need not be sorted).
        let regions = [desc(0x8_0000), desc(0x10_0000)];
        assert!(first.is_kept_by(&regions, &[dup(&b), dup(&a)]));
        let second =
            MemoryTable::map_after(&regions, vec![dup(&b), dup(&a)], u64::MAX, Some(&first))
                .unwrap();
        assert!(std::sync::Arc::ptr_eq(
            &first.mappings[0],
            &second.mappings[1]
        ));
        let mut byte = [0u8];
        second
            .mmap()
            .read_slice(&mut byte, GuestAddress(0x8_0000))
            .unwrap();
        assert_eq!(byte, [2]);
        second
            .mmap()
            .read_slice(&mut byte, GuestAddress(0x10_1fff))
            .unwrap();
        assert_eq!(byte, [1]);
        // Another file at the same place is not the same region: mapped
        // anew, and the old table is not kept.
        let c = file(3);
        assert!(!second.is_kept_by(&regions, &[dup(&b), dup(&c)]));
        let third =
            MemoryTable::map_after(&regions, vec![dup(&b), dup(&c)], u64::MAX, Some(&second))
                .unwrap();
        assert!(!std::sync::Arc::ptr_eq(
            &second.mappings[1],
            &third.mappings[1]
        ));
        third
            .mmap()
            .read_slice(&mut byte, GuestAddress(0x10_0000))
            .unwrap();
        assert_eq!(byte, [3]);
        // Dropping a region is not keeping it.
        assert!(!third.is_kept_by(&regions[..1], &[dup(&b)]));
    }

    #[test]
    fn memory_table_refuses_bad_regions() {
        let f = tempfile::tempfile_in("/dev/shm").unwrap();
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
        let f = tempfile::tempfile_in("/dev/shm").unwrap();
        f.set_len(size).unwrap();
        f
    }

    fn refusal(regions: &[RegionDesc], files: Vec<File>) -> String {
        MemoryTable::map(regions, files).unwrap_err().to_string()
    }

    #[test]
    fn files_outside_memory_file_systems_are_refused() {
        // The source tree lies on a disk file system, not in memory.
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let f = tempfile::tempfile_in(dir).unwrap();
        f.set_len(0x1000).unwrap();
        // SAFETY: a zeroed statfs is a valid value.
        let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
        // SAFETY: fstatfs writes into `fs` and reads a live fd.
        assert_eq!(unsafe { libc::fstatfs(f.as_raw_fd(), &mut fs) }, 0);
        assert_ne!(
            fs.f_type,
            libc::TMPFS_MAGIC,
            "{} must be on a disk file system for this test",
            dir.display()
        );
        let refused = refusal(&[region(0, 0x10000, 0x1000)], vec![f]);
        assert!(refused.contains("only memory file systems"), "{refused}");
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
