//! `observer plot KIND INPUT… -o OUT.svg|OUT.png` (`observer::plot`).

use std::path::{Path, PathBuf};

use anyhow::Result;
use observer::{
    analysis::diff,
    plot::{self, cliff},
    store::import,
};

use super::diff::BootstrapArgs;

#[derive(Debug, clap::Args)]
pub struct PlotArgs {
    #[command(subcommand)]
    pub kind: Kind,
}

#[derive(Debug, clap::Subcommand)]
pub enum Kind {
    /// Per-token stacked time components of one run, the engine's own compute as a line.
    Tokens {
        /// A trace (`observer record`) or a bmoe_metrics CSV.
        run: PathBuf,
        #[command(flatten)]
        out: Out,
    },
    /// A against B: each time component's mean with its 95 % bootstrap interval (as `diff`).
    Compare {
        /// Runs, grouped into sides as `observer diff` does (e.g. A1 B1 B2 A2).
        #[arg(value_name = "FILE", num_args = 2.., required = true)]
        files: Vec<PathBuf>,
        #[command(flatten)]
        bootstrap: BootstrapArgs,
        /// A configuration key that is not a setting; repeatable (as `diff --ignore`).
        #[arg(long, value_name = "KEY")]
        ignore: Vec<String>,
        #[command(flatten)]
        out: Out,
    },
    /// The expert grids of one trace over time: resident fraction per MoE layer.
    Residency {
        run: PathBuf,
        #[command(flatten)]
        out: Out,
    },
    /// tok/s against the memory limit, a line per system (`cargo xtask bench cliff --json`).
    Cliff {
        #[arg(value_name = "BENCH_JSON", num_args = 1.., required = true)]
        files: Vec<PathBuf>,
        #[command(flatten)]
        out: Out,
    },
    /// The observer's split of a token per cell (system × limit) of `cargo xtask bench cliff --json`:
    /// a stacked bar of mean ms per component each.
    CliffSplit {
        #[arg(value_name = "BENCH_JSON", num_args = 1.., required = true)]
        files: Vec<PathBuf>,
        #[command(flatten)]
        out: Out,
    },
}

#[derive(Debug, clap::Args)]
pub struct Out {
    /// The picture to write: `.svg` or `.png`.
    #[arg(short, long, value_name = "FILE")]
    pub output: PathBuf,
}

pub fn plot(a: PlotArgs) -> Result<i32> {
    match a.kind {
        Kind::Tokens { run, out } => {
            let r = import::load(&run)?;
            let s = plot::tokens::TokenSeries::of(&r);
            if s.is_empty() {
                anyhow::bail!("{}: no token records to plot", run.display());
            }
            save(&s, &out.output, &[&run])
        }
        Kind::Compare { files, bootstrap, ignore, out } => {
            let opts = bootstrap.options(ignore)?;
            let runs = files.iter().map(|p| import::load(p)).collect::<Result<Vec<_>, _>>()?;
            let c = plot::compare::Comparison::of(&diff::diff(&runs, &opts))?;
            save(&c, &out.output, &paths(&files))
        }
        Kind::Residency { run, out } => {
            let m = plot::residency::ResidencyMap::of(&import::load(&run)?)?;
            save(&m, &out.output, &[&run])
        }
        Kind::Cliff { files, out } => save(&cliff::CliffPlot::of(&benches(&files)?)?, &out.output, &paths(&files)),
        Kind::CliffSplit { files, out } => save(&cliff::SplitPlot::of(&benches(&files)?)?, &out.output, &paths(&files)),
    }
}

/// Bench result files, each with its file name (which names it in the plot and in errors).
fn benches(files: &[PathBuf]) -> Result<Vec<(String, cliff::CliffBench)>> {
    files
        .iter()
        .map(|f| Ok((f.file_name().map_or(String::new(), |n| n.to_string_lossy().into_owned()), cliff::load(f)?)))
        .collect()
}

fn paths(files: &[PathBuf]) -> Vec<&Path> {
    files.iter().map(PathBuf::as_path).collect()
}

fn save(p: &impl plot::Plot, out: &Path, inputs: &[&Path]) -> Result<i32> {
    plot::save(p, out, inputs)?;
    println!("wrote {}", out.display());
    Ok(0)
}
