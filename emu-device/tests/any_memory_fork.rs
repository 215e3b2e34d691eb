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
