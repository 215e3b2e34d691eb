use proptest::prelude::*;

use super::*;

/// Every byte offset of the whole stream, by nested loops.
fn reference_offsets(pattern: &Pattern) -> Vec<i64> {
    let mut out = Vec::new();
    for r in 0..pattern.repeat {
        let origin = pattern.extent * r as i64;
        for piece in &pattern.pieces {
            match piece {
                Piece::Strided {
                    offset,
                    block,
                    dims,
                } => {
                    for k in 0..dims[2].count {
                        for j in 0..dims[1].count {
                            for i in 0..dims[0].count {
                                let at = origin
                                    + offset
                                    + i as i64 * dims[0].stride
                                    + j as i64 * dims[1].stride
                                    + k as i64 * dims[2].stride;
                                out.extend((0..*block as i64).map(|b| at + b));
                            }
                        }
                    }
                }
                Piece::Indexed { offset, blocks } => {
                    let BlockList::Listed(list) = blocks else {
                        panic!("unresolved")
                    };
                    for block in list {
                        let at = origin + offset + block.offset;
                        out.extend((0..block.len as i64).map(|b| at + b));
                    }
                }
            }
        }
    }
    out
}

fn expand(segments: impl Iterator<Item = Segment>) -> Vec<i64> {
    segments
        .flat_map(|s| (0..s.len as i64).map(move |b| s.offset + b))
        .collect()
}

fn dim() -> impl Strategy<Value = Dim> {
    (0u64..4, -40i64..40).prop_map(|(count, stride)| Dim { count, stride })
}

fn piece() -> impl Strategy<Value = Piece> {
    let strided = (-50i64..50, 0u64..5, [dim(), dim(), dim()]).prop_map(|(offset, block, dims)| {
        Piece::Strided {
            offset,
            block,
            dims,
        }
    });
    let listed = (
        -50i64..50,
        prop::collection::vec((-60i64..60, 0u64..6), 0..6),
    )
        .prop_map(|(offset, list)| Piece::Indexed {
            offset,
            blocks: BlockList::Listed(
                list.into_iter()
                    .map(|(offset, len)| Block { offset, len })
                    .collect(),
            ),
        });
    prop_oneof![strided, listed]
}

fn pattern() -> impl Strategy<Value = Pattern> {
    (prop::collection::vec(piece(), 0..4), 0u64..4, -100i64..100)
        .prop_map(|(pieces, repeat, extent)| Pattern::new(pieces, repeat, extent).unwrap())
}

proptest! {
    #[test]
    fn encoding_round_trips(p in pattern(), q in pattern()) {
        let bytes = encode_pair(&p, &q);
        prop_assert_eq!(bytes.len(), p.encoded_len() + q.encoded_len());
        prop_assert_eq!(decode_pair(&bytes).unwrap(), (p, q));
    }

    #[test]
    fn walk_matches_nested_loops(p in pattern()) {
        let plan = p.plan().unwrap();
        let whole = reference_offsets(&p);
        prop_assert_eq!(plan.len() as usize, whole.len());
        prop_assert_eq!(expand(plan.segments(0, plan.len())), whole.clone());
        if let Some((low, high)) = plan.hull() {
            prop_assert!(whole.iter().all(|&b| b >= low && b < high));
            prop_assert!(whole.contains(&low) && whole.contains(&(high - 1)));
        } else {
            prop_assert!(whole.is_empty());
        }
    }

    #[test]
    fn any_cut_walks_the_same_bytes(p in pattern(), cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..5)) {
        let plan = p.plan().unwrap();
        let whole = expand(plan.segments(0, plan.len()));
        let mut points: Vec<u64> = cuts.iter().map(|c| c.index(plan.len() as usize + 1) as u64).collect();
        points.extend([0, plan.len()]);
        points.sort_unstable();
        let mut pieced = Vec::new();
        let mut sliced = Vec::new();
        for pair in points.windows(2) {
            let (from, len) = (pair[0], pair[1] - pair[0]);
            pieced.extend(expand(plan.segments(from, len)));
            // The part alone, as a packet would carry it.
            let part = plan.slice(from, len);
            prop_assert!(part.encoded_len() <= p.encoded_len());
            let bytes = part.encode();
            let (decoded, used) = Pattern::decode(&bytes, 0).unwrap();
            prop_assert_eq!(used, bytes.len());
            let part_plan = decoded.plan().unwrap();
            prop_assert_eq!(part_plan.len(), len);
            sliced.extend(expand(part_plan.segments(0, len)));
        }
        prop_assert_eq!(&pieced, &whole);
        prop_assert_eq!(&sliced, &whole);
    }

    #[test]
    fn decoding_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..400)) {
        if let Ok((p, q)) = decode_pair(&bytes) {
            let _ = p.plan();
            let _ = q.plan();
        }
    }

    #[test]
    fn huge_values_are_refused_not_wrapped(count in any::<u64>(), stride in any::<i64>(), block in any::<u64>(), offset in any::<i64>(), repeat in any::<u64>(), extent in any::<i64>(), skip in any::<u64>(), len in any::<u64>()) {
        let p = Pattern {
            repeat, extent, skip, len,
            pieces: vec![Piece::Strided { offset, block, dims: [Dim { count, stride }, Dim { count: 2, stride }, Dim::ONE] }],
        };
        if let Ok(plan) = p.plan() {
            // A checked plan walks without overflow: its first and last
            // segments lie inside its hull.
            let (low, high) = plan.hull().unwrap_or((0, 0));
            for s in plan.segments(0, plan.len()).take(3) {
                prop_assert!(s.offset >= low && (s.offset as i128 + s.len as i128) <= high as i128);
            }
        }
    }
}

