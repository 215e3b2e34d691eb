//! `VhostUserTransport` against a small vhost-user backend running in a
//! thread of the test, over a real unix socket pair: the backend records
//! every request (code, payload, descriptors), answers what needs an answer,
//! maps the memory table it receives, and uses the kick and call eventfds.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::FromRawFd;
use std::os::unix::net::UnixStream;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use memmap2::MmapOptions;
use pindown_driver::transport::{
    DEFAULT_FEATURES, F_ACCESS_PLATFORM, F_EVENT_IDX, F_NET_MAC, F_NET_MQ, F_PROTOCOL_FEATURES,
    F_VERSION_1,
};
use pindown_driver::verbs::{Context, ContextConfig, VerbsError};
use pindown_driver::{
    DmaArena, IotlbAccess, SplitQueue, Transport, TransportError, VhostUserConfig,
    VhostUserTransport,
};
use pindown_uapi::Opcode;
use vhost::vhost_user::message::FrontendReq;
use vhost::vhost_user::VhostUserProtocolFeatures;
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

const DEVICE_FEATURES: u64 =
    F_VERSION_1 | F_ACCESS_PLATFORM | F_EVENT_IDX | F_NET_MQ | F_NET_MAC | F_PROTOCOL_FEATURES;
const QUEUE_PAIRS: u64 = 1;

/// What the backend does with IOTLB messages.
#[derive(Clone, Copy, Debug)]
enum IotlbBehaviour {
    Ack(u64),
    Silent,
    Hangup,
}

/// One request as the backend saw it.
#[derive(Debug)]
struct Record {
    request: u32,
    flags: u32,
    body: Vec<u8>,
    files: Vec<File>,
}

impl Record {
    fn u64_at(&self, offset: usize) -> u64 {
        u64::from_le_bytes(self.body[offset..offset + 8].try_into().unwrap())
    }
    fn u32_at(&self, offset: usize) -> u32 {
        u32::from_le_bytes(self.body[offset..offset + 4].try_into().unwrap())
    }
}

fn recv_request(sock: &UnixStream) -> Option<Record> {
    let mut header = [0u8; 12];
    let mut fds = [-1; 8];
    let mut iov = [libc::iovec {
        iov_base: header.as_mut_ptr().cast(),
        iov_len: header.len(),
    }];
    // SAFETY: the iovec points into `header`, which outlives the call.
    let (n, nfds) = unsafe { sock.recv_with_fds(&mut iov, &mut fds) }.ok()?;
    if n == 0 {
        return None;
    }
    let mut sock_ref = sock;
    if n < 12 {
        sock_ref.read_exact(&mut header[n..]).ok()?;
    }
    let word = |at: usize| u32::from_le_bytes(header[at..at + 4].try_into().unwrap());
    let mut body = vec![0u8; word(8) as usize];
    sock_ref.read_exact(&mut body).ok()?;
    let files = fds[..nfds]
        .iter()
        // SAFETY: recv_with_fds handed us ownership of these descriptors.
        .map(|&fd| unsafe { File::from_raw_fd(fd) })
        .collect();
    Some(Record {
        request: word(0),
        flags: word(4),
        body,
        files,
    })
}

fn reply_u64(mut sock: &UnixStream, request: u32, value: u64) -> std::io::Result<()> {
    let mut msg = Vec::new();
    msg.extend_from_slice(&request.to_le_bytes());
    msg.extend_from_slice(&(0x1u32 | 0x4).to_le_bytes());
    msg.extend_from_slice(&8u32.to_le_bytes());
    msg.extend_from_slice(&value.to_le_bytes());
    sock.write_all(&msg)
}

