//! Report sections of the `messaging` programs: `fmpl` (FMPL's figure 7,
//! table 2 and collectives, seed paper 001) and `gasnet` (GASNet/TCA's
//! figures 7-10, the Himeno run and the descriptor cache, seed paper 002),
//! each beside Open MPI and MPICH measured in the same run and the raw
//! RDMA write ping-pong (and for `fmpl` the cache-line ping-pong) as the
//! limit.

use serde_json::Value;

use crate::report::figure::{
    list, num, opt_num, text, Axis, BuildError, Figure, Named, Role, Row, Section, Series,
};

/// Numbers printed in the papers (not measured here), each with where it
/// is printed.
mod paper {
    /// FMPL section 6.1: 8-byte one-way latency of FMPL on the Hitachi
    /// SR8000 (us).
    pub const FMPL_8B_ONE_WAY_US: f64 = 12.8;
    /// FMPL section 6.1: the same for Hitachi's MPI (us).
    pub const HITACHI_MPI_8B_ONE_WAY_US: f64 = 20.0;
    /// FMPL figure 7 text: the size its bandwidths are quoted at (16 MB).
    pub const FMPL_BANDWIDTH_BYTES: f64 = 16.0 * 1024.0 * 1024.0;
    /// FMPL figure 7 text: FMPL's bandwidth at 16 MB (999 MB/s, in GB/s).
    pub const FMPL_16MB_GBS: f64 = 0.999;
    /// FMPL figure 7 text: Hitachi MPI with a copy each side (nordma) at
    /// 16 MB (791 MB/s, in GB/s).
    pub const HITACHI_MPI_COPYING_16MB_GBS: f64 = 0.791;
    /// FMPL table 2: receives posted ahead.
    pub const TABLE2_POSTED: f64 = 600.0;
    /// FMPL table 2: gap between posted receives, FMPL (us).
    pub const TABLE2_FMPL_POST_GAP_US: f64 = 7.03;
    /// FMPL table 2: gap between posted receives, Hitachi MPI (us).
    pub const TABLE2_MPI_POST_GAP_US: f64 = 370.1;
    /// FMPL table 2: 4-byte send latency, FMPL (us).
    pub const TABLE2_FMPL_LATENCY_US: f64 = 9.90;
    /// FMPL table 2: 4-byte send latency, Hitachi MPI (us).
    pub const TABLE2_MPI_LATENCY_US: f64 = 945.8;
    /// FMPL figure 10 text: hardware broadcast bandwidth on 16 nodes at
    /// 8 MB (877 MB/s).
    pub const FMPL_BCAST_8MB_16_NODES: &str = "877 MB/s at 8 MB on 16 nodes (hardware broadcast), FMPL figure 10; figures 8, 9 and 11 give no numbers in the text";

    /// GASNet/TCA figure 7: minimum GPU-to-GPU long-AM latency (us).
    pub const GASNET_TCA_MIN_LATENCY_US: f64 = 2.3;
    /// GASNet/TCA figure 7: minimum GPU-to-GPU latency, MPI over
    /// InfiniBand (us).
    pub const MPI_IB_MIN_LATENCY_US: f64 = 2.1;
    /// GASNet/TCA figure 7: minimum GPU-to-CPU get latency (us).
    pub const GASNET_TCA_GET_MIN_LATENCY_US: f64 = 3.5;
}

/// The two MPIs, as the documents name them and as the report does.
const MPIS: [(&str, &str); 2] = [("openmpi", "Open MPI"), ("mpich", "MPICH")];

/// One MPI of a document: its figures, or why it was not measured.
struct Peer<'a> {
    /// The document's key (`openmpi`).
    key: &'static str,
    /// The report's name (`Open MPI`).
    name: &'static str,
    /// `mpi.<key>`, if the MPI ran.
    doc: Option<&'a Value>,
}

impl Peer<'_> {
    /// The peer's list `key` (empty when the peer did not run).
    fn items(&self, key: &str) -> Result<&[Value], BuildError> {
        match self.doc {
            Some(doc) => list(doc, key).map_err(|e| format!("mpi.{}: {e}", self.key)),
            None => Ok(&[]),
        }
    }
}

/// The MPIs of `doc`; each one absent from `mpi` goes to `missing` with
/// the reason the document's notes give.
fn peers<'a>(doc: &'a Value, missing: &mut Vec<String>) -> Result<Vec<Peer<'a>>, BuildError> {
    let notes = list(doc, "notes")?;
    let mut peers = Vec::new();
    for (key, name) in MPIS {
        let found = doc.get("mpi").and_then(|m| m.get(key));
        if found.is_none() {
            let prefix = format!("{key} not measured");
            let reason = notes
                .iter()
                .filter_map(Value::as_str)
                .find(|n| n.starts_with(&prefix))
                .map_or_else(
                    || format!("{name}: not in the document (no `mpi.{key}`)"),
                    |n| format!("{name}: {n}"),
                );
            missing.push(reason);
        }
        peers.push(Peer {
            key,
            name,
            doc: found,
        });
    }
    Ok(peers)
}

/// The items of `items` whose `key` is the string `value`.
fn with<'a>(items: &[&'a Value], key: &str, value: &str) -> Vec<&'a Value> {
    items
        .iter()
        .copied()
        .filter(|i| i.get(key).and_then(Value::as_str) == Some(value))
        .collect()
}

/// The items of `items` whose `key` is the number `value`.
fn with_num<'a>(items: &[&'a Value], key: &str, value: f64) -> Vec<&'a Value> {
    items
        .iter()
        .copied()
        .filter(|i| opt_num(i, key) == Some(value))
        .collect()
}

/// A condition on one field of an item.
#[derive(Clone, Copy)]
enum Is<'s> {
    /// The field is this number.
    Num(f64),
    /// The field is this string.
    Text(&'s str),
}

/// The items of `items` meeting every condition.
fn pick<'a>(items: &[&'a Value], conditions: &[(&str, Is)]) -> Vec<&'a Value> {
    items
        .iter()
        .copied()
        .filter(|item| {
            conditions.iter().all(|&(key, is)| match is {
                Is::Num(v) => opt_num(item, key) == Some(v),
                Is::Text(t) => item.get(key).and_then(Value::as_str) == Some(t),
            })
        })
        .collect()
}

