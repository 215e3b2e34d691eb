//! Windows: the parts of a port's memory that peers may reach, and the keys
//! that name them.
//!
//! # Keys
//!
//! A key must be unguessable (a port never given a key must not find one by
//! trying, nor derive one from keys it holds) and never reused while the
//! device runs (a revoked key must never come to name another window).
//! Random draws alone give the first, but not the second for sure; a
//! counter gives the second, but not the first. The device does both: a key
//! is the image of a device-wide bind counter under a secret permutation of
//! 64-bit values, Blowfish keyed with 256 bits drawn from the operating
//! system's random source (`getrandom`) when the first key is made.
//!
//! * The counter never repeats, and a permutation maps distinct inputs to
//!   distinct outputs, so no two windows of the device's life share a key,
//!   on one port or across ports (a key of one port never opens another's
//!   window).
//! * Without the secret, the keys are indistinguishable from independent
//!   random 64-bit values: knowing some keys (one's own, or ones a peer
//!   handed out) says nothing about the others, and keys near a known one
//!   (a flipped bit, plus or minus a few) are as unlikely to be live as any
//!   other. A blind guess hits one of `n` live windows with probability
//!   `n / 2^64`.
//!
//! Lookup is a hash-map probe (SipHash with a random seed, so probes with
//! chosen keys cannot degrade it).
//!
//! # Checks
//!
//! [`WindowTable::check`] decides a remote access: the key names a live
//! window, the window is open or bound to the initiating port, it grants the
//! right, and the range lies inside it. Each refusal has its own
//! [`Refusal`] cause, which the device counts for the window's owner
//! ([`RefusalCounters`]); the initiator always gets the same answer.
//!
//! # Limit
//!
//! A table holds at most its limit of windows
//! ([`DEFAULT_MAX_WINDOWS_PER_PORT`] unless configured): binding beyond it
//! fails and changes nothing, so a port cannot grow the device's memory
//! without bound.

use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use blowfish::cipher::{Array, BlockCipherEncrypt, KeyInit};
use blowfish::Blowfish;
use parking_lot::RwLock;
use pindown_uapi::{Access, NodeId, RemoteKey};

/// Windows a port may hold at once unless the device is configured
/// otherwise (`--max-windows-per-port`).
pub const DEFAULT_MAX_WINDOWS_PER_PORT: usize = 65_536;

/// The device's source of keys: the secret permutation and the counter it
/// is applied to.
struct KeySource {
    permutation: Blowfish,
    /// Binds so far, device-wide; never goes back.
    counter: AtomicU64,
}

impl KeySource {
    /// A source keyed from the operating system's random source.
    fn from_os() -> Result<KeySource, getrandom::Error> {
        let mut secret = [0u8; 32];
        getrandom::fill(&mut secret)?;
        let permutation =
            Blowfish::new_from_slice(&secret).expect("32 bytes is a valid Blowfish key length");
        Ok(KeySource {
            permutation,
            counter: AtomicU64::new(0),
        })
    }

    /// A key never made before in this process. Zero is never a key.
    fn next(&self) -> RemoteKey {
        loop {
            let serial = self.counter.fetch_add(1, Ordering::Relaxed);
            let mut block = Array::from(serial.to_le_bytes());
            self.permutation.encrypt_block(&mut block);
            let key = u64::from_le_bytes(block.into());
            if key != 0 {
                return RemoteKey(key);
            }
        }
    }
}

/// The device's key source.
static KEYS: OnceLock<KeySource> = OnceLock::new();

/// Makes the device's key source: draws its secret from the operating
/// system's random source. The device calls it at start-up, so that a
/// machine without a usable random source refuses to start rather than
/// failing at the first bind. Calling it again changes nothing.
pub fn init_keys() -> Result<(), getrandom::Error> {
    if KEYS.get().is_none() {
        // Two first callers may both draw a secret; one is kept, and no key
        // was made from the other.
        let _ = KEYS.set(KeySource::from_os()?);
    }
    Ok(())
}

/// The device's key source, made on first use if [`init_keys`] was not
/// called.
fn keys() -> &'static KeySource {
    KEYS.get_or_init(|| {
        // Linux's getrandom(2) blocks until the pool is seeded and fails
        // only where there is no usable random source at all: then no key
        // the device could make would be safe to hand out.
        KeySource::from_os()
            .unwrap_or_else(|error| panic!("no random source for window keys: {error}"))
    })
}

/// A live window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    /// First I/O virtual address of the window in its owner's memory.
    pub start: u64,
    /// Length in bytes.
    pub len: u64,
    /// What peers may do.
    pub access: Access,
    /// The one port that may use the window, in the incarnation it had
    /// when the window was bound; `None`: any port holding the key.
    pub peer: Option<PortId>,
}

