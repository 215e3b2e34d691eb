//! The fabric fuzz target's world: two reliable-datagram endpoints of one
//! fabric (node 1, *A*, and node 2, *B*) on a clock that only the input
//! moves, a wire between them that the input drives (deliver, drop,
//! duplicate, reorder, corrupt), restarts of either side, and a hostile
//! sender that speaks to A with raw bytes or with well-formed headers
//! carrying any field values.
//!
//! An input is a sequence of operations, each a byte `k` naming one of
//! [`Op`] (the kind `Kind::ALL[k % Kind::ALL.len()]`) followed by its
//! arguments; the sequence ends where the input ends. [`Op::encode`]
//! writes one (the seed generator uses it).
//!
//! What the world asserts on every run:
//! - while no forged, corrupted or late datagram (on the wire for the
//!   peer timeout) got past the checks that leave an endpoint as it was
//!   (format, token, nodes), and neither side took a life of its peer
//!   other than the peer's newest (two late copies of a datagram of a
//!   life that ended can pass for its answer to an introduction; either
//!   side may restart): a message is
//!   delivered at most once per incarnation of its receiver and of its
//!   sender, stream and seq, byte for byte as it was sent with that seq,
//!   and a message acknowledged was delivered (the endpoint's limits,
//!   which `pindown_emu_device::net` documents, are where these may not
//!   hold);
//! - every seq a send returned ends in at most one `Acked` or `Abandoned`
//!   event, and only seqs that were sent do; when a peer is declared gone
//!   or restarted, every message sent to it before has ended; the
//!   endpoint's count of messages outstanding is the number of sends not
//!   ended; after a spell of perfect wire ([`Op::Settle`]) every send has
//!   ended;
//! - a request delivered can be answered at once (the endpoint delivers a
//!   request only when it has room for its reply);
//! - every datagram whose header decodes encodes back to the same bytes,
//!   and every payload that decodes as a fabric message or frame datagram
//!   encodes to bytes that decode to the same value;
//! - and, as for every fuzz target, no panic and no input that runs for
//!   long (libFuzzer's timeout): datagrams between the endpoints never
//!   bounce back and forth forever.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::{Duration, Instant};

use arbitrary::Unstructured;
use pindown_emu_device::internode::message::{FrameDatagram, Message as FabricMessage};
use pindown_emu_device::net::wire::{Header, StreamHeader, HEADER_LEN};
use pindown_emu_device::net::{
    Config, DropReason, Endpoint, Event, Identity, Message, NodeId, SendError, Seq, Stream,
};

/// The fabric's job token.
pub const FABRIC: u64 = 0x7069_6e64_6f77_6e21;
/// Node A, the endpoint under attack.
pub const NODE_A: NodeId = 1;
/// Node B, A's honest peer.
pub const NODE_B: NodeId = 2;
/// The first incarnations of A and B; each restart adds one.
pub const FIRST_INCARNATIONS: [u64; 2] = [0xa000, 0xb000];
/// The nodes, by side (A is side 0, B side 1).
const NODES: [NodeId; 2] = [NODE_A, NODE_B];
/// Datagrams the wire holds; a transmit beyond it is lost.
const WIRE_CAPACITY: usize = 256;
/// Operations of one input (a longer input is cut).
const MAX_OPS: usize = 512;

