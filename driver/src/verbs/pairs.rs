//! The port's RDMA queue pairs on the driver side: setting up a pair's two
//! rings, handing them to a [`QueuePair`] and its [`CompletionQueue`], and
//! taking them back when both are done with them.
//!
//! A pair's rings are set up the first time a queue pair needs them (or,
//! when the transport allows no set-up once the device runs, all when the
//! context opens) and stay set up for the context's life. A queue pair that
//! is dropped posts a signalled NOP with a marker value last; the
//! completion queue gives the completion ring back when the marker arrives
//! (every earlier completion of the pair has arrived by then, since the
//! device completes a pair's requests in order), or when it is dropped
//! itself. Before idle rings serve a new queue pair they are flushed the
//! same way: a marker NOP, and every completion up to it discarded, so that
//! nothing of the old queue pair reaches the new one.
//!
//! A marker is told apart from the program's own NOPs by its user data
//! alone, so marker values must be ones a program does not post: they
//! count on from a random 64-bit start chosen when the context opens,
//! which no program value meets but by a 2^-64 chance (a fixed range,
//! say the top 16 bits set, is one a program may well use for its own
//! sentinels, and then its NOP ended a flush early and let the old queue
//! pair's later completions through).
//!
//! A queue pair dropped with its send ring full cannot post its marker at
//! once: the device is still taking its requests, or has stopped with the
//! completion ring full behind it. The marker then waits, and the
//! completion queue tries to post it each time it reaps, until the device
//! has taken requests and made room. Flushing rings that a full queue pair
//! left discards completions while it waits for room for its marker, for
//! the same reason.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pindown_uapi::{Operation, RingLayout, WorkRequest, WrFlags};

use super::completion::{is_marker, CompletionRing};
use super::queue_pair::{InlineSource, SendRing};
use super::wait::{wait_for_control, Awaiting};
use super::{CompletionQueue, Context, QueuePair, VerbsError};
use crate::arena::DmaArena;
use crate::rdma_queue::{self, SendQueue};
use crate::transport::Transport;

/// What a queue pair and its completion queue share.
#[derive(Debug, Default)]
pub(super) struct PairShared {
    /// The user data of the marker NOP the queue pair posts last, when it
    /// is dropped (posted then, or later: `marker_unposted`); 0 while it
    /// lives. Never 0 otherwise ([`first_marker`]).
    retire_marker: AtomicU64,
    /// Set while the retire marker waits to be posted: the queue pair was
    /// dropped with its send ring full. The completion queue posts it
    /// ([`Context::post_unposted_marker`]) whenever it reaps, until there
    /// is room.
    marker_unposted: AtomicBool,
}

impl PairShared {
    /// Whether the retire marker still waits to be posted.
    pub(super) fn marker_unposted(&self) -> bool {
        self.marker_unposted.load(Ordering::Acquire)
    }

    /// The marker the dropped queue pair posts last, if it is dropped.
    pub(super) fn retire_marker(&self) -> Option<u64> {
        match self.retire_marker.load(Ordering::Acquire) {
            0 => None,
            marker => Some(marker),
        }
    }
}

/// Where a context's marker values start: random, so that no value a
/// program posts is taken for one (see the module's text).
pub(super) fn first_marker() -> u64 {
    use std::hash::BuildHasher;
    // The standard library seeds its hashers from the operating system's
    // random source.
    std::collections::hash_map::RandomState::new().hash_one(0x6d61_726b_u64)
}

/// One I/O pair of the port, as the context sees it.
pub(super) enum PairSlot {
    /// Its rings are not set up yet.
    Unused,
    /// Set up and free; `fresh`: never used, nothing to flush.
    Idle {
        send: SendRing,
        completion: CompletionRing,
        fresh: bool,
    },
    /// Held by a queue pair and a completion queue; each half comes back
    /// here when they let it go.
    Held {
        send: Option<SendRing>,
        completion: Option<CompletionRing>,
    },
}

/// The context's I/O pairs (pair `1 + i` is `slots[i]`).
pub(super) struct PairPool {
    pub(super) slots: Vec<PairSlot>,
}

/// Sets up the two rings of RDMA queue pair `pair` (not enabled yet): the
/// send and completion queues in `arena` (see [`crate::rdma_queue`]),
/// mapped for the device by the transport.
pub(super) fn set_up_pair<T: Transport>(
    transport: &T,
    arena: &Arc<DmaArena>,
    layout: RingLayout,
    pair: u16,
    size: u16,
) -> Result<(SendRing, CompletionRing), VerbsError> {
    let send_index = layout.send_queue(pair);
    let completion_index = layout.completion_queue(pair);
    let send_queue = SendQueue::new(arena, size)?;
    transport.setup_queue(send_index, &send_queue.layout())?;
    let completion_queue = rdma_queue::CompletionQueue::new(arena, size)?;
    transport.setup_queue(completion_index, &completion_queue.layout())?;
    let event = transport.completion_event(completion_index)?;
    Ok((
        SendRing::new(send_index, send_queue),
        CompletionRing {
            index: completion_index,
            queue: completion_queue,
            event,
        },
    ))
}

