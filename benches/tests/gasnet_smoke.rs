//! `gasnet --quick` as CI runs it: one JSON document with every figure of
//! the GASNet paper's experiments measured by our ranks (short-AM round
//! trip, long-AM ping-pong, raw RDMA write ping-pong, get native and by message, halo
//! faces, Himeno) and by each installed MPI, the ratios recomputable from
//! the figures they name, and Himeno's residual the same on both sides.

mod common;

use pindown_benches::report::sections::messaging;
use serde_json::Value;

fn number(value: &Value, key: &str) -> f64 {
    value[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} is not a number in {value}"))
}

fn list<'a>(value: &'a Value, key: &str) -> &'a Vec<Value> {
    value[key]
        .as_array()
        .unwrap_or_else(|| panic!("{key} is not a list in {value}"))
}

fn sizes(figures: &[Value]) -> Vec<u64> {
    figures
        .iter()
        .map(|f| f["bytes"].as_u64().unwrap())
        .collect()
}

#[test]
fn quick_gasnet_prints_every_figure_beside_the_mpis() {
    let report = common::run_report(env!("CARGO_BIN_EXE_gasnet"), &["--quick"]);
    assert_eq!(report["benchmark"], "gasnet");
    assert_eq!(report["verified"], true);
    let ours = &report["pindown"];

    let am = list(ours, "am_pingpong");
    let raw = list(ours, "rdma_write_pingpong");
    assert!(!am.is_empty());
    assert_eq!(sizes(am), sizes(raw));
    assert_eq!(sizes(am), sizes(list(ours, "get_native")));
    assert_eq!(sizes(am), sizes(list(ours, "get_by_message")));
    assert!(sizes(am).contains(&8));
    for figure in am.iter().chain(raw).chain(list(ours, "get_native")) {
        assert!(number(figure, "latency_us") > 0.0, "{figure}");
    }
    for figure in list(ours, "get_native") {
        assert_eq!(figure["mode"], "native");
    }
    for figure in list(ours, "get_by_message") {
        assert_eq!(figure["mode"], "message");
    }

    // Every face of every N, each checked.
    let halo = list(ours, "halo");
    let faces: Vec<(u64, &str)> = halo
        .iter()
        .map(|f| (f["n"].as_u64().unwrap(), f["face"].as_str().unwrap()))
        .collect();
    assert!(!faces.is_empty());
    for &(n, _) in &faces {
        for face in ["block", "blockstride", "stride"] {
            assert!(faces.contains(&(n, face)), "{n} {face} in {faces:?}");
        }
    }
    for figure in halo {
        assert_eq!(figure["verified"], true, "{figure}");
        assert_eq!(number(figure, "bytes"), number(figure, "n").powi(2) * 8.0);
        assert!(number(figure, "time_us") > 0.0);
    }
    let himeno = list(ours, "himeno");
    assert!(!himeno.is_empty());
    for figure in himeno {
        assert!(number(figure, "gosa") > 0.0 && number(figure, "iterations_per_s") > 0.0);
    }

    // The descriptor cache: every lookup a hit or a miss; first come keeps
    // the fixed transfers it saw first, whatever else passes.
    let cache = list(&report, "descriptor_cache");
    assert_eq!(cache.len(), 6);
    for figure in cache {
        assert_eq!(
            number(figure, "hits") + number(figure, "misses"),
            number(figure, "lookups"),
            "{figure}"
        );
        if figure["policy"] == "FirstCome" {
            assert_eq!(number(figure, "evictions"), 0.0, "{figure}");
            let iterations = number(figure, "iterations");
            assert_eq!(
                number(figure, "hot_hit_rate"),
                (iterations - 1.0) / iterations,
                "{figure}"
            );
        }
    }

    // The AM target's ratio is the one its figures give: the short-AM round
    // trip over twice the 8-byte raw write's one-way time.
    let targets = list(&report, "targets");
    let am_target = targets
        .iter()
        .find(|t| {
            t["target"]
                .as_str()
                .is_some_and(|s| s.starts_with("AM round trip"))
        })
        .expect("the AM round-trip target");
    let short = &list(ours, "am_short_round_trip")[0];
    let raw_eight = number(
        raw.iter().find(|f| f["bytes"] == 8).expect("8 bytes"),
        "latency_us",
    );
    let ratio = number(short, "round_trip_us") / (2.0 * raw_eight);
    assert!((number(am_target, "ratio") - ratio).abs() <= 1e-9 * ratio);
    assert_eq!(am_target["met"], ratio <= 2.0);

    // Each installed MPI measured the same sizes and agrees on Himeno.
    let mut measured = Vec::new();
    if !cfg!(openmpi_missing) {
        measured.push("openmpi");
    }
    if !cfg!(mpich_missing) {
        measured.push("mpich");
    }
    for name in measured {
        let peer = &report["mpi"][name];
        assert_eq!(sizes(list(peer, "pingpong")), sizes(am), "{name}");
        assert_eq!(sizes(list(peer, "get")), sizes(am), "{name}");
        assert!(!list(peer, "halo").is_empty());
        let himeno_checks: Vec<&Value> = targets
            .iter()
            .filter(|t| {
                t["figure"]
                    .as_str()
                    .is_some_and(|s| s.starts_with("Himeno") && s.ends_with(name))
            })
            .collect();
        assert_eq!(himeno_checks.len(), himeno.len(), "{name}");
        for check in himeno_checks {
            assert_eq!(check["agree"], true, "{check}");
            let (a, b) = (number(check, "ours_gosa"), number(check, "mpi_gosa"));
            assert!((a - b).abs() <= 1e-5 * a.abs(), "{check}");
        }
        let halo_target = targets
            .iter()
            .find(|t| {
                t["target"]
                    .as_str()
                    .is_some_and(|s| s.starts_with("halo") && s.contains(name))
            })
            .expect("the halo target");
        assert_eq!(list(halo_target, "points").len(), halo.len(), "{name}");
    }
    report_sections(&report);
}

