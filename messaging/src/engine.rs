//! The protocol engine: one rank's queue pair, control memory, slots and
//! progress. Communicators and requests are views of it.
//!
//! A receive on slot `(context, peer, index)` writes its buffer's window
//! key, offset and capacity into the peer's match record for this rank,
//! then (fenced) the receive's generation on that slot: the stamp. The
//! peer's send on the slot waits for the stamp of the next generation it
//! has not consumed, writes the body straight into the receive buffer,
//! then (fenced) the done word into this rank's control memory. One round
//! trip, no queue, no search, no allocation on either side. A small
//! receive (at most [`layout::LANDING_BYTES`], outside collective calls,
//! while a landing buffer is free) names a landing buffer of the peer's
//! block instead of a window, and copies the body out once the done word
//! came.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use pindown_driver::arena::DmaBuffer;
use pindown_driver::launch::Job;
use pindown_driver::verbs::opcode::{Entry, Read, Write};
use pindown_driver::verbs::{
    Completion, CompletionQueue, Context, Local, MemoryRegion, QueuePair, RegionWindow,
    RemoteWindow, VerbsError,
};
use pindown_uapi::queue::MAX_INLINE;
use pindown_uapi::{Access, CompletionError, ErrorDetail, RemoteAddress, Status};

use crate::error::{Error, Result};
use crate::layout::{
    self, CallRecord, Layout, CALL_RECORDS_BYTES, CALL_RECORD_BYTES, CALL_RECORD_SLOTS,
    MATCH_STAMP_AT,
};
use crate::liveness::DeviceWatch;
use crate::windows::WindowCache;

/// How a rank's messaging is set up. Every rank of a job must use the same
/// `slots` and `communicators` (compared at [`Messenger::new`](crate::Messenger::new),
/// failing with [`Error::Mismatch`]); `slots` is at most [`MAX_SLOTS`],
/// `communicators` at most [`MAX_COMMUNICATORS`], `liveness_interval`
/// between 1 us and an hour ([`Error::InvalidConfig`] otherwise).
#[derive(Clone, Debug)]
pub struct Config {
    /// Matching slots per (peer, communicator): the tag range, and how many
    /// nonblocking receives may be outstanding per pair at once.
    pub slots: u32,
    /// Communicators that can exist at once (the world included).
    pub communicators: u32,
    /// The timeout switch: how long a blocking send waits for its receive
    /// to be posted before it copies the message into the sender's spool
    /// and returns. `Some(Duration::ZERO)`: buffered mode (spool at once
    /// unless the receive is already posted); `None`: synchronous mode
    /// (wait for the receive, however long).
    pub send_timeout: Option<Duration>,
    /// How long waiting polls without yielding the processor. Zero (the
    /// default) yields between polls from the start: the rank, its peers
    /// and the device's threads share the cores, and the one that has work
    /// runs next. On hosts with a core to spare for every waiting thread,
    /// a few tens of microseconds save the system call.
    pub spin: Duration,
    /// How long a wait goes without news from its peer before it checks
    /// that the peer is still there (a read of its control memory, which
    /// the device fails once the peer's port has closed or its node no
    /// longer answers). A check unanswered for ten intervals counts the
    /// peer gone only if this rank's device then answers nothing for ten
    /// more, not even a no-op asked on a queue pair of its own: a check
    /// waiting behind megabytes on a slow link is no death. In a
    /// collective call the check reads the peer's record of the call,
    /// so a member that disagrees about the call is found after this
    /// long (see the collectives of [`Communicator`](crate::Communicator)).
    pub liveness_interval: Duration,
    /// Windows over receive buffers (and typed sends' offers) kept bound
    /// for reuse, each for the one peer the receive named; 0 (the
    /// default) keeps none, revoking each window before its receive's
    /// wait returns, at the cost of a bind and a revoke (about 1.5 us) per
    /// receive longer than [`layout::LANDING_BYTES`](crate::layout::LANDING_BYTES)
    /// (shorter ones outside collective calls land in the control memory
    /// and are copied out, with no window, while one of the
    /// [`layout::LANDINGS`](crate::layout::LANDINGS) per peer is free). For trusted peers only: until a cached window goes (least
    /// recently used first, or when its memory is unmapped), that peer can
    /// still write into the buffer of a receive that completed, which the
    /// program may have freed and reused since (as with the keys an MPI's
    /// registration cache keeps valid).
    pub window_cache: usize,
    /// Messages of one sender on one communicator that may wait,
    /// received by nobody yet, in the any-source domain's unexpected
    /// queue (an eager body takes at most
    /// [`ANY_EAGER_BYTES`](crate::layout::ANY_EAGER_BYTES)). Past it,
    /// that sender's further messages on that communicator stay in its
    /// ring here and its sends wait for this rank's receives, as sends do
    /// in an MPI that buffers nothing: a sender streaming messages no one
    /// receives holds at most this many of them per communicator in this
    /// rank's memory. (Per communicator, not per sender: a receive on one
    /// communicator must find its message whatever the same sender left
    /// unreceived on another.) 0 counts as 1.
    pub unexpected_per_sender: usize,
    /// Compare every collective call with every member's once it has
    /// completed here (a read of each member's call record, waiting for
    /// members that have not come to it yet): calls that disagree but
    /// complete anyway (members reducing with different operations, a
    /// reduce's send taken by a broadcast's receive of the same length)
    /// fail with [`Error::Mismatch`] instead of returning wrong data. Off
    /// by default: without it, records are read only while a rank waits,
    /// and a correct program pays nothing for them; on, each call costs a
    /// read per member and ends no earlier than every member has begun it
    /// (a checking mode, as MPI correctness tools offer).
    pub verify_collectives: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            slots: 64,
            communicators: 16,
            send_timeout: Some(Duration::from_millis(1)),
            spin: Duration::ZERO,
            liveness_interval: Duration::from_millis(200),
            window_cache: 0,
            unexpected_per_sender: 4096,
            verify_collectives: false,
        }
    }
}

/// Where a pending send's bytes are.
pub(crate) enum SendData {
    /// In the caller's memory, which stays valid until the send completes
    /// (a blocking call, or a request holding the buffer).
    Borrowed { ptr: *const u8, len: u64 },
    /// In the sender's spool (the timeout switch copied it).
    Spooled(Vec<u8>),
}

impl SendData {
    pub(crate) fn bytes(&self) -> &[u8] {
        match self {
            // SAFETY: the owner of a borrowed send keeps the buffer alive
            // and unchanged until the send has completed (see
            // `Engine::start_send`).
            SendData::Borrowed { ptr, len } => unsafe {
                std::slice::from_raw_parts(*ptr, *len as usize)
            },
            SendData::Spooled(bytes) => bytes,
        }
    }
}

/// A send waiting for its receive.
struct PendingSend {
    generation: u64,
    /// The collective call it belongs to ([`layout::call_tag`]; 0 for
    /// point-to-point).
    call_tag: u64,
    data: SendData,
    /// The layout of a typed send's bytes in its buffer (contiguous if none).
    pattern: Option<pindown_uapi::pattern::Pattern>,
}

/// A receive posted and not yet completed.
pub(crate) struct ActiveRecv<'c> {
    pub(crate) generation: u64,
    pub(crate) capacity: u64,
    /// Keeps the receive buffer registered while the peer may write it.
    pub(crate) region: Option<MemoryRegion<'c>>,
    /// The cached window the peer writes through (its id), held in use.
    window_start: Option<u64>,
    /// The any-tag slot: the done word comes with the index the sender
    /// used.
    any_tag: bool,
    /// Set once the done word arrived (or the post failed).
    result: Option<Result<Received>>,
    /// A typed receive: its pattern and offer buffer.
    pub(crate) typed: Option<crate::typed::TypedRecv>,
    /// A typed receive reading the sender's bytes: the tag of its read.
    pub(crate) reading: Option<u64>,
    /// A small receive: the landing buffer the sender writes the body
    /// into, copied into the receive buffer once the done word came.
    landing: Option<Landing>,
}

/// Where a small receive lands and where its bytes go then.
pub(crate) struct Landing {
    /// The landing buffer's number in the sender's block.
    number: u64,
    /// The receive buffer ([`Engine::post_recv`]'s `ptr`).
    buffer: *mut u8,
}

/// What a completed receive got.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Received {
    /// Bytes delivered into the buffer.
    pub len: u64,
    /// The slot index the sender named (for any-tag receives).
    pub index: u32,
}

/// One slot's local bookkeeping (none of it is shared).
#[derive(Default)]
pub(crate) struct SlotState<'c> {
    /// Receives posted on the slot (the last one's generation).
    recvs_posted: u64,
    pub(crate) recv: Option<ActiveRecv<'c>>,
    /// Result of the last receive completed and not yet taken.
    finished_recv: Option<(u64, Result<Received>)>,
    /// Sends started on the slot (generations handed out, matched or not).
    sends_started: u64,
    /// Sends whose writes are posted or done.
    sends_posted: u64,
    /// Sends whose writes completed.
    pub(crate) sends_completed: u64,
    /// Sends a wait by (peer, index) has covered.
    sends_claimed: u64,
    /// Sends waiting for their receive, oldest first.
    waiting: VecDeque<PendingSend>,
    /// Receives of the peer this rank consumed on the slot (the stamp the
    /// next send needs is one more).
    matched: u64,
}

/// A request posted to the device and not completed.
pub(crate) enum InFlight<'c> {
    /// A send's writes: body parts then the done word.
    Send {
        slot: u64,
        generation: u64,
        _region: Option<MemoryRegion<'c>>,
        _spool: Option<Vec<u8>>,
    },
    /// A receive's match record and stamp.
    Post { slot: u64, generation: u64 },
    /// A liveness check of a peer; with the collective call it was made
    /// in, when it read the peer's records of that call.
    Probe {
        peer: u32,
        call: Option<(u32, CallRecord)>,
    },
    /// A typed send's offer and done word; the send completes on the
    /// receiver's notice.
    Offer(crate::typed::Notice<'c>),
    /// A typed receive's read of the sender's bytes.
    TypedRead { slot: u64, generation: u64 },
    /// Raw writes of the any-source domain or collectives: completion
    /// recorded by tag.
    Plain { peer: u32 },
}

