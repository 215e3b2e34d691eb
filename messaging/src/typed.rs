//! Typed messages: MPI datatypes on either side, moved by the device's
//! vector access with no pack and no unpack.
//!
//! A typed receive posts, in the sender's match record, its *offer
//! buffer* instead of its receive buffer, and its pattern's length with
//! [`TYPED_RECEIVE`]. The send finding such a record binds a read window
//! over its buffer and writes an offer there: the window, the offset,
//! the length and its own access pattern; then the done word with
//! [`OFFER_FLAG`]. The receiver reads the bytes with one VECTOR_READ that
//! names both patterns (DIMMnet-2's receiver-driven vector read), then
//! writes a notice into the sender's match record; the send completes on
//! it. A typed send into a plain receive is one VECTOR_WRITE, the remote
//! side contiguous. [`OFFER_FLAG`](crate::layout::OFFER_FLAG) marks the
//! done word of an offer.

use pindown_driver::verbs::opcode::{Entry, Vector, Write};
use pindown_driver::verbs::{MemoryRegion, RemoteWindow};
use pindown_uapi::pattern::Pattern;
use pindown_uapi::queue::MAX_INLINE;
use pindown_uapi::{Access, RemoteAddress, RemoteKey};

use crate::engine::{
    post_entries, stage, Engine, InFlight, Received, SendData, SendTail, PART_BIT, SCRATCH_BODY,
};
use crate::error::{Error, Result};
use crate::layout::{self, MATCH_STAMP_AT, READ_NOTICE, TYPED_RECEIVE};

/// Bytes of an offer buffer: the header and the sender's encoded pattern.
pub const OFFER_BYTES: usize = 64 << 10;
/// Bytes of an offer's header: key, offset, length, pattern bytes.
const OFFER_HEADER: usize = 32;
/// Where in the scratch memory a notice is staged.
const SCRATCH_NOTICE: u64 = 2048;

/// A typed receive's side: its pattern over the receive buffer, and the
/// buffer its sender writes the offer into.
pub(crate) struct TypedRecv {
    pub(crate) pattern: Pattern,
    pub(crate) offer: Box<[u8]>,
}

/// A send matched with its receive's record.
pub(crate) struct Matched {
    pub(crate) peer: u32,
    pub(crate) slot: u64,
    pub(crate) generation: u64,
    pub(crate) key: u64,
    pub(crate) offset: u64,
    pub(crate) capacity: u64,
    pub(crate) any_tag_index: Option<u32>,
    pub(crate) remote_slot: u64,
    pub(crate) record_at: u64,
    pub(crate) receive_generation: u64,
}

/// A typed send waiting for its receiver's notice, holding what the
/// receiver reads.
pub(crate) struct Notice<'c> {
    pub(crate) slot: u64,
    pub(crate) generation: u64,
    record_at: u64,
    receive_generation: u64,
    pub(crate) window_id: u64,
    _data: SendData,
    _offer: Option<(Vec<u8>, MemoryRegion<'c>)>,
}

impl<'c> Engine<'c> {
    /// An offer buffer (reused ones keep their cached window).
    pub(crate) fn take_offer_buffer(&mut self) -> Box<[u8]> {
        self.offer_pool
            .pop()
            .unwrap_or_else(|| vec![0u8; OFFER_BYTES].into_boxed_slice())
    }

