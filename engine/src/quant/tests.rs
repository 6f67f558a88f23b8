//! Tests for `engine::quant`.
//!
//! The reference decoders here are written from ggml's block layouts
//! (ggml-common.h) element by element, independently of the bulk unpacking in
//! the module; the reference quantizers re-implement ggml's `_ref` algorithms
//! with different primitives (f64 rounding, explicit bit manipulation).

use super::*;

// ---------------------------------------------------------------------------
// Deterministic random numbers
// ---------------------------------------------------------------------------

/// Test data from the engine's own SplitMix64 (`crate::synth::SplitMix`, the
/// one copy in the engine), on a seed offset so streams differ from the synth's.
struct Rng(crate::synth::SplitMix);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(crate::synth::SplitMix::new(seed ^ 0x9e37_79b9_7f4a_7c15))
    }
    fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }
    fn byte(&mut self) -> u8 {
        self.next_u64() as u8
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.byte()).collect()
    }
    /// Uniform in [0, 1).
    fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
    fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * self.unit()
    }
    /// Roughly normal (Irwin-Hall, 4 terms).
    fn normal(&mut self) -> f32 {
        (self.unit() + self.unit() + self.unit() + self.unit() - 2.0) * 1.732
    }
    fn range(&mut self, lo: i32, hi_incl: i32) -> i32 {
        lo + (self.next_u64() % (hi_incl - lo + 1) as u64) as i32
    }
}

fn f16(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

fn h(b: &[u8], off: usize) -> f32 {
    f16(u16::from_le_bytes([b[off], b[off + 1]]))
}

fn put_f16(b: &mut [u8], off: usize, v: f32) {
    b[off..off + 2].copy_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes());
}

fn i8at(b: &[u8], off: usize) -> i32 {
    b[off] as i8 as i32
}

// ---------------------------------------------------------------------------
// Reference decoders, one element at a time, from ggml-common.h
// ---------------------------------------------------------------------------

/// One decoded weight: `value = scaled - min_part`; both parts are returned so
/// tests can bound rounding by `|scaled| + |min_part|`.
#[derive(Clone, Copy)]
struct Elem {
    scaled: f32,
    min_part: f32,
}

impl Elem {
    fn value(self) -> f32 {
        self.scaled - self.min_part
    }
}

fn plain(v: f32) -> Elem {
    Elem { scaled: v, min_part: 0.0 }
}

/// Reference element `e` of block `b` of type `ty`.
fn ref_elem(ty: GgmlType, b: &[u8], e: usize) -> Elem {
    use GgmlType::*;
    match ty {
        F32 => plain(f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        F16 => plain(h(b, 0)),
        BF16 => plain(f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16)),
        Q8_0 => plain(i8at(b, 2 + e) as f32 * h(b, 0)),
        Q8_1 => plain(i8at(b, 4 + e) as f32 * h(b, 0)),
        Q8_K => plain(f32::from_le_bytes([b[0], b[1], b[2], b[3]]) * i8at(b, 4 + e) as f32),
        Q4_0 | Q4_1 | Q5_0 | Q5_1 => {
            // Elements 0..16 are low nibbles of qs[0..16], 16..32 the high nibbles.
            let (qs_off, qh_off) = match ty {
                Q4_0 => (2, None),
                Q4_1 => (4, None),
                Q5_0 => (6, Some(2)),
                _ => (8, Some(4)),
            };
            let byte = b[qs_off + e % 16];
            let mut q = if e < 16 { byte & 0xf } else { byte >> 4 } as i32;
            if let Some(o) = qh_off {
                let qh = u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
                q |= (((qh >> e) & 1) as i32) << 4;
            }
            let d = h(b, 0);
            match ty {
                Q4_0 => plain((q - 8) as f32 * d),
                Q5_0 => plain((q - 16) as f32 * d),
                _ => Elem { scaled: q as f32 * d, min_part: -h(b, 2) },
            }
        }
        Q2_K => {
            let (hf, k, l) = (e / 128, (e % 128) / 32, e % 32);
            let q = (b[16 + 32 * hf + l] >> (2 * k)) & 3;
            let sc = b[e / 16];
            let d = h(b, 80);
            let dmin = h(b, 82);
            Elem { scaled: d * (sc & 0xf) as f32 * q as f32, min_part: dmin * (sc >> 4) as f32 }
        }
        Q3_K => {
            let (hf, k, l) = (e / 128, (e % 128) / 32, e % 32);
            let low = ((b[32 + 32 * hf + l] >> (2 * k)) & 3) as i32;
            let high = (b[l] >> (4 * hf + k)) & 1;
            let q = low - if high == 1 { 0 } else { 4 };
            let s = e / 16;
            let sc = &b[96..108];
            let lo4 = if s < 8 { sc[s] & 0xf } else { sc[s - 8] >> 4 };
            let hi2 = (sc[8 + s % 4] >> (2 * (s / 4))) & 3;
            let scale = (lo4 | (hi2 << 4)) as i32 - 32;
            plain(h(b, 108) * scale as f32 * q as f32)
        }
        Q4_K | Q5_K => {
            let (c, t, l) = (e / 64, (e % 64) / 32, e % 32);
            let qs_off = if ty == Q4_K { 16 } else { 48 };
            let byte = b[qs_off + 32 * c + l];
            let mut q = if t == 0 { byte & 0xf } else { byte >> 4 };
            if ty == Q5_K {
                q |= ((b[16 + l] >> (2 * c + t)) & 1) << 4;
            }
            let j = e / 32;
            let s = &b[4..16];
            let (sc, m) = if j < 4 {
                (s[j] & 63, s[j + 4] & 63)
            } else {
                ((s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
            };
            Elem { scaled: h(b, 0) * sc as f32 * q as f32, min_part: h(b, 2) * m as f32 }
        }
        Q6_K => {
            let (hf, k, l) = (e / 128, (e % 128) / 32, e % 32);
            let ql = b[64 * hf + 32 * (k & 1) + l];
            let low = if k < 2 { ql & 0xf } else { ql >> 4 };
            let high = (b[128 + 32 * hf + l] >> (2 * k)) & 3;
            let q = (low | (high << 4)) as i32 - 32;
            plain(h(b, 208) * (b[192 + e / 16] as i8) as f32 * q as f32)
        }
        _ => panic!("no reference decoder for {ty}"),
    }
}

fn ref_row(ty: GgmlType, row: &[u8], n: usize) -> Vec<Elem> {
    let (bs, ts) = (ty.block_size(), ty.type_size());
    (0..n).map(|i| ref_elem(ty, &row[(i / bs) * ts..(i / bs + 1) * ts], i % bs)).collect()
}

// ---------------------------------------------------------------------------
// Random blocks
// ---------------------------------------------------------------------------

/// A random, valid row of `n` elements: random quants and scale bytes, finite
/// f16/f32 super-scales of either sign.
fn random_row(ty: GgmlType, n: usize, rng: &mut Rng) -> Vec<u8> {
    use GgmlType::*;
    let (bs, ts) = (ty.block_size(), ty.type_size());
    let mut row = rng.bytes(n / bs * ts);
    for b in row.chunks_exact_mut(ts) {
        let mut d = || rng.uniform(-0.02, 0.02);
        match ty {
            F32 => b.copy_from_slice(&rng.normal().to_le_bytes()),
            F16 => put_f16(b, 0, rng.normal()),
            BF16 => b.copy_from_slice(&((rng.normal().to_bits() >> 16) as u16).to_le_bytes()),
            Q4_0 | Q5_0 | Q8_0 | Q8_1 => {
                put_f16(b, 0, d());
                if matches!(ty, Q8_0 | Q8_1) {
                    let off = if ty == Q8_0 { 2 } else { 4 };
                    // Activation-style quants never hit -128.
                    for q in &mut b[off..] {
                        *q = rng.range(-127, 127) as i8 as u8;
                    }
                }
                if ty == Q8_1 {
                    let sum: i32 = (4..36).map(|i| i8at(b, i)).sum();
                    let s = h(b, 0) * sum as f32;
                    put_f16(b, 2, s);
                }
            }
            Q4_1 | Q5_1 => {
                put_f16(b, 0, d());
                put_f16(b, 2, d());
            }
            Q2_K => {
                put_f16(b, 80, d());
                put_f16(b, 82, d());
            }
            Q3_K => put_f16(b, 108, d()),
            Q4_K | Q5_K => {
                put_f16(b, 0, d());
                put_f16(b, 2, d());
            }
            Q6_K => put_f16(b, 208, d()),
            Q8_K => {
                b[0..4].copy_from_slice(&d().to_le_bytes());
                for q in &mut b[4..260] {
                    *q = rng.range(-127, 127) as i8 as u8;
                }
                for g in 0..16 {
                    let s: i32 = (0..16).map(|i| i8at(b, 4 + 16 * g + i)).sum();
                    b[260 + 2 * g..262 + 2 * g].copy_from_slice(&(s as i16).to_le_bytes());
                }
            }
            // Scales 2^-18 .. 2^2 (E8M0 110..130), around a model's.
            MXFP4 => b[0] = rng.range(110, 130) as u8,
            _ => panic!("no random blocks for {ty}"),
        }
    }
    row
}

const WEIGHT_TYPES: [GgmlType; 15] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q8_1,
    GgmlType::Q8_K,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];

/// Every backend this CPU can run.
fn backends() -> Vec<Backend> {
    Backend::ALL.into_iter().filter(|b| b.is_available()).collect()
}

/// The SIMD backends this CPU can run (those whose float order is ggml's).
fn simd_backends() -> Vec<Backend> {
    backends().into_iter().filter(|b| *b != Backend::Scalar).collect()
}

// ---------------------------------------------------------------------------
// Type table
// ---------------------------------------------------------------------------

#[test]
fn type_table_matches_ggml_common_h() {
    use GgmlType::*;
    // (type, id, name, block size, bytes): bytes from the structs and
    // static_asserts in ggml-common.h, worked out by hand.
    let expect: &[(GgmlType, u32, &str, usize, usize)] = &[
        (F32, 0, "f32", 1, 4),
        (F16, 1, "f16", 1, 2),
        (Q4_0, 2, "q4_0", 32, 2 + 16),
        (Q4_1, 3, "q4_1", 32, 4 + 16),
        (Q5_0, 6, "q5_0", 32, 2 + 4 + 16),
        (Q5_1, 7, "q5_1", 32, 4 + 4 + 16),
        (Q8_0, 8, "q8_0", 32, 2 + 32),
        (Q8_1, 9, "q8_1", 32, 4 + 32),
        (Q2_K, 10, "q2_K", 256, 16 + 64 + 4),
        (Q3_K, 11, "q3_K", 256, 32 + 64 + 12 + 2),
        (Q4_K, 12, "q4_K", 256, 4 + 12 + 128),
        (Q5_K, 13, "q5_K", 256, 4 + 12 + 32 + 128),
        (Q6_K, 14, "q6_K", 256, 128 + 64 + 16 + 2),
        (Q8_K, 15, "q8_K", 256, 4 + 256 + 32),
        (IQ4_NL, 20, "iq4_nl", 32, 18),
        (IQ4_XS, 23, "iq4_xs", 256, 136),
        (BF16, 30, "bf16", 1, 2),
        (MXFP4, 39, "mxfp4", 32, 17),
    ];
    for &(ty, id, name, bs, ts) in expect {
        assert_eq!(ty as u32, id, "{name}");
        assert_eq!(GgmlType::from_u32(id), Some(ty));
        assert_eq!(ty.name(), name);
        assert_eq!(ty.block_size(), bs, "{name}");
        assert_eq!(ty.type_size(), ts, "{name}");
    }
    for gone in [4, 5, 31, 32, 33, 36, 37, 38, 43, 1000, u32::MAX] {
        assert_eq!(GgmlType::from_u32(gone), None, "{gone}");
    }
    for ty in GgmlType::ALL {
        assert_eq!(GgmlType::from_u32(ty as u32), Some(ty));
    }
}

#[test]
fn vec_dot_types_follow_ggml_cpu_traits() {
    use GgmlType::*;
    for (ty, vt) in [
        (F32, F32),
        (F16, F16),
        (BF16, BF16),
        (Q4_0, Q8_0),
        (Q5_0, Q8_0),
        (Q8_0, Q8_0),
        (Q4_1, Q8_1),
        (Q5_1, Q8_1),
        (Q2_K, Q8_K),
        (Q3_K, Q8_K),
        (Q4_K, Q8_K),
        (Q5_K, Q8_K),
        (Q6_K, Q8_K),
        (Q8_K, Q8_K),
        (IQ4_NL, Q8_0),
        (IQ2_XXS, Q8_K),
    ] {
        assert_eq!(ty.vec_dot_type(), vt, "{ty}");
    }
}

#[test]
fn row_bytes_checks_blocks_and_overflow() {
    assert_eq!(GgmlType::Q4_K.row_bytes(2048), Some(8 * 144));
    assert_eq!(GgmlType::Q4_K.row_bytes(0), Some(0));
    assert_eq!(GgmlType::Q4_K.row_bytes(100), None);
    assert_eq!(GgmlType::F32.row_bytes(3), Some(12));
    assert_eq!(GgmlType::F32.row_bytes(usize::MAX), None);
    assert_eq!(GgmlType::Q8_0.row_bytes(usize::MAX / 32 * 32), None);
}

// ---------------------------------------------------------------------------
// Dequantization
// ---------------------------------------------------------------------------

#[test]
fn dequantize_matches_reference_decoder() {
    let mut rng = Rng::new(1);
    for ty in WEIGHT_TYPES {
        for nblocks in [1, 3] {
            let n = nblocks * ty.block_size().max(32);
            let row = random_row(ty, n, &mut rng);
            let mut out = vec![f32::NAN; n];
            dequantize_row(ty, &row, &mut out).unwrap();
            let want = ref_row(ty, &row, n);
            for i in 0..n {
                // Same f32 operations as ggml's dequantizers, so exact.
                assert_eq!(out[i].to_bits(), want[i].value().to_bits(), "{ty} element {i}");
            }
        }
    }
}

#[test]
fn dequantize_hand_built_blocks() {
    // Q4_K: d = 1, dmin = 0.5; sub-block 5 has scale 3, min 2 (6-bit fields of
    // j >= 4 split across bytes); element 64*2 + 32 + 7 = 167 is in sub-block 5
    // (high nibble of qs[32*2 + 7]).
    let mut b = vec![0u8; 144];
    put_f16(&mut b, 0, 1.0);
    put_f16(&mut b, 2, 0.5);
    // j = 5: scale = (b[4+9] & 15) | (b[4+1] >> 6) << 4, min = (b[4+9] >> 4) | (b[4+5] >> 6) << 4.
    b[4 + 9] = 0x23; // scale low 3, min low 2
    b[16 + 64 + 7] = 0xa0; // high nibble 10
    let mut out = vec![0f32; 256];
    dequantize_row(GgmlType::Q4_K, &b, &mut out).unwrap();
    assert_eq!(out[167], 3.0 * 10.0 - 0.5 * 2.0);
    assert_eq!(out[166], -1.0); // same sub-block, q = 0
    assert_eq!(out[7], 0.0); // sub-block 0: scale 0, min 0

    // Q6_K: element 200 = 128 + 32*2 + 8: low nibble = ql[64 + 8] >> 4,
    // high bits = (qh[32 + 8] >> 4) & 3, scale = scales[200 / 16 = 12].
    let mut b = vec![0u8; 210];
    put_f16(&mut b, 208, 0.25);
    b[64 + 8] = 0x50; // low nibble of element 200 = 5
    b[128 + 32 + 8] = 0b0010_0000; // high bits of element 200 = 2
    b[192 + 12] = (-3i8) as u8;
    let mut out = vec![0f32; 256];
    dequantize_row(GgmlType::Q6_K, &b, &mut out).unwrap();
    assert_eq!(out[200], 0.25 * -3.0 * ((5 + 32) - 32) as f32);
    assert_eq!(out[201], 0.25 * -3.0 * -32.0);

    // Q3_K: element 40 = 32*1 + 8 (h = 0, k = 1): low bits (qs[8] >> 2) & 3,
    // high bit = bit 1 of hmask[8]; scale index 2 (low nibble of scales[2], high
    // bits (scales[8 + 2] >> 0) & 3).
    let mut b = vec![0u8; 110];
    put_f16(&mut b, 108, 2.0);
    b[32 + 8] = 0b0000_1100; // low 2 bits of element 40 = 3
    b[8] = 0b10; // high bit set: q = 3
    b[96 + 2] = 0x05;
    b[96 + 10] = 0b10; // scale = 5 | 2 << 4 = 37 -> 5
    let mut out = vec![0f32; 256];
    dequantize_row(GgmlType::Q3_K, &b, &mut out).unwrap();
    assert_eq!(out[40], 2.0 * 5.0 * 3.0);
    assert_eq!(out[41], 2.0 * 5.0 * -4.0); // q = 0 - 4
}

// ---------------------------------------------------------------------------
// Dot products
// ---------------------------------------------------------------------------

/// Expected dot product in f64 from the reference decoders, and the bound on
/// the rounding differences a correct f32 kernel may show.
fn expected_dot(ty: GgmlType, w: &[u8], x: &[u8], n: usize) -> (f64, f64) {
    let xt = ty.vec_dot_type();
    let we = ref_row(ty, w, n);
    let xe = ref_row(xt, x, n);
    let mut sum = 0f64;
    let mut mag = 0f64;
    for i in 0..n {
        let (wv, xv) = (we[i], xe[i].value() as f64);
        sum += wv.value() as f64 * xv;
        mag += (wv.scaled.abs() as f64 + wv.min_part.abs() as f64) * xv.abs();
    }
    // Q4_1/Q5_1 take the minimum term from Q8_1's f16 `s = d * sum(q)`.
    let mut extra = 0f64;
    if xt == GgmlType::Q8_1 {
        for (wb, xb) in w.chunks_exact(ty.type_size()).zip(x.chunks_exact(36)) {
            extra += (h(wb, 2) as f64 * h(xb, 2) as f64).abs() * 1e-3;
        }
    }
    (sum, 1e-5 * mag + extra + 1e-20)
}

#[test]
fn vec_dot_matches_f64_dot_of_dequantized_rows() {
    let mut rng = Rng::new(2);
    for backend in backends() {
        for ty in WEIGHT_TYPES {
            for nblocks in [1, 2, 7, 16] {
                let n = nblocks * ty.block_size().max(32);
                let w = random_row(ty, n, &mut rng);
                let x = random_row(ty.vec_dot_type(), n, &mut rng);
                let got = vec_dot_on(backend, ty, n, &w, &x).unwrap() as f64;
                let (want, tol) = expected_dot(ty, &w, &x, n);
                assert!((got - want).abs() <= tol, "{backend:?} {ty} n={n}: got {got}, want {want}, tol {tol}");
            }
        }
    }
}

#[test]
fn float_vec_dot_handles_odd_lengths() {
    // Float types have block size 1: lengths that leave SIMD remainders.
    let mut rng = Rng::new(14);
    for backend in backends() {
        for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16] {
            for n in [1, 7, 31, 33, 100, 257, 1000] {
                let w = random_row(ty, n, &mut rng);
                let x = random_row(ty, n, &mut rng);
                let got = vec_dot_on(backend, ty, n, &w, &x).unwrap() as f64;
                let (want, tol) = expected_dot(ty, &w, &x, n);
                assert!((got - want).abs() <= tol, "{backend:?} {ty} n={n}: {got} vs {want}");
            }
        }
    }
}

