//! Any user memory, reachable by the device: the memory table and where
//! each registered byte lives.
//!
//! A device process on the host reaches only memory it maps: the files
//! the driver handed it in its memory table (vhost-user `SET_MEM_TABLE`).
//! [`DeviceReach`] is the [`Locate`] of the verbs layer's pinner: asked
//! where the bytes of a range are, it looks each part of the range up in
//! this process's mappings ([`maps`]) and answers with the memory-table
//! address the device finds it at, making it reachable first:
//!
//! * **Memory the device maps already**: the DMA arena, the pool (below),
//!   or a shared file it was given: the address inside that region of the
//!   table.
//! * **Private memory** (heap, stack, `malloc`ed C memory, anonymous
//!   `mmap`, `MAP_PRIVATE` file mappings): *rehomed* ([`rehome`]) the
//!   first time. Its pages move into the [`pool`], shared memory at the
//!   same address: the program keeps its addresses and bytes, the device
//!   maps the pool. Rehomed memory stays where it is until the program
//!   unmaps it; registering it again costs no copy.
//! * **Shared mappings of memory file systems** (`shm_open` in /dev/shm,
//!   tmpfs, hugetlbfs, memfd, `MAP_SHARED | MAP_ANONYMOUS`): the file itself
//!   becomes a region of the table at the mapping's address, so the memory
//!   keeps its sharing with other processes. The file is reached through
//!   `/proc/self/map_files` (which needs `CAP_CHECKPOINT_RESTORE` or
//!   `CAP_SYS_ADMIN`), else through the path `/proc/self/maps` shows,
//!   checked to be the same file.
//! * **Shared mappings of disk files** are refused: the device maps only
//!   memory file systems, because a page fault on disk storage can stall
//!   it, and a file that shrinks turns its accesses into SIGBUS.
//! * **Holes** and memory mapped without access are refused, naming the
//!   address.
//!
//! The IOTLB entry of a registered byte is always its own address (IOVA =
//! virtual address), so requests name user addresses; only the entry's
//! target differs: the pool view for rehomed memory, the address itself
//! for everything else. Read-only memory gets read-only entries.
//!
//! The table holds at most [`MAX_REGIONS`] regions: the arena, the pool's
//! segments and the shared files. A new segment or file resends it whole
//! (the device keeps its mappings of the regions it has). File regions
//! the device holds no entry into are dropped when room is needed.
//!
//! Inside a guest ([`Transport::maps_process_memory`]), the IOMMU maps any
//! memory of the process directly: every part of a range is its own
//! target, and only holes are refused.

pub mod fork;
pub mod maps;
pub mod pool;
pub mod rehome;

use std::fs::File;
use std::io;
use std::ops::Range;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use pindown_pincache::{PageRange, PinError, RangeRefCounts};

use crate::arena::{DmaArena, MemoryTableRegion};
use crate::pinner::{Locate, Placement};
use crate::transport::{Transport, TransportError};
use maps::{FileId, Mapping, Maps};
use pool::{Chunk, Pool};
use rehome::{Move, Moved};

/// Most regions a memory table holds (one file descriptor each, as many
/// as one vhost-user message carries).
pub const MAX_REGIONS: usize = vhost::vhost_user::message::MAX_ATTACHED_FD_ENTRIES;

