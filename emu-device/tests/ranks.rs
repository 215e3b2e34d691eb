//! Two driver processes against one device: window keys exchanged between
//! processes, transfers of every size verified byte for byte, atomics from
//! both sides, error completions that leave memory untouched, and a process
//! killed in the middle of a stream.
//!
//! The test binary is also the rank program: started with `--ignored` and
//! `PINDOWN_ROLE` set, the (ignored) `rank_process` test runs a rank that
//! reads commands on stdin and answers with lines starting `@@` on stdout.

mod common;

use std::io::BufRead;
use std::time::Duration;

use common::rank::{fingerprint, pattern, say, Rank};
use common::DeviceProcess;
use pindown_driver::verbs::opcode::{CompareSwap, FetchAdd, Read, Swap, Write};
use pindown_driver::verbs::{
    CompletionQueue, Context, ContextConfig, Entry, Local, QueuePair, RemoteWindow,
};
use pindown_driver::DmaBuffer;
use pindown_pincache::CacheConfig;
use pindown_uapi::{Access, Completion, Status};

/// The target's buffer: big enough for 16 MiB at an odd offset, plus room.
const TARGET_BYTES: u64 = 36 << 20;
/// Offset of the read-only window and of the small window.
const RO_LEN: u64 = 1 << 20;
const SMALL_OFFSET: u64 = 1 << 20;
const SMALL_LEN: u64 = 4096;
/// Offset of the atomic counter (inside the read-write window).
const COUNTER_OFFSET: u64 = 2 << 20;
/// The initiator registers its source in pieces of this size.
const PIECE: u64 = 4 << 20;

// ---------------------------------------------------------------- ranks

fn config(arena_bytes: usize) -> ContextConfig {
    ContextConfig {
        arena_bytes,
        cache: CacheConfig {
            // Keep the pieces apart so a transfer crosses several pins.
            merge: false,
            ..CacheConfig::default()
        },
        ..ContextConfig::default()
    }
}

/// A queue pair and its completion queue.
struct Link<'c> {
    qp: QueuePair<'c>,
    cq: CompletionQueue<'c>,
}

impl<'c> Link<'c> {
    fn new(context: &'c Context) -> Self {
        let mut cq = context.create_completion_queue();
        let qp = context.create_queue_pair(&mut cq).expect("queue pair");
        Link { qp, cq }
    }

    /// Posts `entry` and waits for its completion.
    fn run(&mut self, entry: Entry<'_>, what: &str) -> Completion {
        self.qp
            .post(&[entry.signaled()])
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        self.cq
            .wait(Duration::from_secs(20))
            .unwrap_or_else(|e| panic!("{what}: {e}"))
            .next()
            .unwrap()
    }

    /// Posts `count` requests made by `make`, keeping up to 64 in flight.
    fn run_many<'r>(&mut self, count: u64, make: impl Fn(u64) -> Entry<'r>) {
        let (mut posted, mut done) = (0u64, 0u64);
        while done < count {
            while posted < count && posted - done < 64 {
                let batch = (count - posted).min(64 - (posted - done)).min(16);
                let entries: Vec<Entry> = (posted..posted + batch)
                    .map(|i| make(i).signaled())
                    .collect();
                self.qp.post(&entries).expect("post");
                posted += batch;
            }
            for completion in self.cq.wait(Duration::from_secs(20)).expect("completions") {
                assert!(completion.is_success(), "{completion:?}");
                done += 1;
            }
        }
    }
}

