//! 8-bit types, mostly used for activations.
//!
//! # Layouts
//! `Q8_0`: 32 elements in 34 bytes
//! | offset | size | field                          |
//! |--------|------|--------------------------------|
//! | 0      | 2    | `d`: f16 scale                 |
//! | 2      | 32   | `qs`: i8 quants, element `j` = `qs[j] * d` |
//!
//! `Q8_1`: 32 elements in 36 bytes
//! | offset | size | field                                   |
//! |--------|------|-----------------------------------------|
//! | 0      | 2    | `d`: f16 scale                          |
//! | 2      | 2    | `s`: f16, `d * sum(qs)`                 |
//! | 4      | 32   | `qs`: i8 quants, element `j` = `qs[j] * d` |
//!
//! `Q8_K`: 256 elements in 292 bytes
//! | offset | size | field                                            |
//! |--------|------|--------------------------------------------------|
//! | 0      | 4    | `d`: **f32** scale (negative when the largest-magnitude input is positive) |
//! | 4      | 256  | `qs`: i8 quants, element `j` = `qs[j] * d`        |
//! | 260    | 32   | `bsums`: 16 x i16, `bsums[g] = sum(qs[16g..16g+16])` |
//!
//! # Quantizers
//! * `Q8_0`/`Q8_1` reference (`quantize_row_q8_{0,1}_ref`): `amax = max|x|`,
//!   `d = amax/127`, `id = d ? 1/d : 0`, `q = roundf(x*id)` (halves away from 0),
//!   `Q8_1.s = f16(d * sum(q))`.
//! * x86 flavour (ggml-cpu AVX path): `id = amax ? 127/amax : 0`, halves to even.
//! * ARM flavour (ggml-cpu NEON path): `id = 1/d`, halves to even.
//! * `Q8_K` (`quantize_row_q8_K_ref`, used by ggml-cpu on every architecture):
//!   `max` = the input with the largest magnitude (first one on ties), all-zero
//!   blocks give `d = 0`, `qs = 0`, `bsums = 0`; else `iscale = -127/max`,
//!   `q = min(127, nearest_int(iscale*x))` (halves to even), `d = 1/iscale`.

use super::{Q8Flavor, QK_K, float::f32_to_f16_bits, nearest_int, rd_f16, rd_f32, wr_u16};

pub const QK8_0: usize = 32;
pub const Q8_0_BYTES: usize = 34;
pub const Q8_1_BYTES: usize = 36;
pub const Q8_K_BYTES: usize = 292;

/// Byte offset of `qs` in a `Q8_K` block.
pub const Q8_K_QS: usize = 4;
/// Byte offset of `bsums` in a `Q8_K` block.
pub const Q8_K_BSUMS: usize = 260;

#[inline]
/// `(d, id, fast)`: the block's scale, inverse scale, and whether every
/// `x * id` is a finite value of magnitude below 2^22 (true for any finite
/// block whose inverse scale did not overflow), where the half-to-even flavours
/// reduce to [`nearest_int`].
fn q8_scale(flavor: Q8Flavor, x: &[f32]) -> (f32, f32, bool) {
    // `a > b ? a : b` as ggml's MAX macro; NaN handling is as garbage as ggml's.
    let mut amax = 0f32;
    let mut nan = false;
    for v in x {
        let av = v.abs();
        nan |= av.is_nan();
        amax = if amax > av { amax } else { av };
    }
    let d = amax / 127.0;
    let id = match flavor {
        Q8Flavor::X86 => {
            if amax != 0.0 {
                127.0 / amax
            } else {
                0.0
            }
        }
        Q8Flavor::Reference | Q8Flavor::Arm => {
            if d != 0.0 {
                1.0 / d
            } else {
                0.0
            }
        }
    };
    let fast = !nan && flavor != Q8Flavor::Reference && id.is_finite() && amax * id < 4_000_000.0;
    (d, id, fast)
}

/// Returns the stored quant and the value ggml adds into `Q8_1`'s sum (the
/// SIMD flavours sum the i32 conversions before narrowing them).
#[inline]
fn q8_round(flavor: Q8Flavor, v: f32) -> (i8, i32) {
    // x86 `cvt(t)ps2dq`: NaN and out-of-range values become i32::MIN.
    fn cvt_x86(r: f32) -> i32 {
        if r.is_nan() || !(-2_147_483_648.0..2_147_483_648.0).contains(&r) { i32::MIN } else { r as i32 }
    }
    match flavor {
        // `int8_t q = roundf(v)`: gcc converts through a 32-bit cvttss2si and
        // keeps the low byte.
        Flavor::Reference => {
            let q = cvt_x86(v.round()) as i8;
            (q, q as i32)
        }
        // `_mm256_round_ps` + `_mm256_cvtps_epi32` + saturating packs.
        Flavor::X86 => {
            let r = if v.abs() < 4_194_304.0 {
                // Exactly round-half-even here, and much cheaper than
                // `round_ties_even` (a libm call on baseline x86_64).
                nearest_int(v)
            } else {
                cvt_x86(v.round_ties_even())
            };
            (r.clamp(-128, 127) as i8, r)
        }
        // `vcvtnq_s32_f32` (saturating, NaN -> 0), low byte stored.
        Flavor::Arm => {
            let r = if v.abs() < 4_194_304.0 { nearest_int(v) } else { v.round_ties_even() as i32 };
            (r as i8, r)
        }
    }
}

use Q8Flavor as Flavor;

