//! Waiting for completions: poll for a while after activity, then sleep on
//! the completion rings' eventfds.

use std::io;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

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
/// (at most `timeout`) in a busy loop, then, with the rings' notifications
/// enabled, asleep on their eventfds until one is signalled, and so on
/// until `timeout` has passed (then [`VerbsError::Timeout`]).
pub(super) fn wait_for(
    awaiting: &mut impl Awaiting,
    spin: Duration,
    timeout: Duration,
) -> Result<(), VerbsError> {
    let start = Instant::now();
    loop {
        let spin_until = Instant::now() + spin.min(timeout);
        loop {
            if awaiting.try_complete()? {
                return Ok(());
            }
            if Instant::now() >= spin_until {
                break;
            }
            std::hint::spin_loop();
        }
        let elapsed = start.elapsed();
        if elapsed >= timeout {
            return Err(VerbsError::Timeout(timeout));
        }
        let mut rings = awaiting.rings();
        // Every ring is armed (no short cut): one that is already pending
        // only makes the sleep be skipped.
        let pending = rings.iter_mut().fold(false, |pending, ring| {
            ring.queue.enable_interrupts() | pending
        });
        if !pending {
            sleep_on(&rings, timeout - elapsed).map_err(VerbsError::Wait)?;
        }
        for ring in rings {
            ring.queue.disable_interrupts();
        }
    }
}

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
