//! Invalidation, revocation and reset are barriers: once the owner of a
//! window has revoked it, or taken the device's access to its memory away
//! (unregistered, invalidated, unpinned, evicted from a small pin-down
//! cache), or reset its port (RESET_OWNER, RDMA rings disabled, SET_FEATURES
//! again, or its process killed), no access that began earlier still reads
//! or writes those pages, and none starts afterwards.
//!
//! Each test runs a real device process and rank processes (this test
//! binary started again with `PINDOWN_ROLE` set, as in `ranks.rs`), each a
//! driver [`Context`] on its own socket: an owner with a 16 MiB buffer
//! behind a window, and two peers that move 16 MiB at a time through it.
//! One round:
//!
//! 1. The owner fills its buffer with the *old* pattern and binds a window.
//! 2. A peer posts several 16 MiB transfers through the window.
//! 3. The owner waits until the first transfer is under way — for writes,
//!    until the peer's bytes reach a random offset of its buffer; for reads,
//!    until the peer's first request (an 8-byte write of a flag next to the
//!    buffer) has landed, and then a random while longer — and does the
//!    barrier. As soon as the barrier has returned, it overwrites the whole
//!    buffer with the *new* pattern (the marker).
//! 4. The peer waits until every request it posted has completed (success
//!    or error): exactly one completion per request.
//! 5. Writes: every marker byte is intact. Reads: a read that succeeded
//!    holds only old bytes, exactly; one that failed holds, at each offset,
//!    the old byte or the byte that was there before (it may have been cut
//!    between two steps); no byte of the new pattern appears anywhere.
//!
//! Every barrier kind runs with writes and with reads in flight. A step of
//! a transfer takes the gates of its two ports in port order, so the owner
//! sits on port 1 between the peers on ports 0 and 2, and the rounds
//! alternate between the peers: each (barrier, direction) meets both gate
//! orders, and each order must see at least one transfer cut by the
//! barrier (a test that never races proves nothing).
//!
//! The disconnect barrier: the owner's process is killed (SIGKILL) while
//! the peer's transfers are in flight. Before that, the test opens the
//! owner's DMA arena (its one memfd) through `/proc/<pid>/fd`, so the
//! memory outlives the process. Once the device's status shows the port
//! disconnected (it resets the port, the barrier, before that), the test
//! writes the marker through its own mapping; the checks of step 5 follow.
//! Each round starts an owner process.
//!
//! The four patterns (the peer's read destinations before, old, peer's
//! source, new) use disjoint byte values (the top two bits tell them
//! apart), so a single misplaced byte is caught. Rounds: `BARRIER_ROUNDS`
//! per test (at least 2; default 200, half with each gate order). With
//! the default the whole file takes about two minutes on two cores; a
//! disconnect test alone about 20 s (a process start per round), well
//! under a minute when the cores are busy.

mod common;

use std::collections::HashSet;
use std::io::BufRead;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::rank::{say, Rank};
use common::DeviceProcess;
use pindown_driver::transport::{Transport, DEFAULT_FEATURES};
use pindown_driver::verbs::opcode::{Read, Write};
use pindown_driver::verbs::{
    CompletionQueue, Context, ContextConfig, Entry, MemoryWindow, RemoteWindow,
};
use pindown_driver::DmaBuffer;
use pindown_pincache::CacheConfig;
use pindown_uapi::{Access, Status, ADMIN_QUEUE_PAIR};
use vm_memory::{Bytes, FileOffset, MmapRegion, VolatileMemory};

/// Bytes of the owner's buffer under test, and of each transfer.
const BUFFER: usize = 16 << 20;
/// Offset (in the window) of the flag the peer writes before its reads.
const FLAG_OFFSET: usize = BUFFER;
/// The window: the buffer and the flag's page.
const WINDOW: usize = BUFFER + 4096;
/// 16 MiB writes posted per round.
const WRITES: u64 = 4;
/// 16 MiB reads posted per round (after the flag write).
const READS: usize = 3;
/// Longest a read round waits after the flag before the barrier (a 16 MiB
/// copy takes a few milliseconds).
const MAX_READ_DELAY_US: u64 = 4000;

