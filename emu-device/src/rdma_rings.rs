//! The device side of the RDMA queue format ([`pindown_uapi::queue`]): the
//! send queue's request slots and the completion queue's slots, found once
//! in the port's memory and then reached without a translation per
//! request.
//!
//! A port's two RDMA rings are translated (through its IOTLB, with the
//! access each part needs) when they are first served, and again only when
//! their configuration changes or the port's memory does: every barrier on
//! the port ([`PortShared::barrier`](crate::port::PortShared::barrier):
//! an IOTLB update or invalidation, a new memory table, a revocation, a
//! reset) starts a new generation of its memory, and [`RingCache::view`]
//! compares generations before it lends the pointers. The pointers are
//! only lent for as long as the caller holds the port's access gate, so a
//! barrier that takes ring memory away waits for the access in flight, as
//! it does for any other.
//!
//! Nothing read from the rings is trusted: a slot is taken only when it
//! holds the stamp of the expected position, its bytes are copied before
//! they are decoded, and the decoder validates them (a bad request gets an
//! error completion). A ring whose memory does not translate is either
//! waited for (an IOTLB miss: the frontend is asked) or reported broken.

use std::sync::atomic::{fence, AtomicU16, Ordering};

use pindown_uapi::queue::{
    self, Record, COMPLETION_SLOT, COMPLETION_STAMP, REQUEST_SLOT, REQUEST_STAMP,
};
use pindown_uapi::{Completion, DecodeError, Operation, WorkRequest};
use vm_memory::Permissions;

use crate::memory::{Miss, PortMemory, TranslateError};
use crate::port::SharedState;
use crate::queues::Vring;

/// Where a ring was configured, as the frontend last set it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct RingConfig {
    slots: u64,
    driver: u64,
    device: u64,
    size: u16,
}

impl RingConfig {
    fn of(ring: &Vring) -> RingConfig {
        use virtio_queue::QueueT;
        RingConfig {
            slots: ring.queue.desc_table(),
            driver: ring.queue.avail_ring(),
            device: ring.queue.used_ring(),
            size: ring.queue.size(),
        }
    }
}

/// Why a ring cannot be used now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RingFault {
    /// Part of a ring has no IOTLB entry yet (or not the access needed):
    /// ask the frontend and try again after its UPDATE.
    Miss(Miss),
    /// A ring cannot be used as configured.
    Broken {
        /// Which: the send queue (else the completion queue).
        send_queue: bool,
        /// What is wrong, naming the part.
        reason: String,
    },
}

impl RingFault {
    fn broken(part: &str, reason: String) -> RingFault {
        RingFault::Broken {
            send_queue: part.starts_with("send"),
            reason,
        }
    }
}

/// The translated memory of a port's two RDMA rings.
#[derive(Debug)]
struct Resolved {
    generation: u64,
    sq: RingConfig,
    cq: RingConfig,
    /// One pointer per request slot, readable.
    sq_slots: Vec<*const u8>,
    /// The send queue's device record: index (head) and event lines.
    sq_head: *mut u8,
    sq_event: *mut u8,
    /// One pointer per completion slot, writable.
    cq_slots: Vec<*mut u8>,
    /// The completion queue's driver record: consumed index and event.
    cq_consumed: *const u8,
    cq_call_event: *const u8,
    /// The completion queue's device record event (room wanted).
    cq_room_event: *mut u8,
}

// SAFETY: the pointers are addresses in the port's mapped memory, not
// tied to a thread: they are only dereferenced through a `RingsView`,
// which is lent while the caller holds the port's access gate and after
// `generation` was checked against the gate's (a barrier that changes the
// memory starts a new generation, and the cache is translated again). A
// queue pair's service, which owns the cache, may be served by the shared
// poller's thread as well as by its port's (one at a time, under the
// port's send-queue lock), which is what sending it between threads means.
unsafe impl Send for Resolved {}

