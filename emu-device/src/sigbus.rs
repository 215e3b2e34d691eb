//! Surviving frontend memory that shrinks under the device.
//!
//! A frontend hands its memory over as file descriptors (SET_MEM_TABLE) and
//! the device maps them shared. If the frontend later shrinks such a file
//! (`ftruncate`), or the file cannot supply a page (a hugetlbfs pool that
//! ran dry, an I/O error of a disk-backed file), every access of the device
//! to a page it lost raises SIGBUS, which by default kills the process and
//! every port with it. Memory table checks cannot prevent this: the file is
//! shrunk after they ran. Memfds sealed with `F_SEAL_SHRINK` cannot shrink
//! (QEMU's memfd backend seals them); every other backing is watched here.
//!
//! How the guard works:
//! - Each watched mapping has a slot in a fixed-size registry of atomics
//!   ([`SLOTS`] slots): its address range, its page size, and a *poisoned*
//!   flag. Slots are written under a mutex and read by the signal handler
//!   without any lock (each slot is a sequence lock).
//! - A process-wide SIGBUS handler, installed once with `sigaction`
//!   (`SA_SIGINFO`), looks the faulting address up. If a watched mapping
//!   holds it, the handler maps anonymous zero pages over the lost part of
//!   the mapping (from the faulting page to the end: past a shrink, every
//!   later page of the file is gone too), marks the mapping poisoned and
//!   returns; the interrupted access then completes on the zero pages.
//!   Any other SIGBUS goes to the handler that was installed before (the
//!   Rust runtime's), or gets the default action (the process dies as it
//!   would have without the guard).
//! - The port that owns a poisoned mapping sees the flag
//!   ([`Guarded::poisoned`], checked after every pass of its connection
//!   loop), stops its rings and resets; the other ports keep working.
//! - A slot stays registered as long as the mapping exists: the registry
//!   keeps a reference to the mapping, and frees the slot, then unmaps,
//!   only once no one else refers to it ([`release_unused`]). So an access
//!   in flight, which holds a reference, always finds its slot.

use std::ffi::c_void;
use std::fmt;
use std::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use vm_memory::MmapRegion;

/// Number of mappings the guard can watch at once: 256 connections, each
/// with two memory tables (a table and its replacement, until the old one
/// is unmapped) of 32 shrinkable regions. Sealed memfds take no slot. A
/// table that finds no free slot is refused (the port's request fails; the
/// device and the other ports go on). The handler scans every slot, which
/// only costs time when a frontend shrank its memory.
pub const SLOTS: usize = 16384;

/// One watched mapping, written under [`KEEPER`], read by the handler.
struct Slot {
    /// Sequence lock: odd while the slot is being written.
    seq: AtomicU64,
    /// First byte of the mapping.
    start: AtomicUsize,
    /// Length of the mapping, rounded up to `align`; 0 when free.
    len: AtomicUsize,
    /// Page size of the mapping (huge page size on hugetlbfs).
    align: AtomicUsize,
    /// Set by the handler when it replaced pages of this mapping.
    poisoned: AtomicBool,
}

impl Slot {
    const fn free() -> Slot {
        Slot {
            seq: AtomicU64::new(0),
            start: AtomicUsize::new(0),
            len: AtomicUsize::new(0),
            align: AtomicUsize::new(0),
            poisoned: AtomicBool::new(false),
        }
    }

    /// Writes the slot (the caller holds [`KEEPER`], so writers never race).
    fn write(&self, start: usize, len: usize, align: usize) {
        let seq = self.seq.load(Ordering::Relaxed);
        self.seq.store(seq.wrapping_add(1), Ordering::Relaxed);
        fence(Ordering::Release);
        self.start.store(start, Ordering::Relaxed);
        self.len.store(len, Ordering::Relaxed);
        self.align.store(align, Ordering::Relaxed);
        self.poisoned.store(false, Ordering::Relaxed);
        self.seq.store(seq.wrapping_add(2), Ordering::Release);
    }

