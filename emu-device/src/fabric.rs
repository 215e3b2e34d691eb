//! The RDMA engine's seams implemented over the device's ports: a port's
//! memory ([`rdma::MemoryAccess`]) is its IOTLB-translated memory table, and
//! the [`rdma::Fabric`] is the [`PortTable`], each port reached through its
//! access gate ([`PortShared`]) for one guarded step at a time. A miss is
//! queued on the port that owns the memory, for its frontend.

use std::cell::Cell;
use std::sync::Arc;

use pindown_uapi::{DeviceInfo, ErrorDetail, WorkRequest};
use vm_memory::Permissions;

use crate::memory::{Miss, PortMemory, TranslateError};
use crate::port::{Port, PortShared, PortTable, SharedState};
use crate::rdma::{
    self, AccessFault, Fabric, MemoryAccess, Outcome, Progress, Span, Spans, Target, Turn,
    WindowTable,
};

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

    fn lost(&self) -> bool {
        self.memory.table().poisoned_region().is_some()
    }
}

/// The ports of the device, reached through their gates, as one initiator
/// sees them.
pub struct PortFabric<'a> {
    ports: &'a PortTable,
    /// The initiator (looked up once per kick).
    own: &'a Arc<Port>,
    /// The first miss of the current request in the initiator's own
    /// memory, if any (the request may wait for the mapping).
    own_miss: Cell<Option<Miss>>,
}

impl<'a> PortFabric<'a> {
    /// The fabric of requests issued by `own`.
    pub fn new(ports: &'a PortTable, own: &'a Arc<Port>) -> Self {
        PortFabric {
            ports,
            own,
            own_miss: Cell::new(None),
        }
    }

    /// Runs one turn of `request`, issued by the port `info` describes
    /// (`own`), from `progress` on (`inline`: the bytes a WRITE_INLINE
    /// carries). Also returns the first miss of the turn in the
    /// initiator's own memory, if any: the request may wait for that
    /// mapping.
    pub fn execute(
        &self,
        info: DeviceInfo,
        request: &WorkRequest,
        inline: &[u8],
        progress: &mut Progress,
    ) -> (Turn, Option<Miss>) {
        self.own_miss.set(None);
        let turn = rdma::execute(info, request, inline, self, progress);
        (turn, self.own_miss.take())
    }

    fn port(&self, index: u16) -> Result<Arc<Port>, ErrorDetail> {
        if usize::from(index) == self.own.index {
            return Ok(Arc::clone(self.own));
        }
        self.ports
            .get(usize::from(index))
            .ok_or(ErrorDetail::UnknownPort)
    }
}

/// Lends a port's state to a step, or says it is down.
fn lend<'s>(
    port: &'s Port,
    state: &'s SharedState,
    own_miss: Option<&'s Cell<Option<Miss>>>,
) -> Result<(MemoryView<'s>, &'s WindowTable), ErrorDetail> {
    let memory = state.memory.as_ref().ok_or(ErrorDetail::PortDown)?;
    let view = MemoryView {
        memory,
        port: &port.shared,
        own_miss,
    };
    Ok((view, &state.windows))
}

impl Fabric for PortFabric<'_> {
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
                incarnation: near.shared.incarnation(),
                node: near.node,
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
        let outcome = step(
            Target {
                memory: &near_memory,
                windows: near_windows,
                refusals: &near.stats.refused,
                incarnation: near.shared.incarnation(),
                node: near.node,
            },
            Target {
                memory: &far_memory,
                windows: far_windows,
                refusals: &far.stats.refused,
                incarnation: far.shared.incarnation(),
                node: far.node,
            },
        );
        if far_memory.lost() {
            // Its own thread resets the port; it may be asleep.
            far.inbox.nudge();
        }
        Ok(outcome)
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
            incarnation: port.shared.incarnation(),
            node: port.node,
        }))
    }

    fn vector_limits(&self) -> rdma::VectorLimits {
        self.own.vector_limits
    }

    fn reserve_notice(&self, port: u16) -> Option<rdma::NoticeSlot> {
        let port = self.port(port).ok()?;
        port.inbox
            .reserve_notice()
            .then(|| rdma::NoticeSlot::new(port))
    }

    fn incarnation(&self, port: u16) -> u64 {
        self.port(port).map_or(0, |port| port.shared.incarnation())
    }
}

/// Runs one guarded step on port `index` alone, lent with its memory and
/// windows (for a request of another node's port, or the part of a
/// request of this port's that the fabric link carries out), or says why
/// the port cannot be reached: [`ErrorDetail::UnknownPort`] or
/// [`ErrorDetail::PortDown`].
pub fn with_port(
    ports: &PortTable,
    index: u16,
    step: &mut dyn FnMut(Target<'_>) -> Outcome,
) -> Result<Outcome, ErrorDetail> {
    let port = ports
        .get(usize::from(index))
        .ok_or(ErrorDetail::UnknownPort)?;
    let state = port.shared.access();
    let (memory, windows) = lend(&port, &state, None)?;
    let outcome = step(Target {
        memory: &memory,
        windows,
        refusals: &port.stats.refused,
        incarnation: port.shared.incarnation(),
        node: port.node,
    });
    if memory.lost() {
        // Its own thread resets the port; it may be asleep.
        port.inbox.nudge();
    }
    Ok(outcome)
}
