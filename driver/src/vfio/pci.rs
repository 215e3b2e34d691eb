//! PCI plumbing of the VFIO transport: config space through the VFIO
//! device file, the virtio vendor capabilities, and mapped BARs.

use std::io;
use std::os::fd::{AsRawFd, RawFd};

use vfio_bindings::bindings::vfio::VFIO_REGION_INFO_FLAG_MMAP;
use vfio_ioctls::VfioDevice;

use crate::transport::TransportError;

/// VFIO region index of PCI config space (`VFIO_PCI_CONFIG_REGION_INDEX`).
pub(crate) const CONFIG_REGION: u32 = 7;

/// PCI command register and its bits.
pub(crate) const PCI_COMMAND: u64 = 0x04;
/// Memory space enable.
pub(crate) const PCI_COMMAND_MEMORY: u16 = 1 << 1;
/// Bus master enable: the function may issue DMA.
pub(crate) const PCI_COMMAND_MASTER: u16 = 1 << 2;
/// Legacy interrupt (INTx) disable.
pub(crate) const PCI_COMMAND_INTX_DISABLE: u16 = 1 << 10;
const PCI_STATUS: u64 = 0x06;
const PCI_STATUS_CAP_LIST: u16 = 1 << 4;
const PCI_CAPABILITY_LIST: u64 = 0x34;
const PCI_CAP_ID_VNDR: u8 = 0x09;

/// `cfg_type` of a virtio PCI capability.
pub(crate) const VIRTIO_PCI_CAP_COMMON_CFG: u8 = 1;
/// Notifications.
pub(crate) const VIRTIO_PCI_CAP_NOTIFY_CFG: u8 = 2;
/// Interrupt status.
pub(crate) const VIRTIO_PCI_CAP_ISR_CFG: u8 = 3;
/// Device-specific configuration.
pub(crate) const VIRTIO_PCI_CAP_DEVICE_CFG: u8 = 4;

/// Where a virtio structure lives: BAR, offset, length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VirtioCap {
    /// BAR index.
    pub bar: u8,
    /// Offset in the BAR.
    pub offset: u32,
    /// Length in bytes.
    pub length: u32,
}

/// The modern virtio capabilities of a function.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VirtioCaps {
    /// Common configuration.
    pub common: VirtioCap,
    /// Notification area.
    pub notify: VirtioCap,
    /// Bytes between the doorbells of consecutive `queue_notify_off` values.
    pub notify_multiplier: u32,
    /// Interrupt status register.
    pub isr: VirtioCap,
    /// Device-specific configuration (virtio-net's MAC, max queue pairs).
    pub device: Option<VirtioCap>,
}

/// Reads `buf.len()` bytes of config space at `offset`.
pub(crate) fn config_read(device: &VfioDevice, offset: u64, buf: &mut [u8]) -> io::Result<()> {
    let base = device.get_region_offset(CONFIG_REGION);
    pread_exact(device.as_raw_fd(), buf, base + offset)
}

