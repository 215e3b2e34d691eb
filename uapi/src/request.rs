//! Work requests: what the driver asks the device to do.
//!
//! Layout (64 bytes, little-endian):
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 1 | opcode ([`Opcode`]) |
//! | 1 | 1 | flags ([`WrFlags`]) |
//! | 2 | 2 | remote port; BIND: the one port the window is bound to ([`WindowFlags::PEER`]) |
//! | 4 | 4 | length in bytes (WRITE, READ) |
//! | 8 | 8 | user data, returned in the completion |
//! | 16 | 8 | local address (IOVA of the initiator's memory; BIND: window start) |
//! | 24 | 6 | remote offset inside the window (48 bits, at most [`MAX_REMOTE_OFFSET`]) |
//! | 30 | 2 | remote node ([`NodeId`](crate::NodeId)); BIND: the node of the one port the window is bound to |
//! | 32 | 8 | remote key ([`RemoteKey`]; REVOKE: the window's key) |
//! | 40 | 8 | operand 0: compare (CAS), addend (FETCH_ADD), new value (SWAP), window length (BIND) |
//! | 48 | 8 | operand 1: swap value (CAS) |
//! | 56 | 4 | atomic width in bytes (atomics); access bits ([`Access`]) (BIND) |
//! | 60 | 1 | window flags ([`WindowFlags`]) (BIND); vector flags ([`VectorFlags`]) (VECTOR_WRITE, VECTOR_READ) |
//! | 61 | 3 | reserved, zero (a send queue slot keeps its stamp in the last two: see [`queue`](crate::queue)) |
//!
//! Fields an operation does not use must be zero. WRITE_INLINE carries no
//! local address: the first [`INLINE_IN_REQUEST`] bytes of its data take
//! the place of operands 0 and 1 (offsets 40 to 56; bytes past the data's
//! length are zero), and the rest follows the request in the send queue
//! (see [`queue`](crate::queue)).
//!
//! VECTOR_WRITE and VECTOR_READ move bytes between two access patterns
//! ([`pattern`](crate::pattern)) and use the fields so:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 4 | 4 | bytes the transfer moves: both patterns must cover exactly this many |
//! | 16 | 8 | local base (IOVA the local pattern's offsets count from) |
//! | 24 | 6 | remote base (offset inside the window the remote pattern's offsets count from) |
//! | 30 | 2 | remote node |
//! | 32 | 8 | remote key |
//! | 40 | 8 | descriptor IOVA with [`VectorFlags::DESCRIPTOR_IN_MEMORY`], else zero |
//! | 48 | 8 | immediate value for the target with [`VectorFlags::NOTIFY_TARGET`], else zero |
//! | 56 | 4 | descriptor bytes (the two patterns, [`pattern::encode_pair`](crate::pattern::encode_pair)) |
//! | 60 | 1 | [`VectorFlags`] |
//!
//! ATOMIC_TO_COMPARE_SWAP .. ATOMIC_TO_FETCH_XOR (the operation in the
//! opcode) name a word and a destination window for its old value:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 2, 24, 32 | | the word: port, offset and node, key (as a remote address) |
//! | 4 | 4 | destination offset and node, low 32 bits (48-bit offset, node in the top 16 bits of the 64) |
//! | 16 | 8 | destination key |
//! | 40, 48 | 8 each | operands 0 and 1 (as COMPARE_SWAP, FETCH_ADD, SWAP, FETCH_AND/OR/XOR) |
//! | 56 | 4 | destination offset and node, high 32 bits |
//! | 60 | 2 | destination port (below [`ATOMIC_TO_FOUR`]), with [`ATOMIC_TO_FOUR`] for a 4-byte word |
//!
//! Without [`VectorFlags::DESCRIPTOR_IN_MEMORY`] the descriptor (at most
//! [`MAX_INLINE`] bytes) follows the request in the send queue, in
//! [`vector_inline_slots`] slots of [`INLINE_PER_SLOT`] bytes each.

use crate::error::{le_u16, le_u32, le_u64, need, reserved_zero, DecodeError};
use crate::keys::{Access, PortAddress, RemoteAddress, RemoteKey, MAX_REMOTE_OFFSET};
use crate::queue::{INLINE_IN_REQUEST, INLINE_OFFSET, INLINE_PER_SLOT, MAX_INLINE};

