//! `pindown-fabric-rank`: one rank of an all-to-all check of the fabric.
//!
//! Every rank joins the job ([`Job::from_environment`]), opens its host's
//! device port ([`device_socket`]: `PINDOWN_DEVICE`, or
//! `PINDOWN_DEVICE_DIR` and the local rank), registers a buffer, binds a
//! window over it and gathers every rank's window text (`node:port:key:len`,
//! [`RemoteWindow`]). Then, for every round and every other rank (the
//! target), it writes blocks of several sizes (`--sizes`, default 8 B, 1400
//! B, 64 KiB and 1 MiB; the 8-byte one inline) into its own slot of the
//! target's window, a vector write of 512 contiguous 8-byte elements into
//! every other element of a 8 KiB area of that slot, reads the blocks back
//! and compares (right after writing to
//! that target, or with `--reads-in-turn` after every rank has written,
//! one rank reading at a time between barriers), and fetch-adds `rank + 1`
//! on a counter word of rank 0's window. After a barrier every rank checks
//! every byte its window received from every writer (the last round's
//! blocks), and that its own slot, which nobody writes, is still zero; rank
//! 0 checks the counter against `rounds * (1 + 2 + ... + size)`.
//!
//! It prints one JSON line:
//!
//! ```text
//! {"rank":1,"size":8,"launcher":"environment","local_rank":1,"node":0,
//!  "port":1,"device":"/run/dev/port1.sock","rounds":2,"written":..,
//!  "vector_written":..,"read_back":..,"received":..,"fetch_adds":..,"counter":null,
//!  "expected_counter":null,"seconds":1.2,"verified":true}
//! ```
//!
//! (`counter` is rank 0's) or `{"rank":..,"error":"..."}` and exits with
//! status 1 on a mismatch or a failed request, 2 when the job cannot be
//! joined. With `--output-dir DIR` the line also goes to `DIR/rank-R.json`.
//!
//! Run by hand, for example with devices of two hosts joined in one fabric,
//! each serving `/run/pindown/port{0,1}.sock`:
//! `PINDOWN_DEVICE_DIR=/run/pindown mpiexec -n 4 -ppn 2 -hosts a,b pindown-fabric-rank`.

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use pindown_driver::launch::{device_socket, Job};
use pindown_driver::verbs::opcode::{Entry, FetchAdd, Read, Vector, Write};
use pindown_driver::verbs::{
    Completion, CompletionQueue, Context, ContextConfig, QueuePair, RemoteWindow,
};
use pindown_uapi::pattern::{Pattern, Piece};
use pindown_uapi::{Access, Status};

/// What a rank is asked to do.
#[derive(Clone, Debug)]
pub struct Options {
    /// Block sizes written to (and read back from) every other rank.
    pub sizes: Vec<usize>,
    /// How many times the exchange runs.
    pub rounds: u32,
    /// Where `rank-R.json` goes, if anywhere.
    pub output_dir: Option<PathBuf>,
    /// How long one batch of requests may take.
    pub batch_timeout: Duration,
    /// Whether ranks read back one at a time (between barriers) after
    /// all have written, instead of each right after its writes to a
    /// target.
    pub reads_in_turn: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            sizes: vec![8, 1400, 64 << 10, 1 << 20],
            rounds: 2,
            output_dir: None,
            batch_timeout: Duration::from_secs(120),
            reads_in_turn: false,
        }
    }
}

impl Options {
    /// Parses the command line (without the program name).
    pub fn parse(args: impl IntoIterator<Item = String>) -> Result<Options, String> {
        let mut options = Options::default();
        let mut args = args.into_iter();
        while let Some(arg) = args.next() {
            if arg == "--reads-in-turn" {
                options.reads_in_turn = true;
                continue;
            }
            let value = args.next().ok_or_else(|| format!("{arg} needs a value"))?;
            match arg.as_str() {
                "--sizes" => {
                    options.sizes = value
                        .split(',')
                        .map(|s| match s.trim().parse::<usize>() {
                            Ok(n) if (1..=MAX_BLOCK).contains(&n) => Ok(n),
                            _ => Err(format!("--sizes: {s:?} is not 1 to {MAX_BLOCK}")),
                        })
                        .collect::<Result<_, _>>()?;
                }
                "--rounds" => {
                    options.rounds =
                        value.parse().ok().filter(|&n| n > 0).ok_or_else(|| {
                            format!("--rounds: {value:?} is not a positive number")
                        })?;
                }
                "--output-dir" => options.output_dir = Some(PathBuf::from(value)),
                "--batch-timeout" => {
                    let seconds: u64 = value
                        .parse()
                        .map_err(|_| format!("--batch-timeout: {value:?} is not seconds"))?;
                    options.batch_timeout = Duration::from_secs(seconds.max(1));
                }
                _ => return Err(format!("unknown option {arg}")),
            }
        }
        Ok(options)
    }
}