#[test]
fn matvec_on_rows_of_few_blocks() {
    // Block counts that leave remainders in the kernels' 2- and 4-block steps.
    let mut rng = Rng::new(16);
    for backend in backends() {
        for (ty, nblocks) in [
            (GgmlType::Q8_0, 3),
            (GgmlType::Q8_0, 7),
            (GgmlType::Q4_0, 1),
            (GgmlType::Q4_0, 9),
            (GgmlType::Q4_K, 1),
            (GgmlType::Q5_K, 5),
        ] {
            let cols = nblocks * ty.block_size();
            let rb = ty.row_bytes(cols).unwrap();
            let w: Vec<u8> = (0..5).flat_map(|_| random_row(ty, cols, &mut rng)).collect();
            let x = random_row(ty.vec_dot_type(), cols, &mut rng);
            let mut out = vec![0f32; 5];
            matvec_on(backend, ty, &w, 0..5, cols, &x, &mut out).unwrap();
            for (r, o) in out.iter().enumerate() {
                let (want, tol) = expected_dot(ty, &w[r * rb..(r + 1) * rb], &x, cols);
                assert!((*o as f64 - want).abs() <= tol, "{backend:?} {ty} {nblocks} blocks, row {r}");
            }
        }
    }
}

#[test]
fn matvec_on_very_long_rows() {
    // More blocks per row than the kernels precompute activation data for.
    let mut rng = Rng::new(15);
    let cols = 256 * 70;
    for backend in backends() {
        for ty in [GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K, GgmlType::Q8_0, GgmlType::Q4_0] {
            let rb = ty.row_bytes(cols).unwrap();
            let w: Vec<u8> = (0..3).flat_map(|_| random_row(ty, cols, &mut rng)).collect();
            let x = random_row(ty.vec_dot_type(), cols, &mut rng);
            let mut out = vec![0f32; 3];
            matvec_on(backend, ty, &w, 0..3, cols, &x, &mut out).unwrap();
            for (r, o) in out.iter().enumerate() {
                let (want, tol) = expected_dot(ty, &w[r * rb..(r + 1) * rb], &x, cols);
                assert!((*o as f64 - want).abs() <= tol, "{backend:?} {ty} row {r}");
            }
        }
    }
}

#[test]
fn vec_dot_detects_a_single_changed_quant() {
    // Guards the tolerance above: flipping one weight quant must be visible.
    let mut rng = Rng::new(3);
    for backend in backends() {
        for ty in [GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::Q2_K, GgmlType::Q3_K, GgmlType::Q5_K] {
            let n = 2048;
            let w = random_row(ty, n, &mut rng);
            let x = random_row(GgmlType::Q8_K, n, &mut rng);
            let base = vec_dot_on(backend, ty, n, &w, &x).unwrap() as f64;
            let (want, tol) = expected_dot(ty, &w, &x, n);
            assert!((base - want).abs() <= tol);
            // Change the quant byte of block 5 at its largest-effect position.
            let mut w2 = w.clone();
            let qoff = match ty {
                GgmlType::Q4_K => 16,
                GgmlType::Q5_K => 48,
                GgmlType::Q6_K => 0,
                GgmlType::Q2_K => 16,
                _ => 32,
            };
            let (_, before_tol) = expected_dot(ty, &w2, &x, n);
            w2[5 * ty.type_size() + qoff + 3] ^= 0x33;
            let (want2, _) = expected_dot(ty, &w2, &x, n);
            let got2 = vec_dot_on(backend, ty, n, &w2, &x).unwrap() as f64;
            assert!((got2 - want2).abs() <= before_tol, "{backend:?} {ty}");
            if (want2 - want).abs() > 3.0 * before_tol {
                assert!((got2 - base).abs() > before_tol, "{backend:?} {ty}: change not seen");
            }
        }
    }
}

#[test]
fn simd_and_scalar_agree() {
    // On x86_64 every CPU this runs on has AVX2, on aarch64 ASIMD (checked here, so the test
    // cannot pass empty).
    assert!(!cfg!(target_arch = "x86_64") || Backend::Avx2.is_available(), "x86_64 without AVX2");
    assert!(!cfg!(target_arch = "aarch64") || Backend::Neon.is_available(), "aarch64 without ASIMD");
    let mut rng = Rng::new(4);
    for backend in simd_backends() {
        for ty in WEIGHT_TYPES {
            for _ in 0..20 {
                let n = (1 + rng.range(0, 11) as usize) * ty.block_size().max(32);
                let w = random_row(ty, n, &mut rng);
                let x = random_row(ty.vec_dot_type(), n, &mut rng);
                let a = vec_dot_on(Backend::Scalar, ty, n, &w, &x).unwrap() as f64;
                let b = vec_dot_on(backend, ty, n, &w, &x).unwrap() as f64;
                let (_, tol) = expected_dot(ty, &w, &x, n);
                assert!((a - b).abs() <= 2.0 * tol, "{ty} n={n}: scalar {a}, {backend} {b}");
            }
        }
    }
}

#[test]
fn dispatch_follows_the_isa_level() {
    // The level is ENGINE_ISA when set (the test runs at whatever level it asks for), else the
    // best the CPU has.
    let want = isa_from(std::env::var(ISA_ENV).ok().as_deref()).unwrap();
    assert_eq!(isa().unwrap(), want);
    assert_eq!(backend(), want);
    if std::env::var(ISA_ENV).is_err() {
        assert_eq!(backend(), Backend::best());
    }
    assert!(Backend::Scalar.is_available());
    let report = isa_report().unwrap();
    assert!(report.contains(&format!("isa: {want}")), "{report}");
}

