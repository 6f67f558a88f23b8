//! What runs in the guest, and what comes back.
//!
//! **The plan** (`/vmtest/plan` in the initramfs): one test per line, five tab-separated fields:
//! `NAME`, `TIMEOUT` (seconds; the test is killed when it passes), `NEEDS` (features, comma
//! separated, `-` for none), `KIND` (`rust`: a libtest binary run on one test, which passes only
//! when it exits 0 *and* reports `1 passed`, so a misspelt name never passes; `sh`: exit status),
//! `COMMAND` (for `sh -c`). `/vmtest/host-features` adds features the host decides, one per line:
//! `NAME yes|no DETAIL` (e.g. whether the workspace is built for the guest's architecture).
//!
//! **The console protocol** (the guest's `/init`, `init.sh`, prints; [`Report::parse`] reads),
//! one line each:
//! - `VMINFO <key> <text>`: facts (kernel release, CPUs, memory, a module that failed to load,
//!   what a test left behind);
//! - `VMFEATURE <name> yes|no <detail>`: a kernel feature, probed for real in the guest;
//! - `VMTEST <name> pass|fail|not-runnable <detail>`: one per test, `boot` first; a
//!   `not-runnable` test names the features its kernel lacks (`lacks: zram`);
//! - `VMLOG-BEGIN <name>` … `VMLOG-END <name>`: the tail of a failed test's output;
//! - `VMTEST-END <n>`: every plan line was handled.
//!
//! A planned test without a `VMTEST` line (the guest crashed or hit the boot's timeout) is a
//! failure, and so is a result for a test that was not planned: nothing passes by being absent.

use std::collections::BTreeMap;

/// A kernel or build feature a test may need; probed in the guest (`init.sh`), except
/// [`Feature::Build`], which the host decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Feature {
    /// The workspace's binaries and test binaries exist for the guest's architecture.
    Build,
    Btf,
    /// A cgroup2 mount whose root offers the memory controller.
    Cgroup2Memory,
    Psi,
    Zram,
    /// zram's swap-ins go through the block layer (`block_bio_*` tracepoints; Linux 6.3+, when
    /// zram lost `rw_page`).
    ZramBio,
    Cachestat,
    /// The tracepoint `filemap:mm_filemap_fault` (Linux 6.10+).
    MmFilemapFault,
    /// A BPF kprobe program attaches and runs.
    Kprobe,
    /// A BPF fentry program attaches and runs.
    Fentry,
    /// DAMON's sysfs admin tree with operation filters (a scheme restricted to a memory cgroup;
    /// Linux 6.3+).
    DamonFilters,
}

impl Feature {
    pub const ALL: [Feature; 11] = [
        Feature::Build,
        Feature::Btf,
        Feature::Cgroup2Memory,
        Feature::Psi,
        Feature::Zram,
        Feature::ZramBio,
        Feature::Cachestat,
        Feature::MmFilemapFault,
        Feature::Kprobe,
        Feature::Fentry,
        Feature::DamonFilters,
    ];

    /// The name on the console and in the plan.
    pub fn name(self) -> &'static str {
        match self {
            Feature::Build => "build",
            Feature::Btf => "btf",
            Feature::Cgroup2Memory => "cgroup2-memory",
            Feature::Psi => "psi",
            Feature::Zram => "zram",
            Feature::ZramBio => "zram-bio",
            Feature::Cachestat => "cachestat",
            Feature::MmFilemapFault => "mm_filemap_fault",
            Feature::Kprobe => "kprobe",
            Feature::Fentry => "fentry",
            Feature::DamonFilters => "damon-filters",
        }
    }
}

