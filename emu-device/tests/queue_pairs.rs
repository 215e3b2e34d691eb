//! Several queue pairs and completion queues per context, over a real
//! device process: threads posting and polling at once on their own queue
//! pairs, completion queues shared by several queue pairs, rings handed
//! from a dropped queue pair to the next one, the per-port limit, and the
//! explicit and implicit ends of regions and windows.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::DeviceProcess;
use pindown_driver::verbs::opcode::{FetchAdd, Nop, Read, Write};
use pindown_driver::verbs::{
    Completion, CompletionQueue, Context, ContextConfig, Local, QueuePair, VerbsError,
};
use pindown_uapi::{Access, ErrorDetail, Opcode, Status};

const T: Duration = Duration::from_secs(10);

fn config() -> ContextConfig {
    ContextConfig {
        arena_bytes: 8 << 20,
        ..ContextConfig::default()
    }
}

/// Reaps from `cq` until `count` completions have arrived.
fn collect(cq: &mut CompletionQueue<'_>, count: usize) -> Vec<Completion> {
    let mut seen = Vec::new();
    while seen.len() < count {
        let ready = cq.wait(T).unwrap_or_else(|e| {
            panic!("{} of {count} completions: {e}", seen.len());
        });
        seen.extend(ready);
    }
    seen
}

/// Polls `cq` until it holds no ring (those of dropped queue pairs go back
/// once their last completion is reaped), asserting that nothing more
/// arrives meanwhile; fails after `T` naming `what`.
fn await_rings_back(cq: &mut CompletionQueue<'_>, what: &str) {
    let deadline = std::time::Instant::now() + T;
    while cq.rings() > 0 {
        assert_eq!(
            cq.poll().unwrap().count(),
            0,
            "{what}: nothing past the last"
        );
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: the ring stays held"
        );
        std::thread::sleep(Duration::from_micros(100));
    }
}

/// The thread's tag in the top byte of its requests' user data.
fn tag(thread: u64, i: u64) -> u64 {
    (thread << 56) | i
}

