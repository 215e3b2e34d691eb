//! The completion side of the context's queue pair: the completion queue,
//! polling and waiting.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use pindown_uapi::Completion;

use super::{Context, VerbsError, INTERNAL};
use crate::rdma_queue::CompletionQueue;
use crate::transport::Transport;

/// The completion queue, and completions already taken from it.
pub(super) struct CompletionRing {
    pub(super) queue: CompletionQueue,
    /// The caller's completions, in order.
    pub(super) ready: VecDeque<Completion>,
    /// Completions of the driver's own requests, by user data.
    pub(super) internal: HashMap<u64, Completion>,
}

impl CompletionRing {
    /// Moves every completion the device has written into `ready` or
    /// `internal`. Returns how many arrived.
    pub(super) fn pump(&mut self) -> Result<usize, VerbsError> {
        let mut arrived = 0;
        while let Some(completion) = self.queue.pop() {
            let completion = completion.map_err(VerbsError::BadCompletion)?;
            if completion.user_data & INTERNAL != 0 {
                self.internal.insert(completion.user_data, completion);
            } else {
                self.ready.push_back(completion);
            }
            arrived += 1;
        }
        Ok(arrived)
    }
}

impl<T: Transport + 'static> Context<T> {
    /// Moves completions into `out` without blocking; returns how many.
    pub fn poll(&self, out: &mut [Completion]) -> Result<usize, VerbsError> {
        let mut ring = self.completion.lock();
        if ring.ready.len() < out.len() {
            self.reap(&mut ring)?;
        }
        let count = out.len().min(ring.ready.len());
        for (slot, completion) in out.iter_mut().zip(ring.ready.drain(..count)) {
            *slot = completion;
        }
        Ok(count)
    }

    /// Waits until at least one completion is available (or `timeout`
    /// passes), then moves up to `out.len()` into `out`. Polls for the
    /// configured spin time first, then sleeps on the eventfd.
    pub fn wait(&self, out: &mut [Completion], timeout: Duration) -> Result<usize, VerbsError> {
        self.wait_until(timeout, |context| context.poll(out))
    }

    /// Takes the completions the device wrote and tells it how far the
    /// driver has read, with a doorbell if the device waits for room.
    pub(super) fn reap(&self, ring: &mut CompletionRing) -> Result<(), VerbsError> {
        if ring.pump()? > 0 && ring.queue.publish() {
            self.transport.notify(self.layout.completion_queue())?;
        }
        Ok(())
    }
}
