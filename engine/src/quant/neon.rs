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
//! # Repacked orders (`dotprod`, `i8mm`)
//! llama.cpp uses the kernels above for one token when it does not repack the weights: a build
//! without `dotprod`, or any build run with `--no-repack`. Built with `dotprod` (and run on a CPU
//! with it), it repacks `Q8_0` and `MXFP4` matrices whose row count is a multiple of 4 and
//! `Q4_K`, `Q5_K`, `Q6_K` ones with a multiple of 8 into interleaved blocks, and one token runs
//! its GEMVs (`ggml_gemv_*` in `arch/arm/repack.cpp`), whose integers are the same but whose
//! float order is not; with `i8mm` too, other GEMVs. The CPU's [`Layout`] (run-time detection)
//! selects kernels that follow them row by row (`d = d_w * d_x`, `dmin = dmin_w * d_x`):
//! - `Q8_0`, `Q4_0` (4x4 at `dotprod`, 4x8 at `i8mm`, the same per row): per block
//!   `sum = fma(f32(isum), d_x * d_w, sum)`;
//! - `MXFP4` (4x4 at both): per block `sum = sum + (d_x * E(e)) * f32(isum)`, a multiply then an
//!   add (`vmlaq_f32`, which GCC 12 never fuses);
//! - `Q4_K`, `Q5_K` (8x4 at `dotprod`): per pair of sub-blocks `(2p, 2p+1)`
//!   `sum = fma(d, f32(sc_2p * i_2p + sc_2p+1 * i_2p+1), sum)`, then per block
//!   `sum = sum - f32(Σ_j min_j * bsum_j) * dmin` (`vmlsq_f32`: multiply, then subtract);
//! - `Q4_K` (8x8 at `i8mm`): as 8x4 with two fused multiply-adds per pair (`sc_2p * i_2p` first);
//!   `Q5_K` (8x8): the same, with each pair's `f32(min_2p * bsum_2p + min_2p+1 * bsum_2p+1) *
//!   dmin` subtracted after its two (multiply, then subtract);
//! - `Q6_K` (8x4 at `dotprod`): per block `sum = fma(f32(isum - 32 * imin), d, sum)`
//!   (`vmulq_f32` and `vaddq_f32` contracted by GCC into one `fmla`), the same as its `vec_dot`
//!   above, whose kernel serves it; (8x8 at `i8mm`) `sum = sum + f32(isum - 32 * imin) * d`,
//!   multiply then add (the two-lane `vmul_f32` goes through `vcombine_f32`, which GCC does not
//!   contract).
//!
//! Which products are fused was read off the object code of the `armv8.2-a+dotprod` build's
//! `arch/arm/repack.cpp.o` (GCC 12.2, `-O3`; the 8x8 GEMVs are compiled there too, under
//! `__ARM_FEATURE_DOTPROD`).
//!
//! Not reproduced: a matrix whose row count is not a multiple of the layout's 4 or 8 (llama.cpp
//! keeps the plain layout for it and the kernels here still follow the repacked order; the
//! parity models have none), and the repacked GEMMs llama.cpp runs for 4 or more tokens at once
//! (prompt processing; parity compares one token at a time, and the multi-activation kernels
//! here run the one-token order per activation). `IQ4_NL`, repacked too, has no kernel here.

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

/// The weight layout llama.cpp's CPU backend, built for this CPU, gives the `Q8_0`, `Q4_0`, `Q4_K`,
/// `Q5_K`, `Q6_K` and `MXFP4` matrices, and so the float order the kernels follow (module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Layout {
    /// No `dotprod`: ggml's `ggml_vec_dot_*` on the GGUF layout.
    Plain,
    /// `dotprod` without `i8mm`: the `dotprod` repacked GEMVs (`Q8_0`, `Q4_0` 4x4,
    /// `Q4_K`/`Q5_K`/`Q6_K` 8x4, `MXFP4` 4x4).
    Dotprod,
    /// `dotprod` and `i8mm`: the `i8mm` repacked GEMVs (`Q8_0`, `Q4_0` 4x8, `Q4_K`/`Q5_K`/`Q6_K` 8x8;
    /// `MXFP4` keeps 4x4).
    I8mm,
}

