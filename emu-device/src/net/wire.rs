//! The datagram format of the fabric: one fixed header, then the payload.
//!
//! All fields are little-endian. [`Header::decode`] validates every field
//! and returns an error, never panics, whatever the bytes.
//!
//! | offset | size | field             | meaning                                                       |
//! |-------:|-----:|-------------------|---------------------------------------------------------------|
//! |      0 |    2 | magic             | [`MAGIC`]                                                     |
//! |      2 |    1 | version           | [`VERSION`]                                                   |
//! |      3 |    1 | flags             | [`FLAG_DATA`], [`FLAG_REPLY`], [`FLAG_PROBE`], [`FLAG_PROBE_ECHO`]; other bits zero |
//! |      4 |    8 | fabric            | the job token every device of the fabric shares               |
//! |     12 |    2 | source node       |                                                               |
//! |     14 |    2 | destination node  |                                                               |
//! |     16 |    8 | source incarnation| nonzero, random per device start                              |
//! |     24 |    8 | dest. incarnation | as the sender knows it; 0 = not known yet                     |
//! |     32 |    4 | seq               | the message's sequence number in its stream; 0 in a pure ack  |
//! |     36 |    4 | horizon           | the sender's next unassigned reply seq to the destination     |
//! |     40 |   16 | requests          | [`StreamHeader`] of the request stream                        |
//! |     56 |   16 | replies           | [`StreamHeader`] of the reply stream                          |
//! |     72 |    2 | payload length    | exactly the bytes after the header; 0 in a pure ack           |
//! |     74 |    2 | reserved          | zero                                                          |
//!
//! A [`StreamHeader`] (per stream, both directions' state in one place):
//!
//! | offset | size | field | meaning                                                                   |
//! |-------:|-----:|-------|---------------------------------------------------------------------------|
//! |      0 |    4 | ack   | cumulative: every seq of the receiver's stream below it was delivered     |
//! |      4 |    4 | floor | every seq of the sender's stream below it is acknowledged or abandoned    |
//! |      8 |    8 | sack  | bit `i`: seq `ack + 1 + i` of the receiver's stream was delivered         |

use super::{NodeId, Seq};

/// First two bytes of every datagram ("pd" read as little-endian).
pub const MAGIC: u16 = u16::from_le_bytes(*b"pd");
/// Version of this format (2: timeout probes and their echo).
pub const VERSION: u8 = 2;
/// Flag: the datagram carries a message (`seq` and payload are meaningful).
pub const FLAG_DATA: u8 = 1;
/// Flag: the message belongs to the reply stream (replies are never
/// answered); only with [`FLAG_DATA`].
pub const FLAG_REPLY: u8 = 2;
/// Flag: the message is sent again as the probe of a retransmission
/// timeout; only with [`FLAG_DATA`].
pub const FLAG_PROBE: u8 = 4;
/// Flag: the sender received a probe from the destination since its last
/// datagram with this flag (so everything the destination sent before
/// that probe has arrived, or never will).
pub const FLAG_PROBE_ECHO: u8 = 8;
/// Bytes of the header in front of the payload.
pub const HEADER_LEN: usize = 76;
/// Sequence numbers compare modulo 2^32: `b` is after `a` when
/// `b - a` (wrapping) is below this.
pub const SEQ_HALF_RANGE: u32 = 1 << 31;

/// `true` when `a` precedes `b` in the wrapping sequence space.
pub fn seq_before(a: Seq, b: Seq) -> bool {
    let distance = b.wrapping_sub(a);
    distance != 0 && distance < SEQ_HALF_RANGE
}

/// `true` when `a` precedes or equals `b` in the wrapping sequence space.
pub fn seq_at_or_before(a: Seq, b: Seq) -> bool {
    b.wrapping_sub(a) < SEQ_HALF_RANGE
}

/// One stream's acknowledgement state in a header: `ack` and `sack`
/// describe what the sender of the header delivered of the destination's
/// stream, `floor` the sender's own stream towards the destination.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StreamHeader {
    /// Cumulative acknowledgement: every seq below it was delivered.
    pub ack: Seq,
    /// Every seq of the sender below this is acknowledged or abandoned.
    pub floor: Seq,
    /// Selective acknowledgement: bit `i` set = seq `ack + 1 + i` delivered.
    pub sack: u64,
}

