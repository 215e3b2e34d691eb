//! Report sections of the `fabric` program: two device processes joined
//! over UDP, in event and busy-poll modes, against a raw UDP round trip and
//! bulk transfer measured in the same run, with and without injected loss,
//! and the memory the fabric keeps per peer beside ACP's UDP and Tofu
//! layers (ACP basic layer, tables 5 and 6).

use serde_json::Value;

use crate::report::figure::{
    at, list, num, opt_num, text, Axis, BuildError, Figure, Named, Role, Row, Section, Series,
};

/// The modes the program runs, in the order of its document.
const MODES: [&str; 2] = ["event", "poll"];

/// One of ACP's per-peer memory budgets, as the paper prints it.
struct PaperMemory {
    /// Legend and row text.
    name: &'static str,
    /// Where in the paper.
    table: &'static str,
    /// Memory that does not grow with the peers, in bytes (the paper's
    /// "Kbytes" are thousands: 327 Kbytes = 80 bytes x 4,096).
    fixed_bytes: f64,
    /// Memory per peer (rank), in bytes.
    per_peer_bytes: f64,
    /// What the two figures are made of.
    breakdown: &'static str,
}

/// ACP's UDP layer (table 6) and its Tofu layer (table 5), the tables of
/// registered memory (per registration, not per peer) left out.
const PAPER_MEMORY: [PaperMemory; 2] = [
    PaperMemory {
        name: "ACP UDP layer",
        table: "table 6",
        fixed_bytes: 645_000.0,
        per_peer_bytes: 18.0,
        breakdown: "command queue 327 KB + command station 96 KB + delegate station 222 KB; \
                    per peer: address 6 B + sequence numbers 8 B + rank 4 B",
    },
    PaperMemory {
        name: "ACP Tofu layer",
        table: "table 5",
        fixed_bytes: 262_000.0,
        per_peer_bytes: 68.0,
        breakdown: "command queue 262 KB; per peer: command receive buffer 64 B + \
                    Tofu address 4 B",
    },
];

/// Sections of the `fabric` document.
pub fn fabric(doc: &Value) -> Result<Vec<Section>, BuildError> {
    let mut section = Section::new(
        "The fabric: writes across device processes over UDP, and memory per peer",
        "fabric",
    );
    let loss = loss_label(text(doc, "plan.lossy_fault_in").unwrap_or(""));
    let loss = loss.as_str();
    let modes = list(doc, "modes")?;
    let mut latency = Vec::new();
    for (index, expected) in MODES.iter().enumerate() {
        let mode = modes
            .get(index)
            .ok_or_else(|| format!("the document has no `modes.{index}` ({expected})"))?;
        let name = text(mode, "mode").map_err(|e| format!("modes.{index}: {e}"))?;
        if name != *expected {
            return Err(format!("`modes.{index}.mode` is {name}, not {expected}"));
        }
        let m = ModeFigures::read(mode, name, loss).map_err(|e| format!("modes.{index}: {e}"))?;
        latency.extend(m.latency_series());
        section.figures.push(m.bandwidth_figure());
        section.rows.extend(m.rows());
        section.missing.extend(m.missing);
    }
    section.figures.insert(
        0,
        Figure {
            id: "fabric-latency".into(),
            title: "8-byte write across the fabric against a raw UDP round trip".into(),
            reproduces: "no ACP figure (the paper gives no latency); \
                         the limit is the same two hosts' raw UDP round trip"
                .into(),
            x: Axis::linear("percentile of the samples (%)"),
            y: Axis::log("round trip, post to completion (us)"),
            series: latency,
        },
    );
    memory(doc, &mut section)?;
    section.notes.push(format!(
        "Node 0's device writes into a window of node 1's device (two device processes on {}); \
         event mode sleeps on the socket, busy-poll mode (`--poll`) spins, and raw UDP between the \
         same hosts, measured just before, waits the same way. The lossy streams ran with {loss} \
         injected into what each device receives.",
        hosts(doc)
    ));
    section.notes.push(
        "ACP's paper measures no latency or bandwidth, only memory (tables 5 and 6, per rank at 1M \
         ranks); its UDP layer is a library in the rank, ours a device process per host shared by \
         its ranks, so our per-peer figures are per node."
            .into(),
    );
    Ok(vec![section])
}

