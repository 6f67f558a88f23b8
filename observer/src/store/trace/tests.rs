//! Format tests on synthetic events (the recorded-run round trip is in
//! `observer/tests/trace.rs`).

use std::{
    io::Write,
    path::Path,
    sync::{Arc, Condvar, Mutex},
    time::Duration,
};

use observer_common::model::{
    Component, Components, Counter, Counters, EngineTelemetry, Event, ExpertGrid, ExpertRead, ExplicitReads,
    LatencyHistograms, ModelInfo, ObserverHealth, ProcessSample, ReadKinds, Residency, RunEnd, RunHeader, StepKind,
    ThreadToken, TokenMarks, TokenRecord,
};

use super::*;
use crate::sinks::Sink;

/// A `Write` into a shared buffer.
#[derive(Clone, Default)]
struct Shared(Arc<Mutex<Vec<u8>>>);
impl Write for Shared {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

pub(crate) fn header() -> RunHeader {
    RunHeader {
        observer_version: "0.1.0".into(),
        mode: "ebpf".into(),
        kernel: "6.18.0".into(),
        host: "h".into(),
        cpu_model: "cpu ünïcode".into(),
        n_cpus: 2,
        mem_total_bytes: 24 << 30,
        boot_id: "b0".into(),
        started_unix_ns: 1_753_000_000_000_000_000,
        started_mono_ns: 5_000_000,
        target_pid: 42,
        target_command: vec!["engine".into(), "run".into(), "--dense".into(), "anon".into()],
        model: Some(ModelInfo {
            path: "/m/x.gguf".into(),
            size_bytes: 123,
            hash: "crc32:0011aabb".into(),
            page_bytes: Some(4096),
        }),
        engine_config: [("dense".to_string(), "anon".to_string())].into_iter().collect(),
        probes: vec!["fault_entry".into()],
        tokens: "engine markers in /usr/bin/engine".into(),
        degraded: vec!["kprobe:zram_rw_page: not on this kernel".into()],
    }
}

pub(crate) fn token(seq: u64) -> TokenRecord {
    let mut counters = Counters::default();
    counters.set(Counter::Minflt, Some(seq * 3));
    counters.set(Counter::ReadBytes, Some(4096 * seq));
    let mut components = Components::from_kernel(&[60, 10, 5, 5, 0, 0, 10, 5, 5, 0, 0].map(|v| v * 1000 + seq));
    if seq.is_multiple_of(3) {
        components.set(Component::Reclaim, None);
    }
    TokenRecord {
        seq,
        index: Some(seq + 1),
        kind: if seq == 0 { StepKind::Prompt } else { StepKind::Generate },
        n_tokens: if seq == 0 { 7 } else { 1 },
        start_ns: 1_000_000 + seq * 200_000,
        wall_ns: 100_000 + seq,
        components,
        residual_ns: -3,
        counters,
        engine_compute_ns: Some(80_000),
        threads: vec![ThreadToken { tid: 43, comm: "worker \"q\"".into(), components, counters, residual_ns: 7 }],
        engine: Some(EngineTelemetry {
            wall_ns: Some(100_000),
            cache_hit_pct: Some(0.1 + 0.2),
            dense_resident_frac: Some(1.0 / 3.0),
            ..Default::default()
        }),
        residency: (seq % 2 == 1).then(|| Residency {
            dense_resident_frac: Some(0.852_000_000_000_000_1),
            dense_swapped_frac: Some(f64::MIN_POSITIVE),
            experts_resident_frac: None,
            grid: Some(ExpertGrid {
                n_layers: 2,
                n_experts: 3,
                layers: vec![1, 2],
                resident: vec![0.0, 1.0, 0.1, 1.0 / 3.0, 2.0 / 3.0, 1e-7],
                added: Some(vec![1, 2, 3, 4, 5, 6]),
                evicted: None,
                read_bytes: Some(vec![0, 0, 1 << 33, 0, 5, 0]),
                read_calls: Some(vec![0, 0, 2, 0, 1, 0]),
                refault_faults: None,
                refault_io_ns: None,
            }),
            engine_cache: None,
        }),
        lost_events: seq % 2,
        evicted_by: None,
        refaults: None,
        // Every other record carries explicit reads: they round-trip, and their absence too.
        explicit_reads: seq.is_multiple_of(2).then(|| ExplicitReads {
            bytes: ReadKinds([4096, 3 << 20, 0]),
            ns: ReadKinds([1_000, 2_500_000, 0]),
            calls: ReadKinds([1, 6, 0]),
            unresolved_bytes: seq,
            unresolved_calls: seq.min(1),
            experts: vec![
                ExpertRead { layer: 1, expert: 2, bytes: 1 << 20, calls: 3 },
                ExpertRead { layer: 3, expert: 0, bytes: 2 << 20, calls: 1 },
            ],
            lost_bytes: 0,
        }),
    }
}

pub(crate) fn stream(n: u64) -> Vec<Event> {
    let mut v = vec![Event::Header(header())];
    for i in 0..n {
        v.push(Event::Token(token(i)));
        if i == 1 {
            // A wrapper's child exec'd an engine: what marks the tokens is restated.
            v.push(Event::Marks(TokenMarks {
                mono_ns: i,
                pid: 43,
                tokens: "engine profile llama.cpp: llama_process in /l/libllama.so".into(),
                probes: vec!["fault_entry".into(), "uprobe:/l/libllama.so:llama_process".into()],
                degraded: Vec::new(),
            }));
        }
        if i % 2 == 1 {
            v.push(Event::Process(ProcessSample { mono_ns: i, rss_bytes: Some(1 << 20), ..Default::default() }));
        }
        if i % 3 == 2 {
            v.push(Event::Histograms(LatencyHistograms {
                mono_ns: i,
                kinds: [("minflt".to_string(), vec![0, 3, 5, 1])].into_iter().collect(),
                sum_ns: [("minflt".to_string(), 12_345)].into_iter().collect(),
            }));
            v.push(Event::Health(ObserverHealth {
                mono_ns: i,
                lost_events: 1,
                probes_attached: 16,
                ..Default::default()
            }));
        }
    }
    v.push(Event::End(RunEnd { mono_ns: 99, exit_code: Some(0), lost_events: 2 }));
    v
}

/// Record `events` through the real sink; returns the file's bytes.
fn record(events: &[Event]) -> Vec<u8> {
    let buf = Shared::default();
    let mut w = TraceWriter::from_writer(buf.clone(), Path::new("mem"), 1 << 16).unwrap();
    for e in events {
        w.event(e).unwrap();
    }
    drop(w);
    buf.0.lock().unwrap().clone()
}

fn read(bytes: &[u8]) -> (Vec<Event>, Vec<Issue>, Reader<&[u8]>) {
    let mut r = Reader::new(bytes, Path::new("mem")).unwrap();
    let ev: Vec<Event> = r.by_ref().collect();
    let issues = r.issues().to_vec();
    (ev, issues, r)
}

/// Offsets where each record starts, and the file length.
fn record_starts(bytes: &[u8]) -> Vec<usize> {
    let mut v = Vec::new();
    let mut at = FILE_HEADER_LEN;
    while at < bytes.len() {
        v.push(at);
        let h = parse_record_header(&bytes[at..]).expect("valid record");
        at += RECORD_HEADER_LEN + h.len as usize;
    }
    assert_eq!(at, bytes.len());
    v
}

#[test]
fn layout_is_as_specified() {
    let h = file_header();
    assert_eq!(&h[0..8], b"MOETRACE");
    assert_eq!(u16::from_le_bytes([h[8], h[9]]), 1);
    assert_eq!(u32::from_le_bytes(h[12..16].try_into().unwrap()), crc32fast::hash(&h[..12]));
    // CRC-32/ISO-HDLC check value.
    assert_eq!(crc32fast::hash(b"123456789"), 0xCBF4_3926);
    let r = encode_record(KIND_TOKEN, b"{}");
    assert_eq!(r.len(), 22);
    assert_eq!(&r[0..4], b"MREC");
    assert_eq!((r[4], r[5]), (KIND_TOKEN, ENCODING_JSON));
    assert_eq!(u32::from_le_bytes(r[8..12].try_into().unwrap()), 2);
    assert_eq!(u32::from_le_bytes(r[12..16].try_into().unwrap()), crc32fast::hash(b"{}"));
    assert_eq!(u32::from_le_bytes(r[16..20].try_into().unwrap()), crc32fast::hash(&r[0..16]));
}

#[test]
fn record_kinds_follow_the_type_tag() {
    for (ev, kind) in stream(3).iter().map(|e| (e, kind_of_payload(&serde_json::to_vec(e).unwrap()))) {
        let tag = serde_json::to_value(ev).unwrap()["type"].as_str().unwrap().to_string();
        assert_eq!(KINDS.iter().find(|(_, t)| *t == tag).map(|(k, _)| *k), Some(kind), "{tag}");
    }
    assert_eq!(kind_of_payload(b"{\"type\":\"later\"}"), KIND_OTHER);
}

#[test]
fn round_trip_is_exact() {
    let events = stream(20);
    let bytes = record(&events);
    let (back, issues, r) = read(&bytes);
    assert!(issues.is_empty(), "{issues:?}");
    assert_eq!(back, events);
    assert!(r.complete());
    assert_eq!(
        r.recorder(),
        Some(RecorderStats { records_written: events.len() as u64, dropped_tokens: 0, dropped_other: 0 })
    );
}

#[test]
fn not_a_trace_and_newer_versions_are_clear_errors() {
    let e = Reader::new(&b"# bmoe_metrics v1\n"[..], Path::new("x.csv")).unwrap_err();
    assert!(e.to_string().contains("x.csv is not an observer trace"), "{e}");
    let mut h = file_header();
    h[8] = 9;
    let crc = crc32fast::hash(&h[0..12]);
    h[12..16].copy_from_slice(&crc.to_le_bytes());
    let e = Reader::new(&h[..], Path::new("new.trace")).unwrap_err();
    assert!(e.to_string().contains("version 9") && e.to_string().contains("newer observer"), "{e}");
}

#[test]
fn truncation_at_every_byte_reads_every_complete_record() {
    let events = stream(4);
    let bytes = record(&events);
    let starts = record_starts(&bytes);
    assert_eq!(starts.len(), events.len());
    for cut in 0..=bytes.len() {
        let (back, issues, r) = read(&bytes[..cut]);
        // Records that end at or before the cut.
        let complete = starts
            .iter()
            .enumerate()
            .filter(|&(i, _)| starts.get(i + 1).copied().unwrap_or(bytes.len()) <= cut)
            .count();
        assert_eq!(back, events[..complete], "cut at {cut}");
        let boundary = cut == bytes.len() || (cut >= FILE_HEADER_LEN && starts.contains(&cut));
        if boundary {
            assert!(issues.is_empty(), "cut at {cut} (a record boundary): {issues:?}");
        } else {
            let partial_at = if cut < FILE_HEADER_LEN { 0 } else { starts[complete] as u64 };
            assert_eq!(issues.len(), 1, "cut at {cut}: {issues:?}");
            match &issues[0] {
                Issue::Truncated { offset, available, .. } => {
                    assert_eq!(*offset, partial_at, "cut at {cut}");
                    assert_eq!(offset + available, cut as u64, "cut at {cut}");
                }
                other => panic!("cut at {cut}: expected a truncation, got {other}"),
            }
            assert!(issues[0].to_string().contains(&format!("truncated at byte {partial_at}")));
        }
        assert_eq!(r.complete(), cut == bytes.len());
    }
}

#[test]
fn a_damaged_byte_anywhere_costs_at_most_its_own_record() {
    let events = stream(3);
    let bytes = record(&events);
    let starts = record_starts(&bytes);
    for at in 0..bytes.len() {
        let mut b = bytes.clone();
        b[at] ^= 0x5A;
        if at < FILE_MAGIC.len() {
            assert!(Reader::new(&b[..], Path::new("mem")).is_err(), "a damaged magic is not a trace");
            continue;
        }
        let (back, issues, _) = read(&b);
        if at < FILE_HEADER_LEN {
            assert_eq!(back, events, "damage in the file header at {at}");
            assert_eq!(issues.len(), 1);
            continue;
        }
        let hit = starts.iter().rposition(|&s| s <= at).unwrap();
        let mut expect = events.clone();
        expect.remove(hit);
        assert_eq!(back, expect, "damage at byte {at} (record {hit})");
        assert_eq!(issues.len(), 1, "damage at {at}: {issues:?}");
        assert_eq!(issues[0].offset(), starts[hit] as u64, "damage at {at}: {}", issues[0]);
        assert!(matches!(issues[0], Issue::Corrupt { .. }), "{}", issues[0]);
    }
}

#[test]
fn garbage_in_the_middle_is_reported_and_skipped() {
    let events = stream(6);
    let bytes = record(&events);
    let starts = record_starts(&bytes);
    // Overwrite records 3 and 4 entirely with garbage that contains fake magics.
    let mut b = bytes.clone();
    for (i, x) in b[starts[3]..starts[5]].iter_mut().enumerate() {
        *x = b"MREC\x02\x01garbage"[i % 13];
    }
    let (back, issues, r) = read(&b);
    let mut expect = events.clone();
    expect.drain(3..5);
    assert_eq!(back, expect);
    assert_eq!(issues.len(), 1, "{issues:?}");
    assert_eq!(
        issues[0],
        Issue::Corrupt {
            offset: starts[3] as u64,
            skipped: (starts[5] - starts[3]) as u64,
            reason: "record header checksum mismatch".into()
        }
    );
    assert!(r.complete());
}

#[test]
fn unknown_kinds_and_undecodable_payloads_are_skipped() {
    let events = stream(1);
    let mut bytes = file_header().to_vec();
    bytes.extend(encode_record(KIND_HEADER, &serde_json::to_vec(&events[0]).unwrap()));
    let at_unknown = bytes.len() as u64;
    bytes.extend(encode_record(77, b"{}"));
    let at_future = bytes.len() as u64;
    bytes.extend(encode_record(KIND_OTHER, b"{\"type\":\"future_event\",\"x\":1}"));
    let at_bad = bytes.len() as u64;
    bytes.extend(encode_record(KIND_TOKEN, b"{\"type\":\"token\"}"));
    bytes.extend(encode_record(KIND_TOKEN, &serde_json::to_vec(&events[1]).unwrap()));
    let (back, issues, r) = read(&bytes);
    assert_eq!(back, events[..2]);
    assert_eq!(issues.len(), 3, "{issues:?}");
    assert!(matches!(issues[0], Issue::Unknown { offset, kind: 77, .. } if offset == at_unknown));
    assert!(matches!(issues[1], Issue::Unknown { offset, kind: KIND_OTHER, .. } if offset == at_future));
    assert!(matches!(issues[2], Issue::Undecodable { offset, .. } if offset == at_bad));
    assert!(!r.complete(), "no end record");
    assert_eq!(r.recorder(), None);
}

/// A writer that blocks until released: the disk that does not keep up.
#[derive(Clone, Default)]
struct Gate {
    open: Arc<(Mutex<bool>, Condvar)>,
    out: Shared,
}
impl Write for Gate {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        let (m, c) = &*self.open;
        let mut open = m.lock().unwrap();
        while !*open {
            let (o, timeout) = c.wait_timeout(open, Duration::from_secs(60)).unwrap();
            open = o;
            if timeout.timed_out() {
                break; // the test fails on its counts rather than hanging
            }
        }
        drop(open);
        self.out.write(b)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn a_stalled_disk_drops_and_counts_instead_of_blocking() {
    let gate = Gate::default();
    let (m, _) = &*gate.open;
    *m.lock().unwrap() = true; // let the file header through
    let mut w = TraceWriter::from_writer(gate.clone(), Path::new("gate"), 8).unwrap();
    *m.lock().unwrap() = false;
    let events = stream(200);
    let n_tok = events.iter().filter(|e| matches!(e, Event::Token(_))).count() as u64;
    let other = |e: &&Event| !matches!(e, Event::Token(_) | Event::Header(_) | Event::End(_));
    let n_proc = events.iter().filter(other).count() as u64;
    for e in &events[..events.len() - 1] {
        w.event(e).unwrap();
    }
    let (dt, dp) = w.dropped();
    // The disk is stalled: at most the channel (8) plus the one event the
    // writer holds got through; everything else was dropped, not waited for.
    assert!(dt + dp >= n_tok + n_proc - 9, "dropped {dt}+{dp} of {}", n_tok + n_proc);
    {
        let (m, c) = &*gate.open;
        *m.lock().unwrap() = true;
        c.notify_all();
    }
    w.event(events.last().unwrap()).unwrap();
    drop(w);
    let bytes = gate.out.0.lock().unwrap().clone();
    let (back, issues, r) = read(&bytes);
    assert!(issues.is_empty(), "{issues:?}");
    let s = r.recorder().expect("end record has the recorder's counts");
    assert_eq!((s.dropped_tokens, s.dropped_other), (dt, dp));
    let got_tok = back.iter().filter(|e| matches!(e, Event::Token(_))).count() as u64;
    let got_proc = back.iter().filter(other).count() as u64;
    assert_eq!(got_tok + dt, n_tok);
    assert_eq!(got_proc + dp, n_proc);
    assert_eq!(s.records_written, back.len() as u64);
    assert!(matches!(back.first(), Some(Event::Header(_))) && matches!(back.last(), Some(Event::End(_))));
}

#[test]
fn an_unwritable_trace_is_a_clear_error() {
    let e = TraceWriter::create(Path::new("/no/such/dir/run.trace")).unwrap_err();
    assert!(e.to_string().contains("/no/such/dir/run.trace"), "{e}");
}

/// Token records whose grids are deltas: losing one record to damage loses the grids of
/// the records after it until the next key frame, each reported; nothing is read wrong.
#[test]
fn a_lost_grid_costs_the_deltas_until_the_next_key_frame() {
    let n = super::grid::KEY_EVERY + 6;
    let mut events = vec![Event::Header(header())];
    for seq in 0..n {
        let mut t = token(seq);
        let r = t.residency.get_or_insert_with(Default::default);
        let mut g = ExpertGrid {
            n_layers: 3,
            n_experts: 5,
            layers: vec![0, 1, 2],
            resident: (0..15).map(|i| if (i + seq / 4) % 3 == 0 { 0.5 } else { 1.0 }).collect(),
            added: Some(vec![seq as u32; 15]),
            evicted: None,
            read_bytes: None,
            read_calls: None,
            refault_faults: None,
            refault_io_ns: None,
        };
        g.resident[0] = seq as f32 / 100.0;
        r.grid = Some(g);
        events.push(Event::Token(t));
    }
    events.push(Event::End(RunEnd { mono_ns: 99, exit_code: Some(0), lost_events: 0 }));
    let bytes = record(&events);
    let (back, issues, _) = read(&bytes);
    assert!(issues.is_empty(), "{issues:?}");
    assert_eq!(back, events);
    // Damage the record of token 3 (record 4: after the header).
    let starts = record_starts(&bytes);
    let mut b = bytes.clone();
    b[starts[4] + RECORD_HEADER_LEN + 30] ^= 0x5A;
    let (back, issues, _) = read(&b);
    let mut expect = events.clone();
    expect.remove(4);
    for e in &mut expect {
        if let Event::Token(t) = e
            && (4..super::grid::KEY_EVERY).contains(&t.seq)
            && let Some(r) = &mut t.residency
        {
            r.grid = None;
        }
    }
    assert_eq!(back, expect);
    assert!(matches!(issues[0], Issue::Corrupt { .. }), "{}", issues[0]);
    let partial: Vec<&Issue> = issues[1..].iter().filter(|i| matches!(i, Issue::Partial { .. })).collect();
    assert_eq!(partial.len(), issues.len() - 1);
    assert_eq!(partial.len() as u64, super::grid::KEY_EVERY - 4, "{issues:?}");
    assert!(partial[0].to_string().contains("delta against token record 3"), "{}", partial[0]);
}

/// An older reader's rules: a token record with a packed grid, read as a plain `Event`
/// (unknown keys skipped), is the record without its grid.
#[test]
fn a_reader_without_grid_packing_reads_the_record_without_its_grid() {
    let t = token(1);
    assert!(t.residency.as_ref().unwrap().grid.is_some());
    let bytes = record(&[Event::Header(header()), Event::Token(t.clone())]);
    let starts = record_starts(&bytes);
    let len = u32::from_le_bytes(bytes[starts[1] + 8..starts[1] + 12].try_into().unwrap()) as usize;
    let payload = &bytes[starts[1] + RECORD_HEADER_LEN..starts[1] + RECORD_HEADER_LEN + len];
    let plain: Event = serde_json::from_slice(payload).unwrap();
    let mut want = t;
    want.residency.as_mut().unwrap().grid = None;
    assert_eq!(plain, Event::Token(want));
}
