//! The device side of one split virtqueue (vring) of a port: its
//! configuration as received over vhost-user, its eventfds, and helpers to
//! take descriptor chains and return them used.

use std::cell::Cell;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};

use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{GuestAddress, Permissions};

use crate::memory::{MemoryTable, Miss, PortMemory, TranslateError, Watched};

/// Ring addresses as the frontend sent them (SET_VRING_ADDR).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RingAddrs {
    /// Descriptor table.
    pub desc: u64,
    /// Available (driver) ring.
    pub avail: u64,
    /// Used (device) ring.
    pub used: u64,
}

impl RingAddrs {
    /// Translates frontend virtual ring addresses to guest physical ones
    /// through `table`, for a ring of `size` entries: the descriptor table,
    /// the available ring and the used ring must each lie inside one region.
    pub fn to_gpa(&self, table: &MemoryTable, size: u16) -> Result<RingAddrs, RingError> {
        let size = u64::from(size.max(1));
        let tr = |addr: u64, len: u64, part: &'static str| {
            table
                .uaddr_to_gpa(addr, len)
                .ok_or(RingError::BadAddress { part, addr, len })
        };
        Ok(RingAddrs {
            desc: tr(self.desc, 16 * size, "descriptor table")?,
            avail: tr(self.avail, 6 + 2 * size, "available ring")?,
            used: tr(self.used, 6 + 8 * size, "used ring")?,
        })
    }
}

/// A file descriptor a frontend gave for the notifications of one ring
/// (kick, call or error fd).
///
/// It is the frontend's file: usually an eventfd, but it may be a pipe, a
/// socket or anything else, with its other end closed or never read, and
/// the frontend can change its flags at any time. The device sets
/// `O_NONBLOCK` on it when it is received, and reads and writes it with
/// `RWF_NOWAIT` where the kernel supports that for the file (pipes,
/// sockets, eventfd reads), so that no read or write ever waits for the
/// frontend, whatever it does to the flags later. Where `RWF_NOWAIT` is not
/// supported (eventfd writes), the device first asks `poll` whether the
/// file is ready and relies on `O_NONBLOCK`: an eventfd write only blocks
/// when its counter is about to overflow, which `poll` reports. (A
/// frontend that clears `O_NONBLOCK` and fills its counter between the two
/// calls could still hold its own port's thread; no other port waits for
/// that thread.)
#[derive(Debug)]
pub struct RingFd {
    file: File,
    /// Whether `RWF_NOWAIT` works for writes (cleared on EOPNOTSUPP).
    write_nowait: Cell<bool>,
    /// Whether `RWF_NOWAIT` works for reads (cleared on EOPNOTSUPP).
    read_nowait: Cell<bool>,
}

/// What reading a kick fd found.
#[derive(Debug, PartialEq, Eq)]
pub enum KickRead {
    /// The frontend kicked (bytes were read).
    Kicked,
    /// Nothing to read (a spurious wake-up, or the frontend read it first).
    Nothing,
    /// The fd will never kick again (end of file, or a read error): the
    /// ring must stop listening to it.
    HungUp(String),
}

/// What writing a call fd did.
#[derive(Debug, PartialEq, Eq)]
pub enum Signal {
    /// The frontend was signalled.
    Sent,
    /// The fd is full: a signal is already pending, this one is merged
    /// into it (as eventfd counts merge).
    AlreadyPending,
    /// The fd refused the write for good (its reader is gone, or it is
    /// not writable).
    Failed(String),
}

