//! The `engine` binary: `inspect`, `synth`, `run`.

use std::io::Write as _;

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;

use engine::cli::{BenchArgs, Cli, Cmd, ExpertArgs, RunArgs, SynthArgs};

use engine::cache::slots::ExpertSlots;
use engine::cache::{CacheConfig, ExpertCache};
use engine::dense_regions::DenseRegions;
use engine::gguf::Gguf;
use engine::markers::{KIND_GENERATE, KIND_PROMPT};
use engine::model::{Model, Session};
use engine::output::{Output, Policy};
use engine::placement::{DensePolicy, ExpertAdvice, ExpertPolicy, Placement};
use engine::sampling::{Sampler, SamplerConfig};
use engine::synth::{QuantMix, SynthConfig};
use engine::telemetry::{Meter, MetricsHeader, MetricsWriter};
use engine::tokenizer::{Tokenizer, Utf8Stream};

/// Sets up where `model`'s experts come from; the cache for `--experts cache`.
fn setup_experts(model: &mut Model, a: &ExpertArgs, n_ctx: usize) -> Result<Option<ExpertCache>> {
    let path = model.gguf.path().display().to_string();
    model.placement.set_experts(a.experts);
    if a.expert_advice != ExpertAdvice::Normal {
        if a.experts != ExpertPolicy::Mmap {
            bail!("--expert-advice applies to --experts mmap only");
        }
        let n = Placement::advise_experts(&model.gguf, a.expert_advice)
            .with_context(|| format!("madvise on the experts of {path}"))?;
        eprintln!("engine: {:?} advised on {:.1} MiB of expert pages", a.expert_advice, mib(n as u64));
    }
    if a.experts != ExpertPolicy::Cache {
        return Ok(None);
    }
    // The session's memory beside the weights at n_ctx (`Config::state_bytes`): the KV cache
    // twice (its buffers grow by doubling) and the recurrent state (allocated once, full size).
    let st = model.cfg.state_bytes(n_ctx);
    let state = 2 * st.kv + st.recurrent;
    let bytes = match a.cache_mib.as_str() {
        "auto" => {
            let on_mapping = if model.placement.dense == DensePolicy::Mmap { model.placement.dense_bytes } else { 0 };
            let b = engine::cache::budget::auto(on_mapping, state).map_err(anyhow::Error::msg)?;
            eprintln!("engine: expert cache budget {:.1} MiB = {}", mib(b.bytes), b.source);
            b.bytes
        }
        n => n
            .parse::<u64>()
            .map(|m| m << 20)
            .map_err(|_| anyhow::anyhow!("--cache-mib {n:?}: a number of MiB or `auto`"))?,
    };
    let cfg = CacheConfig { bytes, io_threads: a.io_threads.max(1), lock: a.cache_lock, prefetch: a.prefetch };
    let cache = ExpertCache::new(model, cfg)?;
    if let Some(path) = &a.cache_log {
        let f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("--cache-log {}", path.display()))?;
        cache.set_load_log(f);
    }
    eprintln!(
        "engine: expert cache: {} slots of {:.2} MiB ({:.1} MiB{}), {} I/O threads, prefetch {}, table {} in {}",
        cache.n_slots(),
        mib(cache.slot_bytes() as u64),
        mib(cache.bytes() as u64),
        if a.cache_lock { ", locked" } else { "" },
        a.io_threads.max(1),
        if a.prefetch { "on" } else { "off" },
        if cache.is_published() { "published" } else { "not published" },
        engine::cache::slots::SYMBOL
    );
    Ok(Some(cache))
}

