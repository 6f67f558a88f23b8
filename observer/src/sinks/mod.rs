//! Sinks: consumers of the model stream (`observer_common::model::Event`).
//!
//! A session (`crate::capture::session`) feeds every sink the same events in
//! order: one `Header`, then `Token`s, samples and `Marks` (what marks the
//! tokens changed) as they happen, one `Totals`
//! (eBPF only) and one `End`. A sink
//! must never block the run loop (the recorder drops and counts instead), so
//! that a slow consumer never slows the observation or the engine.

use observer_common::model::Event;

pub mod lines;
pub mod prometheus;
pub mod summary;
pub mod trace_writer;

pub trait Sink {
    /// Consume one event. An error stops the run with that error (for fatal
    /// problems like an unwritable output file), so sinks that can degrade
    /// should count and carry on instead.
    fn event(&mut self, ev: &Event) -> anyhow::Result<()>;
}

/// Keeps every token record (for the JSON summary and the end-of-run report).
#[derive(Debug, Default)]
pub struct Collect {
    pub events: Vec<Event>,
}

impl Sink for Collect {
    fn event(&mut self, ev: &Event) -> anyhow::Result<()> {
        self.events.push(ev.clone());
        Ok(())
    }
}

/// The events a sink that drops under load must still deliver: the
/// once-per-run ones (`Header`, `Totals`, `End`), which come while the run
/// starts or after the target has finished, and `Marks` (at most one per
/// process, while its exec is held), so waiting for them slows nothing.
pub fn once_per_run(ev: &Event) -> bool {
    matches!(ev, Event::Header(_) | Event::Marks(_) | Event::Totals(_) | Event::End(_))
}

/// Fan an event out to several sinks.
pub fn emit(sinks: &mut [Box<dyn Sink>], ev: &Event) -> anyhow::Result<()> {
    for s in sinks.iter_mut() {
        s.event(ev)?;
    }
    Ok(())
}
