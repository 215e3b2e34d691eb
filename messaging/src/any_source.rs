//! Receives that name no source: FMPL's separate any-source domain, with
//! matching at the *receiver* (FMPL section 2.4).
//!
//! Sender-side matching needs the receiver to name its source (the
//! receive writes into that sender's slot), so receives from anyone get a
//! domain of their own, apart from the zero-copy slots: each rank holds,
//! per communicator context and per peer, a ring of
//! [`ANY_ENTRIES`](layout::ANY_ENTRIES) entries that only that peer fills
//! ([`Layout::any_entry`]).
//!
//! * **Send** ([`Communicator::send_any`]): the sender's `n`th message to
//!   a receiver goes into entry `n - 1` (mod the ring size) of its ring
//!   there: the message word (tag, kind, eager length) and the body, then
//!   the stamp word `n`, fenced after them. A body of at most
//!   [`ANY_EAGER_BYTES`](layout::ANY_EAGER_BYTES) travels in the entry
//!   (inline when header and body fit an inline write, else from the
//!   registered send buffer). A longer one travels by **rendezvous**: the
//!   entry carries a read-only window over the send buffer and the
//!   message's length; the receiver reads the bytes with RDMA READs
//!   straight into the receive buffer (zero copy), then counts it in the
//!   credit word it writes back to the sender; the send returns then and
//!   the window is revoked.
//! * **Flow control**: the receiver writes back, in one credit word per
//!   sender ([`Layout::any_credit`], [`layout::any_credit_word`]), how
//!   many entries of that sender it has drained and how many of its
//!   rendezvous messages it has read, each write fenced when the last is
//!   still under way (across the fabric unfenced writes land in any
//!   order, and an older count landing last would take back credits); a
//!   sender never writes
//!   entry `n` before the receiver drained entry `n - ANY_ENTRIES` (it
//!   waits, progressing, and drains its own rings meanwhile into its
//!   unexpected queue, up to a bound, so that two ranks sending to each
//!   other do not wait on each other).
//! * **Receive** ([`Communicator::recv_any`],
//!   [`Communicator::irecv_any`]): receives are posted in order and match
//!   in that order. Matching first moves what has arrived in the rings
//!   into the unexpected queue, round robin (one entry of each sender in
//!   turn, from the one after the last served, so no sender starves under
//!   contention; a sender with
//!   [`Config::unexpected_per_sender`](crate::Config::unexpected_per_sender)
//!   messages queued is skipped, so its sends wait for credits until
//!   receives take some), and writes the credits back; then each posted receive,
//!   oldest first, takes the first queued message it matches. Each ring is
//!   read in order, so the messages of one (source, tag) are received in
//!   the order they were sent (MPI's non-overtaking rule), and a message
//!   goes to the oldest receive that matches it. Eager bodies are copied
//!   out of the ring (at most one entry's body); rendezvous bodies are
//!   read straight into the receive buffer.
//!
//! Sends are blocking (an eager send returns when its writes completed,
//! or once posted when every byte travels inline; a rendezvous send when
//! the receiver has read it), so a rank has at most one rendezvous
//! outstanding per receiver. Like MPI's standard-mode sends, two ranks
//! that rendezvous-send to each other before receiving wait for each
//! other, and a rendezvous send to this rank itself waits for a receive
//! that cannot come (eager sends to itself work).

use std::collections::VecDeque;
use std::ops::DerefMut;
use std::time::{Duration, Instant};

use pindown_uapi::queue::MAX_INLINE;
use pindown_uapi::{Access, RemoteKey};
use stable_deref_trait::StableDeref;

use crate::comm::{Communicator, Shared};
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::layout::{self, Layout, ANY_EAGER_BYTES, ANY_ENTRIES, ANY_HEADER_BYTES};

/// What [`Communicator::recv_any`] received.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AnyReceived {
    /// The sender (rank in the communicator).
    pub source: u32,
    /// The tag the sender gave.
    pub tag: u32,
    /// Bytes delivered into the buffer (the message's length).
    pub len: u64,
}

/// What [`Communicator::probe_any`] found: a message that has arrived and
/// not been received.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AnyStatus {
    /// The sender (rank in the communicator).
    pub source: u32,
    /// The tag the sender gave.
    pub tag: u32,
    /// The message's length.
    pub len: u64,
}

/// Where a drained message's bytes are.
#[derive(Debug)]
enum Body {
    /// Copied out of the ring.
    Eager(Vec<u8>),
    /// Still in the sender's memory, behind a read-only window.
    Rendezvous { key: u64, len: u64 },
}

impl Body {
    fn len(&self) -> u64 {
        match self {
            Body::Eager(bytes) => bytes.len() as u64,
            Body::Rendezvous { len, .. } => *len,
        }
    }
}

/// A message taken from a ring.
#[derive(Debug)]
struct Drained {
    context: u32,
    /// World rank of the sender.
    peer: u32,
    tag: u32,
    body: Body,
}

