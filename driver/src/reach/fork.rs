//! `fork()` keeps private memory private, and never touches the parent's.
//!
//! Rehomed memory is a shared mapping of a pool file. Inherited as it is, a
//! child of `fork()` would share those pages with its parent instead of
//! getting a copy-on-write snapshot, and the first thing the child does
//! (glibc's own fork code resets allocator state, the child allocates,
//! writes its stack) would write into the parent's heap and stack.
//!
//! So rehomed ranges are marked `MADV_DONTFORK`: the child does not inherit
//! them at all, and nothing it does reaches the parent. A `pthread_atfork`
//! handler then gives the child its own copy: before the fork, the parent
//! lists every mapping of a pool file (the *plan*: address, length,
//! protection, pool file and offset) in memory of its own; right after the
//! fork, the child maps private anonymous memory at each of those addresses
//! and reads the contents from the pool file, whose descriptor it
//! inherited. The child's handler allocates nothing and takes no lock.
//! `posix_spawn` and `vfork` run no fork handlers and inherit nothing.
//!
//! What the child reads is the pool file at the time its handler runs:
//! bytes the parent changed between the fork and that moment show through.
//! Before the handler runs, rehomed memory is absent from the child: a
//! child whose forking thread registered its own stack, or whose C library
//! touches a registered page while forking (glibc resets the header of
//! every thread arena, which lies in the first page of the arena's heap),
//! dies with SIGSEGV.
//!
//! The pool files stay open for this (a duplicate descriptor per segment,
//! kept after its context is gone, since rehomed memory outlives the
//! context that moved it); the parent's handler closes those no mapping
//! uses any more.

use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Mutex, Once};

use super::maps::{FileId, Maps};

/// A pool file: its identity, a descriptor the process keeps, and the
/// address range of its view while the segment lives (`None` after).
struct PoolFile {
    id: FileId,
    fd: OwnedFd,
    view: Option<(usize, usize)>,
}

static FILES: Mutex<Vec<PoolFile>> = Mutex::new(Vec::new());
static INSTALL: Once = Once::new();

/// One range for the child to restore.
#[repr(C)]
#[derive(Clone, Copy)]
struct Restore {
    start: usize,
    len: usize,
    prot: libc::c_int,
    fd: libc::c_int,
    offset: u64,
}

/// The plan made before a fork: a private anonymous mapping of
/// `PLAN_BYTES` bytes holding `PLAN_LEN` entries.
static PLAN: AtomicPtr<Restore> = AtomicPtr::new(std::ptr::null_mut());
static PLAN_LEN: AtomicUsize = AtomicUsize::new(0);
static PLAN_BYTES: AtomicUsize = AtomicUsize::new(0);

/// Notes a pool file (a new segment with its view), so that a child of
/// `fork()` gets copies of its mappings. Installs the fork handlers on
/// first use.
pub fn remember_pool_file(id: FileId, fd: BorrowedFd<'_>, view: (usize, usize)) {
    INSTALL.call_once(|| {
        // SAFETY: registers three `extern "C"` functions without arguments
        // that live for the whole program.
        unsafe { libc::pthread_atfork(Some(prepare), Some(parent), Some(child)) };
    });
    let Ok(fd) = fd.try_clone_to_owned() else {
        return;
    };
    lock().push(PoolFile {
        id,
        fd,
        view: Some(view),
    });
}

/// The segment of `id` is gone: its view is unmapped. Its descriptor stays
/// while mappings of the file may remain.
pub fn segment_gone(id: FileId) {
    for file in lock().iter_mut().filter(|f| f.id == id) {
        file.view = None;
    }
}

fn lock() -> std::sync::MutexGuard<'static, Vec<PoolFile>> {
    FILES.lock().unwrap_or_else(|e| e.into_inner())
}

