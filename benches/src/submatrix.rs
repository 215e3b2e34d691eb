//! DIMMnet-2's submatrix transfer (paper sections 2.1 and 5): a
//! [`ROWS`] x (z + 1) matrix of doubles (each row of z doubles padded by
//! one, as the paper did), stored row by row, of which the m x n submatrix
//! at the top left moves into another matrix of the same shape; in MPI
//! terms `MPI_Type_vector(m, n, z + 1, MPI_DOUBLE)`.
//!
//! The host-side ways of moving it (pack into a contiguous buffer, unpack
//! out of one, the one-pass strided-to-strided copy), the values a source
//! matrix holds and the check of a target, and the cache eviction the
//! paper did before each pack and unpack ("cold": the lines a sample
//! touches are flushed and a buffer is streamed through first; see
//! [`Evictor`]).
//!
//! The copies work on raw pointers into memory the emulated NIC also
//! reaches: callers run them only while no request touching that memory is
//! in flight.

use pindown_uapi::pattern::{Pattern, Piece};
use serde::Serialize;

/// Rows of the matrix (the paper's 4096).
pub const ROWS: usize = 4096;
/// Bytes of one element (`MPI_DOUBLE`).
pub const ELEMENT: usize = 8;
/// What a target element holds before a transfer (the bits of -1.0, as the
/// MPI program's sentinel).
pub const SENTINEL: u64 = 0xbff0_0000_0000_0000;

/// One submatrix transfer: the matrix's row length `z` (padded to z + 1)
/// and the submatrix's `m` rows of `n` elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Shape {
    /// Elements of a matrix row before padding.
    pub z: usize,
    /// Rows of the submatrix.
    pub m: usize,
    /// Elements of each submatrix row.
    pub n: usize,
}

impl Shape {
    /// A shape, if the submatrix fits the matrix (`1 <= m <= ROWS`,
    /// `1 <= n <= z`).
    pub fn new(z: usize, m: usize, n: usize) -> Option<Shape> {
        ((1..=ROWS).contains(&m) && (1..=z).contains(&n)).then_some(Shape { z, m, n })
    }

    /// Elements from one matrix row to the next (z + 1).
    pub fn leading(&self) -> usize {
        self.z + 1
    }

    /// Bytes from one matrix row to the next.
    pub fn row_bytes(&self) -> usize {
        self.leading() * ELEMENT
    }

    /// Bytes of one submatrix row.
    pub fn block_bytes(&self) -> usize {
        self.n * ELEMENT
    }

    /// Bytes the transfer moves (m x n elements).
    pub fn bytes(&self) -> usize {
        self.m * self.block_bytes()
    }

    /// Bytes of a whole matrix of this `z`.
    pub fn matrix_bytes(z: usize) -> usize {
        ROWS * (z + 1) * ELEMENT
    }

    /// The submatrix as an access pattern from the matrix's first byte
    /// (what a vector transfer names on either side): `m` blocks of
    /// `n` elements, one matrix row apart.
    pub fn pattern(&self) -> Pattern {
        Pattern::new(
            vec![Piece::vector(
                0,
                self.block_bytes() as u64,
                self.m as u64,
                self.row_bytes() as i64,
            )],
            1,
            0,
        )
        .expect("a submatrix's pattern does not overflow")
    }
}

/// Elements of `packed` (the submatrix of `shape`, packed row after row)
/// that do not hold their [`value_at`].
///
/// # Safety
/// `packed` holds `shape.bytes()` readable bytes, 8-byte aligned, that
/// nothing writes meanwhile.
pub unsafe fn check_packed(packed: *const u8, shape: Shape) -> usize {
    let words = packed as *const u64;
    (0..shape.m * shape.n)
        .filter(|&k| {
            // SAFETY: k < m * n, inside `packed` (the caller's contract).
            unsafe { words.add(k).read() != value_at(k / shape.n, k % shape.n) }
        })
        .count()
}

/// The bits of element (row, col) of a source matrix: unique, and the same
/// value the MPI program uses (`row * 65536 + col + 0.25`).
pub fn value_at(row: usize, col: usize) -> u64 {
    ((row * 65536 + col) as f64 + 0.25).to_bits()
}

/// A matrix of `z` (padded) at `base`, `ROWS` rows.
#[derive(Clone, Copy, Debug)]
pub struct Matrix {
    base: *mut u8,
    z: usize,
}

impl Matrix {
    /// The matrix of `z` at `base`.
    ///
    /// # Safety
    /// `base` is 8-byte aligned and [`Shape::matrix_bytes`]`(z)` bytes
    /// from it are mapped, writable and reached by nothing else while
    /// the methods of this value run.
    pub unsafe fn new(base: *mut u8, z: usize) -> Matrix {
        Matrix { base, z }
    }

