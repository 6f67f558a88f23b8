//! K-quants: 256-element super-blocks with quantized sub-block scales.
//!
//! Notation: in a super-block, element `e` (0..256) is split as
//! `e = 128*h + 32*k + l` (`h` half, `k` 0..4, `l` 0..32) for the 2-bit-plane types
//! (`Q2_K`, `Q3_K`, `Q6_K`), and as `e = 64*c + 32*t + l` (`c` 0..4, `t` 0..2) for
//! the nibble types (`Q4_K`, `Q5_K`). All fields little-endian.
//!
//! # `Q2_K`: 84 bytes, 16 sub-blocks of 16
//! | offset | size | field |
//! |--------|------|-------|
//! | 0  | 16 | `scales[s]`: low nibble = scale, high nibble = min of sub-block `s = e/16` |
//! | 16 | 64 | `qs`: `q(e) = (qs[32h + l] >> 2k) & 3` |
//! | 80 | 2  | `d`: f16 |
//! | 82 | 2  | `dmin`: f16 |
//!
//! value `= (d * (scales[s] & 15)) * q - dmin * (scales[s] >> 4)`.
//!
//! # `Q3_K`: 110 bytes, 16 sub-blocks of 16
//! | offset | size | field |
//! |--------|------|-------|
//! | 0  | 32 | `hmask`: bit `4h + k` of `hmask[l]` = high bit of element `e` |
//! | 32 | 64 | `qs`: low 2 bits, `(qs[32h + l] >> 2k) & 3` |
//! | 96 | 12 | `scales`: 16 x 6-bit, biased by 32 (see below) |
//! | 108| 2  | `d`: f16 |
//!
//! `q = low2 - (high bit ? 0 : 4)` in -4..3; 6-bit scale of sub-block `s`:
//! low 4 bits = `s < 8 ? scales[s] & 15 : scales[s-8] >> 4`, high 2 bits =
//! `(scales[8 + s%4] >> 2*(s/4)) & 3`; value `= (d * (scale6 - 32)) * q`.
//!
//! # `Q4_K`: 144 bytes, 8 sub-blocks of 32
//! | offset | size | field |
//! |--------|------|-------|
//! | 0  | 2   | `d`: f16 |
//! | 2  | 2   | `dmin`: f16 |
//! | 4  | 12  | `scales`: 8 x (6-bit scale, 6-bit min), see below |
//! | 16 | 128 | `qs`: `q(e) = t == 0 ? qs[32c + l] & 15 : qs[32c + l] >> 4` |
//!
//! Sub-block `j = 2c + t`: for `j < 4` scale = `scales[j] & 63`, min =
//! `scales[j+4] & 63`; for `j >= 4` scale = `(scales[j+4] & 15) | (scales[j-4] >> 6) << 4`,
//! min = `(scales[j+4] >> 4) | (scales[j] >> 6) << 4`. value `= (d*scale) * q - dmin*min`.
//!
//! # `Q5_K`: 176 bytes, 8 sub-blocks of 32
//! | offset | size | field |
//! |--------|------|-------|
//! | 0  | 2   | `d`: f16 |
//! | 2  | 2   | `dmin`: f16 |
//! | 4  | 12  | `scales`: as `Q4_K` |
//! | 16 | 32  | `qh`: bit `j = 2c + t` of `qh[l]` = 5th bit of element `e` |
//! | 48 | 128 | `qs`: low nibbles as `Q4_K` |
//!
//! # `Q6_K`: 210 bytes, 16 sub-blocks of 16
//! | offset | size | field |
//! |--------|------|-------|
//! | 0   | 128 | `ql`: low nibble `= k&1 ? ql[64h+32+l] : ql[64h+l]`, taking `>> 4` when `k >= 2` |
//! | 128 | 64  | `qh`: high 2 bits `= (qh[32h + l] >> 2k) & 3` |
//! | 192 | 16  | `scales`: i8 per sub-block `s = e/16` |
//! | 208 | 2   | `d`: f16 |
//!
//! `q = (low | high << 4) - 32` in -32..31; value `= (d * scales[s]) * q`.
//!
//! # Dot products
//! All K-quants dot with `Q8_K` (see [`super::q8`]). Per super-block ggml forms
//! `isum = sum_s scale_s * sum_{e in s} q(e) * q8(e)` in `i32` and (for the types
//! with minimums) `summs = sum_s min_s * bsums`, then adds
//! `d_w*d_x * isum - dmin_w*d_x * summs` in `f32`. The scalar kernels below do the
//! same; `Q6_K` and `Q3_K` use signed quants directly (the AVX2 kernels use the
//! equivalent `bsums` correction for the bias).
//!
//! # Quantizers (weights)
//! Step-by-step ports of ggml's `quantize_row_q{2,3,4,5,6}_K_ref` (scale search of
//! `make_qkx2_quants` for `Q2_K`/`Q4_K`/`Q5_K`, `make_q3_quants` for `Q3_K`,
//! `make_qx_quants` for `Q6_K`, then quantized sub-block scales and requantized
//! elements), including ggml's comparison and rounding order. Not promised to be
//! byte-identical to ggml in every corner case, but it was on the data tried.

