//! The driver side of a split virtqueue (virtio 1.x, section 2.7), with
//! `VIRTIO_F_EVENT_IDX`.
//!
//! The three parts of the ring live in one page-aligned chunk of the
//! [`DmaArena`]:
//!
//! ```text
//! desc  : size x { addr: le64, len: le32, flags: le16, next: le16 }   (16-aligned)
//! avail : flags: le16, idx: le16, ring[size]: le16, used_event: le16  (2-aligned)
//! used  : flags: le16, idx: le16, ring[size]: { id: le32, len: le32 },
//!         avail_event: le16                                           (64-aligned here)
//! ```
//!
//! The device is another process reading and writing the same memory, so
//! every access to the rings is a volatile or atomic access through raw
//! pointers; nothing here ever forms a `&mut` to shared memory. The driver
//! keeps its own shadow of everything it needs to trust (free list, chain
//! lengths, tokens), so a buggy or hostile device can at worst make
//! [`SplitQueue::pop_used`] report the queue broken; it cannot corrupt the
//! driver's state or make it panic.
//!
//! Ordering, in the words of the spec:
//!
//! * [`SplitQueue::add`] writes descriptors and the avail ring entry, then
//!   publishes `avail.idx` with a release store.
//! * [`SplitQueue::kick_needed`] issues a full fence between that store and
//!   its read of `avail_event`, so either the device sees the new index or
//!   the driver sees the device's request to be kicked.
//! * [`SplitQueue::pop_used`] reads `used.idx` with acquire before reading
//!   the used entry.
//! * [`SplitQueue::enable_interrupts`] writes `used_event`, issues a full
//!   fence, and re-reads `used.idx`: if completions slipped in meanwhile it
//!   says so, and the caller polls again instead of sleeping on a
//!   notification that will never come.

use std::num::Wrapping;
use std::ptr;
use std::sync::atomic::{fence, AtomicU16, Ordering};
use std::sync::Arc;

use virtio_bindings::virtio_ring::{
    VRING_AVAIL_F_NO_INTERRUPT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE, VRING_USED_F_NO_NOTIFY,
};

use crate::arena::{ArenaError, DmaArena, DmaBuffer};

/// Largest queue size of a split virtqueue.
pub const MAX_QUEUE_SIZE: u16 = 32768;

const DESC_SIZE: usize = 16;
const USED_ELEM_SIZE: usize = 8;
const RING_HEADER: usize = 4;

/// One buffer of a descriptor chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChainElement {
    /// IOVA of the buffer (its virtual address under identity IOVAs).
    pub addr: u64,
    /// Length in bytes.
    pub len: u32,
    /// Whether the device writes this buffer (else it reads it). In a chain,
    /// device-readable buffers come first.
    pub device_writable: bool,
}

impl ChainElement {
    /// A buffer the device reads.
    pub fn readable(addr: u64, len: u32) -> Self {
        Self {
            addr,
            len,
            device_writable: false,
        }
    }

    /// A buffer the device writes.
    pub fn writable(addr: u64, len: u32) -> Self {
        Self {
            addr,
            len,
            device_writable: true,
        }
    }
}

/// Where a queue's parts are, as the transport tells the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueLayout {
    /// Number of descriptors (a power of two).
    pub size: u16,
    /// IOVA of the descriptor table.
    pub desc_addr: u64,
    /// IOVA of the available ring.
    pub avail_addr: u64,
    /// IOVA of the used ring.
    pub used_addr: u64,
    /// IOVA of the page-aligned chunk holding all three parts.
    pub ring_start: u64,
    /// Length of that chunk in bytes (whole pages).
    pub ring_len: u64,
}

