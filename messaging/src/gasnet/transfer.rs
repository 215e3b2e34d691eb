//! Puts and gets: contiguous (PIO, DMA, alignment fix-up, bounce), by
//! message, and strided / indexed / vector through remote vector access.

use std::ops::Deref;
use std::rc::Rc;

use stable_deref_trait::StableDeref;

use pindown_driver::verbs::opcode::{Entry, Read, Vector, Write};
use pindown_driver::verbs::{MemoryRegion, RemoteWindow};
use pindown_uapi::{Access, PortAddress, RemoteAddress, WorkRequest};

use super::descriptor_cache::{CacheCounters, Cached, DescriptorCache};
use pindown_uapi::pattern::{Block, BlockList, Dim, Pattern, Piece, MAX_BLOCKS_CAP, MAX_DIMS};
use pindown_uapi::queue::MAX_INLINE;

use super::{
    check_range, Endpoint, GetMode, Handle, Kind, Op, DMA_ALIGN, FLAG_INTERNAL, GETS_GIVEN_UP_KEPT,
    GET_DATA_BIT, INTERNAL_GET_REQUEST, MAX_REQUEST, SCRATCH_HEAD, SCRATCH_READ_HEAD,
    SCRATCH_READ_SMALL, SCRATCH_READ_TAIL, SCRATCH_SMALL, SCRATCH_TAIL,
};
use crate::engine::post_entries;
use crate::error::{Error, Result};

/// How one contiguous transfer moves: the integration point of the
/// descriptor cache ([`Endpoint::transfer_descriptor`] computes it for a
/// (source, destination, size); a cache keyed by the same triple returns a
/// stored one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TransferDescriptor {
    /// The whole transfer goes inline (PIO) from the staging buffer.
    pub pio: bool,
    /// The source is copied into a bounce buffer laid out like the
    /// destination first (their misalignments differ).
    pub bounce: bool,
    /// Unaligned bytes at the start, sent through the staging buffer.
    pub head: u64,
    /// Aligned bytes in the middle, by DMA.
    pub body: u64,
    /// Bytes after the last aligned word, through the staging buffer.
    pub tail: u64,
}

/// A repeated put's cached descriptor: its plan and the registration of
/// its source body, held while cached.
pub(super) struct CachedPut<'c> {
    descriptor: TransferDescriptor,
    region: Rc<MemoryRegion<'c>>,
    /// Where the body starts in `region`.
    body_offset: u64,
}

impl<'c> CachedPut<'c> {
    fn clone_shared(&self) -> CachedPut<'c> {
        CachedPut {
            descriptor: self.descriptor,
            region: Rc::clone(&self.region),
            body_offset: self.body_offset,
        }
    }
}

/// A promoted put: the work requests of its body, built once (without
/// their tag and flags, which each put sets).
pub(super) struct PrebuiltPut(Vec<WorkRequest>);

/// Puts' descriptors by (source address, target, destination offset,
/// bytes).
pub(super) type PutCache<'c> = DescriptorCache<(u64, u32, u64, u64), CachedPut<'c>, PrebuiltPut>;

/// The body writes of `cached` to `target_offset` of `remote`.
fn body_requests(
    cached: &CachedPut<'_>,
    remote: &RemoteWindow,
    target_offset: u64,
) -> Vec<WorkRequest> {
    let descriptor = cached.descriptor;
    let mut requests = Vec::new();
    let mut at = 0;
    while at < descriptor.body {
        let n = (descriptor.body - at).min(MAX_REQUEST);
        let Ok(local) = cached.region.local(cached.body_offset + at, n as u32) else {
            // Inside the registration by construction; a request that
            // cannot be built leaves the put unpromoted (built each time).
            return Vec::new();
        };
        let entry = Write::new(local, remote.at(target_offset + descriptor.head + at)).build();
        requests.push(*entry.request());
        at += n;
    }
    requests
}

/// Bytes a small get reads into scratch and copies out.
const SMALL_GET: u64 = MAX_INLINE as u64;

/// The fix-up split of `len` bytes to destination offset `destination`:
/// (head, body, tail).
fn split(destination: u64, len: u64) -> (u64, u64, u64) {
    let head = ((DMA_ALIGN - destination % DMA_ALIGN) % DMA_ALIGN).min(len);
    let tail = (len - head) % DMA_ALIGN;
    (head, len - head - tail, tail)
}

impl<'c> Endpoint<'c> {
    /// How a contiguous transfer of `size` bytes from local address
    /// `source` to offset `destination` of `target`'s segment moves: the
    /// integration point of the descriptor cache
    /// ([`Config::descriptor_cache`](super::Config)), which keys stored
    /// descriptors by these arguments. Every put and long payload asks
    /// here.
    pub fn transfer_descriptor(
        &self,
        source: u64,
        target: u32,
        destination: u64,
        size: u64,
    ) -> TransferDescriptor {
        // The plan does not depend on the target; a cache key does.
        let _ = target;
        if size <= u64::from(self.config.pio_max) {
            return TransferDescriptor {
                pio: true,
                bounce: false,
                head: 0,
                body: size,
                tail: 0,
            };
        }
        let bounce = source % DMA_ALIGN != destination % DMA_ALIGN;
        let (head, body, tail) = split(destination, size);
        TransferDescriptor {
            pio: false,
            bounce,
            head,
            body,
            tail,
        }
    }

