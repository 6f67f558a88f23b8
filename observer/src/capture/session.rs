//! One observation session: the target (spawned or attached), the probes (or
//! the procfs fallback), and the loop that turns what they see into the model
//! stream for the sinks. `observer run`, `record`, `tui` and `serve` are thin
//! callers: they build [`SessionOptions`] from their arguments, pick their
//! sinks, and call [`Session::start`] then [`Session::run`].
//!
//! ## What a session emits, in order
//! 1. one `Header`;
//! 2. `Token`s as they complete (engine markers, `--token-symbol` calls, or
//!    fixed windows), each batch's last one with a residency sample when the
//!    model file is known (named by the options or the command line, else the
//!    first GGUF file the target maps: looked for at every sample until one
//!    appears, so a target that maps its model late is sampled from then on); every `sample_interval` a `Process` sample and, with
//!    eBPF, `Histograms` and `Health`;
//! 3. at the end: the tokens still in the kernel's ring buffer, a last
//!    `Histograms` and `Health`, one `Totals` (per-thread and per-device totals,
//!    eBPF only: `observer_common::totals`), and one `End`.
//!
//! The end-of-run summary is a sink over this stream
//! (`crate::sinks::summary`), so `observer report` on the recorded trace
//! builds the same table.
//!
//! ## Stopping
//! SIGINT and SIGTERM are handled once per process, by [`Stop`]: the session,
//! `serve`'s target loop and the TUI all listen to the same handle. A stop
//! request (a signal, or [`Stop::request`], the TUI's quit) sends a spawned
//! target SIGINT and gives it [`CHILD_GRACE`] to exit; a second request, or
//! the end of the grace period, kills it. An attached process is left alone
//! and the session ends at once.
//!
//! ## The processes followed, and the markers of a program started later
//! A session follows one target: all its threads, its `exec`s, and (spawned,
//! or `--children`) the processes it forks and theirs, in the kernel's bounded
//! set. Token markers are attached where the engine runs:
//! - in the target's program, when it carries them;
//! - else, for a spawned command, in the first program its words name that
//!   carries them (`sh -c "llama-cli …"`, `perf stat -- engine …`: a word is a
//!   path or a name found in `PATH`), attached before the command starts and
//!   for any process, the kernel side keeping the followed ones' calls;
//! - else at each `exec` in the followed set (`after_exec`), as soon as the
//!   exec is read (a forced wakeup; the uprobe programs are verified at start,
//!   so attaching takes milliseconds). Only the process whose parent is the
//!   observer (the spawned command itself, `env …` or `nice …` exec'ing the
//!   engine in its place) or a process attached with `--follow-exec` is held
//!   at its exec (SIGSTOP from the kernel side, SIGCONT once markers are in
//!   place), so that not even its first call is missed. A descendant is never
//!   held: its parent would see it stop, and some parents take that for an
//!   end (`perf stat` exits at its child's first SIGCHLD, stopped or not). A
//!   descendant that makes a call within those milliseconds of its exec has
//!   that call unmarked.

use std::{
    ffi::OsString,
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use aya::maps::{MapData, RingBuf};
use observer_common::{
    FaultTimes, GlobalCounter,
    attrib::ThreadState,
    model::{
        DeviceReads, Event, FaultTotals, MAX_EVICTING_PROCESSES, ObserverHealth, ProcessEvictions, ProgramCost, RunEnd,
        RunTotals, StepKind, ThreadTotals, TokenMarks, TokenRecord,
    },
    totals::{OTHER_COMM, OTHER_TID},
};
use tokio::{io::unix::AsyncFd, sync::watch};

use crate::{
    capture::{
        bpf::{
            self, AttachOptions, EngineChoice, FaultClose, FaultTiming, MarkerKind, Markers, ProbeError, Probes,
            SchedHooks,
        },
        comm_str, header, preflight, procfs, procsample,
        residency::{self, Sampler},
        seed,
        target::{CHILD_GRACE, Ending, Target, named_programs},
        tokens::{Assembler, Snapshot},
    },
    sinks::{Sink, emit},
};

// ---- stopping -----------------------------------------------------------------

/// Stop requests for every session of this process: SIGINT and SIGTERM
/// (once [`Stop::install`]ed) and [`Stop::request`]. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Stop(Arc<StopInner>);

#[derive(Debug)]
struct StopInner {
    /// Requests so far (signals and [`Stop::request`]s).
    count: watch::Sender<u64>,
    signalled: AtomicBool,
}

impl Default for Stop {
    fn default() -> Self {
        Stop(Arc::new(StopInner { count: watch::Sender::new(0), signalled: AtomicBool::new(false) }))
    }
}

impl Stop {
    /// Handle SIGINT and SIGTERM from now on, as stop requests. Call it once
    /// per process (inside the tokio runtime), before spawning a target, so
    /// that a signal that arrives while the probes load is kept, never lost.
    pub fn install() -> Result<Stop> {
        use tokio::signal::unix::{SignalKind, signal};
        let stop = Stop::default();
        let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
        let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
        let s = stop.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = int.recv() => {}
                    _ = term.recv() => {}
                }
                s.0.signalled.store(true, Ordering::SeqCst);
                s.request();
            }
        });
        Ok(stop)
    }

    /// Ask the running session to stop (as a signal would, without marking
    /// the process as signalled).
    pub fn request(&self) {
        self.0.count.send_modify(|n| *n += 1);
    }

    /// SIGINT or SIGTERM arrived: the whole program should end (`serve`
    /// stops following targets, the TUI closes its screen).
    pub fn signalled(&self) -> bool {
        self.0.signalled.load(Ordering::SeqCst)
    }

    /// Resolves once SIGINT or SIGTERM has arrived.
    pub async fn signal_received(&self) {
        let mut rx = self.0.count.subscribe();
        while !self.signalled() {
            if rx.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }

    /// Requests from now on.
    fn requests(&self) -> Requests {
        let rx = self.0.count.subscribe();
        let seen = *rx.borrow();
        Requests { rx, seen }
    }
}

/// Stop requests made after a session started.
#[derive(Debug)]
struct Requests {
    rx: watch::Receiver<u64>,
    seen: u64,
}

