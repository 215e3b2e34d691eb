//! Typed builders for work requests, in the style of `io-uring`'s opcodes:
//! a constructor with the required operands, setters for the optional ones,
//! then [`build`](Write::build) into an [`Entry`] that carries the caller's
//! `user_data` and flags. An entry naming local memory borrows the
//! [`MemoryRegion`](super::MemoryRegion) its [`Local`] range was taken
//! from.
//!
//! ```
//! use pindown_driver::verbs::opcode::{FetchAdd, Nop};
//! use pindown_uapi::{RemoteAddress, RemoteKey};
//!
//! let remote = RemoteAddress { port: 1, key: RemoteKey(42), offset: 0 };
//! let add = FetchAdd::new(remote, 1).build().user_data(7).signaled();
//! assert_eq!(add.request().user_data, 7);
//! let fence = Nop::new().build().user_data(8).fence();
//! # let _ = fence;
//! ```

use std::marker::PhantomData;

use pindown_uapi::{AtomicWidth, Operation, RemoteAddress, WorkRequest, WrFlags};

use super::Local;

/// A work request ready to post; `'r` is the borrow of the memory region
/// its local range belongs to (`'static` for requests naming no local
/// memory).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry<'r> {
    request: WorkRequest,
    inline: bool,
    local: PhantomData<&'r ()>,
}

impl<'r> Entry<'r> {
    fn new(op: Operation) -> Self {
        Entry {
            request: WorkRequest {
                user_data: 0,
                flags: WrFlags::empty(),
                op,
            },
            inline: false,
            local: PhantomData,
        }
    }

    /// Sends a write's bytes inside the send queue, as a NIC's inline send
    /// does (the programmed-I/O path of small transfers): the driver copies
    /// them into the queue when the request is posted, so the source may
    /// change as soon as [`post`](super::QueuePair::post) returns, and the
    /// device neither reads the source memory nor checks that it is
    /// registered. Only writes of at most
    /// [`MAX_INLINE`](pindown_uapi::queue::MAX_INLINE) bytes from the
    /// context's DMA arena travel inline; other requests are posted as
    /// usual.
    pub fn inline(mut self) -> Self {
        self.inline = true;
        self
    }

    /// Whether [`inline`](Self::inline) was asked for.
    pub fn wants_inline(&self) -> bool {
        self.inline
    }

    /// Sets the value returned in the completion (any value).
    pub fn user_data(mut self, user_data: u64) -> Self {
        self.request.user_data = user_data;
        self
    }

    /// Asks for a completion on success too (failures always complete).
    pub fn signaled(mut self) -> Self {
        self.request.flags |= WrFlags::SIGNALED;
        self
    }

    /// Starts only after every earlier request has finished.
    pub fn fence(mut self) -> Self {
        self.request.flags |= WrFlags::FENCE;
        self
    }

    /// The encoded request.
    pub fn request(&self) -> &WorkRequest {
        &self.request
    }
}

impl From<Entry<'_>> for WorkRequest {
    fn from(entry: Entry<'_>) -> WorkRequest {
        entry.request
    }
}

/// Copies local memory into a remote window.
#[derive(Clone, Copy, Debug)]
pub struct Write<'r> {
    local: Local<'r>,
    remote: RemoteAddress,
}

impl<'r> Write<'r> {
    /// Writes `local` to `remote`.
    pub fn new(local: Local<'r>, remote: RemoteAddress) -> Self {
        Write { local, remote }
    }

    /// The request.
    pub fn build(self) -> Entry<'r> {
        Entry::new(Operation::Write {
            local: self.local.iova(),
            len: self.local.len(),
            remote: self.remote,
        })
    }
}

/// Copies a remote window's memory into local memory.
#[derive(Clone, Copy, Debug)]
pub struct Read<'r> {
    local: Local<'r>,
    remote: RemoteAddress,
}

impl<'r> Read<'r> {
    /// Reads `local.len` bytes from `remote` into `local`.
    pub fn new(local: Local<'r>, remote: RemoteAddress) -> Self {
        Read { local, remote }
    }

    /// The request.
    pub fn build(self) -> Entry<'r> {
        Entry::new(Operation::Read {
            local: self.local.iova(),
            len: self.local.len(),
            remote: self.remote,
        })
    }
}

/// Atomic compare-and-swap; the old value comes back in the completion.
#[derive(Clone, Copy, Debug)]
pub struct CompareSwap {
    remote: RemoteAddress,
    compare: u64,
    swap: u64,
    width: AtomicWidth,
}

impl CompareSwap {
    /// Stores `swap` at the 8-byte word `remote` if it holds `compare`.
    pub fn new(remote: RemoteAddress, compare: u64, swap: u64) -> Self {
        CompareSwap {
            remote,
            compare,
            swap,
            width: AtomicWidth::Eight,
        }
    }

    /// Works on a 4-byte word instead.
    pub fn four_bytes(mut self) -> Self {
        self.width = AtomicWidth::Four;
        self
    }

    /// The request.
    pub fn build(self) -> Entry<'static> {
        Entry::new(Operation::CompareSwap {
            remote: self.remote,
            width: self.width,
            compare: self.compare,
            swap: self.swap,
        })
    }
}

/// Atomic fetch-and-add; the old value comes back in the completion.
#[derive(Clone, Copy, Debug)]
pub struct FetchAdd {
    remote: RemoteAddress,
    add: u64,
    width: AtomicWidth,
}

impl FetchAdd {
    /// Adds `add` to the 8-byte word `remote`.
    pub fn new(remote: RemoteAddress, add: u64) -> Self {
        FetchAdd {
            remote,
            add,
            width: AtomicWidth::Eight,
        }
    }

    /// Works on a 4-byte word instead.
    pub fn four_bytes(mut self) -> Self {
        self.width = AtomicWidth::Four;
        self
    }

    /// The request.
    pub fn build(self) -> Entry<'static> {
        Entry::new(Operation::FetchAdd {
            remote: self.remote,
            width: self.width,
            add: self.add,
        })
    }
}

/// Atomic swap; the old value comes back in the completion.
#[derive(Clone, Copy, Debug)]
pub struct Swap {
    remote: RemoteAddress,
    value: u64,
    width: AtomicWidth,
}

impl Swap {
    /// Stores `value` at the 8-byte word `remote`.
    pub fn new(remote: RemoteAddress, value: u64) -> Self {
        Swap {
            remote,
            value,
            width: AtomicWidth::Eight,
        }
    }

    /// Works on a 4-byte word instead.
    pub fn four_bytes(mut self) -> Self {
        self.width = AtomicWidth::Four;
        self
    }

    /// The request.
    pub fn build(self) -> Entry<'static> {
        Entry::new(Operation::Swap {
            remote: self.remote,
            width: self.width,
            value: self.value,
        })
    }
}

/// Does nothing; with [`Entry::fence`], a point after which earlier requests
/// have finished.
#[derive(Clone, Copy, Debug, Default)]
pub struct Nop;

impl Nop {
    /// A no-op.
    pub fn new() -> Self {
        Nop
    }

    /// The request.
    pub fn build(self) -> Entry<'static> {
        Entry::new(Operation::Nop)
    }
}
