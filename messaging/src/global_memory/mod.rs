//! # Global memory: ACP's basic layer on the device's one-sided operations
//!
//! A rank registers memory and gets an address-translation [`Key`]; a key
//! and an offset make a 64-bit [`GlobalAddress`] (rank, color, key entry,
//! offset, the field widths chosen from the rank count: see
//! [`AddressLayout`]). Copies between any two global addresses and atomics
//! on 4- and 8-byte words name only global addresses: the memory may be
//! this rank's, one peer's, or two other ranks' (a *third-party*
//! operation). The device executes all of them, third-party ones
//! included ([`RemoteCopy`](pindown_driver::verbs::opcode::RemoteCopy),
//! [`AtomicTo`](pindown_driver::verbs::opcode::AtomicTo)), so no
//! communication thread polls on any rank and nothing is delegated in
//! software (ACP's delegate and command stations). Every operation
//! returns a [`Handle`]; [`GlobalMemory::complete`] waits for it and every
//! earlier one, [`GlobalMemory::inquire`] asks without waiting.
//!
//! Every rank has *starter memory* ([`Config::starter_bytes`]) whose
//! global address anyone computes ([`GlobalMemory::starter_address`]).
//! The global addresses of other memory are the program's to hand around:
//! a peer turns one into a window key by reading the owner's key table
//! (one RDMA READ of 32 bytes, then cached), so a rank keeps nothing per
//! peer but its port and three window keys ([`MemoryUse`]): no buffers per
//! peer, no table of every peer's registrations.
//!
//! Adjacent registrations merge: a range inside a registration, or
//! starting inside it or right at its end, joins it (extending it if
//! needed) and returns the same key; each registration needs its own
//! [`GlobalMemory::deregister`].
//!
//! [`GlobalMemory::finalize`] releases everything (waiting for operations
//! still in flight first and saying so), and [`GlobalMemory::reinit`]
//! starts again with a rank and starter size the caller chooses (every
//! rank re-initializes; the chosen ranks must be a permutation).
//!
//! ```no_run
//! use pindown_driver::launch::{device_socket, Job};
//! use pindown_driver::verbs::Context;
//! use pindown_messaging::global_memory::{Atomic, Config, GlobalMemory, Order};
//!
//! let mut job = Job::from_environment()?;
//! let context = Context::open(device_socket(&job)?, pindown_messaging::context_config())?;
//! let mut memory = GlobalMemory::init(&context, &mut job, Config::default())?;
//! let (rank, size) = (memory.rank(), memory.size());
//! // Everyone's starter memory has a computable address.
//! let mine = memory.starter_address(rank)?;
//! let next = memory.starter_address((rank + 1) % size)?;
//! // Copy my first 64 bytes into the next rank's starter memory, then
//! // add 1 to the word at offset 64 there, the old value landing in mine.
//! memory.write_local(mine, &[rank as u8; 64])?;
//! let copy = memory.copy(next, mine, 64, Order::Any)?;
//! let add = memory.atomic(mine.plus(64), next.plus(64), Atomic::Add8(1), Order::Any)?;
//! memory.complete(add)?;              // `copy` too: it came earlier
//! assert!(memory.inquire(copy)?);
//! memory.sync()?;                     // everyone's operations landed
//! memory.finalize()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod address;
mod directory;
mod operations;

use std::alloc::Layout as AllocLayout;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use pindown_driver::arena::DmaBuffer;
use pindown_driver::launch::Job;
use pindown_driver::verbs::{Context, RegionWindow};
use pindown_uapi::queue::{COMPLETION_SLOT, REQUEST_SLOT};
use pindown_uapi::{Access, NodeId, PortAddress, RemoteAddress, RemoteKey};

pub use address::{
    AddressFields, AddressLayout, GlobalAddress, Key, COLOR_BITS, MAX_RANKS, MAX_REGISTRATION,
    MIN_ENTRY_BITS, OFFSET_BITS,
};
pub use operations::{Atomic, Counters, Handle, Order};

use crate::error::{Error, Result};
use directory::{
    Placement, PublishedEntry, Registered, Registrations, ENTRY_BYTES, NULL_ENTRY, STARTER_ENTRY,
};
use operations::Operations;

/// Colors (network interfaces a registration is reached through): one
/// here, color 0.
pub const COLORS: u32 = 1;

/// Settings of [`GlobalMemory::init`].
#[derive(Clone, Copy, Debug)]
pub struct Config {
    /// Bytes of starter memory (ACP's `ACP_STARTER_MEMSIZE`), zeroed.
    pub starter_bytes: usize,
    /// Key-table entries: registrations a rank can hold at once (two are
    /// the null entry and the starter memory's).
    pub registrations: u32,
    /// Other ranks' key-table entries kept after a lookup (oldest
    /// forgotten first).
    pub remote_entries: usize,
    /// How long [`GlobalMemory::sync`] waits for a rank before giving up.
    pub sync_timeout: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            starter_bytes: 1 << 20,
            registrations: 256,
            remote_entries: 1024,
            sync_timeout: Duration::from_secs(60),
        }
    }
}