/// Why memory cannot be made reachable by the device.
#[derive(Debug, thiserror::Error)]
pub enum ReachError {
    /// Nothing is mapped there.
    #[error("nothing is mapped at {addr:#x}: only memory this process maps can be registered")]
    Unmapped {
        /// The first unmapped address.
        addr: u64,
    },
    /// The memory is mapped without read access (`PROT_NONE`).
    #[error("[{start:#x}, {end:#x}) is mapped without access (PROT_NONE)")]
    NoAccess {
        /// First byte.
        start: u64,
        /// One past the last byte.
        end: u64,
    },
    /// A shared mapping of a file on a disk (or network) file system.
    #[error(
        "[{start:#x}, {end:#x}) is a MAP_SHARED mapping of {path}, on a file system of type \
         {fs_type:#x}: the device maps only memory file systems (tmpfs, /dev/shm, hugetlbfs, \
         memfd), since a page fault on other storage can stall it and a file that shrinks \
         turns its accesses into SIGBUS; copy the data into memory, or map the file MAP_PRIVATE"
    )]
    DiskFile {
        /// First byte of the mapping.
        start: u64,
        /// One past its last byte.
        end: u64,
        /// The file.
        path: String,
        /// `statfs` type of its file system.
        fs_type: i64,
    },
    /// The file behind a shared mapping cannot be opened or used.
    #[error("cannot hand the device the file behind the shared mapping [{start:#x}, {end:#x}) ({name}): {reason}")]
    FileUnreachable {
        /// First byte of the mapping.
        start: u64,
        /// One past its last byte.
        end: u64,
        /// What `/proc/self/maps` calls it.
        name: String,
        /// Why.
        reason: String,
    },
    /// The device still holds translations into a file region that must
    /// go to make room.
    #[error(
        "[{start:#x}, {end:#x}) still has device translations into memory mapped there \
         before; invalidate it (Context::invalidate) before registering what is mapped there now"
    )]
    Stale {
        /// First byte.
        start: u64,
        /// One past the last byte.
        end: u64,
    },
    /// The memory table has no room for another region.
    #[error(
        "the device's memory table is full: {MAX_REGIONS} regions (the DMA arena, {segments} pool \
         segments and {files} shared file mappings the device still uses); release \
         registrations of shared files, or use fewer of them"
    )]
    TableFull {
        /// Pool segments.
        segments: usize,
        /// Shared file regions.
        files: usize,
    },
    /// The device refused the new memory table.
    #[error(
        "the device refused the memory table with {regions} regions ({bytes} bytes): {source}"
    )]
    Table {
        /// Regions in the refused table.
        regions: usize,
        /// Their bytes.
        bytes: u64,
        /// The transport's error.
        source: TransportError,
    },
    /// A pool segment could not be created.
    #[error("cannot create a pool segment of {bytes} bytes: {source}")]
    Pool {
        /// Its size.
        bytes: usize,
        /// The error.
        source: io::Error,
    },
    /// Moving private memory into the pool failed (the memory is as it
    /// was).
    #[error(
        "cannot move [{start:#x}, {end:#x}) into memory shared with the device: {step} failed: \
         {source}{hint}",
        hint = if source.raw_os_error() == Some(libc::EPERM) {
            " (userfaultfd needs CAP_SYS_PTRACE, or sysctl vm.unprivileged_userfaultfd=1)"
        } else if source.raw_os_error() == Some(libc::EBUSY) {
            " (another userfaultfd watches this memory)"
        } else {
            ""
        }
    )]
    Rehome {
        /// First byte.
        start: u64,
        /// One past the last byte.
        end: u64,
        /// The step that failed.
        step: &'static str,
        /// The kernel's error.
        source: io::Error,
    },
    /// This process's mappings could not be read.
    #[error("cannot read this process's mappings (/proc/self/maps): {0}")]
    Maps(io::Error),
    /// Writable private memory mapping a disk file (a program's
    /// initialized statics, for one), registered through a safe form.
    #[error(
        "[{start:#x}, {end:#x}) is writable memory mapping a disk file privately (initialized \
         statics, for one): userfaultfd cannot hold other threads' writes off while its pages \
         move into memory shared with the device, and a write in the middle would be lost; copy \
         the data into the heap, or register it with the unsafe Context::register_unfenced, \
         whose caller answers for other writers"
    )]
    Unfenceable {
        /// First byte of the part refused.
        start: u64,
        /// One past its last byte.
        end: u64,
    },
}

thread_local! {
    /// Whether the registration running on this thread may move private
    /// disk-file memory without a write fence.
    static UNFENCED_MOVES: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `register` allowing, for the registrations it makes on this thread,
/// moves of private disk-file memory without a write fence (which another
/// thread's write to those pages, in the middle of the move, would lose).
/// `Context::register_unfenced` uses it; its caller answers for writers.
pub(crate) fn allowing_unfenced_moves<R>(register: impl FnOnce() -> R) -> R {
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            UNFENCED_MOVES.with(|allowed| allowed.set(self.0));
        }
    }
    let _reset = Reset(UNFENCED_MOVES.with(|allowed| allowed.replace(true)));
    register()
}