/// The largest block (16 MiB).
const MAX_BLOCK: usize = 16 << 20;

/// Where blocks start in a slot, and the slot's length: each block
/// 64-byte aligned, then the area the vector write scatters into.
fn layout(sizes: &[usize]) -> (Vec<usize>, usize) {
    let mut offsets = Vec::with_capacity(sizes.len());
    let mut at = 0;
    for &size in sizes {
        offsets.push(at);
        at += size.next_multiple_of(64);
    }
    (offsets, at + VECTOR_AREA)
}

/// Elements of 8 bytes each vector write scatters, one every 16 bytes of
/// the target's slot (the 8 bytes between stay untouched).
const VECTOR_ELEMENTS: usize = 512;
/// Bytes each vector write moves.
pub const VECTOR_BYTES: usize = VECTOR_ELEMENTS * 8;
const VECTOR_AREA: usize = 2 * VECTOR_BYTES;

/// The target's side of the vector write: every other 8-byte element.
fn vector_pattern() -> Pattern {
    Pattern::new(vec![Piece::vector(0, 8, VECTOR_ELEMENTS as u64, 16)], 1, 0)
        .expect("a valid pattern")
}

/// The window: the counter word at 0, then one slot per writer from
/// `SLOTS_AT`.
const COUNTER_AT: u64 = 0;
const SLOTS_AT: usize = 4096;

/// Byte `index` of block `block` that `writer` writes to `target` in
/// `round`.
pub fn block_byte(writer: u32, target: u32, round: u32, block: usize, index: usize) -> u8 {
    let mut x = (index as u64)
        ^ u64::from(writer) << 40
        ^ u64::from(target) << 48
        ^ u64::from(round) << 56
        ^ (block as u64) << 34;
    // splitmix64's finalizer: every input bit moves every output byte.
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (x ^ (x >> 31)) as u8
}

fn block(writer: u32, target: u32, round: u32, block: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| block_byte(writer, target, round, block, i))
        .collect()
}

/// The counter rank 0 must end with.
pub fn expected_counter(size: u32, rounds: u32) -> u64 {
    u64::from(rounds) * (1..=u64::from(size)).sum::<u64>()
}

/// What one rank did, for its JSON line.
struct Report {
    node: u16,
    port: u16,
    device: PathBuf,
    written: u64,
    vector_written: u64,
    read_back: u64,
    received: u64,
    fetch_adds: u64,
    counter: Option<(u64, u64)>,
}

/// The first byte where `got` differs from `want`.
fn first_difference(got: &[u8], want: &[u8]) -> Option<usize> {
    got.iter().zip(want).position(|(a, b)| a != b)
}

/// Posts `entries` (all signaled) and waits for a successful completion
/// of each.
fn run_batch(
    qp: &mut QueuePair<'_>,
    cq: &mut CompletionQueue<'_>,
    entries: &[Entry<'_>],
    timeout: Duration,
    what: &str,
) -> Result<Vec<Completion>, String> {
    let mut done = Vec::with_capacity(entries.len());
    let deadline = Instant::now() + timeout;
    for chunk in entries.chunks(32) {
        let signaled: Vec<Entry<'_>> = chunk.iter().map(|e| e.signaled()).collect();
        qp.post(&signaled)
            .map_err(|e| format!("{what}: post failed: {e}"))?;
        let want = done.len() + chunk.len();
        while done.len() < want {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(format!(
                    "{what}: {} of {} completions after {timeout:?}",
                    done.len(),
                    entries.len()
                ));
            }
            match cq.wait(left) {
                Ok(completions) => done.extend(completions),
                Err(e) => return Err(format!("{what}: waiting for completions: {e}")),
            }
        }
    }
    if let Some(failed) = done.iter().find(|c| c.status != Status::Success) {
        return Err(format!("{what}: request failed: {failed:?}"));
    }
    Ok(done)
}

