//! Criterion benchmarks of the RDMA path: the driver posts writes on port 0
//! of the emulated NIC into a window of port 1 (both ports opened by this
//! process), and the device copies the bytes from one DMA arena to the other.
//!
//! * `write_event/{8,1MiB,16MiB}`: event-driven mode (the device sleeps on
//!   doorbells after a short spin, the driver on its completion eventfd).
//! * `write_poll/{8,1MiB,16MiB}`: busy-poll mode (device `--poll`, driver
//!   `ContextConfig::spin = Duration::MAX`).
//! * `write_inline_{event,poll}/8` and `fetch_add_{event,poll}/8`: an
//!   8-byte write carried in the send queue, and an 8-byte fetch-add.
//! * `memcpy/{8,1MiB,16MiB}`: one thread's `memcpy` of the same sizes,
//!   timed in the same run while no device runs.
//! * `ping_pong/cache_line`: a cache line bounced between two threads on
//!   the two cores, the floor of a request's round trip, timed in the same
//!   run while no device runs.
//!
//! The 8-byte requests are timed from post to completion seen, one at a
//! time; 1 MiB and 16 MiB writes stream with [`IN_FLIGHT`] in flight, and
//! the writes report their throughput in bytes. The local memory is
//! registered once, outside the timed part. `cargo run --release -p
//! pindown-benches --bin latency` prints the same figures for more sizes
//! and operations as JSON, each beside its own ping-pong.
//!
//! The device is this executable again: started with
//! [`DEVICE_ENV`](pindown_benches::rdma::DEVICE_ENV) set, it runs
//! `pindown_emu_device::cli::main` instead of the benchmarks, so no separately built
//! `emu-device` binary is needed.
//!
//! Targets (measured, not asserted; [`targets`](pindown_benches::rdma::targets)): `write_*/1MiB` and
//! `write_*/16MiB` at least 0.9 of `memcpy` throughput; `write_poll/8`,
//! `write_inline_poll/8` and `fetch_add_poll/8` medians at most 1.0 us,
//! the event-driven ones at most 1.3 us.

use std::hint::black_box;
use std::time::Instant;

use criterion::{BenchmarkId, Criterion, Throughput};
use pindown_benches::ping_pong;
use pindown_benches::rdma::{
    fill_pattern, run_device_if_asked, run_many, run_one, Mode, RdmaError, IN_FLIGHT,
};
use pindown_benches::replay::Memcpy;
use pindown_driver::verbs::opcode::{FetchAdd, Write};
use pindown_driver::verbs::{Context, Entry, MemoryRegion};
use pindown_emu_device::testing::DeviceProcess;
use pindown_uapi::{Access, RemoteAddress};

/// Transfer sizes and their benchmark names.
const SIZES: [(usize, &str); 3] = [(8, "8"), (1 << 20, "1MiB"), (16 << 20, "16MiB")];
/// Each port's DMA arena: a 16 MiB buffer plus the rings.
const ARENA_BYTES: usize = 24 << 20;
/// Bytes of the source and of the window.
const BUFFER_BYTES: usize = 16 << 20;

fn bench_ping_pong(c: &mut Criterion) {
    let mut group = c.benchmark_group("ping_pong");
    group.bench_function("cache_line", |b| b.iter_custom(ping_pong::time_round_trips));
    group.finish();
}

fn bench_memcpy(c: &mut Criterion) {
    let mut group = c.benchmark_group("memcpy");
    for (bytes, name) in SIZES {
        let mut memcpy = Memcpy::new(bytes).expect("memcpy buffers");
        group.throughput(Throughput::Bytes(bytes as u64));
        if bytes >= 1 << 20 {
            group.sample_size(30);
        }
        group.bench_function(BenchmarkId::from_parameter(name), |b| {
            b.iter(|| memcpy.copy())
        });
    }
    group.finish();
}

