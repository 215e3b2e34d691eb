//! Compiled patterns of common types are compact, and name the right
//! bytes (checked against the reference typemap).

use pindown_uapi::pattern::{BlockList, Dim, Pattern, Piece};

use super::pattern_offsets;
use super::reference::{byte_offsets, typemap};
use crate::datatype::{Datatype, DatatypeError, Field, Order, MAX_LISTED_BLOCKS};

/// Compiles and checks the bytes against the reference.
pub(super) fn compiled(t: &Datatype, count: u64) -> Pattern {
    let pattern = t.commit().unwrap().pattern(count).unwrap();
    assert_eq!(
        pattern_offsets(&pattern, 0, pattern.len),
        byte_offsets(&typemap(t), count)
    );
    pattern
}

fn loops(piece: &Piece) -> Vec<Dim> {
    match piece {
        Piece::Strided { dims, .. } => dims.iter().copied().filter(|d| d.count > 1).collect(),
        Piece::Indexed { .. } => panic!("expected a strided piece, got {piece:?}"),
    }
}

#[test]
fn matrix_column_is_one_strided_piece() {
    let (rows, row_elements) = (4096u64, 4097i64);
    let column = Datatype::vector(rows, 1, row_elements, &Datatype::f64()).unwrap();
    let pattern = column.commit().unwrap().pattern(1).unwrap();
    assert_eq!(pattern.repeat, 1);
    let [Piece::Strided { offset, block, .. }] = pattern.pieces.as_slice() else {
        panic!("not one strided piece: {pattern:?}");
    };
    assert_eq!((*offset, *block), (0, 8));
    assert_eq!(
        loops(&pattern.pieces[0]),
        vec![Dim {
            count: rows,
            stride: row_elements * 8
        }]
    );
    assert_eq!(pattern.len, rows * 8);
    // The walk: one double per row.
    let segments: Vec<_> = pattern.plan().unwrap().segments(0, pattern.len).collect();
    assert_eq!(segments.len(), rows as usize);
    assert!(segments
        .iter()
        .enumerate()
        .all(|(i, s)| s.len == 8 && s.offset == i as i64 * row_elements * 8));
}

#[test]
fn columns_with_a_resized_extent_add_a_loop() {
    // Several adjacent columns: the column resized to one double.
    let column = Datatype::vector(64, 1, 65, &Datatype::f64()).unwrap();
    let column = Datatype::resized(&column, 0, 8).unwrap();
    let pattern = compiled(&column, 3);
    assert_eq!(pattern.pieces.len(), 1);
    assert_eq!(
        loops(&pattern.pieces[0]).len() + usize::from(pattern.repeat > 1),
        2
    );
}

#[test]
fn subarray_of_a_3d_array_is_one_piece_of_two_or_three_loops() {
    for order in [Order::C, Order::Fortran] {
        // Strided in the two outer dimensions, contiguous in the fastest.
        let t = Datatype::subarray(
            &[10, 10, 10],
            &[4, 5, 6],
            &[1, 2, 3],
            order,
            &Datatype::i32(),
        )
        .unwrap();
        let pattern = compiled(&t, 1);
        assert_eq!(pattern.pieces.len(), 1, "{order:?}: {pattern:?}");
        assert_eq!(loops(&pattern.pieces[0]).len(), 2, "{pattern:?}");
        // Two elements of it: a third loop, still one piece.
        let pattern = compiled(&t, 2);
        assert_eq!(
            (pattern.pieces.len(), pattern.repeat),
            (1, 1),
            "{pattern:?}"
        );
        assert_eq!(loops(&pattern.pieces[0]).len(), 3, "{pattern:?}");
        // A full fastest dimension folds into the next.
        let full = Datatype::subarray(
            &[10, 10, 10],
            &[4, 5, 10],
            &[1, 2, 0],
            Order::C,
            &Datatype::i32(),
        )
        .unwrap();
        let pattern = compiled(&full, 1);
        assert_eq!(pattern.pieces.len(), 1);
        assert_eq!(loops(&pattern.pieces[0]).len(), 1, "{pattern:?}");
    }
}

#[test]
fn four_loops_put_the_count_in_the_repeat() {
    let t = Datatype::subarray(
        &[4, 4, 4, 4],
        &[2, 2, 2, 2],
        &[1, 1, 1, 1],
        Order::C,
        &Datatype::byte(),
    )
    .unwrap();
    let pattern = compiled(&t, 1);
    assert_eq!((pattern.pieces.len(), pattern.repeat), (1, 1));
    assert_eq!(loops(&pattern.pieces[0]).len(), 3);
    let pattern = compiled(&t, 5);
    assert_eq!(pattern.pieces.len(), 1);
    assert_eq!((pattern.repeat, pattern.extent), (5, t.extent()));
    assert_eq!(loops(&pattern.pieces[0]).len(), 3);
    assert!(matches!(pattern.pieces[0], Piece::Strided { block: 2, .. }));
}

