//! Reading requests (with their file descriptors) from, and writing replies
//! to, a vhost-user unix socket.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::Instant;

use vhost::vhost_user::message::MAX_ATTACHED_FD_ENTRIES;
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use super::message::{Header, ProtocolError, HEADER_SIZE};

/// A complete message as received.
#[derive(Debug)]
pub struct RawMessage {
    /// Validated header.
    pub header: Header,
    /// Payload (`header.size` bytes).
    pub payload: Vec<u8>,
    /// Files received with the header.
    pub files: Vec<File>,
}

/// Why reading a message failed.
#[derive(Debug, thiserror::Error)]
pub enum RecvError {
    /// The peer closed the connection.
    #[error("connection closed")]
    Closed,
    /// An I/O error.
    #[error("i/o error: {0}")]
    Io(#[from] io::Error),
    /// The bytes were not a valid message.
    #[error("protocol error: {0}")]
    Protocol(#[from] ProtocolError),
}

/// Reads one message. Once its first bytes arrived, the rest must arrive
/// within the socket's read timeout, counted for the whole message, not
/// per read: a frontend trickling one byte at a time cannot hold the
/// thread longer than that.
pub fn recv_message(stream: &mut UnixStream) -> Result<RawMessage, RecvError> {
    let mut hdr = [0u8; HEADER_SIZE];
    let mut raw_fds: [RawFd; MAX_ATTACHED_FD_ENTRIES] = [-1; MAX_ATTACHED_FD_ENTRIES];
    let mut iov = [libc::iovec {
        iov_base: hdr.as_mut_ptr().cast(),
        iov_len: hdr.len(),
    }];
    // SAFETY: the iovec points into `hdr`, which outlives the call and may
    // receive arbitrary bytes; `raw_fds` has room for the fds asked for.
    let (n, nfds) = unsafe { stream.recv_with_fds(&mut iov, &mut raw_fds) }
        .map_err(|e| io::Error::from_raw_os_error(e.errno()))?;
    // Own the fds immediately so they are closed on every path.
    let files: Vec<File> = raw_fds[..nfds.min(MAX_ATTACHED_FD_ENTRIES)]
        .iter()
        .filter(|fd| **fd >= 0)
        // SAFETY: these descriptors were just received through SCM_RIGHTS
        // and are owned by nobody else in this process.
        .map(|fd| unsafe { File::from_raw_fd(*fd) })
        .collect();
    if n == 0 {
        return Err(RecvError::Closed);
    }
    let deadline = stream.read_timeout()?.map(|limit| Instant::now() + limit);
    if n < HEADER_SIZE {
        read_exact_by(stream, &mut hdr[n..], deadline)?;
    }
    let header = Header::decode(&hdr)?;
    let mut payload = vec![0u8; header.size as usize];
    read_exact_by(stream, &mut payload, deadline)?;
    Ok(RawMessage {
        header,
        payload,
        files,
    })
}

/// Fills `buf` from `stream`, failing with `TimedOut` once `deadline` has
/// passed (no deadline: the socket's own timeout per read).
fn read_exact_by(
    stream: &mut UnixStream,
    buf: &mut [u8],
    deadline: Option<Instant>,
) -> Result<(), RecvError> {
    let Some(deadline) = deadline else {
        return stream.read_exact(buf).map_err(eof_is_closed);
    };
    let limit = stream.read_timeout()?;
    let mut filled = 0;
    let result = loop {
        if filled == buf.len() {
            break Ok(());
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break Err(RecvError::Io(io::Error::new(
                io::ErrorKind::TimedOut,
                "the rest of a message did not arrive in time",
            )));
        }
        if let Err(e) = stream.set_read_timeout(Some(left)) {
            break Err(e.into());
        }
        match stream.read(&mut buf[filled..]) {
            Ok(0) => break Err(RecvError::Closed),
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => break Err(RecvError::Io(e)),
        }
    };
    stream.set_read_timeout(limit)?;
    result
}

fn eof_is_closed(e: io::Error) -> RecvError {
    if e.kind() == io::ErrorKind::UnexpectedEof {
        RecvError::Closed
    } else {
        RecvError::Io(e)
    }
}

/// Writes a whole message.
pub fn send_message(stream: &mut UnixStream, bytes: &[u8]) -> io::Result<()> {
    stream.write_all(bytes)
}

/// Sends a whole message without blocking: fails with `WouldBlock` if the
/// socket buffer is full (nothing is written in that case, or the message
/// is completed if a part went out).
pub fn send_nonblocking(stream: &UnixStream, bytes: &[u8]) -> io::Result<()> {
    let fd = std::os::fd::AsRawFd::as_raw_fd(stream);
    let mut off = 0;
    let mut spins = 0;
    while off < bytes.len() {
        // SAFETY: the pointer and length describe the live `bytes` slice.
        let r = unsafe {
            libc::send(
                fd,
                bytes[off..].as_ptr().cast(),
                bytes.len() - off,
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            )
        };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::WouldBlock && off > 0 && spins < 1000 {
                // Never leave half a message on the channel.
                spins += 1;
                std::thread::yield_now();
                continue;
            }
            return Err(e);
        }
        off += r as usize;
    }
    Ok(())
}
