//! The blocks a forward pass is built from, and what they share.
//!
//! # Spec
//! A forward pass runs a batch of `n` consecutive tokens at positions `pos0..pos0+n` (a prompt
//! chunk, or one generated token) through
//! [`embed`] → per layer: `attn_norm` → an attention block ([`self_attn`] or [`delta_net`]) →
//! residual add → `ffn_norm` → a feed-forward block ([`moe`] or [`dense_ffn`]) → residual add →
//! [`output`],
//! the shape of llama.cpp's `src/models/*.cpp` graphs. Which blocks a layer runs is its
//! architecture's description ([`crate::arch`]); the loop is `Session::forward` in
//! [`crate::model`]. Activations are row-major `n x width` f32 buffers, token `b` in row `b`;
//! a block reads its input rows and writes its output rows, and the caller adds the residual.
//!
//! The batched path and the token-by-token path are the same code with `n > 1` or `n = 1`:
//! every output element gets the one-token operations (`quant::matvec_multi`), so a batch gives
//! the bits of token-by-token steps (below 256 positions; see [`crate::attention`]).
//!
//! Shared here, with ggml's numerics: [`rms_norm`] (sum of squares in f64, `(x * s) * w`, as
//! `ggml_compute_forward_rms_norm_f32` followed by `ggml_mul`), activation quantization to the
//! weight's `vec_dot_type` before every product ([`QRows`], as ggml's `mul_mat` does), and
//! row-split matrix products on the pool ([`Ctx::matmuls`]; the split does not enter the
//! numerics: each output row is one dot product).
//!
//! Performance rules the blocks follow: the step's buffers live in the session (the `Scratch`
//! of each block, grown to the largest batch and then reused), one fork-join per parallel
//! region, independent products (Q, K, V) in one region.

pub mod delta_net;
pub mod dense_ffn;
pub mod embed;
pub mod moe;
pub mod output;
pub mod self_attn;
pub mod weights;

use std::ops::Range;

use crate::model::{Model, ModelError};
use crate::pool::Pool;
use crate::quant::{self, GgmlType};
pub use weights::{ExpertWeight, Weight};

/// What every block of one forward pass reads.
pub struct Ctx<'a> {
    pub model: &'a Model,
    pub pool: &'a Pool,
    /// Where the MoE block gets each expert's weights ([`moe::ExpertWeights`]).
    pub experts: &'a dyn moe::ExpertWeights,
    /// Tokens in the batch.
    pub n: usize,
    /// Position of the batch's first token.
    pub pos0: usize,
    /// RoPE factors of the batch's positions.
    pub rope: &'a self_attn::Rope,
}

/// One product of a [`Ctx::matmuls`] region: `out[b*w.rows + r] = w[r] · x[b]` for every row `b`
/// of `x`.
pub struct MatJob<'a> {
    pub w: &'a Weight,
    pub x: &'a QRows,
    pub out: &'a mut [f32],
}

impl Ctx<'_> {
    pub fn cfg(&self) -> &crate::arch::Config {
        &self.model.cfg
    }

    /// `out[b*w.rows + r] = w[r] · x[b]` for every row `b` of `x`.
    pub fn matmul(&self, w: &Weight, x: &QRows, out: &mut [f32]) {
        self.matmuls(&mut [MatJob { w, x, out }]);
    }

    /// Several independent products in one parallel region (e.g. Q, K and V), so that decode
    /// pays one fork-join instead of three. Products with few rows run on the caller.
    pub fn matmuls(&self, jobs: &mut [MatJob<'_>]) {
        let threads = self.pool.threads();
        let mut tasks = Vec::new(); // (job, r0, r1)
        for (j, job) in jobs.iter().enumerate() {
            let chunk = row_chunk(job.w.rows, threads, job.x.n());
            for r0 in (0..job.w.rows).step_by(chunk) {
                tasks.push((j, r0, (r0 + chunk).min(job.w.rows)));
            }
        }
        let outs: Vec<SharedMut<f32>> = jobs.iter_mut().map(|j| SharedMut::new(j.out)).collect();
        let jobs = &*jobs;
        let run = |t: usize| {
            let (j, r0, r1) = tasks[t];
            let job = &jobs[j];
            let rows = job.w.rows;
            let bytes = self.model.bytes(job.w.range.clone());
            let xs: Vec<&[u8]> = (0..job.x.n()).map(|b| job.x.row(b)).collect();
            let mut os: Vec<&mut [f32]> = (0..job.x.n())
                // SAFETY: task t writes only rows r0..r1 of job j's output for each token; the
                // (job, row range) pairs of the tasks are disjoint.
                .map(|b| unsafe { outs[j].slice(b * rows + r0..b * rows + r1) })
                .collect();
            // One pass over the rows for all tokens (bit-identical to one matvec per token).
            quant::matvec_multi(job.w.ty, bytes, r0..r1, job.w.cols, &xs, &mut os);
        };
        let total: usize = jobs.iter().map(|j| j.w.rows * j.x.n()).sum();
        if total < 128 {
            (0..tasks.len()).for_each(run);
        } else {
            self.pool.run(tasks.len(), &run);
        }
    }
}

/// Rows of activations quantized for a weight type's `vec_dot_type` (ggml quantizes `src1` of
/// every `mul_mat` this way), reused across steps.
#[derive(Debug, Default)]
pub struct QRows {
    buf: Vec<u8>,
    one: Vec<u8>,
    row: usize,
    n: usize,
}