/// One rank's any-source state. Rings are numbered `context * ranks +
/// peer`, as in [`Layout::any_entry`].
#[derive(Debug)]
pub(crate) struct AnyState {
    ranks: u32,
    /// Per ring: messages this rank has written into its ring at the peer.
    sent: Vec<u64>,
    /// Per ring: entries of the peer's ring at this rank drained.
    drained: Vec<u64>,
    /// Per ring: rendezvous messages this rank has written into its ring
    /// at the peer.
    rendezvous_sent: Vec<u64>,
    /// Per ring: rendezvous messages of the peer this rank has read.
    reads: Vec<u64>,
    /// Per ring: the credit word last written back to the peer.
    credited: Vec<u64>,
    /// Per ring: the tag of that write (under way while the engine
    /// holds it in flight).
    credit_writes: Vec<Option<u64>>,
    /// Messages drained from the rings and not yet received, oldest first.
    unexpected: VecDeque<Drained>,
    /// Per ring (sender and communicator): its messages in `unexpected`
    /// (at most
    /// [`Config::unexpected_per_sender`](crate::Config::unexpected_per_sender)).
    /// Per ring, not per sender: a sender's messages on one communicator
    /// must not hold up those a receive on another asks for.
    queued: Vec<usize>,
    /// Bytes of the eager bodies in `unexpected`.
    queued_bytes: u64,
    /// Per ring: whether its next entry is left there, its sender having
    /// as many messages queued as it may.
    held: Vec<bool>,
    /// Times a ring started being held.
    held_back: u64,
    /// Per context: the member whose ring the next receive looks at first.
    cursor: Vec<usize>,
    /// Writes back (credits, read-done words) whose completion nobody
    /// waits for; swept now and then so their records do not pile up.
    unreaped: Vec<u64>,
    /// Eager sends that returned once posted (every byte inline, copied
    /// into the send queue): (peer, tag) of their writes, whose failure
    /// the next [`send_any`](Communicator::send_any) reports.
    unconfirmed: Vec<(u32, u64)>,
    /// Receives posted and not yet matched or taken back, in the order
    /// they were posted (the order they match in).
    posted: Vec<Posted>,
    /// Receives posted so far (ids).
    posts: u64,
}

/// A receive waiting for its message.
struct Posted {
    id: u64,
    filter: Filter,
    /// The receive buffer, which its owner keeps valid and untouched until
    /// the receive is taken back (see [`post`]).
    ptr: *mut u8,
    capacity: usize,
    /// Set once matched (and, for rendezvous, read).
    result: Option<Result<AnyReceived>>,
}

impl std::fmt::Debug for Posted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Posted")
            .field("id", &self.id)
            .field("capacity", &self.capacity)
            .field("done", &self.result.is_some())
            .finish()
    }
}

impl AnyState {
    pub(crate) fn new(layout: &Layout) -> Self {
        let rings = layout.contexts as usize * layout.ranks as usize;
        AnyState {
            ranks: layout.ranks,
            sent: vec![0; rings],
            drained: vec![0; rings],
            rendezvous_sent: vec![0; rings],
            reads: vec![0; rings],
            credited: vec![0; rings],
            credit_writes: vec![None; rings],
            unexpected: VecDeque::new(),
            queued: vec![0; rings],
            queued_bytes: 0,
            held: vec![false; rings],
            held_back: 0,
            cursor: vec![0; layout.contexts as usize],
            unreaped: Vec::new(),
            unconfirmed: Vec::new(),
            posted: Vec::new(),
            posts: 0,
        }
    }

    fn ring(&self, context: u32, peer: u32) -> usize {
        context as usize * self.ranks as usize + peer as usize
    }

    /// Queues a message drained from its ring.
    fn enqueue(&mut self, message: Drained) {
        let ring = self.ring(message.context, message.peer);
        self.queued[ring] += 1;
        if let Body::Eager(bytes) = &message.body {
            self.queued_bytes += bytes.len() as u64;
        }
        self.unexpected.push_back(message);
    }

    /// Takes the queued message at `at` out of the queue.
    fn dequeue(&mut self, at: usize) -> Drained {
        let message = self.unexpected.remove(at).expect("a queued message");
        let ring = self.ring(message.context, message.peer);
        self.queued[ring] -= 1;
        if let Body::Eager(bytes) = &message.body {
            self.queued_bytes -= bytes.len() as u64;
        }
        message
    }

    /// What waits in the unexpected queue now.
    pub(crate) fn backlog(&self) -> AnyBacklog {
        AnyBacklog {
            messages: self.unexpected.len(),
            eager_bytes: self.queued_bytes,
            most_from_one_sender: self.queued.iter().copied().max().unwrap_or(0),
            held_back: self.held_back,
        }
    }
}

