//! The VFIO virtio-pci transport: the driver inside a QEMU guest.
//!
//! Inside a guest the device is a virtio-net PCI function (QEMU's
//! `virtio-net-pci` on a vhost-user netdev served by the emu-device). The
//! guest binds it to `vfio-pci`; [`VfioTransport`] opens its IOMMU group and
//! device with `vfio-ioctls`, enables memory decoding and bus mastering,
//! walks the PCI capability list for the modern virtio structures (common
//! configuration, notification area with its multiplier, ISR, device
//! configuration), maps the BAR holding them, resets the device and
//! negotiates features. The layers above see the same [`Transport`] as on the
//! host.
//!
//! # Queues
//!
//! QEMU forwards to the backend only the rings of the queue pairs its netdev
//! has (`queues=N`); its control queue (ring `2N`) is QEMU's own. The RDMA
//! queue pairs reach the guest as the **last** `R` pairs QEMU forwards: the
//! device offers `P` net pairs plus its RDMA pairs to a QEMU frontend, QEMU
//! is started with `queues=P+R`, so the guest sees `max_virtqueue_pairs =
//! P + R` in the device configuration and RDMA pair `q` is rings `2P + 2q`
//! and `2P + 2q + 1`, exactly the indices the host driver uses
//! ([`ring_layout`](Transport::ring_layout)). The guest cannot tell `P` from
//! `R`: [`VfioConfig::net_queue_pairs`] says `P` (by default `N -`
//! [`GUEST_RDMA_QUEUE_PAIRS`]). QEMU enables only the first pair at
//! `DRIVER_OK`; the transport therefore also drives the control queue and
//! asks for `P + R` pairs (`VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET`), which QEMU
//! relays to the backend as `SET_VRING_ENABLE` of the RDMA rings.
//!
//! Virtio-pci enables queues before `DRIVER_OK` only, so every RDMA ring is
//! set up first ([`rings_fixed_at_start`](Transport::rings_fixed_at_start));
//! `DRIVER_OK` is set when all of them are enabled (QEMU starts the
//! vhost-user rings then, from the addresses programmed before), or
//! explicitly by [`VfioTransport::driver_ok`].
//!
//! # Completions
//!
//! QEMU 7.2 under TCG crashes in its MSI-X path with a vhost-user device, so
//! the function has no MSI-X vectors (`vectors=0`) and no interrupt is used.
//! When the device signals a queue, QEMU latches bit 0 of the ISR register. A
//! polling thread reads (and so clears) the ISR, sleeping between reads with
//! an adaptive back-off ([`VfioConfig::poll_min`] after activity, doubling up
//! to [`VfioConfig::poll_max`] when idle), and signals the completion eventfd
//! of every enabled queue when it is set. It also signals them once per
//! `poll_max` without it (a tick), and in practice the tick is what wakes
//! waiters: with QEMU 7.2, `vectors=0` and a vhost-user netdev, QEMU hands
//! the backend no call eventfd for the rings it starts (`SET_VRING_CALL`
//! with the no-fd flag; seen here as hundreds of due notifications the
//! device could not deliver), so only QEMU's own queues (the control queue)
//! raise the ISR. A waiter whose completion arrives after its spin
//! therefore sleeps about `poll_max` (1 ms by default) at most. Waiters
//! treat a wake-up as a hint and look at the used ring.
//!
//! # Memory
//!
//! [`register_memory`](Transport::register_memory) has nothing to tell the
//! device (it reaches guest memory through the IOMMU only) and accepts any
//! table. IOTLB entries are VFIO DMA mappings ([`VfioDma`]) with identity
//! IOVAs; `IotlbAccess` is not expressible through VFIO type1 for user memory
//! and every mapping is read/write. [`VfioPinner`] is the matching pin-down
//! cache pinner.

mod dma;
mod pci;
mod pinner;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use vfio_ioctls::{VfioContainer, VfioDevice, VfioOps};
use virtio_bindings::{virtio_config, virtio_net};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::arena::{DmaArena, DmaBuffer, MemoryTableRegion};
use crate::transport::{
    CompletionEvent, IotlbAccess, QueueIndex, Transport, TransportError, F_ACCESS_PLATFORM,
    F_NET_MQ, F_VERSION_1,
};
use crate::virtqueue::{ChainElement, QueueLayout, SplitQueue};

pub use dma::VfioDma;
pub use pci::{VirtioCap, VirtioCaps};
pub use pinner::VfioPinner;

