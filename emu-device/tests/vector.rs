//! Vector transfers (VECTOR_WRITE, VECTOR_READ) between two ports of a
//! real device process: bytes move between two access patterns, every
//! byte is checked against a model written here (independent of the
//! `uapi` walk the device uses), bytes outside the patterns stay as they
//! were, and every refusal leaves memory untouched.

mod common;

use std::time::Duration;

use common::{buffer_contents as contents, DeviceProcess};
use pindown_driver::arena::DmaBuffer;
use pindown_driver::verbs::opcode::{Entry, Vector, Write};
use pindown_driver::verbs::{CompletionQueue, Context, ContextConfig};
use pindown_uapi::pattern::{encode_blocks, Block, BlockList, Dim, Pattern, Piece};
use pindown_uapi::{
    Access, Completion, Descriptor, ErrorDetail, Operation, Status, WorkRequest, WrFlags,
};

fn config() -> ContextConfig {
    ContextConfig {
        arena_bytes: 96 << 20,
        ..ContextConfig::default()
    }
}

/// The byte offsets (from the base) of a pattern's transfer, in stream
/// order: loops written out, no seeking (the model the device is checked
/// against).
fn model(pattern: &Pattern, lists: &dyn Fn(u64, u64) -> Vec<Block>) -> Vec<i64> {
    let mut stream = Vec::new();
    for repetition in 0..pattern.repeat {
        let origin = pattern.extent * repetition as i64;
        for piece in &pattern.pieces {
            match piece {
                Piece::Strided {
                    offset,
                    block,
                    dims,
                } => {
                    for k in 0..dims[2].count {
                        for j in 0..dims[1].count {
                            for i in 0..dims[0].count {
                                let at = origin
                                    + offset
                                    + i as i64 * dims[0].stride
                                    + j as i64 * dims[1].stride
                                    + k as i64 * dims[2].stride;
                                stream.extend((0..*block as i64).map(|b| at + b));
                            }
                        }
                    }
                }
                Piece::Indexed { offset, blocks } => {
                    let list = match blocks {
                        BlockList::Listed(list) => list.clone(),
                        BlockList::InMemory { iova, count } => lists(*iova, *count),
                    };
                    for block in list {
                        let at = origin + offset + block.offset;
                        stream.extend((0..block.len as i64).map(|b| at + b));
                    }
                }
            }
        }
    }
    stream[pattern.skip as usize..(pattern.skip + pattern.len) as usize].to_vec()
}

fn no_lists(_: u64, _: u64) -> Vec<Block> {
    unreachable!("no block list in memory")
}

/// Distinct bytes for a buffer of `len`, seeded.
fn bytes(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| ((i * 131 + i / 251) as u8) ^ seed)
        .collect()
}

struct Ports {
    device: DeviceProcess,
    initiator: Context,
    target: Context,
}

fn ports(args: &[&str]) -> Ports {
    let device = DeviceProcess::start(common::device_bin(), 3, args).unwrap();
    let initiator = Context::open(device.socket(0), config()).unwrap();
    let target = Context::open(device.socket(1), config()).unwrap();
    Ports {
        device,
        initiator,
        target,
    }
}