/// What a global address's registration is ([`GlobalMemory::properties`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Properties {
    /// The rank owning the memory.
    pub rank: u32,
    /// Its color.
    pub color: u32,
    /// The registration's key.
    pub key: Key,
    /// The owner's address of the registration's first byte.
    pub base: u64,
    /// Bytes registered.
    pub len: u64,
    /// The address's offset into it.
    pub offset: u64,
    /// Registrations merged into it (on the owner only; 0 elsewhere).
    pub count: u32,
    /// Whether it is the owner's starter memory.
    pub starter: bool,
}

/// Memory a rank uses, in ACP's form (its tables 5-6): a fixed part, a
/// part per peer and a part per registration, each measured from what
/// the rank actually holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryUse {
    /// Bytes whatever the peer count: the device's send and completion
    /// rings (the command queue), the key table peers read, the
    /// synchronization words, the staging area and the signal word.
    pub fixed: u64,
    /// Bytes per peer: its port and two window keys. No buffers.
    pub per_peer: u64,
    /// Bytes of [`GlobalMemory::sync`]'s windows and keys: per round of
    /// the dissemination (log2 of the ranks, rounded up), a window over
    /// this rank's word for the rank that signals it and the key of the
    /// word it signals.
    pub sync: u64,
    /// Ranks whose record is kept (every rank, this one included).
    pub peers: u32,
    /// Bytes per registration held (its key-table entry and record).
    pub per_registration: u64,
    /// Registrations held (starter memory included).
    pub registrations: u32,
    /// Bytes per other rank's entry looked up and cached.
    pub per_cached_entry: u64,
    /// Entries cached.
    pub cached_entries: u32,
    /// Bytes of starter memory (the program's, counted apart as ACP
    /// does).
    pub starter: u64,
    /// The sum.
    pub total: u64,
}

/// How a peer is reached: 32 bytes.
#[derive(Clone, Copy, Debug)]
struct Peer {
    node: NodeId,
    port: u16,
    /// Its key table (read-only).
    directory: RemoteKey,
    /// Its starter memory.
    starter: RemoteKey,
    starter_len: u64,
}

impl Peer {
    fn address(&self, key: RemoteKey, offset: u64) -> RemoteAddress {
        RemoteAddress {
            node: self.node,
            port: self.port,
            key,
            offset,
        }
    }
}

/// Bytes of a rank's record in the launcher's key-value space: a status
/// byte (and padding), the rank chosen, node, port, key-table entries,
/// two window keys, starter bytes.
const RECORD_BYTES: usize = 4 + 4 + 2 + 2 + 4 + 8 * 3;
/// The status byte of a rank that set up.
const RECORD_OK: u8 = 1;
/// Synchronization words: one per dissemination round.
pub(crate) const SYNC_WORDS: u64 = 64;
/// Staging bytes (reads of peers' key-table entries, words written).
const STAGING_BYTES: u64 = 4096;

/// Page-aligned, zeroed memory this rank owns and registers.
struct PageMemory {
    ptr: *mut u8,
    layout: AllocLayout,
}

impl PageMemory {
    fn new(len: usize) -> Result<PageMemory> {
        let layout = AllocLayout::from_size_align(len.max(1).next_multiple_of(4096), 4096)
            .map_err(|e| Error::Unsuitable(format!("{len} bytes of memory: {e}")))?;
        // SAFETY: the layout has a nonzero size (at least one page).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(Error::Unsuitable(format!(
                "allocating {} bytes failed",
                layout.size()
            )));
        }
        Ok(PageMemory { ptr, layout })
    }

    fn addr(&self) -> u64 {
        self.ptr as u64
    }

    fn len(&self) -> usize {
        self.layout.size()
    }
}

impl Drop for PageMemory {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) };
    }
}

/// What a rank sets up before the exchange of records.
struct Local<'c> {
    // Field order is drop order: the windows before the memory under them.
    directory_window: RegionWindow<'c>,
    starter_window: RegionWindow<'c>,
    layout: AddressLayout,
    system: PageMemory,
    starter: PageMemory,
    entries: u32,
}

