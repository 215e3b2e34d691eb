//! Collectives: barrier, broadcast, reduce and allreduce on any
//! communicator, any number of ranks, any root, as FMPL builds them.
//!
//! * **Flag words.** Barriers and small reductions do not go through
//!   matched messages (a receive's match record, then the send: two
//!   remote writes per hop). Each rank's control memory holds, per
//!   context and per peer, flag words that only that peer can write (in
//!   its block, [`crate::layout::Layout::barrier_word`] and the rest),
//!   set with one 8-byte inline write carrying a per-communicator epoch
//!   that only grows; the waiting rank sees the epoch reach its own, and refuses
//!   (naming the peer) an epoch more than one call ahead, which no
//!   member writes (it needs this rank's word of the next call to go
//!   further). A small
//!   reduction writes its data first, then (fenced) the step's epoch
//!   word. Its data areas alternate by epoch parity: a peer can be at
//!   most one reduction ahead (it needs this rank's data of the next one
//!   to go further), so it never overwrites data not yet read.
//! * **Messages.** Larger data moves zero copy through point-to-point
//!   messages on the communicator's collective context (its context + 1,
//!   slot indices 0 and 1): every rank calls the collectives in the same
//!   order, and per-slot generations keep them matching in order.
//!
//! The algorithms ([`BarrierAlgorithm`], [`BroadcastAlgorithm`],
//! [`ReduceAlgorithm`]): FMPL's binary trees, a dissemination barrier,
//! a binomial-tree broadcast, FMPL's pipelined broadcast (the message
//! cut into chunks that flow down a binary tree through two alternating
//! receive slots, so that receiving chunk `j + 1` overlaps forwarding
//! chunk `j`), recursive doubling, and reduce-scatter then allgather
//! (Rabenseifner's). `Auto` chooses by size and rank count as
//! [`BroadcastAlgorithm::Auto`] and
//! [`ReduceAlgorithm::Auto`] say (thresholds measured on a 2-core
//! machine, as FMPL chose between its two broadcasts).
//!
//! Every member must call a collective with the same root, the same
//! length and the same algorithm, in the same order. **Call records**
//! make a disagreement an error instead of a wait without end: each
//! collective call on a communicator (splits and dups included) gets a
//! number, and its record (number, kind, algorithm as chosen, element
//! type, root, bytes; [`layout::CallRecord`]) goes into this rank's
//! control memory, where every member may read it. A member that waits
//! on a peer reads the peer's record of the same call with each liveness
//! check ([`crate::Config::liveness_interval`]); a record that differs
//! fails the call with [`Error::Mismatch`] naming both calls, one the
//! peer gave up fails it with [`Error::MemberFailed`]. So a mismatch
//! that leaves ranks waiting on each other (lengths on both sides of an
//! `Auto` threshold, different roots, algorithms or kinds) fails on each
//! of them within a few liveness intervals, and a rank that gave up its
//! call (or an earlier one), or refused its arguments, releases the
//! members that wait on it. A failed call withdraws its receives still
//! posted, so nothing lands in the caller's buffers after it returns;
//! a member whose write into such a receive is refused reads the
//! members' records and fails with [`Error::MemberFailed`] naming the
//! one that gave up, rather than with the device's refusal.
//! Sends and receives of a call carry a tag of its number in the match
//! record ([`layout::call_tag`]): a send that meets a receive of another
//! call moves nothing and fails, so a send left over from a mismatched
//! call never lands in a later one. Mismatched calls that happen to
//! complete (a reduce's send taken by a broadcast's receive of the same
//! length, in the same call; reductions by different operations) are
//! not seen by default: records are only read while a rank waits.
//! [`crate::Config::verify_collectives`] reads every member's record of
//! each call once it completes ([`verify_call`]) and fails those. Calls
//! on two communicators made in different orders are not seen. A call
//! that fails once it has begun leaves the members' epochs and slots in
//! unknown states, so later collective calls on the communicator fail
//! at once with [`Error::CommunicatorBroken`] (publishing nothing: the
//! record of the call given up stays, kept apart from the two latest,
//! so that members waiting in it or a later call learn it however often
//! this rank calls again), and its contexts
//! are not used again; arguments refused before a call begins (a buffer
//! of the wrong length, a root out of range, data too long for the
//! algorithm named) number the call and record it as refused, and break
//! nothing when every member refuses them. The refusing rank's next call
//! waits until each member refused that call too or has begun a later
//! one ([`confirm_refusals`]): a member that took part in it would meet
//! that call's flag words and sends as its own.

use std::cmp::Ordering;
use std::collections::VecDeque;
use std::ops::Range;
use std::time::{Duration, Instant};

use crate::comm::Communicator;
use crate::engine::{Engine, SendBytes};
use crate::error::{Error, Result};
use crate::layout::{self, CallRecord, CALL_RECORD_BYTES, COLLECTIVE_DATA_BYTES, KEPT_CALL_RECORD};
use pindown_uapi::Status;

// ---- the default choice ----
//
// Measured with `msg_check launch N collectives --time --iterations 300`
// on a 2-core machine (Intel Xeon, event-driven device; microseconds per
// call, the slowest rank; 4 and 8 ranks oversubscribe the cores):
//
// | call                 | 2 ranks                     | 4 ranks                     | 8 ranks                     |
// |----------------------|-----------------------------|-----------------------------|-----------------------------|
// | barrier              | dissemination 2.1, tree 3.3 | dissemination 9.9, tree 16  | dissemination 37, tree 69   |
// | allreduce 8 B        | flags 2.7, r.d. 15, tree 19 | flags 11, r.d. 60, tree 60  | flags 46, r.d. 235, tree 242|
// | allreduce 4 KiB      | r.d. 16, tree 20            | r.d. 65, tree 65            | r.d. 179, tree 176          |
// | allreduce 64 KiB     | r.d. 33, tree 41, r.s. 50   | r.d. 131, tree 139, r.s. 206| r.d. 471, tree 384, r.s. 674|
// | allreduce 256 KiB    | r.d. 63, tree 71, r.s. 76   | r.d. 345, tree 215, r.s. 320| r.d. 1255, tree 723, r.s. 961|
// | allreduce 1 MiB      | r.d. 362, tree 339, r.s. 291| r.d. 1453, tree 1079, r.s. 942| r.d. 4049, tree 2618, r.s. 2709|
// | broadcast 1 MiB      | binomial 51, pipelined 64   | binomial 217, pipelined 239 | binomial 727, pipelined 731 |
// | broadcast 4 MiB      | binomial 373, pipelined 395 | binomial 1002, pipelined 986| binomial 2424, pipelined 2828 |
//
// (r.s.: reduce-scatter and allgather; the allreduce rows from 64 KiB are
// medians of three runs with `--bytes N`, each algorithm reading its
// contribution in place and receiving into memory kept between calls.)
//
// Hence: dissemination barriers; flag words for every reduction that fits
// them; recursive doubling above, and the tree from 64 KiB on 3 ranks or
// more (recursive doubling moves p log2 p vectors in all, the tree's
// reduce and broadcast 2 (p - 1): with the cores shared, fewer bytes
// win once the vectors are long), but recursive doubling on 2 ranks (one
// exchange, both combining at once); reduce-scatter and allgather from
// 1 MiB at every rank count (ahead on 2 and 4 ranks, tied with the tree
// on 8); the binomial broadcast at every size (each chunk of the
// pipeline costs a hand-off between threads, more than the overlap gains
// here).

/// Broadcasts of at least this many bytes use the pipelined binary tree
/// by default (on 3 ranks or more): `None`, never, on the machine
/// measured (see the table in the source), where the binomial tree won
/// or tied at every size up to 4 MiB (the pipeline's best, 4 MiB on 4
/// ranks, was 2 % ahead, within the run's noise).
pub const BROADCAST_PIPELINE_MIN: Option<usize> = None;
/// Chunk of the pipelined broadcast.
pub const PIPELINE_CHUNK_BYTES: usize = 128 << 10;
/// Reductions of at most this many bytes ride the flag words by default.
pub const REDUCE_FLAG_MAX: usize = COLLECTIVE_DATA_BYTES as usize;
/// Allreduces of at least this many bytes on 3 ranks or more reduce and
/// broadcast (binary tree) by default; shorter ones beyond the flag words,
/// and those on 2 ranks, use recursive doubling (see the table in the
/// source).
pub const ALLREDUCE_TREE_MIN: usize = 64 << 10;
/// Allreduces of at least this many bytes reduce-scatter and allgather
/// by default, on any number of ranks.
pub const ALLREDUCE_HALVING_MIN: usize = 1 << 20;

/// How a barrier synchronises.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BarrierAlgorithm {
    /// The default: [`Dissemination`](Self::Dissemination) (faster than
    /// the tree on every rank count measured: 2.1 against 3.3 us on 2
    /// ranks, 9.9 against 16 on 4, 37 against 69 on 8).
    #[default]
    Auto,
    /// FMPL's software barrier: arrivals go up a binary tree of flag
    /// words to rank 0, the release comes down it (2 log2 p writes in
    /// sequence).
    BinaryTree,
    /// ceil(log2 p) rounds; in round `k` each rank sets a flag at rank
    /// `+ 2^k` and waits for the one from rank `- 2^k`.
    Dissemination,
}

/// How a broadcast moves the data.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BroadcastAlgorithm {
    /// The default: [`Pipelined`](Self::Pipelined) for messages of
    /// [`BROADCAST_PIPELINE_MIN`] bytes and more on 3 ranks or more
    /// (never, as measured), else [`BinomialTree`](Self::BinomialTree).
    #[default]
    Auto,
    /// Whole-message zero-copy sends down a binomial tree rooted at the
    /// root (ceil(log2 p) steps).
    BinomialTree,
    /// FMPL's pipelined broadcast: chunks of [`PIPELINE_CHUNK_BYTES`] down
    /// a binary tree, received through two alternating slots so that
    /// each rank forwards chunk `j` while chunk `j + 1` arrives.
    Pipelined,
}

/// How a reduction combines.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ReduceAlgorithm {
    /// The default: [`FlagWords`](Self::FlagWords) up to
    /// [`REDUCE_FLAG_MAX`] bytes; above, a reduce uses
    /// [`BinaryTree`](Self::BinaryTree), an allreduce
    /// [`RecursiveDoubling`](Self::RecursiveDoubling), but from
    /// [`ALLREDUCE_TREE_MIN`] bytes on 3 ranks or more the binary tree
    /// (reduce, then broadcast), and from [`ALLREDUCE_HALVING_MIN`] bytes
    /// [`ReduceScatterAllgather`](Self::ReduceScatterAllgather).
    #[default]
    Auto,
    /// Recursive doubling over flag words (data, then a fenced epoch
    /// word; at most [`REDUCE_FLAG_MAX`] bytes): ranks beyond the largest
    /// power of two fold into a partner first and get the result back
    /// last. A reduce runs the allreduce and the root keeps the result.
    FlagWords,
    /// FMPL's: partial results combine up a binary tree rooted at the
    /// root (zero-copy messages); an allreduce then broadcasts from it.
    BinaryTree,
    /// Recursive doubling with zero-copy messages (folding as
    /// [`FlagWords`](Self::FlagWords)).
    RecursiveDoubling,
    /// Reduce-scatter by recursive halving, then allgather by recursive
    /// doubling (Rabenseifner's; folding as
    /// [`FlagWords`](Self::FlagWords)): each member sends and receives
    /// 2 (p - 1) / p of the vector and combines only its own share, all
    /// members at once. A reduce runs the allreduce and the root keeps
    /// the result.
    ReduceScatterAllgather,
}

// ---- element types and operations ----

mod sealed {
    pub trait Sealed {
        /// The type's code in call records ([`super::element_name`]).
        const CODE: u8;
    }
}

/// The element type of a call record's code (0: bytes).
fn element_name(code: u8) -> &'static str {
    ["bytes", "f64", "f32", "i64", "i32", "u64", "u32"]
        .get(usize::from(code))
        .copied()
        .unwrap_or("an unknown type")
}

/// A type reductions work on: f64, f32, i64, i32, u64, u32 (sealed).
/// Integer sums wrap.
pub trait Element:
    sealed::Sealed + Copy + Default + PartialOrd + std::fmt::Debug + 'static
{
    /// `self + other` (wrapping for integers).
    fn sum(self, other: Self) -> Self;
    /// Compares absolute values (integers' without overflow; NaNs equal
    /// everything).
    fn magnitude_cmp(self, other: Self) -> Ordering;
    /// A total order (floats: IEEE 754 totalOrder, so -0 < +0 and NaNs
    /// have places): what makes min, max and ties commutative.
    fn total_cmp(self, other: Self) -> Ordering;
}

