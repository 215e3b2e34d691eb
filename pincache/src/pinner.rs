//! The seam between the cache and whatever really pins memory.

use std::fmt;
use std::io;

/// A page-aligned range of virtual memory, `[start, start + len)`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PageRange {
    /// First byte, a multiple of the page size.
    pub start: usize,
    /// Length in bytes, a non-zero multiple of the page size.
    pub len: usize,
}

impl PageRange {
    /// One past the last byte.
    pub fn end(&self) -> usize {
        self.start + self.len
    }

    /// Whether `[addr, addr + len)` lies inside this range.
    pub fn contains(&self, addr: usize, len: usize) -> bool {
        addr >= self.start && addr.saturating_add(len) <= self.end()
    }
}

impl fmt::Display for PageRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{:#x}, {:#x})", self.start, self.end())
    }
}

/// Why a [`Pinner`] could not pin a range.
#[derive(Debug, thiserror::Error)]
pub enum PinError {
    /// The process's locked-memory limit does not allow the pin.
    #[error(
        "cannot pin {range} ({bytes} bytes): RLIMIT_MEMLOCK is {limit} bytes and {locked} bytes \
         are already locked; raise it (`ulimit -l`, setrlimit, or CAP_IPC_LOCK) or lower the \
         cache's max_pinned_bytes ({source})",
        bytes = range.len
    )]
    MemlockLimit {
        /// The range that was to be pinned.
        range: PageRange,
        /// The soft RLIMIT_MEMLOCK in bytes (`u64::MAX` when unlimited).
        limit: u64,
        /// Bytes this process had locked before the call (VmLck).
        locked: u64,
        /// The error the kernel returned.
        source: io::Error,
    },
    /// Part of the range is not mapped.
    #[error("cannot pin {range}: part of it is not mapped ({source})")]
    Unmapped {
        /// The range that was to be pinned.
        range: PageRange,
        /// The error the kernel returned.
        source: io::Error,
    },
    /// Any other failure of the pinning mechanism.
    #[error("cannot pin {range}: {operation} failed: {source}")]
    Os {
        /// The range that was to be pinned.
        range: PageRange,
        /// The system call or device operation that failed.
        operation: &'static str,
        /// The error the kernel returned.
        source: io::Error,
    },
    /// The memory cannot be made reachable by the device (the pinner says
    /// why; a driver can downcast `source` to its own error type).
    #[error("cannot pin {range}: {source}")]
    Unreachable {
        /// The range that was to be pinned.
        range: PageRange,
        /// Why.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A device-specific failure (translation table full, device gone, ...).
    #[error("cannot pin {range}: {reason}")]
    Device {
        /// The range that was to be pinned.
        range: PageRange,
        /// What the device reported.
        reason: String,
    },
}

/// Does the real work of pinning: makes a page-aligned range resident and
/// visible to a device, and undoes it. The cache decides *when*.
///
/// Implementations must tolerate overlapping pins (the cache may pin a merged
/// region before unpinning the regions it replaces) and must not call back
/// into the cache that owns them: the cache calls them under its writer lock.
pub trait Pinner: Send + Sync {
    /// What the device needs to address the pinned range (an IOVA, a
    /// translation-table index, a memory key); handed out with every hit.
    type Token: Send + Sync;

    /// Pins `range` and returns the device's token for it.
    fn pin(&self, range: PageRange) -> Result<Self::Token, PinError>;

    /// Undoes one earlier `pin` of exactly `range`. Must not fail: if the
    /// memory is already gone (unmapped), the pin is gone with it.
    fn unpin(&self, range: PageRange, token: Self::Token);

    /// The memory of `unmapped` is gone (unmapped or about to be): every pin
    /// there is void, and a later `pin` there is of new memory. Called once
    /// per unmapping, before the `unpin_unmapped` calls of the regions there.
    fn forget(&self, unmapped: PageRange) {
        let _ = unmapped;
    }

    /// Undoes a `pin` of `range` after [`forget`](Self::forget) was told
    /// that the ranges of `unmapped`, which overlap it, are gone: only the
    /// rest of `range` ([`PageRange::minus_all`]) still needs undoing.
    fn unpin_unmapped(&self, range: PageRange, token: Self::Token, unmapped: &[PageRange]) {
        let _ = unmapped;
        self.unpin(range, token);
    }
}

impl PageRange {
    /// Whether the two ranges share a page.
    pub fn overlaps(&self, other: PageRange) -> bool {
        self.start < other.end() && other.start < self.end()
    }

    /// The parts of `self` outside every range of `others`, in order.
    pub fn minus_all(&self, others: &[PageRange]) -> Vec<PageRange> {
        let mut rest = vec![*self];
        for &other in others {
            rest = rest.iter().flat_map(|part| part.minus(other)).collect();
        }
        rest
    }

    /// The parts of `self` outside `other` (none, one or two ranges).
    pub fn minus(&self, other: PageRange) -> impl Iterator<Item = PageRange> {
        let left = PageRange {
            start: self.start,
            len: other.start.clamp(self.start, self.end()) - self.start,
        };
        let right_start = other.end().clamp(self.start, self.end());
        let right = PageRange {
            start: right_start,
            len: self.end() - right_start,
        };
        [left, right].into_iter().filter(|part| part.len > 0)
    }
}

/// A pinner that does nothing: it measures the cache's own cost and serves
/// memory that needs no pinning.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoopPinner;

impl Pinner for NoopPinner {
    type Token = ();

    fn pin(&self, _range: PageRange) -> Result<(), PinError> {
        Ok(())
    }

    fn unpin(&self, _range: PageRange, _token: ()) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minus_keeps_the_parts_outside() {
        let range = PageRange {
            start: 0x1000,
            len: 0x4000,
        };
        let cut = |start, len| range.minus(PageRange { start, len }).collect::<Vec<_>>();
        assert_eq!(
            cut(0x2000, 0x1000),
            vec![
                PageRange {
                    start: 0x1000,
                    len: 0x1000
                },
                PageRange {
                    start: 0x3000,
                    len: 0x2000
                }
            ]
        );
        assert_eq!(cut(0, 0x10000), vec![]);
        assert_eq!(cut(0x8000, 0x1000), vec![range]);
        assert_eq!(
            cut(0, 0x2000),
            vec![PageRange {
                start: 0x2000,
                len: 0x3000
            }]
        );
    }
}
