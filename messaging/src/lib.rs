//! # pindown-messaging: message passing on remote writes
//!
//! FMPL's message passing (Tatebe et al.) over the pindown driver's public
//! API: point-to-point messages matched at the *sender*, zero copy, one
//! network round trip, and collectives built on them.
//!
//! * **Sender-side matching.** A message's tag is a slot index. A receive
//!   writes its buffer's window key, offset and capacity into the
//!   sender's exclusive slot for (communicator, receiver, index) with one
//!   remote write; the send finds it there and writes the body straight
//!   into the receive buffer, then the completion word into the receiver's
//!   memory. No queue, no search, no allocation; posting receives early
//!   hides the round trip. Receives of at most 512 bytes take a landing
//!   buffer of the receiver's control memory instead of a window over
//!   their own buffer, and copy the body out (no window bound per small
//!   message).
//! * **The timeout switch.** A blocking send waits for its receive at most
//!   [`Config::send_timeout`], then copies the message into a spool on the
//!   sender and returns; it goes out when the receive appears (progressed
//!   by any later call, or [`Messenger::sendbuf_check`]). Zero: buffered
//!   mode; `None`: synchronous mode.
//! * **Any index** ([`Communicator::recv_any_index`]): a receive from a
//!   named source that takes a send on whatever index finds no receive of
//!   its own.
//! * **Nonblocking** sends and receives own their buffers until
//!   [`SendRequest::wait`] / [`RecvRequest::wait`] give them back (sound
//!   whatever the caller does with the request); FMPL's (peer, index)
//!   naming works too ([`Communicator::wait_recv`]). Persistent requests
//!   ([`Communicator::send_init`]) are FMPL's reusable transfer
//!   descriptors.
//! * **Any source** ([`Communicator::send_any`],
//!   [`Communicator::recv_any`], [`Communicator::irecv_any`],
//!   [`Communicator::probe_any`]): FMPL's
//!   separate domain for receives that name no source, matched at the
//!   receiver (rings of entries each sender fills, credits, rendezvous by
//!   RDMA READ for long messages).
//! * **Communicators**: the world, [`Communicator::dup`] and
//!   [`Communicator::split`]; each has its own slots.
//! * **Collectives** on any communicator: [`Communicator::barrier`],
//!   [`Communicator::broadcast`], [`Communicator::reduce`] and
//!   [`Communicator::allreduce`] ([`Op`]: sum, min, max, FMPL's
//!   max-absolute and min-absolute, user closures; [`Element`] types),
//!   barriers and small reductions on flag words written with one remote
//!   write each, larger data zero copy; each with a `_with` variant that
//!   names the algorithm, the default chosen by size and rank count.
//! * **Active messages** ([`gasnet`]): GASNet's short, medium and long
//!   messages with handlers and replies on per-pair rings with credit flow
//!   control, put/get (native or by message), strided, vector and indexed
//!   transfers, independent of the [`Messenger`].
//!
//! ```no_run
//! use pindown_driver::launch::{device_socket, Job};
//! use pindown_driver::verbs::Context;
//! use pindown_messaging::{Config, Messenger};
//!
//! let mut job = Job::from_environment()?;                       // mpiexec, mpirun, ...
//! let context = Context::open(device_socket(&job)?, pindown_messaging::context_config())?;
//! let messenger = Messenger::new(&context, &mut job, Config::default())?;
//! let world = messenger.world();
//! let mut buffer = vec![0u8; 8];
//! if world.rank() == 0 {
//!     world.send(1, 0, b"ping....")?;                            // slot (tag) 0
//!     world.recv(1, 0, &mut buffer)?;
//! } else if world.rank() == 1 {
//!     world.recv(0, 0, &mut buffer)?;
//!     world.send(0, 0, &buffer)?;
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod collective;
mod comm;
mod engine;
mod error;
pub mod gasnet;
pub mod global_memory;
pub mod layout;
mod liveness;
mod records;
mod typed;
mod windows;

pub use collective::{
    BarrierAlgorithm, BroadcastAlgorithm, Element, Op, ReduceAlgorithm, ALLREDUCE_HALVING_MIN,
    ALLREDUCE_TREE_MIN, BROADCAST_PIPELINE_MIN, PIPELINE_CHUNK_BYTES, REDUCE_FLAG_MAX,
};
pub use comm::{
    Communicator, Messenger, PersistentRecv, PersistentSend, RecvRequest, SendRequest, SpoolStatus,
    WindowCacheCounts,
};
pub use engine::{Config, Received, MAX_COMMUNICATORS, MAX_SLOTS};

use pindown_driver::verbs::{ContextConfig, Monitor};

/// The driver settings message passing needs: the pin-down cache's unmap
/// monitor required (the driver's default runs it only where userfaultfd
/// allows), so that buffers a program frees and allocates again at the
/// same address (what `malloc` does with large buffers) are registered
/// anew instead of reaching the old pages. Open the context with it (or
/// set `cache.monitor` yourself, or route `munmap` through
/// `pindown_pincache::unmap`).
pub fn context_config() -> ContextConfig {
    let mut config = ContextConfig::default();
    config.cache.monitor = Monitor::Required;
    // Collectives on many ranks hold several buffers of each call pinned
    // at once (sends, receive windows, pipeline chunks): 1 GiB of pinned
    // memory rather than the driver's default, which an 8-rank broadcast
    // of 4 MiB exhausted.
    config.cache.max_pinned_bytes = Some(1 << 30);
    config
}
pub use error::{Error, Result};

mod any_source;
pub use any_source::{AnyBacklog, AnyReceived, AnyRecvRequest, AnyStatus};
