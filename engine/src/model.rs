//! The model and a decoding session: the forward pass built from blocks.
//!
//! [`Model`] is a GGUF file's architecture ([`crate::arch`]: hyperparameters and, per layer, an
//! attention block and a feed-forward block with their tensors) on weights that stay in the
//! mapping: every matrix is a byte range of the file ([`Weight::range`]) read through
//! [`Model::bytes`], which serves dense ranges from the placement's anonymous copy under
//! `--dense anon|locked` ([`crate::placement`]). [`Session::step`] runs one batch of tokens (a
//! prompt chunk or one generated token): the unit that per-token markers and telemetry wrap.
//!
//! # The forward pass
//! ```text
//! x = embed(tokens)                                          blocks::embed
//! for each layer:
//!     x += attention(rmsnorm(x, attn_norm))                  blocks::self_attn | blocks::delta_net
//!     x += ffn(rmsnorm(x, ffn_norm))                         blocks::moe | blocks::dense_ffn
//! logits = output(x[last])                                   blocks::output
//! ```
//! (`Session::forward`; each block's module states what it computes and which ggml operations it
//! reproduces.)
//!
//! # Per-sequence memory
//! A session keeps, per layer, what its attention block carries from token to token
//! ([`LayerState`]): the f16 KV cache of a full-attention layer (growing to the context), the KV
//! ring of a sliding-window layer, or the f32 convolution and recurrent state of a DeltaNet layer
//! (fixed size). [`Config::state_bytes`] gives their total for a context length; `run` prints it
//! at start.
//!
//! Numerics reproduce llama.cpp's CPU backend (a native x86 build, default context: flash
//! attention, F16 KV cache, repacked `Q4_K`) bit for bit when prompts are processed one token
//! at a time, so that greedy decoding agrees token for token and the logits are identical
//! (`cargo xtask parity`): activations are quantized to the weight's `vec_dot_type` before
//! every matrix product and the kernels sum in ggml's float order (`quant`); norms, RoPE,
//! attention, softmax and the expert sum follow ggml operation by operation (see the blocks).
//! Batched prompt steps compute every element with the one-token operations
//! (`quant::matvec_multi`), so they give the same bits as token-by-token steps (below 256
//! positions; beyond, single-token steps split attention like llama.cpp); llama.cpp's batched
//! path switches to GEMM kernels and a tiled flash attention instead.

use std::ops::Range;
use std::path::Path;
use std::time::Instant;

