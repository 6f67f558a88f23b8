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
//! VKQ32 = f32(VKQ)
//! with a sink logit k (gpt-oss's attn_sinks), after the first chunk's loop:
//!   if k > M: ms = expf(M - k); M = k; VKQ32 *= ms; vs = 1   else: ms = 1; vs = expf(k - M)
//!   S = fma(S, ms, vs)
//! out  = VKQ32 * (1/S)                             (ggml_vec_scale_f32 by the inverse)
//! ```
//!
//! Visible cells: the positions up to the query's (causal mask), and for a sliding-window layer
//! only those less than the window behind it (llama.cpp's standard SWA mask). The cells are
//! visited in cache order ([`LayerKv`]: position order for a full cache, llama.cpp's ring order
//! for a windowed one).
//!
//! `expf` is libm's (Rust's `f32::exp` calls the same C library function). The f16 vector
//! operations are element-wise, so their vector width does not matter (no reproduced build has
//! AVX512-FP16, whose native half-precision `ggml_vec_mad_f16` would round differently). The fused `S` update is
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
//! thread count (pass the same thread count as llama.cpp to get its numbers);
//! [`AttnSplit::for_cells`] from a ring's used cells (llama.cpp's SWA cache of
//! [`crate::arch::window_cells`] cells, which assumes its `n_ubatch` of 256, as in the parity
//! runner).
//!
//! # Not reproduced
//! ggml's tiled kernel for prompt batches of ≥ `GGML_FA_TILE_Q` tokens (a GEMM-like f32 path);
//! prompt batches here use the per-row loop. Token-by-token prompt processing (`--ubatch 1`),
//! which is what `cargo xtask parity` compares, runs the per-row loop on both sides.

use half::f16;

use crate::quant::{self, GgmlType};

/// The f16 KV cache of one layer: per cell, `kv_dim` f16 values (little-endian bytes) for K and
/// for V, heads side by side (ggml's non-transposed layout for flash attention), and the position
/// the cell holds.
///
/// A full-context cache appends (cell `j` holds position `j`). A windowed layer's cache is a ring
/// of `cap` cells ([`crate::arch::window_cells`]) filled in llama.cpp's order: cells `0, 1, …` in
/// turn, then from cell 0 again, each overwriting the oldest position (llama.cpp's SWA cache with
/// `find_slot` starting at the head, whose cells are reused once outside the window). Attention
/// visits the cells in index order, like ggml's loop over the KV view.
#[derive(Debug, Default)]
pub struct LayerKv {
    pub k: Vec<u8>,
    pub v: Vec<u8>,
    /// Position held by each cell.
    pub pos: Vec<u32>,
    /// Ring size in cells (0 = append without bound).
    pub cap: usize,
    /// Next cell to write in a full ring.
    head: usize,
}

impl LayerKv {
    /// A cache that keeps at most `cap` cells as a ring (0 = unbounded).
    pub fn ring(cap: usize) -> LayerKv {
        LayerKv { cap, ..Default::default() }
    }

    /// Cells written so far (at most `cap` for a ring).
    pub fn cells(&self) -> usize {
        self.pos.len()
    }

    /// Stores position `pos`'s K and V rows (`kv_dim` floats each), rounded to f16.
    pub fn push(&mut self, pos: usize, k: &[f32], v: &[f32]) {
        let row = 2 * k.len();
        if self.cap == 0 || self.pos.len() < self.cap {
            push_f16(&mut self.k, k);
            push_f16(&mut self.v, v);
            self.pos.push(pos as u32);
            self.head = self.pos.len() % self.cap.max(1);
        } else {
            let c = self.head;
            f16_into(&mut self.k[c * row..(c + 1) * row], k);
            f16_into(&mut self.v[c * row..(c + 1) * row], v);
            self.pos[c] = pos as u32;
            self.head = (c + 1) % self.cap;
        }
    }

    pub fn clear(&mut self) {
        self.k.clear();
        self.v.clear();
        self.pos.clear();
        self.head = 0;
    }
}

fn push_f16(buf: &mut Vec<u8>, x: &[f32]) {
    let start = buf.len();
    buf.resize(start + 2 * x.len(), 0);
    f16_into(&mut buf[start..], x);
}