fn target_rank(socket: &str) {
    let context = Context::open(socket, config(48 << 20)).expect("open");
    let buffer = context.alloc(TARGET_BYTES as usize, 4096).unwrap();
    let region = context.register_buffer(&buffer).unwrap();
    let all = Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC;
    let rw = context.bind_window(&region, 0, TARGET_BYTES, all).unwrap();
    let ro = context
        .bind_window(&region, 0, RO_LEN, Access::REMOTE_READ)
        .unwrap();
    let small = context
        .bind_window(&region, SMALL_OFFSET, SMALL_LEN, Access::REMOTE_WRITE)
        .unwrap();
    say(format!("window rw {}", rw.remote()));
    say(format!("window ro {}", ro.remote()));
    say(format!("window small {}", small.remote()));
    let mut small = Some(small);
    let mut link = Link::new(&context);
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        let words: Vec<&str> = line.split_whitespace().collect();
        let number = |i: usize| words[i].parse::<u64>().unwrap();
        match words.first().copied() {
            Some("verify") => {
                let (offset, len, seed) = (number(1), number(2) as usize, number(3));
                let mut landed = vec![0u8; len];
                buffer.read_at(offset as usize, &mut landed);
                let expected = pattern(seed, len);
                match landed.iter().zip(&expected).position(|(a, b)| a != b) {
                    None => say("ok"),
                    Some(at) => say(format!("bad first difference at {at}")),
                }
            }
            Some("fill") => {
                buffer.write_at(number(1) as usize, &pattern(number(3), number(2) as usize));
                say("ok");
            }
            Some("fingerprint") => {
                let mut bytes = vec![0u8; TARGET_BYTES as usize];
                buffer.read_at(0, &mut bytes);
                say(format!("fingerprint {}", fingerprint(&bytes)));
            }
            Some("revoke-small") => {
                small.take().expect("bound").revoke().unwrap();
                say("ok");
            }
            Some("counter") => {
                let mut word = [0u8; 8];
                buffer.read_at(COUNTER_OFFSET as usize, &mut word);
                say(format!("value {}", u64::from_le_bytes(word)));
            }
            Some("add") => {
                // Through the device, on our own window: the same path as a peer's.
                link.run_many(number(1), |i| {
                    FetchAdd::new(rw.remote().at(COUNTER_OFFSET), 1)
                        .build()
                        .user_data(i)
                });
                say("ok");
            }
            Some("exit") | None => break,
            Some(other) => panic!("unknown command {other}"),
        }
    }
}

struct Initiator {
    context: Context,
    source: DmaBuffer,
    sink: DmaBuffer,
    unregistered: DmaBuffer,
}

