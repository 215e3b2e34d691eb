//! Completions: what the device reports back.
//!
//! Layout (32 bytes, little-endian):
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 8 | user data of the request |
//! | 8 | 1 | status ([`Status`]) |
//! | 9 | 1 | opcode of the request; 0xff when the request could not be decoded |
//! | 10 | 1 | error detail ([`ErrorDetail`]) |
//! | 11 | 1 | kind: 0 the port's own request, 1 an arrival ([`Arrival`]) |
//! | 12 | 4 | bytes transferred |
//! | 16 | 8 | value: old word (atomics), new 64-bit key (BIND), device information (QUERY); arrival: the window's key |
//! | 24 | 2 | arrival: the port that wrote; else zero |
//! | 26 | 2 | arrival: the node of the port that wrote; else zero |
//! | 28 | 4 | reserved, zero |
//!
//! **Arrivals.** When a VECTOR_WRITE with
//! [`NOTIFY_TARGET`](crate::VectorFlags::NOTIFY_TARGET) has moved all its
//! bytes, the device puts an arrival into the *target* port's admin
//! queue pair's completion queue ([`ADMIN_QUEUE_PAIR`](crate::ADMIN_QUEUE_PAIR)),
//! after the bytes are in place: kind 1, status success, opcode
//! VECTOR_WRITE, user data = the request's immediate value, bytes = the
//! bytes written, value = the key of the window written through, bytes
//! 24..28 = the writer's port and node ([`Completion::arrival`]). A
//! writer on another node of the fabric is named the same way. The target port
//! holds a bounded number of arrivals its driver has not taken yet; a
//! write whose arrival would not fit fails ([`Status::LimitReached`],
//! [`ErrorDetail::NoticeLimit`]), so no arrival is dropped: on one node
//! before it moves a byte, from another node before its last part lands
//! (its earlier parts have).

use std::fmt;

use crate::error::{le_u32, le_u64, need, reserved_zero, DecodeError};
use crate::request::Opcode;

/// How a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Status {
    /// Done.
    Success = 0,
    /// The target refused a remote access: no live window of the target
    /// grants this access to the initiating port. The key is unknown or
    /// revoked, the window is bound to another port, the range reaches
    /// outside the window or the owner's registered memory, or the window
    /// lacks the right. Every such refusal carries
    /// [`ErrorDetail::NotGranted`], whatever the cause, so that the answer
    /// tells a guesser nothing about which keys exist; the owner's device
    /// counters tell the causes apart. Remote memory is untouched.
    RemoteAccessError = 1,
    /// The local address is not registered with the device (or not
    /// writable). Memory is untouched.
    LocalProtectionError = 2,
    /// The request itself is malformed or unsupported.
    InvalidRequest = 3,
    /// The target port has no live peer.
    PeerGone = 4,
    /// A limit of the device is reached (see the detail); nothing changed.
    LimitReached = 5,
}

impl Status {
    /// The status with code `code`, as a completion carries it.
    pub fn from_u8(code: u8) -> Result<Status, DecodeError> {
        Ok(match code {
            0 => Status::Success,
            1 => Status::RemoteAccessError,
            2 => Status::LocalProtectionError,
            3 => Status::InvalidRequest,
            4 => Status::PeerGone,
            5 => Status::LimitReached,
            other => return Err(DecodeError::UnknownStatus(other)),
        })
    }

    /// What the status means, in a few words.
    pub fn describe(self) -> &'static str {
        match self {
            Status::Success => "success",
            Status::RemoteAccessError => "remote access refused",
            Status::LocalProtectionError => "local memory not usable",
            Status::InvalidRequest => "invalid request",
            Status::PeerGone => "peer gone",
            Status::LimitReached => "device limit reached",
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.describe())
    }
}

