//! The driver side of the RDMA queues ([`pindown_uapi::queue`]): the send
//! queue, whose stamped request slots the device polls, and the completion
//! queue, whose stamped slots the device writes in place and the driver
//! polls.
//!
//! Each queue lives in one page-aligned chunk of the [`DmaArena`]: the
//! slots, then the driver's record, then the device's record (each record
//! two cache lines). [`SendQueue::layout`] and
//! [`CompletionQueue::layout`] give the three addresses to hand to the
//! transport as a virtio ring's descriptor table, driver area and device
//! area.
//!
//! Per request, in the steady state, the driver writes one slot (more for
//! inline bytes) and reads one completion slot; it reads the device's
//! record only when the send queue looks full, and it makes no system call
//! unless the device asked for a kick before sleeping. The device is
//! another process: every access to shared memory is volatile or atomic,
//! and what the device writes is checked before it is believed (a head
//! that moves backwards or past the requests posted breaks the queue; a
//! completion that does not decode is an error).

use std::sync::atomic::{fence, AtomicU16, Ordering};
use std::sync::Arc;

use pindown_uapi::queue::{
    self, Record, COMPLETION_SLOT, COMPLETION_STAMP, REQUEST_SLOT, REQUEST_STAMP,
};
use pindown_uapi::{Completion, DecodeError, WorkRequest};

use crate::arena::{DmaArena, DmaBuffer};
use crate::virtqueue::{QueueError, QueueLayout};

/// The slots and two records of one queue in a chunk of the arena.
struct QueueMemory {
    memory: DmaBuffer,
    size: u16,
    slot: usize,
    slots: *mut u8,
    driver: *mut u8,
    device: *mut u8,
}

// SAFETY: the raw pointers point into the arena chunk `memory` owns, which
// lives as long as the queue and is not tied to a thread.
unsafe impl Send for QueueMemory {}
// SAFETY: shared access only performs atomic loads of the shared records
// and slots.
unsafe impl Sync for QueueMemory {}

impl QueueMemory {
    fn new(arena: &Arc<DmaArena>, size: u16, slot: usize) -> Result<Self, QueueError> {
        if !queue::valid_size(size) {
            return Err(QueueError::InvalidSize(size));
        }
        let slots_len = queue::slots_bytes(size, slot) as usize;
        let records = slots_len.next_multiple_of(queue::ALIGN as usize);
        let memory = arena.alloc_pages(records + 2 * Record::SIZE as usize)?;
        memory.fill(0);
        let base = memory.as_ptr();
        Ok(QueueMemory {
            size,
            slot,
            slots: base,
            // SAFETY: both records lie inside the chunk just allocated.
            driver: unsafe { base.add(records) },
            // SAFETY: as above.
            device: unsafe { base.add(records + Record::SIZE as usize) },
            memory,
        })
    }

    fn layout(&self) -> QueueLayout {
        QueueLayout {
            size: self.size,
            desc_addr: self.slots as u64,
            avail_addr: self.driver as u64,
            used_addr: self.device as u64,
            ring_start: self.memory.iova(),
            ring_len: self.memory.len().next_multiple_of(crate::page_size()) as u64,
        }
    }

    fn slot(&self, position: u16) -> *mut u8 {
        // SAFETY: the index is below `size`, so the slot is inside the
        // chunk.
        unsafe {
            self.slots
                .add(usize::from(position & (self.size - 1)) * self.slot)
        }
    }

    /// The 16-bit field at `at` (a stamp, an index or an event).
    fn field(&self, at: *mut u8) -> &AtomicU16 {
        // SAFETY: every caller passes a 2-byte-aligned location inside the
        // chunk (slots and records are 64-byte aligned, fields at even
        // offsets), which lives as long as `self`; the device accesses
        // these fields only as whole 16-bit values.
        unsafe { AtomicU16::from_ptr(at as *mut u16) }
    }

    fn driver_field(&self, offset: usize) -> &AtomicU16 {
        // SAFETY: offset is Record::INDEX or Record::EVENT, inside the
        // record.
        self.field(unsafe { self.driver.add(offset) })
    }

    fn device_field(&self, offset: usize) -> &AtomicU16 {
        // SAFETY: as in `driver_field`.
        self.field(unsafe { self.device.add(offset) })
    }

