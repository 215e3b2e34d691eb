//! Registration of any mapped memory, in one driver process with two ports
//! of a real device process: stack arrays, `libc::malloc` buffers,
//! anonymous and read-only mappings, a writer on the same pages while they
//! move into shared memory, a memory table growing under transfers, and
//! the errors for holes, memory without access and disk files mapped
//! `MAP_SHARED`. (`any_memory_ranks.rs` moves bytes between two processes,
//! `any_memory_fork.rs` forks.)

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use common::any_memory::{anonymous, mapping_of, pair, peer_reads, peer_writes, run, Pair, ALL};
use common::rank::pattern;
use pindown_driver::reach::ReachError;
use pindown_driver::verbs::opcode::{FetchAdd, Read, Write};
use pindown_driver::verbs::VerbsError;
use pindown_uapi::{Access, Opcode, Status};

#[inline(never)]
fn stack_array_round_trip(pair: &Pair) {
    let mut array = [0x11u8; 3 * 4096 + 123];
    let addr = array.as_ptr() as u64 + 7;
    let len = array.len() as u64 - 14;
    // SAFETY: `array` outlives the region and the window (both gone
    // before it goes out of scope) and is read with volatile reads.
    let region = unsafe { pair.owner.register(addr, len) }.unwrap();
    let window = pair.owner.bind_window(&region, 0, len, ALL).unwrap();
    let data = pattern(1, len as usize);
    peer_writes(pair, &window, 0, &data);
    // SAFETY: the device has finished (the completion arrived); volatile
    // reads, since the compiler does not know the device wrote there.
    let landed: Vec<u8> = (0..array.len())
        .map(|i| unsafe { std::ptr::read_volatile(array.as_ptr().add(i)) })
        .collect();
    assert_eq!(&landed[7..7 + len as usize], &data[..]);
    assert!(landed[..7].iter().all(|&b| b == 0x11));
    assert!(landed[7 + len as usize..].iter().all(|&b| b == 0x11));
    // The thread's own frames live in these pages too, and it goes on.
    array[3] = 0x99;
    assert_eq!(peer_reads(pair, &window, 0, 64), data[..64]);
    window.revoke().unwrap();
    drop(region);
    assert_eq!(pair.owner.invalidate(addr, len), 1);
    assert!(mapping_of(addr as usize).0, "the stack pages were rehomed");
    std::hint::black_box(&mut array);
}

#[test]
fn stack_arrays_and_c_heap_buffers_are_reached_in_place() {
    let pair = pair();
    stack_array_round_trip(&pair);

    let len = (1 << 20) + 4096 * 3 + 5;
    // SAFETY: a C allocation we free below.
    let buffer = unsafe { libc::malloc(len) }.cast::<u8>();
    assert!(!buffer.is_null());
    // SAFETY: `len` bytes we own.
    unsafe { std::ptr::write_bytes(buffer, 0x22, len) };
    // SAFETY: the allocation is freed only after the region and the
    // window are gone, and read once the device has finished.
    let region = unsafe { pair.owner.register(buffer as u64, len as u64) }.unwrap();
    let window = pair.owner.bind_window(&region, 0, len as u64, ALL).unwrap();
    let data = pattern(2, len - 10);
    peer_writes(&pair, &window, 5, &data);
    // SAFETY: `len` bytes we own; the device is done.
    let landed = unsafe { std::slice::from_raw_parts(buffer, len) }.to_vec();
    assert_eq!(&landed[5..len - 5], &data[..]);
    assert_eq!(&landed[..5], &[0x22; 5]);
    assert_eq!(&landed[len - 5..], &[0x22; 5]);
    // A device atomic next to the owner's CPU atomics on the same word.
    let word = (buffer as usize + 64).next_multiple_of(8);
    // SAFETY: an aligned word inside the buffer, touched only atomically
    // from here on.
    let counter = unsafe { AtomicU64::from_ptr(word as *mut u64) };
    counter.store(0, Ordering::SeqCst);
    for _ in 0..100 {
        let add = FetchAdd::new(window.remote().at((word - buffer as usize) as u64), 3).build();
        assert!(run(&pair.peer, add).is_success());
        counter.fetch_add(1, Ordering::SeqCst);
    }
    assert_eq!(counter.load(Ordering::SeqCst), 400);
    window.revoke().unwrap();
    drop(region);
    pair.owner.invalidate(buffer as u64, len as u64);
    // SAFETY: the buffer was allocated above and is no longer used.
    unsafe { libc::free(buffer.cast()) };
}

