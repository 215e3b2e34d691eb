//! VFIO DMA mappings: the guest kernel pins, the (virtual) IOMMU translates.
//!
//! [`VfioDma`] owns a VFIO type1 container and the table of the mappings
//! made through it. `VFIO_IOMMU_MAP_DMA` pins the pages and installs IOMMU
//! page-table entries; inside a QEMU guest with `intel-iommu` and
//! `caching-mode=on`, QEMU learns of them and answers the device's IOTLB
//! misses with them. `VFIO_IOMMU_UNMAP_DMA` removes them (QEMU relays an
//! IOTLB invalidation to the device) and unpins.
//!
//! VFIO's type1v2 mappings cannot overlap and cannot be unmapped in part. The
//! table gives the semantics of a device IOTLB on top: [`map`](VfioDma::map)
//! maps only the parts of the range not mapped yet, and
//! [`unmap`](VfioDma::unmap) removes every translation inside the range,
//! splitting a mapping that straddles its ends (unmap, then map the parts
//! outside again).
//!
//! **IOVAs.** The driver uses identity IOVAs (IOVA = the virtual address of
//! the byte in this process), as on the host: the verbs layer names arena
//! addresses in work requests. Userspace addresses of x86-64 reach 47 bits,
//! so the guest's IOMMU must have 48-bit IOVAs (QEMU:
//! `-device intel-iommu,aw-bits=48`); with the default 39 bits, maps fail
//! with `EINVAL`/`EFAULT`. [`VfioDma::iova_limit`] reports the limit found.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use vfio_ioctls::VfioContainer;

use crate::transport::TransportError;

/// What makes and removes one DMA mapping: a VFIO container, or a fake in
/// unit tests.
trait DmaBackend: Send + Sync {
    /// `VFIO_IOMMU_MAP_DMA`.
    ///
    /// # Safety
    ///
    /// `[uaddr, uaddr + len)` is memory of this process that stays mapped
    /// while the mapping exists, and that the device may read and write.
    unsafe fn map(&self, iova: u64, len: u64, uaddr: u64) -> Result<(), String>;
    /// `VFIO_IOMMU_UNMAP_DMA` of exactly one earlier mapping.
    fn unmap(&self, iova: u64, len: u64) -> Result<(), String>;
}

impl DmaBackend for VfioContainer {
    unsafe fn map(&self, iova: u64, len: u64, uaddr: u64) -> Result<(), String> {
        // SAFETY: the caller upholds the contract of `vfio_dma_map` (memory
        // of this process, mapped while the mapping lives, device access
        // expected and only touched by the driver through volatile or atomic
        // accesses).
        unsafe { self.vfio_dma_map(iova, len as usize, uaddr as *mut u8) }
            .map_err(|err| err.to_string())
    }

    fn unmap(&self, iova: u64, len: u64) -> Result<(), String> {
        self.vfio_dma_unmap(iova, len as usize)
            .map_err(|err| err.to_string())
    }
}

/// The VFIO DMA mappings of one container, with IOTLB-like semantics.
pub struct VfioDma {
    container: Option<Arc<VfioContainer>>,
    backend: Arc<dyn DmaBackend>,
    /// Mappings by IOVA: (length, userspace address).
    maps: Mutex<BTreeMap<u64, (u64, u64)>>,
    map_calls: AtomicU64,
    unmap_calls: AtomicU64,
    /// Set in a child of `fork()` that inherited the container from the
    /// process that mapped: the mappings are that process's, left alone.
    abandoned: AtomicBool,
}

impl std::fmt::Debug for VfioDma {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VfioDma")
            .field("entries", &self.entries())
            .field("mapped_bytes", &self.mapped_bytes())
            .finish()
    }
}

impl VfioDma {
    /// Wraps a container that has a group (and so an IOMMU) attached.
    pub fn new(container: Arc<VfioContainer>) -> Self {
        VfioDma {
            backend: Arc::clone(&container) as Arc<dyn DmaBackend>,
            container: Some(container),
            maps: Mutex::new(BTreeMap::new()),
            map_calls: AtomicU64::new(0),
            unmap_calls: AtomicU64::new(0),
            abandoned: AtomicBool::new(false),
        }
    }

    /// The container.
    pub fn container(&self) -> Option<&Arc<VfioContainer>> {
        self.container.as_ref()
    }

