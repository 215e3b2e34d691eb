//! Two device processes joined by the fabric over real UDP: writes, reads
//! and atomics from a port of one node into windows of a port of the
//! other, every byte checked, with and without injected loss,
//! duplication and reordering; refusals across nodes; a peer that dies
//! and comes back.

mod common;

use std::time::{Duration, Instant};

use common::{
    buffer_contents as contents, fabric_context_config as config, salted_bytes as pattern,
    DeviceProcess,
};
use pindown_driver::arena::DmaBuffer;
use pindown_driver::verbs::opcode::{
    AtomicTo, CompareSwap, Entry, FetchAdd, FetchBitwise, Read, RemoteCopy, Vector, Write,
};
use pindown_driver::verbs::{CompletionQueue, Context};
use pindown_uapi::pattern::{Block, BlockList, Pattern, Piece};
use pindown_uapi::{
    Access, Arrival, AtomicOp, Bitwise, Completion, ErrorDetail, RemoteAddress, RemoteKey, Status,
};

const TOKEN: &str = "5eed0f1ab";

fn free_port() -> u16 {
    common::free_udp_port()
}

/// Starts node `node` of a fabric on loopback whose node `i` listens on
/// UDP port `ports[i]`.
fn node(node: u16, ports: &[u16], extra: &[&str]) -> DeviceProcess {
    common::fabric_device(node, ports, TOKEN, 1, extra)
}

