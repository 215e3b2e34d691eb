//! Global memory at its edges: each scenario asserts one promise of the
//! module (or one demand of ACP) where it is easiest to break, and fails
//! with the reason when it does not hold. `msg_check launch N
//! acp-edge-<name>`.

use pindown_driver::launch::Job;
use pindown_driver::verbs::Context;
use pindown_messaging::global_memory::{
    Atomic, Config, GlobalAddress, GlobalMemory, Order, OFFSET_BITS,
};
use pindown_messaging::Error;

use super::Tally;

type Outcome = Result<Tally, String>;

fn err<E: std::fmt::Display>(what: &'static str) -> impl Fn(E) -> String {
    move |e| format!("{what}: {e}")
}

/// Runs edge scenario `name`.
pub fn run(job: &mut Job, context: &Context, name: &str) -> Outcome {
    match name {
        "acp-edge-reuse" => reuse(job, context),
        "acp-edge-plus" => plus(job, context),
        "acp-edge-extend" => extend(job, context),
        "acp-edge-initas" => init_as(job, context),
        "acp-edge-memuse" => memuse(job, context),
        "acp-edge-edges" => edges(job, context),
        "acp-edge-properties" => properties(job, context),
        "acp-edge-order" => order(job, context),
        "acp-edge-stale-pin" => stale_pin(job, context),
        "acp-edge-evict" => evict(job, context),
        "acp-edge-hostile-sync" => hostile_sync(job, context),
        other => Err(format!("unknown scenario {other:?}")),
    }
}

/// A global address of a deregistered key must be refused (issue 12);
/// once its entry is reused it silently names the new registration.
fn reuse(job: &mut Job, context: &Context) -> Outcome {
    let mut memory = GlobalMemory::init(context, job, Config::default()).map_err(err("init"))?;
    let mut a = vec![0u8; 4096];
    let mut b = vec![0u8; 4096];
    // SAFETY: `a` outlives its registration (taken back right away).
    let key_a = unsafe { memory.register(a.as_mut_ptr(), 4096, 0) }.map_err(err("register a"))?;
    let stale = memory.address(key_a, a.as_ptr()).map_err(err("address"))?;
    memory.deregister(key_a).map_err(err("deregister a"))?;
    // Register and take back other memory until the entry comes round.
    let mut cycles = 0;
    let key_b = loop {
        // SAFETY: `b` outlives every registration of it.
        let key = unsafe { memory.register(b.as_mut_ptr(), 4096, 0) }.map_err(err("register b"))?;
        cycles += 1;
        if key == key_a || cycles > 10_000 {
            break key;
        }
        memory.deregister(key).map_err(err("deregister b"))?;
    };
    let me = memory
        .starter_address(memory.rank())
        .map_err(err("starter"))?;
    memory
        .write_local(me, &0xdead_beef_u64.to_le_bytes())
        .map_err(err("write_local"))?;
    let outcome = memory
        .copy(stale.plus(8), me, 8, Order::Any)
        .and_then(|h| memory.complete(h));
    let landed = u64::from_le_bytes(b[8..16].try_into().unwrap());
    let result = match outcome {
        Err(Error::NoSuchKey { .. }) if landed == 0 => Ok(Tally::default()),
        other => Err(format!(
            "after {cycles} register/deregister cycles the deregistered key {key_a} is {} again; \
             copying to its old global address {stale} gave {other:?} and the NEW registration's \
             bytes 8..16 now hold {landed:#x}",
            if key_b == key_a { "live" } else { "not" }
        )),
    };
    memory.deregister(key_b).ok();
    memory.finalize().ok();
    drop((a, b));
    result
}

