//! Stderr that never stops a capture.
//!
//! Spec:
//! - While a capture runs (a [`Queued`] guard is held), every line the observer writes to stderr,
//!   its diagnostics (through `log`, [`diagnostic`]) and its per-token lines ([`token_line`]), goes
//!   through one queue of [`QUEUE_LINES`] lines to a thread of its own, in the order written. A
//!   reader of stderr that stalls (a paused pager, a pipe nobody reads, a slow journal) then stops
//!   only that thread: the capture goes on draining the kernel's ring buffer, which would otherwise
//!   fill behind it and lose events.
//! - A token line that finds the queue three quarters full is skipped; a diagnostic only when the
//!   queue is full (the last quarter is theirs). Each kind's skipped lines are counted, and the
//!   counts are said on stderr when the writer has caught up (its queue empty): "observer: N token
//!   lines not printed: …", "observer: N diagnostics not printed: …". The JSON and the trace keep
//!   every token.
//! - At the end of a capture ([`drain`]: before its summary is printed) the queue is written out,
//!   counts included; when the last guard is dropped, stderr is written directly again. That wait
//!   is the only one a stalled reader can cause. Captures at once (a daemon's) share the queue.
//! - Outside a capture, or where the thread could not be started, lines are written directly.
//!   Once a write to stderr has failed (stderr closed), the thread ends and later lines are
//!   dropped: nothing could print them.

use std::{
    collections::VecDeque,
    io::Write,
    sync::{Condvar, Mutex, MutexGuard},
};

/// Lines the queue holds.
pub const QUEUE_LINES: usize = 1024;
/// Token lines are skipped from this many queued lines on (the rest is kept for diagnostics).
const TOKEN_LINES: usize = QUEUE_LINES * 3 / 4;

/// What a line is (module spec): which limit it meets, which count a skip goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Token,
    Diagnostic,
}

#[derive(Debug)]
struct State {
    /// Lines go through the queue (a [`Queued`] guard is held and the writer runs).
    queued: bool,
    writer: Writer,
    lines: VecDeque<String>,
    /// The writer holds a line it has taken from the queue.
    writing: bool,
    skipped_tokens: u64,
    skipped_diagnostics: u64,
    /// [`Queued`] guards held (nested captures share the queue).
    guards: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Writer {
    NotStarted,
    Running,
    /// It could not be started, or stderr failed: lines are written directly, or dropped.
    Gone {
        stderr_failed: bool,
    },
}

static STATE: Mutex<State> = Mutex::new(State {
    queued: false,
    writer: Writer::NotStarted,
    lines: VecDeque::new(),
    writing: false,
    skipped_tokens: 0,
    skipped_diagnostics: 0,
    guards: 0,
});
/// Signalled when a line is queued, and when the writer has written one.
static CHANGED: Condvar = Condvar::new();

fn state() -> MutexGuard<'static, State> {
    // A panic while the lock was held leaves plain data: go on with it.
    STATE.lock().unwrap_or_else(|p| p.into_inner())
}

/// What is said of `n` skipped lines of one kind.
fn skipped_note(n: u64, what: &str, kept: &str) -> String {
    format!("observer: {n} {what} not printed: stderr was not read fast enough{kept}")
}

/// While held, stderr's lines go through the queue (module spec).
#[derive(Debug)]
#[must_use = "lines are queued only while the guard is held"]
pub struct Queued(());

impl Queued {
    /// Queue stderr's lines from now on; starts the writer thread the first time.
    pub fn begin() -> Queued {
        let mut s = state();
        s.guards += 1;
        if s.writer == Writer::NotStarted {
            match std::thread::Builder::new().name("observer-stderr".into()).spawn(write_queued) {
                Ok(_) => s.writer = Writer::Running,
                Err(e) => {
                    s.writer = Writer::Gone { stderr_failed: false };
                    drop(s);
                    log::warn!("no thread for stderr ({e}): its lines are written in line with the capture");
                    return Queued(());
                }
            }
        }
        s.queued = s.writer == Writer::Running;
        Queued(())
    }
}