pub use crate::arch::{Arch, Attention, Config, Ffn, Layer, Mixer, StateBytes};
use crate::attention::LayerKv;
use crate::blocks::delta_net::{self, DeltaState};
use crate::blocks::weights::Tensors;
use crate::blocks::{self, Ctx, dense_ffn, embed, moe, output, self_attn};
pub use crate::blocks::{ExpertWeight, Weight};
use crate::gguf::{Gguf, GgufError};
use crate::placement::{DensePolicy, ExpertPolicy, Placement, PlacementError};
use crate::pool::Pool;
use crate::quant;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("{path}: {what}")]
    Bad { path: String, what: String },
    #[error("token id {id} is out of range (vocabulary of {n})")]
    BadToken { id: u32, n: usize },
    #[error("context full: {pos} + {n} tokens exceed the context length {ctx}")]
    ContextFull { pos: usize, n: usize, ctx: usize },
    #[error("quant: {0}")]
    Quant(#[from] quant::QuantError),
    #[error(transparent)]
    Placement(#[from] PlacementError),
}

#[derive(Debug)]
pub struct Model {
    pub gguf: Gguf,
    pub cfg: Config,
    pub tok_embd: Weight,
    pub layers: Vec<Layer>,
    pub output_norm: Vec<f32>,
    /// The vocabulary projection (`output.weight`, or `token_embd.weight` when absent).
    pub output: Weight,
    /// Where the dense weights are served from ([`crate::placement`]).
    pub placement: Placement,
}

impl Model {
    /// Loads with the dense weights on the file mapping.
    pub fn load(path: impl AsRef<Path>) -> Result<Model, ModelError> {
        Self::load_with(path, DensePolicy::Mmap)
    }

    /// Loads and places the dense weights by `dense` (experts stay on the mapping).
    pub fn load_with(path: impl AsRef<Path>, dense: DensePolicy) -> Result<Model, ModelError> {
        Self::from_gguf_with(Gguf::open(path)?, dense)
    }

    pub fn from_gguf(g: Gguf) -> Result<Model, ModelError> {
        Self::from_gguf_with(g, DensePolicy::Mmap)
    }

    pub fn from_gguf_with(g: Gguf, dense: DensePolicy) -> Result<Model, ModelError> {
        let cfg = Config::read(&g)?;
        let t = Tensors::new(&g);
        let (d, n_vocab) = (cfg.n_embd, cfg.n_vocab);
        let tok_embd = t.matrix("token_embd.weight", d, n_vocab)?;
        let layers = (0..cfg.n_layer).map(|il| cfg.arch.load_layer(&t, &cfg, il)).collect::<Result<Vec<_>, _>>()?;
        let output_norm = t.vector("output_norm.weight", d)?;
        let output = if t.has("output.weight") { t.matrix("output.weight", d, n_vocab)? } else { tok_embd.clone() };
        // Placed last, once the file has been validated as a model.
        let placement = Placement::new(&g, dense, ExpertPolicy::Mmap)?;
        Ok(Model { gguf: g, cfg, tok_embd, layers, output_norm, output, placement })
    }

    /// The bytes of a weight range: the anonymous copy for a dense range under `anon`/`locked`,
    /// the file mapping otherwise (both hold the same bytes).
    #[inline]
    pub fn bytes(&self, r: Range<usize>) -> &[u8] {
        match self.placement.dense_copy(&r) {
            Some(b) => b,
            None => &self.gguf.bytes()[r],
        }
    }
}

/// Which parts of a step took how long (filled by [`Session::step`]).
#[derive(Debug, Default, Clone, Copy)]
pub struct StepTimes {
    /// Attention blocks with their input norms and residual adds.
    pub attention_ns: u64,
    /// Feed-forward (expert) blocks with their input norms and residual adds.
    pub experts_ns: u64,
    pub output_ns: u64,
}

/// The buffers of a forward pass, grown to the largest batch and reused.
#[derive(Debug, Default)]
struct Scratch {
    /// The hidden state (`n x n_embd`).
    x: Vec<f32>,
    /// A block's normed input.
    xn: Vec<f32>,
    /// A block's output, added to `x`.
    y: Vec<f32>,
    rope: self_attn::Rope,
    attn: self_attn::Scratch,
    delta: delta_net::Scratch,
    moe: moe::Scratch,
    ffn: dense_ffn::DenseScratch,
    output: output::Scratch,
}

/// What one layer keeps from token to token.
#[derive(Debug)]
pub enum LayerState {
    /// KV cache of an attention layer (a ring for a sliding-window one).
    Kv(LayerKv),
    /// Convolution and recurrent state of a DeltaNet layer.
    Delta(DeltaState),
}

impl LayerState {
    fn new(c: &Config, il: usize, n_ctx: usize) -> LayerState {
        match (c.mixers[il], &c.ssm) {
            (Mixer::Full, _) => LayerState::Kv(LayerKv::default()),
            (Mixer::Window, _) => LayerState::Kv(LayerKv::ring(crate::arch::window_cells(c.n_swa, n_ctx))),
            (Mixer::DeltaNet, Some(ssm)) => LayerState::Delta(DeltaState::new(ssm)),
            (Mixer::DeltaNet, None) => unreachable!("Config::read gives DeltaNet layers an ssm shape"),
        }
    }

    fn clear(&mut self) {
        match self {
            LayerState::Kv(kv) => kv.clear(),
            LayerState::Delta(d) => d.clear(),
        }
    }
}

/// Decoding state of one sequence: KV caches and recurrent states, position, scratch.
pub struct Session<'m> {
    pub model: &'m Model,
    /// Where the MoE blocks read expert weights ([`Session::with_experts`]; the model's mapping by default).
    experts: &'m dyn moe::ExpertWeights,
    pool: Pool,
    state: Vec<LayerState>,
    pos: usize,
    pub n_ctx: usize,
    logits: Vec<f32>,
    scratch: Scratch,
    pub times: StepTimes,
    /// Tokens per forward pass when a step gets several (prompt processing).
    pub ubatch: usize,
    /// Expert selections since the start, per layer and expert (popularity).
    pub expert_counts: Vec<Vec<u64>>,
}

impl std::fmt::Debug for Session<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Session(pos {}, {:?})", self.pos, self.pool)
    }
}

/// Largest number of tokens processed in one batch (llama.cpp's n_ubatch analogue).
pub const MAX_BATCH: usize = 256;

