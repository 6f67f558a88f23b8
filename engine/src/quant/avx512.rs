//! x86_64 AVX-512 kernels (F, BW, DQ, VL; VNNI for the integer dot products where present),
//! the kernel set of the `avx512` ISA level.
//!
//! # Numerics
//! Every kernel reproduces the float operations of the kernel that a llama.cpp build for
//! AVX-512 (`__AVX512F__`, with `__AVX512VNNI__`/`__AVX512BF16__` as the CPU has them) runs for
//! one token; the integer parts are exact, so any instruction sequence giving the same
//! integers is allowed:
//! * `F32`/`F16`: `ggml_vec_dot_f32`/`_f16` in ggml's AVX-512 shape (4 accumulators of 16
//!   lanes, 64-element steps, `GGML_F32x16_REDUCE`, GCC's `_mm512_reduce_add_ps`), unlike the
//!   AVX shape of the `avx2` level. `BF16`: `ggml_vec_dot_bf16` with `vdpbf16ps` when the CPU
//!   has AVX512-BF16, else its AVX512F shape.
//! * `Q8_0`, `Q5_K`, `Q6_K`: ggml's `__AVX2__` `ggml_vec_dot_*` lane layout (an AVX-512 build
//!   compiles the same code; with VNNI its `mul_sum_*` helpers use `vpdpbusd`, which gives the
//!   same integers): 8 i32 lanes per block, converted and accumulated with one FMA, one
//!   `hsum_float_8`. `Q4_K`: the repacked `ggml_gemv_q4_K_8x8_q8_K` order (whole-block
//!   integers, two FMA chains), as in the `avx2` kernels.
//! * Other types use the `avx2` kernels (same numerics at both levels).
//!
//! # Integer arithmetic
//! AVX-512 has no `vpsignb`, so the signed x signed `Q8_0` products use the offset trick:
//! `vpdpbusd(-128 * sum4(y), x ^ 0x80, y)` where `x ^ 0x80 = x + 128` is unsigned, which gives
//! exactly `sum4(x * y)` per i32 lane. The K-quants multiply their unsigned quants with the
//! activation in `vpmaddubsw` (no saturation for their ranges) and apply the sub-block scales
//! with `vpdpwssd`. A 512-bit vector holds two 32-element groups: two rows (`Q8_0` decode), two
//! tokens (`Q8_0` prompt), or 64 consecutive elements of one row (K-quants), whose lanes are
//! then folded onto ggml's 8.
//!
//! # Layout of the work
//! Decode (`matvec`): `Q8_0` takes two rows per vector; `Q4_K` eight rows per step, the
//! horizontal sums of the eight rows done together and the float chains kept in the lanes of
//! one vector (as ggml's repacked kernel does). Prompt processing (`matvec_multi`) decodes each
//! weight block once for up to [`MAX_MULTI`] tokens; every output element still gets exactly
//! the operations of the one-token kernel, so the results are bit-identical to `matvec`.
//!
//! Every kernel here is a safe `#[target_feature]` function; the only `unsafe` is in the loads
//! (bounds asserted) and in the wrappers handed out by [`kernel`] and [`multi_kernel`], which
//! exist only after [`available`] (and [`vnni`] or [`bf16`] for the kernels that need them)
//! confirmed the features.

use std::arch::x86_64::*;

use super::avx2;
use super::kquants::{Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES};
use super::q8::{Q8_0_BYTES, Q8_K_BYTES};
use super::{Backend, GgmlType, Kernel, Multi};

/// Whether the CPU has the `avx512` level's features (cached by std).
pub(super) fn available() -> bool {
    Backend::Avx512.is_available()
}

/// Whether the integer kernels here can run (AVX512-VNNI; otherwise the `avx2` ones are used).
pub(super) fn vnni() -> bool {
    available() && is_x86_feature_detected!("avx512vnni")
}

/// Whether `BF16` dot products use `vdpbf16ps`, as a build with `__AVX512BF16__` does.
pub(super) fn bf16() -> bool {
    available() && is_x86_feature_detected!("avx512bf16")
}

// ---------------------------------------------------------------------------
// Loads and small helpers
// ---------------------------------------------------------------------------

#[inline]
#[target_feature(enable = "avx512f")]
fn ld512<const N: usize>(b: &[u8; N], off: usize) -> __m512i {
    assert!(off + 64 <= N);
    // SAFETY: `off + 64 <= N` was just checked; `loadu` has no alignment requirement.
    unsafe { _mm512_loadu_si512(b.as_ptr().add(off).cast()) }
}

/// 32 bytes at `off`, in both 256-bit halves.
#[inline]
#[target_feature(enable = "avx512f,avx2")]
fn bcast256<const N: usize>(b: &[u8; N], off: usize) -> __m512i {
    _mm512_broadcast_i64x4(avx2::ld256(b, off))
}

/// `[lo | hi]`.
#[inline]
#[target_feature(enable = "avx512f")]
fn join256(lo: __m256i, hi: __m256i) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

/// ggml's `hsum_float_8` of each 256-bit half: `(lo, hi)`.
#[inline]
#[target_feature(enable = "avx512f,avx512dq,avx2")]
fn hsum8_halves(v: __m512) -> (f32, f32) {
    (avx2::hsum_ps(_mm512_castps512_ps256(v)), avx2::hsum_ps(_mm512_extractf32x8_ps::<1>(v)))
}

/// The i32 lanes `l` and `l + 8` added: ggml's 8 lanes from a vector of two 32-element groups.
#[inline]
#[target_feature(enable = "avx512f,avx512dq")]
fn fold_i32(v: __m512i) -> __m256i {
    _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v))
}

/// Word indices that broadcast word `a` to words 0..16 and word `b` to words 16..32.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn two_words(a: usize, b: usize) -> __m512i {
    let (a, b) = (a as i16, b as i16);
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(_mm256_set1_epi16(a)), _mm256_set1_epi16(b))
}

/// Lane `r` of the result: the sum of the 16 lanes of `v[r]` (eight sums done together).
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn hsum16x8(v: &[__m512i; 8]) -> __m256i {
    // Per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3].
    let pair = |a: __m512i, b: __m512i| _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
    // Per 128-bit lane: the lane sums of four vectors.
    let quad = |a: __m512i, b: __m512i| _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
    let u0 = quad(pair(v[0], v[1]), pair(v[2], v[3]));
    let u1 = quad(pair(v[4], v[5]), pair(v[6], v[7]));
    // Sum the four 128-bit lanes of u0 (vectors 0..4) and of u1 (vectors 4..8).
    let c =
        _mm512_add_epi32(_mm512_shuffle_i64x2::<0b10_00_10_00>(u0, u1), _mm512_shuffle_i64x2::<0b11_01_11_01>(u0, u1));
    let s = _mm512_add_epi32(_mm512_shuffle_i64x2::<0b10_00_10_00>(c, c), _mm512_shuffle_i64x2::<0b11_01_11_01>(c, c));
    _mm512_castsi512_si256(s)
}

/// Lane `r` of the result: the sum of the four i32 of 128-bit lane `r % 4` of `a` (`r < 4`)
/// or of `b` (`r >= 4`).
#[inline]
#[target_feature(enable = "avx512f")]
fn hsum4x8(a: __m512i, b: __m512i) -> __m256i {
    // Per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3], then [a, b, a, b].
    let t = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
    let t = _mm512_add_epi32(t, _mm512_shuffle_epi32::<0b01_00_11_10>(t));
    let idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm512_castsi512_si256(_mm512_permutexvar_epi32(idx, t))
}

