//! Hostile frontends that play with file descriptors, connections and the
//! status socket, against a real device process: call fds nobody reads,
//! kick fds that hang up, more connections than the limit, idle status
//! clients, a client that never reads its completions, a client stopped
//! with SIGSTOP.
//!
//! After each: the hostile port shows `connected=0` once the client is
//! gone; a well-behaved driver on another port, and one on the hostile
//! port reconnected, move bytes (every byte checked); and the device's CPU
//! time stands still (no thread spins).

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::mem::ManuallyDrop;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use pindown_driver::verbs::opcode::{Read as RdmaRead, Write as RdmaWrite};
use pindown_driver::verbs::{CompletionQueue, Context, ContextConfig, VerbsError};
use pindown_uapi::{Access, Completion, Status};
use vhost::VhostBackend;
use vmm_sys_util::eventfd::EventFd;

const T: Duration = Duration::from_secs(10);
const HOSTILE: [u8; 6] = [0x02, 0, 0, 0, 7, 0];
const OTHER: [u8; 6] = [0x02, 0, 0, 0, 7, 1];
const BROADCAST: [u8; 6] = [0xff; 6];

// ---------------------------------------------------------------------------
// Helpers

/// Asserts that no thread of the device spins: over 300 ms its CPU time
/// barely moves (a spinning thread would add about 30 ticks).
fn assert_cpu_idle(dev: &DeviceProcess, when: &str) {
    let before = common::cpu_ticks(dev.pid());
    std::thread::sleep(Duration::from_millis(300));
    let used = common::cpu_ticks(dev.pid()) - before;
    assert!(
        used <= 5,
        "{when}: the device used {used} ticks of CPU in 300 ms while idle\n{}",
        dev.log()
    );
}

fn wait_disconnected(dev: &DeviceProcess, port: usize) {
    assert!(
        dev.wait_for(T, |s| s.get(port).is_some_and(|p| p.n("connected") == 0)),
        "port {port} still connected after its client left: {:?}\n{}",
        dev.status(),
        dev.log()
    );
}

