//! `observer tui`: the live TUI beside a running target (`-- CMD…` or
//! `--pid PID`), or over a recorded trace (`--replay FILE`).
//!
//! Live, it runs exactly the session of `observer run` (`observe`)
//! with one more sink that forwards the model stream to the TUI thread:
//! - `Header` and `End` (once per run each) are sent blocking; the others
//!   (tokens, samples, histograms, health) are offered to a bounded queue and,
//!   when it is full, dropped and counted (`dropped N`, red, in the header). The run loop, and
//!   so the observed process, never waits for the screen.
//! - The TUI thread owns the terminal (`/dev/tty`: alternate screen, raw mode,
//!   restored on exit and on panic). While it is up, this process's stdin is
//!   `/dev/null` and its stdout/stderr go into a pipe that the spawned target
//!   inherits: those lines show under "Output (target, observer)" and are printed,
//!   with the run's end-of-run summary, once the terminal is back.
//! - `run`'s per-token lines are off (`--every 0`).
//! - Quitting (`q`) stops the observation like Ctrl-C does under `run`: a
//!   spawned target gets SIGINT (SIGKILL after a grace period), a `--pid`
//!   target is detached from. When the target exits on its own, the final
//!   summary stays on screen until the user quits. SIGINT/SIGTERM sent to
//!   the observer (the keyboard's Ctrl-C is a key in raw mode) stop the run
//!   as under `run` and close the screen (one handler for both: `Stop`).
//!
//! Replay (`--replay FILE`, a trace or a bmoe_metrics CSV) feeds the file's
//! events through the same `tui::App`.

use std::{
    io::Write,
    os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicI32, AtomicU64, Ordering},
        mpsc::{Receiver, SyncSender, TryRecvError, TrySendError, sync_channel},
    },
    time::{Duration, Instant},
};

use ::tui::{App, IterSource, Options, Source, Status, term, term::Exit};
use anyhow::{Context, Result, bail};
use observer::{
    capture::session::Stop,
    sinks::{Sink, once_per_run},
};
use observer_common::model::Event;

use super::run::{RunArgs, observe};

#[derive(Debug, clap::Args)]
// `run`'s per-token lines would draw over the screen: always off here.
#[command(mut_arg("every", |a| a.hide(true)))]
pub struct TuiArgs {
    /// Show a recorded trace instead of observing a process.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["pid", "command"])]
    replay: Option<PathBuf>,
    /// Screen redraws per second (at most; nothing is redrawn while nothing changes).
    #[arg(long, default_value_t = 1.0 / ::tui::term::DEFAULT_REFRESH.as_secs_f64(), value_name = "HZ", value_parser = parse_hz)]
    refresh: f64,
    /// Events that may wait for the screen before new ones are dropped (and counted).
    #[arg(long, default_value_t = 4096, value_name = "N", value_parser = clap::value_parser!(u32).range(16..))]
    queue: u32,
    #[command(flatten)]
    run: RunArgs,
}

fn parse_hz(s: &str) -> Result<f64, String> {
    let v: f64 = s.trim().parse().map_err(|_| format!("not a number: {s:?}"))?;
    if !(0.1..=60.0).contains(&v) {
        return Err(format!("refresh rate {v} Hz is outside 0.1..=60"));
    }
    Ok(v)
}

