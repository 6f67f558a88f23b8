//! `cargo xtask bench engine [--arch A]`: engine vs llama.cpp's `llama-bench` on the same
//! synthetic file of the architecture (`qwen3moe`: the `small` preset; `olmoe`, `qwen35moe`,
//! `gpt-oss`: `{arch}-bench`, the released model's per-layer shapes with fewer layers and
//! experts, ~0.5 GB), same thread count, same run. Both measure pp (a batch of random prompt
//! tokens from an empty context) and tg (tokens generated one at a time from an empty
//! context), averaged over repetitions; the result is printed as engine / llama.cpp ratios,
//! against each llama.cpp build (`llama.rs`): the `avx2` build (the engine's kernel level) and
//! the speed build (the best this CPU offers without AMX; the same build on a CPU without
//! AVX-512). The decode target is against the speed build: 1.15× for `qwen3moe`, 1.0× for the
//! other architectures. llama-bench runs with its defaults
//! (flash attention `auto`, f16 KV cache); the engine at its default ISA level.
//!
//! The machine is shared and its speed drifts, so they are measured in rounds (`--rounds`, each
//! with `-r` repetitions of every program) in A-B-B-A order (`bench_util::abba_round`): even
//! rounds run the llama.cpp builds then the engine, odd rounds the engine then the builds (a
//! drift within a round favours neither side). A ratio is paired: engine / build within each
//! round, and the median of those per-round ratios is the result, with the rounds the engine
//! was the faster in. Every round's numbers are printed, and the medians of each program's
//! speeds beside.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::llama;