fn wait_log(dev: &DeviceProcess, needle: &str) -> String {
    let deadline = Instant::now() + T;
    loop {
        let log = dev.log();
        if log.contains(needle) {
            return log;
        }
        assert!(
            Instant::now() < deadline,
            "no `{needle}` in the log:\n{log}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn context(dev: &DeviceProcess, socket: usize) -> Context {
    let config = ContextConfig {
        arena_bytes: 8 << 20,
        ..ContextConfig::default()
    };
    Context::open(dev.socket(socket), config)
        .unwrap_or_else(|e| panic!("driver on socket {socket}: {e}\n{}", dev.log()))
}

/// The one completion `cq` has (or gets within `T`).
fn wait_one(cq: &mut CompletionQueue<'_>) -> Completion {
    let mut ready = cq.wait(T).expect("completion");
    assert_eq!(ready.len(), 1);
    ready.next().unwrap()
}

/// Two well-behaved drivers: one on `from`'s socket, one on `to`'s. The
/// first writes 256 KiB into a window of the second and reads it back;
/// every byte is checked. Returns the port the first one got.
fn drivers_move_bytes(dev: &DeviceProcess, from: usize, to: usize, seed: u8) -> u16 {
    const LEN: usize = 256 * 1024;
    let a = context(dev, from);
    let b = context(dev, to);
    let target = b.alloc(LEN, 64).unwrap();
    target.write_at(0, &vec![0u8; LEN]);
    let target_region = b.register_buffer(&target).unwrap();
    let window = b
        .bind_window(
            &target_region,
            0,
            LEN as u64,
            Access::REMOTE_READ | Access::REMOTE_WRITE,
        )
        .unwrap();
    let pattern: Vec<u8> = (0..LEN)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect();
    let source = a.alloc(LEN, 64).unwrap();
    source.write_at(0, &pattern);
    let source_region = a.register_buffer(&source).unwrap();
    let mut cq = a.create_completion_queue();
    let mut qp = a.create_queue_pair(&mut cq).unwrap();
    qp.post(&[RdmaWrite::new(
        source_region.local(0, LEN as u32).unwrap(),
        window.remote().at(0),
    )
    .build()
    .user_data(1)
    .signaled()])
        .unwrap();
    let done = wait_one(&mut cq);
    assert_eq!((done.status, done.byte_len), (Status::Success, LEN as u32));
    let mut landed = vec![0u8; LEN];
    target.read_at(0, &mut landed);
    assert!(landed == pattern, "written bytes differ");

    let back = a.alloc(LEN, 64).unwrap();
    back.write_at(0, &vec![0u8; LEN]);
    let back_region = a.register_buffer(&back).unwrap();
    qp.post(&[RdmaRead::new(
        back_region.local(0, LEN as u32).unwrap(),
        window.remote().at(0),
    )
    .build()
    .user_data(2)
    .signaled()])
        .unwrap();
    assert!(wait_one(&mut cq).is_success());
    let mut read_back = vec![0u8; LEN];
    back.read_at(0, &mut read_back);
    assert!(read_back == pattern, "read bytes differ");
    a.info().port
}

/// What every test checks once its hostile client on `port` (socket
/// `port`) is gone: the port is free, nothing spins, and drivers move
/// bytes on another port and on the hostile port reconnected.
fn healthy_after(dev: &DeviceProcess, port: usize, other: usize) {
    wait_disconnected(dev, port);
    assert_cpu_idle(dev, "after the hostile client left");
    drivers_move_bytes(dev, other, other + 1, 1);
    // Those drivers' connections are torn down before the next two come
    // (a device allowed two connections refuses a third meanwhile).
    assert!(
        dev.wait_for(T, |s| s.iter().all(|p| p.n("connected") == 0)),
        "the drivers' ports stayed connected: {:?}",
        dev.status()
    );
    let got = drivers_move_bytes(dev, port, other, 2);
    assert_eq!(
        got as usize, port,
        "the reconnected driver gets the hostile's port"
    );
    assert_cpu_idle(dev, "after the drivers left");
}

/// Runs `f` on a thread of its own and fails the test if it does not end
/// within `T` (a device that hangs must fail the test, not hang it).
fn within<R: Send + 'static>(what: &str, f: impl FnOnce() -> R + Send + 'static) -> R {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(T)
        .unwrap_or_else(|_| panic!("{what}: no answer, the device hangs"))
}

/// Fills `fd` (a pipe or socket) until it would block, as a frontend that
/// never reads it ends up; leaves it non-blocking.
fn fill(fd: RawFd) {
    // SAFETY: fcntl on a descriptor the caller owns; no pointers.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        assert_eq!(libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK), 0);
    }
    let chunk = [7u8; 8];
    loop {
        // SAFETY: writes 8 bytes from the live `chunk`.
        let n = unsafe { libc::write(fd, chunk.as_ptr().cast(), chunk.len()) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock, "{e}");
            return;
        }
    }
}

/// `fd` seen as an `EventFd`, for the vhost crate's SET_VRING_CALL/KICK
/// (which only send its number); never closed through this view.
fn as_eventfd(fd: RawFd) -> ManuallyDrop<EventFd> {
    // SAFETY: the EventFd only borrows `fd` (ManuallyDrop never closes
    // it); the caller keeps the real owner alive while it is used.
    ManuallyDrop::new(unsafe { EventFd::from_raw_fd(fd) })
}

/// A pipe: (read end, write end), blocking.
fn pipe() -> (OwnedFd, OwnedFd) {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two descriptors into `fds`.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: both descriptors were just created and are owned by nobody else.
    unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
}

/// Makes `fd` blocking again, as a hostile frontend can do to a file it
/// shared with the device.
fn set_blocking(fd: RawFd) {
    // SAFETY: fcntl on a descriptor the caller owns; no pointers.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        assert!(flags >= 0);
        assert_eq!(libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK), 0);
    }
}

