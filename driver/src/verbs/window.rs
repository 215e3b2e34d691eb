//! Memory windows: remote access to registered memory, granted by key and
//! revocable.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use pindown_uapi::{Access, Operation, RemoteAddress, RemoteKey};

use super::{Context, MemoryRegion, VerbsError};
use crate::transport::Transport;

impl<T: Transport + 'static> Context<T> {
    /// Grants any peer that holds the key `access` to `[offset, offset +
    /// len)` of `region` (an open window); the window lives until revoked
    /// (or the port goes away). See [`bind_window_for_peer`] to grant one
    /// port only.
    ///
    /// Fails with [`VerbsError::Refused`] carrying
    /// [`ErrorDetail::WindowLimit`](pindown_uapi::ErrorDetail::WindowLimit) when the
    /// port already holds as many windows as the device allows.
    ///
    /// [`bind_window_for_peer`]: Context::bind_window_for_peer
    pub fn bind_window(
        &self,
        region: &MemoryRegion<'_, T>,
        offset: u64,
        len: u64,
        access: Access,
    ) -> Result<MemoryWindow, VerbsError> {
        self.bind(region, offset, len, access, None)
    }

    /// Like [`bind_window`](Context::bind_window), but only port `peer` may
    /// use the window (as a type-2 memory window is bound to one queue
    /// pair): any other port presenting the key is refused, exactly as if
    /// the key did not exist.
    ///
    /// The binding is to the peer's connection, not to the port index: once
    /// that frontend leaves (or resets its port), the window refuses the
    /// next frontend given the same port too.
    pub fn bind_window_for_peer(
        &self,
        region: &MemoryRegion<'_, T>,
        offset: u64,
        len: u64,
        access: Access,
        peer: u16,
    ) -> Result<MemoryWindow, VerbsError> {
        self.bind(region, offset, len, access, Some(peer))
    }

    fn bind(
        &self,
        region: &MemoryRegion<'_, T>,
        offset: u64,
        len: u64,
        access: Access,
        peer: Option<u16>,
    ) -> Result<MemoryWindow, VerbsError> {
        let start = region.iova_at(offset, len)?;
        let done = self.run_internal(
            Operation::BindWindow {
                start,
                len,
                access,
                peer,
            },
            Duration::from_secs(10),
        )?;
        Ok(MemoryWindow {
            remote: RemoteWindow {
                port: self.info.port,
                key: RemoteKey(done.value),
                len,
            },
            access,
            peer,
        })
    }

    /// Revokes a window; later accesses through its key fail.
    pub fn revoke_window(&self, window: MemoryWindow) -> Result<(), VerbsError> {
        self.run_internal(
            Operation::RevokeWindow {
                key: window.remote.key,
            },
            Duration::from_secs(10),
        )?;
        Ok(())
    }
}

/// What a peer needs to reach a window: port, key and length. Its text form
/// `port:key:len` (the 64-bit key in hex, 16 digits) travels between
/// processes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteWindow {
    /// The owner's port.
    pub port: u16,
    /// The window's key.
    pub key: RemoteKey,
    /// Length in bytes.
    pub len: u64,
}

impl RemoteWindow {
    /// The address `offset` bytes into the window.
    pub fn at(&self, offset: u64) -> RemoteAddress {
        RemoteAddress {
            port: self.port,
            key: self.key,
            offset,
        }
    }
}

impl fmt::Display for RemoteWindow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{:016x}:{}", self.port, self.key.0, self.len)
    }
}

/// A malformed `port:key:len` text.
#[derive(Debug, thiserror::Error)]
#[error("not a window description (port:key:len): {0:?}")]
pub struct BadWindowText(String);

impl FromStr for RemoteWindow {
    type Err = BadWindowText;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let bad = || BadWindowText(text.to_owned());
        let mut parts = text.trim().split(':');
        let port = parts.next().and_then(|p| p.parse().ok()).ok_or_else(bad)?;
        let key = parts
            .next()
            .and_then(|k| u64::from_str_radix(k, 16).ok())
            .ok_or_else(bad)?;
        let len = parts.next().and_then(|l| l.parse().ok()).ok_or_else(bad)?;
        if parts.next().is_some() {
            return Err(bad());
        }
        Ok(RemoteWindow {
            port,
            key: RemoteKey(key),
            len,
        })
    }
}

/// A window this port bound.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryWindow {
    /// How peers reach it.
    pub remote: RemoteWindow,
    /// What they may do.
    pub access: Access,
    /// The one port allowed to use it; `None`: any port holding the key.
    pub peer: Option<u16>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_text_round_trips_and_rejects_garbage() {
        let window = RemoteWindow {
            port: 3,
            key: RemoteKey(0xabc),
            len: 4096,
        };
        assert_eq!(window.to_string(), "3:0000000000000abc:4096");
        assert_eq!(window.to_string().parse::<RemoteWindow>().unwrap(), window);
        let wide = RemoteWindow {
            port: 65535,
            key: RemoteKey(u64::MAX - 1),
            len: u64::MAX,
        };
        assert_eq!(wide.to_string().parse::<RemoteWindow>().unwrap(), wide);
        let too_wide = "1:1ffffffffffffffff:2";
        for bad in ["", "1:2", "x:1:2", "1:zz:2", "1:2:3:4", too_wide] {
            assert!(bad.parse::<RemoteWindow>().is_err(), "{bad}");
        }
    }
}
