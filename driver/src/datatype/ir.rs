//! The flattened form of a datatype, and its normalization.
//!
//! A type flattens to a list of [`Ir`] items in stream order: contiguous
//! blocks and repetitions (a loop of `count` iterations `stride` bytes
//! apart around a list of items). Offsets are from the type's origin.
//! Normalization rewrites the list without changing the bytes it names or
//! their order:
//!
//! * empty blocks and loops go; a loop of one iteration is replaced by
//!   its body;
//! * blocks adjacent in memory and in the stream merge;
//! * a loop over one block whose stride equals the block is a longer
//!   block (a vector whose stride is its block is contiguous);
//! * a loop over one loop whose stride equals the inner loop's span
//!   (`count * stride`) is one loop (dimensions fold);
//! * a run of items equal up to a constant shift is a loop (constant
//!   strides found in index lists).

use super::compile::MAX_LISTED_BLOCKS;
use super::types::Datatype;
use super::DatatypeError;

/// Items flattening may produce, at most, counted as they are made (the
/// same subtree flattened for each of its uses counts each time): a small
/// tree that shares subtrees can name exponentially many blocks. Past it
/// the type is refused ([`DatatypeError::TooComplex`]) rather than
/// flattened for minutes into gigabytes. A regular type folds into a few
/// items; an index list costs one per entry before its constant strides
/// fold.
pub const MAX_FLATTENED_ITEMS: u64 = 4 * MAX_LISTED_BLOCKS;

/// One item of a flattened type.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Ir {
    /// `len` contiguous bytes at `offset`.
    Block { offset: i64, len: u64 },
    /// `count` iterations of `body`, the `i`-th shifted by `i * stride`.
    Rep {
        count: u64,
        stride: i64,
        body: Vec<Ir>,
    },
}

impl Ir {
    /// Moves it by `by` bytes.
    pub(crate) fn shift(&mut self, by: i64) {
        match self {
            Ir::Block { offset, .. } => *offset += by,
            Ir::Rep { body, .. } => body.iter_mut().for_each(|item| item.shift(by)),
        }
    }

    /// Items in it, nested ones included.
    fn items(&self) -> u64 {
        match self {
            Ir::Block { .. } => 1,
            Ir::Rep { body, .. } => 1 + body.iter().map(Ir::items).sum::<u64>(),
        }
    }

    /// Contiguous blocks it names once fully expanded (saturating).
    pub(crate) fn blocks(&self) -> u128 {
        match self {
            Ir::Block { .. } => 1,
            Ir::Rep { count, body, .. } => {
                u128::from(*count).saturating_mul(body.iter().map(Ir::blocks).sum::<u128>())
            }
        }
    }

    /// Calls `visit` with each block in stream order.
    pub(crate) fn each_block(&self, origin: i64, visit: &mut dyn FnMut(i64, u64)) {
        match self {
            Ir::Block { offset, len } => visit(origin + offset, *len),
            Ir::Rep {
                count,
                stride,
                body,
            } => {
                for i in 0..*count {
                    let at = origin + stride * i as i64;
                    for item in body {
                        item.each_block(at, visit);
                    }
                }
            }
        }
    }
}

/// The shift `d` with `b == a` moved by `d`, if there is one.
fn shift_between(a: &Ir, b: &Ir) -> Option<i64> {
    match (a, b) {
        (
            Ir::Block { offset: x, len: m },
            Ir::Block {
                offset: y, len: n, ..
            },
        ) if m == n => y.checked_sub(*x),
        (
            Ir::Rep {
                count: c1,
                stride: s1,
                body: b1,
            },
            Ir::Rep {
                count: c2,
                stride: s2,
                body: b2,
            },
        ) if c1 == c2 && s1 == s2 && b1.len() == b2.len() && !b1.is_empty() => {
            let first = shift_between(&b1[0], &b2[0])?;
            b1.iter()
                .zip(b2)
                .skip(1)
                .all(|(x, y)| shift_between(x, y) == Some(first))
                .then_some(first)
        }
        _ => None,
    }
}

/// Builds flattened lists, normalizing as it goes or (for tests that
/// check normalization changes nothing) not at all.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Flattener {
    pub(crate) normalize: bool,
}

