//! `observer serve`: a standing Prometheus exporter.
//!
//! - `--pid PID` or `-- CMD…`: observe that one target (as `observer run`
//!   does, same options); when it ends, keep serving its final values until
//!   SIGINT/SIGTERM, so that the last scrape sees the whole run.
//! - `--name NAME`: follow a program across restarts: wait for a process whose
//!   name is NAME (its `comm`, as `ps` and `pgrep` show it, or the file name of
//!   its executable), observe it until it exits, then wait for the next one.
//!   One process at a time: with several, the oldest; the others are picked up
//!   as it ends. A process that cannot be observed (it vanished, or attaching
//!   failed) is reported and skipped while it lives.
//! - `--discover`: follow the engines on this host by themselves
//!   ([`observer::capture::discover`]: processes mapping a `.gguf` file or
//!   carrying the token markers), all at once: each discovered process gets
//!   its own session as soon as a scan finds it, and its series carry its
//!   labels (engine, model, container: `vocab::TARGET_LABELS`), so the targets
//!   are exported side by side. `--name` narrows it to processes called NAME;
//!   `--max-targets` bounds the label sets, and the targets left alone are
//!   reported in the log and in `/healthz`. A target found before it mapped
//!   its model is relabelled once it has (the `model` label is filled in:
//!   `MetricsSink::follow_labels`). `--json` and `--record` name one file, so
//!   they are refused here.
//! - `--config FILE`: the same flags from a TOML file ([`super::config`]).
//!
//! Every `observer run` option applies to each target lifetime (`--json FILE`
//! is rewritten at the end of each; token lines are off unless `--every N`).
//!
//! The endpoint (default [`DEFAULT_ADDR`]) is up from the start and stays up
//! across targets; counters keep growing across them (`runs_total` counts
//! targets, `target_up` says whether one is observed now). Each target
//! lifetime is one session (`observe`, as `observer run`) feeding the
//! exporter's sink. SIGINT/SIGTERM end the session and this loop alike (one
//! handler: `Stop`).

use std::{
    collections::{HashMap, HashSet},
    sync::Arc,
    time::Duration,
};

use anyhow::{Result, bail};
use observer::{
    capture::{discover::Discovery, session::Stop},
    sinks::prometheus::{Endpoint, Exporter, Labels, target_labels},
};

use super::run::{RunArgs, observe, observe_session};

/// Where `serve` listens without `--metrics-addr`.
pub const DEFAULT_ADDR: &str = "127.0.0.1:9977";
/// How often `--name` looks for a new process.
const SCAN_INTERVAL: Duration = Duration::from_millis(100);

#[derive(Debug, clap::Args)]
#[command(mut_arg("every", |a| a.default_value("0")))]
#[command(mut_arg("metrics_addr", |a| a
    .default_value(DEFAULT_ADDR)
    .visible_alias("web.listen-address")
    .help("Serve Prometheus/OpenMetrics metrics at http://ADDR/metrics, and /healthz (`PORT` or `:PORT` listen on 127.0.0.1; `HOST:PORT`; `0.0.0.0:9977` for a fleet's Prometheus). `--web.listen-address` as in node_exporter")))]
#[command(group(clap::ArgGroup::new("target").required(true).multiple(true).args(["name", "discover", "pid", "command"])))]
pub struct ServeArgs {
    /// Follow every process called NAME (its comm, or its executable's file
    /// name) as it starts and exits, re-attaching after each restart.
    /// With --discover: only the discovered processes called NAME.
    #[arg(long, value_name = "NAME", conflicts_with_all = ["pid", "command"])]
    pub name: Option<String>,
    /// Follow the engines on this host by themselves: processes that map a
    /// `.gguf` file or whose executable defines the engine's token markers
    /// (labels: engine, model file name, container id).
    #[arg(long, conflicts_with_all = ["pid", "command"])]
    pub discover: bool,
    /// With --discover: the most distinct (engine, model, container) label
    /// sets followed; targets beyond are reported and left alone.
    #[arg(long, value_name = "N", default_value_t = 64, requires = "discover")]
    pub max_targets: usize,
    /// Take flags from a TOML file whose keys are these flags' names
    /// (`metrics-addr = "0.0.0.0:9977"`); the command line wins.
    #[arg(long, value_name = "FILE")]
    pub config: Option<std::path::PathBuf>,
    #[command(flatten)]
    pub run: RunArgs,
}

