//! Queue pairs: a send ring of the port's, owned by one [`QueuePair`],
//! where work requests are posted.

use std::sync::Arc;

use pindown_uapi::queue::{inline_slots, INLINE_IN_REQUEST, MAX_INLINE};
use pindown_uapi::{Descriptor, Operation, WorkRequest};

use super::pairs::PairShared;
use super::{Context, Entry, MemoryRegion, VerbsError};
use crate::arena::{DmaArena, DmaBuffer};
use crate::rdma_queue::SendQueue;
use crate::transport::{QueueIndex, Transport, VhostUserTransport};

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
    /// with whether it asked to go inline (a write of at most
    /// [`MAX_INLINE`] bytes inside `arena` then carries its bytes in the
    /// send queue), with one doorbell (none if the device polls and needs
    /// no kick). All or nothing: fails with [`VerbsError::QueueFull`] when
    /// the batch does not fit.
    pub(super) fn post<'d, T: Transport>(
        &mut self,
        transport: &T,
        arena: &DmaArena,
        count: usize,
        request: impl Fn(usize) -> (WorkRequest, bool, &'d [u8]),
    ) -> Result<(), VerbsError> {
        let inline_len = |request: &WorkRequest, inline: bool| match request.op {
            Operation::Write { local, len, .. }
                if inline && len <= MAX_INLINE && arena.contains(local, len as usize) =>
            {
                Some(len)
            }
            _ => None,
        };
        let slots: usize = (0..count)
            .map(|i| {
                let (request, inline, _) = request(i);
                inline_len(&request, inline)
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
            let (mut request, wants_inline, carried) = request(i);
            self.inline.clear();
            self.inline.extend_from_slice(carried);
            if let (Some(len), Operation::Write { local, remote, .. }) =
                (inline_len(&request, wants_inline), request.op)
            {
                self.inline.resize(len as usize, 0);
                arena.read(local, &mut self.inline);
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
    descriptors: std::collections::VecDeque<HeldDescriptors<'c, T>>,
}

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
            descriptors: Default::default(),
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
    /// device has finished the request (it can tell once the device has
    /// taken a later request of the pair; a dropped queue pair waits for
    /// that up to [`ContextConfig::control_timeout`](super::ContextConfig::control_timeout)).
    pub fn post(&mut self, entries: &[Entry<'_>]) -> Result<(), VerbsError> {
        self.release_descriptors()?;
        let mut in_memory: Vec<Option<u64>> = Vec::new();
        let mut held = Vec::new();
        for entry in entries {
            let placed = match entry.descriptor() {
                Some(bytes) if bytes.len() > MAX_INLINE as usize => {
                    let buffer = self.context.alloc(bytes.len(), 64)?;
                    buffer.write_at(0, bytes);
                    // SAFETY: `buffer` is kept beside the region in
                    // `held`, declared after it so it is freed after the
                    // region deregisters, and both stay until the device
                    // has finished the request (`release_descriptors`).
                    let region =
                        unsafe { self.context.register(buffer.iova(), buffer.len() as u64)? };
                    let iova = buffer.iova();
                    held.push((region, buffer));
                    Some(iova)
                }
                _ => None,
            };
            in_memory.push(placed);
        }
        let send = self.send.as_mut().expect("the send ring stays until drop");
        send.post(
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
                (request, entry.wants_inline(), carried)
            },
        )?;
        if !held.is_empty() {
            self.descriptors.push_back(HeldDescriptors {
                after: send.queue.tail(),
                _held: held,
            });
        }
        Ok(())
    }

    /// Lets go of the descriptors of requests the device has finished.
    fn release_descriptors(&mut self) -> Result<(), VerbsError> {
        let send = self.send.as_mut().expect("the send ring stays until drop");
        while let Some(first) = self.descriptors.front() {
            if !send.queue.finished_before(first.after)? {
                break;
            }
            self.descriptors.pop_front();
        }
        Ok(())
    }

    /// Waits (up to the context's control timeout) until the device has
    /// finished every request whose descriptor the queue pair holds: a
    /// NOP after them shows when. What is still held then is leaked, never
    /// freed under the device.
    fn settle_descriptors(&mut self) {
        let Some(last) = self.descriptors.back() else {
            return;
        };
        let after = last.after;
        let send = self.send.as_mut().expect("the send ring stays until drop");
        let nop = WorkRequest {
            user_data: 0,
            flags: pindown_uapi::WrFlags::empty(),
            op: Operation::Nop,
        };
        let posted = send.queue.tail() != after
            || send
                .post(&*self.context.transport, &self.context.arena, 1, |_| {
                    (nop, false, &[][..])
                })
                .is_ok();
        let deadline = std::time::Instant::now() + self.context.control_timeout;
        while posted && std::time::Instant::now() < deadline {
            if !matches!(send.queue.finished_before(after), Ok(false)) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
        if posted && matches!(send.queue.finished_before(after), Ok(true)) {
            self.descriptors.clear();
        } else {
            tracing::warn!(
                pair = self.pair,
                "the device did not finish the vector requests of a dropped queue pair: \
                 their descriptors stay allocated"
            );
            for held in self.descriptors.drain(..) {
                std::mem::forget(held);
            }
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

/// Descriptors in registered memory, held until the device has taken a
/// request at `after` or later.
struct HeldDescriptors<'c, T: Transport + 'static> {
    after: u16,
    /// Kept alive only; each region drops (deregisters) before its
    /// buffer is freed.
    _held: Vec<(MemoryRegion<'c, T>, DmaBuffer)>,
}

impl<T: Transport + 'static> Drop for QueuePair<'_, T> {
    fn drop(&mut self) {
        self.settle_descriptors();
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