    /// Posts a matched send where either side is typed.
    pub(crate) fn post_typed_send(
        &mut self,
        matched: Matched,
        data: SendData,
        pattern: Option<Pattern>,
    ) -> Result<()> {
        let bytes = data.bytes();
        let pattern = pattern.unwrap_or_else(|| Pattern::contiguous(bytes.len() as u64));
        let control = self.peers[matched.peer as usize].block;
        let key = RemoteKey::try_from(matched.key).map_err(|_| Error::BadPeerRecord {
            rank: matched.peer,
            why: "a match record with key 0".into(),
        })?;
        let target = RemoteWindow {
            node: control.node,
            port: control.port,
            key,
            // The offset is the receiver's word: saturate, the device
            // refuses what lies outside its window.
            len: matched.offset.saturating_add(OFFER_BYTES as u64),
        };
        let len = pattern.len;
        let typed_receive = matched.capacity & TYPED_RECEIVE != 0;
        let capacity = matched.capacity & !TYPED_RECEIVE;
        let tag = self.tag();
        let done = self.peer_at(matched.peer, self.layout.done_word(matched.remote_slot));
        let scratch = self.layout.scratch();
        self.windows.refresh(self.context);
        if typed_receive {
            // The offer: a read window over the buffer, and the pattern.
            let (window, start, window_id) = if bytes.is_empty() {
                // Nothing to read: a window of the receiver's, at offset 0.
                (
                    self.block_window_for(matched.peer),
                    bytes.as_ptr() as u64,
                    0,
                )
            } else {
                let receiver = self.peer_port(matched.peer);
                self.windows.acquire_for(
                    self.context,
                    bytes.as_ptr() as u64,
                    bytes.len() as u64,
                    Access::REMOTE_READ,
                    receiver,
                )?
            };
            let encoded = pattern.encode();
            let mut offer = Vec::with_capacity(OFFER_HEADER + encoded.len());
            offer.extend_from_slice(&window.key.0.to_le_bytes());
            offer.extend_from_slice(&(bytes.as_ptr() as u64).wrapping_sub(start).to_le_bytes());
            offer.extend_from_slice(&len.to_le_bytes());
            offer.extend_from_slice(&(encoded.len() as u64).to_le_bytes());
            offer.extend_from_slice(&encoded);
            if offer.len() > OFFER_BYTES {
                if window_id != 0 {
                    self.windows.release(window_id);
                }
                return Err(Error::TooLong {
                    len: offer.len() as u64,
                    limit: OFFER_BYTES as u64,
                });
            }
            let held = if offer.len() > MAX_INLINE as usize {
                // SAFETY: the offer's heap bytes move with the region into
                // the notice kept in `in_flight` until the offer is read
                // (a Vec's move leaves its bytes in place).
                let region = unsafe {
                    self.context
                        .register(offer.as_ptr() as u64, offer.len() as u64)?
                };
                Some(region)
            } else {
                None
            };
            let Engine {
                qp,
                cq,
                completions,
                control: own,
                control_memory,
                ..
            } = &mut *self;
            let own = &*own;
            let mut entries: Vec<Entry<'_>> = Vec::with_capacity(3);
            let offer_entry = match &held {
                Some(region) => Write::new(
                    region.local(0, offer.len() as u32)?,
                    target.at(matched.offset),
                )
                .build(),
                None => {
                    let local = stage(control_memory, own, scratch, SCRATCH_BODY, &offer)?;
                    Write::new(local, target.at(matched.offset))
                        .build()
                        .inline()
                }
            };
            entries.push(offer_entry.user_data(tag | PART_BIT));
            SendTail {
                done,
                any_tag_index: matched.any_tag_index,
                word: layout::done_word(matched.receive_generation, len, true),
                tag,
            }
            .push(control_memory, own, scratch, &mut entries)?;
            post_entries(qp, cq, completions, &entries)?;
            drop(entries);
            let notice = Notice {
                slot: matched.slot,
                generation: matched.generation,
                record_at: matched.record_at,
                receive_generation: matched.receive_generation,
                window_id,
                _data: data,
                _offer: held.map(|region| (offer, region)),
            };
            self.in_flight.insert(tag, InFlight::Offer(notice));
            return Ok(());
        }
        // A typed send into a plain receive: one vector write, the remote
        // side contiguous; too long for the buffer, its first `capacity`
        // bytes fill it (as a contiguous send's do) and the receiver is
        // told the whole length (a truncation error there).
        let moved = len.min(capacity);
        let region = if moved > 0 {
            // SAFETY: `bytes` are the send's, which its owner keeps valid
            // until the send completes (`SendData`'s contract).
            Some(unsafe {
                self.context
                    .register(bytes.as_ptr() as u64, bytes.len() as u64)?
            })
        } else {
            None
        };
        let vector = match &region {
            Some(region) => {
                let source = if moved < len {
                    let plan = pattern
                        .plan()
                        .map_err(|e| Error::Mismatch(format!("the send's pattern: {e}")))?;
                    plan.slice(0, moved)
                } else {
                    pattern
                };
                Some(Vector::write(
                    region.local(0, bytes.len() as u32)?,
                    source,
                    target.at(matched.offset),
                    Pattern::contiguous(moved),
                )?)
            }
            None => None,
        };
        let Engine {
            qp,
            cq,
            completions,
            control: own,
            control_memory,
            ..
        } = &mut *self;
        let own = &*own;
        let mut entries: Vec<Entry<'_>> = Vec::with_capacity(3);
        if let Some(vector) = &vector {
            entries.push(vector.build().user_data(tag | PART_BIT));
        }
        SendTail {
            done,
            any_tag_index: matched.any_tag_index,
            word: layout::done_word(matched.receive_generation, len, false),
            tag,
        }
        .push(control_memory, own, scratch, &mut entries)?;
        post_entries(qp, cq, completions, &entries)?;
        drop(entries);
        drop(vector);
        self.in_flight.insert(
            tag,
            InFlight::Send {
                slot: matched.slot,
                generation: matched.generation,
                _region: region,
                _spool: match data {
                    SendData::Spooled(v) => Some(v),
                    SendData::Borrowed { .. } => None,
                },
            },
        );
        Ok(())
    }