fn exchange(job: &mut Job, options: &Options) -> Result<Report, String> {
    let (rank, size) = (job.rank(), job.size());
    let device = device_socket(job).map_err(|e| e.to_string())?;
    let (offsets, slot_len) = layout(&options.sizes);
    let window_len = SLOTS_AT + size as usize * slot_len;
    let config = ContextConfig {
        arena_bytes: (window_len + 2 * slot_len + (8 << 20)).next_multiple_of(2 << 20),
        ..ContextConfig::default()
    };
    let context = Context::open(&device, config)
        .map_err(|e| format!("opening the device port {}: {e}", device.display()))?;
    let info = context.info();
    let alloc = |len: usize| {
        context
            .alloc(len, 4096)
            .map_err(|e| format!("allocating {len} bytes: {e}"))
    };
    let exposed = alloc(window_len)?;
    exposed.write_at(0, &vec![0u8; window_len]);
    let staging = alloc(2 * slot_len)?;
    let exposed_region = context
        .register_buffer(&exposed)
        .map_err(|e| format!("registering the window's buffer: {e}"))?;
    let staging_region = context
        .register_buffer(&staging)
        .map_err(|e| format!("registering the staging buffer: {e}"))?;
    let window = context
        .bind_window(
            &exposed_region,
            0,
            window_len as u64,
            Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC,
        )
        .map_err(|e| format!("binding the window: {e}"))?;
    let gathered = job
        .all_gather("fabric-window", window.remote().to_string().as_bytes())
        .map_err(|e| e.to_string())?;
    let windows: Vec<RemoteWindow> = gathered
        .iter()
        .enumerate()
        .map(|(r, text)| {
            let text = String::from_utf8_lossy(text);
            text.parse()
                .map_err(|e| format!("rank {r} published window {text:?}: {e}"))
        })
        .collect::<Result<_, String>>()?;
    if windows[rank as usize] != window.remote() {
        return Err(format!(
            "the gathered window of this rank is {}, not {}",
            windows[rank as usize],
            window.remote()
        ));
    }
    if let Some((r, w)) = windows
        .iter()
        .enumerate()
        .find(|(_, w)| w.len != window_len as u64)
    {
        return Err(format!(
            "rank {r}'s window {w} is not {window_len} bytes long"
        ));
    }

    let mut cq = context.create_completion_queue();
    let mut qp = context
        .create_queue_pair(&mut cq)
        .map_err(|e| format!("creating a queue pair: {e}"))?;
    let mut report = Report {
        node: info.node,
        port: info.port,
        device,
        written: 0,
        vector_written: 0,
        read_back: 0,
        received: 0,
        fetch_adds: 0,
        counter: None,
    };
    let source_at = 0u64;
    let back_at = slot_len as u64;
    let slot = (SLOTS_AT + rank as usize * slot_len) as u64;
    let locals = |base: u64| {
        options
            .sizes
            .iter()
            .zip(&offsets)
            .map(|(&len, &at)| staging_region.local(base + at as u64, len as u32))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("local range: {e}"))
    };
    // Reads this rank's slot of `target`'s window back and compares it
    // with what `round` wrote there.
    let read_back = |qp: &mut QueuePair<'_>,
                     cq: &mut CompletionQueue<'_>,
                     round: u32,
                     target: u32|
     -> Result<u64, String> {
        let remote = &windows[target as usize];
        staging.write_at(slot_len, &vec![0u8; slot_len]);
        let reads: Vec<Entry<'_>> = locals(back_at)?
            .into_iter()
            .zip(&offsets)
            .map(|(local, &at)| Read::new(local, remote.at(slot + at as u64)).build())
            .collect();
        let what = format!("round {round}: reads from rank {target} ({remote})");
        let done = run_batch(qp, cq, &reads, options.batch_timeout, &what)?;
        for (b, (&len, &at)) in options.sizes.iter().zip(&offsets).enumerate() {
            let mut got = vec![0u8; len];
            staging.read_at(slot_len + at, &mut got);
            let want = block(rank, target, round, b, len);
            if let Some(i) = first_difference(&got, &want) {
                return Err(format!(
                    "round {round}: the {len}-byte block read back from rank {target} \
                     ({remote}) differs at byte {i}: got {:#04x}, wrote {:#04x}",
                    got[i], want[i]
                ));
            }
        }
        Ok(done.iter().map(|c| u64::from(c.byte_len)).sum())
    };
    for round in 0..options.rounds {
        for step in 1..size {
            // Staggered, so that not every rank writes to the same target
            // at once.
            let target = (rank + step) % size;
            let remote = &windows[target as usize];
            for (b, (&len, &at)) in options.sizes.iter().zip(&offsets).enumerate() {
                staging.write_at(at, &block(rank, target, round, b, len));
            }
            let writes: Vec<Entry<'_>> = locals(source_at)?
                .into_iter()
                .zip(&offsets)
                .map(|(local, &at)| {
                    let entry = Write::new(local, remote.at(slot + at as u64)).build();
                    if local.len() <= 8 {
                        entry.inline()
                    } else {
                        entry
                    }
                })
                .collect();
            let what = format!("round {round}: writes to rank {target} ({remote})");
            let done = run_batch(&mut qp, &mut cq, &writes, options.batch_timeout, &what)?;
            report.written += done.iter().map(|c| u64::from(c.byte_len)).sum::<u64>();
            // A vector write: contiguous elements here, every other
            // element there.
            let vector_at = slot_len - VECTOR_AREA;
            let elements = options.sizes.len();
            staging.write_at(
                vector_at,
                &block(rank, target, round, elements, VECTOR_BYTES),
            );
            let local = staging_region
                .local(source_at + vector_at as u64, VECTOR_BYTES as u32)
                .map_err(|e| format!("local range: {e}"))?;
            let vector = Vector::write(
                local,
                Pattern::contiguous(VECTOR_BYTES as u64),
                remote.at(slot + vector_at as u64),
                vector_pattern(),
            )
            .map_err(|e| format!("vector write: {e}"))?;
            let what = format!("round {round}: vector write to rank {target} ({remote})");
            let done = run_batch(
                &mut qp,
                &mut cq,
                &[vector.build()],
                options.batch_timeout,
                &what,
            )?;
            report.vector_written += done.iter().map(|c| u64::from(c.byte_len)).sum::<u64>();
            if !options.reads_in_turn {
                report.read_back += read_back(&mut qp, &mut cq, round, target)?;
            }
        }
        if options.reads_in_turn {
            // One rank reads at a time, between barriers.
            for reader in 0..size {
                job.barrier().map_err(|e| e.to_string())?;
                if reader == rank {
                    for step in 1..size {
                        let target = (rank + step) % size;
                        report.read_back += read_back(&mut qp, &mut cq, round, target)?;
                    }
                }
            }
            job.barrier().map_err(|e| e.to_string())?;
        }
        let add = FetchAdd::new(windows[0].at(COUNTER_AT), u64::from(rank) + 1).build();
        let what = format!(
            "round {round}: fetch-add on rank 0's counter ({})",
            windows[0]
        );
        run_batch(&mut qp, &mut cq, &[add], options.batch_timeout, &what)?;
        report.fetch_adds += 1;
    }
    job.barrier().map_err(|e| e.to_string())?;

    // Every writer's last round, byte for byte; this rank's own slot is
    // written by nobody.
    let last = options.rounds - 1;
    for writer in 0..size {
        let slot = SLOTS_AT + writer as usize * slot_len;
        for (b, (&len, &at)) in options.sizes.iter().zip(&offsets).enumerate() {
            let mut got = vec![0u8; len];
            exposed.read_at(slot + at, &mut got);
            let want = if writer == rank {
                vec![0u8; len]
            } else {
                block(writer, rank, last, b, len)
            };
            if let Some(i) = first_difference(&got, &want) {
                return Err(format!(
                    "the {len}-byte block rank {writer} wrote into this rank's window \
                     differs at byte {i}: got {:#04x}, want {:#04x}",
                    got[i], want[i]
                ));
            }
            if writer != rank {
                report.received += len as u64;
            }
        }
        // The vector area: each element where the pattern put it, the
        // bytes between untouched.
        let mut area = vec![0u8; VECTOR_AREA];
        exposed.read_at(slot + slot_len - VECTOR_AREA, &mut area);
        let elements = if writer == rank {
            vec![0u8; VECTOR_BYTES]
        } else {
            block(writer, rank, last, options.sizes.len(), VECTOR_BYTES)
        };
        let mut want = vec![0u8; VECTOR_AREA];
        for (i, element) in elements.chunks(8).enumerate() {
            want[16 * i..16 * i + 8].copy_from_slice(element);
        }
        if let Some(i) = first_difference(&area, &want) {
            return Err(format!(
                "the vector write of rank {writer} into this rank's window differs at byte \
                 {i} of its area: got {:#04x}, want {:#04x}",
                area[i], want[i]
            ));
        }
        if writer != rank {
            report.received += VECTOR_BYTES as u64;
        }
    }
    if rank == 0 {
        let mut word = [0u8; 8];
        exposed.read_at(COUNTER_AT as usize, &mut word);
        let counter = u64::from_le_bytes(word);
        let expected = expected_counter(size, options.rounds);
        report.counter = Some((counter, expected));
        if counter != expected {
            return Err(format!(
                "rank 0's counter is {counter}, but {size} ranks adding rank + 1 in each of \
                 {} rounds make {expected}",
                options.rounds
            ));
        }
    }
    // Nobody leaves (and revokes its window) before all have checked.
    job.barrier().map_err(|e| e.to_string())?;
    drop(window);
    Ok(report)
}

