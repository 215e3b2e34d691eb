//! Tests of the datatype engine against an independent reference.

mod cache;
mod compact;
mod hostile;
mod mpi;
pub(super) mod props;
mod reference;

use pindown_uapi::pattern::Pattern;

/// The byte offsets a pattern's transfer names, in stream order, from
/// its bytes `from..from + len`.
pub(super) fn pattern_offsets(pattern: &Pattern, from: u64, len: u64) -> Vec<i64> {
    let plan = pattern
        .plan()
        .expect("compiled patterns pass the ABI's checks");
    plan.segments(from, len)
        .flat_map(|segment| (0..segment.len as i64).map(move |k| segment.offset + k))
        .collect()
}
