//! Synthetic `qwen3moe` GGUF models: real files of any shape with random weights.
//!
//! # What a synthetic file holds
//! - the metadata llama.cpp's `qwen3moe` loader reads (`qwen3moe.block_count`,
//!   `embedding_length`, `feed_forward_length`, `attention.head_count{,_kv}`,
//!   `attention.{key,value}_length`, `attention.layer_norm_rms_epsilon`, `rope.freq_base`,
//!   `context_length`, `expert_count`, `expert_used_count`, `expert_feed_forward_length`);
//! - a byte-level BPE vocabulary (`tokenizer.ggml.model = "gpt2"`, `pre = "qwen2"`): the 256
//!   byte tokens, merges learned from a built-in English text, `<|endoftext|>`, `<|im_start|>`,
//!   `<|im_end|>` as control tokens at the end, and unused filler tokens up to the vocab size;
//! - the tensors of [`tensor_specs`], weights uniform in `±sqrt(3/fan_in)` (unit-variance
//!   outputs), norms `1 ± 0.1`. Each row is generated from its own seed, so the file depends
//!   only on the configuration and `--seed`, not on the thread count.
//! - Residual-branch projections (`attn_output`, `ffn_down_exps`) are scaled by
//!   `1/sqrt(2·layers)` as in GPT-2's initialisation, and `output.weight` rows by a log-normal
//!   factor (σ = `output_skew`, default 1), so that a few tokens carry large logits as in real
//!   vocabularies.
//! - Router skew: row `e` of `ffn_gate_inp` is scaled by `(rank_e + 1)^-skew` (ranks shuffled
//!   per layer), so high-norm experts win the top-k more often and popularity is uneven.
//!
//! Quantization mixes: `q8_0`, `q4_k`, `q6_k` (every matrix in that type) and `q4_k_m`
//! (experts `Q4_K`, `ffn_down_exps` `Q6_K`, other matrices `Q8_0`); norms and routers are
//! always `F32`, like llama.cpp's quantized files.

use std::collections::HashMap;
use std::path::Path;

use crate::gguf::{GgufWriter, TensorSpec, Value};
use crate::quant::{self, GgmlType};
use crate::tokenizer::{TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_UNUSED, bytes_to_token_text};

/// Bumped whenever the bytes written for a given configuration change (caches key on it).
pub const FORMAT_VERSION: u32 = 2;

#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    #[error("invalid synthetic model configuration: {0}")]
    Config(String),
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("quantizing {tensor}: {source}")]
    Quant { tensor: String, source: quant::QuantError },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantMix {
    Q8_0,
    Q4K,
    Q6K,
    /// Experts Q4_K, `ffn_down_exps` Q6_K, dense Q8_0.
    Q4KM,
}

impl QuantMix {
    pub fn parse(s: &str) -> Option<QuantMix> {
        match s.to_ascii_lowercase().as_str() {
            "q8_0" => Some(QuantMix::Q8_0),
            "q4_k" => Some(QuantMix::Q4K),
            "q6_k" => Some(QuantMix::Q6K),
            "q4_k_m" => Some(QuantMix::Q4KM),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            QuantMix::Q8_0 => "q8_0",
            QuantMix::Q4K => "q4_k",
            QuantMix::Q6K => "q6_k",
            QuantMix::Q4KM => "q4_k_m",
        }
    }

    fn dense(self) -> GgmlType {
        match self {
            QuantMix::Q8_0 | QuantMix::Q4KM => GgmlType::Q8_0,
            QuantMix::Q4K => GgmlType::Q4_K,
            QuantMix::Q6K => GgmlType::Q6_K,
        }
    }

    fn expert(self, down: bool) -> GgmlType {
        match self {
            QuantMix::Q8_0 => GgmlType::Q8_0,
            QuantMix::Q4K => GgmlType::Q4_K,
            QuantMix::Q6K => GgmlType::Q6_K,
            QuantMix::Q4KM if down => GgmlType::Q6_K,
            QuantMix::Q4KM => GgmlType::Q4_K,
        }
    }

