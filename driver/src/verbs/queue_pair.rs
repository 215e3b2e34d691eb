//! The send side of the context's queue pair: the send queue and posting.

use pindown_uapi::queue::{INLINE_IN_REQUEST, MAX_INLINE};
use pindown_uapi::{Operation, WorkRequest};

use super::{Context, Entry, VerbsError, INTERNAL};
use crate::rdma_queue::SendQueue;
use crate::transport::Transport;

/// The send queue and the room to gather inline bytes in.
pub(super) struct SendRing {
    pub(super) queue: SendQueue,
    /// Inline bytes of the request being posted.
    pub(super) inline: Vec<u8>,
}

impl<T: Transport + 'static> Context<T> {
    /// Posts a batch of requests with one doorbell (none if the device is
    /// polling and needs no kick). All or nothing: fails with
    /// [`VerbsError::QueueFull`] when the batch does not fit.
    pub fn post(&self, entries: &[Entry]) -> Result<(), VerbsError> {
        if let Some(bad) = entries
            .iter()
            .find(|entry| entry.request().user_data & INTERNAL != 0)
        {
            return Err(VerbsError::ReservedUserData(bad.request().user_data));
        }
        self.post_with(entries.len(), |i| {
            (*entries[i].request(), entries[i].wants_inline())
        })
    }

    /// The bytes a write asked to go inline carries, if it may: at most
    /// [`MAX_INLINE`], all of them in the arena.
    fn inline_len(&self, request: &WorkRequest, inline: bool) -> Option<u32> {
        match request.op {
            Operation::Write { local, len, .. }
                if inline && len <= MAX_INLINE && self.arena.contains(local, len as usize) =>
            {
                Some(len)
            }
            _ => None,
        }
    }

    /// Posts `count` requests, request `i` being `request(i)` (with
    /// whether it asked to go inline).
    pub(super) fn post_with(
        &self,
        count: usize,
        request: impl Fn(usize) -> (WorkRequest, bool),
    ) -> Result<(), VerbsError> {
        let mut send = self.send.lock();
        let slots: usize = (0..count)
            .map(|i| {
                let (request, inline) = request(i);
                match self.inline_len(&request, inline) {
                    Some(len) => 1 + pindown_uapi::queue::inline_slots(len),
                    None => 1,
                }
            })
            .sum();
        if !send.queue.has_room(slots)? {
            return Err(VerbsError::QueueFull {
                free: send.queue.free()?,
                wanted: slots,
            });
        }
        let SendRing { queue, inline } = &mut *send;
        for i in 0..count {
            let (mut request, wants_inline) = request(i);
            inline.clear();
            if let (Some(len), Operation::Write { local, remote, .. }) =
                (self.inline_len(&request, wants_inline), request.op)
            {
                inline.resize(len as usize, 0);
                self.arena.read(local, inline);
                let mut head = [0u8; INLINE_IN_REQUEST];
                let carried = inline.len().min(INLINE_IN_REQUEST);
                head[..carried].copy_from_slice(&inline[..carried]);
                request.op = Operation::WriteInline { len, head, remote };
            }
            queue.push(&request, inline);
        }
        if queue.kick_needed() {
            self.transport.notify(self.layout.send_queue())?;
        }
        Ok(())
    }
}
