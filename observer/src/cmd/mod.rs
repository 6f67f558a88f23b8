//! One module per subcommand: its arguments, turned into calls of the
//! library. Plus what every subcommand shares: the diagnostics logger and
//! the duration parser.
//!
//! ## Durations on the command line
//! A duration is a decimal number and a unit: `us` (or `µs`), `ms`, `s`,
//! `m` (or `min`); no unit means seconds. Spaces around it are ignored. It must
//! be positive and finite (`250ms`, `1.5`, `2min`).

pub mod assets;
pub mod config;
pub mod diff;
pub mod doctor;
pub mod export;
pub mod heatmap;
pub mod plot;
pub mod record;
pub mod report;
pub mod run;
pub mod serve;
pub mod tui;

use std::time::Duration;

/// A command-line duration (module spec), for clap's `value_parser`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    const UNITS: &str = "us, ms, s, m or min";
    let s = s.trim();
    let (num, unit) = s.split_at(s.find(|c: char| c.is_alphabetic()).unwrap_or(s.len()));
    let v: f64 =
        num.trim().parse().map_err(|_| format!("not a duration: {s:?} (a number and a unit: {UNITS}; e.g. 250ms)"))?;
    let secs = match unit {
        "us" | "µs" => v / 1e6,
        "ms" => v / 1e3,
        "s" | "" => v,
        "m" | "min" => v * 60.0,
        _ => return Err(format!("unknown unit in {s:?} (use {UNITS})")),
    };
    if !(secs > 0.0 && secs.is_finite()) {
        return Err(format!("duration must be positive: {s:?}"));
    }
    Ok(Duration::from_secs_f64(secs))
}

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
        // Through the queue a capture holds (`observer::stderr`), so a stalled reader cannot stop it.
        .target(env_logger::Target::Pipe(Box::new(observer::stderr::LogPipe::default())))
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::parse_duration;

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration(" 2s ").unwrap(), Duration::from_secs(2));
        assert_eq!(parse_duration("1.5").unwrap(), Duration::from_millis(1500));
        assert_eq!(parse_duration("20us").unwrap(), Duration::from_micros(20));
        assert_eq!(parse_duration("20µs").unwrap(), Duration::from_micros(20));
        assert_eq!(parse_duration("2min").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert!(parse_duration("0s").is_err());
        assert!(parse_duration("-1s").is_err());
        assert!(parse_duration("inf").is_err());
        let e = parse_duration("5 parsecs").unwrap_err();
        assert!(e.contains("parsecs") && e.contains("ms"), "{e}");
    }
}
