//! `observer export --chrome-trace`: a run as a Chrome / Perfetto JSON trace
//! (the Trace Event Format), which ui.perfetto.dev and chrome://tracing open.
//!
//! ## Layout
//! - One process (`pid` = the target's PID, or 1 for imports) named after the
//!   target command or the input file.
//! - Track `tokens` (a pseudo-thread, `tid` = [`TOKENS_TID`], above Linux's
//!   largest possible TID, sorted first): one complete slice (`ph: "X"`) per
//!   token record from `start_ns` for `wall_ns`, named `token N` (`prompt`
//!   for a prompt step), with the token-level components (the mean over the
//!   threads that ran) as nested child slices, and the record's counters, the
//!   engine's telemetry and the hidden cost in `args`.
//! - One track per thread of the target (`tid` = its TID, named `comm TID`):
//!   per token a `token N` slice with that thread's components nested in it.
//! - Components are totals per token: their children are laid end to end in
//!   the vocabulary's order (compute, fault_minor, swapin_zram, …), not in
//!   the order they happened; a component that would overrun its token (the
//!   components exceed the wall time) is cut at the token's end, and `args`
//!   keeps the measured value.
//! - Process samples become counter events (`ph: "C"`, `memory (MB)`).
//! - `ts` and `dur` are microseconds (ns precision, 3 decimals) since the run's
//!   first token (or its header's monotonic start, whichever is earlier).

use std::collections::BTreeMap;

use observer_common::model::{Component, Components, StepKind, TokenRecord};
use serde_json::{Map, Value, json};

use crate::store::import::LoadedRun;

/// TID of the `tokens` track: above `PID_MAX_LIMIT` (2^22), never a real thread.
pub const TOKENS_TID: u64 = 1 << 23;

fn us(ns: u64) -> Value {
    // Three decimals: integral nanoseconds.
    json!((ns as f64) / 1000.0)
}

fn token_name(t: &TokenRecord) -> String {
    match t.kind {
        StepKind::Prompt => format!("prompt ({} tokens)", t.n_tokens),
        StepKind::Window => format!("window {}", t.seq),
        _ => format!("token {}", t.index.unwrap_or(t.seq)),
    }
}

fn slice(name: &str, cat: &str, start: u64, dur: u64, pid: u64, tid: u64, args: Map<String, Value>) -> Value {
    json!({ "name": name, "cat": cat, "ph": "X", "ts": us(start), "dur": us(dur), "pid": pid, "tid": tid, "args": args })
}

/// Component child slices laid end to end inside `[start, start + wall)`.
fn components(out: &mut Vec<Value>, c: &Components, start: u64, wall: u64, pid: u64, tid: u64) {
    let end = start + wall;
    let mut at = start;
    for comp in Component::ALL {
        let Some(v) = c.get(comp).filter(|&v| v > 0) else { continue };
        if at >= end {
            break;
        }
        let dur = v.min(end - at);
        let mut args = Map::new();
        args.insert(comp.json_key().into(), json!(v));
        if dur < v {
            args.insert("cut_at_token_end".into(), json!(true));
        }
        args.insert("note".into(), json!("total for the token; not in time order"));
        out.push(slice(comp.name(), "component", at, dur, pid, tid, args));
        at += dur;
    }
}

fn meta(name: &str, pid: u64, tid: u64, args: Value) -> Value {
    json!({ "name": name, "ph": "M", "pid": pid, "tid": tid, "args": args })
}

