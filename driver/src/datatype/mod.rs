//! MPI derived datatypes compiled to the device's access patterns.
//!
//! A [`Datatype`] is built as MPI builds one (primitive types, contiguous,
//! vector, hvector, indexed, hindexed, indexed and hindexed blocks,
//! struct, subarray in C or Fortran order, resized), nested up to
//! [`MAX_DEPTH`] constructors deep.
//! It has MPI's typemap facts: size, lower bound, extent, true lower bound
//! and true extent; bounds set by [`Datatype::resized`] or
//! [`Datatype::subarray`] are markers that outrank the natural bounds of
//! whatever contains them. Structs get no alignment padding: resize a C
//! struct to its `size_of`. The byte stream of `count` elements is MPI's
//! pack order (the typemap's order).
//!
//! ## Representation and normalization
//!
//! Committing ([`Datatype::commit`], `MPI_Type_commit`) flattens the tree
//! once into a list of contiguous blocks and loops (a loop repeats a list
//! `count` times `stride` bytes apart) and normalizes it: contiguous runs
//! merge, a vector whose stride equals its block becomes a block, nested
//! loops whose strides line up fold into one, runs of equal items at a
//! constant distance (an index list with a constant stride) become a loop.
//! [`Committed::pattern`] then compiles `count` elements into a
//! [`Pattern`](pindown_uapi::pattern::Pattern): each chain of at most
//! three loops around a block is one strided piece (a matrix column is
//! one piece, a subarray of a 3-D array one piece of two or three loops),
//! the count goes into the pattern's repeat and extent when it does not
//! fold into a loop, and what is too irregular for loops is unrolled or
//! listed block by block, whichever encodes smaller (DIMMnet-2 compiles
//! types to parameter lists the same way at commit).
//!
//! [`dual_contiguous_unit`] gives the largest unit in which a transfer
//! between two types is contiguous on both sides (GASNet-EX VIS), and
//! [`DescriptorCache`] keeps compiled patterns by `(type, count)` with
//! LRU, LFU, FIFO or first-come replacement and counters that add up.
//!
//! ```
//! use pindown_driver::datatype::{Datatype, Order};
//! use pindown_uapi::pattern::Piece;
//!
//! // A column of a 4096 x 4097 matrix of doubles.
//! let column = Datatype::vector(4096, 1, 4097, &Datatype::f64())?.commit()?;
//! let pattern = column.pattern(1)?;
//! assert_eq!(pattern.len, 4096 * 8);
//! assert!(matches!(pattern.pieces.as_slice(), [Piece::Strided { block: 8, .. }]));
//!
//! // A 4 x 5 x 6 block of a 10 x 10 x 10 array of ints.
//! let block = Datatype::subarray(&[10, 10, 10], &[4, 5, 6], &[1, 2, 3], Order::C, &Datatype::i32())?;
//! assert_eq!(block.commit()?.pattern(1)?.pieces.len(), 1);
//! # Ok::<(), pindown_driver::datatype::DatatypeError>(())
//! ```

mod cache;
mod compile;
mod ir;
mod types;
mod unit;

#[cfg(test)]
mod tests;

use thiserror::Error;

pub use cache::{CacheConfig, CacheStats, Descriptor, DescriptorCache, Lookup, Policy};
pub use compile::{Committed, MAX_LISTED_BLOCKS};
pub use ir::MAX_FLATTENED_ITEMS;
pub use types::{Constructor, Datatype, Field, Order, MAX_DEPTH};
pub use unit::{dual_contiguous_unit, dual_unit, DualUnit};

/// Why a datatype could not be built or compiled.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum DatatypeError {
    /// Sizes, bounds or offsets do not fit 64 bits.
    #[error("datatype arithmetic overflows: {0}")]
    Overflow(&'static str),
    /// A constructor's arguments are inconsistent.
    #[error("invalid datatype: {0}")]
    Invalid(&'static str),
    /// Compiling would list more blocks than [`MAX_LISTED_BLOCKS`].
    #[error("datatype too irregular: {blocks} blocks to list")]
    TooIrregular {
        /// Blocks it would list.
        blocks: u128,
    },
    /// Flattening would make more than [`MAX_FLATTENED_ITEMS`] items (a
    /// type that uses shared subtrees many times over).
    #[error("datatype too complex: flattening it makes more than {limit} items")]
    TooComplex {
        /// The limit.
        limit: u64,
    },
    /// Nested deeper than [`MAX_DEPTH`] constructors.
    #[error("datatype nested too deep: {depth} constructors, at most {limit}")]
    TooDeep {
        /// Its depth.
        depth: u32,
        /// The limit.
        limit: u32,
    },
    /// The two sides of a transfer cover different numbers of bytes.
    #[error("source covers {sent} bytes, target {received}")]
    Mismatch {
        /// Bytes of the source.
        sent: u64,
        /// Bytes of the target.
        received: u64,
    },
    /// The pattern was refused by the ABI's checks.
    #[error(transparent)]
    Pattern(#[from] pindown_uapi::pattern::PatternError),
}
