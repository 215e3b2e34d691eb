//! The status socket's answers: one line per port (`status`) or for the
//! fabric link (`fabric`), `key=value` pairs. Read by `pindown-stat`
//! and the tests.

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

/// Asks the device listening on `control` for `command` (`status` or
/// `fabric`) and returns its answer.
pub fn query(control: &Path, command: &str) -> io::Result<String> {
    let mut stream = UnixStream::connect(control)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.write_all(format!("{command}\n").as_bytes())?;
    let mut text = String::new();
    stream.read_to_string(&mut text)?;
    Ok(text)
}
