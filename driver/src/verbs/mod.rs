//! The verbs API: what a messaging library programs against.
//!
//! The vocabulary is rdma-core's: a [`Context`] is an open port of the device;
//! a [`MemoryRegion`] is registered memory (through the pin-down cache, so a
//! region registered again is a cache hit); a [`MemoryWindow`] grants peers
//! remote access to part of a registered region and can be revoked; the
//! context's queue pair posts work requests built with [`opcode`] and its
//! completion queue reports them.
//!
//! Posting never blocks: [`Context::post`] puts a batch of requests on the
//! send ring and rings the doorbell once, only if the device asked for it
//! (`VIRTIO_F_EVENT_IDX`). [`Context::poll`] reaps completions without
//! blocking; [`Context::wait`] polls for a short while after activity and then
//! sleeps on the completion queue's eventfd.
//!
//! **Windows.** A window's [`RemoteKey`] is 64 bits no one but the device can
//! predict, never reused while the device runs. A remote access that no live
//! window grants (unknown or revoked key, a window bound to another port,
//! outside the window, a missing right) completes with
//! [`Status::RemoteAccessError`](pindown_uapi::Status) and
//! [`ErrorDetail::NotGranted`](pindown_uapi::ErrorDetail), whatever the cause; the
//! device counts the causes for the window's owner. A port holds a bounded
//! number of windows: beyond it, binding fails with
//! [`VerbsError::Refused`] carrying `LimitReached`/`WindowLimit`.
//!
//! **Memory.** Any memory this process maps can be registered, zero copy:
//! buffers of the DMA arena ([`Context::alloc`]), a heap `Vec`, a stack
//! array, memory a C library allocated, anonymous and file mappings. The
//! first registration of private memory moves its pages into memory shared
//! with the device at the same address; shared mappings of memory file
//! systems are handed to the device as files (see [`crate::reach`]).
//! Read-only memory registers read-only: binding a window that writes to
//! it fails with [`VerbsError::ReadOnlyMemory`]. Holes, disk files mapped
//! `MAP_SHARED` and memory without access fail with
//! [`VerbsError::Unreachable`]. A request naming local memory that is not
//! registered completes with
//! [`Status::LocalProtectionError`](pindown_uapi::Status).

pub mod opcode;

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::path::Path;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use pindown_pincache::{CacheConfig, CacheError, CacheStats, PinCache, PinError, Registration};
use pindown_uapi::{
    Access, Completion, DecodeError, DeviceInfo, Operation, RemoteAddress, RemoteKey, RingLayout,
    WorkRequest, WrFlags, ABI_VERSION,
};

use crate::arena::{ArenaError, DmaArena, DmaBuffer};
use crate::pinner::IotlbPinner;
use crate::reach::{DeviceReach, ReachError, ReachStats};
use crate::transport::{
    self, CompletionEvent, Transport, TransportError, VhostUserConfig, VhostUserTransport,
};
use crate::virtqueue::{ChainElement, QueueError, SplitQueue};

pub use opcode::Entry;

/// `user_data` bit reserved for the driver's own requests.
const INTERNAL: u64 = 1 << 63;

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

