//! Vector transfers (VECTOR_WRITE, VECTOR_READ): bytes move between two
//! access patterns ([`pindown_uapi::pattern`]), the initiator's and the
//! target window's, in one pass and with no staging buffer.
//!
//! The first turn takes the descriptor (the bytes that followed the
//! request in the send queue, or a copy read once from the initiator's
//! registered memory), decodes it, reads the block lists it keeps in
//! memory (bounded by [`VectorLimits`]) and plans both patterns; the
//! device's own copy is kept with the request ([`VectorState`]) until it
//! completes, so the owner changing its descriptor or lists afterwards
//! changes nothing. Then the transfer runs in guarded steps of at most
//! [`STEP_BYTES`](super::STEP_BYTES), as a WRITE or READ does: the first
//! step checks every element of both patterns (local registration,
//! window key, rights and bounds, the target's registration), so a
//! request refused up front moves no byte; every later step checks its
//! own part again, so a barrier between two steps stops the transfer.
//!
//! A step's part of a pattern is found in the mapping once when the hull
//! of its elements (lowest to highest byte) is granted as a whole: every
//! element is then an offset from one pointer when the hull is contiguous
//! in this process's memory, or found by a cursor over the hull's spans
//! when it is not (huge pages, several regions). Only when the hull is not
//! wholly granted is each element checked and translated by itself.
//! The two walks are then copied against each other, each run the
//! overlap of the current source and destination elements.

use smallvec::SmallVec;

use pindown_uapi::pattern::{
    decode_pair, Dim, Pattern, PatternError, Piece, Plan, Segments, MAX_DIMS,
};
use pindown_uapi::{Access, Descriptor, ErrorDetail, RemoteAddress, Status, VectorTransfer};

use super::execute::{copy_run, copy_spans, local_fault, refuse};
use super::windows::{PortId, Refusal};
use super::{Failure, MemoryAccess, Span, Spans, Target};

/// Default bound on a descriptor kept in memory, in bytes.
pub const DEFAULT_MAX_DESCRIPTOR_BYTES: u32 = 16 << 20;

/// Default bound on the blocks of one pattern's lists, listed or in
/// memory (16 bytes each to read, 24 to keep).
pub const DEFAULT_MAX_PATTERN_BLOCKS: u64 = 1 << 20;

/// What the device accepts of one vector transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VectorLimits {
    /// Bytes of a descriptor in memory (an inline one is bounded by
    /// [`MAX_INLINE`](pindown_uapi::queue::MAX_INLINE)).
    pub max_descriptor_bytes: u32,
    /// Blocks of each pattern's lists, listed or in memory.
    pub max_pattern_blocks: u64,
}

impl Default for VectorLimits {
    fn default() -> Self {
        VectorLimits {
            max_descriptor_bytes: DEFAULT_MAX_DESCRIPTOR_BYTES,
            max_pattern_blocks: DEFAULT_MAX_PATTERN_BLOCKS,
        }
    }
}

/// A vector transfer's two plans, the device's own copy, kept between
/// turns.
#[derive(Debug)]
pub struct VectorState {
    local: Plan<'static>,
    remote: Plan<'static>,
}

impl VectorState {
    /// The local and the remote plan.
    pub fn into_plans(self) -> (Plan<'static>, Plan<'static>) {
        (self.local, self.remote)
    }
}

/// The error completion of a descriptor that does not decode or plan.
fn malformed(own: u16, error: &PatternError) -> Failure {
    tracing::debug!(port = own, reason = %error, "vector descriptor refused");
    (Status::InvalidRequest, ErrorDetail::Malformed)
}

/// What a pattern error answers.
fn pattern_failure(own: u16, error: PatternError) -> Failure {
    match error {
        PatternError::TooManyBlocks(_) => {
            tracing::debug!(port = own, reason = %error, "vector descriptor refused");
            (Status::LimitReached, ErrorDetail::PatternLimit)
        }
        PatternError::ListUnreadable { .. } => {
            tracing::debug!(port = own, reason = %error, "vector descriptor refused");
            (Status::LocalProtectionError, ErrorDetail::Unregistered)
        }
        error => malformed(own, &error),
    }
}

