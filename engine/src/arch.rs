//! Architectures: what a GGUF file's `general.architecture` selects.
//!
//! # Spec
//! An architecture is
//! 1. its hyperparameters, read from the `{arch}.*` metadata keys ([`Config::read`]);
//! 2. for every layer, which attention block and which feed-forward block it runs, with their
//!    tensors ([`Arch::load_layer`], giving a [`Layer`] whose [`Attention`] and [`Ffn`] variants
//!    are the block kinds).
//!
//! Every layer has the pre-norm residual shape of the models llama.cpp's `src/models/*.cpp`
//! build: `x += attention(rmsnorm(x, attn_norm))`, then `x += ffn(rmsnorm(x, ffn_norm))`;
//! embeddings come first and the [`output`](crate::blocks::output) block (final norm, vocabulary
//! projection) last. The blocks are in [`crate::blocks`], the loop that runs them is
//! `Session::forward` in [`crate::model`].
//!
//! | `general.architecture` | attention, every layer | feed-forward, every layer |
//! |---|---|---|
//! | `qwen3moe` | [`Attention::Full`]: RoPE (NEOX), per-head Q/K RMS norm, GQA, f16 KV cache | [`Ffn::Moe`]: softmax router, top-k renormalised to sum 1, SwiGLU experts |
//!
//! Any other architecture is refused with an error naming it and this list.
//!
//! Adding an architecture: a variant of [`Arch`] with its GGUF name, its keys in
//! [`Config::read`], its layers in [`Arch::load_layer`], and a new block (a new [`Attention`] or
//! [`Ffn`] variant) only for what the existing ones do not compute. What the planned ones need
//! beyond today's blocks (from llama.cpp's `src/models/{qwen35moe,openai-moe,olmoe}.cpp`):
//! - `qwen35moe`: a gated DeltaNet linear-attention block (with a recurrent state per layer
//!   instead of a KV cache) in the layers the metadata marks recurrent (all but every
//!   `full_attention_interval`-th, by default 4th; its FFN norm is named `attn_post_norm`), a
//!   full attention whose Q projection also yields a sigmoid output gate and whose RoPE is
//!   partial and multi-section (`ggml_rope_multi`), merged `ffn_gate_up_exps`, and a shared
//!   expert beside the routed ones (a [`crate::blocks::dense_ffn`] scaled by
//!   `sigmoid(ffn_gate_inp_shexp·x)`, added to the MoE output);
//! - `gpt-oss`: attention sinks, sliding-window layers, biases on the projections, router and
//!   experts, softmax over the top-k logits (`SOFTMAX_WEIGHT` gating), the clamped `swiglu_oai`
//!   activation and MXFP4 experts;
//! - `olmoe`: a Q/K RMS norm over all heads at once, top-k weights without renormalisation.

use crate::blocks::dense_ffn::DenseFfn;
use crate::blocks::moe::Moe;
use crate::blocks::self_attn::SelfAttn;
use crate::blocks::weights::Tensors;
use crate::gguf::Gguf;
use crate::model::ModelError;

/// The architectures the engine runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Qwen3Moe,
}

impl Arch {
    pub const ALL: [Arch; 1] = [Arch::Qwen3Moe];

    /// The `general.architecture` value that selects it (also the prefix of its metadata keys).
    pub fn name(self) -> &'static str {
        match self {
            Arch::Qwen3Moe => "qwen3moe",
        }
    }

    pub fn from_name(name: &str) -> Option<Arch> {
        Arch::ALL.into_iter().find(|a| a.name() == name)
    }

    /// The supported names, comma-separated (for error messages).
    pub fn supported() -> String {
        Arch::ALL.map(Arch::name).join(", ")
    }

    /// Layer `il`'s blocks and their tensors.
    pub fn load_layer(self, t: &Tensors<'_>, c: &Config, il: usize) -> Result<Layer, ModelError> {
        let n = |s: &str| format!("blk.{il}.{s}.weight");
        match self {
            Arch::Qwen3Moe => Ok(Layer {
                attn_norm: t.vector(&n("attn_norm"), c.n_embd)?,
                attn: Attention::Full(SelfAttn::load(t, c, il)?),
                ffn_norm: t.vector(&n("ffn_norm"), c.n_embd)?,
                ffn: Ffn::Moe(Moe::load(t, c, il)?),
            }),
        }
    }
}

impl std::fmt::Display for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
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
    /// Dimensions of each head that RoPE rotates (all of them today).
    pub n_rot: usize,
    pub n_expert: usize,
    pub n_expert_used: usize,
    /// Rows of each expert's gate and up matrices.
    pub n_ff_exp: usize,
    pub n_vocab: usize,
    pub n_ctx_train: usize,
    pub rope_base: f32,
    pub rms_eps: f32,
    /// Factor on the top-k weights (`expert_weights_scale`; 0 or 1 = none).
    pub expert_weights_scale: f32,
}

impl Config {
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
        let n_embd = key("embedding_length")?;
        let n_head = key("attention.head_count")?;
        let n_head_kv = key("attention.head_count_kv")?;
        let head_dim = if has("attention.key_length") { key("attention.key_length")? } else { n_embd / n_head };
        let n_rot = if has("rope.dimension_count") { key("rope.dimension_count")? } else { head_dim };
        if n_rot != head_dim || head_dim % 2 != 0 {
            return Err(bad(format!("rope dimension {n_rot} must equal the (even) head dim {head_dim}")));
        }
        if n_head % n_head_kv != 0 {
            return Err(bad(format!("head count {n_head} is not a multiple of kv head count {n_head_kv}")));
        }
        let n_expert = key("expert_count")?;
        let n_expert_used = key("expert_used_count")?;
        if n_expert_used > n_expert {
            return Err(bad(format!("expert_used_count {n_expert_used} > expert_count {n_expert}")));
        }
        let n_ff_exp = if has("expert_feed_forward_length") {
            key("expert_feed_forward_length")?
        } else {
            key("feed_forward_length")? / n_expert_used
        };
        let tok = g.tensor("token_embd.weight").ok_or_else(|| bad("tensor token_embd.weight is missing".into()))?;
        Ok(Config {
            arch,
            n_layer: key("block_count")?,
            n_embd,
            n_head,
            n_head_kv,
            head_dim,
            n_rot,
            n_expert,
            n_expert_used,
            n_ff_exp,
            n_vocab: tok.dims.get(1).copied().unwrap_or(0) as usize,
            n_ctx_train: key("context_length")?,
            rope_base: g.get_f32(&format!("{a}.rope.freq_base")).unwrap_or(10_000.0),
            rms_eps: g.get_f32(&format!("{a}.attention.layer_norm_rms_epsilon"))?,
            expert_weights_scale: g.get_f32(&format!("{a}.expert_weights_scale")).unwrap_or(0.0),
        })
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
    /// Softmax attention over all earlier positions ([`crate::blocks::self_attn`]).
    Full(SelfAttn),
}

/// The feed-forward block kinds.
#[derive(Debug)]
pub enum Ffn {
    /// Routed experts ([`crate::blocks::moe`]).
    Moe(Moe),
    /// One SwiGLU FFN for every token ([`crate::blocks::dense_ffn`]).
    Dense(DenseFfn),
}

impl Layer {
    pub fn self_attn(&self) -> Option<&SelfAttn> {
        match &self.attn {
            Attention::Full(a) => Some(a),
        }
    }

    pub fn moe(&self) -> Option<&Moe> {
        match &self.ffn {
            Ffn::Moe(m) => Some(m),
            Ffn::Dense(_) => None,
        }
    }
}