/// `key` of the first item meeting `conditions`, `None` if there is none.
fn first(
    items: &[&Value],
    conditions: &[(&str, Is)],
    key: &str,
) -> Result<Option<f64>, BuildError> {
    match pick(items, conditions).first() {
        Some(item) => num(item, key).map(Some),
        None => Ok(None),
    }
}

/// Each peer's `key` of the first item of its list `list` meeting
/// `conditions` (`None` for a peer that did not run or lacks the point).
fn peer_values(
    peers: &[Peer],
    list: &str,
    conditions: &[(&str, Is)],
    key: &str,
) -> Result<Vec<Named>, BuildError> {
    peers
        .iter()
        .map(|p| {
            Ok(Named::new(
                p.name,
                first(&all(p.items(list)?), conditions, key)?,
            ))
        })
        .collect()
}

/// Each peer's largest `key` over its list `list` meeting `conditions`.
fn peer_maxima(
    peers: &[Peer],
    list: &str,
    conditions: &[(&str, Is)],
    key: &str,
) -> Result<Vec<Named>, BuildError> {
    peers
        .iter()
        .map(|p| {
            Ok(Named::new(
                p.name,
                max_of(&pick(&all(p.items(list)?), conditions), key)?,
            ))
        })
        .collect()
}

/// `(x, y)` of every item, `y` scaled by `scale`.
fn xy(items: &[&Value], x: &str, y: &str, scale: f64) -> Result<Vec<(f64, f64)>, BuildError> {
    let mut points = items
        .iter()
        .map(|i| Ok((num(i, x)?, num(i, y)? * scale)))
        .collect::<Result<Vec<_>, BuildError>>()?;
    points.sort_by(|a, b| a.0.total_cmp(&b.0));
    Ok(points)
}

/// `y` of the item whose `x` is `at`.
fn y_at(items: &[&Value], x: &str, at: f64, y: &str) -> Result<Option<f64>, BuildError> {
    match items.iter().find(|i| opt_num(i, x) == Some(at)) {
        Some(item) => num(item, y).map(Some),
        None => Ok(None),
    }
}

/// The largest `y` over `items`.
fn max_of(items: &[&Value], y: &str) -> Result<Option<f64>, BuildError> {
    let mut best: Option<f64> = None;
    for item in items {
        let v = num(item, y)?;
        best = Some(best.map_or(v, |b: f64| b.max(v)));
    }
    Ok(best)
}

/// `bytes` as "8 B", "64 KiB", "16 MiB".
fn size(bytes: f64) -> String {
    let b = bytes as u64;
    if b >= 1 << 20 && b.is_multiple_of(1 << 20) {
        format!("{} MiB", b >> 20)
    } else if b >= 1 << 10 && b.is_multiple_of(1 << 10) {
        format!("{} KiB", b >> 10)
    } else {
        format!("{b} B")
    }
}

fn all(items: &[Value]) -> Vec<&Value> {
    items.iter().collect()
}

fn row(what: impl Into<String>, unit: &str, ours: Option<f64>) -> Row {
    Row {
        what: what.into(),
        unit: unit.to_string(),
        ours,
        paper: None,
        peers: Vec::new(),
        limit: None,
    }
}

fn figure(id: &str, title: &str, reproduces: &str, x: Axis, y: Axis) -> Figure {
    Figure {
        id: id.to_string(),
        title: title.to_string(),
        reproduces: reproduces.to_string(),
        x,
        y,
        series: Vec::new(),
    }
}

