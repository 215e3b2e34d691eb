//! The driver inside a QEMU guest: `pindown-guest` binds the guest's
//! virtio-net function to vfio-pci and drives the device's RDMA queues over
//! the VFIO virtio-pci transport, against a window of a host-side driver on
//! another port of the same device process, and against a window of a
//! second guest (both ports offered to QEMU).
//!
//! The guest's initramfs carries the VFIO modules and the `pindown-guest`
//! binary; it is started with `queues=P+2` (QEMU forwards the RDMA admin
//! pair and one I/O pair as its last two queue pairs) and a 48-bit guest
//! IOMMU (identity IOVAs), through the shared harness (`common::guest`). A
//! missing tool, a guest past its time limit, and QEMU refusing
//! `queues=P+2` ("more queues than supported": the device did not count
//! the RDMA pairs in GET_QUEUE_NUM)
//! fail the test; nothing is skipped.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::guest::{kit, repo_root, Bed, GuestSpec};
use pindown_driver::verbs::{Context, ContextConfig};
use pindown_uapi::Access;

/// How long a guest may take from start to power-off (TCG is slow).
const GUEST_TIMEOUT: Duration = Duration::from_secs(240);
/// Net queue pairs of the device; QEMU gets two more (the RDMA admin pair
/// and one I/O pair, `pindown_driver::GUEST_RDMA_QUEUE_PAIRS`).
const PAIRS: u16 = 2;
/// Window placement inside the host buffer (bytes before it stay unreachable).
const WINDOW_OFFSET: usize = 4096;
const WINDOW_LEN: usize = 65536;
const BUFFER_LEN: usize = WINDOW_OFFSET + WINDOW_LEN + 4096;
/// Marker outside the window.
const OUTSIDE: u8 = 0xa5;
/// Window offset of the done flag (`PINDONE!`) the guest's `rdma` role
/// writes last; must match `DONE_AT` in driver/src/bin/pindown-guest.rs.
const DONE_AT: usize = 49152;

/// Must match `pattern` in driver/src/bin/pindown-guest.rs.
fn pattern(offset: u64) -> u8 {
    (offset.wrapping_mul(31) ^ (offset >> 8)) as u8
}

/// Must match `guest_pattern` in driver/src/bin/pindown-guest.rs.
fn guest_pattern(offset: u64) -> u8 {
    (offset.wrapping_mul(7) + 0x5a) as u8
}

/// The `pindown-guest` binary: next to emu-device when the workspace was
/// built, else built now into a target directory of its own.
fn guest_binary() -> PathBuf {
    let beside =
        Path::new(env!("CARGO_BIN_EXE_pindown-emu-device")).with_file_name("pindown-guest");
    if beside.exists() {
        return beside;
    }
    let target = repo_root().join("target/guest-bin");
    let status = Command::new(env!("CARGO"))
        .current_dir(repo_root())
        .args([
            "build",
            "--release",
            "-p",
            "pindown-driver",
            "--bin",
            "pindown-guest",
        ])
        .arg("--target-dir")
        .arg(&target)
        .status()
        .expect("run cargo");
    assert!(status.success(), "building pindown-guest failed");
    target.join("release/pindown-guest")
}

