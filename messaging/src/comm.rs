//! The public face: a rank's [`Messenger`], its [`Communicator`]s, and
//! the requests of nonblocking calls.

use std::cell::{RefCell, RefMut};
use std::ops::{Deref, DerefMut};
use std::rc::Rc;
use std::time::{Duration, Instant};

use pindown_driver::datatype::Committed;
use pindown_driver::launch::Job;
use pindown_driver::verbs::Context;
use pindown_uapi::pattern::Pattern;
use pindown_uapi::queue::MAX_INLINE;
use stable_deref_trait::StableDeref;

use crate::engine::{Config, Engine, Received, SendBytes};
use crate::error::{Error, Result};
use crate::typed::TypedRecv;

/// What [`Messenger::sendbuf_check`] reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpoolStatus {
    /// Spooled messages that have gone out to their receives so far.
    pub sent: u64,
    /// Spooled messages still waiting for their receives.
    pub spooled: u64,
}

/// Receive-window cache counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WindowCacheCounts {
    /// Receives that found their window bound.
    pub hits: u64,
    /// Receives that bound one.
    pub misses: u64,
}

pub(crate) type Shared<'c> = Rc<RefCell<Engine<'c>>>;

/// One rank's message passing: the engine under every communicator of
/// the rank. Single-threaded (as MPI_THREAD_FUNNELED): it and its
/// communicators are neither `Send` nor `Sync`.
pub struct Messenger<'c> {
    engine: Shared<'c>,
}

impl<'c> Messenger<'c> {
    /// Joins the job's message passing through `context` (this rank's
    /// port): takes two of the context's queue pairs (one for messages,
    /// one that asks the device whether it still answers: see
    /// [`Config::liveness_interval`](crate::Config::liveness_interval)),
    /// allocates the control memory (matching slots, done words,
    /// any-source rings, collective words), binds its windows (one per
    /// peer, for that peer's port alone, and one over the collective
    /// words) and exchanges every rank's through the launcher's key-value
    /// space (collective over the job).
    pub fn new(context: &'c Context, job: &mut Job, config: Config) -> Result<Self> {
        let engine = Engine::new(context, job, config)?;
        Ok(Messenger {
            engine: Rc::new(RefCell::new(engine)),
        })
    }

