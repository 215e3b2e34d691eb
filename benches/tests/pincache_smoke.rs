//! `pin-cost`, `pin-hitrate`, `register-cost` and `barrier-wait` run in
//! `--quick`, and their documents become report sections: every figure has
//! pindown's points, every row pindown's number, and `pin-cost` carries
//! UCX's registration cache, measured, beside its own figures.

mod common;

use std::collections::HashSet;

use pindown_benches::report::figure::{Role, Section};
use pindown_benches::report::sections::pincache;
use serde_json::Value;

/// What every section must hold: figures with an Ours series that has
/// points, ids unique and prefixed by the program, each row with pindown's
/// number.
fn check_sections(program: &str, sections: &[Section]) {
    assert!(!sections.is_empty(), "{program}: no section");
    let mut ids = HashSet::new();
    for section in sections {
        assert!(!section.figures.is_empty(), "{}: no figure", section.title);
        assert!(!section.rows.is_empty(), "{}: no row", section.title);
        for figure in &section.figures {
            assert!(
                figure.id.starts_with(program) && ids.insert(figure.id.clone()),
                "figure id {} (program {program})",
                figure.id
            );
            assert!(
                figure
                    .series
                    .iter()
                    .any(|s| s.role == Role::Ours && !s.points.is_empty()),
                "{}: no pindown points",
                figure.id
            );
            for series in &figure.series {
                for &(x, y) in &series.points {
                    assert!(
                        x.is_finite() && y.is_finite(),
                        "{}: {}",
                        figure.id,
                        series.name
                    );
                    assert!(
                        (!figure.x.log || x > 0.0) && (!figure.y.log || y > 0.0),
                        "{}: {} has ({x}, {y}) on a log axis",
                        figure.id,
                        series.name
                    );
                }
            }
        }
        for row in &section.rows {
            assert!(
                row.ours.is_some_and(f64::is_finite),
                "{}: no pindown number",
                row.what
            );
        }
    }
}

fn run(exe: &str, args: &[&str]) -> Value {
    common::run_report(exe, args)
}

#[test]
#[cfg_attr(
    ucx_missing,
    ignore = "UCX's rcache.h or cc is missing (apt-get install libucx-dev gcc); fails under CI=true"
)]
fn pin_cost_measures_ucx_rcache_beside_pindown_on_the_same_sizes() {
    let doc = run(
        env!("CARGO_BIN_EXE_pin-cost"),
        &["--quick", "--quiet", "--max-pages", "64"],
    );
    let ucx = &doc["ucx"];
    assert_eq!(ucx["status"], "measured", "{ucx}");
    assert_eq!(ucx["header"]["pin"], "mlock", "{ucx}");
    let ours: Vec<u64> = doc["sizes"]
        .as_array()
        .expect("sizes")
        .iter()
        .map(|s| common::integer(s, "pages"))
        .collect();
    let sizes = ucx["sizes"].as_array().expect("ucx.sizes");
    let theirs: Vec<u64> = sizes.iter().map(|s| common::integer(s, "pages")).collect();
    assert_eq!(theirs, ours, "UCX measured other sizes than pindown");
    assert_eq!(ours, [1, 2, 4, 8, 16, 32, 64]);
    for size in sizes {
        assert_eq!(size["verified"], Value::Bool(true), "{size}");
        let miss = common::positive(size, "miss_us");
        let hit_us = common::positive(size, "hit_ns") / 1e3;
        common::positive(size, "invalidate_us");
        common::positive(size, "raw_mlock_us");
        // A miss pins (a system call); a hit only looks up.
        assert!(hit_us < miss, "{size}");
        assert_eq!(
            common::integer(size, "bytes"),
            common::integer(size, "pages") * common::integer(&doc["machine"], "page_size")
        );
    }
    common::positive(ucx, "hit_us");
    assert!(ucx["fit"]["miss_us"]["b"].as_f64().is_some(), "{ucx}");

    let sections = pincache::pin_cost(&doc).expect("pin-cost sections");
    check_sections("pin-cost", &sections);
    let section = &sections[0];
    assert!(
        !section.missing.iter().any(|m| m.contains("UCX")),
        "{:?}",
        section.missing
    );
    let ucx_values: Vec<f64> = section
        .rows
        .iter()
        .flat_map(|r| &r.peers)
        .filter(|p| p.name.contains("UCX"))
        .map(|p| p.value.expect("UCX measured: every UCX value present"))
        .collect();
    assert!(ucx_values.len() >= 4, "{ucx_values:?}");
    let table2 = &section.figures[0];
    for name in ["UCX rcache miss (mlock)", "UCX rcache hit"] {
        let series = table2
            .series
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("no series {name}"));
        assert_eq!(series.role, Role::Peer);
        assert_eq!(series.points.len(), ours.len(), "{name}");
        assert!(series.points.iter().all(|&(_, y)| y > 0.0), "{name}");
    }
    // The paper's line comes from the document's reference, not the plot's.
    let paper = table2
        .series
        .iter()
        .find(|s| s.role == Role::Paper)
        .expect("paper series");
    let a = doc["reference_pm_table2"]["miss_a_us"].as_f64().unwrap();
    let b = doc["reference_pm_table2"]["miss_b_us_per_page"]
        .as_f64()
        .unwrap();
    assert_eq!(paper.points[0], (1.0, a + b));
}

