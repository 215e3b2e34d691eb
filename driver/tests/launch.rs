//! Ranks started by real launchers join their job and exchange values
//! through the launcher's key-value space: `pindown-launch-probe` runs
//! under MPICH's Hydra (`mpiexec.hydra -n 4`, PMI-1), under Open MPI's
//! `mpirun -n 4` (PMIx), and as 3 processes of the environment launcher
//! sharing a directory; each rank's gathered values are checked here
//! against the values every rank should have published. A launcher that
//! is present but broken makes the probe fail with a message naming it,
//! never run as a single rank.
//!
//! The Hydra and Open MPI tests are ignored when the launcher is not
//! installed (the build script looks), except under CI=true, where a
//! missing launcher fails them.

use std::collections::BTreeSet;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

const PROBE: &str = env!("CARGO_BIN_EXE_pindown-launch-probe");

/// Bytes of rank 0's value: enough that PMI-1 splits every value over
/// several keys (Hydra's vallen_max is 1024).
const BYTES: usize = 1500;

/// How long one launch may take (it takes about a second).
const LIMIT: Duration = Duration::from_secs(120);

/// The value rank `rank` publishes (the probe's `probe_value`).
fn probe_value(rank: u32, bytes: usize) -> Vec<u8> {
    let len = bytes + 13 * rank as usize;
    (0..len)
        .map(|i| (i as u64 * 31 + u64::from(rank) * 17 + 7) as u8)
        .collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The variables of launchers that must not leak from the test's own
/// environment into the probe's.
fn scrub(command: &mut Command) -> &mut Command {
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy().into_owned();
        if ["PMI_", "PMIX_", "OMPI_", "PINDOWN_", "MPI_LOCAL", "SLURM_"]
            .iter()
            .any(|prefix| name.starts_with(prefix))
        {
            command.env_remove(&name);
        }
    }
    command
}

/// Runs `command` to its end, killing it after [`LIMIT`].
fn run(command: &mut Command) -> Output {
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{command:?}: {e}"));
    let mut stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let out = std::thread::spawn(move || {
        let mut text = Vec::new();
        stdout.read_to_end(&mut text).ok();
        text
    });
    let err = std::thread::spawn(move || {
        let mut text = Vec::new();
        stderr.read_to_end(&mut text).ok();
        text
    });
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > LIMIT {
            child.kill().ok();
            let _ = child.wait();
            panic!("{command:?} did not finish within {LIMIT:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Output {
        status,
        stdout: out.join().unwrap(),
        stderr: err.join().unwrap(),
    }
}

fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(program).is_file()))
}

fn require(program: &str, packages: &str) {
    assert!(
        on_path(program),
        "{program} is not on PATH (Debian: {packages}; .ci/run installs it)"
    );
}

/// Reads the probe's `rank-R.json` files in `dir` and checks a job of
/// `size` ranks started by `launcher`: every rank present once, with
/// distinct local ranks, and every rank's gathered values equal to what
/// each rank published.
fn check_job(dir: &Path, size: u32, launcher: &str, outputs: &[Output]) {
    let context: String = outputs
        .iter()
        .map(|output| {
            format!(
                "status {}, stdout {}, stderr {}\n",
                output.status,
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            )
        })
        .collect();
    assert!(outputs.iter().all(|o| o.status.success()), "{context}");
    let expected: Vec<String> = (0..size).map(|r| hex(&probe_value(r, BYTES))).collect();
    let mut local_ranks = BTreeSet::new();
    for rank in 0..size {
        let path = dir.join(format!("rank-{rank}.json"));
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{}: {e}; {context}", path.display()));
        let report: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(report["launcher"], launcher, "{report}");
        assert_eq!(report["rank"], rank, "{report}");
        assert_eq!(report["size"], size, "{report}");
        let gathered: Vec<&str> = report["gathered"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        assert_eq!(gathered, expected, "rank {rank}'s gathered values");
        assert_eq!(report["verified"], true, "rank {rank}'s put/fence/get");
        assert_eq!(
            report["absent_not_found"], true,
            "rank {rank}'s missing key"
        );
        if let Some(local) = report["local_rank"].as_u64() {
            assert_eq!(report["local_size"], size, "{report}");
            local_ranks.insert(local);
        }
    }
    // All ranks run on this host: their local ranks are 0..size.
    assert_eq!(
        local_ranks,
        (0..u64::from(size)).collect::<BTreeSet<_>>(),
        "local ranks"
    );
}

fn probe_dir(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("launch-{name}"));
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
#[cfg_attr(
    pindown_no_hydra,
    ignore = "mpiexec.hydra is not installed (Debian mpich); under CI=true this test runs and fails instead"
)]
fn hydra_starts_four_ranks_that_gather_through_pmi1() {
    require("mpiexec.hydra", "mpich");
    let dir = probe_dir("hydra");
    let output = run(scrub(&mut Command::new("mpiexec.hydra"))
        .args([
            "-n",
            "4",
            PROBE,
            "--bytes",
            &BYTES.to_string(),
            "--output-dir",
        ])
        .arg(&dir));
    check_job(&dir, 4, "hydra", &[output]);
}

#[test]
#[cfg_attr(
    pindown_no_openmpi,
    ignore = "mpirun.openmpi is not installed (Debian openmpi-bin); under CI=true this test runs and fails instead"
)]
fn open_mpi_starts_four_ranks_that_gather_through_pmix() {
    require("mpirun.openmpi", "openmpi-bin");
    let dir = probe_dir("openmpi");
    let mut command = Command::new("mpirun.openmpi");
    scrub(&mut command).arg("--oversubscribe");
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } == 0 {
        command.arg("--allow-run-as-root");
    }
    let output = run(command
        .args([
            "-n",
            "4",
            PROBE,
            "--bytes",
            &BYTES.to_string(),
            "--output-dir",
        ])
        .arg(&dir));
    check_job(&dir, 4, "openmpi", &[output]);
}