pub async fn tui(mut args: TuiArgs) -> Result<i32> {
    let opts = Options { refresh: Duration::from_secs_f64(1.0 / args.refresh) };
    if let Some(path) = &args.replay {
        return replay(path, &opts);
    }
    if args.run.pid.is_none() && args.run.command.is_empty() {
        bail!("nothing to observe: give `--pid PID`, `-- CMD [ARGS…]` or `--replay FILE`");
    }
    // Fail before touching stdio when there is no terminal to draw on.
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/tty")
        .context("observer tui needs a terminal (/dev/tty); use `observer run` without one")?;
    args.run.every = 0;

    // SIGINT/SIGTERM stop the run (the session) and close the screen (the
    // source below), also while the final summary is up.
    let stop = Stop::install()?;
    let capture = Capture::start()?;
    let (tx, rx) = sync_channel::<Event>(args.queue as usize);
    let dropped = Arc::new(AtomicU64::new(0));
    let ui = {
        let mut source = LiveSource {
            rx,
            dropped: dropped.clone(),
            lines: capture.lines.clone(),
            saw_end: false,
            stop: stop.clone(),
        };
        let stop = StopOnDrop(stop.clone());
        let mut note = capture.real_stderr();
        std::thread::Builder::new()
            .name("observer-tui".into())
            .spawn(move || {
                yield_to_the_target();
                // Leaving the screen, even by a panic, ends the observation
                // (a no-op once it has ended).
                let _stop = stop;
                let mut app = App::new();
                let r = term::run(&mut source, &mut app, &opts);
                if matches!(r, Ok(Exit::Quit))
                    && !app.ended()
                    && let Some(n) = &mut note
                {
                    let _ = writeln!(n, "observer tui: stopping the observation…");
                }
                r
            })
            .context("starting the TUI thread")?
    };
    let sink = ToScreen { tx, dropped, lines: capture.lines.clone() };
    // When the target exits on its own, the TUI keeps the final summary on
    // screen until the user quits; when the run fails, the TUI sees the queue
    // close without an `End` and leaves by itself.
    let run = observe(args.run, vec![Box::new(sink)], &stop).await;
    // Wait for the user without blocking the runtime (the signal task runs on it).
    while !ui.is_finished() {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let ui = ui.join();
    let captured = capture.finish();
    let mut err = std::io::stderr().lock();
    let _ = err.write_all(&captured);
    let _ = err.flush();
    drop(err);
    match ui {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => return Err(anyhow::Error::from(e).context("drawing on the terminal")),
        Err(_) => bail!("the TUI thread panicked (the terminal was restored; see the message above)"),
    }
    run
}

/// Closing the screen stops the session (a no-op once it has ended).
struct StopOnDrop(Stop);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        // A signal already stops the run; a second stop would SIGKILL the target.
        if !self.0.signalled() {
            self.0.request();
        }
    }
}

// ---- the stream to the screen ----------------------------------------------

/// The sink `run` feeds: forwards events to the TUI thread, never blocking on
/// tokens or samples (module doc).
struct ToScreen {
    tx: SyncSender<Event>,
    dropped: Arc<AtomicU64>,
    lines: Arc<Mutex<LiveLines>>,
}

impl Sink for ToScreen {
    fn event(&mut self, ev: &Event) -> Result<()> {
        match ev {
            // Once per run; the TUI thread drains the queue continuously.
            // An error means the screen is gone: nothing left to show.
            ev if once_per_run(ev) => {
                if matches!(ev, Event::End(_))
                    && let Ok(mut l) = self.lines.lock()
                {
                    // The target has exited and its output is complete (read,
                    // or still in the pipe): what follows is `run`'s end-of-run
                    // report, printed after the screen closes rather than
                    // pushing the target's last lines away.
                    l.close_at_pipe_end();
                }
                let _ = self.tx.send(ev.clone());
            }
            _ => match self.tx.try_send(ev.clone()) {
                Ok(()) | Err(TrySendError::Disconnected(_)) => {}
                Err(TrySendError::Full(_)) => {
                    self.dropped.fetch_add(1, Ordering::Relaxed);
                }
            },
        }
        Ok(())
    }
}

/// The TUI's end of the queue, plus the captured output lines.
struct LiveSource {
    rx: Receiver<Event>,
    dropped: Arc<AtomicU64>,
    lines: Arc<Mutex<LiveLines>>,
    saw_end: bool,
    stop: Stop,
}

