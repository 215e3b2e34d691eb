//! `am_check` scenarios in which one rank plays a hostile peer of the
//! GASNet endpoint with raw writes through the windows it was given (its
//! own queue pair, not the endpoint's calls), and the others check that
//! they keep working and lose nothing.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::{Duration, Instant};

use pindown_driver::arena::DmaBuffer;
use pindown_driver::launch::Job;
use pindown_driver::verbs::opcode::Write;
use pindown_driver::verbs::{
    Completion, CompletionQueue, Context, MemoryRegion, QueuePair, RemoteWindow,
};
use pindown_messaging::gasnet::{Config, Counters, Endpoint, GetMode, Handlers};
use pindown_messaging::Error;
use pindown_uapi::CompletionError;

use super::{Outcome, Tally};

/// Handlers of these scenarios.
const H_ECHO: u8 = 8;
const H_ECHOED: u8 = 9;

/// Runs hostile scenario `scenario`; `counters`: the endpoint's at the
/// end.
pub fn run(
    job: &mut Job,
    context: &Context,
    config: Config,
    scenario: &str,
    counters: &mut Counters,
) -> Outcome {
    let (tally, last) = match scenario {
        "hostile-no-consume" => no_consume(job, context, config)?,
        "hostile-bounce" => bounce(job, context, config)?,
        "hostile-abandoned-get" => abandoned_get(job, context, config)?,
        "hostile-spoofed-pairs" => spoofed_pairs(job, context, config)?,
        other => return Err(format!("unknown scenario {other:?}")),
    };
    *counters = last;
    Ok(tally)
}

/// The windows of a launcher record of the endpoint's exchange (node,
/// port, key, length: 20 bytes each).
fn windows(record: &[u8]) -> Result<Vec<RemoteWindow>, String> {
    record
        .chunks_exact(20)
        .map(|w| {
            let u16_at = |at: usize| u16::from_le_bytes([w[at], w[at + 1]]);
            let u64_at = |at: usize| u64::from_le_bytes(w[at..at + 8].try_into().expect("8 bytes"));
            format!(
                "{}:{}:{:016x}:{}",
                u16_at(0),
                u16_at(2),
                u64_at(4),
                u64_at(12)
            )
            .parse::<RemoteWindow>()
            .map_err(|e| e.to_string())
        })
        .collect()
}

/// Writes through the hostile rank's own queue pair.
struct RawWriter<'c> {
    qp: QueuePair<'c>,
    cq: CompletionQueue<'c>,
    /// Owns the buffer requests read from.
    region: MemoryRegion<'c>,
    posted: usize,
    done: Vec<Completion>,
}

impl<'c> RawWriter<'c> {
    const BYTES: usize = 1 << 16;

    fn new(context: &'c Context) -> Result<Self, String> {
        let buffer = context
            .alloc(Self::BYTES, 4096)
            .map_err(|e| e.to_string())?;
        let region = context.register_owned(buffer).map_err(|e| e.to_string())?;
        let mut cq = context.create_completion_queue();
        let qp = context
            .create_queue_pair(&mut cq)
            .map_err(|e| e.to_string())?;
        Ok(RawWriter {
            qp,
            cq,
            region,
            posted: 0,
            done: Vec::new(),
        })
    }

    fn buffer(&self) -> &DmaBuffer {
        self.region.buffer().expect("an owned region")
    }

