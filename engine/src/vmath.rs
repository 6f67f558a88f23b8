//! Elementwise math with ggml's CPU numerics: `exp` for softmax and `silu` for the SwiGLU of
//! the experts.
//!
//! A quantized model amplifies tiny differences: activations are rounded to 8-bit codes before
//! every matrix product, and a 1e-7 change can move one code, which shifts a whole output row
//! of the next product. To decode the same tokens as llama.cpp, the engine therefore computes
//! `exp` the way ggml's vectorised `ggml_v_expf` does in the llama.cpp build of the engine's ISA
//! level (`ENGINE_ISA`; the AVX-512 and the AVX2+FMA variants are different
//! polynomials/reconstructions; the NEON one is the AVX2 one on 4 lanes), with libm `expf` for the
//! elements ggml leaves to its scalar tail, and `silu(x) = x / (1 + exp(-x))` on top. The
//! lanes are computed one by one here (same operations, same roundings: every fused
//! multiply-add of ggml is an `f32::mul_add`), inside functions compiled with the CPU's FMA
//! enabled.

use crate::quant::Backend;

/// Which of ggml's vector `exp` variants a native llama.cpp build runs on this CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpKind {
    /// AVX-512F+DQ: 16 lanes, `scalef` reconstruction.
    Avx512,
    /// AVX2+FMA: 8 lanes, exponent-add reconstruction.
    Avx2,
    /// NEON (aarch64): 4 lanes; ggml's NEON `ggml_v_expf` is its AVX2+FMA one lane by lane (the
    /// same constants, fused multiply-adds and reconstruction), so [`exp_avx2_lane`] computes it.
    Neon,
    /// No vector path: libm `expf` everywhere.
    Libm,
}

impl ExpKind {
    /// Vector width ggml uses (elements beyond the last full vector use libm).
    pub fn lanes(self) -> usize {
        match self {
            ExpKind::Avx512 => 16,
            ExpKind::Avx2 => 8,
            ExpKind::Neon => 4,
            ExpKind::Libm => 1,
        }
    }
}

/// The `exp` of the llama.cpp build the ISA level reproduces ([`crate::quant::isa`]): AVX-512
/// (which needs `__AVX512F__` and `__AVX512DQ__`, both part of that level), AVX2+FMA, or libm
/// at the scalar level.
pub fn exp_kind() -> ExpKind {
    match crate::quant::backend() {
        Backend::Avx512 => ExpKind::Avx512,
        Backend::Avx2 => ExpKind::Avx2,
        Backend::Neon => ExpKind::Neon,
        Backend::Scalar => ExpKind::Libm,
    }
}

const R: f32 = f32::from_bits(0x4b40_0000); // 0x1.8p23
const LOG2E: f32 = f32::from_bits(0x3fb8_aa3b); // 0x1.715476p+0
const LN2_LO: f32 = f32::from_bits(0x35bf_be8e); // 0x1.7f7d1cp-20
const LN2_HI: f32 = f32::from_bits(0x3f31_7200); // 0x1.62e4p-1
const C5: f32 = f32::from_bits(0x3c07_2010); // 0x1.0e4020p-7
const C4: f32 = f32::from_bits(0x3d2b_9f17); // 0x1.573e2ep-5
const C3: f32 = f32::from_bits(0x3e2a_af33); // 0x1.555e66p-3
const C2: f32 = f32::from_bits(0x3eff_fedb); // 0x1.fffdb6p-2
const C1: f32 = f32::from_bits(0x3f7f_fff6); // 0x1.ffffecp-1

#[inline(always)]
fn reduce(x: f32) -> (f32, f32, f32) {
    let z = x.mul_add(LOG2E, R);
    let n = z - R;
    let b = (-n).mul_add(LN2_LO, (-n).mul_add(LN2_HI, x));
    (z, n, b)
}

/// One lane of ggml's AVX2 `ggml_v_expf`.
#[inline(always)]
fn exp_avx2_lane(x: f32) -> f32 {
    let (z, n, b) = reduce(x);
    let e = z.to_bits() << 23;
    let k = f32::from_bits(e.wrapping_add(1f32.to_bits()));
    let c = n.abs() > 126.0;
    let u = b * b;
    let j = C5.mul_add(b, C4).mul_add(u, C3.mul_add(b, C2)).mul_add(u, C1 * b);
    if !c {
        return j.mul_add(k, k);
    }
    let g: u32 = if n <= 0.0 { 0x8200_0000 } else { 0 };
    let s1 = f32::from_bits(g.wrapping_add(0x7f00_0000));
    let s2 = f32::from_bits(e.wrapping_sub(g));
    if n.abs() > 192.0 { s1 * s1 } else { s2.mul_add(j, s2) * s1 }
}

