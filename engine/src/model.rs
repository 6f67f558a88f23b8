//! `qwen3moe` decode: the model graph of llama.cpp's `src/models/qwen3moe.cpp`, on weights that
//! stay in the GGUF mapping.
//!
//! Per layer: `x += Wo·attn(rope(qnorm(Wq·n)), rope(knorm(Wk·n)), Wv·n)` with `n = rmsnorm(x)`,
//! then `x += Σ_k w_k · down_k(silu(gate_k·m) ⊙ up_k·m)` with `m = rmsnorm(x)` over the top-k
//! experts of `softmax(router·m)`, the k weights renormalised to sum 1. Finally
//! `logits = Wout·rmsnorm(x)` (`Wout` = `token_embd` when `output.weight` is absent).
//!
//! Numerics reproduce llama.cpp's CPU backend (a native x86 build, default context: flash
//! attention, F16 KV cache, repacked `Q4_K`) bit for bit when prompts are processed one token
//! at a time, so that greedy decoding agrees token for token and the logits are identical
//! (`cargo xtask parity`): activations are quantized to the weight's `vec_dot_type` before
//! every matrix product (`quant::quantize_activation`) and the kernels sum in ggml's float
//! order (`quant`); RMS norms sum squares in f64 and scale as `(x * s) * w`; RoPE angles are
//! built by repeated multiplication as in `ggml_rope_cache_init` and rotated with the fused
//! multiply-adds GCC makes of `rotate_pairs`; attention is [`crate::attention`] (ggml's flash
//! attention over the f16 cache, including its split of long KV views across threads); the
//! router softmax uses ggml's vector `exp` and horizontal sums (`vmath`); the expert outputs
//! are weighted and added in top-k order. Batched prompt steps compute every element with the
//! one-token operations (`quant::matvec_multi`), so they give the same bits as token-by-token
//! steps (below 256 positions; beyond, single-token steps split attention like llama.cpp);
//! llama.cpp's batched path switches to GEMM kernels and a tiled flash attention instead.
//!
//! Weights are referenced by byte ranges of the file ([`Weight::range`]) and read through
//! [`Model::bytes`], which serves dense ranges from the placement's anonymous copy under
//! `--dense anon|locked` ([`crate::placement`]).
//! [`Session::step`] runs one batch of tokens (a prompt chunk or one generated token): the unit
//! that per-token markers and telemetry wrap.

use std::ops::Range;
use std::path::Path;

use crate::attention::{self, AttnSplit, LayerKv};
use crate::gguf::{Gguf, GgufError, TensorInfo};
use crate::placement::{DensePolicy, ExpertPolicy, Placement, PlacementError};
use crate::pool::Pool;
use crate::quant::{self, GgmlType};
use crate::vmath;

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

#[derive(Debug, Clone)]
pub struct Config {
    pub arch: String,
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_rot: usize,
    pub n_expert: usize,
    pub n_expert_used: usize,
    pub n_ff_exp: usize,
    pub n_vocab: usize,
    pub n_ctx_train: usize,
    pub rope_base: f32,
    pub rms_eps: f32,
    pub expert_weights_scale: f32,
}

/// A 2-D weight matrix (`rows` rows of `cols` elements) stored in the file.
#[derive(Debug, Clone)]
pub struct Weight {
    pub name: String,
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    /// Absolute byte range in the file.
    pub range: Range<usize>,
}

/// A stack of per-expert matrices (`ffn_*_exps`): expert `e` is rows `e*rows..(e+1)*rows`,
/// one contiguous byte range.
#[derive(Debug, Clone)]
pub struct ExpertWeight {
    pub w: Weight,
    pub n_expert: usize,
    /// Rows per expert.
    pub rows: usize,
}

impl ExpertWeight {
    pub fn expert_range(&self, e: usize) -> Range<usize> {
        let per = self.w.range.len() / self.n_expert;
        self.w.range.start + e * per..self.w.range.start + (e + 1) * per
    }
}

