//! Where the memory of a measurement comes from: the driver's DMA arena, or
//! the program's own heap (a plain `Vec`, registered like any user memory).
//! The figure programs take the kind as a parameter, so that every figure
//! can be measured on both and compared in one run.

use std::fmt;

use pindown_driver::verbs::{Context, MemoryRegion, VerbsError};
use pindown_driver::DmaBuffer;
use serde::Serialize;

/// A kind of memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum MemoryKind {
    /// Buffers from the context's DMA arena ([`Context::alloc`]).
    Arena,
    /// A `Vec` of the program's heap, registered where it lies.
    Heap,
}

impl MemoryKind {
    /// `"arena"` or `"heap"`.
    pub fn name(self) -> &'static str {
        match self {
            MemoryKind::Arena => "arena",
            MemoryKind::Heap => "heap",
        }
    }
}

impl fmt::Display for MemoryKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

enum Storage {
    Arena(DmaBuffer),
    /// Owns the bytes, over-allocated by one page so that the buffer can
    /// start page aligned; reached through the buffer's address only.
    Heap {
        _bytes: Vec<u8>,
    },
}

/// A buffer of one [`MemoryKind`], page aligned. The device may write it
/// while requests are in flight, so it is only read and written through
/// copies (never borrowed as a slice).
pub struct TestBuffer {
    storage: Storage,
    addr: u64,
    len: usize,
}

const PAGE: usize = 4096;

impl TestBuffer {
    /// A zeroed buffer of `len` bytes of `kind`, for `context`'s device.
    pub fn new(context: &Context, kind: MemoryKind, len: usize) -> Result<Self, VerbsError> {
        let (storage, addr) = match kind {
            MemoryKind::Arena => {
                let buffer = context.alloc(len, PAGE)?;
                buffer.fill(0);
                let addr = buffer.iova();
                (Storage::Arena(buffer), addr)
            }
            MemoryKind::Heap => {
                let mut vec = vec![0u8; len + PAGE];
                let start = vec.as_mut_ptr() as usize;
                let addr = start.next_multiple_of(PAGE) as u64;
                (Storage::Heap { _bytes: vec }, addr)
            }
        };
        Ok(TestBuffer { storage, addr, len })
    }

    /// Address of the first byte (what registration and requests name).
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Registers `[offset, offset + len)` with `context`; the region
    /// borrows the buffer.
    pub fn register_part<'a>(
        &'a self,
        context: &'a Context,
        offset: usize,
        len: usize,
    ) -> Result<MemoryRegion<'a>, VerbsError> {
        self.check(offset, len);
        // SAFETY: inside the buffer (checked), which the region borrows,
        // so it stays allocated while the region lives; the buffer's bytes
        // are reached only through raw copies, which tolerate the device.
        unsafe { context.register(self.addr + offset as u64, len as u64) }
    }

    fn check(&self, offset: usize, len: usize) {
        assert!(
            offset.checked_add(len).is_some_and(|end| end <= self.len),
            "[{offset}, +{len}) is outside the {}-byte buffer",
            self.len
        );
    }

    /// Copies `bytes` in at `offset`.
    pub fn write_at(&self, offset: usize, bytes: &[u8]) {
        self.check(offset, bytes.len());
        match &self.storage {
            Storage::Arena(buffer) => buffer.write_at(offset, bytes),
            // SAFETY: inside the buffer (checked), which the Vec owns for
            // as long as `self` lives; a raw copy, since the device may
            // access the same bytes.
            Storage::Heap { .. } => unsafe {
                std::ptr::copy_nonoverlapping(
                    bytes.as_ptr(),
                    (self.addr as *mut u8).add(offset),
                    bytes.len(),
                )
            },
        }
    }

    /// Copies `out.len()` bytes out from `offset`.
    pub fn read_at(&self, offset: usize, out: &mut [u8]) {
        self.check(offset, out.len());
        match &self.storage {
            Storage::Arena(buffer) => buffer.read_at(offset, out),
            // SAFETY: as in `write_at`.
            Storage::Heap { .. } => unsafe {
                std::ptr::copy_nonoverlapping(
                    (self.addr as *const u8).add(offset),
                    out.as_mut_ptr(),
                    out.len(),
                )
            },
        }
    }
}
