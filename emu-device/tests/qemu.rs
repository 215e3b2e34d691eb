//! QEMU 7.2 as the frontend: the vhost-user-net handshake completes, the
//! connection stays up, and after QEMU dies the port takes a new QEMU.
//!
//! QEMU starts paused (`-S`, no kernel); it performs the backend handshake
//! at start-up anyway. Skipped (with a message) when `qemu-system-x86_64`
//! is not installed.

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;

const T: Duration = Duration::from_secs(20);

fn qemu_available() -> bool {
    Command::new("qemu-system-x86_64")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

struct Qemu(Child);

impl Drop for Qemu {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_qemu(socket: &Path, iommu: bool, log: &Path) -> Qemu {
    let mut c = Command::new("qemu-system-x86_64");
    c.args(["-M", "q35,accel=tcg", "-cpu", "max", "-m", "128M"])
        .args([
            "-object",
            "memory-backend-memfd,id=mem0,size=128M,share=on",
            "-machine",
            "memory-backend=mem0",
        ])
        .arg("-chardev")
        .arg(format!("socket,id=c0,path={}", socket.display()))
        .args(["-netdev", "vhost-user,id=n0,chardev=c0,queues=2"]);
    if iommu {
        c.args([
            "-device",
            "intel-iommu,intremap=on,caching-mode=on,device-iotlb=on",
            "-device",
            "pcie-root-port,id=rp0,bus=pcie.0,chassis=1",
            "-device",
            "virtio-net-pci,netdev=n0,bus=rp0,mac=52:54:00:12:34:00,mq=on,vectors=0,\
             iommu_platform=on,ats=on,disable-legacy=on",
        ]);
        // intremap=on needs a split irqchip.
        c.args(["-M", "kernel-irqchip=split"]);
    } else {
        c.args([
            "-device",
            "virtio-net-pci,netdev=n0,mac=52:54:00:12:34:00,mq=on,vectors=0",
        ]);
    }
    c.args([
        "-display",
        "none",
        "-nodefaults",
        "-serial",
        "none",
        "-S",
        "-no-reboot",
    ])
    .stdin(Stdio::null())
    .stdout(Stdio::null())
    .stderr(std::fs::File::create(log).unwrap());
    Qemu(c.spawn().expect("start qemu"))
}

fn handshake_then_reconnect(iommu: bool) {
    if !qemu_available() {
        eprintln!("SKIPPED: qemu-system-x86_64 is not installed (apt-get install qemu-system-x86)");
        return;
    }
    let dev = DeviceProcess::start(device_bin(), 1, &[]).unwrap();
    let log = dev.dir().join("qemu.log");
    let mut qemu = start_qemu(&dev.socket(0), iommu, &log);

    // QEMU's start-up handshake, per queue pair: GET_FEATURES,
    // GET/SET_PROTOCOL_FEATURES, GET_QUEUE_NUM, SET_BACKEND_REQ_FD,
    // SET_OWNER, GET_FEATURES, SET_VRING_CALL/ERR per ring; then
    // SET_VRING_ENABLE for the 4 rings.
    let done = dev.wait_for(T, |s| {
        s[0].n("connected") == 1 && s[0].n("set_vring_enable") >= 4
    });
    let qlog = || std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        done,
        "handshake incomplete: {:?}\nqemu: {}\ndevice: {}",
        dev.status(),
        qlog(),
        dev.log()
    );
    let s = dev.port(0);
    assert!(s.n("get_features") >= 2, "{s:?}");
    assert_eq!(s.n("set_backend_req_fd"), 1);
    assert_eq!(s.n("errors"), 0, "{}", dev.log());

    // The connection stays up.
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        qemu.0.try_wait().unwrap().is_none(),
        "qemu died: {}",
        qlog()
    );
    assert_eq!(dev.port(0).n("connected"), 1);
    assert!(!qlog().contains("error"), "qemu complained: {}", qlog());

    // QEMU dies: the port resets and takes a new QEMU.
    drop(qemu);
    assert!(dev.wait_for(T, |s| s[0].n("connected") == 0));
    let _qemu = start_qemu(&dev.socket(0), iommu, &log);
    assert!(
        dev.wait_for(T, |s| s[0].n("connected") == 1
            && s[0].n("connections") == 2
            && s[0].n("set_vring_enable") >= 8),
        "second handshake: {:?}\n{}",
        dev.status(),
        dev.log()
    );
    assert_eq!(dev.port(0).n("errors"), 0);
}

#[test]
fn qemu_handshake_and_reconnect() {
    handshake_then_reconnect(false);
}

#[test]
fn qemu_handshake_with_device_iotlb() {
    handshake_then_reconnect(true);
}
