//! `am_check`: ranks that check the GASNet-style active messages and
//! one-sided transfers (`pindown_messaging::gasnet`) byte by byte, and a
//! launcher that starts them with an emulated NIC.
//!
//! ```text
//! am_check launch N SCENARIO [ARGS]   # a device with N ports, N ranks
//! am_check rank SCENARIO [ARGS]       # one rank (under mpiexec, or launch)
//! am_check device ARGS...             # the emulated NIC
//! ```
//!
//! Every rank prints one JSON line: `{"rank":0,"size":2,"scenario":...,
//! "ok":true,"checked":N,"counters":{...},"notes":[...]}` (or `"ok":false`
//! with `"error"`, exit status 1).
//!
//! Scenarios:
//! * `handlers`: every rank sends every rank (itself included) short,
//!   medium and long requests; each handler checks its arguments and
//!   bytes and counts (source, kind, sequence) and replies (short, medium
//!   or long); at the end every count must be exactly one, in order per
//!   sender, and a second reply or a reply from a reply handler must have
//!   failed.
//! * `flood [--all] [--messages N]`: a 2-slot ring; every rank but 0 (with
//!   `--all`: every rank to every other) sends N mediums to rank 0, which
//!   checks them in order, each once.
//! * `misalign [--get message] [--every N] [--sparse N]`: each rank puts
//!   into the next one at every source and destination misalignment 0..7
//!   and every length up to N (then sparser up to the second bound); the
//!   target's handler checks the bytes and 16 guard bytes each side; then
//!   gets at every misalignment, checked with their guards.
//! * `strided`: strided (1 to 5 levels), vector and indexed put and get,
//!   blocking and (strided) nonblocking from and into the segment,
//!   checked against a model of the target's area each rank keeps.
//! * `notified-put`: each rank puts a strided pattern into the next with
//!   `put_strided_nb` and a short request behind it, unwaited; the next
//!   rank checks the whole area as soon as the request's handler ran.
//! * `bad-packet`: rank 1 writes malformed packets into rank 0's ring;
//!   rank 0 reports each as an error, runs none, and still runs the good
//!   ones between them.
//! * `barriers`: 200 barriers in a row, each checked by the words every
//!   rank put into every segment before entering it.
//! * `peer-death`: the last rank exits mid-job; the others' wait and a
//!   send to it must fail with `PeerGone` naming it.
//! * `peer-finalized`: the last rank finalizes (its segment's window is
//!   revoked) but its process and port stay; the others' wait must fail
//!   with `PeerGone` naming it, found by a refused liveness check.
//! * `leave-while-owed` (2 ranks): rank 1 sends a request whose handler
//!   takes a second, passes the last barrier and finalizes with its port
//!   up while rank 0 still runs that handler; rank 0 leaves the barrier,
//!   its credit return for rank 1's packets is refused, and it learns
//!   from that refusal that rank 1 is gone.
//! * `latency`: times a short request and its reply against a blocking
//!   8-byte put (notes; a measurement).
//! * `pio`: times blocking puts of 8..512 bytes inline (PIO) and by DMA
//!   (notes; a measurement, never a pass/fail criterion).
//! * `stuck-reply` (2 ranks): rank 0 asks rank 1 for a reply while rank 1
//!   does nothing but native gets for 8 s (timeout 5 s): the reply must
//!   reach rank 0 while rank 1 waits for its gets.
//!
//! `--liveness-ms N` sets `Config::liveness_interval` for any scenario.

use std::cell::RefCell;
use std::collections::HashMap;
use std::process::ExitCode;
use std::rc::Rc;
use std::time::{Duration, Instant};

use pindown_driver::launch::{device_socket, Job};
use pindown_messaging::gasnet::{
    CacheConfig, Config, Counters, Endpoint, GetMode, Handlers, Replacement, Token,
};
use serde_json::{json, Value};

#[path = "scenarios/hostile_gasnet.rs"]
mod hostile_gasnet;
#[path = "scenarios/launcher.rs"]
mod launcher;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    launcher::main("am_check", &args, rank)
}

/// What a scenario checked.
#[derive(Default)]
struct Tally {
    checked: u64,
    notes: Vec<String>,
    extra: serde_json::Map<String, Value>,
}

type Outcome = Result<Tally, String>;

fn rank(scenario: &str, args: &[String]) -> ExitCode {
    let mut job = match Job::from_environment() {
        Ok(job) => job,
        Err(err) => {
            println!("{}", json!({"ok": false, "error": err.to_string()}));
            return ExitCode::from(2);
        }
    };
    let (rank, size) = (job.rank(), job.size());
    let mut counters = Counters::default();
    let outcome = run(&mut job, scenario, args, &mut counters);
    let mut line = json!({"rank": rank, "size": size, "scenario": scenario});
    match &outcome {
        Ok(tally) => {
            line["ok"] = json!(true);
            line["checked"] = json!(tally.checked);
            line["notes"] = json!(tally.notes);
            for (k, v) in &tally.extra {
                line[k] = v.clone();
            }
        }
        Err(err) => {
            line["ok"] = json!(false);
            line["error"] = json!(err);
        }
    }
    line["counters"] = json!({
        "requests": counters.requests, "replies": counters.replies,
        "handlers_run": counters.handlers_run, "stalls": counters.stalls,
        "credit_returns": counters.credit_returns, "credits_returned": counters.credits_returned,
        "pio_writes": counters.pio_writes, "dma_writes": counters.dma_writes,
        "fixup_bytes": counters.fixup_bytes, "bounced": counters.bounced,
        "vector_transfers": counters.vector_transfers, "gets_native": counters.gets_native,
        "gets_by_message": counters.gets_by_message, "bad_packets": counters.bad_packets,
        "requests_held": counters.requests_held, "get_data_refused": counters.get_data_refused,
    });
    println!("{line}");
    if outcome.is_ok() {
        let _ = job.finalize();
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn arg<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(String::as_str)
}

fn run(job: &mut Job, scenario: &str, args: &[String], counters: &mut Counters) -> Outcome {
    let socket = device_socket(job).map_err(|e| e.to_string())?;
    let context = launcher::open(&socket)?;
    let mut config = Config {
        segment_bytes: 4 << 20,
        ..Config::default()
    };
    if let Some(ms) = arg(args, "--liveness-ms") {
        let ms: u64 = ms.parse().map_err(|e| format!("--liveness-ms {ms}: {e}"))?;
        config.liveness_interval = Duration::from_millis(ms);
    }
    if arg(args, "--get") == Some("message") {
        config.get = GetMode::ByMessage;
        config.get_bounce_bytes = 4096;
    }
    if scenario == "descriptors" || (scenario == "remap-put" && arg(args, "--cache") != Some("off"))
    {
        config.descriptor_cache = Some(descriptor_config(args)?);
    }
    if scenario == "stuck-reply" {
        // A short timeout, so that a reply left queued fails the
        // requester within seconds.
        config.timeout = Duration::from_secs(5);
    }
    if scenario.starts_with("hostile-") {
        config.ring_slots = 8;
        return hostile_gasnet::run(job, &context, config, scenario, counters);
    }
    if scenario == "config-checks" {
        return config_checks(job, &context, config);
    }
    let state = Rc::new(RefCell::new(State::default()));
    let handlers = match scenario {
        "flood" => {
            config.ring_slots = 2;
            config.slot_bytes = 256;
            flood_handlers(&state)
        }
        "handlers" => message_handlers(&state, job.rank()),
        "misalign" => misalign_handlers(&state, job.rank()),
        "stuck-reply" => stuck_reply_handlers(&state),
        "bad-packet" | "forged-credit" => bad_packet_handlers(&state),
        "latency" => latency_handlers(&state),
        "notified-put" => notice_handlers(&state),
        "leave-while-owed" => {
            // Every packet consumed is owed back at once.
            config.ring_slots = 2;
            slow_handlers(&state)
        }
        _ => Handlers::new(),
    };
    let mut ep = Endpoint::new(&context, job, config, handlers).map_err(|e| e.to_string())?;
    ep.barrier().map_err(|e| format!("first barrier: {e}"))?;
    if scenario == "peer-finalized" {
        return peer_finalized(ep);
    }
    if scenario == "leave-while-owed" {
        return leave_while_owed(ep, &state, counters);
    }
    let outcome = match scenario {
        "handlers" => handlers_scenario(&mut ep, &state),
        "flood" => flood(&mut ep, &state, args),
        "misalign" => misalign(&mut ep, &state, args),
        "stuck-reply" => stuck_reply(&mut ep, &state),
        "strided" => strided(&mut ep),
        "notified-put" => notified_put(&mut ep, &state),
        "bad-packet" => bad_packet(&mut ep, &state),
        "pio" => pio(&mut ep),
        "peer-death" => peer_death(&mut ep),
        "latency" => latency(&mut ep, &state),
        "barriers" => barriers(&mut ep),
        "descriptors" => descriptors(&mut ep),
        "stale-get" => stale_get(&mut ep),
        "remap-put" => remap_put(&mut ep, args),
        "forged-barrier" => forged_barrier(&mut ep),
        "late-get-reply" => late_get_reply(&mut ep),
        "forged-credit" => forged_credit(&mut ep, job, &context, &state, args),
        other => Err(format!("unknown scenario {other:?}")),
    };
    *counters = ep.counters();
    let tally = outcome?;
    if scenario == "peer-death" {
        return Ok(tally);
    }
    ep.barrier().map_err(|e| format!("final barrier: {e}"))?;
    *counters = ep.counters();
    Ok(tally)
}

/// Byte `i` of the payload `from` sends to `to` as its `n`th.
fn byte(from: u32, to: u32, n: u64, i: usize) -> u8 {
    let x = (i as u64)
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .wrapping_add(u64::from(from) << 48 | u64::from(to) << 32 | n);
    (x ^ (x >> 29) ^ (x >> 47)) as u8
}

fn payload(from: u32, to: u32, n: u64, len: usize) -> Vec<u8> {
    (0..len).map(|i| byte(from, to, n, i)).collect()
}

fn matches(got: &[u8], from: u32, to: u32, n: u64) -> bool {
    got.iter()
        .enumerate()
        .all(|(i, &b)| b == byte(from, to, n, i))
}

/// What handlers record.
#[derive(Default)]
struct State {
    /// Messages handled, by (source, kind, sequence).
    seen: HashMap<(u32, u32, u32), u32>,
    /// The last sequence per (source, kind), for the order.
    last: HashMap<(u32, u32), u32>,
    /// Replies handled, by (source, kind, sequence).
    replies: HashMap<(u32, u32, u32), u32>,
    /// What went wrong inside handlers.
    errors: Vec<String>,
    /// Second replies and replies from reply handlers that were refused.
    refused: u32,
    /// Good messages of the bad-packet scenario.
    good: u32,
    /// Verified puts of the misalign scenario (replies arrived).
    verified: u32,
}

const H_REQUEST: u8 = 1;
const H_REPLY: u8 = 2;
const MESSAGES: u32 = 120;
const LONG_MAX: usize = 3000;
/// Where long requests from `source` with sequence `seq` land.
fn long_offset(source: u32, seq: u32) -> u64 {
    (u64::from(source) * u64::from(MESSAGES) + u64::from(seq)) * 3072 + u64::from(seq % 8)
}
/// Where long replies from `source` land (the second half of the segment).
fn reply_offset(source: u32, seq: u32) -> u64 {
    (2 << 20) + long_offset(source, seq)
}
fn medium_len(seq: u32, max: usize) -> usize {
    (seq as usize * 37) % (max + 1)
}
fn long_len(seq: u32) -> usize {
    (seq as usize * 211) % (LONG_MAX + 1)
}

fn message_handlers(state: &Rc<RefCell<State>>, me: u32) -> Handlers {
    let mut handlers = Handlers::new();
    let s = state.clone();
    handlers.register(H_REQUEST, move |token: &mut Token<'_>, args, data| {
        let mut st = s.borrow_mut();
        let source = token.source();
        if args.len() != 4 || args[2] != me {
            st.errors.push(format!("arguments {args:?} from {source}"));
            return;
        }
        let (kind, seq, len) = (args[0], args[1], args[3] as usize);
        let n = u64::from(seq) << 2 | u64::from(kind);
        if data.len() != len || !matches(data, source, me, n) {
            st.errors.push(format!(
                "kind {kind} seq {seq} from {source}: payload differs"
            ));
        }
        *st.seen.entry((source, kind, seq)).or_default() += 1;
        let st = &mut *st;
        let next = st.last.entry((source, kind)).or_insert(0);
        if seq != *next {
            st.errors.push(format!(
                "kind {kind} from {source}: seq {seq} where {next} was next"
            ));
        }
        *next = seq + 1;
        let echo = payload(me, source, n, len.min(200));
        let replied = match kind {
            0 => token.reply_short(H_REPLY, &[kind, seq, me, 0]),
            1 => token.reply_medium(H_REPLY, &[kind, seq, me, echo.len() as u32], &echo),
            _ => token.reply_long(
                H_REPLY,
                &[kind, seq, me, echo.len() as u32],
                &echo,
                reply_offset(me, seq),
            ),
        };
        if let Err(e) = replied {
            st.errors.push(format!("reply: {e}"));
        }
        // A second reply is refused.
        if token.reply_short(H_REPLY, &[9, seq, me, 0]).is_err() {
            st.refused += 1;
        }
    });
    let s = state.clone();
    handlers.register(H_REPLY, move |token, args, data| {
        let mut st = s.borrow_mut();
        let source = token.source();
        if args.len() != 4 || args[2] != source || !token.is_reply() {
            st.errors
                .push(format!("reply arguments {args:?} from {source}"));
            return;
        }
        let (kind, seq, len) = (args[0], args[1], args[3] as usize);
        let n = u64::from(seq) << 2 | u64::from(kind);
        if data.len() != len || !matches(data, source, me, n) {
            st.errors.push(format!(
                "reply kind {kind} seq {seq} from {source}: payload differs"
            ));
        }
        *st.replies.entry((source, kind, seq)).or_default() += 1;
        // A reply handler may not reply.
        if token.reply_short(H_REPLY, &[0, 0, 0, 0]).is_err() {
            st.refused += 1;
        }
    });
    handlers
}

