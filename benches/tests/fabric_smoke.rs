//! `fabric --quick` as a reader of its figures would run it: one JSON
//! document with every figure measured and set beside its raw UDP baseline
//! of the same run, the ratios computed from the figures, the memory
//! figures consistent with each other, and every target reported. Speed is
//! never asserted.

mod common;

use serde_json::Value;

fn number(value: &Value, path: &str) -> f64 {
    value
        .pointer(path)
        .and_then(Value::as_f64)
        .unwrap_or_else(|| panic!("{path} is not a number in {value}"))
}

fn array<'v>(value: &'v Value, path: &str) -> &'v Vec<Value> {
    value
        .pointer(path)
        .and_then(Value::as_array)
        .unwrap_or_else(|| panic!("{path} is not an array in {value}"))
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

#[test]
fn quick_fabric_reports_every_figure_beside_its_udp_baseline() {
    let report = common::run_report(
        env!("CARGO_BIN_EXE_fabric"),
        &["--quick", "--quiet", "--samples", "100", "--peers", "2,64"],
    );
    assert_eq!(report["program"], "fabric");
    assert_eq!(report["verified"], true);
    let hosts = report["hosts"].as_str().expect("hosts");
    assert!(["netns", "loopback"].contains(&hosts), "{hosts}");
    assert_eq!(report["hosts_detail"]["kind"], hosts);
    if hosts == "loopback" {
        assert!(report["hosts_detail"]["fallback_reason"].is_string());
    }
    // CI runs as root, where the namespaces must work.
    if std::env::var("CI").as_deref() == Ok("true") && is_root() {
        assert_eq!(hosts, "netns", "{}", report["hosts_detail"]);
    }
    let plan = &report["plan"];
    let sizes: Vec<f64> = array(plan, "/bandwidth_bytes")
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    let lossy_sizes: Vec<f64> = array(plan, "/lossy_bandwidth_bytes")
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    assert!(!sizes.is_empty() && !lossy_sizes.is_empty());

    let modes = array(&report, "/modes");
    let names: Vec<&str> = modes.iter().filter_map(|m| m["mode"].as_str()).collect();
    assert_eq!(names, ["event", "poll"]);
    for mode in modes {
        assert!(mode["udp_error"].is_null(), "{}", mode["udp_error"]);
        let trips = array(mode, "/udp/round_trips");
        let payloads: Vec<f64> = trips.iter().map(|t| number(t, "/payload_bytes")).collect();
        assert_eq!(payloads, [64.0, 8.0]);
        for trip in trips {
            assert_eq!(trip["verified"], true);
            assert_eq!(number(trip, "/us/samples"), 100.0);
            assert!(number(trip, "/us/median") > 0.0);
        }
        let udp_64 = number(&trips[0], "/us/median");
        let udp_8 = number(&trips[1], "/us/median");
        let bulk = number(mode, "/udp/bulk/gb_per_s/median");
        assert!(bulk > 0.0);
        let delivered = number(mode, "/udp/bulk/delivered_fraction");
        assert!(delivered > 0.0 && delivered <= 1.0, "{delivered}");
        assert_eq!(mode["udp"]["bulk"]["batching"], "plain");
        let segmented = number(mode, "/udp/bulk_segmented/gb_per_s/median");
        assert!(segmented > 0.0);
        assert_eq!(mode["udp"]["bulk_segmented"]["batching"], "segmented");
        let delivered = number(mode, "/udp/bulk_segmented/delivered_fraction");
        assert!(delivered > 0.0 && delivered <= 1.0, "{delivered}");

        let lossless = &mode["lossless"];
        assert!(lossless["error"].is_null(), "{}", lossless["error"]);
        let latency = &lossless["latency"];
        assert_eq!(latency["verified"], true);
        assert_eq!(number(latency, "/bytes"), 8.0);
        // Fewer when the figure's time ran out (a loaded machine), never
        // fewer than ten.
        let samples = number(latency, "/us/samples");
        assert!((10.0..=100.0).contains(&samples), "{samples}");
        let median = number(latency, "/us/median");
        assert!(median > 0.0);
        assert!(close(
            number(latency, "/over_udp_64_round_trip"),
            median / udp_64
        ));
        assert!(close(
            number(latency, "/over_udp_8_round_trip"),
            median / udp_8
        ));
        let figures = array(lossless, "/bandwidth");
        let measured: Vec<f64> = figures.iter().map(|f| number(f, "/bytes")).collect();
        assert_eq!(measured, sizes);
        for f in figures {
            assert_eq!(f["verified"], true, "{f}");
            let rate = number(f, "/gb_per_s/median");
            assert!(rate > 0.0);
            assert!(number(f, "/gb_per_s/samples") >= 1.0);
            assert!(close(number(f, "/over_udp_bulk"), rate / bulk));
            assert!(close(
                number(f, "/over_udp_bulk_segmented"),
                rate / segmented
            ));
            assert!(f["over_lossless"].is_null());
        }
        // Node 0 started every write, node 1 served them.
        let counters = array(lossless, "/counters");
        assert_eq!(counters.len(), 2);
        // Each device's own line (its answer goes on with a line per peer).
        assert_eq!(number(&counters[0], "/node"), 0.0);
        assert_eq!(number(&counters[1], "/node"), 1.0);
        assert!(number(&counters[0], "/completed") > 0.0);
        assert_eq!(number(&counters[0], "/failed"), 0.0);
        assert!(number(&counters[1], "/served") > 0.0);

        let lossy = &mode["lossy"];
        assert!(lossy["error"].is_null(), "{}", lossy["error"]);
        assert!(lossy["latency"].is_null());
        let lossy_figures = array(lossy, "/bandwidth");
        let measured: Vec<f64> = lossy_figures.iter().map(|f| number(f, "/bytes")).collect();
        assert_eq!(measured, lossy_sizes);
        for f in lossy_figures {
            assert_eq!(f["verified"], true, "{f}");
            let rate = number(f, "/gb_per_s/median");
            let without = figures
                .iter()
                .find(|l| l["bytes"] == f["bytes"])
                .map(|l| number(l, "/gb_per_s/median"))
                .expect("the lossless figure of the same size");
            assert!(close(number(f, "/over_lossless"), rate / without));
            assert!(close(number(f, "/over_udp_bulk"), rate / bulk));
        }
        // Loss was injected, and the fabric recovered from it.
        let lossy_counters = array(lossy, "/counters");
        assert!(number(&lossy_counters[0], "/retransmissions") > 0.0);
    }

    let memory = &report["memory"];
    assert!(memory["error"].is_null(), "{}", memory["error"]);
    let endpoint = array(memory, "/endpoint");
    let peers: Vec<f64> = endpoint.iter().map(|e| number(e, "/peers")).collect();
    assert_eq!(peers, [2.0, 64.0]);
    for e in endpoint {
        let fixed = number(e, "/fixed_bytes");
        let per_peer = number(e, "/per_peer_bytes");
        assert!(fixed > number(e, "/pool_bytes") && per_peer > 0.0, "{e}");
        assert_eq!(
            number(e, "/total_bytes"),
            fixed + per_peer * number(e, "/peers")
        );
        assert!(number(e, "/heap_fixed_bytes") > 0.0);
        assert!(number(e, "/heap_per_peer_bytes") > 0.0);
    }
    let rss = array(memory, "/device_rss");
    let rss_peers: Vec<f64> = rss.iter().map(|d| number(d, "/peers")).collect();
    assert_eq!(rss_peers, [0.0, 2.0, number(plan, "/rss_peers")]);
    for d in rss {
        assert!(number(d, "/rss_bytes") > 0.0);
    }
    // The device's own accounting agrees with the endpoint's.
    assert!(rss[0]["link_memory_fixed"].is_null());
    for d in &rss[1..] {
        assert_eq!(
            number(d, "/link_memory_per_peer"),
            number(&endpoint[0], "/per_peer_bytes")
        );
        assert_eq!(
            number(d, "/link_memory_fixed"),
            number(&endpoint[0], "/fixed_bytes")
        );
        // The link's buffers: at least its receive buffers (64 KiB each).
        assert!(number(d, "/link_memory_buffers") >= 65536.0, "{d}");
    }
    assert!(memory["device_fabric_fixed_rss_bytes"].is_number());
    assert!(memory["device_rss_per_peer_bytes"].is_number());

    let targets = array(&report, "/targets");
    // Per mode: the round trip, the streams of 1 MiB and more, the lossy
    // streams; then six memory targets.
    let big = sizes
        .iter()
        .filter(|&&s| s >= f64::from(1u32 << 20))
        .count();
    assert_eq!(targets.len(), 2 * (1 + big + lossy_sizes.len()) + 6);
    for t in targets {
        let measured = number(t, "/measured");
        let target = number(t, "/target");
        let met = match t["bound"].as_str() {
            Some("at_most") => measured <= target,
            Some("at_least") => measured >= target,
            other => panic!("bound {other:?} in {t}"),
        };
        assert_eq!(t["met"], met, "{t}");
    }

    report_sections_show_every_figure(&report);
}