/// The injected fault as a reader says it: "1 % loss" for `loss=0.01,...`.
fn loss_label(fault: &str) -> String {
    fault
        .split(',')
        .find_map(|part| part.strip_prefix("loss="))
        .and_then(|p| p.parse::<f64>().ok())
        .map_or_else(
            || format!("faults `{fault}`"),
            |p| format!("{} % loss", p * 100.0),
        )
}

/// Where the two devices ran, with the reason when it was not the network
/// namespaces.
fn hosts(doc: &Value) -> String {
    let kind = text(doc, "hosts").unwrap_or("unknown hosts");
    match text(doc, "hosts_detail.fallback_reason") {
        Ok(reason) => format!("{kind}, since {reason}"),
        Err(_) if kind == "netns" => "two network namespaces joined by a veth pair".into(),
        Err(_) => kind.to_string(),
    }
}

/// The percentiles of a summary (`us` or `gb_per_s`): min, median, p99,
/// max.
fn distribution(summary: &Value) -> Result<Vec<(f64, f64)>, BuildError> {
    Ok(vec![
        (0.0, num(summary, "min")?),
        (50.0, num(summary, "median")?),
        (99.0, num(summary, "p99")?),
        (100.0, num(summary, "max")?),
    ])
}

/// What one mode's part of the document gives.
struct ModeFigures {
    mode: String,
    loss: String,
    /// The raw UDP round trip of 8 bytes (its distribution).
    udp_round_trip: Option<Vec<(f64, f64)>>,
    /// The raw UDP bulk transfer, GB/s (median).
    udp_bulk: Option<f64>,
    /// The 8-byte write (its distribution).
    write: Option<Vec<(f64, f64)>>,
    /// `(bytes, GB/s median)` lossless and lossy.
    lossless: Vec<(f64, f64)>,
    lossy: Vec<(f64, f64)>,
    /// Datagrams node 0 sent, and how many of them again, lossless.
    sent_again: Option<(f64, f64)>,
    missing: Vec<String>,
}

impl ModeFigures {
    fn read(mode: &Value, name: &str, loss: &str) -> Result<Self, BuildError> {
        let mut missing = Vec::new();
        if let Ok(reason) = text(mode, "udp_error") {
            missing.push(format!("raw UDP baseline ({name} mode): {reason}"));
        }
        let udp_round_trip = match list(mode, "udp.round_trips") {
            Ok(trips) => trips
                .iter()
                .find(|t| opt_num(t, "payload_bytes") == Some(8.0))
                .map(|t| distribution(at(t, "us")?))
                .transpose()?,
            Err(_) => None,
        };
        let udp_bulk = opt_num(mode, "udp.bulk.gb_per_s.median");
        if udp_round_trip.is_none() && missing.is_empty() {
            missing.push(format!(
                "raw UDP 8-byte round trip ({name} mode): not in the document"
            ));
        }
        if udp_bulk.is_none() && missing.is_empty() {
            missing.push(format!(
                "raw UDP bulk transfer ({name} mode): not in the document"
            ));
        }
        let lossless = at(mode, "lossless")?;
        if let Ok(reason) = text(lossless, "error") {
            missing.push(format!("pindown, {name} mode, lossless: {reason}"));
        }
        let write = match at(lossless, "latency.us") {
            Ok(us) => Some(distribution(us)?),
            Err(_) => None,
        };
        let streams = |pair: &Value| points_or_empty(pair, "bandwidth", "bytes", "gb_per_s.median");
        let lossless_streams = streams(lossless)?;
        let sent_again = match (
            opt_num(lossless, "counters.0.datagrams_sent"),
            opt_num(lossless, "counters.0.retransmissions"),
        ) {
            (Some(sent), Some(again)) => Some((sent, again)),
            _ => None,
        };
        let lossy = match at(mode, "lossy") {
            Ok(Value::Null) | Err(_) => {
                missing.push(format!("pindown, {name} mode, under loss: not run"));
                Vec::new()
            }
            Ok(pair) => {
                if let Ok(reason) = text(pair, "error") {
                    missing.push(format!("pindown, {name} mode, under loss: {reason}"));
                }
                streams(pair)?
            }
        };
        Ok(Self {
            mode: name.to_string(),
            loss: loss.to_string(),
            udp_round_trip,
            udp_bulk,
            write,
            lossless: lossless_streams,
            lossy,
            sent_again,
            missing,
        })
    }