impl<'c> Local<'c> {
    fn set_up(context: &'c Context, size: u32, rank: u32, config: &Config) -> Result<Self> {
        let entries = config
            .registrations
            .clamp(directory::FIRST_USER_ENTRY, directory::MAX_ENTRIES);
        let layout = AddressLayout::for_ranks(size, entries).ok_or_else(|| {
            Error::Unsuitable(format!(
                "{size} ranks with {entries} key-table entries each: global addresses name at \
                 most {MAX_RANKS} ranks, and the entries must fit the bits the ranks leave"
            ))
        })?;
        if rank >= size {
            return Err(Error::NoSuchRank { rank, size });
        }
        if config.starter_bytes == 0 || config.starter_bytes as u64 > MAX_REGISTRATION {
            return Err(Error::Unsuitable(format!(
                "{} bytes of starter memory: 1 byte to {MAX_REGISTRATION} bytes",
                config.starter_bytes
            )));
        }
        let directory_bytes = u64::from(entries) * ENTRY_BYTES;
        let system = PageMemory::new((directory_bytes + SYNC_WORDS * 8 + STAGING_BYTES) as usize)?;
        let starter = PageMemory::new(config.starter_bytes)?;
        // Memory freed by an earlier init may come back at the same
        // address: forget what the pin-down cache knew of it.
        context.invalidate(system.addr(), system.len() as u64);
        context.invalidate(starter.addr(), starter.len() as u64);
        // SAFETY (both registrations): `system` and `starter` move with
        // their windows into `Local`, then `GlobalMemory`, each declared
        // after the windows over them, so they are unmapped only after the
        // windows are revoked and the registrations released. Peers write
        // them; this rank reads them only through raw pointers and atomics.
        let directory_window = context.bind_region_window(
            unsafe { context.register(system.addr(), system.len() as u64)? },
            0,
            directory_bytes,
            Access::REMOTE_READ,
            None,
        )?;
        let starter_window = context.bind_region_window(
            unsafe { context.register(starter.addr(), config.starter_bytes as u64)? },
            0,
            config.starter_bytes as u64,
            Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC,
            None,
        )?;
        Ok(Local {
            layout,
            system,
            starter,
            directory_window,
            starter_window,
            entries,
        })
    }

    /// This rank's record for the exchange.
    fn record(&self, rank: u32, config: &Config) -> [u8; RECORD_BYTES] {
        let own = self.directory_window.remote();
        let mut record = [0u8; RECORD_BYTES];
        record[0] = RECORD_OK;
        record[4..8].copy_from_slice(&rank.to_le_bytes());
        record[8..10].copy_from_slice(&own.node.to_le_bytes());
        record[10..12].copy_from_slice(&own.port.to_le_bytes());
        record[12..16].copy_from_slice(&config.registrations.to_le_bytes());
        record[16..24].copy_from_slice(&own.key.0.to_le_bytes());
        record[24..32].copy_from_slice(&self.starter_window.remote().key.0.to_le_bytes());
        record[32..40].copy_from_slice(&(config.starter_bytes as u64).to_le_bytes());
        record
    }
}

/// Counts `init`s in this process: every rank initializes the same number
/// of times, so the count names the launcher keys of one generation.
static GENERATION: AtomicU32 = AtomicU32::new(0);

/// One rank's global memory ([module docs](self)).
pub struct GlobalMemory<'c> {
    // Field order is drop order: the queue pair before its completion
    // queue, windows before the memory under them.
    ops: Operations<'c>,
    /// The word a barrier signal carries, in the DMA arena so that the
    /// signal travels inline: its value is copied into the send queue
    /// when posted, and the device never reads this rank's memory for it
    /// later (a signal still queued when the rank finalizes would find
    /// `system` invalidated or reused, and never land).
    signal_word: DmaBuffer,
    registrations: Registrations<RegionWindow<'c>>,
    directory_window: RegionWindow<'c>,
    /// For each round of [`sync`](Self::sync), the window over its word,
    /// bound for the one rank that signals this rank in that round.
    sync_windows: Vec<RegionWindow<'c>>,
    /// For each round, the key of the window over that round's word at
    /// the rank this rank signals in it.
    sync_keys: Vec<RemoteKey>,
    system: PageMemory,
    starter: PageMemory,
    context: &'c Context,
    layout: AddressLayout,
    rank: u32,
    peers: Vec<Peer>,
    /// Other ranks' entries looked up: (rank, index) to what was read,
    /// and the lookup's number.
    remote: HashMap<(u32, u32), (PublishedEntry, u64)>,
    /// Their lookup order, to forget the oldest: (rank, index) and the
    /// lookup's number (an entry looked up again is forgotten by its last
    /// lookup only).
    remote_order: VecDeque<((u32, u32), u64)>,
    /// Lookups made.
    next_lookup: u64,
    config: Config,
    /// Dissemination barriers done.
    sync_epoch: u64,
}

impl<'c> GlobalMemory<'c> {
    /// Joins the job with the launcher's rank and size.
    pub fn init(context: &'c Context, job: &mut Job, config: Config) -> Result<Self> {
        Self::init_as(context, job, job.rank(), config)
    }

