//! ACCESS_PLATFORM: ring and buffer addresses are IOVAs, translated only
//! through IOTLB UPDATEs. Misses go out as IOTLB MISS on the backend
//! channel (never waited for) and processing resumes after the UPDATE;
//! forbidden accesses leave memory untouched.

mod common;

use std::collections::HashSet;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use common::*;
use pindown_uapi::features::ACCESS_PLATFORM;
use pindown_uapi::{IotlbMessage, VhostAccess, VhostIotlbType};

const A: [u8; 6] = [0x02, 0, 0, 0, 2, 0];
const B: [u8; 6] = [0x02, 0, 0, 0, 2, 1];
const T: Duration = Duration::from_secs(5);

/// The test's IOMMU: answers MISS messages with UPDATEs, except for pages
/// it was told to keep read-only.
struct Iommu {
    main: UnixStream,
    backend: UnixStream,
    host_base: u64,
    read_only: HashSet<u64>,
    misses: Vec<(u64, VhostAccess)>,
}

fn header(request: u32, flags: u32, size: u32) -> Vec<u8> {
    let mut h = request.to_le_bytes().to_vec();
    h.extend_from_slice(&flags.to_le_bytes());
    h.extend_from_slice(&size.to_le_bytes());
    h
}

impl Iommu {
    fn new(fe: &TestFrontend, backend: UnixStream) -> Iommu {
        // SAFETY: dup(2) of the frontend's socket; the copy is owned below.
        let fd = unsafe { libc::dup(fe.fe.as_raw_fd()) };
        assert!(fd >= 0);
        // SAFETY: `fd` is a fresh descriptor nobody else owns.
        let main = unsafe { <UnixStream as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        main.set_read_timeout(Some(T)).unwrap();
        backend
            .set_read_timeout(Some(Duration::from_millis(20)))
            .unwrap();
        Iommu {
            main,
            backend,
            host_base: fe.host(MEM_GPA),
            read_only: HashSet::new(),
            misses: Vec::new(),
        }
    }

    /// Sends an IOTLB message asking for an ack; returns the ack value.
    fn send(&mut self, payload: Vec<u8>) -> u64 {
        let mut m = header(22, 0x9, payload.len() as u32);
        m.extend_from_slice(&payload);
        self.main.write_all(&m).unwrap();
        let mut h = [0u8; 12];
        self.main.read_exact(&mut h).unwrap();
        assert_eq!(u32::from_le_bytes(h[0..4].try_into().unwrap()), 22);
        assert_eq!(u32::from_le_bytes(h[4..8].try_into().unwrap()) & 0x4, 0x4);
        let mut v = [0u8; 8];
        self.main.read_exact(&mut v).unwrap();
        u64::from_le_bytes(v)
    }

    fn update(&mut self, iova: u64, size: u64, access: VhostAccess) -> u64 {
        let uaddr = self.host_base + (iova - IOVA_BASE);
        self.send(
            IotlbMessage::update(iova, size, uaddr, access)
                .encode()
                .to_vec(),
        )
    }

    fn invalidate(&mut self, iova: u64, size: u64) -> u64 {
        self.send(IotlbMessage::invalidate(iova, size).encode().to_vec())
    }

    /// Serves MISS messages until `done` or the timeout.
    fn serve_until(&mut self, timeout: Duration, mut done: impl FnMut() -> bool) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if done() {
                return true;
            }
            let mut h = [0u8; 12];
            match self.backend.read_exact(&mut h) {
                Ok(()) => {}
                Err(_) => continue,
            }
            let req = u32::from_le_bytes(h[0..4].try_into().unwrap());
            let flags = u32::from_le_bytes(h[4..8].try_into().unwrap());
            let size = u32::from_le_bytes(h[8..12].try_into().unwrap());
            assert_eq!(req, 1, "backend request is IOTLB_MSG");
            assert_eq!(flags & 0x8, 0, "a MISS never waits for a reply");
            let mut p = vec![0u8; size as usize];
            self.backend.read_exact(&mut p).unwrap();
            let miss = IotlbMessage::decode(&p).unwrap();
            assert_eq!(miss.iotlb_type(), Some(VhostIotlbType::Miss));
            self.misses.push((miss.iova, miss.access().unwrap()));
            let page = miss.iova & !0xfff;
            if !self.read_only.contains(&page) {
                assert_eq!(self.update(page, 0x1000, VhostAccess::ReadWrite), 0);
            }
        }
        done()
    }
}

