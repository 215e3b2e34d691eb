//! The context: an open port with its DMA arena, pin-down cache, device
//! description and admin queue pair, on which the driver runs its own
//! requests (query, bind, revoke).

use std::collections::VecDeque;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use pindown_pincache::{CacheConfig, CacheStats, MemoryMonitor, Monitor, PinCache};
use pindown_uapi::{
    Arrival, Completion, DeviceInfo, Operation, RingLayout, WorkRequest, WrFlags, ABI_VERSION,
    ADMIN_QUEUE_PAIR,
};

use super::completion::CompletionRing;
use super::pairs::{set_up_pair, start_pair, PairPool, PairSlot};
use super::queue_pair::{InlineSource, SendRing};
use super::wait::{wait_for, wait_for_control, Awaiting};
use super::VerbsError;
use crate::arena::{ArenaOptions, DmaArena, DmaBuffer, HugePages};
use crate::pinner::IotlbPinner;
use crate::reach::{DeviceReach, ReachError, ReachStats};
use crate::transport::{self, Transport, VhostUserConfig, VhostUserTransport};

/// The pinner of a context: mlock plus IOTLB entries wherever its
/// [`DeviceReach`] places the memory.
pub(super) type ContextPinner<T> = IotlbPinner<Arc<T>, DeviceReach<Arc<T>>>;

/// How a [`Context`] is set up.
#[derive(Clone, Debug)]
pub struct ContextConfig {
    /// Size of the DMA arena: all memory the device may reach.
    pub arena_bytes: usize,
    /// Entries in each send and completion ring (a power of two): how many
    /// requests a queue pair can have posted and not yet executed, and how
    /// many completions a queue pair's completion ring holds unreaped.
    pub queue_size: u16,
    /// The pin-down cache; `max_pinned_bytes: None` means the arena size.
    /// `max_entries` is lowered to what the transport can map
    /// ([`Transport::mapping_budget`]). By default its unmap monitor runs
    /// where userfaultfd allows ([`Monitor::WhereAvailable`]): memory the
    /// program frees and maps again at the same address is registered
    /// anew, never reached through the old translation (memory the kernel
    /// will not watch is registered uncached,
    /// [`CacheStats::unwatched`](pindown_pincache::CacheStats::unwatched)).
    /// Where it cannot run (and in a child of `fork()`), the context logs
    /// why once and [`Context::unmaps_watched`] says `false`: invalidate
    /// memory before it goes then, or route `munmap` through
    /// `pindown_pincache::unmap`. A program that puts a userfaultfd of its
    /// own over memory it registers, or runs under a seccomp policy that
    /// kills on `userfaultfd(2)`, sets [`Monitor::Off`]; with the monitor
    /// on, an `munmap` of registered memory waits for the monitor's
    /// thread to read its event.
    pub cache: CacheConfig,
    /// How long waiting ([`CompletionQueue::wait`](super::CompletionQueue::wait),
    /// and the context's own requests) keeps polling after the last
    /// completion before it sleeps on the eventfds. `Duration::MAX`: never
    /// sleep (busy polling).
    pub spin: Duration,
    /// How long the context's own requests may take: the QUERY when it
    /// opens, window binds and revokes, and the flush that hands an earlier
    /// queue pair's rings to a new one. Beyond it they fail with
    /// [`VerbsError::ControlTimeout`]. The device answers them in
    /// microseconds unless it is gone or stuck, or (inside a guest) waits
    /// for QEMU to map memory; one that closed its connection fails them
    /// at once ([`VerbsError::DeviceGone`]).
    pub control_timeout: Duration,
    /// Whether the DMA arena is on 2 MiB huge pages: tried by default
    /// (normal pages when none are reserved); [`HugePages::Never`] keeps it
    /// on normal pages, [`HugePages::Require`] fails to open without them.
    pub huge_pages: HugePages,
}

