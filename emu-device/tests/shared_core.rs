//! A driver waiting for its completions on the core its device's port
//! thread runs on: the wait keeps the shared-core rule (it yields to the
//! port that must execute the request just posted, rather than wait for
//! the scheduler's tick to take the core away), and every write lands.

mod common;

use std::time::{Duration, Instant};

use common::DeviceProcess;
use pindown_driver::verbs::opcode::Write;
use pindown_driver::verbs::{Context, ContextConfig};
use pindown_uapi::core_sharing::{self, allowed_cpus, pin_to_cpu};
use pindown_uapi::Access;

const T: Duration = Duration::from_secs(10);

#[test]
fn a_driver_waiting_on_its_ports_core_yields_it_to_the_port_and_every_write_lands() {
    // The device inherits the test thread's CPU: everything on one.
    let cpu = *allowed_cpus().first().expect("an allowed CPU");
    assert!(pin_to_cpu(cpu), "pinning the test thread to CPU {cpu}");
    let device = DeviceProcess::start(common::device_bin(), 1, &[]).unwrap();
    let config = ContextConfig {
        arena_bytes: 1 << 20,
        // The wait never sleeps: only yields can let the port run before
        // the scheduler's time slice ends.
        spin: T,
        ..ContextConfig::default()
    };
    let context = Context::open(device.socket(0), config).unwrap();
    let source = context.alloc(4096, 4096).unwrap();
    let target = context.alloc(4096, 4096).unwrap();
    target.fill(0);
    let source_region = context.register_buffer(&source).unwrap();
    let target_region = context.register_buffer(&target).unwrap();
    let window = context
        .bind_window(&target_region, 0, 4096, Access::REMOTE_WRITE)
        .unwrap();
    let remote = window.remote();
    let mut cq = context.create_completion_queue();
    let mut qp = context.create_queue_pair(&mut cq).unwrap();

    const WRITES: u64 = 2000;
    let began = Instant::now();
    let ran_others_before = core_sharing::this_thread(|sharing| sharing.yields_that_ran_others());
    let mut waits_seeing_it_shared = 0;
    for i in 0..WRITES {
        let value = (i + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        source.write_at(0, &value.to_le_bytes());
        let entry = Write::new(source_region.local(0, 8).unwrap(), remote.at(8 * (i % 512)))
            .build()
            .user_data(i)
            .signaled();
        qp.post(&[entry]).unwrap();
        let done: Vec<_> = cq
            .wait(T)
            .unwrap_or_else(|e| panic!("write {i} after {:?}: {e}", began.elapsed()))
            .collect();
        assert_eq!(done.len(), 1, "write {i}: {done:?}");
        assert_eq!(done[0].user_data, i);
        done[0].result().unwrap();
        if core_sharing::this_thread(|sharing| sharing.shared(Instant::now())) {
            waits_seeing_it_shared += 1;
        }
        let mut landed = [0u8; 8];
        target.read_at(8 * (i % 512) as usize, &mut landed);
        assert_eq!(u64::from_le_bytes(landed), value, "write {i}");
    }
    // Each write needs the port to run on the waiter's CPU: a wait that
    // keeps the rule gives it the core by a yield nearly every time; one
    // that spins leaves it to the tick, and yields only to probe, while
    // it has not seen the core shared.
    let ran_others =
        core_sharing::this_thread(|sharing| sharing.yields_that_ran_others()) - ran_others_before;
    assert!(
        ran_others >= WRITES / 4 && waits_seeing_it_shared >= WRITES / 2,
        "{WRITES} writes in {:?}, each waited for by polling on the port \
         thread's CPU: {ran_others} yields ran another thread, and \
         {waits_seeing_it_shared} waits ended with the core seen shared",
        began.elapsed()
    );
}
