//! A simulated network for the tests: endpoints on a virtual clock, every
//! direction through its own [`FaultInjector`]. No threads, no sleeps:
//! the same seed gives the same run.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use super::wire::Header;
use super::{
    Config, DropReason, Endpoint, Event, FaultInjector, Faults, Identity, NodeId, Seq, Stream,
};

/// The fabric token of simulated networks.
pub const FABRIC: u64 = 0xfab1_c0de;

/// One datagram put on the wire.
#[derive(Debug, Clone)]
pub struct Transmission {
    pub at: Instant,
    pub from: NodeId,
    pub to: NodeId,
    pub header: Header,
    pub bytes: Vec<u8>,
}

/// One message handed out by `receive`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery {
    pub at: Instant,
    pub from: NodeId,
    pub stream: Stream,
    pub seq: Seq,
    pub payload: Vec<u8>,
}

/// Decides which transmissions the wire loses (`true` = lost).
pub type DropFilter = Box<dyn FnMut(&Transmission) -> bool>;

/// What a node's application does with a delivered message: the responses
/// to send back at once (to any node).
pub type Responder = Box<dyn FnMut(NodeId, &Delivery) -> Vec<(NodeId, Vec<u8>)>>;

pub struct SimNode {
    pub endpoint: Endpoint,
    /// Messages the application wants to send, retried while the endpoint
    /// refuses them for want of room.
    pub outbox: VecDeque<(NodeId, Vec<u8>)>,
    /// Sequence numbers given to messages from the outbox and responses,
    /// with their destination and payload.
    pub sent: Vec<(NodeId, Stream, Seq, Vec<u8>)>,
    pub delivered: Vec<Delivery>,
    pub events: Vec<(Instant, Event)>,
    pub drops: Vec<DropReason>,
    /// Datagrams accepted that carried no message.
    pub acks_only: u64,
    /// Halted nodes neither send nor receive (a crashed process).
    pub halted: bool,
    /// A stalled node does nothing until then (a process that is not
    /// scheduled): datagrams to it wait on the wire, in order.
    pub stalled_until: Option<Instant>,
    /// A node that takes at most this many datagrams at one instant and is
    /// then busy (stalled) this long, as a device's link takes a bounded
    /// number a pass.
    pub receive_batch: Option<(usize, Duration)>,
}

impl SimNode {
    fn stalled_at(&self, now: Instant) -> bool {
        self.stalled_until.is_some_and(|until| until > now)
    }
}

pub struct Sim {
    pub start: Instant,
    pub now: Instant,
    pub nodes: Vec<SimNode>,
    links: HashMap<(NodeId, NodeId), FaultInjector>,
    pub transmissions: Vec<Transmission>,
    pub responders: HashMap<NodeId, Responder>,
    /// Transmissions for which this returns `true` are lost on the wire.
    pub drop_filter: Option<DropFilter>,
    /// Every change of `delivered_through`: (when, receiver, sender,
    /// stream, value).
    pub through_log: Vec<(Instant, NodeId, NodeId, Stream, Seq)>,
    /// Check after every receive that every seq below `delivered_through`
    /// was delivered (off when peers abandon messages).
    pub check_cumulative: bool,
    buf: Vec<u8>,
}

impl Sim {
    /// `count` fully connected nodes, every direction with `faults` (the
    /// seed varied per direction).
    pub fn new(count: u16, config: Config, faults: Faults) -> Self {
        let start = Instant::now();
        let nodes = (0..count)
            .map(|node| SimNode {
                endpoint: Self::endpoint(node, 0x1000 + u64::from(node), config, count),
                outbox: VecDeque::new(),
                sent: Vec::new(),
                delivered: Vec::new(),
                events: Vec::new(),
                drops: Vec::new(),
                acks_only: 0,
                halted: false,
                stalled_until: None,
                receive_batch: None,
            })
            .collect();
        let mut links = HashMap::new();
        for from in 0..count {
            for to in 0..count {
                if from != to {
                    let seed = faults
                        .seed
                        .wrapping_mul(1_000_003)
                        .wrapping_add(u64::from(from) * 1000 + u64::from(to));
                    links.insert((from, to), FaultInjector::new(Faults { seed, ..faults }));
                }
            }
        }
        Self {
            start,
            now: start,
            nodes,
            links,
            transmissions: Vec::new(),
            responders: HashMap::new(),
            drop_filter: None,
            through_log: Vec::new(),
            check_cumulative: true,
            buf: vec![0; super::wire::HEADER_LEN + config.max_payload],
        }
    }

