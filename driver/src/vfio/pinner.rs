//! The pin-down cache's pinner inside a guest: `VFIO_IOMMU_MAP_DMA`.

use std::sync::Arc;

use parking_lot::Mutex;
use pindown_pincache::{PageRange, PinError, Pinner, RangeRefCounts};

use super::VfioDma;

/// Pins by mapping the range for DMA through a VFIO container: the guest
/// kernel pins the pages (charged to RLIMIT_MEMLOCK) and installs IOMMU
/// entries, which QEMU's virtual IOMMU hands to the device on its IOTLB
/// misses. Unpinning unmaps (QEMU relays an IOTLB invalidation) and unpins.
/// The token is the IOVA of the range (its virtual address: identity
/// IOVAs).
///
/// The cache may pin overlapping ranges; VFIO mappings may not overlap. As
/// [`IotlbPinner`](crate::IotlbPinner) does, the pinner counts references
/// per page and maps only pages going from zero to one reference, unmapping
/// those dropping to zero.
///
/// Limits: every mapping is one entry of the container's DMA entry limit
/// ([`VfioDma::entry_limit`], 65535 by default), and pinned bytes count
/// against RLIMIT_MEMLOCK; configure the cache's `max_entries` and
/// `max_pinned_bytes` below them.
#[derive(Debug)]
pub struct VfioPinner {
    dma: Arc<VfioDma>,
    mapped: Mutex<RangeRefCounts>,
}

impl VfioPinner {
    /// A pinner mapping through `dma`.
    pub fn new(dma: Arc<VfioDma>) -> Self {
        VfioPinner {
            dma,
            mapped: Mutex::new(RangeRefCounts::new()),
        }
    }

    /// The mappings it makes.
    pub fn dma(&self) -> &Arc<VfioDma> {
        &self.dma
    }

    /// Bytes currently mapped for DMA by this pinner.
    pub fn mapped_len(&self) -> usize {
        self.mapped.lock().covered_len()
    }
}

impl Pinner for VfioPinner {
    type Token = u64;

    fn pin(&self, range: PageRange) -> Result<u64, PinError> {
        let mut mapped = self.mapped.lock();
        let fresh = mapped.acquire(range.start..range.end());
        for (done, part) in fresh.iter().enumerate() {
            let len = (part.end - part.start) as u64;
            if let Err(err) = self.dma.map(part.start as u64, len, part.start as u64) {
                for undo in &fresh[..done] {
                    let _ = self
                        .dma
                        .unmap(undo.start as u64, (undo.end - undo.start) as u64);
                }
                mapped.release(range.start..range.end());
                return Err(PinError::Device {
                    range,
                    reason: err.to_string(),
                });
            }
        }
        Ok(range.start as u64)
    }

    fn unpin(&self, range: PageRange, _token: u64) {
        let freed = self.mapped.lock().release(range.start..range.end());
        for part in freed {
            let _ = self
                .dma
                .unmap(part.start as u64, (part.end - part.start) as u64);
        }
    }

    fn forget(&self, unmapped: PageRange) {
        if self.mapped.lock().clear(unmapped.start..unmapped.end()) {
            let _ = self.dma.unmap(unmapped.start as u64, unmapped.len as u64);
        }
    }

    fn unpin_unmapped(&self, range: PageRange, _token: u64, unmapped: &[PageRange]) {
        let mut mapped = self.mapped.lock();
        for rest in range.minus_all(unmapped) {
            for part in mapped.release_lenient(rest.start..rest.end()) {
                let _ = self
                    .dma
                    .unmap(part.start as u64, (part.end - part.start) as u64);
            }
        }
    }
}
