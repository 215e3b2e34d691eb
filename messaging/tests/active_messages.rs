//! GASNet-style active messages and one-sided transfers between real rank
//! processes over the emulated NIC (`examples/am_check`): every handler
//! run counted and checked, every byte that lands compared with what its
//! sender generated, and the bytes around it with what was there.

mod common;

use common::{launch_example, passes_example};
use serde_json::Value;

fn passes(n: u32, scenario: &str, args: &[&str]) -> Vec<Value> {
    passes_example("am_check", n, scenario, args)
}

fn counter(line: &Value, name: &str) -> u64 {
    line["counters"][name]
        .as_u64()
        .unwrap_or_else(|| panic!("counter {name} in {line}"))
}

fn checked(line: &Value) -> u64 {
    line["checked"].as_u64().expect("a checked count")
}

/// Messages of each kind every rank sends every rank in `handlers`.
const MESSAGES: u64 = 120;

#[test]
fn handlers_run_exactly_once_with_their_arguments_data_and_replies() {
    for n in [2u32, 4] {
        let lines = passes(n, "handlers", &[]);
        let n = u64::from(n);
        for line in &lines {
            // Each (source, kind, sequence) handled once, each reply once.
            assert_eq!(checked(line), 2 * 3 * MESSAGES * n, "{line}");
            assert_eq!(counter(line, "requests"), 3 * MESSAGES * n, "{line}");
            assert_eq!(counter(line, "replies"), 3 * MESSAGES * n, "{line}");
            assert_eq!(
                counter(line, "handlers_run"),
                2 * 3 * MESSAGES * n,
                "{line}"
            );
            // Every second reply and every reply from a reply handler refused.
            assert_eq!(line["refused"], line["expected_refused"], "{line}");
            assert_eq!(
                line["refused"].as_u64(),
                Some(2 * 3 * MESSAGES * n),
                "{line}"
            );
            assert_eq!(counter(line, "bad_packets"), 0, "{line}");
        }
    }
}

#[test]
fn credits_run_out_and_come_back_under_many_senders() {
    let messages = 3000u64;
    let lines = passes(4, "flood", &["--messages", "3000"]);
    assert_eq!(checked(&lines[0]), 3 * messages, "{}", lines[0]);
    assert!(
        counter(&lines[0], "credits_returned") >= 3 * messages,
        "{}",
        lines[0]
    );
    for line in &lines[1..] {
        assert_eq!(line["sent"].as_u64(), Some(messages), "{line}");
        assert!(
            counter(line, "stalls") > 0,
            "a 2-slot ring never stalled: {line}"
        );
    }
}

#[test]
fn ranks_flooding_each_other_do_not_deadlock() {
    let messages = 2000u64;
    for n in [2u32, 4] {
        let lines = passes(n, "flood", &["--all", "--messages", "2000"]);
        for line in &lines {
            assert_eq!(checked(line), u64::from(n - 1) * messages, "{line}");
            assert!(counter(line, "stalls") > 0, "{line}");
        }
    }
}

/// The lengths `misalign` tries: every one up to `every`, then every 37th
/// up to `sparse` (as the example's `lengths`).
fn lengths(every: u64, sparse: u64) -> Vec<u64> {
    (0..=every)
        .chain((every + 1..=sparse).step_by(37))
        .collect()
}

fn misaligned(n: u32, every: u64, sparse: u64, extra: &[&str]) -> Vec<Value> {
    let (e, s) = (every.to_string(), sparse.to_string());
    let mut args = vec!["--every", &e, "--sparse", &s];
    args.extend_from_slice(extra);
    let lines = passes(n, "misalign", &args);
    let lengths = lengths(every, sparse);
    // 8 x 8 misalignments of puts and of gets, every byte checked.
    // Gets read from a 16 KiB area at offsets up to 7.
    let gets: u64 = lengths.iter().filter(|&&l| l + 8 <= 16 << 10).sum();
    let expected = 64 * lengths.iter().sum::<u64>() + 64 * gets;
    for line in &lines {
        assert_eq!(checked(line), expected, "{line}");
        assert!(counter(line, "fixup_bytes") > 0, "{line}");
        assert!(counter(line, "bounced") > 0, "{line}");
        assert!(counter(line, "pio_writes") > 0, "{line}");
        assert!(counter(line, "dma_writes") > 0, "{line}");
    }
    lines
}

#[test]
fn every_misalignment_and_length_lands_exactly_with_native_gets() {
    let lines = misaligned(2, 4096, 4096, &[]);
    for line in &lines {
        assert!(counter(line, "gets_native") > 0, "{line}");
        assert_eq!(counter(line, "gets_by_message"), 0, "{line}");
    }
    misaligned(4, 100, 2100, &[]);
}