/// Where a test lives: a test target of a workspace package.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Suite {
    /// `observer/tests/<name>.rs`.
    Observer(&'static str),
    /// `memcg/tests/<name>.rs`.
    Memcg(&'static str),
    /// The unit tests of `testkit/src/lib.rs`.
    TestkitLib,
}

impl Suite {
    pub fn package(self) -> &'static str {
        match self {
            Suite::Observer(_) => "observer",
            Suite::Memcg(_) => "memcg",
            Suite::TestkitLib => "testkit",
        }
    }

    /// The cargo target (`--test NAME`, or the library).
    pub fn target(self) -> Option<&'static str> {
        match self {
            Suite::Observer(t) | Suite::Memcg(t) => Some(t),
            Suite::TestkitLib => None,
        }
    }

    pub fn label(self) -> String {
        match self.target() {
            Some(t) => format!("{}/{t}", self.package()),
            None => format!("{}/lib", self.package()),
        }
    }
}

/// A test of the workspace that runs unchanged in the guest.
#[derive(Debug, Clone, Copy)]
pub struct GuestTest {
    pub suite: Suite,
    /// The test's path inside its binary (`--exact`).
    pub test: &'static str,
    pub needs: &'static [Feature],
    pub timeout_s: u32,
    /// Part of `--smoke`.
    pub smoke: bool,
}

impl GuestTest {
    pub fn name(&self) -> String {
        format!("{}::{}", self.suite.label(), self.test)
    }
}

use Feature::{Btf, Build, Cachestat, Cgroup2Memory, DamonFilters, Zram};

const fn t(suite: Suite, test: &'static str, needs: &'static [Feature], timeout_s: u32, smoke: bool) -> GuestTest {
    GuestTest { suite, test, needs, timeout_s, smoke }
}

const FAULTS: Suite = Suite::Observer("faults");
const ATTRIB: Suite = Suite::Observer("attribution");
const CGROUP: Suite = Suite::Observer("cgroup");
const RESID: Suite = Suite::Observer("residency");
const PERF: Suite = Suite::Observer("perf_stat");
const ENGINE: Suite = Suite::Observer("engine");
const MEMCG: Suite = Suite::Memcg("real");
const EVICTION: Suite = Suite::Observer("eviction");

