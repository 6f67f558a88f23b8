//! The `engine` binary: `inspect`, `synth`, `run`.

use std::io::Write as _;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};

use engine::dense_regions::DenseRegions;
use engine::gguf::Gguf;
use engine::markers::{KIND_GENERATE, KIND_PROMPT};
use engine::model::{Model, Session};
use engine::placement::{DensePolicy, ExpertPolicy};
use engine::sampling::{Sampler, SamplerConfig};
use engine::synth::{QuantMix, SynthConfig};
use engine::telemetry::{Meter, MetricsHeader, MetricsWriter};
use engine::tokenizer::{Tokenizer, Utf8Stream};

#[derive(Parser)]
#[command(name = "engine", about = "Embedded MoE engine (qwen3moe, olmoe, qwen35moe, gpt-oss GGUF)")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
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
    Bench {
        #[arg(long, short)]
        model: PathBuf,
        /// Prompt tokens per pp test.
        #[arg(short = 'p', default_value_t = 128)]
        n_prompt: usize,
        /// Generated tokens per tg test.
        #[arg(short = 'n', default_value_t = 64)]
        n_gen: usize,
        #[arg(long, short)]
        threads: Option<usize>,
        #[arg(long, short, default_value_t = 3)]
        repetitions: usize,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
        /// Dense weights: mmap | anon | locked (see `run --help`).
        #[arg(long, default_value = "mmap")]
        dense: DensePolicy,
    },
    /// Tokenize text with the model's vocabulary and print the ids as JSON.
    Tokenize {
        #[arg(long)]
        model: PathBuf,
        #[arg(long)]
        text: String,
    },
}

#[derive(clap::Args)]
struct SynthArgs {
    #[arg(short, long)]
    output: PathBuf,
    /// tiny | small | qwen3-30b-a3b | olmoe-tiny | olmoe-bench | olmoe-1b-7b | qwen35moe-tiny |
    /// qwen35moe-bench | qwen3.6-35b-a3b | gpt-oss-tiny | gpt-oss-bench | gpt-oss-20b
    #[arg(long, default_value = "tiny")]
    preset: String,
    /// q8_0 | q4_k | q6_k | q4_k_m | mxfp4 (default: the preset's)
    #[arg(long)]
    quant: Option<String>,
    #[arg(long)]
    layers: Option<usize>,
    #[arg(long)]
    hidden: Option<usize>,
    #[arg(long)]
    heads: Option<usize>,
    #[arg(long)]
    kv_heads: Option<usize>,
    #[arg(long)]
    head_dim: Option<usize>,
    #[arg(long)]
    experts: Option<usize>,
    #[arg(long)]
    experts_used: Option<usize>,
    #[arg(long)]
    expert_ffn: Option<usize>,
    #[arg(long)]
    vocab: Option<usize>,
    /// Router skew exponent: expert of popularity rank r gets router rows scaled by (r+1)^-skew.
    #[arg(long)]
    router_skew: Option<f32>,
    /// σ of the log-normal per-token scale of output.weight rows (larger = more peaked logits).
    #[arg(long)]
    output_skew: Option<f32>,
    /// Dimensions of each head RoPE rotates (qwen35moe: partial RoPE).
    #[arg(long)]
    rope_dims: Option<usize>,
    /// RoPE sections `t,h,w,e` (qwen35moe's multi-section RoPE).
    #[arg(long, value_delimiter = ',')]
    rope_sections: Option<Vec<usize>>,
    /// Rows of the shared expert (qwen35moe).
    #[arg(long)]
    shared_ffn: Option<usize>,
    /// Every n-th layer has full attention, the others DeltaNet (qwen35moe).
    #[arg(long)]
    full_attn_interval: Option<usize>,
    /// DeltaNet head dimension (qwen35moe).
    #[arg(long)]
    ssm_state: Option<usize>,
    /// DeltaNet Q/K heads (qwen35moe).
    #[arg(long)]
    ssm_k_heads: Option<usize>,
    /// DeltaNet V heads (qwen35moe).
    #[arg(long)]
    ssm_v_heads: Option<usize>,
    /// Sliding window of every other layer (gpt-oss).
    #[arg(long)]
    sliding_window: Option<usize>,
    /// Use token_embd as the output matrix (no output.weight).
    #[arg(long)]
    tied: bool,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    #[arg(long)]
    threads: Option<usize>,
    /// Print the resolved configuration and exit without writing.
    #[arg(long)]
    dry_run: bool,
}

