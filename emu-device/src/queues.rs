//! The device side of one split virtqueue (vring) of a port: its
//! configuration as received over vhost-user, its eventfds, and helpers to
//! take descriptor chains and return them used.

use std::fs::File;
use std::io::{self, Write};
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
    pub kick: Option<File>,
    /// Call eventfd (device to driver).
    pub call: Option<File>,
    /// Error eventfd.
    pub err: Option<File>,
    /// SET_VRING_ENABLE state.
    pub enabled: bool,
    /// Started: a kick was set and GET_VRING_BASE has not stopped it.
    pub started: bool,
    /// Set when processing stopped on an IOTLB miss; retried after UPDATE.
    pub waiting_iotlb: bool,
}

/// Why a ring could not be (re)configured or used.
#[derive(Debug, thiserror::Error)]
pub enum RingError {
    /// The size is zero, not a power of two, or above the maximum.
    #[error("invalid ring size {0}")]
    BadSize(u32),
    /// Ring addresses do not resolve through the memory table.
    #[error("ring address {0:#x} is not in the memory table")]
    BadAddress(u64),
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

    /// Stops using a ring whose contents make no sense (a bad index, memory
    /// that cannot be read): logged once, and the ring stays inactive until
    /// the frontend configures it again, instead of failing on every pass.
    pub fn break_off(&mut self, port: usize, reason: &str) {
        tracing::warn!(
            port,
            ring = self.index,
            "ring broken, stopped until reconfigured: {reason}"
        );
        self.queue.set_ready(false);
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
        let size = self.size as u64;
        let (desc, avail, used) = if iommu {
            (a.desc, a.avail, a.used)
        } else {
            let tr = |addr: u64, len: u64| {
                table
                    .uaddr_to_gpa(addr, len)
                    .ok_or(RingError::BadAddress(addr))
            };
            (
                tr(a.desc, 16 * size)?,
                tr(a.avail, 6 + 2 * size)?,
                tr(a.used, 6 + 8 * size)?,
            )
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
        base
    }

    /// Drains the kick eventfd (non-blocking).
    pub fn drain_kick(&self) {
        if let Some(k) = &self.kick {
            let mut buf = [0u8; 8];
            // SAFETY: reads at most 8 bytes into `buf`; the fd is a
            // non-blocking eventfd owned by this ring.
            let _ = unsafe { libc::read(k.as_raw_fd(), buf.as_mut_ptr().cast(), 8) };
        }
    }

    /// Signals the driver if the ring asks for it (respecting EVENT_IDX
    /// and NO_INTERRUPT).
    pub fn notify(&mut self, mem: &PortMemory) {
        let needed = self.queue.needs_notification(mem).unwrap_or(true);
        if needed {
            if let Some(c) = &mut self.call {
                let _ = c.write(&1u64.to_ne_bytes());
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
    for d in chain {
        if bufs.len() >= 1024 {
            break;
        }
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
    Pop::Chain(Chain { head, bufs })
}

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