#[test]
fn threads_with_their_own_queue_pairs_post_and_poll_at_once_and_counters_add_up() {
    const THREADS: u64 = 2;
    const ADDS: u64 = 20_000;
    const SLICE: usize = 64 * 1024;
    let device = DeviceProcess::start(common::device_bin(), 2, &[]).unwrap();
    let initiator = Context::open(device.socket(0), config()).unwrap();
    let owner = Context::open(device.socket(1), config()).unwrap();
    // The window: a counter page, then one slice per thread.
    let target = owner.alloc(4096 + THREADS as usize * SLICE, 4096).unwrap();
    target.fill(0);
    let target_region = owner.register_buffer(&target).unwrap();
    let all = Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC;
    let window = owner
        .bind_window(&target_region, 0, target.len() as u64, all)
        .unwrap();
    let remote = window.remote();

    let numbers = std::thread::scope(|scope| {
        let threads: Vec<_> = (0..THREADS)
            .map(|thread| {
                let initiator = &initiator;
                scope.spawn(move || {
                    let mut cq = initiator.create_completion_queue();
                    let mut qp = initiator.create_queue_pair(&mut cq).unwrap();
                    let source = initiator.alloc(SLICE, 4096).unwrap();
                    let bytes: Vec<u8> = (0..SLICE)
                        .map(|i| (i as u64 * 7 + thread * 101) as u8)
                        .collect();
                    source.write_at(0, &bytes);
                    let region = initiator.register_buffer(&source).unwrap();
                    let slice = remote.at(4096 + thread * SLICE as u64);
                    let write = Write::new(region.local(0, SLICE as u32).unwrap(), slice);
                    qp.post(&[write
                        .build()
                        .user_data(tag(thread, u64::MAX >> 8))
                        .signaled()])
                        .unwrap();
                    // Fetch-adds on the shared counter, 16 in flight.
                    let (mut posted, mut done) = (0u64, 0u64);
                    let mut completions = Vec::new();
                    while done < ADDS + 1 {
                        while posted < ADDS && posted + 1 - done < 16 {
                            let add = FetchAdd::new(remote.at(0), 1).build();
                            qp.post(&[add.user_data(tag(thread, posted)).signaled()])
                                .unwrap();
                            posted += 1;
                        }
                        for completion in cq.wait(T).unwrap() {
                            completions.push(completion);
                            done += 1;
                        }
                    }
                    (qp.number(), completions, bytes)
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().unwrap())
            .collect::<Vec<_>>()
    });

    assert_ne!(numbers[0].0, numbers[1].0, "each thread has its own pair");
    let mut old_values = Vec::new();
    for (thread, (_, completions, bytes)) in numbers.iter().enumerate() {
        let thread = thread as u64;
        // Every completion on this thread's queue is one of its own.
        assert_eq!(completions.len() as u64, ADDS + 1);
        assert!(completions.iter().all(|c| c.user_data >> 56 == thread));
        assert!(completions.iter().all(|c| c.result().is_ok()));
        // In the order posted: the write first, then the adds.
        assert_eq!(completions[0].opcode, Some(Opcode::Write));
        let adds: Vec<u64> = completions[1..].iter().map(|c| c.user_data).collect();
        assert_eq!(adds, (0..ADDS).map(|i| tag(thread, i)).collect::<Vec<_>>());
        old_values.extend(completions[1..].iter().map(|c| c.value));
        let mut landed = vec![0u8; SLICE];
        target.read_at(4096 + thread as usize * SLICE, &mut landed);
        assert!(landed == *bytes, "thread {thread}'s write");
    }
    // The counter counts every add of both threads, and each add saw a
    // different old value: 0, 1, ..., 2 ADDS - 1.
    let mut counter = [0u8; 8];
    target.read_at(0, &mut counter);
    assert_eq!(u64::from_le_bytes(counter), THREADS * ADDS);
    old_values.sort_unstable();
    assert_eq!(old_values, (0..THREADS * ADDS).collect::<Vec<_>>());
}

#[test]
fn a_shared_completion_queue_gets_every_completion_of_its_queue_pairs_and_no_other() {
    let device = DeviceProcess::start(common::device_bin(), 1, &[]).unwrap();
    let context = Context::open(device.socket(0), config()).unwrap();
    let mut shared = context.create_completion_queue();
    let mut pairs: Vec<QueuePair<'_>> = (0..3)
        .map(|_| context.create_queue_pair(&mut shared).unwrap())
        .collect();
    let mut alone = context.create_completion_queue();
    let mut other = context.create_queue_pair(&mut alone).unwrap();
    assert_eq!(shared.rings(), 3);
    assert_eq!(alone.rings(), 1);
    // Fewer than a ring holds: nothing is reaped until all are posted.
    const EACH: u64 = 200;
    for i in 0..EACH {
        for (q, qp) in pairs.iter_mut().enumerate() {
            qp.post(&[Nop::new().build().user_data(tag(q as u64, i)).signaled()])
                .unwrap();
        }
        other
            .post(&[Nop::new().build().user_data(tag(9, i)).signaled()])
            .unwrap();
    }
    let seen = collect(&mut shared, 3 * EACH as usize);
    let mut by_pair: HashMap<u64, Vec<u64>> = HashMap::new();
    for completion in &seen {
        by_pair
            .entry(completion.user_data >> 56)
            .or_default()
            .push(completion.user_data & 0xff_ffff);
    }
    assert_eq!(by_pair.len(), 3, "only the shared queue's pairs");
    for (q, order) in &by_pair {
        assert_eq!(*order, (0..EACH).collect::<Vec<_>>(), "pair {q} in order");
    }
    let theirs = collect(&mut alone, EACH as usize);
    assert!(theirs.iter().all(|c| c.user_data >> 56 == 9));
    assert_eq!(shared.poll().unwrap().count(), 0, "nothing more");
    // poll_into appends to what the caller holds.
    let mut out = vec![seen[0]];
    pairs[0]
        .post(&[Nop::new().build().user_data(7).signaled()])
        .unwrap();
    while out.len() < 2 {
        shared.poll_into(&mut out).unwrap();
    }
    assert_eq!((out.len(), out[1].user_data), (2, 7));
}

#[test]
fn queue_pairs_are_bounded_and_a_dropped_one_s_rings_serve_the_next_cleanly() {
    // The admin pair and two I/O pairs.
    let device =
        DeviceProcess::start(common::device_bin(), 1, &["--rdma-queue-pairs", "3"]).unwrap();
    let context = Context::open(device.socket(0), config()).unwrap();
    assert_eq!(context.info().rdma_queue_pairs, 3);
    assert_eq!(context.queue_pair_limit(), 2);
    let mut first_cq = context.create_completion_queue();
    let mut first = context.create_queue_pair(&mut first_cq).unwrap();
    let mut second_cq = context.create_completion_queue();
    let second = context.create_queue_pair(&mut second_cq).unwrap();
    let refused = context.create_queue_pair(&mut second_cq).unwrap_err();
    assert!(
        matches!(refused, VerbsError::NoQueuePair { pairs: 2 }),
        "{refused}"
    );
    assert!(refused.to_string().contains("--rdma-queue-pairs"));

    // The first queue pair posts, then goes away with its completions
    // unreaped: they still arrive on its completion queue.
    for i in 0..50 {
        first
            .post(&[Nop::new().build().user_data(1000 + i).signaled()])
            .unwrap();
    }
    let number = first.number();
    drop(first);
    let leftovers = collect(&mut first_cq, 50);
    assert_eq!(
        leftovers.iter().map(|c| c.user_data).collect::<Vec<_>>(),
        (1000..1050).collect::<Vec<_>>(),
        "the dropped pair's completions, and no marker"
    );
    // Its last completion reaped, the completion queue lets the ring go.
    await_rings_back(&mut first_cq, "the first queue pair");

    // The next queue pair gets those rings (on a new completion queue),
    // and sees nothing of the old one.
    let mut third_cq = context.create_completion_queue();
    let mut third = context.create_queue_pair(&mut third_cq).unwrap();
    assert_eq!(third.number(), number, "the freed pair is reused");
    third
        .post(&[Nop::new().build().user_data(1).signaled()])
        .unwrap();
    let fresh = collect(&mut third_cq, 1);
    assert_eq!(fresh[0].user_data, 1);
    assert_eq!(third_cq.poll().unwrap().count(), 0);

    // Posted, never reaped, and both queues dropped: the next queue pair
    // on those rings sees none of it.
    for i in 0..50 {
        third
            .post(&[Nop::new().build().user_data(5000 + i).signaled()])
            .unwrap();
    }
    drop(third);
    drop(third_cq);
    let mut fourth_cq = context.create_completion_queue();
    let mut fourth = context.create_queue_pair(&mut fourth_cq).unwrap();
    assert_eq!(fourth.number(), number);
    fourth
        .post(&[Nop::new().build().user_data(2).signaled()])
        .unwrap();
    assert_eq!(collect(&mut fourth_cq, 1)[0].user_data, 2);
    assert_eq!(fourth_cq.poll().unwrap().count(), 0);

    // A completion queue of another context is refused.
    let device_b = DeviceProcess::start(common::device_bin(), 1, &[]).unwrap();
    let other = Context::open(device_b.socket(0), config()).unwrap();
    let mut foreign = other.create_completion_queue();
    drop(second);
    let refused = context.create_queue_pair(&mut foreign).unwrap_err();
    assert!(
        matches!(refused, VerbsError::OtherContext { .. }),
        "{refused}"
    );
}

#[test]
fn regions_and_windows_end_explicitly_with_errors_reported_or_when_dropped() {
    let device = DeviceProcess::start(common::device_bin(), 2, &[]).unwrap();
    let initiator = Context::open(device.socket(0), config()).unwrap();
    let owner = Context::open(
        device.socket(1),
        ContextConfig {
            control_timeout: Duration::from_millis(300),
            ..config()
        },
    )
    .unwrap();
    let target = owner.alloc(4096, 4096).unwrap();
    target.fill(0x11);
    let target_region = owner.register_buffer(&target).unwrap();
    let mut cq = initiator.create_completion_queue();
    let mut qp = initiator.create_queue_pair(&mut cq).unwrap();
    let sink = initiator.alloc(4096, 4096).unwrap();
    let sink_region = initiator.register_buffer(&sink).unwrap();
    let mut read = |remote| {
        sink.fill(0);
        let entry = Read::new(sink_region.local(0, 64).unwrap(), remote).build();
        qp.post(&[entry.signaled()]).unwrap();
        let done = collect(&mut cq, 1)[0];
        let mut bytes = [0u8; 64];
        sink.read_at(0, &mut bytes);
        (done, bytes)
    };

    // Revoked explicitly: the key stops working.
    let window = owner
        .bind_window(&target_region, 0, 4096, Access::REMOTE_READ)
        .unwrap();
    let remote = window.remote();
    assert_eq!(read(remote.at(0)).1, [0x11; 64]);
    window.revoke().unwrap();
    let (refused, bytes) = read(remote.at(0));
    let error = refused.result().unwrap_err();
    assert_eq!(
        (error.status, error.detail),
        (Status::RemoteAccessError, ErrorDetail::NotGranted)
    );
    assert!(error.to_string().contains("READ"), "{error}");
    assert_eq!(bytes, [0; 64], "nothing landed");

    // Dropped: revoked all the same.
    let window = owner
        .bind_window(&target_region, 0, 4096, Access::REMOTE_READ)
        .unwrap();
    let remote = window.remote();
    assert!(read(remote.at(0)).0.result().is_ok());
    drop(window);
    assert_eq!(owner.window_revoke_failures(), 0);
    assert_eq!(
        read(remote.at(0)).0.status,
        Status::RemoteAccessError,
        "a dropped window is revoked"
    );

    // Deregistration: explicit, then the memory registers again (a cache
    // hit: the pages stayed pinned).
    let hits = initiator.registration_stats().hits;
    sink_region.deregister().unwrap();
    let again = initiator.register_buffer(&sink).unwrap();
    assert_eq!(initiator.registration_stats().hits, hits + 1);
    again.deregister().unwrap();

    // A device that stops answering (its process stopped, its connection
    // open): an explicit call fails after the control timeout, naming it.
    let window = owner
        .bind_window(&target_region, 0, 4096, Access::REMOTE_READ)
        .unwrap();
    assert!(device.stop(T), "the device did not stop");
    let started = std::time::Instant::now();
    let error = bind_read_window(&owner, &target_region).unwrap_err();
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert!(
        matches!(error, VerbsError::ControlTimeout { .. }),
        "{error}"
    );
    assert!(error.to_string().contains("control_timeout"), "{error}");
    device.resume();
    let mut idle_cq = owner.create_completion_queue();
    let idle_qp = owner.create_queue_pair(&mut idle_cq).unwrap();

    // A window dropped once the device is gone: the revoke cannot be
    // answered; the drop logs and counts it, at once (the device's
    // connection hung up), not after the control timeout.
    let mut device = device;
    assert!(device.terminate(T));
    let started = std::time::Instant::now();
    drop(window);
    assert_eq!(owner.window_revoke_failures(), 1);
    // An explicit call reports the same as an error saying so.
    let error = bind_read_window(&owner, &target_region).unwrap_err();
    assert!(started.elapsed() < Duration::from_millis(300));
    assert!(matches!(error, VerbsError::DeviceGone { .. }), "{error}");
    assert!(
        error.to_string().contains("closed its connection"),
        "{error}"
    );
    // A wait for completions that can no longer come ends at once too.
    let started = std::time::Instant::now();
    let error = idle_cq
        .wait(Duration::from_secs(10))
        .map(|ready| ready.count())
        .unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(2));
    assert!(matches!(error, VerbsError::HungUp), "{error}");
    drop(idle_qp);
}

/// Binds a read window over all of `region`.
fn bind_read_window<'r>(
    owner: &'r Context,
    region: &'r pindown_driver::verbs::MemoryRegion<'_>,
) -> Result<pindown_driver::verbs::MemoryWindow<'r>, VerbsError> {
    owner.bind_window(region, 0, region.len(), Access::REMOTE_READ)
}

