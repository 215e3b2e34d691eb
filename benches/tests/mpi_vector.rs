//! The MPI baseline of `vector-transfer`: `benches/mpi/vector_pingpong.c`
//! builds with each MPI's own compiler wrapper, runs on two ranks under
//! that MPI's own launcher, and its ping-pong moves exactly the submatrix
//! (every element right, nothing around it written) and the same bytes
//! contiguous; a wrong element sent is reported by the program's check.
//!
//! Each test is ignored when its MPI is not installed (the build script
//! looks), except under CI=true, where a missing MPI fails it.

mod common;

use pindown_benches::mpi::{self, Flavor, Program, RunSpec};
use pindown_benches::submatrix::ELEMENT;

fn ping_pong_moves_the_submatrix(flavor: Flavor, library: &str) {
    let binary = common::build(flavor, Program::VectorPingPong, "mpi-vector");
    // Submatrices of one row, a few rows, and every row of the matrix; a
    // row length that is not a power of two.
    let spec = RunSpec {
        z: 63,
        n: 5,
        ms: vec![1, 7, 4096],
        iterations: 3,
        warmup: 1,
        huge_pages: false,
        corrupt_one_element: false,
    };
    let run = mpi::run(flavor, &binary, &spec).expect("the MPI program runs");
    assert!(
        run.header.library.contains(library),
        "{} is not {library}",
        run.header.library
    );
    assert_eq!(run.points.len(), 2 * spec.ms.len());
    for (i, point) in run.points.iter().enumerate() {
        let m = spec.ms[i / 2];
        let kind = if i % 2 == 0 { "vector" } else { "contig" };
        assert_eq!(
            (point.kind.as_str(), point.z, point.n, point.m),
            (kind, spec.z, spec.n, m),
            "{point:?}"
        );
        assert_eq!(point.bytes as usize, m * spec.n * ELEMENT, "{point:?}");
        assert_eq!(point.mismatches, 0, "{point:?}");
        assert!(point.verified, "{point:?}");
        assert_eq!(point.iterations, spec.iterations);
        assert!(point.one_way_us_median > 0.0, "{point:?}");
    }

    // One wrong element sent each way is one mismatch found, in either kind.
    let corrupt = RunSpec {
        ms: vec![7],
        corrupt_one_element: true,
        ..spec
    };
    let run = mpi::run(flavor, &binary, &corrupt).expect("the MPI program runs");
    assert_eq!(run.points.len(), 2);
    for point in &run.points {
        assert_eq!(point.mismatches, 1, "{point:?}");
        assert!(!point.verified, "{point:?}");
    }
}

#[test]
#[cfg_attr(
    openmpi_missing,
    ignore = "Open MPI is not installed (Debian openmpi-bin libopenmpi-dev; .ci/run installs it)"
)]
fn open_mpi_ping_pong_moves_the_submatrix() {
    ping_pong_moves_the_submatrix(Flavor::OpenMpi, "Open MPI");
}

#[test]
#[cfg_attr(
    mpich_missing,
    ignore = "MPICH is not installed (Debian mpich libmpich-dev; .ci/run installs it)"
)]
fn mpich_ping_pong_moves_the_submatrix() {
    ping_pong_moves_the_submatrix(Flavor::Mpich, "MPICH");
}
