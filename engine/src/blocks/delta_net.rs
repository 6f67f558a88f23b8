//! Gated DeltaNet linear attention (`qwen35moe`'s recurrent layers): llama.cpp's
//! `build_layer_attn_linear` of `src/models/qwen35moe.cpp` with the fused `ggml_gated_delta_net`
//! operator (what llama.cpp's CPU backend runs, for one token and for chunks alike).
//!
//! # Spec
//! Shapes: `S` = `ssm.state_size` (the dimension of a head), `Hk` = `ssm.group_count` Q/K heads,
//! `Hv` = `ssm.time_step_rank` V heads, `C = 2·S·Hk + S·Hv` convolution channels, `d_conv` taps.
//! For the `n` normed input rows `xn` of a batch, token after token:
//! ```text
//! qkv = Wqkv·xn, z = Wgate·xn, b = Wbeta·xn, a = Walpha·xn     one parallel region (4 x ggml_mul_mat)
//! beta = sigmoid(b)                                         ggml_sigmoid (libm expf)
//! g    = softplus(a + dt_bias) · ssm_a                      ggml_add, ggml_softplus (x > 20 ? x :
//!                                                           logf(1 + expf(x))), ggml_mul
//! conv: per channel c, the window [state_c (d_conv - 1 values), qkv_c]:
//!   y_c = Σ_i window_i · w_c,i from 0 in tap order, in the roundings of ggml_ssm_conv as GCC
//!   vectorises its loop over the taps for the level's build ([`ConvShape`]): whole vectors
//!   of taps as rounded products added one by one, the rest a chain of fused multiply-adds;
//!   the state keeps the window's last d_conv - 1 values
//! y = silu(y)                                               ggml_silu (vector exp, [`vmath::silu`])
//! q, k, v = y[0..S·Hk], y[S·Hk..2·S·Hk], y[2·S·Hk..]
//! q, k per head: l2 norm = rmsnorm(h, eps / S) · (1/sqrt(S))  ggml_rms_norm, ggml_scale
//! per V head h (Q/K head h mod Hk), state M (S x S, row j = column j of the math's S):
//!   M *= expf(g_h)                                          ggml_vec_scale_f32
//!   d_j = (v_j - dot(M_j, k)) · beta_h                      ggml_vec_dot_f32
//!   M_j += k · d_j                                          ggml_vec_mad_f32 (fused)
//!   o_j = dot(M_j, q) · (1/sqrt(S))
//! o per head = rmsnorm(o_h, ssm_norm) · silu(z_h)           ggml_rms_norm, ggml_mul, ggml_silu
//! out = Wout·o                                              ggml_mul_mat (ssm_out)
//! ```
//! The state lives in the session ([`DeltaState`]: f32, the convolution window and one `S x S`
//! matrix per V head, llama.cpp's `r_l`/`s_l` recurrent cache) and is updated in place. A batch
//! and token-by-token steps give the same bits: every operation above is per token, in order.
//! The V heads run as pool tasks.

use crate::arch::{Config, Ssm};
use crate::blocks::self_attn::sigmoid;
use crate::blocks::weights::Tensors;
use crate::blocks::{Ctx, MatJob, QRows, SharedMut, Weight, dump, rms_norm, sized};
use crate::model::ModelError;
use crate::quant::{self, GgmlType};
use crate::vmath;

/// The tensors of a gated DeltaNet block.
#[derive(Debug)]
pub struct DeltaNet {
    /// `attn_qkv`: `C x n_embd`.
    pub wqkv: Weight,
    /// `attn_gate` (z): `S·Hv x n_embd`.
    pub wgate: Weight,
    /// `ssm_beta`, `ssm_alpha`: `Hv x n_embd`.
    pub wbeta: Weight,
    pub walpha: Weight,
    /// `ssm_conv1d`: `d_conv` taps per channel, f32.
    pub conv: Vec<f32>,
    /// `ssm_dt.bias` and `ssm_a` (`-exp(A_log)`), `Hv` values each.
    pub dt_bias: Vec<f32>,
    pub a: Vec<f32>,
    /// `ssm_norm`: `S` values.
    pub norm: Vec<f32>,
    /// `ssm_out`: `n_embd x S·Hv`.
    pub wout: Weight,
    pub ssm: Ssm,
}