/// A device of its own in `mode`, port 0 writing into a window of port 1.
fn bench_writes(c: &mut Criterion, mode: Mode) {
    let exe = std::env::current_exe().expect("current executable");
    let device = DeviceProcess::start(&exe, 2, mode.device_args()).expect("device");
    let initiator =
        Context::open(device.socket(0), mode.context_config(ARENA_BYTES)).expect("port 0");
    let owner = Context::open(device.socket(1), mode.context_config(ARENA_BYTES)).expect("port 1");
    let target = owner.alloc(BUFFER_BYTES, 4096).expect("target buffer");
    target.fill(0);
    let target_region = owner.register_buffer(&target).expect("register target");
    let bound = owner
        .bind_window(
            &target_region,
            0,
            BUFFER_BYTES as u64,
            Access::REMOTE_WRITE | Access::REMOTE_ATOMIC,
        )
        .expect("window");
    let window = bound.remote();
    let mut cq = initiator.create_completion_queue();
    let mut qp = initiator.create_queue_pair(&mut cq).expect("queue pair");
    let source = initiator.alloc(BUFFER_BYTES, 4096).expect("source buffer");
    let mut bytes = vec![0u8; BUFFER_BYTES];
    fill_pattern(7, 0, &mut bytes);
    source.write_at(0, &bytes);
    let source_region = initiator.register_buffer(&source).expect("register source");

    // The bytes must arrive, or the figures mean nothing.
    let whole = Write::new(
        source_region.local(0, BUFFER_BYTES as u32).expect("local"),
        window.at(0),
    )
    .build();
    run_one(&mut qp, &mut cq, whole).expect("16 MiB write");
    let mut landed = vec![0u8; BUFFER_BYTES];
    target.read_at(0, &mut landed);
    assert!(landed == bytes, "the 16 MiB write did not arrive intact");

    let mut group = c.benchmark_group(format!("write_{mode}"));
    for (bytes, name) in SIZES {
        let to = window.at(0);
        group.throughput(Throughput::Bytes(bytes as u64));
        if bytes >= 1 << 20 {
            group.sample_size(30);
        }
        group.bench_function(BenchmarkId::from_parameter(name), |b| {
            if bytes <= 8 {
                b.iter(|| {
                    let entry = write_from(&source_region, bytes, to).expect("local");
                    black_box(run_one(&mut qp, &mut cq, entry).expect("write"))
                });
            } else {
                b.iter_custom(|iters| {
                    let start = Instant::now();
                    let region = |_| Ok(&source_region);
                    run_many(&mut qp, &mut cq, iters, IN_FLIGHT, region, |region| {
                        write_from(region, bytes, to)
                    })
                    .expect("writes");
                    start.elapsed()
                });
            }
        });
    }
    group.finish();

    let to = window.at(0);
    let mut group = c.benchmark_group(format!("write_inline_{mode}"));
    group.bench_function(BenchmarkId::from_parameter(8), |b| {
        b.iter(|| {
            let entry = write_from(&source_region, 8, to).expect("local").inline();
            black_box(run_one(&mut qp, &mut cq, entry).expect("inline write"))
        })
    });
    group.finish();
    let add = FetchAdd::new(window.at(BUFFER_BYTES as u64 - 8), 1).build();
    let mut group = c.benchmark_group(format!("fetch_add_{mode}"));
    group.bench_function(BenchmarkId::from_parameter(8), |b| {
        b.iter(|| black_box(run_one(&mut qp, &mut cq, add).expect("fetch-add")))
    });
    group.finish();
}

/// A write of the first `bytes` of `region` to `to`.
fn write_from<'r>(
    region: &'r MemoryRegion<'_>,
    bytes: usize,
    to: RemoteAddress,
) -> Result<Entry<'r>, RdmaError> {
    Ok(Write::new(region.local(0, bytes as u32)?, to).build())
}

fn main() {
    // In the device's process this runs the device and never returns.
    run_device_if_asked();
    let mut c = Criterion::default().configure_from_args();
    bench_ping_pong(&mut c);
    bench_memcpy(&mut c);
    for mode in Mode::ALL {
        bench_writes(&mut c, mode);
    }
    c.final_summary();
}
