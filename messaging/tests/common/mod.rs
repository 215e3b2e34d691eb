//! Running `examples/msg_check` from tests: a device with N ports and N
//! rank processes, each printing one JSON line.

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;
use std::sync::Mutex;

use serde_json::Value;

/// The executable of example `name` of this crate, built (once per test
/// binary and example) with the same profile and target directory as this
/// test, so that it is never older than the library under test: it lies
/// in `examples/` beside this test's `deps/`.
pub fn example(name: &str) -> PathBuf {
    built(
        "pindown-messaging",
        "--example",
        name,
        &format!("examples/{name}"),
    )
}

/// The device's own binary, `pindown-emu-device`, built in this test
/// binary's profile on first use.
pub fn device_binary() -> PathBuf {
    built(
        "pindown-emu-device",
        "--bin",
        "pindown-emu-device",
        "pindown-emu-device",
    )
}

/// `cargo build -p PACKAGE KIND NAME` in this test binary's profile and
/// target directory (once per test binary); the path of the result,
/// `RELATIVE` to the profile folder.
fn built(package: &str, kind: &str, name: &str, relative: &str) -> PathBuf {
    static BUILT: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let exe = std::env::current_exe().expect("test executable");
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile>/deps");
    let built = profile_dir.join(relative);
    let mut done = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if !done.iter().any(|n| n == relative) {
        let mut cargo = Command::new(env!("CARGO"));
        cargo
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .args(["build", "-p", package, kind, name]);
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
        assert!(status.success(), "building {name} failed");
        assert!(built.exists(), "{} missing", built.display());
        done.push(relative.to_string());
    }
    built
}

/// `examples/msg_check`, built.
pub fn msg_check() -> PathBuf {
    example("msg_check")
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
    launch_example("msg_check", n, scenario, args)
}

/// Runs `<example> launch n scenario args...` (an example with
/// `msg_check`'s launcher and one JSON line per rank).
pub fn launch_example(example_name: &str, n: u32, scenario: &str, args: &[&str]) -> Launch {
    let output = Command::new(example(example_name))
        .arg("launch")
        .arg(n.to_string())
        .arg(scenario)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("run {example_name}: {e}"));
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
    passes_example("msg_check", n, scenario, args)
}

/// [`passes`] for another example.
pub fn passes_example(example_name: &str, n: u32, scenario: &str, args: &[&str]) -> Vec<Value> {
    let launch = launch_example(example_name, n, scenario, args);
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

/// Removes the variables of any launcher this test runs under (MPI's,
/// PMI's, the project's own) from `command`, so that a rank started by
/// the test sees only what the test sets.
pub fn without_launcher_variables(command: &mut Command) {
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy().into_owned();
        if ["PMI_", "PMIX_", "OMPI_", "PINDOWN_", "MPI_LOCAL"]
            .iter()
            .any(|prefix| name.starts_with(prefix))
        {
            command.env_remove(&name);
        }
    }
}

/// Bytes rank `rank` checked.
pub fn checked(line: &Value) -> u64 {
    line["checked"].as_u64().expect("a checked count")
}