impl Default for ContextConfig {
    fn default() -> Self {
        ContextConfig {
            arena_bytes: 64 << 20,
            queue_size: 256,
            cache: CacheConfig {
                monitor: Monitor::WhereAvailable,
                ..CacheConfig::default()
            },
            spin: Duration::from_micros(50),
            control_timeout: Duration::from_secs(10),
            huge_pages: HugePages::Try,
        }
    }
}

/// The admin queue pair: the driver's own requests and their completions.
struct AdminPair {
    send: SendRing,
    completion: CompletionRing,
    next_user_data: u64,
    /// Arrivals reaped from the admin completion queue, not taken yet.
    arrivals: VecDeque<Arrival>,
}

/// An open port of the device: its DMA arena, its pin-down cache (the
/// registrations every queue pair of the context shares), its admin queue
/// pair and the I/O queue pairs it hands out.
pub struct Context<T: Transport + 'static = VhostUserTransport> {
    pub(super) transport: Arc<T>,
    pub(super) arena: Arc<DmaArena>,
    pub(super) cache: PinCache<ContextPinner<T>>,
    pub(super) info: DeviceInfo,
    pub(super) layout: RingLayout,
    pub(super) queue_size: u16,
    admin: Mutex<AdminPair>,
    pub(super) pairs: Mutex<PairPool>,
    /// The next marker value of a retired or flushed queue pair: counts
    /// on from a random start (see [`super::pairs`]).
    pub(super) markers: AtomicU64,
    pub(super) spin: Duration,
    pub(super) control_timeout: Duration,
    pub(super) window_revoke_failures: AtomicU64,
    /// The process that opened the connection: a child of `fork()` that
    /// drops its copy of the context must not end its parent's connection.
    opened_by: u32,
    /// Whether the device answered the open's QUERY. Until it has, no
    /// buffer of the arena went out and the arena goes with the context,
    /// so a drop has no memory to keep from reuse and waits for nothing.
    device_answered: bool,
}

impl<T: Transport + 'static> Drop for Context<T> {
    /// Ends the connection before the rings' memory goes back to the
    /// arena. Every queue pair, region and window borrowed the context and
    /// is gone, but the device may still be at work on the rings (a
    /// dropped queue pair's flush, the requests of one leaked with
    /// `mem::forget`) and writes its records into them until it has let go
    /// of the port. Only when it confirms that within the control timeout
    /// are the rings freed; otherwise the arena is sealed and keeps them
    /// (and everything freed later) out of any later allocation.
    fn drop(&mut self) {
        if std::process::id() != self.opened_by {
            // A child of fork(): the connection is its parent's, and so
            // are the device's IOTLB entries the pin cache drops next.
            self.transport.abandon();
            self.arena.seal();
            return;
        }
        if !self.device_answered {
            // A failed open: the device that did not answer within the
            // control timeout is not given that time again here.
            return;
        }
        if !self.transport.disconnect(self.control_timeout) {
            tracing::warn!(
                timeout = ?self.control_timeout,
                "the device did not confirm the end of the connection: \
                 the DMA arena is sealed, its memory is never reused"
            );
            self.arena.seal();
        }
    }
}

impl Context<VhostUserTransport> {
    /// Connects to the device's vhost-user socket at `path` and sets up a
    /// port: features, memory table, admin queue pair, pin-down cache, and
    /// the device's description of the port.
    pub fn open(path: impl AsRef<Path>, config: ContextConfig) -> Result<Self, VerbsError> {
        let transport = VhostUserTransport::connect(path, VhostUserConfig::default())?;
        Self::with_transport(transport, config)
    }
}

