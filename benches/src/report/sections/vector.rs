//! Report sections of the vector programs: `vector-transfer`, DIMMnet-2's
//! submatrix transfer (figures 3-6: host pack and unpack; figures 10-13:
//! the transfer's latency and bandwidth), beside Open MPI's and MPICH's
//! derived datatypes, the host's pack + write + unpack and the one-pass
//! strided copy measured in the same run, and the paper's own numbers.

use serde_json::Value;

use crate::report::figure::{
    list, num, points, text, Axis, BuildError, Figure, Named, Role, Row, Section, Series,
};

/// What DIMMnet-2's paper prints for one submatrix width n, at
/// m = z = 4096 (section 5.2, 5.3, table 4, figures 5-6 and 10-13).
struct PaperNumbers {
    /// Submatrix width (doubles per row).
    n: u64,
    /// The remote-vector-access transfer, one way (us; figures 10-11).
    vector_us: f64,
    /// Its bandwidth (MByte/s; figures 12-13).
    vector_mb_per_s: f64,
    /// The host pack + transfer + unpack estimate, best segment count
    /// (us; table 4 and section 5.3).
    host_us: f64,
    /// The host unpack bandwidth that bounds it (MByte/s; figures 5-6).
    host_unpack_mb_per_s: f64,
    /// The range of pack and unpack bandwidths over z at m = 4096
    /// (MByte/s; section 2.1, figures 3-6).
    host_range_mb_per_s: (f64, f64),
}

/// The paper's numbers; its z and m.
const PAPER: [PaperNumbers; 2] = [
    PaperNumbers {
        n: 1,
        vector_us: 258.2,
        vector_mb_per_s: 123.4,
        host_us: 1190.6,
        host_unpack_mb_per_s: 23.7,
        host_range_mb_per_s: (23.7, 59.1),
    },
    PaperNumbers {
        n: 16,
        vector_us: 1058.5,
        vector_mb_per_s: 494.2,
        host_us: 3828.3,
        host_unpack_mb_per_s: 135.4,
        host_range_mb_per_s: (135.4, 208.3),
    },
];
/// The paper's matrix width and submatrix height of the numbers above.
const PAPER_Z: u64 = 4096;
const PAPER_M: u64 = 4096;
/// The paper's host unpack at n = 1, m = 4096, as a share of its
/// contiguous copy (section 2.1).
const PAPER_UNPACK_SHARE: &str = "9-14 %";

fn paper(n: u64) -> Option<&'static PaperNumbers> {
    PAPER.iter().find(|p| p.n == n)
}

/// Series of the document's figure index left out of the plots to keep
/// them readable (they stay in the JSON): the cold one-pass copy, the warm
/// pack + write + unpack and the MPIs' contiguous sends.
const LEFT_OUT: &[&str] = &[
    "one_pass_copy cold",
    "pack_write_unpack warm",
    "openmpi_contig",
    "mpich_contig",
];

/// The reader's name of a pass (`"4k"`, `"huge"`).
fn pages_label(pages: &str) -> &str {
    match pages {
        "4k" => "4 KiB pages",
        "huge" => "2 MiB pages",
        other => other,
    }
}

/// The reader's name of an MPI of the document.
fn mpi_label(mpi: &str) -> &str {
    match mpi {
        "openmpi" => "Open MPI",
        "mpich" => "MPICH",
        other => other,
    }
}

/// How a series of the document is drawn: its role and legend text.
fn describe(method: &str, cache: Option<&str>, z: u64, host_figure: bool) -> (Role, String) {
    let cache = cache.map_or(String::new(), |c| format!(", {c}"));
    match method {
        "vector_write" => (Role::Ours, format!("vector write{cache}")),
        "vector_read" => (Role::Ours, format!("vector read{cache}")),
        "pack" | "unpack" if host_figure => (Role::Ours, format!("host {method}, z = {z}{cache}")),
        "contig_copy" => (Role::Limit, format!("contiguous copy{cache} (Contig)")),
        "contig_write" => (Role::Limit, "contiguous RDMA write (Contig)".to_string()),
        "pack_write_unpack" => (Role::Limit, format!("pack + write + unpack{cache}")),
        "one_pass_copy" => (Role::Limit, format!("one-pass strided copy{cache}")),
        _ => match method.split_once('_') {
            Some((mpi @ ("openmpi" | "mpich"), kind)) => {
                let kind = if kind == "vector" {
                    "MPI_Type_vector"
                } else {
                    "contiguous"
                };
                (Role::Peer, format!("{}, {kind}", mpi_label(mpi)))
            }
            _ => (Role::Limit, format!("{method}{cache}")),
        },
    }
}

