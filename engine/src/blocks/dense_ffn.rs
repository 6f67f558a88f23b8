//! The SwiGLU feed-forward network: a dense FFN block, and the grouped form the MoE experts use.
//!
//! # Spec
//! For an input row `x` and one FFN's matrices (`gate`, `up`: `n_ff x n_embd`; `down`:
//! `n_embd x n_ff`):
//! ```text
//! g = gate·x, u = up·x          ggml_mul_mat (x quantized once when both types share a vec_dot_type)
//! h = silu(g) ⊙ u               ggml_swiglu_split ([`vmath::swiglu`]: ggml's vector exp)
//! y = down·h                    ggml_mul_mat (h quantized for down's type)
//! ```
//! llama.cpp's `build_ffn(…, LLM_FFN_SILU, LLM_FFN_PAR)` for a dense FFN, and per expert in
//! `build_moe_ffn`. [`swiglu_groups`] computes it for *groups* of rows ("slots") where each
//! group has its own matrices: the routed experts (a group per selected expert) and the dense
//! FFN (one group holding every token) are the same code. Work is split into (group, row chunk)
//! tasks, first for `g`/`u`/`h`, then for `y`; each slot's outputs are stored at the slot's
//! place, so neither the order of the groups nor the split enters the numerics.
//!
//! Variants: `gpt-oss`'s experts add biases after the gate, up and down products
//! (`ggml_add_id`) and use the clamped activation `swiglu_oai` instead of `silu(g) ⊙ u`
//! ([`Act`]). A dense FFN layer is not in any architecture the engine runs (they are MoE in
//! every layer); the block is `qwen35moe`'s shared expert.

use crate::arch::Config;
use crate::blocks::weights::Tensors;
use crate::blocks::{Ctx, QRows, SharedMut, Weight, row_chunk, sized};
use crate::model::ModelError;
use crate::quant::{self, GgmlType};
use crate::vmath;

/// The tensors of a dense FFN block.
#[derive(Debug)]
pub struct DenseFfn {
    pub gate: Weight,
    pub up: Weight,
    pub down: Weight,
}

impl DenseFfn {
    /// `blk.{il}.ffn_{gate,up,down}{suffix}.weight` with `n_ff` rows of gate and up (suffix
    /// `""` for a dense FFN, `"_shexp"` for a shared expert).
    pub fn load(t: &Tensors<'_>, c: &Config, il: usize, n_ff: usize, suffix: &str) -> Result<DenseFfn, ModelError> {
        let n = |s: &str| format!("blk.{il}.{s}{suffix}.weight");
        Ok(DenseFfn {
            gate: t.matrix(&n("ffn_gate"), c.n_embd, n_ff)?,
            up: t.matrix(&n("ffn_up"), c.n_embd, n_ff)?,
            down: t.matrix(&n("ffn_down"), n_ff, c.n_embd)?,
        })
    }
}

/// One FFN's three matrices as bytes (`n_ff` rows of gate and up, `n_embd` rows of down).
#[derive(Debug, Clone, Copy)]
pub struct FfnView<'a> {
    pub gate: &'a [u8],
    pub up: &'a [u8],
    pub down: &'a [u8],
}

/// The activation between the gate/up and the down products.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum Act {
    /// `silu(g) ⊙ u` (`ggml_swiglu_split`).
    #[default]
    SwiGlu,
    /// `min(g, 7) / (1 + exp(-1.702·min(g, 7))) ⊙ (clamp(u, -7, 7) + 1)` (`ggml_swiglu_oai`).
    SwiGluOai,
}

/// The shape of the FFNs of a [`swiglu_groups`] call (all groups share it).
#[derive(Debug, Clone, Copy)]
pub struct FfnShape {
    pub gate: GgmlType,
    pub up: GgmlType,
    pub down: GgmlType,
    pub n_embd: usize,
    pub n_ff: usize,
    pub act: Act,
}

/// One FFN's biases as f32 little-endian bytes (`n_ff` values for gate and up, `n_embd` for down).
#[derive(Debug, Clone, Copy)]
pub struct FfnBias<'a> {
    pub gate: &'a [u8],
    pub up: &'a [u8],
    pub down: &'a [u8],
}

/// `x[i] += bias[off + i]`, the bias as f32 little-endian bytes.
fn add_bias(x: &mut [f32], bias: &[u8], off: usize) {
    for (i, v) in x.iter_mut().enumerate() {
        let o = 4 * (off + i);
        *v += f32::from_le_bytes([bias[o], bias[o + 1], bias[o + 2], bias[o + 3]]);
    }
}

/// Slots grouped by a key (an expert): group `i` has key `keys[i]` and the slots
/// `slots[bounds[i]..bounds[i+1]]`, ascending. Groups are ordered by key.
#[derive(Debug, Default, Clone)]
pub struct Groups {
    keys: Vec<usize>,
    bounds: Vec<usize>,
    slots: Vec<usize>,
    count: Vec<usize>,
}

