//! Synthetic GGUF models of every architecture the engine runs ([`crate::arch`]): real files of
//! any shape with random weights.
//!
//! # What a synthetic file holds
//! - the metadata llama.cpp's loader of the architecture reads (`{arch}.block_count`,
//!   `embedding_length`, `feed_forward_length`, `attention.head_count{,_kv}`,
//!   `attention.{key,value}_length`, `attention.layer_norm_rms_epsilon`, `rope.freq_base`,
//!   `context_length`, `expert_count`, `expert_used_count`, `expert_feed_forward_length`; for
//!   `qwen35moe` also `expert_shared_feed_forward_length`, `rope.dimension_count`,
//!   `rope.dimension_sections`, `full_attention_interval` and `ssm.{conv_kernel, state_size,
//!   group_count, time_step_rank, inner_size}`; for `gpt-oss` `attention.sliding_window` and the
//!   YaRN `rope.scaling.{type, factor, original_context_length}`);
//! - a byte-level BPE vocabulary (`tokenizer.ggml.model = "gpt2"`, `pre = "qwen2"`, for every
//!   architecture): the 256 byte tokens, merges learned from a built-in English text,
//!   `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` as control tokens at the end, and unused filler
//!   tokens up to the vocab size;
//! - the tensors of [`tensor_specs`] (the architecture's, with llama.cpp's names and shapes),
//!   weights uniform in `±sqrt(3/fan_in)` (unit-variance outputs), norms `1 ± 0.1`, biases and
//!   attention sinks uniform in `±0.1` and `±1`, DeltaNet decay parameters in the ranges of the
//!   real models' initialisation (`ssm_a = -U(1, 16)`, `ssm_dt.bias = U(-6, -2)`). Each row is
//!   generated from its own seed, so the file depends only on the configuration and `--seed`,
//!   not on the thread count.
//! - Residual-branch projections (`attn_output`, `ssm_out`, `ffn_down_exps`, `ffn_down_shexp`)
//!   are scaled by `1/sqrt(2·layers)` as in GPT-2's initialisation, and `output.weight` rows by a
//!   log-normal factor (σ = `output_skew`, default 1), so that a few tokens carry large logits as
//!   in real vocabularies.
//! - Router skew: row `e` of `ffn_gate_inp` is scaled by `(rank_e + 1)^-skew` (ranks shuffled
//!   per layer), so high-norm experts win the top-k more often and popularity is uneven.
//!
//! Quantization mixes: `q8_0`, `q4_k`, `q6_k` (every matrix in that type), `q4_k_m` (experts
//! `Q4_K`, `ffn_down_exps` `Q6_K`, other matrices `Q8_0`) and `mxfp4` (experts `MXFP4`, other
//! matrices `Q8_0`: gpt-oss as released); norms, routers, biases, sinks, 1-D tensors and
//! `ssm_conv1d` are always `F32`, like llama.cpp's quantized files.
//!
//! Presets (`SynthConfig::preset`): per architecture a tiny one (tests), one with the released
//! model's per-layer shapes (`qwen3-30b-a3b`, `olmoe-1b-7b`, `qwen3.6-35b-a3b`, `gpt-oss-20b`;
//! `--layers` shortens them) and a ~0.5 GB one for `cargo xtask bench engine` (`small`,
//! `olmoe-bench`, `qwen35moe-bench`, `gpt-oss-bench`).

use std::collections::HashMap;
use std::path::Path;

use crate::arch::Arch;
use crate::gguf::{GgufWriter, TensorSpec, Value};
use crate::quant::{self, GgmlType};
use crate::tokenizer::{TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_UNUSED, bytes_to_token_text};

/// Bumped whenever the bytes written for a given configuration change (caches key on it).
pub const FORMAT_VERSION: u32 = 2;

#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    #[error("invalid synthetic model configuration: {0}")]
    Config(String),
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("quantizing {tensor}: {source}")]
    Quant { tensor: String, source: quant::QuantError },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantMix {
    Q8_0,
    Q4K,
    Q6K,
    /// Experts Q4_K, `ffn_down_exps` Q6_K, dense Q8_0.
    Q4KM,
    /// Experts MXFP4, dense Q8_0.
    Mxfp4,
}

impl QuantMix {
    pub fn parse(s: &str) -> Option<QuantMix> {
        match s.to_ascii_lowercase().as_str() {
            "q8_0" => Some(QuantMix::Q8_0),
            "q4_k" => Some(QuantMix::Q4K),
            "q6_k" => Some(QuantMix::Q6K),
            "q4_k_m" => Some(QuantMix::Q4KM),
            "mxfp4" => Some(QuantMix::Mxfp4),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            QuantMix::Q8_0 => "q8_0",
            QuantMix::Q4K => "q4_k",
            QuantMix::Q6K => "q6_k",
            QuantMix::Q4KM => "q4_k_m",
            QuantMix::Mxfp4 => "mxfp4",
        }
    }

