//! Stock Linux guests on the device: two QEMU 7.2 guests (TCG, q35,
//! intel-iommu with device IOTLB, virtio-net-pci with `iommu_platform=on`)
//! share one emu-device process. Their virtio-net drivers bring the link up;
//! they ping each other, move a few MiB with busybox `nc` (checksums
//! compared), use two queue pairs, survive a peer killed mid-flood, and
//! take a restarted guest back and a guest rebooted inside QEMU.
//!
//! The guests are built and started by `tools/guest/` through the shared
//! harness (`common::guest`): each guest prints `PINDOWN-RESULT key=value
//! ...` lines to its serial console, a file the test reads. A missing tool,
//! a guest past its time limit or a QEMU that refuses the device fails the
//! test (see the harness for the policy); nothing is skipped.

mod common;

use std::time::{Duration, Instant};

use common::guest::{kit, Bed, GuestSpec};

/// Bytes each transfer moves (the guests' `pindown.size` is in MiB).
const TRANSFER_MIB: u64 = 4;

/// A device with one socket; its guests boot the plain network kit.
fn bed() -> Bed {
    Bed::new(kit("net", &[], &[]), 1, &[])
}

/// A guest of this file: moves [`TRANSFER_MIB`] MiB when it sends.
fn guest(name: &'static str, host: u8, run: &'static str) -> GuestSpec {
    let mut spec = GuestSpec::new(name, host, run);
    spec.args.push(format!("size={TRANSFER_MIB}"));
    spec
}

/// Checks a ping result: answered, all 5 of the follow-up pings too.
fn check_ping(bed: &mut Bed, g: usize) {
    let r = bed.wait(g, "ping");
    let received = bed.guests[g].get("received");
    bed.check(
        r == "ok" && received.as_deref() == Some("5"),
        &format!("{}: ping={r} received={received:?}", bed.guests[g].name),
    );
}

/// Checks that `from` sent TRANSFER_MIB MiB that `to` received intact.
fn check_transfer(bed: &mut Bed, from: usize, to: usize) {
    let sent = bed.wait(from, "send_sha256");
    let got = bed.wait(to, "recv_sha256");
    let bytes = bed.wait(to, "recv_bytes");
    let send = bed.wait(from, "send");
    bed.check(send == "ok", &format!("send={send}"));
    bed.check(
        bytes == (TRANSFER_MIB << 20).to_string(),
        &format!("received {bytes} bytes"),
    );
    bed.check(
        sent == got,
        &format!("checksums differ: sent {sent}, got {got}"),
    );
}

#[test]
fn two_guests_ping_and_transfer() {
    let mut bed = bed();
    let a = bed.start(&guest("guest-a", 1, "ping,send,stats"));
    let b = bed.start(&guest("guest-b", 2, "ping,recv,stats"));

    for g in [a, b] {
        let boot = bed.wait(g, "boot");
        bed.check(boot == "ok", "boot failed");
    }
    check_ping(&mut bed, a);
    check_ping(&mut bed, b);
    check_transfer(&mut bed, a, b);
    bed.wait_done(a);
    bed.wait_done(b);

    // The device saw the traffic both ways, through the device IOTLB: the
    // rings and buffers were asked for (MISS), updated, and invalidated
    // (iommu=strict unmaps every buffer after use).
    let frames = (TRANSFER_MIB << 20) / 1500;
    bed.check(
        bed.port(0, "tx_frames") >= frames && bed.port(1, "rx_frames") >= frames,
        "the transfer's frames went through ports 0 and 1",
    );
    bed.check(
        bed.port(1, "tx_frames") > 0 && bed.port(0, "rx_frames") > 0,
        "acks went back",
    );
    for p in 0..2 {
        for key in ["iotlb_misses_sent", "iotlb_updates", "iotlb_invalidates"] {
            bed.check(bed.port(p, key) > 0, &format!("port {p}: no {key}"));
        }
        bed.check(bed.port(p, "errors") == 0, &format!("port {p}: errors"));
        bed.check(
            bed.port(p, "tx_errors") == 0,
            &format!("port {p}: tx errors"),
        );
        bed.check(
            bed.port(p, "features") & pindown_uapi::features::ACCESS_PLATFORM != 0,
            "ACCESS_PLATFORM negotiated",
        );
    }
}