    /// Posts the writes of a put and returns its operation's handle.
    pub(super) fn start_put(
        &mut self,
        target: u32,
        target_offset: u64,
        source: &[u8],
    ) -> Result<Handle> {
        self.check_target(target)?;
        let len = source.len() as u64;
        check_range(target_offset, len, self.layout.segment)?;
        let tag = self.tag();
        if len == 0 {
            return Ok(self.handle(tag));
        }
        let descriptor =
            self.transfer_descriptor(source.as_ptr() as u64, target, target_offset, len);
        let remote = self.peers[target as usize];
        let scratch = self.layout.scratch_at;
        if descriptor.pio {
            self.stage(scratch + SCRATCH_SMALL, source);
            let entry = Write::new(
                self.window
                    .region()
                    .local(scratch + SCRATCH_SMALL, len as u32)?,
                remote.at(target_offset),
            )
            .build()
            .inline()
            .user_data(tag)
            .signaled();
            post_entries(&mut self.qp, &mut self.cq, &mut self.stash, &[entry])?;
            self.counters.pio_writes += 1;
            self.ops.insert(tag, self.op(target, 1));
            return Ok(self.handle(tag));
        }
        if !descriptor.bounce && self.descriptors.is_some() {
            return self.put_cached(target, target_offset, source, descriptor, tag);
        }
        // The body's source: the caller's memory, or a bounce buffer whose
        // bytes sit at the destination's misalignment.
        let (bounce, region, body_offset) = if descriptor.bounce {
            let shift = target_offset % DMA_ALIGN;
            let buffer = self.context.alloc((len + 2 * DMA_ALIGN) as usize, 64)?;
            // SAFETY: the bounce buffer was just allocated, `len + 16`
            // bytes, and is this operation's alone.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    source.as_ptr(),
                    buffer.as_ptr().add(shift as usize),
                    source.len(),
                )
            };
            let region = self.context.register_owned(buffer)?;
            self.counters.bounced += 1;
            (true, region, shift + descriptor.head)
        } else {
            let (region, offset) = self.register_body(source, descriptor)?;
            (false, region, offset)
        };
        let count = self.post_put(
            tag,
            target,
            target_offset,
            source,
            descriptor,
            &region,
            body_offset,
            None,
        )?;
        let mut op = self.op(target, count);
        if bounce {
            op._bounce = Some(region);
        } else {
            op._regions.push(region);
        }
        self.ops.insert(tag, op);
        Ok(self.handle(tag))
    }

    /// Registers the part of `source` a DMA put reads (its aligned body,
    /// or all of it when there is none) and gives the body's offset in it.
    fn register_body(
        &self,
        source: &[u8],
        descriptor: TransferDescriptor,
    ) -> Result<(MemoryRegion<'c>, u64)> {
        // SAFETY (both registrations): the range lies inside `source`,
        // which stays allocated until the put's operation completes or is
        // settled: `put` and the long sends wait for it while they borrow
        // the bytes, and `put_nb` moves its source into the operation. The
        // device only reads it.
        Ok(if descriptor.body > 0 {
            let at = source.as_ptr() as u64 + descriptor.head;
            (unsafe { self.context.register(at, descriptor.body)? }, 0)
        } else {
            // No aligned body: the head and tail carry everything.
            let region = unsafe {
                self.context
                    .register(source.as_ptr() as u64, source.len() as u64)?
            };
            (region, descriptor.head)
        })
    }

    /// A DMA put through the descriptor cache: a hit reuses the source's
    /// registration (held while cached); a promoted hit posts the body's
    /// work requests as they were built, with every address and key
    /// resolved (the paper's descriptor promoted to the chip's memory).
    /// An entry whose registration the pin-down cache invalidated (its
    /// source freed, perhaps allocated again at the same address) is
    /// dropped and built anew.
    fn put_cached(
        &mut self,
        target: u32,
        target_offset: u64,
        source: &[u8],
        descriptor: TransferDescriptor,
        tag: u64,
    ) -> Result<Handle> {
        let len = source.len() as u64;
        let key = (source.as_ptr() as u64, target, target_offset, len);
        let cache = self.descriptors.as_mut().expect("a descriptor cache");
        if cache
            .peek(&key)
            .is_some_and(|cached| !cached.value().region.is_current())
        {
            // The source's memory was invalidated (freed, and maybe
            // allocated again at the same address): its registration
            // names old pages.
            cache.remove(&key);
        }
        let fresh = if cache.contains(&key) {
            None
        } else {
            Some(self.register_body(source, descriptor)?)
        };
        let remote = self.peers[target as usize];
        let cache = self.descriptors.as_mut().expect("a descriptor cache");
        let lookup = cache.lookup_or_insert_with(
            key,
            |_| {
                let (region, body_offset) = fresh.expect("registered on a miss");
                CachedPut {
                    descriptor,
                    region: Rc::new(region),
                    body_offset,
                }
            },
            |_, cached| PrebuiltPut(body_requests(cached, &remote.shared, target_offset)),
        );
        let (cached, prebuilt) = match &lookup.entry {
            Cached::Entry(v) => (v.clone_shared(), None),
            Cached::Uncached(v) => (v.clone_shared(), None),
            Cached::Promoted(v, p) => (
                v.clone_shared(),
                Some(p.0.clone()).filter(|requests| !requests.is_empty()),
            ),
        };
        drop(lookup);
        let count = self.post_put(
            tag,
            target,
            target_offset,
            source,
            cached.descriptor,
            &cached.region,
            cached.body_offset,
            prebuilt.as_deref(),
        )?;
        let mut op = self.op(target, count);
        op._cached = Some(cached.region);
        self.ops.insert(tag, op);
        Ok(self.handle(tag))
    }

    /// Stages a put's head and tail and posts its writes: the head and
    /// tail inline from scratch, the body by DMA from `region` at
    /// `body_offset` (or as the `prebuilt` requests), every write tagged
    /// `tag`. Returns how many writes went.
    #[allow(clippy::too_many_arguments)]
    fn post_put(
        &mut self,
        tag: u64,
        target: u32,
        target_offset: u64,
        source: &[u8],
        descriptor: TransferDescriptor,
        region: &MemoryRegion<'c>,
        body_offset: u64,
        prebuilt: Option<&[WorkRequest]>,
    ) -> Result<u32> {
        let len = source.len() as u64;
        let remote = self.peers[target as usize];
        let scratch = self.layout.scratch_at;
        let head = &source[..descriptor.head as usize];
        let tail = &source[(len - descriptor.tail) as usize..];
        self.stage(scratch + SCRATCH_HEAD, head);
        self.stage(scratch + SCRATCH_TAIL, tail);
        let own = self.window.region();
        let mut entries: Vec<Entry<'_>> = Vec::new();
        if descriptor.head > 0 {
            entries.push(
                Write::new(
                    own.local(scratch + SCRATCH_HEAD, descriptor.head as u32)?,
                    remote.at(target_offset),
                )
                .build()
                .inline(),
            );
        }
        match prebuilt {
            Some(requests) => {
                for request in requests {
                    // SAFETY: the request was built by `body_requests`
                    // from this put's cached registration, which the
                    // operation holds (`Op::_cached`) until it completes,
                    // and names the same target window and offsets.
                    entries.push(unsafe { Entry::from_raw(*request, None) });
                }
                self.counters.prebuilt_writes += requests.len() as u64;
            }
            None => {
                let mut at = 0;
                while at < descriptor.body {
                    let n = (descriptor.body - at).min(MAX_REQUEST);
                    entries.push(
                        Write::new(
                            region.local(body_offset + at, n as u32)?,
                            remote.at(target_offset + descriptor.head + at),
                        )
                        .build(),
                    );
                    at += n;
                }
            }
        }
        if descriptor.tail > 0 {
            entries.push(
                Write::new(
                    own.local(scratch + SCRATCH_TAIL, descriptor.tail as u32)?,
                    remote.at(target_offset + descriptor.head + descriptor.body),
                )
                .build()
                .inline(),
            );
        }
        let count = entries.len() as u32;
        let entries: Vec<Entry<'_>> = entries
            .into_iter()
            .map(|e| e.user_data(tag).signaled())
            .collect();
        post_entries(&mut self.qp, &mut self.cq, &mut self.stash, &entries)?;
        drop(entries);
        let pio = u64::from(descriptor.head > 0) + u64::from(descriptor.tail > 0);
        self.counters.pio_writes += pio;
        self.counters.dma_writes += u64::from(count) - pio;
        self.counters.fixup_bytes += descriptor.head + descriptor.tail;
        Ok(count)
    }

    /// The descriptor cache's counters (`None` without a cache).
    pub fn descriptor_counters(&self) -> Option<CacheCounters> {
        self.descriptors.as_ref().map(|cache| cache.counters())
    }

    fn op(&self, peer: u32, remaining: u32) -> Op<'c> {
        Op {
            remaining,
            failure: None,
            peer,
            copies: Vec::new(),
            _regions: Vec::new(),
            _bounce: None,
            _source: None,
            _cached: None,
        }
    }

    /// Copies `bytes` into this endpoint's private memory at `at` (scratch).
    fn stage(&self, at: u64, bytes: &[u8]) {
        assert!(at + bytes.len() as u64 <= self.layout.total);
        // SAFETY: `at..at + len` lies inside the endpoint's memory (the
        // assertion), in the private scratch area nothing else references
        // while staging (inline writes copy it when posted).
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                self.memory.as_ptr().add(at as usize),
                bytes.len(),
            )
        };
    }

    /// Writes `len` bytes of this rank's segment at `from` into `target`'s
    /// window at `to` (a by-message get's answer); the message after it is
    /// fenced behind these writes.
    pub(super) fn write_from_segment(
        &mut self,
        target: u32,
        from: u64,
        len: u64,
        to: RemoteAddress,
    ) -> Result<()> {
        let pio = len <= u64::from(self.config.pio_max);
        let region = self.window.region();
        let mut entries: Vec<Entry<'_>> = Vec::new();
        let mut at = 0;
        while at < len {
            let n = (len - at).min(MAX_REQUEST);
            let destination = RemoteAddress {
                offset: to.offset + at,
                ..to
            };
            let entry = Write::new(region.local(from + at, n as u32)?, destination)
                .build()
                .user_data(GET_DATA_BIT | u64::from(target));
            entries.push(if pio { entry.inline() } else { entry });
            at += n;
        }
        post_entries(&mut self.qp, &mut self.cq, &mut self.stash, &entries)?;
        if pio {
            self.counters.pio_writes += entries.len() as u64;
        } else {
            self.counters.dma_writes += entries.len() as u64;
        }
        Ok(())
    }

    /// Writes `source` into `target`'s segment at `target_offset`; returns
    /// once the bytes are there (and `source` may be reused).
    pub fn put(&mut self, target: u32, target_offset: u64, source: &[u8]) -> Result<()> {
        let handle = self.start_put(target, target_offset, source)?;
        self.wait(handle)
    }

    /// Starts writing `source` into `target`'s segment at `target_offset`;
    /// [`wait`](Self::wait) or [`wait_all`](Self::wait_all) completes it.
    /// The operation owns `source` (a `Vec`, a `Box<[u8]>`, an `Arc<[u8]>`
    /// shared with the caller...) until it completes, so the bytes stay
    /// allocated while the device reads them (GASNet leaves that to the
    /// caller). Small puts (PIO) are copied at once.
    pub fn put_nb<B>(&mut self, target: u32, target_offset: u64, source: B) -> Result<Handle>
    where
        B: StableDeref + Deref<Target = [u8]> + 'static,
    {
        let handle = self.start_put(target, target_offset, &source)?;
        if let Some(op) = self.ops.get_mut(&handle.tag) {
            op._source = Some(Box::new(source));
        }
        Ok(handle)
    }

    /// Reads `destination.len()` bytes of `target`'s segment at
    /// `target_offset` into `destination`, as [`Config::get`](super::Config)
    /// says.
    pub fn get(&mut self, target: u32, target_offset: u64, destination: &mut [u8]) -> Result<()> {
        self.check_target(target)?;
        check_range(target_offset, destination.len() as u64, self.layout.segment)?;
        if destination.is_empty() {
            return Ok(());
        }
        match self.config.get {
            GetMode::Native => self.get_native(target, target_offset, destination),
            GetMode::ByMessage => self.get_by_message(target, target_offset, destination),
        }
    }

    fn get_native(&mut self, target: u32, offset: u64, destination: &mut [u8]) -> Result<()> {
        self.counters.gets_native += 1;
        let len = destination.len() as u64;
        let remote = self.peers[target as usize];
        let scratch = self.layout.scratch_at;
        let tag = self.tag();
        let dest = destination.as_mut_ptr();
        let mut op = self.op(target, 0);
        if len <= SMALL_GET {
            // Small: into scratch, then copied (no registration).
            let entry = Read::new(
                self.window
                    .region()
                    .local(scratch + SCRATCH_READ_SMALL, len as u32)?,
                remote.at(offset),
            )
            .build()
            .user_data(tag)
            .signaled();
            post_entries(&mut self.qp, &mut self.cq, &mut self.stash, &[entry])?;
            op.remaining = 1;
            op.copies
                .push((scratch + SCRATCH_READ_SMALL, dest, len as usize));
            self.ops.insert(tag, op);
            return self.wait(self.handle(tag));
        }
        if destination.as_ptr() as u64 % DMA_ALIGN != offset % DMA_ALIGN {
            // Misaligned differently: into a bounce buffer at the source's
            // misalignment, then copied.
            let shift = offset % DMA_ALIGN;
            let buffer = self.context.alloc((len + 2 * DMA_ALIGN) as usize, 64)?;
            let region = self.context.register_owned(buffer)?;
            let mut entries = Vec::new();
            let mut at = 0;
            while at < len {
                let n = (len - at).min(MAX_REQUEST);
                entries.push(
                    Read::new(region.local(shift + at, n as u32)?, remote.at(offset + at))
                        .build()
                        .user_data(tag)
                        .signaled(),
                );
                at += n;
            }
            post_entries(&mut self.qp, &mut self.cq, &mut self.stash, &entries)?;
            op.remaining = entries.len() as u32;
            drop(entries);
            op.copies.push((shift, dest, len as usize));
            op._bounce = Some(region);
            self.counters.bounced += 1;
            self.ops.insert(tag, op);
            return self.wait(self.handle(tag));
        }
        let (head, body, tail) = split(offset, len);
        // SAFETY: the body lies inside `destination`, borrowed mutably for
        // this call, which returns only once the read has completed or is
        // settled (`wait`: nothing lands after).
        let region = unsafe {
            self.context
                .register(destination.as_ptr() as u64 + head, body)?
        };
        let own = self.window.region();
        let mut entries: Vec<Entry<'_>> = Vec::new();
        if head > 0 {
            entries.push(
                Read::new(
                    own.local(scratch + SCRATCH_READ_HEAD, head as u32)?,
                    remote.at(offset),
                )
                .build(),
            );
            op.copies
                .push((scratch + SCRATCH_READ_HEAD, dest, head as usize));
        }
        let mut at = 0;
        while at < body {
            let n = (body - at).min(MAX_REQUEST);
            entries.push(
                Read::new(region.local(at, n as u32)?, remote.at(offset + head + at)).build(),
            );
            at += n;
        }
        if tail > 0 {
            entries.push(
                Read::new(
                    own.local(scratch + SCRATCH_READ_TAIL, tail as u32)?,
                    remote.at(offset + head + body),
                )
                .build(),
            );
            // SAFETY (of the pointer arithmetic): `head + body < len`.
            op.copies.push((
                scratch + SCRATCH_READ_TAIL,
                dest.wrapping_add((head + body) as usize),
                tail as usize,
            ));
        }
        let entries: Vec<Entry<'_>> = entries
            .into_iter()
            .map(|e| e.user_data(tag).signaled())
            .collect();
        post_entries(&mut self.qp, &mut self.cq, &mut self.stash, &entries)?;
        op.remaining = entries.len() as u32;
        drop(entries);
        self.counters.fixup_bytes += head + tail;
        op._regions.push(region);
        self.ops.insert(tag, op);
        self.wait(self.handle(tag))
    }

    /// The paper's get over a write-only fabric: a request message per
    /// piece of the bounce area; the target writes the bytes into this
    /// rank's bounce area, then replies; the bytes are copied out.
    ///
    /// The bounce area is reachable only through a window bound for the
    /// target for this get alone (its key travels in each request), and
    /// revoked before the get returns, whatever happened: no other rank
    /// can write what this get returns, and a late reply to a get given
    /// up finds the window gone, so the next get need not wait for it.
    fn get_by_message(&mut self, target: u32, offset: u64, destination: &mut [u8]) -> Result<()> {
        self.counters.gets_by_message += 1;
        let piece = self.layout.bounce_bytes.clamp(1, u64::from(u32::MAX));
        let len = destination.len() as u64;
        let shared = self.peers[target as usize].shared;
        let window = self.context.bind_region_window(
            // SAFETY: `self.memory` is the endpoint's own memory.
            unsafe { super::register_memory(self.context, &self.memory)? },
            self.layout.bounce_at,
            self.layout.bounce_bytes.max(1),
            Access::REMOTE_WRITE,
            Some(PortAddress {
                node: shared.node,
                port: shared.port,
            }),
        )?;
        let key = window.remote().key.0;
        let mut at = 0;
        while at < len {
            let n = (len - at).min(piece);
            self.next_get = self.next_get.wrapping_add(1);
            let id = self.next_get;
            let from = offset + at;
            self.flush_outgoing()?;
            self.get_pending = Some((id, target));
            self.send_packet(
                target,
                Kind::Short,
                FLAG_INTERNAL,
                INTERNAL_GET_REQUEST,
                &[
                    id,
                    from as u32,
                    (from >> 32) as u32,
                    n as u32,
                    key as u32,
                    (key >> 32) as u32,
                ],
                &[],
                0,
            )?;
            if let Err(err) = self.wait_until(|ep| ep.get_replies.contains_key(&id)) {
                // Revoked (a barrier: nothing the target writes lands
                // after it) before the caller gets the memory back.
                drop(window);
                let given_up = self.get_pending.take().expect("the get in progress");
                if self.gets_given_up.len() == GETS_GIVEN_UP_KEPT {
                    self.gets_given_up.pop_front();
                }
                self.gets_given_up.push_back(given_up);
                return Err(err);
            }
            self.get_pending = None;
            let status = self.get_replies.remove(&id).unwrap_or(1);
            if status != 0 {
                return Err(Error::Gasnet(format!(
                    "rank {target} refused a get of {n} bytes at offset {from}"
                )));
            }
            // SAFETY: the bounce area lies inside this endpoint's memory
            // and holds `n <= bounce_bytes` bytes the target wrote before
            // its reply (fenced); the destination range is the caller's.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.memory.as_ptr().add(self.layout.bounce_at as usize),
                    destination.as_mut_ptr().add(at as usize),
                    n as usize,
                )
            };
            at += n;
        }
        drop(window);
        self.counters.bounced += 1;
        Ok(())
    }

    /// Writes `source`, laid out as `local`, into `target`'s segment at
    /// `target_offset` laid out as `remote`: one VECTOR_WRITE.
    fn put_patterns(
        &mut self,
        target: u32,
        target_offset: u64,
        remote: Pattern,
        source: &[u8],
        local: Pattern,
    ) -> Result<()> {
        let side = LocalSide::Caller(source.as_ptr(), source.len());
        let handle = self.start_vector(target, target_offset, remote, side, local, false)?;
        self.wait(handle)
    }

    /// Reads `target`'s segment at `target_offset`, laid out as `remote`,
    /// into `destination` laid out as `local`: one VECTOR_READ.
    fn get_patterns(
        &mut self,
        target: u32,
        target_offset: u64,
        remote: Pattern,
        destination: &mut [u8],
        local: Pattern,
    ) -> Result<()> {
        let side = LocalSide::Caller(destination.as_mut_ptr().cast_const(), destination.len());
        let handle = self.start_vector(target, target_offset, remote, side, local, true)?;
        self.wait(handle)
    }

    /// Starts one vector transfer between the local side (laid out by
    /// `local_pattern`) and `target`'s segment from `target_offset` (by
    /// `remote_pattern`).
    fn start_vector(
        &mut self,
        target: u32,
        target_offset: u64,
        remote_pattern: Pattern,
        local: LocalSide,
        local_pattern: Pattern,
        read: bool,
    ) -> Result<Handle> {
        self.check_target(target)?;
        if local_pattern.len != remote_pattern.len {
            return Err(Error::Gasnet(format!(
                "the source names {} bytes, the destination {}",
                local_pattern.len, remote_pattern.len
            )));
        }
        let tag = self.tag();
        if local_pattern.len == 0 {
            return Ok(self.handle(tag));
        }
        let (low, high) = remote_pattern
            .plan()
            .map_err(|e| Error::Gasnet(format!("the remote pattern: {e}")))?
            .hull()
            .unwrap_or((0, 0));
        if low < 0 {
            return Err(Error::Gasnet(
                "the remote pattern reaches before its offset".into(),
            ));
        }
        check_range(target_offset, high as u64, self.layout.segment)?;
        // The caller's memory is registered for the transfer (a pin-down
        // cache hit when it was used before); the segment is registered
        // already, as the endpoint's window.
        let (caller_region, offset, len) = match local {
            LocalSide::Caller(at, len) => {
                let len = u32::try_from(len)
                    .map_err(|_| Error::Gasnet("a local buffer of 4 GiB or more".into()))?;
                // SAFETY: `at` and `len` are the caller's buffer, borrowed
                // by the blocking call, whose `wait` returns only once the
                // transfer completed or, on any error, was settled (the
                // device finished it, or it or the peer is gone), so the
                // memory stays mapped while the registration and the
                // device use it.
                let region = unsafe { self.context.register(at as u64, u64::from(len))? };
                (Some(region), 0, len)
            }
            LocalSide::Segment(offset) => {
                check_range(offset, 0, self.layout.segment)?;
                // The segment's bytes from `offset`, as far as a local
                // range reaches (lengths are 32 bits).
                let len = (self.layout.segment - offset).min(u64::from(u32::MAX)) as u32;
                (None, offset, len)
            }
        };
        let whole = match &caller_region {
            Some(region) => region.local(0, len)?,
            None => self.window.region().local(offset, len)?,
        };
        let at = self.peers[target as usize].at(target_offset);
        let vector = if read {
            Vector::read(whole, local_pattern, at, remote_pattern)?
        } else {
            Vector::write(whole, local_pattern, at, remote_pattern)?
        };
        post_entries(
            &mut self.qp,
            &mut self.cq,
            &mut self.stash,
            &[vector.build().user_data(tag).signaled()],
        )?;
        drop(vector);
        let mut op = self.op(target, 1);
        op._regions.extend(caller_region);
        self.ops.insert(tag, op);
        self.counters.vector_transfers += 1;
        Ok(self.handle(tag))
    }

    /// GASNet's strided put: `counts[0]` contiguous bytes, repeated
    /// `counts[1]` times `source_strides[0]` / `target_strides[0]` apart,
    /// that `counts[2]` times `*_strides[1]` apart, and so on (strides in
    /// bytes, one fewer than counts). One VECTOR_WRITE naming both
    /// patterns.
    pub fn put_strided(
        &mut self,
        target: u32,
        target_offset: u64,
        target_strides: &[u64],
        source: &[u8],
        source_strides: &[u64],
        counts: &[u64],
    ) -> Result<()> {
        let remote = strided_pattern(target_strides, counts)?;
        let local = strided_pattern(source_strides, counts)?;
        self.put_patterns(target, target_offset, remote, source, local)
    }

    /// GASNet's strided get, the mirror of [`put_strided`](Self::put_strided):
    /// one VECTOR_READ.
    pub fn get_strided(
        &mut self,
        target: u32,
        target_offset: u64,
        target_strides: &[u64],
        destination: &mut [u8],
        destination_strides: &[u64],
        counts: &[u64],
    ) -> Result<()> {
        let remote = strided_pattern(target_strides, counts)?;
        let local = strided_pattern(destination_strides, counts)?;
        self.get_patterns(target, target_offset, remote, destination, local)
    }

    /// GASNet-EX's nonblocking strided put (`gex_VIS_StridedPutNB`) from
    /// this rank's own [`segment`](Self::segment), where a stencil keeps
    /// the planes it sends: the transfer of [`put_strided`](Self::put_strided)
    /// with the source pattern counted from `source_offset` of the
    /// segment. Returns once the request is posted; [`wait`](Self::wait)
    /// completes it, and the source bytes must not change until then. A
    /// message this endpoint sends to `target` afterwards arrives after
    /// the put's bytes (module documentation, *Order*), so this put and a
    /// short request make a notified put in one trip.
    pub fn put_strided_nb(
        &mut self,
        target: u32,
        target_offset: u64,
        target_strides: &[u64],
        source_offset: u64,
        source_strides: &[u64],
        counts: &[u64],
    ) -> Result<Handle> {
        let remote = strided_pattern(target_strides, counts)?;
        let local = strided_pattern(source_strides, counts)?;
        let side = LocalSide::Segment(source_offset);
        self.start_vector(target, target_offset, remote, side, local, false)
    }

    /// The mirror of [`put_strided_nb`](Self::put_strided_nb): reads
    /// `target`'s segment into this rank's segment from
    /// `destination_offset`; the bytes are there once [`wait`](Self::wait)
    /// returns for the handle.
    pub fn get_strided_nb(
        &mut self,
        target: u32,
        target_offset: u64,
        target_strides: &[u64],
        destination_offset: u64,
        destination_strides: &[u64],
        counts: &[u64],
    ) -> Result<Handle> {
        let remote = strided_pattern(target_strides, counts)?;
        let local = strided_pattern(destination_strides, counts)?;
        let side = LocalSide::Segment(destination_offset);
        self.start_vector(target, target_offset, remote, side, local, true)
    }

    /// GASNet's vector put (memvec lists): the bytes of `source`'s
    /// `(offset, len)` blocks, in order, into `target`'s segment blocks
    /// `(offset, len)`, in order; both lists name the same number of
    /// bytes, block boundaries need not agree.
    pub fn put_vector(
        &mut self,
        target: u32,
        target_list: &[(u64, u64)],
        source: &[u8],
        source_list: &[(u64, u64)],
    ) -> Result<()> {
        let remote = listed_pattern(target_list)?;
        let local = listed_pattern(source_list)?;
        self.put_patterns(target, 0, remote, source, local)
    }

    /// GASNet's vector get, the mirror of [`put_vector`](Self::put_vector).
    pub fn get_vector(
        &mut self,
        target: u32,
        target_list: &[(u64, u64)],
        destination: &mut [u8],
        destination_list: &[(u64, u64)],
    ) -> Result<()> {
        let remote = listed_pattern(target_list)?;
        let local = listed_pattern(destination_list)?;
        self.get_patterns(target, 0, remote, destination, local)
    }

    /// GASNet's indexed put (address lists): blocks of `source_len` bytes
    /// at `source_offsets` into blocks of `target_len` bytes at
    /// `target_offsets` of `target`'s segment; both sides name the same
    /// number of bytes.
    pub fn put_indexed(
        &mut self,
        target: u32,
        target_offsets: &[u64],
        target_len: u64,
        source: &[u8],
        source_offsets: &[u64],
        source_len: u64,
    ) -> Result<()> {
        let remote = indexed_pattern(target_offsets, target_len)?;
        let local = indexed_pattern(source_offsets, source_len)?;
        self.put_patterns(target, 0, remote, source, local)
    }

    /// GASNet's indexed get, the mirror of [`put_indexed`](Self::put_indexed).
    pub fn get_indexed(
        &mut self,
        target: u32,
        target_offsets: &[u64],
        target_len: u64,
        destination: &mut [u8],
        destination_offsets: &[u64],
        destination_len: u64,
    ) -> Result<()> {
        let remote = indexed_pattern(target_offsets, target_len)?;
        let local = indexed_pattern(destination_offsets, destination_len)?;
        self.get_patterns(target, 0, remote, destination, local)
    }
}

