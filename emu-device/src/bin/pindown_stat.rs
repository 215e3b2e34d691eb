//! `pindown-stat`: what a running device is doing, in the spirit of
//! `ibv_devinfo` and `rdma statistic`: its ports and their frontends,
//! RDMA work by kind with bytes and failures, refused accesses, windows,
//! mapped memory and IOTLB entries, each port's rings, and the fabric
//! link's counters with each peer's (datagrams, retransmissions, drops,
//! round trip). A table by default, `--json` for programs, `--watch
//! SECONDS` to refresh.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use pindown_emu_device::port::{FAILURE_KINDS, WORK_KINDS};
use pindown_emu_device::rdma::RefusalCounters;
use pindown_emu_device::status::{parse_fabric, parse_status, query, FabricStatus, PortStatus};
use serde_json::{json, Map, Value};

/// Shows a running pindown device's ports, work and fabric.
#[derive(Parser, Debug)]
#[command(name = "pindown-stat")]
struct Args {
    /// The device's status socket (its `--control`, or
    /// `DIR/control.sock` of its `--socket-dir DIR`).
    #[arg(long, default_value = "control.sock")]
    control: PathBuf,
    /// The device's socket directory (instead of `--control`).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Refresh every SECONDS until interrupted.
    #[arg(long, value_name = "SECONDS")]
    watch: Option<f64>,
    /// With `--watch`: stop after this many refreshes.
    #[arg(long)]
    count: Option<u64>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let control = args
        .dir
        .as_ref()
        .map_or_else(|| args.control.clone(), |dir| dir.join("control.sock"));
    let mut shown = 0u64;
    loop {
        match snapshot(&control) {
            Ok(snapshot) => {
                if args.json {
                    println!("{}", to_json(&control, &snapshot));
                } else {
                    if args.watch.is_some() {
                        // Clear the screen and go home, as `watch` does.
                        print!("\x1b[2J\x1b[H");
                    }
                    print!("{}", table(&control, &snapshot));
                }
            }
            Err(err) => {
                eprintln!("pindown-stat: {}: {err}", control.display());
                return ExitCode::FAILURE;
            }
        }
        shown += 1;
        match args.watch {
            Some(seconds) if args.count.is_none_or(|count| shown < count) => {
                std::thread::sleep(Duration::from_secs_f64(seconds.max(0.05)));
            }
            _ => return ExitCode::SUCCESS,
        }
    }
}

/// What one look at the device shows.
struct Snapshot {
    /// Every port's status.
    ports: Vec<PortStatus>,
    /// Every configured ring (each names its port).
    rings: Vec<PortStatus>,
    /// The fabric link and its peers (`None` without a fabric).
    fabric: Option<FabricStatus>,
}

impl Snapshot {
    /// The rings of `port`.
    fn rings_of<'s>(&'s self, port: &'s PortStatus) -> impl Iterator<Item = &'s PortStatus> {
        let index = port.get("port");
        self.rings.iter().filter(move |r| r.get("port") == index)
    }
}

fn snapshot(control: &std::path::Path) -> std::io::Result<Snapshot> {
    Ok(Snapshot {
        ports: parse_status(&query(control, "status")?),
        rings: parse_status(&query(control, "rings")?),
        fabric: parse_fabric(&query(control, "fabric")?),
    })
}

/// A field as a JSON number when it is one.
fn value(text: &str) -> Value {
    if let Ok(n) = text.parse::<u64>() {
        return json!(n);
    }
    if let Some(n) = text
        .strip_prefix("0x")
        .and_then(|h| u64::from_str_radix(h, 16).ok())
    {
        return json!(n);
    }
    json!(text)
}

fn object(status: &PortStatus) -> Value {
    let mut keys: Vec<&String> = status.fields.keys().collect();
    keys.sort();
    let map: Map<String, Value> = keys
        .into_iter()
        .map(|k| (k.clone(), value(&status.fields[k])))
        .collect();
    Value::Object(map)
}

/// `status`'s fields with `key` set to the objects of `items`.
fn object_with(status: &PortStatus, key: &str, items: Vec<Value>) -> Value {
    let mut value = object(status);
    if let Value::Object(map) = &mut value {
        map.insert(key.to_string(), Value::Array(items));
    }
    value
}