/// Copies `[iova, iova + out.len())` of `memory` into `out`.
fn read_into(memory: &dyn MemoryAccess, iova: u64, out: &mut [u8]) -> Result<(), Failure> {
    let mut spans = Spans::new();
    memory
        .spans(iova, out.len() as u64, false, &mut spans)
        .map_err(local_fault)?;
    let mut at = 0;
    for span in spans {
        // SAFETY: the span is mapped memory of the initiator, lent for the
        // current guarded step, holding `span.len` bytes, and `out` holds
        // the rest of the range (the spans add up to `out.len()`); `out` is
        // the device's own buffer, so the two cannot overlap.
        unsafe { std::ptr::copy_nonoverlapping(span.addr, out[at..].as_mut_ptr(), span.len) };
        at += span.len;
    }
    Ok(())
}

/// Takes a vector transfer's descriptor (`inline`: the bytes that
/// followed the request; else read from `local`, the initiator's memory),
/// reads its lists in memory and plans both patterns; checks that both
/// cover the request's length.
pub fn prepare(
    own: u16,
    local: &dyn MemoryAccess,
    vector: &VectorTransfer,
    inline: &[u8],
    limits: VectorLimits,
) -> Result<VectorState, Failure> {
    let copy;
    let bytes = match vector.descriptor {
        Descriptor::Inline { len } => {
            if inline.len() != len as usize {
                return Err((Status::InvalidRequest, ErrorDetail::Malformed));
            }
            inline
        }
        Descriptor::InMemory { iova, len } => {
            if len > limits.max_descriptor_bytes {
                tracing::debug!(
                    port = own,
                    len,
                    max = limits.max_descriptor_bytes,
                    "vector descriptor larger than --max-descriptor-bytes"
                );
                return Err((Status::LimitReached, ErrorDetail::PatternLimit));
            }
            let mut buffer = vec![0u8; len as usize];
            read_into(local, iova, &mut buffer)?;
            copy = buffer;
            &copy[..]
        }
    };
    let (mut near, mut far) = decode_pair(bytes).map_err(|error| malformed(own, &error))?;
    let mut read = |iova: u64, out: &mut [u8]| read_into(local, iova, out).is_ok();
    for pattern in [&mut near, &mut far] {
        pattern
            .resolve_lists(limits.max_pattern_blocks, &mut read)
            .map_err(|error| pattern_failure(own, error))?;
    }
    let plan = |pattern: Pattern| pattern.into_plan().map_err(|error| malformed(own, &error));
    let state = VectorState {
        local: plan(near)?,
        remote: plan(far)?,
    };
    let len = u64::from(vector.len);
    if state.local.len() != len || state.remote.len() != len {
        tracing::debug!(
            port = own,
            len,
            local = state.local.len(),
            remote = state.remote.len(),
            "vector transfer patterns do not cover its length"
        );
        return Err((Status::InvalidRequest, ErrorDetail::LengthMismatch));
    }
    Ok(state)
}

/// One side of a vector transfer, as a step sees it.
pub enum Side<'s, 't> {
    /// The initiator's memory, offsets from IOVA `base`.
    Local {
        /// The initiator's memory.
        memory: &'s dyn MemoryAccess,
        /// IOVA the pattern counts from.
        base: u64,
        /// The device writes it (VECTOR_READ).
        write: bool,
    },
    /// A window of the target, offsets from `remote.offset`.
    Remote {
        /// The target port.
        target: &'s Target<'t>,
        /// The initiator, as windows name it.
        initiator: PortId,
        /// Window and base offset.
        remote: RemoteAddress,
        /// The right needed.
        needed: Access,
        /// The device writes it (VECTOR_WRITE).
        write: bool,
    },
}

/// Where a step's part of a pattern is in this process.
enum Mapped {
    /// Every element at `addr + (offset - low)`.
    Contiguous { addr: *mut u8, low: i64 },
    /// The hull `[low, ..)` is granted as a whole and mapped in several
    /// spans; `starts[i]` is where `spans[i]` begins, counted from `low`.
    Hull {
        low: i64,
        spans: Spans,
        starts: SmallVec<[usize; 4]>,
    },
    /// Each element translated by itself: the spans, in stream order.
    Listed,
}

impl Side<'_, '_> {
    /// The absolute address (IOVA, or offset in the window) of `offset`
    /// from the base, if it is one.
    fn at(&self, offset: i64) -> Option<u64> {
        let base = match self {
            Side::Local { base, .. } => *base,
            Side::Remote { remote, .. } => remote.offset,
        };
        u64::try_from(i128::from(base) + i128::from(offset)).ok()
    }