    /// Reads `(start, len, align)` if the slot is in use and was not being
    /// written meanwhile. Async-signal-safe: atomics only.
    fn read(&self) -> Option<(usize, usize, usize)> {
        let before = self.seq.load(Ordering::Acquire);
        if before % 2 == 1 {
            return None;
        }
        let start = self.start.load(Ordering::Relaxed);
        let len = self.len.load(Ordering::Relaxed);
        let align = self.align.load(Ordering::Relaxed);
        fence(Ordering::Acquire);
        let after = self.seq.load(Ordering::Relaxed);
        (before == after && len != 0).then_some((start, len, align))
    }
}

static REGISTRY: [Slot; SLOTS] = [const { Slot::free() }; SLOTS];

/// Pages replaced by the handler so far (all mappings).
static FAULTS_SURVIVED: AtomicU64 = AtomicU64::new(0);

/// A mapping the registry keeps alive until no one else refers to it.
struct Kept {
    slot: usize,
    region: Arc<MmapRegion>,
}

/// The registry's references to the watched mappings; its lock serialises
/// every slot write.
static KEEPER: Mutex<Vec<Kept>> = Mutex::new(Vec::new());

/// The SIGBUS disposition found when the guard was installed.
static PREVIOUS: OnceLock<libc::sigaction> = OnceLock::new();

/// Whether the handler is installed (or why it could not be).
static INSTALLED: OnceLock<Result<(), String>> = OnceLock::new();

/// Why a mapping cannot be watched.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GuardError {
    /// The SIGBUS handler could not be installed.
    #[error("cannot install the SIGBUS handler: {0}")]
    Install(String),
    /// Every slot is taken.
    #[error("all {SLOTS} slots for shrinkable frontend mappings are in use")]
    Full,
}

/// A watched mapping. Holding it keeps the mapping (and so its slot) alive.
#[derive(Clone)]
pub struct Guarded {
    slot: usize,
    _region: Arc<MmapRegion>,
}

impl fmt::Debug for Guarded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Guarded")
            .field("slot", &self.slot)
            .field("poisoned", &self.poisoned())
            .finish()
    }
}

impl Guarded {
    /// Whether the mapping lost pages (its file shrank or failed) and the
    /// handler replaced them with zero pages.
    pub fn poisoned(&self) -> bool {
        // The slot stays ours while `_region` keeps the mapping alive.
        REGISTRY[self.slot].poisoned.load(Ordering::Acquire)
    }
}

/// Watches `region` (mapped with pages of `align` bytes, a power of two):
/// installs the handler on first use and takes a slot.
pub fn guard(region: Arc<MmapRegion>, align: usize) -> Result<Guarded, GuardError> {
    install()?;
    let align = align.max(page_size());
    let start = region.as_ptr() as usize;
    let len = region
        .size()
        .checked_next_multiple_of(align)
        .ok_or(GuardError::Full)?;
    let mut kept = KEEPER.lock().unwrap_or_else(|e| e.into_inner());
    sweep(&mut kept);
    let used: Vec<bool> = {
        let mut used = vec![false; SLOTS];
        for k in kept.iter() {
            used[k.slot] = true;
        }
        used
    };
    let slot = used.iter().position(|u| !u).ok_or(GuardError::Full)?;
    REGISTRY[slot].write(start, len, align);
    kept.push(Kept {
        slot,
        region: Arc::clone(&region),
    });
    Ok(Guarded {
        slot,
        _region: region,
    })
}

/// Frees the slots of mappings no one refers to any more, and unmaps them
/// (slot first, so the handler never sees a slot for an unmapped range).
/// Called whenever a memory table is made or dropped.
pub fn release_unused() {
    let mut kept = KEEPER.lock().unwrap_or_else(|e| e.into_inner());
    sweep(&mut kept);
}

fn sweep(kept: &mut Vec<Kept>) {
    kept.retain(|k| {
        // Only the registry holds the mapping: no one can reach it (the
        // registry never hands its reference out), so no access can be in
        // flight. Free the slot; `retain` then drops the reference, which
        // unmaps.
        if Arc::strong_count(&k.region) > 1 {
            return true;
        }
        REGISTRY[k.slot].write(0, 0, 0);
        false
    });
}

/// Number of watched mappings.
pub fn watched() -> usize {
    KEEPER.lock().unwrap_or_else(|e| e.into_inner()).len()
}

/// How many times the handler replaced lost pages of a frontend mapping.
pub fn faults_survived() -> u64 {
    FAULTS_SURVIVED.load(Ordering::Relaxed)
}