    /// The communicator of every rank of the job.
    pub fn world(&self) -> Communicator<'c> {
        let size = self.engine.borrow().world_size();
        let rank = self.engine.borrow().rank;
        Communicator {
            engine: self.engine.clone(),
            context: 0,
            ranks: (0..size).collect(),
            rank,
            owns_context: false,
        }
    }

    /// The timeout switch: how long a blocking send waits for its receive
    /// before it spools the message and returns (`Some(ZERO)`: buffered
    /// mode; `None`: synchronous mode).
    pub fn set_send_timeout(&self, timeout: Option<Duration>) {
        self.engine.borrow_mut().config.send_timeout = timeout;
    }

    /// The timeout switch's setting.
    pub fn send_timeout(&self) -> Option<Duration> {
        self.engine.borrow().config.send_timeout
    }

    /// Progresses (spooled messages whose receives appeared go out) and
    /// reports how many spooled messages have gone and how many wait; or
    /// the failure of a send that had returned already (a spooled one, or
    /// a short one whose bytes went inline with the request).
    pub fn sendbuf_check(&self) -> Result<SpoolStatus> {
        let mut engine = self.engine.borrow_mut();
        engine.progress()?;
        if let Some(err) = engine.take_deferred_failure() {
            return Err(err);
        }
        Ok(SpoolStatus {
            sent: engine.spool_sent(),
            spooled: engine.spooled(),
        })
    }

    /// Leaves message passing cleanly: waits (at most `timeout`) until
    /// every send has gone out, spooled ones included, and the device has
    /// finished every request, reporting any failure of a send that had
    /// returned. Dropping the messenger only lets posted requests finish.
    ///
    /// Communicators outlive the messenger, but no call starts on them
    /// after this ([`Error::Finalized`]), whatever its outcome.
    pub fn finalize(self, timeout: Duration) -> Result<()> {
        let mut engine = self.engine.borrow_mut();
        let flushed = engine.flush(timeout);
        engine.finalized = true;
        flushed
    }

    /// Progresses every pending operation once, without waiting.
    pub fn progress(&self) -> Result<()> {
        self.engine.borrow_mut().progress()
    }

    /// Makes waits on world rank `peer` find it gone from `at` on, as a
    /// liveness check that goes unanswered does: for tests of what calls
    /// do when a peer that is still there counts as gone.
    #[doc(hidden)]
    pub fn declare_gone_at(&self, peer: u32, at: std::time::Instant) -> Result<()> {
        let mut engine = self.engine.borrow_mut();
        if peer as usize >= engine.peers.len() {
            return Err(Error::Unsuitable(format!("no rank {peer}")));
        }
        engine.declare_gone_at(peer, at);
        Ok(())
    }

    /// Writes `bytes` (at most 64) at `offset` of world rank `peer`'s
    /// control memory and waits for the write, as a hostile or broken
    /// peer could: for tests of what a rank does with words it did not
    /// expect. Offsets come from [`layout::Layout`](crate::layout::Layout)
    /// ([`control_layout`](Self::control_layout)).
    #[doc(hidden)]
    pub fn write_peer_control(&self, peer: u32, offset: u64, bytes: &[u8]) -> Result<()> {
        let remote = self.engine.borrow().try_peer_at(peer, offset);
        let remote = remote.ok_or_else(|| {
            Error::Unsuitable(format!(
                "offset {offset} lies in no window of a peer open to this rank"
            ))
        })?;
        self.write_forged(peer, remote, bytes)
    }

    /// Writes `bytes` (at most 64) at `offset` of the window `key` names
    /// at world rank `peer`'s port, as a rank holding a leaked key could;
    /// waits for the write.
    #[doc(hidden)]
    pub fn write_peer_window(&self, peer: u32, key: u64, offset: u64, bytes: &[u8]) -> Result<()> {
        let port = self.engine.borrow().peer_port(peer);
        let key = pindown_uapi::RemoteKey::try_from(key)
            .map_err(|_| Error::Unsuitable("a window key of 0".into()))?;
        let remote = pindown_uapi::RemoteAddress {
            node: port.node,
            port: port.port,
            key,
            offset,
        };
        self.write_forged(peer, remote, bytes)
    }

    fn write_forged(
        &self,
        peer: u32,
        remote: pindown_uapi::RemoteAddress,
        bytes: &[u8],
    ) -> Result<()> {
        if bytes.len() > 64 {
            return Err(Error::Unsuitable(
                "a forged control write holds at most 64 bytes".into(),
            ));
        }
        let mut engine = self.engine.borrow_mut();
        let tag = engine.write_small(peer, 0, bytes, remote, true)?;
        let deadline = Instant::now() + Duration::from_secs(10);
        engine.wait_until(Some(peer), Some(deadline), |e| e.plain_done(tag))?;
        Ok(())
    }

    /// The key of the window world rank `peer` bound over this rank's
    /// block of its control memory (for this rank's port alone).
    #[doc(hidden)]
    pub fn block_key_at(&self, peer: u32) -> u64 {
        self.engine.borrow().peers[peer as usize].block.key.0
    }

    /// The word at `offset` of this rank's own control memory.
    #[doc(hidden)]
    pub fn own_control_word(&self, offset: u64) -> u64 {
        self.engine.borrow().load(offset)
    }

    /// The layout of every rank's control memory.
    #[doc(hidden)]
    pub fn control_layout(&self) -> crate::layout::Layout {
        self.engine.borrow().layout
    }

    /// Receive-window cache counters.
    pub fn window_cache_counts(&self) -> WindowCacheCounts {
        let (hits, misses) = self.engine.borrow().windows.counts();
        WindowCacheCounts { hits, misses }
    }

    /// The any-source domain's unexpected queue now: messages that
    /// arrived before a receive matched them, and how often a sender was
    /// held back at [`Config::unexpected_per_sender`].
    pub fn any_backlog(&self) -> crate::AnyBacklog {
        self.engine.borrow().any.backlog()
    }
}

/// A group of ranks with its own matching slots: messages of one
/// communicator never match receives of another. Point-to-point calls
/// name a peer by its rank in the communicator and a slot index (the
/// tag) below [`Config::slots`].
pub struct Communicator<'c> {
    pub(crate) engine: Shared<'c>,
    /// Point-to-point context; collectives use the next one.
    pub(crate) context: u32,
    /// World rank of each member.
    pub(crate) ranks: Vec<u32>,
    pub(crate) rank: u32,
    owns_context: bool,
}

impl Drop for Communicator<'_> {
    fn drop(&mut self) {
        if self.owns_context {
            if let Ok(mut engine) = self.engine.try_borrow_mut() {
                // After a failed collective call, requests of its members
                // may still be posted on the contexts; after a refused one
                // that a member took part in, it may still wait for its
                // record: they stay taken, so that no later communicator
                // meets them.
                let (ranks, me) = (&self.ranks, self.rank);
                if crate::collective::keeps_contexts(&mut engine, self.context + 1, ranks, me) {
                    return;
                }
                engine.contexts_taken[self.context as usize] = false;
                engine.contexts_taken[self.context as usize + 1] = false;
                crate::collective::release_context(&mut engine, self.context + 1);
            }
        }
    }
}

