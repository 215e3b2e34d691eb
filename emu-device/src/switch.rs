//! The Ethernet switch between ports: frames sent on a port's tx rings are
//! delivered to the rx ring 0 of the port owning the destination MAC
//! (learnt from source addresses); broadcast, multicast and unknown
//! unicast go to every other connected port.

use std::collections::HashMap;
use std::sync::Mutex;

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
