//! Runs the programs one after the other under one progress bar, keeps
//! each one's document under `raw/` and its stderr under the log folder,
//! and builds the [`Report`].

use std::error::Error;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::Value;

use super::sections::Job;
use super::{JobRun, MachineFacts, Outcome, Peer, Report, Section, RAW};
use crate::mpi::{find_in_path, Flavor};

/// What a report run needs to know.
#[derive(Clone, Debug)]
pub struct Options {
    /// The short version.
    pub quick: bool,
    /// Where the report goes.
    pub out: PathBuf,
    /// Where each program's stderr goes (`PROGRAM.log`).
    pub logs: PathBuf,
    /// The folder holding the benchmark programs.
    pub programs: PathBuf,
    /// Show the progress bar (stderr is a terminal and not `--quiet`).
    pub progress: bool,
    /// The command line, for the report.
    pub command: String,
}

/// Runs `jobs` and returns the report (not yet written, but for the raw
/// documents); a program that fails is recorded, and the others still run.
pub fn run(jobs: &[Job], options: &Options) -> Result<Report, Box<dyn Error>> {
    let raw = options.out.join(RAW);
    std::fs::create_dir_all(&raw)?;
    std::fs::create_dir_all(&options.logs)?;
    let started = SystemTime::now();
    let clock = Instant::now();
    let estimates = estimates(jobs, options);
    let total: f64 = estimates.iter().sum();
    let bar = progress_bar(total, options.progress);
    let mut runs = Vec::new();
    let mut sections = Vec::new();
    let mut done_s = 0.0;
    for (job, estimate) in jobs.iter().zip(&estimates) {
        bar.set_message(job.program);
        let ticker = Ticker::start(&bar, done_s, *estimate);
        let began = Instant::now();
        let result = run_job(job, options, &raw);
        ticker.stop();
        done_s += estimate;
        bar.set_position(millis(done_s));
        let seconds = began.elapsed().as_secs_f64();
        let command = job.command(options.quick);
        let outcome = read_sections(job, result, &mut sections);
        if let Outcome::Failed(why) | Outcome::Unreadable(why) | Outcome::Unverified(why) = &outcome
        {
            // Shown whether or not the bar is (a hidden bar prints nothing).
            bar.suspend(|| eprintln!("pindown-report: {command}: {why}"));
        }
        runs.push(JobRun {
            command,
            seconds,
            outcome,
        });
    }
    bar.finish_and_clear();
    Ok(Report {
        quick: options.quick,
        started: humantime::format_rfc3339_seconds(started).to_string(),
        seconds: clock.elapsed().as_secs_f64(),
        command: options.command.clone(),
        machine: machine(),
        peers: peers(),
        jobs: runs,
        sections,
    })
}

fn millis(seconds: f64) -> u64 {
    (seconds * 1000.0) as u64
}

fn progress_bar(total_s: f64, visible: bool) -> ProgressBar {
    if !visible {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(millis(total_s)), ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template(
            "{elapsed_precise} [{bar:36}] {percent:>3}% about {eta} left  {msg}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    bar
}

/// Moves the bar through a running program's estimate (stopping short of
/// its end, so that a slow program holds the bar instead of overrunning).
struct Ticker {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<()>,
}

impl Ticker {
    fn start(bar: &ProgressBar, done_s: f64, estimate_s: f64) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let (flag, bar) = (stop.clone(), bar.clone());
        let thread = std::thread::spawn(move || {
            let began = Instant::now();
            while !flag.load(Ordering::Relaxed) {
                let run = began.elapsed().as_secs_f64().min(estimate_s * 0.97);
                bar.set_position(millis(done_s + run));
                std::thread::sleep(Duration::from_millis(200));
            }
        });
        Self { stop, thread }
    }

    fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.thread.join();
    }
}

