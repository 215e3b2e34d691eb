//! The fabric figures' pieces: two hosts (network namespaces joined by a
//! veth pair, or the loopback address where namespaces cannot be made),
//! device processes placed in them and joined over UDP, and the raw UDP
//! baselines (ping-pong and bulk transfer) between the same addresses.
//!
//! The namespaces are named `pindown-fab-PID-a` and `-b`; they are removed
//! when the [`Hosts`] value is dropped (also on an error or a panic), on
//! SIGINT, SIGTERM or SIGHUP, and, if the program was killed outright, by
//! the next run (namespaces of a process that no longer exists).

use std::fs::File;
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::stats::Summary;

/// Prefix of the namespaces this module makes.
const NETNS_PREFIX: &str = "pindown-fab-";
/// The two hosts' addresses on the veth pair.
const VETH_ADDRESSES: [Ipv4Addr; 2] = [Ipv4Addr::new(10, 213, 0, 1), Ipv4Addr::new(10, 213, 0, 2)];
/// How long one raw UDP exchange may take before the baseline gives up.
const UDP_TIMEOUT: Duration = Duration::from_secs(5);

/// Namespaces that exist now and must go when the program stops.
static LIVE_NAMESPACES: Mutex<Vec<String>> = Mutex::new(Vec::new());
/// Whether the signal thread that removes them runs.
static SIGNAL_THREAD: OnceLock<()> = OnceLock::new();

/// Where the two hosts of the fabric figures are.
#[derive(Debug)]
pub struct Hosts {
    names: Vec<String>,
    netns: Vec<File>,
    addresses: [IpAddr; 2],
    fallback_reason: Option<String>,
}

/// How the hosts were made, for the JSON report.
#[derive(Clone, Debug, Serialize)]
pub struct HostsReport {
    /// `"netns"` (two network namespaces joined by a veth pair) or
    /// `"loopback"` (both devices on 127.0.0.1 of this namespace).
    pub kind: &'static str,
    /// The namespaces' names (empty on loopback).
    pub namespaces: Vec<String>,
    /// The two hosts' addresses.
    pub addresses: [IpAddr; 2],
    /// Why namespaces were not used, on loopback.
    pub fallback_reason: Option<String>,
}

impl Hosts {
    /// Two network namespaces joined by a veth pair (needs root and
    /// `ip`); loopback if `loopback` is asked for or namespaces cannot be
    /// made (the reason is kept).
    pub fn set_up(loopback: bool) -> Hosts {
        if loopback {
            return Self::loopback("asked for (--loopback)".into());
        }
        match Self::namespaces() {
            Ok(hosts) => hosts,
            Err(e) => Self::loopback(format!("network namespaces could not be made: {e}")),
        }
    }

    fn loopback(reason: String) -> Hosts {
        Hosts {
            names: Vec::new(),
            netns: Vec::new(),
            addresses: [IpAddr::V4(Ipv4Addr::LOCALHOST); 2],
            fallback_reason: Some(reason),
        }
    }

    fn namespaces() -> io::Result<Hosts> {
        if !crate::sys::is_root() {
            return Err(io::Error::other("not root"));
        }
        remove_stale_namespaces();
        remove_on_signal();
        let pid = std::process::id();
        let names = vec![
            format!("{NETNS_PREFIX}{pid}-a"),
            format!("{NETNS_PREFIX}{pid}-b"),
        ];
        // From the first namespace on, drop removes what exists.
        let mut hosts = Hosts {
            names: Vec::new(),
            netns: Vec::new(),
            addresses: VETH_ADDRESSES.map(IpAddr::V4),
            fallback_reason: None,
        };
        for name in &names {
            ip(&["netns", "add", name])?;
            LIVE_NAMESPACES
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(name.clone());
            hosts.names.push(name.clone());
        }
        // Interface names are at most 15 bytes; the pair goes with the
        // namespaces.
        let veth = [format!("pdfa{pid}"), format!("pdfb{pid}")];
        ip(&[
            "link", "add", &veth[0], "netns", &names[0], "type", "veth", "peer", "name", &veth[1],
            "netns", &names[1],
        ])?;
        for (i, name) in names.iter().enumerate() {
            let address = format!("{}/24", VETH_ADDRESSES[i]);
            ip(&["-n", name, "addr", "add", &address, "dev", &veth[i]])?;
            ip(&["-n", name, "link", "set", &veth[i], "up"])?;
            ip(&["-n", name, "link", "set", "lo", "up"])?;
            hosts
                .netns
                .push(File::open(format!("/var/run/netns/{name}"))?);
        }
        Ok(hosts)
    }

