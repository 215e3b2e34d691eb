//! Anonymous memory, `RLIMIT_MEMLOCK` and a few facts about the machine.

use std::io;

use serde::Serialize;

/// The size of a page, from `sysconf(_SC_PAGESIZE)`.
pub fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let v = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if v > 0 {
        v as usize
    } else {
        4096
    }
}

/// Whether the process runs with effective user id 0.
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// `vm.max_map_count`, the most mappings (VMAs) a process may have; the
/// kernel's default, 65530, if it cannot be read. Locking part of a mapping
/// splits it, so many separately pinned buffers count against this limit.
pub fn max_map_count() -> usize {
    std::fs::read_to_string("/proc/sys/vm/max_map_count")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(65530)
}

/// A limit value: `None` stands for `RLIM_INFINITY`.
pub type Limit = Option<u64>;

fn from_rlim(v: libc::rlim_t) -> Limit {
    if v == libc::RLIM_INFINITY {
        None
    } else {
        Some(v)
    }
}

/// The current `(soft, hard)` `RLIMIT_MEMLOCK`, in bytes.
pub fn memlock_limit() -> io::Result<(Limit, Limit)> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `r` is a valid, writable rlimit for the duration of the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((from_rlim(r.rlim_cur), from_rlim(r.rlim_max)))
}

/// Raises the soft (and if needed the hard) `RLIMIT_MEMLOCK` to at least
/// `bytes`. Raising the hard limit needs `CAP_SYS_RESOURCE` (root). A limit
/// already at or above `bytes` is left alone.
pub fn raise_memlock_limit(bytes: u64) -> io::Result<()> {
    let (soft, hard) = memlock_limit()?;
    let enough = |l: Limit| l.map_or(true, |v| v >= bytes);
    if enough(soft) {
        return Ok(());
    }
    let r = libc::rlimit {
        rlim_cur: bytes as libc::rlim_t,
        rlim_max: if enough(hard) {
            hard.map_or(libc::RLIM_INFINITY, |h| h as libc::rlim_t)
        } else {
            bytes as libc::rlim_t
        },
    };
    // SAFETY: `r` is a valid rlimit for the duration of the call.
    if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &r) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// What [`ensure_memlock`] found and did.
#[derive(Clone, Debug, Serialize)]
pub struct MemlockReport {
    /// Soft limit before, in bytes (`null` = unlimited).
    pub soft_before: Limit,
    /// Hard limit before, in bytes (`null` = unlimited).
    pub hard_before: Limit,
    /// Soft limit in force afterwards, in bytes (`null` = unlimited).
    pub soft_after: Limit,
    /// Whether the limit was raised.
    pub raised: bool,
    /// Bytes this process had locked already (`VmLck`), which count
    /// against the limit.
    pub locked_before: u64,
    /// Why raising failed, if it did.
    pub error: Option<String>,
}

impl MemlockReport {
    /// Bytes the process may still lock (`u64::MAX` when unlimited).
    pub fn budget(&self) -> u64 {
        self.soft_after
            .map_or(u64::MAX, |l| l.saturating_sub(self.locked_before))
    }
}

/// Raises `RLIMIT_MEMLOCK` to `wanted` bytes if that is allowed (root, or a
/// hard limit high enough); otherwise leaves it and reports what is in force,
/// so that the caller can size its caches to it.
pub fn ensure_memlock(wanted: u64) -> MemlockReport {
    let (soft_before, hard_before) = memlock_limit().unwrap_or((Some(0), Some(0)));
    let allowed = is_root() || hard_before.map_or(true, |h| h >= wanted);
    let mut error = None;
    if allowed {
        if let Err(e) = raise_memlock_limit(wanted) {
            error = Some(e.to_string());
        }
    } else {
        error = Some("not root and the hard limit is lower".to_string());
    }
    let soft_after = memlock_limit().map(|l| l.0).unwrap_or(soft_before);
    MemlockReport {
        soft_before,
        hard_before,
        soft_after,
        raised: soft_after != soft_before,
        locked_before: locked_bytes(),
        error,
    }
}

