//! The transport layer: how the driver reaches and configures the device.
//!
//! [`Transport`] is everything the queue and memory layers need from a
//! device connection: feature negotiation, the memory table, queue set-up,
//! doorbells, completion events and IOTLB entries. [`VhostUserTransport`]
//! implements it as an embedded vhost-user frontend over a unix socket (the
//! host case: the driver shares its memfd-backed arena with the device
//! process); a VFIO virtio-pci transport (the guest case) implements the same
//! trait without changes above this layer.
//!
//! # Device conventions
//!
//! The device is a virtio-net device. With `P` queue pairs (what
//! `GET_QUEUE_NUM` returns), rings `2i` and `2i + 1` are the receive and
//! transmit queues of pair `i`, ring `2P` is the RDMA send queue and ring
//! `2P + 1` the RDMA completion queue, as [`pindown_uapi::RingLayout`] says.
//!
//! With `VIRTIO_F_ACCESS_PLATFORM` negotiated, every address the driver hands
//! the device (ring addresses, buffer addresses) is an IOVA that the device
//! translates only through the IOTLB entries the driver installed
//! ([`Transport::iotlb_map`]). The driver uses identity IOVAs (IOVA = its own
//! virtual address), so entries map `[iova, iova + len)` onto the same
//! userspace addresses.

use std::io::{self, Read};
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, RwLock};
use pindown_uapi::{IotlbMessage, RingLayout, VhostAccess, MAX_RDMA_QUEUE_PAIRS};
use vhost::vhost_user::message::{FrontendReq, VhostUserHeaderFlag};
use vhost::vhost_user::{Frontend, VhostUserFrontend, VhostUserProtocolFeatures};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::arena::MemoryTableRegion;
use crate::virtqueue::QueueLayout;

pub use pindown_uapi::features::{
    ACCESS_PLATFORM as F_ACCESS_PLATFORM, EVENT_IDX as F_EVENT_IDX, NET_MAC as F_NET_MAC,
    NET_MQ as F_NET_MQ, PROTOCOL_FEATURES as F_PROTOCOL_FEATURES, VERSION_1 as F_VERSION_1,
};
/// The virtio features the driver asks for by default.
pub const DEFAULT_FEATURES: u64 =
    F_VERSION_1 | F_ACCESS_PLATFORM | F_EVENT_IDX | F_NET_MQ | F_NET_MAC;

/// Index of a ring of the device.
pub type QueueIndex = u16;

/// What the device may do with an IOTLB mapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IotlbAccess {
    /// The device may read.
    ReadOnly,
    /// The device may write.
    WriteOnly,
    /// The device may read and write.
    ReadWrite,
}

impl From<IotlbAccess> for VhostAccess {
    fn from(access: IotlbAccess) -> Self {
        match access {
            IotlbAccess::ReadOnly => VhostAccess::ReadOnly,
            IotlbAccess::WriteOnly => VhostAccess::WriteOnly,
            IotlbAccess::ReadWrite => VhostAccess::ReadWrite,
        }
    }
}

/// Why a transport operation failed.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// The socket could not be connected.
    #[error("cannot connect to the vhost-user socket {path}: {source}")]
    Connect {
        /// The socket path.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// The device closed the connection (or it broke).
    #[error("the device closed the vhost-user connection during {request}")]
    Disconnected {
        /// The request in progress.
        request: &'static str,
    },
    /// The device did not answer in time.
    #[error("the device did not answer {request} within {timeout:?}")]
    Timeout {
        /// The request in progress.
        request: &'static str,
        /// How long the driver waited.
        timeout: Duration,
    },
    /// The device answered with a failure status.
    #[error("the device rejected {request} (status {status})")]
    Rejected {
        /// The request.
        request: &'static str,
        /// The status it returned (non-zero).
        status: u64,
    },
    /// The exchange did not follow the protocol.
    #[error("vhost-user {request} failed: {reason}")]
    Protocol {
        /// The request.
        request: &'static str,
        /// What went wrong.
        reason: String,
    },
    /// The device lacks features the driver cannot do without.
    #[error("the device does not offer the required {kind} features {missing:#x}")]
    MissingFeatures {
        /// `"virtio"` or `"vhost-user protocol"`.
        kind: &'static str,
        /// The missing bits.
        missing: u64,
    },
    /// No such ring.
    #[error("queue {index} does not exist (the device has {count} queues)")]
    NoSuchQueue {
        /// The ring asked for.
        index: QueueIndex,
        /// Rings the device has.
        count: u16,
    },
    /// The ring was not set up with [`Transport::setup_queue`].
    #[error("queue {0} is not set up")]
    QueueNotSetUp(QueueIndex),
    /// An argument is out of range.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A local system call failed.
    #[error("{operation} failed: {source}")]
    Io {
        /// The operation.
        operation: &'static str,
        /// The error.
        source: io::Error,
    },
    /// An earlier failure left the connection out of step; reconnect.
    #[error("the vhost-user connection is unusable after an earlier failure: {0}")]
    Broken(String),
}

/// A completion wait handle: an eventfd the device signals when it wants the
/// driver to look at a queue's used ring.
#[derive(Debug, Clone)]
pub struct CompletionEvent {
    fd: Arc<EventFd>,
}