/// This CPU's [`Layout`], from its `dotprod` and `i8mm` (`/proc/cpuinfo`'s `asimddp`, `i8mm`).
pub(super) fn layout() -> Layout {
    if !dotprod() {
        Layout::Plain
    } else if std::arch::is_aarch64_feature_detected!("i8mm") {
        Layout::I8mm
    } else {
        Layout::Dotprod
    }
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

/// `hadd(even) + hadd(odd)`: ggml's two sums of the pairwise loop. Built with the test-only
/// feature `parity-negative-control`, `hadd(even + odd)` instead: the same products in another
/// float order, which the aarch64 parity check must reject (its negative control); without the
/// feature the branch is compiled out.
#[inline(always)]
fn pair_sum(even: float32x4_t, odd: float32x4_t) -> f32 {
    if cfg!(feature = "parity-negative-control") {
        // SAFETY: NEON, registers only.
        hadd_f32(unsafe { vaddq_f32(even, odd) })
    } else {
        hadd_f32(even) + hadd_f32(odd)
    }
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
            let mut sum = pair_sum(s0[t], s1[t]);
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

/// The activation's sum over the 32 elements of sub-block `j`: `bsums[2j] + bsums[2j+1]`.
#[inline(always)]
fn bsum32(y: &[u8; Q8_K_BYTES], j: usize) -> i32 {
    bsum(y, 2 * j) + bsum(y, 2 * j + 1)
}

/// `Σ_j min_j * bsum32_j`.
#[inline(always)]
fn k4_imin(mn: &[i32; 8], y: &[u8; Q8_K_BYTES]) -> i32 {
    (0..8).map(|j| mn[j] * bsum32(y, j)).sum()
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

/// `Q6_K` in the order of `ggml_gemv_q6_K_8x8_q8_K` (the `i8mm` layout): the same integer,
/// but `sum = sum + f32(isum - 32 * imin) * d`, a multiply then an add (GCC does not contract
/// its two-lane `vmul_f32` across the `vcombine_f32` into the `vaddq_f32`).
const Q6_K_8X8_GROUPS: Groups16<Q6_K_BYTES> = Groups16 {
    acc: |sum, isum, a, y| {
        let imin: i32 = (0..16).map(|s| bsum(y, s) * (a[192 + s] as i8 as i32)).sum();
        sum + (isum - 32 * imin) as f32 * (f16_at(a, 208) * f32_at(y, 0))
    },
    ..Q6_K_GROUPS
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
// The repacked orders: ggml's aarch64 GEMVs (`arch/arm/repack.cpp`), row by row
// ---------------------------------------------------------------------------

/// Rows of a [`Pairwise`] type (`Q8_0`, `Q4_0`) in the order of ggml's repacked GEMVs
/// (`ggml_gemv_q8_0_4x4_q8_0`/`_4x8_`, `ggml_gemv_q4_0_4x4_q8_0`/`_4x8_`, the same per row;
/// `Q4_0`'s integer is 16 times the sum, its nibbles kept in the high half, and
/// `vcvtq_n_f32_s32(.., 4)` divides it back exactly): per block
/// `sum = fma(f32(isum), d_x * d_w, sum)`.
#[inline(always)]
fn pair_rows_rp<const SD: bool, const N: usize>(
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
        let mut sum = [0f32; MAX_MULTI];
        for (i, a) in wb.iter().enumerate() {
            let (q, dw) = ((p.quants)(a), f16_at(a, 0));
            for t in 0..nt {
                let b = &xb[t][i];
                sum[t] = (addv(pair_lanes::<SD>(q, b)) as f32).mul_add(f16_at(b, 0) * dw, sum[t]);
            }
        }
        for t in 0..nt {
            outs[t][r] = sum[t];
        }
    }
}

/// `MXFP4` rows in the order of `ggml_gemv_mxfp4_4x4_q8_0`: per block
/// `sum = sum + (d_x * E(e)) * f32(isum)`, multiply then add (`vmlaq_f32`).
#[inline(always)]
fn rows_mxfp4_rp<const SD: bool>(w: &[u8], row_bytes: usize, xs: &[&[u8]], outs: &mut [&mut [f32]]) {
    let nt = xs.len().min(MAX_MULTI);
    let xb: [&[[u8; Q8_0_BYTES]]; MAX_MULTI] = std::array::from_fn(|t| xs.get(t).map_or(&[][..], |x| x.as_chunks().0));
    for (r, row) in w.chunks_exact(row_bytes).enumerate() {
        let (wb, _) = row.as_chunks::<MXFP4_BYTES>();
        let mut sum = [0f32; MAX_MULTI];
        for (i, a) in wb.iter().enumerate() {
            let (q, e) = (mxfp4_quants(a), e8m0_half(a[0]));
            for t in 0..nt {
                let b = &xb[t][i];
                sum[t] += (f16_at(b, 0) * e) * mxfp4_isum::<SD>(q, b) as f32;
            }
        }
        for t in 0..nt {
            outs[t][r] = sum[t];
        }
    }
}

/// `Σ` over the 32 quants of sub-block `j` of a `Q4_K`/`Q5_K` block times the activation.
#[inline(always)]
fn k4_sub<const SD: bool>(q: &Quants, j: usize, y: &[u8; Q8_K_BYTES]) -> i32 {
    addv(vdot::<SD>(vdot::<SD>(zero(), q[2 * j], ld(y, 4 + 32 * j)), q[2 * j + 1], ld(y, 20 + 32 * j)))
}

/// The repacked `Q4_K`/`Q5_K` GEMVs' orders ([`k4_rows_rp`]).
const K4_8X4: u8 = 0;
const Q4_K_8X8: u8 = 1;
const Q5_K_8X8: u8 = 2;

/// `Q4_K` or `Q5_K` rows in the order of ggml's repacked GEMVs: per block, with `d = d_w * d_x`
/// and `dmin = dmin_w * d_x`, per pair of sub-blocks `(2p, 2p+1)`:
/// - [`K4_8X4`] (`ggml_gemv_q4_K_8x4_q8_K`, `ggml_gemv_q5_K_8x4_q8_K`):
///   `sum = fma(d, f32(sc_2p * i_2p + sc_2p+1 * i_2p+1), sum)`;
/// - [`Q4_K_8X8`], [`Q5_K_8X8`] (`ggml_gemv_q4_K_8x8_q8_K`, `ggml_gemv_q5_K_8x8_q8_K`): two fused
///   multiply-adds, `sc_2p * i_2p` first; `Q5_K` then subtracts that pair's
///   `f32(min_2p * bsum_2p + min_2p+1 * bsum_2p+1) * dmin` (multiply, then subtract: `vmlsq_f32`);
///
/// and at the end of the block (the others) `sum = sum - f32(Σ_j min_j * bsum_j) * dmin`, multiply
/// then subtract (`bsum_j`: the activation's sum over sub-block `j`).
#[inline(always)]
fn k4_rows_rp<const SD: bool, const MODE: u8, const N: usize>(
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
                let dy = f32_at(y, 0);
                let (d, dmin) = (dw * dy, dminw * dy);
                let mut s = sum[t];
                for p in 0..4 {
                    let (lo, hi) =
                        (sc[2 * p] * k4_sub::<SD>(&q, 2 * p, y), sc[2 * p + 1] * k4_sub::<SD>(&q, 2 * p + 1, y));
                    if MODE == K4_8X4 {
                        s = ((lo + hi) as f32).mul_add(d, s);
                    } else {
                        s = (lo as f32).mul_add(d, s);
                        s = (hi as f32).mul_add(d, s);
                    }
                    if MODE == Q5_K_8X8 {
                        let bias = mn[2 * p] * bsum32(y, 2 * p) + mn[2 * p + 1] * bsum32(y, 2 * p + 1);
                        s -= bias as f32 * dmin;
                    }
                }
                sum[t] = if MODE == Q5_K_8X8 { s } else { s - k4_imin(&mn, y) as f32 * dmin };
            }
        }
        for t in 0..nt {
            outs[t][r] = sum[t];
        }
    }
}