fn initiator_rank(socket: &str) {
    let context = Context::open(socket, config(48 << 20)).expect("open");
    let source = context.alloc((16 << 20) + 8192, 4096).unwrap();
    let sink = context.alloc((16 << 20) + 8192, 4096).unwrap();
    let unregistered = context.alloc(8192, 4096).unwrap();
    let me = Initiator {
        context,
        source,
        sink,
        unregistered,
    };
    // Register the source and the sink in pieces: transfers cross pins.
    let mut regions = Vec::new();
    for buffer in [&me.source, &me.sink] {
        let mut offset = 0;
        while offset < buffer.len() as u64 {
            let len = PIECE.min(buffer.len() as u64 - offset);
            regions.push(
                me.context
                    .register_buffer_part(buffer, offset as usize, len as usize)
                    .unwrap(),
            );
            offset += len;
        }
    }
    say(format!("port {}", me.context.info().port));
    let mut link = Link::new(&me.context);
    let mut windows = std::collections::HashMap::new();
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        let words: Vec<&str> = line.split_whitespace().collect();
        let number = |i: usize| words[i].parse::<u64>().unwrap();
        match words.first().copied() {
            Some("window") => {
                windows.insert(
                    words[1].to_owned(),
                    words[2].parse::<RemoteWindow>().unwrap(),
                );
            }
            Some("write") => {
                let (offset, len, seed, skew) = (number(1), number(2) as u32, number(3), number(4));
                me.source
                    .write_at(skew as usize, &pattern(seed, len as usize));
                // SAFETY: the pieces registered above cover the source and
                // stay registered until the end of this function.
                let local = unsafe { Local::from_raw(me.source.iova() + skew, len) };
                let done = link.run(
                    Write::new(local, windows["rw"].at(offset))
                        .build()
                        .user_data(seed),
                    "write",
                );
                assert_eq!(
                    (done.status, done.byte_len, done.user_data),
                    (Status::Success, len, seed),
                    "{done:?}"
                );
                say("ok");
            }
            Some("read") => {
                let (offset, len, seed, skew) = (number(1), number(2) as u32, number(3), number(4));
                // SAFETY: as for writes, with the sink.
                let local = unsafe { Local::from_raw(me.sink.iova() + skew, len) };
                let done = link.run(
                    Read::new(local, windows["rw"].at(offset))
                        .build()
                        .user_data(seed),
                    "read",
                );
                assert!(done.is_success(), "{done:?}");
                let mut landed = vec![0u8; len as usize];
                me.sink.read_at(skew as usize, &mut landed);
                say(if landed == pattern(seed, len as usize) {
                    "ok"
                } else {
                    "bad"
                });
            }
            Some("add") => {
                link.run_many(number(1), |i| {
                    FetchAdd::new(windows["rw"].at(COUNTER_OFFSET), 1)
                        .build()
                        .user_data(i)
                });
                say("ok");
            }
            Some("atomics") => {
                let word = windows["rw"].at(COUNTER_OFFSET);
                let current = number(1);
                let swapped = link.run(CompareSwap::new(word, current, 7).build(), "cas");
                let refused = link.run(CompareSwap::new(word, 1, 9).build(), "cas");
                let exchanged = link.run(Swap::new(word, 11).build(), "swap");
                say(format!(
                    "old {} {} {}",
                    swapped.value, refused.value, exchanged.value
                ));
            }
            Some("bad") => {
                let what = words[1];
                // SAFETY: as for writes.
                let local = unsafe { Local::from_raw(me.source.iova(), 64) };
                let entry = match what {
                    "read-only" => Write::new(local, windows["ro"].at(0)).build(),
                    "out-of-window" => {
                        Write::new(local, windows["small"].at(SMALL_LEN - 8)).build()
                    }
                    "revoked" => Write::new(local, windows["small"].at(0)).build(),
                    "unregistered" => {
                        // SAFETY: nothing registers this buffer: the device
                        // must refuse the request and touch nothing.
                        let unregistered = unsafe { Local::from_raw(me.unregistered.iova(), 64) };
                        Write::new(unregistered, windows["rw"].at(0)).build()
                    }
                    "unknown-key" => {
                        let forged = RemoteWindow {
                            key: pindown_uapi::RemoteKey(0x7fff_fff0),
                            ..windows["rw"]
                        };
                        Write::new(local, forged.at(0)).build()
                    }
                    other => panic!("unknown error case {other}"),
                };
                let done = link.run(entry.user_data(99), what);
                say(format!(
                    "status {:?} {:?} {}",
                    done.status, done.detail, done.user_data
                ));
            }
            Some("stream") => {
                say("streaming");
                // SAFETY: as for writes.
                let local = unsafe { Local::from_raw(me.source.iova(), 1 << 20) };
                loop {
                    link.run(
                        Write::new(local, windows["rw"].at(8 << 20)).build(),
                        "stream",
                    );
                }
            }
            Some("exit") | None => break,
            Some(other) => panic!("unknown command {other}"),
        }
    }
    drop(regions);
}

/// The rank program, started by the other tests of this file.
#[test]
#[ignore = "the rank program: the other tests of this file start it with --ignored"]
fn rank_process() {
    let (role, socket) = common::rank::role();
    match role.as_str() {
        "target" => target_rank(&socket),
        "initiator" => initiator_rank(&socket),
        other => panic!("unknown role {other}"),
    }
}

// ---------------------------------------------------------------- parent

/// A device with two ports, a target rank on port 1 and an initiator on
/// port 0 that knows the target's windows.
fn pair() -> (DeviceProcess, Rank, Rank, Vec<String>) {
    let device = DeviceProcess::start(common::device_bin(), 2, &[]).unwrap();
    let mut target = Rank::start("target", &device.socket(1));
    let windows: Vec<String> = (0..3).map(|_| target.next()).collect();
    let initiator = initiator_for(&device, &windows);
    (device, target, initiator, windows)
}