#[derive(Debug)]
pub struct Layer {
    pub attn_norm: Vec<f32>,
    pub wq: Weight,
    pub wk: Weight,
    pub wv: Weight,
    pub wo: Weight,
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
    pub ffn_norm: Vec<f32>,
    pub router: Weight,
    pub gate_exps: ExpertWeight,
    pub up_exps: ExpertWeight,
    pub down_exps: ExpertWeight,
}

#[derive(Debug)]
pub struct Model {
    pub gguf: Gguf,
    pub cfg: Config,
    pub tok_embd: Weight,
    pub output_norm: Vec<f32>,
    pub output: Weight,
    pub layers: Vec<Layer>,
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
        let path = g.path().display().to_string();
        let bad = |what: String| ModelError::Bad { path: path.clone(), what };
        let arch = g.architecture()?.to_owned();
        if !arch.starts_with("qwen3moe") {
            return Err(bad(format!("architecture {arch:?} is not supported (qwen3moe only)")));
        }
        let a = arch.as_str();
        let key = |k: &str| -> Result<usize, ModelError> {
            let v = g.get_u64(&format!("{a}.{k}"))?;
            usize::try_from(v)
                .ok()
                .filter(|&v| v > 0 && v < (1 << 30))
                .ok_or_else(|| ModelError::Bad { path: path.clone(), what: format!("{a}.{k} = {v} is out of range") })
        };
        let n_embd = key("embedding_length")?;
        let n_head = key("attention.head_count")?;
        let n_head_kv = key("attention.head_count_kv")?;
        let head_dim = if g.get(&format!("{a}.attention.key_length")).is_some() {
            key("attention.key_length")?
        } else {
            n_embd / n_head
        };
        let n_rot =
            if g.get(&format!("{a}.rope.dimension_count")).is_some() { key("rope.dimension_count")? } else { head_dim };
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
        let n_ff_exp = if g.get(&format!("{a}.expert_feed_forward_length")).is_some() {
            key("expert_feed_forward_length")?
        } else {
            key("feed_forward_length")? / n_expert_used
        };
        let tok = g.tensor("token_embd.weight").ok_or_else(|| bad("tensor token_embd.weight is missing".into()))?;
        let n_vocab = tok.dims.get(1).copied().unwrap_or(0) as usize;
        let cfg = Config {
            arch: arch.clone(),
            n_layer: key("block_count")?,
            n_embd,
            n_head,
            n_head_kv,
            head_dim,
            n_rot,
            n_expert,
            n_expert_used,
            n_ff_exp,
            n_vocab,
            n_ctx_train: key("context_length")?,
            rope_base: g.get_f32(&format!("{a}.rope.freq_base")).unwrap_or(10_000.0),
            rms_eps: g.get_f32(&format!("{a}.attention.layer_norm_rms_epsilon"))?,
            expert_weights_scale: g.get_f32(&format!("{a}.expert_weights_scale")).unwrap_or(0.0),
        };

        let find = |name: &str| g.tensor(name).ok_or_else(|| bad(format!("tensor {name} is missing")));
        let check = |t: &TensorInfo, want: &[usize]| -> Result<(), ModelError> {
            let got: Vec<usize> = t.dims.iter().map(|&d| d as usize).collect();
            if got != want {
                return Err(bad(format!("tensor {} has shape {got:?}, expected {want:?}", t.name)));
            }
            if !t.ty.is_supported() {
                return Err(bad(format!("tensor {} has type {}, which the engine cannot compute", t.name, t.ty)));
            }
            Ok(())
        };
        let weight = |name: &str, cols: usize, rows: usize| -> Result<Weight, ModelError> {
            let t = find(name)?;
            check(t, &[cols, rows])?;
            Ok(Weight {
                name: name.to_owned(),
                ty: t.ty,
                rows,
                cols,
                range: t.offset as usize..(t.offset + t.size) as usize,
            })
        };
        let experts = |name: &str, cols: usize, rows: usize| -> Result<ExpertWeight, ModelError> {
            let t = find(name)?;
            check(t, &[cols, rows, n_expert])?;
            let w = Weight {
                name: name.to_owned(),
                ty: t.ty,
                rows: rows * n_expert,
                cols,
                range: t.offset as usize..(t.offset + t.size) as usize,
            };
            Ok(ExpertWeight { w, n_expert, rows })
        };
        let vector = |name: &str, n: usize| -> Result<Vec<f32>, ModelError> {
            let t = find(name)?;
            check(t, &[n])?;
            let mut v = vec![0f32; n];
            quant::dequantize_row(t.ty, g.tensor_data(t), &mut v)?;
            Ok(v)
        };

