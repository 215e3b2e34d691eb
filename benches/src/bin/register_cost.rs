//! `register-cost`: what registering any user memory costs, for the two
//! mechanisms that make it reachable by the device, next to the DMA arena
//! and to raw baselines, all in one run. Prints one JSON document.
//!
//! * **Arena**: memory the device maps already. A miss is `mlock` plus one
//!   IOTLB update (a round trip to the device); a hit is a pin-down cache
//!   lookup.
//! * **Rehoming** (what the driver does): the first registration of private
//!   memory copies its pages into the pool and maps the pool over them
//!   (`first_us`), then `mlock` plus the IOTLB update; a later miss of
//!   memory already moved (after an eviction) is `mlock` plus the update
//!   (`miss_us`); a hit is a lookup. Data then moves with one copy by the
//!   device, as for the arena.
//! * **Cross-memory attach** (CMA, the alternative): the device would copy
//!   with `process_vm_writev`/`process_vm_readv` into and out of the owner's
//!   own pages. Its miss is measured raw as `mlock` of the range plus one
//!   IOTLB update of the same length (the translation entry naming the
//!   owner's pages); its hit would be the same lookup. Its bandwidth is
//!   measured raw too: one `process_vm_writev` per transfer into a child
//!   process when the other side is device-mapped memory, and, when both
//!   sides are process memory, two copies through a 256 KiB bounce buffer
//!   (`process_vm_readv` from one, `process_vm_writev` into the other).
//!
//! Baselines from the same run: raw `mlock` of the range (the floor of
//! every miss), and one thread's `memcpy` of each transfer size (the
//! bandwidths are also given as ratios to it). RDMA bandwidths are writes
//! from port 0 into a window of port 1 of the device (this executable run
//! with `--device`), 4 in flight, arena to arena and heap to heap; the
//! last transfer of each is checked byte for byte.

use std::error::Error;
use std::hint::black_box;
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use clap::Parser;
use pindown_driver::transport::{IotlbAccess, Transport};
use pindown_driver::verbs::opcode::Write;
use pindown_driver::verbs::{Context, ContextConfig, MemoryWindow};
use pindown_pincache::CacheConfig;
use pindown_uapi::Access;
use serde::Serialize;

use pindown_benches::child::{DeviceChild, LineChild};
use pindown_benches::output::OutputArgs;
use pindown_benches::rdma::{gb_per_s, pattern, run_device, run_many, IN_FLIGHT};
use pindown_benches::stats::median;
use pindown_benches::sys::{mlock, munlock, LockBudget, Machine, Mapping};

/// Command line. `--device` (first) runs the NIC; `--cma-target BYTES`
/// (first) runs the other process of the CMA copies.
#[derive(Parser, Debug)]
#[command(
    name = "register-cost",
    version,
    about = "Registration miss and hit cost and bandwidth of arena memory, rehomed heap \
             memory and cross-memory attach, with raw mlock and memcpy baselines (JSON on stdout)"
)]
struct Args {
    /// Fewer repetitions (a few seconds in all).
    #[arg(long)]
    quick: bool,
    #[command(flatten)]
    output: OutputArgs,
}

/// Registration sizes.
const REGISTER_SIZES: [usize; 4] = [4 << 10, 64 << 10, 1 << 20, 16 << 20];
/// Transfer sizes of the bandwidths.
const TRANSFER_SIZES: [usize; 4] = [4 << 10, 64 << 10, 1 << 20, 16 << 20];
/// The bounce buffer of CMA between two processes' memories.
const BOUNCE_BYTES: usize = 256 << 10;
/// Every buffer: the largest transfer.
const BUFFER_BYTES: usize = 16 << 20;

/// Medians of one registration size; microseconds unless named `_ns`.
#[derive(Debug, Serialize)]
struct Registration {
    bytes: usize,
    reps: usize,
    /// `mlock` of the range: the floor of a miss.
    raw_mlock_us: f64,
    arena: Costs,
    rehome: RehomeCosts,
    cma: Costs,
}