fn f16_into(dst: &mut [u8], x: &[f32]) {
    // F16 "quantization" is ggml's fp32 -> fp16 conversion (round to nearest even), the same
    // as `ggml_set_rows` into the F16 cache.
    quant::quantize_row(GgmlType::F16, x, dst).expect("f16 row of matching length");
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
    /// The split llama.cpp uses for a batch of one token at position `pos` with `nth` threads
    /// (a full-context cache: the token's cell is `pos`).
    pub fn for_decode(pos: usize, nth: usize) -> Option<AttnSplit> {
        Self::for_cells(pos + 1, nth)
    }

    /// The split for a single-token batch when `used` cells of the cache are in use (llama.cpp's
    /// `n_kv`: the used cells padded to 256, at most the cache, which is itself a multiple of 256).
    pub fn for_cells(used: usize, nth: usize) -> Option<AttnSplit> {
        let n_kv = used.next_multiple_of(KV_PAD);
        (n_kv >= SPLIT_MIN_KV).then(|| AttnSplit { n_kv, chunk: n_kv.div_ceil(nth.max(1)) })
    }
}

/// Which cells a query sees: positions `<= pos` (causal) and, with a window `w > 0`, the last `w`
/// positions (`pos - cell < w`, llama.cpp's standard SWA mask).
#[derive(Debug, Clone, Copy)]
pub struct Visible {
    pub pos: usize,
    pub window: usize,
}

impl Visible {
    #[inline]
    fn sees(&self, cell_pos: u32) -> bool {
        let p = cell_pos as usize;
        p <= self.pos && (self.window == 0 || self.pos - p < self.window)
    }
}