    pub fn endpoint(node: NodeId, incarnation: u64, config: Config, count: u16) -> Endpoint {
        let identity = Identity {
            fabric: FABRIC,
            node,
            incarnation,
        };
        let mut endpoint = Endpoint::new(identity, config).unwrap();
        for peer in (0..count).filter(|&peer| peer != node) {
            endpoint.add_peer(peer).unwrap();
        }
        endpoint
    }

    /// What all links did, summed; and how many datagrams they still hold.
    pub fn link_totals(&self) -> (super::FaultStats, usize) {
        let mut total = super::FaultStats::default();
        let mut held = 0;
        for link in self.links.values() {
            let stats = link.stats();
            total.pushed += stats.pushed;
            total.lost += stats.lost;
            total.duplicated += stats.duplicated;
            total.reordered += stats.reordered;
            total.overflowed += stats.overflowed;
            total.released += stats.released;
            held += link.held();
        }
        (total, held)
    }

    /// Starts every pair's sequence numbers at `first` (to test wrapping).
    pub fn start_sequences_at(&mut self, first: Seq) {
        let count = self.nodes.len() as NodeId;
        for node in 0..count {
            for peer in (0..count).filter(|&peer| peer != node) {
                self.nodes[usize::from(node)]
                    .endpoint
                    .start_sequences_at(peer, first, first);
            }
        }
        self.check_cumulative = false;
    }

    pub fn set_faults(&mut self, from: NodeId, to: NodeId, faults: Faults) {
        self.links.insert((from, to), FaultInjector::new(faults));
    }

    /// Replaces node `node` by a fresh process with `incarnation`.
    pub fn restart(&mut self, node: NodeId, incarnation: u64) {
        let config = *self.nodes[usize::from(node)].endpoint.config();
        let count = self.nodes.len() as u16;
        let sim_node = &mut self.nodes[usize::from(node)];
        sim_node.endpoint = Self::endpoint(node, incarnation, config, count);
        sim_node.outbox.clear();
        sim_node.halted = false;
    }

    /// Lets `idle` of virtual time pass while nothing is to be done (the
    /// endpoints' clocks are started first, at the current time).
    pub fn idle(&mut self, idle: Duration) {
        for node in &mut self.nodes {
            node.endpoint.handle_timeout(self.now);
        }
        assert_eq!(self.next_wakeup(), None, "work pending");
        assert!(self.nodes.iter().all(|node| node.outbox.is_empty()));
        self.now += idle;
    }

    pub fn elapsed(&self) -> Duration {
        self.now - self.start
    }

    /// Queues a message from the application of `from`.
    pub fn queue(&mut self, from: NodeId, to: NodeId, payload: Vec<u8>) {
        self.nodes[usize::from(from)]
            .outbox
            .push_back((to, payload));
    }

    fn send_now(
        &mut self,
        from: NodeId,
        to: NodeId,
        payload: &[u8],
    ) -> Result<Seq, super::SendError> {
        let node = &mut self.nodes[usize::from(from)];
        let seq = node.endpoint.send(self.now, to, payload)?;
        node.sent.push((to, Stream::Request, seq, payload.to_vec()));
        Ok(seq)
    }

