//! Full (softmax) self-attention with RoPE, Q/K RMS norms, grouped-query heads and an f16 KV
//! cache: llama.cpp's `build_attn` path of `src/models/{qwen3moe,olmoe,qwen35moe,openai-moe}.cpp`.
//!
//! # Spec
//! For the `n` normed input rows `xn` of a batch at positions `pos0..pos0+n`:
//! ```text
//! Q = Wq·xn (+ bq), K = Wk·xn (+ bk), V = Wv·xn (+ bv)
//!                                    one parallel region (3 x ggml_mul_mat), biases by ggml_add
//! output gate (qwen35moe): Q has 2·head_dim values per head, [q_h, gate_h]; q_h is the query
//! Q/K norm: per head h = rmsnorm(h, q_norm | k_norm) (qwen3moe, qwen35moe), or one RMS norm over
//!           all heads of the token (olmoe), or none (gpt-oss)       ggml_rms_norm + ggml_mul
//! RoPE on the first n_rot dims of each head of Q and K              ggml_rope_ext / _multi (NEOX)
//! cache += f16(K), f16(V)                                           ggml_set_rows into the F16 cache
//! per token b, query head h (KV head h / (n_head / n_head_kv)):
//!   o = softmax(K·q / sqrt(head_dim) [, sink_h]) V over the visible cells
//!                                    ggml_flash_attn_ext ([`crate::attention`]), sinks, SWA mask
//! o *= sigmoid(gate)                 (qwen35moe; ggml_sigmoid, libm expf)
//! out = Wo·o (+ bo)                  ggml_mul_mat, ggml_add
//! ```
//! RoPE ([`Rope`]): position `p`, pair `i` of `0..n_rot/2` rotates by
//! `θ = p · base^(-2i/n_rot)`, the angles built by repeated multiplication
//! (`theta *= theta_scale`, as `ggml_rope_cache_init`); NEOX pairs element `i` with
//! `i + n_rot/2`, dimensions from `n_rot` on are copied; the rotation uses the fused
//! multiply-adds GCC makes of ggml's `rotate_pairs`. Multi-section RoPE (`qwen35moe`'s
//! interleaved `IMROPE`) gives text tokens the same position in its time, height and width
//! sections, so only pairs of the fourth ("extra") section differ: their position is 0, so
//! `θ = 0` (`ggml_mrope_cache_init`). YaRN (`gpt-oss`) is `rope_yarn`: `θ_interp = freq_scale·θ`,
//! ramp-mixed with `θ` over the correction dims, `cos θ · mscale`, `sin θ · mscale`. The attention
//! rows are one pool task per (token, head).

use crate::arch::{Config, Yarn};
use crate::attention::{self, AttnSplit, LayerKv, Visible};
use crate::blocks::weights::Tensors;
use crate::blocks::{Ctx, MatJob, QRows, SharedMut, Weight, dump, rms_norm, sized};
use crate::model::ModelError;
use crate::quant::{self, GgmlType};

/// Which RMS norm the queries and keys get before RoPE.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QkNorm {
    /// None (`gpt-oss`).
    #[default]
    None,
    /// Each head on its own, weights of `head_dim` values (`qwen3moe`, `qwen35moe`).
    PerHead,
    /// All heads of a token at once, weights of `n_head·head_dim` values (`olmoe`).
    AllHeads,
}

/// The architecture's variant of the block.
#[derive(Debug, Clone, Copy, Default)]
pub struct SelfAttnOptions {
    pub qk_norm: QkNorm,
    /// Q projection yields `[q, gate]` per head; the output is gated by `sigmoid(gate)`.
    pub output_gate: bool,
    /// Biases on the Q, K, V and output projections.
    pub biases: bool,
    /// A learned sink logit per head (`attn_sinks`).
    pub sinks: bool,
    /// Sliding window in positions (0 = attend to the whole context).
    pub window: usize,
}

/// The tensors of a full-attention block.
#[derive(Debug)]
pub struct SelfAttn {
    pub wq: Weight,
    pub wk: Weight,
    pub wv: Weight,
    pub wo: Weight,
    /// RMS norm weights of Q and K (`head_dim` values per head, or all heads'; empty for none).
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
    /// Biases of Q, K, V and the output (empty without biases).
    pub bq: Vec<f32>,
    pub bk: Vec<f32>,
    pub bv: Vec<f32>,
    pub bo: Vec<f32>,
    /// Sink logit per head (empty without sinks).
    pub sinks: Vec<f32>,
    pub opts: SelfAttnOptions,
}

