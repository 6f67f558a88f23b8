//! Attention over an f16 KV cache with the numerics of llama.cpp's CPU flash attention.
//!
//! # What is reproduced (llama.cpp / ggml-cpu `ggml_compute_forward_flash_attn_ext_f16`)
//! llama.cpp's default context (`flash_attn_type = AUTO`) resolves to flash attention on the
//! CPU backend, with an F16 KV cache (`type_k = type_v = F16`). For one query row (one token,
//! one head) ggml then computes, over the visible KV cells `ic = 0, 1, …` in order (masked
//! cells are skipped before any arithmetic):
//!
//! ```text
//! q16  = f16(q)                                   (ggml_cpu_fp32_to_fp16, round to nearest even)
//! s    = vec_dot_f16(K[ic], q16) * scale          (ggml_vec_dot_f16: f32 vector FMA, f64 total)
//! if s > M:  ms = expf(M - s); M = s; VKQ = f16(VKQ * ms); vs = 1     (ggml_vec_scale_f16)
//! else:      ms = 1;          vs = expf(s - M)
//! VKQ  = f16(fma(V[ic], vs, VKQ))                  (ggml_vec_mad_f16, f16 accumulator)
//! S    = fma(S, ms, vs)                            (`S*ms + vs`, contracted by GCC)
//! out  = f32(VKQ) * (1/S)                          (ggml_vec_scale_f32 by the inverse)
//! ```
//!
//! `expf` is libm's (Rust's `f32::exp` calls the same C library function). The f16 vector
//! operations are element-wise, so their vector width does not matter. The fused `S` update is
//! what GCC makes of `S = S*ms + vs` in a GNU C++ build (contraction on); it was confirmed
//! against llama.cpp: with an unfused update the attention outputs differ in the last bit from
//! the third decode step on, with the fused one every step of the parity runs is identical.
//!
//! # The split-KV decode path
//! When a batch holds one token and ggml's KV view has `n_kv >= 512` cells, ggml splits the
//! cells into `nth` (thread count) contiguous chunks of `ceil(n_kv / nth)`, runs the loop above
//! on each (without the final division) and merges the partial `(M, S, VKQ)` in chunk order:
//! `M' = max(M, Mc)`, `a = expf(M - M')`, `b = expf(Mc - M')`, `VKQ = fma(VKQ, a, VKQc * b)`,
//! `S = fma(S, a, Sc * b)`, skipping chunks with `Sc == 0`, then scales by `1/S`. llama.cpp's
//! `n_kv` is the number of used cells padded to a multiple of 256 (never more than the cache),
//! so [`AttnSplit::for_decode`] derives the chunks from the token's position and the engine's
//! thread count (pass the same thread count as llama.cpp to get its numbers).
//!
//! # Not reproduced
//! ggml's tiled kernel for prompt batches of ≥ `GGML_FA_TILE_Q` tokens (a GEMM-like f32 path);
//! prompt batches here use the per-row loop. Token-by-token prompt processing (`--ubatch 1`),
//! which is what `cargo xtask parity` compares, runs the per-row loop on both sides.

use half::f16;

use crate::quant::{self, GgmlType};

/// The f16 KV cache of one layer: per position, `kv_dim` f16 values (little-endian bytes)
/// for K and for V, heads side by side (ggml's non-transposed layout for flash attention).
#[derive(Debug, Default)]
pub struct LayerKv {
    pub k: Vec<u8>,
    pub v: Vec<u8>,
}

impl LayerKv {
    /// Appends one position's K and V rows (`kv_dim` floats each), rounded to f16.
    pub fn push(&mut self, k: &[f32], v: &[f32]) {
        push_f16(&mut self.k, k);
        push_f16(&mut self.v, v);
    }

    pub fn clear(&mut self) {
        self.k.clear();
        self.v.clear();
    }
}

fn push_f16(buf: &mut Vec<u8>, x: &[f32]) {
    let start = buf.len();
    buf.resize(start + 2 * x.len(), 0);
    // F16 "quantization" is ggml's fp32 -> fp16 conversion (round to nearest even), the same
    // as `ggml_set_rows` into the F16 cache.
    quant::quantize_row(GgmlType::F16, x, &mut buf[start..]).expect("f16 row of matching length");
}

/// How ggml splits the KV cells of a single-token decode across threads (see the module
/// docs); `None` means the one-pass loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnSplit {
    /// ggml's `n_kv` (cells in the KV view).
    pub n_kv: usize,
    /// Cells per chunk, `ceil(n_kv / nth)`.
    pub chunk: usize,
}

/// ggml's minimum KV view size for the split path.
const SPLIT_MIN_KV: usize = 512;
/// llama.cpp pads the KV view to a multiple of this many cells.
const KV_PAD: usize = 256;

