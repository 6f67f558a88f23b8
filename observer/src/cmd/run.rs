//! `observer run`: the arguments of one observation [`Session`] and of its
//! outputs (per-token lines, the end-of-run summary and its JSON, a trace, a
//! Prometheus endpoint). `record`, `tui` and `serve` take the same arguments
//! and call [`observe`] with their own sinks added.

use std::{ffi::OsString, path::PathBuf, time::Duration};

use super::parse_duration;
use anyhow::{Context, Result, bail};
use observer::{
    capture::{
        bpf::{EngineChoice, FaultClose, FaultTiming, SchedHooks},
        session::{Mode, Outcome, Session, SessionOptions, Stop, TargetSpec, TokenSymbol},
    },
    output::{Output, Policy},
    sinks::{Sink, lines::Lines, prometheus, summary::SummarySink, trace_writer::TraceWriter},
};

#[derive(Debug, Clone, clap::Args)]
pub struct RunArgs {
    /// Attach to this running process (all its threads) instead of spawning one.
    #[arg(long, conflicts_with = "command")]
    pub pid: Option<u32>,
    /// Also write the summary and every token record as JSON to this file.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Also record the model stream to this trace file (see `observer record`).
    #[arg(long, value_name = "FILE")]
    pub record: Option<PathBuf>,
    /// Replace output files (`--json`, the trace) that exist already.
    #[arg(long)]
    pub force: bool,
    /// Token boundaries from calls of this function (uprobe at entry, uretprobe
    /// at return), e.g. `llama_decode:/usr/lib/libllama.so`. Default: the
    /// engine's marker symbols when the target has them.
    #[arg(long, value_name = "SYM[:LIB]")]
    pub token_symbol: Option<String>,
    /// Without --token-symbol, which engine's token boundaries to look for:
    /// `auto` (our engine's markers, else the first engine profile the target
    /// matches: llama.cpp's decode calls in libllama), a profile's name
    /// (`llama.cpp`), or `none`.
    #[arg(long, default_value = "auto", value_name = "ENGINE", value_parser = EngineChoice::parse)]
    pub engine: EngineChoice,
    /// Fixed time windows instead of tokens (e.g. `250ms`, `1s`).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub window: Option<Duration>,
    /// The model file (GGUF) the target runs; default: the `--model`/`-m`
    /// argument or `*.gguf` file of the target's command line.
    #[arg(long, value_name = "FILE")]
    pub model: Option<PathBuf>,
    /// Rescan the model file's residency (mincore, pagemap) at most this often.
    /// Default: every second, and never for more than 0.5 % of one CPU; a
    /// given interval is kept whatever the scans cost. Either way a scan is
    /// skipped while the model's page cache has not changed (up to 30 s).
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
    /// done for a spawned command's own process. Its parent will see it stop
    /// briefly (some parents, like `perf stat`, take a child's stop for its end).
    #[arg(long, requires = "pid")]
    pub follow_exec: bool,
    /// Do not observe the processes a spawned command starts (by default its
    /// descendants are observed too, as `perf` does).
    #[arg(long, conflicts_with = "pid")]
    pub no_children: bool,
    /// With --pid: observe the processes it starts from now on, too.
    #[arg(long, requires = "pid")]
    pub children: bool,
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
    /// Turn the kernel's BPF run-time statistics on while attached: each program's kernel-side
    /// cost (`bpf_programs` in the summary, `moe_observer_bpf_run_seconds_total`). They cost
    /// every run of every program two clock reads (a fifth of the observer's overhead in a
    /// fault storm), so they are off unless asked for here or already on
    /// (`kernel.bpf_stats_enabled=1`, then they are read).
    #[arg(long)]
    pub bpf_stats: bool,
    /// Which kernel event closes a page fault: `memcg` (the tracepoint
    /// `memcg:count_memcg_events`, Linux >= 6.14: no perf overflow path per fault), `perf` (the
    /// perf software events `minor-faults`/`major-faults`), or `auto` (memcg where the kernel has
    /// it). They count the same faults but for rare edge cases (README, "How a fault is timed").
    #[arg(long, value_enum, default_value_t = FaultClose::Auto, value_name = "EVENT")]
    pub fault_close: FaultClose,
    /// Which programs follow the scheduler (switches, wakeups, runtime updates): `raw` (raw
    /// tracepoints, Linux >= 5.18 with BTF: no record built for every event on the host),
    /// `tracepoint` (the `sched:*` tracepoints), or `auto` (raw where the kernel allows it;
    /// `observer doctor` says).
    #[arg(long, value_enum, default_value_t = SchedHooks::Auto, value_name = "HOOKS")]
    pub sched_hooks: SchedHooks,
    /// Time every page fault, also in fault storms, where by default 1 user-mode minor fault in 8
    /// is timed and stands for the others (counts stay exact; README, "Fault storms").
    #[arg(long)]
    pub time_every_fault: bool,
    /// For `cargo xtask bench storm` (its floor, D): the fault hooks run a program that returns at
    /// once, so no fault is counted or timed and the run costs the target only the kernel's
    /// dispatch of those hooks.
    #[arg(long, hide = true, conflicts_with = "time_every_fault")]
    pub fault_dispatch_only: bool,
    /// Print every Nth token line while running (0: none). Lines that stderr does not take fast
    /// enough are skipped, and a note counts them.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub every: u64,
    /// Serve Prometheus/OpenMetrics metrics at http://ADDR/metrics while
    /// running (`PORT` or `:PORT` listen on 127.0.0.1; `HOST:PORT`).
    #[arg(long, value_name = "ADDR")]
    pub metrics_addr: Option<String>,
    /// The command to spawn and observe.
    #[arg(last = true, value_name = "CMD")]
    pub command: Vec<OsString>,
    /// Observe a target whose token boundaries cannot be found, without
    /// tokens (`serve`: it serves what works and says what does not).
    #[arg(skip)]
    pub without_tokens_ok: bool,
}

