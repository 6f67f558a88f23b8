//! `cargo xtask experiment dense-weights [-n TOKENS] [-t THREADS]`: the seeds' A/B, told by the
//! observer itself.
//!
//! ## Protocol
//! - Model: the `small` synthetic preset (as `demo`), generated once and cached.
//! - Pressure (as `demo --pressure`): a memory cgroup limit of the dense weights + 96 MiB (far
//!   below the model), zram swap of 1 GiB, a 64 MiB balloon re-reading its pages every 100 ms
//!   beside the engine. `anon` dense weights can then be reclaimed to zram; `locked` ones cannot.
//!   The machine is restored afterwards (`testkit::Pressure`).
//! - Runs: A-B-B-A of `engine run --dense anon` (A) and `--dense locked` (B), each `-n TOKENS`
//!   (default 1000) greedy tokens with `--ignore-eos`, each under `observer record` with
//!   `--cgroup`; the page cache is dropped before each run. Traces go to the cache directory.
//! - Output, regenerated as a whole: `docs/findings/dense-weights.md` (the machine, the setup,
//!   `observer diff --markdown` of the four traces, the rows the issue names with intervals, and
//!   what they show — sentences computed from `observer diff --json`, nothing typed in by hand)
//!   and its pictures `docs/findings/dense-weights-*.svg` (`observer plot compare`, and
//!   `observer plot tokens` of the first `anon` and the first `locked` run).

use std::{
    fmt::Write as _,
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::{cache, cmd, llama};

const PROMPT: &str = "Where does the time of a token go, when the model is larger than the memory";
/// The seeds' phone result: `--dense locked` vs anon, and the residual compute that was zram.
const PHONE_SPEEDUP_PCT: f64 = 17.9;
const PHONE_HIDDEN_MS: f64 = 57.0;

pub fn main(args: &[String]) -> Result<()> {
    match args.first().map(String::as_str) {
        Some("dense-weights") => dense_weights(&args[1..]),
        Some("cliff") => crate::experiment_cliff::main(&args[1..]),
        _ => bail!(
            "usage: cargo xtask experiment dense-weights [-n TOKENS] [-t THREADS] [--limit-mib MIB]\n       \
             cargo xtask experiment cliff [--small] [--out DIR] [bench cliff options]"
        ),
    }
}

fn dense_weights(args: &[String]) -> Result<()> {
    let (mut n, mut threads, mut limit, mut report_only) = (1000usize, 2usize, None, false);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut num = |what: &str| -> Result<usize> {
            it.next().with_context(|| format!("{a} needs {what}"))?.parse().with_context(|| format!("{a}: {what}"))
        };
        match a.as_str() {
            "-n" => n = num("a number of tokens")?,
            "-t" => threads = num("a number of threads")?,
            "--limit-mib" => limit = Some(num("a memory limit in MiB")? as u64),
            "--report-only" => report_only = true,
            _ => bail!(
                "usage: cargo xtask experiment dense-weights [-n TOKENS] [-t THREADS] [--limit-mib MIB] [--report-only]"
            ),
        }
    }
    let started = std::time::Instant::now();
    let runs_dir = cache::dir()?.join("experiments/dense-weights");
    if report_only {
        let bin = crate::bench_util::build()?;
        return report(&runs_dir, &bin.join("observer"), started);
    }
    let load_before = loadavg();
    let bin = crate::bench_util::build()?;
    let (engine, observer) = (bin.join("engine"), bin.join("observer"));
    let model = llama::synth_model(&engine, "demo-small", &["--preset", "small"])?;
    let model_mib = std::fs::metadata(&model)?.len() >> 20;
    let dense_mib = {
        let g = engine::gguf::Gguf::open(&model).with_context(|| format!("reading {}", model.display()))?;
        g.tensors.iter().filter(|t| !t.is_routed_expert()).map(|t| t.size).sum::<u64>() >> 20
    };
    let limit_mib = limit.unwrap_or(model_mib + 32);
    if runs_dir.exists() {
        std::fs::remove_dir_all(&runs_dir).with_context(|| format!("clearing {}", runs_dir.display()))?;
    }
    std::fs::create_dir_all(&runs_dir)?;

    // Tests and benchmarks that change machine state wait for each other here.
    let _lock = testkit::machine_lock();
    let pressure = testkit::Pressure::new(&testkit::PressureConfig {
        name: "moe-observer-experiment".into(),
        limit_bytes: limit_mib << 20,
        zram_mib: Some(1024),
        balloon_mib: 64,
        balloon_touch: Duration::from_millis(100),
    })
    .context("setting up memory pressure (needs root, zram and a memory cgroup controller, v1 or v2)")?;
    let cgroup = pressure.cgroup.describe();
    let mut traces = Vec::new();
    let mut result = Ok(());
    for (i, run) in RUNS.iter().enumerate() {
        let dense = run.split_once('-').map_or(*run, |(_, d)| d);
        let trace = runs_dir.join(format!("{run}.trace"));
        eprintln!("experiment: run {} of 4: --dense {dense}, {n} tokens", i + 1);
        if let Err(e) = testkit::drop_caches() {
            result = Err(anyhow::anyhow!("dropping the page cache: {e}"));
            break;
        }
        let mut c = Command::new(&observer);
        c.args(["record", "-o"]).arg(&trace).args(["--every", "0", "--cgroup"]).arg(pressure.cgroup.dir());
        c.arg("--").arg(&engine).args(["run", "-m"]).arg(&model);
        c.args(["-p", PROMPT, "-n", &n.to_string(), "-t", &threads.to_string(), "--ignore-eos", "--dense", dense]);
        if let Err(e) = cmd::run(&mut c) {
            result = Err(e);
            break;
        }
        traces.push(trace);
    }
    drop(pressure); // restores the machine before anything else can fail
    result?;
    let setup = Setup {
        n,
        threads,
        model,
        model_mib,
        dense_mib,
        limit_mib,
        cgroup,
        runs_dir: runs_dir.clone(),
        load: (load_before, loadavg()),
    };
    let path = runs_dir.join(SETUP_FILE);
    std::fs::write(&path, serde_json::to_string_pretty(&setup.to_json())?)
        .with_context(|| format!("writing {}", path.display()))?;
    report(&runs_dir, &observer, started)
}