fn handlers_scenario(ep: &mut Endpoint<'_>, state: &Rc<RefCell<State>>) -> Outcome {
    let me = ep.rank();
    let n = ep.size();
    let max = ep.max_medium();
    for seq in 0..MESSAGES {
        for target in 0..n {
            let tag = |kind: u32| u64::from(seq) << 2 | u64::from(kind);
            ep.request_short(target, H_REQUEST, &[0, seq, target, 0])
                .map_err(|e| format!("short: {e}"))?;
            let len = medium_len(seq, max);
            ep.request_medium(
                target,
                H_REQUEST,
                &[1, seq, target, len as u32],
                &payload(me, target, tag(1), len),
            )
            .map_err(|e| format!("medium: {e}"))?;
            let len = long_len(seq);
            // Misaligned sources too: the payload starts `seq % 8` into
            // a buffer.
            let shift = (seq % 8) as usize;
            let mut buffer = vec![0u8; shift];
            buffer.extend(payload(me, target, tag(2), len));
            ep.request_long(
                target,
                H_REQUEST,
                &[2, seq, target, len as u32],
                &buffer[shift..],
                long_offset(me, seq),
            )
            .map_err(|e| format!("long: {e}"))?;
        }
    }
    let expected = (3 * MESSAGES * n) as usize;
    ep.wait_until(|_| {
        let st = state.borrow();
        st.replies.len() >= expected && st.seen.len() >= expected
    })
    .map_err(|e| format!("waiting for every message and reply: {e}"))?;
    ep.barrier().map_err(|e| e.to_string())?;
    ep.poll().map_err(|e| e.to_string())?;
    let st = state.borrow();
    if let Some(e) = st.errors.first() {
        return Err(format!("{} handler errors, first: {e}", st.errors.len()));
    }
    let mut tally = Tally::default();
    for source in 0..n {
        for kind in 0..3 {
            for seq in 0..MESSAGES {
                match st.seen.get(&(source, kind, seq)) {
                    Some(1) => tally.checked += 1,
                    other => {
                        return Err(format!(
                            "kind {kind} seq {seq} from {source} handled {other:?} times"
                        ))
                    }
                }
                match st.replies.get(&(source, kind, seq)) {
                    Some(1) => tally.checked += 1,
                    other => {
                        return Err(format!(
                            "reply to kind {kind} seq {seq} from {source} handled {other:?} times"
                        ))
                    }
                }
            }
        }
    }
    if st.seen.len() != expected || st.replies.len() != expected {
        return Err(format!(
            "{} messages and {} replies handled, {expected} expected",
            st.seen.len(),
            st.replies.len()
        ));
    }
    // Every request handler's second reply and every reply handler's reply
    // refused.
    tally.extra.insert("refused".into(), json!(st.refused));
    tally
        .extra
        .insert("expected_refused".into(), json!(2 * expected));
    Ok(tally)
}

const H_FLOOD: u8 = 3;

fn flood_handlers(state: &Rc<RefCell<State>>) -> Handlers {
    let mut handlers = Handlers::new();
    let s = state.clone();
    handlers.register(H_FLOOD, move |token, args, data| {
        let mut st = s.borrow_mut();
        let source = token.source();
        let (seq, me) = (args[0], args[1]);
        if !matches(data, source, me, u64::from(seq)) {
            st.errors
                .push(format!("flood {seq} from {source}: payload differs"));
        }
        *st.seen.entry((source, 0, seq)).or_default() += 1;
        let st = &mut *st;
        let next = st.last.entry((source, 0)).or_insert(0);
        if seq != *next {
            st.errors.push(format!(
                "flood from {source}: seq {seq} where {next} was next"
            ));
        }
        *next = seq + 1;
    });
    handlers
}

fn flood(ep: &mut Endpoint<'_>, state: &Rc<RefCell<State>>, args: &[String]) -> Outcome {
    let all = args.iter().any(|a| a == "--all");
    let messages: u32 = arg(args, "--messages")
        .and_then(|m| m.parse().ok())
        .unwrap_or(3000);
    let me = ep.rank();
    let n = ep.size();
    let targets: Vec<u32> = if all {
        (0..n).filter(|&t| t != me).collect()
    } else if me != 0 {
        vec![0]
    } else {
        vec![]
    };
    let max = ep.max_medium();
    for seq in 0..messages {
        for &target in &targets {
            let len = 1 + (seq as usize * 13) % max;
            ep.request_medium(
                target,
                H_FLOOD,
                &[seq, target],
                &payload(me, target, u64::from(seq), len),
            )
            .map_err(|e| format!("medium {seq} to {target}: {e}"))?;
        }
    }
    let senders: Vec<u32> = if all {
        (0..n).filter(|&s| s != me).collect()
    } else if me == 0 {
        (1..n).collect()
    } else {
        vec![]
    };
    let expected = senders.len() * messages as usize;
    ep.wait_until(|_| state.borrow().seen.len() >= expected)
        .map_err(|e| format!("waiting for the flood: {e}"))?;
    let st = state.borrow();
    if let Some(e) = st.errors.first() {
        return Err(format!("{} handler errors, first: {e}", st.errors.len()));
    }
    let mut tally = Tally::default();
    for &source in &senders {
        for seq in 0..messages {
            match st.seen.get(&(source, 0, seq)) {
                Some(1) => tally.checked += 1,
                other => return Err(format!("flood {seq} from {source} handled {other:?} times")),
            }
        }
    }
    if st.seen.len() != expected {
        return Err(format!("{} handled, {expected} expected", st.seen.len()));
    }
    tally.extra.insert(
        "sent".into(),
        json!(targets.len() as u64 * u64::from(messages)),
    );
    Ok(tally)
}

const H_VERIFY: u8 = 4;
const H_VERIFIED: u8 = 5;
const FILL: u8 = 0xEE;
const GUARD: u64 = 16;
/// Where `source`'s puts land in its target's segment.
fn put_area(source: u32) -> u64 {
    u64::from(source) * (64 << 10) + GUARD
}
/// Where the bytes gets read lie (filled by the owner at start).
const GET_AREA: u64 = 1 << 20;
const GET_AREA_BYTES: usize = 16 << 10;

