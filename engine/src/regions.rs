//! The GGUF region map: which byte ranges of a model file hold dense weights and which hold each
//! routed expert of each MoE layer. The observer's residency sampler and heatmap are built on it.
//!
//! # Rule
//! Every tensor of the file is one or more regions (absolute byte ranges, from the reader's
//! validated tensor table):
//! - a tensor `blk.N.<name>_exps.<suffix>` (`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`, the
//!   merged `ffn_gate_up_exps`, and their `.bias`/`.scale` companions where a file has them) is a
//!   *routed-expert* tensor of layer `N`: its slowest dimension is the expert index, so expert `e`
//!   is the contiguous slice `e` ([`TensorInfo::slice_range`]) and becomes one region
//!   `Expert { layer: N, expert: e }`;
//! - a tensor `blk.N.<name>_shexp.<suffix>` (`ffn_{gate,up,down}_shexp`, `ffn_gate_inp_shexp`) is
//!   layer `N`'s *shared expert*, used by every token like the dense weights: `Shared { layer }`;
//! - everything else (embeddings, attention, norms, routers, output) is `Dense`.
//!
//! The number of experts is `{arch}.expert_count` when the file states it, else the slowest
//! dimension of the first routed-expert tensor; every routed-expert tensor must agree, or the
//! map is refused with an error naming the tensor. Regions are sorted by offset and never
//! overlap (overlapping tensors are refused). Bytes outside every tensor (header, tensor table,
//! alignment padding) belong to no region.
//!
//! The expert grid has one row per layer that has routed experts (`moe_layers`, ascending block
//! indices; models such as DeepSeek's start with dense layers) and `n_experts` columns. Row `r`
//! is described by `layers[r]` ([`MoeLayer`]): its block index, the routed-expert tensors (a
//! merged `ffn_gate_up_exps` is one tensor holding each expert's gate and up rows; biases are
//! tensors of their own), the bytes of one expert, and the layer's shared-expert tensors and
//! bytes. A consumer that draws the grid labels row `r` with `layers[r].layer` (e.g. `qwen35moe`:
//! 40 rows of 256 experts, all layers MoE; a model with leading dense layers starts at block
//! 1 or later) and can show the shared expert beside it as a column of its own.

use std::ops::Range;

use crate::gguf::{Gguf, TensorInfo};

/// What a region of the file holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RegionKind {
    /// Weights every token reads: embeddings, attention, norms, routers, output.
    Dense,
    /// Routed expert `expert` of block `layer` (one slice of one `*_exps` tensor).
    Expert { layer: u32, expert: u32 },
    /// The shared expert of block `layer` (`*_shexp` tensors), read by every token.
    Shared { layer: u32 },
}

/// One contiguous byte range of the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Region {
    /// Absolute byte range in the file.
    pub range: Range<u64>,
    pub kind: RegionKind,
    /// Index of the tensor in `Gguf::tensors`.
    pub tensor: usize,
    /// The block index for `blk.N.*` tensors, also for dense ones.
    pub layer: Option<u32>,
}

impl Region {
    pub fn len(&self) -> u64 {
        self.range.end - self.range.start
    }

    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RegionError {
    #[error(
        "{path}: tensor {tensor:?} has {found} slices along its slowest dimension {dims:?}, but the model has {expected} experts ({source_of_count}); the file is inconsistent"
    )]
    ExpertCount { path: String, tensor: String, dims: Vec<u64>, found: u64, expected: u64, source_of_count: String },
    #[error("{path}: tensor {tensor:?} looks like a routed-expert tensor but its block index is not a number")]
    BadLayer { path: String, tensor: String },
    #[error("{path}: tensors {a:?} ({a_range:?}) and {b:?} ({b_range:?}) overlap in the file")]
    Overlap { path: String, a: String, a_range: Range<u64>, b: String, b_range: Range<u64> },
    #[error("{path}: tensor {tensor:?} of {size} bytes cannot be split into {n} equal expert slices")]
    Uneven { path: String, tensor: String, size: u64, n: u64 },
}

/// One row of the expert grid: a block with routed experts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MoeLayer {
    /// The block index (`blk.N`).
    pub layer: u32,
    /// The routed-expert tensors of the block, the part after `blk.N.` (e.g.
    /// `ffn_gate_up_exps.weight`, `ffn_down_exps.weight`, `ffn_down_exps.bias`), in file order.
    pub routed_tensors: Vec<String>,
    /// Gate and up are one merged tensor (`ffn_gate_up_exps`).
    pub merged_gate_up: bool,
    /// Bytes of one routed expert (its slices of every routed tensor).
    pub expert_bytes: u64,
    /// The shared-expert tensors of the block (`*_shexp`), the part after `blk.N.`.
    pub shared_tensors: Vec<String>,
    /// Bytes of the shared expert(s) (0 when the block has none).
    pub shared_bytes: u64,
}

