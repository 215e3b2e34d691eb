//! A hostile frontend over a raw vhost-user socket, against a real device
//! process. After every case the device is alive, well-behaved frontends on
//! other ports move bytes (every byte checked), the hostile port serves a
//! well-behaved frontend again once reconnected (frames and RDMA), and the
//! device's CPU is idle.

mod common;

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::*;
use pindown_driver::verbs::opcode::{Read as RdmaRead, Write as RdmaWrite};
use pindown_driver::verbs::{CompletionQueue, Context, ContextConfig, MemoryWindow};
use pindown_driver::DmaBuffer;
use pindown_emu_device::testing::payload;
use pindown_uapi::{queue, Access, Completion, Status};
use vhost::vhost_user::message::FrontendReq;
use vm_memory::{Bytes, FileOffset, GuestAddress, GuestMemoryMmap, GuestRegionMmap, MmapRegion};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

const T: Duration = Duration::from_secs(5);
const VERSION_1: u64 = 1 << 32;
const PROTOCOL_FEATURES: u64 = 1 << 30;
const ACCESS_PLATFORM: u64 = 1 << 33;
/// MQ and REPLY_ACK.
const PROTOCOLS: u64 = 1 | (1 << 3);
const NEED_REPLY: u32 = 0x9;
/// Ring size the hostile frontend uses.
const QSZ: u16 = 16;
/// Size of the hostile frontend's memory.
const HSIZE: u64 = 1 << 20;
/// Largest ring the device accepts by default.
const QMAX: u32 = 1024;
/// Requests whose reply has its own form: malformed, they end the connection.
const REPLY_REQUIRED: [u32; 6] = [1, 11, 15, 17, 24, 36];

fn code(r: FrontendReq) -> u32 {
    r.into()
}

/// A tiny deterministic generator (xorshift64*), so failures reproduce.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// The hostile frontend's memory: a file shared with the device.
struct Shared {
    file: File,
    mem: GuestMemoryMmap,
    host: u64,
}

impl Shared {
    fn new(file: File) -> Shared {
        file.set_len(HSIZE).unwrap();
        let region = MmapRegion::from_file(
            FileOffset::new(file.try_clone().unwrap(), 0),
            HSIZE as usize,
        )
        .unwrap();
        let host = region.as_ptr() as u64;
        let mem = GuestMemoryMmap::from_regions(vec![GuestRegionMmap::new(
            region,
            GuestAddress(MEM_GPA),
        )
        .unwrap()])
        .unwrap();
        Shared { file, mem, host }
    }

    fn memfd(sealed: bool) -> Shared {
        let fd = memfd::MemfdOptions::default()
            .allow_sealing(sealed)
            .create("hostile")
            .unwrap();
        let shared = Shared::new(fd.as_file().try_clone().unwrap());
        if sealed {
            fd.add_seal(memfd::FileSeal::SealShrink).unwrap();
        }
        shared
    }

    /// Ring `i`: descriptors at +0, available ring at +0x1000, used ring
    /// at +0x2000, buffers (one page each) from +0x4000 (offsets in memory).
    fn ring_base(i: u32) -> u64 {
        0x20000 * (u64::from(i) + 1)
    }

    fn desc(&self, ring: u32, id: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let d = MEM_GPA + Shared::ring_base(ring) + 16 * u64::from(id);
        self.mem.write_obj(addr, GuestAddress(d)).unwrap();
        self.mem.write_obj(len, GuestAddress(d + 8)).unwrap();
        self.mem.write_obj(flags, GuestAddress(d + 12)).unwrap();
        self.mem.write_obj(next, GuestAddress(d + 14)).unwrap();
    }

    /// Puts head `id` in available slot `slot` and publishes index `idx`.
    fn avail(&self, ring: u32, slot: u16, id: u16, idx: u16) {
        let a = MEM_GPA + Shared::ring_base(ring) + 0x1000;
        self.mem
            .write_obj(id, GuestAddress(a + 4 + 2 * u64::from(slot % QSZ)))
            .unwrap();
        self.mem
            .store(idx, GuestAddress(a + 2), Ordering::Release)
            .unwrap();
    }

    fn used_idx(&self, ring: u32) -> u16 {
        let u = MEM_GPA + Shared::ring_base(ring) + 0x2000;
        self.mem
            .load(GuestAddress(u + 2), Ordering::Acquire)
            .unwrap()
    }

    /// Guest physical address of buffer `id` of ring `ring`.
    fn buf(ring: u32, id: u16) -> u64 {
        MEM_GPA + Shared::ring_base(ring) + 0x4000 + 0x1000 * u64::from(id)
    }

    // An RDMA queue (pindown_uapi::queue) set up by `Raw::ring`: slots at
    // +0, the driver's record at +0x1000, the device's at +0x2000.

    /// Writes `bytes` into send queue `ring`'s slot of `position` with
    /// that position's stamp, the stamp last.
    fn post_slot(&self, ring: u32, position: u16, bytes: &[u8; queue::REQUEST_SLOT]) {
        let slot = MEM_GPA
            + Shared::ring_base(ring)
            + (queue::REQUEST_SLOT * usize::from(position % QSZ)) as u64;
        self.mem
            .write_slice(&bytes[..queue::REQUEST_STAMP], GuestAddress(slot))
            .unwrap();
        self.mem
            .store(
                queue::stamp(position),
                GuestAddress(slot + queue::REQUEST_STAMP as u64),
                Ordering::Release,
            )
            .unwrap();
    }

    /// The completion at `position` of completion queue `ring`, once the
    /// device has written it.
    fn completion(&self, ring: u32, position: u16) -> Option<[u8; queue::COMPLETION_SLOT]> {
        let slot = MEM_GPA
            + Shared::ring_base(ring)
            + (queue::COMPLETION_SLOT * usize::from(position % QSZ)) as u64;
        let stamp: u16 = self
            .mem
            .load(
                GuestAddress(slot + queue::COMPLETION_STAMP as u64),
                Ordering::Acquire,
            )
            .unwrap();
        if stamp != queue::stamp(position) {
            return None;
        }
        let mut bytes = [0u8; queue::COMPLETION_SLOT];
        self.mem.read_slice(&mut bytes, GuestAddress(slot)).unwrap();
        Some(bytes)
    }

    /// Tells the device that completions before `consumed` were read.
    fn consumed(&self, ring: u32, consumed: u16) {
        let record = MEM_GPA + Shared::ring_base(ring) + 0x1000;
        self.mem
            .store(consumed, GuestAddress(record), Ordering::Release)
            .unwrap();
    }

    /// The send queue's head: positions before it were taken.
    fn head(&self, ring: u32) -> u16 {
        let record = MEM_GPA + Shared::ring_base(ring) + 0x2000;
        self.mem
            .load(GuestAddress(record), Ordering::Acquire)
            .unwrap()
    }
}

/// The hostile frontend: raw vhost-user messages.
struct Raw {
    s: UnixStream,
    kicks: Vec<EventFd>,
    calls: Vec<EventFd>,
}

fn iotlb(iova: u64, size: u64, uaddr: u64, perm: u8, kind: u8) -> Vec<u8> {
    let mut p = iova.to_le_bytes().to_vec();
    p.extend_from_slice(&size.to_le_bytes());
    p.extend_from_slice(&uaddr.to_le_bytes());
    p.push(perm);
    p.push(kind);
    p.extend_from_slice(&[0; 6]);
    p
}

fn pipe() -> (File, File) {
    let mut fds = [0; 2];
    // SAFETY: pipe(2) writes two new descriptors into `fds`.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    use std::os::fd::FromRawFd;
    // SAFETY: both descriptors are new and owned by nobody else.
    unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) }
}

impl Raw {
    fn connect(dev: &DeviceProcess, socket: usize) -> Raw {
        let s = UnixStream::connect(dev.socket(socket)).unwrap();
        s.set_read_timeout(Some(T)).unwrap();
        Raw {
            s,
            kicks: Vec::new(),
            calls: Vec::new(),
        }
    }

    fn send(&mut self, code: u32, flags: u32, payload: &[u8], fds: &[RawFd]) -> bool {
        let mut m = code.to_le_bytes().to_vec();
        m.extend_from_slice(&flags.to_le_bytes());
        m.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        m.extend_from_slice(payload);
        self.s.send_with_fds(&[&m[..]], fds).is_ok()
    }

    /// The next reply `(request, body)`, or `None` if the device closed
    /// the connection.
    fn reply(&mut self) -> Option<(u32, Vec<u8>)> {
        let mut h = [0u8; 12];
        self.s.read_exact(&mut h).ok()?;
        let w = |i: usize| u32::from_le_bytes(h[i..i + 4].try_into().unwrap());
        assert_ne!(w(4) & 0x4, 0, "a reply");
        let mut body = vec![0u8; w(8) as usize];
        self.s.read_exact(&mut body).ok()?;
        Some((w(0), body))
    }

    /// Sends a request asking for an acknowledgement; its status, or
    /// `None` if the device closed the connection.
    fn ack(&mut self, code: u32, payload: &[u8], fds: &[RawFd]) -> Option<u64> {
        if !self.send(code, NEED_REPLY, payload, fds) {
            return None;
        }
        let (req, body) = self.reply()?;
        assert_eq!(req, code);
        Some(u64::from_le_bytes(body[..8].try_into().unwrap()))
    }

    fn ok(&mut self, code: u32, payload: &[u8], fds: &[RawFd]) {
        assert_eq!(self.ack(code, payload, fds), Some(0), "request {code}");
    }

    fn refused(&mut self, code: u32, payload: &[u8], fds: &[RawFd]) {
        let status = self.ack(code, payload, fds);
        assert!(
            matches!(status, Some(s) if s != 0),
            "request {code} answered {status:?}"
        );
    }

