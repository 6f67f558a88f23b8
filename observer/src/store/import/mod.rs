//! Loading a run from a file, whatever its format, as the model stream:
//! observer traces (`crate::store::trace`) and `bmoe_metrics v1` CSV files
//! ([`bmoe`]). `report`, `diff` and `export` all start here, so an imported
//! run goes through the same code as a recorded one.
//!
//! A file is one run. Duplicated data is not merged quietly ([`one_run`]):
//! a second run header (files joined with `cat`) ends the run, and a token
//! record that repeats an earlier one (the same `seq` in a trace, the same
//! `step` in a CSV: rows repeated) is left out; each is said in a note.

pub mod bmoe;

use std::{
    io::Read,
    path::{Path, PathBuf},
};

use observer_common::model::{Event, ProcessSample, RunEnd, RunHeader, StepKind, TokenRecord};

use crate::store::trace::{self, RecorderStats};

#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
    #[error(transparent)]
    Trace(#[from] trace::TraceError),
    #[error("{}:{line}: {msg}", path.display())]
    Bmoe { path: PathBuf, line: usize, msg: String },
    #[error(
        "{} is neither an observer trace (starts with \"MOETRACE\") nor a bmoe_metrics CSV (starts with \"# bmoe_metrics v1\")",
        path.display()
    )]
    Unknown { path: PathBuf },
    #[error("{} has no token records: nothing to summarise", path.display())]
    NoTokens { path: PathBuf },
}

/// Where a run came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Format {
    Trace,
    BmoeMetrics,
}

impl std::fmt::Display for Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Format::Trace => "trace",
            Format::BmoeMetrics => "bmoe_metrics v1",
        })
    }
}

/// One run, read completely.
#[derive(Debug, Clone)]
pub struct LoadedRun {
    pub path: PathBuf,
    pub format: Format,
    /// The run's header; a default one (and a note) when the trace lost it.
    pub header: RunHeader,
    pub tokens: Vec<TokenRecord>,
    pub process: Vec<ProcessSample>,
    pub end: Option<RunEnd>,
    /// Other events (histograms, health, …), in order.
    pub other: Vec<Event>,
    /// The recorder's counts (traces with an end record only).
    pub recorder: Option<RecorderStats>,
    /// Problems met while reading (truncation, corruption, skipped rows).
    pub notes: Vec<String>,
}

impl LoadedRun {
    /// The records a per-token summary is about: generated tokens, or every
    /// record except prompt steps when none is marked as generated (calls,
    /// windows). The same rule as `attribution::summarise`.
    pub fn summarised(&self) -> Vec<&TokenRecord> {
        let gen_: Vec<&TokenRecord> = self.tokens.iter().filter(|t| t.kind == StepKind::Generate).collect();
        if gen_.is_empty() { self.tokens.iter().filter(|t| t.kind != StepKind::Prompt).collect() } else { gen_ }
    }

    /// Events lost anywhere: the kernel side (end record, else the sum over
    /// tokens) plus the recorder's drops.
    pub fn lost_events(&self) -> u64 {
        let kernel = match &self.end {
            Some(e) => e.lost_events,
            None => self.tokens.iter().map(|t| t.lost_events).sum(),
        };
        kernel + self.recorder.map(|r| r.dropped()).unwrap_or(0)
    }

    /// Build from a stream of events (any source).
    pub fn from_events(path: &Path, format: Format, events: impl IntoIterator<Item = Event>) -> Self {
        let mut run = LoadedRun {
            path: path.to_path_buf(),
            format,
            header: RunHeader::default(),
            tokens: Vec::new(),
            process: Vec::new(),
            end: None,
            other: Vec::new(),
            recorder: None,
            notes: Vec::new(),
        };
        let mut have_header = false;
        for ev in events {
            match ev {
                Event::Header(h) if !have_header => {
                    run.header = h;
                    have_header = true;
                }
                Event::Header(_) => run.notes.push("a second header record was ignored".into()),
                Event::Marks(m) => {
                    run.header.apply(&m);
                    run.other.push(Event::Marks(m));
                }
                Event::Token(t) => run.tokens.push(t),
                Event::Process(p) => run.process.push(p),
                Event::End(e) => run.end = Some(e),
                other => run.other.push(other),
            }
        }
        if !have_header {
            run.notes.push("the header record is missing: host, boot and configuration are unknown".into());
        }
        run
    }
}

