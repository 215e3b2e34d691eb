//! The device process: listening sockets, one thread per frontend
//! connection (epoll on the socket and the kick eventfds), the switch
//! between ports, and the status socket.
//!
//! Isolation between ports: a port's connection thread is the only one
//! that touches its frontend (socket, kick, call and error fds), and it
//! never waits for that frontend while holding anything another port can
//! wait for. Frames switched from another port go through the receiving
//! port's [`Inbox`](crate::inbox::Inbox). Frontend fds are read and written
//! without blocking ([`RingFd`](crate::queues::RingFd)); a kick fd that hangs
//! up stops its ring instead of waking the thread forever.
//!
//! Limits: connections (over all sockets) and status clients are capped
//! (see [`DeviceConfig`]); [`fds_per_connection`] bounds the descriptors
//! one connection can hold, so that the command line can size the
//! connection limit to the descriptor limit.

use std::collections::HashSet;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::inbox::Pushed;
use crate::port::{Port, PortState, PortStats, PortTable, RX_BACKLOG_MAX};
use crate::queues::{self, ChainError, KickRead, Pop};
use crate::send_queue::SendQueue;
use crate::switch::{self, Switch, ETH_HDR_LEN, MAX_TX_CHAIN, NET_HDR_LEN};
use crate::vhost_user::{self, conn, handler};
use crate::DeviceConfig;

const TOKEN_SOCKET: u64 = 0;
const TOKEN_SHUTDOWN: u64 = u64::MAX;
const TOKEN_INBOX: u64 = u64::MAX - 1;

/// How long the device waits for the rest of a started vhost-user message,
/// or for the frontend to take a reply, before it drops the connection.
const FRONTEND_IO_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a status client has to send its request line, and to take
/// the answer.
const CONTROL_IO_TIMEOUT: Duration = Duration::from_secs(1);

/// Longest status request line read.
const CONTROL_LINE_MAX: usize = 256;

/// File descriptors the device keeps for itself whatever the connections
/// hold: standard streams, the signal pipe, the shutdown eventfd, logs, and
/// room to accept (and refuse) a connection. The listening sockets and the
/// status clients come on top (see [`fds_needed`]).
pub const FDS_RESERVED: u64 = 32;

/// The most file descriptors one frontend connection can make the device
/// hold: its socket, epoll, inbox wake-up eventfd and backend channel; a
/// kick, call and error fd per ring plus a duplicate of each kick fd for
/// its epoll registration; a memory table's fds, and as many again in a
/// message being handled (a new table is mapped while the old one lives).
pub fn fds_per_connection(config: &DeviceConfig) -> u64 {
    let rings = 2 * u64::from(config.queue_pairs) + 2;
    let table = vhost::vhost_user::message::MAX_ATTACHED_FD_ENTRIES as u64;
    4 + 4 * rings + 2 * table
}

/// Descriptors a device with `sockets` listening sockets needs, at most,
/// under `config`'s limits.
pub fn fds_needed(config: &DeviceConfig, sockets: usize) -> u64 {
    FDS_RESERVED
        + sockets as u64
        + 1
        + config.max_control_clients as u64
        + config.max_connections as u64 * fds_per_connection(config)
}

/// Raises the soft `RLIMIT_NOFILE` of the process to its hard limit.
/// Returns the (new) soft limit.
pub fn raise_fd_limit() -> io::Result<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one `rlimit` into the live `lim`.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    if lim.rlim_cur < lim.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: lim.rlim_max,
            rlim_max: lim.rlim_max,
        };
        // SAFETY: setrlimit reads one `rlimit` from the live `raised`.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            lim.rlim_cur = lim.rlim_max;
        } else {
            tracing::warn!(
                "cannot raise the descriptor limit from {} to {}: {}",
                lim.rlim_cur,
                lim.rlim_max,
                io::Error::last_os_error()
            );
        }
    }
    Ok(lim.rlim_cur)
}
/// Chains taken from one ring before other work gets a turn.
const BUDGET: usize = 256;