/// Posts signalled NOPs on `qp` (user data from `first` on), never
/// reaping, until the send ring refuses one: the device has stopped with
/// the completion ring full behind it. How many went in.
fn fill_both_rings(qp: &mut QueuePair<'_>, first: u64) -> u64 {
    let deadline = std::time::Instant::now() + T;
    let mut posted = 0;
    loop {
        match qp.post(&[Nop::new().build().user_data(first + posted).signaled()]) {
            Ok(()) => posted += 1,
            Err(VerbsError::QueueFull { .. }) => {
                // Full for good only once the device has stopped taking.
                std::thread::sleep(Duration::from_millis(50));
                if qp
                    .post(&[Nop::new().build().user_data(first + posted).signaled()])
                    .is_ok()
                {
                    posted += 1;
                    continue;
                }
                return posted;
            }
            Err(other) => panic!("posting NOP {posted}: {other}"),
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the rings never filled"
        );
    }
}

#[test]
fn a_queue_pair_dropped_with_both_rings_full_leaves_its_rings_to_the_next() {
    // The admin pair and one I/O pair: the next queue pair must reuse it.
    let device =
        DeviceProcess::start(common::device_bin(), 1, &["--rdma-queue-pairs", "2"]).unwrap();
    let context = Context::open(device.socket(0), config()).unwrap();
    let size = u64::from(context.queue_size());
    let mut cq = context.create_completion_queue();
    let mut qp = context.create_queue_pair(&mut cq).unwrap();
    let posted = fill_both_rings(&mut qp, 1000);
    assert!(
        posted >= 2 * size - 1,
        "{posted} posted: the send ring and the completion ring behind it ({size} each) hold more"
    );
    // Dropped full while its completion queue lives: every completion
    // still arrives there, and then the ring goes back.
    drop(qp);
    let all = collect(&mut cq, posted as usize);
    assert_eq!(
        all.iter().map(|c| c.user_data).collect::<Vec<_>>(),
        (1000..1000 + posted).collect::<Vec<_>>()
    );
    await_rings_back(&mut cq, "dropped full");
    // Full again, dropped, and its completion queue dropped unreaped.
    let mut qp = context.create_queue_pair(&mut cq).unwrap();
    fill_both_rings(&mut qp, 1000);
    drop(qp);
    drop(cq);
    for round in 0..3 {
        let mut next_cq = context.create_completion_queue();
        let mut next = context
            .create_queue_pair(&mut next_cq)
            .unwrap_or_else(|e| panic!("round {round}: the freed pair refused: {e}"));
        next.post(&[Nop::new().build().user_data(7).signaled()])
            .unwrap();
        let seen = collect(&mut next_cq, 1);
        assert_eq!(
            seen[0].user_data, 7,
            "round {round}: nothing of the old pair"
        );
        assert_eq!(next_cq.poll().unwrap().count(), 0, "round {round}");
        // Full again for the next round.
        fill_both_rings(&mut next, 2000);
    }
}