    fn element(&self, row: usize, col: usize) -> *mut u64 {
        debug_assert!(row < ROWS && col <= self.z);
        // SAFETY: inside the matrix (row < ROWS, col <= z), which `new`'s
        // contract keeps mapped; aligned, since base and the offset are.
        unsafe { self.base.add((row * (self.z + 1) + col) * ELEMENT) as *mut u64 }
    }

    /// The submatrix of `shape` as (start, bytes) blocks, one per row: the
    /// memory a transfer of it reads or writes here.
    pub fn blocks(&self, shape: Shape) -> impl Iterator<Item = (*const u8, usize)> + '_ {
        (0..shape.m).map(move |row| (self.element(row, 0) as *const u8, shape.block_bytes()))
    }

    /// Fills every element with [`value_at`].
    pub fn fill_source(&self) {
        for row in 0..ROWS {
            for col in 0..=self.z {
                // SAFETY: in bounds (see `element`), no one else accesses it.
                unsafe { self.element(row, col).write(value_at(row, col)) };
            }
        }
    }

    /// Writes [`SENTINEL`] over the submatrix of `shape` and the elements
    /// [`check_target`](Self::check_target) looks at around it.
    pub fn reset_target(&self, shape: Shape) {
        let rows = (shape.m + 1).min(ROWS);
        let cols = (shape.n + 1).min(self.z + 1);
        for row in 0..rows {
            for col in 0..cols {
                // SAFETY: in bounds, no one else accesses it.
                unsafe { self.element(row, col).write(SENTINEL) };
            }
        }
    }

    /// Elements that are wrong after the submatrix of `shape` was moved
    /// in: each element of the submatrix must hold [`value_at`], and the
    /// element after each of its rows and each element of the row after
    /// it must still hold [`SENTINEL`] (nothing was written outside).
    pub fn check_target(&self, shape: Shape) -> usize {
        let mut wrong = 0;
        for row in 0..shape.m {
            for col in 0..shape.n {
                // SAFETY: in bounds, no one else accesses it.
                wrong +=
                    usize::from(unsafe { self.element(row, col).read() } != value_at(row, col));
            }
            if shape.n <= self.z {
                // SAFETY: as above (col = n <= z).
                wrong += usize::from(unsafe { self.element(row, shape.n).read() } != SENTINEL);
            }
        }
        if shape.m < ROWS {
            for col in 0..shape.n {
                // SAFETY: as above (row = m < ROWS).
                wrong += usize::from(unsafe { self.element(shape.m, col).read() } != SENTINEL);
            }
        }
        wrong
    }
}

/// Copies the submatrix of `shape` out of `matrix` into `packed`
/// (`shape.bytes()` bytes, row after row): the host's pack.
///
/// # Safety
/// `packed` holds `shape.bytes()` writable bytes reached by nothing else,
/// not overlapping the matrix.
pub unsafe fn pack(matrix: &Matrix, shape: Shape, packed: *mut u8) {
    let block = shape.block_bytes();
    for row in 0..shape.m {
        // SAFETY: the row's block lies in the matrix (n <= z) and the
        // destination in `packed` (row < m); they do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                matrix.element(row, 0) as *const u8,
                packed.add(row * block),
                block,
            )
        };
    }
}

/// Copies `packed` into the submatrix of `shape` of `matrix`: the host's
/// unpack.
///
/// # Safety
/// As for [`pack`], with `packed` readable.
pub unsafe fn unpack(packed: *const u8, shape: Shape, matrix: &Matrix) {
    let block = shape.block_bytes();
    for row in 0..shape.m {
        // SAFETY: as in `pack`, the other way round.
        unsafe {
            std::ptr::copy_nonoverlapping(
                packed.add(row * block),
                matrix.element(row, 0) as *mut u8,
                block,
            )
        };
    }
}

/// Copies the submatrix of `shape` from `from` into `to` in one pass, row
/// by row, on one core: the physical limit of a strided-to-strided move.
pub fn copy_strided(from: &Matrix, to: &Matrix, shape: Shape) {
    assert_eq!(from.z, to.z, "both matrices have the same shape");
    let block = shape.block_bytes();
    for row in 0..shape.m {
        // SAFETY: the blocks lie in their matrices (`Matrix::new`'s
        // contract); two matrices do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                from.element(row, 0) as *const u8,
                to.element(row, 0) as *mut u8,
                block,
            )
        };
    }
}

