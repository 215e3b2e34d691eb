//! Queue pairs: a send ring of the port's, owned by one [`QueuePair`],
//! where work requests are posted.

use std::collections::VecDeque;
use std::sync::Arc;

use pindown_uapi::queue::{inline_slots, INLINE_IN_REQUEST, MAX_INLINE};
use pindown_uapi::{Descriptor, Operation, WorkRequest};

use super::memory::context_address;
use super::pairs::PairShared;
use super::{Context, Entry, KeepAlive, MemoryRegion, VerbsError};
use crate::arena::DmaArena;
use crate::rdma_queue::SendQueue;
use crate::transport::{QueueIndex, Transport, VhostUserTransport};
use vm_memory::VolatileSlice;

/// The send queue of one RDMA queue pair, and room to gather the bytes of
/// an inline write in.
pub(super) struct SendRing {
    /// The ring's index in the device.
    pub(super) index: QueueIndex,
    pub(super) queue: SendQueue,
    /// The bytes of the inline write being posted.
    pub(super) inline: Vec<u8>,
}

impl SendRing {
    /// A send ring over `queue`, ring `index` of the device.
    pub(super) fn new(index: QueueIndex, queue: SendQueue) -> Self {
        SendRing {
            index,
            queue,
            inline: Vec::with_capacity(MAX_INLINE as usize),
        }
    }

    /// Puts `count` requests on the ring, request `i` being `request(i)`
    /// with how it may go inline, with one doorbell (none if the device
    /// polls and needs no kick). All or nothing: fails with
    /// [`VerbsError::QueueFull`] when the batch does not fit.
    pub(super) fn post<'d, T: Transport>(
        &mut self,
        transport: &T,
        arena: &DmaArena,
        count: usize,
        request: impl Fn(usize) -> (WorkRequest, InlineSource, &'d [u8]),
    ) -> Result<(), VerbsError> {
        let inline_len = |request: &WorkRequest, source: InlineSource| match request.op {
            Operation::Write { local, len, .. }
                if len <= MAX_INLINE
                    && (source == InlineSource::Mapped
                        || source == InlineSource::Arena
                            && arena.contains(local, len as usize)) =>
            {
                Some(len)
            }
            _ => None,
        };
        let slots: usize = (0..count)
            .map(|i| {
                let (request, source, _) = request(i);
                inline_len(&request, source)
                    .map_or(1 + request.op.slots_after(), |len| 1 + inline_slots(len))
            })
            .sum();
        if !self.queue.has_room(slots)? {
            return Err(VerbsError::QueueFull {
                free: self.queue.free()?,
                wanted: slots,
            });
        }
        for i in 0..count {
            let (mut request, source, carried) = request(i);
            self.inline.clear();
            self.inline.extend_from_slice(carried);
            if let (Some(len), Operation::Write { local, remote, .. }) =
                (inline_len(&request, source), request.op)
            {
                self.inline.resize(len as usize, 0);
                if !arena.read(local, &mut self.inline) {
                    // SAFETY: `source` is `Mapped`: the write's local range
                    // was taken from a memory region of this context that
                    // the entry borrows, so this process maps its `len`
                    // bytes at `local` (the region's address, registered
                    // memory being identity-mapped) while the entry lives.
                    // The device may write the same bytes meanwhile (they
                    // may be a window's or a read's destination), so they
                    // are read with volatile loads, through no reference.
                    unsafe { read_mapped(local, &mut self.inline) };
                }
                let mut head = [0u8; INLINE_IN_REQUEST];
                let carried = self.inline.len().min(INLINE_IN_REQUEST);
                head[..carried].copy_from_slice(&self.inline[..carried]);
                request.op = Operation::WriteInline { len, head, remote };
            }
            self.queue.push(&request, &self.inline);
        }
        if self.queue.kick_needed() {
            transport.notify(self.index)?;
        }
        Ok(())
    }
}

/// Where an inline write may take its bytes from when it is posted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum InlineSource {
    /// The request does not go inline.
    None,
    /// From the context's DMA arena, if the range lies inside it.
    Arena,
    /// From this process's memory at the range's address.
    Mapped,
}

