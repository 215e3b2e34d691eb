//! When a polling thread gives its core away.
//!
//! Both sides of the rings poll: a port's thread polls its RDMA send
//! queues while traffic flows, and a driver thread polls its completion
//! queues while it waits. On a machine with cores to spare neither should
//! ever give its core up: a `sched_yield` costs about half a microsecond
//! with today's kernel mitigations, and a request or completion that
//! lands during one waits for it, which is what a latency tail is made of.
//! On a machine with fewer cores than busy threads (two rank processes and
//! their ports on two cores) the opposite holds: a thread that polls
//! without yielding keeps the thread that must act next (the port that
//! would execute the request just posted, the requester that will post
//! next) off the core for a whole time slice. Both sides keep the same
//! rule, so it lives here, beside the rings it is about.
//!
//! [`CoreSharing`] tells the two apart from the kernel's count of the
//! thread's involuntary context switches (`getrusage(RUSAGE_THREAD)`):
//! it grows only when another thread ran in this one's place, preempting
//! it or given the core by a yield. Interrupts do not count. While it
//! spins, the thread reads the count once per [`CHECK_INTERVAL`] and
//! yields once per [`PROBE_INTERVAL`] to see whether anybody waits (a
//! yield that finds nobody costs half a microsecond, once in hundreds).
//! After a sign it yields between idle polls; a passing thread (a kernel
//! worker) ends that after a few yields that run nobody, a waiting one
//! keeps it up to [`SHARING_HOLD`] after the last yield that ran another
//! thread.

use std::cell::RefCell;
use std::time::{Duration, Instant};

/// How often an idle polling thread reads its involuntary context-switch
/// count (one system call of about half a microsecond).
pub const CHECK_INTERVAL: Duration = Duration::from_millis(1);

/// While the core seems its own, how often a polling thread yields once
/// to see whether another thread waits for it.
pub const PROBE_INTERVAL: Duration = Duration::from_micros(200);

/// A yield shorter than this ran nobody else (one that finds nobody else
/// runnable returns in about half a microsecond; one that switches to
/// another process and back takes two switches, more than this).
pub const OTHERS_RAN: Duration = Duration::from_nanos(1500);

/// How long after the last sign of a shared core the thread keeps
/// yielding between idle polls.
pub const SHARING_HOLD: Duration = Duration::from_millis(10);

/// Yields that ran another thread, one after another with fewer than
/// [`QUICK_YIELDS_TO_END`] between them, that show a thread waiting for
/// the core: a kernel worker that preempted this thread runs once and
/// sleeps again; a rank that polls comes back at every yield.
pub const RAN_YIELDS_TO_CONFIRM: u32 = 2;

/// Yields in a row that ran nobody else that end the sharing, before it
/// was confirmed (the thread that preempted this one was a passing one).
pub const QUICK_YIELDS_TO_END: u32 = 8;

/// Yields in a row that ran nobody else that end a confirmed sharing (the
/// threads that waited went to sleep).
pub const QUICK_YIELDS_TO_END_CONFIRMED: u32 = 64;

/// Idle polls between two yields while the core is shared.
pub const POLLS_PER_YIELD: u32 = 1;

/// What one polling thread has learnt about its core.
#[derive(Debug, Default)]
pub struct CoreSharing {
    /// Yield between idle polls until then.
    shared_until: Option<Instant>,
    /// When the switch count is read next.
    next_check: Option<Instant>,
    /// When the next probing yield is due.
    next_probe: Option<Instant>,
    /// The involuntary context switches counted at the last read.
    switches: Option<u64>,
    /// Idle polls since the last yield.
    idle_polls: u32,
    /// Yields in a row that ran nobody else.
    quick_yields: u32,
    /// Yields that ran another thread since the sharing began.
    ran_yields: u32,
    /// Enough yields ran another thread: somebody waits for the core.
    confirmed: bool,
    /// Yields that ran another thread, over the thread's life.
    yields_that_ran_others: u64,
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