impl RunArgs {
    /// The session these arguments ask for.
    pub fn session_options(&self) -> Result<SessionOptions> {
        let target = match (self.pid, self.command.is_empty()) {
            (Some(pid), _) => TargetSpec::Attach { pid, follow_exec: self.follow_exec },
            (None, false) => TargetSpec::Spawn { command: self.command.clone(), cgroup: self.cgroup.clone() },
            (None, true) => bail!("nothing to observe: give `--pid PID` or `-- CMD [ARGS…]`"),
        };
        let mode = match (self.procfs, self.fallback) {
            (true, _) => Mode::Procfs,
            (false, true) => Mode::EbpfOrProcfs,
            (false, false) => Mode::Ebpf,
        };
        let token_symbol = self.token_symbol.as_deref().map(|spec| match spec.split_once(':') {
            Some((symbol, lib)) => TokenSymbol { symbol: symbol.into(), library: Some(lib.into()) },
            None => TokenSymbol { symbol: spec.into(), library: None },
        });
        Ok(SessionOptions {
            target,
            mode,
            token_symbol,
            engine: self.engine,
            follow_children: if self.pid.is_some() { self.children } else { !self.no_children },
            window: self.window,
            model: self.model.clone(),
            residency_interval: self.residency_interval,
            sample_interval: self.sample_interval,
            poll: self.poll,
            without_tokens_ok: self.without_tokens_ok,
            bpf_stats: self.bpf_stats,
            fault_close: self.fault_close,
            sched_hooks: self.sched_hooks,
            fault_timing: match (self.time_every_fault, self.fault_dispatch_only) {
                (_, true) => FaultTiming::DispatchOnly,
                (true, false) => FaultTiming::EveryFault,
                (false, false) => FaultTiming::Sampled,
            },
        })
    }
}

pub async fn run(args: RunArgs) -> Result<i32> {
    let stop = Stop::install()?;
    observe(args, Vec::new(), &stop).await
}

/// One session as `observer run` makes it, with `extra` sinks (recorder, TUI,
/// exporter) fed the same stream. Returns the target's exit code (0 when
/// there is none) once the probes are detached.
pub async fn observe(args: RunArgs, extra: Vec<Box<dyn Sink>>, stop: &Stop) -> Result<i32> {
    Ok(observe_session(args, extra, stop).await?.detached().await.unwrap_or(0))
}

/// [`observe`], returning as soon as the sinks have had the end, while the
/// probes may still be detaching.
pub async fn observe_session(args: RunArgs, extra: Vec<Box<dyn Sink>>, stop: &Stop) -> Result<Outcome> {
    let opts = args.session_options()?;
    // Every output is checked (and its file created) before the run.
    let inputs: Vec<PathBuf> = args.model.iter().cloned().collect();
    let policy = Policy { force: args.force, inputs: &inputs };
    if let (Some(a), Some(b)) = (&args.json, &args.record)
        && a == b
    {
        bail!("--json and the trace are both {}; give two files", a.display());
    }
    let json = args.json.as_deref().map(|p| Output::create(p, policy)).transpose().context("--json")?;
    let trace = args.record.as_deref().map(|p| Output::create(p, policy)).transpose().context("the trace file")?;
    let mut sinks: Vec<Box<dyn Sink>> = vec![Box::new(Lines::new(args.every))];
    if let Some(addr) = &args.metrics_addr {
        sinks.push(Box::new(prometheus::run_sink(addr)?));
    }
    if let Some(out) = trace {
        sinks.push(Box::new(TraceWriter::to_output(out)?));
    }
    sinks.extend(extra);
    // Last: the table comes after every other sink has had the end.
    sinks.push(Box::new(SummarySink::new(args.keep_tokens, json)));
    Session::start(opts, stop)?.run(&mut sinks).await
}