#[test]
fn isa_levels_parse_and_check_the_cpu() {
    assert_eq!(isa_from(None).unwrap(), Backend::best());
    assert_eq!(isa_from(Some("")).unwrap(), Backend::best());
    assert_eq!(isa_from(Some("scalar")).unwrap(), Backend::Scalar);
    for b in Backend::ALL {
        assert_eq!(Backend::from_name(b.name()), Some(b));
        match isa_from(Some(b.name())) {
            Ok(got) => {
                assert_eq!(got, b);
                assert!(b.is_available());
            }
            Err(QuantError::IsaUnavailable { level, missing, best }) => {
                assert_eq!(level, b);
                assert!(!b.is_available() && !missing.is_empty() && best == Backend::best());
                let msg = isa_from(Some(b.name())).unwrap_err().to_string();
                assert!(msg.contains("lacks") && msg.contains(&missing), "{msg}");
            }
            Err(e) => panic!("{b}: {e}"),
        }
    }
    let e = isa_from(Some("avx1024")).unwrap_err();
    assert!(matches!(&e, QuantError::IsaUnknown(n) if n == "avx1024"));
    assert!(e.to_string().contains("scalar, avx2, avx512 or neon"), "{e}");
    // An x86 level's features include the lower level's; the ARM level needs ASIMD only.
    for w in [Backend::Scalar, Backend::Avx2, Backend::Avx512].windows(2) {
        assert!(w[0].required_features().iter().all(|f| w[1].required_features().contains(f)));
    }
    assert_eq!(Backend::Neon.required_features(), ["asimd"]);
    // Each architecture runs its own levels and never the other's.
    let arm = [Backend::Neon];
    for b in Backend::ALL {
        if cfg!(target_arch = "aarch64") && b != Backend::Scalar {
            assert_eq!(b.is_available(), arm.contains(&b), "{b}");
        }
        if cfg!(target_arch = "x86_64") && arm.contains(&b) {
            assert!(!b.is_available(), "{b}");
        }
    }
}

#[test]
fn vec_dot_with_real_activations() {
    // Activations from quantize_activation, weights from quantize_row: the
    // quantized dot must be close to the float dot of the original vectors.
    let mut rng = Rng::new(5);
    let n = 1024;
    for ty in WEIGHT_TYPES {
        if ty == GgmlType::Q8_1 {
            continue; // activation-only type
        }
        let wf: Vec<f32> = (0..n).map(|_| rng.normal()).collect();
        let xf: Vec<f32> = (0..n).map(|_| rng.normal()).collect();
        let mut w = vec![0u8; ty.row_bytes(n).unwrap()];
        quantize_row(ty, &wf, &mut w).unwrap();
        let mut xq = Vec::new();
        quantize_activation(ty, &xf, &mut xq).unwrap();
        let got = vec_dot(ty, n, &w, &xq) as f64;
        let (want, tol) = expected_dot(ty, &w, &xq, n);
        assert!((got - want).abs() <= tol, "{ty}: {got} vs {want}");
        // Against the dequantized weights times the unquantized activations:
        // only the activation quantization error (< 1% RMS of x) remains.
        let mut wd = vec![0f32; n];
        dequantize_row(ty, &w, &mut wd).unwrap();
        let float_dot: f64 = wd.iter().zip(&xf).map(|(a, b)| *a as f64 * *b as f64).sum();
        let w_rms = (wd.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / n as f64).sqrt();
        let bound = 5.0 * (n as f64).sqrt() * w_rms * 0.01;
        assert!((got - float_dot).abs() < bound, "{ty}: quantized {got} vs float {float_dot} (bound {bound})");
    }
}