fn page_size() -> usize {
    // SAFETY: sysconf has no memory effects.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size).unwrap_or(4096).max(4096)
}

fn install() -> Result<(), GuardError> {
    INSTALLED
        .get_or_init(|| {
            // SAFETY: a zeroed `sigaction` is a valid value (no handler, empty
            // mask, no flags); both calls only read and write these structs.
            unsafe {
                let mut previous: libc::sigaction = std::mem::zeroed();
                if libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut previous) != 0 {
                    return Err(std::io::Error::last_os_error().to_string());
                }
                // Recorded before the handler exists, so the handler always
                // finds it.
                let _ = PREVIOUS.set(previous);
                let mut action: libc::sigaction = std::mem::zeroed();
                action.sa_sigaction = on_sigbus as *const () as libc::sighandler_t;
                action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
                libc::sigemptyset(&mut action.sa_mask);
                if libc::sigaction(libc::SIGBUS, &action, std::ptr::null_mut()) != 0 {
                    return Err(std::io::Error::last_os_error().to_string());
                }
            }
            Ok(())
        })
        .clone()
        .map_err(GuardError::Install)
}

/// The SIGBUS handler. Async-signal-safe: it reads atomics, makes the
/// `mmap` and `sigaction` system calls, and calls the previous handler; it
/// neither allocates nor locks.
extern "C" fn on_sigbus(signal: libc::c_int, info: *mut libc::siginfo_t, context: *mut c_void) {
    // SAFETY: with SA_SIGINFO the kernel passes a valid siginfo_t; si_addr
    // is the faulting address for a SIGBUS raised by a memory access.
    let (code, addr) = unsafe { ((*info).si_code, (*info).si_addr() as usize) };
    if code == libc::BUS_ADRERR && replace_lost_pages(addr) {
        return;
    }
    chain(signal, info, context);
}

/// If `addr` lies in a watched mapping, maps zero pages over the mapping
/// from `addr`'s page to its end and marks it poisoned.
fn replace_lost_pages(addr: usize) -> bool {
    for slot in REGISTRY.iter() {
        let Some((start, len, align)) = slot.read() else {
            continue;
        };
        if addr < start || addr - start >= len {
            continue;
        }
        let from = addr & !(align - 1);
        let end = start + len;
        // SAFETY: [from, end) lies inside a mapping that is live while the
        // faulting access runs: the access holds a reference to it, and its
        // slot (just read consistently) is freed only once no reference but
        // the registry's is left. Replacing its pages with private anonymous
        // ones changes what the device reads and writes there (zeros, never
        // seen by the frontend) but leaves every pointer into it valid; the
        // range is unmapped as a whole later. `from` and `len` are multiples
        // of the mapping's page size, as MAP_FIXED over hugetlbfs requires.
        // The raw system call takes no lock, so it is safe in a handler.
        let r = unsafe {
            libc::syscall(
                libc::SYS_mmap,
                from as *mut c_void,
                end - from,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_FIXED | libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1 as libc::c_int,
                0 as libc::off_t,
            )
        };
        if r as usize != from {
            return false;
        }
        slot.poisoned.store(true, Ordering::Release);
        FAULTS_SURVIVED.fetch_add(1, Ordering::Relaxed);
        return true;
    }
    false
}