impl Requests {
    /// The number of new requests, once there is at least one.
    async fn next(&mut self) -> u64 {
        if self.rx.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
        let now = *self.rx.borrow_and_update();
        let n = now.saturating_sub(self.seen);
        self.seen = now;
        n
    }
}

/// What a stop request does to the target (module doc).
#[derive(Debug, Default)]
struct Stopper {
    since: Option<Instant>,
}

impl Stopper {
    /// `n` stop requests arrived; true when the loop should end now.
    fn requested(&mut self, n: u64, target: &Target) -> bool {
        if !target.is_spawned() {
            return true;
        }
        if self.since.is_some() || n > 1 {
            target.signal(libc::SIGKILL);
        } else {
            target.signal(libc::SIGINT);
        }
        self.since.get_or_insert_with(Instant::now);
        false
    }
    fn pending(&self) -> bool {
        self.since.is_some()
    }
    async fn deadline(&self) {
        let at = self.since.unwrap_or_else(Instant::now) + CHILD_GRACE;
        tokio::time::sleep_until(at.into()).await
    }
    fn expired(&mut self, target: &Target) {
        log::warn!("target still running {} s after SIGINT; killing it", CHILD_GRACE.as_secs());
        target.signal(libc::SIGKILL);
        self.since = Some(Instant::now() + Duration::from_secs(3600));
    }
}

// ---- options ------------------------------------------------------------------

/// The process a session observes.
#[derive(Debug, Clone)]
pub enum TargetSpec {
    /// Spawn `command`, held before `exec` until the probes are attached; in
    /// the cgroup directory `cgroup` when given (only the child joins it).
    Spawn { command: Vec<OsString>, cgroup: Option<PathBuf> },
    /// A running process. With `follow_exec`, hold it at its next `exec`
    /// (SIGSTOP from the kernel side, SIGCONT once the new program's markers
    /// are attached), as is always done for a spawned command; its parent sees
    /// it stop briefly.
    Attach { pid: u32, follow_exec: bool },
}

/// How to measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// eBPF probes; an error when they cannot be loaded.
    #[default]
    Ebpf,
    /// eBPF probes, or the procfs fallback when they cannot be loaded.
    EbpfOrProcfs,
    /// The procfs fallback only (`crate::capture::procfs`).
    Procfs,
}

/// Token boundaries from calls of `symbol` (a uprobe at entry, a uretprobe at
/// return) in `library`, or in the target's executable when `None`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenSymbol {
    pub symbol: String,
    pub library: Option<PathBuf>,
}

/// Everything a session needs to know; no command-line types.
#[derive(Debug, Clone)]
pub struct SessionOptions {
    pub target: TargetSpec,
    pub mode: Mode,
    /// Default: the engine's marker symbols when the target has them, else
    /// an engine profile's entry points (`engine`).
    pub token_symbol: Option<TokenSymbol>,
    /// Which engines to look for without `token_symbol` (`--engine`).
    pub engine: EngineChoice,
    /// Observe the processes the target forks, and theirs, too (the kernel's
    /// set of observed processes grows at each fork, bounded; each `exec` in
    /// it is checked for markers or an engine profile).
    pub follow_children: bool,
    /// Fixed windows instead of tokens when there are no markers (and the
    /// procfs fallback's window; default 1 s there).
    pub window: Option<Duration>,
    /// The model file (GGUF); default: the `--model`/`-m` argument or the
    /// `*.gguf` file of the target's command line, else the first GGUF file
    /// the target maps, once it does (module doc).
    pub model: Option<PathBuf>,
    /// Rescan the model file's residency at most this often; default every
    /// second within [`residency::SCAN_BUDGET`].
    pub residency_interval: Option<Duration>,
    /// How often to emit process, histogram and health samples.
    pub sample_interval: Duration,
    /// How often to read token records from the kernel.
    pub poll: Duration,
    /// Observe the target even when its token boundaries cannot be found
    /// (a `--token-symbol` it does not define): without tokens, said in the
    /// header's `degraded` (`observer serve`, which serves what works).
    pub without_tokens_ok: bool,
    /// Turn the kernel's BPF run-time statistics on while attached (`--bpf-stats`).
    pub bpf_stats: bool,
    /// Which event closes a fault (`--fault-close`).
    pub fault_close: FaultClose,
    /// How faults are timed (`--time-every-fault`, `--fault-dispatch-only`).
    pub fault_timing: FaultTiming,
    /// Which program follows context switches (`--switch-hook`).
    pub sched_hooks: SchedHooks,
}

impl SessionOptions {
    /// The defaults of `observer run` for `target`.
    pub fn new(target: TargetSpec) -> Self {
        let follow_children = matches!(target, TargetSpec::Spawn { .. });
        SessionOptions {
            target,
            mode: Mode::Ebpf,
            token_symbol: None,
            engine: EngineChoice::Auto,
            follow_children,
            window: None,
            model: None,
            residency_interval: None,
            sample_interval: Duration::from_secs(1),
            poll: Duration::from_millis(100),
            without_tokens_ok: false,
            bpf_stats: false,
            fault_close: FaultClose::Auto,
            fault_timing: FaultTiming::Sampled,
            sched_hooks: SchedHooks::Auto,
        }
    }
}

/// How a session ended.
#[derive(Debug)]
pub struct Outcome {
    /// The exit code of a spawned target (128 + signal when killed); `None`
    /// for an attached one, or when the session stopped before it ended.
    pub exit_code: Option<i32>,
    /// The probes being detached, on a blocking thread (the kernel waits for
    /// RCU grace periods: most of a second).
    detach: Option<tokio::task::JoinHandle<()>>,
}

impl Outcome {
    /// Wait until the probes are detached: `observer run` does, so that none
    /// of its programs is left once it has exited. `serve` goes on to its next
    /// target meanwhile (dropping the outcome lets the detach finish on its own).
    pub async fn detached(mut self) -> Option<i32> {
        if let Some(h) = self.detach.take() {
            let _ = h.await;
        }
        self.exit_code
    }
}

// ---- the session ----------------------------------------------------------------

