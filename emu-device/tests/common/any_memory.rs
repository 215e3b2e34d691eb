//! What the tests of registering any memory in one process share: a device
//! with two ports and a context on each, one-request helpers, fresh
//! mappings and what `/proc/self/maps` says about an address.

use std::time::Duration;

use pindown_driver::verbs::opcode::{Read, Write};
use pindown_driver::verbs::{Context, ContextConfig, Entry, MemoryWindow};
use pindown_emu_device::testing::DeviceProcess;
use pindown_pincache::CacheConfig;
use pindown_uapi::{Access, Completion};

/// Every right a window can grant.
pub const ALL: Access = Access::REMOTE_READ
    .union(Access::REMOTE_WRITE)
    .union(Access::REMOTE_ATOMIC);

/// A context with a small arena and room to pin 256 MiB.
pub fn config() -> ContextConfig {
    ContextConfig {
        arena_bytes: 8 << 20,
        cache: CacheConfig {
            max_pinned_bytes: Some(256 << 20),
            ..CacheConfig::default()
        },
        ..ContextConfig::default()
    }
}

/// A device with two ports and a context on each: `owner` owns the
/// memory under test, `peer` reaches it through windows.
pub struct Pair {
    pub _device: DeviceProcess,
    pub owner: Context,
    pub peer: Context,
}

/// Starts a device with two ports and opens a context on each.
pub fn pair() -> Pair {
    let device = DeviceProcess::start(super::device_bin(), 2, &[]).unwrap();
    let owner = Context::open(device.socket(0), config()).unwrap();
    let peer = Context::open(device.socket(1), config()).unwrap();
    Pair {
        _device: device,
        owner,
        peer,
    }
}

/// Posts one request on a queue pair of its own and waits for its
/// completion.
pub fn run(context: &Context, entry: Entry<'_>) -> Completion {
    let mut cq = context.create_completion_queue();
    let mut qp = context.create_queue_pair(&mut cq).unwrap();
    qp.post(&[entry.signaled()]).unwrap();
    let mut ready = cq.wait(Duration::from_secs(20)).unwrap();
    ready.next().unwrap()
}

/// Writes `data` from the peer's arena into `window` at `offset`.
pub fn peer_writes(pair: &Pair, window: &MemoryWindow, offset: u64, data: &[u8]) {
    let source = pair.peer.alloc(data.len(), 4096).unwrap();
    source.write_at(0, data);
    let region = pair.peer.register_buffer(&source).unwrap();
    let local = region.local(0, data.len() as u32).unwrap();
    let done = run(
        &pair.peer,
        Write::new(local, window.remote().at(offset)).build(),
    );
    assert!(done.is_success(), "{done:?}");
}

/// Reads `len` bytes of `window` at `offset` into the peer's arena.
pub fn peer_reads(pair: &Pair, window: &MemoryWindow, offset: u64, len: usize) -> Vec<u8> {
    let sink = pair.peer.alloc(len, 4096).unwrap();
    let region = pair.peer.register_buffer(&sink).unwrap();
    let local = region.local(0, len as u32).unwrap();
    let done = run(
        &pair.peer,
        Read::new(local, window.remote().at(offset)).build(),
    );
    assert!(done.is_success(), "{done:?}");
    let mut out = vec![0u8; len];
    sink.read_at(0, &mut out);
    out
}

/// A fresh private anonymous mapping of `len` bytes.
pub fn anonymous(len: usize, prot: libc::c_int) -> *mut u8 {
    // SAFETY: a new private anonymous mapping placed by the kernel.
    let at = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            prot,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(at, libc::MAP_FAILED);
    at.cast()
}

/// Whether `/proc/self/maps` shows `addr` in a shared mapping, and its
/// permissions.
pub fn mapping_of(addr: usize) -> (bool, String) {
    let text = std::fs::read_to_string("/proc/self/maps").unwrap();
    for line in text.lines() {
        let (range, rest) = line.split_once(' ').unwrap();
        let (start, end) = range.split_once('-').unwrap();
        let (start, end) = (
            usize::from_str_radix(start, 16).unwrap(),
            usize::from_str_radix(end, 16).unwrap(),
        );
        if start <= addr && addr < end {
            let perms = &rest[..4];
            return (perms.ends_with('s'), perms[..3].to_owned());
        }
    }
    panic!("{addr:#x} is not mapped");
}
