//! `pindown-report`: one command runs every benchmark program of the
//! project (each measures its peers and its physical limits in the same
//! run) and writes the report: `report.md`, `report.json`, a plot per
//! figure as SVG and PNG, and each program's own JSON document.
//!
//! ```text
//! cargo run --release -p pindown-benches --bin pindown-report            # full, into benches/results/
//! cargo run --release -p pindown-benches --bin pindown-report -- --quick # short, into target/report-quick/
//! pindown-report --render benches/results   # report.md and plots again from benches/results/report.json
//! pindown-report --rebuild benches/results  # sections again from benches/results/raw/*.json
//! ```
//!
//! Exit status 0 when every program ran and passed its own checks (under
//! `CI=true` a missing peer also fails, since the programs refuse to run
//! without their peers there).

use std::error::Error;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use clap::Parser;
use pindown_benches::report::{self, run, sections, Report};

/// Runs every benchmark program and writes the report.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// The short version (about a minute; CI runs it).
    #[arg(long)]
    quick: bool,
    /// Output folder [default: benches/results/ of the workspace for a full run,
    /// target/report-quick/ for --quick].
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Render report.md and the plots again from DIR/report.json, running
    /// nothing.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["quick", "out", "rebuild"])]
    render: Option<PathBuf>,
    /// Build the sections again from the programs' documents kept in
    /// DIR/raw/ and write the report into DIR, running nothing.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["quick", "out"])]
    rebuild: Option<PathBuf>,
    /// No progress bar.
    #[arg(long, short)]
    quiet: bool,
}

/// The workspace root (the parent of this crate's folder).
fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the benches crate lives in the workspace")
        .to_path_buf()
}

/// Under `cargo run`, builds the sibling programs first (a no-op when they
/// are current), so that the report never measures stale binaries.
fn build_programs(programs: &Path) -> Result<(), Box<dyn Error>> {
    let Some(cargo) = std::env::var_os("CARGO") else {
        return Ok(());
    };
    let mut build = Command::new(cargo);
    build.args(["build", "--locked", "-p", "pindown-benches", "--bins"]);
    if programs.ends_with("release") {
        build.arg("--release");
    }
    let status = build.current_dir(workspace()).status()?;
    if !status.success() {
        return Err(format!("building the benchmark programs failed ({status})").into());
    }
    Ok(())
}

fn main() -> ExitCode {
    match main_result() {
        Ok(code) => code,
        Err(e) => {
            eprintln!("pindown-report: {e}");
            ExitCode::FAILURE
        }
    }
}

fn main_result() -> Result<ExitCode, Box<dyn Error>> {
    let args = Args::parse();
    if let Some(dir) = &args.render {
        Report::read(dir)?.write(dir, false)?;
        println!(
            "rendered {} from its report.json",
            dir.join(report::REPORT_MD).display()
        );
        return Ok(ExitCode::SUCCESS);
    }
    if let Some(dir) = &args.rebuild {
        let report = run::rebuild(&sections::jobs(), dir)?;
        report.write(dir, true)?;
        println!(
            "rebuilt {}: {} figures; {}",
            dir.join(report::REPORT_MD).display(),
            report.figure_ids().len(),
            verdict(&report)
        );
        return Ok(exit_code(&report));
    }
    let programs = std::env::current_exe()?
        .parent()
        .ok_or("the executable has no folder")?
        .to_path_buf();
    build_programs(&programs)?;
    let out = args.out.clone().unwrap_or_else(|| {
        if args.quick {
            workspace().join("target/report-quick")
        } else {
            workspace().join("benches").join("results")
        }
    });
    let options = run::Options {
        quick: args.quick,
        logs: workspace().join(if args.quick {
            "target/report-quick-logs"
        } else {
            "target/report-logs"
        }),
        out: out.clone(),
        programs,
        progress: !args.quiet && std::io::stderr().is_terminal(),
        command: std::iter::once("pindown-report".to_string())
            .chain(std::env::args().skip(1))
            .collect::<Vec<_>>()
            .join(" "),
    };
    let report = run::run(&sections::jobs(), &options)?;
    report.write(&out, true)?;
    println!(
        "{}: {} programs in {:.0} s, {} figures; {}",
        out.join(report::REPORT_MD).display(),
        report.jobs.len(),
        report.seconds,
        report.figure_ids().len(),
        verdict(&report)
    );
    Ok(exit_code(&report))
}

fn verdict(report: &Report) -> &'static str {
    if report.all_verified() {
        "every program verified"
    } else {
        "NOT every program verified (see the Programs table)"
    }
}

/// Success only if every program ran and passed its own checks.
fn exit_code(report: &Report) -> ExitCode {
    if report.all_verified() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
