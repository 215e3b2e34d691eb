//! Access patterns of vector transfers (VECTOR_WRITE, VECTOR_READ): which
//! bytes of one side's memory a transfer touches, and in which order.
//!
//! A [`Pattern`] names a byte stream laid over memory at a *base* (an IOVA
//! on the initiator's side, an offset inside a window on the target's):
//! the period, a list of [`Piece`]s, repeated [`Pattern::repeat`] times,
//! each repetition [`Pattern::extent`] bytes after the one before. A piece
//! is either a nest of up to [`MAX_DIMS`] strided loops around a
//! contiguous block (a column of a matrix, a subarray of a 3-D array: any
//! block size from one byte, any counts and strides, negative ones
//! included) or a list of `(offset, length)` [`Block`]s, carried in the
//! descriptor or held in the initiator's registered memory. A list of
//! pieces combines them (DIMMnet-2's parameter list: 40-byte records as
//! 32 + 8 bytes). Of the stream the pattern describes, the transfer
//! covers [`Pattern::len`] bytes from byte [`Pattern::skip`] on, so "the
//! part of this pattern from byte `k` to byte `k + m`" is the same
//! pattern with `skip + k` and `m` ([`Plan::slice`]): a transfer cut into
//! packets carries, in each, the parameters of its own part.
//!
//! ## Encoding (little-endian)
//!
//! A pattern is a 40-byte header followed by its pieces:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | number of pieces |
//! | 4 | 4 | reserved, zero |
//! | 8 | 8 | repeat |
//! | 16 | 8 | extent (signed) |
//! | 24 | 8 | skip |
//! | 32 | 8 | len |
//!
//! Each piece starts with a kind byte and seven reserved zero bytes:
//!
//! | kind | size | fields after the first 8 bytes |
//! |---|---|---|
//! | 1, strided | 72 | offset (i64), block (u64), then [`MAX_DIMS`] x (count u64, stride i64), innermost first |
//! | 2, listed blocks | 24 + 16 n | offset (i64), n (u64), then n x (offset i64, len u64) |
//! | 3, blocks in memory | 32 | offset (i64), n (u64), IOVA of n x (offset i64, len u64) in the initiator's registered memory |
//!
//! A descriptor is the local pattern followed by the remote one
//! ([`encode_pair`], [`decode_pair`]).
//!
//! Decoding validates every field and allocates no more than the input
//! holds; [`Pattern::plan`] checks the arithmetic (no count, stride or
//! offset overflows, `skip + len` inside the stream) and builds the index
//! a [`Segments`] walk seeks with.

use std::borrow::Cow;

use thiserror::Error;

/// Strided loops around a piece's block, at most.
pub const MAX_DIMS: usize = 3;

/// Bytes of a pattern header.
pub const HEADER_BYTES: usize = 40;
/// Bytes of a strided piece.
pub const STRIDED_BYTES: usize = 8 + 16 + 16 * MAX_DIMS;
/// Bytes of a listed-blocks piece before its blocks.
pub const LISTED_HEADER_BYTES: usize = 24;
/// Bytes of a blocks-in-memory piece.
pub const IN_MEMORY_BYTES: usize = 32;
/// Bytes of one encoded [`Block`].
pub const BLOCK_BYTES: usize = 16;
/// The most blocks a device takes in one pattern, whatever its
/// configuration (`pindown-emu-device --max-pattern-blocks` chooses a
/// limit up to this one).
pub const MAX_BLOCKS_CAP: u64 = 1 << 24;

const KIND_STRIDED: u8 = 1;
const KIND_LISTED: u8 = 2;
const KIND_IN_MEMORY: u8 = 3;

/// One strided loop: `count` iterations, `stride` bytes apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Dim {
    /// Iterations.
    pub count: u64,
    /// Bytes from one iteration to the next (may be negative).
    pub stride: i64,
}

impl Dim {
    /// A loop of one iteration: an unused dimension.
    pub const ONE: Dim = Dim {
        count: 1,
        stride: 0,
    };
}

/// A contiguous run of bytes at `offset` from a piece's origin.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Block {
    /// Offset from the piece's origin (may be negative).
    pub offset: i64,
    /// Bytes.
    pub len: u64,
}

/// Where a piece's block list is.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum BlockList {
    /// In the descriptor.
    Listed(Vec<Block>),
    /// `count` encoded blocks at `iova` in the initiator's registered
    /// memory; [`Pattern::resolve_lists`] reads them.
    InMemory {
        /// IOVA of the first block.
        iova: u64,
        /// Blocks.
        count: u64,
    },
}