/// A port as a window binding names it: its index, and its incarnation,
/// which changes whenever the port is reset or served to a new frontend
/// connection. A window bound to a peer dies with that peer's
/// connection, as an InfiniBand type-2 memory window dies with its queue
/// pair: the next frontend given the same port index cannot use it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortId {
    /// The port's node.
    pub node: NodeId,
    /// The port's index.
    pub index: u16,
    /// The port's incarnation; [`PortId::ANY_INCARNATION`] in a window
    /// bound to a port of another node, whose incarnations this device does
    /// not see: such a window follows that port, not its connection.
    pub incarnation: u64,
}

impl PortId {
    /// The incarnation of a window's peer on another node (a port's own
    /// incarnations count up from 0 and never reach it).
    pub const ANY_INCARNATION: u64 = u64::MAX;

    /// Whether a window bound to `self` lets `initiator` in.
    pub fn admits(&self, initiator: PortId) -> bool {
        self.node == initiator.node
            && self.index == initiator.index
            && (self.incarnation == initiator.incarnation
                || self.incarnation == Self::ANY_INCARNATION)
    }
}

impl Window {
    /// The owner's I/O virtual address of `[offset, offset + len)` inside the
    /// window, if it lies inside.
    pub fn resolve(&self, offset: u64, len: u64) -> Option<u64> {
        let end = offset.checked_add(len)?;
        (end <= self.len).then(|| self.start + offset)
    }
}

/// Why a remote access was refused. The initiator is never told which; the
/// owner's counters are.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Refusal {
    /// No live window has the key (never bound, or revoked).
    BadKey,
    /// The window is bound to another port.
    WrongPeer,
    /// The window does not grant the access.
    MissingRight,
    /// The range reaches outside the window.
    OutOfBounds,
    /// The range lies inside the window, but the owner no longer has that
    /// memory registered with the device (or not with the permission the
    /// access needs).
    Unregistered,
}

/// Refused remote accesses to one port's windows, by cause.
#[derive(Debug, Default)]
pub struct RefusalCounters {
    /// Unknown or revoked keys.
    pub bad_key: AtomicU64,
    /// Windows bound to another port.
    pub wrong_peer: AtomicU64,
    /// Rights the window does not grant.
    pub missing_right: AtomicU64,
    /// Ranges outside the window.
    pub out_of_bounds: AtomicU64,
    /// Ranges inside the window but no longer registered by the owner (or
    /// not with the permission the access needs).
    pub unregistered: AtomicU64,
}

impl RefusalCounters {
    /// The causes as the status socket names them (`refused_<name>`),
    /// with their counters.
    pub fn named(&self) -> [(&'static str, &AtomicU64); 5] {
        [
            ("bad_key", &self.bad_key),
            ("wrong_peer", &self.wrong_peer),
            ("missing_right", &self.missing_right),
            ("out_of_bounds", &self.out_of_bounds),
            ("unregistered", &self.unregistered),
        ]
    }

    /// Counts one refusal.
    pub fn count(&self, refusal: Refusal) {
        let counter = match refusal {
            Refusal::BadKey => &self.bad_key,
            Refusal::WrongPeer => &self.wrong_peer,
            Refusal::MissingRight => &self.missing_right,
            Refusal::OutOfBounds => &self.out_of_bounds,
            Refusal::Unregistered => &self.unregistered,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Refusals of every cause.
    pub fn total(&self) -> u64 {
        [
            &self.bad_key,
            &self.wrong_peer,
            &self.missing_right,
            &self.out_of_bounds,
            &self.unregistered,
        ]
        .iter()
        .map(|counter| counter.load(Ordering::Relaxed))
        .sum()
    }
}

/// A bind refused because the table is full.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the port already holds {limit} windows, the most allowed (--max-windows-per-port)")]
pub struct WindowLimit {
    /// The limit.
    pub limit: usize,
}

/// Hashes a window key for the table. Keys are the device's own
/// permutation outputs, indistinguishable from random 64-bit values, and
/// only the device inserts them: no caller can choose keys that collide,
/// so the key itself (its bits spread by one multiplication) is as good a
/// hash as SipHash's, at a fraction of the cost of a lookup on every
/// remote access.
#[derive(Default)]
struct KeyHasher(u64);

impl std::hash::Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Not used by u64 keys; kept total for any other use.
        for &byte in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(byte)).wrapping_mul(K);
        }
    }

    fn write_u64(&mut self, key: u64) {
        self.0 = (key ^ self.0).wrapping_mul(K);
    }
}

/// An odd constant with well-spread bits (2^64 / golden ratio).
const K: u64 = 0x9E37_79B9_7F4A_7C15;

/// One port's windows.
#[derive(Debug)]
pub struct WindowTable {
    windows: RwLock<HashMap<u64, Window, BuildHasherDefault<KeyHasher>>>,
    limit: usize,
}

