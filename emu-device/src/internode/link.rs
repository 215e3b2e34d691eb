//! The link thread: the UDP socket, the reliable endpoint, the operations
//! this device started towards other nodes (the initiator side) and the
//! reads other nodes asked of it (the target side).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io;
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use pindown_uapi::core_sharing::CoreSharing;
use pindown_uapi::pattern::{Pattern, Plan};
use pindown_uapi::{
    Access, Arrival, AtomicWidth, Completion, ErrorDetail, NodeId, Opcode, Operation, PortAddress,
    RemoteAddress, Status, VectorTransfer, WorkRequest, WrFlags,
};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::batch;
use super::message::{
    FrameDatagram, Message, Origin, PartNotice, PART_NOTICE_LEN, READ_DATA_HEADER, WRITE_HEADER,
};
use crate::fabric::with_port;
use crate::inbox::{LinkCompletion, PostedAt};
use crate::net::wire::{seq_before, Header};
use crate::net::{self, Endpoint, Event, FaultInjector, Faults, Identity, SendError, Seq, Stream};
use crate::port::{Port, PortTable};
use crate::rdma::remote::{self, AtomicOp};
use crate::rdma::{self, Failure, PortId, Target};
use crate::switch::{Station, Switch};

/// Copies other nodes may have delegated to this one at once; one more is
/// refused with [`ErrorDetail::NodeBusy`].
pub const MAX_DELEGATED: usize = 1024;

/// Answers waiting for room in the endpoint at most; beyond, the oldest
/// of the same node is dropped, or the new one when that node has none
/// waiting (logged), and its initiator's operation fails by its own
/// timeout.
pub const MAX_DEFERRED: usize = 4096;

/// Answers to one node waiting for room at most: a node that does not
/// acknowledge its answers fills its own share, never the others'.
pub const MAX_DEFERRED_PER_NODE: usize = 256;

/// Ethernet frames waiting for the link at most; more are dropped.
pub const MAX_FRAMES_QUEUED: usize = 512;

/// Reads other nodes may have under way here at once; one more is
/// refused with [`ErrorDetail::NodeBusy`].
pub const MAX_READ_JOBS: usize = 1024;

/// Bytes a pass copies between two windows of this node at most (a copy
/// delegated here whose both ends are here): the rest waits for the next
/// passes, so a long copy never stops the link from serving its peers.
pub const LOCAL_COPY_BYTES_PER_PASS: usize = 1 << 20;

/// How the link is set up.
#[derive(Debug, Clone)]
pub struct LinkConfig {
    /// This device's node.
    pub node: NodeId,
    /// The UDP address the link binds.
    pub listen: SocketAddr,
    /// The other nodes and their devices' UDP addresses.
    pub peers: BTreeMap<NodeId, SocketAddr>,
    /// The job token every device of the fabric shares.
    pub fabric: u64,
    /// The reliable endpoint's tunables (peer timeout, window, ...).
    pub endpoint: net::Config,
    /// Faults injected into received datagrams.
    pub fault_in: Faults,
    /// Faults injected into sent datagrams.
    pub fault_out: Faults,
    /// How long the thread polls its socket after activity before it
    /// sleeps.
    pub spin: Duration,
    /// Busy-poll: the thread also polls for as long as operations are
    /// under way (it sleeps when there are none, so that an idle fabric
    /// leaves the cores to the ports).
    pub poll: bool,
}

/// A request of a local port that names another node.
#[derive(Debug)]
pub struct Submission {
    /// The initiating port.
    pub port: Arc<Port>,
    /// Where it was posted, which its completion carries back.
    pub at: PostedAt,
    /// The request.
    pub request: WorkRequest,
    /// The bytes of a WRITE_INLINE.
    pub inline: Vec<u8>,
}

/// Counters of the link; they only grow.
#[derive(Debug, Default)]
pub struct LinkStats {
    /// Requests of local ports handed to the link.
    pub started: AtomicU64,
    /// Of those, completed successfully.
    pub completed: AtomicU64,
    /// Of those, completed with an error.
    pub failed: AtomicU64,
    /// Operations of other nodes carried out here (write parts, reads,
    /// atomics).
    pub served: AtomicU64,
    /// Messages that did not decode, or named an operation that does not
    /// exist or is not the sender's.
    pub bad_messages: AtomicU64,
    /// Datagrams from addresses that are no peer's.
    pub stray_datagrams: AtomicU64,
    /// Datagrams the endpoint dropped (stale, duplicate, wrong fabric,
    /// malformed, ...; the endpoint's own counters tell them apart).
    pub dropped_datagrams: AtomicU64,
    /// Datagrams sent (retransmissions included).
    pub datagrams_sent: AtomicU64,
    /// Datagrams received.
    pub datagrams_received: AtomicU64,
    /// Messages sent again.
    pub retransmissions: AtomicU64,
    /// Ethernet frames sent to other nodes (one per node).
    pub frames_sent: AtomicU64,
    /// Ethernet frames received from other nodes.
    pub frames_received: AtomicU64,
    /// Ethernet frames dropped (queue full, bad frame datagrams).
    pub frames_dropped: AtomicU64,
    /// Passes of the link's work that did work on a busy-polling port
    /// thread ([`Link::drive`]) rather than the link's own.
    pub passes_on_ports: AtomicU64,
}

/// Counters of the link towards one peer. The counters only grow; the
/// figures of the protocol's state (incarnation, round trip, timeout,
/// messages outstanding, gone) are those of the last snapshot the link's
/// thread published ([`Link::peer_status`] asks for one).
#[derive(Debug, Default)]
pub struct PeerStats {
    /// Datagrams sent to the peer (retransmissions, pure acknowledgements
    /// and Ethernet frames included).
    pub datagrams_sent: AtomicU64,
    /// Datagrams received from the peer's address.
    pub datagrams_received: AtomicU64,
    /// Messages sent to the peer again (on a timeout or a fast
    /// retransmission): each one stands for a loss, or a late
    /// acknowledgement.
    pub retransmissions: AtomicU64,
    /// Datagrams from the peer's address the endpoint dropped (stale,
    /// malformed, beyond the window, ...).
    pub dropped_datagrams: AtomicU64,
    /// Messages from the peer received again after delivery.
    pub duplicates: AtomicU64,
    /// Messages to the peer given up on (never acknowledged: lost for
    /// good).
    pub abandoned: AtomicU64,
    /// Times the peer was declared gone.
    pub gone_count: AtomicU64,
    /// Times the peer came back with a new incarnation.
    pub restarts: AtomicU64,
    /// Snapshot: the peer's incarnation (0: not heard from yet).
    pub incarnation: AtomicU64,
    /// Snapshot: the smoothed round-trip estimate, us (0: no sample yet).
    pub srtt_us: AtomicU64,
    /// Snapshot: the retransmission timeout now, us.
    pub rto_us: AtomicU64,
    /// Snapshot: messages sent and not acknowledged yet.
    pub outstanding: AtomicU64,
    /// Snapshot: 1 while the peer is declared gone.
    pub gone: AtomicU64,
}

/// Requests for a snapshot of the peers' protocol state, and the last
/// one published: `(asked, published)` generations.
#[derive(Debug, Default)]
struct Snapshots {
    generations: Mutex<(u64, u64)>,
    published: Condvar,
    wanted: AtomicBool,
}

/// How long [`Link::peer_status`] waits for the link's thread to publish
/// a snapshot before it shows the last one.
const SNAPSHOT_PATIENCE: Duration = Duration::from_millis(200);

/// The link of this device to the other nodes' devices.
pub struct Link {
    node: NodeId,
    peers: BTreeMap<NodeId, SocketAddr>,
    queue: Mutex<VecDeque<Submission>>,
    /// Ethernet frames for other nodes (`None`: every node).
    frames: Mutex<VecDeque<(Option<NodeId>, Vec<u8>)>>,
    /// The job token (frame datagrams carry it too).
    fabric: u64,
    wake: EventFd,
    /// The thread sleeps (or is about to): submitters wake it.
    asleep: AtomicBool,
    stop: AtomicBool,
    /// Counters.
    pub stats: LinkStats,
    /// Counters per peer (the peers never change).
    peer_stats: BTreeMap<NodeId, PeerStats>,
    snapshots: Snapshots,
    /// The endpoint's memory: fixed bytes, bytes per peer.
    memory: (usize, usize),
    /// The link's own datagram buffers (received datagrams, the pass's
    /// batch, the message and datagram being built), bytes: fixed, beside
    /// the endpoint's.
    buffers: usize,
    /// The device's switch (its learning table's counters are reported
    /// here).
    switch: Arc<Switch>,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// The link's work, taken for a pass by whichever thread runs it: the
    /// link's own thread, or a busy-polling port thread ([`Link::drive`]).
    /// `None` once the link stopped.
    worker: Mutex<Option<Worker>>,
    /// When a port thread last ran a pass, in nanoseconds since `epoch`
    /// (0: not driven); the link's own thread naps meanwhile.
    driven_at: AtomicU64,
    /// The index plus one of the port whose thread last ran a pass.
    driver: std::sync::atomic::AtomicUsize,
    epoch: Instant,
    /// A pass run by a port thread panicked: port threads no longer drive.
    drive_broken: AtomicBool,
}

/// Datagrams one pass takes at most (the rest waits for the next pass).
const RECEIVE_DATAGRAMS_PER_PASS: usize = 256;

/// Receive calls one pass makes at most (each brings at least one
/// datagram; an error brings none).
const RECEIVE_CALLS_PER_PASS: usize = 96;

/// How long after a port thread's last pass the link's own thread takes
/// over again (a port thread that stops driving says so at once).
const DRIVEN_LAPSE: Duration = Duration::from_micros(200);

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link")
            .field("node", &self.node)
            .field("peers", &self.peers)
            .finish()
    }
}

impl Link {
    /// Binds the socket and starts the link's thread over `ports`.
    pub fn start(
        config: LinkConfig,
        ports: Arc<PortTable>,
        switch: Arc<Switch>,
    ) -> io::Result<Arc<Link>> {
        let invalid = |what: String| io::Error::new(io::ErrorKind::InvalidInput, what);
        let socket = UdpSocket::bind(config.listen)
            .map_err(|e| io::Error::new(e.kind(), format!("cannot bind {}: {e}", config.listen)))?;
        let datagram_max = config.endpoint.max_payload + crate::net::wire::HEADER_LEN;
        if datagram_max > batch::DATAGRAM_MAX {
            return Err(invalid(format!(
                "a {datagram_max}-byte datagram (payload {} + header) is longer than the \
                 {} bytes the link takes",
                config.endpoint.max_payload,
                batch::DATAGRAM_MAX
            )));
        }
        let socket = batch::Wire::new(socket, datagram_max)?;
        let identity = Identity::with_random_incarnation(config.fabric, config.node)
            .map_err(|e| io::Error::other(format!("no random source: {e}")))?;
        let mut endpoint =
            Endpoint::new(identity, config.endpoint).map_err(|e| invalid(e.to_string()))?;
        for &node in config.peers.keys() {
            endpoint
                .add_peer(node)
                .map_err(|e| invalid(e.to_string()))?;
        }
        let report = endpoint.memory();
        let received = batch::Received::with_buffers();
        let outgoing = batch::Outgoing::with_capacity(datagram_max);
        let message = Vec::with_capacity(config.endpoint.max_payload);
        let bytes = vec![0; config.endpoint.max_payload];
        let datagram = vec![0u8; batch::DATAGRAM_MAX];
        let buffers =
            received.bytes() + outgoing.bytes() + message.capacity() + bytes.len() + datagram.len();
        let link = Arc::new(Link {
            node: config.node,
            peers: config.peers.clone(),
            queue: Mutex::new(VecDeque::new()),
            frames: Mutex::new(VecDeque::new()),
            fabric: config.fabric,
            wake: EventFd::new(EFD_NONBLOCK)?,
            asleep: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            stats: LinkStats::default(),
            peer_stats: config
                .peers
                .keys()
                .map(|&node| (node, PeerStats::default()))
                .collect(),
            snapshots: Snapshots::default(),
            memory: (report.fixed_bytes, report.per_peer_bytes),
            buffers,
            switch: Arc::clone(&switch),
            thread: Mutex::new(None),
            worker: Mutex::new(None),
            driven_at: AtomicU64::new(0),
            driver: std::sync::atomic::AtomicUsize::new(0),
            epoch: Instant::now(),
            drive_broken: AtomicBool::new(false),
        });
        let worker = Worker {
            link: Arc::clone(&link),
            ports,
            switch,
            socket,
            endpoint,
            fault_in: (!config.fault_in.is_none()).then(|| FaultInjector::new(config.fault_in)),
            fault_out: (!config.fault_out.is_none()).then(|| FaultInjector::new(config.fault_out)),
            spin: config.spin,
            poll: config.poll,
            ops: BTreeMap::new(),
            next_tag: 1,
            tags: Vec::new(),
            seq_tags: HashMap::new(),
            reads: VecDeque::new(),
            delegations: HashMap::new(),
            delegated: 0,
            op_timeout: config.endpoint.peer_timeout * 2,
            deferred: BTreeMap::new(),
            deferred_count: 0,
            local_copy_budget: LOCAL_COPY_BYTES_PER_PASS,
            local_copy_waits: false,
            resumed: false,
            message,
            received,
            outgoing,
            bytes,
            addresses: config.peers.iter().map(|(&n, &a)| (a, n)).collect(),
            datagram,
            last_work: Instant::now(),
        };
        *link.worker.lock().unwrap_or_else(|e| e.into_inner()) = Some(worker);
        let own = Arc::clone(&link);
        let thread = std::thread::Builder::new()
            .name(format!("link-node{}", config.node))
            .spawn(move || own.serve())?;
        *link.thread.lock().unwrap_or_else(|e| e.into_inner()) = Some(thread);
        Ok(link)
    }

