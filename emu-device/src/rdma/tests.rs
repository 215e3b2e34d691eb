//! The engine against plain memory: ports backed by buffers of this process.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use pindown_uapi::{
    Access, AtomicOp, AtomicWidth, Bitwise, ErrorDetail, Opcode, Operation, RemoteAddress,
    RemoteKey, Status,
};

use super::{Progress, Turn, WindowTable, NOT_GRANTED, STEPS_PER_TURN, STEP_BYTES};
use crate::testing::engine::{remote, BufferDevice as Device};

#[test]
fn writes_and_reads_move_exact_bytes_across_spans_at_odd_offsets() {
    let device = Device::new(2);
    let all = Access::REMOTE_READ | Access::REMOTE_WRITE;
    let key = device.bind(1, device.base(1) + 100, 20_000, all);
    let pattern: Vec<u8> = (0..9_999u32).map(|i| (i * 7 + 3) as u8).collect();
    device.ports[0]
        .memory
        .write(device.base(0) + 4095, &pattern);
    let written = device.run(
        0,
        Operation::Write {
            local: device.base(0) + 4095,
            len: pattern.len() as u32,
            remote: remote(1, key, 3),
        },
    );
    assert_eq!(
        (written.status, written.byte_len, written.user_data),
        (Status::Success, 9_999, 0xfeed)
    );
    assert_eq!(
        device.ports[1]
            .memory
            .read(device.base(1) + 103, pattern.len()),
        pattern
    );
    // Untouched around it.
    assert_eq!(
        device.ports[1].memory.read(device.base(1) + 102, 1),
        vec![0]
    );
    assert_eq!(
        device.ports[1].memory.read(device.base(1) + 103 + 9_999, 1),
        vec![0]
    );

    let read = device.run(
        0,
        Operation::Read {
            local: device.base(0) + 30_001,
            len: 7,
            remote: remote(1, key, 3 + 5),
        },
    );
    assert!(read.is_success());
    assert_eq!(
        device.ports[0].memory.read(device.base(0) + 30_001, 7),
        pattern[5..12].to_vec()
    );
}

#[test]
fn inline_writes_land_exactly_and_are_refused_like_any_write() {
    let device = Device::new(2);
    let writable = device.bind(1, device.base(1) + 4000, 1000, Access::REMOTE_WRITE);
    let read_only = device.bind(1, device.base(1), 4096, Access::REMOTE_READ);
    let bytes: Vec<u8> = (0..300u32).map(|i| (i * 13 + 1) as u8).collect();
    // Across the 4 KiB piece boundary of the target's memory.
    let done = device.write_inline(0, &bytes, remote(1, writable, 90));
    assert_eq!(
        (done.status, done.byte_len, done.opcode),
        (
            Status::Success,
            300,
            Some(pindown_uapi::Opcode::WriteInline)
        )
    );
    assert_eq!(
        device.ports[1].memory.read(device.base(1) + 4090, 300),
        bytes
    );
    assert_eq!(device.ports[1].memory.read(device.base(1) + 4089, 1), [0]);
    assert_eq!(device.ports[1].memory.read(device.base(1) + 4390, 1), [0]);
    let before = device.ports[1].memory.read(device.base(1), 8192);
    for (key, offset, len) in [(read_only, 0, 8), (writable, 999, 2), (RemoteKey(7), 0, 8)] {
        let refused = device.write_inline(0, &bytes[..len], remote(1, key, offset));
        assert_eq!(
            (refused.status, refused.detail),
            NOT_GRANTED,
            "{key:?} {offset}"
        );
    }
    // Bytes that do not match the request's length are malformed.
    let mut head = [0u8; 16];
    head[..8].copy_from_slice(&bytes[..8]);
    let op = Operation::WriteInline {
        len: 8,
        head,
        remote: remote(1, writable, 0),
    };
    let Turn::Done(short) = device.turn_with(0, op, &bytes[..7], &mut Progress::default()) else {
        panic!("one turn");
    };
    assert_eq!(
        (short.status, short.detail),
        (Status::InvalidRequest, ErrorDetail::Malformed)
    );
    assert_eq!(device.ports[1].memory.read(device.base(1), 8192), before);
}

