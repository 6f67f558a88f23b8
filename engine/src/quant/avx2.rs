//! x86_64 AVX2 + FMA + F16C kernels: the kernel set of the `avx2` ISA level, and the
//! `avx512` level's kernels for the types it has none of its own for.
//!
//! Same integer arithmetic as the scalar kernels (and ggml): quants are multiplied
//! with `vpmaddubsw` (unsigned weight quants x signed activation quants, no
//! saturation possible for the value ranges involved), widened with `vpmaddwd`
//! against the sub-block scales, accumulated in `i32` per super-block, then scaled
//! by `d_w * d_x` with one FMA. `Q6_K`'s signed quants are made unsigned by adding their
//! bias (32), which is removed through the activation's `bsums`; `Q3_K` subtracts the
//! products of its `4 * !hbit` part as ggml does. Either gives ggml's integers.
//!
//! The float arithmetic of the `Q8_0`, `Q2_K`..`Q6_K`, `F32`, `F16` and `BF16` kernels is that
//! of the kernel an AVX2 llama.cpp build runs (see the module docs of `quant` and each kernel;
//! `dot_q2_k_repacked` is the `avx512` level's `Q2_K`): where that needs an i32 lane layout
//! (the 8 FMA lanes of `Q8_0`, `Q2_K`, `Q3_K`, `Q5_K`, `Q6_K`), each sub-block scale gets its
//! own `vpmaddwd` as in ggml; `Q4_K` only needs whole-block integers, so its kernel
//! interleaves the i16 products of two sub-blocks (`vpunpck{l,h}wd` + `vpaddw`,
//! the ranges leave room), applies both scales with one `vpmaddwd`, decodes the
//! scales of two blocks per step and precomputes the activation's per-sub-block
//! sums once per `matvec`. The `Q4_0` loop scales four blocks with one FMA (not ggml's
//! order). The kernels whose compute is closest to the memory bandwidth prefetch 4 KiB ahead.
//!
//! `Q8_0`/`Q8_K` x `Q8_0`/`Q8_K` (and `Q4_0`) use ggml's sign trick
//! (`|w| * sign(w) x`); like ggml's, it assumes activation quants are never
//! -128, which ggml's and this module's quantizers never produce.
//!
//! Every kernel here is a safe `#[target_feature]` function; the only `unsafe`
//! is in the loads (bounds asserted) and in the wrappers handed out by
//! [`kernel`], which exist only after [`available`] confirmed the features.

use std::arch::x86_64::*;

use super::kquants::{Q2_K_BYTES, Q3_K_BYTES, Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES};
use super::legacy::Q4_0_BYTES;
use super::q8::{Q8_0_BYTES, Q8_K_BYTES};
use super::{GgmlType, Kernel, QuantizeFn};

/// Whether the CPU has everything these kernels use (cached by std).
pub(super) fn available() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
}

// ---------------------------------------------------------------------------
// Loads and small helpers
// ---------------------------------------------------------------------------

#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn ld256<const N: usize>(b: &[u8; N], off: usize) -> __m256i {
    assert!(off + 32 <= N);
    // SAFETY: `off + 32 <= N` was just checked; `loadu` has no alignment requirement.
    unsafe { _mm256_loadu_si256(b.as_ptr().add(off).cast()) }
}

#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn ld128<const N: usize>(b: &[u8; N], off: usize) -> __m128i {
    assert!(off + 16 <= N);
    // SAFETY: `off + 16 <= N` was just checked; `loadu` has no alignment requirement.
    unsafe { _mm_loadu_si128(b.as_ptr().add(off).cast()) }
}

#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn ld_u32<const N: usize>(b: &[u8; N], off: usize) -> u32 {
    u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

/// One f16 at `off`, converted with F16C.
#[inline]
#[target_feature(enable = "avx2,f16c")]
pub(super) fn f16_at<const N: usize>(b: &[u8; N], off: usize) -> f32 {
    let h = u16::from_le_bytes([b[off], b[off + 1]]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
}

/// Two consecutive f16 at `off` (e.g. `d`, `dmin`).
#[inline]
#[target_feature(enable = "avx2,f16c")]
pub(super) fn f16x2_at<const N: usize>(b: &[u8; N], off: usize) -> (f32, f32) {
    let v = _mm_cvtph_ps(_mm_cvtsi32_si128(ld_u32(b, off) as i32));
    (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v)))
}

#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn f32_at<const N: usize>(b: &[u8; N], off: usize) -> f32 {
    f32::from_bits(ld_u32(b, off))
}

#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn hsum_ps(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// How far ahead of the current weight block the compute-heavier kernels (Q2_K,
/// Q3_K, Q4_K, Q5_K, Q4_0) prefetch. Rows are streamed once from DRAM; on the
/// development machine (2-core AMD EPYC) 3-6 KiB ahead gained ~10% over the
/// hardware prefetchers alone for these, while the fast Q6_K and Q8_0 kernels
/// did as well or better without.
const PREFETCH_DISTANCE: usize = 4096;

/// Prefetches the `N`-byte block [`PREFETCH_DISTANCE`] after block `a`.
#[inline]
#[target_feature(enable = "avx2")]
fn prefetch_block<const N: usize>(a: &[u8; N]) {
    prefetch_ahead::<N>(a.as_ptr());
}

/// Prefetches the `N` bytes that lie [`PREFETCH_DISTANCE`] after `p`, one hint per
/// 64-byte line (consecutive blocks are contiguous, so every line is covered).
#[inline]
#[target_feature(enable = "avx2")]
fn prefetch_ahead<const N: usize>(p: *const u8) {
    // Prefetching is only a hint and never faults: addresses past the end of the
    // matrix are harmless, so `wrapping_add` without bounds is fine.
    let p = p.wrapping_add(PREFETCH_DISTANCE).cast::<i8>();
    let mut off = 0;
    while off < N {
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(off));
        off += 64;
    }
}

/// Signed i8 x i8 products summed in groups of four, as 8 x i32
/// (requires `y != -128` wherever `x < 0`).
#[inline]
#[target_feature(enable = "avx2")]
fn dot_i8_i32(x: __m256i, y: __m256i) -> __m256i {
    let ax = _mm256_sign_epi8(x, x);
    let sy = _mm256_sign_epi8(y, x);
    _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), _mm256_set1_epi16(1))
}

// ---------------------------------------------------------------------------
// Q8_0 x Q8_0 and Q8_K x Q8_K
// ---------------------------------------------------------------------------

/// Lane sums of four 8 x i32 vectors: `[s0 s1 s2 s3 | t0 t1 t2 t3]` with
/// `s_i + t_i = sum(v_i)`.
#[inline]
#[target_feature(enable = "avx2")]
fn hsum4_i32(v: [__m256i; 4]) -> __m256i {
    _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]))
}

/// The f16 at offset 0 of four consecutive `N`-byte blocks, as f32.
#[inline]
#[target_feature(enable = "avx2,f16c")]
pub(super) fn f16_of_4<const N: usize>(b: &[[u8; N]]) -> __m128 {
    let h = |i: usize| u16::from_le_bytes([b[i][0], b[i][1]]) as i16;
    _mm_cvtph_ps(_mm_setr_epi16(h(0), h(1), h(2), h(3), 0, 0, 0, 0))
}

/// Dot product for 32-element blocks with an f16 scale at offset 0 against
/// `Q8_0`: `$int(a, b)` gives a block's integer products as 8 x i32 lanes;
/// four blocks are reduced together and scaled with one FMA.
macro_rules! q8_0_style_dot {
    ($name:ident, $bytes:expr, $int:ident, prefetch: $pf:expr) => {
        #[target_feature(enable = "avx2,fma,f16c")]
        fn $name(w: &[u8], x: &[u8]) -> f32 {
            let (wb, _) = w.as_chunks::<{ $bytes }>();
            let (xb, _) = x.as_chunks::<Q8_0_BYTES>();
            let mut acc = _mm256_setzero_ps();
            let mut wq = wb.chunks_exact(4);
            let mut xq = xb.chunks_exact(4);
            for (a, b) in (&mut wq).zip(&mut xq) {
                if $pf {
                    prefetch_ahead::<{ 4 * $bytes }>(a[0].as_ptr());
                }
                let sums = hsum4_i32([$int(&a[0], &b[0]), $int(&a[1], &b[1]), $int(&a[2], &b[2]), $int(&a[3], &b[3])]);
                let d = _mm_mul_ps(f16_of_4(a), f16_of_4(b));
                acc = _mm256_fmadd_ps(_mm256_set_m128(d, d), _mm256_cvtepi32_ps(sums), acc);
            }
            let mut sum = hsum_ps(acc);
            for (a, b) in wq.remainder().iter().zip(xq.remainder()) {
                let p = _mm256_cvtepi32_ps($int(a, b));
                sum += hsum_ps(p) * (f16_at(a, 0) * f16_at(b, 0));
            }
            sum
        }
    };
}

