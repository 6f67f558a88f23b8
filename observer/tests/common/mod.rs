//! Helpers shared by the observer's integration tests. These tests load and
//! attach real eBPF programs: they need root (CI runs as root) and fail, never
//! skip, without it.

#![allow(dead_code, reason = "each test binary uses a different subset")]

use std::{
    io::{BufRead, BufReader, Read},
    path::PathBuf,
    process::{Child, ChildStdout, Command, Output, Stdio},
    time::{Duration, Instant},
};

use serde_json::Value;

pub const OBSERVER: &str = env!("CARGO_BIN_EXE_observer");

/// The `workload` test program (package `fixtures`, built on first use).
pub fn workload() -> &'static str {
    static PATH: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    PATH.get_or_init(|| fixtures::binary("workload"))
}

/// The embedded engine, a sibling binary of the observer (built by `cargo xtask test`).
pub fn engine_bin() -> PathBuf {
    let p = std::path::Path::new(OBSERVER).with_file_name("engine");
    assert!(p.exists(), "{} missing: run `cargo build --release -p engine` (cargo xtask test does)", p.display());
    p
}

/// The synthetic model `engine synth <args>` as `name` in the scratch `models` directory, made
/// once. synth writes the file aside and renames it into place (`--force` replaces a file that
/// a concurrent maker put there first), so no test ever sees half a model.
pub fn synth_model(name: &str, args: &[&str]) -> PathBuf {
    let path = scratch_dir("models").join(name);
    if !path.exists() {
        let st = Command::new(engine_bin())
            .args(["synth", "--force", "-o"])
            .arg(&path)
            .args(args)
            .status()
            .expect("engine synth");
        assert!(st.success(), "engine synth {args:?} failed");
    }
    path
}

/// The engine's default synthetic model (`engine synth`), which llama.cpp loads too; made once.
pub fn tiny_model() -> PathBuf {
    synth_model("tiny.gguf", &[])
}

/// The model of the memory-pressure tests: 4 layers, hidden 1024, 8 experts, vocab 16384, q8_0:
/// ~70 MiB, ~45 MiB of it dense.
pub fn pressure_model() -> PathBuf {
    #[rustfmt::skip]
    let args = [
        "--quant", "q8_0", "--layers", "4", "--hidden", "1024", "--heads", "16", "--kv-heads", "4", "--head-dim", "64",
        "--experts", "8", "--experts-used", "2", "--expert-ffn", "256", "--vocab", "16384",
    ];
    synth_model("pressure.gguf", &args)
}

/// The `resid_standin` stand-in engine (package `fixtures`, built on first use).
pub fn resid_standin() -> &'static str {
    static PATH: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    PATH.get_or_init(|| fixtures::binary("resid_standin"))
}

/// Serialises every test that loads probes or measures the machine, across
/// test binaries, so that runs do not disturb each other's counters.
pub fn machine_lock() -> testkit::MachineLock {
    assert_root();
    testkit::machine_lock()
}

pub fn assert_root() {
    // SAFETY: no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "the observer's integration tests load eBPF programs and must run as root (CI does): run `sudo cargo xtask test`"
    );
}

/// A scratch directory on the disk (not tmpfs: file refaults must hit a block device).
pub fn scratch_dir(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    std::fs::create_dir_all(&d).expect("create scratch dir");
    d
}

/// A directory on the disk that every user can reach, for tests that run
/// the observer as `nobody`: a clone under a private home directory (0700,
/// or `mktemp -d`) is not reachable by `nobody`, and neither is anything in
/// it. `/var/tmp` is on the disk where `/tmp` may be tmpfs.
pub fn shared_dir(name: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let top = PathBuf::from("/var/tmp/moe-observer-tests");
    let d = top.join(name);
    std::fs::create_dir_all(&d).expect("create a directory under /var/tmp");
    for p in [&top, &d] {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755)).expect("make it searchable by all");
    }
    d
}