/// Why a queue operation failed.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum QueueError {
    /// The queue size is not a power of two in `1..=32768`.
    #[error("invalid queue size {0}: must be a power of two between 1 and 32768")]
    InvalidSize(u16),
    /// The arena could not hold the rings.
    #[error("cannot allocate the rings: {0}")]
    Arena(String),
    /// A chain must have at least one element.
    #[error("a descriptor chain needs at least one buffer")]
    EmptyChain,
    /// A device-readable buffer followed a device-writable one.
    #[error("device-readable buffers must precede device-writable ones in a chain (element {0})")]
    ReadableAfterWritable(usize),
    /// Not enough free descriptors.
    #[error("queue full: the chain needs {needed} descriptors and {free} are free")]
    Full {
        /// Descriptors the chain needs.
        needed: usize,
        /// Descriptors free.
        free: u16,
    },
    /// The device published an impossible used index.
    #[error("device bug: used index moved from {last_used} to {used_idx}, more than the queue size {size}")]
    UsedIndexOutOfRange {
        /// Last used index the driver consumed.
        last_used: u16,
        /// The device's used index.
        used_idx: u16,
        /// Queue size.
        size: u16,
    },
    /// The device completed a descriptor that is not the head of a chain in
    /// flight.
    #[error(
        "device bug: used entry names descriptor {0}, which is not the head of a chain in flight"
    )]
    BadUsedId(u32),
    /// The device claims to have written more than the chain's writable
    /// buffers hold.
    #[error("device bug: used entry for head {head} reports {len} bytes written but the chain has {writable} writable bytes")]
    BadUsedLength {
        /// Head of the chain.
        head: u16,
        /// Length the device reported.
        len: u32,
        /// Writable bytes in the chain.
        writable: u64,
    },
    /// The device published an RDMA send queue head that moved backwards
    /// or past the requests posted.
    #[error("device bug: send queue head moved to {head}, outside {last}..={tail}")]
    HeadOutOfRange {
        /// The head the device published.
        head: u16,
        /// The head it published before.
        last: u16,
        /// The next position the driver would write.
        tail: u16,
    },
    /// The device published a send queue retired position that moved
    /// backwards or past the requests posted.
    #[error("device bug: send queue retired position moved to {retired}, outside {last}..={tail}")]
    RetiredOutOfRange {
        /// The position the device published.
        retired: u16,
        /// The position it published before.
        last: u16,
        /// The next position the driver would write.
        tail: u16,
    },
    /// An earlier device bug broke the queue; it must be reset.
    #[error("the queue is broken by an earlier device error ({0}); reset it")]
    Broken(Box<QueueError>),
}

impl From<ArenaError> for QueueError {
    fn from(err: ArenaError) -> Self {
        QueueError::Arena(err.to_string())
    }
}

/// Bookkeeping of one chain the device holds.
#[derive(Debug)]
struct InFlight<T> {
    token: T,
    count: u16,
    tail: u16,
    writable: u64,
}

/// The driver side of one split virtqueue.
///
/// `T` is the token returned with each completion (an `io_uring`-style
/// `user_data`). Not internally synchronized: one owner posts and reaps
/// (wrap it in a lock to share it).
pub struct SplitQueue<T> {
    memory: DmaBuffer,
    size: u16,
    desc: *mut u8,
    avail: *mut u8,
    used: *mut u8,
    event_idx: bool,
    free_head: u16,
    num_free: u16,
    next: Box<[u16]>,
    in_flight: Box<[Option<InFlight<T>>]>,
    avail_idx: Wrapping<u16>,
    kicked_at: Wrapping<u16>,
    last_used: Wrapping<u16>,
    interrupts: bool,
    broken: Option<QueueError>,
}

// SAFETY: the raw pointers point into the arena chunk `memory` owns, which
// lives as long as the queue and is not tied to a thread; tokens move with
// the queue.
unsafe impl<T: Send> Send for SplitQueue<T> {}
// SAFETY: `&self` methods only read driver-private fields or perform atomic
// and volatile reads of the shared rings.
unsafe impl<T: Sync> Sync for SplitQueue<T> {}

impl<T> std::fmt::Debug for SplitQueue<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SplitQueue")
            .field("layout", &self.layout())
            .field("event_idx", &self.event_idx)
            .field("num_free", &self.num_free)
            .field("avail_idx", &self.avail_idx.0)
            .field("last_used", &self.last_used.0)
            .field("broken", &self.broken)
            .finish()
    }
}

/// `vring_need_event` of the spec: whether moving an index from `old` to
/// `new` crosses the other side's `event` index.
fn need_event(event: u16, new: u16, old: u16) -> bool {
    new.wrapping_sub(event).wrapping_sub(1) < new.wrapping_sub(old)
}

fn round_up(value: usize, to: usize) -> usize {
    value.div_ceil(to) * to
}

