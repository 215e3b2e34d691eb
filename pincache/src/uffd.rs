//! The userfaultfd ABI (linux/userfaultfd.h), the few parts the monitor uses.
//!
//! Written out here rather than taken from the `userfaultfd-sys` crate, whose
//! build runs bindgen and so needs libclang on every machine that builds us;
//! these layouts are part of the kernel's stable ABI.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

const UFFD_API: u64 = 0xAA;
const UFFDIO_API: libc::c_ulong = 0xc018_aa3f;
const UFFDIO_REGISTER: libc::c_ulong = 0xc020_aa00;
const UFFDIO_UNREGISTER: libc::c_ulong = 0x8010_aa01;
const UFFDIO_WRITEPROTECT: libc::c_ulong = 0xc018_aa06;

/// Register mode: deliver write-protect faults (none happen unless pages
/// are write-protected, which the monitor never does).
const UFFDIO_REGISTER_MODE_WP: u64 = 1 << 1;

/// `UFFDIO_WRITEPROTECT` mode: protect (without it: unprotect and wake).
const UFFDIO_WRITEPROTECT_MODE_WP: u64 = 1 << 0;

pub(crate) const UFFD_FEATURE_PAGEFAULT_FLAG_WP: u64 = 1 << 0;
const UFFD_FEATURE_EVENT_REMAP: u64 = 1 << 2;
const UFFD_FEATURE_EVENT_REMOVE: u64 = 1 << 3;
const UFFD_FEATURE_EVENT_UNMAP: u64 = 1 << 6;
/// `userfaultfd` flag: handle faults from user mode only (Linux 5.11);
/// allowed without CAP_SYS_PTRACE whatever `vm.unprivileged_userfaultfd`
/// says.
const UFFD_USER_MODE_ONLY: libc::c_int = 1;
/// Write-protection also covers pages not populated yet (Linux 6.4).
pub(crate) const UFFD_FEATURE_WP_UNPOPULATED: u64 = 1 << 13;

/// Event codes of `uffd_msg.event`.
pub(crate) const EVENT_REMAP: u8 = 0x14;
pub(crate) const EVENT_REMOVE: u8 = 0x15;
pub(crate) const EVENT_UNMAP: u8 = 0x16;

#[repr(C)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct UffdioRange {
    start: u64,
    len: u64,
}

#[repr(C)]
struct UffdioWriteprotect {
    range: UffdioRange,
    mode: u64,
}

#[repr(C)]
struct UffdioRegister {
    range: UffdioRange,
    mode: u64,
    ioctls: u64,
}

/// One 32-byte `struct uffd_msg`: event code at byte 0, then a union whose
/// first three 64-bit words carry the event's arguments from byte 8.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct RawMessage {
    pub event: u8,
    reserved: [u8; 7],
    pub args: [u64; 3],
}

/// What an event says went away.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Gone {
    /// `[start, end)` no longer maps what it did; `unmapped` when the mapping
    /// itself went (munmap, mremap), not just its contents (madvise).
    Range {
        start: u64,
        end: u64,
        unmapped: bool,
    },
    /// An event the monitor does not act on.
    Other(u8),
}

impl RawMessage {
    /// Decodes the range an unmap, remove or remap event reports.
    pub(crate) fn gone(&self) -> Gone {
        match self.event {
            // uffd_msg.arg.remove / .unmap: { start, end }
            EVENT_REMOVE | EVENT_UNMAP => Gone::Range {
                start: self.args[0],
                end: self.args[1],
                unmapped: self.event == EVENT_UNMAP,
            },
            // uffd_msg.arg.remap: { from, to, len }: the old range is gone.
            EVENT_REMAP => Gone::Range {
                start: self.args[0],
                end: self.args[0].saturating_add(self.args[2]),
                unmapped: true,
            },
            other => Gone::Other(other),
        }
    }
}

/// An open userfaultfd with the unmap, remove and remap events enabled.
pub(crate) struct Userfaultfd {
    fd: OwnedFd,
}

impl Userfaultfd {
    /// Opens a non-blocking userfaultfd and negotiates the events.
    ///
    /// Where the process may not handle kernel-mode faults (no
    /// CAP_SYS_PTRACE while `vm.unprivileged_userfaultfd` is 0), it asks
    /// for a descriptor that handles user-mode faults only (Linux 5.11):
    /// the monitor handles no fault at all, only events, which such a
    /// descriptor delivers alike.
    pub(crate) fn open() -> io::Result<Self> {
        let wanted = UFFD_FEATURE_EVENT_UNMAP
            | UFFD_FEATURE_EVENT_REMOVE
            | UFFD_FEATURE_EVENT_REMAP
            | UFFD_FEATURE_PAGEFAULT_FLAG_WP;
        match Self::open_with(wanted) {
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => {
                Self::negotiate(Self::descriptor(UFFD_USER_MODE_ONLY)?, wanted)
            }
            other => other,
        }
    }

    /// Opens a non-blocking userfaultfd with the features `required`, able
    /// to handle faults from the kernel too (a write fence needs that: a
    /// system call writing into a fenced page must wait, not fail).
    pub(crate) fn open_with(required: u64) -> io::Result<Self> {
        Self::negotiate(Self::descriptor(0)?, required)
    }