    /// `"netns"` or `"loopback"`.
    pub fn kind(&self) -> &'static str {
        if self.netns.is_empty() {
            "loopback"
        } else {
            "netns"
        }
    }

    /// What the report says about the hosts.
    pub fn report(&self) -> HostsReport {
        HostsReport {
            kind: self.kind(),
            namespaces: self.names.clone(),
            addresses: self.addresses,
            fallback_reason: self.fallback_reason.clone(),
        }
    }

    /// Host `i`'s (0 or 1) address.
    pub fn address(&self, i: usize) -> IpAddr {
        self.addresses[i]
    }

    /// Host `i`'s network namespace (`None` on loopback).
    pub fn netns(&self, i: usize) -> Option<&File> {
        self.netns.get(i)
    }

    /// A UDP socket bound in host `i` to `port` of its address (0: any
    /// free port). Sockets stay in the namespace they were made in, so
    /// the one returned can be used from any thread.
    pub fn bind_udp(&self, i: usize, port: u16) -> io::Result<UdpSocket> {
        let address = SocketAddr::new(self.address(i), port);
        let Some(netns) = self.netns(i) else {
            return UdpSocket::bind(address);
        };
        let netns = netns.try_clone()?;
        std::thread::scope(|scope| {
            scope
                .spawn(move || {
                    // SAFETY: setns(2) moves only this short-lived thread
                    // into the namespace of an open namespace file; no
                    // memory is passed.
                    if unsafe {
                        libc::setns(std::os::fd::AsRawFd::as_raw_fd(&netns), libc::CLONE_NEWNET)
                    } != 0
                    {
                        return Err(io::Error::last_os_error());
                    }
                    UdpSocket::bind(address)
                })
                .join()
                .unwrap_or_else(|_| Err(io::Error::other("the binding thread panicked")))
        })
    }

    /// A UDP port of host `i` that was free a moment ago.
    pub fn free_port(&self, i: usize) -> io::Result<u16> {
        Ok(self.bind_udp(i, 0)?.local_addr()?.port())
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        self.netns.clear();
        for name in self.names.drain(..) {
            let _ = ip(&["netns", "del", &name]);
            LIVE_NAMESPACES
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .retain(|n| *n != name);
        }
    }
}

/// Runs `ip ARGS`; its error output becomes the error.
fn ip(args: &[&str]) -> io::Result<()> {
    let output = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| io::Error::new(e.kind(), format!("cannot run ip: {e}")))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(io::Error::other(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        )))
    }
}

/// Removes namespaces of this module whose process is gone (a run that
/// was killed outright).
fn remove_stale_namespaces() {
    let Ok(output) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        let Some(rest) = name.strip_prefix(NETNS_PREFIX) else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = ip(&["netns", "del", name]);
        }
    }
}

/// Starts (once) a thread that removes the live namespaces and exits on
/// SIGINT, SIGTERM or SIGHUP.
fn remove_on_signal() {
    SIGNAL_THREAD.get_or_init(|| {
        use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
        let Ok(mut signals) = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP]) else {
            return;
        };
        std::thread::spawn(move || {
            if let Some(signal) = signals.forever().next() {
                let names =
                    std::mem::take(&mut *LIVE_NAMESPACES.lock().unwrap_or_else(|e| e.into_inner()));
                for name in names {
                    let _ = ip(&["netns", "del", &name]);
                }
                std::process::exit(128 + signal);
            }
        });
    });
}

/// How the raw UDP baselines wait for datagrams.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UdpWait {
    /// Non-blocking sockets polled in a loop.
    Spin,
    /// Blocking `recv`.
    Block,
}

/// Receives one datagram into `buf`, spinning or blocking, for at most
/// [`UDP_TIMEOUT`].
fn recv(socket: &UdpSocket, buf: &mut [u8], wait: UdpWait) -> io::Result<usize> {
    match wait {
        UdpWait::Block => socket.recv(buf),
        UdpWait::Spin => {
            let deadline = Instant::now() + UDP_TIMEOUT;
            loop {
                match socket.recv(buf) {
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        if Instant::now() > deadline {
                            return Err(io::Error::new(
                                io::ErrorKind::TimedOut,
                                "no datagram while spinning",
                            ));
                        }
                        std::hint::spin_loop();
                    }
                    other => return other,
                }
            }
        }
    }
}

