//! Tells the MPI tests whether to run: `openmpi_missing` / `mpich_missing`
//! are set when that MPI's compiler wrapper or launcher is not on `PATH`,
//! so that its test is ignored with the reason. Under CI=true they are
//! never set: there a missing MPI fails the test (`.ci/run` installs both).
//! Likewise `ucx_missing`, when UCX's registration-cache header or the C
//! compiler the UCX peer of `pin-cost` is built with is missing.

use std::path::Path;

/// Each cfg and the tools whose absence sets it.
const MPIS: [(&str, [&str; 2]); 2] = [
    ("openmpi_missing", ["mpicc.openmpi", "mpirun.openmpi"]),
    ("mpich_missing", ["mpicc.mpich", "mpiexec.mpich"]),
];

/// The header and the compiler the UCX peer needs (`src/ucx.rs`:
/// `RCACHE_HEADER`, `COMPILER`).
const UCX_HEADER: &str = "/usr/include/ucs/memory/rcache.h";
const UCX_COMPILER: &str = "cc";

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=CI");
    println!("cargo:rerun-if-env-changed=PATH");
    let ci = std::env::var("CI").is_ok_and(|v| v == "true");
    let dirs: Vec<_> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    // Installing or removing an MPI changes these folders.
    for dir in dirs.iter().filter(|d| d.is_dir()) {
        println!("cargo:rerun-if-changed={}", dir.display());
    }
    for (cfg, tools) in MPIS {
        println!("cargo:rustc-check-cfg=cfg({cfg})");
        let found = |tool: &str| {
            dirs.iter()
                .any(|d: &std::path::PathBuf| Path::new(d).join(tool).is_file())
        };
        if !ci && !tools.iter().all(|t| found(t)) {
            println!("cargo:rustc-cfg={cfg}");
        }
    }
    // Installing libucx-dev adds /usr/include/ucs.
    println!("cargo:rerun-if-changed=/usr/include");
    println!("cargo:rustc-check-cfg=cfg(ucx_missing)");
    let ucx_present =
        Path::new(UCX_HEADER).is_file() && dirs.iter().any(|d| d.join(UCX_COMPILER).is_file());
    if !ci && !ucx_present {
        println!("cargo:rustc-cfg=ucx_missing");
    }
}
