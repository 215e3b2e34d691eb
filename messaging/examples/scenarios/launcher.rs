//! What the example rank programs share: their command line (`launch N
//! SCENARIO`, `rank SCENARIO`, `device ARGS`), the launcher that starts a
//! device with N ports and N rank processes of the same executable, and
//! opening a rank's port.

use std::path::Path;
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use pindown_driver::verbs::Context;

/// Runs the command line `args` of program `name`: `rank` runs `rank`,
/// `launch` starts a device and the ranks, `device` (or flags alone, as a
/// test harness starts a device binary) runs the device.
pub fn main(name: &str, args: &[String], rank: fn(&str, &[String]) -> ExitCode) -> ExitCode {
    match args.first().map(String::as_str) {
        Some("device") => {
            // SAFETY: prctl(PR_SET_PDEATHSIG) takes a signal number and
            // changes only this process's attributes: the device dies with
            // the launcher that started it.
            unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) };
            pindown_emu_device::cli::main(args.to_vec())
        }
        // Started by a test harness as a device binary (`--socket-dir ...`).
        Some(flag) if flag.starts_with("--") => pindown_emu_device::cli::main(std::env::args()),
        Some("rank") if args.len() >= 2 => rank(&args[1], &args[2..]),
        Some("launch") if args.len() >= 3 => match args[1].parse::<u32>() {
            Ok(n) if n >= 1 => launch(n, &args[2], &args[3..]),
            _ => usage(name),
        },
        _ => usage(name),
    }
}

fn usage(name: &str) -> ExitCode {
    eprintln!("usage: {name} launch N SCENARIO [ARGS] | rank SCENARIO [ARGS] | device ARGS");
    ExitCode::from(64)
}

/// Starts a device with `n` ports (this executable again; `--poll` among
/// `args` makes it busy-poll, for timings) and `n` ranks, and waits for
/// them; the ranks' lines go to stdout.
fn launch(n: u32, scenario: &str, args: &[String]) -> ExitCode {
    let exe = std::env::current_exe().expect("own executable");
    let dir = tempfile::tempdir().expect("a temporary directory");
    let sockets = dir.path().join("dev");
    let kv = dir.path().join("kv");
    std::fs::create_dir_all(&kv).expect("kv dir");
    let mut device = Command::new(&exe)
        .arg("device")
        .arg("--socket-dir")
        .arg(&sockets)
        .arg("--ports")
        .arg(n.to_string())
        .args(args.iter().filter(|a| *a == "--poll"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the device");
    let ready = Instant::now();
    while !(0..n).all(|i| sockets.join(format!("port{i}.sock")).exists()) {
        if ready.elapsed() > Duration::from_secs(20) {
            eprintln!("the device did not create its sockets");
            let _ = device.kill();
            let _ = device.wait();
            return ExitCode::FAILURE;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let ranks: Vec<_> = (0..n)
        .map(|r| {
            Command::new(&exe)
                .arg("rank")
                .arg(scenario)
                .args(args)
                .env("PINDOWN_RANK", r.to_string())
                .env("PINDOWN_SIZE", n.to_string())
                .env("PINDOWN_LOCAL_RANK", r.to_string())
                .env("PINDOWN_LOCAL_SIZE", n.to_string())
                .env("PINDOWN_KV_DIR", &kv)
                .env("PINDOWN_DEVICE_DIR", &sockets)
                .stdout(Stdio::piped())
                .spawn()
                .expect("start a rank")
        })
        .collect();
    let mut ok = true;
    for child in ranks {
        let output = child.wait_with_output().expect("a rank's output");
        print!("{}", String::from_utf8_lossy(&output.stdout));
        ok &= output.status.success();
    }
    let _ = device.kill();
    let _ = device.wait();
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// Opens the port at `socket` with the messaging settings. The launchers
/// start ranks once the device's socket files exist, and a loaded machine
/// may still be between bind and listen: a refused open is tried again
/// for up to 10 s.
pub fn open(socket: &Path) -> Result<Context, String> {
    let started = Instant::now();
    loop {
        match Context::open(socket, pindown_messaging::context_config()) {
            Ok(context) => return Ok(context),
            Err(e) if started.elapsed() < Duration::from_secs(10) => {
                if std::env::var_os("RANK_TRACE").is_some() {
                    eprintln!("opening {}: {e}; trying again", socket.display());
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(format!("{}: {e}", socket.display())),
        }
    }
}
