//! The one harness for the tests that start QEMU (`guests.rs`,
//! `guest_vfio.rs`, `qemu.rs`): what they need and where it comes from,
//! building the guest's initramfs, starting guests through
//! `tools/guest/run-guest.sh`, reading their consoles, and failing with
//! everything a reader needs (every console, QEMU's output, the device's
//! status and log).
//!
//! The policy, the same for every test here:
//! - A test never installs anything and never skips. The tools (QEMU 7.2,
//!   the Debian cloud kernel, busybox-static) come from one place,
//!   `tools/guest/install-deps.sh`, which `.ci/run` runs before any test
//!   and a developer runs once. A missing tool fails the test with a
//!   message naming the tool and that command, under CI (`CI=true`) and
//!   outside it alike.
//! - QEMU refusing what the device offers (for instance "more queues than
//!   supported") is the device's fault: the test fails.
//! - A guest that does not finish within its time limit is killed and the
//!   test fails showing its console.
//! - One guest test runs at a time (TCG guests are CPU-heavy): a [`Bed`]
//!   holds a process-wide lock while it lives.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{device_bin, DeviceProcess};

/// The one command that installs what the guest tests need.
pub const INSTALL: &str = "tools/guest/install-deps.sh";

/// QEMU's messages when it refuses what the device offers; QEMU retries
/// instead of exiting, so the harness looks for them.
const REFUSALS: &[&str] = &["more queues than supported"];

/// Default time a guest may live from start to power-off (TCG is slow).
pub const GUEST_LIMIT: Duration = Duration::from_secs(120);

/// The workspace root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

/// Fails the test: `tool` is missing.
fn missing(tool: &str, package: &str) -> ! {
    let ci = if std::env::var("CI").is_ok_and(|v| v == "true") {
        " CI=true: .ci/run runs it before the tests, so the CI set-up is broken."
    } else {
        ""
    };
    panic!(
        "{tool} is missing (Debian package {package}): run {INSTALL} before the tests \
         (the guest tests never install and never skip).{ci}"
    );
}

/// Fails the test unless `qemu-system-x86_64` runs.
pub fn require_qemu() {
    let ok = Command::new("qemu-system-x86_64")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        missing("qemu-system-x86_64", "qemu-system-x86");
    }
}

/// Fails the test unless QEMU, a Debian cloud kernel with its modules and
/// a static busybox are installed.
pub fn require_guest_tools() {
    require_qemu();
    let kernel = std::fs::read_dir("/lib/modules").is_ok_and(|dir| {
        dir.flatten().any(|e| {
            let kver = e.file_name().to_string_lossy().into_owned();
            kver.ends_with("-cloud-amd64")
                && e.path().join("modules.dep").is_file()
                && Path::new(&format!("/boot/vmlinuz-{kver}")).is_file()
        })
    });
    if !kernel {
        missing(
            "the guest kernel (/boot/vmlinuz-*-cloud-amd64)",
            "linux-image-cloud-amd64",
        );
    }
    let busybox = Command::new("/bin/busybox")
        .arg("true")
        .env_clear()
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !busybox {
        missing("/bin/busybox", "busybox-static");
    }
}

/// The kernel and initramfs of kit `name` (in `target/guest/NAME`), built
/// once per test process by `tools/guest/build-initramfs.sh --no-install`
/// with `bins` and `modules` added. Fails the test when a tool is missing
/// or the build fails.
pub fn kit(name: &str, bins: &[PathBuf], modules: &[&str]) -> &'static Path {
    static KITS: Mutex<Vec<(String, &'static Path)>> = Mutex::new(Vec::new());
    let mut kits = KITS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, dir)) = kits.iter().find(|(n, _)| n == name) {
        return dir;
    }
    require_guest_tools();
    let dir = repo_root().join("target").join("guest").join(name);
    let script = repo_root().join("tools/guest/build-initramfs.sh");
    let mut cmd = Command::new(&script);
    cmd.arg("--out").arg(&dir).arg("--no-install");
    for b in bins {
        cmd.arg("--bin").arg(b);
    }
    for m in modules {
        cmd.args(["--module", m]);
    }
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
    assert!(
        out.status.success(),
        "build-initramfs.sh failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let dir: &'static Path = Box::leak(dir.into_boxed_path());
    kits.push((name.to_string(), dir));
    dir
}

/// How one guest is started (the options of `run-guest.sh`).
#[derive(Debug, Clone)]
pub struct GuestSpec {
    /// Name in logs and failure reports.
    pub name: &'static str,
    /// The NIC's MAC.
    pub mac: &'static str,
    /// The guest's address of eth0.
    pub ip: &'static str,
    /// The other guest's address.
    pub peer: &'static str,
    /// Actions of the guest's `/init`.
    pub run: &'static str,
    /// Queue pairs of the NIC.
    pub queues: u32,
    /// vCPUs.
    pub smp: u32,
    /// Guest memory (QEMU syntax).
    pub mem: &'static str,
    /// IOVA width of the guest IOMMU, when not QEMU's default.
    pub aw_bits: Option<u32>,
    /// A guest IOMMU (intel-iommu, device IOTLB, `iommu_platform=on`).
    pub iommu: bool,
    /// Extra `pindown.KEY=VALUE` kernel arguments.
    pub args: Vec<String>,
    /// Let a reboot inside the guest restart it instead of ending QEMU.
    pub reboot: bool,
    /// Longest the guest may live.
    pub limit: Duration,
}

