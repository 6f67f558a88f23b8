//! `observer record -o FILE [run options] -- CMD`: `observer run` with the
//! recorder (`observer::sinks::trace_writer::TraceWriter`) as an extra sink.

use std::path::PathBuf;

use anyhow::{Result, bail};

use observer::capture::session::Stop;

use super::run::{RunArgs, observe};

#[derive(Debug, clap::Args)]
pub struct RecordArgs {
    /// The trace file to write (see `observer::store::trace` for the format).
    #[arg(short = 'o', long = "output", value_name = "FILE")]
    pub output: PathBuf,
    #[command(flatten)]
    pub run: RunArgs,
}

pub async fn record(mut a: RecordArgs) -> Result<i32> {
    if a.run.record.is_some() {
        bail!("give the trace file once: `observer record -o FILE`, or `observer run --record FILE`");
    }
    a.run.record = Some(a.output);
    let stop = Stop::install()?;
    observe(a.run, Vec::new(), &stop).await
}
