//! aarch64 NEON kernels: the kernel set of the `neon` ISA level, with `sdot` (the `dotprod`
//! extension, ARMv8.2 and later) where the CPU has it.
//!
//! # Numerics
//! The integers are ggml's (and the scalar kernels'): quants multiplied as `i8 x i8`, summed in
//! `i32` per 16-byte group with `sdot` or, without `dotprod`, with ggml's emulation of it
//! (`ggml_vdotq_s32`: `smull` of each half, `saddlp`, add). The two put different elements in
//! each of the four `i32` lanes (`sdot`: lane `l` holds bytes `4l..4l+4`; the emulation: bytes
//! `2l, 2l+1, 8+2l, 9+2l`); only `Q8_0` and `Q4_0` keep the lanes apart into their float sums.
//!
//! The float arithmetic is that of ggml's NEON `ggml_vec_dot_*` kernels (`arch/arm/quants.c`) as
//! GCC compiles them for aarch64 (contractions read off the object code of `-O3` builds for
//! `armv8-a` and `armv8.2-a+dotprod`, which agree):
//! - `Q8_0`: blocks in pairs, even blocks into one 4-lane sum and odd blocks into another, each
//!   `sum += f32(lanes) * (d_w * d_x)` (`vmlaq_n_f32`: multiply, then add, not fused); the result
//!   is `hadd(even) + hadd(odd)` with `hadd(v) = (v0 + v1) + (v2 + v3)`; a last odd block is
//!   `fma(f32(sumi), d_w * d_x, sum)`;
//! - `Q4_0`: as `Q8_0` (its quants the low nibbles, then the high ones, minus 8), but a last odd
//!   block is `fma(f32(sumi) * d_w, d_x, sum)` (`sumi*d_w*d_x` in the source);
//! - `Q2_K`: per block `sum = fma(f32(imin), -(d_x * dmin_w), sum)` then
//!   `sum = fma(f32(isum), d_x * d_w, sum)`;
//! - `Q3_K`: per block `sum = fma(f32(isum), d_x * d_w, sum)`;
//! - `Q4_K`: per block `sum = sum - f32(imin) * dmin` then `sum = sum + f32(isum) * d`, each one
//!   fused multiply-add (`d = d_x * d_w`, `dmin = d_x * dmin_w`);
//! - `Q5_K`: per block `sum = sum + fma(d, f32(isum), -(dmin * f32(imin)))`;
//! - `Q6_K`: per block `sum = fma(d_w * d_x, f32(isum - 32 * imin), sum)`, the quants taken
//!   unsigned and their bias 32 removed through the activation's `bsums`;
//! - `MXFP4`: blocks in pairs, `sum += fma(f32(i1), d_x1 * E(e1), f32(i0) * (d_x0 * E(e0)))`
//!   (weights looked up from `kvalues_mxfp4` with `tbl`), a last odd block
//!   `sum = fma(f32(i), d_x * E(e), sum)`;
//! - `F32`, `F16` (`ggml_vec_dot_f32`, `ggml_vec_dot_f16` in `vec.cpp`, the latter without FP16
//!   vector arithmetic, as in an `armv8-a` or `armv8.2-a+dotprod` build): four 4-lane
//!   accumulators over 16-element steps, `acc = vfmaq_f32(acc, x, y)` (f16 widened with `fcvtl`),
//!   reduced as `(acc0 + acc2) + (acc1 + acc3)` and `vaddvq_f32`; then the tail, which for `F32`
//!   GCC vectorises (read off the object code: groups of 4 rounded products added in order, the
//!   last `tail % 4` fused, a tail of at most 3 all fused), and whose `f32` products `F16` adds
//!   in `f64` to the widened sum.
//!
//! `BF16` has no NEON path in ggml (`ggml_vec_dot_bf16` sums the `f32` products in `f64`, in
//! order, without `__ARM_FEATURE_BF16` vector code in these builds), which is the scalar kernel.
//!
//! The multi-activation kernels decode each weight block once for up to [`MAX_MULTI`]
//! activations and then run, per activation, exactly the operations above (bit-identical to
//! one `matvec` per activation).
//!
//! llama.cpp uses these kernels for one token when it does not repack the weights: a build
//! without `dotprod`, or any build run with `--no-repack`. With `dotprod` (or `i8mm`) it repacks
//! `Q4_K`, `Q5_K`, `Q6_K` and `Q8_0` matrices whose row count is a multiple of 8 (4 for `Q8_0`)
//! (and `MXFP4`) into interleaved blocks with other float orders, which this module does not
//! reproduce.

use std::arch::aarch64::*;
use std::arch::asm;

use super::kquants::{Q2_K_BYTES, Q3_K_BYTES, Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES, q3k_scales, scale_min_k4};
use super::legacy::Q4_0_BYTES;
use super::mxfp4::{KVALUES, MXFP4_BYTES, e8m0_half};
use super::q8::{Q8_0_BYTES, Q8_K_BYTES};
use super::{GgmlType, Kernel, Multi, f16_to_f32};

/// Whether the CPU has NEON (every aarch64 Linux CPU has).
pub(super) fn available() -> bool {
    std::arch::is_aarch64_feature_detected!("neon")
}

/// Whether the CPU has `sdot` (`dotprod`, `asimddp` in `/proc/cpuinfo`); the kernels use it then.
pub(super) fn dotprod() -> bool {
    std::arch::is_aarch64_feature_detected!("dotprod")
}

// ---------------------------------------------------------------------------
// Loads and the integer dot product
// ---------------------------------------------------------------------------

