//! The ports of the device: the state a frontend connection builds up
//! (features, memory, IOTLB, rings), the part every data path reaches
//! behind the port's access gate ([`PortShared`]), counters that outlive
//! connections, and the table of all ports ([`PortTable`]).

use std::collections::VecDeque;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use parking_lot::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use pindown_uapi::{Completion, Opcode, Status};

use crate::inbox::{Inbox, PostedEpochs};
use crate::memory::{IotlbError, IotlbTable, MemoryTable, Miss, PortMemory, TranslateError};
use crate::queues::Vring;
use crate::rdma::VectorLimits;
use crate::rdma::{RefusalCounters, WindowTable};
use crate::send_queue::SendQueue;
use crate::DeviceConfig;

/// The virtio feature bits the device offers (the masks are uapi's, the
/// bit numbers virtio's).
pub mod features {
    pub use pindown_uapi::features::{
        ACCESS_PLATFORM, EVENT_IDX, INDIRECT_DESC, NET_MAC as MAC, NET_MQ as MQ,
        NET_STATUS as STATUS, PROTOCOL_FEATURES, VERSION_1,
    };

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
    fn offered_bits() {
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
    /// Turns of the port's RDMA send queues that did work, served by the
    /// shared poller (another port's thread) while this port's thread
    /// slept (see [`crate::shared_poll`]).
    pub rdma_turns_by_poller: AtomicU64,
    /// Times the shared poller handed this port back to its own thread
    /// because one thread no longer kept up with the ports it polled.
    pub rdma_handed_back_busy: AtomicU64,
    /// Peers' accesses to this port's windows refused, by cause (the
    /// peers themselves are only told "not granted").
    pub refused: RefusalCounters,
    /// Last features acknowledged.
    pub features: AtomicU64,
    /// RDMA requests completed, by kind, with their bytes and failures.
    pub work: WorkCounters,
    /// Requests in flight on each RDMA queue pair now.
    pub in_flight: InFlight,
}

/// One value for each RDMA queue pair a port may have.
#[derive(Debug)]
pub struct PerPair<A>([A; pindown_uapi::MAX_RDMA_QUEUE_PAIRS as usize]);

impl<A: Default> Default for PerPair<A> {
    fn default() -> Self {
        Self(std::array::from_fn(|_| A::default()))
    }
}

impl<A> PerPair<A> {
    /// Pair `pair`'s value (`None` beyond the most pairs a port has).
    pub fn of(&self, pair: u16) -> Option<&A> {
        self.0.get(usize::from(pair))
    }
}

/// Requests each RDMA queue pair of a port took from its send queue and
/// has not finished (running, on the fabric, or with a completion waiting
/// for room), as its service last published them.
pub type InFlight = PerPair<AtomicU64>;

/// Kinds of RDMA requests counted apart ([`WorkCounters::requests`]).
pub const WORK_KINDS: [&str; 7] = [
    "write",
    "read",
    "atomic",
    "vector",
    "third_party",
    "window",
    "other",
];

/// Failed completions counted apart ([`WorkCounters::failed`]), by
/// status (every status but success).
pub const FAILURE_KINDS: [(Status, &str); 5] = [
    (Status::RemoteAccessError, "remote_access"),
    (Status::LocalProtectionError, "local_protection"),
    (Status::InvalidRequest, "invalid_request"),
    (Status::PeerGone, "peer_gone"),
    (Status::LimitReached, "limit_reached"),
];

/// What a port's RDMA send queues completed.
#[derive(Debug, Default)]
pub struct WorkCounters {
    /// Completions by [`WORK_KINDS`].
    pub requests: [AtomicU64; WORK_KINDS.len()],
    /// Bytes of successful completions (their byte length).
    pub bytes: AtomicU64,
    /// Failed completions by [`FAILURE_KINDS`].
    pub failed: [AtomicU64; FAILURE_KINDS.len()],
}

impl WorkCounters {
    /// Counts one completion written to a completion queue.
    pub fn count(&self, completion: &Completion) {
        let kind = match completion.opcode {
            Some(Opcode::Write | Opcode::WriteInline) => 0,
            Some(Opcode::Read) => 1,
            Some(
                Opcode::CompareSwap
                | Opcode::FetchAdd
                | Opcode::Swap
                | Opcode::FetchAnd
                | Opcode::FetchOr
                | Opcode::FetchXor,
            ) => 2,
            Some(Opcode::VectorWrite | Opcode::VectorRead) => 3,
            Some(
                Opcode::Copy
                | Opcode::AtomicToCompareSwap
                | Opcode::AtomicToFetchAdd
                | Opcode::AtomicToSwap
                | Opcode::AtomicToFetchAnd
                | Opcode::AtomicToFetchOr
                | Opcode::AtomicToFetchXor,
            ) => 4,
            Some(Opcode::BindWindow | Opcode::RevokeWindow) => 5,
            _ => 6,
        };
        self.requests[kind].fetch_add(1, Ordering::Relaxed);
        match FAILURE_KINDS
            .iter()
            .position(|&(status, _)| status == completion.status)
        {
            Some(failure) => {
                self.failed[failure].fetch_add(1, Ordering::Relaxed);
            }
            None => {
                self.bytes
                    .fetch_add(u64::from(completion.byte_len), Ordering::Relaxed);
            }
        }
    }
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
    /// The port's memory and windows, as every data path of the device
    /// reaches them (the one copy; see [`PortShared`]).
    pub shared: Arc<PortShared>,
    /// Frames switched to this port by other ports, for its own thread.
    pub inbox: Inbox,
    /// The current epoch of each of its RDMA send queues.
    pub posted_epochs: PostedEpochs,
    /// What the device accepts of one vector transfer this port starts.
    pub vector_limits: VectorLimits,
    /// The node of the fabric this device is.
    pub node: pindown_uapi::NodeId,
    /// The service of each RDMA queue pair while a frontend is connected
    /// (empty otherwise): the port's thread serves them, or the shared
    /// poller while the port's thread sleeps (see [`crate::shared_poll`]).
    /// Locked before the state, never after.
    send_queues: Mutex<Vec<SendQueue>>,
    /// The port's thread sleeps and leaves its RDMA send queues to the
    /// shared poller.
    pub delegated: AtomicBool,
    /// The shared poller handed the port back since its thread last
    /// looked: the thread serves every ring once.
    pub handed_back: AtomicBool,
    state: Mutex<PortState>,
}

/// The device's ports, by index: where the connection threads, the switch
/// and the RDMA fabric find a port. Ports are only added (one whose
/// frontend left serves the next connection), never removed, so an index
/// names one port for the life of the device.
#[derive(Debug)]
pub struct PortTable {
    ports: std::sync::RwLock<Vec<Arc<Port>>>,
    /// Ports `0..sockets` belong to the listening socket of the same index.
    sockets: usize,
}

/// MAC `base` plus `n` (in its low three bytes).
fn mac_add(base: [u8; 6], n: usize) -> [u8; 6] {
    let low = u32::from_be_bytes([0, base[3], base[4], base[5]]).wrapping_add(n as u32);
    let b = low.to_be_bytes();
    [base[0], base[1], base[2], b[1], b[2], b[3]]
}

impl PortTable {
    /// One disconnected port per listening socket (port `i` on socket `i`).
    pub fn new(sockets: usize, config: &DeviceConfig) -> PortTable {
        let ports = (0..sockets)
            .map(|i| Arc::new(Port::new(i, i, mac_add(config.mac_base, i), config)))
            .collect();
        PortTable {
            ports: std::sync::RwLock::new(ports),
            sockets,
        }
    }