impl RingFd {
    /// Takes over a frontend's fd and makes it non-blocking.
    pub fn new(file: File) -> RingFd {
        let fd = file.as_raw_fd();
        // SAFETY: fcntl on a descriptor owned by `file`, with no pointers
        // involved; a failure leaves the flags as they were.
        unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFL);
            if flags >= 0 && flags & libc::O_NONBLOCK == 0 {
                libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK);
            }
        }
        RingFd {
            file,
            write_nowait: Cell::new(true),
            read_nowait: Cell::new(true),
        }
    }

    /// The raw fd (for epoll).
    pub fn as_raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    /// A second descriptor of the same file (for an epoll registration
    /// that must outlive a replaced fd).
    pub fn try_clone(&self) -> io::Result<File> {
        self.file.try_clone()
    }

    /// Reads what the frontend wrote (an eventfd's counter, or up to 512
    /// bytes of a pipe or socket) without waiting.
    pub fn read_kick(&self) -> KickRead {
        let mut buf = [0u8; 512];
        let n = io_nowait(&self.file, &self.read_nowait, &mut buf, false);
        match n {
            Ok(0) => KickRead::HungUp("end of file".into()),
            Ok(_) => KickRead::Kicked,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) =>
            {
                KickRead::Nothing
            }
            Err(e) => KickRead::HungUp(e.to_string()),
        }
    }

    /// Adds one to the frontend's eventfd (or writes 8 bytes to whatever
    /// file it is) without waiting.
    pub fn signal(&self) -> Signal {
        let mut one = 1u64.to_ne_bytes();
        match io_nowait(&self.file, &self.write_nowait, &mut one, true) {
            Ok(_) => Signal::Sent,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) =>
            {
                Signal::AlreadyPending
            }
            Err(e) => Signal::Failed(e.to_string()),
        }
    }
}

/// One read or write of `buf` on `file` that never waits: `RWF_NOWAIT`
/// while `nowait` says the file supports it, else a plain call on the
/// (non-blocking) fd.
fn io_nowait(file: &File, nowait: &Cell<bool>, buf: &mut [u8], write: bool) -> io::Result<usize> {
    let fd = file.as_raw_fd();
    let iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    if nowait.get() {
        // SAFETY: `iov` describes the live `buf` (written only when
        // reading, which `buf: &mut` allows); offset -1 means the file
        // position, as read(2)/write(2) use.
        let r = unsafe {
            if write {
                libc::pwritev2(fd, &iov, 1, -1, libc::RWF_NOWAIT)
            } else {
                libc::preadv2(fd, &iov, 1, -1, libc::RWF_NOWAIT)
            }
        };
        if r >= 0 {
            return Ok(r as usize);
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EOPNOTSUPP) {
            return Err(e);
        }
        nowait.set(false);
    }
    let mut pfd = libc::pollfd {
        fd,
        events: if write { libc::POLLOUT } else { libc::POLLIN },
        revents: 0,
    };
    // SAFETY: polls one live `pollfd`, without waiting.
    let ready = unsafe { libc::poll(&mut pfd, 1, 0) };
    if ready < 0 {
        return Err(io::Error::last_os_error());
    }
    if ready == 0 {
        return Err(io::ErrorKind::WouldBlock.into());
    }
    // SAFETY: as above, `buf` is live and at least `buf.len()` bytes.
    let r = unsafe {
        if write {
            libc::write(fd, buf.as_ptr().cast(), buf.len())
        } else {
            libc::read(fd, buf.as_mut_ptr().cast(), buf.len())
        }
    };
    if r >= 0 {
        Ok(r as usize)
    } else {
        Err(io::Error::last_os_error())
    }
}

/// One vring.
#[derive(Debug)]
pub struct Vring {
    /// Ring index within the port.
    pub index: usize,
    /// The virtio-queue state (size, addresses, indices).
    pub queue: Queue,
    /// Addresses as received; resolved into `queue` when the ring starts.
    pub addrs: Option<RingAddrs>,
    /// Ring size from SET_VRING_NUM.
    pub size: u16,
    /// Next available index from SET_VRING_BASE.
    pub base: u16,
    /// Kick eventfd (driver to device); `None` when the driver polls.
    pub kick: Option<RingFd>,
    /// Call eventfd (device to driver).
    pub call: Option<RingFd>,
    /// Error eventfd.
    pub err: Option<RingFd>,
    /// SET_VRING_ENABLE state.
    pub enabled: bool,
    /// Started: a kick was set and GET_VRING_BASE has not stopped it.
    pub started: bool,
    /// Set when processing stopped on an IOTLB miss; retried after UPDATE.
    pub waiting_iotlb: bool,
    /// The frontend broke the ring ([`Vring::break_off`]); cleared when the
    /// ring is configured again.
    pub broken: bool,
    /// How many times the ring stopped ([`stop`](Self::stop),
    /// [`break_off`](Self::break_off), [`set_enabled`](Self::set_enabled)): whoever
    /// serves the ring tells a restart by it, even when the ring runs
    /// again by the time it looks.
    pub stops: u32,
}

