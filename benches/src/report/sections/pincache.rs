//! Report sections of the `pincache` programs: `pin-cost` (PM's table 2,
//! hit and miss cost by region size, UCX's registration cache as the
//! peer), `pin-hitrate` (PM's figure 4, bandwidth against hit rate, and
//! hit rates by cache size and trace), `register-cost` (PM's figures 2 and
//! 5, zero copy against copying) and `barrier-wait` (the trust figures).

use serde_json::Value;

use crate::report::figure::{
    at, list, num, opt_num, points, text, Axis, BuildError, Figure, Named, Role, Row, Section,
    Series,
};

/// Bandwidths the PM paper prints for zero copy and for a copying path
/// (MB/s, its unit, 10^6 bytes per second), each at the transfer size
/// (bytes) it gives it for. The paper gives no curves, only these points.
struct PaperBandwidth {
    figure: &'static str,
    bytes: f64,
    zero_copy_mb_per_s: f64,
    copying_mb_per_s: f64,
}

/// PM's figure 2 (PM's own messages, buffer to buffer against copied
/// from user memory; maxima at 8 KiB) and figure 5 (MPI on SCore, zero
/// copy against PM's copying messages; maxima at 512 KiB).
const PM_ZERO_COPY: [PaperBandwidth; 2] = [
    PaperBandwidth {
        figure: "PM figure 2",
        bytes: 8192.0,
        zero_copy_mb_per_s: 119.0,
        copying_mb_per_s: 25.3,
    },
    PaperBandwidth {
        figure: "PM figure 5",
        bytes: 524_288.0,
        zero_copy_mb_per_s: 111.5,
        copying_mb_per_s: 25.0,
    },
];

/// PM's figure 4: zero-copy bandwidth of 8 KiB transfers at a hit rate of
/// 100 % and of 0 % (MB/s), the two values the paper prints.
const PM_FIGURE4_BYTES: f64 = 8192.0;
const PM_FIGURE4_HIT_MB_PER_S: f64 = 109.4;
const PM_FIGURE4_MISS_MB_PER_S: f64 = 40.0;

/// The item of the array at `path` whose `key` equals `value`.
fn find<'a>(doc: &'a Value, path: &str, key: &str, value: f64) -> Result<&'a Value, BuildError> {
    list(doc, path)?
        .iter()
        .find(|item| opt_num(item, key) == Some(value))
        .ok_or_else(|| format!("`{path}` has no item with `{key}` = {value}"))
}

/// `bytes` as "4 KiB", "16 MiB".
fn size_name(bytes: f64) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut value = bytes;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value} {}", UNITS[unit])
}

/// `(x, y * scale)` for each point.
fn scaled(points: Vec<(f64, f64)>, scale: f64) -> Vec<(f64, f64)> {
    points.into_iter().map(|(x, y)| (x, y * scale)).collect()
}

/// The UCX peer of `pin-cost`: its sizes if measured, else why not. A
/// document without `ucx` (written before the peer existed) counts as not
/// measured; a `ucx` that is there but malformed is an error.
fn ucx_peer(doc: &Value) -> Result<Result<&Value, String>, BuildError> {
    let Some(ucx) = doc.get("ucx") else {
        return Ok(Err(
            "the document has no `ucx` (written by a pin-cost without the UCX peer)".into(),
        ));
    };
    match text(ucx, "status")? {
        "measured" => {
            list(ucx, "sizes")?;
            Ok(Ok(ucx))
        }
        status => Ok(Err(format!(
            "{status}: {}",
            ucx.get("reason")
                .and_then(Value::as_str)
                .unwrap_or("no reason given")
        ))),
    }
}

