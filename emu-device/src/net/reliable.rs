//! The reliable-datagram endpoint: one per device process, serving all its
//! peers. A state machine with no I/O of its own; see the [module
//! docs](super) for the protocol.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::wire::{seq_at_or_before, seq_before, Header, StreamHeader, WireError, HEADER_LEN};
use super::{NodeId, Seq};

/// The two sequence spaces between two peers, each direction.
///
/// Requests ([`Endpoint::send`]) may be answered, replies
/// ([`Endpoint::send_reply`]) never are. Each stream has its own sequence
/// numbers, window and acknowledgements, so replies never wait behind
/// requests: a request is delivered only when replies to it can be queued
/// at once, and replies are always delivered, so neither stream can block
/// the other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Stream {
    /// Messages that may be answered.
    Request,
    /// Messages that are never answered (operation results).
    Reply,
}

impl Stream {
    /// Both streams.
    pub const ALL: [Stream; 2] = [Stream::Request, Stream::Reply];

    fn index(self) -> usize {
        match self {
            Stream::Request => 0,
            Stream::Reply => 1,
        }
    }
}

/// Who this endpoint is on the fabric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Identity {
    /// Job token every device of the fabric shares (ACP's TASK field);
    /// datagrams carrying another token are dropped.
    pub fabric: u64,
    /// This device's node number.
    pub node: NodeId,
    /// Random, nonzero, new at every device start: peers tell a restarted
    /// device from its previous life by it.
    pub incarnation: u64,
}

impl Identity {
    /// An identity with a fresh incarnation from the system's random
    /// source.
    pub fn with_random_incarnation(fabric: u64, node: NodeId) -> Result<Self, getrandom::Error> {
        loop {
            let incarnation = getrandom::u64()?;
            if incarnation != 0 {
                return Ok(Self {
                    fabric,
                    node,
                    incarnation,
                });
            }
        }
    }
}

/// Tunables of an [`Endpoint`]; [`Config::default`] gives the defaults
/// documented on each field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Config {
    /// Smallest retransmission timeout (default 100 us).
    pub rto_min: Duration,
    /// Largest retransmission timeout, where the backoff stops (default
    /// 100 ms; at most [`Config::RTO_LIMIT`]).
    pub rto_max: Duration,
    /// Retransmission timeout before the first round-trip sample (default
    /// 1 ms), clamped to `rto_min..=rto_max`.
    pub rto_initial: Duration,
    /// A peer that makes no acknowledgement progress for this long while
    /// messages to it are outstanding is declared gone (default 3 s).
    pub peer_timeout: Duration,
    /// Largest span of unacknowledged sequence numbers per peer and
    /// stream: a message is refused while `next seq - oldest
    /// unacknowledged seq` reaches it (default and maximum 64, the
    /// receiver's selective-ack window).
    pub window: u32,
    /// Messages held for retransmission, shared by all peers (default
    /// 512); the pool is allocated once.
    pub pool_slots: usize,
    /// Largest message (default [`Config::MTU_PAYLOAD`], 1376 bytes, so a
    /// datagram fits a 1500-byte MTU under IPv6 and UDP headers).
    pub max_payload: usize,
    /// A message is retransmitted at once (once) when this many later
    /// messages were selectively acknowledged (default 3).
    pub fast_retransmit_threshold: u32,
    /// How long an acknowledgement may wait for reverse data to ride on
    /// before it goes out alone (default 20 us).
    pub ack_delay: Duration,
    /// Room kept for replies: a new request is delivered only when this
    /// many replies to its sender could be sent right away (reply window
    /// and pool); otherwise it is dropped ([`DropReason::NoResponseRoom`])
    /// and its sender retransmits it later. Requests leave this much of the
    /// pool free. Replies are always delivered, so the room comes back, and
    /// the horizon rule (module docs) holds for requests answered by at
    /// most this many replies. Default 1; 0 turns the check off. At most
    /// `window`, below `pool_slots`.
    pub response_reserve: u32,
}

impl Config {
    /// Largest `window`: the width of the selective-ack bitmap.
    pub const MAX_WINDOW: u32 = 64;
    /// Largest `pool_slots` (slot numbers are 16-bit).
    pub const MAX_POOL_SLOTS: usize = u16::MAX as usize - 1;
    /// The largest message whose datagram fits a 1500-byte Ethernet MTU
    /// with an IPv6 (40 bytes) and a UDP (8 bytes) header: 1376 bytes.
    pub const MTU_PAYLOAD: usize = 1500 - 40 - 8 - HEADER_LEN;
    /// Largest `rto_max` (timeouts count whole microseconds, rounded up;
    /// the round-trip estimate is kept in 23 bits of microseconds and the
    /// backoff in 5 bits).
    pub const RTO_LIMIT: Duration = Duration::from_secs(4);
    /// Largest `ack_delay` (a pending acknowledgement's due time is kept
    /// in 32 bits of microseconds, which wrap every 71.6 minutes).
    pub const ACK_DELAY_LIMIT: Duration = Duration::from_secs(4);

    /// Checks the values against each other and the limits.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let fail = |what: &'static str| Err(ConfigError(what));
        if self.rto_min.is_zero() || self.rto_min > self.rto_max {
            return fail("rto_min must be nonzero and at most rto_max");
        }
        if self.rto_max > Self::RTO_LIMIT {
            return fail("rto_max must be at most 4 s");
        }
        if self.peer_timeout.is_zero() {
            return fail("peer_timeout must be nonzero");
        }
        if self.window == 0 || self.window > Self::MAX_WINDOW {
            return fail("window must be 1 to 64");
        }
        if self.pool_slots == 0 || self.pool_slots > Self::MAX_POOL_SLOTS {
            return fail("pool_slots must be 1 to 65534");
        }
        if self.max_payload == 0 || self.max_payload > usize::from(u16::MAX) - HEADER_LEN {
            return fail("max_payload must be 1 to 65475");
        }
        if self.response_reserve > self.window
            || usize::try_from(self.response_reserve)
                .map_or(true, |reserve| reserve >= self.pool_slots)
        {
            return fail("response_reserve must be at most window and below pool_slots");
        }
        if self.fast_retransmit_threshold == 0 {
            return fail("fast_retransmit_threshold must be nonzero");
        }
        if self.ack_delay > Self::ACK_DELAY_LIMIT {
            return fail("ack_delay must be at most 4 s");
        }
        Ok(())
    }
}

impl Default for Config {
    fn default() -> Self {
        Self {
            rto_min: Duration::from_micros(100),
            rto_max: Duration::from_millis(100),
            rto_initial: Duration::from_millis(1),
            peer_timeout: Duration::from_secs(3),
            window: 64,
            pool_slots: 512,
            max_payload: Self::MTU_PAYLOAD,
            fast_retransmit_threshold: 3,
            ack_delay: Duration::from_micros(20),
            response_reserve: 1,
        }
    }
}

/// An invalid [`Config`] or [`Identity`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("invalid network configuration: {0}")]
pub struct ConfigError(pub &'static str);

/// Why [`Endpoint::add_peer`] refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AddPeerError {
    /// The node is this endpoint itself.
    #[error("node {0} is this endpoint")]
    Myself(NodeId),
    /// The node is a peer already.
    #[error("node {0} is a peer already")]
    Duplicate(NodeId),
}

/// Why [`Endpoint::send`] refused a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SendError {
    /// The node is not a peer.
    #[error("node {0} is not a peer")]
    UnknownPeer(NodeId),
    /// The message is longer than `max_payload`.
    #[error("message of {len} bytes is longer than {max}")]
    TooLarge {
        /// The message's length.
        len: usize,
        /// The largest allowed.
        max: usize,
    },
    /// The peer's window is full: retry once acknowledgements arrive.
    #[error("the window to the peer is full")]
    WindowFull,
    /// The shared retransmission pool is full: retry once
    /// acknowledgements arrive.
    #[error("the retransmission pool is full")]
    PoolFull,
    /// A reply to a peer declared gone (a new message probes it instead).
    #[error("node {0} is gone")]
    PeerGone(NodeId),
}

impl SendError {
    /// `true` for the refusals that pass once acknowledgements arrive.
    pub fn is_would_block(&self) -> bool {
        matches!(self, SendError::WindowFull | SendError::PoolFull)
    }
}

/// Why [`Endpoint::receive`] dropped a datagram (each counted in
/// [`Stats`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum DropReason {
    /// Not a datagram of this format.
    #[error("malformed: {0}")]
    Malformed(WireError),
    /// A payload longer than `max_payload`.
    #[error("payload longer than the largest message")]
    Oversized,
    /// Another fabric's job token.
    #[error("wrong fabric token")]
    WrongFabric,
    /// Addressed to another node.
    #[error("addressed to another node")]
    WrongDestination,
    /// From a node that is not a peer.
    #[error("from a node that is not a peer")]
    UnknownSource,
    /// Addressed to a previous incarnation of this device, or from a
    /// retired incarnation of the peer.
    #[error("stale incarnation")]
    StaleIncarnation,
    /// Acknowledges sequence numbers never sent.
    #[error("acknowledges messages never sent")]
    BadAck,
    /// The message was delivered before (its acknowledgements were
    /// applied).
    #[error("duplicate message")]
    Duplicate,
    /// The message lies beyond the receive window (its acknowledgements
    /// were applied; the sender retransmits it).
    #[error("message beyond the receive window")]
    BeyondWindow,
    /// A message from a peer that does not know this incarnation yet
    /// (destination incarnation 0). It is not delivered: a previous
    /// incarnation of this node may have delivered it already, and each
    /// message must be delivered by at most one incarnation. The
    /// acknowledgement sent back introduces this incarnation, and the
    /// sender retransmits at once, naming it.
    #[error("message from a peer that does not know this incarnation yet")]
    NotYetIntroduced,
    /// From an incarnation of the peer not heard from before, which does
    /// not know this one yet: perhaps the peer's new life, perhaps a late
    /// or forged datagram of a life that will never answer. It is proposed
    /// as the peer's next incarnation and introduced to (a pure
    /// acknowledgement naming it that acknowledges nothing); the peer
    /// changes only when it answers naming this incarnation.
    #[error("from an incarnation of the peer that is not confirmed yet")]
    UnconfirmedIncarnation,
    /// A new request that was not delivered because fewer than
    /// `response_reserve` replies could be sent back to its sender now (its
    /// acknowledgements were applied; the sender retransmits it).
    #[error("no room to respond to the message")]
    NoResponseRoom,
}

