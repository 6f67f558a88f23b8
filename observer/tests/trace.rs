//! `observer record` end to end: real probes on real workloads, the trace read
//! back and compared with the run's own JSON summary, the workload's own
//! clock, truncated at every byte, damaged, and cut by SIGKILL.

#[path = "support/chrome.rs"]
mod chrome;
mod common;

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use common::*;
use observer::store::trace::{Issue, Reader};
use observer_common::model::{Event, TokenRecord};
use serde_json::Value;

fn out_dir(name: &str) -> PathBuf {
    let d = scratch_dir("trace").join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

struct Recorded {
    trace: PathBuf,
    summary: Value,
    workload: Vec<Value>,
    stderr: String,
}

/// `observer record -o DIR/run.trace --json DIR/run.json ARGS`.
fn record(dir: &Path, args: &[&str]) -> Recorded {
    let trace = dir.join("run.trace");
    let json = dir.join("run.json");
    let o = Command::new(OBSERVER)
        .args(["record", "-o", trace.to_str().unwrap(), "--json", json.to_str().unwrap(), "--every", "0"])
        .args(args)
        .output()
        .expect("run observer record");
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "observer record failed: {}\n{stderr}", o.status);
    let summary = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let workload = String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    Recorded { trace, summary, workload, stderr }
}

fn read(bytes: &[u8]) -> (Vec<Event>, Vec<Issue>) {
    let mut r = Reader::new(bytes, Path::new("mem")).expect("a trace");
    let ev: Vec<Event> = r.by_ref().collect();
    (ev, r.issues().to_vec())
}

fn tokens(ev: &[Event]) -> Vec<TokenRecord> {
    ev.iter().filter_map(|e| if let Event::Token(t) = e { Some(t.clone()) } else { None }).collect()
}

/// Offsets of the records (walking the format's length fields).
fn record_starts(b: &[u8]) -> Vec<usize> {
    let mut v = Vec::new();
    let mut at = 16;
    while at + 20 <= b.len() {
        v.push(at);
        at += 20 + u32::from_le_bytes(b[at + 8..at + 12].try_into().unwrap()) as usize;
    }
    assert_eq!(at, b.len(), "records tile the file");
    v
}

