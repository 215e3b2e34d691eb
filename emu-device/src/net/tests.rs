//! Deterministic tests of the endpoint on the simulated network.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use proptest::prelude::*;

use super::reliable::{peer_state_size, ACK_CLOCK_PERIOD};
use super::sim::{Delivery, Sim, Transmission, FABRIC};
use super::wire::{seq_before, Header, StreamHeader, HEADER_LEN};
use super::{
    Config, DropReason, Endpoint, Event, Faults, Identity, NodeId, SendError, Seq, Stream,
};

fn lossy(seed: u64) -> Faults {
    Faults {
        loss: 0.05,
        duplicate: 0.02,
        reorder: 0.05,
        delay: Duration::from_micros(50),
        reorder_hold: Duration::from_micros(300),
        seed,
    }
}

fn payload(from: NodeId, to: NodeId, index: u32) -> Vec<u8> {
    let mut bytes = format!("{from}->{to}#{index}:").into_bytes();
    // Lengths vary, up to a few hundred bytes.
    bytes.resize(bytes.len() + (index as usize * 37) % 300, index as u8);
    bytes
}

/// The floor of the stream of the message a header carries.
fn floor_of(header: &Header) -> Seq {
    if header.reply {
        header.replies.floor
    } else {
        header.requests.floor
    }
}

/// Every message sent was delivered exactly once with its bytes, and every
/// seq ended in exactly one `Acked` (none abandoned).
fn assert_exactly_once(sim: &Sim) {
    for (receiver, node) in sim.nodes.iter().enumerate() {
        let receiver = receiver as NodeId;
        let mut delivered: HashMap<(NodeId, Stream, Seq), &Vec<u8>> = HashMap::new();
        for Delivery {
            from,
            stream,
            seq,
            payload,
            ..
        } in &node.delivered
        {
            assert!(
                delivered.insert((*from, *stream, *seq), payload).is_none(),
                "node {receiver} got ({from}, {stream:?}, {seq}) twice"
            );
        }
        let mut expected = 0;
        for (sender, other) in sim.nodes.iter().enumerate() {
            for (to, stream, seq, bytes) in &other.sent {
                if *to == receiver {
                    expected += 1;
                    assert_eq!(
                        delivered.get(&(sender as NodeId, *stream, *seq)),
                        Some(&bytes),
                        "message ({sender}, {seq}) to {receiver}"
                    );
                }
            }
        }
        assert_eq!(
            delivered.len(),
            expected,
            "node {receiver} got messages never sent"
        );

        let mut acked = HashSet::new();
        for (_, event) in &node.events {
            match event {
                Event::Acked {
                    node: peer,
                    stream,
                    seq,
                    ..
                } => {
                    assert!(
                        acked.insert((*peer, *stream, *seq)),
                        "({peer}, {stream:?}, {seq}) acked twice"
                    )
                }
                other => panic!("node {receiver}: unexpected {other:?}"),
            }
        }
        let sent: HashSet<_> = node
            .sent
            .iter()
            .map(|(to, stream, seq, _)| (*to, *stream, *seq))
            .collect();
        assert_eq!(acked, sent, "node {receiver}: acks do not match sends");
    }
}

/// Counters that must add up whatever happened.
fn assert_counters_add_up(sim: &Sim) {
    for node in &sim.nodes {
        let stats = node.endpoint.stats();
        assert_eq!(
            stats.datagrams_sent,
            stats.first_transmissions + stats.retransmissions + stats.acks_sent
        );
        assert_eq!(stats.messages_sent, node.sent.len() as u64);
        assert_eq!(stats.messages_delivered, node.delivered.len() as u64);
        assert_eq!(
            stats.datagrams_received,
            stats.messages_delivered + node.drops.len() as u64 + node.acks_only
        );
        let dropped_for = |reason: fn(&DropReason) -> bool| {
            node.drops.iter().filter(|drop| reason(drop)).count() as u64
        };
        assert_eq!(
            stats.duplicates,
            dropped_for(|d| *d == DropReason::Duplicate)
        );
        assert_eq!(
            stats.beyond_window,
            dropped_for(|d| *d == DropReason::BeyondWindow)
        );
        assert_eq!(
            stats.no_response_room,
            dropped_for(|d| *d == DropReason::NoResponseRoom)
        );
        assert_eq!(
            stats.acked + stats.abandoned + node.endpoint_outstanding_total(),
            stats.messages_sent
        );
    }
    let sent: u64 = sim
        .nodes
        .iter()
        .map(|n| n.endpoint.stats().datagrams_sent)
        .sum();
    assert_eq!(sent as usize, sim.transmissions.len());
    // The network: what went in came out, less losses, plus copies.
    let (links, held) = sim.link_totals();
    assert_eq!(links.pushed, sent);
    assert_eq!(
        links.released + held as u64,
        links.pushed - links.lost - links.overflowed + links.duplicated
    );
    let received: u64 = sim
        .nodes
        .iter()
        .map(|n| n.endpoint.stats().datagrams_received)
        .sum();
    assert_eq!(received, links.released);
}

trait OutstandingTotal {
    fn endpoint_outstanding_total(&self) -> u64;
}

impl OutstandingTotal for super::sim::SimNode {
    fn endpoint_outstanding_total(&self) -> u64 {
        let me = self.endpoint.identity().node;
        (0..=u16::MAX)
            .take(64)
            .filter(|&node| node != me)
            .filter_map(|node| self.endpoint.outstanding(node))
            .sum::<usize>() as u64
    }
}

#[test]
fn the_largest_default_datagram_fits_an_ethernet_mtu() {
    let endpoint = Sim::endpoint(0, 1, Config::default(), 1);
    // IPv6 and UDP headers.
    assert_eq!(endpoint.max_datagram_len() + 40 + 8, 1500);
}

#[test]
fn per_peer_state_and_fixed_cost_fit_their_budgets() {
    // Two streams of sequence numbers, acknowledgements and lists, the
    // incarnation, the acknowledgement timer, the round-trip estimate and
    // flags; with the node number, index entry and ack-queue entry at most
    // 64 bytes per peer (issue 10).
    assert!(
        peer_state_size() <= 64,
        "per-peer record is {} bytes",
        peer_state_size()
    );
    let mut endpoint = Sim::endpoint(0, 1, Config::default(), 1);
    let empty = endpoint.memory();
    assert!(empty.fixed_bytes <= 1 << 20, "{empty:?}");
    let config = Config::default();
    assert!(empty.pool_bytes >= config.pool_slots * config.max_payload);
    assert!(empty.fixed_bytes >= empty.pool_bytes);
    for node in 1..=100 {
        endpoint.add_peer(node).unwrap();
    }
    let with_peers = endpoint.memory();
    assert_eq!(with_peers.peers, 100);
    assert!(with_peers.per_peer_bytes >= peer_state_size());
    assert!(
        with_peers.per_peer_bytes <= 64,
        "per-peer state is {} bytes",
        with_peers.per_peer_bytes
    );
    assert!(with_peers.fixed_bytes <= 1 << 20, "{with_peers:?}");
    assert_eq!(
        with_peers.total(),
        with_peers.fixed_bytes + 100 * with_peers.per_peer_bytes
    );
}

#[test]
fn exactly_once_under_loss_duplication_and_reordering() {
    let nodes = 4;
    let per_pair = 300;
    let mut sim = Sim::new(nodes, Config::default(), lossy(11));
    for from in 0..nodes {
        for to in (0..nodes).filter(|&to| to != from) {
            for index in 0..per_pair {
                sim.queue(from, to, payload(from, to, index));
            }
        }
    }
    sim.run_until_quiet(Duration::from_secs(2));
    assert_exactly_once(&sim);
    assert_counters_add_up(&sim);

    let total = |field: fn(&super::Stats) -> u64| -> u64 {
        sim.nodes
            .iter()
            .map(|node| field(node.endpoint.stats()))
            .sum()
    };
    let expected = u64::from(nodes) * u64::from(nodes - 1) * u64::from(per_pair);
    assert_eq!(total(|s| s.messages_sent), expected);
    assert_eq!(total(|s| s.messages_delivered), expected);
    // The faults really happened and were repaired.
    assert!(total(|s| s.retransmissions) > 0);
    assert!(total(|s| s.duplicates) > 0);
    assert!(total(|s| s.fast_retransmits) > 0);
    // Every message carried the window bound.
    let window = Config::default().window;
    for transmission in &sim.transmissions {
        if let Some(seq) = transmission.header.seq {
            assert!(seq.wrapping_sub(floor_of(&transmission.header)) < window);
        }
    }
    // All slots came back to the pool.
    for node in &sim.nodes {
        assert_eq!(
            node.endpoint.free_pool_slots(),
            Config::default().pool_slots
        );
    }
}

#[test]
fn sequence_numbers_wrap_around() {
    let mut sim = Sim::new(3, Config::default(), lossy(21));
    let first = u32::MAX - 40;
    sim.start_sequences_at(first);
    for from in 0..3 {
        for to in (0..3).filter(|&to| to != from) {
            for index in 0..200 {
                sim.queue(from, to, payload(from, to, index));
            }
        }
    }
    sim.run_until_quiet(Duration::from_secs(2));
    assert_exactly_once(&sim);
    assert_counters_add_up(&sim);
    let seqs: HashSet<Seq> = sim.nodes[1].delivered.iter().map(|d| d.seq).collect();
    assert!(seqs.contains(&u32::MAX) && seqs.contains(&0) && seqs.contains(&158));
    let repaired: u64 = sim
        .nodes
        .iter()
        .map(|n| n.endpoint.stats().retransmissions)
        .sum();
    assert!(repaired > 0);
    for node in 1..3 {
        assert_eq!(
            sim.nodes[0]
                .endpoint
                .delivered_through(node, Stream::Request),
            Some(first.wrapping_add(200))
        );
    }
}

#[test]
fn the_same_seed_gives_the_same_run() {
    let run = |seed| {
        let mut sim = Sim::new(3, Config::default(), lossy(seed));
        for index in 0..100 {
            sim.queue(0, 1, payload(0, 1, index));
            sim.queue(2, 0, payload(2, 0, index));
        }
        sim.run_until_quiet(Duration::from_secs(1));
        sim.transmissions
            .iter()
            .map(|t| (t.at - sim.start, t.bytes.clone()))
            .collect::<Vec<_>>()
    };
    assert_eq!(run(5), run(5));
    assert_ne!(run(5), run(6));
}

