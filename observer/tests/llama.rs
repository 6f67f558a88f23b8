//! The observer beside a real llama.cpp (the build `cargo xtask` keeps in the
//! cache: `llama.cpp/<version>/avx2/`), with no flag but the command: the
//! llama.cpp engine profile is found through libllama, every decode call is a
//! record (counted independently by a bpftrace uprobe on the same functions),
//! the batch size read from `llama_decode`'s argument matches the caller's own
//! batches, and tok/s matches llama's own printed speed.

mod common;

use std::{
    io::{BufRead, BufReader, Read},
    path::{Path, PathBuf},
    process::{Child, ChildStdout, Command, Stdio},
};

use common::*;
use serde_json::Value;

/// The cached llama.cpp build (avx2: the one every machine can run).
struct Llama {
    bin: PathBuf,
    /// The parity harness (`xtask/src/parity_llama.cpp`), which decodes with
    /// `llama_decode` in batches of a given size.
    harness: PathBuf,
}

fn llama() -> Llama {
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").expect("HOME is set")).join(".cache"));
    let root = cache.join("moe-observer").join("llama.cpp");
    let builds: Vec<PathBuf> = std::fs::read_dir(&root)
        .map(|d| {
            d.flatten().map(|e| e.path().join("avx2")).filter(|p| p.join("build/bin/llama-simple").exists()).collect()
        })
        .unwrap_or_default();
    let dir = builds.into_iter().max().unwrap_or_else(|| {
        panic!(
            "no llama.cpp build under {}: build it with `cargo xtask parity` (or the whole `cargo xtask test`)",
            root.display()
        )
    });
    let harness = std::fs::read_dir(&dir)
        .expect("the build directory is readable")
        .flatten()
        .map(|e| e.path())
        .find(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("parity-llama-")))
        .unwrap_or_else(|| panic!("no parity harness in {}: run `cargo xtask parity`", dir.display()));
    Llama { bin: dir.join("build/bin"), harness }
}

/// A small synthetic GGUF (the engine's `synth`), which llama.cpp loads.
fn tiny_model() -> PathBuf {
    let path = scratch_dir("llama").join("tiny.gguf");
    if !path.exists() {
        let engine = Path::new(OBSERVER).with_file_name("engine");
        assert!(engine.exists(), "{} missing: run `cargo build --release -p engine`", engine.display());
        let st = Command::new(&engine).args(["synth", "-o"]).arg(&path).status().expect("engine synth");
        assert!(st.success(), "engine synth failed");
    }
    path
}

/// bpftrace counting calls of `symbols` in `lib` by processes named `comm`
/// (the kernel's 15-character comm).
struct CallCount {
    child: Child,
    out: BufReader<ChildStdout>,
}

impl CallCount {
    fn start(lib: &Path, symbols: &[&str], comm: &str) -> CallCount {
        let probes: Vec<String> = symbols.iter().map(|s| format!("uprobe:{}:{s}", lib.display())).collect();
        let comm: String = comm.chars().take(15).collect();
        let script = format!("{} /comm == \"{comm}\"/ {{ @calls[probe] = count(); }}", probes.join(","));
        let mut child = Command::new("bpftrace")
            .args(["-e", &script])
            .stdout(Stdio::piped())
            .spawn()
            .expect("bpftrace not found: run `cargo xtask setup`");
        let mut out = BufReader::new(child.stdout.take().expect("piped"));
        // bpftrace says "Attaching N probes..." once they are in place.
        let mut line = String::new();
        loop {
            line.clear();
            let n = out.read_line(&mut line).expect("reading bpftrace");
            assert!(n > 0, "bpftrace ended before attaching: {:?}", child.wait());
            if line.starts_with("Attaching") {
                break;
            }
        }
        CallCount { child, out }
    }

    /// Stop bpftrace and return its count per function.
    fn finish(mut self) -> Vec<(String, u64)> {
        // SAFETY: kill(2) of our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        let mut text = String::new();
        self.out.read_to_string(&mut text).expect("reading bpftrace");
        assert!(self.child.wait().expect("bpftrace").success(), "bpftrace failed:\n{text}");
        let mut calls: Vec<(String, u64)> = text
            .lines()
            .filter_map(|l| {
                // `@calls[uprobe:/path/libllama.so:llama_decode]: 14`
                let (k, v) = l.strip_prefix("@calls[")?.split_once("]: ")?;
                Some((k.rsplit(':').next()?.to_string(), v.trim().parse().ok()?))
            })
            .collect();
        calls.sort();
        calls
    }
}

