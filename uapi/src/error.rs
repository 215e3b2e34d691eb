//! Why bytes from the other side were rejected.

/// A field that failed validation while decoding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The buffer is shorter than the structure.
    #[error("need {needed} bytes, got {got}")]
    Truncated {
        /// Bytes the structure needs.
        needed: usize,
        /// Bytes given.
        got: usize,
    },
    /// An opcode this ABI does not define (or reserves for later).
    #[error("unknown opcode {0:#04x}")]
    UnknownOpcode(u8),
    /// Flag bits this ABI does not define.
    #[error("unknown flag bits {0:#04x}")]
    UnknownFlags(u8),
    /// Window flag bits (BIND_WINDOW) this ABI does not define.
    #[error("unknown window flag bits {0:#04x}")]
    UnknownWindowFlags(u8),
    /// A reserved field is not zero.
    #[error("reserved field at offset {offset} is not zero")]
    ReservedNotZero {
        /// Byte offset of the field.
        offset: usize,
    },
    /// An atomic width other than 4 or 8 bytes.
    #[error("atomic width must be 4 or 8 bytes, not {0}")]
    BadAtomicWidth(u32),
    /// A value that does not fit the field's type (a 4-byte atomic operand
    /// above `u32::MAX`, for example).
    #[error("{field} out of range: {value:#x}")]
    OutOfRange {
        /// The field.
        field: &'static str,
        /// The value found.
        value: u64,
    },
    /// Access bits this ABI does not define, or none where some are needed.
    #[error("invalid access rights {0:#x}")]
    BadAccess(u32),
    /// A status code this ABI does not define.
    #[error("unknown status {0}")]
    UnknownStatus(u8),
    /// An error detail code this ABI does not define.
    #[error("unknown error detail {0}")]
    UnknownDetail(u8),
    /// A feature or operation this ABI reserves for later.
    #[error("{0} is reserved for a later ABI version")]
    Reserved(&'static str),
}

/// Reads a little-endian integer at `offset` (bounds checked by the caller).
pub(crate) fn le_u16(bytes: &[u8], offset: usize) -> u16 {
    u16::from_le_bytes([bytes[offset], bytes[offset + 1]])
}

/// Reads a little-endian `u32` at `offset`.
pub(crate) fn le_u32(bytes: &[u8], offset: usize) -> u32 {
    let mut word = [0u8; 4];
    word.copy_from_slice(&bytes[offset..offset + 4]);
    u32::from_le_bytes(word)
}

/// Reads a little-endian `u64` at `offset`.
pub(crate) fn le_u64(bytes: &[u8], offset: usize) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&bytes[offset..offset + 8]);
    u64::from_le_bytes(word)
}

/// Checks that `bytes` holds at least `needed` bytes.
pub(crate) fn need(bytes: &[u8], needed: usize) -> Result<(), DecodeError> {
    if bytes.len() < needed {
        return Err(DecodeError::Truncated {
            needed,
            got: bytes.len(),
        });
    }
    Ok(())
}

/// Checks that `bytes[range]` is all zero.
pub(crate) fn reserved_zero(
    bytes: &[u8],
    range: std::ops::Range<usize>,
) -> Result<(), DecodeError> {
    match bytes[range.clone()].iter().position(|&b| b != 0) {
        Some(at) => Err(DecodeError::ReservedNotZero {
            offset: range.start + at,
        }),
        None => Ok(()),
    }
}
