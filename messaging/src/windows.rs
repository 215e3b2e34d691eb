//! Windows over receive buffers, kept bound for reuse.
//!
//! A receive longer than [`crate::layout::LANDING_BYTES`] (or inside a
//! collective call) hands its sender a window over the receive buffer,
//! bound for the sender's port alone. Binding one is a request to the device;
//! receiving into the same buffer from the same peer again (the common
//! case: a loop over the same arrays) finds the window bound already.
//! Entries in use by a posted receive are never evicted; idle ones go
//! least recently used first once the cache is full, and with a capacity
//! of 0 none is kept: each is revoked as its last receive completes. A
//! window covers exactly the buffer it was bound for (or a larger one,
//! bound for the same peer, that contains it), never the memory around
//! it.

use pindown_driver::verbs::{Context, MemoryRegion, RegionWindow, RemoteWindow, VerbsError};
use pindown_uapi::{Access, PortAddress};

use crate::error::Result;

struct Entry<'c> {
    id: u64,
    /// The only port the window lets in.
    peer: PortAddress,
    access: Access,
    start: u64,
    len: u64,
    window: RegionWindow<'c>,
    in_use: u32,
    last_use: u64,
    /// Memory was invalidated since it was bound: perhaps its own (freed,
    /// and other memory mapped at its address), so it is never found again
    /// and goes once idle.
    stale: bool,
}

/// Windows over receive buffers.
pub(crate) struct WindowCache<'c> {
    /// Most recently bound last; searched from the end.
    entries: Vec<Entry<'c>>,
    capacity: usize,
    clock: u64,
    next_id: u64,
    hits: u64,
    misses: u64,
    /// The pin-down cache's invalidation count when entries were last
    /// known current.
    seen_invalidations: u64,
}

impl<'c> WindowCache<'c> {
    pub(crate) fn new(capacity: usize) -> Self {
        WindowCache {
            entries: Vec::new(),
            capacity,
            clock: 0,
            next_id: 0,
            hits: 0,
            misses: 0,
            seen_invalidations: 0,
        }
    }

    /// A window covering `[addr, addr + len)`, bound now or found bound,
    /// marked in use; with where it starts and the id to
    /// [`release`](Self::release) it by.
    pub(crate) fn acquire(
        &mut self,
        context: &'c Context,
        addr: u64,
        len: u64,
        peer: PortAddress,
    ) -> Result<(RemoteWindow, u64, u64)> {
        self.acquire_for(context, addr, len, Access::REMOTE_WRITE, peer)
    }

    /// [`acquire`](Self::acquire) a window granting `access` to `peer`.
    pub(crate) fn acquire_for(
        &mut self,
        context: &'c Context,
        addr: u64,
        len: u64,
        access: Access,
        peer: PortAddress,
    ) -> Result<(RemoteWindow, u64, u64)> {
        self.clock += 1;
        self.refresh(context);
        if let Some(entry) = self.entries.iter_mut().rev().find(|e| {
            !e.stale
                && e.peer == peer
                && e.access == access
                && e.start <= addr
                && addr + len <= e.start + e.len
        }) {
            entry.in_use += 1;
            entry.last_use = self.clock;
            self.hits += 1;
            return Ok((entry.window.remote(), entry.start, entry.id));
        }
        self.misses += 1;
        if self.entries.len() >= self.capacity.max(1) {
            self.evict();
        }
        // SAFETY: the caller's receive buffer, which its caller keeps
        // allocated while the window is in use (until the receive
        // completes); with a capacity of 0 (the default) each window is
        // revoked as its last receive completes. A program that sets a
        // capacity trusts its peers: an idle window stays bound over
        // memory the program may free, and the named peer could still
        // write there (`Config::window_cache`).
        let region = unsafe { self.register_evicting(context, addr, len)? };
        let window = match context.bind_region_window(region, 0, len, access, Some(peer)) {
            Err(VerbsError::ReadOnlyMemory { .. }) if access.contains(Access::REMOTE_WRITE) => {
                // The registration says read-only, yet the memory is the
                // caller's writable buffer: an old registration of memory
                // once at this address. Forget every translation of the
                // range and register it afresh.
                self.forget_range(addr, len);
                context.invalidate(addr, len);
                // SAFETY: as above.
                let region = unsafe { self.register_evicting(context, addr, len)? };
                context.bind_region_window(region, 0, len, access, Some(peer))?
            }
            other => other?,
        };
        let remote = window.remote();
        self.next_id += 1;
        self.entries.push(Entry {
            id: self.next_id,
            peer,
            access,
            start: addr,
            len,
            window,
            in_use: 1,
            last_use: self.clock,
            stale: false,
        });
        Ok((remote, addr, self.next_id))
    }