/// What the owner does to take access away while transfers are in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Barrier {
    /// `Context::revoke_window`.
    Revoke,
    /// `Context::invalidate` while the region is still held, then the
    /// region dropped: the drop unpins (IOTLB INVALIDATE) and returns.
    Unregister,
    /// The region dropped (idle in the pin-down cache), then
    /// `Context::invalidate`, which unpins at once.
    Invalidate,
    /// The IOTLB INVALIDATE that the driver's pinner sends on unpin,
    /// through the transport, while the region is still held.
    Unpin,
    /// A pin-down cache of 2 entries: registering two other buffers evicts
    /// the region before the second `register` returns.
    Evict,
    /// RESET_OWNER, acknowledged.
    ResetOwner,
    /// SET_VRING_ENABLE(0) on both RDMA rings, acknowledged; then
    /// SET_FEATURES again and an INVALIDATE of the whole arena.
    RingDisable,
    /// SET_FEATURES again while the rings run, acknowledged; then an
    /// INVALIDATE of the whole arena.
    SetFeatures,
}

impl Barrier {
    const ALL: [Barrier; 8] = [
        Barrier::Revoke,
        Barrier::Unregister,
        Barrier::Invalidate,
        Barrier::Unpin,
        Barrier::Evict,
        Barrier::ResetOwner,
        Barrier::RingDisable,
        Barrier::SetFeatures,
    ];

    fn name(self) -> String {
        format!("{self:?}")
    }

    fn parse(text: &str) -> Barrier {
        Barrier::ALL
            .into_iter()
            .find(|b| b.name() == text)
            .unwrap_or_else(|| panic!("unknown barrier {text}"))
    }

    /// Whether the owner's port is gone afterwards (a new connection per
    /// round).
    fn resets_port(self) -> bool {
        matches!(
            self,
            Barrier::ResetOwner | Barrier::RingDisable | Barrier::SetFeatures
        )
    }
}

// ---------------------------------------------------------------- patterns

/// Byte classes: the top two bits of every byte of a pattern.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Class {
    /// The peer's read destinations before a round.
    Before = 0,
    /// The owner's bytes before the barrier.
    Old = 1,
    /// The bytes the peer writes.
    Peer = 2,
    /// The owner's bytes after the barrier (the marker).
    New = 3,
}

fn pattern(class: Class, len: usize) -> Vec<u8> {
    let salt = (class as u64 + 1).wrapping_mul(0xD1B5_4A32_D192_ED03);
    (0..len as u64)
        .map(|i| {
            let mixed = (i ^ salt).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            ((class as u8) << 6) | (mixed >> 58) as u8
        })
        .collect()
}

fn class_of(byte: u8) -> Class {
    [Class::Before, Class::Old, Class::Peer, Class::New][usize::from(byte >> 6)]
}

/// The first offset where `landed` differs from `expected`, how many bytes
/// differ, and the class of the first wrong byte.
fn difference(landed: &[u8], expected: &[u8]) -> Option<(usize, usize, Class)> {
    let first = landed.iter().zip(expected).position(|(a, b)| a != b)?;
    let count = landed.iter().zip(expected).filter(|(a, b)| a != b).count();
    Some((first, count, class_of(landed[first])))
}

/// The first offset where `landed` holds neither the byte of `a` nor the
/// byte of `b` (page by page: most pages equal one of them whole).
fn neither(landed: &[u8], a: &[u8], b: &[u8]) -> Option<usize> {
    const PAGE: usize = 4096;
    (0..landed.len()).step_by(PAGE).find_map(|start| {
        let end = (start + PAGE).min(landed.len());
        let (page, a, b) = (&landed[start..end], &a[start..end], &b[start..end]);
        if page == a || page == b {
            return None;
        }
        let at = (0..page.len()).find(|&i| page[i] != a[i] && page[i] != b[i])?;
        Some(start + at)
    })
}

/// A small deterministic generator for watch offsets and delays.
struct Rng(u64);

impl Rng {
    fn below(&mut self, bound: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % bound
    }
}

// ---------------------------------------------------------------- ranks

/// Polls `done` until it holds (yielding the CPU between looks, so that
/// the device's threads run first when the cores are busy).
fn spin_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::yield_now();
    }
}

/// The owner's context and buffers (a new set after each port reset).
struct Owner {
    context: Context,
    /// The buffer under test and the flag's page.
    target: DmaBuffer,
    /// Two buffers whose registration evicts `target` from a 2-entry cache.
    others: [DmaBuffer; 2],
}