/// `GlobalAddress::plus` is documented not to carry into the entry field
/// ("an address past a registration's end is refused when used").
fn plus(job: &mut Job, context: &Context) -> Outcome {
    let mut memory = GlobalMemory::init(context, job, Config::default()).map_err(err("init"))?;
    let mut buffer = vec![0u8; 16 << 10];
    let base = buffer.as_mut_ptr();
    // SAFETY: `buffer` outlives both registrations.
    let key_a = unsafe { memory.register(base, 4096, 0) }.map_err(err("register a"))?;
    // SAFETY: as above; 4 KiB apart from `a`, so no merge.
    let key_b = unsafe { memory.register(base.add(8192), 4096, 0) }.map_err(err("register b"))?;
    let ga_a = memory.address(key_a, base).map_err(err("address"))?;
    let past = ga_a.plus(1 << OFFSET_BITS);
    let me = memory
        .starter_address(memory.rank())
        .map_err(err("starter"))?;
    memory
        .write_local(me, &0x1234_5678_u64.to_le_bytes())
        .map_err(err("write_local"))?;
    let outcome = memory
        .copy(past, me, 8, Order::Any)
        .and_then(|h| memory.complete(h));
    let landed = u64::from_le_bytes(buffer[8192..8200].try_into().unwrap());
    let result = match outcome {
        Err(Error::OutOfBounds { .. }) => Ok(Tally::default()),
        other => Err(format!(
            "{ga_a}.plus(1 << {OFFSET_BITS}) = {past} (key b is {key_b}); copying 8 bytes there \
             gave {other:?} and registration b's first word is now {landed:#x}"
        )),
    };
    memory.deregister(key_a).ok();
    memory.deregister(key_b).ok();
    memory.finalize().ok();
    drop(buffer);
    result
}

/// Registering memory adjacent to a registration must not fail this
/// rank's operations in flight on it.
fn extend(job: &mut Job, context: &Context) -> Outcome {
    let mut memory = GlobalMemory::init(context, job, Config::default()).map_err(err("init"))?;
    const HALF: usize = 16 << 20;
    let mut buffer = vec![7u8; 2 * HALF];
    let base = buffer.as_mut_ptr();
    // Pinned ahead (the pin-down cache's hit), so that registering the
    // adjacent half costs only a window bind.
    // SAFETY: `buffer` outlives the region (declared before it); the
    // device reaches it only through the keys registered below.
    let pinned = unsafe { context.register(base as u64, 2 * HALF as u64) }.map_err(err("pin"))?;
    // SAFETY: `buffer` outlives every registration of it.
    let key = unsafe { memory.register(base, HALF as u64, 0) }.map_err(err("register"))?;
    let ga = memory.address(key, base).map_err(err("address"))?;
    let mut last = None;
    for i in 0..64u64 {
        let i = i % 8;
        last = Some(
            memory
                .copy(
                    ga.plus((8 << 20) + i * (1 << 20)),
                    ga.plus(i * (1 << 20)),
                    1 << 20,
                    Order::Any,
                )
                .map_err(err("copy"))?,
        );
    }
    // SAFETY: as above.
    let grown = unsafe { memory.register(base.add(HALF), HALF as u64, 0) }
        .map_err(err("register adjacent"))?;
    let outcome = memory.complete(last.expect("posted"));
    let result = match outcome {
        Ok(()) if grown == key => Ok(Tally::default()),
        other => Err(format!(
            "copies in flight within a registration, then a registration adjacent to it \
             (merged: {}): complete gave {other:?}; counters {:?}",
            grown == key,
            memory.counters()
        )),
    };
    memory.deregister(key).ok();
    memory.deregister(key).ok();
    memory.finalize().ok();
    drop(pinned);
    drop(buffer);
    result
}

/// `init_as` promises: ranks that are not a permutation make every rank
/// fail with `Mismatch`. Rank 0 choosing an out-of-range rank instead
/// fails alone; the others wait for it in the launcher and fail late,
/// and the job's global memory cannot be initialized again.
fn init_as(job: &mut Job, context: &Context) -> Outcome {
    let size = job.size();
    let started = std::time::Instant::now();
    let chosen = if job.rank() == 0 { size } else { job.rank() };
    let first = GlobalMemory::init_as(context, job, chosen, Config::default()).map(|m| m.rank());
    let waited = started.elapsed();
    let first = format!("{first:?}");
    // Everyone tries again correctly.
    let second = GlobalMemory::init(context, job, Config::default()).and_then(|mut m| {
        m.sync()?;
        m.finalize()
    });
    match (&first, &second) {
        (f, Ok(())) if f.contains("Mismatch") || (job.rank() == 0 && f.contains("NoSuchRank")) => {
            if waited.as_secs() > 2 {
                Err(format!("bad rank: {first} after {waited:?}"))
            } else {
                Ok(Tally::default())
            }
        }
        _ => Err(format!(
            "rank 0 chose rank {size} of {size}: this rank's init_as gave {first} after \
             {waited:?}; a correct init by every rank afterwards gave {second:?}"
        )),
    }
}