#[inline]
#[target_feature(enable = "avx2")]
fn int_q8_0(a: &[u8; Q8_0_BYTES], b: &[u8; Q8_0_BYTES]) -> __m256i {
    dot_i8_i32(ld256(a, 2), ld256(b, 2))
}

/// `Q4_0` quants `q - 8` as 32 signed bytes (element `j` low nibble of
/// `qs[j]`, element `j + 16` the high nibble).
#[inline]
#[target_feature(enable = "avx2")]
fn int_q4_0(a: &[u8; Q4_0_BYTES], b: &[u8; Q8_0_BYTES]) -> __m256i {
    let q = ld128(a, 2);
    let m4 = _mm_set1_epi8(0xf);
    let lo = _mm_and_si128(q, m4);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(q), m4);
    let w = _mm256_sub_epi8(_mm256_set_m128i(hi, lo), _mm256_set1_epi8(8));
    dot_i8_i32(w, ld256(b, 2))
}

q8_0_style_dot!(dot_q4_0, Q4_0_BYTES, int_q4_0, prefetch: true);

/// `Q8_0 x Q8_0` in ggml's x86 order (`ggml_vec_dot_q8_0_q8_0`, AVX2 path): per
/// block, the 8 lanes of 4-product integer sums are converted to `f32` and
/// accumulated with one FMA by `d_w * d_x`; one horizontal sum at the end.
/// `dx(i)` gives blocks `4i..4i+4`'s activation scales as f32; the weight
/// scales of four blocks are converted together.
// Prefetching measured neutral to harmful for the fast Q8_0 kernel.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_q8_0_dx(w: &[u8], x: &[u8], dx: impl Fn(usize) -> __m128) -> f32 {
    let (wb, _) = w.as_chunks::<Q8_0_BYTES>();
    let (xb, _) = x.as_chunks::<Q8_0_BYTES>();
    let mut acc = _mm256_setzero_ps();
    let mut w4 = wb.chunks_exact(4);
    let mut x4 = xb.chunks_exact(4);
    for (i, (a, b)) in (&mut w4).zip(&mut x4).enumerate() {
        let d4 = _mm_mul_ps(f16_of_4(a), dx(i));
        let d = _mm256_set_m128(d4, d4);
        let q = |k: usize| _mm256_cvtepi32_ps(int_q8_0(&a[k], &b[k]));
        acc = _mm256_fmadd_ps(_mm256_permute_ps::<0x00>(d), q(0), acc);
        acc = _mm256_fmadd_ps(_mm256_permute_ps::<0x55>(d), q(1), acc);
        acc = _mm256_fmadd_ps(_mm256_permute_ps::<0xaa>(d), q(2), acc);
        acc = _mm256_fmadd_ps(_mm256_permute_ps::<0xff>(d), q(3), acc);
    }
    for (a, b) in w4.remainder().iter().zip(x4.remainder()) {
        let d = _mm256_set1_ps(f16_at(a, 0) * f16_at(b, 0));
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(int_q8_0(a, b)), acc);
    }
    hsum_ps(acc)
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_q8_0(w: &[u8], x: &[u8]) -> f32 {
    let (xb, _) = x.as_chunks::<Q8_0_BYTES>();
    dot_q8_0_dx(w, x, |i| f16_of_4(&xb[4 * i..4 * i + 4]))
}

/// Blocks up to which the `Q8_0` row loop converts the activation scales once
/// (16384 columns).
const MAX_PRE_BLOCKS_Q8: usize = 512;

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn rows_q8_0(w: &[u8], row_bytes: usize, x: &[u8], out: &mut [f32]) {
    let (xb, _) = x.as_chunks::<Q8_0_BYTES>();
    if xb.len() <= MAX_PRE_BLOCKS_Q8 {
        let mut dx = [_mm_setzero_ps(); MAX_PRE_BLOCKS_Q8 / 4];
        for (i, d) in dx.iter_mut().enumerate().take(xb.len() / 4) {
            *d = f16_of_4(&xb[4 * i..4 * i + 4]);
        }
        for (row, o) in w.chunks_exact(row_bytes).zip(out.iter_mut()) {
            *o = dot_q8_0_dx(row, x, |i| dx[i]);
        }
    } else {
        for (row, o) in w.chunks_exact(row_bytes).zip(out.iter_mut()) {
            *o = dot_q8_0(row, x);
        }
    }
}

/// `Q4_0` quants `q` (unsigned, without the `-8`) times the activation, as
/// 8 x i32 lanes; the bias is removed with the activation's block sums.
#[inline]
#[target_feature(enable = "avx2")]
fn int_q4_0_unsigned(a: &[u8; Q4_0_BYTES], b: &[u8; Q8_0_BYTES]) -> __m256i {
    let q = ld128(a, 2);
    let m4 = _mm_set1_epi8(0xf);
    let w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16::<4>(q), m4), _mm_and_si128(q, m4));
    _mm256_madd_epi16(_mm256_maddubs_epi16(w, ld256(b, 2)), _mm256_set1_epi16(1))
}

/// Activation blocks up to which the `Q4_0` row loop precomputes `8 * sum(q8)`
/// per block on the stack (16384 columns).
const MAX_PRE_BLOCKS_32: usize = 512;

/// `Q4_0` row loop: `sum((q - 8) * y) = sum(q * y) - 8 * sum(y)` with the
/// activation sums computed once, which saves the sign trick per block.
#[target_feature(enable = "avx2,fma,f16c")]
fn rows_q4_0(w: &[u8], row_bytes: usize, x: &[u8], out: &mut [f32]) {
    let (xb, _) = x.as_chunks::<Q8_0_BYTES>();
    if xb.len() > MAX_PRE_BLOCKS_32 {
        for (row, o) in w.chunks_exact(row_bytes).zip(out.iter_mut()) {
            *o = dot_q4_0(row, x);
        }
        return;
    }
    let mut bias = [0i32; MAX_PRE_BLOCKS_32];
    for (s, y) in bias.iter_mut().zip(xb) {
        *s = 8 * y[2..].iter().map(|&v| v as i8 as i32).sum::<i32>();
    }
    let bias = &bias[..xb.len()];
    for (row, o) in w.chunks_exact(row_bytes).zip(out.iter_mut()) {
        let (wb, _) = row.as_chunks::<Q4_0_BYTES>();
        let mut acc = _mm256_setzero_ps();
        let mut wq = wb.chunks_exact(4);
        let mut xq = xb.chunks_exact(4);
        let mut bq = bias.chunks_exact(4);
        for ((a, b), s) in (&mut wq).zip(&mut xq).zip(&mut bq) {
            prefetch_ahead::<{ 4 * Q4_0_BYTES }>(a[0].as_ptr());
            let sums = hsum4_i32([
                int_q4_0_unsigned(&a[0], &b[0]),
                int_q4_0_unsigned(&a[1], &b[1]),
                int_q4_0_unsigned(&a[2], &b[2]),
                int_q4_0_unsigned(&a[3], &b[3]),
            ]);
            // Lanes 0..4 hold one partial sum of each block: subtract the bias there.
            let sums = _mm256_sub_epi32(sums, _mm256_setr_epi32(s[0], s[1], s[2], s[3], 0, 0, 0, 0));
            let d = _mm_mul_ps(f16_of_4(a), f16_of_4(b));
            acc = _mm256_fmadd_ps(_mm256_set_m128(d, d), _mm256_cvtepi32_ps(sums), acc);
        }
        let mut sum = hsum_ps(acc);
        for (a, b) in wq.remainder().iter().zip(xq.remainder()) {
            let p = _mm256_cvtepi32_ps(int_q4_0(a, b));
            sum += hsum_ps(p) * (f16_at(a, 0) * f16_at(b, 0));
        }
        *o = sum;
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn dot_q8_k(w: &[u8], x: &[u8]) -> f32 {
    let (wb, _) = w.as_chunks::<Q8_K_BYTES>();
    let (xb, _) = x.as_chunks::<Q8_K_BYTES>();
    let mut acc = _mm256_setzero_ps();
    for (a, b) in wb.iter().zip(xb) {
        let mut sumi = _mm256_setzero_si256();
        for j in 0..8 {
            sumi = _mm256_add_epi32(sumi, dot_i8_i32(ld256(a, 4 + 32 * j), ld256(b, 4 + 32 * j)));
        }
        let d = f32_at(a, 0) * f32_at(b, 0);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum_ps(acc)
}

// ---------------------------------------------------------------------------
// K-quants
// ---------------------------------------------------------------------------

/// `Q4_K`/`Q5_K` 6-bit scales and mins as `[scales(8) | mins(8)]` u8, from the
/// 12 scale bytes at `off` in block `b` (see the layout in `kquants`):
/// low bits `[q0..q3 & 63, q8..q11 & 15, q4..q7 & 63, q8..q11 >> 4]`, plus
/// `(q0..q3 >> 6) << 4` into scales 4..8 and `(q4..q7 >> 6) << 4` into mins 4..8.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn k4_scales_mins<const N: usize>(b: &[u8; N], off: usize) -> __m128i {
    // Bytes off..off+16: the 12 scale bytes and 4 bytes of quants (ignored).
    _mm256_castsi256_si128(k4_decode(_mm256_castsi128_si256(ld128(b, off))))
}

/// [`k4_scales_mins`] of two blocks at once (lane 0: `a`, lane 1: `b`).
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn k4_scales_mins2<const N: usize>(a: &[u8; N], b: &[u8; N], off: usize) -> __m256i {
    k4_decode(_mm256_set_m128i(ld128(b, off), ld128(a, off)))
}

/// The decoding of [`k4_scales_mins`], independently in each 128-bit lane.
#[inline]
#[target_feature(enable = "avx2")]
fn k4_decode(v: __m256i) -> __m256i {
    let lane = |x: __m128i| _mm256_broadcastsi128_si256(x);
    let lo = _mm256_and_si256(
        _mm256_shuffle_epi8(v, lane(_mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, -1, -1, -1, -1))),
        lane(_mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0)),
    );
    let nib_hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), _mm256_set1_epi8(0x0f));
    let nib_hi =
        _mm256_shuffle_epi8(nib_hi, lane(_mm_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 8, 9, 10, 11)));
    let top = _mm256_srli_epi16::<2>(_mm256_and_si256(v, _mm256_set1_epi8(0xc0u8 as i8)));
    let top = _mm256_shuffle_epi8(top, lane(_mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7)));
    _mm256_or_si256(_mm256_or_si256(lo, nib_hi), top)
}