fn observer_ok(args: &[&str]) -> String {
    let o = Command::new(OBSERVER).args(args).output().expect("run observer");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "observer {args:?} failed:\n{err}");
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn a_recorded_run_reads_back_identically_and_survives_any_damage() {
    let _l = machine_lock();
    let dir = out_dir("demo");
    let data = dir.join("demo.bin");
    let r = record(&dir, &["--", workload(), "demo", "--path", data.to_str().unwrap(), "--size", "32M"]);
    let bytes = std::fs::read(&r.trace).unwrap();
    let (ev, issues) = read(&bytes);
    assert!(issues.is_empty(), "{issues:?}");

    // Header: the facts of this run.
    let Event::Header(h) = &ev[0] else { panic!("the first record is the header: {:?}", ev[0]) };
    assert_eq!(h.target_command[0], workload());
    assert_eq!(h.target_command[1], "demo");
    assert_eq!(h.boot_id, std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap().trim());
    assert_eq!(h.target_pid as u64, u(&r.summary["target"], "pid"));
    assert_eq!(h.engine_config["size"], "32M");
    assert!(matches!(ev.last(), Some(Event::End(e)) if e.exit_code == Some(0)));

    // Token records: identical to the ones `run --json` wrote from the same stream.
    let from_json: Vec<TokenRecord> = serde_json::from_value(r.summary["tokens"].clone()).unwrap();
    let got = tokens(&ev);
    assert!(got.len() >= 3, "the demo marks three phases: {}", got.len());
    assert_eq!(got, from_json);
    assert!(got.iter().any(|t| t.engine.is_some()), "the workload's telemetry is recorded");

    // Their walls against the workload's own clock, phase by phase.
    assert_eq!(r.workload.len(), got.len(), "{:?}", r.workload);
    for (t, w) in got.iter().zip(&r.workload) {
        assert_within(&format!("token {} wall", t.seq), t.wall_ns, u(w, "wall_ns"), 0.05);
    }

    // `report` over the trace: the same numbers as the run's own summary.
    let rep: Value = serde_json::from_str(&observer_ok(&["report", "--json", r.trace.to_str().unwrap()])).unwrap();
    assert_eq!(rep["recorder"]["dropped_tokens"], 0);
    assert_eq!(rep["lost_events"], r.summary["lost_events"]);
    let tok_s = rep["metrics"][0]["value"].as_f64().unwrap();
    let run_tok_s = r.summary["attribution"]["tok_s"].as_f64().unwrap();
    assert!((tok_s - run_tok_s).abs() < 1e-9 * run_tok_s, "report {tok_s} vs run {run_tok_s}");
    let wall_mean: f64 = r.workload.iter().map(|w| u(w, "wall_ns") as f64).sum::<f64>() / r.workload.len() as f64 / 1e6;
    let rep_wall = rep["metrics"].as_array().unwrap().iter().find(|m| m["metric"] == "wall_ms").unwrap()["value"]
        .as_f64()
        .unwrap();
    assert!((rep_wall - wall_mean).abs() <= 0.05 * wall_mean, "report wall {rep_wall} ms vs workload {wall_mean} ms");

    // Truncated at every byte: every complete record, and where it stopped.
    let starts = record_starts(&bytes);
    for cut in 0..bytes.len() {
        let (e, is) = read(&bytes[..cut]);
        let complete = starts.iter().skip(1).chain([&bytes.len()]).filter(|&&end| end <= cut).count();
        assert_eq!(e, ev[..complete], "cut at {cut}");
        let at_boundary = cut >= 16 && starts.contains(&cut);
        if at_boundary {
            assert!(is.is_empty(), "cut at {cut}: {is:?}");
        } else {
            let expect = if cut < 16 { 0 } else { starts[complete] as u64 };
            assert!(
                matches!(is.as_slice(), [Issue::Truncated { offset, .. }] if *offset == expect),
                "cut at {cut}: {is:?}"
            );
        }
    }

    // A damaged record in the middle: reported by position, skipped, the rest read.
    let mid = starts.len() / 2;
    let mut damaged = bytes.clone();
    damaged[starts[mid] + 20 + 5] ^= 0xFF;
    let bad = dir.join("damaged.trace");
    std::fs::write(&bad, &damaged).unwrap();
    let (e, is) = read(&damaged);
    let mut expect = ev.clone();
    expect.remove(mid);
    assert_eq!(e, expect);
    assert!(matches!(is.as_slice(), [Issue::Corrupt { offset, .. }] if *offset == starts[mid] as u64), "{is:?}");
    let text = observer_ok(&["report", bad.to_str().unwrap()]);
    assert!(text.contains(&format!("corrupt data at byte {}", starts[mid])), "{text}");

    // Export: a Chrome trace with one token slice per record, threads named.
    let chrome_out = dir.join("demo.json");
    observer_ok(&["export", "--chrome-trace", chrome_out.to_str().unwrap(), r.trace.to_str().unwrap()]);
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&chrome_out).unwrap()).unwrap();
    let c = chrome::check(&v);
    let pid = h.target_pid as u64;
    let tokens_track = &c.tracks[&(pid, observer::analysis::export::TOKENS_TID)];
    assert_eq!(tokens_track.iter().filter(|s| s.0.starts_with("token ")).count(), got.len());
    for t in got.iter() {
        for th in &t.threads {
            assert!(c.thread_names.contains_key(&(pid, th.tid as u64)), "thread {} named", th.tid);
            assert!(c.tracks.contains_key(&(pid, th.tid as u64)));
        }
    }
    assert!(c.process_names[&pid].contains("workload"));
    let _ = r.stderr;
}

