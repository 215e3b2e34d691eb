//! Tells the tests what the machine offers: the tests between hosts run
//! devices in network namespaces (root and iproute2's `ip`) and ranks
//! under MPICH's Hydra (`mpiexec.hydra`). Without them those tests are
//! ignored, except under `CI=true`, where they run and fail saying what is
//! missing.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(program).is_file()))
}

fn main() {
    println!("cargo::rerun-if-env-changed=CI");
    println!("cargo::rerun-if-env-changed=PATH");
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rustc-check-cfg=cfg(pindown_no_netns)");
    println!("cargo::rustc-check-cfg=cfg(pindown_no_hydra)");
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        return;
    }
    let root = std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0);
    if !root || !on_path("ip") || !Path::new("/proc/self/ns/net").exists() {
        println!("cargo::rustc-cfg=pindown_no_netns");
    }
    if !on_path("mpiexec.hydra") {
        println!("cargo::rustc-cfg=pindown_no_hydra");
    }
}