/// The any-source domain's unexpected queue: messages that arrived before
/// a receive matched them ([`Messenger::any_backlog`](crate::Messenger::any_backlog)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AnyBacklog {
    /// Messages waiting.
    pub messages: usize,
    /// Bytes of their eager bodies (a rendezvous message's bytes stay
    /// with its sender).
    pub eager_bytes: u64,
    /// The most messages waiting from one sender on one communicator
    /// (at most [`Config::unexpected_per_sender`](crate::Config::unexpected_per_sender)).
    pub most_from_one_sender: usize,
    /// Times so far a sender was held back: its next message left in its
    /// ring, that sender having as many messages waiting as it may, so
    /// that its sends waited for this rank's receives.
    pub held_back: u64,
}

/// How long a failed wait still waits for the device to finish with a
/// buffer it may be reading or writing before the buffer goes back.
const DEVICE_GRACE: Duration = Duration::from_secs(30);

/// Where a rendezvous entry's body starts: the sender's window key, then
/// the message's length.
const RENDEZVOUS_BODY: u64 = 16;

/// Forgets the completed write-backs (their failures only say the peer is
/// gone, which the next wait on it reports).
fn sweep(engine: &mut Engine<'_>) {
    let mut unreaped = std::mem::take(&mut engine.any.unreaped);
    unreaped.retain(|&tag| matches!(engine.plain_done(tag), Ok(false)));
    engine.any.unreaped = unreaped;
}

/// The first failure of an eager send that had returned, if one failed
/// (taken); forgets those that completed.
fn take_unconfirmed_failure(engine: &mut Engine<'_>) -> Option<Error> {
    let mut failure = None;
    let mut unconfirmed = std::mem::take(&mut engine.any.unconfirmed);
    unconfirmed.retain(|&(_, tag)| match engine.plain_done(tag) {
        Ok(done) => !done,
        Err(err) => {
            failure.get_or_insert(err);
            false
        }
    });
    engine.any.unconfirmed = unconfirmed;
    failure
}

/// Copies `len` bytes at `offset` of the control memory into `out`.
fn copy_out(engine: &Engine<'_>, offset: u64, out: &mut [u8]) {
    assert!(offset + out.len() as u64 <= engine.layout.bytes());
    // SAFETY: the range lies inside the control memory (asserted), which
    // lives as long as the engine. It is a ring entry whose stamp this
    // rank has seen (acquire load) and not yet credited back, so its
    // sender does not write it until this rank's credit says it may;
    // `out` is the caller's own memory and cannot overlap it.
    unsafe {
        std::ptr::copy_nonoverlapping(
            engine.control_ptr().add(offset as usize),
            out.as_mut_ptr(),
            out.len(),
        )
    };
}

/// The next entry of `peer`'s ring in `context`, if its stamp is there:
/// (sequence number, tag, eager length or `None` for rendezvous, offset of
/// the entry).
fn peek(engine: &Engine<'_>, context: u32, peer: u32) -> Option<(u64, u32, Option<u64>, u64)> {
    let seq = engine.any.drained[engine.any.ring(context, peer)] + 1;
    let entry = engine.layout.any_entry(context, peer, seq - 1);
    if engine.load(entry) != seq {
        return None;
    }
    let (tag, eager) = layout::any_message(engine.load(entry + 8));
    Some((seq, tag, eager.map(|len| len.min(ANY_EAGER_BYTES)), entry))
}

/// Takes the entry [`peek`] found out of the ring (an eager body is
/// copied out; a rendezvous entry keeps the sender's window key).
fn take(
    engine: &mut Engine<'_>,
    context: u32,
    peer: u32,
    (seq, tag, eager, entry): (u64, u32, Option<u64>, u64),
) -> Drained {
    let body = match eager {
        Some(len) => {
            let mut bytes = vec![0; len as usize];
            copy_out(engine, entry + ANY_HEADER_BYTES, &mut bytes);
            Body::Eager(bytes)
        }
        None => Body::Rendezvous {
            key: engine.load(entry + RENDEZVOUS_BODY),
            len: engine.load(entry + RENDEZVOUS_BODY + 8),
        },
    };
    let ring = engine.any.ring(context, peer);
    engine.any.drained[ring] = seq;
    Drained {
        context,
        peer,
        tag,
        body,
    }
}

/// Writes back the credit word of every ring of `context` whose counts
/// (entries drained, rendezvous messages read) moved since last said.
fn write_credits(engine: &mut Engine<'_>, context: u32) -> Result<()> {
    for peer in 0..engine.any.ranks {
        let ring = engine.any.ring(context, peer);
        let word = layout::any_credit_word(engine.any.drained[ring], engine.any.reads[ring]);
        if word == engine.any.credited[ring] || engine.peer_gone(peer) {
            continue;
        }
        let at = engine.layout.any_credit(context, engine.rank);
        let remote = engine.peer_at(peer, at);
        // Fenced while the word's last write is still under way: across
        // the fabric two writes of the word may land in either order, and
        // an older count landing last would take back credits the sender
        // already used, leaving it waiting forever. A write that completed
        // has landed; the next needs no fence, which would hold it (and
        // every later request) behind everything earlier on the queue.
        let earlier_under_way =
            engine.any.credit_writes[ring].is_some_and(|tag| engine.in_flight.contains_key(&tag));
        let tag = engine.write_small(peer, 64, &word.to_le_bytes(), remote, earlier_under_way)?;
        engine.any.unreaped.push(tag);
        engine.any.credit_writes[ring] = Some(tag);
        engine.any.credited[ring] = word;
    }
    Ok(())
}

