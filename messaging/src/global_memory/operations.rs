//! Copies and atomics between global addresses, their handles, and the
//! barrier: requests the device runs, wherever the memory is.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use pindown_driver::verbs::opcode::{AtomicTo, Entry, Read, RemoteCopy, Write};
use pindown_driver::verbs::{Completion, CompletionQueue, Context, Local, QueuePair};
use pindown_uapi::{AtomicOp, Bitwise, RemoteAddress, RemoteKey};

use super::directory::{PublishedEntry, ENTRY_BYTES, NULL_ENTRY, STARTER_ENTRY};
use super::{check_bounds, GlobalAddress, GlobalMemory, COLORS, SYNC_WORDS};
use crate::error::{Error, Result};

/// The longest copy one request carries; longer copies go in pieces.
const MAX_PIECE: u64 = 1 << 30;
/// How long a key-table lookup may take before the peer counts as gone.
const LOOKUP_PATIENCE: Duration = Duration::from_secs(10);

/// An operation's handle: [`GlobalMemory::complete`] waits for it and
/// every earlier one. Handles are numbered in the order operations start,
/// from 1 at every init, as ACP's are: a number beyond the last one
/// started stands for all of them (ACP's `ACP_HANDLE_ALL`), and a handle
/// kept from before a re-init names the operation of that number since.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Handle(pub u64);

/// When an operation may start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Order {
    /// Whenever the device gets to it.
    #[default]
    Any,
    /// Only once every earlier operation of this rank finished (ACP's
    /// order attribute).
    AfterEarlier,
}

/// An atomic on a 4- or 8-byte word (the old value goes to a destination
/// global address).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Atomic {
    /// Stores `swap` if the 4-byte word equals `compare`.
    CompareSwap4 {
        /// The value expected.
        compare: u32,
        /// The value stored when it matched.
        swap: u32,
    },
    /// Stores `swap` if the 8-byte word equals `compare`.
    CompareSwap8 {
        /// The value expected.
        compare: u64,
        /// The value stored when it matched.
        swap: u64,
    },
    /// Stores the value in a 4-byte word.
    Swap4(u32),
    /// Stores the value in an 8-byte word.
    Swap8(u64),
    /// Adds to a 4-byte word (wrapping).
    Add4(u32),
    /// Adds to an 8-byte word (wrapping).
    Add8(u64),
    /// ANDs into a 4-byte word.
    And4(u32),
    /// ANDs into an 8-byte word.
    And8(u64),
    /// ORs into a 4-byte word.
    Or4(u32),
    /// ORs into an 8-byte word.
    Or8(u64),
    /// XORs into a 4-byte word.
    Xor4(u32),
    /// XORs into an 8-byte word.
    Xor8(u64),
}

impl Atomic {
    /// The device's operation and the word's width in bytes.
    fn request(self) -> (AtomicOp, u64) {
        let bitwise = |op, mask| AtomicOp::Bitwise { op, mask };
        match self {
            Atomic::CompareSwap4 { compare, swap } => (
                AtomicOp::CompareSwap {
                    compare: compare.into(),
                    swap: swap.into(),
                },
                4,
            ),
            Atomic::CompareSwap8 { compare, swap } => (AtomicOp::CompareSwap { compare, swap }, 8),
            Atomic::Swap4(value) => (
                AtomicOp::Swap {
                    value: value.into(),
                },
                4,
            ),
            Atomic::Swap8(value) => (AtomicOp::Swap { value }, 8),
            Atomic::Add4(add) => (AtomicOp::FetchAdd { add: add.into() }, 4),
            Atomic::Add8(add) => (AtomicOp::FetchAdd { add }, 8),
            Atomic::And4(mask) => (bitwise(Bitwise::And, mask.into()), 4),
            Atomic::And8(mask) => (bitwise(Bitwise::And, mask), 8),
            Atomic::Or4(mask) => (bitwise(Bitwise::Or, mask.into()), 4),
            Atomic::Or8(mask) => (bitwise(Bitwise::Or, mask), 8),
            Atomic::Xor4(mask) => (bitwise(Bitwise::Xor, mask.into()), 4),
            Atomic::Xor8(mask) => (bitwise(Bitwise::Xor, mask), 8),
        }
    }
}