/// Why a ring could not be (re)configured or used.
#[derive(Debug, thiserror::Error)]
pub enum RingError {
    /// The size is zero, not a power of two, or above the maximum.
    #[error("invalid ring size {0}")]
    BadSize(u32),
    /// Ring addresses do not resolve through the memory table.
    #[error("{part} at {addr:#x}+{len:#x} is not inside one region of the memory table")]
    BadAddress {
        /// Which part of the ring.
        part: &'static str,
        /// Its frontend virtual address.
        addr: u64,
        /// Its length for the ring's size.
        len: u64,
    },
    /// virtio-queue refused the configuration.
    #[error("queue: {0}")]
    Queue(String),
}

impl Vring {
    /// A fresh, stopped ring of at most `max_size` entries.
    pub fn new(index: usize, max_size: u16) -> Vring {
        let queue = Queue::new(max_size).unwrap_or_else(|_| {
            // max_size is validated by the configuration; 256 always works.
            Queue::new(256).expect("256 is a valid queue size")
        });
        Vring {
            index,
            queue,
            addrs: None,
            size: 0,
            base: 0,
            kick: None,
            call: None,
            err: None,
            enabled: false,
            started: false,
            waiting_iotlb: false,
            broken: false,
            stops: 0,
        }
    }

    /// Sets the ring size.
    pub fn set_num(&mut self, num: u32) -> Result<(), RingError> {
        let max = self.queue.max_size() as u32;
        if num == 0 || num > max || !num.is_power_of_two() {
            return Err(RingError::BadSize(num));
        }
        self.size = num as u16;
        Ok(())
    }

    /// The largest size the ring accepts.
    pub fn queue_max_size(&self) -> u16 {
        self.queue.max_size()
    }

    /// Whether the queue is configured (addresses resolved).
    pub fn queue_ready(&self) -> bool {
        self.queue.ready()
    }

    /// Moves a configured queue to `base` (SET_VRING_BASE).
    pub fn reset_position(&mut self, base: u16) {
        self.queue.set_next_avail(base);
        self.queue.set_next_used(base);
    }

    /// The ring's next position: the next available index of a split
    /// virtqueue, the next request or completion of an RDMA queue (what
    /// GET_VRING_BASE reports and SET_VRING_BASE sets).
    pub fn position(&self) -> u16 {
        self.queue.next_avail()
    }

    /// The next used index the device writes (an Ethernet ring's; an
    /// RDMA ring keeps its position in [`position`](Self::position)).
    pub fn next_used(&self) -> u16 {
        self.queue.next_used()
    }

    /// Moves the ring's next position (an RDMA queue that took a request
    /// or wrote a completion).
    pub fn set_position(&mut self, position: u16) {
        self.queue.set_next_avail(position);
    }

    /// Steps back one chain (it will be taken again).
    pub fn rewind(&mut self) {
        self.queue.go_to_previous_position();
    }

    /// Asks the driver not to kick (or, with EVENT_IDX, to kick later).
    pub fn queue_disable_notification(&mut self, mem: &PortMemory) -> Result<(), String> {
        self.queue
            .disable_notification(mem)
            .map_err(|e| e.to_string())
    }

    /// Asks the driver to kick again; `Ok(true)` if new chains are already
    /// available.
    pub fn queue_enable_notification(&mut self, mem: &PortMemory) -> Result<bool, String> {
        self.queue
            .enable_notification(mem)
            .map_err(|e| e.to_string())
    }

    /// Whether the used ring is writable, so that the caller can stop
    /// before taking chains it could not return (a miss: ask the frontend
    /// and wait for the UPDATE).
    pub fn used_ring_writable(&self, mem: &PortMemory) -> Result<(), TranslateError> {
        let len = 6 + 8 * u64::from(self.queue.size());
        mem.check(self.queue.used_ring(), len, Permissions::Write)
    }

    /// Whether the ring is ready for processing.
    pub fn active(&self) -> bool {
        self.started && self.enabled && self.queue.ready()
    }

