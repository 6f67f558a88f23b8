use std::{
    collections::BTreeMap,
    io::{Read, Write},
    net::TcpStream,
};

use observer_common::{
    HIST_BUCKETS,
    model::{
        Component, Components, Counter as C, Counters, Event, ExpertGrid, LatencyHistograms, ObserverHealth,
        ProcessSample, Residency, RunEnd, RunHeader, StepKind, TokenRecord,
    },
};

use super::{http::*, *};

/// `series → value` of an exposition (comments skipped).
fn samples(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (k, v) = l.rsplit_once(' ').unwrap_or_else(|| panic!("bad line {l:?}"));
            (k.to_string(), v.parse().unwrap_or_else(|_| panic!("bad value in {l:?}")))
        })
        .collect()
}

fn get(s: &BTreeMap<String, f64>, k: &str) -> f64 {
    *s.get(k).unwrap_or_else(|| panic!("no series {k} in {s:#?}"))
}

fn token(seq: u64, kind: StepKind, wall: u64) -> TokenRecord {
    let mut c = Components::from_kernel(&[600, 100, 0, 200, 0, 0, 50, 30, 20, 0, 0]);
    c.set(Component::SwapinZram, None);
    c.set(Component::Unattributed, None);
    c.set(Component::IoWaitPeer, None);
    let mut counters = Counters::default();
    counters.set(C::Minflt, Some(7));
    counters.set(C::ReadBytes, Some(4096));
    TokenRecord {
        seq,
        index: Some(seq),
        kind,
        n_tokens: if kind == StepKind::Prompt { 5 } else { 1 },
        start_ns: 0,
        wall_ns: wall,
        components: c,
        residual_ns: 0,
        counters,
        engine_compute_ns: Some(900),
        threads: Vec::new(),
        engine: None,
        residency: None,
        lost_events: 0,
        evicted_by: None,
        refaults: None,
        explicit_reads: None,
    }
}

fn hists(n: u64) -> LatencyHistograms {
    let mut b = vec![0u64; HIST_BUCKETS];
    b[10] = n;
    b[HIST_BUCKETS - 1] = 1;
    LatencyHistograms {
        mono_ns: 0,
        kinds: [("majflt_file".to_string(), b)].into_iter().collect(),
        sum_ns: [("majflt_file".to_string(), 1000 * n)].into_iter().collect(),
    }
}

fn health(lost: u64, bpf_ns: u64) -> ObserverHealth {
    ObserverHealth {
        mono_ns: 0,
        lost_events: lost,
        probes_attached: 17,
        probes_missing: 1,
        bpf_run_ns: Some(bpf_ns),
        bpf_run_count: Some(bpf_ns / 100),
        ..Default::default()
    }
}

fn feed(s: &mut MetricsSink, evs: &[Event]) {
    for e in evs {
        s.event(e).unwrap();
    }
}

