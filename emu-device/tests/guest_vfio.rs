//! The driver inside a QEMU guest: `pindown-guest` binds the guest's
//! virtio-net function to vfio-pci and drives the device's RDMA queues over
//! the VFIO virtio-pci transport, against a window of a host-side driver on
//! another port of the same device process, and against a window of a
//! second guest (both ports offered to QEMU).
//!
//! The guest is built by tools/guest/build-initramfs.sh (with the VFIO
//! modules and the `pindown-guest` binary) and started by
//! tools/guest/run-guest.sh with `queues=P+1` (QEMU forwards the RDMA rings
//! as its last queue pair) and a 48-bit guest IOMMU (identity IOVAs). Its
//! console goes to a file; a guest that does not finish in time is killed
//! and the test fails with its console log.
//!
//! Skipped (with a message) when QEMU or the guest kernel is not installed,
//! or when the device does not offer the RDMA pair to QEMU: QEMU refuses
//! `queues=P+1` when the backend's GET_QUEUE_NUM answers `P` ("you are
//! asking more queues than supported") and retries forever.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use pindown_driver::verbs::{Context, ContextConfig};
use uapi::Access;

/// How long a guest may take from start to power-off (TCG is slow).
const GUEST_TIMEOUT: Duration = Duration::from_secs(240);
/// Net queue pairs of the device; QEMU gets one more.
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

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_owned()
}

fn have_tools() -> bool {
    let qemu = Command::new("qemu-system-x86_64")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    let kernel = std::fs::read_dir("/boot").is_ok_and(|dir| {
        dir.flatten().any(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.starts_with("vmlinuz-") && name.ends_with("-cloud-amd64")
        })
    });
    if !qemu || !kernel {
        eprintln!(
            "SKIPPED: needs qemu-system-x86, linux-image-cloud-amd64 and busybox-static \
             (tools/guest/install-deps.sh)"
        );
    }
    qemu && kernel
}