/// Fills the first `n` entries of the stack buffer `buf` with `f(i)` and returns them (the
/// rest is left uninitialised: no clearing of the whole buffer per call).
fn prefix<T: Copy, const N: usize>(
    buf: &mut [std::mem::MaybeUninit<T>; N],
    n: usize,
    mut f: impl FnMut(usize) -> T,
) -> &[T] {
    assert!(n <= N, "prefix of {n} entries in a buffer of {N}");
    for (i, b) in buf[..n].iter_mut().enumerate() {
        b.write(f(i));
    }
    // SAFETY: entries 0..n were initialised just above; `MaybeUninit<T>` has `T`'s layout.
    unsafe { std::slice::from_raw_parts(buf.as_ptr().cast::<T>(), n) }
}

/// An uninitialised stack buffer for [`prefix`].
macro_rules! stack_buf {
    ($t:ty; $n:expr) => {
        [const { std::mem::MaybeUninit::<$t>::uninit() }; $n]
    };
}

// ---------------------------------------------------------------------------
// Floats
// ---------------------------------------------------------------------------

/// GCC's `_mm512_reduce_add_ps`: upper + lower 256 bits, then as `hsum_float_8`.
#[inline]
#[target_feature(enable = "avx512f,avx512dq,avx2")]
fn reduce_add_ps(v: __m512) -> f32 {
    avx2::hsum_ps(_mm256_add_ps(_mm512_extractf32x8_ps::<1>(v), _mm512_castps512_ps256(v)))
}

/// ggml's AVX-512 `ggml_vec_dot_f32`/`_f16` vector part: `GGML_F32_ARR = 4` accumulators of 16
/// lanes over 64-element steps (`sum[j] = fma(x, y, sum[j])`), `GGML_F32x16_REDUCE`
/// (`(s0 + s2) + (s1 + s3)`) and `_mm512_reduce_add_ps`. `load(bytes, element)` gives 16 floats.
/// Returns the sum and the number of elements consumed (the caller adds the tail as ggml).
#[inline]
#[target_feature(enable = "avx512f,avx512dq,avx2,fma")]
fn ggml_dot16(w: &[u8], x: &[u8], n: usize, load: impl Fn(&[u8], usize) -> __m512) -> (f32, usize) {
    let np = n - n % 64;
    let mut acc = [_mm512_setzero_ps(); 4];
    for i in (0..np).step_by(64) {
        for (j, a) in acc.iter_mut().enumerate() {
            *a = _mm512_fmadd_ps(load(w, i + 16 * j), load(x, i + 16 * j), *a);
        }
    }
    let s = _mm512_add_ps(_mm512_add_ps(acc[0], acc[2]), _mm512_add_ps(acc[1], acc[3]));
    (reduce_add_ps(s), np)
}

#[inline]
#[target_feature(enable = "avx512f")]
fn ld_f32x16(b: &[u8], i: usize) -> __m512 {
    assert!(4 * i + 64 <= b.len());
    // SAFETY: in bounds (checked above); `loadu` has no alignment requirement.
    unsafe { _mm512_loadu_ps(b.as_ptr().add(4 * i).cast()) }
}

#[inline]
#[target_feature(enable = "avx512f")]
fn ld_f16x16(b: &[u8], i: usize) -> __m512 {
    assert!(2 * i + 32 <= b.len());
    // SAFETY: in bounds (checked above); `loadu` has no alignment requirement.
    _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(b.as_ptr().add(2 * i).cast()) })
}

/// 16 bf16 at element `i`, widened to f32 (`bf16 << 16`).
#[inline]
#[target_feature(enable = "avx512f")]
fn ld_bf16x16(b: &[u8], i: usize) -> __m512 {
    assert!(2 * i + 32 <= b.len());
    // SAFETY: in bounds (checked above); `loadu` has no alignment requirement.
    let v = unsafe { _mm256_loadu_si256(b.as_ptr().add(2 * i).cast()) };
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(v)))
}

/// `ggml_vec_dot_f32` of an AVX-512 build: the vector sum in `f32`, the tail added with
/// `sumf += x*y` in `f32` (which GCC contracts to an FMA).
#[target_feature(enable = "avx512f,avx512dq,avx2,fma")]
fn dot_f32(w: &[u8], x: &[u8]) -> f32 {
    let n = w.len() / 4;
    let (mut sum, np) = ggml_dot16(w, x, n, |b, i| ld_f32x16(b, i));
    for (a, b) in w[4 * np..].chunks_exact(4).zip(x[4 * np..].chunks_exact(4)) {
        let a = f32::from_le_bytes([a[0], a[1], a[2], a[3]]);
        let b = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        sum = a.mul_add(b, sum);
    }
    sum
}

/// `ggml_vec_dot_f16` of an AVX-512 build (also with AVX512-FP16, whose dot product keeps f32
/// accumulators): the vector sum in `f32`, widened to `f64`, the tail's `f32` products added
/// in `f64`.
#[target_feature(enable = "avx512f,avx512dq,avx2,fma")]
fn dot_f16(w: &[u8], x: &[u8]) -> f32 {
    let n = w.len() / 2;
    let (sum, np) = ggml_dot16(w, x, n, |b, i| ld_f16x16(b, i));
    let mut sum = f64::from(sum);
    for (a, b) in w[2 * np..].chunks_exact(2).zip(x[2 * np..].chunks_exact(2)) {
        let a = super::f16_to_f32(u16::from_le_bytes([a[0], a[1]]));
        let b = super::f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
        sum += f64::from(a * b);
    }
    sum as f32
}

/// The `f64` tail of `ggml_vec_dot_bf16` from element `i`.
fn bf16_tail(w: &[u8], x: &[u8], i: usize, mut sum: f64) -> f32 {
    for (a, b) in w[2 * i..].chunks_exact(2).zip(x[2 * i..].chunks_exact(2)) {
        let a = super::float::bf16_bits_to_f32(u16::from_le_bytes([a[0], a[1]]));
        let b = super::float::bf16_bits_to_f32(u16::from_le_bytes([b[0], b[1]]));
        sum += f64::from(a * b);
    }
    sum as f32
}

/// `ggml_vec_dot_bf16` of an AVX512F build without AVX512-BF16: two 16-lane accumulators over
/// 32-element steps (`c += x*y`, contracted to an FMA), each reduced with
/// `_mm512_reduce_add_ps` and added to an `f64` sum; the tail in `f64`.
#[target_feature(enable = "avx512f,avx512dq,avx2,fma")]
pub(super) fn dot_bf16_f(w: &[u8], x: &[u8]) -> f32 {
    let n = w.len() / 2;
    let np = n - n % 32;
    let (mut c1, mut c2) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    for i in (0..np).step_by(32) {
        c1 = _mm512_fmadd_ps(ld_bf16x16(w, i), ld_bf16x16(x, i), c1);
        c2 = _mm512_fmadd_ps(ld_bf16x16(w, i + 16), ld_bf16x16(x, i + 16), c2);
    }
    let sum = f64::from(reduce_add_ps(c1)) + f64::from(reduce_add_ps(c2));
    bf16_tail(w, x, np, sum)
}

