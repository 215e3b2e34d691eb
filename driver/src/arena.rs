//! The DMA arena: one memfd-backed shared memory region that the device maps.
//!
//! A device process can only reach memory it has mapped, so everything the
//! device touches (vrings, user buffers, bounce buffers) lives in memory the
//! driver shares with it by file descriptor. The arena is one such region:
//! a `memfd` (2 MiB huge pages when the system has them reserved, normal
//! pages otherwise) mapped read/write into this process, plus a thread-safe
//! first-fit allocator that hands out aligned chunks ([`DmaBuffer`]).
//!
//! The driver uses *identity IOVAs*: the I/O virtual address of a byte in the
//! arena is its virtual address in this process. Addresses placed in
//! descriptors are therefore plain pointers, and the transport describes the
//! arena to the device as one memory region ([`MemoryTableRegion`]) whose guest
//! address, userspace address and IOVA all coincide.

use std::collections::BTreeMap;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, RawFd};
use std::sync::Arc;

use memmap2::{MmapOptions, MmapRaw};
use parking_lot::Mutex;
use vm_memory::VolatileSlice;

/// Size of a 2 MiB huge page, the unit of a huge-page arena.
pub const HUGE_PAGE_SIZE: usize = 2 << 20;

/// Smallest alignment the allocator hands out: one cache line, so two chunks
/// never share a line (the device writes some of them concurrently).
pub const MIN_ALIGN: usize = 64;

/// Whether the arena should use huge pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HugePages {
    /// Try 2 MiB huge pages, fall back to normal pages if none are available.
    #[default]
    Try,
    /// Only huge pages; fail if they are not available.
    Require,
    /// Normal pages only.
    Never,
}

/// How to create a [`DmaArena`].
#[derive(Debug, Clone, Copy, Default)]
pub struct ArenaOptions {
    /// Huge-page policy.
    pub huge_pages: HugePages,
    /// Fault every page in at creation (`MAP_POPULATE`), so the first DMA
    /// does not pay for page faults.
    pub populate: bool,
}

/// Why the arena could not be created or could not allocate.
#[derive(Debug, thiserror::Error)]
pub enum ArenaError {
    /// The requested arena size is zero.
    #[error("an arena must have a non-zero size")]
    ZeroSize,
    /// A system call failed while creating the arena.
    #[error("cannot create the DMA arena: {operation} failed: {source}")]
    Os {
        /// The failing operation.
        operation: &'static str,
        /// The kernel's error.
        source: io::Error,
    },
    /// Huge pages were required but could not be had.
    #[error(
        "huge pages were required for the DMA arena but none could be mapped ({source}); \
         reserve some with `echo N > /proc/sys/vm/nr_hugepages`"
    )]
    NoHugePages {
        /// The kernel's error.
        source: io::Error,
    },
    /// An allocation asked for zero bytes or a bad alignment.
    #[error("invalid allocation request: {len} bytes aligned to {align} (alignment must be a power of two)")]
    InvalidRequest {
        /// Requested length.
        len: usize,
        /// Requested alignment.
        align: usize,
    },
    /// No free chunk is large enough.
    #[error("DMA arena exhausted: no free chunk of {len} bytes aligned to {align} ({free} bytes free in total)")]
    OutOfMemory {
        /// Requested length.
        len: usize,
        /// Requested alignment.
        align: usize,
        /// Bytes free in total (possibly fragmented).
        free: usize,
    },
    /// The arena was sealed ([`DmaArena::seal`]): a device may still
    /// write into chunks freed since, so nothing is handed out any more.
    #[error("the DMA arena is sealed: its device never confirmed it let go of the memory")]
    Sealed,
}

/// One region of the memory table, as a vhost-user `SET_MEM_TABLE` entry (or
/// a VFIO DMA mapping) describes it: a file, an offset into it, a size, and
/// where it is mapped in this process.
#[derive(Debug, Clone, Copy)]
pub struct MemoryTableRegion<'a> {
    /// The file backing the region (shared with the device).
    pub fd: BorrowedFd<'a>,
    /// Offset of the region in the file.
    pub file_offset: u64,
    /// Size in bytes.
    pub size: u64,
    /// Address of the region in this process.
    pub userspace_addr: u64,
    /// I/O virtual address (and guest physical address) of its first byte:
    /// equal to `userspace_addr` under identity IOVAs.
    pub iova: u64,
}

