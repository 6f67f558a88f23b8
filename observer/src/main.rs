//! `observer`: attributes a process's time to what the memory system and the
//! scheduler did to it, with eBPF.

mod cmd;

use clap::{CommandFactory, Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "observer", version, about = "Where the time of a token really goes (eBPF)")]
struct Cli {
    /// More diagnostics on stderr: -v debug, -vv trace (`RUST_LOG` overrides).
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,
    /// Fewer diagnostics: -q warnings and errors only, -qq errors only.
    #[arg(short, long, global = true, action = clap::ArgAction::Count, conflicts_with = "verbose")]
    quiet: u8,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Observe a command (`observer run -- CMD ARGS…`) or a running process (`--pid`).
    Run(cmd::run::RunArgs),
    /// Observe like `run` and write the model stream to a trace file (`-o FILE`).
    Record(cmd::record::RecordArgs),
    /// Compare runs (traces or bmoe_metrics CSVs) with bootstrap intervals.
    Diff(cmd::diff::DiffArgs),
    /// Summarise one run (a trace or a bmoe_metrics CSV).
    Report(cmd::report::ReportArgs),
    /// Convert a run to another format (Chrome / Perfetto trace JSON).
    Export(cmd::export::ExportArgs),
    /// Pictures (SVG or PNG): per-token components, A/B comparison, residency over time, the cliff curve.
    Plot(cmd::plot::PlotArgs),
    /// Which weights of a GGUF model are in the page cache: a layer × expert heatmap.
    Heatmap(cmd::heatmap::HeatmapArgs),
    /// A standing Prometheus exporter: observe a PID, a command, or every
    /// process called NAME as it comes and goes, serving /metrics throughout.
    Serve(cmd::serve::ServeArgs),
    /// Check what the observer needs on this host and say what to fix.
    Doctor(cmd::doctor::DoctorArgs),
    /// The live TUI beside a command (`observer tui -- CMD…`), a PID (`--pid`), or a trace (`--replay`).
    Tui(cmd::tui::TuiArgs),
    /// Write the man pages and shell completions of this CLI into DIR (`cargo xtask man`).
    #[command(hide = true)]
    Assets(cmd::assets::AssetsArgs),
}

fn main() {
    let argv = match cmd::config::expand(std::env::args_os().collect()) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("observer: error: {e:#}");
            std::process::exit(2);
        }
    };
    let cli = Cli::parse_from(argv);
    cmd::init_logging(cli.verbose, cli.quiet);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build();
    let result = match rt {
        Ok(rt) => rt.block_on(async {
            match cli.cmd {
                Cmd::Run(args) => cmd::run::run(args).await,
                Cmd::Record(args) => cmd::record::record(args).await,
                Cmd::Diff(args) => cmd::diff::diff(args),
                Cmd::Report(args) => cmd::report::report(args),
                Cmd::Export(args) => cmd::export::export(args),
                Cmd::Heatmap(args) => cmd::heatmap::run(args),
                Cmd::Plot(args) => cmd::plot::plot(args),
                Cmd::Serve(args) => cmd::serve::serve(args).await,
                Cmd::Tui(args) => cmd::tui::tui(args).await,
                Cmd::Doctor(args) => cmd::doctor::doctor(args),
                Cmd::Assets(args) => cmd::assets::write(Cli::command(), &args),
            }
        }),
        Err(e) => Err(anyhow::Error::from(e).context("starting the runtime")),
    };
    // Lines still queued for stderr (`observer::stderr`) come before the exit and its message.
    observer::stderr::drain();
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("observer: error: {}", engine::errors::one_line(&e));
            std::process::exit(2);
        }
    }
}
