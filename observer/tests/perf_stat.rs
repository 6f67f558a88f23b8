//! Fault counts against `perf stat -e major-faults,minor-faults` attached to
//! the same process for the same span (both attach before the workload's
//! `exec` and stop when it exits).

mod common;

use common::*;
use std::process::Command;

#[test]
fn fault_counts_match_perf_stat() {
    let _l = machine_lock();
    let dir = scratch_dir("perfstat");
    let file = dir.join("refault.bin");
    let (perf_text, v) = beside_perf_stat(&dir, &format!("{} demo --size 64M --path {}", workload(), file.display()));
    let maj = perf_count(&perf_text, "major-faults");
    let min = perf_count(&perf_text, "minor-faults");
    assert!(maj >= 16_000 && min >= 16_000, "the demo faults a lot: {perf_text}");
    assert_within("major faults vs perf stat", u(&v["totals"], "majflt"), maj, 0.02);
    assert_within("minor faults vs perf stat", u(&v["totals"], "minflt"), min, 0.02);
    // The whole-run attribution counts the same faults.
    let a = &v["attribution_totals"];
    assert_within("attributed major faults vs perf stat", u(a, "majflt_file") + u(a, "majflt_swap"), maj, 0.02);
    assert_within("attributed minor faults vs perf stat", u(a, "minflt"), min, 0.02);
}

/// The kernel's own run counts of the fault programs (`bpf_programs` in the summary, from
/// `BPF_ENABLE_STATS` and each program's `bpf_prog_info`) against two independent counts of
/// the same perf software events: at least the faults the workload counted itself
/// (getrusage around its phase, all taken while the programs were attached), at most what
/// `perf stat -a` counted on every CPU over a span that encloses the observer's whole run.
#[test]
fn per_program_bpf_run_counts_lie_between_the_workloads_faults_and_perf_stat_system_wide() {
    let _l = machine_lock();
    let dir = scratch_dir("perfstat");
    let perf_out = dir.join("perf-a.csv");
    let json = dir.join("programs.json");
    let _ = std::fs::remove_file(&json);
    let out = Command::new("perf")
        .args(["stat", "-a", "-x,", "-e", "page-faults,minor-faults,major-faults", "-o"])
        .arg(&perf_out)
        .args(["--", OBSERVER, "run", "--every", "0", "--json"])
        .arg(&json)
        .args(["--", workload(), "anon", "--size", "128M"])
        .output()
        .expect("perf not found: run `cargo xtask setup` (installs linux-perf)");
    assert!(out.status.success(), "perf stat -a -- observer run failed: {}", String::from_utf8_lossy(&out.stderr));
    let perf_text = std::fs::read_to_string(&perf_out).unwrap();
    let phase: serde_json::Value = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["kind"] == "anon")
        .expect("the workload's anon phase line");
    let own = u(&phase, "minflt");
    assert!(own >= 32_000, "128 MiB of fresh pages fault at least 32768 times: {phase}");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let progs = v["bpf_programs"].as_array().expect("bpf_programs in the summary (BPF_ENABLE_STATS refused?)");
    let prog = |name: &str| {
        progs.iter().find(|p| p["name"] == name).unwrap_or_else(|| panic!("no program {name} in {progs:?}"))
    };
    for (program, event, lower) in [
        ("fault_entry", "page-faults", own),
        ("fault_exit_min", "minor-faults", own),
        ("fault_exit_maj", "major-faults", 0),
    ] {
        let p = prog(program);
        let (runs, ns) = (u(p, "runs"), u(p, "run_ns"));
        let system = perf_count(&perf_text, event);
        eprintln!("{program}: {runs} runs, {ns} ns; workload {lower}, perf stat -a {event} {system}");
        assert!(runs >= lower, "{program} ran {runs} times, fewer than the workload's own {lower} faults");
        assert!(runs <= system, "{program} ran {runs} times, more than perf stat -a counted {event}: {system}");
        if runs > 0 {
            assert!(ns > 0, "{program}: {runs} runs in 0 ns");
        }
    }
    // The sums the summary prints are the programs' sums.
    let sum = |k: &str| progs.iter().map(|p| u(p, k)).sum::<u64>();
    assert_eq!(u(&v, "bpf_run_count"), sum("runs"));
    assert_eq!(u(&v, "bpf_run_ns"), sum("run_ns"));
}