/// Both nodes send 600 requests to each other and answer request `i`
/// with `i % 3` replies naming the request's seq. Whenever a node sees
/// `Acked { Request, seq, horizon }`, every reply to `seq` has a reply seq
/// below `horizon`, and all of them had arrived by the time its
/// `delivered_through(peer, Reply)` first reached `horizon`. Returns the
/// retransmissions of both nodes.
fn check_horizon(faults: Faults, config: Config) -> u64 {
    let seed = faults.seed;
    let mut sim = Sim::new(2, config, faults);
    for node in 0..2 {
        sim.responders.insert(
            node,
            Box::new(|_, request: &Delivery| {
                if request.stream == Stream::Reply {
                    return Vec::new();
                }
                let count = request.payload[0] % 3;
                (0..count)
                    .map(|index| {
                        let mut response = request.seq.to_le_bytes().to_vec();
                        response.push(index);
                        (request.from, response)
                    })
                    .collect()
            }),
        );
    }
    for index in 0..600u32 {
        for (from, to) in [(0, 1), (1, 0)] {
            sim.queue(from, to, vec![(index % 256) as u8; 1 + index as usize % 50]);
        }
    }
    sim.run_until_quiet(Duration::from_secs(5));
    assert_exactly_once(&sim);

    for (me, peer) in [(0u16, 1u16), (1, 0)] {
        // (request seq, reply seq) of the peer's replies to us.
        let replies: Vec<(Seq, Seq)> = sim.nodes[usize::from(peer)]
            .sent
            .iter()
            .filter(|(to, stream, ..)| *to == me && *stream == Stream::Reply)
            .map(|(_, _, seq, bytes)| (u32::from_le_bytes(bytes[..4].try_into().unwrap()), *seq))
            .collect();
        assert!(replies.len() >= 500, "{} replies", replies.len());
        let arrival: HashMap<Seq, Instant> = sim.nodes[usize::from(me)]
            .delivered
            .iter()
            .filter(|delivery| delivery.stream == Stream::Reply)
            .map(|delivery| (delivery.seq, delivery.at))
            .collect();
        let mut acked_requests = 0;
        for (_, event) in &sim.nodes[usize::from(me)].events {
            let Event::Acked {
                node,
                stream: Stream::Request,
                seq,
                horizon,
            } = *event
            else {
                continue;
            };
            assert_eq!(node, peer);
            acked_requests += 1;
            // When we first had delivered_through(peer, Reply) >= horizon.
            let reached = if horizon == 0 {
                sim.start
            } else {
                sim.through_log
                    .iter()
                    .find(|(_, receiver, from, stream, through)| {
                        *receiver == me
                            && *from == peer
                            && *stream == Stream::Reply
                            && !seq_before(*through, horizon)
                    })
                    .map(|(at, ..)| *at)
                    .expect("delivered_through reaches every horizon")
            };
            for &(_, reply_seq) in replies.iter().filter(|(request, _)| *request == seq) {
                assert!(
                    seq_before(reply_seq, horizon),
                    "seed {seed}: reply {reply_seq} to {seq} not below horizon {horizon}"
                );
                assert!(arrival[&reply_seq] <= reached);
            }
        }
        assert_eq!(acked_requests, 600);
    }
    sim.nodes[0].endpoint.stats().retransmissions + sim.nodes[1].endpoint.stats().retransmissions
}

#[test]
fn horizon_covers_every_response_under_loss() {
    let config = Config {
        response_reserve: 2,
        ..Config::default()
    };
    for seed in [1, 2, 3] {
        let retransmissions = check_horizon(
            Faults {
                loss: 0.1,
                ..lossy(seed)
            },
            config,
        );
        assert!(retransmissions > 0);
    }
}

/// Small windows filled by both sides' requests and replies at once: the
/// reply stream never waits behind requests, so nothing stalls.
#[test]
fn requests_both_ways_in_small_windows_do_not_block_each_other() {
    let config = Config {
        window: 4,
        pool_slots: 16,
        response_reserve: 2,
        ..Config::default()
    };
    for seed in [4, 5] {
        check_horizon(lossy(seed), config);
    }
    check_horizon(Faults::NONE, config);
}

fn transmissions_of(sim: &Sim, from: NodeId, seq: Seq) -> Vec<Duration> {
    sim.transmissions
        .iter()
        .filter(|t| t.from == from && t.header.seq == Some(seq))
        .map(|t| t.at - sim.start)
        .collect()
}

#[test]
fn retransmission_backs_off_to_rto_max_then_the_peer_is_gone() {
    let config = Config::default();
    let mut sim = Sim::new(2, config, Faults::NONE);
    sim.set_faults(
        0,
        1,
        Faults {
            loss: 1.0,
            ..Faults::NONE
        },
    );
    sim.queue(0, 1, b"lost".to_vec());
    sim.run_for(config.peer_timeout - Duration::from_millis(1));
    let times = transmissions_of(&sim, 0, 0);
    let gaps: Vec<Duration> = times.windows(2).map(|w| w[1] - w[0]).collect();
    assert_eq!(gaps[0], config.rto_initial);
    for pair in gaps.windows(2) {
        assert!(pair[1] >= pair[0], "backoff shrank: {gaps:?}");
        assert!(pair[1] <= pair[0] * 2);
    }
    for gap in &gaps {
        assert!(*gap >= config.rto_min && *gap <= config.rto_max, "{gaps:?}");
    }
    // The backoff reached the ceiling and stayed there.
    let at_max = gaps.iter().filter(|gap| **gap == config.rto_max).count();
    assert!(at_max >= 20, "{gaps:?}");
    assert_eq!(*gaps.last().unwrap(), config.rto_max);
    assert!(sim.nodes[0].events.is_empty());

    sim.run_for(Duration::from_secs(1));
    let events: Vec<_> = sim.nodes[0]
        .events
        .iter()
        .map(|(at, e)| (*at - sim.start, *e))
        .collect();
    assert_eq!(
        events,
        vec![
            (
                config.peer_timeout,
                Event::Abandoned {
                    node: 1,
                    stream: Stream::Request,
                    seq: 0
                }
            ),
            (config.peer_timeout, Event::PeerGone { node: 1 }),
        ]
    );
    assert!(sim.nodes[0].endpoint.is_gone(1));
    // Nothing more goes out to a gone peer, and no timer runs.
    assert_eq!(transmissions_of(&sim, 0, 0).len(), times.len());
    assert_eq!(sim.nodes[0].endpoint.poll_timeout(), None);
    assert_eq!(sim.nodes[0].endpoint.free_pool_slots(), config.pool_slots);
    // A reply to it is refused; a new message probes it.
    assert_eq!(
        sim.nodes[0].endpoint.send_reply(sim.now, 1, b"x"),
        Err(SendError::PeerGone(1))
    );
    assert!(sim.nodes[0].endpoint.send(sim.now, 1, b"x").is_ok());
    assert!(!sim.nodes[0].endpoint.is_gone(1));
    assert!(sim.nodes[0].endpoint.poll_timeout().is_some());
    assert_eq!(
        sim.nodes[0].endpoint.free_pool_slots(),
        config.pool_slots - 1
    );
}

#[test]
fn round_trip_estimate_sets_the_timeout_within_bounds() {
    let config = Config::default();
    let mut sim = Sim::new(2, config, Faults::NONE);
    let one_way = Duration::from_micros(400);
    assert_eq!(sim.nodes[0].endpoint.srtt(1), None, "no sample yet");
    for (from, to) in [(0, 1), (1, 0)] {
        sim.set_faults(
            from,
            to,
            Faults {
                delay: one_way,
                seed: 3,
                ..Faults::NONE
            },
        );
    }
    for index in 0..200 {
        sim.queue(0, 1, payload(0, 1, index));
    }
    sim.run_until_quiet(Duration::from_secs(1));
    assert_exactly_once(&sim);
    let rto = sim.nodes[0].endpoint.rto(1).unwrap();
    // Round trips are 0..=800 us plus the ack delay.
    assert!(rto >= config.rto_min && rto <= config.rto_max);
    assert!(rto > Duration::from_micros(100), "{rto:?}");
    // Every sample is two delays of at most `one_way` plus at most the
    // ack delay, and the estimate smooths the samples.
    let srtt = sim.nodes[0].endpoint.srtt(1).unwrap();
    assert!(
        srtt > Duration::ZERO && srtt <= 2 * one_way + config.ack_delay,
        "{srtt:?}"
    );
}

#[test]
fn fast_retransmit_fills_a_hole_before_the_timer() {
    let config = Config::default();
    let mut sim = Sim::new(2, config, Faults::NONE);
    // Introductions first: node 0's first message names no incarnation of
    // node 1 and is sent again once node 1 answers.
    sim.queue(0, 1, b"hello".to_vec());
    sim.run_until_quiet(Duration::from_millis(10));
    let before = *sim.nodes[0].endpoint.stats();
    assert_eq!(before.retransmissions, 1);
    let mut dropped = false;
    sim.drop_filter = Some(Box::new(move |t| {
        let hit = !dropped && t.from == 0 && t.header.seq == Some(3);
        dropped |= hit;
        hit
    }));
    for index in 0..10 {
        sim.queue(0, 1, payload(0, 1, index));
    }
    sim.run_until_quiet(Duration::from_secs(1));
    assert_exactly_once(&sim);
    let stats = sim.nodes[0].endpoint.stats();
    assert_eq!(stats.fast_retransmits, 1);
    assert_eq!(stats.retransmissions - before.retransmissions, 1);
    assert_eq!(stats.timeouts, 0);
    let times = transmissions_of(&sim, 0, 3);
    assert_eq!(times.len(), 2);
    assert!(times[1] - times[0] < config.rto_initial);
}

/// A sim of two nodes whose introductions and first round-trip samples
/// are done, with its statistics of node 0 at that point.
fn introduced_pair(config: Config) -> (Sim, super::Stats) {
    let mut sim = Sim::new(2, config, Faults::NONE);
    // Node 0's first message names no incarnation of node 1 and is sent
    // again once node 1 answers; the next ones give round-trip samples.
    for index in 0..4 {
        sim.queue(0, 1, payload(0, 1, index));
        sim.run_until_quiet(Duration::from_millis(10));
    }
    let before = *sim.nodes[0].endpoint.stats();
    (sim, before)
}