    /// Whether the device closed the connection.
    fn closed_by_device(&mut self) -> bool {
        let mut b = [0u8; 1];
        matches!(self.s.read(&mut b), Ok(0))
    }

    /// SET_OWNER, features, protocol features.
    fn handshake(&mut self, features: u64) {
        self.ok(code(FrontendReq::SET_OWNER), &[], &[]);
        self.ok(
            code(FrontendReq::SET_FEATURES),
            &(VERSION_1 | PROTOCOL_FEATURES | features).to_le_bytes(),
            &[],
        );
        self.ok(
            code(FrontendReq::SET_PROTOCOL_FEATURES),
            &PROTOCOLS.to_le_bytes(),
            &[],
        );
    }

    fn set_memory(&mut self, shared: &Shared) {
        let p = payload::mem_table(&[(MEM_GPA, HSIZE, shared.host, 0)]);
        self.ok(
            code(FrontendReq::SET_MEM_TABLE),
            &p,
            &[shared.file.as_raw_fd()],
        );
    }

    /// Sets up ring `i` (size 16) in `shared`, addressed by frontend
    /// addresses, or by IOVAs equal to guest physical addresses with
    /// `iova`; kicked through an eventfd and enabled.
    fn ring(&mut self, shared: &Shared, i: u32, iova: bool) {
        self.ring_from(shared, i, iova, 0);
    }

    /// Stops ring `i` (GET_VRING_BASE); returns the position it reports.
    fn stop_ring(&mut self, i: u32) -> u32 {
        assert!(self.send(
            code(FrontendReq::GET_VRING_BASE),
            0x1,
            &payload::vring_state(i, 0),
            &[]
        ));
        let (_, body) = self.reply().expect("GET_VRING_BASE answered");
        u32::from_le_bytes(body[4..8].try_into().unwrap())
    }

    /// As [`ring`](Self::ring), the ring starting at `position`.
    fn ring_from(&mut self, shared: &Shared, i: u32, iova: bool, position: u32) {
        let base = Shared::ring_base(i);
        let at = |off: u64| {
            if iova {
                MEM_GPA + base + off
            } else {
                shared.host + base + off
            }
        };
        self.ok(
            code(FrontendReq::SET_VRING_NUM),
            &payload::vring_state(i, u32::from(QSZ)),
            &[],
        );
        self.ok(
            code(FrontendReq::SET_VRING_BASE),
            &payload::vring_state(i, position),
            &[],
        );
        self.ok(
            code(FrontendReq::SET_VRING_ADDR),
            &payload::vring_addr(i, 0, at(0), at(0x2000), at(0x1000)),
            &[],
        );
        let call = EventFd::new(EFD_NONBLOCK).unwrap();
        self.ok(
            code(FrontendReq::SET_VRING_CALL),
            &u64::from(i).to_le_bytes(),
            &[call.as_raw_fd()],
        );
        self.calls.push(call);
        self.kick_fd(i);
        self.ok(
            code(FrontendReq::SET_VRING_ENABLE),
            &payload::vring_state(i, 1),
            &[],
        );
    }

    /// Gives ring `i` a new kick eventfd (which starts it).
    fn kick_fd(&mut self, i: u32) {
        let kick = EventFd::new(EFD_NONBLOCK).unwrap();
        self.ok(
            code(FrontendReq::SET_VRING_KICK),
            &u64::from(i).to_le_bytes(),
            &[kick.as_raw_fd()],
        );
        self.kicks.push(kick);
    }

    fn kick(&self) {
        if let Some(k) = self.kicks.last() {
            k.write(1).unwrap();
        }
    }
}

/// The device, well-behaved frontends on sockets 1 and 2 (frames) and 3
/// (RDMA), and socket 0 for the hostile frontend.
struct Harness {
    dev: DeviceProcess,
    f1: TestFrontend,
    f2: TestFrontend,
    /// Port 3, holding the window (kept open for the whole test).
    rdma: &'static Context,
    window: MemoryWindow<'static>,
    target: &'static DmaBuffer,
    round: u16,
    rng: Rng,
}

fn mac(port: u8) -> [u8; 6] {
    [0x52, 0x54, 0x00, 0x12, 0x34, port]
}

const RDMA_BYTES: usize = 64 * 1024;

fn rdma_config() -> ContextConfig {
    ContextConfig {
        arena_bytes: 4 << 20,
        ..ContextConfig::default()
    }
}

/// The one completion `cq` has (or gets within `T`).
fn wait_one(cq: &mut CompletionQueue<'_>) -> Completion {
    let mut ready = cq.wait(T).expect("completion");
    assert_eq!(ready.len(), 1);
    ready.next().unwrap()
}

impl Harness {
    fn start(args: &[&str]) -> Harness {
        let dev = DeviceProcess::start(device_bin(), 4, args).unwrap();
        let f1 = TestFrontend::connect(&dev.socket(1), 2);
        let f2 = TestFrontend::connect(&dev.socket(2), 2);
        // Port 3's context, its region and its window live for the whole
        // test (the device process ends with the test).
        let rdma: &'static Context = Box::leak(Box::new(
            Context::open(dev.socket(3), rdma_config()).expect("port 3"),
        ));
        let region: &'static _ = Box::leak(Box::new(
            rdma.register_owned(rdma.alloc(RDMA_BYTES, 64).unwrap())
                .unwrap(),
        ));
        let target = region.buffer().expect("an owned region");
        let window = rdma
            .bind_window(
                region,
                0,
                RDMA_BYTES as u64,
                Access::REMOTE_READ | Access::REMOTE_WRITE,
            )
            .unwrap();
        assert!(dev.wait_for(T, |s| (1..4).all(|p| s[p].n("connected") == 1)));
        Harness {
            dev,
            f1,
            f2,
            rdma,
            window,
            target,
            round: 0,
            rng: Rng(0x9e37_79b9_7f4a_7c15),
        }
    }

    fn next_id(&mut self) -> u16 {
        self.round = self.round.wrapping_add(1);
        self.round % QSIZE
    }

    /// A frame from `from` to port `to`, checked byte for byte on arrival.
    fn frame_between(&mut self, from: usize, to: usize, f0: Option<&mut TestFrontend>) {
        let id = self.next_id();
        let payload = self.rng.bytes(1000);
        let sent = frame(mac(to as u8), mac(from as u8), &payload);
        let (sender, receiver): (&mut TestFrontend, &mut TestFrontend) = match (from, to, f0) {
            (1, 2, _) => (&mut self.f1, &mut self.f2),
            (2, 1, _) => (&mut self.f2, &mut self.f1),
            (0, 1, Some(f0)) => (f0, &mut self.f1),
            (1, 0, Some(f0)) => (&mut self.f1, f0),
            (from, to, _) => panic!("no route {from}->{to}"),
        };
        receiver.post_rx(0, id);
        sender.send(1, id, &sent);
        assert_eq!(sender.wait_used(1, T), Some((id, 0)), "tx chain returned");
        // Skip frames other ports flooded meanwhile (from the hostile one).
        let deadline = Instant::now() + T;
        loop {
            let (got, len) = receiver.wait_used(0, T).expect("frame delivered");
            let bytes = receiver.read_buf(0, got, len as usize);
            if got == id && bytes[HDR..] == sent[HDR..] {
                assert_eq!(bytes[..HDR], rx_hdr()[..]);
                break;
            }
            assert!(
                Instant::now() < deadline,
                "frame {from}->{to} not delivered"
            );
            receiver.post_rx(0, got);
        }
    }

    /// An RDMA write of fresh bytes from port 0 into port 3's window, and a
    /// read back: every byte checked on both sides.
    fn rdma_from_port0(&mut self) {
        let c0 = Context::open(self.dev.socket(0), rdma_config()).expect("port 0 again");
        assert_eq!(c0.info().port, 0, "the hostile port is served again");
        let pattern = self.rng.bytes(RDMA_BYTES);
        let source = c0.alloc(RDMA_BYTES, 64).unwrap();
        source.write_at(0, &pattern);
        let src = c0.register_buffer(&source).unwrap();
        let mut cq = c0.create_completion_queue();
        let mut qp = c0.create_queue_pair(&mut cq).unwrap();
        qp.post(&[RdmaWrite::new(
            src.local(0, RDMA_BYTES as u32).unwrap(),
            self.window.remote().at(0),
        )
        .build()
        .user_data(1)
        .signaled()])
            .unwrap();
        assert_eq!(wait_one(&mut cq).status, Status::Success);
        let mut landed = vec![0u8; RDMA_BYTES];
        self.target.read_at(0, &mut landed);
        assert!(landed == pattern, "RDMA write bytes");
        let back = c0.alloc(RDMA_BYTES, 64).unwrap();
        let back_region = c0.register_buffer(&back).unwrap();
        qp.post(&[RdmaRead::new(
            back_region.local(0, RDMA_BYTES as u32).unwrap(),
            self.window.remote().at(0),
        )
        .build()
        .user_data(2)
        .signaled()])
            .unwrap();
        assert_eq!(wait_one(&mut cq).status, Status::Success);
        let mut read = vec![0u8; RDMA_BYTES];
        back.read_at(0, &mut read);
        assert!(read == pattern, "RDMA read bytes");
        drop((qp, cq, src, back_region));
        drop(c0);
        self.port0_free();
    }

    fn port0_free(&self) {
        assert!(
            self.dev.wait_for(T, |s| s[0].n("connected") == 0),
            "port 0 reset: {}",
            self.dev.log()
        );
    }

    /// The checks after each case. `hostile` is the hostile connection if
    /// the device kept it open: the CPU and the other ports are checked
    /// with it still connected, then it is closed and port 0 reconnected.
    fn after(&mut self, case: &str, hostile: Option<Raw>) {
        assert!(self.dev.alive(), "{case}: device died: {}", self.dev.log());
        self.frame_between(1, 2, None);
        self.frame_between(2, 1, None);
        let before = common::cpu_ticks(self.dev.pid());
        std::thread::sleep(Duration::from_millis(300));
        let spent = common::cpu_ticks(self.dev.pid()) - before;
        assert!(spent <= 5, "{case}: device spun {spent} ticks in 300 ms");
        drop(hostile);
        self.port0_free();
        let mut f0 = TestFrontend::connect(&self.dev.socket(0), 2);
        self.frame_between(0, 1, Some(&mut f0));
        self.frame_between(1, 0, Some(&mut f0));
        drop(f0);
        self.port0_free();
        self.rdma_from_port0();
        assert!(self.dev.alive(), "{case}: device died: {}", self.dev.log());
    }
}

