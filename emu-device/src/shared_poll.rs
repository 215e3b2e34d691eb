//! One thread polls the RDMA send queues of every busy port, so that N
//! connected ports keep one core spinning, not N.
//!
//! Each port has a thread of its own (see [`crate::connection`]), which
//! after work polls its send queues for a while. Two ranks exchanging
//! messages through two ports of one device then keep four threads
//! spinning (two ranks, two ports), and on a machine with fewer cores every
//! message waits for the scheduler to hand a core from one to the next. A
//! shared poller, as a DPDK or SPDK reactor serves many queues from one
//! core, removes half of those threads:
//!
//! - The first port thread that polls becomes the *poller* and, between
//!   polls of its own send queues, serves those of the *delegated* ports.
//! - A port thread that would poll while another thread is the poller
//!   *delegates* instead: it marks its port delegated and sleeps on its
//!   socket, inbox and stop signal without asking the driver for kicks, so
//!   its driver posts without a system call and the poller takes the
//!   requests.
//! - The poller hands a port back (clears the mark and wakes its thread)
//!   when the port needs its own thread: a transfer longer than one turn
//!   (it runs on its own core, in parallel with the poller's), an IOTLB
//!   miss to send, a ring stopped; and when one thread no longer keeps up:
//!   over a stretch of polls (see [`Load`]), most found work, from two
//!   ports or more. When the poller itself stops polling
//!   (its traffic ended, its frontend left) it hands back every delegated
//!   port; their threads ask for kicks again, or one of them polls next.
//!
//! Isolation is kept: the poller only ever *tries* the locks of a
//! delegated port (a port busy with its frontend is skipped on that
//! pass), never touches a delegated port's socket, and serves a request
//! through the same [`SendQueue`](crate::send_queue::SendQueue) and
//! access gates as the port's own thread would.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::connection::Context;
use crate::port::{Port, PortStats};

/// Who polls for whom, device-wide.
#[derive(Debug)]
pub struct SharedPoll {
    /// Whether ports share a poller at all (`--solo-polling` turns it off).
    enabled: bool,
    /// The poller and the ports delegated to it.
    roles: Mutex<Roles>,
    /// Changes whenever the set of delegated ports does.
    version: AtomicU64,
    /// Passes of the poller over the delegated ports (a delegated port's
    /// thread takes its port back if this stands still).
    passes: AtomicU64,
    /// The index of the polling port plus one (0: none), for a look
    /// without the lock.
    poller_hint: std::sync::atomic::AtomicUsize,
}

#[derive(Debug, Default)]
struct Roles {
    /// The index of the port whose thread polls for the others.
    poller: Option<usize>,
    /// The ports whose threads sleep while the poller serves them.
    delegated: Vec<Arc<Port>>,
}

/// What the poller knows of the delegated ports (a copy, refreshed when
/// the set changes, so that a poll takes no lock but the ports' own).
#[derive(Debug, Default)]
pub struct Delegated {
    version: u64,
    ports: Vec<Arc<Port>>,
}

/// What a port thread about to poll does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Polls its own send queues (shared polling is off).
    Solo,
    /// Polls its own send queues and the delegated ports'.
    Poller,
    /// Sleeps: the poller serves its send queues.
    Delegate,
}

impl SharedPoll {
    /// No poller yet; `enabled` says whether ports share one at all.
    pub fn new(enabled: bool) -> SharedPoll {
        SharedPoll {
            enabled,
            roles: Mutex::new(Roles::default()),
            version: AtomicU64::new(0),
            passes: AtomicU64::new(0),
            poller_hint: std::sync::atomic::AtomicUsize::new(0),
        }
    }

    /// Whether `port`'s thread is the poller (a look without the lock).
    pub fn is_poller(&self, port: &Port) -> bool {
        self.enabled && self.poller_hint.load(Ordering::Acquire) == port.index + 1
    }

    /// The poller's passes over the delegated ports so far.
    pub fn passes(&self) -> u64 {
        self.passes.load(Ordering::Acquire)
    }

    /// The role of `port`'s thread, which is about to poll with its own
    /// send queues idle: the poller if there is none yet (or it is), else
    /// a delegate, whose port is marked delegated before this returns.
    pub fn take_role(&self, port: &Arc<Port>) -> Role {
        if !self.enabled {
            return Role::Solo;
        }
        let mut roles = self.roles.lock();
        match roles.poller {
            None => {
                roles.poller = Some(port.index);
                self.poller_hint.store(port.index + 1, Ordering::Release);
                Role::Poller
            }
            Some(poller) if poller == port.index => Role::Poller,
            Some(_) => {
                if !port.delegated.swap(true, Ordering::AcqRel) {
                    roles.delegated.push(Arc::clone(port));
                    self.version.fetch_add(1, Ordering::Release);
                }
                Role::Delegate
            }
        }
    }

