//! Memory the device may still use stays allocated, whatever safe code
//! drops: a buffer dropped under a posted request, or under a window
//! leaked with `mem::forget`, is not handed to the next allocation until
//! the device is done with it; and a request on the fabric counts as
//! finished only once its answer is in, not when the device has taken the
//! requests after it. A context's rings go back to its arena only once
//! the device has let go of the port.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::DeviceProcess;
use pindown_driver::arena::{ArenaError, DmaBuffer};
use pindown_driver::verbs::opcode::{Nop, Read, Write};
use pindown_driver::verbs::{CompletionQueue, Context, ContextConfig, RegionWindow};
use pindown_uapi::{Access, Completion, ErrorDetail, RemoteAddress, RemoteKey};

const LEN: usize = 64 * 1024;

fn config() -> ContextConfig {
    ContextConfig {
        arena_bytes: 8 << 20,
        ..ContextConfig::default()
    }
}

/// A window of `owner` open to remote reads over `LEN` bytes of
/// `salt`-ed content, which it returns.
fn readable(owner: &Context, salt: u8) -> (RegionWindow<'_>, Vec<u8>) {
    let source = owner.alloc(LEN, 4096).unwrap();
    let pattern = common::salted_bytes(LEN, salt);
    source.write_at(0, &pattern);
    let region = owner.register_owned(source).unwrap();
    let window = owner
        .bind_region_window(region, 0, LEN as u64, Access::REMOTE_READ, None)
        .unwrap();
    (window, pattern)
}

/// The one completion `cq` has (or gets within `timeout`).
fn wait_one(cq: &mut CompletionQueue<'_>, timeout: Duration) -> Completion {
    let mut ready = cq.wait(timeout).expect("completion");
    assert_eq!(ready.len(), 1);
    ready.next().unwrap()
}

#[test]
fn a_buffer_dropped_under_a_posted_read_stays_allocated_until_the_read_finishes() {
    let device = DeviceProcess::start(common::device_bin(), 2, &[]).unwrap();
    let reader = Context::open(device.socket(0), config()).unwrap();
    let owner = Context::open(device.socket(1), config()).unwrap();
    let (window, pattern) = readable(&owner, 0x3c);

    let mut cq = reader.create_completion_queue();
    let mut qp = reader.create_queue_pair(&mut cq).unwrap();
    let sink = reader.alloc(LEN, 4096).unwrap();
    sink.fill(0);
    let sink_at = sink.iova();
    let region = reader.register_buffer(&sink).unwrap();
    let read = Read::new(region.local(0, LEN as u32).unwrap(), window.remote().at(0));
    qp.post(&[read.build().user_data(1).signaled()]).unwrap();
    // The program lets go of everything while the read may still run.
    drop(region);
    drop(sink);
    let other = reader.alloc(LEN, 4096).unwrap();
    assert_ne!(
        other.iova(),
        sink_at,
        "the chunk of a buffer a posted request names went to the next allocation"
    );
    let done = wait_one(&mut cq, Duration::from_secs(10));
    assert!(done.is_success(), "{done:?}");
    assert!(qp.all_finished().unwrap());
    // Dropping the queue pair lets go of what it kept for its finished
    // requests: the chunk comes back, holding what the read brought (an
    // allocation's content is whatever was there).
    drop(qp);
    let again = reader.alloc(LEN, 4096).unwrap();
    assert_eq!(again.iova(), sink_at, "the kept chunk was never freed");
    assert_eq!(common::buffer_contents(&again), pattern);
    drop(other);
}

#[test]
fn a_leaked_window_keeps_its_memory_and_writes_through_it_land_there_only() {
    let device = DeviceProcess::start(common::device_bin(), 2, &[]).unwrap();
    let writer = Context::open(device.socket(0), config()).unwrap();
    let owner = Context::open(device.socket(1), config()).unwrap();
    let exposed = owner.alloc(LEN, 4096).unwrap();
    exposed.fill(0);
    let exposed_at = exposed.iova();
    let region = owner.register_buffer(&exposed).unwrap();
    let window = owner
        .bind_window(&region, 0, LEN as u64, Access::REMOTE_WRITE)
        .unwrap();
    let remote = window.remote();
    std::mem::forget(window);
    drop(region);
    drop(exposed);
    // The next allocation of the same size gets other memory.
    let next = owner.alloc(LEN, 4096).unwrap();
    next.fill(0);
    assert_ne!(
        next.iova(),
        exposed_at,
        "a leaked window's memory was freed"
    );

    let source = writer.alloc(LEN, 4096).unwrap();
    source.write_at(0, &common::salted_bytes(LEN, 0x77));
    let source_region = writer.register_buffer(&source).unwrap();
    let mut cq = writer.create_completion_queue();
    let mut qp = writer.create_queue_pair(&mut cq).unwrap();
    let write = Write::new(source_region.local(0, LEN as u32).unwrap(), remote.at(0));
    qp.post(&[write.build().user_data(2).signaled()]).unwrap();
    let done = wait_one(&mut cq, Duration::from_secs(10));
    assert!(
        done.is_success(),
        "the leaked window still grants: {done:?}"
    );
    assert!(
        common::buffer_contents(&next).iter().all(|&b| b == 0),
        "a write through a leaked window reached memory allocated since"
    );
}