/// Operation codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Opcode {
    /// Does nothing; completes in order (a fence point when fenced).
    Nop = 0x00,
    /// Copies local memory into a remote window.
    Write = 0x01,
    /// Copies a remote window's memory into local memory.
    Read = 0x02,
    /// Atomic compare-and-swap on a remote word.
    CompareSwap = 0x03,
    /// Atomic fetch-and-add on a remote word.
    FetchAdd = 0x04,
    /// Atomic swap on a remote word.
    Swap = 0x05,
    /// Grants peers access to part of the initiator's registered memory.
    BindWindow = 0x06,
    /// Revokes a window the initiator bound.
    RevokeWindow = 0x07,
    /// Asks for the port's [`DeviceInfo`](crate::DeviceInfo).
    Query = 0x08,
    /// Copies bytes carried in the send queue itself into a remote window.
    WriteInline = 0x09,
    /// Atomic fetch-and-and on a remote word.
    FetchAnd = 0x0a,
    /// Atomic fetch-and-or on a remote word.
    FetchOr = 0x0b,
    /// Atomic fetch-and-xor on a remote word.
    FetchXor = 0x0c,
    /// Copies local memory, read by one access pattern, into a remote
    /// window, written by another (DIMMnet-2's remote vector write).
    VectorWrite = 0x10,
    /// Copies a remote window's memory, read by one access pattern, into
    /// local memory, written by another.
    VectorRead = 0x11,
    /// Copies bytes between two remote windows, on any nodes, started by a
    /// third port and carried out by the source's device (ACP's copy).
    Copy = 0x20,
    /// Compare-and-swap on a remote word, the old value written to a
    /// window anywhere in the fabric (ACP's atomics).
    AtomicToCompareSwap = 0x21,
    /// Fetch-and-add, the old value written to a window.
    AtomicToFetchAdd = 0x22,
    /// Swap, the old value written to a window.
    AtomicToSwap = 0x23,
    /// Fetch-and-and, the old value written to a window.
    AtomicToFetchAnd = 0x24,
    /// Fetch-and-or, the old value written to a window.
    AtomicToFetchOr = 0x25,
    /// Fetch-and-xor, the old value written to a window.
    AtomicToFetchXor = 0x26,
}

impl Opcode {
    /// Vector transfers: access patterns on both sides (DIMMnet-2); codes
    /// past VECTOR_READ are reserved.
    pub const VECTOR_RANGE: std::ops::RangeInclusive<u8> = 0x10..=0x1f;
    /// Reserved for copies and atomics between two other ports, started by a
    /// third (ACP).
    pub const THIRD_PARTY_RANGE: std::ops::RangeInclusive<u8> = 0x20..=0x2f;
    /// ATOMIC_TO_COMPARE_SWAP to ATOMIC_TO_FETCH_XOR.
    pub const ATOMIC_TO_RANGE: std::ops::RangeInclusive<u8> = 0x21..=0x26;
    /// Reserved for messaging: sends, receives and active messages.
    pub const MESSAGING_RANGE: std::ops::RangeInclusive<u8> = 0x30..=0x3f;

    /// The opcode's name as the ABI spells it (`WRITE`, `FETCH_ADD`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Opcode::Nop => "NOP",
            Opcode::Write => "WRITE",
            Opcode::Read => "READ",
            Opcode::CompareSwap => "COMPARE_SWAP",
            Opcode::FetchAdd => "FETCH_ADD",
            Opcode::Swap => "SWAP",
            Opcode::BindWindow => "BIND_WINDOW",
            Opcode::RevokeWindow => "REVOKE_WINDOW",
            Opcode::Query => "QUERY",
            Opcode::WriteInline => "WRITE_INLINE",
            Opcode::FetchAnd => "FETCH_AND",
            Opcode::FetchOr => "FETCH_OR",
            Opcode::FetchXor => "FETCH_XOR",
            Opcode::Copy => "COPY",
            Opcode::AtomicToCompareSwap => "ATOMIC_TO_COMPARE_SWAP",
            Opcode::AtomicToFetchAdd => "ATOMIC_TO_FETCH_ADD",
            Opcode::AtomicToSwap => "ATOMIC_TO_SWAP",
            Opcode::AtomicToFetchAnd => "ATOMIC_TO_FETCH_AND",
            Opcode::AtomicToFetchOr => "ATOMIC_TO_FETCH_OR",
            Opcode::AtomicToFetchXor => "ATOMIC_TO_FETCH_XOR",
            Opcode::VectorWrite => "VECTOR_WRITE",
            Opcode::VectorRead => "VECTOR_READ",
        }
    }

    /// The opcode with code `code`.
    pub fn from_u8(code: u8) -> Result<Opcode, DecodeError> {
        Ok(match code {
            0x00 => Opcode::Nop,
            0x01 => Opcode::Write,
            0x02 => Opcode::Read,
            0x03 => Opcode::CompareSwap,
            0x04 => Opcode::FetchAdd,
            0x05 => Opcode::Swap,
            0x06 => Opcode::BindWindow,
            0x07 => Opcode::RevokeWindow,
            0x08 => Opcode::Query,
            0x09 => Opcode::WriteInline,
            0x0a => Opcode::FetchAnd,
            0x0b => Opcode::FetchOr,
            0x0c => Opcode::FetchXor,
            0x20 => Opcode::Copy,
            0x21 => Opcode::AtomicToCompareSwap,
            0x22 => Opcode::AtomicToFetchAdd,
            0x23 => Opcode::AtomicToSwap,
            0x24 => Opcode::AtomicToFetchAnd,
            0x25 => Opcode::AtomicToFetchOr,
            0x26 => Opcode::AtomicToFetchXor,
            0x10 => Opcode::VectorWrite,
            0x11 => Opcode::VectorRead,
            code if Self::VECTOR_RANGE.contains(&code) => {
                return Err(DecodeError::Reserved("vector transfer"))
            }
            code if Self::THIRD_PARTY_RANGE.contains(&code) => {
                return Err(DecodeError::Reserved("third-party operation"))
            }
            code if Self::MESSAGING_RANGE.contains(&code) => {
                return Err(DecodeError::Reserved("messaging operation"))
            }
            other => return Err(DecodeError::UnknownOpcode(other)),
        })
    }
}

