//! The recorder: a [`Sink`] that writes the trace format (see the module
//! above) on its own thread.
//!
//! Rule: the run loop never waits for the disk. Events go through a bounded
//! channel; a token or process event that finds it full is dropped and
//! counted ([`RecorderStats`]), and the count is written into the `end`
//! record. Only the once-per-run events wait (`header`, `totals`, `end`:
//! [`once_per_run`]): the header goes into an empty channel, and the others
//! come after the target has finished. The thread writes each burst of events and flushes when the
//! channel is empty, so a killed observer loses at most the burst in flight.

use std::{
    fs::File,
    io::{BufWriter, Write},
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
        mpsc::{Receiver, SyncSender, TrySendError, sync_channel},
    },
    thread::JoinHandle,
};

use anyhow::Context;
use observer_common::model::Event;
use serde::{Deserialize, Serialize};

use crate::sinks::{Sink, once_per_run};
use crate::store::trace::{TraceError, encode_record, file_header, grid, kind_of_payload};

/// Default channel capacity, in events.
pub const DEFAULT_CAPACITY: usize = 4096;

/// What the recorder did; written in the `end` record as `"recorder"`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecorderStats {
    /// Records written (header and end included).
    pub records_written: u64,
    /// Token events dropped because the channel to the writer was full.
    pub dropped_tokens: u64,
    /// Other events (process samples, histograms, health) dropped for the same reason.
    pub dropped_other: u64,
}

impl RecorderStats {
    pub fn dropped(&self) -> u64 {
        self.dropped_tokens + self.dropped_other
    }
}

/// The `end` record's payload: the event plus the recorder's counts.
#[derive(Serialize)]
struct EndPayload<'a> {
    #[serde(flatten)]
    event: &'a Event,
    recorder: RecorderStats,
}

/// A token record whose expert grid is packed (`grid`'s format).
#[derive(Serialize)]
struct TokenPayload<'a> {
    #[serde(flatten)]
    event: &'a Event,
    grid_packed: grid::Packed,
}

/// The JSON of an event: a token record's grid packed against the previous one.
fn payload(packer: &mut grid::Packer, mut ev: Event) -> serde_json::Result<Vec<u8>> {
    if let Event::Token(t) = &mut ev
        && let Some(g) = t.residency.as_mut().and_then(|r| r.grid.take())
    {
        let grid_packed = packer.pack(t.seq, &g);
        return serde_json::to_vec(&TokenPayload { event: &ev, grid_packed });
    }
    serde_json::to_vec(&ev)
}

#[derive(Debug, Default)]
struct Shared {
    dropped_tokens: AtomicU64,
    dropped_other: AtomicU64,
}

/// Records the model stream to a trace file. See the module doc.
#[derive(Debug)]
pub struct TraceWriter {
    name: String,
    tx: Option<SyncSender<Event>>,
    thread: Option<JoinHandle<std::io::Result<RecorderStats>>>,
    shared: Arc<Shared>,
    /// Set once the writer thread has failed (reported once, at the end).
    failed: bool,
    finished: Option<RecorderStats>,
}

impl TraceWriter {
    /// Create (or truncate) `path` and start the writer thread.
    pub fn create(path: &Path) -> Result<Self, TraceError> {
        let f = File::create(path).map_err(|source| TraceError::Io { path: path.to_path_buf(), source })?;
        Self::from_writer(BufWriter::with_capacity(1 << 16, f), path, DEFAULT_CAPACITY)
    }

