//! Bad input and missing privileges give one clear line and a non-zero exit.

mod common;

use std::process::Command;

use common::*;

fn stderr_of(c: &mut Command) -> (i32, String) {
    let out = c.output().expect("run observer");
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn unknown_pid() {
    assert_root();
    let (code, err) = stderr_of(Command::new(OBSERVER).args(["run", "--pid", "999999999"]));
    assert_ne!(code, 0);
    assert!(err.contains("no process with PID 999999999"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
}

#[test]
fn command_not_found() {
    assert_root();
    let (code, err) = stderr_of(Command::new(OBSERVER).args(["run", "--", "/no/such/program"]));
    assert_ne!(code, 0);
    assert!(err.contains("/no/such/program"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
}

#[test]
fn nothing_to_observe() {
    let (code, err) = stderr_of(Command::new(OBSERVER).args(["run"]));
    assert_ne!(code, 0);
    assert!(err.contains("--pid"), "{err}");
}

#[test]
fn unprivileged_user_is_told_what_to_do() {
    assert_root();
    // Drop to `nobody` with no capabilities (setpriv is in util-linux).
    let observer = shared_copy(OBSERVER);
    let (code, err) = stderr_of(Command::new("setpriv").args([
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
        "--inh-caps=-all",
        &observer,
        "run",
        "--",
        "true",
    ]));
    assert_ne!(code, 0);
    assert!(err.contains("CAP_BPF") && err.contains("root") && err.contains("--fallback"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
}

#[test]
fn a_program_behind_a_private_directory_is_told_as_such() {
    assert_root();
    // A 0700 directory (what `mktemp -d` makes) holding an executable: `nobody`
    // cannot reach it, which is not the same as it being missing.
    let dir = std::path::PathBuf::from(format!("/tmp/moe-observer-private-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    let prog = dir.join("true");
    std::fs::copy("/bin/true", &prog).unwrap();
    let observer = shared_copy(OBSERVER);
    let (code, err) = stderr_of(
        Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all", &observer, "run"])
            .args(["--fallback", "--"])
            .arg(&prog),
    );
    let _ = std::fs::remove_dir_all(&dir);
    assert_ne!(code, 0);
    assert!(err.contains("permission denied") && err.contains("not searchable"), "{err}");
    assert!(!err.contains("no such file"), "{err}");
}

#[test]
fn procfs_fallback_without_privileges() {
    assert_root();
    let _l = testkit::machine_lock();
    let json = format!("/tmp/moe-observer-fallback-{}.json", std::process::id());
    let _ = std::fs::remove_file(&json);
    let (observer, workload) = (shared_copy(OBSERVER), shared_copy(workload()));
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all", &observer, "run", "--fallback"])
        .args(["--window", "200ms", "--json", &json, "--", &workload, "busy", "--ms", "1000"])
        .output()
        .expect("run observer as nobody");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let first = err.lines().next().unwrap_or("");
    assert!(
        first.contains("no eBPF") && first.contains("procfs fallback") && first.contains("not measured"),
        "{first}"
    );
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let _ = std::fs::remove_file(&json);
    assert_eq!(v["mode"], "procfs");
    assert!(v["totals"].is_null(), "fault bracketing was not measured: {}", v["totals"]);
    let toks = v["tokens"].as_array().unwrap();
    assert!(toks.len() >= 4, "200 ms windows over a 1 s run: {}", toks.len());
    for t in toks {
        for k in ["fault_minor_ns", "swapin_zram_ns", "fault_io_ns", "io_wait_ns", "sleep_ns", "majflt_file", "swapins"]
        {
            assert!(t[k].is_null(), "{k} must be not measured, never 0: {t}");
        }
        assert!(t["compute_ns"].is_u64() && t["runqueue_ns"].is_u64() && t["minflt"].is_u64());
    }
    // Against the workload's own accounting (user time, clock-tick resolution).
    let w: serde_json::Value = serde_json::from_str(
        String::from_utf8_lossy(&out.stdout).lines().find(|l| l.starts_with('{')).expect("workload output"),
    )
    .unwrap();
    let compute: u64 = toks.iter().map(|t| t["compute_ns"].as_u64().unwrap()).sum();
    let utime = w["utime_ns"].as_u64().unwrap();
    let tick = 10_000_000 * toks.len() as u64;
    assert!(compute.abs_diff(utime) <= utime / 20 + tick, "compute {compute} vs the workload's user time {utime}");
}
