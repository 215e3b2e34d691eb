//! Round trips and hostile bytes.

use pindown_uapi::queue::MAX_INLINE;
use pindown_uapi::{
    Access, AtomicOp, AtomicWidth, Bitwise, Completion, DecodeError, ErrorDetail, Opcode,
    Operation, PortAddress, RemoteAddress, RemoteKey, Status, WindowFlags, WorkRequest, WrFlags,
    ATOMIC_TO_FOUR, MAX_REMOTE_OFFSET,
};
use proptest::prelude::*;

fn remote() -> impl Strategy<Value = RemoteAddress> {
    (
        any::<u16>(),
        any::<u16>(),
        any::<u64>(),
        0..=MAX_REMOTE_OFFSET,
    )
        .prop_map(|(node, port, key, offset)| RemoteAddress {
            node,
            port,
            key: RemoteKey(key),
            offset,
        })
}

fn width() -> impl Strategy<Value = AtomicWidth> {
    prop_oneof![Just(AtomicWidth::Four), Just(AtomicWidth::Eight)]
}

fn operand(width: AtomicWidth) -> impl Strategy<Value = u64> {
    match width {
        AtomicWidth::Four => (0..=u64::from(u32::MAX)).boxed(),
        AtomicWidth::Eight => any::<u64>().boxed(),
    }
}

fn operation() -> impl Strategy<Value = Operation> {
    prop_oneof![
        Just(Operation::Nop),
        Just(Operation::Query),
        (any::<u64>(), any::<u32>(), remote()).prop_map(|(local, len, remote)| Operation::Write {
            local,
            len,
            remote
        }),
        (0u32..=MAX_INLINE, any::<[u8; 16]>(), remote()).prop_map(|(len, bytes, remote)| {
            let mut head = [0u8; 16];
            let carried = (len as usize).min(16);
            head[..carried].copy_from_slice(&bytes[..carried]);
            Operation::WriteInline { len, head, remote }
        }),
        (any::<u64>(), any::<u32>(), remote()).prop_map(|(local, len, remote)| Operation::Read {
            local,
            len,
            remote
        }),
        (remote(), width()).prop_flat_map(|(remote, width)| (operand(width), operand(width))
            .prop_map(move |(compare, swap)| Operation::CompareSwap {
                remote,
                width,
                compare,
                swap
            })),
        (remote(), width()).prop_flat_map(|(remote, width)| operand(width)
            .prop_map(move |add| Operation::FetchAdd { remote, width, add })),
        (remote(), width()).prop_flat_map(|(remote, width)| operand(width).prop_map(
            move |value| Operation::Swap {
                remote,
                width,
                value
            }
        )),
        (
            0u64..1 << 62,
            1u64..1 << 40,
            1u32..8,
            proptest::option::of((any::<u16>(), any::<u16>()))
        )
            .prop_map(|(start, len, access, peer)| {
                Operation::BindWindow {
                    start,
                    len,
                    access: Access::from_bits_truncate(access),
                    peer: peer.map(|(node, port)| PortAddress { node, port }),
                }
            }),
        (
            remote(),
            width(),
            prop_oneof![Just(Bitwise::And), Just(Bitwise::Or), Just(Bitwise::Xor)]
        )
            .prop_flat_map(|(remote, width, op)| operand(width).prop_map(move |mask| {
                Operation::FetchBitwise {
                    remote,
                    width,
                    op,
                    mask,
                }
            })),
        (remote(), width(), 0u8..6, remote(), 0u16..ATOMIC_TO_FOUR).prop_flat_map(
            |(word, width, code, destination, port)| {
                (operand(width), operand(width)).prop_map(move |(first, second)| {
                    let op = match code {
                        0 => AtomicOp::CompareSwap {
                            compare: first,
                            swap: second,
                        },
                        1 => AtomicOp::FetchAdd { add: first },
                        2 => AtomicOp::Swap { value: first },
                        3 => AtomicOp::Bitwise {
                            op: Bitwise::And,
                            mask: first,
                        },
                        4 => AtomicOp::Bitwise {
                            op: Bitwise::Or,
                            mask: first,
                        },
                        _ => AtomicOp::Bitwise {
                            op: Bitwise::Xor,
                            mask: first,
                        },
                    };
                    Operation::AtomicTo {
                        word,
                        width,
                        op,
                        destination: RemoteAddress {
                            port,
                            ..destination
                        },
                    }
                })
            }
        ),
        (remote(), remote(), any::<u32>()).prop_map(|(source, destination, len)| {
            Operation::Copy {
                source,
                destination,
                len,
            }
        }),
        any::<u64>().prop_map(|key| Operation::RevokeWindow {
            key: RemoteKey(key)
        }),
    ]
}

