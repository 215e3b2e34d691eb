//! The device's command line: options, start-up, and shutdown on SIGINT or
//! SIGTERM. The `emu-device` binary is [`main`]; programs that start the
//! device as a process of their own (the demo re-executes itself) call it
//! too.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;

use crate::device::{self, Device, Server};
use crate::internode::LinkConfig;
use crate::net::Faults;
use crate::DeviceConfig;
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

/// Emulated NIC serving vhost-user frontends (QEMU or the pindown driver).
#[derive(Debug, Parser)]
#[command(name = "pindown-emu-device", version)]
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
    /// Net queue pairs per port (P; the RDMA rings follow from ring 2P on).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=127))]
    queue_pairs: u16,
    /// RDMA queue pairs per port, the admin pair included (pair q: send
    /// queue 2P+2q, completion queue 2P+2q+1).
    #[arg(long, default_value_t = crate::DEFAULT_RDMA_QUEUE_PAIRS,
          value_parser = clap::value_parser!(u16).range(1..=i64::from(pindown_uapi::MAX_RDMA_QUEUE_PAIRS)))]
    rdma_queue_pairs: u16,
    /// Largest ring size accepted (power of two).
    #[arg(long, default_value_t = 1024)]
    queue_size_max: u16,
    /// IOTLB entries per port (the oldest entry is evicted beyond it).
    #[arg(long, default_value_t = 2048)]
    iotlb_entries_max: usize,
    /// Bound on the bytes one port's memory table may map; a larger
    /// SET_MEM_TABLE is refused (suffixes K, M, G, T: powers of 1024).
    #[arg(long, default_value = "64G", value_parser = parse_bytes)]
    max_mapped_bytes_per_port: u64,
    /// Frontend connections served at once, over all sockets; one more is
    /// accepted and closed at once (logged). Default: what the descriptor
    /// limit allows (the device raises its soft limit to the hard one;
    /// each connection may hold up to 4 + 4 x rings + 64 descriptors),
    /// at most 256 (the SIGBUS guard's room: two memory tables of 32
    /// regions each per connection).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=65_536))]
    max_connections: Option<u64>,
    /// Status-socket clients served at once; one more is closed at once.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u64).range(1..=1024))]
    max_control_clients: u64,
    /// Busy-poll the rings of a port while its traffic flows, without
    /// doorbells (a port idle for 1 ms sleeps on its kicks until the next
    /// one, so that idle ports leave the cores to busy ones).
    #[arg(long)]
    poll: bool,
    /// After work, poll the rings this many microseconds before sleeping
    /// on kicks again (0: sleep at once).
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u64).range(0..=1_000_000))]
    spin_us: u64,
    /// Each port's thread polls only its own RDMA send queues. By default
    /// the first port thread that polls also serves the send queues of the
    /// other busy ports, whose threads sleep meanwhile (their drivers post
    /// without kicks): N busy ports keep one core spinning, not N. A
    /// transfer longer than one turn is handed back to its port's own
    /// thread, which runs it in parallel.
    #[arg(long)]
    solo_polling: bool,
    /// MAC address of port 0 (port i gets this plus i).
    #[arg(long, default_value = "52:54:00:12:34:00", value_parser = parse_mac)]
    mac_base: [u8; 6],
    /// A port whose frontend is QEMU for a guest that drives the RDMA rings
    /// itself through VFIO (repeatable): GET_QUEUE_NUM counts the RDMA queue
    /// pairs too, so that QEMU forwards them (as many as its `queues=`
    /// allows beyond the net pairs).
    #[arg(long = "guest-port", value_name = "PORT")]
    guest_ports: Vec<usize>,
    /// Windows one port may hold at once; a bind beyond fails (completion
    /// status LimitReached, detail WindowLimit) and nothing grows.
    #[arg(long, default_value_t = crate::rdma::DEFAULT_MAX_WINDOWS_PER_PORT,
          value_parser = parse_max_windows)]
    max_windows_per_port: usize,
    /// Bytes of a vector transfer's descriptor kept in the initiator's
    /// memory, at most (suffixes K, M, G: powers of 1024); the device
    /// copies it, so larger ones fail (status LimitReached, detail
    /// PatternLimit) and nothing moves.
    #[arg(long, default_value_t = crate::rdma::DEFAULT_MAX_DESCRIPTOR_BYTES as u64,
          value_parser = parse_descriptor_bytes)]
    max_descriptor_bytes: u64,
    /// Blocks of each pattern's lists (listed in the descriptor or read
    /// from the initiator's memory) in one vector transfer, at most: the
    /// device keeps 24 bytes per block while the transfer runs; more
    /// fail (status LimitReached, detail PatternLimit).
    #[arg(long, default_value_t = crate::rdma::DEFAULT_MAX_PATTERN_BLOCKS,
          value_parser = clap::value_parser!(u64).range(1..=MAX_PATTERN_BLOCKS_CAP))]
    max_pattern_blocks: u64,
    /// Status socket (one `key=value` line per port on connect; the line
    /// `fabric` asks for the fabric link's counters instead).
    #[arg(long, value_name = "PATH")]
    control: Option<PathBuf>,
    /// This device's node of the fabric: remote addresses naming another
    /// node go over UDP to that node's device.
    #[arg(long, default_value_t = 0)]
    node: u16,
    /// The UDP address the fabric link binds (with --fabric-peer).
    #[arg(long, value_name = "ADDR:PORT")]
    fabric_listen: Option<SocketAddr>,
    /// Another node of the fabric and its device's UDP address
    /// (repeatable): `NODE=ADDR:PORT`.
    #[arg(long = "fabric-peer", value_name = "NODE=ADDR:PORT", value_parser = parse_peer)]
    fabric_peers: Vec<(u16, SocketAddr)>,
    /// The job's fabric token (hex, nonzero; every device of the fabric
    /// is given the same): datagrams of another job are dropped. Default:
    /// the environment variable PINDOWN_FABRIC_TOKEN.
    #[arg(long, value_name = "HEX", value_parser = parse_token)]
    fabric_token: Option<u64>,
    /// A peer that acknowledges nothing for this long while requests to
    /// it are in flight is declared gone; they fail with NodeUnreachable
    /// (e.g. 3s, 500ms).
    #[arg(long, default_value = "3s", value_parser = parse_timeout)]
    peer_timeout: Duration,
    /// Faults injected into the datagrams the fabric link receives, e.g.
    /// `loss=0.05,dup=0.01,reorder=0.05,delay=200us,seed=7`.
    #[arg(long, value_name = "SPEC", default_value = "")]
    fault_in: Faults,
    /// Faults injected into the datagrams the fabric link sends (same
    /// form as --fault-in).
    #[arg(long, value_name = "SPEC", default_value = "")]
    fault_out: Faults,
}