/// Dense and per-expert byte ranges of a GGUF file.
#[derive(Debug, Clone)]
pub struct RegionMap {
    pub path: String,
    pub architecture: String,
    pub file_len: u64,
    /// Experts per MoE layer (0 for a dense model).
    pub n_experts: u32,
    /// Block indices of the layers with routed experts, ascending: row `r` of the grid is block
    /// `moe_layers[r]`.
    pub moe_layers: Vec<u32>,
    /// Row `r` of the grid described ([`MoeLayer`]; `layers[r].layer == moe_layers[r]`).
    pub layers: Vec<MoeLayer>,
    /// Blocks of the model (`{arch}.block_count`, else one more than the highest `blk.N`).
    pub n_blocks: u32,
    /// Sorted by offset, non-overlapping.
    pub regions: Vec<Region>,
}

/// `blk.N.rest` → (N, rest); `Err(())` when the index is not a number.
fn split_block(name: &str) -> Option<Result<(u32, &str), ()>> {
    let rest = name.strip_prefix("blk.")?;
    let (n, rest) = rest.split_once('.')?;
    Some(n.parse::<u32>().map(|n| (n, rest)).map_err(|_| ()))
}

fn is_routed(rest: &str) -> bool {
    rest.split('.').next().is_some_and(|base| base.ends_with("_exps"))
}

fn is_shared(rest: &str) -> bool {
    rest.split('.').next().is_some_and(|base| base.ends_with("_shexp"))
}

impl RegionMap {
    pub fn from_gguf(g: &Gguf) -> Result<RegionMap, RegionError> {
        let path = g.path().display().to_string();
        let architecture = g.architecture().unwrap_or("").to_owned();
        let stated = g.get(&format!("{architecture}.expert_count")).and_then(|v| v.as_u64()).filter(|&n| n > 0);

        let mut n_experts: Option<(u64, String)> = stated.map(|n| (n, format!("{architecture}.expert_count = {n}")));
        let mut regions = Vec::new();
        let mut moe_layers = Vec::new();
        for (ti, t) in g.tensors.iter().enumerate() {
            let block = split_block(&t.name);
            let (layer, rest) = match block {
                Some(Ok((n, rest))) => (Some(n), rest),
                Some(Err(())) if t.is_routed_expert() => {
                    return Err(RegionError::BadLayer { path, tensor: t.name.clone() });
                }
                _ => (None, t.name.as_str()),
            };
            match layer {
                Some(l) if is_routed(rest) => {
                    let found = t.n_slices();
                    let (expected, why) = n_experts
                        .get_or_insert_with(|| (found, format!("the slowest dimension of {}", t.name)))
                        .clone();
                    if found != expected {
                        return Err(RegionError::ExpertCount {
                            path,
                            tensor: t.name.clone(),
                            dims: t.dims.clone(),
                            found,
                            expected,
                            source_of_count: why,
                        });
                    }
                    push_experts(&mut regions, &path, ti, t, l)?;
                    moe_layers.push(l);
                }
                Some(l) if is_shared(rest) => regions.push(Region {
                    range: t.byte_range(),
                    kind: RegionKind::Shared { layer: l },
                    tensor: ti,
                    layer,
                }),
                _ => regions.push(Region { range: t.byte_range(), kind: RegionKind::Dense, tensor: ti, layer }),
            }
        }
        regions.retain(|r| !r.is_empty());
        regions.sort_by_key(|r| (r.range.start, r.range.end));
        for w in regions.windows(2) {
            if w[1].range.start < w[0].range.end {
                let name = |r: &Region| g.tensors[r.tensor].name.clone();
                return Err(RegionError::Overlap {
                    path,
                    a: name(&w[0]),
                    a_range: w[0].range.clone(),
                    b: name(&w[1]),
                    b_range: w[1].range.clone(),
                });
            }
        }
        moe_layers.sort_unstable();
        moe_layers.dedup();
        let n_experts = if moe_layers.is_empty() { 0 } else { n_experts.map_or(0, |(n, _)| n) };
        let layers = moe_layers
            .iter()
            .map(|&l| {
                let mut row = MoeLayer {
                    layer: l,
                    routed_tensors: Vec::new(),
                    merged_gate_up: false,
                    expert_bytes: 0,
                    shared_tensors: Vec::new(),
                    shared_bytes: 0,
                };
                for t in &g.tensors {
                    let Some(Ok((n, rest))) = split_block(&t.name) else { continue };
                    if n != l {
                        continue;
                    }
                    if is_routed(rest) {
                        row.merged_gate_up |= rest.starts_with("ffn_gate_up_exps.");
                        row.expert_bytes += t.size / t.n_slices().max(1);
                        row.routed_tensors.push(rest.to_owned());
                    } else if is_shared(rest) {
                        row.shared_bytes += t.size;
                        row.shared_tensors.push(rest.to_owned());
                    }
                }
                row
            })
            .collect();
        let blocks_seen = g.tensors.iter().filter_map(|t| split_block(&t.name)?.ok()).map(|(n, _)| n + 1).max();
        let n_blocks = g
            .get(&format!("{architecture}.block_count"))
            .and_then(|v| v.as_u64())
            .and_then(|n| u32::try_from(n).ok())
            .or(blocks_seen)
            .unwrap_or(0);
        Ok(RegionMap {
            path,
            architecture,
            file_len: g.bytes().len() as u64,
            n_experts: u32::try_from(n_experts).unwrap_or(u32::MAX),
            moe_layers,
            layers,
            n_blocks,
            regions,
        })
    }

