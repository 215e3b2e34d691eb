//! The virtio feature bits that driver and device negotiate, as masks.
//!
//! The bit numbers are virtio's and vhost-user's, not ours: they come from
//! `virtio-bindings` and `vhost`. This module only turns each of them into
//! a mask once, so that the device (what it offers), the driver's two
//! transports (what they ask for) and the tests all name the same constant.

use vhost::vhost_user::message::VhostUserVirtioFeatures;
use virtio_bindings::virtio_config::{VIRTIO_F_ACCESS_PLATFORM, VIRTIO_F_VERSION_1};
use virtio_bindings::virtio_net::{
    VIRTIO_NET_F_CTRL_VQ, VIRTIO_NET_F_MAC, VIRTIO_NET_F_MQ, VIRTIO_NET_F_STATUS,
};
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};

/// A virtio 1.x (modern) device (`VIRTIO_F_VERSION_1`, bit 32).
pub const VERSION_1: u64 = 1 << VIRTIO_F_VERSION_1;
/// Every address the driver gives the device is an I/O virtual address,
/// translated through the IOTLB (`VIRTIO_F_ACCESS_PLATFORM`, bit 33).
pub const ACCESS_PLATFORM: u64 = 1 << VIRTIO_F_ACCESS_PLATFORM;
/// Used/available event indices suppress notifications
/// (`VIRTIO_RING_F_EVENT_IDX`, bit 29).
pub const EVENT_IDX: u64 = 1 << VIRTIO_RING_F_EVENT_IDX;
/// Indirect descriptor tables (`VIRTIO_RING_F_INDIRECT_DESC`, bit 28).
pub const INDIRECT_DESC: u64 = 1 << VIRTIO_RING_F_INDIRECT_DESC;
/// virtio-net: the device has a MAC address (`VIRTIO_NET_F_MAC`, bit 5).
pub const NET_MAC: u64 = 1 << VIRTIO_NET_F_MAC;
/// virtio-net: link status in the configuration space
/// (`VIRTIO_NET_F_STATUS`, bit 16).
pub const NET_STATUS: u64 = 1 << VIRTIO_NET_F_STATUS;
/// virtio-net: the control queue exists (`VIRTIO_NET_F_CTRL_VQ`, bit 17).
pub const NET_CTRL_VQ: u64 = 1 << VIRTIO_NET_F_CTRL_VQ;
/// virtio-net: several queue pairs (`VIRTIO_NET_F_MQ`, bit 22).
pub const NET_MQ: u64 = 1 << VIRTIO_NET_F_MQ;
/// vhost-user: the backend speaks protocol features
/// (`VHOST_USER_F_PROTOCOL_FEATURES`, bit 30).
pub const PROTOCOL_FEATURES: u64 = VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_have_the_spec_bit_numbers() {
        assert_eq!(VERSION_1, 1 << 32);
        assert_eq!(ACCESS_PLATFORM, 1 << 33);
        assert_eq!(EVENT_IDX, 1 << 29);
        assert_eq!(INDIRECT_DESC, 1 << 28);
        assert_eq!(PROTOCOL_FEATURES, 1 << 30);
        assert_eq!(NET_MAC | NET_STATUS | NET_CTRL_VQ | NET_MQ, 0x43_0020);
    }
}
