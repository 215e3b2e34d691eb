//! One thread polls for every busy port: two ports exchanging writes
//! keep one port thread polling while the other sleeps (its requests
//! served by the poller, every write landing); a poller whose frontend
//! leaves hands the ports it polled for back to their own threads, whose
//! requests go on completing; and two ports streaming at once, more than
//! one thread keeps up with, get their own threads back.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::Duration;

use common::DeviceProcess;
use pindown_driver::verbs::opcode::Write;
use pindown_driver::verbs::{Context, ContextConfig, RemoteWindow};
use pindown_uapi::Access;

const T: Duration = Duration::from_secs(10);

/// Turns of each port's send queues served by the shared poller.
fn turns_by_poller(device: &DeviceProcess) -> [u64; 2] {
    let status = device.status().unwrap();
    [0, 1].map(|i| status[i].n("rdma_turns_by_poller"))
}

fn context(device: &DeviceProcess, port: usize) -> Context {
    let config = ContextConfig {
        arena_bytes: 1 << 20,
        ..ContextConfig::default()
    };
    Context::open(device.socket(port), config).unwrap()
}

/// `rounds` round trips between ports 0 and 1: each side writes the
/// round's number into the other's window and waits until the other's
/// write of it has landed in its own. Returns when both sides are done.
fn ping_pong(device: &DeviceProcess, rounds: u64) {
    let (to_1, from_0) = mpsc::channel::<RemoteWindow>();
    let (to_0, from_1) = mpsc::channel::<RemoteWindow>();
    let sides = [(0usize, to_1, from_1), (1, to_0, from_0)];
    thread::scope(|scope| {
        for (port, give, take) in sides {
            scope.spawn(move || {
                let context = context(device, port);
                let source = context.alloc(4096, 4096).unwrap();
                let target = context.alloc(4096, 4096).unwrap();
                target.fill(0);
                let source_region = context.register_buffer(&source).unwrap();
                let target_region = context.register_buffer(&target).unwrap();
                let window = context
                    .bind_window(&target_region, 0, 4096, Access::REMOTE_WRITE)
                    .unwrap();
                give.send(window.remote()).unwrap();
                let peer = take.recv_timeout(T).unwrap();
                let mut cq = context.create_completion_queue();
                let mut qp = context.create_queue_pair(&mut cq).unwrap();
                let landed = |round: u64| {
                    let mut word = [0u8; 8];
                    target.read_at(0, &mut word);
                    u64::from_le_bytes(word) == round
                };
                for round in 1..=rounds {
                    if port == 1 {
                        wait_until(|| landed(round), "port 1 waits for the ping", round);
                    }
                    source.write_at(0, &round.to_le_bytes());
                    let entry = Write::new(source_region.local(0, 8).unwrap(), peer.at(0))
                        .build()
                        .user_data(round)
                        .signaled();
                    qp.post(&[entry]).unwrap();
                    let done: Vec<_> = cq.wait(T).unwrap().collect();
                    assert_eq!(done.len(), 1, "port {port}, round {round}: {done:?}");
                    done[0].result().unwrap();
                    if port == 0 {
                        wait_until(|| landed(round), "port 0 waits for the pong", round);
                    }
                }
            });
        }
    });
}

fn wait_until(mut done: impl FnMut() -> bool, what: &str, round: u64) {
    let deadline = std::time::Instant::now() + T;
    while !done() {
        assert!(
            std::time::Instant::now() < deadline,
            "{what}, round {round}: never landed"
        );
        std::hint::spin_loop();
    }
}

#[test]
fn two_ports_exchanging_writes_leave_one_to_the_others_thread_and_every_write_lands() {
    const ROUNDS: u64 = 2000;
    let device = DeviceProcess::start(common::device_bin(), 2, &[]).unwrap();
    ping_pong(&device, ROUNDS);
    let turns = turns_by_poller(&device);
    // One port's thread polls; the other sleeps once it has seen that, and
    // the poller takes its requests from then on (a turn that did work
    // per write, give or take the ones its own thread took after a kick).
    assert!(
        turns.iter().sum::<u64>() >= ROUNDS / 4,
        "{ROUNDS} round trips; turns served by the shared poller, by port: {turns:?}"
    );
}

#[test]
fn with_solo_polling_each_port_serves_itself_and_every_write_lands() {
    const ROUNDS: u64 = 500;
    let device = DeviceProcess::start(common::device_bin(), 2, &["--solo-polling"]).unwrap();
    ping_pong(&device, ROUNDS);
    assert_eq!(turns_by_poller(&device), [0, 0]);
}

