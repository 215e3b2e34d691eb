//! Any user memory between two processes: a heap `Vec` in one, a file
//! mapping (`MAP_SHARED` files of /dev/shm, a `MAP_PRIVATE` mapping of a
//! disk file) in the other; writes, reads and atomics of 1 byte to 16 MiB,
//! unaligned, across pages, pool chunks and segments and memory-table
//! regions, every byte of both buffers checked against what it should
//! hold; `malloc`/`free` at the same address under traffic, with the
//! userfaultfd monitor and with the unmap hook; memory unmapped in the
//! middle of a 16 MiB transfer.
//!
//! The test binary is also the rank program: started with `--ignored` and
//! `PINDOWN_ROLE` set, the (ignored) `rank_process` test runs one rank that
//! reads commands on stdin and answers with lines starting `@@` on stdout.

mod common;

use std::io::BufRead;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::rank::{fingerprint, pattern, say, Rank};
use common::DeviceProcess;
use pindown_driver::verbs::opcode::{FetchAdd, Read, Write};
use pindown_driver::verbs::{Context, ContextConfig, Entry, Local, RemoteWindow};
use pindown_pincache::{CacheConfig, Monitor};
use pindown_uapi::{Access, Completion, ErrorDetail, Status};

/// Every buffer under test: room for 16 MiB at odd offsets, and more.
const BUFFER_BYTES: usize = 36 << 20;
/// Private memory is registered in pieces of this size, so a transfer
/// crosses pool chunks (and, past the first 64 MiB segment, segments).
const PIECE: usize = 4 << 20;
/// Where the counter word of the atomics lies in every buffer.
const COUNTER: usize = 30 << 20;

const ALL: Access = Access::REMOTE_READ
    .union(Access::REMOTE_WRITE)
    .union(Access::REMOTE_ATOMIC);

/// `monitor`: the driver's default (the unmap monitor where it can run,
/// which is here), else off (the program routes its unmaps through the
/// hook).
fn config(monitor: bool) -> ContextConfig {
    let default = ContextConfig::default();
    ContextConfig {
        arena_bytes: 8 << 20,
        cache: CacheConfig {
            max_pinned_bytes: Some(512 << 20),
            merge: false,
            monitor: if monitor {
                default.cache.monitor
            } else {
                Monitor::Off
            },
            ..default.cache.clone()
        },
        ..default
    }
}

/// Posts one request on a queue pair of its own and waits for its
/// completion.
fn run(context: &Context, entry: Entry<'_>) -> Completion {
    let mut cq = context.create_completion_queue();
    let mut qp = context.create_queue_pair(&mut cq).expect("queue pair");
    qp.post(&[entry.signaled()]).expect("post");
    let mut ready = cq.wait(Duration::from_secs(30)).expect("completion");
    ready.next().expect("one completion")
}

/// Runs `count` requests made by `make`, 64 in flight, all successful.
fn run_many(context: &Context, count: u64, make: impl Fn(u64) -> Entry<'static>) {
    let mut cq = context.create_completion_queue();
    let mut qp = context.create_queue_pair(&mut cq).expect("queue pair");
    let (mut posted, mut done) = (0u64, 0u64);
    while done < count {
        while posted < count && posted - done < 64 {
            let batch = (count - posted).min(64 - (posted - done)).min(16);
            let entries: Vec<Entry> = (posted..posted + batch)
                .map(|i| make(i).signaled())
                .collect();
            qp.post(&entries).expect("post");
            posted += batch;
        }
        for completion in cq.wait(Duration::from_secs(30)).expect("completions") {
            assert!(completion.is_success(), "{completion:?}");
            done += 1;
        }
    }
}

fn status_text(done: &Completion) -> String {
    if done.is_success() {
        "ok".into()
    } else {
        format!("status {:?} {:?}", done.status, done.detail)
    }
}

// ---------------------------------------------------------------- memory

/// A new mapping of `len` bytes: anonymous private, or of `fd` with
/// `flags`, at `at` (0: anywhere; else exactly there, without replacing).
fn map(at: usize, len: usize, flags: libc::c_int, fd: libc::c_int) -> *mut u8 {
    let flags = if at == 0 {
        flags
    } else {
        flags | libc::MAP_FIXED_NOREPLACE
    };
    // SAFETY: a new mapping; MAP_FIXED_NOREPLACE never replaces one.
    let addr = unsafe {
        libc::mmap(
            at as *mut libc::c_void,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            flags,
            fd,
            0,
        )
    };
    assert_ne!(
        addr,
        libc::MAP_FAILED,
        "{}",
        std::io::Error::last_os_error()
    );
    addr.cast()
}