/// 16 bytes at `off` of a block, as signed bytes.
#[inline(always)]
fn ld<const N: usize>(b: &[u8; N], off: usize) -> int8x16_t {
    assert!(off + 16 <= N);
    // SAFETY: `off + 16 <= N` was just checked; `ld1` has no alignment requirement.
    unsafe { vld1q_s8(b.as_ptr().add(off).cast()) }
}

/// 16 bytes at `off` of a block, unsigned.
#[inline(always)]
fn ldu<const N: usize>(b: &[u8; N], off: usize) -> uint8x16_t {
    // SAFETY: only reinterprets the bits.
    unsafe { vreinterpretq_u8_s8(ld(b, off)) }
}

#[inline(always)]
fn f16_at<const N: usize>(b: &[u8; N], off: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[off], b[off + 1]]))
}

#[inline(always)]
fn f32_at<const N: usize>(b: &[u8; N], off: usize) -> f32 {
    f32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

#[inline(always)]
fn bsum(y: &[u8; Q8_K_BYTES], g: usize) -> i32 {
    i16::from_le_bytes([y[260 + 2 * g], y[261 + 2 * g]]) as i32
}

/// `sdot`: `acc` plus, per lane `l`, the products of bytes `4l..4l+4` of `a` and `b`.
#[inline]
#[target_feature(enable = "dotprod")]
fn sdot(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    let mut acc = acc;
    // SAFETY: one register-only instruction of the `dotprod` extension, enabled on this function.
    unsafe {
        asm!(
            "sdot {acc:v}.4s, {a:v}.16b, {b:v}.16b",
            acc = inout(vreg) acc,
            a = in(vreg) a,
            b = in(vreg) b,
            options(pure, nomem, nostack, preserves_flags)
        );
    }
    acc
}

/// ggml's `ggml_vdotq_s32` without `dotprod`: lane `l` gets bytes `2l, 2l+1, 8+2l, 9+2l`.
#[inline(always)]
fn sdot_emulated(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    // SAFETY: NEON is part of every aarch64 target; these touch registers only.
    unsafe {
        let p0 = vmull_s8(vget_low_s8(a), vget_low_s8(b));
        let p1 = vmull_s8(vget_high_s8(a), vget_high_s8(b));
        vaddq_s32(acc, vaddq_s32(vpaddlq_s16(p0), vpaddlq_s16(p1)))
    }
}

/// The integer dot product of the kernels: `sdot` when `SD`, else its emulation.
#[inline(always)]
fn vdot<const SD: bool>(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    if SD {
        // SAFETY: kernels with `SD` are handed out only after `dotprod()` (and are compiled
        // with the feature, so this inlines).
        unsafe { sdot(acc, a, b) }
    } else {
        sdot_emulated(acc, a, b)
    }
}

/// Sum of the four lanes (integers: any order).
#[inline(always)]
fn addv(v: int32x4_t) -> i32 {
    // SAFETY: NEON, registers only.
    unsafe { vaddvq_s32(v) }
}

#[inline(always)]
fn zero() -> int32x4_t {
    // SAFETY: NEON, registers only.
    unsafe { vdupq_n_s32(0) }
}

/// `(v0 + v1) + (v2 + v3)`: GCC's `vaddvq_f32` (two `faddp`).
#[inline(always)]
fn hadd_f32(v: float32x4_t) -> f32 {
    // SAFETY: NEON, registers only.
    unsafe {
        let p = vpaddq_f32(v, v);
        vgetq_lane_f32::<0>(vpaddq_f32(p, p))
    }
}

// ---------------------------------------------------------------------------
// Q8_0 and Q4_0 x Q8_0: ggml's pairwise loop
// ---------------------------------------------------------------------------

/// A 32-quant block type against `Q8_0` in ggml's pairwise NEON loop: its quants as two
/// vectors of signed bytes (elements 0..16 and 16..32), and how a last odd block is added.
struct Pairwise<const N: usize> {
    quants: fn(&[u8; N]) -> (int8x16_t, int8x16_t),
    /// `(sumi, d_w, d_x, sum)` to the new sum.
    tail: fn(i32, f32, f32, f32) -> f32,
}

const Q8_0_PAIRWISE: Pairwise<Q8_0_BYTES> = Pairwise {
    quants: |a| (ld(a, 2), ld(a, 18)),
    // `sumf += sumi*(d_w*d_x)`: one fused multiply-add.
    tail: |sumi, dw, dx, sum| (sumi as f32).mul_add(dw * dx, sum),
};

const Q4_0_PAIRWISE: Pairwise<Q4_0_BYTES> = Pairwise {
    quants: q4_0_quants,
    // `sumf += sumi*d_w*d_x`: `(sumi*d_w)` rounded, then fused with `d_x`.
    tail: |sumi, dw, dx, sum| (sumi as f32 * dw).mul_add(dx, sum),
};

/// A `Q4_0` block's quants: low nibbles (elements 0..16) and high nibbles (16..32), minus 8.
#[inline(always)]
fn q4_0_quants(a: &[u8; Q4_0_BYTES]) -> (int8x16_t, int8x16_t) {
    // SAFETY: NEON, registers only.
    unsafe {
        let v = ldu(a, 2);
        let (m4, s8) = (vdupq_n_u8(0xf), vdupq_n_s8(8));
        (vsubq_s8(vreinterpretq_s8_u8(vandq_u8(v, m4)), s8), vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8::<4>(v)), s8))
    }
}

/// The four `i32` lanes of one block's product: `vdot(vdot(0, w0, y0), w1, y1)` (ggml's `Q4_0`;
/// its `Q8_0` adds two dots into zero, the same integers lane by lane).
#[inline(always)]
fn pair_lanes<const SD: bool>(w: (int8x16_t, int8x16_t), b: &[u8; Q8_0_BYTES]) -> int32x4_t {
    vdot::<SD>(vdot::<SD>(zero(), w.0, ld(b, 2)), w.1, ld(b, 18))
}

