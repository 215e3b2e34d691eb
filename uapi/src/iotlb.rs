//! The vhost-user IOTLB message, `struct vhost_iotlb_msg`, as it travels in
//! an `IOTLB_MSG` request: frontend to device (UPDATE, INVALIDATE) and
//! device to frontend on the backend channel (MISS).
//!
//! The message is vhost-user's, not ours, and `vhost` 0.18 has the request
//! codes (`FrontendReq::IOTLB_MSG`, `BackendReq::IOTLB_MSG`) and the value
//! types ([`VhostIotlbType`], [`VhostAccess`]) but no usable wire form: its
//! `VhostIotlbMsg` has no byte layout (and no `Debug`), its fields are
//! enums that cannot hold the values a hostile frontend sends, and the one
//! struct with the kernel's layout lives in its `vhost-kern` bindings, with
//! implicit padding. So the wire form is defined here, once, for the
//! driver (which sends UPDATE and INVALIDATE) and the device (which decodes
//! them and sends MISS); the type and permission values are `vhost`'s.

pub use vhost::{VhostAccess, VhostIotlbType};

use crate::error::{le_u64, DecodeError};

/// `struct vhost_iotlb_msg`: 32 bytes, little-endian, fields at fixed
/// offsets (iova 0, size 8, uaddr 16, perm 24, type 25, 6 bytes of padding).
///
/// `perm` and `msg_type` are kept as the bytes received; [`access`] and
/// [`iotlb_type`] give them as `vhost`'s types when they are valid.
///
/// [`access`]: IotlbMessage::access
/// [`iotlb_type`]: IotlbMessage::iotlb_type
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IotlbMessage {
    /// First I/O virtual address of the range.
    pub iova: u64,
    /// Length of the range in bytes (MISS: 1 by convention).
    pub size: u64,
    /// The frontend's virtual address `iova` maps to (UPDATE only).
    pub uaddr: u64,
    /// `VHOST_ACCESS_*`: the permission granted (UPDATE) or needed (MISS).
    pub perm: u8,
    /// `VHOST_IOTLB_*`: what the message asks.
    pub msg_type: u8,
}

impl IotlbMessage {
    /// Size on the wire (with the tail padding of the C struct).
    pub const SIZE: usize = 32;

    /// An UPDATE: map `[iova, iova + size)` to `[uaddr, uaddr + size)`.
    pub fn update(iova: u64, size: u64, uaddr: u64, access: VhostAccess) -> Self {
        IotlbMessage {
            iova,
            size,
            uaddr,
            perm: access as u8,
            msg_type: VhostIotlbType::Update as u8,
        }
    }

    /// An INVALIDATE of `[iova, iova + size)`.
    pub fn invalidate(iova: u64, size: u64) -> Self {
        IotlbMessage {
            iova,
            size,
            msg_type: VhostIotlbType::Invalidate as u8,
            ..IotlbMessage::default()
        }
    }

    /// A MISS: the device needs `access` at `iova`.
    pub fn miss(iova: u64, access: VhostAccess) -> Self {
        IotlbMessage {
            iova,
            size: 1,
            perm: access as u8,
            msg_type: VhostIotlbType::Miss as u8,
            ..IotlbMessage::default()
        }
    }

    /// The message type, if it is one `vhost` defines (other than
    /// `Empty`).
    pub fn iotlb_type(&self) -> Option<VhostIotlbType> {
        use VhostIotlbType as T;
        [
            T::Miss,
            T::Update,
            T::Invalidate,
            T::AccessFail,
            T::BatchBegin,
            T::BatchEnd,
        ]
        .into_iter()
        .find(|t| *t as u8 == self.msg_type)
    }

    /// The permission, if it is one `vhost` defines.
    pub fn access(&self) -> Option<VhostAccess> {
        use VhostAccess as A;
        [A::No, A::ReadOnly, A::WriteOnly, A::ReadWrite]
            .into_iter()
            .find(|a| *a as u8 == self.perm)
    }

    /// The wire form.
    pub fn encode(&self) -> [u8; Self::SIZE] {
        let mut bytes = [0u8; Self::SIZE];
        bytes[0..8].copy_from_slice(&self.iova.to_le_bytes());
        bytes[8..16].copy_from_slice(&self.size.to_le_bytes());
        bytes[16..24].copy_from_slice(&self.uaddr.to_le_bytes());
        bytes[24] = self.perm;
        bytes[25] = self.msg_type;
        bytes
    }

    /// Reads the first [`SIZE`](Self::SIZE) bytes of `bytes`. The type and
    /// permission are not checked here (see [`iotlb_type`](Self::iotlb_type)
    /// and [`access`](Self::access)): a message with a value nobody defines
    /// is a request to refuse, not a malformed stream.
    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        if bytes.len() < Self::SIZE {
            return Err(DecodeError::Truncated {
                needed: Self::SIZE,
                got: bytes.len(),
            });
        }
        Ok(IotlbMessage {
            iova: le_u64(bytes, 0),
            size: le_u64(bytes, 8),
            uaddr: le_u64(bytes, 16),
            perm: bytes[24],
            msg_type: bytes[25],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn update_has_the_kernel_layout() {
        let bytes = IotlbMessage::update(0x1122, 0x3344, 0x5566, VhostAccess::ReadWrite).encode();
        assert_eq!(&bytes[0..8], &0x1122u64.to_le_bytes());
        assert_eq!(&bytes[8..16], &0x3344u64.to_le_bytes());
        assert_eq!(&bytes[16..24], &0x5566u64.to_le_bytes());
        assert_eq!((bytes[24], bytes[25]), (3, 2));
        assert_eq!(&bytes[26..], &[0; 6]);
        let miss = IotlbMessage::miss(0x7000, VhostAccess::WriteOnly).encode();
        assert_eq!((miss[24], miss[25]), (2, 1));
        assert_eq!(IotlbMessage::invalidate(1, 2).encode()[25], 3);
    }

    #[test]
    fn unknown_values_decode_but_are_not_typed() {
        let mut bytes = IotlbMessage::update(1, 2, 3, VhostAccess::ReadOnly).encode();
        bytes[24] = 7;
        bytes[25] = 9;
        let m = IotlbMessage::decode(&bytes).unwrap();
        assert_eq!((m.access(), m.iotlb_type()), (None, None));
        assert_eq!(
            IotlbMessage::decode(&bytes[..26]),
            Err(DecodeError::Truncated {
                needed: 32,
                got: 26
            })
        );
    }

    proptest! {
        #[test]
        fn round_trips(iova: u64, size: u64, uaddr: u64, perm: u8, msg_type: u8) {
            let m = IotlbMessage { iova, size, uaddr, perm, msg_type };
            prop_assert_eq!(IotlbMessage::decode(&m.encode()), Ok(m));
        }
    }
}