/// One pass (page size) of the document.
struct Pass<'a> {
    pages: &'a str,
    doc: &'a Value,
}

impl<'a> Pass<'a> {
    /// The series `method cache` at (z, n).
    fn series(&self, method: &str, cache: Option<&str>, z: u64, n: u64) -> Option<&'a Value> {
        list(self.doc, "series").ok()?.iter().find(|s| {
            s.get("method").and_then(Value::as_str) == Some(method)
                && s.get("cache").and_then(Value::as_str) == cache
                && s.get("z").and_then(Value::as_u64) == Some(z)
                && s.get("n").and_then(Value::as_u64) == Some(n)
        })
    }

    /// `quantity` (`us.median`, `mb_per_s`) of `method cache` at (z, n, m).
    fn value(
        &self,
        method: &str,
        cache: Option<&str>,
        (z, n, m): (u64, u64, u64),
        quantity: &str,
    ) -> Option<f64> {
        list(self.series(method, cache, z, n)?, "points")
            .ok()?
            .iter()
            .find(|p| p.get("m").and_then(Value::as_u64) == Some(m))
            .and_then(|p| num(p, quantity).ok())
            .filter(|v| v.is_finite())
    }

    /// `quantity` of `method cache` at (z, n) against m.
    fn points(
        &self,
        method: &str,
        cache: Option<&str>,
        z: u64,
        n: u64,
        quantity: &str,
    ) -> Result<Vec<(f64, f64)>, BuildError> {
        match self.series(method, cache, z, n) {
            None => Ok(Vec::new()),
            Some(series) => points(series, "points", "m", quantity).map_err(|e| {
                format!(
                    "passes ({}): series {method} {cache:?} z = {z} n = {n}: {e}",
                    self.pages
                )
            }),
        }
    }
}

/// `method cache` of a figure index entry (`"pack cold"`, `"openmpi_vector"`).
fn split_key(key: &str) -> (&str, Option<&str>) {
    match key.split_once(' ') {
        Some((method, cache)) => (method, Some(cache)),
        None => (key, None),
    }
}

fn numbers(doc: &Value, path: &str) -> Result<Vec<u64>, BuildError> {
    list(doc, path)?
        .iter()
        .map(|v| {
            v.as_u64()
                .ok_or_else(|| format!("`{path}` holds {v}, not a size"))
        })
        .collect()
}