impl<T: Transport + 'static> Context<T> {
    /// Sets up a port over an already connected transport.
    ///
    /// The admin queue pair's rings are set up now; an I/O pair's when a
    /// queue pair first needs them, or all now when the transport cannot
    /// add rings once the device runs (VFIO inside a guest).
    pub fn with_transport(transport: T, config: ContextConfig) -> Result<Self, VerbsError> {
        let transport = Arc::new(transport);
        transport.negotiate_features(transport::DEFAULT_FEATURES)?;
        let arena = DmaArena::with_options(
            config.arena_bytes,
            ArenaOptions {
                huge_pages: config.huge_pages,
                ..ArenaOptions::default()
            },
        )?;
        transport.register_memory(&[arena.memory_table_region()])?;
        let layout = transport.ring_layout();
        let size = config.queue_size;
        let set_up = |pair| set_up_pair(&*transport, &arena, layout, pair, size);

        let (admin_send, admin_completion) = set_up(ADMIN_QUEUE_PAIR)?;
        let mut io_pairs = Vec::new();
        if transport.rings_fixed_at_start() {
            for pair in 1..layout.rdma_queue_pairs {
                io_pairs.push(set_up(pair)?);
            }
        }
        start_pair(&*transport, &admin_send, &admin_completion)?;
        for (send, completion) in &io_pairs {
            start_pair(&*transport, send, completion)?;
        }

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
        let pinner = IotlbPinner::with_locate(
            Arc::clone(&transport),
            reach,
            transport::IotlbAccess::ReadWrite,
        );
        let cache = PinCache::new(pinner, cache_config)?;
        if config.cache.monitor == Monitor::WhereAvailable && !cache.monitored() {
            if let Err(why) = MemoryMonitor::global() {
                static SAID: std::sync::Once = std::sync::Once::new();
                SAID.call_once(|| {
                    tracing::warn!(
                        "registrations go unwatched: the pin-down cache's unmap monitor cannot \
                         run ({why}); memory freed and mapped again at the same address may be \
                         reached through its old translation unless it is invalidated first"
                    )
                });
            }
        }
        let mut context = Context {
            transport,
            arena,
            cache,
            info: DeviceInfo {
                port: 0,
                abi_version: 0,
                features: 0,
                rdma_queue_pairs: 0,
                node: 0,
            },
            layout,
            queue_size: size,
            admin: Mutex::new(AdminPair {
                send: admin_send,
                completion: admin_completion,
                arrivals: VecDeque::new(),
                next_user_data: 1,
            }),
            pairs: Mutex::new(PairPool { slots: Vec::new() }),
            markers: AtomicU64::new(super::pairs::first_marker()),
            spin: config.spin,
            control_timeout: config.control_timeout,
            window_revoke_failures: AtomicU64::new(0),
            opened_by: std::process::id(),
            device_answered: false,
        };
        let query = context.run_admin(Operation::Query)?;
        context.device_answered = true;
        context.info = DeviceInfo::from_query(query.byte_len, query.value);
        if context.info.abi_version != ABI_VERSION {
            return Err(VerbsError::AbiMismatch {
                device: context.info.abi_version,
                driver: ABI_VERSION,
            });
        }
        // The I/O pairs both the device serves and the transport reaches.
        let usable = context
            .info
            .rdma_queue_pairs
            .min(layout.rdma_queue_pairs)
            .saturating_sub(1);
        let mut prepared = io_pairs.into_iter();
        context.pairs.get_mut().slots = (0..usable)
            .map(|_| match prepared.next() {
                Some((send, completion)) => PairSlot::Idle {
                    send,
                    completion,
                    fresh: true,
                },
                None => PairSlot::Unused,
            })
            .collect();
        Ok(context)
    }

    /// This port as the device describes it; peers address it by
    /// [`DeviceInfo::port`].
    pub fn info(&self) -> DeviceInfo {
        self.info
    }

    /// Whether the device has closed this context's connection (its
    /// process ended, or it dropped this frontend): no request completes
    /// after that, and waits for one fail with [`VerbsError::DeviceGone`].
    /// One `poll` with no wait; `false` over a transport that cannot tell
    /// (VFIO).
    pub fn device_hung_up(&self) -> Result<bool, VerbsError> {
        match self.transport.hangup_fd() {
            Some(fd) => transport::poll_hangup(fd.as_raw_fd(), Some(Duration::ZERO))
                .map_err(VerbsError::Wait),
            None => Ok(false),
        }
    }

    /// How many I/O queue pairs this context can hold at once.
    pub fn queue_pair_limit(&self) -> u16 {
        u16::try_from(self.pairs.lock().slots.len()).unwrap_or(u16::MAX)
    }

    /// Entries in each send and completion ring of this context's queue
    /// pairs ([`ContextConfig::queue_size`]).
    pub fn queue_size(&self) -> u16 {
        self.queue_size
    }

    /// The transport underneath.
    pub fn transport(&self) -> &T {
        &self.transport
    }

    /// Whether the DMA arena is backed by 2 MiB huge pages (see
    /// [`HugePages`](crate::arena::HugePages): the default tries them and
    /// falls back to normal pages when the system has none reserved).
    pub fn arena_uses_huge_pages(&self) -> bool {
        self.arena.uses_huge_pages()
    }

    /// A buffer in the DMA arena, aligned to `align` bytes, not yet
    /// registered.
    pub fn alloc(&self, len: usize, align: usize) -> Result<DmaBuffer, VerbsError> {
        Ok(self.arena.alloc(len, align)?)
    }

    /// Takes the device's access to `[addr, addr + len)` away: every
    /// pin-down cache entry overlapping it is dropped and its IOTLB entries
    /// removed (the pinner's unpin). An entry no
    /// [`MemoryRegion`](super::MemoryRegion) holds goes before this
    /// returns; one still held goes when its last region is deregistered,
    /// and that deregistration returns only after the device has answered
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

    /// Where registered memory lives: pool and memory-table counters.
    pub fn reach_stats(&self) -> ReachStats {
        self.cache.pinner().locator().stats()
    }

    /// Whether the pin-down cache's unmap monitor watches this context's
    /// registrations ([`ContextConfig::cache`]).
    pub fn unmaps_watched(&self) -> bool {
        self.cache.monitored()
    }

    /// Pin-down cache statistics: registration hits, misses, evictions.
    pub fn registration_stats(&self) -> CacheStats {
        self.cache.stats()
    }

    /// How many windows dropped without [`MemoryWindow::revoke`] the device
    /// could not be told to revoke (it was gone); each is logged too.
    ///
    /// [`MemoryWindow::revoke`]: super::MemoryWindow::revoke
    pub fn window_revoke_failures(&self) -> u64 {
        self.window_revoke_failures.load(Ordering::Relaxed)
    }

    /// Runs one request of the driver's own on the admin queue pair and
    /// waits for its completion (at most the configured
    /// [`control_timeout`](ContextConfig::control_timeout)).
    pub(super) fn run_admin(&self, op: Operation) -> Result<Completion, VerbsError> {
        let mut admin = self.admin.lock();
        let admin = &mut *admin;
        let user_data = admin.next_user_data;
        admin.next_user_data += 1;
        let request = WorkRequest {
            user_data,
            flags: WrFlags::SIGNALED,
            op,
        };
        admin.send.post(&*self.transport, &self.arena, 1, |_| {
            (request, InlineSource::None, &[][..])
        })?;
        let mut awaiting = AdminAnswer {
            transport: &*self.transport,
            ring: &mut admin.completion,
            arrivals: &mut admin.arrivals,
            user_data,
            answer: None,
        };
        wait_for_control(&mut awaiting, self.spin, self.control_timeout, op.opcode())?;
        let completion = awaiting.answer.expect("wait_for returns once answered");
        completion.result().map_err(VerbsError::Refused)?;
        Ok(completion)
    }

    /// The arrivals of vector writes into this port's windows that asked
    /// to tell it ([`Vector::notify`](super::opcode::Vector::notify)),
    /// oldest first, taken from the admin completion queue where the
    /// device puts them once the bytes are in place: which port wrote,
    /// through which window, how many bytes, and the writer's immediate
    /// value. Does not wait. Until they are taken, the device holds a
    /// bounded number for the port (4096); a write beyond fails at its
    /// writer with `LimitReached`/`NoticeLimit`.
    pub fn arrivals(&self) -> Result<Vec<Arrival>, VerbsError> {
        let mut admin = self.admin.lock();
        let admin = &mut *admin;
        reap_arrivals(&*self.transport, &mut admin.completion, &mut admin.arrivals)?;
        Ok(admin.arrivals.drain(..).collect())
    }

    /// Like [`arrivals`](Self::arrivals), but waits up to `timeout` for
    /// at least one (polling, then asleep on the admin completion
    /// queue's eventfd); an empty list when none came, and
    /// [`VerbsError::HungUp`] at once if the device closes its
    /// connection. The context's own requests (bind, revoke) wait
    /// meanwhile.
    pub fn wait_arrivals(&self, timeout: Duration) -> Result<Vec<Arrival>, VerbsError> {
        let mut admin = self.admin.lock();
        let admin = &mut *admin;
        let mut awaiting = ArrivalWait {
            transport: &*self.transport,
            ring: &mut admin.completion,
            arrivals: &mut admin.arrivals,
        };
        match wait_for(&mut awaiting, self.spin, timeout) {
            Ok(()) | Err(VerbsError::Timeout(_)) => {}
            Err(other) => return Err(other),
        }
        Ok(admin.arrivals.drain(..).collect())
    }
}