/// The report's total is the sum of its parts.
fn memuse(job: &mut Job, context: &Context) -> Outcome {
    let memory = GlobalMemory::init(context, job, Config::default()).map_err(err("init"))?;
    let r = memory.memory_use();
    let sum = r.fixed
        + r.sync
        + r.starter
        + r.per_peer * u64::from(r.peers)
        + r.per_registration * u64::from(r.registrations)
        + r.per_cached_entry * u64::from(r.cached_entries);
    memory.finalize().ok();
    if sum != r.total {
        return Err(format!(
            "total {} but fixed + sync + starter + per_peer * peers + ... = {sum} ({r:?})",
            r.total
        ));
    }
    Ok(Tally::default())
}

/// Edges: a copy of 0 bytes (done), a misaligned atomic (refused, the
/// bytes unchanged), addresses from arbitrary bits (errors, no panic),
/// starter memory of 0 bytes (refused by name).
fn edges(job: &mut Job, context: &Context) -> Outcome {
    let mut tally = Tally::default();
    let mut memory = GlobalMemory::init(context, job, Config::default()).map_err(err("init"))?;
    let me = memory
        .starter_address(memory.rank())
        .map_err(err("starter"))?;
    memory
        .copy(me.plus(64), me, 0, Order::Any)
        .and_then(|h| memory.complete(h))
        .map_err(err("a copy of 0 bytes"))?;
    memory
        .write_local(me.plus(8), &[0xff; 16])
        .map_err(err("write_local"))?;
    let misaligned = memory
        .atomic(me.plus(128), me.plus(9), Atomic::Add8(1), Order::Any)
        .and_then(|h| memory.complete(h));
    let mut word = [0u8; 16];
    memory
        .read_local(me.plus(8), &mut word)
        .map_err(err("read"))?;
    if misaligned.is_ok() || word != [0xff; 16] {
        return Err(format!(
            "an atomic at offset 9 gave {misaligned:?}, bytes 8..24 now {word:02x?}"
        ));
    }
    tally.checked += 1;
    for bits in [
        u64::MAX,
        0x8000_0000_0000_0000,
        // Entry field 1000 of rank 0: an index nobody registered.
        1000 << OFFSET_BITS,
        GlobalAddress::NULL.0 | 5,
    ] {
        let outcome = memory
            .copy(me.plus(256), GlobalAddress(bits), 1, Order::Any)
            .and_then(|h| memory.complete(h));
        if outcome.is_ok() {
            return Err(format!("a copy from {bits:#x} succeeded"));
        }
        let properties = memory.properties(GlobalAddress(bits));
        if bits != GlobalAddress::NULL.0 | 5 && properties.is_ok() {
            return Err(format!("properties of {bits:#x}: {properties:?}"));
        }
        tally.checked += 1;
    }
    memory.finalize().map_err(err("finalize"))?;
    let empty = GlobalMemory::init(
        context,
        job,
        Config {
            starter_bytes: 0,
            ..Config::default()
        },
    )
    .map(|m| m.rank());
    match empty {
        Err(Error::Unsuitable(why)) if why.contains("starter") => {}
        other => return Err(format!("starter_bytes 0 gave {other:?}")),
    }
    tally.checked += 1;
    Ok(tally)
}

