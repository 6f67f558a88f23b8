//! `cargo xtask bench tui`: what the live TUI costs the engine at its default
//! refresh. The same `engine run` (small synthetic model) under `observer run`
//! and under `observer tui`, each in a tmux terminal, A-B-B-A over several rounds
//! in the same run; prints every round, the medians and the ratio
//! (tui / run, target >= 0.99). Both carry the same probes, so the ratio is
//! the screen's own cost; `bench observer` measures the probes'.

use std::{path::Path, process::Command, time::Duration};

use anyhow::{Context, Result, bail};

use crate::{
    bench_util::{self, gen_tok_s, median},
    cache, cmd,
};

/// `observer tui -- engine …` (or `observer run --every 0 -- engine …` when
/// `!tui`) in a detached tmux terminal of the same size, so that both sides
/// run in the same kind of terminal session; the engine's output (printed by
/// the TUI after it restores the terminal) goes to `out`.
fn in_tmux(tui: bool, observer: &Path, engine_cmd: &[String], out: &Path) -> Result<f64> {
    let _ = std::fs::remove_file(out);
    let session = format!("bench-tui-{}", std::process::id());
    let mut line = format!("{} {} --", observer.display(), if tui { "tui" } else { "run --every 0" });
    for a in engine_cmd {
        line.push_str(&format!(" '{}'", a.replace('\'', "'\\''")));
    }
    line.push_str(&format!(" > {} 2>&1; tmux wait-for -S {session}-done", out.display()));
    cmd::run(Command::new("tmux").args(["new-session", "-d", "-s", &session, "-x", "160", "-y", "45", &line]))?;
    if !tui {
        cmd::run(Command::new("tmux").args(["wait-for", &format!("{session}-done")]))?;
        let _ = Command::new("tmux").args(["kill-session", "-t", &session]).status();
        return gen_tok_s(&std::fs::read_to_string(out).with_context(|| format!("reading {}", out.display()))?);
    }
    // The TUI keeps the final summary up until `q`: wait for the engine's end, then quit.
    // Watched through /proc, not `tmux capture-pane`: a tmux client every half second
    // would load the TUI side only, and be counted as the screen's cost.
    let t0 = std::time::Instant::now();
    let timeout = |what: &str| -> Result<()> {
        if t0.elapsed() > Duration::from_secs(600) {
            let _ = Command::new("tmux").args(["kill-session", "-t", &session]).status();
            bail!("the TUI run: {what} within 10 minutes");
        }
        Ok(())
    };
    let pid = loop {
        if let Some(pid) = find_process(engine_cmd) {
            break pid;
        }
        timeout("the engine did not start")?;
        std::thread::sleep(Duration::from_millis(50));
    };
    // The observer reaps its child: /proc/PID goes away (or turns zombie) at the engine's exit.
    while std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|st| st.rsplit_once(')').is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z')))
    {
        timeout("the engine did not end")?;
        std::thread::sleep(Duration::from_millis(500));
    }
    // Let the TUI take in the end before quitting.
    std::thread::sleep(Duration::from_millis(500));
    cmd::run(Command::new("tmux").args(["send-keys", "-t", &session, "q"]))?;
    cmd::run(Command::new("tmux").args(["wait-for", &format!("{session}-done")]))?;
    let _ = Command::new("tmux").args(["kill-session", "-t", &session]).status();
    gen_tok_s(&std::fs::read_to_string(out).with_context(|| format!("reading {}", out.display()))?)
}

/// The PID of a process whose command line is exactly `cmd`.
fn find_process(cmd: &[String]) -> Option<u32> {
    let want: Vec<u8> = cmd.iter().flat_map(|a| a.bytes().chain([0])).collect();
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        (std::fs::read(format!("/proc/{pid}/cmdline")).ok()? == want).then_some(pid)
    })
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
    let under_run = || in_tmux(false, &observer, &engine_cmd, &out);
    let under_tui = || in_tmux(true, &observer, &engine_cmd, &out);
    println!("model {model} ({n_gen} tokens), {rounds} rounds in A-B-B-A order, TUI at its default refresh");
    let (mut runs, mut tuis) = (Vec::new(), Vec::new());
    for r in 0..rounds {
        let (a, b) = bench_util::abba_round(r, under_run, under_tui)?;
        println!("round {r}: observer run {a:.2} tok/s, observer tui {b:.2} tok/s, ratio {:.4}", b / a);
        runs.push(a);
        tuis.push(b);
    }
    let (mr, mt) = (median(&mut runs), median(&mut tuis));
    println!("median: under observer run {mr:.2} tok/s, under observer tui {mt:.2} tok/s");
    println!("TUI cost ratio (tui / run): {:.4} (target >= 0.99)", mt / mr);
    Ok(())
}
