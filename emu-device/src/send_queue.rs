//! Serving one RDMA queue pair of a port (the format of
//! [`pindown_uapi::queue`]; a port has several pairs, each with a
//! [`SendQueue`] of its own, and their requests run independently): takes
//! work requests from the pair's send queue, in order and one at a time
//! (so a FENCE is always honoured), runs each with
//! [`rdma::execute`](crate::rdma::execute) through the [`PortFabric`] over
//! the device's ports, and writes the completions in place into the pair's
//! completion queue.
//!
//! Every port's memory and windows live once, in its [`PortShared`](crate::port::PortShared),
//! behind the port's access gate; the ring work of a request (writing the
//! previous completion, taking the next request) is one guarded step on
//! the port's own gate, through ring memory translated once
//! ([`RingCache`]), and the request runs in steps of its own. A
//! completion waits here when the completion queue is full; no new
//! request is taken until the driver has consumed completions (and kicks
//! the completion queue, which the device asks for).
//!
//! Notifications: the driver is signalled (the completion queue's call
//! fd) only when it asked, before sleeping; the device asks for a kick
//! ([`SendQueue::arm`]) only when its thread is about to sleep. While both
//! sides poll, a request costs no system call.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pindown_uapi::{
    Completion, DeviceInfo, ErrorDetail, NodeId, Operation, Status, WorkRequest, WrFlags,
};
use pindown_uapi::{ABI_VERSION, ADMIN_QUEUE_PAIR, RDMA_FEATURES};

use crate::inbox::{PostedAt, NOTICES_MAX};

use crate::fabric::PortFabric;
use crate::internode::{Link, Submission};
use crate::port::{Port, PortState, PortTable};
use crate::queues::{Signal, Vring};
use crate::rdma::{Progress, Turn};
use crate::rdma_rings::{RingCache, RingFault, RingsView, Slot};

/// How long a request waits for the frontend to map its local memory
/// before it completes with a local protection error.
const MISS_PATIENCE: Duration = Duration::from_millis(500);

/// One RDMA queue pair (send and completion queue) of a port, while one
/// frontend connection lasts.
#[derive(Debug)]
pub struct SendQueue {
    /// The RDMA queue pair served (see [`pindown_uapi::RingLayout`]).
    pair: u16,
    /// Completions waiting for room in the completion queue.
    pending: VecDeque<Completion>,
    /// The port served.
    port: Arc<Port>,
    /// The rings' memory, translated once.
    rings: RingCache,
    /// The completion queue's consumed index, as last read.
    consumed: u16,
    /// Completion position when the driver's call event was last looked
    /// at.
    called_at: u16,
    /// Since when the running request has waited for its local memory to
    /// be mapped.
    waiting_since: Option<Instant>,
    /// The request taken from the send queue and not complete yet.
    running: Option<Running>,
    /// The inline bytes of the request taken last (reused).
    inline: Vec<u8>,
    /// The requests handed to the fabric link whose completions have not
    /// come back yet, oldest first, of this epoch and of earlier ones
    /// (all of them count against [`MAX_IN_FLIGHT`]).
    on_link: VecDeque<PostedAt>,
    /// The send queue's epoch: a new one begins with each connection, and
    /// when the frontend resets the queue while requests are on the link
    /// (see [`PostedAt`]).
    epoch: u32,
    /// The send queue's stop count ([`Vring::stops`]) last seen.
    stops_seen: u32,
    /// The send queue stopped since it was last served: when it runs
    /// again, a position other than [`left_at`](Self::left_at) is a reset.
    restarting: bool,
    /// The send queue's position when it was last served running.
    left_at: u16,
    /// The port's incarnation last seen (RESET_OWNER makes a new one).
    incarnation_seen: u64,
    /// The retired position last stored in the device record (see
    /// [`pindown_uapi::queue::Record::RETIRED`]); `None` when the rings
    /// (re)start.
    retired: Option<u16>,
}

impl Drop for SendQueue {
    /// The connection ended: what the pair had in flight is no longer
    /// the device's to finish.
    fn drop(&mut self) {
        if let Some(count) = self.port.stats.in_flight.of(self.pair) {
            count.store(0, Ordering::Relaxed);
        }
    }
}

/// A request taken from the send queue and not complete yet.
#[derive(Debug)]
struct Running {
    /// Its position in the send queue.
    position: u16,
    request: WorkRequest,
    /// The bytes of a WRITE_INLINE.
    inline: Vec<u8>,
    progress: Progress,
}