fn file_in(dir: &std::path::Path, name: &str, bytes: &[u8]) -> std::fs::File {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap()
}

/// The buffer a peer rank owns.
enum Kind {
    /// A heap `Vec` (kept alive; reached through `Buffer::base`).
    Heap { _vec: Vec<u8> },
    /// Two /dev/shm files mapped `MAP_SHARED` side by side (two regions
    /// of the memory table), and a second mapping of each to check that
    /// they stay shared.
    Shm {
        _files: [std::fs::File; 2],
        other: [*mut u8; 2],
        _dir: tempfile::TempDir,
    },
    /// A disk file mapped `MAP_PRIVATE`, with its original contents.
    PrivateFile {
        file: std::fs::File,
        original: Vec<u8>,
        _dir: tempfile::TempDir,
    },
}

struct Buffer {
    kind: Kind,
    base: *mut u8,
    /// What every byte should hold.
    shadow: Vec<u8>,
}

impl Buffer {
    fn new(kind: &str) -> Buffer {
        let initial = pattern(0xb0f, BUFFER_BYTES);
        let half = BUFFER_BYTES / 2;
        let (kind, base) = match kind {
            "heap" => {
                let mut vec = initial.clone();
                let base = vec.as_mut_ptr();
                (Kind::Heap { _vec: vec }, base)
            }
            "shm" => {
                let dir = tempfile::tempdir_in("/dev/shm").unwrap();
                let files = [
                    file_in(dir.path(), "a", &initial[..half]),
                    file_in(dir.path(), "b", &initial[half..]),
                ];
                // Reserve the room, then place the two files in it.
                let base = map(0, BUFFER_BYTES, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1);
                // SAFETY: unmapping the reservation just made, to map the
                // files in its place.
                unsafe { libc::munmap(base.cast(), BUFFER_BYTES) };
                for (i, file) in files.iter().enumerate() {
                    map(
                        base as usize + i * half,
                        half,
                        libc::MAP_SHARED,
                        file.as_raw_fd(),
                    );
                }
                let other = [0, 1].map(|i| map(0, half, libc::MAP_SHARED, files[i].as_raw_fd()));
                (
                    Kind::Shm {
                        _files: files,
                        other,
                        _dir: dir,
                    },
                    base,
                )
            }
            "private-file" => {
                let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
                let file = file_in(dir.path(), "private", &initial);
                let base = map(0, BUFFER_BYTES, libc::MAP_PRIVATE, file.as_raw_fd());
                (
                    Kind::PrivateFile {
                        file,
                        original: initial.clone(),
                        _dir: dir,
                    },
                    base,
                )
            }
            other => panic!("unknown buffer kind {other}"),
        };
        Buffer {
            kind,
            base,
            shadow: initial,
        }
    }

    fn addr(&self, offset: usize) -> u64 {
        self.base as u64 + offset as u64
    }

    /// The bytes now (volatile: the device writes them).
    fn bytes(&self, offset: usize, len: usize) -> Vec<u8> {
        let mut out = vec![0u8; len];
        // SAFETY: inside the live buffer; the copy is volatile-safe as the
        // device is idle (the test reads after completions).
        unsafe { std::ptr::copy_nonoverlapping(self.base.add(offset), out.as_mut_ptr(), len) };
        out
    }

    fn write(&mut self, offset: usize, data: &[u8]) {
        // SAFETY: inside the live buffer.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.base.add(offset), data.len()) };
        self.shadow[offset..offset + data.len()].copy_from_slice(data);
    }

    /// Where the buffer differs from the shadow, if anywhere.
    fn first_difference(&self) -> Option<usize> {
        let now = self.bytes(0, BUFFER_BYTES);
        now.iter().zip(&self.shadow).position(|(a, b)| a != b)
    }

    fn counter(&self) -> &AtomicU64 {
        // SAFETY: an 8-byte aligned word inside the live buffer (buffers
        // are page aligned or come from malloc), accessed atomically here
        // and by the device.
        unsafe { AtomicU64::from_ptr(self.base.add(COUNTER).cast()) }
    }