#[test]
fn iova_rings_and_buffers_resolve_through_misses_and_updates() {
    let dev = DeviceProcess::start(device_bin(), 2, &[]).unwrap();
    let mut p1 = TestFrontend::connect(&dev.socket(1), 2);
    let (ours, theirs) = UnixStream::pair().unwrap();
    let mut p0 = TestFrontend::connect_with(&dev.socket(0), 2, Some(&theirs));
    drop(theirs);
    let mut mmu = Iommu::new(&p0, ours);
    assert!(dev.wait_for(T, |s| s[0].n("features") & ACCESS_PLATFORM != 0));

    // Nothing is mapped: the device must ask for every page it touches.
    p1.post_rx(0, 3);
    let f = frame(B, A, &(0..=255u8).collect::<Vec<_>>());
    p0.send(1, 5, &f);
    let delivered = mmu.serve_until(T, || p1.used_idx(0) == 1);
    assert!(delivered, "misses seen: {:x?}\n{}", mmu.misses, dev.log());
    let (id, len) = p1.wait_used(0, T).unwrap();
    assert_eq!((id, len as usize), (3, f.len()));
    assert_eq!(&p1.read_buf(0, 3, f.len())[HDR..], &f[HDR..]);
    let buf_iova = p0.dev_addr(p0.buf(1, 5));
    assert!(
        mmu.misses.iter().any(|(i, _)| *i & !0xfff == buf_iova),
        "the tx buffer page was asked for: {:x?}",
        mmu.misses
    );
    assert!(mmu.serve_until(T, || p0.used_idx(1) == 1));
    assert_eq!(p0.wait_used(1, T), Some((5, 0)));

    // Receive into a page mapped read-only: the frame is dropped and the
    // buffer stays as it was. The rx ring itself is mapped beforehand, so
    // the permission is the only obstacle.
    for a in [p0.rings[0].desc, p0.rings[0].avail, p0.rings[0].used] {
        let iova = p0.dev_addr(a);
        assert_eq!(mmu.update(iova, 0x1000, VhostAccess::ReadWrite), 0);
    }
    mmu.misses.clear();
    let rx_page = p0.dev_addr(p0.buf(0, 2));
    mmu.read_only.insert(rx_page);
    assert_eq!(mmu.update(rx_page, 0x1000, VhostAccess::ReadOnly), 0);
    p0.post_rx(0, 2);
    let dropped_before = dev.port(0).n("rx_dropped");
    let g = frame(A, B, b"to a read-only page");
    p1.send(1, 0, &g);
    assert!(mmu.serve_until(T, || dev.port(0).n("rx_dropped") > dropped_before));
    // Collect the MISS the denied write caused (it is not answered).
    mmu.serve_until(Duration::from_millis(100), || false);
    assert_eq!(
        p0.read_buf(0, 2, 0x1000),
        vec![0xee; 0x1000],
        "memory untouched"
    );
    assert_eq!(p0.used_idx(0), 0);
    assert!(
        mmu.misses.iter().all(|(i, _)| *i & !0xfff == rx_page),
        "only the read-only page faulted: {:x?}",
        mmu.misses
    );
    assert!(
        mmu.misses
            .iter()
            .any(|(_, access)| matches!(access, VhostAccess::WriteOnly | VhostAccess::ReadWrite)),
        "the device asked for write access: {:x?}",
        mmu.misses
    );

    // Make it writable: the next frame lands there.
    mmu.read_only.clear();
    assert_eq!(mmu.update(rx_page, 0x1000, VhostAccess::ReadWrite), 0);
    p1.send(1, 1, &g);
    assert!(mmu.serve_until(T, || p0.used_idx(0) == 1), "{}", dev.log());
    let (id, len) = p0.wait_used(0, T).unwrap();
    assert_eq!((id, len as usize), (2, g.len()));
    assert_eq!(&p0.read_buf(0, 2, g.len())[HDR..], &g[HDR..]);

    // Invalidate the tx buffer page: sending from it misses again.
    assert_eq!(mmu.invalidate(buf_iova, 0x1000), 0);
    mmu.misses.clear();
    p1.post_rx(0, 4);
    p0.send(1, 5, &f);
    assert!(mmu.serve_until(T, || p1.used_idx(0) == 2));
    assert!(mmu.misses.iter().any(|(i, _)| *i & !0xfff == buf_iova));
    let (id, _) = p1.wait_used(0, T).unwrap();
    assert_eq!(&p1.read_buf(0, id, f.len())[HDR..], &f[HDR..]);

    // Updates that the memory table does not back are refused.
    let rw = VhostAccess::ReadWrite;
    let outside = IotlbMessage::update(0x9000_0000, 0x1000, 0x10, rw);
    assert_ne!(mmu.send(outside.encode().to_vec()), 0);
    let empty = IotlbMessage::update(0x9000_0000, 0, mmu.host_base, rw);
    assert_ne!(mmu.send(empty.encode().to_vec()), 0);
    let s = dev.port(0);
    assert!(s.n("iotlb_misses_sent") >= 4, "{s:?}");
    assert!(s.n("iotlb_updates") >= 4);
    assert_eq!(s.n("connected"), 1);
}
