//! # GASNet-style active messages and one-sided transfers
//!
//! GASNet's core and extended API (as GASNet/TCA built them on PEACH2,
//! Kuga et al.) over the pindown driver's public verbs, independent of the
//! message-passing [`Messenger`](crate::Messenger).
//!
//! * **A segment per rank** ([`Endpoint::segment`]): [`Config::segment_bytes`]
//!   of registered memory, bound as one window that every peer knows. Long
//!   messages and puts land in it, gets read from it.
//! * **Active messages** with a [`Handlers`] table: short (arguments only),
//!   medium (a payload carried in the packet, handed to the handler in a
//!   library buffer), long (the payload written into the target's segment
//!   at an offset the sender names, then the packet; the handler gets the
//!   slice of its own segment). A request handler may answer once with a
//!   reply ([`Token::reply_short`], [`Token::reply_medium`],
//!   [`Token::reply_long`]).
//! * **Packets on per-pair rings in the target's memory.** Every target
//!   holds two rings per sender, one for requests and one for replies,
//!   each of [`Config::ring_slots`] fixed slots of
//!   [`Config::slot_bytes`]; a packet (variable length) takes one slot. The
//!   sender writes the packet's body into the slot, then, fenced after it,
//!   the 8-byte stamp (the packet's sequence number on the ring): the
//!   target reads a slot only once its stamp is the next sequence number,
//!   so it never sees half a packet. The sender stages each packet in a
//!   mirror of the target's ring in its own memory (the paper's send
//!   buffer holding the same bytes as the receive buffer), which it reuses
//!   only once the slot is free again.
//! * **Credits.** The target writes how many packets of a sender's ring
//!   it has consumed into the sender's memory: every `ring_slots / 2`
//!   packets, and at once when a packet says its sender has no slot left
//!   in that ring. A request without a free slot *stalls*
//!   ([`Counters::stalls`]): the sender keeps progressing (running the
//!   handlers of what arrives, returning credits, sending queued replies)
//!   until a slot frees. Two ranks flooding each other both keep
//!   consuming, so neither waits forever.
//! * **PIO and DMA.** Writes of at most [`Config::pio_max`] bytes travel
//!   inline in the work request ([`Entry::inline`](pindown_driver::verbs::opcode::Entry::inline); the paper's PIO, the
//!   CPU storing the bytes), longer ones as DMA from registered memory.
//! * **Alignment fix-up.** A put or long payload whose source and
//!   destination are not [`DMA_ALIGN`]-byte aligned sends its unaligned
//!   head and tail (fewer than 8 bytes each) through the staging buffer
//!   by PIO, the aligned body by DMA straight from the source (the paper's
//!   BtoM/MtoM modes: "transfer only the first few bytes in buffer mode to
//!   adjust the alignment"). Source and destination misaligned by
//!   different amounts: the source is copied into a bounce buffer laid
//!   out like the destination first ([`Counters::bounced`]).
//! * **Put and get**, blocking and nonblocking ([`Endpoint::put_nb`],
//!   [`Endpoint::wait`], [`Endpoint::wait_all`]). Get is an RDMA READ
//!   ([`GetMode::Native`]), or the paper's get over a write-only fabric
//!   ([`GetMode::ByMessage`]): a request message, the target's library
//!   handler writes the bytes into the requester's bounce area and replies.
//!   The bounce area is bound, for each get, for the rank it asks alone,
//!   and revoked before the get returns.
//! * **Strided, indexed and vector** put/get (GASNet's VIS) as one remote
//!   vector access each (VECTOR_WRITE / VECTOR_READ naming the pattern of
//!   both sides), no pack or unpack; strided ones also nonblocking from or
//!   into the segment ([`Endpoint::put_strided_nb`],
//!   [`Endpoint::get_strided_nb`]).
//! * **Barrier** ([`Endpoint::barrier`]): dissemination over library
//!   messages, after every put of this rank has completed. A rank that
//!   passed it may finalize while others still wait on their last round:
//!   only the departure of the rank a round waits on fails that round.
//! * **A descriptor cache** ([`Config::descriptor_cache`]) for repeated
//!   puts of the same source, target, destination and size: the plan
//!   ([`Endpoint::transfer_descriptor`]) and the source's registration,
//!   LRU, LFU or first come chosen at run time; after a number of uses a
//!   descriptor is promoted to prebuilt work requests posted as they are
//!   (the paper's promotion of hot descriptors into the chip's memory).
//!   [`Endpoint::descriptor_counters`] says how it did.
//!
//! ## Order
//!
//! Every packet's stamp is fenced behind every earlier request of the
//! endpoint's queue pair (the device starts a fenced request only once
//! those have finished, on one host and across the fabric). So a message
//! arrives after the bytes of every put or long payload this endpoint
//! started before it and that succeeds, blocking or not:
//! [`Endpoint::put_strided_nb`] and then [`Endpoint::request_short`] to
//! the same target is a notified put, whose handler finds the data in
//! place, in one trip instead of a put's round trip and then a message
//! (GASNet itself promises no order between a nonblocking put and a
//! later message; this library does). A put that fails (its target
//! gone, the device's operation timeout) also counts as finished: the
//! message may then go out without its bytes, and the sender learns of
//! the failure from the put's [`Endpoint::wait`]. The fence holds a
//! packet behind every earlier request of the endpoint, gets and
//! requests to other ranks included. Puts and gets among themselves may
//! complete in any order.
//!
//! ## Handlers, replies and the deadlock rule
//!
//! Handlers run inside [`Endpoint::poll`] (and every call that waits:
//! a stalled send, [`Endpoint::wait_until`], a blocking put or get), on the
//! caller's thread, one at a time, in arrival order per sender. As in
//! GASNet, a handler must not block and must not wait for the network: it
//! gets a [`Token`], not the endpoint, and can only reply. A request handler
//! replies at most once; a reply handler may not reply at all
//! ([`Token::reply_short`] fails). Replies are queued and sent when the
//! handler has returned, each as soon as its target's ring of replies has
//! a free slot, so a handler never waits for a credit and a target that
//! consumes slowly delays no other's replies. A reply never causes a
//! packet, so a rank consumes its rings of replies whatever it has
//! queued, and every rank that polls frees the replies queued to it.
//! While a ring's worth of replies to a sender waits (that sender
//! consumes none), its requests stay in their ring ([`Counters::requests_held`])
//! until it does: a rank that never polls holds at most two rings of
//! replies in its peers' memory, and its own requests stall.
//!
//! ## Untrusted packets
//!
//! A packet from a peer is checked before anything reads it: its kind,
//! flags, number of arguments, payload length (inside the slot), long
//! payload (inside the segment), handler index (registered). A bad one is
//! consumed, counted ([`Counters::bad_packets`]) and reported by the
//! [`Endpoint::poll`] that found it as [`Error::Gasnet`]; nothing of it
//! runs. What a rank publishes at [`Endpoint::new`] is checked too: its
//! rings and credit words must be windows of its own port, a port no
//! other rank names.
//!
//! ## Choosing PIO or DMA
//!
//! `am_check launch 2 pio` (the example program) times 2,000 blocking puts
//! of each size both ways, alternating, after a warm-up, on one host (2
//! cores shared with other builds, the device event-driven); median
//! microseconds per put:
//!
//! | bytes | 8 | 16 | 32 | 64 | 128 | 256 | 512 |
//! |---|---|---|---|---|---|---|---|
//! | PIO (inline) | 3.81 | 3.80 | 3.95 | 3.96 | 4.12 | 4.42 | 5.04 |
//! | DMA | 3.88 | 3.89 | 3.90 | 3.89 | 3.88 | 3.89 | 3.89 |
//!
//! PIO wins up to 16 bytes, ties at 32 and loses from 64 on (the inline
//! bytes are copied into the send queue, one 64-byte slot per 64 bytes,
//! where the emulated DMA costs the same at every size up to a page): the
//! default [`PIO_MAX_DEFAULT`] is 32, so packets of short messages with up
//! to four arguments and every fix-up head and tail go by PIO. On a real
//! NIC (the paper: PIO 0.9 us against DMA 2.0 us at the smallest size) the
//! crossover lies higher; measure again there.
//!
//! `am_check launch 2 latency` on the same machine: a short request and
//! its reply take 24.0 us (median of 3,000) against 11.3 us for a blocking
//! 8-byte put (a write and its completion): each message is two writes,
//! its body and then its fenced stamp, and is seen when the target polls.
//!
//! ## Example
//!
//! ```no_run
//! use std::cell::Cell;
//! use std::rc::Rc;
//! use pindown_driver::launch::{device_socket, Job};
//! use pindown_driver::verbs::Context;
//! use pindown_messaging::gasnet::{Config, Endpoint, Handlers};
//!
//! let mut job = Job::from_environment()?;
//! let context = Context::open(device_socket(&job)?, pindown_messaging::context_config())?;
//! let pongs = Rc::new(Cell::new(0u32));
//! let mut handlers = Handlers::new();
//! // 1: a ping (short request); its handler replies with handler 2.
//! handlers.register(1, |token, args, _payload| {
//!     token.reply_short(2, &[args[0] + 1]).expect("one reply");
//! });
//! let seen = pongs.clone();
//! handlers.register(2, move |_token, args, _payload| seen.set(args[0]));
//! // 3: a medium message: the payload in a library buffer.
//! handlers.register(3, |token, _args, payload| {
//!     println!("{} bytes from rank {}", payload.len(), token.source());
//! });
//! // 4: a long message: the payload is already in this rank's segment.
//! handlers.register(4, |_token, args, payload| assert_eq!(payload.len(), args[0] as usize));
//! let mut ep = Endpoint::new(&context, &mut job, Config::default(), handlers)?;
//! let peer = (ep.rank() + 1) % ep.size();
//! ep.request_short(peer, 1, &[41])?;
//! ep.request_medium(peer, 3, &[], b"into a library buffer")?;
//! ep.request_long(peer, 4, &[5], b"hello", 4096)?;      // lands at offset 4096
//! ep.wait_until(|_| pongs.get() == 42)?;
//!
//! // One-sided: put, get, nonblocking put, strided put (a 4 x 3 block of
//! // a 16-byte-row array into rows of 64 bytes), barrier.
//! ep.put(peer, 0, b"eight by")?;
//! let mut back = [0u8; 8];
//! ep.get(peer, 0, &mut back)?;
//! let handle = ep.put_nb(peer, 8, back.to_vec())?;
//! ep.wait(handle)?;
//! let source = [7u8; 48];
//! ep.put_strided(peer, 8192, &[64], &source, &[16], &[4, 3])?;
//! ep.put_vector(peer, &[(100, 3), (200, 5)], &source, &[(0, 8)])?;
//! ep.put_indexed(peer, &[300, 400], 4, &source, &[0], 8)?;
//! ep.barrier()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Gets of every form, replies carrying data, the get over a write-only
//! fabric, polling by hand and the counters:
//!
//! ```no_run
//! use pindown_driver::launch::{device_socket, Job};
//! use pindown_driver::verbs::Context;
//! use pindown_messaging::gasnet::{Config, Endpoint, GetMode, Handlers};
//!
//! let mut job = Job::from_environment()?;
//! let context = Context::open(device_socket(&job)?, pindown_messaging::context_config())?;
//! let mut handlers = Handlers::new();
//! // A request answered with a medium reply (bytes in the reply packet)...
//! handlers.register(1, |token, _args, payload| {
//!     token.reply_medium(3, &[], payload).expect("one reply");
//! });
//! // ...or with a long reply (bytes put into the requester's segment at 0).
//! handlers.register(2, |token, _args, payload| {
//!     token.reply_long(3, &[payload.len() as u32], payload, 0).expect("one reply");
//! });
//! handlers.register(3, |_token, _args, payload| println!("echo of {} bytes", payload.len()));
//! let config = Config { get: GetMode::ByMessage, ..Config::default() };
//! let mut ep = Endpoint::new(&context, &mut job, config, handlers)?;
//! let peer = (ep.rank() + 1) % ep.size();
//! ep.request_medium(peer, 1, &[], b"echo me")?;
//! ep.request_long(peer, 2, &[], b"echo me too", 128)?;
//! while ep.poll()? == 0 {}                                 // until a handler ran
//! let mut row = [0u8; 64];
//! ep.get(peer, 0, &mut row)?;                              // request, put back, reply
//! let mut column = [0u8; 16 * 8];                          // 16 doubles of a 16 x 16 matrix
//! ep.get_strided(peer, 0, &[128], &mut column, &[8], &[8, 16])?;
//! let mut gathered = [0u8; 24];
//! ep.get_vector(peer, &[(0, 8), (512, 16)], &mut gathered, &[(0, 24)])?;
//! ep.get_indexed(peer, &[0, 64, 128], 8, &mut gathered, &[0], 24)?;
//! let a = ep.put_nb(peer, 4096, row.to_vec())?;
//! let b = ep.put_nb(peer, 8192, std::sync::Arc::<[u8]>::from(&column[..]))?;
//! ep.wait(a)?;
//! ep.wait_all()?;                                          // b, and anything else
//! # let _ = b;
//! let counters = ep.counters();
//! println!("{} stalls, {} credits back, {} PIO / {} DMA writes",
//!          counters.stalls, counters.credits_returned, counters.pio_writes, counters.dma_writes);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod descriptor_cache;
use descriptor_cache::DescriptorCache;
pub use descriptor_cache::{CacheConfig, CacheCounters, Replacement};
mod packet;
mod transfer;

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use pindown_driver::arena::DmaBuffer;
use pindown_driver::launch::Job;
use pindown_driver::verbs::opcode::{Read, Write};
use pindown_driver::verbs::{
    Completion, CompletionQueue, Context, MemoryRegion, QueuePair, RegionWindow, RemoteWindow,
};
use pindown_uapi::queue::MAX_INLINE;
use pindown_uapi::{
    Access, CompletionError, ErrorDetail, PortAddress, RemoteAddress, RemoteKey, Status,
};