/// Posts `entries` (signaled) on a fresh queue pair and waits for one
/// completion each.
fn run_all(context: &Context, entries: &[Entry<'_>]) -> Vec<Completion> {
    let mut cq: CompletionQueue<'_> = context.create_completion_queue();
    let mut qp = context.create_queue_pair(&mut cq).unwrap();
    let mut done = Vec::new();
    for chunk in entries.chunks(32) {
        let signaled: Vec<Entry<'_>> = chunk.iter().map(|e| e.signaled()).collect();
        qp.post(&signaled).unwrap();
        let want = done.len() + chunk.len();
        while done.len() < want {
            done.extend(cq.wait(Duration::from_secs(30)).unwrap());
        }
    }
    done
}

fn run(context: &Context, entry: Entry<'_>) -> Completion {
    run_all(context, &[entry]).remove(0)
}

/// Writes and reads of sizes from 1 byte to 4 MiB at unaligned offsets,
/// and atomics, from node 0 into a window of node 1; every byte checked,
/// and the bytes around each range unchanged.
fn moves_bytes_between_nodes(extra: &[&str]) {
    let ports = [free_port(), free_port()];
    let zero = node(0, &ports, extra);
    let one = node(1, &ports, extra);
    let initiator = Context::open(zero.socket(0), config()).unwrap();
    let target = Context::open(one.socket(0), config()).unwrap();
    assert_eq!((initiator.info().node, target.info().node), (0, 1));

    const SPAN: usize = 5 << 20;
    let near = initiator.alloc(SPAN, 64).unwrap();
    let far = target.alloc(SPAN, 64).unwrap();
    let near_region = initiator.register_buffer(&near).unwrap();
    let far_region = target.register_buffer(&far).unwrap();
    let window = target
        .bind_window(
            &far_region,
            0,
            SPAN as u64,
            Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC,
        )
        .unwrap();
    let remote = window.remote();
    assert_eq!(remote.node, 1);

    for (round, &(len, near_at, far_at)) in [
        (1usize, 3usize, 5usize),
        (7, 4095, 4093),
        (1400, 1, 2),
        (1401, 100, 9),
        (64 << 10, 17, 4096 + 3),
        (1 << 20, 4096, 1),
        (4 << 20, 33, 65),
    ]
    .iter()
    .enumerate()
    {
        let source = pattern(SPAN, round as u8);
        let before = pattern(SPAN, 0xa5 ^ round as u8);
        near.write_at(0, &source);
        far.write_at(0, &before);
        let local = near_region.local(near_at as u64, len as u32).unwrap();
        let done = run(
            &initiator,
            Write::new(local, remote.at(far_at as u64))
                .build()
                .user_data(round as u64),
        );
        assert_eq!(
            (done.status, done.detail, done.byte_len, done.user_data),
            (Status::Success, ErrorDetail::None, len as u32, round as u64),
            "write of {len} bytes: {done:?}"
        );
        let mut expected = before.clone();
        expected[far_at..far_at + len].copy_from_slice(&source[near_at..near_at + len]);
        assert!(
            contents(&far) == expected,
            "write of {len} bytes: remote memory differs"
        );

        // Read it back into other bytes of the initiator.
        let back_at = SPAN - len - 7;
        near.write_at(0, &before);
        let local = near_region.local(back_at as u64, len as u32).unwrap();
        let done = run(
            &initiator,
            Read::new(local, remote.at(far_at as u64)).build(),
        );
        assert_eq!(
            (done.status, done.byte_len),
            (Status::Success, len as u32),
            "read of {len} bytes: {done:?}"
        );
        let mut expected_near = before.clone();
        expected_near[back_at..back_at + len].copy_from_slice(&source[near_at..near_at + len]);
        assert!(
            contents(&near) == expected_near,
            "read of {len} bytes: local memory differs"
        );
    }

    // Atomics on a word of node 1, seen by its owner's CPU.
    far.write_at(64, &40u64.to_le_bytes());
    let adds: Vec<Entry<'_>> = (1..=100)
        .map(|i| FetchAdd::new(remote.at(64), i).build().user_data(i))
        .collect();
    let done = run_all(&initiator, &adds);
    let mut olds: Vec<u64> = done
        .iter()
        .map(|c| {
            assert!(c.is_success(), "{c:?}");
            c.value
        })
        .collect();
    olds.sort_unstable();
    // Each add ran once: the old values are the 100 partial sums.
    let mut expected_olds = Vec::new();
    let mut total = 40u64;
    for i in 1..=100u64 {
        expected_olds.push(total);
        total += i;
    }
    let mut sorted = expected_olds.clone();
    sorted.sort_unstable();
    assert_ne!(olds, vec![40; 100]);
    let mut word = [0u8; 8];
    far.read_at(64, &mut word);
    assert_eq!(u64::from_le_bytes(word), 40 + 5050);
    assert_eq!(olds.len(), 100);
    assert!(olds.iter().all(|&old| (40..40 + 5050).contains(&old)));
    let unique: std::collections::BTreeSet<u64> = olds.iter().copied().collect();
    assert_eq!(unique.len(), 100, "every add saw its own old value");
    let swapped = run(
        &initiator,
        CompareSwap::new(remote.at(64), 40 + 5050, 7).build(),
    );
    assert_eq!((swapped.status, swapped.value), (Status::Success, 5090));
    far.read_at(64, &mut word);
    assert_eq!(u64::from_le_bytes(word), 7);
}

#[test]
fn writes_reads_and_atomics_cross_two_nodes() {
    moves_bytes_between_nodes(&[]);
}

#[test]
fn writes_reads_and_atomics_cross_two_nodes_under_loss_duplication_and_reordering() {
    moves_bytes_between_nodes(&[
        "--fault-in",
        "loss=0.05,dup=0.02,reorder=0.05,seed=11",
        "--fault-out",
        "loss=0.05,dup=0.02,reorder=0.05,seed=12",
    ]);
}

#[test]
fn refusals_across_nodes_touch_nothing_and_unknown_nodes_are_named() {
    let ports = [free_port(), free_port()];
    let zero = node(0, &ports, &[]);
    let one = node(1, &ports, &[]);
    let initiator = Context::open(zero.socket(0), config()).unwrap();
    let target = Context::open(one.socket(0), config()).unwrap();
    let near = initiator.alloc(1 << 16, 64).unwrap();
    let far = target.alloc(1 << 16, 64).unwrap();
    near.write_at(0, &pattern(1 << 16, 1));
    let before = pattern(1 << 16, 2);
    far.write_at(0, &before);
    let near_region = initiator.register_buffer(&near).unwrap();
    let far_region = target.register_buffer(&far).unwrap();
    let read_only_window = target
        .bind_window(&far_region, 0, 1 << 16, Access::REMOTE_READ)
        .unwrap();
    let read_only = read_only_window.remote();
    let local = near_region.local(0, 5000).unwrap();
    let forged = RemoteAddress {
        key: RemoteKey(read_only.key.0 ^ 0x55),
        ..read_only.at(0)
    };
    for (what, remote) in [
        ("no write right", read_only.at(0)),
        ("forged key", forged),
        ("past the window", read_only.at((1 << 16) - 100)),
    ] {
        let done = run(&initiator, Write::new(local, remote).build());
        assert_eq!(
            (done.status, done.detail),
            (Status::RemoteAccessError, ErrorDetail::NotGranted),
            "{what}: {done:?}"
        );
    }
    assert!(contents(&far) == before, "a refused write changed memory");
    let nowhere = RemoteAddress {
        node: 9,
        ..read_only.at(0)
    };
    let done = run(&initiator, Write::new(local, nowhere).build());
    assert_eq!(
        (done.status, done.detail),
        (Status::InvalidRequest, ErrorDetail::UnknownNode)
    );
    // Both still serve.
    let done = run(&initiator, Read::new(local, read_only.at(8)).build());
    assert!(done.is_success(), "{done:?}");
    let mut got = vec![0u8; 5000];
    near.read_at(0, &mut got);
    assert_eq!(got, before[8..5008]);
}

#[test]
fn a_dead_peer_fails_requests_within_the_timeout_and_a_restarted_one_serves_again() {
    let ports = [free_port(), free_port()];
    let timeout = ["--peer-timeout", "400ms"];
    let zero = node(0, &ports, &timeout);
    let one = node(1, &ports, &timeout);
    let initiator = Context::open(zero.socket(0), config()).unwrap();
    let near = initiator.alloc(1 << 16, 64).unwrap();
    near.write_at(0, &pattern(1 << 16, 3));
    let near_region = initiator.register_buffer(&near).unwrap();
    let local = near_region.local(0, 1 << 16).unwrap();
    let window = {
        let target = Context::open(one.socket(0), config()).unwrap();
        let far = target.alloc(1 << 16, 64).unwrap();
        let region = target.register_buffer(&far).unwrap();
        let window = target
            .bind_window(&region, 0, 1 << 16, Access::REMOTE_WRITE)
            .unwrap();
        let remote = window.remote();
        let done = run(&initiator, Write::new(local, remote.at(0)).build());
        assert!(done.is_success(), "{done:?}");
        std::mem::forget(window);
        std::mem::forget(region);
        std::mem::forget(far);
        std::mem::forget(target);
        remote
    };
    drop(one);
    let started = Instant::now();
    let done = run(&initiator, Write::new(local, window.at(0)).build());
    let took = started.elapsed();
    assert_eq!(
        (done.status, done.detail),
        (Status::PeerGone, ErrorDetail::NodeUnreachable),
        "{done:?}"
    );
    assert!(took < Duration::from_secs(20), "failed only after {took:?}");

    // A new device process for node 1 at the same address.
    let one = node(1, &ports, &timeout);
    let target = Context::open(one.socket(0), config()).unwrap();
    let far = target.alloc(1 << 16, 64).unwrap();
    let region = target.register_buffer(&far).unwrap();
    let fresh_window = target
        .bind_window(&region, 0, 1 << 16, Access::REMOTE_WRITE)
        .unwrap();
    let fresh = fresh_window.remote();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let done = run(&initiator, Write::new(local, fresh.at(0)).build());
        if done.is_success() {
            break;
        }
        assert_eq!(done.detail, ErrorDetail::NodeUnreachable, "{done:?}");
        assert!(Instant::now() < deadline, "node 1 never served again");
    }
    assert!(contents(&far) == pattern(1 << 16, 3));
    // The old window's key died with the old device.
    let done = run(&initiator, Write::new(local, window.at(0)).build());
    assert_eq!(done.status, Status::RemoteAccessError, "{done:?}");
}

