//! Mixture of experts: router, top-k, the selected experts' FFNs, weighted sum, and an optional
//! shared expert. llama.cpp's `build_moe_ffn` (and, for the shared expert, `build_ffn` of
//! `src/models/qwen35moe.cpp`).
//!
//! # Spec
//! For each normed input row `x` (token `b`):
//! ```text
//! l    = router·x (+ router bias)       ggml_mul_mat (ggml_add)
//! Softmax gating (qwen3moe, olmoe, qwen35moe):
//!   p    = softmax(l)                   ggml_soft_max ([`vmath::softmax`])
//!   top  = the k largest p, ties to the lower expert id, in that order   ggml_argsort_top_k
//!   w_j  = p[top_j]
//! SoftmaxWeight gating (gpt-oss):
//!   top  = the k largest l;  w = softmax(l[top])          ggml_soft_max over the k values
//! norm_w (qwen3moe, qwen35moe):
//!   w_j  = w_j / max(Σ_j w_j, 2^-14)    sum in f64 (ggml_sum_rows), ggml_clamp, ggml_div
//! w_j *= expert_weights_scale when it is neither 0 nor 1
//! y_j  = expert top_j's FFN of x  ([`dense_ffn::swiglu_groups`], ggml_mul_mat_id; gate and up
//!        are halves of one merged `ffn_gate_up_exps` in qwen35moe; biases and `swiglu_oai` in
//!        gpt-oss)
//! out  = Σ_j w_j · y_j                  in top-k order: (y_0·w_0 + y_1·w_1) + …  (ggml_mul, ggml_add)
//! shared expert (qwen35moe): out = out + dense_ffn_shexp(x) · sigmoid(ffn_gate_inp_shexp·x)
//! ```
//! Phases: [`route`] (the routing is then known for every token of the batch), the expert FFNs
//! (tokens grouped by expert, one group per selected expert), and the weighted sum. Expert
//! outputs are kept per (token, slot) and summed in top-k order, so the order in which experts
//! are computed does not enter the numerics.
//!
//! # Where expert weights come from
//! The block asks an [`ExpertWeights`] source for each selected expert's matrices; today that is
//! the model ([`Model`], slices of the file mapping: `--experts mmap`). An expert cache plugs in
//! here: after [`route`] it knows which experts the batch needs, can start reads of the missing
//! ones and order the groups so that resident experts are computed first. The per-expert biases
//! of `gpt-oss` (a few KiB per expert) are read from the model's mapping, not from the source.

use crate::arch::Config;
use crate::blocks::dense_ffn::{self, Act, DenseFfn, FfnBias, FfnShape, FfnView, Groups};
use crate::blocks::self_attn::sigmoid;
use crate::blocks::weights::Tensors;
use crate::blocks::{Ctx, ExpertWeight, QRows, Weight, dump, sized};
use crate::model::{Model, ModelError};
use crate::vmath;

/// How the router's logits become the top-k weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Gating {
    /// Softmax over all experts, then the top k (`LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX`).
    #[default]
    Softmax,
    /// The top k logits, then a softmax over them (`..._SOFTMAX_WEIGHT`).
    SoftmaxWeight,
}

/// The architecture's variant of the block.
#[derive(Debug, Clone, Copy, Default)]
pub struct MoeOptions {
    pub gating: Gating,
    /// Renormalise the top-k weights to sum 1.
    pub norm_w: bool,
    /// Biases on the router and on each expert's gate, up and down products.
    pub biases: bool,
    /// `swiglu_oai` instead of SwiGLU.
    pub oai_swiglu: bool,
    /// A shared expert beside the routed ones.
    pub shared: bool,
}

/// A shared expert: a dense FFN for every token, scaled by a sigmoid gate.
#[derive(Debug)]
pub struct SharedExpert {
    pub ffn: DenseFfn,
    /// `ffn_gate_inp_shexp`: one row of `n_embd` values.
    pub gate: Weight,
}

/// The per-expert biases (f32 vectors).
#[derive(Debug)]
pub struct ExpertBiases {
    pub gate: ExpertWeight,
    pub up: ExpertWeight,
    pub down: ExpertWeight,
}