impl Default for WindowTable {
    fn default() -> Self {
        Self::with_limit(DEFAULT_MAX_WINDOWS_PER_PORT)
    }
}

impl WindowTable {
    /// An empty table holding at most [`DEFAULT_MAX_WINDOWS_PER_PORT`]
    /// windows.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty table holding at most `limit` windows.
    pub fn with_limit(limit: usize) -> Self {
        WindowTable {
            windows: RwLock::new(HashMap::default()),
            limit,
        }
    }

    /// The most windows the table holds.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Adds a window; returns its new key, or fails, changing nothing, when
    /// the table is full.
    pub fn bind(&self, window: Window) -> Result<RemoteKey, WindowLimit> {
        let mut windows = self.windows.write();
        if windows.len() >= self.limit {
            return Err(WindowLimit { limit: self.limit });
        }
        let key = keys().next();
        windows.insert(key.0, window);
        Ok(key)
    }

    /// Removes a window; returns whether it was live.
    pub fn revoke(&self, key: RemoteKey) -> bool {
        self.windows.write().remove(&key.0).is_some()
    }

    /// The live window named by `key`.
    pub fn get(&self, key: RemoteKey) -> Option<Window> {
        self.windows.read().get(&key.0).copied()
    }

    /// Decides an access by port `initiator` (in its current incarnation)
    /// to `[offset, offset + len)` of
    /// the window named `key`, needing `needed`: the owner's I/O virtual
    /// address of the range, or why it is refused. Checks in order: the key,
    /// the peer, the right, the bounds.
    pub fn check(
        &self,
        key: RemoteKey,
        initiator: PortId,
        offset: u64,
        len: u64,
        needed: Access,
    ) -> Result<u64, Refusal> {
        let window = self.get(key).ok_or(Refusal::BadKey)?;
        if window.peer.is_some_and(|peer| !peer.admits(initiator)) {
            return Err(Refusal::WrongPeer);
        }
        if !window.access.contains(needed) {
            return Err(Refusal::MissingRight);
        }
        window.resolve(offset, len).ok_or(Refusal::OutOfBounds)
    }

    /// Revokes every window (the owner went away).
    pub fn clear(&self) {
        let mut windows = self.windows.write();
        windows.clear();
        // Give back what a full table took.
        windows.shrink_to_fit();
    }

    /// Number of live windows.
    pub fn len(&self) -> usize {
        self.windows.read().len()
    }

