//! `cargo xtask bench storm`: what the observer costs a target in a minor-fault storm.
//!
//! The target is the workload's `anon` phase (fresh anonymous memory, one write per page, so
//! one minor fault per page: about a million faults per second here), run alone (A) and under
//! `observer run` (B) in A-B-B-A order over several rounds, on the same machine in the same run.
//! The time compared is the workload's own clock around its phase (the observer's start-up,
//! program loading included, is outside it). Printed: every round, the medians, and the
//! slowdown `B / A` (goal: at most 1.1).
//!
//! The kernel-side cost per event: with `kernel.bpf_stats_enabled` on for the bench (restored
//! after, under the machine lock), `bpftool prog show` is sampled while each observed run goes
//! on, for the programs the observer's process holds; their last sample gives each program's
//! run count and run time, printed as ns per run and as ns per fault of the workload.

use std::{
    collections::BTreeMap,
    process::{Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use anyhow::{Context, Result, bail};
use moe_stats::median;
use serde_json::Value;

use crate::{bench_util, cache, cmd};

const BPF_STATS: &str = "/proc/sys/kernel/bpf_stats_enabled";

/// `kernel.bpf_stats_enabled` on while this lives, then as it was.
struct BpfStats(String);

impl BpfStats {
    fn enable() -> Result<BpfStats> {
        let was = std::fs::read_to_string(BPF_STATS).with_context(|| format!("reading {BPF_STATS}"))?;
        std::fs::write(BPF_STATS, "1").with_context(|| format!("writing {BPF_STATS} (run as root)"))?;
        Ok(BpfStats(was.trim().to_string()))
    }
}

impl Drop for BpfStats {
    fn drop(&mut self) {
        let _ = std::fs::write(BPF_STATS, &self.0);
    }
}

/// The workload's phase: wall time (ns) and minor faults, by its own account.
fn phase(stdout: &str) -> Result<(u64, u64)> {
    stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v["kind"] == "anon")
        .and_then(|v| Some((v["wall_ns"].as_u64()?, v["minflt"].as_u64()?)))
        .context("the workload printed no `anon` phase")
}

/// Programs by id: (name, run count, run time ns).
type Programs = BTreeMap<u64, (String, u64, u64)>;

/// The programs process `pid` holds, from `bpftool prog show`.
fn programs_of(pid: u32) -> Programs {
    let Ok(out) = Command::new("bpftool").args(["-j", "prog", "show"]).output() else { return BTreeMap::new() };
    let Ok(Value::Array(progs)) = serde_json::from_slice::<Value>(&out.stdout) else { return BTreeMap::new() };
    progs
        .iter()
        .filter(|p| p["pids"].as_array().is_some_and(|a| a.iter().any(|x| x["pid"].as_u64() == Some(pid as u64))))
        .filter_map(|p| {
            let name = p["name"].as_str()?.to_string();
            Some((
                p["id"].as_u64()?,
                (name, p["run_cnt"].as_u64().unwrap_or(0), p["run_time_ns"].as_u64().unwrap_or(0)),
            ))
        })
        .collect()
}

/// Runs `c` to its end; returns stdout and, when `sample`, the last `bpftool` sample of the
/// programs its process holds.
fn run(c: &mut Command, sample: bool) -> Result<(String, Programs)> {
    let child = c.stdout(Stdio::piped()).stderr(Stdio::null()).spawn().context("spawning the bench command")?;
    let pid = child.id();
    let done = Arc::new(AtomicBool::new(false));
    let sampler = sample.then(|| {
        let done = Arc::clone(&done);
        std::thread::spawn(move || {
            let mut last = BTreeMap::new();
            while !done.load(Ordering::Relaxed) {
                let now = programs_of(pid);
                if !now.is_empty() {
                    last = now;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            last
        })
    });
    let out = child.wait_with_output().context("waiting for the bench command")?;
    done.store(true, Ordering::Relaxed);
    let progs = sampler.map(|s| s.join().unwrap_or_default()).unwrap_or_default();
    if !out.status.success() {
        bail!("the bench command failed ({})", out.status);
    }
    Ok((String::from_utf8_lossy(&out.stdout).into_owned(), progs))
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
    let _lock = testkit::machine_lock();
    let _stats = BpfStats::enable()?;
    let wl = |c: &mut Command| {
        c.arg(&workload).args(["anon", "--size", &size, "--repeat", &repeat.to_string()]);
    };
    let plain = || -> Result<(u64, u64)> {
        let mut c = Command::new(&workload);
        c.args(["anon", "--size", &size, "--repeat", &repeat.to_string()]);
        phase(&run(&mut c, false)?.0)
    };
    let mut progs_total: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    let mut observed_faults = 0u64;
    let mut observed = || -> Result<(u64, u64)> {
        let mut c = Command::new(&observer);
        c.args(["run", "--every", "0", "--"]);
        wl(&mut c);
        let (out, progs) = run(&mut c, true)?;
        let p = phase(&out)?;
        observed_faults += p.1;
        for (name, n, ns) in progs.into_values() {
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
    }
    let (ma, mb) = (median(&mut a_ns), median(&mut b_ns));
    println!("median: alone {:.3} s, observed {:.3} s", ma / 1e9, mb / 1e9);
    println!(
        "slowdown under the observer (observed / alone): {:.3} (goal <= 1.1); median of rounds {:.3}",
        mb / ma,
        median(&mut ratios)
    );
    if progs_total.is_empty() {
        println!("kernel-side cost: no program of the observer seen by `bpftool -j prog show` (no `pids`?)");
    } else {
        println!("kernel-side cost per program (kernel.bpf_stats_enabled, last sample of each observed run):");
        for (name, (n, ns)) in &progs_total {
            if *n > 0 {
                println!(
                    "  {name:<28} {n:>10} runs  {:>8.1} ns/run  {:>8.1} ns per workload fault",
                    *ns as f64 / *n as f64,
                    *ns as f64 / observed_faults.max(1) as f64
                );
            }
        }
        let total: u64 = progs_total.values().map(|v| v.1).sum();
        println!("  all programs: {:.1} ns per workload fault", total as f64 / observed_faults.max(1) as f64);
    }
    Ok(())
}
