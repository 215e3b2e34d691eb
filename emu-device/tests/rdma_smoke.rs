//! One process, two ports: the whole stack from verbs to the device and back.

mod common;

use std::time::Duration;

use common::DeviceProcess;
use pindown_driver::verbs::opcode::{FetchAdd, Read, Write};
use pindown_driver::verbs::{CompletionQueue, Context, ContextConfig};
use pindown_uapi::{Access, Completion, Status};

/// The one completion `cq` has (or gets within `timeout`).
fn wait_one(cq: &mut CompletionQueue<'_>, timeout: Duration) -> Completion {
    let mut ready = cq.wait(timeout).expect("completion");
    assert_eq!(ready.len(), 1);
    ready.next().unwrap()
}

#[test]
fn write_read_and_add_between_two_ports_of_one_process() {
    let device = DeviceProcess::start(common::device_bin(), 2, &[]).unwrap();
    let config = ContextConfig {
        arena_bytes: 8 << 20,
        ..ContextConfig::default()
    };
    let a = Context::open(device.socket(0), config.clone()).expect("port 0");
    let b = Context::open(device.socket(1), config).expect("port 1");
    assert_ne!(a.info().port, b.info().port);

    let target = b.alloc(64 * 1024, 64).unwrap();
    let target_region = b.register_buffer(&target).unwrap();
    let window = b
        .bind_window(
            &target_region,
            0,
            64 * 1024,
            Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC,
        )
        .unwrap();

    let source = a.alloc(10_000, 64).unwrap();
    let pattern: Vec<u8> = (0..10_000u32).map(|i| (i * 13 + 1) as u8).collect();
    source.write_at(0, &pattern);
    let source_region = a.register_buffer(&source).unwrap();
    let mut cq = a.create_completion_queue();
    let mut qp = a.create_queue_pair(&mut cq).unwrap();
    let write = Write::new(
        source_region.local(3, 9_000).unwrap(),
        window.remote().at(101),
    )
    .build()
    .user_data(1)
    .signaled();
    qp.post(&[write]).unwrap();
    let done = wait_one(&mut cq, Duration::from_secs(5));
    assert_eq!(
        (done.status, done.user_data, done.byte_len),
        (Status::Success, 1, 9_000),
        "{done:?}"
    );
    let mut landed = vec![0u8; 9_000];
    target.read_at(101, &mut landed);
    assert_eq!(landed, pattern[3..9_003]);

    let back = a.alloc(9_000, 64).unwrap();
    let back_region = a.register_buffer(&back).unwrap();
    qp.post(&[Read::new(
        back_region.local(0, 9_000).unwrap(),
        window.remote().at(101),
    )
    .build()
    .user_data(2)
    .signaled()])
        .unwrap();
    assert!(wait_one(&mut cq, Duration::from_secs(5)).is_success());
    let mut read_back = vec![0u8; 9_000];
    back.read_at(0, &mut read_back);
    assert_eq!(read_back, pattern[3..9_003]);

    for expected in 0..10u64 {
        qp.post(&[FetchAdd::new(window.remote().at(16_384), 3)
            .build()
            .user_data(10 + expected)
            .signaled()])
            .unwrap();
        let done = wait_one(&mut cq, Duration::from_secs(5));
        assert_eq!(done.value, expected * 3);
    }
}

#[test]
fn a_full_completion_queue_holds_the_device_back_and_loses_nothing() {
    use pindown_driver::verbs::opcode::Nop;
    use pindown_driver::verbs::VerbsError;
    let device = DeviceProcess::start(common::device_bin(), 1, &[]).unwrap();
    let config = ContextConfig {
        arena_bytes: 4 << 20,
        queue_size: 16,
        ..ContextConfig::default()
    };
    let context = Context::open(device.socket(0), config).unwrap();
    let mut cq = context.create_completion_queue();
    let mut qp = context.create_queue_pair(&mut cq).unwrap();
    let total = 500u64;
    let (mut posted, mut seen) = (0u64, Vec::new());
    while (seen.len() as u64) < total {
        // Post until the rings are full, without reaping completions.
        while posted < total {
            match qp.post(&[Nop::new().build().user_data(posted).signaled()]) {
                Ok(()) => posted += 1,
                Err(VerbsError::QueueFull { .. }) => break,
                Err(other) => panic!("{other}"),
            }
        }
        let ready = cq
            .wait(Duration::from_secs(5))
            .expect("completions keep coming");
        seen.extend(ready.map(|c| c.user_data));
    }
    assert_eq!(
        seen,
        (0..total).collect::<Vec<_>>(),
        "every completion, in order"
    );
}