/// Sections of the `pin-cost` document: PM's table 2.
pub fn pin_cost(doc: &Value) -> Result<Vec<Section>, BuildError> {
    let mut section = Section::new(
        "Pin-down cache: hit and miss cost (PM, table 2)",
        "pin-cost",
    );
    let reference = at(doc, "reference_pm_table2")?;
    let (paper_a, paper_b, paper_hit) = (
        num(reference, "miss_a_us")?,
        num(reference, "miss_b_us_per_page")?,
        num(reference, "hit_us")?,
    );
    let paper_source = text(reference, "source")?;
    let ucx = ucx_peer(doc)?;
    if let Err(reason) = &ucx {
        section.missing.push(format!("UCX ucs_rcache: {reason}"));
    }
    let ucx = ucx.ok();
    for skipped in list(doc, "skipped")? {
        section.missing.push(format!(
            "pindown, {} pages: {}",
            num(skipped, "pages")?,
            text(skipped, "reason")?
        ));
    }

    let miss = points(doc, "sizes", "pages", "miss_us")?;
    let hit = scaled(points(doc, "sizes", "pages", "hit_ns")?, 1e-3);
    let raw = points(doc, "sizes", "pages", "raw_mlock_us")?;
    let (ucx_miss, ucx_hit) = match ucx {
        Some(u) => (
            points(u, "sizes", "pages", "miss_us")?,
            scaled(points(u, "sizes", "pages", "hit_ns")?, 1e-3),
        ),
        None => (Vec::new(), Vec::new()),
    };
    let paper_miss: Vec<(f64, f64)> = miss
        .iter()
        .map(|&(pages, _)| (pages, paper_a + paper_b * pages))
        .collect();
    let paper_hits: Vec<(f64, f64)> = miss.iter().map(|&(pages, _)| (pages, paper_hit)).collect();
    section.figures.push(Figure {
        id: "pin-cost-table2".into(),
        title: "Pin-down cache: miss and hit cost by region size".into(),
        reproduces: "PM, table 2".into(),
        x: Axis::log("region size (4 KiB pages)"),
        y: Axis::log("time per pin and release (us)"),
        series: vec![
            Series::new("pindown miss (mlock pinner)", Role::Ours, miss.clone()),
            Series::new("pindown hit", Role::Ours, hit),
            Series::new("UCX rcache miss (mlock)", Role::Peer, ucx_miss),
            Series::new("UCX rcache hit", Role::Peer, ucx_hit),
            Series::new("raw mlock", Role::Limit, raw),
            Series::new(
                format!("PM miss {paper_a} + {paper_b}/page (paper)"),
                Role::Paper,
                paper_miss,
            ),
            Series::new(
                format!("PM hit {paper_hit} us (paper)"),
                Role::Paper,
                paper_hits,
            ),
        ],
    });

    let ucx_num = |path: &str| ucx.and_then(|u| opt_num(u, path));
    let ucx_size = |pages: f64, key: &str| {
        ucx.and_then(|u| find(u, "sizes", "pages", pages).ok())
            .and_then(|s| opt_num(s, key))
    };
    let ucx_named = |value: Option<f64>| vec![Named::new("UCX rcache", value)];
    let paper = |what: String| Some(format!("{what}, Pentium 166 MHz, NetBSD ({paper_source})"));

    let one = find(doc, "sizes", "pages", 1.0)?;
    section.rows.push(Row {
        what: "hit (look up and release), 1 page".into(),
        unit: "us".into(),
        ours: Some(num(one, "hit_ns")? / 1e3),
        paper: paper(format!("{paper_hit} us")),
        peers: ucx_named(ucx_num("hit_us")),
        limit: None,
    });
    section.rows.push(Row {
        what: "miss (pin with mlock and release), 1 page".into(),
        unit: "us".into(),
        ours: Some(num(one, "miss_us")?),
        paper: paper(format!(
            "{} us ({paper_a} + {paper_b} x 1)",
            paper_a + paper_b
        )),
        peers: ucx_named(ucx_size(1.0, "miss_us")),
        limit: Some(Named::new("raw mlock", Some(num(one, "raw_mlock_us")?))),
    });
    let largest = list(doc, "sizes")?
        .last()
        .ok_or("`sizes` is empty: no region size was measured")?;
    let largest_pages = num(largest, "pages")?;
    section.rows.push(Row {
        what: format!(
            "miss, {largest_pages} pages ({})",
            size_name(num(largest, "bytes")?)
        ),
        unit: "us".into(),
        ours: Some(num(largest, "miss_us")?),
        paper: paper(format!(
            "{:.0} us ({paper_a} + {paper_b} x {largest_pages})",
            paper_a + paper_b * largest_pages
        )),
        peers: ucx_named(ucx_size(largest_pages, "miss_us")),
        limit: Some(Named::new("raw mlock", Some(num(largest, "raw_mlock_us")?))),
    });
    section.rows.push(Row {
        what: "miss cost fit a + b x pages: a".into(),
        unit: "us".into(),
        ours: opt_num(doc, "fit.miss_us.a"),
        paper: paper(format!("{paper_a} us")),
        peers: ucx_named(ucx_num("fit.miss_us.a")),
        limit: Some(Named::new("raw mlock", opt_num(doc, "fit.raw_mlock_us.a"))),
    });
    section.rows.push(Row {
        what: "miss cost fit a + b x pages: b".into(),
        unit: "us/page".into(),
        ours: opt_num(doc, "fit.miss_us.b"),
        paper: paper(format!("{paper_b} us/page")),
        peers: ucx_named(ucx_num("fit.miss_us.b")),
        limit: Some(Named::new("raw mlock", opt_num(doc, "fit.raw_mlock_us.b"))),
    });
    section.rows.push(Row {
        what: "hit over miss, 1 page".into(),
        unit: "ratio".into(),
        ours: opt_num(doc, "ratios.hit_over_miss_1page"),
        paper: paper(format!("{:.4}", num(reference, "hit_over_miss_1page")?)),
        peers: ucx_named(ucx_num("hit_over_miss_1page")),
        limit: None,
    });

    let cases = list(doc, "unmap.cases")?;
    let case = |name: &str| -> Result<Option<f64>, BuildError> {
        let item = cases
            .iter()
            .find(|c| c.get("case").and_then(Value::as_str) == Some(name))
            .ok_or_else(|| format!("`unmap.cases` has no case `{name}`"))?;
        Ok(opt_num(item, "median_us"))
    };
    for item in cases {
        if let Some(error) = item.get("error").and_then(Value::as_str) {
            section
                .missing
                .push(format!("munmap case {}: {error}", text(item, "case")?));
        }
    }
    section.rows.push(Row {
        what: "munmap of a pinned page through the hook, monitor running".into(),
        unit: "us".into(),
        ours: case("pincache_unmap_monitored")?,
        paper: None,
        peers: Vec::new(),
        limit: Some(Named::new("plain munmap", case("munmap")?)),
    });

    section.notes.push(
        "Miss: the cache's pin of a region it does not hold (mlock of the pages) plus the \
         release; hit: the pin of the region it holds plus the release. UCX's registration \
         cache (ucs_rcache_get + ucs_rcache_region_put) is given the same pin (mlock in its \
         mem_reg callback) on the same sizes, so both columns pay the same system call and \
         differ only by the cache."
            .into(),
    );
    section.notes.push(
        "PM's figures are from a Pentium 166 MHz under NetBSD 1.2 pinning for a Myrinet NIC; \
         here mlock on the machine of this run."
            .into(),
    );
    Ok(vec![section])
}