/// 32 bf16 at element `i` as a `__m512bh`.
#[inline]
#[target_feature(enable = "avx512f,avx512bf16")]
fn ld_bh(b: &[u8], i: usize) -> __m512bh {
    assert!(2 * i + 64 <= b.len());
    // SAFETY: in bounds (checked above); `loadu` has no alignment requirement. `__m512bh` is
    // 32 bf16 in the same 64 bytes as `__m512i`.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(b.as_ptr().add(2 * i).cast())) }
}

/// `ggml_vec_dot_bf16` of a build with AVX512-BF16: two `vdpbf16ps` accumulators over
/// 64-element steps, each reduced with `_mm512_reduce_add_ps` into an `f64` sum; the tail in
/// `f64`.
#[target_feature(enable = "avx512f,avx512dq,avx512bf16,avx2,fma")]
pub(super) fn dot_bf16_dp(w: &[u8], x: &[u8]) -> f32 {
    let n = w.len() / 2;
    let np = n - n % 64;
    let (mut c1, mut c2) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    for i in (0..np).step_by(64) {
        c1 = _mm512_dpbf16_ps(c1, ld_bh(w, i), ld_bh(x, i));
        c2 = _mm512_dpbf16_ps(c2, ld_bh(w, i + 32), ld_bh(x, i + 32));
    }
    let sum = f64::from(reduce_add_ps(c1)) + f64::from(reduce_add_ps(c2));
    bf16_tail(w, x, np, sum)
}

// ---------------------------------------------------------------------------
// Q8_0
// ---------------------------------------------------------------------------

/// Blocks up to which the `Q8_0` row loops keep per-activation data on the stack (16384
/// columns); longer rows use the `avx2` kernel (same numerics).
const MAX_PRE_BLOCKS_Q8: usize = 512;

/// `-128 * sum4(y)` per i32 lane of one `Q8_0` activation block: the correction of the
/// `x ^ 0x80` offset trick (module docs).
#[inline]
#[target_feature(enable = "avx512f,avx512vl,avx512vnni,avx2")]
fn q8_0_offset(y: &[u8; Q8_0_BYTES]) -> __m256i {
    let s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(-128), avx2::ld256(y, 2));
    _mm256_sub_epi32(_mm256_setzero_si256(), s)
}

/// The f16 scales of blocks `4i..4i+4` of rows `a` and `b`, as `[a0 a1 a2 a3 b0 b1 b2 b3]`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn f16_scales_2x4(a: &[[u8; Q8_0_BYTES]], b: &[[u8; Q8_0_BYTES]], i: usize) -> __m256 {
    let h = |r: &[[u8; Q8_0_BYTES]], k: usize| u16::from_le_bytes([r[4 * i + k][0], r[4 * i + k][1]]) as i16;
    _mm256_cvtph_ps(_mm_setr_epi16(h(a, 0), h(a, 1), h(a, 2), h(a, 3), h(b, 0), h(b, 1), h(b, 2), h(b, 3)))
}

/// Indices that take element `k` to lanes 0..8 and element `4 + k` to lanes 8..16.
#[inline]
#[target_feature(enable = "avx512f")]
fn lanes_k_4k(k: i32) -> __m512i {
    _mm512_setr_epi32(k, k, k, k, k, k, k, k, 4 + k, 4 + k, 4 + k, 4 + k, 4 + k, 4 + k, 4 + k, 4 + k)
}

/// `Q8_0 x Q8_0` for two rows at once (lower and upper half of each vector), each in ggml's
/// `ggml_vec_dot_q8_0_q8_0` order: per block `acc = fma(d_w * d_x, sum4 lanes, acc)`, one
/// `hsum_float_8` per row. `off[b]`, `dx[i]` are the activation's precomputed offsets and
/// scales (`[dx(4i..4i+4) | same]`).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn q8_0_two_rows(
    ra: &[[u8; Q8_0_BYTES]],
    rb: &[[u8; Q8_0_BYTES]],
    xb: &[[u8; Q8_0_BYTES]],
    off: &[__m256i],
    dx: &[__m256],
) -> (f32, f32) {
    let flip = _mm512_set1_epi8(-128);
    let mut acc = _mm512_setzero_ps();
    let nb = xb.len();
    let block = |b: usize, d: __m512, acc: __m512| {
        let w = _mm512_xor_si512(join256(avx2::ld256(&ra[b], 2), avx2::ld256(&rb[b], 2)), flip);
        let s = _mm512_dpbusd_epi32(_mm512_broadcast_i64x4(off[b]), w, bcast256(&xb[b], 2));
        _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(s), acc)
    };
    for (i, dxi) in dx.iter().enumerate() {
        let d8 = _mm512_castps256_ps512(_mm256_mul_ps(f16_scales_2x4(ra, rb, i), *dxi));
        for k in 0..4 {
            acc = block(4 * i + k, _mm512_permutexvar_ps(lanes_k_4k(k as i32), d8), acc);
        }
    }
    for b in nb / 4 * 4..nb {
        let dy = avx2::f16_at(&xb[b], 0);
        let d = _mm512_insertf32x8::<1>(
            _mm512_set1_ps(avx2::f16_at(&ra[b], 0) * dy),
            _mm256_set1_ps(avx2::f16_at(&rb[b], 0) * dy),
        );
        acc = block(b, d, acc);
    }
    hsum8_halves(acc)
}

#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn rows_q8_0(w: &[u8], row_bytes: usize, x: &[u8], out: &mut [f32]) {
    let (xb, _) = x.as_chunks::<Q8_0_BYTES>();
    let nb = xb.len();
    if nb > MAX_PRE_BLOCKS_Q8 {
        return avx2::rows_q8_0(w, row_bytes, x, out);
    }
    let mut off_buf = stack_buf![__m256i; MAX_PRE_BLOCKS_Q8];
    let off = prefix(&mut off_buf, nb, |b| q8_0_offset(&xb[b]));
    let mut dx_buf = stack_buf![__m256; MAX_PRE_BLOCKS_Q8 / 4];
    let dx = prefix(&mut dx_buf, nb / 4, |i| {
        let d4 = avx2::f16_of_4(&xb[4 * i..4 * i + 4]);
        _mm256_set_m128(d4, d4)
    });
    let row = |r: usize| w[r * row_bytes..(r + 1) * row_bytes].as_chunks::<Q8_0_BYTES>().0;
    let n = out.len();
    for r in (0..n).step_by(2) {
        // An odd last row is paired with itself.
        let r1 = (r + 1).min(n - 1);
        let (a, b) = q8_0_two_rows(row(r), row(r1), xb, off, dx);
        out[r] = a;
        out[r1] = if r1 == r { a } else { b };
    }
}

/// Activations per pass of the multi-activation kernels, at most (`Q4_K`; the others take 8).
pub(super) const MAX_MULTI: usize = 16;

