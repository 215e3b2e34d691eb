//! The device process: the [`Device`] (configuration, ports, switch), the
//! listening sockets and their accept loops ([`Server`]), which start one
//! [`connection`] thread per frontend up to the connection limit, and the
//! status socket.
//!
//! Limits: connections (over all sockets) and status clients are capped
//! (see [`DeviceConfig`]); [`fds_per_connection`] bounds the descriptors
//! one connection can hold, so that the command line can size the
//! connection limit to the descriptor limit.

use std::io::{self, Read, Write};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use crate::connection::{self, Context, Stop};
use crate::internode::{Link, LinkConfig};
use crate::port::{Port, PortTable};
use crate::switch::Switch;
use crate::DeviceConfig;

/// How long a status client has to send its request line, and to take
/// the answer.
const CONTROL_IO_TIMEOUT: Duration = Duration::from_secs(1);

/// Longest status request line read.
const CONTROL_LINE_MAX: usize = 256;

/// File descriptors the device keeps for itself whatever the connections
/// hold: standard streams, the signal pipe, the stop eventfd, logs, and
/// room to accept (and refuse) a connection. The listening sockets and the
/// status clients come on top (see [`fds_needed`]).
pub const FDS_RESERVED: u64 = 32;

/// The most file descriptors one frontend connection can make the device
/// hold: its socket, epoll, inbox wake-up eventfd and backend channel; a
/// kick, call and error fd per ring plus a duplicate of each kick fd for
/// its epoll registration; a memory table's fds, and as many again in a
/// message being handled (a new table is mapped while the old one lives).
pub fn fds_per_connection(config: &DeviceConfig) -> u64 {
    let rings = 2 * u64::from(config.queue_pairs) + 2 * u64::from(config.rdma_queue_pairs);
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

/// The device: configuration, ports, switch.
pub struct Device {
    /// Configuration.
    pub config: DeviceConfig,
    /// The MAC learning switch of queue pair 0.
    pub switch: Arc<Switch>,
    /// The ports.
    pub ports: Arc<PortTable>,
    /// The link to the other nodes of the fabric, once started.
    pub link: std::sync::OnceLock<Arc<Link>>,
    sockets: usize,
    /// Connections being served (a thread each).
    connections: AtomicUsize,
    /// Status clients being served (a thread each).
    control_clients: AtomicUsize,
    stop: Stop,
    shared_poll: crate::shared_poll::SharedPoll,
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
            switch: Arc::new(Switch::default()),
            ports: Arc::new(PortTable::new(sockets, &config)),
            link: std::sync::OnceLock::new(),
            sockets,
            connections: AtomicUsize::new(0),
            control_clients: AtomicUsize::new(0),
            stop: Stop::new()?,
            shared_poll: crate::shared_poll::SharedPoll::new(!config.solo_polling),
            config,
        }))
    }

    /// Asks every connection thread to stop, and stops the fabric link.
    pub fn shutdown(&self) {
        self.stop.request();
        if let Some(link) = self.link.get() {
            link.stop();
        }
    }

    /// Joins the fabric: starts the link to the other nodes' devices.
    pub fn start_link(&self, config: LinkConfig) -> io::Result<()> {
        let link = Link::start(config, Arc::clone(&self.ports), Arc::clone(&self.switch))?;
        self.link
            .set(link)
            .map_err(|_| io::Error::other("the fabric link is started already"))
    }

    /// Frontend connections being served now.
    pub fn connections(&self) -> usize {
        self.connections.load(Ordering::Acquire)
    }

    /// What a connection thread reaches of the device.
    fn context(&self) -> Context<'_> {
        Context {
            config: &self.config,
            ports: &self.ports,
            switch: &self.switch,
            stop: &self.stop,
            link: self.link.get().map(|link| &**link),
            shared_poll: &self.shared_poll,
        }
    }

    /// Frees the connection slot of a connection that ended.
    fn connection_ended(&self) {
        let _ = self
            .connections
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
    }

    /// One line per ring a frontend configured, port by port: `ring
    /// port=.. ring=.. kind=..` (`net_rx`, `net_tx`, `send` or
    /// `completion`), its queue pair, the size the driver set, the
    /// device's position in it (the next available index of an Ethernet
    /// ring; the next request of a send queue, the next completion of a
    /// completion queue), the next used index of an Ethernet ring, the
    /// requests a send queue's pair has in flight, and its state.
    pub fn rings_status(&self) -> String {
        let mut s = String::new();
        for p in self.ports.all() {
            let st = p.lock();
            let layout = st.layout();
            for ring in st.vrings.iter().filter(|r| r.size != 0 || r.enabled) {
                let Ok(index) = u16::try_from(ring.index) else {
                    continue;
                };
                let (kind, pair) = match layout.rdma_ring(index) {
                    Some(pindown_uapi::RdmaRing::Send(pair)) => ("send", pair),
                    Some(pindown_uapi::RdmaRing::Completion(pair)) => ("completion", pair),
                    None if index % 2 == 0 => ("net_rx", index / 2),
                    None => ("net_tx", index / 2),
                };
                // Requests in flight belong to a pair's send queue.
                let in_flight = match kind {
                    "send" => p
                        .stats
                        .in_flight
                        .of(pair)
                        .map_or(0, |c| c.load(Ordering::Relaxed)),
                    _ => 0,
                };
                s.push_str(&format!(
                    "ring port={} ring={index} kind={kind} pair={pair} size={} position={} \
                     next_used={} in_flight={in_flight} enabled={} started={} waiting_iotlb={} \
                     broken={}\n",
                    p.index,
                    ring.size,
                    ring.position(),
                    ring.next_used(),
                    u8::from(ring.enabled),
                    u8::from(ring.started),
                    u8::from(ring.waiting_iotlb),
                    u8::from(ring.broken),
                ));
            }
        }
        s
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
                 rx_frames={} rx_dropped={} rx_deferred={} tx_pair={} rdma_kicks={} rdma_turns_by_poller={} rdma_handed_back_busy={} features={:#x}",
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
                g(&st.rdma_turns_by_poller),
                g(&st.rdma_handed_back_busy),
                g(&st.features),
            ));
            for (cause, count) in st.refused.named() {
                s.push_str(&format!(" refused_{cause}={}", g(count)));
            }
            for (kind, count) in crate::port::WORK_KINDS.iter().zip(&st.work.requests) {
                s.push_str(&format!(" requests_{kind}={}", g(count)));
            }
            s.push_str(&format!(" bytes={}", g(&st.work.bytes)));
            for ((_, kind), count) in crate::port::FAILURE_KINDS.iter().zip(&st.work.failed) {
                s.push_str(&format!(" failed_{kind}={}", g(count)));
            }
            let gate = p.shared.access();
            let (mapped, iotlb, iotlb_bytes) = gate.memory.as_ref().map_or((0, 0, 0), |memory| {
                let iotlb = memory.iotlb();
                (
                    memory.table().mapped_bytes(),
                    iotlb.len(),
                    iotlb.covered_bytes(),
                )
            });
            s.push_str(&format!(
                " windows={} mapped_bytes={mapped} iotlb_entries={iotlb} iotlb_bytes={iotlb_bytes}\n",
                gate.windows.len()
            ));
        }
        s
    }
}

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
        if dev.stop.requested() {
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
    // The kernel's word on who connected: the memory this frontend hands
    // over is the memory that process could pass over its own socket.
    match peer_credentials(&stream) {
        Ok(peer) => tracing::info!(
            port = port.index,
            socket,
            pid = peer.pid,
            uid = peer.uid,
            gid = peer.gid,
            "frontend connected"
        ),
        Err(e) => tracing::warn!(
            port = port.index,
            socket,
            "frontend connected; its credentials are unknown: {e}"
        ),
    }
    let (d, p) = (dev.clone(), port.clone());
    let spawned = thread::Builder::new()
        .name(format!("port{}", port.index))
        .spawn(move || {
            // Closed last, after the port's reset (locals drop in reverse
            // order, on a panic too): a frontend that sees its end close
            // knows the device no longer touches its memory or rings.
            let mut stream = stream;
            // Released when the thread ends, however it ends (a panic
            // included): a port is never left taken.
            let _release = Release { dev: &d, port: &p };
            connection::serve(d.context(), Arc::clone(&p), &mut stream);
        });
    if let Err(e) = spawned {
        // The closure (and the stream) is dropped: the frontend sees the
        // connection closed.
        tracing::error!(
            port = port.index,
            "connection refused: cannot start its thread: {e}"
        );
        release(dev, &port);
    }
}