/// Sends `count` broadcast frames on tx ring 1, 16 at a time, waiting
/// for each batch to come back used.
fn send_frames(fe: &mut TestFrontend, count: usize) {
    let mut sent = 0u16;
    while (sent as usize) < count {
        for id in 0..QSIZE {
            let payload = format!("frame {sent}");
            fe.send(1, id, &frame(BROADCAST, HOSTILE, payload.as_bytes()));
            sent = sent.wrapping_add(1);
        }
        let deadline = Instant::now() + T;
        while fe.used_idx(1) != sent {
            assert!(Instant::now() < deadline, "tx chains not returned");
            std::thread::sleep(Duration::from_millis(1));
        }
        fe.rings[1].used_seen = sent;
    }
}

// ---------------------------------------------------------------------------
// Call fds

/// The hostile frontend on socket 0 gets `call` (full already, or
/// failing) as the call fd of its rx and tx rings, posts rx buffers, and
/// sends 1,024 frames (each batch a signal). Meanwhile it still answers
/// requests; another client's broadcast reaches it; drivers on other ports
/// move bytes.
fn call_fd_never_read(call: RawFd, clear_nonblock: bool) -> DeviceProcess {
    let dev = DeviceProcess::start(device_bin(), 4, &[]).unwrap();
    let mut hostile = TestFrontend::connect(&dev.socket(0), 2);
    for ring in [0, 1] {
        hostile.fe.set_vring_call(ring, &as_eventfd(call)).unwrap();
    }
    if clear_nonblock {
        set_blocking(call);
    }
    for id in 0..4 {
        hostile.post_rx(0, id);
    }
    let mut hostile = within("frames on a port whose call fd is full", move || {
        send_frames(&mut hostile, 1024);
        // The port still answers requests.
        assert_ne!(hostile.fe.get_features().unwrap(), 0);
        hostile
    });

    // Another client's broadcast lands in the hostile's rx ring (and the
    // device signals the full call fd) without holding that client up.
    let mut other = TestFrontend::connect(&dev.socket(1), 2);
    let f = frame(BROADCAST, OTHER, b"to everyone, readers or not");
    other.send(1, 0, &f);
    assert_eq!(other.wait_used(1, T), Some((0, 0)));
    let (id, len) = hostile.wait_used(0, T).expect("broadcast delivered");
    assert_eq!(len as usize, f.len());
    assert_eq!(hostile.read_buf(0, id, len as usize)[HDR..], f[HDR..]);
    let other = within("a request on another port", move || {
        assert_ne!(other.fe.get_features().unwrap(), 0);
        other
    });

    drivers_move_bytes(&dev, 2, 3, 3);
    assert_cpu_idle(&dev, "with a call fd nobody reads");
    drop(hostile);
    drop(other);
    healthy_after(&dev, 0, 2);
    dev
}

#[test]
fn a_blocking_call_pipe_never_read_stalls_nothing() {
    let (read, write) = pipe();
    fill(write.as_raw_fd());
    // The frontend clears O_NONBLOCK again after handing the pipe over.
    call_fd_never_read(write.as_raw_fd(), true);
    drop(read);
}

#[test]
fn a_call_socket_never_read_stalls_nothing() {
    let (mine, theirs) = UnixStream::pair().unwrap();
    fill(theirs.as_raw_fd());
    call_fd_never_read(theirs.as_raw_fd(), true);
    drop(mine);
}

#[test]
fn a_blocking_call_eventfd_at_its_limit_stalls_nothing() {
    // A blocking eventfd whose counter is one below its overflow limit:
    // any further write would wait until somebody reads it.
    let call = EventFd::new(0).unwrap();
    call.write(u64::MAX - 1).unwrap();
    call_fd_never_read(call.as_raw_fd(), true);
}