    /// The port with index `index`.
    pub fn get(&self, index: usize) -> Option<Arc<Port>> {
        self.ports
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(index)
            .cloned()
    }

    /// All ports (connected or not).
    pub fn all(&self) -> Vec<Arc<Port>> {
        self.ports.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Whether the device gives `mac` to one of its ports.
    pub fn owns_mac(&self, mac: &[u8; 6]) -> bool {
        self.ports
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .any(|port| port.mac == *mac)
    }

    /// Indices of the connected ports.
    pub fn connected(&self) -> Vec<usize> {
        self.all()
            .iter()
            .filter(|p| p.stats.connected.load(Ordering::Acquire))
            .map(|p| p.index)
            .collect()
    }

    /// Picks the port for a new connection on socket `socket` and marks it
    /// connected: the socket's own port if free, else a free extra port,
    /// else a new one.
    pub fn allocate(&self, socket: usize, config: &DeviceConfig) -> Arc<Port> {
        let mut ports = self.ports.write().unwrap_or_else(|e| e.into_inner());
        let free = |p: &Arc<Port>| !p.stats.connected.load(Ordering::Acquire);
        let pick = if socket < ports.len() && free(&ports[socket]) {
            Some(socket)
        } else {
            (self.sockets..ports.len()).find(|i| free(&ports[*i]))
        };
        let index = pick.unwrap_or_else(|| {
            let i = ports.len();
            ports.push(Arc::new(Port::new(
                i,
                socket,
                mac_add(config.mac_base, i),
                config,
            )));
            i
        });
        let port = ports[index].clone();
        port.stats.connected.store(true, Ordering::Release);
        PortStats::bump(&port.stats.connections);
        port
    }
}

/// What the data paths of the device reach of a port: its memory (the
/// frontend's memory table behind the port's IOTLB) and its windows,
/// behind the port's access gate.
///
/// Every access to the port's memory — a peer's RDMA copy, an atomic, the
/// port's own rings — is one guarded step: translation, the window check
/// and the data movement happen while the step holds the gate in shared
/// mode ([`PortShared::access`]), and long copies are cut into bounded
/// steps. Every change that takes access away — an IOTLB invalidation or
/// replacement, a window revocation, a new memory table or feature set, a
/// reset, a disconnect — is made while holding the gate exclusively
/// ([`PortShared::barrier`]), which waits for the steps in flight. So once
/// such a change is acknowledged, no access that began earlier can still
/// touch the old pages, and none can start through the old grant.
///
/// Only the port's own connection thread takes the gate exclusively. Steps
/// that span two ports take both gates in port order.
///
/// Translations that miss in the port's IOTLB, whoever made them (the
/// port's rings, its RDMA requests, a peer's access through a window), are
/// queued in [`misses`](Self::note_miss); the port's own thread sends them
/// to its frontend.
#[derive(Debug, Default)]
pub struct PortShared {
    gate: RwLock<SharedState>,
    misses: parking_lot::Mutex<MissOutbox>,
    /// Bumped by every reset (RESET_OWNER, a frontend leaving): windows
    /// bound to this port as their one peer die with it (see
    /// [`PortId`](crate::rdma::PortId)).
    incarnation: AtomicU64,
}

/// How long a MISS stays unanswered before the same page is asked again.
const MISS_RETRY: Duration = Duration::from_millis(200);

/// Misses queued at most (more are dropped: they will miss again).
const MISS_QUEUE_MAX: usize = 64;

/// Pages remembered as asked for at most (a frontend or a peer can make a
/// port miss on any number of pages).
const MISS_ASKED_MAX: usize = 256;

/// IOTLB misses of a port waiting to be sent, and the pages recently asked
/// for (not asked again before `MISS_RETRY` or their UPDATE).
#[derive(Debug, Default)]
pub struct MissOutbox {
    queued: Vec<Miss>,
    asked: Vec<(u64, Instant)>,
}

impl MissOutbox {
    fn page(iova: u64) -> u64 {
        iova & !0xfff
    }