    /// llama.cpp's `general.file_type` for the mix (LLAMA_FTYPE_*).
    fn file_type(self) -> u32 {
        match self {
            QuantMix::Q8_0 => 7,
            QuantMix::Q4K => 15, // Q4_K_M is the closest "mostly Q4_K" type
            QuantMix::Q6K => 18,
            QuantMix::Q4KM => 15,
        }
    }
}

#[derive(Debug, Clone)]
pub struct SynthConfig {
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub experts: usize,
    pub experts_used: usize,
    pub expert_ffn: usize,
    pub vocab: usize,
    pub context: usize,
    pub rope_base: f32,
    pub rms_eps: f32,
    pub tied_output: bool,
    pub router_skew: f32,
    /// σ of the log-normal per-token scale of `output.weight` rows (0 = uniform).
    pub output_skew: f32,
    pub quant: QuantMix,
    pub seed: u64,
}

impl SynthConfig {
    /// Named presets: `tiny`, `small`, `qwen3-30b-a3b`.
    pub fn preset(name: &str) -> Option<SynthConfig> {
        let base = SynthConfig {
            layers: 2,
            hidden: 256,
            heads: 4,
            kv_heads: 2,
            head_dim: 64,
            experts: 8,
            experts_used: 2,
            expert_ffn: 256,
            vocab: 512,
            context: 4096,
            rope_base: 1_000_000.0,
            rms_eps: 1e-6,
            tied_output: false,
            router_skew: 1.0,
            output_skew: 1.0,
            quant: QuantMix::Q8_0,
            seed: 42,
        };
        match name {
            "tiny" => Some(base),
            // ~480 MB in q4_k_m.
            "small" => Some(SynthConfig {
                layers: 8,
                hidden: 1024,
                heads: 16,
                kv_heads: 4,
                head_dim: 64,
                experts: 48,
                experts_used: 8,
                expert_ffn: 512,
                vocab: 32768,
                quant: QuantMix::Q4KM,
                ..base
            }),
            // Qwen3-30B-A3B's per-layer shapes; 48 layers unless overridden.
            "qwen3-30b-a3b" => Some(SynthConfig {
                layers: 48,
                hidden: 2048,
                heads: 32,
                kv_heads: 4,
                head_dim: 128,
                experts: 128,
                experts_used: 8,
                expert_ffn: 768,
                vocab: 151_936,
                context: 40960,
                quant: QuantMix::Q4KM,
                ..base
            }),
            _ => None,
        }
    }

    pub fn validate(&self) -> Result<(), SynthError> {
        let bad = |s: String| Err(SynthError::Config(s));
        if self.layers == 0 || self.hidden == 0 || self.heads == 0 || self.kv_heads == 0 || self.head_dim == 0 {
            return bad("layers, hidden, heads, kv heads and head dim must be positive".into());
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return bad(format!("heads ({}) must be a multiple of kv heads ({})", self.heads, self.kv_heads));
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad(format!("head dim ({}) must be even for RoPE", self.head_dim));
        }
        if self.experts == 0 || self.experts_used == 0 || self.experts_used > self.experts {
            return bad(format!("need 0 < experts used ({}) <= experts ({})", self.experts_used, self.experts));
        }
        if self.vocab < 256 + SPECIALS.len() {
            return bad(format!(
                "vocab ({}) must hold the 256 byte tokens and {} specials",
                self.vocab,
                SPECIALS.len()
            ));
        }
        if self.vocab > u32::MAX as usize / 2 {
            return bad(format!("vocab ({}) is absurd", self.vocab));
        }
        for s in tensor_specs(self) {
            if s.size().is_none() {
                return bad(format!(
                    "tensor {} with rows of {} elements cannot be stored as {}: rows must be a multiple of {}",
                    s.name,
                    s.dims[0],
                    s.ty.name(),
                    s.ty.block_size()
                ));
            }
        }
        Ok(())
    }

