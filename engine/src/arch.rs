//! Architectures: what a GGUF file's `general.architecture` selects.
//!
//! # Spec
//! An architecture is
//! 1. its hyperparameters, read from the `{arch}.*` metadata keys ([`Config::read`]), among them
//!    the kind of every layer's token mixer ([`Config::mixers`]);
//! 2. for every layer, which attention block and which feed-forward block it runs, with their
//!    tensors ([`Arch::load_layer`], giving a [`Layer`] whose [`Attention`] and [`Ffn`] variants
//!    are the block kinds, and whose options are the arch's variants of a block).
//!
//! Every layer has the pre-norm residual shape of the models llama.cpp's `src/models/*.cpp`
//! build: `x += attention(rmsnorm(x, attn_norm))`, then `x += ffn(rmsnorm(x, ffn_norm))`;
//! embeddings come first and the [`output`](crate::blocks::output) block (final norm, vocabulary
//! projection) last. The blocks are in [`crate::blocks`], the loop that runs them is
//! `Session::forward` in [`crate::model`].
//!
//! | `general.architecture` | attention | feed-forward, every layer |
//! |---|---|---|
//! | `qwen3moe` | every layer [`Attention::Full`]: RoPE (NEOX), per-head Q/K RMS norm, GQA, f16 KV cache | [`Ffn::Moe`]: softmax router, top-k renormalised to sum 1, SwiGLU experts |
//! | `olmoe` | every layer [`Attention::Full`] with one Q and one K RMS norm over all heads at once (`attn_{q,k}_norm` of `n_embd` values) | [`Ffn::Moe`]: softmax router, top-k weights *not* renormalised |
//! | `qwen35moe` | [`Attention::DeltaNet`] (gated DeltaNet: causal conv1d + recurrent state) in the layers the metadata marks recurrent (`attention.recurrent_layers`, else all but every `full_attention_interval`-th, default 4th); the others [`Attention::Full`] with an output gate (the Q projection yields `[q, gate]` per head, `o *= sigmoid(gate)`) and partial multi-section RoPE (`rope.dimension_count` of `key_length` dims, `rope.dimension_sections`) | [`Ffn::Moe`] with merged `ffn_gate_up_exps` and a shared expert (`dense_ffn`, scaled by `sigmoid(ffn_gate_inp_shexp·x)`); the FFN norm is `post_attention_norm` |
//! | `gpt-oss` | every layer [`Attention::Full`] with biases on Q, K, V and the output, a learned sink logit per head (`attn_sinks`), every other layer (even ones) a sliding window of `attention.sliding_window` positions, YaRN RoPE | [`Ffn::Moe`] with a router bias, softmax over the top-k logits (`SOFTMAX_WEIGHT`), per-expert biases and the clamped `swiglu_oai` activation; MXFP4 experts; the FFN norm is `post_attention_norm` |
//!
//! Any other architecture is refused with an error naming it and this list.
//!
//! Adding an architecture: a variant of [`Arch`] with its GGUF name, its keys in
//! [`Config::read`], its layers in [`Arch::load_layer`], and a new block (a new [`Attention`] or
//! [`Ffn`] variant) or a block option only for what the existing ones do not compute.

use crate::blocks::delta_net::DeltaNet;
use crate::blocks::dense_ffn::DenseFfn;
use crate::blocks::moe::{Gating, Moe, MoeOptions};
use crate::blocks::self_attn::{QkNorm, SelfAttn, SelfAttnOptions};
use crate::blocks::weights::Tensors;
use crate::gguf::Gguf;
use crate::model::ModelError;

/// The architectures the engine runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Arch {
    Qwen3Moe,
    OlMoe,
    Qwen35Moe,
    GptOss,
}

impl Arch {
    pub const ALL: [Arch; 4] = [Arch::Qwen3Moe, Arch::OlMoe, Arch::Qwen35Moe, Arch::GptOss];

