//! Where each shared word lives in a rank's control memory.
//!
//! A rank's control memory starts with one **block per peer** (world
//! rank `p`, itself included), holding every word that peer, and only
//! that peer, writes into this rank; each block is exposed through a
//! window bound to that peer's port alone, so no rank can write, or
//! read, another peer's words. Block `p` holds, for each communicator
//! context `c` and slot index `i`, at the slot's number `((p * contexts)
//! + c) * slots + i` (its position in the block: `c * slots + i`):
//!
//! * a **match record** (32 bytes) that peer `p` writes when it posts a
//!   receive from this rank on slot `i`: the receive buffer's window key,
//!   its offset in that window, its capacity, and last a stamp (the
//!   receive's generation on the slot), written after the rest by a fenced
//!   write. This rank's send on the slot reads it: sender-side matching.
//! * a **done word** (8 bytes) that peer `p` writes when it completes a
//!   send to this rank on slot `i`: the generation of the receive it
//!   completes (top 24 bits) and the message's length (low 40 bits). It
//!   is written after the body, by a fenced write, as one aligned 8-byte
//!   store.
//!
//! then, for each context, the any-source ring of [`ANY_ENTRIES`] entries
//! of [`ANY_ENTRY_BYTES`] that the peer fills and this rank drains, and
//! the credit words the peer's receiver side writes back, one per
//! context.
//!
//! After the blocks comes the collective area, exposed to every rank of
//! the job through one window: for each context, [`COLLECTIVE_WORDS`]
//! flag words (barrier rounds, tree arrival and release, reduction step
//! epochs) and the data areas of small reductions ([`COLLECTIVE_STEPS`]
//! steps, two parities each, of [`COLLECTIVE_DATA_BYTES`]); every word of
//! it has one writer per collective call, which the epochs check. Last
//! comes scratch memory no window exposes (inline payloads are staged
//! there before posting).

/// Bytes of a match record.
pub const MATCH_RECORD_BYTES: u64 = 32;
/// Offset of the stamp word inside a match record.
pub const MATCH_STAMP_AT: u64 = 24;
/// Bytes of a done word.
pub const DONE_WORD_BYTES: u64 = 8;
/// Bits of the message length in a done word (the top one of them is
/// [`OFFER_FLAG`]).
pub const DONE_LEN_BITS: u32 = 40;
/// Set in a done word's length field when the sender left an offer (its
/// window and access pattern) for the receiver to read from, instead of
/// writing the body: the typed rendezvous.
pub const OFFER_FLAG: u64 = 1 << (DONE_LEN_BITS - 1);
/// The longest message a done word can report.
pub const MAX_MESSAGE: u64 = OFFER_FLAG - 1;
/// Set in a match record's capacity when the receive is typed: its key
/// and offset name the receiver's offer buffer, not the receive buffer.
pub const TYPED_RECEIVE: u64 = 1 << 63;
/// Set in the first word of a match record by a typed receive once it has
/// read the sender's bytes: the sender's notice (the low bits carry the
/// receive's generation).
pub const READ_NOTICE: u64 = 1 << 62;
/// Entries in each any-source ring.
pub const ANY_ENTRIES: u64 = 16;
/// Bytes of each any-source ring entry: a 16-byte header and the body of
/// an eager message.
pub const ANY_ENTRY_BYTES: u64 = 1024;
/// Bytes of an any-source entry's header: the stamp word (the message's
/// sequence number from its sender, 1 first; written last) and the
/// message word ([`any_message_word`]).
pub const ANY_HEADER_BYTES: u64 = 16;
/// The longest body an any-source entry carries in place (eager);
/// longer messages travel by rendezvous.
pub const ANY_EAGER_BYTES: u64 = ANY_ENTRY_BYTES - ANY_HEADER_BYTES;
/// The bit of an any-source message word marking a rendezvous entry
/// (its body holds the sender's window key and the message length).
pub const ANY_RENDEZVOUS: u64 = 1 << 63;