bitflags::bitflags! {
    /// Work request flags.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
    pub struct WrFlags: u8 {
        /// Write a completion when the request succeeds (failures always
        /// complete).
        const SIGNALED = 1 << 0;
        /// Start only after every earlier request of the queue has finished.
        const FENCE = 1 << 1;
    }
}

bitflags::bitflags! {
    /// How a vector transfer is described and reported (VECTOR_WRITE,
    /// VECTOR_READ).
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
    pub struct VectorFlags: u8 {
        /// The descriptor lies in the initiator's registered memory at the
        /// request's descriptor IOVA; without it, it follows the request in
        /// the send queue.
        const DESCRIPTOR_IN_MEMORY = 1 << 0;
        /// When a VECTOR_WRITE completes, the target's driver learns of it
        /// from its own completion queue: which port (of which node) wrote, through which
        /// window, how many bytes, and the request's immediate value
        /// (DIMMnet-2's receive status). Not allowed on VECTOR_READ.
        const NOTIFY_TARGET = 1 << 1;
    }
}

/// Where a vector transfer's descriptor is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Descriptor {
    /// In the send queue, after the request.
    Inline {
        /// Bytes (at most [`MAX_INLINE`]).
        len: u32,
    },
    /// In the initiator's registered memory.
    InMemory {
        /// Its IOVA.
        iova: u64,
        /// Its bytes.
        len: u32,
    },
}

impl Descriptor {
    /// Its bytes.
    pub fn len(self) -> u32 {
        match self {
            Descriptor::Inline { len } | Descriptor::InMemory { len, .. } => len,
        }
    }

    /// Whether it has no byte (never valid: a descriptor holds two
    /// patterns).
    pub fn is_empty(self) -> bool {
        self.len() == 0
    }
}

/// Slots after a vector request that carry its inline descriptor of `len`
/// bytes.
pub fn vector_inline_slots(len: u32) -> usize {
    (len as usize).div_ceil(INLINE_PER_SLOT)
}

/// A vector transfer's operands (VECTOR_WRITE, VECTOR_READ).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VectorTransfer {
    /// IOVA the local pattern's offsets count from.
    pub local: u64,
    /// Bytes moved; both patterns cover exactly this many.
    pub len: u32,
    /// The window, and the offset in it the remote pattern's offsets count
    /// from.
    pub remote: RemoteAddress,
    /// Where the two patterns are.
    pub descriptor: Descriptor,
    /// `Some(immediate)`: tell the target (VECTOR_WRITE only).
    pub notify: Option<u64>,
}

bitflags::bitflags! {
    /// How a window is bound (BIND_WINDOW).
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
    pub struct WindowFlags: u8 {
        /// Only the port in the request's remote-port field may use the
        /// window (as a type-2 memory window is bound to one queue pair);
        /// without it, any port holding the key may.
        const PEER = 1 << 0;
    }
}

/// Bytes 60..62 of an ATOMIC_TO request: the destination port, with this
/// bit set for a 4-byte word (ports are numbered below it).
pub const ATOMIC_TO_FOUR: u16 = 1 << 15;

/// What an atomic does to its word (the old value always comes back).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AtomicOp {
    /// Stores `swap` if the word equals `compare`.
    CompareSwap {
        /// The value expected.
        compare: u64,
        /// The value stored when it matched.
        swap: u64,
    },
    /// Adds `add` (wrapping).
    FetchAdd {
        /// The addend.
        add: u64,
    },
    /// Stores `value`.
    Swap {
        /// The new value.
        value: u64,
    },
    /// Applies AND, OR or XOR with `mask`.
    Bitwise {
        /// Which.
        op: Bitwise,
        /// The other operand.
        mask: u64,
    },
}

impl AtomicOp {
    /// The two operands as a request carries them.
    pub fn operands(self) -> (u64, u64) {
        match self {
            AtomicOp::CompareSwap { compare, swap } => (compare, swap),
            AtomicOp::FetchAdd { add } => (add, 0),
            AtomicOp::Swap { value } => (value, 0),
            AtomicOp::Bitwise { mask, .. } => (mask, 0),
        }
    }
}

/// The logic of a [`Operation::FetchBitwise`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Bitwise {
    /// `word & mask`.
    And,
    /// `word | mask`.
    Or,
    /// `word ^ mask`.
    Xor,
}

/// Packs a window offset and a node into one 64-bit field, as the request
/// carries them. An offset past the 48 bits is sent as the largest one,
/// which no window reaches (a window is shorter): the access is refused,
/// never redirected.
fn pack_offset(offset: u64, node: u16) -> u64 {
    offset.min(MAX_REMOTE_OFFSET) | u64::from(node) << 48
}