/// User data bit marking a request whose completion is not the last of
/// its group (only its failure matters).
pub(crate) const PART_BIT: u64 = 1 << 63;

/// Every landing buffer of a peer's block free: one bit each.
const ALL_LANDINGS_FREE: u8 = u8::MAX;
const _: () = assert!(layout::LANDINGS == ALL_LANDINGS_FREE.count_ones() as u64);

/// User data of the no-op that asks the device whether it still answers
/// (see [`crate::liveness`]): no request's tag.
const DEVICE_CHECK: u64 = PART_BIT - 1;

/// Bytes a done word's batch stages in scratch: the body (inline up to
/// [`MAX_INLINE`]), the index word, the done word.
pub(crate) const SCRATCH_BODY: u64 = 0;
const SCRATCH_INDEX: u64 = 512;
const SCRATCH_DONE: u64 = 520;
const SCRATCH_RECORD: u64 = 528;
const SCRATCH_PROBE: u64 = 576;
/// Where a liveness check made in a collective call lands the peer's
/// call records.
const SCRATCH_CALL_RECORDS: u64 = 640;
/// Where [`Engine::read_call_records`] lands a member's call records.
const SCRATCH_CONFIRM_RECORDS: u64 = SCRATCH_CALL_RECORDS + CALL_RECORDS_BYTES;
/// Where a liveness check made in a collective call lands the peer's
/// call records on the context the communicator was made on.
const SCRATCH_ORIGIN_RECORDS: u64 = SCRATCH_CONFIRM_RECORDS + CALL_RECORDS_BYTES;
const _: () = assert!(SCRATCH_ORIGIN_RECORDS + CALL_RECORDS_BYTES <= SCRATCH_FREE);
/// Free scratch for the any-source domain and collectives.
pub(crate) const SCRATCH_FREE: u64 = 1024;

/// The longest write the engine posts as one request.
const MAX_WRITE: u64 = 1 << 30;

/// Peer state.
pub(crate) struct Peer {
    /// This rank's block of the peer's control memory: the window the
    /// peer bound for this rank's port alone.
    pub(crate) block: RemoteWindow,
    gone: Option<String>,
    probe_in_flight: bool,
    /// When the liveness check in flight was posted.
    probe_sent: Option<Instant>,
    /// When waits on the peer are to find it gone, whatever the checks
    /// say ([`Engine::declare_gone_at`]).
    declared_gone_at: Option<Instant>,
}

/// One rank's engine.
pub(crate) struct Engine<'c> {
    // Field order is drop order: the queue pairs before their completion
    // queue, windows over user memory before the control windows, the
    // control windows before their memory.
    pub(crate) qp: QueuePair<'c>,
    /// Whether the device still answers, asked on a queue pair of its
    /// own: whether a check left unanswered means a peer gone or only a
    /// slow link.
    device: DeviceWatch<'c>,
    pub(crate) cq: CompletionQueue<'c>,
    pub(crate) windows: WindowCache<'c>,
    pub(crate) in_flight: HashMap<u64, InFlight<'c>>,
    /// The window over each peer's block, bound for that peer's port.
    blocks: Vec<RegionWindow<'c>>,
    /// The registration of the control memory, which stages inline
    /// payloads (no window of its own: peers reach it only through the
    /// block bound for each).
    pub(crate) control: MemoryRegion<'c>,
    pub(crate) control_memory: DmaBuffer,
    pub(crate) context: &'c Context,
    pub(crate) layout: Layout,
    pub(crate) rank: u32,
    pub(crate) peers: Vec<Peer>,
    pub(crate) slots: Vec<SlotState<'c>>,
    /// Slots with sends waiting for their receive.
    waiting_slots: Vec<u64>,
    /// Slots with typed receives posted: the only receives that need
    /// this rank to act when their done word arrives (a read of the
    /// sender's bytes), so the only ones every progress call checks. A
    /// plain receive is checked when somebody asks about it
    /// ([`recv_outstanding`](Self::recv_outstanding)), so that a poll
    /// costs the same with one receive posted or thousands.
    typed_slots: Vec<u64>,
    /// Failures of plain requests, by tag.
    plain_failures: HashMap<u64, Error>,
    /// Failures of sends, by slot and generation, until taken.
    send_failures: HashMap<(u64, u64), Error>,
    /// Patterns of (datatype, count), compiled once.
    pub(crate) datatypes: pindown_driver::datatype::DescriptorCache,
    /// Offer buffers of typed receives, kept for reuse (their windows stay
    /// bound in the cache).
    pub(crate) offer_pool: Vec<Box<[u8]>>,
    /// The reductions' working memory (incoming vectors, a reduce's
    /// partial result), kept between calls so that its window stays
    /// bound in the cache and its pages stay resident.
    pub(crate) collective_scratch: Vec<u64>,
    /// Typed sends whose offer went out, waiting for the receiver's notice.
    pub(crate) notices: Vec<crate::typed::Notice<'c>>,
    /// Typed reads that completed, to finish at the next progress.
    pub(crate) reads_done: Vec<(u64, u64, Option<CompletionError>)>,
    /// Sends returned to their callers before completing.
    deferred_sends: Vec<(u64, u64)>,
    /// Failures of such sends, until reported.
    deferred_failures: Vec<Error>,
    /// Failures of parts of a group whose last request has not completed.
    part_failures: HashMap<u64, CompletionError>,
    pub(crate) config: Config,
    /// Set by [`Messenger::finalize`](crate::Messenger::finalize).
    pub(crate) finalized: bool,
    next_tag: u64,
    /// The any-source domain's own state (rings, unexpected queue).
    pub(crate) any: crate::any_source::AnyState,
    pub(crate) completions: Vec<Completion>,
    /// Which contexts are taken (two per communicator).
    pub(crate) contexts_taken: Vec<bool>,
    /// Sends that left the spool.
    spool_sent: u64,
    /// Buffers of dropped requests, kept until their operation completes.
    orphans: Vec<(u64, u64, bool, Box<dyn std::any::Any>)>,
    /// Collective calls made so far on each context (barriers and
    /// flag-word reductions): their epochs.
    pub(crate) collective_epochs: Vec<crate::collective::Epochs>,
    /// The collective call this rank is in: its (collective) context and
    /// record. Liveness checks made meanwhile read the peer's record of
    /// the same call ([`crate::collective::check_member`]).
    pub(crate) collective_call: Option<(u32, CallRecord)>,
    /// What a check of the current collective call found: the next wait
    /// returns it.
    pub(crate) collective_fault: Option<Error>,
    /// World ranks of the members of the current collective call's
    /// communicator (where its record goes).
    pub(crate) collective_members: Vec<u32>,
    /// A liveness check that reads a peer's call records is in flight
    /// (they share one scratch area).
    call_check_in_flight: bool,
    /// Per peer, its landing buffers free for small receives (bit `n`:
    /// buffer `n`). A receive that ended without its done word (withdrawn,
    /// failed) leaves its buffer taken: the peer may still write it.
    landings_free: Vec<u8>,
}

/// Bytes of a rank's address record in the launcher's key-value space:
/// its node and port, and its `Config::slots` and `Config::communicators`
/// (every rank must use the same: compared whole, not by the size of the
/// control area they make).
const RECORD_BYTES: usize = 12;

/// The most matching slots per (peer, communicator) a configuration may
/// name.
pub const MAX_SLOTS: u32 = 1 << 20;
/// The most communicators a configuration may name.
pub const MAX_COMMUNICATORS: u32 = 1 << 16;

impl Config {
    /// Fails with [`Error::InvalidConfig`] naming the first value out of
    /// its range.
    fn check(&self) -> Result<()> {
        if self.slots > MAX_SLOTS || self.communicators > MAX_COMMUNICATORS {
            return Err(Error::InvalidConfig(format!(
                "Config::slots {} and Config::communicators {}: at most {MAX_SLOTS} and \
                 {MAX_COMMUNICATORS}",
                self.slots, self.communicators
            )));
        }
        crate::liveness::check_liveness_interval(self.liveness_interval)
    }
}
/// Its key.
const RECORD_KEY: &str = "pindown-messaging";
/// The launcher key under which a rank publishes the key of the window
/// over `peer`'s block (8 bytes), for `peer` alone to get.
fn block_key_name(peer: u32) -> String {
    format!("pindown-messaging-for-{peer}")
}