    /// What only the kind can tell: shared files are seen the same through
    /// another mapping; a private file mapping left its file as it was.
    fn check_kind(&self) -> Result<(), String> {
        match &self.kind {
            Kind::Heap { .. } => Ok(()),
            Kind::Shm { other, .. } => {
                let half = BUFFER_BYTES / 2;
                for (i, view) in other.iter().enumerate() {
                    // SAFETY: a live mapping of `half` bytes.
                    let seen = unsafe { std::slice::from_raw_parts(*view, half) };
                    if seen != &self.shadow[i * half..(i + 1) * half] {
                        return Err(format!("file {i} differs seen through another mapping"));
                    }
                }
                Ok(())
            }
            Kind::PrivateFile { file, original, .. } => {
                let mut on_disk = Vec::new();
                std::io::Read::read_to_end(&mut &*file, &mut on_disk).unwrap();
                if &on_disk != original {
                    return Err("the file under a MAP_PRIVATE mapping changed".into());
                }
                Ok(())
            }
        }
    }
}

// ---------------------------------------------------------------- ranks

/// A rank owning a buffer of `kind`, registered and open to the peer
/// through one window.
fn buffer_rank(socket: &str, kind: &str) {
    let context = Context::open(socket, config(false)).expect("open");
    let mut buffer = Buffer::new(kind);
    let mut regions = Vec::new();
    let mut offset = 0;
    while offset < BUFFER_BYTES {
        let len = PIECE.min(BUFFER_BYTES - offset);
        // SAFETY (and `whole` below): the buffer lives until the process
        // ends, past the regions and the window, and is read only
        // through the peer's requests; no other thread of this rank
        // touches its pages (a private disk-file buffer moves unfenced).
        regions
            .push(unsafe { context.register_unfenced(buffer.addr(offset), len as u64) }.unwrap());
        offset += len;
    }
    // One window over the whole buffer: a region of the whole buffer.
    let whole = unsafe { context.register_unfenced(buffer.addr(0), BUFFER_BYTES as u64) }.unwrap();
    let window = context
        .bind_window(&whole, 0, BUFFER_BYTES as u64, ALL)
        .unwrap();
    let stats = context.reach_stats();
    say(format!("window {}", window.remote()));
    say(format!(
        "rehomed {} segments {} files {}",
        stats.rehomed, stats.segments, stats.file_regions
    ));
    let mut peer: Option<RemoteWindow> = None;
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        let words: Vec<&str> = line.split_whitespace().collect();
        let number = |i: usize| words[i].parse::<usize>().unwrap();
        match words.first().copied() {
            Some("peer") => {
                peer = Some(words[1].parse().unwrap());
                say("ok");
            }
            Some("put") => {
                let (remote, len, seed, local) = (number(1), number(2), number(3), number(4));
                buffer.write(local, &pattern(seed as u64, len));
                let entry = Write::new(
                    // SAFETY: the range is registered (or deliberately not, to test the
                    // device's check); the device never writes outside registered memory.
                    unsafe { Local::from_raw(buffer.addr(local), len as u32) },
                    peer.unwrap().at(remote as u64),
                );
                say(status_text(&run(&context, entry.build())));
            }
            Some("expect") => {
                let (at, len, seed) = (number(1), number(2), number(3));
                buffer.shadow[at..at + len].copy_from_slice(&pattern(seed as u64, len));
                match buffer.first_difference() {
                    None => say("ok"),
                    Some(i) => say(format!("bad at {i}")),
                }
            }
            Some("get") => {
                let (remote, len, local) = (number(1), number(2), number(3));
                let entry = Read::new(
                    // SAFETY: the range is registered (or deliberately not, to test the
                    // device's check); the device never writes outside registered memory.
                    unsafe { Local::from_raw(buffer.addr(local), len as u32) },
                    peer.unwrap().at(remote as u64),
                );
                let done = run(&context, entry.build());
                if !done.is_success() {
                    say(status_text(&done));
                    continue;
                }
                let landed = buffer.bytes(local, len);
                buffer.shadow[local..local + len].copy_from_slice(&landed);
                match buffer.first_difference() {
                    None => say(format!("fingerprint {}", fingerprint(&landed))),
                    Some(i) => say(format!("bad outside at {i}")),
                }
            }
            Some("fingerprint") => {
                let (at, len) = (number(1), number(2));
                say(format!(
                    "fingerprint {}",
                    fingerprint(&buffer.bytes(at, len))
                ));
            }
            Some("add") => {
                let word = peer.unwrap().at(COUNTER as u64);
                run_many(&context, number(1) as u64, |i| {
                    FetchAdd::new(word, 1).build().user_data(i)
                });
                say("ok");
            }
            Some("cpu-add") => {
                let counter = buffer.counter();
                for _ in 0..number(1) {
                    counter.fetch_add(1, Ordering::SeqCst);
                }
                say("ok");
            }
            Some("counter") => {
                let value = buffer.counter().load(Ordering::SeqCst);
                buffer.shadow[COUNTER..COUNTER + 8].copy_from_slice(&value.to_ne_bytes());
                say(format!("value {value}"));
            }
            Some("reset-counter") => {
                buffer.counter().store(0, Ordering::SeqCst);
                buffer.shadow[COUNTER..COUNTER + 8].copy_from_slice(&[0; 8]);
                say("ok");
            }
            Some("check") => match buffer
                .first_difference()
                .map(|i| format!("bad at {i}"))
                .map_or_else(|| buffer.check_kind(), Err)
            {
                Ok(()) => say("ok"),
                Err(why) => say(why),
            },
            Some("exit") | None => break,
            Some(other) => panic!("unknown command {other}"),
        }
    }
    drop(regions);
}

