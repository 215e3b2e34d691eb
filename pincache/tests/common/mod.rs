//! Shared test fixtures.
#![allow(dead_code)]

use std::sync::Arc;

use parking_lot::Mutex;
use pindown_pincache::{PageRange, PinError, Pinner};

/// What a [`TrackingPinner`] has seen.
#[derive(Debug, Default)]
pub struct PinLog {
    /// Ranges pinned now, with the serial of the pin that pinned them.
    pub pinned: Vec<(PageRange, u64)>,
    /// Calls to `pin` that succeeded.
    pub pins: u64,
    /// Calls to `unpin`.
    pub unpins: u64,
    /// Next serial to hand out.
    pub next_serial: u64,
    /// When set, `pin` fails for ranges that overlap this one.
    pub refuse: Option<PageRange>,
}

/// A pinner that touches no memory and records every call; its token is a
/// serial number, unique per successful `pin`.
#[derive(Debug, Default, Clone)]
pub struct TrackingPinner {
    pub log: Arc<Mutex<PinLog>>,
}

impl Pinner for TrackingPinner {
    type Token = u64;

    fn pin(&self, range: PageRange) -> Result<u64, PinError> {
        let mut log = self.log.lock();
        if let Some(refused) = log.refuse {
            if refused.start < range.end() && range.start < refused.end() {
                return Err(PinError::Device {
                    range,
                    reason: "refused by the test".into(),
                });
            }
        }
        log.next_serial += 1;
        let serial = log.next_serial;
        log.pinned.push((range, serial));
        log.pins += 1;
        Ok(serial)
    }

    fn unpin(&self, range: PageRange, token: u64) {
        let mut log = self.log.lock();
        let position = log
            .pinned
            .iter()
            .position(|&(r, serial)| serial == token && r == range)
            .unwrap_or_else(|| panic!("unpin of {range} (serial {token}) that is not pinned"));
        log.pinned.swap_remove(position);
        log.unpins += 1;
    }
}

/// Where test mappings go: far below where the kernel places mappings on
/// its own (top-down from just under the stack), so that a hole a test leaves
/// by unmapping is never filled by another thread's allocation before the
/// test maps the same address again.
static NEXT_TEST_ADDRESS: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(0x1000_0000_0000);

/// Maps `len` bytes of fresh anonymous memory in the test area.
pub fn map_anonymous(len: usize) -> *mut u8 {
    loop {
        let slot = len.next_multiple_of(1 << 21) + (1 << 21);
        let hint = NEXT_TEST_ADDRESS.fetch_add(slot, std::sync::atomic::Ordering::Relaxed);
        // SAFETY: MAP_FIXED_NOREPLACE never replaces an existing mapping.
        let pointer = unsafe {
            libc::mmap(
                hint as *mut libc::c_void,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
                -1,
                0,
            )
        };
        if pointer as usize == hint {
            return pointer.cast();
        }
        assert!(hint < 0x4000_0000_0000, "no room for test mappings");
    }
}

/// Maps `len` bytes of fresh anonymous memory at exactly `addr`.
pub fn map_anonymous_at(addr: *mut u8, len: usize) -> *mut u8 {
    // SAFETY: MAP_FIXED_NOREPLACE never replaces an existing mapping; the
    // address was unmapped by the caller.
    let pointer = unsafe {
        libc::mmap(
            addr.cast(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
            -1,
            0,
        )
    };
    assert_eq!(
        pointer.cast(),
        addr,
        "could not map again at {addr:?}: {}",
        std::io::Error::last_os_error()
    );
    pointer.cast()
}

/// Unmaps memory mapped by [`map_anonymous`] with a plain `munmap`.
pub fn unmap_plain(addr: *mut u8, len: usize) {
    // SAFETY: the test owns the mapping and no longer uses it.
    assert_eq!(unsafe { libc::munmap(addr.cast(), len) }, 0);
}