/// Per-thread buffers of the multi-activation kernels' prepared activations: taken at the start
/// of a call and put back at its end, so they grow to the largest call once and are then reused
/// (no allocation per call).
#[derive(Default)]
struct Scratch {
    /// `Q8_0`: per (pair, block), the quants, the offset correction and the scales.
    q8: Vec<(__m512i, __m512i, __m512)>,
    /// `Q8_0`: the row's block scales.
    dw: Vec<f32>,
    /// `Q4_K`: per (block, group of 8), the pair sums of activations 0..4 and 4..8 of the group
    /// (128-bit lanes) and the 8 activations' scales.
    q4k: Vec<(__m512i, __m512i, __m256)>,
    /// `Q6_K`: per (pair, block), both activations' bsums and scales, half by half.
    q6k: Vec<(__m512i, __m512)>,
    /// K-quants: the activations' `Q8_K` blocks block-major (entry `b * T + t`).
    ys: Vec<[u8; Q8_K_BYTES]>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

/// Takes this thread's scratch (an empty one if a call on this thread holds it).
fn take_scratch() -> Scratch {
    SCRATCH.with(|c| std::mem::take(&mut *c.borrow_mut()))
}

fn put_scratch(s: Scratch) {
    SCRATCH.with(|c| *c.borrow_mut() = s);
}

/// `v` refilled with `f(0..n)`; no allocation once `v` has the capacity.
fn refill<T>(v: &mut Vec<T>, n: usize, f: impl FnMut(usize) -> T) -> &[T] {
    v.clear();
    v.extend((0..n).map(f));
    v
}

/// `Q8_0` for `T` activations, two per vector (lower half: activation `2p`, upper: `2p + 1`),
/// in the lanes and order of [`q8_0_two_rows`] (whose halves are rows instead). Here the
/// weight is the unsigned operand (`w ^ 0x80`, once per block for all pairs) and each
/// activation pair brings its own correction `-128 * sum4(y)` and scales, prepared once per
/// call; per pair and block that leaves one `vpdpbusd`, one scale product, one conversion and
/// one FMA.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn multi_q8_0_t<const T: usize>(w: &[u8], row_bytes: usize, xs: &[&[u8]], outs: &mut [&mut [f32]]) {
    let xb: [&[[u8; Q8_0_BYTES]]; T] = std::array::from_fn(|t| xs[t].as_chunks::<Q8_0_BYTES>().0);
    let nb = xb[0].len();
    const P: usize = MAX_MULTI / 2;
    let pairs = T.div_ceil(2);
    // Pair p holds activations 2p (lower half) and 2p + 1 (upper; 2p again when T is odd).
    let tok = |p: usize, h: usize| (2 * p + h).min(T - 1);
    let flip = _mm512_set1_epi8(-128);
    let mut scratch = take_scratch();
    let pre = refill(&mut scratch.q8, pairs * nb, |i| {
        let (p, blk) = (i / nb, i % nb);
        let (a, b) = (&xb[tok(p, 0)][blk], &xb[tok(p, 1)][blk]);
        let dx = _mm512_insertf32x8::<1>(_mm512_set1_ps(avx2::f16_at(a, 0)), _mm256_set1_ps(avx2::f16_at(b, 0)));
        (join256(avx2::ld256(a, 2), avx2::ld256(b, 2)), join256(q8_0_offset(a), q8_0_offset(b)), dx)
    });
    scratch.dw.resize(nb, 0.0);
    let dw = &mut scratch.dw[..nb];
    for (r, row) in w.chunks_exact(row_bytes).enumerate() {
        let (wb, _) = row.as_chunks::<Q8_0_BYTES>();
        let mut g4 = wb.chunks_exact(4);
        for (d4, b4) in dw.chunks_exact_mut(4).zip(&mut g4) {
            // SAFETY: `d4` is 4 in-bounds f32; `storeu` has no alignment requirement.
            unsafe { _mm_storeu_ps(d4.as_mut_ptr(), avx2::f16_of_4(b4)) };
        }
        for (d, b) in dw[nb / 4 * 4..].iter_mut().zip(g4.remainder()) {
            *d = avx2::f16_at(b, 0);
        }
        let mut acc = [_mm512_setzero_ps(); P];
        for (blk, (a, &d)) in wb.iter().zip(dw.iter()).enumerate() {
            let wu = _mm512_xor_si512(bcast256(a, 2), flip);
            let d = _mm512_set1_ps(d);
            for (p, accp) in acc.iter_mut().enumerate().take(pairs) {
                let (y, off, dx) = pre[p * nb + blk];
                let s = _mm512_dpbusd_epi32(off, wu, y);
                *accp = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(s), *accp);
            }
        }
        for (p, accp) in acc.iter().enumerate().take(pairs) {
            let (a, b) = hsum8_halves(*accp);
            outs[tok(p, 0)][r] = a;
            if tok(p, 1) != tok(p, 0) {
                outs[tok(p, 1)][r] = b;
            }
        }
    }
    put_scratch(scratch);
}

// ---------------------------------------------------------------------------
// K-quants: shared pieces
// ---------------------------------------------------------------------------

/// [`avx2::k4_scales_mins`] of four blocks at once (128-bit lane `i`: `blocks[i]`): per lane
/// `[scales(8) | mins(8)]` as u8.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2")]
fn k4_scales_mins4<const N: usize>(blocks: [&[u8; N]; 4], off: usize) -> __m512i {
    let v = _mm512_inserti32x4::<1>(_mm512_castsi128_si512(avx2::ld128(blocks[0], off)), avx2::ld128(blocks[1], off));
    let v = _mm512_inserti32x4::<2>(v, avx2::ld128(blocks[2], off));
    let v = _mm512_inserti32x4::<3>(v, avx2::ld128(blocks[3], off));
    let lane = |x: __m128i| _mm512_broadcast_i32x4(x);
    let lo = _mm512_and_si512(
        _mm512_shuffle_epi8(v, lane(_mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, -1, -1, -1, -1))),
        lane(_mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0)),
    );
    let nib_hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), _mm512_set1_epi8(0x0f));
    let nib_hi =
        _mm512_shuffle_epi8(nib_hi, lane(_mm_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 8, 9, 10, 11)));
    let top = _mm512_srli_epi16::<2>(_mm512_and_si512(v, _mm512_set1_epi8(0xc0u8 as i8)));
    let top = _mm512_shuffle_epi8(top, lane(_mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7)));
    _mm512_or_si512(_mm512_or_si512(lo, nib_hi), top)
}

/// The 64 nibble quants of chunk `c` of a `Q4_K`/`Q5_K` block whose `qs` start at `qs`:
/// elements `64c..64c + 64` in order (low nibbles, then high nibbles).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2")]
fn nibbles64<const N: usize>(a: &[u8; N], qs: usize, c: usize) -> __m512i {
    let shift = _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi16(4));
    _mm512_and_si512(_mm512_srlv_epi16(bcast256(a, qs + 32 * c), shift), _mm512_set1_epi8(0x0f))
}

/// `vpdpwssd`: `acc + (a[2i]*b[2i] + a[2i+1]*b[2i+1])` per i32 lane. Through `asm!` because
/// LLVM, tuning for no particular CPU, splits `_mm512_dpwssd_epi32` into `vpmaddwd` + `vpaddd`
/// (one more instruction on the two 512-bit ports).
#[inline]
#[target_feature(enable = "avx512f,avx512vnni")]
fn dpwssd(acc: __m512i, a: __m512i, b: __m512i) -> __m512i {
    let mut acc = acc;
    // SAFETY: `vpdpwssd` only reads and writes the three registers; the function's target
    // features (checked by every caller's entry point) include AVX512-VNNI.
    unsafe {
        std::arch::asm!(
            "vpdpwssd {acc}, {a}, {b}",
            acc = inout(zmm_reg) acc,
            a = in(zmm_reg) a,
            b = in(zmm_reg) b,
            options(pure, nomem, nostack, preserves_flags),
        );
    }
    acc
}

