//! Against the kernel, as root, under `testkit::machine_lock`: the backend this machine's memory
//! controller uses (v1 on the development VM, v2 on a v2 host), and the v2 operations that need
//! no memory controller in this machine's cgroup2 mount. The test process never joins a group.

use std::{
    fs,
    os::unix::process::{CommandExt, ExitStatusExt},
    path::{Path, PathBuf},
    process::{Child, Command},
    time::{Duration, Instant},
};

use memcg::{Group, Hierarchy, OomWatch, StatKey, Version, version_of};

fn assert_root() {
    assert!(testkit::is_root(), "these tests make cgroups and must run as root (CI does)");
}

/// `args` in a child that joins `g` itself before exec.
fn spawn_in(g: &Group, args: &[&str]) -> Child {
    let join = g.child_join().unwrap();
    let mut c = Command::new(args[0]);
    c.args(&args[1..]).stdout(std::process::Stdio::null());
    // SAFETY: ChildJoin::join is async-signal-safe.
    unsafe { c.pre_exec(move || join.join().map_err(std::io::Error::from_raw_os_error)) };
    c.spawn().unwrap_or_else(|e| panic!("spawning {args:?} in {}: {e}", g.dir().display()))
}

fn killed(mut c: Child) -> bool {
    c.wait().unwrap().signal() == Some(libc::SIGKILL)
}

fn vmstat_oom_kills() -> u64 {
    testkit::vmstat("oom_kill").expect("/proc/vmstat has oom_kill (Linux 4.13+)")
}

fn my_cgroups() -> String {
    fs::read_to_string("/proc/self/cgroup").unwrap()
}

#[test]
fn detect_finds_this_machines_memory_controller() {
    let h = Hierarchy::detect().unwrap();
    eprintln!("memory controller: {}", h.describe());
    assert_eq!(version_of(h.parent()).unwrap(), h.version(), "the parent's filesystem agrees");
    match h.version() {
        Version::V1 => assert!(h.parent().join("memory.stat").exists(), "a v1 memory hierarchy has memory.stat"),
        Version::V2 => {
            let ctl = fs::read_to_string(h.parent().join("cgroup.controllers")).unwrap();
            assert!(ctl.split_whitespace().any(|c| c == "memory"), "{ctl}");
        }
    }
}

#[test]
fn a_real_group_limits_counts_places_oom_kills_and_goes() {
    assert_root();
    let _l = testkit::machine_lock();
    let mine = my_cgroups();
    let h = Hierarchy::detect().unwrap();
    let g = h.create(&format!("memcg-test-{}", std::process::id())).unwrap();
    let dir = g.dir().to_path_buf();
    let name = dir.file_name().unwrap().to_str().unwrap().to_string();
    assert!(g.has_memory());
    g.set_limit(32 << 20).unwrap();
    assert_eq!(g.limit().unwrap(), Some(32 << 20));
    let (oom0, max0) = (vmstat_oom_kills(), g.events().unwrap().max.unwrap());

    // Page cache is charged to the group that reads it: a cold 64 MiB file read from inside
    // hits the 32 MiB limit (reclaim, no OOM) and leaves some of itself charged.
    let file = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("memcg-real.bin");
    write_cold(&file, 64 << 20);
    let cat = spawn_in(&g, &["cat", file.to_str().unwrap()]);
    assert!(cat.wait_with_output().unwrap().status.success(), "cat failed");
    let s = g.stat().unwrap();
    assert!(s.get(StatKey::File).unwrap() >= 8 << 20, "the read file is charged to the group: {s:?}");
    assert!(g.usage().unwrap() >= 8 << 20);
    assert!(g.events().unwrap().max.unwrap() > max0, "reading 64 MiB under 32 MiB counted no limit hit");

    // A member that wants 256 MiB under 32 MiB and no swap: the group's OOM killer ends it.
    g.set_swap_limit(Some(0)).unwrap();
    let watch = OomWatch::start(&g).unwrap();
    let hog = spawn_in(&g, &["dd", "if=/dev/zero", "of=/dev/null", "bs=256M", "count=1"]);
    assert!(killed(hog), "dd beyond the limit was not SIGKILLed");
    assert_eq!(watch.kills().unwrap(), 1, "the group counted one OOM kill");
    assert!(vmstat_oom_kills() > oom0, "the machine's /proc/vmstat oom_kill did not move");
    let peak = g.peak().unwrap();
    assert!((24 << 20..=32 << 20).contains(&peak), "peak {peak} should reach the 32 MiB limit");

    // Members: one joined from inside, one placed from outside; never the caller.
    let a = spawn_in(&g, &["sleep", "30"]);
    let b = Command::new("sleep").arg("30").spawn().unwrap();
    g.place(b.id() as i32).unwrap();
    let mut procs = g.procs().unwrap();
    procs.sort();
    let mut want = vec![a.id() as i32, b.id() as i32];
    want.sort();
    assert_eq!(procs, want);
    let theirs = fs::read_to_string(format!("/proc/{}/cgroup", a.id())).unwrap();
    assert!(theirs.lines().any(|l| l.contains("memory") || l.starts_with("0::")) && theirs.contains(&name), "{theirs}");
    assert!(g.place(std::process::id() as i32).is_err());
    match h.version() {
        Version::V1 => assert!(g.reclaim(1 << 20).is_err(), "v1 has no proactive reclaim"),
        Version::V2 => {
            // EAGAIN when less could be reclaimed is fine; any other error is not.
            if let Err(e) = g.reclaim(1 << 20) {
                assert!(e.to_string().contains("reclaimed less than asked"), "{e}");
            }
        }
    }

    drop(g);
    assert!(killed(a) && killed(b), "the members were killed on drop");
    assert!(!dir.exists(), "{} not removed", dir.display());
    assert_eq!(my_cgroups(), mine, "the test process moved");
    let _ = fs::remove_file(&file);
}