/// The `results` item of `trace`, `policy` and capacity `entries`.
fn hitrate_result<'a>(
    doc: &'a Value,
    trace: &str,
    policy: &str,
    entries: f64,
) -> Result<&'a Value, BuildError> {
    list(doc, "results")?
        .iter()
        .find(|r| {
            r.get("trace").and_then(Value::as_str) == Some(trace)
                && r.get("policy").and_then(Value::as_str) == Some(policy)
                && opt_num(r, "capacity_entries") == Some(entries)
        })
        .ok_or_else(|| {
            format!("`results` has no {trace} trace under {policy} with {entries} entries")
        })
}

/// `(capacity, value)` of every result of `trace` under `policy`.
fn by_capacity(
    doc: &Value,
    trace: &str,
    policy: &str,
    key: &str,
    scale: f64,
) -> Result<Vec<(f64, f64)>, BuildError> {
    list(doc, "results")?
        .iter()
        .filter(|r| {
            r.get("trace").and_then(Value::as_str) == Some(trace)
                && r.get("policy").and_then(Value::as_str) == Some(policy)
        })
        .map(|r| Ok((num(r, "capacity_entries")?, num(r, key)? * scale)))
        .collect()
}

/// The traces `pin-hitrate` replays, with their legend names.
const TRACES: [(&str, &str); 3] = [
    ("sequential", "sequential sweep"),
    ("uniform", "uniform"),
    ("hot_cold", "hot set, cold tail"),
];

/// The policies, with their legend names.
const POLICIES: [(&str, &str); 3] = [("lru", "LRU"), ("lfu", "LFU"), ("fifo", "FIFO")];