/// An inline write from the program's own memory (a C heap buffer)
/// carries its bytes in the send queue: the source may change as soon as
/// `post` returns, and what lands is what it held then. Memory another
/// context registered is refused, inline or not.
#[test]
fn inline_writes_from_program_memory_carry_their_bytes_in_the_queue() {
    let pair = pair();
    let target = pair.owner.alloc(4096, 4096).unwrap();
    target.write_at(0, &[0u8; 4096]);
    let target_region = pair.owner.register_buffer(&target).unwrap();
    let window = pair
        .owner
        .bind_window(&target_region, 0, 4096, ALL)
        .unwrap();
    let len = 200;
    // SAFETY: a C allocation freed below, once the region is gone.
    let source = unsafe { libc::malloc(len) }.cast::<u8>();
    assert!(!source.is_null());
    let mut cq = pair.peer.create_completion_queue();
    let mut qp = pair.peer.create_queue_pair(&mut cq).unwrap();
    for (round, len) in [1usize, 8, 64, 200].into_iter().enumerate() {
        let sent = pattern(round as u64 + 10, len);
        // SAFETY: `len` bytes of the allocation, which nothing else uses.
        unsafe { std::ptr::copy_nonoverlapping(sent.as_ptr(), source, len) };
        // SAFETY: the allocation outlives the region and every request
        // naming it (each is waited for below).
        let region = unsafe { pair.peer.register(source as u64, len as u64) }.unwrap();
        let at = 512 * round;
        let entry = Write::new(
            region.local(0, len as u32).unwrap(),
            window.remote().at(at as u64),
        )
        .build()
        .inline()
        .signaled();
        qp.post(&[entry]).unwrap();
        // The bytes went with the request: overwriting them now changes
        // nothing of what lands.
        // SAFETY: as above.
        unsafe { std::ptr::write_bytes(source, 0xEE, len) };
        let done = cq
            .wait(std::time::Duration::from_secs(20))
            .unwrap()
            .next()
            .unwrap();
        assert!(done.is_success(), "{done:?}");
        assert_eq!(done.opcode, Some(Opcode::WriteInline), "{len} bytes");
        let mut landed = vec![0u8; len + 1];
        target.read_at(at, &mut landed);
        assert_eq!(&landed[..len], &sent[..], "{len} bytes");
        assert_eq!(landed[len], 0, "a byte past the write");
        drop(region);
    }
    // Memory another context registered does not go inline: the device
    // refuses it, as it would the same write not inline, and nothing
    // lands. (This context's pin-down cache lets go of it first.)
    pair.peer.invalidate(source as u64, len as u64);
    // SAFETY: as above.
    let foreign = unsafe { pair.owner.register(source as u64, 8) }.unwrap();
    let entry = Write::new(foreign.local(0, 8).unwrap(), window.remote().at(3000))
        .build()
        .inline()
        .signaled();
    qp.post(&[entry]).unwrap();
    let refused = cq
        .wait(std::time::Duration::from_secs(20))
        .unwrap()
        .next()
        .unwrap();
    assert_eq!(refused.status, Status::LocalProtectionError, "{refused:?}");
    let mut untouched = [0xffu8; 8];
    target.read_at(3000, &mut untouched);
    assert_eq!(untouched, [0; 8]);
    drop(foreign);
    drop(qp);
    window.revoke().unwrap();
    pair.owner.invalidate(source as u64, len as u64);
    // SAFETY: allocated above; no region or request names it any more.
    unsafe { libc::free(source.cast()) };
}