/// A device with two sockets, ports `guests` offered to guests (their RDMA
/// pairs counted as queue pairs) and the others for host-side drivers; its guests boot the
/// VFIO kit.
fn bed(guests: &[u16]) -> Bed {
    let kit = kit("vfio", &[guest_binary()], &["vfio-pci", "vfio_iommu_type1"]);
    let pairs = PAIRS.to_string();
    let mut args = vec!["--queue-pairs".to_string(), pairs];
    for port in guests {
        args.extend(["--guest-port".to_string(), port.to_string()]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Bed::new(kit, 2, &args)
}

/// A guest running `pindown-guest` with `args` (`pindown.KEY=VALUE`).
fn vfio_guest(name: &'static str, args: Vec<String>) -> GuestSpec {
    let mut spec = GuestSpec::new(name, 1, "vfio");
    spec.queues = u32::from(PAIRS + pindown_driver::GUEST_RDMA_QUEUE_PAIRS);
    spec.aw_bits = Some(48);
    spec.limit = GUEST_TIMEOUT;
    spec.args = args;
    spec
}

/// Checks the console of a guest that ran the `rdma` role to the end.
fn check_rdma_console(bed: &Bed, g: usize) {
    let console = bed.guests[g].console();
    bed.check(
        console.contains("PINDOWN-GUEST PASS") && console.contains("PINDOWN-RESULT vfio=ok"),
        "the rdma guest failed",
    );
    for step in [
        "read 8192 bytes verified",
        "write 12288 bytes verified",
        "atomics verified",
        "out-of-window write and read refused",
    ] {
        bed.check(console.contains(step), &format!("missing {step:?}"));
    }
}

#[test]
fn guest_driver_writes_reads_and_atomics_over_vfio() {
    let mut bed = bed(&[0]);

    // The host side: a window in the middle of a buffer, filled with the
    // pattern; markers around it.
    let host = Context::open(
        bed.dev.socket(1),
        ContextConfig {
            arena_bytes: 4 << 20,
            ..ContextConfig::default()
        },
    )
    .expect("host context on port 1");
    let buffer = host.alloc(BUFFER_LEN, 4096).unwrap();
    let mut initial = vec![OUTSIDE; BUFFER_LEN];
    for w in 0..WINDOW_LEN {
        initial[WINDOW_OFFSET + w] = pattern(w as u64);
    }
    buffer.write_at(0, &initial);
    let region = host.register_buffer(&buffer).unwrap();
    let window = host
        .bind_window(
            &region,
            WINDOW_OFFSET as u64,
            WINDOW_LEN as u64,
            Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC,
        )
        .unwrap();

    let g = bed.start(&vfio_guest(
        "rdma",
        vec!["role=rdma".into(), format!("window={}", window.remote())],
    ));
    bed.wait_done(g);
    println!("{}", bed.guests[g].console());
    check_rdma_console(&bed, g);

    // The host's memory: the guest's write landed, the atomics left their
    // result, and nothing else changed (the refused write straddling the
    // window's end included).
    let mut expected = initial;
    for i in 0..12288u64 {
        expected[WINDOW_OFFSET + 16384 + i as usize] = guest_pattern(16384 + i);
    }
    let atomic = WINDOW_OFFSET + 32768;
    expected[atomic..atomic + 8].copy_from_slice(&0x1122_3344_5566_7788u64.to_le_bytes());
    let done = WINDOW_OFFSET + DONE_AT;
    expected[done..done + 8].copy_from_slice(b"PINDONE!");
    let mut now = vec![0u8; BUFFER_LEN];
    buffer.read_at(0, &mut now);
    let first_difference = (0..BUFFER_LEN).find(|&i| now[i] != expected[i]);
    bed.check(
        first_difference.is_none(),
        &format!(
            "host memory differs from what the guest's operations should have left, \
             first at byte {first_difference:?}"
        ),
    );
    bed.check(bed.port(0, "errors") == 0, "port 0: errors");
}

#[test]
fn two_guests_do_rdma_against_each_other_over_vfio() {
    let mut bed = bed(&[0, 1]);

    // Guest A owns the window (its `serve` role fills and checks it); it
    // prints the window once bound and then waits for B's done flag.
    // A lives while B boots and runs.
    let mut spec = vfio_guest("serve", vec!["role=serve".into()]);
    spec.limit = 2 * GUEST_TIMEOUT;
    let owner = bed.start_on(0, &spec);
    let window = bed.wait(owner, "window");
    bed.check(
        window.starts_with("0:"),
        &format!("guest A's window is on port 0: {window}"),
    );

    let mut spec = vfio_guest("rdma", vec!["role=rdma".into(), format!("window={window}")]);
    (spec.mac, spec.ip, spec.peer) = ("52:54:00:00:10:02", "10.10.0.2/24", "10.10.0.1");
    let peer = bed.start_on(1, &spec);
    bed.wait_done(peer);
    println!("{}", bed.guests[peer].console());
    check_rdma_console(&bed, peer);

    bed.wait_done(owner);
    let console = bed.guests[owner].console();
    println!("{console}");
    bed.check(
        console.contains("PINDOWN-RESULT serve=ok")
            && console.contains("PINDOWN-GUEST PASS")
            && console.contains("PINDOWN-RESULT vfio=ok"),
        "guest A's buffer is not what B's operations should have left",
    );
    for port in 0..2 {
        bed.check(
            bed.port(port, "errors") == 0,
            &format!("port {port}: errors"),
        );
    }
}

#[test]
fn guest_pin_cache_figures_over_vfio() {
    let mut bed = bed(&[0]);
    let g = bed.start(&vfio_guest(
        "pinbench",
        vec!["role=pinbench".into(), "rounds=256".into()],
    ));
    bed.wait_done(g);
    let console = bed.guests[g].console();
    bed.check(console.contains("PINDOWN-GUEST PASS"), "the guest failed");
    let Some(json) = console
        .lines()
        .find_map(|l| l.split_once("PINDOWN-GUEST JSON ").map(|(_, j)| j.trim()))
    else {
        bed.fail("no JSON line");
    };
    println!("{json}");
    // Measured, not judged: the figures exist and are consistent.
    for key in [
        "\"verbs_register\"",
        "\"vfio_pinner\"",
        "\"hit_rate\"",
        "\"miss\"",
        "\"hit\"",
    ] {
        bed.check(json.contains(key), &format!("{key} missing: {json}"));
    }
    bed.check(json.starts_with('{') && json.ends_with('}'), json);
}