/// Copies started by a port of node 0 between windows of nodes 1 and 2
/// (and from its own node, and within one other node), and bitwise
/// atomics on a word of node 2: every byte checked, rights checked on
/// both windows, under loss.
#[test]
fn third_party_copies_and_bitwise_atomics_across_three_nodes() {
    let ports = [free_port(), free_port(), free_port()];
    let lossy = [
        "--fault-in",
        "loss=0.03,dup=0.01,reorder=0.03,seed=5",
        "--fault-out",
        "loss=0.03,reorder=0.03,seed=6",
    ];
    let devices: Vec<DeviceProcess> = (0..3).map(|n| node(n, &ports, &lossy)).collect();
    let contexts: Vec<Context> = devices
        .iter()
        .map(|d| Context::open(d.socket(0), config()).unwrap())
        .collect();
    const SPAN: usize = 1 << 20;
    let buffers: Vec<DmaBuffer> = contexts
        .iter()
        .map(|c| c.alloc(SPAN, 64).unwrap())
        .collect();
    let originals: Vec<Vec<u8>> = (0..3).map(|n| pattern(SPAN, 0x30 + n as u8)).collect();
    for (buffer, bytes) in buffers.iter().zip(&originals) {
        buffer.write_at(0, bytes);
    }
    let regions: Vec<_> = contexts
        .iter()
        .zip(&buffers)
        .map(|(c, b)| c.register_buffer(b).unwrap())
        .collect();
    let all = Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC;
    let windows: Vec<_> = contexts
        .iter()
        .zip(&regions)
        .map(|(c, r)| c.bind_window(r, 0, SPAN as u64, all).unwrap())
        .collect();
    let read_only = contexts[1]
        .bind_window(&regions[1], 0, SPAN as u64, Access::REMOTE_READ)
        .unwrap();
    let remote = |n: usize, offset: u64| windows[n].remote().at(offset);
    let mut expected = originals.clone();
    // (source node, source offset, destination node, destination offset, len)
    let copies = [
        (1usize, 3usize, 2usize, 100usize, 200_000usize),
        (0, 7, 1, 4096, 70_001),
        (1, 500_000, 1, 10, 1400),
        (2, 0, 0, 900_000, 9),
    ];
    for &(from, from_at, to, to_at, len) in &copies {
        let done = run(
            &contexts[0],
            RemoteCopy::new(
                remote(from, from_at as u64),
                remote(to, to_at as u64),
                len as u32,
            )
            .build(),
        );
        assert_eq!(
            (done.status, done.detail, done.byte_len),
            (Status::Success, ErrorDetail::None, len as u32),
            "copy {from}->{to} of {len}: {done:?}"
        );
        let moved = expected[from][from_at..from_at + len].to_vec();
        expected[to][to_at..to_at + len].copy_from_slice(&moved);
        for n in 0..3 {
            assert!(
                contents(&buffers[n]) == expected[n],
                "after copy {from}->{to} of {len}: node {n}'s memory differs"
            );
        }
    }
    // The destination must grant the initiator the write right.
    let done = run(
        &contexts[0],
        RemoteCopy::new(remote(2, 0), read_only.remote().at(0), 4096).build(),
    );
    assert_eq!(
        (done.status, done.detail),
        (Status::RemoteAccessError, ErrorDetail::NotGranted),
        "{done:?}"
    );
    assert!(contents(&buffers[1]) == expected[1], "a refused copy wrote");

    // Bitwise atomics on a word of node 2 from node 0, against a model.
    let word_at = 64usize;
    let mut model = u64::from_le_bytes(expected[2][word_at..word_at + 8].try_into().unwrap());
    for (i, mask) in [0xFF00_FF00_FF00_FF00u64, 0x1234, 0x8000_0000_0000_0001]
        .into_iter()
        .enumerate()
    {
        let (entry, next) = match i {
            0 => (
                FetchBitwise::and(remote(2, word_at as u64), mask),
                model & mask,
            ),
            1 => (
                FetchBitwise::or(remote(2, word_at as u64), mask),
                model | mask,
            ),
            _ => (
                FetchBitwise::xor(remote(2, word_at as u64), mask),
                model ^ mask,
            ),
        };
        let done = run(&contexts[0], entry.build());
        assert_eq!(
            (done.status, done.value),
            (Status::Success, model),
            "{done:?}"
        );
        model = next;
    }
    let mut word = [0u8; 8];
    buffers[2].read_at(word_at, &mut word);
    assert_eq!(u64::from_le_bytes(word), model);
}

