//! `cargo xtask bench cliff`: decode speed when the model does not fit in memory — the engine's
//! expert cache, the engine on the mapping and llama.cpp on the mapping, same file, same run.
//!
//! # What it does
//! - Model: a generated 30B-A3B-shaped Q4_K_M file (12 layers, ~5.6 GB, router skew 0.25: about
//!   half of a layer's experts make up 90 % of its routing, as measured on Qwen3-30B-A3B; the
//!   engine's `run --json` prints the share it saw as `experts_for_90pct`), cached.
//! - Cells: memory limit (none, 80, 60, 40 % of the file, a memory cgroup made per run) ×
//!   system: `engine --dense anon --experts cache --cache-mib auto`, `engine --dense anon
//!   --experts mmap`, `llama-bench -p 0 -n N --repack 0 -lm mmap`; plus "warm": the engine on
//!   the mapping, unlimited, the file read into the page cache right before (this VM's DAMON
//!   pageout evicts cold page cache, so warm means just warmed). Every other run starts with the
//!   file evicted (`POSIX_FADV_DONTNEED`). Each run is `observer run --json` on the system
//!   (llama.cpp's tokens are its `llama_process` calls).
//! - Rounds (`--rounds`, default 3) alternate the order of the limits and of the systems.
//!   Per cell: tok/s over the tokens after the first 16 (`--tokens`, default 64 of them; the
//!   first 16 are reported beside it), median over rounds with the range, read MB per token, for
//!   the cache its hit rate and read bytes against the misses' own expert bytes; and the
//!   observer's split (ms per token, its mean thread), the mean over the rounds that measured
//!   each component (as `observer plot cliff-split` draws it: with rounds of equal token counts
//!   the split of the mean token).
//! - Ratios against the targets of issue 17 (warm = median of the warm cells), each marked met or
//!   not.
//!
//! Holds the machine lock (`testkit::machine_lock`) from the first run to the last, and runs
//! copies of the binaries (in `target/bench-cliff/bin`) so that a rebuild meanwhile changes
//! nothing. The table so
//! far is printed after every round, and with `--json FILE` every cell is written to FILE (rewritten
//! after each round) in the format `observer plot cliff` draws, `moe-observer bench-cliff v1`
//! (defined in `observer_common::bench_cliff`). `--quick`: one round, 32 measured tokens;
//! `--small`: a 3-layer model of the `small` preset (~165 MB) instead of the 5.6 GB one, with the
//! same router skew (development and the test; its limits are too tight for the engine's own
//! memory below about 80 %).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use observer_common::{
    bench_cliff::{self, CliffBench},
    vocab::Component,
};
use serde_json::Value;

use crate::{bench_util, cmd, llama};

const WARMUP: usize = 16;
const PROMPT: &str = "Once upon a time there was a little language model that wanted to run on a phone";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum System {
    Warm,
    Cache,
    Mmap,
    Llama,
}

impl System {
    fn name(self) -> &'static str {
        match self {
            System::Warm => "warm (engine mmap)",
            System::Cache => "engine cache",
            System::Mmap => "engine mmap",
            System::Llama => "llama.cpp mmap",
        }
    }
}

/// One run's numbers: what the result file holds, and what only the printed table shows.
#[derive(Debug, Clone)]
pub(crate) struct Cell {
    out: bench_cliff::Cell,
    /// The cache's generation read bytes / (its misses × one expert's bytes).
    read_vs_misses: Option<f64>,
    stall_ms: Option<f64>,
    experts_for_90pct: Option<f64>,
}

impl Cell {
    fn read_mb_per_tok(&self) -> f64 {
        self.out.read_bytes_per_token.map_or(f64::NAN, |b| b / 1e6)
    }

    /// The observer's ms per token of component `c` (NaN: not measured).
    fn component_ms(&self, c: &str) -> f64 {
        self.out.components_ms.as_ref().and_then(|m| m.get(c)).copied().unwrap_or(f64::NAN)
    }
}

/// A cell: the limit's index (`None`: the warm cell) and the system.
pub(crate) type Key = (Option<usize>, System);

