//! `msg_check`: ranks that check the messaging library's calls, byte by
//! byte, and a launcher that starts them with an emulated NIC.
//!
//! ```text
//! msg_check launch N SCENARIO [--mode sync|buffered|switch] # a device with N ports, N ranks
//!                                  [--poll]                   # the device busy-polls
//! msg_check rank SCENARIO                                   # one rank (under mpiexec, or launch)
//! msg_check device ARGS...                                   # the emulated NIC
//! ```
//!
//! A rank joins the job ([`Job::from_environment`]: Hydra, Open MPI, or
//! `PINDOWN_RANK`/`PINDOWN_SIZE`/`PINDOWN_KV_DIR`), opens its port
//! ([`device_socket`]), runs the scenario and prints one JSON line:
//! `{"rank":0,"size":2,"scenario":"pingpong","ok":true,"checked":1234}`
//! or `{"rank":0,...,"ok":false,"error":"..."}` (exit status 1).
//! `launch` prints every rank's line and exits 0 only if all passed.
//!
//! Scenarios: `pingpong` (blocking and nonblocking, 0 B to 4 MiB, FMPL's
//! (peer, index) waits, persistent requests), `timeout-switch` (buffered,
//! synchronous and switching sends against late receives, with
//! `sendbuf_check`), `send-first` (every rank sends to every other
//! before receiving), `any-index`, `truncation`, `slots` (every slot
//! outstanding, then the errors beyond), `split` (communicators),
//! `peer-death` (the last rank exits; the others' receives from it fail),
//! and `collectives` (barriers, broadcasts, reduces and allreduces with
//! every algorithm, random roots, sizes 0 B to 4 MiB, element types and
//! operations, on the world, a split and a dup; `--seed S`, `--cases N`;
//! results compared with a reference each rank computes from every
//! rank's seeded contribution).

use std::collections::HashSet;
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use pindown_driver::launch::{device_socket, Job};
use pindown_driver::verbs::Context;
use pindown_messaging::{Communicator, Config, Error, Messenger};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("device") => {
            // SAFETY: prctl(PR_SET_PDEATHSIG) takes a signal number and
            // changes only this process's attributes: the device dies with
            // the launcher that started it.
            unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) };
            pindown_emu_device::cli::main(args)
        }
        Some("rank") if args.len() >= 2 => rank(&args[1], &args[2..]),
        Some("launch") if args.len() >= 3 => match args[1].parse::<u32>() {
            Ok(n) if n >= 1 => launch(n, &args[2], &args[3..]),
            _ => usage(),
        },
        _ => usage(),
    }
}

fn usage() -> ExitCode {
    eprintln!("usage: msg_check launch N SCENARIO [ARGS] | rank SCENARIO [ARGS] | device ARGS");
    ExitCode::from(64)
}