impl std::fmt::Debug for Communicator<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("context", &self.context)
            .field("rank", &self.rank)
            .field("size", &self.ranks.len())
            .finish()
    }
}

impl<'c> Communicator<'c> {
    /// This rank's rank in the communicator.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Ranks in the communicator.
    pub fn size(&self) -> u32 {
        self.ranks.len() as u32
    }

    /// The world rank of member `rank`.
    pub fn world_rank(&self, rank: u32) -> Result<u32> {
        self.ranks
            .get(rank as usize)
            .copied()
            .ok_or(Error::NoSuchRank {
                rank,
                size: self.size(),
            })
    }

    pub(crate) fn engine(&self) -> RefMut<'_, Engine<'c>> {
        self.engine.borrow_mut()
    }

    fn check_index(&self, index: u32) -> Result<()> {
        let slots = self.engine.borrow().config.slots;
        if index >= slots {
            return Err(Error::SlotOutOfRange { index, slots });
        }
        Ok(())
    }

    /// Sends `data` to `dest` on slot `index`: zero copy into the receive
    /// buffer once the receive is posted (into its landing buffer, for a
    /// receive of at most 512 bytes). Waits for the receive at most the
    /// timeout switch's time ([`Messenger::set_send_timeout`]), then copies
    /// the message into the spool and returns; the spooled copy goes out
    /// when the receive appears (from any later call).
    pub fn send(&self, dest: u32, index: u32, data: &[u8]) -> Result<()> {
        self.send_on(self.context, dest, index, data)
    }

    pub(crate) fn send_on(&self, context: u32, dest: u32, index: u32, data: &[u8]) -> Result<()> {
        let peer = self.world_rank(dest)?;
        let mut engine = self.engine();
        let timeout = engine.config.send_timeout;
        let (slot, generation) = engine.start_send(
            context,
            peer,
            index,
            SendBytes::Borrowed {
                ptr: data.as_ptr(),
                len: data.len() as u64,
            },
            None,
        )?;
        let deadline = timeout.and_then(crate::records::deadline_after);
        let posted =
            engine.wait_until(
                Some(peer),
                deadline,
                |e| Ok(e.send_posted(slot, generation)),
            );
        match posted {
            Ok(true) => {}
            Ok(false) => {
                engine.spool(slot, generation);
                engine.defer_failure(slot, generation);
                return Ok(());
            }
            Err(err) => {
                // The bytes may still be needed by a later progress call.
                engine.spool(slot, generation);
                return Err(err);
            }
        }
        if data.len() <= MAX_INLINE as usize {
            // The bytes went inline with the request: the buffer is free
            // now. A later failure is kept for wait_send and
            // Messenger::sendbuf_check.
            return match engine.take_send_failure(slot, generation) {
                Some(err) => Err(err),
                None => {
                    engine.defer_failure(slot, generation);
                    Ok(())
                }
            };
        }
        let done = engine.wait_until(Some(peer), None, |e| Ok(e.send_completed(slot, generation)));
        if let Err(err) = done {
            // Posted and not complete: wait for the device (bounded by
            // its own timeouts) before the caller's buffer is released.
            let _ = engine.wait_until(None, Some(Instant::now() + Duration::from_secs(30)), |e| {
                Ok(e.send_completed(slot, generation))
            });
            return Err(err);
        }
        match engine.take_send_failure(slot, generation) {
            Some(err) => Err(err),
            None => Ok(()),
        }
    }

    /// Receives from `source` on slot `index` into `buffer`; returns the
    /// message's length. A message longer than the buffer fills it and
    /// fails with [`Error::Truncated`]; nothing is written past it.
    pub fn recv(&self, source: u32, index: u32, buffer: &mut [u8]) -> Result<usize> {
        self.check_index(index)?;
        self.recv_on(self.context, source, index, buffer)
            .map(|r| r.len as usize)
    }

    /// Receives the next message from `source` sent on any slot index: a
    /// send finds this receive when no receive is posted on its own index.
    /// There is no order between any-index and explicit-index receives.
    pub fn recv_any_index(&self, source: u32, buffer: &mut [u8]) -> Result<Received> {
        let any = self.engine.borrow().any_tag_index();
        self.recv_on(self.context, source, any, buffer)
    }