#[test]
fn user_data_of_any_value_never_passes_for_the_drivers_markers() {
    // One I/O pair: every queue pair reuses its rings.
    let device =
        DeviceProcess::start(common::device_bin(), 1, &["--rdma-queue-pairs", "2"]).unwrap();
    let context = Context::open(device.socket(0), config()).unwrap();
    // Values a counter-based marker takes first, and sentinels programs
    // use.
    let suspicious: Vec<u64> = (0..64)
        .map(|n| (0xffff << 48) | n)
        .chain([u64::MAX, u64::MAX - 1, 1 << 63, 0])
        .collect();
    let mut cq = context.create_completion_queue();
    for round in 0..4 {
        let mut qp = context.create_queue_pair(&mut cq).unwrap();
        // Whatever the last queue pair left is not this one's.
        qp.post(&[Nop::new().build().user_data(round).signaled()])
            .unwrap();
        let seen = collect(&mut cq, 1);
        assert_eq!(seen[0].user_data, round, "round {round}: only its own");
        for &value in &suspicious {
            qp.post(&[Nop::new().build().user_data(value).signaled()])
                .unwrap();
        }
        // Dropped with those unreaped: they still arrive, all of them,
        // on the completion queue, and nothing else.
        drop(qp);
        let left = collect(&mut cq, suspicious.len());
        assert_eq!(
            left.iter().map(|c| c.user_data).collect::<Vec<_>>(),
            suspicious,
            "round {round}"
        );
        // The ring goes back once the marker behind them is reaped.
        await_rings_back(&mut cq, &format!("round {round}"));
    }
    // A fresh completion queue on rings whose last user left them full of
    // such values sees none of them.
    let mut qp = context.create_queue_pair(&mut cq).unwrap();
    for &value in &suspicious {
        qp.post(&[Nop::new().build().user_data(value).signaled()])
            .unwrap();
    }
    drop(qp);
    drop(cq);
    let mut fresh_cq = context.create_completion_queue();
    let mut fresh = context.create_queue_pair(&mut fresh_cq).unwrap();
    fresh
        .post(&[Nop::new().build().user_data(9).signaled()])
        .unwrap();
    assert_eq!(collect(&mut fresh_cq, 1)[0].user_data, 9);
    assert_eq!(fresh_cq.poll().unwrap().count(), 0);
}