pub(crate) struct Setup {
    pub observer: PathBuf,
    pub engine: PathBuf,
    /// llama-bench and its libllama (`None` with `--no-llama`).
    pub llama: Option<(PathBuf, PathBuf)>,
    pub model: PathBuf,
    pub file_bytes: u64,
    pub threads: usize,
    pub tokens: usize,
    pub scratch: PathBuf,
    pub prefetch: bool,
    pub rounds: usize,
    pub limits: Vec<Option<f64>>,
    /// Where the cells are written (`--json`).
    pub json: Option<PathBuf>,
}

fn warm(path: &Path) -> Result<()> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut buf = vec![0u8; 8 << 20];
    while f.read(&mut buf)? > 0 {}
    Ok(())
}

fn f(v: &Value, k: &str) -> f64 {
    v[k].as_f64().unwrap_or(0.0)
}

/// The mean of field `k` over token records, `None` when a record has it unmeasured (`null`).
fn mean_of(t: &[Value], k: &str) -> Option<f64> {
    let v: Option<Vec<f64>> = t.iter().map(|t| t[k].as_f64()).collect();
    moe_stats::mean(&v?)
}

/// Token records of the measured steps: generated tokens (engine) or `llama_process` calls after
/// llama-bench's one-token warm-up.
fn tokens(summary: &Value, sys: System) -> Result<Vec<Value>> {
    let all = summary["tokens"].as_array().context("no tokens in the observer's JSON")?;
    let v: Vec<Value> = match sys {
        System::Llama => all.iter().filter(|t| t["kind"] == "call").skip(1).cloned().collect(),
        _ => all.iter().filter(|t| t["kind"] == "generate").cloned().collect(),
    };
    Ok(v)
}

fn tok_s(t: &[Value]) -> f64 {
    t.len() as f64 / (t.iter().map(|t| f(t, "wall_ns")).sum::<f64>() / 1e9)
}

fn run_cell(s: &Setup, sys: System, limit: Option<f64>, round: usize) -> Result<Cell> {
    let tag = format!("r{round}-{}-{:?}", limit.map_or(100, |l| (l * 100.0) as u32), sys).to_lowercase();
    let json = s.scratch.join(format!("{tag}.observer.json"));
    let csv = s.scratch.join(format!("{tag}.csv"));
    let out_path = s.scratch.join(format!("{tag}.out"));
    if sys == System::Warm {
        warm(&s.model)?;
    } else {
        testkit::evict(&s.model)?;
    }
    let cg = match limit {
        Some(l) => Some(testkit::MemCgroup::new("bench-cliff", (s.file_bytes as f64 * l) as u64)?),
        None => None,
    };
    let n = WARMUP + s.tokens;
    let mut c = Command::new(&s.observer);
    // `--force`: the scratch files of an earlier bench are replaced.
    c.arg("run").arg("--json").arg(&json).args(["--force", "--every", "0"]);
    if let Some(cg) = &cg {
        c.arg("--cgroup").arg(cg.dir());
    }
    let (t, m) = (s.threads.to_string(), s.model.display().to_string());
    match sys {
        System::Llama => {
            let (llama_bench, libllama) = s.llama.as_ref().context("llama.cpp was not built (--no-llama)")?;
            c.arg("--token-symbol").arg(format!("llama_process:{}", libllama.display())).arg("--");
            c.arg(llama_bench).args(["-m", &m, "-p", "0", "-n", &n.to_string(), "-r", "1", "-t", &t]);
            c.args(["--repack", "0", "-lm", "mmap", "-o", "json"]);
        }
        _ => {
            c.arg("--").arg(&s.engine).args(["run", "-m", &m, "-p", PROMPT, "-n", &(n + 1).to_string(), "-t", &t]);
            c.args([
                "--ignore-eos",
                "--temp",
                "0.8",
                "--seed",
                "1",
                "--json",
                "--dense",
                "anon",
                "--force",
                "--metrics-csv",
            ]);
            c.arg(&csv);
            c.args(["--experts", if sys == System::Cache { "cache" } else { "mmap" }]);
            if sys == System::Cache && s.prefetch {
                c.arg("--prefetch");
            }
        }
    }
    let out = cmd::capture(&mut c)?;
    std::fs::write(&out_path, [&out.stdout[..], b"\n--- stderr ---\n", &out.stderr[..]].concat())?;
    if !out.status.success() {
        bail!("{tag}: {} failed ({}); output in {}", sys.name(), out.status, out_path.display());
    }
    drop(cg);
    let summary: Value = serde_json::from_str(&std::fs::read_to_string(&json)?)
        .with_context(|| format!("parsing {}", json.display()))?;
    let toks = tokens(&summary, sys)?;
    if toks.len() < n {
        bail!("{tag}: {} token records, expected {n} (see {})", toks.len(), out_path.display());
    }
    let (first, rest) = (&toks[..WARMUP], &toks[WARMUP..n]);
    let components =
        components().into_iter().filter_map(|c| Some((c.to_string(), mean_of(rest, &format!("{c}_ns"))? / 1e6)));
    let mut cell = Cell {
        out: bench_cliff::Cell {
            system: sys.name().into(),
            round: round as u32,
            limit_pct: limit.map(|l| l * 100.0),
            tok_s: tok_s(rest),
            first_tok_s: Some(tok_s(first)),
            read_bytes_per_token: mean_of(rest, "read_bytes"),
            hit_pct: None,
            components_ms: Some(components.collect()),
        },
        read_vs_misses: None,
        stall_ms: None,
        experts_for_90pct: None,
    };
    if sys != System::Llama {
        let text = String::from_utf8_lossy(&out.stdout);
        let eng = text.lines().rev().find(|l| l.contains("\"gen_tok_s\"")).context("no engine summary")?;
        let eng: Value = serde_json::from_str(eng)?;
        cell.experts_for_90pct = eng["experts_for_90pct"].as_f64();
        let rows = std::fs::read_to_string(&csv)?;
        let rows: Vec<Vec<f64>> = rows
            .lines()
            .filter(|l| !l.starts_with('#') && !l.starts_with("step"))
            .map(|l| l.split(',').map(|x| x.parse().unwrap_or(f64::NAN)).collect())
            .collect();
        // Columns of bmoe_metrics v1: read_bytes 5, cache_hit_pct 6, stall_ms 7. Rows 1.. are the
        // generated tokens after the first (whose step is the prompt's).
        let measured = &rows[WARMUP.min(rows.len())..(n).min(rows.len())];
        let mean = |i: usize| measured.iter().map(|r| r[i]).sum::<f64>() / measured.len() as f64;
        if sys == System::Cache {
            cell.out.hit_pct = Some(mean(6));
            cell.stall_ms = Some(mean(7));
            let c = &eng["cache"];
            let misses = f(c, "gen_misses");
            cell.read_vs_misses = (misses > 0.0).then(|| f(c, "gen_read_bytes") / (misses * f(c, "expert_bytes")));
        }
    }
    Ok(cell)
}

