//! Remote keys, window access rights and remote addresses.

use std::fmt;

bitflags::bitflags! {
    /// What a window lets a peer do.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub struct Access: u32 {
        /// Peers may READ from the window.
        const REMOTE_READ = 1 << 0;
        /// Peers may WRITE into the window.
        const REMOTE_WRITE = 1 << 1;
        /// Peers may run atomics on the window.
        const REMOTE_ATOMIC = 1 << 2;
    }
}

/// Names a window a port bound: handed to peers, checked by the device on
/// every remote access.
///
/// A key is 64 bits that only the device can make: to anyone else it looks
/// like 64 random bits (it is derived from a secret the device draws from
/// the operating system's random source when it starts), so a peer cannot
/// guess another port's keys, nor derive them from keys it holds. The
/// device never hands out the same key twice while it runs, so a revoked
/// key stays invalid. Zero is never a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RemoteKey(pub u64);

impl TryFrom<u64> for RemoteKey {
    type Error = crate::DecodeError;

    /// The key with value `value`; zero is never a key.
    fn try_from(value: u64) -> Result<Self, Self::Error> {
        match value {
            0 => Err(crate::DecodeError::OutOfRange {
                field: "remote key",
                value,
            }),
            key => Ok(RemoteKey(key)),
        }
    }
}

impl fmt::Display for RemoteKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rkey {:#018x}", self.0)
    }
}

/// A node of the fabric: one device process, on one host. Nodes are
/// numbered by the fabric's configuration; a device without a fabric is
/// node 0.
pub type NodeId = u16;

/// The largest offset into a window a request can name: offsets are 48
/// bits (the top 16 bits of the request's offset field name the node, as
/// ACP's global addresses pack rank and offset in one word), and so are
/// window lengths.
pub const MAX_REMOTE_OFFSET: u64 = (1 << 48) - 1;

/// A port anywhere in the fabric: a node and a port of its device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PortAddress {
    /// The node (its [`DeviceInfo::node`](crate::DeviceInfo)).
    pub node: NodeId,
    /// The port on that node (its [`DeviceInfo::port`](crate::DeviceInfo)).
    pub port: u16,
}

impl fmt::Display for PortAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "node {} port {}", self.node, self.port)
    }
}

/// Where a remote access goes: a node, a port of it, a window on that
/// port, an offset inside. A request whose node is the initiator's own
/// node is carried out inside the device; any other node is reached over
/// the fabric.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RemoteAddress {
    /// The target node (its [`DeviceInfo::node`](crate::DeviceInfo)).
    pub node: NodeId,
    /// The target port (its [`DeviceInfo::port`](crate::DeviceInfo)).
    pub port: u16,
    /// The window.
    pub key: RemoteKey,
    /// Offset from the window's start.
    pub offset: u64,
}

impl RemoteAddress {
    /// The port the access goes to.
    pub fn port_address(&self) -> PortAddress {
        PortAddress {
            node: self.node,
            port: self.port,
        }
    }
}
