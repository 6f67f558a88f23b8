//! The forward-pass blocks against independent one-row-at-a-time computations with the kernels
//! (`quant::matvec`, single-threaded, no grouping), bit for bit; and the MoE block's expert
//! source seam (`ExpertWeights`).

mod common;

use std::sync::Mutex;

use engine::blocks::dense_ffn::{self, DenseFfn};
use engine::blocks::moe::{self, ExpertView, ExpertWeights, Moe};
use engine::blocks::self_attn::Rope;
use engine::blocks::{Ctx, Weight};
use engine::model::{Model, Session};
use engine::pool::Pool;
use engine::quant::GgmlType;
use engine::synth::QuantMix;
use engine::vmath;

use common::{matvec, preset_model, rows};

fn tiny(quant: QuantMix) -> (tempfile::TempDir, Model) {
    preset_model("tiny", |c| c.quant = quant)
}

/// `down·(silu(gate·x) ⊙ up·x)` for one row.
fn ffn_ref(tys: [GgmlType; 3], v: ExpertView<'_>, n_ff: usize, x: &[f32]) -> Vec<f32> {
    let g = matvec(tys[0], v.gate, n_ff, x);
    let u = matvec(tys[1], v.up, n_ff, x);
    let mut h = vec![0f32; n_ff];
    vmath::swiglu(&g, &u, &mut h);
    matvec(tys[2], v.down, x.len(), &h)
}

fn ctx<'a>(m: &'a Model, pool: &'a Pool, rope: &'a Rope, n: usize) -> Ctx<'a> {
    Ctx { model: m, pool, experts: m, n, pos0: 0, rope }
}

fn differing(a: &[f32], b: &[f32]) -> usize {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).filter(|(x, y)| x.to_bits() != y.to_bits()).count()
}

#[test]
fn dense_ffn_matches_one_row_at_a_time() {
    for q in [QuantMix::Q8_0, QuantMix::Q4KM] {
        let (_d, m) = tiny(q);
        let (d, n_ff) = (m.cfg.n_embd, m.cfg.n_ff_exp);
        // A dense FFN on expert 3's matrices of layer 1.
        let e = m.layers[1].moe().unwrap();
        let slice = |x: &engine::blocks::ExpertWeight, name: &str| Weight {
            name: name.into(),
            ty: x.w.ty,
            rows: x.rows,
            cols: x.w.cols,
            range: x.expert_range(3),
        };
        let w = DenseFfn {
            gate: slice(&e.gate_exps, "gate"),
            up: slice(&e.up_exps, "up"),
            down: slice(&e.down_exps, "down"),
        };
        let view = m.expert_weights(1, e, 3);
        let tys = [w.gate.ty, w.up.ty, w.down.ty];
        let rope = Rope::default();
        let mut s = dense_ffn::DenseScratch::default();
        for (threads, n) in [(1, 1), (2, 1), (2, 5), (3, 9)] {
            let pool = Pool::new(threads);
            let x = rows(n, d, 7 + n as u64);
            let mut out = vec![0f32; n * d];
            dense_ffn::forward(&ctx(&m, &pool, &rope, n), &w, &x, &mut s, &mut out).unwrap();
            let want: Vec<f32> = x.chunks(d).flat_map(|xb| ffn_ref(tys, view, n_ff, xb)).collect();
            assert!(want.iter().any(|&v| v != 0.0));
            assert_eq!(differing(&out, &want), 0, "{}: {n} rows on {threads} threads", q.name());
        }
    }
}