use crate::engine::post_entries;
use crate::error::{Error, Result};
use crate::liveness::DeviceWatch;
use packet::{Header, FLAG_CREDIT, FLAG_INTERNAL, FLAG_REPLY, HEADER_BYTES};

pub use packet::{Kind, MAX_ARGS, MIN_SLOT_BYTES};
pub use transfer::TransferDescriptor;

/// Alignment (bytes) the DMA path wants on both sides; unaligned heads and
/// tails go through the staging buffer (the alignment fix-up). Eight: the
/// word the device copies in, and what PEACH2's DMA asked for.
pub const DMA_ALIGN: u64 = 8;

/// The default [`Config::pio_max`], chosen by measurement (module docs).
pub const PIO_MAX_DEFAULT: u32 = 32;

/// How a get moves its bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GetMode {
    /// One RDMA READ from the target's segment.
    #[default]
    Native,
    /// The paper's get over a write-only fabric: a request message; the
    /// target's library handler writes the bytes into the requester's
    /// bounce area and replies; the requester copies them out.
    ByMessage,
}

/// How an endpoint is set up. Every rank of a job must use the same
/// `segment_bytes`, `ring_slots` and `slot_bytes` (compared whole at
/// [`Endpoint::new`], failing with [`Error::Mismatch`]);
/// `liveness_interval` lies between 1 us and an hour
/// ([`Error::InvalidConfig`] otherwise).
#[derive(Clone, Debug)]
pub struct Config {
    /// Bytes of this rank's segment.
    pub segment_bytes: usize,
    /// Slots of the ring each sender has at each target (at least 1).
    pub ring_slots: u32,
    /// Bytes of one slot (a multiple of 8, at least [`MIN_SLOT_BYTES`]):
    /// the packet header (24 bytes), up to [`MAX_ARGS`] arguments and a
    /// medium payload ([`Endpoint::max_medium`]).
    pub slot_bytes: u32,
    /// Writes of at most this many bytes go inline in the work request
    /// (PIO), longer ones by DMA; at most [`MAX_INLINE`].
    pub pio_max: u32,
    /// How [`Endpoint::get`] moves bytes.
    pub get: GetMode,
    /// The descriptor cache for repeated transfers; `None`: every transfer
    /// computes its descriptor.
    pub descriptor_cache: Option<CacheConfig>,
    /// Bytes of the area a [`GetMode::ByMessage`] get lands in (longer gets
    /// go in pieces of this size; at least 1); ranks may differ.
    pub get_bounce_bytes: usize,
    /// How long a wait goes without its condition before it fails.
    pub timeout: Duration,
    /// How often a wait longer than this checks that every peer is still
    /// there (an 8-byte read of its window); a peer whose device reports it
    /// gone or whose window refuses the check (it finalized) fails the
    /// wait with [`Error::PeerGone`]. A check unanswered for ten intervals
    /// does so only if this rank's device then answers nothing for ten
    /// more, not even a no-op asked on a queue pair of its own: a slow
    /// link is no death, and the device fails checks of peers it can no
    /// longer reach itself.
    pub liveness_interval: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            segment_bytes: 1 << 20,
            ring_slots: 64,
            slot_bytes: 1024,
            pio_max: PIO_MAX_DEFAULT,
            get: GetMode::Native,
            descriptor_cache: None,
            get_bounce_bytes: 256 << 10,
            timeout: Duration::from_secs(60),
            liveness_interval: Duration::from_millis(200),
        }
    }
}

/// A handler's index in the table (GASNet's handler index).
pub type HandlerIndex = u8;

type HandlerFn = Box<dyn FnMut(&mut Token<'_>, &[u32], &[u8])>;

/// The handler table: what runs when a message naming an index arrives.
#[derive(Default)]
pub struct Handlers {
    table: Vec<Option<HandlerFn>>,
}

impl Handlers {
    /// An empty table.
    pub fn new() -> Self {
        Handlers {
            table: (0..=u8::MAX).map(|_| None).collect(),
        }
    }

    /// Runs `handler` for messages naming `index`, with the message's
    /// token, arguments and payload (empty for short messages; a library
    /// buffer for medium ones; the slice of this rank's segment the
    /// payload was written to for long ones). Replaces an earlier one.
    pub fn register(
        &mut self,
        index: HandlerIndex,
        handler: impl FnMut(&mut Token<'_>, &[u32], &[u8]) + 'static,
    ) -> &mut Self {
        if self.table.is_empty() {
            *self = Handlers::new();
        }
        self.table[index as usize] = Some(Box::new(handler));
        self
    }
}

/// What a handler may do: learn the sender, and (a request handler, once)
/// reply to it.
pub struct Token<'a> {
    source: u32,
    is_reply: bool,
    replied: bool,
    segment_bytes: u64,
    max_medium: usize,
    replies: &'a mut VecDeque<Outgoing>,
}

impl Token<'_> {
    /// The rank that sent the message.
    pub fn source(&self) -> u32 {
        self.source
    }

    /// Whether the message being handled is a reply.
    pub fn is_reply(&self) -> bool {
        self.is_reply
    }

    fn may_reply(&mut self, args: &[u32]) -> Result<()> {
        if self.is_reply {
            return Err(Error::Gasnet(
                "a reply handler may not reply (GASNet's deadlock rule)".into(),
            ));
        }
        if self.replied {
            return Err(Error::Gasnet(
                "a request handler replies at most once".into(),
            ));
        }
        if args.len() > MAX_ARGS {
            return Err(Error::Gasnet(format!(
                "{} arguments, at most {MAX_ARGS}",
                args.len()
            )));
        }
        self.replied = true;
        Ok(())
    }

    /// Replies with a short message to handler `handler` of the sender.
    pub fn reply_short(&mut self, handler: HandlerIndex, args: &[u32]) -> Result<()> {
        self.may_reply(args)?;
        self.replies.push_back(Outgoing::message(
            self.source,
            Kind::Short,
            FLAG_REPLY,
            handler,
            args,
            Vec::new(),
            0,
        ));
        Ok(())
    }

    /// Replies with a medium message (the payload copied now).
    pub fn reply_medium(
        &mut self,
        handler: HandlerIndex,
        args: &[u32],
        payload: &[u8],
    ) -> Result<()> {
        if payload.len() > self.max_medium {
            return Err(Error::Gasnet(format!(
                "a medium payload of {} bytes, at most {}",
                payload.len(),
                self.max_medium
            )));
        }
        self.may_reply(args)?;
        self.replies.push_back(Outgoing::message(
            self.source,
            Kind::Medium,
            FLAG_REPLY,
            handler,
            args,
            payload.to_vec(),
            0,
        ));
        Ok(())
    }

    /// Replies with a long message: `payload` (copied now) goes into the
    /// sender's segment at `target_offset`, then the message.
    pub fn reply_long(
        &mut self,
        handler: HandlerIndex,
        args: &[u32],
        payload: &[u8],
        target_offset: u64,
    ) -> Result<()> {
        check_range(target_offset, payload.len() as u64, self.segment_bytes)?;
        self.may_reply(args)?;
        self.replies.push_back(Outgoing::message(
            self.source,
            Kind::Long,
            FLAG_REPLY,
            handler,
            args,
            payload.to_vec(),
            target_offset,
        ));
        Ok(())
    }
}

/// A message queued to go out (replies, and the library's own answers).
pub(crate) struct Outgoing {
    target: u32,
    kind: Kind,
    flags: u8,
    handler: u8,
    args: Vec<u32>,
    payload: Vec<u8>,
    long_offset: u64,
    /// Bytes of this rank's segment written to the target before the
    /// message: (segment offset, length, where they go: a window the
    /// target bound for this rank).
    pre_write: Option<(u64, u64, RemoteAddress)>,
}

impl Outgoing {
    fn message(
        target: u32,
        kind: Kind,
        flags: u8,
        handler: u8,
        args: &[u32],
        payload: Vec<u8>,
        long_offset: u64,
    ) -> Self {
        Outgoing {
            target,
            kind,
            flags,
            handler,
            args: args.to_vec(),
            payload,
            long_offset,
            pre_write: None,
        }
    }
}

/// A nonblocking operation to complete with [`Endpoint::wait`] of the
/// endpoint that started it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[must_use = "a nonblocking put completes only through wait or wait_all"]
pub struct Handle {
    /// The endpoint's identity ([`Endpoint::id`]).
    endpoint: u64,
    tag: u64,
}

/// Identities of endpoints, unique in the process.
static NEXT_ENDPOINT: AtomicU64 = AtomicU64::new(1);

