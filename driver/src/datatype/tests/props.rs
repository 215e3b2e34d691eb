//! Random nested datatypes: the compiled patterns name the reference
//! typemap's bytes in order.

use proptest::prelude::*;

use super::pattern_offsets;
use super::reference::{byte_offsets, typemap};
use crate::datatype::ir::Flattener;
use crate::datatype::{dual_unit, Datatype, Field, Order};

fn leaf() -> impl Strategy<Value = Datatype> {
    prop_oneof![
        Just(Datatype::byte()),
        Just(Datatype::primitive(3)),
        Just(Datatype::i16()),
        Just(Datatype::i32()),
        Just(Datatype::f64()),
    ]
}

fn subarray_args() -> impl Strategy<Value = (Vec<u64>, Vec<u64>, Vec<u64>, Order)> {
    prop::collection::vec((1u64..5, 0u64..5, 0u64..5), 1..=3).prop_flat_map(|dims| {
        let sizes: Vec<u64> = dims.iter().map(|d| d.0).collect();
        let subsizes: Vec<u64> = dims.iter().map(|d| d.1 % (d.0 + 1)).collect();
        let starts: Vec<u64> = dims
            .iter()
            .zip(&subsizes)
            .map(|(d, &sub)| d.2 % (d.0 - sub + 1))
            .collect();
        prop_oneof![Just(Order::C), Just(Order::Fortran)]
            .prop_map(move |order| (sizes.clone(), subsizes.clone(), starts.clone(), order))
    })
}

/// Random datatypes, nested up to four deep; `negative_extents` allows
/// resized types of negative extent.
pub(super) fn datatype(negative_extents: bool) -> impl Strategy<Value = Datatype> {
    let low_extent = if negative_extents { -8i64 } else { 0 };
    leaf().prop_recursive(4, 48, 4, move |inner| {
        prop_oneof![
            (0u64..4, inner.clone())
                .prop_map(|(count, t)| Datatype::contiguous(count, &t).unwrap()),
            (0u64..4, 0u64..3, -4i64..5, inner.clone())
                .prop_map(|(c, b, s, t)| Datatype::vector(c, b, s, &t).unwrap()),
            (0u64..4, 0u64..3, -40i64..41, inner.clone())
                .prop_map(|(c, b, s, t)| Datatype::hvector(c, b, s, &t).unwrap()),
            (
                prop::collection::vec((0u64..3, -5i64..6), 0..4),
                inner.clone()
            )
                .prop_map(|(blocks, t)| Datatype::indexed(&blocks, &t).unwrap()),
            (
                prop::collection::vec((0u64..3, -40i64..41), 0..4),
                inner.clone()
            )
                .prop_map(|(blocks, t)| Datatype::hindexed(&blocks, &t).unwrap()),
            // Index lists with a constant stride (to be found).
            (0u64..3, -40i64..41, -24i64..25, 2usize..6, inner.clone()).prop_map(
                |(b, start, step, n, t)| {
                    let displacements: Vec<i64> = (0..n as i64).map(|i| start + i * step).collect();
                    Datatype::hindexed_block(b, &displacements, &t).unwrap()
                }
            ),
            (
                0u64..3,
                prop::collection::vec(-5i64..6, 0..4),
                inner.clone()
            )
                .prop_map(|(b, d, t)| Datatype::indexed_block(b, &d, &t).unwrap()),
            prop::collection::vec((0u64..3, -40i64..41, inner.clone()), 1..4).prop_map(|fields| {
                let fields: Vec<Field> = fields
                    .into_iter()
                    .map(|(block, displacement, datatype)| Field {
                        block,
                        displacement,
                        datatype,
                    })
                    .collect();
                Datatype::structure(&fields).unwrap()
            }),
            (subarray_args(), inner.clone()).prop_map(|((sizes, subs, starts, order), t)| {
                Datatype::subarray(&sizes, &subs, &starts, order, &t).unwrap()
            }),
            (-16i64..17, low_extent..33, inner.clone())
                .prop_map(|(lb, extent, t)| Datatype::resized(&t, lb, extent).unwrap()),
        ]
    })
}