    /// Completes the typed sends whose receivers have read their bytes:
    /// the notice in the match record, or a later receive's stamp there.
    pub(crate) fn check_notices(&mut self) {
        let mut i = 0;
        while i < self.notices.len() {
            let notice = &self.notices[i];
            let first = self.load(notice.record_at);
            let stamp = self.load(notice.record_at + MATCH_STAMP_AT);
            let gone = self.check_peer(self.slot_peer(notice.slot)).err();
            if first == READ_NOTICE | notice.receive_generation
                || stamp > notice.receive_generation
                || gone.is_some()
            {
                let notice = self.notices.swap_remove(i);
                if notice.window_id != 0 {
                    self.windows.release(notice.window_id);
                }
                match gone {
                    Some(err) => self.fail_send(notice.slot, notice.generation, err),
                    None => {
                        let state = &mut self.slots[notice.slot as usize];
                        state.sends_completed = state.sends_completed.max(notice.generation);
                    }
                }
            } else {
                i += 1;
            }
        }
    }

    /// The offer of a typed receive arrived: reads the sender's bytes with
    /// both patterns, or finishes the receive with what is wrong.
    pub(crate) fn start_typed_read(&mut self, slot: u64, len: u64) {
        let peer = self.slot_peer(slot);
        let outcome = self.post_typed_read(slot, peer, len);
        match outcome {
            Ok(Some(tag)) => {
                if let Some(recv) = self.slots[slot as usize].recv.as_mut() {
                    recv.reading = Some(tag);
                }
            }
            Ok(None) => {
                let index = self.slot_index(slot);
                self.notify_sender(slot);
                self.finish_recv(slot, Ok(Received { len: 0, index }));
            }
            Err(err) => {
                self.notify_sender(slot);
                self.finish_recv(slot, Err(err));
            }
        }
    }

    /// The slot index of `slot`.
    fn slot_index(&self, slot: u64) -> u32 {
        self.layout.slot_parts(slot).2
    }