/// Slots a writer thread fills round after round; a slot that does not
/// hold what the writer left there in the previous round lost a write.
struct Hammer {
    slots: *mut u64,
    count: usize,
    stop: AtomicBool,
    lost: AtomicU64,
    rounds: AtomicU64,
}

// SAFETY: the slots are only touched through volatile accesses by the
// writer thread; the raw pointer is an address.
unsafe impl Send for Hammer {}
// SAFETY: as above.
unsafe impl Sync for Hammer {}

impl Hammer {
    fn run(&self) {
        let mut round = 0u64;
        while !self.stop.load(Ordering::Relaxed) {
            for k in 0..self.count {
                // SAFETY: slot `k` lies in the mapping the test keeps alive
                // until this thread is joined.
                unsafe {
                    let slot = self.slots.add(k);
                    let expected = if round == 0 {
                        0
                    } else {
                        (round - 1) * self.count as u64 + k as u64 + 1
                    };
                    if std::ptr::read_volatile(slot) != expected {
                        self.lost.fetch_add(1, Ordering::Relaxed);
                    }
                    std::ptr::write_volatile(slot, round * self.count as u64 + k as u64 + 1);
                }
            }
            round += 1;
            self.rounds.store(round, Ordering::Relaxed);
        }
    }
}

#[test]
fn a_neighbour_writing_while_its_pages_move_loses_no_write() {
    let pair = pair();
    let page = pindown_driver::page_size();
    let mut total_rounds = 0;
    for round in 0..100 {
        // Three pages: the registered buffer ends one page in, and the
        // writer's slots fill the rest of its page and the next.
        let base = anonymous(3 * page, libc::PROT_READ | libc::PROT_WRITE);
        let buffer = base as u64 + 64;
        let buffer_len = page as u64;
        let slots_at = base as usize + 64 + page;
        let hammer = Arc::new(Hammer {
            slots: slots_at as *mut u64,
            count: (3 * page - 64 - page) / 8,
            stop: AtomicBool::new(false),
            lost: AtomicU64::new(0),
            rounds: AtomicU64::new(0),
        });
        let writer = {
            let hammer = Arc::clone(&hammer);
            std::thread::spawn(move || hammer.run())
        };
        // Register while the writer runs: after its first round, and let
        // it run two more rounds afterwards.
        let rounds_done = || hammer.rounds.load(Ordering::Relaxed);
        while rounds_done() < 1 + round % 3 {
            std::hint::spin_loop();
        }
        // SAFETY: the mapping outlives the region; the device never
        // touches it (no request, no window).
        let region = unsafe { pair.owner.register(buffer, buffer_len) }.unwrap();
        let after = rounds_done();
        while rounds_done() < after + 2 {
            std::hint::spin_loop();
        }
        hammer.stop.store(true, Ordering::Relaxed);
        writer.join().unwrap();
        assert_eq!(hammer.lost.load(Ordering::Relaxed), 0, "round {round}");
        total_rounds += hammer.rounds.load(Ordering::Relaxed);
        assert!(mapping_of(buffer as usize).0, "the pages moved");
        // The slots hold the writer's last round.
        let rounds = hammer.rounds.load(Ordering::Relaxed);
        for k in 0..hammer.count {
            // SAFETY: the mapping is alive; the writer has finished.
            let value = unsafe { std::ptr::read_volatile((slots_at as *const u64).add(k)) };
            assert_eq!(value, (rounds - 1) * hammer.count as u64 + k as u64 + 1);
        }
        drop(region);
        pair.owner.invalidate(buffer, buffer_len);
        // SAFETY: unmapping the test's own mapping, no longer used.
        unsafe { libc::munmap(base.cast(), 3 * page) };
    }
    assert!(total_rounds > 100, "the writer ran ({total_rounds} rounds)");
    assert!(pair.owner.reach_stats().rehomed >= 100);
}

