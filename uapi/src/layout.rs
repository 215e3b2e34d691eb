//! Which ring carries what, and what the device says about itself.

/// Version of this ABI. A driver refuses a device reporting another one.
///
/// Version 2: 64-bit remote keys, windows bound to one peer port, one
/// answer ([`ErrorDetail::NotGranted`](crate::ErrorDetail)) for every
/// refused remote access, and a per-port window limit.
///
/// Version 3: the RDMA queues are stamped slots the other side polls, with
/// completions written in place and event records instead of split
/// virtqueues ([`queue`](crate::queue)), and WRITE_INLINE.
pub const ABI_VERSION: u16 = 3;

/// RDMA features a device of this ABI version offers (bits of
/// [`DeviceInfo::features`]).
pub mod rdma_features {
    /// WRITE and READ of any length and alignment.
    pub const READ_WRITE: u32 = 1 << 0;
    /// Compare-and-swap, fetch-and-add and swap on 4- and 8-byte words.
    pub const ATOMICS: u32 = 1 << 1;
    /// Window bind and revoke.
    pub const WINDOWS: u32 = 1 << 2;
    /// WRITE_INLINE of up to [`MAX_INLINE`](crate::queue::MAX_INLINE) bytes.
    pub const INLINE: u32 = 1 << 3;
}

/// Every feature of this version.
pub const RDMA_FEATURES: u32 = rdma_features::READ_WRITE
    | rdma_features::ATOMICS
    | rdma_features::WINDOWS
    | rdma_features::INLINE;

/// The rings of a device with `queue_pairs` Ethernet queue pairs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingLayout {
    /// Ethernet queue pairs (what `GET_QUEUE_NUM` reports).
    pub queue_pairs: u16,
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

    /// The RDMA send queue: stamped work requests in (see [`queue`](crate::queue)).
    pub fn send_queue(&self) -> u16 {
        2 * self.queue_pairs
    }

    /// The RDMA completion queue: stamped completions back (see [`queue`](crate::queue)).
    pub fn completion_queue(&self) -> u16 {
        2 * self.queue_pairs + 1
    }

    /// Number of rings in all.
    pub fn ring_count(&self) -> u16 {
        2 * self.queue_pairs + 2
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
    pub features: u32,
}

impl DeviceInfo {
    /// Packs the information into a completion value.
    pub fn to_value(&self) -> u64 {
        u64::from(self.port) | u64::from(self.abi_version) << 16 | u64::from(self.features) << 32
    }

    /// Unpacks a completion value.
    pub fn from_value(value: u64) -> Self {
        DeviceInfo {
            port: value as u16,
            abi_version: (value >> 16) as u16,
            features: (value >> 32) as u32,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rdma_rings_follow_the_ethernet_pairs() {
        let layout = RingLayout { queue_pairs: 2 };
        assert_eq!((layout.net_rx(1), layout.net_tx(1)), (2, 3));
        assert_eq!((layout.send_queue(), layout.completion_queue()), (4, 5));
        assert_eq!(layout.ring_count(), 6);
    }

    #[test]
    fn device_info_round_trips() {
        let info = DeviceInfo {
            port: 7,
            abi_version: ABI_VERSION,
            features: RDMA_FEATURES,
        };
        assert_eq!(DeviceInfo::from_value(info.to_value()), info);
    }
}