#[test]
fn bad_keys_bounds_rights_and_registrations_fail_and_touch_nothing() {
    let device = Device::new(3);
    let read_only = device.bind(1, device.base(1), 4096, Access::REMOTE_READ);
    let writable = device.bind(1, device.base(1) + 4096, 4096, Access::REMOTE_WRITE);
    device.ports[0].memory.write(device.base(0), &[0xAB; 64]);
    let before = device.ports[1].memory.read(device.base(1), 16_384);
    let write = |key, offset, len, local| {
        device.run(
            0,
            Operation::Write {
                local,
                len,
                remote: remote(1, key, offset),
            },
        )
    };
    let local = device.base(0);
    let (remote_error, not_granted) = NOT_GRANTED;
    let cases = [
        (write(read_only, 0, 8, local), remote_error, not_granted),
        (
            write(RemoteKey(0xdead), 0, 8, local),
            remote_error,
            not_granted,
        ),
        (write(writable, 4090, 8, local), remote_error, not_granted),
        (
            write(writable, 0, 8, 0x7777_0000),
            Status::LocalProtectionError,
            ErrorDetail::Unregistered,
        ),
    ];
    for (completion, status, detail) in cases {
        assert_eq!(
            (completion.status, completion.detail),
            (status, detail),
            "{completion:?}"
        );
    }
    assert!(device
        .run(1, Operation::RevokeWindow { key: writable })
        .is_success());
    let revoked = write(writable, 0, 8, local);
    assert_eq!((revoked.status, revoked.detail), NOT_GRANTED);
    let again = device.run(1, Operation::RevokeWindow { key: writable });
    assert_eq!(
        (again.status, again.detail),
        (Status::InvalidRequest, ErrorDetail::UnknownWindow),
        "the owner learns about its own keys"
    );
    let unknown = device.run(
        0,
        Operation::Write {
            local,
            len: 8,
            remote: remote(9, writable, 0),
        },
    );
    assert_eq!(unknown.detail, ErrorDetail::UnknownPort);
    assert_eq!(
        device.ports[1].memory.read(device.base(1), 16_384),
        before,
        "target unchanged"
    );
    // Binding memory that is not registered fails.
    let bind = device.run(
        1,
        Operation::BindWindow {
            start: 0x5000_0000,
            len: 8,
            access: Access::REMOTE_READ,
            peer: None,
        },
    );
    assert_eq!(bind.status, Status::LocalProtectionError);
}

#[test]
fn a_port_that_is_down_reports_peer_gone() {
    let mut device = Device::new(2);
    let key = device.bind(1, device.base(1), 4096, Access::REMOTE_WRITE);
    device.ports[1].up = false;
    let completion = device.run(
        0,
        Operation::Write {
            local: device.base(0),
            len: 8,
            remote: remote(1, key, 0),
        },
    );
    assert_eq!(
        (completion.status, completion.detail),
        (Status::PeerGone, ErrorDetail::PortDown)
    );
}

#[test]
fn atomics_return_old_values_and_check_alignment() {
    let device = Device::new(2);
    let key = device.bind(1, device.base(1), 4096, Access::REMOTE_ATOMIC);
    let word = remote(1, key, 64);
    let eight = AtomicWidth::Eight;
    let run = |op| device.run(0, op);
    assert_eq!(
        run(Operation::FetchAdd {
            remote: word,
            width: eight,
            add: 5
        })
        .value,
        0
    );
    assert_eq!(
        run(Operation::Swap {
            remote: word,
            width: eight,
            value: 40
        })
        .value,
        5
    );
    let failed = run(Operation::CompareSwap {
        remote: word,
        width: eight,
        compare: 1,
        swap: 2,
    });
    assert_eq!(
        (failed.status, failed.value),
        (Status::Success, 40),
        "a failed compare returns the value"
    );
    assert_eq!(
        run(Operation::CompareSwap {
            remote: word,
            width: eight,
            compare: 40,
            swap: 41
        })
        .value,
        40
    );
    assert_eq!(
        device.ports[1].memory.read(device.base(1) + 64, 8),
        41u64.to_le_bytes().to_vec()
    );
    let four = remote(1, key, 128);
    assert_eq!(
        run(Operation::FetchAdd {
            remote: four,
            width: AtomicWidth::Four,
            add: u64::from(u32::MAX)
        })
        .value,
        0
    );
    assert_eq!(
        run(Operation::FetchAdd {
            remote: four,
            width: AtomicWidth::Four,
            add: 2
        })
        .value,
        u64::from(u32::MAX)
    );
    assert_eq!(
        device.ports[1].memory.read(device.base(1) + 128, 8),
        vec![1, 0, 0, 0, 0, 0, 0, 0],
        "wrapped, 4 bytes only"
    );
    let misaligned = run(Operation::FetchAdd {
        remote: remote(1, key, 66),
        width: eight,
        add: 1,
    });
    assert_eq!(
        (misaligned.status, misaligned.detail),
        (Status::InvalidRequest, ErrorDetail::Misaligned)
    );
    let no_right = device.bind(1, device.base(1), 4096, Access::REMOTE_WRITE);
    let denied = run(Operation::FetchAdd {
        remote: remote(1, no_right, 64),
        width: eight,
        add: 1,
    });
    assert_eq!((denied.status, denied.detail), NOT_GRANTED);
}

