//! The MPI peer of the FMPL figures: `benches/mpi/fmpl_compare.c` builds
//! with each MPI's own compiler wrapper and runs under that MPI's own
//! launcher in every mode (ping-pong and the table-2 preposted receives on
//! two ranks, barrier and allreduce on four, bcast on two), with few
//! iterations and small sizes. Every figure names its MPI and mode, its
//! times are positive and finite and agree with each other, and its data
//! arrived right; one wrong element sent makes the program fail, with the
//! MPI's name and the program's complaint in the error; a launch that says
//! nothing for too long is stopped.
//!
//! Each test is ignored when its MPI is not installed (the build script
//! looks), except under CI=true, where a missing MPI fails it.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{integer, positive, verified};
use pindown_benches::mpi::{self, Flavor, FmplMode, Program};
use serde_json::Value;

/// Median and p99 of one time, in order.
fn median_and_p99(figure: &Value, median: &str, p99: &str) -> f64 {
    let m = positive(figure, median);
    assert!(positive(figure, p99) >= m, "{p99} < {median} in {figure}");
    m
}

/// Equal up to the program's printed rounding (4 decimals, relative 1e-3).
fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-4 + 1e-3 * a.abs().max(b.abs())
}

fn run(flavor: Flavor, binary: &Path, ranks: usize, mode: FmplMode, args: &[&str]) -> Vec<Value> {
    let figures = mpi::run_fmpl_compare(flavor, binary, ranks, mode, args)
        .unwrap_or_else(|e| panic!("{} {}: {e}", flavor.name(), mode.name()));
    for figure in &figures {
        assert_eq!(figure["mpi"], flavor.name(), "{figure}");
        assert_eq!(figure["test"], mode.name(), "{figure}");
        assert_eq!(integer(figure, "ranks"), ranks as u64, "{figure}");
    }
    figures
}

fn every_mode_measures_and_checks(flavor: Flavor) {
    let binary = common::build(flavor, Program::FmplCompare, "mpi-fmpl-compare");
    let sizes = [8u64, 4096, 65536];
    let sizes_arg = "sizes=8,4096,65536";

    let pingpong = run(
        flavor,
        &binary,
        2,
        FmplMode::PingPong,
        &[sizes_arg, "iterations=20", "warmup=2"],
    );
    assert_eq!(pingpong.len(), sizes.len());
    for (figure, bytes) in pingpong.iter().zip(sizes) {
        assert_eq!(integer(figure, "bytes"), bytes, "{figure}");
        assert_eq!(integer(figure, "iterations"), 20, "{figure}");
        verified(figure);
        let one_way = median_and_p99(figure, "one_way_us", "one_way_us_p99");
        let round_trip = median_and_p99(figure, "round_trip_us", "round_trip_us_p99");
        assert!(close(round_trip, 2.0 * one_way), "{figure}");
        // GB/s = bytes / (one_way_us * 1e-6) / 1e9.
        let bandwidth = positive(figure, "bandwidth_gbs");
        assert!(close(bandwidth, bytes as f64 / one_way / 1e3), "{figure}");
    }

    let preposted = run(
        flavor,
        &binary,
        2,
        FmplMode::Preposted,
        &["posted=1,20", "repeats=2", "iterations=10", "warmup=2"],
    );
    let cases: Vec<(u64, &str)> = preposted
        .iter()
        .map(|f| (integer(f, "posted"), f["order"].as_str().unwrap_or("")))
        .collect();
    assert_eq!(
        cases,
        [
            (1, "reverse"),
            (1, "in_order"),
            (20, "reverse"),
            (20, "in_order")
        ]
    );
    for figure in &preposted {
        assert_eq!(integer(figure, "bytes"), 8, "{figure}");
        assert_eq!(integer(figure, "repeats"), 2, "{figure}");
        verified(figure);
        positive(figure, "post_gap_us");
        positive(figure, "send_gap_us");
        median_and_p99(figure, "latency_us", "latency_us_p99");
    }

    let barrier = run(
        flavor,
        &binary,
        4,
        FmplMode::Barrier,
        &["iterations=20", "warmup=2"],
    );
    assert_eq!(barrier.len(), 1);
    assert_eq!(integer(&barrier[0], "iterations"), 20);
    median_and_p99(&barrier[0], "time_us", "time_us_p99");

    let bcast = run(
        flavor,
        &binary,
        2,
        FmplMode::Bcast,
        &[sizes_arg, "iterations=10", "warmup=2"],
    );
    let allreduce = run(
        flavor,
        &binary,
        4,
        FmplMode::Allreduce,
        &[sizes_arg, "iterations=10", "warmup=2"],
    );
    for figures in [&bcast, &allreduce] {
        assert_eq!(figures.len(), sizes.len());
        for (figure, bytes) in figures.iter().zip(sizes) {
            assert_eq!(integer(figure, "bytes"), bytes, "{figure}");
            verified(figure);
            median_and_p99(figure, "time_us", "time_us_p99");
        }
    }
    for figure in &allreduce {
        assert_eq!(
            integer(figure, "count") * 8,
            integer(figure, "bytes"),
            "{figure}"
        );
    }

    // A wrong element sent is found by every mode that moves data.
    for (mode, ranks) in [
        (FmplMode::PingPong, 2),
        (FmplMode::Preposted, 2),
        (FmplMode::Bcast, 2),
        (FmplMode::Allreduce, 4),
    ] {
        let error = mpi::run_fmpl_compare(
            flavor,
            &binary,
            ranks,
            mode,
            &[
                "sizes=8,64",
                "posted=3",
                "repeats=1",
                "iterations=3",
                "warmup=1",
                "corrupt=1",
            ],
        )
        .expect_err("a wrong element fails the run")
        .to_string();
        assert!(error.contains(flavor.name()), "{error}");
        assert!(error.contains("exited with"), "{error}");
        assert!(
            error.contains(&format!("{}: ", mode.name())) && error.contains("mismatches"),
            "{error}"
        );
    }

    // A program that says nothing is stopped after the silence allowed,
    // and the error says so.
    let started = Instant::now();
    let error = mpi::launch(
        flavor,
        Path::new("/bin/sleep"),
        1,
        &["60".to_string()],
        Duration::from_secs(1),
    )
    .expect_err("a silent program is stopped");
    assert!(started.elapsed() < Duration::from_secs(30), "{error}");
    let error = error.to_string();
    assert!(
        error.contains(flavor.name()) && error.contains("no output within 1s"),
        "{error}"
    );

    // Ping-pong and the preposted receives are between two ranks.
    let error = mpi::run_fmpl_compare(flavor, &binary, 4, FmplMode::PingPong, &[])
        .expect_err("4 ranks are refused");
    assert_eq!(error.kind(), std::io::ErrorKind::InvalidInput);
}

