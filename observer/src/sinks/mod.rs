//! Sinks: consumers of the model stream (`observer_common::model::Event`).
//!
//! `observer run` feeds every sink the same events in order: one `Header`,
//! then `Token`s and `Process` samples as they happen, and one `End`. A sink
//! must never block the run loop (the recorder drops and counts instead), so
//! that a slow consumer never slows the observation or the engine.

use observer_common::model::Event;

pub mod prometheus;
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

/// Fan an event out to several sinks.
pub fn emit(sinks: &mut [Box<dyn Sink>], ev: &Event) -> anyhow::Result<()> {
    for s in sinks.iter_mut() {
        s.event(ev)?;
    }
    Ok(())
}
