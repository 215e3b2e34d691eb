//! The MPI peers of the GASNet figures: `benches/mpi/gasnet_compare.c`,
//! `halo.c` and `himeno.c` build with each MPI's own compiler wrapper and
//! run under that MPI's own launcher with small sizes and few iterations.
//! Every figure names its MPI and test, its times are positive, its data
//! arrived right; one wrong element sent makes the program fail with the
//! MPI's name in the error; Himeno's result does not depend on the rank
//! count beyond float rounding of the residual's sum (the sum of p is the
//! same to the last digit printed) nor on the MPI.
//!
//! Each test is ignored when its MPI is not installed (the build script
//! looks), except under CI=true, where a missing MPI fails it.

mod common;

use std::path::{Path, PathBuf};

use common::{positive, verified};
use pindown_benches::mpi::{self, Flavor, GasnetMode, Program};
use serde_json::Value;

/// Builds `program` into a folder of the calling test's own (`test`).
fn build(flavor: Flavor, program: Program, test: &str) -> PathBuf {
    common::build(flavor, program, &format!("mpi-gasnet-compare/{test}"))
}

fn gasnet_compare(flavor: Flavor, binary: &Path) {
    let sizes = [8u64, 4096, 1 << 20];
    for mode in GasnetMode::ALL {
        let figures = mpi::run_gasnet_compare(
            flavor,
            binary,
            mode,
            &["sizes=8,4096,1048576", "iterations=30", "warmup=3"],
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let got: Vec<u64> = figures
            .iter()
            .map(|f| f["bytes"].as_u64().unwrap())
            .collect();
        assert_eq!(got, sizes, "{figures:?}");
        for figure in &figures {
            assert_eq!(figure["test"], mode.name());
            verified(figure);
            let latency = positive(figure, "latency_us");
            assert!(positive(figure, "latency_us_p99") >= latency, "{figure}");
            let bytes = figure["bytes"].as_f64().unwrap();
            let bandwidth = positive(figure, "bandwidth_gbs");
            // Printed to 4 and 6 decimals: relative 1 % is plenty.
            let implied = bytes / latency / 1e3;
            assert!(
                (implied - bandwidth).abs() <= 1e-5 + 0.01 * implied,
                "{figure}"
            );
        }
        let error = mpi::run_gasnet_compare(
            flavor,
            binary,
            mode,
            &["sizes=64", "iterations=5", "warmup=1", "corrupt=1"],
        )
        .expect_err("a wrong byte fails the run")
        .to_string();
        assert!(error.contains(flavor.name()), "{error}");
        assert!(error.contains("mismatches"), "{error}");
    }
}

fn halo(flavor: Flavor, binary: &Path) {
    let faces = ["block", "blockstride", "stride"];
    let types = ["vector", "subarray"];
    for (ranks, pattern) in [(2, "pattern=pingpong"), (3, "pattern=exchange")] {
        let figures = mpi::run_halo(
            flavor,
            binary,
            ranks,
            &[pattern, "sizes=4,16", "iterations=10", "warmup=1"],
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(figures.len(), 2 * faces.len() * types.len(), "{figures:?}");
        let mut i = 0;
        for n in [4u64, 16] {
            for face in faces {
                for datatype in types {
                    let f = &figures[i];
                    i += 1;
                    assert_eq!(f["n"].as_u64(), Some(n), "{f}");
                    assert_eq!(f["face"], face, "{f}");
                    assert_eq!(f["datatype"], datatype, "{f}");
                    assert_eq!(f["ranks"].as_u64(), Some(ranks as u64), "{f}");
                    assert_eq!(f["bytes"].as_u64(), Some(n * n * 8), "{f}");
                    verified(f);
                    positive(f, "time_us");
                }
            }
        }
    }
    for face in faces {
        let error = mpi::run_halo(
            flavor,
            binary,
            2,
            &[
                "sizes=8",
                &format!("faces={face}"),
                "types=vector",
                "iterations=3",
                "warmup=0",
                "corrupt=1",
            ],
        )
        .expect_err("a wrong element fails the run")
        .to_string();
        assert!(error.contains("mismatches"), "{face}: {error}");
    }
}

/// Himeno on 1, 2 and 3 ranks: the same p everywhere, gosa equal up to
/// float rounding of its sum; returns the 2-rank figure.
fn himeno(flavor: Flavor, binary: &Path) -> Value {
    let args = ["sizes=XS", "iterations=20", "warmup=1"];
    let runs: Vec<Value> = [1usize, 2, 3]
        .into_iter()
        .map(|ranks| {
            let figures =
                mpi::run_himeno(flavor, binary, ranks, &args).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(figures.len(), 1, "{figures:?}");
            let f = figures.into_iter().next().unwrap();
            assert_eq!(f["size"], "XS");
            assert_eq!(f["ranks"].as_u64(), Some(ranks as u64));
            assert_eq!(f["iterations"].as_u64(), Some(20));
            positive(&f, "iterations_per_s");
            f
        })
        .collect();
    let serial_gosa = positive(&runs[0], "gosa");
    let serial_p = positive(&runs[0], "p_sum");
    for f in &runs[1..] {
        let gosa = positive(f, "gosa");
        assert!(
            (gosa - serial_gosa).abs() <= 1e-3 * serial_gosa,
            "{f} vs {}",
            runs[0]
        );
        assert_eq!(positive(f, "p_sum"), serial_p, "{f} vs {}", runs[0]);
    }
    // The residual moves: 20 iterations do not leave it where 1 does.
    let one = mpi::run_himeno(flavor, binary, 2, &["sizes=XS", "iterations=1"])
        .unwrap_or_else(|e| panic!("{e}"));
    assert_ne!(one[0]["gosa"], runs[1]["gosa"]);
    runs[1].clone()
}

fn everything(flavor: Flavor) -> Value {
    gasnet_compare(flavor, &build(flavor, Program::GasnetCompare, "each"));
    halo(flavor, &build(flavor, Program::Halo, "each"));
    himeno(flavor, &build(flavor, Program::Himeno, "each"))
}

#[test]
#[cfg_attr(
    openmpi_missing,
    ignore = "Open MPI is not installed (Debian openmpi-bin libopenmpi-dev; .ci/run installs it)"
)]
fn open_mpi_gasnet_peers_measure_and_check() {
    everything(Flavor::OpenMpi);
}

#[test]
#[cfg_attr(
    mpich_missing,
    ignore = "MPICH is not installed (Debian mpich libmpich-dev; .ci/run installs it)"
)]
fn mpich_gasnet_peers_measure_and_check() {
    everything(Flavor::Mpich);
}

/// Both MPIs compute the same Himeno result on 2 ranks (the same
/// arithmetic in the same order; only the transport differs).
#[test]
#[cfg_attr(
    any(openmpi_missing, mpich_missing),
    ignore = "needs both Open MPI and MPICH (.ci/run installs them)"
)]
fn both_mpis_agree_on_himeno() {
    let args = ["sizes=XS", "iterations=10"];
    let [a, b] = Flavor::ALL.map(|flavor| {
        let binary = build(flavor, Program::Himeno, "agree");
        mpi::run_himeno(flavor, &binary, 2, &args).unwrap_or_else(|e| panic!("{e}"))
    });
    assert_eq!(a[0]["gosa"], b[0]["gosa"], "{a:?} {b:?}");
    assert_eq!(a[0]["p_sum"], b[0]["p_sum"], "{a:?} {b:?}");
}
