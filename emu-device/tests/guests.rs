//! Stock Linux guests on the device: two QEMU 7.2 guests (TCG, q35,
//! intel-iommu with device IOTLB, virtio-net-pci with `iommu_platform=on`)
//! share one emu-device process. Their virtio-net drivers bring the link up;
//! they ping each other, move a few MiB with busybox `nc` (checksums
//! compared), use two queue pairs, survive a peer killed mid-flood, and
//! take a restarted guest back and a guest rebooted inside QEMU.
//!
//! The guests are built and started by `tools/guest/` (build-initramfs.sh,
//! run-guest.sh, init). Each guest prints `PINDOWN-RESULT key=value ...`
//! lines to its serial console, a file the test reads. A guest is killed
//! after [`GUEST_LIMIT`] and the test fails showing its console.
//!
//! Skipped (with a printed reason) only when the Debian packages (QEMU, the
//! cloud kernel, busybox-static) are missing and cannot be installed.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use common::*;

/// Longest a guest may live.
const GUEST_LIMIT: Duration = Duration::from_secs(120);
/// Bytes each transfer moves (the guests' `pindown.size` is in MiB).
const TRANSFER_MIB: u64 = 4;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

/// Where the kernel and initramfs are built.
fn kit_dir() -> PathBuf {
    repo_root().join("target").join("guest")
}

/// Builds the initramfs once per test run; `Err` holds the reason to skip.
fn kit() -> Result<&'static Path, String> {
    static KIT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    KIT.get_or_init(|| {
        let script = repo_root().join("tools/guest/build-initramfs.sh");
        let out = Command::new(&script)
            .arg("--out")
            .arg(kit_dir())
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("cannot run {}: {e}", script.display()))?;
        if out.status.success() {
            Ok(kit_dir())
        } else {
            Err(format!(
                "build-initramfs.sh failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            ))
        }
    })
    .as_ref()
    .map(PathBuf::as_path)
    .map_err(Clone::clone)
}

/// Guests are CPU-heavy under TCG on two cores: one test at a time.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Returns the kit, or prints why the test is skipped.
macro_rules! kit_or_skip {
    () => {
        match kit() {
            Ok(k) => k,
            Err(why) => {
                eprintln!("SKIPPED: {why}");
                return;
            }
        }
    };
}

/// How one guest is started.
#[derive(Debug, Clone)]
struct GuestSpec {
    name: &'static str,
    mac: &'static str,
    ip: &'static str,
    peer: &'static str,
    run: &'static str,
    queues: u32,
    smp: u32,
    args: Vec<String>,
    reboot: bool,
}

impl GuestSpec {
    fn new(name: &'static str, host: u8, run: &'static str) -> GuestSpec {
        let (mac, ip, peer) = match host {
            1 => ("52:54:00:00:10:01", "10.10.0.1/24", "10.10.0.2"),
            _ => ("52:54:00:00:10:02", "10.10.0.2/24", "10.10.0.1"),
        };
        GuestSpec {
            name,
            mac,
            ip,
            peer,
            run,
            queues: 2,
            smp: 1,
            args: vec![format!("size={TRANSFER_MIB}")],
            reboot: false,
        }
    }
}

/// A running guest (its QEMU process); killed on drop.
struct Guest {
    name: &'static str,
    child: Child,
    log: PathBuf,
    qemu_log: PathBuf,
    started: Instant,
}

