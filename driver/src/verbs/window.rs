//! Memory windows: remote access to registered memory, granted by key and
//! revocable.

use std::fmt;
use std::marker::PhantomData;
use std::str::FromStr;
use std::sync::atomic::Ordering;

use pindown_uapi::{Access, NodeId, Operation, PortAddress, RemoteAddress, RemoteKey};

use super::{Context, KeepAlive, MemoryRegion, VerbsError};
use crate::transport::{Transport, VhostUserTransport};

impl<T: Transport + 'static> Context<T> {
    /// Grants any peer that holds the key `access` to `[offset, offset +
    /// len)` of `region` (an open window). The window borrows the region
    /// (which cannot be deregistered while it is bound) and lives until
    /// [`MemoryWindow::revoke`] or its drop (or the port going away). See
    /// [`bind_window_for_peer`] to grant one port only.
    ///
    /// Fails with [`VerbsError::Refused`] carrying
    /// [`ErrorDetail::WindowLimit`](pindown_uapi::ErrorDetail::WindowLimit) when the
    /// port already holds as many windows as the device allows.
    ///
    /// [`bind_window_for_peer`]: Context::bind_window_for_peer
    pub fn bind_window<'r>(
        &'r self,
        region: &'r MemoryRegion<'_, T>,
        offset: u64,
        len: u64,
        access: Access,
    ) -> Result<MemoryWindow<'r, T>, VerbsError> {
        self.bind(region, offset, len, access, None)
    }

    /// Like [`bind_window`](Context::bind_window), but only port `peer` (of
    /// this node or another node of the fabric) may
    /// use the window (as a type-2 memory window is bound to one queue
    /// pair): any other port presenting the key is refused, exactly as if
    /// the key did not exist.
    ///
    /// The binding is to the peer's connection, not to the port index: once
    /// that frontend leaves (or resets its port), the window refuses the
    /// next frontend given the same port too.
    pub fn bind_window_for_peer<'r>(
        &'r self,
        region: &'r MemoryRegion<'_, T>,
        offset: u64,
        len: u64,
        access: Access,
        peer: PortAddress,
    ) -> Result<MemoryWindow<'r, T>, VerbsError> {
        self.bind(region, offset, len, access, Some(peer))
    }

    /// Binds a window over `[start, start + len)` of the port's memory,
    /// which no [`MemoryRegion`] vouches for: to test the device's checks
    /// (a window whose memory is unregistered under it, for instance). A
    /// window over memory that is not registered grants nothing.
    ///
    /// # Safety
    ///
    /// While the window is bound, peers holding its key may read, write or
    /// run atomics (as `access` allows) on whatever is registered in that
    /// range: the caller keeps the range unregistered or allocated to what
    /// the window is meant to expose until the window is revoked.
    pub unsafe fn bind_window_raw(
        &self,
        start: u64,
        len: u64,
        access: Access,
        peer: Option<PortAddress>,
    ) -> Result<MemoryWindow<'_, T>, VerbsError> {
        self.bind_range(start, len, access, peer, None)
    }

    /// Like [`bind_window`](Context::bind_window) (or, with `peer`,
    /// [`bind_window_for_peer`](Context::bind_window_for_peer)), but the
    /// window takes the region with it: a [`RegionWindow`] owns both and
    /// borrows only the context, so libraries can keep windows over user
    /// buffers in their own caches. Dropping it revokes the window, then
    /// releases the registration. On failure the region is released
    /// (registering it again is a pin-down cache hit).
    pub fn bind_region_window<'c>(
        &'c self,
        region: MemoryRegion<'c, T>,
        offset: u64,
        len: u64,
        access: Access,
        peer: Option<PortAddress>,
    ) -> Result<RegionWindow<'c, T>, VerbsError> {
        let start = self.window_start(&region, offset, len, access)?;
        let keep = region.keep_alive().cloned();
        let window = self.bind_range(start, len, access, peer, keep)?;
        Ok(RegionWindow { window, region })
    }

    fn bind<'r>(
        &'r self,
        region: &'r MemoryRegion<'_, T>,
        offset: u64,
        len: u64,
        access: Access,
        peer: Option<PortAddress>,
    ) -> Result<MemoryWindow<'r, T>, VerbsError> {
        let start = self.window_start(region, offset, len, access)?;
        self.bind_range(start, len, access, peer, region.keep_alive().cloned())
    }

    /// Where a window over `[offset, offset + len)` of `region` starts,
    /// once the region is known to be this context's and the memory to
    /// allow `access`.
    fn window_start(
        &self,
        region: &MemoryRegion<'_, T>,
        offset: u64,
        len: u64,
        access: Access,
    ) -> Result<u64, VerbsError> {
        if !std::ptr::eq(region.context(), self) {
            return Err(VerbsError::OtherContext {
                what: "memory region",
            });
        }
        let start = region.iova_at(offset, len)?;
        check_not_empty(len, access)?;
        if access.intersects(Access::REMOTE_WRITE | Access::REMOTE_ATOMIC)
            && !self.cache.pinner().writable(start, len)
        {
            return Err(VerbsError::ReadOnlyMemory { addr: start, len });
        }
        Ok(start)
    }

    fn bind_range(
        &self,
        start: u64,
        len: u64,
        access: Access,
        peer: Option<PortAddress>,
        keep: Option<KeepAlive>,
    ) -> Result<MemoryWindow<'_, T>, VerbsError> {
        check_not_empty(len, access)?;
        let done = self.run_admin(Operation::BindWindow {
            start,
            len,
            access,
            peer,
        })?;
        let key = RemoteKey::try_from(done.value).map_err(VerbsError::BadCompletion)?;
        Ok(MemoryWindow {
            context: self,
            remote: RemoteWindow {
                node: self.info.node,
                port: self.info.port,
                key,
                len,
            },
            access,
            peer,
            keep,
            bound: true,
            region: PhantomData,
        })
    }

    fn revoke_key(&self, key: RemoteKey) -> Result<(), VerbsError> {
        self.run_admin(Operation::RevokeWindow { key })?;
        Ok(())
    }
}