#[test]
fn random_bytes_malformed_requests_and_torn_messages() {
    let mut h = Harness::start(&[]);

    // Random bytes, as whole messages or not.
    for round in 0..40 {
        let mut raw = Raw::connect(&h.dev, 0);
        let n = 1 + (h.rng.next() % 3000) as usize;
        let mut bytes = h.rng.bytes(n);
        if round % 2 == 0 {
            // A valid header in front, so the garbage reaches the decoders.
            let code = (h.rng.next() % 48) as u32;
            bytes[..12].copy_from_slice(
                &[
                    code.to_le_bytes(),
                    0x9u32.to_le_bytes(),
                    ((n - 12) as u32).to_le_bytes(),
                ]
                .concat(),
            );
        }
        let _ = raw.s.write_all(&bytes);
        drop(raw);
        h.port0_free();
    }
    h.after("random bytes", None);

    // Every request code with payloads of sizes no request has.
    let mut raw = Raw::connect(&h.dev, 0);
    for c in 0..50u32 {
        for size in [1usize, 7, 9, 13, 41, 300] {
            let payload = vec![0xa5u8; size];
            if REPLY_REQUIRED.contains(&c) {
                assert!(raw.send(c, NEED_REPLY, &payload, &[]));
                assert!(raw.closed_by_device(), "malformed {c} ends the connection");
                h.port0_free();
                raw = Raw::connect(&h.dev, 0);
            } else {
                raw.refused(c, &payload, &[]);
            }
        }
    }
    // Inconsistent: a table announcing two regions with one described,
    // fds where none belong, and none where one belongs.
    let (fd, _keep) = pipe();
    let mut two = payload::mem_table(&[(0, 0x1000, 0, 0)]);
    two[0] = 2;
    raw.refused(code(FrontendReq::SET_MEM_TABLE), &two, &[fd.as_raw_fd()]);
    raw.refused(
        code(FrontendReq::SET_FEATURES),
        &VERSION_1.to_le_bytes(),
        &[fd.as_raw_fd()],
    );
    raw.refused(
        code(FrontendReq::SET_VRING_KICK),
        &0x101u64.to_le_bytes(),
        &[fd.as_raw_fd()],
    );
    raw.refused(code(FrontendReq::SET_VRING_CALL), &0u64.to_le_bytes(), &[]);
    raw.refused(
        code(FrontendReq::SET_BACKEND_REQ_FD),
        &[],
        &[fd.as_raw_fd()],
    );
    let log = h.dev.log();
    assert!(
        log.contains("request failed") && log.contains("port=0") && log.contains("SET_MEM_TABLE"),
        "failures are logged with port and request"
    );
    h.after("malformed requests", Some(raw));

    // Disconnects in the middle of a message: in the header, in the
    // payload, and with fds in flight.
    let memfd = Shared::memfd(false);
    for cut in [5usize, 12, 20, 40] {
        let mut raw = Raw::connect(&h.dev, 0);
        raw.handshake(0);
        let p = payload::mem_table(&[(MEM_GPA, HSIZE, memfd.host, 0)]);
        let mut m = code(FrontendReq::SET_MEM_TABLE).to_le_bytes().to_vec();
        m.extend_from_slice(&NEED_REPLY.to_le_bytes());
        m.extend_from_slice(&(p.len() as u32).to_le_bytes());
        m.extend_from_slice(&p);
        raw.s
            .send_with_fds(&[&m[..cut]], &[memfd.file.as_raw_fd()])
            .unwrap();
        drop(raw);
        h.port0_free();
    }
    h.after("disconnect mid-message", None);
}

#[test]
fn bad_memory_tables_are_refused() {
    // A small bound, to see it refuse a table (the well-behaved frontends
    // map 1 MiB, the driver its 4 MiB arena).
    let mut h = Harness::start(&["--max-mapped-bytes-per-port", "16M"]);
    let mut raw = Raw::connect(&h.dev, 0);
    raw.handshake(0);
    let mem = code(FrontendReq::SET_MEM_TABLE);
    let file = |size: u64| {
        let f = tempfile::tempfile_in("/dev/shm").unwrap();
        f.set_len(size).unwrap();
        f
    };
    let (a, b) = (file(0x10000), file(0x10000));
    let (fa, fb) = (a.as_raw_fd(), b.as_raw_fd());
    // Zero regions, and more than the fd limit.
    raw.refused(mem, &payload::mem_table(&[]), &[]);
    raw.refused(
        mem,
        &payload::mem_table(&[(0, 0x1000, 0x1000, 0); 33]),
        &[fa],
    );
    // Overlaps in guest physical and in frontend addresses.
    let over_gpa = [(0, 0x10000, 0x10_0000, 0), (0x8000, 0x10000, 0x20_0000, 0)];
    raw.refused(mem, &payload::mem_table(&over_gpa), &[fa, fb]);
    let over_user = [
        (0, 0x10000, 0x10_0000, 0),
        (0x10_0000, 0x10000, 0x10_8000, 0),
    ];
    raw.refused(mem, &payload::mem_table(&over_user), &[fa, fb]);
    // Beyond the file's size, by size and by offset; zero size.
    raw.refused(
        mem,
        &payload::mem_table(&[(0, 0x20000, 0x10_0000, 0)]),
        &[fa],
    );
    raw.refused(
        mem,
        &payload::mem_table(&[(0, 0x10000, 0x10_0000, 0x1000)]),
        &[fa],
    );
    raw.refused(mem, &payload::mem_table(&[(0, 0, 0x10_0000, 0)]), &[fa]);
    // Backings that are not regular files.
    let zero = File::open("/dev/zero").unwrap();
    let (pr, _pw) = pipe();
    let (sock, _peer) = UnixStream::pair().unwrap();
    let dir = File::open(std::env::temp_dir()).unwrap();
    for fd in [
        zero.as_raw_fd(),
        pr.as_raw_fd(),
        sock.as_raw_fd(),
        dir.as_raw_fd(),
    ] {
        raw.refused(
            mem,
            &payload::mem_table(&[(0, 1 << 40, 0x10_0000, 0)]),
            &[fd],
        );
        raw.refused(
            mem,
            &payload::mem_table(&[(0, 0x1000, 0x10_0000, 0)]),
            &[fd],
        );
    }
    // Missing and extra fds.
    raw.refused(mem, &payload::mem_table(&[(0, 0x1000, 0x10_0000, 0)]), &[]);
    raw.refused(
        mem,
        &payload::mem_table(&[(0, 0x1000, 0x10_0000, 0)]),
        &[fa, fb],
    );
    // Beyond --max-mapped-bytes-per-port (a sparse 32 MiB file).
    let big = file(32 << 20);
    raw.refused(
        mem,
        &payload::mem_table(&[(0, 32 << 20, 0x1000_0000, 0)]),
        &[big.as_raw_fd()],
    );
    let log = h.dev.log();
    for needle in [
        "a character device",
        "a pipe",
        "a socket",
        "a directory",
        "past the end of its file",
        "overlaps region 0",
        "exceeds the port's limit",
    ] {
        assert!(log.contains(needle), "log names the reason `{needle}`");
    }
    // A good table is still accepted on the same connection.
    raw.ok(
        mem,
        &payload::mem_table(&[(0, 0x10000, 0x10_0000, 0)]),
        &[fa],
    );
    h.after("bad memory tables", Some(raw));

    // Many connections each trying to map a huge /dev/zero region: all
    // refused, nothing mapped.
    let before = std::fs::read_to_string(format!("/proc/{}/status", h.dev.pid())).unwrap();
    for _ in 0..100 {
        let mut raw = Raw::connect(&h.dev, 0);
        raw.refused(
            mem,
            &payload::mem_table(&[(0, 1 << 44, 0x10_0000, 0)]),
            &[zero.as_raw_fd()],
        );
        drop(raw);
        h.port0_free();
    }
    let vm_size = |status: &str| -> u64 {
        let line = status.lines().find(|l| l.starts_with("VmSize:")).unwrap();
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    };
    let after = std::fs::read_to_string(format!("/proc/{}/status", h.dev.pid())).unwrap();
    assert!(
        vm_size(&after) < vm_size(&before) + (1 << 20),
        "address space did not grow by a GiB"
    );
    h.after("many /dev/zero tables", None);
}

/// Sets up a hostile frontend with `shared` as memory and tx ring 1 with
/// one frame pending (posted, not kicked).
fn pending_tx(h: &Harness, shared: &Shared) -> Raw {
    let mut raw = Raw::connect(&h.dev, 0);
    raw.handshake(0);
    raw.set_memory(shared);
    raw.ring(shared, 1, false);
    let f = frame(mac(1), mac(0), b"pending");
    shared
        .mem
        .write_slice(&f, GuestAddress(Shared::buf(1, 0)))
        .unwrap();
    shared.desc(1, 0, Shared::buf(1, 0), f.len() as u32, 0, 0);
    shared.avail(1, 0, 0, 1);
    raw
}

