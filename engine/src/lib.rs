//! The embedded MoE engine: GGUF v3 on memmap2 ([`gguf`]), quantized CPU kernels ([`quant`]),
//! `qwen3moe` decode ([`model`]: a forward pass built from the [`blocks`] an architecture
//! description ([`arch`]) names per layer), a byte-level BPE tokenizer from the GGUF vocabulary
//! ([`tokenizer`]), sampling ([`sampling`]) and a synthetic-model generator ([`synth`]).
//!
//! For the observer: dense-weight placement policies `mmap | anon | locked` ([`placement`]),
//! per-token telemetry with the `bmoe_metrics v1` CSV / JSON-lines writer ([`telemetry`]), and
//! the engine's side of the engine↔observer ABI of the `moe-abi` crate (specified there, once):
//! the token markers `moe_engine_token_begin` / `moe_engine_token_end` around every step with
//! their 152-byte record ([`markers`]), and, under `--dense anon|locked`, where the anonymous
//! copy of the dense weights is (`moe_engine_dense_regions`, [`dense_regions`]).

pub mod arch;
pub mod attention;
pub mod blocks;
pub mod cache;
pub mod cli;
pub mod dense_regions;
pub mod errors;
pub mod files;
pub mod gguf;
pub mod inspect;
pub mod markers;
pub mod model;
pub mod output;
pub mod placement;
pub mod pool;
pub mod quant;
pub mod regions;
pub mod sampling;
pub mod synth;
pub mod telemetry;
pub mod tokenizer;
pub mod vmath;