/// One operation of an input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// A sends a request to B.
    ARequest(Vec<u8>),
    /// B sends a request to A.
    BRequest(Vec<u8>),
    /// B sends a reply to A.
    BReply(Vec<u8>),
    /// Time moves on by `micros << (4 * scale)` (scale 0-7, so up to about
    /// 200 days), then both endpoints handle their timeouts.
    Advance {
        /// Microseconds, before scaling.
        micros: u16,
        /// Shift of `micros`, in nibbles.
        scale: u8,
    },
    /// Both endpoints' datagrams go onto the wire.
    Transmit,
    /// The oldest datagram on the wire reaches its destination.
    Deliver,
    /// The oldest datagram on the wire is lost.
    Drop,
    /// The oldest datagram on the wire is delivered twice (its copy goes
    /// to the back).
    Duplicate,
    /// The oldest datagram on the wire goes to the back.
    Reorder,
    /// A byte of the oldest datagram on the wire is flipped.
    Corrupt {
        /// Which byte (modulo the datagram's length).
        at: u16,
        /// The bits flipped (0 means 1).
        xor: u8,
    },
    /// Raw bytes reach A from the hostile sender.
    Raw(Vec<u8>),
    /// A well-formed header with any field values, and a payload, reach
    /// A from B's address.
    Forged(Forgery),
    /// B restarts: a new endpoint with the next incarnation.
    RestartB,
    /// A restarts likewise.
    RestartA,
    /// A sends a reply to B (one B asked for or not: the endpoint does
    /// not know).
    AReply(Vec<u8>),
    /// As the first operation of an input: the streams start at these
    /// sequence numbers (A's towards B, B's towards A) instead of 0, so
    /// that they wrap around 2^32 within the input; ignored later.
    StartSequences {
        /// A's streams towards B.
        a_to_b: u32,
        /// B's streams towards A.
        b_to_a: u32,
    },
    /// The wire turns perfect for a while: both endpoints' datagrams are
    /// delivered as they are sent, and time runs on to each timer, for
    /// more than the peer timeout and the longest retransmission timeout.
    /// Every message sent before must have ended by then (acknowledged, or
    /// abandoned with its peer).
    Settle,
}

/// The kinds of [`Op`], numbered as an input names them: by their order
/// here (the seeds' bytes depend on it; new kinds go at the end).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// [`Op::ARequest`].
    ARequest,
    /// [`Op::BRequest`].
    BRequest,
    /// [`Op::BReply`].
    BReply,
    /// [`Op::Advance`].
    Advance,
    /// [`Op::Transmit`].
    Transmit,
    /// [`Op::Deliver`].
    Deliver,
    /// [`Op::Drop`].
    Drop,
    /// [`Op::Duplicate`].
    Duplicate,
    /// [`Op::Reorder`].
    Reorder,
    /// [`Op::Corrupt`].
    Corrupt,
    /// [`Op::Raw`].
    Raw,
    /// [`Op::Forged`].
    Forged,
    /// [`Op::RestartB`].
    RestartB,
    /// [`Op::Settle`].
    Settle,
    /// [`Op::AReply`].
    AReply,
    /// [`Op::StartSequences`].
    StartSequences,
    /// [`Op::RestartA`].
    RestartA,
}

impl Kind {
    /// Every kind, at its number.
    pub const ALL: [Kind; 17] = [
        Kind::ARequest,
        Kind::BRequest,
        Kind::BReply,
        Kind::Advance,
        Kind::Transmit,
        Kind::Deliver,
        Kind::Drop,
        Kind::Duplicate,
        Kind::Reorder,
        Kind::Corrupt,
        Kind::Raw,
        Kind::Forged,
        Kind::RestartB,
        Kind::Settle,
        Kind::AReply,
        Kind::StartSequences,
        Kind::RestartA,
    ];
}

// `Kind::ALL` lists every kind at its own number.
const _: () = {
    let mut i = 0;
    while i < Kind::ALL.len() {
        assert!(Kind::ALL[i] as usize == i);
        i += 1;
    }
};

impl Op {
    /// The operation's kind.
    pub fn kind(&self) -> Kind {
        match self {
            Op::ARequest(_) => Kind::ARequest,
            Op::BRequest(_) => Kind::BRequest,
            Op::BReply(_) => Kind::BReply,
            Op::Advance { .. } => Kind::Advance,
            Op::Transmit => Kind::Transmit,
            Op::Deliver => Kind::Deliver,
            Op::Drop => Kind::Drop,
            Op::Duplicate => Kind::Duplicate,
            Op::Reorder => Kind::Reorder,
            Op::Corrupt { .. } => Kind::Corrupt,
            Op::Raw(_) => Kind::Raw,
            Op::Forged(_) => Kind::Forged,
            Op::RestartB => Kind::RestartB,
            Op::Settle => Kind::Settle,
            Op::AReply(_) => Kind::AReply,
            Op::StartSequences { .. } => Kind::StartSequences,
            Op::RestartA => Kind::RestartA,
        }
    }

