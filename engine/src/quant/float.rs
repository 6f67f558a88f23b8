//! Float types: scalar conversions and dot products.
//!
//! # Layouts (block size 1)
//! | type   | bytes | content                                              |
//! |--------|-------|------------------------------------------------------|
//! | `F32`  | 4     | IEEE binary32, little-endian                         |
//! | `F16`  | 2     | IEEE binary16, little-endian                         |
//! | `BF16` | 2     | bfloat16 (high 16 bits of a binary32), little-endian |
//!
//! `F32 -> F16` rounds to nearest even, overflows to infinity and maps every NaN
//! to `sign | 0x7e00`, exactly as ggml's `ggml_compute_fp32_to_fp16`.
//! `F32 -> BF16` rounds to nearest even and turns NaN into a quiet NaN
//! (`(bits >> 16) | 0x40`), exactly as ggml's `ggml_compute_fp32_to_bf16`.
//!
//! Dot products follow ggml's generic `ggml_vec_dot_{f32,f16,bf16}`: each product
//! is formed in `f32`, the sum is accumulated in `f64`.

use super::{f16_to_f32, rd_f32, rd_u16, wr_u16};

/// `f32 -> f16` bits as ggml's reference `ggml_compute_fp32_to_fp16`.
#[inline]
pub fn f32_to_f16_bits(x: f32) -> u16 {
    if x.is_nan() { ((x.to_bits() >> 16) as u16 & 0x8000) | 0x7e00 } else { half::f16::from_f32(x).to_bits() }
}

/// `f16` bits -> `f32` (exact).
#[inline]
pub fn f16_bits_to_f32(h: u16) -> f32 {
    f16_to_f32(h)
}

/// `f32 -> bf16` bits as ggml's `ggml_compute_fp32_to_bf16`.
#[inline]
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    let u = x.to_bits();
    if (u & 0x7fff_ffff) > 0x7f80_0000 {
        return ((u >> 16) | 64) as u16;
    }
    ((u + (0x7fff + ((u >> 16) & 1))) >> 16) as u16
}

/// `bf16` bits -> `f32` (exact).
#[inline]
pub fn bf16_bits_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

pub(crate) fn dequantize_f32(src: &[u8], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
        *d = rd_f32(s, 0);
    }
}

pub(crate) fn dequantize_f16(src: &[u8], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *d = f16_to_f32(rd_u16(s, 0));
    }
}

pub(crate) fn dequantize_bf16(src: &[u8], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *d = bf16_bits_to_f32(rd_u16(s, 0));
    }
}

pub(crate) fn quantize_f32(src: &[f32], dst: &mut [u8]) {
    for (s, d) in src.iter().zip(dst.chunks_exact_mut(4)) {
        d.copy_from_slice(&s.to_le_bytes());
    }
}

pub(crate) fn quantize_f16(src: &[f32], dst: &mut [u8]) {
    for (s, d) in src.iter().zip(dst.chunks_exact_mut(2)) {
        wr_u16(d, 0, f32_to_f16_bits(*s));
    }
}

pub(crate) fn quantize_bf16(src: &[f32], dst: &mut [u8]) {
    for (s, d) in src.iter().zip(dst.chunks_exact_mut(2)) {
        wr_u16(d, 0, f32_to_bf16_bits(*s));
    }
}

pub(crate) fn vec_dot_f32(_n: usize, w: &[u8], x: &[u8]) -> f32 {
    let mut sum = 0f64;
    for (a, b) in w.chunks_exact(4).zip(x.chunks_exact(4)) {
        sum += (rd_f32(a, 0) * rd_f32(b, 0)) as f64;
    }
    sum as f32
}

pub(crate) fn vec_dot_f16(_n: usize, w: &[u8], x: &[u8]) -> f32 {
    let mut sum = 0f64;
    for (a, b) in w.chunks_exact(2).zip(x.chunks_exact(2)) {
        sum += (f16_to_f32(rd_u16(a, 0)) * f16_to_f32(rd_u16(b, 0))) as f64;
    }
    sum as f32
}

pub(crate) fn vec_dot_bf16(_n: usize, w: &[u8], x: &[u8]) -> f32 {
    let mut sum = 0f64;
    for (a, b) in w.chunks_exact(2).zip(x.chunks_exact(2)) {
        sum += (bf16_bits_to_f32(rd_u16(a, 0)) * bf16_bits_to_f32(rd_u16(b, 0))) as f64;
    }
    sum as f32
}
