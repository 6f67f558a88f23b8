//! One module per subcommand.

pub mod diff;
pub mod export;
pub mod heatmap;
pub mod record;
pub mod report;
pub mod run;
pub mod serve;
pub mod tui;
