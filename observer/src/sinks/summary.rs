//! The end-of-run summary as a sink: it keeps what the summary needs as the
//! events pass (`crate::analysis::report::Collector`) and, at the `End`,
//! prints the table to stderr and writes it as JSON when asked. The same
//! table comes from `observer report` on the run's trace, since both are
//! built from the model stream alone.

use observer_common::model::Event;

use crate::{analysis::report::Collector, output::Output, sinks::Sink};

#[derive(Debug)]
pub struct SummarySink {
    collector: Collector,
    json: Option<Output>,
}

impl SummarySink {
    /// Keep at most `keep_tokens` token records for the per-token summary and
    /// the JSON; write the JSON to `json` when given (created, and so
    /// checked, before the run: see [`crate::output`]).
    pub fn new(keep_tokens: usize, json: Option<Output>) -> Self {
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
        // The lines queued during the capture come before the table.
        crate::stderr::drain();
        summary.print(&mut std::io::stderr().lock())?;
        if let Some(out) = self.json.take() {
            let mut bytes = serde_json::to_vec_pretty(&summary)?;
            bytes.push(b'\n');
            out.write_all_and_commit(&bytes)?;
        }
        Ok(())
    }
}
