//! The `munmap` cases of the criterion group `unmap` and of `pin-cost` run,
//! and every region a cache held is invalidated by the unmapping.

use pindown_benches::unmap::{UnmapCase, UnmapRun};

/// Generous for the one page each case pins at a time.
const MAX_PINNED_BYTES: usize = 1 << 20;

#[test]
fn every_case_times_each_unmapping_and_invalidates_what_was_cached() {
    for case in UnmapCase::ALL {
        // The monitored case needs userfaultfd, as pincache's own monitor
        // tests do: a machine without it fails here rather than skipping.
        let run = UnmapRun::new(case, MAX_PINNED_BYTES)
            .unwrap_or_else(|e| panic!("{}: {e}", case.name()));
        assert_eq!(run.case(), case);
        let name = case.name();
        let mut times = 0;
        run.time(20, |_| times += 1)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(times, 20, "{name}");
        let total = run.total(5).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(total > std::time::Duration::ZERO, "{name}");
        run.check_invalidated()
            .unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

#[test]
fn case_names_are_distinct_and_plain_munmap_is_present() {
    let mut names: Vec<_> = UnmapCase::ALL.iter().map(|c| c.name()).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), UnmapCase::ALL.len());
    assert!(UnmapCase::ALL.contains(&UnmapCase::Munmap));
}
