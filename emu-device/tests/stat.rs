//! `pindown-stat` against a running device: the counters it shows add up
//! to the work two driver contexts did, in JSON and in the table.

mod common;

use std::process::Command;

use common::any_memory::{pair, peer_reads, peer_writes, run, ALL};
use pindown_driver::verbs::opcode::Write;
use pindown_uapi::{RemoteKey, Status};
use serde_json::Value;

fn stat(control: &std::path::Path, args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_pindown-stat"))
        .arg("--control")
        .arg(control)
        .args(args)
        .output()
        .expect("run pindown-stat");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn ports(control: &std::path::Path) -> Vec<Value> {
    let json: Value = serde_json::from_str(&stat(control, &["--json"])).unwrap();
    assert!(json["fabric"].is_null(), "{json}");
    json["ports"].as_array().unwrap().clone()
}

fn delta(after: &Value, before: &Value, key: &str) -> u64 {
    after[key]
        .as_u64()
        .unwrap_or_else(|| panic!("{key} in {after}"))
        - before[key].as_u64().unwrap()
}

#[test]
fn the_counters_shown_add_up_to_the_work_done() {
    let pair = pair();
    let control = pair._device.control_path();
    let target = pair.owner.alloc(1 << 20, 4096).unwrap();
    let region = pair.owner.register_buffer(&target).unwrap();
    let window = pair.owner.bind_window(&region, 0, 1 << 20, ALL).unwrap();
    let before = ports(&control);
    assert_eq!(before.len(), 2);
    let sizes = [1usize, 64, 4096, 65_537, 1 << 20];
    for (i, &len) in sizes.iter().enumerate() {
        peer_writes(&pair, &window, 0, &vec![i as u8; len]);
    }
    let read = peer_reads(&pair, &window, 3, 1000);
    assert_eq!(read.len(), 1000);
    // A write with a key nobody bound: refused at the owner, failed at
    // the peer.
    let source = pair.peer.alloc(8, 64).unwrap();
    let source_region = pair.peer.register_buffer(&source).unwrap();
    let mut forged = window.remote().at(0);
    forged.key = RemoteKey(forged.key.0 ^ 0x5a5a_0000);
    let done = run(
        &pair.peer,
        Write::new(source_region.local(0, 8).unwrap(), forged).build(),
    );
    assert_eq!(done.status, Status::RemoteAccessError, "{done:?}");
    let after = ports(&control);
    let (owner, peer) = (0, 1);
    assert_eq!(
        delta(&after[peer], &before[peer], "requests_write"),
        sizes.len() as u64 + 1
    );
    assert_eq!(delta(&after[peer], &before[peer], "requests_read"), 1);
    assert_eq!(
        delta(&after[peer], &before[peer], "bytes"),
        sizes.iter().sum::<usize>() as u64 + 1000
    );
    assert_eq!(
        delta(&after[peer], &before[peer], "failed_remote_access"),
        1
    );
    assert_eq!(delta(&after[owner], &before[owner], "refused_bad_key"), 1);
    assert_eq!(delta(&after[owner], &before[owner], "requests_write"), 0);
    assert_eq!(after[owner]["windows"], 1, "{}", after[owner]);
    assert!(after[owner]["mapped_bytes"].as_u64().unwrap() >= 1 << 20);
    assert_eq!(after[owner]["connected"], 1);

    // The table says the same, and --watch refreshes.
    let table = stat(&control, &[]);
    assert!(table.contains("requests"), "{table}");
    let peer_row = table
        .lines()
        .find(|l| l.starts_with("1 "))
        .unwrap_or_else(|| panic!("no row for port 1:\n{table}"));
    let requests: u64 = after[peer]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| k.starts_with("requests_"))
        .map(|(_, v)| v.as_u64().unwrap())
        .sum();
    assert!(
        peer_row
            .split_whitespace()
            .any(|w| w == requests.to_string()),
        "{peer_row} should show {requests} requests"
    );
    assert!(table.contains("fabric     none"), "{table}");
    let watched = stat(&control, &["--watch", "0.05", "--count", "2"]);
    assert_eq!(watched.matches("\nport 1\n").count(), 2, "{watched}");
    drop(window);
}

#[test]
fn a_device_that_is_not_there_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_pindown-stat"))
        .arg("--dir")
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("control.sock"), "{err}");
}