/// One piece of a pattern's period.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Piece {
    /// Blocks of `block` bytes at `offset + i0 * dims[0].stride + i1 *
    /// dims[1].stride + i2 * dims[2].stride`, `i0` innermost (varying
    /// fastest).
    Strided {
        /// Offset of the first block from the repetition's origin.
        offset: i64,
        /// Bytes of each block.
        block: u64,
        /// The loops, innermost first; unused ones are [`Dim::ONE`].
        dims: [Dim; MAX_DIMS],
    },
    /// Blocks listed one by one, each at `offset + block.offset`.
    Indexed {
        /// Origin of the listed offsets, from the repetition's origin.
        offset: i64,
        /// The blocks, in order.
        blocks: BlockList,
    },
}

impl Piece {
    /// `count` blocks of `block` bytes, `stride` apart, from `offset`.
    pub fn vector(offset: i64, block: u64, count: u64, stride: i64) -> Piece {
        Piece::Strided {
            offset,
            block,
            dims: [Dim { count, stride }, Dim::ONE, Dim::ONE],
        }
    }

    /// `len` contiguous bytes at `offset`.
    pub fn contiguous(offset: i64, len: u64) -> Piece {
        Piece::vector(offset, len, 1, 0)
    }

    /// The blocks it lists in the descriptor, if it lists them.
    pub fn listed(&self) -> Option<&[Block]> {
        match self {
            Piece::Indexed {
                blocks: BlockList::Listed(list),
                ..
            } => Some(list),
            _ => None,
        }
    }

    /// Bytes of its encoding in a descriptor.
    pub fn encoded_len(&self) -> usize {
        match self {
            Piece::Strided { .. } => STRIDED_BYTES,
            Piece::Indexed {
                blocks: BlockList::Listed(list),
                ..
            } => LISTED_HEADER_BYTES + BLOCK_BYTES * list.len(),
            Piece::Indexed {
                blocks: BlockList::InMemory { .. },
                ..
            } => IN_MEMORY_BYTES,
        }
    }
}

/// An access pattern: see the [module documentation](self).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Pattern {
    /// Repetitions of the period.
    pub repeat: u64,
    /// Bytes from one repetition's origin to the next (may be negative).
    pub extent: i64,
    /// Bytes of the stream before the transfer's first.
    pub skip: u64,
    /// Bytes of the stream the transfer covers.
    pub len: u64,
    /// The period.
    pub pieces: Vec<Piece>,
}

/// Why a pattern was refused.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum PatternError {
    /// The descriptor ends inside a header, piece or block list.
    #[error("pattern descriptor truncated: need {needed} bytes at offset {at}, have {have}")]
    Truncated {
        /// Where the structure starts.
        at: usize,
        /// Bytes the structure needs.
        needed: usize,
        /// Bytes left.
        have: usize,
    },
    /// A piece kind this ABI does not define.
    #[error("unknown pattern piece kind {kind} at offset {at}")]
    UnknownPiece {
        /// The kind byte.
        kind: u8,
        /// Where the piece starts.
        at: usize,
    },
    /// A reserved field is not zero.
    #[error("reserved pattern field at offset {at} is not zero")]
    ReservedNotZero {
        /// The byte's offset.
        at: usize,
    },
    /// Bytes follow the last pattern of a descriptor.
    #[error("{0} bytes follow the patterns of the descriptor")]
    TrailingBytes(usize),
    /// Counts, strides, offsets or lengths overflow 64 bits.
    #[error("pattern arithmetic overflows: {0}")]
    Overflow(&'static str),
    /// `skip + len` lies past the end of the stream.
    #[error("pattern covers {stream} bytes, but skip {skip} + len {len} reach past them")]
    OutsideStream {
        /// Bytes of the whole stream.
        stream: u128,
        /// The pattern's skip.
        skip: u64,
        /// The pattern's len.
        len: u64,
    },
    /// A block list in memory was not read in ([`Pattern::resolve_lists`]).
    #[error("a block list in memory was not resolved")]
    Unresolved,
    /// The block lists hold more blocks than the reader allows.
    #[error("pattern block lists hold more than {0} blocks")]
    TooManyBlocks(u64),
    /// A block list in memory could not be read.
    #[error("block list at {iova:#x} ({count} blocks) is not readable")]
    ListUnreadable {
        /// Its IOVA.
        iova: u64,
        /// Its blocks.
        count: u64,
    },
}