/// Why a request failed, in more detail than its [`Status`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ErrorDetail {
    /// No detail (success).
    None = 0,
    /// A remote access no live window grants (with
    /// [`Status::RemoteAccessError`]): the one answer for an unknown or
    /// revoked key, a window bound to another port, a range outside the
    /// window or the owner's registered memory, and a missing right.
    NotGranted = 1,
    /// REVOKE_WINDOW names no live window of the initiating port.
    UnknownWindow = 2,
    /// BIND_WINDOW on a port that holds as many windows as the device
    /// allows per port (the device's `--max-windows-per-port`); revoke one
    /// first. Nothing was bound.
    WindowLimit = 3,
    /// An atomic on a word that is not aligned to its width.
    Misaligned = 4,
    /// Local memory not registered with the device.
    Unregistered = 5,
    /// The request's bytes did not decode.
    Malformed = 6,
    /// No such port.
    UnknownPort = 7,
    /// The port exists but no driver is connected to it.
    PortDown = 8,
    /// A valid request this device does not carry out.
    Unsupported = 9,
    /// A vector transfer whose local or remote pattern does not cover
    /// exactly the request's length (with [`Status::InvalidRequest`]):
    /// nothing moved.
    LengthMismatch = 10,
    /// A vector transfer's descriptor or block lists are larger than the
    /// device allows (its `--max-descriptor-bytes`,
    /// `--max-pattern-blocks`; with [`Status::LimitReached`]): nothing
    /// moved.
    PatternLimit = 11,
    /// The target port could not take the arrival notice a VECTOR_WRITE
    /// with [`NOTIFY_TARGET`](crate::VectorFlags::NOTIFY_TARGET) asked
    /// for (its notices waiting are at the device's bound, or no driver
    /// is connected to take them; with [`Status::LimitReached`]): nothing
    /// moved.
    NoticeLimit = 12,
    /// The remote address names a node this device's fabric does not know
    /// (with [`Status::InvalidRequest`]); nothing was sent.
    UnknownNode = 13,
    /// The target node's device stopped answering for longer than the
    /// fabric's peer timeout, or restarted while the request was in
    /// flight (with [`Status::PeerGone`]). A write may have landed in
    /// part; nothing of the request is in flight any more.
    NodeUnreachable = 14,
    /// The target node has as many operations of this fabric waiting as
    /// it serves at once (with [`Status::LimitReached`]); nothing moved.
    NodeBusy = 15,
}

impl ErrorDetail {
    /// The detail with code `code`, as a completion carries it.
    pub fn from_u8(code: u8) -> Result<ErrorDetail, DecodeError> {
        Ok(match code {
            0 => ErrorDetail::None,
            1 => ErrorDetail::NotGranted,
            2 => ErrorDetail::UnknownWindow,
            3 => ErrorDetail::WindowLimit,
            4 => ErrorDetail::Misaligned,
            5 => ErrorDetail::Unregistered,
            6 => ErrorDetail::Malformed,
            7 => ErrorDetail::UnknownPort,
            8 => ErrorDetail::PortDown,
            9 => ErrorDetail::Unsupported,
            10 => ErrorDetail::LengthMismatch,
            11 => ErrorDetail::PatternLimit,
            12 => ErrorDetail::NoticeLimit,
            13 => ErrorDetail::UnknownNode,
            14 => ErrorDetail::NodeUnreachable,
            15 => ErrorDetail::NodeBusy,
            other => return Err(DecodeError::UnknownDetail(other)),
        })
    }

    /// What the detail means, in a sentence.
    pub fn describe(self) -> &'static str {
        match self {
            ErrorDetail::None => "no detail",
            ErrorDetail::NotGranted => {
                "no live window of the target grants this access to this port"
            }
            ErrorDetail::UnknownWindow => "this port has no live window with that key",
            ErrorDetail::WindowLimit => {
                "the port holds as many windows as the device allows per port \
                 (pindown-emu-device --max-windows-per-port); revoke one first"
            }
            ErrorDetail::Misaligned => "atomic word not aligned to its width",
            ErrorDetail::Unregistered => "local memory not registered with the device",
            ErrorDetail::Malformed => "the request did not decode",
            ErrorDetail::UnknownPort => "no such port",
            ErrorDetail::PortDown => "no driver is connected to the target port",
            ErrorDetail::Unsupported => "the device does not carry out this request",
            ErrorDetail::LengthMismatch => {
                "the vector transfer's patterns do not both cover the request's length"
            }
            ErrorDetail::PatternLimit => {
                "the vector transfer's descriptor or block lists are larger than the device \
                 allows (pindown-emu-device --max-descriptor-bytes, --max-pattern-blocks)"
            }
            ErrorDetail::NoticeLimit => "the target port cannot take an arrival notice now",
            ErrorDetail::UnknownNode => {
                "no such node in this device's fabric (pindown-emu-device --fabric-peer)"
            }
            ErrorDetail::NodeUnreachable => {
                "the target node's device did not answer within the fabric's peer timeout, \
                 or restarted (pindown-emu-device --peer-timeout)"
            }
            ErrorDetail::NodeBusy => "the target node serves as many operations as it can now",
        }
    }
}