/// Connects `socket` to `peer`, drops whatever an earlier exchange left
/// in its buffer, and sets it up for `wait`.
fn prepare(socket: &UdpSocket, peer: SocketAddr, wait: UdpWait) -> io::Result<()> {
    socket.connect(peer)?;
    socket.set_nonblocking(true)?;
    let mut buf = [0u8; 2048];
    while socket.recv(&mut buf).is_ok() {}
    socket.set_nonblocking(wait == UdpWait::Spin)?;
    socket.set_read_timeout(Some(UDP_TIMEOUT))
}

/// A datagram that tells the echo or sink thread to stop (no payload the
/// baselines send is one byte long).
const STOP: [u8; 1] = [0xff];

/// The raw UDP round trip: `client` sends `payload` bytes to `server`,
/// which a thread echoes back; each round trip timed alone after `warmup`
/// untimed ones, in microseconds. Every echo is checked against what was
/// sent; the second value says whether all were right.
pub fn udp_round_trips(
    client: &UdpSocket,
    server: &UdpSocket,
    payload: usize,
    warmup: usize,
    samples: usize,
    wait: UdpWait,
) -> io::Result<(Summary, bool)> {
    let payload = payload.max(2);
    prepare(client, server.local_addr()?, wait)?;
    prepare(server, client.local_addr()?, wait)?;
    let echo = server.try_clone()?;
    let echo_thread = std::thread::spawn(move || -> io::Result<()> {
        let mut buf = vec![0u8; 65536];
        loop {
            let n = recv(&echo, &mut buf, wait)?;
            if buf[..n] == STOP {
                return Ok(());
            }
            echo.send(&buf[..n])?;
        }
    });
    let result = (|| -> io::Result<(Summary, bool)> {
        let mut out = vec![0u8; payload];
        let mut back = vec![0u8; 65536];
        let mut times = Vec::with_capacity(samples);
        let mut right = true;
        for i in 0..warmup + samples {
            out[..8.min(payload)].copy_from_slice(&(i as u64).to_le_bytes()[..8.min(payload)]);
            let start = Instant::now();
            client.send(&out)?;
            let n = recv(client, &mut back, wait)?;
            let elapsed = start.elapsed();
            right &= back[..n] == out[..];
            if i >= warmup {
                times.push(elapsed.as_secs_f64() * 1e6);
            }
        }
        Ok((Summary::of(&mut times), right))
    })();
    let _ = client.send(&STOP);
    let echoed = echo_thread
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("the echo thread panicked")));
    let (summary, right) = result?;
    echoed?;
    Ok((summary, right))
}

/// One round of the raw UDP bulk transfer.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct BulkRound {
    /// Datagrams sent.
    pub sent: u64,
    /// Datagrams the receiver got.
    pub received: u64,
    /// From the first datagram sent until the receiver's count arrived.
    pub seconds: f64,
}

impl BulkRound {
    /// Bytes received per second, in GB/s.
    pub fn gb_per_s(&self, datagram: usize) -> f64 {
        crate::rdma::gb_per_s(self.received as f64 * datagram as f64, self.seconds)
    }
}

/// Marks the sender's last datagram (the receiver answers with its count).
const FIN: u64 = u64::MAX;
/// Numbers the bulk rounds, so that a late final datagram or answer of
/// one round is never taken for another's.
static BULK_ROUND: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// The final datagram of round `round`, and the receiver's answer.
fn fin(first: u64, round: u64) -> [u8; 16] {
    let mut out = [0u8; 16];
    out[..8].copy_from_slice(&first.to_le_bytes());
    out[8..].copy_from_slice(&round.to_le_bytes());
    out
}

/// How the raw UDP bulk transfer hands its datagrams to the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Batching {
    /// One `send` and one `recv` per datagram.
    Plain,
    /// Through `quinn-udp`: runs of datagrams in one segmentation-offloaded
    /// send (UDP GSO), received coalesced (UDP GRO) into eight 64 KiB
    /// buffers a call (the link takes three): the kernel's best. Where the
    /// kernel refuses to segment, each datagram goes alone.
    Segmented,
}

/// Datagrams in one segmented send of the bulk transfer.
const SEGMENTED_RUN: u64 = 44;