/// The whole trace as one JSON value.
pub fn chrome_trace(run: &LoadedRun) -> Value {
    let h = &run.header;
    let pid = if h.target_pid > 0 { h.target_pid as u64 } else { 1 };
    let first = run.tokens.iter().map(|t| t.start_ns).min().unwrap_or(0);
    let origin = if h.started_mono_ns > 0 { first.min(h.started_mono_ns) } else { first };
    let rel = |ns: u64| ns.saturating_sub(origin);

    let pname = if h.target_command.is_empty() {
        run.path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
    } else {
        h.target_command.iter().take(4).cloned().collect::<Vec<_>>().join(" ")
    };
    let mut ev = vec![
        meta("process_name", pid, 0, json!({ "name": pname })),
        meta("thread_name", pid, TOKENS_TID, json!({ "name": "tokens (mean over threads)" })),
        meta("thread_sort_index", pid, TOKENS_TID, json!({ "sort_index": -1 })),
    ];
    let mut threads: BTreeMap<u32, String> = BTreeMap::new();
    for t in &run.tokens {
        let start = rel(t.start_ns);
        let name = token_name(t);
        let mut args = Map::new();
        args.insert("seq".into(), json!(t.seq));
        args.insert("n_tokens".into(), json!(t.n_tokens));
        args.insert("wall_ns".into(), json!(t.wall_ns));
        args.insert("residual_ns".into(), json!(t.residual_ns));
        if let Value::Object(c) = serde_json::to_value(t.counters).unwrap_or(Value::Null) {
            args.extend(c.into_iter().filter(|(_, v)| !v.is_null()));
        }
        if let Some(e) = t.engine_compute_ns {
            args.insert("engine_compute_ns".into(), json!(e));
        }
        if let Some(hd) = t.hidden_ns() {
            args.insert("hidden_ns".into(), json!(hd));
        }
        if let Some(Value::Object(e)) = t.engine.as_ref().and_then(|e| serde_json::to_value(e).ok()) {
            let e: Map<String, Value> = e.into_iter().filter(|(_, v)| !v.is_null()).collect();
            args.insert("engine".into(), Value::Object(e));
        }
        if t.lost_events > 0 {
            args.insert("lost_events".into(), json!(t.lost_events));
        }
        ev.push(slice(&name, "token", start, t.wall_ns, pid, TOKENS_TID, args));
        components(&mut ev, &t.components, start, t.wall_ns, pid, TOKENS_TID);
        for th in &t.threads {
            threads.entry(th.tid).or_insert_with(|| th.comm.clone());
            let mut a = Map::new();
            a.insert("residual_ns".into(), json!(th.residual_ns));
            ev.push(slice(&name, "token", start, t.wall_ns, pid, th.tid as u64, a));
            components(&mut ev, &th.components, start, t.wall_ns, pid, th.tid as u64);
        }
    }
    for (tid, comm) in &threads {
        ev.push(meta("thread_name", pid, *tid as u64, json!({ "name": format!("{comm} {tid}") })));
    }
    for p in &run.process {
        let mut args = Map::new();
        for (k, v) in [
            ("rss", p.rss_bytes),
            ("rss_anon", p.rss_anon_bytes),
            ("rss_file", p.rss_file_bytes),
            ("swap", p.swap_bytes),
            ("mem_available", p.mem_available_bytes),
        ] {
            if let Some(v) = v {
                args.insert(k.into(), json!(v as f64 / 1e6));
            }
        }
        if !args.is_empty() {
            ev.push(json!({ "name": "memory (MB)", "ph": "C", "ts": us(rel(p.mono_ns)), "pid": pid, "tid": 0, "args": args }));
        }
    }
    json!({
        "traceEvents": ev,
        "displayTimeUnit": "ms",
        "otherData": {
            "source": run.path.display().to_string(),
            "observer_version": h.observer_version,
            "mode": h.mode,
            "host": h.host,
            "kernel": h.kernel,
            "engine_config": h.engine_config,
        }
    })
}

#[cfg(test)]
mod tests {
    use observer_common::model::Event;

    use super::*;
    use crate::store::import::Format;

    #[test]
    fn components_nest_inside_their_token() {
        let mut events = crate::store::trace::tests::stream(3);
        // One token whose components overshoot its wall time.
        if let Event::Token(t) = &mut events[2] {
            t.components.set(Component::Sleep, Some(10 * t.wall_ns));
        }
        let run = LoadedRun::from_events(std::path::Path::new("x.trace"), Format::Trace, events);
        let v = chrome_trace(&run);
        let evs = v["traceEvents"].as_array().unwrap();
        let tokens: Vec<&Value> = evs.iter().filter(|e| e["cat"] == "token" && e["tid"] == TOKENS_TID).collect();
        assert_eq!(tokens.len(), 3);
        for tok in tokens {
            let (s, d) = (tok["ts"].as_f64().unwrap(), tok["dur"].as_f64().unwrap());
            let kids: Vec<&Value> = evs
                .iter()
                .filter(|e| e["cat"] == "component" && e["tid"] == TOKENS_TID)
                .filter(|e| e["ts"].as_f64().unwrap() >= s && e["ts"].as_f64().unwrap() < s + d)
                .collect();
            assert!(!kids.is_empty());
            for k in kids {
                let end = k["ts"].as_f64().unwrap() + k["dur"].as_f64().unwrap();
                assert!(end <= s + d + 1e-9, "child ends at {end}, token at {}", s + d);
            }
        }
        assert!(evs.iter().any(|e| e["args"]["cut_at_token_end"] == true));
    }
}