pub(crate) fn quantize_q8_0(flavor: Q8Flavor, src: &[f32], dst: &mut [u8]) {
    for (x, y) in src.chunks_exact(QK8_0).zip(dst.chunks_exact_mut(Q8_0_BYTES)) {
        let (d, id, fast) = q8_scale(flavor, x);
        wr_u16(y, 0, f32_to_f16_bits(d));
        if fast {
            for (q, v) in y[2..].iter_mut().zip(x) {
                *q = nearest_int(v * id) as i8 as u8;
            }
        } else {
            for (q, v) in y[2..].iter_mut().zip(x) {
                *q = q8_round(flavor, v * id).0 as u8;
            }
        }
    }
}

pub(crate) fn quantize_q8_1(flavor: Q8Flavor, src: &[f32], dst: &mut [u8]) {
    for (x, y) in src.chunks_exact(QK8_0).zip(dst.chunks_exact_mut(Q8_1_BYTES)) {
        let (d, id, fast) = q8_scale(flavor, x);
        wr_u16(y, 0, f32_to_f16_bits(d));
        let mut sum = 0i32;
        if fast {
            for (q, v) in y[4..].iter_mut().zip(x) {
                let r = nearest_int(v * id);
                sum += r;
                *q = r as i8 as u8;
            }
        } else {
            for (q, v) in y[4..].iter_mut().zip(x) {
                let (r, for_sum) = q8_round(flavor, v * id);
                sum = sum.wrapping_add(for_sum);
                *q = r as u8;
            }
        }
        wr_u16(y, 2, f32_to_f16_bits(sum as f32 * d));
    }
}

pub(crate) fn quantize_q8_k(src: &[f32], dst: &mut [u8]) {
    for (x, y) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(Q8_K_BYTES)) {
        let mut max = 0f32;
        let mut amax = 0f32;
        for &v in x {
            let av = v.abs();
            if av > amax {
                amax = av;
                max = v;
            }
        }
        if amax == 0.0 {
            y.fill(0);
            continue;
        }
        let iscale = -127.0 / max;
        for (q, &v) in y[Q8_K_QS..Q8_K_QS + QK_K].iter_mut().zip(x) {
            *q = nearest_int(iscale * v).min(127) as i8 as u8;
        }
        for g in 0..QK_K / 16 {
            let s: i32 = y[Q8_K_QS + 16 * g..Q8_K_QS + 16 * g + 16].iter().map(|&q| q as i8 as i32).sum();
            y[Q8_K_BSUMS + 2 * g..Q8_K_BSUMS + 2 * g + 2].copy_from_slice(&(s as i16).to_le_bytes());
        }
        y[0..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
    }
}

pub(crate) fn dequantize_q8_0(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(Q8_0_BYTES).zip(dst.chunks_exact_mut(QK8_0)) {
        let d = rd_f16(b, 0);
        for (o, &q) in y.iter_mut().zip(&b[2..]) {
            *o = (q as i8 as f32) * d;
        }
    }
}

pub(crate) fn dequantize_q8_1(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(Q8_1_BYTES).zip(dst.chunks_exact_mut(QK8_0)) {
        let d = rd_f16(b, 0);
        for (o, &q) in y.iter_mut().zip(&b[4..]) {
            *o = (q as i8 as f32) * d;
        }
    }
}

pub(crate) fn dequantize_q8_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(Q8_K_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let d = rd_f32(b, 0);
        for (o, &q) in y.iter_mut().zip(&b[Q8_K_QS..Q8_K_QS + QK_K]) {
            *o = d * (q as i8 as f32);
        }
    }
}

#[inline(always)]
pub(crate) fn dot_i8(a: &[u8], b: &[u8]) -> i32 {
    a.iter().zip(b).map(|(&x, &y)| (x as i8 as i32) * (y as i8 as i32)).sum()
}

pub(crate) fn vec_dot_q8_0_q8_0(_n: usize, w: &[u8], x: &[u8]) -> f32 {
    let mut sumf = 0f32;
    for (a, b) in w.chunks_exact(Q8_0_BYTES).zip(x.chunks_exact(Q8_0_BYTES)) {
        let sumi = dot_i8(&a[2..], &b[2..]);
        sumf += sumi as f32 * (rd_f16(a, 0) * rd_f16(b, 0));
    }
    sumf
}

pub(crate) fn vec_dot_q8_1_q8_1(_n: usize, w: &[u8], x: &[u8]) -> f32 {
    let mut sumf = 0f32;
    for (a, b) in w.chunks_exact(Q8_1_BYTES).zip(x.chunks_exact(Q8_1_BYTES)) {
        let sumi = dot_i8(&a[4..], &b[4..]);
        sumf += sumi as f32 * (rd_f16(a, 0) * rd_f16(b, 0));
    }
    sumf
}

pub(crate) fn vec_dot_q8_k_q8_k(_n: usize, w: &[u8], x: &[u8]) -> f32 {
    let mut sumf = 0f32;
    for (a, b) in w.chunks_exact(Q8_K_BYTES).zip(x.chunks_exact(Q8_K_BYTES)) {
        let sumi = dot_i8(&a[Q8_K_QS..Q8_K_QS + QK_K], &b[Q8_K_QS..Q8_K_QS + QK_K]);
        sumf += sumi as f32 * (rd_f32(a, 0) * rd_f32(b, 0));
    }
    sumf
}

/// The `d` (f32) of a `Q8_K` block.
#[inline(always)]
pub(crate) fn q8k_d(b: &[u8]) -> f32 {
    rd_f32(b, 0)
}

/// `bsums[g]` of a `Q8_K` block.
#[inline(always)]
pub(crate) fn q8k_bsum(b: &[u8], g: usize) -> i32 {
    i16::from_le_bytes([b[Q8_K_BSUMS + 2 * g], b[Q8_K_BSUMS + 2 * g + 1]]) as i32
}