    /// Stages `bytes` at `at` of the writer's buffer.
    fn stage(&self, at: usize, bytes: &[u8]) {
        assert!(at + bytes.len() <= Self::BYTES);
        // SAFETY: the range lies inside the writer's buffer (asserted),
        // which no request posted and unfinished reads (callers drain
        // before staging again).
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                self.buffer().as_ptr().add(at),
                bytes.len(),
            )
        };
    }

    /// Writes a packet as the endpoint does (the body, then the stamp
    /// `seq` fenced after it) into slot `(seq - 1) % ring_slots` of the
    /// ring of requests at the start of `rings`, staged at `at`.
    fn packet(
        &mut self,
        rings: &RemoteWindow,
        slot_bytes: u64,
        ring_slots: u64,
        seq: u64,
        body: &[u8],
        at: usize,
    ) -> Result<(), String> {
        let slot = (seq - 1) % ring_slots * slot_bytes;
        self.stage(at, &seq.to_le_bytes());
        self.stage(at + 8, body);
        let local = |offset: usize, len: usize| {
            self.region
                .local(offset as u64, len as u32)
                .map_err(|e| e.to_string())
        };
        let body = Write::new(local(at + 8, body.len())?, rings.at(slot + 8))
            .build()
            .signaled();
        let stamp = Write::new(local(at, 8)?, rings.at(slot))
            .build()
            .inline()
            .fence()
            .signaled();
        self.qp.post(&[body, stamp]).map_err(|e| e.to_string())?;
        self.posted += 2;
        Ok(())
    }

    /// Writes `len` bytes of the writer's buffer (from its start) to
    /// `remote`; what the device answered.
    fn write(
        &mut self,
        remote: pindown_uapi::RemoteAddress,
        len: usize,
    ) -> Result<Result<(), CompletionError>, String> {
        let local = self
            .region
            .local(0, len as u32)
            .map_err(|e| e.to_string())?;
        let entry = Write::new(local, remote).build().signaled();
        self.qp.post(&[entry]).map_err(|e| e.to_string())?;
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut done = Vec::new();
        while done.is_empty() {
            if Instant::now() > deadline {
                return Err("a raw write did not complete".into());
            }
            self.cq.poll_into(&mut done).map_err(|e| e.to_string())?;
        }
        Ok(done[0].result().map(drop))
    }

    /// Waits until every write posted completed; fails if one failed.
    fn drain(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.done.len() < self.posted && Instant::now() < deadline {
            self.cq
                .poll_into(&mut self.done)
                .map_err(|e| e.to_string())?;
            std::thread::yield_now();
        }
        if let Some(failed) = self.done.iter().find_map(|c| c.result().err()) {
            return Err(format!("a raw write failed: {failed}"));
        }
        if self.done.len() < self.posted {
            return Err("raw writes did not complete".into());
        }
        Ok(())
    }
}

/// The body (after the stamp) of a short request to `handler`.
fn short_request(handler: u8, args: &[u32]) -> Vec<u8> {
    let mut body = vec![0u8, 0, handler, args.len() as u8];
    body.extend_from_slice(&0u32.to_le_bytes());
    body.extend_from_slice(&0u64.to_le_bytes());
    for arg in args {
        body.extend_from_slice(&arg.to_le_bytes());
    }
    body
}