fn misalign_handlers(state: &Rc<RefCell<State>>, me: u32) -> Handlers {
    let mut handlers = Handlers::new();
    let s = state.clone();
    // Runs in the target (which the handler owns through a raw view of
    // its segment, set up before the first message): checks a put and
    // restores the fill.
    handlers.register(H_VERIFY, move |token, args, _| {
        let source = token.source();
        let (at, len, seed) = (u64::from(args[0]), args[1] as usize, u64::from(args[2]));
        let segment = SEGMENT.with(|s| *s.borrow());
        let base = put_area(source) + at;
        // SAFETY: the segment pointer and length were taken from this
        // rank's endpoint, which outlives every handler; the area checked
        // lies inside it (put_area + 64 KiB).
        let view = unsafe {
            std::slice::from_raw_parts_mut(
                segment.0.add((base - GUARD) as usize),
                len + 2 * GUARD as usize,
            )
        };
        let guards_ok = view[..GUARD as usize].iter().all(|&b| b == FILL)
            && view[GUARD as usize + len..].iter().all(|&b| b == FILL);
        let bytes_ok = matches(
            &view[GUARD as usize..GUARD as usize + len],
            source,
            me,
            seed,
        );
        view.fill(FILL);
        let ok = u32::from(guards_ok && bytes_ok);
        if ok == 0 {
            s.borrow_mut().errors.push(format!(
                "put of {len} bytes at {at} from {source}: bytes {bytes_ok}, guards {guards_ok}"
            ));
        }
        if let Err(e) = token.reply_short(H_VERIFIED, &[ok]) {
            s.borrow_mut().errors.push(format!("reply: {e}"));
        }
    });
    let s = state.clone();
    handlers.register(H_VERIFIED, move |_, args, _| {
        let mut st = s.borrow_mut();
        st.verified += 1;
        if args.first() != Some(&1) {
            st.errors.push("a put failed its check".into());
        }
    });
    handlers
}

thread_local! {
    static SEGMENT: RefCell<(*mut u8, usize)> = const { RefCell::new((std::ptr::null_mut(), 0)) };
}

fn lengths(args: &[String]) -> Vec<usize> {
    let every: usize = arg(args, "--every")
        .and_then(|v| v.parse().ok())
        .unwrap_or(1100);
    let sparse: usize = arg(args, "--sparse")
        .and_then(|v| v.parse().ok())
        .unwrap_or(4104);
    (0..=every)
        .chain((every + 1..=sparse).step_by(37))
        .collect()
}

fn misalign(ep: &mut Endpoint<'_>, state: &Rc<RefCell<State>>, args: &[String]) -> Outcome {
    let me = ep.rank();
    let n = ep.size();
    let target = (me + 1) % n;
    let segment = ep.segment();
    segment.fill(FILL);
    for (i, b) in segment[GET_AREA as usize..GET_AREA as usize + GET_AREA_BYTES]
        .iter_mut()
        .enumerate()
    {
        *b = byte(me, u32::MAX, 7, i);
    }
    SEGMENT.with(|s| *s.borrow_mut() = (segment.as_mut_ptr(), segment.len()));
    ep.barrier().map_err(|e| e.to_string())?;
    let lengths = lengths(args);
    let mut tally = Tally::default();
    let longest = lengths.iter().copied().max().unwrap_or(0);
    if longest > 32 << 10 {
        return Err("lengths up to 32 KiB (the put area per source)".into());
    }
    let mut source = vec![0u8; 8 + longest];
    let mut seed = 0u64;
    for src_mis in 0..8usize {
        for dst_mis in 0..8u64 {
            for &len in &lengths {
                seed += 1;
                for (i, b) in source[src_mis..src_mis + len].iter_mut().enumerate() {
                    *b = byte(me, target, seed, i);
                }
                let before = state.borrow().verified;
                let bytes = &source[src_mis..src_mis + len];
                let at = put_area(me) + dst_mis;
                // Every other put is nonblocking, from a copy it owns
                // (aligned as the allocator places it) and drops once done.
                let put = if seed.is_multiple_of(2) {
                    ep.put_nb(target, at, bytes.to_vec())
                        .and_then(|handle| ep.wait(handle))
                } else {
                    ep.put(target, at, bytes)
                };
                put.map_err(|e| format!("put {len} bytes ({src_mis}, {dst_mis}): {e}"))?;
                ep.request_short(target, H_VERIFY, &[dst_mis as u32, len as u32, seed as u32])
                    .map_err(|e| format!("verify request: {e}"))?;
                ep.wait_until(|_| state.borrow().verified > before)
                    .map_err(|e| format!("verify: {e}"))?;
                tally.checked += len as u64;
            }
        }
    }
    // Gets at every misalignment, with guards around the destination.
    let get_lengths: Vec<usize> = lengths
        .iter()
        .copied()
        .filter(|&l| l + 8 <= GET_AREA_BYTES)
        .collect();
    let mut destination = vec![0u8; GET_AREA_BYTES + 64];
    for src_mis in 0..8u64 {
        for dst_mis in 0..8usize {
            for &len in &get_lengths {
                destination.fill(0x5A);
                let at = GUARD as usize + dst_mis;
                ep.get(target, GET_AREA + src_mis, &mut destination[at..at + len])
                    .map_err(|e| format!("get {len} bytes ({src_mis}, {dst_mis}): {e}"))?;
                let got = &destination[at..at + len];
                let right = got
                    .iter()
                    .enumerate()
                    .all(|(i, &b)| b == byte(target, u32::MAX, 7, i + src_mis as usize));
                let guards = destination[..at].iter().all(|&b| b == 0x5A)
                    && destination[at + len..].iter().all(|&b| b == 0x5A);
                if !right || !guards {
                    return Err(format!(
                        "get {len} bytes ({src_mis}, {dst_mis}): bytes {right}, guards {guards}"
                    ));
                }
                tally.checked += len as u64;
            }
        }
    }
    ep.poll().map_err(|e| e.to_string())?;
    let st = state.borrow();
    if let Some(e) = st.errors.first() {
        return Err(format!("{} errors, first: {e}", st.errors.len()));
    }
    tally.extra.insert(
        "expected".into(),
        json!(64 * lengths.iter().sum::<usize>() + 64 * get_lengths.iter().sum::<usize>()),
    );
    Ok(tally)
}

/// A small deterministic generator.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Every block offset of GASNet's strided form, innermost level first.
fn strided_blocks(strides: &[u64], counts: &[u64]) -> Vec<u64> {
    let mut offsets = vec![0u64];
    for (level, &stride) in strides.iter().enumerate() {
        let mut next = Vec::new();
        for i in 0..counts[level + 1] {
            for &o in &offsets {
                next.push(o + i * stride);
            }
        }
        // Inner levels vary fastest: order by (i, inner) means outer loop
        // over i, inner over the previous list.
        offsets = next;
    }
    offsets
}

const AREA: usize = 64 << 10;
/// Where a rank keeps, in its own 4 MiB segment (peers write theirs below
/// 2 MiB), the source of its nonblocking strided puts and the
/// destination of its nonblocking strided gets.
const OWN_SOURCE: usize = 3 << 20;
const OWN_BACK: usize = OWN_SOURCE + AREA;

/// Counts, source strides, target strides, target offset.
type StridedCase = (Vec<u64>, Vec<u64>, Vec<u64>, u64);