    /// Queues `miss` unless its page is queued already.
    pub fn push(&mut self, miss: Miss) {
        let page = Self::page(miss.iova);
        if self.queued.len() < MISS_QUEUE_MAX
            && !self.queued.iter().any(|m| Self::page(m.iova) == page)
        {
            self.queued.push(miss);
        }
    }

    /// Takes the queued misses whose page was not asked for recently, and
    /// marks their pages asked at `now`.
    pub fn take_due(&mut self, now: Instant) -> Vec<Miss> {
        self.asked
            .retain(|(_, at)| now.saturating_duration_since(*at) < MISS_RETRY);
        let mut due = std::mem::take(&mut self.queued);
        due.retain(|m| {
            let page = Self::page(m.iova);
            // Pages asked for recently are bounded: beyond the bound a miss
            // is dropped, and asked for again when it faults again.
            let fresh =
                self.asked.len() < MISS_ASKED_MAX && !self.asked.iter().any(|(p, _)| *p == page);
            if fresh {
                self.asked.push((page, now));
            }
            fresh
        });
        due
    }

    /// Forgets that `iova`'s page was asked for (the MISS could not be sent).
    pub fn not_asked(&mut self, iova: u64) {
        let page = Self::page(iova);
        self.asked.retain(|(p, _)| *p != page);
    }

    /// Forgets the pages of `[iova, iova + len)` (an UPDATE answered them).
    pub fn answered(&mut self, iova: u64, len: u64) {
        let end = iova.saturating_add(len);
        self.asked
            .retain(|(p, _)| !(*p >= Self::page(iova) && *p < end));
    }