/// Width of an atomic operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AtomicWidth {
    /// A 4-byte word, 4-byte aligned.
    Four,
    /// An 8-byte word, 8-byte aligned.
    Eight,
}

impl AtomicWidth {
    /// Bytes in the word.
    pub fn bytes(self) -> u32 {
        match self {
            AtomicWidth::Four => 4,
            AtomicWidth::Eight => 8,
        }
    }

    /// The width of a word of `bytes` bytes.
    pub fn from_bytes(bytes: u32) -> Result<Self, DecodeError> {
        match bytes {
            4 => Ok(AtomicWidth::Four),
            8 => Ok(AtomicWidth::Eight),
            other => Err(DecodeError::BadAtomicWidth(other)),
        }
    }

    fn check_operand(self, field: &'static str, value: u64) -> Result<u64, DecodeError> {
        if self == AtomicWidth::Four && value > u64::from(u32::MAX) {
            return Err(DecodeError::OutOfRange { field, value });
        }
        Ok(value)
    }
}

/// An operation and its operands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Operation {
    /// Nothing.
    Nop,
    /// Copy `len` bytes from local `local` to `remote`.
    Write {
        /// Source IOVA.
        local: u64,
        /// Bytes.
        len: u32,
        /// Destination.
        remote: RemoteAddress,
    },
    /// Copy `len` bytes (at most [`MAX_INLINE`]) carried with the request
    /// to `remote`: the first up to [`INLINE_IN_REQUEST`] in `head`, the
    /// rest in the send queue slots after the request.
    WriteInline {
        /// Bytes.
        len: u32,
        /// The first `min(len, 16)` bytes; the rest of `head` is zero.
        head: [u8; INLINE_IN_REQUEST],
        /// Destination.
        remote: RemoteAddress,
    },
    /// Copy `len` bytes from `remote` to local `local`.
    Read {
        /// Destination IOVA.
        local: u64,
        /// Bytes.
        len: u32,
        /// Source.
        remote: RemoteAddress,
    },
    /// If the word at `remote` equals `compare`, store `swap`; the old value
    /// comes back in the completion.
    CompareSwap {
        /// The word.
        remote: RemoteAddress,
        /// Its width.
        width: AtomicWidth,
        /// Expected value.
        compare: u64,
        /// New value.
        swap: u64,
    },
    /// Add `add` to the word at `remote` (wrapping); the old value comes back.
    FetchAdd {
        /// The word.
        remote: RemoteAddress,
        /// Its width.
        width: AtomicWidth,
        /// Addend.
        add: u64,
    },
    /// Store `value` at `remote`; the old value comes back.
    Swap {
        /// The word.
        remote: RemoteAddress,
        /// Its width.
        width: AtomicWidth,
        /// New value.
        value: u64,
    },
    /// Apply `op` with `mask` to the word at `remote`; the old value comes
    /// back.
    FetchBitwise {
        /// The word.
        remote: RemoteAddress,
        /// Its width.
        width: AtomicWidth,
        /// AND, OR or XOR.
        op: Bitwise,
        /// The other operand.
        mask: u64,
    },
    /// Copy `len` bytes from the window at `source` to the window at
    /// `destination`: any two windows of the fabric the initiator holds
    /// keys for (the two may be on two other nodes). The source's device
    /// reads the source window and writes the destination, both checked
    /// against the initiator's rights; the initiator's completion comes
    /// once every byte landed.
    Copy {
        /// Where the bytes come from.
        source: RemoteAddress,
        /// Where they go.
        destination: RemoteAddress,
        /// Bytes.
        len: u32,
    },
    /// Run `op` on the `width`-byte word at `word`, and write the old
    /// value (`width` bytes, little-endian) into the window at
    /// `destination`: three windows anywhere in the fabric (ACP's
    /// atomics). The word's device runs it, atomic with respect to every
    /// initiator and the owner's CPU, and then writes the old value with
    /// the initiator's rights; the completion (which carries the old
    /// value too) comes once it landed.
    AtomicTo {
        /// The word.
        word: RemoteAddress,
        /// Its width.
        width: AtomicWidth,
        /// What to do to it.
        op: AtomicOp,
        /// Where the old value goes.
        destination: RemoteAddress,
    },
    /// Grant `access` to `[start, start + len)` of the initiator's registered
    /// memory, to one port or to any; the completion's value is the new
    /// [`RemoteKey`].
    BindWindow {
        /// First IOVA of the window.
        start: u64,
        /// Length in bytes (non-zero).
        len: u64,
        /// Rights granted.
        access: Access,
        /// `Some(port)`: only `port` may use the window; `None`: any port
        /// holding the key may.
        peer: Option<PortAddress>,
    },
    /// Revoke a window the initiator bound; later accesses through its key fail.
    RevokeWindow {
        /// The window's key.
        key: RemoteKey,
    },
    /// Ask for the port's [`DeviceInfo`](crate::DeviceInfo) (the completion's value).
    Query,
    /// Copy local memory read by the local pattern into the remote window
    /// written by the remote pattern.
    VectorWrite(VectorTransfer),
    /// Copy the remote window read by the remote pattern into local memory
    /// written by the local pattern.
    VectorRead(VectorTransfer),
}