/// `bin` (a built binary) copied where `nobody` can run it ([`shared_dir`]);
/// the copy replaces an older one atomically, so concurrent tests may ask.
pub fn shared_copy(bin: &str) -> String {
    let src = std::path::Path::new(bin);
    let dir = shared_dir("bin");
    let name = src.file_name().expect("a binary's path has a file name");
    static COPIES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = COPIES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!("{}.{}.{n}", name.to_string_lossy(), std::process::id()));
    std::fs::copy(src, &tmp).unwrap_or_else(|e| panic!("copying {bin} to {}: {e}", tmp.display()));
    let dst = dir.join(name);
    std::fs::rename(&tmp, &dst).expect("rename the copy into place");
    dst.to_str().expect("a UTF-8 path").to_string()
}

pub struct ObserverRun {
    pub output: Output,
    pub summary: Value,
    /// The workload's own JSON lines from its stdout.
    pub workload: Vec<Value>,
}

/// `observer run --json FILE <args>`; panics with the observer's stderr on failure.
pub fn observe(json_name: &str, args: &[&str]) -> ObserverRun {
    let json = scratch_dir("json").join(json_name);
    let _ = std::fs::remove_file(&json);
    let output = Command::new(OBSERVER).arg("run").arg("--json").arg(&json).args(args).output().expect("run observer");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "observer failed: {}\n{stderr}", output.status);
    let text = std::fs::read_to_string(&json).unwrap_or_else(|e| panic!("no JSON summary ({e}); stderr:\n{stderr}"));
    let summary: Value = serde_json::from_str(&text).expect("summary is JSON");
    let workload = String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).expect("workload JSON line"))
        .collect();
    ObserverRun { output, summary, workload }
}

/// In `observer run`'s stderr: the per-token lines printed ("   123 gen   …") and those said not
/// printed ("observer: N token lines not printed: …", `observer::stderr`).
pub fn token_lines_printed_and_skipped(stderr: &str) -> (u64, u64) {
    let printed = stderr
        .lines()
        .filter(|l| {
            let mut w = l.split_whitespace();
            w.next().is_some_and(|n| n.parse::<u64>().is_ok()) && w.next().is_some_and(|k| k == "gen" || k == "prompt")
        })
        .count() as u64;
    (printed, said_not_printed(stderr, "token lines"))
}

/// The count `N` of `observer::stderr`'s notes "observer: N {what} not printed: …", summed.
pub fn said_not_printed(stderr: &str, what: &str) -> u64 {
    let count = |l: &str| -> Option<u64> {
        let (n, rest) = l.strip_prefix("observer: ")?.split_once(' ')?;
        if rest.starts_with(&format!("{what} not printed:")) { n.parse().ok() } else { None }
    };
    stderr.lines().filter_map(count).sum()
}

pub fn u(v: &Value, key: &str) -> u64 {
    v[key].as_u64().unwrap_or_else(|| panic!("missing numeric `{key}` in {v}"))
}

/// Assert |a - b| <= tol * b.
pub fn assert_within(what: &str, observed: u64, reference: u64, tol: f64) {
    let diff = (observed as f64 - reference as f64).abs();
    assert!(
        diff <= tol * reference as f64,
        "{what}: observer {observed} vs reference {reference} (diff {:.2} %, allowed {:.1} %)",
        100.0 * diff / reference.max(1) as f64,
        tol * 100.0
    );
}

/// Wait for the observer's "probes attached" line on its stderr; returns what it read.
pub fn wait_attached(err: &mut impl std::io::BufRead) -> String {
    let mut seen = String::new();
    loop {
        let mut line = String::new();
        let n = err.read_line(&mut line).expect("reading the observer's stderr");
        assert!(n > 0, "the observer ended before attaching:\n{seen}");
        seen.push_str(&line);
        if line.contains("probes attached") {
            return seen;
        }
    }
}

