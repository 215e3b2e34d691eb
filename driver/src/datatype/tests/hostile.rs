//! Inputs built to hurt: they get a clear error or the right bytes,
//! never a panic, an overflow, or minutes and gigabytes of work.

use pindown_uapi::pattern::Piece;

use super::compact::compiled;
use crate::datatype::{
    Datatype, DatatypeError, Field, MAX_DEPTH, MAX_FLATTENED_ITEMS, MAX_LISTED_BLOCKS,
};

#[test]
fn groups_with_no_copies_name_nothing_wherever_they_point() {
    // An element whose data lies 100 bytes in, copied zero times at the
    // far end of the address space: moving it there would overflow.
    let inner = Datatype::hindexed(&[(1, 100)], &Datatype::byte()).unwrap();
    let indexed = Datatype::hindexed(&[(0, i64::MAX), (1, 0)], &inner).unwrap();
    let fields = [
        Field {
            block: 0,
            displacement: i64::MAX - 10,
            datatype: inner.clone(),
        },
        Field {
            block: 1,
            displacement: 0,
            datatype: Datatype::byte(),
        },
    ];
    let structure = Datatype::structure(&fields).unwrap();
    for t in [indexed, structure] {
        let pattern = compiled(&t, 3);
        assert_eq!(pattern.len, 3);
    }
}

#[test]
fn a_type_that_uses_shared_subtrees_over_and_over_is_refused_quickly() {
    // 60 fields in all, naming about 2^24 irregular blocks: each level
    // uses the one below twice, 2^k bytes apart.
    let mut t = Datatype::hindexed(&[(1, 0), (2, 10)], &Datatype::byte()).unwrap();
    for k in 0..24 {
        let apart = 1i64 << (k + 6);
        t = Datatype::structure(&[
            Field {
                block: 1,
                displacement: 0,
                datatype: t.clone(),
            },
            Field {
                block: 1,
                displacement: apart - 3,
                datatype: Datatype::primitive(2),
            },
            Field {
                block: 1,
                displacement: apart,
                datatype: t.clone(),
            },
        ])
        .unwrap();
    }
    let refused = t.commit().unwrap_err();
    assert_eq!(
        refused,
        DatatypeError::TooComplex {
            limit: MAX_FLATTENED_ITEMS
        }
    );
    assert!(refused.to_string().contains("too complex"), "{refused}");
}

#[test]
fn an_index_list_of_millions_with_a_constant_stride_still_folds() {
    let entries: Vec<(u64, i64)> = (0..2_000_000).map(|i| (1, 16 * i)).collect();
    let t = Datatype::hindexed(&entries, &Datatype::f64()).unwrap();
    let pattern = t.commit().unwrap().pattern(1).unwrap();
    assert_eq!(pattern.pieces.len(), 1, "{:?}", pattern.pieces);
    assert_eq!(pattern.len, 8 * 2_000_000);
}

/// Listed blocks in a pattern.
fn listed(pieces: &[Piece]) -> usize {
    pieces
        .iter()
        .map(|piece| piece.listed().map_or(0, <[_]>::len))
        .sum()
}

#[test]
fn the_listed_blocks_of_all_pieces_together_are_bounded() {
    // Each field names 2^19 irregular blocks, under the bound; six of them
    // at irregular distances list more than it together.
    let pair = Datatype::hindexed(&[(1, 0), (2, 4)], &Datatype::byte()).unwrap();
    let pair = Datatype::resized(&pair, 0, 8).unwrap();
    let many = Datatype::contiguous(1 << 18, &pair).unwrap();
    let span = 8i64 << 18;
    let field = |k: i64| Field {
        block: 1,
        displacement: k * span * 2,
        datatype: many.clone(),
    };
    let two = Datatype::structure(&[field(0), field(1)]).unwrap();
    let pattern = two.commit().unwrap().pattern(1).unwrap();
    assert_eq!(pattern.len, 2 * (3 << 18));
    assert!(listed(&pattern.pieces) as u64 <= MAX_LISTED_BLOCKS);
    let fields: Vec<Field> = [0, 1, 3, 7, 15, 31].into_iter().map(field).collect();
    let six = Datatype::structure(&fields).unwrap();
    match six.commit().unwrap().pattern(1) {
        Err(DatatypeError::TooIrregular { blocks }) => {
            assert!(blocks > u128::from(MAX_LISTED_BLOCKS), "{blocks}")
        }
        other => panic!("{:?}", other.map(|p| listed(&p.pieces))),
    }
}

#[test]
fn nesting_is_bounded_at_max_depth() {
    let mut t = Datatype::f64();
    for level in 0..MAX_DEPTH {
        t = if level % 2 == 0 {
            Datatype::contiguous(1, &t).unwrap()
        } else {
            Datatype::resized(&t, 0, 8).unwrap()
        };
    }
    assert_eq!(compiled(&t, 4).len, 32);
    let refused = Datatype::contiguous(2, &t).unwrap_err();
    assert_eq!(
        refused,
        DatatypeError::TooDeep {
            depth: MAX_DEPTH + 1,
            limit: MAX_DEPTH
        }
    );
    assert!(refused.to_string().contains("too deep"), "{refused}");
}

#[test]
fn strides_and_displacements_of_no_copies_may_be_anything() {
    let f64 = Datatype::f64();
    for t in [
        Datatype::vector(0, 1, i64::MIN, &f64).unwrap(),
        Datatype::vector(3, 0, i64::MAX, &f64).unwrap(),
        Datatype::indexed(&[(0, i64::MIN), (2, 1)], &f64).unwrap(),
        Datatype::indexed_block(0, &[i64::MAX, 5], &f64).unwrap(),
    ] {
        let size = t.size();
        assert_eq!(compiled(&t, 2).len, 2 * size);
    }
    // With copies, the same stride is refused, naming the overflow.
    assert_eq!(
        Datatype::vector(2, 1, i64::MIN, &f64).unwrap_err(),
        DatatypeError::Overflow("displacement in extents")
    );
}
