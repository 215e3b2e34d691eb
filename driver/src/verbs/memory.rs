//! Registered memory and the local ranges requests name.
//!
//! **What a region's borrow covers.** The safe registrations
//! ([`Context::register_bytes`], [`Context::register_buffer`],
//! [`Context::register_buffer_part`], [`Context::register_owned`]) keep
//! the memory allocated to its owner while the region lives, and a window
//! or a request under construction borrows the region. Two things outlive
//! that borrow, and the program must see to them as with every RDMA API
//! (this is a known gap of the safe API, not yet closed): a request
//! already posted (keep the region and its memory until its completion),
//! and a window leaked with `mem::forget` (it stays bound until the port
//! goes). Closing it needs the memory to be owned, not borrowed, by what
//! the device may still use: regions that own their memory, requests that
//! keep it until they finish, windows that keep it until revoked.

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
    ///
    /// The safe forms borrow the memory for the region's life:
    /// [`register_buffer`](Context::register_buffer),
    /// [`register_buffer_part`](Context::register_buffer_part) and
    /// [`register_bytes`](Context::register_bytes).
    ///
    /// # Safety
    ///
    /// The range holds no borrow of the memory it names. The caller keeps
    /// `[addr, addr + len)` allocated to what the device is meant to read
    /// or write there (not freed, not handed to another owner) while the
    /// region lives, and beyond it until every request naming the range
    /// has finished and every window over it is revoked: the device reads
    /// and writes whatever the range holds when it executes them. Memory
    /// the device writes (a read's destination, a window open to remote
    /// writes) must not be read through a Rust reference that assumes it
    /// does not change.
    ///
    /// Writable memory that maps a disk file privately (a program's
    /// initialized statics, for one) cannot be fenced while its pages first
    /// move into memory shared with the device (see [`crate::reach`]), so
    /// every form refuses it ([`ReachError::Unfenceable`]) but
    /// [`register_unfenced`](Context::register_unfenced).
    pub unsafe fn register(&self, addr: u64, len: u64) -> Result<MemoryRegion<'_, T>, VerbsError> {
        // SAFETY: the same contract.
        unsafe { self.pin_range(addr, len) }
    }

    /// Like [`register`](Context::register), but also moves writable
    /// memory that maps a disk file privately, which userfaultfd cannot
    /// write-protect while its pages move into memory shared with the
    /// device.
    ///
    /// # Safety
    ///
    /// As for [`register`](Context::register); and no other thread writes
    /// to the pages under the range during this call (a write made between
    /// the copy and the remapping of a page would be lost), not even to
    /// bytes outside the range on the same pages, such as a neighbouring
    /// static.
    pub unsafe fn register_unfenced(
        &self,
        addr: u64,
        len: u64,
    ) -> Result<MemoryRegion<'_, T>, VerbsError> {
        // SAFETY: the caller keeps `register`'s contract (this one's).
        crate::reach::allowing_unfenced_moves(|| unsafe { self.pin_range(addr, len) })
    }

    /// Registers `[addr, addr + len)`, refusing private disk-file memory
    /// that cannot be fenced unless the thread allows unfenced moves.
    ///
    /// # Safety
    ///
    /// As for [`register`](Self::register).
    unsafe fn pin_range(&self, addr: u64, len: u64) -> Result<MemoryRegion<'_, T>, VerbsError> {
        let (Ok(start), Ok(bytes)) = (usize::try_from(addr), usize::try_from(len)) else {
            return Err(ReachError::Unmapped { addr }.into());
        };
        let registration = self.cache.pin(start, bytes).map_err(registration_error)?;
        Ok(MemoryRegion {
            context: self,
            registration,
            owned: None,
            addr,
            len,
        })
    }

    /// Registers a whole buffer of the context's arena. The region borrows
    /// the buffer, which therefore outlives it: freeing the buffer (its
    /// chunk would go to the next allocation) under a live region, or under
    /// a window over it, does not compile.
    ///
    /// ```compile_fail,E0505
    /// # use pindown_driver::verbs::Context;
    /// # use pindown_uapi::Access;
    /// # fn f(context: &Context) -> Result<(), Box<dyn std::error::Error>> {
    /// let buffer = context.alloc(4096, 4096)?;
    /// let region = context.register_buffer(&buffer)?;
    /// let window = context.bind_window(&region, 0, 4096, Access::REMOTE_WRITE)?;
    /// drop(buffer);
    /// # drop(window);
    /// # Ok(()) }
    /// ```
    pub fn register_buffer<'a>(
        &'a self,
        buffer: &'a DmaBuffer,
    ) -> Result<MemoryRegion<'a, T>, VerbsError> {
        self.register_buffer_part(buffer, 0, buffer.len())
    }

    /// Registers `[offset, offset + len)` of a buffer (a sub-range, for
    /// example at an unaligned start). The region borrows the buffer.
    pub fn register_buffer_part<'a>(
        &'a self,
        buffer: &'a DmaBuffer,
        offset: usize,
        len: usize,
    ) -> Result<MemoryRegion<'a, T>, VerbsError> {
        match offset.checked_add(len) {
            Some(end) if end <= buffer.len() => {}
            _ => {
                return Err(VerbsError::OutOfRegion {
                    offset: offset as u64,
                    len: len as u64,
                    region_len: buffer.len() as u64,
                })
            }
        }
        // SAFETY: the range lies inside `buffer` (checked above), a chunk
        // of the arena that stays allocated to its owner while the returned
        // region (which borrows it for 'a) lives; DmaBuffer gives access to
        // its bytes only through volatile copies, which tolerate the
        // device's writes. Posted requests and leaked windows outlive the
        // borrow: the gap the module documentation states.
        unsafe { self.pin_range(buffer.iova() + offset as u64, len as u64) }
    }

    /// Registers a whole buffer of the context's arena and keeps it: the
    /// region owns the buffer ([`MemoryRegion::buffer`]) and frees it only
    /// after the registration is released, so a library can keep the two
    /// together (in a struct, or in a [`RegionWindow`](super::RegionWindow)).
    /// On failure the buffer is freed.
    pub fn register_owned(&self, buffer: DmaBuffer) -> Result<MemoryRegion<'_, T>, VerbsError> {
        // SAFETY: the region keeps `buffer` (its `owned` field, dropped
        // after the registration), so the chunk stays allocated to it while
        // the region lives; DmaBuffer gives access to its bytes only through
        // volatile copies, which tolerate the device's writes. Posted
        // requests and leaked windows outlive the region: the gap the
        // module documentation states.
        let region = unsafe { self.pin_range(buffer.iova(), buffer.len() as u64)? };
        Ok(MemoryRegion {
            owned: Some(buffer),
            ..region
        })
    }

    /// Registers ordinary memory of the process: a `Vec`'s or an array's
    /// bytes, on the heap or the stack. The region holds the exclusive
    /// borrow, so nothing reads or frees the bytes while the device may
    /// write them; read the results once the region is dropped.
    ///
    /// ```compile_fail,E0502
    /// # use pindown_driver::verbs::Context;
    /// # fn f(context: &Context) -> Result<(), Box<dyn std::error::Error>> {
    /// let mut buffer = vec![0u8; 4096];
    /// let region = context.register_bytes(&mut buffer)?;
    /// println!("{}", buffer[0]); // the device may be writing it
    /// # drop(region);
    /// # Ok(()) }
    /// ```
    pub fn register_bytes<'a>(
        &'a self,
        bytes: &'a mut [u8],
    ) -> Result<MemoryRegion<'a, T>, VerbsError> {
        // SAFETY: the region borrows `bytes` exclusively for 'a, so the
        // memory stays allocated to the caller and no reference reads it
        // while the region lives. Posted requests and leaked windows
        // outlive the borrow: the gap the module documentation states.
        unsafe { self.pin_range(bytes.as_mut_ptr() as u64, bytes.len() as u64) }
    }
}

/// Registered memory: the device may reach it while this lives (and, through
/// the pin-down cache, possibly longer: deregistering releases the
/// registration, and the cache unpins the pages when it needs the room or
/// when they are invalidated).
pub struct MemoryRegion<'c, T: Transport + 'static = VhostUserTransport> {
    context: &'c Context<T>,
    registration: Registration<'c, ContextPinner<T>>,
    /// The buffer a [`Context::register_owned`] region keeps; declared
    /// after the registration, so it is freed after the registration goes.
    owned: Option<DmaBuffer>,
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

    /// The buffer the region owns, if it was registered with
    /// [`Context::register_owned`].
    pub fn buffer(&self) -> Option<&DmaBuffer> {
        self.owned.as_ref()
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
            owned,
            ..
        } = self;
        let pinner = context.cache.pinner();
        let before = pinner.unmap_failures();
        drop(registration);
        drop(owned);
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