    /// The `general.architecture` value that selects it (also the prefix of its metadata keys).
    pub fn name(self) -> &'static str {
        match self {
            Arch::Qwen3Moe => "qwen3moe",
            Arch::OlMoe => "olmoe",
            Arch::Qwen35Moe => "qwen35moe",
            Arch::GptOss => "gpt-oss",
        }
    }

    pub fn from_name(name: &str) -> Option<Arch> {
        Arch::ALL.into_iter().find(|a| a.name() == name)
    }

    /// The supported names, comma-separated (for error messages).
    pub fn supported() -> String {
        Arch::ALL.map(Arch::name).join(", ")
    }

    /// The name of the norm before the feed-forward block.
    fn ffn_norm(self) -> &'static str {
        match self {
            Arch::Qwen3Moe | Arch::OlMoe => "ffn_norm",
            Arch::Qwen35Moe | Arch::GptOss => "post_attention_norm",
        }
    }

    /// Layer `il`'s blocks and their tensors.
    pub fn load_layer(self, t: &Tensors<'_>, c: &Config, il: usize) -> Result<Layer, ModelError> {
        let n = |s: &str| format!("blk.{il}.{s}.weight");
        let attn_opts = match self {
            Arch::Qwen3Moe => SelfAttnOptions { qk_norm: QkNorm::PerHead, ..Default::default() },
            Arch::OlMoe => SelfAttnOptions { qk_norm: QkNorm::AllHeads, ..Default::default() },
            Arch::Qwen35Moe => SelfAttnOptions { qk_norm: QkNorm::PerHead, output_gate: true, ..Default::default() },
            Arch::GptOss => SelfAttnOptions {
                qk_norm: QkNorm::None,
                biases: true,
                sinks: true,
                window: if c.mixers[il] == Mixer::Window { c.n_swa } else { 0 },
                ..Default::default()
            },
        };
        let attn = match c.mixers[il] {
            Mixer::DeltaNet => Attention::DeltaNet(DeltaNet::load(t, c, il)?),
            Mixer::Full | Mixer::Window => Attention::Full(SelfAttn::load(t, c, il, attn_opts)?),
        };
        let moe_opts = match self {
            Arch::Qwen3Moe => MoeOptions { norm_w: true, ..Default::default() },
            Arch::OlMoe => MoeOptions { norm_w: false, ..Default::default() },
            Arch::Qwen35Moe => MoeOptions { norm_w: true, shared: true, ..Default::default() },
            Arch::GptOss => MoeOptions {
                norm_w: false,
                gating: Gating::SoftmaxWeight,
                biases: true,
                oai_swiglu: true,
                shared: false,
            },
        };
        Ok(Layer {
            attn_norm: t.vector(&n("attn_norm"), c.n_embd)?,
            attn,
            ffn_norm: t.vector(&n(self.ffn_norm()), c.n_embd)?,
            ffn: Ffn::Moe(Box::new(Moe::load(t, c, il, moe_opts)?)),
        })
    }
}

impl std::fmt::Display for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The token mixer of a layer (what its attention block is).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mixer {
    /// Softmax attention over every earlier position (KV cache of the whole context).
    Full,
    /// Softmax attention over the last [`Config::n_swa`] positions (a KV ring of that many cells
    /// plus a batch).
    Window,
    /// Gated DeltaNet: a recurrent state of fixed size instead of a KV cache.
    DeltaNet,
}

/// YaRN RoPE scaling (`rope.scaling.type = yarn`), with llama.cpp's context defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Yarn {
    /// `1 / rope.scaling.factor`.
    pub freq_scale: f32,
    /// `rope.scaling.original_context_length`.
    pub n_ctx_orig: usize,
    /// 1 (llama.cpp's `yarn_ext_factor` for YaRN).
    pub ext_factor: f32,
    /// The magnitude factor llama.cpp's context derives (`yarn_attn_factor`).
    pub attn_factor: f32,
    pub beta_fast: f32,
    pub beta_slow: f32,
}