macro_rules! float_element {
    ($($t:ty = $code:literal),*) => {$(
        impl sealed::Sealed for $t {
            const CODE: u8 = $code;
        }
        impl Element for $t {
            fn sum(self, other: Self) -> Self {
                self + other
            }
            fn magnitude_cmp(self, other: Self) -> Ordering {
                self.abs().partial_cmp(&other.abs()).unwrap_or(Ordering::Equal)
            }
            fn total_cmp(self, other: Self) -> Ordering {
                <$t>::total_cmp(&self, &other)
            }
        }
    )*};
}
macro_rules! signed_element {
    ($($t:ty = $code:literal),*) => {$(
        impl sealed::Sealed for $t {
            const CODE: u8 = $code;
        }
        impl Element for $t {
            fn sum(self, other: Self) -> Self {
                self.wrapping_add(other)
            }
            fn magnitude_cmp(self, other: Self) -> Ordering {
                self.unsigned_abs().cmp(&other.unsigned_abs())
            }
            fn total_cmp(self, other: Self) -> Ordering {
                self.cmp(&other)
            }
        }
    )*};
}
macro_rules! unsigned_element {
    ($($t:ty = $code:literal),*) => {$(
        impl sealed::Sealed for $t {
            const CODE: u8 = $code;
        }
        impl Element for $t {
            fn sum(self, other: Self) -> Self {
                self.wrapping_add(other)
            }
            fn magnitude_cmp(self, other: Self) -> Ordering {
                self.cmp(&other)
            }
            fn total_cmp(self, other: Self) -> Ordering {
                self.cmp(&other)
            }
        }
    )*};
}
float_element!(f64 = 1, f32 = 2);
signed_element!(i64 = 3, i32 = 4);
unsigned_element!(u64 = 5, u32 = 6);

/// What a reduction computes, element by element.
///
/// Operations must be associative and commutative (algorithms combine in
/// tree or butterfly order); floating-point sums are then exact only as
/// far as reassociation keeps them.
pub enum Op<'f, T> {
    /// The sum (FMPL's `vsum`).
    Sum,
    /// The smallest value ([`Element::total_cmp`]: -0 below +0).
    Min,
    /// The largest value ([`Element::total_cmp`]).
    Max,
    /// The value of largest absolute value (FMPL's `vmax`), sign kept; of
    /// `x` and `-x`, the greater in [`Element::total_cmp`].
    MaxAbs,
    /// The value of smallest absolute value (FMPL's `vmin`), sign kept;
    /// of `x` and `-x`, the greater in [`Element::total_cmp`].
    MinAbs,
    /// A user function: combines `incoming` into `accumulated` element by
    /// element (`accumulated[i] = f(accumulated[i], incoming[i])`). The
    /// two slices are equally long: the whole vector or any part of it
    /// (reduce-scatter and allgather combine a share at a time, cut at any
    /// element), as MPI calls its user functions; the function must be
    /// associative and commutative, as the built-in ones are.
    User(&'f dyn Fn(&mut [T], &[T])),
}

impl<T> Clone for Op<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Op<'_, T> {}

impl<T> std::fmt::Debug for Op<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Op::Sum => "Sum",
            Op::Min => "Min",
            Op::Max => "Max",
            Op::MaxAbs => "MaxAbs",
            Op::MinAbs => "MinAbs",
            Op::User(_) => "User",
        })
    }
}

/// Combines `incoming` into `accumulated` with `op`.
fn combine<T: Element>(op: Op<'_, T>, accumulated: &mut [T], incoming: &[T]) {
    combine_into(op, accumulated, None, incoming);
}

/// `out[i] = op(first[i], incoming[i])` for every `i`, where `first` is
/// `out` itself when `None`: one pass over the vectors either way.
fn combine_into<T: Element>(op: Op<'_, T>, out: &mut [T], first: Option<&[T]>, incoming: &[T]) {
    debug_assert_eq!(out.len(), incoming.len());
    debug_assert!(first.is_none_or(|first| first.len() == out.len()));
    fn each<T: Element>(out: &mut [T], first: Option<&[T]>, incoming: &[T], f: impl Fn(T, T) -> T) {
        match first {
            None => out
                .iter_mut()
                .zip(incoming)
                .for_each(|(a, &b)| *a = f(*a, b)),
            Some(first) => out
                .iter_mut()
                .zip(first.iter().zip(incoming))
                .for_each(|(o, (&a, &b))| *o = f(a, b)),
        }
    }
    let by_magnitude = |wanted: Ordering| {
        move |a: T, b: T| match b.magnitude_cmp(a) {
            order if order == wanted => b,
            Ordering::Equal if b.total_cmp(a) == Ordering::Greater => b,
            _ => a,
        }
    };
    let by_value =
        |wanted: Ordering| move |a: T, b: T| if b.total_cmp(a) == wanted { b } else { a };
    match op {
        Op::Sum => each(out, first, incoming, |a, b| a.sum(b)),
        Op::Min => each(out, first, incoming, by_value(Ordering::Less)),
        Op::Max => each(out, first, incoming, by_value(Ordering::Greater)),
        Op::MaxAbs => each(out, first, incoming, by_magnitude(Ordering::Greater)),
        Op::MinAbs => each(out, first, incoming, by_magnitude(Ordering::Less)),
        Op::User(f) => {
            if let Some(first) = first {
                out.copy_from_slice(first);
            }
            f(out, incoming)
        }
    }
}

fn bytes_of<T: Element>(values: &[T]) -> &[u8] {
    // SAFETY: `Element` is sealed to primitive integers and floats: no
    // padding, every byte initialised; the view covers exactly the
    // slice's memory and borrows it.
    unsafe { std::slice::from_raw_parts(values.as_ptr().cast(), std::mem::size_of_val(values)) }
}

fn bytes_of_mut<T: Element>(values: &mut [T]) -> &mut [u8] {
    // SAFETY: as in `bytes_of`, and every bit pattern is a valid value of
    // these types, so any bytes written through the view are too.
    unsafe {
        std::slice::from_raw_parts_mut(values.as_mut_ptr().cast(), std::mem::size_of_val(values))
    }
}

// ---- per-context state ----

/// A context's collective calls so far: the epochs of its flag words.
#[derive(Clone, Debug, Default)]
pub(crate) struct Epochs {
    barrier: u64,
    flag_reduce: u64,
    /// Flag writes posted and not yet seen complete: (world peer, tag).
    writes: Vec<(u32, u64)>,
    /// Collective calls begun (the number of the latest).
    calls: u64,
    /// Why the context's collectives stopped: a call that failed once
    /// begun.
    broken: Option<String>,
    /// The latest call was refused here (members may still wait in it).
    last_refused: bool,
    /// The record of the first call of the latest run of refused calls,
    /// until the call after the run has found every member done with it.
    run_start: Option<CallRecord>,
    /// The communicator was made by a split or dup: the collective
    /// context it was made on and that exchange's call number there. A
    /// member that gave that call up has no part in this communicator.
    origin: Option<(u32, u64)>,
}

/// Records that the communicator on collective context `context` was made
/// by the split or dup whose latest call on collective context `parent`
/// just ended.
pub(crate) fn made_from(engine: &mut Engine<'_>, context: u32, parent: u32) {
    let call = engine.collective_epochs[parent as usize].calls;
    engine.collective_epochs[context as usize].origin = Some((parent, call));
}

/// The call a communicator was made by, on the context it was made on
/// (see [`made_from`]).
pub(crate) fn origin(engine: &Engine<'_>, context: u32) -> Option<(u32, u64)> {
    engine.collective_epochs[context as usize].origin
}

/// The call records among `records` (raw slots) that decode: neither
/// unwritten nor torn.
fn decoded(records: &[[u64; 3]]) -> impl Iterator<Item = CallRecord> + '_ {
    records.iter().copied().filter_map(layout::call_record_of)
}

/// What a member's records on a communicator's context and on the
/// context it was made on say when the first show no call at all: the
/// member gave up the split or dup that made it (`made_by`, its call
/// number there), so it has no part in this communicator and waits in
/// none of its calls.
pub(crate) fn check_origin(
    peer: u32,
    made_by: u64,
    records: &[[u64; 3]],
    parent_records: &[[u64; 3]],
) -> Option<Error> {
    if decoded(records).next().is_some() {
        return None;
    }
    decoded(parent_records)
        .any(|r| r.call == made_by && (r.failed || r.refused))
        .then_some(Error::NotAMember {
            rank: peer,
            call: made_by,
        })
}

// ---- call records ----

/// Which collective a call record names.
#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Kind {
    Barrier = 1,
    Broadcast = 2,
    Reduce = 3,
    Allreduce = 4,
    /// A split's gather and scatter of colours and keys
    /// ([`Communicator::exchange`]).
    SplitColors = 5,
    /// A split's or dup's gather and scatter of free contexts.
    FreeContexts = 6,
}

impl Kind {
    /// The kind of a record's code.
    fn of(code: u8) -> Option<Self> {
        [
            Self::Barrier,
            Self::Broadcast,
            Self::Reduce,
            Self::Allreduce,
            Self::SplitColors,
            Self::FreeContexts,
        ]
        .into_iter()
        .find(|kind| *kind as u8 == code)
    }
}

/// The algorithm a call record names, as chosen (never `Auto`).
#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Algorithm {
    Dissemination = 1,
    BarrierTree = 2,
    BinomialTree = 3,
    Pipelined = 4,
    FlagWords = 5,
    BinaryTree = 6,
    RecursiveDoubling = 7,
    /// Through rank 0 (an exchange).
    ThroughRankZero = 8,
    ReduceScatterAllgather = 9,
}

impl Algorithm {
    /// The algorithm of a reduction named by the caller (not `Auto`).
    fn of_reduction(named: ReduceAlgorithm) -> Self {
        match named {
            ReduceAlgorithm::Auto | ReduceAlgorithm::BinaryTree => Self::BinaryTree,
            ReduceAlgorithm::FlagWords => Self::FlagWords,
            ReduceAlgorithm::RecursiveDoubling => Self::RecursiveDoubling,
            ReduceAlgorithm::ReduceScatterAllgather => Self::ReduceScatterAllgather,
        }
    }

    /// The name of a record's algorithm code, for errors.
    fn name_of(code: u8) -> &'static str {
        [
            (Self::Dissemination, "dissemination"),
            (Self::BarrierTree, "a binary tree of flag words"),
            (Self::BinomialTree, "a binomial tree"),
            (Self::Pipelined, "the pipelined tree"),
            (Self::FlagWords, "flag words"),
            (Self::BinaryTree, "a binary tree"),
            (Self::RecursiveDoubling, "recursive doubling"),
            (Self::ThroughRankZero, "rank 0"),
            (Self::ReduceScatterAllgather, "reduce-scatter and allgather"),
        ]
        .into_iter()
        .find(|(algorithm, _)| *algorithm as u8 == code)
        .map_or("an unknown algorithm", |(_, name)| name)
    }
}

/// What a call did, in words, for errors.
fn describe(record: &CallRecord) -> String {
    let by = Algorithm::name_of(record.algorithm);
    let (bytes, element, root) = (record.bytes, element_name(record.element), record.root);
    let op = op_name(record.op);
    match Kind::of(record.kind) {
        Some(Kind::Barrier) => format!("a barrier by {by}"),
        Some(Kind::Broadcast) => format!("a broadcast of {bytes} bytes from root {root} by {by}"),
        Some(Kind::Reduce) => {
            format!("a reduce ({op}) of {bytes} bytes of {element} to root {root} by {by}")
        }
        Some(Kind::Allreduce) => {
            format!("an allreduce ({op}) of {bytes} bytes of {element} by {by}")
        }
        Some(Kind::SplitColors) => {
            format!("a split's exchange of colours, {bytes} bytes per member through {by}")
        }
        Some(Kind::FreeContexts) => format!(
            "a split's or dup's exchange of free contexts, {bytes} bytes per member through {by}"
        ),
        None => format!("an unknown collective (code {})", record.kind),
    }
}

/// A record for a call of `kind` by `algorithm` (numbered when it begins).
fn record(kind: Kind, algorithm: Algorithm, element: u8, root: u32, bytes: usize) -> CallRecord {
    CallRecord {
        call: 0,
        failed: false,
        refused: false,
        kind: kind as u8,
        algorithm: algorithm as u8,
        element,
        op: 0,
        root,
        bytes: bytes as u64,
    }
}

/// The operations as call records name them (a user function by its
/// kind only: two of them are not told apart).
const OPS: [&str; 6] = ["sum", "min", "max", "max-abs", "min-abs", "a user function"];

