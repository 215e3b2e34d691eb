//! The RDMA queues in memory: where the slots and the two records of the
//! send queue and of the completion queue lie, how a slot is stamped, how
//! small writes travel inline, and how each side asks the other for a
//! notification.
//!
//! Each RDMA queue is set up as a virtio ring is (vhost-user's
//! SET_VRING_NUM, SET_VRING_ADDR, SET_VRING_KICK and SET_VRING_CALL, or
//! virtio-pci's queue registers), so that both transports and QEMU carry
//! it unchanged, but its three addresses name the parts of this format
//! instead of a split virtqueue:
//!
//! | virtio address | send queue | completion queue |
//! |---|---|---|
//! | descriptor table | `size` request slots of [`REQUEST_SLOT`] bytes | `size` completion slots of [`COMPLETION_SLOT`] bytes |
//! | driver area | the driver's [`Record`] | the driver's [`Record`] |
//! | device area | the device's [`Record`] | the device's [`Record`] |
//!
//! All three are 64-byte aligned and lie in memory the device may read
//! and write (IOTLB entries or the memory table); `size` is a power of
//! two up to [`MAX_QUEUE_SIZE`].
//!
//! ## Positions and stamps
//!
//! Requests and completions are numbered by 16-bit positions that wrap.
//! Position `p` lives in slot `p % size`, and the last two bytes of that
//! slot ([`REQUEST_STAMP`], [`COMPLETION_STAMP`]) hold [`stamp(p)`](stamp)
//! once the slot is filled: the writer fills the rest of the slot first
//! and stores the stamp last, with release ordering; the reader loads the
//! stamp with acquire ordering and reads the rest only if it is the one it
//! expects. So each side finds new work by polling one slot, with no index
//! to read first: one cache line moves from the driver to the device per
//! request, and one back per completion.
//!
//! ## The send queue
//!
//! The driver writes requests at consecutive positions. A
//! [`WRITE_INLINE`](crate::Opcode::WriteInline) request carries its bytes
//! with it: the first [`INLINE_IN_REQUEST`] in the request itself, the
//! rest in the [`inline_slots`] slots after it, [`INLINE_PER_SLOT`] bytes
//! each, written before the request's stamp. Each of those slots holds
//! its own position's stamp in its last two bytes, so that no later lap
//! takes the bytes it carried for a request. The device takes
//! the request at its `head` position, then moves `head` past it and its
//! inline slots and stores `head` in its record's index ([`Record::INDEX`])
//! with release ordering: slots before `head` may be written again.
//!
//! Taking a request is not finishing it: a request handed to the fabric
//! link reads or writes the initiator's memory until its answer arrives,
//! while the device takes the requests after it. The device therefore also
//! stores, in the same line of its record ([`Record::RETIRED`]), the
//! position before which every request has finished, its last access to
//! the memory it names done: the oldest request still running or on the
//! fabric, or `head` when none is. It moves forward only, from `head`'s
//! first value, and a driver keeps the memory a request names allocated
//! until the retired position has passed the request (a completion of a
//! later request does not tell, since requests on the fabric complete out
//! of order).
//!
//! ## The completion queue
//!
//! The device writes one completion per signalled request and per failed
//! request, in execution order, at consecutive positions. The driver
//! stores how many it has consumed in its record's index; the device
//! writes position `p` only while `p` is less than that index plus
//! `size`, so it never overwrites a completion the driver has not read.
//!
//! ## Notifications
//!
//! Each side asks for a notification by storing, in its record's event
//! field ([`Record::EVENT`]), the position whose arrival should wake it;
//! the other side, after publishing positions `old..new` and a full
//! fence, notifies when [`need_event(event, new, old)`](need_event) holds
//! (the rule of virtio's `VIRTIO_F_EVENT_IDX`). Before sleeping, a side
//! stores its event, fences, and looks at the slot once more.
//!
//! | field | asks for | notification |
//! |---|---|---|
//! | send queue, device record event | a request at that position | the driver kicks the send queue |
//! | completion queue, driver record event | a completion at that position | the device signals the completion queue's call fd |
//! | completion queue, device record event | the driver's consumed index to pass that position (room for a completion) | the driver kicks the completion queue |
//!
//! While a side polls it leaves its event where the other side never gets
//! to (half the position space ahead), so no notification, and no system
//! call, is made per request.
//!
//! The send queue's driver record and the completion queue's device
//! record index are reserved: zero. So is the retired position of every
//! record but the send queue's device record.

use crate::error::DecodeError;
use crate::{Completion, WorkRequest};

/// Bytes of a send queue slot (one [`WorkRequest`], or inline bytes).
pub const REQUEST_SLOT: usize = WorkRequest::SIZE;

/// Bytes of a completion queue slot (one [`Completion`]).
pub const COMPLETION_SLOT: usize = Completion::SIZE;