/// The scale vectors of the four 64-element chunks of a nibble-quant block: chunk `c`'s words
/// 0..16 hold scale `2c`, words 16..32 scale `2c + 1`; `sc` holds the 8 scales as words
/// `8L..8L+8` of the 128-bit lane `L`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn k4_scale_vectors(sc: __m512i, lane: usize) -> [__m512i; 4] {
    std::array::from_fn(|c| _mm512_permutexvar_epi16(two_words(8 * lane + 2 * c, 8 * lane + 2 * c + 1), sc))
}

/// `sum_j scale_j * dot_j` over the four 64-element chunks of a nibble-quant block, as 16 i32
/// lanes (lanes `l` and `l + 8` of chunk `c` belong to sub-blocks `2c` and `2c + 1`); `q(c)`
/// gives chunk `c`'s quants, `s` the scale vectors of [`k4_scale_vectors`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
fn k4_int(q: impl Fn(usize) -> __m512i, y: &[u8; Q8_K_BYTES], s: &[__m512i; 4]) -> __m512i {
    let mut acc = _mm512_setzero_si512();
    for (c, sc) in s.iter().enumerate() {
        acc = dpwssd(acc, _mm512_maddubs_epi16(q(c), ld512(y, 4 + 64 * c)), *sc);
    }
    acc
}

/// The d and dmin (f16 at offset 0) of eight blocks, as f32 lanes `[d0..d8]`, `[m0..m8]`.
#[inline]
#[target_feature(enable = "avx512f,avx2")]
fn dmins8<const N: usize>(blocks: [&[u8; N]; 8]) -> (__m256, __m256) {
    let u = |i: usize| avx2::ld_u32(blocks[i], 0) as i32;
    let h = _mm256_setr_epi32(u(0), u(1), u(2), u(3), u(4), u(5), u(6), u(7));
    let v = _mm512_cvtph_ps(h);
    let d = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0), v);
    let m = _mm512_permutexvar_ps(_mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 0, 0, 0, 0, 0, 0, 0, 0), v);
    (_mm512_castps512_ps256(d), _mm512_castps512_ps256(m))
}

// ---------------------------------------------------------------------------
// Q4_K
// ---------------------------------------------------------------------------

/// `Q4_K x Q8_K` for eight rows, in the order of llama.cpp's repacked
/// `ggml_gemv_q4_K_8x8_q8_K` (which processes 8 rows per step the same way): per block, each
/// row's whole integer `isum = sum_j scale_j * dot_j` and `imin = sum_j min_j * bsum_j`, then
/// per row (one f32 lane each) `acc = fma(isum, d*dy, acc)`, `accm = fma(imin, dmin*dy, accm)`;
/// the result is `acc - accm`.
/// `w` holds the eight rows (stride `row_bytes`) from their first block.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn q4_k_eight_rows(w: &[u8], row_bytes: usize, xb: &[[u8; Q8_K_BYTES]]) -> __m256 {
    assert!(w.len() >= 7 * row_bytes + xb.len() * Q4_K_BYTES);
    let zero = _mm512_setzero_si512();
    let (mut acc, mut accm) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    for (b, y) in xb.iter().enumerate() {
        let blk = |r: usize| -> &[u8; Q4_K_BYTES] {
            let off = r * row_bytes + b * Q4_K_BYTES;
            w[off..off + Q4_K_BYTES].try_into().expect("a Q4_K block")
        };
        let x = [ld512(y, 4), ld512(y, 68), ld512(y, 132), ld512(y, 196)];
        // Pair sums of the activation's bsums (8 words), in every 128-bit lane.
        let ps = _mm512_broadcast_i32x4(avx2::q8k_pair_sums(y));
        let sm0 = k4_scales_mins4([blk(0), blk(1), blk(2), blk(3)], 4);
        let sm1 = k4_scales_mins4([blk(4), blk(5), blk(6), blk(7)], 4);
        let imin0 = _mm512_madd_epi16(_mm512_unpackhi_epi8(sm0, zero), ps);
        let imin1 = _mm512_madd_epi16(_mm512_unpackhi_epi8(sm1, zero), ps);
        let (sc0, sc1) = (_mm512_unpacklo_epi8(sm0, zero), _mm512_unpacklo_epi8(sm1, zero));
        let row = |r: usize| {
            let (a, sc, lane) = (blk(r), if r < 4 { sc0 } else { sc1 }, r % 4);
            let mut acc = zero;
            for (c, xc) in x.iter().enumerate() {
                let s = _mm512_permutexvar_epi16(two_words(8 * lane + 2 * c, 8 * lane + 2 * c + 1), sc);
                acc = dpwssd(acc, _mm512_maddubs_epi16(nibbles64(a, 16, c), *xc), s);
            }
            acc
        };
        let isum = [row(0), row(1), row(2), row(3), row(4), row(5), row(6), row(7)];
        let isum = _mm256_cvtepi32_ps(hsum16x8(&isum));
        let imin = _mm256_cvtepi32_ps(hsum4x8(imin0, imin1));
        let dy = _mm256_set1_ps(avx2::f32_at(y, 0));
        let (d, dmin) = dmins8([blk(0), blk(1), blk(2), blk(3), blk(4), blk(5), blk(6), blk(7)]);
        acc = _mm256_fmadd_ps(isum, _mm256_mul_ps(d, dy), acc);
        accm = _mm256_fmadd_ps(imin, _mm256_mul_ps(dmin, dy), accm);
    }
    _mm256_sub_ps(acc, accm)
}

#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn rows_q4_k(w: &[u8], row_bytes: usize, x: &[u8], out: &mut [f32]) {
    let (xb, _) = x.as_chunks::<Q8_K_BYTES>();
    let full = out.len() / 8 * 8;
    for g in (0..full).step_by(8) {
        let v = q4_k_eight_rows(&w[g * row_bytes..(g + 8) * row_bytes], row_bytes, xb);
        // SAFETY: `out[g..g + 8]` is in bounds (`g + 8 <= full <= out.len()`).
        unsafe { _mm256_storeu_ps(out[g..g + 8].as_mut_ptr(), v) };
    }
    // The same order row by row for the rest.
    avx2::rows_q4_k(&w[full * row_bytes..], row_bytes, x, &mut out[full..]);
}

/// The `T` activations' `Q8_K` blocks block-major (entry `b * T + t` is block `b` of activation
/// `t`), copied into `buf`: the hot loops then address one slice instead of `T`.
fn block_major<'a, const T: usize>(
    xb: &[&[[u8; Q8_K_BYTES]]; T],
    buf: &'a mut Vec<[u8; Q8_K_BYTES]>,
) -> &'a [[u8; Q8_K_BYTES]] {
    refill(buf, xb[0].len() * T, |i| xb[i % T][i / T])
}