use pci::MappedBar;

pub use pindown_uapi::features::NET_CTRL_VQ as F_NET_CTRL_VQ;

// Device status bits (virtio's, one byte in the common configuration).
const STATUS_ACKNOWLEDGE: u8 = virtio_config::VIRTIO_CONFIG_S_ACKNOWLEDGE as u8;
const STATUS_DRIVER: u8 = virtio_config::VIRTIO_CONFIG_S_DRIVER as u8;
const STATUS_DRIVER_OK: u8 = virtio_config::VIRTIO_CONFIG_S_DRIVER_OK as u8;
const STATUS_FEATURES_OK: u8 = virtio_config::VIRTIO_CONFIG_S_FEATURES_OK as u8;
const STATUS_FAILED: u8 = virtio_config::VIRTIO_CONFIG_S_FAILED as u8;

// Common configuration layout (virtio 1.x, `struct virtio_pci_common_cfg`).
const DEVICE_FEATURE_SELECT: usize = 0x00;
const DEVICE_FEATURE: usize = 0x04;
const DRIVER_FEATURE_SELECT: usize = 0x08;
const DRIVER_FEATURE: usize = 0x0c;
const MSIX_CONFIG: usize = 0x10;
const NUM_QUEUES: usize = 0x12;
const DEVICE_STATUS: usize = 0x14;
const QUEUE_SELECT: usize = 0x16;
const QUEUE_SIZE: usize = 0x18;
const QUEUE_MSIX_VECTOR: usize = 0x1a;
const QUEUE_ENABLE: usize = 0x1c;
const QUEUE_NOTIFY_OFF: usize = 0x1e;
const QUEUE_DESC: usize = 0x20;
const QUEUE_DRIVER: usize = 0x28;
const QUEUE_DEVICE: usize = 0x30;
const NO_VECTOR: u16 = 0xffff;

// virtio-net device configuration: `max_virtqueue_pairs`.
const NET_CFG_MAX_PAIRS: usize =
    std::mem::offset_of!(virtio_net::virtio_net_config, max_virtqueue_pairs);

// virtio-net control commands (one byte each on the control queue).
const VIRTIO_NET_CTRL_MQ: u8 = virtio_net::VIRTIO_NET_CTRL_MQ as u8;
const VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET: u8 = virtio_net::VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET as u8;
const VIRTIO_NET_OK: u8 = virtio_net::VIRTIO_NET_OK as u8;

/// RDMA queue pairs a guest expects after the net pairs unless
/// [`VfioConfig::net_queue_pairs`] says otherwise: the admin pair and one
/// I/O pair (QEMU's `queues=P+2`).
pub const GUEST_RDMA_QUEUE_PAIRS: u16 = 2;

/// How to open a [`VfioTransport`].
#[derive(Debug, Clone)]
pub struct VfioConfig {
    /// The PCI function's sysfs directory, e.g.
    /// `/sys/bus/pci/devices/0000:01:00.0` (bound to `vfio-pci`).
    pub device: PathBuf,
    /// Shortest sleep of the completion polling thread (after activity).
    pub poll_min: Duration,
    /// Longest sleep of the completion polling thread (when idle).
    pub poll_max: Duration,
    /// Net queue pairs in front of the RDMA queue pairs (`P`); the pairs
    /// after them are RDMA pairs. `None`: the device configuration's
    /// `max_virtqueue_pairs` less [`GUEST_RDMA_QUEUE_PAIRS`] (see the module
    /// documentation).
    pub net_queue_pairs: Option<u16>,
    /// How long to wait for the device (reset, control commands).
    pub timeout: Duration,
    /// Features never accepted, whatever the layers above ask for (e.g.
    /// `F_EVENT_IDX` to have every completion signalled).
    pub refused_features: u64,
}

impl VfioConfig {
    /// Defaults for the function at `device` (a sysfs directory).
    pub fn new(device: impl Into<PathBuf>) -> Self {
        VfioConfig {
            device: device.into(),
            poll_min: Duration::from_micros(20),
            poll_max: Duration::from_millis(1),
            net_queue_pairs: None,
            timeout: Duration::from_secs(10),
            refused_features: 0,
        }
    }
}

/// A queue programmed into the device.
struct QueueState {
    /// Offset of its doorbell in the notify BAR.
    notify_offset: usize,
    call: Arc<EventFd>,
    enabled: bool,
}