/// The message word of an any-source entry: the tag (low 32 bits), the
/// eager body's length (bits 32..62) or, for rendezvous, the
/// [`ANY_RENDEZVOUS`] bit.
pub fn any_message_word(tag: u32, eager_len: Option<u64>) -> u64 {
    match eager_len {
        Some(len) => (len & 0x7fff_ffff) << 32 | u64::from(tag),
        None => ANY_RENDEZVOUS | u64::from(tag),
    }
}

/// The tag and (for an eager entry) the body length a message word carries.
pub fn any_message(word: u64) -> (u32, Option<u64>) {
    let tag = word as u32;
    if word & ANY_RENDEZVOUS != 0 {
        (tag, None)
    } else {
        (tag, Some((word >> 32) & 0x7fff_ffff))
    }
}

/// The credit word a receiver writes back for one sender's ring: how many
/// of the sender's entries it has drained (low 32 bits) and how many of
/// its rendezvous messages it has finished reading (high 32 bits), both
/// counted modulo 2^32 (a sender compares them with its own counts by
/// wrapping differences: at most [`ANY_ENTRIES`] entries and one
/// rendezvous message are ever outstanding).
pub fn any_credit_word(drained: u64, reads: u64) -> u64 {
    (reads & 0xffff_ffff) << 32 | (drained & 0xffff_ffff)
}

/// The (drained, reads) counts of a credit word, modulo 2^32.
pub fn any_credit_counts(word: u64) -> (u32, u32) {
    (word as u32, (word >> 32) as u32)
}

/// Bytes of this rank's own scratch memory.
pub const SCRATCH_BYTES: u64 = 4096;
/// Flag words of each context's collective area.
pub const COLLECTIVE_WORDS: u64 = 64;
/// Dissemination barrier rounds the flag words hold (up to 2^16 ranks).
pub const COLLECTIVE_ROUNDS: u32 = 16;
/// Steps of a small reduction over flag words: the fold of a rank beyond
/// the largest power of two, [`COLLECTIVE_ROUNDS`] recursive-doubling
/// rounds, and the result sent back to the folded rank.
pub const COLLECTIVE_STEPS: u32 = COLLECTIVE_ROUNDS + 2;
/// Bytes of each small-reduction data area (one step, one parity): the
/// largest reduction the flag words carry. Fits one inline write.
pub const COLLECTIVE_DATA_BYTES: u64 = 256;
/// Bytes of each context's collective area.
pub const COLLECTIVE_BYTES: u64 =
    COLLECTIVE_WORDS * 8 + COLLECTIVE_STEPS as u64 * 2 * COLLECTIVE_DATA_BYTES;
/// First flag word of the tree barrier: the arrival words of the two
/// children, then the release word the parent writes.
const TREE_ARRIVE_WORD: u64 = COLLECTIVE_ROUNDS as u64;
const TREE_RELEASE_WORD: u64 = TREE_ARRIVE_WORD + 2;
/// First flag word of the small-reduction steps' epochs.
const STEP_EPOCH_WORD: u64 = TREE_RELEASE_WORD + 1;
/// Bits of a step epoch word that carry the data's length (the epoch is
/// above them).
pub const STEP_LEN_BITS: u32 = 12;
// A step's data goes in one inline write, and its length fits its word.
const _: () = assert!(
    COLLECTIVE_DATA_BYTES <= pindown_uapi::queue::MAX_INLINE as u64
        && COLLECTIVE_DATA_BYTES < 1 << STEP_LEN_BITS
);

/// The done word reporting `len` bytes for the receive of generation
/// `generation`; `offer`: the bytes wait in the sender's memory.
pub fn done_word(generation: u64, len: u64, offer: bool) -> u64 {
    let flag = if offer { OFFER_FLAG } else { 0 };
    (generation & 0xff_ffff) << DONE_LEN_BITS | (len & MAX_MESSAGE) | flag
}

/// Whether `word` completes the receive of generation `generation`: the
/// message length it reports, and whether it is an offer.
pub fn done_len(word: u64, generation: u64) -> Option<(u64, bool)> {
    (word >> DONE_LEN_BITS == generation & 0xff_ffff)
        .then_some((word & MAX_MESSAGE, word & OFFER_FLAG != 0))
}