/// Where the local side of a vector transfer lies.
#[derive(Clone, Copy)]
enum LocalSide {
    /// The caller's memory (start, bytes), registered for the transfer.
    Caller(*const u8, usize),
    /// This rank's segment from an offset.
    Segment(u64),
}

fn pattern_error(e: impl std::fmt::Display) -> Error {
    Error::Gasnet(format!("access pattern: {e}"))
}

fn signed(x: u64) -> Result<i64> {
    i64::try_from(x).map_err(|_| Error::Gasnet(format!("offset or stride {x} too large")))
}

/// The pattern of GASNet's strided form: up to [`MAX_DIMS`] strided
/// levels in one piece, a fourth as the pattern's repetition, more as a
/// list of blocks.
pub(crate) fn strided_pattern(strides: &[u64], counts: &[u64]) -> Result<Pattern> {
    if counts.is_empty() || strides.len() + 1 != counts.len() {
        return Err(Error::Gasnet(format!(
            "{} counts and {} strides: a strided transfer has one stride per count after the first",
            counts.len(),
            strides.len()
        )));
    }
    let levels = strides.len();
    if counts.contains(&0) {
        return Ok(Pattern::contiguous(0));
    }
    if levels <= MAX_DIMS + 1 {
        let mut dims = [Dim::ONE; MAX_DIMS];
        for (level, dim) in dims.iter_mut().enumerate().take(levels.min(MAX_DIMS)) {
            *dim = Dim {
                count: counts[level + 1],
                stride: signed(strides[level])?,
            };
        }
        let (repeat, extent) = if levels == MAX_DIMS + 1 {
            (counts[MAX_DIMS + 1], signed(strides[MAX_DIMS])?)
        } else {
            (1, 0)
        };
        let piece = Piece::Strided {
            offset: 0,
            block: counts[0],
            dims,
        };
        return Pattern::new(vec![piece], repeat, extent).map_err(pattern_error);
    }
    // Deeper nests: every block listed, once their number is known to be
    // one a device takes (counted first, checked: a nest of large counts
    // would otherwise be listed block by block before any check).
    let block_count = counts[1..]
        .iter()
        .try_fold(1u64, |n, &count| n.checked_mul(count))
        .filter(|&n| n <= MAX_BLOCKS_CAP)
        .ok_or_else(|| {
            Error::Gasnet(format!(
                "a strided transfer of {levels} levels with counts {counts:?} lists more than \
                 {MAX_BLOCKS_CAP} blocks, the most a device takes"
            ))
        })?;
    let mut blocks = Vec::with_capacity(block_count as usize);
    let mut index = vec![0u64; levels];
    loop {
        let mut offset = 0u64;
        for (level, &i) in index.iter().enumerate() {
            offset = i
                .checked_mul(strides[level])
                .and_then(|o| o.checked_add(offset))
                .ok_or_else(|| Error::Gasnet("strided offsets overflow".into()))?;
        }
        blocks.push((offset, counts[0]));
        let mut level = 0;
        loop {
            if level == levels {
                return listed_pattern(&blocks);
            }
            index[level] += 1;
            if index[level] < counts[level + 1] {
                break;
            }
            index[level] = 0;
            level += 1;
        }
    }
}