/// A memfd-backed, shared, read/write memory region with an allocator.
///
/// Create it with [`DmaArena::new`]; it is shared through `Arc` because every
/// [`DmaBuffer`] keeps its arena alive.
pub struct DmaArena {
    map: MmapRaw,
    file: File,
    size: usize,
    huge_pages: bool,
    free: Mutex<FreeList>,
}

impl std::fmt::Debug for DmaArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DmaArena")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("size", &self.size)
            .field("huge_pages", &self.huge_pages)
            .field("fd", &self.file.as_raw_fd())
            .finish()
    }
}

fn os_error(operation: &'static str) -> ArenaError {
    ArenaError::Os {
        operation,
        source: io::Error::last_os_error(),
    }
}

/// `value` rounded up to a multiple of `to` (nonzero); `None` past
/// `usize::MAX`.
fn round_up(value: usize, to: usize) -> Option<usize> {
    value.checked_next_multiple_of(to)
}

/// Creates a memfd of `size` bytes and maps it shared and read/write.
fn create_mapping(size: usize, huge: bool, populate: bool) -> Result<(File, MmapRaw), ArenaError> {
    let mut flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
    if huge {
        flags |= libc::MFD_HUGETLB | libc::MFD_HUGE_2MB;
    }
    // SAFETY: the name is a valid NUL-terminated string; memfd_create returns
    // a new descriptor or -1.
    let fd = unsafe { libc::memfd_create(c"pindown-dma-arena".as_ptr(), flags) };
    if fd < 0 {
        return Err(os_error("memfd_create"));
    }
    // SAFETY: `fd` was just returned by memfd_create and is owned by no one else.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(size as u64).map_err(|source| ArenaError::Os {
        operation: "ftruncate",
        source,
    })?;
    // Neither side may shrink the file under the other's mapping (that would
    // turn accesses into SIGBUS). Sealing is best effort: older kernels lack
    // it for hugetlbfs.
    // SAFETY: fcntl on a descriptor we own, with an integer argument.
    unsafe {
        libc::fcntl(
            file.as_raw_fd(),
            libc::F_ADD_SEALS,
            libc::F_SEAL_SHRINK | libc::F_SEAL_GROW,
        )
    };
    let mut options = MmapOptions::new();
    options.len(size);
    if populate {
        options.populate();
    }
    // A hugetlb mapping reserves its pages at mmap time, so a system without
    // free huge pages fails here (ENOMEM) rather than with SIGBUS later.
    let map = options.map_raw(&file).map_err(|source| ArenaError::Os {
        operation: "mmap",
        source,
    })?;
    Ok((file, map))
}

impl DmaArena {
    /// Creates an arena of at least `size` bytes, trying 2 MiB huge pages
    /// first (then the size is rounded up to a multiple of 2 MiB) and falling
    /// back to normal pages.
    pub fn new(size: usize) -> Result<Arc<Self>, ArenaError> {
        Self::with_options(size, ArenaOptions::default())
    }

    /// Creates an arena of at least `size` bytes as `options` say.
    pub fn with_options(size: usize, options: ArenaOptions) -> Result<Arc<Self>, ArenaError> {
        if size == 0 {
            return Err(ArenaError::ZeroSize);
        }
        let huge_attempt = match options.huge_pages {
            HugePages::Never => None,
            HugePages::Try | HugePages::Require => {
                let huge_size =
                    round_up(size, HUGE_PAGE_SIZE).ok_or(ArenaError::InvalidRequest {
                        len: size,
                        align: HUGE_PAGE_SIZE,
                    })?;
                Some((huge_size, create_mapping(huge_size, true, options.populate)))
            }
        };
        let (file, map, size, huge_pages) = match huge_attempt {
            Some((huge_size, Ok((file, map)))) => (file, map, huge_size, true),
            Some((_, Err(err))) if options.huge_pages == HugePages::Require => {
                return Err(match err {
                    ArenaError::Os { source, .. } => ArenaError::NoHugePages { source },
                    other => other,
                });
            }
            _ => {
                let page = crate::page_size();
                let size = round_up(size, page).ok_or(ArenaError::InvalidRequest {
                    len: size,
                    align: page,
                })?;
                let (file, map) = create_mapping(size, false, options.populate)?;
                (file, map, size, false)
            }
        };
        Ok(Arc::new(Self {
            map,
            file,
            size,
            huge_pages,
            free: Mutex::new(FreeList::new(size)),
        }))
    }

