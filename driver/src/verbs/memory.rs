//! Registered memory and the local ranges requests name.
//!
//! **What keeps memory allocated.** Memory the device may still read or
//! write must stay allocated to what the program meant it for, beyond the
//! borrows of safe code: a request already posted runs after the region
//! that named it is dropped, and a window leaked with `mem::forget` stays
//! bound. The safe registrations therefore take a share of the memory, not
//! a borrow: a region over an arena buffer ([`Context::register_buffer`],
//! [`Context::register_buffer_part`], [`Context::register_owned`]) keeps
//! the buffer's chunk allocated; a window bound on the region keeps a share
//! until it is revoked (for ever, if leaked); and a posted request naming
//! the region keeps one until the device has finished it (the queue pair
//! holds it until the send queue's retired position passes the request,
//! see [`pindown_uapi::queue`]). Dropping the buffer then only drops the
//! program's handle: its memory goes back to the arena when the last share
//! goes. The forms that name memory the driver cannot hold a share of
//! ([`Context::register`], [`Context::register_bytes`],
//! [`Local::from_raw`]) are `unsafe`, and their contract is to keep the
//! memory as the shares would.

use std::any::Any;
use std::fmt;
use std::ops::DerefMut;
use std::sync::Arc;

use stable_deref_trait::StableDeref;

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
    keep: KeepRef<'r>,
    /// Taken from a region, the address of the region's context: this
    /// process maps the range at its address (registered memory is
    /// identity-mapped) for as long as the borrow lasts, so that context's
    /// queue pairs may read it when they post an inline write.
    mapped_in: Option<usize>,
}

/// A share of memory the device may use: while one lives, the memory
/// stays allocated to its owner (an arena chunk is not handed out again,
/// memory a region owns is not given back).
pub(crate) type KeepAlive = Arc<dyn Any + Send + Sync>;

/// Memory of the program's that a region took ([`Context::register_memory`]),
/// never dereferenced while shared.
struct OwnedMemory<M>(M);

/// The share a [`Local`] range's region holds, if any, borrowed: a
/// request takes its own share of it when posted.
#[derive(Clone, Copy, Default)]
pub(crate) struct KeepRef<'r>(Option<&'r KeepAlive>);

impl<'r> KeepRef<'r> {
    /// The share borrowed, if any.
    pub(crate) fn get(self) -> Option<&'r KeepAlive> {
        self.0
    }
}

impl fmt::Debug for KeepRef<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_some() { "kept" } else { "raw" })
    }
}

impl PartialEq for KeepRef<'_> {
    fn eq(&self, other: &Self) -> bool {
        match (self.0, other.0) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            (None, None) => true,
            _ => false,
        }
    }
}

impl Eq for KeepRef<'_> {}

impl<'r> Local<'r> {
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
            keep: KeepRef(None),
            mapped_in: None,
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

    /// The address of the context whose region the range was taken from
    /// (this process maps it at its address); `None` for a range made by
    /// [`Local::from_raw`].
    pub(crate) fn mapped_in(&self) -> Option<usize> {
        self.mapped_in
    }

    /// The share of the memory a request naming the range takes.
    pub(crate) fn keep(&self) -> KeepRef<'r> {
        self.keep
    }
}

