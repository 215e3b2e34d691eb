//! The RDMA engine: executes work requests between ports.
//!
//! The engine sees ports only through two seams: [`MemoryAccess`], which turns
//! a port's I/O virtual addresses into spans of memory mapped in this process
//! (through that port's IOTLB, with its permissions), and [`Fabric`], which
//! finds a target port and its window table. Everything a request names is
//! checked before a byte moves: the local range against the initiator's
//! registrations, the remote range against a live window (key, peer,
//! rights, bounds) and then the target's registrations. A request that
//! fails any check completes with an error and touches no memory; every
//! refused remote access gets the same answer, and the target's owner
//! counts the cause ([`RefusalCounters`]).
//!
//! Data moves with one copy between the two mappings (the zero-copy path:
//! neither side copies through a buffer of its own). Atomics are atomic
//! read-modify-writes on the shared mapping, so they are coherent with the
//! CPU atomics of the memory's owner.

mod execute;
pub mod remote;
pub mod vector;
mod windows;

// This file holds the seams: spans, `MemoryAccess`, `Target` and
// `Fabric`; `execute` runs one request through them, `windows` holds the
// windows, their keys and the refusal counters.

pub use execute::{execute, Progress, Turn, NOT_GRANTED, STEPS_PER_TURN, STEP_BYTES};
pub use vector::{
    VectorLimits, VectorState, DEFAULT_MAX_DESCRIPTOR_BYTES, DEFAULT_MAX_PATTERN_BLOCKS,
};
pub use windows::{
    init_keys, PortId, Refusal, RefusalCounters, Window, WindowLimit, WindowTable,
    DEFAULT_MAX_WINDOWS_PER_PORT,
};

use pindown_uapi::{Completion, ErrorDetail, Status};
use smallvec::SmallVec;

/// A contiguous piece of a port's memory, mapped in this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    /// First byte, in this process's address space.
    pub addr: *mut u8,
    /// Length in bytes.
    pub len: usize,
}

/// The spans backing one I/O virtual address range; rarely more than a few.
pub type Spans = SmallVec<[Span; 4]>;

/// Why a port's address range cannot be used.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AccessFault {
    /// Part of the range is not registered (not in the memory table, or
    /// no IOTLB entry that the frontend will give when asked).
    #[error("address range not registered")]
    Unmapped,
    /// Part of the range has no IOTLB entry yet, starting at `iova`: the
    /// frontend was asked for it and may map it.
    #[error("IOTLB miss at {iova:#x}")]
    Miss {
        /// First address without an entry.
        iova: u64,
    },
    /// The range is registered without the needed permission.
    #[error("registered without {0} permission")]
    Permission(&'static str),
}

/// A port's memory as the engine sees it.
pub trait MemoryAccess {
    /// Appends to `out` the spans backing `[iova, iova + len)`, readable (and
    /// writable when `write`). Fails without appending when any byte is not
    /// registered with that permission.
    fn spans(&self, iova: u64, len: u64, write: bool, out: &mut Spans) -> Result<(), AccessFault>;

    /// Whether the owner took pages of this memory away under the device
    /// (a file of its memory table shrank; the pages now read as zeros and
    /// writes to them go nowhere). A step that touched such memory moved
    /// meaningless bytes and must not complete as a success.
    fn lost(&self) -> bool;
}

/// A port a request reaches, borrowed for one guarded step (the lender
/// holds the port's access gate, so nothing the step checked can change
/// before it ends).
#[derive(Clone, Copy)]
pub struct Target<'a> {
    /// The port's memory.
    pub memory: &'a dyn MemoryAccess,
    /// The port's windows.
    pub windows: &'a WindowTable,
    /// Remote accesses to the port's windows refused, by cause (the
    /// owner's counters: the initiator is only told "not granted").
    pub refusals: &'a RefusalCounters,
    /// The port's current incarnation (see [`PortId`]).
    pub incarnation: u64,
    /// The node the port belongs to (this device's node).
    pub node: pindown_uapi::NodeId,
}

/// Where a port's arrival notices go (its inbox), as the engine sees it.
pub trait NoticeQueue: Send + Sync {
    /// Queues a promised notice.
    fn deliver(&self, notice: Completion);
    /// Gives back a promise unused.
    fn release(&self);
}

/// Room promised for one arrival notice in a target port's queue: used by
/// [`deliver`](NoticeSlot::deliver), given back when dropped unused (the
/// transfer failed or was dropped).
pub struct NoticeSlot {
    queue: std::sync::Arc<dyn NoticeQueue>,
    used: bool,
}

impl NoticeSlot {
    /// A promise of `queue`'s, made already.
    pub fn new(queue: std::sync::Arc<dyn NoticeQueue>) -> Self {
        NoticeSlot { queue, used: false }
    }

    /// Queues `notice` in the promised room.
    pub fn deliver(mut self, notice: Completion) {
        self.used = true;
        self.queue.deliver(notice);
    }
}

impl Drop for NoticeSlot {
    fn drop(&mut self) {
        if !self.used {
            self.queue.release();
        }
    }
}

impl std::fmt::Debug for NoticeSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NoticeSlot")
            .field("used", &self.used)
            .finish()
    }
}

/// Why a request failed: status and detail of its error completion.
pub type Failure = (Status, ErrorDetail);

/// The result of running a request against a target port.
pub type Outcome = Result<Completion, Failure>;

/// The ports of the device, as the engine reaches them.
pub trait Fabric {
    /// Runs one guarded step on ports `initiator` and `target` (the same
    /// port or two): lends both, holding whatever keeps their memory and
    /// windows from changing until `step` returns, or says why the target
    /// cannot be reached: [`ErrorDetail::UnknownPort`] or
    /// [`ErrorDetail::PortDown`].
    fn step(
        &self,
        initiator: u16,
        target: u16,
        step: &mut dyn FnMut(Target<'_>, Target<'_>) -> Outcome,
    ) -> Result<Outcome, ErrorDetail>;

    /// What the device accepts of one vector transfer.
    fn vector_limits(&self) -> VectorLimits {
        VectorLimits::default()
    }

    /// Promises room for one arrival notice in port `port`'s queue, or
    /// `None` when it has none (or the port is unknown or down).
    fn reserve_notice(&self, port: u16) -> Option<NoticeSlot> {
        let _ = port;
        None
    }

    /// The current incarnation of port `port` (see [`PortId`]); a port
    /// that does not exist yet will start at 0.
    fn incarnation(&self, port: u16) -> u64;

    /// Runs `change` on port `port` once no step on it is in flight,
    /// holding new steps off until it returns: a barrier.
    fn exclusive(
        &self,
        port: u16,
        change: &mut dyn FnMut(Target<'_>) -> Outcome,
    ) -> Result<Outcome, ErrorDetail>;
}

#[cfg(test)]
mod tests;