/// Refuses a window that would grant nothing: no byte, or no right.
fn check_not_empty(len: u64, access: Access) -> Result<(), VerbsError> {
    if len == 0 || access.is_empty() {
        return Err(VerbsError::EmptyWindow { len, access });
    }
    Ok(())
}

/// A window this port bound over part of a [`MemoryRegion`], which it
/// borrows. Peers reach it through its [`RemoteWindow`]; it is revoked by
/// [`revoke`](Self::revoke) or when dropped.
///
/// The window keeps a share of the region's memory (when the region holds
/// one) until it is revoked: a window leaked with `mem::forget` keeps the
/// memory allocated for good, so peers never write into memory handed to
/// someone else. If revoking fails, the share is leaked the same way.
pub struct MemoryWindow<'r, T: Transport + 'static = VhostUserTransport> {
    context: &'r Context<T>,
    remote: RemoteWindow,
    access: Access,
    peer: Option<PortAddress>,
    /// The share of the memory under the window.
    keep: Option<KeepAlive>,
    /// Not revoked yet.
    bound: bool,
    region: PhantomData<&'r ()>,
}

impl<T: Transport + 'static> MemoryWindow<'_, T> {
    /// How peers reach it (port, key, length); send it to them.
    pub fn remote(&self) -> RemoteWindow {
        self.remote
    }

    /// What peers may do.
    pub fn access(&self) -> Access {
        self.access
    }

    /// The one port allowed to use it; `None`: any port holding the key.
    pub fn peer(&self) -> Option<PortAddress> {
        self.peer
    }

    /// Revokes the window: once this returns, no access through its key
    /// is in flight and every later one fails. Fails when the device
    /// refuses (it no longer knows the window: the port was reset) or
    /// cannot be reached; the window is gone either way.
    pub fn revoke(mut self) -> Result<(), VerbsError> {
        self.unbind()
    }

    /// Revokes the window however long the device takes: a device that
    /// has not answered within the control timeout is asked again, since
    /// until it answers the window may still grant access. Once this
    /// returns, no access through the key is in flight and none will be:
    /// an error says the device is gone or no longer knows the window
    /// (its port was reset). For memory a borrow lends the device, which
    /// must be out of its reach before the borrow ends; a device that
    /// never answers makes this wait for ever.
    pub fn revoke_waiting(mut self) -> Result<(), VerbsError> {
        loop {
            match self.context.revoke_key(self.remote.key) {
                Err(err @ VerbsError::ControlTimeout { .. }) => {
                    tracing::warn!(window = %self.remote, "revoking again: {err}");
                }
                revoked => {
                    self.bound = false;
                    return revoked;
                }
            }
        }
    }

    /// Revokes the window, once; on failure, leaks the share of its memory
    /// (the device may still let peers reach it).
    fn unbind(&mut self) -> Result<(), VerbsError> {
        if !std::mem::take(&mut self.bound) {
            return Ok(());
        }
        let revoked = self.context.revoke_key(self.remote.key);
        if revoked.is_err() {
            if let Some(keep) = self.keep.take() {
                std::mem::forget(keep);
            }
        }
        revoked
    }
}

