//! A checker for the Chrome Trace Event Format (the JSON object form), written
//! from the format's specification, for the events `observer export` uses:
//! complete events (`ph: "X"`), metadata (`"M"`) and counters (`"C"`).

use std::collections::BTreeMap;

use serde_json::Value;

/// Complete slices per `(pid, tid)`: `(name, ts_us, dur_us)`.
pub type Tracks = BTreeMap<(u64, u64), Vec<(String, f64, f64)>>;

pub struct Checked {
    pub tracks: Tracks,
    /// `thread_name` metadata per `(pid, tid)`.
    pub thread_names: BTreeMap<(u64, u64), String>,
    pub process_names: BTreeMap<u64, String>,
    pub counters: usize,
}

fn int(e: &Value, k: &str) -> u64 {
    e[k].as_u64().unwrap_or_else(|| panic!("`{k}` must be a non-negative integer: {e}"))
}

fn micros(e: &Value, k: &str) -> f64 {
    let v = e[k].as_f64().unwrap_or_else(|| panic!("`{k}` must be a number (µs): {e}"));
    assert!(v >= 0.0 && v.is_finite(), "`{k}` must be ≥ 0: {e}");
    v
}

/// Panics with the offending event when `v` is not a valid trace.
pub fn check(v: &Value) -> Checked {
    let top = v.as_object().expect("a JSON object trace");
    if let Some(u) = top.get("displayTimeUnit") {
        assert!(u == "ms" || u == "ns", "displayTimeUnit must be ms or ns: {u}");
    }
    let events = top["traceEvents"].as_array().expect("`traceEvents` must be an array");
    assert!(!events.is_empty(), "no events");
    let mut c =
        Checked { tracks: Tracks::new(), thread_names: BTreeMap::new(), process_names: BTreeMap::new(), counters: 0 };
    for e in events {
        let ph = e["ph"].as_str().unwrap_or_else(|| panic!("every event needs a `ph` string: {e}"));
        let name = e["name"].as_str().unwrap_or_else(|| panic!("every event needs a `name` string: {e}"));
        let pid = int(e, "pid");
        match ph {
            "X" => {
                let tid = int(e, "tid");
                let ts = micros(e, "ts");
                let dur = micros(e, "dur");
                if let Some(a) = e.get("args") {
                    assert!(a.is_object(), "args must be an object: {e}");
                }
                c.tracks.entry((pid, tid)).or_default().push((name.to_string(), ts, dur));
            }
            "M" => {
                let args = e["args"].as_object().unwrap_or_else(|| panic!("metadata needs args: {e}"));
                match name {
                    "process_name" => {
                        c.process_names.insert(pid, args["name"].as_str().expect("process_name args.name").into());
                    }
                    "thread_name" => {
                        let tid = int(e, "tid");
                        c.thread_names.insert((pid, tid), args["name"].as_str().expect("thread_name args.name").into());
                    }
                    "process_sort_index" | "thread_sort_index" => {
                        assert!(args["sort_index"].is_i64(), "sort_index must be an integer: {e}");
                    }
                    "process_labels" => {}
                    other => panic!("unknown metadata event `{other}`: {e}"),
                }
            }
            "C" => {
                micros(e, "ts");
                let args = e["args"].as_object().unwrap_or_else(|| panic!("counter needs args: {e}"));
                assert!(!args.is_empty() && args.values().all(Value::is_number), "counter args must be numbers: {e}");
                c.counters += 1;
            }
            other => panic!("phase `{other}` is not one the exporter should write: {e}"),
        }
    }
    // Complete events on one thread must nest (no partial overlap), or the
    // viewers draw them wrongly.
    const EPS: f64 = 1e-6;
    for ((pid, tid), slices) in &mut c.tracks {
        slices.sort_by(|a, b| a.1.total_cmp(&b.1).then(b.2.total_cmp(&a.2)));
        let mut stack: Vec<(f64, &str)> = Vec::new();
        for (name, ts, dur) in slices.iter() {
            while stack.last().is_some_and(|&(end, _)| end <= ts + EPS) {
                stack.pop();
            }
            if let Some(&(end, parent)) = stack.last() {
                assert!(
                    ts + dur <= end + EPS,
                    "pid {pid} tid {tid}: `{name}` [{ts}, {}] overlaps `{parent}` ending at {end} without nesting",
                    ts + dur
                );
            }
            stack.push((ts + dur, name));
        }
    }
    c
}