impl Source for LiveSource {
    fn pump(&mut self, app: &mut App) -> Status {
        if self.stop.signalled() {
            return Status::Quit;
        }
        if let Ok(mut l) = self.lines.lock() {
            for line in l.lines.drain(..) {
                app.push_output(line);
            }
        }
        app.set_dropped(self.dropped.load(Ordering::Relaxed));
        for _ in 0..term::PUMP_MAX {
            match self.rx.try_recv() {
                Ok(ev) => {
                    self.saw_end |= matches!(ev, Event::End(_));
                    app.push(ev);
                }
                Err(TryRecvError::Empty) => return Status::Open,
                Err(TryRecvError::Disconnected) if self.saw_end => {
                    app.set_source_done();
                    return Status::Done;
                }
                Err(TryRecvError::Disconnected) => return Status::Failed,
            }
        }
        Status::Open
    }
}

// ---- replay -----------------------------------------------------------------

/// Show a recorded run: a trace (`observer record`) or a bmoe_metrics CSV,
/// read whole (`observer::store::import::load_events`), through the same `App` as a
/// live run. What the reader had to skip (truncation, damage) is listed under
/// "Output"; a trace without an end record says so in the header.
fn replay(path: &Path, opts: &Options) -> Result<i32> {
    // The import error names the file and the cause (its Display already
    // includes its source, so the chain is not printed again).
    let loaded = observer::store::import::load_events(path).map_err(|e| anyhow::anyhow!("--replay: {e}"))?;
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/tty")
        .context("observer tui needs a terminal (/dev/tty); use `observer report` without one")?;
    let mut app = App::new();
    app.push_output(format!("{}: {} ({} events)", path.display(), loaded.format, loaded.events.len()));
    for note in &loaded.notes {
        app.push_output(note.clone());
    }
    if let Some(r) = loaded.recorder {
        // What the recorder could not write is missing here too.
        app.set_dropped(r.dropped());
    }
    let mut source = IterSource::new(loaded.events.into_iter());
    term::run(&mut source, &mut app, opts).context("drawing on the terminal")?;
    Ok(0)
}

/// Make this thread yield to the target: the idle scheduling class
/// (`SCHED_IDLE`). The screen and the output reader must not take CPU from an
/// engine that keeps every core busy (its threads meet at a barrier per layer,
/// so one preempted thread stalls them all). A `SCHED_IDLE` thread never
/// preempts a normal one, is preempted as soon as one wakes, and otherwise
/// runs on time the target leaves free (on a saturated machine it still gets
/// a sliver, enough for a frame every few hundred ms: keys answered within
/// ~50 ms here with the engine on both cores). Per thread, so the spawned
/// target, forked from the main thread, keeps its own policy. Nice 10 too, for
/// kernels where the policy is refused.
fn yield_to_the_target() {
    // SAFETY: gettid, sched_setscheduler and setpriority on our own thread;
    // a failure leaves the policy or priority as it was.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::pid_t;
        let param = libc::sched_param { sched_priority: 0 };
        libc::sched_setscheduler(tid, libc::SCHED_IDLE, &param);
        let now = libc::getpriority(libc::PRIO_PROCESS, tid as libc::id_t);
        libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, (now + 10).min(19));
    }
}

// ---- stdio capture ----------------------------------------------------------

/// Output kept for printing after the TUI (the tail, when it is larger).
const CAPTURE_MAX: usize = 8 << 20;
/// Lines waiting for the TUI thread; more are not shown live (still printed after).
const LINES_MAX: usize = 1000;

/// Saved stdio of this process, for the panic hook (-1: nothing to restore).
static SAVED: [AtomicI32; 3] = [AtomicI32::new(-1), AtomicI32::new(-1), AtomicI32::new(-1)];