/// Pairwise sums of a `Q8_K` block's `bsums`: the 8 activation sums of the
/// 32-element sub-blocks, as i16.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn q8k_pair_sums(y: &[u8; Q8_K_BYTES]) -> __m128i {
    let bsums = ld256(y, 260);
    _mm_hadd_epi16(_mm256_castsi256_si128(bsums), _mm256_extracti128_si256::<1>(bsums))
}

/// Integer part of one `Q4_K` x `Q8_K` super-block: `sum_j scale_j * dot_j` as
/// 8 x i32 lanes, and `sum_j min_j * (bsums[2j] + bsums[2j+1])` as 4 x i32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q4k_block(a: &[u8; Q4_K_BYTES], y: &[u8; Q8_K_BYTES], pair_sums: __m128i) -> (__m256i, __m128i) {
    let sm = k4_scales_mins(a, 4);
    let mins = _mm_madd_epi16(_mm_cvtepu8_epi16(_mm_unpackhi_epi64(sm, sm)), pair_sums);
    let sc = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));
    (q4k_core(a, y, sc), mins)
}

/// `sum_j scale_j * dot_j` of a `Q4_K` block, `sc` holding its 8 scales as i16
/// in both lanes. The two nibble products of each 64-element chunk are
/// interleaved as i16 (`|p| <= 2*15*128`, so the sum of two fits) and multiplied
/// by the pair of scales in one `vpmaddwd`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q4k_core(a: &[u8; Q4_K_BYTES], y: &[u8; Q8_K_BYTES], sc: __m256i) -> __m256i {
    let m4 = _mm256_set1_epi8(0xf);
    // dword j of `sc` holds (scale_2j, scale_2j+1).
    let scale_pairs = [
        _mm256_shuffle_epi32::<0x00>(sc),
        _mm256_shuffle_epi32::<0x55>(sc),
        _mm256_shuffle_epi32::<0xaa>(sc),
        _mm256_shuffle_epi32::<0xff>(sc),
    ];
    let mut sumi = _mm256_setzero_si256();
    for (j, sj) in scale_pairs.into_iter().enumerate() {
        let bits = ld256(a, 16 + 32 * j);
        let lo = _mm256_and_si256(bits, m4);
        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(bits), m4);
        let pl = _mm256_maddubs_epi16(lo, ld256(y, 4 + 64 * j));
        let ph = _mm256_maddubs_epi16(hi, ld256(y, 4 + 64 * j + 32));
        let p = _mm256_add_epi16(_mm256_unpacklo_epi16(pl, ph), _mm256_unpackhi_epi16(pl, ph));
        sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, sj));
    }
    sumi
}

/// Horizontal sum of 4 x i32.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn hsum_epi32_128(v: __m128i) -> i32 {
    let s = _mm_add_epi32(v, _mm_unpackhi_epi64(v, v));
    _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<0b01>(s)))
}

/// `Q4_K x Q8_K` of one row in the float order of llama.cpp's repacked kernel
/// (`ggml_gemv_q4_K_8x8_q8_K`, AVX2), which a native x86 build runs for every
/// `Q4_K` matrix with a multiple of 8 rows: per super-block, the row's whole
/// integer dot `isum = sum_j scale_j * dot_j` and minimum term
/// `imin = sum_j min_j * bsum_j` (exact integers, any summation order), then two
/// `f32` FMA chains `acc = fma(isum, d*dy, acc)`, `accm = fma(imin, dmin*dy, accm)`;
/// the result is `acc - accm`. Two blocks per step share the scale decoding and
/// the horizontal sums; `pairs[i]` holds blocks `2i` and `2i+1`'s activation pair
/// sums (lane 0, lane 1).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_q4_k_pairs(w: &[u8], xb: &[[u8; Q8_K_BYTES]], pairs: impl Fn(usize) -> __m256i) -> f32 {
    let (wb, _) = w.as_chunks::<Q4_K_BYTES>();
    let zero = _mm256_setzero_si256();
    let (mut acc, mut accm) = (0f32, 0f32);
    let mut w2 = wb.chunks_exact(2);
    let mut x2 = xb.chunks_exact(2);
    for (i, (a, y)) in (&mut w2).zip(&mut x2).enumerate() {
        let (a0, a1, y0, y1) = (&a[0], &a[1], &y[0], &y[1]);
        prefetch_ahead::<{ 2 * Q4_K_BYTES }>(a0.as_ptr());
        let sm = k4_scales_mins2(a0, a1, 4);
        let sc = _mm256_unpacklo_epi8(sm, zero);
        // Lane 0: block 0's four min products, lane 1: block 1's.
        let mins = _mm256_madd_epi16(_mm256_unpackhi_epi8(sm, zero), pairs(i));
        let s0 = q4k_core(a0, y0, _mm256_permute2x128_si256::<0x00>(sc, sc));
        let s1 = q4k_core(a1, y1, _mm256_permute2x128_si256::<0x11>(sc, sc));
        // [isum0, isum1, imin0, imin1] as the sums of the two 128-bit halves.
        let m = _mm256_permutevar8x32_epi32(mins, _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7));
        let h = _mm256_hadd_epi32(_mm256_hadd_epi32(s0, s1), m);
        let t = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
        let (isum0, isum1) = (_mm_cvtsi128_si32(t), _mm_extract_epi32::<1>(t));
        let (imin0, imin1) = (_mm_extract_epi32::<2>(t), _mm_extract_epi32::<3>(t));
        let (dy0, dy1) = (f32_at(y0, 0), f32_at(y1, 0));
        let (d0, m0) = f16x2_at(a0, 0);
        let (d1, m1) = f16x2_at(a1, 0);
        acc = (isum0 as f32).mul_add(d0 * dy0, acc);
        accm = (imin0 as f32).mul_add(m0 * dy0, accm);
        acc = (isum1 as f32).mul_add(d1 * dy1, acc);
        accm = (imin1 as f32).mul_add(m1 * dy1, accm);
    }
    for (a, y) in w2.remainder().iter().zip(x2.remainder()) {
        let (sumi, mins) = q4k_block(a, y, q8k_pair_sums(y));
        let dy = f32_at(y, 0);
        let (d, dmin) = f16x2_at(a, 0);
        acc = (hsum_epi32(sumi) as f32).mul_add(d * dy, acc);
        accm = (hsum_epi32_128(mins) as f32).mul_add(dmin * dy, accm);
    }
    acc - accm
}