/// Offset of the stamp in a send queue slot (the request's last two bytes,
/// reserved in [`WorkRequest`]'s own layout).
pub const REQUEST_STAMP: usize = REQUEST_SLOT - 2;

/// Offset of the stamp in a completion queue slot (the completion's last
/// two bytes, reserved in [`Completion`]'s own layout).
pub const COMPLETION_STAMP: usize = COMPLETION_SLOT - 2;

/// Most entries a queue may have.
pub const MAX_QUEUE_SIZE: u16 = 32768;

/// Alignment of slots and records.
pub const ALIGN: u64 = 64;

/// Bytes of a WRITE_INLINE request's data carried in the request itself
/// (its operand fields, offsets 40 to 56).
pub const INLINE_IN_REQUEST: usize = 16;

/// Offset of the inline bytes in the request.
pub const INLINE_OFFSET: usize = 40;

/// Bytes of a WRITE_INLINE request's data each of the slots after it
/// carries (all but the stamp).
pub const INLINE_PER_SLOT: usize = REQUEST_SLOT - 2;

/// Most bytes one WRITE_INLINE request carries.
pub const MAX_INLINE: u32 = 512;

/// One side's record of a queue: two cache lines, each written by one
/// side only, so that the index the writer updates often and the event the
/// reader checks after every post never share a line.
pub struct Record;

impl Record {
    /// Bytes of a record.
    pub const SIZE: u64 = 128;
    /// Offset of the 16-bit index (little-endian).
    pub const INDEX: usize = 0;
    /// Offset of the send queue device record's 16-bit retired position
    /// (little-endian), on the index's line: every request before it has
    /// finished, those handed to the fabric included (see the module
    /// documentation). Zero in the other records.
    pub const RETIRED: usize = 2;
    /// Offset of the 16-bit event (little-endian).
    pub const EVENT: usize = 64;
}

/// The stamp of position `position`: never zero before the first wrap, so
/// that zeroed memory holds no request.
pub fn stamp(position: u16) -> u16 {
    position.wrapping_add(1)
}

/// Whether moving a position from `old` to `new` passes `event`: the
/// other side asked to be notified when `event` arrives (virtio's
/// `vring_need_event`).
pub fn need_event(event: u16, new: u16, old: u16) -> bool {
    new.wrapping_sub(event).wrapping_sub(1) < new.wrapping_sub(old)
}

/// An event the other side never reaches while it polls: half the
/// position space ahead of `position`.
pub fn far_event(position: u16) -> u16 {
    position.wrapping_add(0x8000)
}

/// Slots after a WRITE_INLINE request that carry the rest of its `len`
/// bytes.
pub fn inline_slots(len: u32) -> usize {
    (len as usize)
        .saturating_sub(INLINE_IN_REQUEST)
        .div_ceil(INLINE_PER_SLOT)
}

/// Bytes of the slots of a queue of `size` entries of `slot` bytes each.
pub fn slots_bytes(size: u16, slot: usize) -> u64 {
    u64::from(size) * slot as u64
}

/// Whether `size` is a valid queue size.
pub fn valid_size(size: u16) -> bool {
    size.is_power_of_two() && size <= MAX_QUEUE_SIZE
}

/// The send queue slot of `request` at `position`: its encoding with the
/// stamp in the last two bytes.
pub fn request_slot(request: &WorkRequest, position: u16) -> [u8; REQUEST_SLOT] {
    let mut slot = request.encode();
    slot[REQUEST_STAMP..].copy_from_slice(&stamp(position).to_le_bytes());
    slot
}

/// The stamp a send queue slot holds.
pub fn request_slot_stamp(slot: &[u8; REQUEST_SLOT]) -> u16 {
    u16::from_le_bytes([slot[REQUEST_STAMP], slot[REQUEST_STAMP + 1]])
}

/// The slot at `position` that carries `bytes` (at most
/// [`INLINE_PER_SLOT`]) of a WRITE_INLINE request before it.
pub fn inline_slot(bytes: &[u8], position: u16) -> [u8; REQUEST_SLOT] {
    let mut slot = [0u8; REQUEST_SLOT];
    let len = bytes.len().min(INLINE_PER_SLOT);
    slot[..len].copy_from_slice(&bytes[..len]);
    slot[REQUEST_STAMP..].copy_from_slice(&stamp(position).to_le_bytes());
    slot
}

/// Decodes the request of a send queue slot (its stamp set aside).
pub fn decode_request_slot(slot: &[u8; REQUEST_SLOT]) -> Result<WorkRequest, DecodeError> {
    let mut bytes = *slot;
    bytes[REQUEST_STAMP..].fill(0);
    WorkRequest::decode(&bytes)
}

