//! `latency --quick` on a few sizes, as a reader of its figures would run
//! it: one JSON document with every figure measured, checked and set
//! beside its baseline, and the memory kind a figure was measured on named.

mod common;

use std::process::{Command, Stdio};

use pindown_benches::report::sections::rdma::latency;
use pindown_benches::report::Role;
use serde_json::Value;

fn number(value: &Value, path: &str) -> f64 {
    value
        .pointer(path)
        .and_then(Value::as_f64)
        .unwrap_or_else(|| panic!("{path} is not a number in {value}"))
}

#[test]
fn quick_latency_prints_every_figure_with_its_baseline() {
    let report = common::run_report(
        env!("CARGO_BIN_EXE_latency"),
        &["--quick", "--quiet", "--samples", "300", "--sizes", "8,300"],
    );
    assert_eq!(report["program"], "latency");
    assert_eq!(report["verified"], true);
    let modes = report["modes"].as_array().expect("modes");
    let names: Vec<&str> = modes.iter().filter_map(|m| m["mode"].as_str()).collect();
    assert_eq!(names, ["event", "poll"]);
    for mode in modes {
        assert!(number(mode, "/ping_pong_us/median") > 0.0);
        let kinds = mode["kinds"].as_array().expect("kinds");
        assert_eq!(kinds.len(), 1);
        assert_eq!(kinds[0]["memory"], "arena");
        assert!(kinds[0]["error"].is_null(), "{}", kinds[0]["error"]);
        let figures = kinds[0]["latency"].as_array().expect("latency");
        let ops: Vec<(&str, f64)> = figures
            .iter()
            .map(|f| (f["op"].as_str().unwrap(), number(f, "/bytes")))
            .collect();
        for expected in [
            ("write", 8.0),
            ("write_inline", 8.0),
            ("read", 8.0),
            ("write", 300.0),
            ("write_inline", 300.0),
            ("read", 300.0),
            ("fetch_add", 8.0),
        ] {
            assert!(ops.contains(&expected), "{expected:?} in {ops:?}");
        }
        for figure in figures {
            assert_eq!(figure["verified"], true, "{figure}");
            assert_eq!(number(figure, "/us/samples"), 300.0);
            let median = number(figure, "/us/median");
            let baseline = number(figure, "/ping_pong_us/median");
            assert!(median > 0.0 && baseline > 0.0, "{figure}");
            let ratio = number(figure, "/median_over_ping_pong");
            assert!((ratio - median / baseline).abs() < 1e-9 * ratio.max(1.0));
        }
        let bandwidth = kinds[0]["bandwidth"].as_array().expect("bandwidth");
        let sizes: Vec<f64> = bandwidth.iter().map(|b| number(b, "/bytes")).collect();
        assert_eq!(sizes, [4096.0, 65536.0, 1048576.0, 16777216.0]);
        for figure in bandwidth {
            assert_eq!(figure["verified"], true, "{figure}");
            assert!(number(figure, "/gb_per_s/median") > 0.0);
            assert!(number(figure, "/over_idle_memcpy") > 0.0);
        }
    }
    let targets = report["targets"].as_array().expect("targets");
    assert!(!targets.is_empty());
    for target in targets {
        assert!(target["met"].is_boolean(), "{target}");
    }
    report_section(&report, targets.len());
}

/// The report's section of the document: a latency plot per mode and a
/// bandwidth plot, each with pindown's measured points; one row per
/// target, each with ours and the baseline it is measured against.
fn report_section(report: &Value, targets: usize) {
    let sections = latency(report).expect("the document builds its section");
    assert_eq!(sections.len(), 1);
    let section = &sections[0];
    assert!(section.missing.is_empty(), "{:?}", section.missing);
    let ids: Vec<&str> = section.figures.iter().map(|f| f.id.as_str()).collect();
    assert_eq!(
        ids,
        [
            "latency-arena-event",
            "latency-arena-poll",
            "latency-arena-bandwidth"
        ]
    );
    for figure in &section.figures {
        let ours: Vec<_> = figure
            .series
            .iter()
            .filter(|s| s.role == Role::Ours)
            .collect();
        assert!(!ours.is_empty(), "{}", figure.id);
        for series in ours {
            assert!(!series.points.is_empty(), "{}: {}", figure.id, series.name);
        }
        let limit = figure
            .series
            .iter()
            .find(|s| s.role == Role::Limit)
            .unwrap_or_else(|| panic!("{} has no limit", figure.id));
        assert!(limit.points.iter().all(|&(_, y)| y > 0.0), "{}", figure.id);
    }
    // The event-driven write line holds the document's medians, by size.
    let writes = &section.figures[0].series[0];
    assert_eq!(writes.name, "write, median");
    let medians: Vec<(f64, f64)> = report["modes"][0]["kinds"][0]["latency"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["op"] == "write")
        .map(|f| (number(f, "/bytes"), number(f, "/us/median")))
        .collect();
    assert_eq!(writes.points, medians);
    assert_eq!(section.rows.len(), targets);
    for (row, target) in section
        .rows
        .iter()
        .zip(report["targets"].as_array().unwrap())
    {
        let ours = row
            .ours
            .unwrap_or_else(|| panic!("{} has no value", row.what));
        let limit = row
            .limit
            .as_ref()
            .and_then(|l| l.value)
            .unwrap_or_else(|| panic!("{} has no baseline", row.what));
        // What the target measures is ours against the row's baseline.
        let measured = number(target, "/measured");
        let what = target["what"].as_str().unwrap();
        if what.ends_with("median us") {
            assert_eq!(ours, measured, "{what}");
        } else {
            assert!((ours / limit - measured).abs() <= 1e-9 * measured, "{what}");
        }
    }
}

#[test]
fn heap_memory_is_a_kind_of_its_own() {
    let output = Command::new(env!("CARGO_BIN_EXE_latency"))
        .args([
            "--quick",
            "--quiet",
            "--mode",
            "poll",
            "--memory",
            "arena,heap",
            "--samples",
            "100",
            "--sizes",
            "8",
            "--no-bandwidth",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .output()
        .expect("run latency");
    let report: Value = serde_json::from_slice(&output.stdout).expect("one JSON document");
    let kinds = report["modes"][0]["kinds"].as_array().expect("kinds");
    let names: Vec<&str> = kinds.iter().filter_map(|k| k["memory"].as_str()).collect();
    assert_eq!(names, ["arena", "heap"]);
    assert!(kinds[0]["error"].is_null());
    // Heap memory is measured once the driver registers it, or the reason
    // it cannot is given; the exit status says which.
    let heap_measured = kinds[1]["error"].is_null();
    assert_eq!(output.status.success(), heap_measured, "{}", kinds[1]);
}