#[test]
fn three_processes_gather_through_the_environment_launcher() {
    let dir = probe_dir("environment");
    let space = dir.join("kv");
    let size = 3u32;
    let children: Vec<_> = (0..size)
        .map(|rank| {
            let mut command = Command::new(PROBE);
            scrub(&mut command)
                .args(["--bytes", &BYTES.to_string(), "--output-dir"])
                .arg(&dir)
                .env("PINDOWN_RANK", rank.to_string())
                .env("PINDOWN_SIZE", size.to_string())
                .env("PINDOWN_KV_DIR", &space)
                .env("PINDOWN_LAUNCH_TIMEOUT", "60");
            std::thread::spawn(move || run(&mut command))
        })
        .collect();
    let outputs: Vec<Output> = children.into_iter().map(|c| c.join().unwrap()).collect();
    check_job(&dir, size, "environment", &outputs);
}

/// Runs the probe alone with exactly `vars` (and `PATH`) and returns its
/// error message; the probe must fail, not run as one rank.
fn probe_error(vars: &[(&str, &str)], stdin: Stdio) -> String {
    let mut command = Command::new(PROBE);
    command
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .envs(vars.iter().copied());
    let output = command.stdin(stdin).output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert_eq!(output.status.code(), Some(2), "{vars:?}: {stdout}");
    let report: Value = serde_json::from_str(stdout.trim()).unwrap();
    report["error"]
        .as_str()
        .unwrap_or_else(|| panic!("{vars:?}: no error in {report}"))
        .to_string()
}

#[test]
fn a_broken_pmi_launcher_is_an_error() {
    // A descriptor number the probe does not have open.
    let error = probe_error(
        &[("PMI_FD", "77"), ("PMI_RANK", "0"), ("PMI_SIZE", "4")],
        Stdio::null(),
    );
    assert!(
        error.contains("PMI_FD") && error.contains("not an open file descriptor"),
        "{error}"
    );
    // Standard input, /dev/null: open, but no socket.
    let error = probe_error(
        &[("PMI_FD", "0"), ("PMI_RANK", "0"), ("PMI_SIZE", "4")],
        Stdio::null(),
    );
    assert!(
        error.contains("PMI_FD") && error.contains("not a socket"),
        "{error}"
    );
    // A socket whose other end is closed: init finds no process manager.
    let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
    drop(theirs);
    let error = probe_error(
        &[("PMI_FD", "0"), ("PMI_RANK", "0"), ("PMI_SIZE", "4")],
        Stdio::from(std::os::fd::OwnedFd::from(ours)),
    );
    assert!(error.contains("cmd=init"), "{error}");
    // The rank without the connection.
    let error = probe_error(&[("PMI_RANK", "1"), ("PMI_SIZE", "4")], Stdio::null());
    assert!(error.contains("neither PMI_FD nor PMI_PORT"), "{error}");
}

#[test]
fn open_mpi_variables_without_a_pmix_server_are_an_error() {
    let ompi = [("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "4")];
    // No server named at all.
    let error = probe_error(&ompi, Stdio::null());
    assert!(
        error.contains("openmpi") && error.contains("PMIx"),
        "{error}"
    );
    // A library that is not there.
    let mut vars = ompi.to_vec();
    vars.extend([
        ("PMIX_NAMESPACE", "4242"),
        ("PINDOWN_PMIX_LIBRARY", "/nonexistent/libpmix.so.2"),
    ]);
    let error = probe_error(&vars, Stdio::null());
    assert!(error.contains("/nonexistent/libpmix.so.2"), "{error}");
    // A server that is not running (where the library is installed).
    if Path::new("/usr/lib/x86_64-linux-gnu/libpmix.so.2").exists() {
        let dead = "4242.0;tcp4://127.0.0.1:1";
        let mut vars = ompi.to_vec();
        vars.extend([
            ("PMIX_NAMESPACE", "4242"),
            ("PMIX_RANK", "1"),
            ("PMIX_SERVER_URI41", dead),
            ("PMIX_SERVER_URI4", dead),
            ("PMIX_SERVER_URI3", dead),
            ("PMIX_SERVER_URI2", dead),
        ]);
        let error = probe_error(&vars, Stdio::null());
        assert!(error.contains("PMIx_Init failed"), "{error}");
    }
}

#[test]
fn partial_environment_variables_are_an_error() {
    let error = probe_error(&[("PINDOWN_RANK", "0")], Stdio::null());
    assert!(error.contains("PINDOWN_SIZE"), "{error}");
    let error = probe_error(
        &[
            ("PINDOWN_RANK", "3"),
            ("PINDOWN_SIZE", "3"),
            ("PINDOWN_KV_DIR", "/tmp"),
        ],
        Stdio::null(),
    );
    assert!(error.contains("not below"), "{error}");
}

#[test]
fn without_a_launcher_the_probe_is_a_single_rank() {
    let output = Command::new(PROBE)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .args(["--bytes", "10"])
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let report: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(report["launcher"], "single");
    assert_eq!(
        (report["rank"].as_u64(), report["size"].as_u64()),
        (Some(0), Some(1))
    );
    assert_eq!(report["gathered"][0], hex(&probe_value(0, 10)));
}
