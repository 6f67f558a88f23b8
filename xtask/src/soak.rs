//! `cargo xtask soak [--minutes N] [--warmup-minutes W] [--every SECONDS] [-n TOKENS]`:
//! `observer serve --discover` for N minutes (default 10) while short engine
//! runs come and go on three models, printing the daemon's RSS, open fds and
//! series count over time, and failing when one grows beyond its bound after
//! the warm-up (default 2 minutes). The driver and its bounds are
//! `testkit::soak`. Not part of `cargo xtask test`.

use std::{path::PathBuf, time::Duration};

use anyhow::{Context, Result, bail};
use testkit::soak;

use crate::{bench_util, cache, llama};

const USAGE: &str = "usage: cargo xtask soak [--minutes N] [--warmup-minutes W] [--every SECONDS] [-n TOKENS]";

pub fn main(args: &[String]) -> Result<()> {
    let (mut minutes, mut warmup, mut every, mut tokens) = (10.0f64, 2.0f64, 10.0f64, 3000u32);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = |name: &str| it.next().with_context(|| format!("{name} needs a value; {USAGE}")).cloned();
        match a.as_str() {
            "--minutes" => minutes = val("--minutes")?.parse().context("--minutes")?,
            "--warmup-minutes" => warmup = val("--warmup-minutes")?.parse().context("--warmup-minutes")?,
            "--every" => every = val("--every")?.parse().context("--every")?,
            "-n" => tokens = val("-n")?.parse().context("-n")?,
            _ => bail!("{USAGE}"),
        }
    }
    if !(minutes > warmup && warmup > 0.0 && every > 0.0) {
        bail!("--minutes must exceed --warmup-minutes, both and --every positive; {USAGE}");
    }
    let bin = bench_util::build()?;
    let (engine, models) = targets(&bin)?;
    let cfg = soak::Config {
        observer: bin.join("observer"),
        engine,
        models,
        tokens,
        duration: Duration::from_secs_f64(minutes * 60.0),
        warmup: Duration::from_secs_f64(warmup * 60.0),
        sample_every: Duration::from_secs_f64(every),
    };
    println!(
        "soak: serve --discover for {minutes} min ({warmup} min warm-up), targets `{}` on {} models, \
         at most {} at once, {tokens} tokens each",
        cfg.engine.display(),
        cfg.models.len(),
        soak::CONCURRENT
    );
    let _lock = testkit::machine_lock();
    let report = soak::run(&cfg, &mut std::io::stdout())?;
    let (rss, fds, series) = report.baseline;
    let (rss_max, fds_max, series_max) = report.after_warmup_max(cfg.warmup);
    let after: Vec<soak::Sample> = report.samples.iter().filter(|s| s.t >= cfg.warmup).copied().collect();
    let median = soak::median_rss(&after);
    let last = report.samples.last().context("no sample")?;
    println!(
        "warm-up maxima: RSS {:.1} MiB, {fds} fds, {series} series; after it: RSS median {:.1} MiB, max {:.1} MiB, \
         {fds_max} fds, {series_max} series; {} targets started, {} observed",
        rss as f64 / 1048576.0,
        median as f64 / 1048576.0,
        rss_max as f64 / 1048576.0,
        last.started,
        last.runs
    );
    println!(
        "bounds after the warm-up: median RSS <= warm-up max × {:.2} + {} MiB, fds <= warm-up max + {}, \
         series <= warm-up max",
        1.0 + soak::RSS_SLACK_FRACTION,
        soak::RSS_SLACK_BYTES >> 20,
        soak::FD_SLACK
    );
    if !report.violations.is_empty() {
        bail!("soak: beyond the bounds:\n{}", report.violations.join("\n"));
    }
    println!("soak: ok");
    Ok(())
}

/// The engine under a name of its own (what `serve --name` follows) and
/// three copies of the synthetic tiny model (three label sets), under
/// `target/soak/`.
fn targets(bin: &std::path::Path) -> Result<(PathBuf, Vec<PathBuf>)> {
    let dir = cache::target_dir().join("soak");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let copy = |from: &std::path::Path, name: &str| -> Result<PathBuf> {
        let to = dir.join(name);
        let tmp = dir.join(format!("{name}.tmp"));
        std::fs::copy(from, &tmp).with_context(|| format!("copying {} to {}", from.display(), tmp.display()))?;
        std::fs::rename(&tmp, &to)?;
        Ok(to)
    };
    let engine = copy(&bin.join("engine"), "engine-soak")?;
    let model = llama::synth_model(&engine, "soak-tiny", &[])?;
    let models =
        ["soak-a.gguf", "soak-b.gguf", "soak-c.gguf"].iter().map(|n| copy(&model, n)).collect::<Result<_>>()?;
    Ok((engine, models))
}