#[test]
fn read_only_memory_registers_read_only() {
    let pair = pair();
    let len = 4 * 4096;
    let base = anonymous(len, libc::PROT_READ | libc::PROT_WRITE);
    let data = pattern(3, len);
    // SAFETY: `len` bytes of the fresh mapping.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), base, len) };
    // SAFETY: the mapping made above.
    assert_eq!(
        unsafe { libc::mprotect(base.cast(), len, libc::PROT_READ) },
        0
    );
    // SAFETY: the mapping outlives the region, and is only read.
    let region = unsafe { pair.owner.register(base as u64, len as u64) }.unwrap();
    assert_eq!(mapping_of(base as usize), (true, "r--".to_owned()));
    for access in [Access::REMOTE_WRITE, Access::REMOTE_ATOMIC, ALL] {
        match pair.owner.bind_window(&region, 0, len as u64, access) {
            Err(VerbsError::ReadOnlyMemory { addr, len: l }) => {
                assert_eq!((addr, l), (base as u64, len as u64))
            }
            other => panic!("a {access:?} window over read-only memory: {other:?}"),
        }
    }
    let window = pair
        .owner
        .bind_window(&region, 0, len as u64, Access::REMOTE_READ)
        .unwrap();
    assert_eq!(peer_reads(&pair, &window, 5, len - 5), data[5..]);
    // As a local destination, it is refused by the device.
    let local = region.local(0, 64).unwrap();
    let target = pair.peer.alloc(4096, 4096).unwrap();
    let target_region = pair.peer.register_buffer(&target).unwrap();
    let open = pair
        .peer
        .bind_window(&target_region, 0, 4096, Access::REMOTE_READ)
        .unwrap();
    let done = run(&pair.owner, Read::new(local, open.remote().at(0)).build());
    assert_eq!(done.status, Status::LocalProtectionError, "{done:?}");
    // SAFETY: the mapping is alive and readable.
    let now = unsafe { std::slice::from_raw_parts(base, len) };
    assert_eq!(now, &data[..], "unchanged");
}

