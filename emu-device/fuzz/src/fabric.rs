//! The fabric fuzz target's world: two reliable-datagram endpoints of one
//! fabric (node 1, *A*, and node 2, *B*) on a clock that only the input
//! moves, a wire between them that the input drives (deliver, drop,
//! duplicate, reorder, corrupt), and a hostile sender that speaks to A
//! with raw bytes or with well-formed headers carrying any field values.
//!
//! An input is a sequence of operations, each a byte `k` naming one of
//! [`Op`] (`k % Op::COUNT`) followed by its arguments; the sequence ends
//! where the input ends. [`Op::encode`] writes one (the seed generator
//! uses it).
//!
//! What the world asserts on every run:
//! - while no forged, corrupted or late datagram (on the wire for the
//!   peer timeout) got past the checks that leave an endpoint as it was
//!   (format, token, nodes), and A never took a life of B other than B's
//!   newest (two late copies of a datagram of a life that ended can pass
//!   for its answer to an introduction): a message is
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
/// A's incarnation (B's first is [`B_FIRST_INCARNATION`], then one more
/// at each restart).
pub const A_INCARNATION: u64 = 0xa;
/// B's first incarnation.
pub const B_FIRST_INCARNATION: u64 = 0xb;
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

impl Op {
    /// Number of kinds.
    pub const COUNT: u8 = 16;

    /// Reads one operation; `Err` when the input ends.
    pub fn read(u: &mut Unstructured<'_>) -> arbitrary::Result<Op> {
        let kind = u.arbitrary::<u8>()? % Self::COUNT;
        let bytes = |u: &mut Unstructured<'_>| -> arbitrary::Result<Vec<u8>> {
            let len = usize::from(u.arbitrary::<u16>()?) % (Config::MTU_PAYLOAD + 64);
            Ok(u.bytes(len.min(u.len()))?.to_vec())
        };
        Ok(match kind {
            0 => Op::ARequest(bytes(u)?),
            1 => Op::BRequest(bytes(u)?),
            2 => Op::BReply(bytes(u)?),
            3 => Op::Advance {
                micros: u.arbitrary()?,
                scale: u.arbitrary::<u8>()? % 8,
            },
            4 => Op::Transmit,
            5 => Op::Deliver,
            6 => Op::Drop,
            7 => Op::Duplicate,
            8 => Op::Reorder,
            9 => Op::Corrupt {
                at: u.arbitrary()?,
                xor: u.arbitrary()?,
            },
            10 => Op::Raw(bytes(u)?),
            11 => Op::Forged(Forgery {
                flags: u.arbitrary()?,
                incarnation: u.arbitrary()?,
                numbers: u.arbitrary()?,
                sacks: u.arbitrary()?,
                payload: bytes(u)?,
            }),
            12 => Op::RestartB,
            13 => Op::Settle,
            14 => Op::AReply(bytes(u)?),
            _ => Op::StartSequences {
                a_to_b: u.arbitrary()?,
                b_to_a: u.arbitrary()?,
            },
        })
    }

    /// Appends the operation in the input format.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let bytes = |out: &mut Vec<u8>, b: &[u8]| {
            out.extend_from_slice(&(b.len() as u16).to_le_bytes());
            out.extend_from_slice(b);
        };
        match self {
            Op::ARequest(b) => {
                out.push(0);
                bytes(out, b);
            }
            Op::BRequest(b) => {
                out.push(1);
                bytes(out, b);
            }
            Op::BReply(b) => {
                out.push(2);
                bytes(out, b);
            }
            Op::Advance { micros, scale } => {
                out.push(3);
                out.extend_from_slice(&micros.to_le_bytes());
                out.push(*scale);
            }
            Op::Transmit => out.push(4),
            Op::Deliver => out.push(5),
            Op::Drop => out.push(6),
            Op::Duplicate => out.push(7),
            Op::Reorder => out.push(8),
            Op::Corrupt { at, xor } => {
                out.push(9);
                out.extend_from_slice(&at.to_le_bytes());
                out.push(*xor);
            }
            Op::Raw(b) => {
                out.push(10);
                bytes(out, b);
            }
            Op::Forged(forgery) => {
                out.push(11);
                forgery.encode(out);
                bytes(out, &forgery.payload);
            }
            Op::RestartB => out.push(12),
            Op::Settle => out.push(13),
            Op::AReply(b) => {
                out.push(14);
                bytes(out, b);
            }
            Op::StartSequences { a_to_b, b_to_a } => {
                out.push(15);
                out.extend_from_slice(&a_to_b.to_le_bytes());
                out.extend_from_slice(&b_to_a.to_le_bytes());
            }
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
    a: Endpoint,
    b: Endpoint,
    b_incarnation: u64,
    now: Instant,
    /// Datagrams in flight.
    wire: VecDeque<InFlight>,
    /// Whether a forged, corrupted or late datagram (on the wire for the
    /// peer timeout) got past the checks that leave an endpoint as it was,
    /// or A took a life of B that is not B's newest.
    tainted: bool,
    /// Payloads B sent, by (B's incarnation, stream, seq).
    sent_by_b: BTreeMap<(u64, usize, Seq), Vec<u8>>,
    /// What each endpoint delivered: (receiver, its incarnation, the
    /// sender's incarnation, stream, seq).
    delivered: BTreeSet<(NodeId, u64, u64, usize, Seq)>,
    ledgers: [Ledger; 2],
    buf: Vec<u8>,
    /// Print operations, deliveries and events to standard error.
    trace: bool,
    /// Where the streams started (A's towards B, B's towards A).
    first_seqs: (Seq, Seq),
}