impl CompletionEvent {
    /// Wraps an eventfd (non-blocking mode expected).
    pub fn new(fd: Arc<EventFd>) -> Self {
        Self { fd }
    }

    /// The descriptor to poll or epoll on (readable when signalled).
    pub fn fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the eventfd is owned by the Arc `self` holds, so it stays
        // open for the lifetime of the borrow.
        unsafe { BorrowedFd::borrow_raw(self.fd.as_raw_fd()) }
    }

    /// Consumes pending signals without blocking; returns how many there
    /// were (0 if none).
    pub fn take(&self) -> io::Result<u64> {
        match self.fd.read() {
            Ok(count) => Ok(count),
            Err(err) if err.kind() == io::ErrorKind::WouldBlock => Ok(0),
            Err(err) => Err(err),
        }
    }

    /// Blocks until signalled or until `timeout` passes (forever if `None`);
    /// consumes the signal. Returns whether it was signalled.
    pub fn wait(&self, timeout: Option<Duration>) -> io::Result<bool> {
        if !poll_readable(self.fd.as_raw_fd(), timeout)? {
            return Ok(false);
        }
        Ok(self.take()? > 0)
    }
}

/// Waits until `fd` is readable (or hung up); `false` on timeout.
fn poll_readable(fd: RawFd, timeout: Option<Duration>) -> io::Result<bool> {
    Ok(poll_one(fd, libc::POLLIN, timeout)? != 0)
}

/// What `poll` reports of a connection whose other end closed.
pub(crate) const HANGUP_EVENTS: libc::c_short = libc::POLLHUP | libc::POLLRDHUP | libc::POLLERR;

/// Waits until the connection `fd` polls as hung up (its other end
/// closed); `false` when `timeout` passes first (`None`: no limit; zero: a
/// look).
pub(crate) fn poll_hangup(fd: RawFd, timeout: Option<Duration>) -> io::Result<bool> {
    Ok(poll_one(fd, libc::POLLRDHUP, timeout)? & HANGUP_EVENTS != 0)
}