#[test]
fn holes_memory_without_access_and_shared_disk_files_are_refused_by_name() {
    let pair = pair();
    let page = pindown_driver::page_size();
    // A hole: three pages with the middle one unmapped.
    let base = anonymous(3 * page, libc::PROT_READ | libc::PROT_WRITE);
    // SAFETY: unmapping a page of our own mapping.
    unsafe { libc::munmap(base.add(page).cast(), page) };
    // SAFETY (and below, to the disk file): each registration is refused,
    // so the device never reaches the memory.
    match unsafe { pair.owner.register(base as u64, 3 * page as u64) } {
        Err(VerbsError::Unreachable(ReachError::Unmapped { addr })) => {
            assert_eq!(addr, base as u64 + page as u64)
        }
        other => panic!("a hole: {other:?}"),
    }
    let error = unsafe { pair.owner.register(base as u64, 3 * page as u64) }.unwrap_err();
    assert!(
        error
            .to_string()
            .contains(&format!("{:#x}", base as usize + page)),
        "{error}"
    );
    // No access.
    let none = anonymous(page, libc::PROT_NONE);
    assert!(matches!(
        unsafe { pair.owner.register(none as u64, 8) },
        Err(VerbsError::Unreachable(ReachError::NoAccess { .. }))
    ));
    // A disk file mapped shared.
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = dir.path().join("shared-on-disk");
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    file.set_len(4 * page as u64).unwrap();
    // SAFETY: a new shared mapping of the file, placed by the kernel.
    let mapped = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            4 * page,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            std::os::fd::AsRawFd::as_raw_fd(&file),
            0,
        )
    };
    assert_ne!(mapped, libc::MAP_FAILED);
    match unsafe { pair.owner.register(mapped as u64 + 10, 100) } {
        Err(VerbsError::Unreachable(error @ ReachError::DiskFile { .. })) => {
            let text = error.to_string();
            assert!(text.contains(path.to_str().unwrap()), "{text}");
            assert!(text.contains("memory file systems"), "{text}");
        }
        other => panic!("a shared disk file: {other:?}"),
    }
    // A disk file mapped privately and writable (as a program's initialized
    // statics are): userfaultfd cannot fence it, so it is refused unless
    // the caller vouches that no other thread writes there.
    // SAFETY: a new private mapping of the file, placed by the kernel.
    let private = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            4 * page,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE,
            std::os::fd::AsRawFd::as_raw_fd(&file),
            0,
        )
    }
    .cast::<u8>();
    assert_ne!(private.cast(), libc::MAP_FAILED);
    // SAFETY: the first 64 bytes of the mapping, which no one else uses.
    let bytes = unsafe { std::slice::from_raw_parts_mut(private.add(64), 64) };
    bytes.fill(0x5a);
    let unfenced_before = pair.owner.reach_stats().unfenced;
    // SAFETY: refused (checked below), so nothing is registered.
    match unsafe { pair.owner.register_bytes(bytes) } {
        Err(VerbsError::Unreachable(ReachError::Unfenceable { start, .. })) => {
            assert_eq!(start, private as u64)
        }
        other => panic!("a private disk-file mapping, safe form: {other:?}"),
    }
    // SAFETY: refused (checked), so the device never reaches it.
    match unsafe { pair.owner.register(private as u64, 4 * page as u64) } {
        Err(VerbsError::Unreachable(error @ ReachError::Unfenceable { .. })) => {
            let text = error.to_string();
            assert!(text.contains("register_unfenced"), "{text}");
        }
        other => panic!("a private disk-file mapping: {other:?}"),
    }
    assert!(!mapping_of(private as usize).0, "refused, not moved");
    // SAFETY: no other thread touches the mapping, which stays mapped past
    // the region and the window (read once the device has finished).
    let region = unsafe {
        pair.owner
            .register_unfenced(private as u64, 4 * page as u64)
    }
    .unwrap();
    assert_eq!(pair.owner.reach_stats().unfenced, unfenced_before + 1);
    let window = pair
        .owner
        .bind_window(&region, 0, 4 * page as u64, ALL)
        .unwrap();
    peer_writes(&pair, &window, 128, &pattern(11, 100));
    // SAFETY: inside the mapping; the device has finished.
    let landed = unsafe { std::slice::from_raw_parts(private.add(64), 164) }.to_vec();
    assert_eq!(&landed[..64], &[0x5a; 64]);
    assert_eq!(&landed[64..], &pattern(11, 100)[..]);
    window.revoke().unwrap();
    drop(region);
    // The file itself is unchanged: the mapping is private.
    let mut on_disk = vec![0u8; 256];
    std::io::Read::read_exact(&mut &file, &mut on_disk).unwrap();
    assert!(on_disk.iter().all(|&b| b == 0), "the file changed");

    // The device still serves this port.
    let mut heap = vec![0u8; 1000];
    // SAFETY: `heap` outlives the region and the window; it is read once
    // the device has finished, through black_box.
    let region = unsafe { pair.owner.register(heap.as_ptr() as u64, 1000) }.unwrap();
    let window = pair.owner.bind_window(&region, 0, 1000, ALL).unwrap();
    peer_writes(&pair, &window, 0, &pattern(4, 1000));
    heap.iter_mut().for_each(|b| *b = std::hint::black_box(*b));
    assert_eq!(heap, pattern(4, 1000));
}