    /// Forgets everything.
    pub fn clear(&mut self) {
        self.queued.clear();
        self.asked.clear();
    }
}

/// The state behind a port's gate.
#[derive(Debug, Default)]
pub struct SharedState {
    /// The port's memory, while a frontend is connected and has sent its
    /// memory table.
    pub memory: Option<PortMemory>,
    /// The windows the port bound.
    pub windows: WindowTable,
    /// Changes with every barrier: what was translated from the memory in
    /// an earlier generation (the RDMA rings) must be translated again.
    pub generation: u64,
}

impl PortShared {
    /// No memory yet, and a window table holding at most `max_windows`.
    pub fn new(max_windows: usize) -> Self {
        PortShared {
            gate: RwLock::new(SharedState {
                memory: None,
                windows: WindowTable::with_limit(max_windows),
                generation: 0,
            }),
            misses: Default::default(),
            incarnation: AtomicU64::new(0),
        }
    }

    /// Enters one guarded step (shared mode): the state cannot change
    /// until the guard is dropped.
    pub fn access(&self) -> RwLockReadGuard<'_, SharedState> {
        self.gate.read()
    }

    /// Waits until no step is in flight and holds every new one off until
    /// the guard is dropped. Starts a new generation of the state (see
    /// [`SharedState::generation`]).
    pub fn barrier(&self) -> RwLockWriteGuard<'_, SharedState> {
        let mut state = self.gate.write();
        state.generation = state.generation.wrapping_add(1);
        state
    }

    /// Forgets the memory (with its IOTLB) and revokes every window
    /// (reset, disconnect), once no access is in flight.
    pub fn reset(&self) {
        let mut state = self.barrier();
        state.memory = None;
        state.windows.clear();
        // Under the barrier: no step checks a window against the old
        // incarnation once the reset is done.
        self.incarnation.fetch_add(1, Ordering::AcqRel);
        drop(state);
        self.misses.lock().clear();
    }

    /// The port's current incarnation.
    pub fn incarnation(&self) -> u64 {
        self.incarnation.load(Ordering::Acquire)
    }

    /// Queues an IOTLB miss of this port for its frontend.
    pub fn note_miss(&self, miss: Miss) {
        self.misses.lock().push(miss);
    }

    /// Takes the queued misses due to be sent now (see
    /// [`MissOutbox::take_due`]); the caller sends them to the frontend.
    pub fn take_due_misses(&self, now: Instant) -> Vec<Miss> {
        self.misses.lock().take_due(now)
    }

    /// Records that the MISS for `iova` could not be sent: it is asked
    /// again when it is noted again.
    pub fn miss_not_sent(&self, iova: u64) {
        self.misses.lock().not_asked(iova);
    }

    /// Queues what `failure` asks of this port's frontend, if anything (see
    /// [`TranslateError::ask`]).
    pub fn note_miss_of(&self, failure: TranslateError) {
        if let Some(miss) = failure.ask() {
            self.note_miss(miss);
        }
    }
}

impl crate::rdma::NoticeQueue for Port {
    fn deliver(&self, notice: pindown_uapi::Completion) {
        self.inbox.deliver_notice(notice);
    }

    fn release(&self) {
        self.inbox.release_notice();
    }
}

impl Port {
    /// A disconnected port.
    pub fn new(index: usize, socket: usize, mac: [u8; 6], cfg: &DeviceConfig) -> Port {
        let shared = Arc::new(PortShared::new(cfg.max_windows_per_port));
        Port {
            index,
            socket,
            mac,
            stats: PortStats::default(),
            state: Mutex::new(PortState::new(index, mac, cfg, shared.clone())),
            shared,
            inbox: Inbox::default(),
            posted_epochs: PostedEpochs::default(),
            vector_limits: cfg.vector_limits,
            node: cfg.node,
            send_queues: Mutex::new(Vec::new()),
            delegated: AtomicBool::new(false),
            handed_back: AtomicBool::new(false),
        }
    }