    /// Address of the first byte in this process (and its IOVA).
    pub fn addr(&self) -> u64 {
        self.map.as_mut_ptr() as u64
    }

    /// Size in bytes (a multiple of the page size in use).
    pub fn size(&self) -> usize {
        self.size
    }

    /// Whether the arena is backed by 2 MiB huge pages.
    pub fn uses_huge_pages(&self) -> bool {
        self.huge_pages
    }

    /// The memfd backing the arena (to pass to the device).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// The arena as one memory region for the transport.
    pub fn memory_table_region(&self) -> MemoryTableRegion<'_> {
        MemoryTableRegion {
            fd: self.fd(),
            file_offset: 0,
            size: self.size as u64,
            userspace_addr: self.addr(),
            iova: self.addr(),
        }
    }

    /// Whether `[addr, addr + len)` lies inside the arena.
    pub fn contains(&self, addr: u64, len: usize) -> bool {
        addr >= self.addr()
            && addr
                .checked_add(len as u64)
                .is_some_and(|end| end <= self.addr() + self.size as u64)
    }

    /// Copies `out.len()` bytes at address `addr` of the arena into `out`
    /// (volatile reads); `false`, with nothing copied, when the range is
    /// not inside the arena.
    pub fn read(&self, addr: u64, out: &mut [u8]) -> bool {
        if !self.contains(addr, out.len()) {
            return false;
        }
        let offset = (addr - self.addr()) as usize;
        // SAFETY: the range is inside the arena's live shared mapping
        // (checked above), which stays mapped while `self` lives;
        // VolatileSlice only performs volatile accesses, which tolerate
        // concurrent writers.
        let arena = unsafe { VolatileSlice::new(self.addr() as *mut u8, self.size) };
        arena
            .subslice(offset, out.len())
            .expect("range checked above")
            .copy_to(out);
        true
    }

    /// Bytes not handed out (possibly fragmented).
    pub fn free_bytes(&self) -> usize {
        self.free.lock().free_bytes()
    }

    /// Hands out nothing more: later allocations fail with
    /// [`ArenaError::Sealed`] and chunks freed from now on are kept
    /// (leaked) rather than reused. For an arena whose device may still
    /// write into memory it was given (it never confirmed the end of its
    /// connection, [`Transport::disconnect`](crate::transport::Transport::disconnect)).
    /// The memory itself goes when the last buffer does.
    pub fn seal(&self) {
        self.free.lock().sealed = true;
    }

    /// Whether [`seal`](Self::seal) was called.
    pub fn is_sealed(&self) -> bool {
        self.free.lock().sealed
    }

    /// Allocates `len` bytes aligned to `align` (a power of two; at least
    /// [`MIN_ALIGN`] is used). The chunk returns to the arena when the
    /// [`DmaBuffer`] is dropped. Its content is whatever was there before.
    pub fn alloc(self: &Arc<Self>, len: usize, align: usize) -> Result<DmaBuffer, ArenaError> {
        if len == 0 || !align.is_power_of_two() {
            return Err(ArenaError::InvalidRequest { len, align });
        }
        let align = align.max(MIN_ALIGN);
        // Chunks are multiples of MIN_ALIGN so neighbours never share a line.
        let rounded = round_up(len, MIN_ALIGN).ok_or(ArenaError::InvalidRequest { len, align })?;
        let base = self.addr() as usize;
        let mut free = self.free.lock();
        if free.sealed {
            return Err(ArenaError::Sealed);
        }
        let offset = free
            .take(rounded, align, base)
            .ok_or(ArenaError::OutOfMemory {
                len,
                align,
                free: free.free_bytes(),
            })?;
        Ok(DmaBuffer {
            chunk: Arc::new(Chunk {
                arena: Arc::clone(self),
                offset,
                reserved: rounded,
            }),
            len,
        })
    }

    /// Allocates `len` bytes rounded up to whole base pages, page aligned, so
    /// the chunk shares no page with any other chunk (needed for memory
    /// whose device translation is installed and removed by page).
    pub fn alloc_pages(self: &Arc<Self>, len: usize) -> Result<DmaBuffer, ArenaError> {
        let page = crate::page_size();
        let whole =
            round_up(len.max(1), page).ok_or(ArenaError::InvalidRequest { len, align: page })?;
        let mut buffer = self.alloc(whole, page)?;
        buffer.len = len.max(1);
        Ok(buffer)
    }
}

