//! Keys nobody can guess, across processes: a port tries a million keys
//! against another port's live windows and gets one and the same refusal
//! every time, moves no byte, and the owner's counters account for every
//! attempt by cause. A window bound to one peer serves that peer only; a
//! port's windows are bounded by `--max-windows-per-port`.
//!
//! Ranks (processes of this test binary, see `common::rank`):
//! * `victim` (port 1): a patterned buffer with live windows: one open with
//!   every right, one read-only, one bound to port 2, and many more whose
//!   keys it never tells anyone.
//! * `peer` (port 2): uses the window bound to it.
//! * `attacker` (port 0): never given a usable key; tries random keys, keys
//!   near its own, keys near the victim's (flipped low bits, plus or minus
//!   a little), the peer's key from the wrong port, a right the window
//!   lacks and offsets outside the window.

mod common;

use std::collections::HashMap;
use std::io::BufRead;
use std::time::Duration;

use common::rank::{fingerprint, pattern, say, Rank};
use common::DeviceProcess;
use pindown_driver::verbs::opcode::{CompareSwap, FetchAdd, Read, Swap, Write};
use pindown_driver::verbs::{
    CompletionQueue, Context, ContextConfig, Entry, QueuePair, RemoteWindow, VerbsError,
};
use pindown_uapi::{
    Access, Completion, ErrorDetail, PortAddress, RemoteAddress, RemoteKey, Status,
};

/// The victim's buffer (all windows lie inside it).
const VICTIM_BYTES: usize = 1 << 20;
/// Windows the victim binds and keeps secret.
const SECRET_WINDOWS: usize = 1000;
/// Attempts of the attacker.
const ATTEMPTS: u64 = 1_000_000;
/// Requests the attacker keeps in flight, and posts at once.
const IN_FLIGHT: u64 = 1024;
const BATCH: u64 = 256;

/// A 64-bit mix of `x` (splitmix64): the attacker's random keys.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The `n`-th key near `key`: single bits flipped first, then low-bit
/// masks flipped, then small steps up and down.
fn near(key: RemoteKey, n: u64) -> RemoteKey {
    if n < 64 {
        return RemoteKey(key.0 ^ (1 << n));
    }
    let (step, way) = ((n - 64) / 3 + 1, (n - 64) % 3);
    RemoteKey(match way {
        0 => key.0 ^ step,
        1 => key.0.wrapping_add(step),
        _ => key.0.wrapping_sub(step),
    })
}

fn config() -> ContextConfig {
    ContextConfig {
        arena_bytes: 8 << 20,
        queue_size: IN_FLIGHT as u16,
        ..ContextConfig::default()
    }
}

/// Posts `entry` on `qp` and waits for its completion on `cq`.
fn run(qp: &mut QueuePair<'_>, cq: &mut CompletionQueue<'_>, entry: Entry<'_>) -> Completion {
    qp.post(&[entry.signaled()]).expect("post");
    cq.wait(Duration::from_secs(20))
        .expect("completion")
        .next()
        .unwrap()
}

// ---------------------------------------------------------------- ranks

fn victim_rank(socket: &str) {
    let context = Context::open(socket, config()).expect("open");
    let buffer = context.alloc(VICTIM_BYTES, 4096).unwrap();
    buffer.write_at(0, &pattern(1, VICTIM_BYTES));
    let region = context.register_buffer(&buffer).unwrap();
    let all = Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC;
    let open = context.bind_window(&region, 0, 1 << 16, all).unwrap();
    let read_only = context
        .bind_window(&region, 1 << 16, 1 << 16, Access::REMOTE_READ)
        .unwrap();
    let for_peer = context
        .bind_window_for_peer(
            &region,
            2 << 16,
            1 << 16,
            all,
            PortAddress { node: 0, port: 2 },
        )
        .unwrap();
    let secret: Vec<_> = (0..SECRET_WINDOWS as u64)
        .map(|i| {
            context
                .bind_window(&region, (i * 997) % (VICTIM_BYTES as u64 - 4096), 4096, all)
                .unwrap()
        })
        .collect();
    say(format!("window open {}", open.remote()));
    say(format!("window read-only {}", read_only.remote()));
    say(format!("window peer {}", for_peer.remote()));
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.first().copied() {
            Some("fingerprint") => {
                let mut bytes = vec![0u8; VICTIM_BYTES];
                buffer.read_at(0, &mut bytes);
                say(format!("fingerprint {}", fingerprint(&bytes)));
            }
            Some("verify-peer") => {
                let seed: u64 = words[1].parse().unwrap();
                let mut landed = vec![0u8; 4096];
                buffer.read_at(2 << 16, &mut landed);
                say(if landed == pattern(seed, 4096) {
                    "ok"
                } else {
                    "bad"
                });
            }
            Some("exit") | None => break,
            Some(other) => panic!("unknown command {other}"),
        }
    }
    drop(secret);
}