impl Owner {
    /// Connects with a pin-down cache of `cache_entries` entries.
    fn open(socket: &str, cache_entries: usize) -> Owner {
        let context = Context::open(
            socket,
            ContextConfig {
                arena_bytes: 24 << 20,
                cache: CacheConfig {
                    max_entries: cache_entries,
                    // One buffer, one cache entry: neighbours never merge.
                    merge: false,
                    ..CacheConfig::default()
                },
                ..ContextConfig::default()
            },
        )
        .expect("owner: open");
        let target = context.alloc(WINDOW, 4096).unwrap();
        let others = [
            context.alloc(4096, 4096).unwrap(),
            context.alloc(4096, 4096).unwrap(),
        ];
        Owner {
            context,
            target,
            others,
        }
    }

    fn flag(&self) -> u64 {
        let mut word = [0u8; 8];
        self.target.read_at(FLAG_OFFSET, &mut word);
        u64::from_le_bytes(word)
    }

    /// Takes the whole arena away from the device (every IOTLB entry).
    fn invalidate_arena(&self) {
        let arena = self.target.arena();
        self.context
            .transport()
            .iotlb_unmap(arena.addr(), arena.size() as u64)
            .expect("owner: INVALIDATE of the arena");
    }
}

fn owner_rank(socket: &str, barrier: Barrier, write: bool) {
    let old = pattern(Class::Old, BUFFER);
    let new = pattern(Class::New, BUFFER);
    let mut owner = None;
    let mut lines = std::io::stdin().lock().lines();
    while let Some(Ok(line)) = lines.next() {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["round", round, watch, delay] => {
                let round: u64 = round.parse().unwrap();
                let (watch, delay): (usize, u64) = (watch.parse().unwrap(), delay.parse().unwrap());
                let entries = if barrier == Barrier::Evict { 2 } else { 64 };
                let me: &Owner = owner.get_or_insert_with(|| Owner::open(socket, entries));
                let verdict = owner_round(
                    me, barrier, write, round, watch, delay, &old, &new, &mut lines,
                );
                if barrier.resets_port() {
                    // The port is gone: the next round connects again.
                    owner = None;
                }
                say(verdict);
            }
            ["exit"] => break,
            other => panic!("owner: unknown command {other:?}"),
        }
    }
}

