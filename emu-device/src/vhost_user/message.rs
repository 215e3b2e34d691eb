//! Decoding of frontend requests and encoding of replies.
//!
//! The request codes and payload layouts come from
//! `vhost::vhost_user::message`; this module turns untrusted bytes into a
//! typed [`Request`] and never panics: anything malformed is a
//! [`ProtocolError`].

use std::fs::File;
use std::mem::size_of;

use thiserror::Error;
use vhost::vhost_user::message::{
    FrontendReq, VhostUserHeaderFlag, VhostUserMemory, VhostUserMemoryRegion,
    VhostUserMsgValidator, VhostUserU64, VhostUserVringAddr, VhostUserVringState,
    MAX_ATTACHED_FD_ENTRIES, MAX_MSG_SIZE,
};

use pindown_uapi::IotlbMessage;
use vhost::vhost_user::message::BackendReq;

use crate::memory::{self, Miss, RegionDesc};
use vm_memory::ByteValued;

/// Size of the vhost-user message header (request, flags, size).
pub const HEADER_SIZE: usize = 12;

/// Malformed input from a frontend.
#[derive(Debug, Error, PartialEq, Eq, Clone)]
pub enum ProtocolError {
    /// Fewer bytes than a header.
    #[error("short header ({0} bytes)")]
    ShortHeader(usize),
    /// Version bits are not 1, or reserved bits are set.
    #[error("bad header flags {0:#x}")]
    BadFlags(u32),
    /// The header announces more payload than allowed.
    #[error("payload of {0} bytes is too large")]
    TooLarge(u32),
    /// The payload does not match the request.
    #[error("{request}: bad payload size {size}")]
    BadSize {
        /// Request name.
        request: &'static str,
        /// Payload size received.
        size: usize,
    },
    /// A field has an impossible value.
    #[error("{request}: {reason}")]
    BadField {
        /// Request name.
        request: &'static str,
        /// What is wrong.
        reason: &'static str,
    },
    /// File descriptors missing or unexpected.
    #[error("{request}: expected {expected} file descriptor(s), got {got}")]
    BadFds {
        /// Request name.
        request: &'static str,
        /// Number expected.
        expected: usize,
        /// Number received.
        got: usize,
    },
}

/// A decoded message header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Raw request code.
    pub request: u32,
    /// Flags (version, REPLY, NEED_REPLY).
    pub flags: u32,
    /// Payload size.
    pub size: u32,
}

impl Header {
    /// Decodes and validates a header.
    pub fn decode(bytes: &[u8]) -> Result<Header, ProtocolError> {
        if bytes.len() < HEADER_SIZE {
            return Err(ProtocolError::ShortHeader(bytes.len()));
        }
        let word =
            |i: usize| u32::from_le_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
        let h = Header {
            request: word(0),
            flags: word(4),
            size: word(8),
        };
        if h.flags & VhostUserHeaderFlag::VERSION.bits() != 1
            || h.flags & VhostUserHeaderFlag::RESERVED_BITS.bits() != 0
        {
            return Err(ProtocolError::BadFlags(h.flags));
        }
        if h.size as usize > MAX_MSG_SIZE {
            return Err(ProtocolError::TooLarge(h.size));
        }
        Ok(h)
    }

    /// Whether the sender wants a REPLY_ACK.
    pub fn need_reply(&self) -> bool {
        self.flags & VhostUserHeaderFlag::NEED_REPLY.bits() != 0
    }

    /// The request, if the code is known.
    pub fn code(&self) -> Option<FrontendReq> {
        FrontendReq::try_from(self.request).ok()
    }

    /// Encodes a header.
    pub fn encode(&self) -> [u8; HEADER_SIZE] {
        let mut b = [0u8; HEADER_SIZE];
        b[0..4].copy_from_slice(&self.request.to_le_bytes());
        b[4..8].copy_from_slice(&self.flags.to_le_bytes());
        b[8..12].copy_from_slice(&self.size.to_le_bytes());
        b
    }
}

