//! `pindown-guest`: the pindown driver inside a QEMU guest, over VFIO.
//!
//! ```text
//! pindown-guest bind                 load the VFIO modules, bind the virtio-net
//!                                    function to vfio-pci, print its sysfs path
//! pindown-guest rdma WINDOW          writes, reads and atomics against a peer's
//!                                    window (node:port:key:len), from arena memory
//!                                    and from heap Vecs, bytes verified; an
//!                                    out-of-window access must fail
//! pindown-guest serve               the other side of `rdma`: a window over a
//!                                    buffer of its own, printed as
//!                                    `PINDOWN-RESULT window=node:port:key:len`;
//!                                    waits for the peer's done flag, then
//!                                    verifies the whole buffer
//! pindown-guest pinbench [ROUNDS]    JSON: pin-down cache hit rate, cost of a
//!                                    miss (VFIO map through the vIOMMU) and of
//!                                    a hit
//! pindown-guest                      the role from the kernel command line:
//!                                    pindown.role=rdma|serve|pinbench|bind and
//!                                    pindown.window=node:port:key:len
//!                                    (pindown.event_idx=0: refuse EVENT_IDX)
//! ```
//!
//! Every role binds the function first. Output lines start with
//! `PINDOWN-GUEST `; the last is `PINDOWN-GUEST PASS` or
//! `PINDOWN-GUEST FAIL <reason>`. The window's owner fills it with
//! `pattern(offset)` (see [`pattern`]) before the guest starts, so both sides
//! know the bytes without talking. The `rdma` role ends by writing
//! [`DONE_FLAG`] at window offset [`DONE_AT`], which tells a `serve` owner
//! that the peer is finished.

use std::ffi::CString;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use pindown_driver::verbs::opcode::{CompareSwap, FetchAdd, Read, Write};
use pindown_driver::verbs::{
    CompletionQueue, Context, ContextConfig, Entry, QueuePair, RemoteWindow, VerbsError,
};
use pindown_driver::{Transport, VfioConfig, VfioTransport};
use pindown_pincache::{CacheConfig, PinCache};
use pindown_uapi::{Completion, Status};

/// The byte a window owner stores at `offset` before the guest runs.
fn pattern(offset: u64) -> u8 {
    (offset.wrapping_mul(31) ^ (offset >> 8)) as u8
}

/// The bytes the guest writes at window offset `offset`.
fn guest_pattern(offset: u64) -> u8 {
    (offset.wrapping_mul(7) + 0x5a) as u8
}

/// Window offsets of the checks (the window must be at least 64 KiB).
const READ_AT: u64 = 0;
const READ_LEN: u32 = 8192;
const WRITE_AT: u64 = 16384;
const WRITE_LEN: u32 = 12288;
const ATOMIC_AT: u64 = 32768;
/// Where the guest writes from (and reads back into) heap `Vec`s of its
/// own: process memory VFIO maps as it is.
const HEAP_AT: u64 = 36864;
const HEAP_LEN: u32 = 9000;
/// What the atomics leave in the word at [`ATOMIC_AT`].
const ATOMIC_RESULT: u64 = 0x1122_3344_5566_7788;
/// Window offset of the word the `rdma` role writes last.
const DONE_AT: u64 = 49152;
/// The value of that word ("PINDONE!" in little-endian bytes).
const DONE_FLAG: u64 = u64::from_le_bytes(*b"PINDONE!");

/// Layout of the `serve` role's buffer: the window starts at
/// [`SERVE_WINDOW_OFFSET`]; the bytes around it hold [`SERVE_OUTSIDE`].
const SERVE_WINDOW_OFFSET: usize = 4096;
const SERVE_WINDOW_LEN: usize = 65536;
const SERVE_BUFFER_LEN: usize = SERVE_WINDOW_OFFSET + SERVE_WINDOW_LEN + 4096;
const SERVE_OUTSIDE: u8 = 0xa5;
/// How long `serve` waits for the peer's done flag.
const SERVE_WAIT: Duration = Duration::from_secs(200);

