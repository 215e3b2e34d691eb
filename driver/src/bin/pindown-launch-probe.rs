//! `pindown-launch-probe`: joins the job the way every pindown rank does
//! ([`Job::from_environment`]), exchanges a value through the launcher's
//! key-value space, checks what arrived, and prints one JSON line:
//!
//! ```text
//! {"launcher":"hydra","rank":1,"size":4,"local_rank":1,"local_size":4,
//!  "gathered":["<hex of rank 0's value>",...],"verified":true,
//!  "absent_not_found":true}
//! ```
//!
//! or `{"error":"..."}` (and exit status 2) when the job cannot be joined.
//! With `--output-dir DIR` the line also goes to `DIR/rank-R.json` (some
//! launchers split long lines of different ranks when they forward
//! output).
//! Use it to check a launcher: `mpiexec -n 4 pindown-launch-probe`,
//! `mpirun -n 4 pindown-launch-probe`, `srun --mpi=pmi2 -n 4 ...`.
//!
//! Rank `r` publishes `probe_value(r, bytes)`: `bytes + 13 r` bytes
//! that depend on the rank, with spaces, `=`, newlines and NULs among
//! them (`--bytes N`, default 100; more than about 500 makes PMI-1 split
//! values over several keys). It then gathers a second, short value
//! through `put`, `fence` and `get` and a barrier, so that several fences
//! in a row are exercised, and asks for a key nobody published, which
//! must be reported missing (`absent_not_found`), not waited for.

use std::io::Write;
use std::process::ExitCode;

use pindown_driver::launch::{Job, LaunchError};

/// The value rank `rank` publishes: `bytes + 13 * rank` bytes.
fn probe_value(rank: u32, bytes: usize) -> Vec<u8> {
    let len = bytes + 13 * rank as usize;
    (0..len)
        .map(|i| (i as u64 * 31 + u64::from(rank) * 17 + 7) as u8)
        .collect()
}

fn json_string(text: &str) -> String {
    let mut out = String::from("\"");
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn optional(value: Option<u32>) -> String {
    value.map_or("null".into(), |v| v.to_string())
}

fn run(bytes: usize) -> Result<(String, u32), LaunchError> {
    let mut job = Job::from_environment()?;
    let (rank, size) = (job.rank(), job.size());
    let gathered = job.all_gather("probe", &probe_value(rank, bytes))?;
    let mut verified = gathered.len() == size as usize
        && gathered
            .iter()
            .enumerate()
            .all(|(r, value)| *value == probe_value(r as u32, bytes));
    // A second exchange through put, fence and get.
    job.put("second", format!("second {rank}").as_bytes())?;
    job.fence()?;
    for other in 0..size {
        verified &= job.get(other, "second")? == format!("second {other}").as_bytes();
    }
    // A key nobody published is reported missing, not waited for.
    let absent_not_found = matches!(
        job.get((rank + 1) % size, "absent"),
        Err(LaunchError::NotFound { .. })
    );
    job.barrier()?;
    let line = format!(
        "{{\"launcher\":{},\"rank\":{rank},\"size\":{size},\"local_rank\":{},\"local_size\":{},\"gathered\":[{}],\"verified\":{verified},\"absent_not_found\":{absent_not_found}}}\n",
        json_string(job.launcher().name()),
        optional(job.local_rank()),
        optional(job.local_size()),
        gathered
            .iter()
            .map(|v| json_string(&hex(v)))
            .collect::<Vec<_>>()
            .join(",")
    );
    job.finalize()?;
    Ok((line, rank))
}

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let mut bytes = 100;
    let mut output_dir = None;
    while let Some(arg) = args.next() {
        match (arg.as_str(), args.next()) {
            ("--bytes", Some(n)) if n.parse::<usize>().is_ok() => bytes = n.parse().unwrap_or(0),
            ("--output-dir", Some(dir)) => output_dir = Some(std::path::PathBuf::from(dir)),
            _ => {
                eprintln!("usage: pindown-launch-probe [--bytes N] [--output-dir DIR]");
                return ExitCode::from(64);
            }
        }
    }
    let (line, rank, status) = match run(bytes) {
        Ok((line, rank)) => (line, Some(rank), ExitCode::SUCCESS),
        Err(error) => {
            eprintln!("pindown-launch-probe: {error}");
            (
                format!("{{\"error\":{}}}\n", json_string(&error.to_string())),
                None,
                ExitCode::from(2),
            )
        }
    };
    if let (Some(dir), Some(rank)) = (output_dir, rank) {
        let path = dir.join(format!("rank-{rank}.json"));
        if let Err(error) = std::fs::write(&path, &line) {
            eprintln!("pindown-launch-probe: {}: {error}", path.display());
            return ExitCode::from(1);
        }
    }
    // One write per line, so that the launcher's forwarding keeps lines
    // of different ranks apart.
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(line.as_bytes()).ok();
    stdout.flush().ok();
    status
}
