//! The README's message-passing quick start, as written:
//! `tools/two-hosts.sh -n 4 target/release/examples/ring` starts two
//! network-namespace hosts with a device each, joined by the fabric, and
//! runs the `ring` example under `mpiexec.hydra`.

mod common;

use std::path::Path;
use std::process::Command;

#[test]
#[cfg_attr(
    pindown_no_netns,
    ignore = "network namespaces need root and iproute2's ip"
)]
#[cfg_attr(
    pindown_no_hydra,
    ignore = "mpiexec.hydra is not installed (Debian mpich); under CI=true this test runs and fails instead"
)]
fn the_ring_runs_on_two_namespaced_hosts_under_hydra() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tools/two-hosts.sh");
    let ranks = 4u64;
    let bytes = 300_000u64;
    // A hang fails the test instead of holding it (and CI) forever.
    let output = Command::new("timeout")
        .arg("300")
        .arg(&script)
        .args(["-n", &ranks.to_string()])
        .arg(common::example("ring"))
        .arg(bytes.to_string())
        .env("PINDOWN_EMU_DEVICE", common::device_binary())
        .output()
        .expect("run tools/two-hosts.sh");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let text = format!("{stdout}{}", String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success(), "{text}");
    let mut seen: Vec<(u64, u64)> = Vec::new();
    for line in stdout.lines().filter(|l| l.starts_with("rank ")) {
        let words: Vec<&str> = line.split_whitespace().collect();
        let rank: u64 = words[1].parse().unwrap();
        let node: u64 = words[6].trim_end_matches("):").parse().unwrap();
        seen.push((rank, node));
        let previous = (rank + ranks - 1) % ranks;
        assert!(
            line.contains(&format!("{bytes} bytes from rank {previous} verified")),
            "{line}"
        );
        let sum = ranks * (ranks - 1) / 2;
        assert!(
            line.contains(&format!("= {sum} (expected {sum})")),
            "{line}"
        );
    }
    seen.sort();
    // Every rank reported, each on the host the script gave it (so every
    // message crossed the fabric).
    let wanted: Vec<(u64, u64)> = (0..ranks).map(|r| (r, r % 2)).collect();
    assert_eq!(seen, wanted, "{text}");
}
