//! Global memory (ACP's basic layer) on real rank processes:
//! `msg_check launch N acp|acp-reinit|acp-memory` (a device with N ports,
//! N processes), every rank checking every byte and word that should
//! have arrived and every error it provoked (see
//! `examples/scenarios/global_memory.rs`).

mod common;

use common::{checked, passes};
use serde_json::Value;

#[test]
fn every_function_works_on_one_to_five_ranks() {
    // Three ranks and more make the third-party copies and atomics
    // involve three different ranks.
    for n in 1..=5 {
        let lines = passes(n, "acp", &[]);
        for line in &lines {
            assert!(checked(line) > 8 << 20, "{n} ranks: {line}");
        }
    }
}

#[test]
fn reinit_takes_the_ranks_and_starter_sizes_the_caller_chose() {
    for n in [1, 2, 4] {
        let lines = passes(n, "acp-reinit", &[]);
        for line in &lines {
            // One check per rank's starter memory, and init_as.
            assert_eq!(checked(line), u64::from(n) + 1, "{line}");
        }
    }
}

/// The figures a rank of `acp-memory` reported, by name.
fn figures(line: &Value) -> std::collections::HashMap<String, u64> {
    let note = line["notes"][0].as_str().expect("a note");
    note.split_whitespace()
        .map(|field| {
            let (name, value) = field.split_once('=').expect("name=value");
            (name.to_string(), value.parse().expect("a number"))
        })
        .collect()
}

#[test]
fn memory_per_peer_is_at_most_64_bytes_and_the_report_covers_the_heap() {
    let mut totals = Vec::new();
    for n in [1u32, 2, 4, 8] {
        let lines = passes(n, "acp-memory", &[]);
        let figures = figures(&lines[0]);
        assert!(figures["per_peer"] <= 64, "{figures:?}");
        assert_eq!(figures["peers"], u64::from(n), "{figures:?}");
        assert!(figures["heap"] <= figures["total"], "{figures:?}");
        // One window and one key per round of sync's dissemination.
        let rounds = u64::from(n.next_power_of_two().trailing_zeros());
        assert!(figures["sync"] <= 256 * rounds, "{figures:?}");
        totals.push((n, figures["total"] - figures["sync"], figures["per_peer"]));
    }
    // Beside sync's rounds, the report grows by exactly its per-peer
    // figure per rank: nothing else is kept per peer.
    let (n0, total0, _) = totals[0];
    for &(n, total, per_peer) in &totals[1..] {
        assert_eq!(total - total0, per_peer * u64::from(n - n0), "{totals:?}");
    }
}

#[test]
fn the_edges_hold() {
    // Each scenario asserts one promise where it is easiest to break:
    // entries reused (a stale address never reaches the new
    // registration), offsets that would carry into the entry field,
    // operations in flight while their registration grows, a bad rank
    // chosen at init_as (every rank fails, and init works again), the
    // memory report adding up, zero lengths, misaligned atomics and
    // arbitrary address bits, properties of a rank past the job, order
    // behind a copy whose key the owner replaced, memory unmapped and
    // mapped again at the same address, and a cache of one remote entry.
    for (scenario, ranks) in [
        ("acp-edge-reuse", 1),
        ("acp-edge-plus", 1),
        ("acp-edge-extend", 1),
        ("acp-edge-initas", 3),
        ("acp-edge-memuse", 2),
        ("acp-edge-edges", 2),
        ("acp-edge-properties", 3),
        ("acp-edge-order", 2),
        ("acp-edge-stale-pin", 1),
        ("acp-edge-evict", 2),
        ("acp-edge-hostile-sync", 3),
    ] {
        passes(ranks, scenario, &[]);
    }
}