/// Small enough to expand byte by byte.
fn small(datatype: &Datatype, count: u64) -> bool {
    datatype.size().saturating_mul(count) <= 1 << 14
        && (datatype.true_extent() + datatype.extent().abs() * count as i64) <= 1 << 18
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    /// Sizes, bounds and true bounds agree with the reference typemap.
    #[test]
    fn bounds_match_the_reference(t in datatype(true)) {
        let map = typemap(&t);
        prop_assert_eq!(t.size(), map.size());
        prop_assert_eq!((t.lb(), t.ub()), map.bounds());
        let (low, high) = map.true_bounds();
        prop_assert_eq!((t.true_lb(), t.true_lb() + t.true_extent()), (low, high));
    }

    /// The pattern of `count` elements names the reference typemap's
    /// bytes in pack order, from any byte of the stream on.
    #[test]
    fn pattern_names_the_typemap_in_order(
        t in datatype(true),
        count in 0u64..4,
        window in (any::<u64>(), any::<u64>()),
    ) {
        prop_assume!(small(&t, count));
        let expected = byte_offsets(&typemap(&t), count);
        let pattern = t.commit().unwrap().pattern(count).unwrap();
        prop_assert_eq!(pattern.len, expected.len() as u64);
        prop_assert_eq!(pattern_offsets(&pattern, 0, pattern.len), expected.clone());
        // A part of the stream, as a packet would carry it.
        let total = expected.len() as u64;
        let from = if total == 0 { 0 } else { window.0 % total };
        let len = if total == 0 { 0 } else { window.1 % (total - from + 1) };
        let part = &expected[from as usize..(from + len) as usize];
        prop_assert_eq!(pattern_offsets(&pattern, from, len), part.to_vec());
        let sliced = pattern.plan().unwrap().slice(from, len);
        prop_assert_eq!(pattern_offsets(&sliced, 0, len), part.to_vec());
    }

    /// Packing through the pattern gives the reference pack; unpacking
    /// through it writes exactly what the reference unpack writes and no
    /// byte outside the typemap.
    #[test]
    fn pack_and_unpack_match_the_reference(
        t in datatype(true),
        count in 0u64..4,
        padding in 0usize..64,
        seed in any::<u8>(),
    ) {
        prop_assume!(small(&t, count));
        let reference = byte_offsets(&typemap(&t), count);
        let pattern = t.commit().unwrap().pattern(count).unwrap();
        let low = reference.iter().copied().min().unwrap_or(0);
        let high = reference.iter().copied().max().unwrap_or(0) + 1;
        let span = (high - low) as usize + 2 * padding;
        let base = padding as i64 - low;
        let at = |offset: i64| (base + offset) as usize;
        let memory: Vec<u8> = (0..span).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect();

        let reference_pack: Vec<u8> = reference.iter().map(|&o| memory[at(o)]).collect();
        let plan = pattern.plan().unwrap();
        let mut pack = Vec::new();
        for segment in plan.segments(0, pattern.len) {
            let start = at(segment.offset);
            pack.extend_from_slice(&memory[start..start + segment.len as usize]);
        }
        prop_assert_eq!(&pack, &reference_pack);

        let stream: Vec<u8> = (0..pack.len()).map(|i| (i as u8) ^ 0x5a).collect();
        let mut target = vec![0xeeu8; span];
        let mut taken = 0usize;
        for segment in plan.segments(0, pattern.len) {
            let start = at(segment.offset);
            let len = segment.len as usize;
            target[start..start + len].copy_from_slice(&stream[taken..taken + len]);
            taken += len;
        }
        let mut reference_target = vec![0xeeu8; span];
        for (i, &o) in reference.iter().enumerate() {
            reference_target[at(o)] = stream[i];
        }
        prop_assert_eq!(&target, &reference_target);
        let named: std::collections::HashSet<usize> = reference.iter().map(|&o| at(o)).collect();
        for (i, &byte) in target.iter().enumerate() {
            if !named.contains(&i) {
                prop_assert_eq!(byte, 0xee, "byte {} outside the typemap changed", i);
            }
        }
    }

    /// Normalization never changes the stream: the normalized and the
    /// raw flattening name the same bytes in the same order, and the
    /// normalized one has no more blocks.
    #[test]
    fn normalization_keeps_the_stream(t in datatype(true)) {
        prop_assume!(small(&t, 1));
        let expand = |normalize: bool| {
            let items = Flattener { normalize }.flatten(&t).unwrap();
            let mut offsets = Vec::new();
            let mut blocks = 0u64;
            for item in &items {
                item.each_block(0, &mut |at, len| {
                    blocks += 1;
                    offsets.extend((0..len as i64).map(|k| at + k));
                });
            }
            (offsets, blocks)
        };
        let (raw, raw_blocks) = expand(false);
        let (normalized, blocks) = expand(true);
        prop_assert_eq!(&normalized, &raw);
        prop_assert!(blocks <= raw_blocks);
        prop_assert_eq!(normalized, byte_offsets(&typemap(&t), 1));
    }
}

proptest! {
    // Pairs of types with data are rarer: allow more rejects.
    #![proptest_config(ProptestConfig {
        cases: 200,
        max_global_rejects: 100_000,
        ..ProptestConfig::default()
    })]

    /// The dual-contiguous unit divides every block boundary of both
    /// sides' walks and is the largest that does.
    #[test]
    fn dual_unit_divides_both_sides(a in datatype(false), b in datatype(false)) {
        prop_assume!(a.size() > 0 && b.size() > 0);
        let (sa, sb) = (a.size(), b.size());
        let g = gcd(sa, sb);
        let (ca, cb) = (sb / g, sa / g);
        prop_assume!(small(&a, ca) && small(&b, cb));
        let pa = a.commit().unwrap().pattern(ca).unwrap();
        let pb = b.commit().unwrap().pattern(cb).unwrap();
        let unit = dual_unit(&pa, &pb).unwrap();
        let mut boundaries = 0u64;
        for pattern in [&pa, &pb] {
            let mut at = 0u64;
            for segment in pattern.plan().unwrap().segments(0, pattern.len) {
                at += segment.len;
                boundaries = gcd(boundaries, at);
            }
        }
        prop_assert_eq!(unit.unit, boundaries);
        prop_assert_eq!(unit.units * unit.unit, pa.len);
    }
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}