    fn dense(self) -> GgmlType {
        match self {
            QuantMix::Q8_0 | QuantMix::Q4KM | QuantMix::Mxfp4 => GgmlType::Q8_0,
            QuantMix::Q4K => GgmlType::Q4_K,
            QuantMix::Q6K => GgmlType::Q6_K,
        }
    }

    fn expert(self, down: bool) -> GgmlType {
        match self {
            QuantMix::Q8_0 => GgmlType::Q8_0,
            QuantMix::Q4K => GgmlType::Q4_K,
            QuantMix::Q6K => GgmlType::Q6_K,
            QuantMix::Q4KM if down => GgmlType::Q6_K,
            QuantMix::Q4KM => GgmlType::Q4_K,
            QuantMix::Mxfp4 => GgmlType::MXFP4,
        }
    }

    /// llama.cpp's `general.file_type` for the mix (LLAMA_FTYPE_*).
    fn file_type(self) -> u32 {
        match self {
            QuantMix::Q8_0 => 7,
            QuantMix::Q4K => 15, // Q4_K_M is the closest "mostly Q4_K" type
            QuantMix::Q6K => 18,
            QuantMix::Q4KM => 15,
            QuantMix::Mxfp4 => 38, // LLAMA_FTYPE_MOSTLY_MXFP4_MOE
        }
    }
}

#[derive(Debug, Clone)]
pub struct SynthConfig {
    pub arch: Arch,
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub experts: usize,
    pub experts_used: usize,
    pub expert_ffn: usize,
    pub vocab: usize,
    pub context: usize,
    pub rope_base: f32,
    pub rms_eps: f32,
    pub tied_output: bool,
    pub router_skew: f32,
    /// σ of the log-normal per-token scale of `output.weight` rows (0 = uniform).
    pub output_skew: f32,
    pub quant: QuantMix,
    pub seed: u64,
    /// Dimensions of each head RoPE rotates (0 = all; qwen35moe: partial).
    pub rope_dims: usize,
    /// `rope.dimension_sections` (qwen35moe).
    pub rope_sections: [usize; 4],
    /// Rows of the shared expert's gate and up (0 = none; qwen35moe).
    pub shared_ffn: usize,
    /// Every n-th layer has full attention, the others DeltaNet (qwen35moe).
    pub full_attn_interval: usize,
    /// DeltaNet: convolution taps, head dimension, Q/K heads, V heads (qwen35moe).
    pub ssm_conv: usize,
    pub ssm_state: usize,
    pub ssm_k_heads: usize,
    pub ssm_v_heads: usize,
    /// Sliding window of every other layer (gpt-oss).
    pub sliding_window: usize,
    /// YaRN scaling factor and original context (0 = none; gpt-oss).
    pub yarn_factor: f32,
    pub yarn_orig_ctx: usize,
}

/// The preset names, for help and error messages.
pub const PRESETS: &str = "tiny, small, qwen3-30b-a3b, olmoe-tiny, olmoe-bench, olmoe-1b-7b, qwen35moe-tiny, \
                           qwen35moe-bench, qwen3.6-35b-a3b, gpt-oss-tiny, gpt-oss-bench, gpt-oss-20b";

