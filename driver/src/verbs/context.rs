//! The context: an open port with its DMA arena, pin-down cache and device
//! description, and the driver's own requests (query, bind, revoke).

use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use pindown_pincache::{CacheConfig, CacheStats, PinCache};
use pindown_uapi::{
    Completion, DeviceInfo, Operation, RingLayout, WorkRequest, WrFlags, ABI_VERSION,
};

use super::completion::CompletionRing;
use super::queue_pair::SendRing;
use super::{VerbsError, INTERNAL};
use crate::arena::{DmaArena, DmaBuffer};
use crate::pinner::IotlbPinner;
use crate::rdma_queue::{CompletionQueue, SendQueue};
use crate::transport::{self, CompletionEvent, Transport, VhostUserConfig, VhostUserTransport};

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

/// An open port of the device: its rings, its DMA arena and its pin-down
/// cache.
pub struct Context<T: Transport + 'static = VhostUserTransport> {
    pub(super) transport: Arc<T>,
    pub(super) arena: Arc<DmaArena>,
    pub(super) cache: PinCache<IotlbPinner<Arc<T>>>,
    pub(super) info: DeviceInfo,
    pub(super) layout: RingLayout,
    pub(super) send: Mutex<SendRing>,
    pub(super) completion: Mutex<CompletionRing>,
    pub(super) completion_event: CompletionEvent,
    pub(super) next_internal: AtomicU64,
    pub(super) spin: Duration,
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
        transport.negotiate_features(transport::DEFAULT_FEATURES)?;
        let arena = DmaArena::new(config.arena_bytes)?;
        transport.register_memory(&[arena.memory_region()])?;
        let layout = RingLayout {
            queue_pairs: transport.queue_pairs(),
        };
        let size = config.queue_size;

        // The RDMA queues (pindown_uapi::queue): each in a page-aligned
        // chunk of the arena, mapped for the device by setup_queue.
        let send_queue = SendQueue::new(&arena, size)?;
        transport.setup_queue(layout.send_queue(), &send_queue.layout())?;
        let completion_queue = CompletionQueue::new(&arena, size)?;
        transport.setup_queue(layout.completion_queue(), &completion_queue.layout())?;
        let completion_event = transport.completion_event(layout.completion_queue())?;
        transport.enable_queue(layout.completion_queue(), true)?;
        transport.enable_queue(layout.send_queue(), true)?;

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
        let cache = PinCache::new(IotlbPinner::new(Arc::clone(&transport)), cache_config)?;
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
                inline: Vec::with_capacity(pindown_uapi::queue::MAX_INLINE as usize),
            }),
            completion: Mutex::new(CompletionRing {
                queue: completion_queue,
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

    /// Takes the device's access to `[addr, addr + len)` away: every
    /// pin-down cache entry overlapping it is dropped and its IOTLB entries
    /// removed (the pinner's unpin). An entry no [`MemoryRegion`](super::MemoryRegion) holds goes
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

    /// then sleeping on the completion eventfd.
    pub(super) fn wait_until(
        &self,
        timeout: Duration,
        mut attempt: impl FnMut(&Self) -> Result<usize, VerbsError>,
    ) -> Result<usize, VerbsError> {
        let start = Instant::now();
        loop {
            // Spin: the clock is read once every few attempts only, so
            // that a completion is seen within a few nanoseconds of its
            // arrival.
            let spin = self.spin.min(timeout.saturating_sub(start.elapsed()));
            let spin_from = Instant::now();
            let mut attempts = 0u32;
            loop {
                let found = attempt(self)?;
                if found > 0 {
                    return Ok(found);
                }
                attempts = attempts.wrapping_add(1);
                if attempts.is_multiple_of(SPIN_ATTEMPTS_PER_CLOCK) && spin_from.elapsed() >= spin {
                    break;
                }
                std::hint::spin_loop();
            }
            let elapsed = start.elapsed();
            if elapsed >= timeout {
                return Err(VerbsError::Timeout(timeout));
            }
            // Ask for a signal, then sleep unless a completion slipped in
            // meanwhile. The request stays until its position passes: no
            // need to withdraw it after waking.
            let pending = self.completion.lock().queue.arm();
            if !pending {
                self.completion_event
                    .wait(Some(timeout - elapsed))
                    .map_err(VerbsError::Wait)?;
            }
        }
    }

    /// Posts one request of the driver's own and waits for its completion.
    pub(super) fn run_internal(
        &self,
        op: Operation,
        timeout: Duration,
    ) -> Result<Completion, VerbsError> {
        let user_data = INTERNAL | self.next_internal.fetch_add(1, Ordering::Relaxed);
        let request = WorkRequest {
            user_data,
            flags: WrFlags::SIGNALED,
            op,
        };
        self.post_with(1, |_| (request, false))?;
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

/// Polling attempts between two looks at the clock while spinning.
const SPIN_ATTEMPTS_PER_CLOCK: u32 = 64;