/// What a request in flight was for.
#[derive(Clone, Copy, Debug)]
enum Request {
    /// A piece of a copy.
    Copy {
        handle: u64,
        destination: GlobalAddress,
        source: GlobalAddress,
        len: u64,
    },
    /// An atomic.
    Atomic {
        handle: u64,
        destination: GlobalAddress,
        word: GlobalAddress,
        atomic: Atomic,
    },
    /// A barrier signal.
    Signal,
}

impl Request {
    fn handle(&self) -> Option<u64> {
        match *self {
            Request::Copy { handle, .. } | Request::Atomic { handle, .. } => Some(handle),
            Request::Signal => None,
        }
    }
}

/// What a rank's operations did ([`GlobalMemory::counters`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Requests posted (copies count their pieces).
    pub posted: u64,
    /// Other ranks' key-table entries read.
    pub lookups: u64,
    /// Operations that failed.
    pub failed: u64,
}

/// The queue pair and the bookkeeping of requests in flight.
pub(crate) struct Operations<'c> {
    qp: QueuePair<'c>,
    cq: CompletionQueue<'c>,
    /// Completions reaped and not yet handled.
    stash: Vec<Completion>,
    next_tag: u64,
    next_handle: u64,
    requests: HashMap<u64, Request>,
    /// Handles not finished, with their requests in flight.
    open: BTreeMap<u64, u32>,
    /// Failures of finished handles, until `complete` reports them.
    failures: BTreeMap<u64, Error>,
    /// A barrier signal that failed.
    signal_failure: Option<Error>,
    pub(crate) counters: Counters,
}

impl<'c> Operations<'c> {
    pub(crate) fn new(context: &'c Context) -> Result<Self> {
        let mut cq = context.create_completion_queue();
        let qp = context.create_queue_pair(&mut cq)?;
        Ok(Operations {
            qp,
            cq,
            stash: Vec::new(),
            next_tag: 1,
            next_handle: 1,
            requests: HashMap::new(),
            open: BTreeMap::new(),
            failures: BTreeMap::new(),
            signal_failure: None,
            counters: Counters::default(),
        })
    }

    /// Handles not finished.
    pub(crate) fn pending(&self) -> usize {
        self.open.len()
    }

    /// Bytes of bookkeeping held now.
    pub(crate) fn bytes(&self) -> u64 {
        (self.stash.capacity() * std::mem::size_of::<Completion>()
            + self.requests.capacity() * std::mem::size_of::<(u64, Request)>()) as u64
    }

    /// Whether the device has finished every request posted (a failed
    /// look counts as finished: nothing more will).
    pub(crate) fn all_finished(&mut self) -> bool {
        !matches!(self.qp.all_finished(), Ok(false))
    }

    fn tag(&mut self) -> u64 {
        let tag = self.next_tag;
        self.next_tag += 1;
        tag
    }