#[test]
fn matvec_matches_vec_dot_per_row() {
    let mut rng = Rng::new(6);
    let (rows, cols) = (13, 768);
    for backend in backends() {
        for ty in WEIGHT_TYPES {
            let rb = ty.row_bytes(cols).unwrap();
            let w: Vec<u8> = (0..rows).flat_map(|_| random_row(ty, cols, &mut rng)).collect();
            let x = random_row(ty.vec_dot_type(), cols, &mut rng);
            let mut out = vec![f32::NAN; 9];
            matvec_on(backend, ty, &w, 3..12, cols, &x, &mut out).unwrap();
            for (i, o) in out.iter().enumerate() {
                let r = 3 + i;
                let d = vec_dot_on(backend, ty, cols, &w[r * rb..(r + 1) * rb], &x).unwrap() as f64;
                // Same integers, possibly another f32 summation order.
                let (_, tol) = expected_dot(ty, &w[r * rb..(r + 1) * rb], &x, cols);
                assert!((*o as f64 - d).abs() <= 2.0 * tol, "{backend:?} {ty} row {r}: {o} vs {d}");
            }
            let mut out2 = vec![f32::NAN; 9];
            matvec(ty, &w, 3..12, cols, &x, &mut out2);
            for (i, o) in out2.iter().enumerate() {
                let r = 3 + i;
                let (want, tol) = expected_dot(ty, &w[r * rb..(r + 1) * rb], &x, cols);
                assert!((*o as f64 - want).abs() <= tol, "{ty} row {r}");
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Activation quantizers: bit-exact against re-implementations of ggml's
// ---------------------------------------------------------------------------

/// C's `roundf` (halves away from zero), via f64 where `|x| + 0.5` is exact.
fn roundf_c(x: f32) -> f32 {
    let r = ((x.abs() as f64) + 0.5).floor() as f32;
    if x < 0.0 { -r } else { r }
}

/// ggml's `ggml_compute_fp32_to_fp16`, transcribed bit by bit.
fn ggml_fp32_to_fp16(f: f32) -> u16 {
    let scale_to_inf = f32::from_bits(0x7780_0000); // 2^112
    let scale_to_zero = f32::from_bits(0x0880_0000); // 2^-110
    let mut base = (f.abs() * scale_to_inf) * scale_to_zero;
    let w = f.to_bits();
    let shl1_w = w.wrapping_add(w);
    let sign = w & 0x8000_0000;
    let mut bias = shl1_w & 0xff00_0000;
    if bias < 0x7100_0000 {
        bias = 0x7100_0000;
    }
    base += f32::from_bits((bias >> 1) + 0x0780_0000);
    let bits = base.to_bits();
    let exp_bits = (bits >> 13) & 0x0000_7c00;
    let mantissa_bits = bits & 0x0000_0fff;
    let nonsign = exp_bits + mantissa_bits;
    ((sign >> 16) | if shl1_w > 0xff00_0000 { 0x7e00 } else { nonsign }) as u16
}

fn ggml_fp32_to_bf16(f: f32) -> u16 {
    let u = f.to_bits();
    if (u & 0x7fff_ffff) > 0x7f80_0000 {
        return ((u >> 16) | 64) as u16;
    }
    (u.wrapping_add(0x7fff + ((u >> 16) & 1)) >> 16) as u16
}

fn ref_q8_0(x: &[f32], flavor: Q8Flavor, with_sum: bool) -> Vec<u8> {
    let mut out = Vec::new();
    for blk in x.chunks(32) {
        let amax = blk.iter().fold(0f32, |a, v| if a > v.abs() { a } else { v.abs() });
        let d = amax / 127.0;
        let id = match flavor {
            Q8Flavor::X86 => {
                if amax != 0.0 {
                    127.0 / amax
                } else {
                    0.0
                }
            }
            _ => {
                if d != 0.0 {
                    1.0 / d
                } else {
                    0.0
                }
            }
        };
        let qs: Vec<(i8, i32)> = blk
            .iter()
            .map(|v| {
                let p = v * id;
                let r = match flavor {
                    Q8Flavor::Reference => roundf_c(p) as f64,
                    // Halves to even via f64: floor(p + 0.5), minus one on exact odd halves.
                    _ => {
                        let f = (p as f64 + 0.5).floor();
                        if f - p as f64 == 0.5 && (f as i64) % 2 != 0 { f - 1.0 } else { f }
                    }
                };
                // Non-representable results (inverse scale overflowed to inf)
                // as the C builds of ggml convert them.
                let fits_i32 = r.is_finite() && r.abs() < 2_147_483_648.0;
                // Each flavour as (stored quant, value added into Q8_1's sum).
                match flavor {
                    // gcc: 32-bit truncating conversion (i32::MIN if invalid), low
                    // byte; the sum adds the stored bytes.
                    Q8Flavor::Reference => {
                        let q = (if fits_i32 { r as i64 } else { i32::MIN as i64 }) as u8 as i8;
                        (q, q as i32)
                    }
                    // cvtps2dq (i32::MIN if invalid), then saturating packs; the
                    // sum adds the i32 values.
                    Q8Flavor::X86 => {
                        if fits_i32 {
                            (r.clamp(-128.0, 127.0) as i8, r as i32)
                        } else {
                            (-128, i32::MIN)
                        }
                    }
                    // Saturating conversion to i32 (NaN -> 0), low byte stored.
                    Q8Flavor::Arm => {
                        let i = if r.is_nan() { 0 } else { r.clamp(i32::MIN as f64, i32::MAX as f64) as i64 };
                        (i as u8 as i8, i as i32)
                    }
                }
            })
            .collect();
        out.extend_from_slice(&ggml_fp32_to_fp16(d).to_le_bytes());
        if with_sum {
            let sum = qs.iter().fold(0i32, |s, &(_, v)| s.wrapping_add(v));
            out.extend_from_slice(&ggml_fp32_to_fp16(sum as f32 * d).to_le_bytes());
        }
        out.extend(qs.iter().map(|&(q, _)| q as u8));
    }
    out
}

/// ggml's `nearest_int` reimplemented with f64 (halves to even).
fn nearest_even(x: f32) -> i32 {
    // ggml's `x + 1.5*2^23` trick on non-finite input (the inverse scale of a
    // block of tiny values overflows to infinity): NaN -> 0, +-inf -> -2^22.
    if x.is_nan() {
        return 0;
    }
    if x.is_infinite() {
        return -4_194_304;
    }
    let v = x as f64;
    let f = v.floor();
    let diff = v - f;
    if diff > 0.5 || (diff == 0.5 && (f as i64) % 2 != 0) { f as i32 + 1 } else { f as i32 }
}

fn ref_q8_k(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    for blk in x.chunks(256) {
        let mut amax = 0f32;
        let mut max = 0f32;
        for &v in blk {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax == 0.0 {
            out.extend(std::iter::repeat_n(0u8, 292));
            continue;
        }
        let iscale = -127.0 / max;
        let qs: Vec<i8> = blk.iter().map(|&v| nearest_even(iscale * v).min(127) as i8).collect();
        out.extend_from_slice(&(1.0 / iscale).to_le_bytes());
        out.extend(qs.iter().map(|&q| q as u8));
        for g in 0..16 {
            let s: i16 = qs[16 * g..16 * g + 16].iter().map(|&q| q as i16).sum();
            out.extend_from_slice(&s.to_le_bytes());
        }
    }
    out
}

fn activation_vectors(rng: &mut Rng) -> Vec<Vec<f32>> {
    let mut v = Vec::new();
    for scale in [1e-3f32, 1.0, 37.0, 3e4] {
        v.push((0..512).map(|_| rng.normal() * scale).collect::<Vec<_>>());
    }
    // Values on the quantization grid (many exact halves after scaling).
    v.push((0..512).map(|i| ((i % 255) as f32 - 127.0) * 0.5).collect());
    // Mostly zeros, a single spike per block, all-zero blocks.
    let mut z = vec![0f32; 512];
    z[3] = -2.5;
    z[300] = 7.0;
    v.push(z);
    v.push(vec![0f32; 512]);
    // Subnormal and huge magnitudes.
    v.push((0..512).map(|i| if i % 2 == 0 { 1e-40 } else { -3e-39 }).collect());
    v
}

#[test]
fn quantize_q8_0_and_q8_1_bit_exact_with_ggml_algorithms() {
    let mut rng = Rng::new(7);
    for x in activation_vectors(&mut rng) {
        for flavor in [Q8Flavor::Reference, Q8Flavor::X86, Q8Flavor::Arm] {
            for (ty, with_sum) in [(GgmlType::Q8_0, false), (GgmlType::Q8_1, true)] {
                let mut got = vec![0u8; ty.row_bytes(x.len()).unwrap()];
                quantize_row_q8_0_with(ty, flavor, &x, &mut got).unwrap();
                assert_eq!(got, ref_q8_0(&x, flavor, with_sum), "{ty} {flavor:?}");
                if flavor == Q8Flavor::Reference {
                    let mut got2 = vec![0u8; got.len()];
                    quantize_row(ty, &x, &mut got2).unwrap();
                    assert_eq!(got2, got, "quantize_row({ty}) must be the reference quantizer");
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[test]
fn simd_x86_q8_0_quantizer_matches_the_scalar_one() {
    assert!(Backend::Avx2.is_available(), "x86_64 without AVX2");
    let mut rng = Rng::new(17);
    let mut vectors = activation_vectors(&mut rng);
    // Infinities and NaN in some blocks (ggml's garbage, the same bytes in both).
    let mut odd = vectors[1].clone();
    odd[5] = f32::INFINITY;
    odd[70] = f32::NEG_INFINITY;
    odd[200] = 3.4e38;
    vectors.push(odd);
    for x in vectors {
        let mut simd = vec![0u8; GgmlType::Q8_0.row_bytes(x.len()).unwrap()];
        let mut scalar = simd.clone();
        // SAFETY: AVX2, FMA and F16C were checked above (the avx2 level needs all three).
        unsafe { super::avx2::quantize_q8_0_x86(&x, &mut simd) };
        q8::quantize_q8_0(Q8Flavor::X86, &x, &mut scalar);
        assert_eq!(simd, scalar);
    }
}

#[test]
fn quantize_q8_0_known_vector() {
    // amax = 127 -> d = 1 (f16 0x3c00), id = 1 in every flavour, so q = round(x).
    let mut x = [0f32; 32];
    x[..8].copy_from_slice(&[127.0, 2.5, -3.5, 0.5, -0.5, 1.4999, -126.5, 3.0]);
    let mut q = [0u8; 34];
    quantize_row(GgmlType::Q8_0, &x, &mut q).unwrap();
    assert_eq!(&q[..2], &[0x00, 0x3c]);
    let want_ref: [i8; 8] = [127, 3, -4, 1, -1, 1, -127, 3]; // roundf: halves away from zero
    assert_eq!(&q[2..10], &want_ref.map(|v| v as u8));
    assert!(q[10..].iter().all(|&b| b == 0));
    quantize_row_q8_0_with(GgmlType::Q8_0, Q8Flavor::X86, &x, &mut q).unwrap();
    let want_even: [i8; 8] = [127, 2, -4, 0, 0, 1, -126, 3]; // halves to even
    assert_eq!(&q[2..10], &want_even.map(|v| v as u8));
    // Q8_1 reference: s = f16(d * sum) = 127+3-4+1-1+1-127+3 = 3 -> f16(3.0) = 0x4200.
    let mut q1 = [0u8; 36];
    quantize_row(GgmlType::Q8_1, &x, &mut q1).unwrap();
    assert_eq!(&q1[..4], &[0x00, 0x3c, 0x00, 0x42]);
}

/// The NEON `Q8_K` quantizer gives the scalar reference's bytes (`q8::quantize_q8_k`, itself
/// checked against ggml's algorithm above) on many blocks: random scales, the grid's exact
/// halves, ties of opposite sign for the largest magnitude, a largest magnitude in every lane
/// position, and the blocks it hands to the scalar code (NaN, overflowing inverse scale).
#[cfg(target_arch = "aarch64")]
#[test]
fn neon_q8_k_quantizer_gives_the_scalar_bytes() {
    let mut rng = Rng::new(29);
    let mut vectors = activation_vectors(&mut rng);
    for pos in 0..QK_K {
        let mut x: Vec<f32> = (0..QK_K).map(|_| rng.normal()).collect();
        x[pos] = if pos % 2 == 0 { 9.0 } else { -9.0 };
        x[(pos + 97) % QK_K] = -x[pos];
        vectors.push(x);
    }
    let (mut neon_blocks, mut total) = (0, 0);
    for x in vectors {
        let mut want = vec![0u8; GgmlType::Q8_K.row_bytes(x.len()).unwrap()];
        super::q8::quantize_q8_k(&x, &mut want);
        let mut got = vec![0u8; want.len()];
        quantize_row_on(Backend::Neon, GgmlType::Q8_K, &x, &mut got).unwrap();
        assert_eq!(got, want, "{:?}", &x[..4]);
        total += x.len() / QK_K;
        neon_blocks += x
            .chunks_exact(QK_K)
            .filter(|b| b.iter().all(|v| v.is_finite()) && b.iter().any(|v| v.abs() > 1e-30))
            .count();
    }
    assert!(neon_blocks > 256 && total > neon_blocks, "{neon_blocks} of {total} blocks on the NEON path");
}

#[test]
fn quantize_q8_k_bit_exact_with_ggml_algorithm() {
    let mut rng = Rng::new(8);
    let mut vectors = activation_vectors(&mut rng);
    // NaN and infinity inside a block (ggml's garbage, reproduced), ties of
    // opposite sign for the largest magnitude.
    let mut odd = vec![0.25f32; 1024];
    odd[5] = f32::NAN;
    odd[300] = f32::INFINITY;
    odd[520] = -3.0;
    odd[530] = 3.0;
    odd[800] = 2.0;
    odd[801] = -2.0;
    vectors.push(odd);
    for x in vectors {
        let want = ref_q8_k(&x);
        for backend in backends() {
            let mut got = vec![0u8; GgmlType::Q8_K.row_bytes(x.len()).unwrap()];
            quantize_row_on(backend, GgmlType::Q8_K, &x, &mut got).unwrap();
            assert_eq!(got, want, "{backend:?}");
        }
        let mut got = vec![0u8; GgmlType::Q8_K.row_bytes(x.len()).unwrap()];
        quantize_row(GgmlType::Q8_K, &x, &mut got).unwrap();
        assert_eq!(got, want);
        let mut act = Vec::new();
        quantize_activation(GgmlType::Q4_K, &x, &mut act).unwrap();
        assert_eq!(act, got, "K-quant activations are the reference Q8_K");
    }
}

#[test]
fn quantize_q8_k_known_vector() {
    // max = +127 -> iscale = -1, d = -1.0; q = nearest_int(-x) with halves to even.
    let mut x = [0f32; 256];
    x[..6].copy_from_slice(&[127.0, 2.5, -3.5, 0.5, -1.5, 100.0]);
    x[16] = -7.0;
    let mut q = [0u8; 292];
    quantize_row(GgmlType::Q8_K, &x, &mut q).unwrap();
    assert_eq!(&q[..4], &(-1.0f32).to_le_bytes());
    let want: [i8; 6] = [-127, -2, 4, 0, 2, -100];
    assert_eq!(&q[4..10], &want.map(|v| v as u8));
    // bsums[0] = -127 - 2 + 4 + 0 + 2 - 100 = -223, bsums[1] = 7.
    assert_eq!(&q[260..264], &[(-223i16).to_le_bytes(), 7i16.to_le_bytes()].concat()[..]);
    assert!(q[264..].iter().all(|&b| b == 0));
}

#[test]
fn fp16_conversion_bit_exact_with_ggml() {
    // Known values, worked out by hand.
    let known: &[(f32, u16)] = &[
        (1.0, 0x3c00),
        (-2.0, 0xc000),
        (65504.0, 0x7bff),
        (65519.0, 0x7bff),
        (65520.0, 0x7c00),              // halfway to the next binade: rounds to even -> inf
        (1.0 + 1.0 / 2048.0, 0x3c00),   // tie -> even mantissa
        (1.0 + 3.0 / 2048.0, 0x3c02),   // tie -> even mantissa (up)
        (2f32.powi(-24), 0x0001),       // smallest subnormal
        (2f32.powi(-25), 0x0000),       // tie -> 0
        (3.0 * 2f32.powi(-25), 0x0002), // tie -> 2
        (-0.0, 0x8000),
        (f32::INFINITY, 0x7c00),
        (f32::NEG_INFINITY, 0xfc00),
        (f32::NAN, 0x7e00),
        (f32::from_bits(0xffc0_1234), 0xfe00),
    ];
    for &(x, want) in known {
        assert_eq!(float::f32_to_f16_bits(x), want, "{x:e}");
        assert_eq!(ggml_fp32_to_fp16(x), want, "test transcription, {x:e}");
    }
    // Every exponent, many mantissas, both signs, against the transcription.
    let mut rng = Rng::new(9);
    for exp in 0..256u32 {
        for _ in 0..200 {
            let bits = (rng.next_u64() as u32 & 0x807f_ffff) | (exp << 23);
            let x = f32::from_bits(bits);
            assert_eq!(float::f32_to_f16_bits(x), ggml_fp32_to_fp16(x), "{bits:#010x}");
        }
    }
    let x: Vec<f32> = (0..64).map(|_| rng.normal() * 100.0).collect();
    let mut got = vec![0u8; 128];
    quantize_row(GgmlType::F16, &x, &mut got).unwrap();
    for (i, v) in x.iter().enumerate() {
        assert_eq!(u16::from_le_bytes([got[2 * i], got[2 * i + 1]]), ggml_fp32_to_fp16(*v));
    }
}

#[test]
fn bf16_conversion_bit_exact_with_ggml() {
    let known: &[(f32, u16)] = &[
        (1.0, 0x3f80),
        (f32::from_bits(0x3f80_8000), 0x3f80), // tie -> even
        (f32::from_bits(0x3f81_8000), 0x3f82), // tie -> even (up)
        (f32::from_bits(0x3f80_8001), 0x3f81),
        (f32::from_bits(0x7f80_0001), 0x7fc0), // signalling NaN -> quiet
        (f32::INFINITY, 0x7f80),
        (f32::from_bits(0x7f7f_ffff), 0x7f80), // max finite rounds to inf
    ];
    for &(x, want) in known {
        assert_eq!(float::f32_to_bf16_bits(x), want, "{:#010x}", x.to_bits());
    }
    let mut rng = Rng::new(10);
    let x: Vec<f32> = (0..4096).map(|_| f32::from_bits(rng.next_u64() as u32)).collect();
    let mut got = vec![0u8; 8192];
    quantize_row(GgmlType::BF16, &x, &mut got).unwrap();
    for (i, v) in x.iter().enumerate() {
        assert_eq!(u16::from_le_bytes([got[2 * i], got[2 * i + 1]]), ggml_fp32_to_bf16(*v));
    }
}

#[test]
fn float_round_trips() {
    let mut rng = Rng::new(11);
    let x: Vec<f32> = (0..300).map(|_| rng.normal()).collect();
    let mut b = vec![0u8; 1200];
    quantize_row(GgmlType::F32, &x, &mut b).unwrap();
    let mut y = vec![0f32; 300];
    dequantize_row(GgmlType::F32, &b, &mut y).unwrap();
    assert_eq!(x, y);
    for ty in [GgmlType::F16, GgmlType::BF16] {
        let mut b = vec![0u8; 600];
        quantize_row(ty, &x, &mut b).unwrap();
        dequantize_row(ty, &b, &mut y).unwrap();
        let rel = if ty == GgmlType::F16 { 1.0 / 2048.0 } else { 1.0 / 256.0 };
        for (a, c) in x.iter().zip(&y) {
            assert!((a - c).abs() <= a.abs() * rel, "{ty}: {a} -> {c}");
        }
    }
}

// ---------------------------------------------------------------------------
// Weight quantizers: round-trip quality
// ---------------------------------------------------------------------------

fn round_trip_rel_rmse(ty: GgmlType, x: &[f32]) -> (f64, f32) {
    let mut q = vec![0u8; ty.row_bytes(x.len()).unwrap()];
    quantize_row(ty, x, &mut q).unwrap();
    let mut y = vec![0f32; x.len()];
    dequantize_row(ty, &q, &mut y).unwrap();
    let err: f64 = x.iter().zip(&y).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
    let sig: f64 = x.iter().map(|a| (*a as f64).powi(2)).sum();
    let max_err = x.iter().zip(&y).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    ((err / sig).sqrt(), max_err)
}

#[test]
fn weight_quantizers_round_trip_within_bounds() {
    let mut rng = Rng::new(12);
    // Bounds on relative RMS error for ~normal data; an n-bit uniform quantizer
    // over about +-3 sigma gives roughly 3.5 / 2^n / sqrt(3).
    let cases = [
        (GgmlType::Q2_K, 0.40),
        (GgmlType::Q3_K, 0.20),
        (GgmlType::Q4_K, 0.10),
        (GgmlType::Q5_K, 0.05),
        (GgmlType::Q6_K, 0.025),
        (GgmlType::Q4_0, 0.12),
        (GgmlType::Q4_1, 0.10),
        (GgmlType::Q5_0, 0.06),
        (GgmlType::Q5_1, 0.05),
        (GgmlType::Q8_0, 0.006),
    ];
    for (ty, bound) in cases {
        for scale in [1e-3f32, 1.0, 50.0] {
            let x: Vec<f32> = (0..4096).map(|_| rng.normal() * scale).collect();
            let (rel, max_err) = round_trip_rel_rmse(ty, &x);
            assert!(rel < bound, "{ty} scale {scale}: relative RMSE {rel:.4} >= {bound}");
            let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
            assert!(max_err <= amax * 2.0 * bound as f32 * 4.0, "{ty}: max error {max_err} vs amax {amax}");
        }
    }
}

#[test]
fn weight_quantizers_handle_zero_constant_and_offset_blocks() {
    let mut rng = Rng::new(13);
    for ty in WEIGHT_TYPES {
        if matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
            continue;
        }
        let n = 512;
        let zeros = vec![0f32; n];
        let mut q = vec![0u8; ty.row_bytes(n).unwrap()];
        quantize_row(ty, &zeros, &mut q).unwrap();
        let mut y = vec![1f32; n];
        dequantize_row(ty, &q, &mut y).unwrap();
        assert!(y.iter().all(|&v| v == 0.0), "{ty}: zeros do not round-trip");

        // All-positive data with an offset (exercises the mins of the
        // asymmetric types) and sparse spikes.
        let x: Vec<f32> = (0..n).map(|_| 2.0 + rng.unit()).collect();
        let (rel, _) = round_trip_rel_rmse(ty, &x);
        assert!(rel < 0.35, "{ty}: offset data relative RMSE {rel}");
        let mut spikes = vec![0f32; n];
        for i in (0..n).step_by(97) {
            spikes[i] = if i % 2 == 0 { 5.0 } else { -3.0 };
        }
        quantize_row(ty, &spikes, &mut q).unwrap();
        dequantize_row(ty, &q, &mut y).unwrap();
        assert!(y.iter().all(|v| v.is_finite()), "{ty}");
        for i in (0..n).step_by(97) {
            assert!((y[i] - spikes[i]).abs() < 0.5 * spikes[i].abs(), "{ty}: spike {i}: {} vs {}", y[i], spikes[i]);
        }
    }
}

// ---------------------------------------------------------------------------
// Errors, not panics
// ---------------------------------------------------------------------------

#[test]
fn bad_input_gives_errors() {
    use GgmlType::*;
    let mut out = vec![0f32; 256];
    assert!(matches!(
        dequantize_row(Q4_K, &[0u8; 143], &mut out),
        Err(QuantError::Length { expected: 144, got: 143, .. })
    ));
    assert!(matches!(
        dequantize_row(Q4_K, &[0u8; 144], &mut out[..200]),
        Err(QuantError::NotBlockMultiple { n: 200, block: 256, .. })
    ));
    assert!(matches!(dequantize_row(IQ2_XXS, &[0u8; 66], &mut out), Err(QuantError::Unsupported(IQ2_XXS))));
    assert!(matches!(quantize_row(Q6_K, &out, &mut [0u8; 209]), Err(QuantError::Length { .. })));
    assert!(matches!(quantize_row(I32, &out, &mut [0u8; 1024]), Err(QuantError::Unsupported(I32))));
    assert!(matches!(
        quantize_row_q8_0_with(Q4_0, Q8Flavor::X86, &out, &mut [0u8; 144]),
        Err(QuantError::Unsupported(Q4_0))
    ));

    let w = vec![0u8; 144];
    let x = vec![0u8; 292];
    assert!(try_vec_dot(Q4_K, 256, &w, &x).is_ok());
    assert!(matches!(try_vec_dot(Q4_K, 256, &w[..100], &x), Err(QuantError::Length { .. })));
    assert!(matches!(try_vec_dot(Q4_K, 256, &w, &x[..291]), Err(QuantError::Length { .. })));
    assert!(matches!(try_vec_dot(Q4_K, 255, &w, &x), Err(QuantError::NotBlockMultiple { .. })));
    assert!(matches!(try_vec_dot(IQ4_XS, 256, &w, &x), Err(QuantError::Unsupported(IQ4_XS))));
    for b in Backend::ALL {
        if b.is_available() {
            assert!(matches!(vec_dot_on(b, Q6_K, 256, &w, &x), Err(QuantError::Length { .. })));
        } else {
            assert!(matches!(vec_dot_on(b, Q4_K, 256, &w, &x), Err(QuantError::BackendUnavailable(_))));
        }
    }

    let w = vec![0u8; 4 * 144];
    let mut o = vec![0f32; 2];
    assert!(try_matvec(Q4_K, &w, 2..4, 256, &x, &mut o).is_ok());
    assert!(matches!(try_matvec(Q4_K, &w, 3..5, 256, &x, &mut o), Err(QuantError::Length { .. })));
    assert!(matches!(try_matvec(Q4_K, &w, 0..3, 256, &x, &mut o), Err(QuantError::Length { .. })));
    #[expect(clippy::reversed_empty_ranges, reason = "testing that a reversed range is rejected")]
    let reversed = 3..1;
    assert!(try_matvec(Q4_K, &w, reversed, 256, &x, &mut []).is_err());
    assert!(matches!(try_matvec(Q4_K, &w, 0..2, 256, &x[..10], &mut o), Err(QuantError::Length { .. })));

    let mut buf = Vec::new();
    assert!(matches!(quantize_activation(IQ1_S, &out, &mut buf), Err(QuantError::Unsupported(IQ1_S))));
    assert!(matches!(quantize_activation(Q4_K, &out[..100], &mut buf), Err(QuantError::NotBlockMultiple { .. })));
}

#[test]
fn empty_rows_and_vectors() {
    for backend in backends() {
        for ty in WEIGHT_TYPES {
            assert_eq!(vec_dot_on(backend, ty, 0, &[], &[]).unwrap(), 0.0, "{ty}");
            let mut out = vec![f32::NAN; 3];
            matvec_on(backend, ty, &[], 0..3, 0, &[], &mut out).unwrap();
            assert_eq!(out, [0.0; 3], "{ty}");
        }
    }
    let mut out = vec![f32::NAN; 2];
    matvec(GgmlType::Q4_K, &[], 5..7, 0, &[], &mut out);
    assert_eq!(out, [0.0; 2]);
    let mut buf = vec![1u8; 10];
    quantize_activation(GgmlType::Q4_K, &[], &mut buf).unwrap();
    assert!(buf.is_empty());
}

#[test]
fn checked_entry_points_never_panic() {
    // Random types (supported or not), lengths and bytes, including floats that
    // are NaN, infinite or subnormal: every checked function returns.
    let mut rng = Rng::new(17);
    let specials = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1e-40, -0.0, 3e38, -3e38];
    for _ in 0..3000 {
        let ty = GgmlType::ALL[rng.range(0, GgmlType::ALL.len() as i32 - 1) as usize];
        let n = match rng.range(0, 3) {
            0 => rng.range(0, 40) as usize,
            1 => 32 * rng.range(0, 9) as usize,
            _ => 256 * rng.range(0, 3) as usize,
        };
        let bytes = ty.row_bytes(n).unwrap_or(n);
        let len = if rng.range(0, 4) == 0 { bytes + rng.range(0, 3) as usize } else { bytes };
        let w = rng.bytes(len);
        let x: Vec<f32> =
            (0..n).map(|i| if i % 7 == 3 { specials[i % specials.len()] } else { rng.normal() * 10.0 }).collect();
        let mut out = vec![0f32; n];
        let _ = dequantize_row(ty, &w, &mut out);
        let mut q = vec![0u8; len];
        let _ = quantize_row(ty, &x, &mut q);
        let mut act = Vec::new();
        if quantize_activation(ty, &x, &mut act).is_ok() {
            let _ = try_vec_dot(ty, n, &w, &act);
            for b in backends() {
                let _ = vec_dot_on(b, ty, n, &w, &act);
            }
            let mut o = [0f32; 1];
            let _ = try_matvec(ty, &w, 0..1, n, &act, &mut o);
        }
        for f in [Q8Flavor::Reference, Q8Flavor::X86, Q8Flavor::Arm] {
            let _ = quantize_row_q8_0_with(ty, f, &x, &mut q);
        }
    }
}

#[test]
fn quantize_activation_reuses_the_buffer() {
    let x = vec![0.5f32; 2048];
    let mut buf = Vec::with_capacity(GgmlType::Q8_K.row_bytes(2048).unwrap());
    let ptr = buf.as_ptr();
    quantize_activation(GgmlType::Q4_K, &x, &mut buf).unwrap();
    assert_eq!(buf.len(), 8 * 292);
    assert_eq!(buf.as_ptr(), ptr);
    quantize_activation(GgmlType::Q8_0, &x, &mut buf).unwrap();
    assert_eq!(buf.len(), 64 * 34);
    assert_eq!(buf.as_ptr(), ptr);
}

#[test]
#[should_panic(expected = "not supported")]
fn vec_dot_panics_on_unsupported_type() {
    vec_dot(GgmlType::IQ2_XS, 256, &[0u8; 74], &[0u8; 292]);
}

// ---------------------------------------------------------------------------
// ggml's float summation order (the AVX2 kernels, bit for bit)
// ---------------------------------------------------------------------------
//
// Scalar models of the kernels a native x86 llama.cpp build runs for one token,
// written from ggml-cpu's `arch/x86/quants.c`, `arch/x86/repack.cpp` and `vec.cpp`:
// the integer lanes and every f32 operation in order. The AVX2 kernels must give the
// same bits (this is what makes `cargo xtask parity` bit-exact).

/// `hsum_float_8`: `(l0+l4) + (l2+l6)` and `(l1+l5) + (l3+l7)`, then their sum.
fn ggml_hsum8(a: &[f32; 8]) -> f32 {
    let r = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    (r[0] + r[2]) + (r[1] + r[3])
}

/// Q4_K/Q5_K element `e`: (unsigned quant, sub-block scale, sub-block min).
fn k4_elem(ty: GgmlType, b: &[u8], e: usize) -> (i32, i32, i32) {
    let (c, t, l) = (e / 64, (e % 64) / 32, e % 32);
    let qs_off = if ty == GgmlType::Q4_K { 16 } else { 48 };
    let byte = b[qs_off + 32 * c + l];
    let mut q = if t == 0 { byte & 0xf } else { byte >> 4 };
    if ty == GgmlType::Q5_K {
        q |= ((b[16 + l] >> (2 * c + t)) & 1) << 4;
    }
    let j = e / 32;
    let s = &b[4..16];
    let (sc, m) = if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    };
    (q as i32, sc as i32, m as i32)
}

fn q8k_d(y: &[u8]) -> f32 {
    f32::from_le_bytes([y[0], y[1], y[2], y[3]])
}

fn q8k_bsum(y: &[u8], g: usize) -> i32 {
    i16::from_le_bytes([y[260 + 2 * g], y[261 + 2 * g]]) as i32
}

/// The dot product in the float order of the kernel a llama.cpp build of ISA level `level`
/// runs for one token (`Avx2`, `Avx512`, or `Neon` on this CPU).
fn ggml_order_dot(level: Backend, ty: GgmlType, w: &[u8], x: &[u8], n: usize) -> f32 {
    use GgmlType::*;
    if level == Backend::Neon {
        // The order of the layout llama.cpp gives the weights on this CPU.
        #[cfg(target_arch = "aarch64")]
        if let Some(v) = ggml_neon_repacked_dot(ty, w, x, super::neon::layout()) {
            return v;
        }
        return ggml_neon_dot(ty, w, x, neon_sdot());
    }
    let ts = ty.type_size();
    let xs = ty.vec_dot_type().type_size();
    match ty {
        // ggml_vec_dot_q8_0_q8_0, AVX2.
        Q8_0 => {
            let mut acc = [0f32; 8];
            for (a, b) in w.chunks_exact(ts).zip(x.chunks_exact(xs)) {
                let d = h(a, 0) * h(b, 0);
                for (l, al) in acc.iter_mut().enumerate() {
                    let s: i32 = (4 * l..4 * l + 4).map(|e| i8at(a, 2 + e) * i8at(b, 2 + e)).sum();
                    *al = d.mul_add(s as f32, *al);
                }
            }
            ggml_hsum8(&acc)
        }
        // ggml_gemv_q4_K_8x8_q8_K (AVX2), one row.
        Q4_K => {
            let (mut acc, mut accm) = (0f32, 0f32);
            for (a, y) in w.chunks_exact(ts).zip(x.chunks_exact(xs)) {
                let mut isum = 0i32;
                let mut imin = 0i32;
                for e in 0..QK_K {
                    let (q, sc, _) = k4_elem(ty, a, e);
                    isum += sc * q * i8at(y, 4 + e);
                }
                for j in 0..8 {
                    let (_, _, m) = k4_elem(ty, a, 32 * j);
                    imin += m * (q8k_bsum(y, 2 * j) + q8k_bsum(y, 2 * j + 1));
                }
                let dy = q8k_d(y);
                acc = (isum as f32).mul_add(h(a, 0) * dy, acc);
                accm = (imin as f32).mul_add(h(a, 2) * dy, accm);
            }
            acc - accm
        }
        // ggml_vec_dot_q5_K_q8_K, AVX2.
        Q5_K => {
            let mut acc = [0f32; 8];
            let mut summs = 0f32;
            for (a, y) in w.chunks_exact(ts).zip(x.chunks_exact(xs)) {
                let dy = q8k_d(y);
                let mut imin = 0i32;
                for j in 0..8 {
                    let (_, _, m) = k4_elem(ty, a, 32 * j);
                    imin += m * (q8k_bsum(y, 2 * j) + q8k_bsum(y, 2 * j + 1));
                }
                summs = (-dy * h(a, 2)).mul_add(imin as f32, summs);
                let d = dy * h(a, 0);
                for (l, al) in acc.iter_mut().enumerate() {
                    let mut s = 0i32;
                    for j in 0..8 {
                        for e in 32 * j + 4 * l..32 * j + 4 * l + 4 {
                            let (q, sc, _) = k4_elem(ty, a, e);
                            s += sc * q * i8at(y, 4 + e);
                        }
                    }
                    *al = d.mul_add(s as f32, *al);
                }
            }
            ggml_hsum8(&acc) + summs
        }
        // ggml_vec_dot_q6_K_q8_K, AVX2: unsigned quants, the -32 through bsums.
        Q6_K => {
            let mut acc = [0f32; 8];
            for (a, y) in w.chunks_exact(ts).zip(x.chunks_exact(xs)) {
                let sc = |s: usize| a[192 + s] as i8 as i32;
                let qu = |e: usize| {
                    let (hf, k, l) = (e / 128, (e % 128) / 32, e % 32);
                    let ql = a[64 * hf + 32 * (k & 1) + l];
                    let low = if k < 2 { ql & 0xf } else { ql >> 4 };
                    (low | (((a[128 + 32 * hf + l] >> (2 * k)) & 3) << 4)) as i32
                };
                let d = q8k_d(y) * h(a, 208);
                for (l, al) in acc.iter_mut().enumerate() {
                    let mut s = 0i32;
                    for g in 0..8 {
                        for e in 32 * g + 4 * l..32 * g + 4 * l + 4 {
                            s += sc(e / 16) * qu(e) * i8at(y, 4 + e);
                        }
                    }
                    s -= 32 * (q8k_bsum(y, 2 * l) * sc(2 * l) + q8k_bsum(y, 2 * l + 1) * sc(2 * l + 1));
                    *al = d.mul_add(s as f32, *al);
                }
            }
            ggml_hsum8(&acc)
        }
        // ggml_vec_dot_f32 / ggml_vec_dot_f16, AVX-512 (16 lanes) or AVX (8 lanes).
        F32 | F16 => {
            let val = |b: &[u8], i: usize| {
                if ty == F32 {
                    f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]])
                } else {
                    h(b, 2 * i)
                }
            };
            let wide = level == Backend::Avx512;
            let lanes = if wide { 16 } else { 8 };
            let np = n - n % (4 * lanes);
            let mut acc = vec![[0f32; 16]; 4];
            for i in (0..np).step_by(4 * lanes) {
                for (j, aj) in acc.iter_mut().enumerate() {
                    for (l, a) in aj.iter_mut().enumerate().take(lanes) {
                        let k = i + j * lanes + l;
                        *a = val(w, k).mul_add(val(x, k), *a);
                    }
                }
            }
            let s: Vec<f32> = (0..16).map(|l| (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l])).collect();
            let red = if wide {
                let t: [f32; 8] = std::array::from_fn(|l| s[l + 8] + s[l]);
                ggml_hsum8(&t)
            } else {
                let t = [s[0] + s[4], s[1] + s[5], s[2] + s[6], s[3] + s[7]];
                (t[0] + t[1]) + (t[2] + t[3])
            };
            if ty == F32 {
                (np..n).fold(red, |acc, k| val(w, k).mul_add(val(x, k), acc))
            } else {
                (np..n).fold(f64::from(red), |acc, k| acc + f64::from(val(w, k) * val(x, k))) as f32
            }
        }
        // Q2_K: ggml_vec_dot_q2_K_q8_K (AVX2) at the avx2 level; the repacked
        // ggml_gemv_q2_K_8x8_q8_K at the avx512 level. Q3_K: ggml_vec_dot_q3_K_q8_K (AVX2).
        Q2_K | Q3_K => {
            let mut acc = [0f32; 8];
            let (mut acc1, mut accm1) = (0f32, 0f32);
            for (a, y) in w.chunks_exact(ts).zip(x.chunks_exact(xs)) {
                // (quant, scale) of element e.
                let elem = |e: usize| -> (i32, i32) {
                    let (hf, k, l) = (e / 128, (e % 128) / 32, e % 32);
                    let s = e / 16;
                    if ty == Q2_K {
                        (((a[16 + 32 * hf + l] >> (2 * k)) & 3) as i32, (a[s] & 15) as i32)
                    } else {
                        let low = ((a[32 + 32 * hf + l] >> (2 * k)) & 3) as i32;
                        let hbit = (a[l] >> (4 * hf + k)) & 1;
                        let sc = &a[96..108];
                        let lo4 = if s < 8 { sc[s] & 15 } else { sc[s - 8] >> 4 };
                        let hi2 = (sc[8 + s % 4] >> (2 * (s / 4))) & 3;
                        (low - if hbit == 1 { 0 } else { 4 }, (lo4 | (hi2 << 4)) as i32 - 32)
                    }
                };
                let dy = q8k_d(y);
                let lane = |m: usize| -> i32 {
                    (0..8)
                        .flat_map(|g| 32 * g + 4 * m..32 * g + 4 * m + 4)
                        .map(|e| {
                            let (q, sc) = elem(e);
                            sc * q * i8at(y, 4 + e)
                        })
                        .sum()
                };
                if ty == Q3_K {
                    let d = dy * h(a, 108);
                    for (m, am) in acc.iter_mut().enumerate() {
                        *am = d.mul_add(lane(m) as f32, *am);
                    }
                    continue;
                }
                let min = |s: usize| (a[s] >> 4) as i32;
                let (dw, dminw) = (h(a, 80), h(a, 82));
                if level == Backend::Avx512 {
                    let isum: i32 = (0..8).map(lane).sum();
                    let imin: i32 = (0..16).map(|s| min(s) * q8k_bsum(y, s)).sum();
                    acc1 = (isum as f32).mul_add(dw * dy, acc1);
                    accm1 = (imin as f32).mul_add(dminw * dy, accm1);
                } else {
                    for (l, al) in acc.iter_mut().enumerate() {
                        let ml = min(2 * l) * q8k_bsum(y, 2 * l) + min(2 * l + 1) * q8k_bsum(y, 2 * l + 1);
                        *al = (-dy * dminw).mul_add(ml as f32, *al);
                    }
                    for (m, am) in acc.iter_mut().enumerate() {
                        *am = (dy * dw).mul_add(lane(m) as f32, *am);
                    }
                }
            }
            if ty == Q2_K && level == Backend::Avx512 { acc1 - accm1 } else { ggml_hsum8(&acc) }
        }
        BF16 => ggml_bf16_dot(
            match level {
                Backend::Avx512 if cpu_has("avx512_bf16") => Bf16Shape::Avx512Bf16,
                Backend::Avx512 => Bf16Shape::Avx512F,
                _ => Bf16Shape::Avx2,
            },
            w,
            x,
            n,
        ),
        _ => unreachable!("no ggml-order model for {ty}"),
    }
}

/// Whether the `neon` level's kernels use `sdot` on this CPU.
fn neon_sdot() -> bool {
    #[cfg(target_arch = "aarch64")]
    {
        super::neon::dotprod()
    }
    #[cfg(not(target_arch = "aarch64"))]
    {
        false
    }
}

/// The `neon` level's types with a kernel of their own (the others are the scalar kernels).
const NEON_TYPES: [GgmlType; 8] = [
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::MXFP4,
];

/// The float types whose `neon` kernels follow ggml's NEON order (`F32`, `F16`: kernels of the
/// `neon` module; `BF16`: the scalar kernel, whose order ggml's NEON build shares).
const NEON_FLOAT_TYPES: [GgmlType; 3] = [GgmlType::F32, GgmlType::F16, GgmlType::BF16];

/// Quant `e` (0..32) of a `Q4_0` block: the low nibbles of `qs` are elements 0..16, the high
/// nibbles 16..32, each minus 8.
fn q4_0_elem(b: &[u8], e: usize) -> i32 {
    let q = b[2 + e % 16];
    (if e < 16 { q & 0xf } else { q >> 4 }) as i32 - 8
}

/// Quant `e` (0..256) of a `Q2_K` (`Q3_K` when `q3`) block, as ggml's reference dequantizer reads
/// it: bits `2k` of `qs[32h + l]` for `e = 128h + 32k + l`; `Q3_K` subtracts 4 where bit `4h + k`
/// of `hmask[l]` is clear.
fn k23_elem(b: &[u8], e: usize, q3: bool) -> i32 {
    let (hf, k, l) = (e / 128, (e % 128) / 32, e % 32);
    let qs = if q3 { 32 } else { 16 };
    let low = ((b[qs + 32 * hf + l] >> (2 * k)) & 3) as i32;
    if q3 && (b[l] >> (4 * hf + k)) & 1 == 0 { low - 4 } else { low }
}

/// The dot product in the float order of ggml's NEON `ggml_vec_dot_*` as GCC compiles it for
/// aarch64 (read off the object code: which products are fused, which are not), with `sdot`'s
/// lanes (`sdot`) or those of ggml's emulation of it.
fn ggml_neon_dot(ty: GgmlType, w: &[u8], x: &[u8], sdot: bool) -> f32 {
    use GgmlType::*;
    let ts = ty.type_size();
    let xs = ty.vec_dot_type().type_size();
    let blocks = w.chunks_exact(ts).zip(x.chunks_exact(xs));
    match ty {
        Q8_0 | Q4_0 => {
            // The i32 lane of quant e: sdot sums 4 consecutive bytes of each 16; the emulation
            // pairs bytes 2l, 2l+1 of each 8-byte half.
            let lane = |e: usize| if sdot { (e % 16) / 4 } else { (e % 8) / 2 };
            let quant = |a: &[u8], e: usize| if ty == Q8_0 { i8at(a, 2 + e) } else { q4_0_elem(a, e) };
            let lanes = |a: &[u8], b: &[u8]| -> [i32; 4] {
                let mut l = [0i32; 4];
                for e in 0..32 {
                    l[lane(e)] += quant(a, e) * i8at(b, 2 + e);
                }
                l
            };
            let hadd = |v: [f32; 4]| (v[0] + v[1]) + (v[2] + v[3]);
            let nb = w.len() / ts;
            let mut s = [[0f32; 4]; 2];
            let mut tail = None;
            for (i, (a, b)) in blocks.enumerate() {
                let d = h(a, 0) * h(b, 0);
                let l = lanes(a, b);
                if i + 1 == nb && nb % 2 == 1 {
                    tail = Some((l.iter().sum::<i32>(), d));
                    continue;
                }
                // vmlaq_n_f32: a multiply, then an add.
                for (sl, li) in s[i % 2].iter_mut().zip(l) {
                    *sl += li as f32 * d;
                }
            }
            let sum = hadd(s[0]) + hadd(s[1]);
            match tail {
                None => sum,
                // Q8_0: `sumf += sumi*(d_w*d_x)`, fused.
                Some((sumi, d)) if ty == Q8_0 => (sumi as f32).mul_add(d, sum),
                // Q4_0: `sumf += sumi*d_w*d_x`: `sumi*d_w` rounded, then fused with d_x.
                Some((sumi, _)) => {
                    let (a, b) = (&w[(nb - 1) * ts..], &x[(nb - 1) * xs..]);
                    (sumi as f32 * h(a, 0)).mul_add(h(b, 0), sum)
                }
            }
        }
        Q2_K | Q3_K => {
            let q3 = ty == Q3_K;
            let mut sum = 0f32;
            for (a, y) in blocks {
                let sc = |s: usize| -> i32 {
                    if q3 {
                        let lo = if s < 8 { a[96 + s] & 0xf } else { a[96 + s - 8] >> 4 };
                        let hi = (a[104 + s % 4] >> (2 * (s / 4))) & 3;
                        (lo | (hi << 4)) as i32 - 32
                    } else {
                        (a[s] & 0xf) as i32
                    }
                };
                let isum: i32 = (0..QK_K).map(|e| sc(e / 16) * k23_elem(a, e, q3) * i8at(y, 4 + e)).sum();
                let dy = q8k_d(y);
                if q3 {
                    // sum += d * isum, fused.
                    sum = (isum as f32).mul_add(dy * h(a, 108), sum);
                } else {
                    // sum += dmin * imin (dmin = -d_x * dmin_w), then sum += d * isum: both fused.
                    let imin: i32 = (0..16).map(|s| (a[s] >> 4) as i32 * q8k_bsum(y, s)).sum();
                    sum = (imin as f32).mul_add(-(dy * h(a, 82)), sum);
                    sum = (isum as f32).mul_add(dy * h(a, 80), sum);
                }
            }
            sum
        }
        Q4_K | Q5_K => {
            let mut sum = 0f32;
            for (a, y) in blocks {
                let isum: i32 = (0..QK_K)
                    .map(|e| {
                        let (q, sc, _) = k4_elem(ty, a, e);
                        sc * q * i8at(y, 4 + e)
                    })
                    .sum();
                let imin: i32 =
                    (0..8).map(|j| k4_elem(ty, a, 32 * j).2 * (q8k_bsum(y, 2 * j) + q8k_bsum(y, 2 * j + 1))).sum();
                let dy = q8k_d(y);
                let (d, dmin) = (dy * h(a, 0), dy * h(a, 2));
                if ty == Q4_K {
                    // sumf -= dmin * imin; sumf += d * isum: two fused multiply-adds.
                    sum = (-dmin).mul_add(imin as f32, sum);
                    sum = (isum as f32).mul_add(d, sum);
                } else {
                    // sumf += d * isum - dmin * imin: the first product fused, the second not.
                    sum += d.mul_add(isum as f32, -(dmin * imin as f32));
                }
            }
            sum
        }
        Q6_K => {
            let mut sum = 0f32;
            for (a, y) in blocks {
                let sc = |s: usize| a[192 + s] as i8 as i32;
                let qu = |e: usize| {
                    let (hf, k, l) = (e / 128, (e % 128) / 32, e % 32);
                    let ql = a[64 * hf + 32 * (k & 1) + l];
                    let low = if k < 2 { ql & 0xf } else { ql >> 4 };
                    (low | (((a[128 + 32 * hf + l] >> (2 * k)) & 3) << 4)) as i32
                };
                let isum: i32 = (0..QK_K).map(|e| sc(e / 16) * qu(e) * i8at(y, 4 + e)).sum();
                let imin: i32 = (0..16).map(|s| sc(s) * q8k_bsum(y, s)).sum();
                sum = (h(a, 208) * q8k_d(y)).mul_add((isum - 32 * imin) as f32, sum);
            }
            sum
        }
        // ggml_vec_dot_mxfp4_q8_0: blocks in pairs, sum += i0*(d_x0*E0) + i1*(d_x1*E1), the second
        // product fused into the first; a last odd block fused into the sum.
        MXFP4 => {
            use super::mxfp4::{KVALUES, e8m0_half};
            let isum = |a: &[u8], b: &[u8]| -> i32 {
                (0..32)
                    .map(|e| {
                        let q = if e < 16 { a[1 + e] & 0xf } else { a[1 + e - 16] >> 4 };
                        i32::from(KVALUES[usize::from(q)]) * i8at(b, 2 + e)
                    })
                    .sum()
            };
            let (wb, xb): (Vec<&[u8]>, Vec<&[u8]>) = blocks.unzip();
            let mut sum = 0f32;
            let mut ib = 0;
            while ib + 1 < wb.len() {
                let (a0, a1, b0, b1) = (wb[ib], wb[ib + 1], xb[ib], xb[ib + 1]);
                let p = isum(a0, b0) as f32 * (h(b0, 0) * e8m0_half(a0[0]));
                sum += (isum(a1, b1) as f32).mul_add(h(b1, 0) * e8m0_half(a1[0]), p);
                ib += 2;
            }
            if ib < wb.len() {
                sum = (isum(wb[ib], xb[ib]) as f32).mul_add(h(xb[ib], 0) * e8m0_half(wb[ib][0]), sum);
            }
            sum
        }
        // ggml_vec_dot_f32 / _f16 (NEON without FP16 vector arithmetic, as no reproduced build
        // has it): 4 accumulators of 4 lanes over 16-element steps, each a fused multiply-add,
        // reduced per lane as (a0 + a2) + (a1 + a3), then (l0 + l1) + (l2 + l3) (`vaddvq_f32`);
        // the f32 tail fused into the f32 sum, the f16 tail's f32 products added in f64.
        F32 | F16 => {
            let val = |b: &[u8], i: usize| {
                if ty == F32 {
                    f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]])
                } else {
                    h(b, 2 * i)
                }
            };
            let n = w.len() / ts;
            let np = n - n % 16;
            let mut acc = [[0f32; 4]; 4];
            for i in (0..np).step_by(16) {
                for (j, aj) in acc.iter_mut().enumerate() {
                    for (l, a) in aj.iter_mut().enumerate() {
                        *a = val(w, i + 4 * j + l).mul_add(val(x, i + 4 * j + l), *a);
                    }
                }
            }
            let s: [f32; 4] = std::array::from_fn(|l| (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]));
            let red = (s[0] + s[1]) + (s[2] + s[3]);
            if ty == F32 {
                // GCC vectorises the tail when it is over 3 long: groups of 4 unfused products
                // added in order, the rest fused.
                let unfused = if n - np > 3 { np + (n - np) / 4 * 4 } else { np };
                let red = (np..unfused).fold(red, |acc, k| acc + val(w, k) * val(x, k));
                (unfused..n).fold(red, |acc, k| val(w, k).mul_add(val(x, k), acc))
            } else {
                (np..n).fold(f64::from(red), |acc, k| acc + f64::from(val(w, k) * val(x, k))) as f32
            }
        }
        // ggml_vec_dot_bf16 has no NEON path: the f32 products summed in f64, in order.
        BF16 => {
            let val = |b: &[u8], i: usize| f32::from_bits((u16::from_le_bytes([b[2 * i], b[2 * i + 1]]) as u32) << 16);
            (0..w.len() / 2).fold(0f64, |acc, k| acc + f64::from(val(w, k) * val(x, k))) as f32
        }
        _ => unreachable!("no NEON kernel for {ty}"),
    }
}