    pub(crate) fn recv_on(
        &self,
        context: u32,
        source: u32,
        index: u32,
        buffer: &mut [u8],
    ) -> Result<Received> {
        let peer = self.world_rank(source)?;
        let mut engine = self.engine();
        let (slot, generation) = engine.post_recv(
            context,
            peer,
            index,
            buffer.as_mut_ptr(),
            buffer.len() as u64,
        )?;
        wait_recv(&mut engine, peer, slot, generation)
    }

    /// Starts a send of `buffer` to `dest` on slot `index` and returns at
    /// once; the request gives the buffer back when the send completed. The
    /// message goes out when its receive is posted (from any later call on
    /// this rank).
    ///
    /// ```no_run
    /// # fn f(world: &pindown_messaging::Communicator<'_>) -> pindown_messaging::Result<()> {
    /// // Exchange with a neighbour: post the receive, start the send, compute, wait.
    /// let peer = (world.rank() + 1) % world.size();
    /// let from = (world.rank() + world.size() - 1) % world.size();
    /// let incoming = world.irecv(from, 3, vec![0u8; 1 << 20])?;
    /// let outgoing = world.isend(peer, 3, vec![7u8; 1 << 20])?;
    /// // ... computation overlaps the transfer ...
    /// let (data, received) = incoming.wait()?;
    /// let buffer = outgoing.wait()?; // the send buffer, reusable
    /// assert_eq!(received.len as usize, data.len());
    /// # Ok(()) }
    /// ```
    pub fn isend<B>(&self, dest: u32, index: u32, buffer: B) -> Result<SendRequest<'c, B>>
    where
        B: StableDeref + Deref<Target = [u8]> + 'static,
    {
        self.check_index(index)?;
        let peer = self.world_rank(dest)?;
        let (slot, generation) = self.engine().start_send(
            self.context,
            peer,
            index,
            SendBytes::Borrowed {
                ptr: buffer.as_ptr(),
                len: buffer.len() as u64,
            },
            None,
        )?;
        Ok(SendRequest {
            engine: self.engine.clone(),
            peer,
            slot,
            generation,
            buffer: Some(buffer),
        })
    }

    /// Posts a receive of at most `buffer.len()` bytes from `source` on
    /// slot `index` and returns at once (posting early overlaps the
    /// network round trip with computation); the request gives the buffer
    /// back with what arrived.
    pub fn irecv<B>(&self, source: u32, index: u32, buffer: B) -> Result<RecvRequest<'c, B>>
    where
        B: StableDeref + DerefMut<Target = [u8]> + 'static,
    {
        self.check_index(index)?;
        self.irecv_at(source, index, buffer)
    }

    /// [`irecv`](Self::irecv) on any slot index (see
    /// [`recv_any_index`](Self::recv_any_index)).
    pub fn irecv_any_index<B>(&self, source: u32, buffer: B) -> Result<RecvRequest<'c, B>>
    where
        B: StableDeref + DerefMut<Target = [u8]> + 'static,
    {
        let any = self.engine.borrow().any_tag_index();
        self.irecv_at(source, any, buffer)
    }

    fn irecv_at<B>(&self, source: u32, index: u32, mut buffer: B) -> Result<RecvRequest<'c, B>>
    where
        B: StableDeref + DerefMut<Target = [u8]> + 'static,
    {
        let peer = self.world_rank(source)?;
        let (slot, generation) = self.engine().post_recv(
            self.context,
            peer,
            index,
            buffer.as_mut_ptr(),
            buffer.len() as u64,
        )?;
        Ok(RecvRequest {
            engine: self.engine.clone(),
            peer,
            slot,
            generation,
            buffer: Some(buffer),
            result: None,
        })
    }

    /// Waits for the receive posted on (`source`, `index`), as FMPL names
    /// requests; its request handle then finds it complete. Fails with
    /// [`Error::NoRequest`] when none is outstanding or waiting to be
    /// taken by its handle.
    pub fn wait_recv(&self, source: u32, index: u32) -> Result<()> {
        self.check_index(index)?;
        let peer = self.world_rank(source)?;
        let mut engine = self.engine();
        let slot = engine.layout.slot(self.context, peer, index);
        let Some(generation) = engine.recv_generation(slot) else {
            return Err(Error::NoRequest {
                what: "receive",
                peer: source,
                index,
            });
        };
        engine.wait_until(Some(peer), None, |e| {
            Ok(!e.recv_outstanding(slot, generation))
        })?;
        Ok(())
    }

    /// Waits for the sends started on (`dest`, `index`) since the last such
    /// wait, as FMPL names requests. Fails with [`Error::NoRequest`] when
    /// there is none.
    pub fn wait_send(&self, dest: u32, index: u32) -> Result<()> {
        self.check_index(index)?;
        let peer = self.world_rank(dest)?;
        let mut engine = self.engine();
        let slot = engine.layout.slot(self.context, peer, index);
        let Some(generation) = engine.claim_sends(slot) else {
            return Err(Error::NoRequest {
                what: "send",
                peer: dest,
                index,
            });
        };
        engine.wait_until(Some(peer), None, |e| Ok(e.send_completed(slot, generation)))?;
        Ok(())
    }

