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
//! * **Queues** — [`virtqueue`]: the driver side of split virtqueues (virtio
//!   1.x, with `VIRTIO_F_EVENT_IDX`) laid out in arena memory: descriptor
//!   chains in, completions out, doorbell and interrupt suppression decided
//!   from the device's event indices. Pure shared-memory logic, no system
//!   calls.
//! * **Transport** — [`transport`]: how the device is reached and configured:
//!   feature negotiation, the memory table, queue addresses, doorbells,
//!   completion eventfds and IOTLB entries, behind the [`Transport`] trait.
//!   [`VhostUserTransport`] is the embedded vhost-user frontend used on the
//!   host; [`vfio::VfioTransport`], the VFIO virtio-pci transport for use
//!   inside a QEMU guest, implements the same trait.
//!
//! The verbs API (protection domains, memory regions, queue pairs, completion
//! queues) is built on these layers and never names a concrete transport.
//!
//! ```no_run
//! use pindown_driver::transport::DEFAULT_FEATURES;
//! use pindown_driver::{ChainElement, DmaArena, SplitQueue, Transport};
//! use pindown_driver::{VhostUserConfig, VhostUserTransport};
//!
//! let device = VhostUserTransport::connect("/run/pindown/port0.sock", VhostUserConfig::default())?;
//! let features = device.negotiate_features(DEFAULT_FEATURES)?;
//! let arena = DmaArena::new(64 << 20)?;
//! device.register_memory(&[arena.memory_region()])?;
//!
//! let sq = device.rdma_send_queue();
//! let mut queue = SplitQueue::new(&arena, 256, features & pindown_driver::transport::F_EVENT_IDX != 0)?;
//! device.setup_queue(sq, &queue.layout())?; // IOTLB entry for the rings, then the vring
//! device.enable_queue(sq, true)?;
//!
//! let request = arena.alloc(64, 64)?;
//! request.write_at(0, b"work request");
//! queue.add(&[ChainElement::readable(request.iova(), 64)], 7u64)?;
//! if queue.kick_needed() {
//!     device.notify(sq)?;
//! }
//! let done = device.completion_event(sq)?;
//! while queue.pop_used()?.is_none() {
//!     if !queue.enable_interrupts() {
//!         done.wait(None)?;
//!     }
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![warn(missing_docs)]

pub mod arena;
pub mod pinner;
pub mod rdma_queue;
pub mod transport;
pub mod verbs;
pub mod vfio;
pub mod virtqueue;

pub use arena::{ArenaError, ArenaOptions, DmaArena, DmaBuffer, HugePages, MemoryRegion};
pub use pinner::IotlbPinner;
pub use transport::{
    Access, CompletionEvent, QueueIndex, Transport, TransportError, VhostUserConfig,
    VhostUserTransport,
};
pub use vfio::{VfioConfig, VfioPinner, VfioTransport};
pub use virtqueue::{ChainElement, QueueError, QueueLayout, SplitQueue};

/// The base page size of this process (the unit of mlock and of IOTLB
/// entries installed by [`IotlbPinner`]).
pub fn page_size() -> usize {
    pindown_pincache::page_size()
}
