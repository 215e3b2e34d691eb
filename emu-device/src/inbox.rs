//! A port's inbox: frames other ports sent to it, and arrival notices of
//! vector writes into its windows ([`pindown_uapi::Arrival`]), waiting
//! for the port's own connection thread. The one place where two ports'
//! data paths meet, built so that neither waits for the other.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use pindown_uapi::Completion;
use vmm_sys_util::eventfd::EventFd;

use crate::port::PerPair;

/// Frames other ports sent to one port, waiting for that port's own
/// connection thread to put them into its rx ring.
///
/// A sending port never touches the receiving port's state, rings or
/// frontend fds (whose frontend may be stopped, or may never read its call
/// fd): it appends the frame here, under a lock held only for the append,
/// and wakes the receiver through an eventfd of the device's own. So no
/// port ever waits for another port or its frontend.
#[derive(Debug, Default)]
pub struct Inbox {
    state: Mutex<InboxState>,
    pending: AtomicBool,
    notices_pending: AtomicBool,
    completions_pending: AtomicBool,
}

#[derive(Debug, Default)]
struct InboxState {
    frames: VecDeque<Vec<u8>>,
    /// The receiver's wake-up eventfd, while a frontend is connected.
    wake: Option<Arc<EventFd>>,
    /// Arrival completions for the port's admin completion queue.
    notices: VecDeque<Completion>,
    /// Notices promised to transfers under way ([`Inbox::reserve_notice`]).
    reserved: usize,
    /// Completions of requests the fabric link carried out, by queue
    /// pair.
    completions: Vec<VecDeque<LinkCompletion>>,
}

/// The outcome of a request the fabric link carried out.
#[derive(Clone, Copy, Debug)]
pub struct LinkCompletion {
    /// Its completion.
    pub completion: Completion,
    /// Whether the request asked for a completion on success (SIGNALED).
    pub signaled: bool,
    /// Where the request was posted.
    pub at: PostedAt,
}

/// Where a request the fabric link carries out was posted: its queue
/// pair, its position in the pair's send queue, and the send queue's
/// epoch then. A send queue that the frontend resets with requests on
/// the link starts a new epoch (its positions start over, perhaps from the
/// same numbers), and so does each new connection, so a completion of an
/// older epoch is told apart and dropped, never written into the
/// restarted queues.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PostedAt {
    /// The queue pair, where the completion goes.
    pub pair: u16,
    /// The request's position in the pair's send queue, which the
    /// completion carries back (the pair retires it then).
    pub position: u16,
    /// The send queue's epoch when the request was taken.
    pub epoch: u32,
}

/// The current epoch of each RDMA queue pair's send queue of a port, as
/// the pair's service last published it: the fabric link moves no more
/// data for a request of an older epoch (the frontend reset the queue).
#[derive(Debug, Default)]
pub struct PostedEpochs(PerPair<AtomicU32>);

impl PostedEpochs {
    /// A new service of pair `pair`'s send queue (a new connection) starts
    /// a new epoch: requests of an earlier one, on the link, are not its
    /// own. Returns the epoch.
    pub fn begin(&self, pair: u16) -> u32 {
        self.0.of(pair).map_or(0, |epoch| {
            epoch.fetch_add(1, Ordering::AcqRel).wrapping_add(1)
        })
    }

    /// Pair `pair`'s send queue is at `epoch` now.
    pub fn publish(&self, pair: u16, epoch: u32) {
        if let Some(current) = self.0.of(pair) {
            current.store(epoch, Ordering::Release);
        }
    }

    /// Whether a request posted at `at` is of its send queue's current
    /// epoch.
    pub fn current(&self, at: &PostedAt) -> bool {
        self.0
            .of(at.pair)
            .is_some_and(|epoch| epoch.load(Ordering::Acquire) == at.epoch)
    }
}

/// Arrival notices a port holds at most, queued or promised (a vector
/// write with NOTIFY_TARGET beyond it fails: from this node before it
/// moves a byte, from another before its last part lands).
pub const NOTICES_MAX: usize = 4096;

/// Frames an inbox holds; older ones are dropped when it is full.
pub const INBOX_MAX: usize = 256;

/// What [`Inbox::push`] did with a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pushed {
    /// Queued for the receiver.
    Queued,
    /// Queued, and the oldest frame was dropped to make room.
    QueuedDroppingOldest,
    /// Dropped: no frontend is connected.
    Dropped,
}

