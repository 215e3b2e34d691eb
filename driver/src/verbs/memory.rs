//! Registered memory and the local ranges requests name.

use std::fmt;
use std::marker::PhantomData;

use pindown_pincache::{CacheError, PinError, Registration};

use super::context::ContextPinner;
use super::{Context, VerbsError};
use crate::arena::DmaBuffer;
use crate::reach::ReachError;
use crate::transport::{Transport, VhostUserTransport};

/// A local memory range a work request names: part of a
/// [`MemoryRegion`], which it borrows (taken with [`MemoryRegion::local`]),
/// so that no request can name memory whose registration is gone.
///
/// ```no_run
/// # use pindown_driver::verbs::{opcode::Write, Context, QueuePair};
/// # fn f(context: &Context, qp: &mut QueuePair<'_>, to: pindown_uapi::RemoteAddress)
/// #     -> Result<(), Box<dyn std::error::Error>> {
/// let buffer = context.alloc(64, 64)?;
/// let region = context.register_buffer(&buffer)?;
/// let entry = Write::new(region.local(0, 64)?, to).build();
/// qp.post(&[entry])?;
/// region.deregister()?; // the request is posted: the region may go
/// # Ok(()) }
/// ```
///
/// Deregistering first does not compile, since the entry still borrows
/// the region:
///
/// ```compile_fail,E0505
/// # use pindown_driver::verbs::{opcode::Write, Context, QueuePair};
/// # fn f(context: &Context, qp: &mut QueuePair<'_>, to: pindown_uapi::RemoteAddress)
/// #     -> Result<(), Box<dyn std::error::Error>> {
/// let buffer = context.alloc(64, 64)?;
/// let region = context.register_buffer(&buffer)?;
/// let entry = Write::new(region.local(0, 64)?, to).build();
/// region.deregister()?;
/// qp.post(&[entry])?;
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Local<'r> {
    iova: u64,
    len: u32,
    region: PhantomData<&'r ()>,
}

impl Local<'_> {
    /// A range no region vouches for, to hand the device addresses it must
    /// refuse (tests of the device's checks) or to span several regions.
    ///
    /// # Safety
    ///
    /// Until the request naming the range has completed, every registered
    /// byte of `[iova, iova + len)` must stay registered and allocated to
    /// what the request is meant to read or write: the device reads or
    /// writes whatever is registered there when it executes the request.
    /// Bytes that are not registered make the request fail with
    /// `LocalProtectionError` and are not touched.
    pub unsafe fn from_raw(iova: u64, len: u32) -> Local<'static> {
        Local {
            iova,
            len,
            region: PhantomData,
        }
    }

    /// First byte (arena memory is identity-mapped: its virtual address).
    pub fn iova(&self) -> u64 {
        self.iova
    }

    /// Length in bytes.
    pub fn len(&self) -> u32 {
        self.len
    }

    /// Whether the range is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl<T: Transport + 'static> Context<T> {
    /// Registers `[addr, addr + len)`, any memory this process maps, with
    /// the device (a pin-down cache hit if it is registered already; see
    /// the module documentation for what a first registration does). The
    /// region borrows the context; it is deregistered by
    /// [`MemoryRegion::deregister`] or when dropped.
    pub fn register(&self, addr: u64, len: u64) -> Result<MemoryRegion<'_, T>, VerbsError> {
        let (Ok(start), Ok(bytes)) = (usize::try_from(addr), usize::try_from(len)) else {
            return Err(ReachError::Unmapped { addr }.into());
        };
        let registration = self.cache.pin(start, bytes).map_err(registration_error)?;
        Ok(MemoryRegion {
            context: self,
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

/// Registered memory: the device may reach it while this lives (and, through
/// the pin-down cache, possibly longer: deregistering releases the
/// registration, and the cache unpins the pages when it needs the room or
/// when they are invalidated).
pub struct MemoryRegion<'c, T: Transport + 'static = VhostUserTransport> {
    context: &'c Context<T>,
    registration: Registration<'c, ContextPinner<T>>,
    addr: u64,
    len: u64,
}

impl<'c, T: Transport + 'static> MemoryRegion<'c, T> {
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

    /// Whether this registration still maps the memory's current pages:
    /// false once the memory was invalidated (unmapped, or
    /// [`Context::invalidate`](super::Context::invalidate)) while held. A
    /// library that keeps regions across uses registers again when it
    /// finds one that is not.
    pub fn is_current(&self) -> bool {
        self.registration.is_current()
    }

    /// `[offset, offset + len)` of the region, to name in a request; it
    /// borrows the region.
    pub fn local(&self, offset: u64, len: u32) -> Result<Local<'_>, VerbsError> {
        Ok(Local {
            iova: self.iova_at(offset, u64::from(len))?,
            len,
            region: PhantomData,
        })
    }

    /// The context the region is registered with.
    pub(super) fn context(&self) -> &'c Context<T> {
        self.context
    }

    /// Releases the registration, as dropping the region does, and reports
    /// whether the device could be told what that changed.
    ///
    /// Usually nothing changes in the device: the pin-down cache keeps the
    /// pages registered for the next registration of the same memory. When
    /// the pages were invalidated while the region held them
    /// ([`Context::invalidate`], or the memory going away), this was the
    /// last holder and their IOTLB entries go now: this returns once the
    /// device has answered, and fails with
    /// [`VerbsError::Deregistration`] if it could not be reached.
    pub fn deregister(self) -> Result<(), VerbsError> {
        let MemoryRegion {
            context,
            registration,
            ..
        } = self;
        let pinner = context.cache.pinner();
        let before = pinner.unmap_failures();
        drop(registration);
        match pinner.unmap_failures() - before {
            0 => Ok(()),
            failures => Err(VerbsError::Deregistration { failures }),
        }
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

/// A registration failure, with the reason memory is unreachable brought
/// out of the pinner's error.
fn registration_error(error: CacheError) -> VerbsError {
    match error {
        CacheError::Pin(PinError::Unreachable { source, range }) => {
            match source.downcast::<ReachError>() {
                Ok(reach) => VerbsError::Unreachable(*reach),
                Err(source) => VerbsError::Registration(CacheError::Pin(PinError::Unreachable {
                    range,
                    source,
                })),
            }
        }
        other => VerbsError::Registration(other),
    }
}