    /// Reads one operation; `Err` when the input ends.
    pub fn read(u: &mut Unstructured<'_>) -> arbitrary::Result<Op> {
        let kind = Kind::ALL[usize::from(u.arbitrary::<u8>()?) % Kind::ALL.len()];
        let bytes = |u: &mut Unstructured<'_>| -> arbitrary::Result<Vec<u8>> {
            let len = usize::from(u.arbitrary::<u16>()?) % (Config::MTU_PAYLOAD + 64);
            Ok(u.bytes(len.min(u.len()))?.to_vec())
        };
        Ok(match kind {
            Kind::ARequest => Op::ARequest(bytes(u)?),
            Kind::BRequest => Op::BRequest(bytes(u)?),
            Kind::BReply => Op::BReply(bytes(u)?),
            Kind::Advance => Op::Advance {
                micros: u.arbitrary()?,
                scale: u.arbitrary::<u8>()? % 8,
            },
            Kind::Transmit => Op::Transmit,
            Kind::Deliver => Op::Deliver,
            Kind::Drop => Op::Drop,
            Kind::Duplicate => Op::Duplicate,
            Kind::Reorder => Op::Reorder,
            Kind::Corrupt => Op::Corrupt {
                at: u.arbitrary()?,
                xor: u.arbitrary()?,
            },
            Kind::Raw => Op::Raw(bytes(u)?),
            Kind::Forged => Op::Forged(Forgery {
                flags: u.arbitrary()?,
                incarnation: u.arbitrary()?,
                numbers: u.arbitrary()?,
                sacks: u.arbitrary()?,
                payload: bytes(u)?,
            }),
            Kind::RestartB => Op::RestartB,
            Kind::Settle => Op::Settle,
            Kind::AReply => Op::AReply(bytes(u)?),
            Kind::StartSequences => Op::StartSequences {
                a_to_b: u.arbitrary()?,
                b_to_a: u.arbitrary()?,
            },
            Kind::RestartA => Op::RestartA,
        })
    }

    /// Appends the operation in the input format.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let bytes = |out: &mut Vec<u8>, b: &[u8]| {
            out.extend_from_slice(&(b.len() as u16).to_le_bytes());
            out.extend_from_slice(b);
        };
        out.push(self.kind() as u8);
        match self {
            Op::ARequest(b) | Op::BRequest(b) | Op::BReply(b) | Op::AReply(b) | Op::Raw(b) => {
                bytes(out, b)
            }
            Op::Advance { micros, scale } => {
                out.extend_from_slice(&micros.to_le_bytes());
                out.push(*scale);
            }
            Op::Corrupt { at, xor } => {
                out.extend_from_slice(&at.to_le_bytes());
                out.push(*xor);
            }
            Op::Forged(forgery) => {
                forgery.encode(out);
                bytes(out, &forgery.payload);
            }
            Op::StartSequences { a_to_b, b_to_a } => {
                out.extend_from_slice(&a_to_b.to_le_bytes());
                out.extend_from_slice(&b_to_a.to_le_bytes());
            }
            Op::Transmit
            | Op::Deliver
            | Op::Drop
            | Op::Duplicate
            | Op::Reorder
            | Op::RestartB
            | Op::Settle
            | Op::RestartA => {}
        }
    }
}

/// A datagram on the wire.
#[derive(Clone)]
struct InFlight {
    to: NodeId,
    bytes: Vec<u8>,
    sent: Instant,
    /// A byte of it was flipped.
    corrupted: bool,
}

