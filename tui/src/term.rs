//! The terminal and the loop: owns `/dev/tty` (alternate screen, raw mode;
//! restored on exit, on error and on panic), pulls events from a [`Source`]
//! into the [`App`], redraws at most every `refresh` (and at once after a key),
//! and turns keys into effects.
//!
//! The terminal is `/dev/tty`, not stdout/stdin, so that a caller may point
//! its own stdio elsewhere (`observer tui` captures the target's output).

use std::{
    fs::File,
    io::{self, BufWriter, Write},
    sync::{
        Once,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use observer_common::model::Event;
use ratatui::{
    Terminal,
    backend::CrosstermBackend,
    crossterm::{
        cursor::{Hide, Show},
        event::{self, Event as TermEvent, KeyEventKind},
        execute,
        terminal::{EnterAlternateScreen, LeaveAlternateScreen, disable_raw_mode, enable_raw_mode},
    },
};

use crate::{
    input,
    state::{App, Control},
    view,
};

/// Default redraw rate: 2 Hz, like top-style monitors (htop 1.5 s, btop 2 s)
/// and enough to follow a decode live; each frame also costs the terminal
/// work, on a core the engine may need.
pub const DEFAULT_REFRESH: Duration = Duration::from_millis(500);
/// How often the rate interval is recomputed at most while tokens stream in.
pub const STATS_EVERY: Duration = Duration::from_secs(2);
/// Events moved from a source into the state per pump, so keys stay responsive.
pub const PUMP_MAX: usize = 20_000;

#[derive(Clone, Debug)]
pub struct Options {
    pub refresh: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Options { refresh: DEFAULT_REFRESH }
    }
}

/// Where events come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    /// More may come.
    Open,
    /// No more events, as expected (a replay reached its end, or a live run
    /// sent its `End`): keep showing the state.
    Done,
    /// The producer went away before its end (the run failed): leave.
    Failed,
    /// Leave now, as if the user had quit (e.g. the process got SIGTERM).
    Quit,
}

pub trait Source {
    /// Move available events into `app` without blocking (at most
    /// [`PUMP_MAX`]); say whether more may come. Called on every tick, also
    /// after it said `Done`.
    fn pump(&mut self, app: &mut App) -> Status;
}

/// A finite sequence of events (e.g. a test's).
pub struct IterSource<I>(pub std::iter::Fuse<I>);

impl<I: Iterator> IterSource<I> {
    pub fn new(events: I) -> Self {
        IterSource(events.fuse())
    }
}

impl<I: Iterator<Item = Event>> Source for IterSource<I> {
    fn pump(&mut self, app: &mut App) -> Status {
        for _ in 0..PUMP_MAX {
            match self.0.next() {
                Some(ev) => app.push(ev),
                None => {
                    app.set_source_done();
                    return Status::Done;
                }
            }
        }
        Status::Open
    }
}

/// Why the loop ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exit {
    /// The user quit.
    Quit,
    /// The source failed (see [`Status::Failed`]).
    SourceFailed,
}

type Term = Terminal<CrosstermBackend<BufWriter<File>>>;

/// The terminal in TUI mode; back to normal when dropped.
pub struct TerminalGuard {
    pub terminal: Term,
}

impl TerminalGuard {
    pub fn enter() -> io::Result<Self> {
        install_panic_hook();
        let tty = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/tty")
            .map_err(|e| io::Error::new(e.kind(), format!("cannot open the terminal /dev/tty: {e}")))?;
        enable_raw_mode()?;
        ACTIVE.store(true, Ordering::SeqCst);
        let mut out = BufWriter::new(tty);
        if let Err(e) = execute!(out, EnterAlternateScreen, Hide) {
            restore();
            return Err(e);
        }
        match Terminal::new(CrosstermBackend::new(out)) {
            Ok(terminal) => Ok(TerminalGuard { terminal }),
            Err(e) => {
                restore();
                Err(e)
            }
        }
    }
}

impl Drop for TerminalGuard {
    fn drop(&mut self) {
        let _ = self.terminal.backend_mut().flush();
        restore();
    }
}

/// The terminal is in TUI mode (set by [`TerminalGuard::enter`]).
static ACTIVE: AtomicBool = AtomicBool::new(false);

/// Leave the alternate screen, show the cursor, leave raw mode. Does nothing
/// the second time: leaving the alternate screen twice would also restore the
/// cursor saved on entering it, and what is printed next (a panic message)
/// would overwrite the lines before it. Safe to call from a panic hook.
pub fn restore() {
    if !ACTIVE.swap(false, Ordering::SeqCst) {
        return;
    }
    if let Ok(mut tty) = std::fs::OpenOptions::new().write(true).open("/dev/tty") {
        let _ = execute!(tty, LeaveAlternateScreen, Show);
    }
    let _ = disable_raw_mode();
}

/// A panic anywhere restores the terminal before the message is printed.
pub fn install_panic_hook() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            restore();
            prev(info);
        }));
    });
}

/// Run the TUI until the user quits or the source fails.
pub fn run(source: &mut dyn Source, app: &mut App, opts: &Options) -> io::Result<Exit> {
    let mut guard = TerminalGuard::enter()?;
    let term = &mut guard.terminal;
    let size = term.size()?;
    app.set_viewport(size.width, size.height);
    let mut next_draw = Instant::now();
    let mut next_stats = Instant::now();
    let mut done = false;
    loop {
        // Pumped also after `Done`: a source may still ask to quit.
        match source.pump(app) {
            Status::Open => {}
            Status::Done => done = true,
            Status::Failed => return Ok(Exit::SourceFailed),
            Status::Quit => return Ok(Exit::Quit),
        }
        let now = Instant::now();
        if now >= next_draw {
            if now >= next_stats || done {
                app.refresh_stats();
                // At most every STATS_EVERY, and never more than 0.1 % of the time.
                next_stats = now + STATS_EVERY.max(now.elapsed() * 1000);
            }
            if app.take_dirty() {
                term.draw(|f| view::draw(app, f))?;
            }
            next_draw = now + opts.refresh;
        }
        let wait = next_draw.saturating_duration_since(Instant::now());
        if event::poll(wait)? {
            match event::read()? {
                TermEvent::Key(k) if k.kind != KeyEventKind::Release => {
                    if let Some(e) = input::effect(k) {
                        if app.apply(e) == Control::Quit {
                            return Ok(Exit::Quit);
                        }
                        next_draw = Instant::now();
                    }
                }
                TermEvent::Resize(w, h) => {
                    app.set_viewport(w, h);
                    term.autoresize()?;
                    next_draw = Instant::now();
                }
                _ => {}
            }
        }
    }
}