/// The translated rings of one port, kept across requests (boxed: the
/// send queue takes the cache out of itself and puts it back on every
/// poll, which then moves a pointer).
#[derive(Debug, Default)]
pub struct RingCache {
    resolved: Option<Box<Resolved>>,
}

/// The RDMA rings lent for one guarded step: the caller holds the port's
/// access gate (`'g`) and the rings' configuration (`'r`).
pub struct RingsView<'c, 'g> {
    rings: &'c Resolved,
    _gate: std::marker::PhantomData<&'g SharedState>,
}

/// Translates `[addr, addr + len)` for `access` into one span of this
/// process's memory, or says why not (`part` names it in the reason).
fn contiguous(
    memory: &PortMemory,
    addr: u64,
    len: u64,
    access: Permissions,
    part: &str,
) -> Result<*mut u8, RingFault> {
    let mut slices = memory.translate(addr, len, access);
    let first = match slices.next() {
        Some(Ok(slice)) => slice,
        Some(Err(error)) => return Err(fault(error, part)),
        None => return Err(RingFault::broken(part, format!("{part} is empty"))),
    };
    if first.len() as u64 != len {
        return Err(match slices.next() {
            Some(Err(error)) => fault(error, part),
            _ => RingFault::broken(
                part,
                format!("{part} at {addr:#x} (+{len}) is not contiguous in the frontend's memory"),
            ),
        });
    }
    Ok(first.ptr_guard_mut().as_ptr())
}

fn fault(error: TranslateError, part: &str) -> RingFault {
    match error.ask() {
        Some(miss) => RingFault::Miss(miss),
        None => RingFault::broken(part, format!("{part}: {error}")),
    }
}

/// The slots of a ring: one pointer each (slots never straddle a
/// translation a frontend would make, but each is checked).
fn slots(
    memory: &PortMemory,
    config: RingConfig,
    slot: usize,
    access: Permissions,
    part: &str,
) -> Result<Vec<*mut u8>, RingFault> {
    if !queue::valid_size(config.size) {
        return Err(RingFault::broken(
            part,
            format!("{part}: size {}", config.size),
        ));
    }
    if !config.slots.is_multiple_of(queue::ALIGN) {
        return Err(RingFault::broken(
            part,
            format!(
                "{part} at {:#x} is not {}-byte aligned",
                config.slots,
                queue::ALIGN
            ),
        ));
    }
    let total = queue::slots_bytes(config.size, slot);
    if config.slots.checked_add(total).is_none() {
        return Err(RingFault::broken(
            part,
            format!("{part} wraps the address space"),
        ));
    }
    let mut out = Vec::with_capacity(usize::from(config.size));
    let mut spans = memory.translate(config.slots, total, access);
    let mut at = 0u64;
    while at < total {
        let span = match spans.next() {
            Some(Ok(span)) => span,
            Some(Err(error)) => return Err(fault(error, part)),
            None => break,
        };
        let base = span.ptr_guard_mut().as_ptr();
        let len = span.len() as u64;
        if !at.is_multiple_of(slot as u64) || !len.is_multiple_of(slot as u64) {
            return Err(RingFault::broken(
                part,
                format!(
                    "{part}: slot {} is not contiguous in the frontend's memory",
                    at / slot as u64
                ),
            ));
        }
        for k in 0..len / slot as u64 {
            // SAFETY: k * slot < len: inside the span just translated.
            out.push(unsafe { base.add((k * slot as u64) as usize) });
        }
        at += len;
    }
    Ok(out)
}

/// One 64-byte line of a record (both lines of a record may lie on
/// different pages).
fn record_line(
    memory: &PortMemory,
    record: u64,
    offset: usize,
    access: Permissions,
    part: &str,
) -> Result<*mut u8, RingFault> {
    if !record.is_multiple_of(queue::ALIGN) {
        return Err(RingFault::broken(
            part,
            format!("{part} at {record:#x} is not {}-byte aligned", queue::ALIGN),
        ));
    }
    let line = record
        .checked_add(offset as u64)
        .ok_or_else(|| RingFault::broken(part, format!("{part} wraps the address space")))?;
    contiguous(memory, line, 64, access, part)
}