/// Sections of the `vector_transfer` document.
pub fn vector_transfer(doc: &Value) -> Result<Vec<Section>, BuildError> {
    let zs = numbers(doc, "plan.z")?;
    let ns = numbers(doc, "plan.n")?;
    let ms = numbers(doc, "plan.m")?;
    // The README's representative sizes: z = 4096 (where the targets and
    // the paper's numbers are) and the largest m.
    let z = if zs.contains(&PAPER_Z) {
        PAPER_Z
    } else {
        zs.iter().copied().max().ok_or("`plan.z` is empty")?
    };
    let m = ms.iter().copied().max().ok_or("`plan.m` is empty")?;
    let passes: Vec<Pass> = list(doc, "passes")?
        .iter()
        .enumerate()
        .map(|(i, p)| {
            Ok(Pass {
                pages: text(p, "pages").map_err(|e| format!("passes.{i}: {e}"))?,
                doc: p,
            })
        })
        .collect::<Result<_, BuildError>>()?;
    let small = passes.iter().find(|p| p.pages == "4k");
    let huge = passes.iter().find(|p| p.pages == "huge");
    // The figures come from the 4 KiB pass (always run); the pages plot
    // and the rows set the 2 MiB pass beside it.
    let main = small.or(passes.first());

    let mut section = Section::new(
        "Vector transfers: DIMMnet-2's submatrix transfer",
        "vector-transfer",
    );
    section.notes.push(format!(
        "An m x n submatrix of a 4096 x (z + 1) matrix of doubles (MPI_Type_vector(m, n, \
         z + 1, MPI_DOUBLE)) moves into another port's matrix; latency is one whole transfer \
         (the MPIs: half a ping-pong round trip between two ranks of this host), bandwidth \
         the bytes over it in MByte/s. Plots are at z = {z} (the paper's numbers and the \
         targets are at z = 4096) on {} unless they say otherwise; figures 3-6 show every z \
         of the run. The cold one-pass copy, the warm pack + write + unpack and the MPIs' \
         contiguous sends are in the JSON, left out of the plots.",
        main.map_or("no pass", |p| pages_label(p.pages))
    ));
    section.notes.push(
        "The paper moved the submatrix between two Pentium 4 PCs over DIMMnet-2 and \
         InfiniBand (its MPI used the remote vector read); here both ports are on one host \
         and the emulated NIC copies with a core, so the limit is the one-pass strided copy \
         of that core. In figures 3-6 the pindown lines are the benchmark's own host pack \
         and unpack (the copies a vector transfer avoids), not the device."
            .into(),
    );
    section.notes.extend(targets_note(doc)?);

    let index = list(doc, "figures")?;
    for (i, entry) in index.iter().enumerate() {
        let figure = plot(entry, main, &zs, z).map_err(|e| format!("figures.{i}: {e}"))?;
        section.figures.push(figure);
    }
    section.figures.push(pages_plot(&passes, &ns, z)?);

    for pass in [small, huge].into_iter().flatten() {
        for &n in &ns {
            section.rows.push(warm_row(doc, pass, (z, n, m)));
        }
        if ns.contains(&1) {
            section.rows.push(cold_row(doc, pass, (z, 1, m)));
        }
    }
    if let Some(pass) = small {
        for &n in &ns {
            section.rows.push(bandwidth_row(pass, (z, n, m)));
        }
        if ns.contains(&1) {
            section.rows.push(unpack_row(pass, (z, 1, m)));
        }
    }
    section.missing = missing(&passes)?;
    Ok(vec![section])
}

/// One paper figure from the document's figure index: its series at z (and
/// for figures 3-6 the cold pack or unpack at every z, as the paper drew
/// them), with the paper's point where it prints one.
fn plot(entry: &Value, pass: Option<&Pass>, zs: &[u64], z: u64) -> Result<Figure, BuildError> {
    let number = text(entry, "figure")?;
    let n = at_u64(entry, "n")?;
    let quantity = text(entry, "quantity")?;
    let (y, path) = match quantity {
        "us" => (Axis::log("one transfer, median (us)"), "us.median"),
        "mb_per_s" => (Axis::log("bandwidth (MByte/s, 10^6 B/s)"), "mb_per_s"),
        other => return Err(format!("`quantity` {other} is not us or mb_per_s")),
    };
    let keys: Vec<&str> = list(entry, "series")?
        .iter()
        .map(|k| {
            k.as_str()
                .ok_or_else(|| format!("series key {k} is not a string"))
        })
        .collect::<Result<_, _>>()?;
    let host_method = keys
        .iter()
        .map(|k| split_key(k).0)
        .find(|m| *m == "pack" || *m == "unpack");
    let mut wanted: Vec<(&str, Option<&str>, u64)> = Vec::new();
    if let Some(method) = host_method {
        let mut others: Vec<u64> = zs.iter().copied().filter(|&other| other != z).collect();
        others.sort_unstable();
        wanted.extend(
            others
                .into_iter()
                .map(|other| (method, Some("cold"), other)),
        );
    }
    for key in keys.iter().filter(|k| !LEFT_OUT.contains(k)) {
        let (method, cache) = split_key(key);
        wanted.push((method, cache, z));
    }
    if host_method.is_some() {
        // The cold line of z first, then the others: the paper's lines by z.
        wanted.sort_by_key(|&(method, cache, at)| {
            (Some(method) != host_method, cache != Some("cold"), at)
        });
    }
    let mut series = Vec::new();
    for (method, cache, at) in wanted {
        let (role, name) = describe(method, cache, at, host_method.is_some());
        let points = match pass {
            Some(pass) => pass.points(method, cache, at, n, path)?,
            None => Vec::new(),
        };
        series.push(Series::new(name, role, points));
    }
    if let Some(paper) = paper(n) {
        let m = PAPER_M as f64;
        let point = match (host_method, quantity) {
            (Some("unpack"), "mb_per_s") => Some((
                format!("paper: Pentium 4, z = {PAPER_Z}"),
                paper.host_unpack_mb_per_s,
            )),
            (None, "us") => Some((format!("paper: DIMMnet-2, z = {PAPER_Z}"), paper.vector_us)),
            (None, "mb_per_s") => Some((
                format!("paper: DIMMnet-2, z = {PAPER_Z}"),
                paper.vector_mb_per_s,
            )),
            _ => None,
        };
        if let Some((name, y)) = point {
            series.push(Series::new(name, Role::Paper, vec![(m, y)]));
        }
    }
    let what = match (host_method, quantity) {
        (Some(method), _) => format!("Host {method} bandwidth"),
        (None, "us") => "Submatrix transfer latency".to_string(),
        (None, _) => "Submatrix transfer bandwidth".to_string(),
    };
    let pages = pass.map_or("", |p| pages_label(p.pages));
    let title = if host_method.is_some() {
        format!("{what}, n = {n}, by z, {pages}")
    } else {
        format!("{what}, n = {n}, z = {z}, {pages}")
    };
    Ok(Figure {
        id: format!("vector-transfer-figure{number}"),
        title,
        reproduces: format!("DIMMnet-2, figure {number}"),
        x: Axis::log("submatrix rows m (m x n doubles)"),
        y,
        series,
    })
}

