//! The embedded MoE engine: GGUF v3 on memmap2 ([`gguf`]), quantized CPU kernels ([`quant`]),
//! `qwen3moe` decode ([`model`]), a byte-level BPE tokenizer from the GGUF vocabulary
//! ([`tokenizer`]), sampling ([`sampling`]) and a synthetic-model generator ([`synth`]).
//!
//! For the observer: dense-weight placement policies `mmap | anon | locked` ([`placement`]), the
//! token markers `moe_engine_token_begin` / `moe_engine_token_end` with their `repr(C)` per-token
//! record ([`markers`], layout table there), and per-token telemetry with the `bmoe_metrics v1`
//! CSV / JSON-lines writer ([`telemetry`]).

pub mod gguf;
pub mod inspect;
pub mod markers;
pub mod model;
pub mod placement;
pub mod pool;
pub mod quant;
pub mod sampling;
pub mod synth;
pub mod telemetry;
pub mod tokenizer;
pub mod vmath;
