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
    /// Which weights of a GGUF model are in the page cache: a layer × expert heatmap.
    Heatmap(cmd::heatmap::HeatmapArgs),
}

fn main() {
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build();
    let result = match rt {
        Ok(rt) => rt.block_on(async {
            match cli.cmd {
                Cmd::Run(args) => cmd::run::run(args).await,
                Cmd::Heatmap(args) => cmd::heatmap::run(args),
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