#[test]
fn a_call_pipe_without_reader_is_dropped_and_the_device_lives() {
    let (read, write) = pipe();
    drop(read);
    let dev = call_fd_never_read(write.as_raw_fd(), false);
    wait_log(&dev, "call fd fails");
}

// ---------------------------------------------------------------------------
// Kick fds

/// The hostile frontend on socket 0 gets `kick` as the kick fd of its tx
/// ring; `hang_up` then closes the other end. The ring stops (logged)
/// instead of spinning; a new kick fd restarts it and its frames flow.
fn kick_fd_hangs_up(kick: OwnedFd, hang_up: impl FnOnce()) {
    let dev = DeviceProcess::start(device_bin(), 4, &[]).unwrap();
    let mut hostile = TestFrontend::connect(&dev.socket(0), 2);
    let mut other = TestFrontend::connect(&dev.socket(1), 2);
    hostile
        .fe
        .set_vring_kick(1, &as_eventfd(kick.as_raw_fd()))
        .unwrap();
    drop(kick);
    hang_up();
    // Event-driven: the device sees the hang-up at once; a spinning
    // thread would show here.
    std::thread::sleep(Duration::from_millis(50));
    assert_cpu_idle(&dev, "with a hung-up kick fd");
    let log = wait_log(&dev, "kick fd hung up");
    let line = log.lines().find(|l| l.contains("kick fd hung up")).unwrap();
    assert!(line.contains("port=0") && line.contains("ring=1"), "{line}");
    // The port still answers, other ports still work.
    assert_ne!(hostile.fe.get_features().unwrap(), 0);
    drivers_move_bytes(&dev, 2, 3, 4);

    // A new kick fd restarts the ring where it stopped.
    let fresh = hostile.rings[1].kick.try_clone().unwrap();
    hostile.fe.set_vring_kick(1, &fresh).unwrap();
    other.post_rx(0, 3);
    let f = frame(BROADCAST, HOSTILE, b"kicked again");
    hostile.send(1, 0, &f);
    assert_eq!(hostile.wait_used(1, T), Some((0, 0)));
    let (id, len) = other.wait_used(0, T).expect("frame after restart");
    assert_eq!(id, 3);
    assert_eq!(other.read_buf(0, 3, len as usize)[HDR..], f[HDR..]);
    assert_cpu_idle(&dev, "after the ring restarted");

    drop(hostile);
    drop(other);
    healthy_after(&dev, 0, 2);
}

#[test]
fn a_kick_pipe_whose_writer_is_closed_stops_its_ring() {
    let (read, write) = pipe();
    kick_fd_hangs_up(read, move || drop(write));
}

#[test]
fn a_kick_pipe_closed_after_a_kick_with_bytes_left_stops_its_ring() {
    let (read, mut write) = {
        let (r, w) = pipe();
        (r, std::fs::File::from(w))
    };
    write.write_all(&[1u8; 100]).unwrap();
    kick_fd_hangs_up(read, move || drop(write));
}

#[test]
fn a_kick_socket_whose_peer_is_closed_stops_its_ring() {
    let (mine, theirs) = UnixStream::pair().unwrap();
    kick_fd_hangs_up(OwnedFd::from(theirs), move || drop(mine));
}

#[test]
fn a_kick_socket_whose_peer_stops_writing_stops_its_ring() {
    let (mine, theirs) = UnixStream::pair().unwrap();
    kick_fd_hangs_up(OwnedFd::from(theirs), move || {
        (&mine).write_all(b"12345678").unwrap();
        mine.shutdown(std::net::Shutdown::Write).unwrap();
        // `mine` stays open (the reading side lives): only end of file.
        std::mem::forget(mine);
    });
}

