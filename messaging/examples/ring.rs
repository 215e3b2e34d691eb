//! The message-passing quick start: every rank sends a message to the next
//! rank around a ring (zero copy, straight from its own heap buffer into
//! the receiver's), checks every byte of the one it receives from the
//! previous rank, and then all ranks add up their rank numbers with an
//! allreduce.
//!
//! Started by any launcher the driver knows (`mpiexec.hydra -n 4`,
//! `mpirun.openmpi -n 4`, ...) with `PINDOWN_DEVICE_DIR` (or
//! `PINDOWN_DEVICE`) naming the device ports; `tools/two-hosts.sh` runs it
//! on two network-namespace hosts joined by the fabric. Each rank prints
//! one line; the exit status is 0 only if every check passed.
//!
//! ```sh
//! tools/two-hosts.sh -n 4 target/release/examples/ring [BYTES]
//! ```

use std::process::ExitCode;
use std::time::{Duration, Instant};

use pindown_driver::launch::{device_socket, Job};
use pindown_driver::verbs::Context;
use pindown_messaging::{Config, Messenger, Op};

/// Byte `i` of the message rank `from` sends.
fn byte(from: u32, i: usize) -> u8 {
    (i as u32)
        .wrapping_mul(31)
        .wrapping_add(from.wrapping_mul(97)) as u8
}

fn main() -> ExitCode {
    let bytes: usize = match std::env::args().nth(1).map(|a| a.parse()) {
        None => 1 << 20,
        Some(Ok(n)) => n,
        Some(Err(e)) => {
            eprintln!("usage: ring [BYTES] ({e})");
            return ExitCode::from(64);
        }
    };
    match run(bytes) {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            println!("ring: FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(bytes: usize) -> Result<String, Box<dyn std::error::Error>> {
    let mut job = Job::from_environment()?;
    let context = Context::open(device_socket(&job)?, pindown_messaging::context_config())?;
    let node = context.info().node;
    let messenger = Messenger::new(&context, &mut job, Config::default())?;
    let world = messenger.world();
    let (rank, size) = (world.rank(), world.size());
    let (next, previous) = ((rank + 1) % size, (rank + size - 1) % size);

    // Post the receive first, then send: both are in flight at once.
    let message: Vec<u8> = (0..bytes).map(|i| byte(rank, i)).collect();
    let started = Instant::now();
    let receive = world.irecv(previous, 0, vec![0u8; bytes])?;
    let send = world.isend(next, 0, message)?;
    let (received, status) = receive.wait()?;
    send.wait()?;
    let elapsed = started.elapsed();
    if status.len != bytes as u64 {
        return Err(format!("rank {rank}: {} bytes arrived, not {bytes}", status.len).into());
    }
    if let Some(i) = (0..bytes).find(|&i| received[i] != byte(previous, i)) {
        return Err(format!("rank {rank}: byte {i} from rank {previous} is wrong").into());
    }

    let mut sum = [0u64];
    world.allreduce(&[u64::from(rank)], &mut sum, Op::Sum)?;
    let expected = u64::from(size) * u64::from(size - 1) / 2;
    if sum[0] != expected {
        return Err(format!("rank {rank}: allreduce gave {}, not {expected}", sum[0]).into());
    }
    world.barrier()?;
    drop(world);
    messenger.finalize(Duration::from_secs(30))?;
    Ok(format!(
        "rank {rank} of {size} (device node {node}): {bytes} bytes from rank {previous} verified \
         in {:.1} us; allreduce of the ranks = {} (expected {expected})",
        elapsed.as_secs_f64() * 1e6,
        sum[0]
    ))
}