/// The device: configuration, ports, switch.
pub struct Device {
    /// Configuration.
    pub config: DeviceConfig,
    /// The MAC learning switch of queue pair 0.
    pub switch: Switch,
    /// The ports.
    pub ports: PortTable,
    sockets: usize,
    /// Connections being served (a thread each).
    connections: AtomicUsize,
    /// Status clients being served (a thread each).
    control_clients: AtomicUsize,
    shutdown: EventFd,
    stopping: AtomicBool,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("config", &self.config)
            .field("sockets", &self.sockets)
            .finish()
    }
}

impl Device {
    /// A device with one port per socket (more ports appear when several
    /// frontends connect to one socket).
    pub fn new(config: DeviceConfig, sockets: usize) -> io::Result<Arc<Device>> {
        Ok(Arc::new(Device {
            switch: Switch::default(),
            ports: PortTable::new(sockets, &config),
            sockets,
            connections: AtomicUsize::new(0),
            control_clients: AtomicUsize::new(0),
            shutdown: EventFd::new(EFD_NONBLOCK)?,
            stopping: AtomicBool::new(false),
            config,
        }))
    }

    /// Asks every connection thread to stop.
    pub fn shutdown(&self) {
        self.stopping.store(true, Ordering::Release);
        let _ = self.shutdown.write(1);
    }

    /// Frontend connections being served now.
    pub fn connections(&self) -> usize {
        self.connections.load(Ordering::Acquire)
    }

    /// Delivers a frame (without virtio-net header) sent by port `from`:
    /// queues it in the inbox of each target port (never waits for them).
    pub fn switch_frame(&self, from: usize, frame: &[u8]) {
        let targets = self.switch.route(from, frame, &self.ports.connected());
        for to in targets {
            if let Some(p) = self.ports.get(to) {
                deliver(&p, frame);
            }
        }
    }

    /// One line per port: `key=value` pairs (see [`crate::testing`]).
    pub fn status(&self) -> String {
        let mut s = String::new();
        for p in self.ports.all() {
            let st = &p.stats;
            let g = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
            let m = p.mac;
            let pairs = (self.config.queue_pairs as usize).clamp(1, crate::port::TX_PAIR_STATS);
            s.push_str(&format!(
                "port={} socket={} connected={} connections={} mac={:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x} \
                 messages={} get_features={} set_features={} set_mem_table={} set_vring_kick={} set_vring_enable={} set_backend_req_fd={} errors={} \
                 iotlb_updates={} iotlb_invalidates={} iotlb_misses_sent={} tx_frames={} tx_errors={} \
                 rx_frames={} rx_dropped={} rx_deferred={} tx_pair={} rdma_kicks={} features={:#x} \
                 refused_bad_key={} refused_wrong_peer={} refused_missing_right={} refused_out_of_bounds={} refused_unregistered={}\n",
                p.index,
                p.socket,
                u8::from(st.connected.load(Ordering::Relaxed)),
                g(&st.connections),
                m[0], m[1], m[2], m[3], m[4], m[5],
                g(&st.messages),
                g(&st.get_features),
                g(&st.set_features),
                g(&st.set_mem_table),
                g(&st.set_vring_kick),
                g(&st.set_vring_enable),
                g(&st.set_backend_req_fd),
                g(&st.errors),
                g(&st.iotlb_updates),
                g(&st.iotlb_invalidates),
                g(&st.iotlb_misses_sent),
                g(&st.tx_frames),
                g(&st.tx_errors),
                g(&st.rx_frames),
                g(&st.rx_dropped),
                g(&st.rx_deferred),
                st.tx_pair[..pairs]
                    .iter()
                    .map(|c| g(c).to_string())
                    .collect::<Vec<_>>()
                    .join(","),
                g(&st.rdma_kicks),
                g(&st.features),
                g(&st.refused.bad_key),
                g(&st.refused.wrong_peer),
                g(&st.refused.missing_right),
                g(&st.refused.out_of_bounds),
                g(&st.refused.unregistered),
            ));
        }
        s
    }
}