/// Sections of the `pin-hitrate` document: PM's figure 4 and hit rates.
pub fn pin_hitrate(doc: &Value) -> Result<Vec<Section>, BuildError> {
    let mut section = Section::new(
        "Pin-down cache: bandwidth against hit rate (PM, figure 4), hit rate by cache size",
        "pin-hitrate",
    );
    let transfer = num(doc, "config.transfer_bytes")?;
    let transfer_name = size_name(transfer);
    let experiment = list(doc, "pm_experiment")?;
    let pm_points = |key: &str| -> Result<Vec<(f64, f64)>, BuildError> {
        let mut p: Vec<(f64, f64)> = experiment
            .iter()
            .map(|e| Ok((num(e, "measured_hit_rate")? * 100.0, num(e, key)?)))
            .collect::<Result<_, BuildError>>()?;
        p.sort_by(|a, b| a.0.total_cmp(&b.0));
        Ok(p)
    };
    section.figures.push(Figure {
        id: "pin-hitrate-figure4".into(),
        title: format!(
            "Bandwidth of {transfer_name} transfers against the pin-down cache hit rate"
        ),
        reproduces: "PM, figure 4".into(),
        x: Axis::linear("hit rate (%)"),
        y: Axis::log("bandwidth (MB/s, 10^6 bytes/s)"),
        series: vec![
            Series::new(
                "pindown (pin + copy)".to_string(),
                Role::Ours,
                pm_points("mb_per_s")?,
            ),
            Series::new(
                "memcpy, same transfers",
                Role::Limit,
                pm_points("memcpy_mb_per_s")?,
            ),
            Series::new(
                format!("PM {}, Myrinet (paper)", size_name(PM_FIGURE4_BYTES)),
                Role::Paper,
                vec![
                    (0.0, PM_FIGURE4_MISS_MB_PER_S),
                    (100.0, PM_FIGURE4_HIT_MB_PER_S),
                ],
            ),
        ],
    });

    section.figures.push(Figure {
        id: "pin-hitrate-capacity".into(),
        title: format!(
            "Hit rate by cache size, LRU, {} buffers in the working set",
            num(doc, "config.working_set_buffers")?
        ),
        reproduces: "nothing in PM; added: hit rate by cache size on reproducible traces".into(),
        x: Axis::log("cache capacity (entries)"),
        y: Axis::linear("hit rate (%)"),
        series: TRACES
            .iter()
            .map(|&(trace, name)| {
                Ok(Series::new(
                    format!("pindown, {name}"),
                    Role::Ours,
                    by_capacity(doc, trace, "lru", "hit_rate", 100.0)?,
                ))
            })
            .collect::<Result<_, BuildError>>()?,
    });

    let capacities = list(doc, "config.capacities_entries")?;
    let first = capacities
        .first()
        .and_then(Value::as_f64)
        .ok_or("`config.capacities_entries` is empty")?;
    let last = capacities.last().and_then(Value::as_f64).unwrap_or(first);
    let memcpy = num(doc, "baseline.memcpy_mb_per_s")?;
    let mut policy_series: Vec<Series> = POLICIES
        .iter()
        .map(|&(policy, name)| {
            Ok(Series::new(
                format!("pindown {name}"),
                Role::Ours,
                by_capacity(doc, "hot_cold", policy, "mb_per_s", 1.0)?,
            ))
        })
        .collect::<Result<_, BuildError>>()?;
    policy_series.push(Series::new(
        format!("memcpy of one {transfer_name} transfer"),
        Role::Limit,
        vec![(first, memcpy), (last, memcpy)],
    ));
    section.figures.push(Figure {
        id: "pin-hitrate-policy".into(),
        title: format!("Bandwidth of {transfer_name} transfers by cache size and policy, hot set with cold tail"),
        reproduces: "nothing in PM; added: replacement policies".into(),
        x: Axis::log("cache capacity (entries)"),
        y: Axis::log("bandwidth (MB/s, 10^6 bytes/s)"),
        series: policy_series,
    });

    let at_rate = |rate: f64| {
        experiment
            .iter()
            .find(|e| opt_num(e, "intended_miss_fraction") == Some(1.0 - rate))
            .ok_or_else(|| format!("`pm_experiment` has no run at a hit rate of {rate}"))
    };
    let paper_fig4 = |mb: f64| {
        Some(format!(
            "{mb} MB/s, {} transfers over Myrinet, PM figure 4",
            size_name(PM_FIGURE4_BYTES)
        ))
    };
    for (rate, paper) in [
        (1.0, paper_fig4(PM_FIGURE4_HIT_MB_PER_S)),
        (0.5, None),
        (0.0, paper_fig4(PM_FIGURE4_MISS_MB_PER_S)),
    ] {
        let run = at_rate(rate)?;
        section.rows.push(Row {
            what: format!(
                "{transfer_name} transfers at a hit rate of {:.0} %",
                rate * 100.0
            ),
            unit: "MB/s".into(),
            ours: Some(num(run, "mb_per_s")?),
            paper,
            peers: Vec::new(),
            limit: Some(Named::new(
                "memcpy of the same transfers",
                Some(num(run, "memcpy_mb_per_s")?),
            )),
        });
    }
    for (trace, policy) in [("hot_cold", "lru"), ("hot_cold", "lfu"), ("uniform", "lru")] {
        let result = hitrate_result(doc, trace, policy, last)?;
        let trace_name = TRACES.iter().find(|t| t.0 == trace).map_or(trace, |t| t.1);
        let policy_name = POLICIES
            .iter()
            .find(|p| p.0 == policy)
            .map_or(policy, |p| p.1);
        section.rows.push(Row {
            what: format!(
                "hit rate, {trace_name}, {policy_name}, {last} entries ({:.0} % of the working set)",
                num(result, "capacity_over_working_set")? * 100.0
            ),
            unit: "%".into(),
            ours: Some(num(result, "hit_rate")? * 100.0),
            paper: None,
            peers: Vec::new(),
            limit: None,
        });
    }
    section.notes.push(format!(
        "Each transfer pins its {transfer_name} buffer through the cache (mlock on a miss), \
         copies it and releases it; the PM experiment forces the given share of misses, as \
         the paper did. PM's transfers were DMA over a 160 MB/s Myrinet, so its bandwidth \
         is bound by the network; here the copy is memcpy and a miss's mlock dominates."
    ));
    if at(doc, "config.limited_by_system_limits")?.as_bool() == Some(true) {
        section.notes.push(
            "The run was limited by the machine's lockable memory or mapping count: \
             fewer capacities or transfers than asked (see the document's config)."
                .into(),
        );
    }
    Ok(vec![section])
}