fn peer_rank(socket: &str) {
    let context = Context::open(socket, config()).expect("open");
    assert_eq!(context.info().port, 2, "the peer the window is bound to");
    let source = context.alloc(4096, 4096).unwrap();
    let region = context.register_buffer(&source).unwrap();
    let mut cq = context.create_completion_queue();
    let mut qp = context.create_queue_pair(&mut cq).unwrap();
    let mut window = None;
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.first().copied() {
            Some("window") => window = Some(words[2].parse::<RemoteWindow>().unwrap()),
            Some("write") => {
                let seed: u64 = words[1].parse().unwrap();
                source.write_at(0, &pattern(seed, 4096));
                let remote = window.expect("window given").at(0);
                let done = run(
                    &mut qp,
                    &mut cq,
                    Write::new(region.local(0, 4096).unwrap(), remote).build(),
                );
                say(format!("status {:?} {:?}", done.status, done.detail));
            }
            Some("exit") | None => break,
            Some(other) => panic!("unknown command {other}"),
        }
    }
}

/// What the attacker expects the owner to count an attempt as.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Cause {
    BadKey,
    WrongPeer,
    MissingRight,
    OutOfBounds,
}

/// Attempt `i`: its operation target, which of the five operations, and
/// the cause the owner should count.
fn attempt(
    i: u64,
    victim: &HashMap<String, RemoteWindow>,
    own: &[RemoteKey],
) -> (RemoteAddress, u64, Cause) {
    let port = victim["open"].port;
    let keys = [
        victim["open"].key,
        victim["read-only"].key,
        victim["peer"].key,
    ];
    let at = |key, offset| RemoteAddress {
        node: 0,
        port,
        key,
        offset,
    };
    let in_window = (i % 512) * 64;
    match i {
        // Random keys.
        0..400_000 => (at(RemoteKey(mix(i)), in_window), i % 5, Cause::BadKey),
        // Keys near the attacker's own.
        400_000..600_000 => {
            let n = i - 400_000;
            let key = near(own[(n % own.len() as u64) as usize], n / own.len() as u64);
            (at(key, in_window), i % 5, Cause::BadKey)
        }
        // Keys near the victim's.
        600_000..900_000 => {
            let n = i - 600_000;
            let key = near(keys[(n % 3) as usize], n / 3);
            (at(key, in_window), i % 5, Cause::BadKey)
        }
        // The window bound to port 2, from port 0.
        900_000..940_000 => (at(victim["peer"].key, in_window), i % 5, Cause::WrongPeer),
        // Writes and atomics on the read-only window.
        940_000..970_000 => (
            at(victim["read-only"].key, in_window),
            [0, 2, 3, 4][(i % 4) as usize],
            Cause::MissingRight,
        ),
        // The open window, outside it.
        _ => {
            let len = victim["open"].len;
            let offset = if i.is_multiple_of(2) {
                len - 7 + (i % 4096)
            } else {
                u64::MAX - (i % 4096)
            };
            (at(victim["open"].key, offset), i % 5, Cause::OutOfBounds)
        }
    }
}