/// Queues `frame` for rx ring 0 of `port` (in its inbox; its own thread
/// takes it from there, see [`receive_frames`]), or drops it (counted).
fn deliver(port: &Port, frame: &[u8]) {
    let mut data = Vec::with_capacity(NET_HDR_LEN + frame.len());
    data.extend_from_slice(&switch::rx_header());
    data.extend_from_slice(frame);
    match port.inbox.push(data) {
        Pushed::Queued => {}
        Pushed::QueuedDroppingOldest | Pushed::Dropped => PortStats::bump(&port.stats.rx_dropped),
    }
}

/// Moves the frames of the port's inbox into rx ring 0 (run by the port's
/// own thread). Returns whether a frame was delivered.
///
/// A frame whose rx buffer is not mapped yet (IOTLB miss) waits in the
/// port's backlog, in order, until the frontend answers the MISS; frames
/// arriving meanwhile queue behind it. A frame finding no rx buffer at
/// all, or a buffer mapped without write permission, is dropped, as a
/// NIC drops frames when the driver posts no buffers.
fn receive_frames(port: &Port) -> bool {
    let frames = port.inbox.take();
    if frames.is_empty() {
        return false;
    }
    let mut guard = port.lock();
    let st = &mut *guard;
    let ready =
        port.shared.access().memory.is_some() && st.vrings.first().is_some_and(|r| r.active());
    if !ready {
        for _ in 0..frames.len() {
            PortStats::bump(&port.stats.rx_dropped);
        }
        return false;
    }
    for data in frames {
        if st.rx_backlog.len() >= RX_BACKLOG_MAX {
            st.rx_backlog.pop_front();
            PortStats::bump(&port.stats.rx_dropped);
        }
        st.rx_backlog.push_back(data);
    }
    let delivered = flush_rx(st, &port.stats);
    vhost_user::send_misses(st, &port.stats);
    delivered
}

/// Moves the frames of the rx backlog into rx ring 0, oldest first, until
/// the backlog is empty or an rx buffer misses in the IOTLB (then the ring
/// waits for the UPDATE). Returns whether a frame was delivered.
fn flush_rx(st: &mut PortState, stats: &PortStats) -> bool {
    let PortState {
        index,
        shared: port,
        vrings,
        rx_backlog,
        ..
    } = st;
    let shared = port.access();
    let (Some(mem), Some(ring)) = (shared.memory.as_ref(), vrings.get_mut(0)) else {
        return false;
    };
    let was_waiting = std::mem::take(&mut ring.waiting_iotlb);
    if rx_backlog.is_empty() {
        return false;
    }
    let drop_all = |backlog: &mut std::collections::VecDeque<Vec<u8>>| {
        for _ in backlog.drain(..) {
            PortStats::bump(&stats.rx_dropped);
        }
    };
    if !ring.active() {
        drop_all(rx_backlog);
        return false;
    }
    if let Err(error) = ring.used_ring_writable(mem) {
        match error.ask() {
            Some(miss) => {
                port.note_miss(miss);
                ring.waiting_iotlb = true;
            }
            None => drop_all(rx_backlog),
        }
        return false;
    }
    let mut used = false;
    while let Some(data) = rx_backlog.front() {
        match queues::pop_chain(ring, mem) {
            Pop::Chain(c) => match queues::write_chain(mem, &c, data) {
                Ok(n) => {
                    let _ = ring.add_used(mem, c.head, n as u32);
                    used = true;
                    rx_backlog.pop_front();
                    PortStats::bump(&stats.rx_frames);
                }
                Err(ChainError::Miss(miss)) => {
                    ring.rewind();
                    port.note_miss(miss);
                    if !was_waiting {
                        PortStats::bump(&stats.rx_deferred);
                    }
                    ring.waiting_iotlb = true;
                    break;
                }
                Err(ChainError::Denied(denied)) => {
                    // The buffer stays posted; the frame is lost. The
                    // frontend is asked for the access all the same.
                    port.note_miss_of(denied);
                    ring.rewind();
                    rx_backlog.pop_front();
                    PortStats::bump(&stats.rx_dropped);
                }
                Err(e) => {
                    tracing::debug!("rx drop: {e}");
                    let _ = ring.add_used(mem, c.head, 0);
                    used = true;
                    rx_backlog.pop_front();
                    PortStats::bump(&stats.rx_dropped);
                }
            },
            Pop::Miss(miss) => {
                port.note_miss(miss);
                ring.waiting_iotlb = true;
                break;
            }
            Pop::Broken(e) => {
                ring.break_off(*index, &e);
                drop_all(rx_backlog);
            }
            Pop::Empty => {
                // Ask for a kick when buffers come; if some came
                // meanwhile, go on.
                if let Ok(true) = ring.queue_enable_notification(mem) {
                    continue;
                }
                drop_all(rx_backlog);
            }
        }
    }
    if used {
        ring.notify(mem);
    }
    used
}