/// The tensors of a MoE block.
#[derive(Debug)]
pub struct Moe {
    /// `n_expert x n_embd` router (`ffn_gate_inp`).
    pub router: Weight,
    /// Router bias (empty without).
    pub router_bias: Vec<f32>,
    pub gate_exps: ExpertWeight,
    pub up_exps: ExpertWeight,
    pub down_exps: ExpertWeight,
    /// Gate and up are the halves of one `ffn_gate_up_exps` tensor.
    pub merged_gate_up: bool,
    pub biases: Option<ExpertBiases>,
    pub shared: Option<SharedExpert>,
    pub opts: MoeOptions,
}

impl Moe {
    /// `blk.{il}.ffn_gate_inp.weight`, `blk.{il}.ffn_{gate,up,down}_exps.weight` (or a merged
    /// `ffn_gate_up_exps` when the file has one), and what `opts` asks for.
    pub fn load(t: &Tensors<'_>, c: &Config, il: usize, opts: MoeOptions) -> Result<Moe, ModelError> {
        let n = |s: &str| format!("blk.{il}.{s}.weight");
        let b = |s: &str| format!("blk.{il}.{s}.bias");
        let (d, ne, n_ff) = (c.n_embd, c.n_expert, c.n_ff_exp);
        let merged_gate_up = t.has(&n("ffn_gate_up_exps"));
        let (gate_exps, up_exps) = if merged_gate_up {
            t.experts_halves(&n("ffn_gate_up_exps"), d, n_ff, ne)?
        } else {
            (t.experts(&n("ffn_gate_exps"), d, n_ff, ne)?, t.experts(&n("ffn_up_exps"), d, n_ff, ne)?)
        };
        let biases = if opts.biases {
            Some(ExpertBiases {
                gate: t.expert_vectors(&b("ffn_gate_exps"), n_ff, ne)?,
                up: t.expert_vectors(&b("ffn_up_exps"), n_ff, ne)?,
                down: t.expert_vectors(&b("ffn_down_exps"), d, ne)?,
            })
        } else {
            None
        };
        let shared = if opts.shared {
            Some(SharedExpert {
                ffn: DenseFfn::load(t, c, il, c.n_ff_shexp, "_shexp")?,
                gate: t.row(&n("ffn_gate_inp_shexp"), d)?,
            })
        } else {
            None
        };
        Ok(Moe {
            router: t.matrix(&n("ffn_gate_inp"), d, ne)?,
            router_bias: if opts.biases { t.vector(&b("ffn_gate_inp"), ne)? } else { Vec::new() },
            gate_exps,
            up_exps,
            down_exps: t.experts(&n("ffn_down_exps"), n_ff, d, ne)?,
            merged_gate_up,
            biases,
            shared,
            opts,
        })
    }

    pub fn shape(&self) -> FfnShape {
        FfnShape {
            gate: self.gate_exps.w.ty,
            up: self.up_exps.w.ty,
            down: self.down_exps.w.ty,
            n_embd: self.gate_exps.w.cols,
            n_ff: self.gate_exps.rows,
            act: if self.opts.oai_swiglu { Act::SwiGluOai } else { Act::SwiGlu },
        }
    }
}

/// One expert's gate, up and down matrices as bytes.
pub type ExpertView<'a> = FfnView<'a>;

/// A source of expert weights: where the MoE block reads expert `e` of layer `layer` from.
///
/// The block calls [`Self::request`] once routing is known, computes the experts it returned,
/// then calls [`Self::wait_ready`] and computes what that returned, until it returns none. A
/// source that has every expert at hand (the mapping) returns them all at once; one that loads
/// them (the expert cache) returns the resident ones first and the others as they arrive. The
/// views [`Self::expert_weights`] gives stay valid until the next `request`/`wait_ready` call.
pub trait ExpertWeights: Sync {
    /// Expert `e` of MoE layer `layer`, whose tensors are `w`.
    fn expert_weights(&self, layer: usize, w: &Moe, e: usize) -> ExpertView<'_>;