/// The 3-layer model of `--small` (and of the test).
pub(crate) fn small_model(engine: &Path) -> Result<PathBuf> {
    llama::synth_model(
        engine,
        "cliff-small-3l",
        &["--preset", "small", "--layers", "3", "--vocab", "4096", "--quant", "q4_k_m", "--router-skew", "0.25"],
    )
}

/// The bench's options (`cargo xtask bench cliff --help` lists them).
#[derive(Debug, Clone)]
pub(crate) struct Options {
    pub rounds: usize,
    pub tokens: usize,
    pub threads: usize,
    pub prefetch: bool,
    pub with_llama: bool,
    pub limits: Vec<Option<f64>>,
    pub model: Option<PathBuf>,
    pub small: bool,
    pub json: Option<PathBuf>,
}

pub(crate) const USAGE: &str = "[--quick] [--small] [--rounds N] [--tokens N] [--threads T] \
     [--limits none,80,60,40] [--prefetch] [--no-llama] [--model FILE (instead of the generated one; for development)]";

impl Default for Options {
    fn default() -> Options {
        Options {
            rounds: 3,
            tokens: 64,
            threads: 2,
            prefetch: false,
            with_llama: true,
            limits: vec![None, Some(0.8), Some(0.6), Some(0.4)],
            model: None,
            small: false,
            json: None,
        }
    }
}

impl Options {
    /// Applies option `a` (taking its value from `it`); `Ok(false)`: not one of the bench's.
    pub fn apply<'a>(&mut self, a: &str, it: &mut impl Iterator<Item = &'a String>) -> Result<bool> {
        let mut val = |name: &str| it.next().with_context(|| format!("{name} needs a value")).cloned();
        match a {
            "--quick" => (self.rounds, self.tokens) = (1, 32),
            "--small" => self.small = true,
            "--rounds" => self.rounds = val("--rounds")?.parse()?,
            "--tokens" => self.tokens = val("--tokens")?.parse()?,
            "--threads" => self.threads = val("--threads")?.parse()?,
            "--prefetch" => self.prefetch = true,
            "--no-llama" => self.with_llama = false,
            "--model" => self.model = Some(PathBuf::from(val("--model")?)),
            "--limits" => self.limits = parse_limits(&val("--limits")?)?,
            _ => return Ok(false),
        }
        Ok(true)
    }
}