impl AttnSplit {
    /// The split llama.cpp uses for a batch of one token at position `pos` with `nth` threads.
    pub fn for_decode(pos: usize, nth: usize) -> Option<AttnSplit> {
        let n_kv = (pos + 1).next_multiple_of(KV_PAD);
        (n_kv >= SPLIT_MIN_KV).then(|| AttnSplit { n_kv, chunk: n_kv.div_ceil(nth.max(1)) })
    }
}

/// One query head against the cache: `out = softmax(scale · K q) V` over cells `0..n_vis`
/// of KV head `kvh`, with the numerics of the module docs. `q16` is the query as f16 bytes
/// (`head_dim` values), `k`/`v` the layer's cache, `kv_dim` its row length in values.
#[expect(clippy::too_many_arguments, reason = "one attention row's full description")]
pub fn attend(
    q16: &[u8],
    k: &[u8],
    v: &[u8],
    kv_dim: usize,
    kvh: usize,
    n_vis: usize,
    scale: f32,
    split: Option<AttnSplit>,
    out: &mut [f32],
) {
    let hd = out.len();
    let mut acc = vec![f16::ZERO; hd];
    let chunk = |r: std::ops::Range<usize>, acc: &mut [f16]| -> (f32, f32) {
        acc.fill(f16::ZERO);
        let (mut m, mut s_sum) = (f32::NEG_INFINITY, 0f32);
        for j in r {
            let koff = 2 * (j * kv_dim + kvh * hd);
            let s = quant::vec_dot(GgmlType::F16, hd, &k[koff..koff + 2 * hd], q16) * scale;
            let (ms, vs);
            if s > m {
                ms = (m - s).exp();
                m = s;
                vs = 1.0;
                f16_scale(acc, ms);
            } else {
                ms = 1.0;
                vs = (s - m).exp();
            }
            let voff = 2 * (j * kv_dim + kvh * hd);
            f16_mad(acc, &v[voff..voff + 2 * hd], vs);
            s_sum = s_sum.mul_add(ms, vs);
        }
        (m, s_sum)
    };
    match split {
        None => {
            let (_, s) = chunk(0..n_vis, &mut acc);
            let inv = if s == 0.0 { 0.0 } else { 1.0 / s };
            for (o, a) in out.iter_mut().zip(&acc) {
                *o = a.to_f32() * inv;
            }
        }
        Some(sp) => {
            let (mut m_fin, mut s_fin) = (f32::NEG_INFINITY, 0f32);
            out.fill(0.0);
            let mut c0 = 0;
            while c0 < sp.n_kv {
                let c1 = (c0 + sp.chunk).min(sp.n_kv);
                let (mc, sc) = chunk(c0.min(n_vis)..c1.min(n_vis), &mut acc);
                c0 = c1;
                if sc == 0.0 {
                    continue;
                }
                let m_new = m_fin.max(mc);
                let (a, b) = ((m_fin - m_new).exp(), (mc - m_new).exp());
                for (o, x) in out.iter_mut().zip(&acc) {
                    *o = o.mul_add(a, x.to_f32() * b);
                }
                s_fin = s_fin.mul_add(a, sc * b);
                m_fin = m_new;
            }
            if s_fin != 0.0 {
                let inv = 1.0 / s_fin;
                out.iter_mut().for_each(|o| *o *= inv);
            }
        }
    }
}

/// `y = f16(f32(y) * s)` element-wise (`ggml_vec_scale_f16`).
fn f16_scale(y: &mut [f16], s: f32) {
    for v in y {
        *v = f16::from_f32(v.to_f32() * s);
    }
}

/// `y = f16(fma(x, s, f32(y)))` element-wise (`ggml_vec_mad_f16`); `x` is f16 bytes.
fn f16_mad(y: &mut [f16], x: &[u8], s: f32) {
    #[cfg(target_arch = "x86_64")]
    if f16c_available() {
        // SAFETY: F16C, AVX and FMA were detected at run time.
        unsafe { f16_mad_f16c(y, x, s) };
        return;
    }
    for (v, b) in y.iter_mut().zip(x.chunks_exact(2)) {
        let xv = f16::from_le_bytes([b[0], b[1]]).to_f32();
        *v = f16::from_f32(xv.mul_add(s, v.to_f32()));
    }
}

