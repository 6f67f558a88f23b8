//! `observer diff A B [C D …]`: compare runs (traces or bmoe_metrics CSVs)
//! with bootstrap intervals (`observer::diff`).

use std::path::PathBuf;

use anyhow::{Result, bail};
use observer::{diff, import};

#[derive(Debug, clap::Args)]
pub struct DiffArgs {
    /// Traces (`observer record`) or bmoe_metrics CSVs; runs with the same
    /// configuration are pooled (e.g. A1 B1 B2 A2).
    #[arg(value_name = "FILE", num_args = 2.., required = true)]
    pub files: Vec<PathBuf>,
    /// Print Markdown instead of the terminal table.
    #[arg(long, conflicts_with = "json")]
    pub markdown: bool,
    /// Print JSON instead of the terminal table.
    #[arg(long)]
    pub json: bool,
    /// Bootstrap resamples.
    #[arg(long, default_value_t = observer::stats::DEFAULT_RESAMPLES)]
    pub resamples: usize,
    /// Seed of the bootstrap's random draws.
    #[arg(long, default_value_t = observer::stats::DEFAULT_SEED)]
    pub seed: u64,
    /// A configuration key that is not a setting (an output path, a label):
    /// leave it out when grouping runs. Repeatable.
    #[arg(long, value_name = "KEY")]
    pub ignore: Vec<String>,
}

pub fn diff(a: DiffArgs) -> Result<i32> {
    if a.resamples < 100 {
        bail!("--resamples {} is too few for a 95 % interval (use 1000 or more)", a.resamples);
    }
    let runs = a.files.iter().map(|p| import::load(p)).collect::<Result<Vec<_>, _>>()?;
    let d = diff::diff(&runs, &diff::Options { resamples: a.resamples, seed: a.seed, ignore: a.ignore });
    if a.json {
        println!("{}", serde_json::to_string_pretty(&d)?);
    } else if a.markdown {
        print!("{}", diff::render_markdown(&d));
    } else {
        print!("{}", diff::render_text(&d));
    }
    Ok(0)
}