/// A started session (the target is there and the probes are attached).
pub struct Session {
    opts: SessionOptions,
    target: Target,
    /// The target's command line.
    command: Vec<String>,
    requests: Requests,
    capture: Capture,
    /// What this session cannot measure (`RunHeader::degraded`).
    degraded: Vec<String>,
}

enum Capture {
    Ebpf(Box<Probes>),
    /// The procfs fallback, and why there is no eBPF.
    Procfs(String),
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session").field("pid", &self.target.pid()).field("mode", &self.mode()).finish()
    }
}

impl Session {
    /// Check what is needed, spawn or attach the target, and attach the probes
    /// (or settle for the procfs fallback, as `opts.mode` allows). A spawned
    /// target is still held before `exec`; [`Session::run`] releases it.
    pub fn start(opts: SessionOptions, stop: &Stop) -> Result<Session> {
        let requests = stop.requests();
        let no_ebpf = match opts.mode {
            Mode::Procfs => Some("--procfs given".to_string()),
            Mode::Ebpf | Mode::EbpfOrProcfs => {
                match preflight::check_privileges().and_then(|_| preflight::ensure_tracefs()) {
                    Ok(()) => None,
                    Err(e) if opts.mode == Mode::EbpfOrProcfs => Some(format!("{e:#}")),
                    Err(e) => return Err(e.context("(or add --fallback for a procfs-only measurement)")),
                }
            }
        };
        let (target, command) = match &opts.target {
            TargetSpec::Attach { pid, .. } => (Target::attach(*pid)?, cmdline(*pid)),
            TargetSpec::Spawn { command, cgroup } => (
                Target::spawn_in(command, cgroup.as_deref())?,
                command.iter().map(|s| s.to_string_lossy().into_owned()).collect(),
            ),
        };
        let mut s =
            Session { opts, target, command, requests, capture: Capture::Procfs(String::new()), degraded: Vec::new() };
        let pid = s.target.pid();
        if let Some(why) = no_ebpf {
            if s.opts.mode == Mode::EbpfOrProcfs {
                s.degraded.push(format!("ebpf: {why}"));
            }
            s.capture = Capture::Procfs(why);
            return Ok(s);
        }
        let markers = match s.markers() {
            Ok(m) => m,
            Err(e) if s.opts.without_tokens_ok => {
                log::warn!("pid {pid}: {e:#}: observing it without token boundaries");
                s.degraded.push(format!("tokens: {e:#}"));
                Markers::None
            }
            Err(e) => {
                s.target.signal(libc::SIGKILL);
                return Err(e);
            }
        };
        let follow_children = s.opts.follow_children;
        let held = s.target.is_spawned();
        let (markers_optional, bpf_stats) = (s.opts.without_tokens_ok, s.opts.bpf_stats);
        let (fault_close, fault_timing, sched_hooks) = (s.opts.fault_close, s.opts.fault_timing, s.opts.sched_hooks);
        let opts = AttachOptions {
            target: pid,
            markers,
            follow_children,
            held,
            markers_optional,
            bpf_stats,
            fault_close,
            fault_timing,
            sched_hooks,
        };
        let probes = match Probes::attach(&opts) {
            Ok(p) => p,
            Err(e @ (ProbeError::Permission(_) | ProbeError::Load(_))) if s.opts.mode == Mode::EbpfOrProcfs => {
                s.degraded.push(format!("ebpf: {e}"));
                s.capture = Capture::Procfs(e.to_string());
                return Ok(s);
            }
            Err(e) => {
                // A spawned child is still blocked before exec: end it.
                s.target.signal(libc::SIGKILL);
                return Err(e.into());
            }
        };
        if let Some(e) = &probes.markers_refused {
            log::warn!("pid {pid}: {e}: observing it without token boundaries");
            s.degraded.push(format!("tokens: {e}"));
        }
        // "NAME (why)": an optional probe this kernel lacks.
        for m in &probes.missing {
            let (name, why) = m.split_once(" (").unwrap_or((m, "not attached)"));
            s.degraded.push(format!("{name}: {}", why.strip_suffix(')').unwrap_or(why)));
        }
        s.capture = Capture::Ebpf(Box::new(probes));
        Ok(s)
    }

    pub fn pid(&self) -> u32 {
        self.target.pid()
    }