fn records(summary: &Value) -> &Vec<Value> {
    summary["tokens"].as_array().expect("the JSON has the token records")
}

#[test]
fn llama_simple_is_found_by_its_profile_and_every_decode_call_is_a_record() {
    let _l = machine_lock();
    let llama = llama();
    let model = tiny_model();
    let simple = llama.bin.join("llama-simple");
    let lib = llama.bin.join("libllama.so").canonicalize().unwrap();
    let count = CallCount::start(&lib, &["llama_process", "llama_decode"], "llama-simple");
    let n = 48;
    let run = observe(
        "llama-simple.json",
        &["--", simple.to_str().unwrap(), "-m", model.to_str().unwrap(), "-n", &n.to_string(), "hello world"],
    );
    let calls = count.finish();
    let stderr = String::from_utf8_lossy(&run.output.stderr);
    let probes = run.summary["probes"].to_string();
    assert!(probes.contains("llama_process") && probes.contains("llama_decode"), "{probes}");
    let bpftrace_total: u64 = calls.iter().map(|(_, n)| n).sum();
    assert!(bpftrace_total > 0, "bpftrace counted no call: {calls:?}");
    let recs = records(&run.summary);
    assert_eq!(recs.len() as u64, bpftrace_total, "records vs bpftrace's count {calls:?}");
    // llama-simple's own speed: "decoded N tokens in T s, speed: S t/s", N
    // over its clock from before the first decode call to after the last
    // sampling; the same span from the records is the first call's start to
    // the last call's end. (The summary's tok/s, tokens / Σ wall, leaves out
    // the time between calls and is at least that.)
    let speed: f64 = stderr
        .lines()
        .find_map(|l| l.split_once("speed: ")?.1.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("llama-simple printed no speed:\n{stderr}"));
    let (first, last) = (&recs[0], &recs[recs.len() - 1]);
    let span_s = (u(last, "start_ns") + u(last, "wall_ns") - u(first, "start_ns")) as f64 / 1e9;
    let rate = recs.len() as f64 / span_s;
    let diff = (rate - speed).abs() / speed;
    assert!(diff < 0.02, "observer {rate:.2} calls/s vs llama-simple's {speed:.2} t/s ({:.2} %)", diff * 100.0);
    let tok_s = run.summary["attribution"]["tok_s"].as_f64().expect("tok/s in the summary");
    assert!(tok_s >= rate, "tokens / Σ wall {tok_s:.2} below the rate over the span {rate:.2}");
    eprintln!(
        "llama-simple: {} records = bpftrace {calls:?}; {rate:.2} calls/s over the span vs its own {speed:.2} t/s \
         ({:.2} %); tokens / Σ wall {tok_s:.2}",
        recs.len(),
        diff * 100.0
    );
}

#[test]
fn llama_decode_batches_give_each_record_its_token_count() {
    let _l = machine_lock();
    let llama = llama();
    let model = tiny_model();
    let lib = llama.bin.join("libllama.so").canonicalize().unwrap();
    let comm = llama.harness.file_name().unwrap().to_string_lossy().into_owned();
    let count = CallCount::start(&lib, &["llama_decode"], &comm);
    let (n_gen, ubatch) = (9, 5);
    let logits = scratch_dir("llama").join("logits.bin");
    let run = observe(
        "llama-decode.json",
        &[
            "--",
            llama.harness.to_str().unwrap(),
            "generate",
            model.to_str().unwrap(),
            "2",
            &n_gen.to_string(),
            logits.to_str().unwrap(),
            "the quick brown fox jumps over the lazy dog",
            &ubatch.to_string(),
        ],
    );
    let calls = count.finish();
    // The harness prints its prompt's token ids; it decodes them in batches of
    // `ubatch`, then one token per call, n_gen - 1 times.
    let out: Value = String::from_utf8_lossy(&run.output.stdout)
        .lines()
        .find_map(|l| serde_json::from_str(l).ok())
        .expect("the harness's JSON line");
    let prompt = out["prompt"].as_array().expect("prompt ids").len();
    let mut expected: Vec<u64> = (0..prompt).step_by(ubatch).map(|i| (prompt - i).min(ubatch) as u64).collect();
    expected.extend(std::iter::repeat_n(1, n_gen - 1));
    let recs = records(&run.summary);
    let got: Vec<u64> = recs.iter().map(|t| u(t, "n_tokens")).collect();
    assert_eq!(got, expected, "n_tokens of each record vs the harness's batches");
    let kinds: Vec<&str> = recs.iter().map(|t| t["kind"].as_str().unwrap()).collect();
    assert!(kinds.iter().zip(&expected).all(|(k, &n)| *k == if n > 1 { "prompt" } else { "generate" }), "{kinds:?}");
    assert_eq!(calls, vec![("llama_decode".to_string(), expected.len() as u64)], "bpftrace's count");
}