fn strided(ep: &mut Endpoint<'_>) -> Outcome {
    let me = ep.rank();
    let n = ep.size();
    let target = (me + 1) % n;
    let base = u64::from(me) * (256 << 10);
    let mut rng = Rng(0x1234_5678 + u64::from(me));
    // The model of this rank's area in the target's segment.
    let mut model: Vec<u8> = (0..AREA).map(|_| rng.next() as u8).collect();
    ep.put(target, base, &model)
        .map_err(|e| format!("fill: {e}"))?;
    let mut tally = Tally::default();
    // (counts, source strides, target strides, target offset)
    let cases: Vec<StridedCase> = vec![
        (vec![8], vec![], vec![], 3),
        (vec![8, 16], vec![8], vec![24], 5),
        (vec![3, 5, 4], vec![3, 15], vec![7, 100], 11),
        (vec![8, 4, 3, 2], vec![8, 32, 96], vec![16, 80, 400], 0),
        (
            vec![2, 2, 2, 2, 3],
            vec![2, 4, 8, 16],
            vec![5, 13, 40, 130],
            1,
        ),
        (
            vec![1, 2, 2, 2, 2, 2],
            vec![1, 2, 4, 8, 16],
            vec![3, 9, 30, 100, 333],
            7,
        ),
        // A face of a 16^3 array of doubles (x = const): blocks of one
        // double, 16 x 16 of them.
        (vec![8, 16, 16], vec![8, 128], vec![128, 2048], 8 * 5),
        // A face y = const: rows of 16 doubles, 16 of them.
        (vec![128, 16], vec![128], vec![2048], 128 * 3),
    ];
    for (case, (counts, src_strides, dst_strides, offset)) in cases.iter().enumerate() {
        let blocks_src = strided_blocks(src_strides, counts);
        let blocks_dst = strided_blocks(dst_strides, counts);
        let block = counts[0] as usize;
        let src_len = blocks_src.iter().max().map_or(0, |&o| o as usize + block);
        // (source offset, area offset) of each block.
        let pairs: Vec<(usize, usize)> = blocks_src
            .iter()
            .zip(&blocks_dst)
            .map(|(&s, &d)| (s as usize, (offset + d) as usize))
            .collect();
        let put_into = |model: &mut [u8], source: &[u8]| {
            for &(s, d) in &pairs {
                model[d..d + block].copy_from_slice(&source[s..s + block]);
            }
        };
        let got_from = |expected: &mut [u8], model: &[u8]| {
            for &(s, d) in &pairs {
                expected[s..s + block].copy_from_slice(&model[d..d + block]);
            }
        };
        let moved = (block * pairs.len()) as u64;
        let source: Vec<u8> = (0..src_len).map(|_| rng.next() as u8).collect();
        ep.put_strided(
            target,
            base + offset,
            dst_strides,
            &source,
            src_strides,
            counts,
        )
        .map_err(|e| format!("put_strided case {case}: {e}"))?;
        put_into(&mut model, &source);
        let what = format!("put_strided case {case}");
        area_matches(ep, target, base, &model, &what)?;
        // The mirror: read the same pattern back into a fresh buffer.
        let mut back = vec![0x33u8; src_len];
        ep.get_strided(
            target,
            base + offset,
            dst_strides,
            &mut back,
            src_strides,
            counts,
        )
        .map_err(|e| format!("get_strided case {case}: {e}"))?;
        let mut expected = vec![0x33u8; src_len];
        got_from(&mut expected, &model);
        if back != expected {
            return Err(format!("get_strided case {case}: differs"));
        }
        // The nonblocking forms, from and into this rank's own segment.
        let source: Vec<u8> = (0..src_len).map(|_| rng.next() as u8).collect();
        ep.segment()[OWN_SOURCE..OWN_SOURCE + src_len].copy_from_slice(&source);
        let put = ep
            .put_strided_nb(
                target,
                base + offset,
                dst_strides,
                OWN_SOURCE as u64,
                src_strides,
                counts,
            )
            .and_then(|put| ep.wait(put))
            .map_err(|e| format!("put_strided_nb case {case}: {e}"));
        put?;
        put_into(&mut model, &source);
        let what = format!("put_strided_nb case {case}");
        area_matches(ep, target, base, &model, &what)?;
        ep.segment()[OWN_BACK..OWN_BACK + src_len].fill(0x33);
        let get = ep
            .get_strided_nb(
                target,
                base + offset,
                dst_strides,
                OWN_BACK as u64,
                src_strides,
                counts,
            )
            .and_then(|get| ep.wait(get))
            .map_err(|e| format!("get_strided_nb case {case}: {e}"));
        get?;
        got_from(&mut expected, &model);
        if ep.segment()[OWN_BACK..OWN_BACK + src_len] != expected[..] {
            return Err(format!("get_strided_nb case {case}: differs"));
        }
        tally.checked += 4 * moved;
    }
    // Vector (memvec lists, boundaries differing) and indexed.
    let source: Vec<u8> = (0..4096).map(|_| rng.next() as u8).collect();
    let src_list = [(10u64, 100u64), (500, 1), (1000, 299)];
    let dst_list = [(40_000u64, 50u64), (41_000, 250), (45_003, 100)];
    ep.put_vector(target, &shift(&dst_list, base), &source, &src_list)
        .map_err(|e| format!("put_vector: {e}"))?;
    let stream: Vec<u8> = src_list
        .iter()
        .flat_map(|&(o, l)| source[o as usize..(o + l) as usize].to_vec())
        .collect();
    scatter(&mut model, &dst_list, &stream);
    let mut back = vec![0x44u8; 2048];
    let back_list = [(7u64, 333u64), (900, 67)];
    ep.get_vector(target, &shift(&dst_list, base), &mut back, &back_list)
        .map_err(|e| format!("get_vector: {e}"))?;
    let mut expected = vec![0x44u8; 2048];
    scatter(&mut expected, &back_list, &gather(&model, &dst_list));
    if back != expected {
        return Err("get_vector differs".into());
    }
    let src_offsets = [0u64, 64, 640, 4000];
    let dst_offsets = [
        50_000u64, 50_100, 51_001, 52_003, 53_333, 60_000, 60_013, 61_111,
    ];
    ep.put_indexed(
        target,
        &shift_all(&dst_offsets, base),
        8,
        &source,
        &src_offsets,
        16,
    )
    .map_err(|e| format!("put_indexed: {e}"))?;
    let stream: Vec<u8> = src_offsets
        .iter()
        .flat_map(|&o| source[o as usize..o as usize + 16].to_vec())
        .collect();
    let dst_blocks: Vec<(u64, u64)> = dst_offsets.iter().map(|&o| (o, 8)).collect();
    scatter(&mut model, &dst_blocks, &stream);
    let mut back = vec![0x55u8; 256];
    let back_offsets = [0u64, 100];
    ep.get_indexed(
        target,
        &shift_all(&dst_offsets, base),
        8,
        &mut back,
        &back_offsets,
        32,
    )
    .map_err(|e| format!("get_indexed: {e}"))?;
    let mut expected = vec![0x55u8; 256];
    let back_blocks: Vec<(u64, u64)> = back_offsets.iter().map(|&o| (o, 32)).collect();
    scatter(&mut expected, &back_blocks, &gather(&model, &dst_blocks));
    if back != expected {
        return Err("get_indexed differs".into());
    }
    area_matches(ep, target, base, &model, "after vector and indexed puts")?;
    tally.checked += 3 * 400 + 64 * 2 + 64;
    // A mismatch of lengths and a pattern past the segment are refused.
    if ep
        .put_vector(target, &[(0, 10)], &source, &[(0, 11)])
        .is_ok()
    {
        return Err("a vector put naming 10 and 11 bytes was accepted".into());
    }
    if ep
        .put_strided(target, (4 << 20) - 8, &[16], &source, &[8], &[8, 2])
        .is_ok()
    {
        return Err("a strided put past the segment was accepted".into());
    }
    // A source or destination in this rank's segment must stay inside it,
    // though the endpoint's memory (its rings) goes on after it.
    if ep
        .put_strided_nb(target, 0, &[16], (4 << 20) - 8, &[8], &[8, 2])
        .is_ok()
    {
        return Err("a strided put from past this segment's end was accepted".into());
    }
    if ep
        .get_strided_nb(target, 0, &[16], (4 << 20) - 8, &[8], &[8, 2])
        .is_ok()
    {
        return Err("a strided get into past this segment's end was accepted".into());
    }
    if ep
        .put_strided_nb(target, 0, &[], 5 << 20, &[], &[8])
        .is_ok()
    {
        return Err("a strided put from an offset past the segment was accepted".into());
    }
    Ok(tally)
}

const H_NOTICE: u8 = 11;

fn notice_handlers(state: &Rc<RefCell<State>>) -> Handlers {
    let mut handlers = Handlers::new();
    let s = state.clone();
    handlers.register(H_NOTICE, move |token, args, _| {
        let mut s = s.borrow_mut();
        *s.seen.entry((token.source(), 0, args[0])).or_default() += 1;
    });
    handlers
}

