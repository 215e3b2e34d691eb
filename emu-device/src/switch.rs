//! The Ethernet data path: queue pair 0 of every port is a port of a
//! learning switch. Frames a port sends on its tx rings ([`collect_tx`])
//! are delivered to the rx ring 0 of the port owning the destination MAC
//! (learnt from source addresses); broadcast, multicast and unknown
//! unicast go to every other connected port ([`Switch::forward`]). A frame
//! for another port goes into that port's [`Inbox`](crate::inbox::Inbox);
//! the receiver's own thread moves it into its rx ring ([`receive`],
//! [`flush_rx`]).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use pindown_uapi::NodeId;

use crate::inbox::Pushed;
use crate::internode::Link;
use crate::port::{Port, PortState, PortStats, PortTable, RX_BACKLOG_MAX};
use crate::queues::{self, ChainError, Pop};

/// Size of the virtio-net header with VERSION_1 (`num_buffers` included).
pub const NET_HDR_LEN: usize = 12;

/// Smallest frame accepted: an Ethernet header.
pub const ETH_HDR_LEN: usize = 14;

/// Largest tx chain accepted (header + 64 KiB frame).
pub const MAX_TX_CHAIN: usize = NET_HDR_LEN + 65_536;

/// Most MAC addresses the learning table holds.
pub const MAC_TABLE_MAX: usize = 4096;

/// Most MAC addresses learnt behind one station (a port or a node): a
/// sender that makes up ever new source addresses fills its own share and
/// no more. Frames to addresses not learnt are flooded, as to any unknown
/// one.
pub const MACS_PER_STATION_MAX: usize = 1024;

/// The MAC learning table.
#[derive(Debug, Default)]
pub struct Switch {
    table: Mutex<Table>,
    /// Source addresses not learnt: a station's address beyond its share
    /// or the table's room.
    refused: AtomicU64,
}

/// The addresses learnt, and how many behind each station.
#[derive(Debug, Default)]
struct Table {
    stations: HashMap<[u8; 6], Station>,
    counts: HashMap<Station, usize>,
}

/// Where a MAC address lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Station {
    /// Behind a port of this device.
    Port(usize),
    /// Behind another node of the fabric.
    Node(NodeId),
}

/// Where a frame goes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Route {
    /// Ports of this device.
    pub ports: Vec<usize>,
    /// Other nodes of the fabric: one, or every one (a broadcast, or an
    /// address not learnt yet).
    pub nodes: Nodes,
}