impl<T: Transport + 'static> Context<T> {
    /// Registers `[addr, addr + len)`, any memory this process maps, with
    /// the device (a pin-down cache hit if it is registered already; see
    /// [`crate::reach`] for what a first registration does). The
    /// region borrows the context; it is deregistered by
    /// [`MemoryRegion::deregister`] or when dropped.
    ///
    /// The safe forms keep a share of the memory for as long as the
    /// device may use it (see the module documentation):
    /// [`register_memory`](Context::register_memory),
    /// [`register_buffer`](Context::register_buffer),
    /// [`register_buffer_part`](Context::register_buffer_part) and
    /// [`register_owned`](Context::register_owned).
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
    /// does not change. An inline write ([`Entry::inline`](super::opcode::Entry::inline))
    /// from the range reads its bytes on the posting thread when it is
    /// posted: no other thread may be writing them then.
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
            keep: None,
            addr,
            len,
        })
    }

    /// Registers a whole buffer of the context's arena. The region keeps a
    /// share of the buffer's chunk, and so does every window bound on it
    /// and every request posted naming it, until the device is done with
    /// it: dropping the buffer meanwhile does not hand its memory to the
    /// next allocation.
    pub fn register_buffer(&self, buffer: &DmaBuffer) -> Result<MemoryRegion<'_, T>, VerbsError> {
        self.register_buffer_part(buffer, 0, buffer.len())
    }

    /// Registers `[offset, offset + len)` of a buffer (a sub-range, for
    /// example at an unaligned start), keeping a share of its chunk as
    /// [`register_buffer`](Self::register_buffer) does.
    pub fn register_buffer_part(
        &self,
        buffer: &DmaBuffer,
        offset: usize,
        len: usize,
    ) -> Result<MemoryRegion<'_, T>, VerbsError> {
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
        // of the arena that the region's share keeps allocated while the
        // region lives, and that the shares of its windows and posted
        // requests keep allocated while the device may use them; the chunk
        // is reachable only through volatile copies, which tolerate the
        // device's writes.
        let region = unsafe { self.pin_range(buffer.iova() + offset as u64, len as u64)? };
        Ok(MemoryRegion {
            keep: Some(buffer.keep_alive()),
            ..region
        })
    }

    /// Registers a whole buffer of the context's arena and keeps it: the
    /// region owns the buffer ([`MemoryRegion::buffer`]), so a library can
    /// keep the two together (in a struct, or in a
    /// [`RegionWindow`](super::RegionWindow)). On failure the buffer is
    /// freed.
    pub fn register_owned(&self, buffer: DmaBuffer) -> Result<MemoryRegion<'_, T>, VerbsError> {
        let region = self.register_buffer(&buffer)?;
        Ok(MemoryRegion {
            owned: Some(buffer),
            ..region
        })
    }

    /// Registers ordinary memory of the process and takes it: a `Vec<u8>`,
    /// a `Box<[u8]>`, any owner whose bytes stay where they are when it
    /// moves. The region keeps a share of it, and so does every window
    /// bound on the region and every request posted naming it, until the
    /// device is done with it; [`MemoryRegion::into_memory`] gives it
    /// back once no share is left. On failure the memory is dropped.
    ///
    /// ```no_run
    /// # use std::time::Duration;
    /// # use pindown_driver::verbs::{opcode::Read, Context, RemoteWindow};
    /// # fn f(context: &Context, peer: RemoteWindow) -> Result<(), Box<dyn std::error::Error>> {
    /// let region = context.register_memory(vec![0u8; 4096])?;
    /// let mut cq = context.create_completion_queue();
    /// let mut qp = context.create_queue_pair(&mut cq)?;
    /// qp.post(&[Read::new(region.local(0, 4096)?, peer.at(0)).build().signaled()])?;
    /// cq.wait(Duration::from_secs(1))?.next().ok_or("no completion")?.result()?;
    /// qp.release_finished()?; // the read has finished: its share goes
    /// let bytes: Vec<u8> = region.into_memory().map_err(|_| "still shared")?;
    /// # Ok(()) }
    /// ```
    pub fn register_memory<M>(&self, mut memory: M) -> Result<MemoryRegion<'_, T>, VerbsError>
    where
        M: StableDeref + DerefMut<Target = [u8]> + Send + Sync + 'static,
    {
        let bytes = memory.deref_mut();
        let (addr, len) = (bytes.as_mut_ptr() as u64, bytes.len() as u64);
        // SAFETY: the bytes belong to `memory`, which moves into the
        // region's share without moving them (StableDeref); they stay
        // allocated while any share lives (the region's, its windows',
        // its posted requests'), and nothing dereferences `memory` until
        // `into_memory` takes it back from the last share.
        let region = unsafe { self.pin_range(addr, len)? };
        let keep: KeepAlive = Arc::new(OwnedMemory(memory));
        Ok(MemoryRegion {
            keep: Some(keep),
            ..region
        })
    }

    /// Registers ordinary memory of the process: a `Vec`'s or an array's
    /// bytes, on the heap or the stack. The region holds the exclusive
    /// borrow, so nothing reads or frees the bytes through safe code while
    /// the region lives.
    ///
    /// # Safety
    ///
    /// The borrow ends with the region, and the driver cannot hold a share
    /// of memory it did not allocate: the caller keeps the bytes allocated
    /// and unread (no reference reads them) until every request naming
    /// them has finished and every window bound on the region is revoked,
    /// never leaked. A request has finished once its completion has
    /// arrived, or once
    /// [`QueuePair::all_finished`](super::QueuePair::all_finished) holds;
    /// a later request's completion does not tell, since requests on the
    /// fabric finish out of order (unless the later one is fenced). A
    /// library that owns the memory it registers (a `Box<[u8]>`, a `Vec`
    /// it keeps until the operation is done) meets this; see the module
    /// documentation.
    ///
    /// ```compile_fail,E0502
    /// # use pindown_driver::verbs::Context;
    /// # fn f(context: &Context) -> Result<(), Box<dyn std::error::Error>> {
    /// let mut buffer = vec![0u8; 4096];
    /// // SAFETY: nothing is posted and no window is bound.
    /// let region = unsafe { context.register_bytes(&mut buffer)? };
    /// println!("{}", buffer[0]); // the device may be writing it
    /// # drop(region);
    /// # Ok(()) }
    /// ```
    pub unsafe fn register_bytes<'a>(
        &'a self,
        bytes: &'a mut [u8],
    ) -> Result<MemoryRegion<'a, T>, VerbsError> {
        // SAFETY: the region borrows `bytes` exclusively for 'a, so the
        // memory stays allocated to the caller and no reference reads it
        // while the region lives; beyond it, the caller's contract.
        unsafe { self.pin_range(bytes.as_mut_ptr() as u64, bytes.len() as u64) }
    }
}