#[test]
fn multiqueue_guest_uses_both_pairs() {
    let mut bed = bed();
    // Two vCPUs: the driver enables one queue pair per CPU; the sender runs
    // on CPU 1, so frames leave through the second pair too.
    let mut spec = guest("guest-mq", 1, "queues,ping,send,stats");
    spec.smp = 2;
    spec.args.push("cpu=1".into());
    let a = bed.start(&spec);
    let b = bed.start(&guest("guest-b", 2, "ping,recv,stats"));

    let rxq = bed.wait(a, "rx_queues");
    let txq = bed.wait(a, "tx_queues");
    bed.check(
        rxq == "2" && txq == "2",
        &format!("queues: rx={rxq} tx={txq}"),
    );
    check_ping(&mut bed, a);
    check_ping(&mut bed, b);
    check_transfer(&mut bed, a, b);
    bed.wait_done(a);
    bed.wait_done(b);

    let st = bed.dev.port(0);
    bed.check(
        st.n("features") & pindown_uapi::features::NET_MQ != 0,
        "VIRTIO_NET_F_MQ negotiated",
    );
    let pairs: Vec<u64> = st
        .text("tx_pair")
        .unwrap_or("")
        .split(',')
        .filter_map(|v| v.parse().ok())
        .collect();
    let total: u64 = pairs.iter().sum();
    bed.check(
        pairs.len() >= 2 && pairs[1] > 0 && total >= (TRANSFER_MIB << 20) / 1500,
        &format!("frames per tx pair of the MQ guest: {pairs:?}"),
    );
}

#[test]
fn killed_guest_leaves_the_other_port_working() {
    let mut bed = bed();
    let a = bed.start(&guest("guest-a", 1, "hold"));
    let b = bed.start(&guest("guest-b", 2, "ping,flood"));
    bed.wait(a, "hold");
    check_ping(&mut bed, b);
    bed.wait(b, "flood");

    // Kill B's QEMU in the middle of its ping flood.
    let rx_before = bed.port(0, "rx_frames");
    let deadline = Instant::now() + Duration::from_secs(30);
    while bed.port(0, "rx_frames") < rx_before + 20 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    bed.check(
        bed.port(0, "rx_frames") >= rx_before + 20,
        "the flood reaches guest A",
    );
    bed.guests[b].kill();
    let gone = bed
        .dev
        .wait_for(Duration::from_secs(10), |s| s[1].n("connected") == 0);
    bed.check(gone, "the device noticed guest B's death");
    bed.check(bed.port(0, "connected") == 1, "guest A's port stays up");

    // A restarted guest takes port 1 again and reaches A, whose port kept
    // working all along.
    let b2 = bed.start(&guest("guest-b2", 2, "ping,stats"));
    check_ping(&mut bed, b2);
    bed.wait_done(b2);
    let a_alive = bed.guests[a].exited().is_none();
    bed.check(a_alive, "guest A is still running");
    bed.check(
        bed.port(1, "connections") == 2,
        "the restarted guest took port 1 again",
    );
    for p in 0..2 {
        bed.check(bed.port(p, "errors") == 0, &format!("port {p}: errors"));
    }
}

#[test]
fn rebooted_guest_gets_its_network_back() {
    let mut bed = bed();
    let a = bed.start(&guest("guest-a", 1, "hold"));
    // B pings, reboots inside QEMU (the device sees the rings stopped with
    // GET_VRING_BASE and set up again), and pings once more after the boot.
    let mut spec = guest("guest-b", 2, "ping,reboot");
    spec.reboot = true;
    let b = bed.start(&spec);
    bed.wait(a, "hold");
    check_ping(&mut bed, b);
    bed.wait(b, "reboot");
    let boot = bed.wait_nth(b, "boot", 1);
    bed.check(boot == "ok", "guest B booted again");
    let again = bed.wait_nth(b, "ping", 1);
    let received = bed.guests[b].nth("received", 1);
    bed.check(
        again == "ok" && received.as_deref() == Some("5"),
        &format!("after the reboot: ping={again} received={received:?}"),
    );
    // The init runs its actions again after every boot: stop B here.
    bed.guests[b].kill();
    bed.check(
        bed.port(1, "connections") == 1,
        "the reboot kept B's connection",
    );
    for p in 0..2 {
        bed.check(bed.port(p, "errors") == 0, &format!("port {p}: errors"));
    }
}

/// The README's guest quick start, as written: `tools/guest/two-guests.sh`
/// boots two guests on one device; they ping each other and move bytes
/// that must arrive intact.
#[test]
fn the_quick_start_script_boots_two_guests_that_exchange_bytes() {
    common::guest::require_qemu();
    let _one_bed_at_a_time = common::guest::serial();
    kit("net", &[], &[]);
    let output =
        std::process::Command::new(common::guest::repo_root().join("tools/guest/two-guests.sh"))
            .arg(TRANSFER_MIB.to_string())
            .env("PINDOWN_EMU_DEVICE", common::device_bin())
            .output()
            .expect("run tools/guest/two-guests.sh");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(output.status.success(), "{text}");
    let sums: Vec<&str> = text
        .lines()
        .filter_map(|l| {
            l.trim().split(' ').find_map(|w| {
                w.strip_prefix("send_sha256=")
                    .or(w.strip_prefix("recv_sha256="))
            })
        })
        .collect();
    assert_eq!(sums.len(), 2, "{text}");
    assert_eq!(sums[0], sums[1], "{text}");
    assert!(
        text.contains(&format!("recv_bytes={}", TRANSFER_MIB << 20)),
        "{text}"
    );
}