#[test]
fn engine_none_turns_the_profile_off() {
    let _l = machine_lock();
    let llama = llama();
    let model = tiny_model();
    let simple = llama.bin.join("llama-simple");
    let run = observe(
        "llama-none.json",
        &["--engine", "none", "--", simple.to_str().unwrap(), "-m", model.to_str().unwrap(), "-n", "8", "hi"],
    );
    assert!(records(&run.summary).is_empty(), "no markers, no profile: no records");
    assert!(!run.summary["probes"].to_string().contains("llama_"), "{}", run.summary["probes"]);
}

fn thread_comms(summary: &Value) -> Vec<String> {
    summary["threads"].as_array().expect("threads").iter().map(|t| t["comm"].as_str().unwrap().to_string()).collect()
}

#[test]
fn a_shell_wrapper_is_followed_to_llama_simple_unless_told_not_to() {
    let _l = machine_lock();
    let llama = llama();
    let model = tiny_model();
    let lib = llama.bin.join("libllama.so").canonicalize().unwrap();
    // sh forks llama-simple (no exec in place: `; echo done` keeps sh alive).
    let script = format!(
        "{} -m {} -n 24 hello >/dev/null 2>&1; echo done",
        llama.bin.join("llama-simple").display(),
        model.display()
    );
    let count = CallCount::start(&lib, &["llama_process", "llama_decode"], "llama-simple");
    let run = observe("llama-wrapped.json", &["--", "sh", "-c", &script]);
    let calls = count.finish();
    let total: u64 = calls.iter().map(|(_, n)| n).sum();
    assert!(total > 0, "bpftrace counted no call: {calls:?}");
    assert_eq!(records(&run.summary).len() as u64, total, "records behind sh vs bpftrace {calls:?}");
    let comms = thread_comms(&run.summary);
    assert!(comms.iter().any(|c| c == "sh") && comms.iter().any(|c| c == "llama-simple"), "{comms:?}");

    let run = observe("llama-no-children.json", &["--no-children", "--", "sh", "-c", &script]);
    assert!(records(&run.summary).is_empty(), "--no-children: the child's calls are not observed");
    let comms = thread_comms(&run.summary);
    assert!(!comms.iter().any(|c| c == "llama-simple"), "--no-children: {comms:?}");
}

#[test]
fn a_shell_wrapper_is_followed_to_our_engine() {
    let _l = machine_lock();
    let model = tiny_model();
    let engine = Path::new(OBSERVER).with_file_name("engine");
    let n = 10;
    let script = format!(
        "{} run -m {} -p 'the quick brown fox' -n {n} --ignore-eos --json -t 2; echo done",
        engine.display(),
        model.display()
    );
    let run = observe("engine-wrapped.json", &["--", "sh", "-c", &script]);
    let end = run.workload.iter().find(|v| v.get("marked_steps").is_some()).expect("the engine's final JSON line");
    let recs = records(&run.summary);
    assert_eq!(recs.len() as u64, u(end, "marked_steps"), "records behind sh vs the engine's own marked steps");
    assert_eq!(recs.iter().filter(|t| t["kind"] == "generate").count() as u64, u(end, "gen_steps"));
}

#[test]
fn a_token_symbol_that_never_fires_is_reported_with_the_candidates() {
    let _l = machine_lock();
    let llama = llama();
    let model = tiny_model();
    let lib = llama.bin.join("libllama.so");
    let spec = format!("llama_decode:{}", lib.display());
    // llama-simple decodes through llama_process only: llama_decode never fires.
    let run = observe(
        "llama-silent.json",
        &[
            "--token-symbol",
            &spec,
            "--",
            llama.bin.join("llama-simple").to_str().unwrap(),
            "-m",
            model.to_str().unwrap(),
            "-n",
            "8",
            "hi",
        ],
    );
    assert!(records(&run.summary).is_empty());
    let err = String::from_utf8_lossy(&run.output.stderr);
    let line = err.lines().find(|l| l.contains("no call of `llama_decode`")).unwrap_or_else(|| panic!("{err}"));
    assert!(line.contains("llama_process"), "the warning names the entry point that runs: {line}");
}
