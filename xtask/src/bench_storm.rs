//! `cargo xtask bench storm`: what the observer costs a target in a minor-fault storm.
//!
//! The target is the workload's `anon` phase (fresh anonymous memory, one write per page, so
//! one minor fault per page: about a million faults per second here), run alone (A) and under
//! `observer run` (B) in A-B-B-A order over several rounds, on the same machine in the same run.
//! The time compared is the workload's own clock around its phase (the observer's start-up,
//! program loading included, is outside it). Printed: every round, the medians, and the
//! slowdown `B / A` (goal: at most 1.1).
//!
//! The kernel-side cost per event, from the kernel's BPF run-time statistics: `observer run`
//! turns them on while its programs are loaded (`BPF_ENABLE_STATS`, whose descriptor keeps them
//! on while held and restores the host's setting when closed) and writes each program's
//! cumulative `run_time_ns` and `run_cnt` at the end of the run into its `--json` summary
//! (`bpf_programs`). Summed over the observed runs, printed per program: runs, ns per run, runs
//! per workload fault and ns per workload fault (the programs run for every process's events,
//! so the other processes' faults are in the counts too). Beside them, the budget the slowdown
//! goal leaves: `0.1 ×` the alone run's time per fault, measured in the same run.

use std::{
    collections::BTreeMap,
    path::Path,
    process::{Command, Stdio},
};

use anyhow::{Context, Result, bail};
use moe_stats::median;
use serde_json::Value;

use crate::{bench_util, cache, cmd};

/// The slowdown goal; what is above 1 of it is the budget for the observer's work per fault.
const GOAL: f64 = 1.1;

/// The workload's phase: wall time (ns) and minor faults, by its own account.
fn phase(stdout: &str) -> Result<(u64, u64)> {
    stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v["kind"] == "anon")
        .and_then(|v| Some((v["wall_ns"].as_u64()?, v["minflt"].as_u64()?)))
        .context("the workload printed no `anon` phase")
}

/// Per program: (runs, run time ns).
type Programs = BTreeMap<String, (u64, u64)>;

/// The observer's programs' cost at the end of a run, from its `--json` summary.
fn programs(summary: &Path) -> Result<Programs> {
    let text = std::fs::read_to_string(summary).with_context(|| format!("reading {}", summary.display()))?;
    let v: Value = serde_json::from_str(&text).with_context(|| format!("parsing {}", summary.display()))?;
    let list = v["bpf_programs"].as_array().context(
        "the observer's summary has no bpf_programs: the kernel refused BPF_ENABLE_STATS (Linux >= 5.8, run as root)",
    )?;
    list.iter()
        .map(|p| {
            let name = p["name"].as_str().context("bpf_programs: a program without a name")?;
            Ok((name.to_string(), (p["runs"].as_u64().unwrap_or(0), p["run_ns"].as_u64().unwrap_or(0))))
        })
        .collect()
}