/// Takes frames from tx ring `i`. Returns whether work is left.
fn collect_tx(st: &mut PortState, stats: &PortStats, i: usize, frames: &mut Vec<Vec<u8>>) -> bool {
    let PortState {
        index,
        shared: port,
        vrings,
        ..
    } = st;
    let shared = port.access();
    let (Some(mem), Some(ring)) = (shared.memory.as_ref(), vrings.get_mut(i)) else {
        return false;
    };
    if !ring.active() {
        return false;
    }
    ring.waiting_iotlb = false;
    if let Err(error) = ring.used_ring_writable(mem) {
        if let Some(miss) = error.ask() {
            port.note_miss(miss);
            ring.waiting_iotlb = true;
        }
        return false;
    }
    let mut used = false;
    let mut more = false;
    let mut broken = false;
    let mut taken = 0;
    loop {
        let _ = ring.queue_disable_notification(mem);
        loop {
            if taken >= BUDGET {
                more = true;
                break;
            }
            match queues::pop_chain(ring, mem) {
                Pop::Empty => break,
                Pop::Miss(miss) => {
                    port.note_miss(miss);
                    ring.waiting_iotlb = true;
                    break;
                }
                Pop::Broken(e) => {
                    ring.break_off(*index, &e);
                    PortStats::bump(&stats.tx_errors);
                    broken = true;
                    break;
                }
                Pop::Chain(c) => match queues::read_chain(mem, &c, MAX_TX_CHAIN) {
                    Ok(bytes) => {
                        taken += 1;
                        let _ = ring.add_used(mem, c.head, 0);
                        used = true;
                        if bytes.len() < NET_HDR_LEN + ETH_HDR_LEN {
                            PortStats::bump(&stats.tx_errors);
                        } else {
                            PortStats::bump(&stats.tx_frames);
                            if let Some(c) = stats.tx_pair.get(i / 2) {
                                PortStats::bump(c);
                            }
                            frames.push(bytes[NET_HDR_LEN..].to_vec());
                        }
                    }
                    Err(ChainError::Miss(miss)) => {
                        ring.rewind();
                        port.note_miss(miss);
                        ring.waiting_iotlb = true;
                        break;
                    }
                    Err(e) => {
                        if let ChainError::Denied(denied) = &e {
                            port.note_miss_of(*denied);
                        }
                        taken += 1;
                        tracing::debug!(ring = i, "bad tx chain: {e}");
                        PortStats::bump(&stats.tx_errors);
                        let _ = ring.add_used(mem, c.head, 0);
                        used = true;
                    }
                },
            }
        }
        // A broken ring is not ready any more: looking for new buffers
        // on it would break it again, and again.
        if more || broken || ring.waiting_iotlb {
            break;
        }
        // Re-enable notifications; if buffers arrived meanwhile, go on.
        match ring.queue_enable_notification(mem) {
            Ok(true) => continue,
            _ => break,
        }
    }
    if used {
        ring.notify(mem);
    }
    more
}

/// What processing a ring did.
#[derive(Debug, Default, Clone, Copy)]
struct Work {
    /// Work is left (budget exhausted).
    more: bool,
    /// Something was done (frames taken, RDMA requests or completions served).
    done: bool,
}