impl Pattern {
    /// The whole stream of `pieces`, `repeat` times, `extent` apart.
    pub fn new(pieces: Vec<Piece>, repeat: u64, extent: i64) -> Result<Pattern, PatternError> {
        let mut pattern = Pattern {
            repeat,
            extent,
            skip: 0,
            len: 0,
            pieces,
        };
        let period = period_bytes(&pattern.pieces)?;
        pattern.len = u64::try_from(u128::from(period) * u128::from(repeat))
            .map_err(|_| PatternError::Overflow("total bytes"))?;
        Ok(pattern)
    }

    /// `len` contiguous bytes from the base.
    pub fn contiguous(len: u64) -> Pattern {
        Pattern {
            repeat: 1,
            extent: 0,
            skip: 0,
            len,
            pieces: vec![Piece::contiguous(0, len)],
        }
    }

    /// `len` bytes by the list of `count` blocks at `iova` of the
    /// initiator's registered memory, read when the request runs (the
    /// length is given: it cannot be summed from a list not held here).
    pub fn listed_in_memory(iova: u64, count: u64, len: u64) -> Pattern {
        Pattern {
            repeat: 1,
            extent: 0,
            skip: 0,
            len,
            pieces: vec![Piece::Indexed {
                offset: 0,
                blocks: BlockList::InMemory { iova, count },
            }],
        }
    }

    /// Bytes of its encoding.
    pub fn encoded_len(&self) -> usize {
        HEADER_BYTES + self.pieces.iter().map(Piece::encoded_len).sum::<usize>()
    }

    /// Appends its encoding to `out`.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        let pieces = u32::try_from(self.pieces.len()).unwrap_or(u32::MAX);
        out.extend_from_slice(&pieces.to_le_bytes());
        out.extend_from_slice(&[0; 4]);
        out.extend_from_slice(&self.repeat.to_le_bytes());
        out.extend_from_slice(&self.extent.to_le_bytes());
        out.extend_from_slice(&self.skip.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
        for piece in &self.pieces {
            match piece {
                Piece::Strided {
                    offset,
                    block,
                    dims,
                } => {
                    out.extend_from_slice(&[KIND_STRIDED, 0, 0, 0, 0, 0, 0, 0]);
                    out.extend_from_slice(&offset.to_le_bytes());
                    out.extend_from_slice(&block.to_le_bytes());
                    for dim in dims {
                        out.extend_from_slice(&dim.count.to_le_bytes());
                        out.extend_from_slice(&dim.stride.to_le_bytes());
                    }
                }
                Piece::Indexed { offset, blocks } => match blocks {
                    BlockList::Listed(list) => {
                        out.extend_from_slice(&[KIND_LISTED, 0, 0, 0, 0, 0, 0, 0]);
                        out.extend_from_slice(&offset.to_le_bytes());
                        out.extend_from_slice(&(list.len() as u64).to_le_bytes());
                        for block in list {
                            encode_block(block, out);
                        }
                    }
                    BlockList::InMemory { iova, count } => {
                        out.extend_from_slice(&[KIND_IN_MEMORY, 0, 0, 0, 0, 0, 0, 0]);
                        out.extend_from_slice(&offset.to_le_bytes());
                        out.extend_from_slice(&count.to_le_bytes());
                        out.extend_from_slice(&iova.to_le_bytes());
                    }
                },
            }
        }
    }