impl Operation {
    /// Send queue slots that follow the request and carry its bytes: a
    /// WRITE_INLINE's data past the [`INLINE_IN_REQUEST`] the request
    /// holds ([`inline_slots`](crate::queue::inline_slots)), a vector
    /// transfer's inline descriptor ([`vector_inline_slots`]); none for
    /// other requests.
    pub fn slots_after(&self) -> usize {
        match self {
            Operation::WriteInline { len, .. } => crate::queue::inline_slots(*len),
            Operation::VectorWrite(VectorTransfer {
                descriptor: Descriptor::Inline { len },
                ..
            })
            | Operation::VectorRead(VectorTransfer {
                descriptor: Descriptor::Inline { len },
                ..
            }) => vector_inline_slots(*len),
            _ => 0,
        }
    }

    /// Bytes of those slots' contents that belong to the request (at the
    /// start of the slots' bytes, [`INLINE_PER_SLOT`] per slot), out of
    /// `len` carried bytes in all: for WRITE_INLINE the data less the
    /// part in the request itself.
    pub fn bytes_in_request(&self) -> usize {
        match self {
            Operation::WriteInline { len, .. } => (*len as usize).min(INLINE_IN_REQUEST),
            _ => 0,
        }
    }

    /// The operation's opcode.
    pub fn opcode(&self) -> Opcode {
        match self {
            Operation::Nop => Opcode::Nop,
            Operation::Write { .. } => Opcode::Write,
            Operation::WriteInline { .. } => Opcode::WriteInline,
            Operation::Read { .. } => Opcode::Read,
            Operation::CompareSwap { .. } => Opcode::CompareSwap,
            Operation::FetchAdd { .. } => Opcode::FetchAdd,
            Operation::Swap { .. } => Opcode::Swap,
            Operation::FetchBitwise { op, .. } => match op {
                Bitwise::And => Opcode::FetchAnd,
                Bitwise::Or => Opcode::FetchOr,
                Bitwise::Xor => Opcode::FetchXor,
            },
            Operation::Copy { .. } => Opcode::Copy,
            Operation::AtomicTo { op, .. } => match op {
                AtomicOp::CompareSwap { .. } => Opcode::AtomicToCompareSwap,
                AtomicOp::FetchAdd { .. } => Opcode::AtomicToFetchAdd,
                AtomicOp::Swap { .. } => Opcode::AtomicToSwap,
                AtomicOp::Bitwise {
                    op: Bitwise::And, ..
                } => Opcode::AtomicToFetchAnd,
                AtomicOp::Bitwise {
                    op: Bitwise::Or, ..
                } => Opcode::AtomicToFetchOr,
                AtomicOp::Bitwise {
                    op: Bitwise::Xor, ..
                } => Opcode::AtomicToFetchXor,
            },
            Operation::BindWindow { .. } => Opcode::BindWindow,
            Operation::RevokeWindow { .. } => Opcode::RevokeWindow,
            Operation::Query => Opcode::Query,
            Operation::VectorWrite(_) => Opcode::VectorWrite,
            Operation::VectorRead(_) => Opcode::VectorRead,
        }
    }
}

/// One work request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkRequest {
    /// Returned unchanged in the completion.
    pub user_data: u64,
    /// Signalling and ordering.
    pub flags: WrFlags,
    /// What to do.
    pub op: Operation,
}

/// The raw fields of the layout, before and after interpretation.
#[derive(Default)]
struct Fields {
    remote_port: u16,
    node: u16,
    len: u32,
    local: u64,
    remote_offset: u64,
    remote_key: u64,
    aux: u32,
    window_flags: u8,
    operand0: u64,
    operand1: u64,
    /// ATOMIC_TO's destination port and width (bytes 60..62).
    destination_port: Option<u16>,
}

impl WorkRequest {
    /// Encoded size in bytes.
    pub const SIZE: usize = 64;

