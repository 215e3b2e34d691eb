//! The vhost-user request loop pieces: message decoding, socket I/O and
//! request semantics.
pub mod conn;
pub mod handler;
pub mod message;

use std::io;
use std::os::unix::net::UnixStream;

use crate::memory::Miss;

/// Sends an IOTLB MISS for `miss` on the backend channel, without blocking
/// (fails with `WouldBlock` when the frontend does not read it).
pub fn send_iotlb_miss(backend: &UnixStream, miss: Miss) -> io::Result<()> {
    conn::send_nonblocking(backend, &message::iotlb_miss(miss))
}
