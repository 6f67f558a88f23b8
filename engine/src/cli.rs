//! The `engine` command line (its flag table), in the library so that the
//! observer reads a recorded engine command line with the engine's own
//! definitions ([`config_of`]) instead of guessing which flags take values.

use std::path::PathBuf;

use clap::{CommandFactory, Parser, Subcommand};

use crate::placement::{DensePolicy, ExpertAdvice, ExpertPolicy};

#[derive(Parser)]
#[command(name = "engine", about = "Embedded MoE engine (qwen3moe, olmoe, qwen35moe, gpt-oss GGUF)")]
pub struct Cli {
    #[command(subcommand)]
    pub cmd: Cmd,
}

#[derive(Subcommand)]
pub enum Cmd {
    /// Print architecture, metadata, tensor shapes, types and byte ranges.
    Inspect {
        file: PathBuf,
        /// List every routed expert's byte range.
        #[arg(long)]
        experts: bool,
    },
    /// Write a synthetic GGUF (any supported architecture, by preset) with random weights.
    Synth(SynthArgs),
    /// Run a prompt and generate.
    Run(RunArgs),
    /// Measure prompt (pp) and generation (tg) speed like llama-bench: random token ids,
    /// an empty context per repetition, averages over repetitions.
    Bench(BenchArgs),
    /// Tokenize text with the model's vocabulary and print the ids as JSON.
    Tokenize {
        #[arg(long)]
        model: PathBuf,
        #[arg(long)]
        text: String,
    },
}

#[derive(clap::Args)]
pub struct SynthArgs {
    #[arg(short, long)]
    pub output: PathBuf,
    /// tiny | small | qwen3-30b-a3b | olmoe-tiny | olmoe-bench | olmoe-1b-7b | qwen35moe-tiny |
    /// qwen35moe-bench | qwen3.6-35b-a3b | gpt-oss-tiny | gpt-oss-bench | gpt-oss-20b
    #[arg(long, default_value = "tiny")]
    pub preset: String,
    /// q8_0 | q4_k | q6_k | q4_k_m | mxfp4 (default: the preset's)
    #[arg(long)]
    pub quant: Option<String>,
    #[arg(long)]
    pub layers: Option<usize>,
    #[arg(long)]
    pub hidden: Option<usize>,
    #[arg(long)]
    pub heads: Option<usize>,
    #[arg(long)]
    pub kv_heads: Option<usize>,
    #[arg(long)]
    pub head_dim: Option<usize>,
    #[arg(long)]
    pub experts: Option<usize>,
    #[arg(long)]
    pub experts_used: Option<usize>,
    #[arg(long)]
    pub expert_ffn: Option<usize>,
    #[arg(long)]
    pub vocab: Option<usize>,
    /// Dimensions of each head RoPE rotates (qwen35moe: partial RoPE).
    #[arg(long)]
    pub rope_dims: Option<usize>,
    /// RoPE sections `t,h,w,e` (qwen35moe's multi-section RoPE).
    #[arg(long, value_delimiter = ',')]
    pub rope_sections: Option<Vec<usize>>,
    /// Rows of the shared expert (qwen35moe).
    #[arg(long)]
    pub shared_ffn: Option<usize>,
    /// Every n-th layer has full attention, the others DeltaNet (qwen35moe).
    #[arg(long)]
    pub full_attn_interval: Option<usize>,
    /// DeltaNet head dimension (qwen35moe).
    #[arg(long)]
    pub ssm_state: Option<usize>,
    /// DeltaNet Q/K heads (qwen35moe).
    #[arg(long)]
    pub ssm_k_heads: Option<usize>,
    /// DeltaNet V heads (qwen35moe).
    #[arg(long)]
    pub ssm_v_heads: Option<usize>,
    /// Sliding window of every other layer (gpt-oss).
    #[arg(long)]
    pub sliding_window: Option<usize>,
    /// Context length the model says it was trained for (`context_length`; the engine's cap).
    #[arg(long)]
    pub context: Option<usize>,
    /// Router skew exponent: expert of popularity rank r gets router rows scaled by (r+1)^-skew.
    #[arg(long)]
    pub router_skew: Option<f32>,
    /// σ of the log-normal per-token scale of output.weight rows (larger = more peaked logits).
    #[arg(long)]
    pub output_skew: Option<f32>,
    /// Use token_embd as the output matrix (no output.weight).
    #[arg(long)]
    pub tied: bool,
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    #[arg(long)]
    pub threads: Option<usize>,
    /// Print the resolved configuration and exit without writing.
    #[arg(long)]
    pub dry_run: bool,
    /// Replace the output file if it exists (it is written aside and renamed into place).
    #[arg(long)]
    pub force: bool,
}

