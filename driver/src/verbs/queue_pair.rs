//! The send side of the context's queue pair: the send ring and posting.

use pindown_uapi::WorkRequest;

use super::{Context, Entry, VerbsError, INTERNAL};
use crate::arena::DmaBuffer;
use crate::transport::Transport;
use crate::virtqueue::{ChainElement, QueueError, SplitQueue};

/// Work requests in flight: the ring and the request slots it points at.
pub(super) struct SendRing {
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
}

impl<T: Transport + 'static> Context<T> {
    /// Posts a batch of requests with one doorbell (none if the device is
    /// busy and needs no kick). All or nothing: fails with
    /// [`VerbsError::QueueFull`] when the batch does not fit.
    pub fn post(&self, entries: &[Entry]) -> Result<(), VerbsError> {
        if let Some(bad) = entries
            .iter()
            .find(|entry| entry.request().user_data & INTERNAL != 0)
        {
            return Err(VerbsError::ReservedUserData(bad.request().user_data));
        }
        self.post_requests(entries.iter().map(|entry| *entry.request()))
    }

    pub(super) fn post_requests(
        &self,
        requests: impl ExactSizeIterator<Item = WorkRequest>,
    ) -> Result<(), VerbsError> {
        let mut send = self.send.lock();
        if send.free.len() < requests.len() {
            send.reap()?;
        }
        if send.free.len() < requests.len() {
            return Err(VerbsError::QueueFull {
                free: send.free.len(),
                wanted: requests.len(),
            });
        }
        for request in requests {
            let slot = send.free.pop().expect("room checked above");
            let offset = usize::from(slot) * WorkRequest::SIZE;
            send.slots.write_at(offset, &request.encode());
            let iova = send.slots.iova() + offset as u64;
            send.queue.add(
                &[ChainElement::readable(iova, WorkRequest::SIZE as u32)],
                slot,
            )?;
        }
        if send.queue.kick_needed() {
            self.transport.notify(self.layout.send_queue())?;
        }
        Ok(())
    }
}