/// `observer run`'s end-of-run table and JSON are a function of the model
/// stream alone: `observer report` on the trace of the same run prints the
/// same table and returns the same summary.
#[test]
fn the_run_table_is_what_report_prints_for_its_trace() {
    let _l = machine_lock();
    let dir = out_dir("table");
    let (trace, json, data) = (dir.join("run.trace"), dir.join("run.json"), dir.join("demo.bin"));
    let o = Command::new(OBSERVER)
        .args(["run", "--every", "0", "--record", trace.to_str().unwrap(), "--json", json.to_str().unwrap()])
        .args(["--", workload(), "demo", "--path", data.to_str().unwrap(), "--size", "16M"])
        .output()
        .expect("run observer");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "observer run failed:\n{err}");
    let run_json: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let pid = u(&run_json["target"], "pid");
    // The table: from its first line to the lost-events line.
    let lines: Vec<&str> = err.lines().collect();
    let first = lines
        .iter()
        .position(|l| l.starts_with(&format!("observer: pid {pid} (")) && l.contains(" observed for "))
        .unwrap_or_else(|| panic!("no table:\n{err}"));
    let last = first + lines[first..].iter().position(|l| l.contains("lost events: ")).expect("the table's end");
    let table = lines[first..=last].join("\n") + "\n";
    assert!(table.contains("where the time went") && table.contains("tokens: "), "a full table:\n{table}");

    let report = observer_ok(&["report", trace.to_str().unwrap()]);
    assert!(report.starts_with(&table), "run's table:\n{table}\nreport:\n{report}");
    let rep: Value = serde_json::from_str(&observer_ok(&["report", "--json", trace.to_str().unwrap()])).unwrap();
    assert_eq!(rep["summary"], run_json, "the JSON summary from the trace is the run's");
}

#[test]
fn windows_and_process_samples_round_trip() {
    let _l = machine_lock();
    let dir = out_dir("windows");
    let r = record(
        &dir,
        &[
            "--window",
            "20ms",
            "--sample-interval",
            "50ms",
            "--",
            "sh",
            "-c",
            "i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done",
        ],
    );
    let mut reader = Reader::open(&r.trace).unwrap();
    let ev: Vec<Event> = reader.by_ref().collect();
    assert!(reader.issues().is_empty(), "{:?}", reader.issues());
    assert!(reader.complete());
    assert_eq!(reader.recorder().map(|s| s.dropped()), Some(0));
    let got = tokens(&ev);
    let from_json: Vec<TokenRecord> = serde_json::from_value(r.summary["tokens"].clone()).unwrap();
    assert!(got.len() >= 10, "windows of 20 ms over a ~0.5 s loop: {}", got.len());
    assert_eq!(got, from_json);
    let samples = ev.iter().filter(|e| matches!(e, Event::Process(_))).count();
    assert!(samples >= 3, "process samples every 50 ms: {samples}");

    // diff of two recorded runs: the same numbers as each run's own summary.
    let dir2 = out_dir("windows2");
    let r2 =
        record(&dir2, &["--window", "20ms", "--", "sh", "-c", "i=0; while [ $i -lt 200000 ]; do i=$((i+1)); done"]);
    let j: Value =
        serde_json::from_str(&observer_ok(&["diff", "--json", r.trace.to_str().unwrap(), r2.trace.to_str().unwrap()]))
            .unwrap();
    for (k, s) in [&r.summary, &r2.summary].iter().enumerate() {
        assert!(s["attribution"]["tok_s"].is_null() && j["runs"][k]["tok_s"]["value"].is_null(), "windows: no tok/s");
        let side = if k == 0 { "a" } else { "b" };
        for (metric, key) in [("wall_ms", "wall_ns"), ("compute_ms", "compute_ns"), ("runqueue_ms", "runqueue_ns")] {
            let want = s["attribution"]["mean_ns"][key].as_f64().unwrap() / 1e6;
            let row = j["comparisons"][0]["rows"].as_array().unwrap().iter().find(|r| r["metric"] == metric).unwrap();
            let have = row[side]["value"].as_f64().unwrap();
            assert!((want - have).abs() <= 1e-9 * want.max(1e-9), "run {k} {metric}: diff {have} vs run {want}");
        }
    }
    let rows = j["comparisons"][0]["rows"].as_array().unwrap();
    assert!(rows.iter().any(|r| r["metric"] == "compute_ms"), "measured components are compared");
}