/// The code of `op` in a call record (0 is no operation).
fn op_code<T>(op: &Op<'_, T>) -> u8 {
    1 + match op {
        Op::Sum => 0,
        Op::Min => 1,
        Op::Max => 2,
        Op::MaxAbs => 3,
        Op::MinAbs => 4,
        Op::User(_) => 5,
    }
}

/// The name of a record's operation code, for errors.
fn op_name(code: u8) -> &'static str {
    usize::from(code)
        .checked_sub(1)
        .and_then(|i| OPS.get(i))
        .copied()
        .unwrap_or("an unknown operation")
}

/// What a split's or dup's exchange carries: a record tells them apart
/// (both may carry as many bytes per member).
#[derive(Clone, Copy)]
pub(crate) enum Exchange {
    /// Each member's colour and key (a split).
    SplitColors,
    /// Each member's table of free contexts (a split or a dup).
    FreeContexts,
}

/// The record of a split's or dup's exchange of `bytes` per member.
pub(crate) fn exchange_record(purpose: Exchange, bytes: usize) -> CallRecord {
    let kind = match purpose {
        Exchange::SplitColors => Kind::SplitColors,
        Exchange::FreeContexts => Kind::FreeContexts,
    };
    record(kind, Algorithm::ThroughRankZero, 0, 0, bytes)
}

/// What the call records `records` (slot by slot, the kept one last),
/// read from world rank `peer`, say of this rank's call `mine`: nothing
/// (the peer is not at this call yet, or it agrees), or the error that
/// ends the call: the peer refused this call (its record of it says so,
/// or the run of refused calls it is in began at or before it), gave it
/// up, or gave up an earlier one (its collectives stopped there, so it
/// takes part in no later call).
pub(crate) fn check_member(peer: u32, mine: &CallRecord, records: &[[u64; 3]]) -> Option<Error> {
    let member_failed = |call| Error::MemberFailed { rank: peer, call };
    if let Some(gave_up) = decoded(records)
        .find(|r| (r.failed && r.call <= mine.call) || (r.refused && r.call == mine.call))
    {
        return Some(member_failed(gave_up.call));
    }
    if refusing_through(records).is_some_and(|run| run.contains(&mine.call)) {
        return Some(member_failed(mine.call));
    }
    let theirs = decoded(records).find(|r| r.call == mine.call)?;
    disagreement(peer, mine, &theirs)
}

/// The error naming both calls when world rank `peer`'s record `theirs`
/// of this rank's call `mine` describes another call (whatever became
/// of either since: given up or not).
fn disagreement(peer: u32, mine: &CallRecord, theirs: &CallRecord) -> Option<Error> {
    let as_begun = |record: &CallRecord| CallRecord {
        failed: false,
        refused: false,
        ..*record
    };
    (as_begun(theirs) != as_begun(mine)).then(|| {
        Error::Mismatch(format!(
            "collective call {} on this communicator is {} on world rank {peer} but {} here",
            mine.call,
            describe(&as_begun(theirs)),
            describe(&as_begun(mine))
        ))
    })
}

/// The calls a member's records (slot by slot, the kept one last) show
/// it refused in a row up to its latest call: from its kept record (the
/// first of its latest run) to its latest record, when both are
/// refusals and the run shows whole: it is one call long, or the other
/// parity slot holds the call before the latest, refused too. Its
/// records of the calls between are overwritten, but a run has no gaps:
/// a call that was not refused ends it, and the next refusal starts a
/// new one in the kept slot (written before the parity slot, so a
/// record read while a new run starts does not join it to the old one).
fn refusing_through(records: &[[u64; 3]]) -> Option<std::ops::RangeInclusive<u64>> {
    let kept = layout::call_record_of(*records.get(KEPT_CALL_RECORD as usize)?)?;
    let parities: Vec<CallRecord> = decoded(records.get(..2)?).collect();
    let latest = parities.iter().chain([&kept]).max_by_key(|r| r.call)?;
    let whole = latest.call == kept.call
        || parities
            .iter()
            .any(|r| r.call + 1 == latest.call && r.refused);
    (kept.refused && latest.refused && kept.call <= latest.call && whole)
        .then_some(kept.call..=latest.call)
}

/// Whether world rank `peer`, by its records, is done with the call
/// `refused` that this rank refused (the latest of a run): it refused
/// that call too, or has begun a later one (so it waits in none of this
/// rank's refused calls: a flag-word call, which needs every member,
/// cannot have passed without this rank). `Ok(false)`: it has not come
/// to that call yet, or is in one of them; it learns of the refusal
/// from this rank's records. A member that gave up one of those calls,
/// or an earlier one, fails it: the members disagreed about a call.
fn refusal_passed(peer: u32, refused: u64, records: &[[u64; 3]]) -> Result<bool> {
    if let Some(gave_up) = decoded(records).find(|r| r.failed && r.call <= refused) {
        return Err(Error::MemberFailed {
            rank: peer,
            call: gave_up.call,
        });
    }
    Ok(decoded(records)
        .max_by_key(|r| r.call)
        .is_some_and(|latest| latest.call > refused || (latest.call == refused && latest.refused)))
}

/// Before this rank's first call after a run of refused ones (the
/// latest, `refused`): waits until every member is done with them
/// ([`refusal_passed`]). A member still in one of them would otherwise
/// meet this rank's next call: its flag words and sends would be taken
/// for that call's. Arguments refused on every member so cost one read
/// of each member's records; refused on some, they fail here once the
/// members that took part give the call up.
fn confirm_refusals(engine: &mut Engine<'_>, group: &Group<'_>, refused: u64) -> Result<()> {
    read_members_until(engine, group, |member, records, _| {
        refusal_passed(member, refused, records)
    })
}

/// After call `mine` completed here ([`crate::Config::verify_collectives`]):
/// waits until each member's records show that call or a later one, and
/// compares the member's record of it with this rank's, so that members
/// that disagreed about a call that completed anyway (different
/// operations, a reduce's send taken by a broadcast's receive) fail it
/// with [`Error::Mismatch`]. A member that has gone two calls further
/// (its record of this one overwritten) is not compared, nor one that
/// shows no record at all for a liveness interval: it has dropped the
/// communicator (which clears its records, after its part of every
/// call), or has yet to make its first call there.
fn verify_call(engine: &mut Engine<'_>, group: &Group<'_>, mine: &CallRecord) -> Result<()> {
    let patience = engine.config.liveness_interval;
    read_members_until(engine, group, |member, records, waited| {
        if let Some(err) = check_member(member, mine, records) {
            return Err(err);
        }
        let mut calls = decoded(records).map(|r| r.call).peekable();
        Ok(match calls.peek() {
            None => waited >= patience,
            Some(_) => calls.any(|call| call >= mine.call),
        })
    })
}

/// After a call failed with a mismatch its messages showed (a message
/// longer or shorter than this rank's receive), the members' records
/// of the call, read once each (members known gone skipped), say what
/// differed: the error naming both calls, if a member's record describes
/// another call (or the fault a liveness check found meanwhile).
fn mismatch_in_records(
    engine: &mut Engine<'_>,
    group: &Group<'_>,
    mine: &CallRecord,
) -> Option<Error> {
    // A liveness check made meanwhile may have read the records already.
    if let Some(fault) = engine
        .collective_fault
        .take()
        .filter(Error::is_member_fault)
    {
        return Some(fault);
    }
    let me = engine.rank;
    for &member in group.ranks {
        if member == me || engine.peer_gone(member) {
            continue;
        }
        let records = engine.read_call_records(member, group.context);
        if let Some(fault) = engine
            .collective_fault
            .take()
            .filter(Error::is_member_fault)
        {
            return Some(fault);
        }
        let Ok(records) = records else {
            continue;
        };
        let theirs = decoded(&records).find(|r| r.call == mine.call);
        if let Some(named) = theirs.and_then(|theirs| disagreement(member, mine, &theirs)) {
            return Some(named);
        }
    }
    None
}

/// The longest pause between two reads of a member's records that
/// [`read_members_until`] waits for: a member usually comes within
/// microseconds, and a read costs about as much as a message.
const MEMBER_READ_PAUSE_MAX: Duration = Duration::from_millis(1);

/// Reads each other member's call records, again and again (backing off
/// up to [`MEMBER_READ_PAUSE_MAX`], the member checked meanwhile), until
/// `done` (given the member, its records and how long this rank has
/// waited for it) says so for that member or fails. A member that gave up the
/// split or dup that made the communicator fails it with
/// [`Error::NotAMember`] ([`check_origin`]).
fn read_members_until(
    engine: &mut Engine<'_>,
    group: &Group<'_>,
    mut done: impl FnMut(u32, &[[u64; 3]], Duration) -> Result<bool>,
) -> Result<()> {
    let me = engine.rank;
    for &member in group.ranks.iter().filter(|&&m| m != me) {
        let mut pause = Duration::from_micros(20);
        let started = Instant::now();
        loop {
            let records = engine.read_call_records(member, group.context)?;
            let joined = decoded(&records).next().is_some();
            if let Some((parent, made_by)) = origin(engine, group.context).filter(|_| !joined) {
                let parent_records = engine.read_call_records(member, parent)?;
                if let Some(err) = check_origin(member, made_by, &records, &parent_records) {
                    return Err(err);
                }
            }
            if done(member, &records, started.elapsed())? {
                break;
            }
            let until = Instant::now() + pause;
            engine.wait_until(Some(member), Some(until), |_| Ok(false))?;
            pause = (pause * 2).min(MEMBER_READ_PAUSE_MAX);
        }
    }
    Ok(())
}

/// Writes this rank's record of a call where each other member reads
/// it (its section of the context in this rank's memory), the first
/// word last: in the slot of the call's parity and, with `keep`, in the
/// kept slot too, which later calls leave alone (a member still waiting
/// in that call learns it however many calls this rank makes
/// meanwhile).
fn publish(engine: &Engine<'_>, group: &Group<'_>, record: &CallRecord, keep: bool) {
    publish_to(engine, group.context, group.ranks, record, keep);
}

/// [`publish`] on collective context `context` to the members `ranks`.
fn publish_to(engine: &Engine<'_>, context: u32, ranks: &[u32], record: &CallRecord, keep: bool) {
    // The kept slot first: a member that reads this call's parity slot
    // (the kept one lies after both) reads the kept slot as new at least.
    let slots = keep.then_some(KEPT_CALL_RECORD);
    let slots: Vec<u64> = slots.into_iter().chain([record.call % 2]).collect();
    publish_in(engine, context, ranks, record, &slots);
}

/// Writes `record` into call record `slots` (in that order) of each
/// member of `ranks` but this rank, on collective context `context`.
fn publish_in(
    engine: &Engine<'_>,
    context: u32,
    ranks: &[u32],
    record: &CallRecord,
    slots: &[u64],
) {
    let words = layout::call_record_words(record);
    for &member in ranks.iter().filter(|&&m| m != engine.rank) {
        let records = engine.layout.call_records(context, member);
        for &slot in slots {
            let at = records + slot * CALL_RECORD_BYTES;
            engine.store(at + 8, words[1]);
            engine.store(at + 16, words[2]);
            engine.store(at, words[0]);
        }
    }
}

/// Publishes the current collective call as given up (its end does
/// again): before a receive of the call is withdrawn, so that a member
/// whose write into it is refused finds the reason in this rank's
/// record.
pub(crate) fn publish_given_up(engine: &Engine<'_>) {
    if let Some((context, record)) = engine.collective_call {
        let failed = CallRecord {
            failed: true,
            ..record
        };
        publish_to(engine, context, &engine.collective_members, &failed, true);
    }
}