/// Copies `out.len()` bytes at address `addr` of this process into `out`
/// with volatile loads.
///
/// # Safety
///
/// This process maps `[addr, addr + out.len())` readable for the whole
/// call.
unsafe fn read_mapped(addr: u64, out: &mut [u8]) {
    // SAFETY: the caller's contract: the range is mapped and readable;
    // VolatileSlice only performs volatile accesses, which tolerate
    // another process writing the bytes meanwhile.
    let source = unsafe { VolatileSlice::new(addr as *mut u8, out.len()) };
    source.copy_to(out);
}

/// An RDMA queue pair of the port: posts work requests, whose completions
/// arrive on the [`CompletionQueue`](super::CompletionQueue) it was created
/// with ([`Context::create_queue_pair`]).
///
/// The device executes one queue pair's requests in order, and different
/// queue pairs' independently. Posting takes `&mut self` and no lock: give
/// each thread its own queue pair. Dropping it posts a last marker request
/// and gives the send ring back to the context; the device still finishes
/// what was posted, and the completions still arrive on the completion
/// queue.
pub struct QueuePair<'c, T: Transport + 'static = VhostUserTransport> {
    context: &'c Context<T>,
    pair: u16,
    /// `Some` until the queue pair is dropped.
    send: Option<SendRing>,
    shared: Arc<PairShared>,
    /// Vector descriptors in registered memory, oldest first.
    descriptors: VecDeque<HeldDescriptors<'c, T>>,
    /// Registered buffers of descriptors the device has finished with,
    /// for the next ones (at most [`SPARE_DESCRIPTORS`]).
    spare_descriptors: Vec<MemoryRegion<'c, T>>,
    /// Shares of the memory posted requests name, each with the position
    /// after the last request naming it, oldest first.
    kept: VecDeque<(u16, KeepAlive)>,
}

/// Shares of memory a queue pair holds before it asks the device which
/// requests have finished (posting reads the device's record only then,
/// or when the send ring's room is in question).
const KEPT_BEFORE_ASKING: usize = 32;

/// Registered descriptor buffers a queue pair keeps for reuse, so that
/// posting a vector transfer whose descriptor does not fit the send queue
/// neither allocates nor registers memory once warm.
const SPARE_DESCRIPTORS: usize = 8;
/// Descriptor buffers are allocated in powers of two from this size (so
/// that one serves descriptors of similar lengths)...
const DESCRIPTOR_BUFFER_MIN: usize = 1 << 10;
/// ...and kept for reuse only up to this size.
const DESCRIPTOR_BUFFER_KEPT_MAX: usize = 64 << 10;

