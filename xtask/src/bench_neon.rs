//! `cargo xtask bench neon [--rounds N] [-p N] [-n N] [--threads T] [--cpu CPU]`: the engine's
//! aarch64 `neon` level against its `scalar` level, both cross-built (the same binary,
//! `ENGINE_ISA`) and both under `qemu-aarch64` on the same qemu CPU model (default `max`: `dotprod`
//! and `i8mm`, the repacked orders; `cortex-a72` has neither), on the tiny qwen3moe model in
//! `Q8_0` and `Q4_K_M` (the aarch64 parity models).
//!
//! This is not a speed measurement of the NEON kernels: qemu translates each aarch64 instruction
//! into host code, a NEON instruction into several, so emulated time says nothing of an ARM CPU's.
//! The ratio is a sanity check that the SIMD path is taken: `engine bench`'s decode (tg) and
//! prompt (pp) tok/s of the two levels, in A-B-B-A rounds (`bench_util::abba_round`), each
//! round's numbers printed, then the medians and the geometric mean of the paired ratios
//! neon / scalar with its 95 % bootstrap interval.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::{bench_util, cross, llama};

const QUANTS: [&str; 2] = ["q8_0", "q4_k_m"];

/// `engine bench` at `isa` under qemu's `cpu`: (pp, tg) tok/s.
fn bench(engine: &Path, cpu: &str, isa: &str, model: &Path, sizes: &[String]) -> Result<(f64, f64)> {
    let mut c = Command::new(cross::QEMU);
    c.env("QEMU_CPU", cpu).env("ENGINE_ISA", isa).arg(engine).arg("bench").arg("--model").arg(model);
    c.args(sizes).args(["-r", "1", "--json"]);
    let out = crate::cmd::output(&mut c)?;
    let v: Value = serde_json::from_str(out.trim()).with_context(|| format!("parsing engine bench --json: {out}"))?;
    let get = |k: &str| v[k].as_f64().with_context(|| format!("no {k} in engine bench --json"));
    Ok((get("pp_tok_s")?, get("tg_tok_s")?))
}

pub fn main(args: &[String]) -> Result<()> {
    let usage =
        "usage: cargo xtask bench neon [--rounds N] [-p N] [-n N] [--threads T] [--cpu max|cortex-a76|cortex-a72]";
    let (mut rounds, mut n_prompt, mut n_gen, mut threads) = (4usize, 16usize, 32usize, 1usize);
    let mut cpu = "max".to_owned();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || it.next().context(usage).cloned();
        match a.as_str() {
            "--rounds" => rounds = val()?.parse().context("--rounds N")?,
            "-p" => n_prompt = val()?.parse().context("-p N")?,
            "-n" => n_gen = val()?.parse().context("-n N")?,
            "--threads" => threads = val()?.parse().context("--threads T")?,
            "--cpu" => cpu = val()?,
            _ => bail!("{usage}"),
        }
    }
    if rounds < 2 || n_gen == 0 || n_prompt == 0 {
        bail!("bench neon needs at least 2 rounds and -p, -n above 0\n{usage}");
    }
    cross::packages()?;
    let engine = cross::build_engine()?;
    let sizes = ["-t", &threads.to_string(), "-p", &n_prompt.to_string(), "-n", &n_gen.to_string()].map(str::to_owned);
    println!(
        "bench neon: the engine's neon vs scalar level, both under qemu-aarch64 (QEMU_CPU={cpu}), {threads} thread(s), \
         pp{n_prompt} tg{n_gen}, {rounds} A-B-B-A rounds; emulated time, not ARM speed"
    );
    for quant in QUANTS {
        // Written by the aarch64 engine under qemu (the file is the same whoever writes it).
        let synth = || {
            let mut c = Command::new(cross::QEMU);
            c.arg(&engine);
            c
        };
        let model = llama::synth_model_by(synth, &format!("parity-{quant}"), &["--preset", "tiny", "--quant", quant])?;
        println!("== tiny qwen3moe {quant}: {}", model.display());
        let mut pairs: Vec<((f64, f64), (f64, f64))> = Vec::new();
        for r in 0..rounds {
            let (scalar, neon) = bench_util::abba_round(
                r,
                || bench(&engine, &cpu, "scalar", &model, &sizes),
                || bench(&engine, &cpu, "neon", &model, &sizes),
            )?;
            println!(
                "  round {r}: pp / tg tok/s: scalar {:.1} / {:.1}, neon {:.1} / {:.1}",
                scalar.0, scalar.1, neon.0, neon.1
            );
            pairs.push((scalar, neon));
        }
        for (name, pick) in [("pp", 0usize), ("tg", 1)] {
            let at = |x: (f64, f64)| if pick == 0 { x.0 } else { x.1 };
            let mut s: Vec<f64> = pairs.iter().map(|p| at(p.0)).collect();
            let mut n: Vec<f64> = pairs.iter().map(|p| at(p.1)).collect();
            let paired: Vec<(f64, f64)> = pairs.iter().map(|p| (at(p.0), at(p.1))).collect();
            let ci = bench_util::paired_ratio_ci(&paired)
                .map_or("no interval".to_owned(), |(g, lo, hi)| format!("{g:.2}x [{lo:.2}, {hi:.2}]"));
            println!(
                "  {name}{}: median scalar {:.1} tok/s, neon {:.1} tok/s; neon / scalar {ci} (geometric mean of paired ratios, 95 % bootstrap)",
                if pick == 0 { n_prompt } else { n_gen },
                moe_stats::median(&mut s),
                moe_stats::median(&mut n),
            );
        }
    }
    Ok(())
}