    /// Whether no window is live.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    fn window(access: Access) -> Window {
        Window {
            start: 0x1000,
            len: 0x100,
            access,
            peer: None,
        }
    }

    #[test]
    fn keys_are_unique_across_tables_and_never_zero() {
        let tables: Vec<WindowTable> = (0..4).map(|_| WindowTable::new()).collect();
        let mut seen = HashSet::new();
        for round in 0..50_000 {
            let table = &tables[round % tables.len()];
            let key = table.bind(window(Access::REMOTE_READ)).unwrap();
            assert_ne!(key.0, 0);
            assert!(seen.insert(key), "{key} made twice");
            assert!(table.revoke(key));
        }
    }

    #[test]
    fn keys_look_random_not_sequential() {
        // Consecutive binds give keys with no visible order: about half the
        // bits differ between neighbours, in the high half as in the low.
        let table = WindowTable::new();
        let keys: Vec<u64> = (0..4096)
            .map(|_| table.bind(window(Access::REMOTE_READ)).unwrap().0)
            .collect();
        let flips = |mask: u64| -> f64 {
            let total: u32 = keys
                .windows(2)
                .map(|pair| ((pair[0] ^ pair[1]) & mask).count_ones())
                .sum();
            f64::from(total) / (keys.len() - 1) as f64
        };
        let (low, high) = (flips(0xffff_ffff), flips(0xffff_ffff << 32));
        assert!((14.0..18.0).contains(&low), "low half flips {low}");
        assert!((14.0..18.0).contains(&high), "high half flips {high}");
        // Every bit is set in about half of the keys (none stuck).
        for bit in 0..64 {
            let set = keys.iter().filter(|k| *k & (1 << bit) != 0).count();
            assert!((1700..2400).contains(&set), "bit {bit} set in {set}");
        }
    }

    #[test]
    fn a_revoked_key_stays_dead_and_its_window_gets_a_new_key_when_bound_again() {
        let table = WindowTable::new();
        let read = window(Access::REMOTE_READ);
        let first = table.bind(read).unwrap();
        assert!(table.revoke(first));
        let second = table.bind(read).unwrap();
        assert_ne!(first, second, "the same window bound again: a new key");
        assert_eq!(table.get(first), None);
        assert_eq!(table.get(second), Some(read));
        assert!(
            !table.revoke(first),
            "a revoked key cannot be revoked again"
        );
        // Neither many more binds, nor clearing the table, brings it back.
        let later: HashSet<RemoteKey> = (0..10_000).map(|_| table.bind(read).unwrap()).collect();
        assert!(!later.contains(&first) && !later.contains(&second));
        table.clear();
        assert!(table.is_empty());
        let after_clear = table.bind(read).unwrap();
        assert!(![first, second].contains(&after_clear) && !later.contains(&after_clear));
        assert_eq!(
            table.check(first, id(0), 0, 1, Access::REMOTE_READ),
            Err(Refusal::BadKey)
        );
    }

    #[test]
    fn the_limit_refuses_binds_and_changes_nothing() {
        let table = WindowTable::with_limit(3);
        let keys: Vec<RemoteKey> = (0..3)
            .map(|_| table.bind(window(Access::REMOTE_WRITE)).unwrap())
            .collect();
        for _ in 0..1000 {
            assert_eq!(
                table.bind(window(Access::REMOTE_WRITE)),
                Err(WindowLimit { limit: 3 })
            );
        }
        assert_eq!(table.len(), 3);
        for key in &keys {
            assert!(table.get(*key).is_some(), "earlier windows still live");
        }
        // Revoking one makes room for exactly one.
        assert!(table.revoke(keys[1]));
        assert!(table.bind(window(Access::REMOTE_WRITE)).is_ok());
        assert!(table.bind(window(Access::REMOTE_WRITE)).is_err());
        let message = WindowLimit { limit: 3 }.to_string();
        assert!(message.contains("3 windows") && message.contains("--max-windows-per-port"));
    }

    fn id(index: u16) -> PortId {
        PortId {
            node: 0,
            index,
            incarnation: 7,
        }
    }

    #[test]
    fn a_window_bound_to_a_peer_dies_with_the_peer_s_incarnation() {
        let table = WindowTable::new();
        let bound = table
            .bind(Window {
                peer: Some(id(2)),
                ..window(Access::REMOTE_WRITE)
            })
            .unwrap();
        let w = Access::REMOTE_WRITE;
        assert_eq!(table.check(bound, id(2), 0, 8, w), Ok(0x1000));
        let next = PortId {
            incarnation: 8,
            ..id(2)
        };
        assert_eq!(table.check(bound, next, 0, 8, w), Err(Refusal::WrongPeer));
    }

    #[test]
    fn checks_tell_the_causes_apart_in_order() {
        let table = WindowTable::new();
        let bound = table
            .bind(Window {
                peer: Some(id(2)),
                ..window(Access::REMOTE_WRITE)
            })
            .unwrap();
        let open = table.bind(window(Access::REMOTE_READ)).unwrap();
        let w = Access::REMOTE_WRITE;
        assert_eq!(table.check(bound, id(2), 0x10, 8, w), Ok(0x1010));
        assert_eq!(
            table.check(bound, id(1), 0x10, 8, w),
            Err(Refusal::WrongPeer)
        );
        // The peer is checked before rights and bounds.
        assert_eq!(
            table.check(bound, id(1), 0x1000, 8, Access::REMOTE_ATOMIC),
            Err(Refusal::WrongPeer)
        );
        assert_eq!(
            table.check(bound, id(2), 0, 8, Access::REMOTE_ATOMIC),
            Err(Refusal::MissingRight)
        );
        assert_eq!(
            table.check(bound, id(2), 0xf9, 8, w),
            Err(Refusal::OutOfBounds)
        );
        assert_eq!(
            table.check(open, id(9), 0, 0x100, Access::REMOTE_READ),
            Ok(0x1000)
        );
        assert_eq!(
            table.check(RemoteKey(open.0 ^ 1), id(9), 0, 1, Access::REMOTE_READ),
            Err(Refusal::BadKey)
        );
    }

    #[test]
    fn counters_count_each_cause() {
        let counters = RefusalCounters::default();
        for refusal in [
            Refusal::BadKey,
            Refusal::BadKey,
            Refusal::WrongPeer,
            Refusal::MissingRight,
            Refusal::OutOfBounds,
            Refusal::Unregistered,
        ] {
            counters.count(refusal);
        }
        assert_eq!(counters.bad_key.load(Ordering::Relaxed), 2);
        assert_eq!(counters.wrong_peer.load(Ordering::Relaxed), 1);
        assert_eq!(counters.total(), 6);
    }

    #[test]
    fn resolve_checks_bounds_without_overflow() {
        let window = window(Access::REMOTE_WRITE);
        assert_eq!(window.resolve(0, 0x100), Some(0x1000));
        assert_eq!(window.resolve(0xff, 1), Some(0x10ff));
        assert_eq!(window.resolve(0xff, 2), None);
        assert_eq!(window.resolve(u64::MAX, 2), None);
    }
}