impl<'c> Engine<'c> {
    /// Sets up this rank: control memory, its windows (one over each
    /// peer's block, bound for that peer's port), the queue pair, and
    /// every rank's windows through the launcher: first every rank's
    /// port, then, from each rank, the key of the block it bound for this
    /// one.
    pub(crate) fn new(context: &'c Context, job: &mut Job, config: Config) -> Result<Self> {
        let config = Config {
            slots: config.slots.max(1),
            communicators: config.communicators.max(1),
            unexpected_per_sender: config.unexpected_per_sender.max(1),
            ..config
        };
        config.check()?;
        let layout = Layout {
            ranks: job.size(),
            contexts: config.communicators * 2,
            // One hidden slot per (context, peer) for any-tag receives.
            slots: config.slots + 1,
        };
        // Bounded slots and communicators keep a block's size far inside
        // 64 bits; the whole area is checked against memory.
        let bytes = u128::from(layout.block_bytes()) * u128::from(layout.ranks);
        let bytes = usize::try_from(layout.bytes())
            .ok()
            .filter(|_| bytes < 1 << 48)
            .ok_or_else(|| {
                Error::InvalidConfig(format!(
                    "a control area of {bytes} bytes for {} ranks: lower Config::slots or \
                     Config::communicators",
                    layout.ranks
                ))
            })?;
        let control_memory = context.alloc(bytes, 4096)?;
        // SAFETY: the buffer was just allocated for this engine and
        // `bytes` long; zeroing it before any peer knows it exists.
        unsafe { std::ptr::write_bytes(control_memory.as_ptr(), 0, bytes) };
        let access = Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
        // SAFETY: `control_memory` moves into the engine with the region,
        // into a field declared after `control` and `blocks`: it is freed
        // only after every registration and window over it is gone.
        let control = unsafe { context.register(control_memory.iova(), bytes as u64)? };
        let mut record = [0u8; RECORD_BYTES];
        let own = context.info().address();
        record[..2].copy_from_slice(&own.node.to_le_bytes());
        record[2..4].copy_from_slice(&own.port.to_le_bytes());
        record[4..8].copy_from_slice(&config.slots.to_le_bytes());
        record[8..12].copy_from_slice(&config.communicators.to_le_bytes());
        // Both queue pairs first: a rank that cannot have them fails
        // before the others go on with the exchange.
        let mut cq = context.create_completion_queue();
        let qp = context.create_queue_pair(&mut cq)?;
        let device = DeviceWatch::new(context, &mut cq, DEVICE_CHECK)?;
        let records = job.all_gather(RECORD_KEY, &record)?;
        let mut ports = Vec::with_capacity(records.len());
        for (rank, record) in records.iter().enumerate() {
            let port = pindown_uapi::PortAddress {
                node: u16::from_le_bytes(field(record, 0, rank)?),
                port: u16::from_le_bytes(field(record, 2, rank)?),
            };
            let slots = u32::from_le_bytes(field(record, 4, rank)?);
            let communicators = u32::from_le_bytes(field(record, 8, rank)?);
            if (slots, communicators) != (config.slots, config.communicators) {
                return Err(Error::Mismatch(format!(
                    "rank {rank} uses Config::slots {slots} and Config::communicators \
                     {communicators}, this rank {} and {}: every rank must use the same",
                    config.slots, config.communicators
                )));
            }
            ports.push(port);
        }
        crate::records::distinct_ports(ports.iter().map(|p| (p.node, p.port)))?;
        // One window per peer over the words that peer writes, bound for
        // its port alone; each registration is a pin-down cache hit. Its
        // key is published for that peer to get: O(ranks) per rank.
        let mut blocks = Vec::with_capacity(ports.len());
        for (peer, &port) in ports.iter().enumerate() {
            // SAFETY: as for `control` above.
            let region = unsafe { context.register(control_memory.iova(), bytes as u64)? };
            let block = context.bind_region_window(
                region,
                layout.block_start(peer as u32),
                layout.block_bytes(),
                access,
                Some(port),
            )?;
            job.put(
                &block_key_name(peer as u32),
                &block.remote().key.0.to_le_bytes(),
            )?;
            blocks.push(block);
        }
        job.fence()?;
        let me = job.rank();
        let mut peers = Vec::with_capacity(ports.len());
        for (rank, port) in ports.into_iter().enumerate() {
            let record = match rank as u32 == me {
                true => blocks[rank].remote().key.0.to_le_bytes().to_vec(),
                false => job.get(rank as u32, &block_key_name(me))?,
            };
            let key = u64::from_le_bytes(field(&record, 0, rank)?);
            let key = pindown_uapi::RemoteKey::try_from(key).map_err(|_| Error::BadPeerRecord {
                rank: rank as u32,
                why: "a block key of 0".into(),
            })?;
            peers.push(Peer {
                block: RemoteWindow {
                    node: port.node,
                    port: port.port,
                    key,
                    len: layout.block_bytes(),
                },
                gone: None,
                probe_in_flight: false,
                probe_sent: None,
                declared_gone_at: None,
            });
        }
        let mut slots = Vec::new();
        slots.resize_with(layout.slot_count() as usize, SlotState::default);
        let mut contexts_taken = vec![false; layout.contexts as usize];
        contexts_taken[0] = true;
        contexts_taken[1] = true;
        Ok(Engine {
            qp,
            cq,
            windows: WindowCache::new(config.window_cache),
            finalized: false,
            in_flight: HashMap::new(),
            blocks,
            control,
            control_memory,
            context,
            layout,
            rank: job.rank(),
            peers,
            slots,
            waiting_slots: Vec::new(),
            typed_slots: Vec::new(),
            plain_failures: HashMap::new(),
            send_failures: HashMap::new(),
            part_failures: HashMap::new(),
            datatypes: pindown_driver::datatype::DescriptorCache::new(Default::default()),
            offer_pool: Vec::new(),
            collective_scratch: Vec::new(),
            notices: Vec::new(),
            reads_done: Vec::new(),
            deferred_sends: Vec::new(),
            deferred_failures: Vec::new(),
            config,
            next_tag: 1,
            any: crate::any_source::AnyState::new(&layout),
            completions: Vec::new(),
            contexts_taken,
            spool_sent: 0,
            orphans: Vec::new(),
            collective_epochs: vec![Default::default(); layout.contexts as usize],
            collective_call: None,
            collective_fault: None,
            collective_members: Vec::new(),
            call_check_in_flight: false,
            device,
            landings_free: vec![ALL_LANDINGS_FREE; layout.ranks as usize],
        })
    }

    /// Ranks in the world.
    pub(crate) fn world_size(&self) -> u32 {
        self.layout.ranks
    }

    /// The any-tag slot index.
    pub(crate) fn any_tag_index(&self) -> u32 {
        self.config.slots
    }

    fn word(&self, offset: u64) -> &AtomicU64 {
        debug_assert!(offset.is_multiple_of(8) && offset + 8 <= self.layout.bytes());
        // SAFETY: `offset` is an 8-aligned offset inside the control
        // memory (every layout offset is), which lives as long as the
        // engine; peers write it only through the device, whose aligned
        // 8-byte writes are single stores, so it is only ever accessed
        // as an atomic here.
        unsafe { AtomicU64::from_ptr(self.control_memory.as_ptr().add(offset as usize).cast()) }
    }

    /// Reads a control word this rank's peers write.
    pub(crate) fn load(&self, offset: u64) -> u64 {
        self.word(offset).load(Ordering::Acquire)
    }

    /// Writes a control word of this rank's own memory.
    pub(crate) fn store(&self, offset: u64, value: u64) {
        self.word(offset).store(value, Ordering::Release)
    }

    /// The control memory's first byte.
    pub(crate) fn control_ptr(&self) -> *mut u8 {
        self.control_memory.as_ptr()
    }

    /// Where the word at `offset` of world rank `peer`'s control memory
    /// (a [`Layout`] offset) is reached: through this rank's block there.
    /// Panics for any other offset (scratch, or another rank's block):
    /// this rank never writes there.
    pub(crate) fn peer_at(&self, peer: u32, offset: u64) -> RemoteAddress {
        self.try_peer_at(peer, offset).unwrap_or_else(|| {
            panic!("offset {offset} lies in no window of a peer open to this rank")
        })
    }

    /// [`peer_at`](Self::peer_at), or `None` for an offset no window of
    /// `peer` open to this rank reaches.
    pub(crate) fn try_peer_at(&self, peer: u32, offset: u64) -> Option<RemoteAddress> {
        peer_address(&self.layout, self.rank, &self.peers[peer as usize], offset)
    }

    /// The window over `peer`'s block of this rank's control memory,
    /// which only `peer` may use.
    pub(crate) fn block_window_for(&self, peer: u32) -> RemoteWindow {
        self.blocks[peer as usize].remote()
    }

    /// The port of world rank `peer`.
    pub(crate) fn peer_port(&self, peer: u32) -> pindown_uapi::PortAddress {
        let window = &self.peers[peer as usize].block;
        pindown_uapi::PortAddress {
            node: window.node,
            port: window.port,
        }
    }

    /// Fails if `peer` is known to be gone.
    /// Fails once the messenger was finalized: no call starts after
    /// [`Messenger::finalize`](crate::Messenger::finalize), whatever
    /// communicator it names.
    pub(crate) fn check_open(&self) -> Result<()> {
        if self.finalized {
            return Err(Error::Finalized);
        }
        Ok(())
    }