    /// `ebpf`, or `procfs` for the fallback (as in the run's header).
    pub fn mode(&self) -> &'static str {
        match self.capture {
            Capture::Ebpf(_) => "ebpf",
            Capture::Procfs(_) => "procfs",
        }
    }

    /// Observe until the target ends or a stop is requested, feeding every
    /// event to `sinks` in order (module doc).
    pub async fn run(mut self, sinks: &mut [Box<dyn Sink>]) -> Result<Outcome> {
        // While the capture runs, a stalled reader of stderr must not stop it.
        let queued = crate::stderr::Queued::begin();
        let capture = std::mem::replace(&mut self.capture, Capture::Procfs(String::new()));
        let (ending, detach) = match capture {
            Capture::Ebpf(probes) => {
                let (ending, probes) = self.run_ebpf(*probes, sinks).await?;
                // After the sinks have had the end (the summary is out).
                (ending, Some(tokio::task::spawn_blocking(move || drop(probes))))
            }
            Capture::Procfs(why) => (self.run_procfs(&why, sinks).await?, None),
        };
        let exit_code = match ending {
            Some(Ending::Exited(c)) => Some(c),
            _ => None,
        };
        drop(queued);
        if let Some(line) = self.target.oom_report(exit_code) {
            log::warn!("{line}");
        }
        Ok(Outcome { exit_code, detach })
    }

    /// The token boundaries asked for, checked against the target.
    fn markers(&self) -> Result<Markers> {
        if let Some(TokenSymbol { symbol, library }) = &self.opts.token_symbol {
            let path = match library {
                Some(l) => l.clone(),
                None => self.target.exe().context("cannot find the target's executable for --token-symbol")?,
            };
            if !path.exists() {
                bail!("--token-symbol: {} does not exist", path.display());
            }
            if !bpf::elf_has_symbol(&path, symbol) {
                bail!(
                    "--token-symbol: {} defines no symbol `{symbol}` (check `nm -D {}`)",
                    path.display(),
                    path.display()
                );
            }
            return Ok(Markers::Symbol { symbol: symbol.clone(), path });
        }
        if self.opts.engine == EngineChoice::Off {
            return Ok(Markers::None);
        }
        let Some(exe) = self.target.exe() else { return Ok(Markers::None) };
        let engine = self.opts.engine;
        let spawned = self.target.is_spawned();
        // A wrapper (`sh -c "llama-cli …"`, `perf stat -- engine …`) that names the engine on its
        // command line: the engine's markers are attached now, for any process (the kernel keeps
        // the followed ones'), so that its first call is seen without holding the descendant at
        // its exec (module doc).
        if let TargetSpec::Spawn { command, .. } = &self.opts.target
            && self.opts.follow_children
            && !bpf::carries_markers(&exe, engine)
            && let Some(named) = named_programs(command).into_iter().find(|p| bpf::carries_markers(p, engine))
        {
            log::info!("the command names {}: its token markers are attached before it runs", named.display());
            return Ok(Markers::Auto { exe: named, engine, running: false, any_process: true });
        }
        Ok(Markers::Auto { exe, engine, running: !spawned, any_process: false })
    }

    /// The eBPF session; returns the probes, still attached, for the caller
    /// to detach.
    async fn run_ebpf(&mut self, mut probes: Probes, sinks: &mut [Box<dyn Sink>]) -> Result<(Option<Ending>, Probes)> {
        let pid = self.target.pid();
        let ring = probes.take_events()?;
        // Token records are polled; the kernel wakes us at an `exec` of the target (to attach
        // the new program's markers before its first token), at a question about an fd, and
        // when an eighth of the ring is unread (`observer-ebpf` `maps::batch_wakeup`).
        // SAFETY: the ring buffer owns its fd and outlives the registration.
        let mut ring =
            unsafe { AsyncFd::register(ring) }.map_err(|e| e.into_parts().1).context("registering the ring buffer")?;
        let mut asm = Assembler::new(step_kind(probes.markers.as_ref()));
        let model = self.model_file();
        let mut resid = model.as_deref().and_then(|m| self.residency_sampler(m, &mut probes));
        measured_with(&mut asm, resid.as_ref());
        // Said once everything is attached, the residency sampler's programs included (their
        // verification takes a core for about half a second on the development VM): a caller
        // that waits for this line (a test, a bench's window) starts after it.
        log::info!(
            "pid {pid}: {} probes attached; tokens: {}{}",
            probes.attached.len(),
            tokens_desc(probes.markers.as_ref(), self.opts.window.is_some()),
            if probes.missing.is_empty() {
                String::new()
            } else {
                format!("; not attached: {}", probes.missing.join(", "))
            }
        );
        // A target that names no model (attached before it mapped one, or started by a command
        // line that does not name it): its mapping is looked for at every sample until one
        // appears, and its residency is sampled from then on.
        let mut awaiting_model = model.is_none();
        let marked_by = tokens_desc(probes.markers.as_ref(), self.opts.window.is_some());
        let header = header::build(
            "ebpf",
            pid,
            &self.command,
            probes.attached.clone(),
            model.as_deref(),
            marked_by,
            self.degraded.clone(),
        );
        emit(sinks, &Event::Header(header))?;
        // Otherwise the kernel side does not wake us (`maps::batch_wakeup`): poll.
        let mut poll = interval(self.opts.poll);
        let mut sampler = interval(self.opts.sample_interval);
        let use_windows = self.opts.window.is_some() && probes.markers.is_none();
        let mut ticker = interval(self.opts.window.unwrap_or(Duration::from_secs(3600)));

        // A spawned command without markers (`env`, `nice`, … that exec the
        // engine in its place): stop it at each exec until a program with
        // markers runs, so no token is missed; its parent is the observer. An
        // attached process is only held when asked (its parent sees it stop).
        // A descendant is never held: its parent would see it stop (`perf
        // stat` ends when its child stops); its markers are attached as soon
        // as its exec is read (a forced wakeup), before the engine has loaded
        // a model and decodes.
        let follow_exec = matches!(self.opts.target, TargetSpec::Attach { follow_exec: true, .. });
        let mut stop_on_exec =
            (self.target.is_spawned() || follow_exec) && probes.markers.is_none() && self.opts.token_symbol.is_none();
        let held = pid;
        probes.set_stop_on_exec(stop_on_exec.then_some(held))?;
        self.target.release()?;
        if use_windows {
            ticker.tick().await; // the first tick is immediate
            asm.window(window_snapshot(&mut probes, &asm)?);
        }

        let mut silent = SilentMarkers::default();
        let mut stopper = Stopper::default();
        let ending = loop {
            silent.check(&probes, asm.records(), false, pid, sinks)?;
            // Execs read by the last drain (either branch below): attach what
            // the new programs carry, then let a held one go on.
            for (exec_pid, exec_ns) in std::mem::take(&mut asm.execs) {
                if let Some(x) = resid.as_mut().and_then(Sampler::xread_mut) {
                    x.exec(exec_pid);
                }
                let before = probes.markers.is_some();
                let refused =
                    after_exec(&mut probes, exec_pid, Some(exec_ns), self.opts.engine, self.opts.without_tokens_ok)?;
                marks_found(before, refused, &probes, exec_pid, sinks)?;
                asm.default_kind = step_kind(probes.markers.as_ref());
                if stop_on_exec && exec_pid == held {
                    // The kernel side stopped it at exec; markers are in place now.
                    // SAFETY: plain kill(2) of a process we are observing.
                    unsafe { libc::kill(exec_pid as libc::pid_t, libc::SIGCONT) };
                }
                if stop_on_exec && probes.markers.is_some() {
                    stop_on_exec = false;
                    probes.set_stop_on_exec(None)?;
                }
            }
            tokio::select! {
                e = self.target.wait() => break Some(e?),
                n = self.requests.next() => if stopper.requested(n, &self.target) { break None; },
                _ = stopper.deadline(), if stopper.pending() => stopper.expired(&self.target),
                _ = poll.tick() => drain(ring.get_mut(), &mut asm, &mut resid, sinks)?,
                guard = ring.readable_mut() => {
                    let mut guard = guard.context("waiting on the ring buffer")?;
                    drain(guard.get_inner_mut(), &mut asm, &mut resid, sinks)?;
                    guard.clear_ready();
                }
                _ = ticker.tick(), if use_windows => {
                    // The read records of the ending window first, and the final states of threads
                    // gone before its snapshot after it (see `Assembler::window`).
                    drain(ring.get_mut(), &mut asm, &mut resid, sinks)?;
                    let snap = window_snapshot(&mut probes, &asm)?;
                    drain(ring.get_mut(), &mut asm, &mut resid, sinks)?;
                    if let Some(t) = asm.window(snap) {
                        tokens(vec![t], &mut resid, sinks)?;
                    }
                }
                _ = sampler.tick() => {
                    // A library loaded later (dlopen) may bring an engine's entry points.
                    // Not again once the kernel refused them.
                    if probes.markers.is_none()
                        && probes.markers_refused.is_none()
                        && self.opts.token_symbol.is_none()
                        && !stop_on_exec
                    {
                        let refused = after_exec(&mut probes, pid, None, self.opts.engine, self.opts.without_tokens_ok)?;
                        marks_found(false, refused, &probes, pid, sinks)?;
                    }
                    if awaiting_model && let Some(m) = crate::capture::discover::mapped_gguf(pid) {
                        awaiting_model = false;
                        log::info!("pid {pid}: mapped {}: its residency is sampled from now on", m.display());
                        resid = self.residency_sampler(&m, &mut probes);
                        measured_with(&mut asm, resid.as_ref());
                    }
                    let now = seed::mono_ns();
                    let mut sample = procsample::sample(pid, now);
                    sample.evicted_by_process = evicted_by_process(&resid)?;
                    emit(sinks, &Event::Process(sample))?;
                    emit(sinks, &Event::Histograms(probes.histograms_event(now)?))?;
                    emit(sinks, &Event::Health(health(&probes, asm.malformed, now)?))?;
                }
            }
        };
        // The records still in the ring: when the target has exited, their sample reads nothing
        // of the process (`Sampler::process_ended`) but still closes the grid's counters, which
        // hold what its last tokens did (an empty-cache run lost one token of three from the
        // per-expert refault grids when these records carried no sample).
        if ending.is_some()
            && let Some(s) = resid.as_mut()
        {
            s.process_ended();
        }
        let mut late_resid = resid.take();
        drain(ring.get_mut(), &mut asm, &mut late_resid, sinks)?;
        let now = seed::mono_ns();
        emit(sinks, &Event::Histograms(probes.histograms_event(now)?))?;
        emit(sinks, &Event::Health(health(&probes, asm.malformed, now)?))?;
        let end_ns = seed::mono_ns();
        let slots = probes.slots(end_ns)?;
        let last = match use_windows {
            true => Some(window_snapshot_of(&probes, &asm, end_ns, slots.iter().map(|(s, _)| *s).collect())?),
            false => None,
        };
        // The final states of threads whose slots were given back before the slots were read.
        drain(ring.get_mut(), &mut asm, &mut late_resid, sinks)?;
        if let Some(t) = last.and_then(|last| asm.window(last)) {
            tokens(vec![t], &mut late_resid, sinks)?;
        }
        let mut totals = run_totals(&probes, &asm, slots, end_ns)?;
        totals.evicted_by_process = evicted_by_process(if late_resid.is_some() { &late_resid } else { &resid })?;
        drop(late_resid);
        drop(resid);
        if let Some(w) = totals.slotless_warning() {
            log::warn!("{w}");
        }
        emit(sinks, &Event::Totals(totals))?;
        let lost = probes.counter(GlobalCounter::LostEvents)? + asm.malformed;
        silent.check(&probes, asm.records(), true, pid, sinks)?;
        let torn = probes.counter(GlobalCounter::TornCopies)?;
        if torn > 0 {
            log::warn!(
                "{torn} of the {lost} lost events are thread copies a token's mark could not take whole \
                 (another CPU was updating that thread's state through every attempt): those threads are \
                 missing from their tokens"
            );
        }
        let unfollowed = probes.counter(GlobalCounter::FollowOverflow)?;
        if unfollowed > 0 {
            log::warn!(
                "{unfollowed} process(es) started by the target were not observed: more than {} at once \
                 (their time is missing from the whole-run table)",
                bpf::MAX_FOLLOWED
            );
        }
        drop(ring);
        let exit_code = match ending {
            Some(Ending::Exited(c)) => Some(c),
            _ => None,
        };
        emit(sinks, &Event::End(RunEnd { mono_ns: end_ns, exit_code, lost_events: lost }))?;
        Ok((ending, probes))
    }

    /// The procfs fallback (`crate::capture::procfs`): fixed windows, what
    /// procfs can measure, everything else `None`.
    async fn run_procfs(&mut self, why: &str, sinks: &mut [Box<dyn Sink>]) -> Result<Option<Ending>> {
        let pid = self.target.pid();
        let window = self.opts.window.unwrap_or(Duration::from_secs(1));
        log::info!(
            "pid {pid}: no eBPF ({why}); procfs fallback every {} ms: measuring {}",
            window.as_millis(),
            procfs::MEASURED
        );
        emit(
            sinks,
            &Event::Header(header::build(
                "procfs",
                pid,
                &self.command,
                Vec::new(),
                self.model_file().as_deref(),
                "fixed windows (procfs)".to_string(),
                self.degraded.clone(),
            )),
        )?;
        let mut asm = Assembler::new(StepKind::Window);
        let mut ticker = interval(window);
        let mut sampler = interval(self.opts.sample_interval);
        self.target.release()?;
        ticker.tick().await;
        let snap = |asm: &mut Assembler| asm.window(Snapshot::of_threads(seed::mono_ns(), procfs::snapshot(pid)));
        snap(&mut asm);
        let mut stopper = Stopper::default();
        let ending = loop {
            tokio::select! {
                e = self.target.exited() => {
                    e?;
                    // The last, partial window: a spawned child is still a
                    // zombie here, with its final counters.
                    if let Some(mut t) = snap(&mut asm) {
                        procfs::mark_unmeasured(&mut t);
                        tokens(vec![t], &mut None, sinks)?;
                    }
                    break Some(self.target.reap()?);
                }
                n = self.requests.next() => if stopper.requested(n, &self.target) { break None; },
                _ = stopper.deadline(), if stopper.pending() => stopper.expired(&self.target),
                _ = ticker.tick() => {
                    if let Some(mut t) = snap(&mut asm) {
                        procfs::mark_unmeasured(&mut t);
                        tokens(vec![t], &mut None, sinks)?;
                    }
                }
                _ = sampler.tick() => emit(sinks, &Event::Process(procsample::sample(pid, seed::mono_ns())))?,
            }
        };
        let exit_code = match ending {
            Some(Ending::Exited(c)) => Some(c),
            _ => None,
        };
        emit(sinks, &Event::End(RunEnd { mono_ns: seed::mono_ns(), exit_code, lost_events: 0 }))?;
        Ok(ending)
    }

    /// The target's model file: `--model`, else the one its command line names
    /// (relative to its working directory), else, for a process attached to
    /// (`--pid`), the first GGUF file it has mapped (`discover::mapped_gguf`).
    fn model_file(&self) -> Option<PathBuf> {
        let pid = self.target.pid();
        if let Some(m) =
            self.opts.model.clone().or_else(|| header::model_from_command(&self.command).map(PathBuf::from))
        {
            return Some(if m.is_relative() {
                std::fs::read_link(format!("/proc/{pid}/cwd")).map(|d| d.join(&m)).unwrap_or(m)
            } else {
                m
            });
        }
        if self.target.is_spawned() { None } else { crate::capture::discover::mapped_gguf(pid) }
    }

    /// The residency sampler for the target's model file (`model_file`, or the GGUF it
    /// mapped later), with page-cache churn counted in the kernel. Problems are reported in one
    /// line, never fatal.
    fn residency_sampler(&self, model: &std::path::Path, probes: &mut Probes) -> Option<Sampler> {
        let mut s = match Sampler::new(model, Some(self.target.pid())) {
            Ok(s) => s,
            Err(e) => {
                log::warn!("residency not measured ({}): {e}", model.display());
                return None;
            }
        };
        match self.opts.residency_interval {
            Some(d) => s.set_scan_interval(d),
            None => {
                s.set_scan_interval(Duration::from_secs(1));
                s.set_scan_budget(Some(residency::SCAN_BUDGET));
            }
        }
        if let Err(e) = s.enable_churn(probes.ebpf_mut()) {
            log::warn!("page-cache churn not measured: {e}");
        } else if let Err(e) = s.enable_explicit_reads(probes.ebpf_mut(), self.target.pid()) {
            log::warn!("explicit reads of the model not measured per region: {e}");
        }
        Some(s)
    }
}

