//! When a polling thread gives its core away.
//!
//! A port's thread busy-polls its RDMA send queues while traffic flows. On
//! a machine with cores to spare it should never give the core up: a
//! `sched_yield` costs about half a microsecond with today's kernel
//! mitigations, and a request that lands during one waits for it, which is
//! what a latency tail is made of. On a machine with fewer cores than
//! busy threads (two rank processes and their ports on two cores) the
//! opposite holds: a thread that polls without yielding keeps the
//! requester that will post next, or the peer that waits for the data,
//! off the core for a whole time slice.
//!
//! [`CoreSharing`] tells the two apart from the kernel's count of the
//! thread's involuntary context switches (`getrusage(RUSAGE_THREAD)`):
//! it grows only when another thread ran in this one's place, preempting
//! it or given the core by a yield. Interrupts do not count. The count is
//! read once per [`CHECK_INTERVAL`] of idle polling, and a yield that took
//! long is a sign too. After a sign the thread yields between idle polls
//! for [`SHARING_HOLD`]; without one it spins.

use std::time::{Duration, Instant};

/// How often an idle polling thread reads its involuntary context-switch
/// count (one system call of about half a microsecond).
pub const CHECK_INTERVAL: Duration = Duration::from_millis(1);

/// A yield shorter than this ran nobody else (one that finds nobody else
/// runnable returns in about half a microsecond; one that switches to
/// another process and back takes two switches, more than this).
pub const OTHERS_RAN: Duration = Duration::from_nanos(1500);

/// How long after the last sign of a shared core the thread keeps
/// yielding between idle polls.
pub const SHARING_HOLD: Duration = Duration::from_millis(10);

/// Yields in a row that ran nobody else, right after a preemption, end
/// the sharing at once: the thread that preempted this one was a passing
/// one (a kernel worker), not one that waits for the core. Once a yield
/// has run another thread, only the hold ends the sharing.
pub const QUICK_YIELDS_TO_END: u32 = 8;

/// Idle polls between two yields while the core is shared.
pub const POLLS_PER_YIELD: u32 = 16;

/// What one polling thread has learnt about its core.
#[derive(Debug, Default)]
pub struct CoreSharing {
    /// Yield between idle polls until then.
    shared_until: Option<Instant>,
    /// When the switch count is read next.
    next_check: Option<Instant>,
    /// The involuntary context switches counted at the last read.
    switches: Option<u64>,
    /// Idle polls since the last yield.
    idle_polls: u32,
    /// Yields in a row that ran nobody else since the sharing began.
    quick_yields: u32,
    /// A yield ran another thread since the sharing began.
    confirmed: bool,
}

impl CoreSharing {
    /// A thread that has seen no sign of sharing yet.
    pub fn new() -> CoreSharing {
        CoreSharing::default()
    }

    /// Whether the thread yields between idle polls at `now`.
    pub fn shared(&self, now: Instant) -> bool {
        self.shared_until.is_some_and(|until| now < until)
    }

    /// Records a preemption seen at `now`.
    fn preempted(&mut self, now: Instant) {
        if !self.shared(now) {
            self.confirmed = false;
            self.quick_yields = 0;
        }
        self.shared_until = Some(now + SHARING_HOLD);
    }

    /// A look at the clock at `now` while idle polling: reads the switch
    /// count when it is due.
    pub fn looked(&mut self, now: Instant) {
        if self.next_check.is_some_and(|next| now < next) {
            return;
        }
        self.next_check = Some(now + CHECK_INTERVAL);
        if let Some(count) = involuntary_switches() {
            self.counted(now, count);
        }
    }

    /// The thread's involuntary context switches counted at `now`: more
    /// than at the last count is a preemption.
    pub fn counted(&mut self, now: Instant, count: u64) {
        if self.grew(count) {
            self.preempted(now);
        }
    }

    /// Whether `count` is more than the last count; it becomes the last.
    fn grew(&mut self, count: u64) -> bool {
        let grew = self.switches.is_some_and(|before| count > before);
        self.switches = Some(count);
        grew
    }

    /// A yield that returned at `end`; `ran_others`: another thread ran
    /// in it.
    pub fn yielded(&mut self, end: Instant, ran_others: bool) {
        if ran_others {
            self.shared_until = Some(end + SHARING_HOLD);
            self.confirmed = true;
            return;
        }
        if !self.confirmed {
            self.quick_yields += 1;
            if self.quick_yields >= QUICK_YIELDS_TO_END {
                self.shared_until = None;
            }
        }
    }