/// Sections of the `fmpl` document.
pub fn fmpl(doc: &Value) -> Result<Vec<Section>, BuildError> {
    let mut section = Section::new("FMPL: ping-pong, table 2 and collectives", "fmpl");
    let peers = peers(doc, &mut section.missing)?;
    let pingpong = all(list(doc, "pindown.pingpong")?);
    let preposted = all(list(doc, "pindown.preposted")?);
    let collectives = all(list(doc, "pindown.collectives")?);
    let cache_line_one_way = num(doc, "cache_line_round_trip_us")? / 2.0;
    if pingpong.is_empty() {
        return Err("`pindown.pingpong` is empty".to_string());
    }
    let sizes = pingpong
        .iter()
        .map(|p| num(p, "bytes"))
        .collect::<Result<Vec<_>, _>>()?;
    let smallest = sizes.iter().copied().fold(f64::INFINITY, f64::min);
    let largest = sizes.iter().copied().fold(0.0, f64::max);

    // Figure 7, latency.
    let mut latency = figure(
        "fmpl-fig7-latency",
        "Ping-pong one-way latency by message size",
        "FMPL, figure 7 (latency from the same ping-pong) and section 6.1",
        Axis::log("message size (bytes)"),
        Axis::log("one-way latency (us)"),
    );
    latency.series.push(Series::new(
        "pindown (receives posted ahead)",
        Role::Ours,
        xy(&pingpong, "bytes", "one_way_us", 1.0)?,
    ));
    latency.series.push(Series::new(
        "raw RDMA write ping-pong (limit)",
        Role::Limit,
        xy(&pingpong, "bytes", "rdma_write_one_way_us", 1.0)?,
    ));
    latency.series.push(Series::new(
        "cache-line ping-pong (limit)",
        Role::Limit,
        vec![(smallest, cache_line_one_way), (64.0, cache_line_one_way)],
    ));
    for peer in &peers {
        let items = all(peer.items("pingpong")?);
        latency.series.push(Series::new(
            format!("{} MPI_Send/MPI_Recv", peer.name),
            Role::Peer,
            xy(&items, "bytes", "one_way_us", 1.0)?,
        ));
    }
    latency.series.push(Series::new(
        "FMPL, SR8000 (paper)",
        Role::Paper,
        vec![(8.0, paper::FMPL_8B_ONE_WAY_US)],
    ));
    latency.series.push(Series::new(
        "Hitachi MPI, SR8000 (paper)",
        Role::Paper,
        vec![(8.0, paper::HITACHI_MPI_8B_ONE_WAY_US)],
    ));
    section.figures.push(latency);

    // Figure 7, bandwidth.
    let mut bandwidth = figure(
        "fmpl-fig7-bandwidth",
        "Ping-pong bandwidth by message size",
        "FMPL, figure 7",
        Axis::log("message size (bytes)"),
        Axis::log("bandwidth (GB/s, 10^9 B/s)"),
    );
    bandwidth.series.push(Series::new(
        "pindown (receives posted ahead)",
        Role::Ours,
        xy(&pingpong, "bytes", "bandwidth_gbs", 1.0)?,
    ));
    bandwidth.series.push(Series::new(
        "raw RDMA write ping-pong (limit)",
        Role::Limit,
        xy(&pingpong, "bytes", "rdma_write_bandwidth_gbs", 1.0)?,
    ));
    for peer in &peers {
        let items = all(peer.items("pingpong")?);
        bandwidth.series.push(Series::new(
            format!("{} MPI_Send/MPI_Recv", peer.name),
            Role::Peer,
            xy(&items, "bytes", "bandwidth_gbs", 1.0)?,
        ));
    }
    bandwidth.series.push(Series::new(
        "FMPL, SR8000 (paper)",
        Role::Paper,
        vec![(paper::FMPL_BANDWIDTH_BYTES, paper::FMPL_16MB_GBS)],
    ));
    bandwidth.series.push(Series::new(
        "Hitachi MPI copying (paper)",
        Role::Paper,
        vec![(
            paper::FMPL_BANDWIDTH_BYTES,
            paper::HITACHI_MPI_COPYING_16MB_GBS,
        )],
    ));
    section.figures.push(bandwidth);

    // Table 2: posting gap and latency with 1 and 600 receives posted.
    for (id, title, key, paper_fmpl, paper_mpi) in [
        (
            "fmpl-table2-post-gap",
            "Time per receive posted ahead, by receives posted",
            "post_gap_us",
            paper::TABLE2_FMPL_POST_GAP_US,
            paper::TABLE2_MPI_POST_GAP_US,
        ),
        (
            "fmpl-table2-latency",
            "Send latency with receives posted ahead",
            "latency_us",
            paper::TABLE2_FMPL_LATENCY_US,
            paper::TABLE2_MPI_LATENCY_US,
        ),
    ] {
        let mut f = figure(
            id,
            title,
            "FMPL, table 2",
            Axis::log("receives posted ahead"),
            Axis::log(if key == "latency_us" {
                "one-way latency of one 8-byte send (us)"
            } else {
                "gap between posted receives (us)"
            }),
        );
        f.series.push(Series::new(
            "pindown",
            Role::Ours,
            xy(&preposted, "posted", key, 1.0)?,
        ));
        for peer in &peers {
            let items = all(peer.items("preposted")?);
            f.series.push(Series::new(
                format!("{} (reverse order)", peer.name),
                Role::Peer,
                xy(&items, "posted", key, 1.0)?,
            ));
        }
        if key == "latency_us" {
            f.series.push(Series::new(
                "cache-line ping-pong (limit)",
                Role::Limit,
                preposted
                    .iter()
                    .map(|p| Ok((num(p, "posted")?, cache_line_one_way)))
                    .collect::<Result<Vec<_>, BuildError>>()?,
            ));
        }
        f.series.push(Series::new(
            "FMPL, SR8000, 4 B (paper)",
            Role::Paper,
            vec![(paper::TABLE2_POSTED, paper_fmpl)],
        ));
        f.series.push(Series::new(
            "Hitachi MPI, 4 B (paper)",
            Role::Paper,
            vec![(paper::TABLE2_POSTED, paper_mpi)],
        ));
        section.figures.push(f);
    }

    // Collectives.
    let barrier = with(&collectives, "test", "barrier");
    let mut by_ranks = figure(
        "fmpl-barrier",
        "Barrier by ranks (2 cores: above 2 ranks oversubscribed)",
        "FMPL, figure 8 (barrier synchronisation)",
        Axis::log("ranks"),
        Axis::log("time per barrier, slowest rank (us)"),
    );
    by_ranks.series.push(Series::new(
        "pindown",
        Role::Ours,
        xy(&barrier, "ranks", "time_us", 1.0)?,
    ));
    by_ranks.series.push(Series::new(
        "cache-line round trip (limit)",
        Role::Limit,
        vec![(2.0, 2.0 * cache_line_one_way)],
    ));
    let mut peer_collectives = Vec::new();
    for peer in &peers {
        let items = peer.items("collectives")?;
        by_ranks.series.push(Series::new(
            peer.name,
            Role::Peer,
            xy(
                &with(&all(items), "test", "barrier"),
                "ranks",
                "time_us",
                1.0,
            )?,
        ));
        peer_collectives.push(items);
    }
    section.figures.push(by_ranks);

    for (test, id, title, reproduces) in [
        (
            "bcast",
            "fmpl-bcast",
            "Broadcast on 2 ranks by size",
            "FMPL, figures 9-10 (broadcast; the paper varies nodes at 8 KB)",
        ),
        (
            "allreduce",
            "fmpl-allreduce",
            "Allreduce (sum of doubles) on 2 ranks by size",
            "FMPL, figure 11 (reduction; the paper varies nodes at 8 KB)",
        ),
    ] {
        let ours = with_num(&with(&collectives, "test", test), "ranks", 2.0);
        let mut f = figure(
            id,
            title,
            reproduces,
            Axis::log("message size (bytes)"),
            Axis::log("time per call, slowest rank (us)"),
        );
        f.series.push(Series::new(
            "pindown",
            Role::Ours,
            xy(&ours, "bytes", "time_us", 1.0)?,
        ));
        f.series.push(Series::new(
            "raw RDMA write one way (limit)",
            Role::Limit,
            xy(&pingpong, "bytes", "rdma_write_one_way_us", 1.0)?,
        ));
        for (peer, items) in peers.iter().zip(&peer_collectives) {
            let theirs = with_num(&with(&all(items), "test", test), "ranks", 2.0);
            f.series.push(Series::new(
                peer.name,
                Role::Peer,
                xy(&theirs, "bytes", "time_us", 1.0)?,
            ));
        }
        section.figures.push(f);
    }

    // Rows.
    let mut r = row(
        format!("{} one-way latency", size(smallest)),
        "us",
        y_at(&pingpong, "bytes", smallest, "one_way_us")?,
    );
    r.limit = Some(Named::new(
        "raw RDMA write ping-pong",
        y_at(&pingpong, "bytes", smallest, "rdma_write_one_way_us")?,
    ));
    r.peers = peer_values(
        &peers,
        "pingpong",
        &[("bytes", Is::Num(smallest))],
        "one_way_us",
    )?;
    r.paper = Some(format!(
        "{} us FMPL, {} us Hitachi MPI, 8 B on Hitachi SR8000, FMPL section 6.1",
        paper::FMPL_8B_ONE_WAY_US,
        paper::HITACHI_MPI_8B_ONE_WAY_US
    ));
    section.rows.push(r);

    let mut r = row(
        format!("{} one-way latency against a cache line", size(smallest)),
        "us",
        y_at(&pingpong, "bytes", smallest, "one_way_us")?,
    );
    r.limit = Some(Named::new(
        "cache-line ping-pong, one way",
        Some(cache_line_one_way),
    ));
    section.rows.push(r);

    let mut r = row(
        format!("bandwidth at {}", size(largest)),
        "GB/s",
        y_at(&pingpong, "bytes", largest, "bandwidth_gbs")?,
    );
    r.limit = Some(Named::new(
        "raw RDMA write ping-pong",
        y_at(&pingpong, "bytes", largest, "rdma_write_bandwidth_gbs")?,
    ));
    r.peers = peer_values(
        &peers,
        "pingpong",
        &[("bytes", Is::Num(largest))],
        "bandwidth_gbs",
    )?;
    r.paper = Some(format!(
        "{} GB/s FMPL at 16 MB (Hitachi MPI 0.997 zero-copy, {} copying; link 1.0), FMPL figure 7",
        paper::FMPL_16MB_GBS,
        paper::HITACHI_MPI_COPYING_16MB_GBS
    ));
    section.rows.push(r);

    let mut r = row(
        "peak ping-pong bandwidth over sizes",
        "GB/s",
        max_of(&pingpong, "bandwidth_gbs")?,
    );
    r.limit = Some(Named::new(
        "raw RDMA write ping-pong",
        max_of(&pingpong, "rdma_write_bandwidth_gbs")?,
    ));
    r.peers = peer_maxima(&peers, "pingpong", &[], "bandwidth_gbs")?;
    section.rows.push(r);

    for (what, key, paper_text) in [
        (
            "gap between receives posted ahead, 600 posted",
            "post_gap_us",
            format!(
                "{} us FMPL, {} us Hitachi MPI, FMPL table 2",
                paper::TABLE2_FMPL_POST_GAP_US,
                paper::TABLE2_MPI_POST_GAP_US
            ),
        ),
        (
            "8-byte send latency, 600 posted",
            "latency_us",
            format!(
                "{} us FMPL, {} us Hitachi MPI (4 B), FMPL table 2",
                paper::TABLE2_FMPL_LATENCY_US,
                paper::TABLE2_MPI_LATENCY_US
            ),
        ),
        (
            "gap between 8-byte sends, 600 posted",
            "send_gap_us",
            "not in the paper (the issue's target: within 1.2x of the gap with 1 posted)"
                .to_string(),
        ),
    ] {
        let mut r = row(
            what,
            "us",
            y_at(&preposted, "posted", paper::TABLE2_POSTED, key)?,
        );
        if key == "latency_us" {
            r.limit = Some(Named::new(
                "cache-line ping-pong, one way",
                Some(cache_line_one_way),
            ));
        }
        r.peers = peer_values(
            &peers,
            "preposted",
            &[("posted", Is::Num(paper::TABLE2_POSTED))],
            key,
        )?;
        r.paper = Some(paper_text);
        section.rows.push(r);
    }

    let mut r = row(
        "barrier on 2 ranks",
        "us",
        y_at(&barrier, "ranks", 2.0, "time_us")?,
    );
    r.limit = Some(Named::new(
        "cache-line round trip",
        Some(2.0 * cache_line_one_way),
    ));
    r.peers = peer_values(
        &peers,
        "collectives",
        &[("test", Is::Text("barrier")), ("ranks", Is::Num(2.0))],
        "time_us",
    )?;
    r.paper = Some("figure 8 gives no number in the text (SR8000 hardware barrier)".to_string());
    section.rows.push(r);

    let mib = 1024.0 * 1024.0;
    let bcast_2 = with_num(&with(&collectives, "test", "bcast"), "ranks", 2.0);
    let mut r = row(
        "broadcast of 1 MiB on 2 ranks",
        "us",
        y_at(&bcast_2, "bytes", mib, "time_us")?,
    );
    r.limit = Some(Named::new(
        "raw RDMA write one way",
        y_at(&pingpong, "bytes", mib, "rdma_write_one_way_us")?,
    ));
    r.peers = peer_values(
        &peers,
        "collectives",
        &[
            ("test", Is::Text("bcast")),
            ("ranks", Is::Num(2.0)),
            ("bytes", Is::Num(mib)),
        ],
        "time_us",
    )?;
    r.paper = Some(paper::FMPL_BCAST_8MB_16_NODES.to_string());
    section.rows.push(r);

    section.notes.push(
        "Two ranks on one emulated NIC of a 2-core machine against FMPL on 16 nodes of a Hitachi \
         SR8000 (1 GB/s links): the MPIs here move data through shared memory, so the raw RDMA \
         write ping-pong of the same run is the limit that matters for pindown."
            .to_string(),
    );
    section.notes.push(
        "Table 2 is measured with 8-byte messages (the paper: 4 bytes) and sends in reverse order of \
         posting, so a receiver-side queue is searched to its end; collectives above 2 ranks are \
         oversubscribed on 2 cores."
            .to_string(),
    );
    for note in list(doc, "notes")? {
        let note = note.as_str().ok_or("`notes` holds a non-string")?;
        if !MPIS
            .iter()
            .any(|(key, _)| note.starts_with(&format!("{key} not measured")))
        {
            section.notes.push(note.to_string());
        }
    }
    Ok(vec![section])
}