fn at_u64(doc: &Value, path: &str) -> Result<u64, BuildError> {
    let v = num(doc, path)?;
    if v >= 0.0 && v.fract() == 0.0 {
        Ok(v as u64)
    } else {
        Err(format!("`{path}` = {v} is not a size"))
    }
}

/// The warm vector write over the warm one-pass copy against m, for every
/// n and page size: what huge pages change.
fn pages_plot(passes: &[Pass], ns: &[u64], z: u64) -> Result<Figure, BuildError> {
    let mut series = Vec::new();
    let mut ms: Vec<f64> = Vec::new();
    for pass in passes {
        for &n in ns {
            let write = pass.points("vector_write", Some("warm"), z, n, "us.median")?;
            let copy = pass.points("one_pass_copy", Some("warm"), z, n, "us.median")?;
            let ratio: Vec<(f64, f64)> = write
                .iter()
                .filter_map(|&(m, us)| {
                    let (_, limit) = copy.iter().find(|(at, _)| *at == m)?;
                    (*limit > 0.0).then_some((m, us / limit))
                })
                .collect();
            ms.extend(ratio.iter().map(|p| p.0));
            series.push(Series::new(
                format!("vector write, n = {n}, {}", pages_label(pass.pages)),
                Role::Ours,
                ratio,
            ));
        }
    }
    ms.sort_by(f64::total_cmp);
    ms.dedup();
    series.push(Series::new(
        "one-pass strided copy (= 1)",
        Role::Limit,
        ms.into_iter().map(|m| (m, 1.0)).collect(),
    ));
    Ok(Figure {
        id: "vector-transfer-pages".into(),
        title: format!("Warm vector write over the one-pass copy, z = {z}, by page size"),
        reproduces: "no paper figure; 4 KiB against 2 MiB pages".into(),
        x: Axis::log("submatrix rows m (m x n doubles)"),
        y: Axis::log("vector write time / one-pass copy time"),
        series,
    })
}

/// The bound of the document's target on `pages` whose `what` starts with
/// `prefix` at (z, n), as "at most 1.3x".
fn target_bound(doc: &Value, pages: &str, prefix: &str, z: u64, n: u64) -> Option<String> {
    let at = format!(", z = {z}, n = {n},");
    list(doc, "targets").ok()?.iter().find_map(|t| {
        let what = t.get("what")?.as_str()?;
        (t.get("pages")?.as_str()? == pages && what.starts_with(prefix) && what.contains(&at))
            .then(|| {
                Some(format!(
                    "{} {}x",
                    t.get("bound")?.as_str()?,
                    t.get("target")?.as_f64()?
                ))
            })?
    })
}

