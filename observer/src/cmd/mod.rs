//! One module per subcommand.

pub mod heatmap;
pub mod run;