    pub(crate) fn check_peer(&self, peer: u32) -> Result<()> {
        match &self.peers[peer as usize].gone {
            Some(why) => Err(Error::PeerGone {
                peer,
                why: why.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Makes waits on `peer` find it gone from `at` on, as if its checks
    /// had gone unanswered: for tests of what a rank's calls do when a
    /// peer that is still there counts as gone.
    pub(crate) fn declare_gone_at(&mut self, peer: u32, at: Instant) {
        self.peers[peer as usize].declared_gone_at = Some(at);
    }

    pub(crate) fn tag(&mut self) -> u64 {
        self.next_tag += 1;
        self.next_tag
    }

    /// Posts `entries`, reaping completions while the send queue is full.
    pub(crate) fn post(&mut self, entries: &[Entry<'_>]) -> Result<()> {
        post_entries(&mut self.qp, &mut self.cq, &mut self.completions, entries)
    }

    /// Posts plain writes of `bytes` (staged inline) to `remote`, fenced
    /// if asked; the completion is recorded under the returned tag.
    pub(crate) fn write_small(
        &mut self,
        peer: u32,
        at: u64,
        bytes: &[u8],
        remote: RemoteAddress,
        fence: bool,
    ) -> Result<u64> {
        debug_assert!(bytes.len() <= MAX_INLINE as usize);
        let tag = self.tag();
        let scratch = self.layout.scratch();
        let Engine {
            qp,
            cq,
            completions,
            control,
            control_memory,
            ..
        } = self;
        let local = stage(control_memory, &*control, scratch, SCRATCH_FREE + at, bytes)?;
        let mut entry = Write::new(local, remote)
            .build()
            .inline()
            .user_data(tag)
            .signaled();
        if fence {
            entry = entry.fence();
        }
        post_entries(qp, cq, completions, &[entry])?;
        self.in_flight.insert(tag, InFlight::Plain { peer });
        Ok(tag)
    }

    /// Whether the plain request `tag` completed; its failure, if it failed.
    pub(crate) fn plain_done(&mut self, tag: u64) -> Result<bool> {
        if let Some(err) = self.plain_failures.remove(&tag) {
            return Err(err);
        }
        Ok(!self.in_flight.contains_key(&tag))
    }

    // ---- receives ----

    /// Posts a receive of at most `capacity` bytes at `ptr` on slot
    /// (`context`, `peer`, `index`) and returns the slot and generation.
    ///
    /// The caller keeps `[ptr, ptr + capacity)` valid and untouched until
    /// the receive completes (or the engine is dropped).
    pub(crate) fn post_recv(
        &mut self,
        context: u32,
        peer: u32,
        index: u32,
        ptr: *mut u8,
        capacity: u64,
    ) -> Result<(u64, u64)> {
        self.post_recv_as(context, peer, index, ptr, capacity, None)
    }

    /// [`post_recv`](Self::post_recv), typed when `typed` is given: the
    /// receive's pattern over its buffer, with its offer buffer. The match
    /// record then names the offer buffer and carries the pattern's length
    /// with [`layout::TYPED_RECEIVE`].
    pub(crate) fn post_recv_as(
        &mut self,
        context: u32,
        peer: u32,
        index: u32,
        ptr: *mut u8,
        capacity: u64,
        typed: Option<crate::typed::TypedRecv>,
    ) -> Result<(u64, u64)> {
        self.check_open()?;
        self.check_peer(peer)?;
        let slot = self.layout.slot(context, peer, index);
        // A receive keeps its slot until its request has taken the result
        // (a wait naming the slot, or the progress that finishes a typed
        // receive, leaves it there for the request): it alone takes it.
        let state = &self.slots[slot as usize];
        if state.recv.is_some() || state.finished_recv.is_some() {
            return Err(Error::SlotBusy { peer, index });
        }
        let is_typed = typed.is_some();
        let mut landing = None;
        self.windows.refresh(self.context);
        let (key, offset, region, window_start, capacity) = if let Some(typed) = &typed {
            let region = if capacity == 0 {
                None
            } else {
                // SAFETY: the caller keeps the buffer valid until the
                // receive completes (this function's contract), and the
                // region goes with the receive's slot.
                Some(unsafe { self.context.register(ptr as u64, capacity)? })
            };
            let offer = typed.offer.as_ptr() as u64;
            let sender = self.peer_port(peer);
            let (window, start, id) =
                self.windows
                    .acquire(self.context, offer, typed.offer.len() as u64, sender)?;
            let len = typed.pattern.len;
            (
                window.key,
                offer - start,
                region,
                Some(id),
                len | layout::TYPED_RECEIVE,
            )
        } else if capacity == 0 {
            // Nothing lands: a window only the sender may use, at 0.
            (self.block_window_for(peer).key, 0, None, None, 0)
        } else if let Some(number) = self.free_landing(context, peer, capacity) {
            // Small: into a landing buffer of the sender's block.
            let at = self.layout.landing(peer, number) - self.layout.block_start(peer);
            landing = Some(Landing {
                number,
                buffer: ptr,
            });
            (self.block_window_for(peer).key, at, None, None, capacity)
        } else {
            // The window first: finding none may make the cache renew the
            // registration of this memory, which the receive then holds.
            let sender = self.peer_port(peer);
            let (window, start, id) =
                self.windows
                    .acquire(self.context, ptr as u64, capacity, sender)?;
            // SAFETY: the caller keeps the buffer valid until the receive
            // completes (this function's contract), and the region goes
            // with the receive's slot.
            let region = unsafe {
                self.windows
                    .register_evicting(self.context, ptr as u64, capacity)
            };
            let region = match region {
                Ok(region) => region,
                Err(err) => {
                    self.windows.release(id);
                    return Err(err.into());
                }
            };
            (
                window.key,
                ptr as u64 - start,
                Some(region),
                Some(id),
                capacity,
            )
        };
        let generation = self.slots[slot as usize].recvs_posted + 1;
        let mut record = [0u8; 24];
        record[..8].copy_from_slice(&key.0.to_le_bytes());
        record[8..16].copy_from_slice(&offset.to_le_bytes());
        let capacity_word = layout::tagged_capacity(capacity, self.call_tag_on(context));
        record[16..24].copy_from_slice(&capacity_word.to_le_bytes());
        let target = self
            .layout
            .match_record(self.layout.slot(context, self.rank, index));
        let record_at = self.peer_at(peer, target);
        let stamp_at = self.peer_at(peer, target + MATCH_STAMP_AT);
        let tag = self.tag();
        let scratch = self.layout.scratch();
        let posted = (|| {
            let Engine {
                qp,
                cq,
                completions,
                control: window,
                control_memory,
                ..
            } = &mut *self;
            let region = &*window;
            let record_local = stage(control_memory, region, scratch, SCRATCH_RECORD, &record)?;
            let stamp_local = stage(
                control_memory,
                region,
                scratch,
                SCRATCH_RECORD + 24,
                &generation.to_le_bytes(),
            )?;
            let entries = [
                Write::new(record_local, record_at)
                    .build()
                    .inline()
                    .user_data(tag | PART_BIT),
                Write::new(stamp_local, stamp_at)
                    .build()
                    .inline()
                    .fence()
                    .user_data(tag)
                    .signaled(),
            ];
            post_entries(qp, cq, completions, &entries)
        })();
        if let Err(err) = posted {
            if let Some(id) = window_start {
                self.windows.release(id);
            }
            // A landing buffer stays taken: the record may have reached
            // the peer even so (a polling device runs requests whose
            // doorbell failed), and its send would write there.
            return Err(err);
        }
        self.in_flight
            .insert(tag, InFlight::Post { slot, generation });
        let state = &mut self.slots[slot as usize];
        state.recvs_posted = generation;
        state.finished_recv = None;
        state.recv = Some(ActiveRecv {
            generation,
            capacity: capacity & !layout::TYPED_RECEIVE,
            region,
            window_start,
            any_tag: index == self.config.slots,
            result: None,
            typed,
            reading: None,
            landing,
        });
        if is_typed {
            self.typed_slots.push(slot);
        }
        Ok((slot, generation))
    }

    /// The result of receive `generation` on `slot`, once it completed
    /// (taken: a second call says `None`).
    pub(crate) fn take_recv(&mut self, slot: u64, generation: u64) -> Option<Result<Received>> {
        let state = &mut self.slots[slot as usize];
        match state.finished_recv.take() {
            Some((g, result)) if g == generation => Some(result),
            other => {
                state.finished_recv = other;
                None
            }
        }
    }

    /// Whether receive `generation` on `slot` is still outstanding
    /// (checking its done word).
    pub(crate) fn recv_outstanding(&mut self, slot: u64, generation: u64) -> bool {
        let posted = self.slots[slot as usize]
            .recv
            .as_ref()
            .is_some_and(|r| r.generation == generation);
        posted && !self.check_recv(slot)
    }

    /// The generation of the receive outstanding on `slot`, or of the last
    /// one completed whose result nobody took yet.
    pub(crate) fn recv_generation(&self, slot: u64) -> Option<u64> {
        let state = &self.slots[slot as usize];
        state
            .recv
            .as_ref()
            .map(|r| r.generation)
            .or(state.finished_recv.as_ref().map(|&(g, _)| g))
    }

    /// Checks the done words of the typed receives posted (plain ones are
    /// checked when asked about).
    fn check_recvs(&mut self) {
        let mut i = 0;
        while i < self.typed_slots.len() {
            let slot = self.typed_slots[i];
            let typed_posted = self.slots[slot as usize]
                .recv
                .as_ref()
                .is_some_and(|r| r.typed.is_some());
            if !typed_posted || self.check_recv(slot) {
                self.typed_slots.swap_remove(i);
            } else {
                i += 1;
            }
        }
    }

    /// Checks the done word of the receive posted on `slot`, finishing it
    /// (or, for a typed receive offered the sender's bytes, starting its
    /// read); whether the slot has no receive outstanding any more.
    fn check_recv(&mut self, slot: u64) -> bool {
        let done_at = self.layout.done_word(slot);
        let word = self.load(done_at);
        let state = &self.slots[slot as usize];
        let Some(recv) = state.recv.as_ref() else {
            return true;
        };
        let result = match &recv.result {
            Some(_) => self.slots[slot as usize]
                .recv
                .as_mut()
                .unwrap()
                .result
                .take(),
            None if recv.typed.is_some() => match layout::done_len(word, recv.generation) {
                Some((len, true)) if recv.reading.is_none() => {
                    self.start_typed_read(slot, len);
                    return false;
                }
                Some((len, false)) => Some(Err(Error::Mismatch(format!(
                    "a typed receive got {len} bytes written, not an offer"
                )))),
                _ => None,
            },
            None => layout::done_len(word, recv.generation).map(|(len, _)| {
                let index = if recv.any_tag {
                    self.load(done_at + 8)
                } else {
                    u64::from(self.layout.slot_parts(slot).2)
                };
                if index >= u64::from(self.config.slots) {
                    Err(Error::BadPeerRecord {
                        rank: self.slot_peer(slot),
                        why: format!(
                            "an any-index receive completed on index {index}, beyond the \
                             {} slots per peer",
                            self.config.slots
                        ),
                    })
                } else if len > recv.capacity {
                    Err(Error::Truncated {
                        message: len,
                        capacity: recv.capacity,
                    })
                } else {
                    Ok(Received {
                        len,
                        index: index as u32,
                    })
                }
            }),
        };
        match result {
            Some(result) => {
                if matches!(result, Ok(_) | Err(Error::Truncated { .. })) {
                    self.land(slot, word);
                }
                self.finish_recv(slot, result);
                true
            }
            None => false,
        }
    }

    /// A landing buffer of `peer`'s block for a receive of `capacity`
    /// bytes on `context`, taken, if the receive is small, not part of a
    /// collective call, and one is free. (A member that gives a
    /// collective call up withdraws its receives, and the refusal of a
    /// write into a withdrawn receive's window is how the others learn it;
    /// a landing buffer would take the write.)
    fn free_landing(&mut self, context: u32, peer: u32, capacity: u64) -> Option<u64> {
        if capacity > layout::LANDING_BYTES || self.call_tag_on(context) != 0 {
            return None;
        }
        let free = &mut self.landings_free[peer as usize];
        if *free == 0 {
            return None;
        }
        let number = free.trailing_zeros();
        *free &= !(1 << number);
        Some(u64::from(number))
    }

    /// Copies what landed for the small receive on `slot` into its
    /// buffer (as much of the message as the buffer holds) and frees its
    /// landing buffer, once `word` (the slot's done word) says its sender
    /// is done writing there. A receive refused for what its sender wrote
    /// gets nothing copied, and its landing buffer stays taken.
    fn land(&mut self, slot: u64, word: u64) {
        let peer = self.slot_peer(slot);
        let Some(recv) = self.slots[slot as usize].recv.as_mut() else {
            return;
        };
        let Some((len, false)) = layout::done_len(word, recv.generation) else {
            return;
        };
        let Some(landing) = recv.landing.take() else {
            return;
        };
        let len = len.min(recv.capacity) as usize;
        // SAFETY: the receive is still outstanding, so the caller of
        // `post_recv` keeps its `capacity` bytes at `buffer` valid and
        // untouched (its contract); `len` is at most the capacity.
        let buffer = unsafe { std::slice::from_raw_parts_mut(landing.buffer, len) };
        let at = self.layout.landing(peer, landing.number);
        self.control_memory.read_at(at as usize, buffer);
        self.landings_free[peer as usize] |= 1 << landing.number;
    }

    /// Takes receive `generation` on `slot` back after its wait failed,
    /// so that its buffer may go back to the caller: the window its sender
    /// writes through is revoked (waiting as long as the device takes, so
    /// that no write is in flight or can land later), and a typed
    /// receive's own read into the buffer is waited for (every request of
    /// the queue pair finished). Nothing to do if it completed meanwhile.
    /// In a collective call, the call is published as given up first.
    pub(crate) fn withdraw_recv(&mut self, slot: u64, generation: u64) {
        let state = &mut self.slots[slot as usize];
        if state
            .recv
            .as_ref()
            .is_none_or(|r| r.generation != generation)
        {
            return;
        }
        let Some(recv) = state.recv.take() else {
            return;
        };
        state.finished_recv = None;
        // A member whose write the withdrawal refuses reads why in the
        // call's record: it goes out first.
        crate::collective::publish_given_up(self);
        if let Some(id) = recv.window_start {
            self.windows.withdraw(id);
        }
        if recv.reading.is_some() {
            // Completions must keep being taken for the device to go on.
            while !matches!(self.qp.all_finished(), Ok(true) | Err(_)) {
                let _ = self.progress();
                std::thread::yield_now();
            }
        }
        drop(recv.region);
        if let Some(typed) = recv.typed {
            self.offer_pool.push(typed.offer);
        }
    }

    pub(crate) fn finish_recv(&mut self, slot: u64, result: Result<Received>) {
        let state = &mut self.slots[slot as usize];
        if let Some(recv) = state.recv.take() {
            if let Some(id) = recv.window_start {
                self.windows.release(id);
            }
            drop(recv.region);
            state.finished_recv = Some((recv.generation, result));
            if let Some(typed) = recv.typed {
                self.offer_pool.push(typed.offer);
            }
        }
    }

    // ---- sends ----

    /// Starts a send of `data` on slot (`context`, `peer`, `index`) and
    /// returns the slot and the send's generation. It goes out as soon as
    /// its receive is posted (now, or from a later progress call).
    pub(crate) fn start_send(
        &mut self,
        context: u32,
        peer: u32,
        index: u32,
        data: SendBytes,
        pattern: Option<pindown_uapi::pattern::Pattern>,
    ) -> Result<(u64, u64)> {
        self.check_open()?;
        self.check_peer(peer)?;
        if data.len() > layout::MAX_MESSAGE {
            return Err(Error::TooLong {
                len: data.len(),
                limit: layout::MAX_MESSAGE,
            });
        }
        let slot = self.layout.slot(context, peer, index);
        let state = &mut self.slots[slot as usize];
        state.sends_started += 1;
        let generation = state.sends_started;
        let data = match data {
            SendBytes::Borrowed { ptr, len } => SendData::Borrowed { ptr, len },
        };
        if state.waiting.is_empty() {
            self.waiting_slots.push(slot);
        }
        let call_tag = self.call_tag_on(context);
        self.slots[slot as usize].waiting.push_back(PendingSend {
            generation,
            call_tag,
            data,
            pattern,
        });
        self.try_sends(slot)?;
        Ok((slot, generation))
    }

    /// Whether send `generation` on `slot` left (its writes are posted).
    pub(crate) fn send_posted(&self, slot: u64, generation: u64) -> bool {
        self.slots[slot as usize].sends_posted >= generation
    }

    /// Whether send `generation` on `slot` completed.
    pub(crate) fn send_completed(&self, slot: u64, generation: u64) -> bool {
        self.slots[slot as usize].sends_completed >= generation
    }

    /// The last send started on `slot` that no wait by name has covered
    /// yet, marking it (and those before it) covered.
    pub(crate) fn claim_sends(&mut self, slot: u64) -> Option<u64> {
        let state = &mut self.slots[slot as usize];
        if state.sends_claimed == state.sends_started {
            return None;
        }
        state.sends_claimed = state.sends_started;
        Some(state.sends_started)
    }

    /// Moves a waiting send's bytes into the spool (the timeout switch).
    pub(crate) fn spool(&mut self, slot: u64, generation: u64) {
        if let Some(pending) = self.slots[slot as usize]
            .waiting
            .iter_mut()
            .find(|p| p.generation == generation)
        {
            if let SendData::Borrowed { .. } = pending.data {
                pending.data = SendData::Spooled(pending.data.bytes().to_vec());
            }
        }
    }

    /// Forgets the sends on `context`'s slots that still wait for their
    /// receives: a failed collective call's, on a context its
    /// communicator does not use again. They count as completed, and
    /// nothing waits for them (not finalize either).
    pub(crate) fn forget_waiting_sends(&mut self, context: u32) {
        let layout = self.layout;
        let slots = &mut self.slots;
        self.waiting_slots.retain(|&slot| {
            if layout.slot_parts(slot).0 != context {
                return true;
            }
            let state = &mut slots[slot as usize];
            if let Some(last) = state.waiting.back() {
                state.sends_completed = state.sends_completed.max(last.generation);
            }
            state.waiting.clear();
            false
        });
    }

    /// The tag of the collective call this rank is in, for a send or
    /// receive on `context` ([`layout::call_tag`]); 0 outside one.
    fn call_tag_on(&self, context: u32) -> u64 {
        match self.collective_call {
            Some((call_context, record)) if call_context == context => {
                layout::call_tag(record.call)
            }
            _ => 0,
        }
    }

    /// Sends spooled and still waiting for their receives.
    pub(crate) fn spooled(&self) -> u64 {
        self.waiting_slots
            .iter()
            .map(|&slot| {
                self.slots[slot as usize]
                    .waiting
                    .iter()
                    .filter(|p| matches!(p.data, SendData::Spooled(_)))
                    .count() as u64
            })
            .sum()
    }

    /// Sends that left the spool so far.
    pub(crate) fn spool_sent(&self) -> u64 {
        self.spool_sent
    }

    /// Matches and posts the waiting sends of `slot`, in order.
    fn try_sends(&mut self, slot: u64) -> Result<()> {
        let (context, peer, index) = self.layout.slot_parts(slot);
        let any_slot = self.layout.slot(context, peer, self.config.slots);
        while let Some(front) = self.slots[slot as usize].waiting.front() {
            let generation = front.generation;
            // The explicit slot first, then the any-tag slot.
            let explicit_stamp = self.load(self.layout.match_record(slot) + MATCH_STAMP_AT);
            let target_slot = if explicit_stamp == self.slots[slot as usize].matched + 1 {
                slot
            } else if slot != any_slot
                && self.load(self.layout.match_record(any_slot) + MATCH_STAMP_AT)
                    == self.slots[any_slot as usize].matched + 1
            {
                any_slot
            } else {
                return Ok(());
            };
            let pending = self.slots[slot as usize]
                .waiting
                .pop_front()
                .expect("front");
            let record_at = self.layout.match_record(target_slot);
            let (capacity, receive_tag) = layout::capacity_and_tag(self.load(record_at + 16));
            if pending.call_tag != 0 && receive_tag != 0 && pending.call_tag != receive_tag {
                // A send of one collective call meets a receive of another
                // (members that disagree, or one call's leftover): nothing
                // moves, the receive waits for its own call's send.
                self.slots[slot as usize].sends_posted = generation;
                self.fail_send(
                    slot,
                    generation,
                    Error::Mismatch(format!(
                        "world rank {peer}'s receive belongs to another collective call \
                         (tag {receive_tag}) than this send (tag {})",
                        pending.call_tag
                    )),
                );
                continue;
            }
            self.slots[target_slot as usize].matched += 1;
            let receive_generation = self.slots[target_slot as usize].matched;
            let key = self.load(record_at);
            let offset = self.load(record_at + 8);
            // The same slot at the receiver, named from its side.
            let remote_slot =
                self.layout
                    .slot(context, self.rank, self.layout.slot_parts(target_slot).2);
            if capacity & layout::TYPED_RECEIVE != 0 || pending.pattern.is_some() {
                let result = self.post_typed_send(
                    crate::typed::Matched {
                        peer,
                        slot,
                        generation,
                        key,
                        offset,
                        capacity,
                        any_tag_index: (target_slot == any_slot && slot != any_slot)
                            .then_some(index),
                        remote_slot,
                        record_at,
                        receive_generation,
                    },
                    pending.data,
                    pending.pattern,
                );
                self.slots[slot as usize].sends_posted = generation;
                if let Err(err) = result {
                    self.fail_send(slot, generation, err);
                }
                continue;
            }
            let result = self.post_send(
                peer,
                slot,
                generation,
                pending.data,
                key,
                offset,
                capacity,
                (target_slot == any_slot && slot != any_slot).then_some(index),
                remote_slot,
                receive_generation,
            );
            self.slots[slot as usize].sends_posted = generation;
            if let Err(err) = result {
                self.fail_send(slot, generation, err);
            }
        }
        self.waiting_slots.retain(|&s| s != slot);
        Ok(())
    }

    /// Posts the writes of a matched send: the body into the receive
    /// buffer (cut at its capacity), the index word for an any-tag
    /// receive, and the done word, fenced after them.
    #[allow(clippy::too_many_arguments)]
    fn post_send(
        &mut self,
        peer: u32,
        slot: u64,
        generation: u64,
        data: SendData,
        key: u64,
        offset: u64,
        capacity: u64,
        any_tag_index: Option<u32>,
        remote_slot: u64,
        receive_generation: u64,
    ) -> Result<()> {
        let control = self.peers[peer as usize].block;
        let key = pindown_uapi::RemoteKey::try_from(key).map_err(|_| Error::BadPeerRecord {
            rank: peer,
            why: "a match record with key 0".into(),
        })?;
        let body_window = RemoteWindow {
            node: control.node,
            port: control.port,
            key,
            len: offset.saturating_add(capacity),
        };
        let bytes = data.bytes();
        let len = bytes.len() as u64;
        let moved = len.min(capacity);
        let tag = self.tag();
        let region = if moved > u64::from(MAX_INLINE) {
            self.windows.refresh(self.context);
            // SAFETY: the bytes are the caller's, kept valid until the send
            // completes (`SendData::Borrowed`'s contract), or the spool's
            // heap bytes, which move with the region into `in_flight` and
            // are freed with it once the send has completed.
            Some(unsafe { self.context.register(bytes.as_ptr() as u64, moved)? })
        } else {
            None
        };
        let done = self.peer_at(peer, self.layout.done_word(remote_slot));
        let scratch = self.layout.scratch();
        {
            let Engine {
                qp,
                cq,
                completions,
                control: window,
                control_memory,
                ..
            } = &mut *self;
            let own = &*window;
            let mut entries: Vec<Entry<'_>> = Vec::with_capacity(4);
            if moved > 0 {
                match &region {
                    None => {
                        let local = stage(
                            control_memory,
                            own,
                            scratch,
                            SCRATCH_BODY,
                            &bytes[..moved as usize],
                        )?;
                        entries.push(
                            Write::new(local, body_window.at(offset))
                                .build()
                                .inline()
                                .user_data(tag | PART_BIT),
                        );
                    }
                    Some(region) => {
                        let mut at = 0;
                        while at < moved {
                            let n = (moved - at).min(MAX_WRITE);
                            entries.push(
                                Write::new(
                                    region.local(at, n as u32)?,
                                    body_window.at(offset + at),
                                )
                                .build()
                                .user_data(tag | PART_BIT),
                            );
                            at += n;
                        }
                    }
                }
            }
            SendTail {
                done,
                any_tag_index,
                word: layout::done_word(receive_generation, len, false),
                tag,
            }
            .push(control_memory, own, scratch, &mut entries)?;
            post_entries(qp, cq, completions, &entries)?;
        }
        let spool = match data {
            SendData::Spooled(v) => {
                self.spool_sent += 1;
                Some(v)
            }
            SendData::Borrowed { .. } => None,
        };
        self.in_flight.insert(
            tag,
            InFlight::Send {
                slot,
                generation,
                _region: region,
                _spool: spool,
            },
        );
        Ok(())
    }

    pub(crate) fn fail_send(&mut self, slot: u64, generation: u64, err: Error) {
        let state = &mut self.slots[slot as usize];
        state.sends_completed = state.sends_completed.max(generation);
        self.send_failures.insert((slot, generation), err);
    }

    /// Marks send `generation` on `slot` as returned to its caller: a
    /// failure it meets later is reported by the next
    /// [`take_deferred_failure`](Self::take_deferred_failure).
    pub(crate) fn defer_failure(&mut self, slot: u64, generation: u64) {
        if self.send_completed(slot, generation) {
            if let Some(err) = self.send_failures.remove(&(slot, generation)) {
                self.deferred_failures.push(err);
            }
        } else {
            self.deferred_sends.push((slot, generation));
        }
    }

    /// The first failure of a send that had returned to its caller.
    pub(crate) fn take_deferred_failure(&mut self) -> Option<Error> {
        let mut i = 0;
        while i < self.deferred_sends.len() {
            let (slot, generation) = self.deferred_sends[i];
            if self.send_completed(slot, generation) {
                self.deferred_sends.swap_remove(i);
                if let Some(err) = self.send_failures.remove(&(slot, generation)) {
                    self.deferred_failures.push(err);
                }
            } else {
                i += 1;
            }
        }
        (!self.deferred_failures.is_empty()).then(|| self.deferred_failures.remove(0))
    }

    /// The failure of send `generation` on `slot`, if it failed (taken).
    pub(crate) fn take_send_failure(&mut self, slot: u64, generation: u64) -> Option<Error> {
        self.send_failures.remove(&(slot, generation))
    }

    // ---- progress ----

    /// Reaps completions.
    fn reap(&mut self) -> Result<()> {
        // Completions stashed while posting came first.
        self.cq.poll_into(&mut self.completions)?;
        if !self.completions.is_empty() {
            self.device.heard();
        }
        while !self.completions.is_empty() {
            for completion in std::mem::take(&mut self.completions) {
                self.complete(completion);
            }
        }
        Ok(())
    }

    /// The world rank a slot's peer is.
    pub(crate) fn slot_peer(&self, slot: u64) -> u32 {
        self.layout.slot_parts(slot).1
    }

    /// The error a failed request to `peer` means: the peer gone (and
    /// marked so) when the device says its port or node is, else the
    /// device's own words.
    pub(crate) fn peer_failure(&mut self, peer: u32, err: CompletionError) -> Error {
        if err.status == Status::PeerGone
            || matches!(
                err.detail,
                ErrorDetail::PortDown | ErrorDetail::NodeUnreachable | ErrorDetail::UnknownNode
            )
        {
            let why = format!("the device reports {err}");
            self.peers[peer as usize].gone.get_or_insert(why.clone());
            return Error::PeerGone { peer, why };
        }
        Error::Completion(err)
    }

    fn complete(&mut self, completion: Completion) {
        let part = completion.user_data & PART_BIT != 0;
        let tag = completion.user_data & !PART_BIT;
        let failure = completion.result().err();
        if part {
            // Only a failed part completes; remember it for its group.
            if let Some(err) = failure {
                self.part_failures.insert(tag, err);
            }
            return;
        }
        let failure = self.part_failures.remove(&tag).or(failure);
        match self.in_flight.remove(&tag) {
            Some(InFlight::Send {
                slot, generation, ..
            }) => {
                let state = &mut self.slots[slot as usize];
                state.sends_completed = state.sends_completed.max(generation);
                if let Some(err) = failure {
                    let err = self.peer_failure(self.slot_peer(slot), err);
                    self.send_failures.insert((slot, generation), err);
                }
            }
            Some(InFlight::Post { slot, generation }) => {
                if let Some(err) = failure {
                    let err = self.peer_failure(self.slot_peer(slot), err);
                    if let Some(recv) = self.slots[slot as usize].recv.as_mut() {
                        if recv.generation == generation {
                            recv.result = Some(Err(err));
                        }
                    }
                }
            }
            Some(InFlight::Offer(notice)) => match failure {
                None => self.notices.push(notice),
                Some(err) => {
                    let err = self.peer_failure(self.slot_peer(notice.slot), err);
                    self.fail_send(notice.slot, notice.generation, err);
                    self.windows.release(notice.window_id);
                }
            },
            Some(InFlight::TypedRead { slot, generation }) => {
                self.reads_done.push((slot, generation, failure));
            }
            Some(InFlight::Probe { peer, call }) => {
                self.peers[peer as usize].probe_in_flight = false;
                if call.is_some() {
                    self.call_check_in_flight = false;
                }
                if let Some(err) = failure {
                    let why = format!("its control memory no longer answers: {err}");
                    self.peers[peer as usize].gone.get_or_insert(why);
                } else if call.is_some() && call == self.collective_call {
                    self.check_call_records(peer);
                }
            }
            Some(InFlight::Plain { peer }) => {
                if let Some(err) = failure {
                    let err = self.peer_failure(peer, err);
                    self.plain_failures.insert(tag, err);
                }
            }
            None => {}
        }
    }

    /// Advances everything: completions, waiting sends, posted receives,
    /// buffers of dropped requests.
    pub(crate) fn progress(&mut self) -> Result<()> {
        self.reap()?;
        if !self.reads_done.is_empty() {
            self.finish_typed_reads()?;
        }
        if !self.notices.is_empty() {
            self.check_notices();
        }
        if !self.waiting_slots.is_empty() {
            for slot in self.waiting_slots.clone() {
                self.try_sends(slot)?;
            }
        }
        if !self.typed_slots.is_empty() {
            self.check_recvs();
        }
        if !self.orphans.is_empty() {
            let mut orphans = std::mem::take(&mut self.orphans);
            orphans.retain(|&(slot, generation, is_send, _)| {
                if is_send {
                    !self.send_completed(slot, generation)
                } else if self.recv_outstanding(slot, generation) {
                    true
                } else {
                    // No request will take the result: free the slot.
                    self.take_recv(slot, generation);
                    false
                }
            });
            self.orphans = orphans;
        }
        Ok(())
    }

    /// Keeps `buffer` until operation `generation` on `slot` completes.
    pub(crate) fn adopt(
        &mut self,
        slot: u64,
        generation: u64,
        is_send: bool,
        buffer: Box<dyn std::any::Any>,
    ) {
        self.orphans.push((slot, generation, is_send, buffer));
    }

    /// Checks that `peer` is still there: a read of its control memory,
    /// whose failure marks it gone.
    fn probe(&mut self, peer: u32) -> Result<()> {
        if peer == self.rank || self.peers[peer as usize].probe_in_flight {
            return Ok(());
        }
        let tag = self.tag();
        // In a collective call (and no other such check in flight): the
        // peer's records of the call's context, which it keeps for this
        // rank in this rank's block there. Else the first word of that
        // block. Either is memory this rank may read.
        // A communicator made by a split or dup: also the peer's records
        // of the context it was made on (did the peer give that up?).
        let call = self.collective_call.filter(|_| !self.call_check_in_flight);
        let mut reads = Vec::with_capacity(2);
        match call {
            Some((context, _)) => {
                if let Some((parent, _)) = crate::collective::origin(self, context) {
                    reads.push((
                        self.layout.scratch() + SCRATCH_ORIGIN_RECORDS,
                        CALL_RECORDS_BYTES as u32,
                        self.peer_at(peer, self.layout.call_records(parent, self.rank)),
                    ));
                }
                reads.push((
                    self.layout.scratch() + SCRATCH_CALL_RECORDS,
                    CALL_RECORDS_BYTES as u32,
                    self.peer_at(peer, self.layout.call_records(context, self.rank)),
                ));
            }
            None => reads.push((
                self.layout.scratch() + SCRATCH_PROBE,
                8,
                self.peers[peer as usize].block.at(0),
            )),
        }
        self.read_into_scratch(&reads, tag)?;
        self.peers[peer as usize].probe_in_flight = true;
        self.peers[peer as usize].probe_sent = Some(Instant::now());
        self.call_check_in_flight |= call.is_some();
        self.in_flight.insert(tag, InFlight::Probe { peer, call });
        Ok(())
    }

    /// What the call records of `members` say of this rank's current
    /// collective call, read now, one member after another: the first
    /// that gave this call (or an earlier one) up or refused it. For a
    /// call that failed with a remote access refused: a member that gave
    /// its part up withdrew the receive a send of this rank found, and
    /// its record names the cause. Waits at most
    /// [`Config::liveness_interval`] per member.
    pub(crate) fn member_that_gave_up(&mut self, members: &[u32]) -> Option<Error> {
        self.collective_call?;
        // A check made meanwhile may have found it already.
        if let Some(fault) = self.collective_fault.take().filter(Error::is_member_fault) {
            return Some(fault);
        }
        for &peer in members {
            if peer == self.rank || self.peers[peer as usize].gone.is_some() {
                continue;
            }
            let deadline = Some(Instant::now() + self.config.liveness_interval);
            let idle = |e: &mut Self| {
                Ok(!e.peers[peer as usize].probe_in_flight && !e.call_check_in_flight)
            };
            if !matches!(self.wait_until(None, deadline, idle), Ok(true)) {
                continue;
            }
            self.collective_fault = None;
            if self.probe(peer).is_err() {
                continue;
            }
            let answered = |e: &mut Self| Ok(!e.peers[peer as usize].probe_in_flight);
            if !matches!(self.wait_until(None, deadline, answered), Ok(true)) {
                continue;
            }
            if let Some(fault) = self.collective_fault.take().filter(Error::is_member_fault) {
                return Some(fault);
            }
        }
        None
    }

    /// Compares the call records a liveness check just read from `peer`
    /// with this rank's current collective call; a disagreement becomes
    /// the fault the next wait returns.
    fn check_call_records(&mut self, peer: u32) {
        let Some((context, mine)) = self.collective_call else {
            return;
        };
        let records = self.call_records_at(self.layout.scratch() + SCRATCH_CALL_RECORDS);
        if let Some((_, made_by)) = crate::collective::origin(self, context) {
            let parent = self.call_records_at(self.layout.scratch() + SCRATCH_ORIGIN_RECORDS);
            if let Some(fault) = crate::collective::check_origin(peer, made_by, &records, &parent) {
                self.collective_fault.get_or_insert(fault);
            }
        }
        if let Some(fault) = crate::collective::check_member(peer, &mine, &records) {
            self.collective_fault.get_or_insert(fault);
        }
    }

    /// The call records a read landed at `at` in this rank's memory, slot
    /// by slot ([`layout::CALL_RECORD_SLOTS`]).
    fn call_records_at(&self, at: u64) -> [[u64; 3]; CALL_RECORD_SLOTS as usize] {
        std::array::from_fn(|slot| {
            let word = |i: u64| self.load(at + slot as u64 * CALL_RECORD_BYTES + 8 * i);
            [word(0), word(1), word(2)]
        })
    }

    /// Posts reads into this rank's control memory, each of `len` bytes
    /// at `remote` landing at `at`, completed together under `tag` (the
    /// last is fenced after the others and signaled).
    fn read_into_scratch(&mut self, reads: &[(u64, u32, RemoteAddress)], tag: u64) -> Result<()> {
        let Engine {
            qp,
            cq,
            completions,
            control: window,
            ..
        } = &mut *self;
        let mut entries = Vec::with_capacity(reads.len());
        for (i, &(at, len, remote)) in reads.iter().enumerate() {
            let entry = Read::new((*window).local(at, len)?, remote).build();
            entries.push(match (i + 1 == reads.len(), i) {
                (true, 0) => entry.user_data(tag).signaled(),
                (true, _) => entry.fence().user_data(tag).signaled(),
                (false, _) => entry.user_data(tag | PART_BIT),
            });
        }
        post_entries(qp, cq, completions, &entries)?;
        Ok(())
    }

    /// Reads the call records `peer` keeps for this rank on collective
    /// context `context`, now, waiting for them as on the peer (a peer
    /// that is gone fails it with [`Error::PeerGone`]).
    pub(crate) fn read_call_records(
        &mut self,
        peer: u32,
        context: u32,
    ) -> Result<[[u64; 3]; CALL_RECORD_SLOTS as usize]> {
        let at = self.layout.scratch() + SCRATCH_CONFIRM_RECORDS;
        let remote = self.peer_at(peer, self.layout.call_records(context, self.rank));
        let tag = self.tag();
        self.read_into_scratch(&[(at, CALL_RECORDS_BYTES as u32, remote)], tag)?;
        self.in_flight.insert(tag, InFlight::Plain { peer });
        self.wait_until(Some(peer), None, |e| e.plain_done(tag))?;
        Ok(self.call_records_at(at))
    }

    /// Waits until `ready` says so, progressing meanwhile: polls for
    /// [`Config::spin`], then yields the processor between polls, then
    /// naps. While it waits on `peer`, it checks every
    /// [`Config::liveness_interval`] that the peer is still there, and
    /// fails with [`Error::PeerGone`] once it is not. `deadline`: give up
    /// (returning `Ok(false)`) at that instant.
    pub(crate) fn wait_until(
        &mut self,
        peer: Option<u32>,
        deadline: Option<Instant>,
        mut ready: impl FnMut(&mut Self) -> Result<bool>,
    ) -> Result<bool> {
        let start = Instant::now();
        let mut next_probe = start + self.config.liveness_interval;
        let mut polls: u32 = 0;
        let mut yielding = self.config.spin.is_zero();
        loop {
            self.progress()?;
            if ready(self)? {
                return Ok(true);
            }
            // Only a wait on a peer ends at what a check found: one on no
            // peer (a failed call making its memory safe) waits it out.
            if peer.is_some() {
                if let Some(fault) = self.collective_fault.take() {
                    return Err(fault);
                }
            }
            if let Some(peer) = peer {
                self.check_peer(peer)?;
            }
            polls = polls.wrapping_add(1);
            if !polls.is_multiple_of(64) {
                if yielding {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
                continue;
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                return Ok(false);
            }
            if let Some(peer) = peer {
                if now >= next_probe {
                    match self.device.closed()? {
                        Some(why) => {
                            self.peers[peer as usize].gone.get_or_insert(why.into());
                        }
                        None => self.probe(peer)?,
                    }
                    next_probe = now + self.config.liveness_interval;
                }
                // A check left unanswered: the peer gone only if the
                // device answers nothing either (see `crate::liveness`).
                let state = &mut self.peers[peer as usize];
                if let Some(sent) = state.probe_sent.filter(|_| state.probe_in_flight) {
                    let interval = self.config.liveness_interval;
                    if let Some(why) = self.device.silent(sent, now, interval)? {
                        state.gone.get_or_insert(why);
                    }
                }
                if state.declared_gone_at.is_some_and(|at| now >= at) {
                    state
                        .gone
                        .get_or_insert("declared gone by the program".into());
                }
            }
            let waited = now - start;
            yielding = waited >= self.config.spin;
            if waited > Duration::from_millis(20) {
                std::thread::sleep(Duration::from_micros(50));
            } else if yielding {
                std::thread::yield_now();
            }
        }
    }
}

impl Drop for Engine<'_> {
    /// Lets the requests already posted finish (a short send returns
    /// before its writes ran, a collective's last flag words go
    /// unwaited; leaving at once would drop them with the port), for at
    /// most a few seconds.
    fn drop(&mut self) {
        // The device having finished every request posted covers the
        // sends still in flight too.
        settle_posted(
            self,
            Instant::now() + SETTLE_ON_DROP,
            |engine| !matches!(engine.qp.all_finished(), Ok(false)),
            Self::reap,
        );
    }
}

impl Engine<'_> {
    /// Waits until every send, spooled ones included, has completed and
    /// every request posted has finished; fails after `timeout` naming
    /// what is left, or with the first failure of a send that had
    /// returned.
    pub(crate) fn flush(&mut self, timeout: Duration) -> Result<()> {
        let deadline = crate::records::deadline_after(timeout);
        let drained = self.wait_until(None, deadline, |e| {
            Ok(e.in_flight.is_empty() && e.waiting_slots.is_empty())
        })?;
        if let Some(err) = self.take_deferred_failure() {
            return Err(err);
        }
        if !drained {
            return Err(Error::Unfinished {
                spooled: self.spooled(),
                in_flight: self.in_flight.len() as u64,
            });
        }
        Ok(())
    }
}

/// The bytes a send starts with.
pub(crate) enum SendBytes {
    /// The caller's memory, valid and unchanged until the send completes.
    Borrowed { ptr: *const u8, len: u64 },
}

impl SendBytes {
    fn len(&self) -> u64 {
        match self {
            SendBytes::Borrowed { len, .. } => *len,
        }
    }
}

/// Scratch offsets of the any-source domain's staged writes (inside the
/// free scratch; every one travels inline, so the bytes are copied when
/// posted and the scratch is free again at once).
const SCRATCH_ANY_HEAD: u64 = 0;
const SCRATCH_ANY_STAMP: u64 = MAX_INLINE as u64;

/// The any-source domain's requests.
impl<'c> Engine<'c> {
    /// Posts the writes of one any-source entry to `peer`: `head` (staged
    /// in scratch, inline) at `head_at`, then `body` (the first `len`
    /// bytes of a registered region) at its address, then the 8-byte
    /// `stamp` at `stamp_at`, fenced after them. The completion of the
    /// group is recorded under the returned tag (see
    /// [`plain_done`](Self::plain_done)); the caller keeps `body`'s region
    /// until then.
    pub(crate) fn write_entry(
        &mut self,
        peer: u32,
        head: &[u8],
        head_at: RemoteAddress,
        body: Option<(&MemoryRegion<'_>, u32, RemoteAddress)>,
        stamp: u64,
        stamp_at: RemoteAddress,
    ) -> Result<u64> {
        assert!(head.len() <= MAX_INLINE as usize);
        let tag = self.tag();
        let scratch = self.layout.scratch();
        let Engine {
            qp,
            cq,
            completions,
            control,
            control_memory,
            ..
        } = &mut *self;
        let own = &*control;
        let head_local = stage(
            control_memory,
            own,
            scratch,
            SCRATCH_FREE + SCRATCH_ANY_HEAD,
            head,
        )?;
        let stamp_local = stage(
            control_memory,
            own,
            scratch,
            SCRATCH_FREE + SCRATCH_ANY_STAMP,
            &stamp.to_le_bytes(),
        )?;
        let mut entries: Vec<Entry<'_>> = Vec::with_capacity(3);
        entries.push(
            Write::new(head_local, head_at)
                .build()
                .inline()
                .user_data(tag | PART_BIT),
        );
        if let Some((region, len, at)) = body {
            entries.push(
                Write::new(region.local(0, len)?, at)
                    .build()
                    .user_data(tag | PART_BIT),
            );
        }
        entries.push(
            Write::new(stamp_local, stamp_at)
                .build()
                .inline()
                .fence()
                .user_data(tag)
                .signaled(),
        );
        post_entries(qp, cq, completions, &entries)?;
        self.in_flight.insert(tag, InFlight::Plain { peer });
        Ok(tag)
    }

    /// Posts reads of the first `len` bytes of `region` from `remote`
    /// (a window of `peer`) starting at its offset `offset`; the
    /// completion of the group is recorded under the returned tag. The
    /// caller keeps `region` until then.
    pub(crate) fn read_remote(
        &mut self,
        peer: u32,
        region: &MemoryRegion<'_>,
        len: u64,
        remote: RemoteWindow,
        offset: u64,
    ) -> Result<u64> {
        let tag = self.tag();
        let mut entries: Vec<Entry<'_>> = Vec::new();
        let mut at = 0;
        while at < len {
            let n = (len - at).min(MAX_WRITE);
            let last = at + n == len;
            let entry = Read::new(region.local(at, n as u32)?, remote.at(offset + at)).build();
            entries.push(match (last, at) {
                (true, 0) => entry.user_data(tag).signaled(),
                // Fenced after the other parts, which may finish out of
                // order on the fabric: its completion says all are done.
                (true, _) => entry.fence().user_data(tag).signaled(),
                (false, _) => entry.user_data(tag | PART_BIT),
            });
            at += n;
        }
        self.post(&entries)?;
        self.in_flight.insert(tag, InFlight::Plain { peer });
        Ok(tag)
    }

    /// Starts a liveness check of `peer` (a read of its control memory)
    /// unless one is in flight; a failure marks the peer gone.
    pub(crate) fn watch_peer(&mut self, peer: u32) -> Result<()> {
        self.probe(peer)
    }

    /// Whether `peer` is known to be gone.
    pub(crate) fn peer_gone(&self, peer: u32) -> bool {
        self.peers[peer as usize].gone.is_some()
    }
}

/// [`Engine::try_peer_at`] for rank `rank`'s engine of layout `layout`.
fn peer_address(layout: &Layout, rank: u32, peer: &Peer, offset: u64) -> Option<RemoteAddress> {
    let block = layout.block_start(rank);
    (block..block + layout.block_bytes())
        .contains(&offset)
        .then(|| peer.block.at(offset - block))
}

fn field<const N: usize>(record: &[u8], at: usize, rank: usize) -> Result<[u8; N]> {
    record
        .get(at..at + N)
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| Error::BadPeerRecord {
            rank: rank as u32,
            why: format!("{} bytes, {} expected at least", record.len(), at + N),
        })
}

/// How long a library's drop waits for the device to finish the
/// requests it posted ([`settle_posted`]).
pub(crate) const SETTLE_ON_DROP: Duration = Duration::from_secs(5);

/// Waits until `finished` says the device has finished every request
/// posted on a queue pair, taking completions with `take` meanwhile (the
/// device stops taking requests while the completion queue is full),
/// until `deadline` or until `take` fails. Requests dropped with their
/// queue pair never land, and across the fabric one may still wait for
/// its retransmission when its rank leaves: a barrier's last signal, a
/// credit return.
pub(crate) fn settle_posted<S>(
    state: &mut S,
    deadline: Instant,
    mut finished: impl FnMut(&mut S) -> bool,
    mut take: impl FnMut(&mut S) -> Result<()>,
) {
    while !finished(state) && Instant::now() < deadline {
        if take(state).is_err() {
            break;
        }
        std::thread::sleep(Duration::from_micros(50));
    }
}

/// Posts `entries` on `qp`; while the send queue is full, reaps
/// completions into `stash` (processed by the next reap) to make room.
pub(crate) fn post_entries(
    qp: &mut QueuePair<'_>,
    cq: &mut CompletionQueue<'_>,
    stash: &mut Vec<Completion>,
    entries: &[Entry<'_>],
) -> Result<()> {
    let started = Instant::now();
    loop {
        match qp.post(entries) {
            Ok(()) => return Ok(()),
            Err(VerbsError::QueueFull { .. }) if started.elapsed() < Duration::from_secs(60) => {
                // The device must run to make room: leave it the core.
                cq.poll_into(stash)?;
                std::thread::yield_now();
            }
            Err(err) => return Err(err.into()),
        }
    }
}

/// What ends a send on the receiver's side, in order after its body: the
/// index the sender named (for an any-index receive) and then, fenced, the
/// done word, which completes the group tagged `tag`.
pub(crate) struct SendTail {
    /// The done word at the receiver (the index word follows it).
    pub(crate) done: RemoteAddress,
    /// The index, for an any-index receive.
    pub(crate) any_tag_index: Option<u32>,
    /// The done word.
    pub(crate) word: u64,
    /// The group's tag.
    pub(crate) tag: u64,
}

impl SendTail {
    /// Stages the tail's words in scratch memory and appends their writes
    /// to `entries`.
    pub(crate) fn push<'r>(
        &self,
        memory: &DmaBuffer,
        region: &'r MemoryRegion<'_>,
        scratch: u64,
        entries: &mut Vec<Entry<'r>>,
    ) -> Result<()> {
        if let Some(index) = self.any_tag_index {
            let bytes = u64::from(index).to_le_bytes();
            let local = stage(memory, region, scratch, SCRATCH_INDEX, &bytes)?;
            entries.push(
                Write::new(
                    local,
                    RemoteAddress {
                        offset: self.done.offset + 8,
                        ..self.done
                    },
                )
                .build()
                .inline()
                .user_data(self.tag | PART_BIT),
            );
        }
        let local = stage(
            memory,
            region,
            scratch,
            SCRATCH_DONE,
            &self.word.to_le_bytes(),
        )?;
        entries.push(
            Write::new(local, self.done)
                .build()
                .inline()
                .fence()
                .user_data(self.tag)
                .signaled(),
        );
        Ok(())
    }
}

/// Stages `bytes` at `at` of the scratch memory (which starts at
/// `scratch` in `memory`, registered as `region`) and gives the local
/// range, ready to post inline.
pub(crate) fn stage<'r>(
    memory: &DmaBuffer,
    region: &'r MemoryRegion<'_>,
    scratch: u64,
    at: u64,
    bytes: &[u8],
) -> Result<Local<'r>> {
    let offset = scratch + at;
    assert!(at + bytes.len() as u64 <= layout::SCRATCH_BYTES);
    // SAFETY: scratch memory is this rank's own, inside the control memory
    // (the assertion keeps the range inside the scratch area), never a
    // peer's target; nothing else references it while staging.
    unsafe {
        std::ptr::copy_nonoverlapping(
            bytes.as_ptr(),
            memory.as_ptr().add(offset as usize),
            bytes.len(),
        )
    };
    Ok(region.local(offset, bytes.len() as u32)?)
}

/// Where flag-word writes of collectives are staged in scratch (after
/// what the any-source domain uses; inline writes copy it when posted).
const SCRATCH_COLLECTIVE: u64 = SCRATCH_FREE + 1024;

impl Engine<'_> {
    /// Posts writes of `writes` (offset in `peer`'s control memory,
    /// bytes staged inline; at most [`MAX_INLINE`] bytes each, 1024 in
    /// all) in order, the last one fenced after the others: the flag word
    /// of a collective after its data. The completion of the group is
    /// recorded under the returned tag ([`plain_done`](Self::plain_done)).
    pub(crate) fn write_words(&mut self, peer: u32, writes: &[(u64, &[u8])]) -> Result<u64> {
        let tag = self.tag();
        let scratch = self.layout.scratch();
        let Engine {
            qp,
            cq,
            completions,
            control: window,
            control_memory,
            layout,
            rank,
            peers,
            ..
        } = self;
        let target = &peers[peer as usize];
        let region = &*window;
        let mut entries: Vec<Entry<'_>> = Vec::with_capacity(writes.len());
        let mut staged = SCRATCH_COLLECTIVE;
        for (i, &(at, bytes)) in writes.iter().enumerate() {
            debug_assert!(bytes.len() <= MAX_INLINE as usize);
            let local = stage(control_memory, region, scratch, staged, bytes)?;
            staged += bytes.len().next_multiple_of(8) as u64;
            let remote = peer_address(layout, *rank, target, at)
                .expect("a rank writes collective words only in its own sections");
            let entry = Write::new(local, remote).build().inline();
            entries.push(if i + 1 == writes.len() {
                entry.fence().user_data(tag).signaled()
            } else {
                entry.user_data(tag | PART_BIT)
            });
        }
        post_entries(qp, cq, completions, &entries)?;
        self.in_flight.insert(tag, InFlight::Plain { peer });
        Ok(tag)
    }
}
