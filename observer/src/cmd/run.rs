//! `observer run`: observe a command or a PID, print per-token lines and a
//! summary, optionally write JSON.

use std::{
    ffi::OsString,
    io::Write,
    path::PathBuf,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use observer::{
    analysis::{
        attribution,
        report::{Summary, TargetInfo},
    },
    capture::{
        bpf::{self, AttachOptions, MarkerKind, Markers, ProbeError, Probes},
        header, preflight, procfs, procsample,
        residency::Sampler,
        seed,
        target::{CHILD_GRACE, Ending, Target},
        tokens::{Assembler, Snapshot},
    },
    sinks::{Sink, emit},
};
use observer_common::{
    GlobalCounter,
    model::{Event, ObserverHealth, RunEnd, StepKind, TokenRecord},
};
use tokio::io::unix::AsyncFd;

#[derive(Debug, Clone, clap::Args)]
pub struct RunArgs {
    /// Attach to this running process (all its threads) instead of spawning one.
    #[arg(long, conflicts_with = "command")]
    pub pid: Option<u32>,
    /// Also write the summary and every token record as JSON to this file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Also record the model stream to this trace file (see `observer record`).
    #[arg(long, value_name = "FILE")]
    pub record: Option<PathBuf>,
    /// Token boundaries from calls of this function (uprobe at entry, uretprobe
    /// at return), e.g. `llama_decode:/usr/lib/libllama.so`. Default: the
    /// engine's marker symbols when the target has them.
    #[arg(long, value_name = "SYM[:LIB]")]
    token_symbol: Option<String>,
    /// Fixed time windows instead of tokens (e.g. `250ms`, `1s`).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    window: Option<Duration>,
    /// The model file (GGUF) the target runs; default: the `--model`/`-m`
    /// argument or `*.gguf` file of the target's command line.
    #[arg(long, value_name = "FILE")]
    pub model: Option<PathBuf>,
    /// Rescan the model file's residency (mincore, pagemap) at most this often.
    /// Default: every second, and never for more than 0.5 % of one CPU; a
    /// given interval is kept whatever the scans cost.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub residency_interval: Option<Duration>,
    /// How often to sample the target's memory and swap.
    #[arg(long, default_value = "1s", value_name = "DURATION", value_parser = parse_duration)]
    pub sample_interval: Duration,
    /// Run the spawned command inside this cgroup (a cgroup v2 or v1 directory
    /// under /sys/fs/cgroup, e.g. one with a memory limit); only the child joins
    /// it. An OOM kill of the target there is reported after the run.
    #[arg(long, value_name = "DIR", conflicts_with = "pid")]
    pub cgroup: Option<PathBuf>,
    /// With --pid: hold the process at its next exec (SIGSTOP from the kernel
    /// side, SIGCONT once the new program's token markers are attached), as is
    /// always done for a spawned command. Its parent will see it stop briefly.
    #[arg(long, requires = "pid")]
    pub follow_exec: bool,
    /// Without eBPF (no root/CAP_BPF, or no BPF in the kernel), fall back to a
    /// procfs-only measurement instead of failing.
    #[arg(long)]
    pub fallback: bool,
    /// Use the procfs-only measurement even where eBPF works.
    #[arg(long)]
    pub procfs: bool,
    /// Keep at most this many token records for the end-of-run summary and
    /// JSON (older ones are dropped, and counted); sinks see every record.
    #[arg(long, default_value_t = usize::MAX, hide = true)]
    pub keep_tokens: usize,
    /// How often to read token records from the kernel.
    #[arg(long, default_value = "100ms", value_name = "DURATION", value_parser = parse_duration)]
    pub poll: Duration,
    /// Print every Nth token line while running (0: none).
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub every: u64,
    /// Serve Prometheus/OpenMetrics metrics at http://ADDR/metrics while
    /// running (`PORT` or `:PORT` listen on 127.0.0.1; `HOST:PORT`).
    #[arg(long, value_name = "ADDR")]
    pub metrics_addr: Option<String>,
    /// The command to spawn and observe.
    #[arg(last = true, value_name = "CMD")]
    pub command: Vec<OsString>,
    /// Not an option: a notification stops the run like Ctrl-C (the TUI's quit).
    #[arg(skip)]
    pub stop: std::sync::Arc<tokio::sync::Notify>,
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, unit) = s.split_at(s.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(s.len()));
    let v: f64 = num.parse().map_err(|_| format!("not a duration: {s:?} (use e.g. 250ms, 1s)"))?;
    let secs = match unit {
        "ms" => v / 1e3,
        "s" | "" => v,
        "us" | "µs" => v / 1e6,
        "m" | "min" => v * 60.0,
        _ => return Err(format!("unknown unit in {s:?} (ms, s, min)")),
    };
    if !(secs > 0.0 && secs.is_finite()) {
        return Err(format!("duration must be positive: {s:?}"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// Turns SIGINT and SIGTERM into notifications on `stop`, from its creation
/// (before the target is spawned) until it is dropped. A signal that arrives
/// while the probes load, or while the loop is busy between two polls, is
/// kept as the `Notify` permit, never lost.
struct SignalsToStop(tokio::task::JoinHandle<()>);

impl SignalsToStop {
    fn install(stop: std::sync::Arc<tokio::sync::Notify>) -> Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
        let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
        Ok(SignalsToStop(tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = int.recv() => {}
                    _ = term.recv() => {}
                }
                stop.notify_one();
            }
        })))
    }
}

