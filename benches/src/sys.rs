//! Anonymous memory, the lockable-memory budget and a few facts about the
//! machine.
//!
//! The page size and `RLIMIT_MEMLOCK` come from [`pindown_pincache`]; this module
//! adds what the benchmarks need beyond that: mappings to pin, bare
//! `mlock`/`munlock`/`munmap` for the baselines, and a probe of how much
//! memory this process can really lock.

use std::io;

use pindown_pincache::{locked_bytes, memlock_limit, page_size, raise_memlock_limit};
use serde::Serialize;

/// Whether the process runs with effective user id 0.
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Bit of `CAP_IPC_LOCK` in the capability sets of `/proc/self/status`.
const CAP_IPC_LOCK_BIT: u32 = 14;

/// Whether the process holds `CAP_IPC_LOCK` in its effective set, which
/// lets `mlock` go past `RLIMIT_MEMLOCK`; `None` if it cannot be read.
pub fn has_cap_ipc_lock() -> Option<bool> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let hex = status.lines().find_map(|l| l.strip_prefix("CapEff:"))?;
    let caps = u64::from_str_radix(hex.trim(), 16).ok()?;
    Some(caps & (1 << CAP_IPC_LOCK_BIT) != 0)
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

/// A soft `RLIMIT_MEMLOCK` as reported in JSON: `None` (`null`) stands for
/// unlimited.
fn finite(limit: u64) -> Option<u64> {
    (limit != u64::MAX).then_some(limit)
}

/// How much memory this process may lock, and how that was found out.
///
/// `RLIMIT_MEMLOCK` alone does not say: a process with `CAP_IPC_LOCK` (root,
/// usually) may lock past its soft limit, while one without it may also be
/// stopped short of it by memory pressure. [`LockBudget::probe`] therefore
/// locks the wanted amount once and reports what happened.
#[derive(Clone, Debug, Serialize)]
pub struct LockBudget {
    /// Bytes the program asked to be able to lock.
    pub wanted: u64,
    /// Bytes the program may lock: `wanted` if the probe locked that much,
    /// otherwise the soft `RLIMIT_MEMLOCK` less what was already locked
    /// (never more than `wanted`).
    pub lockable_bytes: u64,
    /// Where `lockable_bytes` comes from: `"probe"` or `"rlimit"`.
    pub source: &'static str,
    /// Whether `mlock` of `wanted` bytes succeeded.
    pub probe_ok: bool,
    /// Why the probe failed, if it did.
    pub probe_error: Option<String>,
    /// Soft `RLIMIT_MEMLOCK` at start, in bytes (`null` = unlimited).
    pub soft_limit_before: Option<u64>,
    /// Soft `RLIMIT_MEMLOCK` after the attempt to raise it to `wanted`.
    pub soft_limit: Option<u64>,
    /// Why raising the soft limit failed, if it was tried and did.
    pub raise_error: Option<String>,
    /// Bytes this process had locked already (`VmLck`) before the probe.
    pub locked_before: u64,
}

impl LockBudget {
    /// Finds out whether `wanted` bytes can be locked: raises the soft
    /// `RLIMIT_MEMLOCK` to `wanted` where that is allowed, then maps `wanted`
    /// bytes, locks them (which faults them in), unlocks and unmaps them.
    /// If that fails, the budget falls back to the soft limit less `VmLck`.
    pub fn probe(wanted: u64) -> Self {
        let page = page_size() as u64;
        let wanted = wanted.max(1).div_ceil(page) * page;
        let soft_before = memlock_limit().unwrap_or(0);
        let raise_error = if soft_before < wanted {
            raise_memlock_limit(wanted).err().map(|e| e.to_string())
        } else {
            None
        };
        let soft = memlock_limit().unwrap_or(soft_before);
        let locked_before = locked_bytes().unwrap_or(0);
        let probe = usize::try_from(wanted)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "wanted exceeds usize"))
            .and_then(try_lock);
        let rlimit_budget = soft.saturating_sub(locked_before).min(wanted);
        let (lockable_bytes, source) = match probe {
            Ok(()) => (wanted, "probe"),
            Err(_) => (rlimit_budget, "rlimit"),
        };
        Self {
            wanted,
            lockable_bytes,
            source,
            probe_ok: probe.is_ok(),
            probe_error: probe.err().map(|e| e.to_string()),
            soft_limit_before: finite(soft_before),
            soft_limit: finite(soft),
            raise_error,
            locked_before,
        }
    }

    /// Whether the budget covers `bytes`.
    pub fn allows(&self, bytes: u64) -> bool {
        bytes <= self.lockable_bytes
    }

    /// The budget as a `CacheConfig::max_pinned_bytes` value.
    pub fn max_pinned_bytes(&self) -> usize {
        usize::try_from(self.lockable_bytes).unwrap_or(usize::MAX)
    }
}

/// Maps `len` bytes, locks and unlocks them; the mapping goes on return.
fn try_lock(len: usize) -> io::Result<()> {
    let mapping = Mapping::new_untouched(len)?;
    mlock(mapping.addr(), mapping.len())?;
    munlock(mapping.addr(), mapping.len())
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
    /// Whether the process holds `CAP_IPC_LOCK` (may lock past
    /// `RLIMIT_MEMLOCK`); `null` if unknown.
    pub cap_ipc_lock: Option<bool>,
    /// `vm.max_map_count`.
    pub max_map_count: usize,
    /// How much memory the program may lock, and how that was found out.
    pub memlock: LockBudget,
}

impl Machine {
    /// Collects the facts; `memlock` is what [`LockBudget::probe`] found.
    pub fn collect(memlock: LockBudget) -> Self {
        Self {
            page_size: page_size(),
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            kernel: kernel_release(),
            cpu_model: cpu_model(),
            root: is_root(),
            cap_ipc_lock: has_cap_ipc_lock(),
            max_map_count: max_map_count(),
            memlock,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// One test, so that no other probe in this binary locks memory while
    /// `VmLck` is compared.
    #[test]
    fn probe_rounds_to_pages_stays_within_wanted_and_leaves_nothing_locked() {
        let page = page_size() as u64;
        assert_eq!(LockBudget::probe(page + 1).wanted, 2 * page);
        let before = locked_bytes().unwrap_or(0);
        let budget = LockBudget::probe(64 * page);
        assert_eq!(budget.wanted, 64 * page);
        assert!(budget.lockable_bytes <= budget.wanted);
        assert_eq!(budget.probe_ok, budget.probe_error.is_none());
        if budget.probe_ok {
            assert_eq!(budget.lockable_bytes, budget.wanted);
            assert_eq!(budget.source, "probe");
        }
        assert_eq!(locked_bytes().unwrap_or(0), before);
    }
}