#[test]
fn memory_shrunk_under_the_device_resets_only_that_port() {
    let mut h = Harness::start(&[]);

    // An unsealed memfd, shrunk to nothing, then kicked.
    let shared = Shared::memfd(false);
    let mut raw = pending_tx(&h, &shared);
    shared.file.set_len(0).unwrap();
    raw.kick();
    assert!(raw.closed_by_device(), "the device drops the port");
    assert!(h.dev.log().contains("shrank under the device"));
    h.after("unsealed memfd shrunk", None);

    // A regular file in /dev/shm, shrunk below its rings.
    let path = std::path::Path::new("/dev/shm").join(format!("hostile-{}", std::process::id()));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    std::fs::remove_file(&path).unwrap();
    let shared = Shared::new(file);
    let mut raw = pending_tx(&h, &shared);
    shared.file.set_len(0x8000).unwrap();
    raw.kick();
    assert!(raw.closed_by_device(), "the device drops the port");
    h.after("/dev/shm file shrunk", None);

    // A memfd sealed against shrinking cannot be shrunk: the port serves on.
    let shared = Shared::memfd(true);
    let raw = pending_tx(&h, &shared);
    assert!(shared.file.set_len(0).is_err(), "F_SEAL_SHRINK holds");
    raw.kick();
    let deadline = Instant::now() + T;
    while shared.used_idx(1) != 1 {
        assert!(Instant::now() < deadline, "sealed memory keeps working");
        std::thread::sleep(Duration::from_millis(2));
    }
    h.after("sealed memfd", Some(raw));
}

#[test]
fn bad_ring_settings_are_refused() {
    let mut h = Harness::start(&[]);
    let shared = Shared::memfd(false);
    let mut raw = Raw::connect(&h.dev, 0);

    // Kicks before anything is set up.
    raw.handshake(0);
    raw.kick_fd(1);
    raw.kick_fd(0);
    for _ in 0..100 {
        raw.kick();
    }
    raw.set_memory(&shared);

    let num = code(FrontendReq::SET_VRING_NUM);
    for bad in [0, 3, 100, QMAX * 2, u32::MAX] {
        raw.refused(num, &payload::vring_state(1, bad), &[]);
    }
    raw.refused(num, &payload::vring_state(99, 16), &[]);
    raw.ok(num, &payload::vring_state(1, 16), &[]);
    let addr = code(FrontendReq::SET_VRING_ADDR);
    let host = shared.host + Shared::ring_base(1);
    for (desc, used, avail) in [
        (0x1000, host + 0x2000, host + 0x1000),
        (host, host + HSIZE, host + 0x1000),
        (host, host + 0x2000, shared.host + HSIZE - 2),
        (host, host + 0x2000, u64::MAX - 1),
    ] {
        raw.refused(addr, &payload::vring_addr(1, 0, desc, used, avail), &[]);
    }
    raw.refused(
        code(FrontendReq::SET_VRING_BASE),
        &payload::vring_state(1, 1 << 16),
        &[],
    );
    raw.refused(
        code(FrontendReq::SET_VRING_BASE),
        &payload::vring_state(1, u32::MAX),
        &[],
    );

    let msg = code(FrontendReq::IOTLB_MSG);
    let uaddr = shared.host;
    for p in [
        iotlb(0x1000, 0x1000, uaddr, 0, 2),
        iotlb(u64::MAX - 0xfff, 0x2000, uaddr, 3, 2),
        iotlb(0x1000, 0x1000, u64::MAX - 0x800, 3, 2),
        iotlb(0x1000, 0, uaddr, 3, 2),
        iotlb(0x1000, HSIZE + 0x1000, uaddr, 3, 2),
    ] {
        raw.refused(msg, &p, &[]);
    }
    let log = h.dev.log();
    for needle in [
        "invalid ring size",
        "is not inside one region of the memory table",
        "beyond the ring's 16-bit index space",
        "carries no access permission",
        "wraps around the address space",
    ] {
        assert!(log.contains(needle), "log names the reason `{needle}`");
    }
    // The ring still starts once set up right, and moves a frame.
    raw.ring(&shared, 1, false);
    let f = frame(mac(1), mac(0), b"after refusals");
    shared
        .mem
        .write_slice(&f, GuestAddress(Shared::buf(1, 0)))
        .unwrap();
    shared.desc(1, 0, Shared::buf(1, 0), f.len() as u32, 0, 0);
    shared.avail(1, 0, 0, 1);
    raw.kick();
    wait_used(&h.dev, &shared, 1, 1);
    h.after("bad ring settings", Some(raw));
}

