//! Semantics of each frontend request on a port's state.

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;

use pindown_uapi::VhostIotlbType;
use vhost::vhost_user::message::FrontendReq;

use super::conn::RawMessage;
use super::message::{self, ProtocolError, Request};
use crate::memory::{self, MemoryTable};
use crate::port::{features, protocol, PortState, PortStats};

/// Size of the virtio-net config space this device reports.
pub const NET_CONFIG_SIZE: usize = 12;

/// What the connection loop has to do after a request.
#[derive(Debug, Default)]
pub struct Handled {
    /// Bytes to send back.
    pub reply: Option<Vec<u8>>,
    /// Kick fds or ring states changed: re-sync the event registrations.
    pub rings_changed: bool,
    /// Mappings or ring states changed: process the rings again.
    pub retry: bool,
}

fn net_config(state: &PortState) -> [u8; NET_CONFIG_SIZE] {
    let mut c = [0u8; NET_CONFIG_SIZE];
    c[0..6].copy_from_slice(&state.mac);
    c[6..8].copy_from_slice(&1u16.to_le_bytes()); // VIRTIO_NET_S_LINK_UP
    c[8..10].copy_from_slice(&state.queue_pairs.to_le_bytes());
    c[10..12].copy_from_slice(&1500u16.to_le_bytes());
    c
}

/// Handles one request.
///
/// A request that cannot be honoured — a payload that is truncated,
/// oversized or inconsistent, missing or extra file descriptors, a value the
/// device refuses — leaves the port's state as it was (unless said
/// otherwise below), is logged with the port, the request and the reason,
/// and is answered as failed (REPLY_ACK with a non-zero status) when the
/// frontend asked for a reply. `Err` is returned only for a malformed
/// request that the frontend always expects a specific reply to
/// ([`message::reply_required`]): there is no way to answer it, and the
/// connection should be dropped.
pub fn handle(
    state: &mut PortState,
    stats: &PortStats,
    msg: RawMessage,
) -> Result<Handled, ProtocolError> {
    let hdr = msg.header;
    let code = hdr.request;
    PortStats::bump(&stats.messages);
    match hdr.code() {
        Some(c) => tracing::debug!(port = state.index, "request {c:?}"),
        None => tracing::debug!(port = state.index, "request {code}"),
    }
    let mut out = Handled::default();
    let result = match message::decode(&hdr, &msg.payload, msg.files) {
        Ok(req) => serve(state, stats, code, req, &mut out),
        Err(e) if message::reply_required(code) => {
            PortStats::bump(&stats.errors);
            tracing::warn!(
                port = state.index,
                request = message::name(code),
                "malformed request that needs a reply, dropping the connection: {e}"
            );
            return Err(e);
        }
        Err(e) => Err(e.to_string()),
    };
    if let Err(e) = &result {
        PortStats::bump(&stats.errors);
        tracing::warn!(
            port = state.index,
            request = message::name(code),
            code,
            "request failed: {e}"
        );
    }
    if out.reply.is_none() && hdr.need_reply() {
        out.reply = Some(message::reply_u64(code, u64::from(result.is_err())));
    }
    Ok(out)
}

