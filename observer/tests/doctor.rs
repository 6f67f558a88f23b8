//! `observer doctor`: as root every capability is there; as `nobody` with no
//! capabilities it names each missing one and the unreadable tracefs, and
//! exits 1. Its tracefs line agrees with /proc/mounts; its fault-close line with the kernel's
//! tracepoint and `/proc/cgroups`, and with what `observer run` attaches.

mod common;

use std::process::Command;

use common::*;

fn doctor() -> (i32, String) {
    let out = Command::new(OBSERVER).arg("doctor").output().expect("run observer doctor");
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).into_owned())
}

#[test]
fn doctor_names_what_is_missing() {
    let _l = machine_lock();
    assert_root();
    let (code, said) = doctor();
    for cap in ["CAP_BPF", "CAP_PERFMON", "CAP_DAC_READ_SEARCH"] {
        assert!(said.contains(&format!("ok   capability: {cap}\n")), "{said}");
    }
    let mounted = std::fs::read_to_string("/proc/mounts").unwrap().lines().any(|l| l.contains(" /sys/kernel/tracing "));
    assert_eq!(said.contains("ok   tracefs: mounted at /sys/kernel/tracing"), mounted, "{said}");
    assert_eq!(code == 0, !said.contains("FIX "), "exit {code} vs\n{said}");
    // The fault close it names: what the test expects of this kernel, and what `observer run`
    // attaches (its summary's probes list).
    let memcg = kernel_has_the_memcg_close();
    let line = said.lines().find(|l| l.starts_with("info fault close: ")).unwrap_or_else(|| panic!("{said}"));
    assert_eq!(line.contains("memcg:count_memcg_events"), memcg, "{line}");
    assert_eq!(line.contains("perf events minor-faults/major-faults (no memcg close: "), !memcg, "{line}");
    let r = observe("doctor-close.json", &["--", "true"]);
    let probes: Vec<&str> = r.summary["probes"].as_array().expect("probes").iter().filter_map(|p| p.as_str()).collect();
    assert_eq!(probes.contains(&"raw_tp:memcg:count_memcg_events"), memcg, "{probes:?}");

    let observer_dir = shared_dir("doctor");
    let bin = observer_dir.join("observer");
    std::fs::copy(OBSERVER, &bin).unwrap();
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all", "--bounding-set=-all"])
        .arg(&bin)
        .arg("doctor")
        .output()
        .expect("setpriv");
    let said = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(said.contains("FIX  capability: CAP_BPF — "), "{said}");
    assert!(
        said.contains("FIX  tracefs: readable by this process — it is 0700 root: give CAP_DAC_READ_SEARCH"),
        "{said}"
    );
    assert!(!said.contains("tracepoint:"), "tracepoints are not judged through an unreadable tracefs:\n{said}");
}