    fn write(&self) -> bool {
        match self {
            Side::Local { write, .. } | Side::Remote { write, .. } => *write,
        }
    }

    /// Checks the element `[offset, offset + len)` and appends its spans
    /// to `out` (a refusal is counted for the target's owner).
    fn element(&self, offset: i64, len: u64, out: &mut Spans) -> Result<(), Failure> {
        match self {
            Side::Local { memory, .. } => {
                let iova = self
                    .at(offset)
                    .ok_or((Status::LocalProtectionError, ErrorDetail::Unregistered))?;
                memory
                    .spans(iova, len, self.write(), out)
                    .map_err(local_fault)
            }
            Side::Remote {
                target,
                initiator,
                remote,
                needed,
                write,
            } => {
                let offset = self
                    .at(offset)
                    .ok_or_else(|| refuse(target, Refusal::OutOfBounds))?;
                let at = RemoteAddress { offset, ..*remote };
                super::execute::remote_range(target, *initiator, at, len, *needed, *write, out)
                    .map(|_| ())
            }
        }
    }

    /// The mapping of the hull `[low, high)` when all of it is granted:
    /// one contiguous run of this process's memory, or several spans
    /// (nothing is counted when it is not granted: the elements are
    /// checked one by one then).
    fn hull(&self, low: i64, high: i64) -> Option<Mapped> {
        let start = self.at(low)?;
        let len = u64::try_from(i128::from(high) - i128::from(low)).ok()?;
        let mut spans = Spans::new();
        match self {
            Side::Local { memory, write, .. } => {
                memory.spans(start, len, *write, &mut spans).ok()?
            }
            Side::Remote {
                target,
                initiator,
                remote,
                needed,
                write,
            } => {
                let iova = target
                    .windows
                    .check(remote.key, *initiator, start, len, *needed)
                    .ok()?;
                target.memory.spans(iova, len, *write, &mut spans).ok()?
            }
        }
        match spans[..] {
            [span] => Some(Mapped::Contiguous {
                addr: span.addr,
                low,
            }),
            [] => None,
            _ => {
                let mut at = 0usize;
                let starts = spans
                    .iter()
                    .map(|span| {
                        let start = at;
                        at += span.len;
                        start
                    })
                    .collect();
                Some(Mapped::Hull { low, spans, starts })
            }
        }
    }

    /// Checks the transfer's bytes `from..from + len` of `plan` on this
    /// side and finds them in this process: contiguous, or (with `keep`)
    /// as spans appended to `out`. Without `keep` it only checks.
    fn map(
        &self,
        plan: &Plan<'_>,
        from: u64,
        len: u64,
        keep: bool,
        out: &mut Spans,
    ) -> Result<Mapped, Failure> {
        // The whole stream's hull first (no walk): when it is granted,
        // so is every part of it.
        if let Some((low, high)) = plan.hull() {
            if let Some(mapped) = self.hull(low, high) {
                return Ok(mapped);
            }
        }
        let mut hull: Option<(i64, i64)> = None;
        for segment in plan.segments(from, len) {
            // The pattern was planned: offset + len fits an i64.
            let end = segment.offset + segment.len as i64;
            hull = Some(hull.map_or((segment.offset, end), |(low, high)| {
                (low.min(segment.offset), high.max(end))
            }));
        }
        let Some((low, high)) = hull else {
            return Ok(Mapped::Listed);
        };
        if let Some(mapped) = self.hull(low, high) {
            return Ok(mapped);
        }
        for segment in plan.segments(from, len) {
            if !keep {
                out.clear();
            }
            self.element(segment.offset, segment.len, out)?;
        }
        if !keep {
            out.clear();
        }
        Ok(Mapped::Listed)
    }
}