/// A rank whose memory is freed and allocated again at the same address
/// while a peer streams writes into it; `hook`: munmap through
/// `pindown_pincache::unmap`, else `malloc`/`free` and the userfaultfd
/// monitor.
fn reuse_rank(socket: &str, hook: bool) {
    const LEN: usize = 4 << 20;
    let context = Context::open(socket, config(!hook)).expect("open");
    assert_eq!(
        context.unmaps_watched(),
        !hook,
        "the default watches unmaps where userfaultfd runs (root here)"
    );
    if !hook {
        // free() of a block this size unmaps it (no dynamic threshold).
        // SAFETY: mallopt only sets an allocator parameter.
        assert_eq!(
            unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, 256 << 10) },
            1
        );
    }
    // With the hook, the program is its own allocator: it maps new memory
    // where it unmapped the old (the malloc variant gets the same address
    // from the C library and the kernel).
    let allocate = |hint: usize| -> *mut u8 {
        let at = if hook {
            map(hint, LEN, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1)
        } else {
            // SAFETY: a C allocation, freed by `release`.
            unsafe { libc::malloc(LEN) }.cast()
        };
        assert!(!at.is_null());
        at
    };
    let release = |at: *mut u8| {
        if hook {
            // SAFETY: `at` is our own mapping of LEN bytes, no longer used.
            unsafe { pindown_pincache::unmap(at, LEN) }.unwrap();
        } else {
            // SAFETY: `at` came from malloc and is no longer used.
            unsafe { libc::free(at.cast()) };
        }
    };
    let fill = |at: *mut u8, value: u8| {
        // SAFETY: LEN bytes we own.
        unsafe { std::ptr::write_bytes(at, value, LEN) };
    };
    let register = |at: *mut u8| {
        // SAFETY: the region is dropped at once, while the memory is
        // allocated; the window below is the unsafe part, and tested.
        let region = unsafe { context.register(at as u64, LEN as u64) }.unwrap();
        // SAFETY: the window is meant to outlive its registration: what the
        // device does when the memory under it is freed is what is tested.
        let window =
            unsafe { context.bind_window_raw(region.iova(), LEN as u64, ALL, None) }.unwrap();
        (region, window)
    };
    let mut current = allocate(0);
    fill(current, 0x11);
    let (region, window) = register(current);
    drop(region);
    say(format!(
        "window {} at {:#x}",
        window.remote(),
        current as usize
    ));
    let mut window = Some(window);
    let mut shadow = vec![0x11u8; LEN];
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        let words: Vec<&str> = line.split_whitespace().collect();
        let number = |i: usize| words[i].parse::<usize>().unwrap();
        match words.first().copied() {
            Some("free") => {
                release(current);
                say("ok");
            }
            Some("revoke") => {
                window.take().expect("a bound window").revoke().unwrap();
                say("ok");
            }
            Some("again") => {
                // The same size again: the kernel hands out the hole just
                // left, so the new memory has the old one's address.
                let fresh = allocate(current as usize);
                let value = number(1) as u8;
                fill(fresh, value);
                shadow.fill(value);
                let rehomed = context.reach_stats().rehomed;
                let (region, fresh_window) = register(fresh);
                drop(region);
                let stats = context.reach_stats();
                say(format!(
                    "window {} at {:#x} rehomed {} released {}",
                    fresh_window.remote(),
                    fresh as usize,
                    stats.rehomed - rehomed,
                    stats.released_bytes
                ));
                current = fresh;
                window = Some(fresh_window);
            }
            Some("expect") => {
                let (at, len, seed) = (number(1), number(2), number(3));
                shadow[at..at + len].copy_from_slice(&pattern(seed as u64, len));
                // SAFETY: LEN bytes we own; the device is idle.
                let now = unsafe { std::slice::from_raw_parts(current, LEN) };
                match now.iter().zip(&shadow).position(|(a, b)| a != b) {
                    None => say("ok"),
                    Some(i) => say(format!("bad at {i}: {:#x}", now[i])),
                }
            }
            Some("exit") | None => break,
            Some(other) => panic!("unknown command {other}"),
        }
    }
}

