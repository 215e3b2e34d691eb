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
//!   its offset in that window, its capacity (with, above it, the tag of
//!   the collective call the receive belongs to, if any), and last a stamp
//!   (the receive's generation on the slot), written after the rest by a
//!   fenced write. This rank's send on the slot reads it: sender-side
//!   matching.
//! * a **done word** (8 bytes) that peer `p` writes when it completes a
//!   send to this rank on slot `i`: the generation of the receive it
//!   completes (top 24 bits) and the message's length (low 40 bits). It
//!   is written after the body, by a fenced write, as one aligned 8-byte
//!   store.
//!
//! then, for each context, the any-source ring of [`ANY_ENTRIES`] entries
//! of [`ANY_ENTRY_BYTES`] that the peer fills and this rank drains, the
//! credit words the peer's receiver side writes back, one per context,
//! and then each context's **collective section** of
//! [`COLLECTIVE_SECTION_BYTES`]: the flag words the peer sets in this
//! rank's collectives (its dissemination-barrier round, its arrival as a
//! tree child, its release as the tree parent, its step of a small
//! reduction) and that step's data areas (two parities of
//! [`COLLECTIVE_DATA_BYTES`]). In any one call a peer plays at most one
//! part of each kind towards this rank (the peers of the barrier rounds,
//! of a tree node and of the reduction steps are all distinct), so a
//! section per peer holds every word it writes, and no rank can set a
//! word another rank should: not another member's, and not as a rank
//! outside the communicator. The section also holds the one part of a
//! block that this rank writes and the peer reads: this rank's **call
//! records** ([`CALL_RECORDS_BYTES`]: two parities and a kept one, the
//! call it gave up or the first of its latest run of refused calls),
//! what its latest collective calls on the
//! context were, which a member that waits on this rank reads to tell a
//! call that disagrees with its own or one this rank will not finish.
//!
//! Last in each block lie [`LANDINGS`] **landing buffers** of
//! [`LANDING_BYTES`]: a receive of at most that many bytes from the peer
//! names one of them in its match record instead of a window over its own
//! buffer, the peer's send writes the body there, and the receive copies
//! it out once the done word has come (no window bound or revoked per
//! small receive, and the receive buffer is never exposed to the peer).
//!
//! After the blocks comes scratch memory no window exposes (inline
//! payloads are staged there before posting).

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
/// Where a match record's capacity carries the collective call a receive
/// belongs to ([`call_tag`]; 0 outside collectives), above any length a
/// receive can have.
const CALL_TAG_SHIFT: u32 = 40;
const CALL_TAG_MASK: u64 = 0xffff << CALL_TAG_SHIFT;
const _: () = assert!(MAX_MESSAGE < 1 << CALL_TAG_SHIFT);

/// The tag of collective call `call` in match records and sends: never 0
/// (0 marks a receive or send outside any collective call).
pub fn call_tag(call: u64) -> u64 {
    call % 0xffff + 1
}

/// A match record's capacity word carrying `tag` ([`call_tag`], or 0).
pub fn tagged_capacity(capacity: u64, tag: u64) -> u64 {
    capacity | (tag << CALL_TAG_SHIFT & CALL_TAG_MASK)
}

/// A match record's capacity word split into the capacity (with
/// [`TYPED_RECEIVE`]) and the call tag.
pub fn capacity_and_tag(word: u64) -> (u64, u64) {
    (
        word & !CALL_TAG_MASK,
        (word & CALL_TAG_MASK) >> CALL_TAG_SHIFT,
    )
}
/// Landing buffers in each peer's block: small receives from that peer
/// outstanding at once without a window of their own.
pub const LANDINGS: u64 = 8;
/// Bytes of a landing buffer: the longest receive that lands in one (a
/// send this short goes inline in the sender's send queue).
pub const LANDING_BYTES: u64 = 512;
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
/// Flag words of each context's collective section.
pub const COLLECTIVE_WORDS: u64 = 4;
/// Bytes of each small-reduction data area (one parity): the largest
/// reduction the flag words carry. Fits one inline write.
pub const COLLECTIVE_DATA_BYTES: u64 = 256;
/// Bytes of a call record ([`call_record_words`]).
pub const CALL_RECORD_BYTES: u64 = 24;
/// Call records a rank keeps for each peer in each context: one per
/// parity of the call number, then a kept one, the call it gave up or
/// the first of its latest run of refused calls, which calls between
/// leave alone.
pub const CALL_RECORD_SLOTS: u64 = 3;
/// The kept record's slot ([`CALL_RECORD_SLOTS`]).
pub const KEPT_CALL_RECORD: u64 = 2;
/// Bytes of a rank's call records for one peer in one context.
pub const CALL_RECORDS_BYTES: u64 = CALL_RECORD_SLOTS * CALL_RECORD_BYTES;
/// Bytes of each context's collective section in a peer's block: the
/// flag words, the call records, then the data areas of the two
/// parities.
pub const COLLECTIVE_SECTION_BYTES: u64 =
    COLLECTIVE_WORDS * 8 + CALL_RECORDS_BYTES + 2 * COLLECTIVE_DATA_BYTES;