#[test]
fn a_replaced_kick_fd_that_hangs_up_later_disturbs_nothing() {
    let dev = DeviceProcess::start(device_bin(), 4, &[]).unwrap();
    let mut hostile = TestFrontend::connect(&dev.socket(0), 2);
    let mut other = TestFrontend::connect(&dev.socket(1), 2);
    let (read, write) = pipe();
    hostile
        .fe
        .set_vring_kick(1, &as_eventfd(read.as_raw_fd()))
        .unwrap();
    // Replaced by the ring's own eventfd, then the old pipe hangs up while
    // the frontend still holds its read end.
    let fresh = hostile.rings[1].kick.try_clone().unwrap();
    hostile.fe.set_vring_kick(1, &fresh).unwrap();
    drop(write);
    std::thread::sleep(Duration::from_millis(50));
    assert_cpu_idle(&dev, "after a replaced kick fd hung up");
    // The ring was not stopped: its frames flow.
    other.post_rx(0, 5);
    let f = frame(BROADCAST, HOSTILE, b"new kick fd");
    hostile.send(1, 0, &f);
    assert_eq!(hostile.wait_used(1, T), Some((0, 0)));
    let (id, len) = other.wait_used(0, T).expect("frame delivered");
    assert_eq!(id, 5);
    assert_eq!(other.read_buf(0, 5, len as usize)[HDR..], f[HDR..]);
    assert!(!dev.log().contains("kick fd hung up"), "{}", dev.log());
    drop(read);
    drop(hostile);
    drop(other);
    healthy_after(&dev, 0, 2);
}

// ---------------------------------------------------------------------------
// Connections

/// Sends GET_FEATURES on a raw connection: `Some(features)` if the device
/// serves it, `None` if it closed the connection.
fn raw_get_features(s: &mut UnixStream) -> Option<u64> {
    s.set_read_timeout(Some(T)).unwrap();
    let mut msg = 1u32.to_le_bytes().to_vec();
    msg.extend_from_slice(&1u32.to_le_bytes());
    msg.extend_from_slice(&0u32.to_le_bytes());
    if s.write_all(&msg).is_err() {
        return None;
    }
    let mut reply = [0u8; 20];
    match s.read_exact(&mut reply) {
        Ok(()) => Some(u64::from_le_bytes(reply[12..].try_into().unwrap())),
        Err(e) => {
            assert!(
                !matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ),
                "neither served nor closed: {e}"
            );
            None
        }
    }
}

#[test]
fn connections_beyond_the_limit_are_refused_and_the_others_keep_serving() {
    let dev = DeviceProcess::start(device_bin(), 4, &["--max-connections", "3"]).unwrap();
    // Two working drivers and one idle client: the limit.
    let a = context(&dev, 0);
    let b = context(&dev, 1);
    let mut idle = UnixStream::connect(dev.socket(2)).unwrap();
    assert!(raw_get_features(&mut idle).is_some());
    let mut refused = Vec::new();
    for socket in [2, 3, 3, 0] {
        let mut s = UnixStream::connect(dev.socket(socket)).unwrap();
        assert_eq!(
            raw_get_features(&mut s),
            None,
            "connection beyond the limit"
        );
        refused.push(s);
    }
    let log = wait_log(&dev, "connection refused");
    assert!(log.contains("3 connections already served"), "{log}");
    let status = dev.status().unwrap();
    assert_eq!(
        status.iter().map(|p| p.n("connected")).sum::<u64>(),
        3,
        "{status:?}"
    );
    // The served ones keep serving.
    drop((a, b));
    wait_disconnected(&dev, 0);
    wait_disconnected(&dev, 1);
    drivers_move_bytes(&dev, 0, 1, 5);
    assert!(raw_get_features(&mut idle).is_some());
    assert_cpu_idle(&dev, "with refused connections");
    drop(idle);
    healthy_after(&dev, 2, 0);
}

