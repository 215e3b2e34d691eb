//! `vector-transfer` on small matrices, as a reader of its figures would
//! run it: one JSON document with every series of every (z, n) present,
//! each point checked (the target's submatrix right, nothing around it
//! written) and of the right size, the targets measured where the run has
//! their sizes, and the MPI series measured or (outside CI) reported
//! missing.

mod common;

use pindown_benches::report::sections::vector::vector_transfer;
use pindown_benches::report::Role;
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
    let args: Vec<String> = [
        "--quick",
        "--quiet",
        "--pages",
        "4k",
        "--samples",
        "3",
        "--cold-samples",
        "2",
        "--z",
        &join(&Z),
        "--n",
        &join(&N),
        "--m",
        &join(&M),
    ]
    .iter()
    .map(|a| a.to_string())
    .collect();
    let report = common::run_report(env!("CARGO_BIN_EXE_vector-transfer"), &args);
    assert_eq!(report["program"], "vector-transfer");
    assert_eq!(report["verified"], true);
    assert_eq!(report["complete"], true);
    let passes = report["passes"].as_array().expect("passes");
    assert_eq!(passes.len(), 1);
    let pass = &passes[0];
    assert_eq!(pass["pages"], "4k");
    assert_eq!(pass["status"], "measured", "{}", pass["reason"]);
    assert_eq!(pass["arena_huge_pages"], false);

    let cold_and_warm = [
        "vector_write",
        "vector_read",
        "pack",
        "unpack",
        "contig_copy",
        "one_pass_copy",
        "pack_write_unpack",
    ];
    for z in Z {
        for n in N {
            let mut measured: Vec<(&str, Option<&str>)> = Vec::new();
            for method in cold_and_warm {
                measured.push((method, Some("cold")));
                measured.push((method, Some("warm")));
            }
            measured.push(("contig_write", Some("warm")));
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
    // z = 4096 is not in this run: its targets say so; the others are
    // measured, each against its bound.
    let targets = report["targets"].as_array().expect("targets");
    let one_pass = targets
        .iter()
        .filter(|t| {
            t["what"]
                .as_str()
                .unwrap()
                .starts_with("vector_write time over one_pass")
        })
        .count();
    assert_eq!(one_pass, Z.len() * N.len());
    for target in targets {
        let what = target["what"].as_str().unwrap();
        if what.contains("z = 4096") {
            assert!(target["measured"].is_null(), "{target}");
            assert!(target["missing"].is_string(), "{target}");
        } else {
            let measured = target["measured"].as_f64().expect("measured");
            let bound = target["target"].as_f64().unwrap();
            let met = if target["bound"] == "at most" {
                measured <= bound
            } else {
                measured >= bound
            };
            assert_eq!(target["met"].as_bool(), Some(met), "{target}");
        }
    }
    report_section(&report);
}

/// The report's section of the document: a plot per paper figure of the
/// document's index and the page-size plot, each with pindown's points at
/// the run's largest z; rows with ours and the baseline measured, the MPIs
/// present when they ran and listed missing when they did not.
fn report_section(report: &Value) {
    let sections = vector_transfer(report).expect("the document builds its section");
    assert_eq!(sections.len(), 1);
    let section = &sections[0];
    let mut ids: Vec<String> = report["figures"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| format!("vector-transfer-figure{}", f["figure"].as_str().unwrap()))
        .collect();
    ids.push("vector-transfer-pages".into());
    let built: Vec<&str> = section.figures.iter().map(|f| f.id.as_str()).collect();
    assert_eq!(built, ids);
    let z = *Z.iter().max().unwrap();
    for figure in &section.figures {
        let ours: Vec<_> = figure
            .series
            .iter()
            .filter(|s| s.role == Role::Ours)
            .collect();
        assert!(!ours.is_empty(), "{}", figure.id);
        // The 4 KiB pass is the only one run: the page-size plot's 2 MiB
        // lines are empty, every other line of ours has every m.
        for series in ours.iter().filter(|s| !s.name.contains("2 MiB")) {
            let ms: Vec<f64> = series.points.iter().map(|p| p.0).collect();
            let expected: Vec<f64> = M.iter().map(|&m| m as f64).collect();
            assert_eq!(ms, expected, "{}: {}", figure.id, series.name);
        }
    }
    // Figure 10's warm vector write is the document's series at z.
    let pass = &report["passes"][0];
    let figure10 = section
        .figures
        .iter()
        .find(|f| f.id == "vector-transfer-figure10")
        .expect("figure 10");
    let warm = figure10
        .series
        .iter()
        .find(|s| s.name == "vector write, warm")
        .expect("warm vector write");
    let expected: Vec<(f64, f64)> = series(pass, "vector_write", Some("warm"), z, 1)["points"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["m"].as_f64().unwrap(),
                p["us"]["median"].as_f64().unwrap(),
            )
        })
        .collect();
    assert_eq!(warm.points, expected);
    assert!(!section.rows.is_empty());
    for row in &section.rows {
        assert!(row.ours.is_some(), "{} has no value", row.what);
        let limit = row.limit.as_ref().expect("a baseline");
        assert!(
            limit.value.is_some(),
            "{}: {} missing",
            row.what,
            limit.name
        );
    }
    for (mpi, name) in [("openmpi", "Open MPI"), ("mpich", "MPICH")] {
        let ran = series(pass, &format!("{mpi}_vector"), None, z, 1)["status"] == "measured";
        let listed = section.missing.iter().any(|m| m.starts_with(name));
        assert_eq!(listed, !ran, "{name}: {:?}", section.missing);
        for row in section.rows.iter().filter(|r| !r.peers.is_empty()) {
            let peer = row
                .peers
                .iter()
                .find(|p| p.name.starts_with(name))
                .unwrap_or_else(|| panic!("{name} not in {}", row.what));
            assert_eq!(peer.value.is_some(), ran, "{name} in {}", row.what);
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