impl<'c, T: Transport + 'static> QueuePair<'c, T> {
    pub(super) fn new(
        context: &'c Context<T>,
        pair: u16,
        send: SendRing,
        shared: Arc<PairShared>,
    ) -> Self {
        QueuePair {
            context,
            pair,
            send: Some(send),
            shared,
            descriptors: VecDeque::new(),
            spare_descriptors: Vec::new(),
            kept: VecDeque::new(),
        }
    }

    /// The queue pair's number on the port (1 and up; 0 is the admin pair).
    pub fn number(&self) -> u16 {
        self.pair
    }

    /// Posts a batch of requests with one doorbell (none if the device is
    /// polling and needs no kick). All or nothing: fails with
    /// [`VerbsError::QueueFull`] when the batch does not fit; the send ring
    /// has [`ContextConfig::queue_size`](super::ContextConfig::queue_size)
    /// slots, a request takes one (an inline write more, see
    /// [`Entry::inline`]), and a slot is free again once the device has
    /// taken its request.
    ///
    /// A vector transfer's descriptor ([`Vector`](super::opcode::Vector))
    /// of at most [`MAX_INLINE`] bytes travels in the send ring's slots
    /// after the request; a larger one is copied into memory of the
    /// context's arena, registered, which the queue pair keeps until the
    /// device has finished the request (the send queue's retired position
    /// tells; a dropped queue pair waits for that up to
    /// [`ContextConfig::control_timeout`](super::ContextConfig::control_timeout)),
    /// and then keeps registered for later descriptors (a few buffers of
    /// up to 64 KiB), so that a warm queue pair posts them with a copy
    /// and no allocation or registration.
    ///
    /// A request naming a region that holds a share of its memory (see
    /// [`MemoryRegion`]) keeps a share too, until the device has finished
    /// the request: the memory stays allocated even if the region and its
    /// buffer are dropped as soon as this returns.
    pub fn post(&mut self, entries: &[Entry<'_>]) -> Result<(), VerbsError> {
        self.release(false)?;
        let mut in_memory: Vec<Option<u64>> = Vec::new();
        let mut held = Vec::new();
        for entry in entries {
            let placed = match entry.descriptor() {
                Some(bytes) if bytes.len() > MAX_INLINE as usize => {
                    let region = match self.descriptor_buffer(bytes.len()) {
                        Ok(region) => region,
                        Err(err) => {
                            keep_spare(&mut self.spare_descriptors, held);
                            return Err(err);
                        }
                    };
                    let buffer = region
                        .owned_buffer()
                        .expect("descriptor regions own their buffers");
                    buffer.write_at(0, bytes);
                    let iova = buffer.iova();
                    held.push(region);
                    Some(iova)
                }
                _ => None,
            };
            in_memory.push(placed);
        }
        let send = self.send.as_mut().expect("the send ring stays until drop");
        let before = send.queue.tail();
        let posted = send.post(
            &*self.context.transport,
            &self.context.arena,
            entries.len(),
            |i| {
                let entry = &entries[i];
                let mut request = *entry.request();
                let carried = match (entry.descriptor(), in_memory.get(i).copied().flatten()) {
                    (Some(bytes), placed) => {
                        place_descriptor(&mut request, bytes.len() as u32, placed);
                        if placed.is_some() {
                            &[][..]
                        } else {
                            bytes
                        }
                    }
                    (None, _) => &[][..],
                };
                let source = match (entry.wants_inline(), entry.local_mapped_in()) {
                    (false, _) => InlineSource::None,
                    // A region of this context: mapped here.
                    (true, Some(context)) if context == context_address(self.context) => {
                        InlineSource::Mapped
                    }
                    // A raw range, or another context's region (which the
                    // device refuses unless the arena holds it).
                    (true, _) => InlineSource::Arena,
                };
                (request, source, carried)
            },
        );
        let after = send.queue.tail();
        if after == before {
            // Nothing reached the ring: nothing to keep.
            keep_spare(&mut self.spare_descriptors, held);
            return posted;
        }
        // The requests are in the ring (even if ringing the doorbell
        // failed, a polling device runs them): keep what they name.
        if !held.is_empty() {
            self.descriptors.push_back(HeldDescriptors { after, held });
        }
        for keep in entries.iter().filter_map(Entry::keep_alive) {
            match self.kept.back_mut() {
                Some((last_after, last)) if Arc::ptr_eq(last, keep) => *last_after = after,
                _ => self.kept.push_back((after, Arc::clone(keep))),
            }
        }
        posted
    }

    /// Whether the device has finished every request posted here so far:
    /// its last access to the memory they name is done, fabric requests'
    /// answers included (taken, or a later request completed, does not
    /// tell; see [`pindown_uapi::queue::Record::RETIRED`]). Memory that a
    /// request names through an `unsafe` form ([`Local::from_raw`](super::Local::from_raw),
    /// [`Context::register`]) may be reused once this holds.
    pub fn all_finished(&mut self) -> Result<bool, VerbsError> {
        let send = self.send.as_mut().expect("the send ring stays until drop");
        let tail = send.queue.tail();
        Ok(send.queue.finished_before(tail)?)
    }

    /// Lets go of the shares of memory (see [`MemoryRegion`]) that the
    /// requests the device has finished kept, now; posting does it from
    /// time to time, and dropping the queue pair for every request.
    pub fn release_finished(&mut self) -> Result<(), VerbsError> {
        self.release(true)
    }

    /// Lets go of the descriptors and the memory shares of requests the
    /// device has finished. Unless `now`, shares go only when there are
    /// enough of them to be worth reading the device's record for.
    fn release(&mut self, now: bool) -> Result<(), VerbsError> {
        let send = self.send.as_mut().expect("the send ring stays until drop");
        while let Some(first) = self.descriptors.front() {
            if !send.queue.finished_before(first.after)? {
                break;
            }
            if let Some(done) = self.descriptors.pop_front() {
                keep_spare(&mut self.spare_descriptors, done.held);
            }
        }
        if now || self.kept.len() >= KEPT_BEFORE_ASKING {
            while let Some(&(after, _)) = self.kept.front() {
                if !send.queue.finished_before(after)? {
                    break;
                }
                self.kept.pop_front();
            }
        }
        Ok(())
    }

    /// A registered buffer of at least `len` bytes for a descriptor: a
    /// spare one (the smallest that fits), else a new one of the next
    /// power of two.
    fn descriptor_buffer(&mut self, len: usize) -> Result<MemoryRegion<'c, T>, VerbsError> {
        let fitting = self
            .spare_descriptors
            .iter()
            .enumerate()
            .filter(|(_, region)| region.len() >= len as u64)
            .min_by_key(|(_, region)| region.len())
            .map(|(at, _)| at);
        if let Some(at) = fitting {
            return Ok(self.spare_descriptors.swap_remove(at));
        }
        let buffer = self
            .context
            .alloc(len.next_power_of_two().max(DESCRIPTOR_BUFFER_MIN), 64)?;
        self.context.register_owned(buffer)
    }

    /// Waits (up to the context's control timeout) until the device has
    /// finished every request whose descriptor or memory the queue pair
    /// holds. What is still held then is leaked, never freed under the
    /// device.
    fn settle(&mut self) {
        if self.descriptors.is_empty() && self.kept.is_empty() {
            return;
        }
        let deadline = std::time::Instant::now() + self.context.control_timeout;
        while std::time::Instant::now() < deadline {
            if !matches!(self.all_finished(), Ok(false)) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
        if matches!(self.all_finished(), Ok(true)) {
            self.descriptors.clear();
            self.kept.clear();
        } else {
            tracing::warn!(
                pair = self.pair,
                "the device did not finish the requests of a dropped queue pair: \
                 the memory they name stays allocated"
            );
            for held in self.descriptors.drain(..) {
                std::mem::forget(held);
            }
            for (_, keep) in self.kept.drain(..) {
                std::mem::forget(keep);
            }
        }
    }
}

