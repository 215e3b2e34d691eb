//! `fork()` keeps private memory private.
//!
//! Rehomed memory is a shared mapping of a pool file, so a child of
//! `fork()` would share those pages with its parent instead of getting a
//! copy-on-write snapshot: parent and child would see each other's writes
//! to what both believe is private memory (heap, stack). A `pthread_atfork`
//! handler restores the usual semantics: in the child, right after the
//! fork, every mapping of a pool file is replaced by a private anonymous
//! copy of its contents, with the same protection. The child pays one copy
//! of the rehomed memory it inherits; `posix_spawn` and `vfork` (which run
//! no fork handlers and share the parent's memory until `exec`) pay
//! nothing. The pool views themselves are not inherited (`MADV_DONTFORK`).
//!
//! The handlers take no lock a thread of the parent could hold at the
//! fork: the pool files are listed in a fixed table of atomics, guarded by
//! a spin flag that the prepare handler takes and the parent and child
//! handlers release.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Once;

use super::maps::{FileId, Maps};

/// Pool files remembered at most (segments of all contexts of the process).
const MAX_POOL_FILES: usize = 256;

/// `(dev, ino)` of each pool file; `(0, 0)` is a free slot.
static POOL_FILES: [[AtomicU64; 2]; MAX_POOL_FILES] =
    [const { [AtomicU64::new(0), AtomicU64::new(0)] }; MAX_POOL_FILES];
static TABLE_BUSY: AtomicBool = AtomicBool::new(false);
static INSTALL: Once = Once::new();

fn lock_table() {
    while TABLE_BUSY
        .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
        .is_err()
    {
        std::hint::spin_loop();
    }
}

fn unlock_table() {
    TABLE_BUSY.store(false, Ordering::Release);
}

/// Notes a pool file, so that a child of `fork()` privatizes its mappings.
/// Installs the fork handlers on first use. Returns false when the table
/// is full (the file's mappings would then be shared with a child).
pub fn remember_pool_file(id: FileId) -> bool {
    INSTALL.call_once(|| {
        // SAFETY: registers three `extern "C"` functions without arguments
        // that live for the whole program.
        unsafe { libc::pthread_atfork(Some(prepare), Some(parent), Some(child)) };
    });
    lock_table();
    let slot = POOL_FILES
        .iter()
        .find(|slot| slot[0].load(Ordering::Relaxed) == 0 && slot[1].load(Ordering::Relaxed) == 0);
    if let Some(slot) = slot {
        slot[0].store(id.dev, Ordering::Relaxed);
        slot[1].store(id.ino, Ordering::Relaxed);
    }
    unlock_table();
    slot.is_some()
}

/// Forgets a pool file (its segment is gone).
pub fn forget_pool_file(id: FileId) {
    lock_table();
    for slot in &POOL_FILES {
        if slot[0].load(Ordering::Relaxed) == id.dev && slot[1].load(Ordering::Relaxed) == id.ino {
            slot[0].store(0, Ordering::Relaxed);
            slot[1].store(0, Ordering::Relaxed);
        }
    }
    unlock_table();
}

fn is_pool_file(id: FileId) -> bool {
    POOL_FILES.iter().any(|slot| {
        slot[0].load(Ordering::Relaxed) == id.dev && slot[1].load(Ordering::Relaxed) == id.ino
    })
}

extern "C" fn prepare() {
    lock_table();
}

extern "C" fn parent() {
    unlock_table();
}

extern "C" fn child() {
    if let Err(message) = privatize_pool_mappings() {
        // The child would share memory with its parent: stop it rather
        // than let the two corrupt each other's private memory.
        let text = format!("pindown: fork: {message}\n");
        // SAFETY: writes a buffer we own to stderr, then ends the process.
        unsafe {
            libc::write(2, text.as_ptr().cast(), text.len());
            libc::abort();
        }
    }
    unlock_table();
}

/// In the child: replaces every mapping of a pool file by a private copy.
fn privatize_pool_mappings() -> Result<(), String> {
    if POOL_FILES
        .iter()
        .all(|slot| slot[1].load(Ordering::Relaxed) == 0)
    {
        return Ok(());
    }
    let maps = Maps::open().map_err(|e| format!("cannot read /proc/self/maps: {e}"))?;
    let mappings = maps
        .file_backed()
        .map_err(|e| format!("cannot list mappings: {e}"))?;
    for mapping in mappings.iter().filter(|m| m.file.is_some_and(is_pool_file)) {
        let (start, len) = (mapping.start, mapping.end - mapping.start);
        let fail = |what: &str| {
            format!(
                "cannot make [{start:#x}, {:#x}) private: {what}: {}",
                mapping.end,
                std::io::Error::last_os_error()
            )
        };
        // SAFETY: a fresh private anonymous mapping, placed by the kernel.
        let copy = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if copy == libc::MAP_FAILED {
            return Err(fail("mmap"));
        }
        // SAFETY: the child is single-threaded here; the source is a live
        // mapping of `len` bytes (made readable first if it was not), the
        // destination the fresh mapping above; then the copy replaces the
        // source at the same address, with the source's protection.
        unsafe {
            if !mapping.read && libc::mprotect(start as *mut _, len, libc::PROT_READ) != 0 {
                return Err(fail("mprotect"));
            }
            std::ptr::copy_nonoverlapping(start as *const u8, copy.cast::<u8>(), len);
            let moved = libc::mremap(
                copy,
                len,
                len,
                libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
                start as *mut libc::c_void,
            );
            if moved == libc::MAP_FAILED {
                return Err(fail("mremap"));
            }
            if libc::mprotect(start as *mut _, len, mapping.prot()) != 0 {
                return Err(fail("mprotect"));
            }
        }
    }
    Ok(())
}