    /// `port`'s thread stops polling (its traffic ended, or its frontend
    /// left): if it was the poller, every delegated port is handed back.
    pub fn stop_polling(&self, port: &Port) {
        if !self.enabled || self.poller_hint.load(Ordering::Acquire) != port.index + 1 {
            return;
        }
        let mut roles = self.roles.lock();
        if roles.poller != Some(port.index) {
            return;
        }
        roles.poller = None;
        self.poller_hint.store(0, Ordering::Release);
        let handed_back = std::mem::take(&mut roles.delegated);
        self.version.fetch_add(1, Ordering::Release);
        drop(roles);
        for port in handed_back {
            wake_to_serve_itself(&port);
        }
    }

    /// `port` needs its own thread again (or its frontend left): it is no
    /// longer delegated, and its thread is woken.
    pub fn hand_back(&self, port: &Port) {
        let mut roles = self.roles.lock();
        let before = roles.delegated.len();
        roles.delegated.retain(|p| p.index != port.index);
        if roles.delegated.len() != before {
            self.version.fetch_add(1, Ordering::Release);
        }
        drop(roles);
        wake_to_serve_itself(port);
    }

    /// The poller's pass over the delegated ports: one turn of each of
    /// their send queues, handing back a port that needs its own thread.
    /// Returns the ports that did work, for the poller's [`Load`].
    pub fn serve_delegated(&self, ctx: Context<'_>, known: &mut Delegated, load: &mut Load) {
        let version = self.version.load(Ordering::Acquire);
        if version != known.version {
            let roles = self.roles.lock();
            known.ports.clone_from(&roles.delegated);
            known.version = self.version.load(Ordering::Acquire);
        }
        self.passes.fetch_add(1, Ordering::Release);
        for port in &known.ports {
            // A panic serving another port's requests must not end the
            // poller's connection: that port goes back to its own thread.
            let turn =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| serve_turn(ctx, port)))
                    .unwrap_or_else(|_| {
                        tracing::error!(port = port.index, "serving its send queues panicked");
                        Turn::HandBack { worked: false }
                    });
            match turn {
                Turn::Idle => {}
                Turn::Worked => load.delegate_worked(port),
                Turn::HandBack { worked } => {
                    if worked {
                        load.delegate_worked(port);
                    }
                    self.hand_back(port);
                }
            }
        }
    }
}

/// Polls in one stretch of the poller's [`Load`].
pub const LOAD_STRETCH: u32 = 32;

/// What the poller's polls found over the current stretch of
/// [`LOAD_STRETCH`] polls: when most found work from two ports or more,
/// one thread no longer keeps up, and a delegated port that worked goes
/// back to its own thread (which then polls it on a core of its own).
/// One port busy alone stays where it is: a thread of its own would
/// only add a spinning thread.
#[derive(Debug, Default)]
pub struct Load {
    polls: u32,
    busy_polls: u32,
    /// The current poll found work.
    busy: bool,
    /// The poller's own send queues worked in this stretch.
    own_worked: bool,
    /// A delegated port that worked in this stretch, and whether another
    /// one did too.
    delegate: Option<Arc<Port>>,
    other_delegate: bool,
}

impl Load {
    /// The poller's own send queues did work in this poll.
    pub fn own_worked(&mut self) {
        self.busy = true;
        self.own_worked = true;
    }

    fn delegate_worked(&mut self, port: &Arc<Port>) {
        self.busy = true;
        match &self.delegate {
            Some(known) if known.index != port.index => self.other_delegate = true,
            Some(_) => {}
            None => self.delegate = Some(Arc::clone(port)),
        }
    }

    /// Whether the current poll found work.
    pub fn busy(&self) -> bool {
        self.busy
    }

    /// Ends a poll; at the end of a stretch, hands back a delegated port
    /// if one thread did not keep up.
    pub fn end_poll(&mut self, shared: &SharedPoll) {
        self.busy_polls += u32::from(self.busy);
        self.busy = false;
        self.polls += 1;
        if self.polls < LOAD_STRETCH {
            return;
        }
        let ports_that_worked = u32::from(self.own_worked)
            + u32::from(self.delegate.is_some())
            + u32::from(self.other_delegate);
        if ports_that_worked >= 2 && self.busy_polls * 4 >= LOAD_STRETCH * 3 {
            if let Some(port) = &self.delegate {
                PortStats::bump(&port.stats.rdma_handed_back_busy);
                shared.hand_back(port);
            }
        }
        *self = Load::default();
    }
}

/// Clears `port`'s mark and wakes its thread, which then serves its send
/// queues itself (and asks for kicks before it sleeps again).
fn wake_to_serve_itself(port: &Port) {
    port.handed_back.store(true, Ordering::Release);
    port.delegated.store(false, Ordering::Release);
    port.inbox.nudge();
}

