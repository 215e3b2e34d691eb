//! QEMU 7.2 as the frontend: the vhost-user-net handshake completes, the
//! connection stays up, and after QEMU dies the port takes a new QEMU.
//!
//! QEMU starts paused (`run-guest.sh --paused`, no kernel); it performs the
//! backend handshake at start-up anyway. QEMU comes from
//! `tools/guest/install-deps.sh`; without it the tests fail (see the
//! harness in `common::guest`).

mod common;

use std::time::Duration;

use common::guest::{Bed, GuestSpec};

const T: Duration = Duration::from_secs(20);

fn handshake_then_reconnect(iommu: bool) {
    let mut bed = Bed::paused();
    let mut spec = GuestSpec::new("qemu", 1, "none");
    spec.mem = "128M";
    spec.iommu = iommu;
    let q = bed.start(&spec);

    // QEMU's start-up handshake, per queue pair: GET_FEATURES,
    // GET/SET_PROTOCOL_FEATURES, GET_QUEUE_NUM, SET_BACKEND_REQ_FD,
    // SET_OWNER, GET_FEATURES, SET_VRING_CALL/ERR per ring; then
    // SET_VRING_ENABLE for the 4 rings.
    let done = bed.dev.wait_for(T, |s| {
        s[0].n("connected") == 1 && s[0].n("set_vring_enable") >= 4
    });
    bed.check(done, "handshake incomplete");
    let s = bed.dev.port(0);
    bed.check(s.n("get_features") >= 2, "GET_FEATURES at least twice");
    bed.check(s.n("set_backend_req_fd") == 1, "one SET_BACKEND_REQ_FD");
    bed.check(s.n("errors") == 0, "no failed request");

    // The connection stays up.
    std::thread::sleep(Duration::from_secs(2));
    bed.check_running(q, "while paused");
    bed.check(bed.port(0, "connected") == 1, "still connected");
    let out = bed.guests[q].qemu_output();
    bed.check(!out.contains("error"), "QEMU printed an error");

    // QEMU dies: the port resets and takes a new QEMU.
    bed.guests[q].kill();
    let gone = bed.dev.wait_for(T, |s| s[0].n("connected") == 0);
    bed.check(gone, "the device noticed QEMU's death");
    spec.name = "qemu-again";
    bed.start(&spec);
    let again = bed.dev.wait_for(T, |s| {
        s[0].n("connected") == 1 && s[0].n("connections") == 2 && s[0].n("set_vring_enable") >= 8
    });
    bed.check(again, "second handshake incomplete");
    bed.check(bed.port(0, "errors") == 0, "no failed request");
}

#[test]
fn qemu_handshake_and_reconnect() {
    handshake_then_reconnect(false);
}

#[test]
fn qemu_handshake_with_device_iotlb() {
    handshake_then_reconnect(true);
}
