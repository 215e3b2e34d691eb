//! The key table: each rank's registrations, by entry, and the copy of
//! it that peers read (32 bytes an entry, in memory they may only read)
//! to turn another rank's global address into a window key.

use std::collections::BTreeMap;

/// Bytes of one entry as peers read it: window key, length, base
/// address, state.
pub(crate) const ENTRY_BYTES: u64 = 32;
/// Entry 0 is never used: global address 0 names nothing.
pub(crate) const NULL_ENTRY: u32 = 0;
/// Every rank's starter memory.
pub(crate) const STARTER_ENTRY: u32 = 1;
/// The first entry registrations get.
pub(crate) const FIRST_USER_ENTRY: u32 = 2;

/// What a peer reads of an entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PublishedEntry {
    /// The window's key (0 when not valid).
    pub(crate) key: u64,
    /// Bytes registered.
    pub(crate) len: u64,
    /// The owner's address of the first byte.
    pub(crate) base: u64,
    /// Color.
    pub(crate) color: u32,
    /// The index's generation (see [`AddressFields::entry`](super::AddressFields)).
    pub(crate) generation: u32,
    /// The index the entry is at (so that a read that lands late, in a
    /// staging area reused by a later lookup, is not taken for another
    /// index's entry).
    pub(crate) index: u32,
    /// Whether the entry names live memory.
    pub(crate) valid: bool,
}

const VALID: u64 = 1;
const COLOR_SHIFT: u32 = 1;
const GENERATION_SHIFT: u32 = 8;
const INDEX_SHIFT: u32 = 40;
/// Key-table indexes the state word holds.
pub(crate) const MAX_ENTRIES: u32 = 1 << (64 - INDEX_SHIFT);

impl PublishedEntry {
    /// An entry naming no memory.
    pub(crate) const GONE: PublishedEntry = PublishedEntry {
        key: 0,
        len: 0,
        base: 0,
        color: 0,
        generation: 0,
        index: 0,
        valid: false,
    };

    /// A live registration's entry.
    pub(crate) fn live<W>(index: u32, registered: &Registered<W>, key: u64) -> PublishedEntry {
        PublishedEntry {
            key,
            len: registered.len,
            base: registered.base,
            color: registered.color,
            generation: registered.generation,
            index,
            valid: true,
        }
    }

    /// The entry's 32 bytes.
    pub(crate) fn encode(&self) -> [u64; 4] {
        let state = if self.valid {
            VALID
                | u64::from(self.color) << COLOR_SHIFT
                | u64::from(self.generation) << GENERATION_SHIFT
                | u64::from(self.index) << INDEX_SHIFT
        } else {
            0
        };
        [self.key, self.len, self.base, state]
    }

    /// Reads 32 bytes a peer published.
    pub(crate) fn decode(bytes: &[u8; ENTRY_BYTES as usize]) -> PublishedEntry {
        let word = |i: usize| u64::from_le_bytes(bytes[i * 8..i * 8 + 8].try_into().unwrap());
        let state = word(3);
        PublishedEntry {
            key: word(0),
            len: word(1),
            base: word(2),
            color: (state >> COLOR_SHIFT & 3) as u32,
            generation: (state >> GENERATION_SHIFT) as u32,
            index: (state >> INDEX_SHIFT) as u32,
            valid: state & VALID != 0,
        }
    }
}

/// A rank's own registrations: entry numbers, reference counts, and the
/// index from base address that merging searches.
pub(crate) struct Registrations<W> {
    /// By entry; `None` when free.
    entries: Vec<Option<Registered<W>>>,
    /// Free entries, reused oldest first (so that a stale global address
    /// finds its entry free as long as possible).
    free: std::collections::VecDeque<u32>,
    /// (color, base) to entry, of user registrations (not the starter).
    by_base: BTreeMap<(u32, u64), u32>,
    /// The generation each entry had last (bumped when it is taken).
    generations: Vec<u32>,
}

/// One registration.
pub(crate) struct Registered<W> {
    /// First byte.
    pub(crate) base: u64,
    /// Bytes.
    pub(crate) len: u64,
    /// Color.
    pub(crate) color: u32,
    /// Registrations merged into it, each needing its own deregistration.
    pub(crate) count: u32,
    /// Its entry's generation.
    pub(crate) generation: u32,
    /// The windows peers reach it through, the current one last: a
    /// registration that grew keeps the windows of its earlier extents,
    /// so that peers holding their keys, and requests in flight, still
    /// reach it.
    pub(crate) windows: Vec<W>,
}

impl<W> Registered<W> {
    /// The window over the whole registration.
    pub(crate) fn window(&self) -> &W {
        self.windows.last().expect("a registration has a window")
    }
}

/// Where a new registration goes.
pub(crate) enum Placement {
    /// Inside registration `entry` already: count it.
    Inside(u32),
    /// Starts inside or right at the end of registration `entry`: extend
    /// it to `[base, base + len)`.
    Extend {
        /// The entry.
        entry: u32,
        /// Its first byte (unchanged).
        base: u64,
        /// Its new length.
        len: u64,
    },
    /// A new entry.
    New,
}

impl<W> Registrations<W> {
    /// A table of `entries` entries (the null entry and the starter's
    /// included).
    pub(crate) fn new(entries: u32) -> Self {
        let mut table = Vec::new();
        table.resize_with(entries as usize, || None);
        Registrations {
            entries: table,
            free: (FIRST_USER_ENTRY..entries).collect(),
            by_base: BTreeMap::new(),
            generations: vec![0; entries as usize],
        }
    }

    /// Entries the table holds.
    pub(crate) fn capacity(&self) -> u32 {
        self.entries.len() as u32
    }