/// The nodes a frame goes to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Nodes {
    /// None.
    #[default]
    None,
    /// This one.
    One(NodeId),
    /// Every node.
    All,
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
    /// Records that `mac` lives at `station`: a station learns at most
    /// [`MACS_PER_STATION_MAX`] addresses, the table at most
    /// [`MAC_TABLE_MAX`]. A refusal is counted ([`refused`](Self::refused))
    /// and forgets where the address was (frames to it are flooded rather
    /// than sent where it no longer is).
    pub fn learn(&self, mac: [u8; 6], station: Station) {
        if is_group(&mac) || mac == [0; 6] {
            return;
        }
        let mut t = self.table.lock().unwrap_or_else(|e| e.into_inner());
        let previous = t.stations.get(&mac).copied();
        if previous == Some(station) {
            return;
        }
        if let Some(previous) = previous {
            t.stations.remove(&mac);
            t.uncount(previous);
        }
        let share = t.counts.get(&station).copied().unwrap_or(0);
        if share >= MACS_PER_STATION_MAX || t.stations.len() >= MAC_TABLE_MAX {
            self.refused.fetch_add(1, Ordering::Relaxed);
            return;
        }
        *t.counts.entry(station).or_insert(0) += 1;
        t.stations.insert(mac, station);
    }

    /// Source addresses not learnt (see [`learn`](Self::learn)).
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// Addresses the table holds.
    pub fn learnt(&self) -> usize {
        self.table
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .stations
            .len()
    }

    /// Forgets every MAC learnt on `port` (on disconnect).
    pub fn forget_port(&self, port: usize) {
        self.forget(Station::Port(port));
    }

    /// Forgets every MAC learnt at `station`.
    pub fn forget(&self, station: Station) {
        let mut t = self.table.lock().unwrap_or_else(|e| e.into_inner());
        t.stations.retain(|_, s| *s != station);
        t.counts.remove(&station);
    }

    /// Where `mac` lives, if known.
    pub fn lookup(&self, mac: &[u8; 6]) -> Option<Station> {
        let t = self.table.lock().unwrap_or_else(|e| e.into_inner());
        t.stations.get(mac).copied()
    }

    /// Learns the source of `frame` (sent from `from`) and returns where
    /// it goes: ports among `ports` (the connected ones), and, for a frame
    /// of a local port (`fabric`: the device has other nodes), other
    /// nodes. A frame that came from another node never goes back to the
    /// fabric (every node hears every flood directly).
    pub fn route(&self, from: Station, frame: &[u8], ports: &[usize], fabric: bool) -> Route {
        let (Some(dst), Some(src)) = (dst_mac(frame), src_mac(frame)) else {
            return Route::default();
        };
        self.learn(src, from);
        let to_nodes = fabric && matches!(from, Station::Port(_));
        let station = (!is_group(&dst)).then(|| self.lookup(&dst)).flatten();
        match station {
            Some(station) if station == from => Route::default(),
            Some(Station::Port(p)) => Route {
                ports: if ports.contains(&p) {
                    vec![p]
                } else {
                    Vec::new()
                },
                nodes: Nodes::None,
            },
            Some(Station::Node(node)) => Route {
                ports: Vec::new(),
                nodes: if to_nodes {
                    Nodes::One(node)
                } else {
                    Nodes::None
                },
            },
            None => Route {
                ports: ports
                    .iter()
                    .copied()
                    .filter(|&p| Station::Port(p) != from)
                    .collect(),
                nodes: if to_nodes { Nodes::All } else { Nodes::None },
            },
        }
    }

    /// Delivers a frame (without virtio-net header) sent from `from` (a
    /// port of this device, or another node through `link`): queues it in
    /// the inbox of each target port among the connected ones (never waits
    /// for them), and hands it to the fabric link for other nodes.
    pub fn forward(&self, ports: &PortTable, from: Station, frame: &[u8], link: Option<&Link>) {
        let route = self.route(from, frame, &ports.connected(), link.is_some());
        for to in route.ports {
            if let Some(p) = ports.get(to) {
                deliver(&p, frame);
            }
        }
        if let Some(link) = link {
            match route.nodes {
                Nodes::None => {}
                Nodes::One(node) => link.send_frame(Some(node), frame),
                Nodes::All => link.send_frame(None, frame),
            }
        }
    }
}

/// The virtio-net header put in front of received frames: no offloads,
/// one buffer.
pub fn rx_header() -> [u8; NET_HDR_LEN] {
    let mut h = [0u8; NET_HDR_LEN];
    h[10..12].copy_from_slice(&1u16.to_le_bytes());
    h
}

/// Chains taken from one ring before other work gets a turn.
pub const BUDGET: usize = 256;

/// Queues `frame` for rx ring 0 of `port` (in its inbox; its own thread
/// takes it from there, see [`receive`]), or drops it (counted).
fn deliver(port: &Port, frame: &[u8]) {
    let mut data = Vec::with_capacity(NET_HDR_LEN + frame.len());
    data.extend_from_slice(&rx_header());
    data.extend_from_slice(frame);
    match port.inbox.push(data) {
        Pushed::Queued => {}
        Pushed::QueuedDroppingOldest | Pushed::Dropped => PortStats::bump(&port.stats.rx_dropped),
    }
}

