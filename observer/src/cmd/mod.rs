//! One module per subcommand: its arguments, turned into calls of the
//! library. Plus what every subcommand shares: the diagnostics logger.

pub mod diff;
pub mod export;
pub mod heatmap;
pub mod record;
pub mod report;
pub mod run;
pub mod serve;
pub mod tui;

/// Diagnostics go through `log` to stderr, one line each, `observer: ` first
/// (then `error: `, `warning: `, `debug: ` or `trace: ` for those levels).
/// The level is info, or as `-v`/`-q` say; `RUST_LOG` (env_logger's syntax,
/// e.g. `RUST_LOG=observer=debug`) overrides both. Results — tables,
/// per-token lines, reports — are not diagnostics: they are printed as they are.
pub fn init_logging(verbose: u8, quiet: u8) {
    use std::io::Write;
    let level = match (verbose, quiet) {
        (0, 0) => log::LevelFilter::Info,
        (1, _) => log::LevelFilter::Debug,
        (v, _) if v > 1 => log::LevelFilter::Trace,
        (_, 1) => log::LevelFilter::Warn,
        _ => log::LevelFilter::Error,
    };
    env_logger::Builder::new()
        .filter_level(level)
        .parse_default_env()
        .format(|f, r| {
            let level = match r.level() {
                log::Level::Error => "error: ",
                log::Level::Warn => "warning: ",
                log::Level::Info => "",
                log::Level::Debug => "debug: ",
                log::Level::Trace => "trace: ",
            };
            writeln!(f, "observer: {level}{}", r.args())
        })
        .init();
}