/// Begins this rank's next collective call on the group's context:
/// numbers and publishes its record, and makes it the call that liveness
/// checks compare. A context whose collectives stopped fails the call
/// and publishes nothing: the record of the call given up stays where
/// members read it, and tells those waiting in this call or any later
/// one. `arguments` refused publish the call as refused (the members
/// waiting in it fail) and fail it; the first of a run of refused calls
/// is kept (a program that retries a refused call makes more of them
/// while members wait in the first). The first call after such a run
/// waits until every member is done with its calls
/// ([`confirm_refusals`]); one that is not (it took part and gave up)
/// fails the call and stops the context's collectives.
fn begin_call(
    engine: &mut Engine<'_>,
    group: &Group<'_>,
    mut record: CallRecord,
    arguments: Result<()>,
) -> Result<CallRecord> {
    let state = &mut engine.collective_epochs[group.context as usize];
    state.calls += 1;
    record.call = state.calls;
    if let Some(why) = &state.broken {
        return Err(Error::CommunicatorBroken(why.clone()));
    }
    record.refused = arguments.is_err();
    let keep = record.refused && !state.last_refused;
    if keep {
        state.run_start = Some(record);
    }
    let after_refusals = (state.last_refused && !record.refused).then_some(record.call - 1);
    state.last_refused = record.refused;
    if let Some(refused) = after_refusals {
        // This call's record goes out once the members are done with
        // the refused ones: until then, the latest record tells a member
        // still in one of them that this rank refused it.
        let confirmed = confirm_refusals(engine, group, refused);
        let state = &mut engine.collective_epochs[group.context as usize];
        let run_start = state.run_start.take();
        if let Err(err) = confirmed {
            end_call(engine, group, record, Some(&err));
            // The kept slot said which calls of the run were refused:
            // it says now that the run's first was given up, which tells
            // a member still waiting in any call of the run, or later.
            if let Some(first) = run_start {
                let failed = CallRecord {
                    failed: true,
                    ..first
                };
                publish_in(
                    engine,
                    group.context,
                    group.ranks,
                    &failed,
                    &[KEPT_CALL_RECORD],
                );
            }
            return Err(err);
        }
    }
    publish(engine, group, &record, keep);
    arguments?;
    engine.collective_call = Some((group.context, record));
    engine.collective_fault = None;
    engine.collective_members.clear();
    engine.collective_members.extend_from_slice(group.ranks);
    Ok(record)
}

/// Ends the call `record`; one that failed is published as given up and
/// stops the context's collectives.
fn end_call(
    engine: &mut Engine<'_>,
    group: &Group<'_>,
    mut record: CallRecord,
    failure: Option<&Error>,
) {
    engine.collective_call = None;
    engine.collective_fault = None;
    if let Some(err) = failure {
        record.failed = true;
        publish(engine, group, &record, true);
        engine.forget_waiting_sends(group.context);
        engine.collective_epochs[group.context as usize]
            .broken
            .get_or_insert_with(|| {
                format!("call {} ({}) failed: {err}", record.call, describe(&record))
            });
    }
}

/// Whether the communicator of collective context `context` (members
/// `ranks`, this rank member `me`) keeps its contexts when it goes: its
/// collectives stopped at a failure (requests of its members may still
/// be posted there), or its latest call was refused here and a member
/// took part in it (it may still wait, and learns it only from this
/// rank's record of the call, which freeing the context would clear).
/// After a refused call, each member's records are read first, as the
/// call after a refusal does: a member that refused it too or has begun
/// a later call is done with it, and so is one that shows no record for
/// a liveness interval (it has dropped the communicator already, which
/// cleared them).
pub(crate) fn keeps_contexts(
    engine: &mut Engine<'_>,
    context: u32,
    ranks: &[u32],
    me: u32,
) -> bool {
    let state = &engine.collective_epochs[context as usize];
    if state.broken.is_some() {
        return true;
    }
    if !state.last_refused {
        return false;
    }
    let refused = state.calls;
    let patience = engine.config.liveness_interval;
    let group = Group { ranks, me, context };
    let settled = read_members_until(engine, &group, |member, records, waited| {
        if decoded(records).next().is_none() {
            return Ok(waited >= patience);
        }
        refusal_passed(member, refused, records)
    });
    settled.is_err()
}

/// Forgets a context's collective state when its communicator goes (on
/// every member, after its last collective call): epochs back to zero
/// and the flag words cleared, so the next communicator on the context
/// starts from zero on every member.
pub(crate) fn release_context(engine: &mut Engine<'_>, context: u32) {
    engine.collective_epochs[context as usize] = Epochs::default();
    // Communicators made on it no longer read its records (another
    // communicator may take it).
    for state in &mut engine.collective_epochs {
        if state.origin.is_some_and(|(parent, _)| parent == context) {
            state.origin = None;
        }
    }
    for writer in 0..engine.layout.ranks {
        let (start, bytes) = engine.layout.collective_section(context, writer);
        for at in (start..start + bytes).step_by(8) {
            engine.store(at, 0);
        }
    }
}

/// The members of a communicator as a collective sees them.
struct Group<'a> {
    /// World rank of each member.
    ranks: &'a [u32],
    me: u32,
    /// The collective context.
    context: u32,
}

impl Group<'_> {
    fn size(&self) -> u32 {
        self.ranks.len() as u32
    }

    fn world(&self, rank: u32) -> u32 {
        self.ranks[rank as usize]
    }

    /// World rank of the member at `relative` ranks after `root`.
    fn world_of_relative(&self, root: u32, relative: u32) -> u32 {
        self.world((root + relative) % self.size())
    }

    /// This rank's place counted from `root`.
    fn relative(&self, root: u32) -> u32 {
        (self.me + self.size() - root) % self.size()
    }
}

/// The largest power of two at most `n` (n >= 1), and its log2.
fn power_of_two_below(n: u32) -> (u32, u32) {
    let log = 31 - n.leading_zeros();
    (1 << log, log)
}

// ---- flag words ----

/// Posts flag writes to `peer`, remembered for a later completion check.
fn write_flags(
    engine: &mut Engine<'_>,
    context: u32,
    peer: u32,
    writes: &[(u64, &[u8])],
) -> Result<()> {
    let tag = engine.write_words(peer, writes)?;
    engine.collective_epochs[context as usize]
        .writes
        .push((peer, tag));
    Ok(())
}

/// Reports the failure of any flag write of `context` that completed,
/// forgetting those done (without waiting for the others).
fn check_flag_writes(engine: &mut Engine<'_>, context: u32) -> Result<()> {
    let writes = std::mem::take(&mut engine.collective_epochs[context as usize].writes);
    let mut pending = Vec::with_capacity(writes.len());
    let mut failure = None;
    for (peer, tag) in writes {
        match engine.plain_done(tag) {
            Ok(true) => {}
            Ok(false) => pending.push((peer, tag)),
            Err(err) => {
                failure.get_or_insert(err);
            }
        }
    }
    engine.collective_epochs[context as usize].writes = pending;
    failure.map_or(Ok(()), Err)
}

/// Waits until the flag word at `at` reaches `epoch` (the word is set
/// by `peer`, checked for liveness meanwhile).
fn wait_flag(engine: &mut Engine<'_>, peer: u32, at: u64, epoch: u64) -> Result<()> {
    engine.wait_until(Some(peer), None, |e| reached(peer, e.load(at), epoch))?;
    Ok(())
}

/// Whether a flag word that `peer` writes, now holding epoch `seen`, has
/// reached `epoch`. An honest peer is at most one call ahead (it needs
/// this rank's word of the next call to go further); an epoch beyond
/// that is refused, not taken as this call's, or one forged word would
/// let every later call on the context pass without the peer.
fn reached(peer: u32, seen: u64, epoch: u64) -> Result<bool> {
    if seen > epoch.saturating_add(1) {
        return Err(Error::BadPeerRecord {
            rank: peer,
            why: format!(
                "a collective flag word holds epoch {seen} while this rank waits for {epoch}: \
                 no member can be more than one call ahead"
            ),
        });
    }
    Ok(seen >= epoch)
}

fn barrier_dissemination(engine: &mut Engine<'_>, group: &Group<'_>, epoch: u64) -> Result<()> {
    let (n, me, context) = (group.size(), group.me, group.context);
    let rounds = 32 - (n - 1).leading_zeros();
    for round in 0..rounds {
        let distance = 1 << round;
        let to = group.world((me + distance) % n);
        let from = group.world((me + n - distance) % n);
        let set = engine.layout.barrier_word(context, engine.rank);
        write_flags(engine, context, to, &[(set, &epoch.to_le_bytes())])?;
        let seen = engine.layout.barrier_word(context, from);
        wait_flag(engine, from, seen, epoch)?;
    }
    Ok(())
}

fn barrier_tree(engine: &mut Engine<'_>, group: &Group<'_>, epoch: u64) -> Result<()> {
    let (n, me, context) = (group.size(), group.me, group.context);
    let children: Vec<u32> = [2 * me + 1, 2 * me + 2]
        .into_iter()
        .filter(|&c| c < n)
        .map(|c| group.world(c))
        .collect();
    for &child in &children {
        let at = engine.layout.tree_arrive(context, child);
        wait_flag(engine, child, at, epoch)?;
    }
    if me > 0 {
        let parent = group.world((me - 1) / 2);
        let arrive = engine.layout.tree_arrive(context, engine.rank);
        write_flags(engine, context, parent, &[(arrive, &epoch.to_le_bytes())])?;
        let release = engine.layout.tree_release(context, parent);
        wait_flag(engine, parent, release, epoch)?;
    }
    let release = engine.layout.tree_release(context, engine.rank);
    for &child in &children {
        write_flags(engine, context, child, &[(release, &epoch.to_le_bytes())])?;
    }
    Ok(())
}

/// This rank's step of a small reduction, sent to `peer` (member rank):
/// data, then the fenced epoch word, in this rank's section there (a
/// rank sends each peer at most one step per reduction).
fn send_step<T: Element>(
    engine: &mut Engine<'_>,
    group: &Group<'_>,
    peer: u32,
    epoch: u64,
    data: &[T],
) -> Result<()> {
    let bytes = bytes_of(data);
    let word = layout::step_word(epoch, bytes.len() as u64).to_le_bytes();
    let data_at = engine.layout.step_data(group.context, engine.rank, epoch);
    let epoch_at = engine.layout.step_epoch(group.context, engine.rank);
    let peer = group.world(peer);
    if bytes.is_empty() {
        write_flags(engine, group.context, peer, &[(epoch_at, &word)])
    } else {
        write_flags(
            engine,
            group.context,
            peer,
            &[(data_at, bytes), (epoch_at, &word)],
        )
    }
}

/// Waits for `peer`'s (member rank) step of a small reduction and
/// copies its data into `into`.
fn recv_step<T: Element>(
    engine: &mut Engine<'_>,
    group: &Group<'_>,
    peer: u32,
    epoch: u64,
    into: &mut [T],
) -> Result<()> {
    let world = group.world(peer);
    let epoch_at = engine.layout.step_epoch(group.context, world);
    engine.wait_until(Some(world), None, |e| {
        reached(world, layout::step_epoch_len(e.load(epoch_at)).0, epoch)
    })?;
    let (seen, len) = layout::step_epoch_len(engine.load(epoch_at));
    let into = bytes_of_mut(into);
    if seen == epoch && len != into.len() as u64 {
        return Err(Error::Mismatch(format!(
            "rank {peer} reduces {len} bytes, this rank {}",
            into.len()
        )));
    }
    let data_at = engine.layout.step_data(group.context, world, epoch);
    // SAFETY: the data area lies inside the control memory (the layout's
    // test checks it) and `into` is at most COLLECTIVE_DATA_BYTES long
    // (checked by the caller); the peer wrote it before the epoch word
    // just read with Acquire, and writes the other parity's area until
    // this rank has sent it the next reduction's data, so nothing writes
    // these bytes while they are copied.
    unsafe {
        std::ptr::copy_nonoverlapping(
            engine.control_ptr().add(data_at as usize),
            into.as_mut_ptr(),
            into.len(),
        )
    };
    Ok(())
}

/// Refuses a reduction of `bytes` on the flag words when they cannot
/// carry it.
fn check_flag_fit(bytes: usize) -> Result<()> {
    if bytes > REDUCE_FLAG_MAX {
        return Err(Error::Unsuitable(format!(
            "flag-word reductions carry at most {REDUCE_FLAG_MAX} bytes: {bytes} bytes asked"
        )));
    }
    Ok(())
}

/// Allreduce over flag words: recursive doubling among the largest
/// power of two, the ranks beyond it folded in first and answered last.
fn allreduce_flags<T: Element>(
    engine: &mut Engine<'_>,
    group: &Group<'_>,
    accumulated: &mut [T],
    op: Op<'_, T>,
) -> Result<()> {
    // The public calls refused longer data before the call began.
    debug_assert!(std::mem::size_of_val(accumulated) <= REDUCE_FLAG_MAX);
    let n = group.size();
    let (power, rounds) = power_of_two_below(n);
    let epochs = &mut engine.collective_epochs[group.context as usize];
    epochs.flag_reduce += 1;
    let epoch = epochs.flag_reduce;
    let me = group.me;
    let mut incoming = vec![T::default(); accumulated.len()];
    if me >= power {
        send_step(engine, group, me - power, epoch, accumulated)?;
        return recv_step(engine, group, me - power, epoch, accumulated);
    }
    let folded = me + power < n;
    if folded {
        recv_step(engine, group, me + power, epoch, &mut incoming)?;
        combine(op, accumulated, &incoming);
    }
    for round in 0..rounds {
        let partner = me ^ (1 << round);
        send_step(engine, group, partner, epoch, accumulated)?;
        recv_step(engine, group, partner, epoch, &mut incoming)?;
        combine(op, accumulated, &incoming);
    }
    if folded {
        send_step(engine, group, me + power, epoch, accumulated)?;
    }
    Ok(())
}