/// A context's address, which names it among the live ones (a region's
/// range may go inline only on a queue pair of the same context).
pub(crate) fn context_address<T: Transport + 'static>(context: &Context<T>) -> usize {
    context as *const Context<T> as usize
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
    /// The region's share of its memory, when the driver allocated it.
    keep: Option<KeepAlive>,
    addr: u64,
    len: u64,
}

impl<'c, T: Transport + 'static> MemoryRegion<'c, T> {
    /// First byte of the region.
    pub fn iova(&self) -> u64 {
        self.addr
    }

    /// The buffer a [`Context::register_owned`] region owns.
    pub(super) fn owned_buffer(&self) -> Option<&DmaBuffer> {
        self.owned.as_ref()
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
    /// finds one that is not. A region whose memory was unmapped must not
    /// name a request's local range any more: an inline write from it
    /// reads the unmapped address when it is posted.
    pub fn is_current(&self) -> bool {
        self.registration.is_current()
    }

    /// `[offset, offset + len)` of the region, to name in a request; it
    /// borrows the region.
    pub fn local(&self, offset: u64, len: u32) -> Result<Local<'_>, VerbsError> {
        Ok(Local {
            iova: self.iova_at(offset, u64::from(len))?,
            len,
            keep: KeepRef(self.keep.as_ref()),
            mapped_in: Some(context_address(self.context)),
        })
    }

    /// The context the region is registered with.
    pub(super) fn context(&self) -> &'c Context<T> {
        self.context
    }

    /// The region's share of its memory, if the driver holds one.
    pub(super) fn keep_alive(&self) -> Option<&KeepAlive> {
        self.keep.as_ref()
    }

    /// Releases the registration and gives back the memory
    /// [`Context::register_memory`] took, once nothing else holds a share
    /// of it: no window bound on the region (revoke them first) and no
    /// request naming it that its queue pair still keeps (the queue pair
    /// lets go of finished requests' shares when it is dropped, when
    /// [`QueuePair::release_finished`](super::QueuePair::release_finished)
    /// is called, and from time to time as it posts). Otherwise, or if the
    /// region holds other memory or memory of another type, the region
    /// comes back unchanged.
    pub fn into_memory<M: Any + Send + Sync>(mut self) -> Result<M, Self> {
        let Some(keep) = self.keep.take() else {
            return Err(self);
        };
        let owned = match keep.downcast::<OwnedMemory<M>>() {
            Ok(owned) => owned,
            Err(keep) => {
                self.keep = Some(keep);
                return Err(self);
            }
        };
        match Arc::try_unwrap(owned) {
            Ok(OwnedMemory(memory)) => {
                drop(self);
                Ok(memory)
            }
            Err(owned) => {
                self.keep = Some(owned);
                Err(self)
            }
        }
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
            keep,
            ..
        } = self;
        let pinner = context.cache.pinner();
        let before = pinner.unmap_failures();
        drop(registration);
        drop(owned);
        drop(keep);
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
