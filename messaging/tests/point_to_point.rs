//! Point-to-point calls between real rank processes over the emulated
//! NIC (`examples/msg_check`): every byte that arrives is checked against
//! what its sender generated.

mod common;

use common::{checked, launch, passes};

#[test]
fn blocking_nonblocking_named_and_persistent_messages_arrive_whole() {
    let lines = passes(2, "pingpong", &[]);
    // 3 rounds of 12 sizes each way blocking, 12 nonblocking, one named
    // wait and 20 persistent 3000-byte messages: the same on both ranks.
    let sizes: u64 = [
        0u64,
        1,
        8,
        511,
        512,
        513,
        4096,
        4097,
        65536,
        1 << 20,
        (1 << 20) + 3,
        4 << 20,
    ]
    .iter()
    .sum();
    let expected = 3 * sizes + sizes + 100 + 20 * 3000;
    for line in &lines {
        assert_eq!(checked(line), expected, "{line}");
    }
}

#[test]
fn the_timeout_switch_spools_waits_and_switches() {
    for mode in [&[][..], &["--mode", "switch"][..]] {
        let lines = passes(2, "timeout-switch", mode);
        // Rank 1 checks 8 spooled, one synchronous and one switched message.
        let spooled: u64 = (0..8).map(|n| 1000 + n * 8000).sum();
        assert_eq!(checked(&lines[1]), spooled + 5000 + 30_000, "{}", lines[1]);
    }
}

#[test]
fn ranks_that_all_send_first_do_not_deadlock() {
    for n in [2, 3, 4] {
        for mode in ["buffered", "switch"] {
            let lines = passes(n, "send-first", &["--mode", mode]);
            let per_peer: u64 = (0..3).map(|round| 100 + round * 40_000).sum();
            for line in &lines {
                assert_eq!(checked(line), per_peer * u64::from(n - 1), "{line}");
            }
        }
    }
}

#[test]
fn synchronous_sends_first_deadlock_is_refused_not_hung() {
    let run = launch(2, "send-first", &["--mode", "sync"]);
    assert!(!run.success, "{}", run.text);
    assert!(run.text.contains("finite send timeout"), "{}", run.text);
}

#[test]
fn any_index_receives_report_the_index_the_sender_named() {
    let lines = passes(2, "any-index", &[]);
    assert_eq!(checked(&lines[1]), (0..6).map(|n| 64 + n).sum::<u64>());
}

#[test]
fn a_short_receive_buffer_is_filled_and_nothing_past_it_is_written() {
    let lines = passes(2, "truncation", &[]);
    assert_eq!(checked(&lines[1]), 64 + 4096 + 1000 + 3 * 4096);
}

#[test]
fn every_slot_outstanding_at_once_and_clear_errors_beyond() {
    let lines = passes(2, "slots", &[]);
    for line in &lines {
        assert_eq!(checked(line), 64 * 300 + 300, "{line}");
    }
}

#[test]
fn split_and_dup_communicators_keep_their_messages_apart() {
    for n in [1, 2, 3, 5] {
        let lines = passes(n, "split", &[]);
        for line in &lines {
            assert_eq!(checked(line), 2000, "{line}");
        }
    }
}

#[test]
fn a_rank_that_dies_fails_the_receives_from_it_without_hanging() {
    for n in [2, 4] {
        let run = launch(n, "peer-death", &[]);
        // The dead rank prints nothing; every other rank noticed.
        assert_eq!(run.ranks.len(), n as usize - 1, "{}", run.text);
        for line in &run.ranks {
            assert_eq!(line["ok"], true, "{}", run.text);
        }
    }
}