/// The halo faces of the `gasnet` document, as the paper names them.
const FACES: [(&str, &str); 3] = [
    ("block", "block"),
    ("blockstride", "block-stride"),
    ("stride", "stride"),
];

/// A peer's halo points of `face`: for each N the better (smaller time,
/// larger bandwidth) of its `MPI_Type_vector` and subarray figures.
fn best_halo(items: &[&Value], face: &str, key: &str) -> Result<Vec<(f64, f64)>, BuildError> {
    let mut points: Vec<(f64, f64)> = Vec::new();
    for item in pick(items, &[("face", Is::Text(face))]) {
        let (n, v) = (num(item, "n")?, num(item, key)?);
        match points.iter_mut().find(|(x, _)| *x == n) {
            Some(point) if key == "time_us" => point.1 = point.1.min(v),
            Some(point) => point.1 = point.1.max(v),
            None => points.push((n, v)),
        }
    }
    points.sort_by(|a, b| a.0.total_cmp(&b.0));
    Ok(points)
}

/// The raw RDMA write ping-pong's `key` at each halo N whose face size
/// (`bytes` of the halo figure) it measured.
fn halo_limit(
    halo: &[&Value],
    raw: &[&Value],
    face: &str,
    key: &str,
) -> Result<Vec<(f64, f64)>, BuildError> {
    let mut points = Vec::new();
    for item in pick(halo, &[("face", Is::Text(face))]) {
        if let Some(v) = first(raw, &[("bytes", Is::Num(num(item, "bytes")?))], key)? {
            points.push((num(item, "n")?, v));
        }
    }
    points.sort_by(|a, b| a.0.total_cmp(&b.0));
    Ok(points)
}