/// The dot product in the float order of ggml's aarch64 repacked GEMV for `ty` in `layout`
/// (`arch/arm/repack.cpp` as GCC compiles it: `vfmaq_f32` fused, `vmlaq_f32`/`vmlsq_f32` a
/// multiply then an add, read off the object code), or `None` where that layout keeps ggml's
/// `ggml_vec_dot_*` order ([`ggml_neon_dot`]): every type at `Plain`, and `Q6_K` at `Dotprod`,
/// whose 8x4 GEMV sums each block's whole integer into one fused multiply-add, as its `vec_dot`
/// does.
#[cfg(target_arch = "aarch64")]
fn ggml_neon_repacked_dot(ty: GgmlType, w: &[u8], x: &[u8], layout: super::neon::Layout) -> Option<f32> {
    use super::neon::Layout;
    use GgmlType::*;
    if layout == Layout::Plain {
        return None;
    }
    let ts = ty.type_size();
    let xs = ty.vec_dot_type().type_size();
    let blocks = w.chunks_exact(ts).zip(x.chunks_exact(xs));
    let mut sum = 0f32;
    match ty {
        // ggml_gemv_q{8,4}_0_4x4_q8_0 and _4x8_: per block sum = fma(f32(isum), d_x * d_w, sum).
        Q8_0 | Q4_0 => {
            let quant = |a: &[u8], e: usize| if ty == Q8_0 { i8at(a, 2 + e) } else { q4_0_elem(a, e) };
            for (a, b) in blocks {
                let isum: i32 = (0..32).map(|e| quant(a, e) * i8at(b, 2 + e)).sum();
                sum = (isum as f32).mul_add(h(b, 0) * h(a, 0), sum);
            }
        }
        // ggml_gemv_mxfp4_4x4_q8_0 (both layouts): sum = sum + (d_x * E(e)) * f32(isum), unfused.
        MXFP4 => {
            use super::mxfp4::{KVALUES, e8m0_half};
            for (a, b) in blocks {
                let isum: i32 = (0..32)
                    .map(|e| {
                        let q = if e < 16 { a[1 + e] & 0xf } else { a[1 + e - 16] >> 4 };
                        i32::from(KVALUES[usize::from(q)]) * i8at(b, 2 + e)
                    })
                    .sum();
                sum += (h(b, 0) * e8m0_half(a[0])) * isum as f32;
            }
        }
        // ggml_gemv_q{4,5}_K_8x4_q8_K and _8x8_: per pair of sub-blocks one fused multiply-add
        // (8x4) or two (8x8); the mins' correction per block, for Q5_K 8x8 per pair.
        Q4_K | Q5_K => {
            for (a, y) in blocks {
                let sub = |j: usize| -> (i32, i32) {
                    let (_, sc, mn) = k4_elem(ty, a, 32 * j);
                    let i: i32 = (32 * j..32 * j + 32).map(|e| k4_elem(ty, a, e).0 * i8at(y, 4 + e)).sum();
                    (sc * i, mn * (q8k_bsum(y, 2 * j) + q8k_bsum(y, 2 * j + 1)))
                };
                let dy = q8k_d(y);
                let (d, dmin) = (h(a, 0) * dy, h(a, 2) * dy);
                let per_pair_mins = ty == Q5_K && layout == Layout::I8mm;
                let mut imin = 0;
                for p in 0..4 {
                    let ((lo, mlo), (hi, mhi)) = (sub(2 * p), sub(2 * p + 1));
                    if layout == Layout::Dotprod {
                        sum = ((lo + hi) as f32).mul_add(d, sum);
                    } else {
                        sum = (lo as f32).mul_add(d, sum);
                        sum = (hi as f32).mul_add(d, sum);
                    }
                    if per_pair_mins {
                        sum -= (mlo + mhi) as f32 * dmin;
                    }
                    imin += mlo + mhi;
                }
                if !per_pair_mins {
                    sum -= imin as f32 * dmin;
                }
            }
        }
        // ggml_gemv_q6_K_8x8_q8_K: the block's whole integer, multiplied, then added (unfused).
        Q6_K if layout == Layout::I8mm => {
            for (a, y) in blocks {
                let sc = |s: usize| a[192 + s] as i8 as i32;
                let qu = |e: usize| {
                    let (hf, k, l) = (e / 128, (e % 128) / 32, e % 32);
                    let ql = a[64 * hf + 32 * (k & 1) + l];
                    let low = if k < 2 { ql & 0xf } else { ql >> 4 };
                    (low | (((a[128 + 32 * hf + l] >> (2 * k)) & 3) << 4)) as i32
                };
                let isum: i32 = (0..QK_K).map(|e| sc(e / 16) * qu(e) * i8at(y, 4 + e)).sum();
                let imin: i32 = (0..16).map(|s| sc(s) * q8k_bsum(y, s)).sum();
                sum += (isum - 32 * imin) as f32 * (h(a, 208) * q8k_d(y));
            }
        }
        _ => return None,
    }
    Some(sum)
}