impl Drop for SignalsToStop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Resolves on Ctrl-C (SIGINT), SIGTERM (through [`SignalsToStop`]), or a
/// notification on `stop`.
async fn stop_requested(stop: &tokio::sync::Notify) -> Result<()> {
    stop.notified().await;
    Ok(())
}

fn markers_for(args: &RunArgs, target: &Target) -> Result<Markers> {
    if let Some(spec) = &args.token_symbol {
        let (symbol, lib) = match spec.split_once(':') {
            Some((s, l)) => (s.to_string(), Some(PathBuf::from(l))),
            None => (spec.clone(), None),
        };
        let path = match lib {
            Some(l) => l,
            None => target.exe().context("cannot find the target's executable for --token-symbol")?,
        };
        if !path.exists() {
            bail!("--token-symbol: {} does not exist", path.display());
        }
        if !bpf::elf_has_symbol(&path, &symbol) {
            bail!("--token-symbol: {} defines no symbol `{symbol}` (check `nm -D {}`)", path.display(), path.display());
        }
        return Ok(Markers::Symbol { symbol, path });
    }
    Ok(match target.exe() {
        Some(exe) => Markers::Auto { exe },
        None => Markers::None,
    })
}

/// Prints token lines to stderr as they complete.
struct Live {
    every: u64,
    header_done: bool,
}