impl<T: Transport + 'static> Drop for MemoryWindow<'_, T> {
    /// Revokes the window; a failure is logged and counted
    /// ([`Context::window_revoke_failures`]).
    fn drop(&mut self) {
        if let Err(err) = self.unbind() {
            self.context
                .window_revoke_failures
                .fetch_add(1, Ordering::Relaxed);
            tracing::warn!(window = %self.remote, "revoking a dropped window failed: {err}");
        }
    }
}

impl<T: Transport + 'static> fmt::Debug for MemoryWindow<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryWindow")
            .field("remote", &self.remote)
            .field("access", &self.access)
            .field("peer", &self.peer)
            .finish()
    }
}

/// A window together with the registration under it
/// ([`Context::bind_region_window`]): it borrows only the context. Dropping
/// it revokes the window first, then releases the registration.
pub struct RegionWindow<'c, T: Transport + 'static = VhostUserTransport> {
    // Field order is drop order: the window is revoked before the region
    // under it is released.
    window: MemoryWindow<'c, T>,
    region: MemoryRegion<'c, T>,
}

impl<'c, T: Transport + 'static> RegionWindow<'c, T> {
    /// How peers reach it; send it to them.
    pub fn remote(&self) -> RemoteWindow {
        self.window.remote()
    }

    /// What peers may do.
    pub fn access(&self) -> Access {
        self.window.access()
    }

    /// The registered memory under the window, to name in local requests.
    pub fn region(&self) -> &MemoryRegion<'c, T> {
        &self.region
    }

    /// Revokes the window, then releases the registration; reports the
    /// device's answer to the revocation.
    pub fn revoke(self) -> Result<(), VerbsError> {
        let RegionWindow { window, region } = self;
        let revoked = window.revoke();
        drop(region);
        revoked
    }

    /// Like [`revoke`](Self::revoke), but waiting however long the device
    /// takes ([`MemoryWindow::revoke_waiting`]).
    pub fn revoke_waiting(self) -> Result<(), VerbsError> {
        let RegionWindow { window, region } = self;
        let revoked = window.revoke_waiting();
        drop(region);
        revoked
    }
}

impl<T: Transport + 'static> fmt::Debug for RegionWindow<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegionWindow")
            .field("window", &self.window)
            .field("region", &self.region)
            .finish()
    }
}

/// What a peer needs to reach a window: port, key and length. Its text form
/// `node:port:key:len` (the 64-bit key in hex, 16 digits) travels between
/// processes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteWindow {
    /// The owner's node.
    pub node: NodeId,
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
            node: self.node,
            port: self.port,
            key: self.key,
            offset,
        }
    }
}

impl fmt::Display for RemoteWindow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}:{:016x}:{}",
            self.node, self.port, self.key.0, self.len
        )
    }
}

/// A malformed `node:port:key:len` text.
#[derive(Debug, thiserror::Error)]
#[error("not a window description (node:port:key:len): {0:?}")]
pub struct BadWindowText(String);

impl FromStr for RemoteWindow {
    type Err = BadWindowText;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let bad = || BadWindowText(text.to_owned());
        let mut parts = text.trim().split(':');
        let node = parts.next().and_then(|n| n.parse().ok()).ok_or_else(bad)?;
        let port = parts.next().and_then(|p| p.parse().ok()).ok_or_else(bad)?;
        let key = parts
            .next()
            .and_then(|k| u64::from_str_radix(k, 16).ok())
            .and_then(|k| RemoteKey::try_from(k).ok())
            .ok_or_else(bad)?;
        let len = parts.next().and_then(|l| l.parse().ok()).ok_or_else(bad)?;
        if parts.next().is_some() {
            return Err(bad());
        }
        Ok(RemoteWindow {
            node,
            port,
            key,
            len,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_text_round_trips_and_rejects_garbage() {
        let window = RemoteWindow {
            node: 2,
            port: 3,
            key: RemoteKey(0xabc),
            len: 4096,
        };
        assert_eq!(window.to_string(), "2:3:0000000000000abc:4096");
        assert_eq!(window.to_string().parse::<RemoteWindow>().unwrap(), window);
        let wide = RemoteWindow {
            node: 65535,
            port: 65535,
            key: RemoteKey(u64::MAX - 1),
            len: u64::MAX,
        };
        assert_eq!(wide.to_string().parse::<RemoteWindow>().unwrap(), wide);
        let too_wide = "0:1:1ffffffffffffffff:2";
        let no_key = "0:1:0000000000000000:2";
        let no_node = "1:0000000000000abc:2";
        for bad in [
            "",
            "1:2",
            "0:x:1:2",
            "0:1:zz:2",
            "0:1:2:3:4",
            too_wide,
            no_key,
            no_node,
        ] {
            assert!(bad.parse::<RemoteWindow>().is_err(), "{bad}");
        }
    }
}