#[derive(Debug, Serialize)]
struct Costs {
    miss_us: f64,
    hit_ns: f64,
}

#[derive(Debug, Serialize)]
struct RehomeCosts {
    /// First registration: move into the pool, then `mlock` and the IOTLB
    /// update.
    first_us: f64,
    /// Registration of memory moved already (after an eviction).
    miss_us: f64,
    hit_ns: f64,
    /// What the move itself adds: `first_us - miss_us`.
    move_us: f64,
}

/// GB/s of one transfer size, and as ratios of `memcpy`.
#[derive(Debug, Serialize)]
struct Bandwidth {
    bytes: usize,
    memcpy_gbps: f64,
    arena_gbps: f64,
    heap_gbps: f64,
    cma_one_copy_gbps: f64,
    cma_two_copies_gbps: f64,
    arena_ratio: f64,
    heap_ratio: f64,
    cma_one_copy_ratio: f64,
    cma_two_copies_ratio: f64,
}

#[derive(Debug, Serialize)]
struct Report {
    machine: Machine,
    registration: Vec<Registration>,
    bandwidth: Vec<Bandwidth>,
    /// Every RDMA and CMA transfer checked arrived intact.
    verified: bool,
}

fn us(start: Instant) -> f64 {
    start.elapsed().as_secs_f64() * 1e6
}

fn config() -> ContextConfig {
    ContextConfig {
        arena_bytes: 2 * BUFFER_BYTES + (8 << 20),
        cache: CacheConfig {
            max_pinned_bytes: Some(1 << 30),
            ..CacheConfig::default()
        },
        ..ContextConfig::default()
    }
}

/// Times `hits` registrations of a cached range; nanoseconds per hit.
fn hit_ns(context: &Context, addr: u64, len: u64, hits: usize) -> Result<f64, Box<dyn Error>> {
    // SAFETY (each registration here): no request or window names the
    // region, dropped at once, so the device never touches the memory.
    drop(unsafe { context.register(addr, len)? });
    let start = Instant::now();
    for _ in 0..hits {
        // SAFETY: as above.
        black_box(unsafe { context.register(addr, len)? });
    }
    Ok(start.elapsed().as_secs_f64() * 1e9 / hits as f64)
}

fn registration(
    context: &Context,
    bytes: usize,
    reps: usize,
) -> Result<Registration, Box<dyn Error>> {
    let arena = context.alloc(bytes, 4096)?;
    let (arena_addr, len) = (arena.iova(), bytes as u64);
    let hits = (4 << 20) / bytes.max(4096) * 50 + 1000;
    let mut raw = Vec::new();
    let mut arena_miss = Vec::new();
    let mut cma_miss = Vec::new();
    let mut first = Vec::new();
    let mut again = Vec::new();
    let mut rehome_hit = 0.0;
    for rep in 0..reps {
        // Raw mlock of fresh private memory.
        let fresh = Mapping::new(bytes)?;
        let start = Instant::now();
        mlock(fresh.addr(), bytes)?;
        raw.push(us(start));
        munlock(fresh.addr(), bytes)?;
        // CMA's miss: mlock plus one IOTLB update of the same length.
        let start = Instant::now();
        mlock(fresh.addr(), bytes)?;
        context
            .transport()
            .iotlb_map(arena_addr, len, arena_addr, IotlbAccess::ReadWrite)?;
        cma_miss.push(us(start));
        context.transport().iotlb_unmap(arena_addr, len)?;
        munlock(fresh.addr(), bytes)?;
        drop(fresh);
        // Arena miss.
        context.invalidate(arena_addr, len);
        let start = Instant::now();
        // SAFETY (the three registrations below): no request or window
        // names the region, dropped at once, so the device never touches
        // the memory.
        let region = unsafe { context.register(arena_addr, len)? };
        arena_miss.push(us(start));
        drop(region);
        context.invalidate(arena_addr, len);
        // Rehoming: first registration of fresh private memory, then a
        // miss of the same memory after an eviction.
        let fresh = Mapping::new(bytes)?;
        let (addr, _) = fresh.into_raw();
        let start = Instant::now();
        let region = unsafe { context.register(addr as u64, len)? };
        first.push(us(start));
        drop(region);
        context.invalidate(addr as u64, len);
        let start = Instant::now();
        let region = unsafe { context.register(addr as u64, len)? };
        again.push(us(start));
        drop(region);
        if rep == 0 {
            rehome_hit = hit_ns(context, addr as u64, len, hits)?;
        }
        // Through the hook: the cache forgets it, the pool takes the
        // space back at the next move.
        // SAFETY: the mapping made above, no longer used.
        unsafe { pindown_pincache::unmap(addr as *mut u8, bytes) }?;
    }
    let arena_hit = hit_ns(context, arena_addr, len, hits)?;
    context.invalidate(arena_addr, len);
    let (first_us, miss_us) = (median(&mut first), median(&mut again));
    Ok(Registration {
        bytes,
        reps,
        raw_mlock_us: median(&mut raw),
        arena: Costs {
            miss_us: median(&mut arena_miss),
            hit_ns: arena_hit,
        },
        rehome: RehomeCosts {
            first_us,
            miss_us,
            hit_ns: rehome_hit,
            move_us: first_us - miss_us,
        },
        cma: Costs {
            miss_us: median(&mut cma_miss),
            // The same cache lookup would serve CMA's hits.
            hit_ns: arena_hit,
        },
    })
}