#[test]
fn a_receiver_that_stalls_is_sent_one_probe_per_timeout_not_every_message_again() {
    let config = Config::default();
    let (mut sim, before) = introduced_pair(config);
    let stall_start = sim.now;
    stall_with_messages_in_flight(&mut sim);
    sim.run_until_quiet(Duration::from_secs(1));
    assert_exactly_once(&sim);
    let stats = *sim.nodes[0].endpoint.stats();
    let timeouts = stats.timeouts - before.timeouts;
    let sent_again = stats.retransmissions - before.retransmissions;
    assert!(
        timeouts >= 3,
        "the stall outlasts several timeouts: {timeouts}"
    );
    // One probe (the oldest message) per timeout; the stalled receiver
    // acknowledges everything before it echoes a probe, so nothing else
    // goes twice.
    assert_eq!(sent_again, timeouts, "{stats:?}");
    assert_eq!(stats.lost_before_probe, before.lost_before_probe);
    let duplicates = sim.nodes[1].endpoint.stats().duplicates;
    assert_eq!(duplicates, timeouts);
    let probed: HashSet<Seq> = sim
        .transmissions
        .iter()
        .filter(|t| t.from == 0 && t.at > stall_start && t.header.probe)
        .filter_map(|t| t.header.seq)
        .collect();
    assert_eq!(
        probed.len(),
        1,
        "the probe is always the oldest message: {probed:?}"
    );
    let probes = sim
        .transmissions
        .iter()
        .filter(|t| t.from == 0 && t.header.probe)
        .count() as u64;
    assert_eq!(probes, timeouts);
}

/// Stalls node 1 for 5 ms (past a timeout and several backoffs) with 40
/// messages from node 0 in flight to it, nothing lost.
fn stall_with_messages_in_flight(sim: &mut Sim) {
    sim.nodes[1].stalled_until = Some(sim.now + Duration::from_millis(5));
    for index in 0..40 {
        sim.queue(0, 1, payload(0, 1, index));
    }
}

#[test]
fn a_receiver_draining_a_backlog_in_batches_is_sent_no_copy_of_the_backlog() {
    let config = Config::default();
    let (mut sim, before) = introduced_pair(config);
    stall_with_messages_in_flight(&mut sim);
    // After the stall it takes 8 datagrams at a time, 30 us apart, and
    // acknowledges between batches: acknowledgements of the backlog's
    // head must not pass for answers to the probes behind it.
    sim.nodes[1].receive_batch = Some((8, Duration::from_micros(30)));
    sim.run_until_quiet(Duration::from_secs(1));
    assert_exactly_once(&sim);
    let stats = *sim.nodes[0].endpoint.stats();
    assert!(stats.timeouts - before.timeouts >= 3, "{stats:?}");
    assert_eq!(
        stats.lost_before_probe, before.lost_before_probe,
        "{stats:?}"
    );
    assert_eq!(
        stats.retransmissions - before.retransmissions,
        stats.timeouts - before.timeouts
    );
}

#[test]
fn a_probe_is_echoed_once() {
    let config = Config::default();
    let (mut sim, _) = introduced_pair(config);
    // A first stall: node 1 receives probes and echoes them.
    stall_with_messages_in_flight(&mut sim);
    sim.run_until_quiet(Duration::from_secs(1));
    let before = *sim.nodes[0].endpoint.stats();
    let seen = sim.transmissions.len();
    // A second one, drained 8 datagrams at a time: an echo left over from
    // the first would ride on the first acknowledgement of the backlog and
    // pass for the answer to the new probes, which still wait behind it.
    // It lasts longer than the first, which raised the timeout.
    stall_with_messages_in_flight(&mut sim);
    sim.nodes[1].stalled_until = Some(sim.now + Duration::from_millis(40));
    sim.nodes[1].receive_batch = Some((8, Duration::from_micros(30)));
    sim.run_until_quiet(Duration::from_secs(1));
    assert_exactly_once(&sim);
    let stats = *sim.nodes[0].endpoint.stats();
    assert!(stats.timeouts - before.timeouts >= 2, "{stats:?}");
    assert_eq!(
        stats.lost_before_probe, before.lost_before_probe,
        "{stats:?}"
    );
    let later = &sim.transmissions[seen..];
    let probes = later
        .iter()
        .filter(|t| t.from == 0 && t.header.probe)
        .count();
    let echoes = later
        .iter()
        .filter(|t| t.from == 1 && t.header.probe_echo)
        .count();
    assert!(
        (1..=probes).contains(&echoes),
        "{echoes} echoes of {probes} probes"
    );
}

#[test]
fn a_lost_probe_leaves_no_stale_probe_time() {
    let config = Config::default();
    let (mut sim, _) = introduced_pair(config);
    // Every probe of a stall is lost, so no echo comes: its messages are
    // acknowledged as the receiver catches up, and the first probe's time
    // stays behind them.
    sim.drop_filter = Some(Box::new(|t| t.from == 0 && t.header.probe));
    stall_with_messages_in_flight(&mut sim);
    sim.run_until_quiet(Duration::from_secs(1));
    sim.drop_filter = None;
    // A lost tail then still costs one timeout: its probe's time is new.
    let (timeouts, lost_before_probe, _) = lose_a_tail(&mut sim);
    assert_eq!(timeouts, 1);
    assert_eq!(lost_before_probe, 10);
}

/// Loses the first transmissions of the last 11 of 16 messages from node
/// 0 (nothing after them is acknowledged, so no fast retransmit can see
/// the gap), checks every message arrived once and each lost one was sent
/// exactly twice; returns the timeouts, the messages sent again for a
/// probe's echo, and how long the 16 took.
fn lose_a_tail(sim: &mut Sim) -> (u64, u64, Duration) {
    let before = *sim.nodes[0].endpoint.stats();
    let first = sim.nodes[0].sent.len() as Seq;
    let lost: HashSet<Seq> = (first + 5..first + 16).collect();
    let mut sent_once = HashSet::new();
    let dropped = lost.clone();
    sim.drop_filter = Some(Box::new(move |t| {
        t.from == 0
            && t.header
                .seq
                .is_some_and(|seq| dropped.contains(&seq) && sent_once.insert(seq))
    }));
    let started = sim.now;
    for index in 0..16 {
        sim.queue(0, 1, payload(0, 1, index));
    }
    sim.run_until_quiet(Duration::from_secs(10));
    assert_exactly_once(sim);
    let stats = *sim.nodes[0].endpoint.stats();
    assert_eq!(
        stats.retransmissions - before.retransmissions,
        11,
        "{stats:?}"
    );
    for &seq in &lost {
        assert_eq!(transmissions_of(sim, 0, seq).len(), 2, "seq {seq}");
    }
    let last_ack = sim.nodes[0]
        .events
        .iter()
        .filter(|(_, event)| matches!(event, Event::Acked { .. }))
        .map(|(at, _)| *at)
        .max()
        .unwrap();
    (
        stats.timeouts - before.timeouts,
        stats.lost_before_probe - before.lost_before_probe,
        last_ack - started,
    )
}

#[test]
fn a_lost_tail_goes_again_once_the_timeout_probe_is_echoed() {
    let config = Config::default();
    let (mut sim, _) = introduced_pair(config);
    let (timeouts, lost_before_probe, recovered) = lose_a_tail(&mut sim);
    // One timeout: its probe (the oldest lost message) is echoed, and the
    // 10 others go again at once.
    assert_eq!(timeouts, 1);
    assert_eq!(lost_before_probe, 10);
    // Well within two timeouts (a probe per timeout would need 11, with
    // backoff).
    assert!(
        recovered < 2 * config.rto_initial,
        "recovered after {recovered:?}"
    );
}

#[test]
fn a_lost_tail_after_a_stall_still_goes_again_after_one_timeout() {
    let config = Config::default();
    let (mut sim, _) = introduced_pair(config);
    // The stall's late acknowledgements raise the round-trip estimate
    // far above the true round trip.
    stall_with_messages_in_flight(&mut sim);
    sim.run_until_quiet(Duration::from_secs(1));
    let srtt = sim.nodes[0].endpoint.srtt(1).unwrap();
    assert!(srtt > Duration::from_micros(200), "{srtt:?}");
    let rto = sim.nodes[0].endpoint.rto(1).unwrap();
    let (timeouts, lost_before_probe, recovered) = lose_a_tail(&mut sim);
    assert_eq!(timeouts, 1);
    assert_eq!(lost_before_probe, 10);
    // One timeout at the raised estimate, then a round trip (a probe per
    // timeout would take 11 timeouts, with backoff: seconds).
    assert!(
        recovered < rto + config.rto_min,
        "recovered after {recovered:?} (timeout {rto:?})"
    );
}

#[test]
fn window_and_pool_bound_what_is_outstanding() {
    let config = Config {
        window: 16,
        pool_slots: 20,
        ..Config::default()
    };
    let mut endpoint = Sim::endpoint(0, 7, config, 3);
    let now = Instant::now();
    // Each stream has its own window.
    for _ in 0..16 {
        endpoint.send(now, 1, b"m").unwrap();
    }
    assert_eq!(endpoint.send(now, 1, b"m"), Err(SendError::WindowFull));
    endpoint.send_reply(now, 1, b"r").unwrap();
    assert_eq!(endpoint.outstanding(1), Some(17));
    // 3 slots left: requests take 2 and leave one for a reply.
    for _ in 0..2 {
        endpoint.send(now, 2, b"m").unwrap();
    }
    assert_eq!(endpoint.send(now, 2, b"m"), Err(SendError::PoolFull));
    endpoint.send_reply(now, 2, b"r").unwrap();
    assert_eq!(endpoint.send_reply(now, 2, b"r"), Err(SendError::PoolFull));
    assert!(SendError::PoolFull.is_would_block());
    assert_eq!(endpoint.free_pool_slots(), 0);
    assert_eq!(
        endpoint.send(now, 1, &vec![0; config.max_payload + 1]),
        Err(SendError::TooLarge {
            len: config.max_payload + 1,
            max: config.max_payload
        })
    );
    assert_eq!(endpoint.send(now, 9, b"m"), Err(SendError::UnknownPeer(9)));

    // Under loss the window holds at every transmission.
    let mut sim = Sim::new(2, config, lossy(4));
    for index in 0..500 {
        sim.queue(0, 1, payload(0, 1, index));
    }
    sim.run_until_quiet(Duration::from_secs(2));
    assert_exactly_once(&sim);
    for transmission in sim.transmissions.iter().filter(|t| t.from == 0) {
        assert_eq!(transmission.to, 1);
        if let Some(seq) = transmission.header.seq {
            assert!(seq.wrapping_sub(floor_of(&transmission.header)) < config.window);
            // Node 0 sends only requests: the reply horizon stays 0.
            assert!(!transmission.header.reply);
            assert_eq!(transmission.header.horizon, 0);
        }
    }
}