/// A vring index plus an optional file descriptor (SET_VRING_KICK/CALL/ERR).
#[derive(Debug)]
pub struct VringFd {
    /// Ring index.
    pub index: u32,
    /// The eventfd, or `None` when the frontend set the "no fd" bit
    /// (polling).
    pub fd: Option<File>,
}

/// Payload of SET_VRING_ADDR.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VringAddr {
    /// Ring index.
    pub index: u32,
    /// Flags (bit 0: log).
    pub flags: u32,
    /// Descriptor table address.
    pub desc: u64,
    /// Used ring address.
    pub used: u64,
    /// Available ring address.
    pub avail: u64,
    /// Log address.
    pub log: u64,
    /// Whether the alignments and flags are valid.
    pub valid: bool,
}

/// A decoded frontend request.
#[derive(Debug)]
pub enum Request {
    /// GET_FEATURES.
    GetFeatures,
    /// SET_FEATURES.
    SetFeatures(u64),
    /// GET_PROTOCOL_FEATURES.
    GetProtocolFeatures,
    /// SET_PROTOCOL_FEATURES.
    SetProtocolFeatures(u64),
    /// GET_QUEUE_NUM.
    GetQueueNum,
    /// GET_MAX_MEM_SLOTS.
    GetMaxMemSlots,
    /// SET_OWNER.
    SetOwner,
    /// RESET_OWNER.
    ResetOwner,
    /// SET_MEM_TABLE with one file per region.
    SetMemTable(Vec<RegionDesc>, Vec<File>),
    /// SET_VRING_NUM.
    SetVringNum { index: u32, num: u32 },
    /// SET_VRING_ADDR.
    SetVringAddr(VringAddr),
    /// SET_VRING_BASE.
    SetVringBase { index: u32, base: u32 },
    /// GET_VRING_BASE.
    GetVringBase { index: u32 },
    /// SET_VRING_KICK.
    SetVringKick(VringFd),
    /// SET_VRING_CALL.
    SetVringCall(VringFd),
    /// SET_VRING_ERR.
    SetVringErr(VringFd),
    /// SET_VRING_ENABLE.
    SetVringEnable { index: u32, enable: bool },
    /// SET_BACKEND_REQ_FD.
    SetBackendReqFd(File),
    /// IOTLB_MSG.
    Iotlb(IotlbMessage),
    /// SET_LOG_BASE (refused).
    SetLogBase,
    /// SET_LOG_FD (refused).
    SetLogFd,
    /// GET_CONFIG: offset and size of the config space read.
    GetConfig { offset: u32, size: u32, flags: u32 },
    /// A request this device does not implement (known or unknown code).
    Unsupported(u32),
}

/// The name of request `code` for messages.
pub fn name(code: u32) -> &'static str {
    match FrontendReq::try_from(code) {
        Ok(FrontendReq::GET_FEATURES) => "GET_FEATURES",
        Ok(FrontendReq::GET_PROTOCOL_FEATURES) => "GET_PROTOCOL_FEATURES",
        Ok(FrontendReq::GET_QUEUE_NUM) => "GET_QUEUE_NUM",
        Ok(FrontendReq::GET_MAX_MEM_SLOTS) => "GET_MAX_MEM_SLOTS",
        Ok(FrontendReq::SET_OWNER) => "SET_OWNER",
        Ok(FrontendReq::RESET_OWNER) => "RESET_OWNER",
        Ok(FrontendReq::SET_LOG_BASE) => "SET_LOG_BASE",
        Ok(FrontendReq::SET_LOG_FD) => "SET_LOG_FD",
        Ok(FrontendReq::SET_FEATURES) => "SET_FEATURES",
        Ok(FrontendReq::SET_PROTOCOL_FEATURES) => "SET_PROTOCOL_FEATURES",
        Ok(FrontendReq::SET_MEM_TABLE) => "SET_MEM_TABLE",
        Ok(FrontendReq::SET_VRING_NUM) => "SET_VRING_NUM",
        Ok(FrontendReq::SET_VRING_ADDR) => "SET_VRING_ADDR",
        Ok(FrontendReq::SET_VRING_BASE) => "SET_VRING_BASE",
        Ok(FrontendReq::GET_VRING_BASE) => "GET_VRING_BASE",
        Ok(FrontendReq::SET_VRING_KICK) => "SET_VRING_KICK",
        Ok(FrontendReq::SET_VRING_CALL) => "SET_VRING_CALL",
        Ok(FrontendReq::SET_VRING_ERR) => "SET_VRING_ERR",
        Ok(FrontendReq::SET_VRING_ENABLE) => "SET_VRING_ENABLE",
        Ok(FrontendReq::SET_BACKEND_REQ_FD) => "SET_BACKEND_REQ_FD",
        Ok(FrontendReq::IOTLB_MSG) => "IOTLB_MSG",
        Ok(FrontendReq::GET_CONFIG) => "GET_CONFIG",
        Ok(_) => "an unsupported request",
        Err(_) => "an unknown request",
    }
}