    fn latency_series(&self) -> Vec<Series> {
        vec![
            Series::new(
                format!("pindown 8 B write, {}", self.mode),
                Role::Ours,
                self.write.clone().unwrap_or_default(),
            ),
            Series::new(
                format!("raw UDP 8 B trip, {}", self.mode),
                Role::Limit,
                self.udp_round_trip.clone().unwrap_or_default(),
            ),
        ]
    }

    fn bandwidth_figure(&self) -> Figure {
        // The bulk transfer has no size of its own: a level across the
        // sizes measured.
        let sizes = self.lossless.iter().chain(&self.lossy).map(|p| p.0);
        let first = sizes.clone().fold(f64::INFINITY, f64::min);
        let last = sizes.fold(f64::NEG_INFINITY, f64::max);
        let udp = match self.udp_bulk {
            Some(rate) if first.is_finite() => vec![(first, rate), (last, rate)],
            _ => Vec::new(),
        };
        Figure {
            id: format!("fabric-bandwidth-{}", self.mode),
            title: format!(
                "Streams of writes across the fabric, {} mode (4 in flight)",
                self.mode
            ),
            reproduces: "no ACP figure (the paper gives no bandwidth); \
                         the limit is the same two hosts' raw UDP bulk transfer"
                .into(),
            x: Axis::log("write size (bytes)"),
            y: Axis::linear("bandwidth (GB/s)"),
            series: vec![
                Series::new(
                    "pindown writes, lossless",
                    Role::Ours,
                    self.lossless.clone(),
                ),
                Series::new(
                    format!("pindown writes, {}", self.loss),
                    Role::Ours,
                    self.lossy.clone(),
                ),
                Series::new("raw UDP bulk, 1400 B datagrams", Role::Limit, udp),
            ],
        }
    }

    fn rows(&self) -> Vec<Row> {
        let median = |d: &Option<Vec<(f64, f64)>>| {
            d.as_ref()
                .and_then(|d| d.iter().find(|p| p.0 == 50.0).map(|p| p.1))
        };
        let mut rows = vec![Row {
            what: format!("{}: 8-byte write, post to completion (median)", self.mode),
            unit: "us".into(),
            ours: median(&self.write),
            paper: None,
            peers: Vec::new(),
            limit: Some(Named::new(
                "raw UDP 8 B round trip",
                median(&self.udp_round_trip),
            )),
        }];
        // The largest stream, lossless and under loss.
        if let Some(&(bytes, rate)) = self.lossless.last() {
            rows.push(Row {
                what: format!("{}: {} writes, lossless", self.mode, size(bytes)),
                unit: "GB/s".into(),
                ours: Some(rate),
                paper: None,
                peers: Vec::new(),
                limit: Some(Named::new("raw UDP bulk transfer", self.udp_bulk)),
            });
        }
        if let Some(&(bytes, rate)) = self.lossy.last() {
            let lossless = self.lossless.iter().find(|p| p.0 == bytes).map(|p| p.1);
            rows.push(Row {
                what: format!("{}: {} writes, {}", self.mode, size(bytes), self.loss),
                unit: "GB/s".into(),
                ours: Some(rate),
                paper: None,
                peers: Vec::new(),
                limit: Some(Named::new("the same writes, lossless", lossless)),
            });
        }
        if let Some((sent, again)) = self.sent_again.filter(|s| s.0 > 0.0) {
            rows.push(Row {
                what: format!(
                    "{}: datagrams sent again with no loss injected (node 0)",
                    self.mode
                ),
                unit: "%".into(),
                ours: Some(100.0 * again / sent),
                paper: None,
                peers: Vec::new(),
                limit: None,
            });
        }
        rows
    }
}