    /// Records a sign of another thread on the core seen at `now`: a
    /// sharing begins on trial, or goes on.
    fn noticed(&mut self, now: Instant) {
        if !self.shared(now) {
            self.confirmed = false;
            self.ran_yields = 0;
        }
        self.quick_yields = 0;
        self.shared_until = Some(now + SHARING_HOLD);
    }

    /// Ends the sharing: the thread spins again.
    fn end(&mut self) {
        self.shared_until = None;
        self.confirmed = false;
        self.ran_yields = 0;
        self.quick_yields = 0;
    }

    /// A look at the clock at `now` while idle polling: reads the switch
    /// count, or yields once to probe, when either is due.
    pub fn looked(&mut self, now: Instant) {
        if !self.shared(now) {
            // A lapsed hold: `pause` spins without reading the clock.
            self.shared_until = None;
        }
        if self.next_check.is_none_or(|next| now >= next) {
            self.next_check = Some(now + CHECK_INTERVAL);
            if let Some(count) = involuntary_switches() {
                self.counted(now, count);
            }
        }
        if !self.shared(now) && self.next_probe.is_none_or(|next| now >= next) {
            self.next_probe = Some(now + PROBE_INTERVAL);
            self.yield_once();
        }
    }

    /// The thread's involuntary context switches counted at `now`: more
    /// than at the last count is a preemption.
    pub fn counted(&mut self, now: Instant, count: u64) {
        if self.grew(count) {
            self.noticed(now);
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
            self.yields_that_ran_others += 1;
            self.noticed(end);
            self.ran_yields += 1;
            self.confirmed |= self.ran_yields >= RAN_YIELDS_TO_CONFIRM;
            return;
        }
        self.quick_yields += 1;
        let enough = if self.confirmed {
            QUICK_YIELDS_TO_END_CONFIRMED
        } else {
            QUICK_YIELDS_TO_END
        };
        if self.quick_yields >= enough {
            self.end();
        }
    }

    /// Between two idle polls: yields the processor every
    /// [`POLLS_PER_YIELD`] idle polls while the core is shared, else
    /// spins once (reading no clock unless a sharing was seen). Returns
    /// whether it yielded: a yield may last a time slice of the thread it
    /// ran, so a caller with a deadline looks at the clock after one.
    pub fn pause(&mut self) -> bool {
        self.idle_polls = self.idle_polls.wrapping_add(1);
        let yielding = self.idle_polls.is_multiple_of(POLLS_PER_YIELD)
            && self.shared_until.is_some()
            && self.shared(Instant::now());
        if yielding {
            self.yield_once();
        } else {
            std::hint::spin_loop();
        }
        yielding
    }

    /// Yields that ran another thread since the thread began (what a
    /// thread that shares its core does between its polls).
    pub fn yields_that_ran_others(&self) -> u64 {
        self.yields_that_ran_others
    }

    /// Yields the processor once and learns from what the yield did.
    fn yield_once(&mut self) {
        let start = Instant::now();
        std::thread::yield_now();
        let end = Instant::now();
        // Only a long yield can have run another thread; the kernel's
        // count tells it from a yield the hypervisor or an interrupt made
        // long.
        let ran_others = end.saturating_duration_since(start) > OTHERS_RAN
            && involuntary_switches().is_some_and(|count| self.grew(count));
        self.yielded(end, ran_others);
    }
}

thread_local! {
    /// What the calling thread has learnt about its core.
    static THIS_THREAD: RefCell<CoreSharing> = RefCell::new(CoreSharing::new());
}

/// Runs `f` on what the calling thread has learnt about its core, kept
/// from one wait to the next (the core stays shared or not whatever the
/// thread waits for). `f` must not call `this_thread` again, nor wait
/// through the driver (which calls it): the state is borrowed while `f`
/// runs, and a second borrow panics.
pub fn this_thread<R>(f: impl FnOnce(&mut CoreSharing) -> R) -> R {
    THIS_THREAD.with_borrow_mut(f)
}

