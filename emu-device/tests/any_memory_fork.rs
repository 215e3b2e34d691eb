//! `fork()` after registering memory, in a process of its own (a child of
//! `fork()` runs the C library's fork code before the fork handler restores
//! rehomed memory: tests elsewhere in the same process that register small
//! heap objects could leave a thread arena's header page out of the
//! child): the child gets private copies of rehomed memory and its writes
//! never reach the parent; memfds and shared anonymous memory go to the
//! device as files and stay shared.

mod common;

use common::any_memory::{mapping_of, pair, peer_writes, ALL};
use common::rank::pattern;
use pindown_driver::verbs::opcode::Read;
use pindown_driver::verbs::{Context, ContextConfig};
use pindown_emu_device::testing::DeviceProcess;

#[test]
fn a_forked_child_gets_a_private_copy_of_rehomed_memory() {
    let pair = pair();
    // Above the C library's mmap threshold: a mapping of its own.
    let mut buffer = vec![0x44u8; 1 << 20];
    // SAFETY: `buffer` outlives the region and the window, and the parent
    // reads it only once the device has finished.
    let region = unsafe {
        pair.owner
            .register(buffer.as_ptr() as u64, buffer.len() as u64)
    }
    .unwrap();
    assert!(mapping_of(buffer.as_ptr() as usize).0);
    let window = pair
        .owner
        .bind_window(&region, 0, buffer.len() as u64, ALL)
        .unwrap();
    // SAFETY: the child only reads and writes its own copy of the buffer
    // and ends with _exit, calling no allocator or lock of the parent.
    let child = unsafe { libc::fork() };
    assert!(child >= 0);
    if child == 0 {
        let p = buffer.as_mut_ptr();
        // SAFETY: the child's copy of the buffer; _exit ends the child.
        unsafe {
            let sees_parent = std::ptr::read_volatile(p.add(100)) == 0x44;
            std::ptr::write_bytes(p, 0x55, 1 << 20);
            libc::_exit(if sees_parent { 0 } else { 3 });
        }
    }
    let mut status = 0;
    // SAFETY: waits for our own child.
    assert_eq!(unsafe { libc::waitpid(child, &mut status, 0) }, child);
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "{status:#x}"
    );
    buffer
        .iter_mut()
        .for_each(|b| *b = std::hint::black_box(*b));
    assert!(
        buffer.iter().all(|&b| b == 0x44),
        "the child wrote into the parent"
    );
    // The device still reaches the parent's pages.
    peer_writes(&pair, &window, 8, &pattern(5, 1000));
    buffer
        .iter_mut()
        .for_each(|b| *b = std::hint::black_box(*b));
    assert_eq!(&buffer[8..1008], &pattern(5, 1000)[..]);
}

#[test]
fn shared_anonymous_memory_and_memfds_stay_shared() {
    let pair = pair();
    let len = 64 << 10;
    // A memfd mapped twice: the device writes through one mapping's
    // registration, the other mapping sees it.
    // SAFETY: memfd_create with a valid name; the descriptor is owned below.
    let fd = unsafe { libc::memfd_create(c"any-memory-test".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: `fd` is new and owned by nobody else.
    let memfd = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    memfd.set_len(len as u64).unwrap();
    let map_shared = |fd: libc::c_int, flags: libc::c_int| {
        // SAFETY: a new shared mapping placed by the kernel.
        let at = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | flags,
                fd,
                0,
            )
        };
        assert_ne!(at, libc::MAP_FAILED);
        at.cast::<u8>()
    };
    let (one, two) = (map_shared(fd, 0), map_shared(fd, 0));
    // SAFETY: the mappings are never unmapped, and read once the device
    // has finished.
    let region = unsafe { pair.owner.register(one as u64 + 100, 5000) }.unwrap();
    let window = pair.owner.bind_window(&region, 0, 5000, ALL).unwrap();
    peer_writes(&pair, &window, 0, &pattern(8, 5000));
    // SAFETY: live mappings of `len` bytes; the device is done.
    let seen = unsafe { std::slice::from_raw_parts(two.add(100), 5000) };
    assert_eq!(seen, &pattern(8, 5000)[..]);
    assert_eq!(pair.owner.reach_stats().file_regions, 1);
    assert_eq!(pair.owner.reach_stats().rehomed, 0);

    // MAP_SHARED | MAP_ANONYMOUS shared with a child: the child sees what
    // the device wrote into the parent's registration.
    let anon = map_shared(-1, libc::MAP_ANONYMOUS);
    let mut ready = [0 as libc::c_int; 2];
    // SAFETY: a pipe into an array of two descriptors.
    assert_eq!(unsafe { libc::pipe(ready.as_mut_ptr()) }, 0);
    // SAFETY: the child only waits on the pipe, reads the shared memory and
    // ends with _exit.
    let child = unsafe { libc::fork() };
    assert!(child >= 0);
    if child == 0 {
        let mut byte = [0u8];
        // SAFETY: reading one byte from our end of the pipe; then the
        // shared mapping, which the child inherited.
        unsafe {
            libc::read(ready[0], byte.as_mut_ptr().cast(), 1);
            let seen = std::slice::from_raw_parts(anon.add(8), 1000);
            let expected = pattern(9, 1000);
            libc::_exit(if seen == &expected[..] { 0 } else { 4 });
        }
    }
    // SAFETY: as above.
    let region = unsafe { pair.owner.register(anon as u64 + 8, 1000) }.unwrap();
    let window = pair.owner.bind_window(&region, 0, 1000, ALL).unwrap();
    peer_writes(&pair, &window, 0, &pattern(9, 1000));
    // SAFETY: writing one byte to our end of the pipe.
    assert_eq!(
        unsafe { libc::write(ready[1], [1u8].as_ptr().cast(), 1) },
        1
    );
    let mut status = 0;
    // SAFETY: waits for our own child.
    assert_eq!(unsafe { libc::waitpid(child, &mut status, 0) }, child);
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "the child does not see the device's write: {status:#x}"
    );
    assert_eq!(pair.owner.reach_stats().file_regions, 2);
    assert_eq!(pair.owner.reach_stats().rehomed, 0);
}

