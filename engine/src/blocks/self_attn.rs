//! Full (softmax) self-attention with RoPE, per-head Q/K RMS norm, grouped-query heads and an f16
//! KV cache: llama.cpp's `build_attn` path of `src/models/qwen3moe.cpp`.
//!
//! # Spec
//! For the `n` normed input rows `xn` of a batch at positions `pos0..pos0+n`:
//! ```text
//! Q = Wq·xn, K = Wk·xn, V = Wv·xn               one parallel region (3 x ggml_mul_mat)
//! per head h of Q and of K:  h = rope(rmsnorm(h, q_norm | k_norm))
//!                                               ggml_rms_norm + ggml_mul, ggml_rope_ext (NEOX)
//! cache += f16(K), f16(V)                        ggml_set_rows into the F16 cache
//! per token b, query head h (KV head h / (n_head / n_head_kv)):
//!   o = softmax(K·q / sqrt(head_dim)) V over cells 0..=pos0+b
//!                                               ggml_flash_attn_ext ([`crate::attention`])
//! out = Wo·o                                     ggml_mul_mat
//! ```
//! RoPE ([`Rope`]): position `p`, pair `i` of `0..head_dim/2` rotates by
//! `θ = p · base^(-2i/n_rot)`, the angles built by repeated multiplication
//! (`theta *= theta_scale`, as `ggml_rope_cache_init` with `freq_scale` 1 and no extrapolation);
//! NEOX pairs element `i` with `i + head_dim/2` and rotates with the fused multiply-adds GCC
//! makes of ggml's `rotate_pairs`. The attention rows are one pool task per (token, head).

use crate::arch::Config;
use crate::attention::{self, AttnSplit, LayerKv};
use crate::blocks::weights::Tensors;
use crate::blocks::{Ctx, MatJob, QRows, SharedMut, Weight, dump, rms_norm, sized};
use crate::model::ModelError;
use crate::quant::{self, GgmlType};

/// The tensors of a full-attention block.
#[derive(Debug)]
pub struct SelfAttn {
    pub wq: Weight,
    pub wk: Weight,
    pub wv: Weight,
    pub wo: Weight,
    /// Per-head RMS norm weights of Q and K (`head_dim` values).
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
}

impl SelfAttn {
    /// `blk.{il}.attn_{q,k,v,output,q_norm,k_norm}.weight`.
    pub fn load(t: &Tensors<'_>, c: &Config, il: usize) -> Result<SelfAttn, ModelError> {
        let n = |s: &str| format!("blk.{il}.{s}.weight");
        let (q_dim, kv_dim) = (c.n_head * c.head_dim, c.n_head_kv * c.head_dim);
        Ok(SelfAttn {
            wq: t.matrix(&n("attn_q"), c.n_embd, q_dim)?,
            wk: t.matrix(&n("attn_k"), c.n_embd, kv_dim)?,
            wv: t.matrix(&n("attn_v"), c.n_embd, kv_dim)?,
            wo: t.matrix(&n("attn_output"), q_dim, c.n_embd)?,
            q_norm: t.vector(&n("attn_q_norm"), c.head_dim)?,
            k_norm: t.vector(&n("attn_k_norm"), c.head_dim)?,
        })
    }
}

/// RoPE factors of a batch's positions: `cos θ, sin θ` per pair, `head_dim` values per token.
#[derive(Debug, Default)]
pub struct Rope {
    cs: Vec<f32>,
    head_dim: usize,
}

impl Rope {
    /// The factors for `n` tokens from position `pos0`.
    pub fn set(&mut self, c: &Config, pos0: usize, n: usize) {
        let hd = c.head_dim;
        let theta_scale = c.rope_base.powf(-2.0 / c.n_rot as f32);
        self.head_dim = hd;
        let cs = sized(&mut self.cs, n * hd);
        for (b, row) in cs.chunks_mut(hd).enumerate() {
            let mut theta = (pos0 + b) as f32;
            for pair in row.chunks_mut(2) {
                pair[0] = theta.cos();
                pair[1] = theta.sin();
                theta *= theta_scale;
            }
        }
    }