/// An initiator on port 0 that knows `windows`.
fn initiator_for(device: &DeviceProcess, windows: &[String]) -> Rank {
    let mut initiator = Rank::start("initiator", &device.socket(0));
    assert!(initiator.next().starts_with("port "));
    for window in windows {
        initiator.send(window);
    }
    initiator
}

#[test]
fn transfers_of_every_size_arrive_intact_across_processes() {
    let (_device, mut target, mut initiator, _) = pair();
    let sizes = [1u64, 7, 4096, 1 << 20, 16 << 20];
    for (i, &len) in sizes.iter().enumerate() {
        let seed = 100 + i as u64;
        // Odd offsets on both sides; the 16 MiB source spans five pins.
        let (offset, skew) = (3 * 4096 + 5 + i as u64 * 17, 4093 - i as u64 * 3);
        assert_eq!(
            initiator.ask(&format!("write {offset} {len} {seed} {skew}")),
            "ok"
        );
        assert_eq!(
            target.ask(&format!("verify {offset} {len} {seed}")),
            "ok",
            "write of {len} bytes"
        );
        let read_offset = (18 << 20) + 7 + i as u64;
        assert_eq!(
            target.ask(&format!("fill {read_offset} {len} {}", seed + 50)),
            "ok"
        );
        assert_eq!(
            initiator.ask(&format!("read {read_offset} {len} {} {skew}", seed + 50)),
            "ok",
            "read of {len} bytes"
        );
    }
    initiator.finish();
    target.finish();
}

#[test]
fn fetch_adds_from_two_processes_sum_exactly_and_swaps_return_old_values() {
    let (_device, mut target, mut initiator, _) = pair();
    initiator.send("add 100000");
    target.send("add 100000");
    assert_eq!(initiator.next(), "ok");
    assert_eq!(target.next(), "ok");
    assert_eq!(target.ask("counter"), "value 200000");
    assert_eq!(initiator.ask("atomics 200000"), "old 200000 7 7");
    assert_eq!(target.ask("counter"), "value 11");
    initiator.finish();
    target.finish();
}

#[test]
fn refused_accesses_complete_with_errors_and_leave_memory_unchanged() {
    let (_device, mut target, mut initiator, _) = pair();
    let before = target.ask("fingerprint");
    let expect = |initiator: &mut Rank, case: &str, status: &str, detail: &str| {
        let answer = initiator.ask(&format!("bad {case}"));
        assert_eq!(answer, format!("status {status} {detail} 99"), "{case}");
    };
    // Every remote refusal gets one and the same answer.
    for case in ["read-only", "out-of-window", "unknown-key"] {
        expect(&mut initiator, case, "RemoteAccessError", "NotGranted");
    }
    expect(
        &mut initiator,
        "unregistered",
        "LocalProtectionError",
        "Unregistered",
    );
    assert_eq!(target.ask("revoke-small"), "ok");
    expect(&mut initiator, "revoked", "RemoteAccessError", "NotGranted");
    assert_eq!(target.ask("fingerprint"), before, "target memory unchanged");
    initiator.finish();
    target.finish();
}

#[test]
fn a_killed_process_leaves_the_device_serving_and_its_port_reusable() {
    let (device, mut target, mut initiator, windows) = pair();
    assert_eq!(initiator.ask("stream"), "streaming");
    std::thread::sleep(Duration::from_millis(200));
    // SIGKILL in the middle of the stream.
    initiator.child.kill().unwrap();
    initiator.child.wait().unwrap();
    drop(initiator);
    // The other port keeps working.
    assert_eq!(target.ask("add 1000"), "ok");
    assert_eq!(target.ask("counter"), "value 1000");
    // A new process takes the freed port and reaches the target.
    let mut again = initiator_for(&device, &windows);
    assert_eq!(again.ask("write 4099 65536 7 11"), "ok");
    assert_eq!(target.ask("verify 4099 65536 7"), "ok");
    again.finish();
    target.finish();
}