    /// Entries in use.
    pub(crate) fn live(&self) -> u32 {
        self.entries.iter().filter(|e| e.is_some()).count() as u32
    }

    /// The registration at `entry`.
    pub(crate) fn get(&self, entry: u32) -> Option<&Registered<W>> {
        self.entries.get(entry as usize).and_then(Option::as_ref)
    }

    /// The registration at `entry`, to change.
    pub(crate) fn get_mut(&mut self, entry: u32) -> Option<&mut Registered<W>> {
        self.entries
            .get_mut(entry as usize)
            .and_then(Option::as_mut)
    }

    /// Where `[base, base + len)` of `color` goes: merged into the user
    /// registration with the highest base at or below `base`, if it
    /// contains the range or the range starts inside or right after it.
    pub(crate) fn place(&self, color: u32, base: u64, len: u64) -> Placement {
        let Some((&(_, below), &entry)) =
            self.by_base.range((color, 0)..=(color, base)).next_back()
        else {
            return Placement::New;
        };
        let existing = self.get(entry).expect("indexed entries are live");
        let end = base.saturating_add(len);
        let existing_end = below.saturating_add(existing.len);
        if end <= existing_end {
            Placement::Inside(entry)
        } else if base <= existing_end {
            Placement::Extend {
                entry,
                base: below,
                len: end - below,
            }
        } else {
            Placement::New
        }
    }

    /// Takes a free entry for `registered`, in the entry's next
    /// generation; `None` when the table is full.
    pub(crate) fn insert(&mut self, mut registered: Registered<W>) -> Option<u32> {
        let entry = self.free.pop_front()?;
        let generation = &mut self.generations[entry as usize];
        *generation = generation.wrapping_add(1);
        registered.generation = *generation;
        self.by_base
            .insert((registered.color, registered.base), entry);
        self.entries[entry as usize] = Some(registered);
        Some(entry)
    }

    /// Puts the starter memory at its entry.
    pub(crate) fn insert_starter(&mut self, registered: Registered<W>) {
        self.entries[STARTER_ENTRY as usize] = Some(registered);
    }

    /// Frees `entry`, giving back what it held.
    pub(crate) fn remove(&mut self, entry: u32) -> Option<Registered<W>> {
        let registered = self.entries.get_mut(entry as usize)?.take()?;
        if entry >= FIRST_USER_ENTRY {
            self.by_base.remove(&(registered.color, registered.base));
            self.free.push_back(entry);
        }
        Some(registered)
    }

    /// Every live entry, in entry order.
    pub(crate) fn drain(&mut self) -> Vec<Registered<W>> {
        self.by_base.clear();
        self.entries.iter_mut().filter_map(Option::take).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn registered(base: u64, len: u64) -> Registered<()> {
        Registered {
            base,
            len,
            color: 0,
            count: 1,
            generation: 0,
            windows: vec![()],
        }
    }

    #[test]
    fn ranges_merge_inside_and_at_the_end_but_not_before() {
        let mut table = Registrations::new(8);
        let entry = table.insert(registered(4096, 4096)).unwrap();
        assert_eq!(entry, FIRST_USER_ENTRY);
        assert!(matches!(table.place(0, 4096, 4096), Placement::Inside(e) if e == entry));
        assert!(matches!(table.place(0, 5000, 10), Placement::Inside(e) if e == entry));
        assert!(matches!(
            table.place(0, 8192, 4096),
            Placement::Extend { entry: e, base: 4096, len: 8192 } if e == entry
        ));
        assert!(matches!(
            table.place(0, 6000, 4096),
            Placement::Extend { entry: e, base: 4096, len } if e == entry && len == 6000 + 4096 - 4096
        ));
        assert!(matches!(table.place(0, 0, 4096), Placement::New));
        assert!(matches!(table.place(0, 8193, 1), Placement::New));
        assert!(matches!(table.place(1, 4096, 1), Placement::New));
    }

    #[test]
    fn freed_entries_are_reused_last_and_a_full_table_says_so() {
        let mut table = Registrations::new(5);
        let a = table.insert(registered(0, 1)).unwrap();
        let b = table.insert(registered(10, 1)).unwrap();
        let c = table.insert(registered(20, 1)).unwrap();
        assert!(table.insert(registered(30, 1)).is_none());
        assert_eq!(table.live(), 3);
        assert_eq!(table.remove(a).unwrap().base, 0);
        assert!(table.get(a).is_none());
        assert!(matches!(table.place(0, 0, 1), Placement::New));
        let first = table.get(b).unwrap().generation;
        assert_eq!(table.insert(registered(40, 1)), Some(a));
        assert_eq!(table.get(a).unwrap().generation, 2, "a's second use");
        assert_eq!(table.get(b).unwrap().generation, first);
        assert_ne!(b, c);
    }

    #[test]
    fn published_entries_round_trip() {
        let entry = PublishedEntry {
            key: 0x1234_5678_9abc_def0,
            len: 1 << 33,
            base: 0x7f00_0000_1000,
            color: 0,
            generation: 0x00ab_cdef,
            index: 0x12_3456,
            valid: true,
        };
        let words = entry.encode();
        let mut bytes = [0u8; ENTRY_BYTES as usize];
        for (i, word) in words.iter().enumerate() {
            bytes[i * 8..i * 8 + 8].copy_from_slice(&word.to_le_bytes());
        }
        assert_eq!(PublishedEntry::decode(&bytes), entry);
        let gone = PublishedEntry {
            valid: false,
            ..entry
        };
        assert_eq!(gone.encode()[3], 0, "an invalid entry's state word is zero");
        assert!(!PublishedEntry::decode(&[0u8; ENTRY_BYTES as usize]).valid);
    }
}