impl<T> SplitQueue<T> {
    /// Lays out a queue of `size` descriptors in a fresh page-aligned chunk of
    /// `arena`, zeroed, all descriptors free. `event_idx` says whether
    /// `VIRTIO_F_EVENT_IDX` was negotiated (it must match what the device
    /// was told).
    pub fn new(arena: &Arc<DmaArena>, size: u16, event_idx: bool) -> Result<Self, QueueError> {
        if size == 0 || !size.is_power_of_two() || size > MAX_QUEUE_SIZE {
            return Err(QueueError::InvalidSize(size));
        }
        let n = size as usize;
        let avail_off = DESC_SIZE * n;
        let avail_len = RING_HEADER + 2 * n + 2;
        let used_off = round_up(avail_off + avail_len, 64);
        let used_len = RING_HEADER + USED_ELEM_SIZE * n + 2;
        let memory = arena.alloc_pages(used_off + used_len)?;
        memory.fill(0);
        let base = memory.as_ptr();
        let mut next: Box<[u16]> = (1..=size).collect();
        next[n - 1] = 0;
        Ok(Self {
            size,
            desc: base,
            // SAFETY: both offsets are inside the chunk just allocated.
            avail: unsafe { base.add(avail_off) },
            // SAFETY: as above.
            used: unsafe { base.add(used_off) },
            memory,
            event_idx,
            free_head: 0,
            num_free: size,
            next,
            in_flight: (0..n).map(|_| None).collect(),
            avail_idx: Wrapping(0),
            kicked_at: Wrapping(0),
            last_used: Wrapping(0),
            interrupts: true,
            broken: None,
        })
    }

    /// Where the parts are, to hand to the transport.
    pub fn layout(&self) -> QueueLayout {
        QueueLayout {
            size: self.size,
            desc_addr: self.desc as u64,
            avail_addr: self.avail as u64,
            used_addr: self.used as u64,
            ring_start: self.memory.iova(),
            ring_len: round_up(self.memory.len(), crate::page_size()) as u64,
        }
    }

    /// Number of descriptors.
    pub fn size(&self) -> u16 {
        self.size
    }

    /// Descriptors currently free.
    pub fn num_free(&self) -> u16 {
        self.num_free
    }

    /// Chains the device holds (added, not yet popped).
    pub fn in_flight(&self) -> u16 {
        (self.avail_idx - self.last_used).0
    }

    /// Whether `VIRTIO_F_EVENT_IDX` is in use.
    pub fn event_idx(&self) -> bool {
        self.event_idx
    }

    /// The device error that broke the queue, if any.
    pub fn broken(&self) -> Option<&QueueError> {
        self.broken.as_ref()
    }

    // --- shared-memory accessors -------------------------------------------

    /// The 16-bit ring field at `base + offset` as an atomic.
    fn shared_u16(&self, base: *mut u8, offset: usize) -> &AtomicU16 {
        // SAFETY: every caller passes an even offset inside the ring chunk,
        // which is page aligned and lives as long as `self`; AtomicU16 has
        // the layout of u16, and the device accesses these fields only as
        // whole 16-bit values, so atomic access is sound across processes.
        unsafe { &*(base.add(offset) as *const AtomicU16) }
    }

    fn avail_flags(&self) -> &AtomicU16 {
        self.shared_u16(self.avail, 0)
    }

    fn avail_idx_field(&self) -> &AtomicU16 {
        self.shared_u16(self.avail, 2)
    }

    fn used_event(&self) -> &AtomicU16 {
        self.shared_u16(self.avail, RING_HEADER + 2 * self.size as usize)
    }

    fn used_flags(&self) -> &AtomicU16 {
        self.shared_u16(self.used, 0)
    }

    fn used_idx_field(&self) -> &AtomicU16 {
        self.shared_u16(self.used, 2)
    }

    fn avail_event(&self) -> &AtomicU16 {
        self.shared_u16(self.used, RING_HEADER + USED_ELEM_SIZE * self.size as usize)
    }

    fn write_desc(&self, index: u16, addr: u64, len: u32, flags: u16, next: u16) {
        // SAFETY: index < size, so the 16-byte entry is inside the descriptor
        // table, 16-byte aligned; volatile writes because the device reads it.
        unsafe {
            let entry = self.desc.add(DESC_SIZE * index as usize);
            ptr::write_volatile(entry as *mut u64, addr.to_le());
            ptr::write_volatile(entry.add(8) as *mut u32, len.to_le());
            ptr::write_volatile(entry.add(12) as *mut u16, flags.to_le());
            ptr::write_volatile(entry.add(14) as *mut u16, next.to_le());
        }
    }

    fn fail(&mut self, err: QueueError) -> QueueError {
        self.broken = Some(err.clone());
        err
    }

    // --- posting ------------------------------------------------------------