/// What one endpoint sent and what became of it.
#[derive(Default)]
struct Ledger {
    /// Seqs sent to the peer and not ended, by stream.
    open: [BTreeSet<Seq>; 2],
    /// Seqs that ended since the last restart of either side, by stream.
    ended: [BTreeSet<Seq>; 2],
}

/// The two endpoints, the wire and the record the checks use.
pub struct World {
    /// A and B, by side.
    endpoints: [Endpoint; 2],
    /// Each side's current incarnation.
    incarnations: [u64; 2],
    now: Instant,
    /// Datagrams in flight.
    wire: VecDeque<InFlight>,
    /// Whether a forged, corrupted or late datagram (on the wire for the
    /// peer timeout) got past the checks that leave an endpoint as it was,
    /// or a side took a life of its peer that is not the peer's newest.
    tainted: bool,
    /// Payloads sent, by (sending side, its incarnation, stream, seq).
    sent: BTreeMap<(usize, u64, usize, Seq), Vec<u8>>,
    /// What each endpoint delivered: (receiver, its incarnation, the
    /// sender's incarnation, stream, seq).
    delivered: BTreeSet<(NodeId, u64, u64, usize, Seq)>,
    ledgers: [Ledger; 2],
    buf: Vec<u8>,
    /// Print operations, deliveries and events to standard error.
    trace: bool,
    /// Where each side's current life started its streams towards the
    /// peer, and where it expects the peer's to start: 0 on a real
    /// device, anywhere after [`Op::StartSequences`], and 0 again once
    /// either side has taken a restart of the other.
    origins: [(Seq, Seq); 2],
}

fn config() -> Config {
    Config {
        window: 8,
        // Fewer than both streams' windows: the pool fills first.
        pool_slots: 12,
        ..Config::default()
    }
}

/// The endpoint of `side` in its life `incarnation`.
fn endpoint(side: usize, incarnation: u64) -> Endpoint {
    let identity = Identity {
        fabric: FABRIC,
        node: NODES[side],
        incarnation,
    };
    let mut endpoint = Endpoint::new(identity, config()).expect("the fuzz config is valid");
    endpoint.add_peer(NODES[1 - side]).expect("a new peer");
    endpoint
}

fn stream_index(stream: Stream) -> usize {
    match stream {
        Stream::Request => 0,
        Stream::Reply => 1,
    }
}

/// The side of `node`.
fn side_of(node: NodeId) -> usize {
    usize::from(node != NODE_A)
}

impl Default for World {
    fn default() -> Self {
        Self::new()
    }
}

impl World {
    /// A fresh world at time zero.
    pub fn new() -> World {
        let start = Instant::now();
        World {
            endpoints: [0, 1].map(|side| endpoint(side, FIRST_INCARNATIONS[side])),
            incarnations: FIRST_INCARNATIONS,
            now: start,
            wire: VecDeque::new(),
            tainted: false,
            sent: BTreeMap::new(),
            delivered: BTreeSet::new(),
            ledgers: Default::default(),
            buf: vec![0; HEADER_LEN + Config::MTU_PAYLOAD + 64],
            trace: false,
            origins: [(0, 0); 2],
        }
    }

    /// Runs every operation of an input.
    pub fn run(data: &[u8]) {
        Self::run_traced(data, false);
    }

    /// Runs every operation of an input; with `trace`, prints each to
    /// standard error before carrying it out (to read a crash's input).
    pub fn run_traced(data: &[u8], trace: bool) {
        let mut world = World::new();
        world.trace = trace;
        let mut u = Unstructured::new(data);
        for first in (0..MAX_OPS).map(|i| i == 0) {
            if u.is_empty() {
                break;
            }
            let Ok(op) = Op::read(&mut u) else {
                break;
            };
            if let (Op::StartSequences { a_to_b, b_to_a }, true) = (&op, first) {
                world.start_at(0, (*a_to_b, *b_to_a));
                world.start_at(1, (*b_to_a, *a_to_b));
            }
            if trace {
                eprintln!("{op:?}");
            }
            world.apply(op);
        }
    }

