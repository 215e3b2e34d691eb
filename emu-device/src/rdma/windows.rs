//! Windows: the parts of a port's memory that peers may reach.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};

use parking_lot::RwLock;
use uapi::{Access, RemoteKey};

/// Keys are unique across the device's life, so a revoked key never comes
/// back to name another window. Zero is never a key.
static NEXT_KEY: AtomicU32 = AtomicU32::new(1);

/// A live window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    /// First I/O virtual address of the window in its owner's memory.
    pub start: u64,
    /// Length in bytes.
    pub len: u64,
    /// What peers may do.
    pub access: Access,
}

impl Window {
    /// The owner's I/O virtual address of `[offset, offset + len)` inside the
    /// window, if it lies inside.
    pub fn resolve(&self, offset: u64, len: u64) -> Option<u64> {
        let end = offset.checked_add(len)?;
        (end <= self.len).then(|| self.start + offset)
    }
}

/// One port's windows.
#[derive(Debug, Default)]
pub struct WindowTable {
    windows: RwLock<HashMap<u32, Window>>,
}

impl WindowTable {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a window; returns its new key.
    pub fn bind(&self, window: Window) -> RemoteKey {
        let key = loop {
            let key = NEXT_KEY.fetch_add(1, Ordering::Relaxed);
            if key != 0 {
                break key;
            }
        };
        self.windows.write().insert(key, window);
        RemoteKey(key)
    }

    /// Removes a window; returns whether it was live.
    pub fn revoke(&self, key: RemoteKey) -> bool {
        self.windows.write().remove(&key.0).is_some()
    }

    /// The live window named by `key`.
    pub fn get(&self, key: RemoteKey) -> Option<Window> {
        self.windows.read().get(&key.0).copied()
    }

    /// Revokes every window (the owner went away).
    pub fn clear(&self) {
        self.windows.write().clear();
    }

    /// Number of live windows.
    pub fn len(&self) -> usize {
        self.windows.read().len()
    }

    /// Whether no window is live.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_never_reused_and_revoked_keys_stay_dead() {
        let table = WindowTable::new();
        let window = Window {
            start: 0x1000,
            len: 0x100,
            access: Access::REMOTE_READ,
        };
        let first = table.bind(window);
        assert!(table.revoke(first));
        let second = table.bind(window);
        assert_ne!(first, second);
        assert_eq!(table.get(first), None);
        assert_eq!(table.get(second), Some(window));
        assert!(!table.revoke(first));
    }

    #[test]
    fn resolve_checks_bounds_without_overflow() {
        let window = Window {
            start: 0x1000,
            len: 0x100,
            access: Access::REMOTE_WRITE,
        };
        assert_eq!(window.resolve(0, 0x100), Some(0x1000));
        assert_eq!(window.resolve(0xff, 1), Some(0x10ff));
        assert_eq!(window.resolve(0xff, 2), None);
        assert_eq!(window.resolve(u64::MAX, 2), None);
    }
}