/// Sections of the `gasnet` document.
pub fn gasnet(doc: &Value) -> Result<Vec<Section>, BuildError> {
    let mut section = Section::new(
        "GASNet/TCA: active messages, get, halo exchange, Himeno and the descriptor cache",
        "gasnet",
    );
    let peers = peers(doc, &mut section.missing)?;
    let am = all(list(doc, "pindown.am_pingpong")?);
    let raw = all(list(doc, "pindown.rdma_write_pingpong")?);
    let get_native = all(list(doc, "pindown.get_native")?);
    let get_by_message = match doc.get("pindown").and_then(|p| p.get("get_by_message")) {
        Some(_) => all(list(doc, "pindown.get_by_message")?),
        None => {
            section.missing.push(
                "pindown get by message: not in the document (no `pindown.get_by_message`)"
                    .to_string(),
            );
            Vec::new()
        }
    };
    let halo = all(list(doc, "pindown.halo")?);
    let himeno = all(list(doc, "pindown.himeno")?);
    let repeated = all(list(doc, "pindown.repeated_puts")?);
    let short_round_trip = num(doc, "pindown.am_short_round_trip.0.round_trip_us")?;
    if am.is_empty() || raw.is_empty() {
        return Err("`pindown.am_pingpong` or `pindown.rdma_write_pingpong` is empty".to_string());
    }
    let sizes = am
        .iter()
        .map(|p| num(p, "bytes"))
        .collect::<Result<Vec<_>, _>>()?;
    let smallest = sizes.iter().copied().fold(f64::INFINITY, f64::min);

    // Figures 7 and 8: long-AM ping-pong.
    for (id, title, reproduces, key, y) in [
        (
            "gasnet-fig7-am-latency",
            "Long active message ping-pong, one-way latency",
            "GASNet/TCA, figure 7 (AM_Long ping-pong latency)",
            "latency_us",
            Axis::log("one-way latency (us)"),
        ),
        (
            "gasnet-fig8-am-bandwidth",
            "Long active message ping-pong, bandwidth",
            "GASNet/TCA, figure 8 (AM_Long ping-pong bandwidth)",
            "bandwidth_gbs",
            Axis::log("bandwidth (GB/s, 10^9 B/s)"),
        ),
    ] {
        let mut f = figure(id, title, reproduces, Axis::log("message size (bytes)"), y);
        f.series.push(Series::new(
            "pindown request_long",
            Role::Ours,
            xy(&am, "bytes", key, 1.0)?,
        ));
        f.series.push(Series::new(
            "raw RDMA write ping-pong (limit)",
            Role::Limit,
            xy(&raw, "bytes", key, 1.0)?,
        ));
        for peer in &peers {
            f.series.push(Series::new(
                format!("{} MPI_Send/MPI_Recv", peer.name),
                Role::Peer,
                xy(&all(peer.items("pingpong")?), "bytes", key, 1.0)?,
            ));
        }
        if key == "latency_us" {
            f.series.push(Series::new(
                "GASNet/TCA GPU-GPU (paper)",
                Role::Paper,
                vec![(smallest, paper::GASNET_TCA_MIN_LATENCY_US)],
            ));
            f.series.push(Series::new(
                "MPI/IB GPU-GPU (paper)",
                Role::Paper,
                vec![(smallest, paper::MPI_IB_MIN_LATENCY_US)],
            ));
        }
        section.figures.push(f);
    }

    // Get (the paper's GPU-to-CPU pattern of figures 7-8).
    for (id, title, key, y) in [
        (
            "gasnet-get-latency",
            "Blocking get, latency",
            "latency_us",
            Axis::log("latency (us)"),
        ),
        (
            "gasnet-get-bandwidth",
            "Blocking get, bandwidth",
            "bandwidth_gbs",
            Axis::log("bandwidth (GB/s, 10^9 B/s)"),
        ),
    ] {
        let mut f = figure(
            id,
            title,
            "GASNet/TCA, figures 7-8 (GPU to CPU: get)",
            Axis::log("message size (bytes)"),
            y,
        );
        f.series.push(Series::new(
            "pindown get, RDMA READ",
            Role::Ours,
            xy(&get_native, "bytes", key, 1.0)?,
        ));
        f.series.push(Series::new(
            "pindown get by message",
            Role::Ours,
            xy(&get_by_message, "bytes", key, 1.0)?,
        ));
        f.series.push(Series::new(
            "raw RDMA write one way (limit)",
            Role::Limit,
            xy(&raw, "bytes", key, 1.0)?,
        ));
        for peer in &peers {
            f.series.push(Series::new(
                format!("{} MPI_Get", peer.name),
                Role::Peer,
                xy(&all(peer.items("get")?), "bytes", key, 1.0)?,
            ));
        }
        if key == "latency_us" {
            f.series.push(Series::new(
                "GASNet/TCA get (paper)",
                Role::Paper,
                vec![(smallest, paper::GASNET_TCA_GET_MIN_LATENCY_US)],
            ));
        }
        section.figures.push(f);
    }

    // Figures 9 and 10: halo exchange, one plot per face.
    for (key, number, what, y) in [
        ("time_us", 9, "latency", "one-way time per face (us)"),
        (
            "bandwidth_gbs",
            10,
            "bandwidth",
            "face bytes over one-way time (GB/s)",
        ),
    ] {
        let raw_key = if key == "time_us" {
            "latency_us"
        } else {
            "bandwidth_gbs"
        };
        for (face, name) in FACES {
            let mut f = figure(
                &format!("gasnet-fig{number}-halo-{what}-{face}"),
                &format!("Halo exchange, {name} face of an N^3 array of doubles, {what}"),
                &format!("GASNet/TCA, figure {number} (halo {what}, {name} face)"),
                Axis::log("N (array edge, elements)"),
                Axis::log(y),
            );
            f.series.push(Series::new(
                "pindown put_strided + AM",
                Role::Ours,
                xy(&pick(&halo, &[("face", Is::Text(face))]), "n", key, 1.0)?,
            ));
            f.series.push(Series::new(
                "contiguous RDMA write (limit)",
                Role::Limit,
                halo_limit(&halo, &raw, face, raw_key)?,
            ));
            for peer in &peers {
                f.series.push(Series::new(
                    format!("{} (best datatype)", peer.name),
                    Role::Peer,
                    best_halo(&all(peer.items("halo")?), face, key)?,
                ));
            }
            section.figures.push(f);
        }
    }

    // Himeno.
    let mut f = figure(
        "gasnet-himeno",
        "Himeno benchmark on 2 ranks (split over i), grids XS to L",
        "GASNet/TCA, figures 11-13 and table 2 (Himeno)",
        Axis::log("grid points (i x j x k)"),
        Axis::log("Jacobi iterations per second"),
    );
    let grid = |items: &[&Value]| -> Result<Vec<(f64, f64)>, BuildError> {
        let mut points = items
            .iter()
            .map(|i| {
                Ok((
                    num(i, "ni")? * num(i, "nj")? * num(i, "nk")?,
                    num(i, "iterations_per_s")?,
                ))
            })
            .collect::<Result<Vec<_>, BuildError>>()?;
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        Ok(points)
    };
    f.series.push(Series::new(
        "pindown (put_strided halo)",
        Role::Ours,
        grid(&himeno)?,
    ));
    let compute_only = |item: &Value| -> Result<f64, BuildError> {
        Ok(num(item, "iterations")? / num(item, "calc_s")?)
    };
    let mut stencil = himeno
        .iter()
        .map(|i| {
            Ok((
                num(i, "ni")? * num(i, "nj")? * num(i, "nk")?,
                compute_only(i)?,
            ))
        })
        .collect::<Result<Vec<_>, BuildError>>()?;
    stencil.sort_by(|a, b| a.0.total_cmp(&b.0));
    f.series.push(Series::new(
        "stencil alone, no halo (limit)",
        Role::Limit,
        stencil,
    ));
    for peer in &peers {
        f.series.push(Series::new(
            peer.name,
            Role::Peer,
            grid(&all(peer.items("himeno")?))?,
        ));
    }
    section.figures.push(f);

    // Descriptor cache.
    let mut f = figure(
        "gasnet-descriptor-cache",
        "Repeated blocking puts with the endpoint's descriptor cache",
        "GASNet/TCA, section 4.4 (descriptors in PEACH2's memory against host memory)",
        Axis::log("put size (bytes)"),
        Axis::log("time per blocking put (us)"),
    );
    for (cache, name) in [
        ("puts-off", "pindown, cache off"),
        ("puts-cached", "pindown, cached"),
        ("puts-promoted", "pindown, cached + promoted"),
    ] {
        f.series.push(Series::new(
            name,
            Role::Ours,
            xy(
                &pick(&repeated, &[("cache", Is::Text(cache))]),
                "bytes",
                "latency_us",
                1.0,
            )?,
        ));
    }
    let put_sizes = pick(&repeated, &[("cache", Is::Text("puts-off"))]);
    let mut raw_at_puts = Vec::new();
    for put in &put_sizes {
        let bytes = num(put, "bytes")?;
        if let Some(v) = first(&raw, &[("bytes", Is::Num(bytes))], "latency_us")? {
            raw_at_puts.push((bytes, v));
        }
    }
    raw_at_puts.sort_by(|a, b| a.0.total_cmp(&b.0));
    f.series.push(Series::new(
        "raw RDMA write one way (limit)",
        Role::Limit,
        raw_at_puts,
    ));
    section.figures.push(f);

    // Rows.
    let mut r = row(
        "short AM round trip (request, reply from the handler)",
        "us",
        Some(short_round_trip),
    );
    r.limit = Some(Named::new(
        format!("raw RDMA write round trip, {}", size(smallest)),
        first(&raw, &[("bytes", Is::Num(smallest))], "latency_us")?.map(|v| 2.0 * v),
    ));
    r.paper = Some(
        "no round trip in the paper (the issue's target: at most 2x the RDMA write round trip)"
            .to_string(),
    );
    section.rows.push(r);

    let mut r = row(
        format!("long-AM one-way latency, {}", size(smallest)),
        "us",
        first(&am, &[("bytes", Is::Num(smallest))], "latency_us")?,
    );
    r.limit = Some(Named::new(
        "raw RDMA write ping-pong",
        first(&raw, &[("bytes", Is::Num(smallest))], "latency_us")?,
    ));
    r.peers = peer_values(
        &peers,
        "pingpong",
        &[("bytes", Is::Num(smallest))],
        "latency_us",
    )?;
    r.paper = Some(format!(
        "{} us GASNet/TCA GPU-GPU smallest (GASNet/IB 1.9, MPI/IB {}; PEACH2 DMA 2.0), GASNet/TCA figure 7",
        paper::GASNET_TCA_MIN_LATENCY_US,
        paper::MPI_IB_MIN_LATENCY_US
    ));
    section.rows.push(r);

    let mut r = row(
        "long-AM peak bandwidth over sizes",
        "GB/s",
        max_of(&am, "bandwidth_gbs")?,
    );
    r.limit = Some(Named::new(
        "raw RDMA write ping-pong",
        max_of(&raw, "bandwidth_gbs")?,
    ));
    r.peers = peer_maxima(&peers, "pingpong", &[], "bandwidth_gbs")?;
    r.paper = Some(
        "3.4 GB/s GASNet/TCA GPU-GPU (GASNet/IB 2.9, MPI/IB 3.8; PEACH2 DMA 3.5 CPU memory), GASNet/TCA figure 8"
            .to_string(),
    );
    section.rows.push(r);

    let mut r = row(
        format!("get latency, native, {}", size(smallest)),
        "us",
        first(&get_native, &[("bytes", Is::Num(smallest))], "latency_us")?,
    );
    r.limit = Some(Named::new(
        "raw RDMA write ping-pong, one way",
        first(&raw, &[("bytes", Is::Num(smallest))], "latency_us")?,
    ));
    r.peers = peer_values(&peers, "get", &[("bytes", Is::Num(smallest))], "latency_us")?;
    r.paper = Some(format!(
        "{} us GASNet/TCA get GPU-CPU smallest, done in software (GASNet/IB 2.1), GASNet/TCA figure 7",
        paper::GASNET_TCA_GET_MIN_LATENCY_US
    ));
    section.rows.push(r);

    let mut r = row(
        format!("get latency by message, {}", size(smallest)),
        "us",
        first(
            &get_by_message,
            &[("bytes", Is::Num(smallest))],
            "latency_us",
        )?,
    );
    r.limit = Some(Named::new(
        format!("raw RDMA write round trip, {}", size(smallest)),
        first(&raw, &[("bytes", Is::Num(smallest))], "latency_us")?.map(|v| 2.0 * v),
    ));
    r.peers = peer_values(&peers, "get", &[("bytes", Is::Num(smallest))], "latency_us")?;
    r.paper = Some(format!(
        "{} us GASNet/TCA (its get is a request and a DMA reply, as here), GASNet/TCA figure 7",
        paper::GASNET_TCA_GET_MIN_LATENCY_US
    ));
    section.rows.push(r);

    let largest_n = halo
        .iter()
        .map(|h| num(h, "n"))
        .collect::<Result<Vec<_>, _>>()?
        .into_iter()
        .fold(0.0, f64::max);
    for (face, name) in [("blockstride", "block-stride"), ("stride", "stride")] {
        let at = [("face", Is::Text(face)), ("n", Is::Num(largest_n))];
        let mut r = row(
            format!("halo, {name} face, N = {largest_n}, one way"),
            "us",
            first(&halo, &at, "time_us")?,
        );
        let face_bytes = first(&halo, &at, "bytes")?;
        let raw_at_face = match face_bytes {
            Some(b) => first(&raw, &[("bytes", Is::Num(b))], "latency_us")?,
            None => None,
        };
        r.limit = Some(Named::new(
            if raw_at_face.is_some() {
                "raw RDMA write of the face's bytes"
            } else {
                "raw RDMA write of the face's bytes (size not in this run's ping-pong)"
            },
            raw_at_face,
        ));
        r.peers = peers
            .iter()
            .map(|p| {
                let best = best_halo(&all(p.items("halo")?), face, "time_us")?;
                Ok(Named::new(
                    p.name,
                    best.iter().find(|(n, _)| *n == largest_n).map(|&(_, v)| v),
                ))
            })
            .collect::<Result<_, BuildError>>()?;
        r.paper = Some(if face == "blockstride" {
            "GASNet/TCA 10% or more below GASNet/IB for N = 4-64 (30% at N = 32) and far below MPI, GASNet/TCA figure 9".to_string()
        } else {
            "GASNet/TCA below MPI only for N <= 16 (no packing), GASNet/TCA figure 9".to_string()
        });
        section.rows.push(r);
    }

    if let Some(last) = himeno.iter().max_by(|a, b| {
        opt_num(a, "ni")
            .unwrap_or(0.0)
            .total_cmp(&opt_num(b, "ni").unwrap_or(0.0))
    }) {
        let grid = text(last, "size")?;
        let mut r = row(
            format!("Himeno {grid}, iterations per second"),
            "1/s",
            Some(num(last, "iterations_per_s")?),
        );
        r.limit = Some(Named::new(
            "our stencil alone (iterations over its compute time)",
            Some(compute_only(last)?),
        ));
        r.peers = peer_values(
            &peers,
            "himeno",
            &[("size", Is::Text(grid))],
            "iterations_per_s",
        )?;
        r.paper = Some(
            "figures 11-13 give no numbers in the text: GASNet/TCA equal to MPI split over i, above it over j (1000 iterations)".to_string(),
        );
        section.rows.push(r);
    }

    let smallest_put = put_sizes
        .iter()
        .map(|p| num(p, "bytes"))
        .collect::<Result<Vec<_>, _>>()?
        .into_iter()
        .fold(f64::INFINITY, f64::min);
    if smallest_put.is_finite() {
        for (cache, name, paper_text) in [
            (
                "puts-off",
                "descriptor cache off",
                "2.2 us: PEACH2 DMA with descriptors fetched from host memory, GASNet/TCA figure 1",
            ),
            (
                "puts-promoted",
                "descriptor cached and promoted",
                "2.0 us: PEACH2 DMA with descriptors in its internal memory, GASNet/TCA figure 1",
            ),
        ] {
            let mut r = row(
                format!("repeated {} blocking put, {name}", size(smallest_put)),
                "us",
                first(
                    &repeated,
                    &[("cache", Is::Text(cache)), ("bytes", Is::Num(smallest_put))],
                    "latency_us",
                )?,
            );
            r.limit = Some(Named::new(
                "raw RDMA write ping-pong, one way",
                first(&raw, &[("bytes", Is::Num(smallest_put))], "latency_us")?,
            ));
            r.paper = Some(paper_text.to_string());
            section.rows.push(r);
        }
    }
    section.notes.push(
        "Two ranks on one emulated NIC of a 2-core machine against GASNet/TCA on PEACH2 between \
         GPUs of HA-PACS/TCA; the MPIs here move data through shared memory."
            .to_string(),
    );
    section.notes.push(
        "Halo peers are the better of MPI_Type_vector and a subarray type at each N; the halo's \
         limit is a contiguous RDMA write of the face's bytes."
            .to_string(),
    );
    for note in list(doc, "notes")? {
        let note = note.as_str().ok_or("`notes` holds a non-string")?;
        if !MPIS
            .iter()
            .any(|(key, _)| note.starts_with(&format!("{key} not measured")))
        {
            section.notes.push(note.to_string());
        }
    }
    Ok(vec![section])
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A small `fmpl` document: two sizes, table 2 at 1 and 600, a
    /// barrier and a broadcast; Open MPI ran, MPICH did not.
    fn fmpl_doc() -> Value {
        let ping = |bytes: u64, us: f64| {
            json!({"bytes": bytes, "one_way_us": us, "bandwidth_gbs": bytes as f64 / us / 1e3,
                   "rdma_write_one_way_us": us * 0.9,
                   "rdma_write_bandwidth_gbs": bytes as f64 / (us * 0.9) / 1e3})
        };
        let posted = |n: u64, gap: f64| json!({"posted": n, "post_gap_us": gap, "send_gap_us": gap / 2.0, "latency_us": 9.0 + gap});
        json!({
            "benchmark": "fmpl",
            "cache_line_round_trip_us": 0.2,
            "notes": ["mpich not measured: mpicc.mpich is not on PATH (Debian packages mpich libmpich-dev)"],
            "pindown": {
                "pingpong": [ping(8, 8.0), ping(1048576, 40.0)],
                "preposted": [posted(1, 1.0), posted(600, 2.0)],
                "collectives": [
                    {"test": "barrier", "ranks": 2, "time_us": 10.0},
                    {"test": "bcast", "ranks": 2, "bytes": 1048576, "time_us": 300.0},
                    {"test": "allreduce", "ranks": 2, "bytes": 8, "time_us": 12.0}
                ]
            },
            "mpi": {
                "openmpi": {
                    "pingpong": [{"bytes": 8, "one_way_us": 0.2, "bandwidth_gbs": 0.04}],
                    "preposted": [{"posted": 600, "post_gap_us": 0.03, "send_gap_us": 0.8, "latency_us": 1.0}],
                    "collectives": [{"test": "barrier", "ranks": 2, "time_us": 0.3}]
                }
            }
        })
    }

    #[test]
    fn a_missing_mpi_is_listed_with_its_reason_and_its_numbers_are_none() {
        let doc = fmpl_doc();
        let sections = fmpl(&doc).unwrap();
        let section = &sections[0];
        assert_eq!(section.missing.len(), 1, "{:?}", section.missing);
        assert!(section.missing[0].starts_with("MPICH: mpich not measured"));
        assert!(section.missing[0].contains("not on PATH"));
        // The note that says so is in `missing`, not repeated in the notes.
        assert!(!section.notes.iter().any(|n| n.contains("not measured")));

        let latency = section
            .rows
            .iter()
            .find(|r| r.what == "8 B one-way latency")
            .unwrap();
        assert_eq!(latency.ours, Some(8.0));
        assert_eq!(latency.limit.as_ref().unwrap().value, Some(8.0 * 0.9));
        let peer = |name: &str| latency.peers.iter().find(|p| p.name == name).unwrap().value;
        assert_eq!(peer("Open MPI"), Some(0.2));
        assert_eq!(peer("MPICH"), None);
        // Open MPI has no 1 MiB point: that row's Open MPI is None too.
        let wide = section
            .rows
            .iter()
            .find(|r| r.what == "bandwidth at 1 MiB")
            .unwrap();
        assert!(wide.peers.iter().all(|p| p.value.is_none()));

        // Every figure keeps its MPICH series (empty) and its Ours points.
        for figure in &section.figures {
            let ours = figure.series.iter().find(|s| s.role == Role::Ours).unwrap();
            assert!(!ours.points.is_empty(), "{}", figure.id);
            let mpich = figure.series.iter().find(|s| s.name.starts_with("MPICH"));
            assert!(mpich.is_some_and(|s| s.points.is_empty()), "{}", figure.id);
        }
        // The cache-line limit is one way: half the round trip.
        let cache = section
            .rows
            .iter()
            .find(|r| r.what.ends_with("against a cache line"))
            .unwrap();
        assert_eq!(cache.limit.as_ref().unwrap().value, Some(0.1));
    }

    #[test]
    fn the_same_figures_with_both_mpis_or_one() {
        let doc = fmpl_doc();
        let mut both = doc.clone();
        both["mpi"]["mpich"] = both["mpi"]["openmpi"].clone();
        both["notes"] = json!([]);
        let ids = |d: &Value| {
            fmpl(d).unwrap()[0]
                .figures
                .iter()
                .map(|f| f.id.clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(ids(&doc), ids(&both));
        let section = &fmpl(&both).unwrap()[0];
        assert!(section.missing.is_empty());
        let barrier = section
            .rows
            .iter()
            .find(|r| r.what == "barrier on 2 ranks")
            .unwrap();
        assert!(barrier.peers.iter().all(|p| p.value == Some(0.3)));
    }

    #[test]
    fn a_malformed_document_is_an_error_naming_the_path() {
        let mut doc = fmpl_doc();
        doc["pindown"]["pingpong"][1]["one_way_us"] = json!("fast");
        let err = fmpl(&doc).unwrap_err();
        assert!(err.contains("one_way_us"), "{err}");
        let mut doc = fmpl_doc();
        doc["mpi"]["openmpi"]["pingpong"] = json!({});
        let err = fmpl(&doc).unwrap_err();
        assert!(
            err.contains("mpi.openmpi") && err.contains("pingpong"),
            "{err}"
        );
        assert!(gasnet(&json!({"benchmark": "gasnet", "notes": []})).is_err());
    }

    #[test]
    fn halo_peers_take_the_better_datatype_at_each_n() {
        let items = [
            json!({"face": "stride", "n": 4, "datatype": "vector", "time_us": 3.0}),
            json!({"face": "stride", "n": 4, "datatype": "subarray", "time_us": 2.0}),
            json!({"face": "stride", "n": 8, "datatype": "vector", "time_us": 5.0}),
            json!({"face": "block", "n": 4, "datatype": "vector", "time_us": 1.0}),
        ];
        let refs = all(&items);
        assert_eq!(
            best_halo(&refs, "stride", "time_us").unwrap(),
            vec![(4.0, 2.0), (8.0, 5.0)]
        );
    }
}