    /// Starts `side`'s streams at `origin`: its own towards the peer, and
    /// where it expects the peer's.
    fn start_at(&mut self, side: usize, origin: (Seq, Seq)) {
        self.endpoints[side].start_sequences_at(NODES[1 - side], origin.0, origin.1);
        self.origins[side] = origin;
    }

    /// Carries out one operation and checks what came of it.
    pub fn apply(&mut self, op: Op) {
        match op {
            Op::ARequest(payload) => self.send(0, Stream::Request, &payload),
            Op::BRequest(payload) => self.send(1, Stream::Request, &payload),
            Op::BReply(payload) => self.send(1, Stream::Reply, &payload),
            Op::AReply(payload) => self.send(0, Stream::Reply, &payload),
            Op::Advance { micros, scale } => {
                let step = u64::from(micros) << (4 * u32::from(scale));
                self.now += Duration::from_micros(step);
                for endpoint in &mut self.endpoints {
                    endpoint.handle_timeout(self.now);
                }
                self.check_events();
            }
            Op::Transmit => {
                for side in [0, 1] {
                    while let Some((to, len)) =
                        self.endpoints[side].poll_transmit(self.now, &mut self.buf)
                    {
                        let datagram = self.buf[..len].to_vec();
                        let (header, _) =
                            Header::decode(&datagram).expect("an endpoint's own datagram decodes");
                        assert_eq!((header.source, header.destination), (NODES[side], to));
                        if self.wire.len() < WIRE_CAPACITY {
                            self.wire.push_back(InFlight {
                                to,
                                bytes: datagram,
                                sent: self.now,
                                corrupted: false,
                            });
                        }
                    }
                }
                self.check_events();
            }
            Op::Deliver => self.deliver_front(),
            Op::Drop => {
                self.wire.pop_front();
            }
            Op::Duplicate => {
                if let Some(front) = self.wire.front().cloned() {
                    if self.wire.len() < WIRE_CAPACITY {
                        self.wire.push_back(front);
                    }
                }
            }
            Op::Reorder => {
                if let Some(front) = self.wire.pop_front() {
                    self.wire.push_back(front);
                }
            }
            Op::Corrupt { at, xor } => {
                if let Some(front) = self.wire.front_mut() {
                    if !front.bytes.is_empty() {
                        let at = usize::from(at) % front.bytes.len();
                        front.bytes[at] ^= xor.max(1);
                        front.corrupted = true;
                    }
                }
            }
            Op::Raw(bytes) => self.receive(NODE_A, &bytes, true),
            Op::Forged(forgery) => {
                let datagram = forgery.datagram(self.incarnations);
                self.receive(NODE_A, &datagram, true);
            }
            Op::Settle => self.settle(),
            // Taken by `run_traced` when first; nothing later.
            Op::StartSequences { .. } => {}
            Op::RestartA => self.restart(0),
            Op::RestartB => self.restart(1),
        }
    }

    /// `side` restarts: a new endpoint with its next incarnation, and its
    /// ledger afresh; the peer learns of it from its next datagram.
    fn restart(&mut self, side: usize) {
        self.incarnations[side] += 1;
        self.endpoints[side] = endpoint(side, self.incarnations[side]);
        self.origins[side] = (0, 0);
        if self.endpoints[1 - side].peer_incarnation(NODES[side]) == Some(0) {
            // The peer has not heard from this side yet: the new life
            // starts where the peer expects (both sides always agree, as
            // at 0 on real devices).
            let (theirs, own) = self.origins[1 - side];
            self.start_at(side, (own, theirs));
        }
        self.ledgers[side] = Ledger::default();
    }