/// Token records `serve` keeps per target for its end-of-target summary.
const SERVE_KEEP_TOKENS: usize = 100_000;

pub async fn serve(args: ServeArgs) -> Result<i32> {
    // clap made sure exactly one of --name, --pid and CMD is given.
    let ServeArgs { name, discover, max_targets, mut run, config: _ } = args;
    if let Some(n) = &name
        && (n.is_empty() || n.contains('/'))
    {
        bail!("--name {n:?}: give a process name as `ps -o comm` shows it (no path)");
    }
    // Not for each session: this endpoint outlives them.
    let addr = run.metrics_addr.take().unwrap_or_else(|| DEFAULT_ADDR.to_string());
    // A standing exporter keeps only recent tokens for each target's summary.
    run.keep_tokens = run.keep_tokens.min(SERVE_KEEP_TOKENS);
    // A daemon serves what works: a target without its token boundaries is
    // still observed (its memory, faults' latencies), and that is said.
    run.without_tokens_ok = true;
    if discover && (run.json.is_some() || run.record.is_some()) {
        bail!("--json and --record write one file per target: not with --discover, which observes many at once");
    }
    let ex = if discover { Exporter::per_target() } else { Exporter::new() };
    let endpoint = Endpoint::start(&addr, Arc::clone(&ex))?;
    let stop = Stop::install()?;
    log::info!("serve: metrics at http://{}/metrics", endpoint.local_addr());
    match name {
        _ if discover => follow_discovered(max_targets, name.as_deref(), run, &ex, &stop).await,
        Some(name) => follow(&name, run, &ex, &stop).await,
        None => {
            observe(run, vec![Box::new(ex.sink())], &stop).await?;
            if !stop.signalled() {
                log::info!("serve: the target ended; serving its final values until SIGINT/SIGTERM");
                stop.signal_received().await;
            }
        }
    }
    drop(endpoint);
    Ok(0)
}

async fn follow(name: &str, mut run: RunArgs, ex: &Arc<Exporter>, stop: &Stop) {
    let mut skip: HashSet<u32> = HashSet::new();
    log::info!("serve: waiting for a process called {name:?}");
    loop {
        let pid = loop {
            if stop.signalled() {
                return;
            }
            skip.retain(|p| procfs::process::Process::new(*p as i32).is_ok());
            if let Some(p) = find_by_name(name, &skip) {
                break p;
            }
            tokio::select! {
                _ = tokio::time::sleep(SCAN_INTERVAL) => {}
                _ = stop.signal_received() => return,
            }
        };
        let mut args = run.clone();
        args.pid = Some(pid);
        log::info!("serve: {name:?} is pid {pid}: observing it");
        // The next target may start while this one's probes detach.
        match observe_session(args, vec![Box::new(ex.sink())], stop).await {
            Ok(_) => {
                log::info!("serve: pid {pid} ended; waiting for the next {name:?}");
                // The outputs (`--json`, a trace) are now ours: the next target rewrites them.
                run.force = true;
            }
            Err(e) => {
                log::warn!("serve: pid {pid}: {e:#}; skipping it");
                skip.insert(pid);
            }
        }
        if stop.signalled() {
            return;
        }
    }
}

/// `--discover`: observe every discovered target at once, each in its own
/// session with its labels, until SIGINT/SIGTERM (then wait for the
/// sessions to end).
async fn follow_discovered(limit: usize, name: Option<&str>, run: RunArgs, ex: &Arc<Exporter>, stop: &Stop) {
    tokio::task::LocalSet::new().run_until(discover_loop(limit, name, run, ex, stop)).await
}

