//! `cargo xtask demo [--pressure] [-n TOKENS] [--no-tui]`: the project's front door.
//!
//! Generates the `small` synthetic model once (cached under the cache dir, keyed by its
//! configuration), then runs the live TUI beside a real generation:
//! `observer tui -- engine run -m small.gguf …`. With `--pressure` the engine runs with its
//! dense weights in anonymous memory (`--dense anon`) inside a memory cgroup smaller than the
//! model, with zram swap on and a balloon beside it, so the zram swap-ins that the engine's own
//! `compute` hides show up as `swapin_zram` and as the hidden cost (the model is evicted from
//! the page cache first, so that its pages are read in, and charged, inside that cgroup); the
//! machine is restored afterwards. Without a terminal (CI, a pipe) or with `--no-tui` it runs
//! `observer run`, which prints per-token lines and the summary instead.

use std::{io::IsTerminal, process::Command, time::Duration};

use anyhow::{Context, Result, bail};

use crate::{cmd, llama};

const PROMPT: &str = "Where does the time of a token go, when the model is larger than the memory";

pub fn run(args: &[String]) -> Result<()> {
    let mut pressure = false;
    let mut tui = std::io::stdout().is_terminal() && std::io::stdin().is_terminal();
    let mut n: Option<usize> = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--pressure" => pressure = true,
            "--no-tui" => tui = false,
            "-n" => n = Some(it.next().context("-n needs a value")?.parse().context("-n: a number of tokens")?),
            _ => bail!("usage: cargo xtask demo [--pressure] [-n TOKENS] [--no-tui]"),
        }
    }
    // Under pressure a token takes hundreds of ms: fewer of them.
    let n = n.unwrap_or(if pressure { 64 } else { 256 });
    let bin = crate::bench_util::build()?;
    let engine = bin.join("engine");
    eprintln!("demo: the `small` synthetic model (generated once, then cached)");
    let model = llama::synth_model(&engine, "demo-small", &["--preset", "small"])?;
    let model_mib = std::fs::metadata(&model).map(|m| m.len() >> 20).unwrap_or(0);
    let dense_mib = {
        let g = engine::gguf::Gguf::open(&model).with_context(|| format!("reading {}", model.display()))?;
        g.tensors.iter().filter(|t| !t.is_routed_expert()).map(|t| t.size).sum::<u64>() >> 20
    };

    // Optional memory pressure: a limit just above the dense weights (far below the model),
    // zram on, and a balloon beside the engine that keeps re-reading its pages, so the
    // engine's anonymous dense copy is pushed to zram between tokens.
    let guard = if pressure {
        let limit = dense_mib + 96;
        eprintln!(
            "demo: memory limit {limit} MiB for a {model_mib} MiB model ({dense_mib} MiB dense), zram swap 1 GiB, 64 MiB balloon"
        );
        Some(
            testkit::Pressure::new(&testkit::PressureConfig {
                name: "moe-observer-demo".into(),
                limit_bytes: limit << 20,
                zram_mib: Some(1024),
                balloon_mib: 64,
                balloon_touch: Duration::from_millis(100),
            })
            .context("setting up memory pressure (needs root, zram and a memory cgroup controller, v1 or v2)")?,
        )
    } else {
        None
    };
    if let Some(p) = &guard {
        eprintln!("demo: memory cgroup {}, {}", p.cgroup.dir().display(), p.cgroup.describe());
        // Page cache is charged to the cgroup of the process that reads it in. The model was
        // just written or read outside the group, so its pages would stay charged to the
        // machine's root and never count against the limit: evict them, and the engine's own
        // reads fill (and refault) the group's page cache.
        testkit::evict(&model)?;
        eprintln!("demo: {} evicted from the page cache", model.display());
    }
    let mut c = Command::new(bin.join("observer"));
    c.arg(if tui { "tui" } else { "run" });
    if !tui {
        c.args(["--every", "16"]);
    }
    if let Some(p) = &guard {
        c.arg("--cgroup").arg(p.cgroup.dir());
    }
    c.arg("--").arg(&engine).arg("run").arg("-m").arg(&model);
    c.args(["-p", PROMPT, "-n", &n.to_string(), "--ignore-eos"]);
    c.args(["--dense", if pressure { "anon" } else { "mmap" }]);
    let r = cmd::run(&mut c);
    drop(guard); // restores the machine before any error is reported
    r
}