#[test]
fn idle_connections_never_exhaust_the_descriptors() {
    // 512 descriptors: the default limit leaves room for a few connections
    // only, whatever each one holds.
    let dev = DeviceProcess::start_with_fd_limit(device_bin(), 4, &[], 512, 512).unwrap();
    let mut served = Vec::new();
    let mut refused = 0;
    // More idle clients than the descriptors could hold at two each.
    for i in 0..300 {
        let mut s = UnixStream::connect(dev.socket(i % 4)).unwrap();
        match raw_get_features(&mut s) {
            Some(_) => served.push(s),
            None => refused += 1,
        }
    }
    assert!(!served.is_empty() && refused > 0, "{} served", served.len());
    let status = dev.status().expect("the status socket still answers");
    let log = wait_log(&dev, "connections at once");
    let limit = format!("serving at most {} connections at once", served.len());
    assert!(log.contains(&limit), "{log}");
    assert_eq!(
        status.iter().map(|p| p.n("connected")).sum::<u64>(),
        served.len() as u64
    );
    // Every served connection still answers.
    for s in &mut served {
        assert!(raw_get_features(s).is_some());
    }
    assert_cpu_idle(&dev, "with idle connections");
    // Idle clients leave: every port is free again and drivers work.
    drop(served);
    assert!(dev.wait_for(T, |s| s.iter().all(|p| p.n("connected") == 0)));
    healthy_after(&dev, 0, 1);
}

/// This process's hard descriptor limit (a child can be given less).
fn hard_fd_limit() -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one `rlimit` into the live `lim`.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
    lim.rlim_max
}

#[test]
fn the_device_raises_its_descriptor_limit_to_the_hard_limit() {
    let hard = hard_fd_limit().min(4096);
    assert!(
        hard > 256,
        "the hard descriptor limit {hard} is too low for this test"
    );
    let dev = DeviceProcess::start_with_fd_limit(device_bin(), 1, &[], 256, hard).unwrap();
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", dev.pid())).unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap();
    let numbers: Vec<&str> = line.split_whitespace().skip(3).take(2).collect();
    let hard = hard.to_string();
    assert_eq!(numbers, [hard.as_str(), hard.as_str()], "{line}");
}

#[test]
fn a_connection_limit_the_descriptors_cannot_hold_is_refused_at_start() {
    // With 1,024 descriptors, 100 connections cannot be held.
    let mut command = Command::new(device_bin());
    command.args([
        "--socket",
        "/nonexistent/x.sock",
        "--max-connections",
        "100",
    ]);
    let limit = libc::rlimit {
        rlim_cur: 1024,
        rlim_max: 1024,
    };
    // SAFETY: the closure runs in the forked child before exec and only
    // calls setrlimit(2), async-signal-safe, on a copied value.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut command, move || {
            if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
    let out = command.output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--max-connections 100 needs"), "{err}");
    assert!(err.contains("the limit is 1024"), "{err}");
}

// ---------------------------------------------------------------------------
// The status socket

#[test]
fn idle_status_clients_do_not_delay_a_status_query() {
    let dev = DeviceProcess::start(device_bin(), 2, &[]).unwrap();
    let _p0 = TestFrontend::connect(&dev.socket(0), 2);
    // Ten clients that connect and never send anything.
    let idle: Vec<UnixStream> = (0..10)
        .map(|_| UnixStream::connect(dev.control_path()).unwrap())
        .collect();
    // A slow one that sends a byte and stops.
    let mut slow = UnixStream::connect(dev.control_path()).unwrap();
    slow.write_all(b"s").unwrap();
    // The harness reads with a 5 s timeout: served at once, not after the
    // idle clients.
    let status = dev.status().expect("status while clients idle");
    assert_eq!(status.len(), 2);
    assert_eq!(status[0].n("connected"), 1);
    // The idle ones get their answer too, and the connection ends.
    for mut s in idle {
        s.set_read_timeout(Some(T)).unwrap();
        let mut text = String::new();
        s.read_to_string(&mut text).unwrap();
        assert!(text.starts_with("port=0 "), "{text}");
    }
    assert_cpu_idle(&dev, "after the status clients");
}

// ---------------------------------------------------------------------------
// Clients that stop reading or stop altogether