/// Runs `c` to its end; returns its stdout.
fn run(c: &mut Command) -> Result<String> {
    let out = c.stdout(Stdio::piped()).stderr(Stdio::null()).output().context("spawning the bench command")?;
    if !out.status.success() {
        bail!("the bench command failed ({})", out.status);
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

pub fn main(args: &[String]) -> Result<()> {
    let (mut rounds, mut size) = (4usize, "512M".to_string());
    let mut repeat = 8u32;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = |name: &str| it.next().with_context(|| format!("{name} needs a value")).cloned();
        match a.as_str() {
            "--rounds" => rounds = val("--rounds")?.parse()?,
            "--size" => size = val("--size")?,
            "--repeat" => repeat = val("--repeat")?.parse()?,
            _ => bail!("usage: cargo xtask bench storm [--rounds N] [--size 512M] [--repeat R]"),
        }
    }
    let bin = bench_util::build()?;
    cmd::run(Command::new("cargo").current_dir(cache::workspace_root()).args([
        "build",
        "--release",
        "-p",
        "fixtures",
        "--bin",
        "workload",
    ]))?;
    let (observer, workload) = (bin.join("observer"), bin.join("workload"));
    let scratch = cache::target_dir().join("bench-storm");
    std::fs::create_dir_all(&scratch).with_context(|| format!("creating {}", scratch.display()))?;
    let _lock = testkit::machine_lock();
    let wl_args = ["anon".to_string(), "--size".into(), size.clone(), "--repeat".into(), repeat.to_string()];
    let plain = || -> Result<(u64, u64)> { phase(&run(Command::new(&workload).args(&wl_args))?) };
    let mut progs_total = Programs::new();
    let mut observed_faults = 0u64;
    let mut n_observed = 0usize;
    let mut observed = || -> Result<(u64, u64)> {
        n_observed += 1;
        let summary = scratch.join(format!("run-{n_observed}.json"));
        let _ = std::fs::remove_file(&summary);
        let out = run(Command::new(&observer)
            .args(["run", "--every", "0", "--json"])
            .arg(&summary)
            .arg("--")
            .arg(&workload)
            .args(&wl_args))?;
        let p = phase(&out)?;
        observed_faults += p.1;
        for (name, (n, ns)) in programs(&summary)? {
            let e = progs_total.entry(name).or_default();
            e.0 += n;
            e.1 += ns;
        }
        Ok(p)
    };
    println!(
        "workload anon --size {size} --repeat {repeat} alone (A) and under `observer run` (B), {rounds} rounds A-B-B-A"
    );
    let (mut a_ns, mut b_ns, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    let (mut alone_ns, mut alone_faults) = (0u64, 0u64);
    for r in 0..rounds {
        let (a, b) = bench_util::abba_round(r, plain, &mut observed)?;
        let ratio = b.0 as f64 / a.0 as f64;
        println!(
            "round {r}: alone {:.3} s ({:.2} M faults/s), observed {:.3} s ({:.2} M faults/s), slowdown {ratio:.3}",
            a.0 as f64 / 1e9,
            a.1 as f64 / a.0 as f64 * 1e3,
            b.0 as f64 / 1e9,
            b.1 as f64 / b.0 as f64 * 1e3
        );
        a_ns.push(a.0 as f64);
        b_ns.push(b.0 as f64);
        ratios.push(ratio);
        alone_ns += a.0;
        alone_faults += a.1;
    }
    let (ma, mb) = (median(&mut a_ns), median(&mut b_ns));
    println!("median: alone {:.3} s, observed {:.3} s", ma / 1e9, mb / 1e9);
    println!(
        "slowdown under the observer (observed / alone): {:.3} (goal <= {GOAL}); median of rounds {:.3}",
        mb / ma,
        median(&mut ratios)
    );
    let per_fault = |x: u64| x as f64 / observed_faults.max(1) as f64;
    let budget = (GOAL - 1.0) * alone_ns as f64 / alone_faults.max(1) as f64;
    println!(
        "kernel-side cost per program (kernel BPF statistics over the {n_observed} observed runs, {observed_faults} \
         workload faults; every process's events run the programs):"
    );
    println!("  {:<20} {:>12} {:>10} {:>12} {:>14}", "program", "runs", "ns/run", "runs/fault", "ns per fault");
    let mut ran: Vec<_> = progs_total.iter().filter(|(_, (n, _))| *n > 0).collect();
    ran.sort_by_key(|(_, (_, ns))| std::cmp::Reverse(*ns));
    for (name, (n, ns)) in &ran {
        println!(
            "  {name:<20} {n:>12} {:>10.1} {:>12.3} {:>14.1}",
            *ns as f64 / *n as f64,
            per_fault(*n),
            per_fault(*ns)
        );
    }
    let total: u64 = progs_total.values().map(|v| v.1).sum();
    println!(
        "  all programs: {:.1} ns per workload fault; budget at the {GOAL}x goal: {budget:.1} ns per fault ({:.1} % of \
         the alone run's {:.1} ns per fault){}",
        per_fault(total),
        (GOAL - 1.0) * 100.0,
        alone_ns as f64 / alone_faults.max(1) as f64,
        if per_fault(total) <= budget { "" } else { " — over budget" }
    );
    Ok(())
}