/// `properties` of an address built from arbitrary bits must be an
/// error, not a panic: the rank field names a rank past the job.
fn properties(job: &mut Job, context: &Context) -> Outcome {
    let mut memory = GlobalMemory::init(context, job, Config::default()).map_err(err("init"))?;
    let size = memory.size();
    let layout = memory.address_layout();
    // The first rank the rank field can name but the job does not have
    // (on 3 ranks: 3; on 1 rank: 1, the field being at least 1 bit).
    let address = layout
        .compose(pindown_messaging::global_memory::AddressFields {
            rank: size,
            color: 0,
            entry: 2,
            offset: 0,
        })
        .ok_or("the rank field holds no rank past the job")?;
    let outcome = memory.properties(address);
    memory.finalize().ok();
    match outcome {
        Err(Error::NoSuchRank { .. }) => Ok(Tally::default()),
        other => Err(format!("properties({address}) gave {other:?}")),
    }
}

/// `Order::AfterEarlier`: "only once every earlier operation of this
/// rank finished". An earlier copy that failed on a key its owner
/// replaced (a merge) is posted again only when its completion is
/// handled, without the fence; the ordered copy after it has already
/// run and read the bytes before they arrived. Ranks 0 and 1 (2 or more).
fn order(job: &mut Job, context: &Context) -> Outcome {
    let mut memory = GlobalMemory::init(context, job, Config::default()).map_err(err("init"))?;
    let (r, n) = (memory.rank(), memory.size());
    if n < 2 {
        return Err("needs 2 ranks".into());
    }
    const HALF: usize = 64 << 10;
    const PIECE: u64 = 4096;
    let mut user = vec![0xabu8; 2 * HALF];
    let base = user.as_mut_ptr();
    let me = memory.starter_address(r).map_err(err("starter"))?;
    let one = memory.starter_address(1).map_err(err("starter"))?;
    let mut key = None;
    if r == 1 {
        // SAFETY: `user` outlives its registrations (taken back below).
        let k = unsafe { memory.register(base, HALF as u64, 0) }.map_err(err("register"))?;
        let ga = memory.address(k, base).map_err(err("address"))?;
        memory
            .write_local(me, &ga.0.to_le_bytes())
            .map_err(err("write_local"))?;
        key = Some(k);
    }
    memory.sync().map_err(err("sync 1"))?;
    let mut remote = GlobalAddress::NULL;
    if r == 0 {
        let h = memory
            .copy(me, one, 8, Order::Any)
            .map_err(err("copy ga"))?;
        memory.complete(h).map_err(err("complete ga"))?;
        let mut word = [0u8; 8];
        memory.read_local(me, &mut word).map_err(err("read"))?;
        remote = GlobalAddress(u64::from_le_bytes(word));
        // Looked up and cached while the first key is live.
        let h = memory
            .copy(me.plus(64), remote, 8, Order::Any)
            .map_err(err("copy warm"))?;
        memory.complete(h).map_err(err("complete warm"))?;
    }
    memory.sync().map_err(err("sync 2"))?;
    if r == 1 {
        // SAFETY: as above; merges into the first registration.
        let grown = unsafe { memory.register(base.add(HALF), HALF as u64, 0) }
            .map_err(err("register adjacent"))?;
        if Some(grown) != key {
            return Err("the adjacent registration did not merge".into());
        }
    }
    memory.sync().map_err(err("sync 3"))?;
    let mut result = Ok(Tally::default());
    if r == 0 {
        let before = memory.counters();
        let first = memory
            .copy(me.plus(4096), remote, PIECE, Order::Any)
            .map_err(err("copy 1"))?;
        let second = memory
            .copy(me.plus(16384), me.plus(4096), PIECE, Order::AfterEarlier)
            .map_err(err("copy 2"))?;
        memory.complete(second).map_err(err("complete"))?;
        let done_first = memory.inquire(first).map_err(err("inquire"))?;
        let mut got = vec![0u8; PIECE as usize];
        memory
            .read_local(me.plus(16384), &mut got)
            .map_err(err("read"))?;
        let mut landed = vec![0u8; PIECE as usize];
        memory
            .read_local(me.plus(4096), &mut landed)
            .map_err(err("read"))?;
        let after = memory.counters();
        if got.iter().any(|&b| b != 0xab) || !done_first || after.failed != before.failed {
            result = Err(format!(
                "the ordered copy read {} of {PIECE} bytes before the earlier copy's bytes (first byte {:#x}); the earlier copy landed: {} (done: {done_first}); counters {before:?} -> {after:?}",
                got.iter().filter(|&&b| b != 0xab).count(),
                got[0],
                landed.iter().all(|&b| b == 0xab),
            ));
        }
    }
    memory.sync().map_err(err("sync 4"))?;
    if let Some(k) = key {
        memory.deregister(k).map_err(err("deregister"))?;
        memory.deregister(k).map_err(err("deregister"))?;
    }
    memory.sync().map_err(err("sync 5"))?;
    memory.finalize().map_err(err("finalize"))?;
    drop(user);
    result
}