/// One lane of ggml's AVX-512 `ggml_v_expf`.
#[inline(always)]
fn exp_avx512_lane(x: f32) -> f32 {
    let (_, n, b) = reduce(x);
    if n.abs() > 192.0 {
        return if n <= 0.0 { 0.0 } else { f32::INFINITY };
    }
    let u = b * b;
    let j = C5.mul_add(b, C4).mul_add(u, C3.mul_add(b, C2)).mul_add(u, C1.mul_add(b, 1.0));
    // scalef(j, n) = j * 2^n, n integral with |n| <= 192: two exact power-of-two steps.
    let ni = n as i32;
    let (h1, h2) = (ni / 2, ni - ni / 2);
    let p = |e: i32| f32::from_bits(((e + 127) as u32) << 23);
    j * p(h1) * p(h2)
}

#[inline(always)]
fn exp_lane(kind: ExpKind, x: f32) -> f32 {
    match kind {
        ExpKind::Avx512 => exp_avx512_lane(x),
        ExpKind::Avx2 | ExpKind::Neon => exp_avx2_lane(x),
        ExpKind::Libm => x.exp(),
    }
}

/// `y[i] = exp(y[i] - max)`; returns the sum (f64, accumulated per vector like ggml's
/// `ggml_vec_soft_max_f32`). `all_vector` treats the tail like full vectors (ggml pads the KV
/// rows of attention with masked entries, so every visible score is in a full vector).
#[inline(always)]
fn softmax_exp_impl(kind: ExpKind, y: &mut [f32], max: f32, all_vector: bool) -> f64 {
    let lanes = kind.lanes();
    let full = if all_vector { y.len() } else { y.len() / lanes * lanes };
    let mut sum = 0f64;
    for chunk in y[..full].chunks_mut(lanes) {
        for v in chunk.iter_mut() {
            *v = exp_lane(kind, *v - max);
        }
        sum += f64::from(if kind == ExpKind::Neon { hsum_pairs(chunk) } else { hsum_tree(chunk) });
    }
    for v in &mut y[full..] {
        *v = (*v - max).exp();
        sum += f64::from(*v);
    }
    sum
}

/// The horizontal sum of one vector as ggml's x86 code does it: a 16-lane AVX-512 vector with
/// GCC's `_mm512_reduce_add_ps` (upper + lower 8 lanes, then as below), an 8-lane AVX2 vector
/// with `hsum_float_8` (upper + lower 4 lanes, then lanes `(0+2) + (1+3)`); shorter chunks (a
/// partial vector when `all_vector`, or the 1-lane libm kind) are treated as zero-padded.
#[inline(always)]
fn hsum_tree(v: &[f32]) -> f32 {
    let mut l = [0f32; 16];
    l[..v.len().min(16)].copy_from_slice(&v[..v.len().min(16)]);
    if v.len() <= 1 {
        return l[0];
    }
    let mut t = [0f32; 8];
    if v.len() > 8 {
        for i in 0..8 {
            t[i] = l[i + 8] + l[i];
        }
    } else {
        t.copy_from_slice(&l[..8]);
    }
    let q = [t[4] + t[0], t[5] + t[1], t[6] + t[2], t[7] + t[3]];
    (q[0] + q[2]) + (q[1] + q[3])
}

/// The horizontal sum of a 4-lane NEON vector as GCC compiles `vaddvq_f32` (two `faddp`):
/// `(v0 + v1) + (v2 + v3)`; a shorter chunk (a partial vector when `all_vector`) is zero-padded.
#[inline(always)]
fn hsum_pairs(v: &[f32]) -> f32 {
    let mut l = [0f32; 4];
    l[..v.len().min(4)].copy_from_slice(&v[..v.len().min(4)]);
    (l[0] + l[1]) + (l[2] + l[3])
}