    /// This device's node.
    pub fn node(&self) -> NodeId {
        self.node
    }

    /// Whether `node` is a node of the fabric (this one included).
    pub fn knows(&self, node: NodeId) -> bool {
        node == self.node || self.peers.contains_key(&node)
    }

    /// Hands a request that names another node to the link. Its
    /// completion comes back through the port's inbox.
    pub fn submit(&self, submission: Submission) {
        self.stats.started.fetch_add(1, Ordering::Relaxed);
        self.queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(submission);
        self.wake_if_asleep();
    }

    /// Sends an Ethernet frame of queue pair 0 (without virtio-net
    /// header) to node `node`, or to every node: best effort, as Ethernet
    /// is. Dropped (counted) when [`MAX_FRAMES_QUEUED`] wait already.
    pub fn send_frame(&self, node: Option<NodeId>, frame: &[u8]) {
        let mut frames = self.frames.lock().unwrap_or_else(|e| e.into_inner());
        if frames.len() >= MAX_FRAMES_QUEUED {
            self.stats.frames_dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        frames.push_back((node, frame.to_vec()));
        drop(frames);
        self.wake_if_asleep();
    }

    /// Whether requests of local ports handed to the link have not all
    /// completed yet.
    pub fn requests_in_flight(&self) -> bool {
        let s = &self.stats;
        // Finished ones first: a request counted as started after them
        // makes the answer yes, never a wrong no.
        let finished = s.completed.load(Ordering::Acquire) + s.failed.load(Ordering::Acquire);
        s.started.load(Ordering::Acquire) > finished
    }

    /// Wakes the thread if it sleeps (no system call while it polls).
    fn wake_if_asleep(&self) {
        if self.asleep.load(Ordering::SeqCst) {
            let _ = self.wake.write(1);
        }
    }

    /// Stops the thread (the device is shutting down).
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        let _ = self.wake.write(1);
        let thread = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(thread) = thread {
            let _ = thread.join();
        }
        // The worker holds the link: dropping it ends the cycle.
        self.worker.lock().unwrap_or_else(|e| e.into_inner()).take();
    }

