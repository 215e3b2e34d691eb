//! Why a messaging call failed.

use pindown_driver::launch::LaunchError;
use pindown_driver::verbs::VerbsError;
use pindown_uapi::CompletionError;

/// Why a messaging call failed. Every variant names what was wrong; none
/// leaves a message half delivered without saying so.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The driver refused or failed (the device may be gone).
    #[error("driver: {0}")]
    Verbs(#[from] VerbsError),
    /// Joining the job or exchanging addresses through the launcher failed.
    #[error("launcher: {0}")]
    Launch(#[from] LaunchError),
    /// A request to the device completed with an error.
    #[error("device: {0}")]
    Completion(#[from] CompletionError),
    /// A rank outside the communicator.
    #[error("rank {rank} is not in this communicator of {size} ranks")]
    NoSuchRank {
        /// The rank named.
        rank: u32,
        /// The communicator's size.
        size: u32,
    },
    /// A matching slot index at or beyond the number of slots per peer.
    #[error("slot index {index} is out of range: {slots} slots per peer and communicator (Config::slots)")]
    SlotOutOfRange {
        /// The index named.
        index: u32,
        /// Slots per peer and communicator.
        slots: u32,
    },
    /// A receive on a slot whose previous receive has not completed: each
    /// (peer, communicator, index) holds one receive at a time.
    #[error("slot {index} from rank {peer} already holds a receive that has not completed")]
    SlotBusy {
        /// The peer (rank in the communicator).
        peer: u32,
        /// The slot index.
        index: u32,
    },
    /// A wait or test on a (peer, index) with no request outstanding.
    #[error("no {what} is outstanding on slot {index} of rank {peer}")]
    NoRequest {
        /// "send" or "receive".
        what: &'static str,
        /// The peer (rank in the communicator).
        peer: u32,
        /// The slot index.
        index: u32,
    },
    /// The message was longer than the receive buffer: the first
    /// `capacity` bytes arrived, nothing was written past the buffer.
    #[error("message of {message} bytes truncated to the {capacity}-byte receive buffer")]
    Truncated {
        /// The message's length.
        message: u64,
        /// The receive buffer's length (bytes delivered).
        capacity: u64,
    },
    /// The peer stopped answering (its process or its device is gone):
    /// the operation with it cannot complete.
    #[error("rank {peer} (world) is gone: {why}")]
    PeerGone {
        /// The peer's world rank.
        peer: u32,
        /// What showed it.
        why: String,
    },
    /// Too many communicators: every context id is taken.
    #[error("no free communicator context: {contexts} in use (Config::communicators)")]
    NoContext {
        /// Contexts configured.
        contexts: u32,
    },
    /// Too many any-source messages in flight to one receiver.
    #[error("any-source message of {len} bytes exceeds the limit of {limit} bytes")]
    TooLong {
        /// The message's length.
        len: u64,
        /// The largest allowed.
        limit: u64,
    },
    /// A record a peer published or wrote into this rank's memory does
    /// not hold: an address record that does not decode (another version
    /// of the library, or a corrupted key-value space), or a control word
    /// no honest peer writes (a slot index out of range, an epoch beyond
    /// the next). Nothing was delivered on its word.
    #[error("rank {rank} wrote a record this rank refuses: {why}")]
    BadPeerRecord {
        /// The rank whose record it is.
        rank: u32,
        /// What was wrong.
        why: String,
    },
    /// Finalizing found sends whose receives never came, or requests the
    /// device did not finish.
    #[error("{spooled} spooled sends still wait for their receives and {in_flight} requests are unfinished")]
    Unfinished {
        /// Sends still waiting for their receives.
        spooled: u64,
        /// Requests posted and not completed.
        in_flight: u64,
    },
    /// Ranks disagree about a collective call's arguments.
    #[error("collective mismatch: {0}")]
    Mismatch(String),
    /// A member gave up the collective call this rank waits in (the call
    /// failed there): it cannot complete.
    #[error("rank {rank} (world) gave up collective call {call} on this communicator")]
    MemberFailed {
        /// The member's world rank.
        rank: u32,
        /// The call's number among the communicator's collective calls.
        call: u64,
    },
    /// A member gave up the split or dup that made this communicator
    /// (collective call `call` on the communicator it was made from), so
    /// it has no part in this one: a collective call here cannot complete.
    #[error(
        "rank {rank} (world) gave up the split or dup that made this communicator \
         (collective call {call} on the communicator it was made from)"
    )]
    NotAMember {
        /// The member's world rank.
        rank: u32,
        /// The split's or dup's call number on the communicator it was
        /// made from.
        call: u64,
    },
    /// An earlier collective call on this communicator failed on this
    /// rank, so the members' collective state no longer agrees: no
    /// collective call on it runs any more (point-to-point still does;
    /// collectives go on over another communicator).
    #[error("the communicator's collectives stopped at an earlier failure: {0}")]
    CommunicatorBroken(String),
    /// A collective algorithm chosen explicitly cannot do what was asked
    /// (data too long for the flag words, too many ranks).
    #[error("collective algorithm unsuitable: {0}")]
    Unsuitable(String),
    /// A global address's color names no network interface.
    #[error("color {color} does not exist ({colors} colors)")]
    NoSuchColor {
        /// The color named.
        color: u32,
        /// Colors there are.
        colors: u32,
    },
    /// Every key-table entry is in use.
    #[error("no key-table entry left: all {entries} are registered (Config::registrations)")]
    NoRegistrationLeft {
        /// Entries in the table.
        entries: u32,
    },
    /// A key or global address names no live registration.
    #[error("no registration for key {key}: {why}")]
    NoSuchKey {
        /// The key (the global address without its offset).
        key: crate::global_memory::Key,
        /// What was wrong.
        why: String,
    },
    /// A range reaches past its registration's end.
    #[error(
        "{len} bytes at global address {address} reach past its registration of {registered} bytes"
    )]
    OutOfBounds {
        /// Where the range starts.
        address: crate::global_memory::GlobalAddress,
        /// Its length.
        len: u64,
        /// Bytes registered.
        registered: u64,
    },
    /// A global address of another rank where this rank's memory is
    /// needed.
    #[error("global address {address} is rank {rank}'s memory, not this rank's")]
    NotLocal {
        /// The address.
        address: crate::global_memory::GlobalAddress,
        /// Its rank.
        rank: u32,
    },
    /// A global-memory operation failed on the device.
    #[error("{what} failed: {why}")]
    Operation {
        /// The operation.
        what: String,
        /// The device's answer.
        why: String,
    },
    /// A call after [`Messenger::finalize`](crate::Messenger::finalize).
    #[error("the messenger was finalized: no call starts after Messenger::finalize")]
    Finalized,
    /// A configuration this library cannot run with: a value out of its
    /// range, named with the range.
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    /// An active-message or one-sided call of [`gasnet`](crate::gasnet)
    /// failed: a bad argument, a malformed packet from a peer, a reply
    /// where none is allowed, a wait that timed out.
    #[error("gasnet: {0}")]
    Gasnet(String),
}

impl Error {
    /// Whether the error says a member gave up a collective call (or the
    /// split or dup that made the communicator).
    pub(crate) fn is_member_fault(&self) -> bool {
        matches!(self, Error::MemberFailed { .. } | Error::NotAMember { .. })
    }
}

/// The result of a messaging call.
pub type Result<T> = std::result::Result<T, Error>;
