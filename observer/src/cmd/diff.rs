//! `observer diff A B [C D …]`: compare runs (traces or bmoe_metrics CSVs)
//! with bootstrap intervals (`observer::analysis::diff`).

use std::path::PathBuf;

use anyhow::{Result, bail};
use observer::{analysis::diff, store::import};

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
    #[command(flatten)]
    pub bootstrap: BootstrapArgs,
    /// A configuration key that is not a setting (an output path, a label):
    /// leave it out when grouping runs. Repeatable.
    #[arg(long, value_name = "KEY")]
    pub ignore: Vec<String>,
}

/// The bootstrap's settings, shared by `diff` and `report`.
#[derive(Debug, clap::Args)]
pub struct BootstrapArgs {
    /// Bootstrap resamples.
    #[arg(long, default_value_t = observer::analysis::stats::DEFAULT_RESAMPLES)]
    pub resamples: usize,
    /// Seed of the bootstrap's random draws.
    #[arg(long, default_value_t = observer::analysis::stats::DEFAULT_SEED)]
    pub seed: u64,
}

impl BootstrapArgs {
    pub fn options(&self, ignore: Vec<String>) -> Result<diff::Options> {
        if self.resamples < 100 {
            bail!("--resamples {} is too few for a 95 % interval (use 1000 or more)", self.resamples);
        }
        Ok(diff::Options { resamples: self.resamples, seed: self.seed, ignore })
    }
}

pub fn diff(a: DiffArgs) -> Result<i32> {
    let opts = a.bootstrap.options(a.ignore)?;
    let runs = a.files.iter().map(|p| import::load(p)).collect::<Result<Vec<_>, _>>()?;
    let d = diff::diff(&runs, &opts);
    if a.json {
        println!("{}", serde_json::to_string_pretty(&d)?);
    } else if a.markdown {
        print!("{}", diff::render_markdown(&d));
    } else {
        print!("{}", diff::render_text(&d));
    }
    Ok(0)
}