fn unfenced_moves_allowed() -> bool {
    UNFENCED_MOVES.with(|allowed| allowed.get())
}

/// Counters of [`DeviceReach`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReachStats {
    /// Ranges moved into the pool.
    pub rehomed: u64,
    /// Bytes moved into the pool.
    pub rehomed_bytes: u64,
    /// Moves made without a write fence (private disk-file mappings).
    pub unfenced: u64,
    /// Pool segments.
    pub segments: usize,
    /// Bytes of all pool segments.
    pub pool_bytes: u64,
    /// Bytes of the pool reserved now (chunks and their headroom).
    pub reserved_bytes: u64,
    /// Bytes the pool got back since it was made.
    pub released_bytes: u64,
    /// Shared file regions in the memory table.
    pub file_regions: usize,
    /// Memory tables sent after the first.
    pub tables_sent: u64,
}

/// A shared file the device maps, at the address a mapping of it had.
#[derive(Debug)]
struct FileRegion {
    file: File,
    id: FileId,
    /// Offset in the file of the region's first byte.
    offset: u64,
    size: u64,
    /// The region's address in the table.
    uaddr: u64,
}

#[derive(Debug)]
struct State {
    maps: Maps,
    arena: Arc<DmaArena>,
    arena_id: FileId,
    pool: Pool,
    files: Vec<FileRegion>,
}

/// The verbs layer's [`Locate`]: makes any mapped memory of this process
/// reachable by the device (see the [module documentation](self)).
#[derive(Debug)]
pub struct DeviceReach<T: Transport> {
    transport: T,
    /// The transport maps process memory itself (VFIO in a guest).
    direct: bool,
    state: Mutex<State>,
    /// The memory-table addresses the device has IOTLB entries into.
    targets: Mutex<RangeRefCounts>,
    /// Memory went away since the pool was last collected.
    dirty: AtomicBool,
    rehomed: AtomicU64,
    rehomed_bytes: AtomicU64,
    unfenced: AtomicU64,
    tables_sent: AtomicU64,
}

impl<T: Transport> DeviceReach<T> {
    /// The reach of a port whose memory table holds `arena` alone (sent
    /// already).
    pub fn new(transport: T, arena: Arc<DmaArena>) -> io::Result<Self> {
        let arena_id = FileId::of_fd(arena.fd())?;
        Ok(DeviceReach {
            direct: transport.maps_process_memory(),
            transport,
            state: Mutex::new(State {
                maps: Maps::open()?,
                arena,
                arena_id,
                pool: Pool::default(),
                files: Vec::new(),
            }),
            targets: Mutex::new(RangeRefCounts::new()),
            dirty: AtomicBool::new(false),
            rehomed: AtomicU64::new(0),
            rehomed_bytes: AtomicU64::new(0),
            unfenced: AtomicU64::new(0),
            tables_sent: AtomicU64::new(0),
        })
    }

    /// Counters and occupancy.
    pub fn stats(&self) -> ReachStats {
        let state = self.state.lock();
        let segments = state.pool.segments();
        ReachStats {
            rehomed: self.rehomed.load(Ordering::Relaxed),
            rehomed_bytes: self.rehomed_bytes.load(Ordering::Relaxed),
            unfenced: self.unfenced.load(Ordering::Relaxed),
            segments: segments.len(),
            pool_bytes: segments.iter().map(|s| s.size() as u64).sum(),
            reserved_bytes: segments.iter().map(|s| s.reserved_bytes() as u64).sum(),
            released_bytes: state.pool.released_bytes(),
            file_regions: state.files.len(),
            tables_sent: self.tables_sent.load(Ordering::Relaxed),
        }
    }

    /// Returns to the pool the space nothing needs any more (memory the
    /// program unmapped and the device no longer reaches); returns the
    /// bytes freed. Runs by itself before the pool grows.
    pub fn collect(&self) -> Result<usize, ReachError> {
        let mut state = self.state.lock();
        self.collect_locked(&mut state)
    }

