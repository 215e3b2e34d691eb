//! The messages nodes exchange about operations, carried one per reliable
//! datagram (see [`crate::net`]): what a write, a read or an atomic asks of
//! a port of another node, and what that node answers. Each message is
//! self-contained: a write's part names its window, offset and bytes, so
//! the target writes it in place as it arrives, in any order, with no
//! reassembly.
//!
//! Layout (little-endian; `tag` names the operation in the initiator's
//! table and comes back in every answer):
//!
//! | kind | fields after the kind byte |
//! |---|---|
//! | 1 WRITE | 1 pad, src port u16, dst port u16, 2 pad, tag u64, src incarnation u64, key u64, offset u64, bytes |
//! | 2 READ | 1 pad, src port, dst port, 2 pad, tag, src incarnation, key, offset, len u32 |
//! | 3 READ_DATA | 7 pad, tag, at u32 (offset inside the read), 4 pad, bytes |
//! | 4 ATOMIC | op u8, src port, dst port, width u8, 1 pad, tag, src incarnation, key, offset, operand 0 u64, operand 1 u64 |
//! | 5 RESULT | status u8, detail u8, 5 pad, tag, value u64 |
//!
//! Decoding checks the kind, the lengths and every code; it never panics
//! on hostile bytes.

use pindown_uapi::{AtomicWidth, ErrorDetail, RemoteKey, Status};

use crate::rdma::remote::AtomicOp;

/// A message about an operation between two nodes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message<'a> {
    /// Part of a write: `bytes` go to `offset` in the window `key` of port
    /// `dst_port`.
    Write {
        /// The writer.
        origin: Origin,
        /// The target port.
        dst_port: u16,
        /// The window.
        key: RemoteKey,
        /// Where in the window.
        offset: u64,
        /// The bytes.
        bytes: &'a [u8],
    },
    /// A read of `len` bytes at `offset` in window `key` of `dst_port`;
    /// answered by [`Message::ReadData`] parts, or one error
    /// [`Message::Result`].
    Read {
        /// The reader.
        origin: Origin,
        /// The port read.
        dst_port: u16,
        /// The window.
        key: RemoteKey,
        /// Where in the window.
        offset: u64,
        /// Bytes to read.
        len: u32,
    },
    /// Part of a read's answer: `bytes` from offset `at` of the read.
    ReadData {
        /// The read.
        tag: u64,
        /// Offset of these bytes inside the read.
        at: u32,
        /// The bytes.
        bytes: &'a [u8],
    },
    /// An atomic on the word at `offset` in window `key` of `dst_port`.
    Atomic {
        /// The initiator.
        origin: Origin,
        /// The target port.
        dst_port: u16,
        /// The window.
        key: RemoteKey,
        /// Where in the window.
        offset: u64,
        /// The word's width.
        width: AtomicWidth,
        /// What to do.
        op: AtomicOp,
    },
    /// The outcome of an operation: an atomic's old value, or why a write
    /// or read failed.
    Result {
        /// The operation.
        tag: u64,
        /// How it ended.
        status: Status,
        /// Why, when it failed.
        detail: ErrorDetail,
        /// An atomic's old value.
        value: u64,
    },
}

/// Who asks: the initiating port of the sending node, and the operation's
/// tag in that node's table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Origin {
    /// The initiating port (on the sending node).
    pub port: u16,
    /// Its incarnation (windows bound to it check it).
    pub incarnation: u64,
    /// The operation's tag.
    pub tag: u64,
}

/// Why a message did not decode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MessageError {
    /// Shorter than its kind's header.
    #[error("message of {0} bytes is shorter than its header")]
    Truncated(usize),
    /// An unknown kind byte.
    #[error("unknown message kind {0}")]
    UnknownKind(u8),
    /// A field with a value no sender makes.
    #[error("bad {0} in message")]
    BadField(&'static str),
}

const WRITE: u8 = 1;
const READ: u8 = 2;
const READ_DATA: u8 = 3;
const ATOMIC: u8 = 4;
const RESULT: u8 = 5;

/// Header bytes of a WRITE (its bytes follow).
pub const WRITE_HEADER: usize = 40;
/// Header bytes of a READ_DATA (its bytes follow).
pub const READ_DATA_HEADER: usize = 24;
const READ_LEN: usize = 44;
const ATOMIC_LEN: usize = 56;
const RESULT_LEN: usize = 24;

