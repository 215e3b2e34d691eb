//! Report sections of the RDMA programs: `latency` (one request at a time,
//! post to completion, against a cache-line ping-pong; streams of writes
//! against `memcpy`), for each memory kind and mode the document has.

use serde_json::Value;

use crate::report::figure::{
    list, num, text, Axis, BuildError, Figure, Named, Role, Row, Section, Series,
};

/// The reader's name of a mode of the document (`"event"`, `"poll"`).
fn mode_label(mode: &str) -> &str {
    match mode {
        "event" => "event-driven",
        "poll" => "busy-poll",
        other => other,
    }
}

/// The reader's name of a latency operation of the document.
fn op_label(op: &str) -> &str {
    match op {
        "write" => "write",
        "write_inline" => "inline write",
        "read" => "read",
        "fetch_add" => "fetch-add",
        other => other,
    }
}

/// `bytes` as the README writes sizes (8 B, 4 KiB, 16 MiB).
fn size_label(bytes: f64) -> String {
    const KIB: f64 = 1024.0;
    if bytes >= KIB * KIB && bytes % (KIB * KIB) == 0.0 {
        format!("{} MiB", bytes / (KIB * KIB))
    } else if bytes >= KIB && bytes % KIB == 0.0 {
        format!("{} KiB", bytes / KIB)
    } else {
        format!("{bytes} B")
    }
}

/// One memory kind of one mode: its path in the document and its names.
struct Kind<'a> {
    mode: &'a str,
    memory: &'a str,
    /// `modes.I.kinds.J`.
    path: String,
    doc: &'a Value,
}

fn kinds(doc: &Value) -> Result<Vec<Kind<'_>>, BuildError> {
    let mut out = Vec::new();
    for (i, mode) in list(doc, "modes")?.iter().enumerate() {
        let name = text(mode, "mode").map_err(|e| format!("modes.{i}: {e}"))?;
        for (j, kind) in list(mode, "kinds")
            .map_err(|e| format!("modes.{i}: {e}"))?
            .iter()
            .enumerate()
        {
            out.push(Kind {
                mode: name,
                memory: text(kind, "memory").map_err(|e| format!("modes.{i}.kinds.{j}: {e}"))?,
                path: format!("modes.{i}.kinds.{j}"),
                doc: kind,
            });
        }
    }
    Ok(out)
}

/// The latency figure of `op` at `bytes` in `kind`, if measured.
fn latency_figure<'a>(kind: &Kind<'a>, op: &str, bytes: f64) -> Option<&'a Value> {
    list(kind.doc, "latency").ok()?.iter().find(|f| {
        f.get("op").and_then(Value::as_str) == Some(op)
            && f.get("bytes").and_then(Value::as_f64) == Some(bytes)
    })
}

/// Sections of the `latency` document.
pub fn latency(doc: &Value) -> Result<Vec<Section>, BuildError> {
    let kinds = kinds(doc)?;
    let mut section = Section::new(
        "RDMA latency and bandwidth against a cache-line round trip and memcpy",
        "latency",
    );
    let samples = num(doc, "plan.latency_samples")?;
    let in_flight = num(doc, "plan.in_flight")?;
    section.notes.push(format!(
        "Latency: one request at a time, post to completion seen, median of {samples:.0} \
         (p99 in the rows); the limit is a cache-line round trip between the two cores \
         measured just before each figure, as the hypervisor moves the two vCPUs between \
         figures. Bandwidth: streams of writes, {in_flight:.0} in flight, against one \
         thread's memcpy of the same size, timed before any device ran (the targets' \
         baseline) and between the rounds. Every write, read and fetch-add is checked."
    ));
    let huge: Vec<String> = kinds
        .iter()
        .filter_map(|k| {
            let huge = k.doc.get("arena_huge_pages")?.as_bool()?;
            Some(format!(
                "{} ({}): {}",
                k.memory,
                mode_label(k.mode),
                if huge { "2 MiB pages" } else { "4 KiB pages" }
            ))
        })
        .collect();
    if !huge.is_empty() {
        section
            .notes
            .push(format!("DMA arenas in this run: {}.", huge.join(", ")));
    }
    let mut memories: Vec<&str> = Vec::new();
    for kind in &kinds {
        if !memories.contains(&kind.memory) {
            memories.push(kind.memory);
        }
        if let Some(error) = kind.doc.get("error").and_then(Value::as_str) {
            section.missing.push(format!(
                "{} memory, {}: {error}",
                kind.memory,
                mode_label(kind.mode)
            ));
        }
        section.figures.push(latency_plot(kind)?);
    }
    for memory in memories {
        section.figures.push(bandwidth_plot(doc, &kinds, memory)?);
    }
    for (i, target) in list(doc, "targets")?.iter().enumerate() {
        section
            .rows
            .push(target_row(doc, &kinds, target).map_err(|e| format!("targets.{i}: {e}"))?);
    }
    Ok(vec![section])
}

