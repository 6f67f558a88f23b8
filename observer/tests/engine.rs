//! The embedded engine under the observer: a record for every token, the
//! components add up, and the fault counts agree with `perf stat` attached to
//! the same process for the same span.

mod common;

use std::{
    io::{BufRead, BufReader},
    process::{Command, Stdio},
    time::Duration,
};

use common::*;

const ENGINE: &str = env!("CARGO_BIN_EXE_observer");

fn engine_bin() -> std::path::PathBuf {
    // The engine is a sibling binary of the workspace (built by `cargo xtask test`).
    let p = std::path::Path::new(ENGINE).with_file_name("engine");
    assert!(p.exists(), "{} missing: run `cargo build --release -p engine` (cargo xtask test does)", p.display());
    p
}

fn tiny_model() -> std::path::PathBuf {
    let path = scratch_dir("engine").join("tiny.gguf");
    if !path.exists() {
        let st = Command::new(engine_bin()).args(["synth", "-o"]).arg(&path).status().expect("engine synth");
        assert!(st.success(), "engine synth failed");
    }
    path
}

fn state(pid: u32) -> char {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    s.rsplit_once(')').and_then(|(_, r)| r.trim().chars().next()).unwrap_or('?')
}

#[test]
fn engine_tokens_components_and_perf_stat() {
    let _l = machine_lock();
    let model = tiny_model();
    let dir = scratch_dir("engine");
    let (perf_out, json) = (dir.join("perf.csv"), dir.join("obs.json"));
    let n_gen = 24;
    // A shell that stops itself, then becomes the engine (same PID): perf and
    // the observer attach while it is stopped, so both count the same span.
    let script = format!(
        "kill -STOP $$; exec {} run -m {} -p 'The quick brown fox' -n {n_gen} --ignore-eos --json -t 2",
        engine_bin().display(),
        model.display()
    );
    let target = Command::new("/bin/sh").args(["-c", &script]).stdout(Stdio::piped()).spawn().unwrap();
    let pid = target.id();
    for _ in 0..200 {
        if state(pid) == 'T' {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(state(pid), 'T', "the target did not stop itself");
    let mut perf = Command::new("perf")
        .args(["stat", "-x,", "-e", "major-faults,minor-faults", "-o"])
        .arg(&perf_out)
        .args(["-p", &pid.to_string()])
        .stderr(Stdio::null())
        .spawn()
        .expect("perf not found: run `cargo xtask setup`");
    let mut obs = Command::new(OBSERVER)
        .args(["run", "--follow-exec", "--every", "0", "--json", json.to_str().unwrap(), "--pid", &pid.to_string()])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(obs.stderr.take().unwrap());
    let mut first = String::new();
    err.read_line(&mut first).unwrap();
    assert!(first.contains("probes attached"), "{first}");
    std::thread::sleep(Duration::from_millis(500)); // perf has no readiness signal
    // SAFETY: continuing our own stopped child.
    unsafe { libc::kill(pid as i32, libc::SIGCONT) };
    let out = target.wait_with_output().unwrap();
    assert!(out.status.success(), "engine failed");
    let mut rest = String::new();
    let _ = std::io::Read::read_to_string(&mut err, &mut rest);
    assert!(obs.wait().unwrap().success(), "observer failed: {rest}");
    assert!(perf.wait().unwrap().success());
    assert!(rest.contains("engine markers attached"), "{rest}");

    let engine_out = String::from_utf8_lossy(&out.stdout);
    let summary: serde_json::Value =
        serde_json::from_str(engine_out.lines().rev().find(|l| l.contains("gen_tokens")).expect("engine summary"))
            .unwrap();
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let toks = v["tokens"].as_array().unwrap();
    // One prompt step (which samples the first token), then one step per further token.
    let gen_tokens = u(&summary, "gen_tokens");
    assert_eq!(toks.len() as u64, gen_tokens, "a record for every marked step: {}", toks.len());
    assert_eq!(toks[0]["kind"], "prompt");
    assert!(toks[1..].iter().all(|t| t["kind"] == "generate"));
    let mut idx: Vec<u64> = toks.iter().map(|t| u(t, "index")).collect();
    idx.dedup();
    assert_eq!(idx.len(), toks.len(), "each token index once");
    // Per thread and token, the components add up to the wall time: checked
    // for threads that lived through the whole token (present in the previous
    // one too); a thread born during a token reports what is missing as its
    // residual instead.
    let mut prev: Vec<u64> = Vec::new();
    for t in toks {
        let wall = u(t, "wall_ns");
        let threads = t["threads"].as_array().unwrap();
        for th in threads.iter().filter(|th| prev.contains(&u(th, "tid"))) {
            let resid = th["residual_ns"].as_i64().unwrap();
            assert!(resid.unsigned_abs() <= wall / 50, "thread components vs wall: {th}");
        }
        prev = threads.iter().map(|th| u(th, "tid")).collect();
        // The engine's own numbers ride along.
        assert!(t["engine_compute_ns"].is_u64(), "{t}");
    }
    // Every record carries the engine's own step record (index and kind agree).
    for t in toks {
        assert!(t["engine"]["wall_ns"].is_u64(), "{t}");
    }
    let perf_text = std::fs::read_to_string(&perf_out).unwrap();
    let maj = perf_count(&perf_text, "major-faults");
    let min = perf_count(&perf_text, "minor-faults");
    assert!(min > 100, "{perf_text}");
    assert_within("minor faults vs perf stat", u(&v["totals"], "minflt"), min, 0.02);
    assert!(
        u(&v["totals"], "majflt").abs_diff(maj) <= maj / 50 + 2,
        "major faults {} vs perf {maj}",
        v["totals"]["majflt"]
    );
}

/// The engine's expert cache under `observer run`: every generated token's record shows which
/// experts are in the engine's cache (from its slot table) and the observer's hit rate, and the
/// reads the observer derives from the table's version counter add up to the misses the engine
/// counts itself (its `--json` summary), up to the reads of the first generated token that the
/// engine may start before the observer samples the prompt's record.
#[test]
fn engine_cache_slots_and_hit_rate_beside_the_engines() {
    let _l = machine_lock();
    let model = tiny_model();
    let json = scratch_dir("engine").join("cache.json");
    let n_gen = 32;
    let out = Command::new(OBSERVER)
        .args(["run", "--every", "0", "--json", json.to_str().unwrap(), "--"])
        .arg(engine_bin())
        .args(["run", "-m", model.to_str().unwrap(), "-p", "The quick brown fox", "-n", &n_gen.to_string()])
        .args(["--ignore-eos", "--json", "-t", "2", "--dense", "anon", "--experts", "cache", "--cache-mib", "1"])
        .output()
        .unwrap();
    assert!(out.status.success(), "observer run failed: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    let summary: serde_json::Value =
        serde_json::from_str(text.lines().rev().find(|l| l.contains("gen_tokens")).expect("engine summary")).unwrap();
    let cache = &summary["cache"];
    let (gen_misses, n_slots) = (u(cache, "gen_misses"), u(cache, "slots"));
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let toks = v["tokens"].as_array().unwrap();
    let with_cache: Vec<&serde_json::Value> =
        toks.iter().filter(|t| t["residency"]["engine_cache"].is_object()).collect();
    assert!(with_cache.len() >= toks.len() / 2, "{} of {} records show the cache", with_cache.len(), toks.len());
    let (layers, experts) = (2u64, 8u64); // the tiny preset
    let mut reads = 0;
    for t in &with_cache {
        let c = &t["residency"]["engine_cache"];
        assert_eq!(u(c, "slots"), n_slots, "{c}");
        let ready: Vec<u64> = c["ready"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
        assert!(ready.len() as u64 <= n_slots && ready.windows(2).all(|w| w[0] < w[1]), "{c}");
        assert!(ready.iter().all(|&cell| cell < layers * experts), "{c}");
        if t["kind"] == "generate" {
            reads += c["reads"].as_u64().unwrap_or(0);
        }
    }
    let per_token = layers * 2; // tiny: 2 experts per token and layer
    eprintln!("observer: {reads} reads from the version counter; engine: {gen_misses} misses, {n_slots} slots");
    assert!(gen_misses > 0, "a 1 MiB cache of the tiny model misses");
    assert!(
        reads <= gen_misses && gen_misses - reads <= per_token,
        "reads from the slot table's version counter {reads} vs the engine's misses {gen_misses}"
    );
    // Per token: the observer's hit rate beside the engine's own (its token record). One read
    // counted a token early or late moves a tiny-model token's rate by 25 points (4 experts per
    // token); over the run those shifts cancel.
    let pairs: Vec<(f64, f64)> = with_cache
        .iter()
        .filter_map(|t| Some((t["residency"]["engine_cache"]["hit_pct"].as_f64()?, t["engine"]["cache_hit_pct"].as_f64()?)))
        .collect();
    assert!(pairs.len() >= toks.len() / 2, "{} tokens with both hit rates", pairs.len());
    let mean = |f: fn(&(f64, f64)) -> f64| pairs.iter().map(f).sum::<f64>() / pairs.len() as f64;
    let (ours, engine) = (mean(|p| p.0), mean(|p| p.1));
    assert!((ours - engine).abs() <= 10.0, "mean hit rate: observer {ours:.1} % vs engine {engine:.1} %");
}
