//! The committed report in `benches/results/` is what `pindown-report` produces: its
//! sections are what the current section code builds from the committed
//! program documents (`benches/results/raw/`), and its Markdown and plots are what
//! rendering `benches/results/report.json` gives, byte for byte.

use std::path::{Path, PathBuf};

use pindown_benches::report::{run, sections, Report, PLOTS, RAW, REPORT_MD};

fn results() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("results")
}

#[test]
fn the_committed_sections_are_what_the_section_code_builds_from_the_committed_documents() {
    let committed = Report::read(&results()).expect("benches/results/report.json");
    assert!(!committed.quick, "benches/results/ holds a full run");
    assert!(committed.all_verified(), "{:?}", committed.jobs);
    let rebuilt =
        run::rebuild(&sections::jobs(), &results()).expect("rebuild from benches/results/raw");
    // The same programs, with the same arguments, every one verified.
    let commands = |r: &Report| r.jobs.iter().map(|j| j.command.clone()).collect::<Vec<_>>();
    let wanted: Vec<String> = sections::jobs().iter().map(|j| j.command(false)).collect();
    assert_eq!(
        commands(&committed),
        wanted,
        "benches/results/ ran other programs"
    );
    assert_eq!(commands(&rebuilt), wanted);
    assert!(rebuilt.all_verified(), "{:?}", rebuilt.jobs);
    let mut raw: Vec<String> = std::fs::read_dir(results().join(RAW))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    raw.sort();
    let mut raw_wanted: Vec<String> = sections::jobs()
        .iter()
        .map(|j| format!("{}.json", j.program))
        .collect();
    raw_wanted.sort();
    assert_eq!(
        raw, raw_wanted,
        "benches/results/raw holds exactly the programs' documents"
    );
    let as_json = |r: &Report| serde_json::to_value(&r.sections).unwrap();
    assert_eq!(
        as_json(&rebuilt),
        as_json(&committed),
        "benches/results/report.json is stale: run pindown-report --rebuild benches/results"
    );
    let ids = committed.figure_ids();
    let mut unique = ids.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique.len(), ids.len(), "figure ids repeat: {ids:?}");
    assert!(!ids.is_empty());
}

#[test]
fn the_committed_markdown_and_plots_are_what_rendering_the_committed_report_gives() {
    let committed = Report::read(&results()).expect("benches/results/report.json");
    let fresh = tempfile::tempdir().unwrap();
    committed.write(fresh.path(), false).unwrap();
    let read = |dir: &Path, name: &str| {
        std::fs::read(dir.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
    };
    assert!(
        read(fresh.path(), REPORT_MD) == read(&results(), REPORT_MD),
        "benches/results/report.md differs from its rendering: run pindown-report --render benches/results"
    );
    let mut plots: Vec<String> = std::fs::read_dir(results().join(PLOTS))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    plots.sort();
    let mut wanted: Vec<String> = committed
        .figure_ids()
        .iter()
        .flat_map(|id| [format!("{id}.png"), format!("{id}.svg")])
        .collect();
    wanted.sort();
    assert_eq!(
        plots, wanted,
        "benches/results/plots holds exactly the report's figures"
    );
    for plot in &plots {
        let name = format!("{PLOTS}/{plot}");
        assert!(
            read(fresh.path(), &name) == read(&results(), &name),
            "benches/results/{name} differs from its rendering: run pindown-report --render benches/results"
        );
    }
}
