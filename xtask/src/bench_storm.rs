//! `cargo xtask bench storm`: what the observer costs a target in a minor-fault storm.
//!
//! The target is the workload's `anon` phase (fresh anonymous memory, one write per page, so
//! one minor fault per page; by default 64 MiB mapped, touched and unmapped 64 times, a million
//! faults in memory the guest reuses, so that the host's own faults on fresh guest memory do
//! not swamp the comparison), run
//! - alone (A),
//! - under `observer run` (B: storms sampled, the default),
//! - under `observer run --time-every-fault` (E: every fault timed),
//! - under `observer run --fault-close perf` (P: faults closed by the perf events, for
//!   comparison with the memcg close B uses where the kernel has it),
//! - under `observer run --bpf-stats` (S: the kernel's statistics, below),
//! - under `observer run --fault-dispatch-only` (D, the floor: the same fault hooks run a
//!   program that returns at once, so `D / A` is what the kernel's dispatch of those hooks costs
//!   a fault, and `B / D` what the observer's programs add to it),
//! - and D under the statistics (F, not timed: `fault_floor`'s ns per run there is what the
//!   statistics themselves add to any program run, their two clock reads),
//!
//! in A-B-E-P-S-D-F / F-D-S-P-E-B-A order over several rounds, on the same machine in the same
//! run. The time compared is the workload's own clock around its phase (the observer's start-up,
//! program loading included, is outside it).
//!
//! Printed first: the host's mitigations of indirect calls and returns
//! (`/sys/devices/system/cpu/vulnerabilities`), which set what a dispatch costs. Then every
//! round, the medians, the slowdown `B / A` (goal: at most 1.1) with `E / A`, `P / A`, `S / A`
//! and `D / A` beside it, which close B used, and how many of B's faults were untimed
//! (`minflt_untimed`: storm sampling, `observer_common::faults`). The slowdown is the ratio of the
//! medians; beside it, the rounds' own ratios paired (`B / A`, `E / A`, `B / E`, `B / P`, `D / A`
//! and `B / D` of each round, whose runs are adjacent, so that the host's drift over the run
//! cancels): their geometric mean with a 95 % bootstrap interval over the rounds
//! (`bench_util::paired_ratio_ci`), and `D / A` and `B / D` also as ns per fault (the dispatch's
//! and the programs' share of the budget).
//!
//! The kernel-side cost per event, from the kernel's BPF run-time statistics of the S runs:
//! `observer run --bpf-stats` turns them on while its programs are loaded (`BPF_ENABLE_STATS`,
//! whose descriptor keeps them on while held) and writes each program's cumulative
//! `run_time_ns` and `run_cnt` at the end of the run into its `--json` summary
//! (`bpf_programs`). They are not on in B: they cost every program run two clock reads. Summed
//! over the observed runs, printed per program: runs, ns per run, runs per workload fault and ns
//! per workload fault, each also net of the statistics' own cost (F) (the programs run for every
//! process's events, so the other processes' faults are in the counts too), and each program's
//! kernel-side budget (`observer_common::budget`, ns per run net of the statistics) with whether
//! it is within it: judged for a program that runs at least once per 100 events of the storm
//! (rarer ones run cold, "rare"). Beside them, the budget the slowdown goal leaves: `0.1 ×` the
//! alone run's time per fault, measured in the same run.
//!
//! `--kind pread`: a storm of explicit reads instead (issue 17: the per-syscall cost of charging
//! reads of the model to its regions). The target is the workload's `pread-storm` (`--calls`
//! `pread64`s of 4 KiB, page-cache hits, striding through the file) on the cached 3-layer
//! `cliff-small` model, run alone (A), under `observer run` without a model (C: the syscall
//! programs run, the explicit-read work does not) and under `observer run --model` on that file
//! (B), in A-C-B / B-C-A order over the rounds. The model is passed through a link without the
//! `.gguf` suffix, so that C finds no model on the command line. Printed: every round, the
//! slowdowns B / A and C / A of the median times, each program's ns per run (gross and net of
//! the statistics, their cost measured as for `--kind switch`, F) and runs per read for B and C,
//! with its budget judged net, and the reads B charged to the model's regions against the
//! workload's calls. The explicit-read work is in `sys_enter` and `sys_exit`, so B − C per read is
//! its cost; it is judged on its own (`observer_common::budget`, module spec: B's table says
//! "apart" for the two programs, C's judges their work on any syscall) against a share of the read
//! of the model it stands for: `--calls / 100` (at least 200) `pread64`s of the model's smallest
//! routed-expert part (E: one expert's slice of one `ffn_*_exps` tensor widened to 4 KiB pages,
//! page-cache hits), timed alone in every round (A-E-C-B / B-C-E-A), their median time a read.
//!
//! The bench fails when B charged fewer reads than the workload made (its explicit-read programs
//! did not run, so B − C would measure nothing); `--kind churn` fails likewise when `filemap_add`
//! never ran in B.
//!
//! `--kind churn`: a storm of page-cache insertions and removals (the programs on
//! `filemap:mm_filemap_add_to_page_cache` / `mm_filemap_delete_from_page_cache`, which run for
//! every file's pages). The target is the workload's `churn-storm` (`--passes` passes over the
//! `cliff-small` model, each dropping it from the page cache with `POSIX_FADV_DONTNEED` and
//! reading it whole again in 1 MiB `pread64`s), run alone (A), under `observer run --model` with
//! a copy of the model churned instead (O: another file's events, which the programs drop after
//! comparing its inode), and under `observer run --model` on the file it churns (B: the pages
//! counted into the model's intervals and their eviction actors), in A-O-B / B-O-A order over
//! the rounds. Printed: every round, the slowdowns O / A and B / A of the median times, each
//! program's ns per run (net of the statistics, F) and runs per page for O and B with its
//! budget (judged in O; B's table says "apart" for the two page-cache programs), and the
//! page-cache work on the model per page (B − O of `filemap_add` + `filemap_delete`), judged
//! against a share of the alone run's time per page (`observer_common::budget`, module spec: a
//! model page's trip out of the page cache and back from storage). One run is one folio: with large folios in the page cache (read-ahead) a
//! run counts many pages. `--random` reads in 4 KiB `pread64`s with `POSIX_FADV_RANDOM` instead
//! (no read-ahead: one page a folio, as random faults of an evicted model bring in), 2 passes
//! unless `--passes` says otherwise.
//!
//! `--kind switch`: a storm of the scheduler's events. The target is the workload's
//! `switch-storm` (`--exchanges` round trips of a byte between two threads over pipes) pinned to
//! one CPU, so that each round trip is two context switches, two wakeups and four system calls,
//! run alone (A), under `observer run` with the scheduler's raw tracepoints (R, `--sched-hooks
//! raw`) and with its tracepoints (T, `--sched-hooks tracepoint`: the programs of kernels
//! without BTF or before 5.18), in A-R-T / T-R-A order over the rounds. Printed: every round,
//! the medians with the added ns per round trip, the paired ratios with their intervals, then R
//! and T once each under `--bpf-stats`: each program's ns per run (gross and net of the
//! statistics, whose cost per run is measured once as `fault_floor`'s under a short fault storm
//! with `--fault-dispatch-only`), runs per round trip, and its budget.
//!
//! `--kind threads`: a storm of threads that start and end (an engine that makes its thread pool
//! for every step). The target is the workload's `anon` phase with 4 threads at a time, each
//! writing 256 fresh pages (4 MiB a round) and exiting, `--thread-rounds` times (250: 1000
//! threads, four times the attribution slots, which are given back as the threads' tasks are
//! freed: `observer_common::attrib::MAX_SLOTS`), alone (A) and under `observer run` (B), in
//! A-B / B-A order over the rounds. Printed: every round, the medians, the paired ratio with its
//! interval, then B once under `--bpf-stats`: how many thread rows its summary has, and each
//! program's cost per run and per thread (`thread_free`, `new_task`, `sched_exit` and
//! `process_free` run once a thread) against its budget.

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