/// The stream of a plan: for each byte of the transfer, its offset from
/// the base (from uapi's walk, itself checked against a loop model in
/// uapi's tests).
fn stream(pattern: &Pattern) -> Vec<usize> {
    let plan = pattern.plan().unwrap();
    plan.segments(0, plan.len())
        .flat_map(|block| (0..block.len).map(move |i| (block.offset as u64 + i) as usize))
        .collect()
}

/// Vector writes and reads from node 0 into a window of node 1: a column
/// of a matrix into contiguous rows and back, and a listed pattern, with
/// parts carrying their own remote patterns; every byte checked, bytes
/// outside the patterns unchanged; under loss.
#[test]
fn vector_writes_and_reads_cross_nodes_in_self_describing_parts() {
    let ports = [free_port(), free_port()];
    let lossy = [
        "--fault-in",
        "loss=0.04,dup=0.02,reorder=0.04,seed=21",
        "--fault-out",
        "loss=0.04,reorder=0.04,seed=22",
    ];
    let zero = node(0, &ports, &lossy);
    let one = node(1, &ports, &lossy);
    let initiator = Context::open(zero.socket(0), config()).unwrap();
    let target = Context::open(one.socket(0), config()).unwrap();
    const SPAN: usize = 1 << 20;
    let near = initiator.alloc(SPAN, 64).unwrap();
    let far = target.alloc(SPAN, 64).unwrap();
    let near_region = initiator.register_buffer(&near).unwrap();
    let far_region = target.register_buffer(&far).unwrap();
    let window = target
        .bind_window(
            &far_region,
            0,
            SPAN as u64,
            Access::REMOTE_READ | Access::REMOTE_WRITE,
        )
        .unwrap();
    // A 512 x 1 column of doubles of a 512 x 256 matrix (row of 2 KiB)
    // against contiguous bytes; then 1000 listed blocks of 3 bytes, in a
    // shuffled order, none overlapping another (parts land in any order:
    // overlapping blocks would leave either part's bytes).
    let column = Pattern::new(vec![Piece::vector(8, 8, 512, 2048)], 1, 0).unwrap();
    let rows = Pattern::contiguous(512 * 8);
    let blocks: Vec<Block> = (0..1000)
        .map(|i| Block {
            offset: (i * 37 % 1009) * 7,
            len: 3,
        })
        .collect();
    let listed = Pattern::new(
        vec![Piece::Indexed {
            offset: 0,
            blocks: BlockList::Listed(blocks),
        }],
        1,
        0,
    )
    .unwrap();
    let cases = [
        (column.clone(), 100u64, rows.clone(), 4096u64),
        (rows, 64, column, 0),
        (Pattern::contiguous(3000), 8, listed, 20_000),
    ];
    for (round, (local_pattern, local_base, remote_pattern, remote_base)) in
        cases.into_iter().enumerate()
    {
        let near_before = pattern(SPAN, 0x40 + round as u8);
        let far_before = pattern(SPAN, 0x80 + round as u8);
        near.write_at(0, &near_before);
        far.write_at(0, &far_before);
        let local = near_region
            .local(local_base, (SPAN as u64 - local_base) as u32)
            .unwrap();
        let write = Vector::write(
            local,
            local_pattern.clone(),
            window.remote().at(remote_base),
            remote_pattern.clone(),
        )
        .unwrap();
        let done = run(&initiator, write.build());
        assert_eq!(
            (done.status, done.detail, done.byte_len),
            (Status::Success, ErrorDetail::None, write.len()),
            "vector write {round}: {done:?}"
        );
        let (from, to) = (stream(&local_pattern), stream(&remote_pattern));
        assert_eq!(from.len(), to.len());
        let mut expected = far_before.clone();
        for (f, t) in from.iter().zip(&to) {
            expected[remote_base as usize + t] = near_before[local_base as usize + f];
        }
        assert!(
            contents(&far) == expected,
            "vector write {round}: remote memory differs"
        );

        // Read the same remote bytes back through the same patterns into
        // fresh local bytes.
        let fresh = pattern(SPAN, 0xc0 + round as u8);
        near.write_at(0, &fresh);
        let read = Vector::read(
            local,
            local_pattern,
            window.remote().at(remote_base),
            remote_pattern,
        )
        .unwrap();
        let done = run(&initiator, read.build());
        assert_eq!(
            (done.status, done.byte_len),
            (Status::Success, read.len()),
            "vector read {round}: {done:?}"
        );
        let mut expected_near = fresh.clone();
        for (f, t) in from.iter().zip(&to) {
            expected_near[local_base as usize + f] = expected[remote_base as usize + t];
        }
        assert!(
            contents(&near) == expected_near,
            "vector read {round}: local memory differs"
        );
    }
    // A pattern reaching past the window is refused, and nothing lands.
    let before = contents(&far);
    let past = Pattern::new(vec![Piece::vector(0, 8, 16, 1 << 17)], 1, 0).unwrap();
    let local = near_region.local(0, 128).unwrap();
    let write =
        Vector::write(local, Pattern::contiguous(128), window.remote().at(0), past).unwrap();
    let done = run(&initiator, write.build());
    assert_eq!(done.status, Status::RemoteAccessError, "{done:?}");
    let after = contents(&far);
    // Parts before the refused one may have landed (each part is checked
    // on its own); nothing outside the pattern changed.
    let allowed: std::collections::BTreeSet<usize> =
        (0..16).flat_map(|i| (i << 17)..(i << 17) + 8).collect();
    for (i, (b, a)) in before.iter().zip(&after).enumerate() {
        assert!(
            b == a || allowed.contains(&i),
            "byte {i} outside the pattern changed"
        );
    }
}