/// The runs' setup, beside their traces, so that `--report-only` rewrites the findings from them.
const SETUP_FILE: &str = "setup.json";
/// The A-B-B-A traces, in run order.
const RUNS: [&str; 4] = ["1-anon", "2-locked", "3-locked", "4-anon"];

/// `docs/findings/dense-weights.md` and its plots from the traces and setup in `runs_dir`.
fn report(runs_dir: &Path, observer: &Path, started: std::time::Instant) -> Result<()> {
    let setup_path = runs_dir.join(SETUP_FILE);
    let setup = std::fs::read_to_string(&setup_path)
        .with_context(|| {
            format!(
                "reading {} (run `cargo xtask experiment dense-weights` without --report-only first)",
                setup_path.display()
            )
        })
        .and_then(|t| Setup::from_json(&serde_json::from_str(&t)?, runs_dir))
        .with_context(|| format!("the experiment's setup in {}", setup_path.display()))?;
    let traces: Vec<PathBuf> = RUNS.iter().map(|r| runs_dir.join(format!("{r}.trace"))).collect();
    if let Some(missing) = traces.iter().find(|t| !t.is_file()) {
        bail!("{} is missing: run `cargo xtask experiment dense-weights` again", missing.display());
    }
    let docs = cache::workspace_root().join("docs/findings");
    std::fs::create_dir_all(&docs)?;
    let obs = |args: &[&str], files: &[PathBuf]| -> Result<String> {
        cmd::output(Command::new(observer).args(args).args(files))
    };
    let markdown = obs(&["diff", "--markdown"], &traces)?;
    let json: Value = serde_json::from_str(&obs(&["diff", "--json"], &traces)?).context("observer diff --json")?;
    let pictures = [
        ("dense-weights-compare.svg", vec!["plot", "compare"], traces.clone()),
        ("dense-weights-tokens-anon.svg", vec!["plot", "tokens"], vec![traces[0].clone()]),
        ("dense-weights-tokens-locked.svg", vec!["plot", "tokens"], vec![traces[1].clone()]),
    ];
    for (name, args, files) in &pictures {
        let out = docs.join(name);
        if out.exists() {
            std::fs::remove_file(&out)?;
        }
        cmd::run(Command::new(observer).args(args).args(files).arg("-o").arg(&out))?;
    }
    let md = findings(&setup, &markdown, &json)?;
    let path = docs.join("dense-weights.md");
    std::fs::write(&path, md).with_context(|| format!("writing {}", path.display()))?;
    println!("experiment: wrote {} and its plots in {:.0} s", path.display(), started.elapsed().as_secs_f64());
    Ok(())
}