#[test]
fn vector_whose_stride_is_its_block_is_contiguous() {
    let t = Datatype::vector(16, 3, 3, &Datatype::i32()).unwrap();
    let pattern = compiled(&t, 5);
    assert_eq!(
        pattern,
        Pattern::new(vec![Piece::contiguous(0, 16 * 3 * 4 * 5)], 1, 0).unwrap()
    );
}

#[test]
fn constant_stride_index_lists_become_loops() {
    let displacements: Vec<i64> = (0..100).map(|i| 7 + 24 * i).collect();
    let t = Datatype::hindexed_block(2, &displacements, &Datatype::i16()).unwrap();
    let pattern = compiled(&t, 1);
    assert_eq!(pattern.pieces.len(), 1);
    assert_eq!(
        loops(&pattern.pieces[0]),
        vec![Dim {
            count: 100,
            stride: 24
        }]
    );
    // Indexed blocks of constant length and stride, in elements.
    let blocks: Vec<(u64, i64)> = (0..10).map(|i| (3, -5 * i)).collect();
    let pattern = compiled(&Datatype::indexed(&blocks, &Datatype::f64()).unwrap(), 1);
    assert_eq!(pattern.pieces.len(), 1);
    assert_eq!(
        loops(&pattern.pieces[0]),
        vec![Dim {
            count: 10,
            stride: -40
        }]
    );
}

#[test]
fn irregular_blocks_are_one_listed_piece() {
    let blocks = [(1u64, 0i64), (2, 5), (1, 11), (3, 20)];
    let pattern = compiled(&Datatype::hindexed(&blocks, &Datatype::byte()).unwrap(), 1);
    let [Piece::Indexed {
        blocks: BlockList::Listed(list),
        ..
    }] = pattern.pieces.as_slice()
    else {
        panic!("not one listed piece: {pattern:?}");
    };
    assert_eq!(list.len(), blocks.len());
}

#[test]
fn count_of_a_struct_goes_into_the_repeat() {
    // struct { f64 x; i32 tag; } sized as C sizes it (16 bytes).
    let fields = [
        Field {
            block: 1,
            displacement: 0,
            datatype: Datatype::f64(),
        },
        Field {
            block: 1,
            displacement: 12,
            datatype: Datatype::i32(),
        },
    ];
    let t = Datatype::resized(&Datatype::structure(&fields).unwrap(), 0, 20).unwrap();
    let pattern = compiled(&t, 1000);
    assert_eq!((pattern.repeat, pattern.extent), (1000, 20));
    assert_eq!(
        pattern.encoded_len(),
        Pattern::new(pattern.pieces.clone(), 1, 0)
            .unwrap()
            .encoded_len()
    );
    // A vector of such structs: unrolled or listed inside the period,
    // never more than the blocks it names.
    let rows = Datatype::vector(3, 2, 7, &t).unwrap();
    let pattern = compiled(&rows, 4);
    assert_eq!(pattern.repeat, 4);
}

#[test]
fn too_irregular_types_are_refused() {
    // Blocks of 1 and 2 bytes per element (not a loop), four million
    // elements, with strides that fold nowhere.
    let fields = [
        Field {
            block: 1,
            displacement: 0,
            datatype: Datatype::byte(),
        },
        Field {
            block: 1,
            displacement: 3,
            datatype: Datatype::i16(),
        },
    ];
    let pair = Datatype::structure(&fields).unwrap();
    let rows = Datatype::hvector(1 << 11, 1, 11, &pair).unwrap();
    let t = Datatype::hvector(1 << 10, 1, 1 << 16, &rows).unwrap();
    let t = Datatype::hvector(3, 1, 1 << 28, &t).unwrap();
    let blocks = 2 * (3u128 << 10 << 11);
    assert!(blocks > u128::from(MAX_LISTED_BLOCKS));
    let refused = t.commit().unwrap().pattern(1);
    assert!(
        matches!(refused, Err(DatatypeError::TooIrregular { .. })),
        "{refused:?}"
    );
}

#[test]
fn offsets_past_64_bits_are_refused() {
    let wide = Datatype::hvector(2, 1, i64::MAX / 2, &Datatype::byte()).unwrap();
    assert!(matches!(
        wide.commit().unwrap().pattern(4),
        Err(DatatypeError::Overflow(_))
    ));
    assert!(matches!(
        Datatype::hvector(4, 1, i64::MAX / 2, &Datatype::byte()),
        Err(DatatypeError::Overflow(_))
    ));
}

#[test]
fn empty_types_compile_to_empty_patterns() {
    let empty = Datatype::contiguous(0, &Datatype::f64()).unwrap();
    assert_eq!(empty.size(), 0);
    let pattern = compiled(&empty, 10);
    assert_eq!(pattern.len, 0);
    assert!(pattern.pieces.is_empty());
    assert_eq!(compiled(&Datatype::f64(), 0).len, 0);
}
