//! One frontend connection: the thread that serves a port while its
//! frontend is connected. It waits (epoll) on the vhost-user socket, the
//! kick eventfds of the port's rings, the port's inbox and the device's
//! stop signal; applies each request through [`vhost_user`], moves frames
//! through the [`switch`], serves each RDMA queue pair through a
//! [`SendQueue`] of its own, and sends the port's IOTLB misses. When the frontend
//! leaves (or misbehaves, or the device stops) it resets the port for the
//! next frontend.
//!
//! Isolation between ports: a port's connection thread is the only one
//! that touches its frontend's socket, kick and error fds (the shared
//! poller, serving a delegated port's send queues, may signal its
//! completion queue's call fd, which never blocks; see
//! [`shared_poll`](crate::shared_poll)), and it never waits for that
//! frontend while holding anything another port can wait for, nor while it
//! polls for other ports. Frames switched from another port go through the receiving
//! port's [`Inbox`](crate::inbox::Inbox). Frontend fds are read and written
//! without blocking ([`RingFd`](crate::queues::RingFd)); a kick fd that hangs
//! up stops its ring instead of waking the thread forever.

use std::collections::HashSet;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::port::{Port, PortState, PortStats, PortTable};
use crate::queues::KickRead;
use crate::send_queue::SendQueue;
use crate::shared_poll::{Delegated, Load, Role, SharedPoll};
use crate::switch::{self, Switch};
use crate::vhost_user::{self, conn, handler};
use crate::DeviceConfig;
use pindown_uapi::core_sharing::CoreSharing;

const TOKEN_SOCKET: u64 = 0;
const TOKEN_SHUTDOWN: u64 = u64::MAX;
const TOKEN_INBOX: u64 = u64::MAX - 1;

/// How long the device waits for the rest of a started vhost-user message,
/// or for the frontend to take a reply, before it drops the connection.
const FRONTEND_IO_TIMEOUT: Duration = Duration::from_secs(10);

/// The device's stop signal, which every connection thread watches.
#[derive(Debug)]
pub struct Stop {
    fd: EventFd,
    requested: AtomicBool,
}

impl Stop {
    /// Not requested yet.
    pub fn new() -> io::Result<Stop> {
        Ok(Stop {
            fd: EventFd::new(EFD_NONBLOCK)?,
            requested: AtomicBool::new(false),
        })
    }

    /// Asks every connection thread to stop (and wakes them).
    pub fn request(&self) {
        self.requested.store(true, Ordering::Release);
        let _ = self.fd.write(1);
    }

    /// Whether a stop was asked for.
    pub fn requested(&self) -> bool {
        self.requested.load(Ordering::Acquire)
    }
}

/// What a connection thread reaches of the device.
#[derive(Debug, Clone, Copy)]
pub struct Context<'a> {
    /// Configuration.
    pub config: &'a DeviceConfig,
    /// All ports (the RDMA fabric and the switch reach peers here).
    pub ports: &'a PortTable,
    /// The MAC learning switch.
    pub switch: &'a Switch,
    /// The device's stop signal.
    pub stop: &'a Stop,
    /// The link to the other nodes of the fabric, if the device has one.
    pub link: Option<&'a crate::internode::Link>,
    /// Which port thread polls the RDMA send queues of the others.
    pub shared_poll: &'a SharedPoll,
}

/// Serves one frontend connection on `port` until it closes, misbehaves
/// or the device stops. The caller then resets the port (see
/// [`reset_port`]), however this ends, a panic included, and only then
/// closes `stream`: the frontend takes the closed connection as the
/// device's word that its memory is no longer touched.
pub fn serve(ctx: Context<'_>, port: Arc<Port>, stream: &mut UnixStream) {
    let index = port.index;
    tracing::info!(port = index, "frontend connected");
    ctx.switch.learn(port.mac, switch::Station::Port(index));
    *port.send_queues() = (0..ctx.config.rdma_queue_pairs)
        .map(|pair| SendQueue::new(Arc::clone(&port), pair))
        .collect();
    if let Err(e) = run(ctx, &port, stream) {
        tracing::info!(port = index, "connection ends: {e}");
    }
}