/// Memory deregistered, freed, and allocated again at the same address
/// must be reached as the new memory: the module invalidates its own
/// pages for exactly this reason, but not the user's.
fn stale_pin(job: &mut Job, context: &Context) -> Outcome {
    let mut memory = GlobalMemory::init(context, job, Config::default()).map_err(err("init"))?;
    let me = memory
        .starter_address(memory.rank())
        .map_err(err("starter"))?;
    const LEN: usize = 4 << 20;
    let mut notes = Vec::new();
    let mut result = Ok(());
    let mut last = std::ptr::null_mut();
    for round in 0..4u8 {
        // Fresh anonymous pages, at the address of the previous round's
        // (unmapped by then) after the first.
        let flags = libc::MAP_PRIVATE
            | libc::MAP_ANONYMOUS
            | if round == 0 {
                0
            } else {
                libc::MAP_FIXED_NOREPLACE
            };
        // SAFETY: anonymous memory, no file; the result is checked.
        let ptr =
            unsafe { libc::mmap(last, LEN, libc::PROT_READ | libc::PROT_WRITE, flags, -1, 0) };
        if ptr == libc::MAP_FAILED {
            return Err(format!("mmap: {}", std::io::Error::last_os_error()));
        }
        last = ptr;
        let buffer = ptr.cast::<u8>();
        // SAFETY: `ptr` maps LEN writable bytes, unmapped only below.
        unsafe { std::ptr::write_bytes(buffer, 0x10 + round, LEN) };
        let at = buffer as u64;
        // SAFETY: the mapping outlives the registration (taken back below).
        let key = unsafe { memory.register(buffer, LEN as u64, 0) }.map_err(err("register"))?;
        let ga = memory.address(key, buffer).map_err(err("address"))?;
        let h = memory
            .copy(me, ga.plus(4096), 64, Order::Any)
            .map_err(err("copy"))?;
        memory.complete(h).map_err(err("complete"))?;
        let mut got = [0u8; 64];
        memory.read_local(me, &mut got).map_err(err("read"))?;
        notes.push(format!("round {round} at {at:#x}: read {:#x}", got[0]));
        if got.iter().any(|&b| b != 0x10 + round) && result.is_ok() {
            result = Err(format!(
                "round {round}: memory at {at:#x} holds {:#x}, the copy read {:#x}",
                0x10 + round,
                got[0]
            ));
        }
        memory.deregister(key).map_err(err("deregister"))?;
        // SAFETY: mapped above; nothing refers to it once deregistered.
        unsafe { libc::munmap(ptr, LEN) };
    }
    memory.finalize().ok();
    result.map_err(|e| format!("{e} ({})", notes.join("; ")))?;
    Ok(Tally {
        notes,
        ..Tally::default()
    })
}