    /// Routing of `layer` is known: `experts` (ascending) will be computed on the normed rows
    /// `xn`. Appends to `ready` the experts that can be computed now.
    fn request(
        &self,
        _ctx: &Ctx<'_>,
        _layer: usize,
        experts: &[usize],
        _xn: &[f32],
        ready: &mut Vec<usize>,
    ) -> Result<(), ModelError> {
        ready.extend_from_slice(experts);
        Ok(())
    }

    /// Appends the requested experts of `layer` not returned yet that can be computed now,
    /// blocking until there is at least one; appends none when all were returned.
    fn wait_ready(&self, _layer: usize, _ready: &mut Vec<usize>) -> Result<(), ModelError> {
        Ok(())
    }
}

/// Experts are slices of the file mapping (`--experts mmap`).
impl ExpertWeights for Model {
    fn expert_weights(&self, _layer: usize, w: &Moe, e: usize) -> ExpertView<'_> {
        ExpertView {
            gate: self.bytes(w.gate_exps.expert_range(e)),
            up: self.bytes(w.up_exps.expert_range(e)),
            down: self.bytes(w.down_exps.expert_range(e)),
        }
    }
}

/// The block's buffers, reused across steps.
#[derive(Debug, Default)]
pub struct Scratch {
    xr: QRows,
    logits: Vec<f32>,
    order: Vec<usize>,
    topw: Vec<f32>,
    /// `(expert, weight)` per slot; slot `b * k + j` is token `b`'s `j`-th choice.
    selected: Vec<(usize, f32)>,
    groups: Groups,
    ffn: dense_ffn::Scratch,
    /// Experts of the layer, those the source has ready, and their groups (see [`ExpertWeights`]).
    keys: Vec<usize>,
    ready: Vec<usize>,
    batch: Groups,
    shared: dense_ffn::DenseScratch,
    shared_y: Vec<f32>,
    shared_gate: Vec<f32>,
}

impl Scratch {
    /// `(expert, weight)` per slot of the last [`route`]: slot `b * k + j` is token `b`'s `j`-th
    /// choice.
    pub fn selected(&self) -> &[(usize, f32)] {
        &self.selected
    }
}

/// Router, top-k and weights of every token ([`Scratch::selected`]); counts each selection in
/// `counts` (per expert).
pub fn route(
    ctx: &Ctx<'_>,
    il: usize,
    w: &Moe,
    xn: &[f32],
    counts: &mut [u64],
    s: &mut Scratch,
) -> Result<(), ModelError> {
    let c = ctx.cfg();
    let (ne, k) = (c.n_expert, c.n_expert_used);
    let logits = sized(&mut s.logits, ctx.n * ne);
    ctx.matmul(&w.router, s.xr.quantize(w.router.ty, xn, c.n_embd)?, logits);
    if !w.router_bias.is_empty() {
        logits.chunks_mut(ne).for_each(|l| crate::blocks::add(l, &w.router_bias));
    }
    dump("ffn_moe_logits", Some(il), logits);
    s.selected.clear();
    for p in logits.chunks_mut(ne) {
        if w.opts.gating == Gating::Softmax {
            vmath::softmax(p, false);
        }
        // A total order (ties to the lower id), so an unstable selection gives ggml's order.
        let desc = |&a: &usize, &b: &usize| p[b].total_cmp(&p[a]).then(a.cmp(&b));
        s.order.clear();
        s.order.extend(0..ne);
        if k < ne {
            s.order.select_nth_unstable_by(k, desc);
        }
        let top = &mut s.order[..k];
        top.sort_unstable_by(desc);
        s.topw.clear();
        s.topw.extend(top.iter().map(|&e| p[e]));
        if w.opts.gating == Gating::SoftmaxWeight {
            vmath::softmax(&mut s.topw, false);
        }
        if w.opts.norm_w {
            let sum = s.topw.iter().map(|&x| f64::from(x)).sum::<f64>() as f32;
            let sum = sum.max(6.103_515_6e-5);
            s.topw.iter_mut().for_each(|x| *x /= sum);
        }
        if c.expert_weights_scale != 0.0 && c.expert_weights_scale != 1.0 {
            s.topw.iter_mut().for_each(|x| *x *= c.expert_weights_scale);
        }
        for (&e, &wt) in top.iter().zip(&s.topw) {
            s.selected.push((e, wt));
            counts[e] += 1;
        }
    }
    Ok(())
}