    /// Does everything due at `now`; returns `true` when anything
    /// happened.
    fn step(&mut self) -> bool {
        let mut busy = false;
        let now = self.now;
        for index in 0..self.nodes.len() {
            let from = index as NodeId;
            if self.nodes[index].halted || self.nodes[index].stalled_at(now) {
                continue;
            }
            if self.nodes[index]
                .endpoint
                .poll_timeout()
                .is_some_and(|at| at <= now)
            {
                self.nodes[index].endpoint.handle_timeout(now);
            }
            // The application's own messages, as far as there is room.
            while let Some((to, payload)) = self.nodes[index].outbox.front().cloned() {
                match self.send_now(from, to, &payload) {
                    Ok(_) => {
                        self.nodes[index].outbox.pop_front();
                        busy = true;
                    }
                    Err(error) if error.is_would_block() => break,
                    Err(error) => {
                        // A gone peer: the application gives the message up.
                        assert!(matches!(error, super::SendError::PeerGone(_)), "{error}");
                        self.nodes[index].outbox.pop_front();
                    }
                }
            }
            while let Some((to, len)) = self.nodes[index].endpoint.poll_transmit(now, &mut self.buf)
            {
                let datagram = &self.buf[..len];
                let (header, _) =
                    Header::decode(datagram).expect("the endpoint sends valid datagrams");
                assert_eq!(header.destination, to);
                let transmission = Transmission {
                    at: now,
                    from,
                    to,
                    header,
                    bytes: datagram.to_vec(),
                };
                let lost = self
                    .drop_filter
                    .as_mut()
                    .is_some_and(|filter| filter(&transmission));
                if !lost {
                    self.links
                        .get_mut(&(from, to))
                        .expect("a link to every other node")
                        .push(now, datagram);
                }
                self.transmissions.push(transmission);
                busy = true;
            }
        }
        let mut keys: Vec<_> = self.links.keys().copied().collect();
        keys.sort_unstable();
        let mut taken = vec![0usize; self.nodes.len()];
        for (from, to) in keys {
            let receiver = usize::from(to);
            if self.nodes[receiver].stalled_at(now) {
                continue;
            }
            let most = self.nodes[receiver]
                .receive_batch
                .map_or(usize::MAX, |(most, _)| most);
            while taken[receiver] < most {
                let Some(datagram) = self.links.get_mut(&(from, to)).unwrap().pop_ready(now) else {
                    break;
                };
                busy = true;
                taken[receiver] += 1;
                self.deliver(to, &datagram);
            }
        }
        for (node, taken) in self.nodes.iter_mut().zip(taken) {
            if let Some((most, busy_for)) = node.receive_batch {
                if taken >= most {
                    node.stalled_until = Some(now + busy_for);
                }
            }
        }
        for node in &mut self.nodes {
            while let Some(event) = node.endpoint.poll_event() {
                node.events.push((now, event));
                busy = true;
            }
        }
        busy
    }