/// One round on the owner's side; returns the answer to `verify`.
#[allow(clippy::too_many_arguments)]
fn owner_round(
    me: &Owner,
    barrier: Barrier,
    write: bool,
    round: u64,
    watch: usize,
    delay_us: u64,
    old: &[u8],
    new: &[u8],
    lines: &mut impl Iterator<Item = std::io::Result<String>>,
) -> String {
    let context = &me.context;
    let target = &me.target;
    target.write_at(0, old);
    target.write_at(FLAG_OFFSET, &0u64.to_le_bytes());
    let mut region = Some(context.register_buffer(target).expect("owner: register"));
    // SAFETY: the window exposes the test's own buffer, which lives as long
    // as the owner; some barriers unregister it under the bound window on
    // purpose, which is what the window checks must withstand.
    let window: MemoryWindow = unsafe {
        context.bind_window_raw(
            target.iova(),
            WINDOW as u64,
            Access::REMOTE_READ | Access::REMOTE_WRITE,
            None,
        )
    }
    .expect("owner: bind");
    if matches!(barrier, Barrier::Invalidate | Barrier::Evict) {
        // Idle in the cache, still mapped for the device.
        region = None;
    }
    say(format!("window {}", window.remote()));

    // Wait until the first transfer is under way.
    if write {
        let mut byte = [0u8];
        spin_until("the peer's first write", || {
            target.read_at(watch, &mut byte);
            byte[0] != old[watch]
        });
    } else {
        spin_until("the peer's flag", || me.flag() == round + 1);
        let until = Instant::now() + Duration::from_micros(delay_us);
        spin_until("the delay", || Instant::now() >= until);
    }

    // The barrier.
    let transport = context.transport();
    let layout = transport.ring_layout();
    let mut held = Vec::new();
    let mut window = Some(window);
    match barrier {
        Barrier::Revoke => {
            let window = window.take().unwrap();
            window.revoke().expect("owner: revoke");
        }
        Barrier::Unregister => {
            assert_eq!(
                context.invalidate(target.iova(), WINDOW as u64),
                1,
                "one cache entry covers the buffer"
            );
            drop(region.take());
            assert_eq!(context.registration_stats().pinned_entries, 0);
        }
        Barrier::Invalidate => {
            assert_eq!(context.invalidate(target.iova(), WINDOW as u64), 1);
            assert_eq!(context.registration_stats().pinned_entries, 0);
        }
        Barrier::Unpin => transport
            .iotlb_unmap(target.iova(), WINDOW as u64)
            .expect("owner: INVALIDATE"),
        Barrier::Evict => {
            let evictions = context.registration_stats().evictions;
            for other in &me.others {
                held.push(context.register_buffer(other).expect("owner: register"));
            }
            let stats = context.registration_stats();
            // Both others are held, the cache has 2 entries and nothing
            // merges: the buffer is not pinned any more.
            assert_eq!(stats.pinned_entries, 2, "{stats:?}");
            assert!(stats.evictions > evictions, "{stats:?}");
        }
        Barrier::ResetOwner => transport.reset_owner().expect("owner: RESET_OWNER"),
        Barrier::RingDisable => {
            transport
                .enable_queue(layout.send_queue(ADMIN_QUEUE_PAIR), false)
                .expect("owner: disable the send queue");
            transport
                .enable_queue(layout.completion_queue(ADMIN_QUEUE_PAIR), false)
                .expect("owner: disable the completion queue");
        }
        Barrier::SetFeatures => {
            transport
                .negotiate_features(DEFAULT_FEATURES)
                .expect("owner: SET_FEATURES");
        }
    }
    // The barrier has returned: the marker goes over the whole buffer.
    target.write_at(0, new);
    match barrier {
        Barrier::RingDisable => {
            transport
                .negotiate_features(DEFAULT_FEATURES)
                .expect("owner: SET_FEATURES");
            me.invalidate_arena();
        }
        Barrier::SetFeatures => me.invalidate_arena(),
        _ => {}
    }
    say("done");

    match lines.next() {
        Some(Ok(line)) if line.trim() == "verify" => {}
        other => panic!("owner: expected verify, got {other:?}"),
    }
    let mut landed = vec![0u8; BUFFER];
    target.read_at(0, &mut landed);
    let verdict = match difference(&landed, new) {
        None => "intact".to_owned(),
        Some((at, count, class)) => {
            format!("bad: {count} marker bytes overwritten, first at {at} by a {class:?} byte")
        }
    };
    // Clean up for the next round on the same port.
    if barrier.resets_port() {
        // The port's windows went with it: nothing to revoke.
        std::mem::forget(window);
    } else {
        drop(held);
        drop(region);
        if let Some(window) = window {
            window.revoke().expect("owner: revoke");
        }
        // The next round maps the buffer again (after Unpin the cache still
        // believes it is mapped).
        context.invalidate(target.iova(), WINDOW as u64);
    }
    verdict
}

/// The peer's context: a source for writes, destinations for reads.
struct Peer {
    context: Context,
    source: DmaBuffer,
    sinks: Vec<DmaBuffer>,
    flag: DmaBuffer,
}