    /// Writes `bytes` (a whole slot) into the slot of `position`, the
    /// stamp last with release ordering.
    fn fill(&self, position: u16, bytes: &[u8], stamp_at: usize) {
        // SAFETY: `slot` is a whole slot of this queue's chunk (64-byte
        // aligned, `stamp_at + 2` bytes long), live as long as `self`; the
        // driver holds no reference into it.
        unsafe { queue::publish_slot(self.slot(position), bytes, stamp_at) };
    }
}

/// Positions the driver posts past the device's retired position at most
/// (half the 16-bit position space), so that comparing a position with
/// the retired one never wraps.
const UNRETIRED_LIMIT: u16 = 1 << 15;

/// The driver side of the send queue.
pub struct SendQueue {
    memory: QueueMemory,
    /// The next position to write.
    tail: u16,
    /// The device's head as last read.
    head: u16,
    /// The device's retired position as last read (every request before
    /// it has finished).
    retired: u16,
    /// `tail` when the doorbell was last considered.
    kicked_at: u16,
    broken: Option<QueueError>,
}

impl SendQueue {
    /// A queue of `size` slots in a fresh chunk of `arena`, zeroed.
    pub fn new(arena: &Arc<DmaArena>, size: u16) -> Result<Self, QueueError> {
        Ok(SendQueue {
            memory: QueueMemory::new(arena, size, REQUEST_SLOT)?,
            tail: 0,
            head: 0,
            retired: 0,
            kicked_at: 0,
            broken: None,
        })
    }

    /// Where the parts are, to hand to the transport.
    pub fn layout(&self) -> QueueLayout {
        self.memory.layout()
    }

    /// Number of slots.
    pub fn size(&self) -> u16 {
        self.memory.size
    }

    /// Slots free for new requests, as far as the driver knows without
    /// reading the device's record: free slots, and no more than
    /// [`UNRETIRED_LIMIT`] positions past the retired one.
    fn known_free(&self) -> u16 {
        let slots = self.memory.size - self.tail.wrapping_sub(self.head);
        let positions = UNRETIRED_LIMIT - self.tail.wrapping_sub(self.retired);
        slots.min(positions)
    }

    /// Whether `slots` slots are free; reads the device's record if the
    /// last one read says not. An error if the device wrote an impossible
    /// head or retired position.
    pub fn has_room(&mut self, slots: usize) -> Result<bool, QueueError> {
        if let Some(error) = &self.broken {
            return Err(QueueError::Broken(Box::new(error.clone())));
        }
        if slots <= usize::from(self.known_free()) {
            return Ok(true);
        }
        self.read_retired()?;
        self.head = self.read_position(Record::INDEX, self.head, |head, last, tail| {
            QueueError::HeadOutOfRange { head, last, tail }
        })?;
        Ok(slots <= usize::from(self.known_free()))
    }

    /// Reads the device's retired position (before its head, which is
    /// never behind it).
    fn read_retired(&mut self) -> Result<(), QueueError> {
        self.retired =
            self.read_position(Record::RETIRED, self.retired, |retired, last, tail| {
                QueueError::RetiredOutOfRange {
                    retired,
                    last,
                    tail,
                }
            })?;
        Ok(())
    }

    /// Reads a position the device publishes in its record at `field`,
    /// last read as `last`: it only moves forward, never past what was
    /// posted; otherwise the queue is broken with `out_of_range(read,
    /// last, tail)`.
    fn read_position(
        &mut self,
        field: usize,
        last: u16,
        out_of_range: impl FnOnce(u16, u16, u16) -> QueueError,
    ) -> Result<u16, QueueError> {
        let read = u16::from_le(self.memory.device_field(field).load(Ordering::Acquire));
        if read.wrapping_sub(last) > self.tail.wrapping_sub(last) {
            let error = out_of_range(read, last, self.tail);
            self.broken = Some(error.clone());
            return Err(error);
        }
        Ok(read)
    }

    /// Slots free now (reading the device's head).
    pub fn free(&mut self) -> Result<usize, QueueError> {
        self.has_room(usize::from(self.memory.size) + 1)?;
        Ok(usize::from(self.known_free()))
    }