/// Counts, source strides, target strides, target offset.
type NotifiedShape = (&'static [u64], &'static [u64], &'static [u64], u64);

/// Rounds of `notified-put`, each with one of the shapes below.
const NOTIFIED_ROUNDS: u32 = 60;

/// `notified-put`: each round, every rank puts a strided pattern of its
/// own segment into the next rank's area with `put_strided_nb` and sends
/// a short request right behind it, without waiting for the put; the
/// next rank checks its area the moment the request's handler has run:
/// every byte the put names must be there already, and every other byte
/// of the area unchanged.
fn notified_put(ep: &mut Endpoint<'_>, state: &Rc<RefCell<State>>) -> Outcome {
    let me = ep.rank();
    let n = ep.size();
    let target = (me + 1) % n;
    let from = (me + n - 1) % n;
    // Counts, source strides, target strides, target offset: faces of a
    // 32^3 array of doubles (x, y and z = const), an odd nest, and a
    // contiguous run.
    let shapes: [NotifiedShape; 5] = [
        (&[8, 32, 32], &[256, 8192], &[256, 8192], 8),
        (&[256, 32], &[8192], &[8192], 256 * 5),
        (&[8192], &[], &[], 8192 * 3),
        (&[3, 7, 5, 3], &[5, 40, 300], &[11, 90, 700], 13),
        (&[1000], &[], &[], 1),
    ];
    let area = |rank: u32| u64::from(rank) * (256 << 10);
    // What this rank's area (written by `from`) holds.
    let mut model = ep.segment()[area(from) as usize..][..NOTIFIED_AREA].to_vec();
    let mut tally = Tally::default();
    for round in 1..=NOTIFIED_ROUNDS {
        let (counts, src_strides, dst_strides, offset) = shapes[round as usize % shapes.len()];
        let block = counts[0] as usize;
        let len = |strides: &[u64]| {
            strided_blocks(strides, counts)
                .iter()
                .max()
                .map_or(0, |&o| o as usize + block)
        };
        let source = payload(me, target, u64::from(round), len(src_strides));
        ep.segment()[OWN_SOURCE..OWN_SOURCE + source.len()].copy_from_slice(&source);
        let put = ep
            .put_strided_nb(
                target,
                area(me) + offset,
                dst_strides,
                OWN_SOURCE as u64,
                src_strides,
                counts,
            )
            .map_err(|e| format!("round {round}: put_strided_nb: {e}"))?;
        ep.request_short(target, H_NOTICE, &[round])
            .map_err(|e| format!("round {round}: request: {e}"))?;
        let noticed =
            |state: &Rc<RefCell<State>>| state.borrow().seen.contains_key(&(from, 0, round));
        ep.wait_until(|_| noticed(state))
            .map_err(|e| format!("round {round}: waiting for rank {from}'s notice: {e}"))?;
        // The notice has run: rank `from`'s bytes must be in place now.
        let got = ep.segment()[area(from) as usize..][..NOTIFIED_AREA].to_vec();
        let sent = payload(from, me, u64::from(round), len(src_strides));
        for (s, d) in strided_blocks(src_strides, counts)
            .iter()
            .zip(strided_blocks(dst_strides, counts))
        {
            let d = (offset + d) as usize;
            model[d..d + block].copy_from_slice(&sent[*s as usize..*s as usize + block]);
        }
        if got != model {
            let at = got.iter().zip(&model).position(|(a, b)| a != b);
            return Err(format!(
                "round {round}: rank {from}'s notice ran before its put's bytes were all in \
                 place, or other bytes changed (first difference at {at:?})"
            ));
        }
        tally.checked += (block * strided_blocks(src_strides, counts).len()) as u64;
        ep.wait(put)
            .map_err(|e| format!("round {round}: put: {e}"))?;
        // Nobody writes round r + 1 before everyone checked round r.
        ep.barrier()
            .map_err(|e| format!("round {round}: barrier: {e}"))?;
    }
    let notices = state.borrow().seen.values().sum::<u32>();
    if notices != NOTIFIED_ROUNDS {
        return Err(format!("{notices} notices ran, {NOTIFIED_ROUNDS} sent"));
    }
    Ok(tally)
}

/// The bytes of a rank's area `notified-put` checks (the largest shape's
/// reach).
const NOTIFIED_AREA: usize = 32 * 8192;

/// Reads this rank's area of `target`'s segment (at `base`) back whole
/// and compares it with `model`.
fn area_matches(
    ep: &mut Endpoint<'_>,
    target: u32,
    base: u64,
    model: &[u8],
    what: &str,
) -> Result<(), String> {
    let mut whole = vec![0u8; model.len()];
    ep.get(target, base, &mut whole)
        .map_err(|e| format!("{what}: get: {e}"))?;
    if whole != model {
        let at = whole.iter().zip(model).position(|(a, b)| a != b);
        return Err(format!("{what}: the area differs at {at:?}"));
    }
    Ok(())
}

fn shift(list: &[(u64, u64)], by: u64) -> Vec<(u64, u64)> {
    list.iter().map(|&(o, l)| (o + by, l)).collect()
}
fn shift_all(list: &[u64], by: u64) -> Vec<u64> {
    list.iter().map(|&o| o + by).collect()
}
fn scatter(into: &mut [u8], blocks: &[(u64, u64)], stream: &[u8]) {
    let mut at = 0;
    for &(o, l) in blocks {
        into[o as usize..(o + l) as usize].copy_from_slice(&stream[at..at + l as usize]);
        at += l as usize;
    }
}
fn gather(from: &[u8], blocks: &[(u64, u64)]) -> Vec<u8> {
    blocks
        .iter()
        .flat_map(|&(o, l)| from[o as usize..(o + l) as usize].to_vec())
        .collect()
}

const H_GOOD: u8 = 6;
const H_GO: u8 = 7;

fn bad_packet_handlers(state: &Rc<RefCell<State>>) -> Handlers {
    let mut handlers = Handlers::new();
    let s = state.clone();
    handlers.register(H_GOOD, move |_, _, _| s.borrow_mut().good += 1);
    // Rank 0's go-ahead to rank 1 (once it polls for the bad packets).
    let s = state.clone();
    handlers.register(H_GO, move |_, _, _| s.borrow_mut().verified += 1);
    handlers
}

/// `body` with `args` as its first arguments.
fn with_args(mut body: Vec<u8>, args: &[u32]) -> Vec<u8> {
    for (i, a) in args.iter().enumerate() {
        body[16 + 4 * i..20 + 4 * i].copy_from_slice(&a.to_le_bytes());
    }
    body
}

/// Bodies of malformed packets (everything after the stamp), and whether
/// each goes into the ring of replies.
fn bad_bodies() -> Vec<(&'static str, bool, Vec<u8>)> {
    let header = |kind: u8, flags: u8, handler: u8, nargs: u8, len: u32, offset: u64| {
        let mut b = vec![kind, flags, handler, nargs];
        b.extend_from_slice(&len.to_le_bytes());
        b.extend_from_slice(&offset.to_le_bytes());
        b.extend_from_slice(&[0u8; 64]);
        b
    };
    let requests = vec![
        ("unregistered handler", header(0, 0, 200, 0, 0, 0)),
        ("17 arguments", header(0, 0, H_GOOD, 17, 0, 0)),
        ("medium past the slot", header(1, 0, H_GOOD, 0, 5000, 0)),
        (
            "long past the segment",
            header(2, 0, H_GOOD, 0, 100, 4 << 20),
        ),
        ("unknown kind", header(7, 0, H_GOOD, 0, 0, 0)),
        ("unknown flags", header(0, 0x40, H_GOOD, 0, 0, 0)),
        ("library message", header(0, 4, 99, 0, 0, 0)),
        // A get reply nobody asked for and a barrier notice of a far epoch
        // (library handlers 1 and 2, two arguments each).
        (
            "unasked get reply",
            with_args(header(0, 4, 1, 2, 0, 0), &[77, 0]),
        ),
        (
            "far barrier",
            with_args(header(0, 4, 2, 2, 0, 0), &[1000, 0]),
        ),
    ];
    let mut bodies: Vec<_> = requests
        .into_iter()
        .map(|(what, body)| (what, false, body))
        .collect();
    // Rings in the wrong lane: a request among the replies (which the
    // target consumes whatever it has queued, since replies never reply)
    // and a reply among the requests.
    bodies.push((
        "request in the reply ring",
        true,
        header(0, 0, H_GOOD, 0, 0, 0),
    ));
    bodies.push((
        "reply in the request ring",
        false,
        header(0, 1, H_GOOD, 0, 0, 0),
    ));
    bodies
}

fn bad_packet(ep: &mut Endpoint<'_>, state: &Rc<RefCell<State>>) -> Outcome {
    let mut tally = Tally::default();
    let bodies = bad_bodies();
    if ep.rank() == 1 {
        ep.wait_until(|_| state.borrow().verified > 0)
            .map_err(|e| e.to_string())?;
        for (_, reply_ring, body) in &bodies {
            ep.send_raw_packet(0, *reply_ring, body)
                .map_err(|e| e.to_string())?;
            ep.request_short(0, H_GOOD, &[])
                .map_err(|e| e.to_string())?;
        }
    } else if ep.rank() == 0 {
        ep.request_short(1, H_GO, &[]).map_err(|e| e.to_string())?;
        let mut errors = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        while state.borrow().good < bodies.len() as u32 || errors.len() < bodies.len() {
            match ep.poll() {
                Ok(_) => {}
                Err(e) => errors.push(e.to_string()),
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "{} good messages ran and {} errors reported: {errors:?}",
                    state.borrow().good,
                    errors.len()
                ));
            }
            std::thread::yield_now();
        }
        if errors.len() != bodies.len()
            || ep.counters().bad_packets != bodies.len() as u64
            || state.borrow().good != bodies.len() as u32
        {
            return Err(format!(
                "{} errors, {} counted: {errors:?}",
                errors.len(),
                ep.counters().bad_packets
            ));
        }
        tally.notes = errors;
        tally.checked = u64::from(state.borrow().good);
    }
    Ok(tally)
}

/// The last rank leaves at once (no finalize, its port goes with it); the
/// others wait for a message it never sends and must learn it is gone.
fn peer_death(ep: &mut Endpoint<'_>) -> Outcome {
    let mut tally = Tally::default();
    let last = ep.size() - 1;
    if ep.rank() == last {
        // Leave once the others are past the first barrier (any departed
        // peer fails every wait, that barrier's included).
        std::thread::sleep(Duration::from_secs(1));
        println!(
            "{}",
            json!({"rank": last, "size": ep.size(), "scenario": "peer-death", "ok": true,
                   "checked": 0, "notes": ["left"]})
        );
        std::process::exit(0);
    }
    let start = Instant::now();
    match ep.wait_until(|_| false) {
        Err(pindown_messaging::Error::PeerGone { peer, why }) if peer == last => {
            tally.notes.push(format!(
                "rank {peer} gone after {:?}: {why}",
                start.elapsed()
            ));
            tally.checked = 1;
        }
        other => return Err(format!("waiting on a departed rank: {other:?}")),
    }
    // Sending to it fails too, at the latest once its ring is full (the
    // stalled send checks on it) rather than at the timeout.
    let start = Instant::now();
    for n in 0..10_000u32 {
        match ep.request_short(last, 1, &[n]) {
            Ok(()) => {}
            Err(pindown_messaging::Error::PeerGone { .. })
            | Err(pindown_messaging::Error::Completion(_)) => {
                tally
                    .notes
                    .push(format!("send {n} failed after {:?}", start.elapsed()));
                tally.checked += 1;
                survivors_meet(ep, last)?;
                return Ok(tally);
            }
            Err(other) => return Err(format!("sending to a departed rank: {other}")),
        }
    }
    Err("10000 sends to a departed rank succeeded".into())
}

/// The last rank finalizes (dropping its endpoint revokes its segment's
/// window) and stays a while with its port up; the others wait on it and
/// must learn it is gone from a liveness check its device refuses.
fn peer_finalized(mut ep: Endpoint<'_>) -> Outcome {
    let mut tally = Tally::default();
    let last = ep.size() - 1;
    if ep.rank() == last {
        drop(ep);
        std::thread::sleep(Duration::from_secs(3));
        tally.notes.push("finalized with its port up".into());
        return Ok(tally);
    }
    let start = Instant::now();
    match ep.wait_until(|_| false) {
        Err(pindown_messaging::Error::PeerGone { peer, why })
            if peer == last && why.contains("liveness check") =>
        {
            tally.notes.push(format!(
                "rank {peer} gone after {:?}: {why}",
                start.elapsed()
            ));
            tally.checked = 1;
        }
        other => return Err(format!("waiting on a finalized rank: {other:?}")),
    }
    survivors_meet(&mut ep, last)?;
    Ok(tally)
}

const H_SLOW: u8 = 10;
/// The word rank 0 of `leave-while-owed` puts into rank 1's segment.
const READY: u64 = 0x00C0_FFEE;
/// How long the handler of `leave-while-owed` takes.
const SLOW_HANDLER: Duration = Duration::from_secs(1);

fn slow_handlers(state: &Rc<RefCell<State>>) -> Handlers {
    let mut handlers = Handlers::new();
    let s = state.clone();
    handlers.register(H_SLOW, move |_, args, _| {
        std::thread::sleep(SLOW_HANDLER);
        if args == [7] {
            s.borrow_mut().good += 1;
        }
    });
    handlers
}