fn peer_rank(socket: &str) {
    let context = Context::open(
        socket,
        ContextConfig {
            arena_bytes: 72 << 20,
            cache: CacheConfig {
                merge: false,
                ..CacheConfig::default()
            },
            ..ContextConfig::default()
        },
    )
    .expect("peer: open");
    let me = Peer {
        source: context.alloc(BUFFER, 4096).unwrap(),
        sinks: (0..READS)
            .map(|_| context.alloc(BUFFER, 4096).unwrap())
            .collect(),
        flag: context.alloc(4096, 4096).unwrap(),
        context,
    };
    me.source.write_at(0, &pattern(Class::Peer, BUFFER));
    let source = me.context.register_buffer(&me.source).unwrap();
    let sinks: Vec<_> = me
        .sinks
        .iter()
        .map(|sink| me.context.register_buffer(sink).unwrap())
        .collect();
    let flag = me.context.register_buffer(&me.flag).unwrap();
    let mut cq = me.context.create_completion_queue();
    let mut qp = me.context.create_queue_pair(&mut cq).unwrap();
    let before = pattern(Class::Before, BUFFER);
    let old = pattern(Class::Old, BUFFER);
    say("ready");

    let mut posted: HashSet<u64> = HashSet::new();
    let mut reads: Vec<u64> = Vec::new();
    // Read destinations that no longer hold the `before` pattern.
    let mut dirty = vec![true; READS];
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["post", direction, window, round] => {
                let window: RemoteWindow = window.parse().unwrap();
                let round: u64 = round.parse().unwrap();
                let tag = |i: u64| (round << 8) | i;
                let entries: Vec<Entry> = if *direction == "write" {
                    reads.clear();
                    (0..WRITES)
                        .map(|i| {
                            Write::new(source.local(0, BUFFER as u32).unwrap(), window.at(0))
                                .build()
                                .user_data(tag(i))
                        })
                        .collect()
                } else {
                    for (sink, dirty) in me.sinks.iter().zip(&mut dirty) {
                        if std::mem::take(dirty) {
                            sink.write_at(0, &before);
                        }
                    }
                    me.flag.write_at(0, &(round + 1).to_le_bytes());
                    reads = (1..=READS as u64).map(tag).collect();
                    std::iter::once(
                        Write::new(flag.local(0, 8).unwrap(), window.at(FLAG_OFFSET as u64))
                            .build()
                            .user_data(tag(0)),
                    )
                    .chain(sinks.iter().zip(&reads).map(|(sink, &user_data)| {
                        Read::new(sink.local(0, BUFFER as u32).unwrap(), window.at(0))
                            .build()
                            .user_data(user_data)
                    }))
                    .collect()
                };
                let entries: Vec<Entry> = entries.into_iter().map(Entry::signaled).collect();
                posted = entries.iter().map(|e| e.request().user_data).collect();
                qp.post(&entries).expect("peer: post");
                say("posted");
            }
            ["drain"] => say(drain(
                &me,
                &mut cq,
                &mut posted,
                &reads,
                &mut dirty,
                &before,
                &old,
            )),
            ["exit"] => break,
            other => panic!("peer: unknown command {other:?}"),
        }
    }
    drop((qp, cq));
    drop((source, sinks, flag));
}

/// Waits for one completion per posted request and checks the reads'
/// destinations; returns `drained OK FAILED CUT` or what went wrong.
fn drain(
    me: &Peer,
    cq: &mut CompletionQueue<'_>,
    posted: &mut HashSet<u64>,
    reads: &[u64],
    dirty: &mut [bool],
    before: &[u8],
    old: &[u8],
) -> String {
    let expected = posted.len();
    let mut outcome = std::collections::HashMap::new();
    while outcome.len() < expected {
        let ready = match cq.wait(Duration::from_secs(30)) {
            Ok(ready) => ready,
            Err(e) => return format!("bad: {} of {expected} completions: {e}", outcome.len()),
        };
        for completion in ready {
            if !posted.remove(&completion.user_data) {
                return format!("bad: unexpected or repeated completion {completion:?}");
            }
            outcome.insert(completion.user_data, completion.status);
        }
    }
    let ok = outcome.values().filter(|s| **s == Status::Success).count();
    let failed = expected - ok;
    let mut cut = 0;
    let mut landed = vec![0u8; BUFFER];
    for ((sink, user_data), dirty) in me.sinks.iter().zip(reads).zip(dirty) {
        sink.read_at(0, &mut landed);
        *dirty = landed != before;
        if outcome[user_data] == Status::Success {
            if let Some((at, count, class)) = difference(&landed, old) {
                return format!(
                    "bad: read {user_data:#x} succeeded but {count} bytes are not the old ones, first at {at} ({class:?})"
                );
            }
        } else if *dirty {
            cut += 1;
            if let Some(at) = neither(&landed, old, before) {
                return format!(
                    "bad: failed read {user_data:#x} has a {:?} byte at {at}",
                    class_of(landed[at])
                );
            }
        }
    }
    format!("drained {ok} {failed} {cut}")
}

/// The owner of the disconnect tests: binds a window over its buffer (the
/// old pattern, the flag cleared), says where the buffer lies in its
/// arena's file, and waits to be killed.
fn victim_rank(socket: &str) {
    let me = Owner::open(socket, 64);
    me.target.write_at(0, &pattern(Class::Old, BUFFER));
    me.target.write_at(FLAG_OFFSET, &0u64.to_le_bytes());
    let region = me
        .context
        .register_buffer(&me.target)
        .expect("victim: register");
    let window = me
        .context
        .bind_window(
            &region,
            0,
            WINDOW as u64,
            Access::REMOTE_READ | Access::REMOTE_WRITE,
        )
        .expect("victim: bind");
    say(format!("window {} {}", window.remote(), me.target.offset()));
    // The parent kills this process: any line (or the end of input) before
    // that is the parent's mistake.
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
    panic!("victim: expected to be killed, got {line:?}");
}