/// How many messages a sender's wait ([`drain_all`]) lets wait in the
/// unexpected queue: past it, senders wait for this rank's receives again
/// (flow control) instead of its memory growing. Posted receives still
/// drain every ring, whatever the queue holds, up to each sender's
/// [`Config::unexpected_per_sender`](crate::Config::unexpected_per_sender).
const UNEXPECTED_SOFT_LIMIT: usize = 4096;

/// Moves the entries that have arrived in the rings of `context` into the
/// unexpected queue (until it holds `limit`), round robin: one entry of
/// each ring in turn, from the ring after the last one served, so that
/// the queue interleaves the senders and none starves. Writes the credits
/// back.
///
/// A ring whose sender already has [`Config::unexpected_per_sender`]
/// messages queued is left as it is: its sender's memory here stays
/// bounded, and its sends wait for credits until receives take some.
///
/// [`Config::unexpected_per_sender`]: crate::Config::unexpected_per_sender
fn drain(engine: &mut Engine<'_>, context: u32, limit: usize) -> Result<()> {
    let ranks = engine.any.ranks;
    let per_sender = engine.config.unexpected_per_sender;
    let mut next = engine.any.cursor[context as usize] % ranks as usize;
    let mut idle = 0;
    while idle < ranks && engine.any.unexpected.len() < limit {
        let peer = next as u32;
        next = (next + 1) % ranks as usize;
        let Some(head) = peek(engine, context, peer) else {
            idle += 1;
            continue;
        };
        let ring = engine.any.ring(context, peer);
        if engine.any.queued[ring] >= per_sender {
            if !engine.any.held[ring] {
                engine.any.held[ring] = true;
                engine.any.held_back += 1;
            }
            idle += 1;
            continue;
        }
        engine.any.held[ring] = false;
        let drained = take(engine, context, peer, head);
        engine.any.enqueue(drained);
        engine.any.cursor[context as usize] = next;
        idle = 0;
    }
    write_credits(engine, context)
}

/// [`drain`] for a sender's wait: bounded by [`UNEXPECTED_SOFT_LIMIT`].
fn drain_all(engine: &mut Engine<'_>, context: u32) -> Result<()> {
    drain(engine, context, UNEXPECTED_SOFT_LIMIT)
}

/// What a receive is looking for.
struct Filter {
    context: u32,
    /// World rank of the source, if one was named.
    peer: Option<u32>,
    tag: Option<u32>,
    /// World ranks of the communicator's members.
    members: Vec<u32>,
}

impl Filter {
    fn matches(&self, context: u32, peer: u32, tag: u32) -> bool {
        context == self.context
            && self.peer.is_none_or(|p| p == peer)
            && self.tag.is_none_or(|t| t == tag)
            && self.members.contains(&peer)
    }

    fn source(&self, peer: u32) -> u32 {
        self.members
            .iter()
            .position(|&p| p == peer)
            .expect("a member") as u32
    }
}

/// Waits until the plain request `tag` to `peer` completed; on failure,
/// still waits (bounded) for the device to finish with the memory it
/// names before the caller lets it go.
fn wait_plain(engine: &mut Engine<'_>, peer: u32, tag: u64) -> Result<()> {
    let mut failure = None;
    let done = engine.wait_until(Some(peer), None, |e| match e.plain_done(tag) {
        Ok(done) => Ok(done),
        Err(err) => {
            failure = Some(err);
            Ok(true)
        }
    });
    if let Some(err) = failure {
        return Err(err);
    }
    if let Err(err) = done {
        let _ = engine.wait_until(None, Some(Instant::now() + DEVICE_GRACE), |e| {
            Ok(!matches!(e.plain_done(tag), Ok(false)))
        });
        return Err(err);
    }
    Ok(())
}

/// [`wait_plain`], and if the device has not finished request `tag` even
/// then, takes its access to `[addr, addr + len)` (the memory of `region`)
/// away before the caller's buffer goes back to the caller: the idle
/// receive windows cached over that memory are revoked, the pages are
/// invalidated, and `region`, their last holder then, deregisters once the
/// device has answered, after which no access that began earlier can
/// touch them.
fn wait_plain_fenced(
    engine: &mut Engine<'_>,
    peer: u32,
    tag: u64,
    region: pindown_driver::verbs::MemoryRegion<'_>,
    addr: u64,
    len: u64,
) -> Result<()> {
    let waited = wait_plain(engine, peer, tag);
    if waited.is_err() && matches!(engine.plain_done(tag), Ok(false)) {
        engine.windows.forget_range(addr, len);
        engine.context.invalidate(addr, len);
        region.deregister()?;
    }
    waited
}

