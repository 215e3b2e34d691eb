//! The Markdown report: the run, the machine and the peers, then each
//! section's plots and its side-by-side table.

use std::fmt::Write;

use super::figure::{Named, Row, Section};
use super::{Outcome, Report};

/// `value` with three significant digits (more when it is large), or
/// "missing".
pub fn number(value: Option<f64>) -> String {
    match value {
        None => "missing".to_string(),
        Some(v) if !v.is_finite() => "not a number".to_string(),
        Some(v) if v != 0.0 && v.abs() < 1e-6 => format!("{v:.2e}"),
        Some(0.0) => "0".to_string(),
        Some(v) if v.abs() >= 100.0 => format!("{v:.0}"),
        Some(v) if v.abs() >= 10.0 => format!("{v:.1}"),
        Some(v) if v.abs() >= 1.0 => format!("{v:.2}"),
        Some(v) => {
            let digits = (2 - v.abs().log10().floor() as i32).clamp(2, 9) as usize;
            format!("{v:.digits$}")
        }
    }
}

/// Whether a smaller number is the better one in `unit`: times, sizes
/// and counts are; rates (`.../s`), shares (`%`) and speed-ups (`x`) are
/// not.
fn lower_is_better(unit: &str) -> bool {
    let unit = unit.trim();
    !(unit.ends_with("/s") || unit.contains('%') || unit == "x" || unit.starts_with("hit"))
}

/// `ours / other`, as "0.420x, better" (better or worse by the unit's
/// direction), or "" if either is missing or zero.
fn ratio(ours: Option<f64>, other: Option<f64>, unit: &str) -> String {
    match (ours, other) {
        (Some(a), Some(b)) if b != 0.0 && a.is_finite() && b.is_finite() => {
            let r = a / b;
            let verdict = if (r - 1.0).abs() < 0.005 {
                "even"
            } else if (r < 1.0) == lower_is_better(unit) {
                "better"
            } else {
                "worse"
            };
            format!("{}x, {verdict}", number(Some(r)))
        }
        _ => String::new(),
    }
}

/// Escapes the characters that would break a table cell.
fn cell(text: &str) -> String {
    text.replace('|', "\\|").replace('\n', " ")
}

fn named(n: &Named, ours: Option<f64>, unit: &str) -> String {
    let r = ratio(ours, n.value, unit);
    if r.is_empty() {
        format!("{}: {}", cell(&n.name), number(n.value))
    } else {
        format!("{}: {} (pindown {r})", cell(&n.name), number(n.value))
    }
}

fn table(out: &mut String, rows: &[Row]) {
    if rows.is_empty() {
        return;
    }
    out.push_str("| figure | unit | pindown | limit in this run | peers in this run | paper |\n");
    out.push_str("|---|---|---|---|---|---|\n");
    for row in rows {
        let limit = row
            .limit
            .as_ref()
            .map_or_else(String::new, |l| named(l, row.ours, &row.unit));
        let peers = row
            .peers
            .iter()
            .map(|p| named(p, row.ours, &row.unit))
            .collect::<Vec<_>>()
            .join("; ");
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} |",
            cell(&row.what),
            cell(&row.unit),
            number(row.ours),
            limit,
            peers,
            cell(row.paper.as_deref().unwrap_or("")),
        );
    }
    out.push('\n');
}

fn section(out: &mut String, section: &Section, plots: &str) {
    let _ = writeln!(out, "## {}\n", section.title);
    let _ = writeln!(out, "From `{}`.\n", section.program);
    for note in &section.notes {
        let _ = writeln!(out, "{note}\n");
    }
    table(out, &section.rows);
    for figure in &section.figures {
        let _ = writeln!(
            out,
            "![{title}]({plots}/{id}.svg)\n\n*{title}* (reproduces {rep}; [PNG]({plots}/{id}.png))\n",
            title = cell(&figure.title),
            rep = figure.reproduces,
            id = figure.id,
        );
    }
    if !section.missing.is_empty() {
        out.push_str("Not measured in this run:\n\n");
        for m in &section.missing {
            let _ = writeln!(out, "- {m}");
        }
        out.push('\n');
    }
}

/// The whole report; plots are referred to under `plots` (relative to the
/// report file).
pub fn render(report: &Report, plots: &str) -> String {
    let mut out = String::new();
    let kind = if report.quick { "quick" } else { "full" };
    let _ = writeln!(out, "# pindown report\n");
    let _ = writeln!(
        out,
        "A {kind} run of every benchmark program, started {} and lasting {:.0} s \
         (`{}`). Every number beside pindown's was measured in the same run on \
         the same machine, except the paper columns, which the papers print. \
         A ratio is pindown's number over the other's, better or worse by \
         the unit (lower times, higher rates).\n",
        report.started, report.seconds, report.command
    );
    out.push_str("## Machine\n\n");
    let m = &report.machine;
    let _ = writeln!(out, "- CPU: {} ({} CPUs usable)", m.cpu_model, m.cpus);
    let _ = writeln!(out, "- memory: {:.1} GiB", m.memory_gib);
    let _ = writeln!(out, "- system: {}, kernel {}", m.os, m.kernel);
    let _ = writeln!(out, "- compiler: {}\n", m.rustc);
    out.push_str("## Peers\n\n");
    for peer in &report.peers {
        match (&peer.version, &peer.missing) {
            (_, Some(why)) => {
                let _ = writeln!(out, "- {}: **missing** ({why})", peer.name);
            }
            (Some(v), None) => {
                let _ = writeln!(out, "- {}: {v}", peer.name);
            }
            (None, None) => {
                let _ = writeln!(out, "- {}: present", peer.name);
            }
        }
    }
    out.push_str("\n## Programs\n\n| program | seconds | outcome |\n|---|---|---|\n");
    for job in &report.jobs {
        let outcome = match &job.outcome {
            Outcome::Verified => "verified".to_string(),
            Outcome::Measured => "measured (no checks of its own)".to_string(),
            Outcome::Unverified(why) => format!("ran, **not verified**: {}", cell(why)),
            Outcome::Failed(why) => format!("**failed**: {}", cell(why)),
            Outcome::Unreadable(why) => format!("ran, **document unreadable**: {}", cell(why)),
        };
        let _ = writeln!(
            out,
            "| `{}` | {:.1} | {outcome} |",
            job.command, job.seconds
        );
    }
    out.push('\n');
    for s in &report.sections {
        section(&mut out, s, plots);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_keep_three_significant_digits_and_name_what_is_missing() {
        assert_eq!(number(Some(1234.5)), "1234");
        assert_eq!(number(Some(12.34)), "12.3");
        assert_eq!(number(Some(1.234)), "1.23");
        assert_eq!(number(Some(0.01234)), "0.0123");
        assert_eq!(number(None), "missing");
        assert_eq!(number(Some(f64::NAN)), "not a number");
        assert_eq!(number(Some(1e-9)), "1.00e-9");
        assert_eq!(ratio(Some(2.0), Some(4.0), "us"), "0.500x, better");
        assert_eq!(ratio(Some(2.0), Some(4.0), "GB/s"), "0.500x, worse");
        assert_eq!(ratio(Some(4.0), Some(4.0), "us"), "1.00x, even");
        assert_eq!(ratio(Some(2.0), Some(0.0), "us"), "");
        assert_eq!(cell("a|b"), "a\\|b");
    }
}