/// Processes ring `i` of `port` (`kicked`: the driver kicked it, as
/// opposed to a poll).
fn process_ring(
    dev: &Device,
    port: &Port,
    send_queue: &mut SendQueue,
    i: usize,
    kicked: bool,
) -> Work {
    let mut frames = Vec::new();
    let mut work = Work::default();
    {
        let mut st = port.lock();
        let net_rings = usize::from(st.layout().send_queue());
        if i == st.rdma_sq() || i == st.rdma_cq() {
            if st.vrings[i].active() {
                if kicked && i == st.rdma_sq() {
                    PortStats::bump(&port.stats.rdma_kicks);
                    work.done = true;
                }
                work.done |= send_queue.serve(&mut st, &dev.ports);
            }
        } else if i < net_rings && i % 2 == 1 {
            work.more = collect_tx(&mut st, &port.stats, i, &mut frames);
        } else if i == 0 {
            // An rx kick (new buffers) or a retry after an IOTLB update.
            work.done |= flush_rx(&mut st, &port.stats);
        }
        vhost_user::send_misses(&st, &port.stats);
    }
    work.done |= !frames.is_empty();
    for f in frames {
        dev.switch_frame(port.index, &f);
    }
    work
}

/// The epoll registration of one ring's kick fd. It holds a duplicate of
/// the fd: the frontend keeps the file open after the device replaces or
/// drops the ring's own descriptor, so the registration must be removed
/// through a descriptor that is still open, or it would keep reporting.
/// Its epoll token carries a generation, so that events of a registration
/// already replaced (reported in the same batch) are recognised and ignored.
struct KickRegistration {
    ring: usize,
    token: u64,
    fd: File,
}

/// The epoll token of ring `ring`'s kick in registration generation `generation`.
fn kick_token(generation: u32, ring: usize) -> u64 {
    (u64::from(generation) << 32) | (ring as u64 + 1)
}

fn unregister_kick(epoll: &Epoll, reg: KickRegistration) {
    let _ = epoll.ctl(
        ControlOperation::Delete,
        reg.fd.as_raw_fd(),
        EpollEvent::default(),
    );
}

fn sync_kicks(
    epoll: &Epoll,
    port: &Port,
    registered: &mut Vec<KickRegistration>,
    generation: &mut u32,
) {
    for reg in registered.drain(..) {
        unregister_kick(epoll, reg);
    }
    *generation = generation.wrapping_add(1) % (u32::MAX - 1);
    let st = port.lock();
    for r in &st.vrings {
        let Some(kick) = r.kick.as_ref().filter(|_| r.started) else {
            continue;
        };
        let fd = match kick.try_clone() {
            Ok(fd) => fd,
            Err(e) => {
                tracing::warn!(
                    port = port.index,
                    ring = r.index,
                    "cannot watch the kick fd: {e}"
                );
                continue;
            }
        };
        let token = kick_token(*generation, r.index);
        let ev = EpollEvent::new(EventSet::IN | EventSet::READ_HANG_UP, token);
        match epoll.ctl(ControlOperation::Add, fd.as_raw_fd(), ev) {
            Ok(()) => registered.push(KickRegistration {
                ring: r.index,
                token,
                fd,
            }),
            // A file epoll cannot watch (a regular file): the ring is only
            // served when the port polls.
            Err(e) => tracing::warn!(
                port = port.index,
                ring = r.index,
                "the kick fd cannot be watched ({e}): the ring is served only when polled"
            ),
        }
    }
}

/// Serves one frontend connection on `port` until it closes, misbehaves
/// or the device shuts down; then resets the port.
pub fn serve_connection(dev: Arc<Device>, port: Arc<Port>, mut stream: UnixStream) {
    let index = port.index;
    tracing::info!(port = index, "frontend connected");
    dev.switch.learn(port.mac, index);
    let mut send_queue = SendQueue::new(Arc::clone(&port), dev.config.poll);
    if let Err(e) = run_connection(&dev, &port, &mut stream, &mut send_queue) {
        tracing::info!(port = index, "connection ends: {e}");
    }
    drop(stream);
    release_port(&dev, &port);
    tracing::info!(port = index, "port reset");
}