/// `sum + f32(lanes) * d`, multiply then add (`vmlaq_n_f32`).
#[inline(always)]
fn mla(sum: float32x4_t, lanes: int32x4_t, d: f32) -> float32x4_t {
    // SAFETY: NEON, registers only.
    unsafe { vaddq_f32(sum, vmulq_n_f32(vcvtq_f32_s32(lanes), d)) }
}

#[inline(always)]
fn fzero() -> float32x4_t {
    // SAFETY: NEON, registers only.
    unsafe { vdupq_n_f32(0.0) }
}

/// Rows of a [`Pairwise`] type against up to [`MAX_MULTI`] activations, each weight block
/// decoded once: blocks in pairs, even blocks into one 4-lane sum and odd blocks into another,
/// `hadd(even) + hadd(odd)`, then the last odd block by the type's `tail`.
#[inline(always)]
fn pair_rows<const SD: bool, const N: usize>(
    p: &Pairwise<N>,
    w: &[u8],
    row_bytes: usize,
    xs: &[&[u8]],
    outs: &mut [&mut [f32]],
) {
    let nt = xs.len().min(MAX_MULTI);
    let xb: [&[[u8; Q8_0_BYTES]]; MAX_MULTI] = std::array::from_fn(|t| xs.get(t).map_or(&[][..], |x| x.as_chunks().0));
    for (r, row) in w.chunks_exact(row_bytes).enumerate() {
        let (wb, _) = row.as_chunks::<N>();
        let nb = wb.len();
        let mut s0 = [fzero(); MAX_MULTI];
        let mut s1 = [fzero(); MAX_MULTI];
        let mut ib = 0;
        while ib + 1 < nb {
            let (a0, a1) = (&wb[ib], &wb[ib + 1]);
            let (q0, q1) = ((p.quants)(a0), (p.quants)(a1));
            let (d0, d1) = (f16_at(a0, 0), f16_at(a1, 0));
            for t in 0..nt {
                let (b0, b1) = (&xb[t][ib], &xb[t][ib + 1]);
                s0[t] = mla(s0[t], pair_lanes::<SD>(q0, b0), d0 * f16_at(b0, 0));
                s1[t] = mla(s1[t], pair_lanes::<SD>(q1, b1), d1 * f16_at(b1, 0));
            }
            ib += 2;
        }
        for t in 0..nt {
            let mut sum = hadd_f32(s0[t]) + hadd_f32(s1[t]);
            if ib < nb {
                let (a, b) = (&wb[ib], &xb[t][ib]);
                let sumi = addv(pair_lanes::<SD>((p.quants)(a), b));
                sum = (p.tail)(sumi, f16_at(a, 0), f16_at(b, 0), sum);
            }
            outs[t][r] = sum;
        }
    }
}

// ---------------------------------------------------------------------------
// K-quants x Q8_K
// ---------------------------------------------------------------------------

/// The 8 (scale, min) pairs of a `Q4_K`/`Q5_K` block.
#[inline(always)]
fn k4_scales<const N: usize>(a: &[u8; N]) -> ([i32; 8], [i32; 8]) {
    let s = &a[4..16];
    let mut sc = [0; 8];
    let mut mn = [0; 8];
    for j in 0..8 {
        let (x, m) = scale_min_k4(j, s);
        sc[j] = x as i32;
        mn[j] = m as i32;
    }
    (sc, mn)
}

/// `Σ_j min_j * (bsums[2j] + bsums[2j+1])`.
#[inline(always)]
fn k4_imin(mn: &[i32; 8], y: &[u8; Q8_K_BYTES]) -> i32 {
    (0..8).map(|j| mn[j] * (bsum(y, 2 * j) + bsum(y, 2 * j + 1))).sum()
}

/// A `Q4_K`/`Q5_K` block's quants as 16 vectors: sub-block `j` is vectors `2j` and `2j+1`.
type Quants = [int8x16_t; 16];

#[inline(always)]
fn q4k_quants(a: &[u8; Q4_K_BYTES]) -> Quants {
    // SAFETY: NEON, registers only.
    unsafe {
        let m4 = vdupq_n_u8(0xf);
        let mut q = [vdupq_n_s8(0); 16];
        for j in 0..4 {
            let (b0, b1) = (ldu(a, 16 + 32 * j), ldu(a, 32 + 32 * j));
            q[4 * j] = vreinterpretq_s8_u8(vandq_u8(b0, m4));
            q[4 * j + 1] = vreinterpretq_s8_u8(vandq_u8(b1, m4));
            q[4 * j + 2] = vreinterpretq_s8_u8(vshrq_n_u8::<4>(b0));
            q[4 * j + 3] = vreinterpretq_s8_u8(vshrq_n_u8::<4>(b1));
        }
        q
    }
}

#[inline(always)]
fn q5k_quants(a: &[u8; Q5_K_BYTES]) -> Quants {
    // SAFETY: NEON, registers only.
    unsafe {
        let m4 = vdupq_n_u8(0xf);
        let (mone, mtwo) = (vdupq_n_u8(1), vdupq_n_u8(2));
        let (mut h0, mut h1) = (ldu(a, 16), ldu(a, 32));
        let mut q = [vdupq_n_s8(0); 16];
        for j in 0..4 {
            let (b0, b1) = (ldu(a, 48 + 32 * j), ldu(a, 64 + 32 * j));
            let hl0 = vshlq_n_u8::<4>(vandq_u8(mone, h0));
            let hl1 = vshlq_n_u8::<4>(vandq_u8(mone, h1));
            let hh0 = vshlq_n_u8::<3>(vandq_u8(mtwo, h0));
            let hh1 = vshlq_n_u8::<3>(vandq_u8(mtwo, h1));
            h0 = vshrq_n_u8::<2>(h0);
            h1 = vshrq_n_u8::<2>(h1);
            q[4 * j] = vreinterpretq_s8_u8(vorrq_u8(vandq_u8(b0, m4), hl0));
            q[4 * j + 1] = vreinterpretq_s8_u8(vorrq_u8(vandq_u8(b1, m4), hl1));
            q[4 * j + 2] = vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8::<4>(b0), hh0));
            q[4 * j + 3] = vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8::<4>(b1), hh1));
        }
        q
    }
}