/// A vector write into a window of another node that asks for a target
/// notice (NOTIFY_TARGET): the target's context finds one arrival naming
/// the writer's node and port, the window, the bytes and the immediate,
/// with every byte in place when it is seen, for a write of one part and
/// one of many parts, under loss; refused writes queue nothing; a port
/// that holds as many arrivals as the device allows refuses the next
/// notifying write, and none that succeeded lost its arrival.
#[test]
fn a_notifying_vector_write_tells_the_target_on_another_node() {
    let ports = [free_port(), free_port()];
    let lossy = [
        "--fault-in",
        "loss=0.03,dup=0.02,reorder=0.03,seed=31",
        "--fault-out",
        "loss=0.03,reorder=0.03,seed=32",
    ];
    let zero = node(0, &ports, &lossy);
    let one = node(1, &ports, &lossy);
    let initiator = Context::open(zero.socket(0), config()).unwrap();
    let target = Context::open(one.socket(0), config()).unwrap();
    const SPAN: usize = 1 << 20;
    let near = initiator.alloc(SPAN, 64).unwrap();
    let far = target.alloc(SPAN, 64).unwrap();
    let near_region = initiator.register_buffer(&near).unwrap();
    let far_region = target.register_buffer(&far).unwrap();
    let window = target
        .bind_window(&far_region, 0, SPAN as u64, Access::REMOTE_WRITE)
        .unwrap();
    let writer = initiator.info().address();
    assert_eq!(writer.node, 0);
    let mut cq: CompletionQueue<'_> = initiator.create_completion_queue();
    let mut qp = initiator.create_queue_pair(&mut cq).unwrap();
    // 64 bytes in one part; 4096 blocks of 64 bytes 128 apart (256 KiB,
    // a few hundred parts).
    let cases = [
        (
            Pattern::new(vec![Piece::vector(8, 16, 4, 40)], 1, 0).unwrap(),
            0xa1u64,
        ),
        (
            Pattern::new(vec![Piece::vector(0, 64, 4096, 128)], 1, 0).unwrap(),
            0xa2,
        ),
    ];
    for (round, (remote_pattern, immediate)) in cases.into_iter().enumerate() {
        let len = remote_pattern.plan().unwrap().len() as usize;
        let source = pattern(len, 0x10 + round as u8);
        near.write_at(0, &source);
        let far_before = pattern(SPAN, 0x90 + round as u8);
        far.write_at(0, &far_before);
        let write = Vector::write(
            near_region.local(0, len as u32).unwrap(),
            Pattern::contiguous(len as u64),
            window.remote().at(4096),
            remote_pattern.clone(),
        )
        .unwrap()
        .notify(immediate);
        qp.post(&[write.build().signaled().user_data(round as u64)])
            .unwrap();
        // The arrival first: the bytes are in place when it is seen.
        let arrivals = target.wait_arrivals(Duration::from_secs(30)).unwrap();
        let landed = contents(&far);
        assert_eq!(
            arrivals,
            vec![Arrival {
                peer: writer,
                key: window.remote().key,
                bytes: len as u32,
                immediate,
            }],
            "round {round}"
        );
        let mut expected = far_before;
        for (i, at) in stream(&remote_pattern).into_iter().enumerate() {
            expected[4096 + at] = source[i];
        }
        assert!(landed == expected, "round {round}: remote memory differs");
        let done: Vec<Completion> = cq.wait(Duration::from_secs(30)).unwrap().collect();
        assert_eq!(done.len(), 1);
        assert_eq!(
            (done[0].status, done[0].user_data, done[0].byte_len),
            (Status::Success, round as u64, len as u32),
            "{done:?}"
        );
        assert!(target.arrivals().unwrap().is_empty(), "one arrival a write");
    }

    // A write of no bytes names a window too.
    let read_only = target
        .bind_window(&far_region, 0, SPAN as u64, Access::REMOTE_READ)
        .unwrap();
    common::arrivals::empty_notifying_writes_are_checked(
        &initiator,
        &target,
        near_region.local(0, 0).unwrap(),
        window.remote(),
        read_only.remote(),
    );

    // Refused (past the window): no arrival.
    let past = Pattern::new(vec![Piece::vector(0, 8, 2, 1 << 30)], 1, 0).unwrap();
    let refused = Vector::write(
        near_region.local(0, 16).unwrap(),
        Pattern::contiguous(16),
        window.remote().at(0),
        past,
    )
    .unwrap()
    .notify(0xbad);
    let done = run(&initiator, refused.build());
    assert_eq!(done.status, Status::RemoteAccessError, "{done:?}");
    assert!(target.arrivals().unwrap().is_empty());

    // Arrivals the target does not take: once its port holds as many as
    // the device allows, notifying writes are refused (NoticeLimit), and
    // every one that succeeded has its arrival.
    let small = Vector::write(
        near_region.local(0, 8).unwrap(),
        Pattern::contiguous(8),
        window.remote().at(0),
        Pattern::contiguous(8),
    )
    .unwrap();
    common::arrivals::arrivals_are_bounded_and_none_is_dropped(&initiator, &target, &small);
}