#[derive(clap::Args)]
struct RunArgs {
    #[arg(long, short)]
    model: PathBuf,
    #[arg(long, short)]
    prompt: String,
    /// Tokens to generate.
    #[arg(short, default_value_t = 64)]
    n: usize,
    #[arg(long, short)]
    threads: Option<usize>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    temp: f32,
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    /// Context length (default: prompt + n).
    #[arg(long)]
    ctx: Option<usize>,
    /// Prompt tokens per forward pass (1 = token by token, like decode).
    #[arg(long, default_value_t = engine::model::MAX_BATCH)]
    ubatch: usize,
    /// Keep generating past end-of-generation tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// One JSON object per token, then a summary object.
    #[arg(long)]
    json: bool,
    /// Write the logits that chose the last generated token (f32 little-endian) to this file.
    #[arg(long)]
    logits_out: Option<PathBuf>,
    /// Dense weights (all but routed experts): `mmap` = the file mapping (page cache), `anon` =
    /// a copy in anonymous memory (swappable, e.g. to zram), `locked` = that copy mlock'ed.
    #[arg(long, default_value = "mmap")]
    dense: DensePolicy,
    /// Routed experts: `mmap` = the file mapping.
    #[arg(long, default_value = "mmap")]
    experts: ExpertPolicy,
    /// Write per-token telemetry in the `bmoe_metrics v1` CSV format to this file.
    #[arg(long)]
    metrics_csv: Option<PathBuf>,
    /// Write the same rows as JSON lines to this file.
    #[arg(long)]
    metrics_json: Option<PathBuf>,
    /// Sample `dense_resident_frac` (mincore) at most this often, in ms, and at most 1 % of the
    /// time (0 = every step, whatever it costs).
    #[arg(long, default_value_t = 100)]
    resident_every_ms: u64,
}

fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Where the anonymous copy of the dense weights is, for observers (`--dense anon|locked`; the
/// ABI is specified in [`engine::dense_regions`]). Defined here, in the binary, and kept by
/// `#[used]`: no Rust code reads it, other processes do (through `/proc/PID/mem`).
#[unsafe(no_mangle)]
#[used]
pub static moe_engine_dense_regions: DenseRegions = DenseRegions::new();

fn main() -> Result<()> {
    engine::dense_regions::export(&moe_engine_dense_regions);
    // Die quietly on a closed stdout (`engine run … | head`) instead of panicking.
    // SAFETY: restoring the default SIGPIPE disposition before any thread is started.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = Cli::parse();
    // The ISA level (ENGINE_ISA) decides kernels and numerics; a bad value is an error here,
    // before any kernel runs.
    let isa_line = engine::quant::isa_report().context("choosing the kernels' ISA level")?;
    match cli.cmd {
        Cmd::Inspect { file, experts } => {
            let g = Gguf::open(&file).with_context(|| format!("reading {}", file.display()))?;
            print!("{}", engine::inspect::report(&g, experts));
            Ok(())
        }
        Cmd::Synth(a) => synth(a),
        Cmd::Run(a) => {
            eprintln!("engine: {isa_line}");
            run(a)
        }
        Cmd::Bench { model, n_prompt, n_gen, threads, repetitions, json, dense } => {
            eprintln!("engine: {isa_line}");
            bench(
                &model,
                n_prompt,
                n_gen,
                threads.unwrap_or_else(default_threads).max(1),
                repetitions.max(1),
                json,
                dense,
            )
        }
        Cmd::Tokenize { model, text } => {
            let g = Gguf::open(&model).with_context(|| format!("reading {}", model.display()))?;
            let tok = Tokenizer::from_gguf(&g).with_context(|| format!("tokenizer of {}", model.display()))?;
            let ids = tok.encode(&text).with_context(|| format!("tokenizing with {}", model.display()))?;
            println!("{}", serde_json::to_string(&ids)?);
            Ok(())
        }
    }
}

fn bench(
    path: &std::path::Path,
    n_prompt: usize,
    n_gen: usize,
    threads: usize,
    reps: usize,
    json: bool,
    dense: DensePolicy,
) -> Result<()> {
    let model = Model::load_with(path, dense).with_context(|| format!("loading {}", path.display()))?;
    let n_vocab = model.cfg.n_vocab as u64;
    let mut rng = engine::synth::SplitMix::new(1);
    let mut sess = Session::new(&model, threads, n_prompt.max(n_gen) + 1);
    // Warm-up (page in the weights, like llama-bench's warm-up run).
    sess.step(&[0]).context("warm-up")?;
    let mut pp = Vec::new();
    let mut tg = Vec::new();
    let mut times = engine::model::StepTimes::default();
    for _ in 0..reps {
        if n_prompt > 0 {
            sess.reset();
            let toks: Vec<u32> = (0..n_prompt).map(|_| (rng.next_u64() % n_vocab) as u32).collect();
            let t = Instant::now();
            sess.step(&toks).context("prompt")?;
            pp.push(n_prompt as f64 / t.elapsed().as_secs_f64());
        }
        if n_gen > 0 {
            sess.reset();
            sess.times = Default::default();
            let mut tok = (rng.next_u64() % n_vocab) as u32;
            let t = Instant::now();
            for _ in 0..n_gen {
                let logits = sess.step(&[tok]).context("generation")?;
                tok = engine::sampling::argmax(logits);
            }
            tg.push(n_gen as f64 / t.elapsed().as_secs_f64());
            times = sess.times;
        }
    }
    let avg = |v: &[f64]| if v.is_empty() { 0.0 } else { v.iter().sum::<f64>() / v.len() as f64 };
    let per_tok = |ns: u64| ns as f64 / 1e6 / n_gen.max(1) as f64;
    if json {
        println!(
            "{}",
            serde_json::json!({
                "pp_tok_s": avg(&pp), "tg_tok_s": avg(&tg), "n_prompt": n_prompt, "n_gen": n_gen,
                "threads": threads, "repetitions": reps,
                "tg_attention_ms_per_tok": per_tok(times.attention_ns),
                "tg_experts_ms_per_tok": per_tok(times.experts_ns),
                "tg_output_ms_per_tok": per_tok(times.output_ns),
            })
        );
    } else {
        println!(
            "pp{n_prompt}: {:.2} tok/s  tg{n_gen}: {:.2} tok/s  ({threads} threads, {reps} reps)",
            avg(&pp),
            avg(&tg)
        );
        println!(
            "tg per token: attention {:.3} ms, experts {:.3} ms, output {:.3} ms",
            per_tok(times.attention_ns),
            per_tok(times.experts_ns),
            per_tok(times.output_ns)
        );
    }
    Ok(())
}

fn synth(a: SynthArgs) -> Result<()> {
    let mut c = SynthConfig::preset(&a.preset)
        .with_context(|| format!("unknown preset {:?} ({})", a.preset, engine::synth::PRESETS))?;
    if let Some(q) = &a.quant {
        c.quant =
            QuantMix::parse(q).with_context(|| format!("unknown quant {q:?} (q8_0, q4_k, q6_k, q4_k_m, mxfp4)"))?;
    }
    macro_rules! set {
        ($($f:ident),*) => { $( if let Some(v) = a.$f { c.$f = v; } )* };
    }
    set!(layers, hidden, heads, kv_heads, head_dim, experts, experts_used, expert_ffn, vocab, router_skew, output_skew);
    set!(rope_dims, shared_ffn, full_attn_interval, ssm_state, ssm_k_heads, ssm_v_heads, sliding_window);
    if let Some(v) = &a.rope_sections {
        c.rope_sections = v.as_slice().try_into().context("--rope-sections takes four values: t,h,w,e")?;
    }
    c.tied_output |= a.tied;
    c.seed = a.seed;
    c.validate()?;
    if a.dry_run {
        println!("{c:?} format={}", engine::synth::FORMAT_VERSION);
        return Ok(());
    }
    let total = c.total_bytes();
    eprintln!(
        "synth: {} {} layers, hidden {}, {}/{} heads × {}, {} experts ({} used) × ffn {}, vocab {}, {}: {:.1} MiB of tensors → {}",
        c.arch,
        c.layers,
        c.hidden,
        c.heads,
        c.kv_heads,
        c.head_dim,
        c.experts,
        c.experts_used,
        c.expert_ffn,
        c.vocab,
        c.quant.name(),
        total as f64 / (1 << 20) as f64,
        a.output.display()
    );
    let t = Instant::now();
    let mut done = 0u64;
    engine::synth::write_model(&c, &a.output, a.threads.unwrap_or_else(default_threads), |s| {
        done += s.size().unwrap_or(0);
        if total > (256 << 20) && s.name.ends_with("ffn_down_exps.weight") {
            eprintln!("  {:>5.1}% {}", done as f64 * 100.0 / total as f64, s.name);
        }
    })
    .with_context(|| format!("writing {}", a.output.display()))?;
    eprintln!("synth: done in {:.1} s", t.elapsed().as_secs_f64());
    Ok(())
}

/// Writes generated tokens to stdout (text, or one JSON object per token).
struct Emitter<'a> {
    json: bool,
    stream: Utf8Stream,
    out: std::io::StdoutLock<'a>,
}