pub fn main(args: &[String]) -> Result<()> {
    let mut o = Options::default();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "--json" {
            o.json = Some(PathBuf::from(it.next().context("--json needs a value")?));
        } else if !o.apply(a, &mut it)? {
            bail!("usage: cargo xtask bench cliff {USAGE} [--json FILE]");
        }
    }
    run(&prepare(o)?).map(drop)
}

/// Builds what the bench runs (llama.cpp, the binaries, the model) and returns its setup.
pub(crate) fn prepare(o: Options) -> Result<Setup> {
    if !testkit::is_root() {
        bail!("bench cliff makes memory cgroups and runs the observer: run it as root");
    }
    // The fastest llama.cpp build for this CPU, as the engine uses its best ISA level.
    let llama = if o.with_llama {
        let builds = llama::ensure(&[llama::Target::Llama, llama::Target::Bench])?;
        let ll = builds.best();
        println!("llama.cpp: {}", ll.describe());
        Some((ll.program(llama::Target::Bench), ll.program(llama::Target::Llama)))
    } else {
        None
    };
    let built = bench_util::build()?;
    let scratch = crate::cache::target_dir().join("bench-cliff");
    // The binaries as built now: a rebuild in the same target directory during the (long) run
    // does not change what is measured.
    let bin = scratch.join("bin");
    std::fs::create_dir_all(&bin)?;
    for b in ["engine", "observer"] {
        std::fs::copy(built.join(b), bin.join(b)).with_context(|| format!("copying {b} to {}", bin.display()))?;
    }
    let engine = bin.join("engine");
    let model = match o.model {
        Some(m) => m,
        None if o.small => small_model(&engine)?,
        None => llama::synth_model(
            &engine,
            "cliff-qwen3-30b-a3b-12l",
            &["--preset", "qwen3-30b-a3b", "--layers", "12", "--router-skew", "0.25"],
        )?,
    };
    let file_bytes = std::fs::metadata(&model)?.len();
    Ok(Setup {
        observer: bin.join("observer"),
        engine,
        llama,
        model,
        file_bytes,
        threads: o.threads,
        tokens: o.tokens,
        scratch,
        prefetch: o.prefetch,
        rounds: o.rounds,
        limits: o.limits,
        json: o.json,
    })
}

/// `none,80,60,40` → unlimited, 0.8, 0.6, 0.4.
fn parse_limits(text: &str) -> Result<Vec<Option<f64>>> {
    text.split(',')
        .map(|l| if l == "none" { Ok(None) } else { l.parse::<f64>().map(|p| Some(p / 100.0)) })
        .collect::<Result<_, _>>()
        .context("--limits: e.g. none,80,60,40")
}

