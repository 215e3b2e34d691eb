//! Which ring carries what, and what the device says about itself.

/// Version of this ABI. A driver refuses a device reporting another one.
///
/// Version 2: 64-bit remote keys, windows bound to one peer port, one
/// answer ([`ErrorDetail::NotGranted`](crate::ErrorDetail)) for every
/// refused remote access, and a per-port window limit.
///
/// Version 3: several RDMA queue pairs per port (the admin pair and I/O
/// pairs, see [`RingLayout`]); [`DeviceInfo`] reports how many.
///
/// Version 4: the RDMA queues are stamped slots the other side polls, with
/// completions written in place and event records instead of split
/// virtqueues ([`queue`](crate::queue)), and WRITE_INLINE.
///
/// Version 5: VECTOR_WRITE and VECTOR_READ between two access patterns
/// ([`pattern`](crate::pattern)).
///
/// Version 6: a remote address names a node of the fabric (the top 16
/// bits of the request's offset field; offsets are 48 bits), and QUERY
/// reports the device's node.
///
/// Version 7: an arrival names the writer's node beside its port
/// (completion bytes 26..28), since a VECTOR_WRITE from another node of
/// the fabric may ask for one.
///
/// Version 8: the send queue's device record carries the retired position
/// ([`Record::RETIRED`](crate::queue::Record::RETIRED)), before which every
/// request has finished.
pub const ABI_VERSION: u16 = 8;

/// RDMA features a device of this ABI version offers (bits of
/// [`DeviceInfo::features`]).
pub mod rdma_features {
    /// WRITE and READ of any length and alignment.
    pub const READ_WRITE: u16 = 1 << 0;
    /// Compare-and-swap, fetch-and-add and swap on 4- and 8-byte words.
    pub const ATOMICS: u16 = 1 << 1;
    /// Window bind and revoke.
    pub const WINDOWS: u16 = 1 << 2;
    /// WRITE_INLINE of up to [`MAX_INLINE`](crate::queue::MAX_INLINE) bytes.
    pub const INLINE: u16 = 1 << 3;
    /// VECTOR_WRITE and VECTOR_READ between two access patterns
    /// ([`pattern`](crate::pattern)), descriptors inline or in memory,
    /// block lists in memory, and target notification
    /// ([`VectorFlags::NOTIFY_TARGET`](crate::VectorFlags::NOTIFY_TARGET)).
    pub const VECTOR: u16 = 1 << 4;
}

/// Every feature of this version.
pub const RDMA_FEATURES: u16 = rdma_features::READ_WRITE
    | rdma_features::ATOMICS
    | rdma_features::WINDOWS
    | rdma_features::INLINE
    | rdma_features::VECTOR;

/// The RDMA queue pair the device executes the driver's own requests on
/// (QUERY, BIND_WINDOW, REVOKE_WINDOW): the admin pair, as NVMe has an admin
/// queue pair beside its I/O queues. Windows a port bound are revoked when
/// this pair's rings stop.
pub const ADMIN_QUEUE_PAIR: u16 = 0;

/// The most RDMA queue pairs a port can have (the admin pair included).
pub const MAX_RDMA_QUEUE_PAIRS: u16 = 64;

/// Which ring carries what: `queue_pairs` Ethernet queue pairs, then
/// `rdma_queue_pairs` RDMA queue pairs (each a send queue and the
/// completion queue its requests complete on).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingLayout {
    /// Ethernet queue pairs (`P`).
    pub queue_pairs: u16,
    /// RDMA queue pairs (`R`), the admin pair
    /// ([`ADMIN_QUEUE_PAIR`]) included; at most
    /// [`MAX_RDMA_QUEUE_PAIRS`].
    pub rdma_queue_pairs: u16,
}

/// One of the two rings of an RDMA queue pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RdmaRing {
    /// The send queue of the pair: stamped work requests in.
    Send(u16),
    /// The completion queue of the pair: stamped completions back.
    Completion(u16),
}

impl RdmaRing {
    /// The queue pair the ring belongs to.
    pub fn pair(self) -> u16 {
        match self {
            RdmaRing::Send(pair) | RdmaRing::Completion(pair) => pair,
        }
    }
}

impl RingLayout {
    /// Receive ring of Ethernet queue pair `pair`.
    pub fn net_rx(&self, pair: u16) -> u16 {
        2 * pair
    }

    /// Transmit ring of Ethernet queue pair `pair`.
    pub fn net_tx(&self, pair: u16) -> u16 {
        2 * pair + 1
    }