/// `count` writes of `bytes` from `source` into `window`, IN_FLIGHT at a
/// time; GB/s.
///
/// # Safety
///
/// `source` is the first of BUFFER_BYTES bytes that stay allocated until
/// this returns.
unsafe fn rdma_gbps(
    context: &Context,
    source: u64,
    window: &MemoryWindow<'_>,
    bytes: usize,
    count: u64,
) -> Result<f64, Box<dyn Error>> {
    let mut cq = context.create_completion_queue();
    let mut qp = context.create_queue_pair(&mut cq)?;
    let start = Instant::now();
    run_many(
        &mut qp,
        &mut cq,
        count,
        IN_FLIGHT,
        |i| {
            let offset = ((i as usize * bytes) % (BUFFER_BYTES - bytes + 1)) as u64;
            // SAFETY: inside the caller's buffer (the offset keeps the
            // range in BUFFER_BYTES), allocated until `run_many` has seen
            // every write complete (this function's contract).
            Ok((offset, unsafe {
                context.register(source + offset, bytes as u64)?
            }))
        },
        |(offset, region)| {
            Ok(Write::new(region.local(0, bytes as u32)?, window.remote().at(*offset)).build())
        },
    )?;
    Ok(gb_per_s(
        (bytes as u64 * count) as f64,
        start.elapsed().as_secs_f64(),
    ))
}

/// The other process of the CMA copies: maps `BUFFER_BYTES` twice, prints
/// its pid and their addresses, waits for its stdin to close.
fn cma_target() -> ExitCode {
    let a = Mapping::new(BUFFER_BYTES).expect("map");
    let b = Mapping::new(BUFFER_BYTES).expect("map");
    println!("{} {:x} {:x}", std::process::id(), a.addr(), b.addr());
    let mut line = String::new();
    while std::io::stdin().read_line(&mut line).is_ok_and(|n| n > 0) {
        line.clear();
    }
    ExitCode::SUCCESS
}