    fn collect_locked(&self, state: &mut State) -> Result<usize, ReachError> {
        self.dirty.store(false, Ordering::Relaxed);
        let mappings = state.maps.file_backed().map_err(ReachError::Maps)?;
        let targets = self.targets.lock().ranges();
        Ok(state.pool.collect(&mappings, &targets))
    }

    /// Where the device finds each part of `range`, made reachable.
    fn place(&self, range: PageRange) -> Result<Vec<Placement>, ReachError> {
        let mut state = self.state.lock();
        let mut placed = Vec::new();
        let mut cursor = range.start;
        while cursor < range.end() {
            let mapping =
                state
                    .maps
                    .at(cursor)
                    .map_err(ReachError::Maps)?
                    .ok_or(ReachError::Unmapped {
                        addr: cursor as u64,
                    })?;
            let end = mapping.end.min(range.end());
            if !mapping.read {
                return Err(ReachError::NoAccess {
                    start: cursor as u64,
                    end: end as u64,
                });
            }
            let uaddr = if self.direct {
                cursor as u64
            } else if mapping.shared {
                self.shared_target(&mut state, &mapping, cursor..end)?
            } else {
                self.rehome(&mut state, &mapping, cursor..end)?
            };
            placed.push(Placement {
                iova: cursor as u64,
                len: (end - cursor) as u64,
                uaddr,
                writable: mapping.write,
            });
            cursor = end;
        }
        Ok(placed)
    }

    /// The table address of `part` of a shared mapping, adding its file to
    /// the table if the device does not map it yet.
    fn shared_target(
        &self,
        state: &mut State,
        mapping: &Mapping,
        part: Range<usize>,
    ) -> Result<u64, ReachError> {
        let id = mapping.file.ok_or_else(|| ReachError::FileUnreachable {
            start: mapping.start as u64,
            end: mapping.end as u64,
            name: String::new(),
            reason: "the kernel names no file for this shared mapping".into(),
        })?;
        let offset = mapping.offset_of(part.start);
        let len = part.len() as u64;
        if let Some(uaddr) = state.find(id, offset, len) {
            return Ok(uaddr);
        }
        self.add_file(state, mapping, id)?;
        state
            .find(id, offset, len)
            .ok_or_else(|| ReachError::FileUnreachable {
                start: part.start as u64,
                end: part.end as u64,
                name: state.maps.name_at(mapping.start).unwrap_or_default(),
                reason: "the mapping reaches past the end of its file".into(),
            })
    }

    /// Adds the file behind `mapping` to the table, as a region at the
    /// mapping's address.
    fn add_file(&self, state: &mut State, mapping: &Mapping, id: FileId) -> Result<(), ReachError> {
        let (start, end) = (mapping.start as u64, mapping.end as u64);
        let name = state.maps.name_at(mapping.start).unwrap_or_default();
        let unreachable = |reason: String| ReachError::FileUnreachable {
            start,
            end,
            name: name.clone(),
            reason,
        };
        let file = open_mapped_file(mapping, &name, id).map_err(unreachable)?;
        let fs_type = fs_type(&file).map_err(|e| unreachable(format!("fstatfs failed: {e}")))?;
        if fs_type != libc::TMPFS_MAGIC && fs_type != libc::HUGETLBFS_MAGIC {
            return Err(ReachError::DiskFile {
                start,
                end,
                path: name,
                fs_type,
            });
        }
        let file_len = file
            .metadata()
            .map_err(|e| unreachable(format!("fstat failed: {e}")))?
            .len();
        let page = crate::page_size() as u64;
        let size = (end - start).min(file_len.saturating_sub(mapping.offset) / page * page);
        if size == 0 {
            return Err(unreachable(
                "the mapping lies past the end of its file".into(),
            ));
        }
        self.make_room(state, start..start + size, 1)?;
        state.files.push(FileRegion {
            file,
            id,
            offset: mapping.offset,
            size,
            uaddr: start,
        });
        if let Err(err) = self.send_table(state) {
            state.files.pop();
            return Err(err);
        }
        Ok(())
    }