/// The flag words of a collective section, in order.
const BARRIER_WORD: u64 = 0;
const TREE_ARRIVE_WORD: u64 = 1;
const TREE_RELEASE_WORD: u64 = 2;
const STEP_EPOCH_WORD: u64 = 3;
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
        (self.landings_at() + LANDINGS * LANDING_BYTES).next_multiple_of(64)
    }

    /// Where the landing buffers start in a block (after the collective
    /// sections), a multiple of 8.
    fn landings_at(&self) -> u64 {
        let per_context = ANY_ENTRIES * ANY_ENTRY_BYTES + 8 + COLLECTIVE_SECTION_BYTES;
        self.slot_bytes() + u64::from(self.contexts) * per_context
    }

    /// Offset of landing buffer `landing` (below [`LANDINGS`]) in peer
    /// `peer`'s block.
    pub fn landing(&self, peer: u32, landing: u64) -> u64 {
        debug_assert!(landing < LANDINGS);
        self.block_start(peer) + self.landings_at() + landing * LANDING_BYTES
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
        self.block_start(self.ranks)
    }

    /// Bytes of the whole control area.
    pub fn bytes(&self) -> u64 {
        self.scratch() + SCRATCH_BYTES
    }
}

/// The collective sections, before the landing buffers at the end of each
/// peer's block.
impl Layout {
    /// The range of the section world rank `writer` writes in `context`'s
    /// collectives: offset and bytes.
    pub fn collective_section(&self, context: u32, writer: u32) -> (u64, u64) {
        assert!(context < self.contexts, "context {context} out of range");
        let sections = self.block_start(writer)
            + self.slot_bytes()
            + u64::from(self.contexts) * (ANY_ENTRIES * ANY_ENTRY_BYTES + 8);
        (
            sections + u64::from(context) * COLLECTIVE_SECTION_BYTES,
            COLLECTIVE_SECTION_BYTES,
        )
    }

    fn collective_word(&self, context: u32, writer: u32, word: u64) -> u64 {
        debug_assert!(word < COLLECTIVE_WORDS);
        self.collective_section(context, writer).0 + word * 8
    }

    /// Offset of the flag word `writer` sets (to the barrier's epoch) in
    /// its round of a dissemination barrier in `context`.
    pub fn barrier_word(&self, context: u32, writer: u32) -> u64 {
        self.collective_word(context, writer, BARRIER_WORD)
    }

    /// Offset of the flag word `writer`, a child in a tree barrier, sets
    /// on arrival.
    pub fn tree_arrive(&self, context: u32, writer: u32) -> u64 {
        self.collective_word(context, writer, TREE_ARRIVE_WORD)
    }

    /// Offset of the flag word `writer`, the parent in a tree barrier,
    /// sets to release this rank.
    pub fn tree_release(&self, context: u32, writer: u32) -> u64 {
        self.collective_word(context, writer, TREE_RELEASE_WORD)
    }

    /// Offset of the epoch word of `writer`'s step of a small reduction:
    /// the reduction's epoch above [`STEP_LEN_BITS`], its data length
    /// below, written after the data.
    pub fn step_epoch(&self, context: u32, writer: u32) -> u64 {
        self.collective_word(context, writer, STEP_EPOCH_WORD)
    }

    /// Offsets of every flag word `writer` sets in `context`'s
    /// collectives: its barrier round, tree arrival, tree release and
    /// reduction step.
    pub fn collective_flag_words(&self, context: u32, writer: u32) -> [u64; 4] {
        [
            self.barrier_word(context, writer),
            self.tree_arrive(context, writer),
            self.tree_release(context, writer),
            self.step_epoch(context, writer),
        ]
    }

    /// Offset of the call records (the even parity, the odd one, the
    /// kept one; [`CALL_RECORD_SLOTS`]) that this rank keeps in
    /// `reader`'s section of `context`: the only words of a block its
    /// owner writes, for that peer to read.
    pub fn call_records(&self, context: u32, reader: u32) -> u64 {
        self.collective_section(context, reader).0 + COLLECTIVE_WORDS * 8
    }

    /// Offset of the data area of `writer`'s step of a small reduction,
    /// for the reductions of parity `parity` (epoch modulo 2).
    pub fn step_data(&self, context: u32, writer: u32, parity: u64) -> u64 {
        self.call_records(context, writer) + CALL_RECORDS_BYTES + parity % 2 * COLLECTIVE_DATA_BYTES
    }
}

/// One collective call of a rank as its call record tells it: the call's
/// number on its communicator (1 first) and what every member must agree
/// on. The codes are [`crate::collective`]'s.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallRecord {
    /// The call's number among the rank's collective calls on the
    /// communicator (1 first; below 2^40).
    pub call: u64,
    /// The rank gave the call up (it failed there, once begun): its
    /// collectives on the communicator stopped.
    pub failed: bool,
    /// The rank refused the call's arguments before it began (its
    /// collectives go on).
    pub refused: bool,
    /// Which collective.
    pub kind: u8,
    /// The algorithm it runs.
    pub algorithm: u8,
    /// The element type of a reduction (0 for bytes).
    pub element: u8,
    /// The operation of a reduction (0 where there is none).
    pub op: u8,
    /// Its root (0 where it has none).
    pub root: u32,
    /// The bytes it moves per member (below 2^48).
    pub bytes: u64,
}