/// Why a verbs call failed.
#[derive(Debug, thiserror::Error)]
pub enum VerbsError {
    /// Talking to the device failed (it may be gone).
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// The DMA arena could not serve the allocation.
    #[error(transparent)]
    Arena(#[from] ArenaError),
    /// A ring is broken (the device wrote something impossible).
    #[error(transparent)]
    Queue(#[from] QueueError),
    /// The pin-down cache could not register the memory.
    #[error(transparent)]
    Registration(#[from] CacheError),
    /// The send ring has room for fewer requests than were posted; nothing
    /// was posted. Reap completions and post again.
    #[error("send queue full: room for {free} requests, {wanted} posted")]
    QueueFull {
        /// Free slots.
        free: usize,
        /// Requests in the batch.
        wanted: usize,
    },
    /// The memory cannot be made reachable by the device (a hole, a disk
    /// file mapped `MAP_SHARED`, memory without access, ...).
    #[error(transparent)]
    Unreachable(#[from] ReachError),
    /// A window granting writes or atomics over memory that is registered
    /// read-only (mapped without `PROT_WRITE`).
    #[error(
        "[{addr:#x}, +{len}) is read-only memory: windows over it may grant remote reads only \
         (atomics and writes need memory mapped writable)"
    )]
    ReadOnlyMemory {
        /// Start of the window.
        addr: u64,
        /// Its length.
        len: u64,
    },
    /// A range beyond the end of the memory region it was taken from.
    #[error("[{offset}, +{len}) is outside the {region_len}-byte memory region")]
    OutOfRegion {
        /// Offset asked for.
        offset: u64,
        /// Length asked for.
        len: u64,
        /// The region's length.
        region_len: u64,
    },
    /// `user_data` with bit 63 set is reserved for the driver.
    #[error("user_data {0:#x} has bit 63 set, which the driver reserves")]
    ReservedUserData(u64),
    /// The device wrote a completion that does not decode.
    #[error("the device wrote an invalid completion: {0}")]
    BadCompletion(DecodeError),
    /// The device speaks another ABI version.
    #[error("device ABI version {device}, driver ABI version {driver}")]
    AbiMismatch {
        /// The device's version.
        device: u16,
        /// Ours.
        driver: u16,
    },
    /// A request the driver made on the caller's behalf failed.
    #[error("the device refused the request: {} ({})", .0.status, .0.detail)]
    Refused(Completion),
    /// No completion arrived in time.
    #[error("no completion within {0:?}")]
    Timeout(Duration),
    /// Waiting on the completion eventfd failed.
    #[error("waiting for completions failed: {0}")]
    Wait(std::io::Error),
}

/// How a [`Context`] is set up.
#[derive(Clone, Debug)]
pub struct ContextConfig {
    /// Size of the DMA arena: all memory the device may reach.
    pub arena_bytes: usize,
    /// Entries in the send and completion rings.
    pub queue_size: u16,
    /// The pin-down cache; `max_pinned_bytes: None` means the arena size.
    /// `max_entries` is lowered to what the transport can map
    /// ([`Transport::mapping_budget`]).
    pub cache: CacheConfig,
    /// How long [`Context::wait`] keeps polling after the last completion
    /// before it sleeps on the eventfd. `Duration::MAX`: never sleep (busy
    /// polling).
    pub spin: Duration,
}

impl Default for ContextConfig {
    fn default() -> Self {
        ContextConfig {
            arena_bytes: 64 << 20,
            queue_size: 256,
            cache: CacheConfig::default(),
            spin: Duration::from_micros(50),
        }
    }
}

/// Work requests in flight: the ring and the request slots it points at.
struct SendRing {
    queue: SplitQueue<u16>,
    slots: DmaBuffer,
    free: Vec<u16>,
}

impl SendRing {
    /// Takes back the slots of requests the device has executed.
    fn reap(&mut self) -> Result<(), QueueError> {
        while let Some((slot, _)) = self.queue.pop_used()? {
            self.free.push(slot);
        }
        Ok(())
    }
}

/// Completion buffers lent to the device, and completions already reaped.
struct CompletionRing {
    queue: SplitQueue<u16>,
    slots: DmaBuffer,
    /// The caller's completions, in order.
    ready: VecDeque<Completion>,
    /// Completions of the driver's own requests, by user data.
    internal: HashMap<u64, Completion>,
}

impl CompletionRing {
    /// Moves every completion the device has written into `ready` or
    /// `internal`, and lends the buffers back. Returns how many arrived.
    fn pump(&mut self) -> Result<usize, VerbsError> {
        let mut arrived = 0;
        while let Some((slot, _written)) = self.queue.pop_used()? {
            let mut bytes = [0u8; Completion::SIZE];
            self.slots
                .read_at(usize::from(slot) * Completion::SIZE, &mut bytes);
            let iova = self.slots.iova() + (usize::from(slot) * Completion::SIZE) as u64;
            self.queue.add(
                &[ChainElement::writable(iova, Completion::SIZE as u32)],
                slot,
            )?;
            let completion = Completion::decode(&bytes).map_err(VerbsError::BadCompletion)?;
            if completion.user_data & INTERNAL != 0 {
                self.internal.insert(completion.user_data, completion);
            } else {
                self.ready.push_back(completion);
            }
            arrived += 1;
        }
        Ok(arrived)
    }
}

/// The pinner of a context: mlock plus IOTLB entries wherever its
/// [`DeviceReach`] places the memory.
type ContextPinner<T> = IotlbPinner<Arc<T>, DeviceReach<Arc<T>>>;

/// An open port of the device: its rings, its DMA arena and its pin-down
/// cache.
pub struct Context<T: Transport + 'static = VhostUserTransport> {
    transport: Arc<T>,
    arena: Arc<DmaArena>,
    cache: PinCache<ContextPinner<T>>,
    info: DeviceInfo,
    layout: RingLayout,
    send: Mutex<SendRing>,
    completion: Mutex<CompletionRing>,
    completion_event: CompletionEvent,
    next_internal: AtomicU64,
    spin: Duration,
}

impl Context<VhostUserTransport> {
    /// Connects to the device's vhost-user socket at `path` and sets up a
    /// port: features, memory table, rings, pin-down cache, and the device's
    /// description of the port.
    pub fn open(path: impl AsRef<Path>, config: ContextConfig) -> Result<Self, VerbsError> {
        let transport = VhostUserTransport::connect(path, VhostUserConfig::default())?;
        Self::with_transport(transport, config)
    }
}

impl<T: Transport + 'static> Context<T> {
    /// Sets up a port over an already connected transport.
    pub fn with_transport(transport: T, config: ContextConfig) -> Result<Self, VerbsError> {
        let transport = Arc::new(transport);
        let features = transport.negotiate_features(transport::DEFAULT_FEATURES)?;
        let event_idx = features & transport::F_EVENT_IDX != 0;
        let arena = DmaArena::new(config.arena_bytes)?;
        transport.register_memory(&[arena.memory_region()])?;
        let layout = RingLayout {
            queue_pairs: transport.queue_pairs(),
        };
        let size = config.queue_size;

        let send_queue = SplitQueue::new(&arena, size, event_idx)?;
        let send_slots = device_slots(
            &*transport,
            &arena,
            usize::from(size) * WorkRequest::SIZE,
            transport::Access::ReadOnly,
        )?;
        transport.setup_queue(layout.send_queue(), &send_queue.layout())?;

        let mut completion_queue = SplitQueue::new(&arena, size, event_idx)?;
        let completion_slots = device_slots(
            &*transport,
            &arena,
            usize::from(size) * Completion::SIZE,
            transport::Access::ReadWrite,
        )?;
        for slot in 0..size {
            let iova = completion_slots.iova() + (usize::from(slot) * Completion::SIZE) as u64;
            completion_queue.add(
                &[ChainElement::writable(iova, Completion::SIZE as u32)],
                slot,
            )?;
        }
        transport.setup_queue(layout.completion_queue(), &completion_queue.layout())?;
        let completion_event = transport.completion_event(layout.completion_queue())?;
        transport.enable_queue(layout.completion_queue(), true)?;
        transport.enable_queue(layout.send_queue(), true)?;
        transport.notify(layout.completion_queue())?;

        // Each cached region is one device mapping: stay within the
        // mechanism's limit (VFIO's DMA entry limit in a guest).
        let max_entries = transport
            .mapping_budget()
            .map_or(config.cache.max_entries, |budget| {
                config.cache.max_entries.min(budget.max(1))
            });
        let cache_config = CacheConfig {
            max_pinned_bytes: config.cache.max_pinned_bytes.or(Some(config.arena_bytes)),
            max_entries,
            ..config.cache.clone()
        };
        let reach = DeviceReach::new(Arc::clone(&transport), Arc::clone(&arena))
            .map_err(|e| VerbsError::Unreachable(ReachError::Maps(e)))?;
        let pinner =
            IotlbPinner::with_locate(Arc::clone(&transport), reach, transport::Access::ReadWrite);
        let cache = PinCache::new(pinner, cache_config)?;
        let mut context = Context {
            transport,
            arena,
            cache,
            info: DeviceInfo {
                port: 0,
                abi_version: 0,
                features: 0,
            },
            layout,
            send: Mutex::new(SendRing {
                queue: send_queue,
                slots: send_slots,
                free: (0..size).rev().collect(),
            }),
            completion: Mutex::new(CompletionRing {
                queue: completion_queue,
                slots: completion_slots,
                ready: VecDeque::new(),
                internal: HashMap::new(),
            }),
            completion_event,
            next_internal: AtomicU64::new(0),
            spin: config.spin,
        };
        let query = context.run_internal(Operation::Query, Duration::from_secs(10))?;
        context.info = DeviceInfo::from_value(query.value);
        if context.info.abi_version != ABI_VERSION {
            return Err(VerbsError::AbiMismatch {
                device: context.info.abi_version,
                driver: ABI_VERSION,
            });
        }
        Ok(context)
    }