/// A pattern listing `(offset, len)` blocks in order (empty ones left out).
pub(crate) fn listed_pattern(list: &[(u64, u64)]) -> Result<Pattern> {
    let blocks = list
        .iter()
        .filter(|&&(_, len)| len > 0)
        .map(|&(offset, len)| {
            Ok(Block {
                offset: signed(offset)?,
                len,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    if blocks.is_empty() {
        return Ok(Pattern::contiguous(0));
    }
    Pattern::new(
        vec![Piece::Indexed {
            offset: 0,
            blocks: BlockList::Listed(blocks),
        }],
        1,
        0,
    )
    .map_err(pattern_error)
}

/// A pattern of blocks of `len` bytes at each of `offsets`.
fn indexed_pattern(offsets: &[u64], len: u64) -> Result<Pattern> {
    let list: Vec<(u64, u64)> = offsets.iter().map(|&o| (o, len)).collect();
    listed_pattern(&list)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fix_up_splits_cover_the_transfer_and_align_the_body() {
        for destination in 0..16u64 {
            for len in 0..40u64 {
                let (head, body, tail) = split(destination, len);
                assert_eq!(head + body + tail, len);
                assert!(head < DMA_ALIGN && tail < DMA_ALIGN);
                if body > 0 {
                    assert_eq!((destination + head) % DMA_ALIGN, 0);
                    assert_eq!(body % DMA_ALIGN, 0);
                }
            }
        }
    }

    /// Every block a strided pattern names, by walking its plan.
    fn walk(pattern: &Pattern) -> Vec<(i64, u64)> {
        let plan = pattern.plan().expect("a valid pattern");
        let mut out: Vec<(i64, u64)> = Vec::new();
        for segment in plan.segments(0, plan.len()) {
            match out.last_mut() {
                Some(last) if last.0 + last.1 as i64 == segment.offset => last.1 += segment.len,
                _ => out.push((segment.offset, segment.len)),
            }
        }
        out
    }

    #[test]
    fn strided_patterns_of_every_depth_name_the_same_blocks() {
        // counts: 3 bytes, 2 x, 2 x, 2 x, 2 x, 2 x (five levels: listed).
        let counts = [3u64, 2, 2, 2, 2, 2];
        let strides = [4u64, 10, 25, 60, 130];
        for levels in 0..=5 {
            let pattern =
                strided_pattern(&strides[..levels], &counts[..levels + 1]).expect("pattern");
            let mut expected = Vec::new();
            let n: u64 = counts[1..=levels].iter().product();
            for k in 0..n {
                let (mut rest, mut offset) = (k, 0u64);
                for level in 0..levels {
                    offset += (rest % counts[level + 1]) * strides[level];
                    rest /= counts[level + 1];
                }
                expected.push((offset as i64, 3u64));
            }
            let mut merged: Vec<(i64, u64)> = Vec::new();
            for (offset, len) in expected {
                match merged.last_mut() {
                    Some(last) if last.0 + last.1 as i64 == offset => last.1 += len,
                    _ => merged.push((offset, len)),
                }
            }
            assert_eq!(walk(&pattern), merged, "levels {levels}");
        }
        assert!(strided_pattern(&[1], &[1]).is_err());
    }

    /// A deep nest whose blocks a device would never take is refused
    /// before any is listed (40^5 blocks would take 1.6 GiB to list).
    #[test]
    fn a_deep_strided_nest_of_too_many_blocks_is_refused_before_listing() {
        let counts = [1u64, 40, 40, 40, 40, 40];
        let strides = [1u64, 40, 1600, 64_000, 2_560_000];
        match strided_pattern(&strides, &counts) {
            Err(Error::Gasnet(why)) => assert!(why.contains("more than"), "{why}"),
            other => panic!("{other:?}"),
        }
        let overflowing = [1u64, u64::MAX, u64::MAX, 2, 2, 2];
        assert!(strided_pattern(&strides, &overflowing).is_err());
    }
}