/// The raw UDP bulk transfer: `sender` sends `count` datagrams of
/// `datagram` bytes (each numbered) to `receiver`, as fast as the kernel
/// takes them, handed over as `batching` says, then a final datagram
/// until the receiver (a thread) answers with how many it got. No flow
/// control: what the receiver's socket buffer cannot hold is lost and not
/// counted. Segmented transfers change the sockets' options (`quinn-udp`
/// turns GRO on): give them sockets of their own.
pub fn udp_bulk(
    sender: &UdpSocket,
    receiver: &UdpSocket,
    datagram: usize,
    count: u64,
    wait: UdpWait,
    batching: Batching,
) -> io::Result<BulkRound> {
    let datagram = datagram.max(16);
    prepare(sender, receiver.local_addr()?, UdpWait::Block)?;
    sender.set_read_timeout(Some(Duration::from_millis(2)))?;
    prepare(receiver, sender.local_addr()?, wait)?;
    let round = BULK_ROUND.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let sink = receiver.try_clone()?;
    let mut source = DatagramSource::new(&sink, batching, wait)?;
    let ready = Arc::new(std::sync::Barrier::new(2));
    let sink_ready = Arc::clone(&ready);
    let sink_thread = std::thread::spawn(move || -> io::Result<u64> {
        let mut received = 0u64;
        sink_ready.wait();
        loop {
            let mut finished = false;
            source.next_datagrams(&sink, &mut |bytes| {
                if bytes == fin(FIN, round) {
                    finished = true;
                } else if bytes.len() == datagram {
                    received += 1;
                }
            })?;
            if finished {
                sink.send(&fin(received, round))?;
                return Ok(received);
            }
        }
    });
    ready.wait();
    let result = (|| -> io::Result<BulkRound> {
        let start = Instant::now();
        match batching {
            Batching::Plain => {
                let mut out = vec![0x5au8; datagram];
                for i in 0..count {
                    out[..8].copy_from_slice(&i.to_le_bytes());
                    sender.send(&out)?;
                }
            }
            Batching::Segmented => send_segmented(sender, datagram, count)?,
        }
        let mut answer = [0u8; 32];
        let deadline = Instant::now() + UDP_TIMEOUT;
        loop {
            sender.send(&fin(FIN, round))?;
            match sender.recv(&mut answer) {
                Ok(16) if answer[8..16] == round.to_le_bytes() => {
                    let received = u64::from_le_bytes(answer[..8].try_into().expect("8 bytes"));
                    return Ok(BulkRound {
                        sent: count,
                        received,
                        seconds: start.elapsed().as_secs_f64(),
                    });
                }
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) && Instant::now() < deadline => {}
                Err(e) => return Err(e),
            }
        }
    })();
    if result.is_err() {
        // Free the sink if it is still waiting.
        let _ = sender.send(&fin(FIN, round));
    }
    let sunk = sink_thread
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("the sink thread panicked")));
    let round = result?;
    sunk?;
    Ok(round)
}

/// Sends `count` numbered datagrams of `datagram` bytes from `sender` in
/// segmented runs of [`SEGMENTED_RUN`] (fewer if the kernel segments
/// fewer; one at a time once it refused a run), waiting for room when the
/// socket's buffer is full (the socket is left blocking, as it was).
fn send_segmented(sender: &UdpSocket, datagram: usize, count: u64) -> io::Result<()> {
    let state = quinn_udp::UdpSocketState::new(quinn_udp::UdpSockRef::from(sender))?;
    let destination = sender.peer_addr()?;
    let mut out = vec![0x5au8; datagram * SEGMENTED_RUN as usize];
    let mut next = 0;
    let mut most = SEGMENTED_RUN.min(state.max_gso_segments() as u64).max(1);
    let result = (|| {
        while next < count {
            let run = (count - next).min(most);
            for k in 0..run {
                let at = k as usize * datagram;
                out[at..at + 8].copy_from_slice(&(next + k).to_le_bytes());
            }
            let transmit = quinn_udp::Transmit {
                destination,
                ecn: None,
                contents: &out[..run as usize * datagram],
                segment_size: (run > 1).then_some(datagram),
                src_ip: None,
            };
            match state.try_send(quinn_udp::UdpSockRef::from(sender), &transmit) {
                Ok(()) => next += run,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    wait_ready(sender, libc::POLLOUT, UDP_TIMEOUT)?;
                }
                Err(_) if run > 1 => most = 1,
                Err(e) => return Err(e),
            }
        }
        Ok(())
    })();
    sender.set_nonblocking(false)?;
    result
}

