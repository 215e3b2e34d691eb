//! Queue pairs: a send ring of the port's, owned by one [`QueuePair`],
//! where work requests are posted.

use std::sync::Arc;

use pindown_uapi::queue::{inline_slots, INLINE_IN_REQUEST, MAX_INLINE};
use pindown_uapi::{Operation, WorkRequest};

use super::pairs::PairShared;
use super::{Context, Entry, VerbsError};
use crate::arena::DmaArena;
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
    pub(super) fn post<T: Transport>(
        &mut self,
        transport: &T,
        arena: &DmaArena,
        count: usize,
        request: impl Fn(usize) -> (WorkRequest, bool),
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
                let (request, inline) = request(i);
                inline_len(&request, inline).map_or(1, |len| 1 + inline_slots(len))
            })
            .sum();
        if !self.queue.has_room(slots)? {
            return Err(VerbsError::QueueFull {
                free: self.queue.free()?,
                wanted: slots,
            });
        }
        for i in 0..count {
            let (mut request, wants_inline) = request(i);
            self.inline.clear();
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
    pub fn post(&mut self, entries: &[Entry<'_>]) -> Result<(), VerbsError> {
        let send = self.send.as_mut().expect("the send ring stays until drop");
        send.post(
            &*self.context.transport,
            &self.context.arena,
            entries.len(),
            |i| (*entries[i].request(), entries[i].wants_inline()),
        )
    }
}

impl<T: Transport + 'static> Drop for QueuePair<'_, T> {
    fn drop(&mut self) {
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