/// Resets a port whose connection ended (or never started) and frees it
/// for the next frontend: once no access to its memory is in flight, its
/// memory and windows are gone; frames for it are dropped. The caller
/// then frees the connection slot and says the port is disconnected.
pub fn reset_port(ctx: Context<'_>, port: &Port) {
    // Whatever this port's thread polled for others, and whatever was
    // polled for it, ends here; its queue pairs' services go (they hold
    // the port).
    ctx.shared_poll.stop_polling(port);
    ctx.shared_poll.hand_back(port);
    port.handed_back.store(false, Ordering::Release);
    port.send_queues().clear();
    port.inbox.close();
    port.shared.reset();
    *port.lock() = PortState::new(port.index, port.mac, ctx.config, port.shared.clone());
    ctx.switch.forget_port(port.index);
}

/// Moves the frames of the port's inbox into rx ring 0 (see
/// [`switch::receive`]) and asks the frontend for what missed. Returns
/// whether a frame was delivered.
fn receive_frames(port: &Port) -> bool {
    let frames = port.inbox.take();
    if frames.is_empty() {
        return false;
    }
    let mut st = port.lock();
    let delivered = switch::receive(&mut st, &port.stats, frames);
    vhost_user::send_misses(&st, &port.stats);
    delivered
}

/// What processing a ring did.
#[derive(Debug, Default, Clone, Copy)]
struct Work {
    /// Work is left (budget exhausted).
    more: bool,
    /// Something was done (frames taken, RDMA requests or completions served).
    done: bool,
}

/// Processes ring `i` of `port` (`kicked`: the driver kicked it, as
/// opposed to a poll).
fn process_ring(ctx: Context<'_>, port: &Port, i: usize, kicked: bool) -> Work {
    let mut frames = Vec::new();
    let mut work = Work::default();
    {
        // The queue pairs' services are locked (before the state) only
        // for an RDMA ring: net traffic leaves them to the shared poller.
        let rdma = port.lock().rdma_ring(i).is_some();
        let mut send_queues = rdma.then(|| port.send_queues());
        let mut st = port.lock();
        let net_rings = 2 * usize::from(st.queue_pairs);
        if let Some(ring) = st.rdma_ring(i).filter(|_| rdma) {
            let send_queue = send_queues
                .as_mut()
                .and_then(|queues| queues.get_mut(usize::from(ring.pair())));
            if let (true, Some(send_queue)) = (st.vrings[i].active(), send_queue) {
                if kicked && matches!(ring, pindown_uapi::RdmaRing::Send(_)) {
                    PortStats::bump(&port.stats.rdma_kicks);
                    work.done = true;
                }
                let served = send_queue.serve(&mut st, ctx.ports, ctx.link);
                work.done |= served.worked;
                work.more |= served.more;
            }
        } else if i < net_rings && i % 2 == 1 {
            work.more = switch::collect_tx(&mut st, &port.stats, i, &mut frames);
        } else if i == 0 {
            // An rx kick (new buffers) or a retry after an IOTLB update.
            work.done |= switch::flush_rx(&mut st, &port.stats);
        }
        vhost_user::send_misses(&st, &port.stats);
    }
    work.done |= !frames.is_empty();
    for f in frames {
        ctx.switch
            .forward(ctx.ports, switch::Station::Port(port.index), &f, ctx.link);
    }
    work
}

/// The epoll registration of one ring's kick fd. It holds a duplicate of
/// the fd: the frontend keeps the file open after the device replaces or
/// drops the ring's own descriptor, so the registration must be removed
/// through a descriptor that is still open, or it would keep reporting.
/// Its epoll token carries a generation, so that events of a registration
/// already replaced (reported in the same batch) are recognised and ignored.
struct KickRegistration {
    ring: usize,
    token: u64,
    fd: File,
}

/// The epoll token of ring `ring`'s kick in registration generation `generation`.
fn kick_token(generation: u32, ring: usize) -> u64 {
    (u64::from(generation) << 32) | (ring as u64 + 1)
}