/// A step's part of a pattern as runs of this process's memory, in
/// stream order.
enum Walk<'a, 'p> {
    Contiguous {
        segments: Segments<'a, 'p>,
        addr: *mut u8,
        low: i64,
    },
    Hull(HullWalk<'a, 'p>),
    Listed(std::slice::Iter<'a, Span>),
}

/// The elements of a step found in the spans of their hull by a cursor
/// (elements mostly move forward; one behind it, or far ahead, is found
/// by binary search); an element crossing a span boundary is split into
/// one run per span.
struct HullWalk<'a, 'p> {
    segments: Segments<'a, 'p>,
    low: i64,
    spans: &'a [Span],
    starts: &'a [usize],
    /// The span the previous run was in.
    cursor: usize,
    /// The rest of the current element: offset from `low`, length.
    at: usize,
    left: usize,
}

impl HullWalk<'_, '_> {
    fn next_run(&mut self) -> Option<Span> {
        while self.left == 0 {
            let segment = self.segments.next()?;
            // Inside the hull: the offset is at least `low`, and the
            // element ends within the hull's length (a usize: it is mapped).
            self.at = (segment.offset - self.low) as usize;
            self.left = segment.len as usize;
        }
        let at = self.at;
        let inside = |i: usize| self.starts[i] <= at && at - self.starts[i] < self.spans[i].len;
        if !inside(self.cursor) {
            let next = self.cursor + 1;
            self.cursor = if next < self.spans.len() && inside(next) {
                next
            } else {
                // starts[0] is 0, so at least one start is <= at.
                self.starts.partition_point(|&start| start <= at) - 1
            };
        }
        let span = self.spans[self.cursor];
        let within = at - self.starts[self.cursor];
        assert!(within < span.len, "a step's element outside its hull");
        let len = self.left.min(span.len - within);
        self.at += len;
        self.left -= len;
        Some(Span {
            // SAFETY: `span` is one of the spans mapping the step's hull,
            // granted as a whole (Side::hull); `within < span.len` (checked
            // above) and the run's `len` stops at the span's end.
            addr: unsafe { span.addr.add(within) },
            len,
        })
    }
}

impl Iterator for Walk<'_, '_> {
    type Item = Span;

    fn next(&mut self) -> Option<Span> {
        match self {
            Walk::Contiguous {
                segments,
                addr,
                low,
            } => segments.next().map(|segment| Span {
                // SAFETY: `addr` maps the hull `[low, high)` of the step's
                // elements contiguously (Side::hull), and this element lies
                // inside it.
                addr: unsafe { addr.add((segment.offset - *low) as usize) },
                len: segment.len as usize,
            }),
            Walk::Hull(hull) => hull.next_run(),
            Walk::Listed(spans) => spans.next().copied(),
        }
    }
}

fn walk<'a, 'p>(
    plan: &'a Plan<'p>,
    from: u64,
    len: u64,
    mapped: &'a Mapped,
    spans: &'a Spans,
) -> Walk<'a, 'p> {
    match mapped {
        Mapped::Contiguous { addr, low } => Walk::Contiguous {
            segments: plan.segments(from, len),
            addr: *addr,
            low: *low,
        },
        Mapped::Hull { low, spans, starts } => Walk::Hull(HullWalk {
            segments: plan.segments(from, len),
            low: *low,
            spans,
            starts,
            cursor: 0,
            at: 0,
            left: 0,
        }),
        Mapped::Listed => Walk::Listed(spans.iter()),
    }
}

/// One guarded step of a vector transfer: moves its bytes `from..from +
/// step` from `source` to `destination` (`near` is the local side, `far`
/// the remote one); with `check_all`, first checks every element of the
/// whole transfer on both sides.
pub fn step(
    state: &VectorState,
    near: &Side<'_, '_>,
    far: &Side<'_, '_>,
    local_writes: bool,
    from: u64,
    step: u64,
    check_all: bool,
) -> Result<(), Failure> {
    let mut near_spans = Spans::new();
    let mut far_spans = Spans::new();
    if check_all {
        let len = state.local.len();
        near.map(&state.local, 0, len, false, &mut near_spans)?;
        far.map(&state.remote, 0, len, false, &mut far_spans)?;
    }
    let near_mapped = near.map(&state.local, from, step, true, &mut near_spans)?;
    let far_mapped = far.map(&state.remote, from, step, true, &mut far_spans)?;
    if let (
        Mapped::Contiguous {
            addr: near_addr,
            low: near_low,
        },
        Mapped::Contiguous {
            addr: far_addr,
            low: far_low,
        },
    ) = (&near_mapped, &far_mapped)
    {
        let blocks = (
            StridedNest::block_of(&state.local),
            StridedNest::block_of(&state.remote),
        );
        if let (Some(near_block), Some(far_block)) = blocks {
            // Unit: the smaller block, when it divides the larger (then
            // the loop runs once per run the walk would make).
            let unit = near_block.min(far_block);
            if near_block.max(far_block).is_multiple_of(unit)
                && from.is_multiple_of(unit)
                && step.is_multiple_of(unit)
            {
                let near_nest = StridedNest::of(&state.local, unit, *near_addr, *near_low);
                let far_nest = StridedNest::of(&state.remote, unit, *far_addr, *far_low);
                let (source, target) = if local_writes {
                    (far_nest, near_nest)
                } else {
                    (near_nest, far_nest)
                };
                copy_nests(&source, &target, from / unit, step / unit);
                return Ok(());
            }
        }
    }
    let near_walk = walk(&state.local, from, step, &near_mapped, &near_spans);
    let far_walk = walk(&state.remote, from, step, &far_mapped, &far_spans);
    let limit = usize::try_from(step).unwrap_or(usize::MAX);
    if local_writes {
        copy_spans(far_walk, near_walk, limit);
    } else {
        copy_spans(near_walk, far_walk, limit);
    }
    Ok(())
}

/// A whole pattern that is one strided piece (no skip, no repetition)
/// mapped contiguously, cut into units of `unit` bytes: its units are
/// found by stepping loop indices, with no walk. Vector transfers between
/// two such patterns whose blocks are multiples of one unit (a column into
/// a column or into a contiguous buffer, a submatrix into a submatrix)
/// copy unit against unit in one loop.
struct StridedNest {
    /// Where offset `low` of the pattern is mapped.
    addr: *mut u8,
    low: i64,
    offset: i64,
    unit: u64,
    /// The unit's place in its block, then the piece's loops.
    dims: [Dim; MAX_DIMS + 1],
}

impl StridedNest {
    /// The block size of a pattern this fast path takes: one strided
    /// piece with bytes, the whole stream, one repetition.
    fn block_of(plan: &Plan<'_>) -> Option<u64> {
        let pattern = plan.pattern();
        let [Piece::Strided { block, dims, .. }] = pattern.pieces[..] else {
            return None;
        };
        let whole = pattern.repeat == 1
            && pattern.skip == 0
            && block > 0
            && dims.iter().all(|dim| dim.count > 0);
        whole.then_some(block)
    }