    /// Encodes the request.
    pub fn encode(&self) -> [u8; Self::SIZE] {
        let mut fields = Fields::default();
        let set_remote = |fields: &mut Fields, remote: &RemoteAddress| {
            fields.remote_port = remote.port;
            fields.node = remote.node;
            fields.remote_key = remote.key.0;
            fields.remote_offset = remote.offset;
        };
        match self.op {
            Operation::Nop | Operation::Query => {}
            Operation::Write { local, len, remote } | Operation::Read { local, len, remote } => {
                fields.local = local;
                fields.len = len;
                set_remote(&mut fields, &remote);
            }
            Operation::WriteInline { len, head, remote } => {
                fields.len = len;
                set_remote(&mut fields, &remote);
                fields.operand0 = u64::from_le_bytes(head[..8].try_into().expect("8 bytes"));
                fields.operand1 = u64::from_le_bytes(head[8..].try_into().expect("8 bytes"));
            }
            Operation::CompareSwap {
                remote,
                width,
                compare,
                swap,
            } => {
                set_remote(&mut fields, &remote);
                fields.aux = width.bytes();
                fields.operand0 = compare;
                fields.operand1 = swap;
            }
            Operation::FetchAdd { remote, width, add } => {
                set_remote(&mut fields, &remote);
                fields.aux = width.bytes();
                fields.operand0 = add;
            }
            Operation::Swap {
                remote,
                width,
                value,
            } => {
                set_remote(&mut fields, &remote);
                fields.aux = width.bytes();
                fields.operand0 = value;
            }
            Operation::FetchBitwise {
                remote,
                width,
                mask,
                ..
            } => {
                set_remote(&mut fields, &remote);
                fields.aux = width.bytes();
                fields.operand0 = mask;
            }
            Operation::AtomicTo {
                word,
                width,
                op,
                destination,
            } => {
                set_remote(&mut fields, &word);
                (fields.operand0, fields.operand1) = op.operands();
                fields.local = destination.key.0;
                let packed = pack_offset(destination.offset, destination.node);
                fields.len = packed as u32;
                fields.aux = (packed >> 32) as u32;
                let four = if width == AtomicWidth::Four {
                    ATOMIC_TO_FOUR
                } else {
                    0
                };
                // A port past the 15 bits (none exists) is sent as the
                // largest one: refused, never another port.
                let port = destination.port.min(ATOMIC_TO_FOUR - 1);
                fields.destination_port = Some(port | four);
            }
            Operation::Copy {
                source,
                destination,
                len,
            } => {
                set_remote(&mut fields, &destination);
                fields.len = len;
                fields.local = pack_offset(source.offset, source.node);
                fields.operand0 = source.key.0;
                fields.aux = u32::from(source.port);
            }
            Operation::BindWindow {
                start,
                len,
                access,
                peer,
            } => {
                fields.local = start;
                fields.operand0 = len;
                fields.aux = access.bits();
                if let Some(peer) = peer {
                    fields.remote_port = peer.port;
                    fields.node = peer.node;
                    fields.window_flags = WindowFlags::PEER.bits();
                }
            }
            Operation::RevokeWindow { key } => fields.remote_key = key.0,
            Operation::VectorWrite(vector) | Operation::VectorRead(vector) => {
                fields.local = vector.local;
                fields.len = vector.len;
                set_remote(&mut fields, &vector.remote);
                let mut flags = VectorFlags::empty();
                if let Descriptor::InMemory { iova, .. } = vector.descriptor {
                    fields.operand0 = iova;
                    flags |= VectorFlags::DESCRIPTOR_IN_MEMORY;
                }
                fields.aux = vector.descriptor.len();
                if let Some(immediate) = vector.notify {
                    fields.operand1 = immediate;
                    flags |= VectorFlags::NOTIFY_TARGET;
                }
                fields.window_flags = flags.bits();
            }
        }
        let mut bytes = [0u8; Self::SIZE];
        bytes[0] = self.op.opcode() as u8;
        bytes[1] = self.flags.bits();
        bytes[2..4].copy_from_slice(&fields.remote_port.to_le_bytes());
        bytes[4..8].copy_from_slice(&fields.len.to_le_bytes());
        bytes[8..16].copy_from_slice(&self.user_data.to_le_bytes());
        bytes[16..24].copy_from_slice(&fields.local.to_le_bytes());
        let remote = pack_offset(fields.remote_offset, fields.node);
        bytes[24..32].copy_from_slice(&remote.to_le_bytes());
        bytes[32..40].copy_from_slice(&fields.remote_key.to_le_bytes());
        bytes[40..48].copy_from_slice(&fields.operand0.to_le_bytes());
        bytes[48..56].copy_from_slice(&fields.operand1.to_le_bytes());
        bytes[56..60].copy_from_slice(&fields.aux.to_le_bytes());
        bytes[60] = fields.window_flags;
        if let Some(port) = fields.destination_port {
            bytes[60..62].copy_from_slice(&port.to_le_bytes());
        }
        bytes
    }