impl SelfAttn {
    /// `blk.{il}.attn_{q,k,v,output}.weight`, the norms, biases and sinks `opts` asks for.
    pub fn load(t: &Tensors<'_>, c: &Config, il: usize, opts: SelfAttnOptions) -> Result<SelfAttn, ModelError> {
        let n = |s: &str| format!("blk.{il}.{s}.weight");
        let b = |s: &str| format!("blk.{il}.{s}.bias");
        let (q_dim, kv_dim) = (c.n_head * c.head_dim, c.n_head_kv * c.head_dim);
        let q_rows = if opts.output_gate { 2 * q_dim } else { q_dim };
        let (q_norm, k_norm) = match opts.qk_norm {
            QkNorm::None => (Vec::new(), Vec::new()),
            QkNorm::PerHead => (t.vector(&n("attn_q_norm"), c.head_dim)?, t.vector(&n("attn_k_norm"), c.head_dim)?),
            QkNorm::AllHeads => (t.vector(&n("attn_q_norm"), q_dim)?, t.vector(&n("attn_k_norm"), kv_dim)?),
        };
        let bias = |s: &str, len: usize| if opts.biases { t.vector(&b(s), len) } else { Ok(Vec::new()) };
        Ok(SelfAttn {
            wq: t.matrix(&n("attn_q"), c.n_embd, q_rows)?,
            wk: t.matrix(&n("attn_k"), c.n_embd, kv_dim)?,
            wv: t.matrix(&n("attn_v"), c.n_embd, kv_dim)?,
            wo: t.matrix(&n("attn_output"), q_dim, c.n_embd)?,
            q_norm,
            k_norm,
            bq: bias("attn_q", q_dim)?,
            bk: bias("attn_k", kv_dim)?,
            bv: bias("attn_v", kv_dim)?,
            bo: bias("attn_output", c.n_embd)?,
            sinks: if opts.sinks { t.vector(&n("attn_sinks"), c.n_head)? } else { Vec::new() },
            opts,
        })
    }
}

/// RoPE factors of a batch's positions: `cos θ, sin θ` per rotated pair, `n_rot` values per token.
#[derive(Debug, Default)]
pub struct Rope {
    cs: Vec<f32>,
    n_rot: usize,
}

/// `rope_yarn` of ggml-cpu for pair `i0/2` with angle `theta_extrap`: `(cos, sin)`.
fn rope_yarn(y: &Yarn, corr: [f32; 2], i0: usize, theta_extrap: f32) -> (f32, f32) {
    let theta_interp = y.freq_scale * theta_extrap;
    let mut theta = theta_interp;
    let mut mscale = y.attn_factor;
    if y.ext_factor != 0.0 {
        let ramp = {
            let v = ((i0 / 2) as f32 - corr[0]) / (corr[1] - corr[0]).max(0.001);
            1.0 - v.clamp(0.0, 1.0)
        };
        let ramp_mix = ramp * y.ext_factor;
        // `theta_interp * (1 - ramp_mix) + theta_extrap * ramp_mix` and
        // `1 + 0.1 * logf(1 / freq_scale)`, each contracted by GCC into one fused multiply-add.
        theta = theta_interp.mul_add(1.0 - ramp_mix, theta_extrap * ramp_mix);
        mscale *= 0.1f32.mul_add((1.0 / y.freq_scale).ln(), 1.0);
    }
    (theta.cos() * mscale, theta.sin() * mscale)
}

/// ggml's `ggml_rope_yarn_corr_dims` for `n_dims` rotated dimensions.
fn yarn_corr_dims(y: &Yarn, n_dims: usize, base: f32) -> [f32; 2] {
    let corr_dim = |beta: f32| {
        n_dims as f32 * (y.n_ctx_orig as f32 / (beta * 2.0 * std::f32::consts::PI)).ln() / (2.0 * base.ln())
    };
    let start = corr_dim(y.beta_fast).floor();
    let end = corr_dim(y.beta_slow).ceil();
    [start.max(0.0), end.min((n_dims - 1) as f32)]
}