    /// Joins the job as rank `rank`, which the caller chooses (every rank
    /// does; the ranks chosen must be a permutation of `0..size`, or every
    /// rank fails with [`Error::Mismatch`]).
    pub fn init_as(context: &'c Context, job: &mut Job, rank: u32, config: Config) -> Result<Self> {
        Self::start(context, job, rank, config)
    }

    /// Releases everything ([`finalize`](Self::finalize)) and joins again
    /// as rank `rank` with `starter_bytes` of starter memory (ACP's
    /// re-initialization). Every rank re-initializes; the ranks chosen
    /// must be a permutation of `0..size`. Operations still in flight are
    /// waited for first, as `finalize` does (then not reported as
    /// [`Error::Unfinished`]: nothing was lost); a failure to release
    /// anything else is returned, and nothing is initialized (join with
    /// [`init_as`](Self::init_as) then).
    pub fn reinit(self, job: &mut Job, rank: u32, starter_bytes: usize) -> Result<Self> {
        let context = self.context;
        let config = Config {
            starter_bytes,
            ..self.config
        };
        match self.finalize() {
            Ok(()) | Err(Error::Unfinished { .. }) => {}
            Err(err) => return Err(err),
        }
        Self::start(context, job, rank, config)
    }

    /// Sets this rank up and exchanges records with every rank. Each rank
    /// takes part in the exchange whatever goes wrong locally (its record
    /// then says it failed), so that a failure on one rank fails every
    /// rank's init instead of matching records of different inits.
    fn start(context: &'c Context, job: &mut Job, rank: u32, config: Config) -> Result<Self> {
        let generation = GENERATION.fetch_add(1, Ordering::Relaxed);
        let size = job.size();
        let local = Local::set_up(context, size, rank, &config);
        let record = match &local {
            Ok(local) => local.record(rank, &config),
            Err(_) => [0u8; RECORD_BYTES],
        };
        let records = job.all_gather(&format!("pindown-acp-{generation}"), &record)?;
        let local = local?;
        let (peers, launcher_ranks) = peers_by_chosen_rank(&records, config.registrations)?;
        crate::records::distinct_ports(peers.iter().map(|peer| (peer.node, peer.port)))?;
        let Local {
            layout,
            system,
            starter,
            directory_window,
            starter_window,
            entries,
        } = local;
        let (sync_windows, sync_keys) = sync_windows(
            context,
            job,
            generation,
            (rank, &peers, &launcher_ranks),
            &system,
            u64::from(entries) * ENTRY_BYTES,
        )?;
        let ops = Operations::new(context)?;
        let signal_word = context.alloc(8, 8)?;
        let mut memory = GlobalMemory {
            ops,
            signal_word,
            registrations: Registrations::new(entries),
            directory_window,
            sync_windows,
            sync_keys,
            system,
            starter,
            context,
            layout,
            rank,
            peers,
            remote: HashMap::new(),
            remote_order: VecDeque::new(),
            next_lookup: 0,
            config,
            sync_epoch: 0,
        };
        let registered = Registered {
            base: memory.starter.addr(),
            len: config.starter_bytes as u64,
            color: 0,
            count: 1,
            generation: 0,
            windows: vec![starter_window],
        };
        memory.publish(
            STARTER_ENTRY,
            PublishedEntry::live(
                STARTER_ENTRY,
                &registered,
                registered.window().remote().key.0,
            ),
        );
        memory.registrations.insert_starter(registered);
        Ok(memory)
    }

    /// This rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Ranks in the job.
    pub fn size(&self) -> u32 {
        self.peers.len() as u32
    }

    /// Colors memory can be registered with ([`COLORS`]).
    pub fn colors(&self) -> u32 {
        COLORS
    }

    /// How this run splits global addresses.
    pub fn address_layout(&self) -> AddressLayout {
        self.layout
    }

    /// The global address of the first byte of `rank`'s starter memory.
    pub fn starter_address(&self, rank: u32) -> Result<GlobalAddress> {
        self.check_rank(rank)?;
        let entry = self.layout.entry(STARTER_ENTRY, 0);
        Ok(self.compose(rank, 0, entry, 0))
    }