/// Three ranks. Rank 0 answers every echo request with a reply. Rank 2
/// writes echo requests into its ring at rank 0 and never consumes
/// anything (no poll): rank 0's replies to it fill its ring of replies,
/// then a ring's worth waits, then rank 0 leaves rank 2's requests in
/// their ring. Rank 2 sends three rings of requests, so rank 0 runs
/// exactly two rings of them and queues exactly one ring of replies.
/// Then rank 1 asks rank 0 for an echo and gets it, not stuck behind the
/// replies to rank 2.
///
/// Nothing here hangs on timing. Rank 0 puts how many of rank 2's
/// requests it has run into rank 2's segment (a put needs no poll
/// there), and rank 2 writes a request only into a slot rank 0 is done
/// with. Rank 2 tells rank 1 (a raw write) once all are in rank 0's
/// ring, and rank 1 asks for its echo only then. (Rank 2 once paced its
/// writes by a 200 us sleep and rank 1 waited a fixed 500 ms: on a
/// loaded machine rank 2 overwrote requests rank 0 had not read, or rank
/// 0 stopped counting before they were all written.)
fn no_consume(
    job: &mut Job,
    context: &Context,
    config: Config,
) -> Result<(Tally, Counters), String> {
    let mut tally = Tally::default();
    if job.size() != 3 {
        return Err("hostile-no-consume runs on 3 ranks".into());
    }
    let ring_slots = u64::from(config.ring_slots);
    let handled = Rc::new(RefCell::new([0u64; 3]));
    let echoed = Rc::new(RefCell::new(0u32));
    let mut handlers = Handlers::new();
    let h = handled.clone();
    handlers.register(H_ECHO, move |token, args, _| {
        h.borrow_mut()[token.source() as usize] += 1;
        let _ = token.reply_short(H_ECHOED, args);
    });
    let e = echoed.clone();
    handlers.register(H_ECHOED, move |_, _, _| *e.borrow_mut() += 1);
    let mut ep =
        Endpoint::new(context, job, config.clone(), handlers).map_err(|e| e.to_string())?;
    ep.barrier().map_err(|e| e.to_string())?;
    // Words of the segments: rank 2's count of its requests rank 0 ran,
    // rank 1's word that all of rank 2's requests are written, rank 0's
    // word that rank 1 had its echo, rank 2's word that rank 0 is done.
    const RAN: usize = 0;
    const ALL_SENT: [u8; 8] = *b"all sent";
    const FLOODED: [u8; 8] = *b"flooded!";
    match ep.rank() {
        0 => {
            let start = Instant::now();
            let mut most_waiting = 0;
            let mut told = 0;
            // Until rank 1 has had its echo and said so.
            while ep.segment()[..8] != FLOODED {
                if start.elapsed() > Duration::from_secs(60) {
                    return Err("rank 1 never said it had its echo".into());
                }
                ep.poll().map_err(|e| format!("poll: {e}"))?;
                most_waiting = most_waiting.max(ep.replies_waiting());
                let ran = handled.borrow()[2];
                if ran != told {
                    ep.put(2, RAN as u64, &ran.to_le_bytes())
                        .map_err(|e| e.to_string())?;
                    told = ran;
                }
            }
            let handled = *handled.borrow();
            let counters = ep.counters();
            tally.notes.push(format!(
                "ran {handled:?}, at most {most_waiting} replies waiting, requests held {} times",
                counters.requests_held
            ));
            ep.put(2, 8, &DONE).map_err(|e| e.to_string())?;
            if handled[2] != 2 * ring_slots || most_waiting as u64 != ring_slots {
                return Err(format!(
                    "ran {} requests of the rank that consumes nothing and queued at most \
                     {most_waiting} replies to it: {} and {ring_slots} expected",
                    handled[2],
                    2 * ring_slots
                ));
            }
            if handled[1] != 1 || counters.requests_held == 0 {
                return Err(format!("rank 1's request ran {} times", handled[1]));
            }
            tally.checked = handled[2] + handled[1];
            Ok((tally, counters))
        }
        1 => {
            await_word(
                &mut ep,
                0,
                &ALL_SENT,
                "rank 2's word that its requests are in",
            )?;
            ep.set_timeout(Duration::from_secs(10));
            let start = Instant::now();
            ep.request_short(0, H_ECHO, &[7])
                .map_err(|e| e.to_string())?;
            ep.wait_until(|_| *echoed.borrow() > 0)
                .map_err(|e| format!("rank 0's reply, behind its replies to rank 2: {e}"))?;
            tally
                .notes
                .push(format!("echo after {:?}", start.elapsed()));
            ep.put(0, 0, &FLOODED).map_err(|e| e.to_string())?;
            tally.checked = 1;
            Ok((tally, ep.counters()))
        }
        _ => {
            let pairs = job
                .get(0, "pindown-gasnet-pairs")
                .map_err(|e| e.to_string())?;
            // Rank 0's rings for this rank (both lanes, requests first).
            let rings = windows(&pairs)?[2 * 2];
            let rank_1 = job.get(1, "pindown-gasnet").map_err(|e| e.to_string())?;
            let rank_1_segment = windows(&rank_1)?[0];
            let mut raw = RawWriter::new(context)?;
            // The first barrier's notice was request 1.
            let mut seq = 2;
            while seq <= 3 * ring_slots + 1 {
                // Every earlier request run, or as many as rank 0 runs
                // before it holds the rest: the slot is free either way.
                let ran = (seq - 2).min(2 * ring_slots);
                let deadline = Instant::now() + Duration::from_secs(60);
                while u64::from_le_bytes(ep.segment()[RAN..RAN + 8].try_into().expect("8 bytes"))
                    < ran
                {
                    if Instant::now() > deadline {
                        return Err(format!("rank 0 never ran {ran} requests"));
                    }
                    std::thread::yield_now();
                }
                let body = short_request(H_ECHO, &[seq as u32]);
                let at = 64 * (seq % 512) as usize;
                raw.packet(
                    &rings,
                    u64::from(config.slot_bytes),
                    ring_slots,
                    seq,
                    &body,
                    at,
                )?;
                raw.drain()?;
                seq += 1;
            }
            tally
                .notes
                .push(format!("sent {} requests, consumed nothing", seq - 2));
            raw.stage(0, &ALL_SENT);
            raw.write(rank_1_segment.at(0), ALL_SENT.len())?
                .map_err(|e| format!("telling rank 1 the requests are in: {e}"))?;
            // Alive (its port open) until rank 0 has looked.
            await_word(&mut ep, 8, &DONE, "rank 0's word that it is done")?;
            tally.checked = 1;
            Ok((tally, ep.counters()))
        }
    }
}