impl DeltaNet {
    pub fn load(t: &Tensors<'_>, c: &Config, il: usize) -> Result<DeltaNet, ModelError> {
        let n = |s: &str| format!("blk.{il}.{s}.weight");
        let ssm = c.ssm.ok_or_else(|| ModelError::Bad {
            path: String::new(),
            what: format!("layer {il} is recurrent but the file has no ssm.* hyperparameters"),
        })?;
        let d = c.n_embd;
        Ok(DeltaNet {
            wqkv: t.matrix(&n("attn_qkv"), d, ssm.conv_channels())?,
            wgate: t.matrix(&n("attn_gate"), d, ssm.value_dim())?,
            wbeta: t.matrix(&n("ssm_beta"), d, ssm.n_v_heads)?,
            walpha: t.matrix(&n("ssm_alpha"), d, ssm.n_v_heads)?,
            conv: t.vector_2d(&n("ssm_conv1d"), ssm.d_conv, ssm.conv_channels())?,
            dt_bias: t.vector(&format!("blk.{il}.ssm_dt.bias"), ssm.n_v_heads)?,
            a: t.vector(&format!("blk.{il}.ssm_a"), ssm.n_v_heads)?,
            norm: t.vector(&n("ssm_norm"), ssm.d_state)?,
            wout: t.matrix(&n("ssm_out"), ssm.value_dim(), d)?,
            ssm,
        })
    }
}

/// A DeltaNet layer's recurrent state (f32): the convolution's last `d_conv - 1` inputs per
/// channel (channel-major), and per V head the `S x S` state matrix, row `j` holding column `j`.
#[derive(Debug, Clone, Default)]
pub struct DeltaState {
    pub conv: Vec<f32>,
    pub ssm: Vec<f32>,
}

impl DeltaState {
    pub fn new(ssm: &Ssm) -> DeltaState {
        DeltaState { conv: vec![0.0; ssm.conv_state_len()], ssm: vec![0.0; ssm.ssm_state_len()] }
    }

    pub fn clear(&mut self) {
        self.conv.fill(0.0);
        self.ssm.fill(0.0);
    }

    pub fn bytes(&self) -> usize {
        4 * (self.conv.len() + self.ssm.len())
    }
}

/// The block's buffers, reused across steps.
#[derive(Debug, Default)]
pub struct Scratch {
    xqkv: QRows,
    xz: QRows,
    xb: QRows,
    xa: QRows,
    qkv: Vec<f32>,
    z: Vec<f32>,
    beta: Vec<f32>,
    g: Vec<f32>,
    o: Vec<f32>,
    head: Vec<f32>,
}

/// `f32` values as the little-endian bytes the `F32` kernels take (x86 is little-endian).
fn f32_bytes(x: &[f32]) -> &[u8] {
    // SAFETY: any f32 is four initialised bytes; u8 has alignment 1; the length is the same
    // memory's.
    unsafe { std::slice::from_raw_parts(x.as_ptr().cast::<u8>(), 4 * x.len()) }
}

/// `ggml_vec_dot_f32` of two f32 rows (ggml's float order, [`quant::vec_dot`] on `F32`).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    quant::vec_dot(GgmlType::F32, a.len(), f32_bytes(a), f32_bytes(b))
}

/// The l2 norm of `build_gdn_l2_norm`: `rmsnorm(x, eps / n) · (1/sqrt(n))` in place.
fn l2_norm(x: &mut [f32], eps: f32) {
    let n = x.len() as f32;
    let sum: f64 = x.iter().map(|&v| f64::from(v * v)).sum();
    let mean = (sum / x.len() as f64) as f32;
    let scale = 1.0 / (mean + eps / n).sqrt();
    let post = 1.0 / n.sqrt();
    x.iter_mut().for_each(|v| *v = (*v * scale) * post);
}

/// Where one V head's vectors are in a token's row of the convolution output.
struct Head {
    h: usize,
    /// Its Q/K head.
    kh: usize,
    sd: usize,
    /// Where K starts (after Q).
    kd: usize,
}

