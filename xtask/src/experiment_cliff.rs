//! `cargo xtask experiment cliff`: the page-cache cliff of issue 17, told by the tool itself.
//!
//! ## Protocol
//! - The run is `cargo xtask bench cliff` (spec: `bench_cliff.rs`) with the options given
//!   (default: the full grid: the 5.6 GB 30B-A3B-shaped model, unlimited, 80, 60 and 40 % of the
//!   file, engine `cache`, engine `mmap`, llama.cpp `mmap`, 3 alternating rounds of 64 measured
//!   tokens after 16), its cells written as `cliff.json` (`moe-observer bench-cliff v1`).
//! - Output, regenerated as a whole, in `--out DIR` (default `docs/findings/`):
//!   - `cliff.json`: every cell of every round;
//!   - `cliff.svg`: `observer plot cliff cliff.json`, tok/s against the memory limit;
//!   - `cliff-split.svg`: `observer plot cliff-split cliff.json`, the observer's split of a token
//!     per cell (a stacked bar of mean ms per component each);
//!   - `cliff.md`: the setup (machine, load, model, options), the plots, the medians per cell,
//!     the observer's component split per cell, the targets met or not, and what the
//!     numbers show: sentences computed from this run's numbers ([`findings`]), none typed in.
//! - `--small`: a reduced run for development and the test: the 3-layer small model, unlimited
//!   and 80 %, one round of 8 measured tokens, no llama.cpp, written to
//!   `target/experiment-cliff-small/` unless `--out` says otherwise, so that it never replaces
//!   the committed findings. Its findings say that they are of a reduced run.

use std::{
    fmt::Write as _,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};

use crate::bench_cliff::{self, Options, Row, Setup, Summary};
use crate::{cache, cmd};

pub fn main(args: &[String]) -> Result<()> {
    let usage = || format!("usage: cargo xtask experiment cliff [--out DIR] {}", bench_cliff::USAGE);
    let mut o = Options::default();
    let mut out: Option<PathBuf> = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "--out" {
            out = Some(PathBuf::from(it.next().with_context(usage)?));
        } else if !o.apply(a, &mut it)? {
            bail!("{}", usage());
        }
    }
    if o.small {
        reduce(&mut o);
    }
    let out = out.unwrap_or_else(|| {
        if o.small {
            cache::target_dir().join("experiment-cliff-small")
        } else {
            cache::workspace_root().join("docs/findings")
        }
    });
    let md = run(o, &out)?;
    println!("experiment: wrote {} with its plot and cells", md.display());
    Ok(())
}

/// The reduced run of `--small` (module spec).
pub(crate) fn reduce(o: &mut Options) {
    o.small = true;
    (o.rounds, o.tokens, o.with_llama) = (1, 8, false);
    o.limits = vec![None, Some(0.8)];
}

/// Runs the bench with `o` and writes `cliff.json`, `cliff.svg` and `cliff.md` into `out`;
/// returns the path of `cliff.md`.
pub(crate) fn run(mut o: Options, out: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    o.json = Some(out.join("cliff.json"));
    let command = command_line(&o, out);
    let setup = bench_cliff::prepare(o.clone())?;
    write_up(&setup, o.small, command, out)
}

/// Runs the bench of `setup` (whose `json` is `out/cliff.json`) and writes its plot and findings
/// into `out`; `small`: a reduced run, `command`: the command line the findings name.
pub(crate) fn write_up(setup: &Setup, small: bool, command: String, out: &Path) -> Result<PathBuf> {
    let json = out.join("cliff.json");
    if setup.json.as_deref() != Some(json.as_path()) {
        bail!("the bench must write its cells to {}", json.display());
    }
    let load_before = loadavg();
    let (bench, summary) = bench_cliff::run(setup)?;
    for (kind, file) in PLOTS {
        let svg = out.join(file);
        if svg.exists() {
            std::fs::remove_file(&svg).with_context(|| format!("removing the old {}", svg.display()))?;
        }
        cmd::run(Command::new(&setup.observer).args(["plot", kind]).arg(&json).arg("-o").arg(&svg))?;
    }
    let run = RunFacts {
        command,
        small,
        machine: machine(),
        load: (load_before, loadavg()),
        model: setup.model.file_name().map_or(String::new(), |f| f.to_string_lossy().into_owned()),
        model_bytes: bench.model_bytes,
        threads: setup.threads,
        rounds: setup.rounds,
        tokens: setup.tokens,
        llama: setup.llama.is_some(),
        scratch: setup.scratch.clone(),
    };
    let md = out.join("cliff.md");
    std::fs::write(&md, findings(&run, &summary)?).with_context(|| format!("writing {}", md.display()))?;
    Ok(md)
}