/// Enables a pair's rings.
pub(super) fn start_pair<T: Transport>(
    transport: &T,
    send: &SendRing,
    completion: &CompletionRing,
) -> Result<(), VerbsError> {
    transport.enable_queue(completion.index, true)?;
    transport.enable_queue(send.index, true)?;
    Ok(())
}

/// A pair's rings being flushed: completions are discarded up to the
/// marker.
struct Flush<'a, T: Transport> {
    transport: &'a T,
    ring: &'a mut CompletionRing,
    marker: u64,
}

impl<T: Transport> Awaiting for Flush<'_, T> {
    fn try_complete(&mut self) -> Result<bool, VerbsError> {
        let marker = self.marker;
        let mut found = false;
        self.ring.pump(self.transport, |completion| {
            found |= is_marker(&completion, marker);
        })?;
        Ok(found)
    }

    fn rings(&mut self) -> Vec<&mut CompletionRing> {
        vec![&mut *self.ring]
    }

    fn hangup_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.transport.hangup_fd()
    }
}

impl<T: Transport + 'static> Context<T> {
    /// A completion queue with no queue pair yet; create queue pairs with
    /// it ([`create_queue_pair`](Self::create_queue_pair)).
    pub fn create_completion_queue(&self) -> CompletionQueue<'_, T> {
        CompletionQueue::new(self)
    }

    /// A queue pair on one of the port's I/O pairs, whose completions
    /// arrive on `cq` (several queue pairs may share one completion queue).
    ///
    /// Fails with [`VerbsError::NoQueuePair`] when every I/O pair is held,
    /// and with [`VerbsError::OtherContext`] when `cq` belongs to another
    /// context. Reusing the rings of an earlier queue pair waits (at most
    /// [`control_timeout`](super::ContextConfig::control_timeout)) until the
    /// device has finished its requests.
    pub fn create_queue_pair(
        &self,
        cq: &mut CompletionQueue<'_, T>,
    ) -> Result<QueuePair<'_, T>, VerbsError> {
        if !cq.belongs_to(self) {
            return Err(VerbsError::OtherContext {
                what: "completion queue",
            });
        }
        let (at, taken) = {
            let mut pool = self.pairs.lock();
            let Some(at) = pool
                .slots
                .iter()
                .position(|slot| matches!(slot, PairSlot::Idle { .. }))
                .or_else(|| {
                    pool.slots
                        .iter()
                        .position(|slot| matches!(slot, PairSlot::Unused))
                })
            else {
                return Err(VerbsError::NoQueuePair {
                    pairs: u16::try_from(pool.slots.len()).unwrap_or(u16::MAX),
                });
            };
            let held = PairSlot::Held {
                send: None,
                completion: None,
            };
            (at, std::mem::replace(&mut pool.slots[at], held))
        };
        let pair = u16::try_from(at + 1).expect("at most MAX_RDMA_QUEUE_PAIRS pairs");
        let prepared = match taken {
            PairSlot::Idle {
                mut send,
                mut completion,
                fresh,
            } => {
                let flushed = if fresh {
                    Ok(())
                } else {
                    self.flush(&mut send, &mut completion)
                };
                match flushed {
                    Ok(()) => Ok((send, completion)),
                    Err(err) => {
                        self.pairs.lock().slots[at] = PairSlot::Idle {
                            send,
                            completion,
                            fresh: false,
                        };
                        Err(err)
                    }
                }
            }
            _ => set_up_pair(
                &*self.transport,
                &self.arena,
                self.layout,
                pair,
                self.queue_size,
            )
            .and_then(|(send, completion)| {
                start_pair(&*self.transport, &send, &completion)?;
                Ok((send, completion))
            })
            .inspect_err(|_| self.pairs.lock().slots[at] = PairSlot::Unused),
        };
        let (send, completion) = prepared?;
        let shared = Arc::new(PairShared::default());
        cq.adopt(pair, completion, Arc::clone(&shared));
        Ok(QueuePair::new(self, pair, send, shared))
    }

    /// A marker value no earlier marker of this context had (never 0).
    fn next_marker(&self) -> u64 {
        loop {
            let marker = self.markers.fetch_add(1, Ordering::Relaxed);
            if marker != 0 {
                return marker;
            }
        }
    }

    /// Posts a marker NOP on `send` and discards every completion up to it,
    /// all within the control timeout. While the send ring is full (its
    /// last queue pair left it so), the completions that arrive are
    /// discarded until the device, with room to complete again, takes
    /// requests and frees a slot.
    fn flush(
        &self,
        send: &mut SendRing,
        completion: &mut CompletionRing,
    ) -> Result<(), VerbsError> {
        let marker = self.next_marker();
        let start = Instant::now();
        let mut tries = 0u32;
        loop {
            match post_marker(&*self.transport, &self.arena, send, marker) {
                Ok(()) => break,
                Err(VerbsError::QueueFull { .. }) => {}
                Err(err) => return Err(err),
            }
            completion.pump(&*self.transport, drop)?;
            if start.elapsed() >= self.control_timeout {
                return Err(VerbsError::ControlTimeout {
                    operation: pindown_uapi::Opcode::Nop,
                    timeout: self.control_timeout,
                });
            }
            if self.device_hung_up()? {
                return Err(VerbsError::DeviceGone {
                    operation: pindown_uapi::Opcode::Nop,
                });
            }
            tries += 1;
            if tries < 100 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        let mut flush = Flush {
            transport: &*self.transport,
            ring: completion,
            marker,
        };
        wait_for_control(
            &mut flush,
            self.spin,
            self.control_timeout.saturating_sub(start.elapsed()),
            pindown_uapi::Opcode::Nop,
        )
    }

    /// Takes back the send ring of a dropped queue pair, after posting its
    /// marker (which tells the completion queue when the pair's last
    /// completion has arrived). A full ring leaves the marker to
    /// [`post_unposted_marker`](Self::post_unposted_marker).
    pub(super) fn return_send_ring(&self, pair: u16, mut send: SendRing, shared: &PairShared) {
        let marker = self.next_marker();
        shared.retire_marker.store(marker, Ordering::Release);
        // A device gone: no marker; the completion ring then comes back
        // when its completion queue is dropped.
        let full = matches!(
            post_marker(&*self.transport, &self.arena, &mut send, marker),
            Err(VerbsError::QueueFull { .. })
        );
        shared.marker_unposted.store(full, Ordering::Release);
        self.put_back(pair, Some(send), None);
        if full {
            // The completion queue may have reaped, and made room, before
            // the ring was back.
            self.post_unposted_marker(pair, shared);
        }
    }

    /// Posts the retire marker of pair `pair` if its queue pair was dropped
    /// with a full send ring and there is room now.
    pub(super) fn post_unposted_marker(&self, pair: u16, shared: &PairShared) {
        let mut pool = self.pairs.lock();
        let Some(PairSlot::Held {
            send: Some(send), ..
        }) = pool.slots.get_mut(usize::from(pair) - 1)
        else {
            return;
        };
        if !shared.marker_unposted() {
            return;
        }
        let marker = shared.retire_marker.load(Ordering::Acquire);
        match post_marker(&*self.transport, &self.arena, send, marker) {
            Err(VerbsError::QueueFull { .. }) => {}
            _ => shared.marker_unposted.store(false, Ordering::Release),
        }
    }

    /// Takes back the completion ring of pair `pair` from a completion
    /// queue.
    pub(super) fn return_completion_ring(&self, pair: u16, completion: CompletionRing) {
        self.put_back(pair, None, Some(completion));
    }

    fn put_back(&self, pair: u16, send: Option<SendRing>, completion: Option<CompletionRing>) {
        let mut pool = self.pairs.lock();
        let Some(slot) = pool.slots.get_mut(usize::from(pair) - 1) else {
            return;
        };
        let PairSlot::Held {
            send: held_send,
            completion: held_completion,
        } = slot
        else {
            return;
        };
        if send.is_some() {
            *held_send = send;
        }
        if completion.is_some() {
            *held_completion = completion;
        }
        if held_send.is_some() && held_completion.is_some() {
            let (Some(send), Some(completion)) = (held_send.take(), held_completion.take()) else {
                unreachable!("both checked present");
            };
            *slot = PairSlot::Idle {
                send,
                completion,
                fresh: false,
            };
        }
    }
}

/// Posts a signalled NOP carrying `marker` on `send`.
fn post_marker<T: Transport>(
    transport: &T,
    arena: &DmaArena,
    send: &mut SendRing,
    marker: u64,
) -> Result<(), VerbsError> {
    let nop = WorkRequest {
        user_data: marker,
        flags: WrFlags::SIGNALED,
        op: Operation::Nop,
    };
    send.post(transport, arena, 1, |_| (nop, InlineSource::None, &[][..]))
}
