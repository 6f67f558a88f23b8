//! `observer export --chrome-trace OUT FILE`: a trace or an imported CSV as
//! Chrome/Perfetto trace JSON (`observer::analysis::export`).

use std::{io::Write, path::PathBuf};

use anyhow::{Context, Result};
use observer::{analysis::export, store::import};

#[derive(Debug, clap::Args)]
pub struct ExportArgs {
    /// Write a Chrome / Perfetto trace (JSON) to this file (`-` for stdout).
    #[arg(long, value_name = "OUT", required = true)]
    pub chrome_trace: PathBuf,
    /// A trace recorded by `observer record`, or a bmoe_metrics CSV.
    #[arg(value_name = "FILE")]
    pub input: PathBuf,
}

pub fn export(a: ExportArgs) -> Result<i32> {
    let run = import::load(&a.input)?;
    for n in &run.notes {
        log::warn!("{n}");
    }
    let v = export::chrome_trace(&run);
    if a.chrome_trace.as_os_str() == "-" {
        let mut out = std::io::stdout().lock();
        serde_json::to_writer(&mut out, &v).context("writing the trace to stdout")?;
        writeln!(out)?;
    } else {
        let f = std::fs::File::create(&a.chrome_trace)
            .with_context(|| format!("cannot create {}", a.chrome_trace.display()))?;
        let mut w = std::io::BufWriter::new(f);
        serde_json::to_writer(&mut w, &v).with_context(|| format!("writing {}", a.chrome_trace.display()))?;
        w.flush().with_context(|| format!("writing {}", a.chrome_trace.display()))?;
        log::info!(
            "wrote {} ({} tokens); open it in ui.perfetto.dev or chrome://tracing",
            a.chrome_trace.display(),
            run.tokens.len()
        );
    }
    Ok(0)
}
