//! The messaging libraries across two device processes joined into one
//! fabric over loopback UDP, whose links lose and reorder datagrams: no
//! root and no launcher needed (the ranks are started here with the
//! environment launcher's variables), so every `cargo test` sends
//! messages across a fabric. `hosts.rs` runs the whole suite across
//! network namespaces under Hydra (as root).
//!
//! Rank r talks to port r / 2 of node r % 2: neighbours in rank order
//! sit on different nodes.

mod common;

use std::fs::File;
use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use pindown_emu_device::testing::{fabric_args, free_udp_port, DeviceProcess};
use serde_json::Value;

const TOKEN: &str = "100b0ac";
const NODES: usize = 2;
const RANKS: usize = 4;
/// A job still running after this long has hung: it fails the test.
const JOB_LIMIT: Duration = Duration::from_secs(180);

/// Two device processes on loopback UDP, each with `extra` arguments.
fn start_nodes(extra: &[&str]) -> Vec<DeviceProcess> {
    let udp = [free_udp_port(), free_udp_port()];
    (0..NODES)
        .map(|node| {
            let mut args = fabric_args(node as u16, &udp, TOKEN);
            args.extend(extra.iter().map(|a| a.to_string()));
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            DeviceProcess::start(&common::msg_check(), RANKS / NODES, &args)
                .unwrap_or_else(|e| panic!("node {node}: {e}"))
        })
        .collect()
}

/// Runs `program rank scenario args` on the ranks, started with the
/// environment launcher's variables (a fresh key-value folder per job);
/// every rank must report success and exit with it within
/// [`JOB_LIMIT`]. Their output goes to files (a rank never blocks on a
/// full pipe), and a rank left running is killed.
fn run_job(devices: &[DeviceProcess], program: &Path, scenario: &str, args: &[&str]) -> Vec<Value> {
    let job = tempfile::tempdir().unwrap();
    let kv = job.path().join("kv");
    std::fs::create_dir(&kv).unwrap();
    let output = |rank: usize, stream: &str| job.path().join(format!("{rank}.{stream}"));
    let mut ranks = Ranks(Vec::new());
    for rank in 0..RANKS {
        let mut command = Command::new(program);
        common::without_launcher_variables(&mut command);
        let child = command
            .arg("rank")
            .arg(scenario)
            .args(args)
            .env("PINDOWN_RANK", rank.to_string())
            .env("PINDOWN_SIZE", RANKS.to_string())
            .env("PINDOWN_KV_DIR", &kv)
            .env("PINDOWN_DEVICE", devices[rank % NODES].socket(rank / NODES))
            .stdout(File::create(output(rank, "out")).unwrap())
            .stderr(File::create(output(rank, "err")).unwrap())
            .spawn()
            .unwrap_or_else(|e| panic!("start rank {rank}: {e}"));
        ranks.0.push(child);
    }
    let started = Instant::now();
    let mut statuses = [None; RANKS];
    while statuses.iter().any(Option::is_none) && started.elapsed() <= JOB_LIMIT {
        for (status, child) in statuses.iter_mut().zip(&mut ranks.0) {
            if status.is_none() {
                *status = child.try_wait().unwrap();
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(ranks);
    let mut lines = Vec::new();
    let mut text = String::new();
    for (rank, status) in statuses.iter().enumerate() {
        let stdout = std::fs::read_to_string(output(rank, "out")).unwrap_or_default();
        let stderr = std::fs::read_to_string(output(rank, "err")).unwrap_or_default();
        text += &format!("rank {rank} ({status:?}):\n{stdout}{stderr}");
        lines.extend(
            stdout
                .lines()
                .filter_map(|l| serde_json::from_str::<Value>(l).ok()),
        );
    }
    assert!(
        statuses.iter().all(|s| s.is_some_and(|s| s.success())),
        "{scenario}: a rank failed, or still ran after {JOB_LIMIT:?} and was killed:\n{text}"
    );
    lines.sort_by_key(|v| v["rank"].as_u64());
    assert_eq!(lines.len(), RANKS, "{scenario}: {text}");
    for (rank, line) in lines.iter().enumerate() {
        assert_eq!(line["rank"], rank as u64, "{text}");
        assert_eq!(line["ok"], true, "{scenario}: {text}");
        assert!(
            common::checked(line) > 0,
            "{scenario}: nothing checked: {text}"
        );
    }
    lines
}

/// Rank processes, killed (and reaped) when dropped: a test that fails
/// leaves none behind.
struct Ranks(Vec<Child>);

impl Drop for Ranks {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[test]
fn messages_cross_a_loopback_fabric_that_loses_and_reorders() {
    // Each node's link drops 10 % and reorders 30 % of what it receives.
    let devices = start_nodes(&["--fault-in", "loss=0.1,reorder=0.3,seed=5"]);
    let msg_check = common::msg_check();
    let am_check = common::example("am_check");
    // A message behind an unwaited strided put must find the put's bytes
    // in place (unfenced, the message's datagrams overtake the put's),
    // credit words written again before the last write landed must not
    // land older than it (any-source), the collectives' messages and
    // flag words cross in every direction, and global memory's barriers
    // release every rank across two incarnations.
    for (program, scenario, args) in [
        (&am_check, "notified-put", &[][..]),
        (&am_check, "handlers", &[][..]),
        (&msg_check, "any-source", &[][..]),
        (&msg_check, "any-source", &[][..]),
        (&msg_check, "collectives", &["--cases", "12"][..]),
        (&msg_check, "acp-reinit", &[][..]),
    ] {
        run_job(&devices, program, scenario, args);
    }
    for device in &devices {
        let fabric = device.fabric_status();
        assert!(fabric.n("served") > 0, "{fabric:?}");
        assert!(
            fabric.n("retransmissions") > 0,
            "no datagram lost: {fabric:?}"
        );
    }
}

/// A check of a peer that waits longer than the liveness patience on a
/// slow link is no death: the ranks' own devices keep answering, and they
/// would fail the check themselves if the peer's node stopped answering.
/// Each node delays what it receives by up to 30 ms, so that a check's
/// round trip often exceeds ten 2 ms liveness intervals.
#[test]
fn a_slow_link_is_not_a_gone_peer() {
    let devices = start_nodes(&["--fault-in", "delay=30ms,seed=11"]);
    let slow_checks = ["--liveness-ms", "2"];
    for (program, scenario) in [
        (common::msg_check(), "any-source"),
        (common::msg_check(), "split"),
        (common::example("am_check"), "notified-put"),
    ] {
        let started = Instant::now();
        run_job(&devices, &program, scenario, &slow_checks);
        eprintln!("{scenario}: {:?}", started.elapsed());
    }
}
