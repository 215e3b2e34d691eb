//! Datatypes as MPI builds them: a tree of constructors over primitive
//! types, each node knowing its size, lower and upper bound (extent) and
//! true bounds, computed once when the node is built.

use std::sync::Arc;

use super::DatatypeError;

/// Constructors a datatype may nest, at most (a basic type is depth 0):
/// far beyond what programs build, and shallow enough that the recursive
/// walks of commit and drop fit any thread's stack.
pub const MAX_DEPTH: u32 = 256;

/// Storage order of a subarray's dimensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Order {
    /// Row-major: the last dimension varies fastest (`MPI_ORDER_C`).
    C,
    /// Column-major: the first dimension varies fastest (`MPI_ORDER_FORTRAN`).
    Fortran,
}

/// One field of a struct type: `block` elements of `datatype` at
/// `displacement` bytes.
#[derive(Clone, Debug)]
pub struct Field {
    /// Elements of the field's type, one extent apart.
    pub block: u64,
    /// Bytes from the struct's origin to the field's first element.
    pub displacement: i64,
    /// The field's type.
    pub datatype: Datatype,
}

/// How a datatype was built: the MPI constructor and its arguments.
/// Displacements and strides are in elements of the inner type's extent
/// for the `Vector`, `Indexed` and `IndexedBlock` forms and in bytes for
/// the `H` forms, as in MPI.
#[derive(Clone, Debug)]
pub enum Constructor {
    /// `size` contiguous bytes with no inner structure (a basic type).
    Primitive {
        /// Bytes.
        size: u64,
        /// Alignment in bytes (1 for raw bytes): a struct's extent is
        /// rounded up to a multiple of the largest alignment in it.
        align: u64,
    },
    /// `count` elements, one extent apart (`MPI_Type_contiguous`).
    Contiguous {
        /// Elements.
        count: u64,
        /// Element type.
        inner: Datatype,
    },
    /// `count` blocks of `block` elements, `stride` element extents apart
    /// (`MPI_Type_vector`).
    Vector {
        /// Blocks.
        count: u64,
        /// Elements per block.
        block: u64,
        /// Element extents from one block to the next.
        stride: i64,
        /// Element type.
        inner: Datatype,
    },
    /// `count` blocks of `block` elements, `stride` bytes apart
    /// (`MPI_Type_create_hvector`).
    Hvector {
        /// Blocks.
        count: u64,
        /// Elements per block.
        block: u64,
        /// Bytes from one block to the next.
        stride: i64,
        /// Element type.
        inner: Datatype,
    },
    /// Blocks of `(elements, displacement in element extents)`
    /// (`MPI_Type_indexed`).
    Indexed {
        /// The blocks, in order.
        blocks: Vec<(u64, i64)>,
        /// Element type.
        inner: Datatype,
    },
    /// Blocks of `(elements, displacement in bytes)`
    /// (`MPI_Type_create_hindexed`).
    Hindexed {
        /// The blocks, in order.
        blocks: Vec<(u64, i64)>,
        /// Element type.
        inner: Datatype,
    },
    /// Blocks of `block` elements at displacements in element extents
    /// (`MPI_Type_create_indexed_block`).
    IndexedBlock {
        /// Elements per block.
        block: u64,
        /// Displacements, in order.
        displacements: Vec<i64>,
        /// Element type.
        inner: Datatype,
    },
    /// Blocks of `block` elements at displacements in bytes
    /// (`MPI_Type_create_hindexed_block`).
    HindexedBlock {
        /// Elements per block.
        block: u64,
        /// Displacements, in order.
        displacements: Vec<i64>,
        /// Element type.
        inner: Datatype,
    },
    /// Fields of possibly different types (`MPI_Type_create_struct`).
    Struct {
        /// The fields, in order.
        fields: Vec<Field>,
    },
    /// A subarray of a multidimensional array of `inner`
    /// (`MPI_Type_create_subarray`): its lower bound is the array's first
    /// byte and its extent the whole array's.
    Subarray {
        /// Elements of the whole array in each dimension.
        sizes: Vec<u64>,
        /// Elements of the subarray in each dimension.
        subsizes: Vec<u64>,
        /// First element of the subarray in each dimension.
        starts: Vec<u64>,
        /// Storage order.
        order: Order,
        /// Element type.
        inner: Datatype,
    },
    /// The same bytes with another lower bound and extent
    /// (`MPI_Type_create_resized`).
    Resized {
        /// The new lower bound.
        lb: i64,
        /// The new extent.
        extent: i64,
        /// The type resized.
        inner: Datatype,
    },
}