pub fn main(args: &[String]) -> Result<()> {
    let mut threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let (mut n_prompt, mut n_gen, mut reps, mut rounds) = (128usize, 64usize, 2usize, 3usize);
    let mut preset: Option<String> = None;
    let mut arch = "qwen3moe".to_owned();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = |name: &str| it.next().with_context(|| format!("{name} needs a value")).cloned();
        match a.as_str() {
            "--threads" => threads = val("--threads")?.parse()?,
            "-p" => n_prompt = val("-p")?.parse()?,
            "-n" => n_gen = val("-n")?.parse()?,
            "-r" => reps = val("-r")?.parse()?,
            "--rounds" => rounds = val("--rounds")?.parse()?,
            "--preset" => preset = Some(val("--preset")?),
            "--arch" => arch = val("--arch")?,
            _ => bail!(
                "usage: cargo xtask bench engine [--threads T] [-p N] [-n N] [-r N] [--rounds N] \
                 [--arch qwen3moe|olmoe|qwen35moe|gpt-oss] [--preset NAME]"
            ),
        }
    }
    let preset = match (preset, arch.as_str()) {
        (Some(p), _) => p,
        (None, "qwen3moe") => "small".to_owned(),
        (None, "olmoe" | "qwen35moe" | "gpt-oss") => format!("{arch}-bench"),
        (None, other) => bail!("bench engine: unknown architecture {other:?} (qwen3moe, olmoe, qwen35moe, gpt-oss)"),
    };
    let builds = llama::ensure(&[llama::Target::Llama, llama::Target::Bench])?;
    let peers = builds.all();
    let engine = llama::build_engine()?;
    let model = llama::synth_model(&engine, &format!("bench-{preset}"), &["--preset", &preset])?;
    let size = std::fs::metadata(&model).map(|m| m.len()).unwrap_or(0);
    println!(
        "model: {} ({:.0} MiB), {threads} threads, pp{n_prompt} tg{n_gen}, {reps} repetitions",
        model.display(),
        size as f64 / 1048576.0
    );
    for b in &peers {
        println!("peer: {}", b.describe());
    }
    if peers.len() == 1 {
        println!("(no AVX-512 on this CPU: the avx2 build is also the best build)");
    }

    // Per peer, then the engine: (pp, tg) tok/s of each round.
    let mut ll: Vec<Vec<(f64, f64)>> = vec![Vec::new(); peers.len()];
    let mut en: Vec<(f64, f64)> = Vec::new();
    let mut e = Value::Null;
    let sizes = ["-t", &threads.to_string(), "-p", &n_prompt.to_string(), "-n", &n_gen.to_string()].map(str::to_owned);
    let engine_run = || -> Result<Value> {
        let out =
            crate::cmd::output(Command::new(&engine).arg("bench").arg("--model").arg(&model).args(&sizes).args([
                "-r",
                &reps.to_string(),
                "--json",
            ]))?;
        serde_json::from_str(out.trim()).context("parsing engine bench --json")
    };
    let peers_run = || -> Result<Vec<(f64, f64)>> {
        peers.iter().map(|b| llama_bench(&b.program(llama::Target::Bench), &model, &sizes, reps)).collect()
    };
    for round in 0..rounds.max(1) {
        // A-B-B-A: the llama.cpp builds then the engine in even rounds, the engine first in odd ones.
        let (theirs, ours) = crate::bench_util::abba_round(round, peers_run, engine_run)?;
        for (v, t) in ll.iter_mut().zip(theirs) {
            v.push(t);
        }
        e = ours;
        en.push((engine_field(&e, "pp_tok_s")?, engine_field(&e, "tg_tok_s")?));
        let theirs: Vec<String> = peers
            .iter()
            .zip(&ll)
            .map(|(b, v)| format!("llama {} {:.1} / {:.1}", b.isa.key, v[round].0, v[round].1))
            .collect();
        println!(
            "round {round} ({}): pp / tg tok/s: engine {:.1} / {:.1}, {}",
            if round % 2 == 1 { "engine first" } else { "engine last" },
            en[round].0,
            en[round].1,
            theirs.join(", ")
        );
    }
    // One column of (pp, tg) rows: 0 pp, 1 tg.
    let column =
        |v: &[(f64, f64)], i: usize| -> Vec<f64> { v.iter().map(|r| if i == 0 { r.0 } else { r.1 }).collect() };
    let (en_pp, en_tg) = (moe_stats::median(&mut column(&en, 0)), moe_stats::median(&mut column(&en, 1)));
    println!(
        "{arch}, preset {preset}, {rounds} rounds (engine at its default ISA level): median tok/s, and the median \
         of the per-round ratios engine / build [rounds the engine was faster]:"
    );
    print!("{:<8} {:>14}", "test", "engine tok/s");
    for b in &peers {
        print!(" {:>28} {:>8} {:>7}", format!("llama {} tok/s", b.isa.key), "ratio", "faster");
    }
    println!();
    let rows = [(format!("pp{n_prompt}"), en_pp, 0), (format!("tg{n_gen}"), en_tg, 1)];
    for (name, ours, i) in &rows {
        print!("{name:<8} {ours:>14.2}");
        for v in &ll {
            let mut theirs = column(v, *i);
            let p = paired(&column(&en, *i), &theirs);
            print!(
                " {:>28.2} {:>7.2}x {:>7}",
                moe_stats::median(&mut theirs),
                p.ratio,
                format!("{}/{}", p.faster, p.rounds)
            );
        }
        println!();
    }
    println!(
        "engine tg time per token (last round): attention {:.3} ms, experts {:.3} ms, output {:.3} ms (wall {:.3} ms)",
        engine_field(&e, "tg_attention_ms_per_tok")?,
        engine_field(&e, "tg_experts_ms_per_tok")?,
        engine_field(&e, "tg_output_ms_per_tok")?,
        1e3 / en_tg
    );
    let best = builds.best();
    let p = paired(&column(&en, 1), &column(&ll[peers.len() - 1], 1));
    let goal = decode_goal(&arch);
    println!(
        "decode target: >= {goal:.2}x the best llama.cpp build ({}): {:.2}x (median of the rounds' ratios; the engine \
         faster in {} of {} rounds) -> {}",
        best.isa.key,
        p.ratio,
        p.faster,
        p.rounds,
        if p.ratio >= goal { "met" } else { "NOT met" }
    );
    Ok(())
}