/// A message handed over by [`Endpoint::receive`], borrowed from the
/// datagram passed in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Message<'a> {
    /// The sender.
    pub node: NodeId,
    /// Its stream: a request may be answered, a reply is not.
    pub stream: Stream,
    /// Its sequence number in that stream from that sender.
    pub seq: Seq,
    /// Its bytes.
    pub payload: &'a [u8],
}

/// What happened, in the order it happened; taken with
/// [`Endpoint::poll_event`].
///
/// Every `seq` [`Endpoint::send`] or [`Endpoint::send_reply`] returned
/// ends in exactly one [`Event::Acked`] or one [`Event::Abandoned`] of its
/// stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// `seq` of `stream` sent to `node` was delivered there. `horizon` is
    /// the peer's next unassigned reply seq towards this endpoint when it
    /// built the acknowledgement: every reply it queued in response to a
    /// request has a seq below `horizon`, so they have all been delivered
    /// here once [`Endpoint::delivered_through`] of the reply stream
    /// reaches `horizon`.
    Acked {
        /// The peer.
        node: NodeId,
        /// The acknowledged message's stream.
        stream: Stream,
        /// The acknowledged message.
        seq: Seq,
        /// See above.
        horizon: Seq,
    },
    /// `seq` sent to `node` will not be retransmitted: the peer was
    /// declared gone or restarted (that event follows). It may or may not
    /// have been delivered.
    Abandoned {
        /// The peer.
        node: NodeId,
        /// The message's stream.
        stream: Stream,
        /// The message given up.
        seq: Seq,
    },
    /// `node` made no acknowledgement progress for `peer_timeout` while
    /// messages were outstanding; they were abandoned (reported just
    /// before); `send_reply` to it fails until it is heard from again, and
    /// `send` probes it.
    PeerGone {
        /// The peer.
        node: NodeId,
    },
    /// `node` came back with a new incarnation: messages outstanding to the
    /// old one were abandoned (reported just before), and sequence numbers
    /// in both directions start again from 0.
    PeerRestarted {
        /// The peer.
        node: NodeId,
    },
    /// `node` gave up on its messages of `stream` with seqs in
    /// `from..until` that were not delivered yet (`missing` of them) — it
    /// declared this endpoint gone. [`Endpoint::delivered_through`] jumped
    /// to `until`; replies awaited below it will not come.
    PeerAbandoned {
        /// The peer.
        node: NodeId,
        /// The stream.
        stream: Stream,
        /// The first seq given up.
        from: Seq,
        /// The seq after the last one given up.
        until: Seq,
        /// How many in `from..until` were never delivered.
        missing: u32,
    },
}

/// Counters of an endpoint; they only grow.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Messages accepted by `send`.
    pub messages_sent: u64,
    /// Datagrams handed out by `poll_transmit` (data and pure acks).
    pub datagrams_sent: u64,
    /// First transmissions of messages.
    pub first_transmissions: u64,
    /// Retransmissions of messages (timeout and fast).
    pub retransmissions: u64,
    /// Retransmissions queued by a fast retransmit.
    pub fast_retransmits: u64,
    /// Retransmission timer expiries that retransmitted something.
    pub timeouts: u64,
    /// Messages sent again because the peer echoed a later timeout probe
    /// and had not acknowledged them (lost before it).
    pub lost_before_probe: u64,
    /// Pure acknowledgements sent.
    pub acks_sent: u64,
    /// Datagrams fed to `receive`.
    pub datagrams_received: u64,
    /// Messages delivered (handed out by `receive`).
    pub messages_delivered: u64,
    /// Messages received again after delivery.
    pub duplicates: u64,
    /// Messages dropped beyond the receive window.
    pub beyond_window: u64,
    /// New messages dropped for want of room to respond.
    pub no_response_room: u64,
    /// Messages dropped because their sender did not know this
    /// incarnation yet.
    pub not_yet_introduced: u64,
    /// Datagrams not of this format, or oversized.
    pub malformed: u64,
    /// Datagrams of another fabric.
    pub wrong_fabric: u64,
    /// Datagrams addressed to another node.
    pub wrong_destination: u64,
    /// Datagrams from nodes that are not peers.
    pub unknown_source: u64,
    /// Datagrams for a previous incarnation of this device or from a
    /// retired incarnation of a peer.
    pub stale_incarnation: u64,
    /// Datagrams from an incarnation of a peer not heard from before that
    /// did not know this one ([`DropReason::UnconfirmedIncarnation`]).
    pub unconfirmed_incarnation: u64,
    /// Datagrams acknowledging messages never sent.
    pub bad_acks: u64,
    /// Messages acknowledged (`Event::Acked`).
    pub acked: u64,
    /// Messages abandoned (`Event::Abandoned`).
    pub abandoned: u64,
    /// Messages peers gave up on before delivering them here.
    pub peer_abandoned: u64,
    /// `Event::PeerGone` emitted.
    pub peers_gone: u64,
    /// `Event::PeerRestarted` emitted.
    pub peers_restarted: u64,
}

/// What an endpoint's state costs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryReport {
    /// Bytes independent of the number of peers, the pool included.
    pub fixed_bytes: usize,
    /// Of which the retransmission pool (slots and payload bytes).
    pub pool_bytes: usize,
    /// Bytes of state per peer (its record, its node number, its index
    /// entry and its possible ack-queue entry, not counting the hash
    /// table's spare capacity). The timers that run while messages are
    /// outstanding are kept with those messages, in the pool.
    pub per_peer_bytes: usize,
    /// Peers now.
    pub peers: usize,
}

impl MemoryReport {
    /// Fixed bytes plus the bytes of the current peers.
    pub fn total(&self) -> usize {
        self.fixed_bytes + self.per_peer_bytes * self.peers
    }
}

/// "No slot" in slot links.
const NO_SLOT: u16 = u16::MAX;
/// "Not armed" / "not yet" for times, in microseconds since the epoch.
const NEVER: u64 = u64::MAX;
/// Retired incarnations remembered (see the module docs).
const RETIRED_INCARNATIONS: usize = 64;
/// Proposed incarnations remembered (see the module docs).
const PROPOSED_INCARNATIONS: usize = 64;
/// Internal times are microseconds since the epoch; a pending
/// acknowledgement's due time keeps only their low 32 bits, a clock that
/// wraps after this long.
#[cfg(test)]
pub(super) const ACK_CLOCK_PERIOD: Duration = Duration::from_micros(1 << 32);

/// Slot flags.
const SLOT_IN_USE: u8 = 1;
/// The slot waits in the transmit queue.
const SLOT_QUEUED: u8 = 2;
/// The message was sent more than once: no round-trip sample (Karn).
const SLOT_RETRANSMITTED: u8 = 4;
/// The message had its one fast retransmit.
const SLOT_FAST_RETRANSMITTED: u8 = 8;
/// The message is a reply.
const SLOT_REPLY: u8 = 16;
/// The message's next transmission is the probe of a retransmission
/// timeout ([`wire::FLAG_PROBE`](super::wire::FLAG_PROBE)).
const SLOT_PROBE: u8 = 32;

/// The timers of a peer that only run while messages to it are
/// outstanding. They live in the peer's anchor slot (see
/// [`Endpoint::anchor`]), so they cost nothing per peer: the pool is
/// allocated once, and a peer with nothing outstanding has no timers.
#[derive(Debug, Clone, Copy)]
struct OutstandingTimers {
    /// When acknowledgement progress was last made, or the first message
    /// became outstanding, us since the epoch; the peer is gone
    /// `peer_timeout` later.
    progress_at: u64,
    /// When the retransmission timer fires, us since the epoch; `NEVER`
    /// when not armed.
    rto_deadline: u64,
    /// When the earliest probe the peer has not echoed yet was queued, us
    /// since the epoch; `NEVER` when none waits for its echo.
    probe_at: u64,
}

/// One message held for retransmission. Its bytes are in the payload
/// area at `index * max_payload`.
#[derive(Debug, Clone, Copy)]
struct Slot {
    /// Bumped at every allocation, so stale transmit-queue entries are
    /// recognised.
    generation: u32,
    seq: Seq,
    /// First transmission, us since the epoch; `NEVER` until sent.
    first_sent: u64,
    /// Latest transmission, us since the epoch; `NEVER` until sent.
    last_sent: u64,
    /// The peer's timers while this slot is its anchor; stale otherwise.
    timers: OutstandingTimers,
    peer: u16,
    len: u16,
    /// Links of the peer's circular list of unacknowledged messages in
    /// seq order (or of the free list, through `next`).
    prev: u16,
    next: u16,
    flags: u8,
}

