//! Helpers shared by the engine's integration tests: cached synthetic models, running the
//! `engine` binary, and an independent reader of `bmoe_metrics v1` files.

#![allow(dead_code, reason = "each test binary uses a different subset")]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use engine::synth::{FORMAT_VERSION, QuantMix, SynthConfig, write_model};

pub const ENGINE: &str = env!("CARGO_BIN_EXE_engine");

/// `${XDG_CACHE_HOME:-$HOME/.cache}/moe-observer/models`.
pub fn model_cache() -> PathBuf {
    let base = match std::env::var_os("XDG_CACHE_HOME") {
        Some(d) if !d.is_empty() => PathBuf::from(d),
        _ => PathBuf::from(std::env::var_os("HOME").expect("HOME is not set")).join(".cache"),
    };
    let d = base.join("moe-observer/models");
    std::fs::create_dir_all(&d).unwrap_or_else(|e| panic!("creating {}: {e}", d.display()));
    d
}

/// A synthetic model in the cache, keyed by its configuration (shape, quant, seed) and the synth
/// format; generated when missing (atomically, so concurrent tests can share it).
pub fn cached_model(name: &str, c: &SynthConfig) -> PathBuf {
    let key = format!("{c:?} format={FORMAT_VERSION}");
    let hash = key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    let path = model_cache().join(format!("test-{name}-{hash:016x}.gguf"));
    if !path.is_file() {
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        write_model(c, &tmp, 2, |_| {}).unwrap_or_else(|e| panic!("synth {}: {e}", tmp.display()));
        std::fs::rename(&tmp, &path).unwrap_or_else(|e| panic!("renaming {}: {e}", tmp.display()));
    }
    path
}

/// `preset`'s synthetic model, changed by `edit`, written to a fresh temporary directory (which
/// lives as long as the returned guard) and loaded.
pub fn preset_model(preset: &str, edit: impl FnOnce(&mut SynthConfig)) -> (tempfile::TempDir, engine::model::Model) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(format!("{preset}.gguf"));
    let mut c = SynthConfig::preset(preset).unwrap();
    edit(&mut c);
    write_model(&c, &path, 2, |_| {}).unwrap();
    let m = engine::model::Model::load(&path).unwrap();
    (dir, m)
}

/// `n` rows of `d` values in [-2, 2), deterministic.
pub fn rows(n: usize, d: usize, seed: u64) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n * d)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
        })
        .collect()
}

/// `w·x` for one row (`w`: `rows` rows of type `ty`), the way ggml computes a one-token `mul_mat`.
pub fn matvec(ty: engine::quant::GgmlType, w: &[u8], rows: usize, x: &[f32]) -> Vec<f32> {
    let mut xq = Vec::new();
    engine::quant::quantize_activation(ty, x, &mut xq).unwrap();
    let mut out = vec![0f32; rows];
    engine::quant::matvec(ty, w, 0..rows, x.len(), &xq, &mut out);
    out
}

/// ~3 MiB: fast enough for every test, slow enough (≈0.3 ms/token) that per-step overheads
/// stay visible.
pub fn small_model() -> PathBuf {
    let mut c = SynthConfig::preset("tiny").unwrap();
    c.hidden = 512;
    c.vocab = 2048;
    c.heads = 8;
    c.kv_heads = 2;
    c.quant = QuantMix::Q8_0;
    cached_model("small-metrics", &c)
}

/// ~70 MiB: dense 45 MiB (a 16k vocabulary: embeddings and output), experts 25 MiB.
pub fn pressure_model() -> PathBuf {
    let mut c = SynthConfig::preset("tiny").unwrap();
    c.layers = 4;
    c.hidden = 1024;
    c.heads = 16;
    c.kv_heads = 4;
    c.head_dim = 64;
    c.experts = 8;
    c.experts_used = 2;
    c.expert_ffn = 256;
    c.vocab = 16384;
    c.quant = QuantMix::Q8_0;
    cached_model("pressure", &c)
}

/// Runs `engine ARGS`, panics with its stderr on failure.
pub fn engine(args: &[&str]) -> Output {
    let out = Command::new(ENGINE).args(args).output().expect("run engine");
    assert!(out.status.success(), "engine {args:?} failed: {}\n{}", out.status, String::from_utf8_lossy(&out.stderr));
    out
}

/// The last JSON object printed on stdout (`run --json`'s summary).
pub fn summary(out: &Output) -> serde_json::Value {
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().rev().find(|l| l.starts_with('{')).expect("no JSON summary on stdout");
    serde_json::from_str(line).expect("summary is JSON")
}