    fn post(&mut self, entries: &[Entry<'_>]) -> Result<()> {
        self.counters.posted += entries.len() as u64;
        crate::engine::post_entries(&mut self.qp, &mut self.cq, &mut self.stash, entries)
    }

    /// Waits for the completion tagged `tag`, keeping the others.
    fn wait_tag(&mut self, tag: u64, peer: u32) -> Result<Completion> {
        let started = Instant::now();
        loop {
            if let Some(at) = self.stash.iter().position(|c| c.user_data == tag) {
                return Ok(self.stash.remove(at));
            }
            self.cq.poll_into(&mut self.stash)?;
            if started.elapsed() > LOOKUP_PATIENCE {
                return Err(Error::PeerGone {
                    peer,
                    why: format!("its key table did not answer within {LOOKUP_PATIENCE:?}"),
                });
            }
            std::thread::yield_now();
        }
    }
}

impl GlobalMemory<'_> {
    /// Copies `len` bytes from `source` to `destination`: global
    /// addresses on any ranks, this one, one peer, or two others (ACP's
    /// `acp_copy`). Both ranges are checked against their registrations
    /// first. The source may not change, nor the destination be read,
    /// until the handle completes.
    pub fn copy(
        &mut self,
        destination: GlobalAddress,
        source: GlobalAddress,
        len: u64,
        order: Order,
    ) -> Result<Handle> {
        let to = self.resolve(destination, len)?;
        let from = self.resolve(source, len)?;
        let handle = self.open_handle();
        let mut done = 0;
        let mut first = true;
        while done < len || first {
            let piece = (len - done).min(MAX_PIECE);
            let tag = self.ops.tag();
            let mut entry = RemoteCopy::new(shift(from, done), shift(to, done), piece as u32)
                .build()
                .user_data(tag)
                .signaled();
            if first && order == Order::AfterEarlier {
                entry = entry.fence();
            }
            self.track(
                tag,
                Request::Copy {
                    handle,
                    destination: destination.plus(done),
                    source: source.plus(done),
                    len: piece,
                },
            );
            self.post_or_fail(tag, &[entry])?;
            done += piece;
            first = false;
        }
        Ok(Handle(handle))
    }

    /// Runs `atomic` on the word at `word` (4 or 8 bytes, aligned, on any
    /// rank) and writes its old value to `destination` (on any rank):
    /// ACP's `acp_cas4`/`acp_cas8`, `acp_swap`, `acp_add`, `acp_and`,
    /// `acp_or`, `acp_xor`. The device runs it atomically with respect to
    /// every initiator and the owner's CPU.
    pub fn atomic(
        &mut self,
        destination: GlobalAddress,
        word: GlobalAddress,
        atomic: Atomic,
        order: Order,
    ) -> Result<Handle> {
        let (_, width) = atomic.request();
        let at = self.resolve(word, width)?;
        let to = self.resolve(destination, width)?;
        let handle = self.open_handle();
        let tag = self.ops.tag();
        let mut entry = atomic_entry(at, to, atomic).user_data(tag).signaled();
        if order == Order::AfterEarlier {
            entry = entry.fence();
        }
        self.track(
            tag,
            Request::Atomic {
                handle,
                destination,
                word,
                atomic,
            },
        );
        self.post_or_fail(tag, &[entry])?;
        Ok(Handle(handle))
    }

    /// Waits until `handle` and every operation started before it have
    /// finished (ACP's `acp_complete`); reports the first failure among
    /// them.
    pub fn complete(&mut self, handle: Handle) -> Result<()> {
        while self.ops.open.range(..=handle.0).next().is_some() {
            self.progress()?;
            std::thread::yield_now();
        }
        let failed: Vec<u64> = self
            .ops
            .failures
            .range(..=handle.0)
            .map(|(&h, _)| h)
            .collect();
        let mut first = None;
        for h in failed {
            let err = self.ops.failures.remove(&h).expect("listed");
            first.get_or_insert(err);
        }
        first.map_or(Ok(()), Err)
    }

    /// What this rank's operations did so far.
    pub fn counters(&self) -> Counters {
        self.ops.counters
    }

    /// Waits for every operation started so far.
    pub fn complete_all(&mut self) -> Result<()> {
        self.complete(Handle(self.ops.next_handle.saturating_sub(1)))
    }

    /// Whether `handle` and every earlier operation finished, without
    /// waiting (ACP's `acp_inquire`); failures are reported by
    /// [`complete`](Self::complete).
    pub fn inquire(&mut self, handle: Handle) -> Result<bool> {
        self.progress()?;
        Ok(self.ops.open.range(..=handle.0).next().is_none())
    }

