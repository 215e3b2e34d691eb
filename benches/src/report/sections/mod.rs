//! The programs the report runs, in order, and how each program's JSON
//! document becomes report sections.
//!
//! * [`pincache`]: `pin-cost`, `pin-hitrate`, `register-cost` and
//!   `barrier-wait` (PM's table 2 and figures 2, 4 and 5; UCX's
//!   registration cache).
//! * [`rdma`]: `latency` (latency and bandwidth by size, arena and heap
//!   memory, against memcpy and a cache-line ping-pong).
//! * [`vector`]: `vector-transfer` (DIMMnet-2's figures 3-6 and 10-13,
//!   against Open MPI's and MPICH's derived datatypes).
//! * [`messaging`]: `fmpl` and `gasnet` (FMPL's figure 7 and table 2,
//!   collectives, GASNet/TCA's figures 7-10 and the Himeno-like run).
//! * [`fabric`]: `fabric` (latency and bandwidth against raw UDP, under
//!   loss, memory per peer).

pub mod fabric;
pub mod messaging;
pub mod pincache;
pub mod rdma;
pub mod vector;

use serde_json::Value;

use super::figure::{BuildError, Section};

/// One program the report runs.
#[derive(Clone, Copy, Debug)]
pub struct Job {
    /// The binary, a sibling of `pindown-report` in the target folder.
    pub program: &'static str,
    /// Its arguments in a `--quick` report.
    pub quick_args: &'static [&'static str],
    /// Its arguments in a full report.
    pub full_args: &'static [&'static str],
    /// Seconds it is expected to take (quick, full) on a 2-core machine,
    /// for the progress bar until a previous report in the output folder
    /// gives measured ones.
    pub estimate_s: (f64, f64),
    /// Whether it wants 2 MiB huge pages (`--huge-pages-wanted` tells how
    /// many; the report raises `vm.nr_hugepages` for it when root).
    pub huge_pages: bool,
    /// Its document's sections.
    pub sections: fn(&Value) -> Result<Vec<Section>, BuildError>,
}

impl Job {
    /// The arguments for a quick or a full report.
    pub fn args(&self, quick: bool) -> &'static [&'static str] {
        if quick {
            self.quick_args
        } else {
            self.full_args
        }
    }

    /// The command line, for the report.
    pub fn command(&self, quick: bool) -> String {
        std::iter::once(self.program)
            .chain(self.args(quick).iter().copied())
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// Every program, in the order the report runs and presents them.
pub fn jobs() -> Vec<Job> {
    vec![
        Job {
            program: "pin-cost",
            quick_args: &["--quick", "--quiet"],
            full_args: &["--quiet"],
            estimate_s: (1.0, 3.0),
            huge_pages: false,
            sections: pincache::pin_cost,
        },
        Job {
            program: "pin-hitrate",
            quick_args: &["--quick", "--quiet"],
            full_args: &["--quiet"],
            estimate_s: (3.0, 15.0),
            huge_pages: false,
            sections: pincache::pin_hitrate,
        },
        Job {
            program: "register-cost",
            quick_args: &["--quick", "--quiet"],
            full_args: &["--quiet"],
            estimate_s: (2.0, 10.0),
            huge_pages: false,
            sections: pincache::register_cost,
        },
        Job {
            program: "barrier-wait",
            quick_args: &["--quick", "--quiet"],
            full_args: &["--quiet"],
            estimate_s: (1.0, 3.0),
            huge_pages: false,
            sections: pincache::barrier_wait,
        },
        Job {
            program: "latency",
            quick_args: &["--quick", "--quiet", "--memory", "arena,heap"],
            full_args: &["--quiet", "--memory", "arena,heap"],
            estimate_s: (3.0, 8.0),
            huge_pages: false,
            sections: rdma::latency,
        },
        Job {
            program: "vector-transfer",
            quick_args: &["--quick", "--quiet"],
            full_args: &["--quiet"],
            estimate_s: (10.0, 100.0),
            huge_pages: true,
            sections: vector::vector_transfer,
        },
        Job {
            program: "fabric",
            quick_args: &["--quick", "--quiet"],
            full_args: &["--quiet"],
            estimate_s: (3.0, 110.0),
            huge_pages: false,
            sections: fabric::fabric,
        },
        Job {
            program: "fmpl",
            quick_args: &["--quick"],
            full_args: &[],
            estimate_s: (16.0, 600.0),
            huge_pages: false,
            sections: messaging::fmpl,
        },
        Job {
            program: "gasnet",
            quick_args: &["--quick"],
            full_args: &[],
            estimate_s: (5.0, 70.0),
            huge_pages: false,
            sections: messaging::gasnet,
        },
    ]
}