impl Flattener {
    /// The list of `items` in order, normalized.
    pub(crate) fn sequence(&self, items: Vec<Ir>) -> Vec<Ir> {
        if !self.normalize {
            return items;
        }
        let mut merged: Vec<Ir> = Vec::with_capacity(items.len());
        for item in items {
            if let (
                Some(Ir::Block { offset, len }),
                Ir::Block {
                    offset: next,
                    len: more,
                },
            ) = (merged.last_mut(), &item)
            {
                if i128::from(*offset) + i128::from(*len) == i128::from(*next) {
                    *len += more;
                    continue;
                }
            }
            merged.push(item);
        }
        // Runs of items equal up to a constant shift become loops.
        let mut out = Vec::with_capacity(merged.len());
        let mut i = 0;
        while i < merged.len() {
            let mut end = i + 1;
            let step = merged
                .get(i + 1)
                .and_then(|next| shift_between(&merged[i], next));
            if let Some(step) = step {
                while end < merged.len()
                    && shift_between(&merged[end - 1], &merged[end]) == Some(step)
                {
                    end += 1;
                }
            }
            if end - i >= 2 {
                let first = merged[i].clone();
                out.extend(self.repeat((end - i) as u64, step.unwrap_or(0), vec![first]));
            } else {
                out.push(merged[i].clone());
            }
            i = end;
        }
        out
    }

    /// `count` iterations of `body`, `stride` apart, normalized.
    pub(crate) fn repeat(&self, count: u64, stride: i64, body: Vec<Ir>) -> Vec<Ir> {
        if !self.normalize {
            return vec![Ir::Rep {
                count,
                stride,
                body,
            }];
        }
        if count == 0 || body.is_empty() {
            return Vec::new();
        }
        if count == 1 {
            return body;
        }
        if let [only] = body.as_slice() {
            match only {
                Ir::Block { offset, len } if i128::from(stride) == i128::from(*len) => {
                    return vec![Ir::Block {
                        offset: *offset,
                        len: len * count,
                    }];
                }
                Ir::Rep {
                    count: inner_count,
                    stride: inner_stride,
                    body: inner_body,
                } if i128::from(stride) == i128::from(*inner_count) * i128::from(*inner_stride) => {
                    return self.repeat(count * inner_count, *inner_stride, inner_body.clone());
                }
                _ => {}
            }
        }
        vec![Ir::Rep {
            count,
            stride,
            body,
        }]
    }

    /// The flattened list of one element of `datatype` at its origin.
    pub(crate) fn flatten(&self, datatype: &Datatype) -> Result<Vec<Ir>, DatatypeError> {
        self.flatten_counting(datatype, &mut 0)
    }

    /// [`flatten`](Self::flatten), adding the items it makes to `made`
    /// (at most [`MAX_FLATTENED_ITEMS`]).
    fn flatten_counting(
        &self,
        datatype: &Datatype,
        made: &mut u64,
    ) -> Result<Vec<Ir>, DatatypeError> {
        if datatype.size() == 0 {
            return Ok(Vec::new());
        }
        let groups = datatype.groups()?;
        if groups.is_empty() {
            // A primitive.
            return Ok(vec![Ir::Block {
                offset: 0,
                len: datatype.size(),
            }]);
        }
        let mut items = Vec::new();
        for group in groups {
            // No copies: nothing to flatten (nor to move by a displacement
            // that bounds never checked, since it names no byte).
            if group.loops.iter().any(|&(count, _)| count == 0) {
                continue;
            }
            let mut body = self.flatten_counting(group.element, made)?;
            *made = made.saturating_add(body.iter().map(Ir::items).sum());
            if *made > MAX_FLATTENED_ITEMS {
                return Err(DatatypeError::TooComplex {
                    limit: MAX_FLATTENED_ITEMS,
                });
            }
            for item in &mut body {
                item.shift(group.displacement);
            }
            for &(count, stride) in &group.loops {
                body = self.repeat(count, stride, body);
            }
            items.extend(body);
        }
        Ok(self.sequence(items))
    }
}