/// A datagram from node `source` to node 0 with the given fields.
fn datagram(
    source: NodeId,
    source_incarnation: u64,
    destination_incarnation: u64,
    seq: Option<Seq>,
) -> Vec<u8> {
    let payload = b"hello";
    let len = if seq.is_some() { payload.len() } else { 0 };
    let header = Header {
        fabric: FABRIC,
        source,
        destination: 0,
        source_incarnation,
        destination_incarnation,
        seq,
        reply: false,
        probe: false,
        probe_echo: false,
        horizon: 0,
        requests: StreamHeader::default(),
        replies: StreamHeader::default(),
        payload_len: len as u16,
    };
    let mut bytes = vec![0; HEADER_LEN + len];
    header.encode(&mut bytes);
    bytes[HEADER_LEN..].copy_from_slice(&payload[..len]);
    bytes
}

#[test]
fn foreign_and_stale_datagrams_are_dropped_and_counted() {
    let mut endpoint = Sim::endpoint(0, 100, Config::default(), 3);
    let now = Instant::now();
    let good = datagram(1, 55, 100, Some(0));
    let change = |at: std::ops::Range<usize>, value: &[u8]| {
        let mut bytes = good.clone();
        bytes[at].copy_from_slice(value);
        bytes
    };
    let cases = [
        (change(4..12, &7u64.to_le_bytes()), DropReason::WrongFabric),
        // The sender does not know node 0's incarnation yet.
        (
            change(24..32, &0u64.to_le_bytes()),
            DropReason::NotYetIntroduced,
        ),
        (
            change(14..16, &2u16.to_le_bytes()),
            DropReason::WrongDestination,
        ),
        (
            change(12..14, &9u16.to_le_bytes()),
            DropReason::UnknownSource,
        ),
        // Addressed to a previous incarnation of node 0.
        (
            change(24..32, &99u64.to_le_bytes()),
            DropReason::StaleIncarnation,
        ),
        (
            good[..30].to_vec(),
            DropReason::Malformed(super::wire::WireError::Truncated(30)),
        ),
        // Acknowledges seq 5 of ours, never sent.
        (change(40..44, &5u32.to_le_bytes()), DropReason::BadAck),
    ];
    for (bytes, reason) in &cases {
        assert_eq!(endpoint.receive(now, bytes), Err(*reason));
    }
    let stats = *endpoint.stats();
    assert_eq!(stats.wrong_fabric, 1);
    assert_eq!(stats.wrong_destination, 1);
    assert_eq!(stats.unknown_source, 1);
    assert_eq!(stats.stale_incarnation, 1);
    assert_eq!(stats.malformed, 1);
    assert_eq!(stats.not_yet_introduced, 1);
    assert_eq!(stats.bad_acks, 1);
    assert_eq!(stats.datagrams_received, cases.len() as u64);
    // Nothing was delivered and nobody was recorded (the bad ack came from
    // an incarnation adopted by then, but delivered nothing).
    assert_eq!(endpoint.delivered_through(1, Stream::Request), Some(0));
    assert_eq!(stats.messages_delivered, 0);

    let oversized = {
        let config = Config {
            max_payload: 4,
            ..Config::default()
        };
        let mut small = Sim::endpoint(0, 100, config, 2);
        small.receive(now, &good)
    };
    assert_eq!(oversized, Err(DropReason::Oversized));

    // The good datagram is delivered once; its copy is a duplicate.
    let message = endpoint.receive(now, &good).unwrap().unwrap();
    assert_eq!(
        (message.node, message.seq, message.payload),
        (1, 0, &b"hello"[..])
    );
    assert_eq!(endpoint.receive(now, &good), Err(DropReason::Duplicate));
    assert_eq!(endpoint.stats().duplicates, 1);
    assert_eq!(endpoint.delivered_through(1, Stream::Request), Some(1));
    // A datagram beyond the window is dropped.
    assert_eq!(
        endpoint.receive(now, &datagram(1, 55, 100, Some(66))),
        Err(DropReason::BeyondWindow)
    );
    assert_eq!(
        endpoint
            .receive(now, &datagram(1, 55, 100, Some(65)))
            .unwrap()
            .unwrap()
            .seq,
        65
    );
    assert_eq!(endpoint.delivered_through(1, Stream::Request), Some(1));
}

#[test]
fn a_restart_resets_the_peer_once_and_late_datagrams_cannot_undo_it() {
    let config = Config::default();
    let mut sim = Sim::new(2, config, Faults::NONE);
    sim.check_cumulative = false;
    for index in 0..20 {
        sim.queue(1, 0, payload(1, 0, index));
        sim.queue(0, 1, payload(0, 1, index));
    }
    sim.run_until_quiet(Duration::from_millis(50));
    // Old datagrams of node 1, some naming node 0's incarnation.
    let old: Vec<Vec<u8>> = sim
        .transmissions
        .iter()
        .filter(|t| t.from == 1)
        .map(|t| t.bytes.clone())
        .collect();
    assert!(old.len() >= 20);
    assert!(sim
        .transmissions
        .iter()
        .any(|t| t.from == 1 && t.header.destination_incarnation != 0));
    let old_incarnation = sim.nodes[0].endpoint.peer_incarnation(1).unwrap();

    // Node 0 has messages in flight when node 1 restarts.
    sim.nodes[1].halted = true;
    sim.queue(0, 1, b"in flight".to_vec());
    sim.run_for(Duration::from_millis(1));
    assert_eq!(sim.nodes[0].endpoint.outstanding(1), Some(1));
    sim.restart(1, 0xbeef);
    sim.queue(1, 0, b"I am back".to_vec());
    sim.run_until_quiet(Duration::from_millis(50));

    let events: Vec<Event> = sim.nodes[0].events.iter().map(|(_, e)| *e).collect();
    let restart_at = events
        .iter()
        .position(|e| *e == Event::PeerRestarted { node: 1 })
        .unwrap();
    assert_eq!(
        events[restart_at - 1],
        Event::Abandoned {
            node: 1,
            stream: Stream::Request,
            seq: 20
        }
    );
    assert_eq!(sim.nodes[0].endpoint.peer_incarnation(1), Some(0xbeef));
    let last = sim.nodes[0].delivered.last().unwrap();
    assert_eq!(
        (last.from, last.seq, &last.payload[..]),
        (1, 0, &b"I am back"[..])
    );

    // Late datagrams of the old incarnation change nothing.
    let before = *sim.nodes[0].endpoint.stats();
    for bytes in &old {
        assert_eq!(
            sim.nodes[0].endpoint.receive(sim.now, bytes),
            Err(DropReason::StaleIncarnation)
        );
    }
    let after = *sim.nodes[0].endpoint.stats();
    assert_eq!(
        after.stale_incarnation,
        before.stale_incarnation + old.len() as u64
    );
    assert_eq!(after.peers_restarted, 1);
    assert_eq!(sim.nodes[0].endpoint.peer_incarnation(1), Some(0xbeef));
    assert_ne!(old_incarnation, 0xbeef);

    // Both directions work in the new sequence spaces.
    let delivered_before = sim.nodes[1].delivered.len();
    sim.queue(0, 1, b"welcome".to_vec());
    sim.run_until_quiet(Duration::from_millis(50));
    let last = sim.nodes[1].delivered.last().unwrap();
    assert_eq!(sim.nodes[1].delivered.len(), delivered_before + 1);
    assert_eq!(
        (last.from, last.seq, &last.payload[..]),
        (0, 0, &b"welcome"[..])
    );
}

/// Node 2 restarts in the middle of traffic on a lossy, reordering
/// network. Every message still ends in exactly one `Acked` or
/// `Abandoned`, an acknowledged message was delivered, nothing is delivered
/// twice, and traffic not involving the old incarnation is unaffected.
#[test]
fn a_restart_under_faults_keeps_every_promise() {
    let mut sim = Sim::new(3, Config::default(), lossy(8));
    sim.check_cumulative = false;
    let queue_all = |sim: &mut Sim, base: u32| {
        for from in 0..3 {
            for to in (0..3).filter(|&to| to != from) {
                for index in 0..100 {
                    sim.queue(from, to, payload(from, to, base + index));
                }
            }
        }
    };
    queue_all(&mut sim, 0);
    sim.run_for(Duration::from_micros(100));
    let old_sent = sim.nodes[2].sent.len();
    let old_events = sim.nodes[2].events.len();
    // Who had heard from the old incarnation sees it restart.
    let knew_old: Vec<bool> = (0..2)
        .map(|node| sim.nodes[node].endpoint.peer_incarnation(2) != Some(0))
        .collect();
    assert!(knew_old.contains(&true));
    assert!(old_sent > 0 && old_sent < 200, "{old_sent}");
    sim.restart(2, 0x7777);
    queue_all(&mut sim, 1000);
    sim.run_until_quiet(Duration::from_secs(3));

    let mut delivered = HashSet::new();
    for node in &sim.nodes {
        for delivery in &node.delivered {
            assert!(
                delivered.insert(delivery.payload.clone()),
                "delivered twice"
            );
        }
    }
    for (index, node) in sim.nodes.iter().enumerate() {
        // The new incarnation of node 2 owns only its own records.
        let (sent, events) = if index == 2 {
            (&node.sent[old_sent..], &node.events[old_events..])
        } else {
            (&node.sent[..], &node.events[..])
        };
        let payload_of: HashMap<(NodeId, Stream, Seq), Vec<&Vec<u8>>> =
            sent.iter()
                .fold(HashMap::new(), |mut map, (to, stream, seq, bytes)| {
                    map.entry((*to, *stream, *seq)).or_default().push(bytes);
                    map
                });
        let mut finished = 0;
        for (_, event) in events {
            match *event {
                Event::Acked {
                    node: peer,
                    stream,
                    seq,
                    ..
                } => {
                    finished += 1;
                    // Some message with this seq to that peer was delivered.
                    assert!(payload_of[&(peer, stream, seq)]
                        .iter()
                        .any(|p| delivered.contains(*p)));
                }
                Event::Abandoned { node: peer, .. } => {
                    finished += 1;
                    assert!(index != 2 && peer == 2, "node {index} abandoned to {peer}");
                }
                Event::PeerRestarted { node: peer } => assert!(index != 2 && peer == 2),
                other => panic!("node {index}: unexpected {other:?}"),
            }
        }
        assert_eq!(finished, sent.len(), "node {index}");
        let restarts = events
            .iter()
            .filter(|(_, e)| matches!(e, Event::PeerRestarted { .. }))
            .count();
        let expected = index != 2 && knew_old[index];
        assert_eq!(restarts, usize::from(expected), "node {index}");
    }
    // Between the nodes that did not restart, exactly once.
    for (from, to) in [(0, 1), (1, 0)] {
        let sent = sim.nodes[usize::from(from)]
            .sent
            .iter()
            .filter(|(dest, ..)| *dest == to)
            .count();
        let got = sim.nodes[usize::from(to)]
            .delivered
            .iter()
            .filter(|d| d.from == from)
            .count();
        assert_eq!((sent, got), (200, 200));
    }
    // The new incarnation sent everything it was given, and all arrived.
    assert_eq!(sim.nodes[2].sent.len() - old_sent, 200);
    assert_eq!(sim.nodes[2].endpoint.stats().acked, 200);
}