fn config() -> Config {
    Config {
        window: 8,
        // Fewer than both streams' windows: the pool fills first.
        pool_slots: 12,
        ..Config::default()
    }
}

fn endpoint(node: NodeId, peer: NodeId, incarnation: u64) -> Endpoint {
    let identity = Identity {
        fabric: FABRIC,
        node,
        incarnation,
    };
    let mut endpoint = Endpoint::new(identity, config()).expect("the fuzz config is valid");
    endpoint.add_peer(peer).expect("a new peer");
    endpoint
}

fn stream_index(stream: Stream) -> usize {
    match stream {
        Stream::Request => 0,
        Stream::Reply => 1,
    }
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
            a: endpoint(NODE_A, NODE_B, A_INCARNATION),
            b: endpoint(NODE_B, NODE_A, B_FIRST_INCARNATION),
            b_incarnation: B_FIRST_INCARNATION,
            now: start,
            wire: VecDeque::new(),
            tainted: false,
            sent_by_b: BTreeMap::new(),
            delivered: BTreeSet::new(),
            ledgers: Default::default(),
            buf: vec![0; HEADER_LEN + Config::MTU_PAYLOAD + 64],
            trace: false,
            first_seqs: (0, 0),
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
                world.a.start_sequences_at(NODE_B, *a_to_b, *b_to_a);
                world.b.start_sequences_at(NODE_A, *b_to_a, *a_to_b);
                world.first_seqs = (*a_to_b, *b_to_a);
            }
            if trace {
                eprintln!("{op:?}");
            }
            world.apply(op);
        }
    }

    /// Carries out one operation and checks what came of it.
    pub fn apply(&mut self, op: Op) {
        match op {
            Op::ARequest(payload) => self.send(NODE_A, Stream::Request, &payload),
            Op::BRequest(payload) => self.send(NODE_B, Stream::Request, &payload),
            Op::BReply(payload) => self.send(NODE_B, Stream::Reply, &payload),
            Op::AReply(payload) => self.send(NODE_A, Stream::Reply, &payload),
            Op::Advance { micros, scale } => {
                let step = u64::from(micros) << (4 * u32::from(scale));
                self.now += Duration::from_micros(step);
                self.a.handle_timeout(self.now);
                self.b.handle_timeout(self.now);
                self.check_events();
            }
            Op::Transmit => {
                for node in [NODE_A, NODE_B] {
                    loop {
                        let endpoint = if node == NODE_A {
                            &mut self.a
                        } else {
                            &mut self.b
                        };
                        let Some((to, len)) = endpoint.poll_transmit(self.now, &mut self.buf)
                        else {
                            break;
                        };
                        let datagram = self.buf[..len].to_vec();
                        let (header, _) =
                            Header::decode(&datagram).expect("an endpoint's own datagram decodes");
                        assert_eq!((header.source, header.destination), (node, to));
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
                let datagram = forgery.datagram(self.b_incarnation);
                self.receive(NODE_A, &datagram, true);
            }
            Op::Settle => self.settle(),
            // Taken by `run_traced` when first; nothing later.
            Op::StartSequences { .. } => {}
            Op::RestartB => {
                self.b_incarnation += 1;
                self.b = endpoint(NODE_B, NODE_A, self.b_incarnation);
                if self.a.peer_incarnation(NODE_B) == Some(0) {
                    // A has not heard from B yet: its streams are where they
                    // started, and so are the new life's (both sides start
                    // where the other expects, as at 0 on real devices).
                    let (a_to_b, b_to_a) = self.first_seqs;
                    self.b.start_sequences_at(NODE_A, b_to_a, a_to_b);
                }
                // B's new life starts its ledger afresh; A learns of it from
                // B's next datagram.
                self.ledgers[1] = Ledger::default();
            }
        }
    }

    fn send(&mut self, from: NodeId, stream: Stream, payload: &[u8]) {
        let (endpoint, peer) = if from == NODE_A {
            (&mut self.a, NODE_B)
        } else {
            (&mut self.b, NODE_A)
        };
        let result = match stream {
            Stream::Request => endpoint.send(self.now, peer, payload),
            Stream::Reply => endpoint.send_reply(self.now, peer, payload),
        };
        match result {
            Ok(seq) => {
                let ledger = &mut self.ledgers[usize::from(from != NODE_A)];
                let s = stream_index(stream);
                assert!(ledger.open[s].insert(seq), "seq {seq} handed out twice");
                ledger.ended[s].remove(&seq);
                if from == NODE_B {
                    self.sent_by_b
                        .insert((self.b_incarnation, s, seq), payload.to_vec());
                }
            }
            Err(SendError::TooLarge { len, max }) => assert!(len > max),
            Err(SendError::WindowFull | SendError::PoolFull | SendError::PeerGone(_)) => {}
            Err(e @ SendError::UnknownPeer(_)) => panic!("refused a peer: {e}"),
        }
        self.check_events();
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
        let (receiver, sender) = if to == NODE_A {
            (&mut self.a, NODE_B)
        } else {
            (&mut self.b, NODE_A)
        };
        let result = receiver.receive(self.now, datagram);
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
        // A took a life of B that is not B's newest for B (two late copies
        // of a datagram of a life that ended can pass for its answer to an
        // introduction: the limit `pindown_emu_device::net` documents).
        if to == NODE_A
            && self
                .a
                .peer_incarnation(NODE_B)
                .is_some_and(|b| b != 0 && b != self.b_incarnation)
        {
            self.tainted = true;
        }
        // What the datagram did first (a restart it revealed resets seqs).
        self.check_events();
        if let Some((node, stream, seq, payload)) = delivered {
            assert_eq!(node, sender, "a message from a node that is not a peer");
            self.check_delivery(to, stream, seq, &payload);
            if stream == Stream::Request {
                // The reply the request's room was kept for.
                let receiver = if to == NODE_A {
                    &mut self.a
                } else {
                    &mut self.b
                };
                let reply = receiver.send_reply(self.now, sender, b"answer");
                match reply {
                    Ok(seq) => {
                        let ledger = &mut self.ledgers[usize::from(to != NODE_A)];
                        assert!(ledger.open[1].insert(seq), "seq {seq} handed out twice");
                        ledger.ended[1].remove(&seq);
                        if to == NODE_B {
                            self.sent_by_b
                                .insert((self.b_incarnation, 1, seq), b"answer".to_vec());
                        }
                    }
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
                for node in [NODE_A, NODE_B] {
                    let endpoint = if node == NODE_A {
                        &mut self.a
                    } else {
                        &mut self.b
                    };
                    if let Some((to, len)) = endpoint.poll_transmit(self.now, &mut buf) {
                        moved = true;
                        let datagram = buf[..len].to_vec();
                        if self.trace {
                            let (h, _) = Header::decode(&datagram).expect("own datagram");
                            eprintln!("  settle: {} -> {to}: src inc {:#x} dst inc {:#x} seq {:?} acks {:?}/{:?}", h.source, h.source_incarnation, h.destination_incarnation, h.seq, h.requests, h.replies);
                        }
                        self.receive(to, &datagram, false);
                    }
                }
            }
            let next = [self.a.poll_timeout(), self.b.poll_timeout()]
                .into_iter()
                .flatten()
                .min()
                .unwrap_or(end);
            self.now = next.clamp(self.now + Duration::from_micros(1), end);
            self.a.handle_timeout(self.now);
            self.b.handle_timeout(self.now);
            self.check_events();
        }
        self.buf = buf;
        for (node, ledger) in [NODE_A, NODE_B].iter().zip(&self.ledgers) {
            assert!(
                ledger.open.iter().all(BTreeSet::is_empty),
                "node {node}: messages still not ended after settling: {:?}",
                ledger.open
            );
        }
    }

    /// While nothing was forged, corrupted or late: at most once per
    /// incarnation of both sides, stream and seq, and the bytes B sent.
    fn check_delivery(&mut self, to: NodeId, stream: Stream, seq: Seq, payload: &[u8]) {
        let (receiver, sender) = if to == NODE_A {
            (&self.a, NODE_B)
        } else {
            (&self.b, NODE_A)
        };
        let incarnation = receiver
            .peer_incarnation(sender)
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
        if to == NODE_A {
            let sent = self
                .sent_by_b
                .get(&(incarnation, s, seq))
                .expect("A delivered a message B never sent");
            assert_eq!(
                sent.as_slice(),
                payload,
                "A delivered other bytes than B sent"
            );
        }
    }

    /// Every event of both endpoints against the ledgers.
    fn check_events(&mut self) {
        for node in [NODE_A, NODE_B] {
            let side = usize::from(node != NODE_A);
            loop {
                let endpoint = if node == NODE_A {
                    &mut self.a
                } else {
                    &mut self.b
                };
                let Some(event) = endpoint.poll_event() else {
                    break;
                };
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
                        }
                    }
                    Event::PeerAbandoned { .. } => {}
                }
            }
            let (endpoint, peer) = if node == NODE_A {
                (&self.a, NODE_B)
            } else {
                (&self.b, NODE_A)
            };
            let open = &self.ledgers[side].open;
            assert_eq!(
                endpoint.outstanding(peer),
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

    /// The datagram, B's current incarnation being `b_incarnation`.
    fn datagram(&self, b_incarnation: u64) -> Vec<u8> {
        let (flags, numbers) = (self.flags, self.numbers);
        let message = flags & 1 != 0;
        let payload: &[u8] = if message { &self.payload } else { &[] };
        let payload = &payload[..payload.len().min(usize::from(u16::MAX))];
        let header = Header {
            fabric: FABRIC,
            source: NODE_B,
            destination: NODE_A,
            source_incarnation: if flags & 16 != 0 {
                b_incarnation
            } else {
                self.incarnation.max(1)
            },
            destination_incarnation: if flags & 32 != 0 { A_INCARNATION } else { 0 },
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
