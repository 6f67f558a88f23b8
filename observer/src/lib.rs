//! The observer's library: probes, attribution, outputs. The `observer`
//! binary is a thin CLI over it (`src/main.rs`, `src/cmd/`).
//!
//! Layers, each a folder; dependencies point down this list, never up:
//! - `cmd/` (the binary, `src/cmd/`): argument parsing only;
//! - [`sinks`]: consumers of the model stream (per-token lines, the end-of-run
//!   summary, Prometheus, the trace writer);
//! - [`plot`]: pictures (SVG, PNG) of what `analysis` computes;
//! - [`analysis`]: what is computed from a run (statistics, `diff`, the
//!   report, exports);
//! - [`store`]: runs on disk (the trace format, imports of other formats);
//! - [`output`]: how every output file is written (checked first, never
//!   overwritten silently, renamed into place whole);
//! - [`style`]: when colour is written (a terminal, no `NO_COLOR`);
//! - [`capture`]: what produces the model stream (eBPF probes, tracefs, the
//!   target process, token assembly, residency, the procfs fallback).

pub mod analysis;
pub mod capture;
pub mod config;
/// Output files: the engine's rules ([`engine::output`]), shared so that both programs write alike.
pub use engine::output;
pub mod plot;
pub mod sinks;
pub mod stderr;
pub mod store;
pub mod style;