/// One token of the gated delta rule on head `hd`'s state `m` (module docs): decay, delta,
/// rank-1 update, output row `oh`.
fn recur(hd: &Head, m: &mut [f32], row: &[f32], g: f32, b: f32, oh: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("fma") {
        // SAFETY: FMA was detected at run time.
        return unsafe { recur_fma(hd, m, row, g, b, oh) };
    }
    recur_impl(hd, m, row, g, b, oh)
}

/// [`recur_impl`] compiled with FMA (so `mul_add` is one instruction, and the loops vectorise).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn recur_fma(hd: &Head, m: &mut [f32], row: &[f32], g: f32, b: f32, oh: &mut [f32]) {
    recur_impl(hd, m, row, g, b, oh)
}

#[inline(always)]
fn recur_impl(hd: &Head, m: &mut [f32], row: &[f32], g: f32, b: f32, oh: &mut [f32]) {
    let (sd, kh, h, kd) = (hd.sd, hd.kh, hd.h, hd.kd);
    let q = &row[kh * sd..(kh + 1) * sd];
    let k = &row[kd + kh * sd..kd + (kh + 1) * sd];
    let v = &row[2 * kd + h * sd..2 * kd + (h + 1) * sd];
    let decay = g.exp();
    let scale = 1.0 / (sd as f32).sqrt();
    m.iter_mut().for_each(|x| *x *= decay);
    // Row j of `m` changes only with delta j, so each row is finished before the next: the
    // same operations, per element, as ggml's separate passes.
    for (j, mj) in m.chunks_mut(sd).enumerate() {
        let dj = (v[j] - dot(mj, k)) * b;
        mj.iter_mut().zip(k).for_each(|(x, &kv)| *x = kv.mul_add(dj, *x));
    }
    for (j, oj) in oh.iter_mut().enumerate() {
        *oj = dot(&m[j * sd..(j + 1) * sd], q) * scale;
    }
}

/// How GCC vectorises `ggml_ssm_conv`'s loop over the `d_conv` taps (`sumf += s[i0] * c[i0]`,
/// no reassociation allowed) in the llama.cpp build of an ISA level, read from the builds'
/// disassembly: a loop over whole vectors of `wide` taps (one `vmulps`, then the products added
/// to the sum one by one with `vaddss`), then one vector of `half` taps if at least that many
/// are left (the same way), then the last taps one by one as fused multiply-adds
/// (`vfmadd231ss`, GCC contracts the scalar `a * b + c`).
///
/// | build | `wide` | `half` | `d_conv = 4` (qwen35moe) |
/// |---|---|---|---|
/// | avx2 | 8 (`ymm`) | 4 (`xmm`) | 4 rounded products added in order |
/// | avx512 | 16 (`zmm`) | 8 (`ymm`) | a chain of 4 FMAs |
///
/// The scalar level reproduces no build; it takes the FMA chain (as does neon, unread so far).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ConvShape {
    wide: usize,
    half: usize,
}

impl ConvShape {
    fn of(level: quant::Backend) -> ConvShape {
        match level {
            quant::Backend::Avx2 => ConvShape { wide: 8, half: 4 },
            quant::Backend::Avx512 => ConvShape { wide: 16, half: 8 },
            // The neon level's build was not read (no aarch64 parity yet): the FMA chain, as scalar.
            quant::Backend::Scalar | quant::Backend::Neon => ConvShape { wide: usize::MAX, half: usize::MAX },
        }
    }

    /// `Σ_i at(i) · taps_i` from 0 in this shape's roundings.
    #[inline(always)]
    fn sum(self, at: impl Fn(usize) -> f32, taps: &[f32]) -> f32 {
        let nc = taps.len();
        let mut sum = 0f32;
        let mut i = 0;
        let products = |from: usize, to: usize, sum: &mut f32| {
            for (k, &tap) in taps.iter().enumerate().take(to).skip(from) {
                *sum += at(k) * tap;
            }
        };
        while nc - i >= self.wide {
            products(i, i + self.wide, &mut sum);
            i += self.wide;
        }
        if nc - i >= self.half {
            products(i, i + self.half, &mut sum);
            i += self.half;
        }
        for (k, &tap) in taps.iter().enumerate().skip(i) {
            sum = at(k).mul_add(tap, sum);
        }
        sum
    }
}

