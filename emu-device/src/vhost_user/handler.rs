//! Semantics of each frontend request on a port's state.

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;

use uapi::VhostIotlbType;
use vhost::vhost_user::message::FrontendReq;

use super::conn::RawMessage;
use super::message::{self, ProtocolError, Request};
use crate::memory::{self, MemoryTable};
use crate::port::{features, protocol, PortState, PortStats};

/// Size of the virtio-net config space this device reports.
pub const NET_CONFIG_SIZE: usize = 12;

/// What the connection loop has to do after a request.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Bytes to send back.
    pub reply: Option<Vec<u8>>,
    /// Kick fds or ring states changed: re-sync the event registrations.
    pub rings_changed: bool,
    /// Mappings or ring states changed: process the rings again.
    pub retry: bool,
}

fn set_nonblocking(fd: &impl AsRawFd) {
    let fd = fd.as_raw_fd();
    // SAFETY: fcntl on a descriptor we own, with no pointers involved.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags >= 0 {
            libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK);
        }
    }
}

fn net_config(state: &PortState) -> [u8; NET_CONFIG_SIZE] {
    let mut c = [0u8; NET_CONFIG_SIZE];
    c[0..6].copy_from_slice(&state.mac);
    c[6..8].copy_from_slice(&1u16.to_le_bytes()); // VIRTIO_NET_S_LINK_UP
    c[8..10].copy_from_slice(&state.queue_pairs.to_le_bytes());
    c[10..12].copy_from_slice(&1500u16.to_le_bytes());
    c
}