#[test]
fn typed_messages_move_between_any_layouts_with_no_pack() {
    let lines = passes(2, "typed", &[]);
    // Per round: a 300 x 301 matrix checked whole, a 300-double column
    // twice, and a 60-double sub-block; then a refused 60-row column, and
    // a column's first 40 bytes in a 40-byte plain receive with 64 guard
    // bytes after it.
    let matrix = 300 * 301 * 8;
    let per_round = matrix + 2 * 300 * 8 + 60 * 8;
    assert_eq!(
        checked(&lines[1]),
        3 * per_round + 60 * 301 * 8 + 40 + 64,
        "{}",
        lines[1]
    );
}

/// How a device leaves the ranks waiting on it.
#[derive(Clone, Copy, Debug)]
enum DeviceEnd {
    /// It exits: its connections close.
    Terminated,
    /// It stops (SIGSTOP) for 10 s: its connections stay open,
    /// unanswered. A receive's wait finds it gone after about 4 s, but
    /// returns only once the device has answered the revocation of the
    /// window over its buffer (until then the device could still write
    /// into the caller's memory), when the device goes on.
    Stopped,
}

/// Two ranks of one device wait on each other; the device then ends as
/// `end` says, and both waits must end with `PeerGone` naming why.
fn waits_end_when_the_device(end: DeviceEnd) {
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};
    let mut device =
        pindown_emu_device::testing::DeviceProcess::start(&common::msg_check(), 2, &[]).unwrap();
    let kv = tempfile::tempdir().unwrap();
    let ranks: Vec<_> = (0..2)
        .map(|r| {
            Command::new(common::msg_check())
                .args(["rank", "device-death"])
                .env("PINDOWN_RANK", r.to_string())
                .env("PINDOWN_SIZE", "2")
                .env("PINDOWN_LOCAL_RANK", r.to_string())
                .env("PINDOWN_KV_DIR", kv.path())
                .env("PINDOWN_DEVICE_DIR", device.dir())
                .stdout(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    // Each rank leaves a signal once set up, right before its wait; the
    // device goes 100 ms after both have (a fixed sleep from the spawn
    // lost ranks still setting up on a loaded machine).
    let ready = |r: u32| kv.path().join(format!("signal.device-death-ready-{r}"));
    let deadline = Instant::now() + Duration::from_secs(120);
    while !(ready(0).exists() && ready(1).exists()) {
        assert!(
            Instant::now() < deadline,
            "the ranks did not set up within 120 s"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(100));
    let ended = Instant::now();
    match end {
        DeviceEnd::Terminated => assert!(device.terminate(Duration::from_secs(5))),
        DeviceEnd::Stopped => {
            assert!(device.stop(Duration::from_secs(5)));
            std::thread::sleep(Duration::from_secs(10));
            device.resume();
        }
    }
    let why = match end {
        // Found at the next check (every 200 ms): the connection closed.
        DeviceEnd::Terminated => "closed its connection",
        // Checks unanswered for 10 intervals, then the no-op asking the
        // device for 10 more.
        DeviceEnd::Stopped => "answered neither a check of it nor a no-op",
    };
    for rank in ranks {
        let output = rank.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&output.stdout);
        let line: serde_json::Value = serde_json::from_str(text.trim()).expect(&text);
        assert_eq!(line["ok"], true, "{line}");
        let noted = line["notes"].to_string();
        assert!(noted.contains(why), "{end:?}: {line}");
        eprintln!("{line}");
    }
    // A bound against a hang, far above either path.
    assert!(ended.elapsed() < Duration::from_secs(30));
}

#[test]
fn waits_end_with_peer_gone_when_the_device_goes_away() {
    waits_end_when_the_device(DeviceEnd::Terminated);
}

#[test]
fn waits_end_with_peer_gone_when_the_device_stops_answering() {
    waits_end_when_the_device(DeviceEnd::Stopped);
}

#[test]
fn a_forged_any_index_completion_is_refused_and_the_pair_still_talks() {
    let lines = passes(2, "forged-index", &[]);
    // Rank 1: the refusal naming rank 0 and the index, its buffer
    // unchanged; rank 0: the message rank 1 sent afterwards, byte-exact.
    assert_eq!(checked(&lines[1]), 2, "{}", lines[1]);
    assert_eq!(checked(&lines[0]), 1, "{}", lines[0]);
}

#[test]
fn forged_collective_epochs_fail_the_collectives_instead_of_passing_them() {
    let lines = passes(2, "forged-epoch", &[]);
    // A barrier refused naming rank 1, and a small allreduce refused
    // for that reason (the refusal stopped the world's collectives).
    assert_eq!(checked(&lines[0]), 2, "{}", lines[0]);
}

#[test]
fn a_rank_outside_a_communicator_cannot_touch_its_collectives() {
    let lines = passes(3, "outsider-collective", &[]);
    // Rank 2: its own sections forged at both victims, and rank 1's
    // section at rank 0 out of its reach.
    assert_eq!(checked(&lines[2]), 2, "{}", lines[2]);
    // Ranks 0 and 1: 20 rounds of both barriers and an allreduce, exact.
    for line in &lines[..2] {
        assert_eq!(checked(line), 20, "{line}");
    }
}

#[test]
fn a_leaked_key_lets_no_third_rank_write_another_peers_words() {
    let lines = passes(3, "leaked-key", &[]);
    // Rank 2's writes through the keys rank 0 bound for rank 1 (its
    // block, a receive buffer) refused; rank 0's receives from rank 1
    // then got rank 1's bytes, whole.
    assert_eq!(checked(&lines[2]), 2, "{}", lines[2]);
    assert_eq!(checked(&lines[0]), 2, "{}", lines[0]);
}

#[test]
fn with_no_window_cache_a_sender_cannot_write_after_the_receive_returned() {
    // No window cache (the default): rank 0's buffers, read again after
    // rank 1's late writes (refused by the 1 KiB receive's window; into
    // the 64-byte receive's landing buffer, never the buffer itself).
    let lines = passes(2, "late-write", &[]);
    assert_eq!(checked(&lines[0]), 2, "{}", lines[0]);
    // With windows cached (for trusted peers), the write into the 1 KiB
    // receive's buffer lands: the limit the README states.
    let cached = passes(2, "late-write", &["--window-cache", "128"]);
    assert_eq!(checked(&cached[0]), 1, "{}", cached[0]);
}

#[test]
fn a_forged_table_from_the_rank_that_gathers_fails_split_naming_it() {
    for scenario in ["forged-split", "forged-context"] {
        let lines = passes(2, scenario, &[]);
        // Rank 1's split refused naming rank 0 (no panic, no communicator
        // on the world's context), and a world message after arrived.
        assert_eq!(checked(&lines[1]), 2, "{scenario}: {}", lines[1]);
    }
}

#[test]
fn forged_any_source_credits_and_entries_are_refused_naming_the_peer() {
    // A credit word claiming entries never written: send_any refused.
    let lines = passes(2, "forged-credit", &[]);
    assert_eq!(checked(&lines[0]), 1, "{}", lines[0]);
    // A rendezvous entry naming a window the sender does not have:
    // refused naming it, the buffer unchanged; an eager length past the
    // entry: truncated to what the entry holds.
    let lines = passes(2, "forged-entry", &[]);
    assert_eq!(checked(&lines[0]), 2, "{}", lines[0]);
}

#[test]
fn a_failed_blocking_receive_gives_its_buffer_back_out_of_the_senders_reach() {
    let lines = passes(2, "withdrawn-receive", &[]);
    assert_eq!(checked(&lines[1]), 4096, "{}", lines[1]);
}

#[test]
fn configurations_out_of_range_or_differing_between_ranks_are_refused() {
    let lines = passes(2, "config-checks", &[]);
    // Three out of range, one differing, the finalize without deadline,
    // no call after it; rank 1 also received the send without deadline.
    assert_eq!(checked(&lines[0]), 6, "{}", lines[0]);
    assert_eq!(checked(&lines[1]), 7, "{}", lines[1]);
}