#[cfg(target_arch = "x86_64")]
fn f16c_available() -> bool {
    is_x86_feature_detected!("f16c") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("avx")
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,fma,f16c")]
fn f16_mad_f16c(y: &mut [f16], x: &[u8], s: f32) {
    use std::arch::x86_64::*;
    let n = y.len().min(x.len() / 2);
    let vs = _mm256_set1_ps(s);
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: `i + 8 <= n` elements of 2 bytes are in bounds of both `y` and `x`;
        // unaligned loads/stores.
        unsafe {
            let yp = y.as_mut_ptr().add(i).cast::<__m128i>();
            let xv = _mm256_cvtph_ps(_mm_loadu_si128(x.as_ptr().add(2 * i).cast()));
            let yv = _mm256_cvtph_ps(_mm_loadu_si128(yp));
            _mm_storeu_si128(yp, _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_fmadd_ps(xv, vs, yv)));
        }
        i += 8;
    }
    for j in i..n {
        let xv = f16::from_le_bytes([x[2 * j], x[2 * j + 1]]).to_f32();
        y[j] = f16::from_f32(xv.mul_add(s, y[j].to_f32()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f16_bytes(x: &[f32]) -> Vec<u8> {
        x.iter().flat_map(|&v| f16::from_f32(v).to_le_bytes()).collect()
    }

    /// The flash-attention loop agrees with a plain f64 softmax-weighted sum to f16 precision,
    /// and the split path with the one-pass loop to within f16 rounding.
    #[test]
    fn matches_reference_softmax() {
        let (hd, kv_dim, n) = (64, 128, 700);
        let mut rng = 0x1234_5678_u64;
        let mut r = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            (rng >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        };
        let q: Vec<f32> = (0..hd).map(|_| r()).collect();
        let mut kv = LayerKv::default();
        for _ in 0..n {
            let k: Vec<f32> = (0..kv_dim).map(|_| r() * 3.0).collect();
            let v: Vec<f32> = (0..kv_dim).map(|_| r()).collect();
            kv.push(&k, &v);
        }
        let q16 = f16_bytes(&q);
        let qr: Vec<f64> = q.iter().map(|&x| f64::from(f16::from_f32(x).to_f32())).collect();
        let scale = 0.125f32;
        for n_vis in [1, 5, 300, n] {
            let kvh = 1;
            let val = |c: &[u8], j: usize, d: usize| {
                let o = 2 * (j * kv_dim + kvh * hd + d);
                f64::from(f16::from_le_bytes([c[o], c[o + 1]]).to_f32())
            };
            let s: Vec<f64> =
                (0..n_vis).map(|j| (0..hd).map(|d| val(&kv.k, j, d) * qr[d]).sum::<f64>() * 0.125).collect();
            let mx = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = s.iter().map(|x| (x - mx).exp()).sum();
            let want: Vec<f64> =
                (0..hd).map(|d| (0..n_vis).map(|j| (s[j] - mx).exp() / z * val(&kv.v, j, d)).sum()).collect();
            let mut got = vec![0f32; hd];
            attend(&q16, &kv.k, &kv.v, kv_dim, kvh, n_vis, scale, None, &mut got);
            let mut split = vec![0f32; hd];
            attend(
                &q16,
                &kv.k,
                &kv.v,
                kv_dim,
                kvh,
                n_vis,
                scale,
                Some(AttnSplit { n_kv: 768, chunk: 384 }),
                &mut split,
            );
            for d in 0..hd {
                assert!((f64::from(got[d]) - want[d]).abs() < 4e-3, "n_vis {n_vis} d {d}: {} vs {}", got[d], want[d]);
                assert!((got[d] - split[d]).abs() < 4e-3, "split n_vis {n_vis} d {d}: {} vs {}", split[d], got[d]);
            }
        }
    }

    #[test]
    fn split_follows_llama_cpp_padding() {
        assert_eq!(AttnSplit::for_decode(0, 2), None);
        assert_eq!(AttnSplit::for_decode(255, 2), None);
        assert_eq!(AttnSplit::for_decode(256, 2), Some(AttnSplit { n_kv: 512, chunk: 256 }));
        assert_eq!(AttnSplit::for_decode(600, 3), Some(AttnSplit { n_kv: 768, chunk: 256 }));
        assert_eq!(AttnSplit::for_decode(300, 1), Some(AttnSplit { n_kv: 512, chunk: 512 }));
    }

    #[test]
    fn f16_mad_vector_and_scalar_agree() {
        let y0: Vec<f16> = (0..37).map(|i| f16::from_f32(i as f32 * 0.37 - 5.0)).collect();
        let x: Vec<u8> = f16_bytes(&(0..37).map(|i| (i as f32 * 0.11).sin()).collect::<Vec<_>>());
        let mut a = y0.clone();
        f16_mad(&mut a, &x, 0.3);
        for (j, v) in y0.iter().enumerate() {
            let xv = f16::from_le_bytes([x[2 * j], x[2 * j + 1]]).to_f32();
            assert_eq!(a[j], f16::from_f32(xv.mul_add(0.3, v.to_f32())));
        }
    }
}
