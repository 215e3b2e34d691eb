//! Registered memory and the local ranges requests name.

use std::fmt;
use std::sync::Arc;

use pindown_pincache::Registration;

use super::{Context, VerbsError};
use crate::arena::DmaBuffer;
use crate::pinner::IotlbPinner;
use crate::transport::Transport;

/// A local memory range named in a work request: an IOVA and a length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Local {
    /// First byte (the arena is identity-mapped: its virtual address).
    pub iova: u64,
    /// Bytes.
    pub len: u32,
}

impl Local {
    /// The range `[iova, iova + len)`.
    pub fn new(iova: u64, len: u32) -> Self {
        Local { iova, len }
    }
}

impl<T: Transport + 'static> Context<T> {
    /// Registers `[addr, addr + len)` of the arena with the device (a
    /// pin-down cache hit if it is registered already).
    pub fn register(&self, addr: u64, len: u64) -> Result<MemoryRegion<'_, T>, VerbsError> {
        if len == 0 || !self.arena.contains(addr, len as usize) {
            return Err(VerbsError::NotInArena { addr, len });
        }
        let registration = self.cache.pin(addr as usize, len as usize)?;
        Ok(MemoryRegion {
            registration,
            addr,
            len,
        })
    }

    /// Registers a whole buffer.
    pub fn register_buffer(&self, buffer: &DmaBuffer) -> Result<MemoryRegion<'_, T>, VerbsError> {
        self.register(buffer.iova(), buffer.len() as u64)
    }
}

/// Registered memory: the device may reach it while this lives.
pub struct MemoryRegion<'c, T: Transport + 'static> {
    registration: Registration<'c, IotlbPinner<Arc<T>>>,
    addr: u64,
    len: u64,
}

impl<T: Transport + 'static> MemoryRegion<'_, T> {
    /// First byte of the region.
    pub fn iova(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the region is empty (never: registration needs a byte).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The pinned range backing the region (page aligned, possibly larger).
    pub fn pinned(&self) -> pindown_pincache::PageRange {
        self.registration.region()
    }

    /// `[offset, offset + len)` of the region, to name in a request.
    pub fn local(&self, offset: u64, len: u32) -> Result<Local, VerbsError> {
        Ok(Local::new(self.iova_at(offset, u64::from(len))?, len))
    }

    pub(super) fn iova_at(&self, offset: u64, len: u64) -> Result<u64, VerbsError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(self.addr + offset),
            _ => Err(VerbsError::OutOfRegion {
                offset,
                len,
                region_len: self.len,
            }),
        }
    }
}

impl<T: Transport + 'static> fmt::Debug for MemoryRegion<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("iova", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .finish()
    }
}