/// What an endpoint has done so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Requests sent (short, medium, long).
    pub requests: u64,
    /// Replies sent.
    pub replies: u64,
    /// Handlers run (user handlers, requests and replies).
    pub handlers_run: u64,
    /// Times a send found no free slot at its target and had to wait.
    pub stalls: u64,
    /// Writes of a consumed count back to a sender.
    pub credit_returns: u64,
    /// Slots those writes freed, in all.
    pub credits_returned: u64,
    /// Writes sent inline (PIO).
    pub pio_writes: u64,
    /// Writes sent by DMA.
    pub dma_writes: u64,
    /// Bytes of unaligned heads and tails sent through the staging buffer.
    pub fixup_bytes: u64,
    /// Body writes a promoted descriptor posted as built
    /// ([`Config::descriptor_cache`]).
    pub prebuilt_writes: u64,
    /// Transfers copied into a bounce buffer first (source and destination
    /// misaligned differently, or a by-message get).
    pub bounced: u64,
    /// Vector transfers (strided, indexed, vector put/get).
    pub vector_transfers: u64,
    /// Gets by RDMA READ.
    pub gets_native: u64,
    /// Gets by message (request, put back, reply).
    pub gets_by_message: u64,
    /// Packets from peers refused as malformed (none of them ran).
    pub bad_packets: u64,
    /// Replies to by-message gets whose bytes the requester's window
    /// refused (it had given the get up, or named no window of its own).
    pub get_data_refused: u64,
    /// Times a sender's requests started being left in their ring
    /// because this rank's replies to it, a ring's worth, waited for
    /// slots there (it consumed none of them).
    pub requests_held: u64,
}

/// Offsets of one rank's memory: the part every peer reaches through one
/// window (segment, get bounce area), the rings and credit words (each
/// ring writable by its sender alone, each credit word by its target
/// alone, through windows bound to that peer), and the private part (the
/// staging mirror of this rank's packets, scratch).
#[derive(Clone, Copy, Debug)]
struct Layout {
    ring_slots: u64,
    slot_bytes: u64,
    segment: u64,
    rings_at: u64,
    credits_at: u64,
    bounce_at: u64,
    bounce_bytes: u64,
    staging_at: u64,
    scratch_at: u64,
    total: u64,
}

/// Scratch offsets: PIO staging (head, tail, small writes), credit
/// words, small reads.
const SCRATCH_HEAD: u64 = 0;
const SCRATCH_TAIL: u64 = 64;
const SCRATCH_CREDIT: u64 = 128;
const SCRATCH_SMALL: u64 = 512;
const SCRATCH_READ_HEAD: u64 = 1024;
const SCRATCH_READ_TAIL: u64 = 1088;
const SCRATCH_READ_SMALL: u64 = 1536;
const SCRATCH_PROBE: u64 = 192;
const SCRATCH_BYTES: u64 = 2048 + MAX_INLINE as u64;

impl Layout {
    /// The layout for `ranks` ranks, or an error naming the sizes when
    /// the memory it needs does not fit 64 bits.
    fn new(ranks: u32, config: &Config) -> Result<Self> {
        let too_large = || {
            Error::Gasnet(format!(
                "the endpoint's memory for {ranks} ranks does not fit 64 bits (segment_bytes {}, \
                 get_bounce_bytes {}, ring_slots {}, slot_bytes {})",
                config.segment_bytes, config.get_bounce_bytes, config.ring_slots, config.slot_bytes
            ))
        };
        let add = |a: u64, b: u64| a.checked_add(b).ok_or_else(too_large);
        let mul = |a: u64, b: u64| a.checked_mul(b).ok_or_else(too_large);
        let round_up = |a: u64, to: u64| a.checked_next_multiple_of(to).ok_or_else(too_large);
        let ranks = u64::from(ranks);
        let ring_slots = u64::from(config.ring_slots);
        let slot_bytes = u64::from(config.slot_bytes);
        let segment = config.segment_bytes as u64;
        // At least 64 bytes before the bounce area: the segment window
        // (which liveness checks read) is never empty.
        let bounce_at = round_up(segment.max(1), 64)?;
        let bounce_bytes = config.get_bounce_bytes as u64;
        let rings_at = round_up(add(bounce_at, bounce_bytes)?, 64)?;
        let ring_bytes = mul(mul(mul(ranks, LANES)?, ring_slots)?, slot_bytes)?;
        let credits_at = add(rings_at, ring_bytes)?;
        let exposed = add(credits_at, mul(8 * LANES, ranks)?)?;
        let staging_at = round_up(exposed, 4096)?;
        let scratch_at = add(staging_at, ring_bytes)?;
        Ok(Layout {
            ring_slots,
            slot_bytes,
            segment,
            rings_at,
            credits_at,
            bounce_at,
            bounce_bytes,
            staging_at,
            scratch_at,
            total: round_up(add(scratch_at, SCRATCH_BYTES)?, 4096)?,
        })
    }

    /// Offset of slot `slot` of `sender`'s ring of `lane` (in the
    /// target's memory); a sender's two rings are adjacent, requests
    /// first.
    fn ring_slot(&self, sender: u32, lane: Lane, slot: u64) -> u64 {
        self.rings_at + self.lane_slot(sender, lane, slot)
    }

    /// Where slot `slot` of `peer`'s ring of `lane` lies among the rings
    /// of every peer (the same numbering serves the target's rings and
    /// the sender's mirrors).
    fn lane_slot(&self, peer: u32, lane: Lane, slot: u64) -> u64 {
        ((u64::from(peer) * LANES + lane as u64) * self.ring_slots + slot) * self.slot_bytes
    }

    /// Bytes of one ring.
    fn lane_bytes(&self) -> u64 {
        self.ring_slots * self.slot_bytes
    }

    /// Bytes of one sender's two rings.
    fn ring_bytes(&self) -> u64 {
        LANES * self.lane_bytes()
    }

    /// Offset of this rank's credit word for its ring of `lane` at
    /// `target` (written by `target`); the two words of a target are
    /// adjacent, requests first.
    fn credit_word(&self, target: u32, lane: Lane) -> u64 {
        self.credits_at + 8 * (LANES * u64::from(target) + lane as u64)
    }

    /// Offset of the mirror of slot `slot` of this rank's ring of `lane`
    /// at `target`.
    fn staging_slot(&self, target: u32, lane: Lane, slot: u64) -> u64 {
        self.staging_at + self.lane_slot(target, lane, slot)
    }
}

/// The two rings a sender has at each target. Replies never cause a
/// packet (a reply handler may not reply), so a target consumes its reply
/// rings whatever it has queued; it leaves a sender's requests in their
/// ring while its own replies to that sender wait for slots, so that a
/// sender that consumes nothing holds at most a ring of replies here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Lane {
    Request = 0,
    Reply = 1,
}

/// Rings per (sender, target): [`Lane`]s.
const LANES: u64 = 2;

impl Lane {
    /// The lane a packet with `flags` travels in.
    fn of(flags: u8) -> Lane {
        match flags & FLAG_REPLY {
            0 => Lane::Request,
            _ => Lane::Reply,
        }
    }
}

/// What reaches a peer: its shared window (segment, bounce area), its
/// rings for this rank, and its credit words for this rank.
#[derive(Clone, Copy, Debug)]
struct PeerWindows {
    shared: RemoteWindow,
    ring: RemoteWindow,
    credit: RemoteWindow,
}

impl PeerWindows {
    /// The address `offset` bytes into the shared window.
    fn at(&self, offset: u64) -> RemoteAddress {
        self.shared.at(offset)
    }
}

/// The key the pair windows are published under.
const PAIRS_KEY: &str = "pindown-gasnet-pairs";

/// Bytes of one window in a record: node, port, key, length.
const WINDOW_RECORD_BYTES: usize = 20;

/// Publishes `windows` under `key` and gives every rank's, each rank's
/// list checked by `check`.
fn exchange_windows(
    job: &mut Job,
    key: &str,
    windows: &[RemoteWindow],
    check: impl Fn(u32, &[RemoteWindow]) -> Result<()>,
) -> Result<Vec<Vec<RemoteWindow>>> {
    let mut record = Vec::with_capacity(windows.len() * WINDOW_RECORD_BYTES);
    for window in windows {
        record.extend_from_slice(&window.node.to_le_bytes());
        record.extend_from_slice(&window.port.to_le_bytes());
        record.extend_from_slice(&window.key.0.to_le_bytes());
        record.extend_from_slice(&window.len.to_le_bytes());
    }
    let records = job.all_gather(key, &record)?;
    records
        .iter()
        .enumerate()
        .map(|(rank, record)| {
            let bad = |why: String| Error::BadPeerRecord {
                rank: rank as u32,
                why,
            };
            if record.is_empty() || record.len() % WINDOW_RECORD_BYTES != 0 {
                return Err(bad(format!(
                    "{} bytes, a multiple of {WINDOW_RECORD_BYTES} expected",
                    record.len()
                )));
            }
            let windows = record
                .chunks_exact(WINDOW_RECORD_BYTES)
                .map(|w| {
                    let text = format!(
                        "{}:{}:{:016x}:{}",
                        u16::from_le_bytes(w[0..2].try_into().expect("2 bytes")),
                        u16::from_le_bytes(w[2..4].try_into().expect("2 bytes")),
                        u64::from_le_bytes(w[4..12].try_into().expect("8 bytes")),
                        u64::from_le_bytes(w[12..20].try_into().expect("8 bytes")),
                    );
                    text.parse::<RemoteWindow>()
                        .map_err(|e| bad(format!("{e}")))
                })
                .collect::<Result<Vec<_>>>()?;
            check(rank as u32, &windows)?;
            Ok(windows)
        })
        .collect()
}
/// The key it is published under.
const RECORD_KEY: &str = "pindown-gasnet";
/// Launcher key of the configuration every rank must share.
const SHAPE_KEY: &str = "pindown-gasnet-shape";
/// Marks a completion of a packet's writes (the rest is the target).
const PACKET_BIT: u64 = 1 << 63;
/// Marks the completion of a liveness check (the rest is the peer).
const PROBE_BIT: u64 = 1 << 62;
/// Tag bit of a credit return (the peer in the low bits).
const CREDIT_BIT: u64 = 1 << 61;
/// Tag bit of the bytes of a by-message get's reply (the peer in the low
/// bits): refused when the requester gave the get up and revoked its
/// window, which is no failure of this rank's.
const GET_DATA_BIT: u64 = 1 << 60;
/// User data of the no-op that asks the device whether it is alive (see
/// `crate::liveness`).
const DEVICE_CHECK: u64 = 1 << 59;
/// Reports of bad packets kept until polls take them.
const BAD_PACKETS_KEPT: usize = 64;
/// By-message gets given up whose late replies are still expected.
const GETS_GIVEN_UP_KEPT: usize = 16;
/// Longest single write or read posted.
const MAX_REQUEST: u64 = 1 << 30;

/// Library handlers (messages with [`FLAG_INTERNAL`]).
const INTERNAL_GET_REQUEST: u8 = 0;
const INTERNAL_GET_REPLY: u8 = 1;
const INTERNAL_BARRIER: u8 = 2;

/// A posted operation: its writes or reads still running, what it holds.
struct Op<'c> {
    remaining: u32,
    failure: Option<CompletionError>,
    peer: u32,
    /// Copies to do once the operation completes (get fix-ups): (scratch
    /// or bounce offset, destination pointer, length).
    copies: Vec<(u64, *mut u8, usize)>,
    _regions: Vec<MemoryRegion<'c>>,
    /// A bounce buffer's region, which owns the buffer.
    _bounce: Option<MemoryRegion<'c>>,
    /// The registration of a cached put's source, shared with the cache.
    _cached: Option<std::rc::Rc<MemoryRegion<'c>>>,
    /// A nonblocking put's source, declared after its regions.
    _source: Option<Box<dyn std::any::Any>>,
}

/// Why a queued message did not go, and whether its packet went anyway
/// (then it must not be sent again: its handler would run twice).
struct SendFailure {
    error: Error,
    packet_sent: bool,
}