/// What the poller's turn on one delegated port did.
enum Turn {
    Idle,
    Worked,
    /// The port needs its own thread.
    HandBack {
        worked: bool,
    },
}

/// One turn of each active send queue of the delegated `port`, if its
/// locks are free.
fn serve_turn(ctx: Context<'_>, port: &Port) -> Turn {
    if !port.delegated.load(Ordering::Acquire) {
        return Turn::Idle;
    }
    let Some(mut send_queues) = port.try_send_queues() else {
        return Turn::Idle;
    };
    let Some(mut state) = port.try_lock() else {
        return Turn::Idle;
    };
    let mut worked = false;
    let mut own_thread_needed = false;
    for send_queue in send_queues.iter_mut() {
        let ring = send_queue.rings_of(&state).0;
        if !state.vrings[ring].active() {
            continue;
        }
        let served = send_queue.serve(&mut state, ctx.ports, ctx.link);
        worked |= served.worked;
        own_thread_needed |=
            served.more || state.vrings[ring].waiting_iotlb || !state.vrings[ring].active();
    }
    if worked {
        PortStats::bump(&port.stats.rdma_turns_by_poller);
    }
    if own_thread_needed {
        Turn::HandBack { worked }
    } else if worked {
        Turn::Worked
    } else {
        Turn::Idle
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DeviceConfig;

    /// A shared poll whose poller is port 0 and port 1 delegated to it.
    fn poller_and_delegate() -> (SharedPoll, Arc<Port>, Arc<Port>) {
        let config = DeviceConfig::default();
        let poller = Arc::new(Port::new(0, 0, [0; 6], &config));
        let delegate = Arc::new(Port::new(1, 1, [0; 6], &config));
        let shared = SharedPoll::new(true);
        assert_eq!(shared.take_role(&poller), Role::Poller);
        assert_eq!(shared.take_role(&delegate), Role::Delegate);
        assert!(delegate.delegated.load(Ordering::Acquire));
        (shared, poller, delegate)
    }

    /// Runs one stretch of polls: poll `i` finds the poller's own work if
    /// `own(i)`, the delegate's if `theirs(i)`.
    fn stretch(
        shared: &SharedPoll,
        delegate: &Arc<Port>,
        own: impl Fn(u32) -> bool,
        theirs: impl Fn(u32) -> bool,
    ) {
        let mut load = Load::default();
        for i in 0..LOAD_STRETCH {
            if own(i) {
                load.own_worked();
            }
            if theirs(i) {
                load.delegate_worked(delegate);
            }
            load.end_poll(shared);
        }
    }

    fn handed_back(delegate: &Port) -> bool {
        !delegate.delegated.load(Ordering::Acquire)
            && delegate.handed_back.load(Ordering::Acquire)
            && delegate.stats.rdma_handed_back_busy.load(Ordering::Relaxed) == 1
    }

    #[test]
    fn a_poller_busy_with_two_ports_hands_the_delegate_back() {
        let (shared, _poller, delegate) = poller_and_delegate();
        stretch(&shared, &delegate, |i| i % 2 == 0, |i| i % 2 == 1);
        assert!(handed_back(&delegate));
    }

    #[test]
    fn a_poller_busy_with_one_port_keeps_it() {
        let (shared, _poller, delegate) = poller_and_delegate();
        stretch(&shared, &delegate, |_| false, |_| true);
        assert!(delegate.delegated.load(Ordering::Acquire));
        stretch(&shared, &delegate, |_| true, |_| false);
        assert!(delegate.delegated.load(Ordering::Acquire));
    }

    #[test]
    fn a_poller_idle_in_more_than_a_quarter_of_its_polls_keeps_its_delegates() {
        let (shared, _poller, delegate) = poller_and_delegate();
        // 23 busy polls of 32: under three in four.
        stretch(&shared, &delegate, |i| i < 12, |i| (12..23).contains(&i));
        assert!(delegate.delegated.load(Ordering::Acquire));
        // 24: at three in four.
        stretch(&shared, &delegate, |i| i < 12, |i| (12..24).contains(&i));
        assert!(handed_back(&delegate));
    }

    #[test]
    fn a_poller_that_stops_hands_back_every_delegate_and_the_next_polls() {
        let (shared, poller, delegate) = poller_and_delegate();
        shared.stop_polling(&poller);
        assert!(!delegate.delegated.load(Ordering::Acquire));
        assert!(delegate.handed_back.load(Ordering::Acquire));
        assert_eq!(shared.take_role(&delegate), Role::Poller);
        assert!(shared.is_poller(&delegate) && !shared.is_poller(&poller));
    }
}
