//! The verbs API: what a messaging library programs against.
//!
//! The vocabulary is rdma-core's: a [`Context`] is an open port of the device;
//! a [`MemoryRegion`] is registered memory (through the pin-down cache, so a
//! region registered again is a cache hit); a [`MemoryWindow`] grants peers
//! remote access to part of a registered region and can be revoked; the
//! context's queue pair posts work requests built with [`opcode`] and its
//! completion queue reports them.
//!
//! Posting never blocks: [`Context::post`] writes a batch of requests into
//! the send queue's slots, which the device polls, and rings the doorbell
//! once, only if the device asked for it before it went to sleep.
//! [`Context::poll`] reads completions the device wrote in place without
//! blocking; [`Context::wait`] polls for [`ContextConfig::spin`] and then
//! sleeps on the completion queue's eventfd. While both sides poll, a
//! request makes no system call. Small writes from the arena can travel
//! inside the send queue ([`Entry::inline`]).
//!
//! **Windows.** A window's [`RemoteKey`](pindown_uapi::RemoteKey) is 64 bits no one but the device can
//! predict, never reused while the device runs. A remote access that no live
//! window grants (unknown or revoked key, a window bound to another port,
//! outside the window, a missing right) completes with
//! [`Status::RemoteAccessError`](pindown_uapi::Status) and
//! [`ErrorDetail::NotGranted`](pindown_uapi::ErrorDetail), whatever the cause; the
//! device counts the causes for the window's owner. A port holds a bounded
//! number of windows: beyond it, binding fails with
//! [`VerbsError::Refused`] carrying `LimitReached`/`WindowLimit`.
//!
//! **Memory.** The device reaches only the context's DMA arena (the memory
//! table it was given). Buffers come from [`Context::alloc`]; registering
//! memory outside the arena fails with [`VerbsError::NotInArena`] (no bounce
//! buffer is used: every transfer is zero-copy). A request naming local memory
//! that is not registered completes with
//! [`Status::LocalProtectionError`](pindown_uapi::Status).

mod completion;
mod context;
mod memory;
pub mod opcode;
mod queue_pair;
mod window;

use std::time::Duration;

use pindown_pincache::CacheError;
use pindown_uapi::{Completion, DecodeError};

use crate::arena::ArenaError;
use crate::transport::TransportError;
use crate::virtqueue::QueueError;

pub use context::{Context, ContextConfig};
pub use memory::{Local, MemoryRegion};
pub use opcode::Entry;
pub use window::{BadWindowText, MemoryWindow, RemoteWindow};

/// `user_data` bit reserved for the driver's own requests.
const INTERNAL: u64 = 1 << 63;

/// Why a verbs call failed.
#[derive(Debug, thiserror::Error)]
pub enum VerbsError {
    /// Talking to the device failed (it may be gone).
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// The DMA arena could not serve the allocation.
    #[error(transparent)]
    Arena(#[from] ArenaError),
    /// A ring is broken (the device wrote something impossible).
    #[error(transparent)]
    Queue(#[from] QueueError),
    /// The pin-down cache could not register the memory.
    #[error(transparent)]
    Registration(#[from] CacheError),
    /// The send queue has fewer free slots than the batch needs (one per
    /// request, more for inline bytes); nothing was posted. Wait for
    /// completions and post again.
    #[error("send queue full: {free} slots free, the batch needs {wanted}")]
    QueueFull {
        /// Free slots.
        free: usize,
        /// Slots the batch needs.
        wanted: usize,
    },
    /// Memory outside the DMA arena cannot be reached by the device.
    #[error("[{addr:#x}, +{len}) is outside the DMA arena; allocate buffers with Context::alloc")]
    NotInArena {
        /// Start of the range.
        addr: u64,
        /// Length.
        len: u64,
    },
    /// A range beyond the end of the memory region it was taken from.
    #[error("[{offset}, +{len}) is outside the {region_len}-byte memory region")]
    OutOfRegion {
        /// Offset asked for.
        offset: u64,
        /// Length asked for.
        len: u64,
        /// The region's length.
        region_len: u64,
    },
    /// `user_data` with bit 63 set is reserved for the driver.
    #[error("user_data {0:#x} has bit 63 set, which the driver reserves")]
    ReservedUserData(u64),
    /// The device wrote a completion that does not decode.
    #[error("the device wrote an invalid completion: {0}")]
    BadCompletion(DecodeError),
    /// The device speaks another ABI version.
    #[error("device ABI version {device}, driver ABI version {driver}")]
    AbiMismatch {
        /// The device's version.
        device: u16,
        /// Ours.
        driver: u16,
    },
    /// A request the driver made on the caller's behalf failed.
    #[error("the device refused the request: {} ({})", .0.status, .0.detail)]
    Refused(Completion),
    /// No completion arrived in time.
    #[error("no completion within {0:?}")]
    Timeout(Duration),
    /// Waiting on the completion eventfd failed.
    #[error("waiting for completions failed: {0}")]
    Wait(std::io::Error),
}