/// Posts signaled 8-byte writes of a counter into its own window through
/// port `port` until `stop`, then `after` more; checks each landed.
/// Returns the writes done.
fn keep_writing(
    device: &DeviceProcess,
    port: usize,
    stop: &AtomicBool,
    after: u64,
    started: mpsc::Sender<()>,
) -> u64 {
    let context = context(device, port);
    let source = context.alloc(4096, 4096).unwrap();
    let target = context.alloc(4096, 4096).unwrap();
    let source_region = context.register_buffer(&source).unwrap();
    let target_region = context.register_buffer(&target).unwrap();
    let window = context
        .bind_window(&target_region, 0, 4096, Access::REMOTE_WRITE)
        .unwrap();
    let remote = window.remote();
    let mut cq = context.create_completion_queue();
    let mut qp = context.create_queue_pair(&mut cq).unwrap();
    let mut write = |i: u64| {
        let value = (i + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ port as u64;
        source.write_at(0, &value.to_le_bytes());
        let entry = Write::new(source_region.local(0, 8).unwrap(), remote.at(8 * (i % 512)))
            .build()
            .user_data(i)
            .signaled();
        qp.post(&[entry]).unwrap();
        let done: Vec<_> = cq
            .wait(T)
            .unwrap_or_else(|e| panic!("port {port}, write {i}: {e}"))
            .collect();
        assert_eq!(done.len(), 1, "port {port}, write {i}: {done:?}");
        done[0].result().unwrap();
        let mut landed = [0u8; 8];
        target.read_at(8 * (i % 512) as usize, &mut landed);
        assert_eq!(u64::from_le_bytes(landed), value, "port {port}, write {i}");
    };
    let mut i = 0;
    while !stop.load(Ordering::Acquire) {
        write(i);
        i += 1;
        if i == 100 {
            started.send(()).unwrap();
        }
    }
    for _ in 0..after {
        write(i);
        i += 1;
    }
    i
}

#[test]
fn a_poller_whose_frontend_leaves_hands_the_ports_back_and_their_writes_go_on() {
    const AFTER: u64 = 500;
    // Busy-poll: a poller polls for a millisecond after its last work, so
    // it is still the poller when its frontend leaves.
    let device = DeviceProcess::start(common::device_bin(), 2, &["--poll"]).unwrap();
    let stops = [
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    ];
    thread::scope(|scope| {
        let (started, warm) = mpsc::channel();
        let writers: Vec<_> = (0..2)
            .map(|port| {
                let (stop, started, device) = (Arc::clone(&stops[port]), started.clone(), &device);
                scope.spawn(move || keep_writing(device, port, &stop, AFTER, started))
            })
            .collect();
        warm.recv_timeout(T).unwrap();
        warm.recv_timeout(T).unwrap();
        // Which port is delegated: the one whose turns the poller serves.
        let before = turns_by_poller(&device);
        thread::sleep(Duration::from_millis(200));
        let after = turns_by_poller(&device);
        let delegated = if after[1] - before[1] >= after[0] - before[0] {
            1
        } else {
            0
        };
        let poller = 1 - delegated;
        assert!(
            after[delegated] > before[delegated],
            "both ports writing: turns by the poller went {before:?} -> {after:?}"
        );
        // The poller's frontend leaves while the other port writes; the
        // delegated port's writes must go on after it has gone (its thread
        // handed back its rings).
        let mut writers: Vec<_> = writers.into_iter().map(Some).collect();
        stops[poller].store(true, Ordering::Release);
        let poller_writes = writers[poller].take().unwrap().join().unwrap();
        assert!(
            poller_writes > AFTER,
            "port {poller}: {poller_writes} writes"
        );
        stops[delegated].store(true, Ordering::Release);
        let writes = writers[delegated].take().unwrap().join().unwrap();
        assert!(writes > AFTER, "port {delegated}: {writes} writes");
    });
}

/// Posts batches of `BATCH` signaled 8-byte writes into its own window
/// through port `port` until `stop`; checks that each batch landed.
fn stream_writes(device: &DeviceProcess, port: usize, stop: &AtomicBool) -> u64 {
    const BATCH: u64 = 16;
    let context = context(device, port);
    let source = context.alloc(4096, 4096).unwrap();
    let target = context.alloc(4096, 4096).unwrap();
    let source_region = context.register_buffer(&source).unwrap();
    let target_region = context.register_buffer(&target).unwrap();
    let window = context
        .bind_window(&target_region, 0, 4096, Access::REMOTE_WRITE)
        .unwrap();
    let remote = window.remote();
    let mut cq = context.create_completion_queue();
    let mut qp = context.create_queue_pair(&mut cq).unwrap();
    let mut batches = 0u64;
    while !stop.load(Ordering::Acquire) {
        let values: Vec<u64> = (0..BATCH)
            .map(|i| (batches * BATCH + i + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15))
            .collect();
        let entries: Vec<_> = (0..BATCH)
            .map(|i| {
                let slot = 8 * i;
                source.write_at(slot as usize, &values[i as usize].to_le_bytes());
                Write::new(source_region.local(slot, 8).unwrap(), remote.at(slot))
                    .build()
                    .user_data(i)
                    .signaled()
            })
            .collect();
        qp.post(&entries).unwrap();
        let mut done = 0;
        while done < BATCH {
            for completion in cq.wait(T).unwrap() {
                completion.result().unwrap();
                done += 1;
            }
        }
        for (i, value) in values.iter().enumerate() {
            let mut landed = [0u8; 8];
            target.read_at(8 * i, &mut landed);
            assert_eq!(
                u64::from_le_bytes(landed),
                *value,
                "port {port}, batch {batches}"
            );
        }
        batches += 1;
    }
    batches
}

#[test]
fn two_ports_streaming_at_once_get_their_own_threads_back() {
    // Both ports keep 16 writes queued: the poller finds work from both in
    // most polls, and hands the delegated one back (which delegates again
    // once idle). With the hand-back gone, the count stays 0.
    let device = DeviceProcess::start(common::device_bin(), 2, &["--poll"]).unwrap();
    let stop = AtomicBool::new(false);
    thread::scope(|scope| {
        let writers: Vec<_> = (0..2)
            .map(|port| {
                let (stop, device) = (&stop, &device);
                scope.spawn(move || stream_writes(device, port, stop))
            })
            .collect();
        thread::sleep(Duration::from_millis(500));
        stop.store(true, Ordering::Release);
        for (port, writer) in writers.into_iter().enumerate() {
            assert!(writer.join().unwrap() > 0, "port {port} wrote nothing");
        }
    });
    let status = device.status().unwrap();
    let back: Vec<u64> = (0..2)
        .map(|i| status[i].n("rdma_handed_back_busy"))
        .collect();
    let turns = turns_by_poller(&device);
    assert!(
        back.iter().sum::<u64>() > 0,
        "handed back busy {back:?}, turns {turns:?}"
    );
}