/// Each job's expected seconds: what the previous report in the output
/// folder measured for the same command, else the built-in estimate.
fn estimates(jobs: &[Job], options: &Options) -> Vec<f64> {
    let previous = super::Report::read(&options.out).ok();
    jobs.iter()
        .map(|job| {
            let command = job.command(options.quick);
            previous
                .as_ref()
                .and_then(|r| r.jobs.iter().find(|j| j.command == command))
                .filter(|j| {
                    j.seconds > 0.0 && matches!(j.outcome, Outcome::Verified | Outcome::Measured)
                })
                .map(|j| j.seconds)
                .unwrap_or(if options.quick {
                    job.estimate_s.0
                } else {
                    job.estimate_s.1
                })
                .max(0.1)
        })
        .collect()
}

/// Appends the sections of `job`'s document (or of the reason it has
/// none) to `sections`; returns how the job ended.
fn read_sections(job: &Job, doc: Result<Value, String>, sections: &mut Vec<Section>) -> Outcome {
    match doc {
        Err(why) => Outcome::Failed(why),
        Ok(doc) => match (job.sections)(&doc) {
            Err(why) => Outcome::Unreadable(why),
            Ok(mut built) => {
                sections.append(&mut built);
                verdict(&doc)
            }
        },
    }
}

/// The report again from the programs' documents kept in `dir/raw/`,
/// running nothing: the run's facts (when, how long, the machine, the
/// peers, which programs failed to run) come from `dir/report.json`, the
/// sections and verdicts from the current section code.
pub fn rebuild(jobs: &[Job], dir: &Path) -> Result<Report, Box<dyn Error>> {
    let previous = Report::read(dir)?;
    let mut sections = Vec::new();
    let runs = jobs
        .iter()
        .map(|job| {
            let command = job.command(previous.quick);
            let earlier = previous.jobs.iter().find(|j| j.command == command);
            let outcome = match earlier {
                // The program did not run to the end: there is nothing to
                // build from.
                Some(JobRun {
                    outcome: Outcome::Failed(why),
                    ..
                }) => Outcome::Failed(why.clone()),
                _ => read_sections(job, read_raw(dir, job), &mut sections),
            };
            JobRun {
                command,
                seconds: earlier.map_or(0.0, |r| r.seconds),
                outcome,
            }
        })
        .collect();
    Ok(Report {
        jobs: runs,
        sections,
        ..previous
    })
}

/// `job`'s document kept in `dir/raw/`.
fn read_raw(dir: &Path, job: &Job) -> Result<Value, String> {
    let path = raw_path(&dir.join(RAW), job);
    let bytes = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    serde_json::from_slice(&bytes).map_err(|e| format!("{} is not JSON: {e}", path.display()))
}

fn raw_path(raw: &Path, job: &Job) -> PathBuf {
    raw.join(format!("{}.json", job.program))
}

/// The program's own verdict from its document: `"verified"` must be
/// `true` when present (absent: a timing-only program), and a document
/// that says `"complete": false` (a pass skipped) is not verified either.
fn verdict(doc: &Value) -> Outcome {
    if doc.get("complete").and_then(Value::as_bool) == Some(false) {
        return Outcome::Unverified(
            "its document says \"complete\": false (a pass was skipped; see its log)".into(),
        );
    }
    match doc.get("verified") {
        None => Outcome::Measured,
        Some(Value::Bool(true)) => Outcome::Verified,
        Some(Value::Bool(false)) => Outcome::Unverified(
            "its document says \"verified\": false (see its log and raw document)".into(),
        ),
        Some(other) => Outcome::Unverified(format!(
            "its document's \"verified\" is {other}, not true or false"
        )),
    }
}

/// How long a program may run: many times its built-in estimate, so
/// that only a hung program reaches it.
fn time_limit(job: &Job, quick: bool) -> Duration {
    let estimate = if quick {
        job.estimate_s.0
    } else {
        job.estimate_s.1
    };
    Duration::from_secs_f64(estimate * 10.0 + 300.0)
}