/// `Σ_j scale_j * (quants of sub-block j · activation)`.
#[inline(always)]
fn k4_isum<const SD: bool>(q: &Quants, sc: &[i32; 8], y: &[u8; Q8_K_BYTES]) -> i32 {
    let mut isum = 0;
    for j in 0..8 {
        let p = vdot::<SD>(vdot::<SD>(zero(), q[2 * j], ld(y, 4 + 32 * j)), q[2 * j + 1], ld(y, 20 + 32 * j));
        isum += addv(p) * sc[j];
    }
    isum
}

/// One `Q4_K` block into `sum`, in ggml's order (module docs).
#[inline(always)]
fn q4k_acc(sum: f32, isum: i32, imin: i32, dw: f32, dminw: f32, y: &[u8; Q8_K_BYTES]) -> f32 {
    let dy = f32_at(y, 0);
    let sum = (-(dy * dminw)).mul_add(imin as f32, sum);
    (isum as f32).mul_add(dy * dw, sum)
}

/// One `Q5_K` block into `sum`, in ggml's order (module docs).
#[inline(always)]
fn q5k_acc(sum: f32, isum: i32, imin: i32, dw: f32, dminw: f32, y: &[u8; Q8_K_BYTES]) -> f32 {
    let dy = f32_at(y, 0);
    let m = (dy * dminw) * imin as f32;
    sum + (dy * dw).mul_add(isum as f32, -m)
}

/// `Q4_K` (`K5 = false`) or `Q5_K` (`K5 = true`) against up to [`MAX_MULTI`] activations,
/// the quants of each block decoded once by `quants`.
#[inline(always)]
fn k4_rows<const SD: bool, const K5: bool, const N: usize>(
    w: &[u8],
    row_bytes: usize,
    xs: &[&[u8]],
    outs: &mut [&mut [f32]],
    quants: impl Fn(&[u8; N]) -> Quants,
) {
    let nt = xs.len().min(MAX_MULTI);
    let xb: [&[[u8; Q8_K_BYTES]]; MAX_MULTI] = std::array::from_fn(|t| xs.get(t).map_or(&[][..], |x| x.as_chunks().0));
    for (r, row) in w.chunks_exact(row_bytes).enumerate() {
        let (wb, _) = row.as_chunks::<N>();
        let mut sum = [0f32; MAX_MULTI];
        for (i, a) in wb.iter().enumerate() {
            let (sc, mn) = k4_scales(a);
            let q = quants(a);
            let (dw, dminw) = (f16_at(a, 0), f16_at(a, 2));
            for t in 0..nt {
                let y = &xb[t][i];
                let (isum, imin) = (k4_isum::<SD>(&q, &sc, y), k4_imin(&mn, y));
                sum[t] = if K5 {
                    q5k_acc(sum[t], isum, imin, dw, dminw, y)
                } else {
                    q4k_acc(sum[t], isum, imin, dw, dminw, y)
                };
            }
        }
        for t in 0..nt {
            outs[t][r] = sum[t];
        }
    }
}

/// A `Q6_K` block's unsigned quants (0..63), 16 vectors of 16: sub-block `s` is vector `s`.
#[inline(always)]
fn q6k_quants(a: &[u8; Q6_K_BYTES]) -> [int8x16_t; 16] {
    // SAFETY: NEON, registers only.
    unsafe {
        let m4 = vdupq_n_u8(0xf);
        let m3 = vdupq_n_u8(3);
        let mut q = [vdupq_n_s8(0); 16];
        for hf in 0..2 {
            let (qh0, qh1) = (ldu(a, 128 + 32 * hf), ldu(a, 144 + 32 * hf));
            let ql: [uint8x16_t; 4] = std::array::from_fn(|k| ldu(a, 64 * hf + 16 * k));
            let hi = |v: uint8x16_t, sh: usize| -> uint8x16_t {
                let s = match sh {
                    0 => v,
                    2 => vshrq_n_u8::<2>(v),
                    4 => vshrq_n_u8::<4>(v),
                    _ => vshrq_n_u8::<6>(v),
                };
                vshlq_n_u8::<4>(vandq_u8(m3, s))
            };
            let o = 8 * hf;
            q[o] = vreinterpretq_s8_u8(vorrq_u8(vandq_u8(ql[0], m4), hi(qh0, 0)));
            q[o + 1] = vreinterpretq_s8_u8(vorrq_u8(vandq_u8(ql[1], m4), hi(qh1, 0)));
            q[o + 2] = vreinterpretq_s8_u8(vorrq_u8(vandq_u8(ql[2], m4), hi(qh0, 2)));
            q[o + 3] = vreinterpretq_s8_u8(vorrq_u8(vandq_u8(ql[3], m4), hi(qh1, 2)));
            q[o + 4] = vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8::<4>(ql[0]), hi(qh0, 4)));
            q[o + 5] = vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8::<4>(ql[1]), hi(qh1, 4)));
            q[o + 6] = vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8::<4>(ql[2]), hi(qh0, 6)));
            q[o + 7] = vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8::<4>(ql[3]), hi(qh1, 6)));
        }
        q
    }
}