/// Bytes of this process's memory that are locked (`VmLck` in
/// `/proc/self/status`); 0 if it cannot be read.
pub fn locked_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmLck:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kib| kib * 1024)
}

/// A private anonymous mapping, written once so that every page is present
/// (and backed by its own frame, not the shared zero page). Unmapped on drop.
#[derive(Debug)]
pub struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value; moving the owner
// to another thread is sound, and shared access only hands out addresses.
unsafe impl Send for Mapping {}
// SAFETY: see above; `&Mapping` gives no way to write through it.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes (rounded up to whole pages) and faults every page in
    /// by writing a non-zero pattern.
    pub fn new(len: usize) -> io::Result<Self> {
        let m = Self::new_untouched(len)?;
        let page = page_size();
        for off in (0..m.len).step_by(page) {
            // SAFETY: `off < m.len`, inside the mapping, which is writable.
            unsafe { m.ptr.add(off).write_volatile((off / page) as u8 | 1) };
        }
        Ok(m)
    }

    /// Maps `len` bytes (rounded up to whole pages) without touching them.
    pub fn new_untouched(len: usize) -> io::Result<Self> {
        let page = page_size();
        let len = len.max(1).div_ceil(page) * page;
        // SAFETY: an anonymous private mapping at an address the kernel
        // chooses; no existing memory is affected.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Self {
            ptr: ptr.cast(),
            len,
        })
    }

    /// First address of the mapping (page aligned).
    pub fn addr(&self) -> usize {
        self.ptr as usize
    }

    /// Length in bytes (whole pages).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the mapping is empty (never true: at least one page).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Gives up ownership without unmapping; returns `(addr, len)`. For
    /// benchmarks whose timed part is the unmapping itself.
    pub fn into_raw(self) -> (usize, usize) {
        let parts = (self.addr(), self.len);
        std::mem::forget(self);
        parts
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr..ptr+len` is the mapping this value created and still
        // owns; no reference into it outlives `self`.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// `mlock(addr, len)` as an `io::Result`.
pub fn mlock(addr: usize, len: usize) -> io::Result<()> {
    // SAFETY: mlock only changes residency; an invalid range is reported as
    // an error, not undefined behaviour.
    if unsafe { libc::mlock(addr as *const libc::c_void, len) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `munlock(addr, len)` as an `io::Result`.
pub fn munlock(addr: usize, len: usize) -> io::Result<()> {
    // SAFETY: as for `mlock`.
    if unsafe { libc::munlock(addr as *const libc::c_void, len) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `munmap(addr, len)` as an `io::Result`.
///
/// # Safety
/// Nothing may use the memory in `addr..addr+len` afterwards, and nothing
/// else may own it (for instance a live [`Mapping`]).
pub unsafe fn munmap(addr: usize, len: usize) -> io::Result<()> {
    // SAFETY: the caller guarantees the range is no longer used.
    if unsafe { libc::munmap(addr as *mut libc::c_void, len) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Facts about the machine that a reader of the results needs.
#[derive(Clone, Debug, Serialize)]
pub struct Machine {
    /// Page size in bytes.
    pub page_size: usize,
    /// Number of CPUs this process may run on.
    pub cpus: usize,
    /// Kernel release (`uname -r`).
    pub kernel: String,
    /// CPU model from `/proc/cpuinfo`, if found.
    pub cpu_model: Option<String>,
    /// Whether the process runs as root.
    pub root: bool,
    /// `RLIMIT_MEMLOCK` before and after the program adjusted it.
    pub rlimit_memlock: MemlockReport,
}

impl Machine {
    /// Collects the facts; `memlock` is what [`ensure_memlock`] reported.
    pub fn collect(memlock: MemlockReport) -> Self {
        Self {
            page_size: page_size(),
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            kernel: kernel_release(),
            cpu_model: cpu_model(),
            root: is_root(),
            rlimit_memlock: memlock,
        }
    }
}

fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

fn cpu_model() -> Option<String> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    info.lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_string())
}
