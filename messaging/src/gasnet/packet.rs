//! The wire format of one active-message packet in a ring slot, and its
//! checked decoding (a packet comes from a peer: untrusted).
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 8 | stamp: the packet's sequence number on its ring (1, 2, ...), written last, fenced |
//! | 8 | 1 | kind: 0 short, 1 medium, 2 long |
//! | 9 | 1 | flags: [`FLAG_REPLY`], [`FLAG_CREDIT`], [`FLAG_INTERNAL`] |
//! | 10 | 1 | handler index |
//! | 11 | 1 | number of arguments (at most [`MAX_ARGS`]) |
//! | 12 | 4 | payload bytes |
//! | 16 | 8 | long: the payload's offset in the target's segment |
//! | 24 | 4 n | arguments |
//! | 24 + 4 n | | medium: the payload |

/// Bytes before the arguments, the stamp included.
pub(crate) const HEADER_BYTES: usize = 24;
/// Arguments a message carries at most (GASNet's `gex_AM_MaxArgs` is 16).
pub const MAX_ARGS: usize = 16;
/// The smallest slot: a header and [`MAX_ARGS`] arguments.
pub const MIN_SLOT_BYTES: usize = HEADER_BYTES + 4 * MAX_ARGS;

/// A reply (its handler may not reply).
pub(crate) const FLAG_REPLY: u8 = 1;
/// The sender has no free slot left after this packet: return the
/// consumed count at once rather than at the next batch.
pub(crate) const FLAG_CREDIT: u8 = 2;
/// A library handler (get by message, barrier), not the user's table.
pub(crate) const FLAG_INTERNAL: u8 = 4;
const KNOWN_FLAGS: u8 = FLAG_REPLY | FLAG_CREDIT | FLAG_INTERNAL;

/// The three categories of active message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Arguments only.
    Short = 0,
    /// Arguments and a payload carried in the packet, delivered in a
    /// library buffer.
    Medium = 1,
    /// Arguments in the packet, the payload written into the target's
    /// segment before it.
    Long = 2,
}

/// A decoded, checked packet header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Header {
    pub(crate) kind: Kind,
    pub(crate) flags: u8,
    pub(crate) handler: u8,
    pub(crate) nargs: usize,
    pub(crate) payload_len: u32,
    pub(crate) long_offset: u64,
}

impl Header {
    /// Bytes of the packet after the stamp (what the body write carries).
    pub(crate) fn body_len(&self) -> usize {
        let inline_payload = if self.kind == Kind::Medium {
            self.payload_len as usize
        } else {
            0
        };
        HEADER_BYTES - 8 + 4 * self.nargs + inline_payload
    }

    /// Writes the header fields (not the stamp) into `slot[8..24]`.
    pub(crate) fn encode(&self, slot: &mut [u8]) {
        slot[8] = self.kind as u8;
        slot[9] = self.flags;
        slot[10] = self.handler;
        slot[11] = self.nargs as u8;
        slot[12..16].copy_from_slice(&self.payload_len.to_le_bytes());
        slot[16..24].copy_from_slice(&self.long_offset.to_le_bytes());
    }

    /// Decodes and checks the header in `slot` (a copy of a whole ring
    /// slot): every length inside the slot, a known kind, known flags,
    /// a long payload inside a segment of `segment_bytes`.
    pub(crate) fn decode(slot: &[u8], segment_bytes: u64) -> Result<Header, String> {
        if slot.len() < HEADER_BYTES {
            return Err(format!("a slot of {} bytes holds no header", slot.len()));
        }
        let kind = match slot[8] {
            0 => Kind::Short,
            1 => Kind::Medium,
            2 => Kind::Long,
            other => return Err(format!("unknown message kind {other}")),
        };
        let flags = slot[9];
        if flags & !KNOWN_FLAGS != 0 {
            return Err(format!("unknown flags {flags:#x}"));
        }
        let nargs = slot[11] as usize;
        if nargs > MAX_ARGS {
            return Err(format!("{nargs} arguments, at most {MAX_ARGS}"));
        }
        if HEADER_BYTES + 4 * nargs > slot.len() {
            return Err(format!(
                "{nargs} arguments do not fit a {}-byte slot",
                slot.len()
            ));
        }
        let payload_len = u32::from_le_bytes(slot[12..16].try_into().expect("4 bytes"));
        let long_offset = u64::from_le_bytes(slot[16..24].try_into().expect("8 bytes"));
        let header = Header {
            kind,
            flags,
            handler: slot[10],
            nargs,
            payload_len,
            long_offset,
        };
        match kind {
            Kind::Short if payload_len != 0 => {
                return Err(format!("a short message with {payload_len} payload bytes"))
            }
            Kind::Medium if 8 + header.body_len() > slot.len() => {
                return Err(format!(
                    "a medium payload of {payload_len} bytes does not fit a {}-byte slot",
                    slot.len()
                ))
            }
            Kind::Long
                if long_offset
                    .checked_add(u64::from(payload_len))
                    .is_none_or(|end| end > segment_bytes) =>
            {
                return Err(format!(
                    "a long payload of {payload_len} bytes at offset {long_offset} lies outside \
                     the {segment_bytes}-byte segment"
                ))
            }
            _ => {}
        }
        Ok(header)
    }