/// A copy that fails on a key its owner replaced (a merge) is retried
/// only if the entry is still in the remote-entry cache when the
/// failure is handled; a lookup in between that evicts it turns the
/// retry into a failure. With `remote_entries: 1` one lookup suffices;
/// with the default (1024) as many distinct remote registrations do.
fn evict(job: &mut Job, context: &Context) -> Outcome {
    let config = Config {
        remote_entries: 1,
        ..Config::default()
    };
    let mut memory = GlobalMemory::init(context, job, config).map_err(err("init"))?;
    let (r, n) = (memory.rank(), memory.size());
    if n < 2 {
        return Err("needs 2 ranks".into());
    }
    const HALF: usize = 64 << 10;
    let mut user = vec![0xabu8; 2 * HALF];
    let mut other = vec![0xcdu8; 4096];
    let base = user.as_mut_ptr();
    let me = memory.starter_address(r).map_err(err("starter"))?;
    let one = memory.starter_address(1).map_err(err("starter"))?;
    let mut keys = Vec::new();
    if r == 1 {
        // SAFETY: `user` and `other` outlive their registrations.
        let k = unsafe { memory.register(base, HALF as u64, 0) }.map_err(err("register"))?;
        // SAFETY: as above.
        let o = unsafe { memory.register(other.as_mut_ptr(), 4096, 0) }
            .map_err(err("register other"))?;
        let ga = memory.address(k, base).map_err(err("address"))?;
        let go = memory.address(o, other.as_ptr()).map_err(err("address"))?;
        memory
            .write_local(me, &ga.0.to_le_bytes())
            .map_err(err("write_local"))?;
        memory
            .write_local(me.plus(8), &go.0.to_le_bytes())
            .map_err(err("write_local"))?;
        keys = vec![k, k, o];
    }
    memory.sync().map_err(err("sync 1"))?;
    let (mut remote, mut remote_other) = (GlobalAddress::NULL, GlobalAddress::NULL);
    if r == 0 {
        let h = memory
            .copy(me, one, 16, Order::Any)
            .map_err(err("copy ga"))?;
        memory.complete(h).map_err(err("complete ga"))?;
        let mut words = [0u8; 16];
        memory.read_local(me, &mut words).map_err(err("read"))?;
        remote = GlobalAddress(u64::from_le_bytes(words[..8].try_into().unwrap()));
        remote_other = GlobalAddress(u64::from_le_bytes(words[8..].try_into().unwrap()));
        let h = memory
            .copy(me.plus(64), remote, 8, Order::Any)
            .map_err(err("copy warm"))?;
        memory.complete(h).map_err(err("complete warm"))?;
    }
    memory.sync().map_err(err("sync 2"))?;
    if r == 1 {
        // SAFETY: as above; merges into the first registration.
        unsafe { memory.register(base.add(HALF), HALF as u64, 0) }
            .map_err(err("register adjacent"))?;
    }
    memory.sync().map_err(err("sync 3"))?;
    let mut result = Ok(Tally::default());
    if r == 0 {
        let first = memory
            .copy(me.plus(4096), remote, 4096, Order::Any)
            .map_err(err("copy 1"))?;
        // Another of rank 1's registrations, looked up before the first
        // copy's failure is handled.
        let second = memory
            .copy(me.plus(16384), remote_other, 8, Order::Any)
            .map_err(err("copy 2"))?;
        let outcome = memory.complete(second);
        let done = memory.inquire(first);
        if let Err(e) = outcome {
            result = Err(format!(
                "a copy with a key rank 1 replaced by a merge failed instead of being retried \
                 ({e}); the later copy done: {done:?}; counters {:?}",
                memory.counters()
            ));
        }
    }
    memory.sync().map_err(err("sync 4"))?;
    for k in keys {
        memory.deregister(k).map_err(err("deregister"))?;
    }
    memory.sync().map_err(err("sync 5"))?;
    memory.finalize().map_err(err("finalize"))?;
    drop((user, other));
    result
}