/// A rank whose window's memory is unmapped (and other memory mapped at
/// the same address) while a peer writes 16 MiB into it.
fn vanish_rank(socket: &str, hook: bool) {
    const LEN: usize = 16 << 20;
    let context = Context::open(socket, config(!hook)).expect("open");
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines().map_while(Result::ok);
    while let Some(line) = lines.next() {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.first().copied() {
            Some("arm") => {
                let at = map(0, LEN, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1);
                // SAFETY: LEN bytes we own.
                unsafe { std::ptr::write_bytes(at, 0x11, LEN) };
                // SAFETY: the region is dropped at once, while the memory
                // is mapped; the window below is the unsafe part, and
                // tested.
                let region = unsafe { context.register(at as u64, LEN as u64) }.unwrap();
                // SAFETY: the window is meant to outlive its registration:
                // what the device does when the memory under it is unmapped
                // is what is tested.
                let window =
                    unsafe { context.bind_window_raw(at as u64, LEN as u64, ALL, None) }.unwrap();
                drop(region);
                say(format!("window {}", window.remote()));
                // "go <delay_us>": unmap after the delay, map new memory
                // there, report, then check it once told the transfer is
                // over.
                let go = lines.next().unwrap();
                let delay: u64 = go.split_whitespace().nth(1).unwrap().parse().unwrap();
                std::thread::sleep(Duration::from_micros(delay));
                if hook {
                    // SAFETY: our own mapping; nothing uses it any more.
                    unsafe { pindown_pincache::unmap(at, LEN) }.unwrap();
                } else {
                    // SAFETY: as above (the monitor sees the unmap).
                    assert_eq!(unsafe { libc::munmap(at.cast(), LEN) }, 0);
                }
                let fresh = map(
                    at as usize,
                    LEN,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                );
                assert_eq!(fresh, at);
                // SAFETY: LEN bytes we own.
                unsafe { std::ptr::write_bytes(fresh, 0x33, LEN) };
                say("remapped");
                let _done = lines.next();
                // SAFETY: LEN bytes we own.
                let now = unsafe { std::slice::from_raw_parts(fresh, LEN) };
                match now.iter().position(|&b| b != 0x33) {
                    None => say("untouched"),
                    Some(i) => say(format!("written at {i}")),
                }
                window.revoke().unwrap();
                // SAFETY: our own mapping.
                unsafe { libc::munmap(fresh.cast(), LEN) };
            }
            Some("exit") | None => break,
            Some(other) => panic!("unknown command {other}"),
        }
    }
}

