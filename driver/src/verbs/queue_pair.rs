//! Queue pairs: a send ring of the port's, owned by one [`QueuePair`],
//! where work requests are posted.

use std::sync::Arc;

use pindown_uapi::WorkRequest;

use super::pairs::PairShared;
use super::{Context, Entry, VerbsError};
use crate::arena::DmaBuffer;
use crate::transport::{QueueIndex, Transport, VhostUserTransport};
use crate::virtqueue::{ChainElement, QueueError, SplitQueue};

/// The send ring of one RDMA queue pair: the ring and the request slots it
/// points at.
pub(super) struct SendRing {
    /// The ring's index in the device.
    pub(super) index: QueueIndex,
    pub(super) queue: SplitQueue<u16>,
    pub(super) slots: DmaBuffer,
    pub(super) free: Vec<u16>,
}

impl SendRing {
    /// Takes back the slots of requests the device has executed.
    pub(super) fn reap(&mut self) -> Result<(), QueueError> {
        while let Some((slot, _)) = self.queue.pop_used()? {
            self.free.push(slot);
        }
        Ok(())
    }

    /// Puts `requests` on the ring with one doorbell (none if the device is
    /// busy and needs no kick). All or nothing: fails with
    /// [`VerbsError::QueueFull`] when the batch does not fit.
    pub(super) fn post<T: Transport>(
        &mut self,
        transport: &T,
        requests: impl ExactSizeIterator<Item = WorkRequest>,
    ) -> Result<(), VerbsError> {
        if self.free.len() < requests.len() {
            self.reap()?;
        }
        if self.free.len() < requests.len() {
            return Err(VerbsError::QueueFull {
                free: self.free.len(),
                wanted: requests.len(),
            });
        }
        for request in requests {
            let slot = self.free.pop().expect("room checked above");
            let offset = usize::from(slot) * WorkRequest::SIZE;
            self.slots.write_at(offset, &request.encode());
            let iova = self.slots.iova() + offset as u64;
            self.queue.add(
                &[ChainElement::readable(iova, WorkRequest::SIZE as u32)],
                slot,
            )?;
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
    /// busy and needs no kick). All or nothing: fails with
    /// [`VerbsError::QueueFull`] when the batch does not fit; the send ring
    /// has [`ContextConfig::queue_size`](super::ContextConfig::queue_size)
    /// slots, and a slot is free again once the device has executed its
    /// request.
    pub fn post(&mut self, entries: &[Entry<'_>]) -> Result<(), VerbsError> {
        let send = self.send.as_mut().expect("the send ring stays until drop");
        send.post(
            &*self.context.transport,
            entries.iter().map(|entry| *entry.request()),
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