/// One `process_vm_writev` or `process_vm_readv` of `len` bytes between
/// `local` here and `remote` in `pid`.
fn cma_copy(pid: i32, local: usize, remote: usize, len: usize, write: bool) -> std::io::Result<()> {
    let local = libc::iovec {
        iov_base: local as *mut libc::c_void,
        iov_len: len,
    };
    let remote = libc::iovec {
        iov_base: remote as *mut libc::c_void,
        iov_len: len,
    };
    // SAFETY: one local iovec inside a live mapping of ours; the kernel
    // checks the remote one against the other process's mappings.
    let moved = unsafe {
        if write {
            libc::process_vm_writev(pid, &local, 1, &remote, 1, 0)
        } else {
            libc::process_vm_readv(pid, &local, 1, &remote, 1, 0)
        }
    };
    if moved != len as isize {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn measure(args: &Args, device: &DeviceChild) -> Result<Report, Box<dyn Error>> {
    let memlock = LockBudget::probe(1 << 30);
    let machine = Machine::collect(memlock);
    let initiator = Context::open(device.socket(0), config())?;
    let owner = Context::open(device.socket(1), config())?;
    let reps = |bytes: usize| match (args.quick, bytes) {
        (true, b) if b >= 16 << 20 => 3,
        (true, _) => 20,
        (false, b) if b >= 16 << 20 => 15,
        (false, b) if b >= 1 << 20 => 60,
        (false, _) => 300,
    };
    let mut registrations = Vec::new();
    for bytes in REGISTER_SIZES {
        registrations.push(registration(&initiator, bytes, reps(bytes))?);
    }

    // Bandwidth: the sources hold a pattern, the targets are windows.
    let data = pattern(0xc0ffee, 0, BUFFER_BYTES);
    let arena_source = initiator.alloc(BUFFER_BYTES, 4096)?;
    arena_source.write_at(0, &data);
    let arena_target = owner.alloc(BUFFER_BYTES, 4096)?;
    let heap_source = data.clone();
    let mut heap_target = vec![0u8; BUFFER_BYTES];
    let all = Access::REMOTE_READ | Access::REMOTE_WRITE;
    let _arena_source_region = initiator.register_buffer(&arena_source)?;
    let arena_target_region = owner.register_buffer(&arena_target)?;
    let arena_window = owner.bind_window(&arena_target_region, 0, BUFFER_BYTES as u64, all)?;
    // SAFETY (both): the heap buffers are declared before the regions and
    // the window, so they are freed after them; the target is read only
    // once every write has completed.
    let _heap_source_region =
        unsafe { initiator.register(heap_source.as_ptr() as u64, BUFFER_BYTES as u64)? };
    let heap_target_region =
        unsafe { owner.register(heap_target.as_ptr() as u64, BUFFER_BYTES as u64)? };
    let heap_window = owner.bind_window(&heap_target_region, 0, BUFFER_BYTES as u64, all)?;

    let exe = std::env::current_exe()?;
    let mut command = Command::new(exe);
    command.arg("--cma-target");
    let mut target = LineChild::spawn("cma-target", command)?;
    let line = target.next(Duration::from_secs(10))?;
    let words: Vec<&str> = line.split_whitespace().collect();
    let [pid, remote_a, remote_b] = words[..] else {
        return Err(format!("cma-target said {line:?}").into());
    };
    let pid: i32 = pid.parse()?;
    let remote_a = usize::from_str_radix(remote_a, 16)?;
    let remote_b = usize::from_str_radix(remote_b, 16)?;
    let bounce = Mapping::new(BOUNCE_BYTES)?;
    let memcpy_target = Mapping::new(BUFFER_BYTES)?;

    let mut verified = true;
    let mut bandwidth = Vec::new();
    for bytes in TRANSFER_SIZES {
        let total: u64 = if args.quick { 64 << 20 } else { 512 << 20 };
        let count = (total / bytes as u64).max(4);
        let rounds = if args.quick { 1 } else { 3 };
        let mut samples: [Vec<f64>; 5] = Default::default();
        for _ in 0..rounds {
            // memcpy, one thread.
            let start = Instant::now();
            for i in 0..count {
                let offset = (i as usize * bytes) % (BUFFER_BYTES - bytes + 1);
                // SAFETY: both ranges lie inside live buffers of
                // BUFFER_BYTES and do not overlap.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        data.as_ptr().add(offset),
                        (memcpy_target.addr() as *mut u8).add(offset),
                        bytes,
                    )
                };
                black_box(memcpy_target.addr());
            }
            samples[0].push(gb_per_s(
                (bytes as u64 * count) as f64,
                start.elapsed().as_secs_f64(),
            ));
            // SAFETY (both): BUFFER_BYTES-long sources, alive until the end
            // of this function.
            samples[1].push(unsafe {
                rdma_gbps(&initiator, arena_source.iova(), &arena_window, bytes, count)
            }?);
            samples[2].push(unsafe {
                rdma_gbps(
                    &initiator,
                    heap_source.as_ptr() as u64,
                    &heap_window,
                    bytes,
                    count,
                )
            }?);
            // CMA, the other side device-mapped: one copy per transfer.
            let start = Instant::now();
            for i in 0..count {
                let offset = (i as usize * bytes) % (BUFFER_BYTES - bytes + 1);
                cma_copy(
                    pid,
                    heap_source.as_ptr() as usize + offset,
                    remote_a + offset,
                    bytes,
                    true,
                )?;
            }
            samples[3].push(gb_per_s(
                (bytes as u64 * count) as f64,
                start.elapsed().as_secs_f64(),
            ));
            // CMA, both sides process memory: two copies through a bounce.
            let start = Instant::now();
            for i in 0..count {
                let offset = (i as usize * bytes) % (BUFFER_BYTES - bytes + 1);
                let mut done = 0;
                while done < bytes {
                    let step = BOUNCE_BYTES.min(bytes - done);
                    cma_copy(pid, bounce.addr(), remote_a + offset + done, step, false)?;
                    cma_copy(pid, bounce.addr(), remote_b + offset + done, step, true)?;
                    done += step;
                }
            }
            samples[4].push(gb_per_s(
                (bytes as u64 * count) as f64,
                start.elapsed().as_secs_f64(),
            ));
        }
        // The last transfer of each kind arrived intact.
        let last = ((count - 1) as usize * bytes) % (BUFFER_BYTES - bytes + 1);
        let mut landed = vec![0u8; bytes];
        arena_target.read_at(last, &mut landed);
        verified &= landed == data[last..last + bytes];
        black_box(&mut heap_target);
        verified &= heap_target[last..last + bytes] == data[last..last + bytes];
        cma_copy(
            pid,
            landed.as_mut_ptr() as usize,
            remote_b + last,
            bytes,
            false,
        )?;
        verified &= landed == data[last..last + bytes];
        let [memcpy, arena, heap, one, two] = samples.map(|mut s| median(&mut s));
        bandwidth.push(Bandwidth {
            bytes,
            memcpy_gbps: memcpy,
            arena_gbps: arena,
            heap_gbps: heap,
            cma_one_copy_gbps: one,
            cma_two_copies_gbps: two,
            arena_ratio: arena / memcpy,
            heap_ratio: heap / memcpy,
            cma_one_copy_ratio: one / memcpy,
            cma_two_copies_ratio: two / memcpy,
        });
    }
    target.finish(Duration::from_secs(5))?;
    drop(heap_window);
    drop(heap_target_region);
    Ok(Report {
        machine,
        registration: registrations,
        bandwidth,
        verified,
    })
}

fn main() -> ExitCode {
    let mut raw = std::env::args_os().skip(1);
    match raw.next().as_deref().and_then(|a| a.to_str()) {
        Some("--device") => return run_device(raw),
        Some("--cma-target") => return cma_target(),
        _ => {}
    }
    let args = Args::parse();
    let run = || -> Result<(), Box<dyn Error>> {
        let exe = std::env::current_exe()?;
        let mut device = DeviceChild::start(&exe, "--device", 2, &[])?;
        let report = match (measure(&args, &device), device.post_mortem()) {
            (Ok(report), None) => report,
            (Ok(_), Some(gone)) => return Err(gone.into()),
            (Err(e), Some(gone)) => return Err(format!("{e}; {gone}").into()),
            (Err(e), None) => return Err(e),
        };
        if !report.verified {
            return Err("a transfer did not arrive intact".into());
        }
        args.output.emit_json(&report)
    };
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("register-cost: {e}");
            ExitCode::FAILURE
        }
    }
}
