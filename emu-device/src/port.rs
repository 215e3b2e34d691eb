//! One port of the device: the state a frontend connection builds up
//! (features, memory, IOTLB, rings) and counters that outlive connections.

use std::collections::VecDeque;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use vm_memory::{Permissions, VolatileSlice};

use crate::memory::{self, IotlbTable, MemError, MemoryTable, PortMemory};
use crate::queues::Vring;
use crate::vhost_user::message::{IotlbMsg, IotlbType, HEADER_SIZE, IOTLB_MSG_SIZE};
use crate::DeviceConfig;

/// virtio-net feature bits (virtio spec numbering).
pub mod features {
    use virtio_bindings::virtio_config::{VIRTIO_F_ACCESS_PLATFORM, VIRTIO_F_VERSION_1};
    use virtio_bindings::virtio_net::{VIRTIO_NET_F_MAC, VIRTIO_NET_F_MQ, VIRTIO_NET_F_STATUS};
    use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};

    /// Device has a MAC address (VIRTIO_NET_F_MAC).
    pub const MAC: u64 = 1 << VIRTIO_NET_F_MAC;
    /// Link status in config space (VIRTIO_NET_F_STATUS).
    pub const STATUS: u64 = 1 << VIRTIO_NET_F_STATUS;
    /// Multiqueue (VIRTIO_NET_F_MQ).
    pub const MQ: u64 = 1 << VIRTIO_NET_F_MQ;
    /// Indirect descriptors (VIRTIO_RING_F_INDIRECT_DESC).
    pub const INDIRECT_DESC: u64 = 1 << VIRTIO_RING_F_INDIRECT_DESC;
    /// Used/avail event index (VIRTIO_RING_F_EVENT_IDX).
    pub const EVENT_IDX: u64 = 1 << VIRTIO_RING_F_EVENT_IDX;
    /// vhost-user protocol features available (VHOST_USER_F_PROTOCOL_FEATURES).
    pub const PROTOCOL_FEATURES: u64 =
        vhost::vhost_user::message::VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
    /// Modern device (VIRTIO_F_VERSION_1).
    pub const VERSION_1: u64 = 1 << VIRTIO_F_VERSION_1;
    /// Addresses go through the platform IOMMU (VIRTIO_F_ACCESS_PLATFORM, bit 33).
    pub const ACCESS_PLATFORM: u64 = 1 << VIRTIO_F_ACCESS_PLATFORM;

    /// Everything the device offers.
    pub const OFFERED: u64 = MAC
        | STATUS
        | MQ
        | INDIRECT_DESC
        | EVENT_IDX
        | PROTOCOL_FEATURES
        | VERSION_1
        | ACCESS_PLATFORM;

    #[cfg(test)]
    #[test]
    fn bit_numbers() {
        assert_eq!(ACCESS_PLATFORM, 1 << 33);
        assert_eq!(VERSION_1, 1 << 32);
        assert_eq!(PROTOCOL_FEATURES, 1 << 30);
        assert_eq!(OFFERED, 0x3_7041_0020);
    }
}

/// vhost-user protocol feature bits offered.
pub mod protocol {
    use vhost::vhost_user::message::VhostUserProtocolFeatures as P;
    /// MQ, REPLY_ACK and BACKEND_REQ (QEMU's SLAVE_REQ).
    ///
    /// CONFIGURE_MEM_SLOTS is deliberately absent: QEMU 7.2 would send the
    /// same region once per queue pair through ADD_MEM_REG. CONFIG is absent
    /// because QEMU's vhost-user-net ignores it (and warns); GET_CONFIG is
    /// still answered (MAC, link up, queue pairs, MTU) for frontends that ask.
    pub const OFFERED: u64 = P::MQ.bits() | P::REPLY_ACK.bits() | P::BACKEND_REQ.bits();
    /// REPLY_ACK bit.
    pub const REPLY_ACK: u64 = P::REPLY_ACK.bits();
}

/// Queue pairs whose tx frames are counted separately.
pub const TX_PAIR_STATS: usize = 8;

/// Frames kept for a port whose rx buffer is not mapped yet (IOTLB miss
/// sent, UPDATE awaited). Older frames are dropped when it is full.
pub const RX_BACKLOG_MAX: usize = 256;

