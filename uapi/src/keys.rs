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
/// every remote access. Keys are never reused while the device runs, so a
/// revoked key stays invalid.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RemoteKey(pub u32);

impl fmt::Display for RemoteKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rkey {:#010x}", self.0)
    }
}

/// Where a remote access goes: a port, a window on it, an offset inside.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RemoteAddress {
    /// The target port (its [`DeviceInfo::port`](crate::DeviceInfo)).
    pub port: u16,
    /// The window.
    pub key: RemoteKey,
    /// Offset from the window's start.
    pub offset: u64,
}