/// A K-quant block whose quants come in 16 groups of 16, each with one integer scale (`Q2_K`,
/// `Q3_K`, `Q6_K`): its quants (group `s` is vector `s`), its scales, and how a block's
/// `isum = Σ_s scale_s * (group s · activation)` enters the sum in ggml's order.
struct Groups16<const N: usize> {
    quants: fn(&[u8; N]) -> [int8x16_t; 16],
    scales: fn(&[u8; N]) -> [i32; 16],
    /// `(sum, isum, block, activation)` to the new sum.
    acc: fn(f32, i32, &[u8; N], &[u8; Q8_K_BYTES]) -> f32,
}

const Q6_K_GROUPS: Groups16<Q6_K_BYTES> = Groups16 {
    quants: q6k_quants,
    scales: |a| std::array::from_fn(|s| a[192 + s] as i8 as i32),
    // Quants taken unsigned, their bias 32 removed through the activation's `bsums`.
    acc: |sum, isum, a, y| {
        let imin: i32 = (0..16).map(|s| bsum(y, s) * (a[192 + s] as i8 as i32)).sum();
        (f16_at(a, 208) * f32_at(y, 0)).mul_add((isum - 32 * imin) as f32, sum)
    },
};

const Q2_K_GROUPS: Groups16<Q2_K_BYTES> = Groups16 {
    quants: q2k_quants,
    scales: |a| std::array::from_fn(|s| (a[s] & 0xf) as i32),
    // `sum += dmin * imin` (`dmin = -d_x * dmin_w`), then `sum += d * isum`: two fused.
    acc: |sum, isum, a, y| {
        let dy = f32_at(y, 0);
        let imin: i32 = (0..16).map(|s| bsum(y, s) * (a[s] >> 4) as i32).sum();
        let sum = (imin as f32).mul_add(-(dy * f16_at(a, 82)), sum);
        (isum as f32).mul_add(dy * f16_at(a, 80), sum)
    },
};

const Q3_K_GROUPS: Groups16<Q3_K_BYTES> = Groups16 {
    quants: q3k_quants,
    scales: |a| q3k_scales(&a[96..108]).map(i32::from),
    // `sum += d * isum`, fused.
    acc: |sum, isum, a, y| (isum as f32).mul_add(f32_at(y, 0) * f16_at(a, 108), sum),
};

/// `v >> sh` lane by lane (a shift known only at run time).
#[inline(always)]
fn shr(v: uint8x16_t, sh: usize) -> uint8x16_t {
    // SAFETY: NEON, registers only.
    unsafe { vshlq_u8(v, vdupq_n_s8(-(sh as i8))) }
}

/// A `Q2_K` block's quants (0..3): element `128h + 32k + l` is bits `2k` of `qs[32h + l]`.
#[inline(always)]
fn q2k_quants(a: &[u8; Q2_K_BYTES]) -> [int8x16_t; 16] {
    // SAFETY: NEON, registers only.
    unsafe {
        let m3 = vdupq_n_u8(3);
        std::array::from_fn(|s| {
            let (h, k, half) = (s / 8, (s % 8) / 2, s % 2);
            vreinterpretq_s8_u8(vandq_u8(shr(ldu(a, 16 + 32 * h + 16 * half), 2 * k), m3))
        })
    }
}

/// A `Q3_K` block's quants (−4..3): the low bits as `Q2_K`'s from `qs` (byte 32), minus 4 where
/// bit `4h + k` of `hmask[l]` (byte 0) is clear.
#[inline(always)]
fn q3k_quants(a: &[u8; Q3_K_BYTES]) -> [int8x16_t; 16] {
    // SAFETY: NEON, registers only.
    unsafe {
        let (m1, m3) = (vdupq_n_u8(1), vdupq_n_u8(3));
        std::array::from_fn(|s| {
            let (h, k, half) = (s / 8, (s % 8) / 2, s % 2);
            let low = vandq_u8(shr(ldu(a, 32 + 32 * h + 16 * half), 2 * k), m3);
            let clear = vandq_u8(shr(vmvnq_u8(ldu(a, 16 * half)), 4 * h + k), m1);
            vsubq_s8(vreinterpretq_s8_u8(low), vreinterpretq_s8_u8(vshlq_n_u8::<2>(clear)))
        })
    }
}

/// Rows of a [`Groups16`] type against up to [`MAX_MULTI`] activations, each block decoded once.
#[inline(always)]
fn groups16_rows<const SD: bool, const N: usize>(
    g: &Groups16<N>,
    w: &[u8],
    row_bytes: usize,
    xs: &[&[u8]],
    outs: &mut [&mut [f32]],
) {
    let nt = xs.len().min(MAX_MULTI);
    let xb: [&[[u8; Q8_K_BYTES]]; MAX_MULTI] = std::array::from_fn(|t| xs.get(t).map_or(&[][..], |x| x.as_chunks().0));
    for (r, row) in w.chunks_exact(row_bytes).enumerate() {
        let (wb, _) = row.as_chunks::<N>();
        let mut sum = [0f32; MAX_MULTI];
        for (i, a) in wb.iter().enumerate() {
            let (q, sc) = ((g.quants)(a), (g.scales)(a));
            for t in 0..nt {
                let y = &xb[t][i];
                let mut isum = 0;
                for (s, qs) in q.iter().enumerate() {
                    isum += addv(vdot::<SD>(zero(), *qs, ld(y, 4 + 16 * s))) * sc[s];
                }
                sum[t] = (g.acc)(sum[t], isum, a, y);
            }
        }
        for t in 0..nt {
            outs[t][r] = sum[t];
        }
    }
}

