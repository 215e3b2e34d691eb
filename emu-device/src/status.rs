//! The status socket's answers, lines of `key=value` pairs: one per port
//! (`status`), one per configured ring (`rings`), and the fabric link's
//! line followed by one per peer (`fabric`). Read by `pindown-stat` and
//! the tests.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

/// The status of one port: `key=value` pairs; numbers parsed.
#[derive(Debug, Clone, Default)]
pub struct PortStatus {
    /// Raw values.
    pub fields: HashMap<String, String>,
}

impl PortStatus {
    /// A numeric field (decimal or `0x` hex).
    pub fn get(&self, key: &str) -> Option<u64> {
        let v = self.fields.get(key)?;
        match v.strip_prefix("0x") {
            Some(h) => u64::from_str_radix(h, 16).ok(),
            None => v.parse().ok(),
        }
    }

    /// A numeric field, 0 when absent.
    pub fn n(&self, key: &str) -> u64 {
        self.get(key).unwrap_or(0)
    }

    /// A field as text.
    pub fn text(&self, key: &str) -> Option<&str> {
        self.fields.get(key).map(String::as_str)
    }
}

/// Parses the status text (one line per port).
pub fn parse_status(text: &str) -> Vec<PortStatus> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| PortStatus {
            fields: l
                .split_whitespace()
                .filter_map(|kv| kv.split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        })
        .collect()
}

/// The fabric link's answer: its own line and one per peer.
#[derive(Debug, Clone, Default)]
pub struct FabricStatus {
    /// The link's counters (`fabric node=..`).
    pub link: PortStatus,
    /// Each peer's counters (`peer node=..`), in node order.
    pub peers: Vec<PortStatus>,
}

/// Parses the answer to `fabric`; `None` when the device has no fabric.
pub fn parse_fabric(text: &str) -> Option<FabricStatus> {
    let mut link = None;
    let mut peers = Vec::new();
    for line in text.lines() {
        let (kind, rest) = line.split_once(' ').unwrap_or((line, ""));
        let Some(status) = parse_status(rest).into_iter().next() else {
            continue;
        };
        match kind {
            "fabric" if status.fields.contains_key("node") => link = Some(status),
            "peer" => peers.push(status),
            _ => {}
        }
    }
    link.map(|link| FabricStatus { link, peers })
}

/// Asks the device listening on `control` for `command` (`status`,
/// `rings` or `fabric`) and returns its answer.
pub fn query(control: &Path, command: &str) -> io::Result<String> {
    let mut stream = UnixStream::connect(control)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.write_all(format!("{command}\n").as_bytes())?;
    let mut text = String::new();
    stream.read_to_string(&mut text)?;
    Ok(text)
}