    /// Its encoding.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.encoded_len());
        self.encode_into(&mut out);
        out
    }

    /// Decodes one pattern from the start of `bytes`; returns it and the
    /// bytes it took. `at` is where `bytes` starts in the descriptor (for
    /// error messages).
    pub fn decode(bytes: &[u8], at: usize) -> Result<(Pattern, usize), PatternError> {
        let mut reader = Reader {
            bytes,
            at: 0,
            base: at,
        };
        let header = reader.take(HEADER_BYTES)?;
        let pieces = le_u32(header, 0);
        reader.zero(header, 4..8)?;
        let mut pattern = Pattern {
            repeat: le_u64(header, 8),
            extent: le_u64(header, 16) as i64,
            skip: le_u64(header, 24),
            len: le_u64(header, 32),
            pieces: Vec::new(),
        };
        for _ in 0..pieces {
            let start = reader.at;
            let head = reader.take(8)?;
            reader.zero(head, 1..8)?;
            let piece = match head[0] {
                KIND_STRIDED => {
                    let body = reader.take(STRIDED_BYTES - 8)?;
                    let mut dims = [Dim::ONE; MAX_DIMS];
                    for (i, dim) in dims.iter_mut().enumerate() {
                        *dim = Dim {
                            count: le_u64(body, 16 + 16 * i),
                            stride: le_u64(body, 24 + 16 * i) as i64,
                        };
                    }
                    Piece::Strided {
                        offset: le_u64(body, 0) as i64,
                        block: le_u64(body, 8),
                        dims,
                    }
                }
                KIND_LISTED => {
                    let body = reader.take(LISTED_HEADER_BYTES - 8)?;
                    let count = le_u64(body, 8);
                    let needed = usize::try_from(count)
                        .ok()
                        .and_then(|count| count.checked_mul(BLOCK_BYTES))
                        .unwrap_or(usize::MAX);
                    let list = reader.take(needed)?;
                    Piece::Indexed {
                        offset: le_u64(body, 0) as i64,
                        blocks: BlockList::Listed(decode_blocks(list)),
                    }
                }
                KIND_IN_MEMORY => {
                    let body = reader.take(IN_MEMORY_BYTES - 8)?;
                    Piece::Indexed {
                        offset: le_u64(body, 0) as i64,
                        blocks: BlockList::InMemory {
                            count: le_u64(body, 8),
                            iova: le_u64(body, 16),
                        },
                    }
                }
                kind => {
                    return Err(PatternError::UnknownPiece {
                        kind,
                        at: at + start,
                    })
                }
            };
            pattern.pieces.push(piece);
        }
        Ok((pattern, reader.at))
    }

    /// Blocks its lists in memory hold.
    pub fn blocks_in_memory(&self) -> u64 {
        self.pieces
            .iter()
            .map(|piece| match piece {
                Piece::Indexed {
                    blocks: BlockList::InMemory { count, .. },
                    ..
                } => *count,
                _ => 0,
            })
            .fold(0, u64::saturating_add)
    }

    /// Replaces each block list in memory by a copy read through `read`
    /// (IOVA, bytes to fill), taking at most `max_blocks` blocks in all
    /// lists, listed or read: the copy is the device's own, so the owner
    /// changing the list afterwards changes nothing.
    pub fn resolve_lists(
        &mut self,
        max_blocks: u64,
        read: &mut dyn FnMut(u64, &mut [u8]) -> bool,
    ) -> Result<(), PatternError> {
        let listed: u64 = self
            .pieces
            .iter()
            .map(|piece| piece.listed().map_or(0, |list| list.len() as u64))
            .sum();
        if listed.saturating_add(self.blocks_in_memory()) > max_blocks {
            return Err(PatternError::TooManyBlocks(max_blocks));
        }
        for piece in &mut self.pieces {
            if let Piece::Indexed { blocks, .. } = piece {
                if let BlockList::InMemory { iova, count } = *blocks {
                    let unreadable = PatternError::ListUnreadable { iova, count };
                    let bytes = usize::try_from(count)
                        .ok()
                        .and_then(|count| count.checked_mul(BLOCK_BYTES))
                        .ok_or(unreadable.clone())?;
                    let mut raw = vec![0u8; bytes];
                    if !read(iova, &mut raw) {
                        return Err(unreadable);
                    }
                    *blocks = BlockList::Listed(decode_blocks(&raw));
                }
            }
        }
        Ok(())
    }

    /// Checks the pattern's arithmetic and indexes it for seeking.
    pub fn plan(&self) -> Result<Plan<'_>, PatternError> {
        Plan::new(Cow::Borrowed(self))
    }

    /// [`Pattern::plan`], keeping the pattern in the plan: a plan that
    /// outlives the place the pattern was decoded in (a transfer that
    /// goes on over several turns).
    pub fn into_plan(self) -> Result<Plan<'static>, PatternError> {
        Plan::new(Cow::Owned(self))
    }
}