/// The guest suite. Each test compares the observer (or the memcg crate) with an independent
/// source on the same run; they are the repository's own tests, run unchanged.
pub const TESTS: &[GuestTest] = &[
    // Attach and detach: the probes are held while it runs and nothing stays loaded (bpftool).
    t(FAULTS, "nothing_stays_loaded_after_exit", &[Build], 300, true),
    // Fault counts against the workload's getrusage.
    t(FAULTS, "anonymous_minor_faults_match_getrusage", &[Build], 600, true),
    t(FAULTS, "file_refaults_match_getrusage", &[Build], 900, false),
    t(FAULTS, "per_thread_rows_add_up", &[Build], 600, false),
    // Compute against schedstat, sleep against the clock, refaults against the block layer.
    t(ATTRIB, "busy_loop_is_compute", &[Build], 300, false),
    t(ATTRIB, "sleep_is_sleep", &[Build], 300, false),
    t(ATTRIB, "file_refaults_are_fault_io", &[Build], 900, false),
    // zram swap-ins against /proc/vmstat pswpin, under a cgroup v2 limit.
    t(ATTRIB, "zram_swapins_are_measured_and_not_compute", &[Build, Zram, Cgroup2Memory], 900, false),
    // Token markers found through a wrapper's exec.
    t(ATTRIB, "markers_are_found_after_a_wrapper_execs", &[Build], 300, false),
    // The memcg crate's real tests, on the v2 backend: a limit, a limit hit from page cache, an
    // OOM kill against /proc/vmstat oom_kill, memory.peak, memory.reclaim, members, removal.
    t(MEMCG, "a_real_group_limits_counts_places_oom_kills_and_goes", &[Build, Cgroup2Memory], 600, true),
    t(MEMCG, "detect_finds_this_machines_memory_controller", &[Build, Cgroup2Memory], 120, false),
    t(MEMCG, "v2_members_child_join_cgroup_kill_and_rmdir_for_real", &[Build, Cgroup2Memory], 300, false),
    // testkit's pressure pieces (zram swap, a v2 group with a limit, a balloon) restore the guest.
    t(Suite::TestkitLib, "tests::zram_and_cgroup_are_restored", &[Build, Zram, Cgroup2Memory], 300, false),
    t(Suite::TestkitLib, "tests::balloon_fills_its_cgroup_and_dies_on_drop", &[Build, Cgroup2Memory], 300, false),
    // observer run --cgroup on v2: placement and the OOM report against /proc/vmstat oom_kill.
    t(CGROUP, "the_child_joins_a_v1_or_v2_group_and_the_observer_does_not", &[Build, Cgroup2Memory], 300, false),
    t(CGROUP, "an_oom_kill_of_the_target_is_reported", &[Build, Cgroup2Memory], 600, false),
    t(
        CGROUP,
        "an_oom_kill_of_another_process_in_the_group_is_not_blamed_on_the_target",
        &[Build, Cgroup2Memory],
        600,
        false,
    ),
    // Fault counts against perf stat on the same process and span.
    t(PERF, "fault_counts_match_perf_stat", &[Build], 600, false),
    // Kernel-mode faults on user memory opened and timed: on x86 by the raw tracepoint
    // `exceptions:page_fault_kernel` (against perf stat's count of it), on arm64 by `page-faults`.
    t(PERF, "kernel_mode_faults_on_user_memory_are_opened_and_timed", &[Build], 600, false),
    // Residency against fincore (and cachestat, which the test also checks), mincore, and the
    // filemap tracepoints' churn.
    t(RESID, "whole_file_residency_equals_fincore", &[Build, Cachestat], 600, false),
    t(
        RESID,
        "evicting_experts_makes_exactly_those_cells_cold_and_touching_one_makes_only_it_warm",
        &[Build],
        600,
        false,
    ),
    t(RESID, "churn_per_region_matches_mincore_deltas_exactly", &[Build], 600, false),
    // The engine's token markers under the observer: a record per token, components adding up,
    // faults against perf stat. (The engine's SIMD kernels are slow under TCG: the tiny model
    // decodes a token in about a second, a 70 MiB one in 7.5 s, too slow for the residency tests
    // of `dense_copy`.)
    t(ENGINE, "engine_tokens_components_and_perf_stat", &[Build], 900, false),
    // Eviction blame on cgroup v2 (this repository's development VM has memory on v1): the
    // reclaim of a memcg at its limit, by the engine itself (its row's cgroup v2 ID and memcg path
    // against the group's directory and /proc/PID/cgroup), by a shell lowering `memory.max`, and
    // `memory.reclaim`; each against fincore. The kernel side reads the actor's system call
    // through BTF (`bpf_task_pt_regs`).
    t(EVICTION, "the_engines_own_memcg_limit_blames_the_engine", &[Build, Btf, Cgroup2Memory], 900, false),
    t(EVICTION, "lowering_a_memcg_limit_blames_the_process_that_wrote_it", &[Build, Btf, Cgroup2Memory], 900, false),
    t(EVICTION, "proactive_reclaim_of_a_memcg_blames_the_writer", &[Build, Btf, Cgroup2Memory], 900, false),
    // The other actors, each against fincore and its own count: fadvise and drop_caches by a named
    // process; kswapd under global pressure (pgsteal_kswapd); another process's direct reclaim
    // (pgsteal_direct, ftrace's vmscan events; kswapd starved on one of the guest's two CPUs); a
    // DAMON pageout kdamond of the test's own (DAMON's sz_applied), restricted to the test's
    // cgroup v2 group.
    t(EVICTION, "fadvise_dontneed_by_a_named_process_is_blamed_on_it", &[Build, Btf], 600, false),
    t(EVICTION, "drop_caches_by_a_shell_is_blamed_as_truncation_by_its_write", &[Build, Btf], 600, false),
    t(EVICTION, "kswapd_under_global_pressure_is_blamed_on_kswapd", &[Build, Btf, Cgroup2Memory], 900, false),
    t(EVICTION, "global_direct_reclaim_is_blamed_on_the_allocating_process", &[Build, Btf, Cgroup2Memory], 900, false),
    t(EVICTION, "damon_pageout_is_blamed_on_kdamond", &[Build, Btf, Cgroup2Memory, DamonFilters], 900, false),
    // Refaults closed into the loop, per actor and per token, with their fault_io.
    t(EVICTION, "pages_read_again_after_an_eviction_are_refaults_of_its_actor", &[Build, Btf], 600, false),
    t(EVICTION, "each_token_carries_its_refaults_and_their_fault_io", &[Build, Btf], 900, false),
];

