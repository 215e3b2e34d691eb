//! Running `examples/msg_check` from tests: a device with N ports and N
//! rank processes, each printing one JSON line.

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;
use std::sync::Once;

use serde_json::Value;

/// The example's executable, built (once per test binary) with the same
/// profile and target directory as this test, so that it is never older
/// than the library under test: it lies in `examples/` beside this test's
/// `deps/`.
pub fn msg_check() -> PathBuf {
    static BUILD: Once = Once::new();
    let exe = std::env::current_exe().expect("test executable");
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile>/deps");
    let built = profile_dir.join("examples/msg_check");
    BUILD.call_once(|| {
        let mut cargo = Command::new(env!("CARGO"));
        cargo.current_dir(env!("CARGO_MANIFEST_DIR")).args([
            "build",
            "-p",
            "pindown-messaging",
            "--example",
            "msg_check",
        ]);
        if profile_dir
            .file_name()
            .is_some_and(|name| name == "release")
        {
            cargo.arg("--release");
        }
        let target = profile_dir.parent().expect("target directory");
        let status = cargo
            .arg("--target-dir")
            .arg(target)
            .status()
            .expect("run cargo");
        assert!(status.success(), "building msg_check failed");
        assert!(built.exists(), "{} missing", built.display());
    });
    built
}

/// What `msg_check launch` printed: one JSON value per rank that printed,
/// and whether the launch succeeded.
pub struct Launch {
    /// The ranks' lines, by rank.
    pub ranks: Vec<Value>,
    /// Whether every rank exited with success.
    pub success: bool,
    /// Everything the launcher printed.
    pub text: String,
}

/// Runs `msg_check launch n scenario args...`.
pub fn launch(n: u32, scenario: &str, args: &[&str]) -> Launch {
    let output = Command::new(msg_check())
        .arg("launch")
        .arg(n.to_string())
        .arg(scenario)
        .args(args)
        .output()
        .expect("run msg_check");
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    let mut ranks: Vec<Value> = text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    ranks.sort_by_key(|v| v["rank"].as_u64());
    Launch {
        ranks,
        success: output.status.success(),
        text: format!("{text}{}", String::from_utf8_lossy(&output.stderr)),
    }
}

/// Runs a scenario on `n` ranks and asserts every rank passed; returns
/// the lines.
pub fn passes(n: u32, scenario: &str, args: &[&str]) -> Vec<Value> {
    let launch = launch(n, scenario, args);
    assert!(
        launch.success,
        "{scenario} on {n} ranks {args:?}:\n{}",
        launch.text
    );
    assert_eq!(launch.ranks.len(), n as usize, "{}", launch.text);
    for (rank, line) in launch.ranks.iter().enumerate() {
        assert_eq!(line["rank"], rank as u64, "{}", launch.text);
        assert_eq!(line["ok"], true, "{}", launch.text);
    }
    launch.ranks
}

/// Bytes rank `rank` checked.
pub fn checked(line: &Value) -> u64 {
    line["checked"].as_u64().expect("a checked count")
}
