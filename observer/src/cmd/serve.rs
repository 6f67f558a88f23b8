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

use std::{collections::HashSet, sync::Arc, time::Duration};

use anyhow::{Result, bail};
use observer::{
    capture::session::Stop,
    sinks::prometheus::{Endpoint, Exporter},
};

use super::run::{RunArgs, observe};

/// Where `serve` listens without `--metrics-addr`.
pub const DEFAULT_ADDR: &str = "127.0.0.1:9977";
/// How often `--name` looks for a new process.
const SCAN_INTERVAL: Duration = Duration::from_millis(100);

#[derive(Debug, clap::Args)]
#[command(mut_arg("every", |a| a.default_value("0")))]
#[command(mut_arg("metrics_addr", |a| a
    .default_value(DEFAULT_ADDR)
    .help("Serve Prometheus/OpenMetrics metrics at http://ADDR/metrics (`PORT` or `:PORT` listen on 127.0.0.1; `HOST:PORT`)")))]
#[command(group(clap::ArgGroup::new("target").required(true).args(["name", "pid", "command"])))]
pub struct ServeArgs {
    /// Follow every process called NAME (its comm, or its executable's file
    /// name) as it starts and exits, re-attaching after each restart.
    #[arg(long, value_name = "NAME", conflicts_with_all = ["pid", "command"])]
    pub name: Option<String>,
    #[command(flatten)]
    pub run: RunArgs,
}

/// Token records `serve` keeps per target for its end-of-target summary.
const SERVE_KEEP_TOKENS: usize = 100_000;

pub async fn serve(args: ServeArgs) -> Result<i32> {
    // clap made sure exactly one of --name, --pid and CMD is given.
    let ServeArgs { name, mut run } = args;
    if let Some(n) = &name
        && (n.is_empty() || n.contains('/'))
    {
        bail!("--name {n:?}: give a process name as `ps -o comm` shows it (no path)");
    }
    // Not for each session: this endpoint outlives them.
    let addr = run.metrics_addr.take().unwrap_or_else(|| DEFAULT_ADDR.to_string());
    // A standing exporter keeps only recent tokens for each target's summary.
    run.keep_tokens = run.keep_tokens.min(SERVE_KEEP_TOKENS);
    let ex = Exporter::new();
    let endpoint = Endpoint::start(&addr, Arc::clone(&ex))?;
    let stop = Stop::install()?;
    log::info!("serve: metrics at http://{}/metrics", endpoint.local_addr());
    match name {
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

async fn follow(name: &str, run: RunArgs, ex: &Arc<Exporter>, stop: &Stop) {
    let mut skip: HashSet<u32> = HashSet::new();
    log::info!("serve: waiting for a process called {name:?}");
    loop {
        let pid = loop {
            if stop.signalled() {
                return;
            }
            skip.retain(|p| std::path::Path::new(&format!("/proc/{p}")).exists());
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
        match observe(args, vec![Box::new(ex.sink())], stop).await {
            Ok(_) => log::info!("serve: pid {pid} ended; waiting for the next {name:?}"),
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

/// The oldest live process (not ourselves, not a zombie) whose comm or
/// executable file name is `name`.
pub fn find_by_name(name: &str, skip: &HashSet<u32>) -> Option<u32> {
    let me = std::process::id();
    // comm is at most 15 bytes (TASK_COMM_LEN − 1).
    let comm_name = &name.as_bytes()[..name.len().min(15)];
    let mut best: Option<(u64, u32)> = None;
    for e in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if pid == me || skip.contains(&pid) {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // `pid (comm) state … starttime(22)`; comm may contain spaces and ')'.
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let comm = &stat.as_bytes()[open + 1..close];
        let rest: Vec<&str> = stat[close + 1..].split_whitespace().collect();
        let (Some(state), Some(start)) = (rest.first(), rest.get(19).and_then(|s| s.parse::<u64>().ok())) else {
            continue;
        };
        if *state == "Z" || *state == "X" {
            continue;
        }
        let exe_matches = || {
            std::fs::read_link(format!("/proc/{pid}/exe")).ok().is_some_and(|p| {
                p.file_name()
                    .and_then(|f| f.to_str())
                    .is_some_and(|f| f.strip_suffix(" (deleted)").unwrap_or(f) == name)
            })
        };
        if (comm == comm_name || exe_matches()) && best.is_none_or(|(s, _)| start < s) {
            best = Some((start, pid));
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