    /// Drops the file regions in the way of a new region at `label`, and
    /// enough unused ones for `extra` more regions.
    fn make_room(
        &self,
        state: &mut State,
        label: Range<u64>,
        extra: usize,
    ) -> Result<(), ReachError> {
        let targets = self.targets.lock();
        let in_use =
            |r: &FileRegion| targets.overlaps(r.uaddr as usize..(r.uaddr + r.size) as usize);
        let overlaps = |r: &FileRegion| r.uaddr < label.end && label.start < r.uaddr + r.size;
        if let Some(stale) = state.files.iter().find(|r| overlaps(r) && in_use(r)) {
            return Err(ReachError::Stale {
                start: stale.uaddr.max(label.start),
                end: (stale.uaddr + stale.size).min(label.end),
            });
        }
        state.files.retain(|r| !overlaps(r));
        while state.regions() + extra > MAX_REGIONS {
            match state.files.iter().position(|r| !in_use(r)) {
                Some(unused) => {
                    state.files.remove(unused);
                }
                None => {
                    return Err(ReachError::TableFull {
                        segments: state.pool.segments().len(),
                        files: state.files.len(),
                    })
                }
            }
        }
        Ok(())
    }

    /// Moves the private `part` of `mapping` into the pool; returns its
    /// table address.
    fn rehome(
        &self,
        state: &mut State,
        mapping: &Mapping,
        part: Range<usize>,
    ) -> Result<u64, ReachError> {
        let chunk = self.reserve(state, part.len())?;
        let segment = &state.pool.segments()[chunk.segment];
        let destination = segment.view() + chunk.offset;
        let job = Move {
            start: part.start,
            len: part.len(),
            prot: mapping.prot(),
            fence: mapping.write,
            file_backed: mapping.file.is_some(),
            allow_unfenced: unfenced_moves_allowed(),
            pool: segment.fd().as_raw_fd(),
            offset: chunk.offset as u64,
            destination,
        };
        match rehome::run(job) {
            Ok(moved) => {
                state.pool.placed(chunk);
                self.rehomed.fetch_add(1, Ordering::Relaxed);
                self.rehomed_bytes
                    .fetch_add(part.len() as u64, Ordering::Relaxed);
                if moved == Moved::Unfenced {
                    self.unfenced.fetch_add(1, Ordering::Relaxed);
                }
                Ok(destination as u64)
            }
            Err(error) if error.step == rehome::UNFENCEABLE => {
                state.pool.cancel(chunk);
                Err(ReachError::Unfenceable {
                    start: part.start as u64,
                    end: part.end as u64,
                })
            }
            Err(error) => {
                state.pool.cancel(chunk);
                Err(ReachError::Rehome {
                    start: part.start as u64,
                    end: part.end as u64,
                    step: error.step,
                    source: error.source,
                })
            }
        }
    }

    /// Pool space for `len` bytes: from what is free, else after
    /// collecting, else in a new segment.
    fn reserve(&self, state: &mut State, len: usize) -> Result<Chunk, ReachError> {
        let page = crate::page_size();
        let mut collected = false;
        if self.dirty.load(Ordering::Relaxed) {
            self.collect_locked(state)?;
            collected = true;
        }
        if let Some(chunk) = state.pool.reserve(len, page) {
            return Ok(chunk);
        }
        if !collected && self.collect_locked(state)? > 0 {
            if let Some(chunk) = state.pool.reserve(len, page) {
                return Ok(chunk);
            }
        }
        let index = state
            .pool
            .grow(len, page)
            .map_err(|source| ReachError::Pool { bytes: len, source })?;
        let view = state.pool.segments()[index].view() as u64;
        let size = state.pool.segments()[index].size() as u64;
        let room = self
            .make_room(state, view..view + size, 0)
            .and_then(|()| self.send_table(state));
        if let Err(err) = room {
            state.pool.shrink();
            return Err(err);
        }
        Ok(state
            .pool
            .reserve(len, page)
            .expect("a new segment holds the chunk"))
    }

