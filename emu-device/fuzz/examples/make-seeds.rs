//! Writes the seed corpora of `vhost_user_message` and `vhost_user_handler`
//! into `corpus/`: the messages a well-behaved frontend (QEMU, the pindown
//! driver) sends, in the input format of `src/lib.rs`. Each single message
//! is a seed of the parser; the whole handshake, and a few variations of
//! it, are seeds of the handler. The seeds of `fabric_endpoint` are
//! exchanges of each kind of fabric message between two endpoints, over a
//! clean wire and over one that loses, duplicates and reorders (the input
//! format of `src/fabric.rs`).
//!
//! Run from `emu-device/fuzz`: `cargo run --example make-seeds`.

use std::path::Path;
use std::sync::atomic::Ordering;

use arbitrary::Unstructured;
use pindown_emu_device::vhost_user::conn::RawMessage;
use pindown_emu_device::vhost_user::handler;
use pindown_emu_device::vhost_user::message::Header;

use pindown_emu_device::internode::message::{Message as FabricMessage, Origin, PartNotice};
use pindown_emu_device::port::features;
use pindown_emu_device::testing::payload;
use pindown_emu_device_fuzz::fabric::{Op, World, NODE_A, NODE_B};
use pindown_emu_device_fuzz::{
    mem_table_payload, next_message, port_with_memory, write_message, FdKind, MEM_GPA, MEM_SIZE,
    MEM_UADDR,
};
use pindown_uapi::pattern::{Pattern, Piece};
use pindown_uapi::{ErrorDetail, RemoteAddress, RemoteKey, Status};
use pindown_uapi::{IotlbMessage, VhostIotlbType};
use vhost::vhost_user::message::{FrontendReq, VhostUserProtocolFeatures};

/// IOVA of the memory with ACCESS_PLATFORM.
const IOVA: u64 = 0x4000_0000;

fn u64_payload(v: u64) -> Vec<u8> {
    v.to_le_bytes().to_vec()
}

fn iotlb(kind: VhostIotlbType, iova: u64, size: u64, uaddr: u64) -> Vec<u8> {
    IotlbMessage {
        iova,
        size,
        uaddr,
        perm: 3,
        msg_type: kind as u8,
    }
    .encode()
    .to_vec()
}

/// A GET_CONFIG payload asking for `size` bytes from offset 0.
fn get_config(size: u32) -> Vec<u8> {
    let mut p = [0u32, size, 0].map(u32::to_le_bytes).concat();
    p.resize(12 + size as usize, 0);
    p
}

/// One message: request, whether a reply is asked for, payload, files.
type Msg = (FrontendReq, bool, Vec<u8>, Vec<FdKind>);

/// Ring `index` set up at `base` (an IOVA with ACCESS_PLATFORM, else a
/// frontend address), 16 entries, started and enabled.
fn ring(index: u32, base: u64) -> Vec<Msg> {
    vec![
        (
            FrontendReq::SET_VRING_NUM,
            true,
            payload::vring_state(index, 16),
            vec![],
        ),
        (
            FrontendReq::SET_VRING_ADDR,
            true,
            payload::vring_addr(index, 0, base, base + 0x2000, base + 0x1000),
            vec![],
        ),
        (
            FrontendReq::SET_VRING_BASE,
            true,
            payload::vring_state(index, 0),
            vec![],
        ),
        (
            FrontendReq::SET_VRING_CALL,
            true,
            u64_payload(index.into()),
            vec![FdKind::EventFd],
        ),
        (
            FrontendReq::SET_VRING_KICK,
            true,
            u64_payload(index.into()),
            vec![FdKind::EventFd],
        ),
        (
            FrontendReq::SET_VRING_ENABLE,
            true,
            payload::vring_state(index, 1),
            vec![],
        ),
    ]
}