/// A chunk of a [`DmaArena`]. Freed back to the arena when dropped, and
/// when what registration made of it lets go too: a region registered
/// over it, a window bound on it, or a request naming it keeps the chunk
/// allocated until the device is done with it, so that dropping the
/// buffer early never hands memory the device may still write to the
/// next allocation.
///
/// The device may read and write the chunk at any time while it holds its
/// address, so the chunk is only reachable through raw pointers and volatile
/// accesses ([`DmaBuffer::volatile`]), never through `&mut [u8]`.
pub struct DmaBuffer {
    chunk: Arc<Chunk>,
    len: usize,
}

/// The allocation behind a [`DmaBuffer`], shared with what keeps it.
struct Chunk {
    arena: Arc<DmaArena>,
    offset: usize,
    reserved: usize,
}

impl Drop for Chunk {
    fn drop(&mut self) {
        self.arena.free.lock().give(self.offset, self.reserved);
    }
}

impl std::fmt::Debug for DmaBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DmaBuffer")
            .field("iova", &format_args!("{:#x}", self.iova()))
            .field("len", &self.len)
            .finish()
    }
}

impl DmaBuffer {
    /// Address of the first byte in this process.
    pub fn as_ptr(&self) -> *mut u8 {
        // SAFETY: offset < arena size, so the result stays inside the mapping.
        unsafe { self.chunk.arena.map.as_mut_ptr().add(self.chunk.offset) }
    }

    /// The IOVA of the first byte (equal to its virtual address).
    pub fn iova(&self) -> u64 {
        self.as_ptr() as u64
    }

    /// Length in bytes, as requested.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: chunks have at least one byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Offset of the chunk in the arena's file.
    pub fn offset(&self) -> usize {
        self.chunk.offset
    }

    /// The arena this chunk belongs to.
    pub fn arena(&self) -> &Arc<DmaArena> {
        &self.chunk.arena
    }

    /// A share of the chunk: it stays allocated while the share lives.
    pub(crate) fn keep_alive(&self) -> crate::verbs::KeepAlive {
        self.chunk.clone()
    }

    /// The chunk as a volatile slice: copies in and out of it are volatile,
    /// as memory shared with another process requires.
    pub fn volatile(&self) -> VolatileSlice<'_> {
        // SAFETY: the chunk is `len` bytes of a live shared mapping that stays
        // mapped while `self` (and so the arena) lives; VolatileSlice only
        // performs volatile accesses, which tolerate concurrent writers.
        unsafe { VolatileSlice::new(self.as_ptr(), self.len) }
    }

    /// Copies `data` into the chunk at `offset` (volatile writes).
    ///
    /// # Panics
    /// If `offset + data.len()` exceeds the chunk.
    pub fn write_at(&self, offset: usize, data: &[u8]) {
        let end = offset.checked_add(data.len()).expect("offset overflow");
        assert!(end <= self.len, "write past the end of a DmaBuffer");
        self.volatile()
            .subslice(offset, data.len())
            .expect("range checked above")
            .copy_from(data);
    }

    /// Copies bytes out of the chunk at `offset` into `out` (volatile reads).
    ///
    /// # Panics
    /// If `offset + out.len()` exceeds the chunk.
    pub fn read_at(&self, offset: usize, out: &mut [u8]) {
        let end = offset.checked_add(out.len()).expect("offset overflow");
        assert!(end <= self.len, "read past the end of a DmaBuffer");
        self.volatile()
            .subslice(offset, out.len())
            .expect("range checked above")
            .copy_to(out);
    }

    /// Sets every byte of the chunk to `value`.
    pub fn fill(&self, value: u8) {
        // SAFETY: as in `volatile`; write_bytes stays inside the chunk.
        unsafe { std::ptr::write_bytes(self.as_ptr(), value, self.len) };
    }
}