/// A fresh private mapping of `len` bytes, at `hint` exactly when given.
fn map_private(hint: usize, len: usize) -> *mut u8 {
    let fixed = if hint != 0 {
        libc::MAP_FIXED_NOREPLACE
    } else {
        0
    };
    // SAFETY: a new anonymous mapping, placed at `hint` only where nothing
    // is mapped (MAP_FIXED_NOREPLACE).
    let at = unsafe {
        libc::mmap(
            hint as *mut libc::c_void,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | fixed,
            -1,
            0,
        )
    };
    assert_ne!(at, libc::MAP_FAILED);
    at.cast()
}

/// The first byte the peer reads through a window over `len` bytes at
/// `at`, registered by `owner` now, and whether that registration hit
/// the cache.
fn first_byte_seen(owner: &Context, peer: &Context, at: *mut u8, len: usize) -> (u8, bool) {
    let hits = owner.registration_stats().hits;
    // SAFETY: the memory stays mapped while the region and window live
    // (both dropped before this returns).
    let region = unsafe { owner.register(at as u64, len as u64) }.unwrap();
    let hit = owner.registration_stats().hits > hits;
    let window = owner.bind_window(&region, 0, len as u64, ALL).unwrap();
    let sink = peer.alloc(4096, 4096).unwrap();
    let sink_region = peer.register_buffer(&sink).unwrap();
    let read = Read::new(sink_region.local(0, 64).unwrap(), window.remote().at(0)).build();
    let done = common::any_memory::run(peer, read);
    assert!(done.is_success(), "{done:?}");
    let mut byte = [0u8];
    sink.read_at(0, &mut byte);
    (byte[0], hit)
}

#[test]
fn a_fork_child_dropping_its_context_leaves_the_parents_memory_watched() {
    const LEN: usize = 1 << 20;
    let device = DeviceProcess::start(common::device_bin(), 2, &[]).unwrap();
    // The driver's default: the unmap monitor runs (root here).
    let owner = Context::open(
        device.socket(0),
        ContextConfig {
            arena_bytes: 8 << 20,
            ..ContextConfig::default()
        },
    )
    .unwrap();
    let peer = Context::open(device.socket(1), common::any_memory::config()).unwrap();
    assert!(owner.unmaps_watched());
    let at = map_private(0, LEN);
    // SAFETY: LEN bytes of our own mapping.
    unsafe { std::ptr::write_bytes(at, 0x11, LEN) };
    assert_eq!(first_byte_seen(&owner, &peer, at, LEN).0, 0x11);
    // The region stays cached (idle) and watched. A child drops its copy
    // of the context, as a forked worker that never uses it does.
    // SAFETY: the child drops its copy of the context and ends with
    // _exit; it touches nothing of the parent's but through the inherited
    // descriptors the drop must leave alone.
    let child = unsafe { libc::fork() };
    assert!(child >= 0);
    if child == 0 {
        drop(owner);
        // SAFETY: ends the child at once.
        unsafe { libc::_exit(0) };
    }
    let mut status = 0;
    // SAFETY: waits for our own child.
    assert_eq!(unsafe { libc::waitpid(child, &mut status, 0) }, child);
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0);
    // The program frees the buffer (a plain munmap, as free does) and
    // gets new memory at the same address.
    // SAFETY: our own mapping, no longer used.
    assert_eq!(unsafe { libc::munmap(at.cast(), LEN) }, 0);
    let again = map_private(at as usize, LEN);
    assert_eq!(again, at);
    // SAFETY: LEN bytes of our own mapping.
    unsafe { std::ptr::write_bytes(again, 0x22, LEN) };
    assert_eq!(
        first_byte_seen(&owner, &peer, again, LEN),
        (0x22, false),
        "the device must read the new memory, through a new registration"
    );
    drop(owner);
    // SAFETY: our own mapping, no longer registered.
    assert_eq!(unsafe { libc::munmap(again.cast(), LEN) }, 0);
}