    /// A reusable send of `buffer` to `dest` on slot `index` (FMPL's
    /// pre-built transfer descriptor; MPI's persistent request): the
    /// checks are done once, and [`PersistentSend::start`] sends the
    /// buffer's current contents.
    pub fn send_init<B>(&self, dest: u32, index: u32, buffer: B) -> Result<PersistentSend<'c, B>>
    where
        B: StableDeref + Deref<Target = [u8]> + 'static,
    {
        self.check_index(index)?;
        let peer = self.world_rank(dest)?;
        Ok(PersistentSend {
            engine: self.engine.clone(),
            context: self.context,
            peer,
            index,
            active: None,
            buffer: Some(buffer),
        })
    }

    /// A reusable receive into `buffer` from `source` on slot `index`.
    pub fn recv_init<B>(&self, source: u32, index: u32, buffer: B) -> Result<PersistentRecv<'c, B>>
    where
        B: StableDeref + DerefMut<Target = [u8]> + 'static,
    {
        self.check_index(index)?;
        let peer = self.world_rank(source)?;
        Ok(PersistentRecv {
            engine: self.engine.clone(),
            context: self.context,
            peer,
            index,
            active: None,
            buffer: Some(buffer),
        })
    }

    /// Sends `count` elements of `datatype` laid out from the start of
    /// `buffer` (as MPI lays out a typed buffer) to `dest` on slot
    /// `index`, with no pack: into a typed receive, the receiver reads the
    /// elements straight from `buffer` with one vector read naming both
    /// layouts (and tells this rank when it is done); into a plain receive,
    /// one vector write lands them contiguous. Returns once the bytes have
    /// moved (the timeout switch spools a typed send as it does any other).
    ///
    /// ```no_run
    /// # fn f(world: &pindown_messaging::Communicator<'_>) -> Result<(), Box<dyn std::error::Error>> {
    /// use pindown_driver::datatype::Datatype;
    /// // Column 0 of a 1000 x 1000 matrix of doubles, into 1000 contiguous doubles.
    /// let column = Datatype::vector(1000, 1, 1000, &Datatype::f64())?.commit()?;
    /// let dense = Datatype::contiguous(1000, &Datatype::f64())?.commit()?;
    /// if world.rank() == 0 {
    ///     let matrix = vec![0u8; 1000 * 1000 * 8];
    ///     world.send_typed(1, 0, &matrix, 1, &column)?;
    /// } else if world.rank() == 1 {
    ///     let mut values = vec![0u8; 1000 * 8];
    ///     world.recv_typed(0, 0, &mut values, 1, &dense)?;
    /// }
    /// # Ok(()) }
    /// ```
    pub fn send_typed(
        &self,
        dest: u32,
        index: u32,
        buffer: &[u8],
        count: u64,
        datatype: &Committed,
    ) -> Result<()> {
        self.check_index(index)?;
        let peer = self.world_rank(dest)?;
        let mut engine = self.engine();
        let pattern = typed_pattern(&mut engine, buffer.len(), count, datatype)?;
        let timeout = engine.config.send_timeout;
        let (slot, generation) = engine.start_send(
            self.context,
            peer,
            index,
            SendBytes::Borrowed {
                ptr: buffer.as_ptr(),
                len: buffer.len() as u64,
            },
            Some(pattern),
        )?;
        let deadline = timeout.and_then(crate::records::deadline_after);
        match engine.wait_until(
            Some(peer),
            deadline,
            |e| Ok(e.send_posted(slot, generation)),
        ) {
            Ok(true) => {}
            Ok(false) => {
                engine.spool(slot, generation);
                engine.defer_failure(slot, generation);
                return Ok(());
            }
            Err(err) => {
                engine.spool(slot, generation);
                return Err(err);
            }
        }
        engine.wait_until(Some(peer), None, |e| Ok(e.send_completed(slot, generation)))?;
        match engine.take_send_failure(slot, generation) {
            Some(err) => Err(err),
            None => Ok(()),
        }
    }

