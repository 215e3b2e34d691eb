//! `pindown-demo --quick --quiet --json` as CI runs it: one JSON document on
//! stdout with every section filled in, every check passed, and nothing left
//! behind.

use std::process::{Command, Stdio};

use serde_json::Value;

fn number(value: &Value, path: &str) -> f64 {
    value
        .pointer(path)
        .and_then(Value::as_f64)
        .unwrap_or_else(|| panic!("{path} is not a number in {value}"))
}

#[test]
fn quick_demo_prints_complete_json_and_passes_verification() {
    let child = Command::new(env!("CARGO_BIN_EXE_pindown-demo"))
        .args(["--quick", "--quiet", "--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start pindown-demo");
    let pid = child.id();
    let output = child.wait_with_output().expect("run pindown-demo");
    let stdout = String::from_utf8(output.stdout).expect("utf-8 on stdout");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "exit {}; stderr: {stderr}; stdout: {stdout}",
        output.status
    );
    assert!(stderr.is_empty(), "--quiet, yet stderr says: {stderr}");
    let report: Value = serde_json::from_str(&stdout).expect("one JSON document");

    assert_eq!(report["program"], "pindown-demo");
    assert_eq!(report["verified"], true);
    assert_eq!(report["plan"]["quick"], true);
    let idle = report["memcpy_idle"].as_array().expect("memcpy_idle");
    assert_eq!(idle.len(), 2);
    let modes = report["modes"].as_array().expect("modes");
    let names: Vec<&str> = modes.iter().filter_map(|m| m["mode"].as_str()).collect();
    assert_eq!(names, ["event", "poll"]);
    for mode in modes {
        let name = &mode["mode"];
        assert_eq!(mode["verified"], true, "{name}: {mode}");
        assert!(mode["error"].is_null(), "{name}: {}", mode["error"]);
        assert_eq!(number(mode, "/verification/failed"), 0.0, "{name}");
        assert!(number(mode, "/verification/checks") >= 20.0, "{name}");

        let transfers = mode["transfers"].as_array().expect("transfers");
        for op in ["write", "read"] {
            let sizes: Vec<f64> = transfers
                .iter()
                .filter(|t| t["op"] == op)
                .map(|t| number(t, "/bytes"))
                .collect();
            assert!(sizes.contains(&8.0), "{name} {op}: {sizes:?}");
            assert!(sizes.contains(&16777216.0), "{name} {op}: {sizes:?}");
        }
        assert!(transfers.iter().all(|t| t["verified"] == true), "{name}");

        assert_eq!(mode["atomics"]["ok"], true, "{name}");
        assert_eq!(number(mode, "/atomics/counter_final"), 11.0, "{name}");

        let latency = number(mode, "/write_8b_latency_us/median");
        let p99 = number(mode, "/write_8b_latency_us/p99");
        assert!(latency > 0.0 && p99 >= latency, "{name}: {latency} {p99}");
        assert!(number(mode, "/write_8b_latency_us/samples") >= 1000.0);

        let bandwidth = mode["bandwidth"].as_array().expect("bandwidth");
        let sizes: Vec<f64> = bandwidth.iter().map(|b| number(b, "/bytes")).collect();
        assert_eq!(sizes, [1048576.0, 16777216.0], "{name}");
        for b in bandwidth {
            assert!(number(b, "/gb_per_s/median") > 0.0, "{name}: {b}");
            assert!(number(b, "/memcpy_gb_per_s/median") > 0.0, "{name}: {b}");
            assert!(number(b, "/over_memcpy") > 0.0, "{name}: {b}");
            assert!(number(b, "/over_idle_memcpy") > 0.0, "{name}: {b}");
            assert_eq!(b["verified"], true, "{name}");
        }

        // Every transfer registered its memory anew: almost all hits.
        let hits = number(mode, "/pin_cache/hits");
        let misses = number(mode, "/pin_cache/misses");
        assert!(
            hits > 100.0 * misses,
            "{name}: {hits} hits, {misses} misses"
        );
        assert!(number(mode, "/pin_cache/hit_rate") > 0.99, "{name}");
    }
    let targets = report["targets"].as_array().expect("targets");
    // Per mode: 1 MiB and 16 MiB bandwidth, 8-byte write and fetch-add
    // latency.
    assert_eq!(targets.len(), 2 * 4);
    for target in targets {
        assert!(target["measured"].is_number(), "{target}");
        assert!(target["met"].is_boolean(), "{target}");
    }

    // The devices' socket directories are gone.
    let prefix = format!("pindown-{pid}-");
    let leftovers: Vec<_> = std::fs::read_dir(std::env::temp_dir())
        .expect("temp dir")
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        .map(|e| e.path())
        .collect();
    assert!(leftovers.is_empty(), "left behind: {leftovers:?}");
}

#[test]
fn quick_demo_without_json_prints_a_summary_a_person_can_read() {
    let output = Command::new(env!("CARGO_BIN_EXE_pindown-demo"))
        .args(["--quick", "--quiet", "--mode", "event"])
        .output()
        .expect("run pindown-demo");
    let stdout = String::from_utf8(output.stdout).expect("utf-8 on stdout");
    assert!(output.status.success(), "{stdout}");
    assert!(
        serde_json::from_str::<Value>(&stdout).is_err(),
        "not JSON: {stdout}"
    );
    let lines: Vec<&str> = stdout.lines().collect();
    assert!(lines.len() < 30, "short: {stdout}");
    assert!(stdout.contains("event mode: verified ("), "{stdout}");
    assert!(stdout.contains(" 0 failed)"), "{stdout}");
    assert!(stdout.contains("8-byte RDMA write: "), "{stdout}");
    assert!(stdout.contains("x memcpy"), "{stdout}");
    assert!(stdout.contains("pin-down cache: "), "{stdout}");
    assert!(stdout.contains("targets: "), "{stdout}");
    assert!(
        stdout.trim_end().ends_with("the whole report: --json"),
        "{stdout}"
    );
    assert!(stdout.contains("everything verified in "), "{stdout}");
}
