//! The fabric link's socket I/O (`internode::batch`) between two network
//! namespaces on a bridge of veth pairs with a 1500-byte MTU: datagrams
//! longer than the path (bridged Ethernet frames) still cross, fragmented
//! by the sender, over IPv4 and over IPv6, and segmented runs of
//! full-size datagrams arrive as the datagrams they were. Needs root (the
//! namespaces), as the other fabric tests do.

use std::fs::File;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use pindown_emu_device::internode::batch::{Outgoing, Received, Wire};
use pindown_emu_device::testing::netns::NetworkNamespaces;

/// The endpoint's largest datagram (1376-byte payload and its header).
const FULL: usize = 1452;

/// Binds a UDP socket to `address` inside the namespace at `netns`.
fn bind_in(netns: &Path, address: SocketAddr) -> UdpSocket {
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                let file = File::open(netns).expect("the namespace's file");
                // SAFETY: setns on this thread alone, with a descriptor of
                // a network namespace that stays open for the call.
                let done = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
                assert_eq!(done, 0, "setns: {}", std::io::Error::last_os_error());
                UdpSocket::bind(address).expect("bind in the namespace")
            })
            .join()
            .expect("the binding thread")
    })
}

fn ip(args: &[&str]) {
    let status = Command::new("ip").args(args).status().expect("ip");
    assert!(status.success(), "ip {args:?}");
}

/// Sends frames longer than the MTU, a segmented run of full-size
/// datagrams and a short one from `sender` to `receiver`; every one must
/// arrive, whole and in order.
fn every_datagram_crosses(sender: UdpSocket, receiver: UdpSocket) {
    let to = receiver.local_addr().unwrap();
    let sender = Wire::new(sender, FULL).unwrap();
    let receiver = Wire::new(receiver, FULL).unwrap();
    let mut sent: Vec<Vec<u8>> = Vec::new();
    sent.extend((0..2u8).map(|i| vec![0xf0 | i; 1600]));
    sent.extend((0..10u8).map(|i| (0..FULL).map(|k| k as u8 ^ i).collect()));
    sent.push(vec![0x5a; 100]);
    let mut out = Outgoing::with_capacity(FULL);
    for datagram in &sent {
        out.push(&sender, to, datagram);
    }
    out.flush(&sender);
    let mut received = Received::with_buffers();
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    while got.len() < sent.len() && Instant::now() < deadline {
        let n = received.receive(&receiver).unwrap();
        for i in 0..n {
            got.push(received.get(i).map(|(bytes, _)| bytes.to_vec()));
        }
        if n == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    let expected: Vec<_> = sent.into_iter().map(Some).collect();
    assert_eq!(got.len(), expected.len(), "datagrams that arrived to {to}");
    assert!(
        got == expected,
        "datagrams to {to} differ or came out of order"
    );
}

#[test]
fn frames_longer_than_the_path_and_segmented_runs_cross_over_ipv4_and_ipv6() {
    let hosts = NetworkNamespaces::create(2)
        .unwrap_or_else(|e| panic!("cannot create 2 network namespaces: {e}"));
    let (a, b) = (hosts.host(0), hosts.host(1));
    for host in [a, b] {
        ip(&["-n", host.name(), "link", "set", "eth0", "mtu", "1500"]);
    }
    // IPv4, the bridge's addresses.
    let sender = bind_in(&a.path(), SocketAddr::new(IpAddr::V4(a.address()), 0));
    let receiver = bind_in(&b.path(), SocketAddr::new(IpAddr::V4(b.address()), 0));
    every_datagram_crosses(sender, receiver);
    // IPv6: addresses of their own on the same links.
    let v6 = |i: u8| -> IpAddr { format!("fd00:201::{i}").parse().unwrap() };
    for (host, i) in [(a, 1), (b, 2)] {
        let cidr = format!("{}/64", v6(i));
        ip(&[
            "-n",
            host.name(),
            "addr",
            "add",
            &cidr,
            "dev",
            "eth0",
            "nodad",
        ]);
    }
    let sender = bind_in(&a.path(), SocketAddr::new(v6(1), 0));
    let receiver = bind_in(&b.path(), SocketAddr::new(v6(2), 0));
    every_datagram_crosses(sender, receiver);
}
