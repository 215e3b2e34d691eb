//! Writes the seed corpus of `uapi_decode` into `corpus/uapi_decode/`: one
//! valid encoding of every operation and of completions, as the driver and
//! the device produce them (bare and as stamped queue slots), and vector
//! transfer descriptors, behind the target's selector byte.
//!
//! Run from `uapi/fuzz`: `cargo run --example make-seeds`.

use std::path::Path;

use pindown_uapi::pattern::{encode_blocks, encode_pair, Block, BlockList, Dim, Pattern, Piece};
use pindown_uapi::queue;
use pindown_uapi::{
    Access, Arrival, AtomicWidth, Completion, Descriptor, DeviceInfo, ErrorDetail, Opcode,
    Operation, PortAddress, RemoteAddress, RemoteKey, Status, VectorTransfer, WorkRequest, WrFlags,
    ABI_VERSION, RDMA_FEATURES,
};

fn main() -> std::io::Result<()> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus/uapi_decode");
    std::fs::create_dir_all(&dir)?;
    let remote = RemoteAddress {
        node: 0,
        port: 1,
        key: RemoteKey(0x1234_5678),
        offset: 0x40,
    };
    let ops = [
        Operation::Nop,
        Operation::Write {
            local: 0x4000_0000,
            len: 4096,
            remote,
        },
        Operation::WriteInline {
            len: 8,
            head: *b"inline!\0\0\0\0\0\0\0\0\0",
            remote,
        },
        Operation::Read {
            local: 0x4000_1000,
            len: 8,
            remote,
        },
        Operation::CompareSwap {
            remote,
            width: AtomicWidth::Eight,
            compare: 1,
            swap: 2,
        },
        Operation::FetchAdd {
            remote,
            width: AtomicWidth::Four,
            add: 3,
        },
        Operation::Swap {
            remote,
            width: AtomicWidth::Eight,
            value: 4,
        },
        Operation::BindWindow {
            start: 0x4000_0000,
            len: 65536,
            access: Access::REMOTE_READ | Access::REMOTE_WRITE,
            peer: None,
        },
        Operation::RevokeWindow {
            key: RemoteKey(0x1234_5678),
        },
        Operation::Query,
        Operation::VectorWrite(VectorTransfer {
            local: 0x4000_0000,
            len: 4096,
            remote,
            descriptor: Descriptor::Inline { len: 224 },
            notify: Some(77),
        }),
        Operation::VectorRead(VectorTransfer {
            local: 0x4000_0000,
            len: 4096,
            remote,
            descriptor: Descriptor::InMemory {
                iova: 0x4000_8000,
                len: 1024,
            },
            notify: None,
        }),
    ];
    for (i, op) in ops.into_iter().enumerate() {
        let wr = WorkRequest {
            user_data: 0x100 + i as u64,
            flags: WrFlags::SIGNALED,
            op,
        };
        let mut seed = vec![0u8];
        seed.extend_from_slice(&wr.encode());
        std::fs::write(dir.join(format!("wr-{:?}", op.opcode())), seed)?;
        let mut slot = vec![4u8];
        slot.extend_from_slice(&queue::request_slot(&wr, 0x7fff + i as u16));
        std::fs::write(dir.join(format!("slot-{:?}", op.opcode())), slot)?;
    }
    let completions = [
        Completion::success(7, Opcode::Write, 4096, 0),
        Completion::error(
            8,
            Some(Opcode::Read),
            Status::RemoteAccessError,
            ErrorDetail::None,
        ),
        Completion::error(9, None, Status::InvalidRequest, ErrorDetail::None),
        Completion::arrival_notice(Arrival {
            peer: PortAddress { node: 1, port: 2 },
            key: RemoteKey(0x1234_5678),
            bytes: 4096,
            immediate: 77,
        }),
    ];
    for (i, c) in completions.into_iter().enumerate() {
        let mut seed = vec![1u8];
        seed.extend_from_slice(&c.encode());
        std::fs::write(dir.join(format!("completion-{i}")), seed)?;
        let mut slot = vec![5u8];
        slot.extend_from_slice(&queue::completion_slot(&c, i as u16));
        std::fs::write(dir.join(format!("completion-slot-{i}")), slot)?;
    }
    std::fs::write(dir.join("opcode"), [2u8, Opcode::BindWindow as u8])?;
    let info = DeviceInfo {
        port: 3,
        abi_version: ABI_VERSION,
        features: RDMA_FEATURES,
        rdma_queue_pairs: 8,
        node: 0,
    };
    let mut seed = vec![3u8];
    seed.extend_from_slice(&info.to_query().1.to_le_bytes());
    std::fs::write(dir.join("device-info"), seed)?;
    // Descriptors: a column against contiguous bytes, a 3-level nest
    // against records of two pieces, a listed list against one in memory
    // (the list's bytes follow the descriptor).
    let column = Pattern::new(vec![Piece::vector(0, 8, 4096, 4097 * 8)], 1, 0).unwrap();
    let nest = Pattern::new(
        vec![Piece::Strided {
            offset: 16,
            block: 4,
            dims: [
                Dim {
                    count: 4,
                    stride: 8,
                },
                Dim {
                    count: 3,
                    stride: -100,
                },
                Dim {
                    count: 2,
                    stride: 1000,
                },
            ],
        }],
        2,
        4000,
    )
    .unwrap();
    let records = Pattern::new(
        vec![Piece::contiguous(0, 32), Piece::contiguous(32, 8)],
        4,
        40,
    )
    .unwrap();
    let blocks = vec![Block { offset: 64, len: 8 }, Block { offset: 0, len: 16 }];
    let listed = Pattern::new(
        vec![Piece::Indexed {
            offset: 8,
            blocks: BlockList::Listed(blocks.clone()),
        }],
        3,
        128,
    )
    .unwrap();
    let mut in_memory = listed.clone();
    in_memory.pieces = vec![Piece::Indexed {
        offset: 8,
        blocks: BlockList::InMemory { iova: 0, count: 2 },
    }];
    let pairs = [
        (column.clone(), Pattern::contiguous(column.len)),
        (nest.clone(), {
            let mut sliced = records.clone();
            sliced.len = nest.len.min(records.len);
            sliced
        }),
        (listed.clone(), in_memory),
    ];
    for (i, (local, remote)) in pairs.iter().enumerate() {
        let descriptor = encode_pair(local, remote);
        let mut seed = vec![6u8];
        seed.extend_from_slice(&(descriptor.len() as u16).to_le_bytes());
        seed.extend_from_slice(&descriptor);
        seed.extend_from_slice(&encode_blocks(&blocks));
        std::fs::write(dir.join(format!("pattern-pair-{i}")), seed)?;
    }
    Ok(())
}
