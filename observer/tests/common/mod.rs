//! Helpers shared by the observer's integration tests. These tests load and
//! attach real eBPF programs: they need root (CI runs as root) and fail, never
//! skip, without it.

#![allow(dead_code, reason = "each test binary uses a different subset")]

use std::{
    path::PathBuf,
    process::{Command, Output},
};

use serde_json::Value;

pub const OBSERVER: &str = env!("CARGO_BIN_EXE_observer");
pub const WORKLOAD: &str = env!("CARGO_BIN_EXE_workload");

/// Serialises every test that loads probes or measures the machine, across
/// test binaries, so that runs do not disturb each other's counters.
pub fn machine_lock() -> testkit::MachineLock {
    assert_root();
    testkit::machine_lock()
}

pub fn assert_root() {
    // SAFETY: no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "the observer's integration tests load eBPF programs and must run as root (CI does): run `sudo cargo xtask test`"
    );
}

/// A scratch directory on the disk (not tmpfs: file refaults must hit a block device).
pub fn scratch_dir(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    std::fs::create_dir_all(&d).expect("create scratch dir");
    d
}

pub struct ObserverRun {
    pub output: Output,
    pub summary: Value,
    /// The workload's own JSON lines from its stdout.
    pub workload: Vec<Value>,
}

/// `observer run --json FILE <args>`; panics with the observer's stderr on failure.
pub fn observe(json_name: &str, args: &[&str]) -> ObserverRun {
    let json = scratch_dir("json").join(json_name);
    let _ = std::fs::remove_file(&json);
    let output = Command::new(OBSERVER)
        .arg("run")
        .arg("--json")
        .arg(&json)
        .args(args)
        .output()
        .expect("run observer");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "observer failed: {}\n{stderr}", output.status);
    let text = std::fs::read_to_string(&json).unwrap_or_else(|e| panic!("no JSON summary ({e}); stderr:\n{stderr}"));
    let summary: Value = serde_json::from_str(&text).expect("summary is JSON");
    let workload = String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).expect("workload JSON line"))
        .collect();
    ObserverRun { output, summary, workload }
}

pub fn u(v: &Value, key: &str) -> u64 {
    v[key].as_u64().unwrap_or_else(|| panic!("missing numeric `{key}` in {v}"))
}

/// Assert |a - b| <= tol * b.
pub fn assert_within(what: &str, observed: u64, reference: u64, tol: f64) {
    let diff = (observed as f64 - reference as f64).abs();
    assert!(
        diff <= tol * reference as f64,
        "{what}: observer {observed} vs reference {reference} (diff {:.2} %, allowed {:.1} %)",
        100.0 * diff / reference.max(1) as f64,
        tol * 100.0
    );
}

/// Names of loaded BPF programs (bpftool is installed by `cargo xtask setup`).
pub fn loaded_programs() -> Vec<String> {
    let out = Command::new("bpftool")
        .args(["prog", "list", "--json"])
        .output()
        .expect("bpftool not found: run `cargo xtask setup`");
    assert!(out.status.success(), "bpftool prog list failed");
    let v: Value = serde_json::from_slice(&out.stdout).expect("bpftool JSON");
    v.as_array()
        .map(|a| a.iter().filter_map(|p| p["name"].as_str().map(String::from)).collect())
        .unwrap_or_default()
}

/// Our programs' names as the kernel shows them (truncated to 15 chars).
pub const OUR_PROGRAMS: &[&str] = &[
    "fault_entry",
    "fault_exit_maj",
    "fault_exit_min",
    "sched_switch",
    "sched_wakeup",
    "sched_exit",
    "sys_enter",
    "sys_exit",
    "reclaim_begin",
    "reclaim_end",
    "bio_queue",
    "bio_complete",
    "rq_complete",
    "filemap_fault",
    "mark_begin",
    "mark_end",
    "sched_exec",
];

pub fn ours_loaded() -> Vec<String> {
    loaded_programs().into_iter().filter(|n| OUR_PROGRAMS.contains(&n.as_str())).collect()
}