impl StreamHeader {
    fn encode(&self, out: &mut [u8]) {
        out[0..4].copy_from_slice(&self.ack.to_le_bytes());
        out[4..8].copy_from_slice(&self.floor.to_le_bytes());
        out[8..16].copy_from_slice(&self.sack.to_le_bytes());
    }
}

/// The decoded header of one datagram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Job token shared by every device of the fabric.
    pub fabric: u64,
    /// Sending node.
    pub source: NodeId,
    /// Receiving node.
    pub destination: NodeId,
    /// The sender's incarnation (nonzero).
    pub source_incarnation: u64,
    /// The receiver's incarnation as the sender knows it; 0 = not known.
    pub destination_incarnation: u64,
    /// The message's sequence number, `None` for a pure acknowledgement.
    pub seq: Option<Seq>,
    /// The message belongs to the reply stream; `false` without a message.
    pub reply: bool,
    /// The message is a timeout probe ([`FLAG_PROBE`]); `false` without a
    /// message.
    pub probe: bool,
    /// A probe from the destination was received ([`FLAG_PROBE_ECHO`]).
    pub probe_echo: bool,
    /// The sender's next unassigned reply seq towards the destination when
    /// the header was built.
    pub horizon: Seq,
    /// The request stream's acknowledgement state.
    pub requests: StreamHeader,
    /// The reply stream's acknowledgement state.
    pub replies: StreamHeader,
    /// Bytes of payload following the header.
    pub payload_len: u16,
}

/// Why bytes are not a datagram of this format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Fewer bytes than a header.
    #[error("datagram of {0} bytes is shorter than the {HEADER_LEN}-byte header")]
    Truncated(usize),
    /// The magic number does not match.
    #[error("bad magic {0:#06x}")]
    BadMagic(u16),
    /// A version this code does not speak.
    #[error("unsupported version {0}")]
    BadVersion(u8),
    /// Unknown flag bits or a nonzero reserved field.
    #[error("reserved bits set")]
    ReservedBits,
    /// The payload length disagrees with the datagram's size.
    #[error("payload length {declared} but {actual} bytes follow the header")]
    LengthMismatch {
        /// What the header declares.
        declared: u16,
        /// What follows the header.
        actual: usize,
    },
    /// The source incarnation is zero.
    #[error("zero source incarnation")]
    ZeroIncarnation,
    /// A pure acknowledgement with a seq or payload.
    #[error("pure acknowledgement with a seq or payload")]
    AckWithData,
    /// A message below its stream's floor, or a reply seq or reply floor
    /// not below the horizon.
    #[error("inconsistent seq {seq}, floor {floor}, horizon {horizon}")]
    InconsistentSeq {
        /// The message's seq (0 for a pure acknowledgement).
        seq: Seq,
        /// The floor of the message's stream (of the reply stream for a
        /// pure acknowledgement).
        floor: Seq,
        /// The declared horizon.
        horizon: Seq,
    },
}

impl Header {
    /// Writes the header into the first [`HEADER_LEN`] bytes of `buf`.
    ///
    /// # Panics
    /// When `buf` is shorter than [`HEADER_LEN`] (a caller bug).
    pub fn encode(&self, buf: &mut [u8]) {
        let out = &mut buf[..HEADER_LEN];
        out[0..2].copy_from_slice(&MAGIC.to_le_bytes());
        out[2] = VERSION;
        let message = match (self.seq, self.reply) {
            (None, _) => 0,
            (Some(_), false) => FLAG_DATA,
            (Some(_), true) => FLAG_DATA | FLAG_REPLY,
        };
        let probe = if self.seq.is_some() && self.probe {
            FLAG_PROBE
        } else {
            0
        };
        let echo = if self.probe_echo { FLAG_PROBE_ECHO } else { 0 };
        out[3] = message | probe | echo;
        out[4..12].copy_from_slice(&self.fabric.to_le_bytes());
        out[12..14].copy_from_slice(&self.source.to_le_bytes());
        out[14..16].copy_from_slice(&self.destination.to_le_bytes());
        out[16..24].copy_from_slice(&self.source_incarnation.to_le_bytes());
        out[24..32].copy_from_slice(&self.destination_incarnation.to_le_bytes());
        out[32..36].copy_from_slice(&self.seq.unwrap_or(0).to_le_bytes());
        out[36..40].copy_from_slice(&self.horizon.to_le_bytes());
        self.requests.encode(&mut out[40..56]);
        self.replies.encode(&mut out[56..72]);
        out[72..74].copy_from_slice(&self.payload_len.to_le_bytes());
        out[74..76].copy_from_slice(&0u16.to_le_bytes());
    }