/// The plots of the findings: `observer plot KIND` and the file it writes.
pub(crate) const PLOTS: [(&str, &str); 2] = [("cliff", "cliff.svg"), ("cliff-split", "cliff-split.svg")];

/// What the findings say about the run besides its numbers.
#[derive(Debug, Clone)]
pub(crate) struct RunFacts {
    pub command: String,
    pub small: bool,
    pub machine: String,
    /// The 1-minute load average before and after the run.
    pub load: (f64, f64),
    pub model: String,
    pub model_bytes: u64,
    pub threads: usize,
    pub rounds: usize,
    pub tokens: usize,
    pub llama: bool,
    pub scratch: PathBuf,
}

pub(crate) fn command_line(o: &Options, out: &Path) -> String {
    let mut c = String::from("cargo xtask experiment cliff");
    if o.small {
        c.push_str(" --small");
    } else {
        let limits: Vec<String> =
            o.limits.iter().map(|l| l.map_or("none".into(), |l| format!("{:.0}", l * 100.0))).collect();
        write!(c, " --rounds {} --tokens {} --threads {} --limits {}", o.rounds, o.tokens, o.threads, limits.join(","))
            .ok();
        if !o.with_llama {
            c.push_str(" --no-llama");
        }
        if o.prefetch {
            c.push_str(" --prefetch");
        }
    }
    if out != cache::workspace_root().join("docs/findings") {
        write!(c, " --out {}", out.display()).ok();
    }
    c
}

fn loadavg() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN)
}

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines().find(|l| l.starts_with("model name")).and_then(|l| Some(l.split(':').nth(1)?.trim().to_string()))
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let ncpu = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!("{cpu}, {ncpu} CPUs, Linux {}", kernel.trim())
}

/// Resources a token's time can be limited by, each a set of the observer's components.
const RESOURCES: [(&str, &[&str]); 5] = [
    ("compute (the CPU work of the token)", &["compute", "fault_minor", "syscall"]),
    ("storage (waiting for reads: faults, explicit reads, a peer's reads)", &["fault_io", "io_wait", "io_wait_peer"]),
    ("reclaim (freeing memory before allocating)", &["reclaim"]),
    ("CPU contention (runnable, waiting for a CPU)", &["runqueue"]),
    ("zram (decompressing swapped-out pages)", &["swapin_zram"]),
];

/// A row's ms per token of the components of a resource.
fn resource_ms(r: &Row, comps: &[&str]) -> f64 {
    r.split.iter().filter(|(n, _)| comps.contains(n)).map(|(_, ms)| ms).filter(|ms| ms.is_finite()).sum()
}

/// The resource with the most ms per token in `r`, and that number.
fn limit_of(r: &Row) -> (&'static str, f64) {
    RESOURCES
        .iter()
        .map(|(name, comps)| (*name, resource_ms(r, comps)))
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .unwrap_or(("", 0.0))
}

fn fmt_opt(v: Option<f64>, digits: usize) -> String {
    v.filter(|v| v.is_finite()).map_or("–".into(), |v| format!("{v:.digits$}"))
}

