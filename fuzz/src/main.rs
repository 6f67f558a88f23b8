//! `fuzz`: the stable mutation fuzzer and the corpus tools behind `cargo xtask fuzz` (crate doc).

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "Fuzz targets of moe-observer's parsers (cargo xtask fuzz runs this)")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// The targets, a line each.
    List,
    /// Write the target's seeds (committed corpus and generated) into DIR.
    Seeds { target: String, dir: PathBuf },
    /// Run the seeded mutation fuzzer: rounds of N inputs from seeds S, S+1, …, without end
    /// unless --rounds is given.
    Mutate {
        target: String,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        #[arg(long, default_value_t = 10_000)]
        per_round: u64,
        #[arg(long)]
        rounds: Option<u64>,
    },
    /// Run the target on these files (a crash found earlier).
    Replay { target: String, files: Vec<PathBuf> },
}

fn target(name: &str) -> Result<&'static fuzz::Target> {
    fuzz::target(name).with_context(|| format!("no fuzz target {name:?}; the targets are {}", fuzz::names()))
}

fn main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::List => {
            for t in fuzz::TARGETS {
                println!("{:<11} {}", t.name, t.about);
            }
        }
        Cmd::Seeds { target: name, dir } => {
            let t = target(&name)?;
            std::fs::create_dir_all(&dir).with_context(|| format!("{}: cannot create", dir.display()))?;
            let seeds = fuzz::seeds(t);
            for s in &seeds {
                let p = dir.join(format!("seed-{}", fuzz::hash(s)));
                std::fs::write(&p, s).with_context(|| format!("{}: cannot write", p.display()))?;
            }
            println!("{}: {} seeds in {}", t.name, seeds.len(), dir.display());
        }
        Cmd::Mutate { target: name, seed, per_round, rounds } => {
            let t = target(&name)?;
            let t0 = std::time::Instant::now();
            let mut total = 0u64;
            for r in 0..rounds.unwrap_or(u64::MAX) {
                let s = seed + r;
                let stats = fuzz::smoke(t, s, per_round).map_err(|f| anyhow::anyhow!("{f}"))?;
                total += stats.mutations;
                eprintln!(
                    "fuzz {}: seed {s}: {} seeds and {} mutations passed ({total} in {:.0} s)",
                    t.name,
                    stats.seeds,
                    stats.mutations,
                    t0.elapsed().as_secs_f64()
                );
            }
        }
        Cmd::Replay { target: name, files } => {
            let t = target(&name)?;
            if files.is_empty() {
                bail!("replay: give the files to run {} on", t.name);
            }
            for f in &files {
                let data = std::fs::read(f).with_context(|| format!("{}: cannot read", f.display()))?;
                fuzz::run_one(t, &data, || f.display().to_string()).map_err(|e| anyhow::anyhow!("{e}"))?;
                println!("{}: {} passed", t.name, f.display());
            }
        }
    }
    Ok(())
}