#[test]
fn a_client_that_never_reads_completions_holds_only_itself() {
    let dev = DeviceProcess::start(device_bin(), 4, &[]).unwrap();
    let config = ContextConfig {
        arena_bytes: 4 << 20,
        queue_size: 16,
        ..ContextConfig::default()
    };
    let hostile = Context::open(dev.socket(0), config).unwrap();
    let peer = context(&dev, 1);
    never_reap(&dev, &hostile, &peer);
    drop(peer);
    drop(hostile);
    healthy_after(&dev, 0, 1);
}

/// `hostile` fills its rings with signaled writes into a window of `peer`
/// and never reaps a completion.
fn never_reap(dev: &DeviceProcess, hostile: &Context, peer: &Context) {
    let target = peer.alloc(4096, 64).unwrap();
    let target_region = peer.register_buffer(&target).unwrap();
    let window = peer
        .bind_window(&target_region, 0, 4096, Access::REMOTE_WRITE)
        .unwrap();
    let source = hostile.alloc(4096, 64).unwrap();
    source.write_at(0, &[0x5a; 4096]);
    let source_region = hostile.register_buffer(&source).unwrap();
    let mut cq = hostile.create_completion_queue();
    let mut qp = hostile.create_queue_pair(&mut cq).unwrap();
    // Post signaled writes until the rings are full; never reap.
    let mut posted = 0u64;
    loop {
        let wr = RdmaWrite::new(source_region.local(0, 4096).unwrap(), window.remote().at(0))
            .build()
            .user_data(posted)
            .signaled();
        match qp.post(&[wr]) {
            Ok(()) => posted += 1,
            Err(VerbsError::QueueFull { .. }) => break,
            Err(other) => panic!("{other}"),
        }
    }
    assert!(posted >= 16, "posted {posted}");
    let deadline = Instant::now() + T;
    let mut landed = vec![0u8; 4096];
    loop {
        target.read_at(0, &mut landed);
        if landed.iter().all(|&b| b == 0x5a) {
            break;
        }
        assert!(Instant::now() < deadline, "the writes did not land");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_cpu_idle(dev, "with a completion queue nobody reads");
    drivers_move_bytes(dev, 2, 3, 6);
}

/// Run as a child process by `a_client_stopped_with_sigstop_...`: a driver
/// on the socket named by `HOSTILE_FDS_SOCKET` writing into its own memory
/// in a loop, printing a line after every 16 completions.
#[test]
#[ignore = "the child process of a_client_stopped_with_sigstop_stalls_nothing; not a test of its own"]
fn sigstop_child() {
    let socket = std::env::var("HOSTILE_FDS_SOCKET")
        .expect("a helper process: run only by a_client_stopped_with_sigstop_stalls_nothing");
    let config = ContextConfig {
        arena_bytes: 4 << 20,
        ..ContextConfig::default()
    };
    let context = Context::open(socket, config).unwrap();
    let buffer = context.alloc(1 << 20, 64).unwrap();
    let region = context.register_buffer(&buffer).unwrap();
    let window = context
        .bind_window(&region, 0, 1 << 19, Access::REMOTE_WRITE)
        .unwrap();
    let mut cq = context.create_completion_queue();
    let mut qp = context.create_queue_pair(&mut cq).unwrap();
    let mut stdout = std::io::stdout();
    for round in 0u64.. {
        for i in 0..16 {
            qp.post(&[RdmaWrite::new(
                region.local(1 << 19, 1 << 19).unwrap(),
                window.remote().at(0),
            )
            .build()
            .user_data(round * 16 + i)
            .signaled()])
                .unwrap();
            assert!(wait_one(&mut cq).is_success());
        }
        writeln!(stdout, "round {round}").unwrap();
        stdout.flush().unwrap();
    }
}

#[test]
fn a_client_stopped_with_sigstop_stalls_nothing() {
    let dev = DeviceProcess::start(device_bin(), 4, &[]).unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "sigstop_child",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("HOSTILE_FDS_SOCKET", dev.socket(0))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id() as libc::pid_t;
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut next_round = || loop {
        let line = lines.next().expect("child output").unwrap();
        if line.starts_with("round ") {
            return line;
        }
    };
    next_round();
    // Stopped in the middle of its traffic.
    // SAFETY: kill(2) on our own child.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    assert!(dev.wait_for(T, |s| s[0].n("connected") == 1));
    assert_cpu_idle(&dev, "with a stopped client");
    drivers_move_bytes(&dev, 1, 2, 7);
    // Continued, it is served again.
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    next_round();
    next_round();
    // Stopped again, then killed while stopped.
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    drivers_move_bytes(&dev, 1, 2, 8);
    child.kill().unwrap();
    child.wait().unwrap();
    healthy_after(&dev, 0, 1);
}

/// Tasks (threads) owned by user `uid`, over the whole machine: what
/// `RLIMIT_NPROC` counts.
fn tasks_of(uid: u32) -> u64 {
    let mut tasks = 0;
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let path = entry.path();
        let Ok(status) = std::fs::read_to_string(path.join("status")) else {
            continue;
        };
        let owner = status
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|l| l.split_whitespace().next())
            .and_then(|u| u.parse::<u32>().ok());
        if owner == Some(uid) {
            tasks += std::fs::read_dir(path.join("task")).map_or(0, |t| t.count() as u64);
        }
    }
    tasks
}