/// The `pindown-guest` binary: next to emu-device when the workspace was
/// built, else built now into a target directory of its own.
fn guest_binary() -> PathBuf {
    let beside = Path::new(env!("CARGO_BIN_EXE_emu-device")).with_file_name("pindown-guest");
    if beside.exists() {
        return beside;
    }
    let target = root().join("target/guest-bin");
    let status = Command::new(env!("CARGO"))
        .current_dir(root())
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

/// Builds the initramfs (once per test binary run) into `dir`.
fn initramfs(dir: &Path) {
    let out = Command::new(root().join("tools/guest/build-initramfs.sh"))
        .arg("--out")
        .arg(dir)
        .arg("--bin")
        .arg(guest_binary())
        .args(["--module", "vfio-pci", "--module", "vfio_iommu_type1"])
        .arg("--no-install")
        .output()
        .expect("run build-initramfs.sh");
    assert!(
        out.status.success(),
        "build-initramfs.sh failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

struct Guest {
    child: Child,
    log: PathBuf,
    stderr: PathBuf,
}

impl Drop for Guest {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

enum Outcome {
    /// The guest finished; its console log.
    Done(String),
    /// QEMU refused the configuration; its error output.
    Refused(String),
}

impl Guest {
    fn start(dir: &Path, socket: &Path, name: &str, args: &[String]) -> Guest {
        let log = dir.join(format!("{name}.console.log"));
        let stderr = dir.join(format!("{name}.qemu.log"));
        let _ = std::fs::remove_file(&log);
        let mut cmd = Command::new(root().join("tools/guest/run-guest.sh"));
        cmd.arg("--socket")
            .arg(socket)
            .arg("--log")
            .arg(&log)
            .arg("--dir")
            .arg(dir)
            .args(["--queues", &(PAIRS + 1).to_string(), "--aw-bits", "48"])
            .args(["--run", "vfio", "--mem", "256M"]);
        for arg in args {
            cmd.args(["--arg", arg]);
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .spawn()
            .expect("start run-guest.sh");
        Guest { child, log, stderr }
    }

    /// The console so far, up to its last complete line (QEMU may be in
    /// the middle of writing the next one).
    fn console(&self) -> String {
        let mut text = std::fs::read_to_string(&self.log).unwrap_or_default();
        text.truncate(text.rfind('\n').map_or(0, |end| end + 1));
        text
    }

    /// Waits for the guest to finish (`PINDOWN-RESULT done=`) or QEMU to
    /// exit; kills it at the time bound and fails with the console.
    fn finish(&mut self, timeout: Duration) -> Outcome {
        self.wait_for("PINDOWN-RESULT done=", timeout)
    }

    /// Waits until the console contains `needle`; QEMU exiting first or
    /// the time bound passing fails with the console.
    fn wait_for(&mut self, needle: &str, timeout: Duration) -> Outcome {
        let start = Instant::now();
        loop {
            let console = self.console();
            if console.contains(needle) {
                return Outcome::Done(console);
            }
            let errors = std::fs::read_to_string(&self.stderr).unwrap_or_default();
            // QEMU keeps reconnecting after this refusal instead of exiting.
            if errors.contains("more queues than supported") {
                let _ = self.child.kill();
                let _ = self.child.wait();
                return Outcome::Refused(errors);
            }
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("QEMU exited ({status}) early\nqemu: {errors}\nconsole:\n{console}");
            }
            if start.elapsed() > timeout {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!(
                    "guest did not finish within {timeout:?}\nqemu: {}\nconsole:\n{}",
                    std::fs::read_to_string(&self.stderr).unwrap_or_default(),
                    self.console()
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// Starts the device with ports `guests` offered to guests (one extra pair
/// each) and the others for host-side drivers.
fn device(guests: &[u16]) -> DeviceProcess {
    let pairs = PAIRS.to_string();
    let mut args = vec!["--queue-pairs".to_string(), pairs];
    for port in guests {
        args.extend(["--guest-port".to_string(), port.to_string()]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    DeviceProcess::start(device_bin(), 2, &args).unwrap()
}

/// The device (see [`device`]) and a folder in its directory holding the
/// guest's kernel and initramfs.
fn device_with_guest_files(guests: &[u16]) -> (DeviceProcess, PathBuf) {
    let dev = device(guests);
    let dir = dev.dir().join("guest");
    std::fs::create_dir_all(&dir).unwrap();
    initramfs(&dir);
    (dev, dir)
}

/// The value of the console's `PINDOWN-RESULT key=value` line.
fn result_value(console: &str, key: &str) -> Option<String> {
    console
        .lines()
        .filter_map(|l| l.split_once("PINDOWN-RESULT "))
        .flat_map(|(_, kv)| kv.split_whitespace())
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
        .map(str::to_owned)
}

/// Checks the console of a guest that ran the `rdma` role to the end.
fn check_rdma_console(console: &str, device_log: &str) {
    assert!(
        console.contains("PINDOWN-GUEST PASS") && console.contains("PINDOWN-RESULT vfio=ok"),
        "guest failed:\n{console}\ndevice:\n{device_log}"
    );
    for step in [
        "read 8192 bytes verified",
        "write 12288 bytes verified",
        "atomics verified",
        "out-of-window write and read refused",
    ] {
        assert!(console.contains(step), "missing {step:?}:\n{console}");
    }
}

fn skip_refused(outcome: Outcome) -> Option<String> {
    match outcome {
        Outcome::Done(console) => Some(console),
        Outcome::Refused(errors) => {
            eprintln!(
                "SKIPPED: the device does not offer its RDMA rings to QEMU as an extra queue \
                 pair (GET_QUEUE_NUM must count P + 1 on guest ports): {}",
                errors.lines().next().unwrap_or_default()
            );
            None
        }
    }
}

#[test]
fn guest_driver_writes_reads_and_atomics_over_vfio() {
    if !have_tools() {
        return;
    }
    let (dev, dir) = device_with_guest_files(&[0]);

    // The host side: a window in the middle of a buffer, filled with the
    // pattern; markers around it.
    let host = Context::open(
        dev.socket(1),
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

    let mut guest = Guest::start(
        &dir,
        &dev.socket(0),
        "rdma",
        &["role=rdma".into(), format!("window={}", window.remote)],
    );
    let Some(console) = skip_refused(guest.finish(GUEST_TIMEOUT)) else {
        return;
    };
    println!("{console}");
    check_rdma_console(&console, &dev.log());

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
    assert_eq!(
        first_difference, None,
        "host memory differs from what the guest's operations should have left"
    );
    let status = dev.port(0);
    assert_eq!(status.n("errors"), 0, "{status:?}\n{}", dev.log());
}

#[test]
fn two_guests_do_rdma_against_each_other_over_vfio() {
    if !have_tools() {
        return;
    }
    let (dev, dir) = device_with_guest_files(&[0, 1]);

    // Guest A owns the window (its `serve` role fills and checks it); it
    // prints the window once bound and then waits for B's done flag.
    let mut owner = Guest::start(&dir, &dev.socket(0), "serve", &["role=serve".into()]);
    let Some(console) = skip_refused(owner.wait_for("PINDOWN-RESULT window=", GUEST_TIMEOUT))
    else {
        return;
    };
    let window = result_value(&console, "window").expect("a window line");
    assert!(
        window.starts_with("0:"),
        "guest A's window is on port 0: {window}"
    );

    let mut peer = Guest::start(
        &dir,
        &dev.socket(1),
        "rdma",
        &["role=rdma".into(), format!("window={window}")],
    );
    let Some(peer_console) = skip_refused(peer.finish(GUEST_TIMEOUT)) else {
        return;
    };
    println!("{peer_console}");
    check_rdma_console(&peer_console, &dev.log());

    let Some(console) = skip_refused(owner.finish(GUEST_TIMEOUT)) else {
        return;
    };
    println!("{console}");
    assert!(
        console.contains("PINDOWN-RESULT serve=ok")
            && console.contains("PINDOWN-GUEST PASS")
            && console.contains("PINDOWN-RESULT vfio=ok"),
        "guest A's buffer is not what B's operations should have left:\n{console}\ndevice:\n{}",
        dev.log()
    );
    for port in 0..2 {
        let status = dev.port(port);
        assert_eq!(status.n("errors"), 0, "{status:?}\n{}", dev.log());
    }
}

#[test]
fn guest_pin_cache_figures_over_vfio() {
    if !have_tools() {
        return;
    }
    let (dev, dir) = device_with_guest_files(&[0]);
    let mut guest = Guest::start(
        &dir,
        &dev.socket(0),
        "pinbench",
        &["role=pinbench".into(), "rounds=256".into()],
    );
    let Some(console) = skip_refused(guest.finish(GUEST_TIMEOUT)) else {
        return;
    };
    assert!(
        console.contains("PINDOWN-GUEST PASS"),
        "guest failed:\n{console}\ndevice:\n{}",
        dev.log()
    );
    let json = console
        .lines()
        .find_map(|l| l.split_once("PINDOWN-GUEST JSON ").map(|(_, j)| j.trim()))
        .expect("a JSON line");
    println!("{json}");
    // Measured, not judged: the figures exist and are consistent.
    for key in [
        "\"verbs_register\"",
        "\"vfio_pinner\"",
        "\"hit_rate\"",
        "\"miss\"",
        "\"hit\"",
    ] {
        assert!(json.contains(key), "{key} missing: {json}");
    }
    assert!(json.starts_with('{') && json.ends_with('}'), "{json}");
}