#[test]
fn a_restarted_device_is_noticed_within_a_round_trip() {
    let config = Config::default();
    let mut sim = Sim::new(2, config, Faults::NONE);
    sim.check_cumulative = false;
    sim.queue(0, 1, b"before".to_vec());
    sim.run_until_quiet(Duration::from_millis(10));
    // Node 1 restarts silently; node 0 still addresses the old one.
    sim.restart(1, 0x5eed);
    let restarted_at = sim.now;
    sim.queue(0, 1, b"after".to_vec());
    sim.run_until_quiet(Duration::from_millis(100));

    let restart = sim.nodes[0]
        .events
        .iter()
        .find(|(_, e)| *e == Event::PeerRestarted { node: 1 })
        .expect("node 0 notices the restart")
        .0;
    assert!(
        restart - restarted_at < config.rto_max,
        "noticed after {:?}",
        restart - restarted_at
    );
    assert_eq!(sim.nodes[1].endpoint.stats().stale_incarnation, 1);
    // The message caught by the restart was abandoned, not delivered; a
    // new one goes through.
    assert!(sim.nodes[0].events.iter().any(|(_, e)| *e
        == Event::Abandoned {
            node: 1,
            stream: Stream::Request,
            seq: 1
        }));
    assert_eq!(sim.nodes[1].delivered.len(), 1, "only the message before");
    sim.queue(0, 1, b"again".to_vec());
    sim.run_until_quiet(Duration::from_millis(100));
    assert_eq!(sim.nodes[1].delivered.len(), 2);
    let last = sim.nodes[1].delivered.last().unwrap();
    assert_eq!((last.seq, &last.payload[..]), (0, &b"again"[..]));
}

#[test]
fn a_new_incarnation_takes_over_once_it_answers_and_only_once() {
    let mut endpoint = Sim::endpoint(0, 100, Config::default(), 2);
    let now = Instant::now();
    let mut buf = vec![0u8; endpoint.max_datagram_len()];
    // Incarnation 1 of node 1 talks (its first message names no
    // incarnation of node 0 and is not delivered until sent again naming
    // it); then incarnation 2 starts (knows nothing of node 0: destination
    // 0); then incarnation 1's late datagrams (which name node 0 correctly)
    // arrive interleaved with 2's.
    assert_eq!(
        endpoint.receive(now, &datagram(1, 1, 0, Some(0))),
        Err(DropReason::NotYetIntroduced)
    );
    assert_eq!(endpoint.peer_incarnation(1), Some(1));
    for seq in 0..2 {
        assert!(endpoint
            .receive(now, &datagram(1, 1, 100, Some(seq)))
            .unwrap()
            .is_some());
    }
    while endpoint.poll_transmit(now, &mut buf).is_some() {}
    // Incarnation 2, not heard from before, not knowing node 0: proposed,
    // introduced to, nothing changes yet.
    assert_eq!(
        endpoint.receive(now, &datagram(1, 2, 0, Some(0))),
        Err(DropReason::UnconfirmedIncarnation)
    );
    assert_eq!(endpoint.poll_event(), None);
    assert_eq!(endpoint.peer_incarnation(1), Some(1));
    assert_eq!(endpoint.delivered_through(1, Stream::Request), Some(2));
    let (to, len) = endpoint.poll_transmit(now, &mut buf).unwrap();
    let (introduction, _) = Header::decode(&buf[..len]).unwrap();
    assert_eq!((to, introduction.seq), (1, None));
    assert_eq!(introduction.destination_incarnation, 2);
    assert_eq!(
        (
            introduction.requests,
            introduction.replies,
            introduction.horizon
        ),
        (StreamHeader::default(), StreamHeader::default(), 0)
    );
    // Incarnation 1 goes on meanwhile.
    assert!(endpoint
        .receive(now, &datagram(1, 1, 100, Some(2)))
        .unwrap()
        .is_some());
    // Incarnation 2 answers naming node 0: it takes over.
    assert!(endpoint
        .receive(now, &datagram(1, 2, 100, Some(0)))
        .unwrap()
        .is_some());
    assert_eq!(
        endpoint.poll_event(),
        Some(Event::PeerRestarted { node: 1 })
    );
    assert_eq!(endpoint.peer_incarnation(1), Some(2));
    for seq in 3..10 {
        assert_eq!(
            endpoint.receive(now, &datagram(1, 1, 100, Some(seq))),
            Err(DropReason::StaleIncarnation)
        );
        assert!(endpoint
            .receive(now, &datagram(1, 2, 100, Some(seq - 2)))
            .unwrap()
            .is_some());
    }
    assert_eq!(endpoint.poll_event(), None);
    assert_eq!(endpoint.stats().peers_restarted, 1);
    assert_eq!(endpoint.delivered_through(1, Stream::Request), Some(8));
    // Long after the retirement expired, a late datagram of incarnation 1
    // (naming node 0; it acknowledges nothing, as incarnation 1 delivered
    // nothing of node 0's) is only proposed: it changes nothing unless it
    // answers the introduction, which a life that ended never does.
    let later = now + Config::default().peer_timeout * 10;
    assert_eq!(
        endpoint.receive(later, &datagram(1, 1, 100, Some(0))),
        Err(DropReason::UnconfirmedIncarnation)
    );
    assert_eq!(endpoint.stats().peers_restarted, 1);
    assert_eq!(endpoint.peer_incarnation(1), Some(2));
}

/// A datagram of node 1 under an incarnation node 0 never heard from —
/// late from a life that ended, corrupted, or forged — reaches node 0,
/// once naming node 0 and once naming none, while the live incarnation
/// goes on talking for longer than the peer timeout. Node 0 keeps its
/// peer: nothing is abandoned, every message is delivered exactly once,
/// and every acknowledgement stands for a delivery. (Taking such a
/// datagram for a restart reset node 0's streams but not the live
/// peer's, which then acknowledged node 0's new messages as duplicates
/// of old ones and never delivered them.)
#[test]
fn an_unknown_incarnation_that_never_answers_changes_nothing() {
    let config = Config::default();
    let mut sim = Sim::new(2, config, Faults::NONE);
    for index in 0..5 {
        sim.queue(0, 1, payload(0, 1, index));
        sim.queue(1, 0, payload(1, 0, index));
    }
    sim.run_until_quiet(Duration::from_millis(50));
    let live = sim.nodes[0].endpoint.peer_incarnation(1);
    let last = sim
        .transmissions
        .iter()
        .rev()
        .find(|t| t.from == 1 && t.header.destination_incarnation != 0)
        .unwrap()
        .header;
    for (incarnation, names_us) in [(0x5eed, true), (0x5eee, false)] {
        let mut header = last;
        header.source_incarnation = incarnation;
        if !names_us {
            header.destination_incarnation = 0;
        }
        let mut bytes = vec![0u8; HEADER_LEN];
        header.seq = None;
        header.reply = false;
        header.probe = false;
        header.payload_len = 0;
        if !names_us {
            header.requests = StreamHeader::default();
            header.replies = StreamHeader::default();
            header.horizon = 0;
        }
        header.encode(&mut bytes);
        let expected = if names_us {
            DropReason::StaleIncarnation
        } else {
            DropReason::UnconfirmedIncarnation
        };
        assert_eq!(
            sim.nodes[0].endpoint.receive(sim.now, &bytes),
            Err(expected)
        );
        assert_eq!(sim.nodes[0].endpoint.peer_incarnation(1), live);
    }
    for round in 0..40 {
        sim.queue(0, 1, payload(0, 1, 100 + round));
        sim.queue(1, 0, payload(1, 0, 100 + round));
        sim.run_for(config.peer_timeout / 10);
    }
    sim.run_until_quiet(Duration::from_secs(1));
    assert_eq!(sim.nodes[0].endpoint.peer_incarnation(1), live);
    assert_eq!(sim.nodes[0].endpoint.stats().peers_restarted, 0);
    assert_exactly_once(&sim);
}

#[test]
fn a_gone_peer_rejoins_after_restart() {
    let config = Config::default();
    let mut sim = Sim::new(2, config, Faults::NONE);
    sim.check_cumulative = false;
    sim.queue(1, 0, b"hello".to_vec());
    sim.run_until_quiet(Duration::from_millis(10));
    // Node 1 crashes.
    sim.nodes[1].halted = true;
    let crashed_at = sim.now;
    for index in 0..5 {
        sim.queue(0, 1, payload(0, 1, index));
    }
    sim.run_for(config.peer_timeout + Duration::from_millis(10));
    let events: Vec<Event> = sim.nodes[0].events.iter().map(|(_, e)| *e).collect();
    let mut expected: Vec<Event> = (0..5)
        .map(|seq| Event::Abandoned {
            node: 1,
            stream: Stream::Request,
            seq,
        })
        .collect();
    expected.push(Event::PeerGone { node: 1 });
    assert_eq!(events, expected);
    let gone_at = sim.nodes[0].events.last().unwrap().0;
    assert_eq!(gone_at - crashed_at, config.peer_timeout);
    assert_eq!(
        sim.nodes[0].endpoint.send_reply(sim.now, 1, b"x"),
        Err(SendError::PeerGone(1))
    );

    sim.restart(1, 0x2222);
    sim.queue(1, 0, b"back".to_vec());
    sim.run_until_quiet(Duration::from_millis(100));
    assert!(!sim.nodes[0].endpoint.is_gone(1));
    assert_eq!(
        sim.nodes[0].events.last().unwrap().1,
        Event::PeerRestarted { node: 1 }
    );
    sim.queue(0, 1, b"hello again".to_vec());
    sim.run_until_quiet(Duration::from_millis(100));
    assert_eq!(sim.nodes[1].delivered.len(), 1);
    assert_eq!(sim.nodes[1].delivered[0].payload, b"hello again");
    assert_eq!(sim.nodes[1].delivered[0].seq, 0);
    let last = sim.nodes[0].delivered.last().unwrap();
    assert_eq!((last.seq, &last.payload[..]), (0, &b"back"[..]));
}