/// `swiglu` lane by lane with the emulated `exp` (the reference for the SIMD versions; the
/// scalar level's path).
#[inline(always)]
fn swiglu_impl(kind: ExpKind, gate: &[f32], up: &[f32], out: &mut [f32]) {
    let lanes = kind.lanes();
    let full = gate.len() / lanes * lanes;
    for i in 0..full {
        let x = gate[i];
        out[i] = (x / (1.0 + exp_lane(kind, 0.0 - x))) * up[i];
    }
    swiglu_tail(gate, up, out, full);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,avx512f")]
fn softmax_exp_avx512(y: &mut [f32], max: f32, all_vector: bool) -> f64 {
    softmax_exp_impl(ExpKind::Avx512, y, max, all_vector)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn softmax_exp_avx2(y: &mut [f32], max: f32, all_vector: bool) -> f64 {
    softmax_exp_impl(ExpKind::Avx2, y, max, all_vector)
}

/// ggml's `ggml_v_expf` and `ggml_vec_swiglu_f32` vector loops with the same intrinsics (so
/// the same roundings as [`exp_avx512_lane`]/[`exp_avx2_lane`] lane by lane, which the tests
/// check); the elements after the last full vector go through libm like ggml's scalar tail.
#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    use super::{C1, C2, C3, C4, C5, LN2_HI, LN2_LO, LOG2E, R};

    /// ggml's AVX-512 `ggml_v_expf`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq")]
    fn expf512(x: __m512) -> __m512 {
        let r = _mm512_set1_ps(R);
        let z = _mm512_fmadd_ps(x, _mm512_set1_ps(LOG2E), r);
        let n = _mm512_sub_ps(z, r);
        let b = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x));
        let d = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(_mm512_abs_ps(n), _mm512_set1_ps(192.0));
        let u = _mm512_mul_ps(b, b);
        let j = _mm512_fmadd_ps(
            _mm512_fmadd_ps(
                _mm512_fmadd_ps(_mm512_set1_ps(C5), b, _mm512_set1_ps(C4)),
                u,
                _mm512_fmadd_ps(_mm512_set1_ps(C3), b, _mm512_set1_ps(C2)),
            ),
            u,
            _mm512_fmadd_ps(_mm512_set1_ps(C1), b, _mm512_set1_ps(1.0)),
        );
        let res = _mm512_scalef_ps(j, n);
        if d == 0 {
            return res;
        }
        let zero = _mm512_setzero_ps();
        let alt = _mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_LE_OQ>(n, zero), _mm512_set1_ps(f32::INFINITY), zero);
        _mm512_mask_blend_ps(d, res, alt)
    }

    /// ggml's AVX2+FMA `ggml_v_expf`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn expf256(x: __m256) -> __m256 {
        let r = _mm256_set1_ps(R);
        let z = _mm256_fmadd_ps(x, _mm256_set1_ps(LOG2E), r);
        let n = _mm256_sub_ps(z, r);
        let b = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x));
        let e = _mm256_slli_epi32::<23>(_mm256_castps_si256(z));
        let k = _mm256_castsi256_ps(_mm256_add_epi32(e, _mm256_castps_si256(_mm256_set1_ps(1.0))));
        let abs_n = _mm256_andnot_ps(_mm256_set1_ps(-0.0), n);
        let c = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GT_OQ>(abs_n, _mm256_set1_ps(126.0)));
        let u = _mm256_mul_ps(b, b);
        let j = _mm256_fmadd_ps(
            _mm256_fmadd_ps(
                _mm256_fmadd_ps(_mm256_set1_ps(C5), b, _mm256_set1_ps(C4)),
                u,
                _mm256_fmadd_ps(_mm256_set1_ps(C3), b, _mm256_set1_ps(C2)),
            ),
            u,
            _mm256_mul_ps(_mm256_set1_ps(C1), b),
        );
        if _mm256_movemask_ps(_mm256_castsi256_ps(c)) == 0 {
            return _mm256_fmadd_ps(j, k, k);
        }
        let g = _mm256_and_si256(
            _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LE_OQ>(n, _mm256_setzero_ps())),
            _mm256_set1_epi32(0x8200_0000u32 as i32),
        );
        let s1 = _mm256_castsi256_ps(_mm256_add_epi32(g, _mm256_set1_epi32(0x7f00_0000)));
        let s2 = _mm256_castsi256_ps(_mm256_sub_epi32(e, g));
        let d = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GT_OQ>(abs_n, _mm256_set1_ps(192.0)));
        let (c, d) = (_mm256_castsi256_ps(c), _mm256_castsi256_ps(d));
        _mm256_or_ps(
            _mm256_and_ps(d, _mm256_mul_ps(s1, s1)),
            _mm256_andnot_ps(
                d,
                _mm256_or_ps(
                    _mm256_and_ps(c, _mm256_mul_ps(_mm256_fmadd_ps(s2, j, s2), s1)),
                    _mm256_andnot_ps(c, _mm256_fmadd_ps(k, j, k)),
                ),
            ),
        )
    }

    /// `out = silu(gate) * up` as `ggml_vec_swiglu_f32` of an AVX-512 build: 16 lanes
    /// `(x / (1 + expf512(0 - x))) * g`, libm for the tail.
    #[target_feature(enable = "avx512f,avx512dq,avx2,fma")]
    pub(super) fn swiglu_avx512(gate: &[f32], up: &[f32], out: &mut [f32]) {
        let full = gate.len() / 16 * 16;
        let (one, zero) = (_mm512_set1_ps(1.0), _mm512_setzero_ps());
        for i in (0..full).step_by(16) {
            assert!(i + 16 <= gate.len() && i + 16 <= up.len() && i + 16 <= out.len());
            // SAFETY: 16 in-bounds f32 of each slice (checked above); no alignment needed.
            unsafe {
                let x = _mm512_loadu_ps(gate.as_ptr().add(i));
                let s = _mm512_div_ps(x, _mm512_add_ps(one, expf512(_mm512_sub_ps(zero, x))));
                _mm512_storeu_ps(out.as_mut_ptr().add(i), _mm512_mul_ps(s, _mm512_loadu_ps(up.as_ptr().add(i))));
            }
        }
        super::swiglu_tail(gate, up, out, full);
    }

    /// `ggml_vec_swiglu_f32` of an AVX2+FMA build: 8 lanes, libm for the tail.
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn swiglu_avx2(gate: &[f32], up: &[f32], out: &mut [f32]) {
        let full = gate.len() / 8 * 8;
        let (one, zero) = (_mm256_set1_ps(1.0), _mm256_setzero_ps());
        for i in (0..full).step_by(8) {
            assert!(i + 8 <= gate.len() && i + 8 <= up.len() && i + 8 <= out.len());
            // SAFETY: 8 in-bounds f32 of each slice (checked above); no alignment needed.
            unsafe {
                let x = _mm256_loadu_ps(gate.as_ptr().add(i));
                let s = _mm256_div_ps(x, _mm256_add_ps(one, expf256(_mm256_sub_ps(zero, x))));
                _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_mul_ps(s, _mm256_loadu_ps(up.as_ptr().add(i))));
            }
        }
        super::swiglu_tail(gate, up, out, full);
    }
}

