//! Telling a gone peer from a slow one.
//!
//! A rank that waits on a peer checks, every liveness interval, that the
//! peer is still there: its device reads a word of the peer's memory. The
//! device answers that check with an error once the peer's port has closed
//! (its process ended) or, across hosts, once the peer's node has
//! acknowledged nothing for the fabric's `--peer-timeout`: the device is
//! the authority on whether a peer can be reached.
//!
//! A check that goes unanswered therefore only says something about the
//! rank's own device. Across a lossy or loaded link a check may wait
//! behind megabytes of other ranks' data for seconds while every datagram
//! still gets through, and counting such a peer as gone would end a
//! healthy job. So a check overdue by [`PROBE_PATIENCE`] intervals makes
//! the rank ask its own device a question: a no-op on a queue pair of its
//! own ([`DeviceWatch`]), so that it never waits behind the requests in
//! flight on the data's pair (a pair takes at most 64 fabric requests at
//! once, and its ring is served in order). A device that answered
//! anything within the patience is alive and will fail the check itself
//! if the peer is gone; a device that answers nothing, not even the
//! no-op, for as long is gone or stuck, and so is every peer the rank
//! reaches through it. A device that closed its connection (its process
//! ended) is known gone at the next check, without waiting. And a check
//! unanswered for [`CHECK_BACKSTOP`] counts its peer gone whatever the
//! device answers: the device itself gives up fabric operations that make
//! no progress well before that.

use std::time::{Duration, Instant};

use pindown_driver::verbs::opcode::Nop;
use pindown_driver::verbs::{CompletionQueue, Context, QueuePair};

use crate::error::{Error, Result};

/// The longest liveness interval a configuration may name (an hour):
/// deadlines computed from it stay far from the clock's range.
pub(crate) const MAX_LIVENESS_INTERVAL: Duration = Duration::from_secs(3600);

/// How many liveness intervals a check may go unanswered before the rank
/// asks its device whether it is alive, and how many more that question
/// may go unanswered before the device counts as gone.
pub(crate) const PROBE_PATIENCE: u32 = 10;

/// How long a check may go unanswered however the device answers (at
/// least twice the patience): the device gives up a fabric operation
/// that makes no progress after twice its `--peer-timeout` (6 s by
/// default), so a check older than this waits on something stuck (a
/// queue pair the device stopped, say), not on a slow link.
pub(crate) const CHECK_BACKSTOP: Duration = Duration::from_secs(60);

/// Fails unless `interval` (a `Config::liveness_interval`) is at least a
/// microsecond (a zero interval would declare every peer gone at its
/// first check) and at most [`MAX_LIVENESS_INTERVAL`].
pub(crate) fn check_liveness_interval(interval: Duration) -> Result<()> {
    if interval < Duration::from_micros(1) || interval > MAX_LIVENESS_INTERVAL {
        return Err(Error::InvalidConfig(format!(
            "Config::liveness_interval is {interval:?}: it must lie between 1us and \
             {MAX_LIVENESS_INTERVAL:?}"
        )));
    }
    Ok(())
}

/// Whether the rank's device still answers, asked on a queue pair that
/// carries nothing else; its completions arrive on the rank's completion
/// queue with the user data given at [`new`](Self::new), and every
/// completion the rank reaps is to be reported with
/// [`heard`](Self::heard).
pub(crate) struct DeviceWatch<'c> {
    context: &'c Context,
    pair: QueuePair<'c>,
    user_data: u64,
    patience: Patience,
    /// Reaps that found completions, counted on the hot path (no clock
    /// read there) ...
    answers: u64,
    /// ... and the count the last judgement saw: when it changed, the
    /// device answered since then.
    answers_seen: u64,
}

impl<'c> DeviceWatch<'c> {
    /// A watch over `context`'s device, asking on a queue pair of its own
    /// whose completions arrive on `cq` with `user_data`.
    pub(crate) fn new(
        context: &'c Context,
        cq: &mut CompletionQueue<'c>,
        user_data: u64,
    ) -> Result<Self> {
        Ok(DeviceWatch {
            context,
            pair: context.create_queue_pair(cq)?,
            user_data,
            patience: Patience::new(Instant::now()),
            answers: 0,
            answers_seen: 0,
        })
    }

    /// The device completed a request (any: a completion is an answer).
    /// Counted only: the time is taken when a check is judged (every few
    /// polls of a wait), which is soon enough for a patience of ten
    /// liveness intervals.
    pub(crate) fn heard(&mut self) {
        self.answers = self.answers.wrapping_add(1);
    }

