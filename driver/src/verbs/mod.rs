//! The verbs API: what a messaging library programs against.
//!
//! The vocabulary is rdma-core's. A [`Context`] is an open port of the
//! device: its DMA arena, its pin-down cache and its registrations. A
//! [`MemoryRegion`] is registered memory (through the pin-down cache, so a
//! region registered again is a cache hit); a [`MemoryWindow`] grants peers
//! remote access to part of a registered region until it is revoked. A
//! [`QueuePair`] posts work requests built with [`opcode`]; their
//! completions arrive on the [`CompletionQueue`] the queue pair was created
//! with.
//!
//! ```no_run
//! use std::time::Duration;
//! use pindown_driver::verbs::opcode::Write;
//! use pindown_driver::verbs::{Context, ContextConfig, RemoteWindow};
//!
//! let context = Context::open("/run/pindown/port0.sock", ContextConfig::default())?;
//! let buffer = context.alloc(4096, 64)?;
//! buffer.write_at(0, b"hello");
//! let region = context.register_buffer(&buffer)?;
//! let mut cq = context.create_completion_queue();
//! let mut qp = context.create_queue_pair(&mut cq)?;
//! let peer: RemoteWindow = "0:1:5f3c0a1d9e2b4c68:4096".parse()?; // from the peer
//! qp.post(&[Write::new(region.local(0, 5)?, peer.at(0)).build().user_data(1).signaled()])?;
//! for completion in cq.wait(Duration::from_secs(1))? {
//!     let value = completion.result()?; // Err names the request, the status and the detail
//!     println!("request {} done: {value}", completion.user_data);
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! **Queue pairs and completion queues.** A port has several RDMA queue
//! pairs in the device (see [`pindown_uapi::RingLayout`]): the admin pair,
//! where the context runs its own requests (query, window bind and revoke),
//! and I/O pairs, one per [`QueuePair`]. A queue pair owns its send ring and
//! posts without a lock ([`QueuePair::post`] takes `&mut self`); give each
//! thread or communicator its own. A [`CompletionQueue`] owns the completion
//! rings of the queue pairs created with it, so several queue pairs may
//! share one, and polling it takes no lock either. Queue pairs and
//! completion queues borrow their context and share its registrations and
//! windows. The number of queue pairs a context can hold at once is the
//! device's count of I/O pairs per port (`pindown-emu-device
//! --rdma-queue-pairs`, less the admin pair); a dropped queue pair's rings
//! go back to the context and serve the next one.
//!
//! **Posting and polling.** [`QueuePair::post`] writes a batch of requests
//! into the send queue's slots, which the device polls, and rings the
//! doorbell once, only if the device asked for it before it went to sleep
//! (see [`pindown_uapi::queue`]). Small writes from the arena can travel
//! inside the send queue ([`Entry::inline`]). [`CompletionQueue::poll`]
//! reads the completions the device wrote in place, without blocking, and
//! yields them as an iterator (completions the iterator does not reach stay
//! queued); [`CompletionQueue::poll_into`] appends them to a `Vec`;
//! [`CompletionQueue::wait`] polls for [`ContextConfig::spin`] after
//! activity and then asks for a signal and sleeps on the completion rings'
//! eventfds. While both sides poll, no system call lies in a request's
//! path (a polling thread that shares its core yields between polls:
//! [`pindown_uapi::core_sharing`]). A completion carries the request's
//! `user_data`;
//! [`Completion::result`](pindown_uapi::Completion::result) turns its
//! status into a `Result`.
//!
//! **Vector transfers.** [`opcode::Vector`] moves bytes between a local
//! [`Pattern`](pindown_uapi::pattern::Pattern) and a remote one in one
//! request (VECTOR_WRITE, VECTOR_READ; DIMMnet-2's remote vector access):
//! strided nests, block lists, pieces repeated with an extent. The driver
//! checks the local pattern against its [`Local`] range and both
//! patterns' lengths when it builds the request; the descriptor travels
//! inline when it fits, else in memory the queue pair keeps until the
//! device has finished. With [`opcode::Vector::notify`], the target's
//! context learns of a write that landed from its own admin completion
//! queue ([`Context::arrivals`], [`Context::wait_arrivals`]): the writer's
//! port, the window's key, the bytes and an immediate value.
//!
//! **Lifetimes.** A [`Local`] range borrows the [`MemoryRegion`] it was
//! taken from, and a request built from it borrows it too, so a request
//! naming memory whose registration is gone cannot be built or posted in
//! safe code. A [`MemoryWindow`] borrows its region: the region cannot be
//! deregistered while the window is bound. [`MemoryRegion::deregister`] and
//! [`MemoryWindow::revoke`] are explicit and report errors; dropping a
//! region deregisters it and dropping a window revokes it (a failure is
//! logged and counted, see [`Context::window_revoke_failures`]). A request
//! already posted when its region is deregistered still finishes normally
//! while the pin-down cache keeps the pages registered, or completes with
//! [`Status::LocalProtectionError`](pindown_uapi::Status) once they are
//! unregistered. Either way its memory stays allocated: the region, its
//! windows and its posted requests each hold a share of the memory (see
//! [`MemoryRegion`]'s module), released when the device is done with it,
//! so dropping a buffer, or leaking a window with `mem::forget`, never
//! lets the device write into memory handed to someone else. Only the
//! `unsafe` forms ([`Context::register`], [`Context::register_bytes`],
//! [`Local::from_raw`]) leave that to the caller.
//!
//! **Protection.** A context is one protection domain: every queue pair of
//! a context reaches every region registered through it, and nothing of
//! another context. To keep two users' memory apart, give each its own
//! context (its own port).
//!
//! **Windows.** A window's [`RemoteKey`](pindown_uapi::RemoteKey) is 64
//! bits no one but the device can predict, never reused while the device
//! runs. A remote access that no live window grants (unknown or revoked
//! key, a window bound to another port, outside the window, a missing
//! right) completes with
//! [`Status::RemoteAccessError`](pindown_uapi::Status) and
//! [`ErrorDetail::NotGranted`](pindown_uapi::ErrorDetail), whatever the
//! cause; the device counts the causes for the window's owner. A port holds
//! a bounded number of windows: beyond it, binding fails with
//! [`VerbsError::Refused`] carrying `LimitReached`/`WindowLimit`.
//!
//! **Memory.** Any memory this process maps can be registered, zero copy:
//! buffers of the DMA arena ([`Context::alloc`]), a heap `Vec`, a stack
//! array, memory a C library allocated, anonymous and file mappings. The
//! first registration of private memory moves its pages into memory shared
//! with the device at the same address; shared mappings of memory file
//! systems are handed to the device as files (see [`crate::reach`]).
//! Read-only memory registers read-only: binding a window that writes to
//! it fails with [`VerbsError::ReadOnlyMemory`]. Holes, disk files mapped
//! `MAP_SHARED` and memory without access fail with
//! [`VerbsError::Unreachable`]. A request naming local memory that is not
//! registered completes with
//! [`Status::LocalProtectionError`](pindown_uapi::Status).
//!
//! **Timeouts.** The context's own requests (query, bind, revoke, and
//! handing a queue pair's rings to a new queue pair) wait at most
//! [`ContextConfig::control_timeout`] for the device, then fail with
//! [`VerbsError::ControlTimeout`]; a device that closes its connection
//! fails them at once with [`VerbsError::DeviceGone`].

