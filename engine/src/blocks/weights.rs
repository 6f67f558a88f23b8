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
/// one contiguous byte range.
#[derive(Debug, Clone)]
pub struct ExpertWeight {
    pub w: Weight,
    pub n_expert: usize,
    /// Rows per expert.
    pub rows: usize,
}

impl ExpertWeight {
    pub fn expert_range(&self, e: usize) -> Range<usize> {
        let per = self.w.range.len() / self.n_expert;
        self.w.range.start + e * per..self.w.range.start + (e + 1) * per
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
        Ok(ExpertWeight { w, n_expert, rows })
    }

    /// A vector of `n` values (norm weights), dequantized to f32.
    pub fn vector(&self, name: &str, n: usize) -> Result<Vec<f32>, ModelError> {
        let t = self.find(name, &[n])?;
        let mut v = vec![0f32; n];
        quant::dequantize_row(t.ty, self.g.tensor_data(t), &mut v)?;
        Ok(v)
    }
}
