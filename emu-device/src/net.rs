//! The Ethernet switch between ports: frames sent on a port's tx rings are
//! delivered to the rx ring 0 of the port owning the destination MAC
//! (learnt from source addresses); broadcast, multicast and unknown
//! unicast go to every other connected port.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use vmm_sys_util::eventfd::EventFd;

/// Size of the virtio-net header with VERSION_1 (`num_buffers` included).
pub const NET_HDR_LEN: usize = 12;

/// Smallest frame accepted: an Ethernet header.
pub const ETH_HDR_LEN: usize = 14;

/// Largest tx chain accepted (header + 64 KiB frame).
pub const MAX_TX_CHAIN: usize = NET_HDR_LEN + 65_536;

/// The MAC learning table.
#[derive(Debug, Default)]
pub struct Switch {
    table: Mutex<HashMap<[u8; 6], usize>>,
}

/// Destination MAC of a frame (without virtio-net header).
pub fn dst_mac(frame: &[u8]) -> Option<[u8; 6]> {
    frame.get(0..6)?.try_into().ok()
}

/// Source MAC of a frame (without virtio-net header).
pub fn src_mac(frame: &[u8]) -> Option<[u8; 6]> {
    frame.get(6..12)?.try_into().ok()
}

/// Whether a MAC is a group (broadcast or multicast) address.
pub fn is_group(mac: &[u8; 6]) -> bool {
    mac[0] & 1 != 0
}

impl Switch {
    /// Records that `mac` lives behind `port`.
    pub fn learn(&self, mac: [u8; 6], port: usize) {
        if is_group(&mac) || mac == [0; 6] {
            return;
        }
        let mut t = self.table.lock().unwrap_or_else(|e| e.into_inner());
        t.insert(mac, port);
    }

    /// Forgets every MAC learnt on `port` (on disconnect).
    pub fn forget_port(&self, port: usize) {
        let mut t = self.table.lock().unwrap_or_else(|e| e.into_inner());
        t.retain(|_, p| *p != port);
    }

    /// Port owning `mac`, if known.
    pub fn lookup(&self, mac: &[u8; 6]) -> Option<usize> {
        let t = self.table.lock().unwrap_or_else(|e| e.into_inner());
        t.get(mac).copied()
    }

    /// Learns the source of `frame` (sent by `from`) and returns the ports
    /// it goes to, chosen among `ports` (the connected ones).
    pub fn route(&self, from: usize, frame: &[u8], ports: &[usize]) -> Vec<usize> {
        let (Some(dst), Some(src)) = (dst_mac(frame), src_mac(frame)) else {
            return Vec::new();
        };
        self.learn(src, from);
        if !is_group(&dst) {
            if let Some(p) = self.lookup(&dst) {
                return if p == from || !ports.contains(&p) {
                    Vec::new()
                } else {
                    vec![p]
                };
            }
        }
        ports.iter().copied().filter(|p| *p != from).collect()
    }
}

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
}

#[derive(Debug, Default)]
struct InboxState {
    frames: VecDeque<Vec<u8>>,
    /// The receiver's wake-up eventfd, while a frontend is connected.
    wake: Option<Arc<EventFd>>,
}

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

    /// Stops accepting frames and drops those waiting (disconnect).
    pub fn close(&self) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.frames.clear();
        st.wake = None;
        self.pending.store(false, Ordering::Release);
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

/// The virtio-net header put in front of received frames: no offloads,
/// one buffer.
pub fn rx_header() -> [u8; NET_HDR_LEN] {
    let mut h = [0u8; NET_HDR_LEN];
    h[10..12].copy_from_slice(&1u16.to_le_bytes());
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(dst: [u8; 6], src: [u8; 6]) -> Vec<u8> {
        let mut f = dst.to_vec();
        f.extend_from_slice(&src);
        f.extend_from_slice(&[0x08, 0x00, 1, 2, 3]);
        f
    }

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

    #[test]
    fn learns_and_routes() {
        let s = Switch::default();
        let a = [2, 0, 0, 0, 0, 1];
        let b = [2, 0, 0, 0, 0, 2];
        let ports = [0, 1, 2];
        // Unknown unicast floods.
        assert_eq!(s.route(0, &frame(b, a), &ports), vec![1, 2]);
        // a was learnt on port 0.
        assert_eq!(s.route(1, &frame(a, b), &ports), vec![0]);
        assert_eq!(s.route(2, &frame(b, [2, 0, 0, 0, 0, 3]), &ports), vec![1]);
        // Broadcast to all others.
        assert_eq!(s.route(1, &frame([0xff; 6], b), &ports), vec![0, 2]);
        // Never back to the sender.
        assert_eq!(s.route(0, &frame(a, a), &ports), Vec::<usize>::new());
        s.forget_port(0);
        assert_eq!(s.lookup(&a), None);
        // Runt frames go nowhere.
        assert!(s.route(0, &[1, 2, 3], &ports).is_empty());
    }
}