/// While alive: fd 0 is /dev/null, fds 1 and 2 write into a pipe read by a
/// thread (see the module doc).
struct Capture {
    saved: Option<[OwnedFd; 3]>,
    lines: Arc<Mutex<LiveLines>>,
    kept: Arc<Mutex<Kept>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

#[derive(Default)]
struct Kept {
    bytes: Vec<u8>,
    /// Bytes of earlier output not kept (beyond CAPTURE_MAX).
    cut: u64,
}

fn cvt(r: libc::c_int, what: &str) -> Result<libc::c_int> {
    if r < 0 { Err(std::io::Error::last_os_error()).with_context(|| what.to_string()) } else { Ok(r) }
}

fn restore_saved_fds() {
    for (i, s) in SAVED.iter().enumerate() {
        let fd = s.swap(-1, Ordering::SeqCst);
        if fd >= 0 {
            // SAFETY: `fd` is a descriptor we duplicated and still own; dup2 onto stdio.
            unsafe { libc::dup2(fd, i as RawFd) };
        }
    }
}

impl Capture {
    fn start() -> Result<Capture> {
        let mut fds = [0; 2];
        // SAFETY: fds is a valid 2-element array.
        cvt(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, "pipe2 for the output capture")?;
        // SAFETY: fresh descriptors from pipe2, owned from here on.
        let (rd, wr) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        let null = std::fs::File::open("/dev/null").context("opening /dev/null")?;
        let mut saved = Vec::with_capacity(3);
        for fd in 0..3 {
            // SAFETY: duplicating a standard descriptor; the copy is ours (CLOEXEC).
            let d = cvt(unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 3) }, "saving stdio")?;
            // SAFETY: fresh descriptor from fcntl.
            saved.push(unsafe { OwnedFd::from_raw_fd(d) });
        }
        let saved: [OwnedFd; 3] = saved.try_into().map_err(|_| anyhow::anyhow!("saving stdio"))?;
        for (i, s) in saved.iter().enumerate() {
            SAVED[i].store(s.as_raw_fd(), Ordering::SeqCst);
        }
        install_panic_hook();
        let _ = std::io::stderr().flush();
        let _ = std::io::stdout().flush();
        for (src, dst) in [(null.as_raw_fd(), 0), (wr.as_raw_fd(), 1), (wr.as_raw_fd(), 2)] {
            // SAFETY: both descriptors are open; dup2 leaves the new one inheritable,
            // so a spawned target writes into the pipe too.
            if let Err(e) = cvt(unsafe { libc::dup2(src, dst) }, "redirecting stdio") {
                restore_saved_fds();
                return Err(e);
            }
        }
        drop(wr);
        prepare_read_end(&rd);
        let lines = Arc::new(Mutex::new(LiveLines::new(rd.as_raw_fd())));
        let kept: Arc<Mutex<Kept>> = Arc::default();
        let reader = {
            let (lines, kept) = (lines.clone(), kept.clone());
            std::thread::Builder::new()
                .name("observer-tui-output".into())
                .spawn(move || {
                    yield_to_the_target();
                    read_output(std::fs::File::from(rd), &lines, &kept)
                })
                .context("starting the output reader")?
        };
        Ok(Capture { saved: Some(saved), lines, kept, reader: Some(reader) })
    }

    /// The real stderr, for notes printed after the screen is gone.
    fn real_stderr(&self) -> Option<std::fs::File> {
        let s = self.saved.as_ref()?;
        s[2].try_clone().ok().map(std::fs::File::from)
    }

    /// Put stdio back and return what was written meanwhile.
    fn finish(mut self) -> Vec<u8> {
        self.restore();
        // The reader sees end-of-file once every writer (also the target's
        // children, if any outlive it) has closed the pipe; do not wait long.
        let deadline = Instant::now() + Duration::from_secs(2);
        if let Some(r) = self.reader.take() {
            while !r.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            if r.is_finished() {
                let _ = r.join();
            }
        }
        let kept = std::mem::take(&mut *self.kept.lock().unwrap_or_else(|e| e.into_inner()));
        let mut out = Vec::new();
        if kept.cut > 0 {
            out.extend_from_slice(
                format!("observer tui: ({} earlier bytes of output not kept)\n", kept.cut).as_bytes(),
            );
        }
        out.extend_from_slice(&kept.bytes);
        out
    }

    fn restore(&mut self) {
        let _ = std::io::stdout().flush();
        let _ = std::io::stderr().flush();
        restore_saved_fds();
        self.saved = None;
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        if self.saved.is_some() {
            self.restore();
        }
    }
}