/// Pins the calling thread to the CPUs `cpus` names (threads and
/// processes it starts later inherit that): how the tests of this rule,
/// and benchmarks, make threads share a core or keep them apart. Returns
/// whether it worked (a CPU the machine lacks, or one outside the
/// process's allowed set, leaves the thread where it was).
pub fn pin_to_cpus(cpus: impl IntoIterator<Item = usize>) -> bool {
    // SAFETY: a zeroed cpu_set_t is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for cpu in cpus {
        if cpu >= libc::CPU_SETSIZE as usize {
            return false;
        }
        // SAFETY: CPU_SET writes inside `set` for cpu < CPU_SETSIZE,
        // checked above.
        unsafe { libc::CPU_SET(cpu, &mut set) };
    }
    // SAFETY: sched_setaffinity reads `size_of::<cpu_set_t>()` bytes of
    // `set`, a live cpu_set_t, for the calling thread (pid 0).
    unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0 }
}

/// Pins the calling thread to CPU `cpu`; see [`pin_to_cpus`].
pub fn pin_to_cpu(cpu: usize) -> bool {
    pin_to_cpus([cpu])
}

/// The CPUs the calling thread may run on, lowest first (empty if the
/// kernel does not say).
pub fn allowed_cpus() -> Vec<usize> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: sched_getaffinity writes at most `size_of::<cpu_set_t>()`
    // bytes into `set`, a live cpu_set_t, for the calling thread.
    let done =
        unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if done != 0 {
        return Vec::new();
    }
    (0..libc::CPU_SETSIZE as usize)
        // SAFETY: CPU_ISSET reads inside `set` for cpu < CPU_SETSIZE.
        .filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) })
        .collect()
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
    fn one_yield_that_ran_a_passing_thread_does_not_confirm() {
        let t0 = Instant::now();
        let mut sharing = CoreSharing::new();
        sharing.counted(t0, 1);
        sharing.counted(t0, 2);
        // The kernel worker that preempted runs once more, then sleeps.
        sharing.yielded(t0, true);
        for _ in 0..QUICK_YIELDS_TO_END {
            sharing.yielded(t0, false);
        }
        assert!(!sharing.shared(t0));
    }

    #[test]
    fn yields_that_keep_running_another_thread_hold_the_sharing() {
        let t0 = Instant::now();
        let mut sharing = CoreSharing::new();
        sharing.counted(t0, 1);
        sharing.counted(t0, 2);
        for _ in 0..RAN_YIELDS_TO_CONFIRM {
            sharing.yielded(t0, true);
        }
        // Confirmed: a short run of quick yields no longer ends it.
        for _ in 0..QUICK_YIELDS_TO_END_CONFIRMED - 1 {
            sharing.yielded(t0, false);
        }
        assert!(sharing.shared(t0 + SHARING_HOLD - Duration::from_micros(1)));
        assert!(!sharing.shared(t0 + SHARING_HOLD), "the hold lapses");
        // Each yield that runs another thread renews the hold.
        let t1 = t0 + SHARING_HOLD / 2;
        sharing.yielded(t1, true);
        assert!(sharing.shared(t0 + SHARING_HOLD));
        assert!(!sharing.shared(t1 + SHARING_HOLD));
        // The waiting threads went to sleep: a long run of quick yields
        // ends it at once.
        for _ in 0..QUICK_YIELDS_TO_END_CONFIRMED {
            sharing.yielded(t1, false);
        }
        assert!(!sharing.shared(t1));
    }

    #[test]
    fn the_kernel_counts_a_yield_that_runs_another_thread_and_this_thread_sees_it() {
        // Two threads on one core that yield to each other: a yield that
        // runs the other is an involuntary switch of the yielder.
        let cpu = allowed_cpus()[0];
        assert!(pin_to_cpu(cpu));
        let before = involuntary_switches().expect("getrusage");
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let other = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                assert!(pin_to_cpu(cpu));
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