    fn send(&mut self, side: usize, stream: Stream, payload: &[u8]) {
        let endpoint = &mut self.endpoints[side];
        let peer = NODES[1 - side];
        let result = match stream {
            Stream::Request => endpoint.send(self.now, peer, payload),
            Stream::Reply => endpoint.send_reply(self.now, peer, payload),
        };
        match result {
            Ok(seq) => self.record_send(side, stream, seq, payload),
            Err(SendError::TooLarge { len, max }) => assert!(len > max),
            Err(SendError::WindowFull | SendError::PoolFull | SendError::PeerGone(_)) => {}
            Err(e @ SendError::UnknownPeer(_)) => panic!("refused a peer: {e}"),
        }
        self.check_events();
    }

    /// `side` sent `payload` as `seq` of `stream`.
    fn record_send(&mut self, side: usize, stream: Stream, seq: Seq, payload: &[u8]) {
        let ledger = &mut self.ledgers[side];
        let s = stream_index(stream);
        assert!(ledger.open[s].insert(seq), "seq {seq} handed out twice");
        ledger.ended[s].remove(&seq);
        self.sent
            .insert((side, self.incarnations[side], s, seq), payload.to_vec());
    }

    /// The oldest datagram on the wire reaches its destination.
    fn deliver_front(&mut self) {
        if let Some(datagram) = self.wire.pop_front() {
            let late = self.now.duration_since(datagram.sent) >= config().peer_timeout;
            self.receive(datagram.to, &datagram.bytes, datagram.corrupted || late);
        }
    }

    /// `datagram` reaches `to`; `suspect`: forged, corrupted or late.
    fn receive(&mut self, to: NodeId, datagram: &[u8], suspect: bool) {
        check_codecs(datagram);
        let side = side_of(to);
        let sender = NODES[1 - side];
        let result = self.endpoints[side].receive(self.now, datagram);
        // Drops that leave the endpoint as it was.
        let untouched = matches!(
            result,
            Err(DropReason::Malformed(_)
                | DropReason::Oversized
                | DropReason::WrongFabric
                | DropReason::WrongDestination
                | DropReason::UnknownSource)
        );
        if suspect && !untouched {
            self.tainted = true;
        }
        if self.trace {
            if let Err(e) = &result {
                eprintln!("  node {to} dropped: {e:?}");
            }
        }
        let delivered = match result {
            Ok(Some(Message {
                node,
                stream,
                seq,
                payload,
            })) => Some((node, stream, seq, payload.to_vec())),
            Ok(None) | Err(_) => None,
        };
        // The receiver took a life of its peer that is not the peer's
        // newest (two late copies of a datagram of a life that ended can
        // pass for its answer to an introduction: the limit
        // `pindown_emu_device::net` documents).
        if self.endpoints[side]
            .peer_incarnation(sender)
            .is_some_and(|peer| peer != 0 && peer != self.incarnations[1 - side])
        {
            self.tainted = true;
        }
        // What the datagram did first (a restart it revealed resets seqs).
        self.check_events();
        if let Some((node, stream, seq, payload)) = delivered {
            assert_eq!(node, sender, "a message from a node that is not a peer");
            self.check_delivery(side, stream, seq, &payload);
            if stream == Stream::Request {
                // The reply the request's room was kept for.
                match self.endpoints[side].send_reply(self.now, sender, b"answer") {
                    Ok(seq) => self.record_send(side, Stream::Reply, seq, b"answer"),
                    Err(e) => panic!("a delivered request could not be answered: {e}"),
                }
            }
        }
        self.check_events();
    }