/// `command` (a shell line) run by a shell that waits for a line on stdin and then `exec`s it (same
/// PID), with `perf stat -e major-faults,minor-faults` and `observer run --pid` both attached
/// before the `exec`, so that both count the same process over the same span, until it exits.
/// Returns perf's CSV text and the observer's `--json` summary; panics naming what failed.
pub fn beside_perf_stat(dir: &std::path::Path, command: &str) -> (String, Value) {
    let (perf, summary, _) = beside_perf_stat_and_bpftrace(dir, command, None, &[]);
    (perf, summary)
}

/// The file in its `dir` where [`beside_perf_stat_and_bpftrace`] keeps the target's stdout.
pub const TARGET_OUT: &str = "target.out";
/// The file in its `dir` where [`beside_perf_stat_and_bpftrace`] keeps the observer's stderr.
pub const OBSERVER_ERR: &str = "observer.err";

/// [`beside_perf_stat`], with a bpftrace script also attached before the `exec` and stopped after
/// the observer has ended (every `$PID` in `script` is the target's PID); its output is the third
/// value. `observer_args` go to `observer run` before `--pid`. The target's stdout is kept in
/// `dir`'s [`TARGET_OUT`], the observer's stderr in its [`OBSERVER_ERR`].
pub fn beside_perf_stat_and_bpftrace(
    dir: &std::path::Path,
    command: &str,
    script: Option<&str>,
    observer_args: &[&str],
) -> (String, Value, Option<String>) {
    use std::io::Write;
    let (perf_out, json) = (dir.join("perf.csv"), dir.join("obs.json"));
    let _ = std::fs::remove_file(&json);
    let mut target = Command::new("/bin/sh")
        .args(["-c", &format!("read go; exec {command}")])
        .stdin(Stdio::piped())
        .stdout(std::fs::File::create(dir.join(TARGET_OUT)).expect("the target's stdout file"))
        .spawn()
        .expect("spawn target shell");
    let pid = target.id().to_string();
    let bpftrace = script.map(|s| Bpftrace::start(&s.replace("$PID", &pid)));
    let mut perf = Command::new("perf")
        .args(["stat", "-x,", "-e", "major-faults,minor-faults", "-o"])
        .arg(&perf_out)
        .args(["-p", &pid])
        .stderr(Stdio::null())
        .spawn()
        .expect("perf not found: run `cargo xtask setup` (installs linux-perf)");
    let mut obs = Command::new(OBSERVER)
        .args(["run", "--json", json.to_str().unwrap()])
        .args(observer_args)
        .args(["--pid", &pid])
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn observer");
    let mut err = std::io::BufReader::new(obs.stderr.take().unwrap());
    let mut seen = wait_attached(&mut err);
    std::thread::sleep(std::time::Duration::from_millis(500)); // perf has no readiness signal
    target.stdin.take().unwrap().write_all(b"go\n").unwrap();
    assert!(target.wait().unwrap().success(), "the target failed: {command}");
    err.read_to_string(&mut seen).unwrap();
    assert!(obs.wait().unwrap().success(), "observer failed: {seen}");
    std::fs::write(dir.join(OBSERVER_ERR), &seen).expect("the observer's stderr file");
    assert!(perf.wait().unwrap().success(), "perf failed");
    let traced = bpftrace.map(Bpftrace::finish);
    let perf_text = std::fs::read_to_string(&perf_out).unwrap();
    let summary = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    (perf_text, summary, traced)
}