impl<'p> Plan<'p> {
    fn new(pattern: Cow<'p, Pattern>) -> Result<Plan<'p>, PatternError> {
        let mut starts = Vec::with_capacity(pattern.pieces.len() + 1);
        let mut list_starts = Vec::with_capacity(pattern.pieces.len());
        let mut period: u64 = 0;
        let mut low = i128::MAX;
        let mut high = i128::MIN;
        for piece in &pattern.pieces {
            starts.push(period);
            let (bytes, hull, prefix) = piece_facts(piece)?;
            list_starts.push(prefix);
            period = period
                .checked_add(bytes)
                .ok_or(PatternError::Overflow("period bytes"))?;
            if let Some((l, h)) = hull {
                low = low.min(l);
                high = high.max(h);
            }
        }
        starts.push(period);
        let stream = u128::from(period) * u128::from(pattern.repeat);
        if u128::from(pattern.skip) + u128::from(pattern.len) > stream {
            return Err(PatternError::OutsideStream {
                stream,
                skip: pattern.skip,
                len: pattern.len,
            });
        }
        let hull = if period == 0 || pattern.repeat == 0 {
            None
        } else {
            let reach = i128::from(pattern.extent) * i128::from(pattern.repeat - 1);
            let (l, h) = (low + reach.min(0), high + reach.max(0));
            if l < i128::from(i64::MIN) || h > i128::from(i64::MAX) {
                return Err(PatternError::Overflow("pattern offsets"));
            }
            Some((l as i64, h as i64))
        };
        Ok(Plan {
            pattern,
            starts,
            list_starts,
            period,
            hull,
        })
    }
}

/// Bytes, hull (lowest offset, one past the highest) and, for a listed
/// piece, prefix sums of its blocks' lengths.
type PieceFacts = (u64, Option<(i128, i128)>, Vec<u64>);

fn piece_facts(piece: &Piece) -> Result<PieceFacts, PatternError> {
    match piece {
        Piece::Strided {
            offset,
            block,
            dims,
        } => {
            let mut elements: u64 = 1;
            let (mut low, mut high) = (i128::from(*offset), i128::from(*offset));
            for dim in dims {
                elements = elements
                    .checked_mul(dim.count)
                    .ok_or(PatternError::Overflow("strided counts"))?;
                if dim.count > 0 {
                    // Each reach fits an i128 (|stride| < 2^63, count <
                    // 2^64), but three of them and the offset may not.
                    let reach = i128::from(dim.stride) * i128::from(dim.count - 1);
                    let overflow = PatternError::Overflow("strided offsets");
                    low = low.checked_add(reach.min(0)).ok_or(overflow.clone())?;
                    high = high.checked_add(reach.max(0)).ok_or(overflow)?;
                }
            }
            let bytes = elements
                .checked_mul(*block)
                .ok_or(PatternError::Overflow("strided bytes"))?;
            let end = high
                .checked_add(i128::from(*block))
                .ok_or(PatternError::Overflow("strided offsets"))?;
            let hull = (bytes > 0).then_some((low, end));
            check_offsets(hull)?;
            Ok((bytes, hull, Vec::new()))
        }
        Piece::Indexed { offset, blocks } => {
            let BlockList::Listed(list) = blocks else {
                return Err(PatternError::Unresolved);
            };
            let mut prefix = Vec::with_capacity(list.len() + 1);
            let mut bytes: u64 = 0;
            let (mut low, mut high) = (i128::MAX, i128::MIN);
            for block in list {
                prefix.push(bytes);
                bytes = bytes
                    .checked_add(block.len)
                    .ok_or(PatternError::Overflow("listed bytes"))?;
                if block.len > 0 {
                    let start = i128::from(*offset) + i128::from(block.offset);
                    low = low.min(start);
                    high = high.max(start + i128::from(block.len));
                }
            }
            prefix.push(bytes);
            let hull = (bytes > 0).then_some((low, high));
            check_offsets(hull)?;
            Ok((bytes, hull, prefix))
        }
    }
}

fn check_offsets(hull: Option<(i128, i128)>) -> Result<(), PatternError> {
    match hull {
        Some((low, high)) if low < i128::from(i64::MIN) || high > i128::from(i64::MAX) => {
            Err(PatternError::Overflow("piece offsets"))
        }
        _ => Ok(()),
    }
}

/// A checked pattern, indexed so that a walk can start at any byte in
/// O(dimensions + log blocks).
#[derive(Clone, Debug)]
pub struct Plan<'p> {
    /// Borrowed ([`Pattern::plan`]) or owned ([`Pattern::into_plan`]).
    pattern: Cow<'p, Pattern>,
    /// Stream offset of each piece inside the period, and the period.
    starts: Vec<u64>,
    /// For each listed piece, prefix sums of its blocks' lengths.
    list_starts: Vec<Vec<u64>>,
    period: u64,
    hull: Option<(i64, i64)>,
}