#[test]
fn moe_block_matches_expert_by_expert_sum() {
    for q in [QuantMix::Q8_0, QuantMix::Q4KM] {
        let (_d, m) = tiny(q);
        let c = &m.cfg;
        let (d, ne, k) = (c.n_embd, c.n_expert, c.n_expert_used);
        let il = 1;
        let w = m.layers[il].moe().unwrap();
        let tys = [w.gate_exps.w.ty, w.up_exps.w.ty, w.down_exps.w.ty];
        let rope = Rope::default();
        let mut s = moe::Scratch::default();
        for (threads, n) in [(1, 1), (2, 1), (2, 6)] {
            let pool = Pool::new(threads);
            let x = rows(n, d, 99 + n as u64);
            let mut out = vec![0f32; n * d];
            let mut counts = vec![0u64; ne];
            moe::forward(&ctx(&m, &pool, &rope, n), il, w, &mut counts, &x, &mut s, &mut out).unwrap();

            let mut want = Vec::new();
            let mut want_counts = vec![0u64; ne];
            for xb in x.chunks(d) {
                let mut p = matvec(w.router.ty, m.bytes(w.router.range.clone()), ne, xb);
                vmath::softmax(&mut p, false);
                let mut ids: Vec<usize> = (0..ne).collect();
                ids.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
                let top = &ids[..k];
                let sum = (top.iter().map(|&e| f64::from(p[e])).sum::<f64>() as f32).max(6.103_515_6e-5);
                let mut acc = vec![0f32; d];
                for (j, &e) in top.iter().enumerate() {
                    want_counts[e] += 1;
                    let y = ffn_ref(tys, m.expert_weights(il, w, e), c.n_ff_exp, xb);
                    let wt = p[e] / sum;
                    for (a, v) in acc.iter_mut().zip(y) {
                        *a = if j == 0 { v * wt } else { *a + v * wt };
                    }
                }
                want.extend(acc);
            }
            assert_eq!(counts, want_counts, "{}: selections of {n} rows", q.name());
            assert_eq!(differing(&out, &want), 0, "{}: {n} rows on {threads} threads", q.name());
        }
    }
}

/// An expert source that serves copies of the experts (as a cache would) and records requests.
struct Copies {
    /// `[layer][expert]` = (gate, up, down) bytes.
    experts: Vec<Vec<[Vec<u8>; 3]>>,
    requested: Mutex<Vec<Vec<bool>>>,
}

impl ExpertWeights for Copies {
    fn expert_weights(&self, layer: usize, _w: &Moe, e: usize) -> ExpertView<'_> {
        self.requested.lock().unwrap()[layer][e] = true;
        let [g, u, d] = &self.experts[layer][e];
        ExpertView { gate: g, up: u, down: d }
    }
}

#[test]
fn experts_come_from_the_session_source() {
    let (_d, m) = tiny(QuantMix::Q4KM);
    let (nl, ne) = (m.cfg.n_layer, m.cfg.n_expert);
    let copies = Copies {
        experts: (0..nl)
            .map(|il| {
                let w = m.layers[il].moe().unwrap();
                (0..ne)
                    .map(|e| {
                        let v = m.expert_weights(il, w, e);
                        [v.gate.to_vec(), v.up.to_vec(), v.down.to_vec()]
                    })
                    .collect()
            })
            .collect(),
        requested: Mutex::new(vec![vec![false; ne]; nl]),
    };
    let tokens = [3, 1, 4, 1, 5, 9, 2, 6];
    let mut a = Session::new(&m, 2, 64);
    let mut want = a.step(&tokens).unwrap().to_vec();
    want.extend_from_slice(a.step(&[5]).unwrap());
    let mut b = Session::new(&m, 2, 64).with_experts(&copies);
    let mut got = b.step(&tokens).unwrap().to_vec();
    got.extend_from_slice(b.step(&[5]).unwrap());
    assert_eq!(differing(&got, &want), 0, "logits from copied experts differ from the mapping's");
    let requested = copies.requested.lock().unwrap().clone();
    for (il, (asked, counts)) in requested.iter().zip(&b.expert_counts).enumerate() {
        let used: Vec<bool> = counts.iter().map(|&c| c > 0).collect();
        assert_eq!(asked, &used, "layer {il}: experts asked of the source vs experts selected");
        assert!(used.iter().any(|&u| u));
    }
}
