//! `cargo xtask bench tui`: what the live TUI costs the engine at its default
//! refresh. The same `engine run` (small synthetic model) under `observer run`
//! and under `observer tui` (in a tmux terminal), A-B-B-A over several rounds
//! in the same run; prints every round, the medians and the ratio
//! (tui / run, target >= 0.99). Both carry the same probes, so the ratio is
//! the screen's own cost; `bench observer` measures the probes'.

use std::{path::Path, process::Command, time::Duration};

use anyhow::{Context, Result, bail};

use crate::{
    bench_util::{self, gen_tok_s, median},
    cache, cmd,
};

/// `observer tui -- engine …` in a detached tmux terminal; the engine's
/// output (printed by the TUI after it restores the terminal) goes to `out`.
fn under_tui(observer: &Path, engine_cmd: &[String], out: &Path) -> Result<f64> {
    let _ = std::fs::remove_file(out);
    let session = format!("bench-tui-{}", std::process::id());
    let mut line = format!("{} tui --", observer.display());
    for a in engine_cmd {
        line.push_str(&format!(" '{}'", a.replace('\'', "'\\''")));
    }
    line.push_str(&format!(" > {} 2>&1; tmux wait-for -S {session}-done", out.display()));
    cmd::run(Command::new("tmux").args(["new-session", "-d", "-s", &session, "-x", "160", "-y", "45", &line]))?;
    // The TUI keeps the final summary up until `q`: wait for the engine's end, then quit.
    let t0 = std::time::Instant::now();
    loop {
        std::thread::sleep(Duration::from_millis(500));
        let pane = cmd::output(Command::new("tmux").args(["capture-pane", "-p", "-t", &session]))?;
        if pane.contains("target exited") || pane.contains("target ended") {
            break;
        }
        if t0.elapsed() > Duration::from_secs(600) {
            let _ = Command::new("tmux").args(["kill-session", "-t", &session]).status();
            bail!("the TUI run did not end in 10 minutes");
        }
    }
    cmd::run(Command::new("tmux").args(["send-keys", "-t", &session, "q"]))?;
    cmd::run(Command::new("tmux").args(["wait-for", &format!("{session}-done")]))?;
    let _ = Command::new("tmux").args(["kill-session", "-t", &session]).status();
    gen_tok_s(&std::fs::read_to_string(out).with_context(|| format!("reading {}", out.display()))?)
}

pub fn main(args: &[String]) -> Result<()> {
    let (mut rounds, mut n_gen) = (4usize, 256usize);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = |name: &str| it.next().with_context(|| format!("{name} needs a value")).cloned();
        match a.as_str() {
            "--rounds" => rounds = val("--rounds")?.parse()?,
            "-n" => n_gen = val("-n")?.parse()?,
            _ => bail!("usage: cargo xtask bench tui [--rounds N] [-n TOKENS]"),
        }
    }
    let bin = bench_util::build()?;
    let (engine, observer) = (bin.join("engine"), bin.join("observer"));
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut engine_cmd = vec![engine.display().to_string()];
    engine_cmd.extend(bench_util::engine_args(&engine, "small", n_gen, threads)?);
    let model = engine_cmd[3].clone();
    let out = cache::dir()?.join("bench-tui.out");
    let under_run = || -> Result<f64> {
        gen_tok_s(&cmd::output(Command::new(&observer).args(["run", "--every", "0", "--"]).args(&engine_cmd))?)
    };
    println!("model {model} ({n_gen} tokens), {rounds} rounds in A-B-B-A order, TUI at its default refresh");
    let (mut runs, mut tuis) = (Vec::new(), Vec::new());
    for r in 0..rounds {
        let (a, b) = if r % 2 == 0 {
            let a = under_run()?;
            (a, under_tui(&observer, &engine_cmd, &out)?)
        } else {
            let b = under_tui(&observer, &engine_cmd, &out)?;
            (under_run()?, b)
        };
        println!("round {r}: observer run {a:.2} tok/s, observer tui {b:.2} tok/s, ratio {:.4}", b / a);
        runs.push(a);
        tuis.push(b);
    }
    let (mr, mt) = (median(&mut runs), median(&mut tuis));
    println!("median: under observer run {mr:.2} tok/s, under observer tui {mt:.2} tok/s");
    println!("TUI cost ratio (tui / run): {:.4} (target >= 0.99)", mt / mr);
    Ok(())
}