#[test]
fn a_read_on_the_fabric_is_unfinished_until_its_answer_comes_whatever_follows_it() {
    // Node 0 alone: node 1 is configured but never answers, so a read from
    // it stays on the fabric link until the peer timeout.
    let udp = [common::free_udp_port(), common::free_udp_port()];
    let device = common::fabric_device(0, &udp, "5eed0f0a11", 1, &["--peer-timeout", "1500ms"]);
    let context = Context::open(device.socket(0), config()).unwrap();
    let mut cq = context.create_completion_queue();
    let mut qp = context.create_queue_pair(&mut cq).unwrap();
    let sink = context.alloc(4096, 4096).unwrap();
    let sink_at = sink.iova();
    let region = context.register_buffer(&sink).unwrap();
    let away = RemoteAddress {
        node: 1,
        port: 0,
        key: RemoteKey(0x1234_5678),
        offset: 0,
    };
    let read = Read::new(region.local(0, 4096).unwrap(), away);
    qp.post(&[read.build().user_data(1).signaled()]).unwrap();
    drop(region);
    drop(sink);
    // A local request after it completes first: the device has taken the
    // read, and one after it, but has not finished the read.
    qp.post(&[Nop::new().build().user_data(2).signaled()])
        .unwrap();
    let nop = wait_one(&mut cq, Duration::from_secs(5));
    assert_eq!(nop.user_data, 2, "{nop:?}");
    assert!(
        !qp.all_finished().unwrap(),
        "a read still on the fabric counted as finished"
    );
    let other = context.alloc(4096, 4096).unwrap();
    assert_ne!(other.iova(), sink_at, "the read's memory was freed");
    let read = wait_one(&mut cq, Duration::from_secs(10));
    assert_eq!(read.user_data, 1);
    assert_eq!(read.detail, ErrorDetail::NodeUnreachable, "{read:?}");
    assert!(qp.all_finished().unwrap(), "retired with its completion");
    drop(qp);
    let again = context.alloc(4096, 4096).unwrap();
    assert_eq!(again.iova(), sink_at, "the kept chunk was never freed");
    drop(other);
}

#[test]
fn a_vec_a_region_took_comes_back_once_no_request_shares_it() {
    let device = DeviceProcess::start(common::device_bin(), 2, &[]).unwrap();
    let reader = Context::open(device.socket(0), config()).unwrap();
    let owner = Context::open(device.socket(1), config()).unwrap();
    let (window, pattern) = readable(&owner, 0x91);

    // A Vec of the program's, at an odd offset inside its allocation.
    let region = reader.register_memory(vec![0u8; LEN + 3]).unwrap();
    let mut cq = reader.create_completion_queue();
    let mut qp = reader.create_queue_pair(&mut cq).unwrap();
    let read = Read::new(region.local(3, LEN as u32).unwrap(), window.remote().at(0));
    qp.post(&[read.build().user_data(1).signaled()]).unwrap();
    // The posted read shares the Vec: the region cannot give it back.
    let region = region
        .into_memory::<Vec<u8>>()
        .expect_err("a posted request's memory was given back");
    let done = wait_one(&mut cq, Duration::from_secs(10));
    assert!(done.is_success(), "{done:?}");
    // Of another type: refused, the region unchanged.
    let region = region.into_memory::<Box<[u8]>>().expect_err("wrong type");
    qp.release_finished().unwrap();
    let bytes: Vec<u8> = region.into_memory().expect("no share left");
    assert_eq!(bytes.len(), LEN + 3);
    assert_eq!(&bytes[..3], &[0, 0, 0], "bytes outside the read changed");
    assert_eq!(&bytes[3..], &pattern[..]);
}

/// A context of `device`'s port 0 that has set up the rings of an I/O
/// queue pair as well as its admin pair's, and a buffer of its arena
/// that outlives it.
fn context_with_rings(device: &DeviceProcess, config: ContextConfig) -> (Context, DmaBuffer) {
    let context = Context::open(device.socket(0), config).unwrap();
    let mut cq = context.create_completion_queue();
    let mut qp = context.create_queue_pair(&mut cq).unwrap();
    qp.post(&[Nop::new().build().user_data(1).signaled()])
        .unwrap();
    assert!(wait_one(&mut cq, Duration::from_secs(10)).is_success());
    drop(qp);
    drop(cq);
    let kept = context.alloc(4096, 4096).unwrap();
    (context, kept)
}