/// One query head against the cache: `out = softmax(scale · K q) V` over the cells of KV head
/// `kvh` that `vis` allows, with the numerics of the module docs. `q16` is the query as f16
/// bytes (`head_dim` values), `kv_dim` the cache's row length in values. With a `sink` logit,
/// the softmax also counts `exp(sink)` in its denominator (ggml's attention sinks, added after
/// the first chunk's loop).
#[expect(clippy::too_many_arguments, reason = "one attention row's full description")]
pub fn attend(
    q16: &[u8],
    kv: &LayerKv,
    kv_dim: usize,
    kvh: usize,
    vis: Visible,
    scale: f32,
    sink: Option<f32>,
    split: Option<AttnSplit>,
    out: &mut [f32],
) {
    let hd = out.len();
    let n_cells = kv.cells();
    let mut acc = vec![f16::ZERO; hd];
    let mut acc32 = vec![0f32; hd];
    // One chunk of cells: (M, S) and the f32 VKQ in `acc32` (ggml converts its f16 accumulator
    // to f32 after the loop, then applies the sink on the first chunk).
    let mut chunk = |r: std::ops::Range<usize>, first: bool, acc32: &mut [f32]| -> (f32, f32) {
        acc.fill(f16::ZERO);
        let (mut m, mut s_sum) = (f32::NEG_INFINITY, 0f32);
        for j in r {
            if !vis.sees(kv.pos[j]) {
                continue;
            }
            let koff = 2 * (j * kv_dim + kvh * hd);
            let s = quant::vec_dot(GgmlType::F16, hd, &kv.k[koff..koff + 2 * hd], q16) * scale;
            let (ms, vs);
            if s > m {
                ms = (m - s).exp();
                m = s;
                vs = 1.0;
                f16_scale(&mut acc, ms);
            } else {
                ms = 1.0;
                vs = (s - m).exp();
            }
            let voff = 2 * (j * kv_dim + kvh * hd);
            f16_mad(&mut acc, &kv.v[voff..voff + 2 * hd], vs);
            s_sum = s_sum.mul_add(ms, vs);
        }
        for (o, a) in acc32.iter_mut().zip(&acc) {
            *o = a.to_f32();
        }
        if let (Some(sk), true) = (sink, first) {
            let (ms, vs);
            if sk > m {
                ms = (m - sk).exp();
                m = sk;
                vs = 1.0;
                acc32.iter_mut().for_each(|o| *o *= ms);
            } else {
                ms = 1.0;
                vs = (sk - m).exp();
            }
            // Not contracted here: `S*ms + vs` of the sink block compiles to a multiply and an add.
            s_sum = s_sum * ms + vs;
        }
        (m, s_sum)
    };
    match split {
        None => {
            let (_, s) = chunk(0..n_cells, true, out);
            let inv = if s == 0.0 { 0.0 } else { 1.0 / s };
            out.iter_mut().for_each(|o| *o *= inv);
        }
        Some(sp) => {
            let (mut m_fin, mut s_fin) = (f32::NEG_INFINITY, 0f32);
            out.fill(0.0);
            let mut c0 = 0;
            while c0 < sp.n_kv {
                let c1 = (c0 + sp.chunk).min(sp.n_kv);
                let (mc, sc) = chunk(c0.min(n_cells)..c1.min(n_cells), c0 == 0, &mut acc32);
                c0 = c1;
                if sc == 0.0 {
                    continue;
                }
                let m_new = m_fin.max(mc);
                let (a, b) = ((m_fin - m_new).exp(), (mc - m_new).exp());
                for (o, &x) in out.iter_mut().zip(&acc32) {
                    *o = o.mul_add(a, x * b);
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

/// `ggml_vec_scale_f16`: `y = f16(f32(y) * s)` element-wise.
fn f16_scale(y: &mut [f16], s: f32) {
    for v in y {
        *v = f16::from_f32(v.to_f32() * s);
    }
}

/// `ggml_vec_mad_f16`: `y = f16(fma(x, s, f32(y)))` element-wise (`x` is f16 bytes).
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

    fn rng(seed: u64) -> impl FnMut() -> f32 {
        let mut s = seed;
        move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        }
    }

    /// `softmax(scale · K q) V` in f64 over the visible positions, a sink counted in the
    /// denominator: the reference for [`attend`].
    fn reference(q16: &[u8], kv: &LayerKv, kv_dim: usize, kvh: usize, vis: Visible, sink: Option<f32>) -> Vec<f64> {
        let hd = q16.len() / 2;
        let f = |c: &[u8], o: usize| f64::from(f16::from_le_bytes([c[o], c[o + 1]]).to_f32());
        let cells: Vec<usize> = (0..kv.cells()).filter(|&j| vis.sees(kv.pos[j])).collect();
        let s: Vec<f64> = cells
            .iter()
            .map(|&j| (0..hd).map(|d| f(&kv.k, 2 * (j * kv_dim + kvh * hd + d)) * f(q16, 2 * d)).sum::<f64>() * 0.125)
            .collect();
        let mx = s.iter().copied().chain(sink.map(f64::from)).fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = s.iter().map(|x| (x - mx).exp()).sum::<f64>() + sink.map_or(0.0, |k| (f64::from(k) - mx).exp());
        (0..hd)
            .map(|d| {
                cells
                    .iter()
                    .zip(&s)
                    .map(|(&j, sj)| (sj - mx).exp() / z * f(&kv.v, 2 * (j * kv_dim + kvh * hd + d)))
                    .sum()
            })
            .collect()
    }

    /// The flash-attention loop agrees with a plain f64 softmax-weighted sum to f16 precision,
    /// and the split path with the one-pass loop to within f16 rounding; with a window, a sink,
    /// and a ring whose cells wrapped around.
    #[test]
    fn matches_reference_softmax() {
        let (hd, kv_dim, n) = (64, 128, 700);
        let mut r = rng(0x1234_5678);
        let q: Vec<f32> = (0..hd).map(|_| r()).collect();
        let q16 = f16_bytes(&q);
        let mut full = LayerKv::default();
        let mut ring = LayerKv::ring(512);
        for p in 0..n {
            let k: Vec<f32> = (0..kv_dim).map(|_| r() * 3.0).collect();
            let v: Vec<f32> = (0..kv_dim).map(|_| r()).collect();
            full.push(p, &k, &v);
            ring.push(p, &k, &v);
        }
        assert_eq!((full.cells(), ring.cells()), (n, 512));
        assert_eq!((ring.pos[0], ring.pos[187], ring.pos[188], ring.pos[511]), (512, 699, 188, 511));
        let kvh = 1;
        let cases = [
            (&full, Visible { pos: 0, window: 0 }, None),
            (&full, Visible { pos: 4, window: 0 }, None),
            (&full, Visible { pos: 299, window: 0 }, Some(0.5)),
            (&full, Visible { pos: n - 1, window: 0 }, None),
            (&full, Visible { pos: n - 1, window: 128 }, Some(2.0)),
            (&ring, Visible { pos: n - 1, window: 128 }, Some(-1.0)),
            (&ring, Visible { pos: n - 1, window: 300 }, None),
        ];
        for (i, (kv, vis, sink)) in cases.into_iter().enumerate() {
            let want = reference(&q16, kv, kv_dim, kvh, vis, sink);
            let mut got = vec![0f32; hd];
            attend(&q16, kv, kv_dim, kvh, vis, 0.125, sink, None, &mut got);
            let mut split = vec![0f32; hd];
            let sp = Some(AttnSplit { n_kv: 768, chunk: 384 });
            attend(&q16, kv, kv_dim, kvh, vis, 0.125, sink, sp, &mut split);
            for d in 0..hd {
                assert!((f64::from(got[d]) - want[d]).abs() < 4e-3, "case {i} d {d}: {} vs {}", got[d], want[d]);
                assert!((got[d] - split[d]).abs() < 4e-3, "split case {i} d {d}: {} vs {}", split[d], got[d]);
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
        // A ring of 512 cells: once full, the view is the whole ring.
        assert_eq!(AttnSplit::for_cells(512, 2), Some(AttnSplit { n_kv: 512, chunk: 256 }));
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