/// The control area's shape, the same on every rank of a job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Ranks in the world.
    pub ranks: u32,
    /// Communicator contexts (each communicator takes two: point-to-point
    /// and collective).
    pub contexts: u32,
    /// Matching slots per (context, peer).
    pub slots: u32,
}

impl Layout {
    /// Number of (context, peer, index) slots.
    pub fn slot_count(&self) -> u64 {
        u64::from(self.contexts) * u64::from(self.ranks) * u64::from(self.slots)
    }

    /// Slots of one peer (every context).
    fn peer_slots(&self) -> u64 {
        u64::from(self.contexts) * u64::from(self.slots)
    }

    /// The slot number of (`context`, `peer`, `index`).
    pub fn slot(&self, context: u32, peer: u32, index: u32) -> u64 {
        (u64::from(peer) * u64::from(self.contexts) + u64::from(context)) * u64::from(self.slots)
            + u64::from(index)
    }

    /// The (context, peer, index) of slot number `slot`.
    pub fn slot_parts(&self, slot: u64) -> (u32, u32, u32) {
        let index = slot % u64::from(self.slots);
        let context = (slot / u64::from(self.slots)) % u64::from(self.contexts);
        let peer = slot / self.peer_slots();
        (context as u32, peer as u32, index as u32)
    }

    /// Bytes of the match records and done words in a peer's block.
    fn slot_bytes(&self) -> u64 {
        self.peer_slots() * (MATCH_RECORD_BYTES + DONE_WORD_BYTES)
    }

    /// Bytes of one peer's block, a multiple of 64.
    pub fn block_bytes(&self) -> u64 {
        let any = u64::from(self.contexts) * (ANY_ENTRIES * ANY_ENTRY_BYTES + 8);
        (self.slot_bytes() + any).next_multiple_of(64)
    }

    /// Where peer `peer`'s block starts.
    pub fn block_start(&self, peer: u32) -> u64 {
        u64::from(peer) * self.block_bytes()
    }

    /// Offset of the match record of slot `slot`.
    pub fn match_record(&self, slot: u64) -> u64 {
        let (_, peer, _) = self.slot_parts(slot);
        self.block_start(peer) + slot % self.peer_slots() * MATCH_RECORD_BYTES
    }

    /// Offset of the done word of slot `slot`.
    pub fn done_word(&self, slot: u64) -> u64 {
        let (_, peer, _) = self.slot_parts(slot);
        self.block_start(peer)
            + self.peer_slots() * MATCH_RECORD_BYTES
            + slot % self.peer_slots() * DONE_WORD_BYTES
    }

    /// Offset of entry `entry` of the any-source ring peer `peer` fills in
    /// context `context`.
    pub fn any_entry(&self, context: u32, peer: u32, entry: u64) -> u64 {
        self.block_start(peer)
            + self.slot_bytes()
            + (u64::from(context) * ANY_ENTRIES + entry % ANY_ENTRIES) * ANY_ENTRY_BYTES
    }

    /// Offset of the credit word peer `peer` writes in context `context`:
    /// how many entries of this rank's ring at the peer the peer has
    /// drained, and how many of this rank's rendezvous messages it has
    /// read ([`any_credit_word`]).
    pub fn any_credit(&self, context: u32, peer: u32) -> u64 {
        self.block_start(peer)
            + self.slot_bytes()
            + u64::from(self.contexts) * ANY_ENTRIES * ANY_ENTRY_BYTES
            + u64::from(context) * 8
    }

    /// Offset of the scratch memory.
    pub fn scratch(&self) -> u64 {
        self.collective_start() + u64::from(self.contexts) * COLLECTIVE_BYTES
    }

    /// Bytes of the whole control area.
    pub fn bytes(&self) -> u64 {
        self.scratch() + SCRATCH_BYTES
    }
}

/// The collective area (after the peers' blocks, before scratch).
impl Layout {
    fn collective_start(&self) -> u64 {
        u64::from(self.ranks) * self.block_bytes()
    }