/// A datatype: an immutable, reference-counted tree of [`Constructor`]s.
/// Cloning is cheap (the tree is shared). See the
/// [module documentation](super) for its semantics.
#[derive(Clone, Debug)]
pub struct Datatype(Arc<Node>);

#[derive(Debug)]
struct Node {
    constructor: Constructor,
    bounds: Bounds,
}

/// The typemap facts of a datatype.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Bounds {
    pub(crate) size: u64,
    pub(crate) lb: i64,
    pub(crate) ub: i64,
    /// Whether the bounds come from explicit markers ([`Datatype::resized`],
    /// [`Datatype::subarray`]), which take precedence over natural bounds
    /// wherever the type is used.
    pub(crate) marked: bool,
    /// Lowest byte and one past the highest byte; `(0, 0)` when `size` is 0.
    pub(crate) true_lb: i64,
    pub(crate) true_ub: i64,
    /// The largest alignment of a basic type in it.
    pub(crate) align: u64,
    /// Constructors nested in it, itself included (0 for a basic type).
    pub(crate) depth: u32,
}

/// Copies of one type at `displacement + sum(i_k * stride_k)`, `i_k <
/// count_k`, the first loop innermost: the common form every constructor
/// lowers to (a struct or an indexed type lowers to one group per field or
/// block).
#[derive(Clone, Debug)]
pub(crate) struct Group<'t> {
    pub(crate) displacement: i64,
    pub(crate) element: &'t Datatype,
    pub(crate) loops: Vec<(u64, i64)>,
}

fn to_i64(value: i128, what: &'static str) -> Result<i64, DatatypeError> {
    i64::try_from(value).map_err(|_| DatatypeError::Overflow(what))
}

impl Datatype {
    fn build(constructor: Constructor) -> Result<Datatype, DatatypeError> {
        let bounds = compute_bounds(&constructor)?;
        Ok(Datatype(Arc::new(Node {
            constructor,
            bounds,
        })))
    }

    /// A basic type of `size` bytes aligned to `align` (lower bound 0,
    /// extent `size`). Above `i64::MAX` bytes its bounds stop at
    /// `i64::MAX`, and a pattern of it fails with
    /// [`DatatypeError::Overflow`].
    pub fn aligned(size: u64, align: u64) -> Datatype {
        let top = i64::try_from(size).unwrap_or(i64::MAX);
        Datatype(Arc::new(Node {
            constructor: Constructor::Primitive { size, align },
            bounds: Bounds {
                size,
                lb: 0,
                ub: top,
                marked: false,
                true_lb: 0,
                true_ub: top,
                align: align.max(1),
                depth: 0,
            },
        }))
    }

    /// `size` raw bytes as one basic type (alignment 1, like
    /// `MPI_Type_contiguous(size, MPI_BYTE)`).
    pub fn primitive(size: u64) -> Datatype {
        Datatype::aligned(size, 1)
    }

    /// The basic type of a Rust value of type `T`: its size and alignment
    /// (MPI packs basic types as their bytes in memory order).
    pub fn of<T: Copy>() -> Datatype {
        Datatype::aligned(
            std::mem::size_of::<T>() as u64,
            std::mem::align_of::<T>() as u64,
        )
    }

    /// One byte (`MPI_BYTE`).
    pub fn byte() -> Datatype {
        Datatype::primitive(1)
    }

    /// `MPI_DOUBLE`.
    pub fn f64() -> Datatype {
        Datatype::of::<f64>()
    }

    /// `MPI_FLOAT`.
    pub fn f32() -> Datatype {
        Datatype::of::<f32>()
    }

    /// `MPI_INT64_T`.
    pub fn i64() -> Datatype {
        Datatype::of::<i64>()
    }

    /// `MPI_INT`.
    pub fn i32() -> Datatype {
        Datatype::of::<i32>()
    }

    /// `MPI_SHORT`.
    pub fn i16() -> Datatype {
        Datatype::of::<i16>()
    }

