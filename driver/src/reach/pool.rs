//! The pool: shared memory that private pages move into when they are
//! registered ([`rehome`](super::rehome)).
//!
//! The pool is a list of segments, each a memfd (sealed against shrinking
//! and growing, so the device needs no SIGBUS guard for it) that the device
//! maps as one region of its memory table, and that this process maps once
//! as the segment's *view*: the region's address in the table, and where
//! rehoming copies pages to. Segments are added as needed, each at least as
//! large as all the earlier ones together (64 MiB first), so that a few
//! segments cover any size.
//!
//! Space is handed out in page-aligned chunks and is *reserved*, not owned:
//! a reservation lasts while the chunk is being rehomed, while any mapping
//! of this process maps it, and while the device has an IOTLB entry into
//! it. [`Pool::collect`] recomputes the reservations from those three
//! facts (the kernel's list of mappings and the pinner's entries) and
//! punches holes into what is free again, so memory the program unmapped,
//! moved or shrank returns to the pool whichever way it went, and no chunk
//! is handed out twice while something can still reach it.
//!
//! A chunk is reserved with as much headroom behind it as it is long: a
//! program that grows a rehomed mapping in place (`mremap`, as `realloc`
//! does for large blocks) maps the file offsets behind the chunk, which are
//! then free holes, reserved as soon as they are mapped.

use std::collections::BTreeMap;
use std::fs::File;
use std::io;
use std::ops::Range;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd};

use super::maps::{FileId, Mapping};

/// Size of the first segment.
pub const FIRST_SEGMENT_BYTES: usize = 64 << 20;

/// A set of disjoint, non-adjacent ranges of offsets.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RangeSet(BTreeMap<usize, usize>);

impl RangeSet {
    /// Adds `range`, merging what it overlaps or touches.
    pub fn insert(&mut self, range: Range<usize>) {
        if range.is_empty() {
            return;
        }
        let (mut start, mut end) = (range.start, range.end);
        let touching: Vec<(usize, usize)> = self
            .0
            .range(..=end)
            .rev()
            .take_while(|(_, &e)| e >= start)
            .map(|(&s, &e)| (s, e))
            .collect();
        for (s, e) in touching {
            self.0.remove(&s);
            start = start.min(s);
            end = end.max(e);
        }
        self.0.insert(start, end);
    }

    /// The ranges in order.
    pub fn iter(&self) -> impl Iterator<Item = Range<usize>> + '_ {
        self.0.iter().map(|(&s, &e)| s..e)
    }

    /// Total length.
    pub fn len(&self) -> usize {
        self.iter().map(|r| r.len()).sum()
    }

    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The parts of `self` outside `other`.
    pub fn minus(&self, other: &RangeSet) -> RangeSet {
        let mut out = RangeSet::default();
        for range in self.iter() {
            let mut cursor = range.start;
            for cut in other.iter() {
                if cut.end <= cursor || cut.start >= range.end {
                    continue;
                }
                if cut.start > cursor {
                    out.insert(cursor..cut.start);
                }
                cursor = cursor.max(cut.end);
            }
            if cursor < range.end {
                out.insert(cursor..range.end);
            }
        }
        out
    }

    /// The start of the first range at or after `at`, if any.
    pub fn next_start(&self, at: usize) -> Option<usize> {
        self.0.range(at..).next().map(|(&s, _)| s)
    }

    /// The first free offset `o` below `limit` (a multiple of `align`) such
    /// that `[o, o + len)` touches nothing in the set.
    pub fn first_fit(&self, len: usize, align: usize, limit: usize) -> Option<usize> {
        let mut candidate = 0usize;
        for range in self.iter() {
            if candidate.checked_add(len)? <= range.start {
                break;
            }
            candidate = range.end.next_multiple_of(align);
        }
        (candidate.checked_add(len)? <= limit).then_some(candidate)
    }
}

/// One segment: a sealed memfd and its view.
#[derive(Debug)]
pub struct Segment {
    file: File,
    id: FileId,
    view: *mut u8,
    size: usize,
    /// Offsets reserved (see the module documentation).
    reserved: RangeSet,
    /// Offsets being rehomed now, not mapped yet.
    pending: RangeSet,
}

// SAFETY: the view is a shared mapping owned by the segment; the raw
// pointer is only an address, and the bytes behind it are only touched
// through volatile copies while rehoming, under the owner's lock.
unsafe impl Send for Segment {}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: the view was mapped with this size by `Segment::new` and
        // is unmapped once, here.
        unsafe { libc::munmap(self.view.cast(), self.size) };
        super::fork::segment_gone(self.id);
    }
}