impl Emitter<'_> {
    fn emit(&mut self, tok: &Tokenizer, id: u32) -> Result<()> {
        if self.json {
            let piece = String::from_utf8_lossy(tok.piece(id));
            writeln!(self.out, "{}", serde_json::json!({"id": id, "piece": piece}))?;
        } else {
            write!(self.out, "{}", self.stream.push(tok.piece(id)))?;
            self.out.flush()?;
        }
        Ok(())
    }
}

fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

fn run(a: RunArgs) -> Result<()> {
    let path = &a.model;
    let t_load = Instant::now();
    let model = Model::load_with(path, a.dense).with_context(|| format!("loading {}", path.display()))?;
    let load_s = t_load.elapsed().as_secs_f64();
    let p = &model.placement;
    eprintln!(
        "engine: {}: dense weights {:.1} MiB ({}), routed experts {:.1} MiB ({}), loaded in {:.2} s",
        path.display(),
        mib(p.dense_bytes),
        p.dense.name(),
        mib(p.expert_bytes),
        p.experts.name(),
        load_s
    );
    if let Some(r) = p.copy_range() {
        eprintln!(
            "engine: dense copy at {:#x}-{:#x} ({} pages, {} runs published in {})",
            r.start,
            r.end,
            r.len() / engine::placement::page_size(),
            p.published_ranges().len(),
            engine::dense_regions::SYMBOL
        );
    }
    let tok = Tokenizer::from_gguf(&model.gguf).with_context(|| format!("tokenizer of {}", path.display()))?;
    let prompt = tok.encode(&a.prompt).with_context(|| format!("tokenizing the prompt with {}", path.display()))?;
    if prompt.is_empty() {
        bail!("the prompt tokenizes to nothing; give some text");
    }
    let threads = a.threads.unwrap_or_else(default_threads).max(1);
    let n_ctx = a.ctx.unwrap_or(prompt.len() + a.n);
    let mut sess = Session::new(&model, threads, n_ctx);
    sess.ubatch = a.ubatch;
    let st = sess.state_bytes();
    let c = &model.cfg;
    let count = |m: engine::arch::Mixer| c.mixers.iter().filter(|&&x| x == m).count();
    eprintln!(
        "engine: {} ({} layers: {} full attention, {} sliding window, {} DeltaNet): KV + state for {} positions \
         {:.2} MiB (KV cache {:.2} MiB, recurrent state {:.2} MiB)",
        c.arch,
        c.n_layer,
        count(engine::arch::Mixer::Full),
        count(engine::arch::Mixer::Window),
        count(engine::arch::Mixer::DeltaNet),
        sess.n_ctx,
        mib(st.total()),
        mib(st.kv),
        mib(st.recurrent)
    );
    if prompt.len() + a.n > sess.n_ctx {
        bail!(
            "{}: prompt ({}) + n ({}) exceeds the context ({}, model trained for {})",
            path.display(),
            prompt.len(),
            a.n,
            sess.n_ctx,
            model.cfg.n_ctx_train
        );
    }
    let mut sampler = Sampler::new(SamplerConfig { temp: a.temp, top_k: a.top_k, top_p: a.top_p, seed: a.seed });
    let gen_steps_planned = a.n.saturating_sub(1) as u64;
    let metrics = if a.metrics_csv.is_some() || a.metrics_json.is_some() {
        let header = MetricsHeader::for_run(
            &model,
            threads,
            sess.n_ctx,
            &[
                ("prompt_tokens", prompt.len().to_string()),
                ("n_predict", a.n.to_string()),
                ("temp", a.temp.to_string()),
                ("seed", a.seed.to_string()),
                ("resident_every_ms", a.resident_every_ms.to_string()),
            ],
        );
        Some(
            MetricsWriter::create(a.metrics_csv.as_deref(), a.metrics_json.as_deref(), &header, gen_steps_planned)
                .context("creating the metrics file")?,
        )
    } else {
        None
    };
    let ExpertPolicy::Mmap = a.experts;
    let mut meter = Meter::new(&model, Duration::from_millis(a.resident_every_ms), metrics);
    let stdout = std::io::stdout();
    let mut em = Emitter { json: a.json, stream: Utf8Stream::default(), out: stdout.lock() };
    if !a.json {
        write!(em.out, "{}", a.prompt)?;
        em.out.flush()?;
    }

    // Step 0 (marked as the prompt): the forward pass over the prompt, then the first token is
    // sampled and written. Every later step (marked as a generated token) decodes the previous
    // token, samples the next one and writes it.
    let mut last_logits = Vec::new();
    let keep_logits = a.logits_out.is_some();
    let (first, prompt_rec) = meter.step(KIND_PROMPT, 0, prompt.len() as u64, || -> Result<u32> {
        let logits = sess.step(&prompt).with_context(|| format!("prompt of {} tokens", prompt.len()))?;
        if keep_logits {
            last_logits = logits.to_vec();
        }
        let t = sampler.sample(logits);
        if a.n > 0 {
            em.emit(&tok, t)?;
        }
        Ok(t)
    })?;
    let prompt_s = prompt_rec.rec.wall_ns as f64 / 1e9;
    let mut generated = if a.n > 0 { vec![first] } else { Vec::new() };
    let mut next = first;
    let mut gen_steps = 0u64;
    let t_gen = Instant::now();
    while generated.len() < a.n && (a.ignore_eos || !tok.is_eog(next)) {
        let index = generated.len() as u64;
        let (t, _) = meter.step(KIND_GENERATE, index, 1, || -> Result<u32> {
            let logits = sess.step(&[next]).with_context(|| format!("generating token {index}"))?;
            if keep_logits {
                last_logits.clear();
                last_logits.extend_from_slice(logits);
            }
            let t = sampler.sample(logits);
            em.emit(&tok, t)?;
            Ok(t)
        })?;
        next = t;
        generated.push(t);
        gen_steps += 1;
    }
    // Generation speed: generation steps over the wall-clock time of the generation loop.
    let gen_s = t_gen.elapsed().as_secs_f64();
    meter.finish().context("writing the metrics")?;
    let prompt_tok_s = prompt.len() as f64 / prompt_s;
    let gen_tok_s = if gen_steps > 0 { gen_steps as f64 / gen_s } else { 0.0 };
    if let Some(p) = &a.logits_out {
        let bytes: Vec<u8> = last_logits.iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(p, bytes).with_context(|| format!("writing {}", p.display()))?;
    }
    let times = sess.times;
    let marked_steps = 1 + gen_steps;
    if a.json {
        let summary = serde_json::json!({
            "prompt_tokens": prompt.len(),
            "gen_tokens": generated.len(),
            "gen_steps": gen_steps,
            "marked_steps": marked_steps,
            "prompt_tok_s": prompt_tok_s,
            "gen_tok_s": gen_tok_s,
            "prompt_ms": prompt_s * 1e3,
            "gen_ms": gen_s * 1e3,
            "threads": threads,
            "dense": model.placement.dense.name(),
            "experts": model.placement.experts.name(),
            "dense_bytes": model.placement.dense_bytes,
            "expert_bytes": model.placement.expert_bytes,
            "prompt_ids": prompt,
            "attention_ms": times.attention_ns as f64 / 1e6,
            "experts_ms": times.experts_ns as f64 / 1e6,
            "output_ms": times.output_ns as f64 / 1e6,
        });
        writeln!(em.out, "{summary}")?;
    } else {
        let rest = em.stream.finish();
        write!(em.out, "{rest}")?;
        writeln!(em.out)?;
        eprintln!(
            "prompt: {} tokens, {:.2} tok/s | generation: {} tokens, {} steps, {:.2} tok/s | {} threads | {} marked steps",
            prompt.len(),
            prompt_tok_s,
            generated.len(),
            gen_steps,
            gen_tok_s,
            threads,
            marked_steps
        );
    }
    Ok(())
}