/// Latency against size for one memory kind in one mode.
fn latency_plot(kind: &Kind) -> Result<Figure, BuildError> {
    let figures = list(kind.doc, "latency").map_err(|e| format!("{}: {e}", kind.path))?;
    let mut ops: Vec<&str> = Vec::new();
    for f in figures {
        let op = text(f, "op").map_err(|e| format!("{}.latency: {e}", kind.path))?;
        if !ops.contains(&op) {
            ops.push(op);
        }
    }
    let mut series = Vec::new();
    for op in &ops {
        let mut points = Vec::new();
        for f in figures.iter().filter(|f| f["op"] == *op) {
            points.push((num(f, "bytes")?, num(f, "us.median")?));
        }
        let name = if *op == "fetch_add" {
            format!("{} (8 B), median", op_label(op))
        } else {
            format!("{}, median", op_label(op))
        };
        series.push(Series::new(name, Role::Ours, points));
    }
    // The round trip measured before each figure of the first operation
    // (writes), so that the limit has one point per size.
    if let Some(first) = ops.first() {
        let mut points = Vec::new();
        for f in figures.iter().filter(|f| f["op"] == *first) {
            points.push((num(f, "bytes")?, num(f, "ping_pong_us.median")?));
        }
        series.push(Series::new(
            format!("round trip before each {}", op_label(first)),
            Role::Limit,
            points,
        ));
    }
    Ok(Figure {
        id: format!("latency-{}-{}", kind.memory, kind.mode),
        title: format!(
            "RDMA latency by size, {} memory, {}",
            kind.memory,
            mode_label(kind.mode)
        ),
        reproduces: "no paper figure; the README's latency figures".into(),
        x: Axis::log("transfer size (bytes)"),
        y: Axis::log("post to completion (us)"),
        series,
    })
}

/// Write bandwidth against size for one memory kind, every mode.
fn bandwidth_plot(doc: &Value, kinds: &[Kind], memory: &str) -> Result<Figure, BuildError> {
    let mut ours = Vec::new();
    let mut limits = Vec::new();
    for kind in kinds.iter().filter(|k| k.memory == memory) {
        let path = format!("{}.bandwidth", kind.path);
        let figures = list(kind.doc, "bandwidth").map_err(|e| format!("{path}: {e}"))?;
        let mut rate = Vec::new();
        let mut memcpy = Vec::new();
        for f in figures {
            let bytes = num(f, "bytes").map_err(|e| format!("{path}: {e}"))?;
            rate.push((bytes, num(f, "gb_per_s.median")?));
            memcpy.push((bytes, num(f, "memcpy_gb_per_s.median")?));
        }
        ours.push(Series::new(
            format!("{} writes, median", mode_label(kind.mode)),
            Role::Ours,
            rate,
        ));
        limits.push(Series::new(
            format!("memcpy, {} rounds", mode_label(kind.mode)),
            Role::Limit,
            memcpy,
        ));
    }
    let mut idle = Vec::new();
    for (i, m) in list(doc, "memcpy_idle")?.iter().enumerate() {
        idle.push((
            num(m, "bytes").map_err(|e| format!("memcpy_idle.{i}: {e}"))?,
            num(m, "gb_per_s.median").map_err(|e| format!("memcpy_idle.{i}: {e}"))?,
        ));
    }
    limits.push(Series::new("memcpy, before any device", Role::Limit, idle));
    ours.extend(limits);
    Ok(Figure {
        id: format!("latency-{memory}-bandwidth"),
        title: format!("RDMA write bandwidth by size, {memory} memory"),
        reproduces: "no paper figure; the README's write bandwidth against memcpy".into(),
        x: Axis::log("write size (bytes)"),
        y: Axis::log("bandwidth (GB/s)"),
        series: ours,
    })
}

