//! Holding writers off a range of memory while it is replaced.
//!
//! A driver that moves private pages into shared memory at the same address
//! copies them and then maps the shared copy over them. A thread that wrote
//! to those pages between the copy and the remap would lose its write. A
//! [`WriteFence`] closes that window: it write-protects the range through a
//! userfaultfd of its own (write-protect mode), so every thread that writes
//! there blocks in the kernel, and dropping the fence wakes them. A thread
//! woken after the range was replaced retries its write on the new mapping;
//! one woken without a replacement (the fence dropped early) writes to the
//! old pages, which are unprotected again.
//!
//! The fence uses a userfaultfd of its own, without unmap events: mapping
//! over the fenced range neither waits for nor notifies anyone (the
//! process-wide [`MemoryMonitor`](crate::MemoryMonitor) has its own
//! descriptor).
//!
//! Which memory can be fenced is the kernel's userfaultfd write-protect
//! support: private and shared anonymous memory, tmpfs (shmem) and
//! hugetlbfs mappings. Private mappings of other files (a disk file mapped
//! `MAP_PRIVATE`) cannot: [`WriteFence::raise`] fails with `EINVAL`.
//!
//! The thread that raises a fence must not write to the fenced range
//! before dropping it (it would wait for itself), and neither may anything
//! it waits for: raise fences from a thread whose stack, thread-local
//! storage and heap use lie outside the range.

use std::io;

use crate::uffd::{Userfaultfd, UFFD_FEATURE_PAGEFAULT_FLAG_WP, UFFD_FEATURE_WP_UNPOPULATED};

/// Writers of a range are held off while this lives; dropping it wakes
/// them (see the `fence` module's documentation).
pub struct WriteFence {
    /// Closing it lifts the protection of what is still registered and
    /// wakes every thread waiting on it.
    _uffd: Userfaultfd,
}

impl std::fmt::Debug for WriteFence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteFence").finish_non_exhaustive()
    }
}

impl WriteFence {
    /// Write-protects the page-aligned range `[start, start + len)`. Pages
    /// not populated yet are protected too: by the kernel where it can
    /// (`UFFD_FEATURE_WP_UNPOPULATED`, Linux 6.4), else by populating them
    /// first (`MADV_POPULATE_WRITE`, which leaves their contents as they
    /// are). The range must be mapped writable.
    ///
    /// Fails when userfaultfd is unavailable (no `CAP_SYS_PTRACE` while
    /// `vm.unprivileged_userfaultfd` is 0), when the memory cannot be
    /// write-protected (`EINVAL`: a private mapping of a disk file), or
    /// when another userfaultfd already watches part of it (`EBUSY`).
    pub fn raise(start: usize, len: usize) -> io::Result<WriteFence> {
        let unpopulated = Userfaultfd::offered_features()? & UFFD_FEATURE_WP_UNPOPULATED;
        let uffd = Userfaultfd::open_with(UFFD_FEATURE_PAGEFAULT_FLAG_WP | unpopulated)?;
        if unpopulated == 0 {
            // SAFETY: MADV_POPULATE_WRITE faults the pages in as a write
            // would, without changing their contents; the caller vouches
            // that the range is mapped writable.
            if unsafe { libc::madvise(start as *mut libc::c_void, len, libc::MADV_POPULATE_WRITE) }
                != 0
            {
                return Err(io::Error::last_os_error());
            }
        }
        uffd.register_write_protect(start, len)?;
        uffd.write_protect(start, len)?;
        Ok(WriteFence { _uffd: uffd })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn a_writer_waits_for_the_fence_and_then_writes() {
        let page = crate::page_size();
        // SAFETY: a fresh private anonymous mapping of two pages.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                2 * page,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(base, libc::MAP_FAILED);
        let addr = base as usize;
        let fence = match WriteFence::raise(addr, 2 * page) {
            Ok(fence) => fence,
            Err(e) => panic!("userfaultfd write protection is unavailable: {e}"),
        };
        let wrote = Arc::new(AtomicBool::new(false));
        let writer = {
            let wrote = Arc::clone(&wrote);
            std::thread::spawn(move || {
                // SAFETY: the mapping lives until the test unmaps it after
                // joining this thread.
                unsafe { std::ptr::write_volatile((addr + page + 8) as *mut u8, 7) };
                wrote.store(true, Ordering::SeqCst);
            })
        };
        std::thread::sleep(Duration::from_millis(100));
        assert!(
            !wrote.load(Ordering::SeqCst),
            "the write went through the fence"
        );
        drop(fence);
        writer.join().unwrap();
        // SAFETY: the mapping is live; the writer has finished.
        assert_eq!(
            unsafe { std::ptr::read_volatile((addr + page + 8) as *const u8) },
            7
        );
        // SAFETY: unmapping the test's own mapping.
        unsafe { libc::munmap(base, 2 * page) };
    }
}