impl fmt::Display for ErrorDetail {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.describe())
    }
}

/// What an arrival completion tells the target of a VECTOR_WRITE with
/// [`NOTIFY_TARGET`](crate::VectorFlags::NOTIFY_TARGET) (see the
/// completion layout in [`Completion`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Arrival {
    /// The port that wrote, and its node.
    pub peer: crate::PortAddress,
    /// The window it wrote through.
    pub key: crate::RemoteKey,
    /// Bytes written.
    pub bytes: u32,
    /// The writer's immediate value.
    pub immediate: u64,
}

/// One completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The request's user data.
    pub user_data: u64,
    /// How it ended.
    pub status: Status,
    /// Why, when it failed.
    pub detail: ErrorDetail,
    /// The request's opcode; `None` when the request did not decode.
    pub opcode: Option<Opcode>,
    /// Bytes moved.
    pub byte_len: u32,
    /// Old word (atomics), key (BIND), device information (QUERY), the
    /// window's key (an arrival), else 0.
    pub value: u64,
    /// `Some(port)`: this completion is an [`Arrival`] from `port` (of
    /// any node), not the outcome of a request of this port's.
    pub arrival_from: Option<crate::PortAddress>,
}

/// Byte 11: a completion of the port's own request.
const KIND_OWN: u8 = 0;
/// Byte 11: an arrival.
const KIND_ARRIVAL: u8 = 1;

const UNDECODED_OPCODE: u8 = 0xff;

/// A request that failed, as its completion reports it. Its text names the
/// request (user data and opcode), the status and the detail, e.g.
/// `request 0x7 (WRITE) failed: remote access refused (no live window of
/// the target grants this access to this port)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, thiserror::Error)]
#[error(
    "request {user_data:#x} ({}) failed: {status} ({detail})",
    opcode.map_or("undecodable", Opcode::name)
)]
pub struct CompletionError {
    /// The request's user data.
    pub user_data: u64,
    /// The request's opcode; `None` when the request did not decode.
    pub opcode: Option<Opcode>,
    /// How it ended (never [`Status::Success`]).
    pub status: Status,
    /// Why.
    pub detail: ErrorDetail,
}

impl Completion {
    /// Encoded size in bytes.
    pub const SIZE: usize = 32;

    /// A successful completion.
    pub fn success(user_data: u64, opcode: Opcode, byte_len: u32, value: u64) -> Self {
        Completion {
            user_data,
            status: Status::Success,
            detail: ErrorDetail::None,
            opcode: Some(opcode),
            byte_len,
            value,
            arrival_from: None,
        }
    }

    /// The arrival completion of `arrival` (see [`Arrival`]).
    pub fn arrival_notice(arrival: Arrival) -> Self {
        Completion {
            user_data: arrival.immediate,
            status: Status::Success,
            detail: ErrorDetail::None,
            opcode: Some(Opcode::VectorWrite),
            byte_len: arrival.bytes,
            value: arrival.key.0,
            arrival_from: Some(arrival.peer),
        }
    }

    /// The arrival this completion reports, if it is one.
    pub fn arrival(&self) -> Option<Arrival> {
        self.arrival_from.map(|peer| Arrival {
            peer,
            key: crate::RemoteKey(self.value),
            bytes: self.byte_len,
            immediate: self.user_data,
        })
    }

    /// A failed completion.
    pub fn error(
        user_data: u64,
        opcode: Option<Opcode>,
        status: Status,
        detail: ErrorDetail,
    ) -> Self {
        Completion {
            user_data,
            status,
            detail,
            opcode,
            byte_len: 0,
            value: 0,
            arrival_from: None,
        }
    }

    /// Whether the request succeeded.
    pub fn is_success(&self) -> bool {
        self.status == Status::Success
    }

    /// The request's outcome: its value (the old word of an atomic, the key
    /// of a BIND, the device information of a QUERY, else 0) on success,
    /// else what went wrong.
    pub fn result(&self) -> Result<u64, CompletionError> {
        if self.is_success() {
            Ok(self.value)
        } else {
            Err(CompletionError {
                user_data: self.user_data,
                opcode: self.opcode,
                status: self.status,
                detail: self.detail,
            })
        }
    }