/// What a turn of the running request did.
enum Advanced {
    /// It completed (its completion is pending, if it has one).
    Completed,
    /// A transfer used its turn and goes on at the next.
    Paused,
    /// It waits for the frontend to map its local memory.
    Waiting,
    /// It is fenced and waits for the pair's requests in flight on the
    /// fabric link (their completions wake the port).
    Fenced,
}

/// Requests of one queue pair in flight on the fabric link at most; the
/// pair takes no new request beyond (a completion wakes it).
pub const MAX_IN_FLIGHT: usize = 64;

/// The nodes a request's remote addresses name (none, one, or a copy's
/// two).
fn remote_nodes(op: &Operation) -> [Option<NodeId>; 2] {
    match op {
        Operation::Write { remote, .. }
        | Operation::Read { remote, .. }
        | Operation::WriteInline { remote, .. }
        | Operation::CompareSwap { remote, .. }
        | Operation::FetchAdd { remote, .. }
        | Operation::Swap { remote, .. }
        | Operation::FetchBitwise { remote, .. } => [Some(remote.node), None],
        Operation::VectorWrite(vector) | Operation::VectorRead(vector) => {
            [Some(vector.remote.node), None]
        }
        Operation::Copy {
            source,
            destination,
            ..
        } => [Some(source.node), Some(destination.node)],
        Operation::AtomicTo {
            word, destination, ..
        } => [Some(word.node), Some(destination.node)],
        Operation::Nop
        | Operation::Query
        | Operation::BindWindow { .. }
        | Operation::RevokeWindow { .. } => [None, None],
    }
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
    /// A transfer longer than one turn paused (and goes on at the next).
    pub paused: bool,
}

/// Requests taken in one turn before the port's thread does other work.
pub const REQUESTS_PER_TURN: usize = 64;

/// The error completion of a request whose bytes did not decode.
fn malformed(user_data: u64) -> Completion {
    Completion::error(
        user_data,
        None,
        Status::InvalidRequest,
        ErrorDetail::Malformed,
    )
}

/// What the ring step found to do next.
enum Next {
    /// Run the request taken.
    Run,
    /// Nothing to run now.
    Stop,
}

impl SendQueue {
    /// RDMA queue pair `pair` of `port`, nothing pending.
    pub fn new(port: Arc<Port>, pair: u16) -> Self {
        let epoch = port.posted_epochs.begin(pair);
        SendQueue {
            pair,
            pending: VecDeque::new(),
            port,
            rings: RingCache::default(),
            consumed: 0,
            called_at: 0,
            waiting_since: None,
            running: None,
            inline: Vec::with_capacity(pindown_uapi::queue::MAX_INLINE as usize),
            on_link: VecDeque::new(),
            epoch,
            stops_seen: 0,
            restarting: false,
            left_at: 0,
            incarnation_seen: 0,
            retired: None,
        }
    }

    /// The indices of the pair's send and completion queues.
    pub fn rings_of(&self, state: &PortState) -> (usize, usize) {
        let layout = state.layout();
        (
            usize::from(layout.send_queue(self.pair)),
            usize::from(layout.completion_queue(self.pair)),
        )
    }

    /// Serves the queues after a kick of either ring (or a polling pass):
    /// writes waiting completions, then runs requests while completions
    /// have room, for one turn (at most [`REQUESTS_PER_TURN`] requests, a
    /// transfer at most [`STEPS_PER_TURN`](crate::rdma::STEPS_PER_TURN)
    /// steps), so that the port's thread answers its frontend between
    /// turns. `state` is the served port's state, whose lock the caller
    /// holds; peers are looked up in `ports` and reached through their
    /// access gates only, never their locks.
    pub fn serve(
        &mut self,
        state: &mut PortState,
        ports: &PortTable,
        link: Option<&Link>,
    ) -> Served {
        let served = self.serve_turn(state, ports, link);
        let (sq, _) = self.rings_of(state);
        if state.vrings[sq].active() {
            self.left_at = state.vrings[sq].position();
        }
        self.publish_in_flight();
        served
    }

    /// Requests taken and not finished: the running one, those on the
    /// fabric, and those whose completion waits for room.
    fn requests_in_flight(&self) -> usize {
        usize::from(self.running.is_some()) + self.on_link.len() + self.pending.len()
    }

