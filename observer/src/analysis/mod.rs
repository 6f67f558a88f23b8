//! Analysis: what is computed from a run's model stream — bootstrap
//! statistics, `diff`, the run summary and per-token attribution, exports.

pub mod attribution;
pub mod diff;
pub mod export;
pub mod reads;
pub mod refaults;
pub mod report;
pub mod stats;