/// Pair sums of blocks `2i` and `2i+1` side by side.
#[inline]
#[target_feature(enable = "avx2")]
fn q8k_pair_sums2(xb: &[[u8; Q8_K_BYTES]], i: usize) -> __m256i {
    _mm256_set_m128i(q8k_pair_sums(&xb[2 * i + 1]), q8k_pair_sums(&xb[2 * i]))
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_q4_k(w: &[u8], x: &[u8]) -> f32 {
    let (xb, _) = x.as_chunks::<Q8_K_BYTES>();
    dot_q4_k_pairs(w, xb, |i| q8k_pair_sums2(xb, i))
}

/// Blocks up to which the row loops precompute the activation's pair sums
/// (16384 columns) on the stack.
const MAX_PRE_BLOCKS: usize = 64;

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn rows_q4_k(w: &[u8], row_bytes: usize, x: &[u8], out: &mut [f32]) {
    let (xb, _) = x.as_chunks::<Q8_K_BYTES>();
    if xb.len() <= MAX_PRE_BLOCKS {
        let mut pairs = [_mm256_setzero_si256(); MAX_PRE_BLOCKS / 2];
        for (i, p) in pairs.iter_mut().enumerate().take(xb.len() / 2) {
            *p = q8k_pair_sums2(xb, i);
        }
        for (row, o) in w.chunks_exact(row_bytes).zip(out.iter_mut()) {
            *o = dot_q4_k_pairs(row, xb, |i| pairs[i]);
        }
    } else {
        for (row, o) in w.chunks_exact(row_bytes).zip(out.iter_mut()) {
            *o = dot_q4_k(row, x);
        }
    }
}

/// i16 lane `i` of `v` broadcast to all 16 lanes (ggml's `get_scale_shuffle_k4`
/// on a vector holding the 8 scales in both 128-bit halves).
#[inline]
#[target_feature(enable = "avx2")]
fn bcast_i16(v: __m256i, i: usize) -> __m256i {
    let lo = (2 * i) as i8;
    let hi = lo + 1;
    let idx = _mm_setr_epi8(lo, hi, lo, hi, lo, hi, lo, hi, lo, hi, lo, hi, lo, hi, lo, hi);
    _mm256_shuffle_epi8(v, _mm256_broadcastsi128_si256(idx))
}

/// `Q5_K x Q8_K` in ggml's x86 order (`ggml_vec_dot_q5_K_q8_K`, AVX2 path): per
/// super-block, 8 i32 lanes `sumi[l] = sum_j scale_j * (4-product sum l of
/// sub-block j)` (one `vpmaddwd` per 32-element sub-block), accumulated as
/// `acc = fma(dy*d, sumi, acc)`; the minimums as a scalar
/// `summs = fma(-dy*dmin, imin, summs)`; result `hsum(acc) + summs`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_q5_k(w: &[u8], x: &[u8]) -> f32 {
    let (wb, _) = w.as_chunks::<Q5_K_BYTES>();
    let (xb, _) = x.as_chunks::<Q8_K_BYTES>();
    let m4 = _mm256_set1_epi8(0xf);
    let one = _mm256_set1_epi8(1);
    let two = _mm256_set1_epi8(2);
    let mut acc = _mm256_setzero_ps();
    let mut summs = 0f32;
    for (a, y) in wb.iter().zip(xb) {
        prefetch_block(a);
        let sm = k4_scales_mins(a, 4);
        let imin = hsum_epi32_128(_mm_madd_epi16(_mm_cvtepu8_epi16(_mm_unpackhi_epi64(sm, sm)), q8k_pair_sums(y)));
        let dy = f32_at(y, 0);
        let (d, dmin) = f16x2_at(a, 0);
        summs = (-dy * dmin).mul_add(imin as f32, summs);
        let sc = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));
        let mut hb = ld256(a, 16);
        let mut sumi = _mm256_setzero_si256();
        for j in 0..4 {
            let bits = ld256(a, 48 + 32 * j);
            // `hb` is shifted right by 2 per step: bits 2j, 2j+1 are bits 0, 1 here.
            let h_lo = _mm256_slli_epi16::<4>(_mm256_and_si256(hb, one));
            let h_hi = _mm256_slli_epi16::<3>(_mm256_and_si256(hb, two));
            hb = _mm256_srli_epi16::<2>(hb);
            let lo = _mm256_or_si256(_mm256_and_si256(bits, m4), h_lo);
            let hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(bits), m4), h_hi);
            let pl = _mm256_madd_epi16(bcast_i16(sc, 2 * j), _mm256_maddubs_epi16(lo, ld256(y, 4 + 64 * j)));
            let ph = _mm256_madd_epi16(bcast_i16(sc, 2 * j + 1), _mm256_maddubs_epi16(hi, ld256(y, 4 + 64 * j + 32)));
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(pl, ph));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(dy * d), _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum_ps(acc) + summs
}

/// Integer part of one `Q6_K` x `Q8_K` super-block in ggml's lane layout
/// (`ggml_vec_dot_q6_K_q8_K`, AVX2 path): lane `l` sums, over the eight 32-element
/// groups, `scale * (products 4l..4l+3 of the group)` (one `vpmaddwd` per group,
/// with the scales of its two 16-element sub-blocks), minus the `-32` bias
/// `32 * (bsums[2l]*sc[2l] + bsums[2l+1]*sc[2l+1])`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn q6k_block(a: &[u8; Q6_K_BYTES], y: &[u8; Q8_K_BYTES]) -> __m256i {
    let m4 = _mm256_set1_epi8(0xf);
    let m30 = _mm256_set1_epi8(0x30);
    let scales = ld128(a, 192);
    let bias = _mm256_slli_epi32::<5>(_mm256_madd_epi16(_mm256_cvtepi8_epi16(scales), ld256(y, 260)));
    // Group g's scales: sc[2g] (as i16) for its first 16 elements, sc[2g+1] for the
    // rest; one in-lane byte shuffle of the i16 scales of the group's half
    // (`s16_lo` holds sc[0..8] in both lanes, `s16_hi` sc[8..16]).
    let s16 = _mm256_cvtepi8_epi16(scales);
    let s16_lo = _mm256_permute2x128_si256::<0x00>(s16, s16);
    let s16_hi = _mm256_permute2x128_si256::<0x11>(s16, s16);
    let group_scales = |g: usize| {
        let (lo, hi) = ((4 * (g % 4)) as i8, (4 * (g % 4) + 2) as i8);
        let idx = _mm256_setr_epi8(
            lo,
            lo + 1,
            lo,
            lo + 1,
            lo,
            lo + 1,
            lo,
            lo + 1,
            lo,
            lo + 1,
            lo,
            lo + 1,
            lo,
            lo + 1,
            lo,
            lo + 1,
            hi,
            hi + 1,
            hi,
            hi + 1,
            hi,
            hi + 1,
            hi,
            hi + 1,
            hi,
            hi + 1,
            hi,
            hi + 1,
            hi,
            hi + 1,
            hi,
            hi + 1,
        );
        _mm256_shuffle_epi8(if g < 4 { s16_lo } else { s16_hi }, idx)
    };
    let mut sumi = _mm256_setzero_si256();
    for h in 0..2 {
        let l0 = ld256(a, 64 * h);
        let l1 = ld256(a, 64 * h + 32);
        let qh = ld256(a, 128 + 32 * h);
        // 16-bit shifts move bits across bytes, but the 0x30 mask keeps only
        // bits that stayed inside their byte.
        let q0 = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16::<4>(qh), m30));
        let q1 = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16::<2>(qh), m30));
        let q2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(l0), m4), _mm256_and_si256(qh, m30));
        let q3 = _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16::<4>(l1), m4),
            _mm256_and_si256(_mm256_srli_epi16::<2>(qh), m30),
        );
        let base = 4 + 128 * h;
        let p = |q: __m256i, k: usize| {
            _mm256_madd_epi16(group_scales(4 * h + k), _mm256_maddubs_epi16(q, ld256(y, base + 32 * k)))
        };
        let (p0, p1, p2, p3) = (p(q0, 0), p(q1, 1), p(q2, 2), p(q3, 3));
        sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p0, p1));
        sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p2, p3));
    }
    _mm256_sub_epi32(sumi, bias)
}

/// `Q6_K x Q8_K` in ggml's x86 order: per block `acc = fma(dy*d, sumi, acc)`
/// on the 8 lanes of [`q6k_block`], one horizontal sum at the end.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_q6_k(w: &[u8], x: &[u8]) -> f32 {
    let (wb, _) = w.as_chunks::<Q6_K_BYTES>();
    let (xb, _) = x.as_chunks::<Q8_K_BYTES>();
    let mut acc = _mm256_setzero_ps();
    for (a, y) in wb.iter().zip(xb) {
        // No software prefetch: measured neutral to harmful for this fast kernel.
        let sumi = q6k_block(a, y);
        let d = f32_at(y, 0) * f16_at(a, 208);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum_ps(acc)
}

/// The i16 scales of the 32-element group `k` (0..4) of a half whose 8 sub-block scales (as
/// i16) `half` holds in both 128-bit lanes: `scale 2k` for the first 16 elements (lane 0),
/// `scale 2k + 1` for the other 16 (ggml's `get_scale_shuffle_q3k`).
#[inline]
#[target_feature(enable = "avx2")]
fn group_scales_16(half: __m256i, k: usize) -> __m256i {
    let (a, b) = ((4 * k) as i8, (4 * k + 2) as i8);
    let lo = _mm_setr_epi8(a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1);
    let hi = _mm_setr_epi8(b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1);
    _mm256_shuffle_epi8(half, _mm256_set_m128i(hi, lo))
}

/// The 16 sub-block scales (i8) of a 16-element-sub-block K-quant as i16, one vector per
/// 128-element half, each half's 8 scales in both 128-bit lanes (ggml's `scales[2]`).
#[inline]
#[target_feature(enable = "avx2")]
fn halves_scales_16(scales8: __m128i) -> [__m256i; 2] {
    let all = _mm256_cvtepi8_epi16(scales8);
    [_mm256_permute2x128_si256::<0x00>(all, all), _mm256_permute2x128_si256::<0x11>(all, all)]
}

