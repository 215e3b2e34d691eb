//! Pinning with `mlock(2)`: the host-side pinner, and the process's
//! locked-memory limit.

use std::io;

use parking_lot::Mutex;

use crate::page_refs::RangeRefCounts;
use crate::pinner::{PageRange, PinError, Pinner};

/// The soft `RLIMIT_MEMLOCK` of this process in bytes (`u64::MAX` when
/// unlimited).
pub fn memlock_limit() -> io::Result<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into the struct we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(if limit.rlim_cur == libc::RLIM_INFINITY {
        u64::MAX
    } else {
        limit.rlim_cur
    })
}

/// Raises the soft and hard `RLIMIT_MEMLOCK` to at least `bytes` (needs
/// `CAP_SYS_RESOURCE` to go past the hard limit). Never lowers it.
pub fn raise_memlock_limit(bytes: u64) -> io::Result<()> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into the struct we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) } != 0 {
        return Err(io::Error::last_os_error());
    }
    if limit.rlim_cur == libc::RLIM_INFINITY || limit.rlim_cur >= bytes {
        return Ok(());
    }
    limit.rlim_cur = bytes;
    if limit.rlim_max != libc::RLIM_INFINITY && limit.rlim_max < bytes {
        limit.rlim_max = bytes;
    }
    // SAFETY: setrlimit reads the struct we own.
    if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &limit) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Bytes this process has locked, as the kernel reports it (`VmLck` in
/// `/proc/self/status`).
pub fn locked_bytes() -> io::Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmLck:"))
        .and_then(|rest| {
            rest.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
        })
        .map(|kib| kib * 1024)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "no VmLck in /proc/self/status"))
}

/// Pins with `mlock` and unpins with `munlock`, counting references per page
/// so that overlapping pins nest (the kernel's locks do not).
///
/// The token is the range itself: a device on the host reaches pinned memory
/// by its virtual address.
#[derive(Debug, Default)]
pub struct MlockPinner {
    locked: Mutex<RangeRefCounts>,
}

impl MlockPinner {
    /// A pinner with nothing locked.
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes this pinner currently holds locked.
    pub fn locked_len(&self) -> usize {
        self.locked.lock().covered_len()
    }
}

fn mlock_range(start: usize, end: usize) -> io::Result<()> {
    // SAFETY: mlock only changes residency of the pages; an unmapped or
    // invalid range is reported as an error, never dereferenced by us.
    if unsafe { libc::mlock(start as *const libc::c_void, end - start) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn munlock_range(start: usize, end: usize) {
    // SAFETY: as for mlock. ENOMEM means the range was unmapped already,
    // which released the lock with it; there is nothing left to undo.
    unsafe { libc::munlock(start as *const libc::c_void, end - start) };
}

impl Pinner for MlockPinner {
    type Token = ();

    fn pin(&self, range: PageRange) -> Result<(), PinError> {
        let mut locked = self.locked.lock();
        let fresh = locked.acquire(range.start..range.end());
        for (done, part) in fresh.iter().enumerate() {
            if let Err(source) = mlock_range(part.start, part.end) {
                for undo in &fresh[..done] {
                    munlock_range(undo.start, undo.end);
                }
                locked.release(range.start..range.end());
                return Err(classify_mlock_error(range, source));
            }
        }
        Ok(())
    }

    fn unpin(&self, range: PageRange, _token: ()) {
        let mut locked = self.locked.lock();
        for part in locked.release(range.start..range.end()) {
            munlock_range(part.start, part.end);
        }
    }

    fn forget(&self, unmapped: PageRange) {
        // munmap drops the kernel's locks with the pages.
        self.locked.lock().clear(unmapped.start..unmapped.end());
    }

    fn unpin_unmapped(&self, range: PageRange, _token: (), unmapped: &[PageRange]) {
        let mut locked = self.locked.lock();
        for rest in range.minus_all(unmapped) {
            for part in locked.release_lenient(rest.start..rest.end()) {
                munlock_range(part.start, part.end);
            }
        }
    }
}

/// Tells a memlock-limit failure from an unmapped range: `mlock` reports both
/// as ENOMEM.
fn classify_mlock_error(range: PageRange, source: io::Error) -> PinError {
    let limit = memlock_limit().unwrap_or(u64::MAX);
    let locked = locked_bytes().unwrap_or(0);
    match source.raw_os_error() {
        Some(libc::EPERM) | Some(libc::EAGAIN) => PinError::MemlockLimit {
            range,
            limit,
            locked,
            source,
        },
        Some(libc::ENOMEM) if locked.saturating_add(range.len as u64) > limit => {
            PinError::MemlockLimit {
                range,
                limit,
                locked,
                source,
            }
        }
        Some(libc::ENOMEM) => PinError::Unmapped { range, source },
        _ => PinError::Os {
            range,
            operation: "mlock",
            source,
        },
    }
}