fn leave_while_owed(
    mut ep: Endpoint<'_>,
    state: &Rc<RefCell<State>>,
    counters: &mut Counters,
) -> Outcome {
    let mut tally = Tally::default();
    if ep.size() != 2 {
        return Err("leave-while-owed runs on 2 ranks".into());
    }
    // Rank 0 says it left the first barrier (one that consumed the slow
    // request would run its handler too early), then stops polling:
    // rank 1's request and barrier packet are both in its ring before it
    // consumes either, and the final barrier's first turn runs the
    // handler while rank 1 leaves.
    if ep.rank() == 1 {
        ep.wait_until(|ep| ep.segment()[..8] == READY.to_le_bytes())
            .map_err(|e| format!("waiting for rank 0: {e}"))?;
        std::thread::sleep(SLOW_HANDLER / 10);
        ep.request_short(0, H_SLOW, &[7])
            .map_err(|e| format!("the slow request: {e}"))?;
        ep.barrier().map_err(|e| format!("last barrier: {e}"))?;
        drop(ep);
        std::thread::sleep(SLOW_HANDLER * 2);
        tally.notes.push("finalized with its port up".into());
        return Ok(tally);
    }
    ep.put(1, 0, &READY.to_le_bytes())
        .map_err(|e| format!("telling rank 1: {e}"))?;
    std::thread::sleep(SLOW_HANDLER / 2);
    ep.barrier().map_err(|e| format!("last barrier: {e}"))?;
    let handled = state.borrow().good;
    if handled != 1 {
        return Err(format!(
            "the slow handler ran {handled} times with its argument"
        ));
    }
    tally.checked += 1;
    if ep.counters().credit_returns < 2 {
        return Err(format!(
            "{} credit returns: the one after the barrier was not sent",
            ep.counters().credit_returns
        ));
    }
    match ep.wait_until(|_| false) {
        Err(pindown_messaging::Error::PeerGone { peer: 1, why }) if why.contains("credit") => {
            tally.notes.push(format!("rank 1 gone: {why}"));
            tally.checked += 1;
        }
        other => return Err(format!("after rank 1 finalized: {other:?}")),
    }
    match ep.request_short(1, H_SLOW, &[7]) {
        Err(pindown_messaging::Error::PeerGone { peer: 1, .. }) => tally.checked += 1,
        other => return Err(format!("a request to the finalized rank: {other:?}")),
    }
    *counters = ep.counters();
    Ok(tally)
}

/// The word of the segment where survivor `rank` of `peer_death` says it
/// has seen the departure.
const SEEN_DEPARTURE: u64 = 0x5EE7_DEAD;

/// Waits until every rank but `last` has seen `last` leave (each puts
/// [`SEEN_DEPARTURE`] into its word of every survivor's segment), so that
/// no survivor finalizes, and revokes its segment, while another still
/// waits for news of `last` (it would learn first of the one that
/// finalized). Failures naming departed ranks are expected meanwhile.
fn survivors_meet(ep: &mut Endpoint<'_>, last: u32) -> Result<(), String> {
    let me = ep.rank();
    for target in 0..last {
        ep.put(target, 8 * u64::from(me), &SEEN_DEPARTURE.to_le_bytes())
            .map_err(|e| format!("telling rank {target} the departure was seen: {e}"))?;
    }
    let all_seen = |ep: &mut Endpoint<'_>| {
        let segment = ep.segment().as_ptr();
        // SAFETY: words 0..last of the segment (`last` <= ranks, each
        // 8 bytes, well inside it), read whole while the device may write
        // them.
        (0..last as usize)
            .all(|rank| unsafe { segment.cast::<u64>().add(rank).read_volatile() } == SEEN_DEPARTURE.to_le())
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while !all_seen(ep) {
        match ep.wait_until(all_seen) {
            Ok(()) => break,
            Err(pindown_messaging::Error::PeerGone { .. }) if Instant::now() < deadline => {}
            Err(e) => return Err(format!("waiting for the other survivors: {e}")),
        }
    }
    Ok(())
}

/// Barriers in a row: before each, every rank puts the barrier's number
/// into its word of every rank's segment; after it, every word of this
/// rank's segment must hold that number (no rank left a barrier before
/// all had entered it).
fn barriers(ep: &mut Endpoint<'_>) -> Outcome {
    let mut tally = Tally::default();
    let (me, n) = (ep.rank(), ep.size());
    for k in 1..=200u64 {
        for target in 0..n {
            ep.put(target, 8 * u64::from(me), &k.to_le_bytes())
                .map_err(|e| format!("put before barrier {k}: {e}"))?;
        }
        ep.barrier().map_err(|e| format!("barrier {k}: {e}"))?;
        let segment = ep.segment();
        for rank in 0..n as usize {
            let word = u64::from_le_bytes(segment[8 * rank..8 * rank + 8].try_into().expect("8"));
            if word < k {
                return Err(format!(
                    "after barrier {k}, rank {rank}'s word holds {word}"
                ));
            }
            tally.checked += 1;
        }
    }
    Ok(tally)
}

const H_PING: u8 = 8;
const H_PONG: u8 = 9;

fn latency_handlers(state: &Rc<RefCell<State>>) -> Handlers {
    let mut handlers = Handlers::new();
    handlers.register(H_PING, |token, args, _| {
        let _ = token.reply_short(H_PONG, args);
    });
    let s = state.clone();
    handlers.register(H_PONG, move |_, _, _| s.borrow_mut().good += 1);
    handlers
}

/// Median round trips (a measurement, no pass/fail): a short request and
/// its reply, against a blocking 8-byte put (one write and its completion).
fn latency(ep: &mut Endpoint<'_>, state: &Rc<RefCell<State>>) -> Outcome {
    let mut tally = Tally::default();
    if ep.rank() != 0 || ep.size() < 2 {
        // Rank 1 answers while it waits in the final barrier.
        return Ok(tally);
    }
    let rounds = 3000;
    let median = |t: &mut Vec<f64>| {
        t.sort_by(f64::total_cmp);
        t[t.len() / 2]
    };
    let mut am = Vec::with_capacity(rounds);
    let mut put = Vec::with_capacity(rounds);
    for round in 0..rounds + 300 {
        let start = Instant::now();
        let before = state.borrow().good;
        ep.request_short(1, H_PING, &[round as u32])
            .map_err(|e| e.to_string())?;
        ep.wait_until(|_| state.borrow().good > before)
            .map_err(|e| e.to_string())?;
        let am_us = start.elapsed().as_secs_f64() * 1e6;
        let start = Instant::now();
        ep.put(1, 0, &[1u8; 8]).map_err(|e| e.to_string())?;
        if round >= 300 {
            am.push(am_us);
            put.push(start.elapsed().as_secs_f64() * 1e6);
        }
    }
    let (am, put) = (median(&mut am), median(&mut put));
    tally.notes.push(format!(
        "short AM round trip {am:.2} us, 8-byte put {put:.2} us"
    ));
    tally.extra.insert("am_round_trip_us".into(), json!(am));
    tally.extra.insert("put_8_us".into(), json!(put));
    Ok(tally)
}

fn pio(ep: &mut Endpoint<'_>) -> Outcome {
    let mut tally = Tally::default();
    if ep.rank() != 0 || ep.size() < 2 {
        return Ok(tally);
    }
    let source = vec![0xA5u8; 512];
    let rounds = 2000;
    let sizes = [8usize, 16, 32, 64, 128, 256, 512];
    let modes = [("pio", 512u32), ("dma", 0)];
    // Warm up both paths (registration, queues), then alternate them so
    // that both see the same machine.
    let mut times = vec![Vec::with_capacity(rounds); sizes.len() * modes.len()];
    for round in 0..rounds + 200 {
        for (s, &size) in sizes.iter().enumerate() {
            for (m, &(_, pio_max)) in modes.iter().enumerate() {
                ep.set_pio_max(pio_max);
                let start = Instant::now();
                ep.put(1, 0, &source[..size]).map_err(|e| e.to_string())?;
                if round >= 200 {
                    times[s * modes.len() + m].push(start.elapsed().as_secs_f64() * 1e6);
                }
            }
        }
    }
    let mut table = serde_json::Map::new();
    for (s, &size) in sizes.iter().enumerate() {
        for (m, &(mode, _)) in modes.iter().enumerate() {
            let t = &mut times[s * modes.len() + m];
            t.sort_by(f64::total_cmp);
            let median = t[t.len() / 2];
            tally.notes.push(format!("{mode} {size} B: {median:.2} us"));
            table.insert(format!("{mode}_{size}"), json!(median));
        }
    }
    tally.extra.insert("median_us".into(), Value::Object(table));
    Ok(tally)
}

/// The descriptor cache's settings from `--policy lru|lfu|first`,
/// `--capacity N` and `--promote N|off`.
fn descriptor_config(args: &[String]) -> Result<CacheConfig, String> {
    let policy = match arg(args, "--policy").unwrap_or("lru") {
        "lru" => Replacement::Lru,
        "lfu" => Replacement::Lfu,
        "first" => Replacement::FirstCome,
        other => return Err(format!("unknown policy {other}")),
    };
    let capacity = arg(args, "--capacity")
        .unwrap_or("8")
        .parse()
        .map_err(|e| format!("--capacity: {e}"))?;
    let promote_after = match arg(args, "--promote").unwrap_or("3") {
        "off" => None,
        n => Some(n.parse().map_err(|e| format!("--promote: {e}"))?),
    };
    Ok(CacheConfig {
        capacity,
        policy,
        promote_after,
    })
}

/// Repeated puts through the descriptor cache: hot transfers (the same
/// source, target offset and size every round, the source's bytes
/// changed each round), one cold transfer a round, and a hot source freed
/// and allocated again midway. Every put is read back with a get and
/// compared; the cache's counters must add up.
fn descriptors(ep: &mut Endpoint<'_>) -> Outcome {
    const ROUNDS: u64 = 24;
    let target = (ep.rank() + 1) % ep.size();
    let area = u64::from(ep.rank()) * (1 << 20);
    // (length, offset in the target's area); equal misalignment on both
    // sides for the third, so its head and tail go by PIO around a
    // cached body.
    let hot: [(usize, u64); 4] = [
        (4096, 0),
        (64 << 10, 8192),
        (5003, 80 << 10),
        (256 << 10, 96 << 10),
    ];
    let mut sources: Vec<Vec<u8>> = hot.iter().map(|&(len, _)| vec![0u8; len + 8]).collect();
    let mut tally = Tally::default();
    let mut back = vec![0u8; 256 << 10];
    let mut dma_puts = 0u64;
    for round in 0..ROUNDS {
        if round == ROUNDS / 2 {
            // Freed and allocated again (glibc usually places it elsewhere
            // here; `remap-put` maps the same address for sure): the
            // cache must not hand out the old registration.
            let len = sources[3].len();
            let before = sources[3].as_ptr() as u64;
            sources[3] = Vec::new();
            sources[3] = vec![0u8; len];
            tally.extra.insert(
                "reallocated_at_same_address".into(),
                json!(sources[3].as_ptr() as u64 == before),
            );
        }
        for (i, &(len, offset)) in hot.iter().enumerate() {
            let skew = if i == 2 { 3 } else { 0 };
            let source = &mut sources[i][skew..skew + len];
            for (j, b) in source.iter_mut().enumerate() {
                *b = (j as u64 * 7 + round * 13 + i as u64) as u8;
            }
            let at = area + offset + skew as u64;
            ep.put(target, at, source)
                .map_err(|e| format!("put {i} round {round}: {e}"))?;
            dma_puts += 1;
            ep.get(target, at, &mut back[..len])
                .map_err(|e| format!("get: {e}"))?;
            if back[..len] != *source {
                return Err(format!("hot put {i} of round {round} did not land as sent"));
            }
            tally.checked += len as u64;
        }
        // A cold transfer: a new offset each round.
        let cold: Vec<u8> = (0..2048).map(|j| (j as u64 ^ round) as u8).collect();
        let at = area + (512 << 10) + round * 4096;
        ep.put(target, at, &cold)
            .map_err(|e| format!("cold put: {e}"))?;
        dma_puts += 1;
        ep.get(target, at, &mut back[..cold.len()])
            .map_err(|e| format!("get: {e}"))?;
        if back[..cold.len()] != cold[..] {
            return Err(format!(
                "the cold put of round {round} did not land as sent"
            ));
        }
        tally.checked += cold.len() as u64;
    }
    let cache = ep.descriptor_counters().ok_or("no descriptor cache")?;
    let counters = ep.counters();
    if cache.lookups != dma_puts || cache.hits + cache.misses != cache.lookups {
        return Err(format!("{dma_puts} DMA puts, cache counters {cache:?}"));
    }
    for (name, value) in [
        ("lookups", cache.lookups),
        ("hits", cache.hits),
        ("misses", cache.misses),
        ("promoted_hits", cache.promoted_hits),
        ("evictions", cache.evictions),
        ("bypasses", cache.bypasses),
        ("prebuilt_writes", counters.prebuilt_writes),
    ] {
        tally.extra.insert(name.into(), json!(value));
    }
    Ok(tally)
}