impl AsRawFd for DmaArena {
    fn as_raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

/// First-fit free list of `[offset, offset + len)` chunks, coalescing on free.
#[derive(Debug)]
struct FreeList {
    chunks: BTreeMap<usize, usize>,
    /// Set by [`DmaArena::seal`]: nothing is taken or given back any more.
    sealed: bool,
}

impl FreeList {
    fn new(size: usize) -> Self {
        let mut chunks = BTreeMap::new();
        chunks.insert(0, size);
        Self {
            chunks,
            sealed: false,
        }
    }

    fn free_bytes(&self) -> usize {
        self.chunks.values().sum()
    }

    /// Takes `len` bytes whose address (`base + offset`) is aligned to `align`.
    fn take(&mut self, len: usize, align: usize, base: usize) -> Option<usize> {
        let (start, chunk_len, aligned) = self.chunks.iter().find_map(|(&start, &chunk_len)| {
            // An alignment past the address space fits no chunk.
            let aligned = round_up(base + start, align)? - base;
            (aligned.checked_add(len)? <= start + chunk_len).then_some((start, chunk_len, aligned))
        })?;
        self.chunks.remove(&start);
        if aligned > start {
            self.chunks.insert(start, aligned - start);
        }
        let end = aligned + len;
        if end < start + chunk_len {
            self.chunks.insert(end, start + chunk_len - end);
        }
        Some(aligned)
    }