fn attacker_rank(socket: &str) {
    let context = Context::open(socket, config()).expect("open");
    assert_eq!(context.info().port, 0);
    let source = context.alloc(4096, 4096).unwrap();
    let sink = context.alloc(4096, 4096).unwrap();
    source.write_at(0, &pattern(2, 4096));
    sink.write_at(0, &pattern(3, 4096));
    let source_region = context.register_buffer(&source).unwrap();
    let sink_region = context.register_buffer(&sink).unwrap();
    // Windows of its own, to try keys near them on the victim's port.
    let own_windows: Vec<_> = (0..16)
        .map(|_| {
            context
                .bind_window(&source_region, 0, 4096, Access::REMOTE_READ)
                .unwrap()
        })
        .collect();
    let own: Vec<RemoteKey> = own_windows.iter().map(|w| w.remote().key).collect();
    let mut cq = context.create_completion_queue();
    let mut qp = context.create_queue_pair(&mut cq).unwrap();
    let mut victim = HashMap::new();
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.first().copied() {
            Some("window") => {
                victim.insert(
                    words[1].to_owned(),
                    words[2].parse::<RemoteWindow>().unwrap(),
                );
            }
            Some("attack") => {
                let write_from = source_region.local(0, 64).unwrap();
                let read_into = sink_region.local(64, 64).unwrap();
                let entry = |i: u64| -> (Entry, Cause) {
                    let (remote, op, cause) = attempt(i, &victim, &own);
                    let entry = match op {
                        0 => Write::new(write_from, remote).build(),
                        1 => Read::new(read_into, remote).build(),
                        2 => FetchAdd::new(remote, 1).build(),
                        3 => Swap::new(remote, 0).build(),
                        _ => CompareSwap::new(remote, 0, 0).build(),
                    };
                    (entry.user_data(i).signaled(), cause)
                };
                let mut causes: HashMap<Cause, u64> = HashMap::new();
                let (mut posted, mut done, mut same) = (0u64, 0u64, 0u64);
                let mut other: Option<Completion> = None;
                while done < ATTEMPTS {
                    while posted < ATTEMPTS && posted - done + BATCH <= IN_FLIGHT {
                        let count = BATCH.min(ATTEMPTS - posted);
                        let (entries, batch_causes): (Vec<Entry>, Vec<Cause>) =
                            (posted..posted + count).map(entry).unzip();
                        match qp.post(&entries) {
                            Ok(()) => {
                                posted += count;
                                for cause in batch_causes {
                                    *causes.entry(cause).or_default() += 1;
                                }
                            }
                            // Completions not reaped yet hold ring slots.
                            Err(VerbsError::QueueFull { .. }) => break,
                            Err(error) => panic!("post: {error}"),
                        }
                    }
                    let ready = cq.wait(Duration::from_secs(20)).expect("completions");
                    for completion in ready {
                        let refused =
                            (
                                completion.status,
                                completion.detail,
                                completion.byte_len,
                                completion.value,
                            ) == (Status::RemoteAccessError, ErrorDetail::NotGranted, 0, 0);
                        if refused {
                            same += 1;
                        } else {
                            other.get_or_insert(completion);
                        }
                        done += 1;
                    }
                }
                let mut landed = vec![0u8; 4096];
                sink.read_at(0, &mut landed);
                say(format!(
                    "attempts {done} same {same} bad_key {} wrong_peer {} missing_right {} \
                     out_of_bounds {} sink_unchanged {} other {other:?}",
                    causes.get(&Cause::BadKey).copied().unwrap_or(0),
                    causes.get(&Cause::WrongPeer).copied().unwrap_or(0),
                    causes.get(&Cause::MissingRight).copied().unwrap_or(0),
                    causes.get(&Cause::OutOfBounds).copied().unwrap_or(0),
                    landed == pattern(3, 4096),
                ));
            }
            Some("exit") | None => break,
            Some(other) => panic!("unknown command {other}"),
        }
    }
}