fn request() -> impl Strategy<Value = WorkRequest> {
    (any::<u64>(), 0u8..4, operation()).prop_map(|(user_data, flags, op)| WorkRequest {
        user_data,
        flags: WrFlags::from_bits_truncate(flags),
        op,
    })
}

proptest! {
    #[test]
    fn requests_round_trip(request in request()) {
        prop_assert_eq!(WorkRequest::decode(&request.encode()), Ok(request));
    }

    #[test]
    fn random_bytes_never_panic_and_accepted_ones_re_encode(bytes in prop::collection::vec(any::<u8>(), 0..80)) {
        if let Ok(request) = WorkRequest::decode(&bytes) {
            prop_assert_eq!(&request.encode()[..], &bytes[..WorkRequest::SIZE]);
        }
        if let Ok(completion) = Completion::decode(&bytes) {
            prop_assert_eq!(&completion.encode()[..], &bytes[..Completion::SIZE]);
        }
    }

    #[test]
    fn mutated_valid_requests_never_panic(request in request(), at in 0usize..64, byte in any::<u8>()) {
        let mut bytes = request.encode();
        bytes[at] = byte;
        if let Ok(decoded) = WorkRequest::decode(&bytes) {
            prop_assert_eq!(decoded.encode(), bytes);
        }
    }

    #[test]
    fn completions_round_trip(user_data in any::<u64>(), len in any::<u32>(), value in any::<u64>()) {
        let completion = Completion::success(user_data, Opcode::FetchAdd, len, value);
        prop_assert_eq!(Completion::decode(&completion.encode()), Ok(completion));
        let failed = Completion::error(user_data, None, Status::InvalidRequest, ErrorDetail::Malformed);
        prop_assert_eq!(Completion::decode(&failed.encode()), Ok(failed));
    }
}

#[test]
fn the_layout_is_fixed_little_endian() {
    let request = WorkRequest {
        user_data: 0x1122_3344_5566_7788,
        flags: WrFlags::SIGNALED,
        op: Operation::Write {
            local: 0xAAAA_0000,
            len: 7,
            remote: RemoteAddress {
                node: 0x0A0B,
                port: 3,
                key: RemoteKey(0x0102_0304_0506_0708),
                offset: 9,
            },
        },
    };
    let bytes = request.encode();
    assert_eq!(&bytes[24..32], &[9, 0, 0, 0, 0, 0, 0x0B, 0x0A]);
    assert_eq!(bytes[0], Opcode::Write as u8);
    assert_eq!(bytes[1], 1);
    assert_eq!(&bytes[2..4], &[3, 0]);
    assert_eq!(&bytes[4..8], &[7, 0, 0, 0]);
    assert_eq!(&bytes[8..16], &0x1122_3344_5566_7788u64.to_le_bytes());
    assert_eq!(&bytes[32..40], &[8, 7, 6, 5, 4, 3, 2, 1]);
}

#[test]
fn a_window_bound_to_a_peer_names_it_and_an_open_one_names_none() {
    let bind = |peer| WorkRequest {
        user_data: 5,
        flags: WrFlags::SIGNALED,
        op: Operation::BindWindow {
            start: 0x1000,
            len: 0x2000,
            access: Access::REMOTE_WRITE | Access::REMOTE_READ,
            peer,
        },
    };
    let port = |node, port| Some(PortAddress { node, port });
    let bound = bind(port(0, 0)).encode();
    assert_eq!(&bound[2..4], &[0, 0], "port 0 is a valid peer");
    assert_eq!(bound[60], WindowFlags::PEER.bits());
    assert_eq!(&bound[56..60], &[3, 0, 0, 0]);
    assert_eq!(WorkRequest::decode(&bound), Ok(bind(port(0, 0))));
    let seven = bind(port(2, 7)).encode();
    assert_eq!((&seven[2..4], &seven[30..32]), (&[7, 0][..], &[2, 0][..]));
    assert_eq!(WorkRequest::decode(&seven), Ok(bind(port(2, 7))));
    let open = bind(None).encode();
    assert_eq!((open[60], &open[2..4]), (0, &[0u8, 0][..]));
    // A port without the flag is not a binding: refused, not ignored.
    let mut stray = open;
    stray[2] = 7;
    assert_eq!(
        WorkRequest::decode(&stray),
        Err(DecodeError::ReservedNotZero { offset: 2 })
    );
    let mut unknown = bound;
    unknown[60] = 0x80;
    assert_eq!(
        WorkRequest::decode(&unknown),
        Err(DecodeError::UnknownWindowFlags(0x80))
    );
}