/// `Q4_K` for `T <= 16` activations: per block, the scales of the row are decoded once and its
/// nibbles once per chunk; the integers of each group of 8 activations are summed together (as
/// the eight rows of [`q4_k_eight_rows`]) and their float chains kept in the lanes of one
/// vector per group.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn multi_q4_k_t<const T: usize>(w: &[u8], row_bytes: usize, xs: &[&[u8]], outs: &mut [&mut [f32]]) {
    let xb: [&[[u8; Q8_K_BYTES]]; T] = std::array::from_fn(|t| xs[t].as_chunks::<Q8_K_BYTES>().0);
    let nb = xb[0].len();
    let zero = _mm512_setzero_si512();
    let tok = |t: usize| t.min(T - 1);
    let groups = T.div_ceil(8);
    let mut scratch = take_scratch();
    let pre = refill(&mut scratch.q4k, nb * groups, |i| {
        let (b, g) = (i / groups, 8 * (i % groups));
        let ps = |t0: usize| {
            let v = _mm512_castsi128_si512(avx2::q8k_pair_sums(&xb[tok(t0)][b]));
            let v = _mm512_inserti32x4::<1>(v, avx2::q8k_pair_sums(&xb[tok(t0 + 1)][b]));
            let v = _mm512_inserti32x4::<2>(v, avx2::q8k_pair_sums(&xb[tok(t0 + 2)][b]));
            _mm512_inserti32x4::<3>(v, avx2::q8k_pair_sums(&xb[tok(t0 + 3)][b]))
        };
        let dy = |t: usize| avx2::f32_at(&xb[tok(g + t)][b], 0);
        (ps(g), ps(g + 4), _mm256_setr_ps(dy(0), dy(1), dy(2), dy(3), dy(4), dy(5), dy(6), dy(7)))
    });
    let ys = block_major(&xb, &mut scratch.ys);
    for (r, row) in w.chunks_exact(row_bytes).enumerate() {
        let (wb, _) = row.as_chunks::<Q4_K_BYTES>();
        let (mut acc, mut accm) = ([_mm256_setzero_ps(); 2], [_mm256_setzero_ps(); 2]);
        for ((a, pb), yb) in wb.iter().zip(pre.chunks_exact(groups)).zip(ys.chunks_exact(T)) {
            let sm = avx2::k4_scales_mins(a, 4);
            let scv = k4_scale_vectors(_mm512_castsi128_si512(_mm_cvtepu8_epi16(sm)), 0);
            let mins = _mm512_broadcast_i32x4(_mm_cvtepu8_epi16(_mm_unpackhi_epi64(sm, sm)));
            let q: [__m512i; 4] = std::array::from_fn(|c| nibbles64(a, 16, c));
            let (d, dmin) = avx2::f16x2_at(a, 0);
            for (g, &(ps0, ps1, dy)) in pb.iter().enumerate() {
                let mut isum = [zero; 8];
                for (s, y) in isum.iter_mut().zip(&yb[8 * g..]) {
                    *s = k4_int(|c| q[c], y, &scv);
                }
                let imin0 = _mm512_madd_epi16(mins, ps0);
                let imin1 = if T > 8 * g + 4 { _mm512_madd_epi16(mins, ps1) } else { zero };
                let isum = _mm256_cvtepi32_ps(hsum16x8(&isum));
                let imin = _mm256_cvtepi32_ps(hsum4x8(imin0, imin1));
                acc[g] = _mm256_fmadd_ps(isum, _mm256_mul_ps(_mm256_set1_ps(d), dy), acc[g]);
                accm[g] = _mm256_fmadd_ps(imin, _mm256_mul_ps(_mm256_set1_ps(dmin), dy), accm[g]);
            }
        }
        let mut v = [0f32; 16];
        for g in 0..groups {
            // SAFETY: `v[8g..8g + 8]` is 8 in-bounds floats (`g < 2`); no alignment needed.
            unsafe { _mm256_storeu_ps(v[8 * g..8 * g + 8].as_mut_ptr(), _mm256_sub_ps(acc[g], accm[g])) };
        }
        for (t, o) in outs.iter_mut().enumerate().take(T) {
            o[r] = v[t];
        }
    }
    put_scratch(scratch);
}

// ---------------------------------------------------------------------------
// Q5_K
// ---------------------------------------------------------------------------

/// The 64 quants of chunk `c` of a `Q5_K` block (elements `64c..64c + 64`): nibbles plus the
/// high bit (bit `2c` of `qh[l]` for the low half, `2c + 1` for the high half) as bit 4.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2")]
fn q5_k_quants(a: &[u8; Q5_K_BYTES], qh: __m512i, c: usize) -> __m512i {
    let shift = join256(_mm256_set1_epi16(2 * c as i16), _mm256_set1_epi16(2 * c as i16 + 1));
    let hi = _mm512_and_si512(_mm512_slli_epi16::<4>(_mm512_srlv_epi16(qh, shift)), _mm512_set1_epi8(0x10));
    _mm512_or_si512(nibbles64(a, 48, c), hi)
}

/// One `Q5_K` block against one activation in ggml's lane layout: the 8 i32 lanes
/// `sum_j scale_j * (products 4l..4l+3 of sub-block j)` (see `avx2::dot_q5_k`).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vnni,avx2")]
fn q5_k_lanes(q: &[__m512i; 4], y: &[u8; Q8_K_BYTES], scv: &[__m512i; 4]) -> __m256i {
    fold_i32(k4_int(|c| q[c], y, scv))
}

/// `Q5_K x Q8_K` in ggml's x86 order (`ggml_vec_dot_q5_K_q8_K`): per block
/// `acc = fma(dy*d, lanes, acc)` and `summs = fma(-dy*dmin, imin, summs)`; the result is
/// `hsum_float_8(acc) + summs`.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn dot_q5_k(w: &[u8], x: &[u8]) -> f32 {
    let (wb, _) = w.as_chunks::<Q5_K_BYTES>();
    let (xb, _) = x.as_chunks::<Q8_K_BYTES>();
    let zero = _mm512_setzero_si512();
    let mut acc = _mm256_setzero_ps();
    let mut summs = 0f32;
    for (a, y) in wb.iter().zip(xb) {
        let sm = _mm512_castsi128_si512(avx2::k4_scales_mins(a, 4));
        let scv = k4_scale_vectors(_mm512_unpacklo_epi8(sm, zero), 0);
        let imin = avx2::hsum_epi32_128(_mm_madd_epi16(
            _mm512_castsi512_si128(_mm512_unpackhi_epi8(sm, zero)),
            avx2::q8k_pair_sums(y),
        ));
        let dy = avx2::f32_at(y, 0);
        let (d, dmin) = avx2::f16x2_at(a, 0);
        summs = (-dy * dmin).mul_add(imin as f32, summs);
        let qh = bcast256(a, 16);
        let q: [__m512i; 4] = std::array::from_fn(|c| q5_k_quants(a, qh, c));
        let lanes = q5_k_lanes(&q, y, &scv);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(dy * d), _mm256_cvtepi32_ps(lanes), acc);
    }
    avx2::hsum_ps(acc) + summs
}