    /// Rows × columns of the expert grid.
    pub fn n_cells(&self) -> usize {
        self.moe_layers.len() * self.n_experts as usize
    }

    /// Grid row of a block index.
    pub fn row_of(&self, layer: u32) -> Option<usize> {
        self.moe_layers.binary_search(&layer).ok()
    }

    /// Row-major cell index (`row * n_experts + expert`) of an expert region.
    pub fn cell_of(&self, kind: RegionKind) -> Option<usize> {
        match kind {
            RegionKind::Expert { layer, expert } if expert < self.n_experts => {
                Some(self.row_of(layer)? * self.n_experts as usize + expert as usize)
            }
            _ => None,
        }
    }

    /// Bytes held by regions of a kind: (dense, shared experts, routed experts).
    pub fn bytes_by_kind(&self) -> (u64, u64, u64) {
        let (mut d, mut s, mut e) = (0, 0, 0);
        for r in &self.regions {
            match r.kind {
                RegionKind::Dense => d += r.len(),
                RegionKind::Shared { .. } => s += r.len(),
                RegionKind::Expert { .. } => e += r.len(),
            }
        }
        (d, s, e)
    }

    /// The regions of one expert cell (one per `*_exps` tensor of its layer).
    pub fn expert_ranges(&self, layer: u32, expert: u32) -> Vec<Range<u64>> {
        self.regions
            .iter()
            .filter(|r| r.kind == RegionKind::Expert { layer, expert })
            .map(|r| r.range.clone())
            .collect()
    }
}