/// The MPIs' `quantity` of `kind` (`vector`) at (z, n, m) in `pass`.
fn mpi_peers(pass: &Pass, kind: &str, at: (u64, u64, u64), quantity: &str) -> Vec<Named> {
    ["openmpi", "mpich"]
        .into_iter()
        .map(|mpi| {
            Named::new(
                format!("{}, MPI_Type_vector", mpi_label(mpi)),
                pass.value(&format!("{mpi}_{kind}"), None, at, quantity),
            )
        })
        .collect()
}

/// The warm vector write against the warm one-pass copy and the MPIs
/// (the targets' first two kinds).
fn warm_row(doc: &Value, pass: &Pass, (z, n, m): (u64, u64, u64)) -> Row {
    let at = (z, n, m);
    let mut targets = Vec::new();
    if let Some(b) = target_bound(
        doc,
        pass.pages,
        "vector_write time over one_pass_copy",
        z,
        n,
    ) {
        targets.push(format!("{b} the one-pass copy"));
    }
    if let Some(b) = target_bound(
        doc,
        pass.pages,
        "openmpi_vector time over vector_write",
        z,
        n,
    ) {
        targets.push(format!("Open MPI {b} ours"));
    }
    let targets = if targets.is_empty() {
        String::new()
    } else {
        format!(" (targets: {})", targets.join("; "))
    };
    let paper = paper(n).filter(|_| pass.pages == "4k").map(|p| {
        format!(
            "{} us at m = {PAPER_M}, z = {PAPER_Z}: DIMMnet-2 vector read, Pentium 4, InfiniBand \
             (figure {})",
            p.vector_us,
            if n == 1 { 10 } else { 11 }
        )
    });
    Row {
        what: format!(
            "vector write, warm, z = {z}, n = {n}, m = {m}, {}{targets}",
            pages_label(pass.pages)
        ),
        unit: "us".into(),
        ours: pass.value("vector_write", Some("warm"), at, "us.median"),
        paper,
        peers: mpi_peers(pass, "vector", at, "us.median"),
        limit: Some(Named::new(
            "one-pass strided copy, warm",
            pass.value("one_pass_copy", Some("warm"), at, "us.median"),
        )),
    }
}

/// The cold vector write against the cold host pack + write + unpack (the
/// targets' third kind; the paper's table 4).
fn cold_row(doc: &Value, pass: &Pass, (z, n, m): (u64, u64, u64)) -> Row {
    let at = (z, n, m);
    let target = target_bound(doc, pass.pages, "pack_write_unpack cold time over", z, n)
        .map_or(String::new(), |b| {
            format!(" (target: pack + write + unpack {b} ours)")
        });
    let paper = paper(n).filter(|_| pass.pages == "4k").map(|p| {
        format!(
            "{} us against {} us for host pack + transfer + unpack, {:.1} % less (table 4)",
            p.vector_us,
            p.host_us,
            100.0 * (1.0 - p.vector_us / p.host_us)
        )
    });
    Row {
        what: format!(
            "vector write, cold, z = {z}, n = {n}, m = {m}, {}{target}",
            pages_label(pass.pages)
        ),
        unit: "us".into(),
        ours: pass.value("vector_write", Some("cold"), at, "us.median"),
        paper,
        peers: mpi_peers(pass, "vector", at, "us.median"),
        limit: Some(Named::new(
            "host pack + RDMA write + unpack, cold",
            pass.value("pack_write_unpack", Some("cold"), at, "us.median"),
        )),
    }
}