/// Captured lines on their way to the screen. Once `limit` is set, only the
/// first `limit` bytes of output are shown live (the rest is printed after).
struct LiveLines {
    lines: Vec<String>,
    /// Bytes read from the pipe so far (updated under the lock with each read).
    read: u64,
    limit: Option<u64>,
    /// The pipe's read end while the reader holds it open, else -1.
    fd: RawFd,
}

impl Default for LiveLines {
    fn default() -> Self {
        LiveLines { lines: Vec::new(), read: 0, limit: None, fd: -1 }
    }
}

impl LiveLines {
    fn new(fd: RawFd) -> Self {
        LiveLines { fd, ..Default::default() }
    }

    /// Show live what has been written so far, nothing after: the bytes read
    /// plus those still waiting in the pipe.
    fn close_at_pipe_end(&mut self) {
        let mut waiting: libc::c_int = 0;
        // SAFETY: `fd` is open while it is not -1 (the reader resets it, under
        // this lock, before closing); FIONREAD writes one int.
        if self.fd >= 0 && unsafe { libc::ioctl(self.fd, libc::FIONREAD, &mut waiting) } < 0 {
            waiting = 0;
        }
        self.limit = Some(self.read + waiting.max(0) as u64);
    }
}

/// The reader wakes at most this often (unless a read fills its buffer): a
/// target printing a line per token would otherwise wake it per token.
const READ_PACE: Duration = Duration::from_millis(100);
/// The capture pipe's size (best effort), so that a paced reader does not
/// make the target wait at a full pipe.
const PIPE_SIZE: libc::c_int = 1 << 20;

/// Paced reading (`read_output`): a larger pipe, read without blocking (the
/// flag is on the read end's open file only; the target's writes still block).
fn prepare_read_end(rd: &OwnedFd) {
    // SAFETY: fcntl on our own pipe descriptor; failures leave the defaults.
    unsafe {
        libc::fcntl(rd.as_raw_fd(), libc::F_SETPIPE_SZ, PIPE_SIZE);
        libc::fcntl(rd.as_raw_fd(), libc::F_SETFL, libc::O_NONBLOCK);
    }
}