fn parse_peer(s: &str) -> Result<(u16, SocketAddr), String> {
    let (node, address) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} is not NODE=ADDR:PORT"))?;
    let node = node
        .parse()
        .map_err(|_| format!("{node:?} is not a node number (0 to 65535)"))?;
    let address = address
        .parse()
        .map_err(|_| format!("{address:?} is not an address ADDR:PORT"))?;
    Ok((node, address))
}

fn parse_token(s: &str) -> Result<u64, String> {
    match u64::from_str_radix(s.trim_start_matches("0x"), 16) {
        Ok(0) => Err("the fabric token must not be 0".into()),
        Ok(token) => Ok(token),
        Err(_) => Err(format!("{s:?} is not a hexadecimal token")),
    }
}

fn parse_timeout(s: &str) -> Result<Duration, String> {
    crate::net::faults::parse_duration(s)
        .filter(|d| !d.is_zero())
        .ok_or_else(|| format!("{s:?} is not a duration such as 3s, 500ms or 100us"))
}

fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (digits, shift) = match t.char_indices().last() {
        Some((i, 'K' | 'k')) => (&t[..i], 10),
        Some((i, 'M' | 'm')) => (&t[..i], 20),
        Some((i, 'G' | 'g')) => (&t[..i], 30),
        Some((i, 'T' | 't')) => (&t[..i], 40),
        _ => (t, 0),
    };
    let n: u64 = digits.parse().map_err(|_| {
        format!("`{s}` is not a byte count (a number, optionally with K, M, G or T)")
    })?;
    let bytes = n
        .checked_mul(1u64 << shift)
        .ok_or_else(|| format!("`{s}` is too large"))?;
    if bytes == 0 {
        return Err("the bound must be at least 1 byte".into());
    }
    Ok(bytes)
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