fn unregister_kick(epoll: &Epoll, reg: KickRegistration) {
    let _ = epoll.ctl(
        ControlOperation::Delete,
        reg.fd.as_raw_fd(),
        EpollEvent::default(),
    );
}

fn sync_kicks(
    epoll: &Epoll,
    port: &Port,
    registered: &mut Vec<KickRegistration>,
    generation: &mut u32,
) {
    for reg in registered.drain(..) {
        unregister_kick(epoll, reg);
    }
    *generation = generation.wrapping_add(1) % (u32::MAX - 1);
    let st = port.lock();
    for r in &st.vrings {
        let Some(kick) = r.kick.as_ref().filter(|_| r.started) else {
            continue;
        };
        let fd = match kick.try_clone() {
            Ok(fd) => fd,
            Err(e) => {
                tracing::warn!(
                    port = port.index,
                    ring = r.index,
                    "cannot watch the kick fd: {e}"
                );
                continue;
            }
        };
        let token = kick_token(*generation, r.index);
        let ev = EpollEvent::new(EventSet::IN | EventSet::READ_HANG_UP, token);
        match epoll.ctl(ControlOperation::Add, fd.as_raw_fd(), ev) {
            Ok(()) => registered.push(KickRegistration {
                ring: r.index,
                token,
                fd,
            }),
            // A file epoll cannot watch (a regular file): the ring is only
            // served when the port polls.
            Err(e) => tracing::warn!(
                port = port.index,
                ring = r.index,
                "the kick fd cannot be watched ({e}): the ring is served only when polled"
            ),
        }
    }
}

