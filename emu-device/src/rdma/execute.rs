//! Executing one work request, in guarded steps through the
//! [`Fabric`](super::Fabric).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use pindown_uapi::{
    Access, Arrival, AtomicWidth, Bitwise, Completion, DeviceInfo, ErrorDetail, Opcode, Operation,
    PortAddress, RemoteAddress, Status, WorkRequest,
};

use super::vector::{self, Side, VectorState};
use super::windows::{PortId, Refusal, Window};
use super::{AccessFault, Fabric, Failure, NoticeSlot, Outcome, Span, Spans, Target};

/// Bytes a transfer moves in one guarded step: a barrier (revoke,
/// invalidate, reset) waits for at most one step of each transfer in
/// flight.
pub const STEP_BYTES: u64 = 256 * 1024;

/// Steps a transfer takes in one turn: then its send queue lets the
/// port's thread do other work (answer its frontend, take a barrier of its
/// own memory) before the transfer goes on, so that a barrier on its own
/// port waits for at most this many steps.
pub const STEPS_PER_TURN: u64 = 4;

/// Where a request stands between two turns.
#[derive(Debug, Default)]
pub struct Progress {
    /// Bytes a transfer has moved so far.
    pub moved: u64,
    /// A vector transfer's plans, from its first turn on.
    pub vector: Option<Box<VectorState>>,
    /// Room for the arrival notice of a VECTOR_WRITE with NOTIFY_TARGET,
    /// promised by the target before the first byte moved, and the
    /// notice that goes there once the last byte has.
    pub notice: Option<(NoticeSlot, Completion)>,
}

/// What one turn of a request did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Turn {
    /// The request is complete.
    Done(Completion),
    /// A transfer used its turn; it goes on from its [`Progress`].
    Paused,
}

/// Runs one turn of `request`, issued by the port described by `info`,
/// reaching its own port and others through `fabric`: a whole request,
/// or up to [`STEPS_PER_TURN`] steps of a transfer from `progress` on.
/// `inline` holds the bytes a WRITE_INLINE carries (all of them; empty
/// for other requests).
pub fn execute(
    info: DeviceInfo,
    request: &WorkRequest,
    inline: &[u8],
    fabric: &dyn Fabric,
    progress: &mut Progress,
) -> Turn {
    let opcode = request.op.opcode();
    match run(info, request, inline, fabric, progress) {
        Ok(Some(completion)) => Turn::Done(completion),
        Ok(None) => Turn::Paused,
        Err((status, detail)) => Turn::Done(Completion::error(
            request.user_data,
            Some(opcode),
            status,
            detail,
        )),
    }
}