fn handshake(iommu: bool) -> Vec<Msg> {
    let mut f = features::VERSION_1 | features::PROTOCOL_FEATURES;
    if iommu {
        f |= features::ACCESS_PLATFORM;
    }
    let mut msgs: Vec<Msg> = vec![
        (FrontendReq::SET_OWNER, false, vec![], vec![]),
        (FrontendReq::GET_FEATURES, false, vec![], vec![]),
        (FrontendReq::SET_FEATURES, false, u64_payload(f), vec![]),
        (FrontendReq::GET_PROTOCOL_FEATURES, false, vec![], vec![]),
        (
            FrontendReq::SET_PROTOCOL_FEATURES,
            false,
            u64_payload(
                (VhostUserProtocolFeatures::MQ
                    | VhostUserProtocolFeatures::REPLY_ACK
                    | VhostUserProtocolFeatures::BACKEND_REQ)
                    .bits(),
            ),
            vec![],
        ),
        (FrontendReq::GET_QUEUE_NUM, false, vec![], vec![]),
        (
            FrontendReq::SET_BACKEND_REQ_FD,
            true,
            vec![],
            vec![FdKind::ConnectedSocket],
        ),
        (
            FrontendReq::SET_MEM_TABLE,
            true,
            mem_table_payload(&[(MEM_GPA, MEM_SIZE, MEM_UADDR, 0)]),
            vec![FdKind::Memfd],
        ),
    ];
    if iommu {
        msgs.push((
            FrontendReq::IOTLB_MSG,
            true,
            iotlb(VhostIotlbType::Update, IOVA, MEM_SIZE, MEM_UADDR),
            vec![],
        ));
    }
    let base = if iommu { IOVA } else { MEM_UADDR };
    msgs.extend(ring(0, base));
    msgs.extend(ring(4, base + 0x4000));
    msgs.extend(ring(5, base + 0x8000));
    msgs
}

fn write(dir: &Path, name: &str, msgs: &[Msg]) -> std::io::Result<()> {
    let mut out = Vec::new();
    for (req, reply, payload, files) in msgs {
        write_message(&mut out, *req, *reply, payload, files);
    }
    std::fs::write(dir.join(name), out)
}

fn main() -> std::io::Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    let handler = root.join("vhost_user_handler");
    let parser = root.join("vhost_user_message");
    std::fs::create_dir_all(&handler)?;
    std::fs::create_dir_all(&parser)?;

    let plain = handshake(false);
    let iommu = handshake(true);
    write(&handler, "handshake", &plain)?;
    write(&handler, "handshake-iommu", &iommu)?;
    let mut teardown = iommu.clone();
    teardown.extend([
        (
            FrontendReq::IOTLB_MSG,
            true,
            iotlb(VhostIotlbType::Invalidate, IOVA, 0x1000, 0),
            vec![],
        ),
        (FrontendReq::GET_CONFIG, false, get_config(12), vec![]),
        (
            FrontendReq::GET_VRING_BASE,
            false,
            payload::vring_state(4, 0),
            vec![],
        ),
        (
            FrontendReq::SET_VRING_ENABLE,
            true,
            payload::vring_state(5, 0),
            vec![],
        ),
        (FrontendReq::RESET_OWNER, true, vec![], vec![]),
    ]);
    write(&handler, "handshake-iommu-teardown", &teardown)?;

    let mut seen = Vec::new();
    for m in teardown.iter().chain(&plain) {
        let mut bytes = Vec::new();
        write_message(&mut bytes, m.0, m.1, &m.2, &m.3);
        if !seen.contains(&bytes) {
            std::fs::write(parser.join(format!("{:02}-{:?}", seen.len(), m.0)), &bytes)?;
            seen.push(bytes);
        }
    }

    // The handler seeds are valid: every request is accepted.
    for seed in std::fs::read_dir(&handler)? {
        let bytes = std::fs::read(seed?.path())?;
        replay_accepted(&bytes);
    }
    fabric_seeds(&root.join("fabric_endpoint"))
}

