//! Batched datagram I/O on the link's UDP socket: `recvmmsg` takes up to
//! [`BATCH`] datagrams in one system call, `sendmmsg` puts a pass's
//! datagrams on the wire in one.

use std::io;
use std::mem::{size_of, zeroed};
use std::net::{SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::RawFd;

/// Datagrams taken or sent in one system call at most.
pub const BATCH: usize = 32;

/// The largest datagram received (a longer one, cut by the kernel, is
/// dropped: no sender of the fabric makes one; Ethernet frames of a
/// 1500-byte MTU and the endpoint's datagrams fit).
pub const DATAGRAM_MAX: usize = 4096;

/// Buffers for [`BATCH`] received datagrams.
pub struct Received {
    buffers: Vec<u8>,
    /// Bytes of each datagram; `None` for one cut short.
    lengths: [Option<usize>; BATCH],
    sources: Vec<libc::sockaddr_storage>,
    count: usize,
}

impl Received {
    /// Empty buffers.
    pub fn new() -> Self {
        Received {
            buffers: vec![0; BATCH * DATAGRAM_MAX],
            lengths: [None; BATCH],
            // SAFETY: sockaddr_storage is plain old data; all zeros is a
            // valid (unspecified-family) value.
            sources: vec![unsafe { zeroed() }; BATCH],
            count: 0,
        }
    }

    /// Takes the datagrams waiting on `fd` (non-blocking), up to
    /// [`BATCH`]; returns how many (0 when none waits).
    pub fn receive(&mut self, fd: RawFd) -> io::Result<usize> {
        let mut iovecs: [libc::iovec; BATCH] = std::array::from_fn(|i| libc::iovec {
            iov_base: self.buffers[i * DATAGRAM_MAX..].as_mut_ptr().cast(),
            iov_len: DATAGRAM_MAX,
        });
        // SAFETY: mmsghdr is plain old data; zeros are a valid start.
        let mut headers: [libc::mmsghdr; BATCH] = unsafe { zeroed() };
        for (i, header) in headers.iter_mut().enumerate() {
            header.msg_hdr.msg_name = (&mut self.sources[i] as *mut libc::sockaddr_storage).cast();
            header.msg_hdr.msg_namelen = size_of::<libc::sockaddr_storage>() as libc::socklen_t;
            header.msg_hdr.msg_iov = &mut iovecs[i];
            header.msg_hdr.msg_iovlen = 1;
        }
        // SAFETY: every header points at one iovec of a live buffer of
        // DATAGRAM_MAX bytes and at a live sockaddr_storage, all of which
        // outlive the call; the kernel writes at most those.
        let got = unsafe {
            libc::recvmmsg(
                fd,
                headers.as_mut_ptr(),
                BATCH as libc::c_uint,
                libc::MSG_DONTWAIT,
                std::ptr::null_mut(),
            )
        };
        if got < 0 {
            self.count = 0;
            let error = io::Error::last_os_error();
            return match error.kind() {
                io::ErrorKind::WouldBlock => Ok(0),
                _ => Err(error),
            };
        }
        self.count = got as usize;
        for (i, header) in headers.iter().take(self.count).enumerate() {
            let cut = header.msg_hdr.msg_flags & libc::MSG_TRUNC != 0;
            self.lengths[i] = (!cut).then_some((header.msg_len as usize).min(DATAGRAM_MAX));
        }
        Ok(self.count)
    }

    /// Datagram `i` of the last [`receive`](Self::receive) and where it
    /// came from (`None` for a datagram cut short, or from an address
    /// family other than IPv4 and IPv6).
    pub fn get(&self, i: usize) -> Option<(&[u8], SocketAddr)> {
        if i >= self.count {
            return None;
        }
        let len = self.lengths[i]?;
        let source = socket_addr(&self.sources[i])?;
        let start = i * DATAGRAM_MAX;
        Some((&self.buffers[start..start + len], source))
    }
}

impl Default for Received {
    fn default() -> Self {
        Self::new()
    }
}

/// The address a `sockaddr_storage` the kernel filled names.
fn socket_addr(storage: &libc::sockaddr_storage) -> Option<SocketAddr> {
    match libc::c_int::from(storage.ss_family) {
        libc::AF_INET => {
            // SAFETY: the family says the storage holds a sockaddr_in,
            // which it is large and aligned enough for.
            let v4 = unsafe { &*(storage as *const _ as *const libc::sockaddr_in) };
            let ip = u32::from_be(v4.sin_addr.s_addr);
            Some(SocketAddr::V4(SocketAddrV4::new(
                ip.into(),
                u16::from_be(v4.sin_port),
            )))
        }
        libc::AF_INET6 => {
            // SAFETY: as above, for sockaddr_in6.
            let v6 = unsafe { &*(storage as *const _ as *const libc::sockaddr_in6) };
            Some(SocketAddr::V6(SocketAddrV6::new(
                v6.sin6_addr.s6_addr.into(),
                u16::from_be(v6.sin6_port),
                u32::from_be(v6.sin6_flowinfo),
                v6.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

/// The C form of `address`, and its length.
fn raw_addr(address: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: plain old data; zeros are valid.
    let mut storage: libc::sockaddr_storage = unsafe { zeroed() };
    let len = match address {
        SocketAddr::V4(v4) => {
            // SAFETY: sockaddr_storage is large and aligned enough for a
            // sockaddr_in.
            let raw = unsafe { &mut *(&mut storage as *mut _ as *mut libc::sockaddr_in) };
            raw.sin_family = libc::AF_INET as libc::sa_family_t;
            raw.sin_port = v4.port().to_be();
            raw.sin_addr.s_addr = u32::from(*v4.ip()).to_be();
            size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(v6) => {
            // SAFETY: as above, for sockaddr_in6.
            let raw = unsafe { &mut *(&mut storage as *mut _ as *mut libc::sockaddr_in6) };
            raw.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            raw.sin6_port = v6.port().to_be();
            raw.sin6_addr.s6_addr = v6.ip().octets();
            raw.sin6_flowinfo = v6.flowinfo().to_be();
            raw.sin6_scope_id = v6.scope_id();
            size_of::<libc::sockaddr_in6>()
        }
    };
    (storage, len as libc::socklen_t)
}

/// Datagrams of one pass, put on the wire together.
#[derive(Default)]
pub struct Outgoing {
    bytes: Vec<u8>,
    /// (destination, start, length) of each datagram in `bytes`.
    datagrams: Vec<(SocketAddr, usize, usize)>,
}

impl Outgoing {
    /// Queues `datagram` for `destination`; sends the batch when it is
    /// full.
    pub fn push(&mut self, fd: RawFd, destination: SocketAddr, datagram: &[u8]) {
        let start = self.bytes.len();
        self.bytes.extend_from_slice(datagram);
        self.datagrams.push((destination, start, datagram.len()));
        if self.datagrams.len() == BATCH {
            self.flush(fd);
        }
    }

    /// Sends the queued datagrams. A datagram the kernel refuses (a full
    /// buffer, an unreachable peer) is dropped: the reliable endpoint
    /// sends again what is not acknowledged, and frames are best effort.
    pub fn flush(&mut self, fd: RawFd) {
        let mut sent = 0;
        while sent < self.datagrams.len() {
            let chunk = &self.datagrams[sent..];
            let addresses: Vec<(libc::sockaddr_storage, libc::socklen_t)> =
                chunk.iter().map(|&(to, _, _)| raw_addr(to)).collect();
            let mut iovecs: Vec<libc::iovec> = chunk
                .iter()
                .map(|&(_, start, len)| libc::iovec {
                    iov_base: self.bytes[start..].as_ptr() as *mut libc::c_void,
                    iov_len: len,
                })
                .collect();
            // SAFETY: plain old data; zeros are valid.
            let mut headers: Vec<libc::mmsghdr> = vec![unsafe { zeroed() }; chunk.len()];
            for (i, header) in headers.iter_mut().enumerate() {
                header.msg_hdr.msg_name = (&addresses[i].0 as *const libc::sockaddr_storage)
                    .cast_mut()
                    .cast();
                header.msg_hdr.msg_namelen = addresses[i].1;
                header.msg_hdr.msg_iov = &mut iovecs[i];
                header.msg_hdr.msg_iovlen = 1;
            }
            // SAFETY: every header points at a live address and one iovec
            // over bytes of `self.bytes`, all alive for the call; the
            // kernel only reads them.
            let done = unsafe {
                libc::sendmmsg(
                    fd,
                    headers.as_mut_ptr(),
                    headers.len() as libc::c_uint,
                    libc::MSG_DONTWAIT,
                )
            };
            if done <= 0 {
                // The first datagram was refused: drop it, go on.
                tracing::trace!("fabric send: {}", io::Error::last_os_error());
                sent += 1;
            } else {
                sent += done as usize;
            }
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
    use std::net::UdpSocket;
    use std::os::fd::AsRawFd;

    #[test]
    fn batches_carry_every_datagram_with_its_source() {
        let receiver = UdpSocket::bind("127.0.0.1:0").unwrap();
        let sender = UdpSocket::bind("127.0.0.1:0").unwrap();
        let to = receiver.local_addr().unwrap();
        let mut out = Outgoing::default();
        let datagrams: Vec<Vec<u8>> = (0..45u8)
            .map(|i| vec![i; 1 + usize::from(i) * 30])
            .collect();
        for datagram in &datagrams {
            out.push(sender.as_raw_fd(), to, datagram);
        }
        assert_eq!(out.len(), 45 - BATCH);
        out.flush(sender.as_raw_fd());
        assert!(out.is_empty());
        let mut received = Received::new();
        let mut got = Vec::new();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while got.len() < datagrams.len() && std::time::Instant::now() < deadline {
            let n = received.receive(receiver.as_raw_fd()).unwrap();
            for i in 0..n {
                let (bytes, from) = received.get(i).unwrap();
                assert_eq!(from, sender.local_addr().unwrap());
                got.push(bytes.to_vec());
            }
        }
        assert_eq!(got, datagrams);
        assert_eq!(received.receive(receiver.as_raw_fd()).unwrap(), 0);
        // A datagram longer than the buffers is refused, not cut.
        sender.send_to(&vec![7u8; DATAGRAM_MAX + 1], to).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert_eq!(received.receive(receiver.as_raw_fd()).unwrap(), 1);
        assert!(received.get(0).is_none());
    }
}