/// What the polling thread shares with the transport.
struct Shared {
    isr_bar: Arc<MappedBar>,
    isr_offset: usize,
    /// Eventfds of enabled queues.
    calls: RwLock<Vec<Arc<EventFd>>>,
    stop: AtomicBool,
    isr_reads: AtomicU64,
    isr_hits: AtomicU64,
    ticks: AtomicU64,
}

/// The control queue (QEMU's own), used to enable the RDMA pair.
struct ControlQueue {
    index: QueueIndex,
    queue: SplitQueue<u8>,
    buffer: DmaBuffer,
    _arena: Arc<DmaArena>,
}

/// A virtio-net PCI function driven through VFIO; see the module
/// documentation.
pub struct VfioTransport {
    // Field order is drop order: the device is reset before the mappings
    // and the BARs go.
    dma: Arc<VfioDma>,
    device: VfioDevice,
    bars: Vec<(u8, Arc<MappedBar>)>,
    caps: VirtioCaps,
    device_features: u64,
    acked: AtomicU64,
    max_pairs: u16,
    queue_pairs: u16,
    rdma_queue_pairs: u16,
    device_queues: u16,
    /// Serialises `queue_select` and the registers behind it.
    control: Mutex<Option<ControlQueue>>,
    queues: RwLock<Vec<Option<QueueState>>>,
    driver_ok: AtomicBool,
    shared: Arc<Shared>,
    poller: Mutex<Option<JoinHandle<()>>>,
    timeout: Duration,
    poll: (Duration, Duration),
    refused: u64,
    sysfs: PathBuf,
    /// Set by [`Transport::abandon`]: the device and its mappings are
    /// another process's.
    abandoned: AtomicBool,
}

impl std::fmt::Debug for VfioTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VfioTransport")
            .field("device", &self.sysfs)
            .field("caps", &self.caps)
            .field(
                "device_features",
                &format_args!("{:#x}", self.device_features),
            )
            .field("queue_pairs", &self.queue_pairs)
            .finish()
    }
}

fn vfio_err(operation: &'static str) -> impl FnOnce(vfio_ioctls::VfioError) -> TransportError {
    move |err| TransportError::Io {
        operation,
        source: std::io::Error::other(err.to_string()),
    }
}