/// The gated DeltaNet's shape (`{arch}.ssm.*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ssm {
    /// `ssm.conv_kernel`: taps of the causal convolution.
    pub d_conv: usize,
    /// `ssm.state_size`: the dimension of a K/V head (`S`).
    pub d_state: usize,
    /// `ssm.group_count`: K (and Q) heads.
    pub n_k_heads: usize,
    /// `ssm.time_step_rank`: V heads (and states).
    pub n_v_heads: usize,
}

impl Ssm {
    pub fn key_dim(&self) -> usize {
        self.d_state * self.n_k_heads
    }

    pub fn value_dim(&self) -> usize {
        self.d_state * self.n_v_heads
    }

    /// Channels of the convolution: Q, K and V side by side.
    pub fn conv_channels(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }

    /// f32 values of a layer's convolution state (`d_conv - 1` inputs per channel).
    pub fn conv_state_len(&self) -> usize {
        (self.d_conv - 1) * self.conv_channels()
    }

    /// f32 values of a layer's recurrent state (an `S x S` matrix per V head).
    pub fn ssm_state_len(&self) -> usize {
        self.d_state * self.d_state * self.n_v_heads
    }
}

/// Hyperparameters.
#[derive(Debug, Clone)]
pub struct Config {
    pub arch: Arch,
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// Dimensions of each head that RoPE rotates (the first `n_rot`; all of them unless partial).
    pub n_rot: usize,
    /// `rope.dimension_sections` (multi-section RoPE; all zero = plain NEOX).
    pub rope_sections: [usize; 4],
    pub yarn: Option<Yarn>,
    pub n_expert: usize,
    pub n_expert_used: usize,
    /// Rows of each expert's gate and up matrices.
    pub n_ff_exp: usize,
    /// Rows of the shared expert's gate and up matrices (0 = no shared expert).
    pub n_ff_shexp: usize,
    pub n_vocab: usize,
    pub n_ctx_train: usize,
    pub rope_base: f32,
    pub rms_eps: f32,
    /// Factor on the top-k weights (`expert_weights_scale`; 0 or 1 = none).
    pub expert_weights_scale: f32,
    /// Sliding window of the [`Mixer::Window`] layers (0 = none).
    pub n_swa: usize,
    /// The gated DeltaNet's shape (`qwen35moe`).
    pub ssm: Option<Ssm>,
    /// Every layer's token mixer.
    pub mixers: Vec<Mixer>,
}

/// KV cells of a sliding-window layer for a context of `n_ctx`: the window plus a batch, padded
/// to 256 and at most the padded context (llama.cpp's SWA cache with `n_ubatch = 256`, whose
/// cells the engine fills in the same order; see [`crate::attention`]).
pub fn window_cells(n_swa: usize, n_ctx: usize) -> usize {
    let pad = |n: usize| n.next_multiple_of(256);
    pad(pad(n_ctx).min(n_swa + crate::model::MAX_BATCH))
}

/// What a session's per-layer memory holds for a context length (see [`Config::state_bytes`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StateBytes {
    /// f16 K and V of the attention layers (full ones: every position; windowed ones: their ring).
    pub kv: u64,
    /// f32 convolution and recurrent states of the DeltaNet layers (independent of the context).
    pub recurrent: u64,
}

impl StateBytes {
    pub fn total(&self) -> u64 {
        self.kv + self.recurrent
    }
}

impl Config {
    /// Bytes a session of context `n_ctx` keeps per sequence beside the weights: the KV cache of
    /// the attention layers and the recurrent state of the DeltaNet layers (what `run` prints at
    /// start and what an expert cache's automatic size must leave free).
    pub fn state_bytes(&self, n_ctx: usize) -> StateBytes {
        let kv_cell = (2 * self.n_head_kv * self.head_dim * 2) as u64; // K and V, f16
        let mut s = StateBytes::default();
        for m in &self.mixers {
            match m {
                Mixer::Full => s.kv += kv_cell * n_ctx as u64,
                Mixer::Window => s.kv += kv_cell * window_cells(self.n_swa, n_ctx).min(n_ctx) as u64,
                Mixer::DeltaNet => {
                    if let Some(ssm) = &self.ssm {
                        s.recurrent += 4 * (ssm.conv_state_len() + ssm.ssm_state_len()) as u64;
                    }
                }
            }
        }
        s
    }