#![expect(
    clippy::needless_range_loop,
    reason = "index loops mirror the documented bit layouts (element e, sub-block s)"
)]

use super::float::f32_to_f16_bits;
use super::q8::{Q8_K_BYTES, Q8_K_QS, q8k_bsum, q8k_d};
use super::{QK_K, nearest_int, rd_f16, wr_u16};

pub const Q2_K_BYTES: usize = 84;
pub const Q3_K_BYTES: usize = 110;
pub const Q4_K_BYTES: usize = 144;
pub const Q5_K_BYTES: usize = 176;
pub const Q6_K_BYTES: usize = 210;

/// ggml's `GROUP_MAX_EPS`.
const GROUP_MAX_EPS: f32 = 1e-15;

// ---------------------------------------------------------------------------
// Field helpers
// ---------------------------------------------------------------------------

/// 6-bit (scale, min) of sub-block `j` of a `Q4_K`/`Q5_K` `scales` array.
#[inline(always)]
pub fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// The 16 signed 6-bit scales (already minus 32) of a `Q3_K` `scales` array.
#[inline(always)]
pub fn q3k_scales(s: &[u8]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for (j, o) in out.iter_mut().enumerate() {
        let lo = if j < 8 { s[j] & 0xf } else { s[j - 8] >> 4 };
        let hi = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        *o = (lo | (hi << 4)) as i8 - 32;
    }
    out
}

/// Unpacked quants of one super-block, as ggml's generic kernels build them.
#[inline(always)]
fn unpack_q2k(b: &[u8], q: &mut [i8; QK_K]) {
    let qs = &b[16..80];
    for h in 0..2 {
        for k in 0..4 {
            for l in 0..32 {
                q[128 * h + 32 * k + l] = ((qs[32 * h + l] >> (2 * k)) & 3) as i8;
            }
        }
    }
}

#[inline(always)]
fn unpack_q3k(b: &[u8], q: &mut [i8; QK_K]) {
    let hm = &b[0..32];
    let qs = &b[32..96];
    for h in 0..2 {
        for k in 0..4 {
            let bit = 4 * h + k;
            for l in 0..32 {
                let low = ((qs[32 * h + l] >> (2 * k)) & 3) as i8;
                let high = (hm[l] >> bit) & 1;
                q[128 * h + 32 * k + l] = low - if high != 0 { 0 } else { 4 };
            }
        }
    }
}

#[inline(always)]
fn unpack_q4k(b: &[u8], q: &mut [i8; QK_K]) {
    let qs = &b[16..144];
    for c in 0..4 {
        for l in 0..32 {
            let v = qs[32 * c + l];
            q[64 * c + l] = (v & 0xf) as i8;
            q[64 * c + 32 + l] = (v >> 4) as i8;
        }
    }
}

#[inline(always)]
fn unpack_q5k(b: &[u8], q: &mut [i8; QK_K]) {
    let qh = &b[16..48];
    let qs = &b[48..176];
    for c in 0..4 {
        for l in 0..32 {
            let v = qs[32 * c + l];
            let h = qh[l];
            q[64 * c + l] = ((v & 0xf) | (((h >> (2 * c)) & 1) << 4)) as i8;
            q[64 * c + 32 + l] = ((v >> 4) | (((h >> (2 * c + 1)) & 1) << 4)) as i8;
        }
    }
}