/// A blocking get that times out leaves its operation, with a raw pointer
/// into the caller's destination, in the endpoint: a later `wait_all`
/// (every barrier runs one) copies the get's bytes through that pointer
/// long after the get returned and the caller's borrow ended. Here the
/// destination is a slice of a buffer the caller owns; once the get has
/// failed the caller zeroes the buffer for another use, and `wait_all`
/// writes into it behind safe code's back (with a freed heap buffer in
/// its place, the same write corrupts the allocator: "malloc(): invalid
/// size", or a silent crash).
fn stale_get(ep: &mut Endpoint<'_>) -> Outcome {
    const LEN: usize = (4 << 20) - 16;
    let mut tally = Tally::default();
    if ep.rank() == 1 {
        ep.segment()[..LEN + 8].fill(0xAB);
    }
    ep.barrier().map_err(|e| e.to_string())?;
    if ep.rank() == 0 {
        let mut buffer = vec![0u8; LEN];
        let mut timed_out = None;
        for attempt in 0..5000 {
            // Offset 1 against an 8-aligned destination: the bounce path,
            // whose completion copies the whole get into the destination.
            ep.set_timeout(Duration::from_nanos(1));
            let result = ep.get(1, 1, &mut buffer[..]);
            ep.set_timeout(Duration::from_secs(60));
            if let Err(err) = result {
                timed_out = Some((attempt, err.to_string()));
                break;
            }
        }
        let Some((attempt, why)) = timed_out else {
            return Err("no get timed out in 5000 attempts".into());
        };
        // The get has returned (an error): the buffer is the caller's again.
        buffer.fill(0);
        ep.wait_all().map_err(|e| e.to_string())?;
        let overwritten = buffer.iter().filter(|&&b| b == 0xAB).count();
        tally.notes.push(format!(
            "get {attempt} failed ({why}); bytes of the caller's buffer written after it \
             returned: {overwritten}"
        ));
        if overwritten > 0 {
            return Err(format!(
                "get {attempt} failed ({why}), yet wait_all later wrote {overwritten} bytes \
                 into the caller's buffer, whose borrow had ended"
            ));
        }
        tally.checked = 1;
    }
    Ok(tally)
}

/// A put source that is unmapped and mapped again at the same address
/// (new pages, new bytes) between puts through the descriptor cache: every
/// put must carry the bytes the source holds when it is made, never the
/// old pages' (the cached registration must be dropped). `--way munmap`
/// (default) or `--way dontneed` (madvise: the same address, its pages
/// replaced by zeroes); `--cache off`: the same without the descriptor
/// cache (plain pin-down cache registrations).
fn remap_put(ep: &mut Endpoint<'_>, args: &[String]) -> Outcome {
    const LEN: usize = 64 << 10;
    const ROUNDS: u64 = 200;
    let mut tally = Tally::default();
    if ep.rank() != 0 {
        return Ok(tally);
    }
    let way = arg(args, "--way").unwrap_or("munmap");
    let map = |at: *mut libc::c_void, fixed: bool| {
        let flags =
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | if fixed { libc::MAP_FIXED } else { 0 };
        // SAFETY: an anonymous mapping of LEN bytes; with MAP_FIXED only
        // at `at`, an address this function mapped and has unmapped.
        unsafe { libc::mmap(at, LEN, libc::PROT_READ | libc::PROT_WRITE, flags, -1, 0) }
    };
    let at = map(std::ptr::null_mut(), false);
    if at == libc::MAP_FAILED {
        return Err("mmap failed".into());
    }
    let mut back = vec![0u8; LEN];
    let mut stale = Vec::new();
    for round in 0..ROUNDS {
        let fill = (round % 250 + 1) as u8;
        // Puts from the same address, enough to promote the descriptor.
        for _ in 0..4 {
            // SAFETY: `at` maps LEN bytes, read and write, that no one else
            // references.
            let source = unsafe { std::slice::from_raw_parts_mut(at.cast::<u8>(), LEN) };
            source.fill(fill);
            ep.put(1, 0, source).map_err(|e| format!("put: {e}"))?;
        }
        // New pages at the same address.
        match way {
            "dontneed" => {
                // SAFETY: the range was mapped above; its contents go.
                unsafe { libc::madvise(at, LEN, libc::MADV_DONTNEED) };
            }
            _ => {
                // SAFETY: the range was mapped above and nothing borrows it.
                unsafe { libc::munmap(at, LEN) };
                if map(at, true) != at {
                    return Err("mmap at the same address failed".into());
                }
            }
        }
        // SAFETY: as above; the new pages.
        let source = unsafe { std::slice::from_raw_parts_mut(at.cast::<u8>(), LEN) };
        source.fill(fill.wrapping_add(1));
        if let Err(e) = ep.put(1, 0, source) {
            return Err(format!(
                "put after remap {round}: {e}; cache {:?}",
                ep.descriptor_counters()
            ));
        }
        ep.get(1, 0, &mut back).map_err(|e| format!("get: {e}"))?;
        let wrong = back.iter().filter(|&&b| b != fill.wrapping_add(1)).count();
        if wrong > 0 {
            stale.push(format!(
                "round {round}: {wrong} bytes wrong (first {})",
                back[0]
            ));
        }
        tally.checked += 1;
    }
    // SAFETY: the mapping of this function, no longer used.
    unsafe { libc::munmap(at, LEN) };
    let cache = ep.descriptor_counters();
    tally
        .extra
        .insert("cache".into(), json!(format!("{cache:?}")));
    if !stale.is_empty() {
        return Err(format!(
            "{} of {ROUNDS} puts after a remap carried old bytes: {:?}",
            stale.len(),
            &stale[..stale.len().min(5)]
        ));
    }
    Ok(tally)
}

/// Three ranks. Rank 2 sends rank 0 the barrier notice that only rank 1
/// may send (round 1 of the next barrier: the sender of round r to rank
/// 0 is rank -2^r); rank 1 enters that barrier only after a delay, having
/// put a marker into rank 0's segment first. A barrier that checked who
/// sent a notice would hold rank 0 until rank 1 entered, and rank 0 would
/// see the marker once it leaves.
fn forged_barrier(ep: &mut Endpoint<'_>) -> Outcome {
    const MARKER: [u8; 8] = *b"entered!";
    let mut tally = Tally::default();
    if ep.size() != 3 {
        return Err("forged-barrier runs on 3 ranks".into());
    }
    // The first barrier (in `run`) was epoch 1: the next is 2.
    let next_epoch = 2;
    match ep.rank() {
        2 => {
            let mut body = vec![0u8, 4, 2, 2];
            body.extend_from_slice(&0u32.to_le_bytes());
            body.extend_from_slice(&0u64.to_le_bytes());
            body.extend_from_slice(&[0u8; 8]);
            let body = with_args(body, &[next_epoch, 1]);
            ep.send_raw_packet(0, false, &body)
                .map_err(|e| e.to_string())?;
            ep.barrier().map_err(|e| e.to_string())?;
        }
        1 => {
            std::thread::sleep(Duration::from_millis(500));
            ep.put(0, 0, &MARKER).map_err(|e| e.to_string())?;
            ep.barrier().map_err(|e| e.to_string())?;
        }
        _ => {
            let start = Instant::now();
            ep.barrier().map_err(|e| e.to_string())?;
            let left_after = start.elapsed();
            if ep.segment()[..8] != MARKER {
                return Err(format!(
                    "rank 0 left the barrier after {left_after:?}, before rank 1 entered it \
                     (its marker is not there): a notice rank 2 forged for rank 1 let it out"
                ));
            }
            tally.checked = 1;
        }
    }
    Ok(tally)
}

/// Run with `--get message`. A get by message that times out leaves its
/// request at the target, which answers it: the late reply, from a healthy
/// peer doing what it was asked, must not be refused as a malformed packet
/// nor fail the next get.
fn late_get_reply(ep: &mut Endpoint<'_>) -> Outcome {
    let mut tally = Tally::default();
    if ep.rank() != 0 {
        // Not polling for a while: rank 0's first get gives up for sure;
        // the final barrier then serves it late.
        std::thread::sleep(Duration::from_millis(300));
        return Ok(tally);
    }
    let mut buffer = vec![0u8; 4096];
    let mut timed_out = None;
    for attempt in 0..5000 {
        ep.set_timeout(Duration::from_nanos(1));
        let result = ep.get(1, 0, &mut buffer);
        ep.set_timeout(Duration::from_secs(60));
        if let Err(err) = result {
            timed_out = Some((attempt, err.to_string()));
            break;
        }
    }
    let Some((attempt, why)) = timed_out else {
        return Err("no get timed out in 5000 attempts".into());
    };
    let mut errors = Vec::new();
    // The next get, at once: the late reply now names an older request.
    if let Err(err) = ep.get(1, 0, &mut buffer) {
        errors.push(format!("the next get: {err}"));
    }
    let deadline = Instant::now() + Duration::from_millis(500);
    while Instant::now() < deadline {
        if let Err(err) = ep.poll() {
            errors.push(err.to_string());
        }
    }
    if !errors.is_empty() {
        return Err(format!(
            "get {attempt} failed ({why}); the late reply then made poll fail: {errors:?} \
             (bad_packets {})",
            ep.counters().bad_packets
        ));
    }
    tally.checked = 1;
    Ok(tally)
}

