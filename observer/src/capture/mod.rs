//! Capture: everything that produces the model stream from a live process —
//! the eBPF probes and their loader, tracefs, the target process, token
//! assembly, residency sampling, process samples and the procfs fallback.

pub mod bpf;
pub mod btf;
pub mod discover;
pub mod engine_abi;
pub mod guard;
pub mod header;
pub mod preflight;
pub mod procfs;
pub mod procsample;
pub mod profile;
pub mod residency;
pub mod seed;
pub mod session;
pub mod syscalls;
pub mod target;
pub mod tokens;
pub mod tracefs;

pub use observer_common::totals::comm_str;