    /// Adds a chain of buffers and makes it available to the device; returns
    /// the head descriptor index. The device sees it at once if it polls;
    /// call [`kick_needed`](Self::kick_needed) after a burst to learn whether
    /// to ring the doorbell.
    pub fn add(&mut self, chain: &[ChainElement], token: T) -> Result<u16, QueueError> {
        if let Some(err) = &self.broken {
            return Err(QueueError::Broken(Box::new(err.clone())));
        }
        if chain.is_empty() {
            return Err(QueueError::EmptyChain);
        }
        if chain.len() > self.num_free as usize {
            return Err(QueueError::Full {
                needed: chain.len(),
                free: self.num_free,
            });
        }
        if let Some(bad) = chain
            .windows(2)
            .position(|pair| pair[0].device_writable && !pair[1].device_writable)
        {
            return Err(QueueError::ReadableAfterWritable(bad + 1));
        }
        let head = self.free_head;
        let mut index = head;
        let mut writable = 0u64;
        for (i, element) in chain.iter().enumerate() {
            let last = i + 1 == chain.len();
            let mut flags = 0u16;
            if element.device_writable {
                flags |= VRING_DESC_F_WRITE as u16;
                writable += u64::from(element.len);
            }
            let next = self.next[index as usize];
            if !last {
                flags |= VRING_DESC_F_NEXT as u16;
            }
            self.write_desc(
                index,
                element.addr,
                element.len,
                flags,
                if last { 0 } else { next },
            );
            if last {
                self.free_head = next;
                self.in_flight[head as usize] = Some(InFlight {
                    token,
                    count: chain.len() as u16,
                    tail: index,
                    writable,
                });
                break;
            }
            index = next;
        }
        self.num_free -= chain.len() as u16;
        let slot = (self.avail_idx.0 % self.size) as usize;
        // SAFETY: slot < size, so the 2-byte entry is inside the avail ring.
        unsafe {
            ptr::write_volatile(
                self.avail.add(RING_HEADER + 2 * slot) as *mut u16,
                head.to_le(),
            )
        };
        self.avail_idx += 1;
        // Release: the descriptors and the ring entry are visible before the
        // index that publishes them.
        self.avail_idx_field()
            .store(self.avail_idx.0.to_le(), Ordering::Release);
        Ok(head)
    }

    /// Whether the device must be notified about the chains added since the
    /// last call. With `EVENT_IDX` this honours the device's `avail_event`:
    /// a burst of adds costs at most one doorbell, and a device that is
    /// still processing (has not re-armed `avail_event`) needs none.
    pub fn kick_needed(&mut self) -> bool {
        // Full fence: our avail.idx store must be visible before we read the
        // device's avail_event (a store-load ordering).
        fence(Ordering::SeqCst);
        let new = self.avail_idx;
        let old = std::mem::replace(&mut self.kicked_at, new);
        if self.event_idx {
            let event = u16::from_le(self.avail_event().load(Ordering::Relaxed));
            need_event(event, new.0, old.0)
        } else {
            new != old
                && u16::from_le(self.used_flags().load(Ordering::Relaxed))
                    & VRING_USED_F_NO_NOTIFY as u16
                    == 0
        }
    }

    // --- reaping ------------------------------------------------------------

    /// Whether the device has completed chains not yet popped.
    pub fn has_used(&self) -> bool {
        u16::from_le(self.used_idx_field().load(Ordering::Acquire)) != self.last_used.0
    }

    /// Takes the next completion in the device's order: the chain's token and
    /// the number of bytes the device wrote into its writable buffers. The
    /// chain's descriptors are free again. `Ok(None)` when nothing is
    /// pending; an error when the device wrote an impossible entry (the
    /// queue is then broken and must be reset).
    pub fn pop_used(&mut self) -> Result<Option<(T, u32)>, QueueError> {
        if let Some(err) = &self.broken {
            return Err(QueueError::Broken(Box::new(err.clone())));
        }
        let used_idx = Wrapping(u16::from_le(self.used_idx_field().load(Ordering::Acquire)));
        if used_idx == self.last_used {
            return Ok(None);
        }
        if (used_idx - self.last_used).0 > self.size {
            return Err(self.fail(QueueError::UsedIndexOutOfRange {
                last_used: self.last_used.0,
                used_idx: used_idx.0,
                size: self.size,
            }));
        }
        let slot = (self.last_used.0 % self.size) as usize;
        // SAFETY: slot < size, so the 8-byte element is inside the used ring
        // and 4-byte aligned; volatile because the device wrote it.
        let (id, len) = unsafe {
            let element = self.used.add(RING_HEADER + USED_ELEM_SIZE * slot);
            (
                u32::from_le(ptr::read_volatile(element as *const u32)),
                u32::from_le(ptr::read_volatile(element.add(4) as *const u32)),
            )
        };
        let Some(chain) = self
            .in_flight
            .get(id as usize)
            .and_then(|entry| entry.as_ref())
        else {
            return Err(self.fail(QueueError::BadUsedId(id)));
        };
        if u64::from(len) > chain.writable {
            let err = QueueError::BadUsedLength {
                head: id as u16,
                len,
                writable: chain.writable,
            };
            return Err(self.fail(err));
        }
        let head = id as u16;
        let chain = self.in_flight[head as usize]
            .take()
            .expect("checked to be in flight above");
        self.next[chain.tail as usize] = self.free_head;
        self.free_head = head;
        self.num_free += chain.count;
        self.last_used += 1;
        if self.event_idx && self.interrupts {
            // Keep asking for a notification at the next completion.
            self.used_event()
                .store(self.last_used.0.to_le(), Ordering::Relaxed);
            fence(Ordering::SeqCst);
        }
        Ok(Some((chain.token, len)))
    }

