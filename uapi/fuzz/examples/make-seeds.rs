//! Writes the seed corpus of `uapi_decode` into `corpus/uapi_decode/`: one
//! valid encoding of every operation and of completions, as the driver and
//! the device produce them (bare and as stamped queue slots), behind the
//! target's selector byte.
//!
//! Run from `uapi/fuzz`: `cargo run --example make-seeds`.

use std::path::Path;

use pindown_uapi::queue;
use pindown_uapi::{
    Access, AtomicWidth, Completion, DeviceInfo, ErrorDetail, Opcode, Operation, RemoteAddress,
    RemoteKey, Status, WorkRequest, WrFlags, ABI_VERSION, RDMA_FEATURES,
};

fn main() -> std::io::Result<()> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus/uapi_decode");
    std::fs::create_dir_all(&dir)?;
    let remote = RemoteAddress {
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
    };
    let mut seed = vec![3u8];
    seed.extend_from_slice(&info.to_value().to_le_bytes());
    std::fs::write(dir.join("device-info"), seed)?;
    Ok(())
}