    /// Marks every entry stale, and lets the idle ones go, once registered
    /// memory went away anywhere since the last look: an entry may then
    /// name old pages at an address that now holds other memory. Call it
    /// before registering memory that may lie where such an entry did, so
    /// that the old registration goes before the new one is made.
    pub(crate) fn refresh(&mut self, context: &'c Context) {
        let invalidations = context.registration_stats().invalidations;
        if invalidations != self.seen_invalidations {
            self.seen_invalidations = invalidations;
            for entry in &mut self.entries {
                entry.stale = true;
            }
            self.evict_idle();
        }
    }

    /// Lets go of the idle windows overlapping `[addr, addr + len)` and
    /// marks the others stale.
    pub(crate) fn forget_range(&mut self, addr: u64, len: u64) {
        for entry in &mut self.entries {
            if entry.start < addr + len && addr < entry.start + entry.len {
                entry.stale = true;
            }
        }
        let mut i = 0;
        while i < self.entries.len() {
            if self.entries[i].stale && self.entries[i].in_use == 0 {
                let entry = self.entries.remove(i);
                if let Err(err) = entry.window.revoke() {
                    tracing::warn!("revoking a stale receive window failed: {err}");
                }
            } else {
                i += 1;
            }
        }
    }

    /// Registers `[addr, addr + len)`; if that fails, lets the idle
    /// windows go (they hold pinned memory: the pin limit may be what
    /// refused it) and tries once more.
    ///
    /// # Safety
    ///
    /// As for [`Context::register`].
    pub(crate) unsafe fn register_evicting(
        &mut self,
        context: &'c Context,
        addr: u64,
        len: u64,
    ) -> std::result::Result<MemoryRegion<'c>, VerbsError> {
        // SAFETY: the caller keeps `Context::register`'s contract.
        match unsafe { context.register(addr, len) } {
            Err(_) if self.evict_idle() > 0 => unsafe { context.register(addr, len) },
            other => other,
        }
    }

    /// Revokes every window no receive uses (their pinned memory goes
    /// back to the pin-down cache); how many.
    pub(crate) fn evict_idle(&mut self) -> usize {
        let before = self.entries.len();
        while self.entries.iter().any(|e| e.in_use == 0) {
            self.evict();
        }
        before - self.entries.len()
    }

    /// Marks window `id` no longer used by one receive.
    pub(crate) fn release(&mut self, id: u64) {
        if let Some(at) = self.entries.iter().position(|e| e.id == id) {
            let entry = &mut self.entries[at];
            entry.in_use = entry.in_use.saturating_sub(1);
            if (entry.stale || self.capacity == 0) && entry.in_use == 0 {
                let entry = self.entries.remove(at);
                if let Err(err) = entry.window.revoke() {
                    tracing::warn!("revoking a stale receive window failed: {err}");
                }
            }
        }
    }

    /// Takes window `id` from a receive whose wait failed, whose buffer
    /// goes back to its caller: revoked now, waiting however long the
    /// device takes, unless another receive still uses it (then it goes
    /// with that one, stale). Idle windows over the same memory go too.
    pub(crate) fn withdraw(&mut self, id: u64) {
        let Some(at) = self.entries.iter().position(|e| e.id == id) else {
            return;
        };
        let entry = &mut self.entries[at];
        entry.in_use = entry.in_use.saturating_sub(1);
        entry.stale = true;
        let (start, len) = (entry.start, entry.len);
        if entry.in_use == 0 {
            let entry = self.entries.remove(at);
            if let Err(err) = entry.window.revoke_waiting() {
                tracing::warn!("withdrawing a receive window: {err} (the device lets it go)");
            }
        }
        self.forget_range(start, len);
    }

    fn evict(&mut self) {
        let victim = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.in_use == 0)
            .min_by_key(|(_, e)| e.last_use)
            .map(|(i, _)| i);
        if let Some(i) = victim {
            let entry = self.entries.remove(i);
            if let Err(err) = entry.window.revoke() {
                tracing::warn!("revoking a cached receive window failed: {err}");
            }
        }
    }

    /// (hits, misses) so far.
    pub(crate) fn counts(&self) -> (u64, u64) {
        (self.hits, self.misses)
    }
}
