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
//! let remote = RemoteAddress { node: 0, port: 1, key: RemoteKey(42), offset: 0 };
//! let add = FetchAdd::new(remote, 1).build().user_data(7).signaled();
//! assert_eq!(add.request().user_data, 7);
//! let fence = Nop::new().build().user_data(8).fence();
//! # let _ = fence;
//! ```

use pindown_uapi::pattern::{encode_pair, Pattern, PatternError};
use pindown_uapi::{
    AtomicOp, AtomicWidth, Bitwise, Descriptor, Operation, RemoteAddress, VectorTransfer,
    WorkRequest, WrFlags,
};

use super::memory::{KeepAlive, KeepRef};
use super::{Local, VerbsError};
use crate::datatype::{Committed, DescriptorCache};

/// A work request ready to post; `'r` is the borrow of the memory region
/// its local range belongs to (`'static` for requests naming no local
/// memory).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry<'r> {
    request: WorkRequest,
    inline: bool,
    /// The local range was taken from a region, of the context at this
    /// address: this process maps it, so that context's queue pairs can
    /// read an inline write's bytes from it when they post it.
    local_mapped_in: Option<usize>,
    /// A vector transfer's descriptor (borrowed from its [`Vector`]).
    descriptor: Option<&'r [u8]>,
    /// The share of the local memory the request names, which the queue
    /// pair keeps from posting until the device has finished the request.
    keep: KeepRef<'r>,
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
            local_mapped_in: None,
            descriptor: None,
            keep: KeepRef::default(),
        }
    }

    /// This entry, naming the memory `local` was taken from.
    fn naming(mut self, local: &Local<'r>) -> Self {
        self.keep = local.keep();
        self.local_mapped_in = local.mapped_in();
        self
    }

    /// The address of the context whose region the local range was taken
    /// from, if it was (see [`inline`](Self::inline)).
    pub(crate) fn local_mapped_in(&self) -> Option<usize> {
        self.local_mapped_in
    }

    /// The share of local memory the request names, if its region holds
    /// one.
    pub(crate) fn keep_alive(&self) -> Option<&'r KeepAlive> {
        self.keep.get()
    }

    /// An entry of any request, with `descriptor` for a vector transfer
    /// (the driver puts it inline or in memory and sets the request's
    /// descriptor field; a descriptor of other requests is ignored): to
    /// hand the device requests it must refuse (tests of its checks).
    ///
    /// # Safety
    ///
    /// As for [`Local::from_raw`](super::Local::from_raw): the device reads
    /// or writes whatever is registered where the request (and its
    /// descriptor) points until the request has completed.
    pub unsafe fn from_raw(request: WorkRequest, descriptor: Option<&'r [u8]>) -> Entry<'r> {
        Entry {
            request,
            inline: false,
            local_mapped_in: None,
            descriptor,
            keep: KeepRef::default(),
        }
    }

    /// A vector transfer's descriptor, if the entry is one.
    pub fn descriptor(&self) -> Option<&'r [u8]> {
        self.descriptor
    }

    /// Sends a write's bytes inside the send queue, as a NIC's inline send
    /// does (the programmed-I/O path of small transfers): the driver copies
    /// them into the queue when the request is posted, so the source may
    /// change (or be freed) as soon as [`post`](super::QueuePair::post)
    /// returns, and the device neither reads the source memory nor checks
    /// that it is registered. Writes of at most
    /// [`MAX_INLINE`](pindown_uapi::queue::MAX_INLINE) bytes travel inline
    /// from any memory registered with the queue pair's context (its DMA
    /// arena or memory of the program's, taken with
    /// [`MemoryRegion::local`](super::MemoryRegion::local)), and from a
    /// [`Local::from_raw`](super::Local::from_raw) range inside the arena;
    /// other requests are posted as usual (the device reads their source
    /// when it executes them, after `post` returns, and refuses memory the
    /// context did not register).
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
        .naming(&self.local)
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
        .naming(&self.local)
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

/// Atomic fetch-and-and, fetch-and-or or fetch-and-xor; the old value
/// comes back in the completion.
#[derive(Clone, Copy, Debug)]
pub struct FetchBitwise {
    remote: RemoteAddress,
    op: Bitwise,
    mask: u64,
    width: AtomicWidth,
}