impl Resolved {
    fn new(
        memory: &PortMemory,
        generation: u64,
        sq: RingConfig,
        cq: RingConfig,
    ) -> Result<Resolved, RingFault> {
        let sq_slots = slots(
            memory,
            sq,
            REQUEST_SLOT,
            Permissions::Read,
            "send queue slots",
        )?;
        let cq_slots = slots(
            memory,
            cq,
            COMPLETION_SLOT,
            Permissions::Write,
            "completion queue slots",
        )?;
        let line = |record, offset, access, part| record_line(memory, record, offset, access, part);
        Ok(Resolved {
            generation,
            sq,
            cq,
            sq_slots: sq_slots.into_iter().map(|p| p as *const u8).collect(),
            sq_head: line(
                sq.device,
                Record::INDEX,
                Permissions::Write,
                "send queue device record",
            )?,
            sq_event: line(
                sq.device,
                Record::EVENT,
                Permissions::Write,
                "send queue device record",
            )?,
            cq_slots,
            cq_consumed: line(
                cq.driver,
                Record::INDEX,
                Permissions::Read,
                "completion queue driver record",
            )?,
            cq_call_event: line(
                cq.driver,
                Record::EVENT,
                Permissions::Read,
                "completion queue driver record",
            )?,
            cq_room_event: line(
                cq.device,
                Record::EVENT,
                Permissions::Write,
                "completion queue device record",
            )?,
        })
    }
}

impl RingCache {
    /// The port's RDMA rings `sq` and `cq` in the memory of `state` (whose
    /// gate the caller holds), translated again if their configuration or
    /// the port's memory changed since the last time. A fresh translation
    /// leaves the completion queue's room event where the driver does not
    /// get to from `cq_tail` (see [`RingsView::arm_room`]).
    pub fn view<'c, 'g>(
        &'c mut self,
        state: &'g SharedState,
        sq: &Vring,
        cq: &Vring,
        cq_tail: u16,
    ) -> Result<RingsView<'c, 'g>, RingFault> {
        let memory = state.memory.as_ref().ok_or_else(|| RingFault::Broken {
            send_queue: true,
            reason: "no memory table".into(),
        })?;
        let (sq, cq) = (RingConfig::of(sq), RingConfig::of(cq));
        let fresh = self
            .resolved
            .as_ref()
            .is_some_and(|r| r.generation == state.generation && r.sq == sq && r.cq == cq);
        if !fresh {
            self.resolved = None;
            let resolved = Resolved::new(memory, state.generation, sq, cq)?;
            self.resolved = Some(Box::new(resolved));
        }
        let view = RingsView {
            rings: self.resolved.as_ref().expect("resolved above"),
            _gate: std::marker::PhantomData,
        };
        if !fresh {
            view.disarm_room(cq_tail);
        }
        Ok(view)
    }

    /// Forgets the translations (the rings stopped).
    pub fn clear(&mut self) {
        self.resolved = None;
    }
}

/// A 16-bit field of ring memory as an atomic.
///
/// # Safety
///
/// `at` must point to two bytes of mapped ring memory, 2-byte aligned,
/// that stay mapped for `'a`.
unsafe fn field<'a>(at: *const u8) -> &'a AtomicU16 {
    // SAFETY: the caller guarantees a live, aligned 2-byte location; the
    // frontend may change it at any time, which atomics allow.
    unsafe { AtomicU16::from_ptr(at as *mut u16) }
}