/// The cold vector write's bandwidth against the cold host unpack that
/// bounds a pack + write + unpack (the paper's 5.2x and 3.6x).
fn bandwidth_row(pass: &Pass, (z, n, m): (u64, u64, u64)) -> Row {
    let at = (z, n, m);
    let paper = paper(n).map(|p| {
        format!(
            "{} MByte/s, {:.1}x the Pentium 4's host unpack ({} MByte/s; figures {} and {})",
            p.vector_mb_per_s,
            p.vector_mb_per_s / p.host_unpack_mb_per_s,
            p.host_unpack_mb_per_s,
            if n == 1 { 12 } else { 13 },
            if n == 1 { 5 } else { 6 }
        )
    });
    Row {
        what: format!(
            "vector write bandwidth, cold, z = {z}, n = {n}, m = {m}, {}",
            pages_label(pass.pages)
        ),
        unit: "MByte/s".into(),
        ours: pass.value("vector_write", Some("cold"), at, "mb_per_s"),
        paper,
        peers: mpi_peers(pass, "vector", at, "mb_per_s"),
        limit: Some(Named::new(
            "host unpack, cold",
            pass.value("unpack", Some("cold"), at, "mb_per_s"),
        )),
    }
}

/// The cold host unpack against a cold contiguous copy of the same bytes
/// (figures 3-6: what the paper's host lost to strides).
fn unpack_row(pass: &Pass, (z, n, m): (u64, u64, u64)) -> Row {
    let at = (z, n, m);
    let paper = paper(n).map(|p| {
        format!(
            "{PAPER_UNPACK_SHARE} of the contiguous copy at n = 1 (figure 5); pack and \
             unpack {}-{} MByte/s over z (figures 3-6)",
            p.host_range_mb_per_s.0, p.host_range_mb_per_s.1
        )
    });
    Row {
        what: format!(
            "host unpack bandwidth (the copy a vector write avoids, not the device), cold, \
             z = {z}, n = {n}, m = {m}, {}",
            pages_label(pass.pages)
        ),
        unit: "MByte/s".into(),
        ours: pass.value("unpack", Some("cold"), at, "mb_per_s"),
        paper,
        peers: Vec::new(),
        limit: Some(Named::new(
            "contiguous copy, cold",
            pass.value("contig_copy", Some("cold"), at, "mb_per_s"),
        )),
    }
}

/// How many of the document's targets each pass met.
fn targets_note(doc: &Value) -> Result<Option<String>, BuildError> {
    let targets = list(doc, "targets")?;
    let mut pages: Vec<&str> = Vec::new();
    for (i, t) in targets.iter().enumerate() {
        let p = text(t, "pages").map_err(|e| format!("targets.{i}: {e}"))?;
        if !pages.contains(&p) {
            pages.push(p);
        }
    }
    if pages.is_empty() {
        return Ok(None);
    }
    let parts: Vec<String> = pages
        .iter()
        .map(|p| {
            let of: Vec<&Value> = targets.iter().filter(|t| t["pages"] == *p).collect();
            let met = of.iter().filter(|t| t["met"] == Value::Bool(true)).count();
            let unmeasured = of.iter().filter(|t| !t["met"].is_boolean()).count();
            let mut part = format!("{}: {met} of {} met", pages_label(p), of.len());
            if unmeasured > 0 {
                part.push_str(&format!(" ({unmeasured} not measured)"));
            }
            part
        })
        .collect();
    Ok(Some(format!(
        "The issue's targets at m = the largest m of the run (the document's `targets`, \
         each with its bound): {}.",
        parts.join("; ")
    )))
}

/// Who was not measured, why, and on which passes.
type Absent = (String, String, Vec<String>);

/// Adds `who`, not measured on `pages` for `reason`, to `lines` (one line
/// per who and reason).
fn add(lines: &mut Vec<Absent>, who: String, reason: String, pages: &str) {
    let label = pages_label(pages).to_string();
    match lines.iter_mut().find(|(w, r, _)| *w == who && *r == reason) {
        Some((_, _, at)) if !at.contains(&label) => at.push(label),
        Some(_) => {}
        None => lines.push((who, reason, vec![label])),
    }
}