        let tok_embd = weight("token_embd.weight", n_embd, n_vocab)?;
        let output = if g.tensor("output.weight").is_some() {
            weight("output.weight", n_embd, n_vocab)?
        } else {
            tok_embd.clone()
        };
        let q_dim = n_head * head_dim;
        let kv_dim = n_head_kv * head_dim;
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let n = |s: &str| format!("blk.{i}.{s}.weight");
            layers.push(Layer {
                attn_norm: vector(&n("attn_norm"), n_embd)?,
                wq: weight(&n("attn_q"), n_embd, q_dim)?,
                wk: weight(&n("attn_k"), n_embd, kv_dim)?,
                wv: weight(&n("attn_v"), n_embd, kv_dim)?,
                wo: weight(&n("attn_output"), q_dim, n_embd)?,
                q_norm: vector(&n("attn_q_norm"), head_dim)?,
                k_norm: vector(&n("attn_k_norm"), head_dim)?,
                ffn_norm: vector(&n("ffn_norm"), n_embd)?,
                router: weight(&n("ffn_gate_inp"), n_embd, n_expert)?,
                gate_exps: experts(&n("ffn_gate_exps"), n_embd, n_ff_exp)?,
                up_exps: experts(&n("ffn_up_exps"), n_embd, n_ff_exp)?,
                down_exps: experts(&n("ffn_down_exps"), n_ff_exp, n_embd)?,
            });
        }
        let output_norm = vector("output_norm.weight", n_embd)?;
        // Placed last, once the file has been validated as a model.
        let placement = Placement::new(&g, dense, ExpertPolicy::Mmap)?;
        Ok(Model { gguf: g, cfg, tok_embd, output_norm, output, layers, placement })
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

/// Raw pointer to a buffer whose disjoint parts are written by different pool tasks.
#[derive(Clone, Copy)]
struct SharedMut<T>(*mut T, usize);
// SAFETY: used only inside `Pool::run` regions where every task writes a range no other task
// touches (documented at each use), and the buffer outlives the region.
unsafe impl<T: Send> Send for SharedMut<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for SharedMut<T> {}

impl<T> SharedMut<T> {
    fn new(s: &mut [T]) -> Self {
        SharedMut(s.as_mut_ptr(), s.len())
    }

    /// # Safety
    /// No other live reference may overlap `r` while the returned slice is used.
    #[expect(clippy::mut_from_ref, reason = "disjoint ranges handed to pool tasks")]
    unsafe fn slice(&self, r: Range<usize>) -> &mut [T] {
        assert!(r.start <= r.end && r.end <= self.1, "SharedMut range {r:?} outside 0..{}", self.1);
        // SAFETY: in bounds (checked above); exclusivity is the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(r.start), r.len()) }
    }
}

struct MatJob<'a> {
    w: &'a Weight,
    range: Range<usize>,
    rows: usize,
    xq: &'a [u8],
    xrow: usize,
    out: &'a mut [f32],
}

/// Which parts of a step took how long (filled by [`Session::step`]).
#[derive(Debug, Default, Clone, Copy)]
pub struct StepTimes {
    pub attention_ns: u64,
    pub experts_ns: u64,
    pub output_ns: u64,
}

/// Decoding state of one sequence: KV cache, position, scratch.
pub struct Session<'m> {
    pub model: &'m Model,
    pool: Pool,
    kv: Vec<LayerKv>,
    pos: usize,
    pub n_ctx: usize,
    logits: Vec<f32>,
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

