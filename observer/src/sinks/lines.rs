//! The per-token lines `observer run` prints to stderr while it runs (the
//! columns are `crate::analysis::attribution::line`'s): every `every`th
//! token, none when `every` is 0.

use std::io::Write;

use observer_common::model::Event;

use crate::{analysis::attribution, sinks::Sink};

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
        let Event::Token(t) = ev else { return Ok(()) };
        if self.every == 0 || !t.seq.is_multiple_of(self.every) {
            return Ok(());
        }
        let mut err = std::io::stderr().lock();
        if !self.header_done {
            let _ = writeln!(err, "{}", attribution::header());
            self.header_done = true;
        }
        let _ = writeln!(err, "{}", attribution::line(t));
        Ok(())
    }
}