struct Setup {
    n: usize,
    threads: usize,
    model: PathBuf,
    model_mib: u64,
    dense_mib: u64,
    limit_mib: u64,
    cgroup: String,
    runs_dir: PathBuf,
    /// /proc/loadavg's 1-minute load before and after the runs.
    load: (f64, f64),
}

impl Setup {
    fn to_json(&self) -> Value {
        serde_json::json!({
            "tokens": self.n, "threads": self.threads, "model": self.model, "model_mib": self.model_mib,
            "dense_mib": self.dense_mib, "limit_mib": self.limit_mib, "cgroup": self.cgroup,
            "load_before": self.load.0, "load_after": self.load.1,
        })
    }

    fn from_json(v: &Value, runs_dir: &Path) -> Result<Setup> {
        let num = |k: &str| v[k].as_u64().with_context(|| format!("no {k:?}"));
        let float = |k: &str| v[k].as_f64().with_context(|| format!("no {k:?}"));
        let text = |k: &str| v[k].as_str().map(str::to_owned).with_context(|| format!("no {k:?}"));
        Ok(Setup {
            n: num("tokens")? as usize,
            threads: num("threads")? as usize,
            model: text("model")?.into(),
            model_mib: num("model_mib")?,
            dense_mib: num("dense_mib")?,
            limit_mib: num("limit_mib")?,
            cgroup: text("cgroup")?,
            runs_dir: runs_dir.to_owned(),
            load: (float("load_before")?, float("load_after")?),
        })
    }
}

fn loadavg() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN)
}

/// A diff row's side value and interval, e.g. `12.3 [11.9, 12.8]`.
fn side(row: &Value, s: &str) -> Option<(f64, f64, f64)> {
    let e = &row[s];
    Some((e["value"].as_f64()?, e["ci95"]["lo"].as_f64()?, e["ci95"]["hi"].as_f64()?))
}

fn fmt_side(v: Option<(f64, f64, f64)>) -> String {
    v.map_or("not measured".into(), |(v, lo, hi)| format!("{v:.2} [{lo:.2}, {hi:.2}]"))
}

/// The sentences on what each side did with the limit's memory, from the residency and refault
/// rows: how much of the `anon` dense weights sat in zram against how much of it came back
/// (swap-ins over the run, an upper bound: other anonymous pages count too), and what the
/// `locked` side's resident dense weights cost the experts' page cache (refaults over every
/// eviction kind, and their `fault_io`). Each sentence only when its rows were measured.
fn where_the_memory_went(s: &Setup, ms: &dyn Fn(&str, &str) -> Option<f64>, anon: &str, locked: &str) -> String {
    const PAGE_MIB: f64 = 4096.0 / 1048576.0;
    let mut md = String::new();
    if let (Some(frac), Some(swapins)) = (ms("dense_swapped_frac", anon), ms("swapins", anon)) {
        let out_mib = frac * s.dense_mib as f64;
        let back_mib = swapins * s.n as f64 * PAGE_MIB;
        let _ = writeln!(
            md,
            "- With `anon`, {:.0} % of the dense weights ({out_mib:.0} MiB) sat in zram (mean over tokens); over the \
             run's {} tokens the engine swapped in at most {back_mib:.1} MiB ({swapins:.1} pages/token, any \
             anonymous page): {}",
            frac * 100.0,
            s.n,
            if back_mib < out_mib / 2.0 {
                "most of what went to zram was not read back while decoding."
            } else {
                "decode read back as much as went out."
            }
        );
    }
    let kinds = observer_common::vocab::EVICTION_ACTORS;
    let sum = |f: &dyn Fn(&str) -> String, side: &str| -> Option<f64> {
        kinds.iter().map(|k| ms(&f(k.name), side)).sum::<Option<f64>>()
    };
    let refaulted = |side: &str| sum(&|k| format!("refaulted_by_{k}"), side);
    let refault_io = |side: &str| sum(&|k| format!("refault_io_{k}_ms"), side);
    if let (Some(ea), Some(el), Some(ra), Some(rl), Some(ia), Some(il)) = (
        ms("experts_resident_frac", anon),
        ms("experts_resident_frac", locked),
        refaulted(anon),
        refaulted(locked),
        refault_io(anon),
        refault_io(locked),
    ) {
        let _ = writeln!(
            md,
            "- The routed experts' share in the page cache: {:.1} % with `anon`, {:.1} % with `locked`; model-file \
             pages evicted and read back into the page cache per token: {ra:.0} with `anon`, {rl:.0} with `locked` \
             ({:.1} and {:.1} MB/token read from the file); the engine's faults on them took {ia:.2} and {il:.2} \
             ms/token of `fault_io`, summed over its threads.",
            ea * 100.0,
            el * 100.0,
            ms("read_mb", anon).unwrap_or(f64::NAN),
            ms("read_mb", locked).unwrap_or(f64::NAN),
        );
        if let (Some(ta), Some(tl)) = (ms("tok_s", anon), ms("tok_s", locked))
            && tl < ta
            && rl > ra
        {
            let _ = writeln!(
                md,
                "- So under this limit, locking the dense weights made decode slower: the memory they kept \
                 resident came out of the experts' page cache, whose refaults cost more than the dense pages \
                 `anon` left in zram."
            );
        }
    }
    md
}

