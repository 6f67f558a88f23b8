//! `observer run`: the arguments of one observation [`Session`] and of its
//! outputs (per-token lines, the end-of-run summary and its JSON, a trace, a
//! Prometheus endpoint). `record`, `tui` and `serve` take the same arguments
//! and call [`observe`] with their own sinks added.

use std::{ffi::OsString, path::PathBuf, time::Duration};

use anyhow::{Context, Result, bail};
use observer::{
    capture::session::{Mode, Session, SessionOptions, Stop, TargetSpec, TokenSymbol},
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
    /// Token boundaries from calls of this function (uprobe at entry, uretprobe
    /// at return), e.g. `llama_decode:/usr/lib/libllama.so`. Default: the
    /// engine's marker symbols when the target has them.
    #[arg(long, value_name = "SYM[:LIB]")]
    pub token_symbol: Option<String>,
    /// Fixed time windows instead of tokens (e.g. `250ms`, `1s`).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub window: Option<Duration>,
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
            window: self.window,
            model: self.model.clone(),
            residency_interval: self.residency_interval,
            sample_interval: self.sample_interval,
            poll: self.poll,
        })
    }
}

pub async fn run(args: RunArgs) -> Result<i32> {
    let stop = Stop::install()?;
    observe(args, Vec::new(), &stop).await
}

/// One session as `observer run` makes it, with `extra` sinks (recorder, TUI,
/// exporter) fed the same stream. Returns the target's exit code (0 when
/// there is none).
pub async fn observe(args: RunArgs, extra: Vec<Box<dyn Sink>>, stop: &Stop) -> Result<i32> {
    let opts = args.session_options()?;
    let mut sinks: Vec<Box<dyn Sink>> = vec![Box::new(Lines::new(args.every))];
    if let Some(addr) = &args.metrics_addr {
        sinks.push(Box::new(prometheus::run_sink(addr)?));
    }
    if let Some(p) = &args.record {
        sinks.push(Box::new(TraceWriter::create(p).context("cannot create the trace file")?));
    }
    sinks.extend(extra);
    // Last: the table comes after every other sink has had the end.
    sinks.push(Box::new(SummarySink::new(args.keep_tokens, args.json.clone())));
    let outcome = Session::start(opts, stop)?.run(&mut sinks).await?;
    Ok(outcome.exit_code.unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("2s").unwrap(), Duration::from_secs(2));
        assert_eq!(parse_duration("1.5").unwrap(), Duration::from_millis(1500));
        assert!(parse_duration("0s").is_err());
        assert!(parse_duration("5 parsecs").is_err());
    }
}