/// One token of the causal convolution in place: channel `c` of `row` becomes
/// `Σ_i window_i · taps_c,i` over the window `[state_c, row_c]` (in the roundings of
/// [`ConvShape`]), and the state keeps the window's last `d_conv - 1` values.
fn conv(row: &mut [f32], state: &mut [f32], taps: &[f32], dc: usize) {
    let shape = ConvShape::of(quant::backend());
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("fma") {
        // SAFETY: FMA was detected at run time.
        return unsafe { conv_fma(shape, row, state, taps, dc) };
    }
    conv_impl(shape, row, state, taps, dc)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn conv_fma(shape: ConvShape, row: &mut [f32], state: &mut [f32], taps: &[f32], dc: usize) {
    conv_impl(shape, row, state, taps, dc)
}

#[inline(always)]
fn conv_impl(shape: ConvShape, row: &mut [f32], state: &mut [f32], taps: &[f32], dc: usize) {
    let win = dc - 1;
    for ((x, st), tp) in row.iter_mut().zip(state.chunks_mut(win)).zip(taps.chunks(dc)) {
        let sum = shape.sum(|i| if i < win { st[i] } else { *x }, tp);
        st.copy_within(1.., 0);
        st[win - 1] = *x;
        *x = sum;
    }
}

/// softplus as `op_softplus`.
fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { (1.0 + x.exp()).ln() }
}

