//! Datagram I/O on the link's UDP socket, through `quinn-udp`: received
//! datagrams arrive coalesced by the kernel (UDP GRO: a run of one
//! sender's datagrams in one buffer of at most 64 KiB, cut apart again
//! here), several buffers in one `recvmmsg`; a pass's datagrams to one peer of one size go out as
//! one segmentation-offloaded send (UDP GSO: the kernel cuts one buffer
//! of at most `GSO_BYTES_MAX` bytes into datagrams, `FLUSH_AT` of full
//! size). Over a veth pair this moves about ten times
//! the datagrams per second of one `sendmmsg` entry per datagram. Where
//! the kernel offers neither (before Linux 5.0) every datagram is a buffer
//! and a send of its own.

use std::io::{self, IoSliceMut};
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::{AsRawFd, RawFd};

use quinn_udp::{RecvMeta, Transmit, UdpSockRef, UdpSocketState};

/// The largest datagram taken (a longer one is dropped, counted: no
/// sender of the fabric makes one; Ethernet frames of a 1500-byte MTU and
/// the endpoint's datagrams fit).
pub const DATAGRAM_MAX: usize = 4096;

/// Receive buffers filled by one system call: runs of up to 64 KiB each
/// when the kernel coalesces, one datagram each when it does not. With the endpoint's pool
/// they keep the fabric's fixed memory under 1 MiB per device.
pub const RECEIVE_BUFFERS: usize = 3;

/// Bytes of one receive buffer: the most a UDP datagram, or a coalesced
/// run of them, can hold, so the kernel never cuts one.
const RECEIVE_BUFFER_BYTES: usize = 64 * 1024;

/// The most datagrams one coalesced buffer holds (a local sender's
/// segmented send carries at most 128, however short).
const DATAGRAMS_PER_BUFFER_MAX: usize = 128;

/// Datagrams queued before a pass's batch goes out unasked: as many
/// full-size (1452-byte) datagrams as one segmented send carries.
const FLUSH_AT: usize = 45;

/// Bytes a segmentation-offloaded send may carry (the UDP payload limit
/// of one IPv4 packet).
const GSO_BYTES_MAX: usize = 65_507;

/// The link's socket, with what `quinn-udp` learned of it (whether the
/// kernel segments and coalesces).
pub struct Wire {
    socket: UdpSocket,
    state: UdpSocketState,
    /// The largest datagram sent in a segmented run: one that fits the
    /// path's MTU (a longer one, a bridged frame, goes alone and may be
    /// fragmented).
    segment_max: usize,
}

impl Wire {
    /// Takes `socket` (made non-blocking); datagrams longer than
    /// `segment_max` are never sent segmented.
    ///
    /// `quinn-udp` sets the socket up for QUIC; the fabric changes some of
    /// it back:
    /// - IPv4 (also through a dual-stack socket): fragmentation by this
    ///   host at the interface's MTU, path MTU messages ignored
    ///   (`IP_PMTUDISC_OMIT`). Bridged Ethernet frames longer than a
    ///   1500-byte path still leave, fragmented, and a forged "fragmentation
    ///   needed" cannot make segmented sends fail.
    /// - IPv6 (routers never fragment): the kernel's path MTU discovery,
    ///   as before, with fragmentation by this host allowed
    ///   (`IPV6_DONTFRAG` off).
    /// - No receive timestamps, destination addresses or traffic classes:
    ///   nothing here reads them, and timestamping is work for every
    ///   packet of the host.
    pub fn new(socket: UdpSocket, segment_max: usize) -> io::Result<Wire> {
        let v6 = socket.local_addr()?.is_ipv6();
        let v6_discovery = v6
            .then(|| get_int_option(&socket, libc::IPPROTO_IPV6, libc::IPV6_MTU_DISCOVER))
            .transpose()?;
        let state = UdpSocketState::new(UdpSockRef::from(&socket))?;
        // An IPv6-only socket may refuse the IPv4 options: it sends no
        // IPv4 then.
        let _ = set_int_option(
            &socket,
            libc::IPPROTO_IP,
            libc::IP_MTU_DISCOVER,
            libc::IP_PMTUDISC_OMIT,
        );
        let _ = set_int_option(&socket, libc::IPPROTO_IP, libc::IP_PKTINFO, 0);
        let _ = set_int_option(&socket, libc::IPPROTO_IP, libc::IP_RECVTOS, 0);
        if let Some(discovery) = v6_discovery {
            set_int_option(
                &socket,
                libc::IPPROTO_IPV6,
                libc::IPV6_MTU_DISCOVER,
                discovery,
            )?;
            set_int_option(&socket, libc::IPPROTO_IPV6, libc::IPV6_DONTFRAG, 0)?;
            set_int_option(&socket, libc::IPPROTO_IPV6, libc::IPV6_RECVPKTINFO, 0)?;
            set_int_option(&socket, libc::IPPROTO_IPV6, libc::IPV6_RECVTCLASS, 0)?;
        }
        set_int_option(&socket, libc::SOL_SOCKET, libc::SO_TIMESTAMPNS, 0)?;
        Ok(Wire {
            socket,
            state,
            segment_max,
        })
    }

