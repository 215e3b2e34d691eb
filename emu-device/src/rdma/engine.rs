//! Executing one work request.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use uapi::{
    Access, AtomicWidth, Completion, DeviceInfo, ErrorDetail, Opcode, Operation, RemoteAddress,
    Status, WorkRequest,
};

use super::windows::{Window, WindowTable};
use super::{Fault, MemoryAccess, Span, Spans};

/// A port a request reaches, borrowed for the duration of the access (the
/// caller holds whatever keeps its memory mapped).
#[derive(Clone, Copy)]
pub struct Target<'a> {
    /// The port's memory.
    pub memory: &'a dyn MemoryAccess,
    /// The port's windows.
    pub windows: &'a WindowTable,
}

/// Why a request failed: status and detail of its error completion.
pub type Failure = (Status, ErrorDetail);

/// The result of running a request against a target port.
pub type Outcome = Result<Completion, Failure>;

/// The other ports of the device, as the engine reaches them.
pub trait Fabric {
    /// Lends port `port` to `access` for the duration of the call (holding
    /// whatever keeps its memory mapped), or says why it cannot:
    /// [`ErrorDetail::UnknownPort`] or [`ErrorDetail::PortDown`].
    fn reach(
        &self,
        port: u16,
        access: &mut dyn FnMut(Target<'_>) -> Outcome,
    ) -> Result<Outcome, ErrorDetail>;
}

/// Executes `request`, issued by the port described by `info`, whose memory
/// and windows are `local`. Requests to another port reach it through
/// `fabric`; requests to the initiator's own port do not.
pub fn execute(
    info: DeviceInfo,
    local: Target<'_>,
    request: &WorkRequest,
    fabric: &dyn Fabric,
) -> Completion {
    let opcode = request.op.opcode();
    let result = run(info, &local, request, fabric);
    match result {
        Ok(completion) => completion,
        Err((status, detail)) => Completion::error(request.user_data, Some(opcode), status, detail),
    }
}

fn run(
    info: DeviceInfo,
    local: &Target<'_>,
    request: &WorkRequest,
    fabric: &dyn Fabric,
) -> Outcome {
    let user_data = request.user_data;
    let done = |opcode: Opcode, byte_len: u32, value: u64| {
        Ok(Completion::success(user_data, opcode, byte_len, value))
    };
    match request.op {
        Operation::Nop => done(Opcode::Nop, 0, 0),
        Operation::Query => done(Opcode::Query, 0, info.to_value()),
        Operation::BindWindow { start, len, access } => {
            let writable = access.intersects(Access::REMOTE_WRITE | Access::REMOTE_ATOMIC);
            let mut spans = Spans::new();
            local
                .memory
                .spans(start, len, writable, &mut spans)
                .map_err(local_fault)?;
            let key = local.windows.bind(Window { start, len, access });
            done(Opcode::BindWindow, 0, u64::from(key.0))
        }
        Operation::RevokeWindow { key } => {
            if local.windows.revoke(key) {
                done(Opcode::RevokeWindow, 0, 0)
            } else {
                Err((Status::InvalidRequest, ErrorDetail::BadKey))
            }
        }
        Operation::Write {
            local: source,
            len,
            remote,
        } => {
            let mut from = Spans::new();
            local
                .memory
                .spans(source, u64::from(len), false, &mut from)
                .map_err(local_fault)?;
            on_target(info, local, remote, fabric, &mut |target| {
                let mut to = Spans::new();
                remote_range(
                    &target,
                    remote,
                    u64::from(len),
                    Access::REMOTE_WRITE,
                    true,
                    &mut to,
                )?;
                copy_spans(&from, &to);
                done(Opcode::Write, len, 0)
            })
        }
        Operation::Read {
            local: destination,
            len,
            remote,
        } => {
            let mut to = Spans::new();
            local
                .memory
                .spans(destination, u64::from(len), true, &mut to)
                .map_err(local_fault)?;
            on_target(info, local, remote, fabric, &mut |target| {
                let mut from = Spans::new();
                remote_range(
                    &target,
                    remote,
                    u64::from(len),
                    Access::REMOTE_READ,
                    false,
                    &mut from,
                )?;
                copy_spans(&from, &to);
                done(Opcode::Read, len, 0)
            })
        }
        Operation::CompareSwap {
            remote,
            width,
            compare,
            swap,
        } => on_target(info, local, remote, fabric, &mut |target| {
            let word = atomic_word(&target, remote, width)?;
            let old = word.compare_swap(compare, swap);
            done(Opcode::CompareSwap, width.bytes(), old)
        }),
        Operation::FetchAdd { remote, width, add } => {
            on_target(info, local, remote, fabric, &mut |target| {
                let word = atomic_word(&target, remote, width)?;
                let old = word.fetch_add(add);
                done(Opcode::FetchAdd, width.bytes(), old)
            })
        }
        Operation::Swap {
            remote,
            width,
            value,
        } => on_target(info, local, remote, fabric, &mut |target| {
            let word = atomic_word(&target, remote, width)?;
            let old = word.swap(value);
            done(Opcode::Swap, width.bytes(), old)
        }),
    }
}

/// Runs `access` on the port `remote` names: the initiator's own, or one
/// lent by `reach`.
fn on_target(
    info: DeviceInfo,
    local: &Target<'_>,
    remote: RemoteAddress,
    fabric: &dyn Fabric,
    access: &mut dyn FnMut(Target<'_>) -> Outcome,
) -> Outcome {
    if remote.port == info.port {
        return access(Target {
            memory: local.memory,
            windows: local.windows,
        });
    }
    match fabric.reach(remote.port, access) {
        Ok(outcome) => outcome,
        Err(detail @ ErrorDetail::PortDown) => Err((Status::PeerGone, detail)),
        Err(detail) => Err((Status::RemoteAccessError, detail)),
    }
}

fn local_fault(fault: Fault) -> Failure {
    match fault {
        Fault::Unmapped | Fault::Permission(_) => {
            (Status::LocalProtectionError, ErrorDetail::Unregistered)
        }
    }
}

/// Checks `[remote, remote + len)` against its window and the target's
/// registrations; fills `out` with the spans to access.
fn remote_range(
    target: &Target<'_>,
    remote: RemoteAddress,
    len: u64,
    needed: Access,
    write: bool,
    out: &mut Spans,
) -> Result<(), Failure> {
    let denied = |detail| (Status::RemoteAccessError, detail);
    let window = target
        .windows
        .get(remote.key)
        .ok_or(denied(ErrorDetail::BadKey))?;
    if !window.access.contains(needed) {
        return Err(denied(ErrorDetail::Permission));
    }
    let iova = window
        .resolve(remote.offset, len)
        .ok_or(denied(ErrorDetail::OutOfBounds))?;
    if len == 0 {
        return Ok(());
    }
    target
        .memory
        .spans(iova, len, write, out)
        .map_err(|_| denied(ErrorDetail::OutOfBounds))
}

/// A remote word for an atomic, checked and aligned; borrowed from the
/// target for the duration of the request.
enum Word<'t> {
    Four(&'t AtomicU32),
    Eight(&'t AtomicU64),
}

impl Word<'_> {
    fn compare_swap(&self, compare: u64, swap: u64) -> u64 {
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

    fn fetch_add(&self, add: u64) -> u64 {
        match self {
            Word::Four(word) => u64::from(word.fetch_add(add as u32, Ordering::SeqCst)),
            Word::Eight(word) => word.fetch_add(add, Ordering::SeqCst),
        }
    }

    fn swap(&self, value: u64) -> u64 {
        match self {
            Word::Four(word) => u64::from(word.swap(value as u32, Ordering::SeqCst)),
            Word::Eight(word) => word.swap(value, Ordering::SeqCst),
        }
    }
}

fn atomic_word<'t>(
    target: &'t Target<'_>,
    remote: RemoteAddress,
    width: AtomicWidth,
) -> Result<Word<'t>, Failure> {
    let bytes = width.bytes();
    let mut spans = Spans::new();
    remote_range(
        target,
        remote,
        u64::from(bytes),
        Access::REMOTE_ATOMIC,
        true,
        &mut spans,
    )?;
    let window_start = target
        .windows
        .get(remote.key)
        .map(|w| w.start)
        .unwrap_or_default();
    let iova = window_start.wrapping_add(remote.offset);
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

/// Copies the bytes of `from` into `to` (equal total lengths), span by span:
/// one copy, straight between the two mappings.
fn copy_spans(from: &[Span], to: &[Span]) {
    let (mut source, mut source_offset) = (from.iter(), 0usize);
    let (mut target, mut target_offset) = (to.iter(), 0usize);
    let (mut current_source, mut current_target) = (source.next(), target.next());
    while let (Some(s), Some(t)) = (current_source, current_target) {
        let n = (s.len - source_offset).min(t.len - target_offset);
        // SAFETY: both spans are mapped memory of ports the caller holds for
        // the duration of the request, and the offsets stay inside them.
        // `copy` (memmove) allows the overlap of a port copying within its
        // own memory. The memory is shared with its owner's process: we go
        // through raw pointers, never references to it.
        unsafe { std::ptr::copy(s.addr.add(source_offset), t.addr.add(target_offset), n) };
        source_offset += n;
        target_offset += n;
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