    /// Registers `[addr, addr + len)` of this process's memory with
    /// `color`, giving its key: the key of a registration it merged into
    /// when it lies inside one, or starts inside or right at the end of
    /// one (which then grows). Each call needs its own
    /// [`deregister`](Self::deregister).
    ///
    /// # Safety
    ///
    /// Until the last deregistration of its key (or
    /// [`finalize`](Self::finalize)), the memory stays allocated, and
    /// this process treats it as shared with every rank: any rank holding
    /// a global address in it may read, write and run atomics on it at
    /// any time.
    pub unsafe fn register(&mut self, addr: *mut u8, len: u64, color: u32) -> Result<Key> {
        if color >= COLORS {
            return Err(Error::NoSuchColor {
                color,
                colors: COLORS,
            });
        }
        let base = addr as u64;
        let too_long = || {
            Error::Unsuitable(format!(
                "registering {len} bytes at {base:#x}: a registration holds 1 byte to \
                 {MAX_REGISTRATION} bytes and ends inside the address space"
            ))
        };
        if len == 0 || len > MAX_REGISTRATION || base.checked_add(len).is_none() {
            return Err(too_long());
        }
        let entry = match self.registrations.place(color, base, len) {
            Placement::Inside(entry) => {
                self.live_mut(entry).count += 1;
                entry
            }
            Placement::Extend { entry, base, len } => {
                if len > MAX_REGISTRATION {
                    return Err(too_long());
                }
                let window = self.bind(base, len)?;
                let registered = self.live_mut(entry);
                registered.len = len;
                registered.count += 1;
                // The earlier windows stay: peers holding their keys, and
                // requests in flight, still reach the memory.
                registered.windows.push(window);
                entry
            }
            Placement::New => {
                let window = self.bind(base, len)?;
                self.registrations
                    .insert(Registered {
                        base,
                        len,
                        color,
                        count: 1,
                        generation: 0,
                        windows: vec![window],
                    })
                    .ok_or(Error::NoRegistrationLeft {
                        entries: self.registrations.capacity(),
                    })?
            }
        };
        let registered = self.registrations.get(entry).expect("live");
        let published = PublishedEntry::live(entry, registered, registered.window().remote().key.0);
        let key = self.key_of(entry, registered);
        self.publish(entry, published);
        Ok(key)
    }

