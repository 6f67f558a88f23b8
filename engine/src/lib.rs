//! The embedded MoE engine: GGUF v3 on memmap2 ([`gguf`]), quantized CPU kernels ([`quant`]),
//! `qwen3moe` decode ([`model`]: a forward pass built from the [`blocks`] an architecture
//! description ([`arch`]) names per layer), a byte-level BPE tokenizer from the GGUF vocabulary
//! ([`tokenizer`]), sampling ([`sampling`]) and a synthetic-model generator ([`synth`]).
//!
//! For the observer: dense-weight placement policies `mmap | anon | locked` ([`placement`]),
//! per-token telemetry with the `bmoe_metrics v1` CSV / JSON-lines writer ([`telemetry`]), and
//! token markers ([`markers`]): the `engine` binary exports
//!
//! ```c
//! void moe_engine_token_begin(uint64_t index, const struct moe_token_record *rec);
//! void moe_engine_token_end(uint64_t index, const struct moe_token_record *rec);
//! ```
//!
//! called around every step (the prompt is step 0, each further generated token one step), with
//! `rec` the 152-byte `repr(C)` record v1 (magic `0x4B4F544D`, `u64::MAX` / negative = not
//! measured) whose field-by-field layout table is in [`markers`].
//!
//! Under `--dense anon|locked` it also exports where the anonymous copy of the dense weights is,
//! for observers that measure its residency from `/proc/PID/pagemap` ([`dense_regions`]):
//!
//! ```c
//! struct moe_dense_range   { uint64_t addr, len, file_offset; };   /* 24 bytes */
//! struct moe_dense_regions {                                        /* 32 bytes */
//!     uint32_t magic;     /* 0x4E45444D */
//!     uint32_t version;   /* 1 */
//!     uint64_t seq;       /* seqlock: odd during an update */
//!     uint64_t count;     /* 0 = no anonymous copy (always so with --dense mmap) */
//!     const struct moe_dense_range *table;
//! } moe_engine_dense_regions;
//! ```
//!
//! published once the copy is complete and cleared before it is unmapped; each entry is one run
//! of dense tensors: `addr..addr+len` holds the file's bytes `file_offset..file_offset+len`.

pub mod arch;
pub mod attention;
pub mod blocks;
pub mod dense_regions;
pub mod gguf;
pub mod inspect;
pub mod markers;
pub mod model;
pub mod placement;
pub mod pool;
pub mod quant;
pub mod regions;
pub mod sampling;
pub mod synth;
pub mod telemetry;
pub mod tokenizer;
pub mod vmath;