/// What the slot at the send queue's head holds.
pub enum Slot {
    /// Not written yet.
    Empty,
    /// A request (or bytes that do not decode) and the slots it takes.
    Taken {
        /// The request, or why its bytes do not decode (the user data, if
        /// the bytes hold one, for the error completion).
        request: Result<WorkRequest, (DecodeError, u64)>,
        /// Slots it occupies: one, plus inline slots.
        slots: u16,
    },
}

impl RingsView<'_, '_> {
    /// Entries of the send queue.
    pub fn sq_size(&self) -> u16 {
        self.rings.sq.size
    }

    /// Entries of the completion queue.
    pub fn cq_size(&self) -> u16 {
        self.rings.cq.size
    }

    fn request_slot(&self, position: u16) -> *const u8 {
        self.rings.sq_slots[usize::from(position & (self.rings.sq.size - 1))]
    }

    /// Looks at the send queue slot of `position` and, if it holds that
    /// position's stamp, copies its request out (with the inline bytes
    /// that follow it into `inline`).
    pub fn take(&self, position: u16, inline: &mut Vec<u8>) -> Slot {
        let slot = self.request_slot(position);
        // SAFETY: the slot pointer is in the send queue's translated slots
        // (64-byte aligned, so the stamp is 2-byte aligned), mapped while
        // the gate is held.
        let stamp = unsafe { field(slot.add(REQUEST_STAMP)) }.load(Ordering::Acquire);
        if u16::from_le(stamp) != queue::stamp(position) {
            return Slot::Empty;
        }
        let bytes = self.copy_slot(slot);
        let request = queue::decode_request_slot(&bytes).map_err(|error| {
            let user_data = u64::from_le_bytes(bytes[8..16].try_into().expect("eight bytes"));
            (error, user_data)
        });
        inline.clear();
        let request = match request {
            Ok(request) => request,
            Err(error) => {
                return Slot::Taken {
                    request: Err(error),
                    slots: 1,
                }
            }
        };
        // Bytes carried with the request: WRITE_INLINE's data (its first
        // bytes in the request itself), a vector transfer's inline
        // descriptor (all in the slots after the request).
        let extra = request.op.slots_after();
        let (len, in_request) = match request.op {
            Operation::WriteInline { len, .. } => (len, request.op.bytes_in_request()),
            Operation::VectorWrite(vector) | Operation::VectorRead(vector) => {
                (vector.descriptor.len(), 0)
            }
            _ => (0, 0),
        };
        if extra >= usize::from(self.rings.sq.size) {
            let error = DecodeError::OutOfRange {
                field: "inline length (longer than the send queue)",
                value: u64::from(len),
            };
            return Slot::Taken {
                request: Err((error, request.user_data)),
                slots: 1,
            };
        }
        if let Operation::WriteInline { head, .. } = request.op {
            inline.extend_from_slice(&head[..in_request]);
        }
        let len = len as usize;
        for k in 1..=extra as u16 {
            let bytes = self.copy_slot(self.request_slot(position.wrapping_add(k)));
            let take = (len - inline.len()).min(queue::INLINE_PER_SLOT);
            inline.extend_from_slice(&bytes[..take]);
        }
        let slots = 1 + extra as u16;
        Slot::Taken {
            request: Ok(request),
            slots,
        }
    }

    fn copy_slot(&self, slot: *const u8) -> [u8; REQUEST_SLOT] {
        let mut words = [0u64; REQUEST_SLOT / 8];
        for (k, word) in words.iter_mut().enumerate() {
            // SAFETY: inside the 64-byte slot, 8-byte aligned; volatile
            // because the frontend may write it (the copy is decoded, never
            // the slot itself).
            *word = unsafe { std::ptr::read_volatile((slot as *const u64).add(k)) };
        }
        let mut bytes = [0u8; REQUEST_SLOT];
        for (chunk, word) in bytes.chunks_exact_mut(8).zip(words) {
            chunk.copy_from_slice(&word.to_ne_bytes());
        }
        bytes
    }