/// Hands a SIGBUS that is not ours to the previous disposition.
fn chain(signal: libc::c_int, info: *mut libc::siginfo_t, context: *mut c_void) {
    if let Some(previous) = PREVIOUS.get() {
        let handler = previous.sa_sigaction;
        if handler != libc::SIG_DFL && handler != libc::SIG_IGN {
            if previous.sa_flags & libc::SA_SIGINFO != 0 {
                // SAFETY: with SA_SIGINFO the previous handler was installed
                // as `void (*)(int, siginfo_t *, void *)`; it gets the
                // arguments the kernel gave us.
                let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut c_void) =
                    unsafe { std::mem::transmute(handler) };
                f(signal, info, context);
            } else {
                // SAFETY: without SA_SIGINFO the previous handler was
                // installed as `void (*)(int)`.
                let f: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(handler) };
                f(signal);
            }
            return;
        }
    }
    // The default action: restore it and let the signal take it. A fault
    // raises SIGBUS again when the access is retried on return; a SIGBUS
    // sent by kill() is raised again (it stays blocked until we return).
    // SAFETY: sigaction and raise are async-signal-safe; the struct is a
    // valid "default action" disposition.
    unsafe {
        let mut default: libc::sigaction = std::mem::zeroed();
        default.sa_sigaction = libc::SIG_DFL;
        libc::sigemptyset(&mut default.sa_mask);
        libc::sigaction(libc::SIGBUS, &default, std::ptr::null_mut());
        // SAFETY: info is valid (see on_sigbus).
        if (*info).si_code <= 0 {
            libc::raise(libc::SIGBUS);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;
    use vm_memory::FileOffset;

    fn shrinkable(size: usize) -> (std::fs::File, Arc<MmapRegion>) {
        let file = tempfile::tempfile_in("/dev/shm").unwrap();
        file.set_len(size as u64).unwrap();
        let region = MmapRegion::from_file(FileOffset::new(file.try_clone().unwrap(), 0), size)
            .expect("map");
        (file, Arc::new(region))
    }

    fn read_volatile(region: &MmapRegion, offset: usize) -> u8 {
        assert!(offset < region.size());
        // SAFETY: offset is inside the live mapping.
        unsafe { std::ptr::read_volatile(region.as_ptr().add(offset)) }
    }

    fn write_volatile(region: &MmapRegion, offset: usize, value: u8) {
        assert!(offset < region.size());
        // SAFETY: offset is inside the live, writable mapping.
        unsafe { std::ptr::write_volatile(region.as_ptr().add(offset), value) }
    }

    #[test]
    fn a_shrunk_file_reads_zeros_and_poisons_only_its_mapping() {
        let (file, region) = shrinkable(4 * 4096);
        let (_other_file, other) = shrinkable(4096);
        let guarded = guard(Arc::clone(&region), 4096).unwrap();
        let other_guarded = guard(Arc::clone(&other), 4096).unwrap();
        write_volatile(&region, 0, 7);
        write_volatile(&region, 3 * 4096, 9);
        assert!(!guarded.poisoned());
        file.set_len(4096).unwrap();
        // Page 0 is still backed; page 3 is gone: a zero page, writable.
        assert_eq!(read_volatile(&region, 0), 7);
        assert_eq!(read_volatile(&region, 3 * 4096), 0);
        assert!(guarded.poisoned());
        write_volatile(&region, 2 * 4096 + 5, 1);
        assert_eq!(read_volatile(&region, 2 * 4096 + 5), 1);
        assert!(!other_guarded.poisoned());
        assert!(faults_survived() >= 1);
    }

    #[test]
    fn mappings_are_unmapped_only_when_unused() {
        let (_file, region) = shrinkable(4096);
        let guarded = guard(Arc::clone(&region), 4096).unwrap();
        let weak = Arc::downgrade(&region);
        let start = region.as_ptr() as usize;
        let slot = guarded.slot;
        release_unused();
        assert_eq!(REGISTRY[slot].read().map(|s| s.0), Some(start));
        drop(region);
        release_unused();
        assert!(weak.upgrade().is_some(), "still held by `guarded`");
        assert_eq!(REGISTRY[slot].read().map(|s| s.0), Some(start));
        drop(guarded);
        release_unused();
        assert!(weak.upgrade().is_none(), "slot freed and unmapped");
    }

    /// A SIGBUS outside every watched mapping still kills the process.
    #[test]
    fn faults_elsewhere_keep_their_default_action() {
        const CHILD: &str = "EMU_DEVICE_SIGBUS_CHILD";
        if std::env::var_os(CHILD).is_some() {
            // The guard is installed, but this mapping is not watched.
            let (_w, watched) = shrinkable(4096);
            let _g = guard(watched, 4096).unwrap();
            let (file, region) = shrinkable(2 * 4096);
            file.set_len(0).unwrap();
            read_volatile(&region, 4096);
            unreachable!("the access above raises SIGBUS");
        }
        let status = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "sigbus::tests::faults_elsewhere_keep_their_default_action",
                "--test-threads=1",
            ])
            .env(CHILD, "1")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .unwrap();
        assert_eq!(status.signal(), Some(libc::SIGBUS), "{status:?}");
    }
}
