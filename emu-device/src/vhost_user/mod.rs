//! The vhost-user protocol: [`message`] decodes and encodes messages,
//! [`conn`] moves them over the socket, [`handler`] applies a frontend
//! request to a port's state; [`send_misses`] sends the port's IOTLB
//! misses on the backend channel.
pub mod conn;
pub mod handler;
pub mod message;

use std::io;
use std::os::unix::net::UnixStream;
use std::time::Instant;

use crate::memory::Miss;
use crate::port::{PortState, PortStats};

/// Sends an IOTLB MISS for `miss` on the backend channel, without blocking
/// (fails with `WouldBlock` when the frontend does not read it).
pub fn send_iotlb_miss(backend: &UnixStream, miss: Miss) -> io::Result<()> {
    conn::send_nonblocking(backend, &message::iotlb_miss(miss))
}

/// Sends the port's queued IOTLB misses to its frontend (non-blocking;
/// never waits for the answer), counting them in `stats`. Returns how many
/// were sent.
pub fn send_misses(state: &PortState, stats: &PortStats) -> usize {
    let due = state.shared.take_due_misses(Instant::now());
    if due.is_empty() {
        return 0;
    }
    let Some(backend) = &state.backend else {
        tracing::debug!(port = state.index, "IOTLB miss but no backend channel");
        return 0;
    };
    let mut sent = 0;
    for miss in due {
        match send_iotlb_miss(backend, miss) {
            Ok(()) => {
                tracing::debug!(port = state.index, iova = miss.iova, "IOTLB miss sent");
                PortStats::bump(&stats.iotlb_misses_sent);
                sent += 1;
            }
            Err(e) => {
                tracing::debug!(port = state.index, "cannot send IOTLB miss: {e}");
                state.shared.miss_not_sent(miss.iova);
            }
        }
    }
    sent
}