    /// Sends the whole table (arena, segments, files).
    fn send_table(&self, state: &State) -> Result<(), ReachError> {
        let mut regions = vec![state.arena.memory_table_region()];
        regions.extend(state.pool.segments().iter().map(|s| MemoryTableRegion {
            fd: s.fd(),
            file_offset: 0,
            size: s.size() as u64,
            userspace_addr: s.view() as u64,
            iova: s.view() as u64,
        }));
        regions.extend(state.files.iter().map(|f| MemoryTableRegion {
            fd: f.file.as_fd(),
            file_offset: f.offset,
            size: f.size,
            userspace_addr: f.uaddr,
            iova: f.uaddr,
        }));
        if regions.len() > MAX_REGIONS {
            return Err(ReachError::TableFull {
                segments: state.pool.segments().len(),
                files: state.files.len(),
            });
        }
        self.transport
            .register_memory(&regions)
            .map_err(|source| ReachError::Table {
                regions: regions.len(),
                bytes: regions.iter().map(|r| r.size).sum(),
                source,
            })?;
        self.tables_sent.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

impl State {
    /// Regions in the table.
    fn regions(&self) -> usize {
        1 + self.pool.segments().len() + self.files.len()
    }

    /// The table address of `len` bytes at `offset` of file `id`, if a
    /// region of the table holds them.
    fn find(&self, id: FileId, offset: u64, len: u64) -> Option<u64> {
        let end = offset.checked_add(len)?;
        if id == self.arena_id {
            return (end <= self.arena.size() as u64).then(|| self.arena.addr() + offset);
        }
        if let Some(index) = self.pool.segment_of(id) {
            let segment = &self.pool.segments()[index];
            return (end <= segment.size() as u64).then(|| segment.view() as u64 + offset);
        }
        self.files
            .iter()
            .find(|r| r.id == id && offset >= r.offset && end <= r.offset + r.size)
            .map(|r| r.uaddr + (offset - r.offset))
    }
}

impl<T: Transport> Locate for DeviceReach<T> {
    fn locate(&self, range: PageRange) -> Result<Vec<Placement>, PinError> {
        self.place(range).map_err(|error| PinError::Unreachable {
            range,
            source: Box::new(error),
        })
    }

    fn device_mapped(&self, placement: &Placement) {
        let start = placement.uaddr as usize;
        self.targets
            .lock()
            .acquire(start..start + placement.len as usize);
    }

    fn device_unmapped(&self, placement: &Placement) {
        let start = placement.uaddr as usize;
        self.targets
            .lock()
            .release_lenient(start..start + placement.len as usize);
    }

    fn forget(&self, _range: PageRange) {
        self.dirty.store(true, Ordering::Relaxed);
    }
}

/// Opens the file `mapping` maps, read-write (the device maps it so):
/// through `/proc/self/map_files`, else through the path `name`, checked to
/// be the file `id`.
fn open_mapped_file(mapping: &Mapping, name: &str, id: FileId) -> Result<File, String> {
    let link = format!("/proc/self/map_files/{:x}-{:x}", mapping.start, mapping.end);
    let open = |path: &str| {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
    };
    let by_link = open(&link);
    let file = match by_link {
        Ok(file) => file,
        Err(link_error) => {
            if name.is_empty() || !name.starts_with('/') || name.ends_with(" (deleted)") {
                return Err(format!(
                    "{link}: {link_error} (opening it needs CAP_CHECKPOINT_RESTORE or \
                     CAP_SYS_ADMIN), and the file has no path to open instead"
                ));
            }
            open(name).map_err(|e| {
                format!("{link}: {link_error}; {name}: {e} (the device maps it read-write)")
            })?
        }
    };
    match FileId::of(&file) {
        Ok(found) if found == id => Ok(file),
        Ok(_) => Err(format!(
            "{name} is no longer the file mapped there (it was replaced)"
        )),
        Err(e) => Err(format!("fstat failed: {e}")),
    }
}

/// The `statfs` type of the file system `file` is on.
fn fs_type(file: &File) -> io::Result<i64> {
    // SAFETY: a zeroed statfs is a valid value for fstatfs to fill.
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: fstatfs writes into `fs` and only reads the descriptor.
    if unsafe { libc::fstatfs(file.as_raw_fd(), &mut fs) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fs.f_type)
}
