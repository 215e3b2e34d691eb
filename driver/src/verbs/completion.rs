//! Completion queues: the completion rings of one or more queue pairs,
//! reaped into one stream of completions.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use pindown_uapi::{Completion, Opcode};

use super::pairs::PairShared;
use super::wait::{wait_for, Awaiting};
use super::{Context, VerbsError};
use crate::rdma_queue;
use crate::transport::{CompletionEvent, QueueIndex, Transport, VhostUserTransport};

/// The completion queue of one RDMA queue pair: slots the device writes
/// completions into, in place.
pub(super) struct CompletionRing {
    /// The ring's index in the device.
    pub(super) index: QueueIndex,
    pub(super) queue: rdma_queue::CompletionQueue,
    /// Signalled by the device when the driver asked for it.
    pub(super) event: CompletionEvent,
}

impl CompletionRing {
    /// Hands every completion the device has written to `deliver`, in
    /// order, and tells the device how far the driver has read (with a
    /// doorbell if it waits for room). Returns how many arrived.
    pub(super) fn pump<T: Transport>(
        &mut self,
        transport: &T,
        mut deliver: impl FnMut(Completion),
    ) -> Result<usize, VerbsError> {
        let mut arrived = 0;
        while let Some(completion) = self.queue.pop() {
            deliver(completion.map_err(VerbsError::BadCompletion)?);
            arrived += 1;
        }
        if arrived > 0 && self.queue.publish() {
            transport.notify(self.index)?;
        }
        Ok(arrived)
    }
}

/// A queue pair's completion ring inside a completion queue.
struct Member {
    pair: u16,
    ring: CompletionRing,
    shared: Arc<PairShared>,
}

/// Where the completions of one or more [`QueuePair`](super::QueuePair)s
/// arrive, in the order the device wrote them for each queue pair.
///
/// It holds the completion rings of the queue pairs created with it
/// ([`Context::create_queue_pair`]); polling takes `&mut self` and no
/// lock. A queue pair dropped before its completion queue leaves its
/// completions here; its ring returns to the context once the last of them
/// has been reaped. Dropping the completion queue returns every ring it
/// holds (completions not yet reaped are discarded).
pub struct CompletionQueue<'c, T: Transport + 'static = VhostUserTransport> {
    context: &'c Context<T>,
    members: Vec<Member>,
    /// Completions reaped and not yet handed out, oldest first.
    ready: VecDeque<Completion>,
}