    /// Selects the architecture by `general.architecture` and reads its hyperparameters.
    pub fn read(g: &Gguf) -> Result<Config, ModelError> {
        let path = g.path().display().to_string();
        let bad = |what: String| ModelError::Bad { path: path.clone(), what };
        let name = g.architecture()?;
        let arch = Arch::from_name(name).ok_or_else(|| {
            bad(format!("architecture {name:?} is not supported (the engine runs: {})", Arch::supported()))
        })?;
        let a = arch.name();
        let has = |k: &str| g.get(&format!("{a}.{k}")).is_some();
        let key = |k: &str| -> Result<usize, ModelError> {
            let v = g.get_u64(&format!("{a}.{k}"))?;
            usize::try_from(v)
                .ok()
                .filter(|&v| v > 0 && v < (1 << 30))
                .ok_or_else(|| bad(format!("{a}.{k} = {v} is out of range")))
        };
        let opt_key = |k: &str| if has(k) { key(k).map(Some) } else { Ok(None) };
        let n_layer = key("block_count")?;
        let n_embd = key("embedding_length")?;
        let n_head = key("attention.head_count")?;
        let n_head_kv = key("attention.head_count_kv")?;
        let head_dim = opt_key("attention.key_length")?.unwrap_or(n_embd / n_head);
        if let Some(v) = opt_key("attention.value_length")?
            && v != head_dim
        {
            return Err(bad(format!("{a}.attention.value_length {v} differs from the key length {head_dim}")));
        }
        let n_rot = opt_key("rope.dimension_count")?.unwrap_or(head_dim);
        if n_rot > head_dim || n_rot % 2 != 0 || head_dim % 2 != 0 {
            return Err(bad(format!("rope dimension {n_rot} must be even and at most the (even) head dim {head_dim}")));
        }
        if n_head % n_head_kv != 0 {
            return Err(bad(format!("head count {n_head} is not a multiple of kv head count {n_head_kv}")));
        }
        let mut rope_sections = [0usize; 4];
        if let Some(v) = g.get(&format!("{a}.rope.dimension_sections")) {
            let vals = v.as_array().unwrap_or(&[]);
            for (s, x) in rope_sections.iter_mut().zip(vals) {
                *s =
                    x.as_u64().and_then(|x| usize::try_from(x).ok()).filter(|&x| x < (1 << 20)).ok_or_else(|| {
                        bad(format!("{a}.rope.dimension_sections must be 4 small non-negative integers"))
                    })?;
            }
            if rope_sections.iter().sum::<usize>() > head_dim / 2 {
                return Err(bad(format!("{a}.rope.dimension_sections {rope_sections:?} exceed the head's pairs")));
            }
        }
        let n_expert = key("expert_count")?;
        let n_expert_used = key("expert_used_count")?;
        if n_expert_used > n_expert {
            return Err(bad(format!("expert_used_count {n_expert_used} > expert_count {n_expert}")));
        }
        let n_ff_exp = match (arch, opt_key("expert_feed_forward_length")?) {
            (_, Some(n)) => n,
            // OLMoE's feed_forward_length is the expert FFN's (llama.cpp builds its experts from n_ff).
            (Arch::OlMoe, None) => key("feed_forward_length")?,
            (Arch::GptOss, None) => return Err(bad(format!("{a}.expert_feed_forward_length is missing"))),
            _ => key("feed_forward_length")? / n_expert_used,
        };
        let n_ff_shexp = match arch {
            Arch::Qwen35Moe => opt_key("expert_shared_feed_forward_length")?.unwrap_or(n_ff_exp),
            _ => 0,
        };
        if arch == Arch::OlMoe && (n_head * head_dim != n_embd || n_head_kv != n_head) {
            return Err(bad(format!(
                "olmoe needs head_count x head dim = embedding_length and head_count_kv = head_count \
                 (its Q and K norms have n_embd values); got {n_head} x {head_dim} vs {n_embd}, kv heads {n_head_kv}"
            )));
        }
        let ssm = if arch == Arch::Qwen35Moe {
            let ssm = Ssm {
                d_conv: key("ssm.conv_kernel")?,
                d_state: key("ssm.state_size")?,
                n_k_heads: key("ssm.group_count")?,
                n_v_heads: key("ssm.time_step_rank")?,
            };
            let inner = key("ssm.inner_size")?;
            if inner != ssm.value_dim() || !ssm.n_v_heads.is_multiple_of(ssm.n_k_heads) || ssm.d_conv < 2 {
                return Err(bad(format!(
                    "{a}.ssm: inner_size {inner} must be state_size x time_step_rank ({} x {}), time_step_rank a \
                     multiple of group_count ({}), conv_kernel at least 2 ({})",
                    ssm.d_state, ssm.n_v_heads, ssm.n_k_heads, ssm.d_conv
                )));
            }
            Some(ssm)
        } else {
            None
        };
        let n_swa = if arch == Arch::GptOss { key("attention.sliding_window")? } else { 0 };
        let mixers = Self::read_mixers(g, arch, n_layer).map_err(bad)?;
        let yarn = Self::read_yarn(g, a).map_err(bad)?;
        let tok = g.tensor("token_embd.weight").ok_or_else(|| bad("tensor token_embd.weight is missing".into()))?;
        Ok(Config {
            arch,
            n_layer,
            n_embd,
            n_head,
            n_head_kv,
            head_dim,
            n_rot,
            rope_sections,
            yarn,
            n_expert,
            n_expert_used,
            n_ff_exp,
            n_ff_shexp,
            n_vocab: tok.dims.get(1).copied().unwrap_or(0) as usize,
            n_ctx_train: key("context_length")?,
            rope_base: g.get_f32(&format!("{a}.rope.freq_base")).unwrap_or(10_000.0),
            rms_eps: g.get_f32(&format!("{a}.attention.layer_norm_rms_epsilon"))?,
            expert_weights_scale: g.get_f32(&format!("{a}.expert_weights_scale")).unwrap_or(0.0),
            n_swa,
            ssm,
            mixers,
        })
    }