/// The 16 `Q3_K` 6-bit scales minus 32, as i8.
#[inline]
#[target_feature(enable = "avx2")]
fn q3k_scales(b: &[u8; 12]) -> __m128i {
    const KMASK1: u32 = 0x0303_0303;
    const KMASK2: u32 = 0x0f0f_0f0f;
    let a0 = ld_u32(b, 0);
    let a1 = ld_u32(b, 4);
    let a2 = ld_u32(b, 8);
    let v = _mm_set_epi32(
        (((a1 >> 4) & KMASK2) | (((a2 >> 6) & KMASK1) << 4)) as i32,
        (((a0 >> 4) & KMASK2) | (((a2 >> 4) & KMASK1) << 4)) as i32,
        ((a1 & KMASK2) | (((a2 >> 2) & KMASK1) << 4)) as i32,
        ((a0 & KMASK2) | ((a2 & KMASK1) << 4)) as i32,
    );
    _mm_sub_epi8(v, _mm_set1_epi8(32))
}

/// `Q3_K x Q8_K` in ggml's x86 order (`ggml_vec_dot_q3_K_q8_K`, AVX2 path; the same at both
/// levels): per block, 8 i32 lanes `sum_g scale(2g + m/4) * (products 4m..4m+3 of 32-element
/// group g)` with the signed quants `low2 - 4 * !hbit` (two `vpmaddubsw`, subtracted), then
/// `acc = fma(dy*d, lanes, acc)`; one `hsum_float_8` at the end.
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_q3_k(w: &[u8], x: &[u8]) -> f32 {
    let (wb, _) = w.as_chunks::<Q3_K_BYTES>();
    let (xb, _) = x.as_chunks::<Q8_K_BYTES>();
    let m3 = _mm256_set1_epi8(3);
    let one = _mm256_set1_epi8(1);
    let mut acc = _mm256_setzero_ps();
    for (a, y) in wb.iter().zip(xb) {
        prefetch_block(a);
        let d = f32_at(y, 0) * f16_at(a, 108);
        let scales = halves_scales_16(q3k_scales(a[96..108].try_into().expect("12 bytes")));
        // The inverted high bits: `4 * !hbit` is subtracted from the low two bits.
        let nh = _mm256_andnot_si256(ld256(a, 0), _mm256_set1_epi8(-1));
        let mut sumi = _mm256_setzero_si256();
        for (j, sc) in scales.iter().enumerate() {
            let bits = ld256(a, 32 + 32 * j);
            let mut p = [_mm256_setzero_si256(); 4];
            for (k, pk) in p.iter_mut().enumerate() {
                let low = _mm256_and_si256(_mm256_srl_epi16(bits, _mm_cvtsi32_si128(2 * k as i32)), m3);
                let hb = _mm256_and_si256(_mm256_srl_epi16(nh, _mm_cvtsi32_si128((4 * j + k) as i32)), one);
                let y8 = ld256(y, 4 + 128 * j + 32 * k);
                let q = _mm256_sub_epi16(
                    _mm256_maddubs_epi16(low, y8),
                    _mm256_maddubs_epi16(_mm256_slli_epi16::<2>(hb), y8),
                );
                *pk = _mm256_madd_epi16(group_scales_16(*sc, k), q);
            }
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(_mm256_add_epi32(p[0], p[1]), _mm256_add_epi32(p[2], p[3])));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum_ps(acc)
}

/// The `Q2_K` quants of group `k` (0..4) of half `j`: 2-bit plane `k` of `qs[32j..32j+32]`.
#[inline]
#[target_feature(enable = "avx2")]
fn q2k_group(a: &[u8; Q2_K_BYTES], j: usize, k: usize) -> __m256i {
    _mm256_and_si256(_mm256_srl_epi16(ld256(a, 16 + 32 * j), _mm_cvtsi32_si128(2 * k as i32)), _mm256_set1_epi8(3))
}

/// One `Q2_K` block in ggml's `ggml_vec_dot_q2_K_q8_K` lane layout: the 8 i32 lanes
/// `sum_g scale(2g + m/4) * (products 4m..4m+3 of group g)`, and the 8 lanes
/// `min(2l) * bsum(2l) + min(2l+1) * bsum(2l+1)`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q2k_block(a: &[u8; Q2_K_BYTES], y: &[u8; Q8_K_BYTES]) -> (__m256i, __m256i) {
    let m4 = _mm_set1_epi8(0xf);
    let sm = ld128(a, 0);
    let mins = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(sm), m4)), ld256(y, 260));
    let scales = halves_scales_16(_mm_and_si128(sm, m4));
    let mut sumi = _mm256_setzero_si256();
    for (j, sc) in scales.iter().enumerate() {
        let mut p = [_mm256_setzero_si256(); 4];
        for (k, pk) in p.iter_mut().enumerate() {
            let q = _mm256_maddubs_epi16(q2k_group(a, j, k), ld256(y, 4 + 128 * j + 32 * k));
            *pk = _mm256_madd_epi16(group_scales_16(*sc, k), q);
        }
        sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(_mm256_add_epi32(p[0], p[1]), _mm256_add_epi32(p[2], p[3])));
    }
    (sumi, mins)
}

/// `Q2_K x Q8_K` in ggml's x86 order (`ggml_vec_dot_q2_K_q8_K`, AVX2 path), which an AVX2 build
/// runs: per block `acc = fma(-dy*dmin, min lanes, acc)`, then `acc = fma(dy*d, lanes, acc)`
/// ([`q2k_block`]); one `hsum_float_8` at the end.
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_q2_k(w: &[u8], x: &[u8]) -> f32 {
    let (wb, _) = w.as_chunks::<Q2_K_BYTES>();
    let (xb, _) = x.as_chunks::<Q8_K_BYTES>();
    let mut acc = _mm256_setzero_ps();
    for (a, y) in wb.iter().zip(xb) {
        prefetch_block(a);
        let (dw, dminw) = f16x2_at(a, 80);
        let dy = f32_at(y, 0);
        let (sumi, mins) = q2k_block(a, y);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(-dy * dminw), _mm256_cvtepi32_ps(mins), acc);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(dy * dw), _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum_ps(acc)
}

/// `Q2_K x Q8_K` in the order of llama.cpp's repacked `ggml_gemv_q2_K_8x8_q8_K` (AVX2 code),
/// which a build with AVX-512 runs for every `Q2_K` matrix with a multiple of 8 rows (ggml
/// repacks `Q2_K` only when `ggml_cpu_has_avx512()`): per block the whole integers
/// `isum = sum_s scale_s * dot_s` and `imin = sum_s min_s * bsum_s`, then
/// `acc = fma(isum, d*dy, acc)`, `accm = fma(imin, dmin*dy, accm)`; the result is `acc - accm`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_q2_k_repacked(w: &[u8], x: &[u8]) -> f32 {
    let (wb, _) = w.as_chunks::<Q2_K_BYTES>();
    let (xb, _) = x.as_chunks::<Q8_K_BYTES>();
    let (mut acc, mut accm) = (0f32, 0f32);
    for (a, y) in wb.iter().zip(xb) {
        prefetch_block(a);
        let (dw, dminw) = f16x2_at(a, 80);
        let dy = f32_at(y, 0);
        let (sumi, mins) = q2k_block(a, y);
        acc = (hsum_epi32(sumi) as f32).mul_add(dw * dy, acc);
        accm = (hsum_epi32(mins) as f32).mul_add(dminw * dy, accm);
    }
    acc - accm
}

// ---------------------------------------------------------------------------
// Floats
// ---------------------------------------------------------------------------

/// ggml's `GGML_F32x8_REDUCE` tail (AVX): `(lo + hi)` then two `hadd`s.
#[inline]
#[target_feature(enable = "avx2")]
fn hsum_hadd_ps(v: __m256) -> f32 {
    let t0 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let t1 = _mm_hadd_ps(t0, t0);
    _mm_cvtss_f32(_mm_hadd_ps(t1, t1))
}

/// The 4-register float dot product skeleton of ggml's `ggml_vec_dot_f32` and
/// `ggml_vec_dot_f16` in an AVX build (`GGML_F32_ARR = 4` accumulators of 8 lanes, FMA per
/// vector, 32-element steps, reduced as `(s0 + s2) + (s1 + s3)` then `GGML_F32x8_REDUCE`'s
/// horizontal tail). `load(bytes, off)` gives the 8 floats at byte offset `off`. Returns
/// the reduced sum and the number of elements consumed (the caller adds the tail as ggml
/// does). The AVX-512 shape is in `avx512`.
macro_rules! ggml_float_dot {
    ($a:expr, $b:expr, $elem_bytes:expr, $load:expr) => {{
        let (a, b): (&[u8], &[u8]) = ($a, $b);
        let n = a.len() / $elem_bytes;
        let np = n - n % 32;
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i < np {
            for (j, aj) in acc.iter_mut().enumerate() {
                let off = (i + 8 * j) * $elem_bytes;
                *aj = _mm256_fmadd_ps($load(a, off), $load(b, off), *aj);
            }
            i += 32;
        }
        let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[2]), _mm256_add_ps(acc[1], acc[3]));
        (hsum_hadd_ps(s), np)
    }};
}