/// Writes `len` bytes to `path` and drops them from the page cache.
fn write_cold(path: &Path, len: usize) {
    use std::os::fd::AsRawFd;
    fs::write(path, vec![7u8; len]).unwrap();
    let f = fs::File::open(path).unwrap();
    f.sync_all().unwrap();
    // SAFETY: valid fd; advisory call.
    let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    assert_eq!(rc, 0);
}

/// This machine's cgroup2 mount point (every current distribution has one).
fn cgroup2_mount() -> PathBuf {
    let mi = fs::read_to_string("/proc/self/mountinfo").unwrap();
    mi.lines()
        .find(|l| l.split_once(" - ").is_some_and(|(_, r)| r.starts_with("cgroup2 ")))
        .and_then(|l| l.split(' ').nth(4))
        .map(PathBuf::from)
        .expect("no cgroup2 mount: mount one with `mount -t cgroup2 none /sys/fs/cgroup/unified`")
}

#[test]
fn v2_members_child_join_cgroup_kill_and_rmdir_for_real() {
    assert_root();
    let _l = testkit::machine_lock();
    let mine = my_cgroups();
    let mount = cgroup2_mount();
    let name = format!("memcg-v2-test-{}", std::process::id());
    let dir = mount.join(&name);
    fs::create_dir(&dir).unwrap();
    let g = Group::open(&dir).unwrap();
    assert_eq!(g.version(), Version::V2, "statfs of {} says cgroup2", dir.display());
    let a = spawn_in(&g, &["sleep", "30"]);
    let line = fs::read_to_string(format!("/proc/{}/cgroup", a.id())).unwrap();
    // The path relative to the mount's root (the mount may show a subtree, e.g. in a container).
    assert!(line.lines().any(|l| l.starts_with("0::") && l.ends_with(&format!("/{name}"))), "{line}");
    assert_eq!(g.procs().unwrap(), vec![a.id() as i32]);
    let b = Command::new("sleep").arg("30").spawn().unwrap();
    g.place(b.id() as i32).unwrap();
    assert_eq!(g.procs().unwrap().len(), 2);
    assert!(dir.join("cgroup.kill").exists(), "Linux 5.14+ has cgroup.kill");
    g.kill_and_wait(Duration::from_secs(5)).unwrap();
    assert!(killed(a) && killed(b));
    let start = Instant::now();
    g.remove().unwrap();
    assert!(!dir.exists());
    eprintln!("removed in {:?}", start.elapsed());
    assert_eq!(my_cgroups(), mine, "the test process moved");

    // A memory group there: made when the mount has the memory controller, refused clearly when not.
    let ctl = fs::read_to_string(mount.join("cgroup.controllers")).unwrap();
    let h = Hierarchy::new(Version::V2, &mount);
    let made = h.create(&name);
    if ctl.split_whitespace().any(|c| c == "memory") {
        let g = made.unwrap();
        assert!(g.has_memory());
    } else {
        let e = made.unwrap_err().to_string();
        assert!(e.contains("cgroup.controllers") && e.contains("without memory"), "{e}");
        assert!(!dir.exists());
        eprintln!("{e}");
    }
}