impl Rope {
    /// The factors for `n` tokens from position `pos0`.
    pub fn set(&mut self, c: &Config, pos0: usize, n: usize) {
        let nr = c.n_rot;
        let theta_scale = c.rope_base.powf(-2.0 / nr as f32);
        let s = c.rope_sections;
        let sect_dims: usize = s.iter().sum();
        // IMROPE: pair i takes its angle from the time/height/width position (the token's) or
        // from the extra position (0) by its sector; see `ggml_mrope_cache_init`.
        let extra = |i: usize| {
            if sect_dims == 0 {
                return false;
            }
            let sector = i % sect_dims;
            !((sector % 3 == 1 && sector < 3 * s[1])
                || (sector % 3 == 2 && sector < 3 * s[2])
                || (sector.is_multiple_of(3) && sector < 3 * s[0]))
        };
        let corr = c.yarn.map(|y| yarn_corr_dims(&y, nr, c.rope_base));
        self.n_rot = nr;
        let cs = sized(&mut self.cs, n * nr);
        for (b, row) in cs.chunks_mut(nr).enumerate() {
            let mut theta = (pos0 + b) as f32;
            let mut theta_e = 0f32;
            for (i, pair) in row.chunks_mut(2).enumerate() {
                let th = if extra(i) { theta_e } else { theta };
                let (cos, sin) = match (&c.yarn, corr) {
                    (Some(y), Some(corr)) => rope_yarn(y, corr, 2 * i, th),
                    _ => (th.cos(), th.sin()),
                };
                pair[0] = cos;
                pair[1] = sin;
                theta *= theta_scale;
                theta_e *= theta_scale;
            }
        }
    }

    /// Rotates the first `n_rot` dims of head `h` of token `b` (NEOX pairs `i`, `i + n_rot/2`);
    /// `tmp` is at least `n_rot` long.
    fn rotate(&self, b: usize, h: &mut [f32], tmp: &mut [f32]) {
        let nr = self.n_rot;
        let cs = &self.cs[b * nr..(b + 1) * nr];
        let half = nr / 2;
        for i in 0..half {
            let (x0, x1) = (h[i], h[i + half]);
            let (cos, sin) = (cs[2 * i], cs[2 * i + 1]);
            // ggml's `rotate_pairs`, `x0*cos - x1*sin` and `x0*sin + x1*cos`, as GCC compiles it
            // for a native build (floating-point contraction is on in GNU C++ mode): the first
            // product of each is fused with the addition.
            tmp[i] = x0.mul_add(cos, -(x1 * sin));
            tmp[i + half] = x0.mul_add(sin, x1 * cos);
        }
        h[..nr].copy_from_slice(&tmp[..nr]);
    }
}

/// The block's buffers, reused across steps.
#[derive(Debug, Default)]
pub struct Scratch {
    xq: QRows,
    xk: QRows,
    xv: QRows,
    /// Q as projected (with the gates when the block has an output gate).
    qg: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    o: Vec<f32>,
    head: Vec<f32>,
    tmp: Vec<f32>,
}