// ---- a split's or dup's exchange ----

/// [`Communicator::exchange`]'s gather at member 0 and return of the
/// whole table to every member.
fn gather_and_return(engine: &mut Engine<'_>, group: &Group<'_>, value: &[u8]) -> Result<Vec<u8>> {
    let (context, len) = (group.context, value.len());
    let mut table = vec![0u8; len * group.size() as usize];
    if group.me == 0 {
        table[..len].copy_from_slice(value);
        let mut posted = Vec::new();
        let mut gathered = Ok(());
        let base = table.as_mut_ptr();
        for member in 1..group.size() {
            // SAFETY: member * len + len <= table.len() (the table holds
            // `size` parts of `len` bytes); every part is a separate
            // range of the table, which stays allocated and untouched
            // until each receive is finished or withdrawn below.
            let part = unsafe { base.add(member as usize * len) };
            match post_recv(engine, context, group.world(member), 0, part, len) {
                Ok(receive) => posted.push(receive),
                Err(err) => {
                    gathered = Err(err);
                    break;
                }
            }
        }
        let mut receives = posted.into_iter();
        while let (Ok(()), Some(receive)) = (&gathered, receives.next()) {
            gathered = finish_recv(engine, receive, len);
        }
        // Those not waited for go back with the table.
        for receive in receives {
            withdraw(engine, receive);
        }
        gathered?;
        with_sends(engine, |engine, sends| {
            for member in 1..group.size() {
                let to = group.world(member);
                sends.start(engine, context, to, 0, table.as_ptr(), table.len())?;
            }
            Ok(())
        })?;
    } else {
        let mut sends = Sends::default();
        if let Err(err) = receive_table(engine, &mut sends, group, value, &mut table) {
            sends.abandon(engine);
            return Err(err);
        }
        // Rank 0 sent the table once it held this rank's contribution:
        // that send has landed or soon will. One that never found its
        // receive (a table sent without it) stays spooled; the table
        // itself was checked.
        if let Err(err) = sends.settle(engine) {
            sends.abandon(engine);
            return Err(err);
        }
    }
    Ok(table)
}

/// A member's part of [`gather_and_return`]: its contribution sent to
/// member 0 (in `sends`), the whole table received into `table` and
/// checked to hold the contribution unchanged.
fn receive_table(
    engine: &mut Engine<'_>,
    sends: &mut Sends,
    group: &Group<'_>,
    value: &[u8],
    table: &mut [u8],
) -> Result<()> {
    let (context, from, len) = (group.context, group.world(0), value.len());
    sends.start(engine, context, from, 0, value.as_ptr(), len)?;
    let whole = table.len();
    let receive = post_recv(engine, context, from, 0, table.as_mut_ptr(), whole)?;
    finish_recv(engine, receive, whole)?;
    if table[group.me as usize * len..][..len] != *value {
        return Err(Error::BadPeerRecord {
            rank: from,
            why: format!("its table of contributions changed rank {}'s own", group.me),
        });
    }
    Ok(())
}

// ---- zero-copy messages ----

/// Sends a collective started from the caller's memory (or its own
/// temporaries), all waited for before it returns.
#[derive(Default)]
struct Sends(Vec<(u32, u64, u64)>);

impl Sends {
    /// Starts a send of `len` bytes at `ptr` to world rank `peer`. The
    /// bytes stay valid and unchanged until [`finish`](Self::finish) or
    /// [`abandon`](Self::abandon).
    fn start(
        &mut self,
        engine: &mut Engine<'_>,
        context: u32,
        peer: u32,
        index: u32,
        ptr: *const u8,
        len: usize,
    ) -> Result<()> {
        let data = SendBytes::Borrowed {
            ptr,
            len: len as u64,
        };
        let (slot, generation) = engine.start_send(context, peer, index, data, None)?;
        self.0.push((peer, slot, generation));
        Ok(())
    }

    /// Waits for every send.
    fn finish(&mut self, engine: &mut Engine<'_>) -> Result<()> {
        while let Some(&(peer, slot, generation)) = self.0.first() {
            engine.wait_until(Some(peer), None, |e| Ok(e.send_completed(slot, generation)))?;
            self.0.remove(0);
            if let Some(err) = engine.take_send_failure(slot, generation) {
                return Err(err);
            }
        }
        Ok(())
    }

    /// Waits for every send that found its receive; one still waiting
    /// for its receive is spooled instead (it goes if the receive ever
    /// appears, and a failure shows later, as for a send past the timeout
    /// switch).
    fn settle(&mut self, engine: &mut Engine<'_>) -> Result<()> {
        while let Some(&(peer, slot, generation)) = self.0.first() {
            if engine.send_posted(slot, generation) {
                engine.wait_until(Some(peer), None, |e| Ok(e.send_completed(slot, generation)))?;
                if let Some(err) = engine.take_send_failure(slot, generation) {
                    self.0.remove(0);
                    return Err(err);
                }
            } else {
                engine.spool(slot, generation);
                engine.defer_failure(slot, generation);
            }
            self.0.remove(0);
        }
        Ok(())
    }

    /// After a failure: sends still waiting for their receives are
    /// copied out (they go if the receive ever appears), those on the
    /// wire get the device's time to finish, so that the caller's memory
    /// is free once the call returns.
    fn abandon(&mut self, engine: &mut Engine<'_>) {
        for (_, slot, generation) in self.0.drain(..) {
            engine.spool(slot, generation);
            let deadline = Instant::now() + Duration::from_secs(30);
            let _ = engine.wait_until(None, Some(deadline), |e| {
                Ok(!e.send_posted(slot, generation) || e.send_completed(slot, generation))
            });
        }
    }
}

/// Runs `body` with a set of sends that all complete before this
/// returns (or are made safe by [`Sends::abandon`] on failure).
fn with_sends<R>(
    engine: &mut Engine<'_>,
    body: impl FnOnce(&mut Engine<'_>, &mut Sends) -> Result<R>,
) -> Result<R> {
    let mut sends = Sends::default();
    let result = body(engine, &mut sends).and_then(|r| sends.finish(engine).map(|()| r));
    if result.is_err() {
        sends.abandon(engine);
    }
    result
}

/// Posts a receive of `len` bytes at `ptr` from world rank `peer`.
fn post_recv(
    engine: &mut Engine<'_>,
    context: u32,
    peer: u32,
    index: u32,
    ptr: *mut u8,
    len: usize,
) -> Result<(u32, u64, u64)> {
    let (slot, generation) = engine.post_recv(context, peer, index, ptr, len as u64)?;
    Ok((peer, slot, generation))
}

/// Takes back a receive the call gives up: its buffer goes back to the
/// caller (or is freed) with the error, so no write may land in it later.
fn withdraw(engine: &mut Engine<'_>, posted: (u32, u64, u64)) {
    let (_, slot, generation) = posted;
    engine.withdraw_recv(slot, generation);
}

/// Waits for a posted receive; it must bring exactly `expected` bytes.
fn finish_recv(engine: &mut Engine<'_>, posted: (u32, u64, u64), expected: usize) -> Result<()> {
    let (peer, slot, generation) = posted;
    if let Err(err) = engine.wait_until(Some(peer), None, |e| {
        Ok(!e.recv_outstanding(slot, generation))
    }) {
        withdraw(engine, posted);
        return Err(err);
    }
    match engine.take_recv(slot, generation) {
        Some(Ok(received)) if received.len == expected as u64 => Ok(()),
        Some(Ok(received)) => Err(Error::Mismatch(format!(
            "world rank {peer} sent {} bytes where this rank expects {expected}",
            received.len
        ))),
        Some(Err(Error::Truncated { message, .. })) => Err(Error::Mismatch(format!(
            "world rank {peer} sent {message} bytes where this rank expects {expected}"
        ))),
        Some(Err(err)) => Err(err),
        None => Err(Error::NoRequest {
            what: "receive",
            peer,
            index: engine.layout.slot_parts(slot).2,
        }),
    }
}

fn broadcast_binomial(
    engine: &mut Engine<'_>,
    group: &Group<'_>,
    root: u32,
    buffer: &mut [u8],
) -> Result<()> {
    let n = group.size();
    let relative = group.relative(root);
    let mut mask = 1;
    while mask < n {
        if relative & mask != 0 {
            let parent = group.world_of_relative(root, relative - mask);
            let posted = post_recv(
                engine,
                group.context,
                parent,
                0,
                buffer.as_mut_ptr(),
                buffer.len(),
            )?;
            finish_recv(engine, posted, buffer.len())?;
            break;
        }
        mask <<= 1;
    }
    with_sends(engine, |engine, sends| {
        mask >>= 1;
        while mask > 0 {
            if relative + mask < n {
                let child = group.world_of_relative(root, relative + mask);
                sends.start(
                    engine,
                    group.context,
                    child,
                    0,
                    buffer.as_ptr(),
                    buffer.len(),
                )?;
            }
            mask >>= 1;
        }
        Ok(())
    })
}

fn broadcast_pipelined(
    engine: &mut Engine<'_>,
    group: &Group<'_>,
    root: u32,
    buffer: &mut [u8],
    chunk: usize,
) -> Result<()> {
    let n = group.size();
    let relative = group.relative(root);
    let parent = (relative > 0).then(|| group.world_of_relative(root, (relative - 1) / 2));
    let children: Vec<u32> = [2 * relative + 1, 2 * relative + 2]
        .into_iter()
        .filter(|&c| c < n)
        .map(|c| group.world_of_relative(root, c))
        .collect();
    let len = buffer.len();
    let chunks = len.div_ceil(chunk).max(1);
    let range = |j: usize| (j * chunk, ((j + 1) * chunk).min(len) - (j * chunk).min(len));
    // Two alternating receive slots (one if the configuration has one).
    let depth = engine.config.slots.min(2) as usize;
    let base = buffer.as_mut_ptr();
    // One window over the whole buffer, held for the call: every chunk's
    // receive finds it instead of binding its own.
    let held_window = match (parent, len) {
        (Some(parent), 1..) => {
            let (context, sender) = (engine.context, engine.peer_port(parent));
            Some(
                engine
                    .windows
                    .acquire(context, base as u64, len as u64, sender)?
                    .2,
            )
        }
        _ => None,
    };
    let mut posted = VecDeque::with_capacity(depth);
    let result = with_sends(engine, |engine, sends| {
        if let Some(parent) = parent {
            for j in 0..depth.min(chunks) {
                let (start, bytes) = range(j);
                // SAFETY: `start <= len`: the pointer stays inside (or one
                // past) the caller's buffer.
                let at = unsafe { base.add(start) };
                posted.push_back(post_recv(
                    engine,
                    group.context,
                    parent,
                    (j % depth) as u32,
                    at,
                    bytes,
                )?);
            }
        }
        for j in 0..chunks {
            let (start, bytes) = range(j);
            if parent.is_some() {
                let receive = posted.pop_front().expect("a receive per chunk");
                finish_recv(engine, receive, bytes)?;
                if let (Some(parent), true) = (parent, j + depth < chunks) {
                    let (next, next_bytes) = range(j + depth);
                    // SAFETY: as above, `next <= len`.
                    let at = unsafe { base.add(next) };
                    posted.push_back(post_recv(
                        engine,
                        group.context,
                        parent,
                        (j % depth) as u32,
                        at,
                        next_bytes,
                    )?);
                }
            }
            for &child in &children {
                // SAFETY: as above, `start <= len`; the chunk has arrived
                // and nothing writes it any more.
                let at = unsafe { base.add(start) };
                sends.start(engine, group.context, child, (j % depth) as u32, at, bytes)?;
            }
        }
        Ok(())
    });
    if result.is_err() {
        // The chunks not received go back with the buffer.
        for receive in posted.drain(..) {
            withdraw(engine, receive);
        }
    }
    if let Some(id) = held_window {
        match result {
            Ok(()) => engine.windows.release(id),
            Err(_) => {
                publish_given_up(engine);
                engine.windows.withdraw(id)
            }
        }
    }
    result
}

/// A member's values during a reduction: its contribution (`mine`) until
/// a first combine writes `result`, `result` from then on. Nothing is
/// copied up front: the first combine reads `mine` and writes `result`
/// in one pass, and what a member sends before it goes out of `mine`.
struct Partial<'a, T> {
    mine: &'a [T],
    result: &'a mut [T],
    written: bool,
}

