//! `vector-transfer` on small matrices, as a reader of its figures would
//! run it: one JSON document with every series of every (z, n) present,
//! each point checked (the target's submatrix right, nothing around it
//! written) and of the right size, the vector write and read either
//! measured and checked or reported missing with the targets that need
//! them left unmeasured, and the MPI series measured or (outside CI)
//! reported missing.

use std::process::{Command, Stdio};

use serde_json::Value;

const Z: [usize; 2] = [64, 300];
const N: [usize; 2] = [1, 16];
const M: [usize; 2] = [16, 4096];

fn series<'a>(pass: &'a Value, method: &str, cache: Option<&str>, z: usize, n: usize) -> &'a Value {
    pass["series"]
        .as_array()
        .expect("series")
        .iter()
        .find(|s| {
            s["method"] == method
                && s["cache"].as_str() == cache
                && s["z"].as_u64() == Some(z as u64)
                && s["n"].as_u64() == Some(n as u64)
        })
        .unwrap_or_else(|| panic!("no series {method} {cache:?} z={z} n={n}"))
}

#[test]
fn small_run_prints_every_series_checked() {
    let join = |v: &[usize]| v.iter().map(usize::to_string).collect::<Vec<_>>().join(",");
    let output = Command::new(env!("CARGO_BIN_EXE_vector-transfer"))
        .args([
            "--quick",
            "--quiet",
            "--pages",
            "4k",
            "--samples",
            "3",
            "--cold-samples",
            "2",
        ])
        .args(["--z", &join(&Z), "--n", &join(&N), "--m", &join(&M)])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .expect("run vector-transfer");
    let stdout = String::from_utf8(output.stdout).expect("utf-8 on stdout");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "exit {}; stderr: {stderr}; stdout: {stdout}",
        output.status
    );
    let report: Value = serde_json::from_str(&stdout).expect("one JSON document");
    assert_eq!(report["program"], "vector-transfer");
    assert_eq!(report["verified"], true);
    assert_eq!(report["complete"], true);
    let passes = report["passes"].as_array().expect("passes");
    assert_eq!(passes.len(), 1);
    let pass = &passes[0];
    assert_eq!(pass["pages"], "4k");
    assert_eq!(pass["status"], "measured", "{}", pass["reason"]);
    assert_eq!(pass["arena_huge_pages"], false);

    let host = [
        "pack",
        "unpack",
        "contig_copy",
        "one_pass_copy",
        "pack_write_unpack",
    ];
    let mut vector_missing = false;
    for z in Z {
        for n in N {
            let mut measured: Vec<(&str, Option<&str>)> = Vec::new();
            for method in host {
                measured.push((method, Some("cold")));
                measured.push((method, Some("warm")));
            }
            measured.push(("contig_write", Some("warm")));
            for method in ["vector_write", "vector_read"] {
                let s = series(pass, method, Some("warm"), z, n);
                if s["status"] == "missing" {
                    vector_missing = true;
                    assert!(
                        s["reason"].as_str().is_some_and(|r| r.contains("vector")),
                        "{s}"
                    );
                    assert!(s["points"].as_array().unwrap().is_empty());
                } else {
                    measured.push((method, Some("warm")));
                }
            }
            for mpi in ["openmpi", "mpich"] {
                for kind in ["vector", "contig"] {
                    let method = format!("{mpi}_{kind}");
                    let s = series(pass, &method, None, z, n);
                    if s["status"] == "missing" {
                        assert_ne!(std::env::var("CI").as_deref(), Ok("true"), "{s}");
                    } else {
                        assert_eq!(s["status"], "measured", "{s}");
                        check_points(s, n);
                    }
                }
            }
            for (method, cache) in measured {
                let s = series(pass, method, cache, z, n);
                assert_eq!(s["status"], "measured", "{s}");
                check_points(s, n);
            }
        }
    }
    let targets = report["targets"].as_array().expect("targets");
    assert!(!targets.is_empty());
    for target in targets {
        if vector_missing {
            assert!(target["measured"].is_null(), "{target}");
            assert!(target["missing"].is_string(), "{target}");
        }
    }
}

/// One point per m, in order, of m x n doubles, checked, with a positive
/// time and the bandwidth it implies.
fn check_points(series: &Value, n: usize) {
    let points = series["points"].as_array().expect("points");
    assert_eq!(points.len(), M.len(), "{series}");
    for (point, m) in points.iter().zip(M) {
        assert_eq!(point["m"].as_u64(), Some(m as u64), "{series}");
        assert_eq!(
            point["bytes"].as_u64(),
            Some((m * n * 8) as u64),
            "{series}"
        );
        assert_eq!(point["verified"], true, "{series}");
        let median = point["us"]["median"].as_f64().expect("median");
        assert!(median > 0.0, "{series}");
        let mb_per_s = point["mb_per_s"].as_f64().expect("mb_per_s");
        let expected = (m * n * 8) as f64 / median;
        assert!((mb_per_s - expected).abs() <= 1e-6 * expected, "{series}");
    }
}