impl<'c, T: Transport + 'static> CompletionQueue<'c, T> {
    pub(super) fn new(context: &'c Context<T>) -> Self {
        CompletionQueue {
            context,
            members: Vec::new(),
            ready: VecDeque::new(),
        }
    }

    /// Whether this completion queue belongs to `context`.
    pub(super) fn belongs_to(&self, context: &Context<T>) -> bool {
        std::ptr::eq(self.context, context)
    }

    /// Takes the completion ring of a new queue pair.
    pub(super) fn adopt(&mut self, pair: u16, ring: CompletionRing, shared: Arc<PairShared>) {
        self.members.push(Member { pair, ring, shared });
    }

    /// Reaps what has arrived, without blocking: an iterator over the
    /// completions ready, oldest first. Completions the iterator does not
    /// reach stay queued for the next call.
    pub fn poll(&mut self) -> Result<Completions<'_>, VerbsError> {
        self.reap()?;
        Ok(Completions {
            ready: &mut self.ready,
        })
    }

    /// Reaps what has arrived, without blocking, and appends every
    /// completion ready to `out`; returns how many were appended.
    pub fn poll_into(&mut self, out: &mut Vec<Completion>) -> Result<usize, VerbsError> {
        self.reap()?;
        let count = self.ready.len();
        out.extend(self.ready.drain(..));
        Ok(count)
    }

    /// Waits until at least one completion is ready (or `timeout` passes:
    /// [`VerbsError::Timeout`]; or the device closes its connection, its
    /// process gone: [`VerbsError::HungUp`] at once, since no completion
    /// can come), then yields those ready, as [`poll`](Self::poll) does.
    /// Polls for the context's [`spin`](super::ContextConfig::spin) first,
    /// then sleeps on the completion rings' eventfds.
    pub fn wait(&mut self, timeout: Duration) -> Result<Completions<'_>, VerbsError> {
        let spin = self.context.spin;
        wait_for(self, spin, timeout)?;
        Ok(Completions {
            ready: &mut self.ready,
        })
    }

    /// Completions reaped and not handed out yet.
    pub fn ready(&self) -> usize {
        self.ready.len()
    }

    /// How many queue pairs' completion rings this queue holds (those of
    /// dropped queue pairs included until their last completion is reaped).
    pub fn rings(&self) -> usize {
        self.members.len()
    }

    /// Moves what every ring has received into `ready`; gives back the
    /// rings of dropped queue pairs whose last completion has arrived.
    fn reap(&mut self) -> Result<(), VerbsError> {
        let transport = &*self.context.transport;
        let mut drained = Vec::new();
        for (at, member) in self.members.iter_mut().enumerate() {
            let ready = &mut self.ready;
            let shared = &member.shared;
            let mut last = false;
            member.ring.pump(transport, |completion| {
                // The marker is read per NOP: the queue pair may be
                // dropped, and post it, while this ring is pumped.
                let marker = match completion.opcode {
                    Some(Opcode::Nop) => shared.retire_marker(),
                    _ => None,
                };
                if marker.is_some_and(|marker| is_marker(&completion, marker)) {
                    last = true;
                } else {
                    ready.push_back(completion);
                }
            })?;
            if last {
                drained.push(at);
            } else if shared.marker_unposted() {
                // A marker a full ring kept out goes once there is room.
                self.context.post_unposted_marker(member.pair, shared);
            }
        }
        for at in drained.into_iter().rev() {
            let member = self.members.swap_remove(at);
            self.context
                .return_completion_ring(member.pair, member.ring);
        }
        Ok(())
    }
}

/// Whether `completion` is the end marker `marker` of a retired queue pair.
pub(super) fn is_marker(completion: &Completion, marker: u64) -> bool {
    completion.user_data == marker && completion.opcode == Some(Opcode::Nop)
}

impl<T: Transport + 'static> Awaiting for CompletionQueue<'_, T> {
    fn try_complete(&mut self) -> Result<bool, VerbsError> {
        if self.ready.is_empty() {
            self.reap()?;
        }
        Ok(!self.ready.is_empty())
    }

    fn rings(&mut self) -> Vec<&mut CompletionRing> {
        self.members
            .iter_mut()
            .map(|member| &mut member.ring)
            .collect()
    }

    fn hangup_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.context.transport.hangup_fd()
    }
}

impl<T: Transport + 'static> Drop for CompletionQueue<'_, T> {
    fn drop(&mut self) {
        for member in self.members.drain(..) {
            self.context
                .return_completion_ring(member.pair, member.ring);
        }
    }
}

impl<T: Transport + 'static> std::fmt::Debug for CompletionQueue<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompletionQueue")
            .field(
                "pairs",
                &self.members.iter().map(|m| m.pair).collect::<Vec<_>>(),
            )
            .field("ready", &self.ready.len())
            .finish()
    }
}

/// Completions ready on a [`CompletionQueue`], oldest first; each one taken
/// from the iterator leaves the queue, the rest stay queued.
#[derive(Debug)]
pub struct Completions<'a> {
    ready: &'a mut VecDeque<Completion>,
}

impl Iterator for Completions<'_> {
    type Item = Completion;

    fn next(&mut self) -> Option<Completion> {
        self.ready.pop_front()
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.ready.len(), Some(self.ready.len()))
    }
}

impl ExactSizeIterator for Completions<'_> {}