/// The decode goal against the best llama.cpp build: 1.15× for `qwen3moe` (issue 15), 1.0× for
/// the architectures added after it (issue 23).
fn decode_goal(arch: &str) -> f64 {
    if arch == "qwen3moe" { 1.15 } else { 1.0 }
}

/// A number of `engine bench --json`'s output; an error naming it when it is missing (never 0).
fn engine_field(e: &Value, name: &str) -> Result<f64> {
    e[name].as_f64().with_context(|| format!("engine bench --json: no number {name:?} in {e}"))
}

/// A paired comparison over rounds: the median of `ours[r] / theirs[r]`, and in how many rounds
/// `ours` was the faster.
#[derive(Debug, PartialEq)]
struct Paired {
    ratio: f64,
    faster: usize,
    rounds: usize,
}

fn paired(ours: &[f64], theirs: &[f64]) -> Paired {
    let mut ratios: Vec<f64> = ours.iter().zip(theirs).map(|(a, b)| a / b).collect();
    let faster = ratios.iter().filter(|&&r| r > 1.0).count();
    Paired { ratio: moe_stats::median(&mut ratios), faster, rounds: ratios.len() }
}

/// One `llama-bench` run: (pp, tg) average tok/s.
fn llama_bench(bench: &Path, model: &Path, sizes: &[String], reps: usize) -> Result<(f64, f64)> {
    let out = crate::cmd::output(Command::new(bench).arg("-m").arg(model).args(sizes).args([
        "-r",
        &reps.to_string(),
        "-o",
        "json",
    ]))?;
    let rows: Vec<Value> = serde_json::from_str(&out).context("parsing llama-bench -o json")?;
    let ts = |pp: bool| {
        rows.iter()
            .find(|r| {
                let (p, g) = (r["n_prompt"].as_u64().unwrap_or(0), r["n_gen"].as_u64().unwrap_or(0));
                if pp { p > 0 && g == 0 } else { g > 0 && p == 0 }
            })
            .and_then(|r| r["avg_ts"].as_f64())
    };
    Ok((ts(true).context("llama-bench: no pp row")?, ts(false).context("llama-bench: no tg row")?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A number missing from the engine's output is an error that names it, never a 0 tok/s.
    #[test]
    fn a_missing_engine_number_is_an_error_naming_it() {
        let e = serde_json::json!({"pp_tok_s": 812.5, "tg_tok_s": null});
        assert_eq!(engine_field(&e, "pp_tok_s").unwrap(), 812.5);
        for name in ["tg_tok_s", "tg_output_ms_per_tok"] {
            let err = engine_field(&e, name).unwrap_err().to_string();
            assert!(err.contains(name), "{err}");
        }
    }

    /// A drift that slows both sides alike in later rounds moves each side's median, not the
    /// per-round ratio: the paired ratio holds the engine's 5 % lead in every round.
    #[test]
    fn the_ratio_is_paired_within_rounds() {
        let theirs = [50.0, 40.0, 60.0, 45.0, 55.0];
        let ours: Vec<f64> = theirs.iter().map(|t| t * 1.05).collect();
        let p = paired(&ours, &theirs);
        assert!((p.ratio - 1.05).abs() < 1e-12, "{p:?}");
        assert_eq!((p.faster, p.rounds), (5, 5));
        let p = paired(&[49.0, 41.0, 61.0], &[50.0, 40.0, 60.0]);
        assert_eq!((p.faster, p.rounds), (2, 3));
        // Ratios 0.98, 1.025, 1.0167: the median is the third round's.
        assert!((p.ratio - 61.0 / 60.0).abs() < 1e-12, "{p:?}");
    }
}