    fn give(&mut self, offset: usize, len: usize) {
        if self.sealed {
            return;
        }
        let mut start = offset;
        let mut end = offset + len;
        if let Some((&prev, &prev_len)) = self.chunks.range(..offset).next_back() {
            debug_assert!(prev + prev_len <= offset, "double free in the DMA arena");
            if prev + prev_len == offset {
                self.chunks.remove(&prev);
                start = prev;
            }
        }
        if let Some(next_len) = self.chunks.remove(&end) {
            end += next_len;
        }
        self.chunks.insert(start, end - start);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 1 MiB arena on normal pages, not populated.
    fn small_arena() -> Arc<DmaArena> {
        DmaArena::with_options(
            1 << 20,
            ArenaOptions {
                huge_pages: HugePages::Never,
                populate: false,
            },
        )
        .unwrap()
    }

    #[test]
    fn allocations_are_aligned_disjoint_and_returned() {
        let arena = small_arena();
        let total = arena.free_bytes();
        assert_eq!(total, arena.size());
        let mut buffers = Vec::new();
        for (i, align) in [1usize, 64, 4096, 256, 8192]
            .iter()
            .cycle()
            .take(40)
            .enumerate()
        {
            let b = arena.alloc(100 + i * 37, *align).unwrap();
            assert_eq!(b.iova() % (*align).max(MIN_ALIGN) as u64, 0);
            assert!(arena.contains(b.iova(), b.len()));
            buffers.push(b);
        }
        let mut spans: Vec<(u64, u64)> = buffers
            .iter()
            .map(|b| (b.iova(), b.iova() + b.len() as u64))
            .collect();
        spans.sort();
        for pair in spans.windows(2) {
            assert!(pair[0].1 <= pair[1].0, "chunks overlap");
        }
        drop(buffers);
        assert_eq!(arena.free_bytes(), total);
        // After coalescing the whole arena is one chunk again.
        let all = arena.alloc(total, 4096).unwrap();
        assert_eq!(all.len(), total);
    }

    #[test]
    fn lengths_and_alignments_past_the_address_space_are_refused() {
        let arena = small_arena();
        let total = arena.free_bytes();
        for len in [usize::MAX, usize::MAX - 10, usize::MAX - MIN_ALIGN + 2] {
            assert!(
                matches!(arena.alloc(len, 64), Err(ArenaError::InvalidRequest { .. })),
                "{len}"
            );
            assert!(
                matches!(
                    arena.alloc_pages(len),
                    Err(ArenaError::InvalidRequest { .. })
                ),
                "{len}"
            );
        }
        // An alignment no address in the arena meets: no chunk fits.
        assert!(matches!(
            arena.alloc(64, 1 << (usize::BITS - 1)),
            Err(ArenaError::OutOfMemory { .. })
        ));
        assert_eq!(arena.free_bytes(), total, "nothing was taken");
        // The next allocation is whole and its own.
        let first = arena.alloc(64, 64).unwrap();
        let second = arena.alloc(64, 64).unwrap();
        assert_ne!(first.iova(), second.iova());
        assert!(matches!(
            DmaArena::new(usize::MAX - 1),
            Err(ArenaError::InvalidRequest { .. })
        ));
    }

    #[test]
    fn exhaustion_is_an_error() {
        let arena = DmaArena::with_options(
            64 << 10,
            ArenaOptions {
                huge_pages: HugePages::Never,
                populate: true,
            },
        )
        .unwrap();
        let _a = arena.alloc(60 << 10, 64).unwrap();
        let err = arena.alloc(8 << 10, 64).unwrap_err();
        assert!(matches!(err, ArenaError::OutOfMemory { .. }), "{err}");
        assert!(matches!(
            arena.alloc(0, 64),
            Err(ArenaError::InvalidRequest { .. })
        ));
        assert!(matches!(
            arena.alloc(8, 3),
            Err(ArenaError::InvalidRequest { .. })
        ));
    }

    #[test]
    fn a_second_mapping_of_the_fd_sees_the_same_bytes() {
        let arena = DmaArena::new(1 << 20).unwrap();
        let buffer = arena.alloc(4096, 4096).unwrap();
        buffer.write_at(10, b"hello device");
        let file = File::from(arena.fd().try_clone_to_owned().unwrap());
        let other = MmapOptions::new().len(arena.size()).map_raw(&file).unwrap();
        assert_ne!(other.as_ptr() as u64, arena.addr());
        let mut seen = [0u8; 12];
        // SAFETY: the range is inside the second mapping, which is live.
        let src = unsafe { other.as_ptr().add(buffer.offset() + 10) };
        // SAFETY: src is valid for 12 bytes (see above).
        unsafe { std::ptr::copy_nonoverlapping(src, seen.as_mut_ptr(), 12) };
        assert_eq!(&seen, b"hello device");
        // And the other way round.
        // SAFETY: as above, inside the second mapping.
        unsafe {
            std::ptr::copy_nonoverlapping(
                b"ack".as_ptr(),
                other.as_mut_ptr().add(buffer.offset()),
                3,
            )
        };
        let mut back = [0u8; 3];
        buffer.read_at(0, &mut back);
        assert_eq!(&back, b"ack");
    }

    #[test]
    fn huge_pages_are_used_or_fall_back() {
        let arena = DmaArena::new(4096).unwrap();
        if arena.uses_huge_pages() {
            assert_eq!(arena.size() % HUGE_PAGE_SIZE, 0);
        } else {
            assert_eq!(arena.size(), crate::page_size());
        }
        let required = DmaArena::with_options(
            4096,
            ArenaOptions {
                huge_pages: HugePages::Require,
                populate: false,
            },
        );
        match required {
            Ok(arena) => assert!(arena.uses_huge_pages()),
            Err(err) => assert!(matches!(err, ArenaError::NoHugePages { .. }), "{err}"),
        }
    }

    #[test]
    fn page_allocations_own_their_pages() {
        let arena = DmaArena::new(1 << 20).unwrap();
        let _small = arena.alloc(10, 64).unwrap();
        let pages = arena.alloc_pages(5000).unwrap();
        let page = crate::page_size() as u64;
        assert_eq!(pages.iova() % page, 0);
        assert_eq!(pages.len(), 5000);
        let next = arena.alloc(10, 64).unwrap();
        assert!(next.iova() >= pages.iova() + 2 * page || next.iova() < pages.iova());
    }
}
