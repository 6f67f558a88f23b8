//! The embedded MoE engine: GGUF v3 on memmap2 ([`gguf`]), quantized CPU kernels ([`quant`]),
//! `qwen3moe` decode ([`model`]), a byte-level BPE tokenizer from the GGUF vocabulary
//! ([`tokenizer`]), sampling ([`sampling`]) and a synthetic-model generator ([`synth`]).

pub mod attention;
pub mod gguf;
pub mod inspect;
pub mod model;
pub mod pool;
pub mod quant;
pub mod sampling;
pub mod synth;
pub mod tokenizer;
pub mod vmath;