/// The warning for token markers that never fire: when a probed token
/// function has not been called [`SILENT_AFTER`] after it was attached (or by
/// the end of the run), say so once, naming the engine entry points the probed
/// file defines (e.g. `llama_process` beside `llama_decode`): on stderr, and in
/// the stream as an `Event::Marks` whose `degraded` carries it (so the JSON
/// summary's `degraded`, a trace and the TUI's header have it too).
#[derive(Debug, Default)]
struct SilentMarkers {
    since: Option<Instant>,
    warned: bool,
}

/// How long probed token markers may stay silent before the warning.
const SILENT_AFTER: Duration = Duration::from_secs(5);

impl SilentMarkers {
    fn check(
        &mut self,
        probes: &Probes,
        records: u64,
        at_end: bool,
        pid: u32,
        sinks: &mut [Box<dyn Sink>],
    ) -> Result<()> {
        let Some(m) = probes.markers.as_ref() else { return Ok(()) };
        let since = *self.since.get_or_insert_with(Instant::now);
        if self.warned || records > 0 || !(at_end || since.elapsed() >= SILENT_AFTER) {
            return Ok(());
        }
        self.warned = true;
        let (what, path) = match m {
            MarkerKind::Symbol { symbol, path } => (format!("`{symbol}`"), path.clone()),
            MarkerKind::Profile(f) => (format!("the {} entry points", f.profile.name), f.path.display().to_string()),
            MarkerKind::Engine { exe } => ("the engine markers".to_string(), exe.clone()),
        };
        let when = if at_end { "during the run".to_string() } else { format!("in {} s", SILENT_AFTER.as_secs()) };
        let candidates = crate::capture::profile::detect(
            &crate::capture::profile::PROFILES.iter().collect::<Vec<_>>(),
            std::path::Path::new(&path),
            None,
        )
        .map(|f| {
            let names: Vec<&str> = f.entries.iter().map(|e| e.symbol).collect();
            format!(
                "; {path} defines these {} entry points: {} (without --token-symbol, every one of them is probed)",
                f.profile.name,
                names.join(", ")
            )
        })
        .unwrap_or_default();
        let warning = format!("no call of {what} {when}: no token records{candidates}");
        log::warn!("{warning}");
        let m = TokenMarks {
            mono_ns: seed::mono_ns(),
            pid,
            tokens: tokens_desc(Some(m), false),
            probes: probes.attached.clone(),
            degraded: vec![format!("tokens: {warning}")],
        };
        emit(sinks, &Event::Marks(m))
    }
}

