//! The engine plugged into the device: serves a port's RDMA send queue and
//! writes its completions.
//!
//! Each port publishes its memory (the frontend's memory table behind its
//! IOTLB) and its windows in a [`PortShared`], which other ports' engines
//! read while they access it. Requests run in order, one at a time, so a
//! FENCE is always honoured. A completion waits in the engine when the
//! completion queue has no free buffer; the engine then takes no new request
//! until the driver posts buffers and kicks the completion queue.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::RwLock;
use uapi::{
    Completion, DeviceInfo, ErrorDetail, Status, WorkRequest, WrFlags, ABI_VERSION, RDMA_FEATURES,
};
use vm_memory::Permissions;

use super::{execute, Fabric, Fault, MemoryAccess, Outcome, Span, Spans, Target, WindowTable};
use crate::device::Device;
use crate::engine::RdmaEngine;
use crate::memory::{self, MemError, PortIommu, PortMemory};
use crate::port::{Port, PortState};
use crate::queues::{self, Pop, Vring};

/// What other ports' engines see of a port.
#[derive(Debug, Default)]
pub struct PortShared {
    /// The port's memory, while a frontend is connected and has sent its
    /// memory table.
    pub memory: RwLock<Option<PortMemory>>,
    /// Windows the port bound.
    pub windows: WindowTable,
}

impl PortShared {
    /// Forgets the memory and revokes every window (the frontend left).
    pub fn reset(&self) {
        *self.memory.write() = None;
        self.windows.clear();
    }
}

/// A port's memory seen through the engine's seam.
struct MemoryView<'a>(&'a PortMemory);

impl MemoryAccess for MemoryView<'_> {
    fn spans(&self, iova: u64, len: u64, write: bool, out: &mut Spans) -> Result<(), Fault> {
        let access = if write {
            Permissions::Write
        } else {
            Permissions::Read
        };
        let len = usize::try_from(len).map_err(|_| Fault::Unmapped)?;
        let slices = memory::slices(self.0, iova, len, access).map_err(|error| match error {
            MemError::Denied { .. } if write => Fault::Permission("write"),
            MemError::Denied { .. } => Fault::Permission("read"),
            _ => Fault::Unmapped,
        })?;
        for slice in slices {
            out.push(Span {
                addr: slice.ptr_guard_mut().as_ptr(),
                len: slice.len(),
            });
        }
        Ok(())
    }
}

/// The other ports, reached through their [`PortShared`].
struct DeviceFabric<'a> {
    device: &'a Device,
}

impl Fabric for DeviceFabric<'_> {
    fn reach(
        &self,
        port: u16,
        access: &mut dyn FnMut(Target<'_>) -> Outcome,
    ) -> Result<Outcome, ErrorDetail> {
        let port = self
            .device
            .port(usize::from(port))
            .ok_or(ErrorDetail::UnknownPort)?;
        let memory = port.rdma.memory.read();
        let memory = memory.as_ref().ok_or(ErrorDetail::PortDown)?;
        Ok(access(Target {
            memory: &MemoryView(memory),
            windows: &port.rdma.windows,
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
    /// The IOMMU of the memory last published to other ports (a new memory
    /// table or feature set builds a new one).
    published: Option<Arc<PortIommu>>,
    /// Since when the request at the head of the send queue has waited for
    /// its local memory to be mapped.
    waiting_since: Option<Instant>,
}

impl DeviceEngine {
    /// An engine with nothing pending.
    pub fn new() -> Self {
        Self::default()
    }

    /// Writes pending completions into completion-queue buffers. Returns
    /// whether any buffer was used.
    fn flush(&mut self, rings: &mut Rings<'_>, memory: &PortMemory) -> bool {
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
                        Ok(Some(n)) => {
                            let _ = ring.add_used(memory, chain.head, n as u32);
                            self.pending.pop_front();
                        }
                        Ok(None) => {
                            ring.rewind();
                            break;
                        }
                        Err(error) => {
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
                Pop::Miss => break,
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
    fn serve_one(
        &mut self,
        rings: &mut Rings<'_>,
        memory: &PortMemory,
        info: DeviceInfo,
        local: &Target<'_>,
        fabric: &DeviceFabric<'_>,
    ) -> bool {
        let ring = &mut rings.vrings[rings.sq];
        let chain = match queues::pop_chain(ring, memory) {
            Pop::Chain(chain) => chain,
            // Polling, the device sees new requests without doorbells;
            // otherwise ask for one, and go on if requests came meanwhile.
            Pop::Empty if rings.polling => return false,
            Pop::Empty => return matches!(ring.queue_enable_notification(memory), Ok(true)),
            Pop::Miss => return false,
            Pop::Broken(error) => {
                ring.break_off(rings.port, &error);
                return false;
            }
        };
        let _ = ring.queue_disable_notification(memory);
        let completion = match queues::read_chain(memory, &chain, WorkRequest::SIZE) {
            Ok(Some(bytes)) => match WorkRequest::decode(&bytes) {
                Ok(request) => {
                    let faults = memory.iommu().fault_count();
                    let done = execute(info, *local, &request, fabric);
                    let missed = done.status == Status::LocalProtectionError
                        && memory.iommu().fault_count() > faults;
                    if missed && rings.lazy_iotlb {
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
                    (request.flags.contains(WrFlags::SIGNALED) || !done.is_success())
                        .then_some(done)
                }
                Err(error) => {
                    tracing::debug!(port = rings.port, "malformed work request: {error}");
                    Some(malformed(&bytes))
                }
            },
            Ok(None) => {
                ring.rewind();
                return false;
            }
            Err(error) => {
                tracing::debug!(port = rings.port, "unreadable work request: {error}");
                Some(malformed(&[]))
            }
        };
        let _ = rings.vrings[rings.sq].add_used(memory, chain.head, 0);
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
        let PortState {
            mem, vrings, guest, ..
        } = state;
        let Some(memory) = mem.as_ref() else {
            return false;
        };
        let mut rings = Rings {
            vrings,
            sq,
            cq,
            port: index,
            lazy_iotlb: *guest,
            polling: device.config.poll,
        };
        let current = memory.iommu();
        if !self
            .published
            .as_ref()
            .is_some_and(|published| Arc::ptr_eq(published, current))
        {
            self.published = Some(Arc::clone(current));
            *port.rdma.memory.write() = Some(memory.clone());
        }
        let info = DeviceInfo {
            port: index as u16,
            abi_version: ABI_VERSION,
            features: RDMA_FEATURES,
        };
        let fabric = DeviceFabric { device };
        let view = MemoryView(memory);
        let local = Target {
            memory: &view,
            windows: &port.rdma.windows,
        };
        let mut worked = self.flush(&mut rings, memory);
        while self.pending.is_empty() && rings.vrings[sq].active() {
            if !self.serve_one(&mut rings, memory, info, &local, &fabric) {
                break;
            }
            worked = true;
            self.flush(&mut rings, memory);
        }
        rings.vrings[sq].notify(memory);
        rings.vrings[cq].notify(memory);
        worked
    }
}
