//! `pindown-fabric-rank` as a program: a rank that cannot find its device
//! or is given a bad command line fails, saying why. (Its all-to-all runs
//! against device processes on several hosts in
//! `emu-device/tests/fabric_hosts.rs`.)

use std::process::Command;

use serde_json::Value;

const RANK: &str = env!("CARGO_BIN_EXE_pindown-fabric-rank");

/// The program alone, with exactly `vars` (and `PATH`).
fn rank(vars: &[(&str, &str)], args: &[&str]) -> std::process::Output {
    Command::new(RANK)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .envs(vars.iter().copied())
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn a_rank_without_a_device_fails_naming_the_variables() {
    let output = rank(&[], &[]);
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    let report: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(report["launcher"], "single");
    assert_eq!(report["verified"], false);
    let error = report["error"].as_str().unwrap();
    assert!(
        error.contains("PINDOWN_DEVICE") && error.contains("PINDOWN_DEVICE_DIR"),
        "{error}"
    );
}

#[test]
fn a_rank_whose_device_does_not_answer_fails_naming_the_socket() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("port0.sock");
    let out = dir.path().join("out");
    std::fs::create_dir(&out).unwrap();
    let output = rank(
        &[("PINDOWN_DEVICE_DIR", dir.path().to_str().unwrap())],
        &["--output-dir", out.to_str().unwrap()],
    );
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    let line = std::fs::read_to_string(out.join("rank-0.json")).unwrap();
    assert_eq!(line.as_bytes(), output.stdout.as_slice());
    let report: Value = serde_json::from_str(&line).unwrap();
    let error = report["error"].as_str().unwrap();
    assert!(error.contains(socket.to_str().unwrap()), "{error}");
}

#[test]
fn bad_command_lines_are_refused() {
    for args in [
        &["--sizes", "0"][..],
        &["--sizes", "8,x"][..],
        &["--rounds", "0"][..],
        &["--rounds"][..],
        &["--frobnicate", "1"][..],
    ] {
        let output = rank(&[], args);
        assert_eq!(output.status.code(), Some(64), "{args:?}: {output:?}");
        assert!(output.stdout.is_empty(), "{args:?}");
    }
}

#[test]
fn a_broken_launcher_is_an_error_not_a_single_rank() {
    let output = rank(&[("PINDOWN_RANK", "0")], &[]);
    assert_eq!(output.status.code(), Some(2), "{output:?}");
    let report: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert!(
        report["error"].as_str().unwrap().contains("PINDOWN_SIZE"),
        "{report}"
    );
}