/// The kind of a step that carries no engine record, by what marks the steps.
fn step_kind(markers: Option<&MarkerKind>) -> StepKind {
    match markers {
        Some(MarkerKind::Symbol { .. } | MarkerKind::Profile(_)) => StepKind::Call,
        Some(MarkerKind::Engine { .. }) => StepKind::Generate,
        None => StepKind::Window,
    }
}

/// The command line of a running process.
/// Hand-read: procfs's `cmdline()` fails on an argument that is not UTF-8; this keeps it (lossily).
fn cmdline(pid: u32) -> Vec<String> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    raw.split(|&b| b == 0).filter(|s| !s.is_empty()).map(|s| String::from_utf8_lossy(s).into_owned()).collect()
}

fn interval(d: Duration) -> tokio::time::Interval {
    let mut i = tokio::time::interval(d);
    i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    i
}

/// Every thread's state now (and the explicit-read totals, when `asm` folds reads), as a window
/// boundary.
fn window_snapshot(probes: &mut Probes, asm: &Assembler) -> Result<Snapshot> {
    let now = seed::mono_ns();
    probes.close_at(now)?;
    window_snapshot_of(probes, asm, now, probes.snapshot(now)?)
}

/// [`window_snapshot`] at `now` of `threads`, the states read then.
fn window_snapshot_of(probes: &Probes, asm: &Assembler, now: u64, threads: Vec<ThreadState>) -> Result<Snapshot> {
    let xread = match asm.xread {
        Some(_) => Some(probes.xread_totals()?),
        None => None,
    };
    Ok(Snapshot { xread, ..Snapshot::of_threads(now, threads) })
}