/// Debugging aid for parity work: with `ENGINE_DUMP` set, prints a summary of each named
/// intermediate tensor (llama.cpp's names) and writes its values to `/tmp/engine-NAME.bin`;
/// with `ENGINE_DUMP_DIR=DIR`, writes every forward pass's tensors to `DIR/step-NNNN/NAME.bin`
/// (the layout of the parity runner's `PARITY_DUMP`, for a tensor-by-tensor comparison).
fn dump(name: &str, v: &[f32]) {
    use std::sync::atomic::Ordering;
    static DIR: std::sync::OnceLock<Option<std::ffi::OsString>> = std::sync::OnceLock::new();
    if let Some(dir) = DIR.get_or_init(|| std::env::var_os("ENGINE_DUMP_DIR")) {
        let dir = std::path::Path::new(dir).join(format!("step-{:04}", DUMP_STEP.load(Ordering::Relaxed)));
        let _ = std::fs::create_dir_all(&dir);
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        let _ = std::fs::write(dir.join(format!("{name}.bin")), bytes);
    }
    if std::env::var_os("ENGINE_DUMP").is_some() {
        let s: f64 = v.iter().map(|&x| f64::from(x)).sum();
        let a: f64 = v.iter().map(|&x| f64::from(x.abs())).sum();
        eprintln!("{name:<28} n={:<6} sum {s:.6} abs {a:.6} first {:?}", v.len(), &v[..4.min(v.len())]);
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        let _ = std::fs::write(format!("/tmp/engine-{name}.bin"), bytes);
    }
}

/// Forward passes so far in this process (the step number of [`dump`]).
static DUMP_STEP: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let sum: f64 = x.iter().map(|&v| f64::from(v * v)).sum();
    let mean = (sum / x.len() as f64) as f32;
    let scale = 1.0 / (mean + eps).sqrt();
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = (v * scale) * g;
    }
}

/// Rows per task for a matrix product over `rows` rows: enough tasks to balance, big enough to
/// amortise dispatch; multiples of 16.
fn row_chunk(rows: usize, threads: usize, batch: usize) -> usize {
    let target_tasks = threads * 4;
    let mut c = rows.div_ceil(target_tasks).next_multiple_of(16);
    if batch > 1 {
        c = c.min(64);
    }
    c.clamp(16, rows.max(16))
}

