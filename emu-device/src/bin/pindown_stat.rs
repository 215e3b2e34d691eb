//! `pindown-stat`: what a running device is doing, in the spirit of
//! `ibv_devinfo` and `rdma statistic`: its ports and their frontends,
//! RDMA work by kind with bytes and failures, refused accesses, windows,
//! mapped memory and IOTLB entries, and the fabric link's counters. A
//! table by default, `--json` for programs, `--watch SECONDS` to refresh.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use pindown_emu_device::port::{FAILURE_KINDS, WORK_KINDS};
use pindown_emu_device::rdma::RefusalCounters;
use pindown_emu_device::status::{parse_status, query, PortStatus};
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
            Ok((ports, fabric)) => {
                if args.json {
                    println!("{}", to_json(&control, &ports, fabric.as_ref()));
                } else {
                    if args.watch.is_some() {
                        // Clear the screen and go home, as `watch` does.
                        print!("\x1b[2J\x1b[H");
                    }
                    print!("{}", table(&control, &ports, fabric.as_ref()));
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

/// Every port's status and the fabric line (`None` without a fabric).
fn snapshot(control: &std::path::Path) -> std::io::Result<(Vec<PortStatus>, Option<PortStatus>)> {
    let ports = parse_status(&query(control, "status")?);
    let fabric = parse_status(&query(control, "fabric")?)
        .into_iter()
        .next()
        .filter(|line| line.fields.contains_key("node"));
    Ok((ports, fabric))
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

fn to_json(control: &std::path::Path, ports: &[PortStatus], fabric: Option<&PortStatus>) -> Value {
    json!({
        "control": control.display().to_string(),
        "ports": ports.iter().map(object).collect::<Vec<_>>(),
        "fabric": fabric.map(object),
    })
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

fn table(control: &std::path::Path, ports: &[PortStatus], fabric: Option<&PortStatus>) -> String {
    let mut out = format!("device {}\n\n", control.display());
    out.push_str(&format!(
        "{:<5} {:<10} {:<18} {:>10} {:>11} {:>7} {:>8} {:>8} {:>11} {:>6}\n",
        "port",
        "frontend",
        "mac",
        "requests",
        "bytes",
        "failed",
        "refused",
        "windows",
        "mapped",
        "iotlb"
    ));
    for port in ports {
        let frontend = if port.n("connected") == 1 {
            format!("yes ({})", port.n("connections"))
        } else {
            format!("no ({})", port.n("connections"))
        };
        out.push_str(&format!(
            "{:<5} {:<10} {:<18} {:>10} {:>11} {:>7} {:>8} {:>8} {:>11} {:>6}\n",
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
    }
    match fabric {
        None => out.push_str("\nfabric     none\n"),
        Some(f) => {
            let sent = f.n("datagrams_sent");
            let rate = |n: u64| {
                if sent == 0 {
                    0.0
                } else {
                    100.0 * n as f64 / sent as f64
                }
            };
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
                "  memory    {} fixed, {} per peer\n",
                bytes(f.n("memory_fixed")),
                f.n("memory_per_peer"),
            ));
        }
    }
    out
}