// The limits fit the fields: the backoff doubles `rto_min` (at least 1 us)
// at most log2(RTO_LIMIT in us) times, and an acknowledgement's due time
// lies less than half the 32-bit microsecond clock ahead.
const _: () = assert!(
    Config::RTO_LIMIT.as_micros() < 1 << ((1 << PeerBits::BACKOFF.width) - 1)
        && Config::RTO_LIMIT.as_micros() <= PeerBits::RTT_MAX as u128
        && Config::ACK_DELAY_LIMIT.as_micros() < 1 << 31
);

/// A bit field of [`PeerBits`]: `width` bits from bit `shift`.
#[derive(Debug, Clone, Copy)]
struct BitField {
    shift: u32,
    width: u32,
}

impl BitField {
    const fn after(previous: BitField, width: u32) -> BitField {
        BitField {
            shift: previous.shift + previous.width,
            width,
        }
    }

    const fn mask(self) -> u64 {
        ((1u64 << self.width) - 1) << self.shift
    }
}

/// The round-trip estimate and the flags of a peer, packed in 64 bits.
#[derive(Debug, Clone, Copy, Default)]
struct PeerBits(u64);

impl PeerBits {
    /// Smoothed round-trip time, us; 0 = no sample yet.
    const SRTT: BitField = BitField {
        shift: 0,
        width: 23,
    };
    /// Round-trip time variation, us.
    const RTTVAR: BitField = BitField::after(Self::SRTT, 23);
    /// Timeouts since the last fresh round-trip sample that doubled the
    /// retransmission timeout (at most 22: `rto_min` is at least 1 us and
    /// `rto_max` at most [`Config::RTO_LIMIT`], below 2^22 us).
    const BACKOFF: BitField = BitField::after(Self::RTTVAR, 5);
    /// Declared gone.
    const GONE: BitField = BitField::after(Self::BACKOFF, 1);
    /// A pure acknowledgement is owed, due at `Peer::ack_due`.
    const ACK_OWED: BitField = BitField::after(Self::GONE, 1);
    /// The peer has an entry in the ack queue.
    const ACK_QUEUED: BitField = BitField::after(Self::ACK_OWED, 1);
    /// A timeout probe from the peer arrived: the next datagram to it
    /// echoes it ([`wire::FLAG_PROBE_ECHO`](super::wire::FLAG_PROBE_ECHO)).
    const PROBE_SEEN: BitField = BitField::after(Self::ACK_QUEUED, 1);
    /// The peer's recorded incarnation addressed an earlier life of this
    /// endpoint: the next datagram from the ack queue introduces this one to
    /// it ([`Endpoint::introduction`]).
    const INTRODUCE: BitField = BitField::after(Self::PROBE_SEEN, 1);
    /// The largest round-trip time the estimate holds, us (8.4 s).
    const RTT_MAX: u64 = (1 << Self::SRTT.width) - 1;

    fn get(self, field: BitField) -> u32 {
        ((self.0 & field.mask()) >> field.shift) as u32
    }

    fn set(&mut self, field: BitField, value: u32) {
        let value = u64::from(value) << field.shift;
        debug_assert_eq!(value & !field.mask(), 0, "{value} overflows {field:?}");
        self.0 = (self.0 & !field.mask()) | (value & field.mask());
    }

    fn is(self, flag: BitField) -> bool {
        self.get(flag) != 0
    }

    fn set_flag(&mut self, flag: BitField, on: bool) {
        self.set(flag, u32::from(on));
    }
}

/// Everything kept per peer: 56 bytes (with its node number, index entry
/// and possible ack-queue entry, 64; asserted in the tests). Arrays are
/// indexed by [`Stream::index`]. The timers that run only while messages
/// are outstanding are in the pool ([`OutstandingTimers`]).
#[derive(Debug, Clone, Copy)]
struct Peer {
    /// The peer's incarnation; 0 = not heard from yet.
    incarnation: u64,
    /// Receive side: bit `i` = seq `recv_next + 1 + i` was delivered.
    recv_sack: [u64; 2],
    /// Round-trip estimate, backoff, flags.
    bits: PeerBits,
    /// Receive side: every seq below it was delivered (or abandoned by
    /// the peer).
    recv_next: [Seq; 2],
    /// Send side: the next unassigned seq.
    send_next: [Seq; 2],
    /// When the owed pure acknowledgement is due (valid with
    /// `PeerBits::ACK_OWED`): the low 32 bits of us since the epoch. It
    /// lies at most `ack_delay` after the time it was set, which tells
    /// which wrap it belongs to ([`Endpoint::ack_due_at`]).
    ack_due: u32,
    /// Oldest unacknowledged message; `NO_SLOT` when none.
    unacked_head: [u16; 2],
}

impl Peer {
    fn new() -> Self {
        Self {
            incarnation: 0,
            recv_sack: [0; 2],
            bits: PeerBits::default(),
            recv_next: [0; 2],
            send_next: [0; 2],
            ack_due: 0,
            unacked_head: [NO_SLOT; 2],
        }
    }

    fn is_gone(&self) -> bool {
        self.bits.is(PeerBits::GONE)
    }
}

/// A peer incarnation replaced by a newer one, remembered so that its late
/// datagrams cannot reset the peer again; or one proposed as the peer's
/// next, waiting for its answer to our introduction.
#[derive(Debug, Clone, Copy)]
struct RemoteIncarnation {
    node: NodeId,
    incarnation: u64,
    /// When it was retired or proposed, us since the epoch.
    at: u64,
    /// A proposed one is owed an introduction.
    introduce: bool,
}

/// The last few [`RemoteIncarnation`]s of one kind, in a fixed ring (the
/// oldest is overwritten).
#[derive(Debug)]
struct IncarnationRing {
    entries: Vec<RemoteIncarnation>,
    capacity: usize,
    cursor: usize,
}

impl IncarnationRing {
    fn new(capacity: usize) -> Self {
        Self {
            entries: Vec::with_capacity(capacity),
            capacity,
            cursor: 0,
        }
    }

    /// Remembers `incarnation` of `node` from `now` on (`introduce`: it is
    /// owed an introduction).
    fn remember(&mut self, node: NodeId, incarnation: u64, now: u64, introduce: bool) {
        let entry = RemoteIncarnation {
            node,
            incarnation,
            at: now,
            introduce,
        };
        if let Some(same) = self
            .entries
            .iter_mut()
            .find(|e| e.node == node && e.incarnation == incarnation)
        {
            *same = entry;
        } else if self.entries.len() < self.capacity {
            self.entries.push(entry);
        } else {
            self.entries[self.cursor] = entry;
            self.cursor = (self.cursor + 1) % self.capacity;
        }
    }

    /// Whether `incarnation` of `node` was remembered less than `lifetime`
    /// before `now`.
    fn holds(&self, node: NodeId, incarnation: u64, now: u64, lifetime: u64) -> bool {
        self.entries.iter().any(|e| {
            e.node == node && e.incarnation == incarnation && now.saturating_sub(e.at) < lifetime
        })
    }

    /// An entry owed an introduction, which it no longer is.
    fn take_introduction(&mut self) -> Option<(NodeId, u64)> {
        let entry = self.entries.iter_mut().find(|e| e.introduce)?;
        entry.introduce = false;
        Some((entry.node, entry.incarnation))
    }

    /// Forgets `incarnation` of `node`.
    fn forget(&mut self, node: NodeId, incarnation: u64) {
        for e in &mut self.entries {
            if e.node == node && e.incarnation == incarnation {
                // Never held again: older than any lifetime.
                e.at = 0;
                e.incarnation = 0;
                e.introduce = false;
            }
        }
    }

    /// Bytes of its fixed allocation.
    fn bytes(&self) -> usize {
        self.entries.capacity() * std::mem::size_of::<RemoteIncarnation>()
    }
}

/// A duration in whole microseconds, rounded up (so a nonzero duration
/// stays nonzero), saturating.
fn micros_u64(duration: Duration) -> u64 {
    u64::try_from(duration.as_nanos().div_ceil(1000)).unwrap_or(u64::MAX)
}

/// [`micros_u64`] for durations checked to fit (timeouts of at most
/// [`Config::RTO_LIMIT`]).
fn micros_u32(duration: Duration) -> u32 {
    u32::try_from(micros_u64(duration)).unwrap_or(u32::MAX)
}

/// `value >> shift`, 0 when `shift` is 64 or more.
fn shift_right(value: u64, shift: u32) -> u64 {
    value.checked_shr(shift).unwrap_or(0)
}

/// The reliable-datagram protocol state of one device towards all its
/// peers; see the [module docs](super).
#[derive(Debug)]
pub struct Endpoint {
    identity: Identity,
    config: Config,
    /// The instant all internal times count from: the first `now` seen.
    epoch: Option<Instant>,
    /// The latest `now` seen, us since the epoch.
    latest: u64,
    peers: Vec<Peer>,
    peer_nodes: Vec<NodeId>,
    /// Each peer's index by node, sorted by node (found by binary search:
    /// 4 bytes a peer, where a hash map takes 10 at its load factor).
    peer_index: Vec<(NodeId, u16)>,
    slots: Vec<Slot>,
    /// `pool_slots * max_payload` bytes, allocated once.
    payloads: Box<[u8]>,
    free_head: u16,
    free_slots: usize,
    /// Messages to (re)transmit, oldest first, as (slot, generation).
    transmit_queue: VecDeque<(u16, u32)>,
    /// Peers owing a pure acknowledgement, in the order it became due.
    ack_queue: VecDeque<u16>,
    events: VecDeque<Event>,
    /// Incarnations of peers replaced by newer ones.
    retired: IncarnationRing,
    /// Incarnations proposed as a peer's next (`at`: when proposed).
    proposed: IncarnationRing,
    /// Some proposed incarnation may be owed an introduction.
    introductions_owed: bool,
    stats: Stats,
    /// The timeouts of `config` in us.
    rto_min: u32,
    rto_max: u32,
    rto_initial: u32,
    peer_timeout: u64,
    ack_delay: u64,
}

