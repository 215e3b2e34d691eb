//! One verified RDMA write between two processes.
//!
//! ```text
//! cargo run --release --example rdma_write            # starts a device of its own
//! cargo run --release --example rdma_write -- DIR     # uses the device serving DIR/port0.sock
//!                                                     # and DIR/port1.sock
//! ```
//!
//! This process (the writer, on port 0) starts a second one (the owner, on
//! port 1). Both use ordinary heap `Vec`s: registration makes any memory
//! the process maps reachable by the device. The owner binds a window over
//! its buffer and prints it; the writer writes a message into that window with one RDMA write
//! and waits for its completion; the owner then checks that the message is
//! in its buffer, byte for byte, and says so. The exit status is success
//! only if it is. Without `DIR`, the writer first starts the emulated NIC
//! (this same executable, run as `rdma_write device ...`) and stops it at
//! the end.

use std::error::Error;
use std::io::{BufRead, BufReader, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use pindown_driver::verbs::opcode::Write;
use pindown_driver::verbs::{Context, ContextConfig, RemoteWindow};
use pindown_uapi::Access;

/// What the writer sends and the owner expects.
const MESSAGE: &[u8] = b"written by port 0 straight into port 1's memory";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("device") => {
            // SAFETY: prctl(PR_SET_PDEATHSIG) takes a signal number and
            // changes only this process's attributes: the device dies with
            // the writer that started it.
            unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) };
            return pindown_emu_device::cli::main(args);
        }
        Some("owner") => owner(Path::new(&args[1])),
        dir => writer(dir.map(PathBuf::from)),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("rdma_write: {error}");
            ExitCode::FAILURE
        }
    }
}

/// The owner (port 1): binds a window over a zeroed buffer, prints it,
/// and once told the write is done checks the buffer.
fn owner(socket: &Path) -> Result<(), Box<dyn Error>> {
    let context = Context::open(socket, ContextConfig::default())?;
    let region = context.register_memory(vec![0u8; 4096])?;
    let window = context.bind_window(&region, 0, 4096, Access::REMOTE_WRITE)?;
    println!("window {}", window.remote());

    let mut line = String::new();
    std::io::stdin().read_line(&mut line)?;
    if line.trim() != "written" {
        return Err(format!("expected `written`, got {line:?}").into());
    }
    // The region holds the Vec while peers may write it: revoke the
    // window, then take the Vec back to read it.
    window.revoke()?;
    let buffer: Vec<u8> = region
        .into_memory()
        .map_err(|_| "the buffer is still shared")?;
    let landed = &buffer[..MESSAGE.len()];
    if landed != MESSAGE {
        println!("mismatch: {:?}", String::from_utf8_lossy(landed));
        return Err("the bytes that arrived are not the message".into());
    }
    println!(
        "verified {} bytes: {}",
        landed.len(),
        String::from_utf8_lossy(landed)
    );
    Ok(())
}

/// The writer (port 0): starts the device if needed and the owner, then
/// writes the message into the owner's window.
fn writer(dir: Option<PathBuf>) -> Result<(), Box<dyn Error>> {
    let exe = std::env::current_exe()?;
    let (dir, _device) = match dir {
        Some(dir) => (dir, None),
        None => {
            let device = Device::start(&exe)?;
            (device.dir.clone(), Some(device))
        }
    };

    let mut owner = Command::new(&exe)
        .arg("owner")
        .arg(dir.join("port1.sock"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let mut from_owner = BufReader::new(owner.stdout.take().ok_or("owner's stdout")?);
    let mut line = String::new();
    from_owner.read_line(&mut line)?;
    let window: RemoteWindow = line
        .trim()
        .strip_prefix("window ")
        .ok_or_else(|| format!("expected the owner's window, got {line:?}"))?
        .parse()?;
    println!("owner's window: {window}");

    let context = Context::open(dir.join("port0.sock"), ContextConfig::default())?;
    let region = context.register_memory(MESSAGE.to_vec())?;
    let mut cq = context.create_completion_queue();
    let mut qp = context.create_queue_pair(&mut cq)?;
    let write = Write::new(region.local(0, MESSAGE.len() as u32)?, window.at(0));
    qp.post(&[write.build().user_data(1).signaled()])?;
    for completion in cq.wait(Duration::from_secs(10))? {
        completion.result()?;
        println!("write of {} bytes completed", completion.byte_len);
    }

    writeln!(owner.stdin.as_mut().ok_or("owner's stdin")?, "written")?;
    line.clear();
    from_owner.read_line(&mut line)?;
    print!("owner: {line}");
    let status = owner.wait()?;
    if !status.success() {
        return Err(format!("the owner failed ({status})").into());
    }
    Ok(())
}

/// The emulated NIC with two ports, run from this executable; stopped and
/// its socket directory removed on drop.
struct Device {
    child: Child,
    dir: PathBuf,
}

impl Device {
    fn start(exe: &Path) -> Result<Device, Box<dyn Error>> {
        let dir = std::env::temp_dir().join(format!("pindown-rdma-write-{}", std::process::id()));
        let child = Command::new(exe)
            .arg("device")
            .arg("--socket-dir")
            .arg(&dir)
            .args(["--ports", "2"])
            .stderr(Stdio::null())
            .spawn()?;
        let device = Device { child, dir };
        let deadline = Instant::now() + Duration::from_secs(10);
        while !(0..2).all(|i| device.dir.join(format!("port{i}.sock")).exists()) {
            if Instant::now() > deadline {
                return Err("the device did not create its sockets".into());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(device)
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