#[test]
fn sigkill_leaves_a_trace_whose_complete_records_read_back() {
    let _l = machine_lock();
    let dir = out_dir("sigkill");
    let trace = dir.join("killed.trace");
    let mut obs = Command::new(OBSERVER)
        .args([
            "record",
            "-o",
            trace.to_str().unwrap(),
            "--window",
            "10ms",
            "--sample-interval",
            "20ms",
            "--every",
            "0",
        ])
        .args(["--", "sh", "-c", "i=0; while [ $i -lt 20000000 ]; do i=$((i+1)); done"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn observer record");
    // Until the run ends the trace is written aside (`observer::output`), and a
    // killed observer leaves it there.
    let trace = dir.join(format!("killed.trace.partial-{}", obs.id()));
    let t0 = Instant::now();
    while std::fs::metadata(&trace).map(|m| m.len()).unwrap_or(0) < 64 << 10 {
        assert!(t0.elapsed() < Duration::from_secs(60), "the trace did not grow to 64 KiB in 60 s");
        assert!(obs.try_wait().unwrap().is_none(), "observer record ended early");
        std::thread::sleep(Duration::from_millis(20));
    }
    obs.kill().expect("SIGKILL the observer");
    obs.wait().unwrap();

    let mut reader = Reader::open(&trace).unwrap();
    let ev: Vec<Event> = reader.by_ref().collect();
    // End the target the killed observer left behind (its PID is in the header).
    if let Some(Event::Header(h)) = ev.first() {
        let comm = std::fs::read_to_string(format!("/proc/{}/comm", h.target_pid)).unwrap_or_default();
        if comm.trim() == "sh" {
            // SAFETY: plain syscall; the PID is our observer's target, still `sh`.
            unsafe { libc::kill(h.target_pid as i32, libc::SIGKILL) };
        }
    }
    assert!(matches!(ev.first(), Some(Event::Header(_))), "the header survives");
    assert!(tokens(&ev).len() >= 10, "{} token records", tokens(&ev).len());
    assert!(!reader.complete(), "no end record after SIGKILL");
    assert_eq!(reader.recorder(), None, "drops unknown without an end record");
    let issues = reader.issues();
    assert!(
        issues.iter().all(|i| matches!(i, Issue::Truncated { .. })) && issues.len() <= 1,
        "at most a truncated tail, never corruption: {issues:?}"
    );
    let size = std::fs::metadata(&trace).unwrap().len();
    match issues.first() {
        Some(Issue::Truncated { offset, available, .. }) => assert_eq!(offset + available, size),
        _ => assert_eq!(reader.offset(), size),
    }
    let text = observer_ok(&["report", trace.to_str().unwrap()]);
    assert!(text.contains("no end record"), "{text}");
}

/// Issue 9's last acceptance item, ready for when branch `engine` is merged
/// (`engine run --dense mmap|anon|locked`, the token markers, and a pressure
/// guard in testkit): two engine configurations that differ only in
/// `--dense`, recorded A-B-B-A (`anon`, `locked`, `locked`, `anon`) inside
/// the memory cgroup `cgroup` (a cgroup v1 or v2 directory with a limit below the
/// model plus its balloon, zram swap on, as the engine's pressure test sets
/// up), then `observer diff --json` of the four traces.
///
/// The test that calls it should assert: two sides, order `A-B-B-A` and
/// balanced; `swapin_zram_ms` and `majflt_swap` disjoint and higher for
/// `anon`; and the tok/s verdict equal to what the per-token walls of the four
/// traces say (recompute tokens / Σ wall per side from the traces; disjoint
/// iff the two intervals do not overlap). Run by hand on 2026-11-29 with the
/// engine branch's binary (86 MiB limit, 64 MiB balloon, 512 MiB zram, 64
/// tokens, 1 thread): anon 6.23 [4.81, 8.59] tok/s vs locked 12.68 [8.99,
/// 19.31], disjoint; swapin_zram 5.16 vs 0.08 ms/token; majflt_swap 1215 vs
/// 10.8 per token — and the two `locked` runs disagreed (8.3 vs 26.9 tok/s),
/// which `diff` flags as `between_runs`.
fn record_dense_ab_under_pressure(engine: &Path, model: &Path, cgroup: &Path, dir: &Path) -> Value {
    let mut traces = Vec::new();
    for (i, dense) in ["anon", "locked", "locked", "anon"].iter().enumerate() {
        testkit::drop_caches().expect("drop caches before each run");
        let trace = dir.join(format!("{}-{dense}.trace", i + 1));
        let _ = std::fs::remove_file(&trace);
        let o = Command::new(OBSERVER)
            .args(["record", "-o", trace.to_str().unwrap(), "--every", "0", "--cgroup", cgroup.to_str().unwrap()])
            .args(["--", engine.to_str().unwrap(), "run", "-m", model.to_str().unwrap(), "-p", "Once upon a time"])
            .args(["-n", "64", "-t", "1", "--ignore-eos", "--dense", dense])
            .output()
            .expect("run observer record");
        assert!(o.status.success(), "record {dense}: {}", String::from_utf8_lossy(&o.stderr));
        traces.push(trace.to_str().unwrap().to_string());
    }
    let mut args = vec!["diff", "--json"];
    args.extend(traces.iter().map(String::as_str));
    serde_json::from_str(&observer_ok(&args)).expect("diff JSON")
}

#[test]
fn dense_anon_vs_locked_under_pressure_diffs_into_the_right_verdict() {
    let _l = machine_lock();
    let dir = scratch_dir("dense-ab");
    let engine = engine_bin();
    let model = pressure_model();
    let dense_mib = {
        let g = engine::gguf::Gguf::open(&model).unwrap();
        g.tensors.iter().filter(|t| !t.is_routed_expert()).map(|t| t.size).sum::<u64>() >> 20
    };
    let p = testkit::Pressure::new(&testkit::PressureConfig {
        name: "observer-dense-ab".into(),
        limit_bytes: (dense_mib + 41) << 20,
        zram_mib: Some(512),
        balloon_mib: 64,
        balloon_touch: std::time::Duration::from_millis(100),
    })
    .expect("pressure setup (root, zram, a memory cgroup controller, v1 or v2)");
    let d = record_dense_ab_under_pressure(&engine, &model, p.cgroup.dir(), &dir);
    drop(p);
    let text = d.to_string();
    assert_eq!(d["sides"].as_array().map(Vec::len), Some(2), "two sides: {text}");
    let cmp = &d["comparisons"][0];
    assert_eq!(cmp["order"], "A-B-B-A", "{text}");
    assert_eq!(cmp["order_balanced"], true, "{text}");
    let settings = cmp["settings"].as_array().unwrap();
    assert!(settings.iter().any(|s| s["key"] == "dense"), "the compared setting is --dense: {text}");
    // Recompute tok/s per side straight from the traces' per-token walls, and
    // compare with diff's numbers and verdict.
    let mut walls: std::collections::BTreeMap<String, (u64, u64)> = Default::default();
    let mut zram: std::collections::BTreeMap<String, (u64, u64)> = Default::default();
    for entry in std::fs::read_dir(&dir).unwrap().flatten() {
        let path = entry.path();
        if path.extension().and_then(|e| e.to_str()) != Some("trace") {
            continue;
        }
        let dense = if path.to_str().unwrap().ends_with("anon.trace") { "anon" } else { "locked" };
        let mut r = Reader::open(&path).unwrap();
        for ev in r.by_ref() {
            if let Event::Token(t) = ev
                && t.kind == observer_common::model::StepKind::Generate
            {
                let e = walls.entry(dense.to_string()).or_default();
                e.0 += t.n_tokens;
                e.1 += t.wall_ns;
                if let Some(z) = t.components.get(observer_common::model::Component::SwapinZram) {
                    let e = zram.entry(dense.to_string()).or_default();
                    e.0 += 1;
                    e.1 += z;
                }
            }
        }
    }
    let tok_s = |k: &str| walls[k].0 as f64 / (walls[k].1 as f64 / 1e9);
    let rows = cmp["rows"].as_array().expect("metric rows");
    let row = |name: &str| rows.iter().find(|m| m["metric"] == name).unwrap_or_else(|| panic!("no {name} row: {text}"));
    let tps = row("tok_s");
    let (a, b) = (tps["a"]["value"].as_f64().unwrap(), tps["b"]["value"].as_f64().unwrap());
    let (anon_side_is_a, locked_tps, anon_tps) =
        if (a - tok_s("anon")).abs() < 1e-6 * a { (true, b, a) } else { (false, a, b) };
    assert!(
        (anon_tps - tok_s("anon")).abs() <= 1e-6 * anon_tps,
        "diff's anon tok/s {anon_tps} vs traces {}",
        tok_s("anon")
    );
    assert!((locked_tps - tok_s("locked")).abs() <= 1e-6 * locked_tps, "diff's locked tok/s vs traces");
    // The verdict is what the intervals say.
    let ci = |s: &str, k: &str| tps[s]["ci95"][k].as_f64().unwrap();
    let (alo, ahi, blo, bhi) = (ci("a", "lo"), ci("a", "hi"), ci("b", "lo"), ci("b", "hi"));
    let disjoint = ahi < blo || bhi < alo;
    assert_eq!(tps["disjoint"].as_bool(), Some(disjoint), "verdict vs intervals: {tps}");
    // The zram swap-in row is the per-token mean of the traces' own records.
    let zr = row("swapin_zram_ms");
    let (za, zb) = (zr["a"]["value"].as_f64().unwrap(), zr["b"]["value"].as_f64().unwrap());
    let (z_anon, z_locked) = if anon_side_is_a { (za, zb) } else { (zb, za) };
    for (side, z) in [("anon", z_anon), ("locked", z_locked)] {
        let (n, sum) = zram[side];
        let want = sum as f64 / n as f64 / 1e6;
        assert!((z - want).abs() <= 1e-9 * want.max(1e-9), "diff's {side} swapin_zram {z} vs traces {want}: {zr}");
    }
    // Physics the comparison must show: the mlocked copy is never swapped,
    // the plain anonymous copy is (the cgroup is smaller than the engine plus
    // the balloon). How much of that costs swap-ins per token depends on which
    // dense pages reclaim picked (the embedding table is mostly cold), so the
    // swap-in *time* is checked against the traces above, not against a sign.
    let sw = row("dense_swapped_frac");
    let (sa, sb) = (sw["a"]["value"].as_f64().unwrap(), sw["b"]["value"].as_f64().unwrap());
    let (s_anon, s_locked) = if anon_side_is_a { (sa, sb) } else { (sb, sa) };
    assert_eq!(s_locked, 0.0, "a locked dense copy cannot be swapped: {sw}");
    assert!(s_anon > 0.0, "the anonymous dense copy must be partly swapped under this pressure: {sw}");
}

/// A trace the wave-1 observer recorded (`observer record -- engine run -m tiny.gguf -n 12`,
/// before the vocabulary's renames and the packed expert grid; `data/README.md`) reads back
/// with today's reader: every record, the same token count, components that add up to each
/// token's wall time, and the renamed histogram kinds under their new names. Written again
/// with today's writer (grids packed), it reads back identically.
#[test]
fn a_wave1_trace_reads_back_with_todays_names() {
    use observer::{sinks::Sink, store::trace::TraceWriter};
    use observer_common::{
        model::Component,
        vocab::{self, Class},
    };
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/wave1-engine-tiny.trace");
    let bytes = std::fs::read(&path).unwrap();
    let mut r = Reader::new(bytes.as_slice(), &path).unwrap();
    let ev: Vec<Event> = r.by_ref().collect();
    assert!(r.issues().is_empty(), "{:?}", r.issues());
    assert!(r.complete(), "the end record");
    // Every record of the file: as many as its records tile it, and as the recorder wrote.
    assert_eq!(ev.len(), record_starts(&bytes).len());
    assert_eq!(r.records(), r.recorder().unwrap().records_written);
    let Event::Header(h) = &ev[0] else { panic!("{:?}", ev[0]) };
    let n = h.target_command.iter().position(|a| a == "-n").map(|i| &h.target_command[i + 1]);
    assert_eq!(n.map(String::as_str), Some("12"), "{:?}", h.target_command);
    let toks = tokens(&ev);
    assert_eq!(toks.len(), 12, "one record per token of `-n 12`");
    for t in &toks {
        assert_eq!(t.components.sum() as i64 + t.residual_ns, t.wall_ns as i64, "token {}", t.seq);
        // Components named after wave 1 are not measured there.
        for c in [Component::IoWaitPeer, Component::Unattributed] {
            assert_eq!(t.components.get(c), None);
        }
        assert!(t.components.get(Component::Compute).is_some_and(|v| v > 0));
        for th in &t.threads {
            assert_eq!(th.components.sum() as i64 + th.residual_ns, t.wall_ns as i64, "token {} tid {}", t.seq, th.tid);
        }
        if let Some(g) = t.residency.as_ref().and_then(|r| r.grid.as_ref()) {
            assert_eq!(g.resident.len(), (g.n_layers * g.n_experts) as usize);
        }
    }
    let grids = toks.iter().filter(|t| t.residency.as_ref().is_some_and(|r| r.grid.is_some())).count();
    assert!(grids >= 10, "wave 1 recorded the expert grid with (nearly) every token: {grids}");
    // Histogram kinds: wave 1 wrote `fault_minor`, `fault_major_file`, …; read as today's.
    let hists: Vec<_> = ev.iter().filter_map(|e| if let Event::Histograms(h) = e { Some(h) } else { None }).collect();
    assert!(!hists.is_empty());
    let raw = String::from_utf8_lossy(&bytes);
    assert!(raw.contains("\"fault_major_file\"") && !raw.contains("\"majflt_file\":["), "the file has the old names");
    for h in &hists {
        let kinds: Vec<&str> = h.kinds.keys().map(String::as_str).collect();
        let mut want: Vec<&str> = vocab::HISTOGRAMS.iter().map(|r| r.name).collect();
        want.sort();
        assert_eq!(kinds, want);
        assert!(kinds.iter().all(|k| vocab::lookup(Class::Histogram, k).is_some_and(|r| r.name == *k)));
        assert!(h.sum_ns.is_empty(), "wave 1 kept no sums");
    }
    assert!(hists.last().unwrap().kinds["minflt"].iter().sum::<u64>() > 0, "the minor faults of the run");

    // Today's writer: the same events back, the grids packed.
    let dir = out_dir("wave1");
    let again = dir.join("again.trace");
    let mut w = TraceWriter::create(&again).unwrap();
    for e in &ev {
        w.event(e).unwrap();
    }
    drop(w);
    let bytes2 = std::fs::read(&again).unwrap();
    let (ev2, issues) = read(&bytes2);
    assert!(issues.is_empty(), "{issues:?}");
    assert_eq!(ev2, ev);
    assert!(String::from_utf8_lossy(&bytes2).contains("\"grid_packed\""));
}

/// The engine on a model with 6 MoE layers × 128 experts while the model file's pages are
/// evicted over and over: the trace's token records, expert grids included (packed, as
/// deltas against the previous grid), read back identical to the ones `--json` wrote from
/// the same stream as plain arrays, and take less room.
#[test]
fn an_engine_runs_expert_grids_read_back_exactly_from_fewer_bytes() {
    let _l = machine_lock();
    let engine = engine_bin();
    #[rustfmt::skip]
    let model = synth_model("grid-6x128.gguf", &[
        "--quant", "q8_0", "--layers", "6", "--hidden", "256", "--heads", "4", "--kv-heads", "2", "--head-dim", "64",
        "--experts", "128", "--experts-used", "8", "--expert-ffn", "64", "--vocab", "2048",
    ]);
    // The grid must change between samples for the deltas to be tested: it does when an
    // eviction falls between two samples, which a short run on a busy machine can miss (a few
    // samples, all taken with the model wholly resident). Up to three runs; every check below
    // holds for each.
    let mut attempt = 0;
    let (bytes, got) = loop {
        attempt += 1;
        let dir = out_dir(&format!("grids-{attempt}"));
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let churner = {
            let (stop, model) = (std::sync::Arc::clone(&stop), model.clone());
            std::thread::spawn(move || {
                use std::os::fd::AsRawFd;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let f = std::fs::File::open(&model).unwrap();
                    // SAFETY: a valid fd. Drops the pages no process maps.
                    unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
                    // The engine's mapped pages: DONTNEED skips them, MADV_PAGEOUT does not.
                    page_out_mappings_of(&model);
                    std::thread::sleep(Duration::from_millis(30));
                }
            })
        };
        let r = record(
            &dir,
            &[
                // A residency sample with every poll of the ring, and a poll for about every token.
                "--residency-interval",
                "20ms",
                "--poll",
                "2ms",
                "--",
                engine.to_str().unwrap(),
                "run",
                "-m",
                model.to_str().unwrap(),
                "-p",
                "Once upon a time",
                "-n",
                "240",
                "-t",
                "1",
                "--ignore-eos",
            ],
        );
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        churner.join().unwrap();
        let bytes = std::fs::read(&r.trace).unwrap();
        let (ev, issues) = read(&bytes);
        assert!(issues.is_empty(), "{issues:?}");
        let got = tokens(&ev);
        let from_json: Vec<TokenRecord> = serde_json::from_value(r.summary["tokens"].clone()).unwrap();
        assert_eq!(got.len(), 240, "a record per step of `-n 240` (the prompt step gives the first token)");
        assert_eq!(got, from_json, "grids and all, bit for bit");
        let grids: Vec<_> = got.iter().filter_map(|t| t.residency.as_ref()?.grid.as_ref()).collect();
        // The last record of each batch read from the kernel carries a residency sample, at most one
        // per 20 ms. How many batches a run gives depends on how fast it decodes (60 tokens gave 2 at
        // load 18): 240 tokens give several at any speed seen here, and three suffice for the checks.
        assert!(grids.len() >= 3, "tokens with a grid: {} of {}", grids.len(), got.len());
        assert!(grids.iter().all(|g| (g.n_layers, g.n_experts) == (6, 128)));
        let fracs: Vec<f64> =
            grids.iter().map(|g| g.resident.iter().map(|&x| x as f64).sum::<f64>() / g.resident.len() as f64).collect();
        eprintln!("grids: {} of {} tokens; mean resident per sample: {fracs:.3?}", grids.len(), got.len());
        if grids.windows(2).any(|w| w[0].resident != w[1].resident) {
            break (bytes, got);
        }
        assert!(attempt < 3, "the grid never changed during {attempt} runs (evicted every 30 ms)");
    };
    // Bytes of the records with a grid: as written, against the same records as plain JSON.
    let starts = record_starts(&bytes);
    let sizes: Vec<usize> = starts
        .iter()
        .filter(|&&s| bytes[s + 4] == observer::store::trace::KIND_TOKEN)
        .map(|&s| u32::from_le_bytes(bytes[s + 8..s + 12].try_into().unwrap()) as usize)
        .collect();
    assert_eq!(sizes.len(), got.len());
    let (mut written, mut plain, mut n) = (0, 0, 0);
    for (t, size) in got.iter().zip(&sizes) {
        if t.residency.as_ref().is_some_and(|r| r.grid.is_some()) {
            written += size;
            plain += serde_json::to_vec(&Event::Token(t.clone())).unwrap().len();
            n += 1;
        }
    }
    eprintln!(
        "token records with a 6 × 128 grid: {} bytes each packed, {} as plain JSON ({n} records)",
        written / n,
        plain / n
    );
    assert!(written * 2 < plain, "packed {written} vs plain {plain} bytes");
}

/// `MADV_PAGEOUT` of every mapping of `path` in other processes (process_madvise, Linux ≥ 5.10).
fn page_out_mappings_of(path: &Path) {
    let me = std::process::id();
    let want = path.canonicalize().unwrap();
    let Ok(procs) = std::fs::read_dir("/proc") else { return };
    for pid in procs.flatten().filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok()) {
        if pid == me {
            continue;
        }
        let Ok(maps) = std::fs::read_to_string(format!("/proc/{pid}/maps")) else { continue };
        let ranges: Vec<libc::iovec> = maps
            .lines()
            .filter(|l| l.split_whitespace().nth(5).is_some_and(|p| Path::new(p) == want))
            .filter_map(|l| {
                let (a, b) = l.split_whitespace().next()?.split_once('-')?;
                let (a, b) = (usize::from_str_radix(a, 16).ok()?, usize::from_str_radix(b, 16).ok()?);
                Some(libc::iovec { iov_base: a as *mut libc::c_void, iov_len: b - a })
            })
            .collect();
        if ranges.is_empty() {
            continue;
        }
        // SAFETY: plain syscalls on a pidfd we own; the iovecs name another process's memory.
        unsafe {
            let fd = libc::syscall(libc::SYS_pidfd_open, pid, 0) as i32;
            if fd >= 0 {
                libc::syscall(libc::SYS_process_madvise, fd, ranges.as_ptr(), ranges.len(), libc::MADV_PAGEOUT, 0);
                libc::close(fd);
            }
        }
    }
}