/// Both variants of the `neon` kernels (`sdot` and its emulation, which put other quants in each
/// lane) against ggml's order, so the one this CPU does not select is checked too (qemu's default
/// CPU has `dotprod`; `cargo xtask test --target aarch64` also runs with a CPU without it).
#[cfg(target_arch = "aarch64")]
#[test]
fn neon_kernels_follow_ggml_order_with_and_without_sdot() {
    assert!(Backend::Neon.is_available(), "aarch64 without ASIMD");
    let mut rng = Rng::new(19);
    let variants: Vec<bool> = if neon_sdot() { vec![false, true] } else { vec![false] };
    // Cases where the two lane layouts give different Q8_0 bits (the check can tell them apart).
    let mut lanes_differ = 0;
    // Per repacked type, cases where its repacked order gives other bits than `vec_dot`'s.
    let mut orders_differ = std::collections::HashMap::new();
    use super::neon::Layout;
    for (sd, layout) in
        variants.into_iter().flat_map(|sd| [Layout::Plain, Layout::Dotprod, Layout::I8mm].map(|l| (sd, l)))
    {
        for ty in NEON_TYPES {
            let k = super::neon::kernel_with(ty, sd, layout).unwrap();
            let m = super::neon::multi_kernel_with(ty, sd, layout).unwrap();
            for nblocks in [1usize, 2, 3, 8, 17] {
                let cols = nblocks * ty.block_size();
                let rows = 5;
                let rb = ty.row_bytes(cols).unwrap();
                let w: Vec<u8> = (0..rows).flat_map(|_| random_row(ty, cols, &mut rng)).collect();
                let xs: Vec<Vec<u8>> = (0..3).map(|_| random_row(ty.vec_dot_type(), cols, &mut rng)).collect();
                let mut outs = vec![vec![f32::NAN; rows]; xs.len()];
                let xr: Vec<&[u8]> = xs.iter().map(Vec::as_slice).collect();
                let mut or: Vec<&mut [f32]> = outs.iter_mut().map(Vec::as_mut_slice).collect();
                (m.f)(&w, rb, &xr, &mut or);
                for (t, x) in xs.iter().enumerate() {
                    let mut mv = vec![f32::NAN; rows];
                    (k.matvec)(&w, rb, cols, x, &mut mv);
                    for r in 0..rows {
                        let row = &w[r * rb..(r + 1) * rb];
                        let plain = ggml_neon_dot(ty, row, x, sd).to_bits();
                        let want = ggml_neon_repacked_dot(ty, row, x, layout).map_or(plain, f32::to_bits);
                        if ty == GgmlType::Q8_0
                            && sd
                            && layout == Layout::Plain
                            && ggml_neon_dot(ty, row, x, false).to_bits() != want
                        {
                            lanes_differ += 1;
                        }
                        if want != plain {
                            *orders_differ.entry((ty, layout)).or_insert(0) += 1;
                        }
                        let what = format!("sdot {sd} {layout:?} {ty} {nblocks} blocks act {t} row {r}");
                        assert_eq!((k.vec_dot)(cols, row, x).to_bits(), want, "vec_dot {what}");
                        assert_eq!(mv[r].to_bits(), want, "matvec {what}");
                        assert_eq!(outs[t][r].to_bits(), want, "multi {what}");
                    }
                }
            }
        }
    }
    assert!(!neon_sdot() || lanes_differ > 0, "no Q8_0 case tells sdot's lanes from the emulation's");
    // Each repacked order is told apart from `vec_dot`'s by some case (the check has teeth).
    for ty in [GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::MXFP4, GgmlType::Q4_K, GgmlType::Q5_K] {
        for layout in [Layout::Dotprod, Layout::I8mm] {
            assert!(
                orders_differ.get(&(ty, layout)).is_some_and(|&n| n > 0),
                "{ty} {layout:?}: no case differs from vec_dot"
            );
        }
    }
    assert!(
        orders_differ.get(&(GgmlType::Q6_K, Layout::I8mm)).is_some_and(|&n| n > 0),
        "Q6_K I8mm: no case differs from vec_dot"
    );
}