    /// Stores the send queue's head (positions before it may be written
    /// again by the driver).
    pub fn publish_head(&self, head: u16) {
        // SAFETY: the device record's index line, translated writable.
        unsafe { field(self.rings.sq_head) }.store(head.to_le(), Ordering::Release);
    }

    /// Stores the send queue's retired position (every request before it
    /// has finished).
    pub fn publish_retired(&self, retired: u16) {
        // SAFETY: the device record's index line (64 bytes from the
        // record, translated writable) holds the retired field at
        // `RETIRED`, 2-aligned like the record.
        unsafe { field(self.rings.sq_head.add(Record::RETIRED - Record::INDEX)) }
            .store(retired.to_le(), Ordering::Release);
    }

    /// Asks the driver to kick the send queue when it publishes `head`,
    /// and says whether a request is there already (then the caller must
    /// not sleep).
    pub fn arm_kick(&self, head: u16) -> bool {
        // SAFETY: the device record's event line, translated writable.
        unsafe { field(self.rings.sq_event) }.store(head.to_le(), Ordering::Relaxed);
        fence(Ordering::SeqCst);
        // SAFETY: as in `take`.
        let stamp = unsafe { field(self.request_slot(head).add(REQUEST_STAMP)) };
        u16::from_le(stamp.load(Ordering::Acquire)) == queue::stamp(head)
    }

    /// Whether the completion queue has room for position `tail`, given
    /// the consumed index last read (`*consumed`, refreshed from the
    /// driver's record when the cached one says full).
    pub fn has_room(&self, tail: u16, consumed: &mut u16) -> bool {
        if tail.wrapping_sub(*consumed) < self.rings.cq.size {
            return true;
        }
        *consumed = self.consumed();
        tail.wrapping_sub(*consumed) < self.rings.cq.size
    }

    fn consumed(&self) -> u16 {
        // SAFETY: the driver record's index line, translated readable.
        u16::from_le(unsafe { field(self.rings.cq_consumed) }.load(Ordering::Acquire))
    }

    /// Asks the driver to kick the completion queue once it has consumed
    /// enough for `tail` to fit, and says whether it fits already.
    pub fn arm_room(&self, tail: u16, consumed: &mut u16) -> bool {
        let event = tail.wrapping_sub(self.rings.cq.size);
        // SAFETY: the device record's event line, translated writable.
        unsafe { field(self.rings.cq_room_event) }.store(event.to_le(), Ordering::Relaxed);
        fence(Ordering::SeqCst);
        *consumed = self.consumed();
        tail.wrapping_sub(*consumed) < self.rings.cq.size
    }

    /// Leaves the room event where the driver's consumed index does not
    /// get to while the device has room.
    pub fn disarm_room(&self, tail: u16) {
        // SAFETY: as in `arm_room`.
        unsafe { field(self.rings.cq_room_event) }
            .store(queue::far_event(tail).to_le(), Ordering::Relaxed);
    }

    /// Writes `completion` at position `tail` (the caller checked the
    /// room), stamp last.
    pub fn complete(&self, tail: u16, completion: &Completion) {
        let slot = self.rings.cq_slots[usize::from(tail & (self.rings.cq.size - 1))];
        let bytes = queue::completion_slot(completion, tail);
        // SAFETY: a whole completion slot translated writable for this
        // generation (32 bytes, 32-byte aligned); the driver reads it only
        // once the stamp is stored.
        unsafe { queue::publish_slot(slot, &bytes, COMPLETION_STAMP) };
    }

    /// Whether the driver asked to be signalled for a completion at one of
    /// the positions `old..new` just written.
    pub fn call_needed(&self, new: u16, old: u16) -> bool {
        fence(Ordering::SeqCst);
        // SAFETY: the driver record's event line, translated readable.
        let event =
            u16::from_le(unsafe { field(self.rings.cq_call_event) }.load(Ordering::Relaxed));
        queue::need_event(event, new, old)
    }
}