/// Every round of every cell; prints the table and writes the result file (`s.json`) after each
/// round. Returns the result as written and its summary.
pub(crate) fn run(s: &Setup) -> Result<(CliffBench, Summary)> {
    // Memory cgroups and page-cache eviction are machine state: one such user at a time.
    let _lock = testkit::machine_lock();
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "model: {} ({:.2} GB), {} threads, {WARMUP} + {} tokens per run, {} rounds, prefetch {}, load {}",
        s.model.display(),
        s.file_bytes as f64 / 1e9,
        s.threads,
        s.tokens,
        s.rounds,
        if s.prefetch { "on" } else { "off" },
        load.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
    );
    let mut systems = vec![System::Cache, System::Mmap];
    if s.llama.is_some() {
        systems.push(System::Llama);
    }
    let mut result = CliffBench::new(s.model.display().to_string(), s.file_bytes);
    // (limit index or warm, system) → cells over rounds.
    let mut cells: Vec<(Key, Vec<Cell>)> = Vec::new();
    let push = |cells: &mut Vec<(Key, Vec<Cell>)>, result: &mut CliffBench, k: Key, c: Cell| {
        result.cells.push(c.out.clone());
        match cells.iter_mut().find(|(kk, _)| *kk == k) {
            Some((_, v)) => v.push(c),
            None => cells.push((k, vec![c])),
        }
    };
    for round in 0..s.rounds {
        let c = run_cell(s, System::Warm, None, round)?;
        println!(
            "round {round}: warm {:.2} tok/s (first 16: {:.2})",
            c.out.tok_s,
            c.out.first_tok_s.unwrap_or(f64::NAN)
        );
        push(&mut cells, &mut result, (None, System::Warm), c);
        let mut order: Vec<usize> = (0..s.limits.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        for li in order {
            let mut sys = systems.clone();
            let turn = round % sys.len();
            sys.rotate_left(turn);
            for sy in sys {
                let c = run_cell(s, sy, s.limits[li], round)?;
                println!(
                    "round {round}: {:>4} {:<15} {:7.2} tok/s (first 16: {:6.2}), {:7.1} MB read/token{}",
                    limit_name(s.limits[li]),
                    sy.name(),
                    c.out.tok_s,
                    c.out.first_tok_s.unwrap_or(f64::NAN),
                    c.read_mb_per_tok(),
                    c.out.hit_pct.map(|h| format!(", hits {h:.1} %")).unwrap_or_default()
                );
                push(&mut cells, &mut result, (Some(li), sy), c);
            }
        }
        if let Some(path) = &s.json {
            write_json(path, &result)?;
        }
        if round + 1 < s.rounds {
            println!("\nafter round {round}:");
            report(s, &cells);
        }
    }
    report(s, &cells);
    if let Some(path) = &s.json {
        println!("cells written to {} ({})", path.display(), bench_cliff::FORMAT);
    }
    Ok((result, summarize(&s.limits, &cells)))
}

/// `result` into `path`, through a temporary file beside it.
fn write_json(path: &Path, result: &CliffBench) -> Result<()> {
    let tmp = path.with_extension("json.tmp");
    let text = serde_json::to_string_pretty(result).context("serialising the bench's cells")?;
    std::fs::write(&tmp, text + "\n").with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
}

fn limit_name(l: Option<f64>) -> String {
    l.map_or("none".into(), |l| format!("{:.0}%", l * 100.0))
}

/// One (limit, system) of the bench: its medians over rounds.
#[derive(Debug, Clone)]
pub(crate) struct Row {
    /// `none` or `80%`.
    pub limit: String,
    pub system: &'static str,
    pub tok_s: f64,
    /// The rounds' lowest and highest tok/s.
    pub range: (f64, f64),
    pub first_tok_s: f64,
    pub read_mb_per_tok: f64,
    pub hit_pct: Option<f64>,
    pub stall_ms: Option<f64>,
    /// The observer's ms per token, per measured component (vocabulary order): the mean over
    /// the rounds that measured it (NaN: none did).
    pub split: Vec<(&'static str, f64)>,
    /// The cache's read bytes / its misses' expert bytes.
    pub read_vs_misses: Option<f64>,
}

/// A target of issue 17 and what the bench measured for it.
#[derive(Debug, Clone)]
pub(crate) struct Target {
    pub limit_pct: u32,
    pub what: String,
    pub got: f64,
    pub want: f64,
    /// The target is an upper bound (`got <= want`), not a lower one.
    pub at_most: bool,
}

impl Target {
    pub fn met(&self) -> bool {
        if self.at_most { self.got <= self.want } else { self.got >= self.want }
    }
}

/// Everything the bench concludes from its cells: what `report` prints and the findings tell.
#[derive(Debug, Clone)]
pub(crate) struct Summary {
    /// The warm cells' median tok/s.
    pub warm: f64,
    pub rows: Vec<Row>,
    pub targets: Vec<Target>,
    /// Share of a layer's experts making up 90 % of its selections (the warm run).
    pub experts_for_90pct: Option<f64>,
}

/// The components of the split: the vocabulary's measured ones.
pub(crate) fn components() -> Vec<&'static str> {
    Component::measured().map(Component::name).collect()
}

