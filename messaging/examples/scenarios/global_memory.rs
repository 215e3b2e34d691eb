//! Global-memory (ACP) scenarios of `msg_check`: `acp` (every function:
//! copies local, remote and third-party, user memory, merges and counts,
//! ordering, all twelve atomics, contention, the errors), `acp-reinit`
//! (re-initialization with other ranks and starter sizes, a bad
//! permutation refused) and `acp-memory` (memory use, reported and
//! measured by a counting allocator).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicI64, Ordering};

use pindown_driver::launch::Job;
use pindown_driver::verbs::Context;
use pindown_messaging::global_memory::{
    AddressFields, Atomic, Config, GlobalAddress, GlobalMemory, Order,
};
use pindown_messaging::Error;

use super::Tally;

/// Heap bytes allocated and not freed.
static HEAP: AtomicI64 = AtomicI64::new(0);

/// The system allocator, counting.
struct Counting;

// SAFETY: every call is forwarded to `System` with the caller's
// arguments; the counter is only arithmetic.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        HEAP.fetch_add(layout.size() as i64, Ordering::Relaxed);
        // SAFETY: forwarded; the caller upholds `alloc`'s contract.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        HEAP.fetch_add(layout.size() as i64, Ordering::Relaxed);
        // SAFETY: forwarded; the caller upholds `alloc_zeroed`'s contract.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        HEAP.fetch_sub(layout.size() as i64, Ordering::Relaxed);
        // SAFETY: forwarded; `ptr` came from this allocator with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        HEAP.fetch_add(new_size as i64 - layout.size() as i64, Ordering::Relaxed);
        // SAFETY: forwarded; the caller upholds `realloc`'s contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

type Outcome = Result<Tally, String>;

/// Runs global-memory scenario `scenario`.
pub fn run(job: &mut Job, context: &Context, scenario: &str) -> Outcome {
    match scenario {
        "acp" => functions(job, context),
        "acp-reinit" => reinit(job, context),
        "acp-memory" => memory(job, context),
        edge if edge.starts_with("acp-edge-") => {
            super::global_memory_edges::run(job, context, edge)
        }
        other => Err(format!("unknown scenario {other:?}")),
    }
}

fn err<E: std::fmt::Display>(what: &'static str) -> impl Fn(E) -> String {
    move |e| format!("{what}: {e}")
}

// Starter memory layout of the `acp` scenario.
const STARTER: usize = 10 << 20;
const SOURCE: u64 = 0;
const SOURCE_LEN: u64 = 1 << 20;
const GET_AREA: u64 = 1 << 20;
const PUT_AREA: u64 = 3 << 20;
const THIRD_AREA: u64 = 5 << 20;
const AREA_LEN: u64 = 2 << 20;
const WORDS: u64 = 7 << 20;
const RESULTS: u64 = WORDS + (32 << 10);
const COUNTER: u64 = WORDS + (60 << 10);
const OLD_VALUES: u64 = WORDS + (64 << 10);
const EXCHANGE: u64 = WORDS + (96 << 10);
const ORDERED_AREA: u64 = 8 << 20;
const CONTENDED_ADDS: u64 = 200;

/// Byte `i` of rank `rank`'s source pattern.
fn byte(rank: u32, i: u64) -> u8 {
    let x = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (u64::from(rank) + 1) << 40;
    (x ^ x >> 29 ^ x >> 47) as u8
}

/// The copies each kind makes: (source offset, destination offset in the
/// area, length); unaligned, crossing pages, 1 byte to almost 1 MiB.
fn cases() -> Vec<(u64, u64, u64)> {
    let lens = [1u64, 7, 8, 63, 4095, 4096, 4097, 65_539, (1 << 20) - 4099];
    let mut at = 3;
    lens.iter()
        .enumerate()
        .map(|(i, &len)| {
            let source = (i as u64 * 1031) % 4099;
            let case = (source, at, len);
            at += len + 5;
            case
        })
        .collect()
}

/// What an area holds once rank `from`'s source arrived by `cases`.
fn expected_area(from: u32) -> Vec<u8> {
    let mut area = vec![0u8; AREA_LEN as usize];
    for (source, at, len) in cases() {
        for i in 0..len {
            area[(at + i) as usize] = byte(from, source + i);
        }
    }
    area
}