/// IDs of the BPF programs a process holds open (from /proc/PID/fdinfo).
pub fn prog_ids_of(pid: u32) -> Vec<u64> {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fdinfo")) else { return Vec::new() };
    let mut ids: Vec<u64> = dir
        .flatten()
        .filter_map(|e| std::fs::read_to_string(e.path()).ok())
        .filter_map(|s| s.lines().find_map(|l| l.strip_prefix("prog_id:")?.trim().parse().ok()))
        .collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// IDs of all loaded BPF programs.
pub fn loaded_prog_ids() -> Vec<u64> {
    let out = Command::new("bpftool")
        .args(["prog", "list", "--json"])
        .output()
        .expect("bpftool not found: run `cargo xtask setup`");
    let v: Value = serde_json::from_slice(&out.stdout).expect("bpftool JSON");
    v.as_array().map(|a| a.iter().filter_map(|p| p["id"].as_u64()).collect()).unwrap_or_default()
}

/// A count from `perf stat -x,` output (`value,unit,event,…`).
pub fn perf_count(text: &str, event: &str) -> u64 {
    text.lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            (f.len() > 2 && f[2] == event).then(|| f[0].trim().parse::<u64>().ok())?
        })
        .unwrap_or_else(|| panic!("no `{event}` line in perf output:\n{text}"))
}

/// A qwen3moe-shaped GGUF of Q8_0 tensors with patterned bytes: `hidden` = expert ffn size.
pub fn write_model(path: &std::path::Path, layers: usize, experts: u64, hidden: u64, alignment: u32) -> PathBuf {
    write_model_with(path, layers, experts, hidden, alignment, Vec::new())
}

/// [`write_model`] with more metadata (a vocabulary, for a header of real size).
pub fn write_model_with(
    path: &std::path::Path,
    layers: usize,
    experts: u64,
    hidden: u64,
    alignment: u32,
    extra: Vec<(String, engine::gguf::Value)>,
) -> PathBuf {
    use engine::{
        gguf::{GgufWriter, TensorSpec, Value},
        quant::GgmlType,
    };
    let q = GgmlType::Q8_0;
    let t = |name: String, dims: &[u64], ty| TensorSpec { name, dims: dims.to_vec(), ty };
    let mut specs = vec![t("token_embd.weight".into(), &[hidden, 512], q)];
    for l in 0..layers {
        specs.push(t(format!("blk.{l}.attn_norm.weight"), &[hidden], GgmlType::F32));
        specs.push(t(format!("blk.{l}.attn_q.weight"), &[hidden, hidden], q));
        specs.push(t(format!("blk.{l}.ffn_gate_inp.weight"), &[hidden, experts], GgmlType::F32));
        for name in ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"] {
            specs.push(t(format!("blk.{l}.{name}.weight"), &[hidden, hidden, experts], q));
        }
    }
    specs.push(t("output.weight".into(), &[hidden, 512], q));
    let meta = vec![
        ("general.architecture".to_owned(), Value::String("qwen3moe".into())),
        ("general.alignment".to_owned(), Value::U32(alignment)),
        ("qwen3moe.block_count".to_owned(), Value::U32(layers as u32)),
        ("qwen3moe.expert_count".to_owned(), Value::U32(experts as u32)),
    ]
    .into_iter()
    .chain(extra)
    .collect::<Vec<_>>();
    let _ = std::fs::remove_file(path);
    let mut w = GgufWriter::create(path, &meta, specs.clone()).expect("create model");
    for (k, s) in specs.iter().enumerate() {
        let n = s.size().expect("size") as usize;
        let bytes: Vec<u8> = (0..n).map(|i| (i as u8).wrapping_mul(31) ^ k as u8 | 1).collect();
        w.write_tensor(&bytes).expect("write tensor");
    }
    w.finish().expect("finish model");
    path.to_owned()
}

/// The cached llama.cpp build (avx2: the one every machine can run): its
/// directory, with the binaries and libraries in `build/bin`.
pub fn llama_build() -> PathBuf {
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").expect("HOME is set")).join(".cache"));
    let root = cache.join("moe-observer").join("llama.cpp");
    let builds: Vec<PathBuf> = std::fs::read_dir(&root)
        .map(|d| {
            d.flatten().map(|e| e.path().join("avx2")).filter(|p| p.join("build/bin/llama-simple").exists()).collect()
        })
        .unwrap_or_default();
    builds.into_iter().max().unwrap_or_else(|| {
        panic!(
            "no llama.cpp build under {}: build it with `cargo xtask parity` (or the whole `cargo xtask test`)",
            root.display()
        )
    })
}