impl SynthConfig {
    /// Named presets ([`PRESETS`]): per architecture a tiny one, a ~0.5 GB bench one and the
    /// released model's per-layer shapes.
    pub fn preset(name: &str) -> Option<SynthConfig> {
        let base = SynthConfig {
            arch: Arch::Qwen3Moe,
            layers: 2,
            hidden: 256,
            heads: 4,
            kv_heads: 2,
            head_dim: 64,
            experts: 8,
            experts_used: 2,
            expert_ffn: 256,
            vocab: 512,
            context: 4096,
            rope_base: 1_000_000.0,
            rms_eps: 1e-6,
            tied_output: false,
            router_skew: 1.0,
            output_skew: 1.0,
            quant: QuantMix::Q8_0,
            seed: 42,
            rope_dims: 0,
            rope_sections: [0; 4],
            shared_ffn: 0,
            full_attn_interval: 0,
            ssm_conv: 0,
            ssm_state: 0,
            ssm_k_heads: 0,
            ssm_v_heads: 0,
            sliding_window: 0,
            yarn_factor: 0.0,
            yarn_orig_ctx: 0,
        };
        let olmoe = SynthConfig { arch: Arch::OlMoe, kv_heads: 4, rope_base: 10_000.0, rms_eps: 1e-5, ..base.clone() };
        let qwen35 = SynthConfig {
            arch: Arch::Qwen35Moe,
            layers: 4,
            expert_ffn: 128,
            shared_ffn: 128,
            rope_dims: 16,
            rope_sections: [3, 3, 2, 0],
            full_attn_interval: 4,
            ssm_conv: 4,
            ssm_state: 32,
            ssm_k_heads: 2,
            ssm_v_heads: 4,
            rope_base: 10_000_000.0,
            ..base.clone()
        };
        let gptoss = SynthConfig {
            arch: Arch::GptOss,
            sliding_window: 16,
            yarn_factor: 32.0,
            yarn_orig_ctx: 4096,
            rope_base: 150_000.0,
            rms_eps: 1e-5,
            quant: QuantMix::Mxfp4,
            ..base.clone()
        };
        match name {
            "tiny" => Some(base),
            // ~480 MB in q4_k_m.
            "small" => Some(SynthConfig {
                layers: 8,
                hidden: 1024,
                heads: 16,
                kv_heads: 4,
                head_dim: 64,
                experts: 48,
                experts_used: 8,
                expert_ffn: 512,
                vocab: 32768,
                quant: QuantMix::Q4KM,
                ..base
            }),
            // Qwen3-30B-A3B's per-layer shapes; 48 layers unless overridden.
            "qwen3-30b-a3b" => Some(SynthConfig {
                layers: 48,
                hidden: 2048,
                heads: 32,
                kv_heads: 4,
                head_dim: 128,
                experts: 128,
                experts_used: 8,
                expert_ffn: 768,
                vocab: 151_936,
                context: 40960,
                quant: QuantMix::Q4KM,
                ..base
            }),
            "olmoe-tiny" => Some(olmoe),
            // OLMoE-1B-7B's per-layer shapes with 24 of its 64 experts, 4 layers: ~0.5 GB in q4_k_m.
            "olmoe-bench" => Some(SynthConfig {
                layers: 4,
                hidden: 2048,
                heads: 16,
                kv_heads: 16,
                head_dim: 128,
                experts: 24,
                experts_used: 8,
                expert_ffn: 1024,
                vocab: 16384,
                quant: QuantMix::Q4KM,
                ..olmoe
            }),
            // OLMoE-1B-7B(-0924)'s shapes; 16 layers.
            "olmoe-1b-7b" => Some(SynthConfig {
                layers: 16,
                hidden: 2048,
                heads: 16,
                kv_heads: 16,
                head_dim: 128,
                experts: 64,
                experts_used: 8,
                expert_ffn: 1024,
                vocab: 50304,
                context: 4096,
                quant: QuantMix::Q4KM,
                ..olmoe
            }),
            "qwen35moe-tiny" => Some(qwen35),
            // Qwen3.6-35B-A3B's per-layer shapes with 32 of its 256 experts and 4 layers (3
            // DeltaNet, 1 full attention): ~0.5 GB in q4_k_m.
            "qwen35moe-bench" => {
                Some(SynthConfig { layers: 4, experts: 32, vocab: 16384, ..Self::preset("qwen3.6-35b-a3b")? })
            }
            // Qwen3.6-35B-A3B (qwen35moe) as published: 40 layers, every 4th full attention (16
            // query heads, 2 KV heads of 256, RoPE on 64 dims in sections 11/11/10), the others
            // gated DeltaNet (16 Q/K heads, 32 V heads of 128, 4-tap convolution); 256 experts of
            // 512, 8 used, a shared expert of 512.
            "qwen3.6-35b-a3b" => Some(SynthConfig {
                layers: 40,
                hidden: 2048,
                heads: 16,
                kv_heads: 2,
                head_dim: 256,
                rope_dims: 64,
                rope_sections: [11, 11, 10, 0],
                experts: 256,
                experts_used: 8,
                expert_ffn: 512,
                shared_ffn: 512,
                ssm_conv: 4,
                ssm_state: 128,
                ssm_k_heads: 16,
                ssm_v_heads: 32,
                vocab: 248_320,
                context: 262_144,
                quant: QuantMix::Q4KM,
                ..qwen35
            }),
            "gpt-oss-tiny" => Some(gptoss),
            // gpt-oss-20b's per-layer shapes with 16 of its 32 experts and 2 layers (one
            // sliding-window, one full): ~0.5 GB in mxfp4.
            "gpt-oss-bench" => {
                Some(SynthConfig { layers: 2, experts: 16, vocab: 16384, ..Self::preset("gpt-oss-20b")? })
            }
            // gpt-oss-20b as released: 24 layers alternating a 128-position sliding window and full
            // attention (64 query heads, 8 KV heads of 64, sinks, biases), 32 experts of 2880,
            // 4 used, MXFP4 experts, YaRN x32 over 4096.
            "gpt-oss-20b" => Some(SynthConfig {
                layers: 24,
                hidden: 2880,
                heads: 64,
                kv_heads: 8,
                head_dim: 64,
                experts: 32,
                experts_used: 4,
                expert_ffn: 2880,
                vocab: 201_088,
                context: 131_072,
                sliding_window: 128,
                ..gptoss
            }),
            _ => None,
        }
    }

