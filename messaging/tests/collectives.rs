//! The collectives on every rank count from 1 to 8: `msg_check launch N
//! collectives` (a device with N ports and N rank processes, oversubscribed
//! on small machines), every rank checking every result against the
//! reference it computes from every rank's seeded contribution.

use std::path::PathBuf;
use std::process::Command;

mod common;

use common::{checked, msg_check, passes};

/// Runs the scenario on `ranks` ranks and checks that every rank reports
/// success with something checked.
fn run_collectives(exe: &PathBuf, ranks: u32, seed: u64, cases: u32) {
    let out = Command::new(exe)
        .args(["launch", &ranks.to_string(), "collectives"])
        .args(["--seed", &seed.to_string(), "--cases", &cases.to_string()])
        .output()
        .expect("run msg_check");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<serde_json::Value> = stdout
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert_eq!(
        lines.len(),
        ranks as usize,
        "{ranks} ranks, one line each expected\n{stdout}\n{stderr}"
    );
    let mut seen: Vec<u64> = Vec::new();
    for line in &lines {
        // Every rank's line and the launcher's errors: the first rank to
        // fail is often not the one that reports it.
        assert_eq!(
            line["ok"], true,
            "{ranks} ranks (seed {seed}): {line}\nall ranks:\n{stdout}\n{stderr}"
        );
        assert_eq!(line["size"], ranks, "{line}");
        let checked = line["checked"].as_u64().expect("a checked count");
        assert!(checked > 0, "{ranks} ranks: nothing checked: {line}");
        seen.push(line["rank"].as_u64().expect("a rank"));
    }
    seen.sort_unstable();
    assert_eq!(seen, (0..u64::from(ranks)).collect::<Vec<_>>());
    assert!(out.status.success(), "{}\n{stdout}\n{stderr}", out.status);
}

#[test]
fn collectives_on_one_to_eight_ranks_match_the_reference() {
    let exe = msg_check();
    // A different seed each run (printed on failure), so that runs
    // together cover more roots and sizes; PINDOWN_COLLECTIVES_SEED
    // repeats one.
    let seed = std::env::var("PINDOWN_COLLECTIVES_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(1)
        });
    eprintln!("collectives seed {seed}");
    for ranks in 1..=8 {
        // Fewer cases as the ranks crowd the cores.
        let cases = if ranks <= 4 { 80 } else { 50 };
        run_collectives(&exe, ranks, seed, cases);
    }
}

#[test]
fn mismatched_collective_calls_fail_on_every_rank_instead_of_waiting() {
    // Six disagreements (lengths across the flag-word limit, roots,
    // kinds, algorithms: flag words against the tree, and reduce-scatter
    // against recursive doubling on one length, whose messages differ in
    // length; a dup against a barrier), each on its own dup: per case the
    // call and the dup's next barrier fail (or the call passes and the
    // barrier fails) on every rank, at least one rank names both calls;
    // then a new dup computes an exact sum.
    for ranks in [2, 3, 4, 8] {
        for line in passes(ranks, "collective-mismatch", &[]) {
            assert_eq!(checked(&line), 13, "{ranks} ranks: {line}");
        }
    }
}

#[test]
fn members_that_give_a_call_up_release_the_others_and_leave_no_late_write() {
    // On 4 ranks: a failed broadcast's buffer stays as it was after its
    // parent forwards late (rank 3); a rank whose peer gave the previous
    // call up fails its next one instead of waiting (rank 0); a refusal
    // on one rank releases the other (rank 1); a send left over from a
    // mismatched call is not taken by the next call (ranks 0-2); a rank
    // that gave a call up and made two more calls since still releases
    // its child waiting in it (rank 3; the others check their part), and
    // so does one that refused a call three times in a row (rank 1); a
    // rank whose call after a refused one would meet the words or sends
    // of a member still in the refused call waits for it and fails
    // (rank 0, twice), a member in any call of a run of refusals learns
    // it (rank 1), and so does one that comes late to a call the others
    // already failed over a refusal (rank 2); communicators whose last
    // call every member refused give their contexts back (every rank).
    let lines = passes(4, "collective-give-up", &[]);
    let counts: Vec<u64> = lines.iter().map(checked).collect();
    assert_eq!(counts, [8, 8, 4, 3], "{lines:?}");
}

#[test]
fn a_member_that_gave_up_the_dup_making_a_communicator_fails_the_others_first_call() {
    // Rank 3 gives up a dup after its contribution reached rank 0; ranks
    // 1 and 2 get the new communicator, whose first barrier fails naming
    // rank 0 or 3 (both gave the dup up) and whose second fails at once;
    // rank 0's dup fails naming rank 3, whose receive of the table it
    // found withdrawn.
    let lines = passes(4, "collective-lost-member", &[]);
    let counts: Vec<u64> = lines.iter().map(checked).collect();
    assert_eq!(counts, [1, 2, 2, 1], "{lines:?}");
}

#[test]
fn verified_collectives_fail_calls_that_disagree_but_complete() {
    // Without Config::verify_collectives, an allreduce by sum against one
    // by max and a reduce against a broadcast both return; with it, they
    // fail on both ranks and one names both calls.
    for verify in [&[][..], &["--verify"][..]] {
        let lines = passes(2, "collective-verify", verify);
        let counts: Vec<u64> = lines.iter().map(checked).collect();
        assert_eq!(counts, [2, 2], "{verify:?}: {lines:?}");
    }
    // Correct programs pass verified: every collective, sizes and roots
    // at random, on 3 ranks.
    let lines = passes(3, "collectives", &["--verify", "--cases", "20"]);
    assert!(lines.iter().all(|l| checked(l) > 0), "{lines:?}");
}