#[inline(always)]
fn unpack_q6k(b: &[u8], q: &mut [i8; QK_K]) {
    let ql = &b[0..128];
    let qh = &b[128..192];
    for h in 0..2 {
        for l in 0..32 {
            let lo0 = ql[64 * h + l];
            let lo1 = ql[64 * h + 32 + l];
            let hi = qh[32 * h + l];
            let e = 128 * h + l;
            q[e] = ((lo0 & 0xf) | ((hi & 3) << 4)) as i8 - 32;
            q[e + 32] = ((lo1 & 0xf) | (((hi >> 2) & 3) << 4)) as i8 - 32;
            q[e + 64] = ((lo0 >> 4) | (((hi >> 4) & 3) << 4)) as i8 - 32;
            q[e + 96] = ((lo1 >> 4) | (((hi >> 6) & 3) << 4)) as i8 - 32;
        }
    }
}

// ---------------------------------------------------------------------------
// Dequantization (same f32 operation order as ggml, so bit-identical to it)
// ---------------------------------------------------------------------------

pub(crate) fn dequantize_q2_k(src: &[u8], dst: &mut [f32]) {
    let mut q = [0i8; QK_K];
    for (b, y) in src.chunks_exact(Q2_K_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let d = rd_f16(b, 80);
        let dmin = rd_f16(b, 82);
        unpack_q2k(b, &mut q);
        for s in 0..16 {
            let sc = b[s];
            let dl = d * (sc & 0xf) as f32;
            let ml = dmin * (sc >> 4) as f32;
            for e in 16 * s..16 * s + 16 {
                y[e] = dl * q[e] as f32 - ml;
            }
        }
    }
}

pub(crate) fn dequantize_q3_k(src: &[u8], dst: &mut [f32]) {
    let mut q = [0i8; QK_K];
    for (b, y) in src.chunks_exact(Q3_K_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let d = rd_f16(b, 108);
        let sc = q3k_scales(&b[96..108]);
        unpack_q3k(b, &mut q);
        for s in 0..16 {
            let dl = d * sc[s] as f32;
            for e in 16 * s..16 * s + 16 {
                y[e] = dl * q[e] as f32;
            }
        }
    }
}

pub(crate) fn dequantize_q4_k(src: &[u8], dst: &mut [f32]) {
    let mut q = [0i8; QK_K];
    for (b, y) in src.chunks_exact(Q4_K_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let d = rd_f16(b, 0);
        let dmin = rd_f16(b, 2);
        unpack_q4k(b, &mut q);
        for j in 0..8 {
            let (sc, m) = scale_min_k4(j, &b[4..16]);
            let d1 = d * sc as f32;
            let m1 = dmin * m as f32;
            for e in 32 * j..32 * j + 32 {
                y[e] = d1 * q[e] as f32 - m1;
            }
        }
    }
}

pub(crate) fn dequantize_q5_k(src: &[u8], dst: &mut [f32]) {
    let mut q = [0i8; QK_K];
    for (b, y) in src.chunks_exact(Q5_K_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let d = rd_f16(b, 0);
        let dmin = rd_f16(b, 2);
        unpack_q5k(b, &mut q);
        for j in 0..8 {
            let (sc, m) = scale_min_k4(j, &b[4..16]);
            let d1 = d * sc as f32;
            let m1 = dmin * m as f32;
            for e in 32 * j..32 * j + 32 {
                y[e] = d1 * q[e] as f32 - m1;
            }
        }
    }
}

