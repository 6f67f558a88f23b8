//! The observer's library: probes, attribution, outputs. The `observer`
//! binary is a thin CLI over it (`src/main.rs`, `src/cmd/`).

pub mod attribution;
pub mod bpf;
pub mod engine_abi;
pub mod preflight;
pub mod report;
pub mod seed;
pub mod syscalls;
pub mod target;
pub mod tokens;
pub mod tracefs;