    /// Stops using a ring whose contents make no sense (an available
    /// index that jumps by more than the ring size, a descriptor loop, a
    /// chain longer than the ring, memory that cannot be read): logged
    /// once, and the ring stays inactive instead of failing on every pass.
    ///
    /// The position is kept at the offending chain: GET_VRING_BASE reports
    /// it, and the frontend restarts the ring with SET_VRING_BASE and
    /// SET_VRING_KICK, or with any new SET_VRING_NUM / SET_VRING_ADDR or a
    /// SET_VRING_ENABLE. A ring restarted unrepaired breaks again.
    pub fn break_off(&mut self, port: usize, reason: &str) {
        tracing::warn!(
            port,
            ring = self.index,
            "ring broken by the frontend, stopped until it is reset: {reason}"
        );
        if self.queue.ready() {
            self.base = self.queue.next_avail();
        }
        self.queue.set_ready(false);
        self.waiting_iotlb = false;
        self.broken = true;
        self.stops = self.stops.wrapping_add(1);
    }

    /// SET_VRING_ENABLE: a ring that was enabled and is disabled stops.
    pub fn set_enabled(&mut self, enable: bool) {
        if self.enabled && !enable {
            self.stops = self.stops.wrapping_add(1);
        }
        self.enabled = enable;
    }

    /// Raw fd of the kick eventfd, if any.
    pub fn kick_fd(&self) -> Option<RawFd> {
        self.kick.as_ref().map(|f| f.as_raw_fd())
    }

    /// Configures `queue` from the received state. Ring addresses are IOVAs
    /// when `iommu` is set, frontend virtual addresses otherwise (then they
    /// are translated to guest physical addresses through `table`).
    pub fn activate(
        &mut self,
        table: Option<&MemoryTable>,
        iommu: bool,
        event_idx: bool,
    ) -> Result<(), RingError> {
        // A running ring keeps its position; a stopped one starts at `base`.
        let (next_avail, next_used) = if self.queue.ready() {
            (self.queue.next_avail(), self.queue.next_used())
        } else {
            (self.base, self.base)
        };
        self.queue.set_ready(false);
        self.base = next_avail;
        self.broken = false;
        let Some(a) = self.addrs else {
            return Ok(());
        };
        let Some(table) = table else {
            return Ok(());
        };
        if self.size == 0 {
            return Ok(());
        }
        let q = &mut self.queue;
        q.try_set_size(self.size)
            .map_err(|e| RingError::Queue(e.to_string()))?;
        let RingAddrs { desc, avail, used } = if iommu {
            a
        } else {
            a.to_gpa(table, self.size)?
        };
        q.try_set_desc_table_address(GuestAddress(desc))
            .map_err(|e| RingError::Queue(e.to_string()))?;
        q.try_set_avail_ring_address(GuestAddress(avail))
            .map_err(|e| RingError::Queue(e.to_string()))?;
        q.try_set_used_ring_address(GuestAddress(used))
            .map_err(|e| RingError::Queue(e.to_string()))?;
        q.set_next_avail(next_avail);
        q.set_next_used(next_used);
        q.set_event_idx(event_idx);
        q.set_ready(true);
        Ok(())
    }

    /// Stops the ring and returns the next available index.
    pub fn stop(&mut self) -> u16 {
        let base = if self.queue.ready() {
            self.queue.next_avail()
        } else {
            self.base
        };
        self.started = false;
        self.queue.set_ready(false);
        self.base = base;
        self.waiting_iotlb = false;
        self.stops = self.stops.wrapping_add(1);
        base
    }

    /// Reads the kick fd (never waits). Without a kick fd, `Nothing`.
    pub fn drain_kick(&self) -> KickRead {
        match &self.kick {
            Some(k) => k.read_kick(),
            None => KickRead::Nothing,
        }
    }

    /// Sets (or, with `None`, removes) the kick fd.
    pub fn set_kick(&mut self, fd: Option<File>) {
        self.kick = fd.map(RingFd::new);
    }

    /// Sets (or removes) the call fd.
    pub fn set_call(&mut self, fd: Option<File>) {
        self.call = fd.map(RingFd::new);
    }