#[test]
fn pin_hitrate_document_builds_figure4_and_hit_rates() {
    let doc = run(env!("CARGO_BIN_EXE_pin-hitrate"), &["--quick", "--quiet"]);
    let sections = pincache::pin_hitrate(&doc).expect("pin-hitrate sections");
    check_sections("pin-hitrate", &sections);
    let figure4 = &sections[0].figures[0];
    assert_eq!(figure4.reproduces, "PM, figure 4");
    let ours = &figure4.series[0].points;
    // Hit rates from 0 to 100 %, and more hits never cost bandwidth by
    // more than noise: the 100 % run beats the 0 % run.
    assert_eq!(ours.first().map(|p| p.0), Some(0.0));
    assert_eq!(ours.last().map(|p| p.0), Some(100.0));
    assert!(ours.last().unwrap().1 > ours.first().unwrap().1, "{ours:?}");
    assert!(figure4.series.iter().any(|s| s.role == Role::Limit));
    assert!(figure4.series.iter().any(|s| s.role == Role::Paper));
}

#[test]
fn register_cost_document_builds_zero_copy_against_copying() {
    let doc = run(env!("CARGO_BIN_EXE_register-cost"), &["--quick", "--quiet"]);
    let sections = pincache::register_cost(&doc).expect("register-cost sections");
    check_sections("register-cost", &sections);
    let bandwidth = &sections[0].figures[0];
    assert_eq!(bandwidth.reproduces, "PM, figures 2 and 5");
    for role in [Role::Ours, Role::Peer, Role::Limit, Role::Paper] {
        assert!(
            bandwidth
                .series
                .iter()
                .any(|s| s.role == role && !s.points.is_empty()),
            "{role:?}"
        );
    }
    // Every copying path was measured: its values are present.
    assert!(sections[0]
        .rows
        .iter()
        .flat_map(|r| &r.peers)
        .all(|p| p.value.is_some_and(|v| v > 0.0)));
    assert!(sections[0].missing.is_empty(), "{:?}", sections[0].missing);
}

#[test]
fn barrier_wait_document_builds_the_trust_figures() {
    let doc = run(env!("CARGO_BIN_EXE_barrier-wait"), &["--quick", "--quiet"]);
    let sections = pincache::barrier_wait(&doc).expect("barrier-wait sections");
    check_sections("barrier-wait", &sections);
    let limits: Vec<_> = sections[0]
        .rows
        .iter()
        .filter_map(|r| r.limit.as_ref())
        .collect();
    assert!(limits.iter().all(|l| l.value.is_some_and(|v| v > 0.0)));
}