/// Runs one program; its parsed stdout, or why it failed. Its previous
/// document is removed first, so that `raw/` never holds a stale one.
fn run_job(job: &Job, options: &Options, raw: &Path) -> Result<Value, String> {
    let raw_path = raw_path(raw, job);
    match std::fs::remove_file(&raw_path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(format!("{}: {e}", raw_path.display()));
        }
        _ => {}
    }
    let binary = options.programs.join(job.program);
    if !binary.is_file() {
        return Err(format!(
            "{} is missing (cargo build --release -p pindown-benches --bins)",
            binary.display()
        ));
    }
    let _huge_pages = if job.huge_pages {
        HugePages::raise_for(&binary, options.quick)
    } else {
        None
    };
    let log_path = options.logs.join(format!("{}.log", job.program));
    let log =
        std::fs::File::create(&log_path).map_err(|e| format!("{}: {e}", log_path.display()))?;
    let mut child = Command::new(&binary)
        .args(job.args(options.quick))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log)
        .spawn()
        .map_err(|e| format!("could not start {}: {e}", binary.display()))?;
    RUNNING_CHILD.store(child.id() as i32, Ordering::SeqCst);
    let mut stdout = child.stdout.take().expect("piped stdout");
    let (sender, output) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = sender.send(std::io::Read::read_to_end(&mut stdout, &mut bytes).map(|_| bytes));
    });
    let limit = time_limit(job, options.quick);
    let began = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if began.elapsed() > limit => {
                let _ = child.kill();
                let _ = child.wait();
                RUNNING_CHILD.store(0, Ordering::SeqCst);
                return Err(format!(
                    "still running after {} s, killed (stderr in {})",
                    limit.as_secs(),
                    log_path.display()
                ));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => return Err(format!("waiting for it: {e}")),
        }
    };
    RUNNING_CHILD.store(0, Ordering::SeqCst);
    // The pipe closes when the program is gone, unless a process it left
    // behind still holds it.
    let stdout = output
        .recv_timeout(Duration::from_secs(30))
        .map_err(|_| {
            "its stdout stayed open 30 s after it exited (a process it started holds it)"
                .to_string()
        })?
        .map_err(|e| format!("reading its output: {e}"))?;
    std::fs::write(&raw_path, &stdout).map_err(|e| format!("{}: {e}", raw_path.display()))?;
    if !status.success() {
        return Err(format!(
            "exited with {status} (stderr in {})",
            log_path.display()
        ));
    }
    serde_json::from_slice(&stdout).map_err(|e| {
        format!(
            "its output is not JSON ({e}; stderr in {})",
            log_path.display()
        )
    })
}

/// The program running now (its pid, 0 for none), stopped if the report
/// is interrupted.
static RUNNING_CHILD: AtomicI32 = AtomicI32::new(0);

/// The `vm.nr_hugepages` to put back (`u64::MAX`: nothing raised).
static HUGE_PAGES_BEFORE: AtomicU64 = AtomicU64::new(u64::MAX);

/// On SIGINT, SIGTERM or SIGHUP: stop the running program, put
/// `vm.nr_hugepages` back, and exit as the signal would have.
fn restore_on_signal() {
    static INSTALLED: std::sync::Once = std::sync::Once::new();
    INSTALLED.call_once(|| {
        use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
        let Ok(mut signals) = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP]) else {
            return;
        };
        std::thread::spawn(move || {
            if let Some(signal) = signals.forever().next() {
                let child = RUNNING_CHILD.load(Ordering::SeqCst);
                if child > 0 {
                    // SAFETY: kill(2) with a pid this process started and
                    // has not reaped yet (cleared after each wait).
                    unsafe { libc::kill(child, libc::SIGTERM) };
                }
                let before = HUGE_PAGES_BEFORE.load(Ordering::SeqCst);
                if before != u64::MAX {
                    let _ = std::fs::write(NR_HUGEPAGES, before.to_string());
                }
                std::process::exit(128 + signal);
            }
        });
    });
}

/// `vm.nr_hugepages` raised for one program and put back on drop (or on
/// a signal, see [`restore_on_signal`]).
struct HugePages {
    before: u64,
}

const NR_HUGEPAGES: &str = "/proc/sys/vm/nr_hugepages";