/// Sections of the `register-cost` document: PM's figures 2 and 5.
pub fn register_cost(doc: &Value) -> Result<Vec<Section>, BuildError> {
    let mut section = Section::new(
        "Zero copy against copying (PM, figures 2 and 5), registration of any memory",
        "register-cost",
    );
    let gbps = |key: &str| points(doc, "bandwidth", "bytes", key);
    let paper_points = |zero_copy: bool| {
        PM_ZERO_COPY
            .iter()
            .map(|p| {
                let mb = if zero_copy {
                    p.zero_copy_mb_per_s
                } else {
                    p.copying_mb_per_s
                };
                (p.bytes, mb / 1e3)
            })
            .collect::<Vec<_>>()
    };
    section.figures.push(Figure {
        id: "register-cost-bandwidth".into(),
        title: "Write bandwidth by size: zero copy through the device against copying".into(),
        reproduces: "PM, figures 2 and 5".into(),
        x: Axis::log("transfer size (bytes)"),
        y: Axis::log("bandwidth (GB/s, 10^9 bytes/s)"),
        series: vec![
            Series::new("pindown, arena", Role::Ours, gbps("arena_gbps")?),
            Series::new("pindown, heap (rehomed)", Role::Ours, gbps("heap_gbps")?),
            Series::new("CMA, one copy", Role::Peer, gbps("cma_one_copy_gbps")?),
            Series::new("CMA, two copies", Role::Peer, gbps("cma_two_copies_gbps")?),
            Series::new("memcpy (one thread)", Role::Limit, gbps("memcpy_gbps")?),
            Series::new("PM zero copy (paper)", Role::Paper, paper_points(true)),
            Series::new("PM copying (paper)", Role::Paper, paper_points(false)),
        ],
    });
    let reg = |key: &str, scale: f64| -> Result<Vec<(f64, f64)>, BuildError> {
        Ok(scaled(points(doc, "registration", "bytes", key)?, scale))
    };
    section.figures.push(Figure {
        id: "register-cost-registration".into(),
        title: "Registration cost by size: arena, rehomed heap, cross-memory attach".into(),
        reproduces: "nothing in PM; added: registering any memory (README, any-memory figures)"
            .into(),
        x: Axis::log("region size (bytes)"),
        y: Axis::log("time (us)"),
        series: vec![
            Series::new("pindown arena miss", Role::Ours, reg("arena.miss_us", 1.0)?),
            Series::new(
                "pindown heap, first (rehome)",
                Role::Ours,
                reg("rehome.first_us", 1.0)?,
            ),
            Series::new(
                "pindown heap, miss after eviction",
                Role::Ours,
                reg("rehome.miss_us", 1.0)?,
            ),
            Series::new("pindown arena hit", Role::Ours, reg("arena.hit_ns", 1e-3)?),
            Series::new("CMA miss (raw)", Role::Peer, reg("cma.miss_us", 1.0)?),
            Series::new("raw mlock", Role::Limit, reg("raw_mlock_us", 1.0)?),
        ],
    });

    let bandwidth = list(doc, "bandwidth")?;
    let smallest = bandwidth.first().ok_or("`bandwidth` is empty")?;
    let largest = bandwidth.last().ok_or("`bandwidth` is empty")?;
    let fig2 = &PM_ZERO_COPY[0];
    let fig5 = &PM_ZERO_COPY[1];
    let paper_text = |p: &PaperBandwidth| {
        Some(format!(
            "{} GB/s zero copy, {} GB/s copying, at {}, Myrinet ({})",
            p.zero_copy_mb_per_s / 1e3,
            p.copying_mb_per_s / 1e3,
            size_name(p.bytes),
            p.figure
        ))
    };
    for (item, paper, heap) in [
        (smallest, paper_text(fig2), false),
        (largest, paper_text(fig5), false),
        (largest, None, true),
    ] {
        let bytes = num(item, "bytes")?;
        section.rows.push(Row {
            what: format!(
                "write bandwidth, {}, {} (zero copy)",
                size_name(bytes),
                if heap { "heap rehomed" } else { "arena" }
            ),
            unit: "GB/s".into(),
            ours: Some(num(item, if heap { "heap_gbps" } else { "arena_gbps" })?),
            paper,
            peers: vec![
                Named::new("CMA one copy", opt_num(item, "cma_one_copy_gbps")),
                Named::new("CMA two copies", opt_num(item, "cma_two_copies_gbps")),
            ],
            limit: Some(Named::new("memcpy", opt_num(item, "memcpy_gbps"))),
        });
    }
    let registration = list(doc, "registration")?;
    let small = registration.first().ok_or("`registration` is empty")?;
    let big = registration.last().ok_or("`registration` is empty")?;
    for item in [small, big] {
        let bytes = num(item, "bytes")?;
        section.rows.push(Row {
            what: format!("registration miss, arena, {}", size_name(bytes)),
            unit: "us".into(),
            ours: Some(num(item, "arena.miss_us")?),
            paper: None,
            peers: vec![Named::new("CMA miss (raw)", opt_num(item, "cma.miss_us"))],
            limit: Some(Named::new("raw mlock", opt_num(item, "raw_mlock_us"))),
        });
    }
    section.rows.push(Row {
        what: format!(
            "registration of heap memory, first time (rehome), {}",
            size_name(num(big, "bytes")?)
        ),
        unit: "us".into(),
        ours: Some(num(big, "rehome.first_us")?),
        paper: None,
        peers: Vec::new(),
        limit: Some(Named::new("raw mlock", opt_num(big, "raw_mlock_us"))),
    });
    section.rows.push(Row {
        what: format!(
            "registration hit, arena, {}",
            size_name(num(small, "bytes")?)
        ),
        unit: "ns".into(),
        ours: Some(num(small, "arena.hit_ns")?),
        paper: None,
        peers: Vec::new(),
        limit: None,
    });
    if at(doc, "verified")?.as_bool() != Some(true) {
        section
            .missing
            .push("byte-for-byte check of the last transfers: not verified".into());
    }
    section.notes.push(
        "Zero copy: 4 writes in flight through the emulated device from registered memory; \
         the copying paths are cross-memory attach (one process_vm_writev per transfer, or \
         two copies through a bounce buffer), the CPU-copy route PM's copying messages took. \
         PM's numbers are bound by its 160 MB/s Myrinet; here the device's copy runs at memory \
         speed, so the limit is memcpy."
            .into(),
    );
    Ok(vec![section])
}