#[derive(clap::Args)]
pub struct RunArgs {
    #[arg(long, short)]
    pub model: PathBuf,
    #[arg(long, short)]
    pub prompt: String,
    /// Tokens to generate.
    #[arg(short, default_value_t = 64)]
    pub n: usize,
    #[arg(long, short)]
    pub threads: Option<usize>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temp: f32,
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    /// Context length (default: prompt + n).
    #[arg(long)]
    pub ctx: Option<usize>,
    /// Prompt tokens per forward pass (1 = token by token, like decode).
    #[arg(long, default_value_t = crate::model::MAX_BATCH)]
    pub ubatch: usize,
    /// Keep generating past end-of-generation tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// One JSON object per token, then a summary object.
    #[arg(long)]
    pub json: bool,
    /// Write the logits that chose the last generated token (f32 little-endian) to this file.
    #[arg(long)]
    pub logits_out: Option<PathBuf>,
    /// Dense weights (all but routed experts): `mmap` = the file mapping (page cache), `anon` =
    /// a copy in anonymous memory (swappable, e.g. to zram), `locked` = that copy mlock'ed.
    #[arg(long, default_value = "mmap")]
    pub dense: DensePolicy,
    #[command(flatten)]
    pub experts: ExpertArgs,
    /// Write per-token telemetry in the `bmoe_metrics v1` CSV format to this file.
    #[arg(long)]
    pub metrics_csv: Option<PathBuf>,
    /// Write the same rows as JSON lines to this file.
    #[arg(long)]
    pub metrics_json: Option<PathBuf>,
    /// Sample `dense_resident_frac` (mincore) at most this often, in ms, and at most 1 % of the
    /// time (0 = every step, whatever it costs).
    #[arg(long, default_value_t = 100)]
    pub resident_every_ms: u64,
    /// Replace output files (--metrics-csv, --metrics-json, --logits-out) that exist; each is
    /// checked before the model loads, written aside and renamed into place, never over the model.
    #[arg(long)]
    pub force: bool,
}

#[derive(clap::Args)]
pub struct BenchArgs {
    #[arg(long, short)]
    pub model: PathBuf,
    /// Prompt tokens per pp test.
    #[arg(short = 'p', default_value_t = 128)]
    pub n_prompt: usize,
    /// Generated tokens per tg test.
    #[arg(short = 'n', default_value_t = 64)]
    pub n_gen: usize,
    #[arg(long, short)]
    pub threads: Option<usize>,
    #[arg(long, short, default_value_t = 3)]
    pub repetitions: usize,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// Dense weights: mmap | anon | locked (see `run --help`).
    #[arg(long, default_value = "mmap")]
    pub dense: DensePolicy,
    #[command(flatten)]
    pub experts: ExpertArgs,
}

/// Where the routed experts come from (`run` and `bench`).
#[derive(clap::Args, Debug, Clone)]
pub struct ExpertArgs {
    /// Routed experts: `mmap` = the file mapping (page cache); `cache` = the expert cache, slots in
    /// anonymous memory filled by O_DIRECT reads on I/O threads.
    #[arg(long, default_value = "mmap")]
    pub experts: ExpertPolicy,
    /// Expert cache size in MiB, or `auto`: the memory cgroup's limit (or MemAvailable) minus
    /// what the process holds, the KV cache and recurrent state, and headroom.
    #[arg(long, default_value = "auto")]
    pub cache_mib: String,
    /// I/O threads reading experts into the cache.
    #[arg(long, default_value_t = 4)]
    pub io_threads: usize,
    /// mlock the expert cache.
    #[arg(long)]
    pub cache_lock: bool,
    /// Read the next layer's likely experts (its router on the current hidden state) ahead.
    #[arg(long)]
    pub prefetch: bool,
    /// With `--experts cache`: append one line `STEP LAYER EXPERT BYTES` to FILE for every expert
    /// the cache starts reading (STEP: the step's token-marker index; BYTES: what its reads
    /// return), for checks against an observer.
    #[arg(long, value_name = "FILE")]
    pub cache_log: Option<std::path::PathBuf>,
    /// With `--experts mmap`: `random` = MADV_RANDOM on the expert pages (no read-ahead of
    /// neighbouring experts), `normal` = the kernel's default.
    #[arg(long, default_value = "normal")]
    pub expert_advice: ExpertAdvice,
}

/// The settings an `engine` command line `argv` (program name first) gives,
/// by the engine's flag table: `subcommand` and every flag given on the
/// command line as its long name (short `-n` as `n`) → value (`true` for a
/// switch; several values joined by `,`). `None` when `argv` does not parse.
pub fn config_of(argv: &[String]) -> Option<std::collections::BTreeMap<String, String>> {
    let cmd = Cli::command();
    let m = cmd.clone().try_get_matches_from(argv).ok()?;
    let (name, sub) = m.subcommand()?;
    let sub_cmd = cmd.find_subcommand(name)?;
    let mut out = std::collections::BTreeMap::new();
    out.insert("subcommand".to_string(), name.to_string());
    for arg in sub_cmd.get_arguments() {
        let id = arg.get_id().as_str();
        if sub.value_source(id) != Some(clap::parser::ValueSource::CommandLine) {
            continue;
        }
        let key = arg.get_long().map(str::to_string).unwrap_or_else(|| id.replace('_', "-"));
        let value = match sub.get_raw(id) {
            Some(raw) => raw.map(|v| v.to_string_lossy().into_owned()).collect::<Vec<_>>().join(","),
            None => "true".to_string(),
        };
        out.insert(key, value);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn switches_short_flags_and_values_are_read_by_the_table() {
        let argv: Vec<String> =
            "engine run -m m.gguf -p hi -n 17 --ignore-eos -t 2 --dense=anon".split(' ').map(String::from).collect();
        let c = config_of(&argv).unwrap();
        assert_eq!(c["ignore-eos"], "true");
        assert_eq!(c["n"], "17");
        assert_eq!(c["threads"], "2");
        assert_eq!(c["dense"], "anon");
        assert_eq!(c["model"], "m.gguf");
        assert_eq!(c["subcommand"], "run");
        assert!(!c.contains_key("temp"), "defaults are not the user's settings: {c:?}");
    }
}
