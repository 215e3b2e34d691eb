//! A minimal vhost-user frontend for the tests: memfd-backed memory shared
//! with the device, and the driver side of split virtqueues.

#![allow(dead_code)]

pub mod guest;

use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use vhost::vhost_user::message::{VhostUserHeaderFlag, VhostUserProtocolFeatures};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vm_memory::{
    Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion,
    GuestRegionMmap, MmapRegion,
};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

pub use pindown_emu_device::testing::DeviceProcess;

pub mod rank;

pub mod any_memory;

pub mod arrivals;

/// virtio-net header length with VERSION_1.
pub const HDR: usize = 12;
/// Ring size used by the test driver.
pub const QSIZE: u16 = 16;
/// Guest physical base of the test memory.
pub const MEM_GPA: u64 = 0x1_0000_0000;
/// Size of the test memory.
pub const MEM_SIZE: usize = 1 << 20;

use pindown_uapi::features::{ACCESS_PLATFORM, PROTOCOL_FEATURES, VERSION_1};

// Not every test binary uses both.
#[allow(unused_imports)]
pub use pindown_emu_device::testing::{fabric_args, free_udp_port};

/// A device process that is node `node` of a loopback fabric (see
/// [`fabric_args`]) with `ports` ports and the options `extra`.
pub fn fabric_device(
    node: u16,
    udp_ports: &[u16],
    token: &str,
    ports: usize,
    extra: &[&str],
) -> DeviceProcess {
    let mut args = fabric_args(node, udp_ports, token);
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    DeviceProcess::start(device_bin(), ports, &args).unwrap()
}

/// The driver contexts of the fabric tests: an arena of 48 MiB.
pub fn fabric_context_config() -> pindown_driver::verbs::ContextConfig {
    pindown_driver::verbs::ContextConfig {
        arena_bytes: 48 << 20,
        ..Default::default()
    }
}

/// `len` bytes that differ with `salt` and from page to page.
pub fn salted_bytes(len: usize, salt: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ salt ^ (i >> 9) as u8)
        .collect()
}

/// Every byte of `buffer`.
pub fn buffer_contents(buffer: &pindown_driver::arena::DmaBuffer) -> Vec<u8> {
    let mut out = vec![0u8; buffer.len()];
    buffer.read_at(0, &mut out);
    out
}

pub fn device_bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_pindown-emu-device"))
}

/// Driver side of one split ring in the test memory.
pub struct DriverRing {
    pub index: usize,
    pub desc: u64,
    pub avail: u64,
    pub used: u64,
    /// Buffers: one page per descriptor.
    pub bufs: u64,
    pub avail_idx: u16,
    pub used_seen: u16,
    pub kick: EventFd,
    pub call: EventFd,
}

/// A frontend with queue pair 0 set up.
pub struct TestFrontend {
    pub fe: Frontend,
    pub mem: GuestMemoryMmap,
    pub rings: Vec<DriverRing>,
    host_base: u64,
    /// With ACCESS_PLATFORM: the device address of MEM_GPA (an IOVA).
    pub iova_base: Option<u64>,
}

/// IOVA at which IOMMU-mode frontends place their memory.
pub const IOVA_BASE: u64 = 0x4000_0000;

impl TestFrontend {
    /// Connects to `socket` and sets up rings `0..nrings` (each ring gets
    /// 16 descriptors and 16 one-page buffers).
    pub fn connect(socket: &Path, nrings: usize) -> TestFrontend {
        Self::connect_with(socket, nrings, None)
    }

