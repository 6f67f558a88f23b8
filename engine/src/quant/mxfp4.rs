//! `MXFP4` (OCP microscaling FP4, gpt-oss's expert format): dequantizer, reference quantizer,
//! and dot products with `Q8_0` activations in the float order llama.cpp's x86 CPU backend uses.
//!
//! # Layout (32 elements, 17 bytes per block)
//! | offset | size | field |
//! |--------|------|-------|
//! | 0 | 1  | `e`: E8M0 shared exponent |
//! | 1 | 16 | `qs`: nibbles; element `j < 16` is the low nibble of `qs[j]`, element `j + 16` its high nibble |
//!
//! A nibble `q` is an E2M1 value stored doubled as the integer `K[q]`,
//! `K = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]` (ggml's `kvalues_mxfp4`), and
//! the scale is `E(e) = 2^(e - 128)` (ggml's `GGML_E8M0_TO_FP32_HALF`, half of E8M0's
//! `2^(e - 127)`, which undoes the doubling; `e < 2` gives the subnormals `2^-128`, `2^-127`).
//! Element value: `K[q] · E(e)`.
//!
//! # Quantizer
//! ggml's `quantize_row_mxfp4_ref`: `e = floor(log2(amax)) - 2 + 127` (0 for an all-zero block),
//! each element the first index of the smallest `|K[i]·E(e) - x|`.
//!
//! # Dot product with `Q8_0` (`vec_dot_type`)
//! llama.cpp repacks every `MXFP4` matrix with a multiple of 8 rows on an AVX2 CPU
//! (`ggml_gemv_mxfp4_8x8_q8_0`), so the arithmetic reproduced is that GEMV's, per row:
//! ```text
//! acc = 0
//! for each block b:  isum = Σ_j K[q_j] · y_j    (i32, exact)
//!                    acc  = fma(f32(isum), E(e_b) · d_y(b), acc)
//! ```
//! Both kernels here (scalar and AVX2) compute exactly that (see the `avx2` module for how). Not
//! reproduced on x86: `ggml_vec_dot_mxfp4_q8_0` (the unrepacked path, for matrices whose row
//! count is not a multiple of 8), which sums two interleaved f32 vector accumulators. On aarch64
//! the `neon` level runs ggml's NEON `ggml_vec_dot_mxfp4_q8_0` instead (`quant::neon`): llama.cpp
//! repacks `MXFP4` there only when built with `dotprod`.

use super::q8::Q8_0_BYTES;
use super::{Kernel, rd_f16};

pub const QK: usize = 32;
pub const MXFP4_BYTES: usize = 17;

/// ggml's `kvalues_mxfp4`: the E2M1 values, doubled.
pub const KVALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// `GGML_E8M0_TO_FP32_HALF`: `2^(e - 128)`.
#[inline]
pub fn e8m0_half(e: u8) -> f32 {
    let bits = if e < 2 { 0x0020_0000u32 << e } else { u32::from(e - 1) << 23 };
    f32::from_bits(bits)
}

pub(crate) fn dequantize(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(MXFP4_BYTES).zip(dst.chunks_exact_mut(QK)) {
        let d = e8m0_half(b[0]);
        for j in 0..16 {
            y[j] = f32::from(KVALUES[usize::from(b[1 + j] & 0xf)]) * d;
            y[j + 16] = f32::from(KVALUES[usize::from(b[1 + j] >> 4)]) * d;
        }
    }
}

fn best_index(x: f32, e: f32) -> u8 {
    let mut best = 0;
    let mut best_err = (f32::from(KVALUES[0]) * e - x).abs();
    for (i, &k) in KVALUES.iter().enumerate().skip(1) {
        let err = (f32::from(k) * e - x).abs();
        if err < best_err {
            best = i as u8;
            best_err = err;
        }
    }
    best
}

pub(crate) fn quantize(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(MXFP4_BYTES)) {
        let amax = x.iter().fold(0f32, |m, &v| if m < v.abs() { v.abs() } else { m });
        let e = if amax > 0.0 { (amax.log2().floor() - 2.0 + 127.0) as u8 } else { 0 };
        let d = e8m0_half(e);
        b[0] = e;
        for j in 0..16 {
            b[1 + j] = best_index(x[j], d) | (best_index(x[j + 16], d) << 4);
        }
    }
}