#[test]
fn concurrent_fetch_adds_from_two_ports_sum_exactly() {
    let device = Arc::new(Device::new(3));
    let key = device.bind(2, device.base(2), 4096, Access::REMOTE_ATOMIC);
    std::thread::scope(|scope| {
        for port in 0..2u16 {
            let device = &device;
            scope.spawn(move || {
                for _ in 0..100_000 {
                    let op = Operation::FetchAdd {
                        remote: remote(2, key, 8),
                        width: AtomicWidth::Eight,
                        add: 1,
                    };
                    assert!(device.run(port, op).is_success());
                }
            });
        }
    });
    assert_eq!(
        device.ports[2].memory.read(device.base(2) + 8, 8),
        200_000u64.to_le_bytes().to_vec()
    );
}

/// Every operation that reaches a remote window, against `remote`.
fn every_remote_op(local: u64, remote: RemoteAddress) -> [Operation; 5] {
    let width = AtomicWidth::Eight;
    [
        Operation::Write {
            local,
            len: 64,
            remote,
        },
        Operation::Read {
            local,
            len: 64,
            remote,
        },
        Operation::FetchAdd {
            remote,
            width,
            add: 1,
        },
        Operation::Swap {
            remote,
            width,
            value: 0,
        },
        Operation::CompareSwap {
            remote,
            width,
            compare: 0x7777_7777_7777_7777,
            swap: 0,
        },
    ]
}

#[test]
fn every_refusal_gets_the_same_answer_moves_no_byte_and_is_counted_by_cause() {
    let device = Device::new(4);
    let base = device.base(1);
    let all = Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC;
    // Windows of port 1: one open to all, one bound to port 2, one
    // write-only, one read-only, and one revoked.
    let open = device.bind(1, base, 8192, all);
    let for_two = device.bind_for(1, base + 8192, 8192, all, Some(2));
    let write_only = device.bind(1, base + 16_384, 4096, Access::REMOTE_WRITE);
    let read_only = device.bind(1, base + 16_384, 4096, Access::REMOTE_READ);
    let revoked = device.bind(1, base, 4096, all);
    assert!(device
        .run(1, Operation::RevokeWindow { key: revoked })
        .is_success());
    let pattern: Vec<u8> = (0..65_536u32).map(|i| (i * 31 + 7) as u8).collect();
    device.ports[1].memory.write(base, &pattern);
    // The initiator's local buffer: a read refused must not land there either.
    let local = device.base(0);
    device.ports[0].memory.write(local, &[0x5a; 64]);

    let cases: Vec<(&str, RemoteAddress, Vec<usize>)> = vec![
        (
            "never bound",
            remote(1, RemoteKey(0x1234_5678_9abc), 0),
            vec![0, 1, 2, 3, 4],
        ),
        ("revoked", remote(1, revoked, 0), vec![0, 1, 2, 3, 4]),
        (
            "open key, low bit flipped",
            remote(1, RemoteKey(open.0 ^ 1), 0),
            vec![0, 1, 2, 3, 4],
        ),
        (
            "another port's key",
            remote(1, for_two, 0),
            vec![0, 1, 2, 3, 4],
        ),
        ("out of bounds", remote(1, open, 8192 - 8), vec![0, 1]),
        (
            "out of bounds, far",
            remote(1, open, u64::MAX - 4),
            vec![0, 1, 2, 3, 4],
        ),
        (
            "missing write right",
            remote(1, read_only, 0),
            vec![0, 2, 3, 4],
        ),
        ("missing read right", remote(1, write_only, 0), vec![1]),
    ];
    let mut attempts = 0u64;
    for (what, address, ops) in &cases {
        let all_ops = every_remote_op(local, *address);
        for &i in ops {
            let done = device.run(0, all_ops[i]);
            attempts += 1;
            assert_eq!(
                (done.status, done.detail, done.byte_len, done.value),
                (NOT_GRANTED.0, NOT_GRANTED.1, 0, 0),
                "{what}: {:?}",
                all_ops[i]
            );
        }
    }
    // The owner's memory and the initiator's buffer are unchanged.
    assert_eq!(device.ports[1].memory.read(base, 65_536), pattern);
    assert_eq!(device.ports[0].memory.read(local, 64), vec![0x5a; 64]);
    // The owner's counters tell the causes apart and add up.
    let counters = &device.ports[1].refused;
    let load = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(load(&counters.bad_key), 15);
    assert_eq!(load(&counters.wrong_peer), 5);
    assert_eq!(load(&counters.out_of_bounds), 7);
    assert_eq!(load(&counters.missing_right), 5);
    assert_eq!(counters.total(), attempts);
    assert_eq!(device.ports[0].refused.total(), 0, "counted at the owner");

    // Port 2 may use the window bound to it, and only that one port.
    let granted = device.run(
        2,
        Operation::Write {
            local: device.base(2),
            len: 8,
            remote: remote(1, for_two, 0),
        },
    );
    assert!(granted.is_success(), "{granted:?}");
}