#[test]
fn tokens_become_counters_with_kind_labels_and_unmeasured_values_are_absent() {
    let ex = Exporter::new();
    let mut s = ex.sink();
    let mut t3 = token(3, StepKind::Window, 1000);
    t3.engine_compute_ns = None;
    feed(
        &mut s,
        &[
            Event::Header(RunHeader::default()),
            Event::Token(token(0, StepKind::Prompt, 2000)),
            Event::Token(token(1, StepKind::Generate, 1000)),
            Event::Token(token(2, StepKind::Generate, 1024)),
            Event::Token(t3),
        ],
    );
    let text = ex.render(Format::Text).unwrap();
    let m = samples(&text);
    assert_eq!(get(&m, r#"moe_observer_step_duration_seconds_count{step="generate"}"#), 2.0);
    assert_eq!(get(&m, r#"moe_observer_tokens_total{step="prompt"}"#), 5.0);
    assert!(!m.contains_key(r#"moe_observer_tokens_total{step="window"}"#), "windows are not tokens");
    assert_eq!(get(&m, r#"moe_observer_step_duration_seconds_count{step="window"}"#), 1.0);
    assert_eq!(get(&m, r#"moe_observer_time_seconds_total{step="generate",component="compute"}"#), 1200e-9);
    assert_eq!(get(&m, r#"moe_observer_time_seconds_total{step="generate",component="fault_io"}"#), 400e-9);
    assert_eq!(get(&m, r#"moe_observer_faults_total{step="generate",kind="minor"}"#), 14.0);
    assert_eq!(get(&m, r#"moe_observer_read_bytes_total{step="generate"}"#), 8192.0);
    // Never measured: no series and no descriptor.
    assert!(!text.contains("swapin_zram"), "{text}");
    assert!(!text.contains("unattributed") && !text.contains("io_wait_peer"), "{text}");
    assert!(!text.contains("kind=\"file\""), "{text}");
    assert!(!text.contains("dense_resident"), "{text}");
    assert!(!text.contains("lost_events"), "{text}");
    // Hidden cost: over steps where both are known.
    assert_eq!(get(&m, r#"moe_observer_engine_compute_seconds_total{step="generate"}"#), 1800e-9);
    assert_eq!(get(&m, r#"moe_observer_engine_steps_compute_seconds_total{step="generate"}"#), 1200e-9);
    assert_eq!(get(&m, r#"moe_observer_engine_steps_total{step="generate"}"#), 2.0);
    assert!(!m.contains_key(r#"moe_observer_engine_steps_total{step="window"}"#));
    // Step durations: exact log2 bounds, an exact sum (the wall time) and the step count.
    assert_eq!(get(&m, r#"moe_observer_step_duration_seconds_bucket{step="generate",le="1.024e-06"}"#), 2.0);
    assert_eq!(get(&m, r#"moe_observer_step_duration_seconds_bucket{step="generate",le="5.12e-07"}"#), 0.0);
    assert!((get(&m, r#"moe_observer_step_duration_seconds_sum{step="generate"}"#) - 2024e-9).abs() < 1e-15);
    assert_eq!(get(&m, "moe_observer_target_up"), 1.0);
    assert_eq!(get(&m, "moe_observer_runs_total"), 1.0);
    assert_eq!(
        get(&m, &format!("moe_observer_build_info{{version=\"{}\",trace_format=\"1\"}}", env!("CARGO_PKG_VERSION"))),
        1.0
    );
}

#[test]
fn residency_process_and_health_gauges_live_while_the_target_runs() {
    let ex = Exporter::new();
    let mut s = ex.sink();
    let mut t = token(0, StepKind::Generate, 1000);
    t.residency = Some(Residency {
        dense_resident_frac: Some(0.75),
        dense_swapped_frac: None,
        experts_resident_frac: Some(0.5),
        grid: Some(ExpertGrid {
            n_layers: 2,
            n_experts: 4,
            layers: vec![1, 3],
            resident: vec![1.0, 1.0, 0.0, 0.0, 0.25, 0.25, 0.25, 0.25],
            added: None,
            evicted: None,
            read_bytes: None,
            read_calls: None,
            refault_faults: None,
            refault_io_ns: None,
        }),
        engine_cache: None,
    });
    feed(
        &mut s,
        &[
            Event::Header(RunHeader::default()),
            Event::Token(t),
            Event::Process(ProcessSample {
                mono_ns: 0,
                rss_bytes: Some(1 << 20),
                swap_bytes: None,
                ..Default::default()
            }),
            Event::Health(health(3, 1000)),
        ],
    );
    let m = samples(&ex.render(Format::Text).unwrap());
    assert_eq!(get(&m, "moe_observer_dense_resident_ratio"), 0.75);
    assert!(!m.contains_key("moe_observer_dense_swapped_ratio"));
    assert_eq!(get(&m, "moe_observer_experts_resident_ratio"), 0.5);
    assert_eq!(get(&m, r#"moe_observer_layer_experts_resident_ratio{layer="1"}"#), 0.5);
    assert_eq!(get(&m, r#"moe_observer_layer_experts_resident_ratio{layer="3"}"#), 0.25);
    assert_eq!(get(&m, "moe_observer_target_rss_bytes"), 1048576.0);
    assert!(!m.contains_key("moe_observer_target_swap_bytes"));
    assert_eq!(get(&m, "moe_observer_probes_attached"), 17.0);
    assert_eq!(get(&m, "moe_observer_lost_events_total"), 3.0);
    assert_eq!(get(&m, "moe_observer_bpf_run_seconds_total"), 1e-6);
    assert_eq!(get(&m, "moe_observer_bpf_runs_total"), 10.0);
    s.event(&Event::End(RunEnd { mono_ns: 0, exit_code: Some(0), lost_events: 5 })).unwrap();
    let m = samples(&ex.render(Format::Text).unwrap());
    assert_eq!(get(&m, "moe_observer_target_up"), 0.0);
    assert_eq!(get(&m, "moe_observer_lost_events_total"), 5.0, "the run's final count");
    for gone in ["target_rss_bytes", "probes_attached", "dense_resident_ratio", "layer_experts_resident_ratio"] {
        assert!(!m.keys().any(|k| k.contains(gone)), "{gone} outlived the target: {m:#?}");
    }
}

#[test]
fn counters_never_go_down_across_target_restarts() {
    let ex = Exporter::new();
    // Two target lifetimes, each with its own sink (as `observer serve` does)
    // and per-run cumulative histograms, lost events and BPF run time.
    for _run in 0..2 {
        let mut s = ex.sink();
        feed(
            &mut s,
            &[
                Event::Header(RunHeader::default()),
                Event::Histograms(hists(4)),
                Event::Health(health(1, 500)),
                Event::Token(token(0, StepKind::Generate, 1000)),
                Event::Histograms(hists(10)),
                Event::Health(health(2, 800)),
                Event::End(RunEnd { mono_ns: 0, exit_code: Some(0), lost_events: 2 }),
            ],
        );
    }
    let m = samples(&ex.render(Format::Text).unwrap());
    assert_eq!(get(&m, "moe_observer_runs_total"), 2.0);
    assert_eq!(get(&m, "moe_observer_lost_events_total"), 4.0);
    assert_eq!(get(&m, "moe_observer_bpf_run_seconds_total"), 1600e-9);
    assert_eq!(get(&m, r#"moe_observer_fault_latency_seconds_bucket{kind="file",le="+Inf"}"#), 22.0);
    assert_eq!(get(&m, r#"moe_observer_fault_latency_seconds_bucket{kind="file",le="1.024e-06"}"#), 20.0);
    assert_eq!(get(&m, r#"moe_observer_fault_latency_seconds_count{kind="file"}"#), 22.0);
    assert_eq!(get(&m, r#"moe_observer_fault_latency_seconds_sum{kind="file"}"#), 20e-6, "deltas of the kernel's sums");
    assert_eq!(get(&m, r#"moe_observer_step_duration_seconds_count{step="generate"}"#), 2.0);
}

#[test]
fn a_run_without_health_samples_measures_no_lost_events() {
    let ex = Exporter::new();
    let mut s = ex.sink();
    feed(
        &mut s,
        &[Event::Header(RunHeader::default()), Event::End(RunEnd { mono_ns: 0, exit_code: Some(0), lost_events: 0 })],
    );
    let text = ex.render(Format::Text).unwrap();
    assert!(!text.contains("lost_events"), "{text}");
    assert!(!text.contains("bpf_run"), "{text}");
}

#[test]
fn openmetrics_has_units_and_eof_and_text_has_total_names() {
    let ex = Exporter::new();
    let mut s = ex.sink();
    feed(&mut s, &[Event::Header(RunHeader::default()), Event::Token(token(0, StepKind::Generate, 1000))]);
    s.event(&Event::Histograms(hists(1))).unwrap();
    let om = ex.render(Format::OpenMetrics).unwrap();
    assert!(om.ends_with("# EOF\n"), "{om}");
    assert_eq!(om.matches("# EOF").count(), 1);
    assert!(om.contains("# TYPE moe_observer_time_seconds counter\n"), "{om}");
    assert!(om.contains("# UNIT moe_observer_time_seconds seconds\n"), "{om}");
    assert!(om.contains("# UNIT moe_observer_read_bytes bytes\n"), "{om}");
    assert!(om.contains("# UNIT moe_observer_fault_latency_seconds seconds\n"), "{om}");
    let kernel_at = om.find("fault_latency").unwrap();
    assert!(kernel_at < om.find("# EOF").unwrap());
    let text = ex.render(Format::Text).unwrap();
    assert!(text.contains("# TYPE moe_observer_time_seconds_total counter\n"), "{text}");
    assert!(!text.contains("# EOF") && !text.contains("# UNIT"), "{text}");
}

/// Every family of the vocabulary is exported under the name it renders, and
/// nothing else is: fed a stream that measures everything.
#[test]
fn every_family_of_the_vocabulary_is_exported_under_its_name() {
    let ex = Exporter::new();
    let mut s = ex.sink();
    let mut t = token(0, StepKind::Generate, 1000);
    t.explicit_reads = Some(observer_common::model::ExplicitReads {
        bytes: observer_common::model::ReadKinds([1, 2, 3]),
        ns: observer_common::model::ReadKinds([4, 5, 6]),
        ..Default::default()
    });
    for c in C::ALL {
        t.counters.set(c, Some(1));
    }
    t.refaults = Some(Default::default());
    t.residency = Some(Residency {
        dense_resident_frac: Some(1.0),
        dense_swapped_frac: Some(0.0),
        experts_resident_frac: Some(1.0),
        grid: Some(ExpertGrid {
            n_layers: 1,
            n_experts: 1,
            layers: vec![3],
            resident: vec![1.0],
            added: None,
            evicted: None,
            read_bytes: None,
            read_calls: None,
            refault_faults: None,
            refault_io_ns: None,
        }),
        engine_cache: None,
    });
    let mut h = hists(1);
    h.kinds.insert("zram_read".into(), vec![1]);
    h.sum_ns.insert("zram_read".into(), 5);
    feed(
        &mut s,
        &[
            Event::Header(RunHeader { degraded: vec!["tokens: none found".into()], ..Default::default() }),
            Event::Token(t),
            Event::Process(ProcessSample {
                mono_ns: 0,
                rss_bytes: Some(1),
                rss_anon_bytes: Some(1),
                rss_file_bytes: Some(1),
                swap_bytes: Some(1),
                mem_available_bytes: Some(1),
                evicted_by_process: vec![observer_common::model::ProcessEvictions {
                    kind: "fadvise".into(),
                    pid: 7,
                    comm: "dd".into(),
                    pages: 1,
                }],
            }),
            Event::Histograms(h),
            Event::Health(health(1, 100)),
        ],
    );
    let text = ex.render(Format::Text).unwrap();
    let types: Vec<&str> =
        text.lines().filter_map(|l| l.strip_prefix("# TYPE ")).filter_map(|l| l.split(' ').next()).collect();
    let want: Vec<String> =
        observer_common::vocab::FAMILIES.iter().map(|f| observer_common::vocab::metric_name(f)).collect();
    let mut a: Vec<String> = types.iter().map(|t| t.to_string()).collect();
    let mut b = want.clone();
    a.sort();
    b.sort();
    assert_eq!(a, b, "{text}");
}

#[test]
fn addresses_default_to_loopback() {
    assert_eq!(parse_addr("9464").unwrap(), vec!["127.0.0.1:9464".parse().unwrap()]);
    assert_eq!(parse_addr(":9464").unwrap(), vec!["127.0.0.1:9464".parse().unwrap()]);
    assert_eq!(parse_addr("0.0.0.0:1").unwrap(), vec!["0.0.0.0:1".parse().unwrap()]);
    assert_eq!(parse_addr("[::1]:80").unwrap(), vec!["[::1]:80".parse().unwrap()]);
    for bad in ["", "host", "70000", ":x", "no.such.host.invalid:1"] {
        let e = parse_addr(bad).unwrap_err().to_string();
        assert!(e.contains("--metrics-addr"), "{bad}: {e}");
    }
}

#[test]
fn accept_headers_pick_the_format() {
    let prom = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
    assert_eq!(negotiate(Some(prom)), Format::OpenMetrics);
    assert_eq!(negotiate(None), Format::Text);
    assert_eq!(negotiate(Some("*/*")), Format::Text);
    assert_eq!(negotiate(Some("text/plain;version=0.0.4")), Format::Text);
    assert_eq!(negotiate(Some("text/plain;q=0.9, application/openmetrics-text;q=0.5")), Format::Text);
    assert_eq!(negotiate(Some("application/openmetrics-text; version=1.0.0; q=0")), Format::Text);
}

#[test]
fn request_heads_parse() {
    let r = parse_head("GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\nACCEPT: text/plain\r\naccept: */*").unwrap();
    assert_eq!(r, Request { method: "GET".into(), path: "/metrics".into(), accept: Some("text/plain,*/*".into()) });
    assert!(parse_head("GET /metrics").is_none());
    assert!(parse_head("GET /metrics SPDY/3").is_none());
    assert!(parse_head("GET /metrics HTTP/1.1\r\nno colon").is_none());
}

fn http(addr: std::net::SocketAddr, req: &str) -> (String, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(req.as_bytes()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let (head, body) = out.split_once("\r\n\r\n").unwrap_or_else(|| panic!("no head end in {out:?}"));
    (head.to_string(), body.to_string())
}

#[test]
fn the_endpoint_answers_with_the_right_content_types_and_codes() {
    let ex = Exporter::new();
    let mut s = ex.sink();
    feed(&mut s, &[Event::Header(RunHeader::default()), Event::Token(token(0, StepKind::Generate, 1000))]);
    let ep = Endpoint::start("127.0.0.1:0", Arc::clone(&ex)).unwrap();
    let a = ep.local_addr();
    assert!(a.ip().is_loopback() && a.port() != 0);

    let (h, b) = http(
        a,
        "GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: application/openmetrics-text;version=1.0.0,*/*;q=0.1\r\n\r\n",
    );
    assert!(h.starts_with("HTTP/1.1 200 OK\r\n"), "{h}");
    assert!(h.contains("Content-Type: application/openmetrics-text; version=1.0.0; charset=utf-8"), "{h}");
    assert!(h.contains(&format!("Content-Length: {}", b.len())), "{h}");
    assert!(b.ends_with("# EOF\n"));

    let (h, b) = http(a, "GET /metrics HTTP/1.0\r\n\r\n");
    assert!(h.contains("Content-Type: text/plain; version=0.0.4; charset=utf-8"), "{h}");
    assert!(b.contains("moe_observer_step_duration_seconds_count{step=\"generate\"} 1"), "{b}");

    let (h, b) = http(a, "HEAD /metrics HTTP/1.1\r\n\r\n");
    assert!(h.starts_with("HTTP/1.1 200") && b.is_empty(), "{h}");
    let (h, b) = http(a, "GET /healthz HTTP/1.1\r\n\r\n");
    assert!(h.starts_with("HTTP/1.1 200") && b == "ok\n", "{h}\n{b}");
    ex.degrade("page residency: no ptrace rights");
    ex.degrade("page residency: no ptrace rights");
    let (_, b) = http(a, "GET /healthz HTTP/1.1\r\n\r\n");
    assert_eq!(b, "ok\ndegraded: page residency: no ptrace rights\n", "said once");
    let (h, _) = http(a, "GET /nope HTTP/1.1\r\n\r\n");
    assert!(h.starts_with("HTTP/1.1 404"), "{h}");
    let (h, _) = http(a, "POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n");
    assert!(h.starts_with("HTTP/1.1 405") && h.contains("Allow: GET, HEAD"), "{h}");
    let (h, _) = http(a, "BLAH\r\n\r\n");
    assert!(h.starts_with("HTTP/1.1 400"), "{h}");
    let big = format!("GET /metrics HTTP/1.1\r\nX: {}\r\n\r\n", "a".repeat(10_000));
    let (h, _) = http(a, &big);
    assert!(h.starts_with("HTTP/1.1 431"), "{h}");

    // A busy port is a clear error naming the address and the cause.
    let e = Endpoint::start(&a.to_string(), Arc::clone(&ex)).unwrap_err().to_string();
    assert!(e.contains(&a.to_string()) && e.contains("something else listens") && e.contains("--metrics-addr"), "{e}");
    // An address this machine does not have (TEST-NET-1) is not called a busy port.
    let e = Endpoint::start("192.0.2.1:9464", Arc::clone(&ex)).unwrap_err().to_string();
    assert!(e.contains("192.0.2.1:9464") && e.contains("not an address of this machine"), "{e}");
    assert!(!e.contains("something else"), "{e}");
    drop(ep);
    assert!(TcpStream::connect(a).is_err(), "the endpoint stops with its handle");
}

#[test]
fn evictions_split_by_actor_become_actor_labels_that_add_up() {
    use observer_common::model::{EvictedBy, N_EVICTION_ACTORS};
    let ex = Exporter::new();
    let mut s = ex.sink();
    let split = |fadvise: u64, kswapd: u64| {
        let mut t = token(1, StepKind::Generate, 1000);
        t.counters.set(C::PagecacheEvicted, Some(fadvise + kswapd));
        let mut by = [0; N_EVICTION_ACTORS];
        by[4] = fadvise;
        by[0] = kswapd;
        t.evicted_by = Some(EvictedBy(by));
        t
    };
    let mut plain = token(3, StepKind::Prompt, 1000);
    plain.counters.set(C::PagecacheEvicted, Some(9));
    feed(&mut s, &[Event::Token(split(100, 3)), Event::Token(split(20, 0)), Event::Token(plain)]);
    let m = samples(&ex.render(Format::Text).unwrap());
    let f = "moe_observer_pagecache_evicted_pages_total";
    assert_eq!(vocab::EVICTION_ACTORS[4].name, "fadvise");
    assert_eq!(get(&m, &format!(r#"{f}{{step="generate",actor="fadvise"}}"#)), 120.0);
    assert_eq!(get(&m, &format!(r#"{f}{{step="generate",actor="kswapd"}}"#)), 3.0);
    assert_eq!(get(&m, &format!(r#"{f}{{step="generate",actor="other"}}"#)), 0.0, "a measured 0");
    assert!(!m.contains_key(&format!(r#"{f}{{step="generate"}}"#)), "split steps have no unlabelled series");
    assert_eq!(get(&m, &format!(r#"{f}{{step="prompt"}}"#)), 9.0, "steps without a split keep the total");
    let generate: f64 = m.iter().filter(|(k, _)| k.starts_with(&format!(r#"{f}{{step="generate""#))).map(|x| x.1).sum();
    assert_eq!(generate, 123.0, "Σ over actors = the steps' pagecache_evicted");
}

#[test]
fn refaults_per_actor_kind_become_three_families_with_the_actor_label() {
    use observer_common::model::Refaults;
    let ex = Exporter::new();
    let mut s = ex.sink();
    let with = |pages: u64, faults: u64, io_ns: u64| {
        let mut t = token(1, StepKind::Generate, 1000);
        let mut r = Refaults::default();
        r.pages.0[4] = pages;
        r.faults.0[4] = faults;
        r.fault_io_ns.0[4] = io_ns;
        t.refaults = Some(r);
        t
    };
    feed(&mut s, &[Event::Token(with(3418, 3418, 172_000_000)), Event::Token(with(2, 1, 500_000))]);
    let m = samples(&ex.render(Format::Text).unwrap());
    let l = r#"{step="generate",actor="fadvise"}"#;
    assert_eq!(get(&m, &format!("moe_observer_refaulted_pages_total{l}")), 3420.0);
    assert_eq!(get(&m, &format!("moe_observer_refault_faults_total{l}")), 3419.0);
    assert!((get(&m, &format!("moe_observer_refault_io_seconds_total{l}")) - 0.1725).abs() < 1e-12);
    let k = r#"{step="generate",actor="kswapd"}"#;
    assert_eq!(get(&m, &format!("moe_observer_refaulted_pages_total{k}")), 0.0, "a measured 0");
    // Steps without refaults have no series.
    assert!(!m.keys().any(|k| k.starts_with("moe_observer_refaulted_pages_total{step=\"prompt\"")));
}

/// Per-process eviction lists (cumulative, as the session samples them) become
/// `pagecache_evicted_by_name_pages_total{actor, actor_name}`: at most
/// `TOP_ACTOR_NAMES` names, kept for good once given, the rest `other`; per kind the
/// series add up to the list's total at every scrape, also when a list's `other` row
/// grows or a named process drops out of the bounded list.
#[test]
fn process_names_are_a_bounded_label_and_other_is_the_rest_exactly() {
    use observer_common::model::ProcessEvictions;
    let ex = Exporter::new();
    let mut s = ex.sink();
    let row = |kind: &str, pid: u32, comm: String, pages: u64| ProcessEvictions { kind: kind.into(), pid, comm, pages };
    let top = vocab::TOP_ACTOR_NAMES;
    let n = top as u32 + 5;
    // Sample 1: n processes, process i evicted 10 * (i + 1) pages (the list is most pages first).
    let mut list: Vec<ProcessEvictions> =
        (0..n).rev().map(|i| row("fadvise", 100 + i, format!("p{i}"), 10 * u64::from(i + 1))).collect();
    list.push(row("fadvise", 0, "other".into(), 7));
    list.push(row("kswapd", 45, "kswapd0".into(), 5));
    let sample =
        |l: &[ProcessEvictions]| Event::Process(ProcessSample { evicted_by_process: l.to_vec(), ..Default::default() });
    let check = |l: &[ProcessEvictions], ex: &Exporter| {
        let m = samples(&ex.render(Format::Text).unwrap());
        let f = "moe_observer_pagecache_evicted_by_name_pages_total";
        let series: Vec<(&String, &f64)> = m.iter().filter(|(k, _)| k.starts_with(f)).collect();
        let names: std::collections::BTreeSet<&str> =
            series.iter().map(|(k, _)| k.split("actor_name=\"").nth(1).unwrap().split('"').next().unwrap()).collect();
        assert!(names.len() <= top + 1, "{names:?}");
        for kind in ["fadvise", "kswapd"] {
            let want: u64 = l.iter().filter(|r| r.kind == kind).map(|r| r.pages).sum();
            let got: f64 = series.iter().filter(|(k, _)| k.contains(&format!("actor=\"{kind}\""))).map(|x| *x.1).sum();
            assert_eq!(got, want as f64, "{kind}: Σ series vs the list");
        }
        m
    };
    feed(&mut s, &[sample(&list)]);
    let m = check(&list, &ex);
    // The names with most pages came first: p{n-1} … p{n-top}; kswapd0 came after them.
    let f = "moe_observer_pagecache_evicted_by_name_pages_total";
    let top_name = format!("p{}", n - 1);
    assert_eq!(get(&m, &format!(r#"{f}{{actor="fadvise",actor_name="{top_name}"}}"#)), 10.0 * f64::from(n));
    let rest: u64 = (0..n - top as u32).map(|i| 10 * u64::from(i + 1)).sum::<u64>() + 7;
    assert_eq!(get(&m, &format!(r#"{f}{{actor="fadvise",actor_name="other"}}"#)), rest as f64);
    assert_eq!(get(&m, &format!(r#"{f}{{actor="kswapd",actor_name="other"}}"#)), 5.0, "no name left for kswapd0");
    // Sample 2: the top process grows, a small one grows, the other row grows, and a named process
    // leaves the list (its pages now in the list's other row).
    let mut later = list.clone();
    later[0].pages += 100; // p{n-1}
    later[n as usize - 1].pages += 3; // p0, no name of its own
    let gone = later.remove(1); // p{n-2}: named, now in other
    let other = later.iter_mut().find(|r| r.pid == 0).unwrap();
    other.pages += gone.pages + 4;
    feed(&mut s, &[sample(&later)]);
    let m = check(&later, &ex);
    assert_eq!(get(&m, &format!(r#"{f}{{actor="fadvise",actor_name="{top_name}"}}"#)), 10.0 * f64::from(n) + 100.0);
    assert_eq!(get(&m, &format!(r#"{f}{{actor="fadvise",actor_name="p{}"}}"#, n - 2)), gone.pages as f64, "kept");
    assert_eq!(get(&m, &format!(r#"{f}{{actor="fadvise",actor_name="other"}}"#)), (rest + 3 + 4) as f64);
    // The run's totals say the same as the last sample: nothing more.
    feed(
        &mut s,
        &[Event::Totals(observer_common::model::RunTotals { evicted_by_process: later.clone(), ..Default::default() })],
    );
    check(&later, &ex);
}

/// Two targets at once (`serve --discover`): each sink's series carry its
/// target's labels first, the two never mix, one's end takes only its own
/// gauges away, and a model name with a quote is escaped.
#[test]
fn several_targets_at_once_each_with_its_labels() {
    let ex = Exporter::per_target();
    let la = target_labels("moe-engine", "a.gguf", "");
    let lb = target_labels("llama.cpp", "b \"q\".gguf", "0123456789ab");
    let (mut a, mut b) = (ex.target_sink(la), ex.target_sink(lb));
    let degraded = RunHeader { degraded: vec!["tokens: --token-symbol: no symbol `x`".into()], ..Default::default() };
    feed(&mut a, &[Event::Header(RunHeader::default())]);
    feed(&mut b, &[Event::Header(degraded)]);
    for i in 0..3 {
        feed(&mut a, &[Event::Token(token(i, StepKind::Generate, 1000))]);
    }
    feed(&mut b, &[Event::Token(token(0, StepKind::Generate, 1000)), Event::Histograms(hists(4))]);
    let rss = |n| Event::Process(ProcessSample { mono_ns: 0, rss_bytes: Some(n), ..Default::default() });
    feed(&mut a, &[rss(1 << 20)]);
    feed(&mut b, &[rss(2 << 20)]);
    let text = ex.render(Format::Text).unwrap();
    let m = samples(&text);
    let a_l = r#"engine="moe-engine",model="a.gguf",container="""#;
    let b_l = r#"engine="llama.cpp",model="b \"q\".gguf",container="0123456789ab""#;
    assert_eq!(get(&m, &format!("moe_observer_tokens_total{{{a_l},step=\"generate\"}}")), 3.0);
    assert_eq!(get(&m, &format!("moe_observer_tokens_total{{{b_l},step=\"generate\"}}")), 1.0);
    assert_eq!(
        get(&m, &format!("moe_observer_time_seconds_total{{{a_l},step=\"generate\",component=\"compute\"}}")),
        1800e-9
    );
    assert_eq!(get(&m, &format!("moe_observer_target_rss_bytes{{{a_l}}}")), 1048576.0);
    assert_eq!(get(&m, &format!("moe_observer_target_rss_bytes{{{b_l}}}")), 2097152.0);
    assert_eq!(get(&m, &format!("moe_observer_fault_latency_seconds_count{{{b_l},kind=\"file\"}}")), 5.0);
    assert_eq!(get(&m, &format!("moe_observer_target_up{{{a_l}}}")), 1.0);
    assert_eq!(get(&m, &format!("moe_observer_degraded{{{b_l},feature=\"tokens\"}}")), 1.0);
    assert!(ex.health().contains("degraded: llama.cpp b \"q\".gguf 0123456789ab: tokens: --token-symbol"));
    assert!(
        !m.contains_key("moe_observer_target_up") && !m.contains_key("moe_observer_runs_total"),
        "no unlabelled slot"
    );
    // Every series of a per-target family carries the three labels, first.
    for k in
        m.keys().filter(|k| !k.starts_with("moe_observer_build_info") && !k.starts_with("moe_observer_mem_available"))
    {
        assert!(k.contains(&format!("{{{a_l}")) || k.contains(&format!("{{{b_l}")), "{k} lacks the target labels");
    }
    feed(&mut b, &[Event::End(RunEnd { mono_ns: 0, exit_code: None, lost_events: 0 })]);
    let m = samples(&ex.render(Format::Text).unwrap());
    assert_eq!(get(&m, &format!("moe_observer_target_up{{{b_l}}}")), 0.0);
    assert!(!m.contains_key(&format!("moe_observer_target_rss_bytes{{{b_l}}}")), "b's gauges went stale");
    assert!(!m.contains_key(&format!("moe_observer_degraded{{{b_l},feature=\"tokens\"}}")));
    assert_eq!(get(&m, &format!("moe_observer_target_rss_bytes{{{a_l}}}")), 1048576.0, "a's stay");
    assert_eq!(get(&m, &format!("moe_observer_tokens_total{{{b_l},step=\"generate\"}}")), 1.0, "counters stay");
}

#[test]
fn a_relabelled_target_moves_its_gauges_and_counts_on_under_the_new_labels() {
    let ex = Exporter::per_target();
    let old = target_labels("moe-engine", "", "");
    let new = target_labels("moe-engine", "m.gguf", "");
    let (tx, rx) = tokio::sync::watch::channel(old.clone());
    let mut s = ex.target_sink(old).follow_labels(rx);
    let rss = |n| Event::Process(ProcessSample { mono_ns: 0, rss_bytes: Some(n), ..Default::default() });
    let degraded = RunHeader { degraded: vec!["tokens: refused".into()], ..Default::default() };
    feed(&mut s, &[Event::Header(degraded), rss(1 << 20), Event::Token(token(0, StepKind::Generate, 1000))]);
    tx.send_replace(new);
    feed(&mut s, &[rss(2 << 20), Event::Token(token(1, StepKind::Generate, 1000))]);
    let m = samples(&ex.render(Format::Text).unwrap());
    let (o, n) = (r#"engine="moe-engine",model="",container="""#, r#"engine="moe-engine",model="m.gguf",container="""#);
    assert_eq!(get(&m, &format!("moe_observer_target_up{{{o}}}")), 0.0);
    assert_eq!(get(&m, &format!("moe_observer_target_up{{{n}}}")), 1.0);
    assert!(!m.contains_key(&format!("moe_observer_target_rss_bytes{{{o}}}")), "the gauge moved");
    assert_eq!(get(&m, &format!("moe_observer_target_rss_bytes{{{n}}}")), 2097152.0);
    assert!(!m.contains_key(&format!("moe_observer_degraded{{{o},feature=\"tokens\"}}")));
    assert_eq!(get(&m, &format!("moe_observer_degraded{{{n},feature=\"tokens\"}}")), 1.0, "the degradation moved");
    assert_eq!(get(&m, &format!("moe_observer_tokens_total{{{o},step=\"generate\"}}")), 1.0, "counted before");
    assert_eq!(get(&m, &format!("moe_observer_tokens_total{{{n},step=\"generate\"}}")), 1.0, "counted after");
    assert_eq!(get(&m, &format!("moe_observer_runs_total{{{n}}}")), 1.0);
    feed(&mut s, &[Event::End(RunEnd { mono_ns: 0, exit_code: None, lost_events: 0 })]);
    let m = samples(&ex.render(Format::Text).unwrap());
    assert_eq!(get(&m, &format!("moe_observer_target_up{{{n}}}")), 0.0);
    assert!(!m.keys().any(|k| k.starts_with("moe_observer_degraded{")), "{m:#?}");
}

#[test]
fn marks_add_the_degradations_found_during_the_run() {
    let ex = Exporter::new();
    let mut s = ex.sink();
    let marks = observer_common::model::TokenMarks { degraded: vec!["tokens: refused".into()], ..Default::default() };
    feed(&mut s, &[Event::Header(RunHeader::default()), Event::Marks(marks)]);
    let m = samples(&ex.render(Format::Text).unwrap());
    assert_eq!(get(&m, "moe_observer_degraded{feature=\"tokens\"}"), 1.0);
    assert_eq!(ex.health(), "ok\ndegraded: tokens: refused\n");
}