    /// The socket's descriptor (for readiness).
    pub fn fd(&self) -> RawFd {
        self.socket.as_raw_fd()
    }

    /// Datagrams one send may carry (1 without segmentation offload).
    pub fn max_segments(&self) -> usize {
        self.state.max_gso_segments()
    }

    /// Whether received datagrams may come coalesced.
    pub fn coalesces(&self) -> bool {
        self.state.gro_segments() > 1
    }
}

fn get_int_option(
    socket: &UdpSocket,
    level: libc::c_int,
    name: libc::c_int,
) -> io::Result<libc::c_int> {
    let mut value: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `value` and `len` are live and sized for an int option; the
    // kernel writes at most `len` bytes into `value`.
    let done = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            level,
            name,
            (&mut value as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if done == 0 {
        Ok(value)
    } else {
        Err(io::Error::last_os_error())
    }
}

fn set_int_option(
    socket: &UdpSocket,
    level: libc::c_int,
    name: libc::c_int,
    value: libc::c_int,
) -> io::Result<()> {
    // SAFETY: `value` is a live int and the length says so; the kernel
    // only reads it.
    let done = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            level,
            name,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if done == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Buffers for the datagrams of one receive.
pub struct Received {
    buffers: Vec<u8>,
    /// (start in `buffers`, bytes, source) of each datagram taken; bytes
    /// `None` for one longer than [`DATAGRAM_MAX`].
    datagrams: Vec<(usize, Option<usize>, SocketAddr)>,
    /// Whether the last receive filled every buffer (more may wait).
    full: bool,
}

impl Received {
    /// Its buffers, allocated once.
    pub fn with_buffers() -> Self {
        Received {
            buffers: vec![0; RECEIVE_BUFFERS * RECEIVE_BUFFER_BYTES],
            datagrams: Vec::with_capacity(RECEIVE_BUFFERS * DATAGRAMS_PER_BUFFER_MAX),
            full: false,
        }
    }

    /// A placeholder with no buffers (allocates nothing; takes no
    /// datagram).
    pub fn empty() -> Self {
        Received {
            buffers: Vec::new(),
            datagrams: Vec::new(),
            full: false,
        }
    }

    /// Bytes of the buffers (the link's own memory, reported with the
    /// endpoint's).
    pub fn bytes(&self) -> usize {
        self.buffers.len()
            + self.datagrams.capacity() * std::mem::size_of::<(usize, Option<usize>, SocketAddr)>()
    }

    /// Takes the datagrams waiting on `wire` (non-blocking): as many as
    /// [`RECEIVE_BUFFERS`] buffers hold; returns how many datagrams (0
    /// when none waits).
    pub fn receive(&mut self, wire: &Wire) -> io::Result<usize> {
        debug_assert!(!self.buffers.is_empty(), "a receive into the placeholder");
        self.datagrams.clear();
        self.full = false;
        let mut meta = [RecvMeta::default(); RECEIVE_BUFFERS];
        let mut chunks = self.buffers.chunks_mut(RECEIVE_BUFFER_BYTES);
        let mut slices: [IoSliceMut<'_>; RECEIVE_BUFFERS] =
            std::array::from_fn(|_| IoSliceMut::new(chunks.next().unwrap_or_default()));
        let filled = match wire
            .state
            .recv(UdpSockRef::from(&wire.socket), &mut slices, &mut meta)
        {
            Ok(filled) => filled,
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => return Ok(0),
            Err(error) => return Err(error),
        };
        self.full = filled == RECEIVE_BUFFERS;
        for (i, meta) in meta.iter().take(filled).enumerate() {
            let base = i * RECEIVE_BUFFER_BYTES;
            let len = meta.len.min(RECEIVE_BUFFER_BYTES);
            // One datagram, or a coalesced run cut every `stride` bytes
            // (the last may be shorter).
            let stride = if meta.stride == 0 { len } else { meta.stride };
            let mut at = 0;
            while at < len {
                let bytes = stride.min(len - at);
                let kept = (bytes <= DATAGRAM_MAX).then_some(bytes);
                self.datagrams.push((base + at, kept, meta.addr));
                at += stride;
            }
            if len == 0 {
                self.datagrams.push((base, Some(0), meta.addr));
            }
        }
        Ok(self.datagrams.len())
    }

    /// Whether the last [`receive`](Self::receive) filled every buffer:
    /// more datagrams may be waiting.
    pub fn full(&self) -> bool {
        self.full
    }

    /// Datagram `i` of the last [`receive`](Self::receive) and where it
    /// came from (`None` for one longer than [`DATAGRAM_MAX`]).
    pub fn get(&self, i: usize) -> Option<(&[u8], SocketAddr)> {
        let &(start, len, source) = self.datagrams.get(i)?;
        let len = len?;
        Some((&self.buffers[start..start + len], source))
    }
}

/// Datagrams of one pass, put on the wire together.
pub struct Outgoing {
    bytes: Vec<u8>,
    /// (destination, start, length) of each datagram in `bytes`.
    datagrams: Vec<(SocketAddr, usize, usize)>,
}

impl Outgoing {
    /// Room for a full batch of datagrams of up to `datagram_max` bytes
    /// (a longer one, a bridged frame, makes room for itself).
    pub fn with_capacity(datagram_max: usize) -> Outgoing {
        Outgoing {
            bytes: Vec::with_capacity(FLUSH_AT * datagram_max),
            datagrams: Vec::with_capacity(FLUSH_AT),
        }
    }

    /// Bytes of its buffers.
    pub fn bytes(&self) -> usize {
        self.bytes.capacity()
            + self.datagrams.capacity() * std::mem::size_of::<(SocketAddr, usize, usize)>()
    }

    /// Queues `datagram` for `destination`; sends the batch when it is
    /// full.
    pub fn push(&mut self, wire: &Wire, destination: SocketAddr, datagram: &[u8]) {
        if self.bytes.len() + datagram.len() > self.bytes.capacity() && !self.is_empty() {
            // Longer datagrams (bridged frames) than the batch was sized
            // for: send what waits rather than grow.
            self.flush(wire);
        }
        let start = self.bytes.len();
        self.bytes.extend_from_slice(datagram);
        self.datagrams.push((destination, start, datagram.len()));
        if self.datagrams.len() == FLUSH_AT {
            self.flush(wire);
        }
    }

    /// Sends the queued datagrams: each run of datagrams to one
    /// destination, of one size (the run's last may be shorter), as one
    /// send the kernel segments. A send the kernel refuses (a full
    /// buffer, an unreachable peer) is dropped: the reliable endpoint
    /// sends again what is not acknowledged, and frames are best effort.
    pub fn flush(&mut self, wire: &Wire) {
        let most = wire.max_segments().max(1);
        let mut first = 0;
        while first < self.datagrams.len() {
            let (destination, start, size) = self.datagrams[first];
            let mut end = first + 1;
            let mut bytes = size;
            let segmentable = size > 0 && size <= wire.segment_max;
            while segmentable && end < self.datagrams.len() && end - first < most {
                let (to, _, len) = self.datagrams[end];
                if to != destination || len == 0 || len > size || bytes + len > GSO_BYTES_MAX {
                    break;
                }
                bytes += len;
                end += 1;
                if len < size {
                    // Only a run's last segment may be shorter.
                    break;
                }
            }
            let run = Transmit {
                destination,
                ecn: None,
                contents: &self.bytes[start..start + bytes],
                segment_size: (end - first > 1).then_some(size),
                src_ip: None,
            };
            match wire.state.try_send(UdpSockRef::from(&wire.socket), &run) {
                Ok(()) => {}
                Err(error) if end - first > 1 && error.kind() != io::ErrorKind::WouldBlock => {
                    // The kernel refused to segment (a smaller MTU on the
                    // way, no checksum offload): each datagram alone.
                    tracing::debug!("fabric segmented send to {destination}: {error}");
                    for &(to, at, len) in &self.datagrams[first..end] {
                        let single = Transmit {
                            destination: to,
                            ecn: None,
                            contents: &self.bytes[at..at + len],
                            segment_size: None,
                            src_ip: None,
                        };
                        let _ = wire.state.try_send(UdpSockRef::from(&wire.socket), &single);
                    }
                }
                Err(error) => {
                    tracing::trace!("fabric send to {destination}: {error}");
                }
            }
            first = end;
        }
        self.bytes.clear();
        self.datagrams.clear();
    }

    /// Datagrams queued.
    pub fn len(&self) -> usize {
        self.datagrams.len()
    }

    /// Whether none is queued.
    pub fn is_empty(&self) -> bool {
        self.datagrams.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// Loopback sockets: a sender and a receiver.
    fn pair(segment_max: usize) -> (Wire, Wire, SocketAddr, SocketAddr) {
        let receiver = UdpSocket::bind("127.0.0.1:0").unwrap();
        let sender = UdpSocket::bind("127.0.0.1:0").unwrap();
        let (to, from) = (receiver.local_addr().unwrap(), sender.local_addr().unwrap());
        (
            Wire::new(sender, segment_max).unwrap(),
            Wire::new(receiver, segment_max).unwrap(),
            to,
            from,
        )
    }

    /// Datagrams taken, each with its source (`None` for one dropped).
    type Taken = Vec<(Option<Vec<u8>>, Option<SocketAddr>)>;

    /// Receives until `want` datagrams came (or 5 s passed); also the
    /// most datagrams one receive returned.
    fn receive_all(wire: &Wire, want: usize) -> (Taken, usize) {
        let mut received = Received::with_buffers();
        let (mut got, mut most) = (Vec::new(), 0);
        let deadline = Instant::now() + Duration::from_secs(5);
        while got.len() < want && Instant::now() < deadline {
            let n = received.receive(wire).unwrap();
            most = most.max(n);
            for i in 0..n {
                let datagram = received.get(i);
                got.push((
                    datagram.map(|(bytes, _)| bytes.to_vec()),
                    datagram.map(|(_, from)| from),
                ));
            }
        }
        assert_eq!(received.receive(wire).unwrap(), 0, "nothing more");
        (got, most)
    }

    #[test]
    fn batches_carry_every_datagram_with_its_source() {
        let (sender, receiver, to, from) = pair(1452);
        let mut out = Outgoing::with_capacity(1452);
        let datagrams: Vec<Vec<u8>> = (0..45u8)
            .map(|i| vec![i; 1 + usize::from(i) * 30])
            .collect();
        for datagram in &datagrams {
            out.push(&sender, to, datagram);
        }
        assert_eq!(out.len(), 45 - FLUSH_AT);
        out.flush(&sender);
        assert!(out.is_empty());
        let (got, _) = receive_all(&receiver, datagrams.len());
        let expected: Vec<_> = datagrams
            .into_iter()
            .map(|d| (Some(d), Some(from)))
            .collect();
        assert_eq!(got, expected);
    }

    #[test]
    fn runs_of_one_size_go_segmented_and_arrive_as_the_datagrams_they_were() {
        let (sender, receiver, to, from) = pair(1452);
        let other = UdpSocket::bind("127.0.0.1:0").unwrap();
        let other_wire = Wire::new(other, 1452).unwrap();
        let elsewhere = other_wire.socket.local_addr().unwrap();
        let mut out = Outgoing::with_capacity(1452);
        // Full-size datagrams with one shorter last, a datagram to another
        // address in the middle, and an empty one.
        let mut sent = Vec::new();
        for i in 0..60u32 {
            let len = if i == 59 { 700 } else { 1452 };
            let datagram: Vec<u8> = (0..len).map(|k| (k as u32 * 7 + i) as u8).collect();
            out.push(&sender, to, &datagram);
            sent.push(datagram);
            if i == 30 {
                out.push(&sender, elsewhere, b"elsewhere");
            }
        }
        out.push(&sender, to, b"");
        sent.push(Vec::new());
        out.flush(&sender);
        let (got, most) = receive_all(&receiver, sent.len());
        let expected: Vec<_> = sent.into_iter().map(|d| (Some(d), Some(from))).collect();
        assert_eq!(got.len(), expected.len());
        assert!(got == expected, "datagrams differ or came out of order");
        let (aside, _) = receive_all(&other_wire, 1);
        assert_eq!(aside, vec![(Some(b"elsewhere".to_vec()), Some(from))]);
        if sender.max_segments() > 1 && receiver.coalesces() {
            // Loopback hands a segmented send over whole: one receive
            // returned more datagrams than it has buffers.
            assert!(
                most > RECEIVE_BUFFERS,
                "no run came coalesced: at most {most}"
            );
        }
    }

    #[test]
    fn a_shorter_datagram_ends_a_run_and_an_empty_one_goes_alone() {
        let (sender, receiver, to, from) = pair(1452);
        let mut out = Outgoing::with_capacity(1452);
        let sizes = [1452, 1452, 700, 1452, 1452, 0, 1452, 1452, 1452];
        let sent: Vec<Vec<u8>> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| vec![i as u8 + 1; n])
            .collect();
        for datagram in &sent {
            out.push(&sender, to, datagram);
        }
        out.flush(&sender);
        let (got, _) = receive_all(&receiver, sent.len());
        let expected: Vec<_> = sent.into_iter().map(|d| (Some(d), Some(from))).collect();
        assert_eq!(got, expected);
    }

    #[test]
    fn a_batch_of_longer_datagrams_goes_out_before_it_outgrows_its_room() {
        let (sender, receiver, to, _) = pair(1452);
        let mut out = Outgoing::with_capacity(1452);
        let room = out.bytes();
        let frames: Vec<Vec<u8>> = (0..FLUSH_AT as u8).map(|i| vec![i; 1530]).collect();
        for frame in &frames {
            out.push(&sender, to, frame);
        }
        assert!(out.len() < FLUSH_AT, "sent before growing");
        assert_eq!(out.bytes(), room, "the batch kept its size");
        out.flush(&sender);
        let (got, _) = receive_all(&receiver, frames.len());
        let got: Vec<_> = got.into_iter().map(|(bytes, _)| bytes.unwrap()).collect();
        assert_eq!(got, frames);
    }

    #[test]
    fn long_datagrams_go_alone_and_too_long_ones_are_dropped() {
        let (sender, receiver, to, from) = pair(1452);
        let mut out = Outgoing::with_capacity(1452);
        // Longer than a segment: each alone (a bridged frame).
        let frames: Vec<Vec<u8>> = (0..3u8).map(|i| vec![i; 1600]).collect();
        for frame in &frames {
            out.push(&sender, to, frame);
        }
        // Longer than any datagram the fabric takes.
        out.push(&sender, to, &vec![9u8; DATAGRAM_MAX + 1]);
        out.flush(&sender);
        let (got, _) = receive_all(&receiver, 4);
        let mut expected: Vec<_> = frames.into_iter().map(|f| (Some(f), Some(from))).collect();
        expected.push((None, None));
        assert_eq!(got, expected);
    }
}