    pub fn validate(&self) -> Result<(), SynthError> {
        let bad = |s: String| Err(SynthError::Config(s));
        if self.layers == 0 || self.hidden == 0 || self.heads == 0 || self.kv_heads == 0 || self.head_dim == 0 {
            return bad("layers, hidden, heads, kv heads and head dim must be positive".into());
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return bad(format!("heads ({}) must be a multiple of kv heads ({})", self.heads, self.kv_heads));
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad(format!("head dim ({}) must be even for RoPE", self.head_dim));
        }
        if self.rope_dims > self.head_dim || !self.rope_dims.is_multiple_of(2) {
            return bad(format!(
                "rope dims ({}) must be even and at most the head dim ({})",
                self.rope_dims, self.head_dim
            ));
        }
        if self.experts == 0 || self.experts_used == 0 || self.experts_used > self.experts {
            return bad(format!("need 0 < experts used ({}) <= experts ({})", self.experts_used, self.experts));
        }
        if self.vocab < 256 + SPECIALS.len() {
            return bad(format!(
                "vocab ({}) must hold the 256 byte tokens and {} specials",
                self.vocab,
                SPECIALS.len()
            ));
        }
        if self.vocab > u32::MAX as usize / 2 {
            return bad(format!("vocab ({}) is absurd", self.vocab));
        }
        match self.arch {
            Arch::OlMoe if self.heads * self.head_dim != self.hidden || self.kv_heads != self.heads => {
                return bad(format!(
                    "olmoe needs heads x head dim = hidden and kv heads = heads (its Q/K norms span the hidden size); \
                     got {} x {} vs {}, kv heads {}",
                    self.heads, self.head_dim, self.hidden, self.kv_heads
                ));
            }
            Arch::OlMoe | Arch::GptOss if self.tied_output => {
                return bad(format!("{} has no tied output (llama.cpp requires output.weight)", self.arch));
            }
            Arch::Qwen35Moe => {
                if self.full_attn_interval == 0 || self.ssm_conv < 2 || self.ssm_state == 0 || self.ssm_k_heads == 0 {
                    return bad(
                        "qwen35moe needs a full-attention interval, >= 2 conv taps, a state size and Q/K heads".into(),
                    );
                }
                if !self.ssm_v_heads.is_multiple_of(self.ssm_k_heads) || self.ssm_v_heads == 0 {
                    return bad(format!(
                        "ssm V heads ({}) must be a positive multiple of the Q/K heads ({})",
                        self.ssm_v_heads, self.ssm_k_heads
                    ));
                }
                let sect: usize = self.rope_sections.iter().sum();
                if sect == 0 || sect > self.rope_dims.max(2) / 2 {
                    return bad(format!(
                        "rope sections {:?} must be positive and at most the rotated pairs ({})",
                        self.rope_sections,
                        self.rope_dims / 2
                    ));
                }
            }
            Arch::GptOss if self.sliding_window == 0 => return bad("gpt-oss needs a sliding window".into()),
            _ => {}
        }
        for s in tensor_specs(self) {
            if s.size().is_none() {
                return bad(format!(
                    "tensor {} with rows of {} elements cannot be stored as {}: rows must be a multiple of {}",
                    s.name,
                    s.dims[0],
                    s.ty.name(),
                    s.ty.block_size()
                ));
            }
        }
        Ok(())
    }

    pub fn total_bytes(&self) -> u64 {
        tensor_specs(self).iter().filter_map(TensorSpec::size).sum()
    }

    /// Whether layer `il` is a DeltaNet layer (qwen35moe: all but every interval-th).
    fn is_recurrent(&self, il: usize) -> bool {
        self.arch == Arch::Qwen35Moe && !(il + 1).is_multiple_of(self.full_attn_interval)
    }
}