impl VfioTransport {
    /// Opens the function at `config.device`: VFIO container, group and
    /// device; bus mastering; the virtio capabilities and their BAR; device
    /// reset, `ACKNOWLEDGE | DRIVER`, and the device's features.
    pub fn open(config: VfioConfig) -> Result<Self, TransportError> {
        let container =
            Arc::new(VfioContainer::new(None).map_err(vfio_err("opening the VFIO container"))?);
        let device = VfioDevice::new(
            &config.device,
            Arc::clone(&container) as Arc<dyn VfioOps>,
            false,
        )
        .map_err(vfio_err("opening the VFIO device"))?;
        let dma = Arc::new(VfioDma::new(container));
        pci::update_command(
            &device,
            pci::PCI_COMMAND_MEMORY | pci::PCI_COMMAND_MASTER | pci::PCI_COMMAND_INTX_DISABLE,
            0,
        )?;
        let caps = pci::find_virtio_caps(&device)?;
        let mut bars: Vec<(u8, Arc<MappedBar>)> = Vec::new();
        let mut wanted = vec![caps.common.bar, caps.notify.bar, caps.isr.bar];
        wanted.extend(caps.device.map(|d| d.bar));
        for bar in wanted {
            if !bars.iter().any(|(b, _)| *b == bar) {
                bars.push((bar, Arc::new(MappedBar::map(&device, bar)?)));
            }
        }
        let bar_of = |index: u8| {
            Arc::clone(
                &bars
                    .iter()
                    .find(|(b, _)| *b == index)
                    .expect("mapped above")
                    .1,
            )
        };
        let shared = Arc::new(Shared {
            isr_bar: bar_of(caps.isr.bar),
            isr_offset: caps.isr.offset as usize,
            calls: RwLock::new(Vec::new()),
            stop: AtomicBool::new(false),
            isr_reads: AtomicU64::new(0),
            isr_hits: AtomicU64::new(0),
            ticks: AtomicU64::new(0),
        });
        let common_bar = bar_of(caps.common.bar);
        let common = caps.common.offset as usize;
        let status = |value: u8| common_bar.write8(common + DEVICE_STATUS, value);
        // Reset: write 0, wait until the device reads back 0.
        status(0);
        let deadline = Instant::now() + config.timeout;
        while common_bar.read8(common + DEVICE_STATUS) != 0 {
            if Instant::now() >= deadline {
                return Err(TransportError::Timeout {
                    request: "device reset",
                    timeout: config.timeout,
                });
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        status(STATUS_ACKNOWLEDGE);
        status(STATUS_ACKNOWLEDGE | STATUS_DRIVER);
        common_bar.write16(common + MSIX_CONFIG, NO_VECTOR);
        let mut device_features = 0u64;
        for select in 0..2u32 {
            common_bar.write32(common + DEVICE_FEATURE_SELECT, select);
            device_features |=
                u64::from(common_bar.read32(common + DEVICE_FEATURE)) << (32 * select);
        }
        let device_queues = common_bar.read16(common + NUM_QUEUES);
        let mut max_pairs = 1;
        if device_features & F_NET_MQ != 0 {
            if let Some(cfg) = caps.device {
                max_pairs = bar_of(cfg.bar)
                    .read16(cfg.offset as usize + NET_CFG_MAX_PAIRS)
                    .max(1);
            }
        }
        let queue_pairs = config
            .net_queue_pairs
            .unwrap_or(max_pairs.saturating_sub(GUEST_RDMA_QUEUE_PAIRS));
        let rdma_queue_pairs = max_pairs.saturating_sub(queue_pairs);
        if queue_pairs == 0 || rdma_queue_pairs < 2 {
            return Err(TransportError::Protocol {
                request: "device configuration",
                reason: format!(
                    "the function has {max_pairs} queue pairs; {queue_pairs} net pairs and at \
                     least 2 RDMA pairs (admin and one I/O pair) are needed (QEMU's netdev \
                     needs queues={} and the device must offer them)",
                    queue_pairs.max(1) + 2
                ),
            });
        }
        let transport = VfioTransport {
            dma,
            device,
            bars,
            caps,
            device_features,
            acked: AtomicU64::new(0),
            max_pairs,
            queue_pairs,
            rdma_queue_pairs,
            device_queues,
            control: Mutex::new(None),
            queues: RwLock::new(Vec::new()),
            driver_ok: AtomicBool::new(false),
            shared,
            poller: Mutex::new(None),
            timeout: config.timeout,
            poll: (config.poll_min, config.poll_max.max(config.poll_min)),
            refused: config.refused_features & !(F_VERSION_1 | F_ACCESS_PLATFORM),
            sysfs: config.device.clone(),
            abandoned: AtomicBool::new(false),
        };
        let rings = transport.ring_layout().ring_count();
        *transport.queues.write() = (0..rings).map(|_| None).collect();
        Ok(transport)
    }

    /// The sysfs directory of the function.
    pub fn sysfs_path(&self) -> &Path {
        &self.sysfs
    }

    /// The virtio capabilities found in config space.
    pub fn capabilities(&self) -> VirtioCaps {
        self.caps
    }

    /// `max_virtqueue_pairs` of the device configuration (1 without `MQ`).
    pub fn max_queue_pairs(&self) -> u16 {
        self.max_pairs
    }

    /// Queues the function has (`num_queues` of the common configuration,
    /// the control queue included).
    pub fn device_queue_count(&self) -> u16 {
        self.device_queues
    }

    /// The DMA mappings (IOTLB entries) of the transport.
    pub fn dma(&self) -> &Arc<VfioDma> {
        &self.dma
    }

    /// A pin-down cache pinner mapping through this transport's container.
    pub fn pinner(&self) -> VfioPinner {
        VfioPinner::new(Arc::clone(&self.dma))
    }

    /// ISR reads by the polling thread, how many found the ISR raised, and
    /// how many times it signalled on its tick instead.
    pub fn isr_stats(&self) -> (u64, u64, u64) {
        (
            self.shared.isr_reads.load(Ordering::Relaxed),
            self.shared.isr_hits.load(Ordering::Relaxed),
            self.shared.ticks.load(Ordering::Relaxed),
        )
    }

    /// Whether `DRIVER_OK` is set.
    pub fn is_driver_ok(&self) -> bool {
        self.driver_ok.load(Ordering::Acquire)
    }

    fn bar(&self, index: u8) -> &MappedBar {
        &self
            .bars
            .iter()
            .find(|(b, _)| *b == index)
            .expect("every capability's BAR is mapped")
            .1
    }

    fn common(&self) -> (&MappedBar, usize) {
        (
            self.bar(self.caps.common.bar),
            self.caps.common.offset as usize,
        )
    }

    fn status(&self) -> u8 {
        let (bar, base) = self.common();
        bar.read8(base + DEVICE_STATUS)
    }

    fn set_status(&self, status: u8) {
        let (bar, base) = self.common();
        bar.write8(base + DEVICE_STATUS, status);
    }

    /// Writes 0 to the status and waits until the device reads back 0.
    fn reset(&self) -> Result<(), TransportError> {
        self.reset_within(self.timeout)
    }

    /// [`reset`](Self::reset), waiting at most `timeout`.
    fn reset_within(&self, timeout: Duration) -> Result<(), TransportError> {
        self.set_status(0);
        let deadline = Instant::now().checked_add(timeout);
        while self.status() != 0 {
            if deadline.is_some_and(|at| Instant::now() >= at) {
                return Err(TransportError::Timeout {
                    request: "device reset",
                    timeout,
                });
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        Ok(())
    }

    /// Programs ring `index` (under the control lock: `queue_select`).
    fn program_queue(
        &self,
        index: QueueIndex,
        layout: &QueueLayout,
    ) -> Result<usize, TransportError> {
        let (bar, base) = self.common();
        bar.write16(base + QUEUE_SELECT, index);
        let max = bar.read16(base + QUEUE_SIZE);
        if max == 0 {
            return Err(TransportError::NoSuchQueue {
                index,
                count: self.device_queues,
            });
        }
        if layout.size > max {
            return Err(TransportError::InvalidArgument(format!(
                "queue {index}: size {} exceeds the device's {max}",
                layout.size
            )));
        }
        if bar.read16(base + QUEUE_ENABLE) != 0 {
            return Err(TransportError::InvalidArgument(format!(
                "queue {index} is enabled already; reset the device to program it again"
            )));
        }
        bar.write16(base + QUEUE_SIZE, layout.size);
        bar.write16(base + QUEUE_MSIX_VECTOR, NO_VECTOR);
        bar.write64(base + QUEUE_DESC, layout.desc_addr);
        bar.write64(base + QUEUE_DRIVER, layout.avail_addr);
        bar.write64(base + QUEUE_DEVICE, layout.used_addr);
        let notify_off = usize::from(bar.read16(base + QUEUE_NOTIFY_OFF));
        let offset =
            self.caps.notify.offset as usize + notify_off * self.caps.notify_multiplier as usize;
        if offset + 2 > self.caps.notify.offset as usize + self.caps.notify.length as usize {
            return Err(TransportError::Protocol {
                request: "queue_notify_off",
                reason: format!("queue {index}: doorbell at {offset:#x} outside the notify area"),
            });
        }
        Ok(offset)
    }

    fn enable_in_device(&self, index: QueueIndex) {
        let (bar, base) = self.common();
        bar.write16(base + QUEUE_SELECT, index);
        bar.write16(base + QUEUE_ENABLE, 1);
    }

    /// Sets the control queue up (before `DRIVER_OK`), if negotiated.
    fn setup_control_queue(&self) -> Result<(), TransportError> {
        if self.features() & F_NET_CTRL_VQ == 0 {
            return Ok(());
        }
        let arena = DmaArena::new(64 << 10).map_err(|err| TransportError::Io {
            operation: "control queue memory",
            source: std::io::Error::other(err.to_string()),
        })?;
        let event_idx = self.features() & crate::transport::F_EVENT_IDX != 0;
        let arena_err = |err: crate::virtqueue::QueueError| TransportError::Io {
            operation: "control queue",
            source: std::io::Error::other(err.to_string()),
        };
        let queue = SplitQueue::new(&arena, 8, event_idx).map_err(arena_err)?;
        let buffer = arena
            .alloc_pages(crate::page_size())
            .map_err(|err| TransportError::Io {
                operation: "control queue buffer",
                source: std::io::Error::other(err.to_string()),
            })?;
        let layout = queue.layout();
        self.dma
            .map(layout.ring_start, layout.ring_len, layout.ring_start)?;
        self.dma
            .map(buffer.iova(), buffer.len() as u64, buffer.iova())?;
        // virtio-net: the control queue follows the receive and transmit
        // queues of every pair the device has.
        let index = 2 * self.max_pairs;
        let mut control = self.control.lock();
        self.program_queue(index, &layout)?;
        self.enable_in_device(index);
        *control = Some(ControlQueue {
            index,
            queue,
            buffer,
            _arena: arena,
        });
        Ok(())
    }

    /// Sets `DRIVER_OK` (QEMU starts the vhost-user rings from the addresses
    /// programmed so far), enables the RDMA pair through the control queue
    /// and starts the completion polling thread. Idempotent.
    pub fn driver_ok(&self) -> Result<(), TransportError> {
        if self.driver_ok.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        self.set_status(STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FEATURES_OK | STATUS_DRIVER_OK);
        if self.status() & STATUS_FAILED != 0 {
            return Err(TransportError::Rejected {
                request: "DRIVER_OK",
                status: u64::from(self.status()),
            });
        }
        if self.max_pairs > 1 {
            self.set_queue_pairs(self.queue_pairs + self.rdma_queue_pairs)?;
        }
        self.start_poller()
    }

    /// `VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET` through the control queue; waits
    /// for QEMU's answer.
    fn set_queue_pairs(&self, pairs: u16) -> Result<(), TransportError> {
        let mut guard = self.control.lock();
        let Some(ctrl) = guard.as_mut() else {
            return Err(TransportError::MissingFeatures {
                kind: "virtio",
                missing: F_NET_CTRL_VQ,
            });
        };
        let base = ctrl.buffer.iova();
        ctrl.buffer
            .write_at(0, &[VIRTIO_NET_CTRL_MQ, VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET]);
        ctrl.buffer.write_at(16, &pairs.to_le_bytes());
        ctrl.buffer.write_at(32, &[0xff]);
        let queue_err = |err: crate::virtqueue::QueueError| TransportError::Protocol {
            request: "control queue",
            reason: err.to_string(),
        };
        ctrl.queue
            .add(
                &[
                    ChainElement::readable(base, 2),
                    ChainElement::readable(base + 16, 2),
                    ChainElement::writable(base + 32, 1),
                ],
                0,
            )
            .map_err(queue_err)?;
        let index = ctrl.index;
        let offset = {
            let (bar, common) = self.common();
            bar.write16(common + QUEUE_SELECT, index);
            self.caps.notify.offset as usize
                + usize::from(bar.read16(common + QUEUE_NOTIFY_OFF))
                    * self.caps.notify_multiplier as usize
        };
        if ctrl.queue.kick_needed() {
            self.bar(self.caps.notify.bar).write16(offset, index);
        }
        let deadline = Instant::now() + self.timeout;
        loop {
            if ctrl.queue.pop_used().map_err(queue_err)?.is_some() {
                break;
            }
            if Instant::now() >= deadline {
                return Err(TransportError::Timeout {
                    request: "VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET",
                    timeout: self.timeout,
                });
            }
            std::thread::sleep(Duration::from_micros(50));
        }
        let mut ack = [0u8; 1];
        ctrl.buffer.read_at(32, &mut ack);
        if ack[0] != VIRTIO_NET_OK {
            return Err(TransportError::Rejected {
                request: "VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET",
                status: u64::from(ack[0]),
            });
        }
        Ok(())
    }

    fn start_poller(&self) -> Result<(), TransportError> {
        let shared = Arc::clone(&self.shared);
        let (min, max) = self.poll;
        let handle = std::thread::Builder::new()
            .name("pindown-vfio-poll".into())
            .spawn(move || poll_isr(&shared, min, max))
            .map_err(|source| TransportError::Io {
                operation: "spawning the completion polling thread",
                source,
            })?;
        *self.poller.lock() = Some(handle);
        Ok(())
    }

    fn check_queue(&self, index: QueueIndex) -> Result<(), TransportError> {
        let count = self.ring_layout().ring_count();
        if index >= count {
            return Err(TransportError::NoSuchQueue { index, count });
        }
        Ok(())
    }
}

/// The polling thread: reads the ISR (which clears it) and signals every
/// enabled queue's eventfd when the device raised it; signals them anyway
/// once per `max` of quiet (the tick that bounds a sleeping waiter's delay
/// when a notification does not reach the ISR).
fn poll_isr(shared: &Shared, min: Duration, max: Duration) {
    let mut sleep = min;
    let mut last_signal = Instant::now();
    while !shared.stop.load(Ordering::Acquire) {
        let isr = shared.isr_bar.read8(shared.isr_offset);
        shared.isr_reads.fetch_add(1, Ordering::Relaxed);
        let raised = isr & 1 != 0;
        if raised {
            shared.isr_hits.fetch_add(1, Ordering::Relaxed);
            sleep = min;
        } else {
            sleep = (sleep * 2).min(max);
        }
        if raised || last_signal.elapsed() >= max {
            if !raised {
                shared.ticks.fetch_add(1, Ordering::Relaxed);
            }
            for call in shared.calls.read().iter() {
                let _ = call.write(1);
            }
            last_signal = Instant::now();
        }
        std::thread::sleep(sleep);
    }
}

impl Drop for VfioTransport {
    fn drop(&mut self) {
        if self.abandoned.load(Ordering::Acquire) {
            // A child of fork(): the poller thread is not in this process
            // (its handle is forgotten, never joined) and the device is
            // the parent's; the mappings are left alone too.
            std::mem::forget(self.poller.lock().take());
            return;
        }
        self.shared.stop.store(true, Ordering::Release);
        if let Some(handle) = self.poller.lock().take() {
            let _ = handle.join();
        }
        // The device stops using the rings before their mappings go.
        let _ = self.reset();
        pci::update_command(&self.device, 0, pci::PCI_COMMAND_MASTER).ok();
    }
}

impl Transport for VfioTransport {
    fn device_features(&self) -> u64 {
        self.device_features
    }

    fn negotiate_features(&self, wanted: u64) -> Result<u64, TransportError> {
        if self.features() != 0 {
            return Err(TransportError::InvalidArgument(
                "features were negotiated already".into(),
            ));
        }
        let required = F_VERSION_1 | F_ACCESS_PLATFORM;
        let missing = required & !self.device_features;
        if missing != 0 {
            return Err(TransportError::MissingFeatures {
                kind: "virtio",
                missing,
            });
        }
        let mut accepted = (wanted | required) & self.device_features & !self.refused;
        if accepted & F_NET_MQ != 0 {
            // MQ needs the control queue, which enables the RDMA pair.
            if self.device_features & F_NET_CTRL_VQ == 0 {
                accepted &= !F_NET_MQ;
            } else {
                accepted |= F_NET_CTRL_VQ;
            }
        }
        let (bar, base) = self.common();
        for select in 0..2u32 {
            bar.write32(base + DRIVER_FEATURE_SELECT, select);
            bar.write32(base + DRIVER_FEATURE, (accepted >> (32 * select)) as u32);
        }
        self.set_status(STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FEATURES_OK);
        if self.status() & STATUS_FEATURES_OK == 0 {
            self.set_status(STATUS_FAILED);
            return Err(TransportError::Rejected {
                request: "FEATURES_OK",
                status: u64::from(self.status()),
            });
        }
        self.acked.store(accepted, Ordering::Release);
        self.setup_control_queue()?;
        Ok(accepted)
    }

    fn features(&self) -> u64 {
        self.acked.load(Ordering::Acquire)
    }

    /// The net pairs of [`VfioConfig::net_queue_pairs`], then every pair
    /// QEMU forwards beyond them.
    fn ring_layout(&self) -> pindown_uapi::RingLayout {
        pindown_uapi::RingLayout {
            queue_pairs: self.queue_pairs,
            rdma_queue_pairs: self.rdma_queue_pairs,
        }
    }

    fn rings_fixed_at_start(&self) -> bool {
        true
    }

    fn register_memory(&self, regions: &[MemoryTableRegion<'_>]) -> Result<(), TransportError> {
        if regions.is_empty() {
            return Err(TransportError::InvalidArgument("no memory regions".into()));
        }
        Ok(())
    }

    fn setup_queue(&self, index: QueueIndex, layout: &QueueLayout) -> Result<(), TransportError> {
        self.check_queue(index)?;
        if self.is_driver_ok() {
            return Err(TransportError::InvalidArgument(format!(
                "queue {index}: rings must be set up before DRIVER_OK"
            )));
        }
        if self.queues.read()[usize::from(index)].is_some() {
            return Err(TransportError::InvalidArgument(format!(
                "queue {index} is set up already"
            )));
        }
        self.dma
            .map(layout.ring_start, layout.ring_len, layout.ring_start)?;
        let call = Arc::new(
            EventFd::new(EFD_NONBLOCK).map_err(|source| TransportError::Io {
                operation: "eventfd for completions",
                source,
            })?,
        );
        let notify_offset = {
            let _control = self.control.lock();
            self.program_queue(index, layout)
        };
        let notify_offset = match notify_offset {
            Ok(offset) => offset,
            Err(err) => {
                let _ = self.dma.unmap(layout.ring_start, layout.ring_len);
                return Err(err);
            }
        };
        self.queues.write()[usize::from(index)] = Some(QueueState {
            notify_offset,
            call,
            enabled: false,
        });
        Ok(())
    }

    fn enable_queue(&self, index: QueueIndex, enabled: bool) -> Result<(), TransportError> {
        self.check_queue(index)?;
        let all_rdma_enabled = {
            let mut queues = self.queues.write();
            let state = queues[usize::from(index)]
                .as_mut()
                .ok_or(TransportError::QueueNotSetUp(index))?;
            if !enabled {
                return Err(TransportError::InvalidArgument(format!(
                    "queue {index}: virtio-pci cannot disable a single queue (reset the device)"
                )));
            }
            if state.enabled {
                return Ok(());
            }
            {
                let _control = self.control.lock();
                self.enable_in_device(index);
            }
            state.enabled = true;
            self.shared.calls.write().push(Arc::clone(&state.call));
            let layout = self.ring_layout();
            (layout.send_queue(0)..layout.ring_count())
                .all(|q| queues[usize::from(q)].as_ref().is_some_and(|s| s.enabled))
        };
        if all_rdma_enabled {
            self.driver_ok()?;
        }
        Ok(())
    }

    fn notify(&self, index: QueueIndex) -> Result<(), TransportError> {
        self.check_queue(index)?;
        let queues = self.queues.read();
        let state = queues[usize::from(index)]
            .as_ref()
            .ok_or(TransportError::QueueNotSetUp(index))?;
        self.bar(self.caps.notify.bar)
            .write16(state.notify_offset, index);
        Ok(())
    }

    fn completion_event(&self, index: QueueIndex) -> Result<CompletionEvent, TransportError> {
        self.check_queue(index)?;
        let queues = self.queues.read();
        let state = queues[usize::from(index)]
            .as_ref()
            .ok_or(TransportError::QueueNotSetUp(index))?;
        Ok(CompletionEvent::new(Arc::clone(&state.call)))
    }

    fn iotlb_enabled(&self) -> bool {
        true
    }

    fn maps_process_memory(&self) -> bool {
        true
    }

    fn mapping_budget(&self) -> Option<usize> {
        VfioDma::entry_limit().map(|limit| limit.saturating_sub(self.dma.entries()))
    }

    fn iotlb_map(
        &self,
        iova: u64,
        len: u64,
        uaddr: u64,
        _access: IotlbAccess,
    ) -> Result<(), TransportError> {
        let (iova, len, uaddr) = page_round(iova, len, uaddr)?;
        self.dma.map(iova, len, uaddr)
    }

    fn iotlb_unmap(&self, iova: u64, len: u64) -> Result<(), TransportError> {
        let (iova, len, _) = page_round(iova, len, iova)?;
        self.dma.unmap(iova, len)
    }

    fn disconnect(&self, timeout: Duration) -> bool {
        // The IOMMU's mappings stay until their removal: only the device's
        // own use of the rings ends here.
        self.reset_within(timeout).is_ok()
    }

    fn abandon(&self) {
        self.abandoned.store(true, Ordering::Release);
        self.dma.abandon();
    }
}

/// Widens `[iova, iova + len)` to whole pages (the unit of VFIO mappings);
/// `uaddr` must have the same offset in its page as `iova`.
fn page_round(iova: u64, len: u64, uaddr: u64) -> Result<(u64, u64, u64), TransportError> {
    let page = crate::page_size() as u64;
    let bad = || {
        TransportError::InvalidArgument(format!(
            "IOTLB range of {len} bytes at {iova:#x} (from {uaddr:#x})"
        ))
    };
    if len == 0 || iova % page != uaddr % page {
        return Err(bad());
    }
    let end = iova.checked_add(len).ok_or_else(bad)?;
    let start = iova - iova % page;
    let end = end.checked_next_multiple_of(page).ok_or_else(bad)?;
    Ok((start, end - start, uaddr - iova % page))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_widen_to_whole_pages() {
        let page = crate::page_size() as u64;
        assert_eq!(
            page_round(page + 8, 16, page + 8).unwrap(),
            (page, page, page)
        );
        assert_eq!(page_round(page - 1, 2, page - 1).unwrap(), (0, 2 * page, 0));
        assert!(page_round(0, 0, 0).is_err());
        assert!(page_round(8, 8, 16).is_err());
        assert!(page_round(u64::MAX - 1, 8, u64::MAX - 1).is_err());
    }
}
