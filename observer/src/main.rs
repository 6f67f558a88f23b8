//! `observer`: attributes a process's time to what the memory system and the
//! scheduler did to it, with eBPF.

mod cmd;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "observer", version, about = "Where the time of a token really goes (eBPF)")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Observe a command (`observer run -- CMD ARGS…`) or a running process (`--pid`).
    Run(cmd::run::RunArgs),
    /// A standing Prometheus exporter: observe a PID, a command, or every
    /// process called NAME as it comes and goes, serving /metrics throughout.
    Serve(cmd::serve::ServeArgs),
}

fn main() {
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build();
    let result = match rt {
        Ok(rt) => rt.block_on(async {
            match cli.cmd {
                Cmd::Run(args) => cmd::run::run(args).await,
                Cmd::Serve(args) => cmd::serve::serve(args).await,
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