impl<'a, T: Element> Partial<'a, T> {
    /// `mine` and `result` are equally long.
    fn new(mine: &'a [T], result: &'a mut [T]) -> Self {
        debug_assert_eq!(mine.len(), result.len());
        Self {
            mine,
            result,
            written: false,
        }
    }

    /// The values so far.
    fn values(&self) -> &[T] {
        if self.written {
            self.result
        } else {
            self.mine
        }
    }

    /// Combines `incoming` into the values so far of `range`, into
    /// `result`. A first combine must cover every element read later.
    fn combine(&mut self, op: Op<'_, T>, range: Range<usize>, incoming: &[T]) {
        let first = (!self.written).then(|| &self.mine[range.clone()]);
        combine_into(op, &mut self.result[range], first, incoming);
        self.written = true;
    }

    /// Makes `result` hold the values so far (a member that combined
    /// nothing copies `mine`).
    fn settle(&mut self) {
        if !self.written {
            self.result.copy_from_slice(self.mine);
            self.written = true;
        }
    }
}

/// Combines everyone's contribution up a binary tree rooted at `root`;
/// the root's `partial` holds the result. `incoming` (as long) receives
/// the children's vectors.
fn reduce_tree<T: Element>(
    engine: &mut Engine<'_>,
    group: &Group<'_>,
    root: u32,
    partial: &mut Partial<'_, T>,
    incoming: &mut [T],
    op: Op<'_, T>,
) -> Result<()> {
    let n = group.size();
    let relative = group.relative(root);
    for child in [2 * relative + 1, 2 * relative + 2] {
        if child < n {
            let peer = group.world_of_relative(root, child);
            receive_whole(engine, group.context, peer, incoming)?;
            partial.combine(op, 0..incoming.len(), incoming);
        }
    }
    if relative > 0 {
        let parent = group.world_of_relative(root, (relative - 1) / 2);
        send_whole(engine, group.context, parent, partial.values())?;
    }
    Ok(())
}

/// Receives exactly `into`'s length from world rank `peer`.
fn receive_whole<T: Element>(
    engine: &mut Engine<'_>,
    context: u32,
    peer: u32,
    into: &mut [T],
) -> Result<()> {
    let len = std::mem::size_of_val(into);
    let posted = post_recv(engine, context, peer, 0, into.as_mut_ptr().cast(), len)?;
    finish_recv(engine, posted, len)
}

/// Sends `values` to world rank `peer` and waits for it.
fn send_whole<T: Element>(
    engine: &mut Engine<'_>,
    context: u32,
    peer: u32,
    values: &[T],
) -> Result<()> {
    let bytes = bytes_of(values);
    with_sends(engine, |engine, sends| {
        sends.start(engine, context, peer, 0, bytes.as_ptr(), bytes.len())
    })
}

/// One exchange with member `peer`: sends `outgoing` while receiving
/// `incoming` (exactly as long as the peer sends); both complete before
/// this returns. The two may not overlap.
fn exchange<T: Element>(
    engine: &mut Engine<'_>,
    group: &Group<'_>,
    peer: u32,
    outgoing: &[T],
    incoming: &mut [T],
) -> Result<()> {
    let peer = group.world(peer);
    let context = group.context;
    let len = std::mem::size_of_val(incoming);
    let posted = post_recv(engine, context, peer, 0, incoming.as_mut_ptr().cast(), len)?;
    let bytes = bytes_of(outgoing);
    let result = with_sends(engine, |engine, sends| {
        sends.start(engine, context, peer, 0, bytes.as_ptr(), bytes.len())?;
        finish_recv(engine, posted, len)
    });
    if result.is_err() {
        // The send failed before the receive was waited for (a receive
        // already finished or withdrawn is not withdrawn again).
        withdraw(engine, posted);
    }
    result
}

/// Runs `among_power` among the largest power of two of the members;
/// each member beyond it first sends its contribution to its partner
/// (its rank minus the power), which combines it in, and gets the result
/// back last. `incoming` (as long as the vectors) takes a vector
/// received.
fn with_folding<T: Element>(
    engine: &mut Engine<'_>,
    group: &Group<'_>,
    partial: &mut Partial<'_, T>,
    incoming: &mut [T],
    op: Op<'_, T>,
    among_power: impl FnOnce(&mut Engine<'_>, &mut Partial<'_, T>, &mut [T]) -> Result<()>,
) -> Result<()> {
    let (n, me) = (group.size(), group.me);
    let (power, _) = power_of_two_below(n);
    if me >= power {
        // Straight into the result: what goes out is `mine`.
        debug_assert!(!partial.written);
        exchange(engine, group, me - power, partial.mine, partial.result)?;
        partial.written = true;
        return Ok(());
    }
    let partner = (me + power < n).then_some(me + power);
    if let Some(partner) = partner {
        receive_whole(engine, group.context, group.world(partner), incoming)?;
        partial.combine(op, 0..incoming.len(), incoming);
    }
    among_power(engine, partial, incoming)?;
    if let Some(partner) = partner {
        send_whole(
            engine,
            group.context,
            group.world(partner),
            partial.values(),
        )?;
    }
    Ok(())
}

/// Allreduce by recursive doubling with messages: in each round the
/// whole vector goes to the partner and comes back from it.
fn allreduce_recursive_doubling<T: Element>(
    engine: &mut Engine<'_>,
    group: &Group<'_>,
    partial: &mut Partial<'_, T>,
    incoming: &mut [T],
    op: Op<'_, T>,
) -> Result<()> {
    with_folding(
        engine,
        group,
        partial,
        incoming,
        op,
        |engine, partial, incoming| {
            let (power, rounds) = power_of_two_below(group.size());
            debug_assert!(group.me < power);
            for round in 0..rounds {
                let partner = group.me ^ (1 << round);
                exchange(engine, group, partner, partial.values(), incoming)?;
                partial.combine(op, 0..incoming.len(), incoming);
            }
            Ok(())
        },
    )
}

/// Allreduce by reduce-scatter, then allgather (Rabenseifner's, as
/// MPICH runs long vectors): recursive halving leaves each member of the
/// power of two with the combined values of its own share (in round `k`
/// a member keeps half of its current range, sends the other half to
/// the partner `me ^ 2^k` and combines the partner's copy of its half);
/// recursive doubling then trades the combined shares back until every
/// member holds all of them, each received straight into the result.
/// Every member sends and receives 2 (p - 1) / p of the vector instead
/// of log2 p whole vectors, and all of them combine at once, each its
/// own share.
fn allreduce_halving<T: Element>(
    engine: &mut Engine<'_>,
    group: &Group<'_>,
    partial: &mut Partial<'_, T>,
    incoming: &mut [T],
    op: Op<'_, T>,
) -> Result<()> {
    with_folding(
        engine,
        group,
        partial,
        incoming,
        op,
        |engine, partial, incoming| {
            let (power, rounds) = power_of_two_below(group.size());
            let me = group.me;
            debug_assert!(me < power);
            // The range held before each halving round, for the way back.
            let mut held = Vec::with_capacity(rounds as usize);
            let mut range = 0..incoming.len();
            for round in (0..rounds).rev() {
                let bit = 1 << round;
                let middle = range.start + range.len() / 2;
                let (low, high) = (range.start..middle, middle..range.end);
                let (keep, give) = if me & bit == 0 {
                    (low, high)
                } else {
                    (high, low)
                };
                held.push(range.clone());
                let into = &mut incoming[..keep.len()];
                if partial.written {
                    // Disjoint views of the result: the half sent, the half
                    // combined into.
                    let (kept, given) = split_pair(
                        &mut partial.result[range.clone()],
                        keep.start < give.start,
                        keep.len(),
                    );
                    exchange(engine, group, me ^ bit, given, into)?;
                    combine(op, kept, into);
                } else {
                    // The first round sends out of `mine`; its combine writes
                    // the kept half of the result, which holds every element
                    // read or sent from here on.
                    exchange(engine, group, me ^ bit, &partial.mine[give], into)?;
                    partial.combine(op, keep.clone(), into);
                }
                range = keep;
            }
            partial.settle();
            for round in 0..rounds {
                let bit = 1 << round;
                let whole = held.pop().expect("a range per halving round");
                let mine_first = range.start == whole.start;
                let (into, mine) = split_pair(
                    &mut partial.result[whole.clone()],
                    !mine_first,
                    whole.len() - range.len(),
                );
                exchange(engine, group, me ^ bit, mine, into)?;
                range = whole;
            }
            Ok(())
        },
    )
}

/// Splits `values` into a written part and a read part: the written one
/// is the first `written_len` elements if `written_first`, else the last
/// `written_len`.
fn split_pair<T>(values: &mut [T], written_first: bool, written_len: usize) -> (&mut [T], &[T]) {
    if written_first {
        let (head, tail) = values.split_at_mut(written_len);
        (head, tail)
    } else {
        let at = values.len() - written_len;
        let (head, tail) = values.split_at_mut(at);
        (tail, head)
    }
}

/// Runs the allreduce `algorithm` (flag words, recursive doubling or
/// reduce-scatter and allgather) on `partial`, which holds the result
/// once it returns.
fn allreduce_by<T: Element>(
    algorithm: Algorithm,
    engine: &mut Engine<'_>,
    group: &Group<'_>,
    partial: &mut Partial<'_, T>,
    incoming: &mut [T],
    op: Op<'_, T>,
) -> Result<()> {
    match algorithm {
        Algorithm::FlagWords => {
            partial.settle();
            allreduce_flags(engine, group, partial.result, op)?;
            check_flag_writes(engine, group.context)
        }
        Algorithm::RecursiveDoubling => {
            allreduce_recursive_doubling(engine, group, partial, incoming, op)
        }
        _ => allreduce_halving(engine, group, partial, incoming, op),
    }
}

/// The most scratch memory a communicator keeps between reductions
/// (bytes); a longer reduction's goes back when it ends.
const SCRATCH_KEPT_MAX: usize = 32 << 20;