fn check_area(
    memory: &GlobalMemory<'_>,
    at: GlobalAddress,
    from: u32,
    what: &str,
) -> Result<u64, String> {
    let mut got = vec![0u8; AREA_LEN as usize];
    memory.read_local(at, &mut got).map_err(err("read_local"))?;
    let want = expected_area(from);
    match (0..got.len()).find(|&i| got[i] != want[i]) {
        None => Ok(AREA_LEN),
        Some(i) => Err(format!(
            "{what}: byte {i} is {:#x}, {:#x} expected (from rank {from})",
            got[i], want[i]
        )),
    }
}

/// A word's value before the atomics: differs per (owner, source, op).
fn initial(owner: u32, source: u32, op: usize) -> u64 {
    0x0123_4567_89ab_cdefu64.rotate_left(owner * 7 + source * 3 + op as u32) ^ op as u64
}

fn atomics(initial: u64, source: u32) -> [(Atomic, u64, u64); 12] {
    // (atomic, new value of the 8-byte slot, old value delivered)
    let low = initial as u32;
    let high = initial & !0xffff_ffff;
    let s = u64::from(source) + 3;
    let four = |new: u32| high | u64::from(new);
    [
        (
            Atomic::CompareSwap8 {
                compare: initial,
                swap: s,
            },
            s,
            initial,
        ),
        (
            Atomic::CompareSwap8 {
                compare: !initial,
                swap: s,
            },
            initial,
            initial,
        ),
        (
            Atomic::CompareSwap4 {
                compare: low,
                swap: s as u32,
            },
            four(s as u32),
            u64::from(low),
        ),
        (Atomic::Swap8(s), s, initial),
        (Atomic::Swap4(s as u32), four(s as u32), u64::from(low)),
        (Atomic::Add8(s), initial.wrapping_add(s), initial),
        (
            Atomic::Add4(u32::MAX),
            four(low.wrapping_add(u32::MAX)),
            u64::from(low),
        ),
        (Atomic::And8(s | 0xf0f0), initial & (s | 0xf0f0), initial),
        (Atomic::Or4(s as u32), four(low | s as u32), u64::from(low)),
        (Atomic::Or8(s << 33), initial | s << 33, initial),
        (Atomic::Xor8(s * 0x1111), initial ^ (s * 0x1111), initial),
        (
            Atomic::Xor4(0xffff_0000),
            four(low ^ 0xffff_0000),
            u64::from(low),
        ),
    ]
}

fn read_u64(memory: &GlobalMemory<'_>, at: GlobalAddress) -> Result<u64, String> {
    let mut word = [0u8; 8];
    memory
        .read_local(at, &mut word)
        .map_err(err("read_local"))?;
    Ok(u64::from_le_bytes(word))
}

