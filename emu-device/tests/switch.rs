//! Frames sent on one port's tx ring arrive, byte for byte, in another
//! port's rx buffers.

mod common;

use std::time::Duration;

use common::*;

const A: [u8; 6] = [0x02, 0, 0, 0, 0, 0xa];
const B: [u8; 6] = [0x02, 0, 0, 0, 0, 0xb];
const T: Duration = Duration::from_secs(5);

#[test]
fn frame_travels_from_port0_to_port1() {
    let dev = DeviceProcess::start(device_bin(), 2, &[]).unwrap();
    let mut p0 = TestFrontend::connect(&dev.socket(0), 2);
    let mut p1 = TestFrontend::connect(&dev.socket(1), 2);
    assert!(dev.wait_for(T, |s| s[0].n("connected") == 1 && s[1].n("connected") == 1));

    // Port 1 learns B by sending first (flooded to port 0, which has no rx
    // buffer yet: dropped and counted).
    p1.send(1, 0, &frame([0xff; 6], B, b"hello"));
    assert_eq!(p1.wait_used(1, T), Some((0, 0)));
    assert!(dev.wait_for(T, |s| s[0].n("rx_dropped") == 1));

    p1.post_rx(0, 3);
    let payload: Vec<u8> = (0..200u8).collect();
    let sent = frame(B, A, &payload);
    p0.send(1, 5, &sent);
    assert_eq!(p0.wait_used(1, T), Some((5, 0)), "tx chain returned");

    let (id, len) = p1.wait_used(0, T).expect("frame delivered");
    assert_eq!(id, 3);
    assert_eq!(len as usize, sent.len());
    let got = p1.read_buf(0, 3, len as usize + 4);
    assert_eq!(&got[..HDR], &rx_hdr()[..], "rx header");
    assert_eq!(&got[HDR..len as usize], &sent[HDR..], "frame bytes");
    assert_eq!(
        &got[len as usize..],
        &[0xee; 4],
        "nothing written past the frame"
    );
    assert!(p1.rings[0].call.read().is_ok(), "rx interrupt");

    // A learnt A on port 0: a reply from port 1 goes to port 0 only.
    p0.post_rx(0, 1);
    p1.send(1, 1, &frame(A, B, b"reply"));
    let (id, len) = p0.wait_used(0, T).expect("reply delivered");
    assert_eq!(id, 1);
    assert_eq!(
        &p0.read_buf(0, 1, len as usize)[HDR..],
        &frame(A, B, b"reply")[HDR..]
    );

    // GET_VRING_BASE stops the ring and reports the next available index;
    // a stopped ring is not served.
    use vhost::VhostBackend;
    assert_eq!(p0.fe.get_vring_base(1).unwrap(), 1);
    p0.send(1, 6, &frame(B, A, b"after stop"));
    assert_eq!(p0.wait_used(1, Duration::from_millis(200)), None);

    let s = dev.status().unwrap();
    assert_eq!(s[0].n("tx_frames"), 1);
    assert_eq!(s[1].n("tx_frames"), 2);
    assert_eq!(s[1].n("rx_frames"), 1);
    assert_eq!(s[0].n("rx_frames"), 1);
    assert_eq!(s[0].n("errors"), 0);
    assert_eq!(s[1].n("errors"), 0);
}

#[test]
fn too_small_rx_buffer_and_runt_frames_do_not_break_the_port() {
    let dev = DeviceProcess::start(device_bin(), 2, &[]).unwrap();
    let mut p0 = TestFrontend::connect(&dev.socket(0), 2);
    let mut p1 = TestFrontend::connect(&dev.socket(1), 2);

    // Runt: shorter than header + Ethernet header.
    p0.send(1, 0, &[0u8; 10]);
    assert_eq!(p0.wait_used(1, T), Some((0, 0)));
    assert!(dev.wait_for(T, |s| s[0].n("tx_errors") == 1));

    // An rx buffer of 8 bytes cannot hold the frame: returned empty and
    // left untouched beyond.
    p1.mem_fill(0, 2);
    p1.post(0, 2, 8, true);
    p0.send(1, 1, &frame(B, A, &[1; 100]));
    assert_eq!(p1.wait_used(0, T), Some((2, 0)));
    assert_eq!(p1.read_buf(0, 2, 16), vec![0x55; 16]);

    // The port still works.
    p1.post_rx(0, 4);
    p0.send(1, 2, &frame(B, A, &[2; 64]));
    let (id, len) = p1.wait_used(0, T).unwrap();
    assert_eq!(id, 4);
    assert_eq!(
        &p1.read_buf(0, 4, len as usize)[HDR..],
        &frame(B, A, &[2; 64])[HDR..]
    );
}

trait Fill {
    fn mem_fill(&mut self, ring: usize, id: u16);
}

impl Fill for TestFrontend {
    fn mem_fill(&mut self, ring: usize, id: u16) {
        use vm_memory::{Bytes, GuestAddress};
        let a = self.buf(ring, id);
        self.mem
            .write_slice(&[0x55; 0x1000], GuestAddress(a))
            .unwrap();
    }
}

#[test]
fn busy_poll_mode_switches_frames() {
    let dev = DeviceProcess::start(device_bin(), 2, &["--poll"]).unwrap();
    let mut p0 = TestFrontend::connect(&dev.socket(0), 2);
    let mut p1 = TestFrontend::connect(&dev.socket(1), 2);
    p1.post_rx(0, 0);
    let f = frame([0xff; 6], A, b"polled");
    p0.send(1, 0, &f);
    let (id, len) = p1.wait_used(0, T).expect("delivered in poll mode");
    assert_eq!((id, len as usize), (0, f.len()));
    assert_eq!(&p1.read_buf(0, 0, f.len())[HDR..], &f[HDR..]);
}

#[test]
fn rdma_queues_are_accepted_and_kicks_reach_the_send_queue() {
    let dev = DeviceProcess::start(device_bin(), 1, &[]).unwrap();
    // Rings 0..=3: two queue pairs; 4: RDMA send queue; 5: completion queue.
    let mut p0 = TestFrontend::connect(&dev.socket(0), 6);
    assert!(dev.wait_for(T, |s| s[0].n("set_vring_kick") == 6));
    p0.send(4, 0, &[0u8; 64]);
    assert!(dev.wait_for(T, |s| s[0].n("rdma_kicks") >= 1));
    assert_eq!(dev.port(0).n("errors"), 0);
}