    /// Writes `request` at the next position, with `inline` (the bytes a
    /// WRITE_INLINE or a vector transfer's inline descriptor carries, else
    /// empty) in the slots after it, less those the request itself holds
    /// ([`Operation::bytes_in_request`](pindown_uapi::Operation::bytes_in_request));
    /// the caller made sure of the room ([`has_room`](Self::has_room) for
    /// [`slots_for`](Self::slots_for)).
    pub fn push(&mut self, request: &WorkRequest, inline: &[u8]) {
        let position = self.tail;
        let rest = inline.get(request.op.bytes_in_request()..).unwrap_or(&[]);
        let mut next = position.wrapping_add(1);
        for chunk in rest.chunks(queue::INLINE_PER_SLOT) {
            self.memory
                .fill(next, &queue::inline_slot(chunk, next), REQUEST_STAMP);
            next = next.wrapping_add(1);
        }
        self.memory.fill(
            position,
            &queue::request_slot(request, position),
            REQUEST_STAMP,
        );
        self.tail = next;
    }

    /// Slots `request` takes, the slots carrying its bytes included.
    pub fn slots_for(request: &WorkRequest) -> usize {
        1 + request.op.slots_after()
    }

    /// The position the next request will be written at.
    pub fn tail(&self) -> u16 {
        self.tail
    }

    /// Whether every request before position `after` (at most the next
    /// position to write) has finished, its memory accesses done: the
    /// device's retired position has reached `after`. Reads the device's
    /// record unless the last read says so already.
    pub fn finished_before(&mut self, after: u16) -> Result<bool, QueueError> {
        let retired = |queue: &Self| {
            // Positions run at most UNRETIRED_LIMIT past the retired one,
            // so one still ahead of it is more than that behind in 16 bits.
            queue.retired.wrapping_sub(after) <= queue.tail.wrapping_sub(after)
        };
        if retired(self) {
            return Ok(true);
        }
        if let Some(error) = &self.broken {
            return Err(QueueError::Broken(Box::new(error.clone())));
        }
        self.read_retired()?;
        Ok(retired(self))
    }

    /// Whether the device must be kicked for the requests written since
    /// the last call: only if it asked, before sleeping.
    pub fn kick_needed(&mut self) -> bool {
        // Full fence: the stamps must be visible before the device's event
        // is read (a store-load ordering; the device fences the other way).
        fence(Ordering::SeqCst);
        let new = self.tail;
        let old = std::mem::replace(&mut self.kicked_at, new);
        let event = u16::from_le(
            self.memory
                .device_field(Record::EVENT)
                .load(Ordering::Relaxed),
        );
        new != old && queue::need_event(event, new, old)
    }
}

/// The driver side of the completion queue.
pub struct CompletionQueue {
    memory: QueueMemory,
    /// The next position to read.
    head: u16,
    /// The consumed index last stored in the driver's record.
    published: u16,
}

impl CompletionQueue {
    /// A queue of `size` slots in a fresh chunk of `arena`, zeroed, asking
    /// for no notification yet.
    pub fn new(arena: &Arc<DmaArena>, size: u16) -> Result<Self, QueueError> {
        let queue = CompletionQueue {
            memory: QueueMemory::new(arena, size, COMPLETION_SLOT)?,
            head: 0,
            published: 0,
        };
        queue
            .memory
            .driver_field(Record::EVENT)
            .store(queue::far_event(0).to_le(), Ordering::Relaxed);
        Ok(queue)
    }

    /// Where the parts are, to hand to the transport.
    pub fn layout(&self) -> QueueLayout {
        self.memory.layout()
    }

    /// Whether the slot at the head holds a completion.
    pub fn ready(&self) -> bool {
        let slot = self.memory.slot(self.head);
        // SAFETY: the stamp is inside the slot.
        let stamp = self.memory.field(unsafe { slot.add(COMPLETION_STAMP) });
        u16::from_le(stamp.load(Ordering::Acquire)) == queue::stamp(self.head)
    }

    /// Takes the next completion, if the device has written it. An error
    /// if its bytes do not decode (it is consumed all the same).
    pub fn pop(&mut self) -> Option<Result<Completion, DecodeError>> {
        if !self.ready() {
            return None;
        }
        let slot = self.memory.slot(self.head);
        let mut words = [0u64; COMPLETION_SLOT / 8];
        for (k, word) in words.iter_mut().enumerate() {
            // SAFETY: inside the 32-byte slot, 8-byte aligned; volatile
            // because the device wrote it.
            *word = unsafe { std::ptr::read_volatile((slot as *const u64).add(k)) };
        }
        let mut bytes = [0u8; COMPLETION_SLOT];
        for (chunk, word) in bytes.chunks_exact_mut(8).zip(words) {
            chunk.copy_from_slice(&word.to_ne_bytes());
        }
        self.head = self.head.wrapping_add(1);
        Some(queue::decode_completion_slot(&bytes))
    }

