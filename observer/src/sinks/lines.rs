//! The per-token lines `observer run` prints to stderr while it runs (the
//! columns are `crate::analysis::attribution::line`'s): every `every`th
//! token, none when `every` is 0.
//!
//! They go through stderr's queue (`crate::stderr`): a reader of stderr that stalls costs printed
//! lines, counted and said, never the capture's events. The summary drains the queue before its
//! table.

use observer_common::model::Event;

use crate::{analysis::attribution, sinks::Sink, stderr};

#[derive(Debug)]
pub struct Lines {
    every: u64,
    header_done: bool,
}

impl Lines {
    pub fn new(every: u64) -> Self {
        Lines { every, header_done: false }
    }
}

impl Sink for Lines {
    fn event(&mut self, ev: &Event) -> anyhow::Result<()> {
        match ev {
            Event::Token(t) if self.every != 0 && t.seq.is_multiple_of(self.every) => {
                if !self.header_done {
                    stderr::token_line(attribution::header().to_string());
                    self.header_done = true;
                }
                stderr::token_line(attribution::line(t));
            }
            _ => {}
        }
        Ok(())
    }
}