/// The rank program, started by the other tests of this file.
#[test]
#[ignore = "the rank program: the other tests of this file start it with --ignored"]
fn rank_process() {
    let (role, socket) = common::rank::role();
    let words: Vec<&str> = role.split_whitespace().collect();
    match words.as_slice() {
        ["owner", barrier, direction] => {
            owner_rank(&socket, Barrier::parse(barrier), *direction == "write")
        }
        ["peer"] => peer_rank(&socket),
        ["victim"] => victim_rank(&socket),
        other => panic!("unknown role {other:?}"),
    }
}

// ---------------------------------------------------------------- parent

/// Ports of the device: the owner's port lies between the two peers', and
/// the rounds alternate between the peers, so each barrier kind meets
/// steps that take the two gates in either order (a step takes the gates
/// of its two ports in port order).
const PORTS: usize = 3;
/// The owner's port (its socket's own port: every owner connection waits
/// until the port is free, and the tests check that no other was made).
const OWNER_PORT: usize = 1;
/// The peers' ports, one for each gate order.
const PEER_PORTS: [usize; 2] = [0, 2];
/// The gate orders, as `PEER_PORTS` give them.
const ORDERS: [&str; 2] = [
    "peer's gate (port 0) before the owner's (port 1)",
    "owner's gate (port 1) before the peer's (port 2)",
];

/// Rounds of each test: `BARRIER_ROUNDS`, or 200 (100 with each gate
/// order).
fn rounds() -> u64 {
    match std::env::var("BARRIER_ROUNDS") {
        Ok(text) => text
            .parse()
            .ok()
            .filter(|&n| n >= 2)
            .expect("BARRIER_ROUNDS is a number of at least 2 (a round with each gate order)"),
        Err(_) => 200,
    }
}

/// Requests of one gate order, over all rounds.
#[derive(Clone, Copy, Debug, Default)]
struct Totals {
    ok: u64,
    failed: u64,
    cut: u64,
}

impl Totals {
    /// Adds the peer's answer to `drain` (`drained OK FAILED CUT`) of a
    /// round that posted `posted` requests.
    fn add(&mut self, drained: &str, posted: u64, what: &str) {
        let counts: Vec<u64> = drained
            .strip_prefix("drained ")
            .unwrap_or_else(|| panic!("{what}: {drained}"))
            .split_whitespace()
            .map(|n| n.parse().unwrap())
            .collect();
        assert_eq!(
            counts[0] + counts[1],
            posted,
            "{what}: success + error = posted"
        );
        self.ok += counts[0];
        self.failed += counts[1];
        self.cut += counts[2];
    }
}

/// Reports the totals and checks that the barrier did stop transfers in
/// flight in either gate order (otherwise the test proved nothing): every
/// round posts more than one 16 MiB transfer, and the barrier comes once
/// the first is under way.
fn check_cut(what: &str, rounds: u64, totals: &[Totals; 2]) {
    for (side, (order, t)) in ORDERS.iter().zip(totals).enumerate() {
        // Even rounds take the first order, odd rounds the second.
        let these = (rounds + 1 - side as u64) / 2;
        eprintln!(
            "{what}, {order}: {these} rounds, {} requests succeeded, {} failed, {} reads cut short",
            t.ok, t.failed, t.cut
        );
    }
    for (order, t) in ORDERS.iter().zip(totals) {
        assert!(
            t.failed > 0,
            "{what}, {order}: no transfer was ever stopped by the barrier"
        );
    }
}

/// Starts the two peers.
fn start_peers(device: &DeviceProcess) -> [Rank; 2] {
    PEER_PORTS.map(|port| {
        let mut peer = Rank::start("peer", &device.socket(port));
        assert_eq!(peer.next(), "ready");
        peer
    })
}

/// Waits until the owner's port is free (its connection ended and the
/// device reset it) and checks that it has had `connections` connections.
fn wait_owner_port_free(device: &DeviceProcess, connections: u64) {
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        let status = device.status().expect("device status");
        if status[OWNER_PORT].n("connected") == 0 {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "the owner's port was not reset: {:?}",
            status[OWNER_PORT]
        );
        std::thread::sleep(Duration::from_millis(1));
    };
    assert_eq!(
        status[OWNER_PORT].n("connections"),
        connections,
        "{:?}",
        status[OWNER_PORT]
    );
}