/// `Q5_K` for `T` activations: the block's quants and scales decoded once, then per activation
/// the lanes and float operations of [`dot_q5_k`].
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn multi_q5_k_t<const T: usize>(w: &[u8], row_bytes: usize, xs: &[&[u8]], outs: &mut [&mut [f32]]) {
    let xb: [&[[u8; Q8_K_BYTES]]; T] = std::array::from_fn(|t| xs[t].as_chunks::<Q8_K_BYTES>().0);
    let zero = _mm512_setzero_si512();
    for (r, row) in w.chunks_exact(row_bytes).enumerate() {
        let (wb, _) = row.as_chunks::<Q5_K_BYTES>();
        let mut acc = [_mm256_setzero_ps(); T];
        let mut summs = [0f32; T];
        for (b, a) in wb.iter().enumerate() {
            let sm = _mm512_castsi128_si512(avx2::k4_scales_mins(a, 4));
            let scv = k4_scale_vectors(_mm512_unpacklo_epi8(sm, zero), 0);
            let mins = _mm512_castsi512_si128(_mm512_unpackhi_epi8(sm, zero));
            let (d, dmin) = avx2::f16x2_at(a, 0);
            let qh = bcast256(a, 16);
            let q: [__m512i; 4] = std::array::from_fn(|c| q5_k_quants(a, qh, c));
            for t in 0..T {
                let y = &xb[t][b];
                let imin = avx2::hsum_epi32_128(_mm_madd_epi16(mins, avx2::q8k_pair_sums(y)));
                let dy = avx2::f32_at(y, 0);
                summs[t] = (-dy * dmin).mul_add(imin as f32, summs[t]);
                let lanes = q5_k_lanes(&q, y, &scv);
                acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dy * d), _mm256_cvtepi32_ps(lanes), acc[t]);
            }
        }
        for t in 0..T {
            outs[t][r] = avx2::hsum_ps(acc[t]) + summs[t];
        }
    }
}

// ---------------------------------------------------------------------------
// Q6_K
// ---------------------------------------------------------------------------

/// The 256 quants of a `Q6_K` block (unsigned, `q + 32`), 64 consecutive elements per vector.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2")]
fn q6_k_quants(a: &[u8; Q6_K_BYTES]) -> [__m512i; 4] {
    let m4 = _mm512_set1_epi8(0x0f);
    let m30 = _mm512_set1_epi8(0x30);
    let mut q = [_mm512_setzero_si512(); 4];
    for h in 0..2 {
        // ql[64h..64h+64]: low nibbles are elements 128h + 0..64, high nibbles 128h + 64..128.
        let l = ld512(a, 64 * h);
        // qh[32h..32h+32]: bits 0-1, 2-3, 4-5, 6-7 are the top bits of the four 32-element
        // groups; 16-bit shifts move bits across bytes, but the 0x30 mask keeps only bits that
        // stayed inside their byte.
        let qh = bcast256(a, 128 + 32 * h);
        let up = _mm512_sllv_epi16(qh, join256(_mm256_set1_epi16(4), _mm256_set1_epi16(2)));
        let down = _mm512_srlv_epi16(qh, join256(_mm256_setzero_si256(), _mm256_set1_epi16(2)));
        q[2 * h] = _mm512_or_si512(_mm512_and_si512(l, m4), _mm512_and_si512(up, m30));
        q[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16::<4>(l), m4), _mm512_and_si512(down, m30));
    }
    q
}

/// The i16 scales of a `Q6_K` block for each quant vector of [`q6_k_quants`]: vector `k` covers
/// sub-blocks `4k..4k+4`, 8 words each.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2")]
fn q6_k_scales(s16: __m256i) -> [__m512i; 4] {
    let s = _mm512_castsi256_si512(s16);
    std::array::from_fn(|k| {
        let k = 4 * k as i16;
        let idx = _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(join128(_mm_set1_epi16(k), _mm_set1_epi16(k + 1))),
            join128(_mm_set1_epi16(k + 2), _mm_set1_epi16(k + 3)),
        );
        _mm512_permutexvar_epi16(idx, s)
    })
}

#[inline]
#[target_feature(enable = "avx2")]
fn join128(lo: __m128i, hi: __m128i) -> __m256i {
    _mm256_set_m128i(hi, lo)
}

/// One `Q6_K` block against one activation in ggml's lane layout (`avx2::q6k_block`): lane `l`
/// sums, over the eight 32-element groups, `scale * (products 4l..4l+3 of the group)`, minus
/// the `-32` bias `32 * (bsums[2l]*sc[2l] + bsums[2l+1]*sc[2l+1])`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vnni,avx2")]
fn q6_k_lanes(q: &[__m512i; 4], sc: &[__m512i; 4], s16: __m256i, y: &[u8; Q8_K_BYTES]) -> __m256i {
    let bias = _mm256_slli_epi32::<5>(_mm256_madd_epi16(s16, avx2::ld256(y, 260)));
    _mm256_sub_epi32(fold_i32(q6_k_int(q, sc, y)), bias)
}

/// The scaled products of a `Q6_K` block as 16 i32 lanes: lanes `l` and `l + 8` are lane `l`
/// of two 32-element groups.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
fn q6_k_int(q: &[__m512i; 4], sc: &[__m512i; 4], y: &[u8; Q8_K_BYTES]) -> __m512i {
    let mut acc = _mm512_setzero_si512();
    for k in 0..4 {
        acc = dpwssd(acc, _mm512_maddubs_epi16(q[k], ld512(y, 4 + 64 * k)), sc[k]);
    }
    acc
}

/// `Q6_K x Q8_K` in ggml's x86 order: per block `acc = fma(dy*d, lanes, acc)`, one
/// `hsum_float_8` at the end.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn dot_q6_k(w: &[u8], x: &[u8]) -> f32 {
    let (wb, _) = w.as_chunks::<Q6_K_BYTES>();
    let (xb, _) = x.as_chunks::<Q8_K_BYTES>();
    let mut acc = _mm256_setzero_ps();
    for (a, y) in wb.iter().zip(xb) {
        let s16 = _mm256_cvtepi8_epi16(avx2::ld128(a, 192));
        let lanes = q6_k_lanes(&q6_k_quants(a), &q6_k_scales(s16), s16, y);
        let d = avx2::f32_at(y, 0) * avx2::f16_at(a, 208);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(lanes), acc);
    }
    avx2::hsum_ps(acc)
}