    /// Sets (or removes) the error fd.
    pub fn set_err(&mut self, fd: Option<File>) {
        self.err = fd.map(RingFd::new);
    }

    /// Stops a ring whose kick fd hung up (its writer closed, an error, an
    /// end of file): the fd is dropped and the ring stays stopped, with
    /// its position kept, until the frontend sets a new kick fd.
    pub fn kick_hung_up(&mut self, port: usize, reason: &str) {
        tracing::warn!(
            port,
            ring = self.index,
            "kick fd hung up ({reason}): ring stopped until a new kick fd is set"
        );
        self.kick = None;
        self.stop();
    }

    /// Signals the driver if the ring asks for it (respecting EVENT_IDX
    /// and NO_INTERRUPT). Never waits: a full call fd already holds a
    /// signal; a call fd that fails for good is dropped (logged).
    pub fn notify(&mut self, mem: &PortMemory) {
        let needed = self.queue.needs_notification(mem).unwrap_or(true);
        if !needed {
            return;
        }
        if let Some(c) = &self.call {
            if let Signal::Failed(e) = c.signal() {
                tracing::warn!(
                    ring = self.index,
                    "call fd fails ({e}): no more interrupts on this ring until a new call fd is set"
                );
                self.call = None;
            }
        }
    }

    /// Gives a chain back to the driver as used, with `len` bytes written.
    pub fn add_used(&mut self, mem: &PortMemory, head: u16, len: u32) -> io::Result<()> {
        self.queue
            .add_used(mem, head, len)
            .map_err(|e| io::Error::other(e.to_string()))
    }
}

/// One buffer of a descriptor chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Buf {
    /// Device address (IOVA or guest physical).
    pub addr: u64,
    /// Length.
    pub len: u32,
    /// Device-writable.
    pub write: bool,
}

/// A descriptor chain taken from a ring.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chain {
    /// Head index (to return it used).
    pub head: u16,
    /// Its buffers in order.
    pub bufs: Vec<Buf>,
}

/// Outcome of taking a chain.
#[derive(Debug, PartialEq, Eq)]
pub enum Pop {
    /// A chain.
    Chain(Chain),
    /// The ring is empty.
    Empty,
    /// The ring or a descriptor did not translate (an IOTLB miss, or an
    /// entry without the access needed): ask the frontend, retry after the
    /// UPDATE.
    Miss(Miss),
    /// The ring is broken (bad index or memory error): stop using it.
    Broken(String),
}

/// Why the buffers of a chain could not be read or written (nothing was
/// written).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChainError {
    /// A buffer has no IOTLB entry yet: ask the frontend, retry after the
    /// UPDATE.
    #[error("{}", TranslateError::Miss(*.0))]
    Miss(Miss),
    /// A buffer is mapped without the permission needed (no UPDATE will
    /// come for it soon).
    #[error("{0}")]
    Denied(TranslateError),
    /// The chain cannot hold or give what is asked, or names memory the
    /// frontend never gave.
    #[error("{0}")]
    Bad(String),
}

impl From<TranslateError> for ChainError {
    fn from(error: TranslateError) -> Self {
        match error {
            TranslateError::Miss(miss) => ChainError::Miss(miss),
            denied @ TranslateError::Denied { .. } => ChainError::Denied(denied),
            other => ChainError::Bad(other.to_string()),
        }
    }
}