#[test]
#[cfg_attr(
    openmpi_missing,
    ignore = "Open MPI is not installed (Debian openmpi-bin libopenmpi-dev; .ci/run installs it)"
)]
fn open_mpi_every_mode_measures_and_checks() {
    every_mode_measures_and_checks(Flavor::OpenMpi);
}

#[test]
#[cfg_attr(
    mpich_missing,
    ignore = "MPICH is not installed (Debian mpich libmpich-dev; .ci/run installs it)"
)]
fn mpich_every_mode_measures_and_checks() {
    every_mode_measures_and_checks(Flavor::Mpich);
}

/// `fmpl --quick` read into the report's section: every figure has our
/// points and a series per MPI, every row our number, each MPI's numbers
/// present exactly when the document says it ran (a missing one listed in
/// `missing`), and the rows carry the document's own figures.
#[test]
fn quick_fmpl_document_builds_its_report_section() {
    use pindown_benches::report::sections::messaging;

    let report = common::run_report(env!("CARGO_BIN_EXE_fmpl"), &["--quick"]);
    assert_eq!(report["benchmark"], "fmpl");
    let sections = messaging::fmpl(&report).expect("the fmpl section builds");
    assert_eq!(sections.len(), 1);
    let section = &sections[0];
    common::section_shows_the_peers(section, &report, "fmpl-", &[]);

    // The rows carry the document's numbers.
    let row = |what: &str| {
        section
            .rows
            .iter()
            .find(|r| r.what == what)
            .unwrap_or_else(|| panic!("no row {what}"))
    };
    let eight = report["pindown"]["pingpong"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["bytes"] == 8)
        .expect("an 8-byte ping-pong");
    let latency = row("8 B one-way latency");
    assert_eq!(latency.ours, eight["one_way_us"].as_f64());
    assert_eq!(
        latency.limit.as_ref().unwrap().value,
        eight["rdma_write_one_way_us"].as_f64()
    );
    let cache_line = row("8 B one-way latency against a cache line");
    assert_eq!(
        cache_line.limit.as_ref().unwrap().value,
        Some(positive(&report, "cache_line_round_trip_us") / 2.0)
    );
    let posted_600 = report["pindown"]["preposted"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["posted"] == 600)
        .expect("table 2 with 600 posted");
    assert_eq!(
        row("gap between receives posted ahead, 600 posted").ours,
        posted_600["post_gap_us"].as_f64()
    );
}