    /// Every layer's mixer, by llama.cpp's rules for the architecture.
    fn read_mixers(g: &Gguf, arch: Arch, n_layer: usize) -> Result<Vec<Mixer>, String> {
        let a = arch.name();
        let flags = |k: &str| -> Result<Option<Vec<bool>>, String> {
            let Some(v) = g.get(&format!("{a}.{k}")) else { return Ok(None) };
            let vals = v.as_array().ok_or_else(|| format!("{a}.{k} must be an array"))?;
            if vals.len() < n_layer {
                return Err(format!("{a}.{k} has {} entries for {n_layer} layers", vals.len()));
            }
            Ok(Some(vals[..n_layer].iter().map(|x| x.as_bool().or(x.as_u64().map(|u| u != 0)) == Some(true)).collect()))
        };
        Ok(match arch {
            Arch::Qwen3Moe | Arch::OlMoe => vec![Mixer::Full; n_layer],
            Arch::Qwen35Moe => {
                let recurrent = match flags("attention.recurrent_layers")? {
                    Some(f) => f,
                    None => {
                        let every =
                            g.get(&format!("{a}.full_attention_interval")).and_then(|v| v.as_u64()).unwrap_or(4);
                        if every == 0 {
                            return Err(format!("{a}.full_attention_interval must be positive"));
                        }
                        (0..n_layer as u64).map(|i| (i + 1) % every != 0).collect()
                    }
                };
                recurrent.into_iter().map(|r| if r { Mixer::DeltaNet } else { Mixer::Full }).collect()
            }
            Arch::GptOss => {
                // llama.cpp's load_swa_pattern(2): layer il slides when il % 2 < 1, unless the
                // file lists the pattern.
                let swa = flags("attention.sliding_window_pattern")?
                    .unwrap_or_else(|| (0..n_layer).map(|il| il % 2 == 0).collect());
                swa.into_iter().map(|s| if s { Mixer::Window } else { Mixer::Full }).collect()
            }
        })
    }

