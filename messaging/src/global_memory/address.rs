//! Global addresses: 64 bits naming a rank, a color, a registration
//! (key entry) and an offset, with the field widths chosen per run from
//! the rank count (ACP's table 3).

use std::fmt;

/// Bits of the offset field: registrations up to 32 GiB.
pub const OFFSET_BITS: u32 = 35;
/// Bits of the color field (the network interface the memory is reached
/// through; ACP's Tofu layer names the TNI). One color exists here.
pub const COLOR_BITS: u32 = 2;
/// The offset field's bits.
const OFFSET_MASK: u64 = (1 << OFFSET_BITS) - 1;
/// The longest registration: every offset inside it, and one past its
/// end, fit the offset field below its all-ones value.
pub const MAX_REGISTRATION: u64 = OFFSET_MASK - 1;
/// Bits left for rank and key entry together.
const RANK_AND_ENTRY_BITS: u32 = 64 - OFFSET_BITS - COLOR_BITS;
/// The fewest entry bits any run keeps (ACP's table 3: rank 20 bits
/// against entry 7 bits).
pub const MIN_ENTRY_BITS: u32 = 7;
/// The most ranks a run can have.
pub const MAX_RANKS: u64 = 1 << (RANK_AND_ENTRY_BITS - MIN_ENTRY_BITS);

/// A 64-bit global address: where a byte of registered memory lives,
/// on any rank. [`GlobalAddress::NULL`] names nothing (entry 0 is never
/// handed out). Valid only within the run (and the `init`) that made
/// it: the field widths change with the rank count.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GlobalAddress(pub u64);

impl GlobalAddress {
    /// The address that names nothing.
    pub const NULL: GlobalAddress = GlobalAddress(0);

    /// `bytes` further on in the same registration. The offset never
    /// carries into the fields above it: past the offset field's end it
    /// stays at its last value, past every registration's end, so the
    /// address is refused when used.
    pub fn plus(self, bytes: u64) -> GlobalAddress {
        let offset = self.0 & OFFSET_MASK;
        let moved = offset.saturating_add(bytes).min(OFFSET_MASK);
        GlobalAddress(self.0 - offset + moved)
    }
}

impl fmt::Display for GlobalAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#018x}", self.0)
    }
}

/// An address-translation key: what registering memory returns, a
/// global address with offset 0 (rank, color and entry of the
/// registration).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Key(pub u64);

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#018x}", self.0)
    }
}

/// The fields of a global address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AddressFields {
    /// The rank whose memory it is.
    pub rank: u32,
    /// The color it is reached through.
    pub color: u32,
    /// The key-entry field: the registration's index in that rank's key
    /// table, and above it the generation of that index (which changes
    /// each time the index is used again, so that an address of a
    /// registration that went never reaches the next one).
    pub entry: u32,
    /// Bytes from the registration's start.
    pub offset: u64,
}

/// How this run splits a global address (from the top bit down): rank,
/// color, key entry (generation, then index), offset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AddressLayout {
    /// Bits of the rank field.
    pub rank_bits: u32,
    /// Bits of the key-entry field.
    pub entry_bits: u32,
    /// Its low bits: the index in the key table. The rest hold the
    /// index's generation.
    pub index_bits: u32,
}

/// Bits that name `n` distinct values (at least 1).
fn bits_for(n: u64) -> u32 {
    (64 - n.saturating_sub(1).leading_zeros()).max(1)
}

impl AddressLayout {
    /// The layout for a run of `ranks` ranks whose key tables hold
    /// `registrations` entries: as few rank bits as name every rank, the
    /// rest for key entries, of which the index takes as few as name
    /// every entry and the generation the rest. `None` past
    /// [`MAX_RANKS`], or when the index does not fit.
    pub fn for_ranks(ranks: u32, registrations: u32) -> Option<AddressLayout> {
        if ranks == 0 || u64::from(ranks) > MAX_RANKS {
            return None;
        }
        let rank_bits = bits_for(ranks.into());
        let entry_bits = RANK_AND_ENTRY_BITS - rank_bits;
        let index_bits = bits_for(registrations.into());
        (index_bits <= entry_bits).then_some(AddressLayout {
            rank_bits,
            entry_bits,
            index_bits,
        })
    }

    /// Bits of the generation of an index (0: entries reused are not told
    /// apart; 1 Mi ranks leave 7 entry bits).
    pub fn generation_bits(&self) -> u32 {
        self.entry_bits - self.index_bits
    }

    /// The entry field of `index` in its `generation` (taken modulo the
    /// generations the field holds).
    pub fn entry(&self, index: u32, generation: u32) -> u32 {
        let generations = (1u64 << self.generation_bits()) - 1;
        ((u64::from(generation) & generations) << self.index_bits | u64::from(index)) as u32
    }

