//! Weights as byte ranges of the GGUF file, and the loader the blocks take their tensors from.
//!
//! A block never copies a matrix: it keeps the tensor's absolute byte range ([`Weight::range`])
//! and reads it through [`crate::model::Model::bytes`] (the file mapping, or the placement's
//! anonymous copy for dense ranges). Only norm vectors are read into `Vec<f32>` at load.
//! [`Tensors`] checks every tensor's shape and type against what the block computes, so that a
//! malformed file is an error at load naming the tensor, never a panic in a kernel.

use std::ops::Range;

use crate::gguf::{Gguf, TensorInfo};
use crate::model::ModelError;
use crate::quant::{self, GgmlType};

/// A 2-D weight matrix (`rows` rows of `cols` elements) stored in the file.
#[derive(Debug, Clone)]
pub struct Weight {
    pub name: String,
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    /// Absolute byte range in the file.
    pub range: Range<usize>,
}

/// A stack of per-expert matrices (`ffn_*_exps`): expert `e` is rows `e*rows..(e+1)*rows`,
/// one contiguous byte range. Of a merged `ffn_gate_up_exps` tensor (expert `e`'s gate rows
/// then its up rows), the gate and the up matrices are two such views with a `part` each.
#[derive(Debug, Clone)]
pub struct ExpertWeight {
    /// The whole tensor (`rows` is all its rows).
    pub w: Weight,
    pub n_expert: usize,
    /// Rows per expert (of this view).
    pub rows: usize,
    /// The view's part of each expert's slice: `(byte offset, bytes)`; the whole slice unless
    /// the tensor is merged.
    pub part: Option<(usize, usize)>,
}

impl ExpertWeight {
    /// Bytes of one expert's slice of the tensor.
    pub fn slice_bytes(&self) -> usize {
        self.w.range.len() / self.n_expert
    }

    /// Absolute byte range of expert `e`'s matrix.
    pub fn expert_range(&self, e: usize) -> Range<usize> {
        let per = self.slice_bytes();
        let (off, len) = self.part.unwrap_or((0, per));
        let start = self.w.range.start + e * per + off;
        start..start + len
    }
}

/// The tensors of one file, looked up by name with their shapes checked.
pub struct Tensors<'g> {
    g: &'g Gguf,
    path: String,
}

impl<'g> Tensors<'g> {
    pub fn new(g: &'g Gguf) -> Self {
        Tensors { g, path: g.path().display().to_string() }
    }

    fn bad(&self, what: String) -> ModelError {
        ModelError::Bad { path: self.path.clone(), what }
    }

    pub fn has(&self, name: &str) -> bool {
        self.g.tensor(name).is_some()
    }

    /// The tensor `name` with dims `want` (ggml order, fastest first), of a type the kernels compute.
    fn find(&self, name: &str, want: &[usize]) -> Result<&'g TensorInfo, ModelError> {
        let t = self.g.tensor(name).ok_or_else(|| self.bad(format!("tensor {name} is missing")))?;
        let got: Vec<usize> = t.dims.iter().map(|&d| d as usize).collect();
        if got != want {
            return Err(self.bad(format!("tensor {name} has shape {got:?}, expected {want:?}")));
        }
        if !t.ty.is_supported() {
            return Err(self.bad(format!("tensor {name} has type {}, which the engine cannot compute", t.ty)));
        }
        Ok(t)
    }

    /// A `rows x cols` matrix.
    pub fn matrix(&self, name: &str, cols: usize, rows: usize) -> Result<Weight, ModelError> {
        let t = self.find(name, &[cols, rows])?;
        Ok(Weight {
            name: name.to_owned(),
            ty: t.ty,
            rows,
            cols,
            range: t.offset as usize..(t.offset + t.size) as usize,
        })
    }

    /// A 1-D tensor of `cols` values used as a one-row matrix (e.g. `ffn_gate_inp_shexp`).
    pub fn row(&self, name: &str, cols: usize) -> Result<Weight, ModelError> {
        let t = self.find(name, &[cols])?;
        Ok(Weight {
            name: name.to_owned(),
            ty: t.ty,
            rows: 1,
            cols,
            range: t.offset as usize..(t.offset + t.size) as usize,
        })
    }

    /// `n_expert` stacked `rows x cols` matrices.
    pub fn experts(&self, name: &str, cols: usize, rows: usize, n_expert: usize) -> Result<ExpertWeight, ModelError> {
        let t = self.find(name, &[cols, rows, n_expert])?;
        let w = Weight {
            name: name.to_owned(),
            ty: t.ty,
            rows: rows * n_expert,
            cols,
            range: t.offset as usize..(t.offset + t.size) as usize,
        };
        Ok(ExpertWeight { w, n_expert, rows, part: None })
    }

    /// The two halves of a merged `n_expert` x `2·rows` x `cols` tensor (`ffn_gate_up_exps`):
    /// the first `rows` rows of each expert (gate) and the next `rows` (up).
    pub fn experts_halves(
        &self,
        name: &str,
        cols: usize,
        rows: usize,
        n_expert: usize,
    ) -> Result<(ExpertWeight, ExpertWeight), ModelError> {
        let whole = self.experts(name, cols, 2 * rows, n_expert)?;
        let half = whole.slice_bytes() / 2;
        let view = |off| ExpertWeight { rows, part: Some((off, half)), ..whole.clone() };
        Ok((view(0), view(half)))
    }

    /// `n_expert` f32 vectors of `len` values (per-expert biases, `[len, n_expert]`).
    pub fn expert_vectors(&self, name: &str, len: usize, n_expert: usize) -> Result<ExpertWeight, ModelError> {
        let t = self.find(name, &[len, n_expert])?;
        if t.ty != GgmlType::F32 {
            return Err(self.bad(format!("tensor {name} has type {}, expected f32", t.ty)));
        }
        let w = Weight {
            name: name.to_owned(),
            ty: t.ty,
            rows: n_expert,
            cols: len,
            range: t.offset as usize..(t.offset + t.size) as usize,
        };
        Ok(ExpertWeight { w, n_expert, rows: 1, part: None })
    }

    /// A `d0 x d1` f32 tensor (e.g. `ssm_conv1d`: `d0` taps per channel), row-major (`d0` fastest).
    pub fn vector_2d(&self, name: &str, d0: usize, d1: usize) -> Result<Vec<f32>, ModelError> {
        let t = self.find(name, &[d0, d1])?;
        if t.ty != GgmlType::F32 {
            return Err(self.bad(format!("tensor {name} has type {}, expected f32", t.ty)));
        }
        let mut v = vec![0f32; d0 * d1];
        quant::dequantize_row(t.ty, self.g.tensor_data(t), &mut v)?;
        Ok(v)
    }

    /// A vector of `n` values (norm weights), dequantized to f32.
    pub fn vector(&self, name: &str, n: usize) -> Result<Vec<f32>, ModelError> {
        let t = self.find(name, &[n])?;
        let mut v = vec![0f32; n];
        quant::dequantize_row(t.ty, self.g.tensor_data(t), &mut v)?;
        Ok(v)
    }
}