impl Endpoint {
    /// An endpoint with no peers. Fails on an invalid `config` or a zero
    /// incarnation.
    pub fn new(identity: Identity, config: Config) -> Result<Self, ConfigError> {
        config.validate()?;
        if identity.incarnation == 0 {
            return Err(ConfigError("the incarnation must be nonzero"));
        }
        let slots = (0..config.pool_slots)
            .map(|index| Slot {
                generation: 0,
                seq: 0,
                first_sent: NEVER,
                last_sent: NEVER,
                timers: OutstandingTimers {
                    progress_at: NEVER,
                    rto_deadline: NEVER,
                    probe_at: NEVER,
                },
                peer: 0,
                len: 0,
                prev: NO_SLOT,
                // The free list chains through `next` (checked in `validate`:
                // every index fits in u16 below NO_SLOT).
                next: if index + 1 < config.pool_slots {
                    (index + 1) as u16
                } else {
                    NO_SLOT
                },
                flags: 0,
            })
            .collect();
        let rto_min = micros_u32(config.rto_min);
        let rto_max = micros_u32(config.rto_max);
        Ok(Self {
            identity,
            config,
            epoch: None,
            latest: 0,
            peers: Vec::new(),
            peer_nodes: Vec::new(),
            peer_index: Vec::new(),
            slots,
            payloads: vec![0u8; config.pool_slots * config.max_payload].into_boxed_slice(),
            free_head: 0,
            free_slots: config.pool_slots,
            transmit_queue: VecDeque::with_capacity(config.pool_slots),
            ack_queue: VecDeque::new(),
            events: VecDeque::new(),
            retired: IncarnationRing::new(RETIRED_INCARNATIONS),
            proposed: IncarnationRing::new(PROPOSED_INCARNATIONS),
            introductions_owed: false,
            stats: Stats::default(),
            rto_min,
            rto_max,
            rto_initial: micros_u32(config.rto_initial).clamp(rto_min, rto_max),
            peer_timeout: micros_u64(config.peer_timeout),
            ack_delay: micros_u64(config.ack_delay),
        })
    }

    /// This endpoint's identity.
    pub fn identity(&self) -> &Identity {
        &self.identity
    }

    /// Its configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The buffer size `poll_transmit` needs: header plus largest message.
    pub fn max_datagram_len(&self) -> usize {
        HEADER_LEN + self.config.max_payload
    }

    /// Makes `node` a peer: datagrams from it are accepted, messages to it
    /// can be sent. Addresses are the caller's business.
    pub fn add_peer(&mut self, node: NodeId) -> Result<(), AddPeerError> {
        if node == self.identity.node {
            return Err(AddPeerError::Myself(node));
        }
        let Err(at) = self.peer_index.binary_search_by_key(&node, |&(n, _)| n) else {
            return Err(AddPeerError::Duplicate(node));
        };
        // At most 65535 other nodes exist, so the index fits in u16.
        let index = self.peers.len() as u16;
        self.peers.push(Peer::new());
        self.peer_nodes.push(node);
        self.peer_index.insert(at, (node, index));
        Ok(())
    }

    /// `now` in us since the epoch (whole microseconds, rounded down).
    fn clock(&mut self, now: Instant) -> u64 {
        let epoch = *self.epoch.get_or_insert(now);
        let micros =
            u64::try_from(now.saturating_duration_since(epoch).as_micros()).unwrap_or(u64::MAX - 1);
        self.latest = self.latest.max(micros);
        micros
    }

    fn instant(&self, micros: u64) -> Option<Instant> {
        self.epoch
            .map(|epoch| epoch + Duration::from_micros(micros))
    }

    fn peer_of(&self, node: NodeId) -> Option<usize> {
        self.peer_index
            .binary_search_by_key(&node, |&(n, _)| n)
            .ok()
            .map(|at| usize::from(self.peer_index[at].1))
    }

    /// Queues a request of at most `max_payload` bytes for reliable
    /// delivery to `node`; returns its seq in the request stream. The
    /// receiver may answer it with up to `response_reserve` replies; it is
    /// delivered only when there is room for them. Requests leave
    /// `response_reserve` slots of the pool free.
    pub fn send(&mut self, now: Instant, node: NodeId, payload: &[u8]) -> Result<Seq, SendError> {
        self.send_message(now, node, payload, Stream::Request)
    }

    /// Queues a reply: a message its receiver does not answer (an
    /// operation's result); returns its seq in the reply stream. Its
    /// receiver always delivers it, and it may use the whole pool.
    pub fn send_reply(
        &mut self,
        now: Instant,
        node: NodeId,
        payload: &[u8],
    ) -> Result<Seq, SendError> {
        self.send_message(now, node, payload, Stream::Reply)
    }

    fn send_message(
        &mut self,
        now: Instant,
        node: NodeId,
        payload: &[u8],
        stream: Stream,
    ) -> Result<Seq, SendError> {
        let now = self.clock(now);
        let peer_index = self.peer_of(node).ok_or(SendError::UnknownPeer(node))?;
        if payload.len() > self.config.max_payload {
            return Err(SendError::TooLarge {
                len: payload.len(),
                max: self.config.max_payload,
            });
        }
        let s = stream.index();
        if self.peers[peer_index].is_gone() {
            if stream == Stream::Reply {
                // It answers a message of a peer given up on.
                return Err(SendError::PeerGone(node));
            }
            // A new message probes a peer declared gone: it is tried (and
            // given up after `peer_timeout`) like any other, so a peer
            // that comes back, or restarted and answers our stale
            // datagram, is heard from.
            self.peers[peer_index].bits.set_flag(PeerBits::GONE, false);
        }
        let peer = &self.peers[peer_index];
        let in_window = peer.send_next[s].wrapping_sub(self.floor(peer_index, s));
        if in_window >= self.config.window {
            return Err(SendError::WindowFull);
        }
        let kept_free = match stream {
            Stream::Request => self.config.response_reserve as usize,
            Stream::Reply => 0,
        };
        if self.free_slots < 1 + kept_free {
            return Err(SendError::PoolFull);
        }
        let slot_index = self.free_head;
        let slot = &mut self.slots[usize::from(slot_index)];
        self.free_head = slot.next;
        self.free_slots -= 1;
        let seq = self.peers[peer_index].send_next[s];
        slot.generation = slot.generation.wrapping_add(1);
        slot.seq = seq;
        slot.first_sent = NEVER;
        slot.last_sent = NEVER;
        slot.peer = peer_index as u16;
        slot.len = payload.len() as u16;
        slot.flags = SLOT_IN_USE
            | SLOT_QUEUED
            | match stream {
                Stream::Request => 0,
                Stream::Reply => SLOT_REPLY,
            };
        let generation = slot.generation;
        let start = usize::from(slot_index) * self.config.max_payload;
        self.payloads[start..start + payload.len()].copy_from_slice(payload);

        self.peers[peer_index].send_next[s] = seq.wrapping_add(1);
        self.list_push_back(peer_index, s, slot_index, now);
        self.transmit_queue.push_back((slot_index, generation));
        self.stats.messages_sent += 1;
        Ok(seq)
    }

    /// Every seq of ours in stream `s` below this is acknowledged or
    /// abandoned.
    fn floor(&self, peer_index: usize, s: usize) -> Seq {
        let peer = &self.peers[peer_index];
        if peer.unacked_head[s] == NO_SLOT {
            peer.send_next[s]
        } else {
            self.slots[usize::from(peer.unacked_head[s])].seq
        }
    }

    fn slot_stream(slot: &Slot) -> usize {
        if slot.flags & SLOT_REPLY != 0 {
            Stream::Reply.index()
        } else {
            Stream::Request.index()
        }
    }

    /// The slot that holds the peer's [`OutstandingTimers`]: its oldest
    /// unacknowledged request, else its oldest unacknowledged reply;
    /// `None` when nothing is outstanding.
    fn anchor(&self, peer_index: usize) -> Option<u16> {
        let heads = self.peers[peer_index].unacked_head;
        heads.into_iter().find(|&head| head != NO_SLOT)
    }

    fn timers(&self, peer_index: usize) -> Option<OutstandingTimers> {
        self.anchor(peer_index)
            .map(|anchor| self.slots[usize::from(anchor)].timers)
    }

    fn timers_mut(&mut self, peer_index: usize) -> Option<&mut OutstandingTimers> {
        self.anchor(peer_index)
            .map(|anchor| &mut self.slots[usize::from(anchor)].timers)
    }

    /// After a change of the peer's lists: when the anchor moved, the
    /// timers move with it (`before` still holds them); a first message
    /// outstanding starts them at `now`.
    fn move_timers(&mut self, peer_index: usize, before: Option<u16>, now: u64) {
        let after = self.anchor(peer_index);
        let Some(after) = after.filter(|&after| Some(after) != before) else {
            return;
        };
        self.slots[usize::from(after)].timers = match before {
            Some(before) => self.slots[usize::from(before)].timers,
            // The peer-gone clock runs while something is outstanding.
            None => OutstandingTimers {
                progress_at: now,
                rto_deadline: NEVER,
                probe_at: NEVER,
            },
        };
    }