// ---------------------------------------------------------------------------
// Q8_K activation quantizer
// ---------------------------------------------------------------------------

/// `quantize_row_q8_K_ref` (ggml-cpu's `Q8_K` quantizer on aarch64 too), bit for bit, four
/// lanes at a time: the same steps as the scalar `q8::quantize_q8_k` (the first element of
/// largest magnitude, `iscale = -127/max`, `q = min(127, nearest_int(iscale * x))` by the same
/// `1.5 * 2^23` addition, `d = 1/iscale`). Blocks holding NaN or whose inverse scale overflows
/// (magnitudes below ~1e-37) go to the scalar code, which reproduces ggml's garbage for them.
fn quantize_q8_k(src: &[f32], dst: &mut [u8]) {
    let (xs, _) = src.as_chunks::<{ super::QK_K }>();
    let (ys, _) = dst.as_chunks_mut::<Q8_K_BYTES>();
    for (x, y) in xs.iter().zip(ys.iter_mut()) {
        let ld = |i: usize| -> float32x4_t {
            let c: &[f32; 4] = x[4 * i..4 * i + 4].try_into().expect("4 lanes");
            // SAFETY: `c` is 4 in-bounds f32; `ld1` has no alignment requirement.
            unsafe { vld1q_f32(c.as_ptr()) }
        };
        // SAFETY: NEON, registers only (the loads are `ld`'s).
        let (amax, nan) = unsafe {
            let (mut vmax, mut nan) = (vdupq_n_f32(0.0), vdupq_n_u32(0));
            for i in 0..64 {
                let v = ld(i);
                vmax = vmaxq_f32(vmax, vabsq_f32(v));
                nan = vorrq_u32(nan, vmvnq_u32(vceqq_f32(v, v)));
            }
            (vmaxvq_f32(vmax), vmaxvq_u32(nan) != 0)
        };
        if nan {
            super::q8::quantize_q8_k(x, y);
            continue;
        }
        if amax == 0.0 {
            y.fill(0);
            continue;
        }
        // ggml keeps the first element of largest magnitude, with its sign.
        let max = *x.iter().find(|v| v.abs() == amax).expect("amax is one of the magnitudes");
        let iscale = -127.0 / max;
        if !iscale.is_finite() {
            super::q8::quantize_q8_k(x, y);
            continue;
        }
        let q = |i: usize| -> int32x4_t {
            // SAFETY: NEON, registers only (the load is `ld`'s).
            unsafe {
                let t =
                    vreinterpretq_u32_f32(vaddq_f32(vmulq_f32(vdupq_n_f32(iscale), ld(i)), vdupq_n_f32(12_582_912.0)));
                let r =
                    vsubq_s32(vreinterpretq_s32_u32(vandq_u32(t, vdupq_n_u32(0x007f_ffff))), vdupq_n_s32(0x0040_0000));
                vminq_s32(r, vdupq_n_s32(127))
            }
        };
        for g in 0..16 {
            let (q0, q1, q2, q3) = (q(4 * g), q(4 * g + 1), q(4 * g + 2), q(4 * g + 3));
            let out: &mut [u8; 16] = (&mut y[4 + 16 * g..20 + 16 * g]).try_into().expect("16 bytes");
            // SAFETY: NEON; `out` is 16 in-bounds bytes, `st1` has no alignment requirement. The
            // narrowing keeps the low bits, as the scalar code's `as i8` does.
            let bsum = unsafe {
                let lo = vcombine_s16(vmovn_s32(q0), vmovn_s32(q1));
                let hi = vcombine_s16(vmovn_s32(q2), vmovn_s32(q3));
                vst1q_s8(out.as_mut_ptr().cast(), vcombine_s8(vmovn_s16(lo), vmovn_s16(hi)));
                vaddvq_s32(vaddq_s32(vaddq_s32(q0, q1), vaddq_s32(q2, q3)))
            };
            y[260 + 2 * g..262 + 2 * g].copy_from_slice(&(bsum as i16).to_le_bytes());
        }
        y[0..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
    }
}

/// The `neon` level's quantizer for `ty`: `Q8_K` (the others are the scalar code).
pub(super) fn quantizer(ty: GgmlType) -> Option<super::QuantizeFn> {
    (ty == GgmlType::Q8_K && available()).then_some(quantize_q8_k as super::QuantizeFn)
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
fn rows_q6_k_mm<const SD: bool>(w: &[u8], rb: usize, xs: &[&[u8]], outs: &mut [&mut [f32]]) {
    groups16_rows::<SD, Q6_K_BYTES>(&Q6_K_8X8_GROUPS, w, rb, xs, outs)
}

#[inline(always)]
fn rows_q4_k<const SD: bool>(w: &[u8], rb: usize, xs: &[&[u8]], outs: &mut [&mut [f32]]) {
    k4_rows::<SD, false, Q4_K_BYTES>(w, rb, xs, outs, q4k_quants)
}

#[inline(always)]
fn rows_q5_k<const SD: bool>(w: &[u8], rb: usize, xs: &[&[u8]], outs: &mut [&mut [f32]]) {
    k4_rows::<SD, true, Q5_K_BYTES>(w, rb, xs, outs, q5k_quants)
}

#[inline(always)]
fn rows_q8_0_rp<const SD: bool>(w: &[u8], rb: usize, xs: &[&[u8]], outs: &mut [&mut [f32]]) {
    pair_rows_rp::<SD, Q8_0_BYTES>(&Q8_0_PAIRWISE, w, rb, xs, outs)
}

#[inline(always)]
fn rows_q4_0_rp<const SD: bool>(w: &[u8], rb: usize, xs: &[&[u8]], outs: &mut [&mut [f32]]) {
    pair_rows_rp::<SD, Q4_0_BYTES>(&Q4_0_PAIRWISE, w, rb, xs, outs)
}

#[inline(always)]
fn rows_q4_k_dp<const SD: bool>(w: &[u8], rb: usize, xs: &[&[u8]], outs: &mut [&mut [f32]]) {
    k4_rows_rp::<SD, K4_8X4, Q4_K_BYTES>(w, rb, xs, outs, q4k_quants)
}

#[inline(always)]
fn rows_q4_k_mm<const SD: bool>(w: &[u8], rb: usize, xs: &[&[u8]], outs: &mut [&mut [f32]]) {
    k4_rows_rp::<SD, Q4_K_8X8, Q4_K_BYTES>(w, rb, xs, outs, q4k_quants)
}

#[inline(always)]
fn rows_q5_k_dp<const SD: bool>(w: &[u8], rb: usize, xs: &[&[u8]], outs: &mut [&mut [f32]]) {
    k4_rows_rp::<SD, K4_8X4, Q5_K_BYTES>(w, rb, xs, outs, q5k_quants)
}

#[inline(always)]
fn rows_q5_k_mm<const SD: bool>(w: &[u8], rb: usize, xs: &[&[u8]], outs: &mut [&mut [f32]]) {
    k4_rows_rp::<SD, Q5_K_8X8, Q5_K_BYTES>(w, rb, xs, outs, q5k_quants)
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
dot_of_rows!(dot_q8_0_rp, rows_q8_0_rp);
dot_of_rows!(dot_q4_0_rp, rows_q4_0_rp);
dot_of_rows!(dot_mxfp4_rp, rows_mxfp4_rp);
dot_of_rows!(dot_q4_k_dp, rows_q4_k_dp);
dot_of_rows!(dot_q4_k_mm, rows_q4_k_mm);
dot_of_rows!(dot_q5_k_dp, rows_q5_k_dp);
dot_of_rows!(dot_q5_k_mm, rows_q5_k_mm);
dot_of_rows!(dot_q6_k_mm, rows_q6_k_mm);

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
entries!(e_q8_0_rp, dot_q8_0_rp, rows_q8_0_rp);
entries!(e_q4_0_rp, dot_q4_0_rp, rows_q4_0_rp);
entries!(e_mxfp4_rp, dot_mxfp4_rp, rows_mxfp4_rp);
entries!(e_q4_k_dp, dot_q4_k_dp, rows_q4_k_dp);
entries!(e_q4_k_mm, dot_q4_k_mm, rows_q4_k_mm);
entries!(e_q5_k_dp, dot_q5_k_dp, rows_q5_k_dp);
entries!(e_q5_k_mm, dot_q5_k_mm, rows_q5_k_mm);
entries!(e_q6_k_mm, dot_q6_k_mm, rows_q6_k_mm);

/// The NEON kernel for `ty` in the float order of `layout`, `sdot` inside when `sd` (the
/// integers are the same either way: a test runs every layout's order without `dotprod`).
///
/// # Panics
/// When `sd` is asked for on a CPU without `dotprod`.
pub(super) fn kernel_with(ty: GgmlType, sd: bool, layout: Layout) -> Option<Kernel> {
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
    let repacked = layout != Layout::Plain;
    Some(match ty {
        F32 => Kernel { vec_dot: dot_f32, matvec: matvec_f32 },
        F16 => Kernel { vec_dot: dot_f16, matvec: matvec_f16 },
        Q8_0 if repacked => k!(e_q8_0_rp),
        Q4_0 if repacked => k!(e_q4_0_rp),
        MXFP4 if repacked => k!(e_mxfp4_rp),
        Q4_K if layout == Layout::Dotprod => k!(e_q4_k_dp),
        Q4_K if layout == Layout::I8mm => k!(e_q4_k_mm),
        Q5_K if layout == Layout::Dotprod => k!(e_q5_k_dp),
        Q5_K if layout == Layout::I8mm => k!(e_q5_k_mm),
        Q6_K if layout == Layout::I8mm => k!(e_q6_k_mm),
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

/// The NEON multi-activation kernel for `ty` in the float order of `layout`, `sdot` inside when
/// `sd`.
///
/// # Panics
/// When `sd` is asked for on a CPU without `dotprod`.
pub(super) fn multi_kernel_with(ty: GgmlType, sd: bool, layout: Layout) -> Option<Multi> {
    assert!(!sd || dotprod(), "sdot kernels on a CPU without dotprod");
    use GgmlType::*;
    macro_rules! m {
        ($m:ident) => {
            Multi { f: if sd { $m::multi_sd } else { $m::multi_nd }, group: MAX_MULTI }
        };
    }
    let repacked = layout != Layout::Plain;
    Some(match ty {
        Q8_0 if repacked => m!(e_q8_0_rp),
        Q4_0 if repacked => m!(e_q4_0_rp),
        MXFP4 if repacked => m!(e_mxfp4_rp),
        Q4_K if layout == Layout::Dotprod => m!(e_q4_k_dp),
        Q4_K if layout == Layout::I8mm => m!(e_q4_k_mm),
        Q5_K if layout == Layout::Dotprod => m!(e_q5_k_dp),
        Q5_K if layout == Layout::I8mm => m!(e_q5_k_mm),
        Q6_K if layout == Layout::I8mm => m!(e_q6_k_mm),
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

/// The kernel of the `neon` level for `ty`: with `sdot` when the CPU has `dotprod`, in the order
/// of the CPU's [`layout`].
pub(super) fn kernel(ty: GgmlType) -> Option<Kernel> {
    if !available() {
        return None;
    }
    kernel_with(ty, dotprod(), layout())
}

/// The multi-activation kernel of the `neon` level for `ty`.
pub(super) fn multi_kernel(ty: GgmlType) -> Option<Multi> {
    if !available() {
        return None;
    }
    multi_kernel_with(ty, dotprod(), layout())
}