/// The `neon` level's float dot products against ggml's NEON order for every length up to 70
/// (every tail of the 16-element steps, with and without full steps before it).
#[cfg(target_arch = "aarch64")]
#[test]
fn neon_float_dots_follow_ggml_order_for_every_tail() {
    assert!(Backend::Neon.is_available(), "aarch64 without ASIMD");
    let mut rng = Rng::new(23);
    for ty in NEON_FLOAT_TYPES {
        for n in 1..=70 {
            let w = random_row(ty, n, &mut rng);
            let x = random_row(ty.vec_dot_type(), n, &mut rng);
            let got = vec_dot_on(Backend::Neon, ty, n, &w, &x).unwrap();
            let want = ggml_neon_dot(ty, &w, &x, false);
            assert_eq!(got.to_bits(), want.to_bits(), "{ty} n {n}: {got} vs ggml order {want}");
        }
    }
}

/// The shapes of `ggml_vec_dot_bf16` on x86.
#[derive(Clone, Copy, Debug)]
enum Bf16Shape {
    /// AVX2: 4 accumulators of 8 lanes over 32-element steps.
    Avx2,
    /// AVX512F without BF16: 2 accumulators of 16 lanes over 32-element steps.
    Avx512F,
    /// AVX512-BF16: 2 `vdpbf16ps` accumulators over 64-element steps (per lane, the odd
    /// product then the even one, each exact in f32 and added with one rounding).
    Avx512Bf16,
}