/// Reaps the admin completion queue, keeping its arrivals (completions of
/// the context's own requests no one waits for any more are dropped).
fn reap_arrivals<T: Transport>(
    transport: &T,
    ring: &mut CompletionRing,
    arrivals: &mut VecDeque<Arrival>,
) -> Result<usize, VerbsError> {
    ring.pump(transport, |completion| {
        if let Some(arrival) = completion.arrival() {
            arrivals.push_back(arrival);
        }
    })
}

/// Waiting for at least one arrival.
struct ArrivalWait<'a, T: Transport> {
    transport: &'a T,
    ring: &'a mut CompletionRing,
    arrivals: &'a mut VecDeque<Arrival>,
}

impl<T: Transport> Awaiting for ArrivalWait<'_, T> {
    fn try_complete(&mut self) -> Result<bool, VerbsError> {
        reap_arrivals(self.transport, self.ring, self.arrivals)?;
        Ok(!self.arrivals.is_empty())
    }

    fn rings(&mut self) -> Vec<&mut CompletionRing> {
        vec![&mut *self.ring]
    }

    fn hangup_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.transport.hangup_fd()
    }
}

/// The admin request being waited for. Completions of earlier requests
/// whose wait timed out are discarded.
struct AdminAnswer<'a, T: Transport> {
    transport: &'a T,
    ring: &'a mut CompletionRing,
    arrivals: &'a mut VecDeque<Arrival>,
    user_data: u64,
    answer: Option<Completion>,
}

impl<T: Transport> Awaiting for AdminAnswer<'_, T> {
    fn try_complete(&mut self) -> Result<bool, VerbsError> {
        let (user_data, answer) = (self.user_data, &mut self.answer);
        let arrivals = &mut *self.arrivals;
        self.ring.pump(self.transport, |completion| {
            if let Some(arrival) = completion.arrival() {
                arrivals.push_back(arrival);
            } else if completion.user_data == user_data {
                *answer = Some(completion);
            }
        })?;
        Ok(self.answer.is_some())
    }

    fn rings(&mut self) -> Vec<&mut CompletionRing> {
        vec![&mut *self.ring]
    }

    fn hangup_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.transport.hangup_fd()
    }
}
