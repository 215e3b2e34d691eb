//! The any-source domain end to end: `msg_check launch N any-source`
//! (every rank but 0 sends mixed sizes and tags to rank 0, which checks
//! every byte, the per-(source, tag) order, filters, probing and
//! truncation) on 2, 4 and 8 ranks, and `any-source-death` (a sender dies
//! in the middle of a rendezvous send; rank 0's receives from it, and
//! rank 1's sends to it, fail with `PeerGone` instead of hanging).

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod common;

use common::msg_check;

/// Runs `msg_check launch ranks scenario`, killed if it takes longer than
/// `limit` (a hang is a failure); returns its exit success and each
/// rank's JSON line.
fn launch(ranks: u32, scenario: &str, limit: Duration) -> (bool, Vec<serde_json::Value>) {
    let mut child = Command::new(msg_check())
        .args(["launch", &ranks.to_string()])
        .args(scenario.split_whitespace())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start msg_check");
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for msg_check") {
            break status;
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("msg_check launch {ranks} {scenario} still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut stdout = String::new();
    use std::io::Read;
    child
        .stdout
        .take()
        .expect("piped stdout")
        .read_to_string(&mut stdout)
        .expect("read msg_check's output");
    let lines = stdout
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}")))
        .collect();
    (status.success(), lines)
}

/// The line of rank `rank`, asserted to say ok with a nonzero count.
fn passed(lines: &[serde_json::Value], rank: u64) -> &serde_json::Value {
    let line = lines
        .iter()
        .find(|l| l["rank"].as_u64() == Some(rank))
        .unwrap_or_else(|| panic!("no line from rank {rank}: {lines:?}"));
    assert_eq!(line["ok"], serde_json::Value::Bool(true), "{line}");
    assert!(line["checked"].as_u64().is_some_and(|c| c > 0), "{line}");
    line
}

fn any_source_on(ranks: u32) {
    let (success, lines) = launch(ranks, "any-source", Duration::from_secs(180));
    assert!(success, "{lines:?}");
    assert_eq!(lines.len(), ranks as usize, "{lines:?}");
    for rank in 0..u64::from(ranks) {
        passed(&lines, rank);
    }
}

#[test]
fn any_source_on_two_ranks() {
    any_source_on(2);
}

#[test]
fn any_source_on_four_ranks() {
    any_source_on(4);
}

#[test]
fn any_source_under_contention_from_seven_senders() {
    any_source_on(8);
}

#[test]
fn a_sender_dying_mid_message_fails_the_receives_from_it() {
    for ranks in [2, 3] {
        let (success, lines) = launch(ranks, "any-source-death", Duration::from_secs(60));
        assert!(success, "{lines:?}");
        let line = passed(&lines, 0);
        // The scenario fails unless the message sent before death arrived
        // intact and every receive from the dead rank said PeerGone.
        let notes = line["notes"].to_string();
        assert!(notes.contains("death noticed after"), "{line}");
        if ranks > 2 {
            // Rank 1 sent to the dying rank until a send failed with
            // PeerGone.
            passed(&lines, 1);
        }
        assert!(
            lines
                .iter()
                .all(|l| l["rank"].as_u64() != Some(u64::from(ranks) - 1)),
            "the dying rank printed a line: {lines:?}"
        );
    }
}

#[test]
fn a_sender_flooding_unmatched_messages_is_held_back_and_loses_nothing() {
    let (success, lines) = launch(3, "any-flood --unexpected 8", Duration::from_secs(120));
    assert!(success, "{lines:?}");
    // Rank 0 failed unless each sender had at most 8 messages queued
    // while only a receive of another tag was posted, both were held
    // back, and every message then arrived byte-exact and in order.
    let line = passed(&lines, 0);
    assert!(line["notes"].to_string().contains("held back"), "{line}");
    passed(&lines, 1);
    passed(&lines, 2);
}