#[test]
fn invalid_fields_are_named() {
    let valid = WorkRequest {
        user_data: 1,
        flags: WrFlags::empty(),
        op: Operation::FetchAdd {
            remote: RemoteAddress {
                node: 0,
                port: 0,
                key: RemoteKey(1),
                offset: 8,
            },
            width: AtomicWidth::Eight,
            add: 1,
        },
    }
    .encode();
    let mut bad = valid;
    bad[56] = 3;
    assert_eq!(
        WorkRequest::decode(&bad),
        Err(DecodeError::BadAtomicWidth(3))
    );
    let mut bad = valid;
    bad[48] = 1;
    assert_eq!(
        WorkRequest::decode(&bad),
        Err(DecodeError::ReservedNotZero { offset: 48 })
    );
    let mut bad = valid;
    bad[0] = 0x12;
    assert_eq!(
        WorkRequest::decode(&bad),
        Err(DecodeError::Reserved("vector transfer"))
    );
    let mut bad = valid;
    bad[0] = 0x99;
    assert_eq!(
        WorkRequest::decode(&bad),
        Err(DecodeError::UnknownOpcode(0x99))
    );
    let mut bad = valid;
    bad[1] = 0x40;
    assert_eq!(
        WorkRequest::decode(&bad),
        Err(DecodeError::UnknownFlags(0x40))
    );
    assert_eq!(
        WorkRequest::decode(&valid[..10]),
        Err(DecodeError::Truncated {
            needed: 64,
            got: 10
        })
    );
    let four = WorkRequest {
        user_data: 1,
        flags: WrFlags::empty(),
        op: Operation::Swap {
            remote: RemoteAddress {
                node: 0,
                port: 0,
                key: RemoteKey(1),
                offset: 8,
            },
            width: AtomicWidth::Four,
            value: 5,
        },
    };
    let mut bad = four.encode();
    bad[44] = 1; // operand 0 above u32::MAX
    assert!(matches!(
        WorkRequest::decode(&bad),
        Err(DecodeError::OutOfRange { .. })
    ));
}

#[test]
fn inline_writes_carry_their_first_bytes_and_nothing_past_them() {
    let remote = RemoteAddress {
        node: 0,
        port: 1,
        key: RemoteKey(2),
        offset: 3,
    };
    let mut head = [0u8; 16];
    head[..5].copy_from_slice(b"hello");
    let write = WorkRequest {
        user_data: 4,
        flags: WrFlags::SIGNALED,
        op: Operation::WriteInline {
            len: 5,
            head,
            remote,
        },
    };
    let bytes = write.encode();
    assert_eq!(bytes[0], Opcode::WriteInline as u8);
    assert_eq!(&bytes[40..45], b"hello");
    assert_eq!(&bytes[16..24], &[0; 8], "no local address");
    assert_eq!(WorkRequest::decode(&bytes), Ok(write));
    let mut stray = bytes;
    stray[45] = 1;
    assert_eq!(
        WorkRequest::decode(&stray),
        Err(DecodeError::ReservedNotZero { offset: 45 })
    );
    let mut local = bytes;
    local[16] = 1;
    assert_eq!(
        WorkRequest::decode(&local),
        Err(DecodeError::ReservedNotZero { offset: 16 })
    );
    let mut long = bytes;
    long[4..8].copy_from_slice(&(MAX_INLINE + 1).to_le_bytes());
    assert!(matches!(
        WorkRequest::decode(&long),
        Err(DecodeError::OutOfRange {
            field: "inline length",
            ..
        })
    ));
}

#[test]
fn an_offset_past_48_bits_is_sent_as_the_largest_and_never_changes_the_node() {
    let write = |offset| WorkRequest {
        user_data: 1,
        flags: WrFlags::SIGNALED,
        op: Operation::Write {
            local: 0x1000,
            len: 8,
            remote: RemoteAddress {
                node: 3,
                port: 1,
                key: RemoteKey(2),
                offset,
            },
        },
    };
    for offset in [MAX_REMOTE_OFFSET + 1, 1 << 60, u64::MAX] {
        let decoded = WorkRequest::decode(&write(offset).encode()).unwrap();
        let Operation::Write { remote, .. } = decoded.op else {
            panic!("{decoded:?}")
        };
        assert_eq!((remote.node, remote.offset), (3, MAX_REMOTE_OFFSET));
    }
}