fn wait_used(dev: &DeviceProcess, shared: &Shared, ring: u32, idx: u16) {
    let deadline = Instant::now() + T;
    while shared.used_idx(ring) != idx {
        assert!(
            Instant::now() < deadline,
            "ring {ring}: used index {} != {idx}: {}",
            shared.used_idx(ring),
            dev.log()
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn broken_rings_stop_and_can_be_reset() {
    let mut h = Harness::start(&[]);
    let shared = Shared::memfd(false);
    let mut raw = Raw::connect(&h.dev, 0);
    raw.handshake(0);
    raw.set_memory(&shared);
    raw.ring(&shared, 1, false);
    const NEXT: u16 = 1;
    let good = frame(mac(1), mac(0), b"good");
    shared
        .mem
        .write_slice(&good, GuestAddress(Shared::buf(1, 0)))
        .unwrap();
    let buf = Shared::buf(1, 0);
    let broken_logs = || h_count(&h.dev.log(), "ring broken by the frontend");

    // A descriptor loop.
    let before = broken_logs();
    shared.desc(1, 0, buf, 64, NEXT, 0);
    shared.avail(1, 0, 0, 1);
    raw.kick();
    wait_log(&h, before + 1);
    assert_eq!(shared.used_idx(1), 0, "nothing used");
    // Reset: GET_VRING_BASE reports the offending chain; repaired, base
    // and kick set again, the chain is served.
    assert!(raw.send(
        code(FrontendReq::GET_VRING_BASE),
        0x1,
        &payload::vring_state(1, 0),
        &[]
    ));
    let (_, body) = raw.reply().unwrap();
    assert_eq!(body, payload::vring_state(1, 0));
    shared.desc(1, 0, buf, good.len() as u32, 0, 0);
    raw.ok(
        code(FrontendReq::SET_VRING_BASE),
        &payload::vring_state(1, 0),
        &[],
    );
    raw.kick_fd(1);
    wait_used(&h.dev, &shared, 1, 1);

    // A chain longer than the ring: 16 linked descriptors in a circle.
    let before = broken_logs();
    for i in 0..16u16 {
        shared.desc(1, i, buf, 8, NEXT, (i + 1) % 16);
    }
    shared.avail(1, 1, 4, 2);
    raw.kick();
    wait_log(&h, before + 1);
    // Repaired, the ring restarts on SET_VRING_ENABLE.
    shared.desc(1, 4, buf, good.len() as u32, 0, 0);
    raw.ok(
        code(FrontendReq::SET_VRING_ENABLE),
        &payload::vring_state(1, 1),
        &[],
    );
    wait_used(&h.dev, &shared, 1, 2);

    // The available index jumps by more than the ring size.
    let before = broken_logs();
    shared.avail(1, 2, 4, 2 + 100);
    raw.kick();
    wait_log(&h, before + 1);
    shared.avail(1, 2, 4, 3);
    raw.ok(
        code(FrontendReq::SET_VRING_ENABLE),
        &payload::vring_state(1, 1),
        &[],
    );
    wait_used(&h.dev, &shared, 1, 3);

    // Buffers outside the memory, lengths 0 and 2^32-1: refused chain by
    // chain, the ring goes on.
    let errors = h.dev.port(0).n("tx_errors");
    for (i, (addr, len)) in [
        (0xdead_0000_0000u64, 64u32),
        (buf, 0),
        (buf, u32::MAX),
        (MEM_GPA + HSIZE - 8, 64),
    ]
    .into_iter()
    .enumerate()
    {
        let i = i as u16;
        shared.desc(1, 5 + i, addr, len, 0, 0);
        shared.avail(1, 3 + i, 5 + i, 4 + i);
    }
    raw.kick();
    wait_used(&h.dev, &shared, 1, 7);
    assert!(h.dev.wait_for(T, |s| s[0].n("tx_errors") >= errors + 4));
    h.after("broken rings", Some(raw));

    // With ACCESS_PLATFORM: a buffer outside the IOTLB. The device asks
    // (no backend channel here: it only logs) and keeps waiting, without
    // spinning.
    let mut raw = Raw::connect(&h.dev, 0);
    raw.handshake(ACCESS_PLATFORM);
    raw.set_memory(&shared);
    let ring = Shared::ring_base(1);
    raw.ok(
        code(FrontendReq::IOTLB_MSG),
        &iotlb(MEM_GPA + ring, 0x4000, shared.host + ring, 3, 2),
        &[],
    );
    shared.avail(1, 0, 0, 0);
    raw.ring(&shared, 1, true);
    shared.desc(1, 0, MEM_GPA + ring + 0x8000, 64, 0, 0);
    shared.avail(1, 0, 0, 1);
    raw.kick();
    h.after("buffer outside the IOTLB", Some(raw));
}

fn h_count(log: &str, needle: &str) -> usize {
    log.matches(needle).count()
}

fn wait_log(h: &Harness, n: usize) {
    let deadline = Instant::now() + T;
    while h_count(&h.dev.log(), "ring broken by the frontend") < n {
        assert!(
            Instant::now() < deadline,
            "ring not reported broken: {}",
            h.dev.log()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The RDMA send and completion queues of the hostile frontend's first
/// queue pair (the admin pair of a device with two net queue pairs).
const RAW_SQ: u32 = 4;
const RAW_CQ: u32 = 5;

/// A raw frontend on port 0 with its memory and the RDMA queues
/// [`RAW_SQ`] and [`RAW_CQ`] set up (their kicks are `raw.kicks[0]` and
/// `[1]`).
fn rdma_frontend(h: &Harness) -> (Shared, Raw) {
    let shared = Shared::memfd(false);
    let mut raw = Raw::connect(&h.dev, 0);
    raw.handshake(0);
    raw.set_memory(&shared);
    raw.ring(&shared, RAW_SQ, false);
    raw.ring(&shared, RAW_CQ, false);
    (shared, raw)
}

/// A request of `op` that asks for a completion.
fn signaled(user_data: u64, op: pindown_uapi::Operation) -> pindown_uapi::WorkRequest {
    pindown_uapi::WorkRequest {
        user_data,
        flags: pindown_uapi::WrFlags::SIGNALED,
        op,
    }
}

/// A NOP that asks for a completion.
fn nop(user_data: u64) -> pindown_uapi::WorkRequest {
    signaled(user_data, pindown_uapi::Operation::Nop)
}

/// Waits until `done` holds (up to [`T`]; `what` names it in the failure).
fn wait_until(h: &Harness, what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + T;
    while !done() {
        assert!(Instant::now() < deadline, "never {what}: {}", h.dev.log());
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Waits for completion `position` of completion queue `cq`.
fn wait_completion(h: &Harness, shared: &Shared, cq: u32, position: u16) -> Completion {
    let deadline = Instant::now() + T;
    loop {
        if let Some(bytes) = shared.completion(cq, position) {
            return queue::decode_completion_slot(&bytes).unwrap();
        }
        assert!(
            Instant::now() < deadline,
            "no completion {position}: {}",
            h.dev.log()
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn rdma_queues_the_device_cannot_use_are_stopped_and_can_be_set_again() {
    let mut h = Harness::start(&[]);
    let (shared, mut raw) = rdma_frontend(&h);
    let (sq, cq) = (RAW_SQ, RAW_CQ);
    shared.post_slot(sq, 0, &queue::request_slot(&nop(1), 0));
    raw.kicks[0].write(1).unwrap();
    assert_eq!(wait_completion(&h, &shared, cq, 0).user_data, 1);

    // Slots 16-byte aligned (enough for a split ring's descriptors), not
    // 64: the send queue stops, the device serves on.
    let base = shared.host + Shared::ring_base(sq);
    let set_addr = |raw: &mut Raw, slots: u64| {
        raw.ok(
            code(FrontendReq::SET_VRING_ADDR),
            &payload::vring_addr(sq, 0, slots, base + 0x2000, base + 0x1000),
            &[],
        );
    };
    set_addr(&mut raw, base + 16);
    shared.post_slot(sq, 1, &queue::request_slot(&nop(2), 1));
    raw.kicks[0].write(1).unwrap();
    wait_log(&h, 1);
    assert!(
        h.dev.log().contains("not 64-byte aligned"),
        "{}",
        h.dev.log()
    );
    assert!(
        shared.completion(cq, 1).is_none(),
        "a broken queue runs nothing"
    );

    // Set right again, the queue goes on where it stood.
    set_the_send_queue_right(&shared, &mut raw);
    raw.kicks[0].write(1).unwrap();
    assert_eq!(wait_completion(&h, &shared, cq, 1).user_data, 2);
    assert_eq!(shared.head(sq), 2);
    h.after("unusable RDMA queues", Some(raw));
}

#[test]
fn random_work_requests_get_answers_and_break_nothing() {
    let mut h = Harness::start(&[]);
    let (shared, raw) = rdma_frontend(&h);
    let (sq, cq) = (RAW_SQ, RAW_CQ);
    let mut untouched = vec![0u8; RDMA_BYTES];
    h.target.read_at(0, &mut untouched);
    let mut posted = 0u16;
    let mut consumed = 0u16;
    let mut answered = 0u64;
    for round in 0..8 {
        for _ in 0..QSZ {
            let mut wr = [0u8; queue::REQUEST_SLOT];
            wr.copy_from_slice(&h.rng.bytes(queue::REQUEST_SLOT));
            if round % 2 == 1 {
                // Mostly valid opcodes with random fields.
                wr[0] = (h.rng.next() % 12) as u8;
            }
            shared.post_slot(sq, posted, &wr);
            posted = posted.wrapping_add(1);
        }
        raw.kicks[0].write(1).unwrap();
        // Read completions (making room for more) until the device has
        // taken every request: an inline write may have taken slots past
        // the last one as its bytes.
        let deadline = Instant::now() + T;
        loop {
            while let Some(bytes) = shared.completion(cq, consumed) {
                // Whatever the requests were, the answers decode.
                Completion::decode(&{
                    let mut plain = bytes;
                    plain[queue::COMPLETION_STAMP..].fill(0);
                    plain
                })
                .unwrap();
                consumed = consumed.wrapping_add(1);
                answered += 1;
            }
            shared.consumed(cq, consumed);
            raw.kicks[1].write(1).unwrap();
            let head = shared.head(sq);
            if head.wrapping_sub(posted) < 0x8000 {
                posted = head;
                break;
            }
            assert!(
                Instant::now() < deadline,
                "send queue head {head}, {posted} posted: {}",
                h.dev.log()
            );
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    assert!(answered > 0, "malformed requests are answered");
    // Another port's window is untouched by whatever the requests named.
    let mut now = vec![0u8; RDMA_BYTES];
    h.target.read_at(0, &mut now);
    assert!(now == untouched, "random requests wrote into port 3");
    h.after("random work requests", Some(raw));
}

#[test]
fn a_message_trickled_byte_by_byte_is_dropped_after_the_message_deadline() {
    let mut h = Harness::start(&[]);
    let mut raw = Raw::connect(&h.dev, 0);
    // The port counts as connected once its connection thread runs: only
    // a disconnection after that is the device dropping the frontend.
    assert!(
        h.dev.wait_for(T, |s| s[0].n("connected") == 1),
        "port 0 never showed the connection: {}",
        h.dev.log()
    );
    // A SET_MEM_TABLE header announcing a payload, then one byte every
    // 0.5 s: each read is quick, the message never completes.
    let p = payload::mem_table(&[(MEM_GPA, HSIZE, 0x7000_0000, 0)]);
    let mut header = code(FrontendReq::SET_MEM_TABLE).to_le_bytes().to_vec();
    header.extend_from_slice(&NEED_REPLY.to_le_bytes());
    header.extend_from_slice(&(p.len() as u32).to_le_bytes());
    raw.s.write_all(&header).unwrap();
    let started = std::time::Instant::now();
    let mut dropped = false;
    for byte in p.iter().cycle().take(80) {
        if raw.s.write_all(&[*byte]).is_err() {
            dropped = true;
            break;
        }
        if h.dev.status().unwrap()[0].n("connected") == 0 {
            dropped = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    assert!(
        dropped,
        "a frontend trickling one byte every 0.5 s kept its port for {:?}: {}",
        started.elapsed(),
        h.dev.log()
    );
    h.port0_free();
    h.after("trickled message", None);
}

#[test]
fn a_peer_reaching_memory_that_shrank_gets_errors_and_the_port_resets() {
    let mut h = Harness::start(&[]);
    let (shared, mut raw) = rdma_frontend(&h);
    let (sq, cq) = (RAW_SQ, RAW_CQ);
    // A BIND_WINDOW request.
    const WINDOW: u64 = 0x8000;
    let bind = pindown_uapi::WorkRequest {
        user_data: 7,
        flags: pindown_uapi::WrFlags::SIGNALED,
        op: pindown_uapi::Operation::BindWindow {
            start: MEM_GPA + 0x1000,
            len: WINDOW,
            access: Access::REMOTE_READ | Access::REMOTE_WRITE,
            peer: None,
        },
    };
    shared.post_slot(sq, 0, &queue::request_slot(&bind, 0));
    raw.kicks[0].write(1).unwrap();
    let deadline = Instant::now() + T;
    let bytes = loop {
        if let Some(bytes) = shared.completion(cq, 0) {
            break bytes;
        }
        assert!(Instant::now() < deadline, "no completion: {}", h.dev.log());
        std::thread::sleep(Duration::from_millis(2));
    };
    let bound = queue::decode_completion_slot(&bytes).unwrap();
    assert_eq!(bound.status, Status::Success, "{bound:?}");
    let window: pindown_driver::verbs::RemoteWindow = format!("0:0:{:016x}:{WINDOW}", bound.value)
        .parse()
        .unwrap();

    // The frontend takes the window's pages away, and then says nothing.
    shared
        .mem
        .write_slice(&[0xab; WINDOW as usize], GuestAddress(MEM_GPA + 0x1000))
        .unwrap();
    shared.file.set_len(0x1000).unwrap();

    // Port 3 reads and writes through the window: errors, never success
    // with bytes that were never there.
    let peer = h.rdma;
    let sink = peer.alloc(WINDOW as usize, 64).unwrap();
    let sink_region = peer.register_buffer(&sink).unwrap();
    let mut cq = peer.create_completion_queue();
    let mut qp = peer.create_queue_pair(&mut cq).unwrap();
    qp.post(&[
        RdmaRead::new(sink_region.local(0, WINDOW as u32).unwrap(), window.at(0))
            .build()
            .user_data(1)
            .signaled(),
    ])
    .unwrap();
    let read = wait_one(&mut cq);
    assert_ne!(
        read.status,
        Status::Success,
        "a read of lost pages: {read:?}"
    );
    qp.post(&[
        RdmaWrite::new(sink_region.local(0, WINDOW as u32).unwrap(), window.at(0))
            .build()
            .user_data(2)
            .signaled(),
    ])
    .unwrap();
    let written = wait_one(&mut cq);
    assert_ne!(
        written.status,
        Status::Success,
        "a write into lost pages: {written:?}"
    );
    drop(sink_region);

    // The owner port is reset although its frontend sent nothing more.
    h.port0_free();
    assert!(raw.closed_by_device(), "the device drops the port");
    assert!(h.dev.log().contains("shrank under the device"));
    h.after("a peer reached memory that shrank", None);
}

/// The Harness's device as node 0 of a fabric whose node 1 is a socket
/// that never answers (returned: it must stay bound), with a peer timeout
/// of 1 s.
fn harness_with_a_silent_node() -> (Harness, std::net::UdpSocket) {
    let udp = [free_udp_port(), free_udp_port()];
    let silent = std::net::UdpSocket::bind(("127.0.0.1", udp[1])).unwrap();
    let mut args = fabric_args(0, &udp, "5eed");
    args.extend(["--peer-timeout".to_string(), "1s".to_string()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    (Harness::start(&args), silent)
}

/// A signaled WRITE of 64 bytes of the hostile frontend's memory to the
/// silent node 1: the link holds it until the peer timeout.
fn write_to_the_silent_node(user_data: u64) -> pindown_uapi::WorkRequest {
    signaled(
        user_data,
        pindown_uapi::Operation::Write {
            local: MEM_GPA + 0xF_0000,
            len: 64,
            remote: pindown_uapi::RemoteAddress {
                node: 1,
                port: 0,
                key: pindown_uapi::RemoteKey(0x1234),
                offset: 0,
            },
        },
    )
}

/// A frontend that resets its RDMA queues (a guest's driver resetting
/// the device, or RESET_OWNER) while a request of the old queue is held on
/// the fabric link: that request's completion, which comes when the link
/// gives up on its silent peer, never reaches the restarted queue; it does
/// not hold the restarted queue's retired position back; it counts
/// against no limit once it ended; and the new queue's requests complete
/// in their own order.
fn a_request_held_on_the_link_is_forgotten_by(reset: Reset) {
    let (mut h, _silent) = harness_with_a_silent_node();
    let (shared, mut raw) = rdma_frontend(&h);
    let (sq, cq) = (RAW_SQ, RAW_CQ);
    let held = write_to_the_silent_node(0xA1);
    shared.post_slot(sq, 0, &queue::request_slot(&held, 0));
    raw.kicks[0].write(1).unwrap();
    wait_until(&h, "the write handed to the link", || {
        h.dev.fabric_status().n("started") >= 1
    });

    let kick = reset.apply(&mut raw, &shared);
    shared.post_slot(sq, 0, &queue::request_slot(&nop(0xB1), 0));
    raw.kicks[kick].write(1).unwrap();
    assert_eq!(wait_completion(&h, &shared, cq, 0).user_data, 0xB1);
    // The retired position moves on while the link still holds the write.
    let retired =
        GuestAddress(MEM_GPA + Shared::ring_base(sq) + 0x2000 + queue::Record::RETIRED as u64);
    let retired_at = || shared.mem.load::<u16>(retired, Ordering::Acquire).unwrap();
    wait_until(&h, "the retired position past the NOP", || {
        retired_at() == 1
    });
    // The held write still counts against the pair's requests on the link.
    let in_flight = in_flight_of(&h, sq);
    assert_eq!(
        h.dev.fabric_status().n("failed"),
        0,
        "the retired position moved only once the held write failed"
    );
    assert_eq!(in_flight, 1, "the held write counted in flight");

    // The link gives the held write up (its peer is silent).
    wait_until(&h, "the held write failed", || {
        h.dev.fabric_status().n("failed") >= 1
    });
    std::thread::sleep(Duration::from_millis(50));
    shared.post_slot(sq, 1, &queue::request_slot(&nop(0xB2), 1));
    raw.kicks[kick].write(1).unwrap();
    let second = wait_completion(&h, &shared, cq, 1);
    assert_eq!(
        (second.user_data, second.status),
        (0xB2, Status::Success),
        "the restarted queue's second completion"
    );
    wait_until(&h, "nothing in flight", || in_flight_of(&h, sq) == 0);
    assert_eq!(retired_at(), 2, "retired position once every request ended");
    h.after(
        &format!("{reset:?} reset with a request on the link"),
        Some(raw),
    );
}

#[test]
fn a_restarted_send_queue_gets_no_completion_of_a_request_held_on_the_link() {
    a_request_held_on_the_link_is_forgotten_by(Reset::Rings);
}

#[test]
fn reset_owner_forgets_a_request_held_on_the_link() {
    a_request_held_on_the_link_is_forgotten_by(Reset::Owner);
}

/// A full ring of NOPs (user_data 0xA000 + position) whose completions
/// fill the completion queue (never consumed), then one more, whose
/// completion waits for room (the device takes no request beyond).
/// Returns the send queue's head.
fn fill_the_completion_queue(h: &Harness, shared: &Shared, raw: &Raw) -> u16 {
    let (sq, cq) = (RAW_SQ, RAW_CQ);
    let old = QSZ + 1;
    for position in 0..old {
        if position == QSZ {
            raw.kicks[0].write(1).unwrap();
            wait_completion(h, shared, cq, QSZ - 1);
            wait_until(h, "a full ring taken", || shared.head(sq) == QSZ);
        }
        let user_data = 0xA000 + u64::from(position);
        shared.post_slot(
            sq,
            position,
            &queue::request_slot(&nop(user_data), position),
        );
    }
    raw.kicks[0].write(1).unwrap();
    wait_until(h, "the request beyond taken", || shared.head(sq) == old);
    old
}

/// How a frontend resets the RDMA queues of port 0.
#[derive(Clone, Copy, Debug)]
enum Reset {
    /// GET_VRING_BASE, then the queues set up again from position 0.
    Rings,
    /// RESET_OWNER, then the port set up again.
    Owner,
}

impl Reset {
    /// Resets the queues [`RAW_SQ`] and [`RAW_CQ`] as a driver resetting
    /// the device does: stopped (or the port's owner reset and the port
    /// set up again), their memory cleared, set up again from position 0.
    /// Returns the index of the send queue's new kick in `raw.kicks`.
    fn apply(self, raw: &mut Raw, shared: &Shared) -> usize {
        match self {
            Reset::Rings => {
                raw.stop_ring(RAW_SQ);
                raw.stop_ring(RAW_CQ);
            }
            Reset::Owner => raw.ok(code(FrontendReq::RESET_OWNER), &[], &[]),
        }
        for ring in [RAW_SQ, RAW_CQ] {
            let at = GuestAddress(MEM_GPA + Shared::ring_base(ring));
            shared.mem.write_slice(&[0u8; 0x3000], at).unwrap();
        }
        if let Reset::Owner = self {
            raw.handshake(0);
            raw.set_memory(shared);
        }
        raw.ring(shared, RAW_SQ, false);
        raw.ring(shared, RAW_CQ, false);
        raw.kicks.len() - 2
    }
}

/// Completions waiting for room in a full completion queue belong to the
/// queues they were posted on: after a reset, the restarted completion
/// queue gets only the completions of its own requests.
fn completions_that_waited_for_room_are_dropped_by(reset: Reset) {
    let mut h = Harness::start(&[]);
    let (shared, mut raw) = rdma_frontend(&h);
    let (sq, cq) = (RAW_SQ, RAW_CQ);
    fill_the_completion_queue(&h, &shared, &raw);
    let kick = reset.apply(&mut raw, &shared);
    for position in 0..2u16 {
        let user_data = 0xB000 + u64::from(position);
        shared.post_slot(
            sq,
            position,
            &queue::request_slot(&nop(user_data), position),
        );
    }
    raw.kicks[kick].write(1).unwrap();
    let got: Vec<u64> = (0..2u16)
        .map(|position| wait_completion(&h, &shared, cq, position).user_data)
        .collect();
    assert_eq!(got, [0xB000, 0xB001], "the restarted queue's completions");
    h.after(
        &format!("{reset:?} reset with completions waiting for room"),
        Some(raw),
    );
}

#[test]
fn a_reset_drops_the_completions_that_waited_for_room() {
    completions_that_waited_for_room_are_dropped_by(Reset::Rings);
}

#[test]
fn reset_owner_drops_the_completions_that_waited_for_room() {
    completions_that_waited_for_room_are_dropped_by(Reset::Owner);
}

/// The `in_flight` figure of port 0's send queue `sq` (the status
/// socket's `rings` answer).
fn in_flight_of(h: &Harness, sq: u32) -> u64 {
    let rings =
        pindown_emu_device::status::query(&h.dev.control_path(), "rings").unwrap_or_default();
    let line = rings
        .lines()
        .find(|l| l.starts_with(&format!("ring port=0 ring={sq} ")))
        .unwrap_or_else(|| panic!("no ring {sq}: {rings}"));
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix("in_flight="))
        .unwrap()
        .parse()
        .unwrap()
}

/// Where the tests keep a vector descriptor and the source bytes in the
/// hostile frontend's memory (past every ring).
const DESCRIPTOR_AT: u64 = MEM_GPA + 0xE_0000;
const SOURCE_AT: u64 = MEM_GPA + 0xF_0000;

/// A VECTOR_WRITE of `repeat` times the 64 KiB at SOURCE_AT into the
/// first 64 KiB of port 3's window (the same bytes over and over: a
/// transfer of many turns), its descriptor written at DESCRIPTOR_AT.
fn long_write(
    h: &Harness,
    shared: &Shared,
    user_data: u64,
    repeat: u64,
    fill: u8,
) -> pindown_uapi::WorkRequest {
    use pindown_uapi::pattern::{encode_pair, Pattern, Piece};
    // One byte in two of the window, byte by byte: a slow transfer.
    let block = RDMA_BYTES as u64 / 2;
    let local = Pattern {
        repeat,
        extent: 0,
        skip: 0,
        len: block * repeat,
        pieces: vec![Piece::contiguous(0, block)],
    };
    let remote = Pattern {
        pieces: vec![Piece::vector(0, 1, block, 2)],
        ..local.clone()
    };
    let desc = encode_pair(&local, &remote);
    shared
        .mem
        .write_slice(&desc, GuestAddress(DESCRIPTOR_AT))
        .unwrap();
    shared
        .mem
        .write_slice(&vec![fill; RDMA_BYTES], GuestAddress(SOURCE_AT))
        .unwrap();
    signaled(
        user_data,
        pindown_uapi::Operation::VectorWrite(pindown_uapi::VectorTransfer {
            local: SOURCE_AT,
            len: u32::try_from(block * repeat).unwrap(),
            remote: h.window.remote().at(0),
            descriptor: pindown_uapi::Descriptor::InMemory {
                iova: DESCRIPTOR_AT,
                len: desc.len() as u32,
            },
            notify: None,
        }),
    )
}

/// Whether port 3's window holds `fill` in its first bytes.
fn target_filled_with(h: &Harness, fill: u8) -> bool {
    let mut b = [0u8; 64];
    h.target.read_at(0, &mut b);
    b.iter().step_by(2).all(|&x| x == fill)
}

/// A long VECTOR_WRITE into port 3 is running when the frontend resets
/// its queues: it stops moving bytes, its completion never comes, and the
/// restarted queue's own request completes at position 0.
fn a_transfer_stops_at(reset: Reset) {
    let mut h = Harness::start(&[]);
    let (shared, mut raw) = rdma_frontend(&h);
    let (sq, cq) = (RAW_SQ, RAW_CQ);
    h.target.write_at(0, &[0u8; RDMA_BYTES]);
    let long = long_write(&h, &shared, 0xA1, 0x3000, 0x5A);
    shared.post_slot(sq, 0, &queue::request_slot(&long, 0));
    raw.kicks[0].write(1).unwrap();
    wait_until(&h, "the transfer moving bytes", || {
        target_filled_with(&h, 0x5A)
    });
    let kick = reset.apply(&mut raw, &shared);
    assert!(
        shared.completion(cq, 0).is_none(),
        "the transfer had ended already"
    );
    h.target.write_at(0, &[0u8; RDMA_BYTES]);
    shared.post_slot(sq, 0, &queue::request_slot(&nop(0xB0), 0));
    raw.kicks[kick].write(1).unwrap();
    assert_eq!(wait_completion(&h, &shared, cq, 0).user_data, 0xB0);
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        shared.completion(cq, 1).is_none(),
        "a completion after the NOP"
    );
    assert!(
        target_filled_with(&h, 0),
        "the old transfer went on writing port 3"
    );
    h.after(&format!("{reset:?} reset mid-transfer"), Some(raw));
}

#[test]
fn a_reset_mid_transfer_stops_the_transfer() {
    a_transfer_stops_at(Reset::Rings);
}

#[test]
fn reset_owner_mid_transfer_stops_the_transfer() {
    a_transfer_stops_at(Reset::Owner);
}

/// A VM paused and resumed: QEMU stops the rings (GET_VRING_BASE) and
/// starts them again at the positions they stopped at (SET_VRING_BASE
/// with those), the guest's driver knowing nothing of it. The completion
/// that waited for room in the full completion queue still comes once
/// the driver consumes.
#[test]
fn a_paused_and_resumed_queue_keeps_its_completions() {
    let mut h = Harness::start(&[]);
    let (shared, mut raw) = rdma_frontend(&h);
    let (sq, cq) = (RAW_SQ, RAW_CQ);
    let old = fill_the_completion_queue(&h, &shared, &raw);

    // Pause: both rings stopped; resume: set up again at their bases.
    let bases = [raw.stop_ring(sq), raw.stop_ring(cq)];
    assert_eq!(bases, [u32::from(old), u32::from(QSZ)]);
    for (ring, base) in [sq, cq].into_iter().zip(bases) {
        raw.ring_from(&shared, ring, false, base);
    }
    // The driver consumes what it has and kicks the completion queue.
    shared.consumed(cq, QSZ);
    raw.kicks.last().unwrap().write(1).unwrap();
    let got = wait_completion(&h, &shared, cq, QSZ);
    assert_eq!(got.user_data, 0xA000 + u64::from(QSZ));
    h.after("queues paused and resumed", Some(raw));
}

/// RESET_OWNER with a request held on the link, 64 times: each held
/// request counts against the pair's requests on the link until the link
/// gives it up, then no more, and the pair keeps taking requests.
#[test]
fn reset_owner_64_times_with_requests_on_the_link() {
    let (mut h, _silent) = harness_with_a_silent_node();
    let (shared, mut raw) = rdma_frontend(&h);
    let (sq, cq) = (RAW_SQ, RAW_CQ);
    let held = write_to_the_silent_node(0xA1);
    let mut kick = 0;
    for round in 1..=64 {
        shared.post_slot(sq, 0, &queue::request_slot(&held, 0));
        raw.kicks[kick].write(1).unwrap();
        wait_until(&h, "the write handed to the link", || {
            h.dev.fabric_status().n("started") >= round
        });
        kick = Reset::Owner.apply(&mut raw, &shared);
    }
    // Every held write has failed by now (peer timeout 1 s).
    wait_until(&h, "the held writes failed", || {
        h.dev.fabric_status().n("failed") >= 64
    });
    shared.post_slot(sq, 0, &queue::request_slot(&nop(0xB0), 0));
    raw.kicks[kick].write(1).unwrap();
    assert_eq!(wait_completion(&h, &shared, cq, 0).user_data, 0xB0);
    wait_until(&h, "nothing in flight", || in_flight_of(&h, sq) == 0);
    h.after("RESET_OWNER 64 times with requests on the link", Some(raw));
}

/// A READ from another node's window is on the link (datagrams delayed)
/// when the frontend resets its queues: once the restarted queue has run a
/// request (the device has seen the reset), no more of the old READ's data
/// lands in the port's memory, and its completion never comes.
#[test]
fn a_read_on_the_link_lands_no_data_after_a_reset() {
    let udp = [free_udp_port(), free_udp_port()];
    let one = fabric_device(1, &udp, "5eed", 1, &[]);
    let far = Context::open(one.socket(0), rdma_config()).unwrap();
    const LEN: usize = 512 << 10;
    let far_buf = far.alloc(LEN, 64).unwrap();
    far_buf.write_at(0, &vec![0x77u8; LEN]);
    let far_region = far.register_buffer(&far_buf).unwrap();
    let window = far
        .bind_window(&far_region, 0, LEN as u64, Access::REMOTE_READ)
        .unwrap();
    let mut args = fabric_args(0, &udp, "5eed");
    args.extend(["--fault-in".to_string(), "delay=30ms".to_string()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut h = Harness::start(&args);
    let (shared, mut raw) = rdma_frontend(&h);
    let (sq, cq) = (RAW_SQ, RAW_CQ);
    let read = signaled(
        0xA1,
        pindown_uapi::Operation::Read {
            local: MEM_GPA,
            len: LEN as u32,
            remote: window.remote().at(0),
        },
    );
    shared.post_slot(sq, 0, &queue::request_slot(&read, 0));
    let t = Instant::now();
    raw.kicks[0].write(1).unwrap();
    let landed = |shared: &Shared| {
        let mut b = vec![0u8; LEN];
        shared
            .mem
            .read_slice(&mut b, GuestAddress(MEM_GPA))
            .unwrap();
        b.iter().filter(|&&x| x == 0x77).count()
    };
    wait_until(&h, "the read landing", || landed(&shared) > 0);
    let before = landed(&shared);
    println!("landed {before} of {LEN} after {:?}", t.elapsed());
    let kick = Reset::Rings.apply(&mut raw, &shared);
    shared.post_slot(sq, 0, &queue::request_slot(&nop(0xB0), 0));
    raw.kicks[kick].write(1).unwrap();
    assert_eq!(wait_completion(&h, &shared, cq, 0).user_data, 0xB0);
    shared
        .mem
        .write_slice(&vec![0u8; LEN], GuestAddress(MEM_GPA))
        .unwrap();
    wait_until(&h, "the old READ ended", || {
        h.dev.fabric_status().n("failed") + h.dev.fabric_status().n("completed") >= 1
    });
    std::thread::sleep(Duration::from_millis(200));
    let after = landed(&shared);
    println!(
        "after the restart: {after} bytes of the old READ landed; fabric {:?}",
        h.dev.fabric_status()
    );
    assert!(shared.completion(cq, 1).is_none(), "a second completion");
    assert_eq!(
        after, 0,
        "the old driver's READ went on writing the port's memory after the reset"
    );
    h.after("reset with a read on the link", Some(raw));
}

/// Restarts and reconfigurations of running RDMA queues, fast and at
/// awkward moments (a long transfer into port 3 running, the completion
/// queue full): the device stays healthy, and after a last reset the
/// restarted queue gets only its own completions and the old transfers
/// write port 3 no more.
#[test]
fn a_storm_of_restarts_and_reconfigurations() {
    let mut h = Harness::start(&[]);
    let (shared, mut raw) = rdma_frontend(&h);
    let (sq, cq) = (RAW_SQ, RAW_CQ);
    let mut rng = Rng(0x1234_5678);
    let long = long_write(&h, &shared, 0xA1, 0x100, 0x5A);
    let mut kick = 0usize;
    let mut pos = 0u16;
    for round in 0..300u32 {
        // Post a few requests (long writes and NOPs), kick, act at once.
        for _ in 0..(rng.next() % 4) {
            let wr = if rng.next().is_multiple_of(2) {
                long
            } else {
                nop(0xC000 + u64::from(round))
            };
            shared.post_slot(sq, pos, &queue::request_slot(&wr, pos));
            pos = pos.wrapping_add(1);
        }
        raw.kicks[kick].write(1).unwrap();
        if rng.next().is_multiple_of(3) {
            std::thread::sleep(Duration::from_micros(rng.next() % 3000));
        }
        let ring = if rng.next().is_multiple_of(4) { cq } else { sq };
        let at = |off: u64| shared.host + Shared::ring_base(ring) + off;
        match rng.next() % 8 {
            0 => {
                kick = Reset::Rings.apply(&mut raw, &shared);
                pos = 0;
            }
            1 => {
                raw.ok(
                    code(FrontendReq::SET_VRING_ENABLE),
                    &payload::vring_state(ring, 0),
                    &[],
                );
                raw.ok(
                    code(FrontendReq::SET_VRING_ENABLE),
                    &payload::vring_state(ring, 1),
                    &[],
                );
            }
            2 => {
                let base = (rng.next() % 64) as u32;
                raw.ok(
                    code(FrontendReq::SET_VRING_BASE),
                    &payload::vring_state(ring, base),
                    &[],
                );
            }
            3 => {
                let num = [1u32, 2, 4, 8, 16][(rng.next() % 5) as usize];
                raw.ok(
                    code(FrontendReq::SET_VRING_NUM),
                    &payload::vring_state(ring, num),
                    &[],
                );
            }
            4 => {
                raw.ok(
                    code(FrontendReq::SET_VRING_ADDR),
                    &payload::vring_addr(ring, 0, at(0), at(0x2000), at(0x1000)),
                    &[],
                );
            }
            5 => {
                // The kick fd replaced while running.
                raw.kick_fd(ring);
                if ring == sq {
                    kick = raw.kicks.len() - 1;
                }
            }
            6 => {
                // Consume everything there is.
                shared.consumed(cq, (rng.next() % 0x10000) as u16);
            }
            _ => {
                raw.stop_ring(ring);
                raw.ok(
                    code(FrontendReq::SET_VRING_NUM),
                    &payload::vring_state(ring, u32::from(QSZ)),
                    &[],
                );
                raw.kick_fd(ring);
                raw.ok(
                    code(FrontendReq::SET_VRING_ENABLE),
                    &payload::vring_state(ring, 1),
                    &[],
                );
                if ring == sq {
                    kick = raw.kicks.len() - 1;
                }
            }
        }
        assert!(h.dev.alive(), "round {round}: {}", h.dev.log());
    }
    // Sizes back to QSZ, then a last reset.
    for ring in [sq, cq] {
        raw.ok(
            code(FrontendReq::SET_VRING_NUM),
            &payload::vring_state(ring, u32::from(QSZ)),
            &[],
        );
    }
    let kick = Reset::Rings.apply(&mut raw, &shared);
    std::thread::sleep(Duration::from_millis(50));
    h.target.write_at(0, &[0u8; RDMA_BYTES]);
    shared.post_slot(sq, 0, &queue::request_slot(&nop(0xB0), 0));
    raw.kicks[kick].write(1).unwrap();
    assert_eq!(wait_completion(&h, &shared, cq, 0).user_data, 0xB0);
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        shared.completion(cq, 1).is_none(),
        "a completion after the NOP"
    );
    assert!(
        target_filled_with(&h, 0),
        "an old transfer went on writing port 3"
    );
    assert_eq!(in_flight_of(&h, sq), 0, "requests in flight");
    h.after("a storm of restarts", Some(raw));
}

/// A send queue stopped as unusable (slots misaligned) and set right
/// again "goes on where it stood" (README, and
/// `rdma_queues_the_device_cannot_use_are_stopped_and_can_be_set_again`):
/// the completion that waited for room in the full completion queue
/// meanwhile still comes, before the next request's.
#[test]
fn a_queue_set_right_again_keeps_the_completion_that_waited_for_room() {
    let mut h = Harness::start(&[]);
    let (shared, mut raw) = rdma_frontend(&h);
    let (sq, cq) = (RAW_SQ, RAW_CQ);
    let old = fill_the_completion_queue(&h, &shared, &raw);

    break_the_send_queue(&h, &shared, &mut raw);
    set_the_send_queue_right(&shared, &mut raw);
    shared.post_slot(sq, old, &queue::request_slot(&nop(0xB000), old));
    raw.kicks[0].write(1).unwrap();
    // The driver consumes the full ring and kicks the completion queue.
    shared.consumed(cq, QSZ);
    raw.kicks[1].write(1).unwrap();
    let first = wait_completion(&h, &shared, cq, QSZ).user_data;
    assert_eq!(
        first,
        0xA000 + u64::from(QSZ),
        "the completion at {QSZ}, after the queue was set right"
    );
    assert_eq!(wait_completion(&h, &shared, cq, QSZ + 1).user_data, 0xB000);
    h.after(
        "queue set right with a completion waiting for room",
        Some(raw),
    );
}

/// A fenced request waits behind a write held on the link when the
/// queues are reset: it never completes, and the restarted queue's own
/// fenced request does not wait for the old write.
#[test]
fn a_reset_while_fenced() {
    let (mut h, _silent) = harness_with_a_silent_node();
    let (shared, mut raw) = rdma_frontend(&h);
    let (sq, cq) = (RAW_SQ, RAW_CQ);
    let held = write_to_the_silent_node(0xA1);
    let fenced = |user_data| pindown_uapi::WorkRequest {
        user_data,
        flags: pindown_uapi::WrFlags::SIGNALED | pindown_uapi::WrFlags::FENCE,
        op: pindown_uapi::Operation::Nop,
    };
    shared.post_slot(sq, 0, &queue::request_slot(&held, 0));
    shared.post_slot(sq, 1, &queue::request_slot(&fenced(0xA2), 1));
    raw.kicks[0].write(1).unwrap();
    wait_until(&h, "both taken", || shared.head(sq) == 2);
    std::thread::sleep(Duration::from_millis(50));
    assert!(shared.completion(cq, 0).is_none(), "the fenced NOP waits");
    let kick = Reset::Rings.apply(&mut raw, &shared);
    shared.post_slot(sq, 0, &queue::request_slot(&fenced(0xB0), 0));
    raw.kicks[kick].write(1).unwrap();
    assert_eq!(wait_completion(&h, &shared, cq, 0).user_data, 0xB0);
    wait_until(&h, "the held write failed", || {
        h.dev.fabric_status().n("failed") >= 1
    });
    std::thread::sleep(Duration::from_millis(200));
    assert!(shared.completion(cq, 1).is_none(), "an old completion");
    shared.post_slot(sq, 1, &queue::request_slot(&fenced(0xB1), 1));
    raw.kicks[kick].write(1).unwrap();
    assert_eq!(wait_completion(&h, &shared, cq, 1).user_data, 0xB1);
    assert_eq!(in_flight_of(&h, sq), 0);
    h.after("reset while fenced", Some(raw));
}

/// A send queue broken by its frontend (slots misaligned) while a long
/// transfer runs, then set right again where it stood: the transfer goes
/// on and completes, every byte in port 3.
#[test]
fn a_queue_broken_mid_transfer_and_set_right_again_finishes_the_transfer() {
    let mut h = Harness::start(&[]);
    let (shared, mut raw) = rdma_frontend(&h);
    let (sq, cq) = (RAW_SQ, RAW_CQ);
    h.target.write_at(0, &[0u8; RDMA_BYTES]);
    let long = long_write(&h, &shared, 0xA1, 0x800, 0x5A);
    shared.post_slot(sq, 0, &queue::request_slot(&long, 0));
    raw.kicks[0].write(1).unwrap();
    wait_until(&h, "the transfer moving bytes", || {
        target_filled_with(&h, 0x5A)
    });
    break_the_send_queue(&h, &shared, &mut raw);
    assert!(
        shared.completion(cq, 0).is_none(),
        "the transfer had ended already"
    );
    set_the_send_queue_right(&shared, &mut raw);
    raw.kicks[0].write(1).unwrap();
    let done = wait_completion(&h, &shared, cq, 0);
    assert_eq!(
        (done.user_data, done.status),
        (0xA1, Status::Success),
        "the transfer's completion: {done:?}"
    );
    h.after("queue broken mid-transfer and set right", Some(raw));
}

/// SET_VRING_ADDR of the send queue [`RAW_SQ`] with its slots `skew`
/// bytes past where they are.
fn set_send_queue_slots(shared: &Shared, raw: &mut Raw, skew: u64) {
    let base = shared.host + Shared::ring_base(RAW_SQ);
    raw.ok(
        code(FrontendReq::SET_VRING_ADDR),
        &payload::vring_addr(RAW_SQ, 0, base + skew, base + 0x2000, base + 0x1000),
        &[],
    );
}

/// Breaks the send queue [`RAW_SQ`]: its slots moved off their 64-byte
/// alignment, and a kick; waits for the device to report it broken.
fn break_the_send_queue(h: &Harness, shared: &Shared, raw: &mut Raw) {
    set_send_queue_slots(shared, raw, 16);
    raw.kicks[0].write(1).unwrap();
    wait_log(h, 1);
}

/// Sets the broken send queue [`RAW_SQ`] right again where it stood.
fn set_the_send_queue_right(shared: &Shared, raw: &mut Raw) {
    set_send_queue_slots(shared, raw, 0);
}