/// Counters of one port (cumulative over connections).
#[derive(Debug, Default)]
pub struct PortStats {
    /// Whether a frontend is connected now.
    pub connected: AtomicBool,
    /// Connections accepted.
    pub connections: AtomicU64,
    /// Requests handled.
    pub messages: AtomicU64,
    /// GET_FEATURES requests.
    pub get_features: AtomicU64,
    /// SET_FEATURES requests.
    pub set_features: AtomicU64,
    /// SET_MEM_TABLE requests accepted.
    pub set_mem_table: AtomicU64,
    /// SET_VRING_KICK requests.
    pub set_vring_kick: AtomicU64,
    /// SET_VRING_ENABLE requests.
    pub set_vring_enable: AtomicU64,
    /// SET_BACKEND_REQ_FD requests.
    pub set_backend_req_fd: AtomicU64,
    /// Requests answered with an error or not supported.
    pub errors: AtomicU64,
    /// IOTLB UPDATE messages.
    pub iotlb_updates: AtomicU64,
    /// IOTLB INVALIDATE messages.
    pub iotlb_invalidates: AtomicU64,
    /// IOTLB MISS messages sent.
    pub iotlb_misses_sent: AtomicU64,
    /// Frames taken from tx rings.
    pub tx_frames: AtomicU64,
    /// Malformed tx chains.
    pub tx_errors: AtomicU64,
    /// Frames delivered into rx rings.
    pub rx_frames: AtomicU64,
    /// Frames for this port dropped (no rx buffer, ring not ready, too
    /// small, buffer not writable, backlog full).
    pub rx_dropped: AtomicU64,
    /// Times rx delivery stopped on an unmapped rx buffer (IOTLB miss)
    /// and kept the frame in the backlog.
    pub rx_deferred: AtomicU64,
    /// Frames taken from the tx ring of each queue pair (the first
    /// [`TX_PAIR_STATS`] pairs).
    pub tx_pair: [AtomicU64; TX_PAIR_STATS],
    /// Kicks of the RDMA send queue.
    pub rdma_kicks: AtomicU64,
    /// Last features acknowledged.
    pub features: AtomicU64,
}

impl PortStats {
    /// Adds one to a counter.
    pub fn bump(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }
}

/// A port: its index, MAC, live state and counters.
#[derive(Debug)]
pub struct Port {
    /// Port index (slot in the device).
    pub index: usize,
    /// Index of the listening socket that owns the port's connection.
    pub socket: usize,
    /// MAC the device assigns to this port.
    pub mac: [u8; 6],
    /// Counters.
    pub stats: PortStats,
    /// What other ports' RDMA engines see of this port.
    pub rdma: crate::rdma::PortShared,
    state: Mutex<PortState>,
}

impl Port {
    /// A disconnected port.
    pub fn new(index: usize, socket: usize, mac: [u8; 6], cfg: &DeviceConfig) -> Port {
        Port {
            index,
            socket,
            mac,
            stats: PortStats::default(),
            rdma: crate::rdma::PortShared::default(),
            state: Mutex::new(PortState::new(index, mac, cfg)),
        }
    }

    /// Locks the state (a poisoned lock is recovered: the state is
    /// consistent at every await-free point).
    pub fn lock(&self) -> MutexGuard<'_, PortState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Everything a frontend connection configures.
#[derive(Debug)]
pub struct PortState {
    /// Port index.
    pub index: usize,
    /// Assigned MAC.
    pub mac: [u8; 6],
    /// Number of net queue pairs.
    pub queue_pairs: u16,
    /// The frontend is QEMU for a guest driving the RDMA rings itself: the
    /// RDMA rings are announced as one more queue pair.
    pub guest: bool,
    /// Acknowledged virtio features.
    pub features: u64,
    /// Acknowledged protocol features.
    pub protocol_features: u64,
    /// SET_OWNER received.
    pub owner: bool,
    /// Memory table.
    pub table: Option<MemoryTable>,
    /// Memory as the device accesses it (IOVA or guest physical).
    pub mem: Option<PortMemory>,
    /// Device IOTLB.
    pub iotlb: IotlbTable,
    /// Rings: net pairs (rx 2i, tx 2i+1), then the RDMA send and completion queues.
    pub vrings: Vec<Vring>,
    /// Backend-to-frontend channel (SET_BACKEND_REQ_FD).
    pub backend: Option<UnixStream>,
    /// MISS requests sent and not yet answered: (page, sent at).
    pub pending_misses: Vec<(u64, Instant)>,
    /// Frames (virtio-net header included) for rx ring 0 that wait for
    /// the IOTLB mapping of the next rx buffer, oldest first (at most
    /// [`RX_BACKLOG_MAX`]).
    pub rx_backlog: VecDeque<Vec<u8>>,
}

impl PortState {
    /// Fresh state.
    pub fn new(index: usize, mac: [u8; 6], cfg: &DeviceConfig) -> PortState {
        let nrings = 2 * cfg.queue_pairs as usize + 2;
        PortState {
            index,
            mac,
            queue_pairs: cfg.queue_pairs,
            guest: cfg.guest_ports.contains(&index),
            features: 0,
            protocol_features: 0,
            owner: false,
            table: None,
            mem: None,
            iotlb: IotlbTable::new(cfg.iotlb_entries_max),
            vrings: (0..nrings)
                .map(|i| Vring::new(i, cfg.queue_size_max))
                .collect(),
            backend: None,
            pending_misses: Vec::new(),
            rx_backlog: VecDeque::new(),
        }
    }

    /// Index of the RDMA send queue.
    pub fn rdma_sq(&self) -> usize {
        2 * self.queue_pairs as usize
    }

    /// Index of the RDMA completion queue.
    pub fn rdma_cq(&self) -> usize {
        2 * self.queue_pairs as usize + 1
    }