    fn live_mut(&mut self, entry: u32) -> &mut Registered<RegionWindow<'c>> {
        self.registrations
            .get_mut(entry)
            .expect("placed in a live entry")
    }

    /// Binds a window over `[base, base + len)`, memory registered with
    /// [`register`](Self::register), whose caller keeps it allocated until
    /// the last deregistration of its key.
    fn bind(&self, base: u64, len: u64) -> Result<RegionWindow<'c>> {
        // SAFETY: the range is memory a caller of the unsafe `register`
        // vouched for until the last deregistration of its key, which
        // revokes this window (or `finalize`, which revokes every one).
        let region = unsafe { self.context.register(base, len)? };
        Ok(self.context.bind_region_window(
            region,
            0,
            len,
            Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC,
            None,
        )?)
    }

    /// Takes back one registration of `key`; the last one revokes peers'
    /// access (operations using it fail from then on) and frees the
    /// entry (its next use is a new generation, which addresses of this
    /// one never reach). The starter memory's key is released only by
    /// [`finalize`](Self::finalize).
    pub fn deregister(&mut self, key: Key) -> Result<()> {
        let address = GlobalAddress(key.0);
        let fields = self.layout.fields(address);
        if fields.offset != 0 {
            return Err(Error::NoSuchKey {
                key,
                why: "a key has offset 0".into(),
            });
        }
        let (index, _) = self.layout.split_entry(fields.entry);
        if fields.rank == self.rank && index == STARTER_ENTRY {
            return Err(Error::NoSuchKey {
                key,
                why: "starter memory is released by finalize only".into(),
            });
        }
        self.local_entry(address, 0)?;
        let registered = self.live_mut(index);
        registered.count -= 1;
        if registered.count == 0 {
            self.publish(index, PublishedEntry::GONE);
            let registered = self.registrations.remove(index).expect("live");
            // Newest first, so the current window goes first.
            for window in registered.windows.into_iter().rev() {
                window.revoke()?;
            }
        }
        Ok(())
    }

    /// The global address of `addr`, inside the registration of `key`
    /// (ACP's `acp_query_ga`).
    pub fn address(&self, key: Key, addr: *const u8) -> Result<GlobalAddress> {
        let base = GlobalAddress(key.0);
        if self.layout.fields(base).offset != 0 {
            return Err(Error::NoSuchKey {
                key,
                why: "a key has offset 0".into(),
            });
        }
        let (registered, _) = self.local_entry(base, 0)?;
        let addr = addr as u64;
        if addr < registered.base || addr >= registered.base + registered.len {
            return Err(Error::OutOfBounds {
                address: base,
                len: addr.wrapping_sub(registered.base),
                registered: registered.len,
            });
        }
        Ok(base.plus(addr - registered.base))
    }

    /// The rank whose memory `address` names.
    pub fn rank_of(&self, address: GlobalAddress) -> u32 {
        self.layout.fields(address).rank
    }

    /// The color of `address`.
    pub fn color_of(&self, address: GlobalAddress) -> u32 {
        self.layout.fields(address).color
    }

    /// This process's pointer to the byte `address` names, which must be
    /// this rank's (ACP's `acp_query_address`).
    pub fn local_address(&self, address: GlobalAddress) -> Result<*mut u8> {
        let (registered, offset) = self.local_entry(address, 0)?;
        Ok((registered.base + offset) as *mut u8)
    }

    /// What `address`'s registration is; another rank's is looked up in
    /// its key table.
    pub fn properties(&mut self, address: GlobalAddress) -> Result<Properties> {
        let fields = self.layout.fields(address);
        self.check_rank(fields.rank)?;
        let key = Key(address.0 - fields.offset);
        let (index, _) = self.layout.split_entry(fields.entry);
        if fields.rank == self.rank {
            let (registered, offset) = self.local_entry(address, 0)?;
            return Ok(Properties {
                rank: fields.rank,
                color: registered.color,
                key,
                base: registered.base,
                len: registered.len,
                offset,
                count: registered.count,
                starter: index == STARTER_ENTRY,
            });
        }
        let entry = self.remote_entry(address)?;
        Ok(Properties {
            rank: fields.rank,
            color: entry.color,
            key,
            base: entry.base,
            len: entry.len,
            offset: fields.offset,
            count: 0,
            starter: index == STARTER_ENTRY,
        })
    }

    /// Copies `bytes` into this rank's memory at `address`.
    pub fn write_local(&self, address: GlobalAddress, bytes: &[u8]) -> Result<()> {
        let (registered, offset) = self.local_entry(address, bytes.len() as u64)?;
        // SAFETY: `local_entry` checked that the range lies inside a live
        // registration, which `register`'s contract keeps allocated.
        unsafe {
            std::ptr::copy(
                bytes.as_ptr(),
                (registered.base + offset) as *mut u8,
                bytes.len(),
            )
        };
        Ok(())
    }

    /// Copies this rank's memory at `address` into `out`.
    pub fn read_local(&self, address: GlobalAddress, out: &mut [u8]) -> Result<()> {
        let (registered, offset) = self.local_entry(address, out.len() as u64)?;
        // SAFETY: as in `write_local`.
        unsafe {
            std::ptr::copy(
                (registered.base + offset) as *const u8,
                out.as_mut_ptr(),
                out.len(),
            )
        };
        Ok(())
    }

    /// This rank's registration of `address` (its index and generation
    /// both matching) and the offset into it, checked to hold `len`
    /// bytes.
    fn local_entry(
        &self,
        address: GlobalAddress,
        len: u64,
    ) -> Result<(&Registered<RegionWindow<'c>>, u64)> {
        let fields = self.layout.fields(address);
        if fields.rank != self.rank {
            return Err(Error::NotLocal {
                address,
                rank: fields.rank,
            });
        }
        let (index, _) = self.layout.split_entry(fields.entry);
        let registered = self
            .registrations
            .get(index)
            .filter(|r| {
                r.color == fields.color
                    && self.layout.entry(index, r.generation) == fields.entry
                    && index != NULL_ENTRY
            })
            .ok_or_else(|| self.gone(address))?;
        check_bounds(address, fields.offset, len, registered.len)?;
        Ok((registered, fields.offset))
    }

    fn gone(&self, address: GlobalAddress) -> Error {
        Error::NoSuchKey {
            key: Key(address.0 - self.layout.fields(address).offset),
            why: format!(
                "global address {address} names no registration (deregistered, or never made)"
            ),
        }
    }

    /// Memory this rank uses ([`MemoryUse`]).
    pub fn memory_use(&self) -> MemoryUse {
        let queue = u64::from(self.context.queue_size());
        let table = u64::from(self.registrations.capacity())
            * (std::mem::size_of::<Option<Registered<RegionWindow<'c>>>>() + 4) as u64;
        let sync = (self.sync_windows.len() * std::mem::size_of::<RegionWindow<'c>>()
            + self.sync_keys.len() * std::mem::size_of::<RemoteKey>()) as u64;
        let fixed = queue * (REQUEST_SLOT + COMPLETION_SLOT) as u64
            + self.system.len() as u64
            + self.signal_word.len() as u64
            + std::mem::size_of::<Self>() as u64
            + table
            + self.ops.bytes();
        // A registration adds its node in the index by base address (the
        // table and the key table are allocated whole at init).
        let per_registration = std::mem::size_of::<((u32, u64), u32)>() as u64;
        let per_cached_entry = (std::mem::size_of::<((u32, u32), (PublishedEntry, u64))>()
            + std::mem::size_of::<((u32, u32), u64)>()) as u64;
        let per_peer = std::mem::size_of::<Peer>() as u64;
        let registrations = self.registrations.live();
        let cached_entries = self.remote.len() as u32;
        let starter = self.starter.len() as u64;
        MemoryUse {
            fixed,
            per_peer,
            sync,
            peers: self.size(),
            per_registration,
            registrations,
            per_cached_entry,
            cached_entries,
            starter,
            total: fixed
                + sync
                + starter
                + per_peer * u64::from(self.size())
                + per_registration * u64::from(registrations)
                + per_cached_entry * u64::from(cached_entries),
        }
    }

    /// Writes entry `entry` of the key table peers read: the state word
    /// cleared first and set last, so a reader sees the old entry, an
    /// invalid one, or the new one (and the device checks every key
    /// anyway).
    fn publish(&mut self, entry: u32, published: PublishedEntry) {
        let words = published.encode();
        let at = self.system.ptr as usize + (u64::from(entry) * ENTRY_BYTES) as usize;
        let word = |i: usize| {
            // SAFETY: the key table lies at the start of `system`, which
            // holds `registrations.capacity()` entries of ENTRY_BYTES
            // (8-aligned: the memory is page-aligned); `entry` is below
            // the capacity, so each word is inside and aligned.
            unsafe { &*((at + i * 8) as *const std::sync::atomic::AtomicU64) }
        };
        word(3).store(0, Ordering::Release);
        for (i, value) in words.iter().enumerate().take(3) {
            word(i).store(*value, Ordering::Release);
        }
        word(3).store(words[3], Ordering::Release);
    }

    fn compose(&self, rank: u32, color: u32, entry: u32, offset: u64) -> GlobalAddress {
        self.layout
            .compose(address::AddressFields {
                rank,
                color,
                entry,
                offset,
            })
            .expect("fields checked against the layout")
    }

    /// The key of `registered`, at index `index` of this rank's table.
    fn key_of(&self, index: u32, registered: &Registered<RegionWindow<'c>>) -> Key {
        let entry = self.layout.entry(index, registered.generation);
        Key(self.compose(self.rank, registered.color, entry, 0).0)
    }

    fn check_rank(&self, rank: u32) -> Result<()> {
        if rank >= self.size() {
            return Err(Error::NoSuchRank {
                rank,
                size: self.size(),
            });
        }
        Ok(())
    }

    /// Releases everything this rank holds: waits for operations still in
    /// flight (reporting [`Error::Unfinished`] if there were any, after
    /// they finished), revokes every window, frees starter memory. Peers
    /// should be done with this rank's memory ([`sync`](Self::sync)
    /// before finalizing).
    pub fn finalize(mut self) -> Result<()> {
        let pending = self.ops.pending();
        let waited = self.complete_all();
        self.release();
        waited?;
        if pending > 0 {
            return Err(Error::Unfinished {
                spooled: 0,
                in_flight: pending as u64,
            });
        }
        Ok(())
    }

    /// Revokes every window and forgets the memory under them.
    fn release(&mut self) {
        for registered in self.registrations.drain() {
            for window in registered.windows.into_iter().rev() {
                if let Err(err) = window.revoke() {
                    tracing::warn!("revoking a global-memory window at finalize failed: {err}");
                }
            }
        }
    }
}