/// Delivers a taken message into `buffer`: copies an eager body from the
/// queue, or reads a rendezvous body from its sender and tells the sender.
fn deliver(
    engine: &mut Engine<'_>,
    filter: &Filter,
    message: Drained,
    buffer: &mut [u8],
) -> Result<AnyReceived> {
    let capacity = buffer.len() as u64;
    let len = message.body.len();
    let moved = len.min(capacity);
    match message.body {
        Body::Eager(bytes) => buffer[..moved as usize].copy_from_slice(&bytes[..moved as usize]),
        Body::Rendezvous { key, len } => {
            let peer = message.peer;
            let read = if moved > 0 {
                read_into(engine, peer, key, len, &mut buffer[..moved as usize])
            } else {
                Ok(())
            };
            // The sender may let its buffer go, whether the read worked
            // or not (a sender still there must not wait forever).
            let ring = engine.any.ring(message.context, peer);
            engine.any.reads[ring] += 1;
            write_credits(engine, message.context)?;
            read?;
        }
    }
    if len > capacity {
        return Err(Error::Truncated {
            message: len,
            capacity,
        });
    }
    Ok(AnyReceived {
        source: filter.source(message.peer),
        tag: message.tag,
        len,
    })
}

/// Reads `buffer.len()` bytes of the rendezvous message behind window
/// `key` (`len` bytes) of `peer` into `buffer`, zero copy.
fn read_into(
    engine: &mut Engine<'_>,
    peer: u32,
    key: u64,
    len: u64,
    buffer: &mut [u8],
) -> Result<()> {
    let key = RemoteKey::try_from(key).map_err(|_| Error::BadPeerRecord {
        rank: peer,
        why: "an any-source rendezvous entry with key 0".into(),
    })?;
    let port = engine.peer_port(peer);
    let window = pindown_driver::verbs::RemoteWindow {
        node: port.node,
        port: port.port,
        key,
        len,
    };
    let context = engine.context;
    let (addr, capacity) = (buffer.as_ptr() as u64, buffer.len() as u64);
    // SAFETY: `wait_plain_fenced` returns only once the read has finished
    // or its range is fenced off from the device (window cache entries
    // revoked, the range invalidated and deregistered), whatever the
    // outcome; no window is bound on the region; `buffer` stays borrowed
    // until then.
    let region = unsafe { context.register_bytes(buffer)? };
    let tag = engine.read_remote(peer, &region, capacity, window, 0)?;
    wait_plain_fenced(engine, peer, tag, region, addr, capacity).map_err(|err| match err {
        // The sender's window refused the read: its entry named a window
        // it does not have open for this rank.
        Error::Completion(refused) if refused.status == pindown_uapi::Status::RemoteAccessError => {
            Error::BadPeerRecord {
                rank: peer,
                why: format!(
                    "its rendezvous entry names a window that refuses the read: {refused}"
                ),
            }
        }
        other => other,
    })
}