    /// Whether ACCESS_PLATFORM is negotiated (addresses are IOVAs).
    pub fn iommu(&self) -> bool {
        self.features & features::ACCESS_PLATFORM != 0
    }

    /// Whether EVENT_IDX is negotiated.
    pub fn event_idx(&self) -> bool {
        self.features & features::EVENT_IDX != 0
    }

    /// Whether PROTOCOL_FEATURES is negotiated.
    pub fn protocol_negotiated(&self) -> bool {
        self.features & features::PROTOCOL_FEATURES != 0
    }

    /// Rebuilds the port memory after the memory table or the features
    /// changed, then re-resolves every ring.
    pub fn rebuild_memory(&mut self) {
        self.mem = self
            .table
            .as_ref()
            .map(|t| memory::new_port_memory(t, &self.iotlb, self.iommu()));
        for i in 0..self.vrings.len() {
            self.activate_ring(i);
        }
    }

    /// Pushes the IOTLB into the port memory's IOMMU.
    pub fn refresh_iotlb(&mut self) {
        if let (Some(mem), Some(table)) = (&self.mem, &self.table) {
            mem.iommu().set_tlb(self.iotlb.to_vm_iotlb(table));
        }
    }

    /// Forgets every translation the frontend gave before a ring was
    /// stopped (GET_VRING_BASE): when the guest resets the device (a
    /// reboot, a driver re-probing it) its vIOMMU mappings are gone, but
    /// QEMU sends no INVALIDATE for them, and the next driver reuses the
    /// same IOVAs for other pages. Keeping them would make the device read
    /// descriptors and write frames through stale translations. Misses
    /// still unanswered (QEMU refuses them while the device is stopped)
    /// and frames waiting for an rx buffer of the old driver go too.
    pub fn forget_translations(&mut self) {
        self.iotlb.clear();
        self.refresh_iotlb();
        if let Some(mem) = &self.mem {
            mem.iommu().take_faults();
        }
        self.pending_misses.clear();
        self.rx_backlog.clear();
    }

    /// (Re)configures ring `i` from what the frontend sent.
    pub fn activate_ring(&mut self, i: usize) {
        let iommu = self.iommu();
        let event_idx = self.event_idx();
        let table = self.table.as_ref();
        if let Some(r) = self.vrings.get_mut(i) {
            if !r.started {
                return;
            }
            if let Err(e) = r.activate(table, iommu, event_idx) {
                tracing::warn!(port = self.index, ring = i, "cannot start ring: {e}");
            }
        }
    }

    /// Volatile slices for `[addr, addr + len)` with `access` — the
    /// interface the RDMA engine moves data through. `addr` is an IOVA when
    /// ACCESS_PLATFORM is negotiated, a guest physical address otherwise.
    /// Any unmapped or forbidden byte makes the whole call fail, memory
    /// untouched; a miss is sent to the frontend afterwards.
    pub fn slices(
        &self,
        addr: u64,
        len: usize,
        access: Permissions,
    ) -> Result<Vec<VolatileSlice<'_, ()>>, MemError> {
        let mem = self.mem.as_ref().ok_or(MemError::NoMemory)?;
        memory::slices(mem, addr, len, access)
    }

    /// Sends IOTLB MISS requests for the faults recorded since the last
    /// call (non-blocking; never waits for the answer). Returns how many
    /// were sent.
    pub fn send_misses(&mut self) -> usize {
        let Some(mem) = &self.mem else {
            return 0;
        };
        let faults = mem.iommu().take_faults();
        if faults.is_empty() {
            return 0;
        }
        let Some(backend) = &self.backend else {
            tracing::debug!(port = self.index, "IOTLB miss but no backend channel");
            return 0;
        };
        let now = Instant::now();
        self.pending_misses
            .retain(|(_, t)| now.duration_since(*t) < Duration::from_millis(200));
        let mut sent = 0;
        for f in faults {
            let page = f.iova & !0xfff;
            if self.pending_misses.iter().any(|(p, _)| *p == page) {
                continue;
            }
            let msg = IotlbMsg {
                iova: f.iova,
                size: 1,
                uaddr: 0,
                perm: memory::perm_to_vhost(f.access),
                kind: IotlbType::Miss,
            };
            let mut bytes = Vec::with_capacity(HEADER_SIZE + IOTLB_MSG_SIZE);
            bytes.extend_from_slice(
                &crate::vhost_user::message::Header {
                    request: vhost::vhost_user::message::BackendReq::IOTLB_MSG.into(),
                    flags: 1,
                    size: IOTLB_MSG_SIZE as u32,
                }
                .encode(),
            );
            bytes.extend_from_slice(&msg.encode());
            match crate::vhost_user::conn::send_nonblocking(backend, &bytes) {
                Ok(()) => {
                    tracing::debug!(port = self.index, iova = f.iova, "IOTLB miss sent");
                    self.pending_misses.push((page, now));
                    sent += 1;
                }
                Err(e) => {
                    tracing::debug!(port = self.index, "cannot send IOTLB miss: {e}");
                }
            }
        }
        sent
    }
}
