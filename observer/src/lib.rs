//! The observer's library: probes, attribution, outputs. The `observer`
//! binary is a thin CLI over it (`src/main.rs`, `src/cmd/`).

pub mod attribution;
pub mod bpf;
pub mod diff;
pub mod engine_abi;
pub mod export;
pub mod header;
pub mod import;
pub mod metrics;
pub mod preflight;
pub mod procfs;
pub mod procsample;
pub mod report;
pub mod residency;
pub mod seed;
pub mod sink;
pub mod stats;
pub mod syscalls;
pub mod target;
pub mod tokens;
pub mod trace;
pub mod tracefs;