/// A rank with a heap source that streams writes into a peer's window
/// until stopped, and writes patterns on request.
fn writer_rank(socket: &str) {
    let context = Arc::new(Context::open(socket, config(false)).expect("open"));
    let mut source = pattern(0x5eed, 16 << 20);
    let source_addr = source.as_ptr() as u64;
    // SAFETY: `source` lives until the process ends, past the region and
    // the writing thread; the device only reads it.
    let region = unsafe { context.register(source_addr, source.len() as u64) }.unwrap();
    say("ready");
    let mut stream: Option<(Arc<AtomicBool>, std::thread::JoinHandle<[u64; 3]>)> = None;
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        let words: Vec<&str> = line.split_whitespace().collect();
        let number = |i: usize| words[i].parse::<usize>().unwrap();
        match words.first().copied() {
            Some("stream") => {
                let window: RemoteWindow = words[1].parse().unwrap();
                let stop = Arc::new(AtomicBool::new(false));
                let landed = Arc::new(AtomicU64::new(0));
                let (c, st, first) = (Arc::clone(&context), Arc::clone(&stop), Arc::clone(&landed));
                let handle = std::thread::spawn(move || {
                    // ok, refused (not granted), other
                    let mut counts = [0u64; 3];
                    let mut round = 0u64;
                    while !st.load(Ordering::Relaxed) {
                        let len = 256 << 10;
                        let offset = (round % 16) * len;
                        let local = // SAFETY: the range is registered (or deliberately not, to test the
                    // device's check); the device never writes outside registered memory.
                    unsafe { Local::from_raw(source_addr, len as u32) };
                        let done = run(&c, Write::new(local, window.at(offset)).build());
                        let slot = match (done.status, done.detail) {
                            (Status::Success, _) => 0,
                            (Status::RemoteAccessError, ErrorDetail::NotGranted) => 1,
                            _ => 2,
                        };
                        counts[slot] += 1;
                        if slot == 0 {
                            first.fetch_add(1, Ordering::Relaxed);
                        }
                        round += 1;
                    }
                    counts
                });
                stream = Some((stop, handle));
                // Let some writes through before answering (however loaded
                // the machine is: a write must have landed).
                let waiting = std::time::Instant::now();
                while landed.load(Ordering::Relaxed) == 0
                    && waiting.elapsed() < Duration::from_secs(20)
                {
                    std::thread::sleep(Duration::from_millis(1));
                }
                std::thread::sleep(Duration::from_millis(20));
                say("streaming");
            }
            Some("stop") => {
                let (stop, handle) = stream.take().unwrap();
                stop.store(true, Ordering::Relaxed);
                let [ok, refused, other] = handle.join().unwrap();
                say(format!("ok {ok} refused {refused} other {other}"));
            }
            Some("send") => {
                // What the source holds, as it is.
                let window: RemoteWindow = words[1].parse().unwrap();
                let (remote, len) = (number(2), number(3));
                let local = // SAFETY: the range is registered (or deliberately not, to test the
                    // device's check); the device never writes outside registered memory.
                    unsafe { Local::from_raw(source_addr, len as u32) };
                say(status_text(&run(
                    &context,
                    Write::new(local, window.at(remote as u64)).build(),
                )));
            }
            Some("put") => {
                let window: RemoteWindow = words[1].parse().unwrap();
                let (remote, len, seed, skew) = (number(2), number(3), number(4), number(5));
                source[skew..skew + len].copy_from_slice(&pattern(seed as u64, len));
                let local = // SAFETY: the range is registered (or deliberately not, to test the
                    // device's check); the device never writes outside registered memory.
                    unsafe { Local::from_raw(source_addr + skew as u64, len as u32) };
                say(status_text(&run(
                    &context,
                    Write::new(local, window.at(remote as u64)).build(),
                )));
            }
            Some("exit") | None => break,
            Some(other) => panic!("unknown command {other}"),
        }
    }
    drop(region);
}

/// The rank program, started by the other tests of this file.
#[test]
#[ignore = "the rank program: the other tests of this file start it with --ignored"]
fn rank_process() {
    let (role, socket) = common::rank::role();
    match role.as_str() {
        "heap" | "shm" | "private-file" => buffer_rank(&socket, &role),
        "reuse-monitor" => reuse_rank(&socket, false),
        "reuse-hook" => reuse_rank(&socket, true),
        "vanish-monitor" => vanish_rank(&socket, false),
        "vanish-hook" => vanish_rank(&socket, true),
        "writer" => writer_rank(&socket),
        other => panic!("unknown role {other}"),
    }
}

// ---------------------------------------------------------------- parent

/// Starts a buffer rank of `kind` on `socket`; returns it and its window.
fn start_buffer(kind: &str, socket: &std::path::Path) -> (Rank, String) {
    let mut rank = Rank::start(kind, socket);
    let window = rank.next();
    let stats = rank.next();
    let window = window.strip_prefix("window ").unwrap().to_owned();
    // Private memory moved into the pool (each piece and, as it is already
    // shared then, not the whole); shared files went to the table as files.
    match kind {
        // The pieces with their headroom fill the first 64 MiB segment:
        // the last one lies in a second.
        "heap" | "private-file" => assert_eq!(
            stats,
            format!(
                "rehomed {} segments 2 files 0",
                BUFFER_BYTES.div_ceil(PIECE)
            ),
            "{kind}"
        ),
        _ => assert!(
            stats.ends_with("files 2") && stats.starts_with("rehomed 0 "),
            "{kind}: {stats}"
        ),
    }
    (rank, window)
}