const CAS: u8 = 1;
const FETCH_ADD: u8 = 2;
const SWAP: u8 = 3;

impl<'a> Message<'a> {
    /// Appends the encoded message to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        match *self {
            Message::Write {
                origin,
                dst_port,
                key,
                offset,
                bytes,
            } => {
                request_header(out, WRITE, 0, origin, dst_port, 0, key, offset);
                out.extend_from_slice(bytes);
            }
            Message::Read {
                origin,
                dst_port,
                key,
                offset,
                len,
            } => {
                request_header(out, READ, 0, origin, dst_port, 0, key, offset);
                out.extend_from_slice(&len.to_le_bytes());
            }
            Message::ReadData { tag, at, bytes } => {
                out.extend_from_slice(&[READ_DATA, 0, 0, 0, 0, 0, 0, 0]);
                out.extend_from_slice(&tag.to_le_bytes());
                out.extend_from_slice(&at.to_le_bytes());
                out.extend_from_slice(&[0; 4]);
                out.extend_from_slice(bytes);
            }
            Message::Atomic {
                origin,
                dst_port,
                key,
                offset,
                width,
                op,
            } => {
                let (code, operand0, operand1) = match op {
                    AtomicOp::CompareSwap { compare, swap } => (CAS, compare, swap),
                    AtomicOp::FetchAdd { add } => (FETCH_ADD, add, 0),
                    AtomicOp::Swap { value } => (SWAP, value, 0),
                };
                let width = width.bytes() as u8;
                request_header(out, ATOMIC, code, origin, dst_port, width, key, offset);
                out.extend_from_slice(&operand0.to_le_bytes());
                out.extend_from_slice(&operand1.to_le_bytes());
            }
            Message::Result {
                tag,
                status,
                detail,
                value,
            } => {
                out.extend_from_slice(&[RESULT, status as u8, detail as u8, 0, 0, 0, 0, 0]);
                out.extend_from_slice(&tag.to_le_bytes());
                out.extend_from_slice(&value.to_le_bytes());
            }
        }
    }

    /// Decodes and checks a message. Never panics.
    pub fn decode(bytes: &'a [u8]) -> Result<Message<'a>, MessageError> {
        let kind = *bytes.first().ok_or(MessageError::Truncated(0))?;
        let need = |n: usize| {
            if bytes.len() < n {
                Err(MessageError::Truncated(bytes.len()))
            } else {
                Ok(())
            }
        };
        let u16_at = |at: usize| u16::from_le_bytes([bytes[at], bytes[at + 1]]);
        let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4"));
        let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8"));
        let origin = || Origin {
            port: u16_at(2),
            incarnation: u64_at(16),
            tag: u64_at(8),
        };
        let key = || RemoteKey::try_from(u64_at(24)).map_err(|_| MessageError::BadField("key"));
        Ok(match kind {
            WRITE => {
                need(WRITE_HEADER)?;
                Message::Write {
                    origin: origin(),
                    dst_port: u16_at(4),
                    key: key()?,
                    offset: u64_at(32),
                    bytes: &bytes[WRITE_HEADER..],
                }
            }
            READ => {
                need(READ_LEN)?;
                Message::Read {
                    origin: origin(),
                    dst_port: u16_at(4),
                    key: key()?,
                    offset: u64_at(32),
                    len: u32_at(40),
                }
            }
            READ_DATA => {
                need(READ_DATA_HEADER)?;
                Message::ReadData {
                    tag: u64_at(8),
                    at: u32_at(16),
                    bytes: &bytes[READ_DATA_HEADER..],
                }
            }
            ATOMIC => {
                need(ATOMIC_LEN)?;
                let width = AtomicWidth::from_bytes(u32::from(bytes[6]))
                    .map_err(|_| MessageError::BadField("atomic width"))?;
                let (operand0, operand1) = (u64_at(40), u64_at(48));
                let op = match bytes[1] {
                    CAS => AtomicOp::CompareSwap {
                        compare: operand0,
                        swap: operand1,
                    },
                    FETCH_ADD => AtomicOp::FetchAdd { add: operand0 },
                    SWAP => AtomicOp::Swap { value: operand0 },
                    _ => return Err(MessageError::BadField("atomic operation")),
                };
                Message::Atomic {
                    origin: origin(),
                    dst_port: u16_at(4),
                    key: key()?,
                    offset: u64_at(32),
                    width,
                    op,
                }
            }
            RESULT => {
                need(RESULT_LEN)?;
                Message::Result {
                    tag: u64_at(8),
                    status: Status::from_u8(bytes[1])
                        .map_err(|_| MessageError::BadField("status"))?,
                    detail: ErrorDetail::from_u8(bytes[2])
                        .map_err(|_| MessageError::BadField("detail"))?,
                    value: u64_at(16),
                }
            }
            other => return Err(MessageError::UnknownKind(other)),
        })
    }
}