    /// [`Op::Settle`].
    fn settle(&mut self) {
        let config = config();
        let end = self.now + config.peer_timeout * 2 + config.rto_max * 2;
        // Datagrams already on the wire arrive first.
        while !self.wire.is_empty() {
            self.deliver_front();
        }
        let mut buf = std::mem::take(&mut self.buf);
        while self.now < end {
            let mut moved = true;
            while moved {
                moved = false;
                for side in [0, 1] {
                    if let Some((to, len)) = self.endpoints[side].poll_transmit(self.now, &mut buf)
                    {
                        moved = true;
                        let datagram = buf[..len].to_vec();
                        if self.trace {
                            let (h, _) = Header::decode(&datagram).expect("own datagram");
                            eprintln!(
                                "  settle: {} -> {to}: src inc {:#x} dst inc {:#x} seq {:?} acks {:?}/{:?}",
                                h.source, h.source_incarnation, h.destination_incarnation, h.seq,
                                h.requests, h.replies
                            );
                        }
                        self.receive(to, &datagram, false);
                    }
                }
            }
            let next = self
                .endpoints
                .iter()
                .filter_map(Endpoint::poll_timeout)
                .min()
                .unwrap_or(end);
            self.now = next.clamp(self.now + Duration::from_micros(1), end);
            for endpoint in &mut self.endpoints {
                endpoint.handle_timeout(self.now);
            }
            self.check_events();
        }
        self.buf = buf;
        for (node, ledger) in NODES.iter().zip(&self.ledgers) {
            assert!(
                ledger.open.iter().all(BTreeSet::is_empty),
                "node {node}: messages still not ended after settling: {:?}",
                ledger.open
            );
        }
    }

    /// While nothing was forged, corrupted or late: at most once per
    /// incarnation of both sides, stream and seq, and the bytes the peer
    /// sent.
    fn check_delivery(&mut self, side: usize, stream: Stream, seq: Seq, payload: &[u8]) {
        let receiver = &self.endpoints[side];
        let to = NODES[side];
        let incarnation = receiver
            .peer_incarnation(NODES[1 - side])
            .expect("a peer that delivered has an incarnation");
        let s = stream_index(stream);
        if self.trace {
            eprintln!("  node {to} delivered {stream:?} {seq} from incarnation {incarnation:#x}");
        }
        let own = receiver.identity().incarnation;
        let first = self.delivered.insert((to, own, incarnation, s, seq));
        if self.tainted {
            return;
        }
        assert!(
            first,
            "node {to} delivered seq {seq} of stream {stream:?} twice"
        );
        let sent = self
            .sent
            .get(&(1 - side, incarnation, s, seq))
            .unwrap_or_else(|| panic!("node {to} delivered a message its peer never sent"));
        assert_eq!(
            sent.as_slice(),
            payload,
            "node {to} delivered other bytes than its peer sent"
        );
    }

    /// Every event of both endpoints against the ledgers.
    fn check_events(&mut self) {
        for side in [0, 1] {
            let node = NODES[side];
            let peer_node = NODES[1 - side];
            while let Some(event) = self.endpoints[side].poll_event() {
                let endpoint = &self.endpoints[side];
                if self.trace {
                    eprintln!("  node {node}: {event:?}");
                }
                if let (
                    Event::Acked {
                        node: peer,
                        stream,
                        seq,
                        ..
                    },
                    false,
                ) = (event, self.tainted)
                {
                    // An acknowledgement means the peer delivered it.
                    let (own, theirs) = (
                        endpoint.identity().incarnation,
                        endpoint
                            .peer_incarnation(peer)
                            .expect("an acknowledging peer is known"),
                    );
                    assert!(
                        self.delivered
                            .contains(&(peer, theirs, own, stream_index(stream), seq)),
                        "node {node}: {stream:?} {seq} acknowledged, never delivered"
                    );
                }
                let ledger = &mut self.ledgers[side];
                match event {
                    Event::Acked { stream, seq, .. } | Event::Abandoned { stream, seq, .. } => {
                        let s = stream_index(stream);
                        assert!(
                            ledger.open[s].remove(&seq),
                            "node {node}: {event:?} of a seq not outstanding (ended before: {})",
                            ledger.ended[s].contains(&seq)
                        );
                        ledger.ended[s].insert(seq);
                    }
                    Event::PeerGone { .. } | Event::PeerRestarted { .. } => {
                        assert!(
                            ledger.open.iter().all(BTreeSet::is_empty),
                            "node {node}: {event:?} with messages not ended: {:?}",
                            ledger.open
                        );
                        if matches!(event, Event::PeerRestarted { .. }) {
                            // Seqs start again from 0 in both directions.
                            *ledger = Ledger::default();
                            self.origins[side] = (0, 0);
                        }
                    }
                    Event::PeerAbandoned { .. } => {}
                }
            }
            let open = &self.ledgers[side].open;
            assert_eq!(
                self.endpoints[side].outstanding(peer_node),
                Some(open[0].len() + open[1].len()),
                "node {node}: outstanding against the sends not ended"
            );
        }
    }
}