/// Most blocks per pattern the flag accepts (384 MiB kept per transfer).
const MAX_PATTERN_BLOCKS_CAP: u64 = pindown_uapi::pattern::MAX_BLOCKS_CAP;

fn parse_descriptor_bytes(s: &str) -> Result<u64, String> {
    let bytes = parse_bytes(s)?;
    if bytes > u64::from(u32::MAX) {
        return Err(format!(
            "--max-descriptor-bytes must be at most {} (a descriptor's length is 32 bits)",
            u32::MAX
        ));
    }
    Ok(bytes)
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

/// Most connections served at once: each may hold two full memory tables
/// (the old one while a new one is mapped), every region of which may need a
/// slot of the SIGBUS guard.
const MAX_CONNECTIONS: u64 = (crate::sigbus::SLOTS / (2 * crate::memory::MAX_REGIONS)) as u64;

/// Default connection limit when the descriptor limit allows more.
const DEFAULT_MAX_CONNECTIONS: u64 = MAX_CONNECTIONS;

/// Raises the descriptor limit and returns the connection limit: the one
/// asked for if the descriptors suffice for it, else (none asked) as many
/// as they suffice for, at most [`DEFAULT_MAX_CONNECTIONS`].
fn connection_limit(
    config: &DeviceConfig,
    sockets: usize,
    asked: Option<u64>,
) -> Result<usize, String> {
    let nofile =
        device::raise_fd_limit().map_err(|e| format!("cannot read the descriptor limit: {e}"))?;
    let per = device::fds_per_connection(config);
    let fixed = device::fds_needed(
        &DeviceConfig {
            max_connections: 0,
            ..config.clone()
        },
        sockets,
    );
    let room = nofile.saturating_sub(fixed) / per;
    let limit = match asked {
        Some(n) if n > MAX_CONNECTIONS => {
            return Err(format!(
                "--max-connections {n} is more than the device can guard: at most \
                 {MAX_CONNECTIONS} (each connection may map two memory tables of {} regions, \
                 and the SIGBUS guard has {} slots)",
                crate::memory::MAX_REGIONS,
                crate::sigbus::SLOTS
            ))
        }
        Some(n) if n > room => {
            return Err(format!(
                "--max-connections {n} needs up to {} file descriptors, but the limit is {nofile} \
                 (each connection may hold {per}); raise the hard limit (ulimit -Hn) or ask for \
                 at most {room}",
                fixed + n * per
            ))
        }
        Some(n) => n,
        None if room == 0 => {
            return Err(format!(
                "the descriptor limit {nofile} leaves no room for a connection \
                 ({fixed} for the device, {per} per connection)"
            ))
        }
        None => room.min(DEFAULT_MAX_CONNECTIONS),
    };
    tracing::info!(
        nofile,
        fds_per_connection = per,
        "serving at most {limit} connections at once"
    );
    Ok(limit as usize)
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
    let mut config = DeviceConfig {
        queue_pairs: cli.queue_pairs,
        rdma_queue_pairs: cli.rdma_queue_pairs,
        queue_size_max: cli.queue_size_max,
        iotlb_entries_max: cli.iotlb_entries_max,
        poll: cli.poll,
        spin_us: cli.spin_us,
        solo_polling: cli.solo_polling,
        mac_base: cli.mac_base,
        guest_ports: cli.guest_ports.clone(),
        max_mapped_bytes_per_port: cli.max_mapped_bytes_per_port,
        max_connections: 0,
        max_control_clients: cli.max_control_clients as usize,
        max_windows_per_port: cli.max_windows_per_port,
        vector_limits: crate::rdma::VectorLimits {
            max_descriptor_bytes: cli.max_descriptor_bytes as u32,
            max_pattern_blocks: cli.max_pattern_blocks,
        },
        node: cli.node,
    };
    crate::rdma::init_keys().map_err(|e| format!("no random source for window keys: {e}"))?;
    config.max_connections = connection_limit(&config, sockets.len(), cli.max_connections)?;
    // A frontend's call fd may be a pipe or socket whose reader is gone:
    // writing it must fail with EPIPE, not kill the device.
    // SAFETY: installs the "ignore" disposition; no handler code runs.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
    }
    let mut signals =
        Signals::new([SIGINT, SIGTERM]).map_err(|e| format!("cannot handle signals: {e}"))?;
    let link = link_config(&cli)?;
    let device = Device::new(config, sockets.len()).map_err(|e| e.to_string())?;
    if let Some(link) = link {
        device.start_link(link).map_err(|e| e.to_string())?;
    }
    let mut server =
        Server::start(device, &sockets, control.as_deref()).map_err(|e| e.to_string())?;
    tracing::info!(ports = sockets.len(), "emu-device ready");
    if let Some(sig) = signals.forever().next() {
        tracing::info!(signal = sig, "shutting down");
    }
    server.stop();
    Ok(())
}

