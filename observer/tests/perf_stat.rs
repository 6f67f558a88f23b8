//! Fault counts against `perf stat -e major-faults,minor-faults` attached to
//! the same process for the same span (both attach before the workload's
//! `exec` and stop when it exits).

mod common;

use std::{
    io::{BufRead, BufReader, Write},
    process::{Command, Stdio},
    time::Duration,
};

use common::*;

#[test]
fn fault_counts_match_perf_stat() {
    let _l = machine_lock();
    let dir = scratch_dir("perfstat");
    let file = dir.join("refault.bin");
    let perf_out = dir.join("perf.csv");
    let json = dir.join("obs.json");
    // A shell that waits for a line on stdin, then becomes the workload (same PID).
    let workload = workload();
    let script = format!("read go; exec {workload} demo --size 64M --path {}", file.display());
    let mut target = Command::new("/bin/sh")
        .args(["-c", &script])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn target shell");
    let pid = target.id().to_string();
    let mut perf = Command::new("perf")
        .args(["stat", "-x,", "-e", "major-faults,minor-faults", "-o"])
        .arg(&perf_out)
        .args(["-p", &pid])
        .stderr(Stdio::null())
        .spawn()
        .expect("perf not found: run `cargo xtask setup` (installs linux-perf)");
    let mut obs = Command::new(OBSERVER)
        .args(["run", "--json", json.to_str().unwrap(), "--pid", &pid])
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn observer");
    // Wait until the observer's probes are attached (its first stderr line).
    let mut err = BufReader::new(obs.stderr.take().unwrap());
    let mut first = String::new();
    err.read_line(&mut first).unwrap();
    assert!(first.contains("probes attached"), "observer did not attach: {first}");
    std::thread::sleep(Duration::from_millis(500)); // perf has no readiness signal
    target.stdin.take().unwrap().write_all(b"go\n").unwrap();
    let st = target.wait().unwrap();
    assert!(st.success(), "workload failed");
    let mut rest = String::new();
    let _ = std::io::Read::read_to_string(&mut err, &mut rest);
    assert!(obs.wait().unwrap().success(), "observer failed: {rest}");
    assert!(perf.wait().unwrap().success(), "perf failed");
    let perf_text = std::fs::read_to_string(&perf_out).unwrap();
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
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