impl Drop for GlobalMemory<'_> {
    /// Lets the operations started finish, and then every request posted
    /// (the last barrier's signals among them), at most a few seconds,
    /// so that none is dropped with the queue pair: a peer waiting in
    /// that barrier would never be released.
    fn drop(&mut self) {
        if self.ops.pending() > 0 {
            let _ = self.complete_all();
        }
        crate::engine::settle_posted(
            self,
            std::time::Instant::now() + crate::engine::SETTLE_ON_DROP,
            |memory| memory.ops.all_finished(),
            Self::progress,
        );
        self.release();
        // The pages go back to the allocator: the pin-down cache must not
        // hand their registration to whatever comes to live there.
        self.context
            .invalidate(self.starter.addr(), self.starter.len() as u64);
        self.context
            .invalidate(self.system.addr(), self.system.len() as u64);
    }
}

/// `len` bytes at `offset` fit a registration of `registered` bytes.
fn check_bounds(address: GlobalAddress, offset: u64, len: u64, registered: u64) -> Result<()> {
    if offset.checked_add(len).is_none_or(|end| end > registered)
        || (len == 0 && offset > registered)
    {
        return Err(Error::OutOfBounds {
            address,
            len,
            registered,
        });
    }
    Ok(())
}

/// Every rank's record, placed by the rank it chose; every rank must have
/// set up, chosen a distinct rank and sized its key table alike.
/// The launcher key under which a rank publishes the key of its window
/// over its word of round `round` of `sync`.
fn sync_key_name(generation: u32, round: u32) -> String {
    format!("pindown-acp-{generation}-sync-{round}")
}