    /// Why no request will complete any more, when the device has closed
    /// the connection (one `poll`, no wait: for each liveness interval,
    /// not each poll of a wait).
    pub(crate) fn closed(&self) -> Result<Option<&'static str>> {
        Ok(self
            .context
            .device_hung_up()?
            .then_some("this rank's device closed its connection (it ended or dropped this rank)"))
    }

    /// Judges a check posted at `check_sent`, still unanswered at `now`,
    /// with checks every `interval`: why the peer counts as gone, when the
    /// device has answered nothing for a patience, not even the question
    /// this asks it (a no-op) once the check is overdue.
    pub(crate) fn silent(
        &mut self,
        check_sent: Instant,
        now: Instant,
        interval: Duration,
    ) -> Result<Option<String>> {
        if self.answers != self.answers_seen {
            self.answers_seen = self.answers;
            self.patience.heard(now);
        }
        match self.patience.judge(check_sent, now, interval) {
            Verdict::Patient => Ok(None),
            Verdict::AskDevice => {
                let nop = Nop::new().build().user_data(self.user_data).signaled();
                self.pair.post(&[nop])?;
                Ok(None)
            }
            Verdict::DeviceSilent(silence) => Ok(Some(format!(
                "this rank's device answered neither a check of it nor a no-op for \
                 {silence:?}: the device is gone or stuck"
            ))),
            Verdict::Unanswered(waited) => Ok(Some(format!(
                "a check of it went unanswered for {waited:?} while this rank's device \
                 answered other requests: its queue pair or the path to it is stuck"
            ))),
        }
    }
}

/// What to make of a check still unanswered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verdict {
    /// Wait on: the check is not overdue, or the device is answering.
    Patient,
    /// Ask the device (a no-op) and report its answer (any completion)
    /// with [`Patience::heard`].
    AskDevice,
    /// The device answered nothing, not even the no-op, for this long.
    DeviceSilent(Duration),
    /// The check went unanswered for this long, past the backstop,
    /// whatever else the device answered.
    Unanswered(Duration),
}

/// When the rank's device last answered, and whether a question to it is
/// out.
#[derive(Clone, Copy, Debug)]
struct Patience {
    heard: Instant,
    asked: Option<Instant>,
}

impl Patience {
    /// A watch that last heard from the device at `now`.
    fn new(now: Instant) -> Self {
        Patience {
            heard: now,
            asked: None,
        }
    }

    /// The device completed a request.
    fn heard(&mut self, now: Instant) {
        self.heard = now;
        self.asked = None;
    }

    /// Judges a check posted at `check_sent`, still unanswered at `now`,
    /// with checks every `interval`.
    fn judge(&mut self, check_sent: Instant, now: Instant, interval: Duration) -> Verdict {
        let patience = interval * PROBE_PATIENCE;
        let since = |then: Instant| now.saturating_duration_since(then);
        if since(check_sent) > CHECK_BACKSTOP.max(2 * patience) {
            return Verdict::Unanswered(since(check_sent));
        }
        if since(check_sent) <= patience || since(self.heard) <= patience {
            return Verdict::Patient;
        }
        match self.asked {
            None => {
                self.asked = Some(now);
                Verdict::AskDevice
            }
            Some(asked) if since(asked) > patience => Verdict::DeviceSilent(since(self.heard)),
            Some(_) => Verdict::Patient,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const INTERVAL: Duration = Duration::from_millis(10);
    const PATIENCE: Duration = Duration::from_millis(100);

    #[test]
    fn a_check_within_its_patience_waits() {
        let start = Instant::now();
        let mut watch = Patience::new(start);
        assert_eq!(
            watch.judge(start, start + PATIENCE, INTERVAL),
            Verdict::Patient
        );
    }

    #[test]
    fn an_overdue_check_asks_the_device_once_and_waits_while_it_answers() {
        let start = Instant::now();
        let mut watch = Patience::new(start);
        let overdue = start + PATIENCE + INTERVAL;
        assert_eq!(watch.judge(start, overdue, INTERVAL), Verdict::AskDevice);
        // The question is out: no second one, no verdict yet.
        assert_eq!(
            watch.judge(start, overdue + INTERVAL, INTERVAL),
            Verdict::Patient
        );
        // The device answers: the check waits on, however old.
        watch.heard(overdue + 2 * INTERVAL);
        let later = overdue + PATIENCE;
        assert_eq!(watch.judge(start, later, INTERVAL), Verdict::Patient);
        // A patience after that answer, it is asked again.
        let much_later = overdue + 2 * INTERVAL + PATIENCE + INTERVAL;
        assert_eq!(watch.judge(start, much_later, INTERVAL), Verdict::AskDevice);
    }

    #[test]
    fn a_device_that_answers_nothing_for_a_patience_after_the_question_is_silent() {
        let start = Instant::now();
        let mut watch = Patience::new(start);
        let asked = start + PATIENCE + INTERVAL;
        assert_eq!(watch.judge(start, asked, INTERVAL), Verdict::AskDevice);
        assert_eq!(
            watch.judge(start, asked + PATIENCE, INTERVAL),
            Verdict::Patient
        );
        let end = asked + PATIENCE + INTERVAL;
        assert_eq!(
            watch.judge(start, end, INTERVAL),
            Verdict::DeviceSilent(end - start)
        );
    }

    #[test]
    fn a_device_heard_recently_excuses_an_old_check_up_to_the_backstop() {
        let start = Instant::now();
        let mut watch = Patience::new(start);
        let now = start + 5 * PATIENCE;
        watch.heard(now - INTERVAL);
        assert_eq!(watch.judge(start, now, INTERVAL), Verdict::Patient);
        let late = start + CHECK_BACKSTOP + INTERVAL;
        watch.heard(late - INTERVAL);
        assert_eq!(
            watch.judge(start, late, INTERVAL),
            Verdict::Unanswered(late - start)
        );
    }
}
