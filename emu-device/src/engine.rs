//! The seam for the RDMA engine (hook point of `crate::rdma`): the device calls it when the RDMA send
//! queue of a port is kicked. The engine reads work requests from
//! `port.vrings[port.rdma_sq()]`, moves data through the ports' gated
//! [`PortShared`](crate::port::PortShared) (of this port, or of another one
//! through [`Device::port`]), and posts
//! completions on `port.vrings[port.rdma_cq()]`.
//!
//! [`Device::port`]: crate::device::Device::port

use crate::device::Device;
use crate::port::PortState;

/// Executes RDMA work requests of one port.
pub trait RdmaEngine: Send {
    /// The send queue of `port` was kicked (or polled). The port's lock is
    /// held; an engine that needs another port must not wait for this one.
    ///
    /// Returns whether it did anything (took a request or wrote a
    /// completion), which keeps an adaptively polling port hot.
    fn on_send_queue_kick(&mut self, port: &mut PortState, device: &Device) -> bool;
}

/// The engine used until the real one exists: logs kicks, does nothing.
#[derive(Debug, Default)]
pub struct NoopEngine;

impl RdmaEngine for NoopEngine {
    fn on_send_queue_kick(&mut self, port: &mut PortState, _device: &Device) -> bool {
        tracing::debug!(port = port.index, "RDMA send queue kicked (no engine)");
        false
    }
}

/// Creates the engine of a port (given the port index).
pub type EngineFactory = Box<dyn Fn(usize) -> Box<dyn RdmaEngine> + Send + Sync>;