/// Three ranks. Every rank's window spans all of its rings and credit
/// words, so rank 2 can write the word where rank 0 keeps what rank 1
/// has consumed of its ring (here: with its own queue pair, as any peer
/// can). Rank 0 then believes its ring at rank 1 is always empty and
/// writes 200 packets into 64 slots while rank 1 is not polling: it
/// should stall at the 65th (and time out, rank 1 not polling); instead
/// it overwrites packets rank 1 has not read, and rank 1 never runs one.
/// `--forge off`: rank 2 writes nothing (the control: rank 0 stalls, all
/// it sent runs; the scenario passes on ranks 1 and 2).
fn forged_credit(
    ep: &mut Endpoint<'_>,
    job: &mut Job,
    context: &pindown_driver::verbs::Context,
    state: &Rc<RefCell<State>>,
    args: &[String],
) -> Outcome {
    use pindown_driver::verbs::opcode::Write;
    use pindown_driver::verbs::RemoteWindow;
    const SENT: u32 = 200;
    const MARKER: [u8; 8] = *b"all sent";
    let mut tally = Tally::default();
    if ep.size() != 3 {
        return Err("forged-credit runs on 3 ranks".into());
    }
    let config = ep.config().clone();
    // Rank 0's layout (mod.rs, `Layout::new`): rings after the segment,
    // then one credit word per target.
    let rings_at = (config.segment_bytes as u64).next_multiple_of(64);
    let credits_at = rings_at + 3 * u64::from(config.ring_slots) * u64::from(config.slot_bytes);
    match ep.rank() {
        2 => {
            let record = job.get(0, "pindown-gasnet").map_err(|e| e.to_string())?;
            let text = format!(
                "{}:{}:{:016x}:{}",
                u16::from_le_bytes(record[0..2].try_into().expect("2 bytes")),
                u16::from_le_bytes(record[2..4].try_into().expect("2 bytes")),
                u64::from_le_bytes(record[4..12].try_into().expect("8 bytes")),
                u64::from_le_bytes(record[12..20].try_into().expect("8 bytes")),
            );
            let rank0: RemoteWindow = text.parse().map_err(|e| format!("{e}"))?;
            let buffer = context.alloc(4096, 4096).map_err(|e| e.to_string())?;
            // SAFETY: 8 bytes of a buffer just allocated, 4096 long.
            unsafe { std::ptr::write(buffer.as_ptr().cast::<u64>(), 1 << 40) };
            let region = context
                .register_buffer(&buffer)
                .map_err(|e| e.to_string())?;
            let mut cq = context.create_completion_queue();
            let mut qp = context
                .create_queue_pair(&mut cq)
                .map_err(|e| e.to_string())?;
            let entry = Write::new(
                region.local(0, 8).map_err(|e| e.to_string())?,
                rank0.at(credits_at + 8),
            )
            .build()
            .inline()
            .signaled();
            let forge = arg(args, "--forge") != Some("off");
            if forge {
                qp.post(&[entry]).map_err(|e| e.to_string())?;
            }
            let deadline = Instant::now() + Duration::from_secs(10);
            let mut done = Vec::new();
            while forge && done.is_empty() && Instant::now() < deadline {
                cq.poll_into(&mut done).map_err(|e| e.to_string())?;
            }
            if forge && done.is_empty() {
                return Err("the forged credit write did not complete".into());
            }
            ep.request_short(0, H_GO, &[]).map_err(|e| e.to_string())?;
            tally.checked = 1;
        }
        0 => {
            ep.wait_until(|_| state.borrow().verified > 0)
                .map_err(|e| e.to_string())?;
            ep.set_timeout(Duration::from_secs(2));
            for n in 0..SENT {
                if let Err(err) = ep.request_short(1, H_GOOD, &[n]) {
                    // What a credit check would do: rank 1 is not polling.
                    tally
                        .notes
                        .push(format!("send {n} stalled and failed: {err}"));
                    break;
                }
            }
            ep.set_timeout(Duration::from_secs(60));
            ep.put(1, 0, &MARKER).map_err(|e| e.to_string())?;
            tally.checked = 1;
        }
        _ => {
            // Not polling until rank 0 says (by a put) it has sent.
            let deadline = Instant::now() + Duration::from_secs(30);
            while ep.segment()[..8] != MARKER {
                if Instant::now() > deadline {
                    return Err("rank 0 never said it was done".into());
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            let deadline = Instant::now() + Duration::from_secs(1);
            while Instant::now() < deadline {
                ep.poll().map_err(|e| e.to_string())?;
            }
            let ran = state.borrow().good;
            // Without the forgery rank 0 stalls once the ring is full and
            // all it sent runs here (63: the first barrier's notice holds
            // a slot whose credit is not yet back).
            if ran < config.ring_slots / 2 {
                // Exit without the final barrier: its notices would sit
                // behind the lost packets.
                return Err(format!(
                    "rank 0 sent without credits (rank 2 forged rank 1's consumed count in rank \
                     0's window) and overran the 64-slot ring: {ran} of its messages ran here"
                ));
            }
            tally.checked = u64::from(ran);
        }
    }
    Ok(tally)
}

/// A zero liveness interval is refused before anything is set up; ranks
/// whose rings or segments differ are refused even where the rings take
/// the same bytes, or the segments the same rounded size.
fn config_checks(
    job: &mut Job,
    context: &pindown_driver::verbs::Context,
    config: Config,
) -> Outcome {
    let mut tally = Tally::default();
    let zero = Config {
        liveness_interval: Duration::ZERO,
        ..config.clone()
    };
    match Endpoint::new(context, job, zero, Handlers::new()) {
        Err(pindown_messaging::Error::InvalidConfig(why)) if why.contains("liveness_interval") => {
            tally.checked += 1
        }
        other => return Err(format!("a zero liveness interval: {:?}", other.map(|_| ()))),
    }
    let even = job.rank().is_multiple_of(2);
    let rings = Config {
        ring_slots: if even { 2 } else { 4 },
        slot_bytes: if even { 512 } else { 256 },
        ..config.clone()
    };
    let segments = Config {
        segment_bytes: if even { 100 } else { 120 },
        ..config.clone()
    };
    if job.size() > 1 {
        for (what, odd) in [
            ("Config::ring_slots", rings),
            ("Config::segment_bytes", segments),
        ] {
            match Endpoint::new(context, job, odd, Handlers::new()) {
                Err(pindown_messaging::Error::Mismatch(why)) if why.contains(what) => {
                    tally.checked += 1
                }
                other => return Err(format!("differing {what}: {:?}", other.map(|_| ()))),
            }
        }
    }
    let mut ep =
        Endpoint::new(context, job, config.clone(), Handlers::new()).map_err(|e| e.to_string())?;
    ep.barrier().map_err(|e| e.to_string())?;
    tally.checked += 1;
    // A handle of an endpoint made again is not the new endpoint's.
    let target = (job.rank() + 1) % job.size();
    let put = ep
        .put_nb(target, 64 * u64::from(job.rank()), vec![7u8; 64])
        .map_err(|e| e.to_string())?;
    ep.wait(put).map_err(|e| e.to_string())?;
    ep.barrier().map_err(|e| e.to_string())?;
    drop(ep);
    let mut ep = Endpoint::new(context, job, config, Handlers::new()).map_err(|e| e.to_string())?;
    match ep.wait(put) {
        Err(pindown_messaging::Error::Gasnet(why)) if why.contains("another endpoint") => {
            tally.checked += 1
        }
        other => return Err(format!("a handle of the endpoint before: {other:?}")),
    }
    ep.barrier().map_err(|e| e.to_string())?;
    Ok(tally)
}

/// Rank 0 asks rank 1 for a reply while rank 1 does nothing but native
/// gets (as a rank that finished its puts does in `misalign`) for longer
/// than the timeout: the reply must reach rank 0 meanwhile, sent from the
/// waits of rank 1's gets. (It once waited in rank 1's queue until rank 1
/// polled: rank 0 gave up, left, and rank 1's next get found its window
/// gone.)
fn stuck_reply_handlers(state: &Rc<RefCell<State>>) -> Handlers {
    let mut handlers = Handlers::new();
    handlers.register(H_VERIFY, move |token, _args, _| {
        let _ = token.reply_short(H_VERIFIED, &[1]);
    });
    let s = state.clone();
    handlers.register(H_VERIFIED, move |_, _, _| {
        s.borrow_mut().verified += 1;
    });
    handlers
}

fn stuck_reply(ep: &mut Endpoint<'_>, state: &Rc<RefCell<State>>) -> Outcome {
    let mut tally = Tally::default();
    if ep.rank() == 0 {
        std::thread::sleep(Duration::from_millis(200));
        ep.request_short(1, H_VERIFY, &[])
            .map_err(|e| format!("request: {e}"))?;
        let asked = Instant::now();
        ep.wait_until(|_| state.borrow().verified > 0)
            .map_err(|e| format!("reply: {e}"))?;
        tally
            .notes
            .push(format!("reply after {:?}", asked.elapsed()));
        // Rank 1 gets for 8 s: enter the final barrier within the timeout.
        std::thread::sleep(Duration::from_secs(4));
        tally.checked = 1;
    } else {
        let mut buffer = vec![0u8; 1024];
        let start = Instant::now();
        let mut gets = 0u64;
        while start.elapsed() < Duration::from_secs(8) {
            ep.get(0, 4096, &mut buffer)
                .map_err(|e| format!("get {gets}: {e}"))?;
            gets += 1;
        }
        tally.checked = gets;
    }
    Ok(tally)
}
