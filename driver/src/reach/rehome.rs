//! Rehoming: moving private pages into the pool at the same address.
//!
//! A private range `[start, start + len)` (heap, stack, anonymous or
//! `MAP_PRIVATE` file memory) is rehomed in three steps: its current
//! contents are copied into a pool chunk through the segment's view, and
//! the chunk is mapped `MAP_SHARED | MAP_FIXED` over the range with the
//! range's protection. The program keeps its addresses and its bytes; the
//! pages are now a file the device maps.
//!
//! A thread that wrote to the range between the copy and the remap would
//! lose its write, so writable memory is fenced first
//! ([`pindown_pincache::WriteFence`]): writers block in the kernel from the
//! moment the range is write-protected until the new mapping is in place,
//! then retry their writes on it. A private mapping of a disk file cannot
//! be write-protected by userfaultfd; it is rehomed unfenced only when the
//! registration allows it ([`Move::allow_unfenced`]: the unsafe
//! `Context::register_unfenced`, whose caller must see to it that no other
//! thread writes to those pages meanwhile), and refused otherwise.
//!
//! The steps run on a thread of their own (`pindown-rehome`), never on the
//! registering thread: the range may hold the registering thread's own
//! stack (a stack array), its thread-local storage or the heap objects it
//! touches while it waits, and a thread that writes to a fenced page waits
//! for whoever lifts the fence. The rehoming thread touches nothing but its
//! own stack, the source range (reading) and the pool view while the fence
//! is up: no allocation, no lock.

use std::io;
use std::os::fd::RawFd;
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};

use pindown_pincache::WriteFence;

/// One range to move.
#[derive(Clone, Copy, Debug)]
pub struct Move {
    /// First byte (page aligned).
    pub start: usize,
    /// Bytes (whole pages).
    pub len: usize,
    /// The range's protection, kept by the new mapping.
    pub prot: libc::c_int,
    /// Hold writers off while moving (writable memory).
    pub fence: bool,
    /// The range maps a file privately: if it is a disk file, it cannot be
    /// fenced.
    pub file_backed: bool,
    /// Move file-backed memory that cannot be fenced anyway (else the move
    /// fails with [`UNFENCEABLE`]).
    pub allow_unfenced: bool,
    /// The pool segment's memfd.
    pub pool: RawFd,
    /// Offset of the chunk in it.
    pub offset: u64,
    /// Address of the chunk in the segment's view.
    pub destination: usize,
}

/// How a move went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Moved {
    /// Writers were held off during the move.
    Fenced,
    /// Nobody could write (read-only memory).
    ReadOnly,
    /// The memory could not be fenced (a private mapping of a disk file).
    Unfenced,
}

/// The step of a [`MoveError`] refusing a private disk-file mapping that
/// cannot be fenced, when unfenced moves are not allowed.
pub const UNFENCEABLE: &str = "write-protecting a private mapping of a disk file";

/// Why a move failed (the range is unchanged).
#[derive(Debug)]
pub struct MoveError {
    /// The step that failed.
    pub step: &'static str,
    /// The kernel's error.
    pub source: io::Error,
}

type Request = (Move, mpsc::SyncSender<Result<Moved, MoveError>>);

/// Moves `job.start..job.start + job.len` into the pool on the rehoming
/// thread and waits for it.
pub fn run(job: Move) -> Result<Moved, MoveError> {
    static WORKER: OnceLock<Mutex<mpsc::Sender<Request>>> = OnceLock::new();
    let sender = WORKER
        .get_or_init(|| {
            let (sender, jobs) = mpsc::channel::<Request>();
            std::thread::Builder::new()
                .name("pindown-rehome".into())
                .spawn(move || {
                    for (job, reply) in jobs {
                        let _ = reply.send(move_range(&job));
                    }
                })
                .expect("cannot start the pindown-rehome thread");
            Mutex::new(sender)
        })
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let (reply, answer) = mpsc::sync_channel(1);
    let gone = || MoveError {
        step: "hand-over to the rehoming thread",
        source: io::Error::other("the pindown-rehome thread is gone"),
    };
    sender.send((job, reply)).map_err(|_| gone())?;
    answer.recv().map_err(|_| gone())?
}

/// The move itself, on the rehoming thread (see the module documentation
/// for what it may touch while the fence is up).
fn move_range(job: &Move) -> Result<Moved, MoveError> {
    // Allocate the chunk's pages before writers are held off: the fence
    // then lasts only as long as the copy and the remap.
    // SAFETY: advice on the chunk of the pool view reserved for this move;
    // populating writes nothing.
    unsafe {
        libc::madvise(
            job.destination as *mut libc::c_void,
            job.len,
            libc::MADV_POPULATE_WRITE,
        )
    };
    let (fence, moved) = if job.fence {
        match WriteFence::raise(job.start, job.len) {
            Ok(fence) => (Some(fence), Moved::Fenced),
            Err(e) if job.file_backed && e.raw_os_error() == Some(libc::EINVAL) => {
                if !job.allow_unfenced {
                    return Err(MoveError {
                        step: UNFENCEABLE,
                        source: e,
                    });
                }
                (None, Moved::Unfenced)
            }
            Err(source) => {
                return Err(MoveError {
                    step: "write-protecting the range (userfaultfd)",
                    source,
                })
            }
        }
    } else {
        (None, Moved::ReadOnly)
    };
    // SAFETY: the source range is mapped readable (the caller checked the
    // mapping) and its writers are held off by the fence (or, for memory
    // that cannot be fenced, by the caller); the destination is a chunk of
    // the pool view reserved for this move, which no one else reaches yet;
    // the two do not overlap (the view is a mapping of its own).
    unsafe {
        std::ptr::copy_nonoverlapping(job.start as *const u8, job.destination as *mut u8, job.len)
    };
    // SAFETY: replaces exactly the range being moved with a shared mapping
    // of the chunk that now holds the same bytes, with the same protection;
    // the caller owns that range's registration and checked its mapping.
    let mapped = unsafe {
        libc::mmap(
            job.start as *mut libc::c_void,
            job.len,
            job.prot,
            libc::MAP_SHARED | libc::MAP_FIXED,
            job.pool,
            job.offset as libc::off_t,
        )
    };
    let result = if mapped == libc::MAP_FAILED {
        Err(MoveError {
            step: "mapping the pool over the range",
            source: io::Error::last_os_error(),
        })
    } else {
        // A child of fork() must not share it (see `fork`).
        // SAFETY: advice on the mapping just made.
        unsafe { libc::madvise(mapped, job.len, libc::MADV_DONTFORK) };
        Ok(moved)
    };
    // Wakes the writers: they retry on the new mapping (or, if the mapping
    // failed, on the old pages, unprotected again).
    drop(fence);
    result
}
