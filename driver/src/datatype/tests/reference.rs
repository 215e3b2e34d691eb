//! A reference typemap: a naive walk of the type tree, written from MPI's
//! definitions of each constructor and sharing nothing with the compiler
//! (not even the extents: it computes its own).

use crate::datatype::{Constructor, Datatype, Order};

/// The entries of a typemap (offset, bytes) in pack order, and its
/// explicit bound markers.
#[derive(Clone, Debug, Default)]
pub struct Typemap {
    pub entries: Vec<(i64, u64)>,
    pub lb_marker: Option<i64>,
    pub ub_marker: Option<i64>,
    /// Bounds of the data without markers, alignment padding included.
    pub natural: Option<(i64, i64)>,
    /// Largest alignment of a basic type in it.
    pub align: u64,
}

impl Typemap {
    pub fn size(&self) -> u64 {
        self.entries.iter().map(|e| e.1).sum()
    }

    pub fn true_bounds(&self) -> (i64, i64) {
        let data: Vec<_> = self.entries.iter().filter(|e| e.1 > 0).collect();
        if data.is_empty() {
            return (0, 0);
        }
        let low = data.iter().map(|e| e.0).min().unwrap();
        let high = data.iter().map(|e| e.0 + e.1 as i64).max().unwrap();
        (low, high)
    }

    /// MPI's lb and ub: the markers where there are any, else the
    /// data's (with the padding of structs in it).
    pub fn bounds(&self) -> (i64, i64) {
        match (self.lb_marker, self.ub_marker) {
            (Some(lb), Some(ub)) => (lb, ub),
            _ => self.natural.unwrap_or((0, 0)),
        }
    }

    pub fn extent(&self) -> i64 {
        let (lb, ub) = self.bounds();
        ub - lb
    }

    /// Appends `other` moved by `by`, markers included.
    fn append(&mut self, other: &Typemap, by: i64) {
        self.entries
            .extend(other.entries.iter().map(|&(at, len)| (at + by, len)));
        if let Some(lb) = other.lb_marker {
            self.lb_marker = Some(self.lb_marker.map_or(lb + by, |m| m.min(lb + by)));
        }
        if let Some(ub) = other.ub_marker {
            self.ub_marker = Some(self.ub_marker.map_or(ub + by, |m| m.max(ub + by)));
        }
        // A child's bounds: its markers, or its natural bounds.
        let child = match (other.lb_marker, other.ub_marker) {
            (Some(lb), Some(ub)) => Some((lb, ub)),
            _ => other.natural,
        };
        if let (Some((lb, ub)), None) = (child, other.lb_marker) {
            let (lb, ub) = (lb + by, ub + by);
            self.natural = Some(
                self.natural
                    .map_or((lb, ub), |(l, h)| (l.min(lb), h.max(ub))),
            );
        }
        self.align = self.align.max(other.align);
    }
}

/// The typemap of one element at origin 0.
pub fn typemap(datatype: &Datatype) -> Typemap {
    let mut map = Typemap {
        align: 1,
        ..Typemap::default()
    };
    match datatype.constructor() {
        Constructor::Primitive { size, align } => {
            map.entries.push((0, *size));
            map.align = *align;
            if *size > 0 {
                map.natural = Some((0, *size as i64));
            }
        }
        Constructor::Contiguous { count, inner } => runs(&mut map, inner, [(*count, 0)]),
        Constructor::Vector {
            count,
            block,
            stride,
            inner,
        } => {
            let ext = typemap(inner).extent();
            runs(
                &mut map,
                inner,
                // Runs of no copies name nothing, whatever their place.
                (0..*count as i64)
                    .map(|i| (*block, if *block == 0 { 0 } else { i * stride * ext })),
            )
        }
        Constructor::Hvector {
            count,
            block,
            stride,
            inner,
        } => runs(
            &mut map,
            inner,
            (0..*count as i64).map(|i| (*block, i * stride)),
        ),
        Constructor::Indexed { blocks, inner } => {
            let ext = typemap(inner).extent();
            runs(
                &mut map,
                inner,
                blocks
                    .iter()
                    .map(|&(len, at)| (len, if len == 0 { 0 } else { at * ext })),
            )
        }
        Constructor::Hindexed { blocks, inner } => runs(&mut map, inner, blocks.iter().copied()),
        Constructor::IndexedBlock {
            block,
            displacements,
            inner,
        } => {
            let ext = typemap(inner).extent();
            runs(
                &mut map,
                inner,
                displacements
                    .iter()
                    .map(|&at| (*block, if *block == 0 { 0 } else { at * ext })),
            )
        }
        Constructor::HindexedBlock {
            block,
            displacements,
            inner,
        } => runs(
            &mut map,
            inner,
            displacements.iter().map(|&at| (*block, at)),
        ),
        Constructor::Struct { fields } => {
            for field in fields {
                runs(
                    &mut map,
                    &field.datatype,
                    [(field.block, field.displacement)],
                );
            }
            // Without markers, the extent is padded to the alignment.
            if let (None, Some((lb, ub))) = (map.lb_marker, map.natural) {
                let align = map.align as i64;
                let extent = (ub - lb + align - 1) / align * align;
                map.natural = Some((lb, lb + extent));
            }
        }
        Constructor::Subarray {
            sizes,
            subsizes,
            starts,
            order,
            inner,
        } => {
            let (sub, ext) = sub(inner);
            let n = sizes.len();
            // Dimensions from the slowest varying in.
            let slow_first: Vec<usize> = match order {
                Order::C => (0..n).collect(),
                Order::Fortran => (0..n).rev().collect(),
            };
            let total: u64 = subsizes.iter().product();
            for mut linear in 0..total {
                // Decode the linear index, fastest dimension last.
                let mut index = vec![0u64; n];
                for &d in slow_first.iter().rev() {
                    index[d] = linear % subsizes[d];
                    linear /= subsizes[d];
                }
                // Element number inside the whole array.
                let mut element: i64 = 0;
                for &d in &slow_first {
                    element = element * sizes[d] as i64 + (starts[d] + index[d]) as i64;
                }
                map.append(&sub, element * ext);
            }
            let whole: i64 = sizes.iter().product::<u64>() as i64 * ext;
            map.lb_marker = Some(0);
            map.ub_marker = Some(whole);
        }
        Constructor::Resized { lb, extent, inner } => {
            let inner = typemap(inner);
            map.entries = inner.entries;
            map.align = inner.align;
            map.lb_marker = Some(*lb);
            map.ub_marker = Some(lb + extent);
        }
    }
    map
}

/// Appends runs of `(copies, byte offset of the first)` of `inner`, the
/// copies of a run one extent apart.
fn runs(map: &mut Typemap, inner: &Datatype, runs: impl IntoIterator<Item = (u64, i64)>) {
    let (sub, ext) = sub(inner);
    for (copies, start) in runs {
        for j in 0..copies as i64 {
            map.append(&sub, start + j * ext);
        }
    }
}

fn sub(inner: &Datatype) -> (Typemap, i64) {
    let map = typemap(inner);
    let ext = map.extent();
    (map, ext)
}

/// The byte offsets `count` elements name, in pack order.
pub fn byte_offsets(map: &Typemap, count: u64) -> Vec<i64> {
    let ext = map.extent();
    let mut out = Vec::new();
    for i in 0..count as i64 {
        for &(at, len) in &map.entries {
            out.extend((0..len as i64).map(|k| i * ext + at + k));
        }
    }
    out
}