impl HugePages {
    fn raise_for(binary: &Path, quick: bool) -> Option<Self> {
        let mut ask = Command::new(binary);
        if quick {
            ask.arg("--quick");
        }
        let wanted: u64 = String::from_utf8(ask.arg("--huge-pages-wanted").output().ok()?.stdout)
            .ok()?
            .trim()
            .parse()
            .ok()?;
        let before: u64 = std::fs::read_to_string(NR_HUGEPAGES)
            .ok()?
            .trim()
            .parse()
            .ok()?;
        if before >= wanted {
            return None;
        }
        restore_on_signal();
        HUGE_PAGES_BEFORE.store(before, Ordering::SeqCst);
        if std::fs::write(NR_HUGEPAGES, wanted.to_string()).is_err() {
            HUGE_PAGES_BEFORE.store(u64::MAX, Ordering::SeqCst);
            return None;
        }
        Some(Self { before })
    }
}

impl Drop for HugePages {
    fn drop(&mut self) {
        let _ = std::fs::write(NR_HUGEPAGES, self.before.to_string());
        HUGE_PAGES_BEFORE.store(u64::MAX, Ordering::SeqCst);
    }
}

/// The first line a command prints (stdout, else stderr), if it runs.
fn first_line(program: &str, args: &[&str]) -> Option<String> {
    let out = Command::new(program).args(args).output().ok()?;
    let text = if out.stdout.is_empty() {
        out.stderr
    } else {
        out.stdout
    };
    String::from_utf8_lossy(&text)
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .map(str::to_string)
}

/// The peer libraries: each MPI by its own tools, UCX by `ucx_info` and
/// its headers (the registration-cache peer is compiled against them).
pub fn peers() -> Vec<Peer> {
    let mut peers: Vec<Peer> = [Flavor::OpenMpi, Flavor::Mpich]
        .into_iter()
        .map(|flavor| {
            let missing = flavor.missing();
            let version = missing
                .is_none()
                .then(|| match flavor {
                    Flavor::OpenMpi => first_line("ompi_info", &["--version"]),
                    Flavor::Mpich => first_line("mpichversion", &[]),
                })
                .flatten()
                .map(|v| v.split_whitespace().collect::<Vec<_>>().join(" "));
            Peer {
                name: match flavor {
                    Flavor::OpenMpi => "Open MPI",
                    Flavor::Mpich => "MPICH",
                }
                .to_string(),
                version,
                missing,
            }
        })
        .collect();
    let ucx_missing = if find_in_path("ucx_info").is_none() {
        Some("ucx_info is not on PATH (Debian package ucx-utils)".to_string())
    } else {
        crate::ucx::missing()
    };
    peers.push(Peer {
        name: "UCX".to_string(),
        version: ucx_missing
            .is_none()
            .then(|| first_line("ucx_info", &["-v"]))
            .flatten()
            .map(|l| l.trim_start_matches('#').trim().to_string()),
        missing: ucx_missing,
    });
    peers
}

/// The header of UCX's registration cache.
pub const UCX_RCACHE_HEADER: &str = crate::ucx::RCACHE_HEADER;

fn machine() -> MachineFacts {
    let read = |path: &str| std::fs::read_to_string(path).unwrap_or_default();
    let field = |text: &str, key: &str| {
        text.lines().find_map(|l| l.strip_prefix(key)).map(|v| {
            v.trim_start_matches([':', '=', ' ', '\t'])
                .trim()
                .trim_matches('"')
                .to_string()
        })
    };
    let memory_kib: f64 = field(&read("/proc/meminfo"), "MemTotal")
        .and_then(|v| v.split_whitespace().next().map(str::to_string))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    MachineFacts {
        cpu_model: field(&read("/proc/cpuinfo"), "model name").unwrap_or_default(),
        cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        memory_gib: memory_kib / (1024.0 * 1024.0),
        os: field(&read("/etc/os-release"), "PRETTY_NAME").unwrap_or_default(),
        kernel: read("/proc/sys/kernel/osrelease").trim().to_string(),
        rustc: first_line("rustc", &["--version"]).unwrap_or_else(|| "unknown".into()),
    }
}