pub(crate) fn summarize(limits: &[Option<f64>], cells: &[(Key, Vec<Cell>)]) -> Summary {
    let get = |k: Key| cells.iter().find(|(kk, _)| *kk == k).map(|(_, v)| v.as_slice());
    let med = |v: &[Cell], f: &dyn Fn(&Cell) -> f64| moe_stats::median(&mut v.iter().map(f).collect::<Vec<_>>());
    let opt = |v: &[Cell], f: &dyn Fn(&Cell) -> Option<f64>| {
        v[0..1].iter().find_map(f).map(|_| med(v, &|c| f(c).unwrap_or(f64::NAN)))
    };
    let warm = get((None, System::Warm)).map_or(f64::NAN, |v| med(v, &|c| c.out.tok_s));
    let mut keys: Vec<Key> = vec![(None, System::Warm)];
    for li in 0..limits.len() {
        for sy in [System::Cache, System::Mmap, System::Llama] {
            keys.push((Some(li), sy));
        }
    }
    let rows = keys
        .into_iter()
        .filter_map(|k| {
            let v = get(k)?;
            let t: Vec<f64> = v.iter().map(|c| c.out.tok_s).collect();
            Some(Row {
                limit: k.0.map_or("none".into(), |li| limit_name(limits[li])),
                system: k.1.name(),
                tok_s: med(v, &|c| c.out.tok_s),
                range: (t.iter().copied().fold(f64::INFINITY, f64::min), t.iter().copied().fold(0.0, f64::max)),
                first_tok_s: med(v, &|c| c.out.first_tok_s.unwrap_or(f64::NAN)),
                read_mb_per_tok: med(v, &|c| c.read_mb_per_tok()),
                hit_pct: opt(v, &|c| c.out.hit_pct),
                stall_ms: opt(v, &|c| c.stall_ms),
                split: components()
                    .into_iter()
                    .map(|n| {
                        let measured: Vec<f64> =
                            v.iter().map(|c| c.component_ms(n)).filter(|ms| ms.is_finite()).collect();
                        (n, moe_stats::mean(&measured).unwrap_or(f64::NAN))
                    })
                    .collect(),
                read_vs_misses: opt(v, &|c| c.read_vs_misses),
            })
        })
        .collect();
    let mut targets = Vec::new();
    for (li, l) in limits.iter().enumerate() {
        let Some(l) = l else { continue };
        let pct = (l * 100.0).round() as u32;
        let t = |sy| get((Some(li), sy)).map(|v| med(v, &|c| c.out.tok_s));
        let first = |sy| get((Some(li), sy)).map(|v| med(v, &|c| c.out.first_tok_s.unwrap_or(f64::NAN)));
        let Some(cache) = t(System::Cache) else { continue };
        let mut target = |what: String, got: f64, want: f64, at_most: bool| {
            targets.push(Target { limit_pct: pct, what: format!("{pct}%: {what}"), got, want, at_most })
        };
        let (w, m, lc) = match pct {
            80 => (0.9, None, None),
            60 => (0.8, Some(1.5), Some(5.0)),
            40 => (0.5, Some(2.0), Some(10.0)),
            _ => (f64::NAN, None, None),
        };
        if w.is_finite() {
            target("cache / warm".into(), cache / warm, w, false);
        }
        if let (Some(want), Some(mm)) = (m, t(System::Mmap)) {
            target("cache / engine mmap".into(), cache / mm, want, false);
        }
        if let (Some(want), Some(ll)) = (lc, t(System::Llama)) {
            target("cache / llama.cpp mmap".into(), cache / ll, want, false);
        }
        if pct == 60
            && let (Some(c), Some(mm)) = (first(System::Cache), first(System::Mmap))
        {
            target("first 16 tokens, cache / engine mmap".into(), c / mm, 1.0, false);
        }
        if let Some(v) = get((Some(li), System::Cache))
            && v[0].read_vs_misses.is_some()
        {
            target(
                "cache read bytes / misses' expert bytes".into(),
                med(v, &|c| c.read_vs_misses.unwrap_or(f64::NAN)),
                1.5,
                true,
            );
        }
    }
    let experts_for_90pct = get((None, System::Warm)).and_then(|v| v[0].experts_for_90pct);
    Summary { warm, rows, targets, experts_for_90pct }
}