/// Serves one connection until it closes; sends every request to `log`.
/// From request `silent_from` on (if any), it answers nothing more but
/// keeps reading, as a wedged device would.
fn backend(
    sock: UnixStream,
    iotlb: IotlbBehaviour,
    silent_from: Option<FrontendReq>,
    log: mpsc::Sender<Record>,
) {
    let mut silent = false;
    while let Some(record) = recv_request(&sock) {
        let req = record.request;
        let need_reply = record.flags & 0x8 != 0;
        silent |= silent_from.is_some_and(|from| from as u32 == req);
        let answer = match req {
            _ if silent => None,
            r if r == FrontendReq::GET_FEATURES as u32 => Some(DEVICE_FEATURES),
            r if r == FrontendReq::GET_PROTOCOL_FEATURES as u32 => Some(
                (VhostUserProtocolFeatures::MQ
                    | VhostUserProtocolFeatures::REPLY_ACK
                    | VhostUserProtocolFeatures::BACKEND_REQ
                    | VhostUserProtocolFeatures::CONFIG)
                    .bits(),
            ),
            r if r == FrontendReq::GET_QUEUE_NUM as u32 => Some(QUEUE_PAIRS),
            r if r == FrontendReq::IOTLB_MSG as u32 => match iotlb {
                IotlbBehaviour::Ack(status) => Some(status),
                IotlbBehaviour::Silent => None,
                IotlbBehaviour::Hangup => return,
            },
            _ if need_reply => Some(0),
            _ => None,
        };
        let _ = log.send(record);
        if let Some(value) = answer {
            if reply_u64(&sock, req, value).is_err() {
                return;
            }
        }
    }
}

fn start(
    iotlb: IotlbBehaviour,
) -> (
    VhostUserTransport,
    mpsc::Receiver<Record>,
    thread::JoinHandle<()>,
) {
    let (ours, theirs) = UnixStream::pair().unwrap();
    let (tx, rx) = mpsc::channel();
    let handle = thread::spawn(move || backend(theirs, iotlb, None, tx));
    let config = VhostUserConfig {
        reply_timeout: Duration::from_millis(300),
        ..VhostUserConfig::default()
    };
    let transport = VhostUserTransport::from_stream(ours, config).unwrap();
    (transport, rx, handle)
}

fn drain(rx: &mpsc::Receiver<Record>) -> Vec<Record> {
    let mut out = Vec::new();
    while let Ok(r) = rx.recv_timeout(Duration::from_millis(100)) {
        out.push(r);
    }
    out
}

fn codes(records: &[Record]) -> Vec<u32> {
    records.iter().map(|r| r.request).collect()
}