/// Binds windows until the device refuses, then checks that the refusal
/// names the limit, changes nothing, and that a revoke makes room again.
fn binder_rank(socket: &str) {
    let context = Context::open(socket, config()).expect("open");
    let buffer = context.alloc(4096, 4096).unwrap();
    let region = context.register_buffer(&buffer).unwrap();
    let mut windows = Vec::new();
    let refusal = loop {
        match context.bind_window(&region, 0, 4096, Access::REMOTE_WRITE | Access::REMOTE_READ) {
            Ok(window) => windows.push(window),
            Err(error) => break error,
        }
        assert!(windows.len() <= 1 << 20, "no limit");
    };
    let VerbsError::Refused(completion) = &refusal else {
        panic!("unexpected error {refusal}");
    };
    // Refused many more times: still refused, the first windows still live.
    for _ in 0..1000 {
        assert!(context
            .bind_window_for_peer(
                &region,
                0,
                8,
                Access::REMOTE_READ,
                PortAddress { node: 0, port: 1 }
            )
            .is_err());
    }
    buffer.write_at(0, &pattern(5, 8));
    let source = context.alloc(4096, 4096).unwrap();
    source.write_at(0, &pattern(6, 8));
    let source_region = context.register_buffer(&source).unwrap();
    let mut cq = context.create_completion_queue();
    let mut qp = context.create_queue_pair(&mut cq).unwrap();
    let through_first = run(
        &mut qp,
        &mut cq,
        Write::new(
            source_region.local(0, 8).unwrap(),
            windows[0].remote().at(0),
        )
        .build(),
    );
    let mut landed = [0u8; 8];
    buffer.read_at(0, &mut landed);
    windows.pop().unwrap().revoke().unwrap();
    let rebound = context.bind_window(&region, 0, 8, Access::REMOTE_READ);
    let full_again = context
        .bind_window(&region, 0, 8, Access::REMOTE_READ)
        .is_err();
    let again = rebound.is_ok();
    say(format!(
        "bound {} status {:?} detail {:?} first {:?} landed {} rebind {again} full {full_again}",
        windows.len() + 1,
        completion.status,
        completion.detail,
        through_first.status,
        landed[..] == pattern(6, 8)[..],
    ));
    say(format!("message {refusal}"));
    for line in std::io::stdin().lock().lines() {
        if line.unwrap() == "exit" {
            break;
        }
    }
}

/// The rank program, started by the other tests of this file.
#[test]
#[ignore = "the rank program: the other tests of this file start it with --ignored"]
fn rank_process() {
    let (role, socket) = common::rank::role();
    match role.as_str() {
        "victim" => victim_rank(&socket),
        "peer" => peer_rank(&socket),
        "attacker" => attacker_rank(&socket),
        "binder" => binder_rank(&socket),
        other => panic!("unknown role {other}"),
    }
}

// ---------------------------------------------------------------- parent

/// The numbers after each word of an answer `word n word n ...`.
fn numbers(answer: &str) -> HashMap<String, String> {
    let words: Vec<&str> = answer.split_whitespace().collect();
    words
        .chunks(2)
        .filter_map(|pair| Some((pair[0].to_owned(), (*pair.get(1)?).to_owned())))
        .collect()
}