/// The report's sections built from the document: every figure has our
/// points, every row our number, the UDP limit of every mode is there
/// (it ran), nothing is listed missing, and the ids are the full run's.
fn report_sections_show_every_figure(report: &Value) {
    use pindown_benches::report::figure::Role;

    let sections = pindown_benches::report::sections::fabric::fabric(report).expect("sections");
    assert_eq!(sections.len(), 1);
    let section = &sections[0];
    assert!(section.missing.is_empty(), "{:?}", section.missing);
    let ids: Vec<&str> = section.figures.iter().map(|f| f.id.as_str()).collect();
    assert_eq!(
        ids,
        [
            "fabric-latency",
            "fabric-bandwidth-event",
            "fabric-bandwidth-poll",
            "fabric-memory",
            "fabric-memory-per-peer"
        ]
    );
    for figure in &section.figures {
        for role in [Role::Ours, Role::Limit, Role::Paper] {
            let wanted = match role {
                Role::Paper => figure.id.starts_with("fabric-memory"),
                Role::Limit => !figure.id.starts_with("fabric-memory"),
                _ => true,
            };
            if wanted {
                assert!(
                    figure
                        .series
                        .iter()
                        .any(|s| s.role == role && !s.points.is_empty()),
                    "{} has no {role:?} points",
                    figure.id
                );
            }
        }
    }
    // The bandwidth figures carry the document's medians.
    let modes = array(report, "/modes");
    for (mode, name) in modes.iter().zip(["event", "poll"]) {
        let figure = section
            .figures
            .iter()
            .find(|f| f.id == format!("fabric-bandwidth-{name}"))
            .unwrap();
        let lossless: Vec<(f64, f64)> = array(mode, "/lossless/bandwidth")
            .iter()
            .map(|f| (number(f, "/bytes"), number(f, "/gb_per_s/median")))
            .collect();
        assert_eq!(figure.series[0].points, lossless);
    }
    assert!(section.rows.len() >= 8, "{:?}", section.rows);
    for row in &section.rows {
        assert!(row.ours.is_some(), "{row:?}");
        if let Some(limit) = &row.limit {
            assert!(limit.value.is_some(), "{row:?}");
        }
    }
    assert!(section.rows.iter().any(|r| r.paper.is_some()));
}