    /// Decodes and validates a request. Never panics.
    pub fn decode(bytes: &[u8]) -> Result<WorkRequest, DecodeError> {
        need(bytes, Self::SIZE)?;
        let opcode = Opcode::from_u8(bytes[0])?;
        let flags = WrFlags::from_bits(bytes[1]).ok_or(DecodeError::UnknownFlags(bytes[1]))?;
        let atomic_to = Opcode::ATOMIC_TO_RANGE.contains(&bytes[0]);
        reserved_zero(bytes, if atomic_to { 62..64 } else { 61..64 })?;
        let fields = Fields {
            remote_port: le_u16(bytes, 2),
            node: le_u16(bytes, 30),
            len: le_u32(bytes, 4),
            local: le_u64(bytes, 16),
            remote_offset: le_u64(bytes, 24) & MAX_REMOTE_OFFSET,
            remote_key: le_u64(bytes, 32),
            operand0: le_u64(bytes, 40),
            operand1: le_u64(bytes, 48),
            aux: le_u32(bytes, 56),
            window_flags: if atomic_to { 0 } else { bytes[60] },
            destination_port: atomic_to.then(|| le_u16(bytes, 60)),
        };
        let remote = RemoteAddress {
            node: fields.node,
            port: fields.remote_port,
            key: RemoteKey(fields.remote_key),
            offset: fields.remote_offset,
        };
        // Which fields the operation uses; the others must be zero.
        struct Uses {
            remote: bool,
            len: bool,
            local: bool,
            aux: bool,
            operand0: bool,
            operand1: bool,
            key_only: bool,
            peer: bool,
            window_flags: bool,
        }
        let none = Uses {
            remote: false,
            len: false,
            local: false,
            aux: false,
            operand0: false,
            operand1: false,
            key_only: false,
            peer: false,
            window_flags: false,
        };
        let (op, uses) = match opcode {
            Opcode::Nop => (Operation::Nop, none),
            Opcode::Query => (Operation::Query, none),
            Opcode::Write | Opcode::Read => {
                let op = if opcode == Opcode::Write {
                    Operation::Write {
                        local: fields.local,
                        len: fields.len,
                        remote,
                    }
                } else {
                    Operation::Read {
                        local: fields.local,
                        len: fields.len,
                        remote,
                    }
                };
                let uses = Uses {
                    remote: true,
                    len: true,
                    local: true,
                    ..none
                };
                (op, uses)
            }
            Opcode::WriteInline => {
                if fields.len > MAX_INLINE {
                    return Err(DecodeError::OutOfRange {
                        field: "inline length",
                        value: u64::from(fields.len),
                    });
                }
                let mut head = [0u8; INLINE_IN_REQUEST];
                head.copy_from_slice(&bytes[INLINE_OFFSET..INLINE_OFFSET + INLINE_IN_REQUEST]);
                let carried = (fields.len as usize).min(INLINE_IN_REQUEST);
                reserved_zero(
                    bytes,
                    INLINE_OFFSET + carried..INLINE_OFFSET + INLINE_IN_REQUEST,
                )?;
                let op = Operation::WriteInline {
                    len: fields.len,
                    head,
                    remote,
                };
                let uses = Uses {
                    remote: true,
                    len: true,
                    operand0: true,
                    operand1: true,
                    ..none
                };
                (op, uses)
            }
            Opcode::FetchAnd | Opcode::FetchOr | Opcode::FetchXor => {
                let width = AtomicWidth::from_bytes(fields.aux)?;
                let op = Operation::FetchBitwise {
                    remote,
                    width,
                    op: match opcode {
                        Opcode::FetchAnd => Bitwise::And,
                        Opcode::FetchOr => Bitwise::Or,
                        _ => Bitwise::Xor,
                    },
                    mask: width.check_operand("operand 0", fields.operand0)?,
                };
                let uses = Uses {
                    remote: true,
                    aux: true,
                    operand0: true,
                    ..none
                };
                (op, uses)
            }
            Opcode::AtomicToCompareSwap
            | Opcode::AtomicToFetchAdd
            | Opcode::AtomicToSwap
            | Opcode::AtomicToFetchAnd
            | Opcode::AtomicToFetchOr
            | Opcode::AtomicToFetchXor => {
                let packed_port = fields.destination_port.unwrap_or(0);
                let width = if packed_port & ATOMIC_TO_FOUR != 0 {
                    AtomicWidth::Four
                } else {
                    AtomicWidth::Eight
                };
                let first = width.check_operand("operand 0", fields.operand0)?;
                let second = width.check_operand("operand 1", fields.operand1)?;
                let bitwise = |op| AtomicOp::Bitwise { op, mask: first };
                let op = match opcode {
                    Opcode::AtomicToCompareSwap => AtomicOp::CompareSwap {
                        compare: first,
                        swap: second,
                    },
                    Opcode::AtomicToFetchAdd => AtomicOp::FetchAdd { add: first },
                    Opcode::AtomicToSwap => AtomicOp::Swap { value: first },
                    Opcode::AtomicToFetchAnd => bitwise(Bitwise::And),
                    Opcode::AtomicToFetchOr => bitwise(Bitwise::Or),
                    _ => bitwise(Bitwise::Xor),
                };
                let packed = u64::from(fields.len) | u64::from(fields.aux) << 32;
                let op = Operation::AtomicTo {
                    word: remote,
                    width,
                    op,
                    destination: RemoteAddress {
                        node: (packed >> 48) as u16,
                        port: packed_port & !ATOMIC_TO_FOUR,
                        key: RemoteKey(fields.local),
                        offset: packed & MAX_REMOTE_OFFSET,
                    },
                };
                let uses = Uses {
                    remote: true,
                    len: true,
                    local: true,
                    aux: true,
                    operand0: true,
                    operand1: opcode == Opcode::AtomicToCompareSwap,
                    ..none
                };
                (op, uses)
            }
            Opcode::Copy => {
                let source_port =
                    u16::try_from(fields.aux).map_err(|_| DecodeError::OutOfRange {
                        field: "source port",
                        value: u64::from(fields.aux),
                    })?;
                let op = Operation::Copy {
                    source: RemoteAddress {
                        node: (fields.local >> 48) as u16,
                        port: source_port,
                        key: RemoteKey(fields.operand0),
                        offset: fields.local & MAX_REMOTE_OFFSET,
                    },
                    destination: remote,
                    len: fields.len,
                };
                let uses = Uses {
                    remote: true,
                    len: true,
                    local: true,
                    aux: true,
                    operand0: true,
                    ..none
                };
                (op, uses)
            }
            Opcode::CompareSwap | Opcode::FetchAdd | Opcode::Swap => {
                let width = AtomicWidth::from_bytes(fields.aux)?;
                let first = width.check_operand("operand 0", fields.operand0)?;
                let op = match opcode {
                    Opcode::CompareSwap => Operation::CompareSwap {
                        remote,
                        width,
                        compare: first,
                        swap: width.check_operand("operand 1", fields.operand1)?,
                    },
                    Opcode::FetchAdd => Operation::FetchAdd {
                        remote,
                        width,
                        add: first,
                    },
                    _ => Operation::Swap {
                        remote,
                        width,
                        value: first,
                    },
                };
                let uses = Uses {
                    remote: true,
                    aux: true,
                    operand0: true,
                    operand1: opcode == Opcode::CompareSwap,
                    ..none
                };
                (op, uses)
            }
            Opcode::BindWindow => {
                let window_flags = WindowFlags::from_bits(fields.window_flags)
                    .ok_or(DecodeError::UnknownWindowFlags(fields.window_flags))?;
                let peer = window_flags
                    .contains(WindowFlags::PEER)
                    .then_some(PortAddress {
                        node: fields.node,
                        port: fields.remote_port,
                    });
                let access = Access::from_bits(fields.aux)
                    .filter(|access| !access.is_empty())
                    .ok_or(DecodeError::BadAccess(fields.aux))?;
                if fields.operand0 == 0
                    || fields.operand0 > MAX_REMOTE_OFFSET
                    || fields.local.checked_add(fields.operand0).is_none()
                {
                    return Err(DecodeError::OutOfRange {
                        field: "window length",
                        value: fields.operand0,
                    });
                }
                let op = Operation::BindWindow {
                    start: fields.local,
                    len: fields.operand0,
                    access,
                    peer,
                };
                let uses = Uses {
                    local: true,
                    aux: true,
                    operand0: true,
                    peer: peer.is_some(),
                    window_flags: true,
                    ..none
                };
                (op, uses)
            }
            Opcode::VectorWrite | Opcode::VectorRead => {
                let vector_flags = VectorFlags::from_bits(fields.window_flags)
                    .ok_or(DecodeError::UnknownFlags(fields.window_flags))?;
                let in_memory = vector_flags.contains(VectorFlags::DESCRIPTOR_IN_MEMORY);
                let notify = vector_flags.contains(VectorFlags::NOTIFY_TARGET);
                if notify && opcode == Opcode::VectorRead {
                    return Err(DecodeError::OutOfRange {
                        field: "vector flags (NOTIFY_TARGET on VECTOR_READ)",
                        value: u64::from(fields.window_flags),
                    });
                }
                let descriptor = if in_memory {
                    Descriptor::InMemory {
                        iova: fields.operand0,
                        len: fields.aux,
                    }
                } else {
                    if fields.aux > MAX_INLINE {
                        return Err(DecodeError::OutOfRange {
                            field: "inline descriptor length",
                            value: u64::from(fields.aux),
                        });
                    }
                    Descriptor::Inline { len: fields.aux }
                };
                if descriptor.is_empty() {
                    return Err(DecodeError::OutOfRange {
                        field: "descriptor length",
                        value: 0,
                    });
                }
                let vector = VectorTransfer {
                    local: fields.local,
                    len: fields.len,
                    remote,
                    descriptor,
                    notify: notify.then_some(fields.operand1),
                };
                let op = if opcode == Opcode::VectorWrite {
                    Operation::VectorWrite(vector)
                } else {
                    Operation::VectorRead(vector)
                };
                let uses = Uses {
                    remote: true,
                    len: true,
                    local: true,
                    aux: true,
                    operand0: in_memory,
                    operand1: notify,
                    window_flags: true,
                    ..none
                };
                (op, uses)
            }
            Opcode::RevokeWindow => (
                Operation::RevokeWindow {
                    key: RemoteKey(fields.remote_key),
                },
                Uses {
                    key_only: true,
                    ..none
                },
            ),
        };
        let unused_nonzero = [
            (!uses.remote && !uses.key_only && fields.remote_key != 0, 32),
            (!uses.remote && !uses.peer && fields.remote_port != 0, 2),
            (!uses.remote && !uses.peer && fields.node != 0, 30),
            (!uses.remote && fields.remote_offset != 0, 24),
            (!uses.len && fields.len != 0, 4),
            (!uses.local && fields.local != 0, 16),
            (!uses.aux && fields.aux != 0, 56),
            (!uses.window_flags && fields.window_flags != 0, 60),
            (!uses.operand0 && fields.operand0 != 0, 40),
            (!uses.operand1 && fields.operand1 != 0, 48),
        ];
        if let Some(&(_, offset)) = unused_nonzero.iter().find(|(bad, _)| *bad) {
            return Err(DecodeError::ReservedNotZero { offset });
        }
        Ok(WorkRequest {
            user_data: le_u64(bytes, 8),
            flags,
            op,
        })
    }
}