/// A request's completion, or `None` when a transfer paused.
fn run(
    info: DeviceInfo,
    request: &WorkRequest,
    inline: &[u8],
    fabric: &dyn Fabric,
    progress: &mut Progress,
) -> Result<Option<Completion>, Failure> {
    let user_data = request.user_data;
    let done = |opcode: Opcode, byte_len: u32, value: u64| {
        Ok(Completion::success(user_data, opcode, byte_len, value))
    };
    let own = info.port;
    let whole = match request.op {
        Operation::Nop => done(Opcode::Nop, 0, 0),
        Operation::Query => {
            let (node, value) = info.to_query();
            done(Opcode::Query, node, value)
        }
        Operation::BindWindow {
            start,
            len,
            access,
            peer,
        } => on_port(fabric, own, own, &mut |local, _| {
            let writable = access.intersects(Access::REMOTE_WRITE | Access::REMOTE_ATOMIC);
            let mut spans = Spans::new();
            local
                .memory
                .spans(start, len, writable, &mut spans)
                .map_err(local_fault)?;
            let window = Window {
                start,
                len,
                access,
                peer: peer.map(|peer| PortId {
                    node: peer.node,
                    index: peer.port,
                    incarnation: if peer.node == info.node {
                        fabric.incarnation(peer.port)
                    } else {
                        PortId::ANY_INCARNATION
                    },
                }),
            };
            match local.windows.bind(window) {
                Ok(key) => done(Opcode::BindWindow, 0, key.0),
                Err(limit) => {
                    tracing::debug!(port = own, "window not bound: {limit}");
                    Err((Status::LimitReached, ErrorDetail::WindowLimit))
                }
            }
        }),
        Operation::RevokeWindow { key } => {
            // A barrier: once revoked, no access through the key is in
            // flight.
            let revoked = fabric.exclusive(own, &mut |local| {
                if local.windows.revoke(key) {
                    done(Opcode::RevokeWindow, 0, 0)
                } else {
                    Err((Status::InvalidRequest, ErrorDetail::UnknownWindow))
                }
            });
            revoked.unwrap_or_else(|detail| Err((Status::InvalidRequest, detail)))
        }
        Operation::Write {
            local: source,
            len,
            remote,
        } => {
            let finished = transfer(fabric, own, Direction::Write, source, remote, len, progress)?;
            return Ok(finished.then(|| Completion::success(user_data, Opcode::Write, len, 0)));
        }
        Operation::WriteInline { len, remote, .. } => {
            if inline.len() != len as usize {
                return Err((Status::InvalidRequest, ErrorDetail::Malformed));
            }
            on_port(fabric, own, remote.port, &mut |local, target| {
                let mut far = Spans::new();
                remote_range(
                    &target,
                    id_of(own, &local),
                    remote,
                    u64::from(len),
                    Access::REMOTE_WRITE,
                    true,
                    &mut far,
                )?;
                copy_in(inline, &far);
                still_there(&target)?;
                done(Opcode::WriteInline, len, 0)
            })
        }
        Operation::Read {
            local: destination,
            len,
            remote,
        } => {
            let finished = transfer(
                fabric,
                own,
                Direction::Read,
                destination,
                remote,
                len,
                progress,
            )?;
            return Ok(finished.then(|| Completion::success(user_data, Opcode::Read, len, 0)));
        }
        Operation::CompareSwap {
            remote,
            width,
            compare,
            swap,
        } => on_port(fabric, own, remote.port, &mut |local, target| {
            let word = atomic_word(&target, id_of(own, &local), remote, width)?;
            let old = word.compare_swap(compare, swap);
            still_there(&target)?;
            done(Opcode::CompareSwap, width.bytes(), old)
        }),
        Operation::FetchAdd { remote, width, add } => {
            on_port(fabric, own, remote.port, &mut |local, target| {
                let word = atomic_word(&target, id_of(own, &local), remote, width)?;
                let old = word.fetch_add(add);
                still_there(&target)?;
                done(Opcode::FetchAdd, width.bytes(), old)
            })
        }
        Operation::Swap {
            remote,
            width,
            value,
        } => on_port(fabric, own, remote.port, &mut |local, target| {
            let word = atomic_word(&target, id_of(own, &local), remote, width)?;
            let old = word.swap(value);
            still_there(&target)?;
            done(Opcode::Swap, width.bytes(), old)
        }),
        Operation::FetchBitwise {
            remote,
            width,
            op,
            mask,
        } => on_port(fabric, own, remote.port, &mut |local, target| {
            let word = atomic_word(&target, id_of(own, &local), remote, width)?;
            let old = word.fetch_bitwise(op, mask);
            still_there(&target)?;
            done(request.op.opcode(), width.bytes(), old)
        }),
        Operation::Copy {
            source,
            destination,
            len,
        } => {
            let initiator = PortId {
                node: info.node,
                index: own,
                incarnation: fabric.incarnation(own),
            };
            let finished = copy(fabric, initiator, source, destination, len, progress)?;
            return Ok(finished.then(|| Completion::success(user_data, Opcode::Copy, len, 0)));
        }
        Operation::AtomicTo {
            word,
            width,
            op,
            destination,
        } => {
            let initiator = PortId {
                node: info.node,
                index: own,
                incarnation: fabric.incarnation(own),
            };
            // One guarded step on both ports: the word changes only if
            // its old value can land.
            on_port(
                fabric,
                word.port,
                destination.port,
                &mut |word_port, to_port| {
                    let mut far = Spans::new();
                    let write = Access::REMOTE_WRITE;
                    let bytes = u64::from(width.bytes());
                    remote_range(
                        &to_port,
                        initiator,
                        destination,
                        bytes,
                        write,
                        true,
                        &mut far,
                    )?;
                    let old = super::remote::atomic(&word_port, initiator, word, width, op)?;
                    copy_in(&old.to_le_bytes()[..bytes as usize], &far);
                    still_there(&to_port)?;
                    done(request.op.opcode(), width.bytes(), old)
                },
            )
        }
        Operation::VectorWrite(vector) | Operation::VectorRead(vector) => {
            let opcode = request.op.opcode();
            let direction = if opcode == Opcode::VectorWrite {
                Direction::Write
            } else {
                Direction::Read
            };
            let finished = vector_transfer(fabric, own, direction, &vector, inline, progress)?;
            return Ok(finished.then(|| Completion::success(user_data, opcode, vector.len, 0)));
        }
    };
    whole.map(Some)
}