/// The common header of WRITE, READ and ATOMIC (40 bytes).
#[allow(clippy::too_many_arguments)]
fn request_header(
    out: &mut Vec<u8>,
    kind: u8,
    code: u8,
    origin: Origin,
    dst_port: u16,
    width: u8,
    key: RemoteKey,
    offset: u64,
) {
    out.extend_from_slice(&[kind, code]);
    out.extend_from_slice(&origin.port.to_le_bytes());
    out.extend_from_slice(&dst_port.to_le_bytes());
    out.extend_from_slice(&[width, 0]);
    out.extend_from_slice(&origin.tag.to_le_bytes());
    out.extend_from_slice(&origin.incarnation.to_le_bytes());
    out.extend_from_slice(&key.0.to_le_bytes());
    out.extend_from_slice(&offset.to_le_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn origin() -> Origin {
        Origin {
            port: 3,
            incarnation: 0x1122,
            tag: 0xfeed_0001,
        }
    }

    #[test]
    fn every_kind_round_trips() {
        let payload: Vec<u8> = (0..100u8).collect();
        let key = RemoteKey(0x5555_6666);
        let messages = [
            Message::Write {
                origin: origin(),
                dst_port: 1,
                key,
                offset: 4096,
                bytes: &payload,
            },
            Message::Read {
                origin: origin(),
                dst_port: 2,
                key,
                offset: 7,
                len: 1 << 20,
            },
            Message::ReadData {
                tag: 9,
                at: 1400,
                bytes: &payload[..10],
            },
            Message::Atomic {
                origin: origin(),
                dst_port: 0,
                key,
                offset: 64,
                width: AtomicWidth::Eight,
                op: AtomicOp::CompareSwap {
                    compare: 5,
                    swap: 6,
                },
            },
            Message::Atomic {
                origin: origin(),
                dst_port: 0,
                key,
                offset: 64,
                width: AtomicWidth::Four,
                op: AtomicOp::FetchAdd { add: 1 },
            },
            Message::Result {
                tag: 9,
                status: Status::RemoteAccessError,
                detail: ErrorDetail::NotGranted,
                value: 77,
            },
        ];
        for message in messages {
            let mut bytes = Vec::new();
            message.encode(&mut bytes);
            assert_eq!(Message::decode(&bytes), Ok(message.clone()));
            // Every shorter prefix of a fixed header is refused.
            let fixed = match message {
                Message::Write { .. } => WRITE_HEADER,
                Message::ReadData { .. } => READ_DATA_HEADER,
                _ => bytes.len(),
            };
            for cut in 0..fixed {
                assert!(
                    Message::decode(&bytes[..cut]).is_err(),
                    "{message:?} cut {cut}"
                );
            }
        }
    }

    #[test]
    fn bad_codes_are_refused() {
        let mut result = Vec::new();
        Message::Result {
            tag: 1,
            status: Status::Success,
            detail: ErrorDetail::None,
            value: 0,
        }
        .encode(&mut result);
        let mut bad_status = result.clone();
        bad_status[1] = 0xee;
        assert_eq!(
            Message::decode(&bad_status),
            Err(MessageError::BadField("status"))
        );
        let mut bad_kind = result;
        bad_kind[0] = 0x99;
        assert_eq!(
            Message::decode(&bad_kind),
            Err(MessageError::UnknownKind(0x99))
        );
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..128)) {
            let _ = Message::decode(&bytes);
        }
    }
}