fn health(probes: &Probes, malformed: u64, mono_ns: u64) -> Result<ObserverHealth> {
    let programs = probes.bpf_stats()?;
    let sum = |f: fn(&ProgramCost) -> u64| programs.as_ref().map(|p| p.iter().map(f).sum());
    Ok(ObserverHealth {
        mono_ns,
        lost_events: probes.counter(GlobalCounter::LostEvents)? + malformed,
        probes_attached: probes.attached.len() as u32,
        probes_missing: probes.missing.len() as u32,
        bpf_run_ns: sum(|p| p.run_ns),
        bpf_run_count: sum(|p| p.runs),
        bpf_programs: programs.unwrap_or_default(),
    })
}

/// What marks the tokens, in words (the log line and the header's `tokens`).
fn tokens_desc(markers: Option<&MarkerKind>, windows: bool) -> String {
    match markers {
        Some(MarkerKind::Engine { exe }) => format!("engine markers in {exe}"),
        Some(MarkerKind::Symbol { symbol, path }) => format!("calls of {symbol} in {path}"),
        Some(MarkerKind::Profile(found)) => format!("engine profile {}", found.describe()),
        None if windows => "fixed windows".to_string(),
        None => "none (whole-run totals only; use --window or --token-symbol)".to_string(),
    }
}

/// The whole run's per-thread and per-device totals from the kernel's maps
/// (`observer_common::totals`), thread states closed at `now`.
/// Who evicted the model file's pages so far, per process (`model::ProcessEvictions`), when
/// eviction blame is attached; empty otherwise.
fn evicted_by_process(resid: &Option<Sampler>) -> Result<Vec<ProcessEvictions>> {
    match resid.as_ref().and_then(|r| r.churn()).and_then(|c| c.blame()) {
        Some(t) => Ok(t.context("reading the eviction blame table")?.by_process(MAX_EVICTING_PROCESSES)),
        None => Ok(Vec::new()),
    }
}

/// The run's totals from `slots`, the threads in the slots read before the ring buffer's last
/// drain, and the threads that gave theirs back (`observer_common::attrib::MAX_SLOTS`, "Slots"): a
/// slot read as its thread's was being given back is counted once, from its final state.
fn run_totals(probes: &Probes, asm: &Assembler, slots: Vec<(ThreadState, FaultTimes)>, now: u64) -> Result<RunTotals> {
    let mut threads: Vec<ThreadTotals> = asm.retired_rows.rows().to_vec();
    for (s, f) in slots.iter().filter(|(s, _)| !asm.retired_since_begin(s)) {
        threads.push(ThreadTotals::from_kernel(s, f));
    }
    // Threads beyond the slots: their faults only (`observer_common::totals`).
    for (tid, o) in probes.overflow_faults()? {
        threads.push(ThreadTotals {
            tid,
            pid: o.tgid,
            comm: comm_str(&o.comm),
            faults: Some(FaultTotals::from_overflow(&o)),
            time: None,
            folded: 0,
        });
    }
    let (other_maj, other_min) = probes.other_faults()?;
    if let Some(faults) = FaultTotals::other(other_maj, other_min) {
        threads.push(ThreadTotals {
            tid: OTHER_TID,
            pid: 0,
            comm: OTHER_COMM.to_string(),
            faults: Some(faults),
            time: None,
            folded: 0,
        });
    }
    threads.sort_by_key(|t| t.tid);
    let devices = probes
        .devices()?
        .iter()
        .map(|(kdev, d)| {
            // The kernel's dev_t encoding: (major << 20) | minor.
            let (major, minor) = (kdev >> 20, kdev & 0xfffff);
            DeviceReads {
                dev: format!("{major}:{minor}"),
                name: block_device_name(major, minor),
                read_bytes: d.read_bytes,
                read_ios: d.read_ios,
                read_ns: d.read_ns,
                completed: d.completed,
            }
        })
        .collect();
    Ok(RunTotals { mono_ns: now, threads, devices, evicted_by_process: Vec::new() })
}