/// A file's events in stream order, whatever its format: what a replay
/// consumes (`observer tui --replay FILE` can take a CSV too).
#[derive(Debug, Clone)]
pub struct Events {
    pub format: Format,
    pub events: Vec<Event>,
    /// Problems met while reading (truncation, corruption, skipped rows).
    pub notes: Vec<String>,
    /// The recorder's counts (traces with an end record only).
    pub recorder: Option<RecorderStats>,
}

/// Read a trace or a bmoe_metrics CSV into its event stream.
pub fn load_events(path: &Path) -> Result<Events, ImportError> {
    let io = |source| ImportError::Io { path: path.to_path_buf(), source };
    let mut head = [0u8; 16];
    let n = {
        let mut f = engine::files::open_regular(path).map_err(io)?;
        let mut n = 0;
        while n < head.len() {
            let k = f.read(&mut head[n..]).map_err(io)?;
            if k == 0 {
                break;
            }
            n += k;
        }
        n
    };
    let head = &head[..n];
    if n > 0 && trace::FILE_MAGIC.starts_with(&head[..n.min(8)]) {
        let mut r = trace::Reader::open(path)?;
        let events: Vec<Event> = r.by_ref().collect();
        let mut notes: Vec<String> = r.issues().iter().map(|i| format!("{}: {i}", path.display())).collect();
        if !r.complete() {
            notes.push(format!(
                "{}: no end record: the recording was cut short (observer killed?); events it dropped are unknown",
                path.display()
            ));
        }
        let events = one_run(path, events, &mut notes, |t| Some(t.seq));
        return Ok(Events { format: Format::Trace, events, notes, recorder: r.recorder() });
    }
    if bmoe::sniff(head) {
        let text = std::fs::read_to_string(path).map_err(io)?;
        let (events, mut notes) = bmoe::parse(path, &text)?;
        let events = one_run(path, events, &mut notes, |t| t.index);
        return Ok(Events { format: Format::BmoeMetrics, events, notes, recorder: None });
    }
    Err(ImportError::Unknown { path: path.to_path_buf() })
}

/// The first run of `events`, without token records whose `key` repeats
/// (module doc); what was left out is added to `notes`.
pub fn one_run(
    path: &Path,
    mut events: Vec<Event>,
    notes: &mut Vec<String>,
    key: impl Fn(&TokenRecord) -> Option<u64>,
) -> Vec<Event> {
    let headers: Vec<usize> =
        events.iter().enumerate().filter(|(_, e)| matches!(e, Event::Header(_))).map(|(i, _)| i).collect();
    if let Some(&second) = headers.get(1) {
        notes.push(format!(
            "{}: holds {} runs one after another (files joined?); only the first is read: split the file to read \
             the others",
            path.display(),
            headers.len()
        ));
        events.truncate(second);
    }
    let mut seen = std::collections::HashSet::new();
    let before = events.len();
    events.retain(|e| !matches!(e, Event::Token(t) if key(t).is_some_and(|k| !seen.insert(k))));
    let repeated = before - events.len();
    if repeated > 0 {
        notes.push(format!(
            "{}: {repeated} token records repeat an earlier record (duplicated rows?); they are left out",
            path.display()
        ));
    }
    events
}

/// Read a trace or a bmoe_metrics CSV as one run; an error when it has no
/// token records.
pub fn load(path: &Path) -> Result<LoadedRun, ImportError> {
    let e = load_events(path)?;
    let mut run = LoadedRun::from_events(path, e.format, e.events);
    run.recorder = e.recorder;
    run.notes.extend(e.notes);
    if run.tokens.is_empty() {
        return Err(ImportError::NoTokens { path: path.to_path_buf() });
    }
    Ok(run)
}