/// Bits of a call number that each of a call record's three words
/// carries, so that a record read while its owner rewrote it (for a call
/// two later) shows as torn.
const CALL_TAG_BITS: u32 = 16;
/// Bits of the call number in a record's first word.
const CALL_BITS: u32 = 40;

/// The three words of a call record: the call number, element type,
/// algorithm, kind and the refused and failed flags; the bytes; the
/// root and the operation. The second and third carry the call number's
/// low bits too.
pub fn call_record_words(record: &CallRecord) -> [u64; 3] {
    let call = record.call & ((1 << CALL_BITS) - 1);
    let tag = (call & ((1 << CALL_TAG_BITS) - 1)) << 48;
    [
        call << 24
            | u64::from(record.element) << 16
            | u64::from(record.algorithm) << 8
            | u64::from(record.kind & 0x3f) << 2
            | u64::from(record.refused) << 1
            | u64::from(record.failed),
        tag | (record.bytes & ((1 << 48) - 1)),
        tag | u64::from(record.op) << 32 | u64::from(record.root),
    ]
}

/// The call record of three words, or `None` for words that do not make
/// one: never written (call 0), or torn (the words' call numbers differ).
pub fn call_record_of(words: [u64; 3]) -> Option<CallRecord> {
    let call = words[0] >> 24;
    let tag = call & ((1 << CALL_TAG_BITS) - 1);
    if call == 0 || words[1] >> 48 != tag || words[2] >> 48 != tag || words[2] >> 40 & 0xff != 0 {
        return None;
    }
    Some(CallRecord {
        call,
        failed: words[0] & 1 != 0,
        refused: words[0] & 2 != 0,
        kind: (words[0] >> 2 & 0x3f) as u8,
        algorithm: (words[0] >> 8) as u8,
        element: (words[0] >> 16) as u8,
        root: words[2] as u32,
        op: (words[2] >> 32) as u8,
        bytes: words[1] & ((1 << 48) - 1),
    })
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
                let (section, section_bytes) = layout.collective_section(context, peer);
                for word in layout.collective_flag_words(context, peer) {
                    assert!(word >= section && word + 8 <= section + COLLECTIVE_WORDS * 8);
                    ranges.push((word, 8, peer));
                }
                let records = layout.call_records(context, peer);
                assert!(records >= section + COLLECTIVE_WORDS * 8);
                ranges.push((records, CALL_RECORDS_BYTES, peer));
                for parity in 0..2 {
                    let at = layout.step_data(context, peer, parity);
                    assert!(at + COLLECTIVE_DATA_BYTES <= section + section_bytes);
                    ranges.push((at, COLLECTIVE_DATA_BYTES, peer));
                }
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
        assert_eq!(layout.scratch(), layout.block_start(5));
        assert_eq!(layout.scratch() + SCRATCH_BYTES, layout.bytes());
    }

    #[test]
    fn call_records_carry_every_field_and_show_torn_reads() {
        let record = CallRecord {
            call: (1 << 40) - 1,
            failed: true,
            refused: true,
            kind: 0x3f,
            algorithm: 0xff,
            element: 0xff,
            op: 0xff,
            root: u32::MAX,
            bytes: (1 << 48) - 1,
        };
        assert_eq!(call_record_of(call_record_words(&record)), Some(record));
        let small = CallRecord {
            call: 1,
            failed: false,
            refused: false,
            kind: 3,
            algorithm: 2,
            element: 1,
            op: 1,
            root: 0,
            bytes: 264,
        };
        let words = call_record_words(&small);
        assert_eq!(call_record_of(words), Some(small));
        assert_eq!(call_record_of([0; 3]), None, "never written");
        // The first word of call 3 over the rest of call 1 (same parity).
        let later = call_record_words(&CallRecord { call: 3, ..small });
        assert_eq!(call_record_of([later[0], words[1], words[2]]), None);
        assert_eq!(call_record_of([words[0], words[1], later[2]]), None);
    }

    #[test]
    fn capacities_carry_call_tags_beside_every_length() {
        for capacity in [0, 1, MAX_MESSAGE, MAX_MESSAGE | TYPED_RECEIVE] {
            for call in [1, 2, 0xfffe, 0xffff, 1 << 39] {
                let tag = call_tag(call);
                assert_ne!(tag, 0);
                assert_eq!(
                    capacity_and_tag(tagged_capacity(capacity, tag)),
                    (capacity, tag)
                );
            }
            assert_eq!(
                capacity_and_tag(tagged_capacity(capacity, 0)),
                (capacity, 0)
            );
        }
        assert_ne!(call_tag(1), call_tag(2));
    }

    #[test]
    fn step_words_carry_epoch_and_length() {
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
