use pincache::{CacheConfig, MlockPinner, PinCache};
use std::time::{Duration, Instant};
fn map() -> *mut u8 {
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            4096,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        (p as *mut u8).write(1);
        p as *mut u8
    }
}
fn main() {
    let monitor = std::env::args().any(|a| a == "--monitor");
    let cache = PinCache::new(
        MlockPinner::new(),
        CacheConfig {
            monitor,
            ..CacheConfig::default()
        },
    )
    .unwrap();
    let n = 20000;
    let mut plain = Duration::ZERO;
    let mut hooked = Duration::ZERO;
    for _ in 0..n {
        let p = map();
        unsafe { libc::mlock(p.cast(), 4096) };
        let t = Instant::now();
        unsafe { libc::munmap(p.cast(), 4096) };
        plain += t.elapsed();
        let p = map();
        drop(cache.pin(p as usize, 4096).unwrap());
        let t = Instant::now();
        unsafe { pincache::unmap(p, 4096).unwrap() };
        hooked += t.elapsed();
    }
    println!(
        "monitor={monitor} plain munmap (mlocked) {:.2} us, pincache::unmap {:.2} us",
        plain.as_nanos() as f64 / n as f64 / 1000.0,
        hooked.as_nanos() as f64 / n as f64 / 1000.0
    );
}
