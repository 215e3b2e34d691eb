//! Stock Linux guests on two nodes of a fabric: each QEMU 7.2 guest (TCG,
//! virtio-net-pci with the device IOTLB) is served by its own device
//! process; the two devices bridge queue pair 0's Ethernet frames over
//! UDP. The guests ping each other and move a few MiB with busybox `nc`
//! (checksums compared), as two guests on one device do (`guests.rs`).

mod common;

use common::guest::{kit, Bed, GuestSpec};
use common::DeviceProcess;

const TOKEN: &str = "9e57f00d";

/// Bytes the transfer moves (the guests' `pindown.size` is in MiB).
const TRANSFER_MIB: u64 = 2;

#[test]
fn guests_on_two_nodes_ping_and_transfer_across_the_fabric() {
    let ports = [common::free_udp_port(), common::free_udp_port()];
    let args = |node| common::fabric_args(node, &ports, TOKEN);
    let zero = args(0);
    let zero: Vec<&str> = zero.iter().map(String::as_str).collect();
    let mut bed = Bed::new(kit("net", &[], &[]), 1, &zero);
    let one = args(1);
    let one: Vec<&str> = one.iter().map(String::as_str).collect();
    let other = DeviceProcess::start(common::device_bin(), 1, &one).expect("start node 1");

    let spec = |name, host, run| {
        let mut spec = GuestSpec::new(name, host, run);
        spec.args.push(format!("size={TRANSFER_MIB}"));
        spec
    };
    let a = bed.start(&spec("guest-a", 1, "ping,send,stats"));
    let b = bed.start_elsewhere(&other, &spec("guest-b", 2, "ping,recv,stats"));
    for g in [a, b] {
        let boot = bed.wait(g, "boot");
        bed.check(boot == "ok", "boot failed");
    }
    for g in [a, b] {
        let r = bed.wait(g, "ping");
        let received = bed.guests[g].get("received");
        bed.check(
            r == "ok" && received.as_deref() == Some("5"),
            &format!("{}: ping={r} received={received:?}", bed.guests[g].name),
        );
    }
    let sent = bed.wait(a, "send_sha256");
    let got = bed.wait(b, "recv_sha256");
    let bytes = bed.wait(b, "recv_bytes");
    bed.check(
        bytes == (TRANSFER_MIB << 20).to_string(),
        &format!("received {bytes} bytes"),
    );
    bed.check(sent == got, &format!("checksums differ: {sent} / {got}"));
    bed.wait_done(a);
    bed.wait_done(b);

    // The frames crossed the fabric both ways, through the two links.
    let frames = (TRANSFER_MIB << 20) / 1500;
    let near = bed.dev.fabric_status();
    let far = other.fabric_status();
    bed.check(
        near.n("frames_sent") >= frames && far.n("frames_received") >= frames,
        &format!("node 0 sent {near:?}; node 1 received {far:?}"),
    );
    bed.check(
        far.n("frames_sent") > 0 && near.n("frames_received") > 0,
        "frames went back from node 1",
    );
}