    pub fn total_bytes(&self) -> u64 {
        tensor_specs(self).iter().filter_map(TensorSpec::size).sum()
    }
}

const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// The tensor table of a configuration, in file order.
pub fn tensor_specs(c: &SynthConfig) -> Vec<TensorSpec> {
    let t = |name: String, dims: &[usize], ty: GgmlType| TensorSpec {
        name,
        dims: dims.iter().map(|&d| d as u64).collect(),
        ty,
    };
    let dense = c.quant.dense();
    let mut v = vec![t("token_embd.weight".into(), &[c.hidden, c.vocab], dense)];
    for i in 0..c.layers {
        let p = |n: &str| format!("blk.{i}.{n}.weight");
        v.push(t(p("attn_norm"), &[c.hidden], GgmlType::F32));
        v.push(t(p("attn_q"), &[c.hidden, c.heads * c.head_dim], dense));
        v.push(t(p("attn_k"), &[c.hidden, c.kv_heads * c.head_dim], dense));
        v.push(t(p("attn_v"), &[c.hidden, c.kv_heads * c.head_dim], dense));
        v.push(t(p("attn_output"), &[c.heads * c.head_dim, c.hidden], dense));
        v.push(t(p("attn_q_norm"), &[c.head_dim], GgmlType::F32));
        v.push(t(p("attn_k_norm"), &[c.head_dim], GgmlType::F32));
        v.push(t(p("ffn_norm"), &[c.hidden], GgmlType::F32));
        v.push(t(p("ffn_gate_inp"), &[c.hidden, c.experts], GgmlType::F32));
        v.push(t(p("ffn_gate_exps"), &[c.hidden, c.expert_ffn, c.experts], c.quant.expert(false)));
        v.push(t(p("ffn_up_exps"), &[c.hidden, c.expert_ffn, c.experts], c.quant.expert(false)));
        v.push(t(p("ffn_down_exps"), &[c.expert_ffn, c.hidden, c.experts], c.quant.expert(true)));
    }
    v.push(t("output_norm.weight".into(), &[c.hidden], GgmlType::F32));
    if !c.tied_output {
        v.push(t("output.weight".into(), &[c.hidden, c.vocab], dense));
    }
    v
}

/// splitmix64: a tiny, fixed, seedable generator (the file must not change with a crate update).
/// A frozen copy, on purpose: the workspace's shared one is `moe_stats::SplitMix64`, but the
/// models written from these draws must stay byte-identical whatever happens to that crate, and
/// the engine depends on nothing of the observer's.
#[derive(Debug, Clone)]
pub struct SplitMix(u64);