fn report(s: &Setup, cells: &[(Key, Vec<Cell>)]) {
    let sum = summarize(&s.limits, cells);
    println!(
        "\nmedians over rounds ({} measured tokens after {WARMUP}; the observer's ms per token: mean over rounds):",
        s.tokens
    );
    println!(
        "{:<5} {:<18} {:>8} {:>15} {:>8} {:>9} {:>6} {:>7} | {}",
        "limit",
        "system",
        "tok/s",
        "range",
        "first16",
        "MB/token",
        "hits%",
        "stall",
        components().join(" ")
    );
    let or_dash = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.1}"));
    for r in &sum.rows {
        let split: Vec<String> = r.split.iter().map(|(_, ms)| format!("{ms:.1}")).collect();
        println!(
            "{:<5} {:<18} {:>8.2} {:>15} {:>8.2} {:>9.1} {:>6} {:>7} | {}",
            r.limit,
            r.system,
            r.tok_s,
            format!("{:.2}–{:.2}", r.range.0, r.range.1),
            r.first_tok_s,
            r.read_mb_per_tok,
            or_dash(r.hit_pct),
            or_dash(r.stall_ms),
            split.join(" ")
        );
    }
    if let Some(x) = sum.experts_for_90pct {
        println!("routing: {:.0} % of a layer's experts made up 90 % of its selections (warm run)", x * 100.0);
    }
    println!("\ntargets (warm = {:.2} tok/s):", sum.warm);
    for t in &sum.targets {
        println!(
            "  {:<58} {:>7.3} (target {} {}) {}",
            t.what,
            t.got,
            if t.at_most { "<=" } else { ">=" },
            t.want,
            if t.met() { "met" } else { "NOT met" }
        );
    }
    println!("(per-run outputs, the observer's JSON and the engine's metrics: {})", s.scratch.display());
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `target/release/{observer,engine}` as `cargo build --release --workspace --bins` makes them
    /// (the build phase of `cargo xtask test`, so there a no-op).
    fn built() -> PathBuf {
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let mut c = Command::new(cargo);
        c.current_dir(crate::cache::workspace_root()).args(["build", "--quiet", "--release", "--workspace", "--bins"]);
        cmd::run(&mut c).expect("building the observer and the engine");
        crate::cache::target_dir().join("release")
    }

    /// The reduced experiment (`experiment cliff --small`: the small model, unlimited and 80 %, one
    /// round, 8 measured tokens, no llama.cpp) runs the bench for real and writes its cells, the
    /// plot `observer plot cliff` draws of them (a line per system), and findings whose numbers are
    /// the cells'.
    #[test]
    fn experiment_cliff_small_writes_cells_plot_and_findings() {
        assert!(testkit::is_root(), "bench cliff makes memory cgroups and runs the observer: run the test as root");
        let bin = built();
        let engine = bin.join("engine");
        let model = small_model(&engine).unwrap();
        let out = crate::cache::target_dir().join("experiment-cliff-test");
        let scratch = out.join("runs");
        std::fs::create_dir_all(&scratch).unwrap();
        let json = out.join("cliff.json");
        for f in ["cliff.json", "cliff.svg", "cliff-split.svg", "cliff.md"] {
            let _ = std::fs::remove_file(out.join(f));
        }
        let mut o = Options::default();
        crate::experiment_cliff::reduce(&mut o);
        let s = Setup {
            observer: bin.join("observer"),
            engine,
            llama: None,
            file_bytes: std::fs::metadata(&model).unwrap().len(),
            model,
            threads: o.threads,
            tokens: o.tokens,
            scratch,
            prefetch: false,
            rounds: o.rounds,
            limits: o.limits.clone(),
            json: Some(json.clone()),
        };
        let command = crate::experiment_cliff::command_line(&o, &out);
        let md = crate::experiment_cliff::write_up(&s, true, command, &out).unwrap();

        let written: CliffBench = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        assert_eq!(written.format, bench_cliff::FORMAT);
        // The warm cell, then engine cache and engine mmap at each limit.
        let keys: Vec<(&str, Option<f64>)> =
            written.cells.iter().map(|c| (c.system.as_str(), c.limit_pct.map(f64::round))).collect();
        assert_eq!(keys.len(), 5, "{keys:?}");
        for k in [
            ("warm (engine mmap)", None),
            ("engine cache", None),
            ("engine mmap", None),
            ("engine cache", Some(80.0)),
            ("engine mmap", Some(80.0)),
        ] {
            assert!(keys.contains(&k), "{k:?} in {keys:?}");
        }
        for c in &written.cells {
            assert!(c.tok_s.is_finite() && c.tok_s > 0.0, "{c:?}");
            assert!(c.first_tok_s.is_some_and(|t| t > 0.0), "{c:?}");
            let comp = c.components_ms.as_ref().unwrap();
            assert!(comp.get("compute").is_some_and(|ms| *ms > 0.0), "the observer's compute in {c:?}");
            assert!(comp.contains_key("io_wait_peer"), "the split has every measured component: {c:?}");
            // The split is of the measured tokens' wall time, in ms per token: the components add up
            // to it (the observer's rule), up to the residual it reports.
            let (sum, wall): (f64, f64) = (comp.values().sum(), 1e3 / c.tok_s);
            assert!((0.5 * wall..=1.01 * wall).contains(&sum), "components {sum} ms vs {wall} ms per token in {c:?}");
            assert_eq!(c.hit_pct.is_some(), c.system == "engine cache", "{c:?}");
            assert!(c.read_bytes_per_token.is_some(), "{c:?}");
        }

        let text = std::fs::read_to_string(out.join("cliff.svg")).unwrap();
        for sys in ["warm (engine mmap)", "engine cache", "engine mmap"] {
            assert!(text.contains(sys), "{sys} in the plot's legend");
        }

        // The split plot: a stacked bar per cell (one round: its values), unlimited first, then
        // the limits falling, a limit's systems in the file's order; its segments the cell's
        // components above 0 in vocabulary order, drawn at one scale.
        let split = std::fs::read_to_string(out.join("cliff-split.svg")).unwrap();
        let mut order: Vec<&bench_cliff::Cell> = written.cells.iter().collect();
        order.sort_by(|a, b| match (a.limit_pct, b.limit_pct) {
            (None, None) => std::cmp::Ordering::Equal,
            (None, _) => std::cmp::Ordering::Less,
            (_, None) => std::cmp::Ordering::Greater,
            (Some(x), Some(y)) => y.total_cmp(&x),
        });
        let values: Vec<Vec<f64>> = order
            .iter()
            .map(|c| {
                let comp = c.components_ms.as_ref().unwrap();
                Component::ALL.iter().map(|k| comp.get(k.name()).copied().unwrap_or(0.0)).collect()
            })
            .collect();
        testkit::svg::check_stacks(&testkit::svg::bar_rows(&split, 12), &values, 2.0).unwrap();
        for c in &order {
            let label = format!("{}, {}", c.system, c.limit_pct.map_or("unlimited".into(), |l| format!("{l:.0} %")));
            assert!(split.contains(&label), "{label} on the split's axis");
        }

        // The findings tell this run's numbers (one round: a cell's median is its value).
        let md = std::fs::read_to_string(md).unwrap();
        let cell = |sys: &str, limit: Option<f64>| {
            written.cells.iter().find(|c| c.system == sys && c.limit_pct.map(f64::round) == limit).unwrap()
        };
        let warm = cell("warm (engine mmap)", None).tok_s;
        assert!(md.contains(&format!("Warm speed (engine `mmap`, unlimited, just warmed): {warm:.2} tok/s")), "{md}");
        let (cache, mmap) = (cell("engine cache", Some(80.0)), cell("engine mmap", Some(80.0)));
        assert!(md.contains(&format!("At 80% of the file, the cache decoded {:.2} tok/s", cache.tok_s)), "{md}");
        assert!(
            md.contains(&format!("engine mmap {:.2} tok/s (the cache {:.2}× it", mmap.tok_s, cache.tok_s / mmap.tok_s)),
            "{md}"
        );
        assert!(md.contains(&format!("| 80% | engine cache | {:.2} |", cache.tok_s)), "{md}");
        let met = cache.tok_s / warm >= 0.9;
        assert!(
            md.contains(&format!(
                "| 80%: cache / warm | {:.3} | ≥ 0.9 | {} |",
                cache.tok_s / warm,
                if met { "met" } else { "**not met**" }
            )),
            "{md}"
        );
        assert!(md.contains("**A reduced run**") && md.contains("--small"), "{md}");
        assert!(md.contains("![tok/s against the memory limit](cliff.svg)"), "{md}");
        assert!(md.contains("![the observer's split of a token per cell](cliff-split.svg)"), "{md}");
        assert!(md.contains("`io_wait_peer`"), "the split's columns are the vocabulary's: {md}");
    }
}