impl FetchBitwise {
    /// ANDs the 8-byte word `remote` with `mask`.
    pub fn and(remote: RemoteAddress, mask: u64) -> Self {
        Self::new(remote, Bitwise::And, mask)
    }

    /// ORs the 8-byte word `remote` with `mask`.
    pub fn or(remote: RemoteAddress, mask: u64) -> Self {
        Self::new(remote, Bitwise::Or, mask)
    }

    /// XORs the 8-byte word `remote` with `mask`.
    pub fn xor(remote: RemoteAddress, mask: u64) -> Self {
        Self::new(remote, Bitwise::Xor, mask)
    }

    fn new(remote: RemoteAddress, op: Bitwise, mask: u64) -> Self {
        FetchBitwise {
            remote,
            op,
            mask,
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
        Entry::new(Operation::FetchBitwise {
            remote: self.remote,
            width: self.width,
            op: self.op,
            mask: self.mask,
        })
    }
}

/// An atomic on a remote word whose old value is written into a window
/// anywhere in the fabric (ACP's atomics, delivering the old value where
/// the initiator asks): the word's device runs it, atomic with respect to
/// every initiator and the owner's CPU, then writes the old value with
/// this port's rights (REMOTE_ATOMIC on the word's window, REMOTE_WRITE on
/// the destination's). The completion carries the old value too and comes
/// once it landed. Across nodes, a destination that refuses the write
/// fails the request after the word changed.
#[derive(Clone, Copy, Debug)]
pub struct AtomicTo {
    word: RemoteAddress,
    op: AtomicOp,
    destination: RemoteAddress,
    width: AtomicWidth,
}

impl AtomicTo {
    /// Runs `op` on the 8-byte word `word`; its old value goes to
    /// `destination`.
    pub fn new(word: RemoteAddress, op: AtomicOp, destination: RemoteAddress) -> Self {
        AtomicTo {
            word,
            op,
            destination,
            width: AtomicWidth::Eight,
        }
    }

    /// Works on a 4-byte word instead (4 bytes land at the destination).
    pub fn four_bytes(mut self) -> Self {
        self.width = AtomicWidth::Four;
        self
    }

    /// The request.
    pub fn build(self) -> Entry<'static> {
        Entry::new(Operation::AtomicTo {
            word: self.word,
            width: self.width,
            op: self.op,
            destination: self.destination,
        })
    }
}

/// A copy between two remote windows, on any nodes of the fabric, that
/// this port holds keys for (ACP's third-party copy): the source's device
/// reads the source window and writes the destination, both checked
/// against this port's rights (REMOTE_READ on the source, REMOTE_WRITE on
/// the destination); the completion comes once every byte landed.
#[derive(Clone, Copy, Debug)]
pub struct RemoteCopy {
    source: RemoteAddress,
    destination: RemoteAddress,
    len: u32,
}

impl RemoteCopy {
    /// Copies `len` bytes from `source` to `destination`.
    pub fn new(source: RemoteAddress, destination: RemoteAddress, len: u32) -> Self {
        RemoteCopy {
            source,
            destination,
            len,
        }
    }