/// llama.cpp's own counts from `llama_perf_context_print`: the prompt's tokens
/// ("prompt eval time = … / N tokens") and the single-token decode calls
/// ("eval time = … / M runs").
pub fn perf_counts(stderr: &str) -> (u64, u64) {
    let count = |key: &str, unit: &str| -> u64 {
        stderr
            .lines()
            .find_map(|l| {
                let rest = l.split_once(key)?.1;
                let before = rest.split_once(unit)?.0;
                before.rsplit_once('/')?.1.trim().parse().ok()
            })
            .unwrap_or_else(|| panic!("no `{key}` … `{unit}` line from llama_perf_context_print:\n{stderr}"))
    };
    (count("prompt eval time =", " tokens"), count(":        eval time =", " runs"))
}

/// A bpftrace script running beside the test, attached before `start` returns; `finish` stops it
/// and returns what it printed (its maps).
pub struct Bpftrace {
    child: Child,
    out: Option<BufReader<ChildStdout>>,
}

impl Bpftrace {
    pub fn start(script: &str) -> Bpftrace {
        Bpftrace::start_env(script, &[])
    }

    /// [`Bpftrace::start`] with environment variables for bpftrace (e.g. `BPFTRACE_STRLEN`).
    pub fn start_env(script: &str, env: &[(&str, &str)]) -> Bpftrace {
        let mut child = Command::new("bpftrace")
            .args(["-e", script])
            // Room for a key per thread of a workload with thousands (bpftrace's default: 4096).
            .env("BPFTRACE_MAP_KEYS_MAX", "65536")
            .envs(env.iter().copied())
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
        Bpftrace { child, out: Some(out) }
    }

    pub fn finish(mut self) -> String {
        let out = self.out.take().expect("bpftrace's output, taken once");
        stop_bpftrace(&mut self.child, out)
    }
}

/// Stop a bpftrace `child` with SIGINT and return what it printed to `out` (its maps). bpftrace 0.17
/// can miss one SIGINT (a CI run hung here: bpftrace alive in `epoll_wait`, its pipe empty), so the
/// signal is sent again every 2 s; after 60 s it is killed and the test fails saying so.
pub fn stop_bpftrace(child: &mut Child, mut out: impl Read + Send + 'static) -> String {
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        out.read_to_string(&mut text).map(|_| text)
    });
    let start = std::time::Instant::now();
    let mut signalled = None;
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for bpftrace") {
            break status;
        }
        if start.elapsed() > std::time::Duration::from_secs(60) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("bpftrace did not stop within 60 s of SIGINT (sent every 2 s); killed");
        }
        if signalled.is_none_or(|t: std::time::Instant| t.elapsed() >= std::time::Duration::from_secs(2)) {
            // SAFETY: kill(2) of our own child, which has not been reaped (try_wait said so).
            unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
            signalled = Some(std::time::Instant::now());
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let text = reader.join().expect("bpftrace reader").expect("reading bpftrace");
    assert!(status.success(), "bpftrace failed ({status}):\n{text}");
    text
}

impl Drop for Bpftrace {
    /// A test that fails before `finish` stops its bpftrace (which would otherwise outlive it).
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The entries of bpftrace map `@name[key]: value` in its output.
pub fn bpftrace_map(text: &str, name: &str) -> Vec<(String, u64)> {
    let prefix = format!("@{name}[");
    let mut m: Vec<(String, u64)> = text
        .lines()
        .filter_map(|l| {
            let (k, v) = l.strip_prefix(&prefix)?.split_once("]: ")?;
            Some((k.to_string(), v.trim().parse().ok()?))
        })
        .collect();
    m.sort();
    m
}

/// A private tmux server (own socket), killed on drop: the terminal the TUI's end-to-end tests draw on.
pub struct Tmux {
    socket: String,
}

impl Tmux {
    pub fn start(name: &str, w: u16, h: u16, shell_cmd: &str) -> Tmux {
        let v = Command::new("tmux").arg("-V").output();
        assert!(
            v.as_ref().is_ok_and(|o| o.status.success()),
            "tmux is needed for the TUI's end-to-end tests: run `cargo xtask setup` ({v:?})"
        );
        let t = Tmux { socket: format!("observer-{name}-{}", std::process::id()) };
        let out = t.run(&["new-session", "-d", "-s", "t", "-x", &w.to_string(), "-y", &h.to_string(), shell_cmd]);
        assert!(out.status.success(), "tmux new-session: {}", String::from_utf8_lossy(&out.stderr));
        t
    }

