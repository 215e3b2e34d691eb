//! The raw RDMA write ping-pong between two rank processes: the baseline
//! the messaging libraries' figures are compared with (their protocol
//! without the library). Each way is a write of the body into the peer's
//! window, then, fenced after it, a write of the flag word (the iteration
//! number) behind the largest body; the peer waits for its flag word to
//! show the number, checks the body and answers the same way. Waiting is
//! done as the libraries wait: poll for `spin`, then yield between polls.
//!
//! The `fmpl` and `gasnet` programs both measure it in the same run as
//! their own figures; the byte patterns ([`fill`], [`stamp`],
//! [`stamped`], [`whole`]) are the ones their messages carry too.

use std::error::Error;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use pindown_driver::launch::Job;
use pindown_driver::verbs::opcode::Write;
use pindown_driver::verbs::{CompletionQueue, Context, QueuePair, RemoteWindow};
use pindown_uapi::Access;

/// Byte `i` of the message of iteration `n`; the first 8 bytes carry `n`.
pub fn fill(buffer: &mut [u8], n: u64) {
    for (i, b) in buffer.iter_mut().enumerate() {
        *b = (i as u64).wrapping_mul(31).wrapping_add(n) as u8;
    }
    stamp(buffer, n);
}

/// Writes `n` into the first (up to) 8 bytes.
pub fn stamp(buffer: &mut [u8], n: u64) {
    let k = buffer.len().min(8);
    buffer[..k].copy_from_slice(&n.to_le_bytes()[..k]);
}

/// Whether the first (up to) 8 bytes hold `n`.
pub fn stamped(buffer: &[u8], n: u64) -> bool {
    let k = buffer.len().min(8);
    buffer[..k] == n.to_le_bytes()[..k]
}

/// Whether every byte is what [`fill`] writes for `n`.
pub fn whole(buffer: &[u8], n: u64) -> bool {
    let mut want = vec![0u8; buffer.len()];
    fill(&mut want, n);
    want == buffer
}

/// One size to measure: `warmup` untimed round trips, then `iterations`
/// timed ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Size {
    /// Bytes of the body (0: the flag word only).
    pub bytes: usize,
    /// Untimed round trips first.
    pub warmup: usize,
    /// Timed round trips.
    pub iterations: usize,
}