#[test]
fn a_window_of_no_bytes_or_no_right_is_refused_naming_both() {
    let device = DeviceProcess::start(common::device_bin(), 1, &[]).unwrap();
    let owner = Context::open(device.socket(0), config()).unwrap();
    let target = owner.alloc(4096, 4096).unwrap();
    let region = owner.register_buffer(&target).unwrap();
    let all = Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC;
    for (len, access) in [(0, all), (0, Access::REMOTE_READ), (16, Access::empty())] {
        let refused = owner.bind_window(&region, 100, len, access).unwrap_err();
        assert!(
            matches!(refused, VerbsError::EmptyWindow { len: l, access: a } if l == len && a == access),
            "{len} bytes, {access:?}: {refused}"
        );
        assert!(
            refused.to_string().contains("at least one byte"),
            "{refused}"
        );
        // SAFETY: refused before anything is bound.
        let raw = unsafe { owner.bind_window_raw(region.iova() + 100, len, access, None) };
        assert!(
            matches!(raw, Err(VerbsError::EmptyWindow { .. })),
            "raw, {len} bytes, {access:?}: {:?}",
            raw.map(|w| w.remote())
        );
    }
    // The port goes on binding.
    let window = owner.bind_window(&region, 100, 1, all).unwrap();
    window.revoke().unwrap();
}