/// One rank's GASNet endpoint: its segment, rings, queue pairs and
/// handlers. See the [module documentation](self).
pub struct Endpoint<'c> {
    // Field order is drop order: operations (their regions) and the queue
    // pairs before the completion queue, the window before its memory.
    ops: HashMap<u64, Op<'c>>,
    qp: QueuePair<'c>,
    /// Whether the device still answers, asked on a queue pair of its
    /// own: whether a check left unanswered means a peer gone or only a
    /// slow link.
    device: DeviceWatch<'c>,
    cq: CompletionQueue<'c>,
    window: RegionWindow<'c>,
    /// The windows over each sender's ring and each target's credit word,
    /// bound to that peer.
    _pair_windows: Vec<RegionWindow<'c>>,
    memory: DmaBuffer,
    context: &'c Context,
    config: Config,
    layout: Layout,
    rank: u32,
    size: u32,
    peers: Vec<PeerWindows>,
    /// Packets sent to each target, by [`Lane`] (the last sequence
    /// number).
    sent: Vec<[u64; 2]>,
    /// Packets consumed from each sender, by lane.
    consumed: Vec<[u64; 2]>,
    /// The consumed counts last written back to each sender, by lane.
    returned: Vec<[u64; 2]>,
    /// Senders' rings owed a credit write at once (a packet asked).
    credit_due: Vec<[bool; 2]>,
    handlers: Handlers,
    /// Replies (and the library's answers) waiting for a slot, by target.
    outgoing: Vec<VecDeque<Outgoing>>,
    /// Senders whose requests are left in their ring now
    /// ([`Counters::requests_held`]).
    holding: Vec<bool>,
    /// A copy of the slot being handled, and the medium library buffer.
    slot_copy: Vec<u8>,
    args: Vec<u32>,
    stash: Vec<Completion>,
    /// Failures of packet writes, credit returns and liveness checks, to
    /// report in the order they were found.
    failures: VecDeque<Error>,
    next_tag: u64,
    /// Unique in the process: the handles this endpoint gives out carry it.
    id: u64,
    /// By-message gets: replies arrived (request id, status).
    get_replies: HashMap<u32, u32>,
    next_get: u32,
    /// The by-message get in progress: (request id, target).
    get_pending: Option<(u32, u32)>,
    /// By-message gets given up whose reply has not come (request id,
    /// target), the last [`GETS_GIVEN_UP_KEPT`]: a late reply is expected,
    /// not a bad packet.
    gets_given_up: VecDeque<(u32, u32)>,
    /// Barrier notices arrived, by (epoch, round).
    barrier_arrivals: HashSet<(u32, u32)>,
    barrier_epoch: u32,
    counters: Counters,
    /// When the liveness check in flight to each peer was posted.
    probes: Vec<Option<Instant>>,
    /// Peers known to be gone, and how that showed.
    gone: Vec<Option<String>>,
    /// Bad packets found while progressing, reported one per poll (at
    /// most [`BAD_PACKETS_KEPT`] kept; the counter counts them all).
    bad_packets: VecDeque<Error>,
    /// Set while the rings are being consumed (reset even if a handler
    /// panics).
    polling: std::rc::Rc<std::cell::Cell<bool>>,
    /// Set while queued replies are being sent (a long reply waits for
    /// its put, and that wait must not start sending the next replies).
    flushing: std::cell::Cell<bool>,
    /// Repeated puts' descriptors ([`Config::descriptor_cache`]).
    descriptors: Option<transfer::PutCache<'c>>,
}

impl<'c> Endpoint<'c> {
    /// Sets up this rank: segment, rings, credit words and their window,
    /// two queue pairs of the context (one for transfers and messages, one
    /// that asks the device whether it still answers: see
    /// [`Config::liveness_interval`]), and every rank's window through the
    /// launcher (a
    /// collective call: every rank of `job` makes it). Open `context` with
    /// [`crate::context_config`], so that user buffers freed and allocated
    /// again at the same address are registered anew.
    pub fn new(
        context: &'c Context,
        job: &mut Job,
        config: Config,
        handlers: Handlers,
    ) -> Result<Self> {
        if config.ring_slots == 0 {
            return Err(Error::Gasnet(
                "Config::ring_slots must be at least 1".into(),
            ));
        }
        if (config.slot_bytes as usize) < MIN_SLOT_BYTES || !config.slot_bytes.is_multiple_of(8) {
            return Err(Error::Gasnet(format!(
                "Config::slot_bytes {} must be a multiple of 8 and at least {MIN_SLOT_BYTES} (a \
                 header and {MAX_ARGS} arguments)",
                config.slot_bytes
            )));
        }
        if config.get_bounce_bytes == 0 {
            return Err(Error::Gasnet(
                "Config::get_bounce_bytes must be at least 1".into(),
            ));
        }
        crate::liveness::check_liveness_interval(config.liveness_interval)?;
        let config = Config {
            pio_max: config.pio_max.min(MAX_INLINE),
            ..config
        };
        // Both queue pairs first: a rank that cannot have them fails
        // before the others go on with the exchanges.
        let mut cq = context.create_completion_queue();
        let qp = context.create_queue_pair(&mut cq)?;
        let device = DeviceWatch::new(context, &mut cq, DEVICE_CHECK)?;
        crate::records::same_shape(
            job,
            SHAPE_KEY,
            &format!(
                "Config::segment_bytes {}, Config::ring_slots {}, Config::slot_bytes {}",
                config.segment_bytes, config.ring_slots, config.slot_bytes
            ),
        )?;
        let size = job.size();
        let layout = Layout::new(size, &config)?;
        let bytes = usize::try_from(layout.total)
            .map_err(|_| Error::Gasnet("the endpoint's memory does not fit".into()))?;
        let memory = context.alloc(bytes, 4096)?;
        // SAFETY: the buffer was just allocated for this endpoint and is
        // `bytes` long; zeroing it before any peer knows it exists.
        unsafe { std::ptr::write_bytes(memory.as_ptr(), 0, bytes) };
        // SAFETY: `memory` becomes the endpoint's `memory` field, which
        // outlives every window over it (see `register_memory`).
        let region = unsafe { register_memory(context, &memory)? };
        // The segment, open to every rank; the bounce area of gets by
        // message is not in it (each get binds it for its target).
        let window = context.bind_region_window(
            region,
            0,
            layout.bounce_at,
            Access::REMOTE_WRITE | Access::REMOTE_READ,
            None,
        )?;
        let shared = exchange_windows(job, RECORD_KEY, &[window.remote()], |rank, peer| {
            (peer[0].len == layout.bounce_at)
                .then_some(())
                .ok_or_else(|| {
                    Error::Mismatch(format!(
                        "rank {rank}'s segment window is {} bytes, this rank's {}: every rank \
                         must use the same segment_bytes",
                        peer[0].len, layout.bounce_at
                    ))
                })
        })?;
        crate::records::distinct_ports(shared.iter().map(|peer| (peer[0].node, peer[0].port)))?;
        // Each sender's ring, writable by that sender alone; each credit
        // word, by its target alone: a peer cannot fill another's ring or
        // forge another's credits.
        let mut pair_windows = Vec::with_capacity(2 * size as usize);
        let mut pair_remotes = Vec::with_capacity(2 * size as usize);
        for (rank, peer) in shared.iter().enumerate() {
            let owner = Some(PortAddress {
                node: peer[0].node,
                port: peer[0].port,
            });
            for (at, len) in [
                (
                    layout.ring_slot(rank as u32, Lane::Request, 0),
                    layout.ring_bytes(),
                ),
                (layout.credit_word(rank as u32, Lane::Request), 8 * LANES),
            ] {
                // SAFETY: as for the segment's region above.
                let region = unsafe { register_memory(context, &memory)? };
                let pair =
                    context.bind_region_window(region, at, len, Access::REMOTE_WRITE, owner)?;
                pair_remotes.push(pair.remote());
                pair_windows.push(pair);
            }
        }
        // A rank's pair windows are its own port's (it cannot hand out
        // another rank's credit words or rings as its own) and as long as
        // this rank's.
        let pairs = exchange_windows(job, PAIRS_KEY, &pair_remotes, |rank, windows| {
            let bad = |why: String| Error::BadPeerRecord { rank, why };
            if windows.len() != 2 * size as usize {
                return Err(bad(format!(
                    "{} pair windows, {} expected",
                    windows.len(),
                    2 * size
                )));
            }
            let own = shared[rank as usize][0];
            if let Some(w) = windows
                .iter()
                .find(|w| (w.node, w.port) != (own.node, own.port))
            {
                return Err(bad(format!(
                    "a pair window on port {}:{}, not its own {}:{}",
                    w.node, w.port, own.node, own.port
                )));
            }
            let lengths = [layout.ring_bytes(), 8 * LANES];
            match windows
                .iter()
                .enumerate()
                .find(|(i, w)| w.len != lengths[i % 2])
            {
                Some((_, w)) => Err(Error::Mismatch(format!(
                    "rank {rank}'s rings or credit words are {} bytes, this rank's {:?}: every \
                     rank must use the same ring_slots and slot_bytes",
                    w.len, lengths
                ))),
                None => Ok(()),
            }
        })?;
        let me = job.rank() as usize;
        let peers = shared
            .iter()
            .zip(&pairs)
            .map(|(shared, pairs)| PeerWindows {
                shared: shared[0],
                ring: pairs[2 * me],
                credit: pairs[2 * me + 1],
            })
            .collect();
        let n = size as usize;
        Ok(Endpoint {
            ops: HashMap::new(),
            qp,
            cq,
            window,
            _pair_windows: pair_windows,
            memory,
            context,
            layout,
            rank: job.rank(),
            size,
            peers,
            sent: vec![[0; 2]; n],
            consumed: vec![[0; 2]; n],
            returned: vec![[0; 2]; n],
            credit_due: vec![[false; 2]; n],
            handlers,
            outgoing: (0..n).map(|_| VecDeque::new()).collect(),
            holding: vec![false; n],
            slot_copy: vec![0; config.slot_bytes as usize],
            args: Vec::with_capacity(MAX_ARGS),
            stash: Vec::new(),
            failures: VecDeque::new(),
            next_tag: 0,
            id: NEXT_ENDPOINT.fetch_add(1, Ordering::Relaxed),
            get_replies: HashMap::new(),
            next_get: 0,
            get_pending: None,
            gets_given_up: VecDeque::new(),
            barrier_arrivals: HashSet::new(),
            barrier_epoch: 0,
            counters: Counters::default(),
            probes: vec![None; n],
            device,
            gone: vec![None; n],
            bad_packets: VecDeque::new(),
            polling: Default::default(),
            flushing: Default::default(),
            descriptors: config.descriptor_cache.map(DescriptorCache::new),
            config,
        })
    }

    /// This rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Ranks in the job.
    pub fn size(&self) -> u32 {
        self.size
    }

    /// The configuration in force (`pio_max` clamped to [`MAX_INLINE`]).
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Changes [`Config::pio_max`] (clamped to [`MAX_INLINE`]): for
    /// measuring the PIO/DMA threshold.
    #[doc(hidden)]
    pub fn set_pio_max(&mut self, pio_max: u32) {
        self.config.pio_max = pio_max.min(MAX_INLINE);
    }