/// `out` (`n x n_embd`) = the block of the module docs on the normed rows `xn`; advances `st`.
pub fn forward(
    ctx: &Ctx<'_>,
    il: usize,
    w: &DeltaNet,
    st: &mut DeltaState,
    xn: &[f32],
    s: &mut Scratch,
    out: &mut [f32],
) -> Result<(), ModelError> {
    let c = ctx.cfg();
    let (n, d) = (ctx.n, c.n_embd);
    let ssm = &w.ssm;
    let (sd, hk, hv, ch, dc) = (ssm.d_state, ssm.n_k_heads, ssm.n_v_heads, ssm.conv_channels(), ssm.d_conv);
    let (kd, vd) = (ssm.key_dim(), ssm.value_dim());
    let Scratch { xqkv, xz, xb, xa, qkv, z, beta, g, o, head } = s;
    let (qkv, z, beta, g, o) =
        (sized(qkv, n * ch), sized(z, n * vd), sized(beta, n * hv), sized(g, n * hv), sized(o, n * vd));

    xqkv.quantize(w.wqkv.ty, xn, d)?;
    xz.quantize(w.wgate.ty, xn, d)?;
    xb.quantize(w.wbeta.ty, xn, d)?;
    xa.quantize(w.walpha.ty, xn, d)?;
    ctx.matmuls(&mut [
        MatJob { w: &w.wqkv, x: xqkv, out: qkv },
        MatJob { w: &w.wgate, x: xz, out: z },
        MatJob { w: &w.wbeta, x: xb, out: beta },
        MatJob { w: &w.walpha, x: xa, out: g },
    ]);
    dump("linear_attn_qkv_mixed", Some(il), qkv);
    beta.iter_mut().for_each(|b| *b = sigmoid(*b));
    for gb in g.chunks_mut(hv) {
        for ((x, &dt), &a) in gb.iter_mut().zip(&w.dt_bias).zip(&w.a) {
            *x = softplus(*x + dt) * a;
        }
    }
    dump("gate", Some(il), g);

    // Causal convolution over the window [state, token], token after token, then SiLU.
    for row in qkv.chunks_mut(ch) {
        conv(row, &mut st.conv, &w.conv, dc);
        vmath::silu(row);
    }
    dump("conv_output_silu", Some(il), qkv);
    for row in qkv.chunks_mut(ch) {
        row[..2 * kd].chunks_mut(sd).for_each(|h| l2_norm(h, c.rms_eps));
    }

    // The recurrence, one pool task per V head (each owns its state matrix).
    {
        let qkv = &*qkv;
        let (beta, g) = (&*beta, &*g);
        let o_p = SharedMut::new(o);
        let st_p = SharedMut::new(&mut st.ssm);
        ctx.pool.run(hv, &|h| {
            // SAFETY: task h alone touches state matrix h and the outputs of head h.
            let m = unsafe { st_p.slice(h * sd * sd..(h + 1) * sd * sd) };
            let head = Head { h, kh: h % hk, sd, kd };
            for t in 0..n {
                // SAFETY: as above.
                let oh = unsafe { o_p.slice(t * vd + h * sd..t * vd + (h + 1) * sd) };
                let row = &qkv[t * ch..(t + 1) * ch];
                recur(&head, m, row, g[t * hv + h], beta[t * hv + h], oh);
            }
        });
    }
    dump("attn_output", Some(il), o);

    // Gated norm per head, then the output projection.
    let head = sized(head, sd);
    for (oh, zh) in o.chunks_mut(sd).zip(z.chunks_mut(sd)) {
        head.copy_from_slice(oh);
        rms_norm(head, &w.norm, c.rms_eps, oh);
        vmath::silu(zh);
        oh.iter_mut().zip(zh.iter()).for_each(|(x, &zv)| *x *= zv);
    }
    dump("final_output", Some(il), o);
    ctx.matmul(&w.wout, xqkv.quantize(w.wout.ty, o, vd)?, out);
    dump("linear_attn_out", Some(il), out);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::Backend;

    /// Values whose products and partial sums round (a xorshift over ±[0.5, 2)).
    fn values(seed: u64, n: usize) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let v = 0.5 + 1.5 * ((s >> 40) as f32 / (1u64 << 24) as f32);
                if s & 1 == 0 { v } else { -v }
            })
            .collect()
    }

    /// The avx2 build's order for `d_conv = 4` (4 rounded products added from 0 in order) and the
    /// avx512 build's (a chain of 4 FMAs), spelled out; the two differ on some windows, so the
    /// level matters.
    #[test]
    fn conv_sums_follow_each_builds_vectorisation() {
        let (mut differ, n) = (0u64, 1000);
        for seed in 1..=n {
            let (w, t) = (values(seed, 4), values(seed + 7919, 4));
            let rounded = (((0f32 + w[0] * t[0]) + w[1] * t[1]) + w[2] * t[2]) + w[3] * t[3];
            let fused = w[3].mul_add(t[3], w[2].mul_add(t[2], w[1].mul_add(t[1], w[0].mul_add(t[0], 0.0))));
            let at = |i: usize| w[i];
            assert_eq!(ConvShape::of(Backend::Avx2).sum(at, &t).to_bits(), rounded.to_bits(), "seed {seed}");
            assert_eq!(ConvShape::of(Backend::Avx512).sum(at, &t).to_bits(), fused.to_bits(), "seed {seed}");
            differ += u64::from(rounded.to_bits() != fused.to_bits());
        }
        assert!(differ > n / 10, "the two orders differ on {differ} of {n} windows");
    }

    /// Longer windows: whole vectors of rounded products, one half vector, then FMAs (13 taps at
    /// avx2: 8 + 4 products, 1 FMA; 29 at avx512: 16 + 8 products, 5 FMAs).
    #[test]
    fn conv_sums_of_long_windows() {
        let reference = |w: &[f32], t: &[f32], products: usize| {
            let mut s = 0f32;
            for (i, (&wi, &ti)) in w.iter().zip(t).enumerate() {
                s = if i < products { s + wi * ti } else { wi.mul_add(ti, s) };
            }
            s
        };
        for seed in 1..=200 {
            for (level, n, products) in [(Backend::Avx2, 13, 12), (Backend::Avx2, 8, 8), (Backend::Avx512, 29, 24)] {
                let (w, t) = (values(seed, n), values(seed + 104_729, n));
                let got = ConvShape::of(level).sum(|i| w[i], &t);
                assert_eq!(got.to_bits(), reference(&w, &t, products).to_bits(), "{level:?} {n} taps, seed {seed}");
            }
        }
    }
}