/// Checks that the device has only its own ports: every owner connection
/// was port `OWNER_PORT`, so the gate orders were the ones counted.
fn check_ports(device: &DeviceProcess) {
    let status = device.status().expect("device status");
    assert_eq!(status.len(), PORTS, "{status:?}");
}

/// Runs the rounds of one barrier kind, with writes or reads in flight.
fn race(barrier: Barrier, write: bool) {
    let device = DeviceProcess::start(common::device_bin(), PORTS, &[]).unwrap();
    let direction = if write { "write" } else { "read" };
    let mut peers = start_peers(&device);
    let mut owner = Rank::start(
        &format!("owner {} {direction}", barrier.name()),
        &device.socket(OWNER_PORT),
    );
    let mut rng = Rng(0x2545_F491_4F6C_DD1D ^ ((barrier as u64 + 1) << 32) ^ u64::from(write));
    let mut totals = [Totals::default(); 2];
    let rounds = rounds();
    for round in 0..rounds {
        let side = (round % 2) as usize;
        let peer = &mut peers[side];
        let what = format!(
            "{barrier:?} with {direction}s in flight, {}, round {round}",
            ORDERS[side]
        );
        let watch = rng.below(BUFFER as u64);
        let delay = rng.below(MAX_READ_DELAY_US);
        owner.send(&format!("round {round} {watch} {delay}"));
        let window = owner.next();
        let window = window
            .strip_prefix("window ")
            .unwrap_or_else(|| panic!("{what}: owner said {window}"));
        let posted = peer.ask(&format!("post {direction} {window} {round}"));
        assert_eq!(posted, "posted", "{what}");
        assert_eq!(owner.next(), "done", "{what}");
        let posted = if write { WRITES } else { READS as u64 + 1 };
        totals[side].add(&peer.ask("drain"), posted, &what);
        let verdict = owner.ask("verify");
        assert_eq!(
            verdict, "intact",
            "{what}: the peer's bytes landed after the barrier returned"
        );
        if barrier.resets_port() {
            // The owner connects again next round: to the same port.
            wait_owner_port_free(&device, round + 1);
        }
    }
    check_ports(&device);
    check_cut(&format!("{barrier:?}, {direction}s"), rounds, &totals);
    owner.finish();
    for peer in peers {
        peer.finish();
    }
}

/// The one memfd of process `pid` (the driver's DMA arena), opened through
/// `/proc` so that it outlives the process.
fn open_memfd(pid: u32) -> std::fs::File {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).expect("the owner's fds");
    let memfds: Vec<PathBuf> = fds
        .filter_map(|entry| {
            let path = entry.ok()?.path();
            let link = std::fs::read_link(&path).ok()?;
            link.to_string_lossy()
                .starts_with("/memfd:")
                .then_some(path)
        })
        .collect();
    assert_eq!(memfds.len(), 1, "the owner has one memfd: {memfds:?}");
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&memfds[0])
        .expect("open the owner's memfd")
}

