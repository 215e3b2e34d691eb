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
