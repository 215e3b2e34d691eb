//! The device's command line: options, start-up, and shutdown on SIGINT or
//! SIGTERM. The `emu-device` binary is [`main`]; programs that start the
//! device as a process of their own (the demo re-executes itself) call it
//! too.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

use crate::device::{Device, Server};
use crate::DeviceConfig;
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

/// Emulated NIC serving vhost-user frontends (QEMU or the pindown driver).
#[derive(Debug, Parser)]
#[command(name = "emu-device", version)]
struct Cli {
    /// Listen on this unix socket (repeatable; port i on the i-th socket).
    #[arg(long = "socket", value_name = "PATH")]
    sockets: Vec<PathBuf>,
    /// Create DIR/port0.sock .. DIR/port{N-1}.sock (and DIR/control.sock).
    #[arg(long, value_name = "DIR")]
    socket_dir: Option<PathBuf>,
    /// Number of sockets to create in --socket-dir.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=1024))]
    ports: u16,
    /// Net queue pairs per port (rings 2P and 2P+1 are the RDMA queues).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=127))]
    queue_pairs: u16,
    /// Largest ring size accepted (power of two).
    #[arg(long, default_value_t = 1024)]
    queue_size_max: u16,
    /// IOTLB entries per port.
    #[arg(long, default_value_t = 2048)]
    iotlb_entries_max: usize,
    /// Busy-poll rings instead of sleeping on kicks.
    #[arg(long)]
    poll: bool,
    /// After work, poll the rings this many microseconds before sleeping
    /// on kicks again (0: sleep at once).
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u64).range(0..=1_000_000))]
    spin_us: u64,
    /// MAC address of port 0 (port i gets this plus i).
    #[arg(long, default_value = "52:54:00:12:34:00", value_parser = parse_mac)]
    mac_base: [u8; 6],
    /// A port whose frontend is QEMU for a guest that drives the RDMA rings
    /// itself through VFIO (repeatable): it reports one more queue pair, the
    /// RDMA send and completion queues, so that QEMU forwards them.
    #[arg(long = "guest-port", value_name = "PORT")]
    guest_ports: Vec<usize>,
    /// Windows one port may hold at once; a bind beyond fails (completion
    /// status LimitReached, detail WindowLimit) and nothing grows.
    #[arg(long, default_value_t = crate::rdma::DEFAULT_MAX_WINDOWS_PER_PORT,
          value_parser = parse_max_windows)]
    max_windows_per_port: usize,
    /// Status socket (one `key=value` line per port on connect).
    #[arg(long, value_name = "PATH")]
    control: Option<PathBuf>,
}

/// Most windows per port the flag accepts (about 50 bytes each).
const MAX_WINDOWS_PER_PORT_CAP: usize = 1 << 24;

fn parse_max_windows(s: &str) -> Result<usize, String> {
    let n: usize = s
        .parse()
        .map_err(|_| format!("`{s}` is not a number of windows"))?;
    if !(1..=MAX_WINDOWS_PER_PORT_CAP).contains(&n) {
        return Err(format!(
            "--max-windows-per-port must be between 1 and {MAX_WINDOWS_PER_PORT_CAP}, not {n}"
        ));
    }
    Ok(n)
}

fn parse_mac(s: &str) -> Result<[u8; 6], String> {
    let parts: Vec<&str> = s.split(':').collect();
    if parts.len() != 6 {
        return Err(format!(
            "`{s}` is not a MAC address (six hex bytes with colons)"
        ));
    }
    let mut mac = [0u8; 6];
    for (m, p) in mac.iter_mut().zip(parts) {
        *m = u8::from_str_radix(p, 16).map_err(|_| format!("`{p}` is not a hex byte"))?;
    }
    Ok(mac)
}

/// Runs the device with command-line `args` (the first is the program
/// name) until SIGINT or SIGTERM.
pub fn main<I, T>(args: I) -> ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(error) => {
            let _ = error.print();
            return if error.use_stderr() {
                ExitCode::FAILURE
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("emu-device: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<(), String> {
    if !cli.queue_size_max.is_power_of_two() {
        return Err(format!(
            "--queue-size-max {} is not a power of two",
            cli.queue_size_max
        ));
    }
    if cli.iotlb_entries_max == 0 {
        return Err("--iotlb-entries-max must be at least 1".into());
    }
    let mut sockets = cli.sockets.clone();
    let mut control = cli.control.clone();
    if let Some(dir) = &cli.socket_dir {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        sockets.extend((0..cli.ports).map(|i| dir.join(format!("port{i}.sock"))));
        control.get_or_insert_with(|| dir.join("control.sock"));
    }
    if sockets.is_empty() {
        return Err("give at least one --socket PATH or --socket-dir DIR".into());
    }
    let config = DeviceConfig {
        queue_pairs: cli.queue_pairs,
        queue_size_max: cli.queue_size_max,
        iotlb_entries_max: cli.iotlb_entries_max,
        poll: cli.poll,
        spin_us: cli.spin_us,
        mac_base: cli.mac_base,
        guest_ports: cli.guest_ports.clone(),
        max_windows_per_port: cli.max_windows_per_port,
    };
    crate::rdma::init_keys().map_err(|e| format!("no random source for window keys: {e}"))?;
    let mut signals =
        Signals::new([SIGINT, SIGTERM]).map_err(|e| format!("cannot handle signals: {e}"))?;
    let engines: crate::engine::EngineFactory =
        Box::new(|_| Box::new(crate::rdma::DeviceEngine::new()));
    let device = Device::new(config, sockets.len(), Some(engines)).map_err(|e| e.to_string())?;
    let mut server =
        Server::start(device, &sockets, control.as_deref()).map_err(|e| e.to_string())?;
    tracing::info!(ports = sockets.len(), "emu-device ready");
    if let Some(sig) = signals.forever().next() {
        tracing::info!(signal = sig, "shutting down");
    }
    server.stop();
    Ok(())
}