/// The rank `first` of `ranks` and the other one.
fn both(ranks: &mut [Rank; 2], first: usize) -> (&mut Rank, &mut Rank) {
    let (a, b) = ranks.split_at_mut(1);
    if first == 0 {
        (&mut a[0], &mut b[0])
    } else {
        (&mut b[0], &mut a[0])
    }
}

fn exchange_every_size(other: &str) {
    let device = DeviceProcess::start(common::device_bin(), 2, &[]).unwrap();
    let (heap, heap_window) = start_buffer("heap", &device.socket(0));
    let (file, file_window) = start_buffer(other, &device.socket(1));
    let mut ranks = [heap, file];
    assert_eq!(ranks[0].ask(&format!("peer {file_window}")), "ok");
    assert_eq!(ranks[1].ask(&format!("peer {heap_window}")), "ok");
    let names = ["heap", other];
    let sizes = [1usize, 7, 4096, 4097, (1 << 20) + 3, 16 << 20];
    for (i, &len) in sizes.iter().enumerate() {
        let seed = 10 + i;
        // Odd offsets on both sides; the large ones cross the 18 MiB
        // boundary between the two shm files and several pool chunks.
        let remote = (10 << 20) + 4093 + 13 * i;
        let local = (1 << 20) + 4095 - 7 * i;
        for first in [0, 1] {
            let what = format!(
                "{} writes {} bytes to {}",
                names[first],
                len,
                names[1 - first]
            );
            let (from, to) = both(&mut ranks, first);
            assert_eq!(
                from.ask(&format!("put {remote} {len} {seed} {local}")),
                "ok",
                "{what}"
            );
            assert_eq!(
                to.ask(&format!("expect {remote} {len} {seed}")),
                "ok",
                "{what}"
            );
        }
        for first in [0, 1] {
            let what = format!(
                "{} reads {} bytes of {}",
                names[first],
                len,
                names[1 - first]
            );
            let (reader, owner) = both(&mut ranks, first);
            let from = 2 * local + 1;
            let expected = owner.ask(&format!("fingerprint {from} {len}"));
            assert_eq!(
                reader.ask(&format!("get {from} {len} {}", local + 8192)),
                expected,
                "{what}"
            );
        }
    }
    // 16 MiB from the end of one buffer to the end of the other: both
    // cross the pool segments of private memory at 32 MiB.
    let (remote, local) = (BUFFER_BYTES - (16 << 20) - 3, (19 << 20) + 1);
    for first in [0, 1] {
        let (from, to) = both(&mut ranks, first);
        assert_eq!(
            from.ask(&format!("put {remote} {} 99 {local}", 16 << 20)),
            "ok"
        );
        assert_eq!(to.ask(&format!("expect {remote} {} 99", 16 << 20)), "ok");
    }
    // Device fetch-adds from the peer and CPU fetch-adds of the owner on
    // one word sum exactly, both ways.
    for first in [0, 1] {
        let (owner, peer) = both(&mut ranks, first);
        assert_eq!(owner.ask("reset-counter"), "ok");
        owner.send("cpu-add 200000");
        peer.send("add 20000");
        assert_eq!(owner.next(), "ok");
        assert_eq!(peer.next(), "ok");
        assert_eq!(owner.ask("counter"), "value 220000", "{}", names[first]);
    }
    for rank in &mut ranks {
        assert_eq!(rank.ask("check"), "ok");
    }
    let [heap, file] = ranks;
    heap.finish();
    file.finish();
}

#[test]
fn a_heap_vec_and_shared_memory_files_exchange_every_size() {
    exchange_every_size("shm");
}

#[test]
fn a_heap_vec_and_a_private_disk_file_mapping_exchange_every_size() {
    exchange_every_size("private-file");
}