impl<'c> Communicator<'c> {
    /// Sends `data` with `tag` to `dest` in the any-source domain: a
    /// receive there with [`recv_any`](Self::recv_any) takes it, whatever
    /// source it names or not. Apart from [`send`](Self::send) and
    /// [`recv`](Self::recv): messages of one domain never match receives
    /// of the other. Returns once the message is in the receiver's memory
    /// (eager, up to [`ANY_EAGER_BYTES`](layout::ANY_EAGER_BYTES); a
    /// message short enough to travel inline returns once posted, and a
    /// failure of its writes is reported by the next `send_any`) or, for
    /// longer messages, once the receiver has read it (rendezvous: the
    /// receiver reads `data` in place, no copy). Waits, progressing, while
    /// the receiver's ring for this rank is full. Fails with
    /// [`Error::PeerGone`] if `dest` goes away meanwhile.
    pub fn send_any(&self, dest: u32, tag: u32, data: &[u8]) -> Result<()> {
        let peer = self.world_rank(dest)?;
        let context = self.context;
        let mut engine = self.engine();
        engine.check_open()?;
        engine.check_peer(peer)?;
        let len = data.len() as u64;
        if len > layout::MAX_MESSAGE {
            return Err(Error::TooLong {
                len,
                limit: layout::MAX_MESSAGE,
            });
        }
        sweep(&mut engine);
        if let Some(err) = take_unconfirmed_failure(&mut engine) {
            return Err(err);
        }
        let ring = engine.any.ring(context, peer);
        let seq = engine.any.sent[ring] + 1;
        let credit_at = engine.layout.any_credit(context, peer);
        engine.wait_until(Some(peer), None, |e| {
            drain_all(e, context)?;
            let (drained, _) = layout::any_credit_counts(e.load(credit_at));
            // Entries written and not drained: at most the ring, unless
            // the receiver claims entries this rank never wrote.
            let undrained = ((seq - 1) as u32).wrapping_sub(drained);
            if undrained > ANY_ENTRIES as u32 {
                return Err(Error::BadPeerRecord {
                    rank: peer,
                    why: format!(
                        "its credit word says {drained} entries drained (mod 2^32), of {} written",
                        seq - 1
                    ),
                });
            }
            Ok(undrained < ANY_ENTRIES as u32)
        })?;
        let entry = engine.layout.any_entry(context, engine.rank, seq - 1);
        let stamp_at = engine.peer_at(peer, entry);
        let head_at = engine.peer_at(peer, entry + 8);
        let body_at = engine.peer_at(peer, entry + ANY_HEADER_BYTES);
        let ctx = engine.context;
        if len <= ANY_EAGER_BYTES {
            let word = layout::any_message_word(tag, Some(len));
            let mut head = word.to_le_bytes().to_vec();
            if 8 + len <= u64::from(MAX_INLINE) {
                // Every byte goes inline, copied into the send queue: the
                // caller's buffer is free once posted.
                head.extend_from_slice(data);
                let tag = engine.write_entry(peer, &head, head_at, None, seq, stamp_at)?;
                engine.any.sent[ring] = seq;
                engine.any.unconfirmed.push((peer, tag));
                return Ok(());
            }
            // SAFETY: `data` is borrowed for this blocking call, which
            // returns once the write has completed or the device's access
            // to `data` is fenced off (`wait_plain_fenced`).
            let region = unsafe { ctx.register(data.as_ptr() as u64, len)? };
            let body = Some((&region, len as u32, body_at));
            let tag = engine.write_entry(peer, &head, head_at, body, seq, stamp_at)?;
            engine.any.sent[ring] = seq;
            return wait_plain_fenced(&mut engine, peer, tag, region, data.as_ptr() as u64, len);
        }
        // Rendezvous: a read-only window over the send buffer, for the
        // receiver's port alone.
        // SAFETY: `data` is borrowed for this blocking call, and the
        // window (read-only) is revoked before it returns, whatever
        // happens: a revocation is a barrier for the device's accesses.
        let region = unsafe { ctx.register(data.as_ptr() as u64, len)? };
        let window = ctx.bind_region_window(
            region,
            0,
            len,
            Access::REMOTE_READ,
            Some(head_at.port_address()),
        )?;
        let key = window.remote().key;
        let mut exchange = || -> Result<()> {
            let mut head = Vec::with_capacity(24);
            head.extend_from_slice(&layout::any_message_word(tag, None).to_le_bytes());
            head.extend_from_slice(&key.0.to_le_bytes());
            head.extend_from_slice(&len.to_le_bytes());
            let tag = engine.write_entry(peer, &head, head_at, None, seq, stamp_at)?;
            engine.any.sent[ring] = seq;
            engine.any.rendezvous_sent[ring] += 1;
            let number = engine.any.rendezvous_sent[ring] as u32;
            wait_plain(&mut engine, peer, tag)?;
            engine.wait_until(Some(peer), None, |e| {
                drain_all(e, context)?;
                let reads = layout::any_credit_counts(e.load(credit_at)).1;
                // Ahead of the rendezvous messages written (mod 2^32): forged.
                if (reads.wrapping_sub(number) as i32) > 0 {
                    return Err(Error::BadPeerRecord {
                        rank: peer,
                        why: format!(
                            "its credit word says {reads} rendezvous messages read, of {number} written"
                        ),
                    });
                }
                Ok(reads == number)
            })?;
            Ok(())
        };
        let exchanged = exchange();
        // The window goes before `data` does, whatever happened above (the
        // receiver has finished reading, or failed): a device that does
        // not answer is asked again.
        if let Err(err) = window.revoke_waiting() {
            tracing::warn!("revoking a rendezvous window: {err} (the device lets it go)");
        }
        exchanged
    }

    /// Receives a message of the any-source domain (sent with
    /// [`send_any`](Self::send_any)) from `source` (any member if `None`)
    /// with `tag` (any tag if `None`) into `buffer`. Messages of one
    /// (source, tag) arrive in the order they were sent; among senders,
    /// the receives go round robin, so no sender starves.
    ///
    /// A message longer than `buffer` fills it and fails with
    /// [`Error::Truncated`] (the message is consumed; nothing is written
    /// past the buffer). A receive from a named source fails with
    /// [`Error::PeerGone`] once that source is gone and none of its
    /// messages match; a receive from any source fails so only once every
    /// other member is gone.
    pub fn recv_any(
        &self,
        source: Option<u32>,
        tag: Option<u32>,
        buffer: &mut [u8],
    ) -> Result<AnyReceived> {
        let filter = self.any_filter(source, tag)?;
        let mut engine = self.engine();
        // SAFETY: `buffer` is borrowed for this whole call, and the
        // receive is taken back (by `wait_posted`) before it returns.
        let id = unsafe { post(&mut engine, filter, buffer.as_mut_ptr(), buffer.len()) };
        wait_posted(&mut engine, id)
    }