/// Puts `frames` taken from the port's inbox into rx ring 0 (run by the
/// port's own thread, holding its lock). Returns whether a frame was
/// delivered.
///
/// A frame whose rx buffer is not mapped yet (IOTLB miss) waits in the
/// port's backlog, in order, until the frontend answers the MISS; frames
/// arriving meanwhile queue behind it. A frame finding no rx buffer at
/// all, or a buffer mapped without write permission, is dropped, as a
/// NIC drops frames when the driver posts no buffers.
pub fn receive(st: &mut PortState, stats: &PortStats, frames: VecDeque<Vec<u8>>) -> bool {
    let ready =
        st.shared.access().memory.is_some() && st.vrings.first().is_some_and(|r| r.active());
    if !ready {
        for _ in 0..frames.len() {
            PortStats::bump(&stats.rx_dropped);
        }
        return false;
    }
    for data in frames {
        if st.rx_backlog.len() >= RX_BACKLOG_MAX {
            st.rx_backlog.pop_front();
            PortStats::bump(&stats.rx_dropped);
        }
        st.rx_backlog.push_back(data);
    }
    flush_rx(st, stats)
}

/// Moves the frames of the rx backlog into rx ring 0, oldest first, until
/// the backlog is empty or an rx buffer misses in the IOTLB (then the ring
/// waits for the UPDATE). Returns whether a frame was delivered.
pub fn flush_rx(st: &mut PortState, stats: &PortStats) -> bool {
    let PortState {
        index,
        shared: port,
        vrings,
        rx_backlog,
        ..
    } = st;
    let shared = port.access();
    let (Some(mem), Some(ring)) = (shared.memory.as_ref(), vrings.get_mut(0)) else {
        return false;
    };
    let was_waiting = std::mem::take(&mut ring.waiting_iotlb);
    if rx_backlog.is_empty() {
        return false;
    }
    let drop_all = |backlog: &mut VecDeque<Vec<u8>>| {
        for _ in backlog.drain(..) {
            PortStats::bump(&stats.rx_dropped);
        }
    };
    if !ring.active() {
        drop_all(rx_backlog);
        return false;
    }
    if let Err(error) = ring.used_ring_writable(mem) {
        match error.ask() {
            Some(miss) => {
                port.note_miss(miss);
                ring.waiting_iotlb = true;
            }
            None => drop_all(rx_backlog),
        }
        return false;
    }
    let mut used = false;
    while let Some(data) = rx_backlog.front() {
        match queues::pop_chain(ring, mem) {
            Pop::Chain(c) => match queues::write_chain(mem, &c, data) {
                Ok(n) => {
                    let _ = ring.add_used(mem, c.head, n as u32);
                    used = true;
                    rx_backlog.pop_front();
                    PortStats::bump(&stats.rx_frames);
                }
                Err(ChainError::Miss(miss)) => {
                    ring.rewind();
                    port.note_miss(miss);
                    if !was_waiting {
                        PortStats::bump(&stats.rx_deferred);
                    }
                    ring.waiting_iotlb = true;
                    break;
                }
                Err(ChainError::Denied(denied)) => {
                    // The buffer stays posted; the frame is lost. The
                    // frontend is asked for the access all the same.
                    port.note_miss_of(denied);
                    ring.rewind();
                    rx_backlog.pop_front();
                    PortStats::bump(&stats.rx_dropped);
                }
                Err(e) => {
                    tracing::debug!("rx drop: {e}");
                    let _ = ring.add_used(mem, c.head, 0);
                    used = true;
                    rx_backlog.pop_front();
                    PortStats::bump(&stats.rx_dropped);
                }
            },
            Pop::Miss(miss) => {
                port.note_miss(miss);
                ring.waiting_iotlb = true;
                break;
            }
            Pop::Broken(e) => {
                ring.break_off(*index, &e);
                drop_all(rx_backlog);
            }
            Pop::Empty => {
                // Ask for a kick when buffers come; if some came
                // meanwhile, go on.
                if let Ok(true) = ring.queue_enable_notification(mem) {
                    continue;
                }
                drop_all(rx_backlog);
            }
        }
    }
    if used {
        ring.notify(mem);
    }
    used
}