#[test]
fn a_reply_reaches_its_requester_while_the_target_only_waits_for_gets() {
    // Rank 1 runs rank 0's handler inside its gets' waits for 8 s; the
    // reply must go out then, not once rank 1 polls (rank 0 gives up
    // after 5 s, and its window going made rank 1's next get fail).
    let lines = passes(2, "stuck-reply", &[]);
    assert_eq!(checked(&lines[0]), 1, "{}", lines[0]);
    assert_eq!(counter(&lines[1], "replies"), 1, "{}", lines[1]);
}

#[test]
fn gets_by_message_over_a_write_only_path_return_the_same_bytes() {
    for n in [2u32, 4] {
        let lines = misaligned(n, 200, 20_000, &["--get", "message"]);
        for line in &lines {
            assert_eq!(counter(line, "gets_native"), 0, "{line}");
            assert!(counter(line, "gets_by_message") > 0, "{line}");
        }
    }
}

#[test]
fn strided_vector_and_indexed_transfers_match_the_reference() {
    for n in [2u32, 4] {
        let lines = passes(n, "strided", &[]);
        for line in &lines {
            // 8 strided cases put and got, blocking and not, then vector
            // and indexed.
            assert_eq!(counter(line, "vector_transfers"), 8 * 4 + 4, "{line}");
            assert!(checked(line) > 0, "{line}");
        }
    }
}

#[test]
fn a_message_behind_an_unwaited_strided_put_finds_its_bytes_in_place() {
    for n in [2u32, 3] {
        let lines = passes(n, "notified-put", &[]);
        for line in &lines {
            assert!(checked(line) > 0, "{line}");
            assert_eq!(counter(line, "vector_transfers"), 60, "{line}");
            assert_eq!(counter(line, "requests"), 60, "{line}");
        }
        // Every rank checked the same rounds of its neighbour's shapes.
        assert!(lines.iter().all(|l| checked(l) == checked(&lines[0])));
    }
}

#[test]
fn no_rank_leaves_a_barrier_before_every_rank_entered_it() {
    for n in [1u32, 2, 3, 5] {
        let lines = passes(n, "barriers", &[]);
        for line in &lines {
            assert_eq!(checked(line), 200 * u64::from(n), "{line}");
        }
    }
}

#[test]
fn malformed_packets_are_reported_and_never_run() {
    let lines = passes(2, "bad-packet", &[]);
    // Nine malformed headers, and a packet in each wrong ring.
    let bad = 11;
    assert_eq!(counter(&lines[0], "bad_packets"), bad, "{}", lines[0]);
    // The good message after each bad one ran; nothing else did.
    assert_eq!(checked(&lines[0]), bad, "{}", lines[0]);
    assert_eq!(counter(&lines[0], "handlers_run"), bad, "{}", lines[0]);
    let notes = lines[0]["notes"].as_array().expect("notes");
    assert_eq!(notes.len() as u64, bad, "{}", lines[0]);
    for note in notes {
        let note = note.as_str().unwrap_or_default();
        assert!(note.contains("from rank 1"), "{note}");
    }
}

#[test]
fn an_unknown_scenario_fails_every_rank() {
    let launch = launch_example("am_check", 2, "no-such-scenario", &[]);
    assert!(!launch.success, "{}", launch.text);
    assert!(launch.text.contains("unknown scenario"), "{}", launch.text);
}

#[test]
fn a_departed_rank_fails_the_waits_on_it() {
    // The wait and a send both failed.
    survivors_learn_the_last_rank_left("peer-death", 2, "gone");
}

#[test]
fn a_rank_that_finalized_is_gone_for_the_others_though_its_port_stays() {
    survivors_learn_the_last_rank_left("peer-finalized", 1, "liveness check");
}

#[test]
fn a_rank_that_finalizes_while_owed_credits_leaves_the_barrier_clean() {
    let lines = passes(2, "leave-while-owed", &[]);
    // The handler ran once, the barrier passed though the credit return
    // after it was refused, the refusal named rank 1 gone, and a request
    // to it then failed at once.
    assert_eq!(checked(&lines[0]), 3, "{}", lines[0]);
    let note = lines[0]["notes"][0].as_str().unwrap_or_default();
    assert!(note.contains("rank 1 gone"), "{}", lines[0]);
    assert!(counter(&lines[0], "credit_returns") >= 2, "{}", lines[0]);
}

/// Runs `scenario` on 2 and 3 ranks: every rank but the last checked
/// `checks` things and its first note says the last rank is gone, with
/// `how` in it.
fn survivors_learn_the_last_rank_left(scenario: &str, checks: u64, how: &str) {
    for n in [2u32, 3] {
        let lines = passes(n, scenario, &[]);
        for line in &lines[..n as usize - 1] {
            assert_eq!(checked(line), checks, "{line}");
            let note = line["notes"][0].as_str().unwrap_or_default();
            assert!(note.contains(&format!("rank {} gone", n - 1)), "{line}");
            assert!(note.contains(how), "{line}");
        }
    }
}