pub(crate) fn dequantize_q6_k(src: &[u8], dst: &mut [f32]) {
    let mut q = [0i8; QK_K];
    for (b, y) in src.chunks_exact(Q6_K_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let d = rd_f16(b, 208);
        unpack_q6k(b, &mut q);
        for s in 0..16 {
            let ds = d * (b[192 + s] as i8) as f32;
            for e in 16 * s..16 * s + 16 {
                y[e] = ds * q[e] as f32;
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Scalar dot products with Q8_K
// ---------------------------------------------------------------------------

#[inline(always)]
fn q8k_qs(b: &[u8]) -> &[u8] {
    &b[Q8_K_QS..Q8_K_QS + QK_K]
}

/// Integer dot products of the 16 groups of 16 elements.
#[inline(always)]
fn group_dots16(q: &[i8; QK_K], y: &[u8]) -> [i32; 16] {
    let mut out = [0i32; 16];
    for (g, o) in out.iter_mut().enumerate() {
        let mut s = 0i32;
        for e in 16 * g..16 * g + 16 {
            s += q[e] as i32 * (y[e] as i8 as i32);
        }
        *o = s;
    }
    out
}

pub(crate) fn vec_dot_q2_k_q8_k(_n: usize, w: &[u8], x: &[u8]) -> f32 {
    let mut q = [0i8; QK_K];
    let mut sumf = 0f32;
    for (a, b) in w.chunks_exact(Q2_K_BYTES).zip(x.chunks_exact(Q8_K_BYTES)) {
        unpack_q2k(a, &mut q);
        let dots = group_dots16(&q, q8k_qs(b));
        let mut isum = 0i32;
        let mut summs = 0i32;
        for s in 0..16 {
            isum += (a[s] & 0xf) as i32 * dots[s];
            summs += (a[s] >> 4) as i32 * q8k_bsum(b, s);
        }
        let yd = q8k_d(b);
        let dall = yd * rd_f16(a, 80);
        let dmin = yd * rd_f16(a, 82);
        sumf += dall * isum as f32 - dmin * summs as f32;
    }
    sumf
}

pub(crate) fn vec_dot_q3_k_q8_k(_n: usize, w: &[u8], x: &[u8]) -> f32 {
    let mut q = [0i8; QK_K];
    let mut sumf = 0f32;
    for (a, b) in w.chunks_exact(Q3_K_BYTES).zip(x.chunks_exact(Q8_K_BYTES)) {
        unpack_q3k(a, &mut q);
        let sc = q3k_scales(&a[96..108]);
        let dots = group_dots16(&q, q8k_qs(b));
        let isum: i32 = (0..16).map(|s| sc[s] as i32 * dots[s]).sum();
        sumf += (rd_f16(a, 108) * q8k_d(b)) * isum as f32;
    }
    sumf
}

fn vec_dot_q45k(w: &[u8], x: &[u8], bytes: usize, unpack: fn(&[u8], &mut [i8; QK_K])) -> f32 {
    let mut q = [0i8; QK_K];
    let mut sumf = 0f32;
    for (a, b) in w.chunks_exact(bytes).zip(x.chunks_exact(Q8_K_BYTES)) {
        unpack(a, &mut q);
        let dots = group_dots16(&q, q8k_qs(b));
        let mut isum = 0i32;
        let mut summs = 0i32;
        for j in 0..8 {
            let (sc, m) = scale_min_k4(j, &a[4..16]);
            isum += sc as i32 * (dots[2 * j] + dots[2 * j + 1]);
            summs += m as i32 * (q8k_bsum(b, 2 * j) + q8k_bsum(b, 2 * j + 1));
        }
        let yd = q8k_d(b);
        let d = rd_f16(a, 0) * yd;
        let dmin = rd_f16(a, 2) * yd;
        sumf += d * isum as f32 - dmin * summs as f32;
    }
    sumf
}

pub(crate) fn vec_dot_q4_k_q8_k(_n: usize, w: &[u8], x: &[u8]) -> f32 {
    vec_dot_q45k(w, x, Q4_K_BYTES, unpack_q4k)
}

pub(crate) fn vec_dot_q5_k_q8_k(_n: usize, w: &[u8], x: &[u8]) -> f32 {
    vec_dot_q45k(w, x, Q5_K_BYTES, unpack_q5k)
}

pub(crate) fn vec_dot_q6_k_q8_k(_n: usize, w: &[u8], x: &[u8]) -> f32 {
    let mut q = [0i8; QK_K];
    let mut sumf = 0f32;
    for (a, b) in w.chunks_exact(Q6_K_BYTES).zip(x.chunks_exact(Q8_K_BYTES)) {
        unpack_q6k(a, &mut q);
        let dots = group_dots16(&q, q8k_qs(b));
        let isum: i32 = (0..16).map(|s| (a[192 + s] as i8) as i32 * dots[s]).sum();
        sumf += (rd_f16(a, 208) * q8k_d(b)) * isum as f32;
    }
    sumf
}

// ---------------------------------------------------------------------------
// Quantization (weights)
// ---------------------------------------------------------------------------

/// Asymmetric quantization of `x` to `0..=nmax` as `x ~ scale * L - min`,
/// minimizing the weighted error over a small grid of inverse scales (the
/// algorithm of ggml's `make_qkx2_quants`). Returns `(scale, min)` with `min >= 0`.
fn search_scale_min(
    x: &[f32],
    weights: &[f32],
    nmax: i32,
    l_out: &mut [u8],
    (rmin, rdelta, nstep): (f32, f32, i32),
    use_mad: bool,
) -> (f32, f32) {
    let n = x.len();
    let mut lo = x[0];
    let mut hi = x[0];
    let mut sum_w = 0f32;
    let mut sum_x = 0f32;
    for (&v, &w) in x.iter().zip(weights) {
        lo = lo.min(v);
        hi = hi.max(v);
        sum_w += w;
        sum_x += w * v;
    }
    lo = lo.min(0.0);
    if hi == lo {
        l_out.fill(0);
        return (0.0, -lo);
    }
    let err = |d: f32| if use_mad { d.abs() } else { d * d };
    let mut iscale = nmax as f32 / (hi - lo);
    let mut scale = 1.0 / iscale;
    let mut min = lo;
    let mut best = 0f32;
    for i in 0..n {
        let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        l_out[i] = l as u8;
        best += weights[i] * err(scale * l as f32 + min - x[i]);
    }
    let mut laux = [0u8; 32];
    for is in 0..=nstep {
        // Like ggml, later candidates are centred on the best `min` found so far.
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (hi - min);
        let (mut sl, mut sl2, mut sxl) = (0f32, 0f32, 0f32);
        for i in 0..n {
            let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            laux[i] = l as u8;
            let (w, lf) = (weights[i], l as f32);
            sl += w * lf;
            sl2 += w * lf * lf;
            sxl += w * lf * x[i];
        }
        let det = sum_w * sl2 - sl * sl;
        if det > 0.0 {
            let mut this_scale = (sum_w * sxl - sum_x * sl) / det;
            let mut this_min = (sl2 * sum_x - sl * sxl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sxl / sl2;
            }
            let cur: f32 = (0..n).map(|i| weights[i] * err(this_scale * laux[i] as f32 + this_min - x[i])).sum();
            if cur < best {
                l_out[..n].copy_from_slice(&laux[..n]);
                best = cur;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// Symmetric quantization of `x` to `-nmax..nmax-1` weighted by `x^2`, trying
/// inverse scales around `nmax / max` (ggml's `make_qx_quants`, `rmse_type = 1`).
/// Returns the scale (negative when the largest-magnitude value is positive) and
/// writes the best quants, biased by `nmax`, to `l_out`.
fn search_scale_sym(x: &[f32], nmax: i32, l_out: &mut [u8]) -> f32 {
    let mut max = 0f32;
    let mut amax = 0f32;
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        l_out.fill(0);
        return 0.0;
    }
    let quant = |iscale: f32, v: f32| nearest_int(iscale * v).clamp(-nmax, nmax - 1);
    let fit = |iscale: f32| {
        let (mut sumlx, mut suml2) = (0f32, 0f32);
        for &v in x {
            let l = quant(iscale, v) as f32;
            let w = v * v;
            sumlx += w * v * l;
            suml2 += w * l * l;
        }
        (sumlx, suml2)
    };
    let store = |iscale: f32, l_out: &mut [u8]| {
        for (o, &v) in l_out.iter_mut().zip(x) {
            *o = (quant(iscale, v) + nmax) as u8;
        }
    };
    let iscale0 = -(nmax as f32) / max;
    let (sumlx, suml2) = fit(iscale0);
    store(iscale0, l_out);
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        let iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        let (sumlx, suml2) = fit(iscale);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            store(iscale, l_out);
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// Symmetric 3-bit search with greedy per-element refinement (ggml's
/// `make_q3_quants` with `do_rmse`). Returns the scale and writes the quants,
/// biased by `nmax`, to `l_out`.
fn search_scale_q3(x: &[f32], nmax: i32, l_out: &mut [u8]) -> f32 {
    let mut max = 0f32;
    let mut amax = 0f32;
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        l_out.fill(0);
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let mut l = [0i32; 16];
    let (mut sumlx, mut suml2) = (0f32, 0f32);
    for (li, &v) in l.iter_mut().zip(x) {
        *li = nearest_int(iscale * v).clamp(-nmax, nmax - 1);
        let w = v * v;
        sumlx += w * v * *li as f32;
        suml2 += w * (*li * *li) as f32;
    }
    for _ in 0..5 {
        let mut changed = false;
        for (li, &v) in l.iter_mut().zip(x) {
            let w = v * v;
            let slx = sumlx - w * v * *li as f32;
            if slx > 0.0 {
                let sl2 = suml2 - w * (*li * *li) as f32;
                let new_l = nearest_int(v * sl2 / slx).clamp(-nmax, nmax - 1);
                if new_l != *li {
                    let slx2 = slx + w * v * new_l as f32;
                    let sl22 = sl2 + w * (new_l * new_l) as f32;
                    if sl22 > 0.0 && slx2 * slx2 * suml2 > sumlx * sumlx * sl22 {
                        *li = new_l;
                        sumlx = slx2;
                        suml2 = sl22;
                        changed = true;
                    }
                }
            }
        }
        if !changed {
            break;
        }
    }
    for (o, li) in l_out.iter_mut().zip(&l) {
        *o = (li + nmax) as u8;
    }
    if suml2 > 0.0 { sumlx / suml2 } else { 0.0 }
}

/// Packs 8 (scale, min) 6-bit pairs into the 12-byte `Q4_K`/`Q5_K` layout.
fn pack_scale_min_k4(ls: &[u8; 8], lm: &[u8; 8], out: &mut [u8]) {
    out[..12].fill(0);
    for j in 0..8 {
        if j < 4 {
            out[j] = ls[j];
            out[j + 4] = lm[j];
        } else {
            out[j + 4] = (ls[j] & 0xf) | ((lm[j] & 0xf) << 4);
            out[j - 4] |= (ls[j] >> 4) << 6;
            out[j] |= (lm[j] >> 4) << 6;
        }
    }
}

/// Shared by `Q4_K` (`nmax = 15`) and `Q5_K` (`nmax = 31`): returns the 256
/// quants and writes `d`, `dmin`, `scales` (bytes 0..16 of the block).
fn quantize_q45k_block(x: &[f32], nmax: i32, grid: (f32, f32, i32), b: &mut [u8], l: &mut [u8; QK_K]) {
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    let mut weights = [0f32; 32];
    for j in 0..8 {
        let xs = &x[32 * j..32 * j + 32];
        let av_x = (xs.iter().map(|v| v * v).sum::<f32>() / 32.0).sqrt();
        for (w, v) in weights.iter_mut().zip(xs) {
            *w = av_x + v.abs();
        }
        (scales[j], mins[j]) = search_scale_min(xs, &weights, nmax, &mut l[32 * j..32 * j + 32], grid, false);
    }
    let max_scale = scales.iter().fold(0f32, |a, &b| if b > a { b } else { a });
    let max_min = mins.iter().fold(0f32, |a, &b| if b > a { b } else { a });
    let inv_scale = if max_scale > 0.0 { 63.0 / max_scale } else { 0.0 };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut ls = [0u8; 8];
    let mut lm = [0u8; 8];
    for j in 0..8 {
        ls[j] = nearest_int(inv_scale * scales[j]).clamp(0, 63) as u8;
        lm[j] = nearest_int(inv_min * mins[j]).clamp(0, 63) as u8;
    }
    let dh = f32_to_f16_bits(max_scale / 63.0);
    let mh = f32_to_f16_bits(max_min / 63.0);
    wr_u16(b, 0, dh);
    wr_u16(b, 2, mh);
    pack_scale_min_k4(&ls, &lm, &mut b[4..16]);
    let d = rd_f16(b, 0);
    let dmin = rd_f16(b, 2);
    for j in 0..8 {
        let (sc, m) = scale_min_k4(j, &b[4..16]);
        let dj = d * sc as f32;
        if dj == 0.0 {
            continue;
        }
        let dm = dmin * m as f32;
        for e in 32 * j..32 * j + 32 {
            l[e] = nearest_int((x[e] + dm) / dj).clamp(0, nmax) as u8;
        }
    }
}

pub(crate) fn quantize_q4_k(src: &[f32], dst: &mut [u8]) {
    let mut l = [0u8; QK_K];
    for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(Q4_K_BYTES)) {
        quantize_q45k_block(x, 15, (-1.0, 0.1, 20), b, &mut l);
        for c in 0..4 {
            for i in 0..32 {
                b[16 + 32 * c + i] = l[64 * c + i] | (l[64 * c + 32 + i] << 4);
            }
        }
    }
}

pub(crate) fn quantize_q5_k(src: &[f32], dst: &mut [u8]) {
    let mut l = [0u8; QK_K];
    for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(Q5_K_BYTES)) {
        quantize_q45k_block(x, 31, (-0.5, 0.1, 15), b, &mut l);
        b[16..48].fill(0);
        for c in 0..4 {
            for i in 0..32 {
                let l0 = l[64 * c + i];
                let l1 = l[64 * c + 32 + i];
                b[16 + i] |= ((l0 >> 4) << (2 * c)) | ((l1 >> 4) << (2 * c + 1));
                b[48 + 32 * c + i] = (l0 & 0xf) | ((l1 & 0xf) << 4);
            }
        }
    }
}

/// Packs 256 2-bit values as `qs[32h + l] |= q(128h + 32k + l) << 2k`.
fn pack_2bit_planes(l: &[u8; QK_K], qs: &mut [u8]) {
    for h in 0..2 {
        for i in 0..32 {
            let e = 128 * h + i;
            qs[32 * h + i] = (l[e] & 3) | ((l[e + 32] & 3) << 2) | ((l[e + 64] & 3) << 4) | ((l[e + 96] & 3) << 6);
        }
    }
}

pub(crate) fn quantize_q2_k(src: &[f32], dst: &mut [u8]) {
    let mut l = [0u8; QK_K];
    let mut weights = [0f32; 16];
    for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(Q2_K_BYTES)) {
        let mut scales = [0f32; 16];
        let mut mins = [0f32; 16];
        for j in 0..16 {
            let xs = &x[16 * j..16 * j + 16];
            for (w, v) in weights.iter_mut().zip(xs) {
                *w = v.abs();
            }
            (scales[j], mins[j]) =
                search_scale_min(xs, &weights, 3, &mut l[16 * j..16 * j + 16], (-0.5, 0.1, 15), true);
        }
        let max_scale = scales.iter().fold(0f32, |a, &b| if b > a { b } else { a });
        let max_min = mins.iter().fold(0f32, |a, &b| if b > a { b } else { a });
        b[..16].fill(0);
        if max_scale > 0.0 {
            let iscale = 15.0 / max_scale;
            for j in 0..16 {
                b[j] = nearest_int(iscale * scales[j]).clamp(0, 15) as u8;
            }
            wr_u16(b, 80, f32_to_f16_bits(max_scale / 15.0));
        } else {
            wr_u16(b, 80, 0);
        }
        if max_min > 0.0 {
            let iscale = 15.0 / max_min;
            for j in 0..16 {
                b[j] |= (nearest_int(iscale * mins[j]).clamp(0, 15) as u8) << 4;
            }
            wr_u16(b, 82, f32_to_f16_bits(max_min / 15.0));
        } else {
            wr_u16(b, 82, 0);
        }
        let d = rd_f16(b, 80);
        let dmin = rd_f16(b, 82);
        for j in 0..16 {
            let dj = d * (b[j] & 0xf) as f32;
            if dj == 0.0 {
                continue;
            }
            let dm = dmin * (b[j] >> 4) as f32;
            for e in 16 * j..16 * j + 16 {
                l[e] = nearest_int((x[e] + dm) / dj).clamp(0, 3) as u8;
            }
        }
        pack_2bit_planes(&l, &mut b[16..80]);
    }
}

pub(crate) fn quantize_q3_k(src: &[f32], dst: &mut [u8]) {
    let mut l = [0u8; QK_K];
    for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(Q3_K_BYTES)) {
        let mut scales = [0f32; 16];
        let mut max_scale = 0f32;
        let mut amax = 0f32;
        for j in 0..16 {
            scales[j] = search_scale_q3(&x[16 * j..16 * j + 16], 4, &mut l[16 * j..16 * j + 16]);
            if scales[j].abs() > amax {
                amax = scales[j].abs();
                max_scale = scales[j];
            }
        }
        b[96..108].fill(0);
        if max_scale != 0.0 {
            let iscale = -32.0 / max_scale;
            for j in 0..16 {
                let v = (nearest_int(iscale * scales[j]).clamp(-32, 31) + 32) as u8;
                if j < 8 {
                    b[96 + j] = v & 0xf;
                } else {
                    b[96 + j - 8] |= (v & 0xf) << 4;
                }
                b[96 + 8 + j % 4] |= (v >> 4) << (2 * (j / 4));
            }
            wr_u16(b, 108, f32_to_f16_bits(1.0 / iscale));
        } else {
            wr_u16(b, 108, 0);
        }
        let d = rd_f16(b, 108);
        let sc = q3k_scales(&b[96..108]);
        for j in 0..16 {
            let dj = d * sc[j] as f32;
            if dj == 0.0 {
                continue; // keep the search's quants, as ggml does
            }
            for e in 16 * j..16 * j + 16 {
                l[e] = (nearest_int(x[e] / dj).clamp(-4, 3) + 4) as u8;
            }
        }
        b[..32].fill(0);
        for h in 0..2 {
            for k in 0..4 {
                for i in 0..32 {
                    let e = 128 * h + 32 * k + i;
                    if l[e] > 3 {
                        b[i] |= 1 << (4 * h + k);
                        l[e] -= 4;
                    }
                }
            }
        }
        pack_2bit_planes(&l, &mut b[32..96]);
    }
}

pub(crate) fn quantize_q6_k(src: &[f32], dst: &mut [u8]) {
    let mut l = [0u8; QK_K];
    for (x, b) in src.chunks_exact(QK_K).zip(dst.chunks_exact_mut(Q6_K_BYTES)) {
        let mut scales = [0f32; 16];
        let mut max_scale = 0f32;
        let mut amax = 0f32;
        for j in 0..16 {
            scales[j] = search_scale_sym(&x[16 * j..16 * j + 16], 32, &mut l[16 * j..16 * j + 16]);
            if scales[j].abs() > amax {
                amax = scales[j].abs();
                max_scale = scales[j];
            }
        }
        if amax < GROUP_MAX_EPS {
            b.fill(0);
            continue;
        }
        let iscale = -128.0 / max_scale;
        wr_u16(b, 208, f32_to_f16_bits(1.0 / iscale));
        for j in 0..16 {
            b[192 + j] = nearest_int(iscale * scales[j]).clamp(-128, 127) as i8 as u8;
        }
        let d = rd_f16(b, 208);
        for j in 0..16 {
            let dj = d * (b[192 + j] as i8) as f32;
            if dj == 0.0 {
                continue; // keep the search's quants, as ggml does
            }
            for e in 16 * j..16 * j + 16 {
                l[e] = (nearest_int(x[e] / dj).clamp(-32, 31) + 32) as u8;
            }
        }
        for h in 0..2 {
            for i in 0..32 {
                let e = 128 * h + i;
                let (q1, q2, q3, q4) = (l[e], l[e + 32], l[e + 64], l[e + 96]);
                b[64 * h + i] = (q1 & 0xf) | ((q3 & 0xf) << 4);
                b[64 * h + 32 + i] = (q2 & 0xf) | ((q4 & 0xf) << 4);
                b[128 + 32 * h + i] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6);
            }
        }
    }
}