impl<'m> Session<'m> {
    pub fn new(model: &'m Model, threads: usize, n_ctx: usize) -> Session<'m> {
        let c = &model.cfg;
        let n_ctx = n_ctx.min(c.n_ctx_train).max(1);
        Session {
            model,
            experts: model,
            pool: Pool::new(threads),
            state: (0..c.n_layer).map(|il| LayerState::new(c, il, n_ctx)).collect(),
            pos: 0,
            n_ctx,
            logits: vec![0.0; c.n_vocab],
            scratch: Scratch::default(),
            times: StepTimes::default(),
            ubatch: MAX_BATCH,
            expert_counts: vec![vec![0; c.n_expert]; c.n_layer],
        }
    }

    /// Reads expert weights from `experts` instead of the model's mapping (e.g. an expert cache).
    pub fn with_experts(mut self, experts: &'m dyn moe::ExpertWeights) -> Self {
        self.experts = experts;
        self
    }

    pub fn pos(&self) -> usize {
        self.pos
    }

    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    /// Forgets the sequence (keeps the allocations).
    pub fn reset(&mut self) {
        self.pos = 0;
        for l in &mut self.state {
            l.clear();
        }
    }

    /// The KV and recurrent-state bytes this session holds now (grows with the position up to
    /// [`Session::state_bytes`]).
    pub fn held_state_bytes(&self) -> StateBytes {
        let mut b = StateBytes::default();
        for st in &self.state {
            match st {
                LayerState::Kv(kv) => b.kv += (kv.k.len() + kv.v.len()) as u64,
                LayerState::Delta(d) => b.recurrent += d.bytes() as u64,
            }
        }
        b
    }

    /// The KV and recurrent-state bytes this session holds at its full context
    /// ([`Config::state_bytes`] of [`Session::n_ctx`]).
    pub fn state_bytes(&self) -> StateBytes {
        self.model.cfg.state_bytes(self.n_ctx)
    }

    /// Evaluates `tokens` (at most [`MAX_BATCH`]; longer prompts are split) at the current
    /// position and returns the logits of the last one.
    pub fn step(&mut self, tokens: &[u32]) -> Result<&[f32], ModelError> {
        let n_vocab = self.model.cfg.n_vocab;
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= n_vocab) {
            return Err(ModelError::BadToken { id, n: n_vocab });
        }
        if self.pos + tokens.len() > self.n_ctx {
            return Err(ModelError::ContextFull { pos: self.pos, n: tokens.len(), ctx: self.n_ctx });
        }
        for chunk in tokens.chunks(self.ubatch.clamp(1, MAX_BATCH)) {
            self.forward(chunk)?;
        }
        Ok(&self.logits)
    }

    pub fn logits(&self) -> &[f32] {
        &self.logits
    }

    /// One forward pass of `tokens` (the module docs' loop).
    fn forward(&mut self, tokens: &[u32]) -> Result<(), ModelError> {
        let m = self.model;
        let c = &m.cfg;
        let (n, d) = (tokens.len(), c.n_embd);
        let Scratch { x, xn, y, rope, attn, delta, moe, ffn, output } = &mut self.scratch;
        let (x, xn, y) = (blocks::sized(x, n * d), blocks::sized(xn, n * d), blocks::sized(y, n * d));
        rope.set(c, self.pos, n);
        let ctx = Ctx { model: m, pool: &self.pool, experts: self.experts, n, pos0: self.pos, rope };

        let ffn_norm_name =
            if matches!(c.arch, Arch::Qwen35Moe | Arch::GptOss) { "attn_post_norm" } else { "ffn_norm" };
        embed::forward(&ctx, &m.tok_embd, tokens, x)?;
        blocks::dump("embd", None, x);
        for (il, layer) in m.layers.iter().enumerate() {
            let t = Instant::now();
            blocks::rms_norm_rows(x, &layer.attn_norm, c.rms_eps, xn);
            blocks::dump("attn_norm", Some(il), xn);
            match (&layer.attn, &mut self.state[il]) {
                (Attention::Full(w), LayerState::Kv(kv)) => self_attn::forward(&ctx, il, w, kv, xn, attn, y)?,
                (Attention::DeltaNet(w), LayerState::Delta(st)) => delta_net::forward(&ctx, il, w, st, xn, delta, y)?,
                _ => unreachable!("layer {il}: the session's state follows the config's mixers"),
            }
            blocks::add(x, y);
            self.times.attention_ns += t.elapsed().as_nanos() as u64;

            let t = Instant::now();
            blocks::rms_norm_rows(x, &layer.ffn_norm, c.rms_eps, xn);
            blocks::dump(ffn_norm_name, Some(il), &xn[(n - 1) * d..]);
            match &layer.ffn {
                Ffn::Moe(w) => moe::forward(&ctx, il, w, &mut self.expert_counts[il], xn, moe, y)?,
                Ffn::Dense(w) => dense_ffn::forward(&ctx, w, xn, ffn, y)?,
            }
            blocks::add(x, y);
            self.times.experts_ns += t.elapsed().as_nanos() as u64;
            blocks::dump("l_out", Some(il), &x[(n - 1) * d..]);
        }

        let t = Instant::now();
        output::forward(&ctx, &m.output_norm, &m.output, &x[(n - 1) * d..], output, &mut self.logits)?;
        self.times.output_ns += t.elapsed().as_nanos() as u64;
        self.pos += n;
        blocks::DUMP_STEP.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
}