/// Datagrams nobody of the fabric sends (random bytes, another job's
/// token, frames naming another node, datagrams from addresses that are
/// no peer's) are dropped and counted; the device goes on serving its
/// peer.
#[test]
fn hostile_datagrams_are_dropped_and_counted_and_the_fabric_goes_on() {
    let ports = [free_port(), free_port()];
    let zero = node(0, &ports, &[]);
    let target_address = format!("127.0.0.1:{}", ports[0]);
    // Pose as node 1 (its address) before node 1 starts, then as a
    // stranger.
    let impostor = std::net::UdpSocket::bind(format!("127.0.0.1:{}", ports[1])).unwrap();
    let stranger = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut sent = 0;
    for round in 0..500 {
        let len = (next() % 1500) as usize;
        let mut bytes: Vec<u8> = (0..len).map(|_| next() as u8).collect();
        match round % 4 {
            // The endpoint's magic and version, the rest random.
            0 if len >= 4 => {
                bytes[..3].copy_from_slice(&[b'p', b'd', pindown_emu_device::net::wire::VERSION])
            }
            // A frame datagram's magic, with random token and nodes.
            1 if len >= 4 => bytes[..4].copy_from_slice(&[b'p', b'f', 1, 0]),
            _ => {}
        }
        impostor.send_to(&bytes, &target_address).unwrap();
        stranger.send_to(&bytes, &target_address).unwrap();
        sent += 2;
    }
    // Some may be lost in the socket's buffer; wait until the count
    // holds still, then every datagram received must be counted as
    // refused, one way or another.
    let mut last = u64::MAX;
    let status = loop {
        std::thread::sleep(Duration::from_millis(200));
        let status = zero.fabric_status();
        if status.n("datagrams_received") == last {
            break status;
        }
        last = status.n("datagrams_received");
    };
    assert!(last > 0 && last <= sent, "{status:?}");
    assert_eq!(
        status.n("stray_datagrams") + status.n("dropped_datagrams") + status.n("frames_dropped"),
        last,
        "every hostile datagram is counted once: {status:?}"
    );
    assert!(status.n("stray_datagrams") > 0, "{status:?}");
    assert_eq!(
        status.n("frames_received") + status.n("served"),
        0,
        "{status:?}"
    );
    drop(impostor);
    // The real node 1 joins, and both serve.
    let one = node(1, &ports, &[]);
    let initiator = Context::open(zero.socket(0), config()).unwrap();
    let target = Context::open(one.socket(0), config()).unwrap();
    let near = initiator.alloc(1 << 16, 64).unwrap();
    let far = target.alloc(1 << 16, 64).unwrap();
    near.write_at(0, &pattern(1 << 16, 9));
    let near_region = initiator.register_buffer(&near).unwrap();
    let far_region = target.register_buffer(&far).unwrap();
    let window = target
        .bind_window(&far_region, 0, 1 << 16, Access::REMOTE_WRITE)
        .unwrap();
    let done = run(
        &initiator,
        Write::new(
            near_region.local(0, 1 << 16).unwrap(),
            window.remote().at(0),
        )
        .build(),
    );
    assert!(done.is_success(), "{done:?}");
    assert!(contents(&far) == pattern(1 << 16, 9));
}