/// Takes the next available chain. On an IOTLB miss while reading the
/// ring or descriptors, the ring position is restored so the same chain is
/// taken again later.
///
/// A ring the frontend broke is reported as [`Pop::Broken`], with the
/// position left at the offending chain: an available index that jumps by
/// more than the ring size, a chain whose descriptors cannot be read, a
/// chain that loops or is longer than the ring (more descriptors than the
/// ring or its indirect table has, or more than 2^32 bytes in total).
/// Descriptors of length 0 or 2^32-1 are not a broken ring: the caller
/// refuses such chains one by one.
pub fn pop_chain(ring: &mut Vring, mem: &PortMemory) -> Pop {
    // virtio-queue ends a chain early, silently, on a descriptor it cannot
    // read: watch its translations to tell a miss from the end.
    let watched = Watched::new(mem);
    let failed = |watched: &Watched<'_>, error: String| match watched.failure() {
        Some(failure) => match failure.ask() {
            Some(miss) => Pop::Miss(miss),
            None => Pop::Broken(failure.to_string()),
        },
        None => Pop::Broken(error),
    };
    let ring_size = ring.queue.size();
    let mut iter = match ring.queue.iter(&watched) {
        Ok(it) => it,
        Err(e) => return failed(&watched, e.to_string()),
    };
    let Some(chain) = iter.next() else {
        return match watched.failure() {
            None => Pop::Empty,
            Some(_) => failed(&watched, String::new()),
        };
    };
    let head = chain.head_index();
    let mut bufs = Vec::new();
    // Whether the last descriptor still pointed to a next one: the chain
    // was cut (a loop, too long, a next index outside the table, an
    // unreadable descriptor).
    let mut cut = false;
    let mut too_long = false;
    for d in chain {
        if bufs.len() >= usize::from(ring_size).max(MAX_INDIRECT_CHAIN) {
            too_long = true;
            break;
        }
        cut = d.has_next();
        bufs.push(Buf {
            addr: d.addr().0,
            len: d.len(),
            write: d.is_write_only(),
        });
    }
    if watched.failure().is_some() {
        ring.queue.go_to_previous_position();
        return failed(&watched, String::new());
    }
    let broken = if bufs.is_empty() {
        Some(format!("chain {head} has no readable descriptor"))
    } else if cut || too_long {
        Some(format!(
            "chain {head} loops, is longer than the ring or its indirect table, \
             or points outside the descriptor table"
        ))
    } else {
        None
    };
    if let Some(reason) = broken {
        ring.queue.go_to_previous_position();
        return Pop::Broken(reason);
    }
    Pop::Chain(Chain { head, bufs })
}

/// Most descriptors a chain through an indirect table may have (a direct
/// chain has at most the ring size).
pub const MAX_INDIRECT_CHAIN: usize = 1024;

/// Reads the device-readable buffers of `chain` into a vector (at most
/// `limit` bytes).
pub fn read_chain(mem: &PortMemory, chain: &Chain, limit: usize) -> Result<Vec<u8>, ChainError> {
    let total: u64 = chain
        .bufs
        .iter()
        .filter(|b| !b.write)
        .map(|b| u64::from(b.len))
        .sum();
    if total > limit as u64 {
        return Err(ChainError::Bad(format!("chain longer than {limit} bytes")));
    }
    let mut out = vec![0u8; total as usize];
    let mut at = 0;
    for b in chain.bufs.iter().filter(|b| !b.write) {
        for slice in mem.translate(b.addr, u64::from(b.len), Permissions::Read) {
            let slice = slice?;
            at += slice.copy_to(&mut out[at..at + slice.len()]);
        }
    }
    Ok(out)
}

/// Writes `data` into the device-writable buffers of `chain`. Returns the
/// bytes written. Fails with nothing written if the buffers are too small
/// or do not all translate for writing.
pub fn write_chain(mem: &PortMemory, chain: &Chain, data: &[u8]) -> Result<usize, ChainError> {
    // Check everything first so a failure leaves memory untouched.
    let mut room = 0usize;
    let mut plan: smallvec::SmallVec<[(u64, usize, usize); 4]> = smallvec::SmallVec::new();
    for b in chain.bufs.iter().filter(|b| b.write) {
        if room >= data.len() {
            break;
        }
        let take = (b.len as usize).min(data.len() - room);
        if take == 0 {
            continue;
        }
        mem.check(b.addr, take as u64, Permissions::Write)?;
        plan.push((b.addr, room, take));
        room += take;
    }
    if room < data.len() {
        return Err(ChainError::Bad(format!(
            "receive buffers hold {room} bytes, frame needs {}",
            data.len()
        )));
    }
    for (addr, off, take) in plan {
        let mut at = off;
        for slice in mem.translate(addr, take as u64, Permissions::Write) {
            let slice = slice?;
            slice.copy_from(&data[at..at + slice.len()]);
            at += slice.len();
        }
    }
    Ok(data.len())
}