    /// Like [`connect`], optionally negotiating ACCESS_PLATFORM with
    /// `backend` as the backend request channel: then every device address
    /// is an IOVA (`IOVA_BASE` + offset in the memory) and the device needs
    /// IOTLB updates.
    pub fn connect_with(
        socket: &Path,
        nrings: usize,
        backend: Option<&std::os::unix::net::UnixStream>,
    ) -> TestFrontend {
        let mut fe = Frontend::connect(socket, 8).expect("connect");
        let memfd = memfd::MemfdOptions::default()
            .create("test-mem")
            .expect("memfd");
        memfd.as_file().set_len(MEM_SIZE as u64).unwrap();
        let region =
            MmapRegion::from_file(FileOffset::new(memfd.into_file(), 0), MEM_SIZE).expect("mmap");
        let region = GuestRegionMmap::new(region, GuestAddress(MEM_GPA)).unwrap();
        let mem = GuestMemoryMmap::from_regions(vec![region]).unwrap();
        let r = mem.find_region(GuestAddress(MEM_GPA)).unwrap();
        let info = VhostUserMemoryRegionInfo::from_guest_region(r).unwrap();
        let host_base = info.userspace_addr;
        assert_eq!(r.len(), MEM_SIZE as u64);

        fe.set_owner().unwrap();
        let features = fe.get_features().unwrap();
        assert_ne!(features & VERSION_1, 0, "device offers VERSION_1");
        assert_ne!(features & PROTOCOL_FEATURES, 0);
        let iommu = if backend.is_some() {
            ACCESS_PLATFORM
        } else {
            0
        };
        assert_ne!(features & ACCESS_PLATFORM, 0);
        fe.set_features(VERSION_1 | PROTOCOL_FEATURES | iommu)
            .unwrap();
        let pf = fe.get_protocol_features().unwrap();
        assert!(pf.contains(VhostUserProtocolFeatures::REPLY_ACK));
        assert!(pf.contains(VhostUserProtocolFeatures::MQ));
        assert!(!pf.contains(VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS));
        let mut want = VhostUserProtocolFeatures::MQ | VhostUserProtocolFeatures::REPLY_ACK;
        if backend.is_some() {
            assert!(pf.contains(VhostUserProtocolFeatures::BACKEND_REQ));
            want |= VhostUserProtocolFeatures::BACKEND_REQ;
        }
        fe.set_protocol_features(want).unwrap();
        // Every request below is acknowledged, so failures surface here.
        fe.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
        // GET_QUEUE_NUM counts queue pairs (as QEMU reads it), but the vhost
        // crate's Frontend takes the answer as its ring limit: only ask when
        // no ring beyond the first pair is needed.
        if nrings <= 2 {
            assert_eq!(fe.get_queue_num().unwrap(), 2);
        }
        fe.set_mem_table(&[info]).unwrap();
        if let Some(b) = backend {
            fe.set_backend_request_fd(b).unwrap();
        }

        let mut me = TestFrontend {
            fe,
            mem,
            rings: Vec::new(),
            host_base,
            iova_base: backend.map(|_| IOVA_BASE),
        };
        for i in 0..nrings {
            me.setup_ring(i);
        }
        me
    }

    /// Frontend virtual address of a test guest physical address.
    pub fn host(&self, gpa: u64) -> u64 {
        self.host_base + (gpa - MEM_GPA)
    }

    /// Device address of a buffer: IOVA with ACCESS_PLATFORM, else the
    /// guest physical address.
    pub fn dev_addr(&self, gpa: u64) -> u64 {
        match self.iova_base {
            Some(b) => b + (gpa - MEM_GPA),
            None => gpa,
        }
    }

    /// Device address of a ring: IOVA with ACCESS_PLATFORM, else the
    /// frontend virtual address (vhost-user convention).
    pub fn ring_addr(&self, gpa: u64) -> u64 {
        match self.iova_base {
            Some(b) => b + (gpa - MEM_GPA),
            None => self.host(gpa),
        }
    }

    fn setup_ring(&mut self, index: usize) {
        // 64 KiB per ring: desc at +0, avail at +0x1000, used at +0x2000,
        // buffers from +0x4000 (16 pages).
        let base = MEM_GPA + 0x10000 * (index as u64 + 1);
        let ring = DriverRing {
            index,
            desc: base,
            avail: base + 0x1000,
            used: base + 0x2000,
            bufs: base + 0x4000,
            avail_idx: 0,
            used_seen: 0,
            kick: EventFd::new(EFD_NONBLOCK).unwrap(),
            call: EventFd::new(EFD_NONBLOCK).unwrap(),
        };
        self.fe.set_vring_num(index, QSIZE).unwrap();
        let cfg = VringConfigData {
            queue_max_size: QSIZE,
            queue_size: QSIZE,
            flags: 0,
            desc_table_addr: self.ring_addr(ring.desc),
            used_ring_addr: self.ring_addr(ring.used),
            avail_ring_addr: self.ring_addr(ring.avail),
            log_addr: None,
        };
        self.fe.set_vring_addr(index, &cfg).unwrap();
        self.fe.set_vring_base(index, 0).unwrap();
        self.fe.set_vring_call(index, &ring.call).unwrap();
        self.fe.set_vring_kick(index, &ring.kick).unwrap();
        self.fe.set_vring_enable(index, true).unwrap();
        self.rings.push(ring);
    }