/// Resets a port whose connection ended (or never started) and frees it
/// for the next frontend: once no access to its memory is in flight, its
/// memory and windows are gone; frames for it are dropped.
fn release_port(dev: &Device, port: &Port) {
    port.inbox.close();
    port.shared.reset();
    *port.lock() = PortState::new(port.index, port.mac, &dev.config, port.shared.clone());
    dev.switch.forget_port(port.index);
    port.stats.connected.store(false, Ordering::Release);
    let _ = dev
        .connections
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
}

fn run_connection(
    dev: &Device,
    port: &Port,
    stream: &mut UnixStream,
    send_queue: &mut SendQueue,
) -> Result<(), String> {
    stream
        .set_read_timeout(Some(FRONTEND_IO_TIMEOUT))
        .map_err(|e| e.to_string())?;
    stream
        .set_write_timeout(Some(FRONTEND_IO_TIMEOUT))
        .map_err(|e| e.to_string())?;
    let epoll = Epoll::new().map_err(|e| e.to_string())?;
    let wake = Arc::new(EventFd::new(EFD_NONBLOCK).map_err(|e| e.to_string())?);
    epoll
        .ctl(
            ControlOperation::Add,
            wake.as_raw_fd(),
            EpollEvent::new(EventSet::IN, TOKEN_INBOX),
        )
        .map_err(|e| e.to_string())?;
    port.inbox.open(wake.clone());
    epoll
        .ctl(
            ControlOperation::Add,
            stream.as_raw_fd(),
            EpollEvent::new(EventSet::IN | EventSet::HANG_UP, TOKEN_SOCKET),
        )
        .map_err(|e| e.to_string())?;
    epoll
        .ctl(
            ControlOperation::Add,
            dev.shutdown.as_raw_fd(),
            EpollEvent::new(EventSet::IN, TOKEN_SHUTDOWN),
        )
        .map_err(|e| e.to_string())?;
    let mut registered = Vec::new();
    let mut generation = 0u32;
    let mut events = vec![EpollEvent::default(); 64];
    let mut again: HashSet<usize> = HashSet::new();
    let poll = dev.config.poll;
    // Adaptive polling: after work, keep polling the rings for a short
    // while before sleeping on the kicks again (a cross-core eventfd wake-up
    // costs far more than a short spin).
    let spin = Duration::from_micros(dev.config.spin_us);
    let mut last_work: Option<Instant> = None;
    let mut rings: HashSet<usize> = HashSet::new();
    let mut kicked: HashSet<usize> = HashSet::new();
    let mut pass: u32 = 0;
    loop {
        if dev.stopping.load(Ordering::Acquire) {
            return Err("device shutting down".into());
        }
        let waiting = {
            let st = port.lock();
            // The frontend shrank a file of its memory table under the
            // device (the SIGBUS guard replaced the lost pages with zeros):
            // stop using that memory, end the connection, reset the port.
            if let Some(region) = st.table.as_ref().and_then(|t| t.poisoned_region()) {
                tracing::warn!(
                    port = port.index,
                    region,
                    "frontend memory shrank under the device: stopping the rings, resetting the port"
                );
                return Err(format!("memory region {region} shrank under the device"));
            }
            st.vrings.iter().any(|r| r.waiting_iotlb)
        };
        let spinning = last_work.is_some_and(|t| t.elapsed() < spin);
        let timeout = if poll || spinning || !again.is_empty() {
            0
        } else if waiting {
            50
        } else {
            -1
        };
        // While polling, every ring is looked at on every pass anyway: ask
        // the kernel about the socket and the kicks only every few passes.
        pass = pass.wrapping_add(1);
        let n = if timeout == 0 && !pass.is_multiple_of(POLL_PASSES_PER_WAIT) {
            0
        } else {
            match epoll.wait(timeout, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => 0,
                Err(e) => return Err(e.to_string()),
            }
        };
        rings.clear();
        rings.extend(again.drain());
        kicked.clear();
        let mut all = poll || spinning || (n == 0 && waiting);
        for ev in &events[..n] {
            match ev.data() {
                TOKEN_SHUTDOWN => return Err("device shutting down".into()),
                TOKEN_INBOX => {
                    // Frames are taken below; only the wake-up is consumed.
                    let _ = wake.read();
                }
                TOKEN_SOCKET => {
                    let msg = conn::recv_message(stream).map_err(|e| e.to_string())?;
                    let out = {
                        let mut st = port.lock();
                        handler::handle(&mut st, &port.stats, msg).map_err(|e| {
                            tracing::warn!(port = port.index, "malformed message: {e}");
                            e.to_string()
                        })?
                    };
                    if let Some(r) = out.reply {
                        conn::send_message(stream, &r).map_err(|e| e.to_string())?;
                    }
                    if out.rings_changed {
                        sync_kicks(&epoll, port, &mut registered, &mut generation);
                    }
                    all |= out.retry;
                }
                t => {
                    let Some(at) = registered.iter().position(|g| g.token == t) else {
                        // A registration replaced earlier in this batch.
                        continue;
                    };
                    let i = registered[at].ring;
                    let hung = ev
                        .event_set()
                        .intersects(EventSet::HANG_UP | EventSet::ERROR);
                    let mut st = port.lock();
                    let Some(r) = st.vrings.get_mut(i) else {
                        continue;
                    };
                    let read = if hung {
                        KickRead::HungUp("hang-up".into())
                    } else {
                        r.drain_kick()
                    };
                    match read {
                        KickRead::Kicked => {
                            rings.insert(i);
                            kicked.insert(i);
                        }
                        KickRead::Nothing => {}
                        KickRead::HungUp(reason) => {
                            r.kick_hung_up(port.index, &reason);
                            unregister_kick(&epoll, registered.swap_remove(at));
                        }
                    }
                }
            }
        }
        if port.inbox.pending() && receive_frames(port) {
            last_work = Some(Instant::now());
        }
        if all {
            let st = port.lock();
            rings.extend(st.vrings.iter().filter(|r| r.active()).map(|r| r.index));
        }
        for &i in &rings {
            let w = process_ring(dev, port, send_queue, i, kicked.contains(&i));
            if w.more {
                again.insert(i);
            }
            if w.done {
                last_work = Some(Instant::now());
            }
        }
        if poll && last_work.is_none_or(|t| t.elapsed() > POLL_IDLE) {
            // Idle in busy-poll mode: keep polling without waiting for kicks,
            // but yield between passes so that busy threads (another port's
            // copy, a spinning driver) get the core first.
            std::thread::yield_now();
        }
    }
}

