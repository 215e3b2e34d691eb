//! `msg_check`: ranks that check the messaging library's calls, byte by
//! byte, and a launcher that starts them with an emulated NIC.
//!
//! ```text
//! msg_check launch N SCENARIO [--mode sync|buffered|switch] # a device with N ports, N ranks
//!                                  [--poll]                   # the device busy-polls
//! msg_check rank SCENARIO                                   # one rank (under mpiexec, or launch)
//! msg_check device ARGS...                                   # the emulated NIC
//! msg_check --socket-dir DIR ...                             # the same, as a device binary
//! ```
//!
//! A rank joins the job ([`Job::from_environment`]: Hydra, Open MPI, or
//! `PINDOWN_RANK`/`PINDOWN_SIZE`/`PINDOWN_KV_DIR`), opens its port
//! ([`device_socket`]), runs the scenario and prints one JSON line:
//! `{"rank":0,"size":2,"scenario":"pingpong","ok":true,"checked":1234}`
//! or `{"rank":0,...,"ok":false,"error":"..."}` (exit status 1).
//! `launch` prints every rank's line and exits 0 only if all passed.
//!
//! Any-source scenarios: `any-source` (every rank but 0 sends mixed
//! sizes and tags to rank 0, which receives them with `recv_any` and
//! `irecv_any`, with and without filters, and checks bytes, the
//! per-(source, tag) order, fairness, truncation and that domains and
//! communicators stay apart) and `any-source-death` (the last rank dies in
//! the middle of a rendezvous send; rank 0's `recv_any` from it fails with
//! `PeerGone`, and with 3 ranks or more rank 1's `send_any` to it too),
//! and `any-flood` (every rank but 0 sends rank 0 more any-source messages
//! than `--unexpected N` lets wait while its only receive asks for
//! another tag: the queue stays within N per sender, the senders are held
//! back, and every message then arrives in order).
//!
//! Scenarios: `pingpong` (blocking and nonblocking, 0 B to 4 MiB, FMPL's
//! (peer, index) waits, persistent requests), `timeout-switch` (buffered,
//! synchronous and switching sends against late receives, with
//! `sendbuf_check`), `send-first` (every rank sends to every other
//! before receiving), `any-index`, `truncation`, `slots` (every slot
//! outstanding, then the errors beyond), `split` (communicators),
//! `typed` (datatypes on either side: a matrix column, a 3-D sub-block,
//! plain sends into typed receives and back, an oversized message, a type
//! past its buffer), `peer-death` (the last rank exits; the others'
//! receives from it fail), `device-death` (every rank waits until the
//! device is taken away), `forged-index` and `forged-epoch` (a peer
//! writes control words no honest peer writes: an any-index receive's
//! index out of range, collective epochs far ahead; the ranks refuse
//! them, naming the peer), `outsider-collective` (a rank outside a
//! communicator forges every collective word it can reach: the
//! communicator's collectives pass, exact), `leaked-key` (a third rank writes through the
//! keys of the windows a rank bound for another peer: refused),
//! `late-write` (the sender writes into a receive buffer after the
//! receive returned: refused, as no window is cached by default, or into
//! a small receive's landing buffer, which leaves the buffer unchanged),
//! `withdrawn-receive` (a blocking receive fails because its peer counts
//! as gone, though it is not; the peer sends afterwards, and nothing lands
//! in the buffer the failed receive gave back), `forged-split` and
//! `forged-context` (the rank gathering a split's table forges this
//! rank's entry: refused), `forged-credit` and `forged-entry` (any-source
//! credit words and ring entries no honest peer writes: refused, naming
//! the peer), `collectives`
//! (barriers, broadcasts,
//! reduces and allreduces with every algorithm, random roots, sizes 0 B to
//! 4 MiB, element types and operations, on the world, a split and a dup;
//! `--seed S`, `--cases N`; results compared with a reference each rank
//! computes from every rank's seeded contribution) and
//! `collective-mismatch` (members that disagree about a collective call:
//! every rank fails instead of waiting, one names both calls) and
//! `collective-give-up` (members that give a call up or refuse it release
//! the others; no late write into a failed call's buffer) and
//! `collective-lost-member` (a member that gives up the dup that made a
//! communicator: the others' first call on it fails) and
//! `collective-verify` (calls that disagree but complete: with
//! `--verify`, every rank fails them; without, they return).
//! `--verify` turns on `Config::verify_collectives` for any scenario;
//! `--liveness-ms N` sets `Config::liveness_interval` (how often a wait
//! checks its peer).

use std::collections::HashSet;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use pindown_driver::launch::{device_socket, Job};
use pindown_messaging::{BarrierAlgorithm, Communicator, Config, Error, Messenger};
use pindown_uapi::ErrorDetail;

#[path = "scenarios/global_memory.rs"]
mod global_memory;
#[path = "scenarios/global_memory_edges.rs"]
mod global_memory_edges;
#[path = "scenarios/launcher.rs"]
mod launcher;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    launcher::main("msg_check", &args, rank)
}

/// What a scenario checked.
#[derive(Default)]
struct Tally {
    checked: u64,
    notes: Vec<String>,
}

type Outcome = Result<Tally, String>;