/// Polls one descriptor for `events` until one is reported or `timeout`
/// passes (`None`: no limit), through interruptions; returns the events
/// reported (0 on timeout).
fn poll_one(
    fd: RawFd,
    events: libc::c_short,
    timeout: Option<Duration>,
) -> io::Result<libc::c_short> {
    // A timeout too long for the clock is no limit.
    let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
    loop {
        let millis = deadline.map_or(-1, |at| {
            let left = at.saturating_duration_since(Instant::now());
            // Rounded up, so a wait never ends before its deadline.
            i32::try_from(left.as_micros().div_ceil(1000)).unwrap_or(i32::MAX)
        });
        let mut pfd = libc::pollfd {
            fd,
            events,
            revents: 0,
        };
        // SAFETY: one pollfd that we own, count 1; poll only writes its
        // `revents`.
        let ready = unsafe { libc::poll(&mut pfd, 1, millis) };
        if ready >= 0 {
            return Ok(if ready > 0 { pfd.revents } else { 0 });
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// What the layers above need from a connection to the device.
///
/// Implementations are shared between threads; doorbells
/// ([`notify`](Self::notify)) must be cheap and must not wait for control
/// operations in progress on other queues.
pub trait Transport: Send + Sync {
    /// The virtio features the device offers.
    fn device_features(&self) -> u64;

    /// Acknowledges `wanted & offered` and returns the accepted set. Must
    /// precede queue set-up.
    fn negotiate_features(&self, wanted: u64) -> Result<u64, TransportError>;

    /// The features accepted by the last negotiation (0 before).
    fn features(&self) -> u64;

    /// The rings this transport reaches: the net queue pairs, then the
    /// RDMA queue pairs it can set up (the device may serve fewer: it
    /// reports its own count in [`DeviceInfo`](pindown_uapi::DeviceInfo)).
    fn ring_layout(&self) -> RingLayout;

    /// Whether every ring must be set up before the device starts, none
    /// later (virtio-pci: queues are enabled before `DRIVER_OK`). The
    /// verbs layer then sets up all RDMA queue pairs at once.
    fn rings_fixed_at_start(&self) -> bool {
        false
    }

    /// Tells the device which memory it may map (replacing any earlier
    /// table). Every address the driver hands the device lies in one of
    /// these regions.
    fn register_memory(&self, regions: &[MemoryTableRegion<'_>]) -> Result<(), TransportError>;

    /// Sets up ring `index` from `layout` (size, addresses, starting at index
    /// 0) and creates its doorbell and completion event. With
    /// `ACCESS_PLATFORM`, first installs an IOTLB entry covering the ring
    /// memory. The ring stays disabled until [`enable_queue`](Self::enable_queue).
    fn setup_queue(&self, index: QueueIndex, layout: &QueueLayout) -> Result<(), TransportError>;

    /// Enables or disables ring `index`.
    fn enable_queue(&self, index: QueueIndex, enabled: bool) -> Result<(), TransportError>;

    /// Rings the doorbell of ring `index` (new available buffers).
    fn notify(&self, index: QueueIndex) -> Result<(), TransportError>;

    /// The completion wait handle of ring `index`.
    fn completion_event(&self, index: QueueIndex) -> Result<CompletionEvent, TransportError>;

    /// Whether addresses are translated through the IOTLB
    /// (`ACCESS_PLATFORM` negotiated). If not, [`iotlb_map`](Self::iotlb_map)
    /// and [`iotlb_unmap`](Self::iotlb_unmap) succeed without doing anything.
    fn iotlb_enabled(&self) -> bool;

    /// Whether the device reaches any memory of this process through
    /// [`iotlb_map`](Self::iotlb_map) alone (an IOMMU that maps process
    /// pages, as VFIO does). If not, the device reaches only the files of
    /// the memory table ([`register_memory`](Self::register_memory)).
    fn maps_process_memory(&self) -> bool {
        false
    }

    /// How many more [`iotlb_map`](Self::iotlb_map) entries the mechanism
    /// underneath can hold, if it has a limit (VFIO's per-container DMA
    /// entry limit). The pin-down cache keeps its entry count below it.
    fn mapping_budget(&self) -> Option<usize> {
        None
    }

    /// A descriptor that polls as hung up (`POLLHUP`, `POLLRDHUP` or
    /// `POLLERR`) once the device has closed the connection, its process
    /// gone: waits for its answers end then instead of at their timeout.
    /// `None` when the transport has no such descriptor.
    fn hangup_fd(&self) -> Option<BorrowedFd<'_>> {
        None
    }

    /// Ends the connection and waits up to `timeout` for the device's word
    /// that it no longer touches this process's memory: a vhost-user
    /// device closes its end once it has reset the port, a virtio-pci
    /// device reads back status 0 after a reset. Returns whether the word
    /// came; if not, memory the device was given (rings above all, which
    /// it writes on its own) must never be handed out again. No request
    /// works afterwards, except that removing IOTLB entries succeeds
    /// without a word where the word came and the device forgot them all.
    /// Without a way to end the connection (the default), `false`.
    fn disconnect(&self, timeout: Duration) -> bool {
        let _ = timeout;
        false
    }

    /// Lets go of the connection without ending it, in a child of `fork()`
    /// that inherited it from the process that opened it: from then on
    /// nothing is sent or changed through it (requests fail, removing
    /// IOTLB entries succeeds without a word), so the parent's connection
    /// is left as it was. By default, nothing to do.
    fn abandon(&self) {}

    /// Lets the device reach `[iova, iova + len)` with `access`; the bytes
    /// are at `uaddr` in this process (inside a registered region).
    fn iotlb_map(
        &self,
        iova: u64,
        len: u64,
        uaddr: u64,
        access: IotlbAccess,
    ) -> Result<(), TransportError>;

    /// Removes the device's translations of `[iova, iova + len)`.
    fn iotlb_unmap(&self, iova: u64, len: u64) -> Result<(), TransportError>;
}

/// How to connect a [`VhostUserTransport`].
#[derive(Debug, Clone)]
pub struct VhostUserConfig {
    /// Protocol features to use if offered. `REPLY_ACK` is required (every
    /// IOTLB update is confirmed before the driver relies on it).
    pub protocol_features: VhostUserProtocolFeatures,
    /// How long to wait for the answer to any control request (the
    /// handshake, memory tables, rings, IOTLB updates): one not answered
    /// in time fails with [`TransportError::Timeout`] and the connection
    /// counts as broken. A peer that closes the socket is detected at
    /// once in any case.
    pub reply_timeout: Duration,
}

impl Default for VhostUserConfig {
    fn default() -> Self {
        Self {
            protocol_features: VhostUserProtocolFeatures::MQ
                | VhostUserProtocolFeatures::REPLY_ACK
                | VhostUserProtocolFeatures::BACKEND_REQ,
            reply_timeout: Duration::from_secs(10),
        }
    }
}

/// Size of the vhost-user message header (request, flags, size; le32 each).
const HEADER_LEN: usize = 12;
/// Protocol version 1, in the low bits of the header flags.
const FLAG_VERSION: u32 = 0x1;

struct Control {
    frontend: Frontend,
    /// A second handle on the main socket, for the requests `Frontend`
    /// cannot send; used only under the same lock.
    raw: UnixStream,
    broken: Option<String>,
    /// Ends a `Frontend` request whose answer does not come.
    watchdog: Watchdog,
    /// How long a request waits for its answer.
    reply_timeout: Duration,
}

/// A thread that shuts the vhost-user socket down when a `Frontend`
/// request has waited longer than its deadline: the `vhost` crate waits
/// for a reply with no deadline of its own (and retries a read that
/// times out), so a device that never answers would hold the caller for
/// ever. The shutdown fails the blocked read at once.
struct Watchdog {
    shared: Arc<(Mutex<WatchState>, Condvar)>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// The process that started the thread (a child of `fork()` has no
    /// such thread, and leaves the state alone).
    owner: u32,
}

#[derive(Default)]
struct WatchState {
    /// The deadline of the request in progress.
    armed: Option<Instant>,
    /// The socket was shut down for the request in progress.
    fired: bool,
    stop: bool,
}

impl Watchdog {
    /// Starts the thread over its own handle on the socket.
    fn new(socket: UnixStream) -> io::Result<Self> {
        let shared = Arc::new((Mutex::new(WatchState::default()), Condvar::new()));
        let watched = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("vhost-user-watchdog".into())
            .spawn(move || Self::watch(&watched, &socket))?;
        Ok(Self {
            shared,
            thread: Some(thread),
            owner: std::process::id(),
        })
    }

    fn watch(shared: &(Mutex<WatchState>, Condvar), socket: &UnixStream) {
        let (lock, wake) = shared;
        let mut state = lock.lock();
        while !state.stop {
            match state.armed {
                None => wake.wait(&mut state),
                Some(deadline) if Instant::now() >= deadline => {
                    let _ = socket.shutdown(std::net::Shutdown::Both);
                    state.fired = true;
                    state.armed = None;
                }
                Some(deadline) => {
                    wake.wait_until(&mut state, deadline);
                }
            }
        }
    }

    /// Watches a request that must be answered within `timeout`.
    fn arm(&self, timeout: Duration) {
        let (lock, wake) = &*self.shared;
        let mut state = lock.lock();
        state.armed = Instant::now().checked_add(timeout);
        state.fired = false;
        wake.notify_one();
    }

    /// The request ended; whether the socket was shut down meanwhile.
    fn disarm(&self) -> bool {
        let (lock, _) = &*self.shared;
        let mut state = lock.lock();
        state.armed = None;
        state.fired
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        if std::process::id() != self.owner {
            // A child of fork(): the thread stayed with the parent (and
            // its lock may have been held there at the fork).
            return;
        }
        let (lock, wake) = &*self.shared;
        lock.lock().stop = true;
        wake.notify_one();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[derive(Debug)]
struct QueueFds {
    kick: EventFd,
    call: Arc<EventFd>,
}

/// The embedded vhost-user frontend: the host transport.
///
/// Control requests are serialized under one lock; doorbells and completion
/// events use per-queue eventfds and take no lock beyond a shared read lock.
pub struct VhostUserTransport {
    control: Mutex<Control>,
    device_features: u64,
    acked: AtomicU64,
    protocol: VhostUserProtocolFeatures,
    queue_pairs: u16,
    queues: RwLock<Vec<Option<QueueFds>>>,
    backend_channel: Option<UnixStream>,
    reply_timeout: Duration,
    /// A third handle on the main socket, never read or written: polled
    /// for the device's hang-up ([`Transport::hangup_fd`]), and shut for
    /// writing by [`Transport::disconnect`].
    hangup: UnixStream,
    /// Set by [`Transport::disconnect`] once the device confirmed (it
    /// forgot every IOTLB entry) and by [`Transport::abandon`] (in a child
    /// of `fork()`, the entries are the parent's): IOTLB removals no
    /// longer go to the device.
    let_go: AtomicBool,
}

impl std::fmt::Debug for VhostUserTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VhostUserTransport")
            .field(
                "device_features",
                &format_args!("{:#x}", self.device_features),
            )
            .field("features", &format_args!("{:#x}", self.features()))
            .field("protocol", &self.protocol)
            .field("queue_pairs", &self.queue_pairs)
            .finish()
    }
}

fn request_name(req: FrontendReq) -> &'static str {
    match req {
        FrontendReq::GET_FEATURES => "GET_FEATURES",
        FrontendReq::SET_FEATURES => "SET_FEATURES",
        FrontendReq::SET_OWNER => "SET_OWNER",
        FrontendReq::RESET_OWNER => "RESET_OWNER",
        FrontendReq::SET_MEM_TABLE => "SET_MEM_TABLE",
        FrontendReq::SET_VRING_NUM => "SET_VRING_NUM",
        FrontendReq::SET_VRING_ADDR => "SET_VRING_ADDR",
        FrontendReq::SET_VRING_BASE => "SET_VRING_BASE",
        FrontendReq::SET_VRING_KICK => "SET_VRING_KICK",
        FrontendReq::SET_VRING_CALL => "SET_VRING_CALL",
        FrontendReq::GET_PROTOCOL_FEATURES => "GET_PROTOCOL_FEATURES",
        FrontendReq::SET_PROTOCOL_FEATURES => "SET_PROTOCOL_FEATURES",
        FrontendReq::GET_QUEUE_NUM => "GET_QUEUE_NUM",
        FrontendReq::SET_VRING_ENABLE => "SET_VRING_ENABLE",
        FrontendReq::SET_BACKEND_REQ_FD => "SET_BACKEND_REQ_FD",
        FrontendReq::IOTLB_MSG => "IOTLB_MSG",
        _ => "vhost-user request",
    }
}

/// Turns an error of the `vhost` crate into ours.
fn vhost_error(request: &'static str, err: vhost::Error) -> TransportError {
    use vhost::vhost_user::Error as E;
    match err {
        vhost::Error::VhostUserProtocol(
            E::Disconnected | E::PartialMessage | E::SocketBroken(_),
        ) => TransportError::Disconnected { request },
        vhost::Error::VhostUserProtocol(E::BackendInternalError) => {
            TransportError::Rejected { request, status: 1 }
        }
        other => TransportError::Protocol {
            request,
            reason: other.to_string(),
        },
    }
}

fn io_error(request: &'static str, err: io::Error, timeout: Duration) -> TransportError {
    match err.kind() {
        io::ErrorKind::UnexpectedEof
        | io::ErrorKind::BrokenPipe
        | io::ErrorKind::ConnectionReset
        | io::ErrorKind::ConnectionAborted => TransportError::Disconnected { request },
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
            TransportError::Timeout { request, timeout }
        }
        _ => TransportError::Protocol {
            request,
            reason: err.to_string(),
        },
    }
}

impl Control {
    fn check(&self) -> Result<(), TransportError> {
        match &self.broken {
            Some(why) => Err(TransportError::Broken(why.clone())),
            None => Ok(()),
        }
    }

    /// Runs one `Frontend` request; a failure other than a clean rejection
    /// leaves the stream out of step, so the connection is marked broken.
    /// A request not answered within `reply_timeout` fails with
    /// [`TransportError::Timeout`] (its watchdog shut the socket down).
    fn run<R>(
        &mut self,
        request: FrontendReq,
        op: impl FnOnce(&mut Frontend) -> vhost::Result<R>,
    ) -> Result<R, TransportError> {
        self.check()?;
        let name = request_name(request);
        self.watchdog.arm(self.reply_timeout);
        let result = op(&mut self.frontend);
        if self.watchdog.disarm() {
            let timeout = self.reply_timeout;
            return Err(self.note(TransportError::Timeout {
                request: name,
                timeout,
            }));
        }
        result.map_err(|err| self.note(vhost_error(name, err)))
    }

    fn note(&mut self, err: TransportError) -> TransportError {
        if !matches!(err, TransportError::Rejected { .. }) {
            self.broken = Some(err.to_string());
        }
        err
    }

    /// Sends a request this crate builds itself and reads its `u64` reply
    /// (a value, or a REPLY_ACK status when `need_reply`).
    fn raw_request(
        &mut self,
        request: FrontendReq,
        body: &[u8],
        need_reply: bool,
        timeout: Duration,
    ) -> Result<u64, TransportError> {
        self.check()?;
        let name = request_name(request);
        let result = self.raw_exchange(request, body, need_reply, timeout, name);
        result.map_err(|err| self.note(err))
    }

    fn raw_exchange(
        &mut self,
        request: FrontendReq,
        body: &[u8],
        need_reply: bool,
        timeout: Duration,
        name: &'static str,
    ) -> Result<u64, TransportError> {
        let mut flags = FLAG_VERSION;
        if need_reply {
            flags |= VhostUserHeaderFlag::NEED_REPLY.bits();
        }
        // The header: request code, flags, payload size, all le32.
        let mut message = Vec::with_capacity(HEADER_LEN + body.len());
        message.extend_from_slice(&(request as u32).to_le_bytes());
        message.extend_from_slice(&flags.to_le_bytes());
        message.extend_from_slice(&(body.len() as u32).to_le_bytes());
        message.extend_from_slice(body);
        send_all(&self.raw, &message).map_err(|err| io_error(name, err, timeout))?;

        let mut reply = [0u8; HEADER_LEN + 8];
        let mut got = 0;
        while got < reply.len() {
            if !poll_readable(self.raw.as_raw_fd(), Some(timeout))
                .map_err(|err| io_error(name, err, timeout))?
            {
                return Err(TransportError::Timeout {
                    request: name,
                    timeout,
                });
            }
            match self.raw.read(&mut reply[got..]) {
                Ok(0) => return Err(TransportError::Disconnected { request: name }),
                Ok(n) => got += n,
                Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
                Err(err) => return Err(io_error(name, err, timeout)),
            }
        }
        let word = |at: usize| u32::from_le_bytes(reply[at..at + 4].try_into().expect("4 bytes"));
        let (code, reply_flags, size) = (word(0), word(4), word(8));
        if code != request as u32
            || reply_flags & VhostUserHeaderFlag::REPLY.bits() == 0
            || size != 8
        {
            return Err(TransportError::Protocol {
                request: name,
                reason: format!(
                    "unexpected reply header (request {code}, flags {reply_flags:#x}, size {size})"
                ),
            });
        }
        Ok(u64::from_le_bytes(
            reply[HEADER_LEN..].try_into().expect("8 bytes"),
        ))
    }
}

/// Writes all of `data` without raising SIGPIPE if the peer is gone.
fn send_all(sock: &UnixStream, mut data: &[u8]) -> io::Result<()> {
    while !data.is_empty() {
        // SAFETY: sends from a slice we own on a socket we own.
        let sent = unsafe {
            libc::send(
                sock.as_raw_fd(),
                data.as_ptr().cast(),
                data.len(),
                libc::MSG_NOSIGNAL,
            )
        };
        if sent < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        data = &data[sent as usize..];
    }
    Ok(())
}

impl VhostUserTransport {
    /// Connects to the vhost-user socket at `path` and performs the
    /// handshake (see [`from_stream`](Self::from_stream)).
    pub fn connect(
        path: impl AsRef<Path>,
        config: VhostUserConfig,
    ) -> Result<Self, TransportError> {
        let path = path.as_ref();
        let stream = UnixStream::connect(path).map_err(|source| TransportError::Connect {
            path: path.to_owned(),
            source,
        })?;
        Self::from_stream(stream, config)
    }

    /// Performs the handshake over a connected socket: `SET_OWNER`,
    /// `GET_FEATURES`, `GET_PROTOCOL_FEATURES`, `SET_PROTOCOL_FEATURES`,
    /// `GET_QUEUE_NUM` (if `MQ`), `SET_BACKEND_REQ_FD` (if `BACKEND_REQ`).
    /// From then on every request asks for a `REPLY_ACK`. Features are
    /// acknowledged later, by [`Transport::negotiate_features`].
    pub fn from_stream(
        stream: UnixStream,
        config: VhostUserConfig,
    ) -> Result<Self, TransportError> {
        let raw = stream.try_clone().map_err(|source| TransportError::Io {
            operation: "dup of the vhost-user socket",
            source,
        })?;
        let hangup = stream.try_clone().map_err(|source| TransportError::Io {
            operation: "dup of the vhost-user socket",
            source,
        })?;
        let watched = stream.try_clone().map_err(|source| TransportError::Io {
            operation: "dup of the vhost-user socket",
            source,
        })?;
        let watchdog = Watchdog::new(watched).map_err(|source| TransportError::Io {
            operation: "start of the vhost-user watchdog thread",
            source,
        })?;
        let frontend =
            Frontend::from_stream(stream, vhost::vhost_user::message::VHOST_USER_MAX_VRINGS);
        let mut control = Control {
            frontend,
            raw,
            broken: None,
            watchdog,
            reply_timeout: config.reply_timeout,
        };
        control.run(FrontendReq::SET_OWNER, |f| f.set_owner())?;
        let device_features = control.run(FrontendReq::GET_FEATURES, |f| f.get_features())?;
        if device_features & F_PROTOCOL_FEATURES == 0 {
            return Err(TransportError::MissingFeatures {
                kind: "virtio",
                missing: F_PROTOCOL_FEATURES,
            });
        }
        let offered = control.run(FrontendReq::GET_PROTOCOL_FEATURES, |f| {
            f.get_protocol_features()
        })?;
        let required = VhostUserProtocolFeatures::REPLY_ACK;
        if !offered.contains(required) {
            return Err(TransportError::MissingFeatures {
                kind: "vhost-user protocol",
                missing: (required - offered).bits(),
            });
        }
        let protocol = offered & config.protocol_features;
        control.run(FrontendReq::SET_PROTOCOL_FEATURES, |f| {
            f.set_protocol_features(protocol)
        })?;
        control
            .frontend
            .set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
        let queue_pairs = if protocol.contains(VhostUserProtocolFeatures::MQ) {
            let pairs = control.raw_request(
                FrontendReq::GET_QUEUE_NUM,
                &[],
                false,
                config.reply_timeout,
            )?;
            if pairs == 0 || pairs > 127 {
                return Err(TransportError::Protocol {
                    request: "GET_QUEUE_NUM",
                    reason: format!("device reports {pairs} queue pairs"),
                });
            }
            pairs as u16
        } else {
            1
        };
        let backend_channel = if protocol.contains(VhostUserProtocolFeatures::BACKEND_REQ) {
            let (ours, theirs) = UnixStream::pair().map_err(|source| TransportError::Io {
                operation: "socketpair for the backend channel",
                source,
            })?;
            control.run(FrontendReq::SET_BACKEND_REQ_FD, |f| {
                f.set_backend_request_fd(&theirs)
            })?;
            Some(ours)
        } else {
            None
        };
        let layout = RingLayout {
            queue_pairs,
            rdma_queue_pairs: MAX_RDMA_QUEUE_PAIRS,
        };
        let num_queues = usize::from(layout.ring_count());
        Ok(Self {
            control: Mutex::new(control),
            device_features,
            acked: AtomicU64::new(0),
            protocol,
            queue_pairs,
            queues: RwLock::new((0..num_queues).map(|_| None).collect()),
            backend_channel,
            reply_timeout: config.reply_timeout,
            hangup,
            let_go: AtomicBool::new(false),
        })
    }

    /// The protocol features in use.
    pub fn protocol_features(&self) -> VhostUserProtocolFeatures {
        self.protocol
    }

    /// The driver's end of the backend request channel (where the device
    /// sends IOTLB misses), if `BACKEND_REQ` is in use.
    pub fn backend_channel(&self) -> Option<&UnixStream> {
        self.backend_channel.as_ref()
    }

    /// Sends `RESET_OWNER` and waits for the device's acknowledgement:
    /// the device forgets the port's memory, IOTLB, rings and windows, and
    /// once it has answered, no access to that memory is in flight. The
    /// connection stays open but every ring and mapping is gone: the
    /// transport (and a [`Context`](crate::verbs::Context) over it) cannot
    /// be used for RDMA again; reconnect instead. Meant for tests of the
    /// device's reset path.
    pub fn reset_owner(&self) -> Result<(), TransportError> {
        self.control
            .lock()
            .run(FrontendReq::RESET_OWNER, |f| f.reset_owner())
    }

    fn check_queue(&self, index: QueueIndex) -> Result<(), TransportError> {
        let count = self.ring_layout().ring_count();
        if index >= count {
            return Err(TransportError::NoSuchQueue { index, count });
        }
        Ok(())
    }

    fn iotlb_msg(&self, msg: IotlbMessage) -> Result<(), TransportError> {
        let status = self.control.lock().raw_request(
            FrontendReq::IOTLB_MSG,
            &msg.encode(),
            true,
            self.reply_timeout,
        )?;
        if status != 0 {
            return Err(TransportError::Rejected {
                request: "IOTLB_MSG",
                status,
            });
        }
        Ok(())
    }
}

impl Transport for VhostUserTransport {
    fn device_features(&self) -> u64 {
        self.device_features
    }

    fn hangup_fd(&self) -> Option<BorrowedFd<'_>> {
        use std::os::fd::AsFd;
        Some(self.hangup.as_fd())
    }

    fn negotiate_features(&self, wanted: u64) -> Result<u64, TransportError> {
        if wanted & F_VERSION_1 != 0 && self.device_features & F_VERSION_1 == 0 {
            return Err(TransportError::MissingFeatures {
                kind: "virtio",
                missing: F_VERSION_1,
            });
        }
        let accepted = (wanted & self.device_features) | F_PROTOCOL_FEATURES;
        self.control
            .lock()
            .run(FrontendReq::SET_FEATURES, |f| f.set_features(accepted))?;
        self.acked.store(accepted, Ordering::Release);
        Ok(accepted)
    }

    fn features(&self) -> u64 {
        self.acked.load(Ordering::Acquire)
    }

    /// The net queue pairs `GET_QUEUE_NUM` reported, and as many RDMA
    /// queue pairs as the ABI allows: rings can be set up at any time, and
    /// the device refuses those it does not have.
    fn ring_layout(&self) -> RingLayout {
        RingLayout {
            queue_pairs: self.queue_pairs,
            rdma_queue_pairs: MAX_RDMA_QUEUE_PAIRS,
        }
    }

    fn register_memory(&self, regions: &[MemoryTableRegion<'_>]) -> Result<(), TransportError> {
        let most = crate::reach::MAX_REGIONS;
        if regions.is_empty() || regions.len() > most {
            return Err(TransportError::InvalidArgument(format!(
                "{} memory regions (1 to {most} allowed)",
                regions.len()
            )));
        }
        let table: Vec<VhostUserMemoryRegionInfo> = regions
            .iter()
            .map(|region| VhostUserMemoryRegionInfo {
                guest_phys_addr: region.iova,
                memory_size: region.size,
                userspace_addr: region.userspace_addr,
                mmap_offset: region.file_offset,
                mmap_handle: region.fd.as_raw_fd(),
            })
            .collect();
        self.control
            .lock()
            .run(FrontendReq::SET_MEM_TABLE, |f| f.set_mem_table(&table))?;
        Ok(())
    }

    fn setup_queue(&self, index: QueueIndex, layout: &QueueLayout) -> Result<(), TransportError> {
        self.check_queue(index)?;
        if self.iotlb_enabled() {
            self.iotlb_map(
                layout.ring_start,
                layout.ring_len,
                layout.ring_start,
                IotlbAccess::ReadWrite,
            )?;
        }
        let eventfd = |operation| {
            EventFd::new(EFD_NONBLOCK).map_err(|source| TransportError::Io { operation, source })
        };
        let kick = eventfd("eventfd for a doorbell")?;
        let call = Arc::new(eventfd("eventfd for completions")?);
        let ring = index as usize;
        let config = VringConfigData {
            queue_max_size: layout.size,
            queue_size: layout.size,
            flags: 0,
            desc_table_addr: layout.desc_addr,
            used_ring_addr: layout.used_addr,
            avail_ring_addr: layout.avail_addr,
            log_addr: None,
        };
        {
            let mut control = self.control.lock();
            control.run(FrontendReq::SET_VRING_NUM, |f| {
                f.set_vring_num(ring, layout.size)
            })?;
            control.run(FrontendReq::SET_VRING_BASE, |f| f.set_vring_base(ring, 0))?;
            control.run(FrontendReq::SET_VRING_ADDR, |f| {
                f.set_vring_addr(ring, &config)
            })?;
            control.run(FrontendReq::SET_VRING_KICK, |f| {
                f.set_vring_kick(ring, &kick)
            })?;
            control.run(FrontendReq::SET_VRING_CALL, |f| {
                f.set_vring_call(ring, &call)
            })?;
        }
        self.queues.write()[ring] = Some(QueueFds { kick, call });
        Ok(())
    }

    fn enable_queue(&self, index: QueueIndex, enabled: bool) -> Result<(), TransportError> {
        self.check_queue(index)?;
        if self.queues.read()[index as usize].is_none() {
            return Err(TransportError::QueueNotSetUp(index));
        }
        self.control.lock().run(FrontendReq::SET_VRING_ENABLE, |f| {
            f.set_vring_enable(index as usize, enabled)
        })
    }

    fn notify(&self, index: QueueIndex) -> Result<(), TransportError> {
        self.check_queue(index)?;
        let queues = self.queues.read();
        let fds = queues[index as usize]
            .as_ref()
            .ok_or(TransportError::QueueNotSetUp(index))?;
        fds.kick.write(1).map_err(|source| TransportError::Io {
            operation: "doorbell eventfd write",
            source,
        })
    }

    fn completion_event(&self, index: QueueIndex) -> Result<CompletionEvent, TransportError> {
        self.check_queue(index)?;
        let queues = self.queues.read();
        let fds = queues[index as usize]
            .as_ref()
            .ok_or(TransportError::QueueNotSetUp(index))?;
        Ok(CompletionEvent::new(Arc::clone(&fds.call)))
    }

    fn iotlb_enabled(&self) -> bool {
        self.features() & F_ACCESS_PLATFORM != 0
    }

    fn iotlb_map(
        &self,
        iova: u64,
        len: u64,
        uaddr: u64,
        access: IotlbAccess,
    ) -> Result<(), TransportError> {
        check_iotlb_range(iova, len)?;
        if !self.iotlb_enabled() {
            return Ok(());
        }
        self.iotlb_msg(IotlbMessage::update(iova, len, uaddr, access.into()))
    }

    fn iotlb_unmap(&self, iova: u64, len: u64) -> Result<(), TransportError> {
        check_iotlb_range(iova, len)?;
        if !self.iotlb_enabled() || self.let_go.load(Ordering::Acquire) {
            return Ok(());
        }
        self.iotlb_msg(IotlbMessage::invalidate(iova, len))
    }

    fn disconnect(&self, timeout: Duration) -> bool {
        let mut control = self.control.lock();
        control
            .broken
            .get_or_insert_with(|| "the driver ended the connection".into());
        // The writing half only: the device reads the end of the stream,
        // resets the port and then closes its end, which this end polls as
        // hung up. Shutting the reading half too would make this end poll
        // as hung up at once. (A device gone already fails the shutdown
        // and polls as hung up.)
        let _ = self.hangup.shutdown(std::net::Shutdown::Write);
        drop(control);
        let confirmed = poll_hangup(self.hangup.as_raw_fd(), Some(timeout)).unwrap_or(false);
        if confirmed {
            // The device reset the port: its IOTLB is gone.
            self.let_go.store(true, Ordering::Release);
        }
        confirmed
    }

    fn abandon(&self) {
        self.let_go.store(true, Ordering::Release);
        // A lock the parent held at the fork stays held here: then the
        // flag alone keeps the removals off the socket.
        if let Some(mut control) = self.control.try_lock() {
            control.broken.get_or_insert_with(|| {
                "inherited across fork(): the connection is the parent's".into()
            });
        }
    }
}

/// Refuses an empty or overflowing IOTLB range.
fn check_iotlb_range(iova: u64, len: u64) -> Result<(), TransportError> {
    if len == 0 || iova.checked_add(len).is_none() {
        return Err(TransportError::InvalidArgument(format!(
            "IOTLB range of {len} bytes at {iova:#x}"
        )));
    }
    Ok(())
}

impl<T: Transport + ?Sized> Transport for Arc<T> {
    fn device_features(&self) -> u64 {
        (**self).device_features()
    }
    fn negotiate_features(&self, wanted: u64) -> Result<u64, TransportError> {
        (**self).negotiate_features(wanted)
    }
    fn features(&self) -> u64 {
        (**self).features()
    }
    fn ring_layout(&self) -> RingLayout {
        (**self).ring_layout()
    }
    fn rings_fixed_at_start(&self) -> bool {
        (**self).rings_fixed_at_start()
    }
    fn register_memory(&self, regions: &[MemoryTableRegion<'_>]) -> Result<(), TransportError> {
        (**self).register_memory(regions)
    }
    fn setup_queue(&self, index: QueueIndex, layout: &QueueLayout) -> Result<(), TransportError> {
        (**self).setup_queue(index, layout)
    }
    fn enable_queue(&self, index: QueueIndex, enabled: bool) -> Result<(), TransportError> {
        (**self).enable_queue(index, enabled)
    }
    fn notify(&self, index: QueueIndex) -> Result<(), TransportError> {
        (**self).notify(index)
    }
    fn completion_event(&self, index: QueueIndex) -> Result<CompletionEvent, TransportError> {
        (**self).completion_event(index)
    }
    fn mapping_budget(&self) -> Option<usize> {
        (**self).mapping_budget()
    }
    fn hangup_fd(&self) -> Option<BorrowedFd<'_>> {
        (**self).hangup_fd()
    }
    fn maps_process_memory(&self) -> bool {
        (**self).maps_process_memory()
    }
    fn iotlb_enabled(&self) -> bool {
        (**self).iotlb_enabled()
    }
    fn iotlb_map(
        &self,
        iova: u64,
        len: u64,
        uaddr: u64,
        access: IotlbAccess,
    ) -> Result<(), TransportError> {
        (**self).iotlb_map(iova, len, uaddr, access)
    }
    fn iotlb_unmap(&self, iova: u64, len: u64) -> Result<(), TransportError> {
        (**self).iotlb_unmap(iova, len)
    }
    fn disconnect(&self, timeout: Duration) -> bool {
        (**self).disconnect(timeout)
    }
    fn abandon(&self) {
        (**self).abandon()
    }
}