/// The initiator `own`, lent as `local`, as windows name it.
fn id_of(own: u16, local: &Target<'_>) -> PortId {
    PortId {
        node: local.node,
        index: own,
        incarnation: local.incarnation,
    }
}

/// Fails a step that touched memory its owner took away
/// ([`MemoryAccess::lost`](super::MemoryAccess::lost)): the port is being
/// reset, like a port that went down.
pub(super) fn still_there(target: &Target<'_>) -> Result<(), Failure> {
    if target.memory.lost() {
        return Err((Status::PeerGone, ErrorDetail::PortDown));
    }
    Ok(())
}

/// Which way a transfer moves bytes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Direction {
    /// Local memory into the remote window.
    Write,
    /// The remote window into local memory.
    Read,
}

impl Direction {
    /// The right the remote side must grant, and whether it is written.
    fn remote_access(self) -> (Access, bool) {
        match self {
            Direction::Write => (Access::REMOTE_WRITE, true),
            Direction::Read => (Access::REMOTE_READ, false),
        }
    }
}

/// Moves `len` bytes between local `iova` and `remote`, in guarded steps
/// of at most [`STEP_BYTES`], at most [`STEPS_PER_TURN`] of them from
/// `progress` on; returns whether the transfer is complete. The first step
/// checks the whole transfer (local registration, window key, rights and
/// bounds, the target's registration), so a request refused up front
/// moves no byte. Every later step checks its own part again: a barrier
/// between two steps (the window revoked, memory invalidated or reset)
/// stops the transfer there, and it completes with an error. A step that
/// touched memory its owner took away fails too.
fn transfer(
    fabric: &dyn Fabric,
    own: u16,
    direction: Direction,
    iova: u64,
    remote: RemoteAddress,
    len: u32,
    progress: &mut Progress,
) -> Result<bool, Failure> {
    let len = u64::from(len);
    let (needed, remote_writes) = direction.remote_access();
    guarded_steps(
        fabric,
        own,
        remote.port,
        len,
        &mut progress.moved,
        &mut |local, target, moved, step| {
            let checked = if moved == 0 { len } else { step };
            let mut near = Spans::new();
            local
                .memory
                .spans(iova + moved, checked, !remote_writes, &mut near)
                .map_err(local_fault)?;
            let mut far = Spans::new();
            let at = RemoteAddress {
                offset: remote.offset.saturating_add(moved),
                ..remote
            };
            remote_range(
                target,
                id_of(own, local),
                at,
                checked,
                needed,
                remote_writes,
                &mut far,
            )?;
            let step = usize::try_from(step).unwrap_or(usize::MAX);
            match direction {
                Direction::Write => copy_spans(near, far, step),
                Direction::Read => copy_spans(far, near, step),
            }
            Ok(())
        },
    )
}

/// Copies `len` bytes between two windows of this device's ports, for
/// `initiator` (which needs REMOTE_READ on the source's window and
/// REMOTE_WRITE on the destination's), in guarded steps as [`transfer`]
/// does: the first step checks the whole range on both sides.
fn copy(
    fabric: &dyn Fabric,
    initiator: PortId,
    source: RemoteAddress,
    destination: RemoteAddress,
    len: u32,
    progress: &mut Progress,
) -> Result<bool, Failure> {
    let len = u64::from(len);
    guarded_steps(
        fabric,
        source.port,
        destination.port,
        len,
        &mut progress.moved,
        &mut |from_port, to_port, moved, step| {
            let checked = if moved == 0 { len } else { step };
            let at = |address: RemoteAddress| RemoteAddress {
                offset: address.offset.saturating_add(moved),
                ..address
            };
            let (mut near, mut far) = (Spans::new(), Spans::new());
            let read = Access::REMOTE_READ;
            remote_range(
                from_port,
                initiator,
                at(source),
                checked,
                read,
                false,
                &mut near,
            )?;
            let write = Access::REMOTE_WRITE;
            remote_range(
                to_port,
                initiator,
                at(destination),
                checked,
                write,
                true,
                &mut far,
            )?;
            copy_spans(near, far, usize::try_from(step).unwrap_or(usize::MAX));
            Ok(())
        },
    )
}

