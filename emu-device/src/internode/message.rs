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
//! WRITE, READ, ATOMIC and COPY share a 48-byte header: kind u8, code u8
//! (the atomic's operation), origin port u16, target port u16, extra u16
//! (an atomic's width; a COPY's destination port), tag u64, origin
//! incarnation u64, key u64, offset u64, origin node u16, destination node
//! u16 (COPY), len u32 (READ, COPY).
//! The origin is the port whose rights are checked: the sender's own port,
//! or for a write a COPY delegated, the port that asked for the copy.
//!
//! | kind | after the header |
//! |---|---|
//! | 1 WRITE | the bytes |
//! | 2 READ | nothing |
//! | 4 ATOMIC | operand 0 u64, operand 1 u64 |
//! | 6 COPY | destination key u64, destination offset u64 (key and offset of the header: the source) |
//! | 7 VECTOR_WRITE | the remote pattern of these bytes (len bytes, [`Pattern`](pindown_uapi::pattern::Pattern) encoding; offsets from the header's offset), then the bytes |
//! | 8 VECTOR_READ | at u32 (offset of this part inside the read), the remote pattern of the part (len bytes) |
//! | 9 ATOMIC_TO | operand 0 u64, operand 1 u64, destination key u64, destination offset u64, destination port u16 (the header's destination node; code and extra as ATOMIC's) |
//! | 10 VECTOR_WRITE_NOTIFY | the last part of a vector write that asked for an arrival notice: immediate u64, the whole write's bytes u32, 4 pad, then as VECTOR_WRITE |
//! | 11 CHECK | nothing: may the origin write len bytes at offset of the window? (answered only when not) |
//!
//! | kind | layout |
//! |---|---|
//! | 3 READ_DATA | kind, 7 pad, tag, at u32 (offset inside the read), 4 pad, bytes |
//! | 5 RESULT | kind, status u8, detail u8, 5 pad, tag, value u64 |
//!
//! Decoding checks the kind, the lengths and every code; it never panics
//! on hostile bytes.

