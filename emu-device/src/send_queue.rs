//! Serving a port's RDMA send and completion queues: takes work requests
//! from the send queue, in order and one at a time (so a FENCE is always
//! honoured), runs each with [`rdma::execute`](crate::rdma::execute)
//! through the [`PortFabric`] over the device's ports, and writes the
//! completions into the completion queue.
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

use uapi::{
    Completion, DeviceInfo, ErrorDetail, Status, WorkRequest, WrFlags, ABI_VERSION, RDMA_FEATURES,
};

use crate::fabric::PortFabric;
use crate::memory::PortMemory;
use crate::port::{Port, PortShared, PortState, PortTable};
use crate::queues::{self, ChainError, Pop, Vring};

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

/// The RDMA send and completion queues of one port, while one frontend
/// connection lasts.
#[derive(Debug)]
pub struct SendQueue {
    /// Completions waiting for a completion-queue buffer.
    pending: VecDeque<Completion>,
    /// The port served.
    port: Arc<Port>,
    /// The device busy-polls: the driver need not ring doorbells.
    polling: bool,
    /// Since when the request at the head of the send queue has waited for
    /// its local memory to be mapped.
    waiting_since: Option<Instant>,
}

impl SendQueue {
    /// The queues of `port`, nothing pending (`polling`: the device
    /// busy-polls the rings, see [`DeviceConfig::poll`](crate::DeviceConfig::poll)).
    pub fn new(port: Arc<Port>, polling: bool) -> Self {
        SendQueue {
            pending: VecDeque::new(),
            port,
            polling,
            waiting_since: None,
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

    /// Takes the next request from the send queue and runs it. Returns
    /// `false` when the queue is empty (or unusable).
    ///
    /// The ring work is one guarded step on the port's own gate; the
    /// request runs outside it, in steps of its own, so that a request may
    /// revoke one of the port's windows (a barrier on the same gate).
    fn serve_one(
        &mut self,
        rings: &mut Rings<'_>,
        port: &Port,
        info: DeviceInfo,
        fabric: &PortFabric<'_>,
    ) -> bool {
        let (chain, request) = {
            let state = port.shared.access();
            let Some(memory) = state.memory.as_ref() else {
                return false;
            };
            let ring = &mut rings.vrings[rings.sq];
            let chain = match queues::pop_chain(ring, memory) {
                Pop::Chain(chain) => chain,
                // Polling, the device sees new requests without doorbells;
                // otherwise ask for one, and go on if requests came meanwhile.
                Pop::Empty if rings.polling => return false,
                Pop::Empty => return matches!(ring.queue_enable_notification(memory), Ok(true)),
                Pop::Miss(miss) => {
                    port.shared.note_miss(miss);
                    return false;
                }
                Pop::Broken(error) => {
                    ring.break_off(rings.port, &error);
                    return false;
                }
            };
            let _ = ring.queue_disable_notification(memory);
            match queues::read_chain(memory, &chain, WorkRequest::SIZE) {
                Ok(bytes) => (
                    chain,
                    WorkRequest::decode(&bytes).map_err(|error| {
                        tracing::debug!(port = rings.port, "malformed work request: {error}");
                        malformed(&bytes)
                    }),
                ),
                Err(ChainError::Miss(miss)) => {
                    ring.rewind();
                    port.shared.note_miss(miss);
                    return false;
                }
                Err(error) => {
                    if let ChainError::Denied(denied) = &error {
                        port.shared.note_miss_of(*denied);
                    }
                    tracing::debug!(port = rings.port, "unreadable work request: {error}");
                    (chain, Err(malformed(&[])))
                }
            }
        };
        let completion = match request {
            Ok(request) => {
                let (done, own_miss) = fabric.execute(info, &request);
                if done.status == Status::LocalProtectionError
                    && rings.lazy_iotlb
                    && own_miss.is_some()
                {
                    // Nothing moved: the local range is checked first.
                    // Take the request again once the mapping arrives.
                    let since = *self.waiting_since.get_or_insert_with(Instant::now);
                    if since.elapsed() < MISS_PATIENCE {
                        let ring = &mut rings.vrings[rings.sq];
                        ring.rewind();
                        ring.waiting_iotlb = true;
                        return false;
                    }
                }
                self.waiting_since = None;
                (request.flags.contains(WrFlags::SIGNALED) || !done.is_success()).then_some(done)
            }
            Err(malformed) => Some(malformed),
        };
        let state = port.shared.access();
        if let Some(memory) = state.memory.as_ref() {
            let _ = rings.vrings[rings.sq].add_used(memory, chain.head, 0);
        }
        self.pending.extend(completion);
        true
    }
}

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
    /// have room. `state` is the served port's state, whose lock the caller
    /// holds; peers are looked up in `ports` and reached through their
    /// access gates only, never their locks.
    ///
    /// Returns whether it did anything (took a request or wrote a
    /// completion), which keeps an adaptively polling port hot.
    pub fn serve(&mut self, state: &mut PortState, ports: &PortTable) -> bool {
        let port = Arc::clone(&self.port);
        let (sq, cq, index) = (state.rdma_sq(), state.rdma_cq(), state.index);
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
        };
        let fabric = PortFabric::new(ports, &port);
        let mut worked = self.flush_step(&mut rings, &port);
        while self.pending.is_empty() && rings.vrings[sq].active() {
            if !self.serve_one(&mut rings, &port, info, &fabric) {
                break;
            }
            worked = true;
            self.flush_step(&mut rings, &port);
        }
        let shared = port.shared.access();
        if let Some(memory) = shared.memory.as_ref() {
            rings.vrings[sq].notify(memory);
            rings.vrings[cq].notify(memory);
        }
        worked
    }
}