fn to_json(control: &std::path::Path, snapshot: &Snapshot) -> Value {
    let ports: Vec<Value> = snapshot
        .ports
        .iter()
        .map(|port| object_with(port, "rings", snapshot.rings_of(port).map(object).collect()))
        .collect();
    json!({
        "control": control.display().to_string(),
        "ports": ports,
        "fabric": snapshot.fabric.as_ref().map(|fabric| {
            object_with(&fabric.link, "peers", fabric.peers.iter().map(object).collect())
        }),
    })
}

/// `part` of `whole` in percent (0 when `whole` is 0).
fn percent(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        100.0 * part as f64 / whole as f64
    }
}

/// A duration in microseconds, or "-" when there is none yet.
fn micros(us: u64) -> String {
    match us {
        0 => "-".to_string(),
        us if us >= 10_000 => format!("{:.1} ms", us as f64 / 1000.0),
        us => format!("{us} us"),
    }
}

/// The rings of one port, a line each.
fn rings_table(out: &mut String, rings: &mut dyn Iterator<Item = &PortStatus>) {
    let mut any = false;
    for ring in rings {
        if !any {
            out.push_str(&format!(
                "  rings      {:>4} {:<10} {:>4} {:>6} {:>9} {:>9} {:>9}  state\n",
                "ring", "kind", "pair", "size", "position", "used", "in flight"
            ));
            any = true;
        }
        let kind = ring.text("kind").unwrap_or("-");
        let used = if kind.starts_with("net") {
            ring.n("next_used").to_string()
        } else {
            "-".to_string()
        };
        let in_flight = if kind == "send" {
            ring.n("in_flight").to_string()
        } else {
            "-".to_string()
        };
        let state = if ring.n("broken") == 1 {
            "broken"
        } else if ring.n("waiting_iotlb") == 1 {
            "waiting for IOTLB"
        } else if ring.n("started") == 1 {
            "started"
        } else if ring.n("enabled") == 1 {
            "enabled"
        } else {
            "stopped"
        };
        out.push_str(&format!(
            "             {:>4} {:<10} {:>4} {:>6} {:>9} {:>9} {:>9}  {state}\n",
            ring.n("ring"),
            kind,
            ring.n("pair"),
            ring.n("size"),
            ring.n("position"),
            used,
            in_flight,
        ));
    }
    if !any {
        out.push_str("  rings      none configured\n");
    }
}

/// The fabric's peers, a line each.
fn peers_table(out: &mut String, peers: &[PortStatus]) {
    out.push_str(&format!(
        "  peers     {:>5} {:<22} {:<18} {:>9} {:>9} {:>9} {:>7} {:>7} {:>5} {:>5} {:>9} {:>9} {:>5}  state\n",
        "node",
        "address",
        "incarnation",
        "sent",
        "received",
        "retrans",
        "rate",
        "dropped",
        "dup",
        "lost",
        "srtt",
        "rto",
        "out",
    ));
    for peer in peers {
        let sent = peer.n("datagrams_sent");
        let state = if peer.n("gone") == 1 {
            "gone"
        } else if peer.n("incarnation") == 0 {
            "not heard from"
        } else {
            "up"
        };
        out.push_str(&format!(
            "            {:>5} {:<22} {:<18} {:>9} {:>9} {:>9} {:>6.2}% {:>7} {:>5} {:>5} {:>9} {:>9} {:>5}  {state}\n",
            peer.n("node"),
            peer.text("address").unwrap_or("-"),
            peer.text("incarnation").unwrap_or("-"),
            sent,
            peer.n("datagrams_received"),
            peer.n("retransmissions"),
            percent(peer.n("retransmissions"), sent),
            peer.n("dropped_datagrams"),
            peer.n("duplicates"),
            peer.n("abandoned"),
            micros(peer.n("srtt_us")),
            micros(peer.n("rto_us")),
            peer.n("outstanding"),
        ));
    }
}

/// Bytes in binary units.
fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = n as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

fn sum(status: &PortStatus, prefix: &str) -> u64 {
    status
        .fields
        .keys()
        .filter(|k| k.starts_with(prefix))
        .map(|k| status.n(k))
        .sum()
}