    /// Locks the state (a poisoned lock is recovered: the state is
    /// consistent at every await-free point).
    pub fn lock(&self) -> MutexGuard<'_, PortState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Locks the state if no one holds it.
    pub fn try_lock(&self) -> Option<MutexGuard<'_, PortState>> {
        match self.state.try_lock() {
            Ok(guard) => Some(guard),
            Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    /// Locks the RDMA queue pairs' services (before the state).
    pub fn send_queues(&self) -> MutexGuard<'_, Vec<SendQueue>> {
        self.send_queues.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Locks the RDMA queue pairs' services if no one holds them.
    pub fn try_send_queues(&self) -> Option<MutexGuard<'_, Vec<SendQueue>>> {
        match self.send_queues.try_lock() {
            Ok(guard) => Some(guard),
            Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
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
    /// Number of RDMA queue pairs, the admin pair included.
    pub rdma_queue_pairs: u16,
    /// The frontend is QEMU for a guest driving the RDMA rings itself: the
    /// RDMA queue pairs are announced as queue pairs too.
    pub guest: bool,
    /// Acknowledged virtio features.
    pub features: u64,
    /// Acknowledged protocol features.
    pub protocol_features: u64,
    /// SET_OWNER received.
    pub owner: bool,
    /// Memory table.
    pub table: Option<MemoryTable>,
    /// Bound on the bytes the memory table may map.
    pub max_mapped_bytes: u64,
    /// The port's memory (as the device accesses it: IOVA or guest
    /// physical, through the port's IOTLB) and windows, shared with the
    /// data paths of other ports.
    pub shared: Arc<PortShared>,
    /// Entries the port's IOTLB holds at most.
    pub iotlb_entries_max: usize,
    /// Rings: net pairs (rx 2i, tx 2i+1), then the RDMA queue pairs (send
    /// queue, completion queue), as [`layout`](Self::layout) says.
    pub vrings: Vec<Vring>,
    /// Backend-to-frontend channel (SET_BACKEND_REQ_FD).
    pub backend: Option<UnixStream>,
    /// Frames (virtio-net header included) for rx ring 0 that wait for
    /// the IOTLB mapping of the next rx buffer, oldest first (at most
    /// [`RX_BACKLOG_MAX`]).
    pub rx_backlog: VecDeque<Vec<u8>>,
}

impl PortState {
    /// Fresh state.
    pub fn new(
        index: usize,
        mac: [u8; 6],
        cfg: &DeviceConfig,
        shared: Arc<PortShared>,
    ) -> PortState {
        let layout = pindown_uapi::RingLayout {
            queue_pairs: cfg.queue_pairs,
            rdma_queue_pairs: cfg.rdma_queue_pairs,
        };
        PortState {
            index,
            mac,
            queue_pairs: cfg.queue_pairs,
            rdma_queue_pairs: cfg.rdma_queue_pairs,
            guest: cfg.guest_ports.contains(&index),
            features: 0,
            protocol_features: 0,
            owner: false,
            table: None,
            max_mapped_bytes: cfg.max_mapped_bytes_per_port,
            shared,
            iotlb_entries_max: cfg.iotlb_entries_max,
            vrings: (0..usize::from(layout.ring_count()))
                .map(|i| Vring::new(i, cfg.queue_size_max))
                .collect(),
            backend: None,
            rx_backlog: VecDeque::new(),
        }
    }

    /// Which ring carries what.
    pub fn layout(&self) -> pindown_uapi::RingLayout {
        pindown_uapi::RingLayout {
            queue_pairs: self.queue_pairs,
            rdma_queue_pairs: self.rdma_queue_pairs,
        }
    }

    /// The RDMA ring ring `i` is, if it is one.
    pub fn rdma_ring(&self, i: usize) -> Option<pindown_uapi::RdmaRing> {
        self.layout().rdma_ring(u16::try_from(i).ok()?)
    }

    /// Whether ring `i` is a ring of the admin queue pair, whose stop
    /// revokes the port's windows (they were bound through it).
    pub fn is_admin_ring(&self, i: usize) -> bool {
        self.rdma_ring(i)
            .is_some_and(|ring| ring.pair() == pindown_uapi::ADMIN_QUEUE_PAIR)
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
    /// changed, then re-resolves every ring. The old memory and every
    /// window bound in it are gone once no access is in flight; the IOTLB
    /// carries over (its entries name frontend addresses, which a new
    /// memory table does not change).
    pub fn rebuild_memory(&mut self) {
        {
            let mut shared = self.shared.barrier();
            shared.windows.clear();
            let iotlb = shared
                .memory
                .take()
                .map(PortMemory::into_iotlb)
                .unwrap_or_else(|| IotlbTable::new(self.iotlb_entries_max));
            shared.memory = self
                .table
                .clone()
                .map(|t| PortMemory::new(t, self.iommu(), iotlb));
        }
        for i in 0..self.vrings.len() {
            // Logged; the request that changed the memory stands.
            let _ = self.activate_ring(i);
        }
    }

    /// Puts the new memory table in place, once no access is in flight,
    /// keeping the IOTLB and the windows (a table that only adds or drops
    /// regions, or one behind the IOTLB), then re-resolves every ring
    /// (running rings keep their positions). Accesses to memory the new
    /// table no longer holds fail; every other access goes on.
    pub fn replace_memory_table(&mut self) {
        {
            let mut shared = self.shared.barrier();
            let iotlb = shared
                .memory
                .take()
                .map(PortMemory::into_iotlb)
                .unwrap_or_else(|| IotlbTable::new(self.iotlb_entries_max));
            shared.memory = self
                .table
                .clone()
                .map(|t| PortMemory::new(t, self.iommu(), iotlb));
        }
        for i in 0..self.vrings.len() {
            // Logged; the request that changed the memory stands.
            let _ = self.activate_ring(i);
        }
    }

    /// Maps `[iova, iova + len)` to the frontend's `[uaddr, uaddr + len)`
    /// in the port's IOTLB (an UPDATE), once no access is in flight.
    /// Returns how many old entries were evicted.
    pub fn iotlb_update(
        &mut self,
        iova: u64,
        len: u64,
        uaddr: u64,
        perm: vm_memory::Permissions,
    ) -> Result<usize, IotlbError> {
        let mut shared = self.shared.barrier();
        let evicted = match shared.memory.as_mut() {
            Some(memory) => memory.iotlb_mut().update(iova, len, uaddr, perm)?,
            None => return Ok(0),
        };
        drop(shared);
        self.shared.misses.lock().answered(iova, len);
        Ok(evicted)
    }

    /// Removes `[iova, iova + len)` from the port's IOTLB (an INVALIDATE);
    /// once this returns, no access through the old entries is in flight
    /// and none can start.
    pub fn iotlb_invalidate(&mut self, iova: u64, len: u64) {
        if let Some(memory) = self.shared.barrier().memory.as_mut() {
            memory.iotlb_mut().invalidate(iova, len);
        }
    }

    /// Entries in the port's IOTLB.
    pub fn iotlb_len(&self) -> usize {
        self.shared
            .access()
            .memory
            .as_ref()
            .map_or(0, |m| m.iotlb().len())
    }

    /// Forgets every translation the frontend gave, and every window, before
    /// a ring was stopped (GET_VRING_BASE): when the guest resets the
    /// device (a reboot, a driver re-probing it) its vIOMMU mappings are
    /// gone, but QEMU sends no INVALIDATE for them, and the next driver
    /// reuses the same IOVAs for other pages. Keeping them would make the
    /// device read descriptors and write frames through stale translations.
    /// Misses still unanswered (QEMU refuses them while the device is
    /// stopped) and frames waiting for an rx buffer of the old driver go
    /// too.
    pub fn forget_translations(&mut self) {
        {
            let mut shared = self.shared.barrier();
            if let Some(memory) = shared.memory.as_mut() {
                memory.iotlb_mut().clear();
            }
            shared.windows.clear();
        }
        self.shared.misses.lock().clear();
        self.rx_backlog.clear();
    }

    /// Revokes every window of the port (its RDMA rings stopped), once no
    /// access is in flight.
    pub fn revoke_windows(&mut self) {
        self.shared.barrier().windows.clear();
    }

    /// (Re)configures ring `i` from what the frontend sent. A ring that
    /// cannot start is logged and the reason returned (the handler answers
    /// the request that tried to start it as failed).
    pub fn activate_ring(&mut self, i: usize) -> Result<(), crate::queues::RingError> {
        let iommu = self.iommu();
        let event_idx = self.event_idx();
        let table = self.table.as_ref();
        if let Some(r) = self.vrings.get_mut(i) {
            if !r.started {
                return Ok(());
            }
            if let Err(e) = r.activate(table, iommu, event_idx) {
                tracing::warn!(port = self.index, ring = i, "cannot start ring: {e}");
                return Err(e);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::Permissions;

    fn miss(page: u64) -> Miss {
        Miss {
            iova: page << 12,
            access: Permissions::Read,
        }
    }

    #[test]
    fn the_pages_asked_for_are_bounded() {
        let mut outbox = MissOutbox::default();
        let now = Instant::now();
        let mut sent = 0;
        for round in 0..40u64 {
            for i in 0..MISS_QUEUE_MAX as u64 {
                outbox.push(miss(round * 1000 + i));
            }
            sent += outbox.take_due(now).len();
            assert!(outbox.asked.len() <= MISS_ASKED_MAX);
        }
        assert_eq!(sent, MISS_ASKED_MAX);
        // Once they are old, new pages are asked for again.
        outbox.push(miss(1 << 28));
        assert_eq!(outbox.take_due(now + MISS_RETRY).len(), 1);
    }
}