impl<'p> Plan<'p> {
    /// The pattern.
    pub fn pattern(&self) -> &Pattern {
        &self.pattern
    }

    /// Bytes the transfer covers ([`Pattern::len`]).
    pub fn len(&self) -> u64 {
        self.pattern.len
    }

    /// Whether the transfer covers no byte.
    pub fn is_empty(&self) -> bool {
        self.pattern.len == 0
    }

    /// Lowest offset and one past the highest offset of any byte of the
    /// whole stream, relative to the base (`None` when it has no byte): a
    /// byte range holding the hull holds every block.
    pub fn hull(&self) -> Option<(i64, i64)> {
        self.hull
    }

    /// The blocks of the transfer's bytes `from..from + len` (counted from
    /// [`Pattern::skip`]), in stream order, as offsets from the base.
    /// `from + len` must not pass [`Plan::len`] (it is clamped).
    pub fn segments(&self, from: u64, len: u64) -> Segments<'_, 'p> {
        let end = from.saturating_add(len).min(self.pattern.len);
        let start = from.min(end);
        let mut walk = Segments {
            plan: self,
            left: end - start,
            repetition: 0,
            piece: 0,
            index: [0; MAX_DIMS],
            into: 0,
            at: None,
        };
        if walk.left > 0 {
            walk.seek(u128::from(self.pattern.skip) + u128::from(start));
        }
        walk
    }

    /// The pattern of the transfer's bytes `from..from + len` alone, as
    /// small as the part allows: the same period with the skip moved, and
    /// listed pieces cut to the blocks the part touches when the part lies
    /// inside one repetition.
    pub fn slice(&self, from: u64, len: u64) -> Pattern {
        let end = from.saturating_add(len).min(self.pattern.len);
        let from = from.min(end);
        let absolute = u128::from(self.pattern.skip) + u128::from(from);
        let last = absolute + u128::from(end - from);
        let mut pattern = self.pattern.as_ref().clone();
        pattern.len = end - from;
        pattern.skip = (absolute) as u64;
        if self.period == 0 || end == from {
            pattern.skip = 0;
            pattern.repeat = 0;
            pattern.pieces.clear();
            return pattern;
        }
        let period = u128::from(self.period);
        let (first_rep, last_rep) = (absolute / period, (last - 1) / period);
        if first_rep == last_rep {
            // Inside one repetition: one period, moved to that repetition,
            // with the pieces it does not touch dropped and listed ones
            // cut.
            let within = (absolute % period) as u64;
            let within_end = within + (end - from);
            let origin = i128::from(self.pattern.extent) * first_rep as i128;
            let mut pieces = Vec::new();
            let mut skip = 0;
            for (i, piece) in self.pattern.pieces.iter().enumerate() {
                let (start, stop) = (self.starts[i], self.starts[i + 1]);
                if stop <= within || start >= within_end || start == stop {
                    continue;
                }
                let first_piece = pieces.is_empty();
                let mut piece = piece.clone();
                let mut dropped = 0;
                if let Piece::Indexed {
                    blocks: BlockList::Listed(list),
                    ..
                } = &mut piece
                {
                    let prefix = &self.list_starts[i];
                    let lo = within.saturating_sub(start);
                    let hi = within_end - start;
                    let first = prefix.partition_point(|&p| p <= lo).saturating_sub(1);
                    let past = prefix.partition_point(|&p| p < hi).min(list.len());
                    dropped = prefix[first];
                    *list = list[first..past].to_vec();
                }
                if first_piece {
                    skip = within.saturating_sub(start) - dropped;
                }
                shift(&mut piece, origin);
                pieces.push(piece);
            }
            pattern.pieces = pieces;
            pattern.repeat = 1;
            pattern.extent = 0;
            pattern.skip = skip;
        } else {
            // Several repetitions: the period moved to the first one the
            // part touches, so that the skip stays inside one period (the
            // stream may be longer than 2^64 bytes, the skip may not).
            let origin = i128::from(self.pattern.extent) * first_rep as i128;
            for piece in &mut pattern.pieces {
                shift(piece, origin);
            }
            pattern.repeat = self.pattern.repeat - first_rep as u64;
            pattern.skip = (absolute - first_rep * period) as u64;
        }
        pattern
    }
}