/// Runs the rounds of the disconnect barrier: the owner is killed while
/// the peer's writes or reads are in flight into its window; once the
/// device shows its port reset, the parent writes the marker through its
/// own mapping of the owner's memory.
fn disconnect_race(write: bool) {
    let device = DeviceProcess::start(common::device_bin(), PORTS, &[]).unwrap();
    let direction = if write { "write" } else { "read" };
    let mut peers = start_peers(&device);
    let old = pattern(Class::Old, BUFFER);
    let new = pattern(Class::New, BUFFER);
    let mut landed = vec![0u8; BUFFER];
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ u64::from(write));
    let mut totals = [Totals::default(); 2];
    let rounds = rounds();
    for round in 0..rounds {
        let side = (round % 2) as usize;
        let peer = &mut peers[side];
        let what = format!(
            "an owner killed with {direction}s in flight, {}, round {round}",
            ORDERS[side]
        );
        let mut owner = Rank::start("victim", &device.socket(OWNER_PORT));
        let said = owner.next();
        let (window, offset) = said
            .strip_prefix("window ")
            .and_then(|rest| rest.split_once(' '))
            .unwrap_or_else(|| panic!("{what}: owner said {said}"));
        let offset: usize = offset.parse().unwrap();
        let file = open_memfd(owner.child.id());
        let size = file.metadata().unwrap().len() as usize;
        let map = MmapRegion::<()>::from_file(FileOffset::new(file, 0), size)
            .expect("map the owner's memfd");
        let buffer = map.get_slice(offset, BUFFER).expect("the owner's buffer");
        let flag = map
            .get_slice(offset + FLAG_OFFSET, 8)
            .expect("the owner's flag");
        // The right memory: the owner's bytes.
        buffer.copy_to(&mut landed[..]);
        assert!(
            landed == old,
            "{what}: the memfd does not hold the owner's buffer"
        );

        let posted = peer.ask(&format!("post {direction} {window} {round}"));
        assert_eq!(posted, "posted", "{what}");
        if write {
            let watch = rng.below(BUFFER as u64) as usize;
            spin_until("the peer's first write", || {
                buffer.read_obj::<u8>(watch).unwrap() != old[watch]
            });
        } else {
            spin_until("the peer's flag", || {
                u64::from_le(flag.read_obj::<u64>(0).unwrap()) == round + 1
            });
            let until = Instant::now() + Duration::from_micros(rng.below(MAX_READ_DELAY_US));
            spin_until("the delay", || Instant::now() >= until);
        }
        // SIGKILL; the device sees the connection end, resets the port
        // (the barrier) and then shows it disconnected.
        owner.child.kill().expect("kill the owner");
        owner.child.wait().expect("reap the owner");
        wait_owner_port_free(&device, round + 1);
        buffer.write_slice(&new, 0).unwrap();

        let posted = if write { WRITES } else { READS as u64 + 1 };
        totals[side].add(&peer.ask("drain"), posted, &what);
        buffer.copy_to(&mut landed[..]);
        if let Some((at, count, class)) = difference(&landed, &new) {
            panic!(
                "{what}: {count} marker bytes overwritten after the port was reset, first at {at} by a {class:?} byte"
            );
        }
    }
    check_ports(&device);
    check_cut(&format!("Disconnect, {direction}s"), rounds, &totals);
    for peer in peers {
        peer.finish();
    }
}

#[test]
fn no_write_lands_after_revoke_window_returns() {
    race(Barrier::Revoke, true);
}

#[test]
fn no_write_lands_after_unregister_returns() {
    race(Barrier::Unregister, true);
}

#[test]
fn no_write_lands_after_cache_invalidation_returns() {
    race(Barrier::Invalidate, true);
}

#[test]
fn no_write_lands_after_the_unpin_invalidate_is_acknowledged() {
    race(Barrier::Unpin, true);
}

#[test]
fn no_write_lands_after_a_two_entry_cache_evicts_the_region() {
    race(Barrier::Evict, true);
}

#[test]
fn no_write_lands_after_reset_owner_is_acknowledged() {
    race(Barrier::ResetOwner, true);
}

#[test]
fn no_write_lands_after_the_rdma_rings_are_disabled() {
    race(Barrier::RingDisable, true);
}

#[test]
fn no_write_lands_after_set_features_is_acknowledged() {
    race(Barrier::SetFeatures, true);
}

#[test]
fn no_byte_is_read_after_revoke_window_returns() {
    race(Barrier::Revoke, false);
}

#[test]
fn no_byte_is_read_after_cache_invalidation_returns() {
    race(Barrier::Invalidate, false);
}

#[test]
fn no_byte_is_read_after_a_two_entry_cache_evicts_the_region() {
    race(Barrier::Evict, false);
}

#[test]
fn no_byte_is_read_after_reset_owner_is_acknowledged() {
    race(Barrier::ResetOwner, false);
}

#[test]
fn no_byte_is_read_after_unregister_returns() {
    race(Barrier::Unregister, false);
}

#[test]
fn no_byte_is_read_after_the_unpin_invalidate_is_acknowledged() {
    race(Barrier::Unpin, false);
}

#[test]
fn no_byte_is_read_after_the_rdma_rings_are_disabled() {
    race(Barrier::RingDisable, false);
}

#[test]
fn no_byte_is_read_after_set_features_is_acknowledged() {
    race(Barrier::SetFeatures, false);
}

#[test]
fn no_write_lands_after_a_killed_owners_port_is_reset() {
    disconnect_race(true);
}

#[test]
fn no_byte_is_read_after_a_killed_owners_port_is_reset() {
    disconnect_race(false);
}