fn table(control: &std::path::Path, snapshot: &Snapshot) -> String {
    let ports = &snapshot.ports;
    let mut out = format!("device {}\n\n", control.display());
    out.push_str(&format!(
        "{:<5} {:<10} {:<18} {:>10} {:>11} {:>7} {:>8} {:>8} {:>11} {:>6} {:>11}\n",
        "port",
        "frontend",
        "mac",
        "requests",
        "bytes",
        "failed",
        "refused",
        "windows",
        "mapped",
        "iotlb",
        "pinned"
    ));
    for port in ports {
        let frontend = if port.n("connected") == 1 {
            format!("yes ({})", port.n("connections"))
        } else {
            format!("no ({})", port.n("connections"))
        };
        out.push_str(&format!(
            "{:<5} {:<10} {:<18} {:>10} {:>11} {:>7} {:>8} {:>8} {:>11} {:>6} {:>11}\n",
            port.n("port"),
            frontend,
            port.fields.get("mac").map_or("-", String::as_str),
            sum(port, "requests_"),
            bytes(port.n("bytes")),
            sum(port, "failed_"),
            sum(port, "refused_"),
            port.n("windows"),
            bytes(port.n("mapped_bytes")),
            port.n("iotlb_entries"),
            bytes(port.n("iotlb_bytes")),
        ));
    }
    for port in ports {
        let line = |prefix: &str, names: &mut dyn Iterator<Item = &str>| -> String {
            names
                .map(|name| format!("{name} {}", port.n(&format!("{prefix}{name}"))))
                .collect::<Vec<_>>()
                .join(", ")
        };
        out.push_str(&format!("\nport {}\n", port.n("port")));
        out.push_str(&format!(
            "  requests   {}\n",
            line("requests_", &mut WORK_KINDS.iter().copied())
        ));
        out.push_str(&format!(
            "  failed     {}\n",
            line("failed_", &mut FAILURE_KINDS.iter().map(|&(_, name)| name))
        ));
        out.push_str(&format!(
            "  refused    {}\n",
            line(
                "refused_",
                &mut RefusalCounters::default()
                    .named()
                    .into_iter()
                    .map(|(name, _)| name)
            )
        ));
        out.push_str(&format!(
            "  vhost-user {} messages, {} errors; IOTLB {} updates, {} invalidates, {} misses sent; features {:#x}\n",
            port.n("messages"),
            port.n("errors"),
            port.n("iotlb_updates"),
            port.n("iotlb_invalidates"),
            port.n("iotlb_misses_sent"),
            port.n("features"),
        ));
        out.push_str(&format!(
            "  net        {} frames sent, {} received, {} dropped\n",
            port.n("tx_frames"),
            port.n("rx_frames"),
            port.n("rx_dropped"),
        ));
        rings_table(&mut out, &mut snapshot.rings_of(port));
    }
    match &snapshot.fabric {
        None => out.push_str("\nfabric     none\n"),
        Some(fabric) => {
            let f = &fabric.link;
            let sent = f.n("datagrams_sent");
            let rate = |n: u64| percent(n, sent);
            out.push_str(&format!(
                "\nfabric     node {}, {} peers; operations {} started, {} completed, {} failed; {} served for peers\n",
                f.n("node"),
                f.n("peers"),
                f.n("started"),
                f.n("completed"),
                f.n("failed"),
                f.n("served"),
            ));
            out.push_str(&format!(
                "  datagrams {} sent, {} received, {} retransmitted ({:.2} %), {} dropped, {} stray, {} bad\n",
                sent,
                f.n("datagrams_received"),
                f.n("retransmissions"),
                rate(f.n("retransmissions")),
                f.n("dropped_datagrams"),
                f.n("stray_datagrams"),
                f.n("bad_messages"),
            ));
            out.push_str(&format!(
                "  memory    {} fixed, {} B per peer (and {} B of counters per peer)\n",
                bytes(f.n("memory_fixed")),
                f.n("memory_per_peer"),
                f.n("memory_peer_stats"),
            ));
            peers_table(&mut out, &fabric.peers);
        }
    }
    out
}