    /// The link's own thread: runs passes while no port thread drives the
    /// link, and naps while one does.
    fn serve(&self) {
        let mut sharing = CoreSharing::new();
        while !self.stop.load(Ordering::Acquire) {
            if self.driven(Instant::now()) {
                self.nap();
                continue;
            }
            let mut guard = match self.worker.try_lock() {
                Ok(guard) => guard,
                Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) => {
                    // A port thread runs a pass right now.
                    self.nap();
                    continue;
                }
            };
            let Some(worker) = guard.as_mut() else {
                return;
            };
            let pass = worker.pass();
            if !pass.spinning {
                worker.sleep();
            } else if !pass.worked {
                // Polling with nothing to do: give the core to a thread
                // that has work (a port, a driver) only while one waits
                // for it.
                drop(guard);
                sharing.looked(Instant::now());
                sharing.pause();
            }
        }
    }

    /// Whether a port thread ran a pass within [`DRIVEN_LAPSE`] of `now`.
    fn driven(&self, now: Instant) -> bool {
        let at = self.driven_at.load(Ordering::Acquire);
        at != 0
            && (now.duration_since(self.epoch).as_nanos() as u64).saturating_sub(at)
                < DRIVEN_LAPSE.as_nanos() as u64
    }

    /// Sleeps on the wake eventfd alone (the driving port thread reads the
    /// socket) for at most [`DRIVEN_LAPSE`].
    fn nap(&self) {
        let mut fds = [libc::pollfd {
            fd: self.wake.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }];
        let wait = libc::timespec {
            tv_sec: 0,
            tv_nsec: DRIVEN_LAPSE.as_nanos() as libc::c_long,
        };
        // SAFETY: `fds` is a live array of one pollfd and `wait` a live
        // timespec; no signal mask is passed.
        unsafe { libc::ppoll(fds.as_mut_ptr(), 1, &wait, std::ptr::null()) };
        let _ = self.wake.read();
    }

    /// Runs one pass of the link's work on the calling thread (a
    /// busy-polling port thread, between its polls), unless another thread
    /// runs one now: the link's own thread then naps, and a request the
    /// port just handed to the link goes out with no thread in between.
    /// Returns whether the pass did work. `port` is the calling port's
    /// index.
    pub fn drive(&self, port: usize) -> bool {
        if self.drive_broken.load(Ordering::Relaxed) {
            return false;
        }
        let Ok(mut guard) = self.worker.try_lock() else {
            return false;
        };
        let Some(worker) = guard.as_mut() else {
            return false;
        };
        let pass = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| worker.pass()));
        drop(guard);
        match pass {
            Ok(pass) => {
                let now = Instant::now().duration_since(self.epoch).as_nanos() as u64;
                self.driver.store(port + 1, Ordering::Release);
                self.driven_at.store(now.max(1), Ordering::Release);
                if pass.worked {
                    self.stats.passes_on_ports.fetch_add(1, Ordering::Relaxed);
                }
                pass.worked
            }
            Err(_) => {
                // The worker's state is whatever the panic left: the link
                // ends, as it did when its own thread panicked.
                tracing::error!("a pass of the fabric link panicked: the link stops");
                self.drive_broken.store(true, Ordering::Relaxed);
                self.worker.lock().unwrap_or_else(|e| e.into_inner()).take();
                self.driven_at.store(0, Ordering::Release);
                let _ = self.wake.write(1);
                false
            }
        }
    }

    /// Port `port`'s thread stops polling (it goes to sleep): if it was
    /// the one driving the link, the link's own thread takes over at once.
    pub fn stop_driving(&self, port: usize) {
        if self.driver.load(Ordering::Acquire) == port + 1
            && self.driven_at.swap(0, Ordering::AcqRel) != 0
        {
            let _ = self.wake.write(1);
        }
    }

    /// One status line: `fabric node=.. peers=..` and the counters.
    pub fn status(&self) -> String {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let s = &self.stats;
        format!(
            "fabric node={} peers={} started={} completed={} failed={} served={} \
             bad_messages={} stray_datagrams={} dropped_datagrams={} datagrams_sent={} \
             datagrams_received={} retransmissions={} frames_sent={} frames_received={} \
             frames_dropped={} passes_on_ports={} memory_fixed={} memory_per_peer={} memory_peer_stats={} \
             memory_buffers={} macs_learnt={} macs_refused={}\n",
            self.node,
            self.peers.len(),
            g(&s.started),
            g(&s.completed),
            g(&s.failed),
            g(&s.served),
            g(&s.bad_messages),
            g(&s.stray_datagrams),
            g(&s.dropped_datagrams),
            g(&s.datagrams_sent),
            g(&s.datagrams_received),
            g(&s.retransmissions),
            g(&s.frames_sent),
            g(&s.frames_received),
            g(&s.frames_dropped),
            g(&s.passes_on_ports),
            self.memory.0,
            self.memory.1,
            // The per-peer counters, apart from the endpoint's state.
            std::mem::size_of::<(NodeId, PeerStats)>(),
            self.buffers,
            self.switch.learnt(),
            self.switch.refused(),
        ) + &self.peer_status()
    }

    /// One line per peer: `peer node=.. address=..`, its counters and a
    /// fresh snapshot of its protocol state (or the last one, if the
    /// link's thread does not publish one within [`SNAPSHOT_PATIENCE`]).
    pub fn peer_status(&self) -> String {
        self.await_snapshot();
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let mut out = String::new();
        for (node, p) in &self.peer_stats {
            let address = self
                .peers
                .get(node)
                .map_or_else(|| "-".to_string(), SocketAddr::to_string);
            out.push_str(&format!(
                "peer node={node} address={address} incarnation={:#x} datagrams_sent={} \
                 datagrams_received={} retransmissions={} dropped_datagrams={} duplicates={} \
                 abandoned={} gone={} gone_count={} restarts={} srtt_us={} rto_us={} outstanding={}\n",
                g(&p.incarnation),
                g(&p.datagrams_sent),
                g(&p.datagrams_received),
                g(&p.retransmissions),
                g(&p.dropped_datagrams),
                g(&p.duplicates),
                g(&p.abandoned),
                g(&p.gone),
                g(&p.gone_count),
                g(&p.restarts),
                g(&p.srtt_us),
                g(&p.rto_us),
                g(&p.outstanding),
            ));
        }
        out
    }

    /// The counters of peer `node`.
    pub fn peer_stats(&self, node: NodeId) -> Option<&PeerStats> {
        self.peer_stats.get(&node)
    }

    /// Asks the link's thread for a snapshot of the peers' protocol state
    /// and waits until it is published, at most [`SNAPSHOT_PATIENCE`].
    fn await_snapshot(&self) {
        let snapshots = &self.snapshots;
        let mut generations = snapshots
            .generations
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        generations.0 += 1;
        let wanted = generations.0;
        snapshots.wanted.store(true, Ordering::Release);
        // Wake the thread even if it polls: a write to the eventfd is
        // harmless then.
        let _ = self.wake.write(1);
        let deadline = Instant::now() + SNAPSHOT_PATIENCE;
        while generations.1 < wanted {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || self.stop.load(Ordering::Acquire) {
                break;
            }
            generations = snapshots
                .published
                .wait_timeout(generations, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// An operation under way towards another node: a request of a local
/// port, or a copy another node delegated to this one.
struct Op {
    /// Where its messages go.
    node: NodeId,
    /// Who gets the outcome.
    requester: Requester,
    /// The port whose rights are checked (the initiator, for a delegated
    /// copy the port that asked for it).
    origin: PortId,
    kind: OpKind,
    /// Messages sent and not yet acknowledged or abandoned.
    unacked: u32,
    /// The largest horizon of the acknowledgements received: answers to
    /// the operation have seqs below it.
    horizon: Option<Seq>,
    failure: Option<Failure>,
    /// When it last made progress (started, a part acknowledged, bytes of
    /// read data or an answer that changed its state arrived).
    progress: Instant,
    /// It made no progress for the operation timeout after it failed: it
    /// completes with its failure, waiting for nothing more (a peer that
    /// claims answers it never sends cannot hold it).
    expired: bool,
    /// The value its completion carries (the old word of an ATOMIC_TO
    /// whose old value this write carries).
    value: u64,
}

/// Whether the request `posted` names (a local port's, where it was
/// posted) is still of its send queue's epoch: the frontend did not reset
/// the queue since. Checked under the port's access gate before the link
/// moves the request's data, so that once a reset's barrier has passed no
/// more of it moves.
fn still_posted(posted: &Option<(Arc<Port>, PostedAt)>) -> bool {
    posted
        .as_ref()
        .is_none_or(|(port, at)| port.posted_epochs.current(at))
}

/// Who gets an operation's outcome.
enum Requester {
    /// A queue pair of a local port: a completion.
    Port {
        port: Arc<Port>,
        /// The port's incarnation when the request was taken: memory of
        /// a later frontend of the port is never touched for it.
        incarnation: u64,
        /// Where the request was posted.
        at: PostedAt,
        user_data: u64,
        opcode: Opcode,
        /// The request asked for a completion on success.
        signaled: bool,
    },
    /// Another node that delegated a copy: a RESULT.
    Node { node: NodeId, tag: u64 },
    /// An ATOMIC_TO of a local port whose old value goes to a third node,
    /// held while this operation (a CHECK of the destination) shows that
    /// the destination takes it: the atomic runs only then, so a
    /// destination that refuses leaves the word as it was. `incarnation`
    /// is the port's when the request was taken.
    Check {
        held: Box<Submission>,
        incarnation: u64,
    },
}

/// Where a write's bytes come from.
enum Source {
    /// The initiator's registered memory at this IOVA.
    Local(u64),
    /// Bytes the request carried.
    Inline(Vec<u8>),
    /// A window of a port of this device (a copy's source), read with the
    /// origin's rights.
    Window(RemoteAddress),
}

enum OpKind {
    Write {
        source: Source,
        remote: RemoteAddress,
        len: u32,
        sent: u32,
        /// A first part went (a write of no bytes sends one empty part:
        /// the target still checks the window).
        started: bool,
    },
    Read {
        local: u64,
        remote: RemoteAddress,
        len: u32,
        requested: bool,
        received: u32,
        /// The target said every byte was sent.
        finished: bool,
    },
    Atomic {
        remote: RemoteAddress,
        width: AtomicWidth,
        op: AtomicOp,
        requested: bool,
        value: Option<u64>,
    },
    /// A vector write, sent in parts that each carry the remote
    /// pattern of their bytes.
    VectorWrite {
        /// The local pattern (offsets from `base`).
        local: Plan<'static>,
        base: u64,
        /// The remote pattern (offsets from `remote.offset`).
        pattern: Plan<'static>,
        remote: RemoteAddress,
        len: u32,
        sent: u32,
        started: bool,
        /// The immediate value of the arrival notice the target queues
        /// (NOTIFY_TARGET): its last part carries it, sent once every
        /// other part is acknowledged and answered.
        notify: Option<u64>,
    },
    /// A vector read, asked for in parts that each carry the remote
    /// pattern of their bytes and are answered by one READ_DATA each.
    VectorRead {
        local: Plan<'static>,
        base: u64,
        pattern: Plan<'static>,
        remote: RemoteAddress,
        len: u32,
        requested: u32,
        received: u32,
    },
    /// An ATOMIC_TO delegated to the word's node (`Op::node`).
    AtomicTo {
        word: RemoteAddress,
        width: AtomicWidth,
        op: AtomicOp,
        destination: RemoteAddress,
        requested: bool,
        value: Option<u64>,
    },
    /// Whether the origin may write `len` bytes at `remote` (an ATOMIC_TO's
    /// destination on a third node, checked before the atomic runs).
    Check {
        remote: RemoteAddress,
        len: u32,
        requested: bool,
    },
    /// A copy delegated to the source's node (`Op::node`).
    Copy {
        source: RemoteAddress,
        destination: RemoteAddress,
        len: u32,
        requested: bool,
        done: bool,
    },
}

/// Where a read's answer lands in the initiator's memory.
enum Landing<'p> {
    /// From this IOVA on.
    At(u64),
    /// Along this plan, whose offsets count from this IOVA.
    Pattern(&'p Plan<'static>, u64),
}

/// The largest part (halving from `max_bytes`) of a pattern's bytes
/// `from..from + left` whose standalone pattern, encoded, and length
/// `fits`; `None` when not even one byte does (a pattern too intricate for
/// a datagram).
fn pattern_part(
    plan: &Plan<'_>,
    from: u64,
    left: u64,
    fits: impl Fn(usize, usize) -> bool,
    max_bytes: usize,
) -> Option<(u64, Vec<u8>)> {
    let mut len = left.min(max_bytes as u64).max(1);
    loop {
        let part = plan.slice(from, len.min(left));
        let encoded = part.encode();
        if fits(encoded.len(), len.min(left) as usize) {
            return Some((len.min(left), encoded));
        }
        if len == 1 {
            return None;
        }
        len /= 2;
    }
}

/// Decodes the pattern a part of a vector transfer carries: one pattern,
/// all of the bytes, its lists carried along.
fn part_plan(bytes: &[u8]) -> Result<Plan<'static>, Failure> {
    let malformed = (Status::InvalidRequest, ErrorDetail::Malformed);
    let (pattern, used): (Pattern, usize) = Pattern::decode(bytes, 0).map_err(|_| malformed)?;
    if used != bytes.len() || pattern.blocks_in_memory() != 0 {
        return Err(malformed);
    }
    pattern.into_plan().map_err(|_| malformed)
}

/// A read another node asked of a port here, being answered.
struct ReadJob {
    node: NodeId,
    origin: Origin,
    remote: RemoteAddress,
    len: u32,
    at: u32,
}

/// What the link's thread owns.
/// A delegation's index key: the node the operation is delegated to, and
/// the local port's index and incarnation.
type DelegationKey = (NodeId, u16, u64);

/// The key under which operation `kind` of local port `origin`, sent to
/// `node`, is indexed in `Worker::delegations`: copies and atomics whose
/// old value goes to a window, the operations that make `node` write
/// into a port of this node.
fn delegation_key(node: NodeId, origin: PortId, kind: &OpKind) -> Option<DelegationKey> {
    matches!(kind, OpKind::Copy { .. } | OpKind::AtomicTo { .. }).then_some((
        node,
        origin.index,
        origin.incarnation,
    ))
}

struct Worker {
    link: Arc<Link>,
    ports: Arc<PortTable>,
    switch: Arc<Switch>,
    socket: batch::Wire,
    endpoint: Endpoint,
    fault_in: Option<FaultInjector>,
    fault_out: Option<FaultInjector>,
    spin: Duration,
    poll: bool,
    ops: BTreeMap<u64, Op>,
    next_tag: u64,
    /// The operations' tags, taken once per pass.
    tags: Vec<u64>,
    /// Which operation each message in flight belongs to.
    seq_tags: HashMap<(NodeId, Seq), u64>,
    reads: VecDeque<ReadJob>,
    /// The tags of the copies and atomics with a destination word under
    /// way, by (the node they are delegated to, the local port that asked
    /// for them): what a write naming a port of this node is checked
    /// against, without a scan of every operation.
    delegations: HashMap<DelegationKey, Vec<u64>>,
    /// Copies other nodes delegated here, under way.
    delegated: usize,
    /// How long an operation may make no progress (no acknowledgement,
    /// no answer) before it fails with NodeUnreachable: a peer that
    /// acknowledges but never answers cannot hold it forever.
    op_timeout: Duration,
    /// Answers the endpoint could not take at once, per node, in order
    /// (sent first).
    deferred: BTreeMap<NodeId, VecDeque<Vec<u8>>>,
    /// Answers in `deferred`, all nodes.
    deferred_count: usize,
    /// Bytes the current pass may still copy between two windows of this
    /// node ([`LOCAL_COPY_BYTES_PER_PASS`]).
    local_copy_budget: usize,
    /// A copy between two windows of this node waits for the next pass's
    /// budget: the thread polls on rather than sleeping.
    local_copy_waits: bool,
    /// A request held for its destination's check was started after this
    /// pass produced: the next pass runs at once.
    resumed: bool,
    /// The message being built.
    message: Vec<u8>,
    /// Datagrams received in one system call.
    received: batch::Received,
    /// Datagrams of the pass, sent in one system call.
    outgoing: batch::Outgoing,
    /// Bytes being moved for the message being built.
    bytes: Vec<u8>,
    addresses: HashMap<SocketAddr, NodeId>,
    /// The datagram being sent.
    datagram: Vec<u8>,
    /// When a pass last did work.
    last_work: Instant,
}

/// What one pass of the link's work did.
struct Pass {
    worked: bool,
    /// The link should keep polling (operations under way in busy-poll
    /// mode, or work within the spin time).
    spinning: bool,
}

/// Where a failed operation's port is not reached.
fn unreachable_port(detail: ErrorDetail) -> Failure {
    match detail {
        ErrorDetail::PortDown => (Status::PeerGone, detail),
        detail => (Status::RemoteAccessError, detail),
    }
}

/// The failure of every operation to a node that is gone.
const GONE: Failure = (Status::PeerGone, ErrorDetail::NodeUnreachable);

/// Runs `f` on port `index`, lent for one guarded step.
fn on_port<T>(
    ports: &PortTable,
    index: u16,
    mut f: impl FnMut(&Target<'_>) -> Result<T, Failure>,
) -> Result<T, Failure> {
    let mut out = None;
    let outcome = with_port(ports, index, &mut |target| {
        out = Some(f(&target)?);
        Ok(Completion::success(0, Opcode::Nop, 0, 0))
    })
    .map_err(unreachable_port)?;
    outcome?;
    Ok(out.expect("set on success"))
}

impl Requester {
    /// The port and place a local port's request was posted at.
    fn posted(&self) -> Option<(Arc<Port>, PostedAt)> {
        match self {
            Requester::Port { port, at, .. } => Some((Arc::clone(port), *at)),
            _ => None,
        }
    }
}

impl Worker {
    /// One pass over everything: submissions, datagrams received, timers,
    /// the endpoint's events, operations to produce, frames, datagrams to
    /// send.
    fn pass(&mut self) -> Pass {
        let now = Instant::now();
        let mut worked = self.take_submissions();
        worked |= self.receive(now);
        if self.endpoint.poll_timeout().is_some_and(|at| at <= now) {
            self.endpoint.handle_timeout(now);
        }
        while let Some(event) = self.endpoint.poll_event() {
            self.on_event(event);
            worked = true;
        }
        worked |= self.produce(now);
        worked |= self.send_frames(now);
        self.finish_ops(now);
        let mut datagram = std::mem::take(&mut self.datagram);
        worked |= self.transmit(now, &mut datagram);
        self.datagram = datagram;
        self.outgoing.flush(&self.socket);
        self.publish_stats();
        if worked {
            self.last_work = now;
        }
        let under_way = !self.ops.is_empty() || !self.reads.is_empty();
        Pass {
            worked,
            spinning: (self.poll && under_way)
                || self.local_copy_waits
                || std::mem::take(&mut self.resumed)
                || now.duration_since(self.last_work) < self.spin,
        }
    }

    /// Sleeps until the socket is readable, a submission arrives, or the
    /// next timer (endpoint, fault injectors) is due.
    fn sleep(&self) {
        // Submitters write the eventfd only while the thread sleeps: say
        // so first, then look at the queues once more, so that a
        // submission made in between is not left waiting.
        self.link.asleep.store(true, Ordering::SeqCst);
        let queued = !self
            .link
            .queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty()
            || !self
                .link
                .frames
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_empty();
        if queued {
            self.link.asleep.store(false, Ordering::SeqCst);
            return;
        }
        let now = Instant::now();
        let due = [
            self.endpoint.poll_timeout(),
            self.fault_in.as_ref().and_then(FaultInjector::next_ready),
            self.fault_out.as_ref().and_then(FaultInjector::next_ready),
        ]
        .into_iter()
        .flatten()
        .min();
        let timeout = due.map(|at| at.saturating_duration_since(now));
        let timespec = timeout.map(|t| libc::timespec {
            tv_sec: t.as_secs().min(1) as libc::time_t,
            tv_nsec: if t.as_secs() >= 1 {
                0
            } else {
                libc::c_long::from(t.subsec_nanos() as i32)
            },
        });
        let mut fds = [
            libc::pollfd {
                fd: self.socket.fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.link.wake.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // At most a second, so that a stop is seen even without a wake.
        let second = libc::timespec {
            tv_sec: 1,
            tv_nsec: 0,
        };
        let wait = timespec.unwrap_or(second);
        // SAFETY: `fds` is a live array of two pollfds and `wait` a live
        // timespec; no signal mask is passed.
        unsafe { libc::ppoll(fds.as_mut_ptr(), 2, &wait, std::ptr::null()) };
        self.link.asleep.store(false, Ordering::SeqCst);
        let _ = self.link.wake.read();
    }

    fn take_submissions(&mut self) -> bool {
        let taken: Vec<Submission> = {
            let mut queue = self.link.queue.lock().unwrap_or_else(|e| e.into_inner());
            queue.drain(..).collect()
        };
        let worked = !taken.is_empty();
        for submission in taken {
            self.start(submission, false);
        }
        worked
    }

    /// Turns a submission into an operation (or completes it at once).
    /// `destination_checked`: an ATOMIC_TO held for its destination's
    /// check, which that destination passed.
    fn start(&mut self, submission: Submission, destination_checked: bool) {
        if !submission.port.posted_epochs.current(&submission.at) {
            // Its send queue was reset since it was posted (or an
            // ATOMIC_TO held for its destination's check): it does not
            // start.
            let Submission {
                port, at, request, ..
            } = submission;
            let reset = (Status::LocalProtectionError, ErrorDetail::Unregistered);
            return deliver(&self.link, &port, at, &request, Err(reset));
        }
        let incarnation = submission.port.shared.incarnation();
        let origin = PortId {
            node: self.link.node,
            index: submission.port.index as u16,
            incarnation,
        };
        if let Operation::AtomicTo {
            word,
            width,
            destination,
            ..
        } = submission.request.op
        {
            // The old value's destination is checked before the word
            // changes: here when it is a window of this node; by the
            // word's device when it is one of that node; else by a CHECK
            // sent to the destination's node, the atomic held until it
            // passed.
            let own = self.link.node;
            let len = u64::from(width.bytes());
            if destination.node == own {
                let checked = self.check_here(origin, destination, len, Access::REMOTE_WRITE);
                if let Err(failure) = checked {
                    let Submission {
                        port, at, request, ..
                    } = submission;
                    return deliver(&self.link, &port, at, &request, Err(failure));
                }
            } else if destination.node != word.node && !destination_checked {
                let probe = OpKind::Check {
                    remote: destination,
                    len: width.bytes(),
                    requested: false,
                };
                let requester = Requester::Check {
                    held: Box::new(submission),
                    incarnation,
                };
                self.insert_op(requester, origin, probe);
                return;
            }
        }
        let Submission {
            port,
            at,
            request,
            inline,
        } = submission;
        let mut value = 0;
        let write = |source, remote, len| OpKind::Write {
            source,
            remote,
            len,
            sent: 0,
            started: false,
        };
        let kind = match request.op {
            Operation::Write { local, len, remote } => write(Source::Local(local), remote, len),
            Operation::WriteInline { len, remote, .. } => {
                write(Source::Inline(inline), remote, len)
            }
            Operation::Read { local, len, remote } => OpKind::Read {
                local,
                remote,
                len,
                requested: false,
                received: 0,
                finished: false,
            },
            Operation::CompareSwap {
                remote,
                width,
                compare,
                swap,
            } => atomic(remote, width, AtomicOp::CompareSwap { compare, swap }),
            Operation::FetchAdd { remote, width, add } => {
                atomic(remote, width, AtomicOp::FetchAdd { add })
            }
            Operation::Swap {
                remote,
                width,
                value,
            } => atomic(remote, width, AtomicOp::Swap { value }),
            Operation::FetchBitwise {
                remote,
                width,
                op,
                mask,
            } => atomic(remote, width, AtomicOp::Bitwise { op, mask }),
            // The source's device carries a copy out; when that is this
            // one, the copy is a write from a window.
            Operation::Copy {
                source,
                destination,
                len,
            } if source.node == self.link.node => write(Source::Window(source), destination, len),
            // The word's device runs an ATOMIC_TO; when that is this one,
            // what is left is a write of the old value.
            Operation::AtomicTo {
                word,
                width,
                op,
                destination,
            } if word.node == self.link.node => {
                let old = on_port(&self.ports, word.port, |target| {
                    remote::atomic(target, origin, word, width, op)
                });
                match old {
                    Ok(old) => {
                        value = old;
                        let bytes = old.to_le_bytes()[..width.bytes() as usize].to_vec();
                        write(Source::Inline(bytes), destination, width.bytes())
                    }
                    Err(failure) => {
                        deliver(&self.link, &port, at, &request, Err(failure));
                        return;
                    }
                }
            }
            Operation::AtomicTo {
                word,
                width,
                op,
                destination,
            } => OpKind::AtomicTo {
                word,
                width,
                op,
                destination,
                requested: false,
                value: None,
            },
            Operation::Copy {
                source,
                destination,
                len,
            } => OpKind::Copy {
                source,
                destination,
                len,
                requested: false,
                done: false,
            },
            Operation::VectorWrite(vector) | Operation::VectorRead(vector) => {
                match self.plan_vector(&port, &vector, &inline) {
                    Err(failure) => {
                        deliver(&self.link, &port, at, &request, Err(failure));
                        return;
                    }
                    Ok((local, pattern)) if matches!(request.op, Operation::VectorWrite(_)) => {
                        OpKind::VectorWrite {
                            local,
                            base: vector.local,
                            pattern,
                            remote: vector.remote,
                            len: vector.len,
                            sent: 0,
                            started: false,
                            notify: vector.notify,
                        }
                    }
                    Ok((local, pattern)) => OpKind::VectorRead {
                        local,
                        base: vector.local,
                        pattern,
                        remote: vector.remote,
                        len: vector.len,
                        requested: 0,
                        received: 0,
                    },
                }
            }
            _ => {
                // The send queue hands over only these operations.
                let failure = (Status::InvalidRequest, ErrorDetail::Unsupported);
                deliver(&self.link, &port, at, &request, Err(failure));
                return;
            }
        };
        let requester = Requester::Port {
            port,
            incarnation,
            at,
            user_data: request.user_data,
            opcode: request.op.opcode(),
            signaled: request.flags.contains(WrFlags::SIGNALED),
        };
        let tag = self.insert_op(requester, origin, kind);
        if let Some(op) = self.ops.get_mut(&tag) {
            op.value = value;
        }
    }

    /// Takes a vector transfer's descriptor (carried, or in the
    /// initiator's memory), resolves its lists and plans both patterns.
    fn plan_vector(
        &self,
        port: &Port,
        vector: &VectorTransfer,
        inline: &[u8],
    ) -> Result<(Plan<'static>, Plan<'static>), Failure> {
        let own = port.index as u16;
        let limits = port.vector_limits;
        on_port(&self.ports, own, |local| {
            rdma::vector::prepare(own, local.memory, vector, inline, limits)
        })
        .map(rdma::VectorState::into_plans)
    }

    /// Files a new operation under a new tag.
    fn insert_op(&mut self, requester: Requester, origin: PortId, kind: OpKind) -> u64 {
        let node = match &kind {
            OpKind::Write { remote, .. }
            | OpKind::Read { remote, .. }
            | OpKind::Atomic { remote, .. }
            | OpKind::VectorWrite { remote, .. }
            | OpKind::VectorRead { remote, .. }
            | OpKind::Check { remote, .. } => remote.node,
            OpKind::Copy { source, .. } => source.node,
            OpKind::AtomicTo { word, .. } => word.node,
        };
        let known = node == self.link.node || self.link.peers.contains_key(&node);
        let tag = self.next_tag;
        self.next_tag += 1;
        if let Some(key) = delegation_key(node, origin, &kind) {
            self.delegations.entry(key).or_default().push(tag);
        }
        self.ops.insert(
            tag,
            Op {
                node,
                requester,
                origin,
                kind,
                unacked: 0,
                horizon: None,
                failure: (!known).then_some((Status::InvalidRequest, ErrorDetail::UnknownNode)),
                progress: Instant::now(),
                expired: false,
                value: 0,
            },
        );
        tag
    }

    /// Reads the datagrams waiting on the socket, at most
    /// [`RECEIVE_DATAGRAMS_PER_PASS`] in at most [`RECEIVE_CALLS_PER_PASS`]
    /// calls.
    fn receive(&mut self, now: Instant) -> bool {
        let mut worked = false;
        // The buffers stay allocated: a placeholder holds their place.
        let mut received = std::mem::replace(&mut self.received, batch::Received::empty());
        // Bounded: a pass may run on a port thread between its polls, and
        // datagrams keep coming as fast as anyone sends them (the rest
        // waits for the next pass).
        let mut taken = 0;
        for _ in 0..RECEIVE_CALLS_PER_PASS {
            if taken >= RECEIVE_DATAGRAMS_PER_PASS {
                break;
            }
            let count = match received.receive(&self.socket) {
                Ok(0) => break,
                Ok(count) => count,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // ICMP errors of earlier sends (a peer not up yet)
                    // surface here; the endpoint retransmits.
                    tracing::debug!("fabric socket: {e}");
                    continue;
                }
            };
            worked = true;
            taken += count;
            for i in 0..count {
                self.link
                    .stats
                    .datagrams_received
                    .fetch_add(1, Ordering::Relaxed);
                let Some((bytes, from)) = received.get(i) else {
                    // Cut short: nobody of the fabric sends such.
                    self.link
                        .stats
                        .dropped_datagrams
                        .fetch_add(1, Ordering::Relaxed);
                    continue;
                };
                let Some(&node) = self.addresses.get(&from) else {
                    self.link
                        .stats
                        .stray_datagrams
                        .fetch_add(1, Ordering::Relaxed);
                    continue;
                };
                if let Some(peer) = self.link.peer_stats.get(&node) {
                    peer.datagrams_received.fetch_add(1, Ordering::Relaxed);
                }
                if FrameDatagram::is_one(bytes)
                    && FrameDatagram::decode(bytes).map_or(true, |frame| frame.source != node)
                {
                    // A frame datagram must come from its node's address.
                    self.link
                        .stats
                        .frames_dropped
                        .fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                match &mut self.fault_in {
                    Some(faults) => faults.push(now, bytes),
                    None => self.handle_datagram(now, node, bytes),
                }
            }
            if !received.full() {
                break;
            }
        }
        self.received = received;
        while let Some(bytes) = self.fault_in.as_mut().and_then(|f| f.pop_ready(now)) {
            // The injector keeps datagrams, not their senders: the header
            // names the node (checked again by the endpoint).
            let node = if FrameDatagram::is_one(&bytes) {
                FrameDatagram::decode(&bytes).ok().map(|frame| frame.source)
            } else {
                Header::decode(&bytes).ok().map(|(header, _)| header.source)
            };
            self.handle_datagram(now, node.unwrap_or(self.link.node), &bytes);
            worked = true;
        }
        worked
    }

    /// Handles one datagram that came from `node`'s address.
    fn handle_datagram(&mut self, now: Instant, node: NodeId, datagram: &[u8]) {
        if FrameDatagram::is_one(datagram) {
            return self.receive_frame(datagram);
        }
        let duplicates = self.endpoint.stats().duplicates;
        let received = self.endpoint.receive(now, datagram);
        let peer = self.link.peer_stats.get(&node);
        if let Some(peer) = peer {
            let again = self.endpoint.stats().duplicates - duplicates;
            if again > 0 {
                peer.duplicates.fetch_add(again, Ordering::Relaxed);
            }
        }
        match received {
            Ok(Some(message)) => self.on_message(now, message.node, message.payload),
            Ok(None) => {}
            Err(reason) => {
                tracing::trace!("datagram dropped: {reason}");
                self.link
                    .stats
                    .dropped_datagrams
                    .fetch_add(1, Ordering::Relaxed);
                if let Some(peer) = peer {
                    peer.dropped_datagrams.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    /// Puts an Ethernet frame from another node on this device's switch.
    fn receive_frame(&self, datagram: &[u8]) {
        let frame = match FrameDatagram::decode(datagram) {
            Ok(frame)
                if frame.fabric == self.link.fabric
                    && frame.destination == self.link.node
                    && self.link.peers.contains_key(&frame.source)
                    && frame.frame.len() >= crate::switch::ETH_HDR_LEN =>
            {
                frame
            }
            _ => {
                self.link
                    .stats
                    .frames_dropped
                    .fetch_add(1, Ordering::Relaxed);
                return;
            }
        };
        if crate::switch::src_mac(frame.frame).is_some_and(|mac| self.ports.owns_mac(&mac)) {
            // Another node claims the address this device gives one of its
            // ports: it would divert that port's traffic.
            self.link
                .stats
                .frames_dropped
                .fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.link
            .stats
            .frames_received
            .fetch_add(1, Ordering::Relaxed);
        self.switch
            .forward(&self.ports, Station::Node(frame.source), frame.frame, None);
    }

    /// Sends the Ethernet frames local ports switched to other nodes.
    fn send_frames(&mut self, now: Instant) -> bool {
        let frames: Vec<(Option<NodeId>, Vec<u8>)> = {
            let mut queue = self.link.frames.lock().unwrap_or_else(|e| e.into_inner());
            queue.drain(..).collect()
        };
        let worked = !frames.is_empty();
        let mut datagram = Vec::new();
        for (node, frame) in frames {
            let nodes: Vec<NodeId> = match node {
                Some(node) => vec![node],
                None => self.link.peers.keys().copied().collect(),
            };
            for destination in nodes {
                let Some(&address) = self.link.peers.get(&destination) else {
                    continue;
                };
                datagram.clear();
                FrameDatagram {
                    fabric: self.link.fabric,
                    source: self.link.node,
                    destination,
                    frame: &frame,
                }
                .encode(&mut datagram);
                self.link.stats.frames_sent.fetch_add(1, Ordering::Relaxed);
                match &mut self.fault_out {
                    Some(faults) => faults.push(now, &datagram),
                    None => self.put_on_wire(destination, address, &datagram),
                }
            }
        }
        worked
    }

    /// Whether local port `origin` has a copy (or an atomic whose old
    /// value goes to a window) under way, delegated to `node`, whose
    /// destination holds `len` bytes at `offset` of window `key` of port
    /// `dst_port`.
    fn delegated_to(
        &self,
        node: NodeId,
        origin: Origin,
        dst_port: u16,
        key: pindown_uapi::RemoteKey,
        offset: u64,
        len: usize,
    ) -> bool {
        // The part carries the sender's tag, not the copy's: any copy of
        // that port delegated to the sender whose destination holds it.
        let Some(tags) = self
            .delegations
            .get(&(node, origin.port, origin.incarnation))
        else {
            return false;
        };
        tags.iter().filter_map(|tag| self.ops.get(tag)).any(|op| {
            let (destination, copied) = match &op.kind {
                OpKind::Copy {
                    destination, len, ..
                } => (destination, *len),
                OpKind::AtomicTo {
                    destination, width, ..
                } => (destination, width.bytes()),
                _ => return false,
            };
            let end = offset.checked_add(len as u64);
            // The index already matched the node and the port.
            destination.node == self.link.node
                && destination.port == dst_port
                && destination.key == key
                && offset >= destination.offset
                && end.is_some_and(|end| {
                    destination
                        .offset
                        .checked_add(u64::from(copied))
                        .is_some_and(|limit| end <= limit)
                })
        })
    }

    fn bad_message(&self, node: NodeId, what: &dyn std::fmt::Display) {
        tracing::debug!(node, "bad fabric message: {what}");
        self.link.stats.bad_messages.fetch_add(1, Ordering::Relaxed);
    }

    /// Handles one message a peer sent.
    fn on_message(&mut self, now: Instant, node: NodeId, payload: &[u8]) {
        let message = match Message::decode(payload) {
            Ok(message) => message,
            Err(error) => return self.bad_message(node, &error),
        };
        let own = self.link.node;
        // Only a write names a port of another node than its sender: the
        // part of a copy that node delegated to the sender.
        let origin_node = match &message {
            Message::Read { origin, .. }
            | Message::Atomic { origin, .. }
            | Message::AtomicTo { origin, .. }
            | Message::VectorWrite { origin, .. }
            | Message::VectorRead { origin, .. }
            | Message::Check { origin, .. }
            | Message::Copy { origin, .. } => Some(origin.node),
            _ => None,
        };
        if origin_node.is_some_and(|origin| origin != node) {
            return self.bad_message(node, &"a request for a port of another node");
        }
        if let Message::Write {
            origin,
            dst_port,
            key,
            offset,
            bytes,
        } = &message
        {
            // A write for a port of this node: only the part of a copy (or
            // the old value of an atomic) that port delegated to the
            // sender, into its destination.
            if origin.node == own
                && node != own
                && !self.delegated_to(node, *origin, *dst_port, *key, *offset, bytes.len())
            {
                self.bad_message(
                    node,
                    &"a write for a port of this node that delegated no such copy",
                );
                let (status, detail) = (Status::RemoteAccessError, ErrorDetail::NotGranted);
                return self.answer(now, node, origin.tag, status, detail, 0);
            }
        }
        let initiator = |origin: Origin| PortId {
            node: origin.node,
            index: origin.port,
            incarnation: origin.incarnation,
        };
        let at = |dst_port, key, offset| RemoteAddress {
            node: own,
            port: dst_port,
            key,
            offset,
        };
        match message {
            Message::Write {
                origin,
                dst_port,
                key,
                offset,
                bytes,
            } => {
                self.served();
                let remote = at(dst_port, key, offset);
                let written = on_port(&self.ports, dst_port, |target| {
                    remote::write_into(target, initiator(origin), remote, bytes)
                });
                if let Err((status, detail)) = written {
                    self.answer(now, node, origin.tag, status, detail, 0);
                }
            }
            Message::Read {
                origin,
                dst_port,
                key,
                offset,
                len,
            } => {
                self.served();
                let remote = at(dst_port, key, offset);
                let needed = Access::REMOTE_READ;
                match self.check_here(initiator(origin), remote, u64::from(len), needed) {
                    Err((status, detail)) => {
                        self.answer(now, node, origin.tag, status, detail, 0);
                    }
                    Ok(()) if self.reads.len() >= MAX_READ_JOBS => {
                        let (status, detail) = (Status::LimitReached, ErrorDetail::NodeBusy);
                        self.answer(now, node, origin.tag, status, detail, 0);
                    }
                    Ok(()) => self.reads.push_back(ReadJob {
                        node,
                        origin,
                        remote,
                        len,
                        at: 0,
                    }),
                }
            }
            Message::Check {
                origin,
                dst_port,
                key,
                offset,
                len,
            } => {
                self.served();
                let remote = at(dst_port, key, offset);
                let needed = Access::REMOTE_WRITE;
                let checked = self.check_here(initiator(origin), remote, u64::from(len), needed);
                if let Err((status, detail)) = checked {
                    self.answer(now, node, origin.tag, status, detail, 0);
                }
            }
            Message::Atomic {
                origin,
                dst_port,
                key,
                offset,
                width,
                op,
            } => {
                self.served();
                let remote = at(dst_port, key, offset);
                let old = on_port(&self.ports, dst_port, |target| {
                    remote::atomic(target, initiator(origin), remote, width, op)
                });
                let (status, detail, value) = match old {
                    Ok(value) => (Status::Success, ErrorDetail::None, value),
                    Err((status, detail)) => (status, detail, 0),
                };
                self.answer(now, node, origin.tag, status, detail, value);
            }
            Message::Copy {
                origin,
                dst_port,
                key,
                offset,
                destination,
                len,
            } => {
                self.served();
                let kind = OpKind::Write {
                    source: Source::Window(at(dst_port, key, offset)),
                    remote: destination,
                    len,
                    sent: 0,
                    started: false,
                };
                if self.delegated >= MAX_DELEGATED {
                    let (status, detail) = (Status::LimitReached, ErrorDetail::NodeBusy);
                    self.answer(now, node, origin.tag, status, detail, 0);
                    return;
                }
                self.delegated += 1;
                let requester = Requester::Node {
                    node,
                    tag: origin.tag,
                };
                self.insert_op(requester, initiator(origin), kind);
            }
            Message::VectorWrite {
                origin,
                dst_port,
                key,
                offset,
                pattern,
                bytes,
                notice,
            } => {
                self.served();
                let base = at(dst_port, key, offset);
                // Room for the arrival before the last part's bytes move:
                // a notice that could not be queued would be lost.
                let slot = match notice {
                    None => None,
                    Some(notice) => match self.reserve_notice(dst_port) {
                        Some(slot) => Some((slot, notice)),
                        None => {
                            let (status, detail) = (Status::LimitReached, ErrorDetail::NoticeLimit);
                            return self.answer(now, node, origin.tag, status, detail, 0);
                        }
                    },
                };
                let written = part_plan(pattern).and_then(|plan| {
                    on_port(&self.ports, dst_port, |target| {
                        remote::write_pattern(target, initiator(origin), base, &plan, bytes)
                    })
                });
                match (written, slot) {
                    (Err((status, detail)), _) => {
                        self.answer(now, node, origin.tag, status, detail, 0);
                    }
                    (Ok(()), Some((slot, notice))) => {
                        slot.deliver(Completion::arrival_notice(Arrival {
                            peer: PortAddress {
                                node: origin.node,
                                port: origin.port,
                            },
                            key,
                            bytes: notice.total,
                            immediate: notice.immediate,
                        }));
                    }
                    (Ok(()), None) => {}
                }
            }
            Message::VectorRead {
                origin,
                dst_port,
                key,
                offset,
                at: part_at,
                pattern,
            } => {
                self.served();
                let base = at(dst_port, key, offset);
                let room = self.endpoint.config().max_payload - READ_DATA_HEADER;
                let plan = part_plan(pattern).and_then(|plan| {
                    if plan.len() > room as u64 {
                        Err((Status::InvalidRequest, ErrorDetail::Malformed))
                    } else {
                        Ok(plan)
                    }
                });
                let mut bytes = std::mem::take(&mut self.bytes);
                let read = plan.and_then(|plan| {
                    let out = &mut bytes[..plan.len() as usize];
                    on_port(&self.ports, dst_port, |target| {
                        remote::read_pattern(target, initiator(origin), base, &plan, out)
                    })
                    .map(|()| plan.len() as usize)
                });
                match read {
                    Ok(len) => {
                        let mut answer = Vec::with_capacity(READ_DATA_HEADER + len);
                        Message::ReadData {
                            tag: origin.tag,
                            at: part_at,
                            bytes: &bytes[..len],
                        }
                        .encode(&mut answer);
                        self.send_answer(now, node, answer);
                    }
                    Err((status, detail)) => {
                        self.answer(now, node, origin.tag, status, detail, 0);
                    }
                }
                self.bytes = bytes;
            }
            Message::AtomicTo {
                origin,
                dst_port,
                key,
                offset,
                width,
                op,
                destination,
            } => {
                self.served();
                if self.delegated >= MAX_DELEGATED {
                    let (status, detail) = (Status::LimitReached, ErrorDetail::NodeBusy);
                    self.answer(now, node, origin.tag, status, detail, 0);
                    return;
                }
                let word = at(dst_port, key, offset);
                if destination.node == own {
                    // The old value's destination is a window of this
                    // node: checked before the word changes (the
                    // initiator checks one of its own node, and has one
                    // of a third node checked, before it asks).
                    let (len, needed) = (u64::from(width.bytes()), Access::REMOTE_WRITE);
                    let checked = self.check_here(initiator(origin), destination, len, needed);
                    if let Err((status, detail)) = checked {
                        return self.answer(now, node, origin.tag, status, detail, 0);
                    }
                }
                let old = on_port(&self.ports, dst_port, |target| {
                    remote::atomic(target, initiator(origin), word, width, op)
                });
                let old = match old {
                    Ok(old) => old,
                    Err((status, detail)) => {
                        self.answer(now, node, origin.tag, status, detail, 0);
                        return;
                    }
                };
                self.delegated += 1;
                let bytes = old.to_le_bytes()[..width.bytes() as usize].to_vec();
                let kind = OpKind::Write {
                    source: Source::Inline(bytes),
                    remote: destination,
                    len: width.bytes(),
                    sent: 0,
                    started: false,
                };
                let requester = Requester::Node {
                    node,
                    tag: origin.tag,
                };
                let tag = self.insert_op(requester, initiator(origin), kind);
                if let Some(op) = self.ops.get_mut(&tag) {
                    op.value = old;
                }
            }
            Message::ReadData { tag, at, bytes } => self.read_data(node, tag, at, bytes),
            Message::Result {
                tag,
                status,
                detail,
                value,
            } => self.result(node, tag, status, detail, value),
        }
    }

    fn served(&self) {
        self.link.stats.served.fetch_add(1, Ordering::Relaxed);
    }

    /// Whether `initiator` may access `len` bytes at `remote` (a window of
    /// a port of this node) as `needed` says, moving nothing.
    fn check_here(
        &self,
        initiator: PortId,
        remote: RemoteAddress,
        len: u64,
        needed: Access,
    ) -> Result<(), Failure> {
        on_port(&self.ports, remote.port, |target| {
            remote::check_access(target, initiator, remote, len, needed)
        })
    }

    /// Promises room for one arrival notice in port `index`'s queue, or
    /// `None` when it has none (or the port is unknown or down).
    fn reserve_notice(&self, index: u16) -> Option<rdma::NoticeSlot> {
        let port = self.ports.get(usize::from(index))?;
        port.inbox
            .reserve_notice()
            .then(|| rdma::NoticeSlot::new(port))
    }

    /// Whether every answer the peer `node` sent before `horizon` (the
    /// largest horizon of an operation's acknowledgements) has arrived:
    /// then a refusal of anything acknowledged is known.
    fn answered(&self, node: NodeId, horizon: Option<Seq>) -> bool {
        horizon.is_none_or(|h| {
            self.endpoint
                .delivered_through(node, Stream::Reply)
                .is_none_or(|through| !seq_before(through, h))
        })
    }

    /// Sends a RESULT (or keeps it for the next round when the endpoint
    /// cannot take it now).
    fn answer(
        &mut self,
        now: Instant,
        node: NodeId,
        tag: u64,
        status: Status,
        detail: ErrorDetail,
        value: u64,
    ) {
        let mut bytes = Vec::with_capacity(24);
        Message::Result {
            tag,
            status,
            detail,
            value,
        }
        .encode(&mut bytes);
        self.send_answer(now, node, bytes);
    }

    /// Sends an answer to `node` now, or keeps it when the endpoint has no
    /// room for it. It may pass answers to the node that wait: answers
    /// of different operations need no order, and an answer sent now
    /// lies below the horizon of the acknowledgements that follow (an
    /// operation's initiator counts on that to know of a refusal).
    fn send_answer(&mut self, now: Instant, node: NodeId, answer: Vec<u8>) {
        if self.send_reply(now, node, &answer).is_err() {
            self.defer(node, answer);
        }
    }

    /// Keeps an answer for when the endpoint has room, within
    /// [`MAX_DEFERRED_PER_NODE`] for its node and [`MAX_DEFERRED`] in all
    /// (beyond, the node's oldest is dropped, or this one when the node
    /// has none waiting).
    fn defer(&mut self, node: NodeId, answer: Vec<u8>) {
        let queue = self.deferred.entry(node).or_default();
        if queue.len() >= MAX_DEFERRED_PER_NODE || self.deferred_count >= MAX_DEFERRED {
            tracing::warn!(node, "fabric answers pile up: the oldest is dropped");
            if queue.pop_front().is_some() {
                self.deferred_count -= 1;
            }
            if self.deferred_count >= MAX_DEFERRED {
                // Every answer waiting is another node's: this one goes.
                return;
            }
        }
        queue.push_back(answer);
        self.deferred_count += 1;
    }

    /// Sends one request (a message the peer answers); `Ok(None)` when
    /// the peer is gone (the message is dropped with it), `Err` when the
    /// endpoint cannot take it now.
    fn send(&mut self, now: Instant, node: NodeId, bytes: &[u8]) -> Result<Option<Seq>, ()> {
        let sent = self.endpoint.send(now, node, bytes);
        Self::sent(node, sent)
    }

    /// Sends one reply (a message the peer does not answer), as
    /// [`send`](Self::send).
    fn send_reply(&mut self, now: Instant, node: NodeId, bytes: &[u8]) -> Result<Option<Seq>, ()> {
        let sent = self.endpoint.send_reply(now, node, bytes);
        Self::sent(node, sent)
    }

    fn sent(node: NodeId, sent: Result<Seq, SendError>) -> Result<Option<Seq>, ()> {
        match sent {
            Ok(seq) => Ok(Some(seq)),
            Err(error) if error.is_would_block() => Err(()),
            Err(SendError::PeerGone(_) | SendError::UnknownPeer(_)) => Ok(None),
            Err(error) => {
                tracing::warn!(node, "fabric message not sent: {error}");
                Ok(None)
            }
        }
    }

    /// Part of the answer to a read of ours: lands in place.
    fn read_data(&mut self, node: NodeId, tag: u64, at: u32, bytes: &[u8]) {
        let Some(op) = self.ops.get_mut(&tag).filter(|op| op.node == node) else {
            // A read that completed with an error already, or a stray.
            return self.bad_message(node, &"read data of no read of ours");
        };
        let (local, len, received) = match &mut op.kind {
            OpKind::Read {
                local,
                len,
                received,
                ..
            } => (Landing::At(*local), *len, received),
            OpKind::VectorRead {
                local,
                base,
                len,
                received,
                ..
            } => (Landing::Pattern(local, *base), *len, received),
            _ => return self.bad_message(node, &"read data for an operation that is no read"),
        };
        let len = &len;
        let end = u64::from(at) + bytes.len() as u64;
        if end > u64::from(*len) || u64::from(*received) + bytes.len() as u64 > u64::from(*len) {
            op.failure
                .get_or_insert((Status::RemoteAccessError, ErrorDetail::Malformed));
            return;
        }
        *received += bytes.len() as u32;
        if !bytes.is_empty() {
            op.progress = Instant::now();
        }
        if op.failure.is_some() {
            return;
        }
        let Requester::Port {
            port,
            incarnation,
            at: posted,
            ..
        } = &op.requester
        else {
            return;
        };
        let incarnation = *incarnation;
        let mut scratch = Vec::new();
        let landed = on_port(&self.ports, port.index as u16, |own| {
            if own.incarnation != incarnation || !port.posted_epochs.current(posted) {
                return Err((Status::LocalProtectionError, ErrorDetail::Unregistered));
            }
            match &local {
                Landing::At(iova) => remote::write_local(own, iova + u64::from(at), bytes),
                Landing::Pattern(plan, base) => {
                    scratch.clear();
                    scratch.extend_from_slice(bytes);
                    let blocks = plan.segments(u64::from(at), bytes.len() as u64);
                    remote::local_pattern(own, *base, blocks, &mut scratch, true)
                }
            }
        });
        if let Err(failure) = landed {
            op.failure = Some(failure);
        }
    }

    /// The outcome of an operation of ours.
    fn result(&mut self, node: NodeId, tag: u64, status: Status, detail: ErrorDetail, value: u64) {
        let Some(op) = self.ops.get_mut(&tag).filter(|op| op.node == node) else {
            return self.bad_message(node, &"result of no operation of ours");
        };
        // Only an answer that changes the operation is progress: repeated
        // ones cannot keep it alive.
        let changed = if status != Status::Success {
            let first = op.failure.is_none();
            op.failure.get_or_insert((status, detail));
            first
        } else {
            match &mut op.kind {
                OpKind::Read { finished, .. } => !std::mem::replace(finished, true),
                OpKind::Atomic { value: old, .. } | OpKind::AtomicTo { value: old, .. } => {
                    let first = old.is_none();
                    if first {
                        *old = Some(value);
                    }
                    first
                }
                OpKind::Copy { done, .. } => !std::mem::replace(done, true),
                OpKind::Write { .. }
                | OpKind::VectorWrite { .. }
                | OpKind::VectorRead { .. }
                | OpKind::Check { .. } => false,
            }
        };
        if changed {
            op.progress = Instant::now();
        }
    }

    fn on_event(&mut self, event: Event) {
        let count = |node: NodeId, counter: fn(&PeerStats) -> &AtomicU64| {
            if let Some(peer) = self.link.peer_stats.get(&node) {
                counter(peer).fetch_add(1, Ordering::Relaxed);
            }
        };
        match event {
            Event::Abandoned { node, .. } => count(node, |p| &p.abandoned),
            Event::PeerGone { node } => count(node, |p| &p.gone_count),
            Event::PeerRestarted { node } => count(node, |p| &p.restarts),
            _ => {}
        }
        match event {
            // Only requests belong to operations of ours; replies we sent
            // are nobody's concern once sent.
            Event::Acked {
                node,
                seq,
                horizon,
                stream: Stream::Request,
            } => {
                if let Some(op) = self
                    .seq_tags
                    .remove(&(node, seq))
                    .and_then(|tag| self.ops.get_mut(&tag))
                {
                    op.unacked -= 1;
                    op.progress = Instant::now();
                    op.horizon = Some(match op.horizon {
                        Some(h) if seq_before(horizon, h) => h,
                        _ => horizon,
                    });
                }
            }
            Event::Abandoned {
                node,
                seq,
                stream: Stream::Request,
            } => {
                if let Some(op) = self
                    .seq_tags
                    .remove(&(node, seq))
                    .and_then(|tag| self.ops.get_mut(&tag))
                {
                    op.unacked -= 1;
                    op.progress = Instant::now();
                    op.failure = Some(GONE);
                }
            }
            Event::Acked { .. } | Event::Abandoned { .. } => {}
            Event::PeerGone { node }
            | Event::PeerRestarted { node }
            | Event::PeerAbandoned { node, .. } => {
                tracing::warn!(node, "fabric peer gone or restarted: {event:?}");
                for op in self.ops.values_mut().filter(|op| op.node == node) {
                    op.failure = Some(GONE);
                    // Its messages were abandoned (reported before); the
                    // answers it waits for will not come.
                    op.horizon = None;
                }
                self.reads.retain(|job| job.node != node);
                self.switch.forget(Station::Node(node));
                if let Some(answers) = self.deferred.remove(&node) {
                    self.deferred_count -= answers.len();
                }
            }
        }
    }

    /// Sends what waits: deferred answers, parts of writes and read
    /// requests and atomics of ours, parts of reads of other nodes.
    fn produce(&mut self, now: Instant) -> bool {
        let mut worked = false;
        self.local_copy_budget = LOCAL_COPY_BYTES_PER_PASS;
        self.local_copy_waits = false;
        // Each node's waiting answers in order; a node without room waits
        // alone.
        let mut deferred = std::mem::take(&mut self.deferred);
        for (&node, answers) in deferred.iter_mut() {
            while let Some(bytes) = answers.front() {
                if self.send_reply(now, node, bytes).is_err() {
                    break;
                }
                answers.pop_front();
                self.deferred_count -= 1;
                worked = true;
            }
        }
        // Sending defers nothing: the map taken is the whole of it.
        deferred.retain(|_, answers| !answers.is_empty());
        self.deferred = deferred;
        // The tags of the pass, in a buffer kept from pass to pass (the
        // loop runs while operations are under way: no allocation in it).
        let mut tags = std::mem::take(&mut self.tags);
        tags.clear();
        tags.extend(self.ops.keys().copied());
        for &tag in &tags {
            worked |= self.produce_op(now, tag);
        }
        self.tags = tags;
        worked | self.produce_reads(now)
    }

    /// Sends what operation `tag` can send now.
    fn produce_op(&mut self, now: Instant, tag: u64) -> bool {
        let mut worked = false;
        loop {
            let Some(op) = self.ops.get(&tag) else {
                return worked;
            };
            if op.failure.is_some() {
                return worked;
            }
            let origin = origin_of(op.origin, tag);
            let node = op.node;
            self.message.clear();
            let request = match &op.kind {
                OpKind::Write { .. } => {
                    match self.write_part(now, tag) {
                        Some(true) => worked = true,
                        Some(false) => return true,
                        None => return worked,
                    }
                    continue;
                }
                OpKind::VectorWrite { .. } => {
                    match self.vector_write_part(now, tag) {
                        Some(true) => worked = true,
                        Some(false) => return true,
                        None => return worked,
                    }
                    continue;
                }
                OpKind::VectorRead { .. } => {
                    match self.vector_read_part(now, tag) {
                        Some(true) => worked = true,
                        Some(false) => return true,
                        None => return worked,
                    }
                    continue;
                }
                OpKind::Read {
                    remote,
                    len,
                    requested: false,
                    ..
                } => Message::Read {
                    origin,
                    dst_port: remote.port,
                    key: remote.key,
                    offset: remote.offset,
                    len: *len,
                },
                OpKind::Atomic {
                    remote,
                    width,
                    op: atomic,
                    requested: false,
                    ..
                } => Message::Atomic {
                    origin,
                    dst_port: remote.port,
                    key: remote.key,
                    offset: remote.offset,
                    width: *width,
                    op: *atomic,
                },
                OpKind::AtomicTo {
                    word,
                    width,
                    op: atomic,
                    destination,
                    requested: false,
                    ..
                } => Message::AtomicTo {
                    origin,
                    dst_port: word.port,
                    key: word.key,
                    offset: word.offset,
                    width: *width,
                    op: *atomic,
                    destination: *destination,
                },
                OpKind::Check {
                    remote,
                    len,
                    requested: false,
                } => Message::Check {
                    origin,
                    dst_port: remote.port,
                    key: remote.key,
                    offset: remote.offset,
                    len: *len,
                },
                OpKind::Copy {
                    source,
                    destination,
                    len,
                    requested: false,
                    ..
                } => Message::Copy {
                    origin,
                    dst_port: source.port,
                    key: source.key,
                    offset: source.offset,
                    destination: *destination,
                    len: *len,
                },
                _ => return worked,
            };
            request.encode(&mut self.message);
            return self.send_request(now, tag, node) | worked;
        }
    }

    /// Sends the next part of vector write `tag`: the bytes gathered from
    /// the local pattern, with the remote pattern of just those bytes.
    /// Returns as [`write_part`](Self::write_part) does.
    fn vector_write_part(&mut self, now: Instant, tag: u64) -> Option<bool> {
        let max_payload = self.endpoint.config().max_payload;
        let op = self.ops.get(&tag)?;
        // Every earlier part acknowledged, and every answer sent before
        // those acknowledgements received (none refused, or the operation
        // would have failed): the notifying last part may go.
        let earlier_landed = op.unacked == 0 && self.answered(op.node, op.horizon);
        let op = self.ops.get_mut(&tag)?;
        let origin = op.origin;
        let posted = op.requester.posted();
        let OpKind::VectorWrite {
            local,
            base,
            pattern,
            remote,
            len,
            sent,
            started,
            notify,
        } = &mut op.kind
        else {
            return None;
        };
        if *started && *sent == *len {
            return None;
        }
        // Every part of a notifying write has room for the notice: which
        // one is last is known only once it is cut.
        let room = match notify {
            None => max_payload - WRITE_HEADER,
            Some(_) => max_payload - WRITE_HEADER - PART_NOTICE_LEN,
        };
        let from = u64::from(*sent);
        let left = u64::from(*len - *sent);
        let fits = |encoded: usize, bytes: usize| encoded + bytes <= room;
        let Some((part, encoded)) = pattern_part(pattern, from, left, fits, room) else {
            op.failure = Some((Status::LimitReached, ErrorDetail::PatternLimit));
            return Some(false);
        };
        let last = from + part == u64::from(*len);
        let notice = match *notify {
            Some(immediate) if last => {
                if !earlier_landed {
                    // Sent once the earlier parts are known to have landed.
                    return None;
                }
                Some(PartNotice {
                    immediate,
                    total: *len,
                })
            }
            _ => None,
        };
        let (base, remote) = (*base, *remote);
        let bytes = &mut self.bytes[..part as usize];
        let blocks = local.segments(from, part);
        let gathered = on_port(&self.ports, origin.index, |own| {
            if own.incarnation != origin.incarnation || !still_posted(&posted) {
                return Err((Status::LocalProtectionError, ErrorDetail::Unregistered));
            }
            remote::local_pattern(own, base, blocks.clone(), bytes, false)
        });
        if let Err(failure) = gathered {
            op.failure = Some(failure);
            return Some(false);
        }
        self.message.clear();
        Message::VectorWrite {
            origin: origin_of(origin, tag),
            dst_port: remote.port,
            key: remote.key,
            offset: remote.offset,
            pattern: &encoded,
            bytes: &self.bytes[..part as usize],
            notice,
        }
        .encode(&mut self.message);
        let went = self.send_part(now, tag, remote.node);
        if went == Some(true) {
            if let Some(OpKind::VectorWrite { sent, started, .. }) =
                self.ops.get_mut(&tag).map(|op| &mut op.kind)
            {
                *sent += part as u32;
                *started = true;
            }
        }
        went
    }

    /// Asks for the next part of vector read `tag`: the remote pattern of
    /// as many bytes as one READ_DATA carries. Returns as
    /// [`write_part`](Self::write_part) does.
    fn vector_read_part(&mut self, now: Instant, tag: u64) -> Option<bool> {
        let max_payload = self.endpoint.config().max_payload;
        let op = self.ops.get_mut(&tag)?;
        let origin = op.origin;
        let OpKind::VectorRead {
            pattern,
            remote,
            len,
            requested,
            ..
        } = &mut op.kind
        else {
            return None;
        };
        if *requested == *len {
            return None;
        }
        let from = u64::from(*requested);
        let left = u64::from(*len - *requested);
        let fits = |encoded: usize, _| encoded <= max_payload - WRITE_HEADER - 4;
        let max_bytes = max_payload - READ_DATA_HEADER;
        let Some((part, encoded)) = pattern_part(pattern, from, left, fits, max_bytes) else {
            op.failure = Some((Status::LimitReached, ErrorDetail::PatternLimit));
            return Some(false);
        };
        let remote = *remote;
        self.message.clear();
        Message::VectorRead {
            origin: origin_of(origin, tag),
            dst_port: remote.port,
            key: remote.key,
            offset: remote.offset,
            at: from as u32,
            pattern: &encoded,
        }
        .encode(&mut self.message);
        let went = self.send_part(now, tag, remote.node);
        if went == Some(true) {
            if let Some(OpKind::VectorRead { requested, .. }) =
                self.ops.get_mut(&tag).map(|op| &mut op.kind)
            {
                *requested += part as u32;
            }
        }
        went
    }

    /// Moves the next part of write `tag`: into a window of this device
    /// directly, or as a message to the target's node. `Some(true)`: a
    /// part went; `Some(false)`: the write failed; `None`: nothing to do
    /// now (done, or the endpoint cannot take a message).
    fn write_part(&mut self, now: Instant, tag: u64) -> Option<bool> {
        let max = self.endpoint.config().max_payload - WRITE_HEADER;
        let own = self.link.node;
        let op = self.ops.get_mut(&tag)?;
        let origin = op.origin;
        let posted = op.requester.posted();
        let OpKind::Write {
            source,
            remote,
            len,
            sent,
            started,
        } = &mut op.kind
        else {
            return None;
        };
        if *started && *sent == *len {
            return None;
        }
        let chunk = (*len - *sent).min(max as u32) as usize;
        if remote.node == own {
            if self.local_copy_budget < chunk {
                // This pass copied its share here: the next one goes on.
                // Waiting for this node's own budget (older copies first)
                // is not a peer's silence: the operation timeout does
                // not run meanwhile (400 copies of 16 MiB asked at once
                // failed their last ones as unreachable).
                self.local_copy_waits = true;
                op.progress = now;
                return None;
            }
            self.local_copy_budget -= chunk;
        }
        let at = *sent;
        let remote = RemoteAddress {
            offset: remote.offset + u64::from(at),
            ..*remote
        };
        let bytes = &mut self.bytes[..chunk];
        let read = match source {
            Source::Inline(inline) => {
                bytes.copy_from_slice(&inline[at as usize..][..chunk]);
                Ok(())
            }
            Source::Local(iova) => {
                let iova = *iova + u64::from(at);
                on_port(&self.ports, origin.index, |own| {
                    if own.incarnation != origin.incarnation || !still_posted(&posted) {
                        return Err((Status::LocalProtectionError, ErrorDetail::Unregistered));
                    }
                    remote::read_local(own, iova, bytes)
                })
            }
            Source::Window(window) => {
                let window = RemoteAddress {
                    offset: window.offset + u64::from(at),
                    ..*window
                };
                on_port(&self.ports, window.port, |target| {
                    remote::read_from(target, origin, window, bytes)
                })
            }
        };
        if let Err(failure) = read {
            op.failure = Some(failure);
            return Some(false);
        }
        if remote.node == own {
            // A copy whose two windows are both here.
            let bytes = &self.bytes[..chunk];
            let written = on_port(&self.ports, remote.port, |target| {
                remote::write_into(target, origin, remote, bytes)
            });
            let op = self.ops.get_mut(&tag)?;
            if let Err(failure) = written {
                op.failure = Some(failure);
                return Some(false);
            }
            if let OpKind::Write { sent, started, .. } = &mut op.kind {
                *sent += chunk as u32;
                *started = true;
            }
            op.progress = now;
            return Some(true);
        }
        self.message.clear();
        Message::Write {
            origin: origin_of(origin, tag),
            dst_port: remote.port,
            key: remote.key,
            offset: remote.offset,
            bytes: &self.bytes[..chunk],
        }
        .encode(&mut self.message);
        let went = self.send_part(now, tag, remote.node);
        if went == Some(true) {
            if let Some(OpKind::Write { sent, started, .. }) =
                self.ops.get_mut(&tag).map(|op| &mut op.kind)
            {
                *sent += chunk as u32;
                *started = true;
            }
        }
        went
    }

    /// Sends the request message built for a read, an atomic or a copy.
    fn send_request(&mut self, now: Instant, tag: u64, node: NodeId) -> bool {
        match self.send_part(now, tag, node) {
            None => false,
            Some(false) => true,
            Some(true) => {
                if let Some(
                    OpKind::Read { requested, .. }
                    | OpKind::Atomic { requested, .. }
                    | OpKind::AtomicTo { requested, .. }
                    | OpKind::Check { requested, .. }
                    | OpKind::Copy { requested, .. },
                ) = self.ops.get_mut(&tag).map(|op| &mut op.kind)
                {
                    *requested = true;
                }
                true
            }
        }
    }

    /// Sends the message built in `self.message` to `node` as a request of
    /// operation `tag`: `Some(true)` when it went (the operation waits for
    /// its acknowledgement), `Some(false)` when the peer is gone (the
    /// operation fails), `None` when the endpoint cannot take it now.
    fn send_part(&mut self, now: Instant, tag: u64, node: NodeId) -> Option<bool> {
        let message = std::mem::take(&mut self.message);
        let sent = self.send(now, node, &message);
        self.message = message;
        let op = self.ops.get_mut(&tag)?;
        match sent {
            Err(()) => None,
            Ok(None) => {
                op.failure = Some(GONE);
                Some(false)
            }
            Ok(Some(seq)) => {
                op.unacked += 1;
                self.seq_tags.insert((node, seq), tag);
                Some(true)
            }
        }
    }

    /// Sends parts of the reads other nodes asked for, oldest first for
    /// each node; a node whose replies have no room waits alone.
    fn produce_reads(&mut self, now: Instant) -> bool {
        let max = self.endpoint.config().max_payload - READ_DATA_HEADER;
        let mut worked = false;
        let mut waiting: Vec<NodeId> = Vec::new();
        let mut index = 0;
        while let Some(job) = self.reads.get(index) {
            let (node, tag) = (job.node, job.origin.tag);
            if waiting.contains(&node) {
                index += 1;
                continue;
            }
            if job.at == job.len {
                // Every byte went out: the last word says so.
                let mut bytes = Vec::with_capacity(24);
                Message::Result {
                    tag,
                    status: Status::Success,
                    detail: ErrorDetail::None,
                    value: 0,
                }
                .encode(&mut bytes);
                if self.send_reply(now, node, &bytes).is_err() {
                    waiting.push(node);
                    index += 1;
                    continue;
                }
                self.reads.remove(index);
                worked = true;
                continue;
            }
            let chunk = (job.len - job.at).min(max as u32) as usize;
            let remote = RemoteAddress {
                offset: job.remote.offset + u64::from(job.at),
                ..job.remote
            };
            let initiator = PortId {
                node,
                index: job.origin.port,
                incarnation: job.origin.incarnation,
            };
            let at = job.at;
            let bytes = &mut self.bytes[..chunk];
            let read = on_port(&self.ports, remote.port, |target| {
                remote::read_from(target, initiator, remote, bytes)
            });
            if let Err((status, detail)) = read {
                // A window revoked, a port reset: the read ends here.
                self.reads.remove(index);
                self.answer(now, node, tag, status, detail, 0);
                worked = true;
                continue;
            }
            self.message.clear();
            Message::ReadData {
                tag,
                at,
                bytes: &self.bytes[..chunk],
            }
            .encode(&mut self.message);
            let message = std::mem::take(&mut self.message);
            let sent = self.send_reply(now, node, &message);
            self.message = message;
            match sent {
                Err(()) => {
                    waiting.push(node);
                    index += 1;
                    continue;
                }
                Ok(None) => {
                    self.reads.remove(index);
                }
                Ok(Some(_)) => {
                    if let Some(job) = self.reads.get_mut(index) {
                        job.at += chunk as u32;
                    }
                }
            }
            worked = true;
        }
        worked
    }

    /// Completes the operations that are done.
    fn finish_ops(&mut self, now: Instant) {
        let op_timeout = self.op_timeout;
        for op in self.ops.values_mut() {
            if op.expired || now.saturating_duration_since(op.progress) <= op_timeout {
                continue;
            }
            tracing::warn!(
                node = op.node,
                "fabric operation made no progress: given up"
            );
            match op.failure {
                None => op.failure = Some(GONE),
                Some(_) => op.expired = true,
            }
        }
        let done: Vec<u64> = self
            .ops
            .iter()
            .filter(|(_, op)| self.is_done(op))
            .map(|(&tag, _)| tag)
            .collect();
        for tag in done {
            let op = self.ops.remove(&tag).expect("listed");
            if let Some(key) = delegation_key(op.node, op.origin, &op.kind) {
                if let Some(tags) = self.delegations.get_mut(&key) {
                    tags.retain(|&t| t != tag);
                    if tags.is_empty() {
                        self.delegations.remove(&key);
                    }
                }
            }
            let outcome = match op.failure {
                Some(failure) => Err(failure),
                None => Ok(match op.kind {
                    OpKind::Write { len, .. } => (len, op.value),
                    OpKind::Read { len, .. }
                    | OpKind::Copy { len, .. }
                    | OpKind::VectorWrite { len, .. }
                    | OpKind::VectorRead { len, .. }
                    | OpKind::Check { len, .. } => (len, 0),
                    OpKind::Atomic { width, value, .. } | OpKind::AtomicTo { width, value, .. } => {
                        (width.bytes(), value.unwrap_or(0))
                    }
                }),
            };
            match op.requester {
                Requester::Port {
                    port,
                    incarnation: _,
                    at,
                    user_data,
                    opcode,
                    signaled,
                } => {
                    let completion = match outcome {
                        Ok((len, value)) => {
                            self.link.stats.completed.fetch_add(1, Ordering::Relaxed);
                            Completion::success(user_data, opcode, len, value)
                        }
                        Err((status, detail)) => {
                            self.link.stats.failed.fetch_add(1, Ordering::Relaxed);
                            Completion::error(user_data, Some(opcode), status, detail)
                        }
                    };
                    // Also when the port has a new owner or frontend since
                    // (RESET_OWNER, a reconnection): its send queue drops a
                    // completion of an older epoch, and stops counting the
                    // request against its requests on the link.
                    let done = LinkCompletion {
                        completion,
                        signaled,
                        at,
                    };
                    port.inbox.deliver_completion(done);
                }
                Requester::Node { node, tag } => {
                    self.delegated -= 1;
                    let (status, detail, value) = match outcome {
                        Ok((_, value)) => (Status::Success, ErrorDetail::None, value),
                        Err((status, detail)) => (status, detail, 0),
                    };
                    self.answer(now, node, tag, status, detail, value);
                }
                Requester::Check { held, incarnation } => {
                    if held.port.shared.incarnation() != incarnation {
                        // The frontend that asked is gone: so is its
                        // request (failed; its send queue drops the
                        // completion of an older epoch).
                        let Submission {
                            port, at, request, ..
                        } = *held;
                        let gone = (Status::LocalProtectionError, ErrorDetail::Unregistered);
                        deliver(&self.link, &port, at, &request, Err(gone));
                        continue;
                    }
                    match outcome {
                        Ok(_) => {
                            self.start(*held, true);
                            // Its request goes out in the next pass, at
                            // once (no sleep in between).
                            self.resumed = true;
                        }
                        Err(failure) => {
                            let Submission {
                                port, at, request, ..
                            } = *held;
                            deliver(&self.link, &port, at, &request, Err(failure));
                        }
                    }
                }
            }
        }
    }

    fn is_done(&self, op: &Op) -> bool {
        if op.unacked > 0 {
            // Nothing of an operation is in flight when it completes.
            return false;
        }
        let answered = |horizon: Option<Seq>| self.answered(op.node, horizon);
        match &op.kind {
            _ if op.failure == Some(GONE) || op.expired => true,
            // Every part acknowledged, and every answer sent before the
            // acknowledgements received: a refused part is known.
            OpKind::Write {
                len,
                sent,
                started,
                remote,
                ..
            } => {
                let all_went = *started && *sent == *len;
                let all_landed = remote.node == self.link.node || op.horizon.is_some();
                (op.failure.is_some() || (all_went && all_landed)) && answered(op.horizon)
            }
            // Read data arriving after a failure is dropped (the tag is
            // gone).
            OpKind::Read {
                len,
                received,
                finished,
                ..
            } => op.failure.is_some() || (*finished && *received == *len),
            OpKind::Atomic { value, .. } | OpKind::AtomicTo { value, .. } => {
                op.failure.is_some() || value.is_some()
            }
            OpKind::Copy { done, .. } => op.failure.is_some() || *done,
            // Acknowledged, and the answers sent before received: a
            // refusal is known.
            OpKind::Check { requested, .. } => {
                (op.failure.is_some() || (*requested && op.horizon.is_some()))
                    && answered(op.horizon)
            }
            OpKind::VectorWrite {
                len, sent, started, ..
            } => {
                (op.failure.is_some() || (*started && *sent == *len && op.horizon.is_some()))
                    && answered(op.horizon)
            }
            OpKind::VectorRead { len, received, .. } => op.failure.is_some() || received == len,
        }
    }

    /// Puts what the endpoint has to send on the wire.
    fn transmit(&mut self, now: Instant, datagram: &mut [u8]) -> bool {
        let mut worked = false;
        let mut retransmissions = self.endpoint.stats().retransmissions;
        while let Some((node, len)) = self.endpoint.poll_transmit(now, datagram) {
            worked = true;
            let now_retransmitted = self.endpoint.stats().retransmissions;
            if let Some(peer) = self.link.peer_stats.get(&node) {
                // The datagram just taken went to `node`: what it sent
                // again was sent again to `node`.
                peer.retransmissions
                    .fetch_add(now_retransmitted - retransmissions, Ordering::Relaxed);
            }
            retransmissions = now_retransmitted;
            let Some(&address) = self.link.peers.get(&node) else {
                continue;
            };
            match &mut self.fault_out {
                Some(faults) => faults.push(now, &datagram[..len]),
                None => self.put_on_wire(node, address, &datagram[..len]),
            }
        }
        if self.fault_out.is_some() {
            while let Some(bytes) = self.fault_out.as_mut().and_then(|f| f.pop_ready(now)) {
                // The injector keeps datagrams, not their destinations:
                // the header names the node.
                let destination = if FrameDatagram::is_one(&bytes) {
                    FrameDatagram::decode(&bytes)
                        .ok()
                        .map(|frame| frame.destination)
                } else {
                    Header::decode(&bytes)
                        .ok()
                        .map(|(header, _)| header.destination)
                };
                if let Some((node, address)) =
                    destination.and_then(|node| Some((node, self.link.peers.get(&node).copied()?)))
                {
                    self.put_on_wire(node, address, &bytes);
                }
                worked = true;
            }
        }
        worked
    }

    /// Queues a datagram for the pass's batch ([`batch::Outgoing`]).
    fn put_on_wire(&mut self, node: NodeId, address: SocketAddr, bytes: &[u8]) {
        self.link
            .stats
            .datagrams_sent
            .fetch_add(1, Ordering::Relaxed);
        if let Some(peer) = self.link.peer_stats.get(&node) {
            peer.datagrams_sent.fetch_add(1, Ordering::Relaxed);
        }
        self.outgoing.push(&self.socket, address, bytes);
    }

    fn publish_stats(&self) {
        let stats = self.endpoint.stats();
        self.link
            .stats
            .retransmissions
            .store(stats.retransmissions, Ordering::Relaxed);
        if self.link.snapshots.wanted.swap(false, Ordering::AcqRel) {
            self.publish_snapshot();
        }
    }

    /// Publishes every peer's protocol state ([`Link::peer_status`] asked
    /// for it).
    fn publish_snapshot(&self) {
        let snapshots = &self.link.snapshots;
        let asked = snapshots
            .generations
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .0;
        let micros = |d: Option<Duration>| d.map_or(0, |d| d.as_micros() as u64);
        for (&node, peer) in &self.link.peer_stats {
            let e = &self.endpoint;
            peer.incarnation
                .store(e.peer_incarnation(node).unwrap_or(0), Ordering::Relaxed);
            peer.srtt_us.store(micros(e.srtt(node)), Ordering::Relaxed);
            peer.rto_us.store(micros(e.rto(node)), Ordering::Relaxed);
            peer.outstanding
                .store(e.outstanding(node).unwrap_or(0) as u64, Ordering::Relaxed);
            peer.gone
                .store(u64::from(e.is_gone(node)), Ordering::Relaxed);
        }
        let mut generations = snapshots
            .generations
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        generations.1 = generations.1.max(asked);
        snapshots.published.notify_all();
    }
}

/// How messages of operation `tag` name the port whose rights count.
fn origin_of(origin: PortId, tag: u64) -> Origin {
    Origin {
        node: origin.node,
        port: origin.index,
        incarnation: origin.incarnation,
        tag,
    }
}

fn atomic(remote: RemoteAddress, width: AtomicWidth, op: AtomicOp) -> OpKind {
    OpKind::Atomic {
        remote,
        width,
        op,
        requested: false,
        value: None,
    }
}

/// Completes a request that never became an operation.
fn deliver(
    link: &Link,
    port: &Port,
    at: PostedAt,
    request: &WorkRequest,
    outcome: Result<(), Failure>,
) {
    let opcode = request.op.opcode();
    let completion = match outcome {
        Ok(()) => Completion::success(request.user_data, opcode, 0, 0),
        Err((status, detail)) => {
            link.stats.failed.fetch_add(1, Ordering::Relaxed);
            Completion::error(request.user_data, Some(opcode), status, detail)
        }
    };
    let done = LinkCompletion {
        completion,
        signaled: true,
        at,
    };
    port.inbox.deliver_completion(done);
}
