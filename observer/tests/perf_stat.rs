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

/// Whether this kernel has the raw tracepoints the observer opens faults with (x86's
/// `exceptions:page_fault_user` / `page_fault_kernel`); the perf event `page-faults` otherwise.
fn raw_fault_entries() -> bool {
    ["page_fault_user", "page_fault_kernel"]
        .iter()
        .all(|tp| std::path::Path::new("/sys/kernel/tracing/events/exceptions").join(tp).exists())
}

/// `perf stat -a` (the fault events, and the tracepoints the fault programs use where the kernel
/// has them) around `observer run --bpf-stats … extra -- workload anon --size 128M`: perf's text,
/// the workload's own fault count (getrusage around its phase) and the observer's summary.
fn observed_beside_perf_stat_system_wide(name: &str, extra: &[&str]) -> (String, u64, serde_json::Value) {
    let dir = scratch_dir("perfstat");
    let perf_out = dir.join(format!("{name}-perf-a.csv"));
    let json = dir.join(format!("{name}.json"));
    let _ = std::fs::remove_file(&json);
    let mut events = "page-faults,minor-faults,major-faults".to_string();
    if raw_fault_entries() {
        events += ",exceptions:page_fault_user,exceptions:page_fault_kernel";
    }
    if kernel_has_the_memcg_close() {
        events += ",memcg:count_memcg_events";
    }
    let out = Command::new("perf")
        .args(["stat", "-a", "-x,", "-e", &events, "-o"])
        .arg(&perf_out)
        .args(["--", OBSERVER, "run", "--bpf-stats", "--every", "0", "--json"])
        .arg(&json)
        .args(extra)
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
    (perf_text, own, v)
}