/// The windows over this rank's synchronization words, each bound for
/// the one rank that signals it in that round (dissemination: rank
/// `rank - 2^round`), and the keys of the windows of the ranks this rank
/// signals (`rank + 2^round`), exchanged through the launcher: O(log
/// ranks) per rank. `me`: this rank (chosen), every peer by chosen rank,
/// and each chosen rank's rank at the launcher. A collective call: every
/// rank publishes and fences whatever fails locally.
fn sync_windows<'c>(
    context: &'c Context,
    job: &mut Job,
    generation: u32,
    (rank, peers, launcher_ranks): (u32, &[Peer], &[u32]),
    system: &PageMemory,
    words_at: u64,
) -> Result<(Vec<RegionWindow<'c>>, Vec<RemoteKey>)> {
    let size = peers.len() as u32;
    let rounds = (0..SYNC_WORDS as u32).take_while(|&round| 1u64 << round < u64::from(size));
    let mut windows = Vec::new();
    let mut failed = None;
    for round in rounds.clone() {
        let from = peers[((rank + size - (1 << round) % size) % size) as usize];
        // SAFETY: `system` is the rank's own memory, kept (in
        // `GlobalMemory`, after `sync_windows`) until the windows are gone.
        let bound =
            unsafe { context.register(system.addr(), system.len() as u64) }.and_then(|region| {
                context.bind_region_window(
                    region,
                    words_at + 8 * u64::from(round),
                    8,
                    Access::REMOTE_WRITE,
                    Some(PortAddress {
                        node: from.node,
                        port: from.port,
                    }),
                )
            });
        let key = match bound {
            Ok(window) => {
                let key = window.remote().key.0;
                windows.push(window);
                key
            }
            Err(err) => {
                failed.get_or_insert(err);
                0
            }
        };
        job.put(&sync_key_name(generation, round), &key.to_le_bytes())?;
    }
    job.fence()?;
    if let Some(err) = failed {
        return Err(err.into());
    }
    let mut keys = Vec::new();
    for round in rounds {
        let to = (rank + (1 << round) % size) % size;
        let value = job.get(
            launcher_ranks[to as usize],
            &sync_key_name(generation, round),
        )?;
        let key = <[u8; 8]>::try_from(value.as_slice())
            .ok()
            .and_then(|bytes| RemoteKey::try_from(u64::from_le_bytes(bytes)).ok())
            .ok_or_else(|| Error::BadPeerRecord {
                rank: to,
                why: format!(
                    "{} bytes for the key of its synchronization word of round {round}, a \
                     nonzero 8-byte key expected (it failed to set up, or lies)",
                    value.len()
                ),
            })?;
        keys.push(key);
    }
    Ok((windows, keys))
}

/// Every rank's peer record by the rank it chose, and each chosen rank's
/// rank at the launcher.
fn peers_by_chosen_rank(records: &[Vec<u8>], registrations: u32) -> Result<(Vec<Peer>, Vec<u32>)> {
    let size = records.len();
    let mut peers: Vec<Option<Peer>> = vec![None; size];
    let mut launcher_ranks = vec![0; size];
    for (index, record) in records.iter().enumerate() {
        let bad = |why: String| Error::BadPeerRecord {
            rank: index as u32,
            why,
        };
        if record.len() != RECORD_BYTES {
            return Err(bad(format!(
                "{} bytes, {RECORD_BYTES} expected",
                record.len()
            )));
        }
        if record[0] != RECORD_OK {
            return Err(Error::Mismatch(format!(
                "the process the launcher calls rank {index} failed to initialize global memory"
            )));
        }
        let u32_at = |at: usize| u32::from_le_bytes(record[at..at + 4].try_into().unwrap());
        let u64_at = |at: usize| u64::from_le_bytes(record[at..at + 8].try_into().unwrap());
        let chosen = u32_at(4);
        if u32_at(12) != registrations {
            return Err(Error::Mismatch(format!(
                "rank {index} has {} key-table entries, this rank {registrations}: every rank \
                 must use the same Config::registrations",
                u32_at(12)
            )));
        }
        let slot = peers
            .get_mut(chosen as usize)
            .ok_or_else(|| bad(format!("chose rank {chosen} of {size}")))?;
        if slot.is_some() {
            return Err(Error::Mismatch(format!(
                "two processes chose rank {chosen}: the ranks given to reinit must be a \
                 permutation of 0..{size}"
            )));
        }
        *slot = Some(Peer {
            node: u16::from_le_bytes(record[8..10].try_into().unwrap()),
            port: u16::from_le_bytes(record[10..12].try_into().unwrap()),
            directory: RemoteKey(u64_at(16)),
            starter: RemoteKey(u64_at(24)),
            starter_len: u64_at(32),
        });
        launcher_ranks[chosen as usize] = index as u32;
    }
    let peers = peers
        .into_iter()
        .map(|p| p.expect("every rank placed once"))
        .collect();
    Ok((peers, launcher_ranks))
}