    /// Tells the port's statistics how many requests are in flight.
    fn publish_in_flight(&self) {
        if let Some(count) = self.port.stats.in_flight.of(self.pair) {
            count.store(self.requests_in_flight() as u64, Ordering::Relaxed);
        }
    }

    /// [`serve`](Self::serve)'s work.
    fn serve_turn(
        &mut self,
        state: &mut PortState,
        ports: &PortTable,
        link: Option<&Link>,
    ) -> Served {
        let port = Arc::clone(&self.port);
        let (sq, cq) = self.rings_of(state);
        let index = state.index;
        let lazy_iotlb = state.guest;
        let info = DeviceInfo {
            port: index as u16,
            abi_version: ABI_VERSION,
            features: RDMA_FEATURES,
            rdma_queue_pairs: state.rdma_queue_pairs,
            node: port.node,
        };
        let incarnation = port.shared.incarnation();
        let vrings = &mut state.vrings;
        vrings[sq].waiting_iotlb = false;
        if incarnation != self.incarnation_seen {
            // RESET_OWNER: the rings are the next owner's.
            self.incarnation_seen = incarnation;
            self.forget_posted();
            self.restarting = false;
            self.stops_seen = vrings[sq].stops;
        }
        if vrings[sq].stops != self.stops_seen {
            // Stopped (and perhaps running again already): a pause until
            // the queue runs again where it stood, a reset if it does not.
            self.stops_seen = vrings[sq].stops;
            self.restarting = true;
            self.rings.clear();
            self.waiting_since = None;
            self.retired = None;
        }
        if !vrings[sq].active() {
            return Served::default();
        }
        if std::mem::take(&mut self.restarting) && vrings[sq].position() != self.left_at {
            self.forget_posted();
        }
        if !vrings[cq].active() {
            // Completions would have nowhere to go: requests wait until the
            // frontend starts (or restarts) the completion queue.
            return Served::default();
        }
        if self.pair == ADMIN_QUEUE_PAIR
            && port.inbox.notices_pending()
            && self.pending.len() < NOTICES_MAX
        {
            // Arrivals of vector writes into the port's windows go to the
            // admin completion queue, among its own completions.
            let notices = port.inbox.take_notices(NOTICES_MAX - self.pending.len());
            self.pending.extend(notices);
        }
        let mut served = Served::default();
        if port.inbox.completions_pending() {
            for done in port.inbox.take_completions(self.pair) {
                if let Some(at) = self.on_link.iter().position(|&at| at == done.at) {
                    self.on_link.remove(at);
                }
                served.worked = true;
                if done.at.epoch != self.epoch {
                    tracing::debug!(
                        port = port.index,
                        pair = self.pair,
                        user_data = done.completion.user_data,
                        "completion of a request posted before its send queue was reset, dropped"
                    );
                    continue;
                }
                if done.signaled || !done.completion.is_success() {
                    self.pending.push_back(done.completion);
                }
            }
        }
        let fabric = PortFabric::new(ports, &port);
        let mut budget = REQUESTS_PER_TURN;
        loop {
            let next = self.ring_step(vrings, sq, cq, &mut served, &mut budget);
            if !matches!(next, Next::Run) {
                break;
            }
            served.worked = true;
            match self.advance(&fabric, info, lazy_iotlb, link) {
                Advanced::Completed => {}
                Advanced::Fenced => break,
                Advanced::Paused => {
                    served.more = true;
                    served.paused = true;
                    break;
                }
                Advanced::Waiting => {
                    vrings[sq].waiting_iotlb = true;
                    break;
                }
            }
        }
        served
    }

    /// One guarded step on the port's own gate: writes the completions
    /// that wait, signals the driver if it asked, and takes the next
    /// request if there is room for its completion and budget left.
    fn ring_step(
        &mut self,
        vrings: &mut [Vring],
        sq: usize,
        cq: usize,
        served: &mut Served,
        budget: &mut usize,
    ) -> Next {
        let port = Arc::clone(&self.port);
        let gate = port.shared.access();
        let cq_tail = vrings[cq].position();
        let mut rings = std::mem::take(&mut self.rings);
        let next = match rings.view(&gate, &vrings[sq], &vrings[cq], cq_tail) {
            Ok(view) => self.ring_work(&view, vrings, sq, cq, served, budget),
            Err(RingFault::Miss(miss)) => {
                port.shared.note_miss(miss);
                vrings[sq].waiting_iotlb = true;
                Next::Stop
            }
            Err(RingFault::Broken { send_queue, reason }) => {
                let ring = if send_queue { sq } else { cq };
                // The running request pauses with the ring: set right
                // again where it stood, the queue goes on with it.
                vrings[ring].break_off(port.index, &reason);
                Next::Stop
            }
        };
        self.rings = rings;
        next
    }

