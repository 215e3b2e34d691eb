//! Commit (flatten and normalize once) and compile to device patterns.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use pindown_uapi::pattern::{Block, BlockList, Dim, Pattern, Piece, BLOCK_BYTES, MAX_DIMS};

use super::ir::{Flattener, Ir};
use super::types::Datatype;
use super::DatatypeError;

/// Blocks listed one by one and pieces a compiled pattern may hold, at
/// most, all pieces together (each listed block and each other piece
/// counts one): a type more irregular than this is refused rather than
/// compiled to a descriptor of many megabytes.
pub const MAX_LISTED_BLOCKS: u64 = 1 << 20;

/// What a pattern being compiled may still hold (see
/// [`MAX_LISTED_BLOCKS`]), in listed blocks and pieces.
#[derive(Clone, Copy)]
struct Room(u128);

impl Room {
    fn new() -> Room {
        Room(u128::from(MAX_LISTED_BLOCKS))
    }

    /// Takes `units`, or refuses the type when they do not fit.
    fn take(&mut self, units: u128) -> Result<(), DatatypeError> {
        if units > self.0 {
            return Err(DatatypeError::TooIrregular {
                blocks: (u128::from(MAX_LISTED_BLOCKS) - self.0).saturating_add(units),
            });
        }
        self.0 -= units;
        Ok(())
    }
}

/// Bytes of a listed piece's header and of a listed block, from the ABI's
/// layout.
const LISTED_COST: u128 = pindown_uapi::pattern::LISTED_HEADER_BYTES as u128;
const BLOCK_COST: u128 = BLOCK_BYTES as u128;

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// A committed datatype: flattened and normalized once, shared by
/// reference count, ready to compile to a [`Pattern`] for any count.
/// Clones share the same commit (and the same [`Committed::id`]).
#[derive(Clone, Debug)]
pub struct Committed(Arc<CommittedInner>);

#[derive(Debug)]
struct CommittedInner {
    id: u64,
    datatype: Datatype,
    items: Vec<Ir>,
}

impl Datatype {
    /// Flattens and normalizes the type (`MPI_Type_commit`).
    pub fn commit(&self) -> Result<Committed, DatatypeError> {
        let items = Flattener { normalize: true }.flatten(self)?;
        Ok(Committed(Arc::new(CommittedInner {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            datatype: self.clone(),
            items,
        })))
    }
}

impl Committed {
    /// An identity unique in the process, the same for all clones: the
    /// descriptor cache's key.
    pub fn id(&self) -> u64 {
        self.0.id
    }

    /// The type committed.
    pub fn datatype(&self) -> &Datatype {
        &self.0.datatype
    }

    pub(crate) fn items(&self) -> &[Ir] {
        &self.0.items
    }

    /// The pattern of `count` elements from the base (the base is the
    /// buffer address MPI would be given): the bytes in MPI's pack order.
    /// When the elements cannot fold into the pieces' loops, the
    /// pattern's repeat and extent carry the count.
    pub fn pattern(&self, count: u64) -> Result<Pattern, DatatypeError> {
        let datatype = &self.0.datatype;
        // Every offset of `count` elements must fit the ABI's 64 bits.
        if count > 0 && datatype.size() > 0 {
            let reach = i128::from(datatype.extent()) * i128::from(count - 1);
            let low = i128::from(datatype.true_lb()) + reach.min(0);
            let high = i128::from(datatype.true_lb() + datatype.true_extent()) + reach.max(0);
            if low < i128::from(i64::MIN) || high > i128::from(i64::MAX) {
                return Err(DatatypeError::Overflow("offsets of the elements"));
            }
            datatype
                .size()
                .checked_mul(count)
                .ok_or(DatatypeError::Overflow("bytes of the elements"))?;
        }
        compile(
            &Flattener { normalize: true },
            self.items(),
            count,
            datatype.extent(),
        )
    }
}

/// The pattern of `count` copies of `items`, `extent` apart.
pub(crate) fn compile(
    flattener: &Flattener,
    items: &[Ir],
    count: u64,
    extent: i64,
) -> Result<Pattern, DatatypeError> {
    let all = flattener.repeat(count, extent, items.to_vec());
    let (pieces, repeat, extent) = match all.as_slice() {
        [Ir::Rep {
            count,
            stride,
            body,
        }] if strided(&all[0]).is_none_or(|(_, _, dims)| dims.len() > MAX_DIMS) => {
            (emit(body, &mut Room::new())?, *count, *stride)
        }
        _ => (emit(&all, &mut Room::new())?, 1, 0),
    };
    Ok(Pattern::new(pieces, repeat, extent)?)
}

/// A chain of one-item loops around a block: its offset, block and loops
/// (innermost first, any number).
fn strided(item: &Ir) -> Option<(i64, u64, Vec<Dim>)> {
    match item {
        Ir::Block { offset, len } => Some((*offset, *len, Vec::new())),
        Ir::Rep {
            count,
            stride,
            body,
        } => match body.as_slice() {
            [only] => {
                let (offset, block, mut dims) = strided(only)?;
                dims.push(Dim {
                    count: *count,
                    stride: *stride,
                });
                Some((offset, block, dims))
            }
            _ => None,
        },
    }
}