/// The scalar dot product in the repacked GEMV's order (module docs).
pub(crate) fn vec_dot_q8_0(_n: usize, w: &[u8], x: &[u8]) -> f32 {
    let mut acc = 0f32;
    for (a, y) in w.chunks_exact(MXFP4_BYTES).zip(x.chunks_exact(Q8_0_BYTES)) {
        let mut isum = 0i32;
        for j in 0..16 {
            isum += i32::from(KVALUES[usize::from(a[1 + j] & 0xf)]) * i32::from(y[2 + j] as i8);
            isum += i32::from(KVALUES[usize::from(a[1 + j] >> 4)]) * i32::from(y[2 + 16 + j] as i8);
        }
        acc = (isum as f32).mul_add(e8m0_half(a[0]) * rd_f16(y, 0), acc);
    }
    acc
}

pub(crate) fn scalar_kernel() -> Kernel {
    fn mv(w: &[u8], row_bytes: usize, cols: usize, x: &[u8], out: &mut [f32]) {
        super::matvec_rows(vec_dot_q8_0, w, row_bytes, cols, x, out)
    }
    Kernel { vec_dot: vec_dot_q8_0, matvec: mv }
}

/// The AVX2 kernel (same bits as [`vec_dot_q8_0`]), when the CPU has AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
pub(crate) fn avx2_kernel() -> Option<Kernel> {
    fn dot(n: usize, w: &[u8], x: &[u8]) -> f32 {
        // SAFETY: handed out only after the features were detected (in `avx2_kernel`).
        unsafe { avx2::dot(n, w, x) }
    }
    fn mv(w: &[u8], row_bytes: usize, cols: usize, x: &[u8], out: &mut [f32]) {
        // SAFETY: as above.
        unsafe { avx2::matvec(w, row_bytes, cols, x, out) }
    }
    (is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c"))
        .then_some(Kernel { vec_dot: dot, matvec: mv })
}

/// The AVX2 kernels. Per block, the 32 weights are looked up from the nibbles (`vpshufb`) as
/// `K[q] + 12` (unsigned, 0..24), multiplied with the activation quants (`vpmaddubsw`,
/// `vpmaddwd`: 8 i32 lanes), and `12 · Σ y` (the activation block's sum, once per call) is
/// subtracted after the lanes are reduced: the same integer `Σ K[q]·y`. The lanes of eight blocks
/// (or of one block of eight rows) are reduced together. `matvec` runs eight rows at a time with
/// one f32 lane per row, so each lane is exactly the per-row FMA chain of the module docs
/// (llama.cpp's repacked GEMV has the same lane-per-row layout); `dot` reduces eight blocks of one
/// row and runs the chain in scalar code.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{KVALUES, MXFP4_BYTES, Q8_0_BYTES};

    /// The offset that makes the looked-up weights unsigned.
    const BIAS: i32 = 12;

    /// [`KVALUES`] + 12 in both 128-bit halves.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn table() -> __m256i {
        let mut tbl = [0u8; 32];
        for (i, t) in tbl.iter_mut().enumerate() {
            *t = (i32::from(KVALUES[i % 16]) + BIAS) as u8;
        }
        // SAFETY: 32 in-bounds bytes; `loadu` has no alignment requirement.
        unsafe { _mm256_loadu_si256(tbl.as_ptr().cast()) }
    }

    /// Shifts of the 64-bit lanes that move the high nibbles down in the upper half.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn nibble_shifts() -> __m256i {
        _mm256_setr_epi64x(0, 0, 4, 4)
    }

    /// 8 lanes of i32 partial sums of `(K[q] + 12) · y` for block `w` and the activation quants `yv`.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn block_lanes(w: &[u8; MXFP4_BYTES], yv: __m256i, table: __m256i, shifts: __m256i) -> __m256i {
        // SAFETY: bytes 1..17 of `w` are in bounds; unaligned load.
        let q = unsafe { _mm256_broadcastsi128_si256(_mm_loadu_si128(w.as_ptr().add(1).cast())) };
        let nib = _mm256_and_si256(_mm256_srlv_epi64(q, shifts), _mm256_set1_epi8(0x0f));
        let wv = _mm256_shuffle_epi8(table, nib);
        _mm256_madd_epi16(_mm256_maddubs_epi16(wv, yv), _mm256_set1_epi16(1))
    }

    /// The activation block's 32 quants and `12 · Σ y`.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn act(y: &[u8; Q8_0_BYTES]) -> (__m256i, i32) {
        // SAFETY: bytes 2..34 of `y` are in bounds; unaligned load.
        let yv = unsafe { _mm256_loadu_si256(y.as_ptr().add(2).cast()) };
        let sum: i32 = y[2..].iter().map(|&b| i32::from(b as i8)).sum();
        (yv, BIAS * sum)
    }

    /// The sums of the 8 lanes of each of 8 vectors, in order: `[Σv0, Σv1, …, Σv7]`.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn hsum8(v: &[__m256i; 8]) -> __m256i {
        let ab = _mm256_hadd_epi32(v[0], v[1]);
        let cd = _mm256_hadd_epi32(v[2], v[3]);
        let ef = _mm256_hadd_epi32(v[4], v[5]);
        let gh = _mm256_hadd_epi32(v[6], v[7]);
        // 128-bit halves: [Σlo(v0..3) | Σhi(v0..3)] and the same for v4..7.
        let abcd = _mm256_hadd_epi32(ab, cd);
        let efgh = _mm256_hadd_epi32(ef, gh);
        let lo = _mm256_permute2x128_si256::<0x20>(abcd, efgh);
        let hi = _mm256_permute2x128_si256::<0x31>(abcd, efgh);
        _mm256_add_epi32(lo, hi)
    }

    /// `GGML_E8M0_TO_FP32_HALF` of 8 exponents (i32 lanes).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn e8m0_half(e: __m256i) -> __m256 {
        let normal = _mm256_slli_epi32::<23>(_mm256_sub_epi32(e, _mm256_set1_epi32(1)));
        let sub = _mm256_sllv_epi32(_mm256_set1_epi32(0x0020_0000), e);
        let is_normal = _mm256_cmpgt_epi32(e, _mm256_set1_epi32(1));
        _mm256_castsi256_ps(_mm256_blendv_epi8(sub, normal, is_normal))
    }

    /// The f16 scale of an activation block, as f32.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    fn dy(y: &[u8; Q8_0_BYTES]) -> f32 {
        let h = u16::from_le_bytes([y[0], y[1]]);
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(h))))
    }

    /// # Safety
    /// The CPU must have AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot(_n: usize, w: &[u8], x: &[u8]) -> f32 {
        let (table, shifts) = (table(), nibble_shifts());
        let (wb, _) = w.as_chunks::<MXFP4_BYTES>();
        let (xb, _) = x.as_chunks::<Q8_0_BYTES>();
        let nb = wb.len().min(xb.len());
        let mut acc = 0f32;
        let mut sums = [0i32; 8];
        let mut i = 0;
        while i < nb {
            let m = (nb - i).min(8);
            let mut v = [_mm256_setzero_si256(); 8];
            let mut bias = [0i32; 8];
            for k in 0..m {
                let (yv, b) = act(&xb[i + k]);
                v[k] = block_lanes(&wb[i + k], yv, table, shifts);
                bias[k] = b;
            }
            // SAFETY: `sums` and `bias` hold 8 i32; unaligned loads and stores.
            unsafe {
                let isum = _mm256_sub_epi32(hsum8(&v), _mm256_loadu_si256(bias.as_ptr().cast()));
                _mm256_storeu_si256(sums.as_mut_ptr().cast(), isum);
            }
            for (k, &s) in sums.iter().enumerate().take(m) {
                acc = (s as f32).mul_add(super::e8m0_half(wb[i + k][0]) * dy(&xb[i + k]), acc);
            }
            i += m;
        }
        acc
    }

    /// Rows of `w` (stride `row_bytes`, `cols` elements) dotted with `x`: eight rows at a time,
    /// one f32 lane per row.
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn matvec(w: &[u8], row_bytes: usize, cols: usize, x: &[u8], out: &mut [f32]) {
        let (table, shifts) = (table(), nibble_shifts());
        let nb = cols / super::QK;
        let (xb, _) = x.as_chunks::<Q8_0_BYTES>();
        let xb = &xb[..nb];
        // Per activation block: the quants, the bias correction and the f16 scale.
        let acts: Vec<(__m256i, __m256i, __m256)> = xb
            .iter()
            .map(|y| {
                let (yv, b) = act(y);
                (yv, _mm256_set1_epi32(b), _mm256_set1_ps(dy(y)))
            })
            .collect();
        let mut r = 0;
        while r + 8 <= out.len() {
            let rows: [&[[u8; MXFP4_BYTES]]; 8] =
                std::array::from_fn(|k| w[(r + k) * row_bytes..(r + k + 1) * row_bytes].as_chunks().0);
            let mut acc = _mm256_setzero_ps();
            for (b, &(yv, bias, dyv)) in acts.iter().enumerate() {
                let v: [__m256i; 8] = std::array::from_fn(|k| block_lanes(&rows[k][b], yv, table, shifts));
                let isum = _mm256_sub_epi32(hsum8(&v), bias);
                let e = _mm256_setr_epi32(
                    i32::from(rows[0][b][0]),
                    i32::from(rows[1][b][0]),
                    i32::from(rows[2][b][0]),
                    i32::from(rows[3][b][0]),
                    i32::from(rows[4][b][0]),
                    i32::from(rows[5][b][0]),
                    i32::from(rows[6][b][0]),
                    i32::from(rows[7][b][0]),
                );
                let scale = _mm256_mul_ps(e8m0_half(e), dyv);
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, acc);
            }
            let o: &mut [f32; 8] = (&mut out[r..r + 8]).try_into().expect("8 outputs");
            // SAFETY: 8 in-bounds f32; `storeu` has no alignment requirement.
            unsafe { _mm256_storeu_ps(o.as_mut_ptr(), acc) };
            r += 8;
        }
        for (k, o) in out.iter_mut().enumerate().skip(r) {
            // SAFETY: the caller's contract.
            *o = unsafe { dot(cols, &w[k * row_bytes..(k + 1) * row_bytes], x) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_is_two_to_the_e_minus_128() {
        assert_eq!(e8m0_half(0), 2f32.powi(-128));
        assert_eq!(e8m0_half(1), 2f32.powi(-127));
        assert_eq!(e8m0_half(127), 0.5);
        assert_eq!(e8m0_half(128), 1.0);
        assert_eq!(e8m0_half(130), 4.0);
    }

    #[test]
    fn quantize_round_trips_representable_values_and_picks_the_nearest() {
        // A block of exact E2M1 multiples of 2^-1 (amax 6 -> e = 2 - 2 + 127 = 127, E = 0.5).
        let x: Vec<f32> = (0..32).map(|i| f32::from(KVALUES[i % 16]) * 0.5).collect();
        let mut b = [0u8; MXFP4_BYTES];
        quantize(&x, &mut b);
        assert_eq!(b[0], 127);
        let mut y = [0f32; 32];
        dequantize(&b, &mut y);
        assert_eq!(&y[..], &x[..]);
        // Every element lands on a nearest representable value.
        let x: Vec<f32> = (0..32).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        quantize(&x, &mut b);
        dequantize(&b, &mut y);
        let d = e8m0_half(b[0]);
        for (xi, yi) in x.iter().zip(&y) {
            let best = KVALUES.iter().map(|&k| (f32::from(k) * d - xi).abs()).fold(f32::INFINITY, f32::min);
            assert_eq!((yi - xi).abs(), best, "{xi} -> {yi}");
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_and_scalar_dots_agree_bit_for_bit() {
        let Some(k) = avx2_kernel() else { return };
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        let mut r = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        };
        for n in [32, 64, 256, 288, 2880] {
            let w: Vec<f32> = (0..n).map(|i| r() * (1.0 + (i % 7) as f32)).collect();
            let x: Vec<f32> = (0..n).map(|_| r()).collect();
            let mut wq = vec![0u8; n / QK * MXFP4_BYTES];
            quantize(&w, &mut wq);
            let mut xq = vec![0u8; n / QK * Q8_0_BYTES];
            crate::quant::quantize_row(crate::quant::GgmlType::Q8_0, &x, &mut xq).unwrap();
            let a = vec_dot_q8_0(n, &wq, &xq);
            let b = (k.vec_dot)(n, &wq, &xq);
            assert_eq!(a.to_bits(), b.to_bits(), "n = {n}: {a} vs {b}");
            // The 8-row matvec (11 rows: one group of 8 and 3 single rows) gives the same bits.
            let rb = n / QK * MXFP4_BYTES;
            let rows: Vec<u8> = (0..11)
                .flat_map(|i| {
                    let wi: Vec<f32> = w.iter().map(|&v| v * (1.0 + i as f32 * 0.3)).collect();
                    let mut q = vec![0u8; rb];
                    quantize(&wi, &mut q);
                    q
                })
                .collect();
            let mut got = vec![0f32; 11];
            (k.matvec)(&rows, rb, n, &xq, &mut got);
            for (i, g) in got.iter().enumerate() {
                let want = vec_dot_q8_0(n, &rows[i * rb..(i + 1) * rb], &xq);
                assert_eq!(g.to_bits(), want.to_bits(), "n = {n}, row {i}");
            }
            // And close to the f64 dot product of the dequantized values.
            let mut wd = vec![0f32; n];
            dequantize(&wq, &mut wd);
            let mut xd = vec![0f32; n];
            crate::quant::dequantize_row(crate::quant::GgmlType::Q8_0, &xq, &mut xd).unwrap();
            let want: f64 = wd.iter().zip(&xd).map(|(&p, &q)| f64::from(p) * f64::from(q)).sum();
            assert!((f64::from(a) - want).abs() <= 1e-4 * want.abs().max(1.0), "n = {n}: {a} vs {want}");
        }
    }
}