/// Every pass, MPI or series the document reports as not measured, with
/// its reason; one line per peer and reason.
fn missing(passes: &[Pass]) -> Result<Vec<String>, BuildError> {
    let mut lines: Vec<Absent> = Vec::new();
    let measured = |v: &Value| v.get("status").and_then(Value::as_str) == Some("measured");
    let reason = |v: &Value| {
        v.get("reason")
            .and_then(Value::as_str)
            .unwrap_or("not measured, no reason given")
            .to_string()
    };
    for pass in passes {
        if !measured(pass.doc) {
            add(
                &mut lines,
                "the driver's figures".into(),
                reason(pass.doc),
                pass.pages,
            );
        }
        let mpis = list(pass.doc, "mpi").map_err(|e| format!("passes ({}): {e}", pass.pages))?;
        for mpi in ["openmpi", "mpich"] {
            match mpis
                .iter()
                .find(|r| r.get("mpi").and_then(Value::as_str) == Some(mpi))
            {
                None => add(
                    &mut lines,
                    mpi_label(mpi).into(),
                    "not run (the document has no run of it)".into(),
                    pass.pages,
                ),
                Some(r) if !measured(r) => {
                    add(&mut lines, mpi_label(mpi).into(), reason(r), pass.pages)
                }
                Some(_) => {}
            }
        }
        for s in list(pass.doc, "series").map_err(|e| format!("passes ({}): {e}", pass.pages))? {
            let status = s.get("status").and_then(Value::as_str);
            if status == Some("measured") {
                continue;
            }
            let r = reason(s);
            // Already said for the pass or its MPI.
            if lines.iter().any(|(_, known, _)| *known == r) {
                continue;
            }
            let method = s.get("method").and_then(Value::as_str).unwrap_or("?");
            add(&mut lines, format!("series {method}"), r, pass.pages);
        }
    }
    Ok(lines
        .into_iter()
        .map(|(who, reason, at)| format!("{who} ({}): {reason}", at.join(", ")))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn point(m: u64, n: u64, us: f64) -> Value {
        let bytes = m * n * 8;
        json!({"m": m, "bytes": bytes, "us": {"median": us}, "mb_per_s": bytes as f64 / us,
               "verified": true})
    }

    fn series(method: &str, cache: Option<&str>, us: f64) -> Value {
        json!({"method": method, "cache": cache, "z": 4096, "n": 1, "status": "measured",
               "reason": null, "points": [point(64, 1, us / 10.0), point(4096, 1, us)]})
    }

    /// A 4 KiB pass with Open MPI measured and MPICH missing; the 2 MiB
    /// pass missing for want of huge pages.
    fn document() -> Value {
        let no_mpich = "mpicc.mpich not found (apt-get install mpich libmpich-dev)";
        let no_huge = "the DMA arenas are not on huge pages: reserve at least 328";
        let mut small = vec![
            series("vector_write", Some("warm"), 40.0),
            series("vector_write", Some("cold"), 100.0),
            series("vector_read", Some("warm"), 41.0),
            series("one_pass_copy", Some("warm"), 35.0),
            series("pack_write_unpack", Some("cold"), 150.0),
            series("pack", Some("cold"), 60.0),
            series("unpack", Some("cold"), 80.0),
            series("contig_copy", Some("cold"), 8.0),
            series("openmpi_vector", None, 50.0),
        ];
        for method in ["mpich_vector", "mpich_contig"] {
            small.push(json!({"method": method, "cache": null, "z": 4096, "n": 1,
                              "status": "missing", "reason": no_mpich, "points": []}));
        }
        json!({
            "plan": {"z": [4096], "n": [1], "m": [64, 4096]},
            "figures": [
                {"figure": "5", "what": "unpack", "n": 1, "quantity": "mb_per_s",
                 "series": ["unpack cold", "unpack warm", "contig_copy cold"]},
                {"figure": "10", "what": "latency", "n": 1, "quantity": "us",
                 "series": ["vector_write cold", "vector_write warm", "one_pass_copy warm",
                            "one_pass_copy cold", "openmpi_vector", "mpich_vector"]}
            ],
            "passes": [
                {"pages": "4k", "status": "measured", "reason": null, "series": small,
                 "mpi": [{"mpi": "openmpi", "status": "measured", "reason": null},
                         {"mpi": "mpich", "status": "missing", "reason": no_mpich}]},
                {"pages": "huge", "status": "missing", "reason": no_huge, "series": [],
                 "mpi": [{"mpi": "openmpi", "status": "measured", "reason": null},
                         {"mpi": "mpich", "status": "missing", "reason": no_mpich}]}
            ],
            "targets": [
                {"pages": "4k", "bound": "at most", "target": 1.3, "measured": 1.14, "met": true,
                 "what": "vector_write time over one_pass_copy warm, z = 4096, n = 1, m = 4096"},
                {"pages": "huge", "bound": "at most", "target": 1.3, "measured": null, "met": null,
                 "what": "vector_write time over one_pass_copy warm, z = 4096, n = 1, m = 4096"}
            ]
        })
    }

    #[test]
    fn a_missing_mpi_and_pass_are_listed_and_their_values_are_none() {
        let sections = vector_transfer(&document()).unwrap();
        let s = &sections[0];
        assert_eq!(
            s.missing,
            [
                "MPICH (4 KiB pages, 2 MiB pages): mpicc.mpich not found (apt-get install \
                 mpich libmpich-dev)",
                "the driver's figures (2 MiB pages): the DMA arenas are not on huge pages: \
                 reserve at least 328"
            ]
        );
        let ids: Vec<&str> = s.figures.iter().map(|f| f.id.as_str()).collect();
        assert_eq!(
            ids,
            [
                "vector-transfer-figure5",
                "vector-transfer-figure10",
                "vector-transfer-pages"
            ]
        );
        // Figure 10: the series of the index at z = 4096 but the cold
        // one-pass copy, the paper's point at m = 4096, MPICH with nothing.
        let latency = &s.figures[1];
        let names: Vec<&str> = latency.series.iter().map(|x| x.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "vector write, cold",
                "vector write, warm",
                "one-pass strided copy, warm",
                "Open MPI, MPI_Type_vector",
                "MPICH, MPI_Type_vector",
                "paper: DIMMnet-2, z = 4096"
            ]
        );
        assert_eq!(latency.series[1].points, [(64.0, 4.0), (4096.0, 40.0)]);
        assert!(latency.series[4].points.is_empty());
        assert_eq!(latency.series[5].points, [(4096.0, PAPER[0].vector_us)]);
        // The pages plot: the ratio on 4 KiB pages, nothing on 2 MiB ones.
        let pages = &s.figures[2];
        assert_eq!(
            pages.series[0].points,
            [(64.0, 40.0 / 35.0), (4096.0, 40.0 / 35.0)]
        );
        assert!(pages.series[1].points.is_empty());

        let warm = &s.rows[0];
        assert_eq!(warm.ours, Some(40.0));
        assert_eq!(warm.limit.as_ref().unwrap().value, Some(35.0));
        assert_eq!(warm.peers[0].value, Some(50.0));
        assert_eq!(warm.peers[1].name, "MPICH, MPI_Type_vector");
        assert_eq!(warm.peers[1].value, None);
        assert!(
            warm.what.contains("at most 1.3x the one-pass copy"),
            "{}",
            warm.what
        );
        let cold = &s.rows[1];
        assert_eq!(
            (cold.ours, cold.limit.as_ref().unwrap().value),
            (Some(100.0), Some(150.0))
        );
        assert!(cold.paper.as_deref().unwrap().contains("78.3 % less"));
        // The 2 MiB pass's rows are there, with nothing measured.
        let huge_warm = &s.rows[2];
        assert!(huge_warm.what.contains("2 MiB pages"));
        assert_eq!(huge_warm.ours, None);
        assert_eq!(huge_warm.peers[0].value, None);
        let bandwidth = s.rows.iter().find(|r| r.unit == "MByte/s").unwrap();
        assert_eq!(bandwidth.ours, Some(4096.0 * 8.0 / 100.0));
        assert!(bandwidth.paper.as_deref().unwrap().contains("5.2x"));
        assert!(s.notes.iter().any(|n| n.contains("4 KiB pages: 1 of 1 met")
            && n.contains("2 MiB pages: 0 of 1 met (1 not measured)")));
    }

    #[test]
    fn a_malformed_document_is_an_error_naming_the_path() {
        let mut doc = document();
        doc["figures"][1]["quantity"] = json!("furlongs");
        let err = vector_transfer(&doc).unwrap_err();
        assert!(
            err.contains("figures.1") && err.contains("furlongs"),
            "{err}"
        );
        let mut doc = document();
        doc["passes"][0]["series"][0]["points"][1]["us"] = json!({});
        let err = vector_transfer(&doc).unwrap_err();
        assert!(err.contains("us.median"), "{err}");
    }
}