impl Inbox {
    /// Starts accepting frames (a frontend connected); `wake` is signalled
    /// when frames arrive.
    pub fn open(&self, wake: Arc<EventFd>) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.frames.clear();
        st.wake = Some(wake);
    }

    /// Stops accepting frames and notices and drops those waiting
    /// (disconnect).
    pub fn close(&self) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.frames.clear();
        st.notices.clear();
        st.completions.clear();
        st.reserved = 0;
        st.wake = None;
        self.pending.store(false, Ordering::Release);
        self.notices_pending.store(false, Ordering::Release);
        self.completions_pending.store(false, Ordering::Release);
    }

    /// Promises room for one arrival notice: false when the port holds
    /// [`NOTICES_MAX`] already (queued or promised) or no frontend is
    /// connected. A promise ends with [`deliver_notice`] or
    /// [`release_notice`].
    ///
    /// [`deliver_notice`]: Self::deliver_notice
    /// [`release_notice`]: Self::release_notice
    pub fn reserve_notice(&self) -> bool {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if st.wake.is_none() || st.notices.len() + st.reserved >= NOTICES_MAX {
            return false;
        }
        st.reserved += 1;
        true
    }

    /// Gives back a promise unused (the transfer failed).
    pub fn release_notice(&self) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.reserved = st.reserved.saturating_sub(1);
    }

    /// Queues a promised notice and wakes the receiver (never waits for
    /// it); dropped only when the port's frontend has gone meanwhile.
    pub fn deliver_notice(&self, notice: Completion) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.reserved = st.reserved.saturating_sub(1);
        let Some(wake) = st.wake.clone() else {
            return;
        };
        st.notices.push_back(notice);
        self.notices_pending.store(true, Ordering::Release);
        let _ = wake.write(1);
    }

    /// Queues the outcome of a request that the fabric link carried out
    /// for its queue pair, and wakes the port's thread; dropped when the
    /// port's frontend has gone meanwhile.
    pub fn deliver_completion(&self, done: LinkCompletion) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let Some(wake) = st.wake.clone() else {
            return;
        };
        let pair = usize::from(done.at.pair);
        if st.completions.len() <= pair {
            st.completions.resize_with(pair + 1, VecDeque::new);
        }
        st.completions[pair].push_back(done);
        self.completions_pending.store(true, Ordering::Release);
        let _ = wake.write(1);
    }

    /// Whether completions of the fabric link are waiting (cheap).
    pub fn completions_pending(&self) -> bool {
        self.completions_pending.load(Ordering::Acquire)
    }

    /// Takes the fabric link's completions for queue pair `pair`.
    pub fn take_completions(&self, pair: u16) -> VecDeque<LinkCompletion> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let taken = st
            .completions
            .get_mut(usize::from(pair))
            .map(std::mem::take)
            .unwrap_or_default();
        let left = st.completions.iter().any(|queue| !queue.is_empty());
        self.completions_pending.store(left, Ordering::Release);
        taken
    }

    /// Whether notices are waiting (cheap; for polling passes).
    pub fn notices_pending(&self) -> bool {
        self.notices_pending.load(Ordering::Acquire)
    }

    /// Takes up to `max` waiting notices, oldest first.
    pub fn take_notices(&self, max: usize) -> Vec<Completion> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let count = max.min(st.notices.len());
        let taken: Vec<Completion> = st.notices.drain(..count).collect();
        self.notices_pending
            .store(!st.notices.is_empty(), Ordering::Release);
        taken
    }

    /// Appends a frame and wakes the receiver (never waits for it).
    pub fn push(&self, frame: Vec<u8>) -> Pushed {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let Some(wake) = st.wake.clone() else {
            return Pushed::Dropped;
        };
        let mut pushed = Pushed::Queued;
        if st.frames.len() >= INBOX_MAX {
            st.frames.pop_front();
            pushed = Pushed::QueuedDroppingOldest;
        }
        st.frames.push_back(frame);
        if !self.pending.swap(true, Ordering::AcqRel) {
            // The device's own non-blocking eventfd: a full counter
            // (EAGAIN) already means "wake up".
            let _ = wake.write(1);
        }
        pushed
    }

    /// Wakes the receiver without a frame: its port has something else to
    /// look at (another port found that its memory shrank).
    pub fn nudge(&self) {
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(wake) = &st.wake {
            let _ = wake.write(1);
        }
    }

    /// Whether frames are waiting (cheap; for polling passes).
    pub fn pending(&self) -> bool {
        self.pending.load(Ordering::Acquire)
    }

    /// Takes every waiting frame, oldest first.
    pub fn take(&self) -> VecDeque<Vec<u8>> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        self.pending.store(false, Ordering::Release);
        std::mem::take(&mut st.frames)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_inbox_queues_only_while_open_and_stays_bounded() {
        let inbox = Inbox::default();
        assert_eq!(inbox.push(vec![1]), Pushed::Dropped);
        let wake = Arc::new(EventFd::new(vmm_sys_util::eventfd::EFD_NONBLOCK).unwrap());
        inbox.open(wake.clone());
        for i in 0..INBOX_MAX + 3 {
            let want = if i < INBOX_MAX {
                Pushed::Queued
            } else {
                Pushed::QueuedDroppingOldest
            };
            assert_eq!(inbox.push(vec![i as u8]), want);
        }
        // One wake-up for the whole batch.
        assert_eq!(wake.read().unwrap(), 1);
        assert!(inbox.pending());
        let frames = inbox.take();
        assert!(!inbox.pending());
        assert_eq!(frames.len(), INBOX_MAX);
        assert_eq!(frames[0], vec![3u8]);
        inbox.push(vec![9]);
        inbox.close();
        assert!(!inbox.pending());
        assert!(inbox.take().is_empty());
        assert_eq!(inbox.push(vec![1]), Pushed::Dropped);
    }
}