/// Every function on every rank.
fn functions(job: &mut Job, context: &Context) -> Outcome {
    let config = Config {
        starter_bytes: STARTER,
        ..Config::default()
    };
    let mut memory = GlobalMemory::init(context, job, config).map_err(err("init"))?;
    let (r, n) = (memory.rank(), memory.size());
    let mut tally = Tally::default();
    let starters = (0..n)
        .map(|k| memory.starter_address(k))
        .collect::<Result<Vec<_>, _>>()
        .map_err(err("starter"))?;
    let starter = |rank: u32| starters[(rank % n) as usize];
    let (me, next, after) = (starter(r), starter(r + 1), starter(r + 2));
    let source: Vec<u8> = (0..SOURCE_LEN).map(|i| byte(r, i)).collect();
    memory
        .write_local(me.plus(SOURCE), &source)
        .map_err(err("write_local"))?;
    // The atomics' words: slot (source, op) of this rank's words.
    for s in 0..n {
        for op in 0..12 {
            let at = me.plus(WORDS + u64::from(s) * 256 + op as u64 * 16);
            memory
                .write_local(at, &initial(r, s, op).to_le_bytes())
                .map_err(err("write_local"))?;
        }
    }
    // User memory: a heap buffer, registered, its global address handed
    // to the previous rank through starter memory.
    let mut user = vec![0u8; (3 << 20) + 4096];
    let first_part = (1 << 20) + 4096;
    // SAFETY: `user` lives until after the last deregistration below
    // and is read only once every rank synchronized.
    let user_key = unsafe { memory.register(user.as_mut_ptr(), first_part, 0) }
        .map_err(err("register user"))?;
    let user_ga = memory
        .address(user_key, user.as_ptr())
        .map_err(err("address"))?;
    memory
        .write_local(me.plus(EXCHANGE), &user_ga.0.to_le_bytes())
        .map_err(err("write_local"))?;
    // A registration to be taken back while a peer holds its address.
    let mut doomed = vec![0u8; 4096];
    // SAFETY: deregistered below before `doomed` drops.
    let doomed_key =
        unsafe { memory.register(doomed.as_mut_ptr(), 4096, 0) }.map_err(err("register doomed"))?;
    memory
        .write_local(me.plus(EXCHANGE + 8), &doomed_key.0.to_le_bytes())
        .map_err(err("write_local"))?;
    memory.sync().map_err(err("sync 1"))?;

    // Copies: remote to local, local to remote, third party.
    let mut last = None;
    for (source_at, at, len) in cases() {
        for (destination, source, what) in [
            (me.plus(GET_AREA + at), next, "copy remote to local"),
            (next.plus(PUT_AREA + at), me, "copy local to remote"),
            (after.plus(THIRD_AREA + at), next, "copy third party"),
        ] {
            let source = source.plus(SOURCE + source_at);
            last = Some(
                memory
                    .copy(destination, source, len, Order::Any)
                    .map_err(err(what))?,
            );
        }
    }
    let last = last.expect("cases");
    while !memory.inquire(last).map_err(err("inquire"))? {
        std::thread::yield_now();
    }
    memory.complete(last).map_err(err("complete"))?;
    // The queries.
    let local = memory
        .local_address(me.plus(5))
        .map_err(err("local_address"))?;
    let mut first = [0u8; 3];
    memory
        .read_local(me.plus(5), &mut first)
        .map_err(err("read_local"))?;
    // SAFETY: `local` points 5 bytes into this rank's starter memory,
    // which holds the source pattern there.
    if unsafe { std::slice::from_raw_parts(local, 3) } != first || first[..] != source[5..8] {
        return Err("local_address names other bytes".into());
    }
    if memory.color_of(next) != 0 || memory.colors() != 1 || memory.rank_of(next) != (r + 1) % n {
        return Err("rank_of, color_of or colors".into());
    }
    match memory.local_address(next) {
        Err(Error::NotLocal { .. }) if n > 1 => {}
        Ok(_) if n == 1 => {}
        other => {
            return Err(format!(
                "local_address of the next rank's memory: {other:?}"
            ))
        }
    }
    tally.checked += 4;
    // The previous rank's user address and doomed key.
    let prev = starter(r + n - 1);
    let fetch = memory
        .copy(me.plus(EXCHANGE + 16), prev.plus(EXCHANGE), 16, Order::Any)
        .map_err(err("copy exchange"))?;
    memory.complete(fetch).map_err(err("complete exchange"))?;
    let prev_user = GlobalAddress(read_u64(&memory, me.plus(EXCHANGE + 16))?);
    let prev_doomed = GlobalAddress(read_u64(&memory, me.plus(EXCHANGE + 24))?);
    if memory.rank_of(prev_user) != (r + n - 1) % n {
        return Err(format!(
            "the previous rank's user address {prev_user} names rank {}",
            memory.rank_of(prev_user)
        ));
    }
    // Into the previous rank's heap buffer, then (ordered) back out of it.
    memory
        .copy(prev_user.plus(5), me.plus(SOURCE), SOURCE_LEN, Order::Any)
        .map_err(err("copy into user memory"))?;
    let back = memory
        .copy(
            me.plus(ORDERED_AREA),
            prev_user.plus(5),
            SOURCE_LEN - 7,
            Order::AfterEarlier,
        )
        .map_err(err("ordered copy"))?;
    memory.complete(back).map_err(err("complete ordered"))?;
    let mut got = vec![0u8; (SOURCE_LEN - 7) as usize];
    memory
        .read_local(me.plus(ORDERED_AREA), &mut got)
        .map_err(err("read_local"))?;
    if got[..] != source[..got.len()] {
        return Err("an ordered copy did not see the copy before it".into());
    }
    tally.checked += got.len() as u64;
    // The doomed registration, looked up (and cached) while alive.
    memory
        .copy(me.plus(EXCHANGE + 64), prev_doomed, 8, Order::Any)
        .and_then(|h| memory.complete(h))
        .map_err(err("copy from a live registration"))?;

    // Atomics: on the next rank's words, old values to the rank after.
    for (op, (atomic, _, _)) in atomics(initial((r + 1) % n, r, 0), r)
        .into_iter()
        .enumerate()
    {
        let word_slot = u64::from(r) * 256 + op as u64 * 16;
        let atomic = if op == 0 {
            atomic
        } else {
            atomics(initial((r + 1) % n, r, op), r)[op].0
        };
        memory
            .atomic(
                after.plus(RESULTS + word_slot),
                next.plus(WORDS + word_slot),
                atomic,
                Order::Any,
            )
            .map_err(err("atomic"))?;
    }
    // Contention: every rank adds 1 to rank 0's counter.
    let counter = starter(0).plus(COUNTER);
    for i in 0..CONTENDED_ADDS {
        memory
            .atomic(
                me.plus(OLD_VALUES + i * 8),
                counter,
                Atomic::Add8(1),
                Order::Any,
            )
            .map_err(err("contended add"))?;
    }
    memory.complete_all().map_err(err("complete atomics"))?;
    memory.sync().map_err(err("sync 2"))?;

    // Check what arrived here.
    tally.checked += check_area(&memory, me.plus(GET_AREA), (r + 1) % n, "remote to local")?;
    tally.checked += check_area(
        &memory,
        me.plus(PUT_AREA),
        (r + n - 1) % n,
        "local to remote",
    )?;
    tally.checked += check_area(&memory, me.plus(THIRD_AREA), (r + n - 1) % n, "third party")?;
    let from = (r + n - 1) % n;
    let sent: Vec<u8> = (0..SOURCE_LEN).map(|i| byte(from, i)).collect();
    if user[5..5 + SOURCE_LEN as usize] != sent[..]
        || user[..5].iter().any(|&b| b != 0)
        || user[5 + SOURCE_LEN as usize..].iter().any(|&b| b != 0)
    {
        return Err("user memory did not receive exactly the copy".into());
    }
    tally.checked += SOURCE_LEN;
    let word_owner = (r + n - 1) % n; // who ran atomics on this rank's words
    let result_owner = (r + 2 * n - 2) % n; // whose old values landed here
    for op in 0..12 {
        let slot = op as u64 * 16;
        let (_, new, _) = atomics(initial(r, word_owner, op), word_owner)[op];
        let word = read_u64(&memory, me.plus(WORDS + u64::from(word_owner) * 256 + slot))?;
        if word != new {
            return Err(format!("atomic {op} left {word:#x}, {new:#x} expected"));
        }
        let (_, _, old) = atomics(initial((r + n - 1) % n, result_owner, op), result_owner)[op];
        let landed = read_u64(
            &memory,
            me.plus(RESULTS + u64::from(result_owner) * 256 + slot),
        )?;
        if landed != old {
            return Err(format!(
                "atomic {op} delivered {landed:#x}, {old:#x} expected"
            ));
        }
        tally.checked += 16;
    }
    let mut seen = std::collections::HashSet::new();
    for i in 0..CONTENDED_ADDS {
        let old = read_u64(&memory, me.plus(OLD_VALUES + i * 8))?;
        if old >= CONTENDED_ADDS * u64::from(n) || !seen.insert(old) {
            return Err(format!("contended add {i} saw {old}"));
        }
    }
    if r == 0 {
        let total = read_u64(&memory, me.plus(COUNTER))?;
        if total != CONTENDED_ADDS * u64::from(n) {
            return Err(format!(
                "the counter reached {total}, {} expected",
                CONTENDED_ADDS * u64::from(n)
            ));
        }
    }
    tally.checked += CONTENDED_ADDS;

    // Merges and counts.
    let mut merge = vec![0u8; 16 << 10];
    let base = merge.as_mut_ptr();
    // SAFETY: `merge` outlives every registration of it (all taken back
    // below).
    let key = unsafe { memory.register(base, 4096, 0) }.map_err(err("register"))?;
    let inside =
        unsafe { memory.register(base.add(1024), 1024, 0) }.map_err(err("register inside"))?;
    let extended =
        unsafe { memory.register(base.add(4096), 4096, 0) }.map_err(err("register adjacent"))?;
    let apart =
        unsafe { memory.register(base.add(12 << 10), 4096, 0) }.map_err(err("register apart"))?;
    if inside != key || extended != key || apart == key {
        return Err(format!(
            "keys {key} {inside} {extended} {apart}: the first three must merge, the last not"
        ));
    }
    let ga = memory.address(key, base).map_err(err("address"))?;
    let properties = memory
        .properties(ga.plus(5000))
        .map_err(err("properties"))?;
    if properties.count != 3
        || properties.len != 8192
        || properties.offset != 5000
        || properties.base != base as u64
        || properties.rank != r
    {
        return Err(format!("merged registration: {properties:?}"));
    }
    memory.deregister(apart).map_err(err("deregister apart"))?;
    for i in 0..3 {
        memory
            .deregister(key)
            .map_err(|e| format!("deregistration {i} of 3: {e}"))?;
    }
    match memory.deregister(key) {
        Err(Error::NoSuchKey { .. }) => {}
        other => return Err(format!("a fourth deregistration gave {other:?}")),
    }
    match memory.copy(me.plus(EXCHANGE + 64), ga, 8, Order::Any) {
        Err(Error::NoSuchKey { .. }) => {}
        other => return Err(format!("copying from a deregistered key gave {other:?}")),
    }
    tally.checked += 1;

    // A registration that grows while peers hold its old key, and one
    // that goes away.
    // SAFETY: `user` is still alive and shared.
    let grown = unsafe { memory.register(user.as_mut_ptr().add(first_part as usize), 1 << 20, 0) }
        .map_err(err("register the rest of user memory"))?;
    if grown != user_key {
        return Err("growing user memory gave a new key".into());
    }
    memory
        .deregister(doomed_key)
        .map_err(err("deregister doomed"))?;
    memory.sync().map_err(err("sync 3"))?;
    // The old key still reaches it (the registration keeps the window
    // of its first extent): no lookup, no failure.
    let before = memory.counters();
    let h = memory
        .copy(prev_user.plus(1), me.plus(SOURCE), 3, Order::Any)
        .map_err(err("copy with the old key"))?;
    memory
        .complete(h)
        .map_err(err("complete with the old key"))?;
    let after = memory.counters();
    if after.lookups != before.lookups || after.failed != before.failed {
        return Err(format!(
            "a copy with the key of a registration that grew: {before:?} then {after:?}"
        ));
    }
    let far = first_part + 100;
    let h = memory
        .copy(prev_user.plus(far), me.plus(SOURCE), 4096, Order::Any)
        .map_err(err("copy past the old end"))?;
    memory
        .complete(h)
        .map_err(err("complete past the old end"))?;
    let outcome = memory
        .copy(me.plus(EXCHANGE + 64), prev_doomed, 8, Order::Any)
        .and_then(|h| memory.complete(h));
    match outcome {
        Err(Error::NoSuchKey { .. }) => {}
        other => {
            return Err(format!(
                "copying from a peer's deregistered key gave {other:?}"
            ))
        }
    }
    // Out of bounds, locally and remotely; a color that does not exist.
    for (what, address, len) in [
        ("own starter", me.plus(STARTER as u64 - 10), 20),
        ("a peer's starter", next.plus(STARTER as u64 - 1), 2),
        (
            "a peer's user memory",
            prev_user.plus((3 << 20) + 4096 - 8),
            9,
        ),
    ] {
        match memory.copy(me.plus(EXCHANGE + 64), address, len, Order::Any) {
            Err(Error::OutOfBounds { .. }) => {}
            other => return Err(format!("{len} bytes at the end of {what} gave {other:?}")),
        }
    }
    let layout = memory.address_layout();
    let fields = layout.fields(next);
    let colored = layout
        .compose(AddressFields { color: 1, ..fields })
        .expect("fits");
    match memory.copy(me.plus(EXCHANGE + 64), colored, 8, Order::Any) {
        Err(Error::NoSuchColor { .. }) => {}
        other => return Err(format!("color 1 gave {other:?}")),
    }
    match memory.copy(me.plus(EXCHANGE + 64), GlobalAddress::NULL, 8, Order::Any) {
        Err(Error::NoSuchKey { .. }) => {}
        other => return Err(format!("the null address gave {other:?}")),
    }
    tally.checked += 6;
    memory.sync().map_err(err("sync 4"))?;
    // Peers are done with user memory.
    memory
        .deregister(user_key)
        .map_err(err("deregister user"))?;
    memory
        .deregister(user_key)
        .map_err(err("deregister user again"))?;
    memory.sync().map_err(err("sync 5"))?;
    // Finalize with an operation pending: reported, and waited for.
    memory
        .copy(me.plus(GET_AREA), me.plus(SOURCE), SOURCE_LEN, Order::Any)
        .map_err(err("last copy"))?;
    match memory.finalize() {
        Err(Error::Unfinished { in_flight: 1, .. }) => {}
        other => return Err(format!("finalize with a copy pending gave {other:?}")),
    }
    drop(doomed);
    Ok(tally)
}