    /// The handshake on a new descriptor: asks for `required` features.
    fn negotiate(fd: OwnedFd, required: u64) -> io::Result<Self> {
        let mut api = UffdioApi {
            api: UFFD_API,
            features: required,
            ioctls: 0,
        };
        // SAFETY: UFFDIO_API reads and writes one UffdioApi we own.
        if unsafe { libc::ioctl(fd.as_raw_fd(), UFFDIO_API, &mut api) } != 0 {
            return Err(io::Error::last_os_error());
        }
        if api.features & required != required {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!(
                    "userfaultfd lacks features {:#x} (it offers {:#x})",
                    required & !api.features,
                    api.features
                ),
            ));
        }
        Ok(Userfaultfd { fd })
    }

    /// The features the kernel offers (asked once per process: the
    /// handshake that reports them can be made only once per descriptor).
    pub(crate) fn offered_features() -> io::Result<u64> {
        static OFFERED: std::sync::OnceLock<Result<u64, i32>> = std::sync::OnceLock::new();
        let offered = OFFERED.get_or_init(|| {
            let fd = Self::descriptor(0).map_err(|e| e.raw_os_error().unwrap_or(libc::EINVAL))?;
            let mut probe = UffdioApi {
                api: UFFD_API,
                features: 0,
                ioctls: 0,
            };
            // SAFETY: UFFDIO_API reads and writes one UffdioApi we own.
            if unsafe { libc::ioctl(fd.as_raw_fd(), UFFDIO_API, &mut probe) } != 0 {
                return Err(io::Error::last_os_error()
                    .raw_os_error()
                    .unwrap_or(libc::EINVAL));
            }
            Ok(probe.features)
        });
        offered.map_err(io::Error::from_raw_os_error)
    }

    /// A new non-blocking userfaultfd, before its handshake; `mode`: 0 or
    /// [`UFFD_USER_MODE_ONLY`].
    fn descriptor(mode: libc::c_int) -> io::Result<OwnedFd> {
        // SAFETY: userfaultfd takes flags only and returns a new descriptor.
        let raw = unsafe {
            libc::syscall(
                libc::SYS_userfaultfd,
                libc::O_CLOEXEC | libc::O_NONBLOCK | mode,
            )
        };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the descriptor is new and owned by nobody else.
        Ok(unsafe { OwnedFd::from_raw_fd(raw as i32) })
    }

    /// Starts receiving events for `[start, start + len)`.
    pub(crate) fn register(&self, start: usize, len: usize) -> io::Result<()> {
        self.register_write_protect(start, len)
    }

    /// Registers `[start, start + len)` in write-protect mode: its events,
    /// and the faults of writes to pages [`write_protect`](Self::write_protect)
    /// protected.
    pub(crate) fn register_write_protect(&self, start: usize, len: usize) -> io::Result<()> {
        let mut register = UffdioRegister {
            range: UffdioRange {
                start: start as u64,
                len: len as u64,
            },
            mode: UFFDIO_REGISTER_MODE_WP,
            ioctls: 0,
        };
        // SAFETY: UFFDIO_REGISTER reads and writes one UffdioRegister we own.
        if unsafe { libc::ioctl(self.fd.as_raw_fd(), UFFDIO_REGISTER, &mut register) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Write-protects `[start, start + len)` (registered in write-protect
    /// mode): a thread that writes there blocks until the protection is
    /// lifted or the descriptor closed.
    pub(crate) fn write_protect(&self, start: usize, len: usize) -> io::Result<()> {
        let mut protect = UffdioWriteprotect {
            range: UffdioRange {
                start: start as u64,
                len: len as u64,
            },
            mode: UFFDIO_WRITEPROTECT_MODE_WP,
        };
        // SAFETY: UFFDIO_WRITEPROTECT reads one UffdioWriteprotect we own.
        if unsafe { libc::ioctl(self.fd.as_raw_fd(), UFFDIO_WRITEPROTECT, &mut protect) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Stops receiving events for `[start, start + len)`; parts that are no
    /// longer mapped are skipped.
    pub(crate) fn unregister(&self, start: usize, len: usize) -> io::Result<()> {
        let mut range = UffdioRange {
            start: start as u64,
            len: len as u64,
        };
        // SAFETY: UFFDIO_UNREGISTER reads one UffdioRange we own.
        if unsafe { libc::ioctl(self.fd.as_raw_fd(), UFFDIO_UNREGISTER, &mut range) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Reads the pending events into `buffer`; returns how many. Zero when
    /// none is pending.
    pub(crate) fn read(&self, buffer: &mut [RawMessage]) -> io::Result<usize> {
        let bytes = std::mem::size_of_val(buffer);
        // SAFETY: the kernel writes whole 32-byte messages into the buffer we
        // own, of which we pass the exact size; RawMessage has no invalid bit
        // patterns.
        let read = unsafe { libc::read(self.fd.as_raw_fd(), buffer.as_mut_ptr().cast(), bytes) };
        if read < 0 {
            let error = io::Error::last_os_error();
            return match error.raw_os_error() {
                Some(libc::EAGAIN) => Ok(0),
                _ => Err(error),
            };
        }
        Ok(read as usize / std::mem::size_of::<RawMessage>())
    }

    /// Blocks until an event is pending.
    pub(crate) fn wait(&self) -> io::Result<()> {
        let mut poll = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll reads and writes one pollfd we own.
        if unsafe { libc::poll(&mut poll, 1, -1) } < 0 {
            let error = io::Error::last_os_error();
            if error.kind() != io::ErrorKind::Interrupted {
                return Err(error);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_layout_matches_the_kernel() {
        assert_eq!(std::mem::size_of::<RawMessage>(), 32);
        assert_eq!(std::mem::size_of::<UffdioApi>(), 24);
        assert_eq!(std::mem::size_of::<UffdioRegister>(), 32);
        assert_eq!(std::mem::size_of::<UffdioWriteprotect>(), 24);
        let remap = RawMessage {
            event: EVENT_REMAP,
            args: [0x1000, 0x9000, 0x2000],
            ..Default::default()
        };
        assert_eq!(
            remap.gone(),
            Gone::Range {
                start: 0x1000,
                end: 0x3000,
                unmapped: true,
            }
        );
    }
}