/// ATOMIC_TO from a port of node 0: on a word of node 2 with the old value
/// landing in a window of node 1 (three nodes), on a word of node 1 with
/// it landing at node 0, and on a word of node 0 with it landing at node
/// 2; every word and every landed old value checked against a model, under
/// loss.
#[test]
fn atomics_deliver_old_values_to_windows_on_other_nodes() {
    let ports = [free_port(), free_port(), free_port()];
    let lossy = [
        "--fault-in",
        "loss=0.03,dup=0.02,reorder=0.03,seed=31",
        "--fault-out",
        "loss=0.03,seed=32",
    ];
    let devices: Vec<DeviceProcess> = (0..3).map(|n| node(n, &ports, &lossy)).collect();
    let contexts: Vec<Context> = devices
        .iter()
        .map(|d| Context::open(d.socket(0), config()).unwrap())
        .collect();
    let buffers: Vec<DmaBuffer> = contexts
        .iter()
        .map(|c| c.alloc(4096, 64).unwrap())
        .collect();
    for (n, buffer) in buffers.iter().enumerate() {
        buffer.write_at(0, &pattern(4096, 0x70 + n as u8));
    }
    let regions: Vec<_> = contexts
        .iter()
        .zip(&buffers)
        .map(|(c, b)| c.register_buffer(b).unwrap())
        .collect();
    let all = Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC;
    let windows: Vec<_> = contexts
        .iter()
        .zip(&regions)
        .map(|(c, r)| c.bind_window(r, 0, 4096, all).unwrap())
        .collect();
    let word_of = |n: usize, at: usize| {
        let mut word = [0u8; 8];
        buffers[n].read_at(at, &mut word);
        u64::from_le_bytes(word)
    };
    // (word's node, word offset, destination node, destination offset, op)
    let cases = [
        (
            2usize,
            64usize,
            1usize,
            512usize,
            AtomicOp::FetchAdd { add: 1000 },
        ),
        (1, 128, 0, 1024, AtomicOp::Swap { value: 77 }),
        (
            0,
            192,
            2,
            2048,
            AtomicOp::Bitwise {
                op: Bitwise::Xor,
                mask: 0xff00,
            },
        ),
        (
            2,
            64,
            2,
            3000,
            AtomicOp::CompareSwap {
                compare: 0,
                swap: 5,
            },
        ),
    ];
    for (word_node, word_at, to_node, to_at, op) in cases {
        let old = word_of(word_node, word_at);
        let done = run(
            &contexts[0],
            AtomicTo::new(
                windows[word_node].remote().at(word_at as u64),
                op,
                windows[to_node].remote().at(to_at as u64),
            )
            .build(),
        );
        assert_eq!(
            (done.status, done.detail, done.value),
            (Status::Success, ErrorDetail::None, old),
            "{op:?} on node {word_node}'s word, old value to node {to_node}: {done:?}"
        );
        let new = match op {
            AtomicOp::FetchAdd { add } => old.wrapping_add(add),
            AtomicOp::Swap { value } => value,
            AtomicOp::Bitwise { mask, .. } => old ^ mask,
            AtomicOp::CompareSwap { compare, swap } => {
                if old == compare {
                    swap
                } else {
                    old
                }
            }
        };
        assert_eq!(word_of(word_node, word_at), new, "{op:?}: the word");
        assert_eq!(word_of(to_node, to_at), old, "{op:?}: the old value landed");
    }
    // A destination that refuses (no write right, or the old value would
    // end past the window) fails the request before the word changes,
    // wherever the word and the destination are: a third node, the
    // initiator's node, the word's node, and the initiator's own word
    // with its old value bound for another node. Nothing of either
    // memory changes.
    let read_only: Vec<_> = contexts
        .iter()
        .zip(&regions)
        .map(|(c, r)| c.bind_window(r, 0, 4096, Access::REMOTE_READ).unwrap())
        .collect();
    // A window of node 1 over memory taken away after it was bound: it
    // grants nothing, though its key, bounds and rights are live.
    let bare = contexts[1].alloc(4096, 64).unwrap();
    let bare_region = contexts[1].register_buffer(&bare).unwrap();
    // SAFETY: `bare` stays allocated, and exposed to nobody else, until
    // `unbacked` is revoked (dropped before it at the end of the test).
    let unbacked =
        unsafe { contexts[1].bind_window_raw(bare.iova(), 4096, Access::REMOTE_WRITE, None) }
            .unwrap();
    drop(bare_region);
    assert_eq!(contexts[1].invalidate(bare.iova(), 4096), 1);
    // (word's node, destination node, destination, what the refusal is)
    let refusals = [
        (2usize, 1usize, unbacked.remote().at(8), "memory taken away"),
        (1, 1, unbacked.remote().at(8), "memory taken away"),
        (0, 1, unbacked.remote().at(8), "memory taken away"),
        (2usize, 1usize, read_only[1].remote().at(8), "read-only"),
        (2, 1, windows[1].remote().at(4090), "past the window"),
        (1, 0, read_only[0].remote().at(8), "read-only"),
        (1, 0, windows[0].remote().at(4092), "past the window"),
        (2, 2, read_only[2].remote().at(8), "read-only"),
        (0, 2, read_only[2].remote().at(8), "read-only"),
        (0, 1, windows[1].remote().at(4089), "past the window"),
    ];
    for (word_node, to_node, destination, why) in refusals {
        let memory: Vec<Vec<u8>> = buffers.iter().map(contents).collect();
        let done = run(
            &contexts[0],
            AtomicTo::new(
                windows[word_node].remote().at(64),
                AtomicOp::FetchAdd { add: 1 },
                destination,
            )
            .build(),
        );
        assert_eq!(
            done.status,
            Status::RemoteAccessError,
            "word on node {word_node}, old value to node {to_node} ({why}): {done:?}"
        );
        for (n, before) in memory.iter().enumerate() {
            assert!(
                contents(&buffers[n]) == *before,
                "word on node {word_node}, old value to node {to_node} ({why}): node {n}'s memory changed"
            );
        }
    }
    // And the same requests with a destination that takes it go through.
    let old = word_of(2, 64);
    let done = run(
        &contexts[0],
        AtomicTo::new(
            windows[2].remote().at(64),
            AtomicOp::FetchAdd { add: 1 },
            windows[1].remote().at(4088),
        )
        .build(),
    );
    assert_eq!(
        (done.status, done.value),
        (Status::Success, old),
        "{done:?}"
    );
    assert_eq!(word_of(2, 64), old + 1);
    assert_eq!(word_of(1, 4088), old);
    drop(unbacked);
}