/// `sigmoid(x) = 1 / (1 + expf(-x))` (ggml's `op_sigmoid`, libm `expf`).
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `out` (`n x n_embd`) = the attention block of the module docs on the normed rows `xn`; stores
/// the batch's K and V in `kv`.
pub fn forward(
    ctx: &Ctx<'_>,
    il: usize,
    w: &SelfAttn,
    kv: &mut LayerKv,
    xn: &[f32],
    s: &mut Scratch,
    out: &mut [f32],
) -> Result<(), ModelError> {
    let c = ctx.cfg();
    let (n, d, hd) = (ctx.n, c.n_embd, c.head_dim);
    let (q_dim, kv_dim) = (c.n_head * hd, c.n_head_kv * hd);
    let q_rows = w.wq.rows;
    let Scratch { xq, xk, xv, qg, q, k, v, o, head, tmp } = s;
    let (qg, k, v, o) = (sized(qg, n * q_rows), sized(k, n * kv_dim), sized(v, n * kv_dim), sized(o, n * q_dim));
    let (head, tmp) = (sized(head, q_dim.max(kv_dim)), sized(tmp, hd));

    xq.quantize(w.wq.ty, xn, d)?;
    xk.quantize(w.wk.ty, xn, d)?;
    xv.quantize(w.wv.ty, xn, d)?;
    ctx.matmuls(&mut [
        MatJob { w: &w.wq, x: xq, out: qg },
        MatJob { w: &w.wk, x: xk, out: k },
        MatJob { w: &w.wv, x: xv, out: v },
    ]);
    let add_bias = |x: &mut [f32], bias: &[f32]| {
        if !bias.is_empty() {
            x.chunks_mut(bias.len()).for_each(|r| crate::blocks::add(r, bias));
        }
    };
    add_bias(qg, &w.bq);
    add_bias(k, &w.bk);
    add_bias(v, &w.bv);
    // The queries: Q itself, or the first half of each head's [q, gate].
    let q = sized(q, n * q_dim);
    if w.opts.output_gate {
        for (qh, gh) in q.chunks_mut(hd).zip(qg.chunks(2 * hd)) {
            qh.copy_from_slice(&gh[..hd]);
        }
    } else {
        q.copy_from_slice(qg);
    }

    let norm_rows = |x: &mut [f32], dim: usize, wts: &[f32], head: &mut [f32]| match w.opts.qk_norm {
        QkNorm::None => {}
        QkNorm::PerHead => x.chunks_mut(hd).for_each(|h| {
            head[..hd].copy_from_slice(h);
            rms_norm(&head[..hd], wts, c.rms_eps, h);
        }),
        QkNorm::AllHeads => x.chunks_mut(dim).for_each(|r| {
            head[..dim].copy_from_slice(r);
            rms_norm(&head[..dim], wts, c.rms_eps, r);
        }),
    };
    norm_rows(q, q_dim, &w.q_norm, head);
    norm_rows(k, kv_dim, &w.k_norm, head);
    for b in 0..n {
        q[b * q_dim..(b + 1) * q_dim].chunks_mut(hd).for_each(|h| ctx.rope.rotate(b, h, tmp));
        k[b * kv_dim..(b + 1) * kv_dim].chunks_mut(hd).for_each(|h| ctx.rope.rotate(b, h, tmp));
    }
    dump("Qcur", Some(il), q);
    dump("Kcur", Some(il), k);
    dump("Vcur", Some(il), v);
    for b in 0..n {
        kv.push(ctx.pos0 + b, &k[b * kv_dim..(b + 1) * kv_dim], &v[b * kv_dim..(b + 1) * kv_dim]);
    }

    // llama.cpp's CPU flash attention (see `attention`): one task per (token, head).
    {
        let kv = &*kv;
        let o_p = SharedMut::new(o);
        let q = &*q;
        let (n_head, group) = (c.n_head, c.n_head / c.n_head_kv);
        let kq_scale = 1.0 / (hd as f32).sqrt();
        let nth = ctx.pool.threads();
        let window = w.opts.window;
        ctx.pool.run(n * n_head, &|t| {
            let (b, h) = (t / n_head, t % n_head);
            let mut q16 = vec![0u8; 2 * hd];
            let qh = &q[b * q_dim + h * hd..b * q_dim + (h + 1) * hd];
            quant::quantize_row(GgmlType::F16, qh, &mut q16).expect("f16 row of head_dim");
            // ggml splits the KV cells across threads only for single-token batches.
            let split = if n == 1 { AttnSplit::for_cells(kv.cells(), nth) } else { None };
            let sink = w.sinks.get(h).copied();
            // SAFETY: task t alone writes head h of token b.
            let oh = unsafe { o_p.slice(b * q_dim + h * hd..b * q_dim + (h + 1) * hd) };
            let vis = Visible { pos: ctx.pos0 + b, window };
            attention::attend(&q16, kv, kv_dim, h / group, vis, kq_scale, sink, split, oh);
        });
    }
    dump("kqv_out", Some(il), o);
    if w.opts.output_gate {
        for (oh, gh) in o.chunks_mut(hd).zip(qg.chunks(2 * hd)) {
            oh.iter_mut().zip(&gh[hd..]).for_each(|(x, &g)| *x *= sigmoid(g));
        }
    }
    ctx.matmul(&w.wo, xq.quantize(w.wo.ty, o, q_dim)?, out);
    add_bias(out, &w.bo);
    dump("attn_out", Some(il), out);
    Ok(())
}