/// In busy-poll mode, passes over the rings between two looks at the
/// socket and the kick eventfds.
const POLL_PASSES_PER_WAIT: u32 = 64;

/// In busy-poll mode, idle time after which passes yield the CPU.
const POLL_IDLE: Duration = Duration::from_millis(1);

/// A running server: listening sockets and the status socket. Dropping it
/// removes the socket files.
#[derive(Debug)]
pub struct Server {
    /// The device.
    pub device: Arc<Device>,
    paths: Vec<PathBuf>,
}

fn bind(path: &Path) -> io::Result<UnixListener> {
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if meta.file_type().is_socket() {
            std::fs::remove_file(path)?;
        } else {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!("{} exists and is not a socket", path.display()),
            ));
        }
    }
    UnixListener::bind(path)
}

impl Server {
    /// Listens on `sockets` (port `i` on `sockets[i]`) and, if given, serves
    /// the status on `control`.
    pub fn start(
        device: Arc<Device>,
        sockets: &[PathBuf],
        control: Option<&Path>,
    ) -> io::Result<Server> {
        let mut server = Server {
            device: device.clone(),
            paths: Vec::new(),
        };
        let mut listeners = Vec::new();
        for path in sockets {
            let l = bind(path).map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!("cannot listen on {}: {e}", path.display()),
                )
            })?;
            server.paths.push(path.clone());
            listeners.push(l);
        }
        if let Some(c) = control {
            let l = bind(c).map_err(|e| {
                io::Error::new(e.kind(), format!("cannot listen on {}: {e}", c.display()))
            })?;
            server.paths.push(c.to_path_buf());
            let dev = device.clone();
            thread::Builder::new()
                .name("status".into())
                .spawn(move || serve_status(dev, l))?;
        }
        for (socket, l) in listeners.into_iter().enumerate() {
            let dev = device.clone();
            thread::Builder::new()
                .name(format!("listen{socket}"))
                .spawn(move || accept_loop(dev, socket, l))?;
        }
        for p in sockets {
            tracing::info!("listening on {}", p.display());
        }
        Ok(server)
    }

    /// Stops the connections and removes the socket files.
    pub fn stop(&mut self) {
        self.device.shutdown();
        for p in self.paths.drain(..) {
            let _ = std::fs::remove_file(&p);
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

fn accept_loop(dev: Arc<Device>, socket: usize, listener: UnixListener) {
    for conn in listener.incoming() {
        if dev.stopping.load(Ordering::Acquire) {
            break;
        }
        match conn {
            Ok(stream) => accept(&dev, socket, stream),
            Err(e) => {
                // Out of descriptors or memory: wait instead of retrying
                // at once (the connection stays in the backlog).
                tracing::warn!(socket, "accept failed: {e}");
                thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

/// Serves a new connection on a port of its own, or refuses it (closes it
/// at once) when the connection limit is reached or its thread cannot
/// start.
fn accept(dev: &Arc<Device>, socket: usize, stream: UnixStream) {
    let max = dev.config.max_connections;
    let taken = dev
        .connections
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < max).then_some(n + 1)
        });
    if taken.is_err() {
        tracing::warn!(
            socket,
            "connection refused: {max} connections already served (--max-connections)"
        );
        return;
    }
    let port = dev.ports.allocate(socket, &dev.config);
    let (d, p) = (dev.clone(), port.clone());
    let spawned = thread::Builder::new()
        .name(format!("port{}", port.index))
        .spawn(move || serve_connection(d, p, stream));
    if let Err(e) = spawned {
        // The closure (and the stream) is dropped: the frontend sees the
        // connection closed.
        tracing::error!(
            port = port.index,
            "connection refused: cannot start its thread: {e}"
        );
        release_port(dev, &port);
    }
}

fn serve_status(dev: Arc<Device>, listener: UnixListener) {
    for conn in listener.incoming() {
        if dev.stopping.load(Ordering::Acquire) {
            break;
        }
        let s = match conn {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("status socket: accept failed: {e}");
                thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let max = dev.config.max_control_clients;
        let taken = dev
            .control_clients
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            });
        if taken.is_err() {
            tracing::warn!("status client refused: {max} served already (--max-control-clients)");
            continue;
        }
        let d = dev.clone();
        let spawned = thread::Builder::new()
            .name("status-client".into())
            .spawn(move || {
                answer_status(&d, s);
                d.control_clients.fetch_sub(1, Ordering::AcqRel);
            });
        if let Err(e) = spawned {
            tracing::warn!("status client refused: cannot start its thread: {e}");
            dev.control_clients.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// Reads a status client's request line (at most [`CONTROL_LINE_MAX`]
/// bytes, for at most [`CONTROL_IO_TIMEOUT`] in all), then writes the
/// status. A client that sends nothing gets the status after the timeout.
fn answer_status(dev: &Device, mut s: UnixStream) {
    let deadline = Instant::now() + CONTROL_IO_TIMEOUT;
    let mut line = Vec::new();
    let mut buf = [0u8; 64];
    while line.len() < CONTROL_LINE_MAX && !line.contains(&b'\n') {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || s.set_read_timeout(Some(left)).is_err() {
            break;
        }
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => line.extend_from_slice(&buf[..n]),
        }
    }
    let _ = s.set_write_timeout(Some(CONTROL_IO_TIMEOUT));
    let _ = s.write_all(dev.status().as_bytes());
}