    // --- interrupt suppression ----------------------------------------------

    /// Asks the device to notify (signal the completion eventfd) at the next
    /// completion. Returns `true` when completions are already pending: the
    /// caller must poll again rather than sleep, since the notification for
    /// those may have been decided before this call.
    pub fn enable_interrupts(&mut self) -> bool {
        self.interrupts = true;
        if self.event_idx {
            self.used_event()
                .store(self.last_used.0.to_le(), Ordering::Relaxed);
        } else {
            self.avail_flags().store(0, Ordering::Relaxed);
        }
        // Full fence: the used_event store must be visible before we re-read
        // used.idx, else a completion in between goes unnoticed by both sides.
        fence(Ordering::SeqCst);
        self.has_used()
    }

    /// Asks the device not to notify on completions (best effort: one
    /// notification already decided may still arrive). Used while the driver
    /// is busy polling.
    pub fn disable_interrupts(&mut self) {
        self.interrupts = false;
        if self.event_idx {
            // The farthest index from where the device is: it cannot reach it
            // before the driver re-enables (it is at most `size` ahead).
            self.used_event().store(
                (self.last_used + Wrapping(0x8000)).0.to_le(),
                Ordering::Relaxed,
            );
        } else {
            self.avail_flags().store(
                (VRING_AVAIL_F_NO_INTERRUPT as u16).to_le(),
                Ordering::Relaxed,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn need_event_matches_the_spec() {
        // Device asked to be kicked when index 5 is published.
        assert!(need_event(5, 6, 5));
        assert!(need_event(5, 9, 3));
        assert!(!need_event(5, 5, 3));
        assert!(!need_event(5, 9, 6));
        // Across the wrap.
        assert!(need_event(0xffff, 2, 0xfffe));
        assert!(!need_event(0xfffd, 2, 0xfffe));
    }

    #[test]
    fn sizes_are_checked() {
        let arena = DmaArena::new(1 << 20).unwrap();
        for bad in [0u16, 3, 100, 65535] {
            assert_eq!(
                SplitQueue::<()>::new(&arena, bad, true).unwrap_err(),
                QueueError::InvalidSize(bad)
            );
        }
        let q = SplitQueue::<()>::new(&arena, 256, true).unwrap();
        let layout = q.layout();
        assert_eq!(layout.desc_addr % 4096, 0);
        assert_eq!(layout.avail_addr, layout.desc_addr + 16 * 256);
        assert_eq!(layout.used_addr % 64, 0);
        assert!(layout.used_addr + 4 + 8 * 256 + 2 <= layout.ring_start + layout.ring_len);
        assert_eq!(layout.ring_len % 4096, 0);
    }

    #[test]
    fn full_and_malformed_chains_are_refused() {
        let arena = DmaArena::new(1 << 20).unwrap();
        let mut q = SplitQueue::new(&arena, 4, true).unwrap();
        let r = ChainElement::readable(0x1000, 8);
        let w = ChainElement::writable(0x2000, 8);
        assert_eq!(q.add(&[], 0).unwrap_err(), QueueError::EmptyChain);
        assert_eq!(
            q.add(&[w, r], 0).unwrap_err(),
            QueueError::ReadableAfterWritable(1)
        );
        q.add(&[r, w, w], 1).unwrap();
        assert_eq!(
            q.add(&[r, w], 2).unwrap_err(),
            QueueError::Full { needed: 2, free: 1 }
        );
        q.add(&[r], 3).unwrap();
        assert_eq!(q.num_free(), 0);
        assert_eq!(q.in_flight(), 2);
    }
}