#[inline]
#[target_feature(enable = "avx2")]
fn ld_f32x8(b: &[u8], off: usize) -> __m256 {
    assert!(off + 32 <= b.len());
    // SAFETY: `off + 32 <= len` was just checked; `loadu` has no alignment requirement.
    unsafe { _mm256_loadu_ps(b.as_ptr().add(off).cast()) }
}

#[inline]
#[target_feature(enable = "avx2,f16c")]
fn ld_f16x8(b: &[u8], off: usize) -> __m256 {
    assert!(off + 16 <= b.len());
    // SAFETY: `off + 16 <= len` was just checked; `loadu` has no alignment requirement.
    _mm256_cvtph_ps(unsafe { _mm_loadu_si128(b.as_ptr().add(off).cast()) })
}

/// `ggml_vec_dot_f32` of an AVX2 build: vector sum in `f32`, the tail added
/// with `sumf += x*y` in `f32` (which GCC contracts to an FMA).
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_f32(w: &[u8], x: &[u8]) -> f32 {
    let (mut sum, np) = ggml_float_dot!(w, x, 4, |b, off| ld_f32x8(b, off));
    for (a, b) in w[np * 4..].chunks_exact(4).zip(x[np * 4..].chunks_exact(4)) {
        let a = f32::from_le_bytes([a[0], a[1], a[2], a[3]]);
        let b = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        sum = a.mul_add(b, sum);
    }
    sum
}

/// `ggml_vec_dot_f16` of an AVX2 build: vector sum in
/// `f32`, widened to `f64`, the tail's `f32` products added in `f64`.
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_f16(w: &[u8], x: &[u8]) -> f32 {
    let (sum, np) = ggml_float_dot!(w, x, 2, |b, off| ld_f16x8(b, off));
    let mut sum = f64::from(sum);
    for (a, b) in w[np * 2..].chunks_exact(2).zip(x[np * 2..].chunks_exact(2)) {
        let a = super::f16_to_f32(u16::from_le_bytes([a[0], a[1]]));
        let b = super::f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
        sum += f64::from(a * b);
    }
    sum as f32
}

/// `ggml_vec_dot_bf16` of an AVX2 build: four 8-lane accumulators over 32-element steps
/// (`c += x*y`, which GCC contracts to an FMA), reduced as `(c1 + c3) + (c2 + c4)` and
/// `hsum_float_8`, widened to `f64`; the tail's `f32` products added in `f64`.
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_bf16(w: &[u8], x: &[u8]) -> f32 {
    let (wb, wr) = w.as_chunks::<64>();
    let (xb, xr) = x.as_chunks::<64>();
    let mut acc = [_mm256_setzero_ps(); 4];
    let widen = |v: __m128i| _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(v)));
    for (a, b) in wb.iter().zip(xb) {
        for (i, s) in acc.iter_mut().enumerate() {
            *s = _mm256_fmadd_ps(widen(ld128(a, 16 * i)), widen(ld128(b, 16 * i)), *s);
        }
    }
    let mut sum = hsum_ps(_mm256_add_ps(_mm256_add_ps(acc[0], acc[2]), _mm256_add_ps(acc[1], acc[3]))) as f64;
    for (a, b) in wr.chunks_exact(2).zip(xr.chunks_exact(2)) {
        let a = super::float::bf16_bits_to_f32(u16::from_le_bytes([a[0], a[1]]));
        let b = super::float::bf16_bits_to_f32(u16::from_le_bytes([b[0], b[1]]));
        sum += (a * b) as f64;
    }
    sum as f32
}

// ---------------------------------------------------------------------------
// Q8_K activation quantizer
// ---------------------------------------------------------------------------

/// `quantize_row_q8_K_ref`, bit for bit, eight lanes at a time. Blocks holding
/// NaN or whose inverse scale overflows (values below ~1e-37) go to the scalar
/// code, which reproduces ggml's garbage for them.
#[target_feature(enable = "avx2,fma,f16c")]
fn quantize_q8_k(src: &[f32], dst: &mut [u8]) {
    let (xs, _) = src.as_chunks::<{ super::QK_K }>();
    let (ys, _) = dst.as_chunks_mut::<Q8_K_BYTES>();
    let sign = _mm256_set1_ps(-0.0);
    for (x, y) in xs.iter().zip(ys.iter_mut()) {
        let ld = |i: usize| -> __m256 {
            let c: &[f32; 8] = x[8 * i..8 * i + 8].try_into().expect("8 lanes");
            // SAFETY: `c` is 8 in-bounds f32; `loadu` has no alignment requirement.
            unsafe { _mm256_loadu_ps(c.as_ptr()) }
        };
        let mut vmax = _mm256_setzero_ps();
        let mut nan = _mm256_setzero_ps();
        for i in 0..32 {
            let v = ld(i);
            vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, v));
            nan = _mm256_or_ps(nan, _mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
        }
        if _mm256_movemask_ps(nan) != 0 {
            super::q8::quantize_q8_k(x, y);
            continue;
        }
        let m = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps::<1>(vmax));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
        if amax == 0.0 {
            y.fill(0);
            continue;
        }
        // ggml keeps the first element of largest magnitude, with its sign.
        let va = _mm256_set1_ps(amax);
        let mut max = amax;
        for i in 0..32 {
            let v = ld(i);
            let hit = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(_mm256_andnot_ps(sign, v), va));
            if hit != 0 {
                max = x[8 * i + hit.trailing_zeros() as usize];
                break;
            }
        }
        let iscale = -127.0 / max;
        if !iscale.is_finite() {
            super::q8::quantize_q8_k(x, y);
            continue;
        }
        // nearest_int: (v + 1.5 * 2^23) bits & 0x7fffff - 0x400000, then min 127.
        let vs = _mm256_set1_ps(iscale);
        let magic = _mm256_set1_ps(12_582_912.0);
        let mant = _mm256_set1_epi32(0x007f_ffff);
        let bias = _mm256_set1_epi32(0x0040_0000);
        let top = _mm256_set1_epi32(127);
        let q = |i: usize| -> __m256i {
            let t = _mm256_castps_si256(_mm256_add_ps(_mm256_mul_ps(vs, ld(i)), magic));
            _mm256_min_epi32(_mm256_sub_epi32(_mm256_and_si256(t, mant), bias), top)
        };
        let mut bsums = [0i32; 16];
        for k in 0..8 {
            let (q0, q1, q2, q3) = (q(4 * k), q(4 * k + 1), q(4 * k + 2), q(4 * k + 3));
            // |q| <= 127: the saturating packs are exact; the permutation undoes
            // their per-lane interleaving.
            let b01 = _mm256_packs_epi32(q0, q1);
            let b23 = _mm256_packs_epi32(q2, q3);
            let b =
                _mm256_permutevar8x32_epi32(_mm256_packs_epi16(b01, b23), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            let off = 4 + 32 * k;
            let out: &mut [u8; 32] = (&mut y[off..off + 32]).try_into().expect("32 bytes");
            // SAFETY: `out` is 32 in-bounds bytes; `storeu` has no alignment requirement.
            unsafe { _mm256_storeu_si256(out.as_mut_ptr().cast(), b) };
            // Groups 2k (elements of q0, q1) and 2k + 1 (q2, q3).
            bsums[2 * k] = hsum_epi32(_mm256_add_epi32(q0, q1));
            bsums[2 * k + 1] = hsum_epi32(_mm256_add_epi32(q2, q3));
        }
        for (g, s) in bsums.iter().enumerate() {
            y[260 + 2 * g..262 + 2 * g].copy_from_slice(&(*s as i16).to_le_bytes());
        }
        y[0..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
    }
}

#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn hsum_epi32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<0b01>(s)))
}

/// ggml-cpu's x86 `quantize_row_q8_0` (its AVX2 path, [`super::Q8Flavor::X86`]), instruction
/// for instruction: `amax` by vector max in ggml's order, `d = amax / 127`,
/// `id = amax != 0 ? 127 / amax : 0`, `round(x * id)` to nearest even, saturating packs.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn quantize_q8_0_x86(src: &[f32], dst: &mut [u8]) {
    let (xs, _) = src.as_chunks::<32>();
    let (ys, _) = dst.as_chunks_mut::<Q8_0_BYTES>();
    let sign = _mm256_set1_ps(-0.0);
    for (x, y) in xs.iter().zip(ys.iter_mut()) {
        // SAFETY: `x` is 32 in-bounds f32; `loadu` has no alignment requirement.
        let v: [__m256; 4] = std::array::from_fn(|k| unsafe { _mm256_loadu_ps(x.as_ptr().add(8 * k)) });
        let mut max = _mm256_andnot_ps(sign, v[0]);
        for vk in &v[1..] {
            max = _mm256_max_ps(max, _mm256_andnot_ps(sign, *vk));
        }
        let m4 = _mm_max_ps(_mm256_extractf128_ps::<1>(max), _mm256_castps256_ps128(max));
        let m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        y[0..2].copy_from_slice(&super::float::f32_to_f16_bits(amax / 127.0).to_le_bytes());
        let id = _mm256_set1_ps(if amax != 0.0 { 127.0 / amax } else { 0.0 });
        let q = |k: usize| {
            _mm256_cvtps_epi32(_mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
                v[k], id,
            )))
        };
        let i01 = _mm256_packs_epi32(q(0), q(1));
        let i23 = _mm256_packs_epi32(q(2), q(3));
        let b = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(i01, i23), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        let out: &mut [u8; 32] = (&mut y[2..34]).try_into().expect("32 bytes");
        // SAFETY: `out` is 32 in-bounds bytes; `storeu` has no alignment requirement.
        unsafe { _mm256_storeu_si256(out.as_mut_ptr().cast(), b) };
    }
}