impl<'m> Session<'m> {
    pub fn new(model: &'m Model, threads: usize, n_ctx: usize) -> Session<'m> {
        let c = &model.cfg;
        Session {
            model,
            pool: Pool::new(threads),
            kv: (0..c.n_layer).map(|_| LayerKv::default()).collect(),
            pos: 0,
            n_ctx: n_ctx.min(c.n_ctx_train).max(1),
            logits: vec![0.0; c.n_vocab],
            times: StepTimes::default(),
            ubatch: MAX_BATCH,
            expert_counts: vec![vec![0; c.n_expert]; c.n_layer],
        }
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
        for l in &mut self.kv {
            l.clear();
        }
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

    /// `out[b*w.rows + r] = w[r] · x[b]` for every token `b`; `xq` holds the B activations
    /// quantized for `w.ty` (`xrow` bytes each).
    #[expect(clippy::too_many_arguments, reason = "one product's full description; see MatJob")]
    fn matmul(
        &self,
        w: &Weight,
        range: Range<usize>,
        rows: usize,
        xq: &[u8],
        xrow: usize,
        batch: usize,
        out: &mut [f32],
    ) {
        self.matmuls(&mut [MatJob { w, range, rows, xq, xrow, out }], batch);
    }

    /// Several independent products in one parallel region (e.g. Q, K and V), so that decode
    /// pays one fork-join instead of three. Products with few rows run on the caller.
    fn matmuls(&self, jobs: &mut [MatJob<'_>], batch: usize) {
        let threads = self.pool.threads();
        let mut tasks = Vec::new(); // (job, r0, r1)
        for (j, job) in jobs.iter().enumerate() {
            let chunk = row_chunk(job.rows, threads, batch);
            for r0 in (0..job.rows).step_by(chunk) {
                tasks.push((j, r0, (r0 + chunk).min(job.rows)));
            }
        }
        let outs: Vec<SharedMut<f32>> = jobs.iter_mut().map(|j| SharedMut::new(j.out)).collect();
        let jobs = &*jobs;
        let run = |t: usize| {
            let (j, r0, r1) = tasks[t];
            let job = &jobs[j];
            let bytes = self.model.bytes(job.range.clone());
            let xs: Vec<&[u8]> = (0..batch).map(|b| &job.xq[b * job.xrow..(b + 1) * job.xrow]).collect();
            let mut os: Vec<&mut [f32]> = (0..batch)
                // SAFETY: task t writes only rows r0..r1 of job j's output for each token; the
                // (job, row range) pairs of the tasks are disjoint.
                .map(|b| unsafe { outs[j].slice(b * job.rows + r0..b * job.rows + r1) })
                .collect();
            // One pass over the rows for all tokens (bit-identical to one matvec per token).
            quant::matvec_multi(job.w.ty, bytes, r0..r1, job.w.cols, &xs, &mut os);
        };
        let total_rows: usize = jobs.iter().map(|j| j.rows).sum();
        if total_rows * batch < 128 {
            (0..tasks.len()).for_each(run);
        } else {
            self.pool.run(tasks.len(), &run);
        }
    }

    fn quantize_batch(ty: GgmlType, x: &[f32], cols: usize, buf: &mut Vec<u8>) -> Result<usize, ModelError> {
        let mut row = Vec::new();
        buf.clear();
        let mut xrow = 0;
        for xb in x.chunks(cols) {
            quant::quantize_activation(ty, xb, &mut row)?;
            xrow = row.len();
            buf.extend_from_slice(&row);
        }
        Ok(xrow)
    }

    fn forward(&mut self, tokens: &[u32]) -> Result<(), ModelError> {
        let m = self.model;
        let c = &m.cfg;
        let bsz = tokens.len();
        let (d, hd) = (c.n_embd, c.head_dim);
        let (q_dim, kv_dim) = (c.n_head * hd, c.n_head_kv * hd);
        let pos0 = self.pos;

        // Embeddings.
        let mut x = vec![0f32; bsz * d];
        let erow = m.tok_embd.ty.row_bytes(d).unwrap_or(0);
        for (b, &t) in tokens.iter().enumerate() {
            let start = m.tok_embd.range.start + t as usize * erow;
            quant::dequantize_row(m.tok_embd.ty, m.bytes(start..start + erow), &mut x[b * d..(b + 1) * d])?;
        }
        dump("embd", &x);

        // RoPE cos/sin per token position (ggml_rope_cache_init with freq_scale 1, ext 0).
        let theta_scale = c.rope_base.powf(-2.0 / c.n_rot as f32);
        let mut rope = vec![0f32; bsz * hd];
        for b in 0..bsz {
            let mut theta = (pos0 + b) as f32;
            for i in 0..hd / 2 {
                rope[b * hd + 2 * i] = theta.cos();
                rope[b * hd + 2 * i + 1] = theta.sin();
                theta *= theta_scale;
            }
        }

        let mut xn = vec![0f32; bsz * d];
        let mut xq = Vec::new();
        let (mut xq_k, mut xq_v) = (Vec::<u8>::new(), Vec::<u8>::new());
        let mut q = vec![0f32; bsz * q_dim];
        let mut k = vec![0f32; bsz * kv_dim];
        let mut v = vec![0f32; bsz * kv_dim];
        let mut attn = vec![0f32; bsz * q_dim];
        let mut proj = vec![0f32; bsz * d];
        let mut tmp = vec![0f32; hd];
        let mut tmp2 = vec![0f32; hd];
        let group = c.n_head / c.n_head_kv;
        let kq_scale = 1.0 / (hd as f32).sqrt();
        let n_used = c.n_expert_used;
        let n_ff = c.n_ff_exp;

        for (il, layer) in m.layers.iter().enumerate() {
            let t_attn = std::time::Instant::now();
            for b in 0..bsz {
                rms_norm(&x[b * d..(b + 1) * d], &layer.attn_norm, c.rms_eps, &mut xn[b * d..(b + 1) * d]);
            }
            dump(&format!("attn_norm-{il}"), &xn);
            let qrow = Self::quantize_batch(layer.wq.ty, &xn, d, &mut xq)?;
            let krow = Self::quantize_batch(layer.wk.ty, &xn, d, &mut xq_k)?;
            let vrow = Self::quantize_batch(layer.wv.ty, &xn, d, &mut xq_v)?;
            self.matmuls(
                &mut [
                    MatJob {
                        w: &layer.wq,
                        range: layer.wq.range.clone(),
                        rows: q_dim,
                        xq: &xq,
                        xrow: qrow,
                        out: &mut q,
                    },
                    MatJob {
                        w: &layer.wk,
                        range: layer.wk.range.clone(),
                        rows: kv_dim,
                        xq: &xq_k,
                        xrow: krow,
                        out: &mut k,
                    },
                    MatJob {
                        w: &layer.wv,
                        range: layer.wv.range.clone(),
                        rows: kv_dim,
                        xq: &xq_v,
                        xrow: vrow,
                        out: &mut v,
                    },
                ],
                bsz,
            );

            // Q/K RMS norm per head, NEOX RoPE; K and V into the f16 cache.
            let rope_head = |h: &mut [f32], cs: &[f32], tmp: &mut [f32]| {
                let half = hd / 2;
                for i in 0..half {
                    let (x0, x1) = (h[i], h[i + half]);
                    let (cos, sin) = (cs[2 * i], cs[2 * i + 1]);
                    // ggml's `rotate_pairs`, `x0*cos - x1*sin` and `x0*sin + x1*cos`, as GCC
                    // compiles it for a native build (floating-point contraction is on in GNU
                    // C++ mode): the first product of each is fused with the addition.
                    tmp[i] = x0.mul_add(cos, -(x1 * sin));
                    tmp[i + half] = x0.mul_add(sin, x1 * cos);
                }
                h.copy_from_slice(&tmp[..hd]);
            };
            for b in 0..bsz {
                let cs = &rope[b * hd..(b + 1) * hd];
                for h in q[b * q_dim..(b + 1) * q_dim].chunks_mut(hd) {
                    tmp2.copy_from_slice(h);
                    rms_norm(&tmp2, &layer.q_norm, c.rms_eps, h);
                    rope_head(h, cs, &mut tmp);
                }
                for h in k[b * kv_dim..(b + 1) * kv_dim].chunks_mut(hd) {
                    tmp2.copy_from_slice(h);
                    rms_norm(&tmp2, &layer.k_norm, c.rms_eps, h);
                    rope_head(h, cs, &mut tmp);
                }
            }
            let kv = &mut self.kv[il];
            dump(&format!("Qcur-{il}"), &q);
            dump(&format!("Kcur-{il}"), &k);
            dump(&format!("Vcur-{il}"), &v);
            for b in 0..bsz {
                kv.push(&k[b * kv_dim..(b + 1) * kv_dim], &v[b * kv_dim..(b + 1) * kv_dim]);
            }
            let kv = &self.kv[il];

            // Attention (llama.cpp's CPU flash attention, see `attention`): one task per
            // (token, head).
            {
                let attn_p = SharedMut::new(&mut attn);
                let q = &q;
                let nth = self.pool.threads();
                self.pool.run(bsz * c.n_head, &|t| {
                    let (b, h) = (t / c.n_head, t % c.n_head);
                    let n_vis = pos0 + b + 1;
                    let mut q16 = vec![0u8; 2 * hd];
                    let qh = &q[b * q_dim + h * hd..b * q_dim + (h + 1) * hd];
                    quant::quantize_row(GgmlType::F16, qh, &mut q16).expect("f16 row of head_dim");
                    // ggml splits the KV cells across threads only for single-token batches.
                    let split = if bsz == 1 { AttnSplit::for_decode(n_vis - 1, nth) } else { None };
                    // SAFETY: task t alone writes head h of token b.
                    let o = unsafe { attn_p.slice(b * q_dim + h * hd..b * q_dim + (h + 1) * hd) };
                    attention::attend(&q16, &kv.k, &kv.v, kv_dim, h / group, n_vis, kq_scale, split, o);
                });
            }
            let xrow = Self::quantize_batch(layer.wo.ty, &attn, q_dim, &mut xq)?;
            dump(&format!("kqv_out-{il}"), &attn);
            self.matmul(&layer.wo, layer.wo.range.clone(), d, &xq, xrow, bsz, &mut proj);
            dump(&format!("attn_out-{il}"), &proj);
            for (xv, &p) in x.iter_mut().zip(&proj) {
                *xv += p;
            }
            self.times.attention_ns += t_attn.elapsed().as_nanos() as u64;

            // MoE.
            let t_moe = std::time::Instant::now();
            for b in 0..bsz {
                rms_norm(&x[b * d..(b + 1) * d], &layer.ffn_norm, c.rms_eps, &mut xn[b * d..(b + 1) * d]);
            }
            let mut router = vec![0f32; bsz * c.n_expert];
            dump(&format!("ffn_norm-{il}"), &xn[(bsz - 1) * d..]);
            let xrow = Self::quantize_batch(layer.router.ty, &xn, d, &mut xq)?;
            self.matmul(&layer.router, layer.router.range.clone(), c.n_expert, &xq, xrow, bsz, &mut router);
            dump(&format!("ffn_moe_logits-{il}"), &router);
            // selected[b*n_used + k] = (expert, weight)
            let mut selected = Vec::with_capacity(bsz * n_used);
            for b in 0..bsz {
                let p = &mut router[b * c.n_expert..(b + 1) * c.n_expert];
                vmath::softmax(p, false);
                let mut idx: Vec<usize> = (0..c.n_expert).collect();
                idx.sort_by(|&a, &b2| p[b2].total_cmp(&p[a]).then(a.cmp(&b2)));
                let top = &idx[..n_used];
                let sum = top.iter().map(|&e| f64::from(p[e])).sum::<f64>() as f32;
                let sum = sum.max(6.103_515_6e-5);
                for &e in top {
                    let mut w = p[e] / sum;
                    if c.expert_weights_scale != 0.0 && c.expert_weights_scale != 1.0 {
                        w *= c.expert_weights_scale;
                    }
                    selected.push((e, w));
                    self.expert_counts[il][e] += 1;
                }
            }
            // Group (token, slot) pairs by expert.
            let mut by_expert: Vec<(usize, Vec<usize>)> = Vec::new();
            {
                let mut slots_of: Vec<Vec<usize>> = vec![Vec::new(); c.n_expert];
                for (s, &(e, _)) in selected.iter().enumerate() {
                    slots_of[e].push(s);
                }
                for (e, slots) in slots_of.into_iter().enumerate() {
                    if !slots.is_empty() {
                        by_expert.push((e, slots));
                    }
                }
            }
            let (gty, uty, dty) = (layer.gate_exps.w.ty, layer.up_exps.w.ty, layer.down_exps.w.ty);
            let mut xq_up = Vec::new();
            let grow = Self::quantize_batch(gty, &xn, d, &mut xq)?;
            let urow = if uty.vec_dot_type() == gty.vec_dot_type() {
                0
            } else {
                Self::quantize_batch(uty, &xn, d, &mut xq_up)?
            };
            let n_slots = bsz * n_used;
            let mut hbuf = vec![0f32; n_slots * n_ff];
            {
                let chunk =
                    row_chunk(n_ff, self.pool.threads(), by_expert.iter().map(|e| e.1.len()).max().unwrap_or(1));
                let per = n_ff.div_ceil(chunk);
                let h_p = SharedMut::new(&mut hbuf);
                let (xq, xq_up, by_expert) = (&xq, &xq_up, &by_expert);
                self.pool.run(by_expert.len() * per, &|t| {
                    let (ei, ci) = (t / per, t % per);
                    let (e, slots) = &by_expert[ei];
                    let r0 = ci * chunk;
                    let r1 = (r0 + chunk).min(n_ff);
                    let gw = m.bytes(layer.gate_exps.expert_range(*e));
                    let uw = m.bytes(layer.up_exps.expert_range(*e));
                    let n = r1 - r0;
                    let mut g = vec![0f32; slots.len() * n];
                    let mut u = vec![0f32; slots.len() * n];
                    let xg: Vec<&[u8]> =
                        slots.iter().map(|&s| &xq[s / n_used * grow..(s / n_used + 1) * grow]).collect();
                    let xu: Vec<&[u8]> = if urow == 0 {
                        xg.clone()
                    } else {
                        slots.iter().map(|&s| &xq_up[s / n_used * urow..(s / n_used + 1) * urow]).collect()
                    };
                    quant::matvec_multi(gty, gw, r0..r1, d, &xg, &mut g.chunks_mut(n).collect::<Vec<_>>());
                    quant::matvec_multi(uty, uw, r0..r1, d, &xu, &mut u.chunks_mut(n).collect::<Vec<_>>());
                    for (k, &s) in slots.iter().enumerate() {
                        // SAFETY: slot s belongs to exactly one expert and rows r0..r1 to one
                        // task of that expert.
                        let h = unsafe { h_p.slice(s * n_ff + r0..s * n_ff + r1) };
                        vmath::swiglu(&g[k * n..(k + 1) * n], &u[k * n..(k + 1) * n], h);
                    }
                });
            }
            let hrow = Self::quantize_batch(dty, &hbuf, n_ff, &mut xq)?;
            dump(&format!("ffn_moe_swiglu-{il}"), &hbuf[(bsz - 1) * n_used * n_ff..]);
            let mut down = vec![0f32; n_slots * d];
            {
                let chunk = row_chunk(d, self.pool.threads(), by_expert.iter().map(|e| e.1.len()).max().unwrap_or(1));
                let per = d.div_ceil(chunk);
                let down_p = SharedMut::new(&mut down);
                let (xq, by_expert) = (&xq, &by_expert);
                self.pool.run(by_expert.len() * per, &|t| {
                    let (ei, ci) = (t / per, t % per);
                    let (e, slots) = &by_expert[ei];
                    let r0 = ci * chunk;
                    let r1 = (r0 + chunk).min(d);
                    let dw = m.bytes(layer.down_exps.expert_range(*e));
                    let xs: Vec<&[u8]> = slots.iter().map(|&s| &xq[s * hrow..(s + 1) * hrow]).collect();
                    let mut os: Vec<&mut [f32]> = slots
                        .iter()
                        // SAFETY: as above, (slot, row range) pairs are disjoint across tasks.
                        .map(|&s| unsafe { down_p.slice(s * d + r0..s * d + r1) })
                        .collect();
                    quant::matvec_multi(dty, dw, r0..r1, n_ff, &xs, &mut os);
                });
            }
            for b in 0..bsz {
                let xb = &mut x[b * d..(b + 1) * d];
                let acc = &mut proj[..d];
                for kk in 0..n_used {
                    let s = b * n_used + kk;
                    let w = selected[s].1;
                    let e = &down[s * d..(s + 1) * d];
                    if kk == 0 {
                        acc.iter_mut().zip(e).for_each(|(a, &v)| *a = v * w);
                    } else {
                        acc.iter_mut().zip(e).for_each(|(a, &v)| *a += v * w);
                    }
                }
                for (xv, &a) in xb.iter_mut().zip(acc.iter()) {
                    *xv += a;
                }
            }
            self.times.experts_ns += t_moe.elapsed().as_nanos() as u64;
            dump(&format!("ffn_moe_down-{il}"), &down[(bsz - 1) * n_used * d..]);
            dump(&format!("l_out-{il}"), &x[(bsz - 1) * d..]);
        }

        // Output for the last token only.
        let t_out = std::time::Instant::now();
        let last = &x[(bsz - 1) * d..bsz * d];
        let mut xl = vec![0f32; d];
        rms_norm(last, &m.output_norm, c.rms_eps, &mut xl);
        dump("result_norm", &xl);
        let xrow = Self::quantize_batch(m.output.ty, &xl, d, &mut xq)?;
        let mut logits = std::mem::take(&mut self.logits);
        self.matmul(&m.output, m.output.range.clone(), c.n_vocab, &xq, xrow, 1, &mut logits);
        self.logits = logits;
        dump("result_output", &self.logits);
        self.times.output_ns += t_out.elapsed().as_nanos() as u64;
        self.pos += bsz;
        DUMP_STEP.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
}
