//! Operations between a port of this device and a port of another node
//! of the fabric, one side at a time: the target side (a write, a read or
//! an atomic another node's port asks of a port here, checked against its
//! windows exactly as a local initiator's would be) and the initiator side
//! (the bytes of its own memory a write sends, and where a read's answer
//! lands, checked against its registrations).
//!
//! Each function runs inside one guarded step of the port it is given
//! (the caller lends it, holding its access gate), touches nothing before
//! every byte is checked, and fails as the local engine does.

use pindown_uapi::pattern::{Block, Plan};
use pindown_uapi::{Access, AtomicWidth, ErrorDetail, RemoteAddress, Status};

use super::execute::{atomic_word, copy_in, copy_spans, local_fault, remote_range, still_there};
use super::{Failure, PortId, Span, Spans, Target};

pub use pindown_uapi::AtomicOp;

/// Writes `bytes` at `remote` in `target`, for `initiator` (a port of
/// another node), if a live window grants it.
pub fn write_into(
    target: &Target<'_>,
    initiator: PortId,
    remote: RemoteAddress,
    bytes: &[u8],
) -> Result<(), Failure> {
    let mut far = Spans::new();
    remote_range(
        target,
        initiator,
        remote,
        bytes.len() as u64,
        Access::REMOTE_WRITE,
        true,
        &mut far,
    )?;
    copy_in(bytes, &far);
    still_there(target)
}

/// Reads `out.len()` bytes at `remote` in `target` into `out`, for
/// `initiator`, if a live window grants it.
pub fn read_from(
    target: &Target<'_>,
    initiator: PortId,
    remote: RemoteAddress,
    out: &mut [u8],
) -> Result<(), Failure> {
    let mut far = Spans::new();
    remote_range(
        target,
        initiator,
        remote,
        out.len() as u64,
        Access::REMOTE_READ,
        false,
        &mut far,
    )?;
    copy_out(&far, out);
    still_there(target)
}

/// Checks that `initiator` may access `len` bytes at `remote` in `target`
/// as `needed` says (`REMOTE_READ` or `REMOTE_WRITE`), moving nothing: a
/// read's first answer, or the destination of an ATOMIC_TO checked before
/// its word changes (nothing is refused later but a window revoked or
/// memory taken away meanwhile).
pub fn check_access(
    target: &Target<'_>,
    initiator: PortId,
    remote: RemoteAddress,
    len: u64,
    needed: Access,
) -> Result<(), Failure> {
    let mut far = Spans::new();
    let write = needed.contains(Access::REMOTE_WRITE);
    remote_range(target, initiator, remote, len, needed, write, &mut far).map(drop)
}

/// Runs `op` on the `width`-byte word at `remote` in `target`, for
/// `initiator`: a real atomic read-modify-write on the owner's memory.
/// Returns the old value.
pub fn atomic(
    target: &Target<'_>,
    initiator: PortId,
    remote: RemoteAddress,
    width: AtomicWidth,
    op: AtomicOp,
) -> Result<u64, Failure> {
    let word = atomic_word(target, initiator, remote, width)?;
    let old = match op {
        AtomicOp::CompareSwap { compare, swap } => word.compare_swap(compare, swap),
        AtomicOp::FetchAdd { add } => word.fetch_add(add),
        AtomicOp::Swap { value } => word.swap(value),
        AtomicOp::Bitwise { op, mask } => word.fetch_bitwise(op, mask),
    };
    still_there(target)?;
    Ok(old)
}

/// The spans of every block of `plan` (offsets from `base`), in stream
/// order, each checked against the target's window for `initiator` with
/// `needed`, before anything moves.
fn pattern_spans(
    target: &Target<'_>,
    initiator: PortId,
    base: RemoteAddress,
    plan: &Plan<'_>,
    needed: Access,
    write: bool,
) -> Result<Spans, Failure> {
    let mut spans = Spans::new();
    if plan.is_empty() {
        // No block to check: the window itself is, as for an empty WRITE
        // (an empty part still names a window it must be granted).
        remote_range(target, initiator, base, 0, needed, write, &mut spans)?;
    }
    for block in plan.segments(0, plan.len()) {
        let offset = u64::try_from(i128::from(base.offset) + i128::from(block.offset))
            .map_err(|_| refuse_outside(target))?;
        let at = RemoteAddress { offset, ..base };
        remote_range(target, initiator, at, block.len, needed, write, &mut spans)?;
    }
    Ok(spans)
}

