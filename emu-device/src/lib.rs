//! The emulated pindown NIC: a vhost-user-net backend process.
//!
//! One process serves several ports. Each port is one frontend connection
//! (QEMU's `-netdev vhost-user`, or the pindown driver on the host) on one of
//! the device's unix sockets. Queue pair 0 of every port is an Ethernet port
//! of a learning switch; rings `2P` and `2P+1` (P = queue pairs) are the RDMA
//! send and completion queues, served by [`send_queue`].
//!
//! Modules, in the order of the data path, each depending only on those
//! below it:
//!
//! - [`cli`]: the command line; starts a [`device`].
//! - [`device`]: the process: the [`Device`](device::Device), listening
//!   sockets, the accept loop with the connection limit, the status socket.
//! - [`connection`]: one thread per frontend connection: its epoll loop
//!   over the socket, the kicks and the inbox; resets the port when the
//!   frontend leaves.
//! - [`vhost_user`]: the protocol: message codec, socket I/O, and applying
//!   a request to a port's state.
//! - [`switch`]: the Ethernet data path of queue pair 0: tx rings, the MAC
//!   learning switch, rx rings.
//! - [`internode`]: the link to the devices of other nodes: one thread
//!   with the UDP socket and the reliable endpoint, carrying this node's
//!   requests out and other nodes' requests in.
//! - [`send_queue`]: serving a port's RDMA send and completion queues.
//! - [`shared_poll`]: which port thread polls the send queues of the
//!   other busy ports, and when it hands them back.
//! - [`fabric`]: the RDMA engine's seams over the device's ports.
//! - [`port`]: per-port state, the access gate every data path goes
//!   through, counters, and the table of all ports.
//! - [`inbox`]: frames other ports sent to a port.
//! - [`rdma_rings`]: the device side of the RDMA queue format, its ring
//!   memory translated once per generation of the port's memory.
//! - [`queues`]: the device side of split virtqueues.
//! - [`rdma`]: the RDMA engine proper: executing one work request in
//!   guarded steps, windows and keys; it sees ports only through its
//!   seams.
//! - [`net`]: the fabric between device processes on different hosts:
//!   reliable datagrams over UDP (protocol core, fault injection).
//! - [`memory`]: memory tables, the IOTLB, address translation.
//! - [`sigbus`]: surviving frontend memory that shrinks under the device.
//!
//! [`status`] reads the status socket's answers (`pindown-stat`, tests);
//! [`testing`] runs the binary for tests.

pub mod cli;
pub mod connection;
pub mod device;
pub mod fabric;
pub mod inbox;
pub mod internode;
pub mod memory;
pub mod net;
pub mod port;
pub mod queues;
pub mod rdma;
pub mod rdma_rings;
pub mod send_queue;
pub mod shared_poll;
pub mod sigbus;
pub mod status;
pub mod switch;
pub mod testing;
pub mod vhost_user;

/// RDMA queue pairs per port unless configured: the admin pair and seven
/// I/O pairs.
pub const DEFAULT_RDMA_QUEUE_PAIRS: u16 = 8;

/// Device-wide settings.
#[derive(Debug, Clone)]
pub struct DeviceConfig {
    /// Net queue pairs per port (GET_QUEUE_NUM of a host frontend).
    pub queue_pairs: u16,
    /// RDMA queue pairs per port, the admin pair included (1 to
    /// [`MAX_RDMA_QUEUE_PAIRS`](pindown_uapi::MAX_RDMA_QUEUE_PAIRS)); each
    /// is a send queue and its completion queue, served on its own.
    pub rdma_queue_pairs: u16,
    /// Largest ring size accepted.
    pub queue_size_max: u16,
    /// IOTLB entries per port.
    pub iotlb_entries_max: usize,
    /// Busy-poll the rings of a port while its traffic flows, without
    /// doorbells; a port idle for a millisecond sleeps on its kicks.
    pub poll: bool,
    /// After work, keep polling this many microseconds before sleeping.
    pub spin_us: u64,
    /// Each port's thread polls only its own RDMA send queues; by default
    /// one thread polls for every busy port (see [`shared_poll`]).
    pub solo_polling: bool,
    /// MAC of port 0; port `i` gets this plus `i`.
    pub mac_base: [u8; 6],
    /// Ports whose frontend is QEMU serving a guest that drives the RDMA
    /// rings itself (through VFIO): QEMU forwards only the rings of the
    /// queue pairs it is told of, so these ports report the RDMA queue pairs
    /// too (`queue_pairs + rdma_queue_pairs`).
    pub guest_ports: Vec<usize>,
    /// Bound on the bytes one port's memory table may map
    /// (`--max-mapped-bytes-per-port`); a larger SET_MEM_TABLE is refused.
    pub max_mapped_bytes_per_port: u64,
    /// Frontend connections served at once, over all sockets; a connection
    /// beyond it is accepted and closed at once (logged). The command line
    /// sizes it from the file descriptor limit (see
    /// [`device::fds_per_connection`]).
    pub max_connections: usize,
    /// Clients the status socket serves at once; one beyond it is closed
    /// at once (logged).
    pub max_control_clients: usize,
    /// Windows one port may hold at once; binding beyond fails with
    /// `LimitReached`/`WindowLimit`.
    pub max_windows_per_port: usize,
    /// What the device accepts of one vector transfer (descriptor bytes,
    /// blocks of a pattern's lists); beyond, the request fails with
    /// `LimitReached`/`PatternLimit`.
    pub vector_limits: rdma::VectorLimits,
    /// The node of the fabric this device is (0 without a fabric).
    pub node: pindown_uapi::NodeId,
}

impl Default for DeviceConfig {
    fn default() -> Self {
        DeviceConfig {
            queue_pairs: 2,
            rdma_queue_pairs: DEFAULT_RDMA_QUEUE_PAIRS,
            queue_size_max: 1024,
            iotlb_entries_max: 2048,
            poll: false,
            spin_us: 50,
            solo_polling: false,
            mac_base: [0x52, 0x54, 0x00, 0x12, 0x34, 0x00],
            guest_ports: Vec::new(),
            max_mapped_bytes_per_port: memory::DEFAULT_MAX_MAPPED_BYTES_PER_PORT,
            max_connections: 64,
            max_control_clients: 32,
            max_windows_per_port: rdma::DEFAULT_MAX_WINDOWS_PER_PORT,
            vector_limits: rdma::VectorLimits::default(),
            node: 0,
        }
    }
}