/// Three ranks; rank 2 is hostile. Each synchronization word of a rank is
/// writable only by the rank that signals it in that round: rank 2 holds
/// the key of rank 0's word of round 0 (it signals it there) and can read
/// from the launcher the key of its word of round 1, which rank 1
/// signals. Its write through the latter is refused; through the former
/// it writes a synchronization far ahead, and rank 0's next `sync` fails
/// naming rank 2 instead of passing without it.
fn hostile_sync(job: &mut Job, context: &Context) -> Outcome {
    use pindown_driver::verbs::opcode::Write;
    use pindown_uapi::{ErrorDetail, RemoteAddress, RemoteKey};
    use std::time::{Duration, Instant};
    const FORGED: [u8; 8] = *b"forged!!";
    let config = Config {
        starter_bytes: 4096,
        ..Config::default()
    };
    let mut memory = GlobalMemory::init(context, job, config).map_err(err("init"))?;
    if memory.size() != 3 {
        return Err("acp-edge-hostile-sync runs on 3 ranks".into());
    }
    memory.sync().map_err(err("sync"))?;
    let mut tally = Tally::default();
    let zero = memory.starter_address(0).map_err(err("address"))?;
    match memory.rank() {
        0 => {
            let deadline = Instant::now() + Duration::from_secs(30);
            let mut seen = [0u8; 8];
            while seen != FORGED {
                if Instant::now() > deadline {
                    return Err("rank 2 never said it had forged".into());
                }
                std::thread::sleep(Duration::from_millis(1));
                memory.read_local(zero, &mut seen).map_err(err("read"))?;
            }
            match memory.sync() {
                Err(Error::BadPeerRecord { rank: 2, why }) if why.contains("ahead") => {
                    tally.notes.push(format!("refused: {why}"));
                    tally.checked += 1;
                }
                other => return Err(format!("sync after a forged signal: {other:?}")),
            }
        }
        1 => tally.checked += 1,
        _ => {
            // Rank 0's record: its node and port.
            let record = job.get(0, "pindown-acp-0").map_err(err("record"))?;
            let node = u16::from_le_bytes([record[8], record[9]]);
            let port = u16::from_le_bytes([record[10], record[11]]);
            let own = RemoteKey(u64::from_le_bytes(job_key(job, 0)?));
            let rank_1s = RemoteKey(u64::from_le_bytes(job_key(job, 1)?));
            let buffer = context.alloc(4096, 4096).map_err(err("alloc"))?;
            buffer.write_at(0, &u64::MAX.to_le_bytes());
            let region = context.register_buffer(&buffer).map_err(err("register"))?;
            let mut cq = context.create_completion_queue();
            let mut qp = context
                .create_queue_pair(&mut cq)
                .map_err(err("queue pair"))?;
            let mut write =
                |key: RemoteKey| -> Result<Result<(), pindown_uapi::CompletionError>, String> {
                    let remote = RemoteAddress {
                        node,
                        port,
                        key,
                        offset: 0,
                    };
                    let entry = Write::new(region.local(0, 8).map_err(err("local"))?, remote)
                        .build()
                        .signaled();
                    qp.post(&[entry]).map_err(err("post"))?;
                    let mut done = Vec::new();
                    let deadline = Instant::now() + Duration::from_secs(10);
                    while done.is_empty() {
                        if Instant::now() > deadline {
                            return Err("a write did not complete".into());
                        }
                        cq.poll_into(&mut done).map_err(err("poll"))?;
                    }
                    Ok(done[0].result().map(drop))
                };
            match write(rank_1s)? {
                Err(e) if e.detail == ErrorDetail::NotGranted => tally.checked += 1,
                other => return Err(format!("a write into rank 1's word at rank 0: {other:?}")),
            }
            write(own)?.map_err(|e| format!("a write into its own word at rank 0: {e}"))?;
            let mine = memory.starter_address(2).map_err(err("address"))?;
            memory.write_local(mine, &FORGED).map_err(err("write"))?;
            let copy = memory
                .copy(zero, mine, 8, Order::Any)
                .map_err(err("copy"))?;
            memory.complete(copy).map_err(err("complete"))?;
            tally.checked += 1;
        }
    }
    // Rank 0 reads no more; the others may leave.
    std::thread::sleep(Duration::from_millis(500));
    memory.finalize().map_err(err("finalize"))?;
    Ok(tally)
}

/// The key rank 0 published for its synchronization word of `round` (of
/// the first init of this process).
fn job_key(job: &mut Job, round: u32) -> Result<[u8; 8], String> {
    let value = job
        .get(0, &format!("pindown-acp-0-sync-{round}"))
        .map_err(err("sync key"))?;
    value
        .try_into()
        .map_err(|v: Vec<u8>| format!("a sync key of {} bytes", v.len()))
}