    /// The send queue of RDMA queue pair `pair` (ring `2P + 2 pair`):
    /// stamped work requests in (see [`queue`](crate::queue)).
    pub fn send_queue(&self, pair: u16) -> u16 {
        2 * self.queue_pairs + 2 * pair
    }

    /// The completion queue of RDMA queue pair `pair` (ring `2P + 2 pair +
    /// 1`): stamped completions back (see [`queue`](crate::queue)).
    pub fn completion_queue(&self, pair: u16) -> u16 {
        2 * self.queue_pairs + 2 * pair + 1
    }

    /// The RDMA ring `ring` is, if it is one.
    pub fn rdma_ring(&self, ring: u16) -> Option<RdmaRing> {
        let offset = ring.checked_sub(2 * self.queue_pairs)?;
        let pair = offset / 2;
        if pair >= self.rdma_queue_pairs {
            return None;
        }
        Some(if offset % 2 == 0 {
            RdmaRing::Send(pair)
        } else {
            RdmaRing::Completion(pair)
        })
    }

    /// Number of rings in all.
    pub fn ring_count(&self) -> u16 {
        2 * self.queue_pairs + 2 * self.rdma_queue_pairs
    }
}

/// What the device reports about a port (the value of a QUERY completion).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// This port's number, which peers use in [`RemoteAddress`](crate::RemoteAddress).
    pub port: u16,
    /// The device's ABI version.
    pub abi_version: u16,
    /// Bits of [`rdma_features`].
    pub features: u16,
    /// RDMA queue pairs the port serves, the admin pair included.
    pub rdma_queue_pairs: u16,
    /// The node of the fabric this device is (0 without a fabric), which
    /// peers use in [`RemoteAddress`](crate::RemoteAddress).
    pub node: crate::NodeId,
}

impl DeviceInfo {
    /// This port's address in the fabric (what an [`Arrival`](crate::Arrival)
    /// of its writes names).
    pub fn address(&self) -> crate::PortAddress {
        crate::PortAddress {
            node: self.node,
            port: self.port,
        }
    }

    /// Packs the information into a QUERY completion's byte count (the
    /// node) and value (the rest).
    pub fn to_query(&self) -> (u32, u64) {
        let value = u64::from(self.port)
            | u64::from(self.abi_version) << 16
            | u64::from(self.features) << 32
            | u64::from(self.rdma_queue_pairs) << 48;
        (u32::from(self.node), value)
    }

    /// Unpacks a QUERY completion's byte count and value.
    pub fn from_query(byte_len: u32, value: u64) -> Self {
        DeviceInfo {
            port: value as u16,
            abi_version: (value >> 16) as u16,
            features: (value >> 32) as u16,
            rdma_queue_pairs: (value >> 48) as u16,
            node: byte_len as u16,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rdma_rings_follow_the_ethernet_pairs() {
        let layout = RingLayout {
            queue_pairs: 2,
            rdma_queue_pairs: 3,
        };
        assert_eq!((layout.net_rx(1), layout.net_tx(1)), (2, 3));
        assert_eq!((layout.send_queue(0), layout.completion_queue(0)), (4, 5));
        assert_eq!((layout.send_queue(2), layout.completion_queue(2)), (8, 9));
        assert_eq!(layout.ring_count(), 10);
        let rings: Vec<_> = (0..12).map(|ring| layout.rdma_ring(ring)).collect();
        assert_eq!(&rings[..4], &[None; 4]);
        assert_eq!(rings[4], Some(RdmaRing::Send(0)));
        assert_eq!(rings[7], Some(RdmaRing::Completion(1)));
        assert_eq!(rings[9], Some(RdmaRing::Completion(2)));
        assert_eq!(&rings[10..], &[None; 2]);
        for ring in 4..10 {
            let pair = layout.rdma_ring(ring).unwrap().pair();
            assert!(ring == layout.send_queue(pair) || ring == layout.completion_queue(pair));
        }
    }

    #[test]
    fn device_info_round_trips() {
        let info = DeviceInfo {
            port: 7,
            abi_version: ABI_VERSION,
            features: RDMA_FEATURES,
            rdma_queue_pairs: MAX_RDMA_QUEUE_PAIRS,
            node: 513,
        };
        let (byte_len, value) = info.to_query();
        assert_eq!(DeviceInfo::from_query(byte_len, value), info);
    }
}