impl Segment {
    /// A new segment of `size` bytes (a multiple of the page size).
    pub fn new(size: usize) -> io::Result<Segment> {
        // SAFETY: the name is a valid C string; memfd_create returns a new
        // descriptor or -1.
        let fd = unsafe {
            libc::memfd_create(
                c"pindown-pool".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is new and owned by nobody else.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(size as u64)?;
        // SAFETY: fcntl with an integer argument on a descriptor we own.
        if unsafe {
            libc::fcntl(
                file.as_raw_fd(),
                libc::F_ADD_SEALS,
                libc::F_SEAL_SHRINK | libc::F_SEAL_GROW,
            )
        } != 0
        {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a new shared mapping of the whole file, placed by the
        // kernel.
        let view = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if view == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        // A child of fork() gets no view (nothing in it uses one).
        // SAFETY: advice on the mapping just made.
        unsafe { libc::madvise(view, size, libc::MADV_DONTFORK) };
        let id = FileId::of(&file)?;
        super::fork::remember_pool_file(id, file.as_fd(), (view as usize, size));
        Ok(Segment {
            file,
            id,
            view: view.cast(),
            size,
            reserved: RangeSet::default(),
            pending: RangeSet::default(),
        })
    }

    /// The memfd.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// The file's identity.
    pub fn id(&self) -> FileId {
        self.id
    }

    /// Address of the view.
    pub fn view(&self) -> usize {
        self.view as usize
    }

    /// Size in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Bytes reserved.
    pub fn reserved_bytes(&self) -> usize {
        self.reserved.len()
    }
}

/// Where a chunk lies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunk {
    /// Index of the segment.
    pub segment: usize,
    /// Offset in the segment's file.
    pub offset: usize,
    /// Length in bytes.
    pub len: usize,
    /// End of the space reserved with it (its headroom included).
    pub reserved_end: usize,
}

/// The segments.
#[derive(Debug, Default)]
pub struct Pool {
    segments: Vec<Segment>,
    /// Bytes whose holes were punched by [`collect`](Self::collect).
    released: u64,
}

impl Pool {
    /// The segments, in order.
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// Adds a segment able to hold `len` bytes; returns its index.
    pub fn grow(&mut self, len: usize, page: usize) -> io::Result<usize> {
        let total: usize = self.segments.iter().map(Segment::size).sum();
        let size = FIRST_SEGMENT_BYTES
            .max(total)
            .max(len.saturating_mul(2).next_multiple_of(page));
        self.segments.push(Segment::new(size)?);
        Ok(self.segments.len() - 1)
    }

    /// Removes the last segment (one whose table could not be sent).
    pub fn shrink(&mut self) {
        self.segments.pop();
    }

    /// Reserves `len` bytes (a multiple of `page`) with headroom behind
    /// them; the chunk stays pending until [`placed`](Self::placed) or
    /// [`cancel`](Self::cancel).
    pub fn reserve(&mut self, len: usize, page: usize) -> Option<Chunk> {
        for (index, segment) in self.segments.iter_mut().enumerate() {
            // Headroom as long as the chunk where it fits, else up to the
            // end of the segment.
            let offset = segment
                .reserved
                .first_fit(len.saturating_mul(2), page, segment.size)
                .or_else(|| segment.reserved.first_fit(len, page, segment.size));
            if let Some(offset) = offset {
                // The headroom ends where the next reservation starts.
                let end = (offset + 2 * len)
                    .min(segment.size)
                    .min(segment.reserved.next_start(offset).unwrap_or(usize::MAX));
                segment.reserved.insert(offset..end);
                segment.pending.insert(offset..offset + len);
                return Some(Chunk {
                    segment: index,
                    offset,
                    len,
                    reserved_end: end,
                });
            }
        }
        None
    }

    /// The chunk is mapped now: its reservation rests on the mapping.
    pub fn placed(&mut self, chunk: Chunk) {
        let segment = &mut self.segments[chunk.segment];
        let mut done = RangeSet::default();
        done.insert(chunk.offset..chunk.offset + chunk.len);
        segment.pending = segment.pending.minus(&done);
    }

    /// The chunk was not used; its space is free again.
    pub fn cancel(&mut self, chunk: Chunk) {
        let segment = &mut self.segments[chunk.segment];
        let mut gone = RangeSet::default();
        gone.insert(chunk.offset..chunk.reserved_end);
        segment.pending = segment.pending.minus(&gone);
        segment.reserved = segment.reserved.minus(&gone);
        punch(&segment.file, chunk.offset..chunk.offset + chunk.len);
    }

    /// The segment and offset of the view address `uaddr`, if it lies in
    /// a view.
    pub fn offset_of(&self, uaddr: usize) -> Option<(usize, usize)> {
        self.segments.iter().enumerate().find_map(|(index, s)| {
            (uaddr >= s.view() && uaddr < s.view() + s.size).then(|| (index, uaddr - s.view()))
        })
    }

    /// The segment whose file is `id`.
    pub fn segment_of(&self, id: FileId) -> Option<usize> {
        self.segments.iter().position(|s| s.id == id)
    }

    /// Recomputes every reservation from what still needs the space:
    /// chunks being rehomed, the file mappings of this process (`mappings`,
    /// the views left out) with headroom as long as each, and the device's
    /// IOTLB targets (`targets`, view addresses). Punches holes into what
    /// is no longer reserved. Returns the bytes freed.
    pub fn collect(&mut self, mappings: &[Mapping], targets: &[Range<usize>]) -> usize {
        let mut needed: Vec<RangeSet> = self.segments.iter().map(|s| s.pending.clone()).collect();
        for mapping in mappings {
            let Some(index) = mapping.file.and_then(|id| self.segment_of(id)) else {
                continue;
            };
            let segment = &self.segments[index];
            if mapping.start == segment.view() {
                continue;
            }
            let start = mapping.offset as usize;
            let len = mapping.end - mapping.start;
            needed[index].insert(start..(start + 2 * len).min(segment.size).max(start + len));
        }
        for target in targets {
            if let Some((index, offset)) = self.offset_of(target.start) {
                needed[index].insert(offset..offset + target.len());
            }
        }
        let mut freed = 0;
        for (segment, needed) in self.segments.iter_mut().zip(needed) {
            let free = segment.reserved.minus(&needed);
            for range in free.iter() {
                punch(&segment.file, range.start..range.end.min(segment.size));
                freed += range.len();
            }
            segment.reserved = needed;
        }
        self.released += freed as u64;
        freed
    }

    /// Bytes returned to the pool by [`collect`](Self::collect) so far.
    pub fn released_bytes(&self) -> u64 {
        self.released
    }
}

/// Gives the memory of `range` of `file` back to the system (the offsets
/// read as zeros afterwards).
fn punch(file: &File, range: Range<usize>) {
    if range.is_empty() {
        return;
    }
    // SAFETY: fallocate on a descriptor we own; punching a hole keeps the
    // size (and so the seals) and only drops pages.
    unsafe {
        libc::fallocate(
            file.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            range.start as libc::off_t,
            range.len() as libc::off_t,
        )
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(ranges: &[Range<usize>]) -> RangeSet {
        let mut out = RangeSet::default();
        for r in ranges {
            out.insert(r.clone());
        }
        out
    }

    #[test]
    fn range_sets_merge_cut_and_fit() {
        let s = set(&[0..10, 20..30, 10..12, 40..50, 28..41]);
        assert_eq!(s.iter().collect::<Vec<_>>(), vec![0..12, 20..50]);
        assert_eq!(s.len(), 42);
        let cut = s.minus(&set(&[5..25, 45..60]));
        assert_eq!(cut.iter().collect::<Vec<_>>(), vec![0..5, 25..45]);
        assert_eq!(s.first_fit(8, 4, 100), Some(12));
        assert_eq!(s.first_fit(9, 4, 100), Some(52));
        assert_eq!(s.first_fit(60, 4, 100), None);
        assert_eq!(RangeSet::default().first_fit(100, 4, 100), Some(0));
    }

    #[test]
    fn reservations_follow_mappings_and_targets() {
        let page = crate::page_size();
        let mut pool = Pool::default();
        pool.grow(page, page).unwrap();
        let a = pool.reserve(4 * page, page).unwrap();
        let b = pool.reserve(page, page).unwrap();
        assert_eq!(a.offset, 0);
        assert_eq!(b.offset, 8 * page, "a keeps its headroom");
        pool.placed(a);
        pool.placed(b);
        let id = pool.segments()[0].id();
        // a is mapped (somewhere), b only reached by the device.
        let mapping = Mapping {
            start: 0x1000_0000,
            end: 0x1000_0000 + 4 * page,
            read: true,
            write: true,
            exec: false,
            shared: true,
            offset: 0,
            file: Some(id),
        };
        let view = pool.segments()[0].view();
        let target = view + 8 * page..view + 9 * page;
        assert_eq!(
            pool.collect(std::slice::from_ref(&mapping), &[target]),
            page
        );
        assert_eq!(pool.segments()[0].reserved_bytes(), 9 * page);
        // Nothing needs them any more.
        assert_eq!(pool.collect(&[], &[]), 9 * page);
        assert_eq!(pool.reserve(4 * page, page).unwrap().offset, 0);
    }

    #[test]
    fn headroom_stops_at_the_next_reservation() {
        let page = crate::page_size();
        let mut pool = Pool::default();
        pool.grow(page, page).unwrap();
        let size = pool.segments()[0].size();
        let a = pool.reserve(page, page).unwrap();
        let b = pool.reserve(page, page).unwrap();
        let big = pool.reserve(size - 4 * page, page).unwrap();
        assert_eq!((a.offset, b.offset, big.offset), (0, 2 * page, 4 * page));
        for chunk in [a, b, big] {
            pool.placed(chunk);
        }
        // Only the device still reaches b and big.
        let view = pool.segments()[0].view();
        let targets = [
            view + 2 * page..view + 3 * page,
            view + 4 * page..view + size,
        ];
        pool.collect(&[], &targets);
        // Two pages fit in front of b, without headroom.
        let squeezed = pool.reserve(2 * page, page).unwrap();
        assert_eq!((squeezed.offset, squeezed.reserved_end), (0, 2 * page));
        pool.cancel(squeezed);
        assert_eq!(
            pool.segments()[0].reserved_bytes(),
            page + size - 4 * page,
            "cancelling it leaves b and big reserved"
        );
    }
}