    /// `count` copies of `inner`, one extent apart.
    pub fn contiguous(count: u64, inner: &Datatype) -> Result<Datatype, DatatypeError> {
        Datatype::build(Constructor::Contiguous {
            count,
            inner: inner.clone(),
        })
    }

    /// `count` blocks of `block` copies of `inner`, block starts `stride`
    /// extents of `inner` apart.
    pub fn vector(
        count: u64,
        block: u64,
        stride: i64,
        inner: &Datatype,
    ) -> Result<Datatype, DatatypeError> {
        Datatype::build(Constructor::Vector {
            count,
            block,
            stride,
            inner: inner.clone(),
        })
    }

    /// `count` blocks of `block` copies of `inner`, block starts `stride`
    /// bytes apart.
    pub fn hvector(
        count: u64,
        block: u64,
        stride: i64,
        inner: &Datatype,
    ) -> Result<Datatype, DatatypeError> {
        Datatype::build(Constructor::Hvector {
            count,
            block,
            stride,
            inner: inner.clone(),
        })
    }

    /// Blocks of `(copies, displacement in extents of inner)`.
    pub fn indexed(blocks: &[(u64, i64)], inner: &Datatype) -> Result<Datatype, DatatypeError> {
        Datatype::build(Constructor::Indexed {
            blocks: blocks.to_vec(),
            inner: inner.clone(),
        })
    }

    /// Blocks of `(copies, displacement in bytes)`.
    pub fn hindexed(blocks: &[(u64, i64)], inner: &Datatype) -> Result<Datatype, DatatypeError> {
        Datatype::build(Constructor::Hindexed {
            blocks: blocks.to_vec(),
            inner: inner.clone(),
        })
    }

    /// Blocks of `block` copies at `displacements` in extents of inner.
    pub fn indexed_block(
        block: u64,
        displacements: &[i64],
        inner: &Datatype,
    ) -> Result<Datatype, DatatypeError> {
        Datatype::build(Constructor::IndexedBlock {
            block,
            displacements: displacements.to_vec(),
            inner: inner.clone(),
        })
    }

    /// Blocks of `block` copies at `displacements` in bytes.
    pub fn hindexed_block(
        block: u64,
        displacements: &[i64],
        inner: &Datatype,
    ) -> Result<Datatype, DatatypeError> {
        Datatype::build(Constructor::HindexedBlock {
            block,
            displacements: displacements.to_vec(),
            inner: inner.clone(),
        })
    }

    /// A struct of `fields`. As MPI implementations do, its extent is
    /// rounded up to a multiple of the largest alignment of a basic type
    /// in it (unless a field carries explicit bounds); make sure of a C
    /// struct's `size_of` with [`Datatype::resized`].
    pub fn structure(fields: &[Field]) -> Result<Datatype, DatatypeError> {
        Datatype::build(Constructor::Struct {
            fields: fields.to_vec(),
        })
    }

    /// The subarray `starts .. starts + subsizes` of an array of `sizes`
    /// elements of `inner`, dimensions stored in `order`.
    pub fn subarray(
        sizes: &[u64],
        subsizes: &[u64],
        starts: &[u64],
        order: Order,
        inner: &Datatype,
    ) -> Result<Datatype, DatatypeError> {
        if sizes.is_empty() || sizes.len() != subsizes.len() || sizes.len() != starts.len() {
            return Err(DatatypeError::Invalid(
                "subarray needs one size, subsize and start per dimension",
            ));
        }
        for ((&size, &sub), &start) in sizes.iter().zip(subsizes).zip(starts) {
            if size == 0 || u128::from(sub) + u128::from(start) > u128::from(size) {
                return Err(DatatypeError::Invalid(
                    "subarray dimension: size 0, or start + subsize past the size",
                ));
            }
        }
        Datatype::build(Constructor::Subarray {
            sizes: sizes.to_vec(),
            subsizes: subsizes.to_vec(),
            starts: starts.to_vec(),
            order,
            inner: inner.clone(),
        })
    }

    /// The bytes of `inner` with lower bound `lb` and extent `extent`.
    pub fn resized(inner: &Datatype, lb: i64, extent: i64) -> Result<Datatype, DatatypeError> {
        Datatype::build(Constructor::Resized {
            lb,
            extent,
            inner: inner.clone(),
        })
    }

    /// How it was built.
    pub fn constructor(&self) -> &Constructor {
        &self.0.constructor
    }