/// The modules VFIO needs, in load order (vfio_iommu_type1 is requested
/// by no one else).
const MODULES: [&str; 6] = [
    "irqbypass",
    "vfio",
    "vfio_iommu_type1",
    "vfio_virqfd",
    "vfio-pci-core",
    "vfio-pci",
];

static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();

fn say(line: impl AsRef<str>) {
    let at = START.get_or_init(Instant::now).elapsed().as_secs_f64();
    println!("PINDOWN-GUEST {} (at {at:.3} s)", line.as_ref());
}

/// `KEY=value` from the kernel command line.
fn cmdline_param(key: &str) -> Option<String> {
    fs::read_to_string("/proc/cmdline")
        .unwrap_or_default()
        .split_whitespace()
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
        .map(str::to_owned)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let param = cmdline_param;
    let role = args
        .first()
        .cloned()
        .or_else(|| param("pindown.role"))
        .unwrap_or_else(|| "bind".into());
    let result = match role.as_str() {
        "bind" => bind().map(|path| say(format!("bound {}", path.display()))),
        "rdma" => args
            .get(1)
            .cloned()
            .or_else(|| param("pindown.window"))
            .ok_or_else(|| "no window given (pindown.window=node:port:key:len)".to_string())
            .and_then(|w| w.parse::<RemoteWindow>().map_err(|e| e.to_string()))
            .and_then(rdma),
        "serve" => serve(),
        "pinbench" => {
            let rounds = args
                .get(1)
                .cloned()
                .or_else(|| param("pindown.rounds"))
                .and_then(|r| r.parse().ok())
                .unwrap_or(200);
            pinbench(rounds)
        }
        other => Err(format!("unknown role {other:?}")),
    };
    match result {
        Ok(()) => {
            say("PASS");
            ExitCode::SUCCESS
        }
        Err(reason) => {
            say(format!("FAIL {reason}"));
            ExitCode::FAILURE
        }
    }
}

fn mount_if_missing(source: &str, target: &str, fstype: &str, probe: &str) {
    if Path::new(probe).exists() {
        return;
    }
    let _ = fs::create_dir_all(target);
    let c = |s: &str| CString::new(s).expect("no NUL");
    let (source, target, fstype) = (c(source), c(target), c(fstype));
    // SAFETY: valid NUL-terminated strings; a null data pointer is allowed.
    unsafe {
        libc::mount(
            source.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            0,
            std::ptr::null(),
        );
    }
}

/// Loads `name` from /lib/modules (flat, or the usual tree) unless loaded.
fn load_module(name: &str) -> Result<(), String> {
    if Path::new("/sys/module")
        .join(name.replace('-', "_"))
        .exists()
    {
        return Ok(());
    }
    let file = format!("{name}.ko");
    let mut found = None;
    let mut dirs = vec![PathBuf::from("/lib/modules")];
    while let Some(dir) = dirs.pop() {
        let Ok(entries) = fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.file_name().and_then(|n| n.to_str()) == Some(file.as_str()) {
                found = Some(path);
            }
        }
    }
    let path = found.ok_or_else(|| format!("module {file} not found under /lib/modules"))?;
    let module = fs::File::open(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let params = CString::default();
    // SAFETY: finit_module with an open module file, empty parameters and
    // no flags.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_finit_module,
            std::os::fd::AsRawFd::as_raw_fd(&module),
            params.as_ptr(),
            0,
        )
    };
    let err = std::io::Error::last_os_error();
    if rc != 0 && err.raw_os_error() != Some(libc::EEXIST) {
        return Err(format!("loading {}: {err}", path.display()));
    }
    Ok(())
}

fn read_hex(path: &Path) -> Option<u32> {
    let text = fs::read_to_string(path).ok()?;
    u32::from_str_radix(text.trim().trim_start_matches("0x"), 16).ok()
}