/// The share of a layer's experts that the run's most-used ones need to make up 90 % of its
/// selections, averaged over the layers that routed (the routing skew a cache lives on).
fn experts_for_90pct(counts: &[Vec<u64>]) -> Option<f64> {
    let fracs: Vec<f64> = counts
        .iter()
        .filter_map(|c| {
            let total: u64 = c.iter().sum();
            if total == 0 {
                return None;
            }
            let mut v = c.clone();
            v.sort_unstable_by(|a, b| b.cmp(a));
            let (mut acc, mut n) = (0u64, 0usize);
            while acc * 10 < total * 9 {
                acc += v[n];
                n += 1;
            }
            Some(n as f64 / c.len() as f64)
        })
        .collect();
    (!fracs.is_empty()).then(|| fracs.iter().sum::<f64>() / fracs.len() as f64)
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

/// Which expert the expert cache holds in which slot, for observers (`--experts cache`; the ABI
/// is specified in `moe_abi::expert_slots`, the engine's side in [`engine::cache::slots`]).
#[unsafe(no_mangle)]
#[used]
pub static moe_engine_expert_slots: ExpertSlots = ExpertSlots::new();

/// A user error is one line on stderr and exit status 1 (`engine::errors`).
fn main() {
    if let Err(e) = engine_main() {
        eprintln!("engine: error: {}", engine::errors::one_line(&e));
        std::process::exit(1);
    }
}

fn engine_main() -> Result<()> {
    engine::dense_regions::export(&moe_engine_dense_regions);
    engine::cache::slots::export(&moe_engine_expert_slots);
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
        Cmd::Bench(a) => {
            eprintln!("engine: {isa_line}");
            bench(&a)
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

fn bench(a: &BenchArgs) -> Result<()> {
    let (path, n_prompt, n_gen, json) = (&a.model, a.n_prompt, a.n_gen, a.json);
    let (threads, reps) = (a.threads.unwrap_or_else(default_threads).max(1), a.repetitions.max(1));
    let (dense, experts) = (a.dense, &a.experts);
    let mut model = Model::load_with(path, dense).with_context(|| format!("loading {}", path.display()))?;
    let n_ctx = n_prompt.max(n_gen) + 1;
    let cache = setup_experts(&mut model, experts, n_ctx)?;
    let n_vocab = model.cfg.n_vocab as u64;
    let mut rng = engine::synth::SplitMix::new(1);
    let mut sess = Session::new(&model, threads, n_ctx);
    if let Some(c) = &cache {
        sess = sess.with_experts(c);
    }
    // Warm-up (page in the weights, like llama-bench's warm-up run).
    sess.step(&[0]).context("warm-up")?;
    let mut pp = Vec::new();
    let mut tg = Vec::new();
    let mut times = engine::model::StepTimes::default();
    let mut tg_cache = engine::cache::CacheStats::default();
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
            let c0 = cache.as_ref().map(ExpertCache::stats).unwrap_or_default();
            let t = Instant::now();
            for _ in 0..n_gen {
                let logits = sess.step(&[tok]).context("generation")?;
                tok = engine::sampling::argmax(logits);
            }
            tg.push(n_gen as f64 / t.elapsed().as_secs_f64());
            times = sess.times;
            tg_cache = cache.as_ref().map(|c| c.stats().since(&c0)).unwrap_or_default();
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
                "experts": model.placement.experts.name(),
                "tg_cache_hit_pct": tg_cache.hit_pct(),
                "tg_read_bytes_per_tok": tg_cache.read_bytes as f64 / n_gen.max(1) as f64,
                "tg_stall_ms_per_tok": per_tok(tg_cache.stall_ns),
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
    set!(rope_dims, shared_ffn, full_attn_interval, ssm_state, ssm_k_heads, ssm_v_heads, sliding_window, context);
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
    let out = Output::create(&a.output, Policy { force: a.force, inputs: &[] })?;
    engine::synth::write_model(&c, out.partial_path(), a.threads.unwrap_or_else(default_threads), |s| {
        done += s.size().unwrap_or(0);
        if total > (256 << 20) && s.name.ends_with("ffn_down_exps.weight") {
            eprintln!("  {:>5.1}% {}", done as f64 * 100.0 / total as f64, s.name);
        }
    })
    .with_context(|| format!("writing {}", a.output.display()))?;
    out.commit()?;
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
    // Outputs are checked before the work (`engine::output`).
    let inputs = [path.clone()];
    let policy = Policy { force: a.force, inputs: &inputs };
    let output = |p: &Option<std::path::PathBuf>| p.as_deref().map(|p| Output::create(p, policy)).transpose();
    let (metrics_csv, metrics_json, logits_out) =
        (output(&a.metrics_csv)?, output(&a.metrics_json)?, output(&a.logits_out)?);
    let t_load = Instant::now();
    let mut model = Model::load_with(path, a.dense).with_context(|| format!("loading {}", path.display()))?;
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
    let kv_ctx = n_ctx.min(model.cfg.n_ctx_train).max(1);
    let cache = setup_experts(&mut model, &a.experts, kv_ctx)?;
    let mut sess = Session::new(&model, threads, n_ctx);
    if let Some(c) = &cache {
        sess = sess.with_experts(c);
    }
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
    let metrics = if metrics_csv.is_some() || metrics_json.is_some() {
        let header = MetricsHeader::for_run(
            &model,
            cache.as_ref(),
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
            MetricsWriter::create(metrics_csv, metrics_json, &header, gen_steps_planned)
                .context("creating the metrics file")?,
        )
    } else {
        None
    };
    let mut meter = Meter::new(&model, Duration::from_millis(a.resident_every_ms), metrics).with_cache(cache.as_ref());
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
    let keep_logits = logits_out.is_some();
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
    let gen_cache0 = cache.as_ref().map(ExpertCache::stats);
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
    // The cache's counters over the whole run and over the generation steps.
    let cache_json = |c: &ExpertCache| {
        let (all, g) = (c.stats(), c.stats().since(&gen_cache0.unwrap_or_default()));
        serde_json::json!({
            "slots": c.n_slots(), "slot_bytes": c.slot_bytes(), "bytes": c.bytes(), "expert_bytes": c.expert_bytes(),
            "io_threads": c.config.io_threads, "prefetch": c.config.prefetch,
            "read_bytes": all.read_bytes, "reads": all.reads, "hits": all.hits, "misses": all.misses,
            "gen_read_bytes": g.read_bytes, "gen_hits": g.hits, "gen_misses": g.misses,
            "gen_stall_ms": g.stall_ns as f64 / 1e6, "gen_io_ms": g.io_ns as f64 / 1e6,
            "prefetched": all.prefetched, "prefetch_used": all.prefetch_used,
        })
    };
    let prompt_tok_s = prompt.len() as f64 / prompt_s;
    let gen_tok_s = if gen_steps > 0 { gen_steps as f64 / gen_s } else { 0.0 };
    if let Some(out) = logits_out {
        let bytes: Vec<u8> = last_logits.iter().flat_map(|v| v.to_le_bytes()).collect();
        out.write_all_and_commit(&bytes)?;
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
            "cache": cache.as_ref().map(cache_json),
            "experts_for_90pct": experts_for_90pct(&sess.expert_counts),
            "expert_counts": sess.expert_counts,
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
        if let Some(c) = &cache {
            let j = cache_json(c);
            eprintln!(
                "expert cache: {} hits, {} misses, {:.1} MiB read in {} reads, generation stall {:.1} ms",
                j["hits"],
                j["misses"],
                mib(j["read_bytes"].as_u64().unwrap_or(0)),
                j["reads"],
                j["gen_stall_ms"].as_f64().unwrap_or(0.0)
            );
        }
    }
    Ok(())
}