#[test]
fn a_growing_memory_table_keeps_windows_and_transfers_going() {
    let pair = Arc::new(pair());
    let len = 16 << 20;
    let mut target = vec![0u8; len];
    // SAFETY: `target` is freed after the window and the region (dropped
    // at the end), and read once the writes have finished.
    let region = unsafe { pair.owner.register(target.as_ptr() as u64, len as u64) }.unwrap();
    let window = pair.owner.bind_window(&region, 0, len as u64, ALL).unwrap();
    let remote = window.remote();
    let tables_before = pair.owner.reach_stats().tables_sent;
    // The peer streams 16 MiB writes into the window...
    let stop = Arc::new(AtomicBool::new(false));
    let stream = {
        let (pair, stop) = (Arc::clone(&pair), Arc::clone(&stop));
        std::thread::spawn(move || {
            let source = pattern(6, len);
            // SAFETY: `source` outlives the region; the device only reads it.
            let source_region =
                unsafe { pair.peer.register(source.as_ptr() as u64, len as u64) }.unwrap();
            let local = source_region.local(0, len as u32).unwrap();
            let mut writes = 0;
            while !stop.load(Ordering::Relaxed) || writes < 3 {
                let done = run(&pair.peer, Write::new(local, remote.at(0)).build());
                assert!(done.is_success(), "write {writes}: {done:?}");
                writes += 1;
            }
            writes
        })
    };
    // ...while the owner's memory table grows: pool segments for new
    // private memory, and a shared memory file.
    let mut kept = Vec::new();
    for size in [40 << 20, 70 << 20, 100 << 20] {
        let buffer = vec![1u8; size];
        // SAFETY: kept beside its region (a Vec's move leaves the bytes in
        // place) and dropped after it; the device never touches it.
        let region = unsafe { pair.owner.register(buffer.as_ptr() as u64, size as u64) }.unwrap();
        kept.push((region, buffer));
    }
    let shm = tempfile::tempfile_in("/dev/shm").unwrap();
    shm.set_len(1 << 20).unwrap();
    // SAFETY: a new shared mapping of the file, placed by the kernel.
    let mapped = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            1 << 20,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            std::os::fd::AsRawFd::as_raw_fd(&shm),
            0,
        )
    };
    assert_ne!(mapped, libc::MAP_FAILED);
    // SAFETY: the mapping is never unmapped; the device never touches it.
    let shm_region = unsafe { pair.owner.register(mapped as u64, 1 << 20) }.unwrap();
    stop.store(true, Ordering::Relaxed);
    let writes = stream.join().unwrap();
    let stats = pair.owner.reach_stats();
    assert!(
        stats.tables_sent >= tables_before + 3 && stats.segments >= 3 && stats.file_regions == 1,
        "{stats:?}"
    );
    // Every write arrived whole, and the window still works.
    target
        .iter_mut()
        .for_each(|b| *b = std::hint::black_box(*b));
    assert!(target == pattern(6, len), "after {writes} writes");
    peer_writes(&pair, &window, 3, &pattern(7, 5000));
    target
        .iter_mut()
        .for_each(|b| *b = std::hint::black_box(*b));
    assert_eq!(&target[3..5003], &pattern(7, 5000)[..]);
    drop(window);
    drop((shm_region, kept, region));
}

#[test]
fn a_region_held_across_an_invalidation_leaves_the_next_registration_whole() {
    // Held, invalidated (retired while held), registered again (a new
    // cache entry over the same pages), then the old one released: the
    // new registration must keep its device mappings, writable.
    let pair = pair();
    let len = 16 * 4096;
    let base = anonymous(len, libc::PROT_READ | libc::PROT_WRITE);
    let before = pattern(5, len);
    // SAFETY: `len` bytes of the fresh mapping.
    unsafe { std::ptr::copy_nonoverlapping(before.as_ptr(), base, len) };
    // SAFETY (both): the mapping is never unmapped, and read with
    // volatile reads once the device has finished.
    let old = unsafe { pair.owner.register(base as u64, len as u64) }.unwrap();
    assert_eq!(pair.owner.invalidate(base as u64, len as u64), 1);
    let new = unsafe { pair.owner.register(base as u64, len as u64) }.unwrap();
    drop(old);
    let window = pair
        .owner
        .bind_window(&new, 0, len as u64, ALL)
        .expect("the new registration is still writable");
    let data = pattern(6, len - 3);
    peer_writes(&pair, &window, 3, &data);
    // SAFETY: the mapping is alive; the device finished (the completion
    // came); volatile, since the compiler does not see the device write.
    let landed: Vec<u8> = (0..len)
        .map(|i| unsafe { std::ptr::read_volatile(base.add(i)) })
        .collect();
    assert_eq!(&landed[..3], &before[..3]);
    assert_eq!(&landed[3..], &data[..]);
    assert_eq!(peer_reads(&pair, &window, 0, len), landed);
}
