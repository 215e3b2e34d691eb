//! Serving one RDMA queue pair of a port (a port has several, each with a
//! [`SendQueue`] of its own; their requests run independently): takes work
//! requests from the pair's send queue, in order and one at a time (so a FENCE is always
//! honoured), runs each with [`rdma::execute`](crate::rdma::execute)
//! through the [`PortFabric`] over the device's ports, and writes the
//! completions into the pair's completion queue.
//!
//! Every port's memory and windows live once, in its
//! [`PortShared`], behind the port's access gate; the ring work is one
//! guarded step on the port's own gate, and the request runs in steps of
//! its own. A completion waits here when the completion queue has no free
//! buffer; no new request is taken until the driver posts buffers and
//! kicks the completion queue.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pindown_uapi::{
    Completion, DeviceInfo, ErrorDetail, Status, WorkRequest, WrFlags, ABI_VERSION, RDMA_FEATURES,
};

use crate::fabric::PortFabric;
use crate::memory::PortMemory;
use crate::port::{Port, PortShared, PortState, PortTable};
use crate::queues::{self, ChainError, Pop, Vring};
use crate::rdma::{Progress, Turn};

/// How long a request waits for the frontend to map its local memory
/// before it completes with a local protection error.
const MISS_PATIENCE: Duration = Duration::from_millis(500);

/// The RDMA rings of a port, borrowed apart from its memory.
struct Rings<'a> {
    vrings: &'a mut [Vring],
    sq: usize,
    cq: usize,
    port: usize,
    /// The frontend maps memory when the device asks (QEMU for a guest,
    /// whose vIOMMU answers IOTLB misses): wait for it instead of failing.
    lazy_iotlb: bool,
    /// The device busy-polls: the driver need not ring doorbells.
    polling: bool,
}

/// One RDMA queue pair (send and completion queue) of a port, while one
/// frontend connection lasts.
#[derive(Debug)]
pub struct SendQueue {
    /// The RDMA queue pair served (see [`pindown_uapi::RingLayout`]).
    pair: u16,
    /// Completions waiting for a completion-queue buffer.
    pending: VecDeque<Completion>,
    /// The port served.
    port: Arc<Port>,
    /// The device busy-polls: the driver need not ring doorbells.
    polling: bool,
    /// Since when the running request has waited for its local memory to
    /// be mapped.
    waiting_since: Option<Instant>,
    /// The request taken from the send queue and not complete yet.
    running: Option<Running>,
}

impl SendQueue {
    /// RDMA queue pair `pair` of `port`, nothing pending (`polling`: the
    /// device busy-polls the rings, see
    /// [`DeviceConfig::poll`](crate::DeviceConfig::poll)).
    pub fn new(port: Arc<Port>, pair: u16, polling: bool) -> Self {
        SendQueue {
            pair,
            pending: VecDeque::new(),
            port,
            polling,
            waiting_since: None,
            running: None,
        }
    }

    /// Writes pending completions into completion-queue buffers, in one
    /// guarded step on the port's gate. Returns whether any buffer was used.
    fn flush_step(&mut self, rings: &mut Rings<'_>, port: &Port) -> bool {
        let state = port.shared.access();
        match state.memory.as_ref() {
            Some(memory) => self.flush(rings, memory, &port.shared),
            None => false,
        }
    }

    /// Writes pending completions into completion-queue buffers. Returns
    /// whether any buffer was used.
    fn flush(&mut self, rings: &mut Rings<'_>, memory: &PortMemory, port: &PortShared) -> bool {
        let mut used = false;
        while let Some(completion) = self.pending.front() {
            let ring = &mut rings.vrings[rings.cq];
            if !ring.active() {
                break;
            }
            match queues::pop_chain(ring, memory) {
                Pop::Chain(chain) => {
                    let written = queues::write_chain(memory, &chain, &completion.encode());
                    match written {
                        Ok(n) => {
                            let _ = ring.add_used(memory, chain.head, n as u32);
                            self.pending.pop_front();
                        }
                        Err(ChainError::Miss(miss)) => {
                            ring.rewind();
                            port.note_miss(miss);
                            break;
                        }
                        Err(error) => {
                            if let ChainError::Denied(denied) = &error {
                                port.note_miss_of(*denied);
                            }
                            // A buffer the device cannot write: give it back
                            // empty and try the next one.
                            tracing::debug!(port = rings.port, "bad completion buffer: {error}");
                            let _ = ring.add_used(memory, chain.head, 0);
                        }
                    }
                    used = true;
                }
                Pop::Empty => {
                    // Ask for a kick when the driver posts buffers.
                    if let Ok(true) = ring.queue_enable_notification(memory) {
                        continue;
                    }
                    break;
                }
                Pop::Miss(miss) => {
                    port.note_miss(miss);
                    break;
                }
                Pop::Broken(error) => {
                    ring.break_off(rings.port, &error);
                    break;
                }
            }
        }
        used
    }

