//! One thread polls for every busy port: two ports exchanging writes
//! keep one port thread polling while the other sleeps (its requests
//! served by the poller, every write landing); a poller whose frontend
//! leaves hands the ports it polled for back to their own threads, whose
//! requests go on completing; two ports streaming at once land every
//! write; and a delegated port's transfer longer than one turn goes back
//! to its own thread and lands.

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

/// Keeps up to `IN_FLIGHT` signaled 8-byte writes of a counter in flight
/// into its own window through port `port` until `stop` (slot `i % 512`
/// for write `i`), then checks that every slot holds the last value
/// written there. Returns the writes done.
fn stream_writes(device: &DeviceProcess, port: usize, stop: &AtomicBool) -> u64 {
    const IN_FLIGHT: u64 = 128;
    const SLOTS: u64 = 512;
    let context = context(device, port);
    let source = context.alloc(8 * SLOTS as usize, 4096).unwrap();
    let target = context.alloc(8 * SLOTS as usize, 4096).unwrap();
    let source_region = context.register_buffer(&source).unwrap();
    let target_region = context.register_buffer(&target).unwrap();
    let window = context
        .bind_window(&target_region, 0, 8 * SLOTS, Access::REMOTE_WRITE)
        .unwrap();
    let remote = window.remote();
    let mut cq = context.create_completion_queue();
    let mut qp = context.create_queue_pair(&mut cq).unwrap();
    let value = |i: u64| (i + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ port as u64;
    let (mut posted, mut completed) = (0u64, 0u64);
    while !stop.load(Ordering::Acquire) || completed < posted {
        // A slot's source is rewritten only once its last write completed.
        while !stop.load(Ordering::Acquire) && posted - completed < IN_FLIGHT.min(SLOTS) {
            let slot = 8 * (posted % SLOTS);
            source.write_at(slot as usize, &value(posted).to_le_bytes());
            let entry = Write::new(source_region.local(slot, 8).unwrap(), remote.at(slot))
                .build()
                .user_data(posted)
                .signaled();
            qp.post(&[entry]).unwrap();
            posted += 1;
        }
        for completion in cq.wait(T).unwrap() {
            completion.result().unwrap();
            completed += 1;
        }
    }
    for i in posted.saturating_sub(SLOTS)..posted {
        let mut landed = [0u8; 8];
        target.read_at(8 * (i % SLOTS) as usize, &mut landed);
        assert_eq!(
            u64::from_le_bytes(landed),
            value(i),
            "port {port}, write {i}"
        );
    }
    posted
}

#[test]
fn two_ports_streaming_at_once_land_every_write() {
    // Both ports keep 128 writes queued: the poller finds work from both
    // in most polls and may hand the delegated one back (the rule itself
    // is tested in shared_poll's unit tests); whoever serves them, every
    // write lands.
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
    let turns = turns_by_poller(&device);
    assert!(
        turns.iter().sum::<u64>() > 0,
        "turns by the poller {turns:?}"
    );
}

#[test]
fn a_delegated_ports_long_transfer_goes_back_to_its_thread_and_lands() {
    const BIG: usize = 16 << 20;
    const TRANSFERS: u64 = 8;
    let device = DeviceProcess::start(common::device_bin(), 2, &["--poll"]).unwrap();
    let stop = AtomicBool::new(false);
    thread::scope(|scope| {
        // Port 0 keeps writing: whichever thread polls, it stays busy.
        let (started, warm) = mpsc::channel();
        let (stop_ref, device_ref) = (&stop, &device);
        let background = scope.spawn(move || keep_writing(device_ref, 0, stop_ref, 0, started));
        warm.recv_timeout(T).unwrap();
        let config = ContextConfig {
            arena_bytes: 3 * BIG + (1 << 20),
            ..ContextConfig::default()
        };
        let context = Context::open(device.socket(1), config).unwrap();
        let source = context.alloc(BIG, 4096).unwrap();
        let target = context.alloc(BIG, 4096).unwrap();
        let source_region = context.register_buffer(&source).unwrap();
        let target_region = context.register_buffer(&target).unwrap();
        let window = context
            .bind_window(&target_region, 0, BIG as u64, Access::REMOTE_WRITE)
            .unwrap();
        let mut cq = context.create_completion_queue();
        let mut qp = context.create_queue_pair(&mut cq).unwrap();
        let mut pattern = vec![0u8; BIG];
        let mut landed = vec![0u8; BIG];
        let before = turns_by_poller(&device)[1];
        for transfer in 0..TRANSFERS {
            // Small writes first, so that port 1 is delegated when the
            // long one comes (the poller takes it, and hands it back after
            // its first turn).
            for small in 0..50u64 {
                let entry = Write::new(source_region.local(0, 8).unwrap(), window.remote().at(0))
                    .build()
                    .user_data(small)
                    .signaled();
                qp.post(&[entry]).unwrap();
                for completion in cq.wait(T).unwrap() {
                    completion.result().unwrap();
                }
            }
            for (i, byte) in pattern.iter_mut().enumerate() {
                *byte = (i as u64 * 31 + transfer * 7 + (i as u64 >> 12)) as u8;
            }
            source.write_at(0, &pattern);
            let entry = Write::new(
                source_region.local(0, BIG as u32).unwrap(),
                window.remote().at(0),
            )
            .build()
            .user_data(1000 + transfer)
            .signaled();
            qp.post(&[entry]).unwrap();
            let done: Vec<_> = cq
                .wait(T)
                .unwrap_or_else(|e| panic!("transfer {transfer}: {e}"))
                .collect();
            assert_eq!(done.len(), 1, "transfer {transfer}: {done:?}");
            done[0].result().unwrap();
            target.read_at(0, &mut landed);
            assert!(landed == pattern, "transfer {transfer}: the bytes differ");
        }
        let served = turns_by_poller(&device)[1] - before;
        stop.store(true, Ordering::Release);
        background.join().unwrap();
        assert!(served > 0, "port 1 was never served by the poller");
    });
}