// ---------------------------------------------------------------------------
// MXFP4 x Q8_0: ggml_vec_dot_mxfp4_q8_0 (llama.cpp repacks MXFP4 only with dotprod)
// ---------------------------------------------------------------------------

/// An `MXFP4` block's weights: `kvalues_mxfp4` looked up (`tbl`) by the low nibbles (elements
/// 0..16) and by the high ones (16..32).
#[inline(always)]
fn mxfp4_quants(a: &[u8; MXFP4_BYTES]) -> (int8x16_t, int8x16_t) {
    // SAFETY: NEON, registers only; the table is 16 bytes.
    unsafe {
        let table = vld1q_s8(KVALUES.as_ptr());
        let v = ldu(a, 1);
        (vqtbl1q_s8(table, vandq_u8(v, vdupq_n_u8(0xf))), vqtbl1q_s8(table, vshrq_n_u8::<4>(v)))
    }
}

/// One block's `Σ K[q]·y` (`i32`).
#[inline(always)]
fn mxfp4_isum<const SD: bool>(q: (int8x16_t, int8x16_t), b: &[u8; Q8_0_BYTES]) -> i32 {
    addv(pair_lanes::<SD>(q, b))
}

/// `MXFP4` rows against up to [`MAX_MULTI`] `Q8_0` activations, each weight block decoded once:
/// blocks in pairs, `sum += f32(i0) * (d_x0 * E(e0)) + f32(i1) * (d_x1 * E(e1))` with the second
/// product fused into the first (`fmul`, `fmadd`, then `fadd` into the sum, as GCC compiles it);
/// a last odd block `sum = fma(f32(i), d_x * E(e), sum)`.
#[inline(always)]
fn rows_mxfp4<const SD: bool>(w: &[u8], row_bytes: usize, xs: &[&[u8]], outs: &mut [&mut [f32]]) {
    let nt = xs.len().min(MAX_MULTI);
    let xb: [&[[u8; Q8_0_BYTES]]; MAX_MULTI] = std::array::from_fn(|t| xs.get(t).map_or(&[][..], |x| x.as_chunks().0));
    for (r, row) in w.chunks_exact(row_bytes).enumerate() {
        let (wb, _) = row.as_chunks::<MXFP4_BYTES>();
        let nb = wb.len();
        let mut sum = [0f32; MAX_MULTI];
        let mut ib = 0;
        while ib + 1 < nb {
            let (a0, a1) = (&wb[ib], &wb[ib + 1]);
            let (q0, q1) = (mxfp4_quants(a0), mxfp4_quants(a1));
            let (e0, e1) = (e8m0_half(a0[0]), e8m0_half(a1[0]));
            for t in 0..nt {
                let (b0, b1) = (&xb[t][ib], &xb[t][ib + 1]);
                let p = mxfp4_isum::<SD>(q0, b0) as f32 * (f16_at(b0, 0) * e0);
                sum[t] += (mxfp4_isum::<SD>(q1, b1) as f32).mul_add(f16_at(b1, 0) * e1, p);
            }
            ib += 2;
        }
        for t in 0..nt {
            if ib < nb {
                let (a, b) = (&wb[ib], &xb[t][ib]);
                sum[t] = (mxfp4_isum::<SD>(mxfp4_quants(a), b) as f32).mul_add(f16_at(b, 0) * e8m0_half(a[0]), sum[t]);
            }
            outs[t][r] = sum[t];
        }
    }
}

// ---------------------------------------------------------------------------
// F32 and F16: ggml_vec_dot_f32 and ggml_vec_dot_f16
// ---------------------------------------------------------------------------

/// Four `f32` at element `i` of a row of `f32`.
#[inline(always)]
fn ld_f32x4(b: &[u8], i: usize) -> float32x4_t {
    assert!(4 * i + 16 <= b.len());
    // SAFETY: `4i + 16 <= len` was just checked; `ld1` has no alignment requirement.
    unsafe { vld1q_f32(b.as_ptr().add(4 * i).cast()) }
}

/// Four `f16` at element `i` of a row of `f16`, widened to `f32` (`fcvtl`, exact: ggml's
/// `GGML_F32Cx4_LOAD`, `vcvt_f32_f16(vld1_f16(p))`).
#[inline(always)]
fn ld_f16x4(b: &[u8], i: usize) -> float32x4_t {
    assert!(2 * i + 8 <= b.len());
    // SAFETY: `2i + 8 <= len` was just checked; `ld1` has no alignment requirement. `fcvtl` is
    // base ASIMD (Rust's `vcvt_f32_f16` needs the unstable `f16` types) and touches registers only.
    unsafe {
        let h = vld1_u16(b.as_ptr().add(2 * i).cast());
        let out: float32x4_t;
        asm!(
            "fcvtl {o:v}.4s, {h:v}.4h",
            o = lateout(vreg) out,
            h = in(vreg) h,
            options(pure, nomem, nostack, preserves_flags)
        );
        out
    }
}

/// The vector part of ggml's NEON `ggml_vec_dot_f32` and (without FP16 vector arithmetic, which
/// no reproduced build has) `ggml_vec_dot_f16`: `GGML_F32_ARR = 4` accumulators of 4 lanes over
/// 16-element steps, `acc[j] = vfmaq_f32(acc[j], x, y)`, reduced by `GGML_F32x4_REDUCE` as
/// `(acc0 + acc2) + (acc1 + acc3)` and `vaddvq_f32`. Returns the sum and the elements consumed
/// (the caller adds the tail as ggml does).
#[inline(always)]
fn float_dot4(w: &[u8], x: &[u8], n: usize, ld: impl Fn(&[u8], usize) -> float32x4_t) -> (f32, usize) {
    let np = n - n % 16;
    // SAFETY: NEON, registers only (the loads check their bounds).
    unsafe {
        let mut acc = [vdupq_n_f32(0.0); 4];
        let mut i = 0;
        while i < np {
            for (j, a) in acc.iter_mut().enumerate() {
                *a = vfmaq_f32(*a, ld(w, i + 4 * j), ld(x, i + 4 * j));
            }
            i += 16;
        }
        let s = vaddq_f32(vaddq_f32(acc[0], acc[2]), vaddq_f32(acc[1], acc[3]));
        (hadd_f32(s), np)
    }
}