/// Encoded bytes of `pieces`.
fn cost(pieces: &[Piece]) -> u128 {
    pieces.iter().map(|piece| piece.encoded_len() as u128).sum()
}

/// Pieces naming the bytes of `items` in order, taken from `room`.
fn emit(items: &[Ir], room: &mut Room) -> Result<Vec<Piece>, DatatypeError> {
    let mut pieces = Vec::new();
    for item in items {
        emit_item(item, &mut pieces, room)?;
    }
    Ok(gather_lists(pieces))
}

/// Listed blocks and other pieces in `pieces` (what they take of a
/// [`Room`]).
fn units(pieces: &[Piece]) -> u128 {
    pieces
        .iter()
        .map(|piece| piece.listed().map_or(1, |list| list.len() as u128))
        .sum()
}

fn emit_item(item: &Ir, pieces: &mut Vec<Piece>, room: &mut Room) -> Result<(), DatatypeError> {
    if let Some((offset, block, dims)) = strided(item) {
        if dims.len() <= MAX_DIMS {
            room.take(1)?;
            let mut loops = [Dim::ONE; MAX_DIMS];
            loops[..dims.len()].copy_from_slice(&dims);
            pieces.push(Piece::Strided {
                offset,
                block,
                dims: loops,
            });
            return Ok(());
        }
    }
    let Ir::Rep {
        count,
        stride,
        body,
    } = item
    else {
        unreachable!("a block is always strided");
    };
    // Too irregular for loops: unroll the outer loop (each iteration its
    // own pieces) or list every block, whichever encodes smaller. One
    // iteration is compiled in room of its own, taken from `room` once the
    // choice is made.
    let once = emit(body, &mut room.clone())?;
    let unrolled = cost(&once).saturating_mul(u128::from(*count));
    let blocks = item.blocks();
    let listed = LISTED_COST.saturating_add(BLOCK_COST.saturating_mul(blocks));
    if listed <= unrolled {
        room.take(blocks)?;
        let mut list = Vec::with_capacity(blocks as usize);
        item.each_block(0, &mut |offset, len| push_block(&mut list, offset, len));
        pieces.push(Piece::Indexed {
            offset: 0,
            blocks: BlockList::Listed(list),
        });
    } else {
        room.take(units(&once).saturating_mul(u128::from(*count)))?;
        for i in 0..*count {
            let by = stride * i as i64;
            for piece in &once {
                let mut piece = piece.clone();
                match &mut piece {
                    Piece::Strided { offset, .. } | Piece::Indexed { offset, .. } => *offset += by,
                }
                pieces.push(piece);
            }
        }
    }
    Ok(())
}

/// Appends a block, merging it into the last when they are adjacent.
fn push_block(list: &mut Vec<Block>, offset: i64, len: u64) {
    if let Some(last) = list.last_mut() {
        if i128::from(last.offset) + i128::from(last.len) == i128::from(offset) {
            last.len += len;
            return;
        }
    }
    list.push(Block { offset, len });
}

/// The blocks of a piece that is a contiguous run or a list, from the
/// repetition's origin; `None` for a piece with loops.
fn as_list(piece: &Piece) -> Option<Vec<Block>> {
    match piece {
        Piece::Strided {
            offset,
            block,
            dims,
        } if dims.iter().all(|dim| dim.count == 1) => Some(vec![Block {
            offset: *offset,
            len: *block,
        }]),
        Piece::Indexed {
            offset,
            blocks: BlockList::Listed(list),
        } => Some(
            list.iter()
                .map(|block| Block {
                    offset: offset + block.offset,
                    len: block.len,
                })
                .collect(),
        ),
        _ => None,
    }
}

/// Runs of two or more contiguous or listed pieces become one listed
/// piece (16 bytes a block instead of a 72-byte piece each).
fn gather_lists(pieces: Vec<Piece>) -> Vec<Piece> {
    let mut out: Vec<Piece> = Vec::with_capacity(pieces.len());
    let mut run: Vec<Piece> = Vec::new();
    let flush = |run: &mut Vec<Piece>, out: &mut Vec<Piece>| {
        if run.len() < 2 {
            out.append(run);
            return;
        }
        let mut list = Vec::new();
        for piece in run.iter() {
            for block in as_list(piece).unwrap_or_default() {
                push_block(&mut list, block.offset, block.len);
            }
        }
        let origin = list.first().map_or(0, |block| block.offset);
        // Offsets from the first block; blocks more than 2^63 bytes apart
        // stay in their own pieces.
        let relative: Option<Vec<Block>> = list
            .iter()
            .map(|block| {
                Some(Block {
                    offset: block.offset.checked_sub(origin)?,
                    len: block.len,
                })
            })
            .collect();
        match relative {
            Some(list) => {
                out.push(if let [only] = list.as_slice() {
                    Piece::contiguous(origin, only.len)
                } else {
                    Piece::Indexed {
                        offset: origin,
                        blocks: BlockList::Listed(list),
                    }
                });
                run.clear();
            }
            None => out.append(run),
        }
    };
    for piece in pieces {
        if as_list(&piece).is_some() {
            run.push(piece);
        } else {
            flush(&mut run, &mut out);
            out.push(piece);
        }
    }
    flush(&mut run, &mut out);
    out
}