    /// Posts a receive like [`recv_any`](Self::recv_any) and returns at
    /// once; the request gives the buffer back with what arrived. Posted
    /// receives match in the order they were posted (a later receive,
    /// blocking or not, never takes a message an earlier one matches).
    /// Messages are matched when this rank calls into the any-source
    /// domain ([`AnyRecvRequest::test`], [`AnyRecvRequest::wait`],
    /// [`recv_any`](Self::recv_any), [`probe_any`](Self::probe_any)).
    pub fn irecv_any<B>(
        &self,
        source: Option<u32>,
        tag: Option<u32>,
        mut buffer: B,
    ) -> Result<AnyRecvRequest<'c, B>>
    where
        B: StableDeref + DerefMut<Target = [u8]> + 'static,
    {
        let filter = self.any_filter(source, tag)?;
        let mut engine = self.engine();
        // SAFETY: the request owns `buffer` (its bytes do not move:
        // StableDeref) and takes the receive back before it gives the
        // buffer up (`wait`, or drop).
        let id = unsafe { post(&mut engine, filter, buffer.as_mut_ptr(), buffer.len()) };
        Ok(AnyRecvRequest {
            engine: self.engine.clone(),
            id,
            buffer: Some(buffer),
        })
    }

    /// The filter of a receive or probe from `source` with `tag`; fails
    /// after the messenger was finalized.
    fn any_filter(&self, source: Option<u32>, tag: Option<u32>) -> Result<Filter> {
        self.engine().check_open()?;
        Ok(Filter {
            context: self.context,
            peer: source.map(|s| self.world_rank(s)).transpose()?,
            tag,
            members: self.ranks.clone(),
        })
    }

    /// Whether a message of the any-source domain from `source` (any if
    /// `None`) with `tag` (any if `None`) has arrived and waits to be
    /// received; returns at once. The message found is the one the same
    /// [`recv_any`](Self::recv_any) would take next.
    pub fn probe_any(&self, source: Option<u32>, tag: Option<u32>) -> Result<Option<AnyStatus>> {
        let filter = self.any_filter(source, tag)?;
        let mut engine = self.engine();
        engine.progress()?;
        sweep(&mut engine);
        match_posted(&mut engine)?;
        drain_all(&mut engine, self.context)?;
        Ok(engine
            .any
            .unexpected
            .iter()
            .find(|d| filter.matches(d.context, d.peer, d.tag))
            .map(|d| AnyStatus {
                source: filter.source(d.peer),
                tag: d.tag,
                len: d.body.len(),
            }))
    }
}

/// Adds a receive into `capacity` bytes at `ptr` to the posted ones;
/// gives its id.
///
/// # Safety
///
/// `[ptr, ptr + capacity)` stays valid, and untouched by anything but
/// this engine, until the receive is taken back ([`wait_posted`], or
/// [`AnyRecvRequest`]'s wait or drop).
unsafe fn post(engine: &mut Engine<'_>, filter: Filter, ptr: *mut u8, capacity: usize) -> u64 {
    sweep(engine);
    engine.any.posts += 1;
    let id = engine.any.posts;
    engine.any.posted.push(Posted {
        id,
        filter,
        ptr,
        capacity,
        result: None,
    });
    id
}

/// Matches the posted receives, oldest first, against the messages that
/// have arrived (every ring of their contexts drained into the unexpected
/// queue first, so that a message goes to the oldest receive it matches
/// whenever it landed), and delivers what matched.
fn match_posted(engine: &mut Engine<'_>) -> Result<()> {
    let mut contexts: Vec<u32> = engine
        .any
        .posted
        .iter()
        .filter(|p| p.result.is_none())
        .map(|p| p.filter.context)
        .collect();
    if contexts.is_empty() {
        return Ok(());
    }
    contexts.sort_unstable();
    contexts.dedup();
    for context in contexts {
        drain(engine, context, usize::MAX)?;
    }
    let mut posted = std::mem::take(&mut engine.any.posted);
    for receive in posted.iter_mut().filter(|p| p.result.is_none()) {
        let Some(i) = engine
            .any
            .unexpected
            .iter()
            .position(|d| receive.filter.matches(d.context, d.peer, d.tag))
        else {
            continue;
        };
        let message = engine.any.dequeue(i);
        // SAFETY: the owner of a posted receive keeps its buffer valid and
        // to this engine alone until it takes the receive back (see
        // `post`); the engine is borrowed mutably here, so no other
        // reference to the buffer is in use.
        let buffer = unsafe { std::slice::from_raw_parts_mut(receive.ptr, receive.capacity) };
        receive.result = Some(deliver(engine, &receive.filter, message, buffer));
    }
    // Receives posted meanwhile (none: the engine was borrowed) keep
    // their place after these.
    posted.append(&mut engine.any.posted);
    engine.any.posted = posted;
    Ok(())
}