/// An ATOMIC_TO held for its destination's check goes out as soon as the
/// check passed, not at the link's next wake-up: with devices that sleep
/// at once after work (`--spin-us 0`), 20 of them (third-node
/// destination, and the initiator's own word with a remote one) complete
/// well within the time one sleep of a second each would take.
#[test]
fn a_held_atomic_to_goes_on_without_waiting_for_a_wake_up() {
    let ports = [free_port(), free_port(), free_port()];
    let devices: Vec<DeviceProcess> = (0..3)
        .map(|n| node(n, &ports, &["--spin-us", "0"]))
        .collect();
    let contexts: Vec<Context> = devices
        .iter()
        .map(|d| Context::open(d.socket(0), config()).unwrap())
        .collect();
    let buffers: Vec<DmaBuffer> = contexts
        .iter()
        .map(|c| c.alloc(4096, 64).unwrap())
        .collect();
    let regions: Vec<_> = contexts
        .iter()
        .zip(&buffers)
        .map(|(c, b)| c.register_buffer(b).unwrap())
        .collect();
    let all = Access::REMOTE_WRITE | Access::REMOTE_ATOMIC;
    let windows: Vec<_> = contexts
        .iter()
        .zip(&regions)
        .map(|(c, r)| c.bind_window(r, 0, 4096, all).unwrap())
        .collect();
    let started = Instant::now();
    for round in 0..20u64 {
        let (word_node, to_node) = if round % 2 == 0 { (2, 1) } else { (0, 1) };
        let done = run(
            &contexts[0],
            AtomicTo::new(
                windows[word_node].remote().at(64),
                AtomicOp::FetchAdd { add: 1 },
                windows[to_node].remote().at(512 + 8 * round),
            )
            .build(),
        );
        assert!(done.is_success(), "{done:?}");
    }
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(10),
        "20 held ATOMIC_TOs took {took:?} (a link that slept till its next wake-up: a second each)"
    );
    let mut word = [0u8; 8];
    buffers[2].read_at(64, &mut word);
    assert_eq!(u64::from_le_bytes(word), 10);
    buffers[0].read_at(64, &mut word);
    assert_eq!(u64::from_le_bytes(word), 10);
}

#[test]
fn port_threads_carry_the_link_while_their_requests_are_on_the_fabric() {
    // Busy-poll: the port thread that hands a request to the link runs the
    // link's passes itself, between its polls.
    let on_ports = writes_both_ways(&["--poll"], 500, Duration::ZERO);
    assert!(
        on_ports >= 250,
        "500 writes, {on_ports} link passes on port threads"
    );
    // Event-driven, a port thread that spins after work (here long past
    // the test) runs the passes while its node's requests are in flight:
    // each write's answer is taken there.
    let on_ports = writes_both_ways(&["--spin-us=100000"], 200, Duration::ZERO);
    assert!(
        on_ports >= 100,
        "200 writes, {on_ports} link passes on port threads"
    );
    // Event-driven with no spin: the link's own thread does all.
    assert_eq!(writes_both_ways(&["--spin-us=0"], 200, Duration::ZERO), 0);
}

/// `writes` checked 8-byte writes from `from` into `window` (at most
/// 4096 bytes of `far`).
fn checked_writes(
    from: &Context,
    window: pindown_driver::verbs::RemoteWindow,
    far: &DmaBuffer,
    writes: u64,
) {
    let near = from.alloc(4096, 64).unwrap();
    let near_region = from.register_buffer(&near).unwrap();
    for i in 0..writes {
        let value = (i + 7).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        near.write_at(0, &value.to_le_bytes());
        let at = 8 * (i % 512);
        let done = run(
            from,
            Write::new(near_region.local(0, 8).unwrap(), window.at(at))
                .build()
                .user_data(i),
        );
        done.result().unwrap_or_else(|e| panic!("write {i}: {e:?}"));
        let mut landed = [0u8; 8];
        far.read_at(at as usize, &mut landed);
        assert_eq!(u64::from_le_bytes(landed), value, "write {i}");
    }
}

#[test]
fn a_link_whose_port_thread_stopped_driving_serves_the_other_node_again() {
    // Busy-poll: idle past a millisecond, node 0's port thread sleeps and
    // its link's own thread takes over.
    let driven = writes_both_ways(&["--poll"], 200, Duration::from_millis(20));
    assert!(driven > 0, "node 0's port thread never drove its link");
    // Event-driven: node 1's writes come while node 0's port thread still
    // spins after its last answer (it no longer drives: nothing of its
    // own is in flight), and once it slept.
    for extra in [&[][..], &["--spin-us=2000"][..]] {
        let driven = writes_both_ways(extra, 200, Duration::ZERO);
        assert!(
            driven > 0,
            "node 0's port thread never drove its link {extra:?}"
        );
    }
}

/// Node 0 makes `writes` checked 8-byte writes, one at a time, into node
/// 1's window; then, after `pause`, node 1 as many into node 0's, all of
/// which node 0 must serve. Returns node 0's count of link passes run on
/// its port thread by the end of its own writes.
fn writes_both_ways(extra: &[&str], writes: u64, pause: Duration) -> u64 {
    let ports = [free_port(), free_port()];
    let zero = node(0, &ports, extra);
    let one = node(1, &ports, extra);
    let zero_context = Context::open(zero.socket(0), config()).unwrap();
    let one_context = Context::open(one.socket(0), config()).unwrap();
    let far_zero = zero_context.alloc(4096, 64).unwrap();
    let far_one = one_context.alloc(4096, 64).unwrap();
    far_zero.fill(0);
    far_one.fill(0);
    let region_zero = zero_context.register_buffer(&far_zero).unwrap();
    let region_one = one_context.register_buffer(&far_one).unwrap();
    let window_zero = zero_context
        .bind_window(&region_zero, 0, 4096, Access::REMOTE_WRITE)
        .unwrap();
    let window_one = one_context
        .bind_window(&region_one, 0, 4096, Access::REMOTE_WRITE)
        .unwrap();
    checked_writes(&zero_context, window_one.remote(), &far_one, writes);
    let driven = zero.fabric_status().n("passes_on_ports");
    std::thread::sleep(pause);
    let served_before = zero.fabric_status().n("served");
    checked_writes(&one_context, window_zero.remote(), &far_zero, writes);
    let served = zero.fabric_status().n("served") - served_before;
    assert!(
        served >= writes,
        "node 0 served {served} of node 1's {writes} writes {extra:?}"
    );
    driven
}
