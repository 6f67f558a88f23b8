//! Token embeddings: row `token` of `token_embd`, dequantized to f32 (ggml's `get_rows`, which
//! dequantizes with the type's `to_float`, as [`quant::dequantize_row`] does).

use crate::blocks::{Ctx, Weight};
use crate::model::ModelError;
use crate::quant;

/// `x` (`n x n_embd`) = the embedding rows of `tokens` (ids checked by the caller).
pub fn forward(ctx: &Ctx<'_>, w: &Weight, tokens: &[u32], x: &mut [f32]) -> Result<(), ModelError> {
    let d = w.cols;
    let erow = w.ty.row_bytes(d).unwrap_or(0);
    for (&t, xb) in tokens.iter().zip(x.chunks_mut(d)) {
        let start = w.range.start + t as usize * erow;
        quant::dequantize_row(w.ty, ctx.model.bytes(start..start + erow), xb)?;
    }
    Ok(())
}