/// `(50, median)`, `(99, p99)`, `(100, max)` of the summary at `path`.
fn quantiles(doc: &Value, path: &str) -> Result<Vec<(f64, f64)>, BuildError> {
    let summary = at(doc, path)?;
    Ok(vec![
        (50.0, num(summary, "median")?),
        (99.0, num(summary, "p99")?),
        (100.0, num(summary, "max")?),
    ])
}

/// Sections of the `barrier-wait` document: the trust figures.
pub fn barrier_wait(doc: &Value) -> Result<Vec<Section>, BuildError> {
    let mut section = Section::new(
        "Trust: revoke and invalidation behind transfers in flight",
        "barrier-wait",
    );
    let transfer = size_name(num(doc, "transfer_bytes")?);
    let step = size_name(num(doc, "step_bytes")?);
    section.figures.push(Figure {
        id: "barrier-wait-quantiles".into(),
        title: format!("Wait of a barrier issued during a {transfer} write"),
        reproduces: "nothing in PM; added: README, trust figures".into(),
        x: Axis::linear("percentile of trials (50 = median, 100 = max)"),
        y: Axis::log("wait (us)"),
        series: vec![
            Series::new(
                "pindown revoke, peer writing",
                Role::Ours,
                quantiles(doc, "revoke.in_flight_us")?,
            ),
            Series::new(
                "pindown INVALIDATE, peer writing",
                Role::Ours,
                quantiles(doc, "invalidate.in_flight_us")?,
            ),
            Series::new(
                "pindown INVALIDATE, own write",
                Role::Ours,
                quantiles(doc, "invalidate_own_transfer.in_flight_us")?,
            ),
            Series::new(
                "revoke, idle",
                Role::Limit,
                quantiles(doc, "revoke.idle_us")?,
            ),
            Series::new(
                format!("memcpy, one {step} step"),
                Role::Limit,
                quantiles(doc, "memcpy_step_us")?,
            ),
        ],
    });
    let memcpy_step = Named::new(
        format!("memcpy of one {step} step"),
        opt_num(doc, "memcpy_step_us.median"),
    );
    for (path, what, idle) in [
        (
            "revoke",
            "revoke, peer's write in flight",
            "revoke.idle_us.median",
        ),
        (
            "invalidate",
            "INVALIDATE, peer's write in flight",
            "invalidate.idle_us.median",
        ),
        (
            "invalidate_own_transfer",
            "INVALIDATE, the port's own write in flight",
            "invalidate_own_transfer.idle_us.median",
        ),
    ] {
        section.rows.push(Row {
            what: format!("{what}, median"),
            unit: "us".into(),
            ours: Some(num(doc, &format!("{path}.in_flight_us.median"))?),
            paper: None,
            peers: Vec::new(),
            limit: Some(Named::new("same, nothing in flight", opt_num(doc, idle))),
        });
        section.rows.push(Row {
            what: format!("{what}, p99"),
            unit: "us".into(),
            ours: Some(num(doc, &format!("{path}.in_flight_us.p99"))?),
            paper: None,
            peers: Vec::new(),
            limit: Some(memcpy_step.clone()),
        });
    }
    section.rows.push(Row {
        what: format!("excess wait of a revoke, median, in {step} steps"),
        unit: "steps".into(),
        ours: Some(num(doc, "revoke.excess_steps.median")?),
        paper: None,
        peers: Vec::new(),
        limit: None,
    });
    section.notes.push(format!(
        "A barrier (a window revoke, an IOTLB INVALIDATE) returns only once no transfer can \
         still touch the memory; issued while a {transfer} write is in flight it waits for \
         the steps under way ({step} each). Mode: {}, {} trials. PM has no such figure: it \
         trusted its processes.",
        text(doc, "mode")?,
        num(doc, "trials")?
    ));
    Ok(vec![section])
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pin_cost_doc(ucx: Option<Value>) -> Value {
        let size = |pages: f64| {
            json!({"pages": pages, "bytes": pages * 4096.0, "miss_us": 3.0 + pages,
                   "raw_mlock_us": 2.5 + pages, "hit_ns": 12.0})
        };
        let mut doc = json!({
            "sizes": [size(1.0), size(4.0)],
            "skipped": [{"pages": 8, "reason": "exceeds the lockable budget"}],
            "fit": {"miss_us": {"a": 3.0, "b": 1.0}, "raw_mlock_us": {"a": 2.5, "b": 1.0}},
            "ratios": {"hit_over_miss_1page": 0.003},
            "reference_pm_table2": {"source": "PM pin-down cache paper, table 2",
                "miss_a_us": 90.8, "miss_b_us_per_page": 12.3, "hit_us": 0.6,
                "hit_over_miss_1page": 0.0058},
            "unmap": {"cases": [
                {"case": "munmap", "median_us": 2.0, "error": null},
                {"case": "pincache_unmap_monitored", "median_us": null,
                 "error": "userfaultfd unavailable"}]}
        });
        if let Some(ucx) = ucx {
            doc["ucx"] = ucx;
        }
        doc
    }

    #[test]
    fn missing_ucx_is_listed_with_its_reason_and_its_values_are_none() {
        let doc = pin_cost_doc(Some(json!({"status": "missing",
            "reason": "/usr/include/ucs/memory/rcache.h is missing"})));
        let sections = pin_cost(&doc).unwrap();
        let s = &sections[0];
        assert!(
            s.missing
                .iter()
                .any(|m| m.contains("UCX") && m.contains("rcache.h is missing")),
            "{:?}",
            s.missing
        );
        assert!(s.missing.iter().any(|m| m.contains("8 pages")));
        assert!(s
            .missing
            .iter()
            .any(|m| m.contains("userfaultfd unavailable")));
        let ucx_values: Vec<_> = s
            .rows
            .iter()
            .flat_map(|r| &r.peers)
            .filter(|p| p.name.contains("UCX"))
            .collect();
        assert!(!ucx_values.is_empty());
        assert!(ucx_values.iter().all(|p| p.value.is_none()));
        let figure = &s.figures[0];
        assert!(figure
            .series
            .iter()
            .filter(|f| f.role == Role::Peer)
            .all(|f| f.points.is_empty()));
        // The paper's line is computed from the document's reference.
        let paper = figure
            .series
            .iter()
            .find(|f| f.role == Role::Paper)
            .unwrap();
        assert_eq!(paper.points[1], (4.0, 90.8 + 12.3 * 4.0));
        // A document written before the peer existed builds too.
        let old = pin_cost(&pin_cost_doc(None)).unwrap();
        assert!(old[0].missing.iter().any(|m| m.contains("no `ucx`")));
    }

    #[test]
    fn measured_ucx_fills_its_series_and_rows() {
        let doc = pin_cost_doc(Some(json!({"status": "measured", "reason": null,
            "sizes": [{"pages": 1, "miss_us": 3.5, "hit_ns": 25.0},
                      {"pages": 4, "miss_us": 6.5, "hit_ns": 24.0}],
            "hit_us": 0.025, "fit": {"miss_us": {"a": 2.5, "b": 1.0}},
            "hit_over_miss_1page": 0.007})));
        let s = &pin_cost(&doc).unwrap()[0];
        assert!(!s.missing.iter().any(|m| m.contains("UCX")));
        let hit = s.rows.iter().find(|r| r.what.starts_with("hit (")).unwrap();
        assert_eq!(hit.peers[0].value, Some(0.025));
        let largest = s
            .rows
            .iter()
            .find(|r| r.what.starts_with("miss, 4"))
            .unwrap();
        assert_eq!(largest.peers[0].value, Some(6.5));
        assert_eq!(largest.ours, Some(7.0));
        let peer_hits = s.figures[0]
            .series
            .iter()
            .find(|f| f.name == "UCX rcache hit")
            .unwrap();
        assert_eq!(peer_hits.points, vec![(1.0, 0.025), (4.0, 0.024)]);
    }

    #[test]
    fn malformed_documents_are_errors_naming_the_path() {
        let mut doc = pin_cost_doc(None);
        doc["ucx"] = json!({"status": 3});
        assert!(pin_cost(&doc).unwrap_err().contains("status"));
        let err = pin_hitrate(&json!({"config": {}})).unwrap_err();
        assert!(err.contains("config.transfer_bytes"), "{err}");
        assert!(register_cost(&json!({})).unwrap_err().contains("bandwidth"));
        assert!(barrier_wait(&json!({"transfer_bytes": 1}))
            .unwrap_err()
            .contains("step_bytes"));
    }

    #[test]
    fn size_names_are_binary_units() {
        assert_eq!(size_name(4096.0), "4 KiB");
        assert_eq!(size_name(16.0 * 1024.0 * 1024.0), "16 MiB");
        assert_eq!(size_name(100.0), "100 B");
    }
}