use pindown_uapi::{AtomicWidth, Bitwise, ErrorDetail, NodeId, RemoteAddress, RemoteKey, Status};

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
    /// An atomic on the word at `offset` in window `key` of `dst_port`
    /// whose old value goes to the window `destination` (on any node):
    /// the receiver runs it, writes the old value, and answers with one
    /// [`Message::Result`] carrying it.
    AtomicTo {
        /// The initiator.
        origin: Origin,
        /// The word's port.
        dst_port: u16,
        /// The word's window.
        key: RemoteKey,
        /// Where in the window.
        offset: u64,
        /// The word's width.
        width: AtomicWidth,
        /// What to do.
        op: AtomicOp,
        /// Where the old value goes.
        destination: RemoteAddress,
    },
    /// Part of a vector write: `bytes` go to the blocks of `pattern`
    /// (offsets from `offset`) in window `key` of `dst_port`.
    VectorWrite {
        /// The writer.
        origin: Origin,
        /// The target port.
        dst_port: u16,
        /// The window.
        key: RemoteKey,
        /// Where the pattern's offsets count from.
        offset: u64,
        /// The encoded pattern of this part.
        pattern: &'a [u8],
        /// The bytes, in the pattern's order.
        bytes: &'a [u8],
        /// On the last part of a write that asked for it, sent once every
        /// other part is acknowledged: the target queues an arrival
        /// notice once these bytes are in place.
        notice: Option<PartNotice>,
    },
    /// Part of a vector read: the blocks of `pattern` (offsets from
    /// `offset`) in window `key` of `dst_port`, answered by one
    /// [`Message::ReadData`] at `at`, or an error [`Message::Result`].
    VectorRead {
        /// The reader.
        origin: Origin,
        /// The port read.
        dst_port: u16,
        /// The window.
        key: RemoteKey,
        /// Where the pattern's offsets count from.
        offset: u64,
        /// Offset of this part inside the whole read.
        at: u32,
        /// The encoded pattern of this part.
        pattern: &'a [u8],
    },
    /// Whether `origin` may write `len` bytes at `offset` in window `key`
    /// of `dst_port` (its bounds, rights and memory), moving nothing:
    /// answered by an error [`Message::Result`] only when it may not.
    /// Sent before an ATOMIC_TO whose old value goes to the receiver's
    /// node, so that a destination that refuses leaves the word as it was.
    Check {
        /// The port that will write.
        origin: Origin,
        /// The destination's port.
        dst_port: u16,
        /// The window.
        key: RemoteKey,
        /// Where in the window.
        offset: u64,
        /// Bytes that will be written.
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
    /// A copy of `len` bytes from `offset` in window `key` of `dst_port`
    /// (on the receiving node) to the window `destination` (on any node),
    /// for `origin`: the receiver carries it out and answers with one
    /// [`Message::Result`].
    Copy {
        /// The port that asked for the copy (on the sending node).
        origin: Origin,
        /// The source port (on the receiving node).
        dst_port: u16,
        /// The source window.
        key: RemoteKey,
        /// Where in the source window.
        offset: u64,
        /// Where the bytes go.
        destination: RemoteAddress,
        /// Bytes.
        len: u32,
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

/// The arrival notice the last part of a vector write asks its target to
/// queue (the writer and the window are the part's own).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PartNotice {
    /// The writer's immediate value.
    pub immediate: u64,
    /// Bytes of the whole write.
    pub total: u32,
}

/// Who asks: the port whose rights are checked, and the operation's tag
/// in the sending node's table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Origin {
    /// The port's node (the sender, or the node that asked the sender for
    /// a copy).
    pub node: NodeId,
    /// The port.
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
const COPY: u8 = 6;
const VECTOR_WRITE: u8 = 7;
const VECTOR_READ: u8 = 8;
const ATOMIC_TO: u8 = 9;
const VECTOR_WRITE_NOTIFY: u8 = 10;
const CHECK: u8 = 11;
/// Bytes a VECTOR_WRITE_NOTIFY carries beyond a VECTOR_WRITE.
pub const PART_NOTICE_LEN: usize = 16;
const ATOMIC_TO_LEN: usize = ATOMIC_LEN + 18;

/// Header bytes of a WRITE (its bytes follow), and of READ.
pub const WRITE_HEADER: usize = 48;
/// Header bytes of a READ_DATA (its bytes follow).
pub const READ_DATA_HEADER: usize = 24;
const READ_LEN: usize = WRITE_HEADER;
const ATOMIC_LEN: usize = WRITE_HEADER + 16;
const COPY_LEN: usize = WRITE_HEADER + 16;
const RESULT_LEN: usize = 24;

const CAS: u8 = 1;
const FETCH_ADD: u8 = 2;
const SWAP: u8 = 3;
const FETCH_AND: u8 = 4;
const FETCH_OR: u8 = 5;
const FETCH_XOR: u8 = 6;

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
                let header = RequestHeader::new(WRITE, origin, dst_port, key, offset);
                header.encode(out);
                out.extend_from_slice(bytes);
            }
            Message::Read {
                origin,
                dst_port,
                key,
                offset,
                len,
            } => RequestHeader {
                len,
                ..RequestHeader::new(READ, origin, dst_port, key, offset)
            }
            .encode(out),
            Message::Check {
                origin,
                dst_port,
                key,
                offset,
                len,
            } => RequestHeader {
                len,
                ..RequestHeader::new(CHECK, origin, dst_port, key, offset)
            }
            .encode(out),
            Message::Copy {
                origin,
                dst_port,
                key,
                offset,
                destination,
                len,
            } => {
                RequestHeader {
                    len,
                    destination_node: destination.node,
                    extra: destination.port,
                    ..RequestHeader::new(COPY, origin, dst_port, key, offset)
                }
                .encode(out);
                out.extend_from_slice(&destination.key.0.to_le_bytes());
                out.extend_from_slice(&destination.offset.to_le_bytes());
            }
            Message::VectorWrite {
                origin,
                dst_port,
                key,
                offset,
                pattern,
                bytes,
                notice,
            } => {
                let kind = match notice {
                    None => VECTOR_WRITE,
                    Some(_) => VECTOR_WRITE_NOTIFY,
                };
                RequestHeader {
                    len: pattern.len() as u32,
                    ..RequestHeader::new(kind, origin, dst_port, key, offset)
                }
                .encode(out);
                if let Some(notice) = notice {
                    out.extend_from_slice(&notice.immediate.to_le_bytes());
                    out.extend_from_slice(&notice.total.to_le_bytes());
                    out.extend_from_slice(&[0; 4]);
                }
                out.extend_from_slice(pattern);
                out.extend_from_slice(bytes);
            }
            Message::VectorRead {
                origin,
                dst_port,
                key,
                offset,
                at,
                pattern,
            } => {
                RequestHeader {
                    len: pattern.len() as u32,
                    ..RequestHeader::new(VECTOR_READ, origin, dst_port, key, offset)
                }
                .encode(out);
                out.extend_from_slice(&at.to_le_bytes());
                out.extend_from_slice(pattern);
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
                let header = RequestHeader::new(ATOMIC, origin, dst_port, key, offset);
                encode_atomic(out, header, width, op);
            }
            Message::AtomicTo {
                origin,
                dst_port,
                key,
                offset,
                width,
                op,
                destination,
            } => {
                let header = RequestHeader {
                    destination_node: destination.node,
                    ..RequestHeader::new(ATOMIC_TO, origin, dst_port, key, offset)
                };
                encode_atomic(out, header, width, op);
                out.extend_from_slice(&destination.key.0.to_le_bytes());
                out.extend_from_slice(&destination.offset.to_le_bytes());
                out.extend_from_slice(&destination.port.to_le_bytes());
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
            node: u16_at(40),
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
                    len: u32_at(44),
                }
            }
            CHECK => {
                need(READ_LEN)?;
                Message::Check {
                    origin: origin(),
                    dst_port: u16_at(4),
                    key: key()?,
                    offset: u64_at(32),
                    len: u32_at(44),
                }
            }
            COPY => {
                need(COPY_LEN)?;
                let destination_key = RemoteKey::try_from(u64_at(WRITE_HEADER))
                    .map_err(|_| MessageError::BadField("destination key"))?;
                Message::Copy {
                    origin: origin(),
                    dst_port: u16_at(4),
                    key: key()?,
                    offset: u64_at(32),
                    destination: RemoteAddress {
                        node: u16_at(42),
                        port: u16_at(6),
                        key: destination_key,
                        offset: u64_at(WRITE_HEADER + 8),
                    },
                    len: u32_at(44),
                }
            }
            VECTOR_WRITE | VECTOR_WRITE_NOTIFY => {
                let (notice, start) = if kind == VECTOR_WRITE_NOTIFY {
                    need(WRITE_HEADER + PART_NOTICE_LEN)?;
                    let notice = PartNotice {
                        immediate: u64_at(WRITE_HEADER),
                        total: u32_at(WRITE_HEADER + 8),
                    };
                    (Some(notice), WRITE_HEADER + PART_NOTICE_LEN)
                } else {
                    need(WRITE_HEADER)?;
                    (None, WRITE_HEADER)
                };
                let pattern_len = u32_at(44) as usize;
                let rest = &bytes[start..];
                if pattern_len > rest.len() {
                    return Err(MessageError::BadField("pattern length"));
                }
                let bytes = &rest[pattern_len..];
                if notice.is_some_and(|notice| (notice.total as usize) < bytes.len()) {
                    return Err(MessageError::BadField("notice's byte count"));
                }
                Message::VectorWrite {
                    origin: origin(),
                    dst_port: u16_at(4),
                    key: key()?,
                    offset: u64_at(32),
                    pattern: &rest[..pattern_len],
                    bytes,
                    notice,
                }
            }
            VECTOR_READ => {
                need(WRITE_HEADER + 4)?;
                let pattern_len = u32_at(44) as usize;
                let rest = &bytes[WRITE_HEADER + 4..];
                if pattern_len != rest.len() {
                    return Err(MessageError::BadField("pattern length"));
                }
                Message::VectorRead {
                    origin: origin(),
                    dst_port: u16_at(4),
                    key: key()?,
                    offset: u64_at(32),
                    at: u32_at(WRITE_HEADER),
                    pattern: rest,
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
            ATOMIC_TO => {
                need(ATOMIC_TO_LEN)?;
                let (width, op) = decode_atomic(bytes)?;
                let destination_key = RemoteKey::try_from(u64_at(ATOMIC_LEN))
                    .map_err(|_| MessageError::BadField("destination key"))?;
                Message::AtomicTo {
                    origin: origin(),
                    dst_port: u16_at(4),
                    key: key()?,
                    offset: u64_at(32),
                    width,
                    op,
                    destination: RemoteAddress {
                        node: u16_at(42),
                        port: u16_at(ATOMIC_LEN + 16),
                        key: destination_key,
                        offset: u64_at(ATOMIC_LEN + 8),
                    },
                }
            }
            ATOMIC => {
                need(ATOMIC_LEN)?;
                let (width, op) = decode_atomic(bytes)?;
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

/// Encodes an atomic's header (`header` with its code and width), then
/// its two operands.
fn encode_atomic(out: &mut Vec<u8>, header: RequestHeader, width: AtomicWidth, op: AtomicOp) {
    let code = match op {
        AtomicOp::CompareSwap { .. } => CAS,
        AtomicOp::FetchAdd { .. } => FETCH_ADD,
        AtomicOp::Swap { .. } => SWAP,
        AtomicOp::Bitwise { op, .. } => match op {
            Bitwise::And => FETCH_AND,
            Bitwise::Or => FETCH_OR,
            Bitwise::Xor => FETCH_XOR,
        },
    };
    RequestHeader {
        code,
        extra: width.bytes() as u16,
        ..header
    }
    .encode(out);
    let (operand0, operand1) = op.operands();
    out.extend_from_slice(&operand0.to_le_bytes());
    out.extend_from_slice(&operand1.to_le_bytes());
}

/// The width and operation of an ATOMIC or ATOMIC_TO (at least
/// `ATOMIC_LEN` bytes).
fn decode_atomic(bytes: &[u8]) -> Result<(AtomicWidth, AtomicOp), MessageError> {
    let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8"));
    let width = AtomicWidth::from_bytes(u32::from(u16::from_le_bytes([bytes[6], bytes[7]])))
        .map_err(|_| MessageError::BadField("atomic width"))?;
    let (operand0, operand1) = (u64_at(WRITE_HEADER), u64_at(WRITE_HEADER + 8));
    let op = match bytes[1] {
        CAS => AtomicOp::CompareSwap {
            compare: operand0,
            swap: operand1,
        },
        FETCH_ADD => AtomicOp::FetchAdd { add: operand0 },
        SWAP => AtomicOp::Swap { value: operand0 },
        code @ (FETCH_AND | FETCH_OR | FETCH_XOR) => AtomicOp::Bitwise {
            op: match code {
                FETCH_AND => Bitwise::And,
                FETCH_OR => Bitwise::Or,
                _ => Bitwise::Xor,
            },
            mask: operand0,
        },
        _ => return Err(MessageError::BadField("atomic operation")),
    };
    Ok((width, op))
}

/// The common header of WRITE, READ, ATOMIC and COPY.
struct RequestHeader {
    kind: u8,
    code: u8,
    origin: Origin,
    dst_port: u16,
    /// An atomic's width, a copy's destination port.
    extra: u16,
    key: RemoteKey,
    offset: u64,
    destination_node: NodeId,
    len: u32,
}

impl RequestHeader {
    fn new(kind: u8, origin: Origin, dst_port: u16, key: RemoteKey, offset: u64) -> Self {
        RequestHeader {
            kind,
            code: 0,
            origin,
            dst_port,
            extra: 0,
            key,
            offset,
            destination_node: 0,
            len: 0,
        }
    }

    fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&[self.kind, self.code]);
        out.extend_from_slice(&self.origin.port.to_le_bytes());
        out.extend_from_slice(&self.dst_port.to_le_bytes());
        out.extend_from_slice(&self.extra.to_le_bytes());
        out.extend_from_slice(&self.origin.tag.to_le_bytes());
        out.extend_from_slice(&self.origin.incarnation.to_le_bytes());
        out.extend_from_slice(&self.key.0.to_le_bytes());
        out.extend_from_slice(&self.offset.to_le_bytes());
        out.extend_from_slice(&self.origin.node.to_le_bytes());
        out.extend_from_slice(&self.destination_node.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
    }
}
/// The datagram that carries an Ethernet frame of queue pair 0 to
/// another node: outside the reliable endpoint (Ethernet is best effort;
/// the guests' own protocols recover losses), told apart from the
/// endpoint's datagrams by its magic.
///
/// | offset | size | field |
/// |---|---|---|
/// | 0 | 2 | magic `pf` |
/// | 2 | 1 | version 1 |
/// | 3 | 1 | zero |
/// | 4 | 8 | the fabric's job token |
/// | 12 | 2 | source node |
/// | 14 | 2 | destination node |
/// | 16 | .. | the frame (no virtio-net header) |
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameDatagram<'a> {
    /// The job token.
    pub fabric: u64,
    /// The sending node.
    pub source: NodeId,
    /// The receiving node.
    pub destination: NodeId,
    /// The frame.
    pub frame: &'a [u8],
}

const FRAME_MAGIC: [u8; 2] = *b"pf";
const FRAME_VERSION: u8 = 1;
/// Bytes before the frame.
pub const FRAME_HEADER: usize = 16;

impl<'a> FrameDatagram<'a> {
    /// Whether `datagram` is one (by its magic).
    pub fn is_one(datagram: &[u8]) -> bool {
        datagram.starts_with(&FRAME_MAGIC)
    }

    /// Appends the encoded datagram to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&FRAME_MAGIC);
        out.extend_from_slice(&[FRAME_VERSION, 0]);
        out.extend_from_slice(&self.fabric.to_le_bytes());
        out.extend_from_slice(&self.source.to_le_bytes());
        out.extend_from_slice(&self.destination.to_le_bytes());
        out.extend_from_slice(self.frame);
    }

    /// Decodes and checks one. Never panics.
    pub fn decode(datagram: &'a [u8]) -> Result<FrameDatagram<'a>, MessageError> {
        if datagram.len() < FRAME_HEADER {
            return Err(MessageError::Truncated(datagram.len()));
        }
        if !Self::is_one(datagram) || datagram[2] != FRAME_VERSION || datagram[3] != 0 {
            return Err(MessageError::BadField("frame datagram magic or version"));
        }
        Ok(FrameDatagram {
            fabric: u64::from_le_bytes(datagram[4..12].try_into().expect("8")),
            source: u16::from_le_bytes([datagram[12], datagram[13]]),
            destination: u16::from_le_bytes([datagram[14], datagram[15]]),
            frame: &datagram[FRAME_HEADER..],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn origin() -> Origin {
        Origin {
            node: 2,
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
            Message::Copy {
                origin: origin(),
                dst_port: 4,
                key,
                offset: 12,
                destination: RemoteAddress {
                    node: 7,
                    port: 5,
                    key: RemoteKey(0x77),
                    offset: 99,
                },
                len: 3 << 20,
            },
            Message::VectorWrite {
                origin: origin(),
                dst_port: 1,
                key,
                offset: 8,
                pattern: &payload[..40],
                bytes: &payload[40..],
                notice: None,
            },
            Message::VectorWrite {
                origin: origin(),
                dst_port: 1,
                key,
                offset: 8,
                pattern: &payload[..40],
                bytes: &payload[40..],
                notice: Some(PartNotice {
                    immediate: 0xfeed,
                    total: 1 << 20,
                }),
            },
            Message::VectorRead {
                origin: origin(),
                dst_port: 1,
                key,
                offset: 8,
                at: 2800,
                pattern: &payload[..40],
            },
            Message::ReadData {
                tag: 9,
                at: 1400,
                bytes: &payload[..10],
            },
            Message::Check {
                origin: origin(),
                dst_port: 2,
                key,
                offset: 4088,
                len: 8,
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
            Message::AtomicTo {
                origin: origin(),
                dst_port: 3,
                key,
                offset: 8,
                width: AtomicWidth::Four,
                op: AtomicOp::Bitwise {
                    op: Bitwise::Xor,
                    mask: 0xf0,
                },
                destination: RemoteAddress {
                    node: 9,
                    port: 2,
                    key: RemoteKey(0x99),
                    offset: 1 << 40,
                },
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
                Message::VectorWrite {
                    notice: Some(_), ..
                } => WRITE_HEADER + PART_NOTICE_LEN,
                Message::Write { .. } | Message::VectorWrite { .. } => WRITE_HEADER,
                Message::VectorRead { .. } => WRITE_HEADER + 4,
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
        // A notice counting fewer bytes than its own part carries.
        let mut notified = Vec::new();
        Message::VectorWrite {
            origin: Origin {
                node: 1,
                port: 0,
                incarnation: 1,
                tag: 2,
            },
            dst_port: 0,
            key: RemoteKey(5),
            offset: 0,
            pattern: &[],
            bytes: &[1, 2, 3],
            notice: Some(PartNotice {
                immediate: 1,
                total: 2,
            }),
        }
        .encode(&mut notified);
        assert_eq!(
            Message::decode(&notified),
            Err(MessageError::BadField("notice's byte count"))
        );
        let mut bad_kind = result;
        bad_kind[0] = 0x99;
        assert_eq!(
            Message::decode(&bad_kind),
            Err(MessageError::UnknownKind(0x99))
        );
    }

    #[test]
    fn frame_datagrams_round_trip_and_differ_from_endpoint_datagrams() {
        let frame = [0xffu8; 60];
        let datagram = FrameDatagram {
            fabric: 0x5eed,
            source: 2,
            destination: 3,
            frame: &frame,
        };
        let mut bytes = Vec::new();
        datagram.encode(&mut bytes);
        assert_eq!(FrameDatagram::decode(&bytes), Ok(datagram));
        assert!(!FrameDatagram::is_one(
            &crate::net::wire::MAGIC.to_le_bytes()
        ));
        for cut in 0..FRAME_HEADER {
            assert!(FrameDatagram::decode(&bytes[..cut]).is_err());
        }
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..128)) {
            let _ = Message::decode(&bytes);
            let _ = FrameDatagram::decode(&bytes);
        }
    }
}