/// The host's mitigations that make a kernel call or return dearer (a tracepoint's dispatch is a
/// few of each): `spectre_v2` (retpolines: indirect calls) and `spec_rstack_overflow` ("Safe
/// RET": every return), as the kernel reports them; a file the kernel does not have is said so,
/// one it has but that cannot be read gives its error.
fn mitigations() -> String {
    let dir = Path::new("/sys/devices/system/cpu/vulnerabilities");
    ["spectre_v2", "spec_rstack_overflow", "retbleed"]
        .iter()
        .map(|f| {
            let path = dir.join(f);
            let v = match std::fs::read_to_string(&path) {
                Ok(v) => v.trim().to_string(),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => "(not reported by this kernel)".into(),
                Err(e) => format!("(cannot read {}: {e})", path.display()),
            };
            format!("{f}: {v}")
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// The workload's phase of `kind`: wall time (ns) and its events (`minflt` for `anon`,
/// `exchanges` for `switch`, `calls` for `pread`), by its own account.
fn phase(stdout: &str, kind: &str) -> Result<(u64, u64)> {
    let events = match kind {
        "anon" => "minflt",
        "switch" => "exchanges",
        _ => "calls",
    };
    stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v["kind"] == kind)
        .and_then(|v| Some((v["wall_ns"].as_u64()?, v[events].as_u64()?)))
        .with_context(|| format!("the workload printed no `{kind}` phase"))
}

/// Per program: (runs, run time ns).
type Programs = BTreeMap<String, (u64, u64)>;

/// The observer's `--json` summary of a run.
fn summary(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

/// The observer's programs' cost at the end of a run, from its `--json` summary, added to `total`.
fn add_programs(v: &Value, total: &mut Programs) -> Result<()> {
    let list = v["bpf_programs"].as_array().context(
        "the observer's summary has no bpf_programs: the kernel refused BPF_ENABLE_STATS (Linux >= 5.8, run as root)",
    )?;
    for p in list {
        let name = p["name"].as_str().context("bpf_programs: a program without a name")?;
        let e = total.entry(name.to_string()).or_default();
        e.0 += p["runs"].as_u64().unwrap_or(0);
        e.1 += p["run_ns"].as_u64().unwrap_or(0);
    }
    Ok(())
}

/// Runs `c` to its end; returns its stdout.
fn run(c: &mut Command) -> Result<String> {
    let out = c.stdout(Stdio::piped()).stderr(Stdio::null()).output().context("spawning the bench command")?;
    if !out.status.success() {
        bail!("the bench command failed ({})", out.status);
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// One observed run of `workload wl_args` (with `--model model` when given): its phase, its
/// summary (the programs' cost added to `progs`).
struct Observed<'a> {
    observer: &'a Path,
    workload: &'a Path,
    wl_args: &'a [String],
    kind: &'a str,
    scratch: &'a Path,
    n: usize,
}

impl Observed<'_> {
    /// With `stats`, under `--bpf-stats`: the programs' cost is added to `progs`. `extra`: more
    /// `observer run` options.
    fn run(
        &mut self,
        model: Option<&Path>,
        stats: bool,
        extra: &[&str],
        progs: &mut Programs,
    ) -> Result<((u64, u64), Value)> {
        self.n += 1;
        let json = self.scratch.join(format!("run-{}.json", self.n));
        let _ = std::fs::remove_file(&json);
        let mut c = Command::new(self.observer);
        c.args(["run", "--every", "0", "--json"]).arg(&json).args(extra);
        if stats {
            c.arg("--bpf-stats");
        }
        if let Some(m) = model {
            c.arg("--model").arg(m);
        }
        let out = run(c.arg("--").arg(self.workload).args(self.wl_args))?;
        let v = summary(&json)?;
        if stats {
            add_programs(&v, progs)?;
        }
        Ok((phase(&out, self.kind)?, v))
    }
}

/// The programs that ran, most expensive first: per program, runs, ns per run, runs per event and
/// ns per event (`events`: the workload's faults or reads over the observed runs); with
/// `stats_ns` (what the statistics add to a run), ns per run and per event net of it too.
/// Programs named in `apart` also do another event's work in this arm, judged on its own by the
/// caller (`observer_common::budget`, module spec): their column says "apart".
fn print_programs(progs: &Programs, events: u64, event: &str, stats_ns: Option<f64>, apart: &[&str]) {
    let per = |x: f64| x / events.max(1) as f64;
    let net = |w: usize, v: f64| stats_ns.map(|_| format!(" {v:>w$.1}")).unwrap_or_default();
    let head = |w: usize, t: &str| stats_ns.map(|_| format!(" {t:>w$}")).unwrap_or_default();
    println!(
        "  (budget: `observer_common::budget`, ns per run net of the statistics, against {}; judged only for a \
         program on the storm's path, at least 1 run per 100 {event}s: a rarer one runs cold)",
        if stats_ns.is_some() { "the net ns/run" } else { "ns/run, the statistics' own cost not measured here" }
    );
    println!(
        "  {:<20} {:>12} {:>10}{} {:>12} {:>14}{} {:>8}  within",
        "program",
        "runs",
        "ns/run",
        head(12, "net ns/run"),
        format!("runs/{event}"),
        format!("ns per {event}"),
        head(14, &format!("net per {event}")),
        "budget"
    );
    let mut ran: Vec<_> = progs.iter().filter(|(_, (n, _))| *n > 0).collect();
    ran.sort_by_key(|(_, (_, ns))| std::cmp::Reverse(*ns));
    for (name, (n, ns)) in &ran {
        let (n, ns) = (*n as f64, *ns as f64);
        let net_ns = ns - n * stats_ns.unwrap_or(0.0);
        let budget = observer_common::budget::budget(name).map(|b| b.ns_per_run as f64);
        let within = match budget {
            _ if apart.contains(&name.as_str()) => "apart",
            None => "NO BUDGET",
            Some(_) if per(n) < 0.01 => "rare",
            Some(b) if net_ns / n <= b => "yes",
            Some(_) => "OVER",
        };
        println!(
            "  {name:<20} {n:>12} {:>10.1}{} {:>12.3} {:>14.1}{} {:>8}  {within}",
            ns / n,
            net(12, net_ns / n),
            per(n),
            per(ns),
            net(14, per(net_ns)),
            budget.map(|b| format!("{b:.0}")).unwrap_or_else(|| "–".into())
        );
    }
}

/// Which close a run's summary says it attached (`observer_common::faults`).
fn fault_close(v: &Value) -> String {
    let probes = v["probes"].as_array().map(|a| a.iter().filter_map(|p| p.as_str()).collect::<Vec<_>>());
    match probes {
        Some(p) if p.contains(&"raw_tp:memcg:count_memcg_events") => "memcg:count_memcg_events".into(),
        Some(p) if p.contains(&"perf:minor-faults") => "perf minor-faults".into(),
        _ => "? (no fault close in the summary's probes)".into(),
    }
}

/// The sum of the numbers in `v` (an object or array of counts per kind, or a number).
fn sum_counts(v: &Value) -> u64 {
    match v {
        Value::Object(m) => m.values().map(sum_counts).sum(),
        Value::Array(a) => a.iter().map(sum_counts).sum(),
        v => v.as_u64().unwrap_or(0),
    }
}

/// A storm's arms, each a letter (the module spec's) and a name, the first the target alone, with
/// each arm's time (ns) in every round: printed per round as their times and their ratios to the
/// first, and as the ratios between named arms paired by round.
struct Arms {
    arms: Vec<(char, &'static str)>,
    ns: Vec<Vec<f64>>,
}

impl Arms {
    fn new(arms: &[(char, &'static str)]) -> Self {
        Arms { arms: arms.to_vec(), ns: vec![Vec::new(); arms.len()] }
    }

    /// Adds a round: each arm's time (ns), in the arms' order.
    fn push(&mut self, times: &[u64]) {
        for (ns, t) in self.ns.iter_mut().zip(times) {
            ns.push(*t as f64);
        }
    }

    /// Adds round `r` and prints it: the first arm's time and ns per `event` (`events` of them a
    /// run), then each other arm's time and its ratio to the first's.
    fn round(&mut self, r: usize, times: &[u64], events: u64, event: &str) {
        self.push(times);
        let alone = times[0] as f64;
        let others: String = self.arms[1..]
            .iter()
            .zip(&times[1..])
            .map(|((_, name), &t)| format!(", {name} {:.3} s ({:.3}x)", t as f64 / 1e9, t as f64 / alone))
            .collect();
        println!(
            "round {r}: {} {:.3} s ({:.0} ns/{event}){others}",
            self.arms[0].1,
            alone / 1e9,
            alone / events.max(1) as f64
        );
    }

    /// The times of `arm` (its letter), one a round.
    fn times(&self, arm: char) -> &[f64] {
        let i = self.arms.iter().position(|(c, _)| *c == arm).unwrap_or_else(|| panic!("no arm {arm}"));
        &self.ns[i]
    }

    /// The median time of `arm` over the rounds.
    fn median(&self, arm: char) -> f64 {
        median(&mut self.times(arm).to_vec())
    }

    /// `y / x` paired by round: their geometric mean with its 95 % bootstrap interval over the
    /// rounds (`bench_util::paired_ratio_ci`), `None` for fewer than two rounds (or a time of 0).
    fn ratio(&self, x: char, y: char) -> Option<(f64, f64, f64)> {
        let pairs: Vec<(f64, f64)> = self.times(x).iter().copied().zip(self.times(y).iter().copied()).collect();
        bench_util::paired_ratio_ci(&pairs)
    }

    /// Prints the paired ratios `(label, x, y)`, each `y / x` (`ratio`), on one line.
    fn print_ratios(&self, ratios: &[(&str, char, char)]) {
        let each: Vec<String> = ratios
            .iter()
            .map(|&(label, x, y)| match self.ratio(x, y) {
                Some((g, lo, hi)) => format!("{label} {g:.3} [{lo:.3}, {hi:.3}]"),
                None => format!("{label} n/a (fewer than two rounds)"),
            })
            .collect();
        println!("paired by round, geometric mean with a 95 % bootstrap interval over the rounds: {}", each.join("; "));
    }
}

pub fn main(args: &[String]) -> Result<()> {
    let (mut rounds, mut size, mut kind) = (4usize, "64M".to_string(), "anon".to_string());
    let (mut repeat, mut calls, mut exchanges, mut passes) = (64u32, 400_000u64, 200_000u64, None);
    let mut random = false;
    let mut threads_repeat = 250u32;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = |name: &str| it.next().with_context(|| format!("{name} needs a value")).cloned();
        match a.as_str() {
            "--rounds" => rounds = val("--rounds")?.parse()?,
            "--size" => size = val("--size")?,
            "--repeat" => repeat = val("--repeat")?.parse()?,
            "--kind" => kind = val("--kind")?,
            "--calls" => calls = val("--calls")?.parse()?,
            "--exchanges" => exchanges = val("--exchanges")?.parse()?,
            "--passes" => passes = Some(val("--passes")?.parse()?),
            "--random" => random = true,
            "--thread-rounds" => threads_repeat = val("--thread-rounds")?.parse()?,
            _ => bail!(
                "usage: cargo xtask bench storm [--rounds N] [--kind anon|pread|churn|switch|threads] [--size 64M] \
                 [--repeat R] [--calls N] [--passes N] [--random] [--exchanges N] [--thread-rounds N]"
            ),
        }
    }
    if !matches!(kind.as_str(), "anon" | "pread" | "churn" | "switch" | "threads") {
        bail!(
            "--kind {kind}: the storms are `anon` (minor faults), `pread` (explicit reads of the model), `churn` \
             (page-cache insertions and removals), `switch` (context switches) and `threads` (threads started and ended)"
        );
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
    if kind == "pread" {
        let model = crate::bench_cliff::small_model(&bin.join("engine"))?;
        let _lock = testkit::machine_lock();
        return pread_storm(&observer, &workload, &scratch, &model, rounds, calls);
    }
    if kind == "churn" {
        let model = crate::bench_cliff::small_model(&bin.join("engine"))?;
        let _lock = testkit::machine_lock();
        let passes = passes.unwrap_or(if random { 2 } else { 8 });
        return churn_storm(&observer, &workload, &scratch, &model, rounds, passes, random);
    }
    if kind == "switch" {
        let _lock = testkit::machine_lock();
        return switch_storm(&observer, &workload, &scratch, rounds, exchanges);
    }
    if kind == "threads" {
        let _lock = testkit::machine_lock();
        return thread_storm(&observer, &workload, &scratch, rounds, threads_repeat);
    }
    let _lock = testkit::machine_lock();
    let wl_args = ["anon".to_string(), "--size".into(), size.clone(), "--repeat".into(), repeat.to_string()];
    let (mut progs_total, mut progs_floor) = (Programs::new(), Programs::new());
    let mut stats_faults = 0u64;
    let mut obs =
        Observed { observer: &observer, workload: &workload, wl_args: &wl_args, kind: "anon", scratch: &scratch, n: 0 };
    println!(
        "workload anon --size {size} --repeat {repeat} alone (A), under `observer run` (B: fault storms sampled), \
         under `observer run --time-every-fault` (E), under `observer run --fault-close perf` (P: faults closed \
         by perf events, the close before the memcg one), under `observer run --bpf-stats` (S: the programs' \
         cost) and under `observer run --fault-dispatch-only` (D: the fault hooks' dispatch, programs that \
         return at once; F: D under the statistics, their own cost), {rounds} rounds A-B-E-P-S-D-F / \
         F-D-S-P-E-B-A"
    );
    println!("host mitigations: {}", mitigations());
    let mut arms = Arms::new(&[
        ('A', "alone"),
        ('B', "observed"),
        ('E', "every fault timed"),
        ('P', "perf close"),
        ('S', "with statistics"),
        ('D', "dispatch floor"),
    ]);
    let mut ratios = Vec::new();
    let (mut alone_ns, mut alone_faults) = (0u64, 0u64);
    let (mut b_minflt, mut b_untimed) = (0u64, 0u64);
    let mut closes = Vec::new();
    for r in 0..rounds {
        let mut order = ['A', 'B', 'E', 'P', 'S', 'D', 'F'];
        if !r.is_multiple_of(2) {
            order.reverse();
        }
        let (mut a, mut b, mut e, mut p, mut st, mut d) =
            ((0u64, 0u64), (0u64, 0u64), (0u64, 0u64), (0u64, 0u64), (0u64, 0u64), (0u64, 0u64));
        for side in order {
            match side {
                'A' => a = phase(&run(Command::new(&workload).args(&wl_args))?, "anon")?,
                'B' => {
                    let (ph, v) = obs.run(None, false, &[], &mut progs_total)?;
                    b = ph;
                    closes.push(fault_close(&v));
                    b_minflt += v["totals"]["minflt"].as_u64().unwrap_or(0);
                    b_untimed += v["totals"]["minflt_untimed"].as_u64().unwrap_or(0);
                }
                'E' => e = obs.run(None, false, &["--time-every-fault"], &mut progs_total)?.0,
                'P' => p = obs.run(None, false, &["--fault-close", "perf"], &mut progs_total)?.0,
                'D' => d = obs.run(None, false, &["--fault-dispatch-only"], &mut progs_total)?.0,
                'F' => _ = obs.run(None, true, &["--fault-dispatch-only"], &mut progs_floor)?,
                _ => {
                    st = obs.run(None, true, &[], &mut progs_total)?.0;
                    stats_faults += st.1;
                }
            }
        }
        let ratio = b.0 as f64 / a.0 as f64;
        let rate = |p: (u64, u64)| p.1 as f64 / p.0 as f64 * 1e3;
        println!(
            "round {r}: alone {:.3} s ({:.2} M faults/s), observed {:.3} s ({:.2} M faults/s), slowdown {ratio:.3}; \
             every fault timed {:.3} s ({:.3}x); perf close {:.3} s ({:.3}x); with statistics {:.3} s ({:.3}x); \
             dispatch floor {:.3} s ({:.3}x)",
            a.0 as f64 / 1e9,
            rate(a),
            b.0 as f64 / 1e9,
            rate(b),
            e.0 as f64 / 1e9,
            e.0 as f64 / a.0 as f64,
            p.0 as f64 / 1e9,
            p.0 as f64 / a.0 as f64,
            st.0 as f64 / 1e9,
            st.0 as f64 / a.0 as f64,
            d.0 as f64 / 1e9,
            d.0 as f64 / a.0 as f64
        );
        arms.push(&[a.0, b.0, e.0, p.0, st.0, d.0]);
        ratios.push(ratio);
        alone_ns += a.0;
        alone_faults += a.1;
    }
    closes.dedup();
    let (ma, mb, me, mp, ms, md) =
        (arms.median('A'), arms.median('B'), arms.median('E'), arms.median('P'), arms.median('S'), arms.median('D'));
    println!(
        "median: alone {:.3} s, observed {:.3} s, every fault timed {:.3} s, with the perf close {:.3} s, observed \
         with statistics {:.3} s, dispatch floor {:.3} s",
        ma / 1e9,
        mb / 1e9,
        me / 1e9,
        mp / 1e9,
        ms / 1e9,
        md / 1e9
    );
    println!("faults closed in B by: {}", closes.join(", "));
    println!(
        "untimed in B (storm sampling): {b_untimed} of {b_minflt} minor faults ({:.1} %)",
        100.0 * b_untimed as f64 / b_minflt.max(1) as f64
    );
    println!(
        "slowdown under the observer (observed / alone): {:.3} (goal <= {GOAL}); median of rounds {:.3}; \
         every fault timed {:.3}; with the perf close {:.3}; with --bpf-stats {:.3}; dispatch floor {:.3}",
        mb / ma,
        median(&mut ratios),
        me / ma,
        mp / ma,
        ms / ma,
        md / ma
    );
    arms.print_ratios(&[
        ("observed / alone", 'A', 'B'),
        ("every fault timed / alone", 'A', 'E'),
        ("observed / every fault timed", 'E', 'B'),
        ("memcg close / perf close", 'P', 'B'),
    ]);
    // The floor splits B's cost: the kernel's dispatch of the fault hooks (D / A, times the alone
    // run's time per fault) and what the observer's programs add to it (B / D, times D's).
    let alone_fault = alone_ns as f64 / alone_faults.max(1) as f64;
    let floor_fault = alone_fault * md / ma;
    let share = |ci: Option<(f64, f64, f64)>, base: f64| match ci {
        Some((g, lo, hi)) => format!(
            "{g:.3} [{lo:.3}, {hi:.3}]: {:.0} [{:.0}, {:.0}] ns per fault",
            (g - 1.0) * base,
            (lo - 1.0) * base,
            (hi - 1.0) * base
        ),
        None => "n/a (fewer than two rounds)".to_string(),
    };
    println!(
        "split at the dispatch floor (paired, as above): the kernel's dispatch of the fault hooks, floor / alone {} \
         (of the alone run's {alone_fault:.0} ns per fault); the observer's programs, observed / floor {} (of the \
         floor's {floor_fault:.0})",
        share(arms.ratio('A', 'D'), alone_fault),
        share(arms.ratio('D', 'B'), floor_fault)
    );
    let observed_faults = stats_faults;
    let n_observed = rounds;
    let per_fault = |x: u64| x as f64 / observed_faults.max(1) as f64;
    let budget = (GOAL - 1.0) * alone_ns as f64 / alone_faults.max(1) as f64;
    println!(
        "kernel-side cost per program (kernel BPF statistics over the {n_observed} runs with statistics, \
         {observed_faults} workload faults; every process's events run the programs):"
    );
    // What the statistics add to a run: the floor's ns per run under them.
    let stats_ns = progs_floor.get("fault_floor").filter(|(n, _)| *n > 0).map(|(n, ns)| *ns as f64 / *n as f64);
    match stats_ns {
        Some(x) => println!(
            "  (the statistics' own cost per program run: {x:.1} ns, fault_floor's ns/run under them in the F runs; \
             net ns/run = ns/run less that)"
        ),
        None => println!("  (the F runs' summaries name no fault_floor runs: no net ns/run)"),
    }
    print_programs(&progs_total, observed_faults, "fault", stats_ns, &[]);
    let total: u64 = progs_total.values().map(|v| v.1).sum();
    let runs: u64 = progs_total.values().map(|v| v.0).sum();
    // Judged net of the statistics, as every budget is (`observer_common::budget`): their clock
    // reads are not in an observed run.
    let net = stats_ns.map(|x| per_fault(total) - x * runs as f64 / observed_faults.max(1) as f64);
    let net_total = net.map(|n| format!(" ({n:.1} net of the statistics)")).unwrap_or_default();
    let judged = net.unwrap_or(per_fault(total));
    println!(
        "  all programs: {:.1} ns per workload fault{net_total}; budget at the {GOAL}x goal: {budget:.1} ns per fault \
         ({:.1} % of the alone run's {:.1} ns per fault): {} {}",
        per_fault(total),
        (GOAL - 1.0) * 100.0,
        alone_ns as f64 / alone_faults.max(1) as f64,
        if net.is_some() { "net" } else { "gross (no net: the floor's statistics are missing)" },
        if judged <= budget { "within" } else { "over budget" }
    );
    Ok(())
}

/// `model` linked as `scratch/name`, a name without `.gguf`: without `--model` the observer finds
/// no model on the command line.
fn model_link(scratch: &Path, model: &Path, name: &str) -> Result<std::path::PathBuf> {
    let link = scratch.join(name);
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(model, &link).with_context(|| format!("linking {}", link.display()))?;
    Ok(link)
}

/// `--kind pread` (module spec).
fn pread_storm(
    observer: &Path,
    workload: &Path,
    scratch: &Path,
    model: &Path,
    rounds: usize,
    calls: u64,
) -> Result<()> {
    let link = model_link(scratch, model, "pread-storm-model.bin")?;
    let wl_args: Vec<String> =
        vec!["pread-storm".into(), "--path".into(), link.display().to_string(), "--calls".into(), calls.to_string()];
    // The event the explicit-read work is judged against (`observer_common::budget::XREAD_WORK`).
    let part = smallest_expert_part(model)?;
    let part_calls = (calls / 100).max(200);
    let part_args: Vec<String> = vec![
        "pread-storm".into(),
        "--path".into(),
        link.display().to_string(),
        "--calls".into(),
        part_calls.to_string(),
        "--block".into(),
        part.to_string(),
    ];
    println!(
        "workload pread-storm --calls {calls} (4 KiB pread64s of {}, page-cache hits) alone (A), under `observer run` \
         without a model (C) and with it as --model (B); and {part_calls} reads of {part} bytes alone (E: the \
         model's smallest routed-expert part), {rounds} rounds A-E-C-B / B-C-E-A",
        model.display()
    );
    let mut obs = Observed { observer, workload, wl_args: &wl_args, kind: "pread", scratch, n: 0 };
    let (mut progs_b, mut progs_c) = (Programs::new(), Programs::new());
    let mut arms = Arms::new(&[('A', "alone"), ('C', "no model"), ('B', "model")]);
    let (mut reads_b, mut reads_c, mut charged) = (0u64, 0u64, 0u64);
    let mut part_ns = Vec::new();
    for r in 0..rounds {
        let order: [char; 4] = if r.is_multiple_of(2) { ['A', 'E', 'C', 'B'] } else { ['B', 'C', 'E', 'A'] };
        let (mut a, mut b, mut c) = (0u64, 0u64, 0u64);
        for side in order {
            match side {
                'A' => a = phase(&run(Command::new(workload).args(&wl_args))?, "pread")?.0,
                'E' => {
                    let ns = phase(&run(Command::new(workload).args(&part_args))?, "pread")?.0;
                    part_ns.push(ns as f64 / part_calls as f64);
                }
                'B' => {
                    let ((ns, n), v) = obs.run(Some(link.as_path()), true, &[], &mut progs_b)?;
                    b = ns;
                    reads_b += n;
                    // The reads charged to the model's regions (and unresolved ones), from the token.
                    for t in v["tokens"].as_array().into_iter().flatten() {
                        let x = &t["explicit_reads"];
                        charged += sum_counts(&x["calls"]) + x["unresolved_calls"].as_u64().unwrap_or(0);
                    }
                }
                _ => {
                    let ((ns, n), _) = obs.run(None, true, &[], &mut progs_c)?;
                    c = ns;
                    reads_c += n;
                }
            }
        }
        arms.round(r, &[a, c, b], calls, "read");
    }
    let (ma, mb, mc) = (arms.median('A'), arms.median('B'), arms.median('C'));
    println!(
        "median: alone {:.3} s, no model {:.3} s, model {:.3} s; slowdown without a model {:.3}, with it {:.3}",
        ma / 1e9,
        mc / 1e9,
        mb / 1e9,
        mc / ma,
        mb / ma
    );
    println!("reads charged to the model (explicit_reads calls of the tokens): {charged} of the workload's {reads_b}");
    if charged < reads_b {
        bail!(
            "the observer charged {charged} of the workload's {reads_b} reads to the model: its explicit-read programs \
             did not run (run `observer run --model {} -- {} {}` to see its warnings)",
            link.display(),
            workload.display(),
            wl_args.join(" ")
        );
    }
    let stats_ns = statistics_cost(observer, workload, scratch)?;
    println!("with the model (B), kernel BPF statistics over its runs:");
    println!(
        "  (\"apart\": the program also charges the reads to the model's regions here; that work is judged below, the \
         program's own work per syscall in C)"
    );
    print_programs(&progs_b, reads_b, "read", stats_ns, &["sys_enter", "sys_exit"]);
    println!("without a model (C):");
    print_programs(&progs_c, reads_c, "read", stats_ns, &[]);
    let per = |p: &Programs, name: &str, reads: u64| p.get(name).map_or(0.0, |v| v.1 as f64 / reads.max(1) as f64);
    let xread: f64 =
        ["sys_enter", "sys_exit"].iter().map(|n| per(&progs_b, n, reads_b) - per(&progs_c, n, reads_c)).sum();
    let small = ma / calls as f64;
    println!(
        "explicit-read work (sys_enter + sys_exit, B − C): {xread:.1} ns per read; the alone run's time per read: \
         {small:.1} ns ({:.1} % of it)",
        100.0 * xread / small
    );
    print_apart(
        &observer_common::budget::XREAD_WORK,
        xread,
        median(&mut part_ns),
        &format!("{part} bytes, E, median of {rounds}"),
    );
    Ok(())
}

/// Work judged apart from its programs' budgets (`observer_common::budget`, module spec): `work`
/// ns against `b`'s share of `event_ns`, the event as measured (`how`).
fn print_apart(b: &observer_common::budget::ApartBudget, work: f64, event_ns: f64, how: &str) {
    let budget = b.ns(event_ns);
    println!(
        "  budget of the {}: {:.0} % of {} ({how}): {:.1} µs, so {budget:.0} ns; the work is {:.2} % of it: {}",
        b.work,
        100.0 * b.share,
        b.event,
        event_ns / 1e3,
        100.0 * work / event_ns,
        if work <= budget { "within" } else { "OVER" }
    );
}

/// The model's smallest routed-expert part in bytes (one expert's slice of one `ffn_*_exps`
/// tensor), widened to whole 4 KiB pages as the engine's cache reads it (`engine::cache::io`).
fn smallest_expert_part(model: &Path) -> Result<u64> {
    let g = engine::gguf::Gguf::open(model).with_context(|| format!("reading {}", model.display()))?;
    let page = engine::cache::io::ALIGN as u64;
    g.tensors
        .iter()
        .filter(|t| t.is_routed_expert() && t.n_slices() > 0)
        .map(|t| (t.size / t.n_slices()).div_ceil(page) * page)
        .min()
        .with_context(|| format!("{} has no routed-expert tensor", model.display()))
}

/// `--kind churn` (module spec).
fn churn_storm(
    observer: &Path,
    workload: &Path,
    scratch: &Path,
    model: &Path,
    rounds: usize,
    passes: u64,
    random: bool,
) -> Result<()> {
    // A copy of the model: the other file.
    let link = model_link(scratch, model, "churn-storm-model.bin")?;
    let copy = scratch.join("churn-storm-copy.bin");
    let len = |p: &Path| std::fs::metadata(p).map(|m| m.len()).ok();
    if len(&copy) != len(model) {
        std::fs::copy(model, &copy).with_context(|| format!("copying {} to {}", model.display(), copy.display()))?;
    }
    let args = |path: &Path| -> Vec<String> {
        let mut a: Vec<String> = vec![
            "churn-storm".into(),
            "--path".into(),
            path.display().to_string(),
            "--passes".into(),
            passes.to_string(),
        ];
        if random {
            a.extend(["--random".into(), "--block".into(), "4K".into()]);
        }
        a
    };
    let (wl_model, wl_copy) = (args(&link), args(&copy));
    println!(
        "workload churn-storm --passes {passes}{} (each: {} dropped with POSIX_FADV_DONTNEED and read whole) alone (A), \
         under `observer run --model` on it with a copy churned instead (O) and on the file it churns (B), \
         {rounds} rounds A-O-B / B-O-A",
        if random { " --random --block 4K" } else { "" },
        model.display()
    );
    let mut on_model = Observed { observer, workload, wl_args: &wl_model, kind: "churn", scratch, n: 0 };
    let mut on_copy = Observed { observer, workload, wl_args: &wl_copy, kind: "churn", scratch, n: 1000 };
    let (mut progs_b, mut progs_o) = (Programs::new(), Programs::new());
    let mut arms = Arms::new(&[('A', "alone"), ('O', "other file"), ('B', "model")]);
    let (mut pages_b, mut pages_o, mut pages) = (0u64, 0u64, 0u64);
    for r in 0..rounds {
        let order: [char; 3] = if r.is_multiple_of(2) { ['A', 'O', 'B'] } else { ['B', 'O', 'A'] };
        let (mut a, mut b, mut o) = (0u64, 0u64, 0u64);
        for side in order {
            match side {
                'A' => (a, pages) = phase(&run(Command::new(workload).args(&wl_model))?, "churn")?,
                'B' => {
                    let ((ns, n), _) = on_model.run(Some(link.as_path()), true, &[], &mut progs_b)?;
                    (b, pages_b) = (ns, pages_b + n);
                }
                _ => {
                    let ((ns, n), _) = on_copy.run(Some(link.as_path()), true, &[], &mut progs_o)?;
                    (o, pages_o) = (ns, pages_o + n);
                }
            }
        }
        arms.round(r, &[a, o, b], pages, "page");
    }
    let (ma, mb, mo) = (arms.median('A'), arms.median('B'), arms.median('O'));
    println!(
        "median: alone {:.3} s, other file {:.3} s, model {:.3} s; slowdown with another file's events {:.3}, with \
         the model's {:.3}",
        ma / 1e9,
        mo / 1e9,
        mb / 1e9,
        mo / ma,
        mb / ma
    );
    if progs_b.get("filemap_add").is_none_or(|p| p.0 == 0) {
        bail!(
            "the observer's filemap_add never ran on the churned model: its page-cache programs did not attach (run \
             `observer run --model {} -- {} {}` to see its warnings)",
            link.display(),
            workload.display(),
            wl_model.join(" ")
        );
    }
    let stats_ns = statistics_cost(observer, workload, scratch)?;
    println!("the model churned (B), kernel BPF statistics over its runs:");
    println!(
        "  (\"apart\": the program also counts the model's pages into its intervals and blames their eviction here; \
         that work is judged below, the program's own work per page of any file in O)"
    );
    print_programs(&progs_b, pages_b, "page", stats_ns, &["filemap_add", "filemap_delete"]);
    println!("another file churned (O):");
    print_programs(&progs_o, pages_o, "page", stats_ns, &[]);
    let per = |p: &Programs, name: &str, n: u64| p.get(name).map_or(0.0, |v| v.1 as f64 / n.max(1) as f64);
    let work: f64 = ["filemap_add", "filemap_delete"]
        .iter()
        .map(|name| per(&progs_b, name, pages_b) - per(&progs_o, name, pages_o))
        .sum();
    let event = ma / pages.max(1) as f64;
    println!(
        "page-cache work on the model (filemap_add + filemap_delete, B − O): {work:.1} ns per page; the alone run's \
         time per page: {event:.1} ns"
    );
    print_apart(&observer_common::budget::MODEL_PAGE_WORK, work, event, "A, per page");
    Ok(())
}

/// `--kind switch` (module spec).
fn switch_storm(observer: &Path, workload: &Path, scratch: &Path, rounds: usize, exchanges: u64) -> Result<()> {
    let wl_args: Vec<String> = ["-c", "0"]
        .into_iter()
        .map(String::from)
        .chain([workload.display().to_string(), "switch-storm".into(), "--exchanges".into(), exchanges.to_string()])
        .collect();
    let taskset = Path::new("taskset");
    println!(
        "taskset -c 0 workload switch-storm --exchanges {exchanges} (round trips of a byte between two threads on \
         one CPU: 2 switches, 2 wakeups, 4 syscalls each) alone (A), under `observer run` with the scheduler's raw \
         tracepoints (R) and with its tracepoints (`--sched-hooks tracepoint`, T), {rounds} rounds A-R-T / T-R-A, \
         then each observed arm once under --bpf-stats; the statistics' own cost from one fault storm under \
         --fault-dispatch-only --bpf-stats (F)"
    );
    println!("host mitigations: {}", mitigations());
    let mut obs = Observed { observer, workload: taskset, wl_args: &wl_args, kind: "switch", scratch, n: 0 };
    let raw: &[&str] = &["--sched-hooks", "raw"];
    let tp: &[&str] = &["--sched-hooks", "tracepoint"];
    let mut none = Programs::new();
    let mut arms = Arms::new(&[('A', "alone"), ('R', "raw"), ('T', "tracepoints")]);
    let mut alone_ex = 0u64;
    for r in 0..rounds {
        let order: [char; 3] = if r.is_multiple_of(2) { ['A', 'R', 'T'] } else { ['T', 'R', 'A'] };
        let (mut a, mut rw, mut t) = (0u64, 0u64, 0u64);
        for side in order {
            match side {
                'A' => {
                    let (ns, n) = phase(&run(Command::new(taskset).args(&wl_args))?, "switch")?;
                    (a, alone_ex) = (ns, n);
                }
                'R' => rw = obs.run(None, false, raw, &mut none)?.0.0,
                _ => t = obs.run(None, false, tp, &mut none)?.0.0,
            }
        }
        arms.round(r, &[a, rw, t], exchanges, "exchange");
    }
    let (ma, mr, mt) = (arms.median('A'), arms.median('R'), arms.median('T'));
    let per_ex = |ns: f64| ns / alone_ex.max(1) as f64;
    println!(
        "median: alone {:.3} s ({:.0} ns an exchange), raw {:.3} s (+{:.0} ns an exchange), tracepoints {:.3} s \
         (+{:.0} ns)",
        ma / 1e9,
        per_ex(ma),
        mr / 1e9,
        per_ex(mr - ma),
        mt / 1e9,
        per_ex(mt - ma)
    );
    arms.print_ratios(&[("raw / alone", 'A', 'R'), ("tracepoints / alone", 'A', 'T'), ("raw / tracepoints", 'T', 'R')]);
    let stats_ns = statistics_cost(observer, workload, scratch)?;
    for (name, extra) in [("raw tracepoints (R)", raw), ("tracepoints (T)", tp)] {
        let mut progs = Programs::new();
        let ((ns, n), _) = obs.run(None, true, extra, &mut progs)?;
        println!(
            "{name} under --bpf-stats: {:.3} s, {n} exchanges; kernel BPF statistics of the run:",
            ns as f64 / 1e9
        );
        print_all_programs(&progs, n, "exchange", stats_ns);
    }
    Ok(())
}

/// The statistics' own cost per program run, printed: an empty program's (`fault_floor`) under
/// them, in a short fault storm under `--fault-dispatch-only --bpf-stats` (F).
fn statistics_cost(observer: &Path, workload: &Path, scratch: &Path) -> Result<Option<f64>> {
    let mut floor = Programs::new();
    let fwl = ["anon".to_string(), "--size".into(), "64M".into(), "--repeat".into(), "4".into()];
    let mut fobs = Observed { observer, workload, wl_args: &fwl, kind: "anon", scratch, n: 100 };
    fobs.run(None, true, &["--fault-dispatch-only"], &mut floor)?;
    let stats_ns = floor.get("fault_floor").filter(|(n, _)| *n > 0).map(|(n, ns)| *ns as f64 / *n as f64);
    match stats_ns {
        Some(x) => println!("the statistics' own cost per program run: {x:.1} ns (fault_floor under them, F)"),
        None => println!("F named no fault_floor runs: no net ns/run"),
    }
    Ok(stats_ns)
}

/// [`print_programs`], then their sum per event (net of the statistics with `stats_ns`).
fn print_all_programs(progs: &Programs, n: u64, event: &str, stats_ns: Option<f64>) {
    print_programs(progs, n, event, stats_ns, &[]);
    let total: u64 = progs.values().map(|v| v.1).sum();
    let runs: u64 = progs.values().map(|v| v.0).sum();
    println!(
        "  all programs: {:.0} ns per {event}{}",
        total as f64 / n.max(1) as f64,
        stats_ns
            .map(|x| format!(" ({:.0} net of the statistics)", (total as f64 - x * runs as f64) / n.max(1) as f64))
            .unwrap_or_default()
    );
}

/// Threads started and ended at once by `--kind threads` (module spec).
const STORM_THREADS: u32 = 4;

/// `--kind threads` (module spec).
fn thread_storm(observer: &Path, workload: &Path, scratch: &Path, rounds: usize, repeat: u32) -> Result<()> {
    let wl_args: Vec<String> =
        ["anon", "--threads", &STORM_THREADS.to_string(), "--repeat", &repeat.to_string(), "--size", "4M"]
            .into_iter()
            .map(String::from)
            .collect();
    let threads = (STORM_THREADS * repeat) as u64;
    println!(
        "workload anon --threads {STORM_THREADS} --repeat {repeat} --size 4M ({threads} threads, {STORM_THREADS} \
         at a time, each writing 256 fresh pages and exiting) alone (A) and under `observer run` (B), {rounds} \
         rounds A-B / B-A, then B once under --bpf-stats; the statistics' own cost from one fault storm under \
         --fault-dispatch-only --bpf-stats (F)"
    );
    println!("host mitigations: {}", mitigations());
    let mut obs = Observed { observer, workload, wl_args: &wl_args, kind: "anon", scratch, n: 0 };
    let mut none = Programs::new();
    let mut arms = Arms::new(&[('A', "alone"), ('B', "observed")]);
    for r in 0..rounds {
        let order: [char; 2] = if r.is_multiple_of(2) { ['A', 'B'] } else { ['B', 'A'] };
        let (mut a, mut b) = (0u64, 0u64);
        for side in order {
            match side {
                'A' => a = phase(&run(Command::new(workload).args(&wl_args))?, "anon")?.0,
                _ => b = obs.run(None, false, &[], &mut none)?.0.0,
            }
        }
        arms.round(r, &[a, b], threads, "thread");
    }
    println!("median: alone {:.3} s, observed {:.3} s", arms.median('A') / 1e9, arms.median('B') / 1e9);
    arms.print_ratios(&[("observed / alone", 'A', 'B')]);
    let stats_ns = statistics_cost(observer, workload, scratch)?;
    let mut progs = Programs::new();
    let ((ns, _), v) = obs.run(None, true, &[], &mut progs)?;
    let rows = v["threads"].as_array().map(|t| t.len()).unwrap_or(0);
    println!(
        "B under --bpf-stats: {:.3} s, {rows} thread rows in its summary for {threads} threads and the main one; \
         kernel BPF statistics of the run:",
        ns as f64 / 1e9
    );
    print_all_programs(&progs, threads, "thread", stats_ns);
    Ok(())
}
