//! What the programs show while they run and what they print at the end.

use std::error::Error;
use std::io::IsTerminal;
use std::path::PathBuf;

use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

/// The command-line options about output that every program takes
/// (flattened into its own arguments).
#[derive(clap::Args, Clone, Debug, Default)]
pub struct OutputArgs {
    /// Also write the JSON document to FILE.
    #[arg(long, value_name = "FILE")]
    pub json_out: Option<PathBuf>,
    /// No progress display on stderr.
    #[arg(long, short)]
    pub quiet: bool,
}

impl OutputArgs {
    /// Whether progress and human-readable lines go to stderr: only when it
    /// is a terminal and `--quiet` was not given (so that logs and pipes
    /// stay clean).
    pub fn chatty(&self) -> bool {
        !self.quiet && std::io::stderr().is_terminal()
    }

    /// A progress bar of `total` steps on stderr, or a hidden one unless
    /// [`chatty`](Self::chatty).
    pub fn progress_bar(&self, total: u64) -> ProgressBar {
        if !self.chatty() {
            return ProgressBar::hidden();
        }
        let bar = ProgressBar::new(total);
        bar.set_style(
            ProgressStyle::with_template("{elapsed:>4} [{bar:30}] {pos}/{len} {msg}")
                .expect("valid template")
                .progress_chars("=> "),
        );
        bar
    }

    /// Prints `report` as pretty JSON on stdout, and also writes it to the
    /// `--json-out` file if one was given.
    pub fn emit_json<T: Serialize>(&self, report: &T) -> Result<(), Box<dyn Error>> {
        self.write_json_file(report)?;
        println!("{}", serde_json::to_string_pretty(report)?);
        Ok(())
    }

    /// Writes `report` as pretty JSON to the `--json-out` file, if one was
    /// given.
    pub fn write_json_file<T: Serialize>(&self, report: &T) -> Result<(), Box<dyn Error>> {
        if let Some(path) = &self.json_out {
            std::fs::write(path, format!("{}\n", serde_json::to_string_pretty(report)?))?;
        }
        Ok(())
    }
}