#[test]
fn a_dropped_context_frees_its_rings_once_the_device_has_let_go_of_the_port() {
    let device = DeviceProcess::start(common::device_bin(), 1, &[]).unwrap();
    let (context, kept) = context_with_rings(&device, config());
    let arena = Arc::clone(kept.arena());
    drop(context);
    // Asked right away: the device reset the port before it closed the
    // connection, and the drop waited for that.
    let port = &device.status().unwrap()[0];
    assert_eq!(
        (port.n("connections"), port.n("connected")),
        (1, 0),
        "the port is reset when the drop returns"
    );
    assert!(!arena.is_sealed());
    assert_eq!(
        arena.free_bytes(),
        arena.size() - 4096,
        "everything but the kept buffer (the rings too) is back"
    );
    let again = arena.alloc(4096, 4096).expect("the arena still allocates");
    drop((again, kept));
    assert_eq!(arena.free_bytes(), arena.size());
}

#[test]
fn rings_of_a_device_that_never_confirms_the_end_stay_out_of_every_later_allocation() {
    let device = DeviceProcess::start(common::device_bin(), 1, &[]).unwrap();
    let timeout = Duration::from_millis(300);
    let (context, kept) = context_with_rings(
        &device,
        ContextConfig {
            control_timeout: timeout,
            ..config()
        },
    );
    let arena = Arc::clone(kept.arena());
    let later = context.alloc(4096, 4096).unwrap();
    let free = arena.free_bytes();
    // Stopped, the device can neither reset the port nor close its end;
    // woken, it would still write its records into the rings.
    assert!(
        device.stop(Duration::from_secs(5)),
        "the device did not stop"
    );
    drop(context);
    assert!(arena.is_sealed());
    assert_eq!(arena.free_bytes(), free, "the rings are kept");
    drop(later);
    assert_eq!(arena.free_bytes(), free, "a buffer freed now is kept too");
    let refused = arena.alloc(64, 64).unwrap_err();
    assert!(matches!(refused, ArenaError::Sealed), "{refused}");
    assert!(refused.to_string().contains("sealed"), "{refused}");

    // Woken, the device ends the connection and takes a new frontend.
    device.resume();
    assert!(device.wait_for(Duration::from_secs(10), |s| s[0].n("connected") == 0));
    let (context, _kept) = context_with_rings(&device, config());
    drop(context);
    drop(kept);
}

#[test]
fn a_fork_child_dropping_its_copy_of_a_context_leaves_the_parents_connection_alone() {
    let device = DeviceProcess::start(common::device_bin(), 1, &[]).unwrap();
    let (context, kept) = context_with_rings(&device, config());
    // Regions dropped stay cached, their IOTLB entries with them.
    let cached = context.alloc(LEN, 4096).unwrap();
    drop(context.register_buffer(&cached).unwrap());
    drop(context.register_memory(vec![7u8; LEN]).unwrap());
    let entries = device.status().unwrap()[0].n("iotlb_entries");
    assert!(entries > 0);

    // SAFETY: the child only drops its copy of the context and leaves
    // with _exit, running no code of the parent's other threads.
    let child = unsafe { libc::fork() };
    assert!(child >= 0, "fork: {}", std::io::Error::last_os_error());
    if child == 0 {
        drop(context);
        // SAFETY: ends the child at once, without the parent's atexit
        // handlers or the test harness.
        unsafe { libc::_exit(0) };
    }
    let mut status = 0;
    // SAFETY: waits for our own child, writing its status into ours.
    assert_eq!(unsafe { libc::waitpid(child, &mut status, 0) }, child);
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0);

    let port = &device.status().unwrap()[0];
    assert_eq!(
        (port.n("connected"), port.n("iotlb_entries")),
        (1, entries),
        "the child's drop changed the parent's connection"
    );
    // The parent's context works on: a request, and a new registration
    // answered by the device.
    let mut cq = context.create_completion_queue();
    let mut qp = context.create_queue_pair(&mut cq).unwrap();
    qp.post(&[Nop::new().build().user_data(2).signaled()])
        .unwrap();
    assert!(wait_one(&mut cq, Duration::from_secs(10)).is_success());
    drop(context.register_memory(vec![1u8; 3 * LEN]).unwrap());
    drop((qp, cq, cached, kept));
    drop(context);
    assert!(device.wait_for(Duration::from_secs(10), |s| s[0].n("connected") == 0));
}