/// `f32 -> f16` with F16C (round to nearest even, like ggml); eight lanes that
/// hold a NaN go to the scalar conversion, which writes ggml's `0x7e00` NaN.
#[target_feature(enable = "avx2,fma,f16c")]
fn quantize_f16(src: &[f32], dst: &mut [u8]) {
    let (xs, xr) = src.as_chunks::<8>();
    let (ys, yr) = dst.as_chunks_mut::<16>();
    for (x, y) in xs.iter().zip(ys.iter_mut()) {
        // SAFETY: `x` is 8 in-bounds f32; `loadu` has no alignment requirement.
        let v = unsafe { _mm256_loadu_ps(x.as_ptr()) };
        if _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_UNORD_Q>(v, v)) != 0 {
            super::float::quantize_f16(x, y);
            continue;
        }
        let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
        // SAFETY: `y` is 16 in-bounds bytes; `storeu` has no alignment requirement.
        unsafe { _mm_storeu_si128(y.as_mut_ptr().cast(), h) };
    }
    super::float::quantize_f16(xr, yr);
}

/// The AVX2 quantizer for activations of type `ty`, if there is one.
pub(super) fn quantizer(ty: GgmlType) -> Option<QuantizeFn> {
    if !available() {
        return None;
    }
    fn q8k(src: &[f32], dst: &mut [u8]) {
        // SAFETY: handed out only after `available()` confirmed AVX2, FMA and F16C.
        unsafe { quantize_q8_k(src, dst) }
    }
    fn f16(src: &[f32], dst: &mut [u8]) {
        // SAFETY: as above.
        unsafe { quantize_f16(src, dst) }
    }
    match ty {
        GgmlType::Q8_K => Some(q8k),
        GgmlType::F16 => Some(f16),
        _ => None,
    }
}

// ---------------------------------------------------------------------------
// Dispatch
// ---------------------------------------------------------------------------

/// Generates the safe entry points for one kernel: a dot product and a row loop
/// compiled with the same features (so the dot product inlines into it).
macro_rules! entry {
    ($dot:ident) => {{
        #[target_feature(enable = "avx2,fma,f16c")]
        fn rows(w: &[u8], row_bytes: usize, x: &[u8], out: &mut [f32]) {
            for (row, o) in w.chunks_exact(row_bytes).zip(out.iter_mut()) {
                *o = $dot(row, x);
            }
        }
        entry!(@wrap $dot, rows)
    }};
    (@wrap $dot:ident, $rows:ident) => {{
        fn vec_dot(_n: usize, w: &[u8], x: &[u8]) -> f32 {
            // SAFETY: `kernel()` hands this out only after `available()` confirmed
            // AVX2, FMA and F16C on this CPU.
            unsafe { $dot(w, x) }
        }
        fn matvec(w: &[u8], row_bytes: usize, _cols: usize, x: &[u8], out: &mut [f32]) {
            // SAFETY: as for `vec_dot` above.
            unsafe { $rows(w, row_bytes, x, out) }
        }
        Kernel { vec_dot, matvec }
    }};
}

/// The `Q2_K` kernel of the `avx512` level ([`dot_q2_k_repacked`]; AVX2 code).
pub(super) fn kernel_q2_k_repacked() -> Option<Kernel> {
    available().then(|| entry!(dot_q2_k_repacked))
}

/// The AVX2 kernel for `ty`, if there is one. Callers must have checked
/// [`available`].
pub(super) fn kernel(ty: GgmlType) -> Option<Kernel> {
    if !available() {
        return None;
    }
    use GgmlType::*;
    Some(match ty {
        F32 => entry!(dot_f32),
        F16 => entry!(dot_f16),
        Q8_0 => entry!(@wrap dot_q8_0, rows_q8_0),
        Q4_0 => entry!(@wrap dot_q4_0, rows_q4_0),
        BF16 => entry!(dot_bf16),
        Q8_K => entry!(dot_q8_k),
        Q2_K => entry!(dot_q2_k),
        Q3_K => entry!(dot_q3_k),
        Q4_K => entry!(@wrap dot_q4_k, rows_q4_k),
        Q5_K => entry!(dot_q5_k),
        Q6_K => entry!(dot_q6_k),
        _ => return None,
    })
}

// ---------------------------------------------------------------------------
// Several activations against the same rows (prompt processing)
// ---------------------------------------------------------------------------
//
// Each weight block is loaded and decoded once for up to `MAX_MULTI` activations;
// every output element then goes through exactly the operations of the one-token
// kernel above (same integers, same f32 operations in the same order), so the
// results are bit-identical to one `matvec` per activation.

/// Activations per pass of the multi-activation kernels.
const MAX_MULTI: usize = 4;

/// `Q8_0`: per 4-block group, the weight quants' absolute values and scales are
/// shared; per activation as in [`dot_q8_0_dx`].
#[target_feature(enable = "avx2,fma,f16c")]
fn multi_q8_0_t<const T: usize>(w: &[u8], row_bytes: usize, xs: &[&[u8]], outs: &mut [&mut [f32]]) {
    let xb: [&[[u8; Q8_0_BYTES]]; T] = std::array::from_fn(|t| xs[t].as_chunks::<Q8_0_BYTES>().0);
    let nb = xb[0].len();
    if nb > MAX_PRE_BLOCKS_Q8 || !nb.is_multiple_of(4) {
        for (x, o) in xs.iter().zip(outs.iter_mut()) {
            rows_q8_0(w, row_bytes, x, o);
        }
        return;
    }
    let mut dx = [[_mm_setzero_ps(); MAX_PRE_BLOCKS_Q8 / 4]; T];
    for (t, dt) in dx.iter_mut().enumerate() {
        for (i, d) in dt.iter_mut().enumerate().take(nb / 4) {
            *d = f16_of_4(&xb[t][4 * i..4 * i + 4]);
        }
    }
    for (r, row) in w.chunks_exact(row_bytes).enumerate() {
        let (wb, _) = row.as_chunks::<Q8_0_BYTES>();
        let mut acc = [_mm256_setzero_ps(); T];
        for (i, a) in wb.chunks_exact(4).enumerate() {
            let dw = f16_of_4(a);
            let d8: [__m256; T] = std::array::from_fn(|t| {
                let d4 = _mm_mul_ps(dw, dx[t][i]);
                _mm256_set_m128(d4, d4)
            });
            for k in 0..4 {
                let wq = ld256(&a[k], 2);
                let aw = _mm256_sign_epi8(wq, wq);
                for t in 0..T {
                    let d = match k {
                        0 => _mm256_permute_ps::<0x00>(d8[t]),
                        1 => _mm256_permute_ps::<0x55>(d8[t]),
                        2 => _mm256_permute_ps::<0xaa>(d8[t]),
                        _ => _mm256_permute_ps::<0xff>(d8[t]),
                    };
                    let sy = _mm256_sign_epi8(ld256(&xb[t][4 * i + k], 2), wq);
                    let q = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sy), _mm256_set1_epi16(1));
                    acc[t] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(q), acc[t]);
                }
            }
        }
        for t in 0..T {
            outs[t][r] = hsum_ps(acc[t]);
        }
    }
}

/// [`q4k_core`] for `T` activations, the nibbles decoded once.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q4k_core_t<const T: usize>(a: &[u8; Q4_K_BYTES], ys: [&[u8; Q8_K_BYTES]; T], sc: __m256i) -> [__m256i; T] {
    let m4 = _mm256_set1_epi8(0xf);
    let scale_pairs = [
        _mm256_shuffle_epi32::<0x00>(sc),
        _mm256_shuffle_epi32::<0x55>(sc),
        _mm256_shuffle_epi32::<0xaa>(sc),
        _mm256_shuffle_epi32::<0xff>(sc),
    ];
    let mut sumi = [_mm256_setzero_si256(); T];
    for (j, sj) in scale_pairs.into_iter().enumerate() {
        let bits = ld256(a, 16 + 32 * j);
        let lo = _mm256_and_si256(bits, m4);
        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(bits), m4);
        for t in 0..T {
            let pl = _mm256_maddubs_epi16(lo, ld256(ys[t], 4 + 64 * j));
            let ph = _mm256_maddubs_epi16(hi, ld256(ys[t], 4 + 64 * j + 32));
            let p = _mm256_add_epi16(_mm256_unpacklo_epi16(pl, ph), _mm256_unpackhi_epi16(pl, ph));
            sumi[t] = _mm256_add_epi32(sumi[t], _mm256_madd_epi16(p, sj));
        }
    }
    sumi
}