/// A block before the window's start: refused like any access outside.
fn refuse_outside(target: &Target<'_>) -> Failure {
    super::execute::refuse(target, super::Refusal::OutOfBounds)
}

/// Writes `bytes` into the blocks of `plan` (offsets from `base`, in
/// stream order) in `target`, for `initiator` (a part of a vector write
/// of another node): every block is checked before the first byte moves.
pub fn write_pattern(
    target: &Target<'_>,
    initiator: PortId,
    base: RemoteAddress,
    plan: &Plan<'_>,
    bytes: &[u8],
) -> Result<(), Failure> {
    if plan.len() != bytes.len() as u64 {
        return Err((Status::InvalidRequest, ErrorDetail::LengthMismatch));
    }
    let spans = pattern_spans(target, initiator, base, plan, Access::REMOTE_WRITE, true)?;
    copy_in(bytes, &spans);
    still_there(target)
}

/// Reads the blocks of `plan` (offsets from `base`, in stream order) in
/// `target` into `out`, for `initiator` (a part of a vector read of
/// another node): every block is checked before the first byte moves.
pub fn read_pattern(
    target: &Target<'_>,
    initiator: PortId,
    base: RemoteAddress,
    plan: &Plan<'_>,
    out: &mut [u8],
) -> Result<(), Failure> {
    if plan.len() != out.len() as u64 {
        return Err((Status::InvalidRequest, ErrorDetail::LengthMismatch));
    }
    let spans = pattern_spans(target, initiator, base, plan, Access::REMOTE_READ, false)?;
    copy_out(&spans, out);
    still_there(target)
}

/// Gathers (`write` false: reads into `bytes`) or scatters (`write`:
/// copies `bytes` out) the initiator's own memory along the blocks
/// `blocks` (offsets from IOVA `base`, in stream order): the local side
/// of a part of a vector transfer with another node. Every block is
/// checked first.
pub fn local_pattern(
    local: &Target<'_>,
    base: u64,
    blocks: impl Iterator<Item = Block>,
    bytes: &mut [u8],
    write: bool,
) -> Result<(), Failure> {
    let mut spans = Spans::new();
    for block in blocks {
        let iova = base.wrapping_add_signed(block.offset);
        local
            .memory
            .spans(iova, block.len, write, &mut spans)
            .map_err(local_fault)?;
    }
    if write {
        copy_in(bytes, &spans);
    } else {
        copy_out(&spans, bytes);
    }
    lost_locally(local)
}

/// Copies `out.len()` bytes of the initiator's own registered memory at
/// `iova` into `out` (what a write sends).
pub fn read_local(local: &Target<'_>, iova: u64, out: &mut [u8]) -> Result<(), Failure> {
    let mut near = Spans::new();
    local
        .memory
        .spans(iova, out.len() as u64, false, &mut near)
        .map_err(local_fault)?;
    copy_out(&near, out);
    lost_locally(local)
}

/// Copies `bytes` into the initiator's own registered, writable memory at
/// `iova` (where a read's answer lands).
pub fn write_local(local: &Target<'_>, iova: u64, bytes: &[u8]) -> Result<(), Failure> {
    let mut near = Spans::new();
    local
        .memory
        .spans(iova, bytes.len() as u64, true, &mut near)
        .map_err(local_fault)?;
    copy_in(bytes, &near);
    lost_locally(local)
}

/// Fails a step whose own memory its owner took away.
fn lost_locally(local: &Target<'_>) -> Result<(), Failure> {
    if local.memory.lost() {
        return Err((Status::LocalProtectionError, ErrorDetail::Unregistered));
    }
    Ok(())
}

/// Copies the spans' first `out.len()` bytes into `out`.
fn copy_out(from: &[Span], out: &mut [u8]) {
    let len = out.len();
    let to = Span {
        addr: out.as_mut_ptr(),
        len,
    };
    copy_spans(from.iter().copied(), [to], len);
}