impl Groups {
    /// Groups the slots `0..` by `key_of_slot` (each key `< n_keys`); keys with no slot get no group.
    pub fn by_key(&mut self, n_keys: usize, key_of_slot: impl ExactSizeIterator<Item = usize> + Clone) {
        self.count.clear();
        self.count.resize(n_keys + 1, 0);
        for k in key_of_slot.clone() {
            self.count[k + 1] += 1;
        }
        self.keys.clear();
        self.bounds.clear();
        self.bounds.push(0);
        for k in 0..n_keys {
            if self.count[k + 1] > 0 {
                self.keys.push(k);
                self.bounds.push(self.bounds.last().copied().unwrap_or(0) + self.count[k + 1]);
            }
            // count[k] becomes the start of key k's slots (a running prefix sum).
            self.count[k + 1] += self.count[k];
        }
        self.slots.clear();
        self.slots.resize(key_of_slot.len(), 0);
        for (s, k) in key_of_slot.enumerate() {
            self.slots[self.count[k]] = s;
            self.count[k] += 1;
        }
    }

    /// One group with key 0 holding slots `0..n`.
    pub fn single(&mut self, n: usize) {
        self.by_key(1, std::iter::repeat_n(0, n));
    }

    /// Keeps the groups whose key passes `keep` (with their slots).
    pub fn retain(&mut self, keep: impl Fn(usize) -> bool) {
        let (mut n, mut slots) = (0, Vec::with_capacity(self.slots.len()));
        let mut bounds = vec![0];
        for i in 0..self.keys.len() {
            if keep(self.keys[i]) {
                self.keys[n] = self.keys[i];
                n += 1;
                slots.extend_from_slice(&self.slots[self.bounds[i]..self.bounds[i + 1]]);
                bounds.push(slots.len());
            }
        }
        self.keys.truncate(n);
        (self.slots, self.bounds) = (slots, bounds);
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    pub fn key(&self, i: usize) -> usize {
        self.keys[i]
    }

    pub fn slots(&self, i: usize) -> &[usize] {
        &self.slots[self.bounds[i]..self.bounds[i + 1]]
    }

    fn largest(&self) -> usize {
        self.bounds.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(1)
    }
}

/// The buffers of [`swiglu_groups`], reused across steps.
#[derive(Debug, Default)]
pub struct Scratch {
    xg: QRows,
    xu: QRows,
    xh: QRows,
    h: Vec<f32>,
    /// `y` of every slot (`n_slots x n_embd`), the result of the last call.
    pub y: Vec<f32>,
}

impl Scratch {
    /// `h` of every slot (`n_slots x n_ff`) of the last call.
    pub fn h(&self) -> &[f32] {
        &self.h
    }
}

/// The biases of a group's FFN, by key (`None`: no biases).
pub type BiasFn<'a, 'w> = Option<&'a (dyn Fn(usize) -> FfnBias<'w> + Sync)>;