/// The result of posted receive `id`, once matched, taking it back.
fn take_posted(engine: &mut Engine<'_>, id: u64) -> Option<Result<AnyReceived>> {
    let i = engine.any.posted.iter().position(|p| p.id == id)?;
    engine.any.posted[i].result.as_ref()?;
    engine.any.posted.remove(i).result
}

/// Takes posted receive `id` back unmatched (its buffer is the owner's
/// again); nothing if it is gone already.
fn cancel_posted(engine: &mut Engine<'_>, id: u64) {
    engine.any.posted.retain(|p| p.id != id);
}

/// Whether posted receive `id` can no longer match: its named source is
/// gone, or, naming none, every other member is. The error says so.
fn posted_hopeless(engine: &Engine<'_>, id: u64) -> Result<()> {
    let Some(receive) = engine.any.posted.iter().find(|p| p.id == id) else {
        return Ok(());
    };
    if let Some(peer) = receive.filter.peer {
        return engine.check_peer(peer);
    }
    let mut others = receive
        .filter
        .members
        .iter()
        .copied()
        .filter(|&p| p != engine.rank)
        .peekable();
    if others.peek().is_none() {
        return Ok(());
    }
    let mut last = 0;
    for p in others {
        if !engine.peer_gone(p) {
            return Ok(());
        }
        last = p;
    }
    engine.check_peer(last)
}

/// Waits until posted receive `id` is matched and delivered, and takes it
/// back (also when the wait fails).
fn wait_posted(engine: &mut Engine<'_>, id: u64) -> Result<AnyReceived> {
    let Some(receive) = engine.any.posted.iter().find(|p| p.id == id) else {
        return Err(Error::Mismatch(format!(
            "no any-source receive {id} is posted"
        )));
    };
    let peer = receive.filter.peer;
    let others: Vec<u32> = receive
        .filter
        .members
        .iter()
        .copied()
        .filter(|&p| p != engine.rank)
        .collect();
    let interval = engine.config.liveness_interval;
    let mut next_probe = Instant::now() + interval;
    let mut result = None;
    let waited = engine.wait_until(peer, None, |e| {
        match_posted(e)?;
        if let Some(r) = take_posted(e, id) {
            result = Some(r);
            return Ok(true);
        }
        if peer.is_none() {
            posted_hopeless(e, id)?;
            if Instant::now() >= next_probe {
                for &p in &others {
                    if !e.peer_gone(p) {
                        e.watch_peer(p)?;
                    }
                }
                next_probe = Instant::now() + interval;
            }
        }
        Ok(false)
    });
    if let Err(err) = waited {
        cancel_posted(engine, id);
        return Err(err);
    }
    result.expect("a result once ready")
}

/// A nonblocking any-source receive ([`Communicator::irecv_any`]);
/// [`wait`](Self::wait) gives the buffer back with what arrived. Dropping
/// it unfinished takes the receive back (no message is lost: an unmatched
/// message stays for later receives).
pub struct AnyRecvRequest<'c, B: 'static> {
    engine: Shared<'c>,
    id: u64,
    buffer: Option<B>,
}

impl<B: 'static> AnyRecvRequest<'_, B> {
    /// Whether the receive has its message (matching once, without
    /// waiting). Fails with [`Error::PeerGone`] when it never can: its
    /// source is gone (or, naming none, every other member).
    pub fn test(&mut self) -> Result<bool> {
        let mut engine = self.engine.borrow_mut();
        engine.progress()?;
        match_posted(&mut engine)?;
        match engine.any.posted.iter().find(|p| p.id == self.id) {
            Some(receive) if receive.result.is_some() => Ok(true),
            Some(_) => posted_hopeless(&engine, self.id).map(|()| false),
            None => Ok(true),
        }
    }

    /// Waits for the message; gives the buffer back and what arrived. A
    /// message longer than the buffer fills it and fails with
    /// [`Error::Truncated`].
    pub fn wait(mut self) -> Result<(B, AnyReceived)> {
        let result = wait_posted(&mut self.engine.borrow_mut(), self.id);
        let buffer = self.buffer.take().expect("the buffer until wait");
        result.map(|received| (buffer, received))
    }
}

impl<B: 'static> Drop for AnyRecvRequest<'_, B> {
    fn drop(&mut self) {
        match self.engine.try_borrow_mut() {
            Ok(mut engine) => cancel_posted(&mut engine, self.id),
            // The engine is in use (a panic unwinding through a call):
            // keep the buffer alive rather than let a later match write
            // freed memory.
            Err(_) => {
                if let Some(buffer) = self.buffer.take() {
                    std::mem::forget(buffer);
                }
            }
        }
    }
}