/// Decodes a fixed-size payload, which must be exactly `T`'s size: a
/// shorter one is truncated, a longer one inconsistent with the request.
fn pod<T: ByteValued + Default>(code: u32, p: &[u8]) -> Result<T, ProtocolError> {
    if p.len() != size_of::<T>() {
        return Err(ProtocolError::BadSize {
            request: name(code),
            size: p.len(),
        });
    }
    let mut v = T::default();
    v.as_mut_slice().copy_from_slice(p);
    Ok(v)
}

fn no_payload(code: u32, p: &[u8]) -> Result<(), ProtocolError> {
    if p.is_empty() {
        Ok(())
    } else {
        Err(ProtocolError::BadSize {
            request: name(code),
            size: p.len(),
        })
    }
}

fn expect_fds(code: u32, fds: &[File], expected: usize) -> Result<(), ProtocolError> {
    if fds.len() == expected {
        Ok(())
    } else {
        Err(ProtocolError::BadFds {
            request: name(code),
            expected,
            got: fds.len(),
        })
    }
}

fn vring_fd(code: u32, payload: &[u8], mut fds: Vec<File>) -> Result<VringFd, ProtocolError> {
    let v: VhostUserU64 = pod(code, payload)?;
    let value = v.value;
    let index = (value & 0xff) as u32;
    if value & !0x1ff != 0 {
        return Err(ProtocolError::BadField {
            request: name(code),
            reason: "reserved bits set",
        });
    }
    let nofd = value & 0x100 != 0;
    expect_fds(code, &fds, usize::from(!nofd))?;
    Ok(VringFd {
        index,
        fd: fds.pop(),
    })
}

/// Whether the frontend always waits for a reply to request `code`
/// (whatever the NEED_REPLY flag says). Such a request cannot be answered
/// "failed" when it is malformed: the reply has a request-specific form.
pub fn reply_required(code: u32) -> bool {
    matches!(
        FrontendReq::try_from(code),
        Ok(FrontendReq::GET_FEATURES
            | FrontendReq::GET_PROTOCOL_FEATURES
            | FrontendReq::GET_QUEUE_NUM
            | FrontendReq::GET_MAX_MEM_SLOTS
            | FrontendReq::GET_VRING_BASE
            | FrontendReq::GET_CONFIG)
    )
}