/// A queue pair dropped while the device is still on its requests, with
/// its send ring full of unsignalled ones: its retire marker cannot be
/// posted at once, and no completion will come to prompt it. Polling its
/// completion queue posts it once the device has made room, and the ring
/// goes back.
#[test]
fn a_queue_pair_dropped_full_of_unsignalled_requests_gives_its_ring_back() {
    const BIG: usize = 32 << 20;
    let device =
        DeviceProcess::start(common::device_bin(), 2, &["--rdma-queue-pairs", "2"]).unwrap();
    let config = || ContextConfig {
        arena_bytes: 80 << 20,
        ..config()
    };
    let initiator = Context::open(device.socket(0), config()).unwrap();
    let owner = Context::open(device.socket(1), config()).unwrap();
    let target = owner.alloc(BIG, 4096).unwrap();
    let target_region = owner.register_buffer(&target).unwrap();
    let window = owner
        .bind_window(&target_region, 0, BIG as u64, Access::REMOTE_WRITE)
        .unwrap();
    let source = initiator.alloc(BIG, 4096).unwrap();
    let region = initiator.register_buffer(&source).unwrap();
    let size = usize::from(initiator.queue_size());
    let mut cq = initiator.create_completion_queue();
    let mut full_drops = 0;
    for attempt in 0..10 {
        let mut qp = initiator.create_queue_pair(&mut cq).unwrap();
        // A long unsignalled write, named raw so that the queue pair keeps
        // no share and its drop does not wait for the device.
        // SAFETY: `source` outlives every request (the device is done
        // with them before the test ends: the ring comes back only then).
        let local = unsafe { Local::from_raw(region.iova(), BIG as u32) };
        qp.post(&[Write::new(local, window.remote().at(0)).build()])
            .unwrap();
        // Unsignalled NOPs, the largest batch that fits, then one at a
        // time until one is refused while the device is still writing.
        let batch: Vec<_> = (0..size - 1).map(|_| Nop::new().build()).collect();
        let mut batch = batch.as_slice();
        while batch.len() > 1 && matches!(qp.post(batch), Err(VerbsError::QueueFull { .. })) {
            batch = &batch[..batch.len() / 2];
        }
        let full = (0..2 * size).any(|_| {
            matches!(
                qp.post(&[Nop::new().build()]),
                Err(VerbsError::QueueFull { .. })
            )
        });
        drop(qp);
        await_rings_back(
            &mut cq,
            &format!("attempt {attempt} (dropped full: {full})"),
        );
        full_drops += u32::from(full);
    }
    assert!(
        full_drops > 0,
        "the send ring never filled: the device outran the posts"
    );
}