fn push_experts(
    regions: &mut Vec<Region>,
    path: &str,
    ti: usize,
    t: &TensorInfo,
    layer: u32,
) -> Result<(), RegionError> {
    let n = t.n_slices();
    if n == 0 || !t.size.is_multiple_of(n) {
        return Err(RegionError::Uneven { path: path.to_owned(), tensor: t.name.clone(), size: t.size, n });
    }
    for e in 0..n {
        let Some(range) = t.slice_range(e) else { break };
        let expert = u32::try_from(e).unwrap_or(u32::MAX);
        regions.push(Region { range, kind: RegionKind::Expert { layer, expert }, tensor: ti, layer: Some(layer) });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::{GgufWriter, TensorSpec, Value};
    use crate::quant::GgmlType;

    fn spec(name: &str, dims: &[u64], ty: GgmlType) -> TensorSpec {
        TensorSpec { name: name.into(), dims: dims.to_vec(), ty }
    }

    fn write(dir: &std::path::Path, name: &str, meta: &[(String, Value)], specs: Vec<TensorSpec>) -> Gguf {
        let path = dir.join(name);
        let mut w = GgufWriter::create(&path, meta, specs.clone()).unwrap();
        for s in &specs {
            w.write_tensor(&vec![0u8; s.size().unwrap() as usize]).unwrap();
        }
        w.finish().unwrap();
        Gguf::open(&path).unwrap()
    }

    fn arch(a: &str, experts: Option<u32>) -> Vec<(String, Value)> {
        let mut m = vec![("general.architecture".to_owned(), Value::String(a.into()))];
        if let Some(n) = experts {
            m.push((format!("{a}.expert_count"), Value::U32(n)));
        }
        m
    }

    #[test]
    fn synthetic_qwen3moe_map_covers_every_tensor_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny.gguf");
        let c = crate::synth::SynthConfig::preset("tiny").unwrap();
        crate::synth::write_model(&c, &path, 1, |_| {}).unwrap();
        let g = Gguf::open(&path).unwrap();
        let m = RegionMap::from_gguf(&g).unwrap();
        assert_eq!(m.architecture, "qwen3moe");
        assert_eq!(m.n_experts as usize, c.experts);
        assert_eq!(m.moe_layers, (0..c.layers as u32).collect::<Vec<_>>());
        // Every tensor byte is in exactly one region.
        let tensor_bytes: u64 = g.tensors.iter().map(|t| t.size).sum();
        let (d, s, e) = m.bytes_by_kind();
        assert_eq!(d + s + e, tensor_bytes);
        assert_eq!(s, 0);
        let exps: u64 = g.tensors.iter().filter(|t| t.is_routed_expert()).map(|t| t.size).sum();
        assert_eq!(e, exps);
        // Three ranges per expert (gate, up, down), each the tensor's slice.
        for l in 0..c.layers as u32 {
            for x in 0..c.experts as u32 {
                let r = m.expert_ranges(l, x);
                assert_eq!(r.len(), 3);
                for (name, got) in ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"].iter().zip(&r) {
                    let t = g.tensor(&format!("blk.{l}.{name}.weight")).unwrap();
                    assert_eq!(*got, t.slice_range(x as u64).unwrap());
                }
            }
        }
        assert!(m.regions.windows(2).all(|w| w[0].range.end <= w[1].range.start));
        assert_eq!(m.cell_of(RegionKind::Expert { layer: 1, expert: 3 }), Some(c.experts + 3));
    }

    #[test]
    fn merged_gate_up_shared_experts_and_leading_dense_layers() {
        let dir = tempfile::tempdir().unwrap();
        let q = GgmlType::Q8_0;
        let specs = vec![
            spec("token_embd.weight", &[64, 32], q),
            // block 0 is dense (DeepSeek-style leading dense layer)
            spec("blk.0.ffn_up.weight", &[64, 64], q),
            spec("blk.1.attn_q.weight", &[64, 64], q),
            spec("blk.1.ffn_gate_inp.weight", &[64, 4], GgmlType::F32),
            spec("blk.1.ffn_gate_up_exps.weight", &[64, 128, 4], q),
            spec("blk.1.ffn_down_exps.weight", &[64, 64, 4], q),
            spec("blk.1.ffn_down_exps.bias", &[64, 4], GgmlType::F32),
            spec("blk.1.ffn_gate_shexp.weight", &[64, 64], q),
            spec("blk.1.ffn_gate_inp_shexp.weight", &[64], GgmlType::F32),
            spec("output.weight", &[64, 32], q),
        ];
        let g = write(dir.path(), "m.gguf", &arch("deepseek2", Some(4)), specs);
        let m = RegionMap::from_gguf(&g).unwrap();
        assert_eq!(m.n_experts, 4);
        assert_eq!(m.moe_layers, vec![1]);
        assert_eq!(m.n_cells(), 4);
        let r = m.expert_ranges(1, 2);
        assert_eq!(r.len(), 3, "gate_up, down and down bias slices: {r:?}");
        let gu = g.tensor("blk.1.ffn_gate_up_exps.weight").unwrap();
        assert_eq!(r[0], gu.slice_range(2).unwrap());
        let shared: Vec<_> = m.regions.iter().filter(|r| matches!(r.kind, RegionKind::Shared { layer: 1 })).collect();
        assert_eq!(shared.len(), 2);
        let dense0 = m.regions.iter().find(|r| r.layer == Some(0)).unwrap();
        assert_eq!(dense0.kind, RegionKind::Dense);
        assert_eq!(m.row_of(0), None);
        assert_eq!(m.cell_of(RegionKind::Expert { layer: 1, expert: 3 }), Some(3));
        assert_eq!(m.n_blocks, 2, "blocks from the highest blk.N without a block_count key");
        let row = &m.layers[0];
        assert_eq!(row.layer, 1);
        assert!(row.merged_gate_up);
        assert_eq!(
            row.routed_tensors,
            ["ffn_gate_up_exps.weight", "ffn_down_exps.weight", "ffn_down_exps.bias"].map(String::from)
        );
        assert_eq!(row.expert_bytes, r.iter().map(|x| x.end - x.start).sum::<u64>());
        assert_eq!(row.shared_tensors, ["ffn_gate_shexp.weight", "ffn_gate_inp_shexp.weight"].map(String::from));
        assert_eq!(row.shared_bytes, shared.iter().map(|r| r.len()).sum::<u64>());
    }

    /// The released models' shapes: 40 x 256 with a merged gate_up and a shared expert per layer
    /// (qwen35moe), 24 x 32 with biases (gpt-oss), 16 x 64 (olmoe); every row labelled by its block.
    #[test]
    fn released_shapes_describe_every_moe_layer() {
        for (preset, layers, experts) in
            [("qwen3.6-35b-a3b", 40, 256), ("gpt-oss-20b", 24, 32), ("olmoe-1b-7b", 16, 64)]
        {
            let c = crate::synth::SynthConfig::preset(preset).unwrap();
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("m.gguf");
            crate::synth::write_sparse(&c, &path).unwrap();
            let g = Gguf::open(&path).unwrap();
            let m = RegionMap::from_gguf(&g).unwrap();
            assert_eq!((m.n_blocks, m.n_experts, m.moe_layers.len()), (layers, experts, layers as usize), "{preset}");
            assert_eq!(m.n_cells(), (layers * experts) as usize);
            for (r, row) in m.layers.iter().enumerate() {
                assert_eq!(row.layer, r as u32);
                assert_eq!(row.merged_gate_up, c.arch == crate::arch::Arch::Qwen35Moe, "{preset}");
                assert_eq!(row.shared_bytes > 0, c.shared_ffn > 0, "{preset}");
                let want: u64 = g
                    .tensors
                    .iter()
                    .filter(|t| t.name.starts_with(&format!("blk.{r}.")) && t.is_routed_expert())
                    .map(|t| t.size / t.n_slices())
                    .sum();
                assert_eq!(row.expert_bytes, want);
            }
            let biases = m.layers[0].routed_tensors.iter().filter(|t| t.ends_with(".bias")).count();
            assert_eq!(biases, if c.arch == crate::arch::Arch::GptOss { 3 } else { 0 }, "{preset}");
        }
    }

    #[test]
    fn inconsistent_expert_counts_are_refused_with_the_tensor_named() {
        let dir = tempfile::tempdir().unwrap();
        let q = GgmlType::Q8_0;
        let specs = vec![
            spec("blk.0.ffn_up_exps.weight", &[64, 32, 4], q),
            spec("blk.0.ffn_down_exps.weight", &[64, 32, 3], q),
        ];
        let g = write(dir.path(), "a.gguf", &arch("qwen3moe", None), specs);
        let e = RegionMap::from_gguf(&g).unwrap_err().to_string();
        assert!(e.contains("blk.0.ffn_down_exps.weight") && e.contains("3 slices") && e.contains("4 experts"), "{e}");

        let specs = vec![spec("blk.0.ffn_up_exps.weight", &[64, 32, 4], q)];
        let g = write(dir.path(), "b.gguf", &arch("qwen3moe", Some(8)), specs);
        let e = RegionMap::from_gguf(&g).unwrap_err().to_string();
        assert!(e.contains("qwen3moe.expert_count = 8"), "{e}");

        let specs = vec![spec("blk.x.ffn_up_exps.weight", &[64, 32, 4], q)];
        let g = write(dir.path(), "c.gguf", &arch("qwen3moe", None), specs);
        let e = RegionMap::from_gguf(&g).unwrap_err().to_string();
        assert!(e.contains("blk.x.ffn_up_exps.weight") && e.contains("not a number"), "{e}");
    }

    #[test]
    fn a_dense_model_has_an_empty_grid() {
        let dir = tempfile::tempdir().unwrap();
        let specs = vec![
            spec("token_embd.weight", &[64, 32], GgmlType::Q8_0),
            spec("blk.0.ffn_up.weight", &[64, 64], GgmlType::Q8_0),
        ];
        let g = write(dir.path(), "d.gguf", &arch("llama", None), specs);
        let m = RegionMap::from_gguf(&g).unwrap();
        assert_eq!((m.n_experts, m.n_cells()), (0, 0));
        assert_eq!(m.regions.len(), 2);
    }
}