/// Bytes of rank 1's segment the get scenarios read.
const GOT: usize = 4096;
/// What rank 1's segment holds there.
const RANK_1_BYTE: u8 = 0x11;
/// Rank 0 says it is done (into the others' segments).
const DONE: [u8; 8] = *b"all done";
/// Rank 0 says its get from rank 2 gave up (into rank 2's segment, after
/// [`DONE`]'s word).
const GAVE_UP: [u8; 8] = *b"gave up!";
/// Rank 2 says it polls no more (into rank 0's segment, after
/// [`GAVE_UP`]'s word), by a raw write: the endpoint's calls poll.
const SILENT: [u8; 8] = *b"silent!!";

/// Waits, without polling, until `word` of `ep`'s segment holds `value`.
fn await_word(
    ep: &mut Endpoint<'_>,
    word: usize,
    value: &[u8; 8],
    what: &str,
) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(60);
    while ep.segment()[word..word + 8] != *value {
        if Instant::now() > deadline {
            return Err(format!("{what} never came"));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(())
}

/// An endpoint getting by message through a bounce area of [`GOT`] bytes.
fn by_message(config: Config) -> Config {
    Config {
        get: GetMode::ByMessage,
        get_bounce_bytes: GOT,
        ..config
    }
}

/// Polls until rank 0 has put [`DONE`] at `at` of this rank's segment.
fn poll_until_done(ep: &mut Endpoint<'_>, at: usize) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(60);
    while ep.segment()[at..at + 8] != DONE {
        if Instant::now() > deadline {
            return Err("rank 0 never said it was done".into());
        }
        let _ = ep.poll();
        std::thread::yield_now();
    }
    Ok(())
}

/// Fails unless `bytes` are all rank 1's.
fn rank_1_bytes(bytes: &[u8], what: &str) -> Result<(), String> {
    match bytes.iter().position(|&b| b != RANK_1_BYTE) {
        None => Ok(()),
        Some(i) => Err(format!(
            "{what}: byte {i} is {:#x}, not rank 1's {RANK_1_BYTE:#x}",
            bytes[i]
        )),
    }
}

/// Three ranks, gets by message. Rank 0 gets rank 1's bytes again and
/// again while rank 2 writes other bytes, as fast as it can, where rank
/// 0's bounce area lies past its segment window: every such write is
/// refused (the area is only ever bound for the rank a get asks), and
/// every get returns rank 1's bytes.
fn bounce(job: &mut Job, context: &Context, config: Config) -> Result<(Tally, Counters), String> {
    let mut tally = Tally::default();
    if job.size() != 3 {
        return Err("hostile-bounce runs on 3 ranks".into());
    }
    let config = by_message(config);
    let mut ep =
        Endpoint::new(context, job, config.clone(), Handlers::new()).map_err(|e| e.to_string())?;
    ep.segment()[..GOT].fill(RANK_1_BYTE);
    ep.barrier().map_err(|e| e.to_string())?;
    match ep.rank() {
        0 => {
            let mut buffer = vec![0u8; GOT];
            let start = Instant::now();
            let mut gets = 0;
            while start.elapsed() < Duration::from_secs(1) {
                buffer.fill(0);
                ep.get(1, 0, &mut buffer).map_err(|e| format!("get: {e}"))?;
                rank_1_bytes(&buffer, &format!("get {gets}"))?;
                gets += 1;
            }
            for rank in [1, 2] {
                ep.put(rank, GOT as u64, &DONE).map_err(|e| e.to_string())?;
            }
            tally
                .notes
                .push(format!("{gets} gets, every byte rank 1's"));
            tally.checked = gets;
        }
        1 => poll_until_done(&mut ep, GOT)?,
        _ => {
            let record = job.get(0, "pindown-gasnet").map_err(|e| e.to_string())?;
            let segment = windows(&record)?[0];
            let mut raw = RawWriter::new(context)?;
            raw.stage(0, &[0xee; GOT]);
            let mut refused = 0;
            while ep.segment()[GOT..GOT + 8] != DONE {
                // Where the bounce area starts: the segment's end.
                match raw.write(segment.at(segment.len), GOT)? {
                    Ok(()) => return Err("a write into rank 0's bounce area landed".into()),
                    Err(_) => refused += 1,
                }
                let _ = ep.poll();
            }
            if refused == 0 {
                return Err("no write was tried while rank 0 got".into());
            }
            tally.notes.push(format!(
                "{refused} writes into rank 0's bounce area refused"
            ));
            tally.checked = refused;
        }
    }
    ep.barrier().map_err(|e| e.to_string())?;
    Ok((tally, ep.counters()))
}

/// Three ranks, gets by message. Rank 2 stops polling once it has left
/// the barrier and says so (a raw write into rank 0's segment: a get sent
/// while rank 2 still polled in the barrier was answered), and polls
/// again only once rank 0 says (a put into rank 2's segment, which needs
/// no poll there) that its get from rank 2 gave up, after 1 s; rank 0's gets from rank 1 right after
/// go through at once (they wait for no late reply). Rank 2 then answers
/// the get given up: its bytes are refused (the window is gone), which is
/// no failure of rank 2's, and rank 0 takes the late reply as expected,
/// not as a bad packet. (Rank 2 once slept a fixed 3 s instead: on a
/// loaded machine rank 0 could start its get late enough to be answered.)
fn abandoned_get(
    job: &mut Job,
    context: &Context,
    config: Config,
) -> Result<(Tally, Counters), String> {
    let mut tally = Tally::default();
    if job.size() != 3 {
        return Err("hostile-abandoned-get runs on 3 ranks".into());
    }
    let mut ep = Endpoint::new(context, job, by_message(config), Handlers::new())
        .map_err(|e| e.to_string())?;
    ep.segment()[..GOT].fill(RANK_1_BYTE);
    ep.barrier().map_err(|e| e.to_string())?;
    match ep.rank() {
        0 => {
            let mut buffer = vec![0u8; GOT];
            await_word(
                &mut ep,
                GOT + 16,
                &SILENT,
                "rank 2's word that it polls no more",
            )?;
            ep.set_timeout(Duration::from_secs(1));
            if ep.get(2, 0, &mut buffer).is_ok() {
                return Err("a get from a rank that does not poll succeeded".into());
            }
            ep.set_timeout(Duration::from_secs(60));
            ep.put(2, GOT as u64 + 8, &GAVE_UP)
                .map_err(|e| e.to_string())?;
            for n in 0..4 {
                let start = Instant::now();
                buffer.fill(0);
                ep.get(1, 0, &mut buffer)
                    .map_err(|e| format!("get {n} from rank 1 after a get given up: {e}"))?;
                rank_1_bytes(&buffer, &format!("get {n}"))?;
                if start.elapsed() > Duration::from_millis(500) {
                    return Err(format!("get {n} from rank 1 took {:?}", start.elapsed()));
                }
                tally.checked += 1;
            }
            // Rank 2's late reply comes once it polls again.
            std::thread::sleep(Duration::from_secs(3));
            let until = Instant::now() + Duration::from_secs(1);
            while Instant::now() < until {
                ep.poll()
                    .map_err(|e| format!("poll after the late reply: {e}"))?;
            }
            for rank in [1, 2] {
                ep.put(rank, GOT as u64, &DONE).map_err(|e| e.to_string())?;
            }
        }
        1 => poll_until_done(&mut ep, GOT)?,
        _ => {
            let record = job.get(0, "pindown-gasnet").map_err(|e| e.to_string())?;
            let segment = windows(&record)?[0];
            let mut raw = RawWriter::new(context)?;
            raw.stage(0, &SILENT);
            raw.write(segment.at(GOT as u64 + 16), SILENT.len())?
                .map_err(|e| format!("telling rank 0 this rank polls no more: {e}"))?;
            // No poll (the get stays unanswered) until rank 0 gave up.
            await_word(
                &mut ep,
                GOT + 8,
                &GAVE_UP,
                "rank 0's word that its get gave up",
            )?;
            let deadline = Instant::now() + Duration::from_secs(60);
            while ep.segment()[GOT..GOT + 8] != DONE {
                if Instant::now() > deadline {
                    return Err("rank 0 never said it was done".into());
                }
                ep.poll()
                    .map_err(|e| format!("answering the get given up: {e}"))?;
            }
            if ep.counters().get_data_refused != 1 {
                return Err(format!(
                    "{} answers refused, 1 expected (the get given up)",
                    ep.counters().get_data_refused
                ));
            }
            tally.checked = 1;
        }
    }
    ep.barrier().map_err(|e| e.to_string())?;
    Ok((tally, ep.counters()))
}

/// Three ranks. Rank 2 joins the endpoints' two exchanges by hand,
/// publishing a segment window of its own but, as its rings and credit
/// words, rank 0's (read from the launcher before it publishes): had the
/// others taken them, their credit returns for rank 2's packets would
/// have gone into rank 0's credit word for them. Ranks 0 and 1 refuse the
/// record, naming rank 2.
fn spoofed_pairs(
    job: &mut Job,
    context: &Context,
    config: Config,
) -> Result<(Tally, Counters), String> {
    let mut tally = Tally::default();
    if job.size() != 3 {
        return Err("hostile-spoofed-pairs runs on 3 ranks".into());
    }
    if job.rank() == 2 {
        // The shared settings first, as an endpoint publishes them.
        let shape = format!(
            "Config::segment_bytes {}, Config::ring_slots {}, Config::slot_bytes {}",
            config.segment_bytes, config.ring_slots, config.slot_bytes
        );
        job.all_gather("pindown-gasnet-shape", shape.as_bytes())
            .map_err(|e| e.to_string())?;
        let memory = context.alloc(1 << 22, 4096).map_err(|e| e.to_string())?;
        let region = context
            .register_buffer(&memory)
            .map_err(|e| e.to_string())?;
        // As long as an endpoint's segment window (the segment rounded up
        // to 64 bytes).
        let len = (config.segment_bytes as u64).max(1).next_multiple_of(64);
        let own = context
            .bind_region_window(
                region,
                0,
                len,
                pindown_uapi::Access::REMOTE_WRITE | pindown_uapi::Access::REMOTE_READ,
                None,
            )
            .map_err(|e| e.to_string())?;
        let remote = own.remote();
        let mut record = Vec::new();
        record.extend_from_slice(&remote.node.to_le_bytes());
        record.extend_from_slice(&remote.port.to_le_bytes());
        record.extend_from_slice(&remote.key.0.to_le_bytes());
        record.extend_from_slice(&remote.len.to_le_bytes());
        job.all_gather("pindown-gasnet", &record)
            .map_err(|e| e.to_string())?;
        // Rank 0's pair windows, readable before the fence.
        let deadline = Instant::now() + Duration::from_secs(30);
        let pairs = loop {
            match job.get(0, "pindown-gasnet-pairs") {
                Ok(pairs) => break pairs,
                Err(e) if Instant::now() > deadline => return Err(e.to_string()),
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        };
        job.all_gather("pindown-gasnet-pairs", &pairs)
            .map_err(|e| e.to_string())?;
        tally
            .notes
            .push("published rank 0's pair windows as its own".into());
        tally.checked = 1;
        return Ok((tally, Counters::default()));
    }
    match Endpoint::new(context, job, config, Handlers::new()) {
        Err(Error::BadPeerRecord { rank: 2, why }) if why.contains("not its own") => {
            tally.notes.push(format!("refused: {why}"));
            tally.checked = 1;
            Ok((tally, Counters::default()))
        }
        Err(other) => Err(format!("rank 2's record: {other}")),
        Ok(_) => Err("rank 2's record, naming rank 0's windows, was taken".into()),
    }
}