#[test]
fn handshake_memory_queues_doorbells_and_iotlb_reach_the_backend() {
    let (transport, rx, _backend) = start(IotlbBehaviour::Ack(0));
    assert_eq!(transport.device_features(), DEVICE_FEATURES);
    let rings = transport.ring_layout();
    assert_eq!(rings.queue_pairs, 1);
    // Any RDMA pair the ABI allows may be set up; the device refuses those
    // it does not have.
    assert_eq!(rings.rdma_queue_pairs, pindown_uapi::MAX_RDMA_QUEUE_PAIRS);
    assert_eq!(
        rings.ring_count(),
        2 + 2 * pindown_uapi::MAX_RDMA_QUEUE_PAIRS
    );
    assert!(transport.backend_channel().is_some());

    let handshake = drain(&rx);
    assert_eq!(
        codes(&handshake),
        vec![
            FrontendReq::SET_OWNER as u32,
            FrontendReq::GET_FEATURES as u32,
            FrontendReq::GET_PROTOCOL_FEATURES as u32,
            FrontendReq::SET_PROTOCOL_FEATURES as u32,
            FrontendReq::GET_QUEUE_NUM as u32,
            FrontendReq::SET_BACKEND_REQ_FD as u32,
        ]
    );
    let acked_protocol = handshake[3].u64_at(0);
    assert_eq!(
        acked_protocol,
        (VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::BACKEND_REQ)
            .bits(),
        "only the wanted protocol features are acked"
    );
    assert_eq!(handshake[5].files.len(), 1, "backend channel fd passed");

    // Features.
    let acked = transport.negotiate_features(DEFAULT_FEATURES).unwrap();
    assert_eq!(acked, DEFAULT_FEATURES | F_PROTOCOL_FEATURES);
    assert!(transport.iotlb_enabled());
    let set_features = drain(&rx);
    assert_eq!(codes(&set_features), vec![FrontendReq::SET_FEATURES as u32]);
    assert_eq!(set_features[0].u64_at(0), acked);
    assert_ne!(set_features[0].flags & 0x8, 0, "requests ask for REPLY_ACK");

    // Memory table: one region, the arena's memfd, identity addresses.
    let arena = DmaArena::new(4 << 20).unwrap();
    transport
        .register_memory(&[arena.memory_table_region()])
        .unwrap();
    let mem = drain(&rx);
    assert_eq!(codes(&mem), vec![FrontendReq::SET_MEM_TABLE as u32]);
    let table = &mem[0];
    assert_eq!(table.u32_at(0), 1, "one region");
    assert_eq!(table.u64_at(8), arena.addr(), "guest address = IOVA");
    assert_eq!(table.u64_at(16), arena.size() as u64);
    assert_eq!(table.u64_at(24), arena.addr(), "userspace address");
    assert_eq!(table.u64_at(32), 0, "mmap offset");
    assert_eq!(table.files.len(), 1);
    // The backend maps the fd and sees the driver's bytes.
    let device_map = MmapOptions::new()
        .len(arena.size())
        .map_raw(&table.files[0])
        .unwrap();
    let buffer = arena.alloc(64, 64).unwrap();
    buffer.write_at(0, b"shared with the device");
    let mut seen = [0u8; 22];
    // SAFETY: inside the backend's live mapping of the arena.
    unsafe {
        std::ptr::copy_nonoverlapping(
            device_map.as_ptr().add(buffer.offset()),
            seen.as_mut_ptr(),
            22,
        )
    };
    assert_eq!(&seen, b"shared with the device");

    // Queue set-up of the admin pair's send queue (ring 2P).
    let sq_index = rings.send_queue(pindown_uapi::ADMIN_QUEUE_PAIR);
    assert_eq!(sq_index, 2);
    let queue = SplitQueue::<u32>::new(&arena, 64, true).unwrap();
    let layout = queue.layout();
    transport.setup_queue(sq_index, &layout).unwrap();
    transport.enable_queue(sq_index, true).unwrap();
    let setup = drain(&rx);
    assert_eq!(
        codes(&setup),
        vec![
            FrontendReq::IOTLB_MSG as u32,
            FrontendReq::SET_VRING_NUM as u32,
            FrontendReq::SET_VRING_BASE as u32,
            FrontendReq::SET_VRING_ADDR as u32,
            FrontendReq::SET_VRING_KICK as u32,
            FrontendReq::SET_VRING_CALL as u32,
            FrontendReq::SET_VRING_ENABLE as u32,
        ],
        "the ring memory is in the IOTLB before the ring is described"
    );
    let iotlb = &setup[0];
    assert_eq!(iotlb.body.len(), 32);
    assert_eq!(iotlb.flags, 0x9, "version 1 + NEED_REPLY");
    assert_eq!(
        pindown_uapi::IotlbMessage::decode(&iotlb.body),
        Ok(pindown_uapi::IotlbMessage::update(
            layout.ring_start,
            layout.ring_len,
            layout.ring_start, // uaddr = iova
            pindown_uapi::VhostAccess::ReadWrite
        ))
    );
    assert_eq!(setup[1].u32_at(0), sq_index as u32);
    assert_eq!(setup[1].u32_at(4), 64);
    assert_eq!(setup[2].u32_at(4), 0, "base 0");
    let addr = &setup[3];
    assert_eq!(addr.u32_at(0), sq_index as u32);
    assert_eq!(addr.u64_at(8), layout.desc_addr);
    assert_eq!(addr.u64_at(16), layout.used_addr);
    assert_eq!(addr.u64_at(24), layout.avail_addr);
    assert_eq!(setup[4].u64_at(0), sq_index as u64);
    assert_eq!(setup[4].files.len(), 1);
    assert_eq!(setup[5].files.len(), 1);
    assert_eq!(
        (setup[6].u32_at(0), setup[6].u32_at(4)),
        (sq_index as u32, 1)
    );

    // Doorbell: the backend's kick eventfd becomes readable.
    let mut kick = &setup[4].files[0];
    transport.notify(sq_index).unwrap();
    transport.notify(sq_index).unwrap();
    let mut count = [0u8; 8];
    kick.read_exact(&mut count).unwrap();
    assert_eq!(u64::from_ne_bytes(count), 2);

    // Completion: the backend signals the call eventfd.
    let event = transport.completion_event(sq_index).unwrap();
    assert!(!event.wait(Some(Duration::from_millis(10))).unwrap());
    let mut call = &setup[5].files[0];
    call.write_all(&1u64.to_ne_bytes()).unwrap();
    assert!(event.wait(Some(Duration::from_secs(5))).unwrap());
    assert_eq!(event.take().unwrap(), 0, "the signal was consumed");

    // IOTLB map and unmap of a user range.
    transport
        .iotlb_map(buffer.iova(), 4096, buffer.iova(), IotlbAccess::ReadOnly)
        .unwrap();
    transport.iotlb_unmap(buffer.iova(), 4096).unwrap();
    let tlb = drain(&rx);
    assert_eq!(codes(&tlb), vec![FrontendReq::IOTLB_MSG as u32; 2]);
    assert_eq!(
        pindown_uapi::IotlbMessage::decode(&tlb[0].body),
        Ok(pindown_uapi::IotlbMessage::update(
            buffer.iova(),
            4096,
            buffer.iova(),
            pindown_uapi::VhostAccess::ReadOnly
        ))
    );
    assert_eq!(
        pindown_uapi::IotlbMessage::decode(&tlb[1].body),
        Ok(pindown_uapi::IotlbMessage::invalidate(buffer.iova(), 4096))
    );

    // Errors on bad indices and unset queues.
    let count = rings.ring_count();
    assert!(matches!(
        transport.notify(count),
        Err(TransportError::NoSuchQueue { index, count: reported })
            if index == count && reported == count
    ));
    assert!(matches!(
        transport.notify(rings.completion_queue(pindown_uapi::ADMIN_QUEUE_PAIR)),
        Err(TransportError::QueueNotSetUp(3))
    ));
}