    /// YaRN parameters when `rope.scaling.type` is `yarn` (llama.cpp's `llama_context`
    /// defaults: ext factor 1, beta fast 32, beta slow 1, attention factor from the scaling
    /// factor and `rope.scaling.attn_factor`; llama.cpp's generic loader reads no
    /// `rope.scaling.yarn_*` keys for these architectures, so neither does this).
    fn read_yarn(g: &Gguf, a: &str) -> Result<Option<Yarn>, String> {
        let ty = g.get(&format!("{a}.rope.scaling.type")).and_then(|v| v.as_str().map(str::to_owned));
        match ty.as_deref() {
            None | Some("none") => return Ok(None),
            Some("yarn") => {}
            Some(other) => return Err(format!("{a}.rope.scaling.type = {other:?} is not supported (none, yarn)")),
        }
        if g.get_f32(&format!("{a}.rope.scaling.yarn_log_multiplier")).is_ok_and(|m| m != 0.0) {
            return Err(format!("{a}.rope.scaling.yarn_log_multiplier (DeepSeek's YaRN variant) is not supported"));
        }
        let factor = g.get_f32(&format!("{a}.rope.scaling.factor")).unwrap_or(0.0);
        let freq_scale = if factor == 0.0 { 1.0 } else { 1.0 / factor };
        let n_ctx_orig =
            g.get(&format!("{a}.rope.scaling.original_context_length"))
                .and_then(|v| v.as_u64())
                .ok_or_else(|| format!("{a}.rope.scaling.original_context_length is missing"))? as usize;
        // llama_context: attn_factor = get_mscale(factor) = 0.1 ln(factor) + 1 (for factor > 1),
        // then divided by (1 + 0.1 ln(1/freq_scale)) because ggml's rope_yarn multiplies it back,
        // then times rope.scaling.attn_factor.
        let mscale = |s: f32| if s <= 1.0 { 1.0 } else { 0.1 * s.ln() + 1.0 };
        let mut attn_factor = mscale(1.0 / freq_scale);
        attn_factor *= 1.0 / (1.0 + 0.1 * (1.0 / freq_scale).ln());
        attn_factor *= g.get_f32(&format!("{a}.rope.scaling.attn_factor")).unwrap_or(1.0);
        Ok(Some(Yarn { freq_scale, n_ctx_orig, ext_factor: 1.0, attn_factor, beta_fast: 32.0, beta_slow: 1.0 }))
    }

    /// The layers with a KV cache.
    pub fn is_attention(&self, il: usize) -> bool {
        self.mixers[il] != Mixer::DeltaNet
    }
}

/// One layer: two pre-norm residual blocks.
#[derive(Debug)]
pub struct Layer {
    pub attn_norm: Vec<f32>,
    pub attn: Attention,
    pub ffn_norm: Vec<f32>,
    pub ffn: Ffn,
}

/// The attention block kinds.
#[derive(Debug)]
pub enum Attention {
    /// Softmax attention over earlier positions ([`crate::blocks::self_attn`]).
    Full(SelfAttn),
    /// Gated DeltaNet linear attention ([`crate::blocks::delta_net`]).
    DeltaNet(DeltaNet),
}

/// The feed-forward block kinds.
#[derive(Debug)]
pub enum Ffn {
    /// Routed experts ([`crate::blocks::moe`]).
    Moe(Box<Moe>),
    /// One SwiGLU FFN for every token ([`crate::blocks::dense_ffn`]).
    Dense(DenseFfn),
}

impl Layer {
    pub fn self_attn(&self) -> Option<&SelfAttn> {
        match &self.attn {
            Attention::Full(a) => Some(a),
            Attention::DeltaNet(_) => None,
        }
    }

    pub fn moe(&self) -> Option<&Moe> {
        match &self.ffn {
            Ffn::Moe(m) => Some(&**m),
            Ffn::Dense(_) => None,
        }
    }
}