/// What one target of the document measures, read from its `what`
/// (`"MODE, MEMORY: REST"`, as the program writes it).
enum Measure<'a> {
    /// `OP BYTES B median us`.
    Median { op: &'a str, bytes: f64 },
    /// `OP BYTES B p99 over median`.
    P99 { op: &'a str, bytes: f64 },
    /// `BYTES B writes over idle memcpy`.
    Bandwidth { bytes: f64 },
}

/// `OP BYTES` of a target's `what`.
fn op_bytes(head: &str) -> Option<(&str, f64)> {
    let (op, bytes) = head.split_once(' ')?;
    Some((op, bytes.parse().ok()?))
}

fn parse_measure(rest: &str) -> Option<Measure<'_>> {
    if let Some(head) = rest.strip_suffix(" B median us") {
        let (op, bytes) = op_bytes(head)?;
        Some(Measure::Median { op, bytes })
    } else if let Some(head) = rest.strip_suffix(" B p99 over median") {
        let (op, bytes) = op_bytes(head)?;
        Some(Measure::P99 { op, bytes })
    } else {
        let head = rest.strip_suffix(" B writes over idle memcpy")?;
        Some(Measure::Bandwidth {
            bytes: head.parse().ok()?,
        })
    }
}

/// The row of one target: ours, the baseline the target is measured
/// against, and the bound and whether this run met it.
fn target_row(doc: &Value, kinds: &[Kind], target: &Value) -> Result<Row, BuildError> {
    let what = text(target, "what")?;
    let bound = num(target, "target")?;
    let verdict = match target.get("met").and_then(Value::as_bool) {
        Some(true) => "met",
        Some(false) => "missed",
        None => "not measured",
    };
    let parsed = what.split_once(": ").and_then(|(label, rest)| {
        let (mode, memory) = label.split_once(", ")?;
        let kind = kinds
            .iter()
            .find(|k| k.mode == mode && k.memory == memory)?;
        Some((kind, parse_measure(rest)?))
    });
    let Some((kind, measure)) = parsed else {
        // A target this builder does not know: shown as the document says.
        return Ok(Row {
            what: format!("{what} (target {bound}: {verdict})"),
            unit: String::new(),
            ours: target.get("measured").and_then(Value::as_f64),
            paper: None,
            peers: Vec::new(),
            limit: None,
        });
    };
    let at_kind = format!("{} memory, {}", kind.memory, mode_label(kind.mode));
    let figure = |op: &str, bytes: f64| {
        latency_figure(kind, op, bytes)
            .ok_or_else(|| format!("no latency figure {op} {bytes} B in {}", kind.path))
    };
    Ok(match measure {
        Measure::Median { op, bytes } => {
            let f = figure(op, bytes)?;
            Row {
                what: format!(
                    "{} {}, median, {at_kind} (target at most {bound} us: {verdict})",
                    size_label(bytes),
                    op_label(op)
                ),
                unit: "us".into(),
                ours: Some(num(f, "us.median")?),
                paper: None,
                peers: Vec::new(),
                limit: Some(Named::new(
                    "cache-line round trip just before",
                    Some(num(f, "ping_pong_us.median")?),
                )),
            }
        }
        Measure::P99 { op, bytes } => {
            let f = figure(op, bytes)?;
            Row {
                what: format!(
                    "{} {}, p99, {at_kind} (target at most {bound}x its median: {verdict})",
                    size_label(bytes),
                    op_label(op)
                ),
                unit: "us".into(),
                ours: Some(num(f, "us.p99")?),
                paper: None,
                peers: Vec::new(),
                limit: Some(Named::new("its median", Some(num(f, "us.median")?))),
            }
        }
        Measure::Bandwidth { bytes } => {
            let f = list(kind.doc, "bandwidth")?
                .iter()
                .find(|f| f.get("bytes").and_then(Value::as_f64) == Some(bytes))
                .ok_or_else(|| format!("no bandwidth figure of {bytes} B in {}", kind.path))?;
            let idle = list(doc, "memcpy_idle")?
                .iter()
                .find(|m| m.get("bytes").and_then(Value::as_f64) == Some(bytes))
                .map(|m| num(m, "gb_per_s.median"))
                .transpose()?;
            Row {
                what: format!(
                    "{} write stream, {at_kind} (target at least {bound}x memcpy: {verdict})",
                    size_label(bytes)
                ),
                unit: "GB/s".into(),
                ours: Some(num(f, "gb_per_s.median")?),
                paper: None,
                peers: Vec::new(),
                limit: Some(Named::new("memcpy before any device ran", idle)),
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::figure::at;
    use serde_json::json;

    fn summary(median: f64, p99: f64) -> Value {
        json!({"samples": 100, "median": median, "p99": p99, "mean": median, "min": median, "max": p99})
    }

    fn latency(op: &str, bytes: u32, median: f64, ping_pong: f64) -> Value {
        json!({"op": op, "bytes": bytes, "us": summary(median, 2.0 * median),
               "ping_pong_us": summary(ping_pong, ping_pong), "verified": true})
    }

    /// Arena measured, heap failed in the busy-poll mode.
    fn document() -> Value {
        json!({
            "plan": {"latency_samples": 100, "in_flight": 4},
            "memcpy_idle": [{"bytes": 1048576, "gb_per_s": summary(40.0, 41.0)}],
            "modes": [{
                "mode": "poll",
                "kinds": [
                    {"memory": "arena", "arena_huge_pages": false, "error": null,
                     "latency": [latency("write", 8, 0.5, 0.1), latency("write", 4096, 0.8, 0.2),
                                 latency("fetch_add", 8, 0.6, 0.1)],
                     "bandwidth": [{"bytes": 1048576, "gb_per_s": summary(36.0, 37.0),
                                    "memcpy_gb_per_s": summary(38.0, 39.0)}]},
                    {"memory": "heap", "arena_huge_pages": false,
                     "error": "heap memory in poll mode: registration refused",
                     "latency": [], "bandwidth": []}
                ]
            }],
            "targets": [
                {"what": "poll, arena: write 8 B median us", "target": 1.0, "measured": 0.5, "met": true},
                {"what": "poll, arena: write 8 B p99 over median", "target": 2.0, "measured": 2.0, "met": true},
                {"what": "poll, arena: 1048576 B writes over idle memcpy", "target": 0.9, "measured": 0.9, "met": true},
                {"what": "something new", "target": 3.0, "measured": 1.5, "met": false}
            ]
        })
    }

    #[test]
    fn a_failed_memory_kind_is_listed_missing_and_targets_become_rows() {
        let doc = document();
        let sections = super::latency(&doc).unwrap();
        assert_eq!(sections.len(), 1);
        let s = &sections[0];
        assert_eq!(
            s.missing,
            ["heap memory, busy-poll: heap memory in poll mode: registration refused"]
        );
        let ids: Vec<&str> = s.figures.iter().map(|f| f.id.as_str()).collect();
        assert_eq!(
            ids,
            [
                "latency-arena-poll",
                "latency-heap-poll",
                "latency-arena-bandwidth",
                "latency-heap-bandwidth"
            ]
        );
        // The arena's latency plot: writes at both sizes, the fetch-add,
        // and the round trip before each write.
        let arena = &s.figures[0];
        assert_eq!(arena.series[0].points, [(8.0, 0.5), (4096.0, 0.8)]);
        assert_eq!(arena.series[1].points, [(8.0, 0.6)]);
        assert_eq!(arena.series[2].role, Role::Limit);
        assert_eq!(arena.series[2].points, [(8.0, 0.1), (4096.0, 0.2)]);
        // The heap's plots have nothing to draw.
        assert!(s.figures[1].series.iter().all(|x| x.points.is_empty()));
        let bandwidth = &s.figures[2];
        assert_eq!(bandwidth.series[0].points, [(1048576.0, 36.0)]);
        assert!(bandwidth
            .series
            .iter()
            .any(|x| x.role == Role::Limit && x.points == [(1048576.0, 40.0)]));

        assert_eq!(s.rows.len(), 4);
        let median = &s.rows[0];
        assert_eq!(median.ours, Some(0.5));
        assert_eq!(median.limit.as_ref().unwrap().value, Some(0.1));
        assert!(median.what.contains("8 B write") && median.what.contains("met"));
        let p99 = &s.rows[1];
        assert_eq!(
            (p99.ours, p99.limit.as_ref().unwrap().value),
            (Some(1.0), Some(0.5))
        );
        let stream = &s.rows[2];
        assert_eq!(stream.ours, Some(36.0));
        assert_eq!(stream.limit.as_ref().unwrap().value, Some(40.0));
        assert!(stream.what.starts_with("1 MiB write stream"));
        assert_eq!(s.rows[3].ours, Some(1.5));
        assert!(s.rows[3].what.contains("missed"));
    }

    #[test]
    fn a_document_without_its_modes_is_an_error_naming_the_path() {
        let mut doc = document();
        doc.as_object_mut().unwrap().remove("modes");
        let err = super::latency(&doc).unwrap_err();
        assert!(err.contains("`modes`"), "{err}");
        // A target whose figure is not in the document names the path.
        let mut doc = document();
        doc["modes"][0]["kinds"][0]["latency"] = json!([]);
        assert!(at(&doc, "targets.0.what").is_ok());
        let err = super::latency(&doc).unwrap_err();
        assert!(
            err.contains("targets.0") && err.contains("write 8"),
            "{err}"
        );
    }
}