mod completion;
mod context;
mod memory;
pub mod opcode;
mod pairs;
mod queue_pair;
mod wait;
mod window;

use std::time::Duration;

use pindown_pincache::CacheError;
use pindown_uapi::{CompletionError, DecodeError, Opcode};

use crate::arena::ArenaError;
use crate::reach::ReachError;
use crate::transport::TransportError;
use crate::virtqueue::QueueError;

pub use completion::{CompletionQueue, Completions};
pub use context::{Context, ContextConfig};
pub(crate) use memory::KeepAlive;
pub use memory::{Local, MemoryRegion};
pub use opcode::Entry;
/// The pin-down cache's settings ([`ContextConfig::cache`]).
pub use pindown_pincache::{CacheConfig, Monitor, Policy};
pub use pindown_uapi::Completion;
pub use queue_pair::QueuePair;
pub use window::{BadWindowText, MemoryWindow, RegionWindow, RemoteWindow};

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
    /// Every I/O queue pair of the port is held by a live queue pair (or
    /// its rings still belong to a live completion queue).
    #[error(
        "all {pairs} I/O queue pairs of the port are in use; drop a queue pair (and, \
         if it shared one, its completion queue) or start the device with more \
         --rdma-queue-pairs"
    )]
    NoQueuePair {
        /// I/O queue pairs the context can use.
        pairs: u16,
    },
    /// An object of another context was passed (a completion queue or a
    /// memory region); each context has its own rings and registrations.
    #[error("the {what} belongs to another context")]
    OtherContext {
        /// What was passed.
        what: &'static str,
    },
    /// The memory cannot be made reachable by the device (a hole, a disk
    /// file mapped `MAP_SHARED`, memory without access, ...).
    #[error(transparent)]
    Unreachable(#[from] ReachError),
    /// A window of no bytes, or granting no right: it would grant nothing,
    /// and the device refuses to bind one.
    #[error("a window must cover at least one byte and grant at least one right: {len} bytes, rights {access:?} asked")]
    EmptyWindow {
        /// Its length.
        len: u64,
        /// Its rights.
        access: pindown_uapi::Access,
    },
    /// A window granting writes or atomics over memory that is registered
    /// read-only (mapped without `PROT_WRITE`).
    #[error(
        "[{addr:#x}, +{len}) is read-only memory: windows over it may grant remote reads only \
         (atomics and writes need memory mapped writable)"
    )]
    ReadOnlyMemory {
        /// Start of the window.
        addr: u64,
        /// Its length.
        len: u64,
    },
    /// A vector transfer's patterns do not cover the same bytes (or more
    /// than a request's 32-bit length).
    #[error("the local pattern covers {local} bytes, the remote one {remote}: they must be equal and fit 32 bits")]
    VectorLengths {
        /// Bytes of the local pattern.
        local: u64,
        /// Bytes of the remote pattern.
        remote: u64,
    },
    /// A safe vector builder was given a local pattern whose block list
    /// lies in memory.
    #[error(
        "the local pattern's block list lies in memory, where its blocks cannot be checked against \
         the local range before the request is posted: give the blocks inline, or use the unsafe \
         Vector::with_local_list_in_memory"
    )]
    LocalListInMemory,
    /// A vector transfer's pattern is not valid.
    #[error("invalid access pattern: {0}")]
    Pattern(#[from] pindown_uapi::pattern::PatternError),
    /// A datatype of a typed vector transfer could not be compiled.
    #[error("datatype: {0}")]
    Datatype(#[from] crate::datatype::DatatypeError),
    /// A range beyond the end of the memory region it was taken from (for
    /// a vector transfer: the local pattern's hull beyond its range).
    #[error("[{offset}, +{len}) is outside the {region_len}-byte memory region")]
    OutOfRegion {
        /// Offset asked for.
        offset: u64,
        /// Length asked for.
        len: u64,
        /// The region's length.
        region_len: u64,
    },
    /// Deregistration removed device translations, and the device could
    /// not be told (it is gone): it can no longer reach the memory in any
    /// case, but the port is unusable.
    #[error("deregistration: {failures} IOTLB invalidations could not be delivered (the device is gone)")]
    Deregistration {
        /// Invalidations that failed.
        failures: u64,
    },
    /// The device wrote a completion that does not decode, or one whose
    /// value is impossible for its request.
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
    #[error("the device refused the request: {0}")]
    Refused(CompletionError),
    /// A request the driver made on the caller's behalf (or the hand-over
    /// of a queue pair's rings) got no completion within
    /// [`ContextConfig::control_timeout`].
    #[error("no completion of {} within {timeout:?} (ContextConfig::control_timeout)", operation.name())]
    ControlTimeout {
        /// The request.
        operation: Opcode,
        /// How long it waited.
        timeout: Duration,
    },
    /// The device closed its connection (its process is gone) while a
    /// request the driver made on the caller's behalf waited for its
    /// answer.
    #[error("the device closed its connection while {} waited for its answer", operation.name())]
    DeviceGone {
        /// The request.
        operation: Opcode,
    },
    /// No completion arrived in time.
    #[error("no completion within {0:?}")]
    Timeout(Duration),
    /// The device closed its connection (its process is gone) while
    /// [`CompletionQueue::wait`] or [`Context::wait_arrivals`] waited.
    #[error("the device closed its connection")]
    HungUp,
    /// Waiting on the completion eventfd failed.
    #[error("waiting for completions failed: {0}")]
    Wait(std::io::Error),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::VhostUserTransport;

    fn send<T: Send>() {}
    fn sync<T: Sync>() {}

    /// A context is shared between threads; queue pairs, completion
    /// queues and windows move to the thread that uses them.
    #[test]
    fn threads_can_share_a_context_and_take_queue_pairs_along() {
        sync::<Context<VhostUserTransport>>();
        send::<QueuePair<'static, VhostUserTransport>>();
        send::<CompletionQueue<'static, VhostUserTransport>>();
        send::<MemoryWindow<'static, VhostUserTransport>>();
        send::<Entry<'static>>();
        send::<VerbsError>();
    }

    /// A local pattern whose block list lies in memory cannot be checked
    /// against the local range, so the safe builders refuse it; a remote
    /// one is checked by the device against the window, and is taken.
    #[test]
    fn safe_vector_builders_refuse_a_local_block_list_in_memory() {
        use pindown_uapi::pattern::Pattern;
        use pindown_uapi::{RemoteAddress, RemoteKey};
        let listed = Pattern::listed_in_memory(0x10_0000, 8, 64);
        // SAFETY: a range for a request that is built and never posted.
        let local = unsafe { Local::from_raw(0x20_0000, 64) };
        let remote = RemoteAddress {
            node: 0,
            port: 1,
            key: RemoteKey::try_from(7).unwrap(),
            offset: 0,
        };
        let contiguous = Pattern::contiguous(64);
        for read in [false, true] {
            let built = if read {
                opcode::Vector::read(local, listed.clone(), remote, contiguous.clone())
            } else {
                opcode::Vector::write(local, listed.clone(), remote, contiguous.clone())
            };
            assert!(
                matches!(built, Err(VerbsError::LocalListInMemory)),
                "read {read}: {built:?}"
            );
            let remote_listed = if read {
                opcode::Vector::read(local, contiguous.clone(), remote, listed.clone())
            } else {
                opcode::Vector::write(local, contiguous.clone(), remote, listed.clone())
            };
            assert!(remote_listed.is_ok(), "read {read}: {remote_listed:?}");
            // SAFETY: as above: never posted.
            let vouched = unsafe {
                opcode::Vector::with_local_list_in_memory(
                    local,
                    listed.clone(),
                    remote,
                    contiguous.clone(),
                    read,
                )
            };
            assert!(vouched.is_ok(), "read {read}: {vouched:?}");
        }
    }
}
