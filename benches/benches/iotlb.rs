//! Criterion benchmarks of the device IOTLB (`pindown_emu_device::memory`): what an
//! IOTLB UPDATE and a translation cost with 10, 1,000 and 100,000 entries,
//! each beside a baseline timed in the same run.
//!
//! * `translate/{10,1000,100000}`: one device address (64 bytes) translated
//!   through a port's memory (`PortMemory::translate`: IOTLB lookup, memory
//!   table region, slice), addresses drawn at random among the entries.
//! * `read_obj/{n}`: the same through vm-memory's `Bytes::read_obj` of a
//!   `u64`, as virtio-queue reads ring entries (translation plus the read).
//! * `baseline_btreemap/{n}`: a `BTreeMap<u64, u64>` lookup of the entry
//!   holding an address, over as many keys.
//! * `baseline_memcpy64`: copying 64 bytes.
//! * `update/{n}`: an UPDATE replacing one entry of a full table (remove
//!   the old entry, insert the new one).
//! * `update_evicting/{n}`: an UPDATE of a new page into a full table (the
//!   oldest entry is evicted).
//! * `invalidate/{n}`: an INVALIDATE of one entry, then the UPDATE that
//!   maps it again (the pair is timed).
//! * `rebuild_old/{n}`: what every UPDATE and INVALIDATE used to cost: a
//!   vm-memory `Iotlb` rebuilt from all `n` entries (kept here only for
//!   comparison).

use std::collections::BTreeMap;
use std::fs::File;
use std::hint::black_box;
use std::os::fd::FromRawFd;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use pindown_emu_device::memory::{IotlbTable, MemoryTable, PortMemory, RegionDesc};
use vm_memory::{Bytes, GuestAddress, Iotlb, Permissions};

const SIZES: [usize; 3] = [10, 1_000, 100_000];
const PAGE: u64 = 0x1000;
/// IOVA of entry 0; entry `i` is at `IOVA_BASE + 2 * i` pages.
const IOVA_BASE: u64 = 0x1000_0000;
/// Frontend address of the one memory region.
const UADDR_BASE: u64 = 0x7f00_0000_0000;
/// Pages of the memory region (entries share them).
const REGION_PAGES: u64 = 256;
/// Random entry indices, drawn once.
const PICKS: usize = 4096;

fn iova(i: u64) -> u64 {
    IOVA_BASE + 2 * i * PAGE
}

fn uaddr(i: u64) -> u64 {
    UADDR_BASE + (i % REGION_PAGES) * PAGE
}

/// `PICKS` pseudo-random numbers below `n` (xorshift; no timing of a RNG).
fn picks(n: usize) -> Vec<u64> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    (0..PICKS)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n as u64
        })
        .collect()
}

fn memory_table() -> MemoryTable {
    // SAFETY: memfd_create with a NUL-terminated name; the fd is checked
    // and owned by the File right away.
    let fd = unsafe { libc::memfd_create(c"iotlb-bench".as_ptr(), 0) };
    assert!(fd >= 0, "memfd_create");
    // SAFETY: `fd` is a fresh descriptor nobody else owns.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(REGION_PAGES * PAGE).expect("memfd size");
    let region = RegionDesc {
        gpa: 0,
        size: REGION_PAGES * PAGE,
        uaddr: UADDR_BASE,
        mmap_offset: 0,
    };
    MemoryTable::map(&[region], vec![file]).expect("memory table")
}

fn table(n: usize) -> IotlbTable {
    let mut t = IotlbTable::new(n);
    for i in 0..n as u64 {
        t.update(iova(i), PAGE, uaddr(i), Permissions::ReadWrite)
            .expect("update");
    }
    t
}

fn bench_translate(c: &mut Criterion) {
    let mut group = c.benchmark_group("translate");
    for n in SIZES {
        let memory = PortMemory::new(memory_table(), true, table(n));
        let picks = picks(n);
        let mut k = 0;
        group.bench_function(BenchmarkId::from_parameter(n), |b| {
            b.iter(|| {
                k = (k + 1) % PICKS;
                let addr = iova(picks[k]) + 64;
                let slice = memory
                    .translate(black_box(addr), 64, Permissions::Read)
                    .next()
                    .expect("one slice")
                    .expect("mapped");
                black_box(slice.len())
            })
        });
    }
    group.finish();

    let mut group = c.benchmark_group("read_obj");
    for n in SIZES {
        let memory = PortMemory::new(memory_table(), true, table(n));
        let picks = picks(n);
        let mut k = 0;
        group.bench_function(BenchmarkId::from_parameter(n), |b| {
            b.iter(|| {
                k = (k + 1) % PICKS;
                let addr = GuestAddress(iova(picks[k]) + 64);
                memory.read_obj::<u64>(black_box(addr)).expect("mapped")
            })
        });
    }
    group.finish();
}

