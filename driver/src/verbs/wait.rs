//! Waiting for completions: poll for a while after activity, then sleep on
//! the completion rings' eventfds. While it polls, a thread gives its core
//! to the port that must execute its request only when the two share the
//! core ([`CoreSharing`], the rule the port's thread keeps too).

use std::io;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use pindown_uapi::core_sharing::{self, CoreSharing};

use super::completion::CompletionRing;
use super::VerbsError;

/// Something that waits on completion rings: [`try_complete`] looks for
/// what is awaited (reaping completions as it goes).
///
/// [`try_complete`]: Awaiting::try_complete
pub(super) trait Awaiting {
    /// Reaps and reports whether what is awaited has arrived.
    fn try_complete(&mut self) -> Result<bool, VerbsError>;

    /// The rings whose completions are awaited.
    fn rings(&mut self) -> Vec<&mut CompletionRing>;
}

/// Calls [`Awaiting::try_complete`] until it reports success: for `spin`
/// (at most `timeout`) in a busy loop, then, having asked the device to
/// signal each ring's next completion, asleep on their eventfds until one
/// is signalled, and so on until `timeout` has passed (then
/// [`VerbsError::Timeout`]). While it spins the device signals nothing;
/// alone on its core the thread reads its switch count once a millisecond
/// and yields once per 200 us to probe, and sharing it, it yields between
/// polls ([`CoreSharing`]).
pub(super) fn wait_for(
    awaiting: &mut impl Awaiting,
    spin: Duration,
    timeout: Duration,
) -> Result<(), VerbsError> {
    let start = Instant::now();
    loop {
        // The clock is read once every few attempts only, so that a
        // completion is seen within nanoseconds of its arrival, and after
        // every yield, which may have lasted another thread's time slice.
        let spin = spin.min(timeout.saturating_sub(start.elapsed()));
        let spin_from = Instant::now();
        let mut attempts = 0u32;
        loop {
            if awaiting.try_complete()? {
                return Ok(());
            }
            attempts = attempts.wrapping_add(1);
            let yielded = core_sharing::this_thread(CoreSharing::pause);
            if yielded || attempts.is_multiple_of(ATTEMPTS_PER_CLOCK) {
                let now = Instant::now();
                if now.saturating_duration_since(spin_from) >= spin {
                    break;
                }
                core_sharing::this_thread(|sharing| sharing.looked(now));
            }
        }
        let elapsed = start.elapsed();
        if elapsed >= timeout {
            return Err(VerbsError::Timeout(timeout));
        }
        let mut rings = awaiting.rings();
        // Every ring is armed (no short cut): one that is already pending
        // only makes the sleep be skipped. The request stays until its
        // position passes: nothing to withdraw after waking.
        let pending = rings
            .iter_mut()
            .fold(false, |pending, ring| ring.queue.arm() | pending);
        if !pending {
            sleep_on(&rings, timeout - elapsed).map_err(VerbsError::Wait)?;
        }
    }
}

/// Polling attempts between two looks at the clock while spinning.
const ATTEMPTS_PER_CLOCK: u32 = 64;

/// Sleeps until one of the rings' completion eventfds is signalled (or
/// `timeout` passes) and consumes the signals.
fn sleep_on(rings: &[&mut CompletionRing], timeout: Duration) -> io::Result<()> {
    let mut fds: Vec<libc::pollfd> = rings
        .iter()
        .map(|ring| libc::pollfd {
            fd: ring.event.fd().as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let millis = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
    let count = libc::nfds_t::try_from(fds.len()).unwrap_or(libc::nfds_t::MAX);
    loop {
        // SAFETY: `fds` is a live array of `count` pollfd structures that
        // poll may write the `revents` of; the descriptors stay open while
        // the rings (borrowed here) hold their eventfds.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), count, millis) };
        if ready >= 0 {
            break;
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
    for ring in rings {
        ring.event.take()?;
    }
    Ok(())
}