impl GuestSpec {
    /// Guest `host` (1 or 2) of the 10.10.0.0/24 pair, running `run`.
    pub fn new(name: &'static str, host: u8, run: &'static str) -> GuestSpec {
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
            mem: "256M",
            aw_bits: None,
            iommu: true,
            args: Vec::new(),
            reboot: false,
            limit: GUEST_LIMIT,
        }
    }
}

/// A running QEMU (through `run-guest.sh`, which execs it); killed on drop.
pub struct Guest {
    /// The spec's name.
    pub name: &'static str,
    child: Child,
    log: PathBuf,
    qemu_log: PathBuf,
    started: Instant,
    limit: Duration,
}

impl Guest {
    /// Starts a guest on `socket`; with `kit`, it boots that kernel and
    /// initramfs, without it QEMU starts paused (handshake only). Logs go
    /// to `dir`.
    fn start(kit: Option<&Path>, socket: &Path, dir: &Path, spec: &GuestSpec) -> Guest {
        let log = dir.join(format!("{}.console.log", spec.name));
        let qemu_log = dir.join(format!("{}.qemu.log", spec.name));
        let _ = std::fs::remove_file(&log);
        let mut c = Command::new(repo_root().join("tools/guest/run-guest.sh"));
        c.arg("--socket").arg(socket).arg("--log").arg(&log);
        match kit {
            Some(kit) => c.arg("--dir").arg(kit),
            None => c.arg("--paused"),
        };
        c.args(["--mac", spec.mac, "--ip", spec.ip, "--peer", spec.peer])
            .args(["--run", spec.run, "--mem", spec.mem])
            .args(["--queues", &spec.queues.to_string()])
            .args(["--smp", &spec.smp.to_string()]);
        if let Some(bits) = spec.aw_bits {
            c.args(["--aw-bits", &bits.to_string()]);
        }
        if !spec.iommu {
            c.arg("--no-iommu");
        }
        for a in &spec.args {
            c.args(["--arg", a]);
        }
        if spec.reboot {
            c.arg("--reboot");
        }
        let out = std::fs::File::create(&qemu_log).expect("qemu log");
        let child = c
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("qemu log"))
            .stderr(out)
            .spawn()
            .expect("start run-guest.sh");
        Guest {
            name: spec.name,
            child,
            log,
            qemu_log,
            started: Instant::now(),
            limit: spec.limit,
        }
    }

    /// The console so far, up to its last complete line (QEMU may be in
    /// the middle of writing the next one).
    pub fn console(&self) -> String {
        let mut text = std::fs::read_to_string(&self.log).unwrap_or_default();
        text.truncate(text.rfind('\n').map_or(0, |end| end + 1));
        text
    }

    /// What QEMU printed (its stdout and stderr).
    pub fn qemu_output(&self) -> String {
        std::fs::read_to_string(&self.qemu_log).unwrap_or_default()
    }

    /// The guest's `PINDOWN-RESULT key=value ...` lines so far.
    pub fn results(&self) -> Vec<HashMap<String, String>> {
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
    pub fn nth(&self, key: &str, n: usize) -> Option<String> {
        self.results()
            .into_iter()
            .filter_map(|m| m.get(key).cloned())
            .nth(n)
    }

    /// The first value of `key`.
    pub fn get(&self, key: &str) -> Option<String> {
        self.nth(key, 0)
    }

    /// Whether QEMU exited (reaping it).
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Sends SIGKILL to QEMU and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// QEMU's refusal of the device's offer, if it printed one.
    fn refusal(&self) -> Option<String> {
        let out = self.qemu_output();
        REFUSALS
            .iter()
            .find(|r| out.contains(*r))
            .map(|_| out.clone())
    }

    /// Everything a failure report needs.
    fn report(&self) -> String {
        format!(
            "--- {} console ({}) ---\n{}\n--- {} qemu ---\n{}",
            self.name,
            self.log.display(),
            self.console(),
            self.name,
            self.qemu_output()
        )
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        self.kill();
    }
}

/// One device and its guests; failures show every console, QEMU's output
/// and the device's status and log. One bed at a time per test process.
pub struct Bed {
    /// The device process.
    pub dev: DeviceProcess,
    kit: Option<&'static Path>,
    /// Guests in start order.
    pub guests: Vec<Guest>,
    _serial: MutexGuard<'static, ()>,
}

/// Holds the guest tests of one test binary to one bed at a time.
pub fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

impl Bed {
    /// A device with `sockets` sockets started with `args`, whose guests
    /// boot `kit` (see [`kit`]).
    pub fn new(kit: &'static Path, sockets: usize, args: &[&str]) -> Bed {
        Bed::start_device(Some(kit), sockets, args)
    }