    /// Changes [`Config::timeout`]: for tests of what a timed-out wait
    /// leaves behind.
    #[doc(hidden)]
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.config.timeout = timeout;
    }

    /// What the endpoint has done so far.
    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// The largest medium payload (GASNet's `MaxMedium`): a slot less the
    /// header and [`MAX_ARGS`] arguments.
    pub fn max_medium(&self) -> usize {
        self.config.slot_bytes as usize - HEADER_BYTES - 4 * MAX_ARGS
    }

    /// This rank's segment. Peers write into it (puts, long messages) and
    /// read from it (gets) whenever they like: what another rank writes
    /// shows up here, synchronised as the program arranges (a message, a
    /// barrier).
    pub fn segment(&mut self) -> &mut [u8] {
        // SAFETY: the segment is the first `segment_bytes` of memory this
        // endpoint owns and keeps mapped while it lives; the `&mut self`
        // borrow keeps the library from handing out another slice of it.
        // The device writes into it on behalf of peers, like any
        // RDMA-exposed buffer; the bytes are plain data (any value valid).
        unsafe {
            std::slice::from_raw_parts_mut(self.memory.as_ptr(), self.layout.segment as usize)
        }
    }

    fn word(&self, offset: u64) -> &AtomicU64 {
        debug_assert!(offset.is_multiple_of(8) && offset + 8 <= self.layout.total);
        // SAFETY: `offset` is 8-aligned inside the endpoint's memory (the
        // layout's words are; the buffer is 4096-aligned), which lives as
        // long as `self`; the device writes these words with whole 8-byte
        // stores, so an atomic view is the right one.
        unsafe { &*(self.memory.as_ptr().add(offset as usize) as *const AtomicU64) }
    }

    fn tag(&mut self) -> u64 {
        self.next_tag += 1;
        self.next_tag
    }

    /// The handle of the operation tagged `tag`.
    pub(super) fn handle(&self, tag: u64) -> Handle {
        Handle {
            endpoint: self.id,
            tag,
        }
    }

    fn check_target(&self, target: u32) -> Result<()> {
        if target >= self.size {
            return Err(Error::NoSuchRank {
                rank: target,
                size: self.size,
            });
        }
        if let Some(why) = &self.gone[target as usize] {
            return Err(Error::PeerGone {
                peer: target,
                why: why.clone(),
            });
        }
        Ok(())
    }

    /// Records a failed request to `peer` for the next call to report,
    /// and remembers a peer the device says is gone.
    fn fail_peer(&mut self, peer: u32, err: CompletionError) {
        let error = self.failure(peer, err);
        self.failures.push_back(error);
    }

    /// Records a failed liveness check of `peer`: whatever the device
    /// answered, the peer is gone. The check reads the peer's segment,
    /// which the peer exposes for its whole life, so a refusal (its
    /// window revoked: it finalized, or left while its device went on)
    /// means it left as surely as a port that went down does.
    fn fail_probe(&mut self, peer: u32, err: CompletionError) {
        let why = format!("its segment no longer answers a liveness check: {err}");
        if let Some(gone) = self.gone.get_mut(peer as usize) {
            gone.get_or_insert_with(|| why.clone());
        }
        self.failures.push_back(Error::PeerGone { peer, why });
    }

    /// Records a refused credit return to `peer`: its credit word lies in
    /// memory it exposes for its whole life (as the liveness check's word
    /// does), so the peer is gone, usually because it finalized after
    /// the last barrier while this rank was still consuming its packets.
    fn fail_credit_return(&mut self, peer: u32, err: CompletionError) {
        let why = format!("its credit word no longer takes a credit return: {err}");
        if let Some(gone) = self.gone.get_mut(peer as usize) {
            gone.get_or_insert_with(|| why.clone());
        }
        self.failures.push_back(Error::PeerGone { peer, why });
    }

    /// The error a failed request to `peer` means; a peer the device says
    /// is gone is remembered (later calls naming it fail at once).
    fn failure(&mut self, peer: u32, err: CompletionError) -> Error {
        let error = peer_failure(peer, err);
        if let Error::PeerGone { why, .. } = &error {
            if let Some(gone) = self.gone.get_mut(peer as usize) {
                gone.get_or_insert_with(|| why.clone());
            }
        }
        error
    }

    /// Sends a short request to handler `handler` of `target`.
    pub fn request_short(
        &mut self,
        target: u32,
        handler: HandlerIndex,
        args: &[u32],
    ) -> Result<()> {
        self.check_target(target)?;
        self.check_args(args)?;
        self.flush_outgoing()?;
        self.send_packet(target, Kind::Short, 0, handler, args, &[], 0)?;
        self.counters.requests += 1;
        Ok(())
    }

    /// Sends a medium request: `payload` (at most [`max_medium`] bytes)
    /// travels in the packet and reaches the handler in a library buffer.
    /// `payload` may be reused on return.
    ///
    /// [`max_medium`]: Self::max_medium
    pub fn request_medium(
        &mut self,
        target: u32,
        handler: HandlerIndex,
        args: &[u32],
        payload: &[u8],
    ) -> Result<()> {
        self.check_target(target)?;
        self.check_args(args)?;
        if payload.len() > self.max_medium() {
            return Err(Error::Gasnet(format!(
                "a medium payload of {} bytes, at most {}",
                payload.len(),
                self.max_medium()
            )));
        }
        self.flush_outgoing()?;
        self.send_packet(target, Kind::Medium, 0, handler, args, payload, 0)?;
        self.counters.requests += 1;
        Ok(())
    }

    /// Sends a long request: `payload` is written into `target`'s segment
    /// at `target_offset`, then the packet; the handler gets that slice of
    /// its segment. `payload` may be reused on return.
    pub fn request_long(
        &mut self,
        target: u32,
        handler: HandlerIndex,
        args: &[u32],
        payload: &[u8],
        target_offset: u64,
    ) -> Result<()> {
        self.check_target(target)?;
        self.check_args(args)?;
        check_range(target_offset, payload.len() as u64, self.layout.segment)?;
        self.flush_outgoing()?;
        let op = self.start_put(target, target_offset, payload)?;
        // The packet's stamp is fenced after the payload's writes.
        let sent = self.send_packet(target, Kind::Long, 0, handler, args, payload, target_offset);
        let waited = self.wait(op);
        sent?;
        waited?;
        self.counters.requests += 1;
        Ok(())
    }

    fn check_args(&self, args: &[u32]) -> Result<()> {
        if args.len() > MAX_ARGS {
            return Err(Error::Gasnet(format!(
                "{} arguments, at most {MAX_ARGS}",
                args.len()
            )));
        }
        Ok(())
    }

    /// Free slots in this rank's ring of `lane` at `target`, from the
    /// consumed count `target` wrote back (never believed beyond what was
    /// sent).
    fn free_slots(&self, target: u32, lane: Lane) -> u64 {
        let sent = self.sent[target as usize][lane as usize];
        let consumed = self
            .word(self.layout.credit_word(target, lane))
            .load(Ordering::Acquire)
            .min(sent);
        self.layout.ring_slots - (sent - consumed).min(self.layout.ring_slots)
    }

    /// Writes one packet into this rank's ring at `target` of its lane
    /// (replies apart from the rest): the body, then the fenced stamp.
    /// Waits (progressing) for a free slot.
    /// `payload`: a medium message's bytes (carried in the packet) or a
    /// long message's (already put: only its length travels).
    #[allow(clippy::too_many_arguments)]
    fn send_packet(
        &mut self,
        target: u32,
        kind: Kind,
        flags: u8,
        handler: u8,
        args: &[u32],
        payload: &[u8],
        long_offset: u64,
    ) -> Result<()> {
        let lane = Lane::of(flags);
        let mut free = self.free_slots(target, lane);
        if free == 0 {
            self.counters.stalls += 1;
            let start = Instant::now();
            let mut next_check = start + self.config.liveness_interval;
            let mut spins = 0u32;
            while free == 0 {
                self.progress_incoming()?;
                self.send_queued_replies();
                self.reap()?;
                if let Some(err) = self.failures.pop_front() {
                    return Err(err);
                }
                free = self.free_slots(target, lane);
                spins = spins.wrapping_add(1);
                if free == 0 && spins.is_multiple_of(64) {
                    let now = Instant::now();
                    if now - start > self.config.timeout {
                        return Err(Error::Gasnet(format!(
                            "no free slot at rank {target} for {:?}: it does not consume its ring",
                            self.config.timeout
                        )));
                    }
                    if now >= next_check {
                        // A target that left never frees a slot.
                        self.check_peers(now)?;
                        next_check = now + self.config.liveness_interval;
                    }
                    if now - start > Duration::from_millis(20) {
                        std::thread::sleep(Duration::from_micros(50));
                        continue;
                    }
                }
                std::thread::yield_now();
            }
        }
        let seq = self.sent[target as usize][lane as usize] + 1;
        let slot = (seq - 1) % self.layout.ring_slots;
        let flags = if free == 1 {
            flags | FLAG_CREDIT
        } else {
            flags
        };
        let header = Header {
            kind,
            flags,
            handler,
            nargs: args.len(),
            // A long message's payload went ahead by put: only its length
            // travels.
            payload_len: u32::try_from(payload.len()).map_err(|_| {
                Error::Gasnet(format!(
                    "a payload of {} bytes: messages carry at most 4 GiB - 1",
                    payload.len()
                ))
            })?,
            long_offset,
        };
        let body_len = header.body_len();
        let staged = self.layout.staging_slot(target, lane, slot);
        {
            let mut bytes = vec![0u8; 8 + body_len];
            bytes[..8].copy_from_slice(&seq.to_le_bytes());
            header.encode(&mut bytes);
            for (i, arg) in args.iter().enumerate() {
                let at = HEADER_BYTES + 4 * i;
                bytes[at..at + 4].copy_from_slice(&arg.to_le_bytes());
            }
            let at = header.payload_at();
            if kind == Kind::Medium {
                bytes[at..at + payload.len()].copy_from_slice(payload);
            }
            // SAFETY: the mirror slot lies inside this endpoint's private
            // staging area (the layout keeps `8 + body_len <= slot_bytes`:
            // medium payloads are bounded by `max_medium`); the device
            // reads it only for this slot's previous packet, which the
            // target has consumed (the slot is free).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    bytes.as_ptr(),
                    self.memory.as_ptr().add(staged as usize),
                    bytes.len(),
                )
            };
        }
        let pio = body_len as u64 <= u64::from(self.config.pio_max);
        self.post_staged_packet(target, lane, seq, staged, body_len, pio)
    }

    /// Posts the packet staged at `staged` (its stamp, then `body_len`
    /// bytes) into its slot of `target`'s ring of `lane` for this rank: the body
    /// (inline when `pio`), then the stamp fenced behind it, so the target
    /// never sees half a packet. Packet `seq` is then sent.
    fn post_staged_packet(
        &mut self,
        target: u32,
        lane: Lane,
        seq: u64,
        staged: u64,
        body_len: usize,
        pio: bool,
    ) -> Result<()> {
        let slot = (seq - 1) % self.layout.ring_slots;
        let remote = self.peers[target as usize].ring;
        let ring = lane as u64 * self.layout.lane_bytes() + slot * self.layout.slot_bytes;
        let user_data = PACKET_BIT | u64::from(target);
        let region = self.window.region();
        let body = Write::new(
            region.local(staged + 8, body_len as u32)?,
            remote.at(ring + 8),
        )
        .build()
        .user_data(user_data);
        let body = if pio { body.inline() } else { body };
        let stamp = Write::new(region.local(staged, 8)?, remote.at(ring))
            .build()
            .inline()
            .fence()
            .user_data(user_data);
        post_entries(&mut self.qp, &mut self.cq, &mut self.stash, &[body, stamp])?;
        if pio {
            self.counters.pio_writes += 2;
        } else {
            self.counters.pio_writes += 1;
            self.counters.dma_writes += 1;
        }
        self.sent[target as usize][lane as usize] = seq;
        Ok(())
    }

    /// Sends queued replies and library answers, oldest first per target,
    /// as far as free reply slots allow: never waits, so a target that
    /// consumes nothing holds up no other's replies. Those to a target
    /// known gone are dropped.
    fn flush_outgoing(&mut self) -> Result<()> {
        if self.flushing.replace(true) {
            // Inside a flush already (a long reply waiting for its put):
            // the outer one sends the rest, in order.
            return Ok(());
        }
        let flushed = self.flush_outgoing_now();
        self.flushing.set(false);
        flushed
    }

    fn flush_outgoing_now(&mut self) -> Result<()> {
        for target in 0..self.size {
            let queued = &mut self.outgoing[target as usize];
            if self.gone[target as usize].is_some() {
                queued.clear();
                continue;
            }
            while !self.outgoing[target as usize].is_empty()
                && self.free_slots(target, Lane::Reply) > 0
            {
                let out = self.outgoing[target as usize]
                    .pop_front()
                    .expect("one queued");
                if let Err(failure) = self.send_outgoing(&out) {
                    if !failure.packet_sent {
                        // Kept, first in line, for the next flush: a reply
                        // that could not go yet is not lost.
                        self.outgoing[target as usize].push_front(out);
                    }
                    return Err(failure.error);
                }
            }
        }
        Ok(())
    }

    /// Sends the replies queued so far, as far as free slots allow, from
    /// the loops that wait for this rank's own operations or for a free
    /// slot. A failure is kept for the next call that reports failures
    /// (`poll`, `wait_until`, a stalled send), not returned: the wait that
    /// sent the reply must still see its own operation settled.
    fn send_queued_replies(&mut self) {
        if self.replies_queued() {
            if let Err(err) = self.flush_outgoing() {
                self.failures.push_back(err);
            }
        }
    }

    /// Whether replies wait for slots at any target.
    fn replies_queued(&self) -> bool {
        self.outgoing.iter().any(|queued| !queued.is_empty())
    }

    /// Replies (and the library's answers) queued, waiting for free slots
    /// at their targets: at most about two rings' worth per target, since
    /// a target whose replies fill a ring has its requests left in their
    /// ring until it consumes some.
    pub fn replies_waiting(&self) -> usize {
        self.outgoing.iter().map(VecDeque::len).sum()
    }

    fn send_outgoing(&mut self, out: &Outgoing) -> std::result::Result<(), SendFailure> {
        let before = |error| SendFailure {
            error,
            packet_sent: false,
        };
        if let Some((from, len, to)) = out.pre_write {
            self.write_from_segment(out.target, from, len, to)
                .map_err(before)?;
        }
        let op = if out.kind == Kind::Long {
            Some(
                self.start_put(out.target, out.long_offset, &out.payload)
                    .map_err(before)?,
            )
        } else {
            None
        };
        let payload: &[u8] = if out.kind == Kind::Short {
            &[]
        } else {
            &out.payload
        };
        let sent = self.send_packet(
            out.target,
            out.kind,
            out.flags,
            out.handler,
            &out.args,
            payload,
            out.long_offset,
        );
        if let Some(op) = op {
            // The payload is the queued copy: it must outlive the writes.
            self.wait(op).map_err(|error| SendFailure {
                error,
                packet_sent: sent.is_ok(),
            })?;
        }
        sent.map_err(before)?;
        if out.flags & FLAG_REPLY != 0 {
            self.counters.replies += 1;
        }
        Ok(())
    }

    /// Runs the handlers of every packet that has arrived, returns credits
    /// and sends queued replies; how many user handlers ran.
    pub fn poll(&mut self) -> Result<usize> {
        let ran = self.progress()?;
        if let Some(err) = self.bad_packets.pop_front() {
            return Err(err);
        }
        Ok(ran)
    }

    /// What [`poll`](Self::poll) does but report bad packets (they stay
    /// queued for `poll`): reaps, runs handlers, sends queued replies,
    /// fails if a request of this rank failed.
    fn progress(&mut self) -> Result<usize> {
        self.reap()?;
        let ran = self.progress_incoming()?;
        self.flush_outgoing()?;
        if let Some(err) = self.failures.pop_front() {
            return Err(err);
        }
        Ok(ran)
    }

    /// Polls until `cond` holds; fails after [`Config::timeout`] without
    /// it, or as soon as a request to a peer fails. Bad packets from peers
    /// do not end the wait (a hostile peer cannot make this rank give up
    /// on the others): they are counted and left for
    /// [`poll`](Self::poll) to report.
    pub fn wait_until(&mut self, mut cond: impl FnMut(&mut Self) -> bool) -> Result<()> {
        let start = Instant::now();
        let mut next_check = start + self.config.liveness_interval;
        let mut polls = 0u32;
        loop {
            self.progress()?;
            if cond(self) {
                return Ok(());
            }
            polls = polls.wrapping_add(1);
            if polls.is_multiple_of(64) {
                let now = Instant::now();
                let waited = now - start;
                if waited > self.config.timeout {
                    return Err(Error::Gasnet(format!(
                        "the condition did not hold within {:?}",
                        self.config.timeout
                    )));
                }
                if now >= next_check {
                    self.check_peers(now)?;
                    next_check = now + self.config.liveness_interval;
                }
                if waited > Duration::from_millis(20) {
                    std::thread::sleep(Duration::from_micros(50));
                    continue;
                }
            }
            std::thread::yield_now();
        }
    }

    /// Reads 8 bytes of every peer's window that has no check in flight;
    /// a check left unanswered fails the wait only if the device answers
    /// nothing either (see `crate::liveness`).
    fn check_peers(&mut self, now: Instant) -> Result<()> {
        let closed = self.device.closed()?;
        for peer in 0..self.size {
            if peer == self.rank || self.gone[peer as usize].is_some() {
                continue;
            }
            if let Some(why) = closed {
                return Err(Error::PeerGone {
                    peer,
                    why: why.into(),
                });
            }
            if let Some(sent) = self.probes[peer as usize] {
                let interval = self.config.liveness_interval;
                if let Some(why) = self.device.silent(sent, now, interval)? {
                    return Err(Error::PeerGone { peer, why });
                }
                continue;
            }
            let at = self.layout.scratch_at + SCRATCH_PROBE;
            let remote = self.peers[peer as usize].at(0);
            let entry = Read::new(self.window.region().local(at, 8)?, remote)
                .build()
                .user_data(PROBE_BIT | u64::from(peer))
                .signaled();
            post_entries(&mut self.qp, &mut self.cq, &mut self.stash, &[entry])?;
            self.probes[peer as usize] = Some(now);
        }
        Ok(())
    }

    /// Consumes the packets that have arrived on every ring; how many
    /// user handlers ran.
    fn progress_incoming(&mut self) -> Result<usize> {
        if self.polling.get() {
            // A handler's own progress (never: handlers get no endpoint),
            // or a send stalled inside a reply: the outer loop consumes.
            return Ok(0);
        }
        /// Clears the flag when consuming ends, by return or by a
        /// handler's panic (an endpoint used after a caught panic still
        /// consumes its rings).
        struct Consuming(std::rc::Rc<std::cell::Cell<bool>>);
        impl Drop for Consuming {
            fn drop(&mut self) {
                self.0.set(false);
            }
        }
        self.polling.set(true);
        let _consuming = Consuming(std::rc::Rc::clone(&self.polling));
        let mut ran = 0;
        for sender in 0..self.size {
            // Replies first: consuming them never queues anything.
            for lane in [Lane::Reply, Lane::Request] {
                loop {
                    if lane == Lane::Request && self.holds_requests_of(sender) {
                        if !self.holding[sender as usize] && self.packet_arrived(sender, lane) {
                            self.holding[sender as usize] = true;
                            self.counters.requests_held += 1;
                        }
                        break;
                    }
                    if lane == Lane::Request {
                        self.holding[sender as usize] = false;
                    }
                    match self.take_packet(sender, lane) {
                        Ok(Some(n)) => ran += n,
                        Ok(None) => break,
                        Err(err) => {
                            self.counters.bad_packets += 1;
                            if self.bad_packets.len() < BAD_PACKETS_KEPT {
                                self.bad_packets.push_back(err);
                            }
                        }
                    }
                }
                let (peer, l) = (sender as usize, lane as usize);
                let due = self.credit_due[peer][l];
                let owed = self.consumed[peer][l] - self.returned[peer][l];
                let departed = self.gone[peer].is_some();
                if owed > 0 && !departed && (due || owed >= (self.layout.ring_slots / 2).max(1)) {
                    self.credit_due[peer][l] = false;
                    self.return_credits(sender, lane)?;
                }
            }
        }
        Ok(ran)
    }

    /// Whether the requests of `sender` stay in their ring for now: this
    /// rank's replies to it fill a ring already, waiting for slots there
    /// (it does not consume them). Each request consumed queues at most
    /// one reply, so the replies queued to a sender stay under two rings.
    fn holds_requests_of(&self, sender: u32) -> bool {
        self.outgoing[sender as usize].len() as u64 >= self.layout.ring_slots
    }

    /// Writes the consumed count of `sender`'s ring of `lane` into its
    /// memory.
    fn return_credits(&mut self, sender: u32, lane: Lane) -> Result<()> {
        let consumed = self.consumed[sender as usize][lane as usize];
        let at = self.layout.scratch_at + SCRATCH_CREDIT + 8 * lane as u64;
        // SAFETY: the scratch credit word is inside this endpoint's private
        // memory; the inline write copies it when posted.
        unsafe {
            std::ptr::copy_nonoverlapping(
                consumed.to_le_bytes().as_ptr(),
                self.memory.as_ptr().add(at as usize),
                8,
            )
        };
        let remote = self.peers[sender as usize].credit.at(8 * lane as u64);
        // Fenced: a later count never lands before an earlier one.
        let entry = Write::new(self.window.region().local(at, 8)?, remote)
            .build()
            .inline()
            .fence()
            .user_data(CREDIT_BIT | u64::from(sender));
        post_entries(&mut self.qp, &mut self.cq, &mut self.stash, &[entry])?;
        self.counters.pio_writes += 1;
        self.counters.credit_returns += 1;
        self.counters.credits_returned += consumed - self.returned[sender as usize][lane as usize];
        self.returned[sender as usize][lane as usize] = consumed;
        Ok(())
    }

    /// Where the next packet of `sender`'s ring of `lane` is, and its
    /// sequence number.
    fn next_packet(&self, sender: u32, lane: Lane) -> (u64, u64) {
        let expected = self.consumed[sender as usize][lane as usize] + 1;
        let slot = (expected - 1) % self.layout.ring_slots;
        (self.layout.ring_slot(sender, lane, slot), expected)
    }

    /// Whether the next packet of `sender`'s ring of `lane` has arrived.
    fn packet_arrived(&self, sender: u32, lane: Lane) -> bool {
        let (at, expected) = self.next_packet(sender, lane);
        self.word(at).load(Ordering::Acquire) == expected
    }

    /// Consumes the next packet of `sender`'s ring of `lane` if it has
    /// arrived: its handler runs (or it is refused). `Ok(None)`: nothing
    /// new.
    fn take_packet(&mut self, sender: u32, lane: Lane) -> Result<Option<usize>> {
        let (at, expected) = self.next_packet(sender, lane);
        if self.word(at).load(Ordering::Acquire) != expected {
            return Ok(None);
        }
        let slot_bytes = self.layout.slot_bytes as usize;
        let mut copy = std::mem::take(&mut self.slot_copy);
        copy.resize(slot_bytes, 0);
        // SAFETY: the slot lies inside this endpoint's ring area; its
        // stamp (acquired above) says the sender's body write finished
        // before it (fenced), and the sender writes the slot again only
        // after the credit this consumption returns.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.memory.as_ptr().add(at as usize),
                copy.as_mut_ptr(),
                slot_bytes,
            )
        };
        self.consumed[sender as usize][lane as usize] = expected;
        let result = self.handle_packet(sender, lane, &copy);
        self.slot_copy = copy;
        result.map(Some)
    }

    fn handle_packet(&mut self, sender: u32, lane: Lane, slot: &[u8]) -> Result<usize> {
        let bad =
            |why: String| Error::Gasnet(format!("a malformed packet from rank {sender}: {why}"));
        let header = Header::decode(slot, self.layout.segment).map_err(bad)?;
        if header.flags & FLAG_CREDIT != 0 {
            self.credit_due[sender as usize][lane as usize] = true;
        }
        if Lane::of(header.flags) != lane {
            return Err(bad(format!(
                "a {} in the ring of {}",
                if lane == Lane::Reply {
                    "request"
                } else {
                    "reply"
                },
                if lane == Lane::Reply {
                    "replies"
                } else {
                    "requests"
                },
            )));
        }
        let mut args = std::mem::take(&mut self.args);
        header.args(slot, &mut args);
        let result = if header.flags & FLAG_INTERNAL != 0 {
            self.internal(sender, &header, &args).map(|()| 0)
        } else {
            self.run_handler(sender, &header, &args, slot)
        };
        self.args = args;
        result
    }

    fn run_handler(
        &mut self,
        sender: u32,
        header: &Header,
        args: &[u32],
        slot: &[u8],
    ) -> Result<usize> {
        let Endpoint {
            handlers,
            outgoing,
            memory,
            layout,
            counters,
            config,
            ..
        } = self;
        let Some(handler) = handlers
            .table
            .get_mut(header.handler as usize)
            .and_then(Option::as_mut)
        else {
            return Err(Error::Gasnet(format!(
                "a message from rank {sender} names handler {}, which is not registered",
                header.handler
            )));
        };
        let payload: &[u8] = match header.kind {
            Kind::Short => &[],
            Kind::Medium => {
                let at = header.payload_at();
                &slot[at..at + header.payload_len as usize]
            }
            // SAFETY: `decode` checked the payload lies inside the
            // segment, the first `segment` bytes of this endpoint's memory;
            // the payload's writes finished before the packet's stamp.
            Kind::Long => unsafe {
                std::slice::from_raw_parts(
                    memory.as_ptr().add(header.long_offset as usize),
                    header.payload_len as usize,
                )
            },
        };
        let mut token = Token {
            source: sender,
            is_reply: header.flags & FLAG_REPLY != 0,
            replied: false,
            segment_bytes: layout.segment,
            max_medium: config.slot_bytes as usize - HEADER_BYTES - 4 * MAX_ARGS,
            replies: &mut outgoing[sender as usize],
        };
        handler(&mut token, args, payload);
        counters.handlers_run += 1;
        Ok(1)
    }

    /// The library's own messages: gets by message and barriers.
    fn internal(&mut self, sender: u32, header: &Header, args: &[u32]) -> Result<()> {
        let arg = |i: usize| args.get(i).copied().unwrap_or(0);
        match header.handler {
            INTERNAL_GET_REQUEST if args.len() == 6 && header.flags & FLAG_REPLY == 0 => {
                let id = arg(0);
                let offset = u64::from(arg(1)) | u64::from(arg(2)) << 32;
                let len = u64::from(arg(3));
                let key = u64::from(arg(4)) | u64::from(arg(5)) << 32;
                // Into the window over its bounce area the requester bound
                // for this rank for this get (its key is the request's).
                let to = RemoteKey::try_from(key).ok().map(|key| RemoteAddress {
                    key,
                    offset: 0,
                    ..self.peers[sender as usize].at(0)
                });
                // The window bounds the length (the device refuses past it).
                let fits = offset
                    .checked_add(len)
                    .is_some_and(|end| end <= self.layout.segment)
                    && to.is_some();
                let mut reply = Outgoing::message(
                    sender,
                    Kind::Short,
                    FLAG_REPLY | FLAG_INTERNAL,
                    INTERNAL_GET_REPLY,
                    &[id, u32::from(!fits)],
                    Vec::new(),
                    0,
                );
                if let Some(to) = to.filter(|_| fits && len > 0) {
                    reply.pre_write = Some((offset, len, to));
                }
                self.outgoing[sender as usize].push_back(reply);
                Ok(())
            }
            // Only the get in progress (one at a time) expects a reply.
            // The reply to the get in progress, from the rank asked.
            INTERNAL_GET_REPLY
                if args.len() == 2
                    && header.flags & FLAG_REPLY != 0
                    && self.get_pending == Some((arg(0), sender)) =>
            {
                self.get_replies.insert(arg(0), arg(1));
                Ok(())
            }
            // The late reply to a get given up (its window was revoked
            // first, so its bytes did not land): nothing to do.
            INTERNAL_GET_REPLY
                if args.len() == 2
                    && header.flags & FLAG_REPLY != 0
                    && self.gets_given_up.contains(&(arg(0), sender)) =>
            {
                self.gets_given_up
                    .retain(|&given_up| given_up != (arg(0), sender));
                Ok(())
            }
            // A peer is at most one barrier ahead: notices of this rank's
            // current barrier or the next, for one of its rounds, from the
            // one rank that signals this rank in that round.
            INTERNAL_BARRIER
                if args.len() == 2
                    && header.flags & FLAG_REPLY == 0
                    && (arg(0) == self.barrier_epoch
                        || arg(0) == self.barrier_epoch.wrapping_add(1))
                    && arg(1) < 31
                    && (1u32 << arg(1)) < self.size
                    && sender
                        == (self.rank + self.size - (1u32 << arg(1)) % self.size) % self.size =>
            {
                // One notice per (barrier, round) is due: a repeated one
                // changes nothing.
                self.barrier_arrivals.insert((arg(0), arg(1)));
                Ok(())
            }
            other => Err(Error::Gasnet(format!(
                "a library message from rank {sender} with handler {other} and {} arguments",
                args.len()
            ))),
        }
    }

    /// Reaps completions: operations count down, packet failures are kept
    /// to report.
    fn reap(&mut self) -> Result<()> {
        self.cq.poll_into(&mut self.stash)?;
        if !self.stash.is_empty() {
            self.device.heard();
        }
        for completion in std::mem::take(&mut self.stash) {
            let failure = completion.result().err();
            if completion.user_data == DEVICE_CHECK {
                // An answer, as every completion is: noted above.
                continue;
            }
            if completion.user_data & PROBE_BIT != 0 {
                let peer = (completion.user_data & !PROBE_BIT) as u32;
                if let Some(slot) = self.probes.get_mut(peer as usize) {
                    *slot = None;
                }
                if let Some(err) = failure {
                    self.fail_probe(peer, err);
                }
                continue;
            }
            if completion.user_data & GET_DATA_BIT != 0 {
                if failure.is_some() {
                    self.counters.get_data_refused += 1;
                }
                continue;
            }
            if completion.user_data & CREDIT_BIT != 0 {
                if let Some(err) = failure {
                    let peer = (completion.user_data & !CREDIT_BIT) as u32;
                    self.fail_credit_return(peer, err);
                }
                continue;
            }
            if completion.user_data & PACKET_BIT != 0 {
                if let Some(err) = failure {
                    let peer = (completion.user_data & !PACKET_BIT) as u32;
                    self.fail_peer(peer, err);
                }
                continue;
            }
            if let Some(op) = self.ops.get_mut(&completion.user_data) {
                op.remaining = op.remaining.saturating_sub(1);
                if op.failure.is_none() {
                    op.failure = failure;
                }
            }
        }
        Ok(())
    }

    /// Waits for a nonblocking operation: once it returns, the target has
    /// the bytes and the source may be reused.
    ///
    /// A handle of another endpoint (another rank's object, or one of
    /// this rank's before it was made again) is refused: its tag would
    /// name one of this endpoint's operations, or none. A handle waited
    /// for already is complete.
    pub fn wait(&mut self, handle: Handle) -> Result<()> {
        if handle.endpoint != self.id {
            return Err(Error::Gasnet(format!(
                "wait on a handle of another endpoint (operation {} of endpoint {}, this is \
                 endpoint {})",
                handle.tag, handle.endpoint, self.id
            )));
        }
        let tag = handle.tag;
        if !self.ops.contains_key(&tag) {
            return Ok(());
        }
        let waited = self.wait_for(tag);
        if waited.is_err() {
            // However the wait failed (a reap, consuming, the timeout):
            // nothing of the operation lands after this returns.
            self.settle(tag);
        }
        waited
    }

    /// [`wait`](Self::wait)'s loop for operation `tag`, then its copies.
    fn wait_for(&mut self, tag: u64) -> Result<()> {
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            self.reap()?;
            if self.ops.get(&tag).is_none_or(|op| op.remaining == 0) {
                break;
            }
            // Keep consuming while waiting, and send the replies the
            // handlers queued: peers may be stalled on us (a peer waiting
            // for a reply would otherwise wait for as long as this rank
            // only waits for its own one-sided operations).
            self.progress_incoming()?;
            self.send_queued_replies();
            // Checked on the first turn too, then every 64.
            let check = spins.is_multiple_of(64);
            spins = spins.wrapping_add(1);
            if check {
                // The device completes or fails every request it took (a
                // departed target fails it): this bound is for a device
                // that stopped answering.
                let waited = start.elapsed();
                if waited > self.config.timeout {
                    self.settle(tag);
                    return Err(Error::Gasnet(format!(
                        "an operation did not complete within {:?}",
                        self.config.timeout
                    )));
                }
                if waited > Duration::from_millis(20) {
                    std::thread::sleep(Duration::from_micros(50));
                    continue;
                }
            }
            std::thread::yield_now();
        }
        let Some(op) = self.ops.remove(&tag) else {
            return Ok(());
        };
        if let Some(err) = op.failure {
            return Err(self.failure(op.peer, err));
        }
        for (from, to, len) in &op.copies {
            // SAFETY: `from` is a scratch or bounce offset whose read has
            // completed; `to` points into the caller's destination, which
            // the blocking get borrows mutably for the whole call.
            unsafe {
                let source = match op._bounce.as_ref().and_then(|r| r.buffer()) {
                    Some(bounce) => bounce.as_ptr().add(*from as usize),
                    None => self.memory.as_ptr().add(*from as usize),
                };
                std::ptr::copy_nonoverlapping(source, *to, *len);
            }
        }
        Ok(())
    }

    /// After a wait for operation `tag` gave up: the operation's copies
    /// into the caller's memory are dropped (the call returns, its
    /// destination borrow ends), and the device, which may still write
    /// into the caller's memory through the operation's registration, is
    /// waited for until it completes or fails the operation (it does, for
    /// a peer gone too: a port that closed at once, a node that stopped
    /// answering within the fabric's operation timeout), or closes its
    /// connection, so that nothing lands in the caller's memory after the
    /// call returned. A device that stops answering but keeps its
    /// connection is waited for however long: until it answers, it may
    /// still write there.
    fn settle(&mut self, tag: u64) {
        let Some(op) = self.ops.get_mut(&tag) else {
            return;
        };
        op.copies.clear();
        let mut next_check = Instant::now();
        loop {
            if self.reap().is_err() {
                break;
            }
            if self.ops.get(&tag).is_none_or(|op| op.remaining == 0) {
                self.ops.remove(&tag);
                return;
            }
            let now = Instant::now();
            if now >= next_check {
                if !matches!(self.device.closed(), Ok(None)) {
                    break;
                }
                next_check = now + self.config.liveness_interval;
            }
            std::thread::sleep(Duration::from_micros(50));
        }
        // The device is gone: nothing more will land. The operation keeps
        // its registration.
    }

    /// Waits for every nonblocking operation of this endpoint.
    pub fn wait_all(&mut self) -> Result<()> {
        let tags: Vec<u64> = self.ops.keys().copied().collect();
        let mut first = None;
        for tag in tags {
            if let Err(err) = self.wait(self.handle(tag)) {
                first.get_or_insert(err);
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// A barrier of every rank (dissemination over library messages):
    /// returns once every rank has entered it. This rank's puts have all
    /// completed before it enters.
    pub fn barrier(&mut self) -> Result<()> {
        self.wait_all()?;
        self.flush_outgoing()?;
        self.barrier_epoch = self.barrier_epoch.wrapping_add(1);
        let epoch = self.barrier_epoch;
        // Notices of earlier barriers (a repeated notice taken after its
        // round) can no longer be due.
        self.barrier_arrivals
            .retain(|&(of, _)| of == epoch || of == epoch.wrapping_add(1));
        let n = self.size;
        let mut distance = 1u32;
        let mut round = 0u32;
        while distance < n {
            let to = (self.rank + distance) % n;
            self.send_packet(
                to,
                Kind::Short,
                FLAG_INTERNAL,
                INTERNAL_BARRIER,
                &[epoch, round],
                &[],
                0,
            )?;
            let from = (self.rank + n - distance) % n;
            self.wait_for_barrier_round(epoch, round, from)?;
            self.barrier_arrivals.remove(&(epoch, round));
            distance *= 2;
            round += 1;
        }
        Ok(())
    }

    /// Waits for round `round` of barrier `epoch` to arrive from `from`.
    /// Another rank found gone meanwhile does not fail the round (it is
    /// remembered: later calls naming it fail): once any rank has entered
    /// a barrier's last round, every rank may leave the barrier and
    /// finalize while others still wait on their own last round, and this
    /// rank may learn of it from a credit return or a liveness check.
    /// `from` found gone fails it unless its message already arrived.
    fn wait_for_barrier_round(&mut self, epoch: u32, round: u32, from: u32) -> Result<()> {
        let arrived = |ep: &Self| ep.barrier_arrivals.contains(&(epoch, round));
        loop {
            match self.wait_until(|ep| arrived(ep)) {
                Ok(()) => return Ok(()),
                // The next turn takes the arrival, or the next failure.
                Err(Error::PeerGone { peer, .. }) if peer != from || arrived(self) => {}
                Err(err) => return Err(err),
            }
        }
    }

    /// Sends a packet of raw bytes (everything after the stamp) into this
    /// rank's ring at `target` (the ring of replies if `reply_ring`), as a
    /// hostile peer could: for tests of the target's checks.
    #[doc(hidden)]
    pub fn send_raw_packet(&mut self, target: u32, reply_ring: bool, body: &[u8]) -> Result<()> {
        self.check_target(target)?;
        if body.is_empty() || body.len() + 8 > self.layout.slot_bytes as usize {
            return Err(Error::Gasnet("a raw packet must fit a slot".into()));
        }
        let lane = match reply_ring {
            true => Lane::Reply,
            false => Lane::Request,
        };
        self.wait_until(|ep| ep.free_slots(target, lane) > 0)?;
        let seq = self.sent[target as usize][lane as usize] + 1;
        let slot = (seq - 1) % self.layout.ring_slots;
        let staged = self.layout.staging_slot(target, lane, slot);
        let mut bytes = Vec::with_capacity(8 + body.len());
        bytes.extend_from_slice(&seq.to_le_bytes());
        bytes.extend_from_slice(body);
        // SAFETY: as in `send_packet`: the mirror slot is private and free,
        // and the bytes fit it (checked above).
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                self.memory.as_ptr().add(staged as usize),
                bytes.len(),
            )
        };
        self.post_staged_packet(target, lane, seq, staged, body.len(), false)
    }
}