fn findings(s: &Setup, diff_md: &str, d: &Value) -> Result<String> {
    let cmp = &d["comparisons"][0];
    let rows = cmp["rows"].as_array().context("diff JSON: no comparison rows")?;
    let row = |name: &str| rows.iter().find(|r| r["metric"] == name);
    let val = |name: &str, s: &str| row(name).and_then(|r| side(r, s));
    let a_is_anon = d["sides"][0]["config"]["dense"] == "anon";
    let (anon, locked) = if a_is_anon { ("a", "b") } else { ("b", "a") };
    let mut md = String::new();
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_default();
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let ncpu = std::thread::available_parallelism().map_or(0, |n| n.get());
    writeln!(md, "# Dense weights: `anon` against `locked` under memory pressure\n")?;
    writeln!(
        md,
        "Written by `cargo xtask experiment dense-weights -n {} -t {}` (`xtask/src/experiment.rs`); every \
         number and sentence below comes from that run. Regenerate it rather than editing it.\n",
        s.n, s.threads
    )?;
    writeln!(md, "## Setup\n")?;
    writeln!(md, "- Machine: {cpu}, {ncpu} CPUs, Linux {}.", kernel.trim())?;
    writeln!(
        md,
        "- Model: `{}` ({} MiB, {} MiB of it dense: attention, norms, router, embeddings, output).",
        s.model.file_name().map_or(String::new(), |f| f.to_string_lossy().into_owned()),
        s.model_mib,
        s.dense_mib
    )?;
    writeln!(
        md,
        "- Memory: a cgroup limit of {} MiB ({}), zram swap of 1 GiB, and a 64 MiB \
         balloon re-reading its pages every 100 ms in the same cgroup.",
        s.limit_mib, s.cgroup
    )?;
    writeln!(
        md,
        "- Runs: A-B-B-A, A = `engine run --dense anon`, B = `--dense locked`, {} greedy tokens each, {} threads, \
         page cache dropped before each, each under `observer record --cgroup`. Traces: `{}`.",
        s.n,
        s.threads,
        s.runs_dir.display()
    )?;
    writeln!(
        md,
        "- Load: the 1-minute load average was {:.1} before the runs and {:.1} after ({ncpu} CPUs).\n",
        s.load.0, s.load.1
    )?;
    writeln!(md, "## What the numbers show\n")?;
    let tps = (val("tok_s", anon), val("tok_s", locked));
    if let (Some(a), Some(b)) = tps {
        let pct = (b.0 - a.0) / a.0 * 100.0;
        let disjoint = row("tok_s").and_then(|r| r["disjoint"].as_bool()).unwrap_or(false);
        writeln!(
            md,
            "- Decode with the dense weights locked: {:.2} tok/s against {:.2} with them in anonymous memory, \
             {pct:+.1} %; the 95 % intervals {}. The seeds' phone run measured {PHONE_SPEEDUP_PCT:+.1} %.",
            b.0,
            a.0,
            if disjoint { "are disjoint: a real difference" } else { "overlap: not resolved by this run" }
        )?;
    }
    let ms = |name: &str, s: &str| val(name, s).map(|v| v.0);
    if let (Some(ec), Some(c)) = (ms("engine_compute_ms", anon), ms("compute_ms", anon)) {
        // What the observer measured besides compute, largest first.
        let mut others: Vec<(&str, f64)> = observer_common::vocab::Component::ALL
            .iter()
            .filter(|c| c.name() != "compute")
            .filter_map(|c| Some((c.name(), ms(&format!("{}_ms", c.name()), anon)?)))
            .collect();
        others.sort_by(|x, y| y.1.total_cmp(&x.1));
        let listed: Vec<String> = others.iter().take(4).map(|(n, v)| format!("`{n}` {v:.2}")).collect();
        writeln!(
            md,
            "- With `anon`, the engine's own `compute` (a residual: its step time minus what it timed as I/O) is \
             {ec:.2} ms/token; the observer measured {c:.2} ms/token of user-mode compute. The {:.2} ms/token \
             between them is hidden inside the engine's number; the largest parts the observer measured \
             (ms/token): {}; `swapin_zram` is {:.2}. The phone's hidden share was {PHONE_HIDDEN_MS:.0} ms/token, \
             most of it zram.",
            ec - c,
            listed.join(", "),
            ms("swapin_zram_ms", anon).unwrap_or(0.0)
        )?;
    }
    // The component whose mean moved most between the sides.
    let moved = rows
        .iter()
        .filter_map(|r| {
            let name = r["metric"].as_str()?.strip_suffix("_ms")?;
            observer_common::vocab::Component::from_name(name)?;
            Some((name, ms(&format!("{name}_ms"), anon)?, ms(&format!("{name}_ms"), locked)?))
        })
        .max_by(|x, y| (x.2 - x.1).abs().total_cmp(&(y.2 - y.1).abs()));
    if let Some((name, a, b)) = moved {
        writeln!(md, "- The component that moved most: `{name}`, {a:.2} ms/token with `anon`, {b:.2} with `locked`.")?;
    }
    if let Some(rq) = ms("runqueue_ms", anon).filter(|&rq| rq > 0.25 * ms("wall_ms", anon).unwrap_or(f64::INFINITY)) {
        writeln!(
            md,
            "- `runqueue` is {rq:.1} ms/token with `anon`: the engine's threads waited for a CPU for a large share \
             of the wall time, so other processes on this machine shaped these numbers."
        )?;
    }
    if let (Some(zl), Some(za)) = (ms("swapin_zram_ms", locked), ms("swapin_zram_ms", anon)) {
        writeln!(md, "- `swapin_zram` per token: {za:.2} ms with `anon`, {zl:.2} ms with `locked`.")?;
    }
    if let (Some(ml), Some(ma)) = (ms("majflt_swap", locked), ms("majflt_swap", anon)) {
        writeln!(md, "- Swap-in major faults per token: {ma:.1} with `anon`, {ml:.1} with `locked`.")?;
    }
    md.push_str(&where_the_memory_went(s, &ms, anon, locked));
    writeln!(md, "\n## The rows the question is about (95 % bootstrap intervals)\n")?;
    writeln!(md, "| metric | anon | locked |\n|---|---|---|")?;
    for name in [
        "tok_s",
        "wall_ms",
        "compute_ms",
        "engine_compute_ms",
        "hidden_ms",
        "swapin_zram_ms",
        "fault_minor_ms",
        "majflt_swap",
    ] {
        writeln!(md, "| `{name}` | {} | {} |", fmt_side(val(name, anon)), fmt_side(val(name, locked)))?;
    }
    writeln!(md, "\n![anon vs locked](dense-weights-compare.svg)\n")?;
    writeln!(md, "Per token, first `anon` run:\n\n![anon](dense-weights-tokens-anon.svg)\n")?;
    writeln!(md, "Per token, first `locked` run:\n\n![locked](dense-weights-tokens-locked.svg)\n")?;
    writeln!(md, "## `observer diff --markdown` of the four runs\n")?;
    md.push_str(diff_md);
    Ok(md)
}