impl Drop for Queued {
    fn drop(&mut self) {
        let mut s = drained();
        s.guards = s.guards.saturating_sub(1);
        if s.guards == 0 {
            s.queued = false;
        }
    }
}

/// Wait until what is queued is written (and the counts of what was skipped): a capture's end,
/// before its summary (module spec). Returns at once when nothing is queued.
pub fn drain() {
    drop(drained());
}

/// [`drain`], returning the state still locked.
fn drained() -> MutexGuard<'static, State> {
    let mut s = state();
    while s.writer == Writer::Running && (!s.lines.is_empty() || s.writing || has_counts(&s)) {
        s = CHANGED.wait(s).unwrap_or_else(|p| p.into_inner());
    }
    s
}

fn has_counts(s: &State) -> bool {
    s.skipped_tokens > 0 || s.skipped_diagnostics > 0
}

/// A per-token line (module spec).
pub fn token_line(line: String) {
    write(line, Kind::Token);
}

/// A diagnostic line: what the `log` records are written through (module spec).
pub fn diagnostic(line: String) {
    write(line, Kind::Diagnostic);
}

fn write(line: String, kind: Kind) {
    let mut s = state();
    if !s.queued {
        let dropped = s.writer == Writer::Gone { stderr_failed: true };
        drop(s);
        if !dropped {
            let _ = writeln!(std::io::stderr().lock(), "{line}");
        }
        return;
    }
    let limit = match kind {
        Kind::Token => TOKEN_LINES,
        Kind::Diagnostic => QUEUE_LINES,
    };
    if s.lines.len() >= limit {
        match kind {
            Kind::Token => s.skipped_tokens += 1,
            Kind::Diagnostic => s.skipped_diagnostics += 1,
        }
        return;
    }
    s.lines.push_back(line);
    CHANGED.notify_all();
}

/// The writer thread: each queued line to stderr, and the counts when the queue is empty, until
/// stderr fails.
fn write_queued() {
    let mut s = state();
    loop {
        let batch: Vec<String> = match s.lines.pop_front() {
            Some(line) => vec![line],
            None if has_counts(&s) => notes(&mut s),
            None => {
                s = CHANGED.wait(s).unwrap_or_else(|p| p.into_inner());
                continue;
            }
        };
        s.writing = true;
        drop(s);
        let mut err = std::io::stderr().lock();
        let ok = batch.iter().all(|line| writeln!(err, "{line}").is_ok());
        drop(err);
        s = state();
        s.writing = false;
        if !ok {
            s.writer = Writer::Gone { stderr_failed: true };
            s.queued = false;
            s.lines.clear();
            s.skipped_tokens = 0;
            s.skipped_diagnostics = 0;
            CHANGED.notify_all();
            return;
        }
        CHANGED.notify_all();
    }
}

/// The counts' notes; the counts are then zero.
fn notes(s: &mut State) -> Vec<String> {
    let mut notes = Vec::new();
    let tokens = std::mem::take(&mut s.skipped_tokens);
    if tokens > 0 {
        notes.push(skipped_note(tokens, "token lines", " (the JSON and the trace keep every token)"));
    }
    let diagnostics = std::mem::take(&mut s.skipped_diagnostics);
    if diagnostics > 0 {
        notes.push(skipped_note(diagnostics, "diagnostics", ""));
    }
    notes
}

/// `log`'s target (`env_logger::Target::Pipe`): each record, written and flushed whole, is one
/// [`diagnostic`].
#[derive(Debug, Default)]
pub struct LogPipe(Vec<u8>);

impl Write for LogPipe {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if !self.0.is_empty() {
            let text = String::from_utf8_lossy(&self.0);
            diagnostic(text.strip_suffix('\n').unwrap_or(&text).to_string());
            self.0.clear();
        }
        Ok(())
    }
}