    fn list_push_back(&mut self, peer_index: usize, s: usize, slot_index: u16, now: u64) {
        let anchor = self.anchor(peer_index);
        let head = self.peers[peer_index].unacked_head[s];
        if head == NO_SLOT {
            let slot = &mut self.slots[usize::from(slot_index)];
            slot.prev = slot_index;
            slot.next = slot_index;
            self.peers[peer_index].unacked_head[s] = slot_index;
        } else {
            let tail = self.slots[usize::from(head)].prev;
            self.slots[usize::from(slot_index)].prev = tail;
            self.slots[usize::from(slot_index)].next = head;
            self.slots[usize::from(tail)].next = slot_index;
            self.slots[usize::from(head)].prev = slot_index;
        }
        self.move_timers(peer_index, anchor, now);
    }

    /// Unlinks the slot from its peer's list and frees it.
    fn release_slot(&mut self, peer_index: usize, slot_index: u16) {
        let anchor = self.anchor(peer_index);
        let slot = self.slots[usize::from(slot_index)];
        let s = Self::slot_stream(&slot);
        let peer = &mut self.peers[peer_index];
        if slot.next == slot_index {
            peer.unacked_head[s] = NO_SLOT;
        } else {
            self.slots[usize::from(slot.prev)].next = slot.next;
            self.slots[usize::from(slot.next)].prev = slot.prev;
            if peer.unacked_head[s] == slot_index {
                peer.unacked_head[s] = slot.next;
            }
        }
        // Nothing starts here: a released slot leaves a message behind or
        // no anchor at all.
        self.move_timers(peer_index, anchor, NEVER);
        let slot = &mut self.slots[usize::from(slot_index)];
        slot.flags = 0;
        slot.prev = NO_SLOT;
        slot.next = self.free_head;
        self.free_head = slot_index;
        self.free_slots += 1;
    }

    /// Abandons every unacknowledged message to the peer, reporting each.
    fn abandon_all(&mut self, peer_index: usize) {
        let node = self.peer_nodes[peer_index];
        for stream in Stream::ALL {
            let s = stream.index();
            while self.peers[peer_index].unacked_head[s] != NO_SLOT {
                let slot_index = self.peers[peer_index].unacked_head[s];
                let seq = self.slots[usize::from(slot_index)].seq;
                self.release_slot(peer_index, slot_index);
                self.events
                    .push_back(Event::Abandoned { node, stream, seq });
                self.stats.abandoned += 1;
            }
        }
    }

    /// The peer's unacknowledged slots of both streams (at most 128),
    /// written into `out`; returns how many.
    fn unacked_slots(&self, peer_index: usize, out: &mut [u16; 128]) -> usize {
        let mut count = 0;
        for head in self.peers[peer_index].unacked_head {
            if head == NO_SLOT {
                continue;
            }
            // At most `window` (64) per stream, so `out` has room.
            let mut cursor = head;
            loop {
                out[count] = cursor;
                count += 1;
                cursor = self.slots[usize::from(cursor)].next;
                if cursor == head {
                    break;
                }
            }
        }
        count
    }

    /// Unacknowledged messages of both streams.
    fn outstanding_count(&self, peer_index: usize) -> usize {
        self.unacked_slots(peer_index, &mut [0; 128])
    }

    fn schedule_ack(&mut self, peer_index: usize, now: u64) {
        let due = now.saturating_add(self.ack_delay);
        let peer = &mut self.peers[peer_index];
        if !peer.bits.is(PeerBits::ACK_OWED) {
            peer.bits.set_flag(PeerBits::ACK_OWED, true);
            // The low 32 bits; `ack_due_at` restores the rest.
            peer.ack_due = due as u32;
        }
        if !peer.bits.is(PeerBits::ACK_QUEUED) {
            peer.bits.set_flag(PeerBits::ACK_QUEUED, true);
            self.ack_queue.push_back(peer_index as u16);
        }
    }

    /// When the peer's owed acknowledgement is due, us since the epoch;
    /// `NEVER` when none is owed. It was set to a `now` (at most `latest`,
    /// the latest time seen) plus `ack_delay` (below 2^31 us), so its low
    /// 32 bits place it: at most `ack_delay` after `latest`, or else before
    /// `latest` — exactly when less than 71.6 minutes before, and before in
    /// any case, so an acknowledgement owed across a long stall of the
    /// caller is sent when it resumes.
    fn ack_due_at(&self, peer: &Peer) -> u64 {
        if !peer.bits.is(PeerBits::ACK_OWED) {
            return NEVER;
        }
        let ahead = peer.ack_due.wrapping_sub(self.latest as u32);
        if u64::from(ahead) <= self.ack_delay {
            self.latest + u64::from(ahead)
        } else {
            let behind = (self.latest as u32).wrapping_sub(peer.ack_due);
            self.latest.saturating_sub(u64::from(behind))
        }
    }

    /// The peer came back as `incarnation`: abandon what was outstanding,
    /// start both directions afresh.
    fn restart_peer(&mut self, peer_index: usize, incarnation: u64, now: u64) {
        let node = self.peer_nodes[peer_index];
        let old = self.peers[peer_index].incarnation;
        self.retired.remember(node, old, now, false);
        self.abandon_all(peer_index);
        let peer = &mut self.peers[peer_index];
        let ack = (
            peer.ack_due,
            peer.bits.is(PeerBits::ACK_OWED),
            peer.bits.is(PeerBits::ACK_QUEUED),
        );
        *peer = Peer::new();
        peer.incarnation = incarnation;
        peer.ack_due = ack.0;
        peer.bits.set_flag(PeerBits::ACK_OWED, ack.1);
        peer.bits.set_flag(PeerBits::ACK_QUEUED, ack.2);
        self.events.push_back(Event::PeerRestarted { node });
        self.stats.peers_restarted += 1;
    }