fn json_string(text: &str) -> String {
    let mut out = String::from("\"");
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn optional<T: std::fmt::Display>(value: Option<T>) -> String {
    value.map_or("null".into(), |v| v.to_string())
}

/// Runs one rank with the command line `args` (without the program
/// name); prints (and stores) its JSON line; returns the exit status.
pub fn rank_main(args: impl IntoIterator<Item = String>) -> u8 {
    let options = match Options::parse(args) {
        Ok(options) => options,
        Err(error) => {
            eprintln!("pindown-fabric-rank: {error}");
            eprintln!(
                "usage: pindown-fabric-rank [--sizes B,B,..] [--rounds N] [--output-dir DIR] \
                 [--batch-timeout SECONDS] [--reads-in-turn]"
            );
            return 64;
        }
    };
    let started = Instant::now();
    let mut job = match Job::from_environment() {
        Ok(job) => job,
        Err(error) => {
            eprintln!("pindown-fabric-rank: {error}");
            println!("{{\"error\":{}}}", json_string(&error.to_string()));
            return 2;
        }
    };
    let rank = job.rank();
    let head = format!(
        "\"rank\":{rank},\"size\":{},\"launcher\":{},\"local_rank\":{}",
        job.size(),
        json_string(job.launcher().name()),
        optional(job.local_rank()),
    );
    let (line, status) = match exchange(&mut job, &options) {
        Ok(report) => {
            let finalized = job.finalize().map_err(|e| e.to_string());
            let line = format!(
                "{{{head},\"node\":{},\"port\":{},\"device\":{},\"rounds\":{},\"written\":{},\
                 \"vector_written\":{},\"read_back\":{},\"received\":{},\"fetch_adds\":{},\"counter\":{},\
                 \"expected_counter\":{},\"seconds\":{:.3},\"verified\":{}{}}}\n",
                report.node,
                report.port,
                json_string(&report.device.display().to_string()),
                options.rounds,
                report.written,
                report.vector_written,
                report.read_back,
                report.received,
                report.fetch_adds,
                optional(report.counter.map(|(got, _)| got)),
                optional(report.counter.map(|(_, want)| want)),
                started.elapsed().as_secs_f64(),
                finalized.is_ok(),
                match &finalized {
                    Ok(()) => String::new(),
                    Err(e) => format!(",\"error\":{}", json_string(e)),
                },
            );
            let status = if finalized.is_ok() { 0 } else { 1 };
            (line, status)
        }
        Err(error) => {
            eprintln!("pindown-fabric-rank: rank {rank}: {error}");
            (
                format!(
                    "{{{head},\"verified\":false,\"error\":{}}}\n",
                    json_string(&error)
                ),
                1,
            )
        }
    };
    if let Some(dir) = &options.output_dir {
        let path = dir.join(format!("rank-{rank}.json"));
        if let Err(error) = std::fs::write(&path, &line) {
            eprintln!("pindown-fabric-rank: {}: {error}", path.display());
            return 1;
        }
    }
    // One write per line, so that a launcher forwarding the output keeps
    // lines of different ranks apart.
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(line.as_bytes()).ok();
    stdout.flush().ok();
    status
}

#[allow(dead_code)] // Not called where the tests include this file as a module.
fn main() -> ExitCode {
    ExitCode::from(rank_main(std::env::args().skip(1)))
}