    /// The nest of `plan` (which [`block_of`](Self::block_of) took, with
    /// a block that is a multiple of `unit`) mapped at `addr` from `low`.
    fn of(plan: &Plan<'_>, unit: u64, addr: *mut u8, low: i64) -> StridedNest {
        let Piece::Strided {
            offset,
            block,
            dims: piece_dims,
        } = plan.pattern().pieces[0]
        else {
            unreachable!("block_of took only one strided piece")
        };
        let mut dims = [Dim::ONE; MAX_DIMS + 1];
        dims[0] = Dim {
            count: block / unit,
            stride: unit as i64,
        };
        dims[1..].copy_from_slice(&piece_dims);
        StridedNest {
            addr,
            low,
            offset,
            unit,
            dims,
        }
    }

    /// Loop indices of unit `element`, innermost first, and its offset.
    fn seek(&self, element: u64) -> ([u64; MAX_DIMS + 1], i64) {
        let mut index = [0; MAX_DIMS + 1];
        let mut rest = element;
        let mut at = self.offset;
        for (i, dim) in self.dims.iter().enumerate() {
            index[i] = rest % dim.count;
            rest /= dim.count;
            at += index[i] as i64 * dim.stride;
        }
        (index, at)
    }

    /// The innermost loop that runs more than once (the units of one
    /// block, or a piece's loop), or the outermost if none does: units
    /// follow each other along it at a constant stride.
    fn innermost(&self) -> usize {
        self.dims
            .iter()
            .position(|dim| dim.count > 1)
            .unwrap_or(MAX_DIMS)
    }

