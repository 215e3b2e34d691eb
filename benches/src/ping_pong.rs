//! The latency baseline: a cache line bounced between two threads on two
//! cores. Every RDMA request crosses between the driver's core and the
//! device's core at least twice (the request there, the completion back),
//! so this round trip is the floor the figures are compared with.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crate::stats::Summary;
use pindown_uapi::core_sharing::{pin_to_cpu, pin_to_cpus};

/// A value alone on its cache line (so that only the bounced line moves).
#[repr(align(128))]
#[derive(Default)]
struct Line(AtomicU64);

/// Round-trip times of a cache line between two threads pinned to CPUs 0
/// and 1: the first stores `2i + 1`, the second answers with `2i + 2`; each
/// round trip is timed alone, with the same clock and in the same way as an
/// RDMA request, after `warmup` untimed ones. In microseconds.
pub fn round_trips(warmup: usize, samples: usize) -> Summary {
    let line = Arc::new(Line::default());
    let total = (warmup + samples) as u64;
    let echo = {
        let line = Arc::clone(&line);
        std::thread::spawn(move || {
            pin_to_cpu(1);
            for i in 0..total {
                let ping = 2 * i + 1;
                while line.0.load(Ordering::Acquire) != ping {
                    std::hint::spin_loop();
                }
                line.0.store(ping + 1, Ordering::Release);
            }
        })
    };
    let pinned = pin_to_cpu(0);
    let mut times = Vec::with_capacity(samples);
    for i in 0..total {
        let ping = 2 * i + 1;
        let start = Instant::now();
        line.0.store(ping, Ordering::Release);
        while line.0.load(Ordering::Acquire) != ping + 1 {
            std::hint::spin_loop();
        }
        let elapsed = start.elapsed();
        if i >= warmup as u64 {
            times.push(elapsed.as_secs_f64() * 1e6);
        }
    }
    echo.join().expect("the echo thread does not panic");
    if pinned {
        unpin();
    }
    Summary::of(&mut times)
}

/// The time of `count` round trips in a row (for benchmarks that time
/// batches: criterion's `iter_custom`), between threads pinned as in
/// [`round_trips`], after one untimed round trip that makes sure both
/// threads run.
pub fn time_round_trips(count: u64) -> std::time::Duration {
    if count == 0 {
        return std::time::Duration::ZERO;
    }
    let line = Arc::new(Line::default());
    let echo = {
        let line = Arc::clone(&line);
        std::thread::spawn(move || {
            pin_to_cpu(1);
            for i in 0..=count {
                let ping = 2 * i + 1;
                while line.0.load(Ordering::Acquire) != ping {
                    std::hint::spin_loop();
                }
                line.0.store(ping + 1, Ordering::Release);
            }
        })
    };
    let pinned = pin_to_cpu(0);
    let mut start = Instant::now();
    for i in 0..=count {
        if i == 1 {
            start = Instant::now();
        }
        let ping = 2 * i + 1;
        line.0.store(ping, Ordering::Release);
        while line.0.load(Ordering::Acquire) != ping + 1 {
            std::hint::spin_loop();
        }
    }
    let elapsed = start.elapsed();
    echo.join().expect("the echo thread does not panic");
    if pinned {
        unpin();
    }
    elapsed
}

/// Lets the calling thread run on every CPU again.
fn unpin() {
    pin_to_cpus(0..libc::CPU_SETSIZE as usize);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_are_counted_and_ordered() {
        let summary = round_trips(10, 200);
        assert_eq!(summary.samples, 200);
        assert!(summary.min > 0.0);
        assert!(summary.min <= summary.median && summary.median <= summary.max);
        assert!(time_round_trips(1000) > std::time::Duration::ZERO);
    }
}