/// Runs the raw write ping-pong between ranks 0 and 1 of `job` (a job of
/// exactly 2 ranks; both call this with the same `sizes`) for every size
/// in turn, and returns, on rank 0, each size's one-way times in
/// microseconds (half of each timed round trip), on rank 1 empty lists.
/// `key` names the launcher key the windows are exchanged under (unique
/// per call in a job). Every body is checked where it lands (the stamp on
/// every iteration, every byte on the last of each size); a wrong one is
/// an error.
pub fn ping_pong(
    context: &Context,
    job: &mut Job,
    key: &str,
    sizes: &[Size],
    spin: Duration,
) -> Result<Vec<Vec<f64>>, Box<dyn Error>> {
    if job.size() != 2 {
        return Err(format!(
            "the raw write ping-pong runs on 2 ranks, not {}",
            job.size()
        )
        .into());
    }
    let me = job.rank();
    let peer = 1 - me;
    let largest = sizes.iter().map(|s| s.bytes).max().unwrap_or(0);
    let flag_at = largest.next_multiple_of(64);
    let mut target = vec![0u8; flag_at + 64];
    // The peer writes `target` behind the compiler's back: it is reached
    // only through this pointer from here on, never through the Vec.
    let (target_at, target_len) = (target.as_mut_ptr(), target.len());
    // SAFETY (both registrations): `target` and `source` are declared
    // before the regions, the window and the queue pair, so they are freed
    // after them, at the end of this function; `target` is read through
    // `target_at` alone (below).
    let target_region = unsafe { context.register(target_at as u64, target_len as u64)? };
    let window = context.bind_window(&target_region, 0, target_len as u64, Access::REMOTE_WRITE)?;
    // The bytes of `target` the peer wrote last. SAFETY: inside `target`,
    // which lives to the end of the function; read only once the flag of
    // iteration n has arrived (after the data, fenced), and the peer
    // writes iteration n + 1 only after this rank has answered n, so no
    // write lands while the slice is in use.
    let landed = |len: usize| unsafe { std::slice::from_raw_parts(target_at.cast_const(), len) };
    let texts = job.all_gather(key, window.remote().to_string().as_bytes())?;
    let peer_window: RemoteWindow = String::from_utf8(texts[peer as usize].clone())?.parse()?;
    let mut source = vec![0u8; flag_at + 64];
    let source_region = unsafe { context.register(source.as_ptr() as u64, source.len() as u64)? };
    let mut cq = context.create_completion_queue();
    let mut qp = context.create_queue_pair(&mut cq)?;
    let flag = || -> u64 {
        // SAFETY: the flag word lies inside `target` (flag_at + 8 <= len),
        // 8-aligned in a heap buffer aligned to 8 at least; the device
        // writes it as one aligned store, so it is read atomically.
        unsafe { AtomicU64::from_ptr(target_at.add(flag_at).cast::<u64>()).load(Ordering::Acquire) }
    };
    // Iterations are numbered across sizes, so that a flag word never
    // needs resetting (and the ranks never need to meet between sizes).
    let mut n = 0u64;
    let mut outstanding = 0u64;
    let mut all = Vec::with_capacity(sizes.len());
    for size in sizes {
        let bytes = size.bytes;
        let last = n + (size.warmup + size.iterations) as u64;
        let first_timed = n + size.warmup as u64 + 1;
        let mut times = Vec::with_capacity(if me == 0 { size.iterations } else { 0 });
        let write = |n: u64, source: &mut Vec<u8>, qp: &mut QueuePair<'_>| {
            if n == last {
                fill(&mut source[..bytes], n);
            } else {
                stamp(&mut source[..bytes], n);
            }
            source[flag_at..flag_at + 8].copy_from_slice(&n.to_le_bytes());
            let mut entries = Vec::with_capacity(2);
            if bytes > 0 {
                entries.push(
                    Write::new(source_region.local(0, bytes as u32)?, peer_window.at(0)).build(),
                );
            }
            entries.push(
                Write::new(
                    source_region.local(flag_at as u64, 8)?,
                    peer_window.at(flag_at as u64),
                )
                .build()
                .fence()
                .signaled(),
            );
            qp.post(&entries)?;
            Ok::<(), Box<dyn Error>>(())
        };
        let wait_flag = |n: u64, cq: &mut CompletionQueue<'_>, outstanding: &mut u64| {
            let start = Instant::now();
            while flag() != n {
                for completion in cq.poll()? {
                    completion.result()?;
                    *outstanding -= 1;
                }
                if start.elapsed() >= spin {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            }
            Ok::<(), Box<dyn Error>>(())
        };
        let check = |n: u64| -> Result<(), Box<dyn Error>> {
            if !stamped(landed(bytes), n) || (n == last && !whole(landed(bytes), n)) {
                return Err(
                    format!("rank {me}: raw write {n} of {bytes} bytes arrived wrong").into(),
                );
            }
            Ok(())
        };
        while n < last {
            n += 1;
            if me == 0 {
                let start = Instant::now();
                write(n, &mut source, &mut qp)?;
                outstanding += 1;
                wait_flag(n, &mut cq, &mut outstanding)?;
                let elapsed = start.elapsed();
                if n >= first_timed {
                    times.push(elapsed.as_secs_f64() * 1e6 / 2.0);
                }
                check(n)?;
            } else {
                wait_flag(n, &mut cq, &mut outstanding)?;
                check(n)?;
                write(n, &mut source, &mut qp)?;
                outstanding += 1;
            }
        }
        all.push(times);
    }
    while outstanding > 0 {
        for completion in cq.wait(Duration::from_secs(10))? {
            completion.result()?;
            outstanding -= 1;
        }
    }
    drop(window);
    Ok(all)
}
