//! The dual-contiguous unit of a transfer between two patterns (GASNet-EX
//! VIS's "dual contiguity"): the largest `u` such that, counted from the
//! transfer's first byte, every block boundary of either side falls on a
//! multiple of `u`. The transfer is then a sequence of `u`-byte units,
//! each contiguous on both sides, so a copy loop (or a packet cutter) can
//! move whole units without looking at the patterns again.

use pindown_uapi::pattern::{BlockList, Dim, Pattern, Piece};

use super::compile::Committed;
use super::DatatypeError;

/// The dual-contiguous unit of a pair of patterns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DualUnit {
    /// Bytes of each unit (0 when the transfer is empty).
    pub unit: u64,
    /// Units of the transfer (`len / unit`).
    pub units: u64,
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// The gcd of the stream offsets where blocks of `pattern`'s transfer
/// start or end, counted from its first byte (a multiple of the true
/// unit when blocks adjacent in memory sit in different pieces: it never
/// claims contiguity that is not there).
fn boundary_gcd(pattern: &Pattern) -> Result<u64, DatatypeError> {
    let mut g = gcd(pattern.len, pattern.skip);
    let mut at: u64 = 0;
    for piece in &pattern.pieces {
        g = gcd(g, at);
        match piece {
            Piece::Strided { block, dims, .. } => {
                let elements = dims
                    .iter()
                    .map(|dim: &Dim| dim.count)
                    .try_fold(1u64, u64::checked_mul)
                    .ok_or(DatatypeError::Overflow("strided counts"))?;
                if elements > 0 {
                    g = gcd(g, *block);
                }
                at = at.wrapping_add(elements.wrapping_mul(*block));
            }
            Piece::Indexed { blocks, .. } => {
                let BlockList::Listed(list) = blocks else {
                    return Err(DatatypeError::Invalid(
                        "a block list in memory has no boundaries to read",
                    ));
                };
                for block in list {
                    g = gcd(g, at);
                    at = at.wrapping_add(block.len);
                }
            }
        }
    }
    // The period repeats: its length is a boundary too.
    if pattern.repeat > 1 {
        g = gcd(g, at);
    }
    Ok(g)
}

/// The dual-contiguous unit of a transfer from `source` to `target`,
/// which must cover the same number of bytes.
pub fn dual_unit(source: &Pattern, target: &Pattern) -> Result<DualUnit, DatatypeError> {
    if source.len != target.len {
        return Err(DatatypeError::Mismatch {
            sent: source.len,
            received: target.len,
        });
    }
    source.plan()?;
    target.plan()?;
    let unit = gcd(boundary_gcd(source)?, boundary_gcd(target)?);
    Ok(DualUnit {
        unit,
        units: source.len.checked_div(unit).unwrap_or(0),
    })
}

/// The dual-contiguous unit of `source_count` elements of `source` sent
/// as `target_count` elements of `target`.
pub fn dual_contiguous_unit(
    source: &Committed,
    source_count: u64,
    target: &Committed,
    target_count: u64,
) -> Result<DualUnit, DatatypeError> {
    dual_unit(
        &source.pattern(source_count)?,
        &target.pattern(target_count)?,
    )
}