const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// The tensor table of a configuration, in file order (llama.cpp's names and shapes for the
/// architecture).
pub fn tensor_specs(c: &SynthConfig) -> Vec<TensorSpec> {
    let t = |name: String, dims: &[usize], ty: GgmlType| TensorSpec {
        name,
        dims: dims.iter().map(|&d| d as u64).collect(),
        ty,
    };
    let f32 = GgmlType::F32;
    let dense = c.quant.dense();
    let (h, e, ff) = (c.hidden, c.experts, c.expert_ffn);
    let (q_dim, kv_dim) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
    let mut v = vec![t("token_embd.weight".into(), &[h, c.vocab], dense)];
    for i in 0..c.layers {
        let p = |n: &str| format!("blk.{i}.{n}.weight");
        let pb = |n: &str| format!("blk.{i}.{n}.bias");
        v.push(t(p("attn_norm"), &[h], f32));
        if c.is_recurrent(i) {
            let (sd, hk, hv) = (c.ssm_state, c.ssm_k_heads, c.ssm_v_heads);
            let channels = 2 * sd * hk + sd * hv;
            v.push(t(p("attn_qkv"), &[h, channels], dense));
            v.push(t(p("attn_gate"), &[h, sd * hv], dense));
            v.push(t(p("ssm_conv1d"), &[c.ssm_conv, channels], f32));
            v.push(t(pb("ssm_dt"), &[hv], f32));
            v.push(t(format!("blk.{i}.ssm_a"), &[hv], f32));
            v.push(t(p("ssm_beta"), &[h, hv], dense));
            v.push(t(p("ssm_alpha"), &[h, hv], dense));
            v.push(t(p("ssm_norm"), &[sd], f32));
            v.push(t(p("ssm_out"), &[sd * hv, h], dense));
        } else {
            let q_rows = if c.arch == Arch::Qwen35Moe { 2 * q_dim } else { q_dim };
            v.push(t(p("attn_q"), &[h, q_rows], dense));
            v.push(t(p("attn_k"), &[h, kv_dim], dense));
            v.push(t(p("attn_v"), &[h, kv_dim], dense));
            v.push(t(p("attn_output"), &[q_dim, h], dense));
            match c.arch {
                Arch::Qwen3Moe | Arch::Qwen35Moe => {
                    v.push(t(p("attn_q_norm"), &[c.head_dim], f32));
                    v.push(t(p("attn_k_norm"), &[c.head_dim], f32));
                }
                Arch::OlMoe => {
                    v.push(t(p("attn_q_norm"), &[q_dim], f32));
                    v.push(t(p("attn_k_norm"), &[kv_dim], f32));
                }
                Arch::GptOss => {
                    v.push(t(pb("attn_q"), &[q_dim], f32));
                    v.push(t(pb("attn_k"), &[kv_dim], f32));
                    v.push(t(pb("attn_v"), &[kv_dim], f32));
                    v.push(t(pb("attn_output"), &[h], f32));
                    v.push(t(p("attn_sinks"), &[c.heads], f32));
                }
            }
        }
        let ffn_norm =
            if matches!(c.arch, Arch::Qwen35Moe | Arch::GptOss) { "post_attention_norm" } else { "ffn_norm" };
        v.push(t(p(ffn_norm), &[h], f32));
        v.push(t(p("ffn_gate_inp"), &[h, e], f32));
        if c.arch == Arch::Qwen35Moe {
            v.push(t(p("ffn_gate_up_exps"), &[h, 2 * ff, e], c.quant.expert(false)));
        } else {
            v.push(t(p("ffn_gate_exps"), &[h, ff, e], c.quant.expert(false)));
            v.push(t(p("ffn_up_exps"), &[h, ff, e], c.quant.expert(false)));
        }
        v.push(t(p("ffn_down_exps"), &[ff, h, e], c.quant.expert(true)));
        if c.arch == Arch::GptOss {
            v.push(t(pb("ffn_gate_inp"), &[e], f32));
            v.push(t(pb("ffn_gate_exps"), &[ff, e], f32));
            v.push(t(pb("ffn_up_exps"), &[ff, e], f32));
            v.push(t(pb("ffn_down_exps"), &[h, e], f32));
        }
        if c.shared_ffn > 0 {
            v.push(t(p("ffn_gate_inp_shexp"), &[h], f32));
            v.push(t(p("ffn_gate_shexp"), &[h, c.shared_ffn], dense));
            v.push(t(p("ffn_up_shexp"), &[h, c.shared_ffn], dense));
            v.push(t(p("ffn_down_shexp"), &[c.shared_ffn, h], dense));
        }
    }
    v.push(t("output_norm.weight".into(), &[h], f32));
    if !c.tied_output {
        v.push(t("output.weight".into(), &[h, c.vocab], dense));
    }
    v
}

/// splitmix64: a tiny, fixed, seedable generator (the file must not change with a crate update).
/// A frozen copy, on purpose: the workspace's shared one is `moe_stats::SplitMix64`, but the
/// models written from these draws must stay byte-identical whatever happens to that crate, and
/// the engine depends on nothing of the observer's.
#[derive(Debug, Clone)]
pub struct SplitMix(u64);