/// Waits until `socket` is ready for `events` (`poll`), for at most
/// `timeout`.
fn wait_ready(socket: &UdpSocket, events: libc::c_short, timeout: Duration) -> io::Result<()> {
    let mut fds = [libc::pollfd {
        fd: std::os::fd::AsRawFd::as_raw_fd(socket),
        events,
        revents: 0,
    }];
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let millis = libc::c_int::try_from(left.as_millis()).unwrap_or(libc::c_int::MAX);
        // SAFETY: `fds` is one live pollfd for the duration of the call.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), 1, millis) };
        match ready {
            0 => return Err(io::Error::new(io::ErrorKind::TimedOut, "socket not ready")),
            n if n < 0 => {
                let error = io::Error::last_os_error();
                if error.kind() != io::ErrorKind::Interrupted {
                    return Err(error);
                }
            }
            _ => return Ok(()),
        }
    }
}

/// Where the bulk transfer's sink takes its datagrams from.
enum DatagramSource {
    /// One `recv` per datagram.
    Plain { buf: Vec<u8>, wait: UdpWait },
    /// `quinn-udp`'s receive: coalesced runs, several buffers a call.
    Segmented {
        state: quinn_udp::UdpSocketState,
        buffers: Vec<Vec<u8>>,
        wait: UdpWait,
    },
}

impl DatagramSource {
    fn new(socket: &UdpSocket, batching: Batching, wait: UdpWait) -> io::Result<DatagramSource> {
        Ok(match batching {
            Batching::Plain => DatagramSource::Plain {
                buf: vec![0u8; 65536],
                wait,
            },
            Batching::Segmented => DatagramSource::Segmented {
                state: quinn_udp::UdpSocketState::new(quinn_udp::UdpSockRef::from(socket))?,
                buffers: vec![vec![0u8; 65536]; 8],
                wait,
            },
        })
    }

    /// Receives what the next call brings (at least one datagram, or an
    /// error after [`UDP_TIMEOUT`]) and hands each datagram to `each`.
    fn next_datagrams(
        &mut self,
        socket: &UdpSocket,
        each: &mut dyn FnMut(&[u8]),
    ) -> io::Result<()> {
        match self {
            DatagramSource::Plain { buf, wait } => {
                let n = recv(socket, buf, *wait)?;
                each(&buf[..n]);
                Ok(())
            }
            DatagramSource::Segmented {
                state,
                buffers,
                wait,
            } => {
                let deadline = Instant::now() + UDP_TIMEOUT;
                let mut meta = vec![quinn_udp::RecvMeta::default(); buffers.len()];
                loop {
                    let mut slices: Vec<io::IoSliceMut<'_>> =
                        buffers.iter_mut().map(|b| io::IoSliceMut::new(b)).collect();
                    match state.recv(quinn_udp::UdpSockRef::from(socket), &mut slices, &mut meta) {
                        Ok(filled) => {
                            for (buffer, meta) in buffers.iter().zip(&meta).take(filled) {
                                let stride = meta.stride.max(1);
                                for run in buffer[..meta.len].chunks(stride) {
                                    each(run);
                                }
                            }
                            return Ok(());
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                            let left = deadline.saturating_duration_since(Instant::now());
                            if left.is_zero() {
                                return Err(io::Error::new(
                                    io::ErrorKind::TimedOut,
                                    "no datagram within the timeout",
                                ));
                            }
                            match wait {
                                UdpWait::Block => wait_ready(socket, libc::POLLIN, left)?,
                                UdpWait::Spin => std::hint::spin_loop(),
                            }
                        }
                        Err(e) => return Err(e),
                    }
                }
            }
        }
    }
}

/// What the reliable endpoint's state costs with a number of peers.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct EndpointMemory {
    /// Peers added.
    pub peers: usize,
    /// `Endpoint::memory()`: bytes independent of the peers, the pool
    /// included.
    pub fixed_bytes: usize,
    /// Of which the retransmission pool.
    pub pool_bytes: usize,
    /// `Endpoint::memory()`: bytes of state per peer.
    pub per_peer_bytes: usize,
    /// Fixed plus per-peer bytes of all peers.
    pub total_bytes: usize,
    /// Heap the endpoint took when made (measured by the caller's
    /// allocator), in bytes.
    pub heap_fixed_bytes: usize,
    /// Heap the peers added, over the number of peers (measured; it
    /// includes spare capacity of growing tables), in bytes.
    pub heap_per_peer_bytes: f64,
}