impl Guest {
    fn start(kit: &Path, socket: &Path, dir: &Path, spec: &GuestSpec) -> Guest {
        let log = dir.join(format!("{}.console.log", spec.name));
        let qemu_log = dir.join(format!("{}.qemu.log", spec.name));
        let _ = std::fs::remove_file(&log);
        let mut c = Command::new(repo_root().join("tools/guest/run-guest.sh"));
        c.arg("--socket")
            .arg(socket)
            .arg("--log")
            .arg(&log)
            .arg("--dir")
            .arg(kit)
            .args(["--mac", spec.mac, "--ip", spec.ip, "--peer", spec.peer])
            .args(["--run", spec.run])
            .args(["--queues", &spec.queues.to_string()])
            .args(["--smp", &spec.smp.to_string()]);
        for a in &spec.args {
            c.args(["--arg", a]);
        }
        if spec.reboot {
            c.arg("--reboot");
        }
        let child = c
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&qemu_log).expect("qemu log"))
            .stderr(std::fs::File::create(&qemu_log).expect("qemu log"))
            .spawn()
            .expect("start run-guest.sh");
        Guest {
            name: spec.name,
            child,
            log,
            qemu_log,
            started: Instant::now(),
        }
    }

    /// The console so far, up to its last complete line (QEMU may be in
    /// the middle of writing the next one).
    fn console(&self) -> String {
        let mut text = std::fs::read_to_string(&self.log).unwrap_or_default();
        text.truncate(text.rfind('\n').map_or(0, |end| end + 1));
        text
    }

    /// The guest's result lines so far, as `key=value` maps.
    fn results(&self) -> Vec<HashMap<String, String>> {
        self.console()
            .lines()
            .filter_map(|l| l.split_once("PINDOWN-RESULT "))
            .map(|(_, kv)| {
                kv.split_whitespace()
                    .filter_map(|p| p.split_once('='))
                    .map(|(k, v)| (k.to_string(), v.trim().to_string()))
                    .collect()
            })
            .collect()
    }

    /// The `n`-th (0-based) value of `key` printed so far.
    fn nth(&self, key: &str, n: usize) -> Option<String> {
        self.results()
            .into_iter()
            .filter_map(|m| m.get(key).cloned())
            .nth(n)
    }

    /// The first value of `key`.
    fn get(&self, key: &str) -> Option<String> {
        self.nth(key, 0)
    }

    /// Whether QEMU exited (reaping it).
    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Sends SIGKILL to QEMU and reaps it.
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Everything a failure report needs.
    fn report(&self) -> String {
        format!(
            "--- {} console ({}) ---\n{}\n--- {} qemu ---\n{}",
            self.name,
            self.log.display(),
            self.console(),
            self.name,
            std::fs::read_to_string(&self.qemu_log).unwrap_or_default()
        )
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        self.kill();
    }
}

/// One device and its guests; failures show every console and the
/// device's log.
struct Bed {
    dev: DeviceProcess,
    kit: &'static Path,
    guests: Vec<Guest>,
}

impl Bed {
    fn new(kit: &'static Path) -> Bed {
        let dev = DeviceProcess::start(device_bin(), 1, &[]).expect("start emu-device");
        Bed {
            dev,
            kit,
            guests: Vec::new(),
        }
    }

    /// Starts a guest and waits until the device has a connection for it
    /// (so ports are numbered in start order). Returns its index.
    fn start(&mut self, spec: &GuestSpec) -> usize {
        let before = self.connected();
        let g = Guest::start(self.kit, &self.dev.socket(0), self.dev.dir(), spec);
        self.guests.push(g);
        let ok = self.dev.wait_for(Duration::from_secs(30), |s| {
            s.iter().filter(|p| p.n("connected") == 1).count() > before
        });
        if !ok {
            self.fail(&format!("{} did not connect to the device", spec.name));
        }
        self.guests.len() - 1
    }

    fn connected(&self) -> usize {
        self.dev
            .status()
            .map(|s| s.iter().filter(|p| p.n("connected") == 1).count())
            .unwrap_or(0)
    }

    fn fail(&self, what: &str) -> ! {
        let mut s = format!("{what}\n");
        for g in &self.guests {
            s.push_str(&g.report());
            s.push('\n');
        }
        s.push_str(&format!(
            "--- device status ---\n{:#?}\n--- device log (tail) ---\n{}",
            self.dev
                .status()
                .ok()
                .map(|v| v.into_iter().map(|p| p.fields).collect::<Vec<_>>()),
            tail(&self.dev.log(), 60)
        ));
        panic!("{s}");
    }