    /// Tells the device how far the driver has read (so that it may write
    /// those slots again); returns whether the completion queue must be
    /// kicked (the device waits for room and asked).
    pub fn publish(&mut self) -> bool {
        let (new, old) = (self.head, self.published);
        if new == old {
            return false;
        }
        self.memory
            .driver_field(Record::INDEX)
            .store(new.to_le(), Ordering::Release);
        self.published = new;
        fence(Ordering::SeqCst);
        let event = u16::from_le(
            self.memory
                .device_field(Record::EVENT)
                .load(Ordering::Relaxed),
        );
        queue::need_event(event, new, old)
    }

    /// Asks the device to signal the completion eventfd at the next
    /// completion. Returns `true` when one is there already: the caller
    /// must look again rather than sleep.
    pub fn arm(&mut self) -> bool {
        self.memory
            .driver_field(Record::EVENT)
            .store(self.head.to_le(), Ordering::Relaxed);
        // Full fence: the event must be visible before the slot is looked
        // at again, else a completion in between goes unnoticed by both
        // sides.
        fence(Ordering::SeqCst);
        self.ready()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pindown_uapi::{Operation, RemoteAddress, RemoteKey, WrFlags};

    fn nop(user_data: u64) -> WorkRequest {
        WorkRequest {
            user_data,
            flags: WrFlags::SIGNALED,
            op: Operation::Nop,
        }
    }

    /// Stores the device record's `field` as the device would.
    fn device_stores(sq: &SendQueue, field: usize, value: u16) {
        sq.memory
            .device_field(field)
            .store(value.to_le(), Ordering::Release);
    }

    #[test]
    fn a_request_finishes_when_the_retired_position_passes_it_not_when_taken() {
        let arena = DmaArena::new(1 << 20).unwrap();
        let mut sq = SendQueue::new(&arena, 8).unwrap();
        sq.push(&nop(1), &[]);
        sq.push(&nop(2), &[]);
        assert!(!sq.finished_before(1).unwrap());
        // Both taken (the second, say, handed to the fabric): not finished.
        device_stores(&sq, Record::INDEX, 2);
        assert!(!sq.finished_before(1).unwrap());
        assert!(!sq.finished_before(2).unwrap());
        device_stores(&sq, Record::RETIRED, 1);
        assert!(sq.finished_before(1).unwrap());
        assert!(!sq.finished_before(2).unwrap());
        device_stores(&sq, Record::RETIRED, 2);
        assert!(sq.finished_before(2).unwrap());
        // A retired position past what was posted is a device bug.
        device_stores(&sq, Record::RETIRED, 5);
        sq.push(&nop(3), &[]);
        assert!(matches!(
            sq.finished_before(3),
            Err(QueueError::RetiredOutOfRange { retired: 5, .. })
        ));
        assert!(sq.has_room(1).is_err(), "the queue stays broken");
    }

    #[test]
    fn posting_stops_half_the_position_space_past_the_retired_position() {
        let arena = DmaArena::new(1 << 20).unwrap();
        let mut sq = SendQueue::new(&arena, 4).unwrap();
        // The device takes every request at once but one at position 0
        // never finishes (an answer from the fabric that does not come).
        let mut posted = 0u32;
        while sq.has_room(1).unwrap() {
            sq.push(&nop(u64::from(posted)), &[]);
            posted += 1;
            device_stores(&sq, Record::INDEX, sq.tail());
        }
        assert_eq!(posted, u32::from(UNRETIRED_LIMIT));
        assert!(!sq.finished_before(1).unwrap());
        // Once it finishes, posting goes on.
        device_stores(&sq, Record::RETIRED, sq.tail());
        assert!(sq.has_room(1).unwrap());
        assert!(sq.finished_before(sq.tail()).unwrap());
    }

    #[test]
    fn requests_land_stamped_in_consecutive_slots() {
        let arena = DmaArena::new(1 << 20).unwrap();
        let mut sq = SendQueue::new(&arena, 4).unwrap();
        let layout = sq.layout();
        assert_eq!(layout.desc_addr % 64, 0);
        assert_eq!(layout.avail_addr, layout.desc_addr + 256);
        assert_eq!(layout.used_addr, layout.avail_addr + 128);
        assert!(sq.has_room(4).unwrap());
        sq.push(&nop(1), &[]);
        let mut bytes = [0u8; REQUEST_SLOT];
        // SAFETY: the first slot of the queue's chunk, 64 bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(layout.desc_addr as *const u8, bytes.as_mut_ptr(), 64)
        };
        assert_eq!(queue::request_slot_stamp(&bytes), queue::stamp(0));
        assert_eq!(queue::decode_request_slot(&bytes), Ok(nop(1)));
        // An inline write of 100 bytes: the request and two slots.
        let data: Vec<u8> = (0..100).collect();
        let mut head = [0u8; 16];
        head.copy_from_slice(&data[..16]);
        let write = WorkRequest {
            user_data: 2,
            flags: WrFlags::SIGNALED,
            op: Operation::WriteInline {
                len: 100,
                head,
                remote: RemoteAddress {
                    node: 0,
                    port: 1,
                    key: RemoteKey(2),
                    offset: 0,
                },
            },
        };
        assert_eq!(SendQueue::slots_for(&write), 3);
        assert!(sq.has_room(3).unwrap());
        sq.push(&write, &data);
        assert!(!sq.has_room(1).unwrap(), "all four slots are in use");
        // The device takes all four: its head says so.
        sq.memory
            .device_field(Record::INDEX)
            .store(4u16.to_le(), Ordering::Release);
        assert!(sq.has_room(4).unwrap());
        // A head beyond what was posted is a device bug.
        sq.memory
            .device_field(Record::INDEX)
            .store(9u16.to_le(), Ordering::Release);
        sq.push(&nop(3), &[]);
        sq.push(&nop(4), &[]);
        sq.push(&nop(5), &[]);
        sq.push(&nop(6), &[]);
        assert!(matches!(
            sq.has_room(1),
            Err(QueueError::HeadOutOfRange { head: 9, .. })
        ));
        assert!(sq.has_room(1).is_err(), "the queue stays broken");
    }

