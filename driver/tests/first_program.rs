//! The README's first program, `examples/rdma_write.rs`, run as it is:
//! two processes and a device of its own; the owner's verification of the
//! bytes is what makes it succeed.

use std::path::PathBuf;
use std::process::Command;

/// The example's executable, built now if this test's build did not make
/// it (it lies in `examples/` beside this test's `deps/`).
fn example() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable");
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile>/deps");
    let built = profile_dir.join("examples/rdma_write");
    let release = profile_dir
        .file_name()
        .is_some_and(|name| name == "release");
    let mut cargo = Command::new(env!("CARGO"));
    cargo.current_dir(env!("CARGO_MANIFEST_DIR")).args([
        "build",
        "-p",
        "pindown-driver",
        "--example",
        "rdma_write",
    ]);
    if release {
        cargo.arg("--release");
    }
    let target = profile_dir.parent().expect("target directory");
    let status = cargo
        .arg("--target-dir")
        .arg(target)
        .status()
        .expect("run cargo");
    assert!(status.success(), "building the example failed");
    assert!(built.exists(), "{} missing", built.display());
    built
}

#[test]
fn the_first_program_writes_and_the_owner_verifies_the_bytes() {
    let out = Command::new(example()).output().expect("run the example");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}\n{stdout}\n{stderr}", out.status);
    let message = "written by port 0 straight into port 1's memory";
    assert!(
        stdout.contains(&format!(
            "owner: verified {} bytes: {message}",
            message.len()
        )),
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!("write of {} bytes completed", message.len())),
        "{stdout}"
    );
}