#[test]
fn after_a_partition_the_receiver_skips_what_the_sender_abandoned() {
    let config = Config::default();
    let mut sim = Sim::new(2, config, Faults::NONE);
    sim.check_cumulative = false;
    for index in 0..3 {
        sim.queue(0, 1, payload(0, 1, index));
    }
    sim.run_until_quiet(Duration::from_millis(10));
    // Partition: node 0's next messages never arrive.
    sim.set_faults(
        0,
        1,
        Faults {
            loss: 1.0,
            ..Faults::NONE
        },
    );
    for index in 3..7 {
        sim.queue(0, 1, payload(0, 1, index));
    }
    sim.run_for(config.peer_timeout + Duration::from_millis(10));
    assert!(sim.nodes[0].endpoint.is_gone(1));
    assert_eq!(
        sim.nodes[1].endpoint.delivered_through(0, Stream::Request),
        Some(3)
    );

    // Healed: node 1 speaks, node 0 hears it and may send again.
    sim.set_faults(0, 1, Faults::NONE);
    sim.queue(1, 0, b"still here".to_vec());
    sim.run_until_quiet(Duration::from_millis(50));
    assert!(!sim.nodes[0].endpoint.is_gone(1));
    sim.queue(0, 1, b"resumed".to_vec());
    sim.run_until_quiet(Duration::from_millis(50));
    let skipped: Vec<Event> = sim.nodes[1]
        .events
        .iter()
        .map(|(_, e)| *e)
        .filter(|e| matches!(e, Event::PeerAbandoned { .. }))
        .collect();
    assert_eq!(
        skipped,
        vec![Event::PeerAbandoned {
            node: 0,
            stream: Stream::Request,
            from: 3,
            until: 7,
            missing: 4
        }]
    );
    assert_eq!(sim.nodes[1].endpoint.stats().peer_abandoned, 4);
    let last = sim.nodes[1].delivered.last().unwrap();
    assert_eq!((last.seq, &last.payload[..]), (7, &b"resumed"[..]));
    assert_eq!(
        sim.nodes[1].endpoint.delivered_through(0, Stream::Request),
        Some(8)
    );
}

#[test]
fn a_gone_peer_can_be_revived_by_the_caller() {
    let config = Config::default();
    let mut sim = Sim::new(2, config, Faults::NONE);
    sim.check_cumulative = false;
    sim.queue(0, 1, b"first".to_vec());
    sim.run_until_quiet(Duration::from_millis(10));
    sim.set_faults(
        0,
        1,
        Faults {
            loss: 1.0,
            ..Faults::NONE
        },
    );
    sim.queue(0, 1, b"lost".to_vec());
    sim.run_for(config.peer_timeout + Duration::from_millis(10));
    assert!(sim.nodes[0].endpoint.is_gone(1));
    // Node 1 never speaks first. A reply to it is refused until node 0's
    // caller revives it (a request would probe it by itself).
    sim.set_faults(0, 1, Faults::NONE);
    assert_eq!(
        sim.nodes[0].endpoint.send_reply(sim.now, 1, b"x"),
        Err(SendError::PeerGone(1))
    );
    assert!(sim.nodes[0].endpoint.revive_peer(1));
    assert!(!sim.nodes[0].endpoint.revive_peer(1));
    assert!(!sim.nodes[0].endpoint.revive_peer(77));
    sim.queue(0, 1, b"retry".to_vec());
    sim.run_until_quiet(Duration::from_millis(50));
    let last = sim.nodes[1].delivered.last().unwrap();
    assert_eq!((last.seq, &last.payload[..]), (2, &b"retry"[..]));
    assert_eq!(
        sim.nodes[1].events.last().unwrap().1,
        Event::PeerAbandoned {
            node: 0,
            stream: Stream::Request,
            from: 1,
            until: 2,
            missing: 1
        }
    );
    assert_eq!(
        sim.nodes[0].events.last().unwrap().1,
        Event::Acked {
            node: 1,
            stream: Stream::Request,
            seq: 2,
            horizon: 0
        }
    );
}

/// Moves datagrams between two endpoints and runs their timers until both
/// are quiet or `limit` passed; returns the time reached and the payloads
/// each delivered.
fn pump(
    a: &mut Endpoint,
    b: &mut Endpoint,
    mut now: Instant,
    limit: Duration,
) -> (Instant, Vec<Vec<u8>>, Vec<Vec<u8>>) {
    let end = now + limit;
    let (mut got_a, mut got_b) = (Vec::new(), Vec::new());
    let mut buf = vec![0; a.max_datagram_len().max(b.max_datagram_len())];
    for _ in 0..100_000 {
        a.handle_timeout(now);
        b.handle_timeout(now);
        let mut moved = false;
        while let Some((_, len)) = a.poll_transmit(now, &mut buf) {
            moved = true;
            if let Ok(Some(message)) = b.receive(now, &buf[..len]) {
                got_b.push(message.payload.to_vec());
            }
        }
        while let Some((_, len)) = b.poll_transmit(now, &mut buf) {
            moved = true;
            if let Ok(Some(message)) = a.receive(now, &buf[..len]) {
                got_a.push(message.payload.to_vec());
            }
        }
        if moved {
            continue;
        }
        match [a.poll_timeout(), b.poll_timeout()]
            .into_iter()
            .flatten()
            .min()
        {
            Some(at) if at <= end => now = now.max(at),
            _ => return (now, got_a, got_b),
        }
    }
    panic!("the endpoints spin");
}

#[test]
fn no_response_room_defers_a_message_until_acks_free_the_window() {
    let config = Config {
        window: 2,
        ..Config::default()
    };
    let identity = |node, incarnation| Identity {
        fabric: FABRIC,
        node,
        incarnation,
    };
    let mut a = Endpoint::new(identity(0, 10), config).unwrap();
    let mut b = Endpoint::new(identity(1, 20), config).unwrap();
    a.add_peer(1).unwrap();
    b.add_peer(0).unwrap();
    // They get to know each other.
    let start = Instant::now();
    a.send(start, 1, b"hi").unwrap();
    b.send(start, 0, b"hi").unwrap();
    let (now, got_a, got_b) = pump(&mut a, &mut b, start, Duration::from_millis(10));
    assert_eq!((got_a.len(), got_b.len()), (1, 1));
    assert_eq!((a.outstanding(1), b.outstanding(0)), (Some(0), Some(0)));
    // A's first message named no incarnation of B and was sent again; B's
    // left after B had heard from A, so it named A.
    assert_eq!(a.stats().not_yet_introduced, 0);
    assert_eq!(b.stats().not_yet_introduced, 1);

    let mut buf = vec![0; a.max_datagram_len()];
    // A fills its reply window to B; the replies are lost. Its request
    // window is its own.
    a.send_reply(now, 1, b"1").unwrap();
    a.send_reply(now, 1, b"2").unwrap();
    assert_eq!(a.send_reply(now, 1, b"3"), Err(SendError::WindowFull));
    while a.poll_transmit(now, &mut buf).is_some() {}
    // B's request cannot be answered yet: not delivered.
    b.send(now, 0, b"request").unwrap();
    let (_, len) = b.poll_transmit(now, &mut buf).unwrap();
    let request = buf[..len].to_vec();
    let through = a.delivered_through(1, Stream::Request);
    assert_eq!(a.receive(now, &request), Err(DropReason::NoResponseRoom));
    assert_eq!(a.delivered_through(1, Stream::Request), through);
    assert_eq!(a.stats().no_response_room, 1);
    // A reply needs no room: delivered even while A's window is full.
    b.send_reply(now, 0, b"reply").unwrap();
    let (_, len) = b.poll_transmit(now, &mut buf).unwrap();
    let reply_datagram = buf[..len].to_vec();
    let reply = a.receive(now, &reply_datagram).unwrap().unwrap();
    assert_eq!(reply.stream, Stream::Reply);
    assert_eq!(reply.payload, b"reply");
    // Once B acknowledges A's messages, the retransmitted request is
    // delivered.
    let (_, got_a, got_b) = pump(&mut a, &mut b, now, Duration::from_millis(100));
    assert_eq!(got_a, vec![b"request".to_vec()]);
    assert_eq!(got_b, vec![b"1".to_vec(), b"2".to_vec()]);
    assert_eq!((a.outstanding(1), b.outstanding(0)), (Some(0), Some(0)));
}