/// Applies one decoded request to the port.
fn serve(
    state: &mut PortState,
    stats: &PortStats,
    code: u32,
    req: Request,
    out: &mut Handled,
) -> Result<(), String> {
    let rings = state.vrings.len();
    let no_ring = |index: u32| format!("no ring {index} (the port has rings 0 to {})", rings - 1);
    match req {
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
            let rdma = if state.guest {
                state.rdma_queue_pairs
            } else {
                0
            };
            let pairs = u64::from(state.queue_pairs) + u64::from(rdma);
            out.reply = Some(message::reply_u64(code, pairs));
            Ok(())
        }
        Request::GetMaxMemSlots => {
            out.reply = Some(message::reply_u64(code, memory::MAX_REGIONS as u64));
            Ok(())
        }
        Request::SetOwner => {
            state.owner = true;
            Ok(())
        }
        Request::ResetOwner => {
            let cfg = crate::DeviceConfig {
                queue_pairs: state.queue_pairs,
                rdma_queue_pairs: state.rdma_queue_pairs,
                queue_size_max: state.vrings[0].queue_max_size(),
                iotlb_entries_max: state.iotlb_entries_max,
                guest_ports: if state.guest {
                    vec![state.index]
                } else {
                    Vec::new()
                },
                max_mapped_bytes_per_port: state.max_mapped_bytes,
                ..Default::default()
            };
            state.shared.reset();
            *state = PortState::new(state.index, state.mac, &cfg, state.shared.clone());
            out.rings_changed = true;
            Ok(())
        }
        Request::SetMemTable(descs, files) => {
            if state
                .table
                .as_ref()
                .is_some_and(|t| t.is_same(&descs, &files))
            {
                // QEMU sends the same table once per queue pair.
                PortStats::bump(&stats.set_mem_table);
                return Ok(());
            }
            // Windows name IOVAs when ACCESS_PLATFORM is on: the IOTLB,
            // which carries over, decides what they reach, so they stay.
            // Without it they name guest physical addresses: they stay
            // only when every old region stays.
            let keep_windows = state
                .table
                .as_ref()
                .is_some_and(|old| state.iommu() || old.is_kept_by(&descs, &files));
            let t =
                MemoryTable::map_after(&descs, files, state.max_mapped_bytes, state.table.as_ref())
                    .map_err(|e| e.to_string())?;
            tracing::info!(
                port = state.index,
                regions = descs.len(),
                bytes = t.mapped_bytes(),
                guarded = t.guarded_regions(),
                "memory table set"
            );
            PortStats::bump(&stats.set_mem_table);
            state.table = Some(t);
            if keep_windows {
                state.replace_memory_table();
            } else {
                state.rebuild_memory();
            }
            // The old table is unused now: unmap it.
            crate::sigbus::release_unused();
            out.retry = true;
            Ok(())
        }
        Request::SetVringNum { index, num } => {
            let r = state
                .vrings
                .get_mut(index as usize)
                .ok_or_else(|| no_ring(index))?;
            r.set_num(num).map_err(|e| e.to_string())?;
            state
                .activate_ring(index as usize)
                .map_err(|e| format!("cannot start ring {index}: {e}"))
        }
        Request::SetVringAddr(a) => {
            let index = a.index as usize;
            let iommu = state.iommu();
            let r = state
                .vrings
                .get_mut(index)
                .ok_or_else(|| no_ring(a.index))?;
            if !a.valid {
                return Err("misaligned ring address or unknown flags".into());
            }
            if a.flags != 0 {
                return Err("ring logging is not supported".into());
            }
            let addrs = crate::queues::RingAddrs {
                desc: a.desc,
                avail: a.avail,
                used: a.used,
            };
            // Frontend addresses are checked against the memory table now;
            // IOVAs are translated when the ring runs (the IOTLB may fill on
            // demand). Without a table yet, the check is made when the ring
            // starts.
            if let (false, Some(table)) = (iommu, state.table.as_ref()) {
                addrs
                    .to_gpa(table, r.size)
                    .map_err(|e| format!("ring {index}: {e}"))?;
            }
            r.addrs = Some(addrs);
            out.retry = true;
            state
                .activate_ring(index)
                .map_err(|e| format!("cannot start ring {index}: {e}"))
        }
        Request::SetVringBase { index, base } => {
            let r = state
                .vrings
                .get_mut(index as usize)
                .ok_or_else(|| no_ring(index))?;
            let base = u16::try_from(base)
                .map_err(|_| format!("ring base {base} is beyond the ring's 16-bit index space"))?;
            r.base = base;
            if r.queue_ready() {
                r.reset_position(base);
            }
            Ok(())
        }
        Request::GetVringBase { index } => match state.vrings.get_mut(index as usize) {
            Some(r) => {
                let base = r.stop();
                if state.iommu() {
                    state.forget_translations();
                }
                if state.is_admin_ring(index as usize) {
                    state.revoke_windows();
                }
                out.reply = Some(message::reply_vring_state(code, index, base as u32));
                out.rings_changed = true;
                Ok(())
            }
            None => {
                out.reply = Some(message::reply_vring_state(code, index, 0));
                Err(no_ring(index))
            }
        },
        Request::SetVringKick(v) => {
            PortStats::bump(&stats.set_vring_kick);
            let proto = state.protocol_negotiated();
            let r = state
                .vrings
                .get_mut(v.index as usize)
                .ok_or_else(|| no_ring(v.index))?;
            r.set_kick(v.fd);
            r.started = true;
            if !proto {
                r.enabled = true;
            }
            out.rings_changed = true;
            out.retry = true;
            state
                .activate_ring(v.index as usize)
                .map_err(|e| format!("cannot start ring {}: {e}", v.index))
        }
        Request::SetVringCall(v) => {
            let r = state
                .vrings
                .get_mut(v.index as usize)
                .ok_or_else(|| no_ring(v.index))?;
            r.set_call(v.fd);
            Ok(())
        }
        Request::SetVringErr(v) => {
            let r = state
                .vrings
                .get_mut(v.index as usize)
                .ok_or_else(|| no_ring(v.index))?;
            r.set_err(v.fd);
            Ok(())
        }
        Request::SetVringEnable { index, enable } => {
            let r = state
                .vrings
                .get_mut(index as usize)
                .ok_or_else(|| no_ring(index))?;
            PortStats::bump(&stats.set_vring_enable);
            r.set_enabled(enable);
            let restart = enable && r.broken;
            if !enable && state.is_admin_ring(index as usize) {
                state.revoke_windows();
            }
            out.rings_changed = true;
            out.retry = true;
            if restart {
                // Enabling a ring the frontend broke restarts it.
                state
                    .activate_ring(index as usize)
                    .map_err(|e| format!("cannot restart ring {index}: {e}"))?;
            }
            Ok(())
        }
        Request::SetBackendReqFd(f) => {
            PortStats::bump(&stats.set_backend_req_fd);
            use std::os::unix::fs::FileTypeExt;
            let is_socket = f
                .metadata()
                .map(|m| m.file_type().is_socket())
                .unwrap_or(false);
            if !is_socket {
                return Err("the backend request channel is not a socket".into());
            }
            let s = UnixStream::from(OwnedFd::from(f));
            state.backend = Some(s);
            Ok(())
        }
        Request::Iotlb(m) => match m.iotlb_type() {
            Some(VhostIotlbType::Update) => {
                PortStats::bump(&stats.iotlb_updates);
                iotlb_update(state, m.iova, m.size, m.uaddr, m.perm)?;
                out.retry = true;
                Ok(())
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
    }
}

fn iotlb_update(
    state: &mut PortState,
    iova: u64,
    size: u64,
    uaddr: u64,
    perm: u8,
) -> Result<(), String> {
    let perm = match memory::perm_from_vhost(perm) {
        Some(vm_memory::Permissions::No) => {
            return Err(format!(
                "IOTLB update {iova:#x}+{size:#x} carries no access permission"
            ))
        }
        Some(p) => p,
        None => return Err(format!("bad IOTLB permission {perm:#x}")),
    };
    if size == 0 {
        return Err(format!("IOTLB update at {iova:#x} has size 0"));
    }
    if iova.checked_add(size).is_none() || uaddr.checked_add(size).is_none() {
        return Err(format!(
            "IOTLB update {iova:#x}+{size:#x} -> {uaddr:#x} wraps around the address space"
        ));
    }
    let table = state
        .table
        .as_ref()
        .ok_or("IOTLB update before the memory table")?;
    let backed: u64 = table.uaddr_segments(uaddr, size).iter().map(|s| s.2).sum();
    if backed != size {
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
    use crate::testing::payload;
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
        let mut f = tempfile::tempfile_in("/dev/shm").unwrap();
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
    fn the_same_table_over_other_files_is_a_new_table() {
        let (mut st, stats) = with_memory();
        let table = |byte: u8| {
            let mut f = tempfile::tempfile_in("/dev/shm").unwrap();
            f.write_all(&vec![byte; 0x10000]).unwrap();
            let mut p = 1u32.to_le_bytes().to_vec();
            p.extend_from_slice(&[0; 4]);
            for v in [0x1000_0000u64, 0x10000, 0x7f00_0000, 0] {
                p.extend_from_slice(&v.to_le_bytes());
            }
            (p, f)
        };
        let read = |st: &PortState| {
            use vm_memory::Bytes;
            let shared = st.shared.access();
            let memory = shared.memory.as_ref().unwrap();
            let mut b = [0u8; 1];
            memory
                .table()
                .mmap()
                .read_slice(&mut b, vm_memory::GuestAddress(0x1000_0000))
                .unwrap();
            b[0]
        };
        assert_eq!(read(&st), 0);
        // Same regions, another file: the device maps the new file.
        let (p, f) = table(0x5a);
        let keep = f.try_clone().unwrap();
        let out = handle(&mut st, &stats, msg(5, 0x9, p.clone(), vec![f])).unwrap();
        assert_eq!(out.reply.unwrap()[12..], 0u64.to_le_bytes());
        assert_eq!(read(&st), 0x5a);
        // The same regions of the same file again: nothing changes.
        let out = handle(&mut st, &stats, msg(5, 0x9, p, vec![keep])).unwrap();
        assert_eq!(out.reply.unwrap()[12..], 0u64.to_le_bytes());
        assert_eq!(read(&st), 0x5a);
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
        let m = pindown_uapi::IotlbMessage::update(
            0x1000,
            0x1000,
            0x7f00_1000,
            pindown_uapi::VhostAccess::ReadWrite,
        );
        let out = handle(&mut st, &stats, msg(22, 0x9, m.encode().to_vec(), vec![])).unwrap();
        assert_eq!(out.reply.unwrap()[12..], 0u64.to_le_bytes());
        assert_eq!(st.iotlb_len(), 1);
        let bad = pindown_uapi::IotlbMessage {
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

    /// Sends a request asking for a reply; returns the REPLY_ACK status.
    fn status(
        st: &mut PortState,
        stats: &PortStats,
        code: u32,
        payload: Vec<u8>,
        files: Vec<std::fs::File>,
    ) -> u64 {
        let out = handle(st, stats, msg(code, 0x9, payload, files)).expect("answered");
        let reply = out.reply.expect("a reply");
        u64::from_le_bytes(reply[12..20].try_into().unwrap())
    }

    fn iotlb(iova: u64, size: u64, uaddr: u64, perm: u8, kind: VhostIotlbType) -> Vec<u8> {
        pindown_uapi::IotlbMessage {
            iova,
            size,
            uaddr,
            perm,
            msg_type: kind as u8,
        }
        .encode()
        .to_vec()
    }

    const NUM: u32 = 8;
    const ADDR: u32 = 9;
    const BASE: u32 = 10;
    const GET_BASE: u32 = 11;
    const KICK: u32 = 12;
    const ENABLE: u32 = 18;
    const IOTLB: u32 = 22;
    const MEM: u32 = 5;
    /// Frontend address and guest physical address of the test memory.
    const UADDR: u64 = 0x7f00_0000;
    const GPA: u64 = 0x1000_0000;

    #[test]
    fn ring_sizes_and_bases_are_validated() {
        let (mut st, stats) = with_memory();
        for bad in [0, 3, 100, 2048, u32::MAX] {
            assert_eq!(
                status(&mut st, &stats, NUM, payload::vring_state(1, bad), vec![]),
                1,
                "{bad}"
            );
        }
        assert_eq!(st.vrings[1].size, 0, "refused sizes leave the ring alone");
        assert_eq!(
            status(&mut st, &stats, NUM, payload::vring_state(1, 1024), vec![]),
            0
        );
        assert_eq!(
            status(&mut st, &stats, NUM, payload::vring_state(99, 16), vec![]),
            1
        );
        assert_eq!(
            status(
                &mut st,
                &stats,
                BASE,
                payload::vring_state(1, 0x1_0000),
                vec![]
            ),
            1
        );
        assert_eq!(
            status(
                &mut st,
                &stats,
                BASE,
                payload::vring_state(1, 0xffff),
                vec![]
            ),
            0
        );
        assert_eq!(st.vrings[1].base, 0xffff);
        assert_eq!(
            status(&mut st, &stats, BASE, payload::vring_state(99, 0), vec![]),
            1
        );
    }

    #[test]
    fn ring_addresses_outside_the_memory_table_are_refused() {
        let (mut st, stats) = with_memory();
        assert_eq!(
            status(&mut st, &stats, NUM, payload::vring_state(1, 16), vec![]),
            0
        );
        let good = (UADDR, UADDR + 0xe000, UADDR + 0x1000);
        // The descriptor table (256 bytes) would cross the end of the region.
        let cases = [
            (UADDR + 0xff10, good.1, good.2),
            (good.0, 0x1234_0000, good.2),
            (good.0, good.1, UADDR + 0x1_0000),
            (good.0, good.1, u64::MAX - 1),
        ];
        for (desc, used, avail) in cases {
            let p = payload::vring_addr(1, 0, desc, used, avail);
            assert_eq!(status(&mut st, &stats, ADDR, p, vec![]), 1);
            assert_eq!(st.vrings[1].addrs, None, "refused addresses are not kept");
        }
        // Misaligned, or with logging asked for.
        let p = payload::vring_addr(1, 0, good.0 + 8, good.1, good.2);
        assert_eq!(status(&mut st, &stats, ADDR, p, vec![]), 1);
        let p = payload::vring_addr(1, 1, good.0, good.1, good.2);
        assert_eq!(status(&mut st, &stats, ADDR, p, vec![]), 1);
        let p = payload::vring_addr(1, 0, good.0, good.1, good.2);
        assert_eq!(status(&mut st, &stats, ADDR, p, vec![]), 0);
        assert_eq!(
            status(
                &mut st,
                &stats,
                KICK,
                0x101u64.to_le_bytes().to_vec(),
                vec![]
            ),
            0
        );
        assert!(st.vrings[1].active());
        // A larger ring no longer fits: refused, and said so.
        assert_eq!(
            status(&mut st, &stats, NUM, payload::vring_state(1, 1024), vec![]),
            1
        );
        assert!(!st.vrings[1].active());
    }

    #[test]
    fn iotlb_updates_that_wrap_or_carry_no_permission_are_refused() {
        let (mut st, stats) = with_memory();
        let update =
            |iova, size, uaddr, perm| iotlb(iova, size, uaddr, perm, VhostIotlbType::Update);
        for p in [
            update(0x1000, 0x1000, UADDR, 0),
            update(0x1000, 0x1000, UADDR, 4),
            update(0x1000, 0, UADDR, 3),
            update(u64::MAX - 0xfff, 0x2000, UADDR, 3),
            update(0x1000, 0x2000, u64::MAX - 0xfff, 3),
            update(0x1000, 0x2000, UADDR + 0xf000, 3),
            iotlb(0x1000, 0x1000, UADDR, 3, VhostIotlbType::Miss),
        ] {
            assert_eq!(status(&mut st, &stats, IOTLB, p, vec![]), 1);
        }
        assert_eq!(st.iotlb_len(), 0);
        assert_eq!(
            status(
                &mut st,
                &stats,
                IOTLB,
                update(0x1000, 0x1000, UADDR, 1),
                vec![]
            ),
            0
        );
        assert_eq!(st.iotlb_len(), 1);
        // Invalidating a range that wraps only invalidates more.
        let p = iotlb(0x800, u64::MAX, 0, 0, VhostIotlbType::Invalidate);
        assert_eq!(status(&mut st, &stats, IOTLB, p, vec![]), 0);
        assert_eq!(st.iotlb_len(), 0);
    }

    #[test]
    fn malformed_payloads_are_refused_and_the_connection_kept() {
        let (mut st, stats) = with_memory();
        let file = || tempfile::tempfile_in("/dev/shm").unwrap();
        let cases: Vec<(u32, Vec<u8>, Vec<std::fs::File>)> = vec![
            (2, vec![0; 7], vec![]),                // SET_FEATURES truncated
            (2, vec![0; 9], vec![]),                // oversized
            (2, vec![0; 8], vec![file()]),          // with an fd
            (3, vec![0; 0], vec![]),                // SET_OWNER is fine...
            (3, vec![0; 8], vec![]),                // ...but takes no payload
            (NUM, vec![0; 12], vec![]),             // SET_VRING_NUM oversized
            (ADDR, vec![0; 39], vec![]),            // SET_VRING_ADDR truncated
            (MEM, payload::mem_table(&[]), vec![]), // zero regions
            (MEM, payload::mem_table(&[(0, 0x1000, 0, 0); 33]), vec![]), // too many
            (MEM, payload::mem_table(&[(0, 0x1000, 0, 0)]), vec![]), // missing fd
            (
                MEM,
                payload::mem_table(&[(0, 0x1000, 0, 0)]),
                vec![file(), file()],
            ), // extra fd
            (
                MEM,
                payload::mem_table(&[(0, 0x1000, 0, 0)])[..30].to_vec(),
                vec![file()],
            ),
            (KICK, 0x101u64.to_le_bytes().to_vec(), vec![file()]), // fd despite "no fd"
            (KICK, 0x1u64.to_le_bytes().to_vec(), vec![]),         // no fd without "no fd"
            (KICK, 0x1_0001u64.to_le_bytes().to_vec(), vec![]),    // reserved bits
            (IOTLB, vec![0; 26], vec![]),                          // short IOTLB message
            (ENABLE, payload::vring_state(1, 2), vec![]),          // enable is 0 or 1
            (21, vec![], vec![]),                                  // SET_BACKEND_REQ_FD without fd
            (999, vec![1, 2, 3], vec![file()]),                    // unknown request
        ];
        for (i, (code, payload, files)) in cases.into_iter().enumerate() {
            let expected = u64::from(i != 3);
            assert_eq!(
                status(&mut st, &stats, code, payload, files),
                expected,
                "case {i}"
            );
        }
        assert_eq!(
            st.table.as_ref().unwrap().regions()[0].size,
            0x10000,
            "old table kept"
        );
        // Requests whose reply has its own form cannot be answered "failed".
        assert!(handle(&mut st, &stats, msg(GET_BASE, 0x1, vec![0; 4], vec![])).is_err());
        assert!(handle(&mut st, &stats, msg(1, 0x1, vec![0; 8], vec![])).is_err());
        assert!(handle(&mut st, &stats, msg(1, 0x1, vec![], vec![file()])).is_err());
    }

    #[test]
    fn memory_tables_beyond_the_bound_or_on_devices_are_refused() {
        let (mut st, stats) = with_memory();
        let p = payload::mem_table(&[(0, 0x1000, 0x1000, 0)]);
        let zero = std::fs::File::open("/dev/zero").unwrap();
        assert_eq!(status(&mut st, &stats, MEM, p.clone(), vec![zero]), 1);
        st.max_mapped_bytes = 0x8000;
        let f = tempfile::tempfile_in("/dev/shm").unwrap();
        f.set_len(0x10000).unwrap();
        let p = payload::mem_table(&[(0, 0x9000, 0x1000, 0)]);
        assert_eq!(
            status(&mut st, &stats, MEM, p, vec![f.try_clone().unwrap()]),
            1
        );
        assert_eq!(st.table.as_ref().unwrap().regions()[0].gpa, GPA);
        let p = payload::mem_table(&[(0, 0x8000, 0x1000, 0)]);
        assert_eq!(status(&mut st, &stats, MEM, p, vec![f]), 0);
        // The backend channel must be a socket.
        let file = tempfile::tempfile_in("/dev/shm").unwrap();
        assert_eq!(status(&mut st, &stats, 21, vec![], vec![file]), 1);
        let (a, _b) = UnixStream::pair().unwrap();
        let a = std::fs::File::from(OwnedFd::from(a));
        assert_eq!(status(&mut st, &stats, 21, vec![], vec![a]), 0);
    }

    /// Writes descriptor `i` of the ring at GPA: (addr, len, flags, next).
    fn put_desc(st: &PortState, i: u64, addr: u64, len: u32, flags: u16, next: u16) {
        use vm_memory::{Bytes, GuestAddress};
        let m = st.table.as_ref().unwrap().mmap();
        let d = GPA + 16 * i;
        m.write_obj(addr, GuestAddress(d)).unwrap();
        m.write_obj(len, GuestAddress(d + 8)).unwrap();
        m.write_obj(flags, GuestAddress(d + 12)).unwrap();
        m.write_obj(next, GuestAddress(d + 14)).unwrap();
    }

    /// Publishes head `head` at avail slot `slot` and sets the avail index.
    fn put_avail(st: &PortState, slot: u64, head: u16, idx: u16) {
        use vm_memory::{Bytes, GuestAddress};
        let m = st.table.as_ref().unwrap().mmap();
        m.write_obj(head, GuestAddress(GPA + 0x1000 + 4 + 2 * slot))
            .unwrap();
        m.write_obj(idx, GuestAddress(GPA + 0x1000 + 2)).unwrap();
    }

    fn pop(st: &mut PortState) -> crate::queues::Pop {
        let shared = st.shared.clone();
        let gate = shared.access();
        let mem = gate.memory.as_ref().unwrap();
        let ring = &mut st.vrings[1];
        let popped = crate::queues::pop_chain(ring, mem);
        if let crate::queues::Pop::Broken(e) = &popped {
            ring.break_off(0, e);
        }
        popped
    }

    #[test]
    fn a_ring_the_frontend_broke_stops_and_can_be_reset() {
        use crate::queues::Pop;
        let (mut st, stats) = with_memory();
        assert_eq!(
            status(&mut st, &stats, NUM, payload::vring_state(1, 16), vec![]),
            0
        );
        let p = payload::vring_addr(1, 0, UADDR, UADDR + 0x2000, UADDR + 0x1000);
        assert_eq!(status(&mut st, &stats, ADDR, p, vec![]), 0);
        assert_eq!(
            status(
                &mut st,
                &stats,
                KICK,
                0x101u64.to_le_bytes().to_vec(),
                vec![]
            ),
            0
        );
        const NEXT: u16 = 1;

        // A descriptor that points to itself: the ring stops at that chain.
        put_desc(&st, 0, GPA + 0x4000, 64, NEXT, 0);
        put_avail(&st, 0, 0, 1);
        assert!(matches!(pop(&mut st), Pop::Broken(_)));
        assert!(st.vrings[1].broken && !st.vrings[1].active());
        // GET_VRING_BASE reports the offending chain's position.
        let out = handle(
            &mut st,
            &stats,
            msg(GET_BASE, 0x1, payload::vring_state(1, 0), vec![]),
        )
        .unwrap();
        assert_eq!(out.reply.unwrap()[12..], payload::vring_state(1, 0)[..]);
        // Repaired and restarted (base, kick): the chain is served.
        put_desc(&st, 0, GPA + 0x4000, 64, 0, 0);
        assert_eq!(
            status(&mut st, &stats, BASE, payload::vring_state(1, 0), vec![]),
            0
        );
        assert_eq!(
            status(
                &mut st,
                &stats,
                KICK,
                0x101u64.to_le_bytes().to_vec(),
                vec![]
            ),
            0
        );
        match pop(&mut st) {
            Pop::Chain(c) => assert_eq!((c.head, c.bufs.len()), (0, 1)),
            other => panic!("{other:?}"),
        }

        // A chain longer than the ring (17 linked descriptors in 16 slots
        // can only be a loop), and a next index outside the table.
        for i in 0..16 {
            put_desc(&st, i, GPA + 0x4000, 8, NEXT, ((i + 1) % 16) as u16);
        }
        put_avail(&st, 1, 3, 2);
        assert!(matches!(pop(&mut st), Pop::Broken(_)));
        // SET_VRING_ENABLE restarts it; still broken, it stops again.
        assert_eq!(
            status(&mut st, &stats, ENABLE, payload::vring_state(1, 1), vec![]),
            0
        );
        assert!(st.vrings[1].active());
        assert!(matches!(pop(&mut st), Pop::Broken(_)));
        put_desc(&st, 3, GPA + 0x4000, 8, NEXT, 200);
        assert_eq!(
            status(&mut st, &stats, ENABLE, payload::vring_state(1, 1), vec![]),
            0
        );
        assert!(matches!(pop(&mut st), Pop::Broken(_)));

        // An available index that jumps by more than the ring size.
        put_desc(&st, 3, GPA + 0x4000, 8, 0, 0);
        put_avail(&st, 1, 3, 40);
        assert_eq!(
            status(&mut st, &stats, ENABLE, payload::vring_state(1, 1), vec![]),
            0
        );
        assert!(matches!(pop(&mut st), Pop::Broken(_)));
        put_avail(&st, 1, 3, 2);
        assert_eq!(
            status(&mut st, &stats, ENABLE, payload::vring_state(1, 1), vec![]),
            0
        );
        match pop(&mut st) {
            Pop::Chain(c) => assert_eq!((c.head, c.bufs.len()), (3, 1)),
            other => panic!("{other:?}"),
        }

        // Lengths 0 and 2^32-1 are refused chain by chain, not the ring.
        for (slot, len) in [(2u64, 0u32), (3, u32::MAX)] {
            put_desc(&st, 5, GPA + 0x4000, len, 0, 0);
            put_avail(&st, slot, 5, slot as u16 + 1);
            match pop(&mut st) {
                Pop::Chain(c) => assert_eq!(c.bufs[0].len, len),
                other => panic!("{other:?}"),
            }
        }
        assert!(st.vrings[1].active());
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