fn reuse_under_traffic(role: &str) {
    let device = DeviceProcess::start(common::device_bin(), 2, &[]).unwrap();
    let mut owner = Rank::start(role, &device.socket(0));
    let mut writer = Rank::start("writer", &device.socket(1));
    assert_eq!(writer.next(), "ready");
    let first = owner.next();
    let (mut window, address) = first
        .strip_prefix("window ")
        .unwrap()
        .split_once(" at ")
        .map(|(w, a)| (w.to_owned(), a.to_owned()))
        .unwrap();
    for round in 0..3u8 {
        assert_eq!(writer.ask(&format!("stream {window}")), "streaming");
        assert_eq!(owner.ask("free"), "ok");
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(owner.ask("revoke"), "ok");
        let value = 0x20 + round;
        let again = owner.ask(&format!("again {value}"));
        let stopped = writer.ask("stop");
        let words: Vec<&str> = stopped.split_whitespace().collect();
        assert!(
            words[1].parse::<u64>().unwrap() > 0 && words[3].parse::<u64>().unwrap() > 0,
            "writes land before the free and are refused after it: {stopped}"
        );
        assert_eq!(words[5], "0", "no other failure: {stopped}");
        // The new memory has the old address, a fresh translation (a new
        // move into the pool), and the old pool space came back.
        let (new_window, rest) = again
            .strip_prefix("window ")
            .unwrap()
            .split_once(" at ")
            .unwrap();
        let rest: Vec<&str> = rest.split_whitespace().collect();
        assert_eq!(rest[0], address, "the allocation reused the address");
        assert_eq!(rest[2], "1", "registered anew: {again}");
        assert!(
            rest[4].parse::<u64>().unwrap() >= (4 << 20) * u64::from(round + 1),
            "the old pool space was released: {again}"
        );
        window = new_window.to_owned();
        // Nothing of the stream reached the new memory.
        assert_eq!(owner.ask("expect 0 0 0"), "ok");
        // It receives exactly what is sent to it.
        for (i, (remote, len, skew)) in [(5, 1000, 3), (4093, 70000, 1), ((4 << 20) - 9, 9, 0)]
            .into_iter()
            .enumerate()
        {
            let seed = 100 * u64::from(round) + i as u64;
            assert_eq!(
                writer.ask(&format!("put {window} {remote} {len} {seed} {skew}")),
                "ok"
            );
            assert_eq!(owner.ask(&format!("expect {remote} {len} {seed}")), "ok");
        }
    }
    owner.finish();
    writer.finish();
}

#[test]
fn free_and_malloc_at_the_same_address_under_traffic_with_the_monitor() {
    reuse_under_traffic("reuse-monitor");
}

#[test]
fn unmap_and_map_at_the_same_address_under_traffic_with_the_hook() {
    reuse_under_traffic("reuse-hook");
}

fn vanish_during_a_transfer(role: &str) {
    let device = DeviceProcess::start(common::device_bin(), 2, &[]).unwrap();
    let mut owner = Rank::start(role, &device.socket(0));
    let mut writer = Rank::start("writer", &device.socket(1));
    assert_eq!(writer.next(), "ready");
    let mut outcomes = std::collections::BTreeMap::new();
    // The delays, then (while no write was cut short: a loaded machine
    // may finish the write before the owner acts) more without delay.
    let delays = [0u64, 200, 500, 1000, 2000, 4000, 8000, 300_000];
    for (round, delay) in delays.into_iter().chain([0; 30]).enumerate() {
        if round >= delays.len() && outcomes.len() >= 2 {
            break;
        }
        let window = owner.ask("arm");
        let window = window.strip_prefix("window ").unwrap();
        // A 16 MiB write while the owner unmaps the memory after `delay`.
        writer.send(&format!("send {window} 0 {}", 16 << 20));
        owner.send(&format!("go {delay}"));
        let written = writer.next();
        assert_eq!(owner.next(), "remapped");
        assert!(
            written == "ok" || written.starts_with("status RemoteAccessError"),
            "the write completes, or fails as refused: {written}"
        );
        *outcomes.entry(written).or_insert(0) += 1;
        assert_eq!(owner.ask("done"), "untouched", "delay {delay} us");
    }
    // Over the delays, writes both finished before the unmap and were
    // cut short by it.
    assert!(outcomes.len() >= 2, "{outcomes:?}");
    // The device still serves both ports.
    let window = owner.ask("arm");
    let window = window.strip_prefix("window ").unwrap();
    assert_eq!(writer.ask(&format!("send {window} 7 4096")), "ok");
    owner.send("go 0");
    assert_eq!(owner.next(), "remapped");
    assert_eq!(owner.ask("done"), "untouched");
    owner.finish();
    writer.finish();
}

#[test]
fn memory_unmapped_during_a_transfer_fails_it_and_is_never_written_again_with_the_monitor() {
    vanish_during_a_transfer("vanish-monitor");
}

#[test]
fn memory_unmapped_during_a_transfer_fails_it_and_is_never_written_again_with_the_hook() {
    vanish_during_a_transfer("vanish-hook");
}