/// A block device's kernel name (`vda`, `zram0`) from sysfs.
fn block_device_name(major: u32, minor: u32) -> Option<String> {
    std::fs::read_to_string(format!("/sys/dev/block/{major}:{minor}/uevent"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("DEVNAME=").map(str::to_string))
}

/// The target exec'd (or may have loaded a library): attach the markers of
/// its program, or an engine profile's entry points, when it has them. With
/// `tokens_optional` (`SessionOptions::without_tokens_ok`), markers whose
/// uprobes the kernel refuses leave the run without tokens: returns the
/// `degraded` entry that says so.
fn after_exec(
    probes: &mut Probes,
    pid: u32,
    exec_ns: Option<u64>,
    engine: EngineChoice,
    tokens_optional: bool,
) -> Result<Option<String>> {
    if engine == EngineChoice::Off || probes.markers_refused.is_some() {
        return Ok(None);
    }
    let Ok(exe) = std::fs::read_link(format!("/proc/{pid}/exe")) else { return Ok(None) };
    // How long after its exec the markers are in place: a call the process made before is unmarked.
    let since = || match exec_ns {
        Some(t) => format!(" ({:.1} ms after its exec)", seed::mono_ns().saturating_sub(t) as f64 / 1e6),
        None => String::new(),
    };
    match probes.attach_after_exec(&exe, pid, engine) {
        Ok(Some(MarkerKind::Profile(found))) => log::info!("pid {pid}: engine profile {}{}", found.describe(), since()),
        Ok(Some(_)) => log::info!("pid {pid} exec'd {}: engine markers attached{}", exe.display(), since()),
        Ok(None) => {}
        // It ended before its markers could be attached (a short program): nothing to mark.
        Err(e) if std::fs::read_link(format!("/proc/{pid}/exe")).is_err() => {
            log::warn!("pid {pid} ended before its token markers were attached: its steps have no records ({e})");
        }
        Err(e) if tokens_optional && e.is_markers_refused() => {
            let why = e.to_string();
            log::warn!("pid {pid}: {why}: observing it without token boundaries");
            probes.markers_refused = Some(why.clone());
            return Ok(Some(format!("tokens: {why}")));
        }
        Err(e) => return Err(e.into()),
    }
    Ok(None)
}

/// Restate the header's `tokens` and `probes` (`Event::Marks`) when markers were found that were
/// not there `before` (a wrapper's child exec'd an engine, or a library was loaded later).
/// `refused`: the markers found were refused by the kernel (`after_exec`): said in the marks'
/// `degraded`.
fn marks_found(
    before: bool,
    refused: Option<String>,
    probes: &Probes,
    pid: u32,
    sinks: &mut [Box<dyn Sink>],
) -> Result<()> {
    if refused.is_none() && (before || probes.markers.is_none()) {
        return Ok(());
    }
    let m = TokenMarks {
        mono_ns: seed::mono_ns(),
        pid,
        tokens: tokens_desc(probes.markers.as_ref(), false),
        probes: probes.attached.clone(),
        degraded: refused.into_iter().collect(),
    };
    emit(sinks, &Event::Marks(m))
}

/// Tell the assembler what the residency sampler measures in the kernel (its marks carry it).
fn measured_with(asm: &mut Assembler, resid: Option<&Sampler>) {
    let churn = resid.and_then(Sampler::churn);
    asm.churn = churn.is_some();
    asm.blame = churn.is_some_and(|c| c.blame.is_ok());
    asm.xread = resid.and_then(Sampler::xread).map(|x| x.cells.clone());
}

/// Emit a batch of token records. With a residency sampler, the last record
/// of the batch carries a residency sample (taken now; the file scan is rate
/// limited by the sampler), the others none: tokens are read in batches. Its
/// grid's churn is since the previous sample, and so are its read layers: the
/// per-expert explicit reads of the batch's records (`ExpertGrid::add_reads`).
fn tokens(mut batch: Vec<TokenRecord>, resid: &mut Option<Sampler>, sinks: &mut [Box<dyn Sink>]) -> Result<()> {
    // Generated tokens since the previous sample (the batch), for the engine cache's hit rate.
    let generated = batch.iter().all(|t| t.kind == StepKind::Generate).then_some(batch.len() as u64);
    let reads = resid.as_ref().is_some_and(|s| s.xread().is_some());
    let mut grid_reads = observer_common::model::ExplicitReads::default();
    if reads {
        grid_reads.experts =
            batch.iter().filter_map(|t| t.explicit_reads.as_ref()).flat_map(|x| x.experts.clone()).collect();
    }
    if let (Some(s), Some(last)) = (resid.as_mut(), batch.last_mut()) {
        match s.sample_after(generated) {
            Ok(mut x) => {
                if let Some(g) = x.residency.grid.as_mut().filter(|_| reads) {
                    let outside = g.add_reads(&grid_reads);
                    debug_assert_eq!(outside, 0, "a read expert outside the model's grid");
                }
                last.residency = Some(x.residency)
            }
            Err(e) => {
                log::warn!("residency sampling stopped: {e}");
                *resid = None;
            }
        }
    }
    for t in batch {
        emit(sinks, &Event::Token(t))?;
    }
    Ok(())
}

fn drain(
    ring: &mut RingBuf<MapData>,
    asm: &mut Assembler,
    resid: &mut Option<Sampler>,
    sinks: &mut [Box<dyn Sink>],
) -> Result<()> {
    let mut batch = Vec::new();
    while let Some(item) = ring.next() {
        if let Some(t) = asm.push(&item) {
            batch.push(t);
        }
    }
    // The descriptors the kernel asked about: its reads on them are charged once they are known.
    let queries = std::mem::take(&mut asm.fd_queries);
    if let Some(x) = resid.as_mut().and_then(Sampler::xread_mut) {
        for (tgid, fd) in queries {
            x.resolve(tgid, fd);
        }
    }
    if batch.is_empty() { Ok(()) } else { tokens(batch, resid, sinks) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "current_thread")]
    async fn requests_count_from_the_start_of_a_session_and_signals_are_told_apart() {
        let stop = Stop::default();
        stop.request();
        let mut r = stop.requests();
        stop.request();
        stop.request();
        assert_eq!(r.next().await, 2, "two requests after the session started, none before");
        assert!(!stop.signalled(), "a request is not a signal");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_spawned_target_gets_sigint_then_sigkill_and_an_attached_one_is_left() {
        // A spawned target keeps an ignored SIGINT (a `nohup`-like launcher's intent), and a test
        // run started in the background by a non-interactive shell has SIGINT ignored: give this
        // process the default disposition, which the child then inherits, so that the test
        // measures the stop sequence and not how it was launched.
        // SAFETY: reading and setting a signal disposition.
        unsafe {
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(libc::SIGINT, std::ptr::null(), &mut old) == 0 && old.sa_sigaction == libc::SIG_IGN {
                libc::signal(libc::SIGINT, libc::SIG_DFL);
            }
        }
        let cmd: Vec<OsString> = vec!["sleep".into(), "30".into()];
        let mut t = Target::spawn(&cmd).unwrap();
        t.release().unwrap();
        let mut s = Stopper::default();
        assert!(!s.requested(1, &t), "a spawned target gets time to exit");
        assert!(s.pending());
        assert_eq!(t.wait().await.unwrap(), Ending::Exited(128 + libc::SIGINT));
        let me = Target::attach(std::process::id()).unwrap();
        assert!(Stopper::default().requested(1, &me), "an attached process: stop at once");
    }
}