    /// Between two idle polls: yields the processor every
    /// [`POLLS_PER_YIELD`] idle polls while the core is shared, else
    /// spins once.
    pub fn pause(&mut self) {
        self.idle_polls = self.idle_polls.wrapping_add(1);
        if self.idle_polls.is_multiple_of(POLLS_PER_YIELD) {
            let start = Instant::now();
            if self.shared(start) {
                std::thread::yield_now();
                let end = Instant::now();
                // Only a long yield can have run another thread; the
                // kernel's count tells it from a yield the hypervisor or
                // an interrupt made long.
                let ran_others = end.saturating_duration_since(start) > OTHERS_RAN
                    && involuntary_switches().is_some_and(|count| self.grew(count));
                self.yielded(end, ran_others);
                return;
            }
        }
        std::hint::spin_loop();
    }
}

/// The calling thread's involuntary context switches so far, if the
/// kernel says.
fn involuntary_switches() -> Option<u64> {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes one `rusage` into the memory `usage` owns
    // and reads nothing else.
    let done = unsafe { libc::getrusage(libc::RUSAGE_THREAD, usage.as_mut_ptr()) };
    if done != 0 {
        return None;
    }
    // SAFETY: getrusage succeeded, so it filled `usage` (and zeroed
    // memory is a valid `rusage` anyway).
    let usage = unsafe { usage.assume_init() };
    u64::try_from(usage.ru_nivcsw).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fresh_thread_spins() {
        let sharing = CoreSharing::new();
        assert!(!sharing.shared(Instant::now()));
    }

    #[test]
    fn more_involuntary_switches_mean_sharing_for_the_hold() {
        let t0 = Instant::now();
        let mut sharing = CoreSharing::new();
        sharing.counted(t0, 7);
        assert!(!sharing.shared(t0), "a first count is a baseline");
        let t1 = t0 + CHECK_INTERVAL;
        sharing.counted(t1, 7);
        assert!(!sharing.shared(t1));
        let t2 = t1 + CHECK_INTERVAL;
        sharing.counted(t2, 8);
        assert!(sharing.shared(t2));
        assert!(sharing.shared(t2 + SHARING_HOLD - Duration::from_micros(1)));
        assert!(!sharing.shared(t2 + SHARING_HOLD));
    }

    #[test]
    fn a_preemption_by_a_passing_thread_ends_after_quick_yields() {
        let t0 = Instant::now();
        let mut sharing = CoreSharing::new();
        sharing.counted(t0, 1);
        sharing.counted(t0, 2);
        assert!(sharing.shared(t0));
        for _ in 1..QUICK_YIELDS_TO_END {
            sharing.yielded(t0, false);
            assert!(sharing.shared(t0));
        }
        sharing.yielded(t0, false);
        assert!(!sharing.shared(t0), "nobody waits for the core");
    }

    #[test]
    fn a_yield_that_ran_another_thread_holds_the_sharing() {
        let t0 = Instant::now();
        let mut sharing = CoreSharing::new();
        sharing.counted(t0, 1);
        sharing.counted(t0, 2);
        sharing.yielded(t0, true);
        // Quick yields no longer end it: somebody does wait for the core.
        for _ in 0..2 * QUICK_YIELDS_TO_END {
            sharing.yielded(t0, false);
        }
        assert!(sharing.shared(t0 + SHARING_HOLD - Duration::from_micros(1)));
        assert!(!sharing.shared(t0 + SHARING_HOLD));
        // Each yield that runs another thread renews the hold.
        let t1 = t0 + SHARING_HOLD / 2;
        sharing.yielded(t1, true);
        assert!(sharing.shared(t0 + SHARING_HOLD));
        assert!(!sharing.shared(t1 + SHARING_HOLD));
    }

    /// Keeps the calling thread on CPU 0.
    fn on_cpu_zero() {
        // SAFETY: cpu_set_t is plain data; CPU_ZERO/CPU_SET write only
        // into `set`, and sched_setaffinity reads it for the calling
        // thread (pid 0).
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_ZERO(&mut set);
            libc::CPU_SET(0, &mut set);
            assert_eq!(
                libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set),
                0
            );
        }
    }

    #[test]
    fn the_kernel_counts_a_yield_that_runs_another_thread_and_this_thread_sees_it() {
        // Two threads on one core that yield to each other: a yield that
        // runs the other is an involuntary switch of the yielder.
        on_cpu_zero();
        let before = involuntary_switches().expect("getrusage");
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let other = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                on_cpu_zero();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    std::thread::yield_now();
                }
            })
        };
        let mut sharing = CoreSharing::new();
        sharing.counted(Instant::now(), before);
        let start = Instant::now();
        while !sharing.shared(Instant::now()) && start.elapsed() < Duration::from_secs(5) {
            for _ in 0..POLLS_PER_YIELD {
                sharing.pause();
            }
            sharing.looked(Instant::now());
            sharing.next_check = None;
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        other.join().unwrap();
        let after = involuntary_switches().expect("getrusage");
        assert!(after > before, "no switch counted ({before} -> {after})");
        assert!(
            sharing.shared(Instant::now()),
            "the shared core was not seen"
        );
    }
}