/// A datagram to A from B's address with a well-formed header of any
/// field values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Forgery {
    /// Bit 0: it carries a message; bit 1: a reply; bit 2: a probe; bit 3:
    /// a probe echo; bit 4: the source incarnation is B's real one (else
    /// `incarnation`); bit 5: it names A's incarnation (else none).
    pub flags: u8,
    /// The claimed source incarnation, when not B's (0 counts as 1).
    pub incarnation: u64,
    /// seq, horizon, and the request and reply streams' ack and floor.
    pub numbers: [u32; 6],
    /// The request and reply streams' selective acks.
    pub sacks: [u64; 2],
    /// The payload (only with a message).
    pub payload: Vec<u8>,
}

impl Forgery {
    /// Appends the header fields in the input format (the payload follows
    /// as a length and its bytes).
    fn encode(&self, out: &mut Vec<u8>) {
        out.push(self.flags);
        out.extend_from_slice(&self.incarnation.to_le_bytes());
        for n in self.numbers {
            out.extend_from_slice(&n.to_le_bytes());
        }
        for s in self.sacks {
            out.extend_from_slice(&s.to_le_bytes());
        }
    }

    /// The datagram, A's and B's current incarnations being
    /// `incarnations`.
    fn datagram(&self, incarnations: [u64; 2]) -> Vec<u8> {
        let (flags, numbers) = (self.flags, self.numbers);
        let message = flags & 1 != 0;
        let payload: &[u8] = if message { &self.payload } else { &[] };
        let payload = &payload[..payload.len().min(usize::from(u16::MAX))];
        let header = Header {
            fabric: FABRIC,
            source: NODE_B,
            destination: NODE_A,
            source_incarnation: if flags & 16 != 0 {
                incarnations[1]
            } else {
                self.incarnation.max(1)
            },
            destination_incarnation: if flags & 32 != 0 { incarnations[0] } else { 0 },
            seq: message.then_some(numbers[0]),
            reply: message && flags & 2 != 0,
            probe: message && flags & 4 != 0,
            probe_echo: flags & 8 != 0,
            horizon: numbers[1],
            requests: StreamHeader {
                ack: numbers[2],
                floor: numbers[3],
                sack: self.sacks[0],
            },
            replies: StreamHeader {
                ack: numbers[4],
                floor: numbers[5],
                sack: self.sacks[1],
            },
            payload_len: payload.len() as u16,
        };
        let mut datagram = vec![0; HEADER_LEN];
        header.encode(&mut datagram);
        datagram.extend_from_slice(payload);
        datagram
    }
}

/// Decoders of the fabric on any bytes: what decodes encodes back.
fn check_codecs(datagram: &[u8]) {
    if let Ok((header, payload)) = Header::decode(datagram) {
        let mut again = vec![0; HEADER_LEN];
        header.encode(&mut again);
        assert_eq!(
            again,
            datagram[..HEADER_LEN],
            "a header re-encodes to other bytes"
        );
        check_payload(payload);
    }
    check_payload(datagram);
}

fn check_payload(bytes: &[u8]) {
    if let Ok(message) = FabricMessage::decode(bytes) {
        let mut encoded = Vec::new();
        message.encode(&mut encoded);
        assert_eq!(
            FabricMessage::decode(&encoded),
            Ok(message),
            "a fabric message re-encodes to bytes that decode otherwise"
        );
    }
    if let Ok(frame) = FrameDatagram::decode(bytes) {
        let mut encoded = Vec::new();
        frame.encode(&mut encoded);
        assert_eq!(encoded, bytes, "a frame datagram re-encodes to other bytes");
    }
}