/// Moves a piece by `by` bytes (the origin of a repetition of a checked
/// pattern): a strided piece's offset is its first block, inside the
/// hull, so the sum fits; a listed piece's origin may not fit once moved,
/// and then moves into its blocks (each block with bytes lies inside the
/// hull).
fn shift(piece: &mut Piece, by: i128) {
    match piece {
        Piece::Strided { offset, .. } => *offset = (i128::from(*offset) + by) as i64,
        Piece::Indexed { offset, blocks } => {
            let moved = i128::from(*offset) + by;
            if let Ok(fits) = i64::try_from(moved) {
                *offset = fits;
            } else if let BlockList::Listed(list) = blocks {
                for block in list {
                    block.offset = if block.len == 0 {
                        0
                    } else {
                        (moved + i128::from(block.offset)) as i64
                    };
                }
                *offset = 0;
            }
        }
    }
}

/// One contiguous run of a walk: `len` bytes at `offset` from the base.
pub type Segment = Block;

/// A walk over a transfer's blocks ([`Plan::segments`]).
#[derive(Clone, Debug)]
pub struct Segments<'a, 'p> {
    plan: &'a Plan<'p>,
    left: u64,
    repetition: u64,
    piece: usize,
    /// Strided: loop indices, innermost first; listed: `index[0]` is the
    /// block.
    index: [u64; MAX_DIMS],
    /// Bytes already taken of the current block.
    into: u64,
    /// Strided: the current block's offset from the repetition's origin,
    /// once known (kept up to date by adding strides, so that a walk does
    /// not multiply per block).
    at: Option<i128>,
}

impl Segments<'_, '_> {
    /// Places the walk at stream byte `at` (inside the stream).
    fn seek(&mut self, at: u128) {
        let plan = self.plan;
        let period = u128::from(plan.period);
        self.repetition = (at / period) as u64;
        let within = (at % period) as u64;
        // The last piece starting at or before `within` that is not empty.
        self.piece = plan.starts.partition_point(|&s| s <= within) - 1;
        while plan.starts[self.piece + 1] == plan.starts[self.piece] {
            self.piece += 1;
        }
        let mut rest = within - plan.starts[self.piece];
        match &plan.pattern.pieces[self.piece] {
            Piece::Strided { block, dims, .. } => {
                let mut element = rest / block;
                self.into = rest % block;
                for (i, dim) in dims.iter().enumerate() {
                    self.index[i] = element % dim.count;
                    element /= dim.count;
                }
            }
            Piece::Indexed { .. } => {
                let prefix = &plan.list_starts[self.piece];
                let mut block = prefix.partition_point(|&p| p <= rest) - 1;
                // Skip empty blocks at that point.
                while prefix[block + 1] == prefix[block] {
                    block += 1;
                }
                rest -= prefix[block];
                self.index = [block as u64, 0, 0];
                self.into = rest;
            }
        }
    }

    /// Moves to the next piece (and repetition) with at least one byte.
    fn next_piece(&mut self) {
        let plan = self.plan;
        loop {
            self.piece += 1;
            if self.piece == plan.pattern.pieces.len() {
                self.piece = 0;
                self.repetition += 1;
            }
            if plan.starts[self.piece + 1] > plan.starts[self.piece] {
                break;
            }
        }
        self.index = [0; MAX_DIMS];
        self.into = 0;
        self.at = None;
    }
}

impl Iterator for Segments<'_, '_> {
    type Item = Segment;