/// Before the fork, in the parent: lists what the child must restore, and
/// closes the pool files nothing maps any more.
extern "C" fn prepare() {
    let mut files = lock();
    if files.is_empty() {
        return;
    }
    let Ok(mappings) = Maps::open().and_then(|maps| maps.file_backed()) else {
        return;
    };
    let mut plan = Vec::new();
    let mut used = vec![false; files.len()];
    for mapping in &mappings {
        let Some(index) = files.iter().position(|f| Some(f.id) == mapping.file) else {
            continue;
        };
        used[index] = true;
        if files[index]
            .view
            .is_some_and(|(start, _)| start == mapping.start)
        {
            continue;
        }
        plan.push(Restore {
            start: mapping.start,
            len: mapping.end - mapping.start,
            prot: mapping.prot(),
            fd: files[index].fd.as_raw_fd(),
            offset: mapping.offset,
        });
    }
    let mut index = 0;
    files.retain(|f| {
        index += 1;
        used[index - 1] || f.view.is_some()
    });
    drop(files);
    if plan.is_empty() {
        return;
    }
    let bytes = std::mem::size_of_val(plan.as_slice());
    // SAFETY: a new private anonymous mapping: the child inherits a copy.
    let at = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if at == libc::MAP_FAILED {
        return;
    }
    // SAFETY: the new mapping holds `bytes` bytes, as many as the plan.
    unsafe { std::ptr::copy_nonoverlapping(plan.as_ptr(), at.cast(), plan.len()) };
    PLAN_BYTES.store(bytes, Ordering::SeqCst);
    PLAN_LEN.store(plan.len(), Ordering::SeqCst);
    PLAN.store(at.cast(), Ordering::SeqCst);
}

/// Drops the plan (in the parent, or in the child once used).
fn drop_plan() {
    let plan = PLAN.swap(std::ptr::null_mut(), Ordering::SeqCst);
    if !plan.is_null() {
        // SAFETY: the plan's own mapping, made by `prepare`.
        unsafe { libc::munmap(plan.cast(), PLAN_BYTES.load(Ordering::SeqCst)) };
    }
}

extern "C" fn parent() {
    drop_plan();
}

/// Writes `what` and the last OS error to stderr and ends the child.
fn fail(what: &[u8]) -> ! {
    let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
    let mut digits = [0u8; 12];
    let mut at = digits.len();
    let mut n = errno.unsigned_abs();
    loop {
        at -= 1;
        digits[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    // SAFETY: writes buffers we own to stderr, then ends the process.
    unsafe {
        libc::write(2, b"pindown: fork: ".as_ptr().cast(), 15);
        libc::write(2, what.as_ptr().cast(), what.len());
        libc::write(2, b", errno ".as_ptr().cast(), 8);
        libc::write(2, digits[at..].as_ptr().cast(), digits.len() - at);
        libc::write(2, b"\n".as_ptr().cast(), 1);
        libc::abort()
    }
}

/// In the child, right after the fork: private copies of the rehomed
/// memory, read from the pool files. Allocates nothing, locks nothing.
extern "C" fn child() {
    let plan = PLAN.load(Ordering::SeqCst);
    if plan.is_null() {
        return;
    }
    for i in 0..PLAN_LEN.load(Ordering::SeqCst) {
        // SAFETY: the plan holds PLAN_LEN entries (the child's copy of it).
        let entry = unsafe { *plan.add(i) };
        // SAFETY: maps fresh memory where the parent's rehomed range was
        // (absent here: MADV_DONTFORK), never over anything else.
        let at = unsafe {
            libc::mmap(
                entry.start as *mut libc::c_void,
                entry.len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
                -1,
                0,
            )
        };
        if at == libc::MAP_FAILED {
            fail(b"cannot map private memory for registered memory");
        }
        let mut done = 0;
        while done < entry.len {
            // SAFETY: reads into the mapping just made, within its length.
            let read = unsafe {
                libc::pread(
                    entry.fd,
                    (entry.start + done) as *mut libc::c_void,
                    entry.len - done,
                    (entry.offset + done as u64) as libc::off_t,
                )
            };
            if read <= 0 {
                fail(b"cannot read registered memory from its pool file");
            }
            done += read as usize;
        }
        // SAFETY: gives the copy the protection the parent's range has.
        if unsafe { libc::mprotect(at, entry.len, entry.prot) } != 0 {
            fail(b"cannot protect the copy of registered memory");
        }
    }
    drop_plan();
}