    /// Bytes of data (`MPI_Type_size`).
    pub fn size(&self) -> u64 {
        self.0.bounds.size
    }

    /// Lower bound (`MPI_Type_get_extent`).
    pub fn lb(&self) -> i64 {
        self.0.bounds.lb
    }

    /// Upper bound: lower bound plus extent.
    pub fn ub(&self) -> i64 {
        self.0.bounds.ub
    }

    /// Extent: the distance from one element to the next when repeated.
    pub fn extent(&self) -> i64 {
        self.0.bounds.ub - self.0.bounds.lb
    }

    /// Offset of the lowest byte of data (`MPI_Type_get_true_extent`); 0
    /// for a type without data.
    pub fn true_lb(&self) -> i64 {
        self.0.bounds.true_lb
    }

    /// Bytes from the lowest to one past the highest byte of data.
    pub fn true_extent(&self) -> i64 {
        self.0.bounds.true_ub - self.0.bounds.true_lb
    }

    pub(crate) fn bounds(&self) -> Bounds {
        self.0.bounds
    }

    /// The constructor lowered to groups of copies (see [`Group`]).
    pub(crate) fn groups(&self) -> Result<Vec<Group<'_>>, DatatypeError> {
        groups(&self.0.constructor)
    }

    /// Whether both are the same node (not a structural comparison).
    pub fn same(&self, other: &Datatype) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// `elements` extents in bytes, for a displacement or stride of `copies`
/// copies: with none, it names nothing and is 0 whatever its size (as MPI
/// accepts a vector of no blocks with any stride).
fn scaled(copies: u64, elements: i64, extent: i64) -> Result<i64, DatatypeError> {
    if copies == 0 {
        return Ok(0);
    }
    to_i64(
        i128::from(elements) * i128::from(extent),
        "displacement in extents",
    )
}

fn groups(constructor: &Constructor) -> Result<Vec<Group<'_>>, DatatypeError> {
    let group = |displacement, element, loops| Group {
        displacement,
        element,
        loops,
    };
    Ok(match constructor {
        Constructor::Primitive { .. } => Vec::new(),
        Constructor::Contiguous { count, inner } => {
            vec![group(0, inner, vec![(*count, inner.extent())])]
        }
        Constructor::Vector {
            count,
            block,
            stride,
            inner,
        } => vec![group(
            0,
            inner,
            vec![
                (*block, inner.extent()),
                (
                    *count,
                    scaled(count.saturating_mul(*block), *stride, inner.extent())?,
                ),
            ],
        )],
        Constructor::Hvector {
            count,
            block,
            stride,
            inner,
        } => vec![group(
            0,
            inner,
            vec![(*block, inner.extent()), (*count, *stride)],
        )],
        Constructor::Indexed { blocks, inner } => blocks
            .iter()
            .map(|&(len, at)| {
                Ok(group(
                    scaled(len, at, inner.extent())?,
                    inner,
                    vec![(len, inner.extent())],
                ))
            })
            .collect::<Result<_, DatatypeError>>()?,
        Constructor::Hindexed { blocks, inner } => blocks
            .iter()
            .map(|&(len, at)| group(at, inner, vec![(len, inner.extent())]))
            .collect(),
        Constructor::IndexedBlock {
            block,
            displacements,
            inner,
        } => displacements
            .iter()
            .map(|&at| {
                Ok(group(
                    scaled(*block, at, inner.extent())?,
                    inner,
                    vec![(*block, inner.extent())],
                ))
            })
            .collect::<Result<_, DatatypeError>>()?,
        Constructor::HindexedBlock {
            block,
            displacements,
            inner,
        } => displacements
            .iter()
            .map(|&at| group(at, inner, vec![(*block, inner.extent())]))
            .collect(),
        Constructor::Struct { fields } => fields
            .iter()
            .map(|field| {
                group(
                    field.displacement,
                    &field.datatype,
                    vec![(field.block, field.datatype.extent())],
                )
            })
            .collect(),
        Constructor::Subarray {
            sizes,
            subsizes,
            starts,
            order,
            inner,
        } => {
            // Dimensions from the fastest varying out.
            let fastest_first: Vec<usize> = match order {
                Order::C => (0..sizes.len()).rev().collect(),
                Order::Fortran => (0..sizes.len()).collect(),
            };
            let mut stride = i128::from(inner.extent());
            let mut displacement: i128 = 0;
            let mut loops = Vec::with_capacity(sizes.len());
            for dim in fastest_first {
                let step = to_i64(stride, "subarray stride")?;
                loops.push((subsizes[dim], step));
                displacement += i128::from(starts[dim]) * stride;
                stride *= i128::from(sizes[dim]);
                to_i64(stride, "subarray extent")?;
            }
            vec![group(to_i64(displacement, "subarray start")?, inner, loops)]
        }
        Constructor::Resized { inner, .. } => vec![group(0, inner, Vec::new())],
    })
}

