//! The fabric between device processes on different hosts: reliable
//! delivery of messages over UDP datagrams, as a protocol core with no I/O
//! of its own (in the manner of quinn-proto).
//!
//! The caller owns the sockets and the clock. It feeds received datagrams
//! to [`Endpoint::receive`] (which hands back a new message, borrowed from
//! the datagram), sends what [`Endpoint::poll_transmit`] hands out, calls
//! [`Endpoint::handle_timeout`] at [`Endpoint::poll_timeout`], and reads
//! [`Event`]s with [`Endpoint::poll_event`]. Because nothing here reads a
//! clock or a socket, loss, duplication and reordering are tested
//! deterministically on a virtual clock ([`FaultInjector`] and the
//! simulated network of the tests).
//!
//! # Protocol
//!
//! The design follows ACP's UDP layer (per-destination sequence numbers, an
//! acknowledgement for every datagram, retransmission on timeout with a
//! backoff from 100 us to 100 ms, a job token in every datagram), improved
//! where ACP pays for simplicity:
//!
//! - **Two streams: requests and replies.** A message sent with
//!   [`Endpoint::send`] is a request and may be answered; one sent with
//!   [`Endpoint::send_reply`] (an operation's result) is a reply and is
//!   never answered. Each [`Stream`] has its own sequence numbers, window
//!   and acknowledgements in each direction. A request is delivered only
//!   when its receiver could queue `response_reserve` replies to the sender
//!   at once (else it is dropped, [`DropReason::NoResponseRoom`], and
//!   retransmitted later); replies are always delivered. So replies always
//!   drain, the room for them comes back, and two peers busy answering
//!   each other's requests cannot stall each other — which they could if
//!   replies shared a window with requests a peer refuses.
//! - **Selective acknowledgement instead of go-back-N.** ACP drops every
//!   datagram that is not the next in sequence. Here messages are
//!   independent (each RDMA operation is self-contained), so a receiver
//!   delivers each new message at once, in any order, at most once. It
//!   keeps per peer and stream only a cumulative acknowledgement (every
//!   seq below it delivered) and a 64-bit bitmap of the 64 seqs after it —
//!   no receive buffers. A message beyond that window is dropped and
//!   retransmitted later; the sender never lets its unacknowledged span
//!   exceed the window, so that only happens after a peer abandoned
//!   messages.
//! - **Acknowledgements ride on reverse traffic.** Every datagram's header
//!   carries the acknowledgements of both streams for its destination; a
//!   pure acknowledgement goes out only when no message to that peer left
//!   within `ack_delay`. Only messages are acknowledged, never
//!   acknowledgements.
//! - **Retransmission.** Per peer, a retransmission timeout from an RFC
//!   6298 round-trip estimate (samples only from messages sent once,
//!   Karn's rule), clamped to `rto_min..=rto_max`. When the timer fires,
//!   the oldest message of each stream unacknowledged for a full timeout
//!   is sent again as a probe (flagged as one) and the timeout doubles up
//!   to `rto_max`; a fresh round-trip sample ends the backoff. The
//!   receiver echoes a probe in its next datagram, after it has taken
//!   every datagram that came before the probe. At the echo, every message
//!   sent before the probe and still unacknowledged was lost (datagrams
//!   between two hosts keep their order, or nearly) and goes again at
//!   once. A receiver that was only slow (a process not scheduled for a
//!   while, draining its backlog a pass at a time) thus gets one duplicate
//!   per timeout, not a copy of everything in flight, and a lost tail
//!   costs one timeout, not one per message, however high the stall left
//!   the round-trip estimate. A hole is retransmitted at once, once, when
//!   `fast_retransmit_threshold` later messages of its stream were
//!   selectively acknowledged.
//! - **One shared pool.** Unacknowledged messages live in one fixed pool of
//!   `pool_slots` slots allocated at start, shared by all peers (ACP keeps
//!   64 fixed entries as well). Per peer the endpoint keeps 64 bytes: a
//!   56-byte record, its node number, its index entry and its possible
//!   place in the queue of pure acknowledgements. The retransmission and
//!   peer-gone timers run only while messages are outstanding, so they
//!   are kept with the peer's oldest outstanding message in the pool.
//!   Timers count whole microseconds.
//!   `send` refuses with [`SendError::WindowFull`] or
//!   [`SendError::PoolFull`] rather than queueing without bound; requests
//!   leave `response_reserve` slots for replies.
//! - **Liveness.** A peer that makes no acknowledgement progress for
//!   `peer_timeout` while messages to it are outstanding is declared gone:
//!   its messages are abandoned ([`Event::Abandoned`] each, then
//!   [`Event::PeerGone`]); `send_reply` to it fails until a datagram from
//!   it arrives again (or [`Endpoint::revive_peer`]), while a new message
//!   (`send`) probes it and is given up after `peer_timeout` in turn. A
//!   restarted peer answers a probe addressed to its previous life with a
//!   pure acknowledgement, which reveals its new incarnation. Every
//!   datagram carries the sender's *floor* per stream (all its seqs below
//!   are acknowledged or abandoned), so a receiver whose peer abandoned
//!   messages moves its cumulative ack past them ([`Event::PeerAbandoned`])
//!   instead of waiting forever.
//!
//! Every `seq` returned by `send` or `send_reply` ends in exactly one
//! [`Event::Acked`] or one [`Event::Abandoned`] of its stream.
//!
//! ## The horizon rule
//!
//! Every header carries the sender's *horizon*: its next unassigned reply
//! seq towards the destination when the header was built (after the
//! datagram's own seq if it is a reply). The device handles a delivered
//! request and queues its replies to the requester with `send_reply` (at
//! most `response_reserve` of them, which always succeed right after
//! `receive` returned the request) before it calls `receive` or
//! `poll_transmit` again, and the acknowledgement of the request leaves
//! with (or after) those replies. So when the initiator sees
//! `Acked { stream: Request, seq, horizon }`, every reply to `seq` has a
//! reply seq below `horizon`, and all have been delivered once
//! `delivered_through(node, Stream::Reply)` reaches `horizon` (or were
//! given up, reported by [`Event::PeerAbandoned`]).
//!
//! ## Identity and incarnations
//!
//! Every datagram carries the fabric's job token, source and destination
//! node, the source's incarnation (random, nonzero, new at every device
//! start) and the destination's incarnation as the sender knows it (0 =
//! not known yet). A receiver drops, and counts: another format or
//! version, another token, another destination node, an unknown source
//! node, a truncated or oversized datagram, and a destination incarnation
//! that is neither 0 nor its own (meant for its previous life).
//!
//! A message that names no destination incarnation (0) is not delivered:
//! an earlier incarnation of the receiver may have delivered it already.
//! The receiver answers with an acknowledgement naming itself, and the
//! sender, on learning the incarnation, sends everything outstanding again
//! naming it ([`DropReason::NotYetIntroduced`]; one extra round trip when
//! two devices first meet). Outstanding messages are abandoned whenever the
//! recorded incarnation changes, so every copy of a message names the same
//! incarnation and no message is delivered by two incarnations of a node.
//!
//! Incarnations are random, so their values do not tell old from new. The
//! rules, for a datagram from peer `P` with source incarnation `s` when `r`
//! is recorded for `P`:
//!
//! 1. `r` is 0 (never heard from `P`): record `s`, and answer (naming it).
//! 2. `s == r`: accept.
//! 3. `s` was retired for `P` less than `peer_timeout` ago: drop as stale.
//! 4. `s` acknowledges something of ours (an ack or selective ack of
//!    either stream): it knew a session of ours that we no longer have —
//!    late from a life we left, or the live one after we were made to leave
//!    it. Drop as stale: taking it would reset our streams towards `P`
//!    while it keeps its own, and it would then acknowledge our new
//!    messages as duplicates of old ones without delivering them.
//! 5. `s` names ours and was proposed less than `peer_timeout` ago: it
//!    heard our introduction, so `P` restarted: retire `r`, abandon
//!    everything outstanding to `P`, start both streams in both directions
//!    from 0, emit [`Event::PeerRestarted`], and process the datagram.
//! 6. Otherwise *propose* `s` as `P`'s next life and introduce ourselves to
//!    it (a pure acknowledgement to `P`'s address that names `s` and
//!    acknowledges nothing; the live `r`, if that is who gets it, drops it
//!    as addressed to another life), and drop the datagram
//!    ([`DropReason::UnconfirmedIncarnation`]). Nothing changes yet.
//!
//! The destination check comes first, so a datagram naming another
//! incarnation of ours never gets this far; it is answered, since the peer
//! still addresses a life of ours that ended: with a pure acknowledgement
//! naming none when we have not heard from the peer (see below), else
//! with an introduction to `r` when it comes from `r`, or to `s`,
//! proposed, when it does not. A
//! new incarnation of `P` has delivered nothing of ours (we never named
//! it), so it acknowledges nothing; it cannot know our incarnation before
//! it hears from us, and it hears from us only in an introduction (our
//! datagrams to `P` name `r`, which it drops). So its first datagrams are
//! proposed (rule 6), and once introduced it records us and answers naming
//! us (rules 1 and 5): one round trip. When both sides proposed each other
//! (each recorded another life of the other), the first introduction that
//! arrives names a proposed life and is taken, and the answer to it (a
//! restart taken is answered) completes the other side: introductions
//! never bounce back and forth. A datagram of a life that will never answer — late from a life
//! that ended, corrupted on the way, or forged — is not taken for a
//! restart. Rule 3 drops a late datagram of the old incarnation (which may
//! name ours correctly) quickly, and rule 4 after that if it acknowledged
//! anything. The limits: two late copies of a datagram of a life that
//! ended having delivered nothing of ours, the second arriving after our
//! introduction, pass for its answer; and the job token is not an
//! authenticator: a host that knows it and can send from `P`'s address can
//! play both parts of a restart. Either resets our state towards `P`, and
//! the live incarnation, which acknowledges our old session, is then
//! refused (rule 4) until one of the two restarts: a partition that fails
//! operations visibly, never a message lost while reported delivered, and
//! never a crash or a hang of the device.
//!
//! When a device restarts, its peers still address the old incarnation. On
//! such a stale datagram from a peer it has not heard from in this life,
//! the device answers with a pure acknowledgement, which names no
//! incarnation of the peer and so is never stale itself: the peer proposes
//! the new incarnation and introduces itself (rule 6), the device records
//! it and answers naming it (rule 1), and the peer takes the restart (rule
//! 5) within two round trips instead of timing out.
//!
//! ## Wire format
//!
//! See [`wire`]: a 76-byte little-endian header, then the message.

pub mod faults;
pub mod reliable;
#[cfg(test)]
mod sim;
#[cfg(test)]
mod tests;
pub mod wire;

/// A node of the fabric: one device process.
pub type NodeId = u16;
/// A message's sequence number from one sender to one receiver in one
/// [`Stream`]; compared modulo 2^32 ([`wire::seq_before`]).
pub type Seq = u32;

pub use faults::{FaultInjector, FaultStats, Faults, FaultsParseError};
pub use reliable::{
    AddPeerError, Config, ConfigError, DropReason, Endpoint, Event, Identity, MemoryReport,
    Message, SendError, Stats, Stream,
};