#[test]
fn table_two_forty_byte_records_as_thirty_two_plus_eight() {
    // DIMMnet-2's table 2: two 40-byte records, 56 bytes apart, as a
    // 32-byte and an 8-byte piece per record.
    let p = Pattern::new(
        vec![Piece::contiguous(0, 32), Piece::contiguous(32, 8)],
        2,
        56,
    )
    .unwrap();
    let plan = p.plan().unwrap();
    let segments: Vec<_> = plan.segments(0, plan.len()).collect();
    assert_eq!(
        segments,
        vec![
            Block { offset: 0, len: 32 },
            Block { offset: 32, len: 8 },
            Block {
                offset: 56,
                len: 32
            },
            Block { offset: 88, len: 8 },
        ]
    );
}

#[test]
fn a_column_seeks_in_constant_time_and_slices_to_the_same_size() {
    // One double per row of a 4096 x 4097 matrix.
    let p = Pattern::new(vec![Piece::vector(0, 8, 4096, 4097 * 8)], 1, 0).unwrap();
    let plan = p.plan().unwrap();
    let part = plan.slice(2048 * 8 + 3, 1000);
    assert_eq!(part.encoded_len(), p.encoded_len());
    let first = part.plan().unwrap().segments(0, 1000).next().unwrap();
    assert_eq!(
        first,
        Block {
            offset: 2048 * 4097 * 8 + 3,
            len: 5
        }
    );
}

#[test]
fn overflowing_counts_are_refused() {
    let p = Pattern {
        repeat: 1,
        extent: 0,
        skip: 0,
        len: 0,
        pieces: vec![Piece::vector(0, u64::MAX, 2, 1)],
    };
    assert_eq!(
        p.plan().unwrap_err(),
        PatternError::Overflow("strided bytes")
    );
    let past = Pattern {
        len: 9,
        ..Pattern::contiguous(8)
    };
    assert!(matches!(
        past.plan(),
        Err(PatternError::OutsideStream { .. })
    ));
}

#[test]
fn lists_in_memory_are_copied_and_bounded() {
    let blocks = [Block { offset: 8, len: 4 }, Block { offset: 0, len: 2 }];
    let raw = encode_blocks(&blocks);
    let mut p = Pattern {
        repeat: 1,
        extent: 0,
        skip: 0,
        len: 6,
        pieces: vec![Piece::Indexed {
            offset: 100,
            blocks: BlockList::InMemory {
                iova: 0x1000,
                count: 2,
            },
        }],
    };
    assert_eq!(p.plan().unwrap_err(), PatternError::Unresolved);
    let mut too_few = p.clone();
    assert_eq!(
        too_few.resolve_lists(1, &mut |_, _| true).unwrap_err(),
        PatternError::TooManyBlocks(1)
    );
    p.resolve_lists(2, &mut |iova, out| {
        assert_eq!(iova, 0x1000);
        out.copy_from_slice(&raw);
        true
    })
    .unwrap();
    let plan = p.plan().unwrap();
    assert_eq!(
        plan.segments(0, 6).collect::<Vec<_>>(),
        vec![
            Block {
                offset: 108,
                len: 4
            },
            Block {
                offset: 100,
                len: 2
            }
        ]
    );
}

#[test]
fn strided_loops_whose_reaches_add_up_past_128_bits_are_refused() {
    // Each reach is near 2^127; two of them overflow an i128, and a loop
    // of no iteration keeps the element count from overflowing first
    // (found by the uapi_decode fuzz target).
    let piece = Piece::Strided {
        offset: 0,
        block: 1,
        dims: [
            Dim {
                count: u64::MAX,
                stride: i64::MAX,
            },
            Dim {
                count: 0,
                stride: 0,
            },
            Dim {
                count: u64::MAX,
                stride: i64::MAX,
            },
        ],
    };
    let pattern = Pattern {
        repeat: 1,
        extent: 0,
        skip: 0,
        len: 0,
        pieces: vec![piece],
    };
    assert_eq!(
        pattern.plan().map(|plan| plan.len()),
        Err(PatternError::Overflow("strided offsets"))
    );
}

#[test]
fn a_slice_past_two_to_the_64_bytes_of_the_stream_walks_the_same_blocks() {
    // The stream is 2^66 bytes; the part starts past byte 2^64, which a
    // skip cannot name unless the slice starts at its first repetition.
    let pattern = Pattern {
        repeat: 1 << 62,
        extent: 1,
        skip: u64::MAX - 100,
        len: 1000,
        pieces: vec![Piece::contiguous(0, 16)],
    };
    let plan = pattern.plan().unwrap();
    let slice = plan.slice(200, 300);
    let sliced = slice.plan().unwrap();
    let whole: Vec<Segment> = plan.segments(200, 300).collect();
    assert_eq!(sliced.segments(0, 300).collect::<Vec<_>>(), whole);
    assert!(slice.skip < 16, "{slice:?}");
}