    /// The arguments of the packet in `slot` (checked by `decode`).
    pub(crate) fn args(&self, slot: &[u8], out: &mut Vec<u32>) {
        out.clear();
        out.extend((0..self.nargs).map(|i| {
            let at = HEADER_BYTES + 4 * i;
            u32::from_le_bytes(slot[at..at + 4].try_into().expect("4 bytes"))
        }));
    }

    /// Where a medium payload starts in the slot.
    pub(crate) fn payload_at(&self) -> usize {
        HEADER_BYTES + 4 * self.nargs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot_with(header: &Header, len: usize) -> Vec<u8> {
        let mut slot = vec![0u8; len];
        header.encode(&mut slot);
        slot
    }

    #[test]
    fn headers_round_trip_and_hostile_ones_are_refused() {
        let good = Header {
            kind: Kind::Medium,
            flags: FLAG_REPLY,
            handler: 7,
            nargs: 3,
            payload_len: 100,
            long_offset: 0,
        };
        let slot = slot_with(&good, 256);
        assert_eq!(Header::decode(&slot, 4096), Ok(good));
        // Payload past the slot.
        let big = Header {
            payload_len: 256,
            ..good
        };
        assert!(Header::decode(&slot_with(&big, 256), 4096).is_err());
        // Too many arguments.
        let mut many = slot.clone();
        many[11] = 17;
        assert!(Header::decode(&many, 4096).is_err());
        // Unknown kind and flags.
        let mut kind = slot.clone();
        kind[8] = 9;
        assert!(Header::decode(&kind, 4096).is_err());
        let mut flags = slot.clone();
        flags[9] = 0x80;
        assert!(Header::decode(&flags, 4096).is_err());
        // A long payload past the segment, and one whose end overflows.
        let long = Header {
            kind: Kind::Long,
            payload_len: 10,
            long_offset: 4090,
            ..good
        };
        assert!(Header::decode(&slot_with(&long, 256), 4096).is_err());
        let wrap = Header {
            long_offset: u64::MAX - 3,
            ..long
        };
        assert!(Header::decode(&slot_with(&wrap, 256), 4096).is_err());
        let fits = Header {
            long_offset: 4086,
            ..long
        };
        assert!(Header::decode(&slot_with(&fits, 256), 4096).is_ok());
        // A short message with a payload; a slot too small for a header.
        let short = Header {
            kind: Kind::Short,
            ..good
        };
        assert!(Header::decode(&slot_with(&short, 256), 4096).is_err());
        assert!(Header::decode(&[0u8; 10], 4096).is_err());
        // Arguments past the slot, for every kind (a short or long packet
        // in a slot too small for its arguments was once taken, and
        // reading them panicked).
        for kind in [Kind::Short, Kind::Medium, Kind::Long] {
            let argued = Header {
                kind,
                nargs: MAX_ARGS,
                payload_len: 0,
                long_offset: 0,
                ..good
            };
            let tight = slot_with(&argued, HEADER_BYTES + 4 * MAX_ARGS - 8);
            assert!(Header::decode(&tight, 4096).is_err(), "{kind:?}");
            let roomy = slot_with(&argued, MIN_SLOT_BYTES);
            let header = Header::decode(&roomy, 4096).expect("fits");
            let mut args = Vec::new();
            header.args(&roomy, &mut args);
            assert_eq!(args.len(), MAX_ARGS);
        }
    }
}