    /// A barrier across every rank (ACP's `acp_sync`), after this rank's
    /// operations completed: when it returns, every rank's operations
    /// started before it have landed. Dissemination over one word per
    /// round in each rank's memory, written by the device through a
    /// window bound for the one rank that signals in that round, so no
    /// other rank can release it; that rank's word more than one barrier
    /// ahead of this rank's (no member can be) fails it with
    /// [`Error::BadPeerRecord`] naming the writer. The signals of one
    /// barrier land before the next barrier's go (plain writes may land
    /// out of order across the fabric).
    pub fn sync(&mut self) -> Result<()> {
        self.complete_all()?;
        let size = self.size();
        if size == 1 {
            return Ok(());
        }
        // Signals are plain writes, which the fabric may land out of
        // order: the last synchronization's must have landed before this
        // one's go, or a late one (a datagram sent again) could set a word
        // back below the epoch its owner already saw, and the owner would
        // wait for ever.
        self.land_signals()?;
        self.sync_epoch += 1;
        let epoch = self.sync_epoch;
        let flags_at = self.sync_words_at();
        // Staged in the DMA arena, so that each signal carries the epoch
        // inline: the device must not read `system` for it after `sync`
        // returns (the rank may finalize at once, and the memory go).
        self.signal_word.write_at(0, &epoch.to_le_bytes());
        let mut round = 0u64;
        let mut distance = 1u32;
        while distance < size {
            let partner = (self.rank + distance) % size;
            let peer = self.peers[partner as usize];
            let tag = self.ops.tag();
            // SAFETY: the word lies in the DMA arena and is at most
            // MAX_INLINE bytes, so posting copies it into the send queue
            // (an inline write): the device never reads the buffer, which
            // lives as long as `self` anyway.
            let word = unsafe { Local::from_raw(self.signal_word.iova(), 8) };
            let entry = Write::new(word, peer.address(self.sync_keys[round as usize], 0))
                .build()
                .inline()
                .user_data(tag)
                .signaled();
            self.ops.requests.insert(tag, Request::Signal);
            self.ops.post(&[entry])?;
            let from = (self.rank + size - distance) % size;
            let started = Instant::now();
            // SAFETY: the flag words lie inside `system` (SYNC_WORDS words
            // after the key table), 8-aligned in page-aligned memory; peers
            // write them through the device with aligned 8-byte stores.
            let flag = unsafe {
                AtomicU64::from_ptr((self.system.addr() + flags_at + round * 8) as *mut u64)
            };
            // Acquire: what the peer wrote before its signal is seen after.
            loop {
                let signalled = flag.load(Ordering::Acquire);
                if signalled > epoch + 1 {
                    return Err(Error::BadPeerRecord {
                        rank: from,
                        why: format!(
                            "synchronization {signalled} signalled while this rank is in {epoch}: \
                             no rank can be more than one ahead"
                        ),
                    });
                }
                if signalled >= epoch {
                    break;
                }
                self.progress()?;
                if let Some(err) = self.ops.signal_failure.take() {
                    return Err(err);
                }
                if started.elapsed() > self.config.sync_timeout {
                    return Err(Error::PeerGone {
                        peer: from,
                        why: format!("no barrier signal within {:?}", self.config.sync_timeout),
                    });
                }
                std::thread::yield_now();
            }
            round += 1;
            distance *= 2;
        }
        debug_assert!(round <= SYNC_WORDS);
        Ok(())
    }

    /// Waits until every barrier signal this rank sent has landed (or
    /// failed: then that failure).
    fn land_signals(&mut self) -> Result<()> {
        let started = Instant::now();
        loop {
            self.progress()?;
            if let Some(err) = self.ops.signal_failure.take() {
                return Err(err);
            }
            let in_flight = self
                .ops
                .requests
                .values()
                .any(|r| matches!(r, Request::Signal));
            if !in_flight {
                return Ok(());
            }
            if started.elapsed() > self.config.sync_timeout {
                return Err(Error::Operation {
                    what: "a barrier signal".into(),
                    why: format!("not finished within {:?}", self.config.sync_timeout),
                });
            }
            std::thread::yield_now();
        }
    }

    /// Handles what the device finished.
    pub(crate) fn progress(&mut self) -> Result<()> {
        self.ops.cq.poll_into(&mut self.ops.stash)?;
        while !self.ops.stash.is_empty() {
            let batch = std::mem::take(&mut self.ops.stash);
            for completion in batch {
                self.finish(completion)?;
            }
        }
        Ok(())
    }