impl Drop for Endpoint<'_> {
    /// Lets the operations and queued replies already started finish, and
    /// then every request posted (packets go unsignaled: a barrier's last
    /// round, a credit return), at most a few seconds in all, so that no
    /// write is dropped with the port: across the fabric a packet may
    /// still wait for its retransmission when the rank leaves.
    fn drop(&mut self) {
        let deadline = Instant::now() + crate::engine::SETTLE_ON_DROP;
        self.config.timeout = self.config.timeout.min(crate::engine::SETTLE_ON_DROP);
        while self.replies_queued() && Instant::now() < deadline {
            if self.progress().is_err() {
                break;
            }
            std::thread::yield_now();
        }
        while !self.ops.is_empty() && Instant::now() < deadline {
            if self.reap().is_err() {
                break;
            }
            self.ops.retain(|_, op| op.remaining > 0);
            std::thread::yield_now();
        }
        // (Failed packets complete even unsignaled.)
        crate::engine::settle_posted(
            self,
            deadline,
            |endpoint| !matches!(endpoint.qp.all_finished(), Ok(false)),
            Self::reap,
        );
    }
}

/// The error a failed request to `peer` means.
fn peer_failure(peer: u32, err: CompletionError) -> Error {
    if err.status == Status::PeerGone
        || matches!(
            err.detail,
            ErrorDetail::PortDown | ErrorDetail::NodeUnreachable | ErrorDetail::UnknownNode
        )
    {
        return Error::PeerGone {
            peer,
            why: format!("the device reports {err}"),
        };
    }
    Error::Completion(err)
}