    /// Makes descriptor `id` of ring `ring` available: `len` bytes at the
    /// descriptor's page, device-writable or not.
    pub fn post(&mut self, ring: usize, id: u16, len: u32, writable: bool) {
        let addr = self.dev_addr(self.buf(ring, id));
        let r = &mut self.rings[ring];
        let d = r.desc + 16 * id as u64;
        self.mem.write_obj(addr.to_le(), GuestAddress(d)).unwrap();
        self.mem
            .write_obj(len.to_le(), GuestAddress(d + 8))
            .unwrap();
        let flags: u16 = if writable { 2 } else { 0 };
        self.mem
            .write_obj(flags.to_le(), GuestAddress(d + 12))
            .unwrap();
        self.mem.write_obj(0u16, GuestAddress(d + 14)).unwrap();
        let slot = r.avail + 4 + 2 * (r.avail_idx % QSIZE) as u64;
        self.mem.write_obj(id.to_le(), GuestAddress(slot)).unwrap();
        r.avail_idx = r.avail_idx.wrapping_add(1);
        self.mem
            .store(
                r.avail_idx.to_le(),
                GuestAddress(r.avail + 2),
                Ordering::Release,
            )
            .unwrap();
        r.kick.write(1).unwrap();
    }

    /// Guest physical address of buffer `id` of ring `ring`.
    pub fn buf(&self, ring: usize, id: u16) -> u64 {
        self.rings[ring].bufs + 0x1000 * id as u64
    }

    /// Sends `data` (virtio-net header included) on ring `ring` with
    /// descriptor `id`.
    pub fn send(&mut self, ring: usize, id: u16, data: &[u8]) {
        let addr = self.buf(ring, id);
        self.mem.write_slice(data, GuestAddress(addr)).unwrap();
        self.post(ring, id, data.len() as u32, false);
    }

    /// Posts receive buffer `id` (one page) on ring `ring`.
    pub fn post_rx(&mut self, ring: usize, id: u16) {
        let addr = self.buf(ring, id);
        self.mem
            .write_slice(&[0xeeu8; 0x1000], GuestAddress(addr))
            .unwrap();
        self.post(ring, id, 0x1000, true);
    }

    /// The used index the device published.
    pub fn used_idx(&self, ring: usize) -> u16 {
        let r = &self.rings[ring];
        u16::from_le(
            self.mem
                .load(GuestAddress(r.used + 2), Ordering::Acquire)
                .unwrap(),
        )
    }

    /// Waits for the next used element of ring `ring`: (id, len).
    pub fn wait_used(&mut self, ring: usize, timeout: Duration) -> Option<(u16, u32)> {
        let deadline = Instant::now() + timeout;
        loop {
            let idx = self.used_idx(ring);
            let r = &mut self.rings[ring];
            if idx != r.used_seen {
                let e = r.used + 4 + 8 * (r.used_seen % QSIZE) as u64;
                r.used_seen = r.used_seen.wrapping_add(1);
                let id: u32 = self.mem.read_obj(GuestAddress(e)).unwrap();
                let len: u32 = self.mem.read_obj(GuestAddress(e + 4)).unwrap();
                return Some((u32::from_le(id) as u16, u32::from_le(len)));
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Reads `len` bytes of buffer `id` of ring `ring`.
    pub fn read_buf(&self, ring: usize, id: u16, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        self.mem
            .read_slice(&mut v, GuestAddress(self.buf(ring, id)))
            .unwrap();
        v
    }
}

/// An Ethernet frame with a virtio-net header in front.
pub fn frame(dst: [u8; 6], src: [u8; 6], payload: &[u8]) -> Vec<u8> {
    let mut f = vec![0u8; HDR];
    f.extend_from_slice(&dst);
    f.extend_from_slice(&src);
    f.extend_from_slice(&[0x88, 0xb5]); // local experimental ethertype
    f.extend_from_slice(payload);
    f
}

/// The virtio-net header the device puts in front of received frames.
pub fn rx_hdr() -> Vec<u8> {
    let mut h = vec![0u8; HDR];
    h[10] = 1;
    h
}

/// CPU time (user + system, clock ticks) process `pid` has used so far.
pub fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("process stat");
    // Fields after the command name (which may hold spaces) start with the
    // state (field 3); utime and stime are fields 14 and 15.
    let rest = &stat[stat.rfind(')').expect("command name") + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}