/// One guarded step of a transfer: `(local, target, from, bytes)` checks
/// and moves the transfer's bytes `from..from + bytes`.
type TransferStep<'s> = dyn FnMut(&Target<'_>, &Target<'_>, u64, u64) -> Result<(), Failure> + 's;

/// Runs up to [`STEPS_PER_TURN`] guarded steps of a transfer of `len`
/// bytes between the initiator `own` and port `target`, from `moved` on:
/// `step(local, target, moved, bytes)` checks and moves the transfer's
/// bytes `moved..moved + bytes` (at most [`STEP_BYTES`]); a step that
/// touched memory its owner took away fails. Returns whether the transfer
/// is complete.
fn guarded_steps(
    fabric: &dyn Fabric,
    own: u16,
    target: u16,
    len: u64,
    moved: &mut u64,
    step: &mut TransferStep<'_>,
) -> Result<bool, Failure> {
    for _ in 0..STEPS_PER_TURN {
        let from = *moved;
        let bytes = (len - from).min(STEP_BYTES);
        on_port(fabric, own, target, &mut |local, target| {
            step(&local, &target, from, bytes)?;
            if local.memory.lost() {
                return Err((Status::LocalProtectionError, ErrorDetail::Unregistered));
            }
            still_there(&target)?;
            Ok(STEP_DONE)
        })?;
        *moved += bytes;
        if *moved >= len {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Runs up to [`STEPS_PER_TURN`] steps of a vector transfer from
/// `progress` on (see [`vector`]): the first turn takes its descriptor
/// (`inline`, or the initiator's memory) and plans it; the first step
/// checks every element of both patterns, every later one its own part.
/// Returns whether the transfer is complete.
fn vector_transfer(
    fabric: &dyn Fabric,
    own: u16,
    direction: Direction,
    transfer: &pindown_uapi::VectorTransfer,
    inline: &[u8],
    progress: &mut Progress,
) -> Result<bool, Failure> {
    if progress.vector.is_none() {
        let limits = fabric.vector_limits();
        let mut prepared = None;
        let mut writer = PortAddress { node: 0, port: own };
        on_port(fabric, own, own, &mut |local, _| {
            writer.node = local.node;
            prepared = Some(vector::prepare(
                own,
                local.memory,
                transfer,
                inline,
                limits,
            )?);
            Ok(STEP_DONE)
        })?;
        progress.vector = prepared.map(Box::new);
        if let Some(immediate) = transfer.notify {
            // Room for the arrival first: a notice that could not be
            // queued would be lost, so the write does not start.
            let slot = fabric
                .reserve_notice(transfer.remote.port)
                .ok_or((Status::LimitReached, ErrorDetail::NoticeLimit))?;
            let arrival = Completion::arrival_notice(Arrival {
                peer: writer,
                key: transfer.remote.key,
                bytes: transfer.len,
                immediate,
            });
            progress.notice = Some((slot, arrival));
        }
    }
    let Some(state) = progress.vector.as_deref() else {
        return Err((Status::InvalidRequest, ErrorDetail::Malformed));
    };
    let len = u64::from(transfer.len);
    let (needed, remote_writes) = direction.remote_access();
    let finished = guarded_steps(
        fabric,
        own,
        transfer.remote.port,
        len,
        &mut progress.moved,
        &mut |local, target, moved, step| {
            if len == 0 {
                // No element to check: the window itself is, as for an
                // empty WRITE (an arrival of no bytes still names a window
                // the writer must be granted).
                let initiator = id_of(own, local);
                return super::remote::check_access(target, initiator, transfer.remote, 0, needed);
            }
            let near = Side::Local {
                memory: local.memory,
                base: transfer.local,
                write: !remote_writes,
            };
            let far = Side::Remote {
                target,
                initiator: id_of(own, local),
                remote: transfer.remote,
                needed,
                write: remote_writes,
            };
            let check_all = moved == 0 && step < len;
            vector::step(state, &near, &far, !remote_writes, moved, step, check_all)
        },
    )?;
    if finished {
        if let Some((slot, arrival)) = progress.notice.take() {
            slot.deliver(arrival);
        }
    }
    Ok(finished)
}

/// What a step of a transfer returns when it worked (the request's own
/// completion is built once the last step is done).
const STEP_DONE: Completion = Completion {
    user_data: 0,
    status: Status::Success,
    detail: ErrorDetail::None,
    opcode: None,
    byte_len: 0,
    value: 0,
    arrival_from: None,
};

/// Runs one guarded step on the initiator and the port `target` names.
fn on_port(
    fabric: &dyn Fabric,
    own: u16,
    target: u16,
    step: &mut dyn FnMut(Target<'_>, Target<'_>) -> Outcome,
) -> Outcome {
    match fabric.step(own, target, step) {
        Ok(outcome) => outcome,
        Err(detail @ ErrorDetail::PortDown) => Err((Status::PeerGone, detail)),
        Err(detail) => Err((Status::RemoteAccessError, detail)),
    }
}

pub(super) fn local_fault(fault: AccessFault) -> Failure {
    match fault {
        AccessFault::Unmapped | AccessFault::Miss { .. } | AccessFault::Permission(_) => {
            (Status::LocalProtectionError, ErrorDetail::Unregistered)
        }
    }
}

/// The answer to every refused remote access, whatever the cause: the
/// initiator learns nothing about which keys exist.
pub const NOT_GRANTED: Failure = (Status::RemoteAccessError, ErrorDetail::NotGranted);

/// Refuses a remote access: counts the cause for the target's owner, and
/// answers [`NOT_GRANTED`].
pub(super) fn refuse(target: &Target<'_>, refusal: Refusal) -> Failure {
    target.refusals.count(refusal);
    NOT_GRANTED
}

/// Checks the access of port `initiator` to `[remote, remote + len)`,
/// needing `needed`, against the target's window and registrations; fills
/// `out` with the spans to access and returns the owner's I/O virtual
/// address of the range.
pub(super) fn remote_range(
    target: &Target<'_>,
    initiator: PortId,
    remote: RemoteAddress,
    len: u64,
    needed: Access,
    write: bool,
    out: &mut Spans,
) -> Result<u64, Failure> {
    let iova = target
        .windows
        .check(remote.key, initiator, remote.offset, len, needed)
        .map_err(|refusal| refuse(target, refusal))?;
    if len == 0 {
        return Ok(iova);
    }
    target
        .memory
        .spans(iova, len, write, out)
        .map_err(|_| refuse(target, Refusal::Unregistered))?;
    Ok(iova)
}

/// A remote word for an atomic, checked and aligned; borrowed from the
/// target for the duration of the request.
pub(super) enum Word<'t> {
    Four(&'t AtomicU32),
    Eight(&'t AtomicU64),
}

impl Word<'_> {
    pub(super) fn compare_swap(&self, compare: u64, swap: u64) -> u64 {
        match self {
            Word::Four(word) => {
                let result = word.compare_exchange(
                    compare as u32,
                    swap as u32,
                    Ordering::SeqCst,
                    Ordering::SeqCst,
                );
                u64::from(result.unwrap_or_else(|old| old))
            }
            Word::Eight(word) => word
                .compare_exchange(compare, swap, Ordering::SeqCst, Ordering::SeqCst)
                .unwrap_or_else(|old| old),
        }
    }

    pub(super) fn fetch_add(&self, add: u64) -> u64 {
        match self {
            Word::Four(word) => u64::from(word.fetch_add(add as u32, Ordering::SeqCst)),
            Word::Eight(word) => word.fetch_add(add, Ordering::SeqCst),
        }
    }

    pub(super) fn fetch_bitwise(&self, op: Bitwise, mask: u64) -> u64 {
        match (self, op) {
            (Word::Four(word), Bitwise::And) => {
                u64::from(word.fetch_and(mask as u32, Ordering::SeqCst))
            }
            (Word::Four(word), Bitwise::Or) => {
                u64::from(word.fetch_or(mask as u32, Ordering::SeqCst))
            }
            (Word::Four(word), Bitwise::Xor) => {
                u64::from(word.fetch_xor(mask as u32, Ordering::SeqCst))
            }
            (Word::Eight(word), Bitwise::And) => word.fetch_and(mask, Ordering::SeqCst),
            (Word::Eight(word), Bitwise::Or) => word.fetch_or(mask, Ordering::SeqCst),
            (Word::Eight(word), Bitwise::Xor) => word.fetch_xor(mask, Ordering::SeqCst),
        }
    }

    pub(super) fn swap(&self, value: u64) -> u64 {
        match self {
            Word::Four(word) => u64::from(word.swap(value as u32, Ordering::SeqCst)),
            Word::Eight(word) => word.swap(value, Ordering::SeqCst),
        }
    }
}

pub(super) fn atomic_word<'t>(
    target: &'t Target<'_>,
    initiator: PortId,
    remote: RemoteAddress,
    width: AtomicWidth,
) -> Result<Word<'t>, Failure> {
    let bytes = width.bytes();
    let mut spans = Spans::new();
    // Granted first: only an initiator the window admits learns whether
    // its word is aligned.
    let iova = remote_range(
        target,
        initiator,
        remote,
        u64::from(bytes),
        Access::REMOTE_ATOMIC,
        true,
        &mut spans,
    )?;
    let misaligned = (Status::InvalidRequest, ErrorDetail::Misaligned);
    let [Span { addr, len }] = spans[..] else {
        return Err(misaligned);
    };
    if !iova.is_multiple_of(u64::from(bytes))
        || !(addr as usize).is_multiple_of(bytes as usize)
        || len != bytes as usize
    {
        return Err(misaligned);
    }
    // SAFETY: the span is mapped for as long as the target is lent (the
    // borrow 't), aligned to the word's width, and the device touches it only
    // through atomics.
    Ok(unsafe {
        match width {
            AtomicWidth::Four => Word::Four(AtomicU32::from_ptr(addr.cast())),
            AtomicWidth::Eight => Word::Eight(AtomicU64::from_ptr(addr.cast())),
        }
    })
}

/// Copies `bytes` into `to` (which holds at least as many), span by span.
pub(super) fn copy_in(bytes: &[u8], to: &[Span]) {
    let mut rest = bytes;
    for span in to {
        let n = span.len.min(rest.len());
        // SAFETY: the span is mapped memory of a port lent for the current
        // guarded step and holds at least `n` bytes; `bytes` is the
        // device's own copy, so the two cannot overlap.
        unsafe { std::ptr::copy_nonoverlapping(rest.as_ptr(), span.addr, n) };
        rest = &rest[n..];
        if rest.is_empty() {
            break;
        }
    }
}

/// Copies the first `limit` bytes of `from` into `to` (both hold at least
/// that many), span by span: one copy, straight between the two mappings.
pub(super) fn copy_spans(
    from: impl IntoIterator<Item = Span>,
    to: impl IntoIterator<Item = Span>,
    limit: usize,
) {
    let (mut source, mut source_offset) = (from.into_iter(), 0usize);
    let (mut target, mut target_offset) = (to.into_iter(), 0usize);
    let (mut current_source, mut current_target) = (source.next(), target.next());
    let mut left = limit;
    while let (Some(s), Some(t)) = (current_source, current_target) {
        if left == 0 {
            break;
        }
        let n = (s.len - source_offset).min(t.len - target_offset).min(left);
        // SAFETY: both spans are mapped memory of ports lent for the
        // current guarded step, and the offsets stay inside them.
        // `copy` (memmove) allows the overlap of a port copying within its
        // own memory. The memory is shared with its owner's process: we go
        // through raw pointers, never references to it.
        unsafe { copy_run(s.addr.add(source_offset), t.addr.add(target_offset), n) };
        source_offset += n;
        target_offset += n;
        left -= n;
        if source_offset == s.len {
            current_source = source.next();
            source_offset = 0;
        }
        if target_offset == t.len {
            current_target = target.next();
            target_offset = 0;
        }
    }
}

/// Copies `n` bytes from `from` to `to` (which may overlap, as memmove
/// allows): the element sizes of vector transfers (4, 8, 16 bytes) as one
/// unaligned load and store each, longer runs through `ptr::copy`.
///
/// # Safety
///
/// Both ranges are mapped memory lent for the current guarded step.
pub(super) unsafe fn copy_run(from: *const u8, to: *mut u8, n: usize) {
    // SAFETY (all arms): the caller's ranges hold `n` bytes; a whole value
    // is read before it is written, so an overlap copies as memmove does.
    unsafe {
        match n {
            4 => to
                .cast::<u32>()
                .write_unaligned(from.cast::<u32>().read_unaligned()),
            8 => to
                .cast::<u64>()
                .write_unaligned(from.cast::<u64>().read_unaligned()),
            16 => to
                .cast::<u128>()
                .write_unaligned(from.cast::<u128>().read_unaligned()),
            _ => std::ptr::copy(from, to, n),
        }
    }
}
