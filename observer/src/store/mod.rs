//! Store: runs on disk — the observer's trace format and imports of other
//! formats (`bmoe_metrics v1` CSV), read back as the model stream.

pub mod import;
pub mod trace;