/// Re-initialization with reversed ranks and other starter sizes.
fn reinit(job: &mut Job, context: &Context) -> Outcome {
    let mut tally = Tally::default();
    let memory = GlobalMemory::init(context, job, Config::default()).map_err(err("init"))?;
    let (process, n) = (memory.rank(), memory.size());
    let new_rank = n - 1 - process;
    let starter_bytes = 64 << 10 << process;
    let mut memory = memory
        .reinit(job, new_rank, starter_bytes)
        .map_err(err("reinit"))?;
    if memory.rank() != new_rank {
        return Err(format!("reinit as {new_rank} gave rank {}", memory.rank()));
    }
    let me = memory.starter_address(new_rank).map_err(err("starter"))?;
    memory
        .write_local(me, &u64::from(process).to_le_bytes())
        .map_err(err("write_local"))?;
    memory.sync().map_err(err("sync"))?;
    for rank in 0..n {
        let there = memory.starter_address(rank).map_err(err("starter"))?;
        let at = me.plus(64 + 8 * u64::from(rank));
        let h = memory.copy(at, there, 8, Order::Any).map_err(err("copy"))?;
        memory.complete(h).map_err(err("complete"))?;
        let marker = read_u64(&memory, at)?;
        let owner = n - 1 - rank;
        if marker != u64::from(owner) {
            return Err(format!(
                "rank {rank}'s starter holds {marker}, process {owner} expected"
            ));
        }
        let properties = memory.properties(there).map_err(err("properties"))?;
        if properties.len != 64 << 10 << owner || !properties.starter {
            return Err(format!("rank {rank}'s starter: {properties:?}"));
        }
        tally.checked += 1;
    }
    memory.sync().map_err(err("sync"))?;
    memory.finalize().map_err(err("finalize"))?;
    // Everyone choosing rank 0 is refused everywhere; a permutation then
    // works.
    match GlobalMemory::init_as(context, job, 0, Config::default()) {
        Err(Error::Mismatch(_)) if n > 1 => {}
        Ok(_) if n == 1 => {}
        other => {
            return Err(format!(
                "every rank choosing 0 gave {:?}",
                other.map(|m| m.rank())
            ))
        }
    }
    let memory = GlobalMemory::init_as(context, job, (process + 1) % n, Config::default())
        .map_err(err("init_as"))?;
    if memory.rank() != (process + 1) % n {
        return Err("init_as gave another rank".into());
    }
    memory.finalize().map_err(err("finalize"))?;
    tally.checked += 1;
    Ok(tally)
}

/// Memory use: the report, and the heap measured around init.
fn memory(job: &mut Job, context: &Context) -> Outcome {
    let mut tally = Tally::default();
    let config = Config {
        starter_bytes: 64 << 10,
        ..Config::default()
    };
    let before = HEAP.load(Ordering::Relaxed);
    let memory = GlobalMemory::init(context, job, config).map_err(err("init"))?;
    let heap = HEAP.load(Ordering::Relaxed) - before;
    let report = memory.memory_use();
    if report.per_peer > 64 {
        return Err(format!("{} bytes per peer", report.per_peer));
    }
    if heap as u64 > report.total {
        return Err(format!(
            "init allocated {heap} bytes, the report says {}",
            report.total
        ));
    }
    tally.notes.push(format!(
        "heap={heap} fixed={} per_peer={} sync={} peers={} per_registration={} registrations={} starter={} total={}",
        report.fixed, report.per_peer, report.sync, report.peers, report.per_registration, report.registrations, report.starter, report.total
    ));
    tally.checked += 1;
    memory.finalize().map_err(err("finalize"))?;
    Ok(tally)
}
