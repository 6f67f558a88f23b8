//! The output block: `logits = Wout·rmsnorm(x, output_norm)` for the batch's last token
//! (llama.cpp keeps only the last token's row before the final norm when one set of logits is
//! wanted; `Wout` is `output.weight`, or `token_embd.weight` when the file ties them).
//!
//! # Spec
//! ```text
//! xl     = rmsnorm(x[n-1], output_norm)     ggml_rms_norm, ggml_mul     ([`rms_norm`])
//! logits = Wout·xl                          ggml_mul_mat (xl quantized for Wout's type)
//! ```

use crate::blocks::{Ctx, QRows, Weight, dump, rms_norm, sized};
use crate::model::ModelError;

/// The block's buffers, reused across steps.
#[derive(Debug, Default)]
pub struct Scratch {
    xl: Vec<f32>,
    xq: QRows,
}

/// `logits` (`n_vocab`) of the last row `last` of the final hidden state.
pub fn forward(
    ctx: &Ctx<'_>,
    norm: &[f32],
    w: &Weight,
    last: &[f32],
    s: &mut Scratch,
    logits: &mut [f32],
) -> Result<(), ModelError> {
    let xl = sized(&mut s.xl, last.len());
    rms_norm(last, norm, ctx.cfg().rms_eps, xl);
    dump("result_norm", None, xl);
    ctx.matmul(w, s.xq.quantize(w.ty, xl, last.len())?, logits);
    dump("result_output", None, logits);
    Ok(())
}