/// `s.y[slot] = down·(silu(gate·x) ⊙ up·x)` for every slot of every group, with the group's
/// matrices `weights(key)` (and biases `biases(key)`, activation `f.act`) and `x` = row
/// `slot / slots_per_token` of `x`.
#[expect(clippy::too_many_arguments, reason = "the grouped FFN's full description")]
pub fn swiglu_groups<'w>(
    ctx: &Ctx<'_>,
    f: FfnShape,
    groups: &Groups,
    weights: &(dyn Fn(usize) -> FfnView<'w> + Sync),
    biases: BiasFn<'_, 'w>,
    x: &[f32],
    slots_per_token: usize,
    s: &mut Scratch,
) -> Result<(), ModelError> {
    let (d, n_ff) = (f.n_embd, f.n_ff);
    let n_slots = ctx.n * slots_per_token;
    let Scratch { xg, xu, xh, h, y } = s;
    let xg = xg.quantize(f.gate, x, d)?;
    let xu = if f.up.vec_dot_type() == f.gate.vec_dot_type() { xg } else { xu.quantize(f.up, x, d)? };
    let threads = ctx.pool.threads();
    let h = sized(h, n_slots * n_ff);
    {
        let chunk = row_chunk(n_ff, threads, groups.largest());
        let per = n_ff.div_ceil(chunk);
        let h_p = SharedMut::new(h);
        ctx.pool.run(groups.len() * per, &|t| {
            let (gi, ci) = (t / per, t % per);
            let slots = groups.slots(gi);
            let fw = weights(groups.key(gi));
            let r0 = ci * chunk;
            let r1 = (r0 + chunk).min(n_ff);
            let n = r1 - r0;
            let mut g = vec![0f32; slots.len() * n];
            let mut u = vec![0f32; slots.len() * n];
            let xgs: Vec<&[u8]> = slots.iter().map(|&s| xg.row(s / slots_per_token)).collect();
            let xus: Vec<&[u8]> = slots.iter().map(|&s| xu.row(s / slots_per_token)).collect();
            quant::matvec_multi(f.gate, fw.gate, r0..r1, d, &xgs, &mut g.chunks_mut(n).collect::<Vec<_>>());
            quant::matvec_multi(f.up, fw.up, r0..r1, d, &xus, &mut u.chunks_mut(n).collect::<Vec<_>>());
            if let Some(bias) = biases {
                let b = bias(groups.key(gi));
                g.chunks_mut(n).for_each(|gk| add_bias(gk, b.gate, r0));
                u.chunks_mut(n).for_each(|uk| add_bias(uk, b.up, r0));
            }
            for (k, &s) in slots.iter().enumerate() {
                // SAFETY: slot s belongs to exactly one group and rows r0..r1 to one task of it.
                let hs = unsafe { h_p.slice(s * n_ff + r0..s * n_ff + r1) };
                let (gk, uk) = (&g[k * n..(k + 1) * n], &u[k * n..(k + 1) * n]);
                match f.act {
                    Act::SwiGlu => vmath::swiglu(gk, uk, hs),
                    Act::SwiGluOai => vmath::swiglu_oai(gk, uk, hs),
                }
            }
        });
    }
    let xh = xh.quantize(f.down, h, n_ff)?;
    let y = sized(y, n_slots * d);
    {
        let chunk = row_chunk(d, threads, groups.largest());
        let per = d.div_ceil(chunk);
        let y_p = SharedMut::new(y);
        ctx.pool.run(groups.len() * per, &|t| {
            let (gi, ci) = (t / per, t % per);
            let slots = groups.slots(gi);
            let fw = weights(groups.key(gi));
            let r0 = ci * chunk;
            let r1 = (r0 + chunk).min(d);
            let xs: Vec<&[u8]> = slots.iter().map(|&s| xh.row(s)).collect();
            let mut os: Vec<&mut [f32]> = slots
                .iter()
                // SAFETY: as above, (slot, row range) pairs are disjoint across tasks.
                .map(|&s| unsafe { y_p.slice(s * d + r0..s * d + r1) })
                .collect();
            quant::matvec_multi(f.down, fw.down, r0..r1, n_ff, &xs, &mut os);
            if let Some(bias) = biases {
                let b = bias(groups.key(gi));
                os.iter_mut().for_each(|o| add_bias(o, b.down, r0));
            }
        });
    }
    Ok(())
}

/// The buffers of the dense FFN block.
#[derive(Debug, Default)]
pub struct DenseScratch {
    groups: Groups,
    ffn: Scratch,
}

/// `out` (`n x n_embd`) = the FFN of the module docs on each normed row of `xn`.
pub fn forward(
    ctx: &Ctx<'_>,
    w: &DenseFfn,
    xn: &[f32],
    s: &mut DenseScratch,
    out: &mut [f32],
) -> Result<(), ModelError> {
    let f = FfnShape {
        gate: w.gate.ty,
        up: w.up.ty,
        down: w.down.ty,
        n_embd: w.gate.cols,
        n_ff: w.gate.rows,
        act: Act::SwiGlu,
    };
    let m = ctx.model;
    let view = FfnView {
        gate: m.bytes(w.gate.range.clone()),
        up: m.bytes(w.up.range.clone()),
        down: m.bytes(w.down.range.clone()),
    };
    s.groups.single(ctx.n);
    swiglu_groups(ctx, f, &s.groups, &|_| view, None, xn, 1, &mut s.ffn)?;
    out.copy_from_slice(&s.ffn.y[..out.len()]);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_hold_each_slot_once_in_key_then_slot_order() {
        let mut g = Groups::default();
        let keys = [5, 1, 5, 0, 1, 5, 7];
        g.by_key(8, keys.iter().copied());
        let got: Vec<(usize, Vec<usize>)> = (0..g.len()).map(|i| (g.key(i), g.slots(i).to_vec())).collect();
        assert_eq!(got, [(0, vec![3]), (1, vec![1, 4]), (5, vec![0, 2, 5]), (7, vec![6])]);
        assert_eq!(g.largest(), 3);
        // Reused with fewer slots and keys: nothing stale remains.
        g.by_key(2, [1, 1].into_iter());
        assert_eq!((g.len(), g.key(0), g.slots(0)), (1, 1, &[0, 1][..]));
        g.single(3);
        assert_eq!((g.len(), g.key(0), g.slots(0)), (1, 0, &[0, 1, 2][..]));
        // A subset of the groups keeps their slots.
        g.by_key(8, keys.iter().copied());
        g.retain(|k| k == 1 || k == 7);
        let got: Vec<(usize, Vec<usize>)> = (0..g.len()).map(|i| (g.key(i), g.slots(i).to_vec())).collect();
        assert_eq!(got, [(1, vec![1, 4]), (7, vec![6])]);
    }
}
