//! `pindown-stat` against a running device: the counters it shows add up
//! to the work two driver contexts did, in JSON and in the table; the
//! rings show the sizes the driver set and the requests it posted; two
//! devices joined by the fabric agree on the datagrams each sent the
//! other, and the one whose peer drops what it receives sent again.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::any_memory::{pair, peer_reads, peer_writes, run, ALL};
use common::DeviceProcess;
use pindown_driver::verbs::opcode::{Entry, Read, Write};
use pindown_driver::verbs::{Context, ContextConfig};
use pindown_uapi::{Access, RemoteKey, Status};
use serde_json::Value;

fn stat(control: &std::path::Path, args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_pindown-stat"))
        .arg("--control")
        .arg(control)
        .args(args)
        .output()
        .expect("run pindown-stat");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn ports(control: &std::path::Path) -> Vec<Value> {
    let json: Value = serde_json::from_str(&stat(control, &["--json"])).unwrap();
    assert!(json["fabric"].is_null(), "{json}");
    json["ports"].as_array().unwrap().clone()
}

fn delta(after: &Value, before: &Value, key: &str) -> u64 {
    after[key]
        .as_u64()
        .unwrap_or_else(|| panic!("{key} in {after}"))
        - before[key].as_u64().unwrap()
}

#[test]
fn the_counters_shown_add_up_to_the_work_done() {
    let pair = pair();
    let control = pair._device.control_path();
    let target = pair.owner.alloc(1 << 20, 4096).unwrap();
    let region = pair.owner.register_buffer(&target).unwrap();
    let window = pair.owner.bind_window(&region, 0, 1 << 20, ALL).unwrap();
    let before = ports(&control);
    assert_eq!(before.len(), 2);
    let sizes = [1usize, 64, 4096, 65_537, 1 << 20];
    for (i, &len) in sizes.iter().enumerate() {
        peer_writes(&pair, &window, 0, &vec![i as u8; len]);
    }
    let read = peer_reads(&pair, &window, 3, 1000);
    assert_eq!(read.len(), 1000);
    // A write with a key nobody bound: refused at the owner, failed at
    // the peer.
    let source = pair.peer.alloc(8, 64).unwrap();
    let source_region = pair.peer.register_buffer(&source).unwrap();
    let mut forged = window.remote().at(0);
    forged.key = RemoteKey(forged.key.0 ^ 0x5a5a_0000);
    let done = run(
        &pair.peer,
        Write::new(source_region.local(0, 8).unwrap(), forged).build(),
    );
    assert_eq!(done.status, Status::RemoteAccessError, "{done:?}");
    let after = ports(&control);
    let (owner, peer) = (0, 1);
    assert_eq!(
        delta(&after[peer], &before[peer], "requests_write"),
        sizes.len() as u64 + 1
    );
    assert_eq!(delta(&after[peer], &before[peer], "requests_read"), 1);
    assert_eq!(
        delta(&after[peer], &before[peer], "bytes"),
        sizes.iter().sum::<usize>() as u64 + 1000
    );
    assert_eq!(
        delta(&after[peer], &before[peer], "failed_remote_access"),
        1
    );
    assert_eq!(delta(&after[owner], &before[owner], "refused_bad_key"), 1);
    assert_eq!(delta(&after[owner], &before[owner], "requests_write"), 0);
    assert_eq!(after[owner]["windows"], 1, "{}", after[owner]);
    assert!(after[owner]["mapped_bytes"].as_u64().unwrap() >= 1 << 20);
    // Pinned bytes are what the IOTLB entries cover: none without an
    // entry, at least a byte per entry.
    for port in &after {
        let (entries, pinned) = (
            port["iotlb_entries"].as_u64().unwrap(),
            port["iotlb_bytes"].as_u64().unwrap(),
        );
        assert_eq!(entries == 0, pinned == 0, "{port}");
        assert!(pinned >= entries, "{port}");
    }
    assert_eq!(after[owner]["connected"], 1);

    // The table says the same, and --watch refreshes.
    let table = stat(&control, &[]);
    assert!(table.contains("requests"), "{table}");
    let peer_row = table
        .lines()
        .find(|l| l.starts_with("1 "))
        .unwrap_or_else(|| panic!("no row for port 1:\n{table}"));
    let requests: u64 = after[peer]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| k.starts_with("requests_"))
        .map(|(_, v)| v.as_u64().unwrap())
        .sum();
    assert!(
        peer_row
            .split_whitespace()
            .any(|w| w == requests.to_string()),
        "{peer_row} should show {requests} requests"
    );
    assert!(table.contains("fabric     none"), "{table}");
    let watched = stat(&control, &["--watch", "0.05", "--count", "2"]);
    assert_eq!(watched.matches("\nport 1\n").count(), 2, "{watched}");
    drop(window);
}

#[test]
fn a_device_that_is_not_there_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_pindown-stat"))
        .arg("--dir")
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("control.sock"), "{err}");
}

/// The whole `--json` document.
fn document(control: &std::path::Path) -> Value {
    serde_json::from_str(&stat(control, &["--json"])).unwrap()
}