/// Keeps descriptor buffers the device has finished with (or never saw)
/// in `spare` for reuse, up to [`SPARE_DESCRIPTORS`] of at most
/// [`DESCRIPTOR_BUFFER_KEPT_MAX`] bytes; the rest go.
fn keep_spare<'c, T: Transport + 'static>(
    spare: &mut Vec<MemoryRegion<'c, T>>,
    regions: Vec<MemoryRegion<'c, T>>,
) {
    for region in regions {
        if spare.len() < SPARE_DESCRIPTORS && region.len() <= DESCRIPTOR_BUFFER_KEPT_MAX as u64 {
            spare.push(region);
        }
    }
}

/// Sets the descriptor field of a vector request: `len` bytes at `iova`
/// in memory, or inline.
fn place_descriptor(request: &mut WorkRequest, len: u32, iova: Option<u64>) {
    if let Operation::VectorWrite(vector) | Operation::VectorRead(vector) = &mut request.op {
        vector.descriptor = match iova {
            Some(iova) => Descriptor::InMemory { iova, len },
            None => Descriptor::Inline { len },
        };
    }
}

/// Descriptors in registered memory, held until the device has finished
/// every request before `after` (the retired position has reached it).
struct HeldDescriptors<'c, T: Transport + 'static> {
    after: u16,
    /// Regions that own their buffers.
    held: Vec<MemoryRegion<'c, T>>,
}

impl<T: Transport + 'static> Drop for QueuePair<'_, T> {
    fn drop(&mut self) {
        self.settle();
        if let Some(send) = self.send.take() {
            self.context.return_send_ring(self.pair, send, &self.shared);
        }
    }
}

impl<T: Transport + 'static> std::fmt::Debug for QueuePair<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueuePair")
            .field("number", &self.pair)
            .finish()
    }
}