fn run(ctx: Context<'_>, port: &Arc<Port>, stream: &mut UnixStream) -> Result<(), String> {
    stream
        .set_read_timeout(Some(FRONTEND_IO_TIMEOUT))
        .map_err(|e| e.to_string())?;
    stream
        .set_write_timeout(Some(FRONTEND_IO_TIMEOUT))
        .map_err(|e| e.to_string())?;
    let epoll = Epoll::new().map_err(|e| e.to_string())?;
    let wake = Arc::new(EventFd::new(EFD_NONBLOCK).map_err(|e| e.to_string())?);
    epoll
        .ctl(
            ControlOperation::Add,
            wake.as_raw_fd(),
            EpollEvent::new(EventSet::IN, TOKEN_INBOX),
        )
        .map_err(|e| e.to_string())?;
    port.inbox.open(wake.clone());
    epoll
        .ctl(
            ControlOperation::Add,
            stream.as_raw_fd(),
            EpollEvent::new(EventSet::IN | EventSet::HANG_UP, TOKEN_SOCKET),
        )
        .map_err(|e| e.to_string())?;
    epoll
        .ctl(
            ControlOperation::Add,
            ctx.stop.fd.as_raw_fd(),
            EpollEvent::new(EventSet::IN, TOKEN_SHUTDOWN),
        )
        .map_err(|e| e.to_string())?;
    let layout = port.lock().layout();
    let mut registered = Vec::new();
    let mut generation = 0u32;
    let mut events = vec![EpollEvent::default(); 64];
    let mut again: HashSet<usize> = HashSet::new();
    let poll = ctx.config.poll;
    // Adaptive polling: after work, keep polling the rings for a short
    // while before sleeping on the kicks again (a cross-core eventfd wake-up
    // costs far more than a short spin).
    let spin = Duration::from_micros(ctx.config.spin_us);
    let mut last_work: Option<Instant> = None;
    let mut rings: HashSet<usize> = HashSet::new();
    let mut kicked: HashSet<usize> = HashSet::new();
    let mut looked = Instant::now();
    let mut swept = Instant::now();
    let mut sharing = CoreSharing::new();
    let mut delegated_ports = Delegated::default();
    let mut load = Load::default();
    // The shared poller's passes when this thread last slept delegated.
    let mut poller_passes = 0;
    loop {
        if ctx.stop.requested() {
            return Err("device shutting down".into());
        }
        let waiting = {
            let st = port.lock();
            // The frontend shrank a file of its memory table under the
            // device (the SIGBUS guard replaced the lost pages with zeros):
            // stop using that memory, end the connection, reset the port.
            if let Some(region) = st.table.as_ref().and_then(|t| t.poisoned_region()) {
                tracing::warn!(
                    port = port.index,
                    region,
                    "frontend memory shrank under the device: stopping the rings, resetting the port"
                );
                return Err(format!("memory region {region} shrank under the device"));
            }
            st.vrings.iter().any(|r| r.waiting_iotlb)
        };
        let now = Instant::now();
        if port.handed_back.swap(false, Ordering::AcqRel) {
            // Handed back by the shared poller (perhaps mid-transfer):
            // serve everything, then poll as after work.
            last_work = Some(now);
            again.extend(
                port.lock()
                    .vrings
                    .iter()
                    .filter(|r| r.active())
                    .map(|r| r.index),
            );
        }
        let delegated = port.delegated.load(Ordering::Acquire);
        let spinning = !delegated && last_work.is_some_and(|t| now.duration_since(t) < spin);
        // Busy-poll mode polls while traffic flows; a port idle for
        // POLL_IDLE sleeps on its kicks like an event-driven one, so that
        // idle ports leave the cores to the busy ones.
        let polling =
            poll && !delegated && last_work.is_some_and(|t| now.duration_since(t) < POLL_IDLE);
        let mut timeout = if polling || spinning || !again.is_empty() {
            0
        } else if waiting {
            50
        } else {
            -1
        };
        if timeout != 0 {
            // This thread sleeps: the ports it polled for go back to
            // their own threads, and the fabric link to its own.
            ctx.shared_poll.stop_polling(port);
            if let Some(link) = ctx.link {
                link.stop_driving(port.index);
            }
        } else if !again.is_empty() && ctx.shared_poll.is_poller(port) {
            // Work of its own first (a turn at a time): the delegated
            // ports are served between its turns.
            load.own_worked();
            ctx.shared_poll
                .serve_delegated(ctx, &mut delegated_ports, &mut load);
            load.end_poll(ctx.shared_poll);
        }
        if delegated && timeout != 0 {
            // Asleep while delegated, the port asks for no kick: its
            // driver posts without a system call and the shared poller
            // serves it (and wakes this thread to hand it back). The
            // thread still looks now and then that the poller makes
            // progress, and takes its port back if it does not.
            if !(0..=DELEGATED_LOOK_MS).contains(&timeout) {
                timeout = DELEGATED_LOOK_MS;
            }
            let passes = ctx.shared_poll.passes();
            if passes == poller_passes {
                ctx.shared_poll.hand_back(port);
                continue;
            }
            poller_passes = passes;
        }
        if timeout != 0 && !delegated {
            let mut send_queues = port.send_queues();
            let mut st = port.lock();
            for send_queue in send_queues.iter_mut() {
                if send_queue.arm(&mut st) {
                    // A request came in while the doorbell was being armed.
                    timeout = 0;
                    again.insert(send_queue.rings_of(&st).0);
                }
            }
        }
        // While polling, every ring is looked at on every pass anyway: ask
        // the kernel about the socket and the kicks only every
        // LOOK_INTERVAL. Not while work is left over from the last pass (a
        // transfer between two turns): its frontend is answered between
        // turns.
        let look = timeout != 0 || !again.is_empty() || now.duration_since(looked) >= LOOK_INTERVAL;
        let n = if !look {
            0
        } else {
            looked = now;
            match epoll.wait(timeout, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => 0,
                Err(e) => return Err(e.to_string()),
            }
        };

        rings.clear();
        rings.extend(again.drain());
        kicked.clear();
        // A polling port passes over all its rings every LOOK_INTERVAL;
        // in between (a transfer going on in turns), only over the rings
        // with work left and those kicked.
        let sweep = (polling || spinning) && now.duration_since(swept) >= LOOK_INTERVAL;
        if sweep {
            swept = now;
        }
        let mut all = sweep || (n == 0 && waiting);
        for ev in &events[..n] {
            match ev.data() {
                TOKEN_SHUTDOWN => return Err("device shutting down".into()),
                TOKEN_INBOX => {
                    // Frames are taken below; only the wake-up is consumed.
                    let _ = wake.read();
                }
                TOKEN_SOCKET => {
                    // Reading a message may wait for the frontend: the
                    // ports this thread polls for go back to their own.
                    ctx.shared_poll.stop_polling(port);
                    let msg = conn::recv_message(stream).map_err(|e| e.to_string())?;
                    let out = {
                        let mut st = port.lock();
                        handler::handle(&mut st, &port.stats, msg).map_err(|e| {
                            tracing::warn!(port = port.index, "malformed message: {e}");
                            e.to_string()
                        })?
                    };
                    if let Some(r) = out.reply {
                        conn::send_message(stream, &r).map_err(|e| e.to_string())?;
                    }
                    if out.rings_changed {
                        sync_kicks(&epoll, port, &mut registered, &mut generation);
                    }
                    all |= out.retry;
                }
                t => {
                    let Some(at) = registered.iter().position(|g| g.token == t) else {
                        // A registration replaced earlier in this batch.
                        continue;
                    };
                    let i = registered[at].ring;
                    let hung = ev
                        .event_set()
                        .intersects(EventSet::HANG_UP | EventSet::ERROR);
                    let mut st = port.lock();
                    let Some(r) = st.vrings.get_mut(i) else {
                        continue;
                    };
                    let read = if hung {
                        KickRead::HungUp("hang-up".into())
                    } else {
                        r.drain_kick()
                    };
                    match read {
                        KickRead::Kicked => {
                            rings.insert(i);
                            kicked.insert(i);
                        }
                        KickRead::Nothing => {}
                        KickRead::HungUp(reason) => {
                            r.kick_hung_up(port.index, &reason);
                            unregister_kick(&epoll, registered.swap_remove(at));
                        }
                    }
                }
            }
        }
        if port.inbox.pending() && receive_frames(port) {
            last_work = Some(Instant::now());
        }
        if port.inbox.completions_pending() {
            // Requests the fabric link completed: their pairs' services
            // write the completions.
            let st = port.lock();
            rings.extend(
                (0..st.rdma_queue_pairs)
                    .map(|pair| usize::from(layout.send_queue(pair)))
                    .filter(|&ring| st.vrings.get(ring).is_some_and(|r| r.active())),
            );
        }
        if port.inbox.notices_pending() {
            // Arrivals for the admin completion queue: its send queue's
            // service writes them.
            rings.insert(usize::from(
                layout.send_queue(pindown_uapi::ADMIN_QUEUE_PAIR),
            ));
        }
        if all {
            let st = port.lock();
            rings.extend(st.vrings.iter().filter(|r| r.active()).map(|r| r.index));
        }
        for &i in &rings {
            if served_with_its_send_queue(port, &layout, &rings, &kicked, i) {
                continue;
            }
            let w = process_ring(ctx, port, i, kicked.contains(&i));
            if w.more {
                again.insert(i);
            }
            if w.done {
                last_work = Some(Instant::now());
            }
        }
        if (polling || spinning) && again.is_empty() {
            // Between two passes over everything, poll the RDMA send queue
            // alone: the one ring whose latency is measured in
            // microseconds.
            let role = ctx.shared_poll.take_role(port);
            if role != Role::Delegate {
                let others = (role == Role::Poller).then_some(&mut delegated_ports);
                let polled = poll_rdma(ctx, port, others, &mut load, &mut again, &mut sharing);
                if let Some(worked) = polled {
                    last_work = Some(worked);
                }
            }
        }
    }
}