/// Decodes a request from its header, payload and received files.
///
/// Payloads must have exactly the size of the request's layout, and
/// exactly the file descriptors the request takes must come with it;
/// anything else is a [`ProtocolError`]. Files of requests the device does
/// not implement are dropped (closed).
pub fn decode(hdr: &Header, payload: &[u8], fds: Vec<File>) -> Result<Request, ProtocolError> {
    let code = hdr.request;
    let Some(req) = hdr.code() else {
        return Ok(Request::Unsupported(code));
    };
    let plain = |fds: &Vec<File>| expect_fds(code, fds, 0);
    let r = match req {
        FrontendReq::GET_FEATURES => {
            plain(&fds)?;
            no_payload(code, payload)?;
            Request::GetFeatures
        }
        FrontendReq::SET_FEATURES => {
            plain(&fds)?;
            Request::SetFeatures(pod::<VhostUserU64>(code, payload)?.value)
        }
        FrontendReq::GET_PROTOCOL_FEATURES => {
            plain(&fds)?;
            no_payload(code, payload)?;
            Request::GetProtocolFeatures
        }
        FrontendReq::SET_PROTOCOL_FEATURES => {
            plain(&fds)?;
            Request::SetProtocolFeatures(pod::<VhostUserU64>(code, payload)?.value)
        }
        FrontendReq::GET_QUEUE_NUM => {
            plain(&fds)?;
            no_payload(code, payload)?;
            Request::GetQueueNum
        }
        FrontendReq::GET_MAX_MEM_SLOTS => {
            plain(&fds)?;
            no_payload(code, payload)?;
            Request::GetMaxMemSlots
        }
        FrontendReq::SET_OWNER => {
            plain(&fds)?;
            no_payload(code, payload)?;
            Request::SetOwner
        }
        FrontendReq::RESET_OWNER => {
            plain(&fds)?;
            no_payload(code, payload)?;
            Request::ResetOwner
        }
        FrontendReq::SET_MEM_TABLE => {
            let head = size_of::<VhostUserMemory>();
            if payload.len() < head {
                return Err(ProtocolError::BadSize {
                    request: name(code),
                    size: payload.len(),
                });
            }
            let m: VhostUserMemory = pod(code, &payload[..head])?;
            let n = m.num_regions as usize;
            if n == 0 || n > MAX_ATTACHED_FD_ENTRIES {
                return Err(ProtocolError::BadField {
                    request: name(code),
                    reason: "number of regions is 0 or above the file descriptor limit",
                });
            }
            let rsz = size_of::<VhostUserMemoryRegion>();
            if payload.len() != head + n * rsz {
                return Err(ProtocolError::BadSize {
                    request: name(code),
                    size: payload.len(),
                });
            }
            expect_fds(code, &fds, n)?;
            let regions = payload[head..]
                .chunks_exact(rsz)
                .map(|c| {
                    pod::<VhostUserMemoryRegion>(code, c).map(|r| RegionDesc {
                        gpa: r.guest_phys_addr,
                        size: r.memory_size,
                        uaddr: r.user_addr,
                        mmap_offset: r.mmap_offset,
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
            Request::SetMemTable(regions, fds)
        }
        FrontendReq::SET_VRING_NUM => {
            plain(&fds)?;
            let s: VhostUserVringState = pod(code, payload)?;
            Request::SetVringNum {
                index: s.index,
                num: s.num,
            }
        }
        FrontendReq::SET_VRING_ADDR => {
            plain(&fds)?;
            let a: VhostUserVringAddr = pod(code, payload)?;
            Request::SetVringAddr(VringAddr {
                index: a.index,
                flags: a.flags,
                desc: a.descriptor,
                used: a.used,
                avail: a.available,
                log: a.log,
                valid: a.is_valid(),
            })
        }
        FrontendReq::SET_VRING_BASE => {
            plain(&fds)?;
            let s: VhostUserVringState = pod(code, payload)?;
            Request::SetVringBase {
                index: s.index,
                base: s.num,
            }
        }
        FrontendReq::GET_VRING_BASE => {
            plain(&fds)?;
            let s: VhostUserVringState = pod(code, payload)?;
            Request::GetVringBase { index: s.index }
        }
        FrontendReq::SET_VRING_KICK => Request::SetVringKick(vring_fd(code, payload, fds)?),
        FrontendReq::SET_VRING_CALL => Request::SetVringCall(vring_fd(code, payload, fds)?),
        FrontendReq::SET_VRING_ERR => Request::SetVringErr(vring_fd(code, payload, fds)?),
        FrontendReq::SET_VRING_ENABLE => {
            plain(&fds)?;
            let s: VhostUserVringState = pod(code, payload)?;
            if s.num > 1 {
                return Err(ProtocolError::BadField {
                    request: name(code),
                    reason: "enable is neither 0 nor 1",
                });
            }
            Request::SetVringEnable {
                index: s.index,
                enable: s.num == 1,
            }
        }
        FrontendReq::SET_BACKEND_REQ_FD => {
            no_payload(code, payload)?;
            let mut fds = fds;
            expect_fds(code, &fds, 1)?;
            Request::SetBackendReqFd(fds.pop().ok_or(ProtocolError::BadFds {
                request: name(code),
                expected: 1,
                got: 0,
            })?)
        }
        FrontendReq::IOTLB_MSG => {
            plain(&fds)?;
            Request::Iotlb(
                IotlbMessage::decode(payload).map_err(|_| ProtocolError::BadSize {
                    request: name(code),
                    size: payload.len(),
                })?,
            )
        }
        FrontendReq::SET_LOG_BASE => Request::SetLogBase,
        FrontendReq::SET_LOG_FD => Request::SetLogFd,
        FrontendReq::GET_CONFIG => {
            plain(&fds)?;
            if payload.len() < 12 {
                return Err(ProtocolError::BadSize {
                    request: name(code),
                    size: payload.len(),
                });
            }
            let w = |i: usize| {
                u32::from_le_bytes([payload[i], payload[i + 1], payload[i + 2], payload[i + 3]])
            };
            if payload.len() as u64 != 12 + u64::from(w(4)) {
                return Err(ProtocolError::BadSize {
                    request: name(code),
                    size: payload.len(),
                });
            }
            Request::GetConfig {
                offset: w(0),
                size: w(4),
                flags: w(8),
            }
        }
        _ => Request::Unsupported(code),
    };
    Ok(r)
}

/// Builds a reply message for request `request` with `body`.
pub fn reply(request: u32, body: &[u8]) -> Vec<u8> {
    let h = Header {
        request,
        flags: 0x1 | VhostUserHeaderFlag::REPLY.bits(),
        size: body.len() as u32,
    };
    let mut v = Vec::with_capacity(HEADER_SIZE + body.len());
    v.extend_from_slice(&h.encode());
    v.extend_from_slice(body);
    v
}

/// The backend request telling the frontend that the device misses an
/// IOTLB entry: an `IOTLB_MSG` of type MISS (no reply asked; the frontend
/// answers with an UPDATE on the main socket).
pub fn iotlb_miss(miss: Miss) -> [u8; HEADER_SIZE + IotlbMessage::SIZE] {
    let mut bytes = [0u8; HEADER_SIZE + IotlbMessage::SIZE];
    let header = Header {
        request: BackendReq::IOTLB_MSG.into(),
        // Version 1 (the low bits under `VhostUserHeaderFlag::VERSION`);
        // no reply asked.
        flags: 0x1,
        size: IotlbMessage::SIZE as u32,
    };
    bytes[..HEADER_SIZE].copy_from_slice(&header.encode());
    let body = IotlbMessage::miss(miss.iova, memory::perm_to_vhost(miss.access));
    bytes[HEADER_SIZE..].copy_from_slice(&body.encode());
    bytes
}

/// Builds a u64 reply (also the REPLY_ACK form: 0 is success).
pub fn reply_u64(request: u32, value: u64) -> Vec<u8> {
    reply(request, &value.to_le_bytes())
}

/// Builds a VhostUserVringState reply.
pub fn reply_vring_state(request: u32, index: u32, num: u32) -> Vec<u8> {
    let mut b = [0u8; 8];
    b[0..4].copy_from_slice(&index.to_le_bytes());
    b[4..8].copy_from_slice(&num.to_le_bytes());
    reply(request, &b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn hdr(request: u32, flags: u32, size: u32) -> Vec<u8> {
        Header {
            request,
            flags,
            size,
        }
        .encode()
        .to_vec()
    }

    #[test]
    fn header_validation() {
        assert!(Header::decode(&hdr(1, 1, 0)).is_ok());
        assert!(Header::decode(&hdr(1, 0x9, 8)).unwrap().need_reply());
        assert_eq!(
            Header::decode(&hdr(1, 2, 0)),
            Err(ProtocolError::BadFlags(2))
        );
        assert_eq!(
            Header::decode(&hdr(1, 0x11, 0)),
            Err(ProtocolError::BadFlags(0x11))
        );
        assert_eq!(
            Header::decode(&hdr(1, 1, 0x10000)),
            Err(ProtocolError::TooLarge(0x10000))
        );
        assert_eq!(Header::decode(&[0; 5]), Err(ProtocolError::ShortHeader(5)));
    }

    #[test]
    fn decodes_common_requests() {
        let h = Header::decode(&hdr(2, 1, 8)).unwrap();
        match decode(
            &h,
            &pindown_uapi::features::ACCESS_PLATFORM.to_le_bytes(),
            vec![],
        )
        .unwrap()
        {
            Request::SetFeatures(f) => assert_eq!(f, pindown_uapi::features::ACCESS_PLATFORM),
            r => panic!("{r:?}"),
        }
        let h = Header::decode(&hdr(18, 1, 8)).unwrap();
        let mut p = 3u32.to_le_bytes().to_vec();
        p.extend_from_slice(&1u32.to_le_bytes());
        assert!(matches!(
            decode(&h, &p, vec![]).unwrap(),
            Request::SetVringEnable {
                index: 3,
                enable: true
            }
        ));
        // Unknown code: not an error, the loop replies "unsupported".
        let h = Header::decode(&hdr(9999, 1, 0)).unwrap();
        assert!(matches!(
            decode(&h, &[], vec![]).unwrap(),
            Request::Unsupported(9999)
        ));
        // Kick without fd and without the no-fd bit is malformed.
        let h = Header::decode(&hdr(12, 1, 8)).unwrap();
        assert!(decode(&h, &0u64.to_le_bytes(), vec![]).is_err());
        let r = decode(&h, &0x101u64.to_le_bytes(), vec![]).unwrap();
        assert!(matches!(
            r,
            Request::SetVringKick(VringFd { index: 1, fd: None })
        ));
        // Memory table with the wrong number of fds.
        let h = Header::decode(&hdr(5, 1, 40)).unwrap();
        let mut p = 1u32.to_le_bytes().to_vec();
        p.extend_from_slice(&[0; 4]);
        p.extend_from_slice(&[0; 32]);
        assert!(matches!(
            decode(&h, &p, vec![]),
            Err(ProtocolError::BadFds { .. })
        ));
    }

    #[test]
    fn iotlb_messages_decode_and_misses_encode() {
        let m = IotlbMessage::update(
            0x1000,
            0x2000,
            0x7f00_0000,
            pindown_uapi::VhostAccess::ReadWrite,
        );
        let h = Header::decode(&hdr(22, 1, 32)).unwrap();
        match decode(&h, &m.encode(), vec![]).unwrap() {
            Request::Iotlb(got) => assert_eq!(got, m),
            r => panic!("{r:?}"),
        }
        assert!(matches!(
            decode(&h, &m.encode()[..25], vec![]),
            Err(ProtocolError::BadSize { size: 25, .. })
        ));
        let miss = iotlb_miss(Miss {
            iova: 0x5123,
            access: vm_memory::Permissions::Write,
        });
        let h = Header::decode(&miss).unwrap();
        assert_eq!((h.request, h.size, h.need_reply()), (1, 32, false));
        let body = IotlbMessage::decode(&miss[HEADER_SIZE..]).unwrap();
        assert_eq!(
            body,
            IotlbMessage::miss(0x5123, pindown_uapi::VhostAccess::WriteOnly)
        );
        assert_eq!(body.iotlb_type(), Some(pindown_uapi::VhostIotlbType::Miss));
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
            if let Ok(h) = Header::decode(&bytes) {
                let end = (HEADER_SIZE + h.size as usize).min(bytes.len());
                let _ = decode(&h, &bytes[HEADER_SIZE..end], vec![]);
            }
        }

        #[test]
        fn random_payloads_for_every_code_never_panic(
            code in 0u32..50,
            flags in prop_oneof![Just(1u32), Just(9u32)],
            payload in proptest::collection::vec(any::<u8>(), 0..300),
        ) {
            let h = Header { request: code, flags, size: payload.len() as u32 };
            let _ = decode(&h, &payload, vec![]);
        }
    }
}
