//! The link between this device and the devices of the other nodes of the
//! fabric: one thread that owns the UDP socket and the reliable endpoint
//! ([`crate::net`]), carries out this device's requests that name another
//! node (as the initiator) and the requests other nodes send here (as the
//! target).
//!
//! A port's send queue hands a request for another node to the link
//! ([`Link::submit`]) and goes on with its next request: requests to other
//! nodes are in flight together, and their completions come back through
//! the port's inbox ([`crate::inbox::Inbox::deliver_completion`]) in the
//! order they finish. A request with the FENCE flag waits until the pair's
//! earlier requests completed.
//!
//! What each operation guarantees:
//!
//! - WRITE (and WRITE_INLINE): cut into messages of at most one datagram,
//!   each naming its window and offset, written in place at the target as
//!   it arrives, in any order. The write completes once every part was
//!   acknowledged and every answer the target sent before acknowledging
//!   was received (the horizon rule of [`crate::net`]): a refused part
//!   reaches the initiator before the write could complete. Two writes may
//!   complete in either order unless the second is fenced.
//! - READ: one request; the target checks the window, then streams the
//!   bytes in parts the initiator writes in place into its memory; it
//!   completes when every byte arrived. A failure is one error answer.
//! - Atomics: executed exactly once by the device that owns the word (the
//!   endpoint delivers each message at most once and retransmits until
//!   acknowledged), atomic with respect to every initiator and the owner's
//!   CPU; the answer carries the old value.
//!
//! A peer that stops answering for the endpoint's peer timeout, or that
//! restarts, fails every request in flight to it with
//! [`ErrorDetail::NodeUnreachable`](pindown_uapi::ErrorDetail::NodeUnreachable); a restarted peer is served again as
//! soon as it is heard from.

pub mod batch;
mod link;
pub mod message;

pub use link::{
    Link, LinkConfig, LinkStats, Submission, LOCAL_COPY_BYTES_PER_PASS, MAX_DEFERRED,
    MAX_DEFERRED_PER_NODE, MAX_DELEGATED, MAX_FRAMES_QUEUED, MAX_READ_JOBS,
};