/// The kernel's own run counts of the fault programs (`bpf_programs` in the summary, from
/// `BPF_ENABLE_STATS` and each program's `bpf_prog_info`) against two independent counts of
/// the same events: at least the faults the workload counted itself (getrusage around its
/// phase, all taken while the programs were attached), at most what `perf stat -a` counted on
/// every CPU over a span that encloses the observer's whole run (the perf software events, and
/// the `exceptions` tracepoints where the observer opens faults with them).
#[test]
fn per_program_bpf_run_counts_lie_between_the_workloads_faults_and_perf_stat_system_wide() {
    let _l = machine_lock();
    let (raw, memcg) = (raw_fault_entries(), kernel_has_the_memcg_close());
    let (perf_text, own, v) = observed_beside_perf_stat_system_wide("programs", &[]);
    let progs = v["bpf_programs"].as_array().expect("bpf_programs in the summary (BPF_ENABLE_STATS refused?)");
    let prog = |name: &str| {
        progs.iter().find(|p| p["name"] == name).unwrap_or_else(|| panic!("no program {name} in {progs:?}"))
    };
    let probes: Vec<&str> = v["probes"].as_array().unwrap().iter().filter_map(|p| p.as_str()).collect();
    let mut checks = vec![("fault_exit_maj", "major-faults", 0)];
    if memcg {
        // The memcg close runs for every memcg event counted (PGPGIN too on cgroup v1), each
        // fault's PGFAULT among them; the perf close is not attached.
        checks.push(("fault_memcg", "memcg:count_memcg_events", own));
        assert!(probes.contains(&"raw_tp:memcg:count_memcg_events"), "{probes:?}");
        assert!(!probes.contains(&"perf:minor-faults"), "both closes attached: {probes:?}");
    } else {
        checks.push(("fault_exit_min", "minor-faults", own));
        assert!(probes.contains(&"perf:minor-faults"), "{probes:?}");
    }
    if raw {
        // The user-mode entries; kernel-mode ones run for kernel addresses too (and return).
        checks.push(("fault_entry_user", "exceptions:page_fault_user", own));
        checks.push(("fault_entry_kernel", "exceptions:page_fault_kernel", 0));
        assert!(probes.contains(&"raw_tp:exceptions:page_fault_user"), "{probes:?}");
        assert!(!probes.contains(&"perf:page-faults"), "both entries attached: {probes:?}");
        let perf_entry = progs.iter().find(|p| p["name"] == "fault_entry");
        assert!(perf_entry.is_none(), "the perf-event entry loaded beside the raw tracepoints: {perf_entry:?}");
    } else {
        checks.push(("fault_entry", "page-faults", own));
        assert!(probes.contains(&"perf:page-faults"), "{probes:?}");
    }
    for (program, event, lower) in checks {
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

/// `bench storm`'s floor (`observer run --fault-dispatch-only`): the fault hooks (x86's raw
/// entries, and the memcg close where the kernel has it) run `fault_floor`, a program that
/// returns at once, and none of the fault programs is loaded. Its run count is each hook's: at
/// least once per fault of the workload per hook (getrusage), at most what `perf stat -a` counted
/// of those events over the whole run; and the observer counts no fault.
#[test]
fn the_dispatch_floor_runs_an_empty_program_on_every_fault_hook_and_counts_nothing() {
    let _l = machine_lock();
    assert!(
        raw_fault_entries(),
        "--fault-dispatch-only measures x86's raw fault entries; this kernel has no exceptions:page_fault_user"
    );
    let memcg = kernel_has_the_memcg_close();
    let (perf_text, own, v) = observed_beside_perf_stat_system_wide("floor", &["--fault-dispatch-only"]);
    let probes: Vec<&str> = v["probes"].as_array().unwrap().iter().filter_map(|p| p.as_str()).collect();
    let mut hooks = vec![("exceptions:page_fault_user", own), ("exceptions:page_fault_kernel", 0)];
    if memcg {
        hooks.push(("memcg:count_memcg_events", own));
    }
    for (event, _) in &hooks {
        let probe = format!("raw_tp:{event} (dispatch only)");
        assert!(probes.contains(&probe.as_str()), "{probe} not in {probes:?}");
    }
    let progs = v["bpf_programs"].as_array().expect("bpf_programs in the summary (BPF_ENABLE_STATS refused?)");
    for name in ["fault_entry_user", "fault_entry_kernel", "fault_memcg", "fault_entry", "fault_exit_min"] {
        assert!(progs.iter().all(|p| p["name"] != name), "{name} loaded under the floor: {progs:?}");
    }
    let floor =
        progs.iter().find(|p| p["name"] == "fault_floor").unwrap_or_else(|| panic!("no fault_floor in {progs:?}"));
    let runs = u(floor, "runs");
    let (lower, upper): (u64, u64) =
        hooks.iter().fold((0, 0), |(lo, hi), (event, own)| (lo + own, hi + perf_count(&perf_text, event)));
    eprintln!("fault_floor: {runs} runs; the workload's faults × hooks {lower}, perf stat -a {upper}");
    assert!(runs >= lower, "fault_floor ran {runs} times, fewer than the workload's faults on each hook ({lower})");
    assert!(runs <= upper, "fault_floor ran {runs} times, more than perf stat -a counted on its hooks ({upper})");
    let totals = &v["totals"];
    assert_eq!(u(totals, "minflt") + u(totals, "majflt"), 0, "faults counted under the floor: {totals}");
}

/// Faults taken in kernel mode on the target's memory (`dd` reading `/dev/zero` into its fresh
/// 64 MiB buffer: the kernel's copy faults every page) are opened and timed like user-mode ones:
/// every exit finds its entry. On x86 `perf stat` counts them as `exceptions:page_fault_kernel`
/// for the same process, the tracepoint whose raw program opens them.
#[test]
fn kernel_mode_faults_on_user_memory_are_opened_and_timed() {
    let _l = machine_lock();
    let dir = scratch_dir("perfstat");
    let perf_out = dir.join("perf-kernel-mode.csv");
    let json = dir.join("kernel-mode.json");
    let _ = std::fs::remove_file(&json);
    let dd = ["dd", "if=/dev/zero", "of=/dev/null", "bs=64M", "count=1", "status=none"];
    let mut c = Command::new(OBSERVER);
    c.args(["run", "--every", "0", "--json"]).arg(&json).arg("--");
    if raw_fault_entries() {
        c.args(["perf", "stat", "-x,", "-e", "exceptions:page_fault_kernel", "-o"]).arg(&perf_out).arg("--");
    }
    // One fault per 4 KiB page: no transparent huge pages for dd's buffer (a kernel with THP
    // `always`, as Debian's 6.12 guest has, fills it with 2 MiB faults). The flag is inherited
    // by the observer and the command it starts.
    // SAFETY: prctl in the child between fork and exec; it allocates nothing.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut c, || {
            if libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let out = c.args(dd).output().expect("run observer");
    assert!(out.status.success(), "observer run -- dd: {}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let t = &v["totals"];
    let pages = 64 << 20 >> 12;
    assert!(u(t, "minflt") >= pages, "{t}");
    assert_eq!(u(t, "unmatched_exits"), 0, "faults closed without an entry: {t}");
    assert!(u(t, "minflt_ns") > 0, "{t}");
    if raw_fault_entries() {
        let kernel_mode = perf_count(&std::fs::read_to_string(&perf_out).unwrap(), "exceptions:page_fault_kernel");
        assert!(
            kernel_mode >= pages,
            "perf stat counted {kernel_mode} kernel-mode faults of dd, not its buffer's {pages}"
        );
    }
}

/// Sets `kernel.bpf_stats_enabled` for a test and puts the host's value back when dropped.
struct StatsSysctl(String);

const STATS_SYSCTL: &str = "/proc/sys/kernel/bpf_stats_enabled";

impl StatsSysctl {
    fn set(v: &str) -> Self {
        let old = std::fs::read_to_string(STATS_SYSCTL).expect("reading kernel.bpf_stats_enabled (Linux >= 5.8)");
        std::fs::write(STATS_SYSCTL, v).expect("writing kernel.bpf_stats_enabled (root)");
        StatsSysctl(old.trim().to_string())
    }
}

impl Drop for StatsSysctl {
    fn drop(&mut self) {
        let _ = std::fs::write(STATS_SYSCTL, &self.0);
    }
}

/// The kernel's BPF statistics cost every program run two clock reads, so `observer run` turns
/// them on only with `--bpf-stats` (or reads them when the host has them on). The target, the
/// observer's child, looks while observed: how many `bpf-stats` descriptors (`BPF_ENABLE_STATS`)
/// its parent holds, and `kernel.bpf_stats_enabled`: none without the flag (and no cost in the
/// summary), one with it (and the cost there), none and the host's 1 when the host has them on.
#[test]
fn bpf_statistics_are_on_only_with_bpf_stats_or_when_the_host_has_them_on() {
    let _l = machine_lock();
    let _host = StatsSysctl::set("0");
    let target =
        format!("ls -l /proc/$PPID/fd | grep -c bpf-stats; cat {STATS_SYSCTL}; exec {} anon --size 16M", workload());
    // (descriptors held by the observer, the sysctl) as the target saw them.
    let seen = |r: &ObserverRun| {
        let out = String::from_utf8_lossy(&r.output.stdout).into_owned();
        let mut l = out.lines().map(str::to_string);
        (l.next().unwrap_or_default(), l.next().unwrap_or_default())
    };
    let pair = |a: &str, b: &str| (a.to_string(), b.to_string());

    let off = observe("stats-off.json", &["--every", "0", "--", "sh", "-c", &target]);
    assert_eq!(seen(&off), pair("0", "0"), "without --bpf-stats the statistics were on during the run");
    for k in ["bpf_run_ns", "bpf_run_count"] {
        assert!(off.summary[k].is_null(), "{k} without the statistics: {}", off.summary[k]);
    }
    assert!(off.summary["bpf_programs"].as_array().is_none_or(|a| a.is_empty()), "{}", off.summary["bpf_programs"]);

    let on = observe("stats-on.json", &["--bpf-stats", "--every", "0", "--", "sh", "-c", &target]);
    assert_eq!(seen(&on), pair("1", "0"), "--bpf-stats did not turn the statistics on");
    assert!(u(&on.summary, "bpf_run_count") > 0 && u(&on.summary, "bpf_run_ns") > 0, "{}", on.summary);

    // On for the host: read, and left on.
    let _on = StatsSysctl::set("1");
    let host = observe("stats-host.json", &["--every", "0", "--", "sh", "-c", &target]);
    assert_eq!(seen(&host), pair("0", "1"));
    assert!(u(&host.summary, "bpf_run_count") > 0, "the host's statistics were not read: {}", host.summary);
    assert_eq!(std::fs::read_to_string(STATS_SYSCTL).unwrap().trim(), "1", "the host's setting was changed");
}

/// perf beside the observer (README, "While the observer runs, …"): `perf stat -a` of
/// `sched:sched_switch`, `raw_syscalls:sys_enter` and `sched:sched_process_exit` over a switch
/// storm (20 000 round trips between two threads: 2 switches and 4 syscalls each) run while
/// `observer run` is attached to another process. The events the observer takes through raw or
/// BTF tracepoints reach perf too (at least the storm's own), and one it takes through a perf
/// tracepoint does not (a BPF program on it that returns 0 keeps the event from every perf
/// listener: `sched_process_exit`, the storm's own exit among them; under `--sched-hooks
/// tracepoint` the switches too). Which way each goes is read from the run's own list of probes.
#[test]
fn perf_sees_the_events_the_observer_takes_through_raw_tracepoints_and_not_its_perf_tracepoints() {
    let _l = machine_lock();
    let dir = scratch_dir("perfbeside");
    const EXCHANGES: u64 = 20_000;
    for hooks in ["auto", "tracepoint"] {
        let json = dir.join(format!("{hooks}.json"));
        let mut obs = Command::new(OBSERVER)
            .args(["run", "--sched-hooks", hooks, "--force", "--json"])
            .arg(&json)
            .args(["--", workload(), "sleep", "--ms", "60000"])
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("observer");
        let mut err = std::io::BufReader::new(obs.stderr.take().unwrap());
        let mut seen = wait_attached(&mut err);
        let perf_out = dir.join(format!("{hooks}-perf-a.csv"));
        let perf = Command::new("perf")
            .args(["stat", "-a", "-x,", "-e", "sched:sched_switch,raw_syscalls:sys_enter,sched:sched_process_exit"])
            .arg("-o")
            .arg(&perf_out)
            .args(["--", workload(), "switch-storm", "--exchanges", &EXCHANGES.to_string()])
            .output()
            .expect("perf not found: run `cargo xtask setup` (installs linux-perf)");
        // SAFETY: kill(2) of our own child.
        unsafe { libc::kill(obs.id() as i32, libc::SIGINT) };
        std::io::Read::read_to_string(&mut err, &mut seen).unwrap();
        // Its status is the interrupted target's; the summary is written either way.
        let _ = obs.wait().unwrap();
        assert!(perf.status.success(), "perf stat -a failed: {}", String::from_utf8_lossy(&perf.stderr));
        let perf_text = std::fs::read_to_string(&perf_out).unwrap();
        let summary =
            std::fs::read_to_string(&json).unwrap_or_else(|e| panic!("{}: {e}; observer: {seen}", json.display()));
        let v: serde_json::Value = serde_json::from_str(&summary).unwrap();
        let probes: Vec<&str> = v["probes"].as_array().unwrap().iter().filter_map(|p| p.as_str()).collect();
        // Taken through perf tracepoints (hidden from perf) or not, by the observer's own list.
        let hidden = |event: &str| probes.contains(&format!("tp:{event}").as_str());
        assert!(hidden("sched:sched_process_exit"), "--sched-hooks {hooks}: {probes:?}");
        assert!(!hidden("raw_syscalls:sys_enter"), "syscalls go through raw tracepoints: {probes:?}");
        assert_eq!(hidden("sched:sched_switch"), hooks == "tracepoint", "--sched-hooks {hooks}: {probes:?}");
        for (event, at_least) in [
            ("sched:sched_switch", 2 * EXCHANGES),
            ("raw_syscalls:sys_enter", 4 * EXCHANGES),
            ("sched:sched_process_exit", 1),
        ] {
            let n = perf_count(&perf_text, event);
            eprintln!("--sched-hooks {hooks}: perf counted {n} {event}");
            if hidden(event) {
                assert_eq!(n, 0, "--sched-hooks {hooks}: {event} is hidden from perf while observed: {perf_text}");
            } else {
                assert!(n >= at_least, "--sched-hooks {hooks}: perf sees {event}: {n} < {at_least}: {perf_text}");
            }
        }
    }
}