fn rank(scenario: &str, args: &[String]) -> ExitCode {
    let mut job = match Job::from_environment() {
        Ok(job) => job,
        Err(err) => {
            println!("{{\"ok\":false,\"error\":{:?}}}", err.to_string());
            return ExitCode::from(2);
        }
    };
    let (rank, size) = (job.rank(), job.size());
    let outcome = run(&mut job, scenario, args);
    let line = match &outcome {
        Ok(tally) => format!(
            "{{\"rank\":{rank},\"size\":{size},\"scenario\":{scenario:?},\"ok\":true,\"checked\":{},\"notes\":{:?}}}",
            tally.checked, tally.notes
        ),
        Err(err) => format!(
            "{{\"rank\":{rank},\"size\":{size},\"scenario\":{scenario:?},\"ok\":false,\"error\":{err:?}}}"
        ),
    };
    println!("{line}");
    if std::env::var_os("MSG_CHECK_TRACE").is_some() {
        eprintln!("{line}");
    }
    if outcome.is_ok() {
        let _ = job.finalize();
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn run(job: &mut Job, scenario: &str, args: &[String]) -> Outcome {
    let socket = device_socket(job).map_err(|e| e.to_string())?;
    let context = launcher::open(&socket)?;
    if scenario.starts_with("acp") {
        return global_memory::run(job, &context, scenario);
    }
    if scenario == "config-checks" {
        return config_checks(job, &context);
    }
    let mut config = Config::default();
    if let Some(mode) = args
        .iter()
        .position(|a| a == "--mode")
        .and_then(|i| args.get(i + 1))
    {
        config.send_timeout = match mode.as_str() {
            "sync" => None,
            "buffered" => Some(Duration::ZERO),
            _ => Some(Duration::from_millis(20)),
        };
    }
    if let Some(windows) = args
        .iter()
        .position(|a| a == "--window-cache")
        .and_then(|i| args.get(i + 1))
    {
        config.window_cache = windows
            .parse()
            .map_err(|e| format!("--window-cache {windows}: {e}"))?;
    }
    if let Some(ms) = args
        .iter()
        .position(|a| a == "--liveness-ms")
        .and_then(|i| args.get(i + 1))
    {
        let ms: u64 = ms.parse().map_err(|e| format!("--liveness-ms {ms}: {e}"))?;
        config.liveness_interval = Duration::from_millis(ms);
    }
    config.verify_collectives = args.iter().any(|a| a == "--verify");
    if scenario == "collective-verify" && !config.verify_collectives {
        // Unverified, the mismatched calls must complete: no liveness
        // check (which reads the members' call records) may fall inside
        // one, however slowly a rank is scheduled.
        config.liveness_interval = Duration::from_secs(60);
    }
    if let Some(limit) = args
        .iter()
        .position(|a| a == "--unexpected")
        .and_then(|i| args.get(i + 1))
    {
        config.unexpected_per_sender = limit
            .parse()
            .map_err(|e| format!("--unexpected {limit}: {e}"))?;
    }
    let messenger = Messenger::new(&context, job, config.clone()).map_err(|e| e.to_string())?;
    let world = messenger.world();
    let tally = match scenario {
        "any-source" => any_source(&world),
        "any-source-death" => any_source_death(&world),
        "any-flood" => any_flood(&messenger, &world, &config),
        "pingpong" => pingpong(&messenger, &world),
        "timeout-switch" => timeout_switch(&messenger, &world),
        "send-first" => send_first(&messenger, &world),
        "any-index" => any_index(&world),
        "truncation" => truncation(&world),
        "slots" => slots(&world),
        "split" => split(&world),
        "typed" => typed(&world),
        "device-death" => device_death(&world),
        "peer-death" => peer_death(&world),
        "collectives" => collectives::run(&world, args),
        "collective-mismatch" => collectives::mismatch(&world),
        "collective-give-up" => collectives::give_up(&world),
        "collective-lost-member" => collectives::lost_member(&messenger, &world),
        "collective-verify" => collectives::verify(&world, &config),
        "forged-index" => forged_index(&messenger, &world),
        "forged-epoch" => forged_epoch(&messenger, &world),
        "outsider-collective" => outsider_collective(&messenger, &world),
        "leaked-key" => leaked_key(&messenger, &world),
        "late-write" => late_write(&messenger, &world),
        "withdrawn-receive" => withdrawn_receive(&messenger, &world),
        "forged-split" => forged_split(&messenger, &world, false),
        "forged-context" => forged_split(&messenger, &world, true),
        "forged-credit" => forged_credit(&messenger, &world),
        "forged-entry" => forged_entry(&messenger, &world),
        other => Err(format!("unknown scenario {other:?}")),
    }?;
    // Everyone done before anyone leaves (but a dead rank, and after a
    // forgery: the world's collectives refuse a forged epoch for good, and
    // the forger of a receive's completion still sees that receive
    // posted, so its next send to that peer may go to it).
    let forged = [
        "forged-epoch",
        "outsider-collective",
        "forged-index",
        "forged-split",
        "forged-context",
        "forged-credit",
        "forged-entry",
    ];
    if ![
        "peer-death",
        "any-source-death",
        "device-death",
        "withdrawn-receive",
        "collective-lost-member",
    ]
    .contains(&scenario)
        && !forged.contains(&scenario)
    {
        barrier(&world).map_err(|e| format!("final barrier: {e}"))?;
        drop(world);
        messenger
            .finalize(Duration::from_secs(30))
            .map_err(|e| format!("finalize: {e}"))?;
    }
    Ok(tally)
}

/// Byte `i` of the message `from` sends to `to` as its `n`th.
fn byte(from: u32, to: u32, n: u64, i: usize) -> u8 {
    let x = (i as u64)
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .wrapping_add(u64::from(from) << 48 | u64::from(to) << 32 | n);
    (x ^ (x >> 29) ^ (x >> 47)) as u8
}

fn message(from: u32, to: u32, n: u64, len: usize) -> Vec<u8> {
    (0..len).map(|i| byte(from, to, n, i)).collect()
}

fn check(got: &[u8], from: u32, to: u32, n: u64, what: &str) -> Result<u64, String> {
    match (0..got.len()).find(|&i| got[i] != byte(from, to, n, i)) {
        None => Ok(got.len() as u64),
        Some(i) => Err(format!("{what}: byte {i} of {} differs", got.len())),
    }
}

fn err(what: &str) -> impl Fn(Error) -> String + '_ {
    move |e| format!("{what}: {e}")
}

/// A barrier over point-to-point messages (slot 0 of a dup'd
/// communicator would do too): everyone to rank 0, rank 0 back.
fn barrier(world: &Communicator<'_>) -> pindown_messaging::Result<()> {
    if world.rank() == 0 {
        for r in 1..world.size() {
            world.recv(r, 0, &mut [])?;
        }
        for r in 1..world.size() {
            world.send(r, 0, &[])?;
        }
    } else {
        world.send(0, 0, &[])?;
        world.recv(0, 0, &mut [])?;
    }
    Ok(())
}

/// This rank and `peer` meet: an empty message each way on the last slot
/// index (which the scenarios leave free).
fn meet(world: &Communicator<'_>, peer: u32) -> pindown_messaging::Result<()> {
    let index = Config::default().slots - 1;
    if world.rank() < peer {
        world.recv(peer, index, &mut [])?;
        world.send(peer, index, &[])
    } else {
        world.send(peer, index, &[])?;
        world.recv(peer, index, &mut []).map(drop)
    }
}

const SIZES: [usize; 12] = [
    0,
    1,
    8,
    511,
    512,
    513,
    4096,
    4097,
    65536,
    1 << 20,
    (1 << 20) + 3,
    4 << 20,
];

fn pingpong(messenger: &Messenger<'_>, world: &Communicator<'_>) -> Outcome {
    let mut tally = Tally::default();
    if world.size() < 2 || world.rank() > 1 {
        return Ok(tally);
    }
    let me = world.rank();
    let peer = 1 - me;
    let mut n = 0u64;
    // Blocking, the same buffers each round (window cache hits).
    let mut buffer = vec![0u8; 4 << 20];
    for round in 0..3 {
        for &len in &SIZES {
            n += 1;
            let index = (n % 8) as u32;
            if me == 0 {
                world
                    .send(peer, index, &message(me, peer, n, len))
                    .map_err(err("send"))?;
                let got = world.recv(peer, index, &mut buffer).map_err(err("recv"))?;
                if got != len {
                    return Err(format!("round {round}: pong of {got} bytes, {len} sent"));
                }
                tally.checked += check(&buffer[..got], peer, me, n, "pong")?;
            } else {
                let got = world.recv(peer, index, &mut buffer).map_err(err("recv"))?;
                if got != len {
                    return Err(format!("round {round}: ping of {got} bytes, {len} sent"));
                }
                tally.checked += check(&buffer[..got], peer, me, n, "ping")?;
                world
                    .send(peer, index, &message(me, peer, n, len))
                    .map_err(err("send"))?;
            }
        }
    }
    // Nonblocking: receives posted first, sends after, waited in turn.
    for &len in &SIZES {
        n += 1;
        let recv = world.irecv(peer, 9, vec![0u8; len]).map_err(err("irecv"))?;
        let send = world
            .isend(peer, 9, message(me, peer, n, len))
            .map_err(err("isend"))?;
        let back = send.wait().map_err(err("send wait"))?;
        if back.len() != len {
            return Err("isend gave back another buffer".into());
        }
        let (got, received) = recv.wait().map_err(err("recv wait"))?;
        if received.len != len as u64 || received.index != 9 {
            return Err(format!("irecv: {received:?} for {len} bytes on 9"));
        }
        tally.checked += check(&got, peer, me, n, "irecv")?;
    }
    // FMPL's naming: wait by (peer, index), then the handle finds it done.
    n += 1;
    let mut recv = world
        .irecv(peer, 10, vec![0u8; 100])
        .map_err(err("irecv"))?;
    world
        .send(peer, 10, &message(me, peer, n, 100))
        .map_err(err("send"))?;
    world.wait_recv(peer, 10).map_err(err("wait_recv"))?;
    if !recv.test().map_err(err("test"))? {
        return Err("wait_recv returned before the receive completed".into());
    }
    let (got, _) = recv.wait().map_err(err("recv wait"))?;
    tally.checked += check(&got, peer, me, n, "wait_recv")?;
    // Persistent requests: one set-up, many sends of changing contents.
    let mut send = world
        .send_init(peer, 11, vec![0u8; 3000])
        .map_err(err("send_init"))?;
    let mut recv = world
        .recv_init(peer, 11, vec![0u8; 3000])
        .map_err(err("recv_init"))?;
    for _ in 0..20 {
        n += 1;
        recv.start().map_err(err("recv start"))?;
        send.buffer_mut()
            .ok_or("persistent buffer busy")?
            .copy_from_slice(&message(me, peer, n, 3000));
        send.start().map_err(err("send start"))?;
        send.wait().map_err(err("send wait"))?;
        let received = recv.wait().map_err(err("recv wait"))?;
        if received.len != 3000 {
            return Err(format!("persistent receive of {} bytes", received.len));
        }
        tally.checked += check(recv.buffer().ok_or("buffer")?, peer, me, n, "persistent")?;
    }
    let counts = messenger.window_cache_counts();
    tally.notes.push(format!("window cache {counts:?}"));
    Ok(tally)
}

fn timeout_switch(messenger: &Messenger<'_>, world: &Communicator<'_>) -> Outcome {
    let mut tally = Tally::default();
    if world.size() < 2 || world.rank() > 1 {
        return Ok(tally);
    }
    let me = world.rank();
    let peer = 1 - me;
    let late = Duration::from_millis(150);
    let mut buffer = vec![0u8; 70_000];
    // Both ranks start here, however long each took to set up.
    meet(world, peer).map_err(err("meet"))?;
    // 1. Buffered: the sends return before any receive exists; the spool
    //    drains when the receives come. Rank 1 posts them only when told
    //    (on slot GO) that the sends have returned, however long they took.
    const GO: u32 = 9;
    messenger.set_send_timeout(Some(Duration::ZERO));
    if me == 0 {
        for n in 0..8u64 {
            world
                .send(
                    peer,
                    n as u32,
                    &message(me, peer, n, 1000 + n as usize * 8000),
                )
                .map_err(err("buffered send"))?;
        }
        let status = messenger.sendbuf_check().map_err(err("sendbuf_check"))?;
        if status.spooled == 0 {
            return Err(format!("buffered sends left nothing spooled: {status:?}"));
        }
        tally.notes.push(format!("after sends: {status:?}"));
        world.send(peer, GO, &[]).map_err(err("go"))?;
        let start = Instant::now();
        loop {
            let status = messenger.sendbuf_check().map_err(err("sendbuf_check"))?;
            if status.spooled == 0 {
                if status.sent < 8 {
                    return Err(format!("spool drained but only {} sent", status.sent));
                }
                break;
            }
            if start.elapsed() > Duration::from_secs(30) {
                return Err(format!("spool never drained: {status:?}"));
            }
            std::thread::sleep(Duration::from_micros(100));
        }
    } else {
        world.recv(peer, GO, &mut []).map_err(err("go"))?;
        for n in 0..8u64 {
            let len = world
                .recv(peer, n as u32, &mut buffer)
                .map_err(err("recv"))?;
            tally.checked += check(&buffer[..len], peer, me, n, "spooled message")?;
        }
    }
    meet(world, 1 - world.rank()).map_err(err("meet"))?;
    // 2. Synchronous: the send waits for the late receive.
    messenger.set_send_timeout(None);
    if me == 0 {
        let before = messenger.sendbuf_check().map_err(err("sendbuf_check"))?;
        let start = Instant::now();
        world
            .send(peer, 20, &message(me, peer, 20, 5000))
            .map_err(err("sync send"))?;
        let waited = start.elapsed();
        let status = messenger.sendbuf_check().map_err(err("sendbuf_check"))?;
        // A message spooled earlier (the meeting's, in buffered mode) may
        // go out meanwhile; the synchronous send must not add to the
        // number of messages that ever entered the spool.
        if status.sent + status.spooled != before.sent + before.spooled {
            return Err(format!(
                "a synchronous send went through the spool: {before:?} then {status:?}"
            ));
        }
        tally
            .notes
            .push(format!("synchronous send waited {waited:?}"));
    } else {
        std::thread::sleep(late + Duration::from_millis(20));
        let len = world.recv(peer, 20, &mut buffer).map_err(err("recv"))?;
        tally.checked += check(&buffer[..len], peer, me, 20, "synchronous message")?;
    }
    meet(world, 1 - world.rank()).map_err(err("meet"))?;
    // 3. The switch: with no receive in its timeout, a send spools and
    //    returns; rank 1 posts the receive only when told (slot GO).
    messenger.set_send_timeout(Some(Duration::from_millis(10)));
    if me == 0 {
        let before = messenger.sendbuf_check().map_err(err("sendbuf_check"))?;
        world
            .send(peer, 21, &message(me, peer, 21, 30_000))
            .map_err(err("send"))?;
        let after = messenger.sendbuf_check().map_err(err("sendbuf_check"))?;
        if after.sent + after.spooled != before.sent + before.spooled + 1 {
            return Err(format!(
                "the switch did not spool: {before:?} then {after:?}"
            ));
        }
        world.send(peer, GO, &[]).map_err(err("go"))?;
        let start = Instant::now();
        while messenger
            .sendbuf_check()
            .map_err(err("sendbuf_check"))?
            .spooled
            > 0
        {
            if start.elapsed() > Duration::from_secs(30) {
                return Err("the switched message never left the spool".into());
            }
            std::thread::sleep(Duration::from_micros(100));
        }
    } else {
        world.recv(peer, GO, &mut []).map_err(err("go"))?;
        let len = world.recv(peer, 21, &mut buffer).map_err(err("recv"))?;
        tally.checked += check(&buffer[..len], peer, me, 21, "switched message")?;
    }
    Ok(tally)
}

/// Configurations out of range are refused before anything is set up;
/// ranks that differ in slots and communicators are refused even where
/// the control areas they make are the same size; deadlines too far for
/// the clock mean no deadline. Every rank runs it.
fn config_checks(job: &mut Job, context: &pindown_driver::verbs::Context) -> Outcome {
    let mut tally = Tally::default();
    let refused = |config: Config, job: &mut Job, wanted: &str| -> Result<(), String> {
        match Messenger::new(context, job, config) {
            Err(Error::InvalidConfig(why)) if why.contains(wanted) => Ok(()),
            Err(other) => Err(format!("{wanted}: {other}")),
            Ok(_) => Err(format!("{wanted}: accepted")),
        }
    };
    let zero = Config {
        liveness_interval: Duration::ZERO,
        ..Config::default()
    };
    refused(zero, job, "liveness_interval")?;
    let forever = Config {
        liveness_interval: Duration::MAX,
        ..Config::default()
    };
    refused(forever, job, "liveness_interval")?;
    let huge = Config {
        slots: u32::MAX,
        communicators: u32::MAX / 2,
        ..Config::default()
    };
    refused(huge, job, "Config::slots")?;
    tally.checked += 3;
    // 429 slots on one communicator and 2 slots on two make peer blocks of
    // the same size: the shapes are compared, not the sizes.
    let (slots, communicators) = if job.rank().is_multiple_of(2) {
        (428, 1)
    } else {
        (2, 2)
    };
    let odd = Config {
        slots,
        communicators,
        ..Config::default()
    };
    if job.size() > 1 {
        match Messenger::new(context, job, odd) {
            Err(Error::Mismatch(why)) if why.contains("Config::slots") => tally.checked += 1,
            other => return Err(format!("differing shapes: {:?}", other.map(|_| ()))),
        }
    }
    let messenger = Messenger::new(context, job, Config::default()).map_err(err("messenger"))?;
    messenger.set_send_timeout(Some(Duration::MAX));
    let world = messenger.world();
    if world.size() > 1 && world.rank() < 2 {
        let peer = 1 - world.rank();
        meet(&world, peer).map_err(err("meet"))?;
        if world.rank() == 0 {
            world.send(peer, 1, b"no deadline").map_err(err("send"))?;
        } else {
            let mut buffer = [0u8; 11];
            world.recv(peer, 1, &mut buffer).map_err(err("recv"))?;
            if &buffer != b"no deadline" {
                return Err(format!("received {buffer:?}"));
            }
            tally.checked += 1;
        }
    }
    messenger.finalize(Duration::MAX).map_err(err("finalize"))?;
    tally.checked += 1;
    // The communicator outlives the messenger, but no call starts on it.
    let mut buffer = [0u8; 8];
    let finalized = [
        world.send(0, 1, b"late").err(),
        world.recv(0, 1, &mut buffer).err(),
        world.barrier().err(),
        world.send_any(0, 1, b"late").err(),
        world.recv_any(None, None, &mut buffer).err(),
    ];
    if let Some(call) = finalized
        .iter()
        .position(|e| !matches!(e, Some(Error::Finalized)))
    {
        return Err(format!("call {call} after finalize: {:?}", finalized[call]));
    }
    tally.checked += 1;
    Ok(tally)
}

fn withdrawn_receive(messenger: &Messenger<'_>, world: &Communicator<'_>) -> Outcome {
    const INDEX: u32 = 4;
    const LEN: usize = 4096;
    const CANARY: u8 = 0xab;
    let mut tally = Tally::default();
    if world.size() < 2 || world.rank() > 1 {
        return Ok(tally);
    }
    let me = world.rank();
    meet(world, 1 - me).map_err(err("meet"))?;
    if me == 1 {
        // Rank 0 counts as gone 100 ms into the receive: the receive fails
        // and its buffer comes back.
        let mut buffer = vec![CANARY; LEN];
        messenger
            .declare_gone_at(0, Instant::now() + Duration::from_millis(100))
            .map_err(err("declare_gone_at"))?;
        match world.recv(0, INDEX, &mut buffer) {
            Err(Error::PeerGone { .. }) => {}
            other => return Err(format!("a receive from a rank declared gone: {other:?}")),
        }
        // Rank 0 sends once the receive has failed, and keeps trying for
        // 700 ms; its bytes must not land.
        signal("withdrawn-receive-failed")?;
        await_signal("withdrawn-receive-sent")?;
        if let Some(at) = buffer.iter().position(|&b| b != CANARY) {
            return Err(format!(
                "a write landed at byte {at} of the buffer a failed receive gave back"
            ));
        }
        tally.checked += LEN as u64;
    } else {
        await_signal("withdrawn-receive-failed")?;
        // Buffered: the send returns, and a failure (the receive's window
        // is gone) shows later or never; this rank only tries.
        messenger.set_send_timeout(Some(Duration::ZERO));
        let sent = world.send(1, INDEX, &message(0, 1, 0, LEN));
        tally.notes.push(format!("send: {sent:?}"));
        let until = Instant::now() + Duration::from_millis(700);
        while Instant::now() < until {
            let _ = messenger.sendbuf_check();
            std::thread::sleep(Duration::from_millis(1));
        }
        signal("withdrawn-receive-sent")?;
    }
    Ok(tally)
}

/// Where ranks of one run leave each other signals that do not go
/// through the library (a rank may have declared the other gone): the
/// launcher's key-value folder (`PINDOWN_KV_DIR`), in names its own
/// files never take.
fn signal_path(name: &str) -> Result<std::path::PathBuf, String> {
    let dir = std::env::var_os("PINDOWN_KV_DIR")
        .ok_or("signals between ranks need PINDOWN_KV_DIR (the environment launcher)")?;
    Ok(std::path::Path::new(&dir).join(format!("signal.{name}")))
}

/// Leaves signal `name` for the other ranks (nothing under another
/// launcher: a rank that waits for a signal fails saying so).
fn signal(name: &str) -> Result<(), String> {
    let Ok(path) = signal_path(name) else {
        return Ok(());
    };
    std::fs::write(&path, b"").map_err(|e| format!("{}: {e}", path.display()))
}

/// Waits (at most a minute) for signal `name`.
fn await_signal(name: &str) -> Result<(), String> {
    let path = signal_path(name)?;
    let deadline = Instant::now() + Duration::from_secs(60);
    while !path.exists() {
        if Instant::now() > deadline {
            return Err(format!("no signal {name} within a minute"));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(())
}

fn send_first(messenger: &Messenger<'_>, world: &Communicator<'_>) -> Outcome {
    let mut tally = Tally::default();
    if messenger.send_timeout().is_none() {
        return Err("send-first needs a finite send timeout".into());
    }
    let me = world.rank();
    let size = world.size();
    for round in 0..3u64 {
        for peer in (0..size).filter(|&p| p != me) {
            let len = 100 + (round as usize) * 40_000;
            world
                .send(peer, 1, &message(me, peer, round, len))
                .map_err(err("send first"))?;
        }
        for peer in (0..size).filter(|&p| p != me) {
            let mut buffer = vec![0u8; 200_000];
            let len = world.recv(peer, 1, &mut buffer).map_err(err("recv"))?;
            tally.checked += check(&buffer[..len], peer, me, round, "send-first")?;
        }
    }
    Ok(tally)
}

fn any_index(world: &Communicator<'_>) -> Outcome {
    let mut tally = Tally::default();
    if world.size() < 2 || world.rank() > 1 {
        return Ok(tally);
    }
    let me = world.rank();
    let indexes = [5u32, 17, 3, 60, 0, 41];
    if me == 0 {
        for (n, &index) in indexes.iter().enumerate() {
            world
                .send(1, index, &message(0, 1, u64::from(index), 64 + n))
                .map_err(err("send"))?;
        }
    } else {
        let mut seen = HashSet::new();
        for _ in 0..indexes.len() {
            let mut buffer = vec![0u8; 256];
            let got = world
                .recv_any_index(0, &mut buffer)
                .map_err(err("recv_any_index"))?;
            if !indexes.contains(&got.index) || !seen.insert(got.index) {
                return Err(format!("any-index receive reported index {}", got.index));
            }
            tally.checked += check(
                &buffer[..got.len as usize],
                0,
                1,
                u64::from(got.index),
                "any-index",
            )?;
        }
    }
    Ok(tally)
}

fn truncation(world: &Communicator<'_>) -> Outcome {
    let mut tally = Tally::default();
    if world.size() < 2 || world.rank() > 1 {
        return Ok(tally);
    }
    for (len, capacity) in [(100usize, 64usize), (5000, 4096), (1 << 20, 1000)] {
        if world.rank() == 0 {
            world
                .send(1, 2, &message(0, 1, len as u64, len))
                .map_err(err("send"))?;
        } else {
            let guard = 0xa5u8;
            let mut memory = vec![guard; capacity + 4096];
            match world.recv(0, 2, &mut memory[..capacity]) {
                Err(Error::Truncated {
                    message,
                    capacity: c,
                }) if message == len as u64 && c == capacity as u64 => {}
                other => return Err(format!("{len} into {capacity}: {other:?}")),
            }
            tally.checked += check(&memory[..capacity], 0, 1, len as u64, "truncated")?;
            if let Some(i) = memory[capacity..].iter().position(|&b| b != guard) {
                return Err(format!("byte {i} past the receive buffer was written"));
            }
            tally.checked += 4096;
        }
    }
    Ok(tally)
}

fn slots(world: &Communicator<'_>) -> Outcome {
    let mut tally = Tally::default();
    if world.size() < 2 || world.rank() > 1 {
        return Ok(tally);
    }
    let slots = Config::default().slots;
    let me = world.rank();
    let peer = 1 - me;
    // Errors first: out of range, and waits on nothing.
    match world.recv(peer, slots, &mut [0u8; 8]) {
        Err(Error::SlotOutOfRange { index, slots: s }) if index == slots && s == slots => {}
        other => return Err(format!("index {slots}: {other:?}")),
    }
    match world.wait_recv(peer, 7) {
        Err(Error::NoRequest { .. }) => {}
        other => return Err(format!("wait_recv on nothing: {other:?}")),
    }
    match world.wait_send(peer, 7) {
        Err(Error::NoRequest { .. }) => {}
        other => return Err(format!("wait_send on nothing: {other:?}")),
    }
    match world.recv(world.size(), 0, &mut [0u8; 8]) {
        Err(Error::NoSuchRank { .. }) => {}
        other => return Err(format!("rank {}: {other:?}", world.size())),
    }
    // Every slot outstanding at once, in both directions.
    let mut recvs = Vec::new();
    for index in 0..slots {
        recvs.push(
            world
                .irecv(peer, index, vec![0u8; 300])
                .map_err(err("irecv"))?,
        );
    }
    match world.irecv(peer, 0, vec![0u8; 8]) {
        Err(Error::SlotBusy { index: 0, .. }) => {}
        other => {
            return Err(format!(
                "a second receive on a busy slot: {:?}",
                other.err()
            ))
        }
    }
    let mut sends = Vec::new();
    for index in (0..slots).rev() {
        sends.push(
            world
                .isend(peer, index, message(me, peer, u64::from(index), 300))
                .map_err(err("isend"))?,
        );
    }
    for send in sends {
        send.wait().map_err(err("send wait"))?;
    }
    for (index, recv) in recvs.into_iter().enumerate() {
        let (got, received) = recv.wait().map_err(err("recv wait"))?;
        if received.index != index as u32 {
            return Err(format!("slot {index} reported {received:?}"));
        }
        tally.checked += check(&got, peer, me, index as u64, "slot")?;
    }
    // A receive completed by a wait naming its slot (FMPL's naming) keeps
    // the slot until its handle has taken the result: a second receive
    // there is refused, and the handle still gets its message.
    let first = world.irecv(peer, 1, vec![0u8; 300]).map_err(err("irecv"))?;
    world
        .send(peer, 1, &message(me, peer, 1001, 300))
        .map_err(err("send"))?;
    world.wait_recv(peer, 1).map_err(err("wait_recv"))?;
    match world.irecv(peer, 1, vec![0u8; 8]) {
        Err(Error::SlotBusy { index: 1, .. }) => {}
        other => {
            return Err(format!(
                "a receive on a slot whose result is not taken: {:?}",
                other.err()
            ))
        }
    }
    let (got, _) = first.wait().map_err(err("recv wait after wait_recv"))?;
    tally.checked += check(&got, peer, me, 1001, "slot after wait_recv")?;
    Ok(tally)
}

fn split(world: &Communicator<'_>) -> Outcome {
    let mut tally = Tally::default();
    let me = world.rank();
    let half = world
        .split(Some(me % 2), world.size() - me)
        .map_err(err("split"))?
        .ok_or("split gave no communicator")?;
    let dup = world.dup().map_err(err("dup"))?;
    let none = world
        .split(if me == 0 { None } else { Some(0) }, me)
        .map_err(err("split"))?;
    if (me == 0) != none.is_none() {
        return Err("split with no color gave a communicator".into());
    }
    // Ordered by key (descending world rank).
    let expected_size = (0..world.size()).filter(|r| r % 2 == me % 2).count() as u32;
    if half.size() != expected_size {
        return Err(format!(
            "half of size {}, {expected_size} expected",
            half.size()
        ));
    }
    let members: Vec<u32> = (0..half.size())
        .map(|r| half.world_rank(r).unwrap())
        .collect();
    if members.windows(2).any(|w| w[0] < w[1]) {
        return Err(format!("members not ordered by key: {members:?}"));
    }
    // A ring in each communicator: the same slot index, no crosstalk.
    for comm in [&half, &dup] {
        let (r, s) = (comm.rank(), comm.size());
        let to = (r + 1) % s;
        let from = (r + s - 1) % s;
        let tag = u64::from(comm.world_rank(r).unwrap()) + 1000 * u64::from(s);
        let mut recv = comm.irecv(from, 4, vec![0u8; 1000]).map_err(err("irecv"))?;
        comm.send(to, 4, &message(me, comm.world_rank(to).unwrap(), tag, 1000))
            .map_err(err("send"))?;
        let _ = recv.test();
        let (got, _) = recv.wait().map_err(err("recv"))?;
        let sender = comm.world_rank(from).unwrap();
        let sender_tag = u64::from(sender) + 1000 * u64::from(s);
        tally.checked += check(&got, sender, me, sender_tag, "ring")?;
    }
    Ok(tally)
}

/// Sizes of the any-source scenario's messages: empty, inline, past the
/// inline limit, exactly an entry's body, one byte past it (rendezvous),
/// and large.
fn any_sizes() -> [usize; 9] {
    let eager = pindown_messaging::layout::ANY_EAGER_BYTES as usize;
    let inline = pindown_uapi::queue::MAX_INLINE as usize - 8;
    [0, 1, inline, inline + 1, eager, eager + 1, 4096, 1 << 20, 3]
}

/// Tags of the any-source scenario's first phase.
const ANY_TAGS: u64 = 4;
use pindown_messaging::layout::ANY_ENTRIES;
/// Bytes after a truncating receive's buffer that must stay untouched.
const GUARD: u8 = 0xee;

/// Receives one any-source message and checks it against what its sender
/// sent as its `n`th of the phase (`next[source][tag]`, stepping by
/// `step`), `len_of(n)` bytes of `message(source, 0, base + n, ..)`.
#[allow(clippy::too_many_arguments)]
fn recv_any_checked(
    world: &Communicator<'_>,
    source: Option<u32>,
    tag: Option<u32>,
    buffer: &mut [u8],
    next: &mut [Vec<u64>],
    tag_base: u32,
    step: u64,
    base: u64,
    len_of: &dyn Fn(u64) -> usize,
) -> Result<(u32, u64), String> {
    let got = world
        .recv_any(source, tag, buffer)
        .map_err(err("recv_any"))?;
    if source.is_some_and(|s| s != got.source) || tag.is_some_and(|t| t != got.tag) {
        return Err(format!(
            "recv_any({source:?}, {tag:?}) took a message from {} with tag {}",
            got.source, got.tag
        ));
    }
    let slot = got
        .tag
        .checked_sub(tag_base)
        .and_then(|t| next[got.source as usize].get_mut(t as usize))
        .ok_or_else(|| format!("unexpected tag {} from {}", got.tag, got.source))?;
    let n = *slot;
    *slot += step;
    let len = len_of(n);
    if got.len != len as u64 {
        return Err(format!(
            "message {n} from {} (tag {}): {} bytes, {len} sent (out of order?)",
            got.source, got.tag, got.len
        ));
    }
    let what = format!("any-source message {n} from {}", got.source);
    let checked = check(&buffer[..len], got.source, 0, base + n, &what)?;
    Ok((got.source, checked + 1))
}

fn any_source(world: &Communicator<'_>) -> Outcome {
    let mut tally = Tally::default();
    let (me, size) = (world.rank(), world.size());
    if size < 2 {
        return Ok(tally);
    }
    let sizes = any_sizes();
    let per_sender = 3 * sizes.len() as u64;
    let phase1_len = |n: u64| sizes[(n % sizes.len() as u64) as usize];
    // Phase 2: eager messages only (a blocking rendezvous send would wait
    // for a receive the filters put off), tags 10 and 11.
    let eager = pindown_messaging::layout::ANY_EAGER_BYTES;
    let phase2 = 20u64;
    let phase2_len = |n: u64| (1 + (n * 37 + 5) % eager) as usize;
    let last = size - 1;
    let other = world.dup().map_err(err("dup"))?;
    if me != 0 {
        for n in 0..per_sender {
            let data = message(me, 0, n, phase1_len(n));
            world
                .send_any(0, (n % ANY_TAGS) as u32, &data)
                .map_err(err("send_any"))?;
            tally.checked += data.len() as u64 + 1;
        }
        barrier(world).map_err(err("barrier"))?;
        for n in 0..phase2 {
            let data = message(me, 0, 1000 + n, phase2_len(n));
            world
                .send_any(0, 10 + (n % 2) as u32, &data)
                .map_err(err("send_any phase 2"))?;
            tally.checked += data.len() as u64 + 1;
        }
        barrier(world).map_err(err("barrier"))?;
        if me == 1 {
            for (tag, len) in [(20u32, 100usize), (21, 8192), (22, 40)] {
                let data = message(me, 0, 2000 + u64::from(tag), len);
                world
                    .send_any(0, tag, &data)
                    .map_err(err("send_any truncation"))?;
                tally.checked += data.len() as u64 + 1;
            }
            // Domains and communicators apart: the same tag on a
            // zero-copy slot, on another communicator, then here.
            let zero_copy = message(me, 0, 3000, 64);
            world.send(0, 5, &zero_copy).map_err(err("send"))?;
            let elsewhere = message(me, 0, 3001, 64);
            other
                .send_any(0, 5, &elsewhere)
                .map_err(err("send_any on a dup"))?;
            let here = message(me, 0, 3002, 64);
            world.send_any(0, 5, &here).map_err(err("send_any"))?;
            tally.checked += 3 * 65;
        }
        // Fairness: every sender's ring full before rank 0 receives.
        barrier(world).map_err(err("barrier"))?;
        for n in 0..ANY_ENTRIES {
            let data = message(me, 0, 4000 + n, 32);
            world
                .send_any(0, 50, &data)
                .map_err(err("send_any fairness"))?;
            tally.checked += 33;
        }
        barrier(world).map_err(err("barrier"))?;
        return Ok(tally);
    }
    // The zero-copy receive of the domains-apart check, posted early so
    // that its send finds it (a send that waits spools and goes out
    // later, which is not what this scenario checks).
    let zero_copy = world.irecv(1, 5, vec![0u8; 64]).map_err(err("irecv"))?;
    // Rank 0. Phase 1: everything with no filter, under contention from
    // every other rank.
    let mut buffer = vec![0u8; (1 << 20) + 64];
    let mut next: Vec<Vec<u64>> = (0..size).map(|_| (0..ANY_TAGS).collect()).collect();
    let (mut run, mut longest, mut previous) = (0u64, 0u64, u32::MAX);
    for _ in 0..per_sender * u64::from(size - 1) {
        let (source, checked) = recv_any_checked(
            world,
            None,
            None,
            &mut buffer,
            &mut next,
            0,
            ANY_TAGS,
            0,
            &phase1_len,
        )?;
        tally.checked += checked;
        run = if source == previous { run + 1 } else { 1 };
        previous = source;
        longest = longest.max(run);
    }
    for source in 1..size {
        for tag in 0..ANY_TAGS {
            let expected = (per_sender - tag).div_ceil(ANY_TAGS) * ANY_TAGS + tag;
            if next[source as usize][tag as usize] != expected {
                return Err(format!(
                    "from {source} tag {tag}: not every message arrived"
                ));
            }
        }
    }
    tally
        .notes
        .push(format!("phase 1: longest run from one sender {longest}"));
    barrier(world).map_err(err("barrier"))?;
    // Phase 2: filters. The last rank's tag 11 first, then tag 10 from
    // anyone, then the rest.
    let mut next: Vec<Vec<u64>> = (0..size).map(|_| vec![0, 1]).collect();
    let status = loop {
        if let Some(status) = world
            .probe_any(Some(last), Some(11))
            .map_err(err("probe_any"))?
        {
            break status;
        }
    };
    if (status.source, status.tag, status.len) != (last, 11, phase2_len(1) as u64) {
        return Err(format!("probe_any found {status:?}"));
    }
    tally.checked += 1;
    let each_tag = phase2 / 2;
    let rounds = [
        (Some(last), Some(11), each_tag),
        (None, Some(10), each_tag * u64::from(size - 1)),
        (None, None, each_tag * u64::from(size - 2)),
    ];
    for (source, tag, count) in rounds {
        for _ in 0..count {
            let (_, checked) = recv_any_checked(
                world,
                source,
                tag,
                &mut buffer,
                &mut next,
                10,
                2,
                1000,
                &phase2_len,
            )?;
            tally.checked += checked;
        }
    }
    if world
        .probe_any(None, None)
        .map_err(err("probe_any"))?
        .is_some()
    {
        return Err("a message left over after phase 2".into());
    }
    barrier(world).map_err(err("barrier"))?;
    // Phase 3: truncation (eager and rendezvous), then a message that fits.
    for (tag, len, capacity) in [(20u32, 100usize, 64usize), (21, 8192, 4000)] {
        let mut buffer = vec![GUARD; capacity + 64];
        match world.recv_any(Some(1), Some(tag), &mut buffer[..capacity]) {
            Err(Error::Truncated {
                message,
                capacity: c,
            }) if message == len as u64 && c == capacity as u64 => {}
            other => return Err(format!("truncating receive of tag {tag}: {other:?}")),
        }
        let what = format!("truncated tag {tag}");
        tally.checked += check(&buffer[..capacity], 1, 0, 2000 + u64::from(tag), &what)?;
        if let Some(i) = buffer[capacity..].iter().position(|&b| b != GUARD) {
            return Err(format!(
                "{what}: byte {} past the buffer written",
                capacity + i
            ));
        }
        tally.checked += 64;
    }
    let mut exact = vec![0u8; 40];
    let got = world
        .recv_any(Some(1), None, &mut exact)
        .map_err(err("recv_any after truncation"))?;
    if (got.source, got.tag, got.len) != (1, 22, 40) {
        return Err(format!("after truncation: {got:?}"));
    }
    tally.checked += check(&exact, 1, 0, 2022, "after truncation")?;
    // Each message where it was sent: the world's any-source domain takes
    // neither the zero-copy message nor the dup's.
    let mut got = vec![0u8; 64];
    let here = world
        .recv_any(None, None, &mut got)
        .map_err(err("recv_any apart"))?;
    if (here.source, here.tag, here.len) != (1, 5, 64) {
        return Err(format!("apart: {here:?}"));
    }
    tally.checked += check(&got, 1, 0, 3002, "any-source apart")?;
    let elsewhere = other
        .recv_any(Some(1), Some(5), &mut got)
        .map_err(err("recv_any on a dup"))?;
    if (elsewhere.source, elsewhere.tag, elsewhere.len) != (1, 5, 64) {
        return Err(format!("on a dup: {elsewhere:?}"));
    }
    tally.checked += check(&got, 1, 0, 3001, "any-source on a dup")?;
    let (got, received) = zero_copy.wait().map_err(err("recv apart"))?;
    tally.checked += check(&got[..received.len as usize], 1, 0, 3000, "zero copy apart")?;
    // To itself (eager only: a rendezvous send to itself would wait for
    // its own receive).
    let to_self = [40usize, eager as usize];
    for (n, &len) in to_self.iter().enumerate() {
        let data = message(0, 0, 5000 + n as u64, len);
        world
            .send_any(0, 60, &data)
            .map_err(err("send_any to self"))?;
    }
    for (n, &len) in to_self.iter().enumerate() {
        let got = world
            .recv_any(Some(0), Some(60), &mut buffer)
            .map_err(err("recv_any from self"))?;
        if (got.source, got.len) != (0, len as u64) {
            return Err(format!("to itself: {got:?}, {len} bytes sent"));
        }
        tally.checked += check(&buffer[..len], 0, 0, 5000 + n as u64, "to itself")?;
    }
    // Nonblocking receives match in the order they were posted; one
    // dropped unmatched loses no message.
    let first = world
        .irecv_any(Some(0), Some(61), vec![0u8; 64])
        .map_err(err("irecv_any"))?;
    let mut second = world
        .irecv_any(None, Some(61), vec![0u8; 64])
        .map_err(err("irecv_any"))?;
    if second.test().map_err(err("test"))? {
        return Err("an any-source receive completed before any send".into());
    }
    drop(
        world
            .irecv_any(Some(0), Some(62), vec![0u8; 64])
            .map_err(err("irecv_any"))?,
    );
    for (n, tag) in [(0u64, 61u32), (1, 61), (2, 62)] {
        let data = message(0, 0, 6000 + n, 20 + n as usize);
        world
            .send_any(0, tag, &data)
            .map_err(err("send_any to self"))?;
    }
    let (got, second_got) = second.wait().map_err(err("wait"))?;
    let (first_buffer, first_got) = first.wait().map_err(err("wait"))?;
    for (n, buffer, got) in [(0u64, &first_buffer, first_got), (1, &got, second_got)] {
        if (got.source, got.tag, got.len) != (0, 61, 20 + n) {
            return Err(format!("posted receive {n} got {got:?}"));
        }
        tally.checked += check(&buffer[..got.len as usize], 0, 0, 6000 + n, "irecv_any")?;
    }
    let got = world
        .recv_any(Some(0), Some(62), &mut buffer)
        .map_err(err("recv_any after a dropped irecv_any"))?;
    if got.len != 22 {
        return Err(format!("after a dropped irecv_any: {got:?}"));
    }
    tally.checked += check(&buffer[..22], 0, 0, 6002, "after a dropped irecv_any")?;
    // Fairness: with every ring full, receives from anyone go round robin:
    // each run of size - 1 receives takes one message of every sender.
    barrier(world).map_err(err("barrier"))?;
    barrier(world).map_err(err("barrier"))?;
    let mut next: Vec<Vec<u64>> = (0..size).map(|_| vec![0]).collect();
    let mut window = HashSet::new();
    for _ in 0..ANY_ENTRIES {
        window.clear();
        for _ in 1..size {
            let (source, checked) = recv_any_checked(
                world,
                None,
                None,
                &mut buffer,
                &mut next,
                50,
                1,
                4000,
                &|_| 32,
            )?;
            tally.checked += checked;
            if !window.insert(source) {
                return Err(format!(
                    "fairness: {source} served twice before every sender was: {window:?}"
                ));
            }
        }
    }
    Ok(tally)
}

/// Messages each sender of `any-flood` sends that no receive asks for
/// until later.
const FLOOD: u64 = 40;

/// Every rank but 0 sends rank 0 [`FLOOD`] any-source messages with tag 1
/// and then one with tag 2. Rank 0 posts a receive for tag 2 only and
/// progresses for a while: its unexpected queue must hold at most
/// `Config::unexpected_per_sender` messages of each sender, and the
/// senders must have been held back (their sends waiting). Then it
/// receives the tag-1 messages, each sender's in order and byte-exact,
/// and the tag-2 ones: nothing lost, the senders released.
fn any_flood(messenger: &Messenger<'_>, world: &Communicator<'_>, config: &Config) -> Outcome {
    let mut tally = Tally::default();
    let (me, size) = (world.rank(), world.size());
    let eager = pindown_messaging::layout::ANY_EAGER_BYTES;
    let len_of = |n: u64| (1 + (n * 37 + 5) % eager) as usize;
    // The flood alternates between the world and a dup: the limit holds
    // per sender and communicator, and the receives in the senders' order
    // (one communicator, then the other) never find their message held
    // behind the other communicator's.
    let dup = world.dup().map_err(err("dup"))?;
    let comms = [world, &dup];
    if me != 0 {
        for n in 0..=FLOOD {
            let data = message(me, 0, 5000 + n, len_of(n));
            let (comm, tag) = match n == FLOOD {
                true => (world, 2),
                false => (comms[n as usize % 2], 1),
            };
            comm.send_any(0, tag, &data)
                .map_err(err("send_any flood"))?;
            tally.checked += data.len() as u64 + 1;
        }
        return Ok(tally);
    }
    let cap = config.unexpected_per_sender.max(1);
    let senders = u64::from(size - 1);
    let mut waiting = world
        .irecv_any(None, Some(2), vec![0u8; eager as usize])
        .map_err(err("irecv_any"))?;
    // A receive on the dup that nothing matches: its rings drain too.
    let unmatched = dup
        .irecv_any(None, Some(3), vec![0u8; 8])
        .map_err(err("irecv_any on the dup"))?;
    let started = Instant::now();
    let mut most = pindown_messaging::AnyBacklog::default();
    while started.elapsed() < Duration::from_millis(500) {
        if waiting.test().map_err(err("test"))? {
            return Err("the tag-2 receive matched before the tag-1 flood was received".into());
        }
        let now = messenger.any_backlog();
        // At most `cap` per sender and communicator, on two.
        if now.most_from_one_sender > cap || now.messages as u64 > 2 * cap as u64 * senders {
            return Err(format!(
                "{} messages queued, at most {cap} of each of {senders} senders on each of 2 \
                 communicators allowed: {now:?}",
                now.messages
            ));
        }
        if now.messages > most.messages {
            most = now;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    drop(unmatched);
    let held = messenger.any_backlog().held_back;
    // With a cap below the flood, every sender was held back at least
    // once, and no more than the cap of each waited.
    if (cap as u64) < FLOOD && held < senders {
        return Err(format!("{held} senders held back, {senders} expected"));
    }
    tally.checked += held;
    tally
        .notes
        .push(format!("most queued: {most:?}, held back {held} times"));
    let mut buffer = vec![0u8; eager as usize];
    for source in 1..size {
        for n in 0..FLOOD {
            let got = comms[n as usize % 2]
                .recv_any(Some(source), Some(1), &mut buffer)
                .map_err(err("recv_any flood"))?;
            let len = len_of(n);
            if got.len != len as u64 {
                return Err(format!(
                    "message {n} from {source}: {} bytes, {len} sent",
                    got.len
                ));
            }
            let what = format!("flood message {n} from {source}");
            tally.checked += check(&buffer[..len], source, 0, 5000 + n, &what)? + 1;
        }
    }
    let last = |got: pindown_messaging::AnyReceived, bytes: &[u8]| -> Result<u64, String> {
        let len = len_of(FLOOD);
        if got.tag != 2 || got.len != len as u64 {
            return Err(format!(
                "last message: {got:?}, {len} bytes of tag 2 expected"
            ));
        }
        check(&bytes[..len], got.source, 0, 5000 + FLOOD, "last message")
    };
    let (bytes, got) = waiting.wait().map_err(err("wait tag 2"))?;
    tally.checked += last(got, &bytes)?;
    for _ in 2..size {
        let got = world
            .recv_any(None, Some(2), &mut buffer)
            .map_err(err("recv_any tag 2"))?;
        tally.checked += last(got, &buffer)?;
    }
    Ok(tally)
}

fn any_source_death(world: &Communicator<'_>) -> Outcome {
    let mut tally = Tally::default();
    let (me, size) = (world.rank(), world.size());
    let last = size - 1;
    if size < 2 || (me != 0 && me != 1 && me != last) {
        return Ok(tally);
    }
    let big = 1usize << 20;
    if me == 1 && me != last {
        // Sending to the rank that dies and never receives (it drains its
        // ring while its own send waits, so credits come back until it
        // dies): the sends fail once it is gone, not hang.
        let dead = world.world_rank(last).map_err(err("world rank"))?;
        let started = Instant::now();
        let mut sent = 0;
        let failure = loop {
            match world.send_any(last, 7, &message(me, last, sent, 32)) {
                Ok(()) => sent += 1,
                Err(e) => break e,
            }
            if started.elapsed() > Duration::from_secs(20) {
                return Err(format!("{sent} sends to a rank that should be dead"));
            }
        };
        if !matches!(failure, Error::PeerGone { peer, .. } if peer == dead) {
            return Err(format!("sending to a dead rank: {failure}"));
        }
        let rendezvous = world.send_any(last, 8, &message(me, last, 0, big));
        if !matches!(rendezvous, Err(Error::PeerGone { peer, .. }) if peer == dead) {
            return Err(format!("a rendezvous send to a dead rank: {rendezvous:?}"));
        }
        tally.checked += 2;
        tally
            .notes
            .push(format!("{sent} sends before the receiver died"));
        return Ok(tally);
    }
    if me == last {
        world
            .send_any(0, 1, &message(me, 0, 1, 100))
            .map_err(err("send_any"))?;
        // Die while the rendezvous send below waits for its reader.
        std::thread::spawn(|| {
            std::thread::sleep(Duration::from_millis(300));
            std::process::exit(0);
        });
        let data = message(me, 0, 2, big);
        let result = world.send_any(0, 2, &data);
        return Err(format!(
            "a rendezvous send nobody reads returned: {result:?}"
        ));
    }
    let mut buffer = vec![0u8; big];
    let got = world
        .recv_any(Some(last), Some(1), &mut buffer)
        .map_err(err("recv_any"))?;
    if (got.source, got.tag, got.len) != (last, 1, 100) {
        return Err(format!("first message: {got:?}"));
    }
    tally.checked += check(&buffer[..100], last, 0, 1, "before death")?;
    let start = Instant::now();
    let dead = world.world_rank(last).map_err(err("world rank"))?;
    let is_gone = |r: &pindown_messaging::Result<_>| matches!(r, Err(Error::PeerGone { peer, .. }) if *peer == dead);
    // Waits while the sender lives (its rendezvous entry goes to the
    // unexpected queue meanwhile), fails once it is gone.
    let never_sent = world.recv_any(Some(last), Some(99), &mut buffer);
    if !is_gone(&never_sent) {
        return Err(format!("waiting on a sender that dies: {never_sent:?}"));
    }
    let waited = start.elapsed();
    // The rendezvous message it announced cannot be read any more.
    let rendezvous = world.recv_any(Some(last), Some(2), &mut buffer);
    if !is_gone(&rendezvous) {
        return Err(format!("reading from a dead sender: {rendezvous:?}"));
    }
    let named = world.recv_any(Some(last), None, &mut buffer);
    if !is_gone(&named) {
        return Err(format!("a receive from a dead sender: {named:?}"));
    }
    tally.checked += 3;
    if size == 2 {
        let anyone = world.recv_any(None, None, &mut buffer);
        if !is_gone(&anyone) {
            return Err(format!("a receive from anyone, everyone dead: {anyone:?}"));
        }
        tally.checked += 1;
    }
    tally.notes.push(format!(
        "death noticed after {waited:?}, all errors after {:?}",
        start.elapsed()
    ));
    Ok(tally)
}

/// The byte offsets (of 8-byte elements) of the column `col` of a
/// `rows` x `row_len` row-major matrix of doubles.
fn column_offsets(rows: usize, row_len: usize, col: usize) -> Vec<usize> {
    (0..rows).map(|r| (r * row_len + col) * 8).collect()
}

/// The byte offsets of the sub-block `sub` at `start` of a C-order 3-D
/// array of doubles of `dims`.
fn block_offsets(dims: [usize; 3], sub: [usize; 3], start: [usize; 3]) -> Vec<usize> {
    let mut out = Vec::new();
    for i in 0..sub[0] {
        for j in 0..sub[1] {
            for k in 0..sub[2] {
                let (a, b, c) = (start[0] + i, start[1] + j, start[2] + k);
                out.push(((a * dims[1] + b) * dims[2] + c) * 8);
            }
        }
    }
    out
}

/// Gathers the 8-byte elements at `offsets` of `memory`.
fn gather(memory: &[u8], offsets: &[usize]) -> Vec<u8> {
    offsets
        .iter()
        .flat_map(|&o| memory[o..o + 8].to_vec())
        .collect()
}

fn typed(world: &Communicator<'_>) -> Outcome {
    use pindown_driver::datatype::{Datatype, Order};
    let mut tally = Tally::default();
    if world.size() < 2 || world.rank() > 1 {
        return Ok(tally);
    }
    let me = world.rank();
    let peer = 1 - me;
    let f64t = Datatype::f64();
    let (rows, row_len) = (300usize, 301usize);
    let column = Datatype::vector(rows as u64, 1, row_len as i64, &f64t)
        .and_then(|t| t.commit())
        .map_err(|e| e.to_string())?;
    let dims = [10usize, 12, 14];
    let (sub, start) = ([3usize, 4, 5], [2usize, 5, 7]);
    let block = Datatype::subarray(
        &dims.map(|d| d as u64),
        &sub.map(|d| d as u64),
        &start.map(|d| d as u64),
        Order::C,
        &f64t,
    )
    .and_then(|t| t.commit())
    .map_err(|e| e.to_string())?;
    let block_count = sub.iter().product::<usize>();
    // The 60 elements of the block go to a column of 60 rows.
    let short_column = Datatype::vector(block_count as u64, 1, row_len as i64, &f64t)
        .and_then(|t| t.commit())
        .map_err(|e| e.to_string())?;
    let matrix_bytes = rows * row_len * 8;
    let guard = 0x5au8;
    for round in 0..3u64 {
        let n = 100 + round;
        // 1. Column to column (both typed), 2. column to a plain receive,
        // 3. a plain send to a typed receive.
        let sender_matrix = message(0, 1, n, matrix_bytes);
        let offsets = column_offsets(rows, row_len, (round as usize * 7) % row_len);
        let col = (round as usize * 7) % row_len;
        if me == 0 {
            let shifted = &sender_matrix[col * 8..];
            world
                .send_typed(peer, 3, shifted, 1, &column)
                .map_err(err("typed send"))?;
            world
                .send_typed(peer, 4, shifted, 1, &column)
                .map_err(err("typed send to a plain receive"))?;
            world
                .send(peer, 5, &gather(&sender_matrix, &offsets))
                .map_err(err("plain send to a typed receive"))?;
        } else {
            let want = gather(&sender_matrix, &offsets);
            let mut target = vec![guard; matrix_bytes];
            let got = world
                .recv_typed(peer, 3, &mut target[col * 8..], 1, &column)
                .map_err(err("typed receive"))?;
            if got != rows * 8 || gather(&target, &offsets) != want {
                return Err(format!("round {round}: column to column arrived wrong"));
            }
            let mut inside = vec![false; matrix_bytes];
            for &o in &offsets {
                inside[o..o + 8].fill(true);
            }
            if (0..matrix_bytes).any(|i| !inside[i] && target[i] != guard) {
                return Err("a typed receive wrote outside its column".into());
            }
            tally.checked += matrix_bytes as u64;
            let mut plain = vec![0u8; rows * 8];
            let got = world
                .recv(peer, 4, &mut plain)
                .map_err(err("plain receive"))?;
            if got != rows * 8 || plain != want {
                return Err(format!("round {round}: column to plain arrived wrong"));
            }
            tally.checked += plain.len() as u64;
            let mut target = vec![guard; matrix_bytes];
            let got = world
                .recv_typed(
                    peer,
                    5,
                    &mut target[col * 8..],
                    rows as u64,
                    &f64t.commit().map_err(|e| e.to_string())?,
                )
                .map_err(err("typed receive of contiguous doubles"))?;
            if got != rows * 8 || target[col * 8..][..rows * 8] != want[..] {
                return Err(format!("round {round}: plain to typed arrived wrong"));
            }
            tally.checked += (rows * 8) as u64;
        }
        // 4. A 3-D sub-block to a column of another shape.
        let array = message(0, 1, n + 50, dims.iter().product::<usize>() * 8);
        let block_at = block_offsets(dims, sub, start);
        if me == 0 {
            world
                .send_typed(peer, 6, &array, 1, &block)
                .map_err(err("sub-block send"))?;
        } else {
            let mut target = vec![guard; block_count * row_len * 8];
            world
                .recv_typed(peer, 6, &mut target, 1, &short_column)
                .map_err(err("sub-block receive"))?;
            let column_at = column_offsets(block_count, row_len, 0);
            if gather(&target, &column_at) != gather(&array, &block_at) {
                return Err(format!("round {round}: sub-block to column arrived wrong"));
            }
            tally.checked += (block_count * 8) as u64;
        }
    }
    // 5. Too many bytes for a typed receive: an error there, nothing
    // written, and the sender completes.
    if me == 0 {
        let matrix = message(0, 1, 9, matrix_bytes);
        world
            .send_typed(peer, 7, &matrix, 1, &column)
            .map_err(err("oversized typed send"))?;
    } else {
        let mut target = vec![guard; block_count * row_len * 8];
        match world.recv_typed(peer, 7, &mut target, 1, &short_column) {
            Err(Error::Truncated { message, capacity })
                if message == (rows * 8) as u64 && capacity == (block_count * 8) as u64 => {}
            other => return Err(format!("an oversized typed message: {other:?}")),
        }
        if target.iter().any(|&b| b != guard) {
            return Err("a refused typed message wrote bytes".into());
        }
        tally.checked += target.len() as u64;
    }
    // 6. A type reaching past the buffer is refused before anything moves.
    match world.recv_typed(peer, 8, &mut [0u8; 64], 1, &column) {
        Err(Error::Mismatch(_)) => {}
        other => return Err(format!("a type past its buffer: {other:?}")),
    }
    // 7. A typed send too long for a plain receive (a small one, 40 bytes
    // of the column's 2400): the first 40 bytes fill the buffer, as a
    // contiguous send's would, nothing past it, and a truncation error.
    let matrix = message(0, 1, 11, matrix_bytes);
    if me == 0 {
        world
            .send_typed(peer, 9, &matrix, 1, &column)
            .map_err(err("typed send to a short plain receive"))?;
    } else {
        let capacity = 40;
        let mut memory = vec![guard; capacity + 64];
        match world.recv(peer, 9, &mut memory[..capacity]) {
            Err(Error::Truncated {
                message,
                capacity: c,
            }) if message == (rows * 8) as u64 && c == capacity as u64 => {}
            other => return Err(format!("a typed send into a short receive: {other:?}")),
        }
        let want = gather(&matrix, &column_offsets(rows, row_len, 0));
        if memory[..capacity] != want[..capacity] {
            return Err("a typed send into a short receive filled it wrong".into());
        }
        if memory[capacity..].iter().any(|&b| b != guard) {
            return Err("a typed send into a short receive wrote past it".into());
        }
        tally.checked += memory.len() as u64;
    }
    Ok(tally)
}

/// Every rank waits for a message nobody sends, until the device is taken
/// away (by the test): the wait must end with `PeerGone`.
fn device_death(world: &Communicator<'_>) -> Outcome {
    let mut tally = Tally::default();
    let peer = (world.rank() + 1) % world.size();
    // Set up: the test stops the device once every rank says so.
    signal(&format!("device-death-ready-{}", world.rank()))?;
    let start = Instant::now();
    let why = match world.recv(peer, 0, &mut [0u8; 8]) {
        Err(Error::PeerGone { why, .. }) => why,
        other => return Err(format!("a wait with the device gone: {other:?}")),
    };
    tally.checked += 1;
    tally.notes.push(format!(
        "the device's end noticed after {:?}: {why}",
        start.elapsed()
    ));
    Ok(tally)
}

fn peer_death(world: &Communicator<'_>) -> Outcome {
    let tally = Tally::default();
    let last = world.size() - 1;
    if world.size() < 2 {
        return Ok(tally);
    }
    if world.rank() == last {
        // Leave without a word, mid-job.
        std::process::exit(0);
    }
    let start = Instant::now();
    match world.recv(last, 0, &mut [0u8; 64]) {
        Err(Error::PeerGone { peer, .. }) if peer == world.world_rank(last).unwrap() => {}
        other => return Err(format!("a receive from a dead rank: {other:?}")),
    }
    let mut tally = tally;
    tally.checked += 1;
    tally
        .notes
        .push(format!("death noticed after {:?}", start.elapsed()));
    Ok(tally)
}

/// `forged-index` (2 ranks): rank 0 writes a done word for rank 1's
/// any-index receive from it, naming index 2^64 - 1; rank 1's receive
/// fails naming rank 0 and the index, and the ranks still exchange a
/// message afterwards.
fn forged_index(messenger: &Messenger<'_>, world: &Communicator<'_>) -> Outcome {
    let mut tally = Tally::default();
    if world.size() != 2 {
        return Err("forged-index runs on 2 ranks".into());
    }
    let layout = messenger.control_layout();
    let any_slot = layout.slot(0, 0, Config::default().slots);
    if world.rank() == 0 {
        let done = layout.done_word(any_slot);
        messenger
            .write_peer_control(1, done + 8, &u64::MAX.to_le_bytes())
            .map_err(|e| format!("forging the index word: {e}"))?;
        let word = pindown_messaging::layout::done_word(1, 4, false);
        messenger
            .write_peer_control(1, done, &word.to_le_bytes())
            .map_err(|e| format!("forging the done word: {e}"))?;
    }
    barrier(world).map_err(|e| format!("barrier after forging: {e}"))?;
    if world.rank() == 1 {
        let mut buffer = [0x5au8; 16];
        match world.recv_any_index(0, &mut buffer) {
            Err(Error::BadPeerRecord { rank: 0, why }) if why.contains("index") => {
                tally.notes.push(format!("refused: {why}"));
                tally.checked += 1;
            }
            other => {
                return Err(format!(
                    "an any-index receive with a forged index: {other:?}"
                ))
            }
        }
        if buffer != [0x5a; 16] {
            return Err(format!("the refused receive's buffer changed: {buffer:?}"));
        }
        tally.checked += 1;
        let sent = message(1, 0, 0, 100);
        // Synchronous: this rank leaves with no final barrier, so the
        // message must not wait in its spool.
        messenger.set_send_timeout(None);
        world
            .send(0, 2, &sent)
            .map_err(|e| format!("a send after: {e}"))?;
    } else {
        let mut got = vec![0u8; 100];
        world
            .recv(1, 2, &mut got)
            .map_err(|e| format!("a receive after: {e}"))?;
        if got != message(1, 0, 0, 100) {
            return Err("the message after the forgery arrived changed".into());
        }
        tally.checked += 1;
    }
    Ok(tally)
}

/// Waits until rank 0 posted its first receive from this rank on world
/// slot index `index`; the key and offset its match record here names
/// (its buffer's window, or for a small receive a landing buffer of this
/// rank's block there).
fn first_receive_window(messenger: &Messenger<'_>, index: u32) -> Result<(u64, u64), String> {
    let layout = messenger.control_layout();
    let record = layout.match_record(layout.slot(0, 0, index));
    let stamp = record + pindown_messaging::layout::MATCH_STAMP_AT;
    let start = Instant::now();
    while messenger.own_control_word(stamp) != 1 {
        messenger
            .progress()
            .map_err(|e| format!("waiting for the receive: {e}"))?;
        if start.elapsed() > Duration::from_secs(10) {
            return Err("rank 0's receive never showed".into());
        }
    }
    let key = messenger.own_control_word(record);
    Ok((key, messenger.own_control_word(record + 8)))
}

/// `leaked-key` (3 ranks): rank 1 hands rank 2 the key of the window
/// rank 0 bound over rank 1's words, and the key and offset of the
/// window over the buffer of rank 0's receive from rank 1; rank 2's
/// writes through them (a done word completing that receive, bytes into
/// its buffer) are refused, and rank 0 then gets rank 1's real messages,
/// whole.
fn leaked_key(messenger: &Messenger<'_>, world: &Communicator<'_>) -> Outcome {
    let mut tally = Tally::default();
    if world.size() != 3 {
        return Err("leaked-key runs on 3 ranks".into());
    }
    // The second receive longer than a landing buffer, so that its match
    // record names a window over its own buffer.
    let (first, second) = (message(1, 0, 0, 100), message(1, 0, 1, 1024));
    let layout = messenger.control_layout();
    match world.rank() {
        1 => {
            let (key, offset) = first_receive_window(messenger, 6)?;
            let mut leak = messenger.block_key_at(0).to_le_bytes().to_vec();
            leak.extend_from_slice(&key.to_le_bytes());
            leak.extend_from_slice(&offset.to_le_bytes());
            world
                .send(2, 3, &leak)
                .map_err(|e| format!("leaking: {e}"))?;
            world
                .send(0, 5, &first)
                .map_err(|e| format!("the first send: {e}"))?;
            world
                .send(0, 6, &second)
                .map_err(|e| format!("the second send: {e}"))?;
        }
        2 => {
            let mut leak = [0u8; 24];
            world
                .recv(1, 3, &mut leak)
                .map_err(|e| format!("the leak: {e}"))?;
            let word = |i: usize| u64::from_le_bytes(leak[8 * i..8 * i + 8].try_into().unwrap());
            let done = layout.done_word(layout.slot(0, 1, 5)) - layout.block_start(1);
            let forged = pindown_messaging::layout::done_word(1, 64, false);
            for (what, key, offset, bytes) in [
                ("a done word", word(0), done, forged.to_le_bytes()),
                ("receive bytes", word(1), word(2), [0xee; 8]),
            ] {
                match messenger.write_peer_window(0, key, offset, &bytes) {
                    Err(Error::Completion(err)) if err.detail == ErrorDetail::NotGranted => {
                        tally.notes.push(format!("{what} refused: {err}"));
                        tally.checked += 1;
                    }
                    other => return Err(format!("{what} through a leaked key: {other:?}")),
                }
            }
            world
                .send(0, 4, &[])
                .map_err(|e| format!("the signal: {e}"))?;
        }
        _ => {
            let pending = world
                .irecv(1, 6, vec![0u8; 1024])
                .map_err(|e| format!("posting: {e}"))?;
            world
                .recv(2, 4, &mut [])
                .map_err(|e| format!("the signal: {e}"))?;
            let mut got = vec![0u8; 128];
            let received = world
                .recv(1, 5, &mut got)
                .map_err(|e| format!("the receive: {e}"))?;
            if received != 100 || got[..100] != first[..] || got[100..] != [0; 28] {
                return Err(format!(
                    "rank 1's first message arrived as {received} bytes"
                ));
            }
            tally.checked += 1;
            let (buffer, _) = pending
                .wait()
                .map_err(|e| format!("the second receive: {e}"))?;
            if buffer[..] != second[..] {
                return Err("rank 1's second message arrived changed".into());
            }
            tally.checked += 1;
        }
    }
    Ok(tally)
}

/// `late-write` (2 ranks): rank 1 keeps the key and offset its match
/// record names for rank 0's receive and, once the receive has returned,
/// writes through them again. A 1 KiB receive's window over the buffer
/// refuses the write, the buffer unchanged; with windows cached
/// (`--window-cache N`, for trusted peers) the write lands there (the
/// limit the README states). A 64-byte receive named a landing buffer of
/// rank 1's block, which rank 1 may write whenever it likes: the buffer
/// stays unchanged whatever lands there. Checked: the buffers found
/// unchanged.
fn late_write(messenger: &Messenger<'_>, world: &Communicator<'_>) -> Outcome {
    let mut tally = Tally::default();
    if world.size() != 2 {
        return Err("late-write runs on 2 ranks".into());
    }
    // (message bytes, first slot index of the round)
    for (len, first) in [(1024usize, 2u32), (64, 6)] {
        let sent = message(1, 0, u64::from(first), len);
        if world.rank() == 1 {
            let (key, offset) = first_receive_window(messenger, first)?;
            world
                .send(0, first, &sent)
                .map_err(|e| format!("the send: {e}"))?;
            world
                .recv(0, first + 1, &mut [])
                .map_err(|e| format!("the signal: {e}"))?;
            let outcome = messenger.write_peer_window(0, key, offset, &[0xee; 8]);
            let landed = match outcome {
                Ok(()) => true,
                Err(Error::Completion(err)) if err.detail == ErrorDetail::NotGranted => false,
                Err(other) => return Err(format!("the late write: {other}")),
            };
            tally
                .notes
                .push(format!("{len} B: late write landed: {landed}"));
            // Told by the index alone: a receive with a buffer would take
            // a window, and that could evict the one written through.
            world
                .send(0, first + 2 + u32::from(landed), &[])
                .map_err(|e| format!("the report: {e}"))?;
            continue;
        }
        let mut buffer = vec![0u8; len];
        world
            .recv(1, first, &mut buffer)
            .map_err(|e| format!("the receive: {e}"))?;
        if buffer != sent {
            return Err(format!("the {len}-byte message arrived changed"));
        }
        world
            .send(1, first + 1, &[])
            .map_err(|e| format!("the signal: {e}"))?;
        let report = world
            .recv_any_index(1, &mut [])
            .map_err(|e| format!("the report: {e}"))?;
        let landed = report.index == first + 3;
        // The device, not this program, may have written the buffer since.
        let now: Vec<u8> = (0..buffer.len())
            // SAFETY: `i` is inside `buffer`, which this function owns.
            .map(|i| unsafe { std::ptr::read_volatile(buffer.as_ptr().add(i)) })
            .collect();
        let changed = now != sent;
        // Only a window over the buffer lets a late write change it; a
        // small receive names a landing buffer of the sender's own block,
        // which takes the write.
        let through_window = len as u64 > pindown_messaging::layout::LANDING_BYTES;
        if !through_window && !landed {
            return Err(format!(
                "{len} B: the late write was refused: the receive took a window, not a \
                 landing buffer"
            ));
        }
        if changed != (landed && through_window) {
            return Err(format!(
                "{len} B: the late write landed: {landed}, the buffer changed: {changed}"
            ));
        }
        tally.notes.push(format!(
            "{len} B: late write landed: {landed}, buffer changed: {changed}"
        ));
        if !changed {
            tally.checked += 1;
        }
    }
    Ok(tally)
}

/// `forged-epoch` (2 ranks): rank 1 writes epoch 2^64 - 1 into every
/// barrier and reduction flag word it sets in the world's collectives at
/// rank 0,
/// then tells it so; rank 0's barrier and small allreduce fail naming
/// rank 1, rather than passing without it.
fn forged_epoch(messenger: &Messenger<'_>, world: &Communicator<'_>) -> Outcome {
    let mut tally = Tally::default();
    if world.size() != 2 {
        return Err("forged-epoch runs on 2 ranks".into());
    }
    // The world is context 0; its collectives use context 1.
    let (layout, collective) = (messenger.control_layout(), 1);
    if world.rank() == 1 {
        let forged = u64::MAX.to_le_bytes();
        for word in layout.collective_flag_words(collective, 1) {
            messenger
                .write_peer_control(0, word, &forged)
                .map_err(|e| format!("forging a flag word: {e}"))?;
        }
        // Synchronous, as this rank leaves with no final barrier.
        messenger.set_send_timeout(None);
        world
            .send(0, 1, &[])
            .map_err(|e| format!("the signal: {e}"))?;
        return Ok(tally);
    }
    world
        .recv(1, 1, &mut [])
        .map_err(|e| format!("the signal: {e}"))?;
    let refused = |what: &str, result: pindown_messaging::Result<()>| match result {
        Err(Error::BadPeerRecord { rank: 1, why }) if why.contains("epoch") => Ok(why),
        other => Err(format!("{what} after forged epochs: {other:?}")),
    };
    let why = refused("a barrier", world.barrier())?;
    tally.notes.push(format!("barrier refused: {why}"));
    tally.checked += 1;
    // The refusal stopped the world's collectives: the allreduce is
    // refused at once, for the barrier's reason.
    let mut sum = [0u64];
    let why = match world.allreduce(&[1u64], &mut sum, pindown_messaging::Op::Sum) {
        Err(Error::CommunicatorBroken(why)) if why.contains("rank 1") && why.contains("epoch") => {
            why
        }
        other => return Err(format!("an allreduce after forged epochs: {other:?}")),
    };
    tally.notes.push(format!("allreduce refused: {why}"));
    tally.checked += 1;
    Ok(tally)
}

/// `outsider-collective` (3 ranks): ranks 0 and 1 split off a
/// communicator of their own; rank 2, outside it, writes epoch 2^64 - 1
/// into every collective flag word it can reach at ranks 0 and 1 (its own
/// section of every context, the new communicator's included), fills its
/// data areas with garbage, and tries to reach rank 1's section at rank 0
/// (no window of rank 0 open to rank 2 covers it). Ranks 0 and 1 then run
/// barriers of both algorithms and small allreduces on their
/// communicator: all pass, with exact sums.
fn outsider_collective(messenger: &Messenger<'_>, world: &Communicator<'_>) -> Outcome {
    let mut tally = Tally::default();
    if world.size() != 3 {
        return Err("outsider-collective runs on 3 ranks".into());
    }
    let me = world.rank();
    let pair = world
        .split((me < 2).then_some(0), me)
        .map_err(err("split"))?;
    let layout = messenger.control_layout();
    // Synchronous signals: no rank leaves with its message spooled.
    messenger.set_send_timeout(None);
    if me == 2 {
        let forged = u64::MAX.to_le_bytes();
        let garbage = [0xa5u8; 64];
        for victim in 0..2 {
            for context in 0..layout.contexts {
                for word in layout.collective_flag_words(context, 2) {
                    messenger
                        .write_peer_control(victim, word, &forged)
                        .map_err(|e| format!("forging its own flag word: {e}"))?;
                }
                for parity in 0..2 {
                    let data = layout.step_data(context, 2, parity);
                    messenger
                        .write_peer_control(victim, data, &garbage)
                        .map_err(|e| format!("forging its own step data: {e}"))?;
                }
            }
        }
        tally.checked += 1;
        for context in 0..layout.contexts {
            match messenger.write_peer_control(0, layout.barrier_word(context, 1), &forged) {
                Err(Error::Unsuitable(why)) if why.contains("no window") => {}
                other => return Err(format!("rank 1's flag word at rank 0: {other:?}")),
            }
        }
        tally.checked += 1;
        for victim in 0..2 {
            world
                .send(victim, 1, &[])
                .map_err(|e| format!("the signal: {e}"))?;
        }
        return Ok(tally);
    }
    world
        .recv(2, 1, &mut [])
        .map_err(|e| format!("the signal: {e}"))?;
    let pair = pair.ok_or("ranks 0 and 1 got no communicator")?;
    for round in 0..20u64 {
        pair.barrier_with(BarrierAlgorithm::Dissemination)
            .map_err(err("dissemination barrier"))?;
        pair.barrier_with(BarrierAlgorithm::BinaryTree)
            .map_err(err("tree barrier"))?;
        let mine = [u64::from(me) * 1000 + round, round];
        let mut sum = [0u64; 2];
        pair.allreduce(&mine, &mut sum, pindown_messaging::Op::Sum)
            .map_err(err("allreduce"))?;
        let expected = [1000 + 2 * round, 2 * round];
        if sum != expected {
            return Err(format!("allreduce {round}: {sum:?}, not {expected:?}"));
        }
        tally.checked += 1;
    }
    Ok(tally)
}

/// The `collectives` scenario.
mod collectives {
    use std::cmp::Ordering;

    use pindown_messaging::{
        BarrierAlgorithm, BroadcastAlgorithm, Communicator, Config, Element, Error, Op,
        ReduceAlgorithm,
    };

    use super::{err, Outcome, Tally};

    /// splitmix64: the same stream on every rank for the same seed.
    struct Random(u64);

    impl Random {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }

        fn below(&mut self, n: u64) -> u64 {
            self.next() % n.max(1)
        }

        /// A length of 0 to `max`: the edges often, else log-uniform.
        fn length(&mut self, max: u64) -> u64 {
            match self.below(8) {
                0 => 0,
                1 => max,
                2 => self.below(16),
                _ => {
                    let bits = self.below(u64::from(64 - max.leading_zeros()) + 1);
                    (self.below(1 << bits) + 1).min(max)
                }
            }
        }
    }

    fn flag(args: &[String], name: &str, default: u64) -> u64 {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    }

    /// Nanoseconds of the system-wide monotonic clock (the same on every
    /// rank of this machine).
    fn now_ns() -> u64 {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime writes the timespec it is given, which
        // lives on this stack frame.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
        ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
    }

    /// Element types as the test makes and checks them: values that sum
    /// exactly, and the reference operations written out here.
    trait TestElement: Element {
        const NAME: &'static str;
        fn make(bits: u64) -> Self;
        /// A user operation (associative and commutative), differing
        /// from the built-in ones.
        fn user(a: Self, b: Self) -> Self;
        /// Compares absolute values, written out independently.
        fn compare_magnitudes(self, other: Self) -> Ordering;
        fn same(self, other: Self) -> bool;
    }

    macro_rules! test_float {
        ($t:ty) => {
            impl TestElement for $t {
                const NAME: &'static str = stringify!($t);
                fn make(bits: u64) -> Self {
                    // Halves from -1000 to 1000: sums of 8 are exact.
                    ((bits % 4001) as i64 - 2000) as $t * 0.5
                }
                fn user(a: Self, b: Self) -> Self {
                    // The larger of the two, both rounded down.
                    a.floor().max(b.floor())
                }
                fn compare_magnitudes(self, other: Self) -> Ordering {
                    f64::total_cmp(&f64::from(self).abs(), &f64::from(other).abs())
                }
                fn same(self, other: Self) -> bool {
                    self.to_bits() == other.to_bits()
                }
            }
        };
    }
    macro_rules! test_int {
        ($t:ty, $signed:expr) => {
            impl TestElement for $t {
                const NAME: &'static str = stringify!($t);
                fn make(bits: u64) -> Self {
                    if bits % 7 == 0 {
                        // Extremes: wrapping sums, magnitudes beyond i32.
                        [<$t>::MIN, <$t>::MAX][(bits >> 8) as usize % 2]
                    } else if $signed {
                        ((bits % 2001) as i64 - 1000) as $t
                    } else {
                        (bits % 2001) as $t
                    }
                }
                fn user(a: Self, b: Self) -> Self {
                    a ^ b
                }
                fn compare_magnitudes(self, other: Self) -> Ordering {
                    (self as i128)
                        .unsigned_abs()
                        .cmp(&(other as i128).unsigned_abs())
                }
                fn same(self, other: Self) -> bool {
                    self == other
                }
            }
        };
    }
    test_float!(f64);
    test_float!(f32);
    test_int!(i64, true);
    test_int!(i32, true);
    test_int!(u64, false);
    test_int!(u32, false);

    #[derive(Clone, Copy, Debug)]
    enum Which {
        Sum,
        Min,
        Max,
        MaxAbs,
        MinAbs,
        User,
    }

    const WHICH: [Which; 6] = [
        Which::Sum,
        Which::Min,
        Which::Max,
        Which::MaxAbs,
        Which::MinAbs,
        Which::User,
    ];

    /// The reference: `a` combined with `b` as the operation is defined
    /// (min and max in total order; of equal magnitudes, the greater).
    fn reference<T: TestElement>(which: Which, a: T, b: T) -> T {
        let greater = |x: T, y: T| {
            if y.total_cmp(x) == Ordering::Greater {
                y
            } else {
                x
            }
        };
        match which {
            Which::Sum => a.sum(b),
            Which::Min => {
                if b.total_cmp(a) == Ordering::Less {
                    b
                } else {
                    a
                }
            }
            Which::Max => greater(a, b),
            Which::MaxAbs | Which::MinAbs => {
                let wanted = if matches!(which, Which::MaxAbs) {
                    Ordering::Greater
                } else {
                    Ordering::Less
                };
                match b.compare_magnitudes(a) {
                    Ordering::Equal => greater(a, b),
                    order if order == wanted => b,
                    _ => a,
                }
            }
            Which::User => T::user(a, b),
        }
    }

    /// Member `rank`'s contribution to case `case` (from its world rank).
    fn contribution<T: TestElement>(seed: u64, case: u64, world_rank: u32, count: usize) -> Vec<T> {
        let mut random = Random(seed ^ case << 20 ^ u64::from(world_rank) << 52);
        (0..count).map(|_| T::make(random.next())).collect()
    }

    struct Case<'a, 'c> {
        comm: &'a Communicator<'c>,
        seed: u64,
        case: u64,
    }

    fn reduction<T: TestElement>(
        case: &Case<'_, '_>,
        random: &mut Random,
        algorithm: ReduceAlgorithm,
        all: bool,
    ) -> Result<u64, String> {
        let comm = case.comm;
        let max_bytes = if algorithm == ReduceAlgorithm::FlagWords {
            256
        } else {
            4 << 20
        };
        let count = random.length(max_bytes / std::mem::size_of::<T>() as u64) as usize;
        let which = WHICH[random.below(6) as usize];
        let root = random.below(u64::from(comm.size())) as u32;
        let user = |acc: &mut [T], incoming: &[T]| {
            acc.iter_mut()
                .zip(incoming)
                .for_each(|(a, &b)| *a = T::user(*a, b))
        };
        let op = match which {
            Which::Sum => Op::Sum,
            Which::Min => Op::Min,
            Which::Max => Op::Max,
            Which::MaxAbs => Op::MaxAbs,
            Which::MinAbs => Op::MinAbs,
            Which::User => Op::User(&user),
        };
        let members: Vec<u32> = (0..comm.size())
            .map(|r| comm.world_rank(r).unwrap())
            .collect();
        let mine = contribution::<T>(case.seed, case.case, members[comm.rank() as usize], count);
        let mut expected = contribution::<T>(case.seed, case.case, members[0], count);
        for &member in &members[1..] {
            let theirs = contribution::<T>(case.seed, case.case, member, count);
            for (e, t) in expected.iter_mut().zip(theirs) {
                *e = reference(which, *e, t);
            }
        }
        let poison = T::make(0x5555);
        let mut got = vec![poison; count];
        let what = format!(
            "case {} {} of {count} {} {which:?} by {algorithm:?} (root {root})",
            case.case,
            if all { "allreduce" } else { "reduce" },
            T::NAME
        );
        if std::env::var_os("MSG_CHECK_TRACE").is_some() {
            eprintln!("rank {}: {what}", comm.rank());
        }
        if all {
            comm.allreduce_with(&mine, &mut got, op, algorithm)
        } else {
            comm.reduce_with(root, &mine, &mut got, op, algorithm)
        }
        .map_err(|e| format!("{what}: {e}"))?;
        let check_here = all || comm.rank() == root;
        let want: &[T] = if check_here {
            &expected
        } else {
            &vec![poison; count]
        };
        if let Some(i) = (0..count).find(|&i| !got[i].same(want[i])) {
            return Err(format!(
                "{what}: element {i} is {:?}, {:?} expected",
                got[i], want[i]
            ));
        }
        Ok(count as u64)
    }

    fn reduction_any(
        case: &Case<'_, '_>,
        random: &mut Random,
        algorithm: ReduceAlgorithm,
        all: bool,
    ) -> Result<u64, String> {
        match random.below(6) {
            0 => reduction::<f64>(case, random, algorithm, all),
            1 => reduction::<f32>(case, random, algorithm, all),
            2 => reduction::<i64>(case, random, algorithm, all),
            3 => reduction::<i32>(case, random, algorithm, all),
            4 => reduction::<u64>(case, random, algorithm, all),
            _ => reduction::<u32>(case, random, algorithm, all),
        }
    }

    fn broadcast(
        case: &Case<'_, '_>,
        random: &mut Random,
        algorithm: BroadcastAlgorithm,
    ) -> Result<u64, String> {
        let comm = case.comm;
        let len = random.length(4 << 20) as usize;
        let root = random.below(u64::from(comm.size())) as u32;
        let world_root = comm.world_rank(root).unwrap();
        let bytes = |len| -> Vec<u8> {
            let mut r = Random(case.seed ^ case.case << 24 ^ 0xb7);
            (0..len).map(|_| r.next() as u8).collect()
        };
        let expected = bytes(len);
        let mut buffer = if comm.rank() == root {
            expected.clone()
        } else {
            vec![0xa5; len]
        };
        comm.broadcast_with(root, &mut buffer, algorithm)
            .map_err(|e| {
                format!(
                    "case {} broadcast of {len} from {world_root} by {algorithm:?}: {e}",
                    case.case
                )
            })?;
        match (0..len).find(|&i| buffer[i] != expected[i]) {
            None => Ok(len as u64),
            Some(i) => Err(format!(
                "case {} broadcast of {len} from {world_root} by {algorithm:?}: byte {i} differs",
                case.case
            )),
        }
    }

    /// Barriers: no rank leaves before the last one arrived (arrival
    /// times after random delays, gathered with an allreduce of maxima).
    fn barrier(
        case: &Case<'_, '_>,
        random: &mut Random,
        algorithm: BarrierAlgorithm,
    ) -> Result<u64, String> {
        let comm = case.comm;
        let delays: Vec<u64> = (0..comm.size()).map(|_| random.below(1500)).collect();
        std::thread::sleep(std::time::Duration::from_micros(
            delays[comm.rank() as usize],
        ));
        let arrived = now_ns();
        comm.barrier_with(algorithm)
            .map_err(|e| format!("case {} barrier by {algorithm:?}: {e}", case.case))?;
        let left = now_ns();
        let mut last_arrival = [0u64];
        comm.allreduce(&[arrived], &mut last_arrival, Op::Max)
            .map_err(err("allreduce of arrival times"))?;
        if left < last_arrival[0] {
            return Err(format!(
                "case {} barrier by {algorithm:?}: left {} ns before the last rank arrived",
                case.case,
                last_arrival[0] - left
            ));
        }
        Ok(1)
    }

    /// The calls' own checks: wrong lengths, roots and algorithms.
    fn errors(comm: &Communicator<'_>) -> Result<u64, String> {
        let mut checked = 0;
        match comm.allreduce(&[1u32, 2], &mut [0u32; 3], Op::Sum) {
            Err(Error::Mismatch(_)) => checked += 1,
            other => return Err(format!("allreduce into a longer buffer: {other:?}")),
        }
        match comm.broadcast(comm.size(), &mut [0u8; 4]) {
            Err(Error::NoSuchRank { rank, size }) if rank == size => checked += 1,
            other => return Err(format!("broadcast from beyond the communicator: {other:?}")),
        }
        if comm.size() > 1 {
            match comm.allreduce_with(
                &[0u64; 33],
                &mut [0u64; 33],
                Op::Sum,
                ReduceAlgorithm::FlagWords,
            ) {
                Err(Error::Unsuitable(_)) => checked += 1,
                other => return Err(format!("264 bytes on the flag words: {other:?}")),
            }
        }
        Ok(checked)
    }

    /// Ranks 0 and 1 disagree about a broadcast's length: the receiver
    /// says so. Its call failed once begun, so the pair's next collective
    /// fails on both (at once on rank 1; on rank 0 from rank 1's record of
    /// the call), point-to-point on the pair still works, and so do the
    /// collectives of another communicator of the two. With `verify`
    /// (`Config::verify_collectives`), rank 0's part, though it
    /// completed, fails too, and so its next call at once.
    fn length_mismatch(world: &Communicator<'_>, verify: bool) -> Result<u64, String> {
        let me = world.rank();
        // Every rank takes part in both splits of the world; ranks 0 and 1
        // get communicators of the two.
        let pair = world
            .split((me < 2).then_some(0), me)
            .map_err(err("split"))?;
        let again = world
            .split((me < 2).then_some(0), me)
            .map_err(err("second split"))?;
        let (Some(pair), Some(again)) = (pair, again) else {
            return Ok(0);
        };
        if pair.size() < 2 {
            return Ok(0);
        }
        let mut buffer = vec![1u8; if me == 0 { 16 } else { 8 }];
        let outcome = pair.broadcast_with(0, &mut buffer, BroadcastAlgorithm::BinomialTree);
        match (me, verify, outcome) {
            (0, false, Ok(())) | (1, _, Err(Error::Mismatch(_))) => {}
            (0, true, Err(Error::Mismatch(_) | Error::MemberFailed { rank: 1, call: 1 })) => {}
            (_, _, other) => return Err(format!("broadcast of 16 bytes into 8: {other:?}")),
        }
        let mut sum = [0u32];
        match (me, verify, pair.allreduce(&[me + 1], &mut sum, Op::Sum)) {
            (0, false, Err(Error::MemberFailed { rank: 1, call: 1 }))
            | (0, true, Err(Error::CommunicatorBroken(_)))
            | (1, _, Err(Error::CommunicatorBroken(_))) => {}
            (_, _, other) => return Err(format!("allreduce after a mismatch: {other:?}")),
        }
        // Point-to-point on the pair still works.
        let mut got = [0u8; 4];
        if me == 0 {
            pair.send(1, 3, &[9; 4])
                .map_err(err("send after a mismatch"))?;
        } else {
            pair.recv(0, 3, &mut got)
                .map_err(err("recv after a mismatch"))?;
            if got != [9; 4] {
                return Err(format!("message after a mismatch: {got:?}"));
            }
        }
        // Another communicator of the two still runs collectives.
        pair.allreduce(&[me + 1], &mut sum, Op::Sum)
            .map_or(Ok(()), |()| Err("the broken pair's allreduce passed"))?;
        again
            .allreduce(&[me + 1], &mut sum, Op::Sum)
            .map_err(err("allreduce on another communicator"))?;
        if sum[0] != 3 {
            return Err(format!(
                "sum of 1 and 2 on another communicator: {}",
                sum[0]
            ));
        }
        Ok(4)
    }

    /// Fails the run if this rank still waits after `seconds` (a hang
    /// becomes a failure line instead of a run that never ends).
    fn watchdog(rank: u32, scenario: &'static str, seconds: u64) {
        std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_secs(seconds));
            println!(
                "{{\"rank\":{rank},\"scenario\":\"{scenario}\",\"ok\":false,\"error\":\"still waiting after {seconds} s\"}}"
            );
            std::process::exit(1);
        });
    }

    /// `collective-give-up` (4 ranks): members that give a call up or
    /// refuse it release those that wait in it, and nothing lands in a
    /// buffer after its call returned. (1) Ranks 0-2 broadcast 32 bytes
    /// from rank 0, which comes once rank 3 (child of rank 2, giving 64)
    /// has failed from rank 2's record; rank 3's buffer stays as it was
    /// after rank 2 forwards, and rank 2's write, refused, is reported
    /// as rank 3's giving up. (2) Ranks 0 and 1 disagree
    /// about a broadcast's length: rank 1 fails, makes no next call on
    /// the pair, and rank 0's next call there fails instead of waiting.
    /// (3) Rank 0 names flag words for 33 doubles (refused before the
    /// call), rank 1 for 32: rank 1 fails instead of waiting. (4) On ranks
    /// 0-2, rank 1 broadcasts as the root of a call where ranks 0 and 2
    /// take rank 0 for it; rank 2's part passes, and its next broadcast
    /// (from rank 1) must not take rank 1's send left over from the first:
    /// it fails. (5) A member that gave a call up and made more calls
    /// since still releases the member waiting on it in that call. (6)
    /// So does a rank that refused a call and refused two more since.
    /// (7) On a pair, a member takes part in a call in the middle of a
    /// peer's run of refusals: it learns it from the run. (3) and (7)
    /// also check the refusing rank's next call: it waits until the
    /// member that took part is done with the refused call, and fails,
    /// instead of meeting that member's words or sends. (8) A member
    /// that comes late to a call the others already failed over a
    /// refusal still learns it. (9) Communicators whose last call every
    /// member refused give their contexts back when dropped.
    pub(super) fn give_up(world: &Communicator<'_>) -> Outcome {
        if world.size() != 4 {
            return Err("collective-give-up runs on 4 ranks".into());
        }
        let me = world.rank();
        watchdog(me, "collective-give-up", 180);
        let mut tally = Tally::default();
        // (1)
        let dup = world.dup().map_err(err("dup"))?;
        // Rank 0 comes once rank 3 has failed (told point to point).
        const FAILED_NOTICE: u32 = 5;
        if me == 0 {
            world
                .recv(3, FAILED_NOTICE, &mut [0u8; 1])
                .map_err(err("rank 3's notice"))?;
        }
        let len = if me == 3 { 64 } else { 32 };
        let mut buffer = vec![if me == 0 { 0x42u8 } else { 0xee }; len];
        let outcome = dup.broadcast(0, &mut buffer);
        if me == 3 {
            world
                .send(0, FAILED_NOTICE, &[1])
                .map_err(err("the notice to rank 0"))?;
        }
        match (me, &outcome) {
            (3, Err(Error::Mismatch(_))) => {
                // Rank 2 forwards once rank 0 comes; the world barrier
                // progresses this rank meanwhile.
                std::thread::sleep(std::time::Duration::from_millis(1500));
                world.barrier().map_err(err("world barrier"))?;
                let changed = buffer.iter().filter(|&&b| b != 0xee).count();
                if changed > 0 {
                    return Err(format!(
                        "{changed} bytes landed in the buffer after the failed broadcast returned"
                    ));
                }
                tally.checked += 1;
            }
            (3, other) => return Err(format!("rank 3's broadcast of 64 bytes: {other:?}")),
            // Rank 2 forwards into a receive rank 3 withdrew: the error
            // names rank 3 and its call, not the refused write.
            (0 | 1, Ok(())) | (2, Err(Error::MemberFailed { rank: 3, call: 1 })) => {
                if me == 2 {
                    tally.notes.push(format!("rank 2's broadcast: {outcome:?}"));
                }
                world.barrier().map_err(err("world barrier"))?
            }
            (_, other) => return Err(format!("broadcast of 32 bytes from rank 0: {other:?}")),
        }
        drop(dup);
        // (2)
        let pair = world
            .split((me < 2).then_some(0), me)
            .map_err(err("split"))?;
        if let Some(pair) = &pair {
            let mut buffer = vec![1u8; if me == 0 { 16 } else { 8 }];
            match (me, pair.broadcast(0, &mut buffer)) {
                (0, Ok(())) => match pair.barrier() {
                    Err(Error::MemberFailed { rank: 1, call: 1 }) => tally.checked += 1,
                    other => return Err(format!("a barrier after rank 1 gave up: {other:?}")),
                },
                (1, Err(Error::Mismatch(_))) => tally.checked += 1,
                (_, other) => return Err(format!("broadcast of 16 bytes into 8: {other:?}")),
            }
        }
        world.barrier().map_err(err("world barrier"))?;
        // (3), on a new pair (the first one's collectives stopped).
        let pair = world
            .split((me < 2).then_some(0), me)
            .map_err(err("second split"))?;
        if let Some(pair) = &pair {
            let n = if me == 0 { 33 } else { 32 };
            let outcome = pair.allreduce_with(
                &vec![1.0f64; n],
                &mut vec![0.0; n],
                Op::Sum,
                ReduceAlgorithm::FlagWords,
            );
            match (me, outcome) {
                (0, Err(Error::Unsuitable(_))) => {
                    // Rank 1 still waits in the call this rank refused:
                    // the next flag-word call must not meet its words as
                    // its own. It fails once rank 1 gives the call up.
                    let mut sum = vec![0.0f64; 32];
                    let next = pair.allreduce_with(
                        &vec![2.0f64; 32],
                        &mut sum,
                        Op::Sum,
                        ReduceAlgorithm::FlagWords,
                    );
                    match next {
                        Err(Error::MemberFailed { rank: 1, call: 1 }) => tally.checked += 1,
                        other => {
                            return Err(format!(
                                "a flag-word allreduce after one refused while rank 1 \
                                 waits in it: {other:?} (sum {})",
                                sum[0]
                            ))
                        }
                    }
                }
                (1, Err(Error::MemberFailed { rank: 0, call: 1 })) => tally.checked += 1,
                (_, other) => return Err(format!("flag words for 33 and 32 doubles: {other:?}")),
            }
        }
        world.barrier().map_err(err("world barrier"))?;
        // (4)
        let three = world
            .split((me < 3).then_some(0), me)
            .map_err(err("third split"))?;
        if let Some(three) = &three {
            let root = me % 2;
            let mut first = [if me == root { 0x10 + me as u8 } else { 0 }; 64];
            let first_outcome = three.broadcast(root, &mut first);
            let mut second = [if me == 1 { 0xbb } else { 0 }; 64];
            let second_outcome = three.broadcast(1, &mut second);
            match (me, &first_outcome, &second_outcome) {
                (2, Ok(()), Err(Error::MemberFailed { rank: 1, .. } | Error::Mismatch(_))) => {
                    tally.checked += 1
                }
                (0 | 1, Err(_), Err(Error::CommunicatorBroken(_))) => tally.checked += 1,
                _ => {
                    return Err(format!(
                        "broadcasts from roots 0 and 1, then from 1: {first_outcome:?}, \
                         {second_outcome:?} (second buffer {:#x})",
                        second[0]
                    ))
                }
            }
        }
        world.barrier().map_err(err("world barrier"))?;
        // (5) A binomial broadcast of 16 bytes from rank 0, where rank 2
        // gives 8: rank 2 fails, then calls twice more on the dup (both
        // refused at once). Rank 3, its child, still waits in the first
        // call and learns that rank 2 gave it up, or, if its check read
        // rank 2's record before rank 2 gave up (a loaded machine), that
        // rank 2 called a broadcast of another length.
        let dup = world.dup().map_err(err("dup"))?;
        let mut buffer = vec![if me == 0 { 0x5a } else { 0 }; if me == 2 { 8 } else { 16 }];
        let outcome = dup.broadcast_with(0, &mut buffer, BroadcastAlgorithm::BinomialTree);
        match (me, outcome) {
            (0 | 1, Ok(())) if buffer == [0x5a; 16] => tally.checked += 1,
            (2, Err(Error::Mismatch(_) | Error::Truncated { .. })) => {
                for _ in 0..2 {
                    match dup.barrier() {
                        Err(Error::CommunicatorBroken(_)) => {}
                        other => return Err(format!("a barrier after giving up: {other:?}")),
                    }
                }
                tally.checked += 1
            }
            (3, Err(Error::MemberFailed { rank: 2, call: 1 })) => tally.checked += 1,
            (3, Err(Error::Mismatch(why)))
                if why.contains("collective call 1 ") && why.contains("on world rank 2 ") =>
            {
                tally.checked += 1
            }
            (_, other) => {
                return Err(format!(
                    "broadcast of 16 bytes where rank 2 gives 8: {other:?}"
                ))
            }
        }
        world.barrier().map_err(err("world barrier"))?;
        // (6) On a new pair, rank 0 names a root out of range three times
        // (each call refused); rank 1, waiting in the first, learns it.
        let pair = world
            .split((me < 2).then_some(0), me)
            .map_err(err("fourth split"))?;
        if let Some(pair) = &pair {
            let mut buffer = [0u8; 8];
            if me == 0 {
                for _ in 0..3 {
                    match pair.broadcast(7, &mut buffer) {
                        Err(Error::NoSuchRank { .. }) => {}
                        other => return Err(format!("a broadcast from root 7 of 2: {other:?}")),
                    }
                }
                tally.checked += 1;
            } else {
                match pair.broadcast(0, &mut buffer) {
                    Err(Error::MemberFailed { rank: 0, call: 1 }) => tally.checked += 1,
                    other => {
                        return Err(format!("a broadcast rank 0 refused three times: {other:?}"))
                    }
                }
            }
        }
        world.barrier().map_err(err("world barrier"))?;
        // (7) On a new pair, both refuse call 1 (which breaks nothing);
        // rank 1 then takes part in call 2, a barrier, while rank 0
        // refuses calls 2 to 4 and comes to the barrier as call 5. Rank 1
        // learns that rank 0 refused its call, from the run of refusals
        // rank 0's records show (its record of call 2 is overwritten);
        // rank 0's barrier waits until rank 1 is done with call 2, and
        // fails, naming it, instead of taking rank 1's word of call 2.
        let pair = world
            .split((me < 2).then_some(0), me)
            .map_err(err("fifth split"))?;
        if let Some(pair) = &pair {
            let refused = |what: &str| match pair.broadcast(7, &mut [0u8; 8]) {
                Err(Error::NoSuchRank { .. }) => Ok(()),
                other => Err(format!("{what}, a broadcast from root 7 of 2: {other:?}")),
            };
            refused("call 1")?;
            if me == 0 {
                for call in 2..=4 {
                    refused(&format!("call {call}"))?;
                }
                match pair.barrier() {
                    Err(Error::MemberFailed { rank: 1, call: 2 }) => tally.checked += 1,
                    other => {
                        return Err(format!(
                            "a barrier after refusing the call rank 1 took part in: {other:?}"
                        ))
                    }
                }
            } else {
                match pair.barrier() {
                    Err(Error::MemberFailed { rank: 0, call: 2 }) => tally.checked += 1,
                    other => return Err(format!("a barrier rank 0 refused in a run: {other:?}")),
                }
            }
        }
        world.barrier().map_err(err("world barrier"))?;
        // (8) On ranks 0-2, rank 0 refuses calls 1 and 2 and comes to the
        // barrier as call 3; rank 1 comes to it as call 1 at once, rank 2
        // a second later. Rank 1 fails from the refusal, rank 0's barrier
        // fails naming rank 1, and rank 2, late, still learns that its
        // call 1 cannot complete (rank 0's records no longer show the
        // refusals alone: its call 3 failed).
        let three = world
            .split((me < 3).then_some(0), me)
            .map_err(err("sixth split"))?;
        if let Some(three) = &three {
            match me {
                0 => {
                    for _ in 0..2 {
                        match three.broadcast(7, &mut [0u8; 8]) {
                            Err(Error::NoSuchRank { .. }) => {}
                            other => return Err(format!("a broadcast from root 7: {other:?}")),
                        }
                    }
                    match three.barrier() {
                        Err(Error::MemberFailed { rank: 1, call: 1 }) => tally.checked += 1,
                        other => return Err(format!("rank 0's barrier as call 3: {other:?}")),
                    }
                }
                1 => match three.barrier() {
                    Err(Error::MemberFailed { rank: 0, call: 1 }) => tally.checked += 1,
                    other => return Err(format!("rank 1's barrier: {other:?}")),
                },
                _ => {
                    std::thread::sleep(std::time::Duration::from_secs(1));
                    match three.barrier() {
                        Err(Error::MemberFailed {
                            rank: 0 | 1,
                            call: 1,
                        }) => tally.checked += 1,
                        other => return Err(format!("rank 2's late barrier: {other:?}")),
                    }
                }
            }
        }
        world.barrier().map_err(err("world barrier"))?;
        // (9) Dups whose only call every member refuses, dropped: their
        // contexts are free again (twice as many dups as there are
        // communicators), and the next dup works.
        let communicators = Config::default().communicators;
        for round in 0..2 * communicators {
            let dup = world
                .dup()
                .map_err(|e| format!("dup {round} after dups whose call all refused: {e}"))?;
            match dup.broadcast(99, &mut [0u8; 8]) {
                Err(Error::NoSuchRank { .. }) => {}
                other => return Err(format!("a broadcast from root 99: {other:?}")),
            }
        }
        let dup = world.dup().map_err(err("the last dup"))?;
        dup.barrier().map_err(err("its barrier"))?;
        tally.checked += 1;
        world.barrier().map_err(err("world barrier"))?;
        Ok(tally)
    }

    /// `collective-lost-member` (4 ranks): rank 3 gives up a dup of the
    /// world after its contribution reached rank 0 (rank 0 counts as gone
    /// for it 2 s into the call, while rank 1 comes 4 s late), so
    /// ranks 1 and 2 get the table and the new communicator, and rank 0's
    /// table to rank 3 is refused: rank 0's dup fails naming rank 3. The
    /// first barrier of ranks 1 and 2 on the new communicator fails with
    /// `NotAMember`, naming rank 0 or 3, instead of waiting for ever.
    pub(super) fn lost_member(
        messenger: &pindown_messaging::Messenger<'_>,
        world: &Communicator<'_>,
    ) -> Outcome {
        if world.size() != 4 {
            return Err("collective-lost-member runs on 4 ranks".into());
        }
        let me = world.rank();
        watchdog(me, "collective-lost-member", 180);
        let mut tally = Tally::default();
        world.barrier().map_err(err("world barrier"))?;
        match me {
            1 => std::thread::sleep(std::time::Duration::from_secs(4)),
            3 => messenger
                .declare_gone_at(
                    0,
                    std::time::Instant::now() + std::time::Duration::from_secs(2),
                )
                .map_err(err("declare_gone_at"))?,
            _ => {}
        }
        match (me, world.dup()) {
            (0, Err(Error::MemberFailed { rank: 3, call })) if call > 0 => tally.checked += 1,
            (3, Err(Error::PeerGone { peer: 0, .. })) => tally.checked += 1,
            (1 | 2, Ok(dup)) => match dup.barrier() {
                Err(Error::NotAMember { rank: 0 | 3, call }) if call > 0 => {
                    tally.checked += 1;
                    match dup.barrier() {
                        Err(Error::CommunicatorBroken(_)) => tally.checked += 1,
                        other => return Err(format!("a second barrier: {other:?}")),
                    }
                }
                other => {
                    return Err(format!(
                        "a barrier on a dup ranks 0 and 3 gave up: {other:?}"
                    ))
                }
            },
            (_, other) => return Err(format!("a dup rank 3 gives up: {other:?}")),
        }
        // Ranks 0 and 3 stay until ranks 1 and 2 are done (a rank that
        // leaves counts as gone), and those stay until their notices have
        // landed (synchronous sends).
        const DONE: u32 = 6;
        messenger.set_send_timeout(None);
        for (waiter, notifier) in [(0, 1), (0, 2), (3, 1), (3, 2)] {
            if me == notifier {
                world.send(waiter, DONE, &[1]).map_err(err("done notice"))?;
            } else if me == waiter {
                world
                    .recv(notifier, DONE, &mut [0u8; 1])
                    .map_err(err("done notice"))?;
            }
        }
        Ok(tally)
    }

    /// How many ranks of the world named the mismatch of case `name`
    /// (`named`: 1 here if this rank did); none is an error.
    fn namers_of_mismatch(world: &Communicator<'_>, name: &str, named: u32) -> Result<u32, String> {
        let mut namers = [0u32];
        world
            .allreduce(&[named], &mut namers, Op::Sum)
            .map_err(err("allreduce of the ranks that named the mismatch"))?;
        if namers[0] == 0 {
            return Err(format!("{name}: no rank named the mismatch"));
        }
        Ok(namers[0])
    }

    /// `collective-verify` (2 ranks): calls that disagree but complete
    /// anyway, each on a new dup of the world: an allreduce by sum on
    /// rank 0 and by max on rank 1, and a reduce to rank 1 (binary tree)
    /// on rank 0 against a broadcast from rank 0 (binomial tree) on rank
    /// 1, whose receive takes the reduce's send. With `--verify` each
    /// fails on both ranks (`Mismatch`, or `MemberFailed` where the other
    /// failed first; at least one names both calls) and the dup's next
    /// barrier fails at once; without, both return, the program none the
    /// wiser, as the module's documentation says.
    pub(super) fn verify(world: &Communicator<'_>, config: &Config) -> Outcome {
        type Call = fn(&Communicator<'_>) -> pindown_messaging::Result<()>;
        let cases: [(&str, Call); 2] = [
            ("an allreduce by sum against one by max", |c| {
                let op = if c.rank() == 0 { Op::Sum } else { Op::Max };
                c.allreduce(&[u64::from(c.rank()) + 1], &mut [0u64], op)
            }),
            ("a reduce against a broadcast", |c| match c.rank() {
                0 => c.reduce_with(
                    1,
                    &[7u64],
                    &mut [0u64],
                    Op::Sum,
                    ReduceAlgorithm::BinaryTree,
                ),
                _ => c.broadcast_with(0, &mut [0u8; 8], BroadcastAlgorithm::BinomialTree),
            }),
        ];
        if world.size() != 2 {
            return Err("collective-verify runs on 2 ranks".into());
        }
        watchdog(world.rank(), "collective-verify", 60);
        let mut tally = Tally::default();
        for (name, call) in cases {
            let dup = world.dup().map_err(err("dup"))?;
            let outcome = call(&dup);
            let named = match (config.verify_collectives, outcome) {
                (false, Ok(())) => 0u32,
                (true, Err(Error::Mismatch(why))) if why.contains(" but ") => {
                    tally.notes.push(format!("{name}: {why}"));
                    1
                }
                (true, Err(Error::MemberFailed { call: 1, .. })) => 0,
                (verify, other) => {
                    return Err(format!("{name}, verify {verify}: {other:?}"));
                }
            };
            if config.verify_collectives {
                match dup.barrier() {
                    Err(Error::CommunicatorBroken(_)) => {}
                    other => return Err(format!("{name}, the barrier after: {other:?}")),
                }
                namers_of_mismatch(world, name, named)?;
            }
            tally.checked += 1;
        }
        Ok(tally)
    }

    /// `collective-mismatch` (2 ranks or more): members that disagree
    /// about a collective call (lengths on both sides of the flag-word
    /// limit, roots, algorithms, kinds), each case on a new dup of the
    /// world. No rank waits for ever: each either fails the call with
    /// `Mismatch` (naming both calls) or `MemberFailed`, or (its part
    /// done) fails the dup's next barrier; at least one rank names the
    /// mismatch; the dup's collectives stay stopped; the world and the
    /// next dup work.
    pub(super) fn mismatch(world: &Communicator<'_>) -> Outcome {
        type Call = fn(&Communicator<'_>) -> pindown_messaging::Result<()>;
        let cases: [(&str, Call); 6] = [
            ("allreduce of 33 doubles against 32", |c| {
                let n = if c.rank() == 0 { 33 } else { 32 };
                c.allreduce(&vec![1.0f64; n], &mut vec![0.0; n], Op::Sum)
            }),
            ("broadcasts from different roots", |c| {
                c.broadcast(c.rank() % 2, &mut [7u8; 64])
            }),
            ("a barrier against broadcasts", |c| match c.rank() {
                0 => c.barrier(),
                _ => c.broadcast(0, &mut [0u8; 8]),
            }),
            ("a reduce by flag words against the tree", |c| {
                let algorithm = match c.rank() {
                    0 => ReduceAlgorithm::FlagWords,
                    _ => ReduceAlgorithm::BinaryTree,
                };
                c.reduce_with(0, &[1u64; 4], &mut [0u64; 4], Op::Sum, algorithm)
            }),
            (
                "an allreduce by reduce-scatter against recursive doubling",
                |c| {
                    let algorithm = match c.rank() {
                        0 => ReduceAlgorithm::ReduceScatterAllgather,
                        _ => ReduceAlgorithm::RecursiveDoubling,
                    };
                    let mine = vec![1i64; 4096];
                    c.allreduce_with(&mine, &mut vec![0; 4096], Op::Sum, algorithm)
                },
            ),
            ("a dup against a barrier", |c| match c.rank() {
                0 => c.dup().map(drop),
                _ => c.barrier(),
            }),
        ];
        if world.size() < 2 {
            return Err("collective-mismatch runs on 2 ranks or more".into());
        }
        // A rank still waiting after a minute fails the run rather than
        // hanging it (the whole scenario takes a few seconds).
        watchdog(world.rank(), "collective-mismatch", 60);
        let mut tally = Tally::default();
        let mut broken = Vec::new();
        for (name, call) in cases {
            let dup = world.dup().map_err(err("dup"))?;
            let started = std::time::Instant::now();
            let (named, failed) = match call(&dup) {
                Ok(()) => (0u32, false),
                Err(Error::Mismatch(why))
                    if why.contains("world rank") && why.contains(" but ") =>
                {
                    tally.notes.push(format!("{name}: {why}"));
                    (1, true)
                }
                Err(Error::MemberFailed { .. }) => (0, true),
                Err(other) => return Err(format!("{name}: {other}")),
            };
            // The dup's next collective fails on every rank: at once where
            // the call failed, else from the records of those where it did
            // (naming the mismatched call, or this barrier where the member
            // waited on failed in it).
            match (failed, dup.barrier()) {
                (true, Err(Error::CommunicatorBroken(_))) => {}
                (false, Err(Error::MemberFailed { call: 1 | 2, .. })) => {}
                (_, other) => return Err(format!("{name}, the barrier after: {other:?}")),
            }
            let waited = started.elapsed();
            let namers = namers_of_mismatch(world, name, named)?;
            tally
                .notes
                .push(format!("{name}: {waited:?}, {namers} named it"));
            tally.checked += 2;
            // Kept to the end: its contexts are not used again anyway.
            broken.push(dup);
        }
        // The world and a new dup still run collectives.
        let fresh = world.dup().map_err(err("dup after the mismatches"))?;
        let mut sum = [0u64];
        fresh
            .allreduce(&[u64::from(world.rank()) + 1], &mut sum, Op::Sum)
            .map_err(err("allreduce on a new dup"))?;
        let size = u64::from(world.size());
        if sum[0] != size * (size + 1) / 2 {
            return Err(format!("sum of 1..={size} on a new dup: {}", sum[0]));
        }
        tally.checked += 1;
        drop(broken);
        Ok(tally)
    }

    fn cases(
        comm: &Communicator<'_>,
        seed: u64,
        count: u64,
        tally: &mut Tally,
    ) -> Result<(), String> {
        let mut random = Random(seed);
        for case in 0..count {
            let case = Case {
                comm,
                seed,
                case: case + (u64::from(comm.size()) << 32),
            };
            let all = random.below(2) == 0;
            if std::env::var_os("MSG_CHECK_TRACE").is_some() {
                eprintln!(
                    "rank {} (of {}): case {}",
                    comm.rank(),
                    comm.size(),
                    case.case
                );
            }
            let checked = match case.case % 11 {
                0 => barrier(&case, &mut random, BarrierAlgorithm::Dissemination)?,
                1 => barrier(&case, &mut random, BarrierAlgorithm::BinaryTree)?,
                2 => broadcast(&case, &mut random, BroadcastAlgorithm::BinomialTree)?,
                3 => broadcast(&case, &mut random, BroadcastAlgorithm::Pipelined)?,
                4 => broadcast(&case, &mut random, BroadcastAlgorithm::Auto)?,
                5 => reduction_any(&case, &mut random, ReduceAlgorithm::FlagWords, all)?,
                6 => reduction_any(&case, &mut random, ReduceAlgorithm::BinaryTree, all)?,
                7 => reduction_any(&case, &mut random, ReduceAlgorithm::RecursiveDoubling, all)?,
                8 => reduction_any(&case, &mut random, ReduceAlgorithm::Auto, true)?,
                9 => reduction_any(
                    &case,
                    &mut random,
                    ReduceAlgorithm::ReduceScatterAllgather,
                    all,
                )?,
                _ => reduction_any(&case, &mut random, ReduceAlgorithm::Auto, false)?,
            };
            tally.checked += checked;
        }
        Ok(())
    }

    /// Microseconds per call of `call`, run `iterations` times after a
    /// warm-up, the slowest rank's figure (every rank reports the same).
    fn time(
        world: &Communicator<'_>,
        iterations: u32,
        mut call: impl FnMut() -> pindown_messaging::Result<()>,
    ) -> Result<f64, String> {
        for _ in 0..iterations.div_ceil(10) {
            call().map_err(err("warm-up"))?;
        }
        world.barrier().map_err(err("barrier"))?;
        let start = std::time::Instant::now();
        for _ in 0..iterations {
            call().map_err(err("timed call"))?;
        }
        let mine = [start.elapsed().as_secs_f64() * 1e6 / f64::from(iterations)];
        let mut slowest = [0.0];
        world
            .allreduce(&mine, &mut slowest, Op::Max)
            .map_err(err("allreduce"))?;
        Ok(slowest[0])
    }

    /// `--time`: figures of each algorithm (notes), for the default table.
    fn timing(world: &Communicator<'_>, args: &[String]) -> Outcome {
        let mut tally = Tally::default();
        let scale = flag(args, "--iterations", 1000) as u32;
        // `--bytes N`: a ping-pong and the allreduces of N bytes, nothing
        // else.
        let only = flag(args, "--bytes", 0) as usize;
        if world.size() == 2 {
            let bytes = if only == 0 { 8 } else { only };
            let mut buffer = vec![0u8; bytes];
            let peer = 1 - world.rank();
            let iterations = (scale * 5 * 64 / (bytes as u32 / 64 + 64)).max(10);
            let us = time(world, iterations, || {
                if world.rank() == 0 {
                    world.send(peer, 0, &buffer)?;
                    world.recv(peer, 0, &mut buffer).map(drop)
                } else {
                    world.recv(peer, 0, &mut buffer)?;
                    world.send(peer, 0, &buffer)
                }
            })?;
            tally
                .notes
                .push(format!("ping-pong {bytes} B one way: {:.2} us", us / 2.0));
        }
        for algorithm in [
            BarrierAlgorithm::Dissemination,
            BarrierAlgorithm::BinaryTree,
        ]
        .into_iter()
        .filter(|_| only == 0)
        {
            let us = time(world, scale * 5, || world.barrier_with(algorithm))?;
            tally
                .notes
                .push(format!("barrier {algorithm:?}: {us:.2} us"));
        }
        for bytes in [8usize, 256, 4096, 65536, 256 << 10, 1 << 20] {
            if only != 0 && bytes != only {
                continue;
            }
            let send = vec![1.0f64; bytes / 8];
            let mut receive = vec![0.0f64; bytes / 8];
            for algorithm in [
                ReduceAlgorithm::FlagWords,
                ReduceAlgorithm::RecursiveDoubling,
                ReduceAlgorithm::BinaryTree,
                ReduceAlgorithm::ReduceScatterAllgather,
            ] {
                if algorithm == ReduceAlgorithm::FlagWords && bytes > 256 {
                    continue;
                }
                let iterations = (scale * 64 / (bytes as u32 / 64 + 64)).max(10);
                let us = time(world, iterations, || {
                    world.allreduce_with(&send, &mut receive, Op::Sum, algorithm)
                })?;
                tally
                    .notes
                    .push(format!("allreduce {bytes} B {algorithm:?}: {us:.2} us"));
            }
        }
        for bytes in [8usize, 65536, 256 << 10, 1 << 20, 4 << 20]
            .into_iter()
            .filter(|_| only == 0)
        {
            let mut buffer = vec![7u8; bytes];
            for algorithm in [
                BroadcastAlgorithm::BinomialTree,
                BroadcastAlgorithm::Pipelined,
            ] {
                let iterations = (scale * 64 / (bytes as u32 / 1024 + 64)).max(10);
                let mut root = 0;
                let us = time(world, iterations, || {
                    root = (root + 1) % world.size();
                    world.broadcast_with(root, &mut buffer, algorithm)
                })?;
                tally
                    .notes
                    .push(format!("broadcast {bytes} B {algorithm:?}: {us:.2} us"));
            }
        }
        tally.checked = tally.notes.len() as u64;
        Ok(tally)
    }

    pub(super) fn run(world: &Communicator<'_>, args: &[String]) -> Outcome {
        if args.iter().any(|a| a == "--time") {
            return timing(world, args);
        }
        let seed = flag(args, "--seed", 0x00c0_11ec);
        let count = flag(args, "--cases", 60);
        let mut tally = Tally::default();
        tally.notes.push(format!("seed {seed}, {count} cases"));
        cases(world, seed, count, &mut tally)?;
        tally.checked += errors(world)?;
        // A split (odd and even world ranks, reversed) and a dup.
        let me = world.rank();
        let half = world
            .split(Some(me % 2), world.size() - me)
            .map_err(err("split"))?
            .ok_or("split gave no communicator")?;
        cases(&half, seed ^ 0x1, count / 3, &mut tally)?;
        drop(half);
        let dup = world.dup().map_err(err("dup"))?;
        cases(&dup, seed ^ 0x2, count / 3, &mut tally)?;
        drop(dup);
        // The contexts freed are taken again with fresh epochs.
        let again = world.dup().map_err(err("dup"))?;
        cases(&again, seed ^ 0x3, 10, &mut tally)?;
        let verify = args.iter().any(|a| a == "--verify");
        tally.checked += length_mismatch(world, verify)?;
        Ok(tally)
    }
}

/// `forged-split` and `forged-context` (2 ranks): rank 0, which gathers
/// the contributions of a split and sends every rank the table, sends
/// rank 1 a forged one: rank 1's own color taken out (`forged-split`), or
/// the world's context marked free for the new communicator
/// (`forged-context`). Rank 1's split fails naming rank 0, instead of
/// panicking or putting the new communicator on the world's context; the
/// world still works.
fn forged_split(messenger: &Messenger<'_>, world: &Communicator<'_>, context: bool) -> Outcome {
    let mut tally = Tally::default();
    if world.size() != 2 {
        return Err("forged-split runs on 2 ranks".into());
    }
    let layout = messenger.control_layout();
    // The world is context 0; its collectives (the exchange) context 1.
    let collective = 1;
    if world.rank() == 1 {
        match world.split(Some(5), 0) {
            Err(Error::BadPeerRecord { rank: 0, why }) => {
                tally.notes.push(format!("refused: {why}"));
                tally.checked += 1;
            }
            Err(other) => return Err(format!("split with a forged table: {other}")),
            Ok(_) => return Err("split took a forged table".into()),
        }
        let mut got = [0u8; 8];
        world
            .recv(0, 4, &mut got)
            .map_err(err("a world receive after"))?;
        if got != [0xee; 8] {
            return Err(format!("the world message after: {got:x?}"));
        }
        tally.checked += 1;
        return Ok(tally);
    }
    // Rank 1's receives of the tables: its match record here.
    let record = layout.match_record(layout.slot(collective, 1, 0));
    let stamp = record + pindown_messaging::layout::MATCH_STAMP_AT;
    let pairs = Config::default().communicators as usize;
    // The table of colors (rank 1's own row forged out unless `context`),
    // then, if rank 1 took it, the free contexts (all free, the world's
    // included).
    let tables: Vec<Vec<u8>> = {
        let mut colors = vec![0u8; 18];
        colors[0] = 1;
        colors[1..5].copy_from_slice(&5u32.to_le_bytes());
        if context {
            colors[9] = 1;
            colors[10..14].copy_from_slice(&5u32.to_le_bytes());
        }
        match context {
            true => vec![colors, vec![1u8; 2 * pairs]],
            false => vec![colors],
        }
    };
    for (generation, table) in (1u64..).zip(&tables) {
        let started = Instant::now();
        while messenger.own_control_word(stamp) != generation {
            messenger.progress().map_err(err("progress"))?;
            if started.elapsed() > Duration::from_secs(10) {
                return Err(format!("rank 1's receive {generation} never showed"));
            }
        }
        let (key, offset) = (
            messenger.own_control_word(record),
            messenger.own_control_word(record + 8),
        );
        for (i, chunk) in table.chunks(64).enumerate() {
            messenger
                .write_peer_window(1, key, offset + 64 * i as u64, chunk)
                .map_err(err("forging the table"))?;
        }
        let word = pindown_messaging::layout::done_word(generation, table.len() as u64, false);
        messenger
            .write_peer_control(
                1,
                layout.done_word(layout.slot(collective, 0, 0)),
                &word.to_le_bytes(),
            )
            .map_err(err("forging the done word"))?;
    }
    messenger.set_send_timeout(None);
    world
        .send(1, 4, &[0xee; 8])
        .map_err(err("a world send after"))?;
    tally.checked += 1;
    Ok(tally)
}

/// `forged-credit` (2 ranks): rank 1 writes into rank 0 a credit word
/// saying it drained 1000 entries of rank 0's any-source ring, of none
/// sent. Rank 0's next `send_any` to it fails naming rank 1 instead of
/// waiting while rank 1 lives.
fn forged_credit(messenger: &Messenger<'_>, world: &Communicator<'_>) -> Outcome {
    let mut tally = Tally::default();
    if world.size() != 2 {
        return Err("forged-credit runs on 2 ranks".into());
    }
    let layout = messenger.control_layout();
    messenger.set_send_timeout(None);
    if world.rank() == 1 {
        let word = pindown_messaging::layout::any_credit_word(1000, 0);
        messenger
            .write_peer_control(0, layout.any_credit(0, 1), &word.to_le_bytes())
            .map_err(err("forging"))?;
        world.send(0, 1, &[]).map_err(err("signal"))?;
        world.recv(0, 2, &mut []).map_err(err("signal back"))?;
        tally.checked += 1;
        return Ok(tally);
    }
    world.recv(1, 1, &mut []).map_err(err("signal"))?;
    match world.send_any(1, 7, &[1, 2, 3]) {
        Err(Error::BadPeerRecord { rank: 1, why }) if why.contains("drained") => {
            tally.notes.push(format!("refused: {why}"));
            tally.checked += 1;
        }
        other => return Err(format!("send_any after a forged credit: {other:?}")),
    }
    world.send(1, 2, &[]).map_err(err("signal back"))?;
    Ok(tally)
}

/// `forged-entry` (2 ranks): rank 1 writes into its own any-source ring
/// at rank 0 a rendezvous entry naming a window it does not have, 2^62
/// bytes long, then an eager entry whose length says 2^31 - 1. Rank 0's
/// first `recv_any` fails naming rank 1, its buffer unchanged; the second
/// is a truncation of what one entry holds.
fn forged_entry(messenger: &Messenger<'_>, world: &Communicator<'_>) -> Outcome {
    use pindown_messaging::layout::{any_message_word, ANY_EAGER_BYTES, ANY_RENDEZVOUS};
    let mut tally = Tally::default();
    if world.size() != 2 {
        return Err("forged-entry runs on 2 ranks".into());
    }
    let layout = messenger.control_layout();
    messenger.set_send_timeout(None);
    if world.rank() == 1 {
        let first = layout.any_entry(0, 1, 0);
        let mut head = Vec::new();
        head.extend_from_slice(&(ANY_RENDEZVOUS | 9).to_le_bytes());
        head.extend_from_slice(&0x1234_5678u64.to_le_bytes());
        head.extend_from_slice(&(1u64 << 62).to_le_bytes());
        messenger
            .write_peer_control(0, first + 8, &head)
            .map_err(err("entry 0"))?;
        messenger
            .write_peer_control(0, first, &1u64.to_le_bytes())
            .map_err(err("stamp 0"))?;
        let second = layout.any_entry(0, 1, 1);
        let word = any_message_word(10, Some(0x7fff_ffff));
        messenger
            .write_peer_control(0, second + 8, &word.to_le_bytes())
            .map_err(err("entry 1"))?;
        messenger
            .write_peer_control(0, second, &2u64.to_le_bytes())
            .map_err(err("stamp 1"))?;
        world.send(0, 1, &[]).map_err(err("signal"))?;
        world.recv(0, 2, &mut []).map_err(err("signal back"))?;
        tally.checked += 1;
        return Ok(tally);
    }
    world.recv(1, 1, &mut []).map_err(err("signal"))?;
    let mut buffer = vec![0x5au8; 64];
    match world.recv_any(None, None, &mut buffer) {
        Err(Error::BadPeerRecord { rank: 1, why }) => {
            tally.notes.push(format!("refused: {why}"));
            tally.checked += 1;
        }
        other => return Err(format!("a rendezvous entry with a forged key: {other:?}")),
    }
    if buffer.iter().any(|&b| b != 0x5a) {
        return Err("the refused receive changed its buffer".into());
    }
    match world.recv_any(None, None, &mut buffer) {
        Err(Error::Truncated {
            message,
            capacity: 64,
        }) if message == ANY_EAGER_BYTES => tally.checked += 1,
        other => return Err(format!("an eager entry 2^31 - 1 bytes long: {other:?}")),
    }
    world.send(1, 2, &[]).map_err(err("signal back"))?;
    Ok(tally)
}