/// Starts a device with `n` ports (this executable again) and `n` ranks,
/// and waits for them.
fn launch(n: u32, scenario: &str, args: &[String]) -> ExitCode {
    let exe = std::env::current_exe().expect("own executable");
    let dir = tempfile::tempdir().expect("a temporary directory");
    let sockets = dir.path().join("dev");
    let kv = dir.path().join("kv");
    std::fs::create_dir_all(&kv).expect("kv dir");
    let mut device = Command::new(&exe)
        .arg("device")
        .arg("--socket-dir")
        .arg(&sockets)
        .arg("--ports")
        .arg(n.to_string())
        // `--poll`: the device busy-polls its rings (for timings).
        .args(args.iter().filter(|a| *a == "--poll"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the device");
    let ready = Instant::now();
    while !(0..n).all(|i| sockets.join(format!("port{i}.sock")).exists()) {
        if ready.elapsed() > Duration::from_secs(20) {
            eprintln!("the device did not create its sockets");
            let _ = device.kill();
            let _ = device.wait();
            return ExitCode::FAILURE;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let ranks: Vec<_> = (0..n)
        .map(|r| {
            Command::new(&exe)
                .arg("rank")
                .arg(scenario)
                .args(args)
                .env("PINDOWN_RANK", r.to_string())
                .env("PINDOWN_SIZE", n.to_string())
                .env("PINDOWN_LOCAL_RANK", r.to_string())
                .env("PINDOWN_LOCAL_SIZE", n.to_string())
                .env("PINDOWN_KV_DIR", &kv)
                .env("PINDOWN_DEVICE_DIR", &sockets)
                .stdout(Stdio::piped())
                .spawn()
                .expect("start a rank")
        })
        .collect();
    let mut ok = true;
    for child in ranks {
        let output = child.wait_with_output().expect("a rank's output");
        print!("{}", String::from_utf8_lossy(&output.stdout));
        ok &= output.status.success();
    }
    let _ = device.kill();
    let _ = device.wait();
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// What a scenario checked.
#[derive(Default)]
struct Tally {
    checked: u64,
    notes: Vec<String>,
}

type Outcome = Result<Tally, String>;

fn rank(scenario: &str, args: &[String]) -> ExitCode {
    // The heap never shrinks through brk: a trim from inside the pin-down
    // cache's locked sections blocks on the unmap monitor, which waits for
    // that lock (a deadlock of the cache seen with the collectives'
    // large-buffer churn; to be fixed in pincache).
    // SAFETY: mallopt only changes the allocator's tuning parameters.
    unsafe { libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX) };
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
    let context = Context::open(&socket, pindown_messaging::context_config())
        .map_err(|e| format!("{}: {e}", socket.display()))?;
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
    let messenger = Messenger::new(&context, job, config).map_err(|e| e.to_string())?;
    let world = messenger.world();
    let tally = match scenario {
        "pingpong" => pingpong(&messenger, &world),
        "timeout-switch" => timeout_switch(&messenger, &world),
        "send-first" => send_first(&messenger, &world),
        "any-index" => any_index(&world),
        "truncation" => truncation(&world),
        "slots" => slots(&world),
        "split" => split(&world),
        "peer-death" => peer_death(&world),
        "collectives" => collectives::run(&world, args),
        other => Err(format!("unknown scenario {other:?}")),
    }?;
    // Everyone done before anyone leaves (but a dead rank).
    if scenario != "peer-death" {
        barrier(&world).map_err(|e| format!("final barrier: {e}"))?;
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
    // 1. Buffered: the sends return before any receive exists; the spool
    //    drains when the receives come.
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
        std::thread::sleep(late);
        for n in 0..8u64 {
            let len = world
                .recv(peer, n as u32, &mut buffer)
                .map_err(err("recv"))?;
            tally.checked += check(&buffer[..len], peer, me, n, "spooled message")?;
        }
    }
    barrier(world).map_err(err("barrier"))?;
    // 2. Synchronous: the send waits for the late receive.
    messenger.set_send_timeout(None);
    if me == 0 {
        let start = Instant::now();
        world
            .send(peer, 20, &message(me, peer, 20, 5000))
            .map_err(err("sync send"))?;
        let waited = start.elapsed();
        let status = messenger.sendbuf_check().map_err(err("sendbuf_check"))?;
        if status.spooled != 0 || waited < late {
            return Err(format!(
                "synchronous send returned after {waited:?} with {status:?}"
            ));
        }
    } else {
        std::thread::sleep(late + Duration::from_millis(20));
        let len = world.recv(peer, 20, &mut buffer).map_err(err("recv"))?;
        tally.checked += check(&buffer[..len], peer, me, 20, "synchronous message")?;
    }
    barrier(world).map_err(err("barrier"))?;
    // 3. The switch: a timeout shorter than the receiver's delay spools.
    messenger.set_send_timeout(Some(Duration::from_millis(10)));
    if me == 0 {
        let before = messenger.sendbuf_check().map_err(err("sendbuf_check"))?;
        world
            .send(peer, 21, &message(me, peer, 21, 30_000))
            .map_err(err("send"))?;
        let after = messenger.sendbuf_check().map_err(err("sendbuf_check"))?;
        if after.spooled != 1 && after.sent == before.sent {
            return Err(format!(
                "the switch did not spool: {before:?} then {after:?}"
            ));
        }
    } else {
        std::thread::sleep(late);
        let len = world.recv(peer, 21, &mut buffer).map_err(err("recv"))?;
        tally.checked += check(&buffer[..len], peer, me, 21, "switched message")?;
    }
    Ok(tally)
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

/// The `collectives` scenario.
mod collectives {
    use std::cmp::Ordering;

    use pindown_messaging::{
        BarrierAlgorithm, BroadcastAlgorithm, Communicator, Element, Error, Op, ReduceAlgorithm,
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
    /// says so, and both go on.
    fn length_mismatch(world: &Communicator<'_>) -> Result<u64, String> {
        let me = world.rank();
        let pair = world
            .split((me < 2).then_some(0), me)
            .map_err(err("split"))?;
        let Some(pair) = pair else { return Ok(0) };
        if pair.size() < 2 {
            return Ok(0);
        }
        let mut buffer = vec![1u8; if me == 0 { 16 } else { 8 }];
        let outcome = pair.broadcast_with(0, &mut buffer, BroadcastAlgorithm::BinomialTree);
        match (me, outcome) {
            (0, Ok(())) | (_, Err(Error::Mismatch(_))) => {}
            (_, other) => return Err(format!("broadcast of 16 bytes into 8: {other:?}")),
        }
        // The pair still works.
        let mut sum = [0u32];
        pair.allreduce(&[me + 1], &mut sum, Op::Sum)
            .map_err(err("allreduce after a mismatch"))?;
        if sum[0] != 3 {
            return Err(format!("sum of 1 and 2 after a mismatch: {}", sum[0]));
        }
        Ok(2)
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
            let checked = match case.case % 10 {
                0 => barrier(&case, &mut random, BarrierAlgorithm::Dissemination)?,
                1 => barrier(&case, &mut random, BarrierAlgorithm::BinaryTree)?,
                2 => broadcast(&case, &mut random, BroadcastAlgorithm::BinomialTree)?,
                3 => broadcast(&case, &mut random, BroadcastAlgorithm::Pipelined)?,
                4 => broadcast(&case, &mut random, BroadcastAlgorithm::Auto)?,
                5 => reduction_any(&case, &mut random, ReduceAlgorithm::FlagWords, all)?,
                6 => reduction_any(&case, &mut random, ReduceAlgorithm::BinaryTree, all)?,
                7 => reduction_any(&case, &mut random, ReduceAlgorithm::RecursiveDoubling, all)?,
                8 => reduction_any(&case, &mut random, ReduceAlgorithm::Auto, true)?,
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
        if world.size() == 2 {
            let mut buffer = [0u8; 8];
            let peer = 1 - world.rank();
            let us = time(world, scale * 5, || {
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
                .push(format!("ping-pong 8 B one way: {:.2} us", us / 2.0));
        }
        for algorithm in [
            BarrierAlgorithm::Dissemination,
            BarrierAlgorithm::BinaryTree,
        ] {
            let us = time(world, scale * 5, || world.barrier_with(algorithm))?;
            tally
                .notes
                .push(format!("barrier {algorithm:?}: {us:.2} us"));
        }
        for bytes in [8usize, 256, 4096, 65536, 1 << 20] {
            let send = vec![1.0f64; bytes / 8];
            let mut receive = vec![0.0f64; bytes / 8];
            for algorithm in [
                ReduceAlgorithm::FlagWords,
                ReduceAlgorithm::RecursiveDoubling,
                ReduceAlgorithm::BinaryTree,
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
        for bytes in [8usize, 65536, 256 << 10, 1 << 20, 4 << 20] {
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
        tally.checked += length_mismatch(world)?;
        Ok(tally)
    }
}