/// The scalar tail of `ggml_vec_swiglu_f32` from element `from`: `ggml_silu_f32` with libm.
fn swiglu_tail(gate: &[f32], up: &[f32], out: &mut [f32], from: usize) {
    for i in from..gate.len() {
        let x = gate[i];
        out[i] = (x / (1.0 + (-x).exp())) * up[i];
    }
}

/// Softmax in place, ggml's way: `exp(x - max)` (vector `exp` as above), f64 sum, then a
/// multiply by the f32 inverse of the sum.
pub fn softmax(x: &mut [f32], all_vector: bool) {
    if x.is_empty() {
        return;
    }
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum = match exp_kind() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: exp_kind() is Avx512 only at the avx512 ISA level, which `quant::isa` grants
        // only after detecting avx512f/bw/dq/vl, avx2 and fma at run time.
        ExpKind::Avx512 => unsafe { softmax_exp_avx512(x, max, all_vector) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the avx2 level is granted only after detecting avx2 and fma at run time.
        ExpKind::Avx2 => unsafe { softmax_exp_avx2(x, max, all_vector) },
        kind => softmax_exp_impl(kind, x, max, all_vector),
    };
    let inv = (1.0 / sum) as f32;
    x.iter_mut().for_each(|v| *v *= inv);
}

/// `out = silu(gate) * up`, like ggml's `ggml_vec_swiglu_f32`.
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(gate.len() == up.len() && up.len() == out.len(), "swiglu: length mismatch");
    match exp_kind() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: see `softmax`.
        ExpKind::Avx512 => unsafe { simd::swiglu_avx512(gate, up, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: see `softmax`.
        ExpKind::Avx2 => unsafe { simd::swiglu_avx2(gate, up, out) },
        kind => swiglu_impl(kind, gate, up, out),
    }
}