fn number(value: &Value, key: &str) -> u64 {
    value[key]
        .as_u64()
        .unwrap_or_else(|| panic!("{key} is not a number in {value}"))
}

/// The fabric of both devices once no datagram is on its way (every
/// count the same twice in a row, 100 ms apart); neither received more
/// from the other than the other sent it (the kernel may drop some under
/// load, even on loopback).
fn quiet_fabrics(zero: &DeviceProcess, one: &DeviceProcess) -> (Value, Value) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let counts = |f: &Value| {
        let peer = &f["peers"][0];
        (
            number(peer, "datagrams_sent"),
            number(peer, "datagrams_received"),
        )
    };
    let mut last: Option<((u64, u64), (u64, u64))> = None;
    loop {
        let a = document(&zero.control_path())["fabric"].clone();
        let b = document(&one.control_path())["fabric"].clone();
        let now = (counts(&a), counts(&b));
        let ((a_sent, a_received), (b_sent, b_received)) = now;
        assert!(b_received <= a_sent && a_received <= b_sent, "{a}\n{b}");
        if last == Some(now) {
            return (a, b);
        }
        assert!(
            Instant::now() < deadline,
            "the fabric never settled:\n{a}\n{b}"
        );
        last = Some(now);
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn rings_and_fabric_peers_add_up_to_the_traffic() {
    let udp = [common::free_udp_port(), common::free_udp_port()];
    let start = |node: u16, extra: &[&str]| {
        let mut args = common::fabric_args(node, &udp, "5eed57a7");
        args.extend(extra.iter().map(|s| s.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        DeviceProcess::start(common::device_bin(), 1, &args).unwrap()
    };
    let zero = start(0, &[]);
    // Node 1 drops 5 % of what it receives: node 0 must send again.
    let one = start(1, &["--fault-in", "loss=0.05,seed=11"]);
    let queue_size = 32;
    let config = ContextConfig {
        arena_bytes: 16 << 20,
        queue_size,
        ..ContextConfig::default()
    };
    let initiator = Context::open(zero.socket(0), config.clone()).unwrap();
    let target = Context::open(one.socket(0), config).unwrap();

    const SPAN: usize = 1 << 20;
    const PIECE: usize = 64 << 10;
    let near = initiator.alloc(SPAN, 4096).unwrap();
    let far = target.alloc(SPAN, 4096).unwrap();
    let near_region = initiator.register_buffer(&near).unwrap();
    let far_region = target.register_buffer(&far).unwrap();
    let window = target
        .bind_window(
            &far_region,
            0,
            SPAN as u64,
            Access::REMOTE_READ | Access::REMOTE_WRITE,
        )
        .unwrap();
    let source: Vec<u8> = (0..SPAN).map(|i| (i * 7 + i / 4096) as u8).collect();
    near.write_at(0, &source);

    // One queue pair: every piece written, then the first piece read back
    // into the zeroed end of the local buffer.
    let mut cq = initiator.create_completion_queue();
    let mut qp = initiator.create_queue_pair(&mut cq).unwrap();
    let mut requests = 0u64;
    let mut post = |entry: Entry<'_>| {
        qp.post(&[entry.signaled()]).unwrap();
        requests += 1;
        let done: Vec<_> = cq.wait(Duration::from_secs(30)).unwrap().collect();
        assert_eq!(done.len(), 1);
        assert_eq!(done[0].status, Status::Success, "{:?}", done[0]);
    };
    for at in (0..SPAN).step_by(PIECE) {
        post(
            Write::new(
                near_region.local(at as u64, PIECE as u32).unwrap(),
                window.remote().at(at as u64),
            )
            .build(),
        );
    }
    let mut written = vec![0u8; SPAN];
    far.read_at(0, &mut written);
    assert!(written == source, "the writes did not all land");
    near.write_at(SPAN - PIECE, &vec![0u8; PIECE]);
    post(
        Read::new(
            near_region
                .local((SPAN - PIECE) as u64, PIECE as u32)
                .unwrap(),
            window.remote().at(0),
        )
        .build(),
    );
    let mut read = vec![0u8; PIECE];
    near.read_at(SPAN - PIECE, &mut read);
    assert!(read == source[..PIECE], "the read did not land");

    // The rings: the sizes the driver set, and the send and completion
    // queue of the pair used have moved by one slot per request.
    let port = &document(&zero.control_path())["ports"][0];
    let rings = port["rings"].as_array().expect("rings");
    let rdma: Vec<&Value> = rings
        .iter()
        .filter(|r| r["kind"] == "send" || r["kind"] == "completion")
        .collect();
    assert!(rdma.len() >= 4, "the admin pair and ours: {port}");
    for ring in &rdma {
        // Every completion was reaped: nothing in flight.
        assert_eq!(number(ring, "in_flight"), 0, "{ring}");
        assert_eq!(number(ring, "size"), u64::from(queue_size), "{ring}");
        assert_eq!(number(ring, "started"), 1, "{ring}");
        assert_eq!(number(ring, "broken"), 0, "{ring}");
    }
    let ours = |kind: &str| {
        rdma.iter()
            .filter(|r| r["kind"] == kind && number(r, "pair") != 0)
            .map(|r| number(r, "position"))
            .max()
            .unwrap()
    };
    // No wrap: fewer requests than the 16-bit positions count.
    assert_eq!(ours("send"), requests, "{port}");
    assert_eq!(ours("completion"), requests, "{port}");

    // The fabric: what each side sent the other, the other received,
    // unless the kernel dropped it (then it was sent again, or it was
    // an acknowledgement).
    let (a, b) = quiet_fabrics(&zero, &one);
    let (to_one, to_zero) = (&a["peers"][0], &b["peers"][0]);
    assert_eq!(a["peers"].as_array().unwrap().len(), 1, "{a}");
    assert_eq!(number(to_one, "node"), 1);
    assert_eq!(number(to_zero, "node"), 0);
    assert_eq!(to_one["address"], format!("127.0.0.1:{}", udp[1]));
    assert_eq!(to_zero["address"], format!("127.0.0.1:{}", udp[0]));
    assert!(number(&a, "memory_peer_stats") > 0, "{a}");
    // The peers' counts are the link's (one peer each; no stray datagram
    // on loopback).
    for (link, peer) in [(&a, to_one), (&b, to_zero)] {
        for key in ["datagrams_sent", "retransmissions", "dropped_datagrams"] {
            assert_eq!(number(peer, key), number(link, key), "{key}: {link}");
        }
        assert_eq!(
            number(peer, "datagrams_received"),
            number(link, "datagrams_received") - number(link, "stray_datagrams"),
            "{link}"
        );
        assert_ne!(number(peer, "incarnation"), 0, "heard from: {peer}");
        assert!(number(peer, "rto_us") > 0, "{peer}");
        assert_eq!(number(peer, "outstanding"), 0, "{peer}");
        assert_eq!(number(peer, "gone"), 0, "{peer}");
        assert_eq!(number(peer, "abandoned"), 0, "{peer}");
    }
    // Every byte went in datagrams of at most one message each: the
    // writes' bytes took at least that many first transmissions to node
    // 1, the read's to node 0.
    let max_payload = pindown_emu_device::net::Config::default().max_payload as u64;
    let first = |peer: &Value| number(peer, "datagrams_sent") - number(peer, "retransmissions");
    assert!(
        first(to_one) >= (SPAN as u64).div_ceil(max_payload),
        "{to_one}"
    );
    assert!(
        first(to_zero) >= (PIECE as u64).div_ceil(max_payload),
        "{to_zero}"
    );
    // What node 1 dropped on arrival, node 0 sent again.
    assert!(number(to_one, "retransmissions") > 0, "{to_one}");
    // Node 0's writes were acknowledged on their first transmission often
    // enough for a round-trip estimate (Karn: only those count).
    let srtt = number(to_one, "srtt_us");
    assert!(srtt > 0 && srtt <= number(to_one, "rto_us"), "{to_one}");

    // The table shows the peer and the rings.
    let table = stat(&zero.control_path(), &[]);
    let peer_line = table
        .lines()
        .find(|l| l.contains(&format!("127.0.0.1:{}", udp[1])))
        .unwrap_or_else(|| panic!("no line for peer 1:\n{table}"));
    let words: Vec<&str> = peer_line.split_whitespace().collect();
    assert!(
        words.contains(&number(to_one, "datagrams_sent").to_string().as_str()),
        "{peer_line}"
    );
    assert!(peer_line.ends_with("up"), "{peer_line}");
    let send_line = table
        .lines()
        .find(|l| l.contains(" send ") && l.contains(&format!(" {requests} ")))
        .unwrap_or_else(|| panic!("no send queue at {requests}:\n{table}"));
    assert!(
        send_line.contains(&format!(" {queue_size} ")),
        "{send_line}"
    );

    // A write to a node that is stopped stays in flight until it wakes.
    let pair_in_flight = |pindown_stat: &Value| {
        pindown_stat["ports"][0]["rings"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["kind"] == "send" && number(r, "pair") != 0)
            .map(|r| number(r, "in_flight"))
            .sum::<u64>()
    };
    assert!(one.stop(Duration::from_secs(2)), "node 1 did not stop");
    qp.post(&[Write::new(
        near_region.local(0, PIECE as u32).unwrap(),
        window.remote().at(0),
    )
    .build()
    .signaled()])
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(2);
    while pair_in_flight(&document(&zero.control_path())) == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    let during = document(&zero.control_path());
    let in_flight = pair_in_flight(&during);
    one.resume();
    assert_eq!(
        in_flight, 1,
        "the write to the stopped node: {}",
        during["ports"][0]["rings"]
    );
    let done: Vec<_> = cq.wait(Duration::from_secs(30)).unwrap().collect();
    assert_eq!(done[0].status, Status::Success, "{:?}", done[0]);
    assert_eq!(pair_in_flight(&document(&zero.control_path())), 0);
    drop(window);
}
