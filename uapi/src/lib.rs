//! # uapi: the pindown device ABI
//!
//! Everything that crosses between the driver and the emulated NIC, and
//! nothing else: which rings carry what, the 64-byte work request, the
//! 32-byte completion, opcodes, status codes, remote keys, window access
//! rights, device information and the ABI version, and the rule by which
//! a thread polling a ring gives its core to the other side
//! ([`core_sharing`], with the calls its tests use to put threads on
//! CPUs). Both sides depend on this crate; neither restates
//! it.
//!
//! Encoding is explicit little-endian at fixed offsets. Every `decode`
//! validates every field and returns a [`DecodeError`] for anything it does
//! not understand; no input makes it panic.
//!
//! ## Rings
//!
//! The device is a virtio-net device. Queue pairs `0..P` carry Ethernet
//! (receive ring `2i`, transmit ring `2i+1`); `P` is what `GET_QUEUE_NUM`
//! reports to a host frontend. `R` RDMA queue pairs follow (see
//! [`RingLayout`]); pair `q` has two rings, set up like virtio rings but
//! laid out as [`queue`] says, not as split virtqueues:
//!
//! * its **send queue** (ring `2P+2q`): slots of one [`WorkRequest`]
//!   ([`WorkRequest::SIZE`] bytes) each, stamped with their position, which
//!   the device polls; small writes carry their bytes inline.
//! * its **completion queue** (ring `2P+2q+1`): slots of one [`Completion`]
//!   ([`Completion::SIZE`] bytes) each, which the device writes in place,
//!   stamped, for every signalled request of the pair and for every request
//!   that fails, in execution order; the driver polls them.
//!
//! The device executes each send queue in order, and the pairs
//! independently of each other. Pair 0 is the admin pair
//! ([`ADMIN_QUEUE_PAIR`]), where a driver runs its own requests (QUERY,
//! BIND_WINDOW, REVOKE_WINDOW); the others are I/O pairs. QUERY reports `R`
//! ([`DeviceInfo::rdma_queue_pairs`]). A QEMU frontend (a guest driving the
//! RDMA rings through VFIO) is told of `P + R` pairs by `GET_QUEUE_NUM`,
//! since QEMU forwards only the rings of the pairs it knows.
//!
//! ## Addresses
//!
//! A *local* address is an I/O virtual address of the initiator's own
//! memory, translated by the device through the initiator port's IOTLB (what
//! the driver registered). A *remote* address is a [`RemoteAddress`]: the
//! target port, a [`RemoteKey`] naming a live window the target bound, and an
//! offset inside that window. Anything outside a registered range or a live
//! window fails with an error completion, and no memory is touched.
//!
//! ## Windows and keys
//!
//! BIND_WINDOW grants part of the initiator's registered memory to peers,
//! either to any port that holds the key (an open window) or to one port
//! only ([`WindowFlags::PEER`], as a type-2 memory window is bound to one
//! queue pair). Keys are 64 bits no one but the device can predict, never
//! reused while the device runs. A remote access that no live window grants
//! (unknown or revoked key, wrong port, outside the window, missing right)
//! always completes with [`Status::RemoteAccessError`] and
//! [`ErrorDetail::NotGranted`], so that answers reveal nothing about which
//! keys exist. A device bounds the windows of a port; beyond the bound,
//! BIND_WINDOW completes with [`Status::LimitReached`] and
//! [`ErrorDetail::WindowLimit`].
//!
//! ## Borrowed facts
//!
//! Two things both sides need are not ours: the virtio feature bits
//! ([`features`], masks of `virtio-bindings`' bit numbers) and the
//! vhost-user IOTLB message ([`IotlbMessage`], with `vhost`'s type and
//! permission values). They are stated here once so that neither side
//! restates them.
//!
//! ## Room to grow
//!
//! Opcode ranges are reserved for more vector transfers
//! ([`Opcode::VECTOR_RANGE`] past VECTOR_READ), the third-party copies and
//! atomics of ACP ([`Opcode::THIRD_PARTY_RANGE`]) and messaging
//! ([`Opcode::MESSAGING_RANGE`]).

#![warn(missing_docs)]

mod completion;
pub mod core_sharing;
mod error;
pub mod features;
mod iotlb;
mod keys;
mod layout;
pub mod pattern;
pub mod queue;
mod request;

pub use completion::{Arrival, Completion, CompletionError, ErrorDetail, Status};
pub use error::DecodeError;
pub use iotlb::{IotlbMessage, VhostAccess, VhostIotlbType};
pub use keys::{Access, NodeId, PortAddress, RemoteAddress, RemoteKey, MAX_REMOTE_OFFSET};
pub use layout::{
    rdma_features, DeviceInfo, RdmaRing, RingLayout, ABI_VERSION, ADMIN_QUEUE_PAIR,
    MAX_RDMA_QUEUE_PAIRS, RDMA_FEATURES,
};
pub use request::{
    vector_inline_slots, AtomicOp, AtomicWidth, Bitwise, Descriptor, Opcode, Operation,
    VectorFlags, VectorTransfer, WindowFlags, WorkRequest, WrFlags, ATOMIC_TO_FOUR,
};