/// The plan's lines for `tests`, each running `command(test)`.
pub fn plan_text(tests: &[GuestTest], command: impl Fn(&GuestTest) -> String) -> String {
    let mut s = String::new();
    for t in tests {
        let needs: Vec<&str> = t.needs.iter().map(|f| f.name()).collect();
        let needs = if needs.is_empty() { "-".to_string() } else { needs.join(",") };
        s.push_str(&format!("{}\t{}\t{needs}\trust\t{}\n", t.name(), t.timeout_s, command(t)));
    }
    s
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Pass,
    Fail,
    NotRunnable,
}

impl Outcome {
    pub fn word(self) -> &'static str {
        match self {
            Outcome::Pass => "pass",
            Outcome::Fail => "fail",
            Outcome::NotRunnable => "not-runnable",
        }
    }
}

const KEYWORDS: [&str; 6] = ["VMLOG-END ", "VMLOG-BEGIN ", "VMTEST-END ", "VMTEST ", "VMFEATURE ", "VMINFO "];

/// What one boot reported.
#[derive(Debug, Default)]
pub struct Report {
    pub info: Vec<(String, String)>,
    /// name → (present, detail).
    pub features: BTreeMap<String, (bool, String)>,
    /// In the order reported: name, outcome, detail.
    pub results: Vec<(String, Outcome, String)>,
    /// name → the tail of its output (failed tests).
    pub logs: BTreeMap<String, String>,
    /// `VMTEST-END` was seen.
    pub ended: bool,
}

impl Report {
    pub fn parse(console: &str) -> Report {
        let mut r = Report::default();
        let mut log: Option<(String, String)> = None;
        for raw in console.lines() {
            // A kernel message may share the line; the protocol starts where its keyword does.
            let l = KEYWORDS.iter().filter_map(|k| raw.find(k)).min().map(|i| &raw[i..]);
            if let Some((name, text)) = &mut log {
                if l.is_some_and(|l| l.strip_prefix("VMLOG-END ") == Some(name.as_str())) {
                    r.logs.insert(name.clone(), std::mem::take(text));
                    log = None;
                } else {
                    text.push_str(raw);
                    text.push('\n');
                }
                continue;
            }
            let Some(l) = l else { continue };
            let mut w = l.splitn(4, ' ');
            match (w.next(), w.next(), w.next(), w.next()) {
                (Some("VMINFO"), Some(k), v, rest) => {
                    let v = [v, rest].into_iter().flatten().collect::<Vec<_>>().join(" ");
                    r.info.push((k.to_string(), v));
                }
                (Some("VMFEATURE"), Some(name), Some(ok), detail) => {
                    r.features.insert(name.to_string(), (ok == "yes", detail.unwrap_or("").to_string()));
                }
                (Some("VMTEST"), Some(name), Some(outcome), detail) => {
                    let o = match outcome {
                        "pass" => Outcome::Pass,
                        "not-runnable" => Outcome::NotRunnable,
                        _ => Outcome::Fail,
                    };
                    let detail = if o == Outcome::Fail && outcome != "fail" {
                        format!("unknown outcome `{outcome}`: {}", detail.unwrap_or(""))
                    } else {
                        detail.unwrap_or("").to_string()
                    };
                    r.results.push((name.to_string(), o, detail));
                }
                (Some("VMLOG-BEGIN"), Some(name), ..) => log = Some((name.to_string(), String::new())),
                (Some("VMTEST-END"), ..) => r.ended = true,
                _ => {}
            }
        }
        r
    }