fn compute_bounds(constructor: &Constructor) -> Result<Bounds, DatatypeError> {
    let mut size: u64 = 0;
    let mut natural: Option<(i128, i128)> = None;
    let mut marked: Option<(i128, i128)> = None;
    let mut data: Option<(i128, i128)> = None;
    let mut align: u64 = 1;
    let widen = |range: &mut Option<(i128, i128)>, low: i128, high: i128| {
        *range = Some(match *range {
            None => (low, high),
            Some((l, h)) => (l.min(low), h.max(high)),
        });
    };
    let groups = groups(constructor)?;
    let depth = 1 + groups
        .iter()
        .map(|group| group.element.bounds().depth)
        .max()
        .unwrap_or(0);
    if depth > MAX_DEPTH {
        return Err(DatatypeError::TooDeep {
            depth,
            limit: MAX_DEPTH,
        });
    }
    for group in groups {
        let mut copies: u64 = 1;
        let (mut low, mut high) = (
            i128::from(group.displacement),
            i128::from(group.displacement),
        );
        for &(count, stride) in &group.loops {
            copies = copies
                .checked_mul(count)
                .ok_or(DatatypeError::Overflow("copies"))?;
            if count > 0 {
                let reach = i128::from(count - 1) * i128::from(stride);
                low = low.saturating_add(reach.min(0));
                high = high.saturating_add(reach.max(0));
            }
        }
        let element = group.element.bounds();
        // No copies, or copies of a type without data or markers: no
        // entries in the typemap, nothing to bound or align.
        if copies == 0 || (element.size == 0 && !element.marked) {
            continue;
        }
        align = align.max(element.align);
        size = element
            .size
            .checked_mul(copies)
            .and_then(|bytes| bytes.checked_add(size))
            .ok_or(DatatypeError::Overflow("size"))?;
        let range = if element.marked {
            &mut marked
        } else {
            &mut natural
        };
        widen(
            range,
            low.saturating_add(i128::from(element.lb)),
            high.saturating_add(i128::from(element.ub)),
        );
        if element.size > 0 {
            widen(
                &mut data,
                low.saturating_add(i128::from(element.true_lb)),
                high.saturating_add(i128::from(element.true_ub)),
            );
        }
    }
    let (true_lb, true_ub) = data.unwrap_or((0, 0));
    to_i64(true_ub - true_lb, "true extent")?;
    let (true_lb, true_ub) = (
        to_i64(true_lb, "true lower bound")?,
        to_i64(true_ub, "true upper bound")?,
    );
    let explicit = match constructor {
        Constructor::Resized { lb, extent, .. } => {
            Some((i128::from(*lb), i128::from(*lb) + i128::from(*extent)))
        }
        Constructor::Subarray { sizes, inner, .. } => {
            let whole = sizes.iter().fold(i128::from(inner.extent()), |all, &n| {
                all.saturating_mul(i128::from(n))
            });
            Some((0, whole))
        }
        _ => None,
    };
    let (is_marked, (lb, ub)) = match (explicit, marked, natural) {
        (Some(range), _, _) => (true, range),
        (None, Some(range), _) => (true, range),
        (None, None, Some((lb, ub))) if matches!(constructor, Constructor::Struct { .. }) => {
            // MPI's epsilon: the extent rounded up to the alignment.
            let align = i128::from(align);
            (false, (lb, lb + (ub - lb + align - 1) / align * align))
        }
        (None, None, Some(range)) => (false, range),
        (None, None, None) => (false, (0, 0)),
    };
    to_i64(ub - lb, "extent")?;
    Ok(Bounds {
        size,
        lb: to_i64(lb, "lower bound")?,
        ub: to_i64(ub, "upper bound")?,
        marked: is_marked,
        true_lb,
        true_ub,
        align,
        depth,
    })
}