impl SplitMix {
    pub fn new(seed: u64) -> SplitMix {
        SplitMix(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

fn mix(a: u64, b: u64) -> u64 {
    SplitMix::new(a ^ b.wrapping_mul(0xD6E8_FEB8_6659_FD93)).next_u64()
}

/// Built-in text the BPE merges are learned from.
const CORPUS: &str = "The quick brown fox jumps over the lazy dog. A model that does not fit in memory \
is decoded token by token, and every token touches the dense weights and a few experts. \
The engine maps the file, the kernel reads pages from the disk, and the observer measures \
where the time of each token goes: compute, faults, swap, reading, waiting. \
Hello world! This is a test of the tokenizer, with numbers like 12345 and 2026, \
punctuation, quotes 'like this', and words such as mixture, experts, attention, layer, \
memory, cache, page, decode, prompt, generation, speed, thread, weight, router. \
It is what it is; they're here, we've seen it, I'm sure you'll like it, he'd agree. \
In the beginning the universe was created. This has made a lot of people very angry \
and been widely regarded as a bad move. Once upon a time there was a little language model \
that wanted to run on a phone with less memory than its own weights.";

/// Learns up to `n` byte-level BPE merges from [`CORPUS`]. Returns merges as token-text pairs.
pub fn learn_merges(n: usize) -> Vec<(String, String)> {
    // Pre-split roughly like the qwen2 regex: words carry their leading space.
    let mut words: HashMap<Vec<String>, usize> = HashMap::new();
    let mut cur = String::new();
    let flush = |cur: &mut String, words: &mut HashMap<Vec<String>, usize>| {
        if !cur.is_empty() {
            let syms = cur.bytes().map(|b| bytes_to_token_text(&[b])).collect();
            *words.entry(syms).or_default() += 1;
            cur.clear();
        }
    };
    for ch in CORPUS.chars() {
        let alpha = ch.is_alphabetic();
        let starts_new = !alpha || !(cur.chars().last().is_some_and(|c| c.is_alphabetic() || c == ' '));
        if starts_new && !(alpha && cur == " ") {
            flush(&mut cur, &mut words);
        }
        cur.push(ch);
        if !alpha && ch != ' ' {
            flush(&mut cur, &mut words);
        }
    }
    flush(&mut cur, &mut words);

    let mut words: Vec<(Vec<String>, usize)> = words.into_iter().collect();
    words.sort();
    let mut merges = Vec::new();
    while merges.len() < n {
        let mut counts: HashMap<(String, String), usize> = HashMap::new();
        for (syms, f) in &words {
            for w in syms.windows(2) {
                *counts.entry((w[0].clone(), w[1].clone())).or_default() += f;
            }
        }
        // Most frequent pair, ties broken by the pair itself (deterministic).
        let Some((best, count)) = counts.into_iter().max_by(|a, b| a.1.cmp(&b.1).then_with(|| b.0.cmp(&a.0))) else {
            break;
        };
        if count < 2 {
            break;
        }
        let joined = format!("{}{}", best.0, best.1);
        for (syms, _) in &mut words {
            let mut out = Vec::with_capacity(syms.len());
            let mut i = 0;
            while i < syms.len() {
                if i + 1 < syms.len() && syms[i] == best.0 && syms[i + 1] == best.1 {
                    out.push(joined.clone());
                    i += 2;
                } else {
                    out.push(syms[i].clone());
                    i += 1;
                }
            }
            *syms = out;
        }
        merges.push(best);
    }
    merges
}

/// Vocabulary: (tokens, types, merges, eos id).
fn vocabulary(n_vocab: usize) -> (Vec<String>, Vec<i32>, Vec<String>, u32) {
    let mut tokens: Vec<String> = (0..=255u8).map(|b| bytes_to_token_text(&[b])).collect();
    let mut types = vec![TOKEN_NORMAL; 256];
    let room = n_vocab - 256 - SPECIALS.len();
    let merges = learn_merges(room.min(4000));
    let mut seen: std::collections::HashSet<String> = tokens.iter().cloned().collect();
    let mut merge_strs = Vec::new();
    for (a, b) in &merges {
        let t = format!("{a}{b}");
        if seen.insert(t.clone()) {
            tokens.push(t);
            types.push(TOKEN_NORMAL);
        }
        merge_strs.push(format!("{a} {b}"));
    }
    let mut i = 0;
    while tokens.len() < n_vocab - SPECIALS.len() {
        tokens.push(format!("<|unused_{i}|>"));
        types.push(TOKEN_UNUSED);
        i += 1;
    }
    let eos = tokens.len() as u32;
    for s in SPECIALS {
        tokens.push(s.to_owned());
        types.push(TOKEN_CONTROL);
    }
    (tokens, types, merge_strs, eos)
}

fn metadata(c: &SynthConfig) -> Vec<(String, Value)> {
    let u = |x: usize| Value::U32(x as u32);
    let a = c.arch.name();
    let (tokens, types, merges, eos) = vocabulary(c.vocab);
    // qwen3moe's feed_forward_length is the experts' total (llama.cpp divides it by the used
    // count when expert_feed_forward_length is absent); olmoe's is one expert's.
    let ffn_len = if c.arch == Arch::Qwen3Moe { c.expert_ffn * c.experts_used } else { c.expert_ffn };
    let mut m = vec![
        ("general.architecture".to_owned(), Value::String(a.into())),
        ("general.name".to_owned(), Value::String(format!("synthetic-{a}-{}", c.quant.name()))),
        ("general.alignment".to_owned(), Value::U32(32)),
        ("general.file_type".to_owned(), Value::U32(c.quant.file_type())),
        (format!("{a}.block_count"), u(c.layers)),
        (format!("{a}.context_length"), u(c.context)),
        (format!("{a}.embedding_length"), u(c.hidden)),
        (format!("{a}.feed_forward_length"), u(ffn_len)),
        (format!("{a}.attention.head_count"), u(c.heads)),
        (format!("{a}.attention.head_count_kv"), u(c.kv_heads)),
        (format!("{a}.attention.key_length"), u(c.head_dim)),
        (format!("{a}.attention.value_length"), u(c.head_dim)),
        (format!("{a}.rope.freq_base"), Value::F32(c.rope_base)),
        (format!("{a}.attention.layer_norm_rms_epsilon"), Value::F32(c.rms_eps)),
        (format!("{a}.expert_count"), u(c.experts)),
        (format!("{a}.expert_used_count"), u(c.experts_used)),
    ];
    if c.arch != Arch::OlMoe {
        m.push((format!("{a}.expert_feed_forward_length"), u(c.expert_ffn)));
    }
    if c.rope_dims > 0 {
        m.push((format!("{a}.rope.dimension_count"), u(c.rope_dims)));
    }
    if c.arch == Arch::Qwen35Moe {
        m.push((format!("{a}.expert_shared_feed_forward_length"), u(c.shared_ffn)));
        let sections = c.rope_sections.iter().map(|&x| Value::I32(x as i32)).collect();
        m.push((format!("{a}.rope.dimension_sections"), Value::Array(sections)));
        m.push((format!("{a}.full_attention_interval"), u(c.full_attn_interval)));
        m.push((format!("{a}.ssm.conv_kernel"), u(c.ssm_conv)));
        m.push((format!("{a}.ssm.state_size"), u(c.ssm_state)));
        m.push((format!("{a}.ssm.group_count"), u(c.ssm_k_heads)));
        m.push((format!("{a}.ssm.time_step_rank"), u(c.ssm_v_heads)));
        m.push((format!("{a}.ssm.inner_size"), u(c.ssm_state * c.ssm_v_heads)));
    }
    if c.arch == Arch::GptOss {
        m.push((format!("{a}.attention.sliding_window"), u(c.sliding_window)));
    }
    if c.yarn_factor > 0.0 {
        m.push((format!("{a}.rope.scaling.type"), Value::String("yarn".into())));
        m.push((format!("{a}.rope.scaling.factor"), Value::F32(c.yarn_factor)));
        m.push((format!("{a}.rope.scaling.original_context_length"), u(c.yarn_orig_ctx)));
    }
    m.extend([
        ("tokenizer.ggml.model".to_owned(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".to_owned(), Value::String("qwen2".into())),
        ("tokenizer.ggml.tokens".to_owned(), Value::Array(tokens.into_iter().map(Value::String).collect())),
        ("tokenizer.ggml.token_type".to_owned(), Value::Array(types.into_iter().map(Value::I32).collect())),
        ("tokenizer.ggml.merges".to_owned(), Value::Array(merges.into_iter().map(Value::String).collect())),
        ("tokenizer.ggml.eos_token_id".to_owned(), Value::U32(eos)),
        ("tokenizer.ggml.bos_token_id".to_owned(), Value::U32(eos)),
        ("tokenizer.ggml.padding_token_id".to_owned(), Value::U32(eos)),
        ("tokenizer.ggml.add_bos_token".to_owned(), Value::Bool(false)),
    ]);
    m.push(("synth.seed".to_owned(), Value::U64(c.seed)));
    m.push(("synth.router_skew".to_owned(), Value::F32(c.router_skew)));
    m.push(("synth.output_skew".to_owned(), Value::F32(c.output_skew)));
    m
}

/// How a tensor's values are drawn.
fn row_values(c: &SynthConfig, spec: &TensorSpec, tensor_seed: u64, row: u64, out: &mut [f32]) {
    let mut rng = SplitMix::new(mix(tensor_seed, row));
    let name = spec.name.as_str();
    let fan_in = spec.dims[0] as f32;
    if name.ends_with("norm.weight") {
        out.iter_mut().for_each(|x| *x = 1.0 + 0.1 * rng.uniform());
    } else if name.ends_with(".bias") && !name.ends_with("ssm_dt.bias") {
        out.iter_mut().for_each(|x| *x = 0.1 * rng.uniform());
    } else if name.ends_with("attn_sinks.weight") {
        out.iter_mut().for_each(|x| *x = rng.uniform());
    } else if name.ends_with("ssm_dt.bias") {
        out.iter_mut().for_each(|x| *x = -4.0 + 2.0 * rng.uniform());
    } else if name.ends_with("ssm_a") {
        out.iter_mut().for_each(|x| *x = -(8.5 + 7.5 * rng.uniform()));
    } else if name == "token_embd.weight" {
        out.iter_mut().for_each(|x| *x = rng.uniform());
    } else if name.ends_with("ffn_gate_inp.weight") {
        // Row `row` is expert `row`; its popularity rank is a per-tensor permutation.
        let n = spec.dims[1];
        let mut perm: Vec<u64> = (0..n).collect();
        let mut prng = SplitMix::new(tensor_seed);
        for i in (1..perm.len()).rev() {
            perm.swap(i, (prng.next_u64() % (i as u64 + 1)) as usize);
        }
        let rank = perm[row as usize] as f32;
        let scale = 4.0 * (3.0 / fan_in).sqrt() * (rank + 1.0).powf(-c.router_skew);
        out.iter_mut().for_each(|x| *x = scale * rng.uniform());
    } else if name == "output.weight" {
        // Token `row` gets a log-normal logit scale (σ = output_skew): like a real vocabulary, a few
        // tokens carry large logits, so greedy choices are rarely decided by a hair.
        let mut trng = SplitMix::new(mix(tensor_seed, u64::MAX - row));
        let z = (trng.uniform() + trng.uniform() + trng.uniform() + trng.uniform()) * 0.866; // ≈ N(0,1)
        let scale = 2.0 * (3.0 / fan_in).sqrt() * (c.output_skew * z).exp();
        out.iter_mut().for_each(|x| *x = scale * rng.uniform());
    } else {
        let mut scale = (3.0 / fan_in).sqrt();
        if ["attn_output.weight", "ssm_out.weight", "ffn_down_exps.weight", "ffn_down_shexp.weight"]
            .iter()
            .any(|r| name.ends_with(r))
        {
            // Residual-branch projections scaled by 1/sqrt(2·layers) (GPT-2's initialisation):
            // each layer nudges the residual stream instead of replacing it.
            scale /= (2.0 * c.layers as f32).sqrt();
        }
        out.iter_mut().for_each(|x| *x = scale * rng.uniform());
    }
}

/// Writes a configuration's header (metadata and tensor table) and a sparse data section of the
/// right size, without weights: files of the released models' sizes (tens of GB) for tests that
/// need only the structure (region map, hyperparameters), in no time and no disk space.
pub fn write_sparse(c: &SynthConfig, path: &Path) -> Result<(), SynthError> {
    c.validate()?;
    let io = |source| SynthError::Io { path: path.display().to_string(), source };
    let specs = tensor_specs(c);
    let header = crate::gguf::encode_header(&metadata(c), &specs, 32);
    let data: u64 = specs.iter().filter_map(TensorSpec::size).map(|b| b.next_multiple_of(32)).sum();
    std::fs::write(path, &header).map_err(io)?;
    let f = std::fs::OpenOptions::new().write(true).open(path).map_err(io)?;
    f.set_len((header.len() as u64).next_multiple_of(32) + data).map_err(io)
}

/// Writes a synthetic model to `path`; `progress` is called after each tensor.
pub fn write_model(
    c: &SynthConfig,
    path: &Path,
    threads: usize,
    mut progress: impl FnMut(&TensorSpec),
) -> Result<(), SynthError> {
    c.validate()?;
    let specs = tensor_specs(c);
    let io = |source| SynthError::Io { path: path.display().to_string(), source };
    let mut w = GgufWriter::create(path, &metadata(c), specs.clone()).map_err(io)?;
    let threads = threads.max(1);
    for (ti, spec) in specs.iter().enumerate() {
        let tensor_seed = mix(c.seed, ti as u64 + 1);
        let cols = spec.dims[0] as usize;
        let n_rows = spec.dims.iter().skip(1).product::<u64>() as usize;
        let rb = spec.ty.row_bytes(cols).unwrap_or(0);
        // Chunks of at most ~32 MiB, rows split across threads inside a chunk.
        let rows_per_chunk = ((32usize << 20) / rb.max(1)).clamp(1, n_rows.max(1));
        let start = w.position();
        let mut buf = vec![0u8; rows_per_chunk * rb];
        let mut r0 = 0;
        while r0 < n_rows {
            let nr = rows_per_chunk.min(n_rows - r0);
            let chunk = &mut buf[..nr * rb];
            let per_thread = nr.div_ceil(threads);
            let result: Result<(), quant::QuantError> = std::thread::scope(|s| {
                let handles: Vec<_> = chunk
                    .chunks_mut(per_thread * rb)
                    .enumerate()
                    .map(|(t, part)| {
                        s.spawn(move || {
                            let mut vals = vec![0f32; cols];
                            for (k, dst) in part.chunks_mut(rb).enumerate() {
                                let row = (r0 + t * per_thread + k) as u64;
                                row_values(c, spec, tensor_seed, row, &mut vals);
                                quant::quantize_row(spec.ty, &vals, dst)?;
                            }
                            Ok(())
                        })
                    })
                    .collect();
                handles.into_iter().try_for_each(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            });
            result.map_err(|source| SynthError::Quant { tensor: spec.name.clone(), source })?;
            w.write_chunk(chunk).map_err(io)?;
            r0 += nr;
        }
        w.end_tensor(start).map_err(io)?;
        progress(spec);
    }
    w.finish().map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_are_learned_and_deterministic() {
        let a = learn_merges(200);
        assert!(a.len() > 100, "only {} merges", a.len());
        assert_eq!(a, learn_merges(200));
        assert!(a.iter().any(|(l, r)| format!("{l}{r}") == "Ġthe" || l == "Ġ"), "{:?}", &a[..10]);
    }

    #[test]
    fn presets_are_valid_and_sized() {
        for p in PRESETS.split(", ") {
            let c = SynthConfig::preset(p).unwrap_or_else(|| panic!("preset {p}"));
            c.validate().unwrap_or_else(|e| panic!("preset {p}: {e}"));
        }
        let sizes: Vec<(&str, u64)> = ["small", "olmoe-bench", "qwen35moe-bench", "gpt-oss-bench"]
            .into_iter()
            .map(|p| (p, SynthConfig::preset(p).unwrap().total_bytes() >> 20))
            .collect();
        assert!(sizes.iter().all(|&(_, mib)| (380..650).contains(&mib)), "MiB: {sizes:?}");
    }

    #[test]
    fn bad_shapes_are_rejected_with_a_reason() {
        let mut c = SynthConfig::preset("tiny").unwrap();
        c.quant = QuantMix::Q4K;
        c.hidden = 96;
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("multiple of 256"), "{e}");
        let mut c = SynthConfig::preset("tiny").unwrap();
        c.heads = 3;
        assert!(c.validate().is_err());
    }
}