/// `ggml_vec_dot_f32`: the vector sum in `f32`, then the tail's `sumf += x*y` as GCC compiles it
/// (vectorised): a tail of more than 3 elements goes 4 at a time, the 4 products rounded
/// (`fmul`) and added in order; the last `tail % 4` (or a whole tail of at most 3) are fused
/// multiply-adds.
fn dot_f32(_n: usize, w: &[u8], x: &[u8]) -> f32 {
    let n = w.len().min(x.len()) / 4;
    let (mut sum, np) = float_dot4(w, x, n, ld_f32x4);
    let at = |b: &[u8], i: usize| f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]);
    let tail = n - np;
    let unfused = if tail > 3 { np + tail / 4 * 4 } else { np };
    for i in np..unfused {
        sum += at(w, i) * at(x, i);
    }
    for i in unfused..n {
        sum = at(w, i).mul_add(at(x, i), sum);
    }
    sum
}

/// `ggml_vec_dot_f16`: the vector sum widened to `f64` (`ggml_float`), the tail's `f32`
/// products added in `f64`.
fn dot_f16(_n: usize, w: &[u8], x: &[u8]) -> f32 {
    let n = w.len().min(x.len()) / 2;
    let (sum, np) = float_dot4(w, x, n, ld_f16x4);
    let mut sum = f64::from(sum);
    for i in np..n {
        let a = f16_to_f32(u16::from_le_bytes([w[2 * i], w[2 * i + 1]]));
        let b = f16_to_f32(u16::from_le_bytes([x[2 * i], x[2 * i + 1]]));
        sum += f64::from(a * b);
    }
    sum as f32
}

fn matvec_f32(w: &[u8], rb: usize, cols: usize, x: &[u8], out: &mut [f32]) {
    for (row, o) in w.chunks_exact(rb).zip(out.iter_mut()) {
        *o = dot_f32(cols, row, x);
    }
}

fn matvec_f16(w: &[u8], rb: usize, cols: usize, x: &[u8], out: &mut [f32]) {
    for (row, o) in w.chunks_exact(rb).zip(out.iter_mut()) {
        *o = dot_f16(cols, row, x);
    }
}

// ---------------------------------------------------------------------------
// Entry points
// ---------------------------------------------------------------------------

#[inline(always)]
fn rows_q8_0<const SD: bool>(w: &[u8], rb: usize, xs: &[&[u8]], outs: &mut [&mut [f32]]) {
    pair_rows::<SD, Q8_0_BYTES>(&Q8_0_PAIRWISE, w, rb, xs, outs)
}

#[inline(always)]
fn rows_q4_0<const SD: bool>(w: &[u8], rb: usize, xs: &[&[u8]], outs: &mut [&mut [f32]]) {
    pair_rows::<SD, Q4_0_BYTES>(&Q4_0_PAIRWISE, w, rb, xs, outs)
}

#[inline(always)]
fn rows_q2_k<const SD: bool>(w: &[u8], rb: usize, xs: &[&[u8]], outs: &mut [&mut [f32]]) {
    groups16_rows::<SD, Q2_K_BYTES>(&Q2_K_GROUPS, w, rb, xs, outs)
}

#[inline(always)]
fn rows_q3_k<const SD: bool>(w: &[u8], rb: usize, xs: &[&[u8]], outs: &mut [&mut [f32]]) {
    groups16_rows::<SD, Q3_K_BYTES>(&Q3_K_GROUPS, w, rb, xs, outs)
}

#[inline(always)]
fn rows_q6_k<const SD: bool>(w: &[u8], rb: usize, xs: &[&[u8]], outs: &mut [&mut [f32]]) {
    groups16_rows::<SD, Q6_K_BYTES>(&Q6_K_GROUPS, w, rb, xs, outs)
}

#[inline(always)]
fn rows_q4_k<const SD: bool>(w: &[u8], rb: usize, xs: &[&[u8]], outs: &mut [&mut [f32]]) {
    k4_rows::<SD, false, Q4_K_BYTES>(w, rb, xs, outs, q4k_quants)
}

#[inline(always)]
fn rows_q5_k<const SD: bool>(w: &[u8], rb: usize, xs: &[&[u8]], outs: &mut [&mut [f32]]) {
    k4_rows::<SD, true, Q5_K_BYTES>(w, rb, xs, outs, q5k_quants)
}

/// A one-row dot product through a rows body (an empty row is 0).
macro_rules! dot_of_rows {
    ($name:ident, $rows:ident) => {
        #[inline(always)]
        fn $name<const SD: bool>(w: &[u8], x: &[u8]) -> f32 {
            let mut o = [0f32];
            if !w.is_empty() {
                $rows::<SD>(w, w.len(), &[x], &mut [&mut o[..]]);
            }
            o[0]
        }
    };
}
dot_of_rows!(dot_q8_0, rows_q8_0);
dot_of_rows!(dot_q4_0, rows_q4_0);
dot_of_rows!(dot_q2_k, rows_q2_k);
dot_of_rows!(dot_q3_k, rows_q3_k);
dot_of_rows!(dot_q4_k, rows_q4_k);
dot_of_rows!(dot_q5_k, rows_q5_k);
dot_of_rows!(dot_q6_k, rows_q6_k);
dot_of_rows!(dot_mxfp4, rows_mxfp4);