    #[test]
    fn the_first_post_kicks_and_a_stale_event_does_not() {
        let arena = DmaArena::new(1 << 20).unwrap();
        let mut sq = SendQueue::new(&arena, 8).unwrap();
        sq.push(&nop(1), &[]);
        assert!(sq.kick_needed(), "the device starts asleep");
        sq.push(&nop(2), &[]);
        assert!(!sq.kick_needed(), "the device polls: no event at 1");
        sq.memory
            .device_field(Record::EVENT)
            .store(2u16.to_le(), Ordering::Relaxed);
        sq.push(&nop(3), &[]);
        assert!(sq.kick_needed(), "the device asked for position 2");
    }

    #[test]
    fn completions_are_read_by_their_stamps_and_published() {
        let arena = DmaArena::new(1 << 20).unwrap();
        let mut cq = CompletionQueue::new(&arena, 2).unwrap();
        assert!(cq.pop().is_none());
        assert!(!cq.arm(), "nothing written yet");
        let done = Completion::success(7, pindown_uapi::Opcode::Nop, 0, 0);
        cq.memory
            .fill(0, &queue::completion_slot(&done, 0), COMPLETION_STAMP);
        assert!(cq.arm(), "a completion is there: do not sleep");
        assert_eq!(cq.pop(), Some(Ok(done)));
        assert!(cq.pop().is_none());
        // The device asked to be kicked once position 0 is consumed.
        cq.memory
            .device_field(Record::EVENT)
            .store(0u16.to_le(), Ordering::Relaxed);
        assert!(cq.publish());
        assert!(!cq.publish(), "nothing new consumed");
        // A slot of the previous lap is not a completion.
        cq.memory
            .fill(1, &queue::completion_slot(&done, 0xffff), COMPLETION_STAMP);
        assert!(cq.pop().is_none());
        let mut garbage = queue::completion_slot(&done, 1);
        garbage[8] = 99;
        cq.memory.fill(1, &garbage, COMPLETION_STAMP);
        assert!(matches!(
            cq.pop(),
            Some(Err(DecodeError::UnknownStatus(99)))
        ));
    }
}