/// `Q4_K`: per two-block step, scales and nibbles decoded once; per activation
/// the integers and the two FMA chains of [`dot_q4_k_pairs`].
#[target_feature(enable = "avx2,fma,f16c")]
fn multi_q4_k_t<const T: usize>(w: &[u8], row_bytes: usize, xs: &[&[u8]], outs: &mut [&mut [f32]]) {
    let xb: [&[[u8; Q8_K_BYTES]]; T] = std::array::from_fn(|t| xs[t].as_chunks::<Q8_K_BYTES>().0);
    let nb = xb[0].len();
    if nb > MAX_PRE_BLOCKS || !nb.is_multiple_of(2) {
        for (x, o) in xs.iter().zip(outs.iter_mut()) {
            rows_q4_k(w, row_bytes, x, o);
        }
        return;
    }
    let mut pairs = [[_mm256_setzero_si256(); MAX_PRE_BLOCKS / 2]; T];
    for (t, pt) in pairs.iter_mut().enumerate() {
        for (i, p) in pt.iter_mut().enumerate().take(nb / 2) {
            *p = q8k_pair_sums2(xb[t], i);
        }
    }
    let zero = _mm256_setzero_si256();
    let perm = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
    for (r, row) in w.chunks_exact(row_bytes).enumerate() {
        let (wb, _) = row.as_chunks::<Q4_K_BYTES>();
        let (mut acc, mut accm) = ([0f32; T], [0f32; T]);
        for (i, a) in wb.chunks_exact(2).enumerate() {
            let (a0, a1) = (&a[0], &a[1]);
            prefetch_ahead::<{ 2 * Q4_K_BYTES }>(a0.as_ptr());
            let sm = k4_scales_mins2(a0, a1, 4);
            let sc = _mm256_unpacklo_epi8(sm, zero);
            let mn = _mm256_unpackhi_epi8(sm, zero);
            let s0 =
                q4k_core_t::<T>(a0, std::array::from_fn(|t| &xb[t][2 * i]), _mm256_permute2x128_si256::<0x00>(sc, sc));
            let s1 = q4k_core_t::<T>(
                a1,
                std::array::from_fn(|t| &xb[t][2 * i + 1]),
                _mm256_permute2x128_si256::<0x11>(sc, sc),
            );
            let (d0, m0) = f16x2_at(a0, 0);
            let (d1, m1) = f16x2_at(a1, 0);
            for t in 0..T {
                let mins = _mm256_madd_epi16(mn, pairs[t][i]);
                let m = _mm256_permutevar8x32_epi32(mins, perm);
                let h = _mm256_hadd_epi32(_mm256_hadd_epi32(s0[t], s1[t]), m);
                let v = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
                let (isum0, isum1) = (_mm_cvtsi128_si32(v), _mm_extract_epi32::<1>(v));
                let (imin0, imin1) = (_mm_extract_epi32::<2>(v), _mm_extract_epi32::<3>(v));
                let (dy0, dy1) = (f32_at(&xb[t][2 * i], 0), f32_at(&xb[t][2 * i + 1], 0));
                acc[t] = (isum0 as f32).mul_add(d0 * dy0, acc[t]);
                accm[t] = (imin0 as f32).mul_add(m0 * dy0, accm[t]);
                acc[t] = (isum1 as f32).mul_add(d1 * dy1, acc[t]);
                accm[t] = (imin1 as f32).mul_add(m1 * dy1, accm[t]);
            }
        }
        for t in 0..T {
            outs[t][r] = acc[t] - accm[t];
        }
    }
}

/// `Q6_K`: per half block the 6-bit quants and group scales decoded once; per
/// activation the lanes and FMAs of [`q6k_block`] / [`dot_q6_k`].
#[target_feature(enable = "avx2,fma,f16c")]
fn multi_q6_k_t<const T: usize>(w: &[u8], row_bytes: usize, xs: &[&[u8]], outs: &mut [&mut [f32]]) {
    let xb: [&[[u8; Q8_K_BYTES]]; T] = std::array::from_fn(|t| xs[t].as_chunks::<Q8_K_BYTES>().0);
    let m4 = _mm256_set1_epi8(0xf);
    let m30 = _mm256_set1_epi8(0x30);
    for (r, row) in w.chunks_exact(row_bytes).enumerate() {
        let (wb, _) = row.as_chunks::<Q6_K_BYTES>();
        let mut acc = [_mm256_setzero_ps(); T];
        for (b, a) in wb.iter().enumerate() {
            let scales = ld128(a, 192);
            let s16 = _mm256_cvtepi8_epi16(scales);
            let s16_lo = _mm256_permute2x128_si256::<0x00>(s16, s16);
            let s16_hi = _mm256_permute2x128_si256::<0x11>(s16, s16);
            let group_scales = |g: usize| {
                let (lo, hi) = ((4 * (g % 4)) as i8, (4 * (g % 4) + 2) as i8);
                let idx = _mm256_setr_epi8(
                    lo,
                    lo + 1,
                    lo,
                    lo + 1,
                    lo,
                    lo + 1,
                    lo,
                    lo + 1,
                    lo,
                    lo + 1,
                    lo,
                    lo + 1,
                    lo,
                    lo + 1,
                    lo,
                    lo + 1,
                    hi,
                    hi + 1,
                    hi,
                    hi + 1,
                    hi,
                    hi + 1,
                    hi,
                    hi + 1,
                    hi,
                    hi + 1,
                    hi,
                    hi + 1,
                    hi,
                    hi + 1,
                    hi,
                    hi + 1,
                );
                _mm256_shuffle_epi8(if g < 4 { s16_lo } else { s16_hi }, idx)
            };
            let mut sumi = [_mm256_setzero_si256(); T];
            for h in 0..2 {
                let l0 = ld256(a, 64 * h);
                let l1 = ld256(a, 64 * h + 32);
                let qh = ld256(a, 128 + 32 * h);
                let q = [
                    _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16::<4>(qh), m30)),
                    _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16::<2>(qh), m30)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(l0), m4), _mm256_and_si256(qh, m30)),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16::<4>(l1), m4),
                        _mm256_and_si256(_mm256_srli_epi16::<2>(qh), m30),
                    ),
                ];
                let gs =
                    [group_scales(4 * h), group_scales(4 * h + 1), group_scales(4 * h + 2), group_scales(4 * h + 3)];
                let base = 4 + 128 * h;
                for t in 0..T {
                    let y = &xb[t][b];
                    let p = |k: usize| _mm256_madd_epi16(gs[k], _mm256_maddubs_epi16(q[k], ld256(y, base + 32 * k)));
                    let (p0, p1, p2, p3) = (p(0), p(1), p(2), p(3));
                    sumi[t] = _mm256_add_epi32(sumi[t], _mm256_add_epi32(p0, p1));
                    sumi[t] = _mm256_add_epi32(sumi[t], _mm256_add_epi32(p2, p3));
                }
            }
            let dw = f16_at(a, 208);
            for t in 0..T {
                let y = &xb[t][b];
                let bias = _mm256_slli_epi32::<5>(_mm256_madd_epi16(s16, ld256(y, 260)));
                let d = f32_at(y, 0) * dw;
                acc[t] =
                    _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_sub_epi32(sumi[t], bias)), acc[t]);
            }
        }
        for t in 0..T {
            outs[t][r] = hsum_ps(acc[t]);
        }
    }
}

macro_rules! multi_entry {
    ($f:ident) => {{
        fn multi(w: &[u8], row_bytes: usize, xs: &[&[u8]], outs: &mut [&mut [f32]]) {
            // SAFETY: handed out by `multi_kernel` only after `available()` confirmed
            // AVX2, FMA and F16C on this CPU.
            unsafe {
                match xs.len() {
                    1 => $f::<1>(w, row_bytes, xs, outs),
                    2 => $f::<2>(w, row_bytes, xs, outs),
                    3 => $f::<3>(w, row_bytes, xs, outs),
                    _ => $f::<4>(w, row_bytes, xs, outs),
                }
            }
        }
        multi as super::MultiFn
    }};
}

/// The multi-activation kernel for `ty` (1 to [`MAX_MULTI`] activations per call),
/// if there is one. Callers must have checked [`available`].
pub(super) fn multi_kernel(ty: GgmlType) -> Option<super::Multi> {
    if !available() {
        return None;
    }
    let f = match ty {
        GgmlType::Q8_0 => multi_entry!(multi_q8_0_t),
        GgmlType::Q4_K => multi_entry!(multi_q4_k_t),
        GgmlType::Q6_K => multi_entry!(multi_q6_k_t),
        _ => return None,
    };
    Some(super::Multi { f, group: MAX_MULTI })
}