/// Loads the VFIO modules and binds the first virtio-net function to
/// vfio-pci; returns its sysfs directory.
fn bind() -> Result<PathBuf, String> {
    mount_if_missing("proc", "/proc", "proc", "/proc/self");
    mount_if_missing("sysfs", "/sys", "sysfs", "/sys/bus");
    mount_if_missing("devtmpfs", "/dev", "devtmpfs", "/dev/null");
    for module in MODULES {
        load_module(module)?;
    }
    let mut function = None;
    for entry in fs::read_dir("/sys/bus/pci/devices").map_err(|e| e.to_string())? {
        let path = entry.map_err(|e| e.to_string())?.path();
        let vendor = read_hex(&path.join("vendor"));
        let device = read_hex(&path.join("device"));
        if vendor == Some(0x1af4) && matches!(device, Some(0x1041) | Some(0x1000)) {
            function = Some(path);
            break;
        }
    }
    let path = function.ok_or("no virtio-net PCI function")?;
    let address = path
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or("bad PCI path")?
        .to_owned();
    let driver = fs::read_link(path.join("driver")).ok();
    let bound_to = driver
        .as_ref()
        .and_then(|d| d.file_name())
        .and_then(|n| n.to_str())
        .map(str::to_owned);
    if bound_to.as_deref() != Some("vfio-pci") {
        if bound_to.is_some() {
            fs::write(path.join("driver/unbind"), &address)
                .map_err(|e| format!("unbinding {address}: {e}"))?;
        }
        fs::write(path.join("driver_override"), "vfio-pci")
            .map_err(|e| format!("driver_override of {address}: {e}"))?;
        fs::write("/sys/bus/pci/drivers_probe", &address)
            .map_err(|e| format!("drivers_probe of {address}: {e}"))?;
    }
    let group = fs::read_link(path.join("iommu_group"))
        .map_err(|e| format!("{address} has no IOMMU group (intel_iommu=on?): {e}"))?;
    let group = group
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or("bad group link")?
        .to_owned();
    let node = Path::new("/dev/vfio").join(&group);
    let deadline = Instant::now() + Duration::from_secs(5);
    while !node.exists() {
        if Instant::now() >= deadline {
            return Err(format!("{} did not appear", node.display()));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(path)
}

fn open_context(config: ContextConfig) -> Result<Context<VfioTransport>, String> {
    let path = bind()?;
    say(format!("bound {}", path.display()));
    let mut vfio = VfioConfig::new(&path);
    if cmdline_param("pindown.event_idx").as_deref() == Some("0") {
        vfio.refused_features |= pindown_driver::transport::F_EVENT_IDX;
    }
    let transport = VfioTransport::open(vfio).map_err(|e| e.to_string())?;
    say(format!(
        "transport caps={:?} max_pairs={} rings={:?} features={:#x}",
        transport.capabilities(),
        transport.max_queue_pairs(),
        transport.ring_layout(),
        transport.device_features()
    ));
    let context = Context::with_transport(transport, config).map_err(|e| e.to_string())?;
    say(format!("context open: port {}", context.info().port));
    Ok(context)
}

/// A queue pair of the guest's context and its completion queue.
struct Link<'c> {
    context: &'c Context<VfioTransport>,
    qp: QueuePair<'c, VfioTransport>,
    cq: CompletionQueue<'c, VfioTransport>,
}

impl<'c> Link<'c> {
    fn new(context: &'c Context<VfioTransport>) -> Result<Self, String> {
        let mut cq = context.create_completion_queue();
        let qp = context
            .create_queue_pair(&mut cq)
            .map_err(|e| e.to_string())?;
        Ok(Link { context, qp, cq })
    }

    fn wait_one(&mut self) -> Result<Completion, String> {
        match self.cq.wait(Duration::from_secs(20)) {
            Ok(mut ready) if ready.len() == 1 => Ok(ready.next().expect("one completion")),
            Ok(ready) => Err(format!("{} completions", ready.len())),
            Err(VerbsError::Timeout(t)) => Err(format!("no completion within {t:?}")),
            Err(e) => Err(e.to_string()),
        }
    }

    /// Posts `entry` and waits for its completion. The device learns a
    /// guest buffer's translation on demand: the first access to a freshly
    /// pinned buffer misses in its IOTLB, and the device holds the request
    /// until QEMU answers its miss from the vIOMMU's tables.
    fn run(&mut self, entry: Entry<'_>) -> Result<Completion, String> {
        self.qp.post(&[entry]).map_err(|e| e.to_string())?;
        let started = Instant::now();
        let done = self.wait_one()?;
        let (reads, hits, ticks) = self.context.transport().isr_stats();
        say(format!(
            "op {:?} {:?} in {:.3} ms (isr reads={reads} raised={hits} ticks={ticks})",
            done.opcode,
            done.status,
            started.elapsed().as_secs_f64() * 1e3
        ));
        Ok(done)
    }
}

fn expect_success(done: Completion, what: &str) -> Result<Completion, String> {
    if done.status != Status::Success {
        return Err(format!("{what}: {done:?}"));
    }
    Ok(done)
}

fn rdma(window: RemoteWindow) -> Result<(), String> {
    if window.len < 65536 {
        return Err(format!("window of {} bytes; 64 KiB needed", window.len));
    }
    let context = open_context(ContextConfig {
        arena_bytes: 8 << 20,
        ..ContextConfig::default()
    })?;
    let buffer = context.alloc(65536, 4096).map_err(|e| e.to_string())?;
    let region = context
        .register_buffer(&buffer)
        .map_err(|e| e.to_string())?;
    let local = |offset: u64, len: u32| region.local(offset, len).map_err(|e| e.to_string());
    let mut link = Link::new(&context)?;

    // Read: the owner's pattern arrives.
    buffer.fill(0);
    let read = Read::new(local(0, READ_LEN)?, window.at(READ_AT))
        .build()
        .user_data(1)
        .signaled();
    let done = expect_success(link.run(read)?, "read")?;
    let mut got = vec![0u8; READ_LEN as usize];
    buffer.read_at(0, &mut got);
    let bad = (0..READ_LEN as u64).find(|&i| got[i as usize] != pattern(READ_AT + i));
    if done.byte_len != READ_LEN || bad.is_some() {
        return Err(format!("read: {done:?}, first wrong byte at {bad:?}"));
    }
    say(format!("read {READ_LEN} bytes verified"));

    // Write, then read it back.
    let data: Vec<u8> = (0..WRITE_LEN as u64)
        .map(|i| guest_pattern(WRITE_AT + i))
        .collect();
    buffer.write_at(8192, &data);
    let write = Write::new(local(8192, WRITE_LEN)?, window.at(WRITE_AT))
        .build()
        .user_data(2)
        .signaled();
    expect_success(link.run(write)?, "write")?;
    buffer.fill(0);
    let back = Read::new(local(32768, WRITE_LEN)?, window.at(WRITE_AT))
        .build()
        .user_data(3)
        .signaled();
    expect_success(link.run(back)?, "read back")?;
    let mut got = vec![0u8; WRITE_LEN as usize];
    buffer.read_at(32768, &mut got);
    if got != data {
        return Err("write: read back differs".into());
    }
    say(format!("write {WRITE_LEN} bytes verified by read back"));

    // Atomics on the word at ATOMIC_AT, which starts as the owner's pattern.
    let mut word = [0u8; 8];
    for (i, b) in word.iter_mut().enumerate() {
        *b = pattern(ATOMIC_AT + i as u64);
    }
    let initial = u64::from_le_bytes(word);
    let mut expected = initial;
    for round in 0..3u64 {
        let add = FetchAdd::new(window.at(ATOMIC_AT), 1000 + round)
            .build()
            .user_data(10 + round)
            .signaled();
        let done = expect_success(link.run(add)?, "fetch-add")?;
        if done.value != expected {
            return Err(format!(
                "fetch-add {round}: old {:#x}, expected {expected:#x}",
                done.value
            ));
        }
        expected = expected.wrapping_add(1000 + round);
    }
    let cas = CompareSwap::new(window.at(ATOMIC_AT), expected, ATOMIC_RESULT)
        .build()
        .user_data(20)
        .signaled();
    let done = expect_success(link.run(cas)?, "compare-swap")?;
    if done.value != expected {
        return Err(format!("compare-swap: old {:#x}", done.value));
    }
    let failed_cas = CompareSwap::new(window.at(ATOMIC_AT), 0, 0xdead)
        .build()
        .user_data(21)
        .signaled();
    let done = expect_success(link.run(failed_cas)?, "compare-swap (no match)")?;
    if done.value != ATOMIC_RESULT {
        return Err(format!("compare-swap (no match): old {:#x}", done.value));
    }
    say("atomics verified: 3 fetch-adds, compare-swap hit and miss");

    // From and into heap memory of this process, registered where it is:
    // VFIO maps any memory, so no copy and no arena.
    let skew = 4093;
    let mut source = vec![0u8; skew + HEAP_LEN as usize + 5];
    for i in 0..HEAP_LEN as usize {
        source[skew + i] = guest_pattern(HEAP_AT + i as u64);
    }
    // SAFETY: `link.run` returns once the request has completed, or fails
    // this run, which then exits; `source` outlives both regions and no
    // window is bound on them.
    let source_region =
        unsafe { context.register_bytes(&mut source) }.map_err(|e| e.to_string())?;
    let write = Write::new(
        source_region
            .local(skew as u64, HEAP_LEN)
            .map_err(|e| e.to_string())?,
        window.at(HEAP_AT),
    )
    .build()
    .user_data(25)
    .signaled();
    expect_success(link.run(write)?, "write from a heap Vec")?;
    let mut sink = vec![0u8; HEAP_LEN as usize + 1];
    // SAFETY: as for `source_region`.
    let sink_region = unsafe { context.register_bytes(&mut sink) }.map_err(|e| e.to_string())?;
    let read = Read::new(
        sink_region.local(1, HEAP_LEN).map_err(|e| e.to_string())?,
        window.at(HEAP_AT),
    )
    .build()
    .user_data(26)
    .signaled();
    expect_success(link.run(read)?, "read into a heap Vec")?;
    drop((source_region, sink_region));
    // The device wrote behind the compiler's back.
    std::hint::black_box(&mut sink);
    if sink[0] != 0 || sink[1..] != source[skew..skew + HEAP_LEN as usize] {
        return Err("heap Vec: the bytes read back differ".into());
    }
    say(format!(
        "heap Vec write and read of {HEAP_LEN} bytes verified"
    ));

    // Out of the window: a write straddling its end, a read past it.
    buffer.fill(0xee);
    let outside = Write::new(local(0, 64)?, window.at(window.len - 32))
        .build()
        .user_data(30)
        .signaled();
    let done = link.run(outside)?;
    if done.status != Status::RemoteAccessError {
        return Err(format!("out-of-window write: {done:?}"));
    }
    let outside = Read::new(local(0, 16)?, window.at(window.len))
        .build()
        .user_data(31)
        .signaled();
    let done = link.run(outside)?;
    if done.status != Status::RemoteAccessError {
        return Err(format!("out-of-window read: {done:?}"));
    }
    let mut got = [0u8; 16];
    buffer.read_at(0, &mut got);
    if got != [0xee; 16] {
        return Err("a failed read changed local memory".into());
    }
    say("out-of-window write and read refused");

    // The device still serves.
    let again = Read::new(local(0, 64)?, window.at(READ_AT))
        .build()
        .user_data(40)
        .signaled();
    expect_success(link.run(again)?, "read after errors")?;

    // Last: the done flag, so a waiting owner knows every write landed.
    buffer.write_at(0, &DONE_FLAG.to_le_bytes());
    let done = Write::new(local(0, 8)?, window.at(DONE_AT))
        .build()
        .user_data(50)
        .signaled();
    expect_success(link.run(done)?, "done flag")?;
    let (reads, hits, ticks) = context.transport().isr_stats();
    say(format!("isr reads={reads} raised={hits} ticks={ticks}"));
    say("RDMA DONE");
    Ok(())
}

/// The window owner's side of `rdma`: binds a window over the middle of a
/// registered buffer (pattern inside, [`SERVE_OUTSIDE`] around it), prints
/// it, waits until the peer's [`DONE_FLAG`] appears in its own memory and
/// checks every byte of the buffer against what the peer's operations
/// should have left.
fn serve() -> Result<(), String> {
    let context = open_context(ContextConfig {
        arena_bytes: 4 << 20,
        ..ContextConfig::default()
    })?;
    let buffer = context
        .alloc(SERVE_BUFFER_LEN, 4096)
        .map_err(|e| e.to_string())?;
    let mut expected = vec![SERVE_OUTSIDE; SERVE_BUFFER_LEN];
    for w in 0..SERVE_WINDOW_LEN {
        expected[SERVE_WINDOW_OFFSET + w] = pattern(w as u64);
    }
    buffer.write_at(0, &expected);
    let region = context
        .register_buffer(&buffer)
        .map_err(|e| e.to_string())?;
    let window = context
        .bind_window(
            &region,
            SERVE_WINDOW_OFFSET as u64,
            SERVE_WINDOW_LEN as u64,
            pindown_uapi::Access::REMOTE_READ
                | pindown_uapi::Access::REMOTE_WRITE
                | pindown_uapi::Access::REMOTE_ATOMIC,
        )
        .map_err(|e| e.to_string())?;
    println!("PINDOWN-RESULT window={}", window.remote());

    let flag_at = SERVE_WINDOW_OFFSET + DONE_AT as usize;
    let deadline = Instant::now() + SERVE_WAIT;
    loop {
        let mut word = [0u8; 8];
        buffer.read_at(flag_at, &mut word);
        if u64::from_le_bytes(word) == DONE_FLAG {
            break;
        }
        if Instant::now() >= deadline {
            return Err(format!("no done flag from the peer within {SERVE_WAIT:?}"));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    say("done flag seen");

    for i in 0..WRITE_LEN as u64 {
        expected[SERVE_WINDOW_OFFSET + (WRITE_AT + i) as usize] = guest_pattern(WRITE_AT + i);
    }
    for i in 0..HEAP_LEN as u64 {
        expected[SERVE_WINDOW_OFFSET + (HEAP_AT + i) as usize] = guest_pattern(HEAP_AT + i);
    }
    let atomic = SERVE_WINDOW_OFFSET + ATOMIC_AT as usize;
    expected[atomic..atomic + 8].copy_from_slice(&ATOMIC_RESULT.to_le_bytes());
    expected[flag_at..flag_at + 8].copy_from_slice(&DONE_FLAG.to_le_bytes());
    let mut now = vec![0u8; SERVE_BUFFER_LEN];
    buffer.read_at(0, &mut now);
    if let Some(i) = (0..SERVE_BUFFER_LEN).find(|&i| now[i] != expected[i]) {
        return Err(format!(
            "buffer byte {i} is {:#04x}, expected {:#04x}",
            now[i], expected[i]
        ));
    }
    say(format!(
        "write {WRITE_LEN} bytes, heap write {HEAP_LEN} bytes, atomic word and done flag \
         verified; the other {} bytes unchanged",
        SERVE_BUFFER_LEN - WRITE_LEN as usize - HEAP_LEN as usize - 16
    ));
    println!("PINDOWN-RESULT serve=ok");
    Ok(())
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn summary(mut samples: Vec<f64>) -> String {
    samples.sort_by(f64::total_cmp);
    let mean = samples.iter().sum::<f64>() / samples.len().max(1) as f64;
    format!(
        "{{\"n\": {}, \"mean_us\": {:.3}, \"median_us\": {:.3}, \"p90_us\": {:.3}, \"min_us\": {:.3}}}",
        samples.len(),
        mean,
        percentile(&samples, 0.5),
        percentile(&samples, 0.9),
        samples.first().copied().unwrap_or(0.0)
    )
}

fn micros(start: Instant) -> f64 {
    start.elapsed().as_secs_f64() * 1e6
}

/// Measures the pin-down cache inside the guest: through the verbs API
/// (mlock plus VFIO map per miss) and through a bare [`VfioPinner`](pindown_driver::VfioPinner) cache
/// (VFIO map only); then a hit rate under an LRU-friendly reuse pattern
/// with fewer cache entries than buffers.
fn pinbench(rounds: usize) -> Result<(), String> {
    let page = pindown_driver::page_size();
    let buffers = 64usize;
    let buffer_pages = 4usize;
    let context = open_context(ContextConfig {
        arena_bytes: 16 << 20,
        cache: CacheConfig {
            merge: false,
            ..CacheConfig::default()
        },
        ..ContextConfig::default()
    })?;

    // Verbs registration: miss (first time) then hit (again).
    let bufs: Vec<_> = (0..buffers)
        .map(|_| context.alloc(buffer_pages * page, page))
        .collect::<Result<_, _>>()
        .map_err(|e| e.to_string())?;
    let mut miss = Vec::new();
    let mut hit = Vec::new();
    for buf in &bufs {
        let start = Instant::now();
        let region = context.register_buffer(buf).map_err(|e| e.to_string())?;
        miss.push(micros(start));
        drop(region);
    }
    for _ in 0..rounds.div_ceil(buffers) {
        for buf in &bufs {
            let start = Instant::now();
            let region = context.register_buffer(buf).map_err(|e| e.to_string())?;
            hit.push(micros(start));
            drop(region);
        }
    }
    let verbs_stats = context.registration_stats();

    // Bare VFIO pinner: map and unmap costs, then a workload hit rate.
    let dma = std::sync::Arc::clone(context.transport().dma());
    let memory = context
        .alloc(buffers * buffer_pages * page, page)
        .map_err(|e| e.to_string())?;
    let base = memory.iova() as usize;
    let cache = PinCache::new(
        pindown_driver::VfioPinner::new(std::sync::Arc::clone(&dma)),
        CacheConfig {
            max_entries: buffers / 2,
            merge: false,
            ..CacheConfig::default()
        },
    )
    .map_err(|e| e.to_string())?;
    let mut vfio_miss = Vec::new();
    let mut vfio_hit = Vec::new();
    let (maps_before, unmaps_before) = dma.calls();
    // Working set: 3/4 of the accesses go to 8 hot buffers, the rest sweep
    // all of them (deterministic).
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let accesses = rounds.max(buffers) * 4;
    for n in 0..accesses {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let which = if !seed.is_multiple_of(4) {
            (seed >> 8) as usize % 8
        } else {
            n % buffers
        };
        let addr = base + which * buffer_pages * page;
        let before = cache.stats().misses;
        let start = Instant::now();
        let registration = cache
            .pin(addr, buffer_pages * page)
            .map_err(|e| e.to_string())?;
        let took = micros(start);
        drop(registration);
        if cache.stats().misses > before {
            vfio_miss.push(took);
        } else {
            vfio_hit.push(took);
        }
    }
    let stats = cache.stats();
    let (maps, unmaps) = dma.calls();
    drop(cache);

    let memlock = {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes into the struct we pass.
        unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) };
        if limit.rlim_cur == libc::RLIM_INFINITY {
            "null".to_string()
        } else {
            limit.rlim_cur.to_string()
        }
    };
    let hit_rate = stats.hits as f64 / (stats.hits + stats.misses).max(1) as f64;
    println!(
        "PINDOWN-GUEST JSON {{\"bench\": \"guest_pin_cache\", \"transport\": \"vfio\", \
         \"page_size\": {page}, \"region_bytes\": {}, \
         \"dma_entry_limit\": {}, \"memlock_limit\": {memlock}, \
         \"verbs_register\": {{\"miss\": {}, \"hit\": {}, \"hits\": {}, \"misses\": {}}}, \
         \"vfio_pinner\": {{\"miss\": {}, \"hit\": {}, \"hits\": {}, \"misses\": {}, \
         \"evictions\": {}, \"hit_rate\": {hit_rate:.4}, \"max_entries\": {}, \
         \"vfio_map_calls\": {}, \"vfio_unmap_calls\": {}}}}}",
        buffer_pages * page,
        pindown_driver::vfio::VfioDma::entry_limit().map_or("null".to_string(), |l| l.to_string()),
        summary(miss),
        summary(hit),
        verbs_stats.hits,
        verbs_stats.misses,
        summary(vfio_miss),
        summary(vfio_hit),
        stats.hits,
        stats.misses,
        stats.evictions,
        buffers / 2,
        maps - maps_before,
        unmaps - unmaps_before,
    );
    Ok(())
}