    /// The range of every context's collective area together, the one
    /// window open to every rank: offset and bytes.
    pub fn collectives(&self) -> (u64, u64) {
        (
            self.collective_start(),
            u64::from(self.contexts) * COLLECTIVE_BYTES,
        )
    }

    fn collective_word(&self, context: u32, word: u64) -> u64 {
        debug_assert!(word < COLLECTIVE_WORDS);
        self.collective_start() + u64::from(context) * COLLECTIVE_BYTES + word * 8
    }

    /// Offset of the flag word that round `round` of a dissemination
    /// barrier in `context` sets (to the barrier's epoch).
    pub fn barrier_round(&self, context: u32, round: u32) -> u64 {
        assert!(
            round < COLLECTIVE_ROUNDS,
            "barrier round {round} out of range"
        );
        self.collective_word(context, u64::from(round))
    }

    /// Offset of the flag word child `child` (0 or 1) of a tree barrier
    /// sets on arrival.
    pub fn tree_arrive(&self, context: u32, child: u32) -> u64 {
        assert!(child < 2, "a binary tree node has two children");
        self.collective_word(context, TREE_ARRIVE_WORD + u64::from(child))
    }

    /// Offset of the flag word the parent in a tree barrier sets to
    /// release this rank.
    pub fn tree_release(&self, context: u32) -> u64 {
        self.collective_word(context, TREE_RELEASE_WORD)
    }

    /// Offset of the epoch word of small-reduction step `step`: the
    /// reduction's epoch above [`STEP_LEN_BITS`], its data length below,
    /// written after the data.
    pub fn step_epoch(&self, context: u32, step: u32) -> u64 {
        assert!(
            step < COLLECTIVE_STEPS,
            "reduction step {step} out of range"
        );
        self.collective_word(context, STEP_EPOCH_WORD + u64::from(step))
    }

    /// Offset of the data area of small-reduction step `step` for the
    /// reductions of parity `parity` (epoch modulo 2).
    pub fn step_data(&self, context: u32, step: u32, parity: u64) -> u64 {
        assert!(
            step < COLLECTIVE_STEPS,
            "reduction step {step} out of range"
        );
        self.collective_start()
            + u64::from(context) * COLLECTIVE_BYTES
            + COLLECTIVE_WORDS * 8
            + (u64::from(step) * 2 + parity % 2) * COLLECTIVE_DATA_BYTES
    }

    /// The range of `context`'s collective area: offset and bytes.
    pub fn collective_area(&self, context: u32) -> (u64, u64) {
        (
            self.collective_start() + u64::from(context) * COLLECTIVE_BYTES,
            COLLECTIVE_BYTES,
        )
    }
}

/// The word encoding a small-reduction step's `epoch` and data length.
pub fn step_word(epoch: u64, len: u64) -> u64 {
    debug_assert!(len < 1 << STEP_LEN_BITS);
    epoch << STEP_LEN_BITS | len
}

