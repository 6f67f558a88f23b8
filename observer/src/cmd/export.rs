//! `observer export --chrome-trace OUT FILE`: a trace or an imported CSV as
//! Chrome/Perfetto trace JSON (`observer::analysis::export`).

use std::{io::Write, path::PathBuf};

use anyhow::{Context, Result};
use observer::{
    analysis::export,
    output::{Output, Policy},
    store::import,
};

#[derive(Debug, clap::Args)]
pub struct ExportArgs {
    /// Write a Chrome / Perfetto trace (JSON) to this file (`-` for stdout).
    #[arg(long, value_name = "OUT", required = true)]
    pub chrome_trace: PathBuf,
    /// A trace recorded by `observer record`, or a bmoe_metrics CSV.
    #[arg(value_name = "FILE")]
    pub input: PathBuf,
    /// Replace OUT when it exists.
    #[arg(long)]
    pub force: bool,
}

pub fn export(a: ExportArgs) -> Result<i32> {
    let stdout = a.chrome_trace.as_os_str() == "-";
    let inputs = [a.input.clone()];
    let out = (!stdout)
        .then(|| Output::create(&a.chrome_trace, Policy { force: a.force, inputs: &inputs }))
        .transpose()
        .context("--chrome-trace")?;
    let run = import::load(&a.input)?;
    for n in &run.notes {
        log::warn!("{n}");
    }
    let v = export::chrome_trace(&run);
    if let Some(out) = out {
        out.write_all_and_commit(&serde_json::to_vec(&v)?)?;
        log::info!(
            "wrote {} ({} tokens); open it in ui.perfetto.dev or chrome://tracing",
            a.chrome_trace.display(),
            run.tokens.len()
        );
    } else {
        let mut out = std::io::stdout().lock();
        serde_json::to_writer(&mut out, &v).context("writing the trace to stdout")?;
        writeln!(out)?;
    }
    Ok(0)
}