/// Whether ring `i` is an RDMA completion queue that need not be looked at
/// on its own in this pass: it was not kicked, and its pair's send queue is
/// active and in the pass too, whose service writes the pair's
/// completions. (Serving a pair once per pass, not once per ring, keeps a
/// polling pass short.)
fn served_with_its_send_queue(
    port: &Port,
    layout: &pindown_uapi::RingLayout,
    rings: &HashSet<usize>,
    kicked: &HashSet<usize>,
    i: usize,
) -> bool {
    let Some(pindown_uapi::RdmaRing::Completion(pair)) = u16::try_from(i)
        .ok()
        .and_then(|ring| layout.rdma_ring(ring))
    else {
        return false;
    };
    let send = usize::from(layout.send_queue(pair));
    !kicked.contains(&i)
        && rings.contains(&send)
        && port
            .lock()
            .vrings
            .get(send)
            .is_some_and(|ring| ring.active())
}

/// Polls the RDMA queue pairs of `port` alone (and, as the shared poller,
/// those of the ports delegated to it, `others`) for [`RDMA_POLL_TIME`],
/// or until something needs a full pass (a transfer paused between turns,
/// an IOTLB miss to send, a ring stopped). Between idle polls it spins, or
/// yields while `sharing` says the core is shared. Returns when work was
/// last done, if any.
fn poll_rdma(
    ctx: Context<'_>,
    port: &Port,
    mut others: Option<&mut Delegated>,
    load: &mut Load,
    again: &mut HashSet<usize>,
    sharing: &mut CoreSharing,
) -> Option<Instant> {
    let started = Instant::now();
    let mut worked = None;
    for polls in 1u32.. {
        let mut send_queues = port.send_queues();
        let mut st = port.lock();
        let mut live = false;
        for send_queue in send_queues.iter_mut() {
            let sq = send_queue.rings_of(&st).0;
            if !st.vrings[sq].active() {
                continue;
            }
            let served = send_queue.serve(&mut st, ctx.ports, ctx.link);
            if served.worked {
                load.own_worked();
                worked = Some(Instant::now());
            }
            if served.more {
                again.insert(sq);
                if served.paused {
                    // A transfer longer than one turn: the delegated ports
                    // go back to their own threads while it runs.
                    drop(st);
                    drop(send_queues);
                    ctx.shared_poll.stop_polling(port);
                }
                return worked;
            }
            if st.vrings[sq].waiting_iotlb || !st.vrings[sq].active() {
                drop(st);
                drop(send_queues);
                ctx.shared_poll.stop_polling(port);
                return worked;
            }
            live = true;
        }
        drop(st);
        drop(send_queues);
        if let Some(others) = others.as_deref_mut() {
            ctx.shared_poll.serve_delegated(ctx, others, load);
        }
        // The port thread runs the fabric link's work too. Busy-polling,
        // always: a request just handed to the link goes out, and its
        // answer is taken, with no other thread in between. Event-driven,
        // while it spins after work and requests of this node are on the
        // fabric: their answers are taken and completed here, with no
        // wake-up of the link's thread nor of this one.
        let linked = ctx
            .link
            .filter(|link| ctx.config.poll || link.requests_in_flight());
        if linked.is_some_and(|link| link.drive(port.index)) {
            load.own_worked();
        }
        let idle = !load.busy();
        if !idle && (others.is_some() || linked.is_some()) {
            worked = Some(Instant::now());
        }
        load.end_poll(ctx.shared_poll);
        if !live {
            break;
        }
        if polls.is_multiple_of(RDMA_POLLS_PER_CLOCK) {
            let now = Instant::now();
            if now.duration_since(started) >= RDMA_POLL_TIME {
                break;
            }
            if idle {
                sharing.looked(now);
            }
        }
        if idle {
            sharing.pause();
        }
    }
    worked
}

/// How long a delegated port's thread sleeps at most before it looks
/// whether the shared poller made progress (milliseconds).
const DELEGATED_LOOK_MS: i32 = 10;

/// How long a polling port polls its RDMA queues alone between two passes
/// over everything (rings, socket, inbox): a pass costs microseconds, and
/// a request arriving during one waits for it.
const RDMA_POLL_TIME: Duration = Duration::from_micros(200);

/// RDMA polls between two looks at the clock.
const RDMA_POLLS_PER_CLOCK: u32 = 32;

/// In busy-poll mode, idle time after which a port sleeps on its kicks.
const POLL_IDLE: Duration = Duration::from_millis(1);

/// While a port polls, how often it looks at its socket and kick eventfds
/// (at most: once per pass over everything).
const LOOK_INTERVAL: Duration = Duration::from_micros(50);