/// Handles one request. A `ProtocolError` means the message was malformed
/// and the connection should be dropped; request-level failures are
/// answered (when the frontend asked for a reply) and logged.
pub fn handle(
    state: &mut PortState,
    stats: &PortStats,
    msg: RawMessage,
) -> Result<Outcome, ProtocolError> {
    let hdr = msg.header;
    let code = hdr.request;
    let req = message::decode(&hdr, &msg.payload, msg.files)?;
    PortStats::bump(&stats.messages);
    match hdr.code() {
        Some(c) => tracing::debug!(port = state.index, "request {c:?}"),
        None => tracing::debug!(port = state.index, "request {code}"),
    }
    let mut out = Outcome::default();
    let result: Result<(), String> = match req {
        Request::GetFeatures => {
            PortStats::bump(&stats.get_features);
            out.reply = Some(message::reply_u64(code, features::OFFERED));
            Ok(())
        }
        Request::SetFeatures(f) => {
            PortStats::bump(&stats.set_features);
            if f & !features::OFFERED != 0 {
                Err(format!(
                    "features {:#x} were not offered",
                    f & !features::OFFERED
                ))
            } else {
                state.features = f;
                stats
                    .features
                    .store(f, std::sync::atomic::Ordering::Relaxed);
                state.rebuild_memory();
                out.retry = true;
                Ok(())
            }
        }
        Request::GetProtocolFeatures => {
            out.reply = Some(message::reply_u64(code, protocol::OFFERED));
            Ok(())
        }
        Request::SetProtocolFeatures(p) => {
            if p & !protocol::OFFERED != 0 {
                Err(format!("protocol features {p:#x} were not offered"))
            } else {
                state.protocol_features = p;
                Ok(())
            }
        }
        Request::GetQueueNum => {
            let pairs = u64::from(state.queue_pairs) + u64::from(state.guest);
            out.reply = Some(message::reply_u64(code, pairs));
            Ok(())
        }
        Request::GetMaxMemSlots => {
            out.reply = Some(message::reply_u64(
                code,
                vhost::vhost_user::message::MAX_ATTACHED_FD_ENTRIES as u64,
            ));
            Ok(())
        }
        Request::SetOwner => {
            state.owner = true;
            Ok(())
        }
        Request::ResetOwner => {
            let cfg = crate::DeviceConfig {
                queue_pairs: state.queue_pairs,
                queue_size_max: state.vrings[0].queue_max_size(),
                iotlb_entries_max: state.iotlb_entries_max,
                guest_ports: if state.guest {
                    vec![state.index]
                } else {
                    Vec::new()
                },
                ..Default::default()
            };
            state.shared.reset();
            *state = PortState::new(state.index, state.mac, &cfg, state.shared.clone());
            out.rings_changed = true;
            Ok(())
        }
        Request::SetMemTable(descs, files) => {
            if state.table.as_ref().map(|t| t.regions()) == Some(&descs[..]) {
                // QEMU sends the same table once per queue pair.
                PortStats::bump(&stats.set_mem_table);
                Ok(())
            } else {
                match MemoryTable::map(&descs, files) {
                    Ok(t) => {
                        tracing::info!(
                            port = state.index,
                            regions = descs.len(),
                            "memory table set"
                        );
                        PortStats::bump(&stats.set_mem_table);
                        state.table = Some(t);
                        state.rebuild_memory();
                        out.retry = true;
                        Ok(())
                    }
                    Err(e) => Err(e.to_string()),
                }
            }
        }
        Request::SetVringNum { index, num } => match state.vrings.get_mut(index as usize) {
            Some(r) => r
                .set_num(num)
                .map(|_| state.activate_ring(index as usize))
                .map_err(|e| e.to_string()),
            None => Err(format!("no ring {index}")),
        },
        Request::SetVringAddr(a) => {
            let index = a.index as usize;
            if !a.valid {
                Err("misaligned ring address or unknown flags".into())
            } else if a.flags != 0 {
                Err("ring logging is not supported".into())
            } else if let Some(r) = state.vrings.get_mut(index) {
                r.addrs = Some(crate::queues::RingAddrs {
                    desc: a.desc,
                    avail: a.avail,
                    used: a.used,
                });
                state.activate_ring(index);
                out.retry = true;
                Ok(())
            } else {
                Err(format!("no ring {index}"))
            }
        }
        Request::SetVringBase { index, base } => match state.vrings.get_mut(index as usize) {
            Some(_) if base > u16::MAX as u32 => Err(format!("ring base {base} too large")),
            Some(r) => {
                r.base = base as u16;
                if r.queue_ready() {
                    r.reset_position(base as u16);
                }
                Ok(())
            }
            None => Err(format!("no ring {index}")),
        },
        Request::GetVringBase { index } => match state.vrings.get_mut(index as usize) {
            Some(r) => {
                let base = r.stop();
                if state.iommu() {
                    state.forget_translations();
                }
                if state.is_rdma_ring(index as usize) {
                    state.revoke_windows();
                }
                out.reply = Some(message::reply_vring_state(code, index, base as u32));
                out.rings_changed = true;
                Ok(())
            }
            None => {
                out.reply = Some(message::reply_vring_state(code, index, 0));
                Err(format!("no ring {index}"))
            }
        },
        Request::SetVringKick(v) => {
            PortStats::bump(&stats.set_vring_kick);
            let proto = state.protocol_negotiated();
            match state.vrings.get_mut(v.index as usize) {
                Some(r) => {
                    if let Some(f) = &v.fd {
                        set_nonblocking(f);
                    }
                    r.kick = v.fd;
                    r.started = true;
                    if !proto {
                        r.enabled = true;
                    }
                    state.activate_ring(v.index as usize);
                    out.rings_changed = true;
                    out.retry = true;
                    Ok(())
                }
                None => Err(format!("no ring {}", v.index)),
            }
        }
        Request::SetVringCall(v) => match state.vrings.get_mut(v.index as usize) {
            Some(r) => {
                r.call = v.fd;
                Ok(())
            }
            None => Err(format!("no ring {}", v.index)),
        },
        Request::SetVringErr(v) => match state.vrings.get_mut(v.index as usize) {
            Some(r) => {
                r.err = v.fd;
                Ok(())
            }
            None => Err(format!("no ring {}", v.index)),
        },
        Request::SetVringEnable { index, enable } => match state.vrings.get_mut(index as usize) {
            Some(r) => {
                PortStats::bump(&stats.set_vring_enable);
                r.enabled = enable;
                if !enable && state.is_rdma_ring(index as usize) {
                    state.revoke_windows();
                }
                out.rings_changed = true;
                out.retry = true;
                Ok(())
            }
            None => Err(format!("no ring {index}")),
        },
        Request::SetBackendReqFd(f) => {
            PortStats::bump(&stats.set_backend_req_fd);
            let s = UnixStream::from(OwnedFd::from(f));
            state.backend = Some(s);
            Ok(())
        }
        Request::Iotlb(m) => match m.iotlb_type() {
            Some(VhostIotlbType::Update) => {
                PortStats::bump(&stats.iotlb_updates);
                iotlb_update(state, m.iova, m.size, m.uaddr, m.perm).map(|_| {
                    out.retry = true;
                })
            }
            Some(VhostIotlbType::Invalidate) => {
                PortStats::bump(&stats.iotlb_invalidates);
                state.iotlb_invalidate(m.iova, m.size);
                Ok(())
            }
            Some(VhostIotlbType::AccessFail) => {
                tracing::warn!(
                    port = state.index,
                    iova = m.iova,
                    "frontend reports IOTLB access failure"
                );
                Ok(())
            }
            other => Err(format!(
                "unexpected IOTLB message type {} ({other:?})",
                m.msg_type
            )),
        },
        Request::SetLogBase | Request::SetLogFd => Err("dirty logging is not supported".into()),
        Request::GetConfig {
            offset,
            size,
            flags,
        } => {
            let cfg = net_config(state);
            let mut body = Vec::new();
            let ok = size as usize <= 256 && offset as usize <= 0x1000;
            let sz = if ok { size } else { 0 };
            body.extend_from_slice(&offset.to_le_bytes());
            body.extend_from_slice(&sz.to_le_bytes());
            body.extend_from_slice(&flags.to_le_bytes());
            for i in 0..sz as usize {
                body.push(cfg.get(offset as usize + i).copied().unwrap_or(0));
            }
            out.reply = Some(message::reply(code, &body));
            if ok {
                Ok(())
            } else {
                Err("config access out of range".into())
            }
        }
        Request::Unsupported(c) => {
            let name = FrontendReq::try_from(c)
                .map(|r| format!("{r:?}"))
                .unwrap_or_else(|_| c.to_string());
            Err(format!("unsupported request {name}"))
        }
    };
    if let Err(e) = &result {
        PortStats::bump(&stats.errors);
        tracing::warn!(port = state.index, request = code, "request failed: {e}");
    }
    if out.reply.is_none() && hdr.need_reply() {
        out.reply = Some(message::reply_u64(code, u64::from(result.is_err())));
    }
    Ok(out)
}

