//! One module per subcommand.

pub mod diff;
pub mod export;
pub mod record;
pub mod report;
pub mod run;
pub mod tui;