    /// Waits until guest `g` printed `key` for the `n`-th time (0-based);
    /// a guest past [`GUEST_LIMIT`] or whose QEMU exited first fails.
    fn wait_nth(&mut self, g: usize, key: &str, n: usize) -> String {
        loop {
            if let Some(v) = self.guests[g].nth(key, n) {
                return v;
            }
            if let Some(st) = self.guests[g].exited() {
                // Read once more: the line may have come just before exit.
                if let Some(v) = self.guests[g].nth(key, n) {
                    return v;
                }
                let name = self.guests[g].name;
                self.fail(&format!("{name} exited ({st}) before printing {key}"));
            }
            if self.guests[g].started.elapsed() > GUEST_LIMIT {
                self.guests[g].kill();
                let name = self.guests[g].name;
                self.fail(&format!(
                    "{name} killed after {GUEST_LIMIT:?} waiting for {key}"
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn wait(&mut self, g: usize, key: &str) -> String {
        self.wait_nth(g, key, 0)
    }

    /// Waits for the guest's `done=1` and for QEMU to exit cleanly.
    fn wait_done(&mut self, g: usize) {
        let done = self.wait(g, "done");
        if done != "1" {
            let name = self.guests[g].name;
            self.fail(&format!("{name} finished with failures (done={done})"));
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(st) = self.guests[g].exited() {
                if !st.success() {
                    let name = self.guests[g].name;
                    self.fail(&format!("{name}: QEMU exited with {st}"));
                }
                return;
            }
            if Instant::now() > deadline {
                let name = self.guests[g].name;
                self.fail(&format!("{name} printed done=1 but did not power off"));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn check(&self, cond: bool, what: &str) {
        if !cond {
            self.fail(what);
        }
    }

    /// A port's counter.
    fn port(&self, index: usize, key: &str) -> u64 {
        self.dev.port(index).n(key)
    }
}

fn tail(s: &str, lines: usize) -> String {
    let v: Vec<&str> = s.lines().collect();
    v[v.len().saturating_sub(lines)..].join("\n")
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
    let _serial = serial();
    let kit = kit_or_skip!();
    let mut bed = Bed::new(kit);
    let a = bed.start(&GuestSpec::new("guest-a", 1, "ping,send,stats"));
    let b = bed.start(&GuestSpec::new("guest-b", 2, "ping,recv,stats"));

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
            bed.port(p, "features") & uapi::features::ACCESS_PLATFORM != 0,
            "ACCESS_PLATFORM negotiated",
        );
    }
}

#[test]
fn multiqueue_guest_uses_both_pairs() {
    let _serial = serial();
    let kit = kit_or_skip!();
    let mut bed = Bed::new(kit);
    // Two vCPUs: the driver enables one queue pair per CPU; the sender runs
    // on CPU 1, so frames leave through the second pair too.
    let mut spec = GuestSpec::new("guest-mq", 1, "queues,ping,send,stats");
    spec.smp = 2;
    spec.args.push("cpu=1".into());
    let a = bed.start(&spec);
    let b = bed.start(&GuestSpec::new("guest-b", 2, "ping,recv,stats"));

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
        st.n("features") & uapi::features::NET_MQ != 0,
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
    let _serial = serial();
    let kit = kit_or_skip!();
    let mut bed = Bed::new(kit);
    let a = bed.start(&GuestSpec::new("guest-a", 1, "hold"));
    let b = bed.start(&GuestSpec::new("guest-b", 2, "ping,flood"));
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
    let b2 = bed.start(&GuestSpec::new("guest-b2", 2, "ping,stats"));
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
    let _serial = serial();
    let kit = kit_or_skip!();
    let mut bed = Bed::new(kit);
    let a = bed.start(&GuestSpec::new("guest-a", 1, "hold"));
    // B pings, reboots inside QEMU (the device sees the rings stopped with
    // GET_VRING_BASE and set up again), and pings once more after the boot.
    let mut spec = GuestSpec::new("guest-b", 2, "ping,reboot");
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