#[test]
fn invalid_configurations_are_refused() {
    let identity = Identity {
        fabric: 1,
        node: 0,
        incarnation: 1,
    };
    let bad = [
        Config {
            window: 65,
            ..Config::default()
        },
        Config {
            window: 0,
            ..Config::default()
        },
        Config {
            rto_min: Duration::from_secs(1),
            ..Config::default()
        },
        Config {
            rto_max: Duration::from_secs(5),
            ..Config::default()
        },
        Config {
            pool_slots: 0,
            ..Config::default()
        },
        Config {
            max_payload: 70_000,
            ..Config::default()
        },
        Config {
            fast_retransmit_threshold: 0,
            ..Config::default()
        },
        Config {
            ack_delay: Config::ACK_DELAY_LIMIT + Duration::from_micros(1),
            ..Config::default()
        },
        Config {
            response_reserve: 65,
            window: 64,
            ..Config::default()
        },
    ];
    for config in bad {
        assert!(Endpoint::new(identity, config).is_err(), "{config:?}");
    }
    assert!(Endpoint::new(
        Identity {
            incarnation: 0,
            ..identity
        },
        Config::default()
    )
    .is_err());
    let mut endpoint = Endpoint::new(identity, Config::default()).unwrap();
    assert!(endpoint.add_peer(0).is_err());
    endpoint.add_peer(1).unwrap();
    assert!(endpoint.add_peer(1).is_err());
    let random = Identity::with_random_incarnation(1, 0).unwrap();
    assert_ne!(random.incarnation, 0);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    #[test]
    fn exactly_once_for_any_seed_and_fault_rates(
        seed in any::<u64>(),
        loss in 0.0..0.2f64,
        duplicate in 0.0..0.1f64,
        reorder in 0.0..0.2f64,
        delay_us in 0u64..500,
    ) {
        let faults = Faults {
            loss, duplicate, reorder,
            delay: Duration::from_micros(delay_us),
            reorder_hold: Duration::from_micros(200),
            seed,
        };
        let mut sim = Sim::new(3, Config::default(), faults);
        for from in 0..3 {
            for to in (0..3).filter(|&to| to != from) {
                for index in 0..60 {
                    sim.queue(from, to, payload(from, to, index));
                }
            }
        }
        sim.run_until_quiet(Duration::from_secs(2));
        assert_exactly_once(&sim);
        assert_counters_add_up(&sim);
    }

    #[test]
    fn horizon_holds_for_any_seed_and_fault_rates(
        seed in any::<u64>(),
        loss in 0.0..0.2f64,
        duplicate in 0.0..0.1f64,
        reorder in 0.0..0.2f64,
        delay_us in 0u64..300,
    ) {
        check_horizon(
            Faults {
                loss, duplicate, reorder,
                delay: Duration::from_micros(delay_us),
                reorder_hold: Duration::from_micros(200),
                seed,
            },
            Config { response_reserve: 2, ..Config::default() },
        );
    }

    #[test]
    fn receive_never_panics_on_hostile_bytes(
        bytes in proptest::collection::vec(any::<u8>(), 0..200),
        flips in proptest::collection::vec((0usize..HEADER_LEN + 5, any::<u8>()), 0..6),
        seq in proptest::option::of(0u32..200),
    ) {
        let mut endpoint = Sim::endpoint(0, 100, Config::default(), 3);
        let now = Instant::now();
        let _ = endpoint.receive(now, &bytes);
        // Valid datagrams with a few bytes changed reach deeper checks.
        let mut mutated = datagram(1, 55, if flips.len() % 2 == 0 { 100 } else { 0 }, seq);
        for (at, value) in flips {
            if let Some(byte) = mutated.get_mut(at) {
                *byte = value;
            }
        }
        let _ = endpoint.receive(now, &mutated);
        endpoint.handle_timeout(now + Duration::from_millis(1));
        let mut buf = vec![0; endpoint.max_datagram_len()];
        let mut sent = 0;
        while endpoint.poll_transmit(now + Duration::from_millis(1), &mut buf).is_some() {
            sent += 1;
            prop_assert!(sent < 10);
        }
        prop_assert_eq!(endpoint.stats().datagrams_received, 2);
    }
}

/// A device that runs longer than the 32-bit microsecond clock of pending
/// acknowledgements (71.6 minutes) keeps its promises across the wrap,
/// under loss, and its timers still fire there.
#[test]
fn a_run_across_the_wrap_of_the_acknowledgement_clock_keeps_every_promise() {
    let config = Config::default();
    let mut sim = Sim::new(3, config, lossy(21));
    let before_wrap = Duration::from_millis(20);
    sim.idle(ACK_CLOCK_PERIOD - before_wrap);
    let total_timeouts =
        |sim: &Sim| -> u64 { sim.nodes.iter().map(|n| n.endpoint.stats().timeouts).sum() };
    // Traffic in every direction from before the wrap until after it.
    let mut timeouts_at_wrap = None;
    let mut index = 0;
    while sim.elapsed() < ACK_CLOCK_PERIOD + before_wrap {
        for from in 0..3 {
            for to in (0..3).filter(|&to| to != from) {
                sim.queue(from, to, payload(from, to, index));
            }
        }
        index += 1;
        sim.run_for(Duration::from_micros(200));
        if sim.elapsed() >= ACK_CLOCK_PERIOD && timeouts_at_wrap.is_none() {
            timeouts_at_wrap = Some(total_timeouts(&sim));
        }
    }
    sim.run_until_quiet(Duration::from_secs(2));
    assert_exactly_once(&sim);
    assert_counters_add_up(&sim);
    let wrap = sim.start + ACK_CLOCK_PERIOD;
    let sent_before = |kind: fn(&Header) -> bool| {
        sim.transmissions
            .iter()
            .filter(|t| kind(&t.header))
            .partition::<Vec<_>, _>(|t| t.at < wrap)
    };
    for (what, kind) in [
        (
            "messages",
            (|h: &Header| h.seq.is_some()) as fn(&Header) -> bool,
        ),
        ("pure acknowledgements", |h: &Header| h.seq.is_none()),
    ] {
        let (before, after) = sent_before(kind);
        assert!(
            before.len() > 100 && after.len() > 100,
            "{what}: {} before the wrap, {} after",
            before.len(),
            after.len()
        );
    }
    // Messages were retransmitted, and retransmission timers fired, on
    // both sides of the wrap.
    let mut seen = HashSet::new();
    let retransmitted_at: Vec<Instant> = sim
        .transmissions
        .iter()
        .filter(|t| {
            let Some(seq) = t.header.seq else {
                return false;
            };
            !seen.insert((t.from, t.to, t.header.reply, seq))
        })
        .map(|t| t.at)
        .collect();
    assert!(retransmitted_at.iter().any(|&at| at < wrap));
    assert!(retransmitted_at.iter().any(|&at| at >= wrap));
    let timeouts_at_wrap = timeouts_at_wrap.expect("the run crossed the wrap");
    assert!(timeouts_at_wrap > 0);
    assert!(total_timeouts(&sim) > timeouts_at_wrap);

    // After the wrap a silent peer is still given up `peer_timeout` after
    // the message was sent.
    sim.set_faults(
        0,
        1,
        Faults {
            loss: 1.0,
            ..Faults::NONE
        },
    );
    let events_before = sim.nodes[0].events.len();
    let sent_at = sim.now;
    sim.queue(0, 1, b"into the void".to_vec());
    sim.run_for(config.peer_timeout + Duration::from_millis(10));
    let gone: Vec<Instant> = sim.nodes[0].events[events_before..]
        .iter()
        .filter(|(_, event)| *event == Event::PeerGone { node: 1 })
        .map(|(at, _)| *at)
        .collect();
    // Timers count whole microseconds since the endpoint's first `now`, and
    // the faults' delays have nanosecond grain: the time is exact to the
    // microsecond.
    assert_eq!(gone.len(), 1, "{gone:?}");
    let exact = sent_at + config.peer_timeout;
    assert!(gone[0] <= exact && exact - gone[0] < Duration::from_micros(1));
}

/// Endpoints 0 and 1 that have met; at `at` after their clocks started,
/// node 1 receives a message and owes its acknowledgement. Returns both,
/// that instant and a buffer.
fn owe_an_acknowledgement(config: Config, at: Duration) -> (Endpoint, Endpoint, Instant, Vec<u8>) {
    let mut a = Sim::endpoint(0, 0xa, config, 2);
    let mut b = Sim::endpoint(1, 0xb, config, 2);
    let start = Instant::now();
    a.send(start, 1, b"hello").unwrap();
    b.handle_timeout(start);
    let (met, _, got_b) = pump(&mut a, &mut b, start, Duration::from_millis(10));
    assert_eq!(got_b, vec![b"hello".to_vec()]);
    assert_eq!((a.poll_timeout(), b.poll_timeout()), (None, None));
    let owed = start + at;
    assert!(owed > met);
    let mut buf = vec![0; a.max_datagram_len()];
    a.send(owed, 1, b"again").unwrap();
    let (_, len) = a.poll_transmit(owed, &mut buf).unwrap();
    let message = b.receive(owed, &buf[..len]).unwrap().unwrap();
    assert_eq!(message.payload, b"again");
    assert_eq!(b.poll_timeout(), Some(owed + config.ack_delay));
    (a, b, owed, buf)
}

/// Sends node 1's owed pure acknowledgement at `at` and checks that node 0
/// takes it.
fn acknowledgement_leaves_at(a: &mut Endpoint, b: &mut Endpoint, at: Instant, buf: &mut [u8]) {
    let (to, len) = b.poll_transmit(at, buf).expect("the owed acknowledgement");
    assert_eq!(to, 0);
    let (header, _) = Header::decode(&buf[..len]).unwrap();
    assert_eq!(header.seq, None);
    assert!(b.poll_transmit(at, buf).is_none());
    assert_eq!(b.poll_timeout(), None);
    assert_eq!(a.receive(at, &buf[..len]), Ok(None));
    assert_eq!(a.outstanding(1), Some(0));
}

/// A pending acknowledgement's due time keeps 32 bits of microseconds: one
/// that falls due across their wrap leaves neither early nor late.
#[test]
fn an_acknowledgement_due_across_the_wrap_leaves_on_time() {
    let config = Config::default();
    let owed_at = ACK_CLOCK_PERIOD - config.ack_delay / 2;
    let (mut a, mut b, owed, mut buf) = owe_an_acknowledgement(config, owed_at);
    let due = owed + config.ack_delay;
    for early in [
        owed,
        owed + config.ack_delay / 4,
        due - Duration::from_micros(1),
    ] {
        assert!(b.poll_transmit(early, &mut buf).is_none(), "{early:?}");
        assert_eq!(b.poll_timeout(), Some(due));
    }
    acknowledgement_leaves_at(&mut a, &mut b, due, &mut buf);
}

/// An acknowledgement owed before the device stalls, across the wrap of
/// its 32-bit microsecond due time or for longer than that, is sent when
/// the device resumes.
#[test]
fn an_acknowledgement_owed_across_a_long_stall_is_sent() {
    let config = Config::default();
    let cases = [
        (
            ACK_CLOCK_PERIOD - Duration::from_secs(1),
            Duration::from_secs(2),
        ),
        (
            Duration::from_millis(20),
            ACK_CLOCK_PERIOD + Duration::from_secs(1),
        ),
        (
            ACK_CLOCK_PERIOD - Duration::from_secs(1),
            ACK_CLOCK_PERIOD + Duration::from_secs(2),
        ),
        (
            Duration::from_millis(20),
            2 * ACK_CLOCK_PERIOD - Duration::from_secs(1),
        ),
        (
            Duration::from_millis(20),
            3 * ACK_CLOCK_PERIOD + Duration::from_millis(1),
        ),
    ];
    for (owed_at, stall) in cases {
        let (mut a, mut b, owed, mut buf) = owe_an_acknowledgement(config, owed_at);
        acknowledgement_leaves_at(&mut a, &mut b, owed + stall, &mut buf);
    }
}