/// `out` (`n x n_embd`) = the MoE block of the module docs on the normed rows `xn`.
pub fn forward(
    ctx: &Ctx<'_>,
    il: usize,
    w: &Moe,
    counts: &mut [u64],
    xn: &[f32],
    s: &mut Scratch,
    out: &mut [f32],
) -> Result<(), ModelError> {
    let (d, k) = (ctx.cfg().n_embd, ctx.cfg().n_expert_used);
    route(ctx, il, w, xn, counts, s)?;
    s.groups.by_key(ctx.cfg().n_expert, s.selected.iter().map(|&(e, _)| e));
    let experts = |e: usize| ctx.experts.expert_weights(il, w, e);
    let m = ctx.model;
    let bias_of = |e: usize| {
        let b = w.biases.as_ref().expect("biases present");
        FfnBias {
            gate: m.bytes(b.gate.expert_range(e)),
            up: m.bytes(b.up.expert_range(e)),
            down: m.bytes(b.down.expert_range(e)),
        }
    };
    let biases: dense_ffn::BiasFn<'_, '_> = if w.biases.is_some() { Some(&bias_of) } else { None };
    // Experts in batches as the source has them (all at once from the mapping); every slot's
    // output lands at its place, so batching does not enter the numerics.
    s.keys.clear();
    s.keys.extend((0..s.groups.len()).map(|i| s.groups.key(i)));
    s.ready.clear();
    ctx.experts.request(ctx, il, &s.keys, xn, &mut s.ready)?;
    loop {
        if s.ready.is_empty() {
            ctx.experts.wait_ready(il, &mut s.ready)?;
            if s.ready.is_empty() {
                break;
            }
        }
        let groups = if s.ready.len() == s.keys.len() {
            &s.groups
        } else {
            s.batch.clone_from(&s.groups);
            s.batch.retain(|e| s.ready.contains(&e));
            &s.batch
        };
        dense_ffn::swiglu_groups(ctx, w.shape(), groups, &experts, biases, xn, k, &mut s.ffn)?;
        s.ready.clear();
    }
    let (h, y) = (s.ffn.h(), &s.ffn.y);
    let n_ff = w.gate_exps.rows;
    dump("ffn_moe_swiglu", Some(il), &h[(ctx.n - 1) * k * n_ff..]);
    for (b, acc) in out.chunks_mut(d).enumerate() {
        for j in 0..k {
            let slot = b * k + j;
            let wt = s.selected[slot].1;
            let ys = &y[slot * d..(slot + 1) * d];
            if j == 0 {
                acc.iter_mut().zip(ys).for_each(|(a, &v)| *a = v * wt);
            } else {
                acc.iter_mut().zip(ys).for_each(|(a, &v)| *a += v * wt);
            }
        }
    }
    dump("ffn_moe_down", Some(il), &y[(ctx.n - 1) * k * d..ctx.n * k * d]);
    if let Some(sh) = &w.shared {
        dump("ffn_moe_out", Some(il), out);
        let ys = sized(&mut s.shared_y, ctx.n * d);
        dense_ffn::forward(ctx, &sh.ffn, xn, &mut s.shared, ys)?;
        let g = sized(&mut s.shared_gate, ctx.n);
        ctx.matmul(&sh.gate, s.xr.quantize(sh.gate.ty, xn, d)?, g);
        dump("ffn_shexp", Some(il), ys);
        for ((acc, yb), &gb) in out.chunks_mut(d).zip(ys.chunks(d)).zip(g.iter()) {
            let gate = sigmoid(gb);
            // ffn_shexp * sigmoid(gate), then moe_out + that (ggml_mul, ggml_add).
            acc.iter_mut().zip(yb).for_each(|(a, &v)| *a += v * gate);
        }
    }
    Ok(())
}
