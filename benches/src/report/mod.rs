//! `pindown-report`: runs every benchmark program of the project (each of
//! which measures its peers and baselines in the same run), reads their
//! JSON documents into [`Section`]s, and writes the report: `report.json`,
//! a plot per figure (`plots/ID.svg` and `plots/ID.png`), `report.md`, and
//! each program's own document under `raw/`.
//!
//! * [`figure`]: what a section is made of, and the JSON path helpers.
//! * [`sections`]: the programs, in the order they run, and how each
//!   document becomes sections.
//! * [`plot`]: plots with `plotters`.
//! * [`markdown`]: the Markdown report.
//! * [`run`]: runs the programs under one progress bar with an estimate of
//!   the time left.

pub mod figure;
pub mod markdown;
pub mod plot;
pub mod run;
pub mod sections;

use std::error::Error;
use std::path::Path;

use serde::{Deserialize, Serialize};

pub use figure::{Axis, BuildError, Figure, Named, Role, Row, Section, Series};

/// How one program's run ended.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// It ran and its own checks passed (`"verified": true`).
    Verified,
    /// It ran; it has no checks of its own (a timing-only program).
    Measured,
    /// It ran but its checks failed or a figure is missing; the reason.
    Unverified(String),
    /// It did not run to the end, or printed no JSON document.
    Failed(String),
    /// Its document could not be read into sections (the section code and
    /// the program disagree); `--rebuild` tries again.
    Unreadable(String),
}

/// One program run.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct JobRun {
    /// The program and its arguments.
    pub command: String,
    /// Wall-clock seconds.
    pub seconds: f64,
    /// How it ended.
    pub outcome: Outcome,
}

/// A peer library and whether it is installed.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Peer {
    /// "Open MPI", "MPICH", "UCX".
    pub name: String,
    /// Its version, as its own tool prints it.
    pub version: Option<String>,
    /// Why it is missing (`None` when present).
    pub missing: Option<String>,
}

/// The machine the report ran on.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct MachineFacts {
    /// `/proc/cpuinfo`'s model name.
    pub cpu_model: String,
    /// CPUs this process may run on.
    pub cpus: usize,
    /// `MemTotal`, in GiB.
    pub memory_gib: f64,
    /// `/etc/os-release`'s `PRETTY_NAME`.
    pub os: String,
    /// Kernel release.
    pub kernel: String,
    /// `rustc --version` of the toolchain that built the programs.
    pub rustc: String,
}

/// The whole report, as written to `report.json`; `report.md` and the
/// plots are rendered from it alone (`pindown-report --render DIR`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Report {
    /// Whether this was the `--quick` run.
    pub quick: bool,
    /// When the run started (RFC 3339, UTC).
    pub started: String,
    /// How long it took, in seconds.
    pub seconds: f64,
    /// The command that produced it.
    pub command: String,
    /// The machine.
    pub machine: MachineFacts,
    /// The peer libraries.
    pub peers: Vec<Peer>,
    /// Each program run, in order.
    pub jobs: Vec<JobRun>,
    /// The sections, in the order of the programs.
    pub sections: Vec<Section>,
}

impl Report {
    /// Whether every program ran and passed its own checks.
    pub fn all_verified(&self) -> bool {
        self.jobs
            .iter()
            .all(|j| matches!(j.outcome, Outcome::Verified | Outcome::Measured))
    }

    /// Every figure id, in report order.
    pub fn figure_ids(&self) -> Vec<&str> {
        self.sections
            .iter()
            .flat_map(|s| s.figures.iter().map(|f| f.id.as_str()))
            .collect()
    }

    /// Writes `report.md` and `plots/` into `dir` from this report (and
    /// `report.json` too when `with_json`).
    /// `report.json` goes first, so that a plot that cannot be drawn loses
    /// nothing of the run; `plots/` is emptied of earlier plots first.
    pub fn write(&self, dir: &Path, with_json: bool) -> Result<(), Box<dyn Error>> {
        if with_json {
            std::fs::create_dir_all(dir)?;
            std::fs::write(
                dir.join(REPORT_JSON),
                format!("{}\n", serde_json::to_string_pretty(self)?),
            )?;
        }
        let plots = dir.join(PLOTS);
        std::fs::create_dir_all(&plots)?;
        for entry in std::fs::read_dir(&plots)? {
            let path = entry?.path();
            if path.extension().is_some_and(|e| e == "svg" || e == "png") {
                std::fs::remove_file(&path)?;
            }
        }
        for section in &self.sections {
            for figure in &section.figures {
                plot::write(figure, &plots)?;
            }
        }
        std::fs::write(dir.join(REPORT_MD), markdown::render(self, PLOTS))?;
        Ok(())
    }

    /// Reads `dir/report.json`.
    pub fn read(dir: &Path) -> Result<Self, Box<dyn Error>> {
        let path = dir.join(REPORT_JSON);
        let text =
            std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?)
    }
}

/// The report's JSON file name.
pub const REPORT_JSON: &str = "report.json";
/// The Markdown report's file name.
pub const REPORT_MD: &str = "report.md";
/// The plot folder, relative to the report.
pub const PLOTS: &str = "plots";
/// The folder of the programs' own documents, relative to the report.
pub const RAW: &str = "raw";