/// Makes an endpoint, adds `peers` peers, and reports its own memory
/// figures beside the heap growth `heap_in_use` (bytes allocated now, from
/// a counting allocator; `None` when there is none) sees.
pub fn endpoint_memory(
    peers: usize,
    heap_in_use: &dyn Fn() -> Option<usize>,
) -> Result<EndpointMemory, Box<dyn std::error::Error>> {
    use pindown_emu_device::net::{Config, Endpoint, Identity};
    let before = heap_in_use();
    let mut endpoint = Endpoint::new(
        Identity {
            fabric: 0x5eed,
            node: 0,
            incarnation: 1,
        },
        Config::default(),
    )?;
    let made = heap_in_use();
    for node in 1..=peers {
        endpoint.add_peer(u16::try_from(node)?)?;
    }
    let added = heap_in_use();
    let report = endpoint.memory();
    let difference = |a: Option<usize>, b: Option<usize>| match (a, b) {
        (Some(a), Some(b)) => b.saturating_sub(a),
        _ => 0,
    };
    Ok(EndpointMemory {
        peers,
        fixed_bytes: report.fixed_bytes,
        pool_bytes: report.pool_bytes,
        per_peer_bytes: report.per_peer_bytes,
        total_bytes: report.total(),
        heap_fixed_bytes: difference(before, made),
        heap_per_peer_bytes: difference(made, added) as f64 / peers.max(1) as f64,
    })
}

/// Resident memory of process `pid` (`VmRSS`), in bytes.
pub fn rss_bytes(pid: u32) -> io::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|kib| kib.parse::<u64>().ok())
        .map(|kib| kib * 1024)
        .ok_or_else(|| io::Error::other("no VmRSS"))
}

/// The fabric link's status line of the device whose control socket is
/// `control` (the first of its answer; a line per peer follows), as
/// `key=value` pairs.
pub fn fabric_status(
    control: &std::path::Path,
) -> io::Result<std::collections::BTreeMap<String, u64>> {
    use std::io::{Read, Write};
    let mut stream = std::os::unix::net::UnixStream::connect(control)?;
    stream.set_read_timeout(Some(UDP_TIMEOUT))?;
    stream.write_all(b"fabric\n")?;
    let mut text = String::new();
    stream.read_to_string(&mut text)?;
    Ok(text
        .lines()
        .next()
        .unwrap_or("")
        .split_whitespace()
        .filter_map(|kv| kv.split_once('='))
        .filter_map(|(k, v)| Some((k.to_string(), v.parse().ok()?)))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (UdpSocket, UdpSocket) {
        let hosts = Hosts::set_up(true);
        (hosts.bind_udp(0, 0).unwrap(), hosts.bind_udp(1, 0).unwrap())
    }

    #[test]
    fn round_trips_echo_every_payload() {
        for wait in [UdpWait::Spin, UdpWait::Block] {
            let (a, b) = pair();
            let (summary, right) = udp_round_trips(&a, &b, 64, 5, 50, wait).unwrap();
            assert!(right);
            assert_eq!(summary.samples, 50);
            assert!(summary.min > 0.0);
        }
    }

    #[test]
    fn bulk_counts_what_arrived() {
        for batching in [Batching::Plain, Batching::Segmented] {
            for wait in [UdpWait::Block, UdpWait::Spin] {
                let (a, b) = pair();
                let round = udp_bulk(&a, &b, 1400, 200, wait, batching).unwrap();
                assert_eq!(round.sent, 200);
                assert!(round.received <= 200 && round.received > 0, "{round:?}");
                assert!(round.gb_per_s(1400) > 0.0);
            }
        }
    }

    #[test]
    fn endpoint_memory_grows_per_peer() {
        let two = endpoint_memory(2, &|| None).unwrap();
        let many = endpoint_memory(100, &|| None).unwrap();
        assert_eq!(two.fixed_bytes, many.fixed_bytes);
        assert!(two.per_peer_bytes > 0);
        assert_eq!(many.total_bytes - two.total_bytes, 98 * many.per_peer_bytes);
    }

    #[test]
    fn loopback_hosts_say_why() {
        let hosts = Hosts::set_up(true);
        assert_eq!(hosts.kind(), "loopback");
        assert!(hosts.report().fallback_reason.is_some());
        assert!(hosts.netns(0).is_none());
    }
}