    /// Rotates head `h` of token `b` (NEOX pairs `i`, `i + half`); `tmp` is `head_dim` long.
    fn rotate(&self, b: usize, h: &mut [f32], tmp: &mut [f32]) {
        let hd = self.head_dim;
        let cs = &self.cs[b * hd..(b + 1) * hd];
        let half = hd / 2;
        for i in 0..half {
            let (x0, x1) = (h[i], h[i + half]);
            let (cos, sin) = (cs[2 * i], cs[2 * i + 1]);
            // ggml's `rotate_pairs`, `x0*cos - x1*sin` and `x0*sin + x1*cos`, as GCC compiles it
            // for a native build (floating-point contraction is on in GNU C++ mode): the first
            // product of each is fused with the addition.
            tmp[i] = x0.mul_add(cos, -(x1 * sin));
            tmp[i + half] = x0.mul_add(sin, x1 * cos);
        }
        h.copy_from_slice(&tmp[..hd]);
    }
}

/// The block's buffers, reused across steps.
#[derive(Debug, Default)]
pub struct Scratch {
    xq: QRows,
    xk: QRows,
    xv: QRows,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    o: Vec<f32>,
    head: Vec<f32>,
    tmp: Vec<f32>,
}

/// `out` (`n x n_embd`) = the attention block of the module docs on the normed rows `xn`; appends
/// the batch's K and V to `kv`.
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
    let Scratch { xq, xk, xv, q, k, v, o, head, tmp } = s;
    let (q, k, v, o) = (sized(q, n * q_dim), sized(k, n * kv_dim), sized(v, n * kv_dim), sized(o, n * q_dim));
    let (head, tmp) = (sized(head, hd), sized(tmp, hd));

    xq.quantize(w.wq.ty, xn, d)?;
    xk.quantize(w.wk.ty, xn, d)?;
    xv.quantize(w.wv.ty, xn, d)?;
    ctx.matmuls(&mut [
        MatJob { w: &w.wq, x: xq, out: q },
        MatJob { w: &w.wk, x: xk, out: k },
        MatJob { w: &w.wv, x: xv, out: v },
    ]);

    for b in 0..n {
        for h in q[b * q_dim..(b + 1) * q_dim].chunks_mut(hd) {
            head.copy_from_slice(h);
            rms_norm(head, &w.q_norm, c.rms_eps, h);
            ctx.rope.rotate(b, h, tmp);
        }
        for h in k[b * kv_dim..(b + 1) * kv_dim].chunks_mut(hd) {
            head.copy_from_slice(h);
            rms_norm(head, &w.k_norm, c.rms_eps, h);
            ctx.rope.rotate(b, h, tmp);
        }
    }
    dump("Qcur", Some(il), q);
    dump("Kcur", Some(il), k);
    dump("Vcur", Some(il), v);
    for b in 0..n {
        kv.push(&k[b * kv_dim..(b + 1) * kv_dim], &v[b * kv_dim..(b + 1) * kv_dim]);
    }

    // llama.cpp's CPU flash attention (see `attention`): one task per (token, head).
    {
        let kv = &*kv;
        let o_p = SharedMut::new(o);
        let q = &*q;
        let (n_head, group) = (c.n_head, c.n_head / c.n_head_kv);
        let kq_scale = 1.0 / (hd as f32).sqrt();
        let nth = ctx.pool.threads();
        ctx.pool.run(n * n_head, &|t| {
            let (b, h) = (t / n_head, t % n_head);
            let n_vis = ctx.pos0 + b + 1;
            let mut q16 = vec![0u8; 2 * hd];
            let qh = &q[b * q_dim + h * hd..b * q_dim + (h + 1) * hd];
            quant::quantize_row(GgmlType::F16, qh, &mut q16).expect("f16 row of head_dim");
            // ggml splits the KV cells across threads only for single-token batches.
            let split = if n == 1 { AttnSplit::for_decode(n_vis - 1, nth) } else { None };
            // SAFETY: task t alone writes head h of token b.
            let oh = unsafe { o_p.slice(b * q_dim + h * hd..b * q_dim + (h + 1) * hd) };
            attention::attend(&q16, &kv.k, &kv.v, kv_dim, h / group, n_vis, kq_scale, split, oh);
        });
    }
    dump("kqv_out", Some(il), o);
    ctx.matmul(&w.wo, xq.quantize(w.wo.ty, o, q_dim)?, out);
    dump("attn_out", Some(il), out);
    Ok(())
}