    /// The index and the generation an entry field names.
    pub fn split_entry(&self, entry: u32) -> (u32, u32) {
        (
            entry & ((1u32 << self.index_bits) - 1),
            entry >> self.index_bits,
        )
    }

    /// The address of `fields`; `None` if a field does not fit.
    pub fn compose(&self, fields: AddressFields) -> Option<GlobalAddress> {
        if u64::from(fields.rank) >> self.rank_bits != 0
            || u64::from(fields.color) >> COLOR_BITS != 0
            || u64::from(fields.entry) >> self.entry_bits != 0
            || fields.offset >> OFFSET_BITS != 0
        {
            return None;
        }
        let entry_shift = OFFSET_BITS;
        let color_shift = entry_shift + self.entry_bits;
        let rank_shift = color_shift + COLOR_BITS;
        Some(GlobalAddress(
            u64::from(fields.rank) << rank_shift
                | u64::from(fields.color) << color_shift
                | u64::from(fields.entry) << entry_shift
                | fields.offset,
        ))
    }

    /// The fields of `address`.
    pub fn fields(&self, address: GlobalAddress) -> AddressFields {
        let entry_shift = OFFSET_BITS;
        let color_shift = entry_shift + self.entry_bits;
        let rank_shift = color_shift + COLOR_BITS;
        let mask = |bits: u32| (1u64 << bits) - 1;
        AddressFields {
            rank: (address.0 >> rank_shift & mask(self.rank_bits)) as u32,
            color: (address.0 >> color_shift & mask(COLOR_BITS)) as u32,
            entry: (address.0 >> entry_shift & mask(self.entry_bits)) as u32,
            offset: address.0 & mask(OFFSET_BITS),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn widths_follow_the_rank_count_and_fill_64_bits() {
        for ranks in [1u32, 2, 3, 4, 5, 31, 32, 33, 1000, 1 << 20] {
            let layout = AddressLayout::for_ranks(ranks, 100).unwrap();
            assert!(u64::from(ranks) <= 1 << layout.rank_bits, "{ranks}");
            if ranks > 2 {
                assert!(u64::from(ranks) > 1 << (layout.rank_bits - 1), "{ranks}");
            }
            assert_eq!(
                layout.rank_bits + COLOR_BITS + layout.entry_bits + OFFSET_BITS,
                64
            );
            assert!(layout.entry_bits >= MIN_ENTRY_BITS);
            assert_eq!(layout.index_bits, 7, "100 entries need 7 bits");
        }
        assert_eq!(AddressLayout::for_ranks(0, 100), None);
        assert_eq!(AddressLayout::for_ranks((MAX_RANKS + 1) as u32, 100), None);
        assert_eq!(
            AddressLayout::for_ranks(1 << 20, 256),
            None,
            "8 index bits of 7"
        );
    }

    #[test]
    fn fields_survive_a_round_trip_and_overflow_is_refused() {
        let layout = AddressLayout::for_ranks(6, 256).unwrap();
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..10_000 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let fields = AddressFields {
                rank: (seed % 6) as u32,
                color: (seed >> 8) as u32 & 3,
                entry: (seed >> 10) as u32 & ((1 << layout.entry_bits) - 1),
                offset: seed >> (64 - OFFSET_BITS),
            };
            let address = layout.compose(fields).unwrap();
            assert_eq!(layout.fields(address), fields);
        }
        let too_far = AddressFields {
            rank: 8,
            color: 0,
            entry: 1,
            offset: 0,
        };
        assert_eq!(layout.compose(too_far), None);
        let long = AddressFields {
            rank: 0,
            color: 0,
            entry: 1,
            offset: 1 << OFFSET_BITS,
        };
        assert_eq!(layout.compose(long), None);
    }

    #[test]
    fn entries_carry_their_generation_and_offsets_never_carry_into_them() {
        let layout = AddressLayout::for_ranks(4, 256).unwrap();
        assert_eq!(layout.generation_bits(), 25 - 8);
        let entry = layout.entry(5, 3);
        assert_eq!(layout.split_entry(entry), (5, 3));
        let wrapped = layout.entry(5, 1 << layout.generation_bits());
        assert_eq!(layout.split_entry(wrapped), (5, 0));
        let fields = AddressFields {
            rank: 1,
            color: 0,
            entry,
            offset: 10,
        };
        let address = layout.compose(fields).unwrap();
        let far = address.plus(1 << OFFSET_BITS);
        assert_eq!(layout.fields(far).entry, entry);
        assert_eq!(layout.fields(far).offset, OFFSET_MASK);
        assert_eq!(layout.fields(address.plus(5)).offset, 15);
    }
}
