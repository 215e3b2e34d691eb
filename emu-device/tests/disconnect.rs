//! A frontend that dies or misbehaves only resets its own port: the other
//! ports keep working and the socket accepts a new connection.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use common::*;

const A: [u8; 6] = [0x02, 0, 0, 0, 1, 0];
const B: [u8; 6] = [0x02, 0, 0, 0, 1, 1];
const C: [u8; 6] = [0x02, 0, 0, 0, 1, 2];
const T: Duration = Duration::from_secs(5);

fn expect_frame(fe: &mut TestFrontend, id: u16, sent: &[u8]) {
    let (got_id, len) = fe.wait_used(0, T).expect("frame delivered");
    assert_eq!(got_id, id);
    assert_eq!(len as usize, sent.len());
    assert_eq!(&fe.read_buf(0, id, len as usize)[HDR..], &sent[HDR..]);
}

#[test]
fn dead_frontend_resets_only_its_port() {
    let dev = DeviceProcess::start(device_bin(), 3, &[]).unwrap();
    let mut p0 = TestFrontend::connect(&dev.socket(0), 2);
    let mut p1 = TestFrontend::connect(&dev.socket(1), 2);
    let mut p2 = TestFrontend::connect(&dev.socket(2), 2);
    assert!(dev.wait_for(T, |s| s.iter().all(|p| p.n("connected") == 1)));

    // Mid-session: port 2 has buffers posted, then its frontend vanishes.
    p2.post_rx(0, 0);
    p2.send(1, 0, &frame([0xff; 6], C, b"bye"));
    drop(p2);
    assert!(
        dev.wait_for(T, |s| s[2].n("connected") == 0),
        "port 2 reset"
    );

    // Ports 0 and 1 still switch frames.
    p1.post_rx(0, 0);
    let f = frame(B, A, b"still here");
    p0.send(1, 0, &f);
    // The broadcast from port 2 may have reached port 1 first.
    let mut id_len = p1.wait_used(0, T).unwrap();
    if id_len.1 as usize == HDR + 14 + 3 {
        p1.post_rx(0, 1);
        id_len = p1.wait_used(0, T).unwrap();
    }
    assert_eq!(id_len.1 as usize, f.len());
    assert_eq!(&p1.read_buf(0, id_len.0, f.len())[HDR..], &f[HDR..]);

    // Socket 2 takes a new frontend, which is port 2 again.
    let mut p2 = TestFrontend::connect(&dev.socket(2), 2);
    assert!(dev.wait_for(T, |s| s[2].n("connected") == 1
        && s[2].n("connections") == 2));
    p2.post_rx(0, 7);
    let g = frame(C, A, b"welcome back");
    p0.send(1, 1, &g);
    expect_frame(&mut p2, 7, &g);
    let s = dev.status().unwrap();
    assert!(s.iter().all(|p| p.n("errors") == 0), "{s:?}");
}

#[test]
fn two_frontends_on_one_socket_are_two_ports() {
    let dev = DeviceProcess::start(device_bin(), 1, &[]).unwrap();
    let mut p0 = TestFrontend::connect(&dev.socket(0), 2);
    let mut q = TestFrontend::connect(&dev.socket(0), 2);
    assert!(dev.wait_for(T, |s| s.len() == 2
        && s[1].n("connected") == 1
        && s[1].n("socket") == 0));
    q.post_rx(0, 2);
    let f = frame(B, A, b"same socket");
    p0.send(1, 0, &f);
    expect_frame(&mut q, 2, &f);
    drop(q);
    assert!(dev.wait_for(T, |s| s[1].n("connected") == 0));
    assert_eq!(dev.port(0).n("connected"), 1);
}

fn header(request: u32, flags: u32, size: u32) -> Vec<u8> {
    let mut h = request.to_le_bytes().to_vec();
    h.extend_from_slice(&flags.to_le_bytes());
    h.extend_from_slice(&size.to_le_bytes());
    h
}

fn read_reply(s: &mut UnixStream) -> (u32, u32, Vec<u8>) {
    let mut h = [0u8; 12];
    s.read_exact(&mut h).unwrap();
    let w = |i: usize| u32::from_le_bytes(h[i..i + 4].try_into().unwrap());
    let mut body = vec![0u8; w(8) as usize];
    s.read_exact(&mut body).unwrap();
    (w(0), w(4), body)
}

#[test]
fn unknown_requests_are_refused_and_malformed_ones_drop_only_that_connection() {
    let dev = DeviceProcess::start(device_bin(), 2, &[]).unwrap();
    let mut p0 = TestFrontend::connect(&dev.socket(0), 2);

    let mut raw = UnixStream::connect(dev.socket(1)).unwrap();
    raw.set_read_timeout(Some(T)).unwrap();
    // Unknown request asking for a reply: an error reply, connection kept.
    raw.write_all(&header(999, 0x9, 0)).unwrap();
    let (req, flags, body) = read_reply(&mut raw);
    assert_eq!((req, flags & 0x4), (999, 0x4));
    assert_ne!(u64::from_le_bytes(body.try_into().unwrap()), 0);
    // Known request with a short payload and a request for SET_LOG_FD
    // without its fd: refused or dropped, never a crash.
    raw.write_all(&header(1, 0x1, 0)).unwrap();
    let (req, _, body) = read_reply(&mut raw);
    assert_eq!(req, 1);
    assert_ne!(
        u64::from_le_bytes(body.try_into().unwrap()) & pindown_uapi::features::VERSION_1,
        0
    );
    // Garbage: bad version bits. The device drops this connection only.
    raw.write_all(&header(1, 0x3, 0)).unwrap();
    let mut buf = [0u8; 1];
    assert_eq!(raw.read(&mut buf).unwrap_or(0), 0, "connection closed");
    assert!(dev.wait_for(T, |s| s[1].n("connected") == 0));

    // An oversized announced payload also drops only that connection.
    let mut raw = UnixStream::connect(dev.socket(1)).unwrap();
    raw.set_read_timeout(Some(T)).unwrap();
    raw.write_all(&header(2, 0x1, 0x10_0000)).unwrap();
    assert_eq!(raw.read(&mut buf).unwrap_or(0), 0, "connection closed");

    // Port 0 is unaffected: its rings still work (a frame to itself is
    // not delivered, but the tx chain comes back).
    p0.send(1, 0, &frame(A, A, b"loop"));
    assert_eq!(p0.wait_used(1, T), Some((0, 0)));
    let mut p1 = TestFrontend::connect(&dev.socket(1), 2);
    p1.post_rx(0, 0);
    let f = frame([0xff; 6], A, b"broadcast");
    p0.send(1, 1, &f);
    expect_frame(&mut p1, 0, &f);
}

#[test]
fn sigterm_removes_the_sockets() {
    let mut dev = DeviceProcess::start(device_bin(), 2, &[]).unwrap();
    let _p0 = TestFrontend::connect(&dev.socket(0), 2);
    assert!(dev.terminate(T), "clean exit");
    assert!(!dev.socket(0).exists());
    assert!(!dev.socket(1).exists());
    assert!(!dev.control_path().exists());
}