#[test]
fn a_rejected_iotlb_update_is_an_error_and_the_connection_lives_on() {
    let (transport, rx, _backend) = start(IotlbBehaviour::Ack(1));
    transport.negotiate_features(DEFAULT_FEATURES).unwrap();
    let err = transport
        .iotlb_map(0x10000, 4096, 0x10000, IotlbAccess::ReadWrite)
        .unwrap_err();
    assert!(
        matches!(
            err,
            TransportError::Rejected {
                request: "IOTLB_MSG",
                status: 1
            }
        ),
        "{err}"
    );
    // Still in step: the next request works.
    transport.negotiate_features(DEFAULT_FEATURES).unwrap();
    drain(&rx);
}

#[test]
fn a_silent_backend_times_out() {
    let (transport, _rx, _backend) = start(IotlbBehaviour::Silent);
    transport.negotiate_features(DEFAULT_FEATURES).unwrap();
    let err = transport
        .iotlb_map(0x10000, 4096, 0x10000, IotlbAccess::ReadWrite)
        .unwrap_err();
    assert!(matches!(err, TransportError::Timeout { .. }), "{err}");
    // The stream is out of step now: later requests refuse rather than hang.
    assert!(matches!(
        transport.negotiate_features(DEFAULT_FEATURES),
        Err(TransportError::Broken(_))
    ));
}

#[test]
fn a_vanished_backend_gives_errors_not_hangs() {
    let (transport, _rx, backend) = start(IotlbBehaviour::Hangup);
    transport.negotiate_features(DEFAULT_FEATURES).unwrap();
    let arena = DmaArena::new(1 << 20).unwrap();
    let err = transport
        .iotlb_map(arena.addr(), 4096, arena.addr(), IotlbAccess::ReadWrite)
        .unwrap_err();
    assert!(matches!(err, TransportError::Disconnected { .. }), "{err}");
    backend.join().unwrap();
    // Every later control request fails at once.
    assert!(transport
        .register_memory(&[arena.memory_table_region()])
        .is_err());
    assert!(transport.iotlb_unmap(arena.addr(), 4096).is_err());

    // A backend that is gone before the handshake.
    let (ours, theirs) = UnixStream::pair().unwrap();
    drop(theirs);
    let err = VhostUserTransport::from_stream(ours, VhostUserConfig::default()).unwrap_err();
    assert!(matches!(err, TransportError::Disconnected { .. }), "{err}");

    // And one that closes in the middle of a Frontend request.
    let (ours, theirs) = UnixStream::pair().unwrap();
    let closer = thread::spawn(move || {
        // Read the first request (SET_OWNER), then answer GET_FEATURES by closing.
        let _ = recv_request(&theirs);
        let _ = recv_request(&theirs);
        drop(theirs);
    });
    let err = VhostUserTransport::from_stream(ours, VhostUserConfig::default()).unwrap_err();
    assert!(matches!(err, TransportError::Disconnected { .. }), "{err}");
    closer.join().unwrap();
}

