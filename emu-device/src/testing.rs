//! A harness that runs the `emu-device` binary on a temporary socket
//! directory, reads its status socket, and kills and cleans it up on drop.
//!
//! ```no_run
//! # use pindown_emu_device::testing::DeviceProcess;
//! // In an integration test: env!("CARGO_BIN_EXE_pindown-emu-device").
//! let bin = std::path::Path::new("target/release/pindown-emu-device");
//! let dev = DeviceProcess::start(bin, 2, &[]).unwrap();
//! let status = dev.status().unwrap();
//! assert_eq!(status[0].n("connected"), 0);
//! ```
//!
//! [`netns`] gives devices hosts of their own (network namespaces with
//! their own addresses) for fabric tests:
//! [`DeviceProcess::start_in_netns`]; without root, [`free_udp_port`] and
//! [`fabric_args`] join devices into a fabric over loopback.

#[cfg(any(test, feature = "test-hooks"))]
pub mod engine;
pub mod netns;

use std::io;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

pub use crate::status::{parse_status, PortStatus};

/// A running `emu-device` child process.
#[derive(Debug)]
pub struct DeviceProcess {
    child: Child,
    dir: PathBuf,
    ports: usize,
}

static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// A free UDP port of the loopback address (for a fabric's nodes).
///
/// The port is taken below the kernel's ephemeral range
/// (`net.ipv4.ip_local_port_range`), so that no socket bound to port 0
/// between the pick and the device's bind (any concurrent test's) can take
/// it; test processes running at once start at different places (their
/// process ids) and each pick moves on.
pub fn free_udp_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    const LOWEST: u32 = 10_000;
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32_768);
    if ephemeral_low < LOWEST + 1_000 {
        // A machine whose ephemeral range starts low: any free port.
        let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        return socket.local_addr().unwrap().port();
    }
    let span = ephemeral_low - LOWEST;
    for _ in 0..span {
        let pick =
            (std::process::id().wrapping_mul(97) + NEXT.fetch_add(1, Ordering::Relaxed)) % span;
        let port = u16::try_from(LOWEST + pick).expect("below the ephemeral range");
        if std::net::UdpSocket::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free UDP port between {LOWEST} and {ephemeral_low}")
}

/// The device options that make it node `node` of a fabric on loopback
/// whose node `i` listens on UDP port `ports[i]`, with job token `token`.
pub fn fabric_args(node: u16, ports: &[u16], token: &str) -> Vec<String> {
    let mut args = vec![
        "--node".to_string(),
        node.to_string(),
        "--fabric-listen".to_string(),
        format!("127.0.0.1:{}", ports[usize::from(node)]),
        "--fabric-token".to_string(),
        token.to_string(),
    ];
    for (other, port) in ports.iter().enumerate() {
        if other != usize::from(node) {
            args.push("--fabric-peer".to_string());
            args.push(format!("{other}=127.0.0.1:{port}"));
        }
    }
    args
}

impl DeviceProcess {
    /// Starts `bin --socket-dir TMP --ports ports ARGS...` and waits (up to
    /// 10 s) until all sockets exist. Logs go to `TMP/device.log`.
    pub fn start(bin: &Path, ports: usize, args: &[&str]) -> io::Result<DeviceProcess> {
        Self::spawn(bin, ports, args, None)
    }

    /// Like [`DeviceProcess::start`], with the process's `RLIMIT_NOFILE`
    /// set to `soft` and `hard` before it runs.
    pub fn start_with_fd_limit(
        bin: &Path,
        ports: usize,
        args: &[&str],
        soft: u64,
        hard: u64,
    ) -> io::Result<DeviceProcess> {
        Self::spawn(bin, ports, args, Some((soft, hard)))
    }

    /// Like [`DeviceProcess::start`], running as user and group `uid`
    /// (the caller must be root): limits that do not bind root, such as
    /// `RLIMIT_NPROC`, then bind the device. The binary is copied into the
    /// device's own directory first, so that the user can run it wherever
    /// the build lies.
    ///
    /// `nproc`: the `RLIMIT_NPROC` soft limit the device runs with (tasks
    /// of that user over the whole machine; the hard limit is kept).
    pub fn start_as_user(
        bin: &Path,
        ports: usize,
        args: &[&str],
        uid: u32,
        nproc: Option<u64>,
    ) -> io::Result<DeviceProcess> {
        Self::spawn_with(bin, ports, args, None, Some((uid, nproc)), None)
    }

    /// Like [`DeviceProcess::start`], with the device in the network
    /// namespace `host` (its UDP sockets bind and send there), while its
    /// socket directory stays in the shared filesystem, where drivers of
    /// any namespace connect.
    pub fn start_in_netns(
        bin: &Path,
        ports: usize,
        args: &[&str],
        host: &netns::Namespace,
    ) -> io::Result<DeviceProcess> {
        Self::spawn_with(bin, ports, args, None, None, Some(&host.path()))
    }