    /// Write to any `Write` (tests use a slow one); `name` is used in messages.
    pub fn from_writer<W: Write + Send + 'static>(
        mut out: W,
        name: &Path,
        capacity: usize,
    ) -> Result<Self, TraceError> {
        let io = |source| TraceError::Io { path: PathBuf::from(name), source };
        out.write_all(&file_header()).map_err(io)?;
        out.flush().map_err(io)?;
        let (tx, rx) = sync_channel::<Event>(capacity.max(1));
        let shared = Arc::new(Shared::default());
        let sh = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("trace-writer".into())
            .spawn(move || write_loop(out, rx, &sh))
            .map_err(io)?;
        Ok(TraceWriter {
            name: name.display().to_string(),
            tx: Some(tx),
            thread: Some(thread),
            shared,
            failed: false,
            finished: None,
        })
    }

    /// Drops so far (tokens, other events).
    pub fn dropped(&self) -> (u64, u64) {
        (self.shared.dropped_tokens.load(Ordering::Relaxed), self.shared.dropped_other.load(Ordering::Relaxed))
    }

    /// Close the channel, wait for the writer, and return its counts. Called
    /// by the `end` event; also by `Drop` for a run that ends without one.
    pub fn finish(&mut self) -> anyhow::Result<RecorderStats> {
        if let Some(s) = self.finished {
            return Ok(s);
        }
        self.tx = None;
        let Some(t) = self.thread.take() else {
            anyhow::bail!("trace {}: writer already stopped", self.name);
        };
        let r = t.join().map_err(|_| anyhow::anyhow!("trace {}: the writer thread panicked", self.name))?;
        let s = r.with_context(|| format!("writing trace {}", self.name))?;
        self.finished = Some(s);
        Ok(s)
    }

    fn writer_failed(&mut self) {
        if !self.failed {
            self.failed = true;
            log::error!(
                "writing trace {} failed; further events are dropped (the error follows at the end)",
                self.name
            );
        }
    }
}

impl Sink for TraceWriter {
    fn event(&mut self, ev: &Event) -> anyhow::Result<()> {
        let Some(tx) = &self.tx else { return Ok(()) };
        match ev {
            ev if once_per_run(ev) => {
                // Waits: see the module doc. A closed channel means the
                // writer failed; `finish` returns its error.
                let _ = tx.send(ev.clone());
                if matches!(ev, Event::End(_)) {
                    let s = self.finish()?;
                    if s.dropped() > 0 {
                        log::warn!(
                            "trace {}: dropped {} token and {} other events (the disk did not keep up)",
                            self.name,
                            s.dropped_tokens,
                            s.dropped_other
                        );
                    }
                }
            }
            _ => match tx.try_send(ev.clone()) {
                Ok(()) => {}
                Err(TrySendError::Full(_)) => self.count_drop(ev),
                Err(TrySendError::Disconnected(_)) => {
                    self.count_drop(ev);
                    self.writer_failed();
                }
            },
        }
        Ok(())
    }
}

impl TraceWriter {
    fn count_drop(&self, ev: &Event) {
        let c = if matches!(ev, Event::Token(_)) { &self.shared.dropped_tokens } else { &self.shared.dropped_other };
        c.fetch_add(1, Ordering::Relaxed);
    }
}

impl Drop for TraceWriter {
    fn drop(&mut self) {
        if self.thread.is_some()
            && let Err(e) = self.finish()
        {
            log::error!("{e:#}");
        }
    }
}

fn write_loop<W: Write>(mut out: W, rx: Receiver<Event>, shared: &Shared) -> std::io::Result<RecorderStats> {
    let mut stats = RecorderStats::default();
    let mut packer = grid::Packer::default();
    while let Ok(first) = rx.recv() {
        let mut next = Some(first);
        while let Some(ev) = next {
            let end = matches!(ev, Event::End(_));
            let payload = if end {
                stats.records_written += 1; // counts itself
                stats.dropped_tokens = shared.dropped_tokens.load(Ordering::Relaxed);
                stats.dropped_other = shared.dropped_other.load(Ordering::Relaxed);
                serde_json::to_vec(&EndPayload { event: &ev, recorder: stats })
            } else {
                stats.records_written += 1;
                payload(&mut packer, ev)
            }
            .map_err(std::io::Error::other)?;
            out.write_all(&encode_record(kind_of_payload(&payload), &payload))?;
            if end {
                out.flush()?;
                return Ok(stats);
            }
            next = rx.try_recv().ok();
        }
        out.flush()?;
    }
    // The sink went away without an `end` (the run failed): keep what we have.
    stats.dropped_tokens = shared.dropped_tokens.load(Ordering::Relaxed);
    stats.dropped_other = shared.dropped_other.load(Ordering::Relaxed);
    out.flush()?;
    Ok(stats)
}