impl Sink for Live {
    fn event(&mut self, ev: &Event) -> Result<()> {
        let Event::Token(t) = ev else { return Ok(()) };
        if self.every == 0 || t.seq % self.every != 0 {
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

/// Extra sinks a subcommand adds to `run` (recorder, TUI, exporter).
pub type ExtraSinks = Vec<Box<dyn Sink>>;

pub async fn run(args: RunArgs) -> Result<i32> {
    run_with(args, Vec::new()).await
}

/// `run` with extra sinks fed the same model stream.
pub async fn run_with(args: RunArgs, mut extra: ExtraSinks) -> Result<i32> {
    if args.pid.is_none() && args.command.is_empty() {
        bail!("nothing to observe: give `--pid PID` or `-- CMD [ARGS…]`");
    }
    let _signals = SignalsToStop::install(args.stop.clone())?;
    if let Some(addr) = &args.metrics_addr {
        extra.push(Box::new(observer::sinks::prometheus::run_sink(addr)?));
    }
    // Without eBPF: fall back to procfs when asked to, else say what to do.
    let no_ebpf = if args.procfs {
        Some("--procfs given".to_string())
    } else {
        match preflight::check_privileges().and_then(|_| preflight::ensure_tracefs()) {
            Ok(()) => None,
            Err(e) if args.fallback => Some(format!("{e:#}")),
            Err(e) => return Err(e.context("(or add --fallback for a procfs-only measurement)")),
        }
    };
    if let Some(p) = &args.record {
        extra.push(Box::new(observer::store::trace::TraceWriter::create(p).context("cannot create the trace file")?));
    }
    let (mut target, command): (Target, Vec<String>) = match args.pid {
        Some(pid) => {
            let t = Target::attach(pid)?;
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let cmd = cmdline
                .split(|&b| b == 0)
                .filter(|s| !s.is_empty())
                .map(|s| String::from_utf8_lossy(s).into_owned())
                .collect();
            (t, cmd)
        }
        None => {
            let cmd = args.command.iter().map(|s| s.to_string_lossy().into_owned()).collect();
            (Target::spawn_in(&args.command, args.cgroup.as_deref())?, cmd)
        }
    };
    if let Some(why) = no_ebpf {
        return run_procfs(args, extra, target, command, &why).await;
    }
    let pid = target.pid();
    let markers = match markers_for(&args, &target) {
        Ok(m) => m,
        Err(e) => {
            target.signal(libc::SIGKILL);
            return Err(e);
        }
    };
    let mut probes = match Probes::attach(&AttachOptions { target: pid, markers }) {
        Ok(p) => p,
        Err(e @ (ProbeError::Permission(_) | ProbeError::Load(_))) if args.fallback => {
            return run_procfs(args, extra, target, command, &e.to_string()).await;
        }
        Err(e) => {
            // A spawned child is still blocked before exec: end it.
            target.signal(libc::SIGKILL);
            return Err(e.into());
        }
    };
    let marker_desc = match &probes.markers {
        Some(MarkerKind::Engine { exe }) => format!("engine markers in {exe}"),
        Some(MarkerKind::Symbol { symbol, path }) => format!("calls of {symbol} in {path}"),
        None if args.window.is_some() => "fixed windows".to_string(),
        None => "none (whole-run totals only; use --window or --token-symbol)".to_string(),
    };
    eprintln!(
        "observer: pid {pid}: {} probes attached; tokens: {marker_desc}{}",
        probes.attached.len(),
        if probes.missing.is_empty() {
            String::new()
        } else {
            format!("; not attached: {}", probes.missing.join(", "))
        }
    );
    let ring = probes.take_events()?;
    // Token records are polled; only an `exec` of the target wakes us (to
    // attach the new program's markers before its first token).
    // SAFETY: the ring buffer owns its fd and outlives the registration.
    let mut ring =
        unsafe { AsyncFd::register(ring) }.map_err(|e| e.into_parts().1).context("registering the ring buffer")?;
    let default_kind = match probes.markers {
        Some(MarkerKind::Symbol { .. }) => StepKind::Call,
        Some(MarkerKind::Engine { .. }) => StepKind::Generate,
        None => StepKind::Window,
    };
    let mut asm = Assembler::new(default_kind);
    let mut records = Kept::new(args.keep_tokens);
    let mut resid = residency_sampler(&args, &command, &target, &mut probes);
    asm.churn = resid.as_ref().is_some_and(|r| r.churn().is_some());
    let mut sinks = sinks(&args, extra);
    let header = header::build("ebpf", pid, &command, probes.attached.clone(), args.model.as_deref());
    emit(&mut sinks, &Event::Header(header))?;
    // The kernel side never wakes us (see observer-ebpf/src/marks.rs): poll.
    let mut poll = interval(args.poll);
    let mut sampler = interval(args.sample_interval);
    let use_windows = args.window.is_some() && probes.markers.is_none();
    let mut ticker = interval(args.window.unwrap_or(Duration::from_secs(3600)));

    // A spawned wrapper (sh -c, env, …) without markers: stop it at each
    // exec until a program with markers runs, so no token is missed. An
    // attached process is only held when asked (its parent sees it stop).
    let mut stop_on_exec =
        (target.is_spawned() || args.follow_exec) && probes.markers.is_none() && args.token_symbol.is_none();
    probes.set_stop_on_exec(pid, stop_on_exec)?;
    target.release()?;
    let start = Instant::now();
    if use_windows {
        ticker.tick().await; // the first tick is immediate
        let now = seed::mono_ns();
        asm.window(Snapshot { ts: now, index: 0, threads: probes.snapshot(now)?, engine: None, lost: 0, churn: None });
    }

    let mut stop = Stopper::default();
    let ending = loop {
        tokio::select! {
            e = target.wait() => break Some(e?),
            r = stop_requested(&args.stop) => { r?; if stop.signal(&target) { break None; } }
            _ = stop.deadline(), if stop.pending() => stop.expired(&target),
            _ = poll.tick() => drain(ring.get_mut(), &mut asm, &mut resid, &mut records, &mut sinks)?,
            guard = ring.readable_mut() => {
                let mut guard = guard.context("waiting on the ring buffer")?;
                drain(guard.get_inner_mut(), &mut asm, &mut resid, &mut records, &mut sinks)?;
                guard.clear_ready();
                if std::mem::take(&mut asm.exec_seen) {
                    after_exec(&mut probes, pid)?;
                    if stop_on_exec {
                        // The kernel side stopped it at exec; markers are in place now.
                        // SAFETY: plain kill(2) of the process we are observing.
                        unsafe { libc::kill(pid as libc::pid_t, libc::SIGCONT) };
                        stop_on_exec = probes.markers.is_none();
                        probes.set_stop_on_exec(pid, stop_on_exec)?;
                    }
                }
            }
            _ = ticker.tick(), if use_windows => {
                let now = seed::mono_ns();
                let snap = Snapshot { ts: now, index: 0, threads: probes.snapshot(now)?, engine: None, lost: 0, churn: None };
                if let Some(t) = asm.window(snap) { tokens(vec![t], &mut resid, &mut records, &mut sinks)?; }
            }
            _ = sampler.tick() => {
                let now = seed::mono_ns();
                emit(&mut sinks, &Event::Process(procsample::sample(pid, now)))?;
                emit(&mut sinks, &Event::Histograms(probes.histograms_event(now)?))?;
                emit(&mut sinks, &Event::Health(health(&probes, asm.malformed, now)?))?;
            }
        }
    };
    let duration_ns = start.elapsed().as_nanos() as u64;
    // The records still in the ring: when the target has exited, a residency
    // sample now would describe a process that is gone, so they carry none.
    let ended = ending.is_some();
    let mut late_resid = if ended { None } else { resid.take() };
    drain(ring.get_mut(), &mut asm, &mut late_resid, &mut records, &mut sinks)?;
    let now = seed::mono_ns();
    emit(&mut sinks, &Event::Histograms(probes.histograms_event(now)?))?;
    emit(&mut sinks, &Event::Health(health(&probes, asm.malformed, now)?))?;
    let end_ns = seed::mono_ns();
    if use_windows {
        let snap =
            Snapshot { ts: end_ns, index: 0, threads: probes.snapshot(end_ns)?, engine: None, lost: 0, churn: None };
        if let Some(t) = asm.window(snap) {
            tokens(vec![t], &mut late_resid, &mut records, &mut sinks)?;
        }
    }
    drop(late_resid);
    drop(resid);

    let rows = probes.thread_faults()?;
    let states = probes.snapshot(end_ns)?;
    let hists = probes.hists()?;
    let devices = probes.devices()?;
    let bpf_stats = probes.bpf_stats();
    let lost = probes.counter(GlobalCounter::LostEvents)? + asm.malformed;
    let attached = probes.attached.clone();
    drop(ring);

    let exit_code = match ending {
        Some(Ending::Exited(c)) => Some(c),
        _ => None,
    };
    emit(&mut sinks, &Event::End(RunEnd { mono_ns: end_ns, exit_code, lost_events: lost }))?;
    drop(sinks);
    let mut summary = Summary::build(TargetInfo { pid, command, exit_code }, duration_ns, attached, &rows, lost);
    summary.tokens_not_kept = records.dropped;
    summary.add_attribution(&states, &hists, records.records);
    summary.devices = devices.iter().map(|(d, io)| observer::analysis::report::DeviceRow::new(*d, io)).collect();
    summary.bpf_run_ns = bpf_stats.map(|s| s.0);
    summary.bpf_run_count = bpf_stats.map(|s| s.1);
    finish(&args, &summary)?;
    if let Some(line) = target.oom_report(exit_code) {
        eprintln!("observer: {line}");
    }
    // Detaching waits for the kernel (see `bpf::detach_tracepoints`): after
    // the summary is out.
    drop(probes);
    Ok(exit_code.unwrap_or(0))
}

fn health(probes: &Probes, malformed: u64, mono_ns: u64) -> Result<ObserverHealth> {
    let stats = probes.bpf_stats();
    Ok(ObserverHealth {
        mono_ns,
        lost_events: probes.counter(GlobalCounter::LostEvents)? + malformed,
        probes_attached: probes.attached.len() as u32,
        probes_missing: probes.missing.len() as u32,
        bpf_run_ns: stats.map(|s| s.0),
        bpf_run_count: stats.map(|s| s.1),
    })
}

/// The target exec'd: attach the markers of its new program, when it has them.
fn after_exec(probes: &mut Probes, pid: u32) -> Result<()> {
    let Ok(exe) = std::fs::read_link(format!("/proc/{pid}/exe")) else { return Ok(()) };
    if probes.attach_after_exec(&exe, pid)?.is_some() {
        eprintln!("observer: pid {pid} exec'd {}: engine markers attached", exe.display());
    }
    Ok(())
}

fn interval(d: Duration) -> tokio::time::Interval {
    let mut i = tokio::time::interval(d);
    i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    i
}

fn sinks(args: &RunArgs, extra: ExtraSinks) -> Vec<Box<dyn Sink>> {
    let mut v: Vec<Box<dyn Sink>> = vec![Box::new(Live { every: args.every, header_done: false })];
    v.extend(extra);
    v
}

/// Print the summary; write it as JSON when asked.
fn finish(args: &RunArgs, summary: &Summary) -> Result<()> {
    summary.print(&mut std::io::stderr().lock())?;
    if let Some(path) = &args.json {
        let f = std::fs::File::create(path).with_context(|| format!("cannot create JSON file {}", path.display()))?;
        serde_json::to_writer_pretty(std::io::BufWriter::new(f), summary)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// Ctrl-C / SIGTERM handling shared by both modes: a spawned child gets
/// SIGINT and a grace period (a second signal, or the end of the grace
/// period, kills it); an attached process is left alone and we stop at once.
#[derive(Debug, Default)]
struct Stopper {
    since: Option<Instant>,
}

impl Stopper {
    /// A stop signal arrived; true when the loop should end now.
    fn signal(&mut self, target: &Target) -> bool {
        if !target.is_spawned() {
            return true;
        }
        if self.since.is_some() {
            target.signal(libc::SIGKILL);
        } else {
            target.signal(libc::SIGINT);
            self.since = Some(Instant::now());
        }
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
        eprintln!("observer: target still running {} s after SIGINT; killing it", CHILD_GRACE.as_secs());
        target.signal(libc::SIGKILL);
        self.since = Some(Instant::now() + Duration::from_secs(3600));
    }
}

/// The procfs fallback (`observer::capture::procfs`): fixed windows, what procfs can
/// measure, everything else `None`.
async fn run_procfs(
    args: RunArgs,
    extra: ExtraSinks,
    mut target: Target,
    command: Vec<String>,
    why: &str,
) -> Result<i32> {
    let pid = target.pid();
    let window = args.window.unwrap_or(Duration::from_secs(1));
    eprintln!(
        "observer: pid {pid}: no eBPF ({why}); procfs fallback every {} ms: measuring {}",
        window.as_millis(),
        procfs::MEASURED
    );
    let mut sinks = sinks(&args, extra);
    emit(&mut sinks, &Event::Header(header::build("procfs", pid, &command, Vec::new(), args.model.as_deref())))?;
    let mut asm = Assembler::new(StepKind::Window);
    let mut records = Kept::new(args.keep_tokens);
    let mut ticker = interval(window);
    let mut sampler = interval(args.sample_interval);
    target.release()?;
    let start = Instant::now();
    ticker.tick().await;
    let snap = |asm: &mut Assembler| {
        let now = seed::mono_ns();
        asm.window(Snapshot { ts: now, index: 0, threads: procfs::snapshot(pid), engine: None, lost: 0, churn: None })
    };
    snap(&mut asm);
    let mut stop = Stopper::default();
    let ending = loop {
        tokio::select! {
            e = target.exited() => {
                e?;
                // The last, partial window: a spawned child is still a
                // zombie here, with its final counters.
                if let Some(mut t) = snap(&mut asm) {
                    procfs::mark_unmeasured(&mut t);
                    tokens(vec![t], &mut None, &mut records, &mut sinks)?;
                }
                break Some(target.reap()?);
            }
            r = stop_requested(&args.stop) => { r?; if stop.signal(&target) { break None; } }
            _ = stop.deadline(), if stop.pending() => stop.expired(&target),
            _ = ticker.tick() => {
                if let Some(mut t) = snap(&mut asm) {
                    procfs::mark_unmeasured(&mut t);
                    tokens(vec![t], &mut None, &mut records, &mut sinks)?;
                }
            }
            _ = sampler.tick() => emit(&mut sinks, &Event::Process(procsample::sample(pid, seed::mono_ns())))?,
        }
    };
    let duration_ns = start.elapsed().as_nanos() as u64;
    let exit_code = match ending {
        Some(Ending::Exited(c)) => Some(c),
        _ => None,
    };
    emit(&mut sinks, &Event::End(RunEnd { mono_ns: seed::mono_ns(), exit_code, lost_events: 0 }))?;
    drop(sinks);
    let mut summary = Summary::build(TargetInfo { pid, command, exit_code }, duration_ns, Vec::new(), &[], 0);
    summary.mode = "procfs".into();
    summary.totals = None;
    summary.majflt_hist = None;
    summary.minflt_hist = None;
    summary.tokens_not_kept = records.dropped;
    summary.add_attribution(&[], &[], records.records);
    finish(&args, &summary)?;
    if let Some(line) = target.oom_report(exit_code) {
        eprintln!("observer: {line}");
    }
    Ok(exit_code.unwrap_or(0))
}

/// The token records kept for the summary: all of them, or the newest
/// `cap` (a standing `observer serve` must not grow without bound).
#[derive(Debug)]
struct Kept {
    records: Vec<TokenRecord>,
    cap: usize,
    dropped: u64,
}

impl Kept {
    fn new(cap: usize) -> Self {
        Kept { records: Vec::new(), cap: cap.max(1), dropped: 0 }
    }
    fn push(&mut self, t: TokenRecord) {
        if self.records.len() >= self.cap {
            let n = self.records.len().div_ceil(2);
            self.records.drain(..n);
            self.dropped += n as u64;
        }
        self.records.push(t);
    }
}

/// Emit a batch of token records. With a residency sampler, the last record
/// of the batch carries a residency sample (taken now; the file scan is rate
/// limited by the sampler), the others none: tokens are read in batches.
fn tokens(
    mut batch: Vec<TokenRecord>,
    resid: &mut Option<Sampler>,
    records: &mut Kept,
    sinks: &mut [Box<dyn Sink>],
) -> Result<()> {
    if let (Some(s), Some(last)) = (resid.as_mut(), batch.last_mut()) {
        match s.sample() {
            Ok(x) => last.residency = Some(x.residency),
            Err(e) => {
                eprintln!("observer: residency sampling stopped: {e}");
                *resid = None;
            }
        }
    }
    for t in batch {
        emit(sinks, &Event::Token(t.clone()))?;
        records.push(t);
    }
    Ok(())
}

fn drain(
    ring: &mut aya::maps::RingBuf<aya::maps::MapData>,
    asm: &mut Assembler,
    resid: &mut Option<Sampler>,
    records: &mut Kept,
    sinks: &mut [Box<dyn Sink>],
) -> Result<()> {
    let mut batch = Vec::new();
    while let Some(item) = ring.next() {
        if let Some(t) = asm.push(&item) {
            batch.push(t);
        }
    }
    if batch.is_empty() { Ok(()) } else { tokens(batch, resid, records, sinks) }
}

/// The residency sampler for the target's model file, when there is one (a
/// GGUF named by `--model` or on the command line), with page-cache churn
/// counted in the kernel. Problems are reported in one line, never fatal.
fn residency_sampler(args: &RunArgs, command: &[String], target: &Target, probes: &mut Probes) -> Option<Sampler> {
    let model = args.model.clone().or_else(|| header::model_from_command(command).map(PathBuf::from))?;
    // A relative path is relative to the target's working directory.
    let model = if model.is_relative() {
        std::fs::read_link(format!("/proc/{}/cwd", target.pid())).map(|d| d.join(&model)).unwrap_or(model)
    } else {
        model
    };
    let mut s = match Sampler::new(&model, Some(target.pid())) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("observer: residency not measured ({}): {e}", model.display());
            return None;
        }
    };
    match args.residency_interval {
        Some(d) => s.set_scan_interval(d),
        None => {
            s.set_scan_interval(Duration::from_secs(1));
            s.set_scan_budget(Some(observer::capture::residency::SCAN_BUDGET));
        }
    }
    if let Err(e) = s.enable_churn(probes.ebpf_mut()) {
        eprintln!("observer: page-cache churn not measured: {e}");
    }
    Some(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use observer_common::model::{Components, Counters};

    fn rec(seq: u64) -> TokenRecord {
        TokenRecord {
            seq,
            index: Some(seq),
            kind: StepKind::Generate,
            n_tokens: 1,
            start_ns: 0,
            wall_ns: 1,
            components: Components::default(),
            residual_ns: 0,
            counters: Counters::default(),
            engine_compute_ns: None,
            threads: Vec::new(),
            engine: None,
            residency: None,
            lost_events: 0,
        }
    }

    #[test]
    fn kept_tokens_are_bounded_and_the_rest_counted() {
        let mut k = Kept::new(10);
        for i in 0..25 {
            k.push(rec(i));
        }
        assert!(k.records.len() <= 10);
        assert_eq!(k.records.len() as u64 + k.dropped, 25);
        assert_eq!(k.records.last().unwrap().seq, 24, "the newest are kept");
        let mut all = Kept::new(usize::MAX);
        for i in 0..25 {
            all.push(rec(i));
        }
        assert_eq!((all.records.len(), all.dropped), (25, 0));
    }

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("2s").unwrap(), Duration::from_secs(2));
        assert_eq!(parse_duration("1.5").unwrap(), Duration::from_millis(1500));
        assert!(parse_duration("0s").is_err());
        assert!(parse_duration("5 parsecs").is_err());
    }
}