    pub fn run(&self, args: &[&str]) -> Output {
        Command::new("tmux").arg("-L").arg(&self.socket).args(args).output().expect("run tmux")
    }

    pub fn screen(&self) -> String {
        String::from_utf8_lossy(&self.run(&["capture-pane", "-p", "-t", "t"]).stdout).into_owned()
    }

    /// The normal screen with all its scrollback (a long end-of-run report
    /// scrolls its first lines off a small pane).
    pub fn history(&self) -> String {
        String::from_utf8_lossy(&self.run(&["capture-pane", "-p", "-S", "-", "-t", "t"]).stdout).into_owned()
    }

    /// The observer process started by the pane's shell.
    pub fn observer_pid(&self) -> i32 {
        let shell =
            String::from_utf8_lossy(&self.run(&["display", "-p", "-t", "t", "#{pane_pid}"]).stdout).trim().to_string();
        let children =
            std::fs::read_to_string(format!("/proc/{shell}/task/{shell}/children")).expect("children of the shell");
        children
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .find(|p: &i32| std::fs::read_to_string(format!("/proc/{p}/comm")).is_ok_and(|c| c.trim() == "observer"))
            .unwrap_or_else(|| panic!("no observer among {children:?}"))
    }

    pub fn keys(&self, keys: &str) {
        let out = self.run(&["send-keys", "-t", "t", keys]);
        assert!(out.status.success(), "tmux send-keys {keys}");
    }

    /// Poll the screen until `pred` holds on a settled screen (the same in two
    /// captures 50 ms apart: a capture can land in the middle of a redraw);
    /// panic with the last screen after `timeout`.
    pub fn wait(&self, what: &str, timeout: Duration, pred: impl Fn(&str) -> bool) -> String {
        let t0 = Instant::now();
        loop {
            let s = self.screen();
            if pred(&s) {
                std::thread::sleep(Duration::from_millis(50));
                if self.screen() == s {
                    return s;
                }
            }
            assert!(t0.elapsed() < timeout, "timed out after {timeout:?} waiting for {what}; screen:\n{s}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.run(&["kill-server"]);
    }
}

/// Rows of the TUI's Tokens view for steps of kind `kind` (`P`, `g`, `c`, `w`):
/// `   seq k  wall ms  hidden │███…`.
pub fn bar_rows(screen: &str, kind: char) -> Vec<&str> {
    screen
        .lines()
        .filter(|l| {
            let mut it = l.split_whitespace();
            it.next().is_some_and(|s| s.parse::<u64>().is_ok())
                && it.next() == Some(kind.encode_utf8(&mut [0; 4]))
                && l.contains("│█")
        })
        .collect()
}

/// Whether this kernel closes faults with `memcg:count_memcg_events` by default
/// (`observer_common::faults`: the tracepoint exists and `/proc/cgroups` has the memory
/// controller on, as `observer run --fault-close auto` decides).
pub fn kernel_has_the_memcg_close() -> bool {
    let on = std::fs::read_to_string("/proc/cgroups").expect("/proc/cgroups").lines().any(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        f.first() == Some(&"memory") && f.last() == Some(&"1")
    });
    on && std::path::Path::new("/sys/kernel/tracing/events/memcg/count_memcg_events").exists()
}