#[test]
fn an_open_whose_query_gets_no_answer_ends_after_one_control_timeout() {
    // A device whose port is stuck: it answers every vhost-user request
    // but never serves its rings, and keeps the connection open after the
    // driver ends it (the emulated NIC closes only once the port is reset).
    let (ours, theirs) = UnixStream::pair().unwrap();
    let (log, _records) = mpsc::channel();
    let (release, released) = mpsc::channel::<()>();
    let device = thread::spawn(move || {
        let kept_open = theirs.try_clone().unwrap();
        backend(theirs, IotlbBehaviour::Ack(0), None, log);
        let _ = released.recv();
        drop(kept_open);
    });
    let transport = VhostUserTransport::from_stream(ours, VhostUserConfig::default()).unwrap();
    let timeout = Duration::from_secs(3);
    let start = Instant::now();
    let err = Context::with_transport(
        transport,
        ContextConfig {
            arena_bytes: 4 << 20,
            control_timeout: timeout,
            ..ContextConfig::default()
        },
    )
    .err()
    .expect("no device answered, yet the open succeeded");
    let took = start.elapsed();
    assert!(
        matches!(
            err,
            VerbsError::ControlTimeout {
                operation: Opcode::Query,
                ..
            }
        ),
        "{err}"
    );
    // The failed open does not wait for the device a second time (no
    // buffer of its arena went out, and the arena goes with it): once
    // the QUERY's timeout, not twice.
    assert!(
        took < timeout * 3 / 2,
        "the failed open took {took:?} with a control timeout of {timeout:?}"
    );
    release.send(()).unwrap();
    device.join().unwrap();
}

#[test]
fn a_device_that_stops_answering_fails_the_request_instead_of_holding_it() {
    // Silent from GET_FEATURES (in the handshake) or from SET_MEM_TABLE
    // (after it): the request fails as timed out, the connection counts
    // as broken, and nothing waits for ever (a wait past a minute fails
    // the test instead of hanging it).
    let timeout = Duration::from_millis(300);
    let config = VhostUserConfig {
        reply_timeout: timeout,
        ..VhostUserConfig::default()
    };
    for silent_from in [FrontendReq::GET_FEATURES, FrontendReq::SET_MEM_TABLE] {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let (log, _records) = mpsc::channel();
        let device =
            thread::spawn(move || backend(theirs, IotlbBehaviour::Ack(0), Some(silent_from), log));
        let (done, outcome) = mpsc::channel();
        let config = config.clone();
        let driver = thread::spawn(move || {
            let result = VhostUserTransport::from_stream(ours, config).and_then(|transport| {
                transport.negotiate_features(DEFAULT_FEATURES)?;
                let arena = DmaArena::new(1 << 20).unwrap();
                let first = transport.register_memory(&[arena.memory_table_region()]);
                let after = transport.negotiate_features(DEFAULT_FEATURES);
                first.map(|()| after)
            });
            done.send(result).unwrap();
        });
        let result = outcome
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|_| panic!("still waiting for a device silent from {silent_from:?}"));
        match (silent_from, result) {
            (FrontendReq::GET_FEATURES, Err(TransportError::Timeout { request, .. })) => {
                assert_eq!(request, "GET_FEATURES")
            }
            (FrontendReq::SET_MEM_TABLE, Err(TransportError::Timeout { request, .. })) => {
                assert_eq!(request, "SET_MEM_TABLE")
            }
            (_, other) => panic!("silent from {silent_from:?}: {other:?}"),
        }
        driver.join().unwrap();
        device.join().unwrap();
    }
}

#[test]
fn connect_reports_a_missing_socket() {
    let err = VhostUserTransport::connect("/nonexistent/pindown.sock", VhostUserConfig::default())
        .unwrap_err();
    assert!(matches!(err, TransportError::Connect { .. }), "{err}");
}