/// The retransmission and peer-gone timers live with the peer's oldest
/// outstanding message (a request before a reply): when a request joins an
/// outstanding reply they carry on unchanged, and the peer is given up
/// `peer_timeout` after the reply became outstanding.
#[test]
fn timers_carry_on_when_the_oldest_outstanding_message_changes() {
    let config = Config::default();
    let mut a = Sim::endpoint(0, 0xa, config, 2);
    let mut b = Sim::endpoint(1, 0xb, config, 2);
    let start = Instant::now();
    a.send(start, 1, b"hello").unwrap();
    let (met, _, _) = pump(&mut a, &mut b, start, Duration::from_millis(10));
    while a.poll_event().is_some() {}
    let rto = a.rto(1).unwrap();

    // A reply goes out and is lost; the retransmission timer runs.
    let mut buf = vec![0; a.max_datagram_len()];
    let first = met + Duration::from_millis(1);
    a.send_reply(first, 1, b"reply").unwrap();
    assert!(a.poll_transmit(first, &mut buf).is_some());
    assert_eq!(a.poll_timeout(), Some(first + rto));
    // A request joins it before the timer fires: same timers.
    let later = first + rto / 2;
    a.send(later, 1, b"request").unwrap();
    assert_eq!(a.poll_timeout(), Some(first + rto));
    assert!(a.poll_transmit(later, &mut buf).is_some());
    assert_eq!(a.poll_timeout(), Some(first + rto));
    assert_eq!(a.outstanding(1), Some(2));

    // Everything is lost from now on: the reply is retransmitted when the
    // timer it started fires, and the peer is given up `peer_timeout` after the reply
    // became outstanding.
    let mut retransmitted_at = Vec::new();
    let gone_at = loop {
        let at = a.poll_timeout().expect("a timer runs");
        assert!(at <= first + config.peer_timeout, "{:?}", at - first);
        a.handle_timeout(at);
        while let Some((_, len)) = a.poll_transmit(at, &mut buf) {
            let (header, _) = Header::decode(&buf[..len]).unwrap();
            retransmitted_at.push((at, header.reply));
        }
        if let Some(event) = std::iter::from_fn(|| a.poll_event())
            .find(|event| matches!(event, Event::PeerGone { .. }))
        {
            assert_eq!(event, Event::PeerGone { node: 1 });
            break at;
        }
    };
    // Only the reply had waited a full timeout when the timer fired.
    assert_eq!(retransmitted_at[0], (first + rto, true));
    assert!(retransmitted_at[1].0 > first + rto);
    assert_eq!(gone_at, first + config.peer_timeout);
    assert_eq!(a.outstanding(1), Some(0));
}

/// Node 1 restarts; node 0 proposes the new life and introduces itself,
/// the new life learns node 0 from it, but every answer is lost for longer
/// than the proposal lasts (a peer timeout), and each side gives its
/// message up. The new life then names node 0 without being proposed any
/// more: node 0 proposes it again and introduces itself, and the restart
/// goes through on the answer: the new life's next message is delivered
/// once, and both directions work.
#[test]
fn a_restart_whose_answers_were_lost_for_a_peer_timeout_still_goes_through() {
    let config = Config::default();
    let mut a = Sim::endpoint(0, 100, config, 2);
    let mut b = Sim::endpoint(1, 1, config, 2);
    let start = Instant::now();
    a.send(start, 1, b"to the first life").unwrap();
    b.send(start, 0, b"from the first life").unwrap();
    let (now, got_a, got_b) = pump(&mut a, &mut b, start, Duration::from_millis(50));
    assert_eq!((got_a.len(), got_b.len()), (1, 1));
    a.send(now, 1, b"to a life that ended").unwrap();

    let mut b = Sim::endpoint(1, 2, config, 2);
    let mut buf = vec![0; a.max_datagram_len()];
    b.send(now, 0, b"from the second life").unwrap();
    let (_, len) = b.poll_transmit(now, &mut buf).unwrap();
    assert_eq!(
        a.receive(now, &buf[..len]),
        Err(DropReason::UnconfirmedIncarnation)
    );
    // A's datagrams: its message to the first life, and the introduction.
    let mut introduced = false;
    while let Some((_, len)) = a.poll_transmit(now, &mut buf) {
        let result = b.receive(now, &buf[..len]);
        introduced |= result == Ok(None);
    }
    assert!(introduced);
    assert_eq!(b.peer_incarnation(0), Some(100));
    // Every answer of the second life is lost for two peer timeouts.
    let mut now = now;
    let end = now + config.peer_timeout * 2;
    while now < end {
        now += Duration::from_millis(10);
        a.handle_timeout(now);
        b.handle_timeout(now);
        while b.poll_transmit(now, &mut buf).is_some() {}
        while let Some((_, len)) = a.poll_transmit(now, &mut buf) {
            let _ = b.receive(now, &buf[..len]);
        }
    }
    assert_eq!(a.peer_incarnation(1), Some(1));
    assert_eq!(a.stats().peers_restarted, 0);
    // Each side gave its message up meanwhile. The wire works again, and
    // the second life sends (naming node 0, which it learnt from the
    // introduction).
    assert!(b.is_gone(0) && a.is_gone(1));
    b.send(now, 0, b"after the partition").unwrap();
    let (now, got_a, _) = pump(&mut a, &mut b, now, Duration::from_secs(2));
    assert_eq!(a.peer_incarnation(1), Some(2));
    assert_eq!(a.stats().peers_restarted, 1);
    assert_eq!(got_a, [b"after the partition".to_vec()]);
    // Both directions work in the new sequence spaces.
    a.send(now, 1, b"welcome").unwrap();
    let (_, _, got_b) = pump(&mut a, &mut b, now, Duration::from_secs(1));
    assert_eq!(got_b, [b"welcome".to_vec()]);
}

/// A lost message is sent again within a few timeouts even while the
/// peer keeps acknowledging other messages: node 1 sends a request every
/// millisecond and node 0 answers each, so acknowledgements of node 0's
/// replies arrive far more often than its retransmission timeout (the
/// links delay datagrams by up to 20 ms), while node 0's one request is
/// lost on its first transmission and no later request of node 0's can
/// reveal the gap.
#[test]
fn a_lost_message_is_sent_again_while_other_acknowledgements_flow() {
    let faults = Faults {
        delay: Duration::from_millis(20),
        seed: 3,
        ..Faults::NONE
    };
    let mut sim = Sim::new(2, Config::default(), faults);
    sim.responders.insert(
        0,
        Box::new(|_, request: &Delivery| vec![(request.from, request.payload.clone())]),
    );
    let mut dropped = None;
    sim.drop_filter = Some(Box::new(move |t: &Transmission| {
        let lone_request = t.from == 0 && !t.header.reply && t.header.seq.is_some();
        lone_request && dropped.replace(t.header.seq).is_none()
    }));
    // Traffic first, so that the round trip is measured.
    for index in 0..200 {
        sim.queue(1, 0, payload(1, 0, index));
        sim.run_for(Duration::from_millis(1));
    }
    let lost = b"the lone request".to_vec();
    sim.queue(0, 1, lost.clone());
    let sent_at = sim.now;
    for index in 200..1200 {
        sim.queue(1, 0, payload(1, 0, index));
        sim.run_for(Duration::from_millis(1));
    }
    let arrived = sim.nodes[1]
        .delivered
        .iter()
        .find(|d| d.from == 0 && d.payload == lost)
        .map(|d| d.at - sent_at);
    // The timeout is at most 100 ms; a round trip at most 40 ms.
    assert!(
        arrived.is_some_and(|after| after < Duration::from_millis(300)),
        "the lost request arrived after {arrived:?} (node 0 retransmitted {} times)",
        sim.nodes[0].endpoint.stats().retransmissions
    );
}

/// Requests lost together while acknowledgements of replies flow: one
/// timeout sends the oldest as a probe, its echo sends the rest, and the
/// acknowledgements arriving meanwhile set off no timeout per lost
/// message (each would double the backoff).
#[test]
fn requests_lost_together_take_one_timeout() {
    let faults = Faults {
        reorder: 1.0,
        reorder_hold: Duration::from_millis(10),
        seed: 3,
        ..Faults::NONE
    };
    let config = Config {
        rto_min: Duration::from_millis(50),
        ..Config::default()
    };
    let mut sim = Sim::new(2, config, faults);
    sim.responders.insert(
        0,
        Box::new(|_, request: &Delivery| vec![(request.from, request.payload.clone())]),
    );
    let dropping = std::rc::Rc::new(std::cell::Cell::new(false));
    let mut dropped = HashSet::new();
    let drop_now = dropping.clone();
    sim.drop_filter = Some(Box::new(move |t: &Transmission| {
        let request = t.from == 0 && !t.header.reply && t.header.seq.is_some();
        request && drop_now.get() && dropped.insert(t.header.seq)
    }));
    for index in 0..200 {
        sim.queue(1, 0, payload(1, 0, index));
        sim.run_for(Duration::from_millis(1));
    }
    let before = *sim.nodes[0].endpoint.stats();
    dropping.set(true);
    for k in 0..20u8 {
        sim.queue(0, 1, vec![k; 16]);
    }
    sim.run_for(Duration::from_micros(10));
    dropping.set(false);
    for index in 200..600 {
        sim.queue(1, 0, payload(1, 0, index));
        sim.run_for(Duration::from_millis(1));
    }
    let after = sim.nodes[0].endpoint.stats();
    let delivered = sim.nodes[1]
        .delivered
        .iter()
        .filter(|d| d.from == 0 && d.stream == Stream::Request)
        .count();
    assert_eq!(delivered, 20, "every lost request arrived");
    assert_eq!(after.timeouts - before.timeouts, 1, "{after:?}");
    assert_eq!(after.lost_before_probe - before.lost_before_probe, 19);
}