/// Posts `entries` (signaled) on a fresh queue pair and waits for one
/// completion each.
fn run_all(context: &Context, entries: &[Entry<'_>]) -> Vec<Completion> {
    let mut cq: CompletionQueue<'_> = context.create_completion_queue();
    let mut qp = context.create_queue_pair(&mut cq).unwrap();
    let signaled: Vec<Entry<'_>> = entries.iter().map(|e| e.signaled()).collect();
    qp.post(&signaled).unwrap();
    let mut done = Vec::new();
    while done.len() < entries.len() {
        done.extend(cq.wait(Duration::from_secs(20)).unwrap());
    }
    done
}

fn run(context: &Context, entry: Entry<'_>) -> Completion {
    run_all(context, &[entry]).remove(0)
}

/// One transfer between a local buffer of `local_len` and a remote one
/// of `remote_len` (the whole remote buffer is the window, with the
/// remote pattern's base at `remote_base`; the local base at
/// `local_base`), checked byte by byte on both sides.
struct Case {
    local_len: usize,
    local_base: u64,
    local: Pattern,
    remote_len: usize,
    remote_base: u64,
    remote: Pattern,
}

impl Case {
    fn check(&self, ports: &Ports, read: bool) {
        let Ports {
            initiator, target, ..
        } = ports;
        let near = initiator.alloc(self.local_len, 64).unwrap();
        let far = target.alloc(self.remote_len, 64).unwrap();
        let (near_before, far_before) = (bytes(self.local_len, 0x11), bytes(self.remote_len, 0x5a));
        near.write_at(0, &near_before);
        far.write_at(0, &far_before);
        let near_region = initiator.register_buffer(&near).unwrap();
        let far_region = target.register_buffer(&far).unwrap();
        let window = target
            .bind_window(
                &far_region,
                0,
                self.remote_len as u64,
                Access::REMOTE_READ | Access::REMOTE_WRITE,
            )
            .unwrap();
        let local = near_region
            .local(
                self.local_base,
                (self.local_len as u64 - self.local_base) as u32,
            )
            .unwrap();
        let remote = window.remote().at(self.remote_base);
        let vector = if read {
            Vector::read(local, self.local.clone(), remote, self.remote.clone())
        } else {
            Vector::write(local, self.local.clone(), remote, self.remote.clone())
        }
        .unwrap();
        let done = run(initiator, vector.build().user_data(3));
        assert_eq!(
            (done.status, done.detail, done.byte_len),
            (Status::Success, ErrorDetail::None, vector.len()),
            "{done:?}"
        );
        let near_offsets = model(&self.local, &no_lists);
        let far_offsets = model(&self.remote, &no_lists);
        assert_eq!(near_offsets.len(), far_offsets.len());
        let (mut near_expected, mut far_expected) = (near_before.clone(), far_before.clone());
        for (n, f) in near_offsets.iter().zip(&far_offsets) {
            let n = (self.local_base as i64 + n) as usize;
            let f = (self.remote_base as i64 + f) as usize;
            if read {
                near_expected[n] = far_before[f];
            } else {
                far_expected[f] = near_before[n];
            }
        }
        let (near_after, far_after) = (contents(&near), contents(&far));
        assert!(
            near_after == near_expected,
            "local memory differs from the model"
        );
        assert!(
            far_after == far_expected,
            "remote memory differs from the model"
        );
        assert!(
            near_before != near_after || far_before != far_after,
            "the transfer moved no byte"
        );
    }
}

fn strided(offset: i64, block: u64, dims: [(u64, i64); 3]) -> Piece {
    Piece::Strided {
        offset,
        block,
        dims: dims.map(|(count, stride)| Dim { count, stride }),
    }
}

#[test]
fn strided_patterns_of_different_shapes_write_and_read_every_byte() {
    let ports = ports(&[]);
    // A 3-level nest of 3-byte blocks (with a negative stride) against
    // 1-byte elements 5 apart, then against a 2-level nest of 7-byte
    // blocks.
    let nest = Pattern::new(
        vec![strided(4000, 3, [(5, 8), (4, -100), (3, 1000)])],
        2,
        5000,
    )
    .unwrap();
    assert_eq!(nest.len, 2 * 3 * 5 * 4 * 3);
    let bytes_apart = Pattern::new(vec![Piece::vector(1, 1, 360, 5)], 1, 0).unwrap();
    let sevens = Pattern::new(vec![strided(0, 7, [(6, 20), (9, 200), (1, 0)])], 1, 0)
        .unwrap()
        .clone();
    let mut sevens = sevens;
    sevens.skip = 3;
    sevens.len = 360;
    for read in [false, true] {
        Case {
            local_len: 12_000,
            local_base: 64,
            local: nest.clone(),
            remote_len: 4096,
            remote_base: 100,
            remote: bytes_apart.clone(),
        }
        .check(&ports, read);
        Case {
            local_len: 4096,
            local_base: 0,
            local: bytes_apart.clone(),
            remote_len: 12_000,
            remote_base: 500,
            remote: sevens.clone(),
        }
        .check(&ports, read);
    }
}

#[test]
fn a_column_of_doubles_and_records_of_two_pieces_move_in_many_steps() {
    let ports = ports(&[]);
    // 4096 x 1 column of doubles, rows of 1025: many steps of the walk.
    let rows = 4096u64;
    let row = 1025 * 8;
    let column = Pattern::new(vec![Piece::vector(0, 8, rows, row)], 1, 0).unwrap();
    for read in [false, true] {
        Case {
            local_len: (rows * 8) as usize,
            local_base: 0,
            local: Pattern::contiguous(rows * 8),
            remote_len: (rows * row as u64) as usize,
            remote_base: 16,
            remote: column.clone(),
        }
        .check(&ports, read);
    }
    // DIMMnet-2's table 2: 40-byte records as 32 + 8 bytes, into records
    // of 48 bytes laid out the other way round.
    let records = Pattern::new(
        vec![Piece::contiguous(0, 32), Piece::contiguous(32, 8)],
        1000,
        40,
    )
    .unwrap();
    let swapped = Pattern::new(
        vec![Piece::contiguous(16, 32), Piece::contiguous(4, 8)],
        1000,
        48,
    )
    .unwrap();
    for read in [false, true] {
        Case {
            local_len: 40_000,
            local_base: 0,
            local: records.clone(),
            remote_len: 48_100,
            remote_base: 0,
            remote: swapped.clone(),
        }
        .check(&ports, read);
    }
    // More than STEP_BYTES per side: 8 MiB in 64-byte blocks.
    let blocks = Pattern::new(vec![Piece::vector(0, 64, 1 << 17, 128)], 1, 0).unwrap();
    for read in [false, true] {
        Case {
            local_len: 8 << 20,
            local_base: 0,
            local: Pattern::contiguous(8 << 20),
            remote_len: 16 << 20,
            remote_base: 0,
            remote: blocks.clone(),
        }
        .check(&ports, read);
    }
}

#[test]
fn indexed_lists_inline_in_a_large_descriptor_and_in_memory() {
    let ports = ports(&[]);
    // A short list: the descriptor goes inline.
    let short: Vec<Block> = (0..10)
        .map(|i| Block {
            offset: (97 * i * i) as i64,
            len: 1 + i as u64 % 4,
        })
        .collect();
    let listed = Pattern::new(
        vec![Piece::Indexed {
            offset: 3,
            blocks: BlockList::Listed(short),
        }],
        1,
        0,
    )
    .unwrap();
    let len = listed.len;
    for read in [false, true] {
        Case {
            local_len: 256,
            local_base: 0,
            local: Pattern::contiguous(len),
            remote_len: 10_000,
            remote_base: 10,
            remote: listed.clone(),
        }
        .check(&ports, read);
    }
    // 4096 blocks listed: a 64 KiB descriptor, in the queue pair's memory.
    let many: Vec<Block> = (0..4096)
        .map(|i| Block {
            offset: ((i * 7919) % 4096 * 16) as i64,
            len: 8,
        })
        .collect();
    let scattered = Pattern::new(
        vec![Piece::Indexed {
            offset: 0,
            blocks: BlockList::Listed(many.clone()),
        }],
        1,
        0,
    )
    .unwrap();
    for read in [false, true] {
        Case {
            local_len: 4096 * 8,
            local_base: 0,
            local: Pattern::contiguous(4096 * 8),
            remote_len: 4096 * 16,
            remote_base: 0,
            remote: scattered.clone(),
        }
        .check(&ports, read);
    }

    // Lists in the initiator's memory, of 4096 blocks and of far more
    // (the device reads them into its own memory first).
    let Ports {
        initiator, target, ..
    } = &ports;
    for count in [4096usize, 200_000] {
        let blocks: Vec<Block> = (0..count)
            .map(|i| Block {
                offset: ((i * 7919) % count * 16) as i64,
                len: 8,
            })
            .collect();
        let list = initiator.alloc(count * 16, 64).unwrap();
        list.write_at(0, &encode_blocks(&blocks));
        let list_region = initiator.register_buffer(&list).unwrap();
        let source = initiator.alloc(count * 8, 64).unwrap();
        let data = bytes(count * 8, 0x33);
        source.write_at(0, &data);
        let source_region = initiator.register_buffer(&source).unwrap();
        let sink = target.alloc(count * 16, 64).unwrap();
        let sink_before = bytes(count * 16, 0x44);
        sink.write_at(0, &sink_before);
        let sink_region = target.register_buffer(&sink).unwrap();
        let window = target
            .bind_window(&sink_region, 0, (count * 16) as u64, Access::REMOTE_WRITE)
            .unwrap();
        let in_memory =
            Pattern::listed_in_memory(list_region.iova(), count as u64, (count * 8) as u64);
        let write = Vector::write(
            source_region.local(0, (count * 8) as u32).unwrap(),
            Pattern::contiguous((count * 8) as u64),
            window.remote().at(0),
            in_memory.clone(),
        )
        .unwrap();
        let done = run(initiator, write.build());
        assert!(done.is_success(), "{count} blocks: {done:?}");
        let mut expected = sink_before.clone();
        let lists = |_: u64, _: u64| blocks.clone();
        for (i, f) in model(&in_memory, &lists).iter().enumerate() {
            expected[*f as usize] = data[i];
        }
        assert!(contents(&sink) == expected, "{count} blocks");
    }
}

/// What a refused transfer leaves: both buffers as they were.
struct Untouched<'a> {
    buffers: Vec<(&'a DmaBuffer, Vec<u8>)>,
}

impl<'a> Untouched<'a> {
    fn new(buffers: &[&'a DmaBuffer]) -> Self {
        Untouched {
            buffers: buffers.iter().map(|b| (*b, contents(b))).collect(),
        }
    }

    fn check(&self, what: &str) {
        for (buffer, before) in &self.buffers {
            assert!(contents(buffer) == *before, "{what}: memory changed");
        }
    }
}

/// A refused request: its status and detail.
fn refused(done: &Completion) -> (Status, ErrorDetail) {
    assert!(!done.is_success(), "{done:?}");
    assert_eq!(done.byte_len, 0);
    (done.status, done.detail)
}

#[test]
fn refused_transfers_move_no_byte_and_the_device_keeps_serving() {
    let ports = ports(&["--max-pattern-blocks", "5000"]);
    let Ports {
        device,
        initiator,
        target,
    } = &ports;
    let near = initiator.alloc(64 << 10, 64).unwrap();
    near.write_at(0, &bytes(64 << 10, 1));
    let near_region = initiator.register_buffer(&near).unwrap();
    let far = target.alloc(128 << 10, 4096).unwrap();
    far.write_at(0, &bytes(128 << 10, 2));
    let far_region = target.register_buffer(&far).unwrap();
    // The window is the first 64 KiB of the buffer.
    let window = target
        .bind_window(
            &far_region,
            0,
            64 << 10,
            Access::REMOTE_READ | Access::REMOTE_WRITE,
        )
        .unwrap();
    let untouched = Untouched::new(&[&near, &far]);
    let local = near_region.local(0, 64 << 10).unwrap();
    let remote = window.remote().at(0);
    let rows = Pattern::new(vec![Piece::vector(0, 16, 100, 256)], 1, 0).unwrap();
    let refused_before = device.status().unwrap()[1].n("refused_out_of_bounds");

    // One element past the end of the window (the rest inside): not
    // granted, whichever way.
    let mut outside = rows.clone();
    outside.pieces.push(Piece::contiguous((64 << 10) - 8, 16));
    outside.len += 16;
    for read in [false, true] {
        let build = if read { Vector::read } else { Vector::write };
        let vector = build(
            local,
            Pattern::contiguous(outside.len),
            remote,
            outside.clone(),
        )
        .unwrap();
        assert_eq!(
            refused(&run(initiator, vector.build())),
            (Status::RemoteAccessError, ErrorDetail::NotGranted)
        );
        untouched.check("an element outside the window");
    }
    let counted = device.status().unwrap()[1].n("refused_out_of_bounds") - refused_before;
    assert_eq!(counted, 2, "each refusal is counted for the owner");

    // A local element in memory no region registers (a heap buffer).
    let heap = vec![7u8; 4096];
    let heap_offset = heap.as_ptr() as i64 - near_region.iova() as i64;
    let stray = Pattern::new(
        vec![
            Piece::contiguous(0, 100),
            Piece::Indexed {
                offset: heap_offset,
                blocks: BlockList::Listed(vec![Block { offset: 0, len: 60 }]),
            },
        ],
        1,
        0,
    )
    .unwrap();
    for read in [false, true] {
        let entry = {
            let vector = if read {
                Vector::read(
                    local,
                    Pattern::contiguous(160),
                    remote,
                    Pattern::contiguous(160),
                )
            } else {
                Vector::write(
                    local,
                    Pattern::contiguous(160),
                    remote,
                    Pattern::contiguous(160),
                )
            }
            .unwrap();
            let mut request = *vector.build().request();
            let descriptor = pindown_uapi::pattern::encode_pair(&stray, &Pattern::contiguous(160));
            set_descriptor_len(&mut request, descriptor.len() as u32);
            (request, descriptor)
        };
        // SAFETY: the request names the test's own buffers and a heap
        // buffer no region registers, which the device must refuse.
        let done = run(initiator, unsafe {
            Entry::from_raw(entry.0, Some(&entry.1))
        });
        assert_eq!(
            refused(&done),
            (Status::LocalProtectionError, ErrorDetail::Unregistered)
        );
        untouched.check("an unregistered local element");
    }
    assert!(heap.iter().all(|&b| b == 7));

    // Patterns of different lengths: the device refuses before a byte
    // moves (the driver would have refused to build it).
    let mismatch =
        pindown_uapi::pattern::encode_pair(&Pattern::contiguous(100), &Pattern::contiguous(99));
    for (len, what) in [(100, "remote shorter"), (99, "local longer")] {
        let request = raw(Operation::VectorWrite(pindown_uapi::VectorTransfer {
            local: near_region.iova(),
            len,
            remote,
            descriptor: Descriptor::Inline {
                len: mismatch.len() as u32,
            },
            notify: None,
        }));
        // SAFETY: the test's own registered buffers.
        let done = run(initiator, unsafe {
            Entry::from_raw(request, Some(&mismatch))
        });
        assert_eq!(
            refused(&done),
            (Status::InvalidRequest, ErrorDetail::LengthMismatch),
            "{what}"
        );
        untouched.check(what);
    }

    // Hostile descriptors.
    let good =
        pindown_uapi::pattern::encode_pair(&Pattern::contiguous(64), &Pattern::contiguous(64));
    let mut overflowing = Pattern::contiguous(64);
    overflowing.pieces = vec![strided(0, 1 << 20, [(1 << 30, 1), (1 << 30, 1), (1, 0)])];
    let huge_list = Pattern::listed_in_memory(near_region.iova(), 1 << 40, 64);
    let over_limit = Pattern::listed_in_memory(near_region.iova(), 5001, 64);
    let mut trailing = good.clone();
    trailing.extend_from_slice(&[0; 5]);
    // What, descriptor bytes, in memory at, expected answer.
    type Hostile = (&'static str, Vec<u8>, Option<u64>, (Status, ErrorDetail));
    let cases: Vec<Hostile> = vec![
        (
            "truncated",
            good[..good.len() - 3].to_vec(),
            None,
            (Status::InvalidRequest, ErrorDetail::Malformed),
        ),
        (
            "bytes after the patterns (the inline length lies)",
            trailing,
            None,
            (Status::InvalidRequest, ErrorDetail::Malformed),
        ),
        (
            "overflowing counts",
            pindown_uapi::pattern::encode_pair(&Pattern::contiguous(64), &overflowing),
            None,
            (Status::InvalidRequest, ErrorDetail::Malformed),
        ),
        (
            "a list of 2^40 blocks in memory",
            pindown_uapi::pattern::encode_pair(&Pattern::contiguous(64), &huge_list),
            None,
            (Status::LimitReached, ErrorDetail::PatternLimit),
        ),
        (
            "a list past --max-pattern-blocks",
            pindown_uapi::pattern::encode_pair(&Pattern::contiguous(64), &over_limit),
            None,
            (Status::LimitReached, ErrorDetail::PatternLimit),
        ),
        (
            "a descriptor in unregistered memory",
            good.clone(),
            Some(heap.as_ptr() as u64),
            (Status::LocalProtectionError, ErrorDetail::Unregistered),
        ),
    ];
    for (what, descriptor, iova, expected) in cases {
        let descriptor_field = match iova {
            Some(iova) => Descriptor::InMemory {
                iova,
                len: descriptor.len() as u32,
            },
            None => Descriptor::Inline {
                len: descriptor.len() as u32,
            },
        };
        let request = raw(Operation::VectorWrite(pindown_uapi::VectorTransfer {
            local: near_region.iova(),
            len: 64,
            remote,
            descriptor: descriptor_field,
            notify: None,
        }));
        let done = if iova.is_some() {
            // Posted as is: the driver leaves an in-memory descriptor
            // field alone when the entry carries no bytes.
            // SAFETY: the descriptor's memory is unregistered on purpose.
            run(initiator, unsafe { Entry::from_raw(request, None) })
        } else {
            // SAFETY: the test's own registered buffers.
            run(initiator, unsafe {
                Entry::from_raw(request, Some(&descriptor))
            })
        };
        assert_eq!(refused(&done), expected, "{what}");
        untouched.check(what);
    }

    // The device is up, this port and the others still move bytes.
    let other = Context::open(device.socket(2), config()).unwrap();
    let from = other.alloc(4096, 64).unwrap();
    from.write_at(0, &[9u8; 4096]);
    let from_region = other.register_buffer(&from).unwrap();
    let done = run(
        &other,
        Write::new(
            from_region.local(0, 4096).unwrap(),
            window.remote().at(4096),
        )
        .build(),
    );
    assert!(done.is_success(), "{done:?}");
    let mut landed = [0u8; 4096];
    far.read_at(4096, &mut landed);
    assert_eq!(landed, [9u8; 4096]);
    let vector = Vector::write(local, rows.clone(), remote, rows.clone()).unwrap();
    assert!(run(initiator, vector.build()).is_success());
}

/// A raw request (no flags, user data 0).
fn raw(op: Operation) -> WorkRequest {
    WorkRequest {
        user_data: 0,
        flags: WrFlags::empty(),
        op,
    }
}

fn set_descriptor_len(request: &mut WorkRequest, len: u32) {
    if let Operation::VectorWrite(vector) | Operation::VectorRead(vector) = &mut request.op {
        vector.descriptor = Descriptor::Inline { len };
    }
}

#[test]
fn the_target_learns_of_a_notifying_write_from_its_own_completion_queue() {
    let ports = ports(&[]);
    let Ports {
        initiator, target, ..
    } = &ports;
    let source = initiator.alloc(4096, 64).unwrap();
    source.write_at(0, &bytes(4096, 3));
    let source_region = initiator.register_buffer(&source).unwrap();
    let sink = target.alloc(8192, 64).unwrap();
    let sink_region = target.register_buffer(&sink).unwrap();
    let window = target
        .bind_window(&sink_region, 0, 8192, Access::REMOTE_WRITE)
        .unwrap();
    let local = source_region.local(0, 4096).unwrap();
    let spread = Pattern::new(vec![Piece::vector(0, 16, 256, 32)], 1, 0).unwrap();
    let write = Vector::write(
        local,
        Pattern::contiguous(4096),
        window.remote().at(0),
        spread.clone(),
    )
    .unwrap()
    .notify(0xfeed_0001);
    assert!(run(initiator, write.build()).is_success());
    let arrivals = target.wait_arrivals(Duration::from_secs(5)).unwrap();
    assert_eq!(arrivals.len(), 1, "{arrivals:?}");
    let arrival = arrivals[0];
    assert_eq!(arrival.peer, initiator.info().address());
    assert_eq!(arrival.key, window.remote().key);
    assert_eq!(arrival.bytes, 4096);
    assert_eq!(arrival.immediate, 0xfeed_0001);
    // The bytes are there when the arrival is.
    let landed = contents(&sink);
    let data = bytes(4096, 3);
    for (i, at) in model(&spread, &no_lists).iter().enumerate() {
        assert_eq!(landed[*at as usize], data[i]);
    }

    // Without the flag, or refused: no arrival. The admin queue still
    // serves the context's own requests in between.
    let quiet = Vector::write(
        local,
        Pattern::contiguous(4096),
        window.remote().at(0),
        spread.clone(),
    )
    .unwrap();
    assert!(run(initiator, quiet.build()).is_success());
    let outside = Vector::write(
        local,
        Pattern::contiguous(4096),
        window.remote().at(8000),
        spread.clone(),
    )
    .unwrap()
    .notify(2);
    assert_eq!(
        refused(&run(initiator, outside.build())),
        (Status::RemoteAccessError, ErrorDetail::NotGranted)
    );
    // A write of no bytes names a window too.
    let read_only = target
        .bind_window(&sink_region, 0, 8192, Access::REMOTE_READ)
        .unwrap();
    common::arrivals::empty_notifying_writes_are_checked(
        initiator,
        target,
        source_region.local(0, 0).unwrap(),
        window.remote(),
        read_only.remote(),
    );
    drop(read_only);
    // (A bind reaps the admin queue: arrivals are kept, not lost.)
    let extra = target
        .bind_window(&sink_region, 0, 64, Access::REMOTE_READ)
        .unwrap();
    drop(extra);
    assert!(target.arrivals().unwrap().is_empty());

    // Writes the target does not take arrivals of: once its port holds as
    // many as the device allows, the next fails before a byte moves, and
    // every write that succeeded has its arrival.
    let small = Vector::write(
        source_region.local(0, 8).unwrap(),
        Pattern::contiguous(8),
        window.remote().at(0),
        Pattern::contiguous(8),
    )
    .unwrap();
    common::arrivals::arrivals_are_bounded_and_none_is_dropped(initiator, target, &small);
}

#[test]
fn no_byte_of_a_long_vector_write_lands_after_the_window_is_revoked() {
    let ports = ports(&[]);
    let Ports {
        initiator, target, ..
    } = &ports;
    const SOURCE: usize = 16 << 20;
    const WINDOW: usize = 32 << 20;
    let source = initiator.alloc(SOURCE, 4096).unwrap();
    source.write_at(0, &vec![0xa5u8; SOURCE]);
    let source_region = initiator.register_buffer(&source).unwrap();
    let sink = target.alloc(WINDOW, 4096).unwrap();
    let sink_region = target.register_buffer(&sink).unwrap();
    let halves = Pattern::new(vec![Piece::vector(0, 4096, 4096, 8192)], 1, 0).unwrap();
    let write = Vector::write(
        source_region.local(0, SOURCE as u32).unwrap(),
        Pattern::contiguous(SOURCE as u64),
        pindown_uapi::RemoteAddress {
            node: 0,
            port: target.info().port,
            key: pindown_uapi::RemoteKey(0),
            offset: 0,
        },
        halves.clone(),
    )
    .unwrap();
    // A round cuts the write only if the revoke runs before the write's
    // last step: on a loaded two-core machine the spinning test thread may
    // not run until a write is over for many rounds in a row.
    let mut cut = 0;
    for _round in 0..100 {
        sink.write_at(0, &vec![0u8; WINDOW]);
        let window = target
            .bind_window(&sink_region, 0, WINDOW as u64, Access::REMOTE_WRITE)
            .unwrap();
        let mut request = *write.build().request();
        if let Operation::VectorWrite(vector) = &mut request.op {
            vector.remote = window.remote().at(0);
        }
        let descriptor = write.build().descriptor().unwrap().to_vec();
        let completion = std::thread::scope(|scope| {
            let writer = scope.spawn(|| {
                // SAFETY: the test's own registered buffers.
                run(initiator, unsafe {
                    Entry::from_raw(request, Some(&descriptor))
                })
            });
            let mut byte = [0u8];
            while byte[0] == 0 {
                sink.read_at(0, &mut byte);
                std::hint::spin_loop();
            }
            window.revoke().unwrap();
            // Revoked: the marker goes over the whole window.
            sink.write_at(0, &vec![0x11u8; WINDOW]);
            writer.join().unwrap()
        });
        let landed = contents(&sink);
        let overwritten = landed.iter().filter(|&&b| b != 0x11).count();
        assert_eq!(overwritten, 0, "bytes landed after the revoke returned");
        if !completion.is_success() {
            assert_eq!(
                refused(&completion),
                (Status::RemoteAccessError, ErrorDetail::NotGranted)
            );
            cut += 1;
            if cut >= 3 {
                break;
            }
        }
    }
    assert!(
        cut > 0,
        "no write was cut by the revoke: the test proves nothing"
    );
}

/// The doubles of `buffer`.
fn doubles(buffer: &DmaBuffer) -> Vec<f64> {
    contents(buffer)
        .chunks_exact(8)
        .map(|raw| f64::from_le_bytes(raw.try_into().unwrap()))
        .collect()
}

fn fill_doubles(buffer: &DmaBuffer, values: impl Iterator<Item = f64>) {
    let raw: Vec<u8> = values.flat_map(f64::to_le_bytes).collect();
    buffer.write_at(0, &raw);
}

#[test]
fn a_datatype_send_moves_a_subarray_into_a_column_and_back_with_no_pack() {
    use pindown_driver::datatype::{CacheConfig, Datatype, DescriptorCache, Order};
    let ports = ports(&[]);
    let Ports {
        initiator, target, ..
    } = &ports;
    // A 3 x 4 x 5 block at (2, 3, 4) of an 8 x 9 x 10 array of doubles
    // (C order) into every 7th double of the peer's buffer, and back into
    // 60 contiguous doubles.
    let (sizes, subsizes, starts) = ([8u64, 9, 10], [3u64, 4, 5], [2u64, 3, 4]);
    let block = Datatype::subarray(&sizes, &subsizes, &starts, Order::C, &Datatype::f64())
        .unwrap()
        .commit()
        .unwrap();
    let spaced = Datatype::vector(60, 1, 7, &Datatype::f64())
        .unwrap()
        .commit()
        .unwrap();
    let packed = Datatype::contiguous(60, &Datatype::f64())
        .unwrap()
        .commit()
        .unwrap();
    let array = initiator.alloc(8 * 9 * 10 * 8, 64).unwrap();
    let back = initiator.alloc(60 * 8, 64).unwrap();
    let peer = target.alloc(60 * 7 * 8, 64).unwrap();
    fill_doubles(&array, (0..720).map(f64::from));
    fill_doubles(&back, std::iter::repeat_n(-1.0, 60));
    fill_doubles(&peer, std::iter::repeat_n(-2.0, 420));
    let array_region = initiator.register_buffer(&array).unwrap();
    let back_region = initiator.register_buffer(&back).unwrap();
    let peer_region = target.register_buffer(&peer).unwrap();
    let window = target
        .bind_window(
            &peer_region,
            0,
            peer.len() as u64,
            Access::REMOTE_READ | Access::REMOTE_WRITE,
        )
        .unwrap();
    let mut cache = DescriptorCache::new(CacheConfig::default());
    let write = Vector::write_typed(
        &mut cache,
        array_region.local(0, array.len() as u32).unwrap(),
        (1, &block),
        window.remote().at(0),
        (1, &spaced),
    )
    .unwrap();
    let done = run(initiator, write.build());
    assert_eq!((done.status, done.byte_len), (Status::Success, 60 * 8));
    // The subarray in MPI's pack order: the last index varies fastest.
    let mut expected_packed = Vec::new();
    for a in 0..3 {
        for b in 0..4 {
            for c in 0..5 {
                let (i, j, k) = (starts[0] + a, starts[1] + b, starts[2] + c);
                expected_packed.push((i * 90 + j * 10 + k) as f64);
            }
        }
    }
    let mut expected_peer = vec![-2.0; 420];
    for (n, value) in expected_packed.iter().enumerate() {
        expected_peer[n * 7] = *value;
    }
    assert_eq!(doubles(&peer), expected_peer);
    let read = Vector::read_typed(
        &mut cache,
        back_region.local(0, back.len() as u32).unwrap(),
        (1, &packed),
        window.remote().at(0),
        (1, &spaced),
    )
    .unwrap();
    let done = run(initiator, read.build());
    assert_eq!((done.status, done.byte_len), (Status::Success, 60 * 8));
    assert_eq!(doubles(&back), expected_packed);
    assert_eq!(doubles(&array), (0..720).map(f64::from).collect::<Vec<_>>());
    // Three types compiled once each; the second use of `spaced` hit.
    let stats = cache.stats();
    assert_eq!((stats.lookups, stats.misses, stats.hits), (4, 3, 1));
}

#[test]
fn descriptors_in_memory_reuse_registered_buffers_and_move_the_right_bytes() {
    let ports = ports(&[]);
    let Ports {
        initiator, target, ..
    } = &ports;
    const LEN: usize = 1 << 16;
    let near = initiator.alloc(LEN, 64).unwrap();
    let far = target.alloc(LEN, 64).unwrap();
    let near_region = initiator.register_buffer(&near).unwrap();
    let far_region = target.register_buffer(&far).unwrap();
    let window = target
        .bind_window(&far_region, 0, LEN as u64, Access::REMOTE_WRITE)
        .unwrap();
    // Two listed patterns of 48 blocks each, at different places: their
    // descriptors (over MAX_INLINE) go in registered memory.
    let listed = |first: i64, step: i64| {
        let blocks = (0..48)
            .map(|i| Block {
                offset: first + i * step,
                len: 24,
            })
            .collect();
        Pattern::new(
            vec![Piece::Indexed {
                offset: 0,
                blocks: BlockList::Listed(blocks),
            }],
            1,
            0,
        )
        .unwrap()
    };
    // Four transfers in flight at once, each with its own pair of
    // patterns (disjoint sources, disjoint destinations).
    const IN_FLIGHT: usize = 4;
    let pairs: Vec<(Pattern, Pattern)> = (0..IN_FLIGHT as i64)
        .map(|k| (listed(k * 4096, 64), listed(16384 + k * 10000, 200)))
        .collect();
    assert!(
        pindown_uapi::pattern::encode_pair(&pairs[0].0, &pairs[0].1).len()
            > pindown_uapi::queue::MAX_INLINE as usize
    );
    let mut cq: CompletionQueue<'_> = initiator.create_completion_queue();
    let mut qp = initiator.create_queue_pair(&mut cq).unwrap();
    let mut registrations = None;
    for round in 0..100u64 {
        let data = bytes(LEN, round as u8);
        near.write_at(0, &data);
        // The pairs go in a different order each round, so a descriptor
        // buffer holds another pair's patterns from one round to the next.
        let order: Vec<usize> = (0..IN_FLIGHT)
            .map(|i| (i + round as usize) % IN_FLIGHT)
            .collect();
        let vectors: Vec<Vector<'_>> = order
            .iter()
            .map(|&k| {
                let (local, remote) = &pairs[k];
                Vector::write(
                    near_region.local(0, LEN as u32).unwrap(),
                    local.clone(),
                    window.remote().at(0),
                    remote.clone(),
                )
                .unwrap()
            })
            .collect();
        let entries: Vec<Entry<'_>> = vectors
            .iter()
            .zip(&order)
            .map(|(vector, &k)| vector.build().user_data(k as u64).signaled())
            .collect();
        // One post each: a buffer given back at the post, not at the
        // completion, would carry the next post's descriptor.
        for entry in &entries {
            qp.post(std::slice::from_ref(entry)).unwrap();
        }
        let mut done: Vec<Completion> = Vec::new();
        while done.len() < IN_FLIGHT {
            done.extend(cq.wait(Duration::from_secs(20)).unwrap());
        }
        let mut finished: Vec<(u64, Status)> =
            done.iter().map(|c| (c.user_data, c.status)).collect();
        finished.sort_unstable_by_key(|&(k, _)| k);
        let expected: Vec<(u64, Status)> = (0..IN_FLIGHT as u64)
            .map(|k| (k, Status::Success))
            .collect();
        assert_eq!(finished, expected, "round {round}");
        // Every block landed where its remote pattern says, from where
        // its local one says: a descriptor buffer reused while the device
        // still read it, or holding another pair's patterns, fails.
        let after = contents(&far);
        for (k, (local, remote)) in pairs.iter().enumerate() {
            let (from, to) = (model(local, &no_lists), model(remote, &no_lists));
            for (f, t) in from.iter().zip(&to) {
                assert_eq!(
                    after[*t as usize], data[*f as usize],
                    "round {round}, pair {k}"
                );
            }
        }
        if round == 4 {
            let stats = initiator.registration_stats();
            registrations = Some(stats.hits + stats.misses);
        }
    }
    // Once warm, posting registered nothing more.
    let stats = initiator.registration_stats();
    assert_eq!(Some(stats.hits + stats.misses), registrations);
}
