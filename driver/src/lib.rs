//! # pindown-driver: the userspace driver of the pindown NIC
//!
//! The driver reaches an emulated RDMA-capable virtio-net device that lives in
//! another process (or behind QEMU), and moves data by DMA to and from its own
//! memory without kernel involvement on the data path. It is built in layers,
//! each knowing only the one below:
//!
//! * **Memory** — [`arena`]: the DMA arena, a memfd-backed region shared with
//!   the device, with an allocator for vrings, user buffers and bounce
//!   buffers. IOVAs are identity: the device address of a byte is its virtual
//!   address here. [`pinner`]: registration of memory for DMA through the
//!   `pincache` pin-down cache: mlock plus a device IOTLB entry.
//!   [`reach`]: any mapped memory of the process made reachable by the
//!   device (private pages moved into shared memory at the same address,
//!   shared memory-file-system mappings handed over as files).
//! * **Queues** — [`rdma_queue`]: the driver side of the RDMA send and
//!   completion queues ([`pindown_uapi::queue`]): stamped request slots the
//!   device polls, completions the device writes in place and the driver
//!   polls, doorbells and signals only when the other side asked before
//!   sleeping. [`virtqueue`]: the driver side of split virtqueues (virtio
//!   1.x, with `VIRTIO_F_EVENT_IDX`), for the control queue of a guest's
//!   NIC. Both are pure shared-memory logic in arena memory, no system
//!   calls.
//! * **Transport** — [`transport`]: how the device is reached and configured:
//!   feature negotiation, the memory table, queue addresses, doorbells,
//!   completion eventfds and IOTLB entries, behind the [`Transport`] trait.
//!   [`VhostUserTransport`] is the embedded vhost-user frontend used on the
//!   host; [`vfio::VfioTransport`], the VFIO virtio-pci transport for use
//!   inside a QEMU guest, implements the same trait.
//!
//! [`launch`] is the bootstrap every rank calls first: it joins the job an
//! existing launcher (Hydra, Open MPI's `mpirun`, Slurm) started and
//! exchanges device addresses through the launcher's key-value space.
//!
//! [`datatype`] builds MPI derived datatypes and compiles them to the
//! device's access patterns for vector transfers, with a descriptor cache.
//!
//! The [`verbs`] API is built on these layers and never names a concrete
//! transport: a context (an open port and its registrations, one protection
//! domain), memory regions registered through the pin-down cache, memory
//! windows, queue pairs (one per thread or communicator, posting without a
//! lock) and completion queues (iterators over completions; one may serve
//! several queue pairs).
//!
//! ```no_run
//! use pindown_driver::rdma_queue::{CompletionQueue, SendQueue};
//! use pindown_driver::transport::DEFAULT_FEATURES;
//! use pindown_driver::{DmaArena, Transport, VhostUserConfig, VhostUserTransport};
//! use pindown_uapi::{Operation, WorkRequest, WrFlags};
//!
//! let device = VhostUserTransport::connect("/run/pindown/port0.sock", VhostUserConfig::default())?;
//! device.negotiate_features(DEFAULT_FEATURES)?;
//! let arena = DmaArena::new(64 << 20)?;
//! device.register_memory(&[arena.memory_table_region()])?;
//!
//! let layout = device.ring_layout();
//! let pair = pindown_uapi::ADMIN_QUEUE_PAIR;
//! let (sq, cq) = (layout.send_queue(pair), layout.completion_queue(pair));
//! let mut requests = SendQueue::new(&arena, 256)?;
//! let mut completions = CompletionQueue::new(&arena, 256)?;
//! device.setup_queue(sq, &requests.layout())?; // IOTLB entry for the queue, then the ring
//! device.setup_queue(cq, &completions.layout())?;
//! device.enable_queue(cq, true)?;
//! device.enable_queue(sq, true)?;
//!
//! let nop = WorkRequest { user_data: 7, flags: WrFlags::SIGNALED, op: Operation::Nop };
//! assert!(requests.has_room(1)?);
//! requests.push(&nop, &[]);
//! if requests.kick_needed() {
//!     device.notify(sq)?;
//! }
//! let done = device.completion_event(cq)?;
//! let completion = loop {
//!     if let Some(completion) = completions.pop() {
//!         break completion?;
//!     }
//!     if !completions.arm() {
//!         done.wait(None)?;
//!     }
//! };
//! assert_eq!(completion.user_data, 7);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![warn(missing_docs)]

pub mod arena;
pub mod datatype;
pub mod launch;
pub mod pinner;
pub mod rdma_queue;
pub mod reach;
pub mod transport;
pub mod verbs;
pub mod vfio;
pub mod virtqueue;

pub use arena::{ArenaError, ArenaOptions, DmaArena, DmaBuffer, HugePages, MemoryTableRegion};
pub use pinner::{Identity, IotlbPinner, Locate, Placement};
pub use transport::{
    CompletionEvent, IotlbAccess, QueueIndex, Transport, TransportError, VhostUserConfig,
    VhostUserTransport,
};
pub use vfio::{VfioConfig, VfioPinner, VfioTransport, GUEST_RDMA_QUEUE_PAIRS};
pub use virtqueue::{ChainElement, QueueError, QueueLayout, SplitQueue};

/// The base page size of this process (the unit of mlock and of IOTLB
/// entries installed by [`IotlbPinner`]).
pub fn page_size() -> usize {
    pindown_pincache::page_size()
}