/// Fails unless `[offset, offset + len)` lies inside `limit` bytes.
fn check_range(offset: u64, len: u64, limit: u64) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= limit => Ok(()),
        _ => Err(Error::Gasnet(format!(
            "{len} bytes at offset {offset} lie outside the {limit}-byte segment"
        ))),
    }
}

/// Registers an endpoint's memory (its segment, rings, credit words,
/// staging and bounce area).
///
/// # Safety
///
/// `memory` is, or becomes, the `memory` field of an [`Endpoint`]: declared
/// after every field that holds a registration or window over it (`ops`,
/// `window`, `_pair_windows`), it is freed only after they are gone.
unsafe fn register_memory<'c>(
    context: &'c Context,
    memory: &DmaBuffer,
) -> Result<MemoryRegion<'c>> {
    // SAFETY: the caller keeps `memory` allocated while the region and
    // every window over it live (this function's contract); the endpoint
    // reads and writes it only through raw pointers and atomics.
    Ok(unsafe { context.register(memory.iova(), memory.len() as u64)? })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sizes whose memory does not fit 64 bits are refused by name, never
    /// wrapped (a wrapped layout would place rings inside the segment).
    #[test]
    fn a_layout_too_large_for_64_bits_is_refused() {
        let huge = [
            Config {
                segment_bytes: usize::MAX - 10,
                ..Config::default()
            },
            Config {
                get_bounce_bytes: usize::MAX - 100,
                ..Config::default()
            },
            Config {
                ring_slots: u32::MAX,
                slot_bytes: u32::MAX,
                ..Config::default()
            },
        ];
        for config in huge {
            match Layout::new(u32::MAX, &config) {
                Err(Error::Gasnet(why)) => assert!(why.contains("does not fit 64 bits"), "{why}"),
                Err(other) => panic!("{other}"),
                Ok(layout) => panic!("{layout:?}"),
            }
        }
        assert!(Layout::new(2, &Config::default()).is_ok());
    }

    #[test]
    fn the_layout_keeps_rings_credits_and_bounce_inside_the_window_and_staging_out() {
        for (ranks, slots, slot_bytes, segment) in
            [(1, 1, 64, 0), (4, 2, 256, 4097), (8, 64, 1024, 1 << 20)]
        {
            let config = Config {
                segment_bytes: segment,
                ring_slots: slots,
                slot_bytes,
                ..Config::default()
            };
            let layout = Layout::new(ranks, &config).unwrap();
            assert!(layout.bounce_at >= layout.segment);
            assert!(layout.rings_at >= layout.bounce_at + layout.bounce_bytes);
            assert_eq!(layout.rings_at % 64, 0);
            // Rings of different senders, lanes and slots never overlap;
            // the last ends where the credit words start; a sender's two
            // rings are adjacent (one window covers both).
            let last_slot = u64::from(slots) - 1;
            let mut starts = std::collections::BTreeSet::new();
            for sender in 0..ranks {
                for lane in [Lane::Request, Lane::Reply] {
                    for slot in 0..u64::from(slots) {
                        assert!(starts.insert(layout.ring_slot(sender, lane, slot)));
                    }
                }
                assert_eq!(
                    layout.ring_slot(sender, Lane::Reply, last_slot) + u64::from(slot_bytes),
                    layout.ring_slot(sender, Lane::Request, 0) + layout.ring_bytes()
                );
                assert_eq!(
                    layout.credit_word(sender, Lane::Reply),
                    layout.credit_word(sender, Lane::Request) + 8
                );
            }
            let last = layout.ring_slot(ranks - 1, Lane::Reply, last_slot);
            assert_eq!(last + u64::from(slot_bytes), layout.credits_at);
            assert_eq!(layout.ring_slot(1 % ranks, Lane::Reply, 0) % 8, 0);
            assert!(layout.credit_word(ranks - 1, Lane::Reply) + 8 <= layout.staging_at);
            // What peers may not touch lies past the window.
            assert_eq!(layout.staging_at % 4096, 0);
            let staged_end =
                layout.staging_slot(ranks - 1, Lane::Reply, last_slot) + u64::from(slot_bytes);
            assert_eq!(staged_end, layout.scratch_at);
            assert!(layout.scratch_at + SCRATCH_BYTES <= layout.total);
            assert!(SCRATCH_READ_SMALL + u64::from(MAX_INLINE) <= SCRATCH_BYTES);
        }
    }

    #[test]
    fn replies_follow_the_rules_and_queue_in_order() {
        let mut queue = VecDeque::new();
        let mut token = Token {
            source: 3,
            is_reply: false,
            replied: false,
            segment_bytes: 4096,
            max_medium: 100,
            replies: &mut queue,
        };
        assert!(token.reply_medium(1, &[], &[0u8; 101]).is_err());
        assert!(token.reply_long(1, &[], &[0u8; 10], 4090).is_err());
        assert!(token.reply_short(1, &[0; MAX_ARGS + 1]).is_err());
        token.reply_long(1, &[7], b"abc", 4093).expect("fits");
        assert!(token.reply_short(1, &[]).is_err(), "a second reply");
        assert_eq!(queue.len(), 1);
        assert_eq!(queue[0].target, 3);
        assert_eq!(queue[0].payload, b"abc");
        let mut token = Token {
            source: 0,
            is_reply: true,
            replied: false,
            segment_bytes: 4096,
            max_medium: 100,
            replies: &mut queue,
        };
        assert!(token.reply_short(1, &[]).is_err(), "a reply to a reply");
        assert_eq!(queue.len(), 1);
    }
}
