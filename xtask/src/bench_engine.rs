//! `cargo xtask bench engine [--arch A]`: engine vs llama.cpp's `llama-bench` on the same
//! synthetic file of the architecture (`qwen3moe`: the `small` preset; `olmoe`, `qwen35moe`,
//! `gpt-oss`: `{arch}-bench`, the released model's per-layer shapes with fewer layers and
//! experts, ~0.5 GB), same thread count, same run. Both measure pp (a batch of random prompt
//! tokens from an empty context) and tg (tokens generated one at a time from an empty
//! context), averaged over repetitions; the result is printed as engine / llama.cpp ratios.
//! llama-bench runs with its defaults (flash attention `auto`, f16 KV cache).
//!
//! The machine is shared, so the two are measured in alternating rounds (`--rounds`, each
//! with `-r` repetitions) and the medians are compared; every round's numbers are printed, and
//! the spread of the per-round ratios (min..max) with the medians.

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
    let ll = llama::ensure()?;
    let engine = llama::build_engine()?;
    let model = llama::synth_model(&engine, &format!("bench-{preset}"), &["--preset", &preset])?;
    let size = std::fs::metadata(&model).map(|m| m.len()).unwrap_or(0);
    println!(
        "model: {} ({:.0} MiB), {threads} threads, pp{n_prompt} tg{n_gen}, {reps} repetitions",
        model.display(),
        size as f64 / 1048576.0
    );

    let mut ll_pp_v = Vec::new();
    let mut ll_tg_v = Vec::new();
    let mut en_pp_v = Vec::new();
    let mut en_tg_v = Vec::new();
    let mut e = Value::Null;
    for round in 0..rounds.max(1) {
        let out = crate::cmd::output(
            Command::new(&ll.bench)
                .arg("-m")
                .arg(&model)
                .args(["-t", &threads.to_string(), "-p", &n_prompt.to_string(), "-n", &n_gen.to_string()])
                .args(["-r", &reps.to_string(), "-o", "json"]),
        )?;
        let rows: Vec<Value> = serde_json::from_str(&out).context("parsing llama-bench -o json")?;
        let ts = |pp: bool| {
            rows.iter()
                .find(|r| {
                    let (p, g) = (r["n_prompt"].as_u64().unwrap_or(0), r["n_gen"].as_u64().unwrap_or(0));
                    if pp { p > 0 && g == 0 } else { g > 0 && p == 0 }
                })
                .and_then(|r| r["avg_ts"].as_f64())
        };
        ll_pp_v.push(ts(true).context("llama-bench: no pp row")?);
        ll_tg_v.push(ts(false).context("llama-bench: no tg row")?);

        let out = crate::cmd::output(
            Command::new(&engine)
                .arg("bench")
                .arg("--model")
                .arg(&model)
                .args(["-t", &threads.to_string(), "-p", &n_prompt.to_string(), "-n", &n_gen.to_string()])
                .args(["-r", &reps.to_string(), "--json"]),
        )?;
        e = serde_json::from_str(out.trim()).context("parsing engine bench --json")?;
        en_pp_v.push(e["pp_tok_s"].as_f64().unwrap_or(0.0));
        en_tg_v.push(e["tg_tok_s"].as_f64().unwrap_or(0.0));
        println!(
            "round {round}: pp engine {:.1} / llama {:.1} tok/s, tg engine {:.1} / llama {:.1} tok/s",
            en_pp_v[round], ll_pp_v[round], en_tg_v[round], ll_tg_v[round]
        );
    }
    let spread = |en: &[f64], ll: &[f64]| {
        let r: Vec<f64> = en.iter().zip(ll).map(|(e, l)| e / l).collect();
        (r.iter().copied().fold(f64::INFINITY, f64::min), r.iter().copied().fold(0.0, f64::max))
    };
    let (pp_lo, pp_hi) = spread(&en_pp_v, &ll_pp_v);
    let (tg_lo, tg_hi) = spread(&en_tg_v, &ll_tg_v);
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (ll_pp, ll_tg) = (median(&mut ll_pp_v), median(&mut ll_tg_v));
    let (en_pp, en_tg) = (median(&mut en_pp_v), median(&mut en_tg_v));

    println!("{arch}, preset {preset}: medians over {rounds} rounds (per-round ratio min..max):");
    println!("{:<8} {:>14} {:>14} {:>8} {:>14}", "test", "engine tok/s", "llama tok/s", "ratio", "round ratios");
    println!(
        "{:<8} {:>14.2} {:>14.2} {:>7.2}x {:>6.2}..{:.2}x",
        format!("pp{n_prompt}"),
        en_pp,
        ll_pp,
        en_pp / ll_pp,
        pp_lo,
        pp_hi
    );
    println!(
        "{:<8} {:>14.2} {:>14.2} {:>7.2}x {:>6.2}..{:.2}x",
        format!("tg{n_gen}"),
        en_tg,
        ll_tg,
        en_tg / ll_tg,
        tg_lo,
        tg_hi
    );
    println!(
        "engine tg time per token (last round): attention {:.3} ms, experts {:.3} ms, output {:.3} ms (wall {:.3} ms)",
        e["tg_attention_ms_per_tok"].as_f64().unwrap_or(0.0),
        e["tg_experts_ms_per_tok"].as_f64().unwrap_or(0.0),
        e["tg_output_ms_per_tok"].as_f64().unwrap_or(0.0),
        1e3 / en_tg
    );
    println!(
        "decode target: >= 1.00x llama.cpp -> {}",
        if tg_lo >= 1.0 {
            "met in every round"
        } else if en_tg / ll_tg >= 1.0 {
            "met by the medians, not in every round (noisy machine?)"
        } else {
            "NOT met"
        }
    );
    Ok(())
}