/// One message of each kind the fabric's nodes exchange.
fn fabric_messages() -> Vec<Vec<u8>> {
    let origin = Origin {
        node: NODE_A,
        port: 0,
        incarnation: 7,
        tag: 0x51,
    };
    let key = RemoteKey(0x1234_5678_9abc_def1);
    let vector_part = Pattern::new(vec![Piece::vector(0, 8, 2, 64)], 1, 0)
        .expect("a valid pattern")
        .encode();
    let messages = [
        FabricMessage::Write {
            origin,
            dst_port: 1,
            key,
            offset: 64,
            bytes: b"sixteen bytes!!!",
        },
        FabricMessage::Read {
            origin,
            dst_port: 1,
            key,
            offset: 0,
            len: 4096,
        },
        FabricMessage::ReadData {
            tag: 0x51,
            at: 1024,
            bytes: &[0xa5; 32],
        },
        FabricMessage::Copy {
            origin,
            dst_port: 0,
            key,
            offset: 8,
            destination: RemoteAddress {
                node: NODE_B,
                port: 2,
                key,
                offset: 128,
            },
            len: 256,
        },
        FabricMessage::Result {
            tag: 0x51,
            status: Status::Success,
            detail: ErrorDetail::None,
            value: 42,
        },
        // The last part of a vector write that asked for an arrival
        // notice: two 8-byte blocks 64 apart.
        FabricMessage::VectorWrite {
            origin,
            dst_port: 1,
            key,
            offset: 0,
            pattern: &vector_part,
            bytes: &[0x3c; 16],
            notice: Some(PartNotice {
                immediate: 0xfeed,
                total: 4096,
            }),
        },
        // The check of an ATOMIC_TO's destination on a third node.
        FabricMessage::Check {
            origin,
            dst_port: 1,
            key,
            offset: 4088,
            len: 8,
        },
    ];
    messages
        .iter()
        .map(|m| {
            let mut out = Vec::new();
            m.encode(&mut out);
            out
        })
        .collect()
}

/// Writes the `fabric_endpoint` seeds into `dir` and runs each.
fn fabric_seeds(dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let messages = fabric_messages();
    let clean: Vec<Op> = messages
        .iter()
        .flat_map(|m| {
            [
                Op::ARequest(m.clone()),
                Op::BRequest(m.clone()),
                Op::Transmit,
                Op::Deliver,
                Op::Deliver,
                Op::Transmit,
                Op::Deliver,
                Op::Deliver,
                Op::BReply(m.clone()),
                Op::Advance {
                    micros: 50,
                    scale: 0,
                },
                Op::Transmit,
                Op::Deliver,
            ]
        })
        .collect();
    let mut rough = clean.clone();
    for (i, op) in [Op::Drop, Op::Duplicate, Op::Reorder]
        .into_iter()
        .enumerate()
    {
        rough.insert(3 + 5 * i, op);
    }
    rough.extend([
        Op::Advance {
            micros: 2000,
            scale: 0,
        },
        Op::Transmit,
        Op::Deliver,
        Op::RestartB,
        Op::BRequest(messages[0].clone()),
        Op::AReply(messages[4].clone()),
        Op::Transmit,
        Op::Deliver,
        Op::Settle,
    ]);
    // The lossy exchange again, with sequence numbers that wrap around
    // 2^32 halfway.
    let mut wrapping = vec![Op::StartSequences {
        a_to_b: u32::MAX - 3,
        b_to_a: u32::MAX - 5,
    }];
    wrapping.extend(rough.iter().cloned());
    // Both sides restart, one after the other, with messages under way.
    let mut restarts = clean.clone();
    restarts.extend([
        Op::ARequest(messages[1].clone()),
        Op::Transmit,
        Op::RestartA,
        Op::Deliver,
        Op::ARequest(messages[2].clone()),
        Op::BRequest(messages[3].clone()),
        Op::Transmit,
        Op::Deliver,
        Op::Deliver,
        Op::RestartB,
        Op::Settle,
        Op::ARequest(messages[0].clone()),
        Op::Settle,
    ]);
    for (name, ops) in [
        ("clean-wire", clean),
        ("lossy-wire", rough),
        ("wrapping-sequences", wrapping),
        ("restarts", restarts),
    ] {
        let mut bytes = Vec::new();
        for op in &ops {
            op.encode(&mut bytes);
        }
        World::run(&bytes);
        std::fs::write(dir.join(name), bytes)?;
    }
    Ok(())
}

/// Applies a seed to a fresh port; panics unless every request succeeds.
fn replay_accepted(bytes: &[u8]) {
    let mut u = Unstructured::new(bytes);
    let (mut state, stats) = port_with_memory();
    while let Ok(msg) = next_message(&mut u) {
        let header = Header::decode(&msg.header).expect("a valid header");
        let raw = RawMessage {
            header,
            payload: msg.payload,
            files: msg.files,
        };
        handler::handle(&mut state, &stats, raw).expect("a well-formed request");
    }
    assert_eq!(stats.errors.load(Ordering::Relaxed), 0, "a request failed");
}