    /// Feeds one datagram received from the network (any bytes). Returns
    /// the message it carried when that is new; acknowledgements and peer
    /// changes it carried become events. Handle a returned request (queue
    /// its replies) before the next `receive` or `poll_transmit`.
    pub fn receive<'a>(
        &mut self,
        now: Instant,
        datagram: &'a [u8],
    ) -> Result<Option<Message<'a>>, DropReason> {
        let now = self.clock(now);
        self.stats.datagrams_received += 1;
        let (header, payload) = match Header::decode(datagram) {
            Ok(decoded) => decoded,
            Err(error) => {
                self.stats.malformed += 1;
                return Err(DropReason::Malformed(error));
            }
        };
        if payload.len() > self.config.max_payload {
            self.stats.malformed += 1;
            return Err(DropReason::Oversized);
        }
        if header.fabric != self.identity.fabric {
            self.stats.wrong_fabric += 1;
            return Err(DropReason::WrongFabric);
        }
        if header.destination != self.identity.node {
            self.stats.wrong_destination += 1;
            return Err(DropReason::WrongDestination);
        }
        let Some(peer_index) = self.peer_of(header.source) else {
            self.stats.unknown_source += 1;
            return Err(DropReason::UnknownSource);
        };
        self.check_incarnation(peer_index, &header, now)?;
        if header.destination_incarnation == 0 {
            // The peer has not heard from this incarnation: its ack fields
            // describe nothing of ours, and its message, which a previous
            // incarnation of this node may have delivered, is not
            // delivered. Our acknowledgement introduces us; the peer sends
            // the message again naming us.
            self.heard_from(peer_index, now);
            if header.seq.is_none() {
                return Ok(None);
            }
            self.schedule_ack(peer_index, now);
            self.stats.not_yet_introduced += 1;
            return Err(DropReason::NotYetIntroduced);
        }
        // The peer cannot acknowledge what was never sent.
        let stream_headers = [header.requests, header.replies];
        let peer = &self.peers[peer_index];
        if (0..2).any(|s| !seq_at_or_before(stream_headers[s].ack, peer.send_next[s])) {
            self.stats.bad_acks += 1;
            return Err(DropReason::BadAck);
        }
        self.heard_from(peer_index, now);
        self.apply_acknowledgement(peer_index, &stream_headers, header.horizon, now);
        if header.probe_echo {
            self.probe_echoed(peer_index);
        }
        for stream in Stream::ALL {
            self.apply_floor(peer_index, stream, stream_headers[stream.index()].floor);
        }

        let Some(seq) = header.seq else {
            return Ok(None);
        };
        let stream = if header.reply {
            Stream::Reply
        } else {
            Stream::Request
        };
        let s = stream.index();
        if header.probe {
            // Echoed by the next datagram to the peer, delivered or not:
            // whatever the peer sent before the probe came before it.
            self.peers[peer_index]
                .bits
                .set_flag(PeerBits::PROBE_SEEN, true);
        }
        // Any message, new or not, is answered so the sender learns.
        self.schedule_ack(peer_index, now);
        let peer = self.peers[peer_index];
        let distance = seq.wrapping_sub(peer.recv_next[s]);
        let already_delivered = if distance >= super::wire::SEQ_HALF_RANGE {
            // Before the cumulative ack.
            true
        } else if (1..=Config::MAX_WINDOW).contains(&distance) {
            peer.recv_sack[s] & (1u64 << (distance - 1)) != 0
        } else {
            false
        };
        if already_delivered {
            self.stats.duplicates += 1;
            return Err(DropReason::Duplicate);
        }
        if distance > Config::MAX_WINDOW {
            self.stats.beyond_window += 1;
            return Err(DropReason::BeyondWindow);
        }
        if stream == Stream::Request && !self.has_response_room(peer_index) {
            self.stats.no_response_room += 1;
            return Err(DropReason::NoResponseRoom);
        }
        let peer = &mut self.peers[peer_index];
        if distance == 0 {
            let run = peer.recv_sack[s].trailing_ones();
            peer.recv_next[s] = peer.recv_next[s].wrapping_add(1 + run);
            peer.recv_sack[s] = shift_right(peer.recv_sack[s], 1 + run);
        } else {
            peer.recv_sack[s] |= 1u64 << (distance - 1);
        }
        self.stats.messages_delivered += 1;
        Ok(Some(Message {
            node: header.source,
            stream,
            seq,
            payload,
        }))
    }

    /// `true` when `response_reserve` replies to the peer would be accepted
    /// by `send_reply` now.
    fn has_response_room(&self, peer_index: usize) -> bool {
        let reserve = self.config.response_reserve;
        if reserve == 0 {
            return true;
        }
        let s = Stream::Reply.index();
        let peer = &self.peers[peer_index];
        let in_window = peer.send_next[s].wrapping_sub(self.floor(peer_index, s));
        !peer.is_gone()
            && in_window + reserve <= self.config.window
            && self.free_slots >= reserve as usize
    }

    /// Applies the incarnation rules of the module docs; resets the peer
    /// when it restarted.
    fn check_incarnation(
        &mut self,
        peer_index: usize,
        header: &Header,
        now: u64,
    ) -> Result<(), DropReason> {
        let recorded = self.peers[peer_index].incarnation;
        let destination = header.destination_incarnation;
        if destination != 0 && destination != self.identity.incarnation {
            self.stats.stale_incarnation += 1;
            // The peer still addresses a previous life of ours. Not heard
            // from in this one: a pure acknowledgement naming no incarnation
            // of it (so never stale) tells it we restarted. Heard from: an
            // introduction to the life we know, or to the one it spoke from,
            // proposed (rules 5 and 6 of the module docs).
            let source = header.source_incarnation;
            if recorded == 0 {
                self.schedule_ack(peer_index, now);
            } else if source == recorded {
                self.introduce(peer_index);
            } else {
                self.propose(header.source, source, now);
            }
            return Err(DropReason::StaleIncarnation);
        }
        let source = header.source_incarnation;
        if source == recorded {
            return Ok(());
        }
        if self
            .retired
            .holds(header.source, source, now, self.peer_timeout)
        {
            self.stats.stale_incarnation += 1;
            return Err(DropReason::StaleIncarnation);
        }
        if recorded == 0 {
            self.peers[peer_index].incarnation = source;
            self.introduced(peer_index);
            // Named in our answer, the peer may take us (it may have
            // proposed us and introduced itself).
            self.schedule_ack(peer_index, now);
            return Ok(());
        }
        // An incarnation of the peer not heard from before. A new life of
        // the peer has delivered nothing of ours (we never named it): it
        // acknowledges nothing. One that acknowledges something knew a
        // session of ours that we no longer have (late, or one we left for
        // a forged life): taking it would reset our streams but not its own.
        let acknowledges_nothing = [header.requests, header.replies]
            .iter()
            .all(|stream| stream.ack == 0 && stream.sack == 0);
        if !acknowledges_nothing {
            self.stats.stale_incarnation += 1;
            return Err(DropReason::StaleIncarnation);
        }
        if destination != 0
            && self
                .proposed
                .holds(header.source, source, now, self.peer_timeout)
        {
            // It heard our introduction: the peer restarted. Our answer
            // names it (it may have proposed us too).
            self.proposed.forget(header.source, source);
            self.restart_peer(peer_index, source, now);
            self.schedule_ack(peer_index, now);
            return Ok(());
        }
        // Perhaps the peer's new life, perhaps a late or forged datagram of
        // a life that will never answer: introduce ourselves, and change
        // nothing until it answers naming us.
        self.propose(header.source, source, now);
        self.stats.unconfirmed_incarnation += 1;
        Err(DropReason::UnconfirmedIncarnation)
    }

    /// Proposes `incarnation` as `node`'s next and queues an introduction
    /// naming it (see [`introduction`](Self::introduction)).
    fn propose(&mut self, node: NodeId, incarnation: u64, now: u64) {
        self.proposed.remember(node, incarnation, now, true);
        self.introductions_owed = true;
    }

    /// Queues an introduction naming the peer's recorded incarnation (see
    /// [`introduction`](Self::introduction)).
    fn introduce(&mut self, peer_index: usize) {
        let peer = &mut self.peers[peer_index];
        peer.bits.set_flag(PeerBits::INTRODUCE, true);
        if !peer.bits.is(PeerBits::ACK_QUEUED) {
            peer.bits.set_flag(PeerBits::ACK_QUEUED, true);
            self.ack_queue.push_back(peer_index as u16);
        }
    }

    /// The peer's incarnation became known: every message already sent to
    /// it named no incarnation, so it was not delivered (see
    /// [`DropReason::NotYetIntroduced`]); send them again now, naming it.
    fn introduced(&mut self, peer_index: usize) {
        let mut slots = [0u16; 128];
        let count = self.unacked_slots(peer_index, &mut slots);
        for &slot_index in &slots[..count] {
            let slot = &mut self.slots[usize::from(slot_index)];
            if slot.flags & SLOT_QUEUED == 0 && slot.last_sent != NEVER {
                slot.flags |= SLOT_QUEUED | SLOT_RETRANSMITTED;
                self.transmit_queue.push_back((slot_index, slot.generation));
            }
        }
    }

    /// Heard from a peer declared gone: it may be sent to again, and an
    /// acknowledgement carries our floors so it skips what was abandoned.
    fn heard_from(&mut self, peer_index: usize, now: u64) {
        if self.peers[peer_index].is_gone() {
            self.peers[peer_index].bits.set_flag(PeerBits::GONE, false);
            self.schedule_ack(peer_index, now);
        }
    }

    /// Applies the cumulative and selective acknowledgements of a datagram
    /// from the peer: acknowledged messages are released, a round-trip
    /// sample taken, holes fast-retransmitted.
    fn apply_acknowledgement(
        &mut self,
        peer_index: usize,
        stream_headers: &[StreamHeader; 2],
        horizon: Seq,
        now: u64,
    ) {
        let node = self.peer_nodes[peer_index];
        let mut progress = false;
        let mut rtt_sample = None;
        let mut slots = [0u16; 128];
        let count = self.unacked_slots(peer_index, &mut slots);
        for &slot_index in &slots[..count] {
            let slot = self.slots[usize::from(slot_index)];
            let s = Self::slot_stream(&slot);
            let StreamHeader { ack, sack, .. } = stream_headers[s];
            let distance = slot.seq.wrapping_sub(ack);
            let acked = seq_before(slot.seq, ack)
                || (1..=Config::MAX_WINDOW).contains(&distance)
                    && sack & (1u64 << (distance - 1)) != 0;
            if acked {
                // A message never sent cannot be acknowledged (a lying
                // peer); it stays until it is sent.
                if slot.first_sent == NEVER {
                    continue;
                }
                if slot.flags & SLOT_RETRANSMITTED == 0 {
                    rtt_sample = Some(now.saturating_sub(slot.first_sent));
                }
                self.release_slot(peer_index, slot_index);
                self.events.push_back(Event::Acked {
                    node,
                    stream: Stream::ALL[s],
                    seq: slot.seq,
                    horizon,
                });
                self.stats.acked += 1;
                progress = true;
            } else if slot.flags & (SLOT_FAST_RETRANSMITTED | SLOT_QUEUED) == 0
                && slot.first_sent != NEVER
                && distance < Config::MAX_WINDOW
                && shift_right(sack, distance).count_ones() >= self.config.fast_retransmit_threshold
            {
                let slot = &mut self.slots[usize::from(slot_index)];
                slot.flags |= SLOT_FAST_RETRANSMITTED | SLOT_RETRANSMITTED | SLOT_QUEUED;
                self.transmit_queue.push_back((slot_index, slot.generation));
                self.stats.fast_retransmits += 1;
            }
        }
        if let Some(sample) = rtt_sample {
            // A fresh sample ends the backoff. Acknowledgements of
            // retransmitted messages alone keep it (Karn): were the round
            // trip longer than the timeout, every message would be
            // retransmitted before its acknowledgement and no sample taken.
            self.update_rtt(peer_index, sample);
            self.peers[peer_index].bits.set(PeerBits::BACKOFF, 0);
        }
        if progress {
            // With nothing outstanding any more there are no timers. The
            // timeout runs from the oldest transmission still unanswered,
            // not from this acknowledgement: acknowledgements of other
            // messages (the other stream's, later ones') arriving more
            // often than the timeout must not keep a lost message from
            // being sent again. While a timeout's probe awaits its echo,
            // the messages it left waiting are older than that deadline
            // and must not set off a timeout each: the probe's deadline
            // stands.
            let rto = u64::from(self.rto_of(&self.peers[peer_index]));
            let oldest = self.oldest_transmission(peer_index);
            if let Some(timers) = self.timers_mut(peer_index) {
                timers.progress_at = now;
                let due = oldest.saturating_add(rto);
                timers.rto_deadline = if timers.probe_at != NEVER && timers.rto_deadline != NEVER {
                    due.max(timers.rto_deadline)
                } else {
                    due
                };
            }
        }
    }

    /// The latest transmission of the peer's unacknowledged message sent
    /// longest ago (us); `NEVER` when every one is queued to go (again),
    /// and `poll_transmit` arms the timer.
    fn oldest_transmission(&self, peer_index: usize) -> u64 {
        let mut slots = [0u16; 128];
        let count = self.unacked_slots(peer_index, &mut slots);
        slots[..count]
            .iter()
            .map(|&slot_index| &self.slots[usize::from(slot_index)])
            .filter(|slot| slot.flags & SLOT_QUEUED == 0)
            .map(|slot| slot.last_sent)
            .min()
            .unwrap_or(NEVER)
    }

    /// The peer echoed a timeout probe: it received the probe, so every
    /// message sent before the earliest probe it had not echoed and still
    /// unacknowledged now was lost (datagrams between two hosts keep their
    /// order, or nearly), and goes again at once rather than one message
    /// per timeout.
    fn probe_echoed(&mut self, peer_index: usize) {
        let Some(timers) = self.timers_mut(peer_index) else {
            return;
        };
        let probe_at = std::mem::replace(&mut timers.probe_at, NEVER);
        if probe_at == NEVER {
            return;
        }
        let mut slots = [0u16; 128];
        let count = self.unacked_slots(peer_index, &mut slots);
        for &slot_index in &slots[..count] {
            let slot = &mut self.slots[usize::from(slot_index)];
            if slot.flags & SLOT_QUEUED == 0 && slot.last_sent < probe_at {
                slot.flags |= SLOT_QUEUED | SLOT_RETRANSMITTED;
                self.transmit_queue.push_back((slot_index, slot.generation));
                self.stats.lost_before_probe += 1;
            }
        }
    }

    /// The current retransmission timeout towards the peer, us: from the
    /// round-trip estimate (or `rto_initial` before the first sample),
    /// clamped to `rto_min..=rto_max`, doubled at every backoff up to
    /// `rto_max`.
    fn rto_of(&self, peer: &Peer) -> u32 {
        let srtt = peer.bits.get(PeerBits::SRTT);
        let base = if srtt == 0 {
            self.rto_initial
        } else {
            let rto = u64::from(srtt) + 4 * u64::from(peer.bits.get(PeerBits::RTTVAR));
            u32::try_from(rto)
                .unwrap_or(u32::MAX)
                .clamp(self.rto_min, self.rto_max)
        };
        let backed_off = u64::from(base) << peer.bits.get(PeerBits::BACKOFF);
        backed_off.min(u64::from(self.rto_max)) as u32
    }

    /// RFC 6298 smoothing of one round-trip sample (us).
    fn update_rtt(&mut self, peer_index: usize, sample: u64) {
        let sample = sample.clamp(1, PeerBits::RTT_MAX);
        let bits = &mut self.peers[peer_index].bits;
        let srtt = u64::from(bits.get(PeerBits::SRTT));
        // Both stay within `RTT_MAX`: averages of values within it.
        if srtt == 0 {
            bits.set(PeerBits::SRTT, sample as u32);
            bits.set(PeerBits::RTTVAR, (sample / 2) as u32);
        } else {
            let rttvar = u64::from(bits.get(PeerBits::RTTVAR));
            let rttvar = (3 * rttvar + srtt.abs_diff(sample)) / 4;
            bits.set(PeerBits::RTTVAR, rttvar as u32);
            bits.set(PeerBits::SRTT, ((7 * srtt + sample) / 8).max(1) as u32);
        }
    }

    /// Applies the peer's floor of `stream`: seqs below it will never come.
    fn apply_floor(&mut self, peer_index: usize, stream: Stream, floor: Seq) {
        let s = stream.index();
        let peer = &mut self.peers[peer_index];
        let from = peer.recv_next[s];
        if !seq_before(from, floor) {
            return;
        }
        let jump = floor.wrapping_sub(from);
        // Seqs from+1 .. floor-1 are bits 0 .. jump-2.
        let gap_bits = (jump - 1).min(64);
        let gap_mask = if gap_bits == 64 {
            u64::MAX
        } else {
            (1u64 << gap_bits) - 1
        };
        let delivered_in_gap = (peer.recv_sack[s] & gap_mask).count_ones();
        let missing = jump - delivered_in_gap;
        let floor_delivered = jump <= 64 && peer.recv_sack[s] & (1u64 << (jump - 1)) != 0;
        peer.recv_next[s] = floor;
        peer.recv_sack[s] = shift_right(peer.recv_sack[s], jump);
        if floor_delivered {
            let run = peer.recv_sack[s].trailing_ones();
            peer.recv_next[s] = floor.wrapping_add(1 + run);
            peer.recv_sack[s] = shift_right(peer.recv_sack[s], 1 + run);
        }
        self.stats.peer_abandoned += u64::from(missing);
        self.events.push_back(Event::PeerAbandoned {
            node: self.peer_nodes[peer_index],
            stream,
            from,
            until: floor,
            missing,
        });
    }

    fn build_header(
        &self,
        peer_index: usize,
        message: Option<(Stream, Seq)>,
        payload_len: u16,
    ) -> Header {
        let peer = &self.peers[peer_index];
        let stream_header = |s: usize| StreamHeader {
            ack: peer.recv_next[s],
            floor: self.floor(peer_index, s),
            sack: peer.recv_sack[s],
        };
        Header {
            fabric: self.identity.fabric,
            source: self.identity.node,
            destination: self.peer_nodes[peer_index],
            source_incarnation: self.identity.incarnation,
            destination_incarnation: peer.incarnation,
            seq: message.map(|(_, seq)| seq),
            reply: matches!(message, Some((Stream::Reply, _))),
            probe: false,
            probe_echo: peer.bits.get(PeerBits::PROBE_SEEN) != 0,
            horizon: peer.send_next[Stream::Reply.index()],
            requests: stream_header(Stream::Request.index()),
            replies: stream_header(Stream::Reply.index()),
            payload_len,
        }
    }

    /// Writes `header`, a pure acknowledgement, into `buf` and counts it;
    /// returns where it goes and its length.
    fn pure_acknowledgement(&mut self, header: &Header, buf: &mut [u8]) -> (NodeId, usize) {
        header.encode(buf);
        self.stats.acks_sent += 1;
        self.stats.datagrams_sent += 1;
        (header.destination, HEADER_LEN)
    }

    /// A pure acknowledgement to the peer's address that names its
    /// incarnation `name` and acknowledges nothing: it introduces this
    /// endpoint to `name` (a proposed new incarnation of the peer, or the
    /// recorded one when it addressed an earlier life of ours); any other
    /// incarnation that gets it drops it.
    fn introduction(&self, peer_index: usize, name: u64) -> Header {
        Header {
            destination_incarnation: name,
            probe_echo: false,
            horizon: 0,
            requests: StreamHeader::default(),
            replies: StreamHeader::default(),
            ..self.build_header(peer_index, None, 0)
        }
    }

    /// Writes the next datagram to put on the wire into `buf` and returns
    /// its destination and length. `buf` must hold
    /// [`max_datagram_len`](Self::max_datagram_len) bytes; a shorter one
    /// gets nothing.
    ///
    /// Messages go first (every one carries the latest acknowledgements to
    /// its destination), then pure acknowledgements that are due.
    pub fn poll_transmit(&mut self, now: Instant, buf: &mut [u8]) -> Option<(NodeId, usize)> {
        if buf.len() < self.max_datagram_len() {
            return None;
        }
        let now = self.clock(now);
        while let Some((slot_index, generation)) = self.transmit_queue.pop_front() {
            let slot = &mut self.slots[usize::from(slot_index)];
            if slot.generation != generation || slot.flags & SLOT_QUEUED == 0 {
                continue;
            }
            slot.flags &= !SLOT_QUEUED;
            if slot.first_sent == NEVER {
                slot.first_sent = now;
                self.stats.first_transmissions += 1;
            } else {
                self.stats.retransmissions += 1;
            }
            slot.last_sent = now;
            let slot = *slot;
            let stream = Stream::ALL[Self::slot_stream(&slot)];
            let peer_index = usize::from(slot.peer);
            let mut header = self.build_header(peer_index, Some((stream, slot.seq)), slot.len);
            header.probe = slot.flags & SLOT_PROBE != 0;
            self.slots[usize::from(slot_index)].flags &= !SLOT_PROBE;
            self.peers[peer_index]
                .bits
                .set_flag(PeerBits::PROBE_SEEN, false);
            header.encode(buf);
            let start = usize::from(slot_index) * self.config.max_payload;
            let len = usize::from(slot.len);
            buf[HEADER_LEN..HEADER_LEN + len].copy_from_slice(&self.payloads[start..start + len]);
            self.peers[peer_index]
                .bits
                .set_flag(PeerBits::ACK_OWED, false);
            let rto = u64::from(self.rto_of(&self.peers[peer_index]));
            let timers = self
                .timers_mut(peer_index)
                .expect("a message being sent is outstanding");
            if timers.rto_deadline == NEVER {
                timers.rto_deadline = now.saturating_add(rto);
            }
            self.stats.datagrams_sent += 1;
            return Some((header.destination, HEADER_LEN + len));
        }
        // Introductions to proposed incarnations.
        if self.introductions_owed {
            while let Some((node, incarnation)) = self.proposed.take_introduction() {
                let Some(peer_index) = self.peer_of(node) else {
                    continue;
                };
                let header = self.introduction(peer_index, incarnation);
                return Some(self.pure_acknowledgement(&header, buf));
            }
            self.introductions_owed = false;
        }
        // Pure acknowledgements that are due. The queue is in the order
        // acknowledgements became owed; an entry whose acknowledgement left
        // with a message is dropped, one not yet due goes to the back.
        for _ in 0..self.ack_queue.len() {
            let Some(entry) = self.ack_queue.pop_front() else {
                break;
            };
            let peer_index = usize::from(entry);
            if self.peers[peer_index].bits.is(PeerBits::INTRODUCE) {
                self.peers[peer_index]
                    .bits
                    .set_flag(PeerBits::INTRODUCE, false);
                // The entry stays for an acknowledgement still owed.
                self.ack_queue.push_front(entry);
                let header = self.introduction(peer_index, self.peers[peer_index].incarnation);
                return Some(self.pure_acknowledgement(&header, buf));
            }
            let due = self.ack_due_at(&self.peers[peer_index]);
            let peer = &mut self.peers[peer_index];
            if due == NEVER {
                peer.bits.set_flag(PeerBits::ACK_QUEUED, false);
                continue;
            }
            if due > now {
                self.ack_queue.push_back(entry);
                continue;
            }
            peer.bits.set_flag(PeerBits::ACK_QUEUED, false);
            peer.bits.set_flag(PeerBits::ACK_OWED, false);
            let header = self.build_header(peer_index, None, 0);
            self.peers[peer_index]
                .bits
                .set_flag(PeerBits::PROBE_SEEN, false);
            return Some(self.pure_acknowledgement(&header, buf));
        }
        None
    }

    /// The next event, oldest first.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// When [`handle_timeout`](Self::handle_timeout) (or `poll_transmit`
    /// for a delayed acknowledgement) must be called next; `None` when no
    /// timer runs. Datagrams already queued are sent by `poll_transmit`
    /// without waiting. Costs one pass over the peers.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let earliest = (0..self.peers.len())
            .map(|peer_index| {
                let ack_due = self.ack_due_at(&self.peers[peer_index]);
                match self.timers(peer_index) {
                    Some(timers) => {
                        let gone_at = timers.progress_at.saturating_add(self.peer_timeout);
                        timers.rto_deadline.min(ack_due).min(gone_at)
                    }
                    None => ack_due,
                }
            })
            .min()
            .unwrap_or(NEVER);
        if earliest == NEVER {
            None
        } else {
            self.instant(earliest)
        }
    }

    /// Runs the timers due at `now`: retransmissions with backoff, peers
    /// declared gone. Delayed acknowledgements need no call here; they
    /// leave through `poll_transmit`.
    pub fn handle_timeout(&mut self, now: Instant) {
        let now = self.clock(now);
        for peer_index in 0..self.peers.len() {
            let Some(timers) = self.timers(peer_index) else {
                continue;
            };
            if now >= timers.progress_at.saturating_add(self.peer_timeout) {
                self.abandon_all(peer_index);
                self.peers[peer_index].bits.set_flag(PeerBits::GONE, true);
                let node = self.peer_nodes[peer_index];
                self.events.push_back(Event::PeerGone { node });
                self.stats.peers_gone += 1;
                continue;
            }
            if now < timers.rto_deadline {
                continue;
            }
            let rto = u64::from(self.rto_of(&self.peers[peer_index]));
            // The probes: the oldest message of each stream unacknowledged
            // for a full timeout. The others wait for the peer's echo of a
            // probe (see `probe_echoed`): a receiver that was only slow
            // acknowledges them before it echoes, and is sent no
            // duplicates. Each stream has its own probe, since a receiver
            // may refuse requests until replies arrive
            // ([`DropReason::NoResponseRoom`]) and never refuses a reply.
            let mut probes: [Option<(u64, u16)>; 2] = [None; 2];
            let mut oldest_sent = NEVER;
            let mut slots = [0u16; 128];
            let count = self.unacked_slots(peer_index, &mut slots);
            for &slot_index in &slots[..count] {
                let slot = &self.slots[usize::from(slot_index)];
                if slot.flags & SLOT_QUEUED != 0 || slot.last_sent == NEVER {
                    continue;
                }
                if slot.last_sent.saturating_add(rto) <= now {
                    let probe = &mut probes[Self::slot_stream(slot)];
                    if probe.is_none_or(|(first_sent, _)| slot.first_sent < first_sent) {
                        *probe = Some((slot.first_sent, slot_index));
                    }
                } else {
                    oldest_sent = oldest_sent.min(slot.last_sent);
                }
            }
            for &(_, slot_index) in probes.iter().flatten() {
                let slot = &mut self.slots[usize::from(slot_index)];
                slot.flags |= SLOT_QUEUED | SLOT_RETRANSMITTED | SLOT_PROBE;
                self.transmit_queue.push_back((slot_index, slot.generation));
            }
            if probes.iter().any(Option::is_some) {
                // The earliest probe not echoed yet counts, unless its echo
                // could no longer find anything: every message sent before
                // it was acknowledged since (that probe, or its echo, was
                // lost).
                let earliest = self.timers(peer_index).map_or(NEVER, |t| t.probe_at);
                let still_covers = earliest != NEVER
                    && slots[..count].iter().any(|&slot_index| {
                        self.slots[usize::from(slot_index)].last_sent < earliest
                    });
                if !still_covers {
                    self.timers_mut(peer_index)
                        .expect("messages are outstanding")
                        .probe_at = now;
                }
            }
            let rto_deadline = if probes.iter().any(Option::is_some) {
                self.stats.timeouts += 1;
                if rto < u64::from(self.rto_max) {
                    let bits = &mut self.peers[peer_index].bits;
                    bits.set(PeerBits::BACKOFF, bits.get(PeerBits::BACKOFF) + 1);
                }
                let backed_off = self.rto_of(&self.peers[peer_index]);
                now.saturating_add(u64::from(backed_off))
            } else if oldest_sent != NEVER {
                oldest_sent.saturating_add(rto)
            } else {
                // Everything is queued; `poll_transmit` re-arms.
                NEVER
            };
            self.timers_mut(peer_index)
                .expect("nothing was released")
                .rto_deadline = rto_deadline;
        }
    }

    /// Every seq of `stream` from `node` below this was delivered (or given
    /// up by the node, reported by [`Event::PeerAbandoned`]); `None` for a
    /// node that is not a peer.
    pub fn delivered_through(&self, node: NodeId, stream: Stream) -> Option<Seq> {
        self.peer_of(node)
            .map(|index| self.peers[index].recv_next[stream.index()])
    }

    /// Lets `send_reply` to a peer declared gone try again (the caller's
    /// policy; `send` of a request does this by itself). If it is still
    /// unreachable it is declared gone again `peer_timeout` later. Returns
    /// whether the peer was gone.
    pub fn revive_peer(&mut self, node: NodeId) -> bool {
        let Some(index) = self.peer_of(node) else {
            return false;
        };
        let was_gone = self.peers[index].is_gone();
        self.peers[index].bits.set_flag(PeerBits::GONE, false);
        was_gone
    }

    /// Messages to `node` (both streams) sent and not yet acknowledged or
    /// abandoned.
    pub fn outstanding(&self, node: NodeId) -> Option<usize> {
        self.peer_of(node)
            .map(|index| self.outstanding_count(index))
    }

    /// `true` while `node` is declared gone.
    pub fn is_gone(&self, node: NodeId) -> bool {
        self.peer_of(node)
            .is_some_and(|index| self.peers[index].is_gone())
    }

    /// The incarnation of `node` as last heard (0 = not heard from yet).
    pub fn peer_incarnation(&self, node: NodeId) -> Option<u64> {
        self.peer_of(node)
            .map(|index| self.peers[index].incarnation)
    }

    /// The smoothed round-trip estimate towards `node`; `None` for no
    /// peer, or before the first sample.
    pub fn srtt(&self, node: NodeId) -> Option<Duration> {
        let index = self.peer_of(node)?;
        match self.peers[index].bits.get(PeerBits::SRTT) {
            0 => None,
            us => Some(Duration::from_micros(u64::from(us))),
        }
    }

    /// The current retransmission timeout towards `node`.
    pub fn rto(&self, node: NodeId) -> Option<Duration> {
        self.peer_of(node)
            .map(|index| Duration::from_micros(u64::from(self.rto_of(&self.peers[index]))))
    }

    /// Free slots of the retransmission pool.
    pub fn free_pool_slots(&self) -> usize {
        self.free_slots
    }

    /// The counters.
    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// What the state costs: fixed bytes (the pool included) and bytes per
    /// peer.
    pub fn memory(&self) -> MemoryReport {
        let pool_bytes = self.slots.capacity() * std::mem::size_of::<Slot>() + self.payloads.len();
        let fixed_bytes = std::mem::size_of::<Self>()
            + pool_bytes
            + self.transmit_queue.capacity() * std::mem::size_of::<(u16, u32)>()
            + self.retired.bytes()
            + self.proposed.bytes();
        let per_peer_bytes = std::mem::size_of::<Peer>()
            + std::mem::size_of::<NodeId>()
            + std::mem::size_of::<(NodeId, u16)>()
            + std::mem::size_of::<u16>(); // its possible ack-queue entry
        MemoryReport {
            fixed_bytes,
            pool_bytes,
            per_peer_bytes,
            peers: self.peers.len(),
        }
    }
}

#[cfg(any(test, feature = "test-hooks"))]
impl Endpoint {
    /// Starts the sequence numbers of both streams towards `node` at
    /// `send_next` and from it at `recv_next` (to test wrapping); only
    /// before any traffic. For tests and fuzzing only: a device always
    /// starts at 0 (a new life of a peer acknowledges nothing).
    pub fn start_sequences_at(&mut self, node: NodeId, send_next: Seq, recv_next: Seq) {
        let index = self.peer_of(node).unwrap();
        assert_eq!(self.anchor(index), None);
        self.peers[index].send_next = [send_next; 2];
        self.peers[index].recv_next = [recv_next; 2];
    }
}

#[cfg(test)]
pub(super) fn peer_state_size() -> usize {
    std::mem::size_of::<Peer>()
}