#[test]
fn a_window_over_memory_the_owner_no_longer_registers_refuses_alike() {
    let mut device = Device::new(2);
    let base = device.base(1);
    let key = device.bind(1, base + 4096, 4096, Access::REMOTE_WRITE);
    // The owner unregisters the page under the window (the window stays).
    device.ports[1].memory.registered = vec![(base, 4096, true)];
    let done = device.run(
        0,
        Operation::Write {
            local: device.base(0),
            len: 8,
            remote: remote(1, key, 0),
        },
    );
    assert_eq!((done.status, done.detail), NOT_GRANTED);
    let counters = &device.ports[1].refused;
    assert_eq!(
        counters
            .unregistered
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    assert_eq!(counters.total(), 1);
}

#[test]
fn binding_beyond_the_window_limit_fails_clearly_and_keeps_the_others() {
    let mut device = Device::new(2);
    device.ports[1].windows = WindowTable::with_limit(4);
    let base = device.base(1);
    let keys: Vec<RemoteKey> = (0..4)
        .map(|i| device.bind(1, base + i * 8, 8, Access::REMOTE_WRITE))
        .collect();
    let refused = device.run(
        1,
        Operation::BindWindow {
            start: base,
            len: 8,
            access: Access::REMOTE_WRITE,
            peer: None,
        },
    );
    assert_eq!(
        (refused.status, refused.detail, refused.value),
        (Status::LimitReached, ErrorDetail::WindowLimit, 0)
    );
    assert!(refused.detail.describe().contains("--max-windows-per-port"));
    assert_eq!(device.ports[1].windows.len(), 4);
    // The windows bound before still work.
    for (i, key) in keys.iter().enumerate() {
        device.ports[0]
            .memory
            .write(device.base(0), &[i as u8 + 1; 8]);
        let done = device.run(
            0,
            Operation::Write {
                local: device.base(0),
                len: 8,
                remote: remote(1, *key, 0),
            },
        );
        assert!(done.is_success(), "{done:?}");
        assert_eq!(
            device.ports[1].memory.read(base + i as u64 * 8, 8),
            vec![i as u8 + 1; 8]
        );
    }
    // A revoke makes room again.
    assert!(device
        .run(1, Operation::RevokeWindow { key: keys[0] })
        .is_success());
    device.bind(1, base, 8, Access::REMOTE_READ);
}

#[test]
fn long_transfers_pause_between_turns_and_a_barrier_between_turns_stops_them() {
    let steps = 3 * STEPS_PER_TURN as usize;
    let len = steps * STEP_BYTES as usize;
    let device = Device::with_memory(2, len);
    let all = Access::REMOTE_READ | Access::REMOTE_WRITE;
    let pattern: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
    device.ports[0].memory.write(device.base(0), &pattern);
    let key = device.bind(1, device.base(1), len as u64, all);
    let write = Operation::Write {
        local: device.base(0),
        len: len as u32,
        remote: remote(1, key, 0),
    };
    // Whole: three turns, the last one complete, every byte in place.
    let mut progress = Progress::default();
    assert_eq!(device.turn(0, write, &mut progress), Turn::Paused);
    assert_eq!(progress.moved, STEPS_PER_TURN * STEP_BYTES);
    assert_eq!(device.turn(0, write, &mut progress), Turn::Paused);
    let Turn::Done(done) = device.turn(0, write, &mut progress) else {
        panic!("a third turn completes the transfer");
    };
    assert_eq!((done.status, done.byte_len), (Status::Success, len as u32));
    assert!(device.ports[1].memory.read(device.base(1), len) == pattern);

    // Revoked between two turns: the next turn fails, and nothing after
    // the first turn's bytes was written.
    let fresh = Device::with_memory(2, len);
    fresh.ports[0].memory.write(fresh.base(0), &pattern);
    let key = fresh.bind(1, fresh.base(1), len as u64, all);
    let write = Operation::Write {
        local: fresh.base(0),
        len: len as u32,
        remote: remote(1, key, 0),
    };
    let mut progress = Progress::default();
    assert_eq!(fresh.turn(0, write, &mut progress), Turn::Paused);
    assert!(fresh.ports[1].windows.revoke(key));
    let Turn::Done(done) = fresh.turn(0, write, &mut progress) else {
        panic!("a revoked window ends the transfer");
    };
    assert_eq!((done.status, done.detail), NOT_GRANTED);
    let cut = (STEPS_PER_TURN * STEP_BYTES) as usize;
    let landed = fresh.ports[1].memory.read(fresh.base(1), len);
    assert!(landed[..cut] == pattern[..cut]);
    assert!(
        landed[cut..].iter().all(|&b| b == 0),
        "bytes after the barrier"
    );
}

#[test]
fn memory_its_owner_took_away_fails_every_access() {
    let device = Device::new(3);
    let all = Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC;
    let key = device.bind(1, device.base(1), 4096, all);
    let key2 = device.bind(2, device.base(2), 4096, all);
    device.ports[1].memory.lost.store(true, Ordering::Relaxed);
    let peer_gone = (Status::PeerGone, ErrorDetail::PortDown);
    for op in every_remote_op(device.base(0), remote(1, key, 0)) {
        let done = device.run(0, op);
        assert_eq!((done.status, done.detail), peer_gone, "{op:?}");
    }
    // The initiator's own memory taken away: a local error.
    device.ports[0].memory.lost.store(true, Ordering::Relaxed);
    for op in [
        Operation::Write {
            local: device.base(0),
            len: 64,
            remote: remote(2, key2, 0),
        },
        Operation::Read {
            local: device.base(0),
            len: 64,
            remote: remote(2, key2, 0),
        },
    ] {
        let done = device.run(0, op);
        assert_eq!(
            (done.status, done.detail),
            (Status::LocalProtectionError, ErrorDetail::Unregistered),
            "{op:?}"
        );
    }
}

/// How a vector test maps the initiator's memory.
#[derive(Clone, Copy, Debug)]
enum Mapping {
    /// In runs of this many bytes, registered as one.
    Pieces(usize),
    /// One run, registered as two halves meeting at this offset: a hull
    /// across both is not registered as a whole, its elements are.
    SplitAt(usize),
}

/// Fills port 0's and port 1's first `memory` bytes with patterns of
/// their own, opens port 1's to reads and writes, and runs a vector write
/// (or `read`) of `len` bytes between port 0 at `local` (from its base) and
/// port 1 at offset 100, `descriptor` inline. Returns the completion, the
/// turns it took and the two patterns written before.
fn vector_between(
    device: &Device,
    memory: usize,
    local: u64,
    len: u64,
    descriptor: &[u8],
    read: bool,
) -> (pindown_uapi::Completion, usize, Vec<u8>, Vec<u8>) {
    use pindown_uapi::{Descriptor, VectorTransfer};
    let (near, far) = (&device.ports[0].memory, &device.ports[1].memory);
    let near_bytes: Vec<u8> = (0..memory).map(|i| (i * 7 + 1) as u8).collect();
    let far_bytes: Vec<u8> = (0..memory).map(|i| (i * 13 + 5) as u8).collect();
    near.write(near.base, &near_bytes);
    far.write(far.base, &far_bytes);
    let key = device.bind(
        1,
        far.base,
        memory as u64,
        Access::REMOTE_READ | Access::REMOTE_WRITE,
    );
    let transfer = VectorTransfer {
        local: near.base + local,
        len: len as u32,
        remote: RemoteAddress {
            node: 0,
            port: 1,
            key,
            offset: 100,
        },
        descriptor: Descriptor::Inline {
            len: descriptor.len() as u32,
        },
        notify: None,
    };
    let op = if read {
        Operation::VectorRead(transfer)
    } else {
        Operation::VectorWrite(transfer)
    };
    let (done, turns) = device.run_vector(0, op, descriptor);
    (done, turns, near_bytes, far_bytes)
}

#[test]
fn vector_transfers_move_the_same_bytes_through_contiguous_and_scattered_mappings() {
    use pindown_uapi::pattern::{encode_pair, Pattern, Piece};

    const MEMORY: usize = 4 << 20;
    const COUNT: u64 = 60_000;
    // Each local pattern with the offsets of its bytes, in stream order.
    // Blocks of 24 bytes 40 apart cross 4 KiB (and 12 KiB + 8) boundaries
    // now and then.
    let blocks = |offset: i64, block: u64, stride: i64| -> Vec<usize> {
        (0..COUNT as i64)
            .flat_map(|i| (0..block as i64).map(move |b| (offset + i * stride + b) as usize))
            .collect()
    };
    let last = 8 + 40 * (COUNT as i64 - 1);
    let patterns = [
        // Forward: the cursor moves on.
        (vec![Piece::vector(8, 24, COUNT, 40)], blocks(8, 24, 40)),
        // Backward: every element is behind the one before.
        (
            vec![Piece::vector(last, 24, COUNT, -40)],
            blocks(last, 24, -40),
        ),
        // Forward, then back to the start and forward again.
        (
            vec![
                Piece::vector(8, 24, COUNT, 40),
                Piece::vector(4, 20, COUNT, 40),
            ],
            [blocks(8, 24, 40), blocks(4, 20, 40)].concat(),
        ),
    ];
    for (pieces, model) in patterns {
        let local = Pattern::new(pieces, 1, 0).unwrap();
        assert_eq!(local.len, model.len() as u64);
        // More than STEPS_PER_TURN steps, so several turns; into contiguous
        // bytes of the window.
        assert!(local.len > STEP_BYTES * STEPS_PER_TURN);
        let remote = Pattern::contiguous(local.len);
        let descriptor = encode_pair(&local, &remote);
        let mut results = Vec::new();
        // Runs of 4 KiB or 12 KiB + 8: each step's hull is granted as a
        // whole and found in many spans; one run: every step maps its hull
        // once; registered in two halves (no element crosses 1 MB): each
        // element is checked and translated by itself.
        for mapping in [
            Mapping::Pieces(4096),
            Mapping::Pieces(3 * 4096 + 8),
            Mapping::Pieces(MEMORY),
            Mapping::SplitAt(1_000_000),
        ] {
            for read in [false, true] {
                let piece = match mapping {
                    Mapping::Pieces(piece) => piece,
                    Mapping::SplitAt(_) => MEMORY,
                };
                let mut device = Device::with_pieces(2, MEMORY, piece);
                if let Mapping::SplitAt(half) = mapping {
                    let base = device.ports[0].memory.base;
                    device.ports[0].memory.registered = vec![
                        (base, half as u64, true),
                        (base + half as u64, (MEMORY - half) as u64, true),
                    ];
                }
                let (near, far) = (&device.ports[0].memory, &device.ports[1].memory);
                let (done, turns, near_bytes, far_bytes) =
                    vector_between(&device, MEMORY, 0, local.len, &descriptor, read);
                let case = format!("{mapping:?}, read {read}, {} bytes", local.len);
                assert!(done.is_success(), "{case}: {done:?}");
                assert_eq!(done.byte_len, local.len as u32, "{case}");
                assert!(turns > 1, "a transfer this long takes several turns");
                let (mut near_expected, mut far_expected) = (near_bytes.clone(), far_bytes.clone());
                for (k, &at) in model.iter().enumerate() {
                    if read {
                        near_expected[at] = far_bytes[100 + k];
                    } else {
                        far_expected[100 + k] = near_bytes[at];
                    }
                }
                assert!(near.read(near.base, MEMORY) == near_expected, "{case}");
                assert!(far.read(far.base, MEMORY) == far_expected, "{case}");
                results.push((near.read(near.base, MEMORY), far.read(far.base, MEMORY)));
            }
        }
        for pair in results.chunks(2).skip(1) {
            assert!(pair == &results[..2]);
        }
    }
}

#[test]
fn a_loop_that_runs_once_may_have_any_stride() {
    use pindown_uapi::pattern::{encode_pair, Dim, Pattern, Piece};

    const MEMORY: usize = 64 * 1024;
    // Four doubles 8 bytes apart, inside a loop that runs once with the
    // largest stride either way: it moves nothing, so the pattern is four
    // contiguous doubles (a column in a matrix of one column, say). Its
    // carry steps one stride past and back, which leaves i64's range.
    for (first, stride) in [(8, i64::MAX), (8, i64::MIN), (40, i64::MIN + 1)] {
        let local = Pattern::new(
            vec![Piece::Strided {
                offset: first,
                block: 8,
                dims: [
                    Dim {
                        count: 4,
                        stride: 8,
                    },
                    Dim { count: 1, stride },
                    Dim::ONE,
                ],
            }],
            1,
            0,
        )
        .unwrap();
        let remote_pattern = Pattern::contiguous(local.len);
        let descriptor = encode_pair(&local, &remote_pattern);
        for read in [false, true] {
            let device = Device::new(2);
            let (near, far) = (&device.ports[0].memory, &device.ports[1].memory);
            let (done, _, near_bytes, far_bytes) =
                vector_between(&device, MEMORY, 64, local.len, &descriptor, read);
            let case = format!("first {first}, stride {stride}, read {read}");
            assert!(done.is_success(), "{case}: {done:?}");
            assert_eq!(done.byte_len, 32, "{case}");
            let (mut near_expected, mut far_expected) = (near_bytes.clone(), far_bytes.clone());
            let local_at = 64 + first as usize;
            if read {
                near_expected[local_at..local_at + 32].copy_from_slice(&far_bytes[100..132]);
            } else {
                far_expected[100..132].copy_from_slice(&near_bytes[local_at..local_at + 32]);
            }
            assert!(near.read(near.base, MEMORY) == near_expected, "{case}");
            assert!(far.read(far.base, MEMORY) == far_expected, "{case}");
        }
    }
}

#[test]
fn bitwise_atomics_apply_their_logic_and_return_the_old_word() {
    let device = Device::new(2);
    let key = device.bind(1, device.base(1), 4096, Access::REMOTE_ATOMIC);
    let word = remote(1, key, 64);
    let start = 0xF0F0_1234_5678_9ABCu64;
    device.ports[1]
        .memory
        .write(device.base(1) + 64, &start.to_le_bytes());
    let mut model = start;
    for (op, mask) in [
        (Bitwise::And, 0xFFFF_0000_FFFF_0000u64),
        (Bitwise::Or, 0x0000_00FF_0000_00FF),
        (Bitwise::Xor, 0x1111_1111_1111_1111),
    ] {
        let done = device.run(
            0,
            Operation::FetchBitwise {
                remote: word,
                width: AtomicWidth::Eight,
                op,
                mask,
            },
        );
        assert_eq!(
            (done.status, done.value),
            (Status::Success, model),
            "{op:?}"
        );
        model = match op {
            Bitwise::And => model & mask,
            Bitwise::Or => model | mask,
            Bitwise::Xor => model ^ mask,
        };
        let now = device.ports[1].memory.read(device.base(1) + 64, 8);
        assert_eq!(now, model.to_le_bytes().to_vec(), "{op:?}");
    }
    // A 4-byte word leaves its neighbour alone.
    let four = remote(1, key, 128);
    device.ports[1]
        .memory
        .write(device.base(1) + 128, &[0xFF; 8]);
    let done = device.run(
        0,
        Operation::FetchBitwise {
            remote: four,
            width: AtomicWidth::Four,
            op: Bitwise::And,
            mask: 0x0F,
        },
    );
    assert_eq!(done.value, 0xFFFF_FFFF);
    assert_eq!(
        device.ports[1].memory.read(device.base(1) + 128, 8),
        vec![0x0F, 0, 0, 0, 0xFF, 0xFF, 0xFF, 0xFF]
    );
}

#[test]
fn a_copy_between_two_other_ports_needs_both_rights_and_moves_exact_bytes() {
    let device = Device::with_memory(3, 1 << 20);
    let len = 300_000u32;
    let source: Vec<u8> = (0..len as usize).map(|i| (i * 13 + 7) as u8).collect();
    device.ports[1].memory.write(device.base(1) + 5, &source);
    let before: Vec<u8> = (0..(1 << 20)).map(|i| (i % 251) as u8).collect();
    device.ports[2].memory.write(device.base(2), &before);
    let read_key = device.bind(1, device.base(1), 1 << 20, Access::REMOTE_READ);
    let write_key = device.bind(2, device.base(2), 1 << 20, Access::REMOTE_WRITE);
    let copy = |from: RemoteAddress, to: RemoteAddress| Operation::Copy {
        source: from,
        destination: to,
        len,
    };
    // Without the read right on the source, or the write right on the
    // destination, nothing moves.
    for (what, op) in [
        (
            "write window as source",
            copy(remote(2, write_key, 0), remote(2, write_key, 9)),
        ),
        (
            "read window as destination",
            copy(remote(1, read_key, 5), remote(1, read_key, 0)),
        ),
        (
            "past the source window",
            copy(remote(1, read_key, (1 << 20) - 10), remote(2, write_key, 0)),
        ),
    ] {
        let done = device.run(0, op);
        assert_eq!(done.status, Status::RemoteAccessError, "{what}: {done:?}");
        assert_eq!(
            device.ports[2].memory.read(device.base(2), 1 << 20),
            before,
            "{what}"
        );
    }
    let done = device.run(0, copy(remote(1, read_key, 5), remote(2, write_key, 17)));
    assert_eq!(
        (done.status, done.opcode, done.byte_len),
        (Status::Success, Some(Opcode::Copy), len),
        "{done:?}"
    );
    let mut expected = before.clone();
    expected[17..17 + len as usize].copy_from_slice(&source);
    assert!(device.ports[2].memory.read(device.base(2), 1 << 20) == expected);
}

#[test]
fn an_atomic_to_another_window_changes_the_word_only_when_the_old_value_can_land() {
    let device = Device::new(3);
    let atomic_key = device.bind(1, device.base(1), 4096, Access::REMOTE_ATOMIC);
    let write_key = device.bind(2, device.base(2), 4096, Access::REMOTE_WRITE);
    let read_key = device.bind(2, device.base(2), 4096, Access::REMOTE_READ);
    device.ports[1]
        .memory
        .write(device.base(1) + 64, &40u64.to_le_bytes());
    let to = |key, offset| Operation::AtomicTo {
        word: remote(1, atomic_key, 64),
        width: AtomicWidth::Eight,
        op: AtomicOp::FetchAdd { add: 2 },
        destination: remote(2, key, offset),
    };
    let done = device.run(0, to(write_key, 8));
    assert_eq!(
        (done.status, done.opcode, done.value),
        (Status::Success, Some(Opcode::AtomicToFetchAdd), 40),
        "{done:?}"
    );
    assert_eq!(
        device.ports[1].memory.read(device.base(1) + 64, 8),
        42u64.to_le_bytes().to_vec()
    );
    assert_eq!(
        device.ports[2].memory.read(device.base(2) + 8, 8),
        40u64.to_le_bytes().to_vec()
    );
    // A destination without the write right: refused, and the word is
    // left as it was.
    let done = device.run(0, to(read_key, 16));
    assert_eq!(done.status, Status::RemoteAccessError, "{done:?}");
    assert_eq!(
        device.ports[1].memory.read(device.base(1) + 64, 8),
        42u64.to_le_bytes().to_vec()
    );
    assert_eq!(
        device.ports[2].memory.read(device.base(2) + 16, 8),
        vec![0; 8]
    );
}

/// A one-unit vector transfer whose pattern names a loop of one unit
/// with a stride near the limits of `i64` (a loop that runs once may
/// have any stride): the copy takes that stride as its innermost, which
/// counts as far, and moves its one unit without overflowing a product
/// of the stride (the prefetch distance stays inside the run).
#[test]
fn a_one_unit_vector_transfer_with_an_extreme_stride_moves_its_bytes() {
    use pindown_uapi::pattern::{encode_pair, Dim, Pattern, Piece};
    const MEMORY: usize = 1 << 16;
    for stride in [i64::MAX, i64::MIN, 1 << 60, -(1 << 59)] {
        for read in [false, true] {
            let device = Device::with_pieces(2, MEMORY, MEMORY);
            let local = Pattern::new(
                vec![Piece::Strided {
                    offset: 64,
                    block: 8,
                    dims: [Dim::ONE, Dim::ONE, Dim { count: 1, stride }],
                }],
                1,
                0,
            )
            .unwrap();
            let remote = Pattern::contiguous(8);
            let descriptor = encode_pair(&local, &remote);
            let (done, _, near_bytes, far_bytes) =
                vector_between(&device, MEMORY, 0, 8, &descriptor, read);
            assert!(done.is_success(), "{stride} {read}: {done:?}");
            let (near, far) = (&device.ports[0].memory, &device.ports[1].memory);
            if read {
                assert_eq!(near.read(near.base + 64, 8), far_bytes[100..108].to_vec());
            } else {
                assert_eq!(far.read(far.base + 100, 8), near_bytes[64..72].to_vec());
            }
        }
    }
}