    /// Moves `index` and `at` on by `run` units along loop `d` (the
    /// [`innermost`](Self::innermost), whose inner loops run once), `run`
    /// no more than that loop has left, carrying into the outer loops
    /// when it ends.
    ///
    /// A loop that ends is stepped past its end and back. Only the result
    /// lies in the hull: the step past may leave `i64`'s range (a loop that
    /// runs once may have any stride), so the arithmetic wraps, and the
    /// result is exact all the same.
    #[inline(always)]
    fn advance(&self, index: &mut [u64; MAX_DIMS + 1], at: &mut i64, d: usize, run: u64) {
        let dim = self.dims[d];
        index[d] += run;
        *at = at.wrapping_add(dim.stride.wrapping_mul(run as i64));
        if index[d] < dim.count {
            return;
        }
        *at = at.wrapping_sub(dim.stride.wrapping_mul(dim.count as i64));
        index[d] = 0;
        for (i, dim) in self.dims.iter().enumerate().skip(d + 1) {
            index[i] += 1;
            *at = at.wrapping_add(dim.stride);
            if index[i] < dim.count {
                return;
            }
            *at = at.wrapping_sub(dim.stride.wrapping_mul(dim.count as i64));
            index[i] = 0;
        }
    }
}

/// Copies units `first..first + count` of `source` to the same units of
/// `target` (both nests have the same unit and cover the same bytes; the
/// caller checked and mapped both for the current step), in runs along
/// both sides' innermost loops: within a run both sides move at a
/// constant stride.
fn copy_nests(source: &StridedNest, target: &StridedNest, first: u64, count: u64) {
    let (mut source_index, mut source_at) = source.seek(first);
    let (mut target_index, mut target_at) = target.seek(first);
    let (source_loop, target_loop) = (source.innermost(), target.innermost());
    let (source_dim, target_dim) = (source.dims[source_loop], target.dims[target_loop]);
    let mut left = count;
    while left > 0 {
        let run = left
            .min(source_dim.count - source_index[source_loop])
            .min(target_dim.count - target_index[target_loop]);
        // SAFETY: both nests are mapped contiguously from `low` over their
        // hull (Side::hull, checked and granted for the current step), and
        // every block of a checked plan lies inside its hull; the run's
        // `run` units are units of the nests (the run ends where either
        // side's loop does), each `unit` bytes at `at + k * stride` from
        // `low`.
        unsafe {
            copy_strided(
                source.addr.offset((source_at - source.low) as isize),
                source_dim.stride as isize,
                target.addr.offset((target_at - target.low) as isize),
                target_dim.stride as isize,
                source.unit as usize,
                run as usize,
            );
        }
        source.advance(&mut source_index, &mut source_at, source_loop, run);
        target.advance(&mut target_index, &mut target_at, target_loop, run);
        left -= run;
    }
}

/// A strided copy whose stride on either side is at least this many bytes
/// prefetches its units ahead ([`PREFETCH_AHEAD`]): the hardware's stride
/// prefetchers stop at page boundaries and follow short strides only, so
/// a column of a matrix (one element per row, rows kilobytes apart) is
/// otherwise one cache miss after another, each target line also taken
/// from the core that last wrote it. Measured with `vector-transfer`
/// (`4096 x 4097` doubles, 2 MiB pages): a 4096 x 16 submatrix moved in
/// 217 us without, 75 us with (the one-pass copy by one core: 52 us).
const PREFETCH_STRIDE_MIN: usize = 1024;
/// Units ahead of the one being copied whose lines are prefetched (16:
/// 85 us in the measurement above, 32 and 64: 75 us).
const PREFETCH_AHEAD: isize = 32;
/// Units longer than this are left to the hardware's sequential
/// prefetchers, which follow a unit's own lines.
const PREFETCH_UNIT_MAX: usize = 256;

/// Copies `run` units of `unit` bytes from `from + k * from_stride` to
/// `to + k * to_stride`, k in `0..run`: one loop per common unit size, so
/// that an element of a column is one load and one store, and a row of a
/// few doubles a few of each with no call. A unit is read whole before it
/// is written, so units that overlap copy as `memmove` would. Far strides
/// prefetch ([`PREFETCH_STRIDE_MIN`]).
///
/// # Safety
/// Every unit on both sides lies inside memory the caller may read
/// (`from`) and write (`to`).
unsafe fn copy_strided(
    from: *const u8,
    from_stride: isize,
    to: *mut u8,
    to_stride: isize,
    unit: usize,
    run: usize,
) {
    let far = from_stride.unsigned_abs().max(to_stride.unsigned_abs()) >= PREFETCH_STRIDE_MIN;
    if far && unit <= PREFETCH_UNIT_MAX {
        // SAFETY: the caller's contract.
        unsafe { copy_units::<true>(from, from_stride, to, to_stride, unit, run) }
    } else {
        // SAFETY: the caller's contract.
        unsafe { copy_units::<false>(from, from_stride, to, to_stride, unit, run) }
    }
}

/// [`copy_strided`], prefetching [`PREFETCH_AHEAD`] units ahead on both
/// sides when `PREFETCH`, inside the run ([`ahead`]).
///
/// # Safety
/// As for [`copy_strided`].
#[inline(always)]
unsafe fn copy_units<const PREFETCH: bool>(
    from: *const u8,
    from_stride: isize,
    to: *mut u8,
    to_stride: isize,
    unit: usize,
    run: usize,
) {
    /// The loop for units that are one value of `T`.
    ///
    /// # Safety
    /// As for `copy_strided`, with `unit` the size of `T`.
    #[inline(always)]
    unsafe fn values<T: Copy, const PREFETCH: bool>(
        from: *const u8,
        fs: isize,
        to: *mut u8,
        ts: isize,
        run: usize,
    ) {
        let (mut from, mut to) = (from, to);
        let (prefetched, from_ahead, to_ahead) = ahead::<PREFETCH>(fs, ts, run);
        for k in 0..run {
            if PREFETCH && k < prefetched {
                let size = std::mem::size_of::<T>();
                prefetch_lines(from.wrapping_offset(from_ahead), size);
                prefetch_lines(to.wrapping_offset(to_ahead), size);
            }
            // SAFETY: the caller's units hold a `T` each; unaligned
            // accesses make no claim on alignment.
            unsafe {
                to.cast::<T>()
                    .write_unaligned(from.cast::<T>().read_unaligned());
            }
            from = from.wrapping_offset(fs);
            to = to.wrapping_offset(ts);
        }
    }
    // SAFETY (all arms): the caller's contract, unit by unit.
    unsafe {
        match unit {
            4 => values::<u32, PREFETCH>(from, from_stride, to, to_stride, run),
            8 => values::<u64, PREFETCH>(from, from_stride, to, to_stride, run),
            16 => values::<u128, PREFETCH>(from, from_stride, to, to_stride, run),
            32 => values::<[u128; 2], PREFETCH>(from, from_stride, to, to_stride, run),
            64 => values::<[u128; 4], PREFETCH>(from, from_stride, to, to_stride, run),
            128 => values::<[u128; 8], PREFETCH>(from, from_stride, to, to_stride, run),
            _ => {
                let (mut from, mut to) = (from, to);
                let (prefetched, from_ahead, to_ahead) =
                    ahead::<PREFETCH>(from_stride, to_stride, run);
                for k in 0..run {
                    if PREFETCH && k < prefetched {
                        prefetch_lines(from.wrapping_offset(from_ahead), unit);
                        prefetch_lines(to.wrapping_offset(to_ahead), unit);
                    }
                    copy_run(from, to, unit);
                    from = from.wrapping_offset(from_stride);
                    to = to.wrapping_offset(to_stride);
                }
            }
        }
    }
}

/// How a run of `run` units prefetches: the first units whose unit
/// [`PREFETCH_AHEAD`] further on is still in the run (none if the run is
/// that short, or without `PREFETCH`), and the byte distances to it on
/// each side. Prefetching stays inside the run, so the distances are at
/// most the run's own extent (no overflow) and no line outside the
/// pattern is asked for.
#[inline(always)]
fn ahead<const PREFETCH: bool>(
    from_stride: isize,
    to_stride: isize,
    run: usize,
) -> (usize, isize, isize) {
    let prefetched = if PREFETCH {
        run.saturating_sub(PREFETCH_AHEAD as usize)
    } else {
        0
    };
    if prefetched == 0 {
        return (0, 0, 0);
    }
    (
        prefetched,
        from_stride.wrapping_mul(PREFETCH_AHEAD),
        to_stride.wrapping_mul(PREFETCH_AHEAD),
    )
}

/// Asks for every cache line of the `bytes` bytes at `at` (into every
/// cache level). A hint: it reads nothing, and an address outside mapped
/// memory is ignored (x86_64; elsewhere nothing).
#[inline(always)]
fn prefetch_lines(at: *const u8, bytes: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        const LINE: usize = 64;
        let offset = at as usize & (LINE - 1);
        let first_line = at.wrapping_sub(offset);
        // Lines after the first the bytes reach into.
        let more = (offset + bytes.max(1) - 1) / LINE;
        for line in 0..=more {
            // SAFETY: a prefetch neither faults nor reads into the
            // program: any address is allowed (SSE is baseline on x86_64).
            unsafe { _mm_prefetch::<_MM_HINT_T0>(first_line.wrapping_add(line * LINE).cast()) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (at, bytes);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A nest of `unit`-byte units over `buffer`, loops innermost first.
    fn nest(buffer: &mut [u8], unit: u64, loops: &[(u64, i64)]) -> StridedNest {
        let mut dims = [Dim::ONE; MAX_DIMS + 1];
        for (dim, &(count, stride)) in dims.iter_mut().zip(loops) {
            *dim = Dim { count, stride };
        }
        // Put the lowest unit at the buffer's start.
        let low: i64 = dims
            .iter()
            .map(|d| (d.count as i64 - 1) * d.stride.min(0))
            .sum();
        StridedNest {
            addr: buffer.as_mut_ptr(),
            low,
            offset: 0,
            unit,
            dims,
        }
    }

    /// Bytes a nest's hull spans.
    fn span(unit: u64, loops: &[(u64, i64)]) -> usize {
        let reach: i64 = loops
            .iter()
            .map(|&(count, stride)| (count as i64 - 1) * stride.abs())
            .sum();
        reach as usize + unit as usize
    }

    /// Loops, innermost first: the innermost long enough for runs that
    /// prefetch (more than `PREFETCH_AHEAD` units), the others short.
    fn loops() -> impl Strategy<Value = Vec<(u64, i64)>> {
        (
            (1u64..2 * PREFETCH_AHEAD as u64, -40i64..40),
            prop::collection::vec((1u64..6, -40i64..40), 0..=MAX_DIMS),
        )
            .prop_map(|(innermost, outer)| [vec![innermost], outer].concat())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// Copying in runs along both sides' innermost loops moves the
        /// same bytes, in the same order, as copying unit by unit; with
        /// strides spread out, runs also take the prefetching loops
        /// (`PREFETCH_STRIDE_MIN`), for every unit size with a loop of
        /// its own and for others.
        #[test]
        fn runs_copy_what_units_copy(
            unit in prop::sample::select(vec![1u64, 3, 4, 8, 16, 24, 32, 64, 128, 200]),
            far in any::<bool>(),
            source_loops in loops(),
            target_loops in loops(),
            first_share in 0.0f64..1.0,
        ) {
            let units = |l: &[(u64, i64)]| l.iter().map(|&(c, _)| c).product::<u64>();
            let total = units(&source_loops).min(units(&target_loops));
            let first = ((total as f64 * first_share) as u64).min(total - 1);
            let count = total - first;
            let scale = |l: &[(u64, i64)]| -> Vec<(u64, i64)> {
                // Far: every nonzero stride at least `PREFETCH_STRIDE_MIN`.
                let push = |s: i64| match far {
                    true => s.signum() * PREFETCH_STRIDE_MIN as i64,
                    false => 0,
                };
                l.iter().map(|&(c, s)| (c, s * unit as i64 + push(s))).collect()
            };
            let (source_loops, target_loops) = (scale(&source_loops), scale(&target_loops));
            let mut source: Vec<u8> = (0..span(unit, &source_loops)).map(|i| (i * 7 + 1) as u8).collect();
            let target_len = span(unit, &target_loops);
            let mut target = vec![0u8; target_len];
            let mut expected = vec![0u8; target_len];
            let source_nest = nest(&mut source, unit, &source_loops);
            let expected_nest = nest(&mut expected, unit, &target_loops);
            for element in first..first + count {
                let (_, from) = source_nest.seek(element);
                let (_, to) = expected_nest.seek(element);
                let from = (from - source_nest.low) as usize;
                let to = (to - expected_nest.low) as usize;
                let bytes = source[from..from + unit as usize].to_vec();
                expected[to..to + unit as usize].copy_from_slice(&bytes);
            }
            let target_nest = nest(&mut target, unit, &target_loops);
            copy_nests(&source_nest, &target_nest, first, count);
            prop_assert_eq!(target, expected);
        }
    }
}