    /// Mappings in place (VFIO DMA entries used).
    pub fn entries(&self) -> usize {
        self.maps.lock().len()
    }

    /// Bytes mapped.
    pub fn mapped_bytes(&self) -> u64 {
        self.maps.lock().values().map(|(len, _)| len).sum()
    }

    /// `VFIO_IOMMU_MAP_DMA` and `VFIO_IOMMU_UNMAP_DMA` calls made so far.
    pub fn calls(&self) -> (u64, u64) {
        (
            self.map_calls.load(Ordering::Relaxed),
            self.unmap_calls.load(Ordering::Relaxed),
        )
    }

    /// The kernel's per-container limit of DMA mappings
    /// (`/sys/module/vfio_iommu_type1/parameters/dma_entry_limit`).
    pub fn entry_limit() -> Option<usize> {
        std::fs::read_to_string("/sys/module/vfio_iommu_type1/parameters/dma_entry_limit")
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// Lets the device reach `[iova, iova + len)`, backed by this process's
    /// memory at `uaddr` (page aligned, mapped, read/write). Parts already
    /// mapped stay as they are.
    pub fn map(&self, iova: u64, len: u64, uaddr: u64) -> Result<(), TransportError> {
        check_range(iova, len, uaddr)?;
        let mut maps = self.maps.lock();
        let end = iova + len;
        let mut gaps = Vec::new();
        let mut cursor = iova;
        for (&start, &(mlen, _)) in overlapping(&maps, iova, end) {
            if start > cursor {
                gaps.push((cursor, start));
            }
            cursor = cursor.max(start + mlen);
        }
        if cursor < end {
            gaps.push((cursor, end));
        }
        for (done, &(start, stop)) in gaps.iter().enumerate() {
            let addr = uaddr + (start - iova);
            if let Err(err) = self.raw_map(start, stop - start, addr) {
                for &(s, e) in &gaps[..done] {
                    let _ = self.raw_unmap(s, e - s);
                    maps.remove(&s);
                }
                return Err(err);
            }
            maps.insert(start, (stop - start, addr));
        }
        Ok(())
    }

    /// Removes the device's translations of `[iova, iova + len)`; mappings
    /// reaching beyond it are split (their outer parts mapped again).
    pub fn unmap(&self, iova: u64, len: u64) -> Result<(), TransportError> {
        if len == 0 || iova.checked_add(len).is_none() {
            return Err(TransportError::InvalidArgument(format!(
                "DMA range of {len} bytes at {iova:#x}"
            )));
        }
        let end = iova + len;
        let mut maps = self.maps.lock();
        let hit: Vec<(u64, u64, u64)> = overlapping(&maps, iova, end)
            .map(|(&s, &(l, u))| (s, l, u))
            .collect();
        let mut first_error = None;
        for (start, mlen, uaddr) in hit {
            if let Err(err) = self.raw_unmap(start, mlen) {
                first_error.get_or_insert(err);
                continue;
            }
            maps.remove(&start);
            let stop = start + mlen;
            for (s, e) in [(start, iova.max(start)), (end.min(stop), stop)] {
                if s < e {
                    let addr = uaddr + (s - start);
                    match self.raw_map(s, e - s, addr) {
                        Ok(()) => {
                            maps.insert(s, (e - s, addr));
                        }
                        Err(err) => {
                            first_error.get_or_insert(err);
                        }
                    }
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Removes every mapping.
    pub fn unmap_all(&self) {
        let mut maps = self.maps.lock();
        for (&start, &(len, _)) in maps.iter() {
            let _ = self.raw_unmap(start, len);
        }
        maps.clear();
    }

    fn raw_map(&self, iova: u64, len: u64, uaddr: u64) -> Result<(), TransportError> {
        self.map_calls.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller hands us memory of this process that stays
        // mapped while the mapping exists (the pinner and the transport unmap
        // before the memory goes away); the device may read and write it at
        // any time, which is what it was registered for.
        unsafe { self.backend.map(iova, len, uaddr) }.map_err(|err| {
            // Identity IOVAs of userspace reach 47 bits; QEMU's intel-iommu
            // translates 39 unless told otherwise.
            let hint = if iova + len > 1 << 39 {
                " (IOVA above 39 bits: the IOMMU needs 48-bit addresses, \
                 QEMU -device intel-iommu,aw-bits=48)"
            } else {
                ""
            };
            TransportError::Io {
                operation: "VFIO_IOMMU_MAP_DMA",
                source: std::io::Error::other(format!(
                    "[{iova:#x}, +{len:#x}) from {uaddr:#x}: {err}{hint}"
                )),
            }
        })
    }

    /// Leaves every mapping to the process that made it (this one is a
    /// child of `fork()` sharing its container): from now on nothing is
    /// unmapped, by [`unmap`](Self::unmap) or on drop.
    pub fn abandon(&self) {
        self.abandoned.store(true, Ordering::Release);
    }

    fn raw_unmap(&self, iova: u64, len: u64) -> Result<(), TransportError> {
        if self.abandoned.load(Ordering::Acquire) {
            return Ok(());
        }
        self.unmap_calls.fetch_add(1, Ordering::Relaxed);
        self.backend
            .unmap(iova, len)
            .map_err(|err| TransportError::Io {
                operation: "VFIO_IOMMU_UNMAP_DMA",
                source: std::io::Error::other(format!("[{iova:#x}, +{len:#x}): {err}")),
            })
    }

    /// The mappings, in address order: (IOVA, length, userspace address).
    pub fn mappings(&self) -> Vec<(u64, u64, u64)> {
        self.maps
            .lock()
            .iter()
            .map(|(&iova, &(len, uaddr))| (iova, len, uaddr))
            .collect()
    }
}

impl Drop for VfioDma {
    fn drop(&mut self) {
        self.unmap_all();
    }
}

/// The mappings intersecting `[start, end)`, in address order.
fn overlapping(
    maps: &BTreeMap<u64, (u64, u64)>,
    start: u64,
    end: u64,
) -> impl Iterator<Item = (&u64, &(u64, u64))> {
    let first = maps
        .range(..start)
        .next_back()
        .filter(|(&s, &(l, _))| s + l > start)
        .map(|(&s, _)| s)
        .unwrap_or(start);
    maps.range(first..end)
}

fn check_range(iova: u64, len: u64, uaddr: u64) -> Result<(), TransportError> {
    let page = crate::page_size() as u64;
    if len == 0
        || iova.checked_add(len).is_none()
        || uaddr.checked_add(len).is_none()
        || !iova.is_multiple_of(page)
        || !len.is_multiple_of(page)
        || !uaddr.is_multiple_of(page)
    {
        return Err(TransportError::InvalidArgument(format!(
            "DMA range of {len:#x} bytes at {iova:#x} from {uaddr:#x} (page-aligned, non-empty)"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake IOMMU with VFIO type1v2 rules: no overlapping maps, unmaps of
    /// whole mappings only.
    #[derive(Default)]
    struct Fake {
        maps: Mutex<BTreeMap<u64, (u64, u64)>>,
    }

    impl DmaBackend for Fake {
        unsafe fn map(&self, iova: u64, len: u64, uaddr: u64) -> Result<(), String> {
            let mut maps = self.maps.lock();
            if overlapping(&maps, iova, iova + len).next().is_some() {
                return Err("EEXIST".into());
            }
            maps.insert(iova, (len, uaddr));
            Ok(())
        }

        fn unmap(&self, iova: u64, len: u64) -> Result<(), String> {
            let mut maps = self.maps.lock();
            match maps.get(&iova) {
                Some(&(l, _)) if l == len => {
                    maps.remove(&iova);
                    Ok(())
                }
                _ => Err("EINVAL: not a whole mapping".into()),
            }
        }
    }

    fn fake() -> (VfioDma, Arc<Fake>) {
        let backend = Arc::new(Fake::default());
        let dma = VfioDma {
            container: None,
            backend: Arc::clone(&backend) as Arc<dyn DmaBackend>,
            maps: Mutex::new(BTreeMap::new()),
            map_calls: AtomicU64::new(0),
            unmap_calls: AtomicU64::new(0),
            abandoned: AtomicBool::new(false),
        };
        (dma, backend)
    }

    const P: u64 = 4096;

    fn kernel(backend: &Fake) -> Vec<(u64, u64, u64)> {
        backend
            .maps
            .lock()
            .iter()
            .map(|(&i, &(l, u))| (i, l, u))
            .collect()
    }

    #[test]
    fn maps_only_the_gaps_and_mirrors_the_kernel() {
        let (dma, backend) = fake();
        dma.map(4 * P, 2 * P, 0x40 * P).unwrap();
        // Overlaps [4P, 6P) on both sides: only [2P, 4P) and [6P, 8P) are new.
        dma.map(2 * P, 6 * P, 0x3e * P).unwrap();
        assert_eq!(
            dma.mappings(),
            vec![
                (2 * P, 2 * P, 0x3e * P),
                (4 * P, 2 * P, 0x40 * P),
                (6 * P, 2 * P, 0x42 * P)
            ]
        );
        assert_eq!(dma.mappings(), kernel(&backend));
        // Mapping what is mapped changes nothing.
        dma.map(4 * P, P, 0x40 * P).unwrap();
        assert_eq!(dma.entries(), 3);
        assert_eq!(dma.mapped_bytes(), 6 * P);
    }

    #[test]
    fn unmap_splits_mappings_that_straddle_its_ends() {
        let (dma, backend) = fake();
        dma.map(0, 8 * P, 0x100 * P).unwrap();
        dma.unmap(3 * P, 2 * P).unwrap();
        assert_eq!(
            dma.mappings(),
            vec![(0, 3 * P, 0x100 * P), (5 * P, 3 * P, 0x105 * P)]
        );
        assert_eq!(dma.mappings(), kernel(&backend));
        // An unmap over a hole and part of a mapping.
        dma.unmap(2 * P, 4 * P).unwrap();
        assert_eq!(
            dma.mappings(),
            vec![(0, 2 * P, 0x100 * P), (6 * P, 2 * P, 0x106 * P)]
        );
        // Unmapping nothing succeeds; everything goes with unmap_all.
        dma.unmap(100 * P, P).unwrap();
        dma.unmap_all();
        assert!(kernel(&backend).is_empty());
        assert_eq!(dma.entries(), 0);
    }

    #[test]
    fn refuses_unaligned_or_empty_ranges() {
        let (dma, _) = fake();
        assert!(dma.map(1, P, 1).is_err());
        assert!(dma.map(0, 0, 0).is_err());
        assert!(dma.map(0, P + 1, 0).is_err());
        assert!(dma.map(u64::MAX - P + 1, 2 * P, 0).is_err());
        assert!(dma.unmap(0, 0).is_err());
    }

    #[test]
    fn a_failed_map_leaves_nothing_behind() {
        let (dma, backend) = fake();
        // The kernel already has [4P, 5P) (made behind the table's back),
        // so the second gap fails and the first is undone.
        // SAFETY: the fake touches no memory.
        unsafe { backend.map(4 * P, P, 0) }.unwrap();
        dma.map(3 * P, P, 0).unwrap();
        assert!(dma.map(0, 8 * P, 0).is_err());
        assert_eq!(dma.mappings(), vec![(3 * P, P, 0)]);
        assert_eq!(kernel(&backend), vec![(3 * P, P, 0), (4 * P, P, 0)]);
    }

    #[test]
    fn pinner_overlapping_pins_unmap_exactly_the_freed_pages() {
        use pindown_pincache::{PageRange, Pinner};

        let (dma, backend) = fake();
        let pinner = super::super::VfioPinner::new(Arc::new(dma));
        let a = PageRange {
            start: 0,
            len: 8 * P as usize,
        };
        let b = PageRange {
            start: 4 * P as usize,
            len: 8 * P as usize,
        };
        let token_a = pinner.pin(a).unwrap();
        let token_b = pinner.pin(b).unwrap();
        assert_eq!(kernel(&backend), vec![(0, 8 * P, 0), (8 * P, 4 * P, 8 * P)]);
        // Releasing A frees [0, 4P) only: the first mapping is split.
        pinner.unpin(a, token_a);
        assert_eq!(
            kernel(&backend),
            vec![(4 * P, 4 * P, 4 * P), (8 * P, 4 * P, 8 * P)]
        );
        assert_eq!(pinner.mapped_len(), 8 * P as usize);
        pinner.unpin(b, token_b);
        assert!(kernel(&backend).is_empty());
        assert_eq!(pinner.dma().entries(), 0);
    }
}