    // Inlined into the device's copy loop, where a call per element of a
    // column of doubles would cost as much as the element.
    #[inline(always)]
    fn next(&mut self) -> Option<Segment> {
        if self.left == 0 {
            return None;
        }
        let plan = self.plan;
        let origin = i128::from(plan.pattern.extent) * i128::from(self.repetition);
        let (offset, block_len, finished_piece) = match &plan.pattern.pieces[self.piece] {
            Piece::Strided {
                offset,
                block,
                dims,
            } => {
                let at = self.at.unwrap_or_else(|| {
                    let mut at = i128::from(*offset);
                    for (dim, index) in dims.iter().zip(self.index) {
                        at += i128::from(dim.stride) * i128::from(index);
                    }
                    at
                });
                let mut finished = true;
                let mut next = at;
                for (dim, index) in dims.iter().zip(self.index.iter_mut()) {
                    *index += 1;
                    if *index < dim.count {
                        next += i128::from(dim.stride);
                        finished = false;
                        break;
                    }
                    next -= i128::from(dim.stride) * i128::from(dim.count - 1);
                    *index = 0;
                }
                self.at = (!finished).then_some(next);
                (at, *block, finished)
            }
            Piece::Indexed { offset, blocks } => {
                let BlockList::Listed(list) = blocks else {
                    unreachable!("a plan holds only listed blocks")
                };
                let mut i = self.index[0] as usize;
                while list[i].len == 0 {
                    i += 1;
                }
                let block = list[i];
                let mut next = i + 1;
                while next < list.len() && list[next].len == 0 {
                    next += 1;
                }
                self.index[0] = next as u64;
                (
                    i128::from(*offset) + i128::from(block.offset),
                    block.len,
                    next == list.len(),
                )
            }
        };
        let take = (block_len - self.into).min(self.left);
        let segment = Segment {
            offset: (origin + offset + i128::from(self.into)) as i64,
            len: take,
        };
        self.left -= take;
        if self.left > 0 {
            // Only the last segment ends inside a block.
            self.into = 0;
            if finished_piece {
                self.next_piece();
            }
        }
        Some(segment)
    }
}

/// The bytes of `pieces`' period.
fn period_bytes(pieces: &[Piece]) -> Result<u64, PatternError> {
    pieces.iter().try_fold(0u64, |sum, piece| {
        let (bytes, _, _) = piece_facts(piece)?;
        sum.checked_add(bytes)
            .ok_or(PatternError::Overflow("period bytes"))
    })
}

/// The descriptor of a vector transfer: `local` then `remote`.
pub fn encode_pair(local: &Pattern, remote: &Pattern) -> Vec<u8> {
    let mut out = Vec::with_capacity(local.encoded_len() + remote.encoded_len());
    local.encode_into(&mut out);
    remote.encode_into(&mut out);
    out
}

/// Decodes a vector transfer's descriptor: its local and its remote
/// pattern, and nothing after them.
pub fn decode_pair(bytes: &[u8]) -> Result<(Pattern, Pattern), PatternError> {
    let (local, used) = Pattern::decode(bytes, 0)?;
    let (remote, more) = Pattern::decode(&bytes[used..], used)?;
    let trailing = bytes.len() - used - more;
    if trailing > 0 {
        return Err(PatternError::TrailingBytes(trailing));
    }
    Ok((local, remote))
}

fn encode_block(block: &Block, out: &mut Vec<u8>) {
    out.extend_from_slice(&block.offset.to_le_bytes());
    out.extend_from_slice(&block.len.to_le_bytes());
}

fn decode_blocks(bytes: &[u8]) -> Vec<Block> {
    bytes
        .chunks_exact(BLOCK_BYTES)
        .map(|raw| Block {
            offset: le_u64(raw, 0) as i64,
            len: le_u64(raw, 8),
        })
        .collect()
}

/// Encodes blocks as a list in memory holds them.
pub fn encode_blocks(blocks: &[Block]) -> Vec<u8> {
    let mut out = Vec::with_capacity(blocks.len() * BLOCK_BYTES);
    for block in blocks {
        encode_block(block, &mut out);
    }
    out
}

struct Reader<'b> {
    bytes: &'b [u8],
    at: usize,
    base: usize,
}

impl<'b> Reader<'b> {
    fn take(&mut self, needed: usize) -> Result<&'b [u8], PatternError> {
        let have = self.bytes.len() - self.at;
        if needed > have {
            return Err(PatternError::Truncated {
                at: self.base + self.at,
                needed,
                have,
            });
        }
        let taken = &self.bytes[self.at..self.at + needed];
        self.at += needed;
        Ok(taken)
    }

    /// Checks that `range` of `field` (which was just taken) is zero.
    fn zero(&self, field: &[u8], range: std::ops::Range<usize>) -> Result<(), PatternError> {
        let field_start = self.base + self.at - field.len();
        match field[range.clone()].iter().position(|&b| b != 0) {
            Some(i) => Err(PatternError::ReservedNotZero {
                at: field_start + range.start + i,
            }),
            None => Ok(()),
        }
    }
}

fn le_u32(bytes: &[u8], offset: usize) -> u32 {
    crate::error::le_u32(bytes, offset)
}

fn le_u64(bytes: &[u8], offset: usize) -> u64 {
    crate::error::le_u64(bytes, offset)
}

#[cfg(test)]
mod tests;