/// `Q6_K` for `T` activations, two per vector for the float part: the block's quants and
/// scales decoded once; per activation the integer lanes of [`q6_k_lanes`]; per pair of
/// activations the fold onto ggml's 8 lanes, the `-32` bias, the conversion and the FMA of
/// [`dot_q6_k`] done in one vector (lower half: the first activation, upper: the second).
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn multi_q6_k_t<const T: usize>(w: &[u8], row_bytes: usize, xs: &[&[u8]], outs: &mut [&mut [f32]]) {
    let xb: [&[[u8; Q8_K_BYTES]]; T] = std::array::from_fn(|t| xs[t].as_chunks::<Q8_K_BYTES>().0);
    let nb = xb[0].len();
    const P: usize = MAX_MULTI / 2;
    let pairs = T.div_ceil(2);
    // Pair p holds activations 2p (lower half) and 2p + 1 (upper; 2p again when T is odd).
    let tok = |p: usize, h: usize| (2 * p + h).min(T - 1);
    let mut scratch = take_scratch();
    let pre = refill(&mut scratch.q6k, pairs * nb, |i| {
        let (p, b) = (i / nb, i % nb);
        let (ya, yb) = (&xb[tok(p, 0)][b], &xb[tok(p, 1)][b]);
        let dy = _mm512_insertf32x8::<1>(_mm512_set1_ps(avx2::f32_at(ya, 0)), _mm256_set1_ps(avx2::f32_at(yb, 0)));
        (join256(avx2::ld256(ya, 260), avx2::ld256(yb, 260)), dy)
    });
    let ys = block_major(&xb, &mut scratch.ys);
    for (r, row) in w.chunks_exact(row_bytes).enumerate() {
        let (wb, _) = row.as_chunks::<Q6_K_BYTES>();
        let mut acc = [_mm512_setzero_ps(); P];
        for ((b, a), yb) in wb.iter().enumerate().zip(ys.chunks_exact(T)) {
            let s16 = _mm256_cvtepi8_epi16(avx2::ld128(a, 192));
            let s16x2 = _mm512_broadcast_i64x4(s16);
            let (q, sc) = (q6_k_quants(a), q6_k_scales(s16));
            let dw = _mm512_set1_ps(avx2::f16_at(a, 208));
            for (p, accp) in acc.iter_mut().enumerate().take(pairs) {
                let ia = q6_k_int(&q, &sc, &yb[tok(p, 0)]);
                let ib = q6_k_int(&q, &sc, &yb[tok(p, 1)]);
                // [lanes l + l+8 of ia | of ib].
                let folded = _mm512_add_epi32(
                    _mm512_shuffle_i64x2::<0b01_00_01_00>(ia, ib),
                    _mm512_shuffle_i64x2::<0b11_10_11_10>(ia, ib),
                );
                let (bsums, dy) = pre[p * nb + b];
                let bias = _mm512_slli_epi32::<5>(_mm512_madd_epi16(s16x2, bsums));
                let lanes = _mm512_sub_epi32(folded, bias);
                *accp = _mm512_fmadd_ps(_mm512_mul_ps(dy, dw), _mm512_cvtepi32_ps(lanes), *accp);
            }
        }
        for (p, accp) in acc.iter().enumerate().take(pairs) {
            let (a, b) = hsum8_halves(*accp);
            outs[tok(p, 0)][r] = a;
            if tok(p, 1) != tok(p, 0) {
                outs[tok(p, 1)][r] = b;
            }
        }
    }
    put_scratch(scratch);
}

// ---------------------------------------------------------------------------
// Dispatch
// ---------------------------------------------------------------------------

/// Generates the safe entry points for one kernel compiled with features `$f`: a dot product
/// and a row loop compiled with the same features (so the dot product inlines into it).
macro_rules! entry {
    ($f:literal, $dot:ident) => {{
        #[target_feature(enable = $f)]
        fn rows(w: &[u8], row_bytes: usize, x: &[u8], out: &mut [f32]) {
            for (row, o) in w.chunks_exact(row_bytes).zip(out.iter_mut()) {
                *o = $dot(row, x);
            }
        }
        entry!(@wrap $dot, rows)
    }};
    (@wrap $dot:ident, $rows:ident) => {{
        fn vec_dot(_n: usize, w: &[u8], x: &[u8]) -> f32 {
            // SAFETY: `kernel()` hands this out only after checking the features `$dot` needs
            // (`available()`, plus `vnni()`/`bf16()` where used) on this CPU.
            unsafe { $dot(w, x) }
        }
        fn matvec(w: &[u8], row_bytes: usize, _cols: usize, x: &[u8], out: &mut [f32]) {
            // SAFETY: as for `vec_dot` above.
            unsafe { $rows(w, row_bytes, x, out) }
        }
        Kernel { vec_dot, matvec }
    }};
}

/// The AVX-512 level's own kernel for `ty`, if there is one: always for the float types
/// (ggml's AVX-512 shapes) and `Q2_K` (the repacked order of an AVX-512 build), for `Q8_0`,
/// `Q4_K`, `Q5_K`, `Q6_K` when the CPU has VNNI.
pub(super) fn kernel(ty: GgmlType) -> Option<Kernel> {
    if !available() {
        return None;
    }
    use GgmlType::*;
    Some(match ty {
        F32 => entry!("avx512f,avx512dq,avx2,fma", dot_f32),
        F16 => entry!("avx512f,avx512dq,avx2,fma", dot_f16),
        BF16 if bf16() => entry!("avx512f,avx512dq,avx512bf16,avx2,fma", dot_bf16_dp),
        BF16 => entry!("avx512f,avx512dq,avx2,fma", dot_bf16_f),
        // A build with AVX-512 repacks Q2_K (`ggml_gemv_q2_K_8x8_q8_K` order).
        Q2_K => return avx2::kernel_q2_k_repacked(),
        Q8_0 if vnni() => entry!(@wrap dot_q8_0, rows_q8_0),
        Q4_K if vnni() => entry!(@wrap dot_q4_k, rows_q4_k),
        Q5_K if vnni() => entry!("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c", dot_q5_k),
        Q6_K if vnni() => entry!("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c", dot_q6_k),
        _ => return None,
    })
}

/// One `Q8_0` row: the two-row kernel with the row as both rows.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn dot_q8_0(w: &[u8], x: &[u8]) -> f32 {
    let mut out = [0f32];
    rows_q8_0(w, w.len(), x, &mut out);
    out[0]
}

/// One `Q4_K` row (the repacked order row by row; the eight-row kernel is for `matvec`).
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")]
fn dot_q4_k(w: &[u8], x: &[u8]) -> f32 {
    avx2::dot_q4_k(w, x)
}

/// The safe entry point of a multi-activation kernel `$f::<T>` for the listed `T` (calls get
/// at most the last one: the kernel's `Multi::group`).
macro_rules! multi_entry {
    ($f:ident, [$($t:literal),+]) => {{
        fn multi(w: &[u8], row_bytes: usize, xs: &[&[u8]], outs: &mut [&mut [f32]]) {
            // SAFETY: handed out by `multi_kernel` only after `vnni()` confirmed AVX-512
            // F/BW/DQ/VL, VNNI, AVX2, FMA and F16C on this CPU.
            unsafe {
                match xs.len() {
                    $($t => $f::<$t>(w, row_bytes, xs, outs),)+
                    n => unreachable!("{n} activations in a multi-activation call"),
                }
            }
        }
        (multi as super::MultiFn, [$($t),+].len())
    }};
}

/// The multi-activation kernel for `ty` (1 to [`MAX_MULTI`] activations per call), if there
/// is one (VNNI CPUs only; otherwise the `avx2` ones are used).
pub(super) fn multi_kernel(ty: GgmlType) -> Option<Multi> {
    if !vnni() {
        return None;
    }
    // Group sizes measured per CPU-second (`quant_speed` with `QS_MULTI`): 16 activations gain
    // ~8% over 8 for `Q4_K` (its per-block decoding is the most expensive to share); `Q6_K` gains
    // nothing and `Q8_0` loses a third (its prepared activations then outgrow the L1 cache).
    let (f, group) = match ty {
        GgmlType::Q8_0 => multi_entry!(multi_q8_0_t, [1, 2, 3, 4, 5, 6, 7, 8]),
        GgmlType::Q4_K => multi_entry!(multi_q4_k_t, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]),
        GgmlType::Q5_K => multi_entry!(multi_q5_k_t, [1, 2, 3, 4, 5, 6, 7, 8]),
        GgmlType::Q6_K => multi_entry!(multi_q6_k_t, [1, 2, 3, 4, 5, 6, 7, 8]),
        _ => return None,
    };
    Some(Multi { f, group })
}