    /// The ring work of [`ring_step`](Self::ring_step), through `view`.
    fn ring_work(
        &mut self,
        view: &RingsView<'_, '_>,
        vrings: &mut [Vring],
        sq: usize,
        cq: usize,
        served: &mut Served,
        budget: &mut usize,
    ) -> Next {
        loop {
            self.publish_retired(view, vrings[sq].position());
            served.worked |= self.flush(view, &mut vrings[cq]);
            if !self.pending.is_empty() {
                // The completion queue is full (the driver was asked to
                // kick it when it has consumed some), or stopped.
                return Next::Stop;
            }
            if self.running.is_some() {
                // A transfer that paused goes on.
                return Next::Run;
            }
            if *budget == 0 {
                served.more = true;
                return Next::Stop;
            }
            if self.on_link.len() >= MAX_IN_FLIGHT {
                // A completion from the fabric link wakes the port.
                return Next::Stop;
            }
            let head_before = vrings[sq].position();
            let (request, slots) = match view.take(head_before, &mut self.inline) {
                Slot::Empty => return Next::Stop,
                Slot::Taken { request, slots } => (request, slots),
            };
            *budget -= 1;
            served.worked = true;
            let head = head_before.wrapping_add(slots);
            vrings[sq].set_position(head);
            view.publish_head(head);
            match request {
                Ok(request) => {
                    // The request takes the bytes with their buffer; the
                    // buffer comes back when it completes here.
                    self.running = Some(Running {
                        position: head_before,
                        request,
                        inline: std::mem::take(&mut self.inline),
                        progress: Progress::default(),
                    });
                    return Next::Run;
                }
                Err((error, user_data)) => {
                    tracing::debug!(port = self.port.index, "malformed work request: {error}");
                    self.pending.push_back(malformed(user_data));
                }
            }
        }
    }

    /// The frontend reset the send queue (it runs again from another
    /// position than where it stopped, or the port has a new owner): what
    /// it had posted is no longer ours to complete.
    fn forget_posted(&mut self) {
        self.running = None;
        self.waiting_since = None;
        self.rings.clear();
        self.retired = None;
        if self.on_link.iter().any(|at| at.epoch == self.epoch) {
            // Their completions come later, and the restarted queue may
            // reuse their positions: a new epoch tells them apart. Once no
            // step on the port is in flight (the barrier), the link moves
            // no more of their data.
            self.epoch = self.epoch.wrapping_add(1);
            let _no_step_in_flight = self.port.shared.barrier();
            self.port.posted_epochs.publish(self.pair, self.epoch);
        }
        // Nor are the completions of its requests that wait for room
        // (arrival notices are the port's, not the queue's).
        self.pending
            .retain(|completion| completion.arrival_from.is_some());
    }

    /// Stores the retired position if it moved: the oldest request still
    /// running or on the fabric link, else `head`.
    fn publish_retired(&mut self, view: &RingsView<'_, '_>, head: u16) {
        let epoch = self.epoch;
        let unfinished = self
            .on_link
            .iter()
            .filter(|at| at.epoch == epoch)
            .map(|at| at.position);
        let running = self.running.as_ref().map(|running| running.position);
        let retired = unfinished
            .chain(running)
            .max_by_key(|&position| head.wrapping_sub(position))
            .unwrap_or(head);
        if self.retired != Some(retired) {
            view.publish_retired(retired);
            self.retired = Some(retired);
        }
    }

