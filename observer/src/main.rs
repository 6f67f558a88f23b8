//! `observer`: attributes a process's time to what the memory system and the
//! scheduler did to it, with eBPF.

mod bpf;
mod preflight;
mod report;
mod target;

use std::{ffi::OsString, path::PathBuf, time::Instant};

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use observer_common::GlobalCounter;

use crate::{
    bpf::Probes,
    report::{Summary, TargetInfo},
    target::{CHILD_GRACE, Ending, Target},
};

#[derive(Debug, Parser)]
#[command(name = "observer", version, about = "Where the time of a token really goes (eBPF)")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Observe a command (`observer run -- CMD ARGS…`) or a running process (`--pid`).
    Run(RunArgs),
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    /// Attach to this running process (all its threads) instead of spawning one.
    #[arg(long, conflicts_with = "command")]
    pid: Option<u32>,
    /// Also write the summary as JSON to this file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// The command to spawn and observe.
    #[arg(last = true, value_name = "CMD")]
    command: Vec<OsString>,
}

fn main() {
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build();
    let result = match rt {
        Ok(rt) => rt.block_on(async {
            match cli.cmd {
                Cmd::Run(args) => run(args).await,
            }
        }),
        Err(e) => Err(anyhow::Error::from(e).context("starting the runtime")),
    };
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("observer: error: {e:#}");
            std::process::exit(2);
        }
    }
}

async fn run(args: RunArgs) -> Result<i32> {
    if args.pid.is_none() && args.command.is_empty() {
        anyhow::bail!("nothing to observe: give `--pid PID` or `-- CMD [ARGS…]`");
    }
    preflight::check_privileges()?;
    preflight::ensure_tracefs()?;
    let (mut target, command) = match args.pid {
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
            (Target::spawn(&args.command)?, cmd)
        }
    };
    let pid = target.pid();
    let probes = match Probes::attach(pid) {
        Ok(p) => p,
        Err(e) => {
            // The spawned child is still blocked before exec: end it.
            target.signal(libc::SIGKILL);
            return Err(e.into());
        }
    };
    target.release()?;
    let start = Instant::now();

    let ending = wait_for_end(&mut target).await?;
    let duration_ns = start.elapsed().as_nanos() as u64;

    let rows = probes.thread_faults()?;
    let lost = probes.counter(GlobalCounter::LostEvents)?;
    let attached = probes.attached.clone();
    drop(probes);

    let exit_code = match ending {
        Some(Ending::Exited(c)) => Some(c),
        _ => None,
    };
    let summary = Summary::build(
        TargetInfo { pid, command, exit_code },
        duration_ns,
        attached,
        &rows,
        lost,
    );
    summary.print(&mut std::io::stderr().lock())?;
    if let Some(path) = &args.json {
        let f = std::fs::File::create(path)
            .with_context(|| format!("cannot create JSON file {}", path.display()))?;
        serde_json::to_writer_pretty(std::io::BufWriter::new(f), &summary)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(exit_code.unwrap_or(0))
}

/// Resolves on Ctrl-C (SIGINT) or SIGTERM.
async fn stop_requested() -> Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    tokio::select! {
        _ = int.recv() => {}
        _ = term.recv() => {}
    }
    Ok(())
}

/// Wait until the target ends, or Ctrl-C/SIGTERM: then a spawned child gets
/// SIGINT and a grace period (a second signal kills it); an attached process is
/// left alone. `None` means we stopped observing while the target still ran.
async fn wait_for_end(target: &mut Target) -> Result<Option<Ending>> {
    tokio::select! {
        e = target.wait() => return e.map(Some),
        r = stop_requested() => r?,
    }
    if !target.is_spawned() {
        return Ok(None);
    }
    target.signal(libc::SIGINT);
    tokio::select! {
        e = target.wait() => e.map(Some),
        _ = stop_requested() => {
            target.signal(libc::SIGKILL);
            target.wait().await.map(Some)
        }
        _ = tokio::time::sleep(CHILD_GRACE) => {
            eprintln!("observer: target still running {} s after SIGINT; killing it", CHILD_GRACE.as_secs());
            target.signal(libc::SIGKILL);
            target.wait().await.map(Some)
        }
    }
}
