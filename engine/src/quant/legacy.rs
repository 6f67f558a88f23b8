//! ggml's original 32-element block types (scalar only; not hot in K-quant models).
//!
//! # Layouts (32 elements per block; element `j` of the block, `j < 16`, is the low
//! nibble of `qs[j]`, element `j + 16` its high nibble)
//! `Q4_0`: 18 bytes
//! | offset | size | field |
//! |--------|------|-------|
//! | 0 | 2  | `d`: f16 |
//! | 2 | 16 | `qs`: nibbles `q`; value `(q - 8) * d` |
//!
//! `Q4_1`: 20 bytes
//! | offset | size | field |
//! |--------|------|-------|
//! | 0 | 2  | `d`: f16 |
//! | 2 | 2  | `m`: f16 |
//! | 4 | 16 | `qs`: nibbles `q`; value `q * d + m` |
//!
//! `Q5_0`: 22 bytes
//! | offset | size | field |
//! |--------|------|-------|
//! | 0 | 2  | `d`: f16 |
//! | 2 | 4  | `qh`: u32 LE, bit `e` = 5th bit of element `e` |
//! | 6 | 16 | `qs`: low nibbles; value `(q - 16) * d` |
//!
//! `Q5_1`: 24 bytes
//! | offset | size | field |
//! |--------|------|-------|
//! | 0 | 2  | `d`: f16 |
//! | 2 | 2  | `m`: f16 |
//! | 4 | 4  | `qh`: u32 LE, bit `e` = 5th bit of element `e` |
//! | 8 | 16 | `qs`: low nibbles; value `q * d + m` |
//!
//! `Q4_0`/`Q5_0` dot with `Q8_0`; `Q4_1`/`Q5_1` dot with `Q8_1`, whose `s` field
//! (`d * sum(q8)`, stored as f16) carries the minimum term as in ggml.
//! Quantizers are ggml's `quantize_row_q{4,5}_{0,1}_ref`.

use super::float::f32_to_f16_bits;
use super::q8::{Q8_0_BYTES, Q8_1_BYTES};
use super::{rd_f16, wr_u16};

pub const QK: usize = 32;
pub const Q4_0_BYTES: usize = 18;
pub const Q4_1_BYTES: usize = 20;
pub const Q5_0_BYTES: usize = 22;
pub const Q5_1_BYTES: usize = 24;

#[inline]
fn rd_u32(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

/// Unpacks the 32 quants of a 4-bit block (plus optional 5th bits) into `q`.
#[inline(always)]
fn unpack(qs: &[u8], qh: u32, q: &mut [u8; QK]) {
    for j in 0..16 {
        q[j] = (qs[j] & 0xf) | ((((qh >> j) & 1) as u8) << 4);
        q[j + 16] = (qs[j] >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
    }
}

fn pack(q: &[u8; QK], qs: &mut [u8]) -> u32 {
    let mut qh = 0u32;
    for j in 0..16 {
        qs[j] = (q[j] & 0xf) | ((q[j + 16] & 0xf) << 4);
        qh |= (((q[j] >> 4) & 1) as u32) << j;
        qh |= (((q[j + 16] >> 4) & 1) as u32) << (j + 16);
    }
    qh
}

pub(crate) fn dequantize_q4_0(src: &[u8], dst: &mut [f32]) {
    let mut q = [0u8; QK];
    for (b, y) in src.chunks_exact(Q4_0_BYTES).zip(dst.chunks_exact_mut(QK)) {
        let d = rd_f16(b, 0);
        unpack(&b[2..18], 0, &mut q);
        for (o, &v) in y.iter_mut().zip(&q) {
            *o = (v as i32 - 8) as f32 * d;
        }
    }
}

pub(crate) fn dequantize_q4_1(src: &[u8], dst: &mut [f32]) {
    let mut q = [0u8; QK];
    for (b, y) in src.chunks_exact(Q4_1_BYTES).zip(dst.chunks_exact_mut(QK)) {
        let (d, m) = (rd_f16(b, 0), rd_f16(b, 2));
        unpack(&b[4..20], 0, &mut q);
        for (o, &v) in y.iter_mut().zip(&q) {
            *o = v as f32 * d + m;
        }
    }
}

pub(crate) fn dequantize_q5_0(src: &[u8], dst: &mut [f32]) {
    let mut q = [0u8; QK];
    for (b, y) in src.chunks_exact(Q5_0_BYTES).zip(dst.chunks_exact_mut(QK)) {
        let d = rd_f16(b, 0);
        unpack(&b[6..22], rd_u32(b, 2), &mut q);
        for (o, &v) in y.iter_mut().zip(&q) {
            *o = (v as i32 - 16) as f32 * d;
        }
    }
}

pub(crate) fn dequantize_q5_1(src: &[u8], dst: &mut [f32]) {
    let mut q = [0u8; QK];
    for (b, y) in src.chunks_exact(Q5_1_BYTES).zip(dst.chunks_exact_mut(QK)) {
        let (d, m) = (rd_f16(b, 0), rd_f16(b, 2));
        unpack(&b[8..24], rd_u32(b, 4), &mut q);
        for (o, &v) in y.iter_mut().zip(&q) {
            *o = v as f32 * d + m;
        }
    }
}

/// Signed value with the largest magnitude (first on ties), as ggml's loops.
fn signed_absmax(x: &[f32]) -> f32 {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    max
}

fn min_max(x: &[f32]) -> (f32, f32) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}

pub(crate) fn quantize_q4_0(src: &[f32], dst: &mut [u8]) {
    let mut q = [0u8; QK];
    for (x, y) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(Q4_0_BYTES)) {
        let d = signed_absmax(x) / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        wr_u16(y, 0, f32_to_f16_bits(d));
        for (l, &v) in q.iter_mut().zip(x) {
            *l = ((v * id + 8.5) as i8).min(15) as u8;
        }
        pack(&q, &mut y[2..18]);
    }
}

