//! `observer run --cgroup DIR`: a cgroup v1 or v2 directory (told apart by its filesystem), with
//! only the spawned child placed there, and an OOM kill under the group's limit reported after the
//! run: of the target, or of another process in the group. Checked against the kernel's own
//! accounts: the child's /proc/PID/cgroup, and /proc/vmstat `oom_kill`.

mod common;

use std::{
    path::{Path, PathBuf},
    process::{Command, Output},
    time::{Duration, Instant},
};

use common::*;

fn observer_run(args: &[&str]) -> (Output, String) {
    let out = Command::new(OBSERVER).arg("run").args(args).output().expect("run observer");
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    (out, err)
}

fn oom_kills() -> u64 {
    testkit::vmstat("oom_kill").expect("/proc/vmstat has oom_kill (Linux 4.13+)")
}

#[test]
fn an_oom_kill_of_the_target_is_reported() {
    let _l = machine_lock();
    let cg = testkit::MemCgroup::new("obs-oom", 48 << 20).expect("memory cgroup");
    cg.group().set_swap_limit(Some(0)).expect("no swap for the group: beyond the limit is out of memory");
    let dir = cg.dir().to_str().unwrap().to_string();
    let oom0 = oom_kills();
    let (out, err) = observer_run(&["--every", "0", "--cgroup", &dir, "--", workload(), "anon", "--size", "512M"]);
    let machine = oom_kills() - oom0;
    assert_eq!(out.status.code(), Some(128 + libc::SIGKILL), "the target's end, as the observer returns it:\n{err}");
    assert!(machine >= 1, "/proc/vmstat oom_kill did not move: was the workload OOM-killed?\n{err}");
    let line = err.lines().find(|l| l.contains("OOM killer")).unwrap_or_else(|| panic!("no OOM line:\n{err}"));
    assert!(
        line.starts_with(&format!("observer: warning: the target was killed by the OOM killer of its cgroup {dir} (")),
        "{line}"
    );
    assert!(line.contains(&format!("{}: 1 OOM kill(s) there", cg.group().version())), "{line}");
    assert!(line.contains("its memory limit is 48.0 MiB"), "{line}");
}

#[test]
fn an_oom_kill_of_another_process_in_the_group_is_not_blamed_on_the_target() {
    let _l = machine_lock();
    let cg = testkit::MemCgroup::new("obs-oom-other", 48 << 20).expect("memory cgroup");
    cg.group().set_swap_limit(Some(0)).expect("no swap for the group");
    let dir = cg.dir().to_str().unwrap().to_string();
    let oom0 = oom_kills();
    let observer = Command::new(OBSERVER)
        .args(["run", "--every", "0", "--cgroup", &dir, "--", workload(), "sleep", "--ms", "4000"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run observer");
    // Once the target is in the group, the observer has read the counter.
    let start = Instant::now();
    while cg.group().procs().unwrap().is_empty() {
        assert!(start.elapsed() < Duration::from_secs(30), "the target never joined {dir}");
        std::thread::sleep(Duration::from_millis(20));
    }
    let hog = cg.wrap(&["dd", "if=/dev/zero", "of=/dev/null", "bs=256M", "count=1"]);
    let st = Command::new(&hog[0]).args(&hog[1..]).stderr(std::process::Stdio::null()).status().unwrap();
    assert_eq!(std::os::unix::process::ExitStatusExt::signal(&st), Some(libc::SIGKILL), "the hog was not OOM-killed");
    let out = observer.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the target survived:\n{err}");
    assert!(oom_kills() > oom0, "/proc/vmstat oom_kill did not move");
    let line = err.lines().find(|l| l.contains("OOM killer")).unwrap_or_else(|| panic!("no OOM line:\n{err}"));
    assert!(
        line.starts_with(&format!(
            "observer: warning: the OOM killer of the cgroup {dir} killed 1 process(es) there during the run, not the target"
        )),
        "{line}"
    );
}

/// This machine's cgroup2 mount point.
fn cgroup2_mount() -> PathBuf {
    let mi = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    mi.lines()
        .find(|l| l.split_once(" - ").is_some_and(|(_, r)| r.starts_with("cgroup2 ")))
        .and_then(|l| l.split(' ').nth(4))
        .map(PathBuf::from)
        .expect("no cgroup2 mount: mount one with `mount -t cgroup2 none /sys/fs/cgroup/unified`")
}

/// `observer run --cgroup DIR -- cat /proc/self/cgroup`: the target's own view of its cgroups.
fn cgroups_of_target(dir: &Path) -> (String, String) {
    let (out, err) = observer_run(&["--cgroup", dir.to_str().unwrap(), "--", "cat", "/proc/self/cgroup"]);
    assert!(out.status.success(), "observer failed:\n{err}");
    (String::from_utf8_lossy(&out.stdout).into_owned(), err)
}

#[test]
fn the_child_joins_a_v1_or_v2_group_and_the_observer_does_not() {
    let _l = machine_lock();
    let mine = std::fs::read_to_string("/proc/self/cgroup").unwrap();
    // This machine's memory cgroup (v1 on the development VM, v2 on a v2 host).
    let cg = testkit::MemCgroup::new("obs-place", 256 << 20).expect("memory cgroup");
    let name = cg.dir().file_name().unwrap().to_str().unwrap();
    let (text, err) = cgroups_of_target(cg.dir());
    let want = match cg.group().version() {
        memcg::Version::V1 => ":memory:/",
        memcg::Version::V2 => "0::/",
    };
    assert!(text.lines().any(|l| l.contains(want) && l.ends_with(&format!("/{name}"))), "{text}\n{err}");
    assert!(!err.contains("cannot be reported"), "a memory group has an OOM-kill counter:\n{err}");

    // A group in the cgroup2 mount, whatever controllers it has.
    let name = format!("obs-v2-{}", std::process::id());
    let dir = cgroup2_mount().join(&name);
    std::fs::create_dir(&dir).unwrap();
    let g = memcg::Group::open(&dir).unwrap();
    assert_eq!(g.version(), memcg::Version::V2);
    let has_memory = g.has_memory();
    let (text, err) = cgroups_of_target(&dir);
    g.remove().unwrap();
    assert!(text.lines().any(|l| l.starts_with("0::") && l.ends_with(&format!("/{name}"))), "{text}\n{err}");
    if !has_memory {
        // No memory controller there (the development VM's cgroup2 has only hugetlb): said so.
        assert!(err.contains("an OOM kill of the target there cannot be reported"), "{err}");
    }
    assert_eq!(std::fs::read_to_string("/proc/self/cgroup").unwrap(), mine, "the test process moved");
}

#[test]
fn a_directory_that_is_no_cgroup_is_a_clear_error() {
    let _l = machine_lock();
    let (out, err) = observer_run(&["--cgroup", "/tmp", "--", "true"]);
    assert!(!out.status.success());
    assert!(err.contains("--cgroup /tmp") && err.contains("not a cgroup directory"), "{err}");
    let (out, err) = observer_run(&["--cgroup", "/nonexistent/cg", "--", "true"]);
    assert!(!out.status.success());
    assert!(err.contains("--cgroup /nonexistent/cg") && err.contains("statfs"), "{err}");
}