    fn spawn(
        bin: &Path,
        ports: usize,
        args: &[&str],
        nofile: Option<(u64, u64)>,
    ) -> io::Result<DeviceProcess> {
        Self::spawn_with(bin, ports, args, nofile, None, None)
    }

    fn spawn_with(
        bin: &Path,
        ports: usize,
        args: &[&str],
        nofile: Option<(u64, u64)>,
        user: Option<(u32, Option<u64>)>,
        netns: Option<&Path>,
    ) -> io::Result<DeviceProcess> {
        let dir = std::env::temp_dir().join(format!(
            "emu-device-test-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        let log = std::fs::File::create(dir.join("device.log"))?;
        let mut command = match user {
            None => Command::new(bin),
            Some((uid, nproc)) => {
                let copy = dir.join("pindown-emu-device");
                std::fs::copy(bin, &copy)?;
                std::os::unix::fs::chown(&dir, Some(uid), Some(uid))?;
                std::os::unix::fs::chown(dir.join("device.log"), Some(uid), Some(uid))?;
                let mut command = Command::new(copy);
                // SAFETY: the closure runs in the forked child before exec
                // and only calls getrlimit(2), setrlimit(2), setgroups(2),
                // setgid(2) and setuid(2), which are async-signal-safe, on
                // values of its own.
                unsafe {
                    std::os::unix::process::CommandExt::pre_exec(&mut command, move || {
                        if let Some(soft) = nproc {
                            let mut limit = libc::rlimit {
                                rlim_cur: 0,
                                rlim_max: 0,
                            };
                            if libc::getrlimit(libc::RLIMIT_NPROC, &mut limit) != 0 {
                                return Err(io::Error::last_os_error());
                            }
                            limit.rlim_cur = soft.min(limit.rlim_max);
                            if libc::setrlimit(libc::RLIMIT_NPROC, &limit) != 0 {
                                return Err(io::Error::last_os_error());
                            }
                        }
                        if libc::setgroups(0, std::ptr::null()) != 0
                            || libc::setgid(uid) != 0
                            || libc::setuid(uid) != 0
                        {
                            return Err(io::Error::last_os_error());
                        }
                        Ok(())
                    });
                }
                command
            }
        };
        if let Some((soft, hard)) = nofile {
            let limit = libc::rlimit {
                rlim_cur: soft,
                rlim_max: hard,
            };
            // SAFETY: the closure runs in the forked child before exec and
            // only calls setrlimit(2), which is async-signal-safe, on a
            // value copied into it.
            unsafe {
                std::os::unix::process::CommandExt::pre_exec(&mut command, move || {
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) == 0 {
                        Ok(())
                    } else {
                        Err(io::Error::last_os_error())
                    }
                });
            }
        }
        // Opened here, held open until the child has been spawned: the
        // child enters the namespace through this descriptor.
        let namespace = match netns {
            Some(path) => Some(std::fs::File::open(path).map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!("network namespace {}: {e}", path.display()),
                )
            })?),
            None => None,
        };
        if let Some(file) = &namespace {
            let fd = std::os::fd::AsRawFd::as_raw_fd(file);
            // SAFETY: the closure runs in the forked child before exec and
            // only calls setns(2), which is async-signal-safe, on `fd`: a
            // descriptor of the parent's `namespace` file, which stays open
            // until after spawn returns, so the child has it too (it is
            // close-on-exec, so the device does not keep it).
            unsafe {
                std::os::unix::process::CommandExt::pre_exec(&mut command, move || {
                    if libc::setns(fd, libc::CLONE_NEWNET) == 0 {
                        Ok(())
                    } else {
                        Err(io::Error::last_os_error())
                    }
                });
            }
        }
        command
            .arg("--socket-dir")
            .arg(&dir)
            .arg("--ports")
            .arg(ports.to_string())
            .args(args)
            .env(
                "RUST_LOG",
                std::env::var("EMU_DEVICE_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        let child = spawn_retrying_busy_text(&mut command)?;
        drop(namespace);
        let mut dev = DeviceProcess { child, dir, ports };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let ready = dev.control_path().exists() && (0..ports).all(|i| dev.socket(i).exists());
            if ready {
                return Ok(dev);
            }
            if let Some(st) = dev.child.try_wait()? {
                return Err(io::Error::other(format!(
                    "emu-device exited ({st}): {}",
                    dev.log()
                )));
            }
            if Instant::now() > deadline {
                return Err(io::Error::other("emu-device sockets did not appear"));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Socket of port `i`.
    pub fn socket(&self, i: usize) -> PathBuf {
        self.dir.join(format!("port{i}.sock"))
    }

    /// Number of sockets.
    pub fn ports(&self) -> usize {
        self.ports
    }

    /// The status socket.
    pub fn control_path(&self) -> PathBuf {
        self.dir.join("control.sock")
    }

    /// The temporary directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The device's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("device.log")).unwrap_or_default()
    }

    /// Whether the process is still running.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Reads the status of every port.
    pub fn status(&self) -> io::Result<Vec<PortStatus>> {
        Ok(parse_status(&crate::status::query(
            &self.control_path(),
            "status",
        )?))
    }

    /// The fabric link's counters (the status socket's `fabric` line;
    /// empty without a fabric or when the device does not answer).
    pub fn fabric_status(&self) -> PortStatus {
        crate::status::query(&self.control_path(), "fabric")
            .ok()
            .and_then(|text| parse_status(&text).into_iter().next())
            .unwrap_or_default()
    }

    /// The fabric link's line per peer (`peer node=..`), in node order;
    /// empty without a fabric or when the device does not answer.
    pub fn fabric_peers(&self) -> Vec<PortStatus> {
        crate::status::query(&self.control_path(), "fabric")
            .ok()
            .and_then(|text| crate::status::parse_fabric(&text))
            .map(|fabric| fabric.peers)
            .unwrap_or_default()
    }

    /// Status of port `i` (empty if unknown).
    pub fn port(&self, i: usize) -> PortStatus {
        self.status()
            .ok()
            .and_then(|v| v.into_iter().nth(i))
            .unwrap_or_default()
    }

    /// Polls the status until `pred` holds or `timeout` passes.
    pub fn wait_for(&self, timeout: Duration, mut pred: impl FnMut(&[PortStatus]) -> bool) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(s) = self.status() {
                if pred(&s) {
                    return true;
                }
            }
            if Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops the process (SIGSTOP) and waits up to `timeout` until every
    /// thread of it is seen stopped (the signal is delivered
    /// asynchronously); returns whether they were. Its connections stay
    /// open, unanswered, until [`resume`](Self::resume).
    pub fn stop(&self, timeout: Duration) -> bool {
        self.signal(libc::SIGSTOP);
        let tasks = format!("/proc/{}/task", self.pid());
        let stopped = || {
            std::fs::read_dir(&tasks).is_ok_and(|mut threads| {
                threads.all(|thread| {
                    thread
                        .and_then(|thread| std::fs::read_to_string(thread.path().join("stat")))
                        // The state follows the parenthesised command name.
                        .is_ok_and(|stat| {
                            stat.rsplit_once(')')
                                .is_some_and(|(_, rest)| rest.trim_start().starts_with('T'))
                        })
                })
            })
        };
        let deadline = Instant::now() + timeout;
        while !stopped() {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }

    /// Continues a process [`stop`](Self::stop)ped (SIGCONT).
    pub fn resume(&self) {
        self.signal(libc::SIGCONT);
    }

    fn signal(&self, signal: libc::c_int) {
        // SAFETY: kill(2) on our own child, not reaped while `self` owns
        // it; no memory is involved.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, signal);
        }
    }

    /// Sends SIGTERM and waits up to `timeout` for a clean exit; returns
    /// whether it exited successfully.
    pub fn terminate(&mut self, timeout: Duration) -> bool {
        self.signal(libc::SIGTERM);
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Ok(Some(st)) = self.child.try_wait() {
                return st.success();
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }
}

impl Drop for DeviceProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::env::var_os("EMU_DEVICE_KEEP").is_none() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// Payloads of vhost-user requests as a frontend sends them, built from
/// the `vhost` crate's message types (for tests, hostile clients and fuzz
/// seeds).
pub mod payload {
    use vhost::vhost_user::message::{
        VhostUserMemory, VhostUserMemoryRegion, VhostUserVringAddr, VhostUserVringState,
    };
    use vm_memory::ByteValued;

    /// SET_VRING_NUM, SET_VRING_BASE, GET_VRING_BASE, SET_VRING_ENABLE.
    pub fn vring_state(index: u32, num: u32) -> Vec<u8> {
        VhostUserVringState::new(index, num).as_slice().to_vec()
    }

    /// SET_VRING_ADDR (no log address).
    pub fn vring_addr(
        index: u32,
        flags: u32,
        descriptor: u64,
        used: u64,
        available: u64,
    ) -> Vec<u8> {
        VhostUserVringAddr {
            index,
            flags,
            descriptor,
            used,
            available,
            log: 0,
        }
        .as_slice()
        .to_vec()
    }

    /// SET_MEM_TABLE: regions as (guest physical address, size, frontend
    /// address, file offset).
    pub fn mem_table(regions: &[(u64, u64, u64, u64)]) -> Vec<u8> {
        let mut p = VhostUserMemory::new(regions.len() as u32)
            .as_slice()
            .to_vec();
        for &(gpa, size, uaddr, offset) in regions {
            p.extend_from_slice(VhostUserMemoryRegion::new(gpa, size, uaddr, offset).as_slice());
        }
        p
    }
}

/// Spawns `command`, trying again while exec fails with `ETXTBSY`: a copy
/// of the device binary just written by this process is "busy" for as
/// long as a child that another thread forked meanwhile still holds the
/// writing descriptor (until that child's own exec closes it).
fn spawn_retrying_busy_text(command: &mut Command) -> io::Result<std::process::Child> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match command.spawn() {
            Err(e)
                if e.kind() == io::ErrorKind::ExecutableFileBusy && Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(5));
            }
            result => return result,
        }
    }
}