/// The epoch and data length a step's epoch word reports.
pub fn step_epoch_len(word: u64) -> (u64, u64) {
    (word >> STEP_LEN_BITS, word & ((1 << STEP_LEN_BITS) - 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_peer_block_holds_exactly_that_peers_words() {
        let layout = Layout {
            ranks: 5,
            contexts: 3,
            slots: 7,
        };
        let last = layout.slot(2, 4, 6);
        assert_eq!(last + 1, layout.slot_count());
        let mut ranges: Vec<(u64, u64, u32)> = Vec::new();
        for peer in 0..5 {
            for context in 0..3 {
                for index in 0..7 {
                    let slot = layout.slot(context, peer, index);
                    assert_eq!(layout.slot_parts(slot), (context, peer, index));
                    ranges.push((layout.match_record(slot), MATCH_RECORD_BYTES, peer));
                    ranges.push((layout.done_word(slot), DONE_WORD_BYTES, peer));
                }
                for entry in 0..ANY_ENTRIES {
                    ranges.push((
                        layout.any_entry(context, peer, entry),
                        ANY_ENTRY_BYTES,
                        peer,
                    ));
                }
                ranges.push((layout.any_credit(context, peer), 8, peer));
            }
        }
        for &(at, bytes, peer) in &ranges {
            assert_eq!(at % 8, 0);
            let start = layout.block_start(peer);
            assert!(at >= start && at + bytes <= start + layout.block_bytes());
        }
        ranges.sort_unstable();
        for pair in ranges.windows(2) {
            assert!(pair[0].0 + pair[0].1 <= pair[1].0, "{pair:?} overlap");
        }
        assert_eq!(layout.block_bytes() % 64, 0);
        let (collectives, bytes) = layout.collectives();
        assert_eq!(collectives, layout.block_start(5));
        assert_eq!(collectives + bytes, layout.scratch());
        assert_eq!(layout.scratch() + SCRATCH_BYTES, layout.bytes());
    }

    #[test]
    fn collective_areas_are_disjoint_aligned_and_between_any_source_and_scratch() {
        let layout = Layout {
            ranks: 5,
            contexts: 3,
            slots: 7,
        };
        let any_end = layout.block_start(5);
        let mut ranges: Vec<(u64, u64)> = Vec::new();
        for context in 0..3 {
            let (start, bytes) = layout.collective_area(context);
            let mut words: Vec<u64> = (0..COLLECTIVE_ROUNDS)
                .map(|r| layout.barrier_round(context, r))
                .collect();
            words.extend([
                layout.tree_arrive(context, 0),
                layout.tree_arrive(context, 1),
                layout.tree_release(context),
            ]);
            words.extend((0..COLLECTIVE_STEPS).map(|s| layout.step_epoch(context, s)));
            for &word in &words {
                assert_eq!(word % 8, 0);
                assert!(word >= start && word + 8 <= start + COLLECTIVE_WORDS * 8);
                ranges.push((word, 8));
            }
            for step in 0..COLLECTIVE_STEPS {
                for parity in 0..2 {
                    let at = layout.step_data(context, step, parity);
                    assert_eq!(at % 8, 0);
                    assert!(at >= start + COLLECTIVE_WORDS * 8);
                    assert!(at + COLLECTIVE_DATA_BYTES <= start + bytes);
                    ranges.push((at, COLLECTIVE_DATA_BYTES));
                }
            }
            assert!(start >= any_end);
            assert!(start + bytes <= layout.scratch());
        }
        ranges.sort_unstable();
        for pair in ranges.windows(2) {
            assert!(pair[0].0 + pair[0].1 <= pair[1].0, "{pair:?} overlap");
        }
        for (epoch, len) in [(1, 0), (7, 256), (1 << 40, 8)] {
            assert_eq!(step_epoch_len(step_word(epoch, len)), (epoch, len));
        }
    }

    #[test]
    fn done_words_carry_generation_and_length() {
        for (generation, len) in [(1, 0), (2, 8), (0x100_0001, MAX_MESSAGE), (77, 1 << 30)] {
            for offer in [false, true] {
                let word = done_word(generation, len, offer);
                assert_eq!(done_len(word, generation), Some((len, offer)));
                assert_eq!(done_len(word, generation + 1), None);
            }
        }
        assert_eq!(done_len(0, 1), None, "a fresh word completes nothing");
    }

    #[test]
    fn any_message_words_carry_tag_and_kind() {
        for tag in [0, 7, u32::MAX] {
            for len in [0, 1, ANY_EAGER_BYTES] {
                assert_eq!(
                    any_message(any_message_word(tag, Some(len))),
                    (tag, Some(len))
                );
            }
            assert_eq!(any_message(any_message_word(tag, None)), (tag, None));
        }
    }

    #[test]
    fn credit_words_carry_both_counts_modulo_2_32() {
        for (drained, reads) in [(0, 0), (17, 3), (u64::from(u32::MAX) + 5, 1 << 33)] {
            let (d, r) = any_credit_counts(any_credit_word(drained, reads));
            assert_eq!(
                (u64::from(d), u64::from(r)),
                (drained % (1 << 32), reads % (1 << 32))
            );
        }
    }
}