/// The process at the other end of `stream`, as the kernel recorded it
/// when it connected (`SO_PEERCRED`).
fn peer_credentials(stream: &UnixStream) -> std::io::Result<libc::ucred> {
    use std::os::fd::AsRawFd;
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cred`, which we
    // own, and only reads the descriptor.
    let done = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if done != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(cred)
}

/// Resets a port whose connection never started and frees its
/// connection slot.
fn release(dev: &Device, port: &Port) {
    connection::reset_port(dev.context(), port);
    dev.connection_ended();
    // Said last: whoever sees the port disconnected (the status) finds
    // its connection slot free too.
    port.stats
        .connected
        .store(false, std::sync::atomic::Ordering::Release);
    tracing::info!(port = port.index, "port reset");
}

/// Releases a connection's port and its place under the connection limit
/// when dropped.
struct Release<'a> {
    dev: &'a Device,
    port: &'a Port,
}

impl Drop for Release<'_> {
    fn drop(&mut self) {
        if thread::panicking() {
            tracing::error!(port = self.port.index, "connection thread panicked");
        }
        release(self.dev, self.port);
    }
}

fn serve_status(dev: Arc<Device>, listener: UnixListener) {
    for conn in listener.incoming() {
        if dev.stop.requested() {
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
/// status: the fabric link's line for `fabric`, else one line per port. A
/// client that sends nothing gets the ports' status after the timeout.
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
    let answer = if line.starts_with(b"fabric") {
        dev.link
            .get()
            .map_or_else(|| "fabric none\n".to_string(), |link| link.status())
    } else if line.starts_with(b"rings") {
        dev.rings_status()
    } else {
        dev.status()
    };
    let _ = s.write_all(answer.as_bytes());
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;

    use super::*;

    /// Whether `stream`'s other end closed within `timeout`.
    fn closed_within(stream: &UnixStream, timeout: Duration) -> bool {
        let mut poll = libc::pollfd {
            fd: stream.as_raw_fd(),
            events: libc::POLLRDHUP,
            revents: 0,
        };
        let millis = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
        // SAFETY: one pollfd of ours; poll only writes its `revents`.
        let ready = unsafe { libc::poll(&mut poll, 1, millis) };
        ready > 0 && poll.revents & (libc::POLLHUP | libc::POLLRDHUP | libc::POLLERR) != 0
    }

    #[test]
    fn a_frontends_connection_closes_only_once_its_port_is_reset() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("port0.sock");
        let device = Device::new(DeviceConfig::default(), 1).unwrap();
        let _server = Server::start(device.clone(), std::slice::from_ref(&socket), None).unwrap();
        let frontend = UnixStream::connect(&socket).unwrap();
        let connected_by = Instant::now() + Duration::from_secs(10);
        let port = loop {
            match device.ports.get(0) {
                Some(port) if port.stats.connected.load(Ordering::Acquire) => break port,
                _ => {
                    assert!(
                        Instant::now() < connected_by,
                        "the frontend never connected"
                    );
                    thread::sleep(Duration::from_millis(1))
                }
            }
        };
        // An access to the port's memory in flight: the reset waits for it.
        let in_flight = port.shared.access();
        frontend.shutdown(std::net::Shutdown::Write).unwrap();
        assert!(
            !closed_within(&frontend, Duration::from_millis(300)),
            "the connection closed before the port was reset"
        );
        assert!(port.stats.connected.load(Ordering::Acquire));
        drop(in_flight);
        assert!(closed_within(&frontend, Duration::from_secs(10)));
        assert!(!port.stats.connected.load(Ordering::Acquire));
    }
}