/// The completion queue slot of `completion` at `position`.
pub fn completion_slot(completion: &Completion, position: u16) -> [u8; COMPLETION_SLOT] {
    let mut slot = completion.encode();
    slot[COMPLETION_STAMP..].copy_from_slice(&stamp(position).to_le_bytes());
    slot
}

/// Publishes a slot in shared memory as this module's protocol says: the
/// bytes before `stamp_at` first (volatile 8-byte stores, the last partial
/// word bytewise so that nothing touches the stamp), then the stamp
/// (`bytes[stamp_at..stamp_at + 2]`) with release ordering, so that a
/// reader that loads the stamp with acquire ordering sees the whole slot.
///
/// # Safety
///
/// `slot` must be 8-byte aligned and valid for writes of `stamp_at + 2`
/// bytes for the duration of the call, `stamp_at` even and at most
/// `bytes.len() - 2`; the other side may access the slot concurrently
/// (that is what the stamp orders), but nothing else in this process may
/// hold a reference to it.
pub unsafe fn publish_slot(slot: *mut u8, bytes: &[u8], stamp_at: usize) {
    for (k, chunk) in bytes[..stamp_at].chunks(8).enumerate() {
        // SAFETY: `8 * k + chunk.len() <= stamp_at`, inside the slot the
        // caller vouches for; whole words are 8-byte aligned because the
        // slot is.
        unsafe {
            if let Ok(word) = <[u8; 8]>::try_from(chunk) {
                std::ptr::write_volatile((slot as *mut u64).add(k), u64::from_ne_bytes(word));
            } else {
                for (i, byte) in chunk.iter().enumerate() {
                    std::ptr::write_volatile(slot.add(8 * k + i), *byte);
                }
            }
        }
    }
    let stamp = u16::from_ne_bytes([bytes[stamp_at], bytes[stamp_at + 1]]);
    // SAFETY: the stamp lies inside the slot at an even offset of an
    // 8-byte-aligned slot, so it is a live, 2-byte-aligned location, and
    // the other side accesses it only as a whole 16-bit value.
    unsafe { std::sync::atomic::AtomicU16::from_ptr(slot.add(stamp_at) as *mut u16) }
        .store(stamp, std::sync::atomic::Ordering::Release);
}

/// Decodes the completion of a completion queue slot (its stamp set
/// aside).
pub fn decode_completion_slot(slot: &[u8; COMPLETION_SLOT]) -> Result<Completion, DecodeError> {
    let mut bytes = *slot;
    bytes[COMPLETION_STAMP..].fill(0);
    Completion::decode(&bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Operation, RemoteAddress, RemoteKey, WrFlags};

    #[test]
    fn stamps_are_never_zero_before_the_wrap_and_differ_between_laps() {
        assert_ne!(stamp(0), 0);
        for size in [1u16, 2, 256, MAX_QUEUE_SIZE] {
            for position in [0u16, 1, 255, 0x7fff, 0xfffe] {
                let next_lap = position.wrapping_add(size);
                assert_ne!(stamp(position), stamp(next_lap), "{size} {position}");
            }
        }
    }

    #[test]
    fn need_event_is_virtios_rule() {
        assert!(need_event(5, 6, 5));
        assert!(need_event(5, 9, 3));
        assert!(!need_event(5, 5, 3));
        assert!(!need_event(5, 9, 6));
        assert!(need_event(0xffff, 2, 0xfffe));
        assert!(!need_event(far_event(10), 11, 10));
    }

    #[test]
    fn inline_bytes_spill_into_whole_slots() {
        assert_eq!(inline_slots(0), 0);
        assert_eq!(inline_slots(16), 0);
        assert_eq!(inline_slots(17), 1);
        assert_eq!(inline_slots(78), 1);
        assert_eq!(inline_slots(79), 2);
        assert_eq!(inline_slots(MAX_INLINE), 8);
    }

    #[test]
    fn slots_round_trip_with_their_stamps() {
        let request = WorkRequest {
            user_data: 9,
            flags: WrFlags::SIGNALED,
            op: Operation::Write {
                local: 0x1000,
                len: 8,
                remote: RemoteAddress {
                    node: 0,
                    port: 1,
                    key: RemoteKey(2),
                    offset: 3,
                },
            },
        };
        let slot = request_slot(&request, 41);
        assert_eq!(request_slot_stamp(&slot), 42);
        assert_eq!(decode_request_slot(&slot), Ok(request));
        assert_eq!(
            WorkRequest::decode(&slot),
            Err(DecodeError::ReservedNotZero { offset: 62 })
        );
        let completion = Completion::success(9, crate::Opcode::Write, 8, 0);
        let slot = completion_slot(&completion, 0xffff);
        assert_eq!(&slot[COMPLETION_STAMP..], &[0, 0]);
        assert_eq!(decode_completion_slot(&slot), Ok(completion));
        assert!(valid_size(256) && !valid_size(0) && !valid_size(3));
    }
}