    /// Writes pending completions into the completion queue while it has
    /// room, and signals the driver if it asked. Returns whether any was
    /// written.
    fn flush(&mut self, view: &RingsView<'_, '_>, ring: &mut Vring) -> bool {
        let start = ring.position();
        let mut tail = start;
        while let Some(completion) = self.pending.front() {
            if !view.has_room(tail, &mut self.consumed) && !view.arm_room(tail, &mut self.consumed)
            {
                break;
            }
            view.complete(tail, completion);
            self.port.stats.work.count(completion);
            tail = tail.wrapping_add(1);
            self.pending.pop_front();
        }
        if tail == start {
            return false;
        }
        ring.set_position(tail);
        if view.call_needed(tail, self.called_at) {
            if let Some(call) = &ring.call {
                if let Signal::Failed(e) = call.signal() {
                    tracing::warn!(
                        ring = ring.index,
                        "call fd fails ({e}): no more interrupts on this ring until a new call fd is set"
                    );
                    ring.call = None;
                }
            }
        }
        self.called_at = tail;
        true
    }

    /// Runs one turn of the running request (outside the port's gate, in
    /// steps of its own, so that a request may revoke one of the port's
    /// windows: a barrier on the same gate).
    fn advance(
        &mut self,
        fabric: &PortFabric<'_>,
        info: DeviceInfo,
        lazy_iotlb: bool,
        link: Option<&Link>,
    ) -> Advanced {
        let Some(running) = self.running.as_mut() else {
            return Advanced::Completed;
        };
        let epoch = self.epoch;
        let earlier_on_link = self.on_link.iter().any(|at| at.epoch == epoch);
        if running.request.flags.contains(WrFlags::FENCE) && earlier_on_link {
            return Advanced::Fenced;
        }
        let nodes = remote_nodes(&running.request.op);
        if nodes.iter().flatten().any(|&node| node != info.node) {
            let running = self.running.take().expect("a running request");
            self.hand_over(running, nodes, link);
            return Advanced::Completed;
        }
        let (turn, own_miss) = fabric.execute(
            info,
            &running.request,
            &running.inline,
            &mut running.progress,
        );
        let done = match turn {
            Turn::Paused => return Advanced::Paused,
            Turn::Done(done) => done,
        };
        if done.status == Status::LocalProtectionError && lazy_iotlb && own_miss.is_some() {
            // The failed step moved nothing (a step checks all it touches
            // before it copies) and the request keeps its progress: take
            // the same step again once the frontend maps the memory.
            let since = *self.waiting_since.get_or_insert_with(Instant::now);
            if since.elapsed() < MISS_PATIENCE {
                return Advanced::Waiting;
            }
        }
        self.waiting_since = None;
        let running = self.running.take().expect("a running request");
        self.inline = running.inline;
        let signaled = running.request.flags.contains(WrFlags::SIGNALED);
        if signaled || !done.is_success() {
            self.pending.push_back(done);
        }
        Advanced::Completed
    }

    /// Hands a request that names `nodes`, one of them not this one, to
    /// the fabric link, or fails it.
    fn hand_over(&mut self, running: Running, nodes: [Option<NodeId>; 2], link: Option<&Link>) {
        let request = running.request;
        let refused = |detail| {
            let status = Status::InvalidRequest;
            Completion::error(request.user_data, Some(request.op.opcode()), status, detail)
        };
        match link {
            Some(link) if nodes.iter().flatten().all(|&node| link.knows(node)) => {
                let at = PostedAt {
                    pair: self.pair,
                    position: running.position,
                    epoch: self.epoch,
                };
                link.submit(Submission {
                    port: Arc::clone(&self.port),
                    at,
                    request,
                    inline: running.inline,
                });
                self.on_link.push_back(at);
            }
            _ => self.pending.push_back(refused(ErrorDetail::UnknownNode)),
        }
    }

    /// Before the port's thread sleeps: asks the driver to kick the send
    /// queue at its next request. Returns whether work is there already
    /// (then the thread must not sleep).
    pub fn arm(&mut self, state: &mut PortState) -> bool {
        if self.running.is_some() || !self.pending.is_empty() {
            // Waits for a kick of the completion queue (room), or for its
            // own next turn; nothing to arm on the send queue.
            return false;
        }
        let (sq, cq) = self.rings_of(state);
        if !state.vrings[sq].active() || !state.vrings[cq].active() {
            return false;
        }
        let port = Arc::clone(&self.port);
        let gate = port.shared.access();
        let cq_tail = state.vrings[cq].position();
        let head = state.vrings[sq].position();
        match self
            .rings
            .view(&gate, &state.vrings[sq], &state.vrings[cq], cq_tail)
        {
            Ok(view) => view.arm_kick(head),
            // Served (and reported) at the next kick or retry.
            Err(_) => false,
        }
    }
}
