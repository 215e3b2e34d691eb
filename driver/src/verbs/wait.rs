//! Waiting for completions: poll for a while after activity, then sleep on
//! the completion rings' eventfds. While it polls, a thread gives its core
//! to the port that must execute its request only when the two share the
//! core ([`CoreSharing`], the rule the port's thread keeps too).

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::time::{Duration, Instant};

use pindown_uapi::core_sharing::{self, CoreSharing};

use super::completion::CompletionRing;
use super::VerbsError;
use crate::transport;

/// Something that waits on completion rings: [`try_complete`] looks for
/// what is awaited (reaping completions as it goes).
///
/// [`try_complete`]: Awaiting::try_complete
pub(super) trait Awaiting {
    /// Reaps and reports whether what is awaited has arrived.
    fn try_complete(&mut self) -> Result<bool, VerbsError>;

    /// The rings whose completions are awaited.
    fn rings(&mut self) -> Vec<&mut CompletionRing>;

    /// A descriptor that polls as hung up once the device that would
    /// answer is gone ([`Transport::hangup_fd`]): the wait then ends with
    /// [`VerbsError::HungUp`].
    ///
    /// [`Transport::hangup_fd`]: crate::transport::Transport::hangup_fd
    fn hangup_fd(&self) -> Option<BorrowedFd<'_>> {
        None
    }
}

/// Calls [`Awaiting::try_complete`] until it reports success: for `spin`
/// (at most `timeout`) in a busy loop, then, having asked the device to
/// signal each ring's next completion, asleep on their eventfds until one
/// is signalled, and so on until `timeout` has passed (then
/// [`VerbsError::Timeout`]) or the device hangs up (then
/// [`VerbsError::HungUp`]; looked at once a millisecond while spinning).
/// While it spins the device signals nothing; alone on its core the
/// thread reads its switch count once a millisecond and yields once per
/// 200 us to probe, and sharing it, it yields between polls
/// ([`CoreSharing`]).
pub(super) fn wait_for(
    awaiting: &mut impl Awaiting,
    spin: Duration,
    timeout: Duration,
) -> Result<(), VerbsError> {
    let start = Instant::now();
    let mut hangup_looked = start;
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
                if now.saturating_duration_since(hangup_looked) >= HANGUP_LOOK {
                    hangup_looked = now;
                    if hung_up(awaiting.hangup_fd())? && !awaiting.try_complete()? {
                        return Err(VerbsError::HungUp);
                    }
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
            drop(rings);
            // The descriptor outlives the wait (the transport holds it).
            let hangup = awaiting.hangup_fd().map(|fd| fd.as_raw_fd());
            let rings = awaiting.rings();
            if sleep_on(&rings, hangup, timeout - elapsed).map_err(VerbsError::Wait)? {
                drop(rings);
                // An answer sent before the hang-up still counts.
                return match awaiting.try_complete()? {
                    true => Ok(()),
                    false => Err(VerbsError::HungUp),
                };
            }
        }
    }
}

/// [`wait_for`] on the answer to `operation`, a request the driver made
/// on the caller's behalf: at most `timeout` ([`VerbsError::ControlTimeout`]),
/// or until the device hangs up ([`VerbsError::DeviceGone`]).
pub(super) fn wait_for_control(
    awaiting: &mut impl Awaiting,
    spin: Duration,
    timeout: Duration,
    operation: pindown_uapi::Opcode,
) -> Result<(), VerbsError> {
    wait_for(awaiting, spin, timeout).map_err(|err| match err {
        VerbsError::Timeout(timeout) => VerbsError::ControlTimeout { operation, timeout },
        VerbsError::HungUp => VerbsError::DeviceGone { operation },
        other => other,
    })
}

/// Polling attempts between two looks at the clock while spinning.
const ATTEMPTS_PER_CLOCK: u32 = 64;

/// How often a spinning wait looks for the device's hang-up.
const HANGUP_LOOK: Duration = Duration::from_millis(1);

/// Whether `fd` polls as hung up now (none: never).
fn hung_up(fd: Option<BorrowedFd<'_>>) -> Result<bool, VerbsError> {
    let Some(fd) = fd else {
        return Ok(false);
    };
    transport::poll_hangup(fd.as_raw_fd(), Some(Duration::ZERO)).map_err(VerbsError::Wait)
}

/// Sleeps until one of the rings' completion eventfds is signalled, the
/// device hangs up (`hangup`: its connection's descriptor; then `true`)
/// or `timeout` passes, and consumes the signals.
fn sleep_on(
    rings: &[&mut CompletionRing],
    hangup: Option<std::os::fd::RawFd>,
    timeout: Duration,
) -> io::Result<bool> {
    let mut fds: Vec<libc::pollfd> = rings
        .iter()
        .map(|ring| libc::pollfd {
            fd: ring.event.fd().as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    if let Some(fd) = hangup {
        fds.push(libc::pollfd {
            fd,
            events: libc::POLLRDHUP,
            revents: 0,
        });
    }
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
    let gone = hangup.is_some() && fds[rings.len()].revents & transport::HANGUP_EVENTS != 0;
    for ring in rings {
        ring.event.take()?;
    }
    Ok(gone)
}