/// Takes the frames sent on tx ring `i` (at most [`BUDGET`] chains),
/// appending them (without virtio-net header) to `frames`. Returns
/// whether work is left.
pub fn collect_tx(
    st: &mut PortState,
    stats: &PortStats,
    i: usize,
    frames: &mut Vec<Vec<u8>>,
) -> bool {
    let PortState {
        index,
        shared: port,
        vrings,
        ..
    } = st;
    let shared = port.access();
    let (Some(mem), Some(ring)) = (shared.memory.as_ref(), vrings.get_mut(i)) else {
        return false;
    };
    if !ring.active() {
        return false;
    }
    ring.waiting_iotlb = false;
    if let Err(error) = ring.used_ring_writable(mem) {
        if let Some(miss) = error.ask() {
            port.note_miss(miss);
            ring.waiting_iotlb = true;
        }
        return false;
    }
    let mut used = false;
    let mut more = false;
    let mut broken = false;
    let mut taken = 0;
    loop {
        let _ = ring.queue_disable_notification(mem);
        loop {
            if taken >= BUDGET {
                more = true;
                break;
            }
            match queues::pop_chain(ring, mem) {
                Pop::Empty => break,
                Pop::Miss(miss) => {
                    port.note_miss(miss);
                    ring.waiting_iotlb = true;
                    break;
                }
                Pop::Broken(e) => {
                    ring.break_off(*index, &e);
                    PortStats::bump(&stats.tx_errors);
                    broken = true;
                    break;
                }
                Pop::Chain(c) => match queues::read_chain(mem, &c, MAX_TX_CHAIN) {
                    Ok(bytes) => {
                        taken += 1;
                        let _ = ring.add_used(mem, c.head, 0);
                        used = true;
                        if bytes.len() < NET_HDR_LEN + ETH_HDR_LEN {
                            PortStats::bump(&stats.tx_errors);
                        } else {
                            PortStats::bump(&stats.tx_frames);
                            if let Some(c) = stats.tx_pair.get(i / 2) {
                                PortStats::bump(c);
                            }
                            frames.push(bytes[NET_HDR_LEN..].to_vec());
                        }
                    }
                    Err(ChainError::Miss(miss)) => {
                        ring.rewind();
                        port.note_miss(miss);
                        ring.waiting_iotlb = true;
                        break;
                    }
                    Err(e) => {
                        if let ChainError::Denied(denied) = &e {
                            port.note_miss_of(*denied);
                        }
                        taken += 1;
                        tracing::debug!(ring = i, "bad tx chain: {e}");
                        PortStats::bump(&stats.tx_errors);
                        let _ = ring.add_used(mem, c.head, 0);
                        used = true;
                    }
                },
            }
        }
        // A broken ring is not ready any more: looking for new buffers
        // on it would break it again, and again.
        if more || broken || ring.waiting_iotlb {
            break;
        }
        // Re-enable notifications; if buffers arrived meanwhile, go on.
        match ring.queue_enable_notification(mem) {
            Ok(true) => continue,
            _ => break,
        }
    }
    if used {
        ring.notify(mem);
    }
    more
}

impl Table {
    /// One address fewer behind `station`.
    fn uncount(&mut self, station: Station) {
        if let Some(count) = self.counts.get_mut(&station) {
            *count -= 1;
            if *count == 0 {
                self.counts.remove(&station);
            }
        }
    }
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
    fn learns_and_routes() {
        let s = Switch::default();
        let a = [2, 0, 0, 0, 0, 1];
        let b = [2, 0, 0, 0, 0, 2];
        let ports = [0, 1, 2];
        let route = |from, frame: &[u8]| s.route(Station::Port(from), frame, &ports, false).ports;
        // Unknown unicast floods.
        assert_eq!(route(0, &frame(b, a)), vec![1, 2]);
        // a was learnt on port 0.
        assert_eq!(route(1, &frame(a, b)), vec![0]);
        assert_eq!(route(2, &frame(b, [2, 0, 0, 0, 0, 3])), vec![1]);
        // Broadcast to all others.
        assert_eq!(route(1, &frame([0xff; 6], b)), vec![0, 2]);
        // Never back to the sender.
        assert_eq!(route(0, &frame(a, a)), Vec::<usize>::new());
        s.forget_port(0);
        assert_eq!(s.lookup(&a), None);
        // Runt frames go nowhere.
        assert!(route(0, &[1, 2, 3]).is_empty());
    }