    /// One result per expected name (`boot` first, then the plan's), in that order: what the guest
    /// said, or a failure saying why it said nothing (`why_silent`); then a failure for every
    /// result nobody planned.
    pub fn reconcile(&self, planned: &[String], why_silent: &str) -> Vec<(String, Outcome, String)> {
        let mut out = Vec::new();
        let expected: Vec<String> = std::iter::once("boot".to_string()).chain(planned.iter().cloned()).collect();
        for name in &expected {
            let got: Vec<_> = self.results.iter().filter(|(n, ..)| n == name).collect();
            match got.as_slice() {
                [] => out.push((name.clone(), Outcome::Fail, format!("no result: {why_silent}"))),
                [(_, o, d)] => out.push((name.clone(), *o, d.clone())),
                more => out.push((name.clone(), Outcome::Fail, format!("{} results for one test", more.len()))),
            }
        }
        for (name, o, d) in &self.results {
            if !expected.contains(name) {
                out.push((name.clone(), Outcome::Fail, format!("not planned, reported {}: {d}", o.word())));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_smoke_is_the_issues_subset() {
        let mut names: Vec<String> = TESTS.iter().map(GuestTest::name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), TESTS.len());
        let smoke: Vec<&str> = TESTS.iter().filter(|t| t.smoke).map(|t| t.test).collect();
        assert_eq!(
            smoke,
            [
                "nothing_stays_loaded_after_exit",
                "anonymous_minor_faults_match_getrusage",
                "a_real_group_limits_counts_places_oom_kills_and_goes"
            ]
        );
        for t in TESTS {
            assert!(t.needs.contains(&Feature::Build), "{} runs a binary of the workspace", t.name());
        }
    }

    #[test]
    fn plan_lines_have_five_fields() {
        let text = plan_text(&TESTS[..2], |t| format!("run {}", t.test));
        let lines: Vec<Vec<&str>> = text.lines().map(|l| l.split('\t').collect()).collect();
        assert_eq!(
            lines[0],
            [
                "observer/faults::nothing_stays_loaded_after_exit",
                "300",
                "build",
                "rust",
                "run nothing_stays_loaded_after_exit"
            ]
        );
        assert_eq!(lines.len(), 2);
    }

    #[test]
    fn console_lines_are_parsed_and_silence_is_a_failure() {
        let console = "\
SeaBIOS
VMINFO kernel 6.1.0-57-cloud-amd64
VMTEST boot pass 6.1.0-57-cloud-amd64 up, init at 2.1 s
[    3.2] random: crng init doneVMFEATURE kprobe yes a kprobe program on vfs_read ran 12 times
VMFEATURE fentry no bpftool could not load it
VMTEST a pass 1.0s
VMTEST b fail 2.0s exit 101: assertion failed
VMLOG-BEGIN b
thread 'x' panicked at src/lib.rs:1:1:
VMLOG-END b
VMTEST c not-runnable lacks: zram
VMTEST x pass 1s
";
        let r = Report::parse(console);
        assert!(!r.ended);
        assert_eq!(r.info[0], ("kernel".into(), "6.1.0-57-cloud-amd64".into()));
        assert_eq!(r.features["kprobe"], (true, "a kprobe program on vfs_read ran 12 times".into()));
        assert!(!r.features["fentry"].0);
        assert_eq!(r.logs["b"], "thread 'x' panicked at src/lib.rs:1:1:\n");
        let planned: Vec<String> = ["a", "b", "c", "d"].map(String::from).to_vec();
        let got = r.reconcile(&planned, "QEMU killed at the 60 s timeout");
        let outcomes: Vec<(&str, Outcome)> = got.iter().map(|(n, o, _)| (n.as_str(), *o)).collect();
        assert_eq!(
            outcomes,
            [
                ("boot", Outcome::Pass),
                ("a", Outcome::Pass),
                ("b", Outcome::Fail),
                ("c", Outcome::NotRunnable),
                ("d", Outcome::Fail),
                ("x", Outcome::Fail),
            ]
        );
        assert_eq!(got[4].2, "no result: QEMU killed at the 60 s timeout");
        assert!(got[5].2.starts_with("not planned"));
        assert!(Report::parse("VMTEST-END 3\n").ended);
    }
}