    fn post_typed_read(&mut self, slot: u64, peer: u32, len: u64) -> Result<Option<u64>> {
        let tag = self.tag();
        let control = self.peers[peer as usize].block;
        let Engine {
            slots,
            qp,
            cq,
            completions,
            in_flight,
            ..
        } = &mut *self;
        let recv = slots[slot as usize]
            .recv
            .as_ref()
            .expect("an active typed receive");
        let typed = recv.typed.as_ref().expect("typed");
        let offer = &typed.offer;
        let word = |at: usize| u64::from_le_bytes(offer[at..at + 8].try_into().expect("8 bytes"));
        let (key, offset, offered, encoded_len) = (word(0), word(8), word(16), word(24) as usize);
        if offered != len {
            return Err(Error::Mismatch(format!(
                "the offer says {offered} bytes, the done word {len}"
            )));
        }
        if len > typed.pattern.len {
            return Err(Error::Truncated {
                message: len,
                capacity: typed.pattern.len,
            });
        }
        if len == 0 {
            return Ok(None);
        }
        if len != typed.pattern.len {
            return Err(Error::Mismatch(format!(
                "{len} bytes sent to a typed receive of {} bytes (typed receives take exactly \
                 their type's bytes)",
                typed.pattern.len
            )));
        }
        let remote_pattern = OFFER_HEADER
            .checked_add(encoded_len)
            .and_then(|end| offer.get(OFFER_HEADER..end))
            .ok_or_else(|| Error::Mismatch("an offer longer than its buffer".into()))
            .and_then(|bytes| {
                Pattern::decode(bytes, 0)
                    .map(|(pattern, _)| pattern)
                    .map_err(|e| Error::Mismatch(format!("the sender's pattern: {e}")))
            })?;
        let key = RemoteKey::try_from(key).map_err(|_| Error::BadPeerRecord {
            rank: peer,
            why: "an offer with key 0".into(),
        })?;
        let remote = RemoteAddress {
            node: control.node,
            port: control.port,
            key,
            offset,
        };
        let region = recv.region.as_ref().expect("a typed receive of bytes");
        let vector = Vector::read(
            region.local(0, region.len() as u32)?,
            typed.pattern.clone(),
            remote,
            remote_pattern,
        )?;
        let generation = recv.generation;
        post_entries(
            qp,
            cq,
            completions,
            &[vector.build().user_data(tag).signaled()],
        )?;
        in_flight.insert(tag, InFlight::TypedRead { slot, generation });
        Ok(Some(tag))
    }

    /// Writes the notice of `slot`'s receive into its sender's match record.
    fn notify_sender(&mut self, slot: u64) {
        let Some(generation) = self.slots[slot as usize]
            .recv
            .as_ref()
            .map(|r| r.generation)
        else {
            return;
        };
        let (context, peer, index) = self.layout.slot_parts(slot);
        let record = self
            .layout
            .match_record(self.layout.slot(context, self.rank, index));
        let remote = self.peer_at(peer, record);
        let word = READ_NOTICE | generation;
        if let Err(err) = self.write_small(peer, SCRATCH_NOTICE, &word.to_le_bytes(), remote, true)
        {
            tracing::warn!("the notice of a typed receive could not be posted: {err}");
        }
    }

    /// Finishes the typed receives whose reads completed.
    pub(crate) fn finish_typed_reads(&mut self) -> Result<()> {
        for (slot, generation, failure) in std::mem::take(&mut self.reads_done) {
            let Some(recv) = self.slots[slot as usize].recv.as_ref() else {
                continue;
            };
            if recv.generation != generation {
                continue;
            }
            let len = recv.typed.as_ref().map_or(0, |t| t.pattern.len);
            let index = self.slot_index(slot);
            let result = match failure {
                None => Ok(Received { len, index }),
                Some(err) => Err(self.peer_failure(self.slot_peer(slot), err)),
            };
            self.notify_sender(slot);
            self.finish_recv(slot, result);
        }
        Ok(())
    }
}
