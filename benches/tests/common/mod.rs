//! What the MPI tests share: building a program (a missing MPI fails the
//! test, which the build script ignores unless CI=true) and reading the
//! numbers of the figures the programs print.

// Each test crate includes this module and uses part of it.
#![allow(dead_code)]

use std::path::PathBuf;

use pindown_benches::mpi::{self, Flavor, Program};
use serde_json::Value;

/// Builds `program` for `flavor` into `folder` of this crate's temporary
/// directory; a test's own folder, so that tests running at once never
/// write one source file together.
pub fn build(flavor: Flavor, program: Program, folder: &str) -> PathBuf {
    if let Some(reason) = flavor.missing() {
        panic!(
            "{reason}; .ci/run installs it (apt-get install {})",
            flavor.packages()
        );
    }
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(folder);
    mpi::build(flavor, program, &dir)
        .unwrap_or_else(|e| panic!("{} build {}: {e}", flavor.name(), program.name()))
}

/// `figure[key]` as a number that is positive and finite.
pub fn positive(figure: &Value, key: &str) -> f64 {
    let value = figure[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} is not a number in {figure}"));
    assert!(
        value.is_finite() && value > 0.0,
        "{key} = {value} in {figure}"
    );
    value
}

/// `figure[key]` as an unsigned integer.
pub fn integer(figure: &Value, key: &str) -> u64 {
    figure[key]
        .as_u64()
        .unwrap_or_else(|| panic!("{key} is not an unsigned integer in {figure}"))
}

/// The figure's data check passed: no mismatch, verified.
pub fn verified(figure: &Value) {
    assert_eq!(integer(figure, "mismatches"), 0, "{figure}");
    assert_eq!(figure["verified"], Value::Bool(true), "{figure}");
}

/// Runs a benchmark program with `args`, asserts it succeeded, and gives
/// the one JSON document it printed.
pub fn run_report<S: AsRef<std::ffi::OsStr>>(exe: &str, args: &[S]) -> Value {
    let output = std::process::Command::new(exe)
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .output()
        .unwrap_or_else(|e| panic!("run {exe}: {e}"));
    let stdout = String::from_utf8(output.stdout).expect("utf-8 on stdout");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "{exe}: exit {}; stderr: {stderr}; stdout: {stdout}",
        output.status
    );
    serde_json::from_str(&stdout).expect("one JSON document")
}

/// What every report section built from an MPI-comparing document must
/// show: figure ids unique and starting with `prefix`, pindown's points in
/// every figure, and each MPI (`mpi.openmpi`, `mpi.mpich` in `report`)
/// listed missing exactly when it did not run, with a series in every
/// figure but `without_peers` that has points exactly when it ran, and row
/// values present exactly when it ran; every row has our number.
pub fn section_shows_the_peers(
    section: &pindown_benches::report::Section,
    report: &Value,
    prefix: &str,
    without_peers: &[&str],
) {
    use pindown_benches::report::Role;
    let mut ids: Vec<&str> = section.figures.iter().map(|f| f.id.as_str()).collect();
    ids.sort_unstable();
    let count = ids.len();
    ids.dedup();
    assert_eq!(ids.len(), count, "figure ids repeat: {ids:?}");
    for figure in &section.figures {
        assert!(figure.id.starts_with(prefix), "{}", figure.id);
        assert!(
            figure
                .series
                .iter()
                .any(|s| s.role == Role::Ours && !s.points.is_empty()),
            "{}",
            figure.id
        );
    }
    for (key, name) in [("openmpi", "Open MPI"), ("mpich", "MPICH")] {
        let ran = report["mpi"].get(key).is_some();
        assert_eq!(
            section.missing.iter().any(|m| m.starts_with(name)),
            !ran,
            "{name}: {:?}",
            section.missing
        );
        for figure in section
            .figures
            .iter()
            .filter(|f| !without_peers.contains(&f.id.as_str()))
        {
            let theirs = figure
                .series
                .iter()
                .find(|s| s.role == Role::Peer && s.name.starts_with(name))
                .unwrap_or_else(|| panic!("no {name} series in {}", figure.id));
            assert_eq!(!theirs.points.is_empty(), ran, "{name} in {}", figure.id);
        }
        for row in &section.rows {
            if let Some(peer) = row.peers.iter().find(|p| p.name == name) {
                assert_eq!(peer.value.is_some(), ran, "{name} in {}", row.what);
            }
        }
    }
    for row in &section.rows {
        assert!(row.ours.is_some_and(f64::is_finite), "{}", row.what);
    }
}