    /// Receives `count` elements of `datatype` into `buffer` (laid out from
    /// its start) from `source` on slot `index`: the receiver-driven vector
    /// read of [`send_typed`](Self::send_typed) (a plain send works too:
    /// its bytes are read as a contiguous layout). The message must carry
    /// exactly the type's bytes: more is [`Error::Truncated`], fewer
    /// [`Error::Mismatch`]; nothing moves then. Returns the bytes received.
    pub fn recv_typed(
        &self,
        source: u32,
        index: u32,
        buffer: &mut [u8],
        count: u64,
        datatype: &Committed,
    ) -> Result<usize> {
        self.check_index(index)?;
        let peer = self.world_rank(source)?;
        let mut engine = self.engine();
        let pattern = typed_pattern(&mut engine, buffer.len(), count, datatype)?;
        let offer = engine.take_offer_buffer();
        let (slot, generation) = engine.post_recv_as(
            self.context,
            peer,
            index,
            buffer.as_mut_ptr(),
            buffer.len() as u64,
            Some(TypedRecv { pattern, offer }),
        )?;
        wait_recv(&mut engine, peer, slot, generation).map(|r| r.len as usize)
    }

    /// A context free on every member, taken on this one.
    fn agree_context(&self) -> Result<u32> {
        let free: Vec<u8> = self
            .engine
            .borrow()
            .contexts_taken
            .chunks(2)
            .map(|pair| u8::from(!pair[0] && !pair[1]))
            .collect();
        let all = self.exchange(crate::collective::Exchange::FreeContexts, &free)?;
        let contexts = self.engine.borrow().contexts_taken.len() as u32;
        let pair = (0..free.len())
            .find(|&i| free[i] == 1 && all.iter().all(|f| f[i] == 1))
            .ok_or(Error::NoContext { contexts })?;
        let context = pair as u32 * 2;
        let mut engine = self.engine();
        engine.contexts_taken[context as usize] = true;
        engine.contexts_taken[context as usize + 1] = true;
        Ok(context)
    }

    /// A communicator of the same ranks with its own slots (collective).
    pub fn dup(&self) -> Result<Communicator<'c>> {
        let context = self.agree_context()?;
        crate::collective::made_from(&mut self.engine(), context + 1, self.context + 1);
        Ok(Communicator {
            engine: self.engine.clone(),
            context,
            ranks: self.ranks.clone(),
            rank: self.rank,
            owns_context: true,
        })
    }

    /// Splits the communicator (collective): members giving the same
    /// `color` form a new communicator, ordered by `key` then by rank here;
    /// `None` takes no part and gets `None`.
    pub fn split(&self, color: Option<u32>, key: u32) -> Result<Option<Communicator<'c>>> {
        let mut mine = [0u8; 9];
        mine[0] = u8::from(color.is_some());
        mine[1..5].copy_from_slice(&color.unwrap_or(0).to_le_bytes());
        mine[5..9].copy_from_slice(&key.to_le_bytes());
        let all = self.exchange(crate::collective::Exchange::SplitColors, &mine)?;
        let context = self.agree_context()?;
        let Some(color) = color else {
            let mut engine = self.engine();
            engine.contexts_taken[context as usize] = false;
            engine.contexts_taken[context as usize + 1] = false;
            return Ok(None);
        };
        let mut members: Vec<(u32, u32)> = all
            .iter()
            .enumerate()
            .filter(|(_, r)| r[0] == 1 && u32::from_le_bytes(r[1..5].try_into().unwrap()) == color)
            .map(|(rank, r)| (u32::from_le_bytes(r[5..9].try_into().unwrap()), rank as u32))
            .collect();
        members.sort_unstable();
        let ranks: Vec<u32> = members
            .iter()
            .map(|&(_, r)| self.ranks[r as usize])
            .collect();
        // This rank's own entry came back unchanged (`exchange`).
        let rank = members
            .iter()
            .position(|&(_, r)| r == self.rank)
            .ok_or_else(|| Error::BadPeerRecord {
                rank: self.ranks[0],
                why: "its table of colors left this rank out of its own".into(),
            })? as u32;
        crate::collective::made_from(&mut self.engine(), context + 1, self.context + 1);
        Ok(Some(Communicator {
            engine: self.engine.clone(),
            context,
            ranks,
            rank,
            owns_context: true,
        }))
    }
}

/// The pattern of `count` elements of `datatype` over a buffer of
/// `buffer_len` bytes, checked to lie inside it.
fn typed_pattern(
    engine: &mut Engine<'_>,
    buffer_len: usize,
    count: u64,
    datatype: &Committed,
) -> Result<Pattern> {
    let lookup = engine
        .datatypes
        .get(datatype, count)
        .map_err(|e| Error::Mismatch(format!("datatype: {e}")))?;
    let pattern = lookup.descriptor.pattern.clone();
    let hull = pattern
        .plan()
        .map_err(|e| Error::Mismatch(format!("datatype pattern: {e}")))?
        .hull();
    if let Some((low, high)) = hull {
        if low < 0 || high > buffer_len as i64 {
            return Err(Error::Mismatch(format!(
                "{count} elements of the datatype span bytes [{low}, {high}) of a \
                 {buffer_len}-byte buffer"
            )));
        }
    }
    Ok(pattern)
}