/// Read the capture pipe (non-blocking descriptor) until every writer has
/// closed it: everything into `kept`, whole lines into `lines` (module doc).
fn read_output(rd: std::fs::File, lines: &Mutex<LiveLines>, kept: &Mutex<Kept>) {
    let mut buf = vec![0u8; 256 << 10];
    let mut partial: Vec<u8> = Vec::new();
    // Offset in the output of `partial`'s first byte.
    let mut partial_at = 0u64;
    loop {
        let r = {
            let Ok(mut l) = lines.lock() else { break };
            // SAFETY: reading into our buffer from our descriptor.
            let n = unsafe { libc::read(rd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if n > 0 {
                l.read += n as u64;
            }
            n
        };
        let n = match r {
            0 => break,
            n if n > 0 => n as usize,
            _ => match std::io::Error::last_os_error().kind() {
                std::io::ErrorKind::Interrupted => continue,
                std::io::ErrorKind::WouldBlock => {
                    let mut pfd = libc::pollfd { fd: rd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
                    // SAFETY: one valid pollfd; waits for data or the writers' close.
                    unsafe { libc::poll(&mut pfd, 1, -1) };
                    continue;
                }
                _ => break,
            },
        };
        let chunk = &buf[..n];
        if let Ok(mut k) = kept.lock() {
            k.bytes.extend_from_slice(chunk);
            if k.bytes.len() > CAPTURE_MAX {
                let cut = k.bytes.len() - CAPTURE_MAX / 2;
                k.bytes.drain(..cut);
                k.cut += cut as u64;
            }
        }
        partial.extend_from_slice(chunk);
        // Whole lines, each with the output offset just past it.
        let mut new_lines = Vec::new();
        while let Some(i) = partial.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = partial.drain(..=i).collect();
            partial_at += line.len() as u64;
            new_lines.push((
                String::from_utf8_lossy(&line[..line.len() - 1]).trim_end_matches('\r').to_string(),
                partial_at,
            ));
        }
        if partial.len() > 4096 {
            partial_at += partial.len() as u64;
            new_lines.push((String::from_utf8_lossy(&partial).into_owned(), partial_at));
            partial.clear();
        }
        if let Ok(mut l) = lines.lock() {
            let limit = l.limit.unwrap_or(u64::MAX);
            for (line, end) in new_lines {
                if end <= limit && l.lines.len() < LINES_MAX {
                    l.lines.push(line);
                }
            }
        }
        if n < buf.len() {
            std::thread::sleep(READ_PACE);
        }
    }
    if let Ok(mut l) = lines.lock() {
        l.fd = -1;
    }
}

/// A panic puts stdio back (after the TUI's hook restored the terminal), so
/// its message reaches the user.
fn install_panic_hook() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            restore_saved_fds();
            prev(info);
        }));
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use observer_common::model::RunEnd;

    #[test]
    fn the_sink_never_blocks_on_tokens_and_counts_what_it_drops() {
        let (tx, rx) = sync_channel(16);
        let dropped = Arc::new(AtomicU64::new(0));
        let mut sink = ToScreen { tx, dropped: dropped.clone(), lines: Arc::default() };
        let sample = Event::Process(Default::default());
        for _ in 0..100 {
            sink.event(&sample).unwrap();
        }
        assert_eq!(dropped.load(Ordering::Relaxed), 84);
        let mut src = LiveSource { rx, dropped, lines: Arc::default(), saw_end: false, stop: Stop::default() };
        let mut app = App::new();
        assert_eq!(src.pump(&mut app), Status::Open);
        assert_eq!(app.dropped_total(), 84);
        // End is delivered even to a full queue once it drains; then the
        // closed channel reads as a finished run.
        sink.event(&Event::End(RunEnd::default())).unwrap();
        drop(sink);
        assert_eq!(src.pump(&mut app), Status::Done);
        assert!(app.ended());
    }

    #[test]
    fn output_shown_live_ends_with_what_the_target_wrote_before_the_end() {
        let mut fds = [0; 2];
        // SAFETY: a fresh pipe, owned below.
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
        // SAFETY: fresh descriptors from pipe2.
        let (rd, wr) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        prepare_read_end(&rd);
        let mut wr = std::fs::File::from(wr);
        let lines = Arc::new(Mutex::new(LiveLines::new(rd.as_raw_fd())));
        let kept: Arc<Mutex<Kept>> = Arc::default();
        let reader = {
            let (lines, kept) = (lines.clone(), kept.clone());
            std::thread::spawn(move || read_output(std::fs::File::from(rd), &lines, &kept))
        };
        wr.write_all(b"first\n").unwrap();
        // The paced reader takes this line in within a pace or two.
        let t0 = Instant::now();
        while lines.lock().unwrap().lines.is_empty() {
            assert!(t0.elapsed() < Duration::from_secs(5), "the reader did not take in the first line");
            std::thread::sleep(Duration::from_millis(5));
        }
        // The target's last lines are still in the pipe (the reader sleeps)
        // when the run's end arrives; then the observer's report follows.
        wr.write_all(b"last words\nno newline").unwrap();
        lines.lock().unwrap().close_at_pipe_end();
        wr.write_all(b"\nend-of-run report\n").unwrap();
        drop(wr);
        reader.join().unwrap();
        let l = lines.lock().unwrap();
        assert_eq!(l.lines, ["first", "last words"], "shown live");
        assert_eq!(l.fd, -1, "the reader let go of the descriptor");
        assert_eq!(kept.lock().unwrap().bytes, b"first\nlast words\nno newline\nend-of-run report\n", "printed after");
    }

    #[test]
    fn a_run_that_fails_before_its_end_closes_the_screen() {
        let (tx, rx) = sync_channel::<Event>(4);
        drop(tx);
        let mut src =
            LiveSource { rx, dropped: Arc::default(), lines: Arc::default(), saw_end: false, stop: Stop::default() };
        assert_eq!(src.pump(&mut App::new()), Status::Failed);
    }
}