/// Runs `body` with the engine's scratch memory viewed as `len` elements
/// of `T` (grown if shorter, its contents unspecified), and puts the
/// memory back for the next call (up to [`SCRATCH_KEPT_MAX`] bytes),
/// whatever `body` returns. Receives posted into it are finished or
/// withdrawn by `body`.
fn with_scratch<T: Element, R>(
    engine: &mut Engine<'_>,
    len: usize,
    body: impl FnOnce(&mut Engine<'_>, &mut [T]) -> Result<R>,
) -> Result<R> {
    const { assert!(std::mem::align_of::<T>() <= std::mem::align_of::<u64>()) };
    let mut scratch = std::mem::take(&mut engine.collective_scratch);
    let words = (len * std::mem::size_of::<T>()).div_ceil(8);
    if scratch.len() < words {
        scratch.resize(words, 0);
    }
    // SAFETY: the words cover at least `len` elements of `T`, whose
    // alignment is at most a word's (asserted above); every bit pattern
    // is a valid `T` (`Element` is sealed to primitive integers and
    // floats); `scratch` is owned here and outlives the view, which
    // `body` cannot keep (it is borrowed for the call only).
    let view = unsafe { std::slice::from_raw_parts_mut(scratch.as_mut_ptr().cast::<T>(), len) };
    let result = body(engine, view);
    if scratch.len() * 8 <= SCRATCH_KEPT_MAX {
        engine.collective_scratch = scratch;
    }
    result
}

// ---- the public calls ----

/// Collectives (every member calls them, in the same order).
///
/// Members that disagree about a call (kind, root, length, element type,
/// algorithm) fail instead of waiting on each other: a rank that waits
/// on a peer reads the peer's record of the same call with each liveness
/// check ([`Config::liveness_interval`](crate::Config::liveness_interval))
/// and fails with [`Error::Mismatch`] naming both calls, or with
/// [`Error::MemberFailed`] when the peer gave the call up. A call that
/// fails once begun stops the communicator's collectives: later ones
/// fail at once with [`Error::CommunicatorBroken`], while point-to-point
/// on it still works. Arguments refused before a call begins (buffers of
/// different lengths, a root out of range) break nothing when every
/// member refuses them; members that wait in the call fail with
/// [`Error::MemberFailed`], and so does the refusing rank's next call,
/// naming the member that took part.
impl Communicator<'_> {
    fn group(&self) -> Group<'_> {
        Group {
            ranks: &self.ranks,
            me: self.rank,
            context: self.context + 1,
        }
    }

    fn check_root(&self, root: u32) -> Result<()> {
        if root >= self.size() {
            return Err(Error::NoSuchRank {
                rank: root,
                size: self.size(),
            });
        }
        Ok(())
    }

    /// Every member's `value` (all of the same length), in rank order:
    /// gathered at rank 0 and sent back whole, on the collective context,
    /// as one collective call (`purpose` tells its record apart). The
    /// table rank 0 sends back must hold this rank's value unchanged
    /// ([`Error::BadPeerRecord`] naming rank 0 otherwise). Every send is
    /// waited for, so that a member that gave its part up (and withdrew
    /// its receive) fails the call on rank 0 too.
    pub(crate) fn exchange(&self, purpose: Exchange, value: &[u8]) -> Result<Vec<Vec<u8>>> {
        let group = self.group();
        let table = self.collective_call(exchange_record(purpose, value.len()), Ok(()), || {
            gather_and_return(&mut self.engine(), &group, value)
        })?;
        Ok(table
            .chunks(value.len().max(1))
            .take(self.size() as usize)
            .map(<[u8]>::to_vec)
            .collect())
    }

    /// Runs `body` as this rank's next collective call, described by
    /// `record` (see the module's call records), unless its `arguments`
    /// were refused: `body` borrows the engine as it needs.
    pub(crate) fn collective_call<R>(
        &self,
        record: CallRecord,
        arguments: Result<()>,
        body: impl FnOnce() -> Result<R>,
    ) -> Result<R> {
        let group = self.group();
        let record = begin_call(&mut self.engine(), &group, record, arguments)?;
        let result = match body() {
            Err(Error::Completion(refused)) if refused.status == Status::RemoteAccessError => {
                // A member that gave its part up withdrew a receive this
                // rank wrote to: its record says so.
                let explained = self.engine().member_that_gave_up(group.ranks);
                Err(explained.unwrap_or(Error::Completion(refused)))
            }
            Err(Error::Mismatch(seen)) => {
                // Members that run different algorithms on the same
                // length exchange messages of lengths the other does not
                // expect: their records say why.
                let explained = mismatch_in_records(&mut self.engine(), &group, &record);
                Err(explained.unwrap_or(Error::Mismatch(seen)))
            }
            Ok(value) if self.engine().config.verify_collectives => {
                verify_call(&mut self.engine(), &group, &record).map(|()| value)
            }
            other => other,
        };
        end_call(&mut self.engine(), &group, record, result.as_ref().err());
        result
    }

    /// Blocks until every member has called it (the default algorithm,
    /// see [`BarrierAlgorithm::Auto`]).
    ///
    /// ```no_run
    /// # fn f(world: &pindown_messaging::Communicator<'_>) -> pindown_messaging::Result<()> {
    /// world.barrier()?; // no rank passes before all have arrived
    /// # Ok(()) }
    /// ```
    pub fn barrier(&self) -> Result<()> {
        self.barrier_with(BarrierAlgorithm::Auto)
    }

    /// [`barrier`](Self::barrier) with the algorithm named.
    ///
    /// ```no_run
    /// # fn f(world: &pindown_messaging::Communicator<'_>) -> pindown_messaging::Result<()> {
    /// use pindown_messaging::BarrierAlgorithm;
    /// world.barrier_with(BarrierAlgorithm::BinaryTree)?; // FMPL's software barrier
    /// # Ok(()) }
    /// ```
    pub fn barrier_with(&self, algorithm: BarrierAlgorithm) -> Result<()> {
        self.engine().check_open()?;
        let group = self.group();
        if group.size() == 1 {
            return Ok(());
        }
        let chosen = match algorithm {
            BarrierAlgorithm::BinaryTree => Algorithm::BarrierTree,
            BarrierAlgorithm::Auto | BarrierAlgorithm::Dissemination => Algorithm::Dissemination,
        };
        self.collective_call(record(Kind::Barrier, chosen, 0, 0, 0), Ok(()), || {
            let mut engine = self.engine();
            let context = group.context as usize;
            engine.collective_epochs[context].barrier += 1;
            let epoch = engine.collective_epochs[context].barrier;
            match chosen {
                Algorithm::BarrierTree => barrier_tree(&mut engine, &group, epoch)?,
                _ => barrier_dissemination(&mut engine, &group, epoch)?,
            }
            check_flag_writes(&mut engine, group.context)
        })
    }

    /// Copies `root`'s `buffer` into every member's `buffer` (all of the
    /// same length; a different length fails with [`Error::Mismatch`]).
    ///
    /// ```no_run
    /// # fn f(world: &pindown_messaging::Communicator<'_>) -> pindown_messaging::Result<()> {
    /// let mut table = vec![0u8; 1 << 20];
    /// if world.rank() == 0 {
    ///     table.fill(7);
    /// }
    /// world.broadcast(0, &mut table)?;
    /// assert!(table.iter().all(|&b| b == 7));
    /// # Ok(()) }
    /// ```
    pub fn broadcast(&self, root: u32, buffer: &mut [u8]) -> Result<()> {
        self.broadcast_with(root, buffer, BroadcastAlgorithm::Auto)
    }

    /// [`broadcast`](Self::broadcast) with the algorithm named.
    ///
    /// ```no_run
    /// # fn f(world: &pindown_messaging::Communicator<'_>) -> pindown_messaging::Result<()> {
    /// use pindown_messaging::BroadcastAlgorithm;
    /// let mut data = vec![1u8; 8 << 20];
    /// world.broadcast_with(0, &mut data, BroadcastAlgorithm::Pipelined)?;
    /// # Ok(()) }
    /// ```
    pub fn broadcast_with(
        &self,
        root: u32,
        buffer: &mut [u8],
        algorithm: BroadcastAlgorithm,
    ) -> Result<()> {
        self.engine().check_open()?;
        let group = self.group();
        if group.size() == 1 {
            return self.check_root(root);
        }
        let chosen = match algorithm {
            BroadcastAlgorithm::Auto
                if BROADCAST_PIPELINE_MIN.is_some_and(|min| buffer.len() >= min)
                    && group.size() >= 3 =>
            {
                Algorithm::Pipelined
            }
            BroadcastAlgorithm::Pipelined => Algorithm::Pipelined,
            BroadcastAlgorithm::Auto | BroadcastAlgorithm::BinomialTree => Algorithm::BinomialTree,
        };
        let call = record(Kind::Broadcast, chosen, 0, root, buffer.len());
        self.collective_call(call, self.check_root(root), || {
            let mut engine = self.engine();
            match chosen {
                Algorithm::Pipelined => {
                    broadcast_pipelined(&mut engine, &group, root, buffer, PIPELINE_CHUNK_BYTES)
                }
                _ => broadcast_binomial(&mut engine, &group, root, buffer),
            }
        })
    }

    /// Combines every member's `send` element by element with `op` into
    /// `root`'s `receive` (as long as `send`); on the other members
    /// `receive` is not touched (it may be empty).
    ///
    /// ```no_run
    /// # fn f(world: &pindown_messaging::Communicator<'_>) -> pindown_messaging::Result<()> {
    /// use pindown_messaging::Op;
    /// let mine = [world.rank() as f64, 1.0];
    /// let mut total = [0.0; 2];
    /// world.reduce(0, &mine, &mut total, Op::Sum)?;
    /// if world.rank() == 0 {
    ///     assert_eq!(total[1], world.size() as f64);
    /// }
    /// # Ok(()) }
    /// ```
    pub fn reduce<T: Element>(
        &self,
        root: u32,
        send: &[T],
        receive: &mut [T],
        op: Op<'_, T>,
    ) -> Result<()> {
        self.reduce_with(root, send, receive, op, ReduceAlgorithm::Auto)
    }

    /// [`reduce`](Self::reduce) with the algorithm named.
    ///
    /// ```no_run
    /// # fn f(world: &pindown_messaging::Communicator<'_>) -> pindown_messaging::Result<()> {
    /// use pindown_messaging::{Op, ReduceAlgorithm};
    /// let mine = vec![world.rank() as i64; 1 << 16];
    /// let mut largest = vec![0i64; 1 << 16];
    /// world.reduce_with(0, &mine, &mut largest, Op::Max, ReduceAlgorithm::BinaryTree)?;
    /// # Ok(()) }
    /// ```
    pub fn reduce_with<T: Element>(
        &self,
        root: u32,
        send: &[T],
        receive: &mut [T],
        op: Op<'_, T>,
        algorithm: ReduceAlgorithm,
    ) -> Result<()> {
        self.engine().check_open()?;
        let arguments = self.check_root(root).and_then(|()| {
            if self.rank == root && receive.len() != send.len() {
                return Err(Error::Mismatch(format!(
                    "the root's receive buffer holds {} elements, its send buffer {}",
                    receive.len(),
                    send.len()
                )));
            }
            Ok(())
        });
        let group = self.group();
        if group.size() == 1 {
            arguments?;
            receive.copy_from_slice(send);
            return Ok(());
        }
        let bytes = std::mem::size_of_val(send);
        let chosen = match algorithm {
            ReduceAlgorithm::Auto if bytes <= REDUCE_FLAG_MAX => Algorithm::FlagWords,
            ReduceAlgorithm::Auto | ReduceAlgorithm::BinaryTree => Algorithm::BinaryTree,
            named => Algorithm::of_reduction(named),
        };
        let arguments = arguments.and_then(|()| match chosen {
            Algorithm::FlagWords => check_flag_fit(bytes),
            _ => Ok(()),
        });
        let call = CallRecord {
            op: op_code(&op),
            ..record(Kind::Reduce, chosen, T::CODE, root, bytes)
        };
        let len = send.len();
        self.collective_call(call, arguments, || {
            with_scratch(&mut self.engine(), 2 * len, |engine, scratch| {
                // The root builds the result in `receive`, the others in
                // scratch memory (their `receive` is not touched).
                let (spare, incoming) = scratch.split_at_mut(len);
                let result = if self.rank == root { receive } else { spare };
                let mut partial = Partial::new(send, result);
                match chosen {
                    Algorithm::BinaryTree => {
                        reduce_tree(engine, &group, root, &mut partial, incoming, op)?
                    }
                    _ => allreduce_by(chosen, engine, &group, &mut partial, incoming, op)?,
                }
                if self.rank == root {
                    partial.settle();
                }
                Ok(())
            })
        })
    }

    /// Combines every member's `send` element by element with `op` into
    /// every member's `receive` (as long as `send`).
    ///
    /// ```no_run
    /// # fn f(world: &pindown_messaging::Communicator<'_>) -> pindown_messaging::Result<()> {
    /// use pindown_messaging::Op;
    /// let residual = [0.25f64 * world.rank() as f64];
    /// let mut worst = [0.0f64];
    /// world.allreduce(&residual, &mut worst, Op::MaxAbs)?;
    /// let clamp = |acc: &mut [u32], incoming: &[u32]| {
    ///     acc.iter_mut().zip(incoming).for_each(|(a, b)| *a = (*a + b).min(100))
    /// };
    /// let mut votes = [0u32];
    /// world.allreduce(&[60], &mut votes, Op::User(&clamp))?;
    /// # Ok(()) }
    /// ```
    pub fn allreduce<T: Element>(
        &self,
        send: &[T],
        receive: &mut [T],
        op: Op<'_, T>,
    ) -> Result<()> {
        self.allreduce_with(send, receive, op, ReduceAlgorithm::Auto)
    }

    /// [`allreduce`](Self::allreduce) with the algorithm named.
    ///
    /// ```no_run
    /// # fn f(world: &pindown_messaging::Communicator<'_>) -> pindown_messaging::Result<()> {
    /// use pindown_messaging::{Op, ReduceAlgorithm};
    /// let mut sum = [0u64; 4];
    /// world.allreduce_with(&[1, 2, 3, 4], &mut sum, Op::Sum, ReduceAlgorithm::RecursiveDoubling)?;
    /// # Ok(()) }
    /// ```
    pub fn allreduce_with<T: Element>(
        &self,
        send: &[T],
        receive: &mut [T],
        op: Op<'_, T>,
        algorithm: ReduceAlgorithm,
    ) -> Result<()> {
        self.engine().check_open()?;
        let arguments = if receive.len() != send.len() {
            Err(Error::Mismatch(format!(
                "the receive buffer holds {} elements, the send buffer {}",
                receive.len(),
                send.len()
            )))
        } else {
            Ok(())
        };
        let group = self.group();
        if group.size() == 1 {
            arguments?;
            receive.copy_from_slice(send);
            return Ok(());
        }
        let bytes = std::mem::size_of_val(send);
        let chosen = match algorithm {
            ReduceAlgorithm::Auto if bytes <= REDUCE_FLAG_MAX => Algorithm::FlagWords,
            ReduceAlgorithm::Auto if bytes >= ALLREDUCE_HALVING_MIN => {
                Algorithm::ReduceScatterAllgather
            }
            ReduceAlgorithm::Auto if bytes < ALLREDUCE_TREE_MIN || group.size() == 2 => {
                Algorithm::RecursiveDoubling
            }
            ReduceAlgorithm::Auto => Algorithm::BinaryTree,
            named => Algorithm::of_reduction(named),
        };
        let arguments = arguments.and_then(|()| match chosen {
            Algorithm::FlagWords => check_flag_fit(bytes),
            _ => Ok(()),
        });
        let call = CallRecord {
            op: op_code(&op),
            ..record(Kind::Allreduce, chosen, T::CODE, 0, bytes)
        };
        self.collective_call(call, arguments, || {
            with_scratch(&mut self.engine(), send.len(), |engine, incoming| {
                let mut partial = Partial::new(send, receive);
                match chosen {
                    Algorithm::BinaryTree => {
                        reduce_tree(engine, &group, 0, &mut partial, incoming, op)?;
                        // Rank 0 combined (it has a child); the broadcast
                        // fills every other member's result.
                        broadcast_binomial(engine, &group, 0, bytes_of_mut(partial.result))
                    }
                    _ => allreduce_by(chosen, engine, &group, &mut partial, incoming, op),
                }
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operations_combine_element_by_element() {
        let mut acc = [3i32, -7, 5, -5, i32::MIN];
        let incoming = [-4i32, 6, -5, 5, i32::MAX];
        let mut sum = acc;
        combine(Op::Sum, &mut sum, &incoming);
        for i in 0..acc.len() {
            assert_eq!(sum[i], acc[i].wrapping_add(incoming[i]));
        }
        let mut max_abs = acc;
        combine(Op::MaxAbs, &mut max_abs, &incoming);
        assert_eq!(max_abs, [-4, -7, 5, 5, i32::MIN]);
        let mut min_abs = acc;
        combine(Op::MinAbs, &mut min_abs, &incoming);
        assert_eq!(min_abs, [3, 6, 5, 5, i32::MAX]);
        let mut min = acc;
        combine(Op::Min, &mut min, &incoming);
        let mut max = acc;
        combine(Op::Max, &mut max, &incoming);
        for i in 0..acc.len() {
            assert_eq!(min[i], acc[i].min(incoming[i]));
            assert_eq!(max[i], acc[i].max(incoming[i]));
        }
        let product = |a: &mut [i32], b: &[i32]| a.iter_mut().zip(b).for_each(|(a, b)| *a *= b);
        acc = [2, 3, 4, 5, 6];
        combine(Op::User(&product), &mut acc, &[1, 2, 3, 4, 5]);
        assert_eq!(acc, [2, 6, 12, 20, 30]);
    }

    #[test]
    fn max_and_min_abs_agree_whichever_side_a_tie_comes_from() {
        for (a, b) in [(2.5f64, -2.5f64), (-1.0, 1.0), (0.0, -0.0)] {
            for op in [Op::MaxAbs, Op::MinAbs] {
                let (mut left, mut right) = ([a], [b]);
                combine(op, &mut left, &[b]);
                combine(op, &mut right, &[a]);
                assert_eq!(
                    left[0].to_bits(),
                    right[0].to_bits(),
                    "{op:?} of {a} and {b}"
                );
            }
        }
    }

    #[test]
    fn powers_of_two_below() {
        for n in 1..100u32 {
            let (power, log) = power_of_two_below(n);
            assert_eq!(power, 1 << log);
            assert!(power <= n && n < 2 * power);
        }
    }

    #[test]
    fn a_peers_record_of_the_same_call_decides_what_a_wait_learns() {
        let numbered = |mut record: CallRecord, call| {
            record.call = call;
            record
        };
        let mine = numbered(record(Kind::Allreduce, Algorithm::FlagWords, 1, 0, 256), 7);
        let words = |r: &CallRecord| layout::call_record_words(r);
        let previous = words(&numbered(
            record(Kind::Barrier, Algorithm::Dissemination, 0, 0, 0),
            6,
        ));
        // The same call: nothing to say, in either parity's place.
        assert!(check_member(2, &mine, &[previous, words(&mine)]).is_none());
        assert!(check_member(2, &mine, &[words(&mine), previous]).is_none());
        // Not at this call yet (or never written): nothing to say.
        assert!(check_member(2, &mine, &[previous, [0; 3]]).is_none());
        // The same number, another call: both named.
        let other = numbered(
            record(Kind::Allreduce, Algorithm::RecursiveDoubling, 1, 0, 264),
            7,
        );
        match check_member(2, &mine, &[previous, words(&other)]) {
            Some(Error::Mismatch(why)) => {
                assert!(why.contains("collective call 7"), "{why}");
                assert!(
                    why.contains("264 bytes of f64 by recursive doubling on world rank 2"),
                    "{why}"
                );
                assert!(why.contains("256 bytes of f64 by flag words here"), "{why}");
            }
            other => panic!("{other:?}"),
        }
        for (field, theirs) in [
            ("root", CallRecord { root: 1, ..mine }),
            ("element", CallRecord { element: 3, ..mine }),
            (
                "kind",
                CallRecord {
                    kind: Kind::Reduce as u8,
                    ..mine
                },
            ),
        ] {
            assert!(
                matches!(
                    check_member(2, &mine, &[previous, words(&theirs)]),
                    Some(Error::Mismatch(_))
                ),
                "{field}"
            );
        }
        // Given up or refused there.
        for gave_up in [
            CallRecord {
                failed: true,
                ..mine
            },
            CallRecord {
                refused: true,
                ..mine
            },
        ] {
            assert!(matches!(
                check_member(2, &mine, &[previous, words(&gave_up)]),
                Some(Error::MemberFailed { rank: 2, call: 7 })
            ));
        }
        // An earlier call given up: the peer's collectives stopped there,
        // whether or not it has come to this one. One refused earlier is
        // no matter (every rank refused it, or some member failed in it).
        let earlier = numbered(record(Kind::Barrier, Algorithm::Dissemination, 0, 0, 0), 6);
        let failed_earlier = words(&CallRecord {
            failed: true,
            ..earlier
        });
        let refused_earlier = words(&CallRecord {
            refused: true,
            ..earlier
        });
        assert!(matches!(
            check_member(2, &mine, &[failed_earlier, [0; 3]]),
            Some(Error::MemberFailed { rank: 2, call: 6 })
        ));
        assert!(check_member(2, &mine, &[refused_earlier, [0; 3]]).is_none());
        assert!(check_member(2, &mine, &[refused_earlier, words(&mine)]).is_none());
        // The parities moved on past this call (the peer made two calls
        // that needed no part of this rank's), the kept record still
        // tells it.
        let later = |call| words(&numbered(mine, call));
        for kept in [
            CallRecord {
                refused: true,
                ..mine
            },
            CallRecord {
                failed: true,
                ..mine
            },
        ] {
            assert!(matches!(
                check_member(2, &mine, &[later(9), later(8), words(&kept)]),
                Some(Error::MemberFailed { rank: 2, call: 7 })
            ));
        }
        assert!(check_member(2, &mine, &[later(9), later(8), [0; 3]]).is_none());
        // A split's exchange of colours and a dup's of free contexts of
        // as many bytes are told apart.
        let colours = numbered(exchange_record(Exchange::SplitColors, 9), 7);
        let contexts = numbered(exchange_record(Exchange::FreeContexts, 9), 7);
        assert!(matches!(
            check_member(2, &colours, &[previous, words(&contexts)]),
            Some(Error::Mismatch(_))
        ));
        // A record torn by its owner's rewrite is no record.
        let next = words(&numbered(mine, 9));
        let torn = [next[0], words(&other)[1], words(&other)[2]];
        assert!(check_member(2, &mine, &[previous, torn]).is_none());
    }

    /// Records of a barrier numbered `call`, refused or failed as asked.
    fn barrier_record(call: u64, refused: bool, failed: bool) -> [u64; 3] {
        layout::call_record_words(&CallRecord {
            call,
            refused,
            failed,
            ..record(Kind::Barrier, Algorithm::Dissemination, 0, 0, 0)
        })
    }

    #[test]
    fn a_run_of_refused_calls_tells_a_member_in_any_of_them() {
        let refused = |call| barrier_record(call, true, false);
        let mine = |call| CallRecord {
            call,
            ..record(Kind::Barrier, Algorithm::Dissemination, 0, 0, 0)
        };
        // The peer refused calls 5 to 9 in a row (parities 8 and 9, the
        // first kept): a member in call 7 learns it, though the peer's
        // record of call 7 is gone.
        let run = [refused(8), refused(9), refused(5)];
        for call in 5..=9 {
            assert!(matches!(
                check_member(2, &mine(call), &run),
                Some(Error::MemberFailed { rank: 2, call: c }) if c == call
            ));
        }
        // Not yet at call 10; at call 4, before the run, it took part.
        assert!(check_member(2, &mine(10), &run).is_none());
        assert!(check_member(2, &mine(4), &run).is_none());
        // A new run starting at call 10 after calls 6 to 9 went well, read
        // before its kept record was: the old run's kept call 5 does not
        // join it, so a member in call 9 is not failed.
        let starting = [refused(10), barrier_record(9, false, false), refused(5)];
        assert!(check_member(2, &mine(9), &starting).is_none());
        assert!(matches!(
            check_member(2, &mine(10), &starting),
            Some(Error::MemberFailed { rank: 2, call: 10 })
        ));
        // A run 3 to 6 whose next call failed (a member had taken part):
        // the kept record names the run's first call as given up, which
        // tells a member waiting in any call of the run.
        let failed_after = [
            refused(6),
            barrier_record(7, false, true),
            barrier_record(3, true, true),
        ];
        for call in 3..=7 {
            assert!(matches!(
                check_member(2, &mine(call), &failed_after),
                Some(Error::MemberFailed { rank: 2, .. })
            ));
        }
        // A call after the run that was not refused ended it: its kept
        // record no longer speaks for the calls since.
        let ended = [refused(8), barrier_record(9, false, false), refused(5)];
        assert!(check_member(2, &mine(7), &ended).is_none());
        assert!(matches!(
            check_member(2, &mine(8), &ended),
            Some(Error::MemberFailed { rank: 2, call: 8 })
        ));
    }

    #[test]
    fn a_member_that_gave_up_the_call_making_a_communicator_is_not_in_it() {
        let none = [[0u64; 3]; 3];
        let plain = |call| barrier_record(call, false, false);
        let failed = |call| barrier_record(call, false, true);
        // Made by call 4 on the parent, which the peer gave up (its record
        // of it in either place): not a member.
        for parent in [[failed(4), plain(3), [0; 3]], [plain(3), [0; 3], failed(4)]] {
            assert!(matches!(
                check_origin(1, 4, &none, &parent),
                Some(Error::NotAMember { rank: 1, call: 4 })
            ));
        }
        // It made a call on the communicator, or gave up another call on
        // the parent, or finished call 4: nothing to say.
        let made_a_call = [plain(1), [0; 3], [0; 3]];
        assert!(check_origin(1, 4, &made_a_call, &[failed(4), plain(3), [0; 3]]).is_none());
        assert!(check_origin(1, 4, &none, &[failed(5), plain(4), [0; 3]]).is_none());
        assert!(check_origin(1, 4, &none, &[plain(4), plain(3), [0; 3]]).is_none());
    }

    #[test]
    fn a_member_is_done_with_refused_calls_once_it_refused_them_or_went_past() {
        let plain = |call| barrier_record(call, false, false);
        // Refused call 6 too, or began call 7: done.
        let refused_too = [barrier_record(6, true, false), plain(5), [0; 3]];
        assert!(refusal_passed(3, 6, &refused_too).unwrap());
        assert!(refusal_passed(3, 6, &[plain(6), plain(7), [0; 3]]).unwrap());
        // Took part in call 6 (it may wait in it), or not there yet.
        assert!(!refusal_passed(3, 6, &[plain(6), plain(5), [0; 3]]).unwrap());
        assert!(!refusal_passed(3, 6, &[plain(4), plain(5), [0; 3]]).unwrap());
        assert!(!refusal_passed(3, 6, &[[0; 3]; 3]).unwrap());
        // Gave up call 6, or an earlier one: the call after the refusal
        // fails, naming it.
        for failed_at in [4, 6] {
            let records = [plain(5), barrier_record(failed_at, false, true), [0; 3]];
            assert!(matches!(
                refusal_passed(3, 6, &records),
                Err(Error::MemberFailed { rank: 3, call }) if call == failed_at
            ));
        }
        // One that gave up a later call got past these.
        let later = [barrier_record(8, false, true), plain(7), [0; 3]];
        assert!(refusal_passed(3, 6, &later).unwrap());
    }
}