    /// Takes the next request from the send queue, in one guarded step on
    /// the port's own gate.
    fn take(&mut self, rings: &mut Rings<'_>, port: &Port) -> Taken {
        let state = port.shared.access();
        let Some(memory) = state.memory.as_ref() else {
            return Taken::Nothing;
        };
        let ring = &mut rings.vrings[rings.sq];
        let chain = match queues::pop_chain(ring, memory) {
            Pop::Chain(chain) => chain,
            // Polling, the device sees new requests without doorbells;
            // otherwise ask for one, and go on if requests came meanwhile.
            Pop::Empty if rings.polling => return Taken::Nothing,
            Pop::Empty => {
                return match ring.queue_enable_notification(memory) {
                    Ok(true) => Taken::Again,
                    _ => Taken::Nothing,
                }
            }
            Pop::Miss(miss) => {
                port.shared.note_miss(miss);
                return Taken::Nothing;
            }
            Pop::Broken(error) => {
                ring.break_off(rings.port, &error);
                return Taken::Nothing;
            }
        };
        let _ = ring.queue_disable_notification(memory);
        match queues::read_chain(memory, &chain, WorkRequest::SIZE) {
            Ok(bytes) => match WorkRequest::decode(&bytes) {
                Ok(request) => Taken::Request(Running {
                    head: chain.head,
                    request,
                    progress: Progress::default(),
                }),
                Err(error) => {
                    tracing::debug!(port = rings.port, "malformed work request: {error}");
                    Taken::Malformed(chain.head, malformed(&bytes))
                }
            },
            Err(ChainError::Miss(miss)) => {
                ring.rewind();
                port.shared.note_miss(miss);
                Taken::Nothing
            }
            Err(error) => {
                if let ChainError::Denied(denied) = &error {
                    port.shared.note_miss_of(*denied);
                }
                tracing::debug!(port = rings.port, "unreadable work request: {error}");
                Taken::Malformed(chain.head, malformed(&[]))
            }
        }
    }

    /// Runs one turn of the running request (outside the port's gate, in
    /// steps of its own, so that a request may revoke one of the port's
    /// windows: a barrier on the same gate).
    fn advance(
        &mut self,
        rings: &mut Rings<'_>,
        info: DeviceInfo,
        fabric: &PortFabric<'_>,
    ) -> Advanced {
        let Some(running) = self.running.as_mut() else {
            return Advanced::Completed;
        };
        let (turn, own_miss) = fabric.execute(info, &running.request, &mut running.progress);
        let done = match turn {
            Turn::Paused => return Advanced::Paused,
            Turn::Done(done) => done,
        };
        if done.status == Status::LocalProtectionError && rings.lazy_iotlb && own_miss.is_some() {
            // The failed step moved nothing (a step checks all it touches
            // before it copies) and the request keeps its progress: take
            // the same step again once the frontend maps the memory.
            let since = *self.waiting_since.get_or_insert_with(Instant::now);
            if since.elapsed() < MISS_PATIENCE {
                rings.vrings[rings.sq].waiting_iotlb = true;
                return Advanced::Waiting;
            }
        }
        self.waiting_since = None;
        let running = self.running.take().expect("a running request");
        let signaled = running.request.flags.contains(WrFlags::SIGNALED);
        self.finish(
            rings,
            running.head,
            (signaled || !done.is_success()).then_some(done),
        );
        Advanced::Completed
    }

    /// Gives chain `head` back to the driver and queues its completion.
    fn finish(&mut self, rings: &mut Rings<'_>, head: u16, completion: Option<Completion>) {
        let state = self.port.shared.access();
        if let Some(memory) = state.memory.as_ref() {
            let _ = rings.vrings[rings.sq].add_used(memory, head, 0);
        }
        self.pending.extend(completion);
    }
}