/// `silu(x) = x / (1 + exp(-x))` in place, like ggml's `ggml_vec_silu_f32` (vector `exp` on full
/// vectors, libm on the tail).
pub fn silu(x: &mut [f32]) {
    fn imp(kind: ExpKind, x: &mut [f32]) {
        let full = x.len() / kind.lanes() * kind.lanes();
        let (head, tail) = x.split_at_mut(full);
        head.iter_mut().for_each(|v| *v = *v / (1.0 + exp_lane(kind, -*v)));
        tail.iter_mut().for_each(|v| *v = *v / (1.0 + (-*v).exp()));
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,avx512f")]
    fn avx512(x: &mut [f32]) {
        imp(ExpKind::Avx512, x)
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    fn avx2(x: &mut [f32]) {
        imp(ExpKind::Avx2, x)
    }
    match exp_kind() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: see `softmax`.
        ExpKind::Avx512 => unsafe { avx512(x) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: see `softmax`.
        ExpKind::Avx2 => unsafe { avx2(x) },
        kind => imp(kind, x),
    }
}

/// gpt-oss's clamped SwiGLU, `ggml_swiglu_oai` with alpha 1.702 and limit 7 (scalar, libm
/// `expf`): `x = min(g, 7)`, `y = clamp(u, -7, 7)`, `out = x / (1 + exp(1.702·(-x))) · (y + 1)`.
pub fn swiglu_oai(gate: &[f32], up: &[f32], out: &mut [f32]) {
    const ALPHA: f32 = 1.702;
    const LIMIT: f32 = 7.0;
    assert!(gate.len() == up.len() && up.len() == out.len(), "swiglu_oai: length mismatch");
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        // std::min(g, limit) and std::clamp(u, -limit, limit).
        let x = if LIMIT < g { LIMIT } else { g };
        let y = u.clamp(-LIMIT, LIMIT);
        let glu = x / (1.0 + (ALPHA * -x).exp());
        *o = glu * (y + 1.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vector_exp_variants_agree_with_libm() {
        for i in -2000..2000 {
            let x = i as f32 * 0.01;
            let want = f64::from(x).exp();
            for got in [exp_avx2_lane(x), exp_avx512_lane(x)] {
                let rel = ((f64::from(got) - want) / want).abs();
                assert!(rel < 2e-6, "exp({x}) = {got}, want {want}");
            }
        }
        assert_eq!(exp_avx512_lane(-200.0), 0.0);
        assert_eq!(exp_avx2_lane(-200.0), 0.0);
        assert!(exp_avx512_lane(200.0).is_infinite());
        assert!(exp_avx2_lane(200.0).is_infinite());
        // Subnormal range goes through the special path of the AVX2 variant.
        // (|n| > 126, result subnormal with ~17 significant bits.)
        for x in [-88.0f32, -90.0] {
            let tiny = exp_avx2_lane(x);
            assert!((f64::from(tiny) / f64::from(x).exp() - 1.0).abs() < 1e-4, "exp({x}) = {tiny}");
        }
    }

    /// The SIMD `swiglu` (ggml's intrinsics) against the lane-by-lane emulation, bit for bit,
    /// at every level this CPU runs, over ordinary, large, tiny and special inputs.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn simd_swiglu_matches_the_lane_emulation() {
        let mut gate: Vec<f32> = (0..4000).map(|i| ((i as f32) * 0.7351).sin() * (1.0 + (i % 97) as f32)).collect();
        gate.extend([0.0, -0.0, 88.0, -88.0, 90.0, -90.0, 104.0, -104.0, 150.0, -150.0, 1e-30, f32::MAX, f32::MIN]);
        gate.extend([f32::INFINITY, f32::NEG_INFINITY, 126.5, -126.5, 127.0, -127.0, 192.5, -192.5, 0.5, -0.5]);
        let up: Vec<f32> = (0..gate.len()).map(|i| 1.0 - (i % 13) as f32 * 0.17).collect();
        let kinds = [
            (ExpKind::Avx2, crate::quant::Backend::Avx2.is_available()),
            (ExpKind::Avx512, crate::quant::Backend::Avx512.is_available()),
        ];
        assert!(kinds[0].1, "x86_64 without AVX2");
        for (kind, available) in kinds {
            if !available {
                continue;
            }
            // Odd lengths and offsets: partial vectors go to the libm tail in both.
            for (start, len) in [(0, gate.len()), (3, 1000), (0, 15), (5, 7)] {
                let (g, u) = (&gate[start..start + len], &up[start..start + len]);
                let mut want = vec![0f32; len];
                swiglu_impl(kind, g, u, &mut want);
                let mut got = vec![0f32; len];
                // SAFETY: the CPU runs the level (checked above).
                unsafe {
                    match kind {
                        ExpKind::Avx512 => simd::swiglu_avx512(g, u, &mut got),
                        _ => simd::swiglu_avx2(g, u, &mut got),
                    }
                }
                for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                    assert!(a.to_bits() == b.to_bits(), "{kind:?} x={} : simd {a} vs lanes {b}", g[i]);
                }
            }
        }
    }

    /// ggml's NEON `ggml_v_expf` (`vec.h`), transcribed with the same intrinsics, against the
    /// lane emulation the `neon` level runs, bit for bit; and `vaddvq_f32` against [`hsum_pairs`].
    #[cfg(target_arch = "aarch64")]
    #[test]
    fn ggml_neon_exp_is_the_lane_emulation() {
        use std::arch::aarch64::*;
        /// # Safety
        /// None beyond NEON, which every aarch64 target has.
        unsafe fn expf4(x: float32x4_t) -> float32x4_t {
            // SAFETY: NEON is part of every aarch64 target; registers only.
            unsafe {
                let r = vdupq_n_f32(R);
                let z = vfmaq_f32(r, x, vdupq_n_f32(LOG2E));
                let n = vsubq_f32(z, r);
                let b = vfmsq_f32(vfmsq_f32(x, n, vdupq_n_f32(LN2_HI)), n, vdupq_n_f32(LN2_LO));
                let e = vshlq_n_u32::<23>(vreinterpretq_u32_f32(z));
                let k = vreinterpretq_f32_u32(vaddq_u32(e, vreinterpretq_u32_f32(vdupq_n_f32(1.0))));
                let c = vcagtq_f32(n, vdupq_n_f32(126.0));
                let u = vmulq_f32(b, b);
                let j = vfmaq_f32(
                    vmulq_f32(vdupq_n_f32(C1), b),
                    vfmaq_f32(
                        vfmaq_f32(vdupq_n_f32(C2), vdupq_n_f32(C3), b),
                        vfmaq_f32(vdupq_n_f32(C4), vdupq_n_f32(C5), b),
                        u,
                    ),
                    u,
                );
                if vpaddd_u64(vreinterpretq_u64_u32(c)) == 0 {
                    return vfmaq_f32(k, j, k);
                }
                let d = vandq_u32(vclezq_f32(n), vdupq_n_u32(0x8200_0000));
                let s1 = vreinterpretq_f32_u32(vaddq_u32(d, vdupq_n_u32(0x7f00_0000)));
                let s2 = vreinterpretq_f32_u32(vsubq_u32(e, d));
                vbslq_f32(
                    vcagtq_f32(n, vdupq_n_f32(192.0)),
                    vmulq_f32(s1, s1),
                    vbslq_f32(c, vmulq_f32(vfmaq_f32(s2, s2, j), s1), vfmaq_f32(k, k, j)),
                )
            }
        }
        let mut xs: Vec<f32> = (0..8000).map(|i| ((i as f32) * 0.7351).sin() * (1.0 + (i % 97) as f32)).collect();
        xs.extend([0.0, -0.0, 88.0, -88.0, 90.0, -90.0, 104.0, -104.0, 150.0, -150.0, 1e-30, f32::MAX, f32::MIN]);
        xs.extend([f32::INFINITY, f32::NEG_INFINITY, 126.5, -126.5, 127.0, -127.0, 192.5, -192.5, 0.5, -0.5, 3.0]);
        assert!(xs.len().is_multiple_of(4));
        for v in xs.chunks_exact(4) {
            // SAFETY: as above; 4 floats read from a 4-element chunk.
            let (got, sum) = unsafe {
                let g = expf4(vld1q_f32(v.as_ptr()));
                let mut o = [0f32; 4];
                vst1q_f32(o.as_mut_ptr(), g);
                (o, vaddvq_f32(vld1q_f32(v.as_ptr())))
            };
            for (x, g) in v.iter().zip(got) {
                let want = exp_lane(ExpKind::Neon, *x);
                assert!(
                    g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()),
                    "exp({x}): ggml {g} vs lanes {want}"
                );
            }
            let want = hsum_pairs(v);
            assert!(
                sum.to_bits() == want.to_bits() || (sum.is_nan() && want.is_nan()),
                "vaddvq {v:?}: {sum} vs {want}"
            );
        }
    }

    #[test]
    fn softmax_sums_to_one() {
        let mut v: Vec<f32> = (0..37).map(|i| (i as f32 * 0.7).sin() * 5.0).collect();
        softmax(&mut v, false);
        let s: f32 = v.iter().sum();
        assert!((s - 1.0).abs() < 1e-5, "{s}");
    }
}