#[test]
fn a_million_guessed_keys_are_refused_alike_and_move_no_byte() {
    let device = DeviceProcess::start(common::device_bin(), 3, &[]).unwrap();
    let mut victim = Rank::start("victim", &device.socket(1));
    let windows: Vec<String> = (0..3).map(|_| victim.next()).collect();
    let window = |name: &str| {
        windows
            .iter()
            .find(|line| line.starts_with(&format!("window {name} ")))
            .unwrap()
            .clone()
    };

    // The peer the window is bound to may use it.
    let mut peer = Rank::start("peer", &device.socket(2));
    peer.send(&window("peer"));
    assert_eq!(peer.ask("write 42"), "status Success None");
    assert_eq!(victim.ask("verify-peer 42"), "ok");

    let before = victim.ask("fingerprint");
    let counters_before = device.port(1);
    assert_eq!(counters_before.n("refused_bad_key"), 0);

    // The attacker learns the victim's keys only to derive neighbours.
    let mut attacker = Rank::start("attacker", &device.socket(0));
    for line in &windows {
        attacker.send(line);
    }
    attacker.send("attack");
    let report = numbers(&attacker.next_within(Duration::from_secs(300)));
    let n = |key: &str| report[key].parse::<u64>().unwrap();
    assert_eq!(n("attempts"), ATTEMPTS);
    assert_eq!(
        n("same"),
        ATTEMPTS,
        "every attempt refused with RemoteAccessError/NotGranted, nothing moved; \
         first other completion: {}",
        report["other"]
    );
    assert_eq!(
        report["sink_unchanged"], "true",
        "refused reads landed nothing"
    );

    // The victim's memory is byte for byte what it was.
    assert_eq!(victim.ask("fingerprint"), before);

    // The owner's counters tell the causes apart and add up to the attempts.
    let victim_counters = device.port(1);
    let counted = |key: &str| victim_counters.n(key) - counters_before.n(key);
    assert_eq!(counted("refused_bad_key"), n("bad_key"));
    assert_eq!(counted("refused_wrong_peer"), n("wrong_peer"));
    assert_eq!(counted("refused_missing_right"), n("missing_right"));
    assert_eq!(counted("refused_out_of_bounds"), n("out_of_bounds"));
    assert_eq!(counted("refused_unregistered"), 0);
    let total: u64 = [
        "refused_bad_key",
        "refused_wrong_peer",
        "refused_missing_right",
        "refused_out_of_bounds",
        "refused_unregistered",
    ]
    .iter()
    .map(|key| counted(key))
    .sum();
    assert_eq!(total, ATTEMPTS);
    assert!(n("bad_key") >= 900_000 && n("wrong_peer") > 0 && n("out_of_bounds") > 0);
    // Refusals are the owner's to see: the attacker's port counted none.
    assert_eq!(device.port(0).n("refused_bad_key"), 0);

    // The victim's windows still serve their peer.
    assert_eq!(peer.ask("write 43"), "status Success None");
    assert_eq!(victim.ask("verify-peer 43"), "ok");
    attacker.finish();
    peer.finish();
    victim.finish();
}

#[test]
fn binding_beyond_the_window_limit_is_refused_naming_the_limit() {
    let device =
        DeviceProcess::start(common::device_bin(), 1, &["--max-windows-per-port", "64"]).unwrap();
    let mut binder = Rank::start("binder", &device.socket(0));
    assert_eq!(
        binder.next(),
        "bound 64 status LimitReached detail WindowLimit first Success landed true \
         rebind true full true"
    );
    let message = binder.next();
    assert!(
        message.contains("--max-windows-per-port") && message.contains("limit"),
        "{message}"
    );
    binder.finish();

    // The flag refuses what makes no sense.
    let out = std::process::Command::new(common::device_bin())
        .args([
            "--socket",
            "/tmp/unused.sock",
            "--max-windows-per-port",
            "0",
        ])
        .output()
        .unwrap();
    let error = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(error.contains("--max-windows-per-port"), "{error}");
    assert!(!error.contains("panicked"), "{error}");
}

#[test]
fn a_window_bound_to_a_peer_dies_with_the_peer_s_connection() {
    let device = DeviceProcess::start(common::device_bin(), 3, &[]).unwrap();
    let mut victim = Rank::start("victim", &device.socket(1));
    let windows: Vec<String> = (0..3).map(|_| victim.next()).collect();
    let for_peer = windows
        .iter()
        .find(|line| line.starts_with("window peer "))
        .unwrap()
        .clone();

    // The bound peer writes through the window.
    let mut peer = Rank::start("peer", &device.socket(2));
    peer.send(&for_peer);
    assert_eq!(peer.ask("write 7"), "status Success None");
    assert_eq!(victim.ask("verify-peer 7"), "ok");
    let before = victim.ask("fingerprint");
    peer.finish();
    assert!(device.wait_for(Duration::from_secs(5), |s| s[2].n("connected") == 0));

    // The next frontend on the same socket gets port 2 again, and the key,
    // and is refused like any other port: the binding died with the
    // connection it was made for.
    let wrong_peer_before = device.port(1).n("refused_wrong_peer");
    let mut next = Rank::start("peer", &device.socket(2));
    next.send(&for_peer);
    assert_eq!(next.ask("write 8"), "status RemoteAccessError NotGranted");
    assert_eq!(victim.ask("fingerprint"), before, "nothing landed");
    assert_eq!(
        device.port(1).n("refused_wrong_peer"),
        wrong_peer_before + 1,
        "the owner counts a wrong peer"
    );
    next.finish();
    victim.finish();
}
