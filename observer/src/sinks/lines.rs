//! The per-token lines `observer run` prints to stderr while it runs (the
//! columns are `crate::analysis::attribution::line`'s): every `every`th
//! token, none when `every` is 0.
//!
//! A thread of their own writes them, through a queue of [`QUEUE_LINES`] lines: a reader of
//! stderr that stalls (a paused pager, a pipe nobody reads) must not stop the capture, whose
//! kernel ring buffer would fill behind it and lose events. A line that finds the queue full is
//! skipped and counted, and the count is said on stderr when the writer catches up; the JSON
//! and the trace keep every token. At the end of the run the queue is written out before
//! anything else is printed (that wait is the only one a stalled reader can cause).

use std::{
    io::Write,
    sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel},
    thread::JoinHandle,
};

use observer_common::model::Event;

use crate::{analysis::attribution, sinks::Sink};

/// Lines the queue to the writer holds.
pub const QUEUE_LINES: usize = 1024;

#[derive(Debug)]
pub struct Lines {
    every: u64,
    header_done: bool,
    writer: Option<Writer>,
    /// No writer thread could be started: lines are written in line with the capture.
    inline: bool,
}

/// The queue to the thread that writes to stderr.
#[derive(Debug)]
struct Writer {
    tx: SyncSender<String>,
    thread: JoinHandle<()>,
    /// Lines skipped since the last one queued.
    skipped: u64,
}

impl Writer {
    fn start() -> std::io::Result<Writer> {
        let (tx, rx) = sync_channel(QUEUE_LINES);
        let thread = std::thread::Builder::new().name("observer-lines".into()).spawn(move || write_all(rx))?;
        Ok(Writer { tx, thread, skipped: 0 })
    }

    /// Queue `line`, or count it as skipped when the queue is full.
    fn send(&mut self, line: String) {
        if self.skipped > 0 {
            let note = skipped_note(self.skipped);
            if self.tx.try_send(note).is_err() {
                self.skipped += 1;
                return;
            }
            self.skipped = 0;
        }
        match self.tx.try_send(line) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => self.skipped += 1,
            // The writer is gone (stderr closed): nothing can be printed any more.
            Err(TrySendError::Disconnected(_)) => {}
        }
    }

    /// Write out what is queued (and the count of what was skipped), then stop the thread.
    fn finish(self) {
        if self.skipped > 0 {
            let _ = self.tx.send(skipped_note(self.skipped));
        }
        drop(self.tx);
        let _ = self.thread.join();
    }
}

/// What is said of `n` skipped lines.
fn skipped_note(n: u64) -> String {
    format!(
        "observer: {n} token lines not printed: stderr was not read fast enough (the JSON and the trace keep every token)"
    )
}

/// The writer thread: each line to stderr, until the queue is closed or stderr fails.
fn write_all(rx: Receiver<String>) {
    for line in rx {
        if writeln!(std::io::stderr().lock(), "{line}").is_err() {
            return;
        }
    }
}

impl Lines {
    pub fn new(every: u64) -> Self {
        Lines { every, header_done: false, writer: None, inline: false }
    }

    fn send(&mut self, line: String) {
        if self.writer.is_none() && !self.inline {
            match Writer::start() {
                Ok(w) => self.writer = Some(w),
                Err(e) => {
                    log::warn!("no thread for the per-token lines ({e}): they are printed in line with the capture");
                    self.inline = true;
                }
            }
        }
        match self.writer.as_mut() {
            Some(w) => w.send(line),
            None => {
                let _ = writeln!(std::io::stderr().lock(), "{line}");
            }
        }
    }
}

impl Sink for Lines {
    fn event(&mut self, ev: &Event) -> anyhow::Result<()> {
        match ev {
            Event::Token(t) if self.every != 0 && t.seq.is_multiple_of(self.every) => {
                if !self.header_done {
                    self.send(attribution::header().to_string());
                    self.header_done = true;
                }
                self.send(attribution::line(t));
            }
            Event::End(_) => {
                if let Some(w) = self.writer.take() {
                    w.finish();
                }
            }
            _ => {}
        }
        Ok(())
    }
}

impl Drop for Lines {
    fn drop(&mut self) {
        if let Some(w) = self.writer.take() {
            w.finish();
        }
    }
}