    fn deliver(&mut self, to: NodeId, datagram: &[u8]) {
        let now = self.now;
        let node = &mut self.nodes[usize::from(to)];
        if node.halted {
            return;
        }
        let from = Header::decode(datagram)
            .map(|(header, _)| header.source)
            .ok();
        let through = |endpoint: &Endpoint, from: Option<NodeId>| {
            from.map(|from| {
                Stream::ALL.map(|stream| endpoint.delivered_through(from, stream).unwrap())
            })
        };
        let through_before = through(&node.endpoint, from);
        let result = node.endpoint.receive(now, datagram);
        if let (Some(from), Some(before), Some(after)) =
            (from, through_before, through(&node.endpoint, from))
        {
            for (index, stream) in Stream::ALL.into_iter().enumerate() {
                if before[index] != after[index] {
                    self.through_log.push((now, to, from, stream, after[index]));
                }
            }
        }
        let delivery = match result {
            Ok(Some(message)) => Delivery {
                at: now,
                from: message.node,
                stream: message.stream,
                seq: message.seq,
                payload: message.payload.to_vec(),
            },
            Ok(None) => {
                node.acks_only += 1;
                return;
            }
            Err(reason) => {
                node.drops.push(reason);
                return;
            }
        };
        node.delivered.push(delivery.clone());
        if self.check_cumulative {
            let through = node
                .endpoint
                .delivered_through(delivery.from, delivery.stream)
                .unwrap();
            let mut seen: Vec<Seq> = node
                .delivered
                .iter()
                .filter(|earlier| {
                    earlier.from == delivery.from && earlier.stream == delivery.stream
                })
                .map(|earlier| earlier.seq)
                .collect();
            seen.sort_unstable();
            seen.dedup();
            // Seqs start at 0 per incarnation and stay far from wrapping here.
            let contiguous = seen
                .iter()
                .enumerate()
                .take_while(|(i, seq)| *i as Seq == **seq)
                .count();
            assert!(
                contiguous as Seq >= through,
                "node {to}: delivered_through({}) = {through} but only {contiguous} delivered in order",
                delivery.from
            );
        }
        // The application handles the message before anything more is
        // transmitted: its responses get their seqs now.
        if let Some(responder) = self.responders.get_mut(&to) {
            for (dest, payload) in responder(to, &delivery) {
                let node = &mut self.nodes[usize::from(to)];
                let seq = node
                    .endpoint
                    .send_reply(now, dest, &payload)
                    .expect("response_reserve leaves room for the replies");
                node.sent.push((dest, Stream::Reply, seq, payload));
            }
        }
    }

    /// When anything happens next.
    fn next_wakeup(&self) -> Option<Instant> {
        // A stalled node's timers and datagrams wait for its resumption.
        let resumed = |node: &SimNode, at: Instant| match node.stalled_until {
            Some(until) => at.max(until),
            None => at,
        };
        let timers = self
            .nodes
            .iter()
            .filter(|node| !node.halted)
            .filter_map(|node| Some(resumed(node, node.endpoint.poll_timeout()?)));
        let links = self.links.iter().filter_map(|(&(_, to), link)| {
            Some(resumed(&self.nodes[usize::from(to)], link.next_ready()?))
        });
        timers.chain(links).min()
    }

    /// Runs until nothing is left to do or `limit` of virtual time passed.
    /// Panics when the endpoints spin (many steps at one instant).
    pub fn run_for(&mut self, limit: Duration) {
        let end = self.now + limit;
        let mut steps_at_this_instant = 0;
        loop {
            if self.step() {
                steps_at_this_instant += 1;
                assert!(
                    steps_at_this_instant < 100_000,
                    "endpoints spin at {:?}",
                    self.elapsed()
                );
                continue;
            }
            // Nothing happened: wait for the next timer or datagram. A
            // timer in the past that does nothing would be a spin.
            match self.next_wakeup() {
                Some(at) if at <= end => {
                    if at <= self.now {
                        steps_at_this_instant += 1;
                        assert!(
                            steps_at_this_instant < 1000,
                            "a timer in the past does nothing"
                        );
                    } else {
                        steps_at_this_instant = 0;
                        self.now = at;
                    }
                }
                Some(_) => {
                    self.now = end;
                    return;
                }
                None => return,
            }
        }
    }

    /// Runs until every outbox is empty and no message is outstanding.
    pub fn run_until_quiet(&mut self, limit: Duration) {
        self.run_for(limit);
        for (index, node) in self.nodes.iter().enumerate() {
            if node.halted {
                continue;
            }
            assert!(
                node.outbox.is_empty(),
                "node {index} still has {} messages to send at {:?}: {:?}, timeout {:?}, drops {:?}",
                node.outbox.len(),
                self.elapsed(),
                node.endpoint.stats(),
                node.endpoint.poll_timeout().map(|at| at - self.start),
                node.drops.len(),
            );
        }
    }
}
