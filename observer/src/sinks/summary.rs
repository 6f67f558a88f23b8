//! The end-of-run summary as a sink: it keeps what the summary needs as the
//! events pass (`crate::analysis::report::Collector`) and, at the `End`,
//! prints the table to stderr and writes it as JSON when asked. The same
//! table comes from `observer report` on the run's trace, since both are
//! built from the model stream alone.

use std::path::PathBuf;

use anyhow::Context;
use observer_common::model::Event;

use crate::{analysis::report::Collector, sinks::Sink};

#[derive(Debug)]
pub struct SummarySink {
    collector: Collector,
    json: Option<PathBuf>,
}

impl SummarySink {
    /// Keep at most `keep_tokens` token records for the per-token summary and
    /// the JSON; write the JSON to `json` when given.
    pub fn new(keep_tokens: usize, json: Option<PathBuf>) -> Self {
        SummarySink { collector: Collector::new(keep_tokens), json }
    }
}

impl Sink for SummarySink {
    fn event(&mut self, ev: &Event) -> anyhow::Result<()> {
        self.collector.push(ev);
        if !matches!(ev, Event::End(_)) {
            return Ok(());
        }
        let summary = self.collector.summary();
        summary.print(&mut std::io::stderr().lock())?;
        if let Some(path) = &self.json {
            let f =
                std::fs::File::create(path).with_context(|| format!("cannot create JSON file {}", path.display()))?;
            serde_json::to_writer_pretty(std::io::BufWriter::new(f), &summary)
                .with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(())
    }
}