/// Waits for receive `generation` on `slot` and takes its result.
fn wait_recv(engine: &mut Engine<'_>, peer: u32, slot: u64, generation: u64) -> Result<Received> {
    let waited = engine.wait_until(Some(peer), None, |e| {
        Ok(!e.recv_outstanding(slot, generation))
    });
    if let Err(err) = waited {
        // The caller's buffer goes back with the error: no write may land
        // in it later.
        engine.withdraw_recv(slot, generation);
        return Err(err);
    }
    engine
        .take_recv(slot, generation)
        .unwrap_or(Err(Error::NoRequest {
            what: "receive",
            peer,
            index: 0,
        }))
}

/// The buffer of a request dropped before operation `generation` on
/// `slot` completed: the engine keeps it until the device is done with it
/// (a send still waiting for its receive is spooled first, and a later
/// failure of it is reported as a returned send's). If the engine is
/// borrowed (a drop during one of its own calls), the buffer is leaked
/// rather than freed under the device.
fn abandon<B: 'static>(engine: &Shared<'_>, slot: u64, generation: u64, is_send: bool, buffer: B) {
    let Ok(mut engine) = engine.try_borrow_mut() else {
        std::mem::forget(buffer);
        return;
    };
    let finished = if is_send {
        engine.send_completed(slot, generation)
    } else {
        !engine.recv_outstanding(slot, generation)
    };
    if finished {
        if !is_send {
            // The result, if nobody took it, frees the slot with the request.
            engine.take_recv(slot, generation);
        }
        return;
    }
    if is_send {
        engine.spool(slot, generation);
        engine.defer_failure(slot, generation);
    }
    engine.adopt(slot, generation, is_send, Box::new(buffer));
}

/// A nonblocking send; [`wait`](Self::wait) gives the buffer back.
/// Dropped before completing, it keeps the buffer until the send completes.
pub struct SendRequest<'c, B: 'static> {
    engine: Shared<'c>,
    peer: u32,
    slot: u64,
    generation: u64,
    buffer: Option<B>,
}

impl<B: 'static> SendRequest<'_, B> {
    /// Whether the send completed (progressing once); its failure, if it
    /// failed.
    pub fn test(&mut self) -> Result<bool> {
        let mut engine = self.engine.borrow_mut();
        engine.progress()?;
        if !engine.send_completed(self.slot, self.generation) {
            return Ok(false);
        }
        match engine.take_send_failure(self.slot, self.generation) {
            Some(err) => Err(err),
            None => Ok(true),
        }
    }

    /// Waits for the send to complete and gives the buffer back.
    pub fn wait(mut self) -> Result<B> {
        let (slot, generation) = (self.slot, self.generation);
        {
            let mut engine = self.engine.borrow_mut();
            engine.wait_until(Some(self.peer), None, |e| {
                Ok(e.send_completed(slot, generation))
            })?;
            if let Some(err) = engine.take_send_failure(slot, generation) {
                return Err(err);
            }
        }
        Ok(self.buffer.take().expect("the buffer until wait"))
    }
}

impl<B: 'static> Drop for SendRequest<'_, B> {
    fn drop(&mut self) {
        if let Some(buffer) = self.buffer.take() {
            abandon(&self.engine, self.slot, self.generation, true, buffer);
        }
    }
}

/// A nonblocking receive; [`wait`](Self::wait) gives the buffer back with
/// what arrived.
pub struct RecvRequest<'c, B: 'static> {
    engine: Shared<'c>,
    peer: u32,
    slot: u64,
    generation: u64,
    buffer: Option<B>,
    result: Option<Result<Received>>,
}

impl<B: 'static> RecvRequest<'_, B> {
    /// Whether the receive completed (progressing once).
    pub fn test(&mut self) -> Result<bool> {
        if self.result.is_some() {
            return Ok(true);
        }
        let mut engine = self.engine.borrow_mut();
        engine.progress()?;
        if engine.recv_outstanding(self.slot, self.generation) {
            engine.check_peer(self.peer)?;
            return Ok(false);
        }
        self.result = engine.take_recv(self.slot, self.generation);
        Ok(true)
    }