impl SplitMix {
    pub fn new(seed: u64) -> SplitMix {
        SplitMix(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

fn mix(a: u64, b: u64) -> u64 {
    SplitMix::new(a ^ b.wrapping_mul(0xD6E8_FEB8_6659_FD93)).next_u64()
}

/// Built-in text the BPE merges are learned from.
const CORPUS: &str = "The quick brown fox jumps over the lazy dog. A model that does not fit in memory \
is decoded token by token, and every token touches the dense weights and a few experts. \
The engine maps the file, the kernel reads pages from the disk, and the observer measures \
where the time of each token goes: compute, faults, swap, reading, waiting. \
Hello world! This is a test of the tokenizer, with numbers like 12345 and 2026, \
punctuation, quotes 'like this', and words such as mixture, experts, attention, layer, \
memory, cache, page, decode, prompt, generation, speed, thread, weight, router. \
It is what it is; they're here, we've seen it, I'm sure you'll like it, he'd agree. \
In the beginning the universe was created. This has made a lot of people very angry \
and been widely regarded as a bad move. Once upon a time there was a little language model \
that wanted to run on a phone with less memory than its own weights.";

/// Learns up to `n` byte-level BPE merges from [`CORPUS`]. Returns merges as token-text pairs.
pub fn learn_merges(n: usize) -> Vec<(String, String)> {
    // Pre-split roughly like the qwen2 regex: words carry their leading space.
    let mut words: HashMap<Vec<String>, usize> = HashMap::new();
    let mut cur = String::new();
    let flush = |cur: &mut String, words: &mut HashMap<Vec<String>, usize>| {
        if !cur.is_empty() {
            let syms = cur.bytes().map(|b| bytes_to_token_text(&[b])).collect();
            *words.entry(syms).or_default() += 1;
            cur.clear();
        }
    };
    for ch in CORPUS.chars() {
        let alpha = ch.is_alphabetic();
        let starts_new = !alpha || !(cur.chars().last().is_some_and(|c| c.is_alphabetic() || c == ' '));
        if starts_new && !(alpha && cur == " ") {
            flush(&mut cur, &mut words);
        }
        cur.push(ch);
        if !alpha && ch != ' ' {
            flush(&mut cur, &mut words);
        }
    }
    flush(&mut cur, &mut words);

    let mut words: Vec<(Vec<String>, usize)> = words.into_iter().collect();
    words.sort();
    let mut merges = Vec::new();
    while merges.len() < n {
        let mut counts: HashMap<(String, String), usize> = HashMap::new();
        for (syms, f) in &words {
            for w in syms.windows(2) {
                *counts.entry((w[0].clone(), w[1].clone())).or_default() += f;
            }
        }
        // Most frequent pair, ties broken by the pair itself (deterministic).
        let Some((best, count)) = counts.into_iter().max_by(|a, b| a.1.cmp(&b.1).then_with(|| b.0.cmp(&a.0))) else {
            break;
        };
        if count < 2 {
            break;
        }
        let joined = format!("{}{}", best.0, best.1);
        for (syms, _) in &mut words {
            let mut out = Vec::with_capacity(syms.len());
            let mut i = 0;
            while i < syms.len() {
                if i + 1 < syms.len() && syms[i] == best.0 && syms[i + 1] == best.1 {
                    out.push(joined.clone());
                    i += 2;
                } else {
                    out.push(syms[i].clone());
                    i += 1;
                }
            }
            *syms = out;
        }
        merges.push(best);
    }
    merges
}

/// Vocabulary: (tokens, types, merges, eos id).
fn vocabulary(n_vocab: usize) -> (Vec<String>, Vec<i32>, Vec<String>, u32) {
    let mut tokens: Vec<String> = (0..=255u8).map(|b| bytes_to_token_text(&[b])).collect();
    let mut types = vec![TOKEN_NORMAL; 256];
    let room = n_vocab - 256 - SPECIALS.len();
    let merges = learn_merges(room.min(4000));
    let mut seen: std::collections::HashSet<String> = tokens.iter().cloned().collect();
    let mut merge_strs = Vec::new();
    for (a, b) in &merges {
        let t = format!("{a}{b}");
        if seen.insert(t.clone()) {
            tokens.push(t);
            types.push(TOKEN_NORMAL);
        }
        merge_strs.push(format!("{a} {b}"));
    }
    let mut i = 0;
    while tokens.len() < n_vocab - SPECIALS.len() {
        tokens.push(format!("<|unused_{i}|>"));
        types.push(TOKEN_UNUSED);
        i += 1;
    }
    let eos = tokens.len() as u32;
    for s in SPECIALS {
        tokens.push(s.to_owned());
        types.push(TOKEN_CONTROL);
    }
    (tokens, types, merge_strs, eos)
}

fn metadata(c: &SynthConfig) -> Vec<(String, Value)> {
    let u = |x: usize| Value::U32(x as u32);
    let a = "qwen3moe";
    let (tokens, types, merges, eos) = vocabulary(c.vocab);
    let mut m = vec![
        ("general.architecture".to_owned(), Value::String(a.into())),
        ("general.name".to_owned(), Value::String(format!("synthetic-qwen3moe-{}", c.quant.name()))),
        ("general.alignment".to_owned(), Value::U32(32)),
        ("general.file_type".to_owned(), Value::U32(c.quant.file_type())),
        (format!("{a}.block_count"), u(c.layers)),
        (format!("{a}.context_length"), u(c.context)),
        (format!("{a}.embedding_length"), u(c.hidden)),
        (format!("{a}.feed_forward_length"), u(c.expert_ffn * c.experts_used)),
        (format!("{a}.attention.head_count"), u(c.heads)),
        (format!("{a}.attention.head_count_kv"), u(c.kv_heads)),
        (format!("{a}.attention.key_length"), u(c.head_dim)),
        (format!("{a}.attention.value_length"), u(c.head_dim)),
        (format!("{a}.rope.freq_base"), Value::F32(c.rope_base)),
        (format!("{a}.attention.layer_norm_rms_epsilon"), Value::F32(c.rms_eps)),
        (format!("{a}.expert_count"), u(c.experts)),
        (format!("{a}.expert_used_count"), u(c.experts_used)),
        (format!("{a}.expert_feed_forward_length"), u(c.expert_ffn)),
        ("tokenizer.ggml.model".to_owned(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".to_owned(), Value::String("qwen2".into())),
        ("tokenizer.ggml.tokens".to_owned(), Value::Array(tokens.into_iter().map(Value::String).collect())),
        ("tokenizer.ggml.token_type".to_owned(), Value::Array(types.into_iter().map(Value::I32).collect())),
        ("tokenizer.ggml.merges".to_owned(), Value::Array(merges.into_iter().map(Value::String).collect())),
        ("tokenizer.ggml.eos_token_id".to_owned(), Value::U32(eos)),
        ("tokenizer.ggml.bos_token_id".to_owned(), Value::U32(eos)),
        ("tokenizer.ggml.padding_token_id".to_owned(), Value::U32(eos)),
        ("tokenizer.ggml.add_bos_token".to_owned(), Value::Bool(false)),
    ];
    m.push(("synth.seed".to_owned(), Value::U64(c.seed)));
    m.push(("synth.router_skew".to_owned(), Value::F32(c.router_skew)));
    m.push(("synth.output_skew".to_owned(), Value::F32(c.output_skew)));
    m
}

/// How a tensor's values are drawn.
fn row_values(c: &SynthConfig, spec: &TensorSpec, tensor_seed: u64, row: u64, out: &mut [f32]) {
    let mut rng = SplitMix::new(mix(tensor_seed, row));
    let name = spec.name.as_str();
    let fan_in = spec.dims[0] as f32;
    if name.ends_with("norm.weight") {
        out.iter_mut().for_each(|x| *x = 1.0 + 0.1 * rng.uniform());
    } else if name == "token_embd.weight" {
        out.iter_mut().for_each(|x| *x = rng.uniform());
    } else if name.ends_with("ffn_gate_inp.weight") {
        // Row `row` is expert `row`; its popularity rank is a per-tensor permutation.
        let n = spec.dims[1];
        let mut perm: Vec<u64> = (0..n).collect();
        let mut prng = SplitMix::new(tensor_seed);
        for i in (1..perm.len()).rev() {
            perm.swap(i, (prng.next_u64() % (i as u64 + 1)) as usize);
        }
        let rank = perm[row as usize] as f32;
        let scale = 4.0 * (3.0 / fan_in).sqrt() * (rank + 1.0).powf(-c.router_skew);
        out.iter_mut().for_each(|x| *x = scale * rng.uniform());
    } else if name == "output.weight" {
        // Token `row` gets a log-normal logit scale (σ = output_skew): like a real vocabulary, a few
        // tokens carry large logits, so greedy choices are rarely decided by a hair.
        let mut trng = SplitMix::new(mix(tensor_seed, u64::MAX - row));
        let z = (trng.uniform() + trng.uniform() + trng.uniform() + trng.uniform()) * 0.866; // ≈ N(0,1)
        let scale = 2.0 * (3.0 / fan_in).sqrt() * (c.output_skew * z).exp();
        out.iter_mut().for_each(|x| *x = scale * rng.uniform());
    } else {
        let mut scale = (3.0 / fan_in).sqrt();
        if name.ends_with("attn_output.weight") || name.ends_with("ffn_down_exps.weight") {
            // Residual-branch projections scaled by 1/sqrt(2·layers) (GPT-2's initialisation):
            // each layer nudges the residual stream instead of replacing it.
            scale /= (2.0 * c.layers as f32).sqrt();
        }
        out.iter_mut().for_each(|x| *x = scale * rng.uniform());
    }
}

/// Writes a synthetic model to `path`; `progress` is called after each tensor.
pub fn write_model(
    c: &SynthConfig,
    path: &Path,
    threads: usize,
    mut progress: impl FnMut(&TensorSpec),
) -> Result<(), SynthError> {
    c.validate()?;
    let specs = tensor_specs(c);
    let io = |source| SynthError::Io { path: path.display().to_string(), source };
    let mut w = GgufWriter::create(path, &metadata(c), specs.clone()).map_err(io)?;
    let threads = threads.max(1);
    for (ti, spec) in specs.iter().enumerate() {
        let tensor_seed = mix(c.seed, ti as u64 + 1);
        let cols = spec.dims[0] as usize;
        let n_rows = spec.dims.iter().skip(1).product::<u64>() as usize;
        let rb = spec.ty.row_bytes(cols).unwrap_or(0);
        // Chunks of at most ~32 MiB, rows split across threads inside a chunk.
        let rows_per_chunk = ((32usize << 20) / rb.max(1)).clamp(1, n_rows.max(1));
        let start = w.position();
        let mut buf = vec![0u8; rows_per_chunk * rb];
        let mut r0 = 0;
        while r0 < n_rows {
            let nr = rows_per_chunk.min(n_rows - r0);
            let chunk = &mut buf[..nr * rb];
            let per_thread = nr.div_ceil(threads);
            let result: Result<(), quant::QuantError> = std::thread::scope(|s| {
                let handles: Vec<_> = chunk
                    .chunks_mut(per_thread * rb)
                    .enumerate()
                    .map(|(t, part)| {
                        s.spawn(move || {
                            let mut vals = vec![0f32; cols];
                            for (k, dst) in part.chunks_mut(rb).enumerate() {
                                let row = (r0 + t * per_thread + k) as u64;
                                row_values(c, spec, tensor_seed, row, &mut vals);
                                quant::quantize_row(spec.ty, &vals, dst)?;
                            }
                            Ok(())
                        })
                    })
                    .collect();
                handles.into_iter().try_for_each(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            });
            result.map_err(|source| SynthError::Quant { tensor: spec.name.clone(), source })?;
            w.write_chunk(chunk).map_err(io)?;
            r0 += nr;
        }
        w.end_tensor(start).map_err(io)?;
        progress(spec);
    }
    w.finish().map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_are_learned_and_deterministic() {
        let a = learn_merges(200);
        assert!(a.len() > 100, "only {} merges", a.len());
        assert_eq!(a, learn_merges(200));
        assert!(a.iter().any(|(l, r)| format!("{l}{r}") == "Ġthe" || l == "Ġ"), "{:?}", &a[..10]);
    }

    #[test]
    fn presets_are_valid_and_sized() {
        for p in ["tiny", "small", "qwen3-30b-a3b"] {
            SynthConfig::preset(p).unwrap().validate().unwrap();
        }
        let small = SynthConfig::preset("small").unwrap().total_bytes();
        assert!((400 << 20..650 << 20).contains(&small), "small is {small} bytes");
    }

    #[test]
    fn bad_shapes_are_rejected_with_a_reason() {
        let mut c = SynthConfig::preset("tiny").unwrap();
        c.quant = QuantMix::Q4K;
        c.hidden = 96;
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("multiple of 256"), "{e}");
        let mut c = SynthConfig::preset("tiny").unwrap();
        c.heads = 3;
        assert!(c.validate().is_err());
    }
}