impl QRows {
    /// Quantizes each `cols`-wide row of `x` for products with weights of type `ty`.
    pub fn quantize(&mut self, ty: GgmlType, x: &[f32], cols: usize) -> Result<&Self, ModelError> {
        self.buf.clear();
        self.n = 0;
        for xb in x.chunks(cols) {
            quant::quantize_activation(ty, xb, &mut self.one)?;
            self.row = self.one.len();
            self.buf.extend_from_slice(&self.one);
            self.n += 1;
        }
        Ok(self)
    }

    /// Number of rows.
    pub fn n(&self) -> usize {
        self.n
    }

    pub fn row(&self, b: usize) -> &[u8] {
        &self.buf[b * self.row..(b + 1) * self.row]
    }
}

/// `out = (x * 1/sqrt(mean(x²) + eps)) * w`, the mean of squares summed in f64 (ggml's RMS
/// norm, then its multiplication by the norm weight).
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let sum: f64 = x.iter().map(|&v| f64::from(v * v)).sum();
    let mean = (sum / x.len() as f64) as f32;
    let scale = 1.0 / (mean + eps).sqrt();
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = (v * scale) * g;
    }
}

/// [`rms_norm`] of every `w.len()`-wide row of `x`.
pub fn rms_norm_rows(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    for (xb, ob) in x.chunks(w.len()).zip(out.chunks_mut(w.len())) {
        rms_norm(xb, w, eps, ob);
    }
}

/// `x += y` element-wise (the residual connection, ggml's `add`).
pub fn add(x: &mut [f32], y: &[f32]) {
    for (xv, &v) in x.iter_mut().zip(y) {
        *xv += v;
    }
}

/// `v` resized to `n` elements (grown once, then reused; the contents are stale, and every
/// block overwrites what it reads).
pub fn sized(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    v.resize(n, 0.0);
    v
}

/// Rows per task for a matrix product over `rows` rows: enough tasks to balance, big enough to
/// amortise dispatch; multiples of 16.
pub fn row_chunk(rows: usize, threads: usize, batch: usize) -> usize {
    let target_tasks = threads * 4;
    let mut c = rows.div_ceil(target_tasks).next_multiple_of(16);
    if batch > 1 {
        c = c.min(64);
    }
    c.clamp(16, rows.max(16))
}

/// Raw pointer to a buffer whose disjoint parts are written by different pool tasks.
#[derive(Clone, Copy)]
pub struct SharedMut<T>(*mut T, usize);
// SAFETY: used only inside `Pool::run` regions where every task writes a range no other task
// touches (documented at each use), and the buffer outlives the region.
unsafe impl<T: Send> Send for SharedMut<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for SharedMut<T> {}

impl<T> SharedMut<T> {
    pub fn new(s: &mut [T]) -> Self {
        SharedMut(s.as_mut_ptr(), s.len())
    }

    /// # Safety
    /// No other live reference may overlap `r` while the returned slice is used.
    #[expect(clippy::mut_from_ref, reason = "disjoint ranges handed to pool tasks")]
    pub unsafe fn slice(&self, r: Range<usize>) -> &mut [T] {
        assert!(r.start <= r.end && r.end <= self.1, "SharedMut range {r:?} outside 0..{}", self.1);
        // SAFETY: in bounds (checked above); exclusivity is the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(r.start), r.len()) }
    }
}

/// Debugging aid for parity work: with `ENGINE_DUMP` set, prints a summary of each named
/// intermediate tensor (llama.cpp's names, `NAME-LAYER` for layer tensors) and writes its values
/// to `/tmp/engine-NAME.bin`; with `ENGINE_DUMP_DIR=DIR`, writes every forward pass's tensors to
/// `DIR/step-NNNN/NAME.bin` (the layout of the parity runner's `PARITY_DUMP`, for a
/// tensor-by-tensor comparison). Both variables are read once; without them a call costs a load.
pub fn dump(name: &str, layer: Option<usize>, v: &[f32]) {
    use std::sync::atomic::Ordering;
    static VARS: std::sync::OnceLock<(Option<std::ffi::OsString>, bool)> = std::sync::OnceLock::new();
    let (dir, print) =
        VARS.get_or_init(|| (std::env::var_os("ENGINE_DUMP_DIR"), std::env::var_os("ENGINE_DUMP").is_some()));
    if dir.is_none() && !print {
        return;
    }
    let name = match layer {
        Some(il) => format!("{name}-{il}"),
        None => name.to_owned(),
    };
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    if let Some(dir) = dir {
        let dir = std::path::Path::new(dir).join(format!("step-{:04}", DUMP_STEP.load(Ordering::Relaxed)));
        let _ = std::fs::create_dir_all(&dir);
        let _ = std::fs::write(dir.join(format!("{name}.bin")), &bytes);
    }
    if *print {
        let s: f64 = v.iter().map(|&x| f64::from(x)).sum();
        let a: f64 = v.iter().map(|&x| f64::from(x.abs())).sum();
        eprintln!("{name:<28} n={:<6} sum {s:.6} abs {a:.6} first {:?}", v.len(), &v[..4.min(v.len())]);
        let _ = std::fs::write(format!("/tmp/engine-{name}.bin"), &bytes);
    }
}

/// Forward passes so far in this process (the step number of [`dump`]).
pub static DUMP_STEP: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