#[test]
fn the_descriptor_cache_keeps_hot_puts_and_every_put_lands() {
    // Every put (hot ones repeated with new bytes, one cold one a round, a
    // hot source freed and allocated again midway) is read back and
    // compared by the scenario, which also checks hits + misses ==
    // lookups == DMA puts.
    let extra = |line: &Value, name: &str| {
        line[name]
            .as_u64()
            .unwrap_or_else(|| panic!("{name} in {line}"))
    };
    for line in passes(
        2,
        "descriptors",
        &["--policy", "lru", "--capacity", "8", "--promote", "3"],
    ) {
        assert!(extra(&line, "promoted_hits") > 0, "{line}");
        assert!(extra(&line, "prebuilt_writes") > 0, "{line}");
        assert!(extra(&line, "evictions") > 0, "cold puts push out: {line}");
    }
    for line in passes(
        2,
        "descriptors",
        &["--policy", "lfu", "--capacity", "5", "--promote", "2"],
    ) {
        assert!(extra(&line, "promoted_hits") > 0, "{line}");
        assert!(extra(&line, "prebuilt_writes") > 0, "{line}");
    }
    for line in passes(
        2,
        "descriptors",
        &["--policy", "first", "--capacity", "3", "--promote", "off"],
    ) {
        assert!(extra(&line, "hits") > 0, "{line}");
        assert_eq!(extra(&line, "evictions"), 0, "first come keeps: {line}");
        assert!(extra(&line, "bypasses") > 0, "{line}");
        assert_eq!(extra(&line, "promoted_hits"), 0, "promotion off: {line}");
        assert_eq!(extra(&line, "prebuilt_writes"), 0, "promotion off: {line}");
    }
    // Five transfers in turn through four LRU entries: each finds its
    // entry just evicted.
    for line in passes(
        2,
        "descriptors",
        &["--policy", "lru", "--capacity", "4", "--promote", "3"],
    ) {
        assert_eq!(extra(&line, "hits"), 0, "{line}");
    }
}

#[test]
fn hostile_peers_and_abandoned_operations_change_nothing_they_should_not() {
    // A blocking get that gives up writes nothing into the caller's
    // memory afterwards; a put source unmapped and mapped again at the
    // same address is read anew (cache on); a barrier notice from a rank
    // that is not the round's sender does not let anyone out; a late reply
    // to a get given up neither fails the next get nor lands in it; a rank
    // cannot forge another pair's credits (its write is refused, no ring
    // overruns).
    for (ranks, scenario, args) in [
        (2, "stale-get", &[][..]),
        (2, "remap-put", &["--way", "munmap"][..]),
        (2, "remap-put", &["--way", "dontneed"][..]),
        (3, "forged-barrier", &[][..]),
        (2, "late-get-reply", &["--get", "message"][..]),
        (3, "forged-credit", &[][..]),
    ] {
        passes(ranks, scenario, args);
    }
}

#[test]
fn a_rank_that_consumes_nothing_holds_a_ring_of_replies_and_delays_no_one_else() {
    let lines = passes(3, "hostile-no-consume", &[]);
    // Rank 0 failed unless it ran exactly two rings of the requests of
    // the rank that consumes nothing, queued exactly one ring of replies
    // to it and held the rest; rank 1 failed unless its echo came back.
    assert!(counter(&lines[0], "requests_held") >= 1, "{}", lines[0]);
    assert_eq!(checked(&lines[1]), 1, "{}", lines[1]);
}

#[test]
fn a_third_rank_cannot_write_what_a_get_by_message_returns() {
    let lines = passes(3, "hostile-bounce", &[]);
    // Rank 0 failed unless every get returned rank 1's bytes; rank 2
    // unless every write into rank 0's bounce area was refused.
    assert!(checked(&lines[0]) > 0, "{}", lines[0]);
    assert!(checked(&lines[2]) > 0, "{}", lines[2]);
}

#[test]
fn a_get_given_up_holds_up_no_later_get_and_its_late_answer_fails_nothing() {
    let lines = passes(3, "hostile-abandoned-get", &[]);
    // Four gets from rank 1 right after the one given up, each at once;
    // the late answer refused at rank 2 (no failure there) and taken as
    // expected at rank 0 (no bad packet).
    assert_eq!(checked(&lines[0]), 4, "{}", lines[0]);
    assert_eq!(counter(&lines[0], "bad_packets"), 0, "{}", lines[0]);
    assert_eq!(counter(&lines[2], "get_data_refused"), 1, "{}", lines[2]);
}

#[test]
fn a_rank_publishing_another_ranks_windows_as_its_own_is_refused_by_name() {
    let lines = passes(3, "hostile-spoofed-pairs", &[]);
    for rank in [0, 1] {
        assert_eq!(checked(&lines[rank]), 1, "{}", lines[rank]);
    }
}

#[test]
fn configurations_out_of_range_or_differing_between_ranks_are_refused() {
    // A zero liveness interval, differing rings, differing segments; then
    // the same configuration everywhere works, and a handle of an
    // endpoint made again is refused by the new one.
    for line in passes(2, "config-checks", &[]) {
        assert_eq!(checked(&line), 5, "{line}");
    }
}