/// The findings document of a run (module spec): every number from `s`, every sentence chosen by
/// those numbers.
pub(crate) fn findings(run: &RunFacts, s: &Summary) -> Result<String> {
    let mut md = String::new();
    writeln!(md, "# The page-cache cliff: the expert cache against the mapping\n")?;
    writeln!(
        md,
        "Written by `{}` (`xtask/src/experiment_cliff.rs`); every number and sentence below comes from that \
         run. Regenerate it rather than editing it.\n",
        run.command
    )?;
    if run.small {
        writeln!(
            md,
            "**A reduced run** (`--small`: a {:.0} MB model, one round of {} tokens, no llama.cpp): it shows that \
             the experiment works, not the issue's targets, which need the full run on a quiet machine.\n",
            run.model_bytes as f64 / 1e6,
            run.tokens
        )?;
    }
    writeln!(md, "## Setup\n")?;
    writeln!(md, "- Machine: {}.", run.machine)?;
    writeln!(
        md,
        "- Load: the 1-minute load average was {:.1} before the run and {:.1} after.",
        run.load.0, run.load.1
    )?;
    writeln!(md, "- Model: `{}` ({:.2} GB).", run.model, run.model_bytes as f64 / 1e9)?;
    writeln!(
        md,
        "- Runs: {} round(s), {} measured tokens after 16 of warm-up per run, {} threads; systems: engine \
         `--experts cache`, engine `--experts mmap` (both `--dense anon`){}; each run under `observer run` in a \
         memory cgroup of the share of the file named by its limit, the file evicted first; the warm cell is engine \
         `mmap`, unlimited, the file read right before. Per-run outputs: `{}`.",
        run.rounds,
        run.tokens,
        run.threads,
        if run.llama { ", llama.cpp `llama-bench --repack 0 -lm mmap`" } else { "; llama.cpp not run" },
        run.scratch.display()
    )?;
    if let Some(x) = s.experts_for_90pct {
        writeln!(md, "- Routing: {:.0} % of a layer's experts made up 90 % of its selections (warm run).", x * 100.0)?;
    }
    writeln!(md, "\n![tok/s against the memory limit](cliff.svg)\n")?;

    writeln!(md, "## What the numbers show\n")?;
    let row = |limit: &str, system: &str| s.rows.iter().find(|r| r.limit == limit && r.system == system);
    writeln!(md, "- Warm speed (engine `mmap`, unlimited, just warmed): {:.2} tok/s.", s.warm)?;
    let mut limits: Vec<&str> = Vec::new();
    for r in &s.rows {
        if !limits.contains(&r.limit.as_str()) {
            limits.push(&r.limit);
        }
    }
    for l in limits {
        let Some(c) = row(l, "engine cache") else { continue };
        let at = if l == "none" { "Without a limit".to_string() } else { format!("At {l} of the file") };
        let mut parts = vec![format!(
            "the cache decoded {:.2} tok/s ({:.2}× warm{})",
            c.tok_s,
            c.tok_s / s.warm,
            c.hit_pct.map_or(String::new(), |h| format!(", {h:.1} % hits"))
        )];
        for other in ["engine mmap", "llama.cpp mmap"] {
            if let Some(o) = row(l, other) {
                parts.push(format!(
                    "{other} {:.2} tok/s (the cache {:.2}× it, {:.1} against {:.1} MB read per token)",
                    o.tok_s,
                    c.tok_s / o.tok_s,
                    c.read_mb_per_tok,
                    o.read_mb_per_tok
                ));
            }
        }
        writeln!(md, "- {at}, {}.", parts.join("; "))?;
        if let Some(r) = c.read_vs_misses {
            writeln!(
                md,
                "  The cache read {:.3}× the bytes of the experts it missed ({}).",
                r,
                if r <= 1.5 { "within the 1.5× target" } else { "over the 1.5× target" }
            )?;
        }
        if let (Some(stall), Some(peer)) = (c.stall_ms, c.split.iter().find(|(n, _)| *n == "io_wait_peer")) {
            writeln!(
                md,
                "  The decode thread waited {stall:.1} ms per token for the cache's reads by the engine's clock \
                 (`stall`); the observer's `io_wait_peer` (mean thread) is {:.1} ms per token.",
                peer.1
            )?;
        }
    }
    let missed: Vec<_> = s.targets.iter().filter(|t| !t.met()).collect();
    if s.targets.is_empty() {
        writeln!(md, "- No limit of this run has a target of issue 17 (they are at 80, 60 and 40 %).")?;
    } else if missed.is_empty() {
        writeln!(md, "- Every target of issue 17 this run measured is met ({}).", s.targets.len())?;
    } else {
        writeln!(md, "- {} of the {} targets this run measured are missed:", missed.len(), s.targets.len())?;
        for t in &missed {
            writeln!(md, "  - {}: {:.3}, target {} {}.", t.what, t.got, if t.at_most { "≤" } else { "≥" }, t.want)?;
            if let Some(c) = row(&format!("{}%", t.limit_pct), "engine cache") {
                let (name, ms) = limit_of(c);
                let all: Vec<String> = RESOURCES
                    .iter()
                    .map(|(n, comps)| format!("{} {:.1}", n.split(' ').next().unwrap_or(n), resource_ms(c, comps)))
                    .collect();
                writeln!(
                    md,
                    "    The cache's token ({:.1} ms) went mostly to {name}: {ms:.1} ms per token (ms per token: {}).",
                    1e3 / c.tok_s,
                    all.join(", ")
                )?;
            }
        }
    }

    writeln!(md, "\n## Medians over rounds\n")?;
    writeln!(
        md,
        "| limit | system | tok/s | range | first 16 tok/s | MB read/token | hits % | stall ms |\n|---|---|---|---|---|---|---|---|"
    )?;
    for r in &s.rows {
        writeln!(
            md,
            "| {} | {} | {:.2} | {:.2}–{:.2} | {} | {} | {} | {} |",
            r.limit,
            r.system,
            r.tok_s,
            r.range.0,
            r.range.1,
            fmt_opt(Some(r.first_tok_s), 2),
            fmt_opt(Some(r.read_mb_per_tok), 1),
            fmt_opt(r.hit_pct, 1),
            fmt_opt(r.stall_ms, 1)
        )?;
    }
    writeln!(md, "\n## The observer's split per cell (ms per token of its mean thread, mean over rounds)\n")?;
    writeln!(md, "![the observer's split of a token per cell](cliff-split.svg)\n")?;
    let names = bench_cliff::components();
    writeln!(md, "| limit | system | {} |", names.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(" | "))?;
    writeln!(md, "|---|---|{}", "---|".repeat(names.len()))?;
    for r in &s.rows {
        let v: Vec<String> = r.split.iter().map(|(_, ms)| fmt_opt(Some(*ms), 1)).collect();
        writeln!(md, "| {} | {} | {} |", r.limit, r.system, v.join(" | "))?;
    }
    if !s.targets.is_empty() {
        writeln!(md, "\n## Targets of issue 17\n")?;
        writeln!(md, "| target | measured | wanted | |\n|---|---|---|---|")?;
        for t in &s.targets {
            writeln!(
                md,
                "| {} | {:.3} | {} {} | {} |",
                t.what,
                t.got,
                if t.at_most { "≤" } else { "≥" },
                t.want,
                if t.met() { "met" } else { "**not met**" }
            )?;
        }
    }
    Ok(md)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench_cliff::Target;

    fn row(limit: &str, system: &'static str, tok_s: f64, split: &[(&'static str, f64)]) -> Row {
        Row {
            limit: limit.into(),
            system,
            tok_s,
            range: (tok_s, tok_s),
            first_tok_s: tok_s,
            read_mb_per_tok: 10.0,
            hit_pct: (system == "engine cache").then_some(75.0),
            stall_ms: (system == "engine cache").then_some(4.0),
            split: bench_cliff::components()
                .into_iter()
                .map(|n| (n, split.iter().find(|(m, _)| *m == n).map_or(0.0, |(_, v)| *v)))
                .collect(),
            read_vs_misses: (system == "engine cache").then_some(1.01),
        }
    }

    /// The sentences follow the numbers: a missed target names the resource with the most time in
    /// the cache's token, a met one is not listed, and every table has a row per cell.
    #[test]
    fn findings_are_computed_from_the_summary() {
        let s = Summary {
            warm: 20.0,
            rows: vec![
                row("none", "warm (engine mmap)", 20.0, &[("compute", 50.0)]),
                row("60%", "engine cache", 10.0, &[("compute", 40.0), ("io_wait_peer", 55.0), ("runqueue", 5.0)]),
                row("60%", "engine mmap", 4.0, &[("compute", 40.0), ("fault_io", 200.0)]),
            ],
            targets: vec![
                Target { limit_pct: 60, what: "60%: cache / warm".into(), got: 0.5, want: 0.8, at_most: false },
                Target { limit_pct: 60, what: "60%: cache / engine mmap".into(), got: 2.5, want: 1.5, at_most: false },
            ],
            experts_for_90pct: Some(0.5),
        };
        let run = RunFacts {
            command: "cargo xtask experiment cliff".into(),
            small: false,
            machine: "a CPU".into(),
            load: (1.0, 2.0),
            model: "m.gguf".into(),
            model_bytes: 5_600_000_000,
            threads: 2,
            rounds: 3,
            tokens: 64,
            llama: true,
            scratch: "/tmp/x".into(),
        };
        let md = findings(&run, &s).unwrap();
        assert!(md.contains("At 60% of the file, the cache decoded 10.00 tok/s (0.50× warm, 75.0 % hits)"), "{md}");
        assert!(md.contains("engine mmap 4.00 tok/s (the cache 2.50× it"), "{md}");
        assert!(md.contains("1 of the 2 targets this run measured are missed"), "{md}");
        assert!(md.contains("60%: cache / warm: 0.500, target ≥ 0.8."), "{md}");
        assert!(!md.contains("60%: cache / engine mmap: 2.500"), "a met target is not listed as missed: {md}");
        assert!(md.contains("went mostly to storage (waiting for reads"), "{md}");
        assert!(md.contains("storage 55.0"), "{md}");
        assert!(!md.contains("A reduced run"), "{md}");
        assert_eq!(md.matches("| 60% | engine cache |").count(), 2, "a row in each table: {md}");
        assert!(md.contains("| 60%: cache / engine mmap | 2.500 | ≥ 1.5 | met |"), "{md}");
    }
}