// ---------------------------------------------------------------------------
// Entry points
// ---------------------------------------------------------------------------

/// Activations per pass of the multi-activation kernels.
pub(super) const MAX_MULTI: usize = 8;

/// The entry points of one type in both variants: `*_sd` compiled with `dotprod` (handed out only
/// when the CPU has it), `*_nd` for any NEON CPU.
macro_rules! entries {
    ($m:ident, $dot:ident, $rows:ident) => {
        mod $m {
            use super::*;

            #[target_feature(enable = "dotprod")]
            fn dot_sd(w: &[u8], x: &[u8]) -> f32 {
                $dot::<true>(w, x)
            }
            #[target_feature(enable = "dotprod")]
            fn rows_sd(w: &[u8], rb: usize, xs: &[&[u8]], outs: &mut [&mut [f32]]) {
                $rows::<true>(w, rb, xs, outs)
            }
            pub(super) fn vec_dot_sd(_n: usize, w: &[u8], x: &[u8]) -> f32 {
                // SAFETY: handed out only after `dotprod()` confirmed the feature.
                unsafe { dot_sd(w, x) }
            }
            pub(super) fn matvec_sd(w: &[u8], rb: usize, _cols: usize, x: &[u8], out: &mut [f32]) {
                // SAFETY: as for `vec_dot_sd`.
                unsafe { rows_sd(w, rb, &[x], &mut [out]) }
            }
            pub(super) fn multi_sd(w: &[u8], rb: usize, xs: &[&[u8]], outs: &mut [&mut [f32]]) {
                // SAFETY: as for `vec_dot_sd`.
                unsafe { rows_sd(w, rb, xs, outs) }
            }
            pub(super) fn vec_dot_nd(_n: usize, w: &[u8], x: &[u8]) -> f32 {
                $dot::<false>(w, x)
            }
            pub(super) fn matvec_nd(w: &[u8], rb: usize, _cols: usize, x: &[u8], out: &mut [f32]) {
                $rows::<false>(w, rb, &[x], &mut [out])
            }
            pub(super) fn multi_nd(w: &[u8], rb: usize, xs: &[&[u8]], outs: &mut [&mut [f32]]) {
                $rows::<false>(w, rb, xs, outs)
            }
        }
    };
}
entries!(e_q8_0, dot_q8_0, rows_q8_0);
entries!(e_q4_0, dot_q4_0, rows_q4_0);
entries!(e_q2_k, dot_q2_k, rows_q2_k);
entries!(e_q3_k, dot_q3_k, rows_q3_k);
entries!(e_q4_k, dot_q4_k, rows_q4_k);
entries!(e_q5_k, dot_q5_k, rows_q5_k);
entries!(e_q6_k, dot_q6_k, rows_q6_k);
entries!(e_mxfp4, dot_mxfp4, rows_mxfp4);

/// The NEON kernel for `ty`, `sdot` inside when `sd`.
///
/// # Panics
/// When `sd` is asked for on a CPU without `dotprod`.
pub(super) fn kernel_with(ty: GgmlType, sd: bool) -> Option<Kernel> {
    assert!(!sd || dotprod(), "sdot kernels on a CPU without dotprod");
    use GgmlType::*;
    macro_rules! k {
        ($m:ident) => {
            if sd {
                Kernel { vec_dot: $m::vec_dot_sd, matvec: $m::matvec_sd }
            } else {
                Kernel { vec_dot: $m::vec_dot_nd, matvec: $m::matvec_nd }
            }
        };
    }
    Some(match ty {
        F32 => Kernel { vec_dot: dot_f32, matvec: matvec_f32 },
        F16 => Kernel { vec_dot: dot_f16, matvec: matvec_f16 },
        Q8_0 => k!(e_q8_0),
        Q4_0 => k!(e_q4_0),
        Q2_K => k!(e_q2_k),
        Q3_K => k!(e_q3_k),
        Q4_K => k!(e_q4_k),
        Q5_K => k!(e_q5_k),
        Q6_K => k!(e_q6_k),
        MXFP4 => k!(e_mxfp4),
        _ => return None,
    })
}

/// The NEON multi-activation kernel for `ty`, `sdot` inside when `sd`.
///
/// # Panics
/// When `sd` is asked for on a CPU without `dotprod`.
pub(super) fn multi_kernel_with(ty: GgmlType, sd: bool) -> Option<Multi> {
    assert!(!sd || dotprod(), "sdot kernels on a CPU without dotprod");
    use GgmlType::*;
    macro_rules! m {
        ($m:ident) => {
            Multi { f: if sd { $m::multi_sd } else { $m::multi_nd }, group: MAX_MULTI }
        };
    }
    Some(match ty {
        Q8_0 => m!(e_q8_0),
        Q4_0 => m!(e_q4_0),
        Q2_K => m!(e_q2_k),
        Q3_K => m!(e_q3_k),
        Q4_K => m!(e_q4_k),
        Q5_K => m!(e_q5_k),
        Q6_K => m!(e_q6_k),
        MXFP4 => m!(e_mxfp4),
        _ => return None,
    })
}

/// The kernel of the `neon` level for `ty`: with `sdot` when the CPU has `dotprod`.
pub(super) fn kernel(ty: GgmlType) -> Option<Kernel> {
    if !available() {
        return None;
    }
    kernel_with(ty, dotprod())
}

/// The multi-activation kernel of the `neon` level for `ty`.
pub(super) fn multi_kernel(ty: GgmlType) -> Option<Multi> {
    if !available() {
        return None;
    }
    multi_kernel_with(ty, dotprod())
}