/// The last-level cache's size in bytes, from sysfs (the largest cache of
/// CPU 0); `None` if sysfs does not say.
pub fn last_level_cache_bytes() -> Option<usize> {
    let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    dir.flatten()
        .filter_map(|entry| {
            let size = std::fs::read_to_string(entry.path().join("size")).ok()?;
            parse_cache_size(size.trim())
        })
        .max()
}

/// `"32768K"`, `"2M"` or `"512"` in bytes.
fn parse_cache_size(text: &str) -> Option<usize> {
    let (digits, unit) = match text.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => text.split_at(i),
        None => (text, ""),
    };
    let number: usize = digits.parse().ok()?;
    let scale = match unit {
        "" => 1,
        "K" => 1 << 10,
        "M" => 1 << 20,
        "G" => 1 << 30,
        _ => return None,
    };
    number.checked_mul(scale)
}

/// Makes the next step start cold (the paper's "dummy access" before each
/// pack and unpack): the lines of the step's own memory are flushed from
/// every cache level of every core (`clflush`), and a buffer is streamed
/// through, one word of every line, which empties this thread's TLB and
/// private caches. Not flushed: the TLB of another thread doing the step
/// (the device's, for a vector transfer), and page-table lines held in a
/// shared cache larger than the buffer.
///
/// Flushing the footprint makes the data cold whatever the last-level
/// cache's size: a streamed buffer alone must be larger than that cache,
/// and a virtual machine may report one of hundreds of megabytes (shared by
/// the host's cores), which made every cold sample stream a gigabyte.
pub struct Evictor {
    words: Vec<u64>,
    round: u64,
    /// Ranges flushed line by line (start, bytes).
    footprint: Vec<(*const u8, usize)>,
}

/// Bytes of a cache line.
const LINE: usize = 64;

impl Evictor {
    /// An evictor streaming `bytes`, with no footprint yet.
    pub fn new(bytes: usize) -> Evictor {
        Evictor {
            words: vec![1; bytes.div_ceil(8)],
            round: 0,
            footprint: Vec::new(),
        }
    }

    /// Bytes streamed through per [`evict`](Self::evict).
    pub fn bytes(&self) -> usize {
        self.words.len() * 8
    }

    /// Sets the ranges each [`evict`](Self::evict) flushes from then on.
    ///
    /// # Safety
    /// Every range stays mapped until the footprint is set again or the
    /// evictor is dropped.
    pub unsafe fn set_footprint(&mut self, ranges: Vec<(*const u8, usize)>) {
        self.footprint = ranges;
    }