    #[test]
    fn addresses_move_between_stations() {
        let s = Switch::default();
        let guest = [2, 0, 0, 0, 0, 1];
        s.learn(guest, Station::Port(0));
        s.learn(guest, Station::Node(3));
        assert_eq!(s.lookup(&guest), Some(Station::Node(3)));
        s.learn(guest, Station::Port(1));
        assert_eq!(s.lookup(&guest), Some(Station::Port(1)));
        assert_eq!(s.learnt(), 1);
        assert_eq!(s.refused(), 0);
    }

    #[test]
    fn a_station_learns_its_share_of_addresses_and_no_more() {
        let s = Switch::default();
        let mac = |station: u8, i: usize| [2, station, 0, 0, (i >> 8) as u8, i as u8];
        for i in 0..MACS_PER_STATION_MAX + 100 {
            s.learn(mac(9, i), Station::Node(9));
        }
        assert_eq!(s.learnt(), MACS_PER_STATION_MAX);
        assert_eq!(s.refused(), 100);
        // Addresses it holds stay; the others are flooded (unknown).
        assert_eq!(s.lookup(&mac(9, 0)), Some(Station::Node(9)));
        assert_eq!(s.lookup(&mac(9, MACS_PER_STATION_MAX)), None);
        // Other stations are not crowded out.
        s.learn(mac(1, 0), Station::Port(0));
        assert_eq!(s.lookup(&mac(1, 0)), Some(Station::Port(0)));
        // Moving an address between stations moves its share.
        s.learn(mac(9, 0), Station::Port(0));
        s.learn(mac(9, MACS_PER_STATION_MAX), Station::Node(9));
        assert_eq!(
            s.lookup(&mac(9, MACS_PER_STATION_MAX)),
            Some(Station::Node(9))
        );
        // A move the new station has no share for forgets the address.
        s.learn(mac(9, 3), Station::Port(0));
        s.learn(mac(9, 2000), Station::Node(9));
        let refused = s.refused();
        s.learn(mac(9, 3), Station::Node(9));
        assert_eq!(s.refused(), refused + 1);
        assert_eq!(s.lookup(&mac(9, 3)), None);
        // Forgetting a station frees its share.
        s.forget(Station::Node(9));
        assert_eq!(s.learnt(), 2);
        // The whole table is bounded too.
        for station in 10..10 + (MAC_TABLE_MAX / MACS_PER_STATION_MAX) as u8 + 1 {
            for i in 0..MACS_PER_STATION_MAX {
                s.learn(mac(station, i), Station::Node(u16::from(station)));
            }
        }
        assert_eq!(s.learnt(), MAC_TABLE_MAX);
    }

    #[test]
    fn frames_cross_the_fabric_once_and_learn_remote_stations() {
        let s = Switch::default();
        let (local, remote) = ([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 9]);
        let ports = [0, 1];
        // A broadcast of a local port floods locally and to every node.
        let route = s.route(Station::Port(0), &frame([0xff; 6], local), &ports, true);
        assert_eq!((route.ports, route.nodes), (vec![1], Nodes::All));
        // The answer from node 3 is learnt there and goes to port 0 only.
        let route = s.route(Station::Node(3), &frame(local, remote), &ports, true);
        assert_eq!((route.ports, route.nodes), (vec![0], Nodes::None));
        // Unicast to the remote station goes to node 3 only.
        let route = s.route(
            Station::Port(1),
            &frame(remote, [2, 0, 0, 0, 0, 2]),
            &ports,
            true,
        );
        assert_eq!((route.ports, route.nodes), (vec![], Nodes::One(3)));
        // A flood from another node never goes back to the fabric.
        let route = s.route(Station::Node(3), &frame([0xff; 6], remote), &ports, true);
        assert_eq!((route.ports, route.nodes), (vec![0, 1], Nodes::None));
        s.forget(Station::Node(3));
        assert_eq!(s.lookup(&remote), None);
    }
}
