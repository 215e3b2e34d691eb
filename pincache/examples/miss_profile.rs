use pincache::{CacheConfig, NoopPinner, PinCache};
use std::time::Instant;
fn main() {
    let page = 4096;
    let n = 16 * 1024;
    let mut best = f64::MAX;
    for _round in 0..200 {
        let cache = PinCache::new(
            NoopPinner,
            CacheConfig {
                max_entries: n + 1,
                max_pinned_bytes: Some((n + 1) * page),
                ..CacheConfig::default()
            },
        )
        .unwrap();
        let start = Instant::now();
        for i in 0..n {
            drop(std::hint::black_box(
                cache.pin(0x10_0000_0000 + 2 * i * page, page),
            ));
        }
        let ns = start.elapsed().as_nanos() as f64 / n as f64;
        best = best.min(ns);
    }
    println!("miss {best:.1} ns");
    if std::env::args().any(|a| a == "--evict") {
        evict_steady();
    }
}

#[allow(dead_code)]
fn evict_steady() {
    let page = 4096;
    let cache = PinCache::new(
        NoopPinner,
        CacheConfig {
            max_entries: 1024,
            max_pinned_bytes: Some(1 << 30),
            merge: false,
            ..CacheConfig::default()
        },
    )
    .unwrap();
    let mut best = f64::MAX;
    let mut i = 0usize;
    for _round in 0..50 {
        let start = Instant::now();
        for _ in 0..20000 {
            i += 1;
            drop(std::hint::black_box(
                cache.pin(0x10_0000_0000 + 2 * (i % (1 << 20)) * page, page),
            ));
        }
        best = best.min(start.elapsed().as_nanos() as f64 / 20000.0);
    }
    println!("miss+evict {best:.1} ns");
}