/// `ggml_vec_dot_bf16` in shape `shape`: each vector sum (FMAs, as GCC contracts `c += x*y`)
/// reduced and added in f64, then the f64 tail.
fn ggml_bf16_dot(shape: Bf16Shape, w: &[u8], x: &[u8], n: usize) -> f32 {
    let val = |b: &[u8], i: usize| f32::from_bits(u32::from(u16::from_le_bytes([b[2 * i], b[2 * i + 1]])) << 16);
    let reduce16 = |s: &[f32; 16]| ggml_hsum8(&std::array::from_fn(|l| s[l + 8] + s[l]));
    let (sum, np) = match shape {
        Bf16Shape::Avx512Bf16 => {
            let np = n - n % 64;
            let mut c = [[0f32; 16]; 2];
            for i in (0..np).step_by(64) {
                for (h, ch) in c.iter_mut().enumerate() {
                    for (j, a) in ch.iter_mut().enumerate() {
                        let k = i + 32 * h + 2 * j;
                        *a = val(w, k + 1).mul_add(val(x, k + 1), *a);
                        *a = val(w, k).mul_add(val(x, k), *a);
                    }
                }
            }
            (f64::from(reduce16(&c[0])) + f64::from(reduce16(&c[1])), np)
        }
        Bf16Shape::Avx512F => {
            let np = n - n % 32;
            let mut c = [[0f32; 16]; 2];
            for i in (0..np).step_by(32) {
                for (h, ch) in c.iter_mut().enumerate() {
                    for (l, a) in ch.iter_mut().enumerate() {
                        *a = val(w, i + 16 * h + l).mul_add(val(x, i + 16 * h + l), *a);
                    }
                }
            }
            (f64::from(reduce16(&c[0])) + f64::from(reduce16(&c[1])), np)
        }
        Bf16Shape::Avx2 => {
            let np = n - n % 32;
            let mut c = [[0f32; 8]; 4];
            for i in (0..np).step_by(32) {
                for (j, cj) in c.iter_mut().enumerate() {
                    for (l, a) in cj.iter_mut().enumerate() {
                        *a = val(w, i + 8 * j + l).mul_add(val(x, i + 8 * j + l), *a);
                    }
                }
            }
            let s: [f32; 8] = std::array::from_fn(|l| (c[0][l] + c[2][l]) + (c[1][l] + c[3][l]));
            (f64::from(ggml_hsum8(&s)), np)
        }
    };
    (np..n).fold(sum, |acc, k| acc + f64::from(val(w, k) * val(x, k))) as f32
}

/// Both AVX-512 `BF16` kernels (the dispatch picks one by the CPU's AVX512-BF16) in their ggml
/// shapes, so the one this CPU does not select is checked too.
#[cfg(target_arch = "x86_64")]
#[test]
fn avx512_bf16_kernels_follow_both_ggml_shapes() {
    if !Backend::Avx512.is_available() {
        assert!(!cpu_has("avx512f") || !cpu_has("avx512bw"), "AVX-512 CPU without the avx512 level");
        return;
    }
    let mut rng = Rng::new(18);
    for n in [7usize, 32, 64, 100, 1000, 4099] {
        let w = random_row(GgmlType::BF16, n, &mut rng);
        let x = random_row(GgmlType::BF16, n, &mut rng);
        // SAFETY: the avx512 level (AVX-512 F/BW/DQ/VL, AVX2, FMA) was checked above.
        let f = unsafe { super::avx512::dot_bf16_f(&w, &x) };
        assert_eq!(f.to_bits(), ggml_bf16_dot(Bf16Shape::Avx512F, &w, &x, n).to_bits(), "avx512f n={n}");
        if cpu_has("avx512_bf16") {
            // SAFETY: AVX512-BF16 was checked too.
            let d = unsafe { super::avx512::dot_bf16_dp(&w, &x) };
            assert_eq!(d.to_bits(), ggml_bf16_dot(Bf16Shape::Avx512Bf16, &w, &x, n).to_bits(), "dpbf16 n={n}");
        }
    }
}

#[test]
fn simd_kernels_follow_ggml_float_order_bit_for_bit() {
    // The property is about the SIMD kernels; the scalar ones promise no order.
    assert!(!cfg!(target_arch = "x86_64") || Backend::Avx2.is_available(), "x86_64 without AVX2");
    let mut rng = Rng::new(11);
    assert!(!cfg!(target_arch = "aarch64") || Backend::Neon.is_available(), "aarch64 without ASIMD");
    for backend in simd_backends() {
        for ty in [
            GgmlType::Q8_0,
            GgmlType::Q4_K,
            GgmlType::Q5_K,
            GgmlType::Q6_K,
            GgmlType::F32,
            GgmlType::F16,
            GgmlType::BF16,
        ] {
            if backend == Backend::Neon && !NEON_TYPES.contains(&ty) && !NEON_FLOAT_TYPES.contains(&ty) {
                continue; // the scalar kernels there, which promise no order
            }
            // Block counts: odd, even, above the row loops' precomputation limits; 19 rows (not a
            // multiple of the 2- or 8-row steps).
            for cols in [256usize, 768, 1024, 1056, 2048, 4352, 17408] {
                let cols = if ty.block_size() == 1 { cols + 37 } else { cols };
                if !cols.is_multiple_of(ty.block_size()) {
                    continue;
                }
                let rows = 19;
                let rb = ty.row_bytes(cols).unwrap();
                let w: Vec<u8> = (0..rows).flat_map(|_| random_row(ty, cols, &mut rng)).collect();
                let x = random_row(ty.vec_dot_type(), cols, &mut rng);
                let mut out = vec![f32::NAN; rows];
                matvec_on(backend, ty, &w, 0..rows, cols, &x, &mut out).unwrap();
                for (r, o) in out.iter().enumerate() {
                    let row = &w[r * rb..(r + 1) * rb];
                    let want = ggml_order_dot(backend, ty, row, &x, cols);
                    let one = vec_dot_on(backend, ty, cols, row, &x).unwrap();
                    assert_eq!(
                        o.to_bits(),
                        want.to_bits(),
                        "{backend} {ty} {cols} cols row {r}: matvec {o} vs ggml order {want}"
                    );
                    assert_eq!(
                        one.to_bits(),
                        want.to_bits(),
                        "{backend} {ty} {cols} cols row {r}: vec_dot {one} vs ggml order {want}"
                    );
                }
            }
        }
    }
}

#[test]
fn matvec_multi_is_bit_identical_to_matvec() {
    let mut rng = Rng::new(12);
    for backend in backends() {
        for ty in WEIGHT_TYPES {
            if ty == GgmlType::Q8_1 {
                continue; // activation-only type
            }
            // Block counts below, at and above the multi kernels' stack limits.
            for cols in [256usize, 512, 1024, 4096, 4352, 17408] {
                if !cols.is_multiple_of(ty.block_size()) {
                    continue;
                }
                let rows = 13;
                let w: Vec<u8> = (0..rows).flat_map(|_| random_row(ty, cols, &mut rng)).collect();
                for n_act in [1, 3, 4, 6, 8, 9, 17] {
                    let xs: Vec<Vec<u8>> = (0..n_act).map(|_| random_row(ty.vec_dot_type(), cols, &mut rng)).collect();
                    let xr: Vec<&[u8]> = xs.iter().map(Vec::as_slice).collect();
                    let mut outs = vec![vec![f32::NAN; 11]; n_act];
                    let mut or: Vec<&mut [f32]> = outs.iter_mut().map(Vec::as_mut_slice).collect();
                    matvec_multi_on(backend, ty, &w, 2..13, cols, &xr, &mut or).unwrap();
                    for (t, x) in xs.iter().enumerate() {
                        let mut one = vec![f32::NAN; 11];
                        matvec_on(backend, ty, &w, 2..13, cols, x, &mut one).unwrap();
                        for (i, (a, b)) in outs[t].iter().zip(&one).enumerate() {
                            assert_eq!(
                                a.to_bits(),
                                b.to_bits(),
                                "{backend} {ty} {cols} cols, {n_act} activations, t {t} row {i}: {a} vs {b}"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn matvec_multi_at_the_process_level_matches_matvec() {
    let mut rng = Rng::new(13);
    let (ty, cols, rows) = (GgmlType::Q4_K, 1024, 16);
    let w: Vec<u8> = (0..rows).flat_map(|_| random_row(ty, cols, &mut rng)).collect();
    let xs: Vec<Vec<u8>> = (0..5).map(|_| random_row(ty.vec_dot_type(), cols, &mut rng)).collect();
    let xr: Vec<&[u8]> = xs.iter().map(Vec::as_slice).collect();
    let mut outs = vec![vec![f32::NAN; rows]; 5];
    let mut or: Vec<&mut [f32]> = outs.iter_mut().map(Vec::as_mut_slice).collect();
    matvec_multi(ty, &w, 0..rows, cols, &xr, &mut or);
    for (t, x) in xs.iter().enumerate() {
        let mut one = vec![f32::NAN; rows];
        matvec_on(backend(), ty, &w, 0..rows, cols, x, &mut one).unwrap();
        assert_eq!(outs[t], one, "activation {t}");
    }
}