#[test]
fn a_connection_whose_thread_cannot_start_is_refused_and_its_port_freed() {
    // RLIMIT_NPROC binds only users without CAP_SYS_RESOURCE: the device
    // runs as `nobody`, allowed exactly the tasks a started device has.
    const NOBODY: u32 = 65534;
    // SAFETY: geteuid(2) has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "this test starts the device as another user: run it as root"
    );
    let probe = DeviceProcess::start_as_user(device_bin(), 3, &[], NOBODY, None).unwrap();
    // The device may still be starting threads when its sockets appear:
    // count once the number has held still for a while.
    let started = settled_tasks_of(NOBODY);
    drop(probe);
    let deadline = Instant::now() + T;
    while tasks_of(NOBODY) > started - 1 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let others = tasks_of(NOBODY);
    let threads = started - others;
    let dev =
        DeviceProcess::start_as_user(device_bin(), 3, &[], NOBODY, Some(others + threads)).unwrap();
    // Its sockets exist before its listening threads do: connecting before
    // the last of them started would race its start for the last task.
    let deadline = Instant::now() + T;
    while dev.log().matches("listening on").count() < 3 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    // (The status socket cannot start a thread for a client either: the
    // device's log tells what happened.)
    for round in 1..=3 {
        let mut s = UnixStream::connect(dev.socket(0)).unwrap();
        assert_eq!(raw_get_features(&mut s), None, "refused, not served");
        let deadline = Instant::now() + T;
        let refusals = loop {
            let log = dev.log();
            let refusals: Vec<String> = log
                .lines()
                .filter(|l| l.contains("cannot start its thread"))
                .map(str::to_owned)
                .collect();
            if refusals.len() >= round || Instant::now() > deadline {
                break refusals;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        assert_eq!(refusals.len(), round, "{}", dev.log());
        // Socket 0's own port every time: each refusal freed it (a port
        // left taken would make the next connection get a new port).
        assert!(
            refusals.iter().all(|l| l.contains("port=0")),
            "{refusals:?}"
        );
    }
    // Refused for its thread every time, never for the connection limit:
    // the refused connections were counted out again.
    assert!(!dev.log().contains("connections already served"));
    assert_cpu_idle(&dev, "after refused connections");
}

/// The tasks of `uid` once their number has not changed for 300 ms (at
/// most `T`).
fn settled_tasks_of(uid: u32) -> u64 {
    let deadline = Instant::now() + T;
    let mut count = tasks_of(uid);
    let mut since = Instant::now();
    while since.elapsed() < Duration::from_millis(300) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        let now = tasks_of(uid);
        if now != count {
            count = now;
            since = Instant::now();
        }
    }
    count
}
