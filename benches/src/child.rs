//! Child processes of a program that starts its own device and ranks: the
//! emulated NIC run from the program's own executable on a temporary socket
//! directory, and processes that talk in lines over their stdin and stdout.
//! Both are stopped and reaped when dropped (also on an error or a panic),
//! and the device's directory is removed.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a device may take to create its sockets.
const START_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a stopped child may take to exit before it is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(2);

/// Sends SIGTERM to `child`, waits up to `timeout` for it to exit, then
/// kills it; reaps it either way.
fn stop(child: &mut Child, timeout: Duration) {
    if let Ok(None) = child.try_wait() {
        // SAFETY: kill(2) on the pid of our own child, which has not been
        // reaped yet (try_wait just saw it running), so the pid is still
        // its own; no memory is involved.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// The emulated NIC running in a child process: `EXE FLAG --socket-dir DIR
/// --ports N ARGS...`, where `EXE FLAG` runs the device (for instance a
/// program that calls `pindown_emu_device::cli::main` when its first argument is
/// `--device`). Its log goes to `DIR/device.log`.
#[derive(Debug)]
pub struct DeviceChild {
    child: Child,
    dir: PathBuf,
}

static DIRS: AtomicUsize = AtomicUsize::new(0);

impl DeviceChild {
    /// Starts the device on a new temporary directory and waits until its
    /// port and control sockets exist.
    pub fn start(exe: &Path, flag: &str, ports: usize, args: &[&str]) -> io::Result<DeviceChild> {
        Self::start_in(exe, flag, ports, args, None)
    }

    /// Like [`DeviceChild::start`], with the device in the network
    /// namespace `netns` (an open `/var/run/netns/NAME` or
    /// `/proc/PID/ns/net`) when one is given: its UDP sockets live there,
    /// while its unix sockets are in the shared filesystem as usual.
    pub fn start_in(
        exe: &Path,
        flag: &str,
        ports: usize,
        args: &[&str],
        netns: Option<&std::fs::File>,
    ) -> io::Result<DeviceChild> {
        let dir = std::env::temp_dir().join(format!(
            "pindown-{}-{}",
            std::process::id(),
            DIRS.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        let failed = |what: &str, e: io::Error| {
            let _ = std::fs::remove_dir_all(&dir);
            io::Error::new(e.kind(), format!("{what}: {e}"))
        };
        std::fs::create_dir_all(&dir)
            .map_err(|e| failed(&format!("cannot create {}", dir.display()), e))?;
        let log = std::fs::File::create(dir.join("device.log"))
            .map_err(|e| failed("cannot create the device's log", e))?;
        let mut command = Command::new(exe);
        if let Some(netns) = netns {
            let fd = std::os::fd::AsRawFd::as_raw_fd(netns);
            // SAFETY: the closure runs in the forked child before exec and
            // only calls setns(2), which is async-signal-safe, on a
            // descriptor the parent keeps open until spawn returns.
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
        let child = command
            .arg(flag)
            .arg("--socket-dir")
            .arg(&dir)
            .arg("--ports")
            .arg(ports.to_string())
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| failed(&format!("cannot start {}", exe.display()), e))?;
        // From here on, drop cleans up.
        let mut device = DeviceChild { child, dir };
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let control = device.dir.join("control.sock");
            if control.exists() && (0..ports).all(|i| device.socket(i).exists()) {
                return Ok(device);
            }
            if let Some(gone) = device.post_mortem() {
                return Err(io::Error::other(gone));
            }
            if Instant::now() > deadline {
                return Err(io::Error::other(format!(
                    "the device's sockets did not appear within {START_TIMEOUT:?}"
                )));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The device's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The device's socket directory (its log is `device.log` there).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The socket of port `i`.
    pub fn socket(&self, i: usize) -> PathBuf {
        self.dir.join(format!("port{i}.sock"))
    }

    /// The device's log so far, or why it is gone: what to show when
    /// something failed.
    pub fn post_mortem(&mut self) -> Option<String> {
        if let Ok(None) = self.child.try_wait() {
            return None;
        }
        let log = std::fs::read_to_string(self.dir.join("device.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        Some(format!(
            "the device exited: {}",
            lines[lines.len().saturating_sub(5)..].join(" | ")
        ))
    }
}

impl Drop for DeviceChild {
    fn drop(&mut self) {
        stop(&mut self.child, STOP_TIMEOUT);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The most of a child's stderr [`LineChild`] keeps (its end).
const STDERR_KEPT: usize = 64 << 10;

/// A child process spoken to in lines: commands on its stdin, answers on its
/// stdout (read by a thread, so that waiting for an answer can time out).
/// Its stderr is this process's, unless the command pipes it: then a thread
/// keeps the end of it for [`LineChild::stderr`].
#[derive(Debug)]
pub struct LineChild {
    name: String,
    child: Child,
    input: Option<ChildStdin>,
    lines: Receiver<String>,
    stderr: Option<StderrTail>,
}

/// The end of a child's stderr, kept by the thread that reads it.
#[derive(Debug)]
struct StderrTail {
    kept: Arc<Mutex<Vec<u8>>>,
    reader: std::thread::JoinHandle<()>,
}

impl LineChild {
    /// Spawns `command` with piped stdin and stdout; `name` appears in
    /// errors. A `command` whose stderr is piped has it collected.
    pub fn spawn(name: impl Into<String>, mut command: Command) -> io::Result<LineChild> {
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        let input = child.stdin.take();
        let output = child.stdout.take().expect("stdout is piped");
        let (sender, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(output).lines().map_while(Result::ok) {
                if sender.send(line).is_err() {
                    break;
                }
            }
        });
        let stderr = child.stderr.take().map(|mut errors| {
            let kept = Arc::new(Mutex::new(Vec::new()));
            let sink = Arc::clone(&kept);
            let reader = std::thread::spawn(move || {
                let mut chunk = [0u8; 4096];
                while let Ok(n @ 1..) = errors.read(&mut chunk) {
                    let mut kept = sink.lock().unwrap_or_else(|e| e.into_inner());
                    kept.extend_from_slice(&chunk[..n]);
                    let excess = kept.len().saturating_sub(STDERR_KEPT);
                    kept.drain(..excess);
                }
            });
            StderrTail { kept, reader }
        });
        Ok(LineChild {
            name: name.into(),
            child,
            input,
            lines,
            stderr,
        })
    }

    /// What the child wrote to its stderr so far (the end of it, as kept),
    /// when its command piped it; empty otherwise. After the child exited,
    /// waits (briefly) for the rest of it.
    pub fn stderr(&mut self) -> String {
        let Some(StderrTail { kept, reader }) = &self.stderr else {
            return String::new();
        };
        if matches!(self.child.try_wait(), Ok(Some(_))) {
            // The pipe closes when the child and whatever inherited it exit.
            let deadline = Instant::now() + STOP_TIMEOUT;
            while !reader.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        let kept = kept.lock().unwrap_or_else(|e| e.into_inner());
        String::from_utf8_lossy(&kept).into_owned()
    }

    /// An error naming the child and `what` went wrong, with the last
    /// `lines` non-empty lines of its stderr.
    pub fn failure(&mut self, what: &str, lines: usize) -> io::Error {
        let stderr = self.stderr();
        let kept: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
        let tail = kept[kept.len().saturating_sub(lines)..].join("\n  ");
        io::Error::other(format!("{}: {what}; its stderr:\n  {tail}", self.name))
    }

    /// The next line, waiting up to `timeout`; `None` once the child closed
    /// its stdout (at its end); an error if it said nothing in time.
    pub fn next_or_end(&mut self, timeout: Duration) -> io::Result<Option<String>> {
        match self.lines.recv_timeout(timeout) {
            Ok(line) => Ok(Some(line)),
            Err(RecvTimeoutError::Timeout) => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("{}: no output within {timeout:?}", self.name),
            )),
            Err(RecvTimeoutError::Disconnected) => Ok(None),
        }
    }

    /// Sends one line.
    pub fn send(&mut self, line: &str) -> io::Result<()> {
        let input = self
            .input
            .as_mut()
            .ok_or_else(|| io::Error::other(format!("{}: input already closed", self.name)))?;
        writeln!(input, "{line}")?;
        input.flush()
    }

    /// The next line, waiting up to `timeout`; an error if the child closed
    /// its stdout (exited) or said nothing in time.
    pub fn next(&mut self, timeout: Duration) -> io::Result<String> {
        match self.lines.recv_timeout(timeout) {
            Ok(line) => Ok(line),
            Err(RecvTimeoutError::Timeout) => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("{}: no answer within {timeout:?}", self.name),
            )),
            Err(RecvTimeoutError::Disconnected) => {
                let status = self.child.wait()?;
                Err(io::Error::other(format!(
                    "{} exited ({status}) without answering",
                    self.name
                )))
            }
        }
    }

    /// Sends `line` and returns the answer.
    pub fn ask(&mut self, line: &str, timeout: Duration) -> io::Result<String> {
        self.send(line)?;
        self.next(timeout)
    }

    /// Closes the child's stdin and waits up to `timeout` for it to exit
    /// (killing it after that); returns its exit status.
    pub fn finish(mut self, timeout: Duration) -> io::Result<ExitStatus> {
        self.wait_for_exit(timeout)
    }

    /// Like [`LineChild::finish`], keeping the child for [`LineChild::stderr`].
    pub fn wait_for_exit(&mut self, timeout: Duration) -> io::Result<ExitStatus> {
        drop(self.input.take());
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            if Instant::now() > deadline {
                stop(&mut self.child, STOP_TIMEOUT);
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("{} did not exit within {timeout:?}", self.name),
                ));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for LineChild {
    fn drop(&mut self) {
        drop(self.input.take());
        stop(&mut self.child, STOP_TIMEOUT);
    }
}

/// Starts a device with `n` ports (`exe --device`, with `device_args`) and
/// `n` rank processes `exe --rank MODE ARGS...` joined by the driver's own
/// launcher environment (`PINDOWN_RANK`, `PINDOWN_SIZE`, a key-value
/// folder, the device's folder), waits for all of them, and returns the
/// JSON values the ranks printed on stdout, one a line (in practice rank
/// 0's figures). An error names the ranks that failed.
pub fn run_ranks(
    exe: &Path,
    n: usize,
    mode: &str,
    args: &[String],
    device_args: &[&str],
) -> Result<Vec<serde_json::Value>, Box<dyn std::error::Error>> {
    let device = DeviceChild::start(exe, "--device", n, device_args)?;
    let kv = tempfile::tempdir()?;
    let ranks: Vec<_> = (0..n)
        .map(|r| {
            Command::new(exe)
                .arg("--rank")
                .arg(mode)
                .args(args)
                .env("PINDOWN_RANK", r.to_string())
                .env("PINDOWN_SIZE", n.to_string())
                .env("PINDOWN_LOCAL_RANK", r.to_string())
                .env("PINDOWN_LOCAL_SIZE", n.to_string())
                .env("PINDOWN_KV_DIR", kv.path())
                .env("PINDOWN_DEVICE_DIR", device.dir())
                .stdout(Stdio::piped())
                .spawn()
        })
        .collect::<Result<_, _>>()?;
    let mut figures = Vec::new();
    let mut failed = Vec::new();
    for (r, child) in ranks.into_iter().enumerate() {
        let output = child.wait_with_output()?;
        if !output.status.success() {
            failed.push(format!("rank {r}: {}", output.status));
        }
        for line in String::from_utf8_lossy(&output.stdout).lines() {
            figures.push(serde_json::from_str(line)?);
        }
    }
    drop(device);
    if !failed.is_empty() {
        return Err(format!("{mode}: {}", failed.join(", ")).into());
    }
    Ok(figures)
}