    fn finish(&mut self, completion: Completion) -> Result<()> {
        let Some(request) = self.ops.requests.remove(&completion.user_data) else {
            return Ok(());
        };
        let failure = match (completion.result(), request) {
            (Ok(_), _) => None,
            (Err(err), Request::Signal) => {
                self.ops.signal_failure = Some(err.into());
                return Ok(());
            }
            (Err(err), _) => Some(self.describe_failure(&request, err)),
        };
        self.close(request, failure)
    }

    /// One request of its handle finished.
    fn close(&mut self, request: Request, failure: Option<Error>) -> Result<()> {
        let Some(handle) = request.handle() else {
            return Ok(());
        };
        if let Some(err) = failure {
            self.ops.counters.failed += 1;
            self.ops.failures.entry(handle).or_insert(err);
        }
        let left = self
            .ops
            .open
            .get_mut(&handle)
            .expect("open while in flight");
        *left -= 1;
        if *left == 0 {
            self.ops.open.remove(&handle);
        }
        Ok(())
    }

    /// The error of a request the device failed: a registration of
    /// another rank that went away since it was looked up gives
    /// [`Error::NoSuchKey`] (its entry is looked up again to tell), any
    /// other failure the device's answer. A request is never posted
    /// again: an atomic may have changed its word before failing to
    /// deliver the old value.
    fn describe_failure(&mut self, request: &Request, err: pindown_uapi::CompletionError) -> Error {
        let (what, addresses) = match *request {
            Request::Copy {
                destination,
                source,
                len,
                ..
            } => (
                format!("copying {len} bytes from {source} to {destination}"),
                [source, destination],
            ),
            Request::Atomic {
                destination,
                word,
                atomic,
                ..
            } => (
                format!(
                    "{atomic:?} on {word} (old value to {destination}; the word may have \
                     changed if only the delivery failed)"
                ),
                [word, destination],
            ),
            Request::Signal => return err.into(),
        };
        for address in addresses {
            let fields = self.layout.fields(address);
            let (index, _) = self.layout.split_entry(fields.entry);
            if fields.rank != self.rank && index != STARTER_ENTRY {
                self.remote.remove(&(fields.rank, index));
                if let Err(gone @ Error::NoSuchKey { .. }) = self.remote_entry(address) {
                    return gone;
                }
            }
        }
        Error::Operation {
            what,
            why: err.to_string(),
        }
    }

    fn open_handle(&mut self) -> u64 {
        let handle = self.ops.next_handle;
        self.ops.next_handle += 1;
        self.ops.open.insert(handle, 0);
        handle
    }

    fn track(&mut self, tag: u64, request: Request) {
        let handle = request.handle().expect("operations have handles");
        *self.ops.open.get_mut(&handle).expect("opened") += 1;
        self.ops.requests.insert(tag, request);
    }