    /// This port as the device describes it; peers address it by
    /// [`DeviceInfo::port`].
    pub fn info(&self) -> DeviceInfo {
        self.info
    }

    /// The transport underneath.
    pub fn transport(&self) -> &T {
        &self.transport
    }

    /// A buffer in the DMA arena, aligned to `align` bytes, not yet
    /// registered.
    pub fn alloc(&self, len: usize, align: usize) -> Result<DmaBuffer, VerbsError> {
        Ok(self.arena.alloc(len, align)?)
    }

    /// Registers `[addr, addr + len)`, any memory this process maps, with
    /// the device (a pin-down cache hit if it is registered already; see
    /// the module documentation for what a first registration does).
    pub fn register(&self, addr: u64, len: u64) -> Result<MemoryRegion<'_, T>, VerbsError> {
        let (Ok(start), Ok(bytes)) = (usize::try_from(addr), usize::try_from(len)) else {
            return Err(ReachError::Unmapped { addr }.into());
        };
        let registration = self.cache.pin(start, bytes).map_err(registration_error)?;
        Ok(MemoryRegion {
            registration,
            addr,
            len,
        })
    }

    /// Where registered memory lives: pool and memory-table counters.
    pub fn reach_stats(&self) -> ReachStats {
        self.cache.pinner().locator().stats()
    }

    /// Registers a whole buffer.
    pub fn register_buffer(&self, buffer: &DmaBuffer) -> Result<MemoryRegion<'_, T>, VerbsError> {
        self.register(buffer.iova(), buffer.len() as u64)
    }

    /// Takes the device's access to `[addr, addr + len)` away: every
    /// pin-down cache entry overlapping it is dropped and its IOTLB entries
    /// removed (the pinner's unpin). An entry no [`MemoryRegion`] holds goes
    /// before this returns; one still held goes when its last region is
    /// dropped, and that drop returns only after the device has answered
    /// the INVALIDATE. Either way, once the unpin has returned the device
    /// has finished every access to those pages and starts no new one (a
    /// window over them stays bound, but accesses through it fail). A later
    /// [`register`](Self::register) maps the memory again. Returns how many
    /// cache entries were dropped. Call it before reusing registered memory
    /// for something the device must not see.
    pub fn invalidate(&self, addr: u64, len: u64) -> usize {
        let (Ok(addr), Ok(len)) = (usize::try_from(addr), usize::try_from(len)) else {
            return 0;
        };
        self.cache.invalidate(addr, len)
    }

    /// Pin-down cache statistics: registration hits, misses, evictions.
    pub fn registration_stats(&self) -> CacheStats {
        self.cache.stats()
    }

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
        if access.intersects(Access::REMOTE_WRITE | Access::REMOTE_ATOMIC)
            && !self.cache.pinner().writable(start, len)
        {
            return Err(VerbsError::ReadOnlyMemory { addr: start, len });
        }
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

    /// Posts a batch of requests with one doorbell (none if the device is
    /// busy and needs no kick). All or nothing: fails with
    /// [`VerbsError::QueueFull`] when the batch does not fit.
    pub fn post(&self, entries: &[Entry]) -> Result<(), VerbsError> {
        if let Some(bad) = entries
            .iter()
            .find(|entry| entry.request().user_data & INTERNAL != 0)
        {
            return Err(VerbsError::ReservedUserData(bad.request().user_data));
        }
        self.post_requests(entries.iter().map(|entry| *entry.request()))
    }

    fn post_requests(
        &self,
        requests: impl ExactSizeIterator<Item = WorkRequest>,
    ) -> Result<(), VerbsError> {
        let mut send = self.send.lock();
        if send.free.len() < requests.len() {
            send.reap()?;
        }
        if send.free.len() < requests.len() {
            return Err(VerbsError::QueueFull {
                free: send.free.len(),
                wanted: requests.len(),
            });
        }
        for request in requests {
            let slot = send.free.pop().expect("room checked above");
            let offset = usize::from(slot) * WorkRequest::SIZE;
            send.slots.write_at(offset, &request.encode());
            let iova = send.slots.iova() + offset as u64;
            send.queue.add(
                &[ChainElement::readable(iova, WorkRequest::SIZE as u32)],
                slot,
            )?;
        }
        if send.queue.kick_needed() {
            self.transport.notify(self.layout.send_queue())?;
        }
        Ok(())
    }

    /// Moves completions into `out` without blocking; returns how many.
    pub fn poll(&self, out: &mut [Completion]) -> Result<usize, VerbsError> {
        let mut ring = self.completion.lock();
        if ring.ready.len() < out.len() {
            self.reap(&mut ring)?;
        }
        let count = out.len().min(ring.ready.len());
        for (slot, completion) in out.iter_mut().zip(ring.ready.drain(..count)) {
            *slot = completion;
        }
        Ok(count)
    }

    /// Waits until at least one completion is available (or `timeout`
    /// passes), then moves up to `out.len()` into `out`. Polls for the
    /// configured spin time first, then sleeps on the eventfd.
    pub fn wait(&self, out: &mut [Completion], timeout: Duration) -> Result<usize, VerbsError> {
        self.wait_until(timeout, |context| context.poll(out))
    }

    /// Polls with `attempt` until it yields something, spinning briefly and
    /// then sleeping on the completion eventfd.
    fn wait_until(
        &self,
        timeout: Duration,
        mut attempt: impl FnMut(&Self) -> Result<usize, VerbsError>,
    ) -> Result<usize, VerbsError> {
        let start = Instant::now();
        loop {
            let spin_until = Instant::now() + self.spin.min(timeout);
            loop {
                let found = attempt(self)?;
                if found > 0 {
                    return Ok(found);
                }
                if Instant::now() >= spin_until {
                    break;
                }
                std::hint::spin_loop();
            }
            let elapsed = start.elapsed();
            if elapsed >= timeout {
                return Err(VerbsError::Timeout(timeout));
            }
            let pending = self.completion.lock().queue.enable_interrupts();
            if !pending {
                self.completion_event
                    .wait(Some(timeout - elapsed))
                    .map_err(VerbsError::Wait)?;
            }
            self.completion.lock().queue.disable_interrupts();
        }
    }

    /// Takes the completions the device wrote and lends their buffers back,
    /// with a doorbell if the device waits for buffers.
    fn reap(&self, ring: &mut CompletionRing) -> Result<(), VerbsError> {
        if ring.pump()? > 0 && ring.queue.kick_needed() {
            self.transport.notify(self.layout.completion_queue())?;
        }
        Ok(())
    }

    /// Posts one request of the driver's own and waits for its completion.
    fn run_internal(&self, op: Operation, timeout: Duration) -> Result<Completion, VerbsError> {
        let user_data = INTERNAL | self.next_internal.fetch_add(1, Ordering::Relaxed);
        self.post_requests(std::iter::once(WorkRequest {
            user_data,
            flags: WrFlags::SIGNALED,
            op,
        }))?;
        let mut done = None;
        self.wait_until(timeout, |context| {
            let mut ring = context.completion.lock();
            context.reap(&mut ring)?;
            done = ring.internal.remove(&user_data);
            Ok(usize::from(done.is_some()))
        })?;
        let completion = done.expect("wait_until returns once found");
        if completion.is_success() {
            Ok(completion)
        } else {
            Err(VerbsError::Refused(completion))
        }
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

/// Page-exclusive arena memory for the driver's own request or completion
/// slots, mapped for the device for the context's life (never through the
/// pin-down cache, whose unpins would remove the mapping).
fn device_slots<T: Transport>(
    transport: &T,
    arena: &Arc<DmaArena>,
    len: usize,
    access: transport::Access,
) -> Result<DmaBuffer, VerbsError> {
    let slots = arena.alloc_pages(len)?;
    transport.iotlb_map(
        slots.iova(),
        slots.len() as u64,
        slots.as_ptr() as u64,
        access,
    )?;
    Ok(slots)
}

/// Registered memory: the device may reach it while this lives.
pub struct MemoryRegion<'c, T: Transport + 'static> {
    registration: Registration<'c, ContextPinner<T>>,
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

    fn iova_at(&self, offset: u64, len: u64) -> Result<u64, VerbsError> {
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