fn bench_baselines(c: &mut Criterion) {
    let mut group = c.benchmark_group("baseline_btreemap");
    for n in SIZES {
        let map: BTreeMap<u64, u64> = (0..n as u64).map(|i| (iova(i), uaddr(i))).collect();
        let picks = picks(n);
        let mut k = 0;
        group.bench_function(BenchmarkId::from_parameter(n), |b| {
            b.iter(|| {
                k = (k + 1) % PICKS;
                let addr = iova(picks[k]) + 64;
                let (start, target) = map.range(..=black_box(addr)).next_back().expect("key");
                black_box(target + (addr - start))
            })
        });
    }
    group.finish();

    let source = [0x5au8; 64];
    let mut destination = [0u8; 64];
    c.bench_function("baseline_memcpy64", |b| {
        b.iter(|| {
            destination.copy_from_slice(black_box(&source));
            black_box(&mut destination);
        })
    });
}

fn bench_update(c: &mut Criterion) {
    let mut group = c.benchmark_group("update");
    for n in SIZES {
        let mut t = table(n);
        let picks = picks(n);
        let mut k = 0;
        group.bench_function(BenchmarkId::from_parameter(n), |b| {
            b.iter(|| {
                k = (k + 1) % PICKS;
                let i = picks[k];
                t.update(iova(i), PAGE, uaddr(i + 1), Permissions::ReadWrite)
                    .expect("update")
            })
        });
        assert_eq!(t.len(), n);
    }
    group.finish();

    let mut group = c.benchmark_group("update_evicting");
    for n in SIZES {
        let mut t = table(n);
        let mut next = n as u64;
        group.bench_function(BenchmarkId::from_parameter(n), |b| {
            b.iter(|| {
                next += 1;
                t.update(iova(next), PAGE, uaddr(next), Permissions::ReadWrite)
                    .expect("update")
            })
        });
        assert_eq!(t.len(), n);
    }
    group.finish();

    let mut group = c.benchmark_group("invalidate");
    for n in SIZES {
        let mut t = table(n);
        let picks = picks(n);
        let mut k = 0;
        group.bench_function(BenchmarkId::from_parameter(n), |b| {
            b.iter(|| {
                k = (k + 1) % PICKS;
                let i = picks[k];
                t.invalidate(iova(i), PAGE);
                t.update(iova(i), PAGE, uaddr(i), Permissions::ReadWrite)
                    .expect("update")
            })
        });
        assert_eq!(t.len(), n);
    }
    group.finish();
}

/// The translation table every UPDATE and INVALIDATE used to rebuild:
/// vm-memory's `Iotlb` from all entries, each first resolved in the memory
/// table (IOVA -> guest physical).
fn rebuild_old(t: &IotlbTable, memory: &MemoryTable) -> Iotlb {
    let mut tlb = Iotlb::new();
    for (iova, e) in t.iter() {
        for (offset, gpa, len) in memory.uaddr_segments(e.uaddr, e.len) {
            tlb.set_mapping(
                GuestAddress(iova + offset),
                GuestAddress(gpa),
                len as usize,
                e.perm,
            )
            .expect("mapping");
        }
    }
    tlb
}

fn bench_rebuild_old(c: &mut Criterion) {
    let mut group = c.benchmark_group("rebuild_old");
    group.sample_size(10);
    let memory = memory_table();
    for n in SIZES {
        let t = table(n);
        group.bench_function(BenchmarkId::from_parameter(n), |b| {
            b.iter(|| rebuild_old(&t, &memory))
        });
    }
    group.finish();
}

criterion_group!(
    benches,
    bench_translate,
    bench_baselines,
    bench_update,
    bench_rebuild_old
);
criterion_main!(benches);