    /// Waits for the message; gives the buffer back and what arrived.
    pub fn wait(mut self) -> Result<(B, Received)> {
        let result = match self.result.take() {
            Some(result) => result,
            None => wait_recv(
                &mut self.engine.borrow_mut(),
                self.peer,
                self.slot,
                self.generation,
            ),
        };
        // A failed wait (the peer gone, a liveness check unanswered) may
        // leave the receive posted: the buffer stays with the request,
        // whose drop hands it to the engine until nothing can land in it.
        let received = result?;
        let buffer = self.buffer.take().expect("the buffer until wait");
        Ok((buffer, received))
    }
}

impl<B: 'static> Drop for RecvRequest<'_, B> {
    fn drop(&mut self) {
        if let Some(buffer) = self.buffer.take() {
            abandon(&self.engine, self.slot, self.generation, false, buffer);
        }
    }
}

/// A reusable send (see [`Communicator::send_init`]).
pub struct PersistentSend<'c, B: 'static> {
    engine: Shared<'c>,
    context: u32,
    peer: u32,
    index: u32,
    active: Option<(u64, u64)>,
    buffer: Option<B>,
}

impl<B: StableDeref + Deref<Target = [u8]> + 'static> PersistentSend<'_, B> {
    /// Sends the buffer's current contents; fails if the previous start
    /// has not been waited for.
    pub fn start(&mut self) -> Result<()> {
        if self.active.is_some() {
            return Err(Error::SlotBusy {
                peer: self.peer,
                index: self.index,
            });
        }
        let buffer = self.buffer.as_ref().expect("held");
        let started = self.engine.borrow_mut().start_send(
            self.context,
            self.peer,
            self.index,
            SendBytes::Borrowed {
                ptr: buffer.as_ptr(),
                len: buffer.len() as u64,
            },
            None,
        )?;
        self.active = Some(started);
        Ok(())
    }

    /// Waits for the started send to complete.
    pub fn wait(&mut self) -> Result<()> {
        let Some((slot, generation)) = self.active else {
            return Err(Error::NoRequest {
                what: "send",
                peer: self.peer,
                index: self.index,
            });
        };
        let mut engine = self.engine.borrow_mut();
        engine.wait_until(Some(self.peer), None, |e| {
            Ok(e.send_completed(slot, generation))
        })?;
        self.active = None;
        match engine.take_send_failure(slot, generation) {
            Some(err) => Err(err),
            None => Ok(()),
        }
    }

    /// The buffer, to change between sends.
    pub fn buffer_mut(&mut self) -> Option<&mut B> {
        if self.active.is_some() {
            return None;
        }
        self.buffer.as_mut()
    }
}

impl<B: 'static> Drop for PersistentSend<'_, B> {
    fn drop(&mut self) {
        if let (Some((slot, generation)), Some(buffer)) = (self.active, self.buffer.take()) {
            abandon(&self.engine, slot, generation, true, buffer);
        }
    }
}

/// A reusable receive (see [`Communicator::recv_init`]).
pub struct PersistentRecv<'c, B: 'static> {
    engine: Shared<'c>,
    context: u32,
    peer: u32,
    index: u32,
    active: Option<(u64, u64)>,
    buffer: Option<B>,
}

impl<B: StableDeref + DerefMut<Target = [u8]> + 'static> PersistentRecv<'_, B> {
    /// Posts the receive.
    pub fn start(&mut self) -> Result<()> {
        let buffer = self.buffer.as_mut().expect("held");
        let posted = self.engine.borrow_mut().post_recv(
            self.context,
            self.peer,
            self.index,
            buffer.as_mut_ptr(),
            buffer.len() as u64,
        )?;
        self.active = Some(posted);
        Ok(())
    }

    /// Waits for the message; the buffer holds it.
    pub fn wait(&mut self) -> Result<Received> {
        let Some((slot, generation)) = self.active.take() else {
            return Err(Error::NoRequest {
                what: "receive",
                peer: self.peer,
                index: self.index,
            });
        };
        let mut engine = self.engine.borrow_mut();
        let result = wait_recv(&mut engine, self.peer, slot, generation);
        if result.is_err() && engine.recv_outstanding(slot, generation) {
            // Still posted (the wait failed on a liveness check): the
            // receive stays active, so the buffer is not handed out and a
            // drop gives it to the engine until nothing can land in it.
            self.active = Some((slot, generation));
        }
        result
    }

    /// The buffer, between receives.
    pub fn buffer(&self) -> Option<&B> {
        if self.active.is_some() {
            return None;
        }
        self.buffer.as_ref()
    }
}

impl<B: 'static> Drop for PersistentRecv<'_, B> {
    fn drop(&mut self) {
        if let (Some((slot, generation)), Some(buffer)) = (self.active, self.buffer.take()) {
            abandon(&self.engine, slot, generation, false, buffer);
        }
    }
}