/// A request taken from the send queue and not complete yet.
#[derive(Debug)]
struct Running {
    /// Its chain in the send queue, given back when it completes.
    head: u16,
    request: WorkRequest,
    progress: Progress,
}

/// What taking a request from the send queue found.
enum Taken {
    /// A request to run.
    Request(Running),
    /// A chain that holds no valid request: its error completion.
    Malformed(u16, Completion),
    /// Requests arrived while notifications were being enabled: look again.
    Again,
    /// Nothing to take now.
    Nothing,
}

/// What a turn of the running request did.
enum Advanced {
    /// It completed (its completion is pending, if it has one).
    Completed,
    /// A transfer used its turn and goes on at the next.
    Paused,
    /// It waits for the frontend to map its local memory.
    Waiting,
}

/// What serving the queues did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Served {
    /// Something was done (a request taken or advanced, a completion
    /// written): keeps an adaptively polling port hot.
    pub worked: bool,
    /// Work is left that needs no kick (a transfer paused, or the turn's
    /// request budget was used): serve again soon.
    pub more: bool,
}

/// Requests taken in one turn before the port's thread does other work.
const REQUESTS_PER_TURN: usize = 64;

/// The error completion of a request that did not decode; its user data if
/// the bytes hold one.
fn malformed(bytes: &[u8]) -> Completion {
    let user_data = bytes
        .get(8..16)
        .map(|b| u64::from_le_bytes(b.try_into().expect("eight bytes")))
        .unwrap_or(0);
    Completion::error(
        user_data,
        None,
        Status::InvalidRequest,
        ErrorDetail::Malformed,
    )
}

impl SendQueue {
    /// Serves the queues after a kick of either ring (or a polling pass):
    /// writes waiting completions, then runs requests while completions
    /// have room, for one turn (at most [`REQUESTS_PER_TURN`] requests, a
    /// transfer at most [`STEPS_PER_TURN`](crate::rdma::STEPS_PER_TURN)
    /// steps), so that the port's thread answers its frontend between
    /// turns. `state` is the served port's state, whose lock the caller
    /// holds; peers are looked up in `ports` and reached through their
    /// access gates only, never their locks.
    pub fn serve(&mut self, state: &mut PortState, ports: &PortTable) -> Served {
        let port = Arc::clone(&self.port);
        let layout = state.layout();
        let sq = usize::from(layout.send_queue(self.pair));
        let cq = usize::from(layout.completion_queue(self.pair));
        let index = state.index;
        let PortState { vrings, guest, .. } = state;
        let mut rings = Rings {
            vrings,
            sq,
            cq,
            port: index,
            lazy_iotlb: *guest,
            polling: self.polling,
        };
        let info = DeviceInfo {
            port: index as u16,
            abi_version: ABI_VERSION,
            features: RDMA_FEATURES,
            rdma_queue_pairs: layout.rdma_queue_pairs,
        };
        rings.vrings[sq].waiting_iotlb = false;
        if !rings.vrings[sq].active() {
            // The frontend stopped or reset the ring: what it had posted
            // is no longer ours to complete.
            self.running = None;
            self.waiting_since = None;
        }
        let fabric = PortFabric::new(ports, &port);
        let mut served = Served {
            worked: self.flush_step(&mut rings, &port),
            more: false,
        };
        let mut budget = REQUESTS_PER_TURN;
        while self.pending.is_empty() && rings.vrings[sq].active() {
            if budget == 0 {
                served.more = true;
                break;
            }
            budget -= 1;
            if self.running.is_none() {
                match self.take(&mut rings, &port) {
                    Taken::Request(running) => self.running = Some(running),
                    Taken::Malformed(head, completion) => {
                        self.finish(&mut rings, head, Some(completion));
                        served.worked = true;
                        self.flush_step(&mut rings, &port);
                        continue;
                    }
                    Taken::Again => continue,
                    Taken::Nothing => break,
                }
            }
            served.worked = true;
            match self.advance(&mut rings, info, &fabric) {
                Advanced::Completed => {
                    self.flush_step(&mut rings, &port);
                }
                Advanced::Paused => {
                    served.more = true;
                    break;
                }
                Advanced::Waiting => break,
            }
        }
        let shared = port.shared.access();
        if let Some(memory) = shared.memory.as_ref() {
            rings.vrings[sq].notify(memory);
            rings.vrings[cq].notify(memory);
        }
        served
    }
}