    /// Posts `entries`; if that fails, the request tagged `tag` fails
    /// its handle (which still completes).
    fn post_or_fail(&mut self, tag: u64, entries: &[Entry<'_>]) -> Result<()> {
        if let Err(err) = self.ops.post(entries) {
            let request = self.ops.requests.remove(&tag).expect("tracked");
            let text = err.to_string();
            self.close(
                request,
                Some(Error::Operation {
                    what: "posting a request".into(),
                    why: text,
                }),
            )?;
            return Err(err);
        }
        Ok(())
    }

    /// Where `len` bytes at `address` are, as the device names them,
    /// checked against the registration.
    fn resolve(&mut self, address: GlobalAddress, len: u64) -> Result<RemoteAddress> {
        let fields = self.layout.fields(address);
        self.check_rank(fields.rank)?;
        if fields.color >= COLORS {
            return Err(Error::NoSuchColor {
                color: fields.color,
                colors: COLORS,
            });
        }
        if fields.rank == self.rank {
            let (registered, offset) = self.local_entry(address, len)?;
            return Ok(registered.window().remote().at(offset));
        }
        let peer = self.peers[fields.rank as usize];
        if fields.entry == self.layout.entry(STARTER_ENTRY, 0) {
            check_bounds(address, fields.offset, len, peer.starter_len)?;
            return Ok(peer.address(peer.starter, fields.offset));
        }
        let mut entry = self.remote_entry(address)?;
        if check_bounds(address, fields.offset, len, entry.len).is_err() {
            // The registration may have grown since it was looked up.
            let (index, _) = self.layout.split_entry(fields.entry);
            self.remote.remove(&(fields.rank, index));
            entry = self.remote_entry(address)?;
        }
        check_bounds(address, fields.offset, len, entry.len)?;
        Ok(peer.address(RemoteKey(entry.key), fields.offset))
    }

    /// Another rank's key-table entry for `address`: cached, or read from
    /// its key table; it must be live, of the address's color and
    /// generation (else the registration the address named is gone).
    pub(super) fn remote_entry(&mut self, address: GlobalAddress) -> Result<PublishedEntry> {
        let fields = self.layout.fields(address);
        self.check_rank(fields.rank)?;
        let (index, _) = self.layout.split_entry(fields.entry);
        if index == NULL_ENTRY {
            return Err(self.gone(address));
        }
        let layout = self.layout;
        let names = move |entry: &PublishedEntry| {
            entry.valid
                && entry.index == index
                && entry.color == fields.color
                && layout.entry(index, entry.generation) == fields.entry
        };
        let id = (fields.rank, index);
        if let Some((entry, _)) = self.remote.get(&id) {
            if names(entry) {
                return Ok(*entry);
            }
        }
        let entry = self.read_entry(fields.rank, index)?;
        let Some(entry) = entry.filter(|e| names(e)) else {
            self.remote.remove(&id);
            return Err(self.gone(address));
        };
        while self.remote_order.len() >= self.config.remote_entries.max(1) {
            let Some((oldest, lookup)) = self.remote_order.pop_front() else {
                break;
            };
            if self.remote.get(&oldest).is_some_and(|&(_, l)| l == lookup) {
                self.remote.remove(&oldest);
            }
        }
        let lookup = self.next_lookup;
        self.next_lookup += 1;
        self.remote.insert(id, (entry, lookup));
        self.remote_order.push_back((id, lookup));
        Ok(entry)
    }

    /// Reads entry `index` of `rank`'s key table; `None` if the device
    /// refuses (past the table's end) .
    fn read_entry(&mut self, rank: u32, index: u32) -> Result<Option<PublishedEntry>> {
        self.ops.counters.lookups += 1;
        let peer = self.peers[rank as usize];
        let staging = self.staging_offset() + 64;
        let tag = self.ops.tag();
        let read = Read::new(
            self.directory_window
                .region()
                .local(staging, ENTRY_BYTES as u32)?,
            peer.address(peer.directory, u64::from(index) * ENTRY_BYTES),
        )
        .build()
        .user_data(tag)
        .signaled();
        self.ops.post(&[read])?;
        let completion = self.ops.wait_tag(tag, rank)?;
        if completion.result().is_err() {
            return Ok(None);
        }
        let mut bytes = [0u8; ENTRY_BYTES as usize];
        // SAFETY: the staging area lies inside `system` and the read that
        // filled it completed; no request targets it now.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (self.system.addr() + staging) as *const u8,
                bytes.as_mut_ptr(),
                bytes.len(),
            )
        };
        Ok(Some(PublishedEntry::decode(&bytes)))
    }

    /// Offset in `system` of the synchronization words.
    fn sync_words_at(&self) -> u64 {
        u64::from(self.registrations.capacity()) * ENTRY_BYTES
    }

    /// Offset in `system` of the staging area.
    fn staging_offset(&self) -> u64 {
        self.sync_words_at() + SYNC_WORDS * 8
    }
}

/// `address` moved `by` bytes on.
fn shift(address: RemoteAddress, by: u64) -> RemoteAddress {
    RemoteAddress {
        offset: address.offset + by,
        ..address
    }
}

fn atomic_entry(word: RemoteAddress, destination: RemoteAddress, atomic: Atomic) -> Entry<'static> {
    let (op, width) = atomic.request();
    let request = AtomicTo::new(word, op, destination);
    if width == 4 {
        request.four_bytes().build()
    } else {
        request.build()
    }
}