    /// Decodes and validates one datagram; returns the header and the
    /// payload that follows it.
    pub fn decode(datagram: &[u8]) -> Result<(Header, &[u8]), WireError> {
        let Some((head, payload)) = datagram.split_first_chunk::<HEADER_LEN>() else {
            return Err(WireError::Truncated(datagram.len()));
        };
        let u16_at = |at: usize| u16::from_le_bytes([head[at], head[at + 1]]);
        let u32_at =
            |at: usize| u32::from_le_bytes([head[at], head[at + 1], head[at + 2], head[at + 3]]);
        let u64_at = |at: usize| {
            let mut bytes = [0u8; 8];
            bytes.copy_from_slice(&head[at..at + 8]);
            u64::from_le_bytes(bytes)
        };
        let magic = u16_at(0);
        if magic != MAGIC {
            return Err(WireError::BadMagic(magic));
        }
        if head[2] != VERSION {
            return Err(WireError::BadVersion(head[2]));
        }
        let flags = head[3];
        let known_flags = if flags & FLAG_DATA != 0 {
            FLAG_DATA | FLAG_REPLY | FLAG_PROBE | FLAG_PROBE_ECHO
        } else {
            FLAG_PROBE_ECHO
        };
        if flags & !known_flags != 0 || u16_at(74) != 0 {
            return Err(WireError::ReservedBits);
        }
        let payload_len = u16_at(72);
        if usize::from(payload_len) != payload.len() {
            return Err(WireError::LengthMismatch {
                declared: payload_len,
                actual: payload.len(),
            });
        }
        let source_incarnation = u64_at(16);
        if source_incarnation == 0 {
            return Err(WireError::ZeroIncarnation);
        }
        let raw_seq = u32_at(32);
        let horizon = u32_at(36);
        let stream_at = |at: usize| StreamHeader {
            ack: u32_at(at),
            floor: u32_at(at + 4),
            sack: u64_at(at + 8),
        };
        let requests = stream_at(40);
        let replies = stream_at(56);
        let seq = if flags & FLAG_DATA != 0 {
            Some(raw_seq)
        } else {
            if raw_seq != 0 || payload_len != 0 {
                return Err(WireError::AckWithData);
            }
            None
        };
        // Reply floor <= horizon; a message at or above its stream's floor,
        // a reply below the horizon.
        let reply = flags & FLAG_REPLY != 0;
        let floor = if reply || seq.is_none() {
            replies.floor
        } else {
            requests.floor
        };
        let consistent = seq_at_or_before(replies.floor, horizon)
            && match seq {
                Some(seq) => seq_at_or_before(floor, seq) && (!reply || seq_before(seq, horizon)),
                None => true,
            };
        if !consistent {
            return Err(WireError::InconsistentSeq {
                seq: raw_seq,
                floor,
                horizon,
            });
        }
        let header = Header {
            fabric: u64_at(4),
            source: u16_at(12),
            destination: u16_at(14),
            source_incarnation,
            destination_incarnation: u64_at(24),
            seq,
            reply,
            probe: flags & FLAG_PROBE != 0,
            probe_echo: flags & FLAG_PROBE_ECHO != 0,
            horizon,
            requests,
            replies,
            payload_len,
        };
        Ok((header, payload))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample(seq: Option<Seq>, payload_len: u16) -> Header {
        Header {
            fabric: 0x0123_4567_89ab_cdef,
            source: 3,
            destination: 9,
            source_incarnation: 77,
            destination_incarnation: 0,
            seq,
            reply: seq.is_some(),
            probe: seq.is_some(),
            probe_echo: true,
            horizon: seq.map_or(12, |seq| seq.wrapping_add(4)),
            requests: StreamHeader {
                ack: 5,
                floor: 1,
                sack: 0b1011,
            },
            replies: StreamHeader {
                ack: 8,
                floor: seq.map_or(10, |seq| seq.wrapping_sub(2)),
                sack: 1 << 63,
            },
            payload_len,
        }
    }

    #[test]
    fn round_trip_with_payload() {
        let header = sample(Some(u32::MAX), 3);
        let mut datagram = vec![0u8; HEADER_LEN + 3];
        header.encode(&mut datagram);
        datagram[HEADER_LEN..].copy_from_slice(b"abc");
        let (decoded, payload) = Header::decode(&datagram).unwrap();
        assert_eq!(decoded, header);
        assert_eq!(payload, b"abc");
    }

    #[test]
    fn every_field_is_validated() {
        let mut good = vec![0u8; HEADER_LEN + 2];
        sample(Some(40), 2).encode(&mut good);
        assert!(Header::decode(&good).is_ok());
        let broken = |change: &dyn Fn(&mut Vec<u8>)| {
            let mut bytes = good.clone();
            change(&mut bytes);
            Header::decode(&bytes).unwrap_err()
        };
        assert_eq!(broken(&|b| b.truncate(10)), WireError::Truncated(10));
        assert!(matches!(broken(&|b| b[0] ^= 1), WireError::BadMagic(_)));
        assert_eq!(broken(&|b| b[2] = 1), WireError::BadVersion(1));
        assert_eq!(broken(&|b| b[3] |= 16), WireError::ReservedBits);
        // A reply flag, or a probe flag, without a message.
        let mut ack = vec![0u8; HEADER_LEN];
        sample(None, 0).encode(&mut ack);
        assert!(Header::decode(&ack).unwrap().0.probe_echo);
        for flag in [FLAG_REPLY, FLAG_PROBE] {
            let mut bytes = ack.clone();
            bytes[3] |= flag;
            assert_eq!(Header::decode(&bytes).unwrap_err(), WireError::ReservedBits);
        }
        assert_eq!(broken(&|b| b[75] = 1), WireError::ReservedBits);
        assert!(matches!(
            broken(&|b| b.push(0)),
            WireError::LengthMismatch {
                declared: 2,
                actual: 3
            }
        ));
        assert_eq!(broken(&|b| b[16..24].fill(0)), WireError::ZeroIncarnation);
        // Pure ack flag with a payload.
        assert_eq!(broken(&|b| b[3] = 0), WireError::AckWithData);
        // Horizon not after the reply's seq.
        assert!(matches!(
            broken(&|b| b[36..40].copy_from_slice(&40u32.to_le_bytes())),
            WireError::InconsistentSeq { .. }
        ));
        // Reply floor after the reply's seq.
        assert!(matches!(
            broken(&|b| b[60..64].copy_from_slice(&41u32.to_le_bytes())),
            WireError::InconsistentSeq { .. }
        ));
        // A request below the request floor.
        assert!(matches!(
            broken(&|b| {
                b[3] = FLAG_DATA;
                b[44..48].copy_from_slice(&41u32.to_le_bytes());
            }),
            WireError::InconsistentSeq { .. }
        ));
    }

    #[test]
    fn wrapping_comparisons() {
        assert!(seq_before(u32::MAX, 0));
        assert!(!seq_before(0, u32::MAX));
        assert!(seq_at_or_before(7, 7));
        assert!(!seq_before(7, 7));
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = Header::decode(&bytes);
        }

        #[test]
        fn encode_decode_round_trip(
            fabric in any::<u64>(), source in any::<u16>(), destination in any::<u16>(),
            source_incarnation in 1..u64::MAX, destination_incarnation in any::<u64>(),
            seq in proptest::option::of(any::<u32>()), reply in any::<bool>(),
            probe in any::<bool>(), probe_echo in any::<bool>(),
            acks in any::<[u32; 2]>(), sacks in any::<[u64; 2]>(),
            ahead in 1u32..1000, behind in 0u32..1000, len in 0u16..64,
        ) {
            let len = if seq.is_some() { len } else { 0 };
            let base = seq.unwrap_or(acks[0]);
            let floor = base.wrapping_sub(behind);
            let header = Header {
                fabric, source, destination, source_incarnation, destination_incarnation,
                seq, reply: reply && seq.is_some(), probe: probe && seq.is_some(), probe_echo,
                horizon: base.wrapping_add(ahead),
                requests: StreamHeader { ack: acks[0], floor, sack: sacks[0] },
                replies: StreamHeader { ack: acks[1], floor, sack: sacks[1] },
                payload_len: len,
            };
            let mut datagram = vec![0xa5u8; HEADER_LEN + usize::from(len)];
            header.encode(&mut datagram);
            let (decoded, payload) = Header::decode(&datagram).unwrap();
            prop_assert_eq!(decoded, header);
            prop_assert_eq!(payload.len(), usize::from(len));
        }
    }
}