pub(crate) fn quantize_q4_1(src: &[f32], dst: &mut [u8]) {
    let mut q = [0u8; QK];
    for (x, y) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(Q4_1_BYTES)) {
        let (min, max) = min_max(x);
        let d = (max - min) / 15.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        wr_u16(y, 0, f32_to_f16_bits(d));
        wr_u16(y, 2, f32_to_f16_bits(min));
        for (l, &v) in q.iter_mut().zip(x) {
            *l = (((v - min) * id + 0.5) as i8).min(15) as u8;
        }
        pack(&q, &mut y[4..20]);
    }
}

pub(crate) fn quantize_q5_0(src: &[f32], dst: &mut [u8]) {
    let mut q = [0u8; QK];
    for (x, y) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(Q5_0_BYTES)) {
        let d = signed_absmax(x) / -16.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        wr_u16(y, 0, f32_to_f16_bits(d));
        for (l, &v) in q.iter_mut().zip(x) {
            *l = ((v * id + 16.5) as i8).min(31) as u8;
        }
        let qh = pack(&q, &mut y[6..22]);
        y[2..6].copy_from_slice(&qh.to_le_bytes());
    }
}

pub(crate) fn quantize_q5_1(src: &[f32], dst: &mut [u8]) {
    let mut q = [0u8; QK];
    for (x, y) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(Q5_1_BYTES)) {
        let (min, max) = min_max(x);
        let d = (max - min) / 31.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        wr_u16(y, 0, f32_to_f16_bits(d));
        wr_u16(y, 2, f32_to_f16_bits(min));
        for (l, &v) in q.iter_mut().zip(x) {
            // ggml casts to uint8_t without clamping; stay within 5 bits.
            *l = (((v - min) * id + 0.5) as u8).min(31);
        }
        let qh = pack(&q, &mut y[8..24]);
        y[4..8].copy_from_slice(&qh.to_le_bytes());
    }
}

#[inline(always)]
fn dot_u_i8(q: &[u8; QK], y: &[u8]) -> i32 {
    q.iter().zip(y).map(|(&a, &b)| a as i32 * (b as i8 as i32)).sum()
}

#[inline(always)]
fn dot_centered(q: &[u8; QK], bias: i32, y: &[u8]) -> i32 {
    q.iter().zip(y).map(|(&a, &b)| (a as i32 - bias) * (b as i8 as i32)).sum()
}

pub(crate) fn vec_dot_q4_0_q8_0(_n: usize, w: &[u8], x: &[u8]) -> f32 {
    let mut q = [0u8; QK];
    let mut sumf = 0f32;
    for (a, b) in w.chunks_exact(Q4_0_BYTES).zip(x.chunks_exact(Q8_0_BYTES)) {
        unpack(&a[2..18], 0, &mut q);
        let sumi = dot_centered(&q, 8, &b[2..34]);
        sumf += sumi as f32 * rd_f16(a, 0) * rd_f16(b, 0);
    }
    sumf
}

pub(crate) fn vec_dot_q5_0_q8_0(_n: usize, w: &[u8], x: &[u8]) -> f32 {
    let mut q = [0u8; QK];
    let mut sumf = 0f32;
    for (a, b) in w.chunks_exact(Q5_0_BYTES).zip(x.chunks_exact(Q8_0_BYTES)) {
        unpack(&a[6..22], rd_u32(a, 2), &mut q);
        let sumi = dot_centered(&q, 16, &b[2..34]);
        sumf += (rd_f16(a, 0) * rd_f16(b, 0)) * sumi as f32;
    }
    sumf
}

pub(crate) fn vec_dot_q4_1_q8_1(_n: usize, w: &[u8], x: &[u8]) -> f32 {
    let mut q = [0u8; QK];
    let mut sumf = 0f32;
    for (a, b) in w.chunks_exact(Q4_1_BYTES).zip(x.chunks_exact(Q8_1_BYTES)) {
        unpack(&a[4..20], 0, &mut q);
        let sumi = dot_u_i8(&q, &b[4..36]);
        sumf += (rd_f16(a, 0) * rd_f16(b, 0)) * sumi as f32 + rd_f16(a, 2) * rd_f16(b, 2);
    }
    sumf
}

pub(crate) fn vec_dot_q5_1_q8_1(_n: usize, w: &[u8], x: &[u8]) -> f32 {
    let mut q = [0u8; QK];
    let mut sumf = 0f32;
    for (a, b) in w.chunks_exact(Q5_1_BYTES).zip(x.chunks_exact(Q8_1_BYTES)) {
        unpack(&a[8..24], rd_u32(a, 4), &mut q);
        let sumi = dot_u_i8(&q, &b[4..36]);
        sumf += (rd_f16(a, 0) * rd_f16(b, 0)) * sumi as f32 + rd_f16(a, 2) * rd_f16(b, 2);
    }
    sumf
}