fn iotlb_update(
    state: &mut PortState,
    iova: u64,
    size: u64,
    uaddr: u64,
    perm: u8,
) -> Result<(), String> {
    let perm = memory::perm_from_vhost(perm).ok_or_else(|| format!("bad permission {perm}"))?;
    let table = state
        .table
        .as_ref()
        .ok_or("IOTLB update before the memory table")?;
    let backed: u64 = table.uaddr_segments(uaddr, size).iter().map(|s| s.2).sum();
    if size == 0 || backed != size {
        return Err(format!(
            "IOTLB update {iova:#x}+{size:#x} -> {uaddr:#x} is not backed by the memory table"
        ));
    }
    let evicted = state
        .iotlb_update(iova, size, uaddr, perm)
        .map_err(|e| e.to_string())?;
    if evicted > 0 {
        tracing::debug!(
            port = state.index,
            evicted,
            "IOTLB full, evicted oldest entries"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vhost_user::message::Header;
    use crate::DeviceConfig;
    use proptest::prelude::*;
    use std::io::Write;

    fn msg(request: u32, flags: u32, payload: Vec<u8>, files: Vec<std::fs::File>) -> RawMessage {
        RawMessage {
            header: Header {
                request,
                flags,
                size: payload.len() as u32,
            },
            payload,
            files,
        }
    }

    fn with_memory() -> (PortState, PortStats) {
        let cfg = DeviceConfig::default();
        let mut st = PortState::new(0, [2, 0, 0, 0, 0, 1], &cfg, Default::default());
        let stats = PortStats::default();
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(&vec![0u8; 0x10000]).unwrap();
        let mut p = 1u32.to_le_bytes().to_vec();
        p.extend_from_slice(&[0; 4]);
        for v in [0x1000_0000u64, 0x10000, 0x7f00_0000, 0] {
            p.extend_from_slice(&v.to_le_bytes());
        }
        let out = handle(&mut st, &stats, msg(5, 0x9, p, vec![f])).unwrap();
        assert_eq!(out.reply.unwrap()[12..], 0u64.to_le_bytes());
        (st, stats)
    }

    #[test]
    fn need_reply_gets_an_ack_and_errors_are_nonzero() {
        let (mut st, stats) = with_memory();
        // SET_VRING_NUM on a ring beyond 2P+1: error ack, state unchanged.
        let mut p = 99u32.to_le_bytes().to_vec();
        p.extend_from_slice(&16u32.to_le_bytes());
        let out = handle(&mut st, &stats, msg(8, 0x9, p, vec![])).unwrap();
        assert_eq!(out.reply.unwrap()[12..], 1u64.to_le_bytes());
        // The RDMA queues (2P, 2P+1) are accepted.
        for ring in [4u32, 5] {
            let mut p = ring.to_le_bytes().to_vec();
            p.extend_from_slice(&64u32.to_le_bytes());
            let out = handle(&mut st, &stats, msg(8, 0x9, p, vec![])).unwrap();
            assert_eq!(out.reply.unwrap()[12..], 0u64.to_le_bytes());
        }
        // Non-power-of-two size is refused.
        let mut p = 0u32.to_le_bytes().to_vec();
        p.extend_from_slice(&100u32.to_le_bytes());
        let out = handle(&mut st, &stats, msg(8, 0x9, p, vec![])).unwrap();
        assert_eq!(out.reply.unwrap()[12..], 1u64.to_le_bytes());
        // GET_QUEUE_NUM counts queue pairs.
        let out = handle(&mut st, &stats, msg(17, 0x1, vec![], vec![])).unwrap();
        assert_eq!(out.reply.unwrap()[12..], 2u64.to_le_bytes());
        // IOTLB update inside the table is accepted, outside refused.
        let m =
            uapi::IotlbMessage::update(0x1000, 0x1000, 0x7f00_1000, uapi::VhostAccess::ReadWrite);
        let out = handle(&mut st, &stats, msg(22, 0x9, m.encode().to_vec(), vec![])).unwrap();
        assert_eq!(out.reply.unwrap()[12..], 0u64.to_le_bytes());
        assert_eq!(st.iotlb_len(), 1);
        let bad = uapi::IotlbMessage {
            uaddr: 0x7f00_f800,
            ..m
        };
        let out = handle(&mut st, &stats, msg(22, 0x9, bad.encode().to_vec(), vec![])).unwrap();
        assert_eq!(out.reply.unwrap()[12..], 1u64.to_le_bytes());
        assert_eq!(st.iotlb_len(), 1);
    }

    #[test]
    fn vring_enable_before_features_is_remembered() {
        let cfg = DeviceConfig::default();
        let mut st = PortState::new(0, [2, 0, 0, 0, 0, 1], &cfg, Default::default());
        let stats = PortStats::default();
        let mut p = 1u32.to_le_bytes().to_vec();
        p.extend_from_slice(&1u32.to_le_bytes());
        let out = handle(&mut st, &stats, msg(18, 0x1, p, vec![])).unwrap();
        assert!(out.reply.is_none());
        assert!(st.vrings[1].enabled);
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]
        #[test]
        fn random_request_sequences_never_panic(
            reqs in proptest::collection::vec(
                (0u32..46, prop_oneof![Just(1u32), Just(9u32)],
                 proptest::collection::vec(any::<u8>(), 0..80), 0usize..3),
                1..12),
        ) {
            let (mut st, stats) = with_memory();
            for (code, flags, payload, nfiles) in reqs {
                let files = (0..nfiles)
                    .map(|_| std::fs::File::open("/dev/null").unwrap())
                    .collect();
                let _ = handle(&mut st, &stats, msg(code, flags, payload, files));
            }
        }
    }
}
