//! Tells the tests whether an MPI compiler is at hand: the datatype
//! engine's cross-check against `MPI_Pack` compiles a C program with
//! `mpicc` (or `$MPICC`, or Debian's `mpicc.openmpi` and `mpicc.mpich`).
//! Without any the check is ignored, except under `CI=true`, where it
//! runs and fails. The same for the launcher tests (`mpiexec.hydra`,
//! `mpirun.openmpi`) and the PMIx layout test (libpmix-dev's headers and
//! `cc`).

use std::path::Path;

/// Debian's libpmix-dev header the PMIx layout test compiles against.
const PMIX_HEADER: &str = "/usr/lib/x86_64-linux-gnu/pmix2/include/pmix_common.h";

fn on_path(program: &str) -> bool {
    if program.contains('/') {
        return Path::new(program).is_file();
    }
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(program).is_file()))
}

fn main() {
    println!("cargo::rerun-if-env-changed=MPICC");
    println!("cargo::rerun-if-env-changed=CI");
    println!("cargo::rerun-if-env-changed=PATH");
    println!("cargo::rustc-check-cfg=cfg(pindown_no_mpicc)");
    println!("cargo::rustc-check-cfg=cfg(pindown_no_hydra)");
    println!("cargo::rustc-check-cfg=cfg(pindown_no_openmpi)");
    println!("cargo::rustc-check-cfg=cfg(pindown_no_pmix_headers)");
    let mpicc = std::env::var("MPICC").unwrap_or_else(|_| "mpicc".into());
    let ci = std::env::var("CI").is_ok_and(|v| v == "true");
    let found = [mpicc.as_str(), "mpicc.openmpi", "mpicc.mpich"]
        .iter()
        .any(|program| on_path(program));
    if !found && !ci {
        println!("cargo::rustc-cfg=pindown_no_mpicc");
    }
    // The launcher tests: MPICH's Hydra, Open MPI's mpirun, and the PMIx
    // headers (with a C compiler) for the layout check.
    if !ci && !on_path("mpiexec.hydra") {
        println!("cargo::rustc-cfg=pindown_no_hydra");
    }
    if !ci && !on_path("mpirun.openmpi") {
        println!("cargo::rustc-cfg=pindown_no_openmpi");
    }
    let pmix_headers = Path::new(PMIX_HEADER).is_file() && on_path("cc");
    if !ci && !pmix_headers {
        println!("cargo::rustc-cfg=pindown_no_pmix_headers");
    }
}