/// The report's `gasnet` section built from this document: every figure
/// has our points and a series per MPI, every row our number, each MPI's
/// numbers present exactly when the document says it ran, and the rows
/// carry the document's own figures.
fn report_sections(report: &Value) {
    let sections = messaging::gasnet(report).expect("the gasnet section builds");
    assert_eq!(sections.len(), 1);
    let section = &sections[0];
    common::section_shows_the_peers(section, report, "gasnet-", &["gasnet-descriptor-cache"]);
    for row in &section.rows {
        assert!(row.paper.is_some(), "{}", row.what);
    }
    // The rows carry the document's numbers, not copies.
    let row = |what: &str| {
        section
            .rows
            .iter()
            .find(|r| r.what.starts_with(what))
            .unwrap_or_else(|| panic!("no row {what}"))
    };
    let ours = &report["pindown"];
    let eight = |name: &str, key: &str| {
        number(
            list(ours, name).iter().find(|f| f["bytes"] == 8).unwrap(),
            key,
        )
    };
    assert_eq!(
        row("short AM round trip").ours,
        Some(number(
            &list(ours, "am_short_round_trip")[0],
            "round_trip_us"
        ))
    );
    assert_eq!(
        row("short AM round trip").limit.as_ref().unwrap().value,
        Some(2.0 * eight("rdma_write_pingpong", "latency_us"))
    );
    assert_eq!(
        row("long-AM one-way latency, 8 B").ours,
        Some(eight("am_pingpong", "latency_us"))
    );
    assert_eq!(
        row("get latency, native, 8 B").ours,
        Some(eight("get_native", "latency_us"))
    );
    let peak = list(ours, "am_pingpong")
        .iter()
        .map(|f| number(f, "bandwidth_gbs"))
        .fold(0.0, f64::max);
    assert_eq!(row("long-AM peak bandwidth").ours, Some(peak));
}
