//! `cargo xtask bench observer`: what the observer costs the engine. The same
//! `engine run` (small synthetic model, greedy, fixed prompt and length) with
//! and without `observer run` attached, in A-B-B-A order over several rounds
//! on the same machine in the same run; prints every round, the medians and
//! their ratio (target >= 0.98).
//!
//! Two ratios: decode tok/s (what users see; on a shared or virtualised
//! machine it swings by several % between identical runs), and CPU time for
//! the same work — the engine's user+system time alone versus the engine's
//! plus the observer's own (`wait4` rusage of the process tree), which counts
//! every cost the observer adds (eBPF programs run on the engine's threads,
//! uprobe traps, the observer's own work) and is immune to that noise. It
//! also counts the one-time cost of loading and verifying the eBPF programs
//! (about 0.4 s of CPU here, spent while the target is held before `exec`),
//! so for short runs it is well below the decode ratio.
//!
//! Then the steady-state cost within runs ([`crate::bench_within`]: the observer attached and
//! detached in alternating windows of one decode, against an A/A control; goal >= 0.995 with a
//! lower 95 % bound >= 0.99). `--only between|within` runs one of the two.

use std::process::Command;

use anyhow::{Context, Result, bail};

use moe_stats::median;

use crate::bench_util::{self, gen_tok_s};

/// Run `c`, return its stdout and the CPU time (user + system, ns) of it and
/// every descendant it waited for.
fn run_timed(c: &mut Command) -> Result<(String, u64)> {
    use std::io::Read;
    let mut child = c
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .context("spawning the benchmark command")?;
    let mut out = String::new();
    child.stdout.take().context("stdout")?.read_to_string(&mut out)?;
    let mut status = 0;
    // SAFETY: zeroed rusage is a valid out-parameter; our own child.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let r = unsafe { libc::wait4(child.id() as i32, &mut status, 0, &mut ru) };
    if r < 0 || !libc::WIFEXITED(status) || libc::WEXITSTATUS(status) != 0 {
        bail!("the benchmark command failed (status {status})");
    }
    let ns = |t: libc::timeval| t.tv_sec as u64 * 1_000_000_000 + t.tv_usec as u64 * 1000;
    Ok((out, ns(ru.ru_utime) + ns(ru.ru_stime)))
}

pub fn main(args: &[String]) -> Result<()> {
    // 256 tokens: at ~150 tok/s a 96-token decode lasts 0.6 s, and one
    // scheduler hiccup moves its rate by 10 %.
    let mut rounds = 6usize;
    let mut n_gen = 256usize;
    let mut threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut preset = "small".to_string();
    let mut only = None::<String>;
    // 12 within-run rounds (72 windows, about 25 minutes): on the 2-core VM 36 windows gave a
    // 95 % interval of ±0.7 %, 72 windows ±0.5 %, which the goal's lower bound (0.99) needs.
    let (mut w_rounds, mut cycles, mut window, mut w_tokens) =
        (12usize, 6usize, std::time::Duration::from_secs(3), 12000usize);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = |name: &str| it.next().with_context(|| format!("{name} needs a value")).cloned();
        match a.as_str() {
            "--rounds" => rounds = val("--rounds")?.parse()?,
            "-n" => n_gen = val("-n")?.parse()?,
            "--threads" => threads = val("--threads")?.parse()?,
            "--preset" => preset = val("--preset")?,
            "--only" => only = Some(val("--only")?),
            "--within-rounds" => w_rounds = val("--within-rounds")?.parse()?,
            "--cycles" => cycles = val("--cycles")?.parse()?,
            "--window" => window = std::time::Duration::from_secs_f64(val("--window")?.parse()?),
            "--within-tokens" => w_tokens = val("--within-tokens")?.parse()?,
            _ => bail!(
                "usage: cargo xtask bench observer [--rounds N] [-n TOKENS] [--threads T] [--preset small] \
                 [--only between|within] [--within-rounds R] [--cycles C] [--window SECONDS] [--within-tokens N]"
            ),
        }
    }
    let within = crate::bench_within::Options {
        rounds: w_rounds,
        cycles,
        window,
        threads,
        preset: preset.clone(),
        tokens: w_tokens,
    };
    match only.as_deref() {
        None => {
            between(rounds, n_gen, threads, &preset)?;
            crate::bench_within::main(&within)
        }
        Some("between") => between(rounds, n_gen, threads, &preset),
        Some("within") => crate::bench_within::main(&within),
        Some(o) => bail!("--only {o:?}: between or within"),
    }
}

/// The between-run comparison (module doc).
fn between(rounds: usize, n_gen: usize, threads: usize, preset: &str) -> Result<()> {
    let bin = bench_util::build()?;
    let engine = bin.join("engine");
    let observer = bin.join("observer");
    let engine_args = bench_util::engine_args(&engine, preset, n_gen, threads)?;
    let model = &engine_args[2];
    println!("model {model} ({threads} threads, {n_gen} tokens), {rounds} rounds in A-B-B-A order");
    let run_plain = || -> Result<(f64, u64)> {
        let (out, cpu) = run_timed(Command::new(&engine).args(&engine_args))?;
        Ok((gen_tok_s(&out)?, cpu))
    };
    let run_observed = || -> Result<(f64, u64)> {
        let (out, cpu) =
            run_timed(Command::new(&observer).args(["run", "--every", "0", "--"]).arg(&engine).args(&engine_args))?;
        Ok((gen_tok_s(&out)?, cpu))
    };
    let (mut plain, mut observed, mut cpu_ratio) = (Vec::new(), Vec::new(), Vec::new());
    for r in 0..rounds {
        let (a, b) = bench_util::abba_round(r, run_plain, run_observed)?;
        let cr = a.1 as f64 / b.1 as f64;
        println!(
            "round {r}: engine alone {:.2} tok/s ({:.0} ms CPU), with observer {:.2} tok/s ({:.0} ms CPU, engine + observer), tok/s ratio {:.4}, CPU ratio {cr:.4}",
            a.0,
            a.1 as f64 / 1e6,
            b.0,
            b.1 as f64 / 1e6,
            b.0 / a.0
        );
        plain.push(a.0);
        observed.push(b.0);
        cpu_ratio.push(cr);
    }
    let (mp, mo) = (median(&mut plain), median(&mut observed));
    println!("median: engine alone {mp:.2} tok/s, with observer {mo:.2} tok/s");
    println!("observer cost ratio, decode tok/s (with / without): {:.4} (target >= 0.98)", mo / mp);
    println!(
        "observer cost ratio, CPU time for the same tokens (alone / with, observer included): {:.4} (target >= 0.98)",
        median(&mut cpu_ratio)
    );
    Ok(())
}