/// The fabric link the command line asks for, if any.
fn link_config(cli: &Cli) -> Result<Option<LinkConfig>, String> {
    let Some(listen) = cli.fabric_listen else {
        if !cli.fabric_peers.is_empty() {
            return Err("--fabric-peer needs --fabric-listen".into());
        }
        return Ok(None);
    };
    let fabric = match cli.fabric_token {
        Some(token) => token,
        None => match std::env::var("PINDOWN_FABRIC_TOKEN") {
            Ok(text) => parse_token(&text).map_err(|e| format!("PINDOWN_FABRIC_TOKEN: {e}"))?,
            Err(_) => {
                return Err(
                    "a fabric needs a job token: --fabric-token HEX or PINDOWN_FABRIC_TOKEN".into(),
                )
            }
        },
    };
    let mut peers = std::collections::BTreeMap::new();
    for &(node, address) in &cli.fabric_peers {
        if node == cli.node {
            return Err(format!("--fabric-peer {node}={address} names this node"));
        }
        if peers.insert(node, address).is_some() {
            return Err(format!("--fabric-peer names node {node} twice"));
        }
    }
    let endpoint = crate::net::Config {
        peer_timeout: cli.peer_timeout,
        // The link takes every datagram waiting before it transmits, so
        // acknowledgements are batched by the pass anyway; delaying them
        // further would make every isolated request wait.
        ack_delay: Duration::ZERO,
        ..crate::net::Config::default()
    };
    endpoint.validate().map_err(|e| e.to_string())?;
    Ok(Some(LinkConfig {
        node: cli.node,
        listen,
        peers,
        fabric,
        endpoint,
        fault_in: cli.fault_in,
        fault_out: cli.fault_out,
        spin: Duration::from_micros(cli.spin_us),
        poll: cli.poll,
    }))
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn byte_counts_take_binary_suffixes() {
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("16M"), Ok(16 << 20));
        assert_eq!(parse_bytes("64G"), Ok(64 << 30));
        assert_eq!(parse_bytes("2t"), Ok(2 << 40));
        assert!(parse_bytes("0").is_err());
        assert!(parse_bytes("G").is_err());
        assert!(parse_bytes("12Q").is_err());
        assert!(parse_bytes("99999999999T").is_err());
    }
}