    /// Writes one word of every cache line of the buffer, so that each
    /// line is fetched and left dirty, displacing what the caches held;
    /// then flushes every line of the footprint.
    pub fn evict(&mut self) {
        self.round += 1;
        let round = self.round;
        for line in self.words.chunks_mut(LINE / 8) {
            // Volatile, so that the stores are not merged away.
            // SAFETY: a pointer to the first element of a non-empty chunk.
            unsafe { std::ptr::write_volatile(line.as_mut_ptr(), round) };
        }
        for &(start, bytes) in &self.footprint {
            // SAFETY: `set_footprint`'s contract keeps the range mapped.
            unsafe { flush_lines(start, bytes) };
        }
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a fence has no memory operands (SSE2 is baseline on
        // x86_64).
        unsafe {
            std::arch::x86_64::_mm_mfence()
        };
    }
}

/// Flushes every cache line of `bytes` bytes from `start` out of every
/// level of the cache hierarchy (x86_64; elsewhere nothing: the streamed
/// buffer alone evicts).
///
/// # Safety
/// The range is mapped.
unsafe fn flush_lines(start: *const u8, bytes: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        let first = start as usize & !(LINE - 1);
        let end = start as usize + bytes;
        for line in (first..end).step_by(LINE) {
            // SAFETY: `line` lies in the range's first line or inside the
            // range, mapped by the caller's contract (a line never spans
            // two pages, so the line below `start` is on `start`'s page).
            unsafe { std::arch::x86_64::_mm_clflush(line as *const u8) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (start, bytes);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matrix_of(storage: &mut [u64], z: usize) -> Matrix {
        assert!(storage.len() * 8 >= Shape::matrix_bytes(z));
        // SAFETY: the storage is large enough, aligned, and borrowed
        // mutably for the matrix's use in the test.
        unsafe { Matrix::new(storage.as_mut_ptr() as *mut u8, z) }
    }

    #[test]
    fn pack_then_unpack_moves_exactly_the_submatrix() {
        let z = 9;
        let mut a = vec![0u64; Shape::matrix_bytes(z) / 8];
        let mut b = vec![0u64; Shape::matrix_bytes(z) / 8];
        let (from, to) = (matrix_of(&mut a, z), matrix_of(&mut b, z));
        from.fill_source();
        for (m, n) in [(1, 1), (3, 2), (ROWS, 9), (ROWS - 1, 1)] {
            let shape = Shape::new(z, m, n).unwrap();
            to.reset_target(shape);
            let mut packed = vec![0u64; shape.bytes() / 8];
            // SAFETY: `packed` holds shape.bytes() bytes of its own.
            unsafe { pack(&from, shape, packed.as_mut_ptr() as *mut u8) };
            assert_eq!(packed[0], value_at(0, 0));
            assert_eq!(packed[n - 1], value_at(0, n - 1));
            if m > 1 {
                assert_eq!(packed[n], value_at(1, 0));
            }
            // SAFETY: as above.
            unsafe { unpack(packed.as_ptr() as *const u8, shape, &to) };
            assert_eq!(to.check_target(shape), 0, "{shape:?}");
            to.reset_target(shape);
            assert!(to.check_target(shape) >= m * n, "a reset target fails");
            copy_strided(&from, &to, shape);
            assert_eq!(to.check_target(shape), 0, "{shape:?}");
        }
    }

    #[test]
    fn a_write_outside_the_submatrix_is_found() {
        let z = 4;
        let mut a = vec![0u64; Shape::matrix_bytes(z) / 8];
        let mut b = vec![0u64; Shape::matrix_bytes(z) / 8];
        let (from, to) = (matrix_of(&mut a, z), matrix_of(&mut b, z));
        from.fill_source();
        let shape = Shape::new(z, 5, 2).unwrap();
        to.reset_target(shape);
        // One element too many per row: the column after the submatrix.
        copy_strided(&from, &to, Shape::new(z, 5, 3).unwrap());
        assert_eq!(to.check_target(shape), 5);
    }

    #[test]
    fn packed_check_and_pattern() {
        let z = 7;
        let mut a = vec![0u64; Shape::matrix_bytes(z) / 8];
        let from = matrix_of(&mut a, z);
        from.fill_source();
        let shape = Shape::new(z, 6, 3).unwrap();
        let mut packed = vec![0u64; shape.bytes() / 8];
        // SAFETY: `packed` holds shape.bytes() bytes of its own.
        unsafe { pack(&from, shape, packed.as_mut_ptr() as *mut u8) };
        // SAFETY: as above.
        assert_eq!(
            unsafe { check_packed(packed.as_ptr() as *const u8, shape) },
            0
        );
        packed[4] ^= 1;
        // SAFETY: as above.
        assert_eq!(
            unsafe { check_packed(packed.as_ptr() as *const u8, shape) },
            1
        );
        // The pattern's bytes are the packed bytes, in order.
        let pattern = shape.pattern();
        assert_eq!(pattern.len, shape.bytes() as u64);
        let plan = pattern.plan().unwrap();
        let hull = plan.hull().unwrap();
        assert_eq!(
            hull,
            (0, (5 * shape.row_bytes() + shape.block_bytes()) as i64)
        );
    }

    #[test]
    fn shapes_and_cache_sizes() {
        let shape = Shape::new(4096, 4096, 16).unwrap();
        assert_eq!(shape.row_bytes(), 4097 * 8);
        assert_eq!(shape.bytes(), 4096 * 16 * 8);
        assert!(Shape::new(16, 1, 17).is_none());
        assert!(Shape::new(16, ROWS + 1, 1).is_none());
        assert!(Shape::new(16, 0, 1).is_none());
        assert_eq!(parse_cache_size("32768K"), Some(32 << 20));
        assert_eq!(parse_cache_size("2M"), Some(2 << 20));
        assert_eq!(parse_cache_size("512"), Some(512));
        assert_eq!(parse_cache_size("x"), None);
        let mut evictor = Evictor::new(1 << 16);
        let footprint = vec![7u64; 100];
        // SAFETY: `footprint` outlives the evictor's uses below.
        unsafe { evictor.set_footprint(vec![(footprint.as_ptr().cast(), 800)]) };
        evictor.evict();
        evictor.evict();
        // Flushing leaves the bytes as they were.
        assert!(footprint.iter().all(|&w| w == 7));
        assert_eq!(evictor.bytes(), 1 << 16);
        // One word of every line written each round, the others untouched.
        assert_eq!(evictor.words[0], 2);
        assert_eq!(evictor.words[LINE / 8], 2);
        assert_eq!(evictor.words[1], 1);
    }
}