/// Writes `buf` to config space at `offset`.
pub(crate) fn config_write(device: &VfioDevice, offset: u64, buf: &[u8]) -> io::Result<()> {
    let base = device.get_region_offset(CONFIG_REGION);
    // SAFETY: writes from a slice we own to a descriptor we hold open.
    let n = unsafe {
        libc::pwrite(
            device.as_raw_fd(),
            buf.as_ptr().cast(),
            buf.len(),
            (base + offset) as libc::off_t,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    if n as usize != buf.len() {
        return Err(io::Error::new(
            io::ErrorKind::WriteZero,
            "short config space write",
        ));
    }
    Ok(())
}

fn pread_exact(fd: RawFd, buf: &mut [u8], offset: u64) -> io::Result<()> {
    // SAFETY: reads into a slice we own from a descriptor the caller holds.
    let n = unsafe {
        libc::pread(
            fd,
            buf.as_mut_ptr().cast(),
            buf.len(),
            offset as libc::off_t,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    if n as usize != buf.len() {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "short config space read",
        ));
    }
    Ok(())
}

pub(crate) fn config_u8(device: &VfioDevice, offset: u64) -> io::Result<u8> {
    let mut b = [0u8; 1];
    config_read(device, offset, &mut b)?;
    Ok(b[0])
}

pub(crate) fn config_u16(device: &VfioDevice, offset: u64) -> io::Result<u16> {
    let mut b = [0u8; 2];
    config_read(device, offset, &mut b)?;
    Ok(u16::from_le_bytes(b))
}

pub(crate) fn config_u32(device: &VfioDevice, offset: u64) -> io::Result<u32> {
    let mut b = [0u8; 4];
    config_read(device, offset, &mut b)?;
    Ok(u32::from_le_bytes(b))
}

fn io_err(operation: &'static str) -> impl FnOnce(io::Error) -> TransportError {
    move |source| TransportError::Io { operation, source }
}

/// Sets bits in (and clears bits of) the PCI command register.
pub(crate) fn update_command(
    device: &VfioDevice,
    set: u16,
    clear: u16,
) -> Result<u16, TransportError> {
    let command = config_u16(device, PCI_COMMAND).map_err(io_err("PCI command read"))?;
    let new = (command | set) & !clear;
    config_write(device, PCI_COMMAND, &new.to_le_bytes()).map_err(io_err("PCI command write"))?;
    Ok(new)
}

/// Walks the capability list and collects the virtio structures.
pub(crate) fn find_virtio_caps(device: &VfioDevice) -> Result<VirtioCaps, TransportError> {
    let missing = |what: &str| TransportError::Protocol {
        request: "PCI capability walk",
        reason: format!("no virtio {what} capability (not a modern virtio function?)"),
    };
    let status = config_u16(device, PCI_STATUS).map_err(io_err("PCI status read"))?;
    if status & PCI_STATUS_CAP_LIST == 0 {
        return Err(missing("PCI"));
    }
    let mut common = None;
    let mut notify = None;
    let mut isr = None;
    let mut dev = None;
    let mut pointer =
        config_u8(device, PCI_CAPABILITY_LIST).map_err(io_err("PCI config read"))? & !3;
    // At most 48 capabilities fit in the 192 bytes after the header.
    for _ in 0..48 {
        if pointer == 0 {
            break;
        }
        let at = u64::from(pointer);
        let mut cap = [0u8; 20];
        config_read(device, at, &mut cap[..16]).map_err(io_err("PCI config read"))?;
        if cap[0] == PCI_CAP_ID_VNDR && cap[2] >= 16 {
            let found = VirtioCap {
                bar: cap[4],
                offset: u32::from_le_bytes(cap[8..12].try_into().expect("4 bytes")),
                length: u32::from_le_bytes(cap[12..16].try_into().expect("4 bytes")),
            };
            match cap[3] {
                VIRTIO_PCI_CAP_COMMON_CFG if common.is_none() => common = Some(found),
                VIRTIO_PCI_CAP_NOTIFY_CFG if notify.is_none() && cap[2] >= 20 => {
                    let multiplier =
                        config_u32(device, at + 16).map_err(io_err("PCI config read"))?;
                    notify = Some((found, multiplier));
                }
                VIRTIO_PCI_CAP_ISR_CFG if isr.is_none() => isr = Some(found),
                VIRTIO_PCI_CAP_DEVICE_CFG if dev.is_none() => dev = Some(found),
                _ => {}
            }
        }
        pointer = cap[1] & !3;
    }
    let (notify, notify_multiplier) = notify.ok_or_else(|| missing("notify"))?;
    Ok(VirtioCaps {
        common: common.ok_or_else(|| missing("common config"))?,
        notify,
        notify_multiplier,
        isr: isr.ok_or_else(|| missing("ISR"))?,
        device: dev,
    })
}

/// A BAR mapped into this process (`mmap` of the VFIO device file).
#[derive(Debug)]
pub(crate) struct MappedBar {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is device memory accessed only through volatile reads
// and writes of naturally aligned integers; it may be used from any thread.
unsafe impl Send for MappedBar {}
// SAFETY: as above; concurrent volatile accesses are what device registers
// expect (callers serialise the multi-register sequences).
unsafe impl Sync for MappedBar {}

impl MappedBar {
    /// Maps BAR `index` of `device`.
    pub(crate) fn map(device: &VfioDevice, index: u8) -> Result<Self, TransportError> {
        let region = u32::from(index);
        let len = device.get_region_size(region) as usize;
        let flags = device.get_region_flags(region);
        if len == 0 || flags & VFIO_REGION_INFO_FLAG_MMAP == 0 {
            return Err(TransportError::Protocol {
                request: "BAR mmap",
                reason: format!("BAR{index} is empty or not mappable (flags {flags:#x})"),
            });
        }
        let offset = device.get_region_offset(region);
        // SAFETY: a fresh shared mapping of the device file at the region's
        // offset; the kernel checks length and offset against the BAR.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                device.as_raw_fd(),
                offset as libc::off_t,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(TransportError::Io {
                operation: "mmap of a BAR",
                source: io::Error::last_os_error(),
            });
        }
        Ok(MappedBar {
            ptr: ptr.cast(),
            len,
        })
    }

    fn at<T>(&self, offset: usize) -> *mut T {
        assert!(
            offset.is_multiple_of(std::mem::size_of::<T>())
                && offset + std::mem::size_of::<T>() <= self.len,
            "BAR access at {offset:#x} out of bounds or misaligned"
        );
        // SAFETY: in bounds of the mapping (checked above).
        unsafe { self.ptr.add(offset).cast() }
    }

    pub(crate) fn read8(&self, offset: usize) -> u8 {
        // SAFETY: aligned, in bounds, device memory mapped for our lifetime.
        unsafe { std::ptr::read_volatile(self.at::<u8>(offset)) }
    }

    pub(crate) fn read16(&self, offset: usize) -> u16 {
        // SAFETY: aligned, in bounds, device memory mapped for our lifetime.
        u16::from_le(unsafe { std::ptr::read_volatile(self.at::<u16>(offset)) })
    }

    pub(crate) fn read32(&self, offset: usize) -> u32 {
        // SAFETY: aligned, in bounds, device memory mapped for our lifetime.
        u32::from_le(unsafe { std::ptr::read_volatile(self.at::<u32>(offset)) })
    }

    pub(crate) fn write8(&self, offset: usize, value: u8) {
        // SAFETY: aligned, in bounds, device memory mapped for our lifetime.
        unsafe { std::ptr::write_volatile(self.at::<u8>(offset), value) }
    }

    pub(crate) fn write16(&self, offset: usize, value: u16) {
        // SAFETY: aligned, in bounds, device memory mapped for our lifetime.
        unsafe { std::ptr::write_volatile(self.at::<u16>(offset), value.to_le()) }
    }

    pub(crate) fn write32(&self, offset: usize, value: u32) {
        // SAFETY: aligned, in bounds, device memory mapped for our lifetime.
        unsafe { std::ptr::write_volatile(self.at::<u32>(offset), value.to_le()) }
    }

    /// A 64-bit register written as two 32-bit halves, low first (as the
    /// virtio spec allows for the queue address fields).
    pub(crate) fn write64(&self, offset: usize, value: u64) {
        self.write32(offset, value as u32);
        self.write32(offset + 4, (value >> 32) as u32);
    }
}

impl Drop for MappedBar {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `map`, used by no one
        // after this point.
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
        }
    }
}