pub fn scratch(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("engine-tests");
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

/// A `bmoe_metrics v1` file read independently of the engine's writer.
#[derive(Debug)]
pub struct Bmoe {
    pub model: Vec<(String, String)>,
    pub config: Vec<(String, String)>,
    pub columns: Vec<String>,
    /// Values per row; −1 = not measured, as in the file.
    pub rows: Vec<Vec<f64>>,
}

impl Bmoe {
    pub fn col(&self, name: &str) -> Vec<f64> {
        let i = self.columns.iter().position(|c| c == name).unwrap_or_else(|| panic!("no column {name}"));
        self.rows.iter().map(|r| r[i]).collect()
    }

    pub fn config(&self, key: &str) -> Option<&str> {
        self.config.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }

    /// Decode speed as the format's users quote it: rows / sum(wall_ms) × 1000.
    pub fn tok_s(&self) -> f64 {
        self.rows.len() as f64 / self.col("wall_ms").iter().sum::<f64>() * 1000.0
    }
}

pub const BMOE_COLUMNS: &str = "step,steps,wall_ms,io_ms,compute_ms,read_bytes,cache_hit_pct,stall_ms,mgmt_ms,majflt,cpu_ms,dense_resident_frac,turn,majflt_mib,cache_budget_mib,rss_mib,rss_anon_mib,rss_file_mib,swap_mib,mem_available_mib,mem_free_mib,swap_free_mib";

pub fn read_bmoe(path: &Path) -> Bmoe {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("# bmoe_metrics v1"), "{}: first line", path.display());
    let kv = |l: Option<&str>, what: &str| -> Vec<(String, String)> {
        let l = l.unwrap_or_else(|| panic!("missing {what} line")).strip_prefix("# ").expect("comment line");
        l.split(' ')
            .map(|p| {
                let (k, v) = p.split_once('=').unwrap_or_else(|| panic!("{what}: {p:?} is not key=value"));
                (k.to_owned(), v.to_owned())
            })
            .collect()
    };
    let model = kv(lines.next(), "model");
    let config = kv(lines.next(), "config");
    let header = lines.next().expect("CSV header");
    assert_eq!(header, BMOE_COLUMNS, "CSV header");
    let columns: Vec<String> = header.split(',').map(str::to_owned).collect();
    let rows = lines
        .map(|l| {
            let v: Vec<f64> =
                l.split(',').map(|x| x.parse().unwrap_or_else(|_| panic!("bad value {x:?} in {l}"))).collect();
            assert_eq!(v.len(), columns.len(), "row {l}");
            v
        })
        .collect();
    Bmoe { model, config, columns, rows }
}

/// Drops a file's pages from the page cache (so that a run in a cgroup charges them there).
pub fn uncache(path: &Path) {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(path).unwrap();
    // Dirty pages are not dropped: write them back first.
    f.sync_all().unwrap_or_else(|e| panic!("fsync {}: {e}", path.display()));
    // SAFETY: advice on a valid fd.
    let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    assert_eq!(rc, 0, "posix_fadvise {}", path.display());
}

pub fn assert_root(what: &str) {
    // SAFETY: no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(euid, 0, "{what} must run as root (CI does): run `sudo cargo xtask test`");
}

/// A finished child with its own resource usage (`wait4`): an independent account of its CPU
/// time, major faults and peak RSS.
#[derive(Debug)]
pub struct Finished {
    pub stdout: String,
    pub stderr: String,
    pub cpu_ms: f64,
    pub majflt: u64,
    pub maxrss_mib: f64,
}

/// Runs `cmd` (stdout/stderr to files), waits with `wait4`, panics on failure.
pub fn run_with_rusage(mut cmd: Command, name: &str) -> Finished {
    use std::os::unix::process::ExitStatusExt;
    let (o, e) = (scratch(&format!("{name}.stdout")), scratch(&format!("{name}.stderr")));
    cmd.stdout(std::fs::File::create(&o).unwrap()).stderr(std::fs::File::create(&e).unwrap());
    let child = cmd.spawn().unwrap_or_else(|err| panic!("spawning {cmd:?}: {err}"));
    let pid = child.id() as libc::pid_t;
    let mut status = 0;
    // SAFETY: zeroed rusage is a valid out-parameter.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: waiting for our own child with valid out-pointers.
    let rc = unsafe { libc::wait4(pid, &mut status, 0, &mut ru) };
    assert_eq!(rc, pid, "wait4 {pid}");
    std::mem::forget(child); // reaped by wait4
    let stdout = std::fs::read_to_string(&o).unwrap();
    let stderr = std::fs::read_to_string(&e).unwrap();
    let st = std::process::ExitStatus::from_raw(status);
    assert!(st.success(), "{cmd:?} failed: {st}\n{stderr}");
    let tv = |t: libc::timeval| t.tv_sec as f64 * 1e3 + t.tv_usec as f64 / 1e3;
    Finished {
        stdout,
        stderr,
        cpu_ms: tv(ru.ru_utime) + tv(ru.ru_stime),
        majflt: ru.ru_majflt as u64,
        maxrss_mib: ru.ru_maxrss as f64 / 1024.0,
    }
}

/// The last JSON object of a text.
pub fn last_json(text: &str) -> serde_json::Value {
    let line = text.lines().rev().find(|l| l.starts_with('{')).expect("no JSON object in the output");
    serde_json::from_str(line).expect("JSON")
}