    /// The request.
    pub fn build(self) -> Entry<'static> {
        Entry::new(Operation::Copy {
            source: self.source,
            destination: self.destination,
            len: self.len,
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

/// A vector transfer (VECTOR_WRITE or VECTOR_READ): bytes move between
/// local memory, laid out by one [`Pattern`], and a remote window, laid
/// out by another (DIMMnet-2's remote vector access; see
/// [`pindown_uapi::pattern`]). The local pattern's offsets count from the
/// start of its [`Local`] range, which must hold every byte the pattern
/// names (checked here); the remote pattern's offsets count from the
/// remote address's offset in its window (checked by the device). Both
/// patterns must cover the same number of bytes.
///
/// The builder keeps the encoded descriptor, and the [`Entry`]
/// [`build`](Self::build) makes borrows it: when the request is posted,
/// a descriptor of at most [`MAX_INLINE`](pindown_uapi::queue::MAX_INLINE)
/// bytes is copied into the send queue, a larger one into registered
/// memory the queue pair owns and keeps until the device has finished
/// the request.
///
/// ```no_run
/// # use pindown_driver::verbs::{opcode::Vector, Context, QueuePair};
/// # use pindown_uapi::pattern::{Pattern, Piece};
/// # fn f(context: &Context, qp: &mut QueuePair<'_>, to: pindown_uapi::RemoteAddress)
/// #     -> Result<(), Box<dyn std::error::Error>> {
/// // A column of 4096 doubles (rows of 4097) into 4096 contiguous ones.
/// let matrix = context.alloc(4096 * 4097 * 8, 64)?;
/// let region = context.register_buffer(&matrix)?;
/// let column = Pattern::new(vec![Piece::vector(0, 8, 4096, 4097 * 8)], 1, 0)?;
/// let whole = region.local(0, matrix.len() as u32)?;
/// let write = Vector::write(whole, column, to, Pattern::contiguous(4096 * 8))?.notify(7);
/// qp.post(&[write.build().user_data(1).signaled()])?;
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct Vector<'r> {
    local: Local<'r>,
    len: u32,
    remote: RemoteAddress,
    read: bool,
    notify: Option<u64>,
    descriptor: Vec<u8>,
}

impl<'r> Vector<'r> {
    /// Writes the bytes of `local` that `local_pattern` names into the
    /// window at `remote`, laid out by `remote_pattern`.
    pub fn write(
        local: Local<'r>,
        local_pattern: Pattern,
        remote: RemoteAddress,
        remote_pattern: Pattern,
    ) -> Result<Self, VerbsError> {
        Self::new(local, local_pattern, remote, remote_pattern, false, false)
    }

    /// Reads the bytes of the window at `remote` that `remote_pattern`
    /// names into `local`, laid out by `local_pattern`.
    pub fn read(
        local: Local<'r>,
        local_pattern: Pattern,
        remote: RemoteAddress,
        remote_pattern: Pattern,
    ) -> Result<Self, VerbsError> {
        Self::new(local, local_pattern, remote, remote_pattern, true, false)
    }

    /// Writes `local_side.0` elements of datatype `local_side.1`, laid
    /// out from the start of `local` as MPI lays out a typed buffer, into
    /// `remote_side.0` elements of `remote_side.1` from `remote`: a
    /// typed send with no pack and no unpack. Both types' patterns come
    /// from `cache` (compiled once per type and count).
    pub fn write_typed(
        cache: &mut DescriptorCache,
        local: Local<'r>,
        local_side: (u64, &Committed),
        remote: RemoteAddress,
        remote_side: (u64, &Committed),
    ) -> Result<Self, VerbsError> {
        let (local_pattern, remote_pattern) = typed_patterns(cache, local_side, remote_side)?;
        Self::new(local, local_pattern, remote, remote_pattern, false, false)
    }

    /// Reads `remote_side.0` elements of datatype `remote_side.1` from
    /// `remote` into `local_side.0` elements of `local_side.1` laid out
    /// from the start of `local` (see [`write_typed`](Self::write_typed)).
    pub fn read_typed(
        cache: &mut DescriptorCache,
        local: Local<'r>,
        local_side: (u64, &Committed),
        remote: RemoteAddress,
        remote_side: (u64, &Committed),
    ) -> Result<Self, VerbsError> {
        let (local_pattern, remote_pattern) = typed_patterns(cache, local_side, remote_side)?;
        Self::new(local, local_pattern, remote, remote_pattern, true, false)
    }

    /// Like [`write`](Self::write) (or, with `read`, [`read`](Self::read)),
    /// but the local pattern may hold a block list in memory
    /// ([`BlockList::InMemory`](pindown_uapi::pattern::BlockList::InMemory)),
    /// which the device reads when it executes the request. The safe forms
    /// refuse such a pattern ([`VerbsError::LocalListInMemory`]): its
    /// blocks cannot be checked against `local` here, and the device checks
    /// each local block only against the port's registered memory, not
    /// against the range `local` names.
    ///
    /// # Safety
    ///
    /// When the device executes the request, every block the list names
    /// lies inside `local` (the device refuses blocks outside registered
    /// memory, but not blocks in memory registered for something else).
    pub unsafe fn with_local_list_in_memory(
        local: Local<'r>,
        local_pattern: Pattern,
        remote: RemoteAddress,
        remote_pattern: Pattern,
        read: bool,
    ) -> Result<Self, VerbsError> {
        Self::new(local, local_pattern, remote, remote_pattern, read, true)
    }

    /// The request, once the lengths and the local pattern are checked
    /// (a local block list in memory only if `local_list_in_memory`).
    fn new(
        local: Local<'r>,
        local_pattern: Pattern,
        remote: RemoteAddress,
        remote_pattern: Pattern,
        read: bool,
        local_list_in_memory: bool,
    ) -> Result<Self, VerbsError> {
        let len = local_pattern.len;
        if remote_pattern.len != len {
            return Err(VerbsError::VectorLengths {
                local: len,
                remote: remote_pattern.len,
            });
        }
        let len = u32::try_from(len).map_err(|_| VerbsError::VectorLengths {
            local: len,
            remote: remote_pattern.len,
        })?;
        match local_pattern.plan() {
            Ok(plan) => {
                if let Some((low, high)) = plan.hull() {
                    if low < 0 || high > i64::from(local.len()) {
                        return Err(VerbsError::OutOfRegion {
                            offset: low.max(0) as u64,
                            len: (i128::from(high) - i128::from(low)) as u64,
                            region_len: u64::from(local.len()),
                        });
                    }
                }
            }
            // A block list in memory: vouched for by the caller of the
            // unsafe form; the device checks every block against the
            // port's registered memory.
            Err(PatternError::Unresolved) if local_list_in_memory => {}
            Err(PatternError::Unresolved) => return Err(VerbsError::LocalListInMemory),
            Err(error) => return Err(VerbsError::Pattern(error)),
        }
        if let Err(error) = remote_pattern.plan() {
            if error != PatternError::Unresolved {
                return Err(VerbsError::Pattern(error));
            }
        }
        let descriptor = encode_pair(&local_pattern, &remote_pattern);
        if u32::try_from(descriptor.len()).is_err() {
            return Err(VerbsError::Pattern(PatternError::Overflow(
                "descriptor bytes (a request's descriptor length is 32 bits)",
            )));
        }
        Ok(Vector {
            local,
            len,
            remote,
            read,
            notify: None,
            descriptor,
        })
    }

    /// Tells the target when the write has landed: its context finds an
    /// arrival in its admin completion queue carrying this port and its
    /// node (the target may be on another node of the fabric), the
    /// window's key, the bytes and `immediate`
    /// ([`Context::arrivals`](super::Context::arrivals)). A write only (a
    /// read ignores it).
    pub fn notify(mut self, immediate: u64) -> Self {
        if !self.read {
            self.notify = Some(immediate);
        }
        self
    }

    /// Bytes the transfer moves.
    pub fn len(&self) -> u32 {
        self.len
    }

    /// Whether it moves no byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The request, borrowing the descriptor this builder holds.
    pub fn build(&self) -> Entry<'_> {
        let vector = VectorTransfer {
            local: self.local.iova(),
            len: self.len,
            remote: self.remote,
            // Set when posted: inline or in the queue pair's memory.
            descriptor: Descriptor::Inline {
                len: self.descriptor.len() as u32,
            },
            notify: self.notify,
        };
        let mut entry = Entry::new(if self.read {
            Operation::VectorRead(vector)
        } else {
            Operation::VectorWrite(vector)
        })
        .naming(&self.local);
        entry.descriptor = Some(&self.descriptor);
        entry
    }
}

/// The patterns of `count` elements of each side's datatype, from `cache`.
fn typed_patterns(
    cache: &mut DescriptorCache,
    (local_count, local_type): (u64, &Committed),
    (remote_count, remote_type): (u64, &Committed),
) -> Result<(Pattern, Pattern), VerbsError> {
    let local = cache
        .get(local_type, local_count)?
        .descriptor
        .pattern
        .clone();
    let remote = cache
        .get(remote_type, remote_count)?
        .descriptor
        .pattern
        .clone();
    Ok((local, remote))
}