/// `(x, y)` points of the array at `path`, or none if the array is
/// absent (a pair that failed before measuring); a malformed item is an
/// error.
fn points_or_empty(
    doc: &Value,
    path: &str,
    x: &str,
    y: &str,
) -> Result<Vec<(f64, f64)>, BuildError> {
    match at(doc, path) {
        Ok(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, item)| {
                Ok((
                    num(item, x).map_err(|e| format!("{path}.{i}: {e}"))?,
                    num(item, y).map_err(|e| format!("{path}.{i}: {e}"))?,
                ))
            })
            .collect(),
        Ok(Value::Null) | Err(_) => Ok(Vec::new()),
        Ok(_) => Err(format!("`{path}` is not an array")),
    }
}

/// A size in bytes as "16 MiB".
fn size(bytes: f64) -> String {
    const KIB: f64 = 1024.0;
    if bytes >= KIB * KIB {
        format!("{} MiB", bytes / (KIB * KIB))
    } else if bytes >= KIB {
        format!("{} KiB", bytes / KIB)
    } else {
        format!("{bytes} B")
    }
}

/// The memory figures and rows.
fn memory(doc: &Value, section: &mut Section) -> Result<(), BuildError> {
    let memory = at(doc, "memory")?;
    if let Ok(reason) = text(memory, "error") {
        section
            .missing
            .push(format!("memory figures of pindown: {reason}"));
    }
    let endpoint = match at(memory, "endpoint") {
        Ok(Value::Array(items)) => items.as_slice(),
        _ => &[],
    };
    let mut accounted = Vec::new();
    let mut heap = Vec::new();
    let mut accounted_per_peer = Vec::new();
    let mut heap_per_peer = Vec::new();
    for (i, e) in endpoint.iter().enumerate() {
        let field = |key: &str| num(e, key).map_err(|err| format!("memory.endpoint.{i}: {err}"));
        let peers = field("peers")?;
        accounted.push((peers, field("total_bytes")?));
        heap.push((
            peers,
            field("heap_fixed_bytes")? + field("heap_per_peer_bytes")? * peers,
        ));
        accounted_per_peer.push((peers, field("per_peer_bytes")?));
        heap_per_peer.push((peers, field("heap_per_peer_bytes")?));
    }
    let device_per_peer = opt_num(memory, "device_rss_per_peer_bytes");
    let peer_counts: Vec<f64> = accounted.iter().map(|p| p.0).collect();
    let paper_total = |p: &PaperMemory| {
        peer_counts
            .iter()
            .map(|&n| (n, p.fixed_bytes + p.per_peer_bytes * n))
            .collect::<Vec<_>>()
    };
    let paper_per_peer = |p: &PaperMemory| {
        peer_counts
            .iter()
            .map(|&n| (n, p.per_peer_bytes))
            .collect::<Vec<_>>()
    };
    let mut total_series = vec![
        Series::new("pindown, own accounting", Role::Ours, accounted),
        Series::new("pindown, heap (allocator)", Role::Ours, heap),
    ];
    let mut per_peer_series = vec![
        Series::new("pindown, own accounting", Role::Ours, accounted_per_peer),
        Series::new("pindown, heap (allocator)", Role::Ours, heap_per_peer),
    ];
    for p in &PAPER_MEMORY {
        total_series.push(Series::new(
            format!("{} ({})", p.name, p.table),
            Role::Paper,
            paper_total(p),
        ));
        per_peer_series.push(Series::new(
            format!("{} ({})", p.name, p.table),
            Role::Paper,
            paper_per_peer(p),
        ));
    }
    section.figures.push(Figure {
        id: "fabric-memory".into(),
        title: "Fabric endpoint memory of one device against its peers".into(),
        reproduces: "ACP, tables 5 and 6 (memory of the Tofu and UDP layers)".into(),
        x: Axis::log("fabric peers"),
        y: Axis::linear("memory (bytes)"),
        series: total_series,
    });
    section.figures.push(Figure {
        id: "fabric-memory-per-peer".into(),
        title: "Fabric memory per peer".into(),
        reproduces: "ACP, tables 5 and 6 (bytes per rank)".into(),
        x: Axis::log("fabric peers"),
        y: Axis::linear("memory per peer (bytes)"),
        series: per_peer_series,
    });

    let [udp, tofu] = &PAPER_MEMORY;
    let paper_per_peer_text = format!(
        "{} B per peer, {} ({}; {}); {} B per rank, {} ({})",
        udp.per_peer_bytes,
        udp.name,
        udp.table,
        udp.breakdown.split("; per peer: ").nth(1).unwrap_or(""),
        tofu.per_peer_bytes,
        tofu.name,
        tofu.table
    );
    let kb = |b: f64| b / 1000.0;
    let paper_fixed_text = format!(
        "{} KB, {} ({}; {}); {} KB, {} ({})",
        kb(udp.fixed_bytes),
        udp.name,
        udp.table,
        udp.breakdown.split("; per peer: ").next().unwrap_or(""),
        kb(tofu.fixed_bytes),
        tofu.name,
        tofu.table
    );
    let last = endpoint.len().checked_sub(1);
    let at_most = |key: &str| last.and_then(|i| opt_num(memory, &format!("endpoint.{i}.{key}")));
    section.rows.push(Row {
        what: "endpoint state per peer (its own accounting)".into(),
        unit: "B".into(),
        ours: at_most("per_peer_bytes"),
        paper: Some(paper_per_peer_text),
        peers: Vec::new(),
        limit: None,
    });
    section.rows.push(Row {
        what: format!(
            "endpoint heap per peer, counted by the allocator ({} peers)",
            at_most("peers").map_or_else(|| "most".to_string(), |n| n.to_string())
        ),
        unit: "B".into(),
        ours: at_most("heap_per_peer_bytes"),
        paper: None,
        peers: Vec::new(),
        limit: None,
    });
    section.rows.push(Row {
        what: "endpoint memory that does not grow with peers".into(),
        unit: "B".into(),
        ours: at_most("fixed_bytes"),
        paper: Some(paper_fixed_text),
        peers: Vec::new(),
        limit: None,
    });
    let link_buffers = at(memory, "device_rss").ok().and_then(|rows| {
        rows.as_array()?
            .iter()
            .find(|row| row["peers"].as_u64().is_some_and(|p| p > 0))?["link_memory_buffers"]
            .as_f64()
    });
    section.rows.push(Row {
        what: "link datagram buffers, fixed (beside the endpoint's memory)".into(),
        unit: "B".into(),
        ours: link_buffers,
        paper: None,
        peers: Vec::new(),
        limit: None,
    });
    section.rows.push(Row {
        what: "device process resident memory per peer (an upper bound)".into(),
        unit: "B".into(),
        ours: device_per_peer,
        paper: None,
        peers: Vec::new(),
        limit: None,
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn summary(median: f64) -> Value {
        json!({"samples": 3, "min": median * 0.9, "median": median, "p99": median * 1.5,
               "mean": median, "max": median * 2.0})
    }

    /// One mode; its UDP baseline failed and the lossy pair did not run.
    fn mode(name: &str) -> Value {
        json!({
            "mode": name,
            "udp": {"wait": "block", "round_trips": [], "bulk": null},
            "udp_error": "bind: address in use",
            "lossless": {
                "latency": {"bytes": 8, "us": summary(40.0)},
                "bandwidth": [
                    {"bytes": 4096, "gb_per_s": summary(0.05)},
                    {"bytes": 1048576, "gb_per_s": summary(0.25)}
                ],
                "counters": [{"datagrams_sent": 200, "retransmissions": 5}],
                "error": null
            },
            "lossy": null
        })
    }

    fn document() -> Value {
        json!({
            "program": "fabric",
            "hosts": "loopback",
            "hosts_detail": {"kind": "loopback", "fallback_reason": "not root"},
            "plan": {"lossy_fault_in": "loss=0.01,seed=7"},
            "modes": [mode("event"), mode("poll")],
            "memory": {
                "endpoint": [
                    {"peers": 2, "fixed_bytes": 1000, "per_peer_bytes": 64, "total_bytes": 1128,
                     "heap_fixed_bytes": 900, "heap_per_peer_bytes": 70.0}
                ],
                "device_rss": [{"peers": 0, "rss_bytes": 4000000}],
                "device_rss_per_peer_bytes": null,
                "error": null
            }
        })
    }

    #[test]
    fn a_missing_baseline_is_listed_and_its_value_is_none() {
        let sections = fabric(&document()).unwrap();
        let section = &sections[0];
        for name in MODES {
            assert!(
                section.missing.iter().any(|m| m.contains("raw UDP")
                    && m.contains(name)
                    && m.contains("bind: address in use")),
                "{:?}",
                section.missing
            );
            assert!(section
                .missing
                .iter()
                .any(|m| m.contains(&format!("{name} mode, under loss: not run"))));
        }
        let latency = section
            .rows
            .iter()
            .find(|r| r.what.starts_with("event: 8-byte write"))
            .unwrap();
        assert_eq!(latency.ours, Some(40.0));
        assert_eq!(latency.limit.as_ref().unwrap().value, None);
        let stream = section
            .rows
            .iter()
            .find(|r| r.what == "event: 1 MiB writes, lossless")
            .unwrap();
        assert_eq!(stream.ours, Some(0.25));
        assert_eq!(stream.limit.as_ref().unwrap().value, None);
        let again = section
            .rows
            .iter()
            .find(|r| r.what.starts_with("poll: datagrams sent again"))
            .unwrap();
        assert_eq!(again.ours, Some(100.0 * 5.0 / 200.0));
        // The resident memory per peer was not measured: shown as missing.
        let rss = section
            .rows
            .iter()
            .find(|r| r.what.starts_with("device process resident memory"))
            .unwrap();
        assert_eq!(rss.ours, None);
        assert!(section.notes[0].contains("not root"));
    }

    #[test]
    fn paper_points_follow_the_measured_peer_counts() {
        let sections = fabric(&document()).unwrap();
        let memory = sections[0]
            .figures
            .iter()
            .find(|f| f.id == "fabric-memory")
            .unwrap();
        let udp = memory
            .series
            .iter()
            .find(|s| s.role == Role::Paper && s.name.contains("UDP"))
            .unwrap();
        let p = &PAPER_MEMORY[0];
        assert_eq!(
            udp.points,
            vec![(2.0, p.fixed_bytes + 2.0 * p.per_peer_bytes)]
        );
        let ours = memory.series.iter().find(|s| s.role == Role::Ours).unwrap();
        assert_eq!(ours.points, vec![(2.0, 1128.0)]);
    }

    #[test]
    fn a_malformed_document_names_the_path() {
        let mut doc = document();
        doc["modes"][1]["mode"] = json!("event");
        assert!(fabric(&doc).unwrap_err().contains("modes.1"));
        let mut doc = document();
        doc["modes"][0]["lossless"]["bandwidth"][1]["bytes"] = json!("big");
        let err = fabric(&doc).unwrap_err();
        assert!(err.contains("bandwidth.1"), "{err}");
        let mut doc = document();
        doc["memory"]["endpoint"][0]
            .as_object_mut()
            .unwrap()
            .remove("total_bytes");
        assert!(fabric(&doc).unwrap_err().contains("total_bytes"));
    }
}