/// The outcome of one discovered target's session.
type Done = ((u32, u64), &'static str, Result<i32>);
/// The targets observed now, by (pid, start time), with where their sink takes its labels from.
type Observing = HashMap<(u32, u64), tokio::sync::watch::Sender<Labels>>;

async fn discover_loop(limit: usize, name: Option<&str>, run: RunArgs, ex: &Arc<Exporter>, stop: &Stop) {
    let mut discovery = Discovery::new(limit);
    // Targets observed now, and those that could not be (while they live).
    let mut observing = Observing::new();
    let mut skip: HashSet<(u32, u64)> = HashSet::new();
    let mut sessions: tokio::task::JoinSet<Done> = tokio::task::JoinSet::new();
    let mut reported_drops = 0;
    log::info!("serve: discovering engines (processes mapping a .gguf file or carrying the token markers)");
    let ended =
        |done: Result<Done, tokio::task::JoinError>, observing: &mut Observing, skip: &mut HashSet<(u32, u64)>| {
            let Ok((key, engine, res)) = done else { return };
            observing.remove(&key);
            match res {
                Ok(_) => log::info!("serve: pid {} ended", key.0),
                Err(e) => {
                    log::warn!("serve: pid {}: {e:#}; skipping it", key.0);
                    ex.degrade(format!("a {engine} target could not be observed (see the log)"));
                    skip.insert(key);
                }
            }
        };
    // Whether the last scan could not list the processes (said once, until one can).
    let mut unlisted = false;
    while !stop.signalled() {
        let live = match discovery.scan() {
            Ok(live) => {
                if std::mem::take(&mut unlisted) {
                    log::info!("serve: discovery lists the processes again");
                }
                live
            }
            Err(e) => {
                if !std::mem::replace(&mut unlisted, true) {
                    log::warn!("serve: discovery: {e}; no engine can be found until it can (is procfs mounted here?)");
                    ex.degrade(format!("discovery: {e}"));
                }
                Vec::new()
            }
        };
        if discovery.dropped() > reported_drops {
            reported_drops = discovery.dropped();
            ex.degrade(format!("discovery: {reported_drops} target(s) beyond --max-targets {limit} not followed"));
        }
        if !unlisted {
            skip.retain(|k| live.iter().any(|t| (t.pid, t.start) == *k));
        }
        for t in live {
            let key = (t.pid, t.start);
            let l = t.labels;
            let labels = target_labels(l.engine, &l.model, &l.container);
            if let Some(tx) = observing.get(&key) {
                if *tx.borrow() != labels {
                    log::info!(
                        "serve: pid {} mapped {:?}: its series are labelled model={:?} from now on",
                        t.pid,
                        l.model,
                        l.model
                    );
                    tx.send_replace(labels);
                }
                continue;
            }
            if skip.contains(&key) || !name.is_none_or(|n| is_called(t.pid, n)) {
                continue;
            }
            log::info!(
                "serve: discovered pid {} (engine {}, model {:?}, container {:?}): observing it",
                t.pid,
                l.engine,
                l.model,
                l.container
            );
            let mut args = run.clone();
            args.pid = Some(t.pid);
            let (tx, rx) = tokio::sync::watch::channel(labels.clone());
            let sink = ex.target_sink(labels).follow_labels(rx);
            let stop = stop.clone();
            observing.insert(key, tx);
            sessions.spawn_local(async move { (key, l.engine, observe(args, vec![Box::new(sink)], &stop).await) });
        }
        tokio::select! {
            _ = tokio::time::sleep(SCAN_INTERVAL) => {}
            Some(done) = sessions.join_next(), if !sessions.is_empty() => ended(done, &mut observing, &mut skip),
            _ = stop.signal_received() => {}
        }
    }
    // Attached sessions end at once on a stop request.
    while let Some(done) = sessions.join_next().await {
        ended(done, &mut observing, &mut skip);
    }
}

/// Whether the executable of `pid` has the file name `name`.
fn exe_is_called(pid: u32, name: &str) -> bool {
    procfs::process::Process::new(pid as i32).and_then(|p| p.exe()).is_ok_and(|p| {
        p.file_name().and_then(|f| f.to_str()).is_some_and(|f| f.strip_suffix(" (deleted)").unwrap_or(f) == name)
    })
}

/// Whether `pid` is called `name`: its comm (at most 15 bytes) or its
/// executable's file name.
fn is_called(pid: u32, name: &str) -> bool {
    let stat = procfs::process::Process::new(pid as i32).and_then(|p| p.stat());
    stat.is_ok_and(|s| s.comm.as_bytes() == &name.as_bytes()[..name.len().min(15)]) || exe_is_called(pid, name)
}

/// The oldest live process (not ourselves, not a zombie) whose comm or
/// executable file name is `name`.
pub fn find_by_name(name: &str, skip: &HashSet<u32>) -> Option<u32> {
    let me = std::process::id();
    // comm is at most 15 bytes (TASK_COMM_LEN − 1).
    let comm_name = &name.as_bytes()[..name.len().min(15)];
    let mut best: Option<(u64, u32)> = None;
    for p in procfs::process::all_processes().ok()?.flatten() {
        let pid = p.pid as u32;
        if pid == me || skip.contains(&pid) {
            continue;
        }
        let Ok(stat) = p.stat() else { continue };
        if stat.state == 'Z' || stat.state == 'X' {
            continue;
        }
        if (stat.comm.as_bytes() == comm_name || exe_is_called(pid, name))
            && best.is_none_or(|(s, _)| stat.starttime < s)
        {
            best = Some((stat.starttime, pid));
        }
    }
    best.map(|(_, p)| p)
}

#[cfg(test)]
mod tests {
    use clap::{Args, Command, FromArgMatches};

    use super::*;

    fn parse(args: &[&str]) -> Result<(ServeArgs, u64), clap::Error> {
        let cmd = ServeArgs::augment_args(Command::new("serve"));
        let m = cmd.try_get_matches_from(args)?;
        let every = *m.get_one::<u64>("every").expect("every has a default");
        Ok((ServeArgs::from_arg_matches(&m)?, every))
    }

    #[test]
    fn serve_prints_no_token_lines_by_default_and_takes_one_target() {
        let (a, every) = parse(&["serve", "--name", "engine"]).unwrap();
        assert_eq!(a.name.as_deref(), Some("engine"));
        assert_eq!(every, 0);
        assert_eq!(a.run.metrics_addr.as_deref(), Some(DEFAULT_ADDR));
        let (a, _) = parse(&["serve", "--metrics-addr", ":9100", "--pid", "1"]).unwrap();
        assert_eq!((a.run.pid, a.run.metrics_addr.as_deref()), (Some(1), Some(":9100")));
        assert!(parse(&["serve", "--name", "x", "--pid", "1"]).is_err());
        assert!(parse(&["serve", "--name", "x", "--", "true"]).is_err());
        assert!(parse(&["serve"]).is_err(), "a target is required");
        assert!(parse(&["serve", "--pid", "1", "--", "true"]).is_err());
        assert!(parse(&["serve", "--discover", "--pid", "1"]).is_err());
        let (a, _) = parse(&["serve", "--discover", "--name", "engine", "--max-targets", "3"]).unwrap();
        assert!(a.discover && a.name.is_some() && a.max_targets == 3);
        assert!(parse(&["serve", "--name", "engine", "--max-targets", "3"]).is_err(), "--max-targets needs --discover");
        let (a, _) = parse(&["serve", "--", "true"]).unwrap();
        assert!(a.name.is_none() && a.run.pid.is_none());
    }

    #[test]
    fn finds_a_process_by_comm_and_exe_name() {
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let pid = child.id();
        let none = HashSet::new();
        let found = (0..50).find_map(|_| {
            let p = find_by_name("sleep", &none).filter(|p| *p == pid);
            if p.is_none() {
                std::thread::sleep(Duration::from_millis(20));
            }
            p
        });
        // Another `sleep` may be older; ours must at least be a candidate once
        // the older ones are skipped.
        let mut skip = HashSet::new();
        let mut got = found;
        while got.is_none() {
            match find_by_name("sleep", &skip) {
                Some(p) if p == pid => got = Some(p),
                Some(p) => {
                    skip.insert(p);
                }
                None => break,
            }
        }
        assert_eq!(got, Some(pid));
        skip.insert(pid);
        assert_ne!(find_by_name("sleep", &skip), Some(pid), "skipped pids are not picked");
        child.kill().unwrap();
        child.wait().unwrap();
        assert_ne!(find_by_name("sleep", &none), Some(pid), "a reaped process is gone");
        assert_eq!(find_by_name("no-such-program-xyz", &none), None);
    }
}