    /// Encodes the completion.
    pub fn encode(&self) -> [u8; Self::SIZE] {
        let mut bytes = [0u8; Self::SIZE];
        bytes[0..8].copy_from_slice(&self.user_data.to_le_bytes());
        bytes[8] = self.status as u8;
        bytes[9] = self.opcode.map_or(UNDECODED_OPCODE, |op| op as u8);
        bytes[10] = self.detail as u8;
        bytes[12..16].copy_from_slice(&self.byte_len.to_le_bytes());
        bytes[16..24].copy_from_slice(&self.value.to_le_bytes());
        if let Some(peer) = self.arrival_from {
            bytes[11] = KIND_ARRIVAL;
            bytes[24..26].copy_from_slice(&peer.port.to_le_bytes());
            bytes[26..28].copy_from_slice(&peer.node.to_le_bytes());
        }
        bytes
    }

    /// Decodes and validates a completion. Never panics.
    pub fn decode(bytes: &[u8]) -> Result<Completion, DecodeError> {
        need(bytes, Self::SIZE)?;
        let arrival_from = match bytes[11] {
            KIND_OWN => {
                reserved_zero(bytes, 24..32)?;
                None
            }
            KIND_ARRIVAL => {
                reserved_zero(bytes, 28..32)?;
                Some(crate::PortAddress {
                    port: crate::error::le_u16(bytes, 24),
                    node: crate::error::le_u16(bytes, 26),
                })
            }
            _ => reserved_zero(bytes, 11..12).map(|()| None)?,
        };
        let opcode = match bytes[9] {
            UNDECODED_OPCODE => None,
            code => Some(Opcode::from_u8(code)?),
        };
        Ok(Completion {
            user_data: le_u64(bytes, 0),
            status: Status::from_u8(bytes[8])?,
            opcode,
            detail: ErrorDetail::from_u8(bytes[10])?,
            byte_len: le_u32(bytes, 12),
            value: le_u64(bytes, 16),
            arrival_from,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_arrival_round_trips_and_own_completions_keep_their_reserved_bytes_zero() {
        let arrival = Arrival {
            peer: crate::PortAddress {
                node: 0x0102,
                port: 3,
            },
            key: crate::RemoteKey(0x1234_5678_9abc_def0),
            bytes: 4096,
            immediate: 77,
        };
        let notice = Completion::arrival_notice(arrival);
        let bytes = notice.encode();
        assert_eq!(bytes[11], KIND_ARRIVAL);
        let decoded = Completion::decode(&bytes).unwrap();
        assert_eq!(decoded.arrival(), Some(arrival));
        assert_eq!(decoded.opcode, Some(Opcode::VectorWrite));
        let own = Completion::success(1, Opcode::Write, 8, 0);
        assert_eq!(Completion::decode(&own.encode()).unwrap().arrival(), None);
        let mut bad = own.encode();
        bad[24] = 1;
        assert!(Completion::decode(&bad).is_err(), "a port only in arrivals");
        let mut bad = bytes;
        bad[11] = 2;
        assert!(Completion::decode(&bad).is_err(), "unknown kind");
        let mut bad = own.encode();
        bad[26] = 1;
        assert!(Completion::decode(&bad).is_err(), "a node only in arrivals");
        let mut bad = bytes;
        bad[28] = 1;
        assert!(Completion::decode(&bad).is_err());
    }

    #[test]
    fn result_gives_the_value_or_an_error_naming_request_status_and_detail() {
        let done = Completion::success(7, Opcode::FetchAdd, 8, 41);
        assert_eq!(done.result(), Ok(41));
        let failed = Completion::error(
            9,
            Some(Opcode::Write),
            Status::RemoteAccessError,
            ErrorDetail::NotGranted,
        );
        let error = failed.result().unwrap_err();
        assert_eq!(
            (error.user_data, error.opcode, error.status, error.detail),
            (
                9,
                Some(Opcode::Write),
                Status::RemoteAccessError,
                ErrorDetail::NotGranted
            )
        );
        assert_eq!(
            error.to_string(),
            format!(
                "request 0x9 (WRITE) failed: {} ({})",
                Status::RemoteAccessError.describe(),
                ErrorDetail::NotGranted.describe()
            )
        );
        let undecoded = Completion::error(5, None, Status::InvalidRequest, ErrorDetail::Malformed);
        assert!(undecoded
            .result()
            .unwrap_err()
            .to_string()
            .contains("(undecodable)"));
    }
}