    /// A device with one socket whose guests are QEMUs started paused
    /// (no kernel): they perform the vhost-user handshake only.
    pub fn paused() -> Bed {
        require_qemu();
        Bed::start_device(None, 1, &[])
    }

    fn start_device(kit: Option<&'static Path>, sockets: usize, args: &[&str]) -> Bed {
        let serial = serial();
        let dev = DeviceProcess::start(device_bin(), sockets, args).expect("start emu-device");
        Bed {
            dev,
            kit,
            guests: Vec::new(),
            _serial: serial,
        }
    }

    /// Starts a guest on socket 0; see [`Bed::start_on`].
    pub fn start(&mut self, spec: &GuestSpec) -> usize {
        self.start_on(0, spec)
    }

    /// Starts a guest on socket 0 of another device process `dev` (another
    /// node of a fabric) and waits until that device has a connection.
    /// Returns its index.
    pub fn start_elsewhere(&mut self, dev: &DeviceProcess, spec: &GuestSpec) -> usize {
        let g = Guest::start(self.kit, &dev.socket(0), dev.dir(), spec);
        self.guests.push(g);
        let ok = dev.wait_for(Duration::from_secs(30), |s| {
            s.iter().any(|p| p.n("connected") == 1)
        });
        assert!(ok, "{} never connected to the other device", spec.name);
        self.guests.len() - 1
    }

    /// Starts a guest on socket `socket` and waits until the device has
    /// one more connection (so ports are numbered in start order). Returns
    /// its index.
    pub fn start_on(&mut self, socket: usize, spec: &GuestSpec) -> usize {
        let before = self.connected();
        let g = Guest::start(self.kit, &self.dev.socket(socket), self.dev.dir(), spec);
        self.guests.push(g);
        let ok = self.dev.wait_for(Duration::from_secs(30), |s| {
            s.iter().filter(|p| p.n("connected") == 1).count() > before
        });
        if !ok {
            self.fail(&format!("{} did not connect to the device", spec.name));
        }
        self.guests.len() - 1
    }

    /// Ports with a connected frontend.
    pub fn connected(&self) -> usize {
        self.dev
            .status()
            .map(|s| s.iter().filter(|p| p.n("connected") == 1).count())
            .unwrap_or(0)
    }

    /// Fails the test with `what` and every log.
    pub fn fail(&self, what: &str) -> ! {
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

    /// Fails unless guest `g`'s QEMU is running and accepted the device:
    /// a refusal, an exit or the guest's time limit fails the test.
    pub fn check_running(&mut self, g: usize, waiting_for: &str) {
        let name = self.guests[g].name;
        if let Some(out) = self.guests[g].refusal() {
            self.guests[g].kill();
            self.fail(&format!(
                "QEMU refused what the device offers to {name} (the device's fault): {}",
                out.lines()
                    .find(|l| REFUSALS.iter().any(|r| l.contains(r)))
                    .unwrap_or_default()
            ));
        }
        if let Some(st) = self.guests[g].exited() {
            self.fail(&format!("{name}: QEMU exited ({st}) {waiting_for}"));
        }
        let limit = self.guests[g].limit;
        if self.guests[g].started.elapsed() > limit {
            self.guests[g].kill();
            self.fail(&format!("{name} killed after {limit:?} {waiting_for}"));
        }
    }

    /// Waits until guest `g` printed `key` for the `n`-th time (0-based).
    pub fn wait_nth(&mut self, g: usize, key: &str, n: usize) -> String {
        loop {
            if let Some(v) = self.guests[g].nth(key, n) {
                return v;
            }
            if self.guests[g].exited().is_some() {
                // Read once more: the line may have come just before exit.
                if let Some(v) = self.guests[g].nth(key, n) {
                    return v;
                }
            }
            self.check_running(g, &format!("before printing {key}"));
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits for the first `key` of guest `g`.
    pub fn wait(&mut self, g: usize, key: &str) -> String {
        self.wait_nth(g, key, 0)
    }

    /// Waits for the guest's `done=1` and for QEMU to exit cleanly.
    pub fn wait_done(&mut self, g: usize) {
        let done = self.wait(g, "done");
        let name = self.guests[g].name;
        if done != "1" {
            self.fail(&format!("{name} finished with failures (done={done})"));
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(st) = self.guests[g].exited() {
                if !st.success() {
                    self.fail(&format!("{name}: QEMU exited with {st}"));
                }
                return;
            }
            if Instant::now() > deadline {
                self.fail(&format!("{name} printed done=1 but did not power off"));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Fails with `what` unless `cond`.
    pub fn check(&self, cond: bool, what: &str) {
        if !cond {
            self.fail(what);
        }
    }

    /// A counter of port `index`.
    pub fn port(&self, index: usize, key: &str) -> u64 {
        self.dev.port(index).n(key)
    }
}

/// The last `lines` lines of `s`.
pub fn tail(s: &str, lines: usize) -> String {
    let v: Vec<&str> = s.lines().collect();
    v[v.len().saturating_sub(lines)..].join("\n")
}
