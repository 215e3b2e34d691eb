//! The engine plugged into the device: serves a port's RDMA send queue and
//! writes its completions.
//!
//! Every port's memory and windows live once, in its
//! [`PortShared`](crate::port::PortShared), behind the port's access gate;
//! the engine reaches its own port and its peers through it, one guarded
//! step at a time. Requests run in order, one at a time, so a FENCE is
//! always honoured. A completion waits in the engine when the completion
//! queue has no free buffer; the engine then takes no new request until the
//! driver posts buffers and kicks the completion queue.

use std::cell::Cell;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use uapi::{
    Completion, DeviceInfo, ErrorDetail, Status, WorkRequest, WrFlags, ABI_VERSION, RDMA_FEATURES,
};
use vm_memory::Permissions;

use super::{execute, AccessFault, Fabric, MemoryAccess, Outcome, Span, Spans, Target};
use crate::device::Device;
use crate::engine::RdmaEngine;
use crate::memory::{Miss, PortMemory, TranslateError};
use crate::port::{Port, PortShared, PortState, SharedState};
use crate::queues::{self, ChainError, Pop, Vring};

/// A port's memory seen through the engine's seam.
struct MemoryView<'a> {
    memory: &'a PortMemory,
    /// The port, whose frontend is asked for what misses.
    port: &'a PortShared,
    /// Where a miss of the initiator's own memory is kept for the request
    /// (`None` for a peer's memory).
    own_miss: Option<&'a Cell<Option<Miss>>>,
}

impl MemoryAccess for MemoryView<'_> {
    fn spans(&self, iova: u64, len: u64, write: bool, out: &mut Spans) -> Result<(), AccessFault> {
        let access = if write {
            Permissions::Write
        } else {
            Permissions::Read
        };
        let start = out.len();
        for slice in self.memory.translate(iova, len, access) {
            let slice = slice.map_err(|error| {
                out.truncate(start);
                // A denied access is asked for too: an UPDATE may grant it.
                if let Some(miss) = error.ask() {
                    self.port.note_miss(miss);
                }
                match error {
                    TranslateError::Miss(miss) => {
                        if let Some(own) = self.own_miss {
                            own.set(Some(miss));
                        }
                        AccessFault::Miss { iova: miss.iova }
                    }
                    TranslateError::Denied { .. } if write => AccessFault::Permission("write"),
                    TranslateError::Denied { .. } => AccessFault::Permission("read"),
                    TranslateError::Unbacked { .. } | TranslateError::Wraps { .. } => {
                        AccessFault::Unmapped
                    }
                }
            })?;
            out.push(Span {
                addr: slice.ptr_guard_mut().as_ptr(),
                len: slice.len(),
            });
        }
        Ok(())
    }
}

/// The ports of the device, reached through their gates.
struct DeviceFabric<'a> {
    device: &'a Device,
    /// The initiator (looked up once per kick).
    own: &'a Arc<Port>,
    /// The first miss of the current request in the initiator's own
    /// memory, if any (the request may wait for the mapping).
    own_miss: Cell<Option<Miss>>,
}

impl DeviceFabric<'_> {
    fn port(&self, index: u16) -> Result<Arc<Port>, ErrorDetail> {
        if usize::from(index) == self.own.index {
            return Ok(Arc::clone(self.own));
        }
        self.device
            .port(usize::from(index))
            .ok_or(ErrorDetail::UnknownPort)
    }
}

/// Lends a port's state to a step, or says it is down.
fn lend<'s>(
    port: &'s Port,
    state: &'s SharedState,
    own_miss: Option<&'s Cell<Option<Miss>>>,
) -> Result<(MemoryView<'s>, &'s super::WindowTable), ErrorDetail> {
    let memory = state.memory.as_ref().ok_or(ErrorDetail::PortDown)?;
    let view = MemoryView {
        memory,
        port: &port.shared,
        own_miss,
    };
    Ok((view, &state.windows))
}

impl Fabric for DeviceFabric<'_> {
    fn step(
        &self,
        initiator: u16,
        target: u16,
        step: &mut dyn FnMut(Target<'_>, Target<'_>) -> Outcome,
    ) -> Result<Outcome, ErrorDetail> {
        let near = self.port(initiator)?;
        if initiator == target {
            let state = near.shared.access();
            let (memory, windows) = lend(&near, &state, Some(&self.own_miss))?;
            let own = Target {
                memory: &memory,
                windows,
                refusals: &near.stats.refused,
            };
            return Ok(step(own, own));
        }
        let far = self.port(target)?;
        // Two gates are always taken in port order, so that two steps
        // crossing in opposite directions cannot wait for each other
        // behind a barrier.
        let (near_state, far_state) = if initiator < target {
            let near_state = near.shared.access();
            (near_state, far.shared.access())
        } else {
            let far_state = far.shared.access();
            (near.shared.access(), far_state)
        };
        let (near_memory, near_windows) = lend(&near, &near_state, Some(&self.own_miss))?;
        let (far_memory, far_windows) = lend(&far, &far_state, None)?;
        Ok(step(
            Target {
                memory: &near_memory,
                windows: near_windows,
                refusals: &near.stats.refused,
            },
            Target {
                memory: &far_memory,
                windows: far_windows,
                refusals: &far.stats.refused,
            },
        ))
    }

    fn exclusive(
        &self,
        port: u16,
        change: &mut dyn FnMut(Target<'_>) -> Outcome,
    ) -> Result<Outcome, ErrorDetail> {
        let port = self.port(port)?;
        let state = port.shared.barrier();
        let own_miss = (port.index == self.own.index).then_some(&self.own_miss);
        let (memory, windows) = lend(&port, &state, own_miss)?;
        Ok(change(Target {
            memory: &memory,
            windows,
            refusals: &port.stats.refused,
        }))
    }
}

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

/// The RDMA engine of one connection.
#[derive(Debug, Default)]
pub struct DeviceEngine {
    /// Completions waiting for a completion-queue buffer.
    pending: VecDeque<Completion>,
    /// The port served, once known.
    port: Option<Arc<Port>>,
    /// Since when the request at the head of the send queue has waited for
    /// its local memory to be mapped.
    waiting_since: Option<Instant>,
}

impl DeviceEngine {
    /// An engine with nothing pending.
    pub fn new() -> Self {
        Self::default()
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
        fabric: &DeviceFabric<'_>,
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
                fabric.own_miss.set(None);
                let done = execute(info, &request, fabric);
                let own_miss = fabric.own_miss.take();
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

impl RdmaEngine for DeviceEngine {
    fn on_send_queue_kick(&mut self, state: &mut PortState, device: &Device) -> bool {
        if self.port.is_none() {
            self.port = device.port(state.index);
        }
        let Some(port) = self.port.clone() else {
            return false;
        };
        let (sq, cq, index) = (state.rdma_sq(), state.rdma_cq(), state.index);
        let PortState { vrings, guest, .. } = state;
        let mut rings = Rings {
            vrings,
            sq,
            cq,
            port: index,
            lazy_iotlb: *guest,
            polling: device.config.poll,
        };
        let info = DeviceInfo {
            port: index as u16,
            abi_version: ABI_VERSION,
            features: RDMA_FEATURES,
        };
        let fabric = DeviceFabric {
            device,
            own: &port,
            own_miss: Cell::new(None),
        };
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
