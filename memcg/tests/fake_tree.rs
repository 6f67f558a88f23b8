//! Both backends against a fake cgroupfs: a tree of regular files in a temporary directory.
//!
//! The kernel's part is emulated as far as regular files allow: [`kernel_mkdir`] writes the
//! interface files the kernel would create in a new group (with `memory.*` only when the parent's
//! `cgroup.subtree_control` enables memory, for v2), [`kernel_rmdir`] removes them as the kernel's
//! `rmdir` would, and each test reads back what the crate wrote where the kernel would have
//! acted on it. Processes are real (`sleep` children), so kills are real.

use std::{
    fs,
    os::unix::process::{CommandExt, ExitStatusExt},
    path::{Path, PathBuf},
    process::{Child, Command},
    time::Duration,
};

use memcg::{Error, Group, Hierarchy, OomWatch, StatKey, Version};

fn put(dir: &Path, file: &str, text: &str) {
    fs::write(dir.join(file), text).unwrap();
}

fn get(dir: &Path, file: &str) -> String {
    fs::read_to_string(dir.join(file)).unwrap()
}

/// A root group of `version`: v2 with the controllers a distribution's root has.
fn fake_root(version: Version) -> (tempfile::TempDir, PathBuf) {
    let t = tempfile::tempdir().unwrap();
    let root = t.path().to_path_buf();
    put(&root, "cgroup.procs", "1\n");
    match version {
        Version::V2 => {
            put(&root, "cgroup.controllers", "cpuset cpu io memory hugetlb pids\n");
            put(&root, "cgroup.subtree_control", "\n");
        }
        Version::V1 => put(&root, "memory.limit_in_bytes", "9223372036854771712\n"),
    }
    (t, root)
}

/// What the kernel creates in a new group `dir`.
fn kernel_mkdir(version: Version, dir: &Path) {
    put(dir, "cgroup.procs", "");
    match version {
        Version::V2 => {
            let parent = get(dir.parent().unwrap(), "cgroup.subtree_control");
            // The parent's enabled controllers ("+memory" as written to a regular file).
            let enabled: Vec<&str> = parent.split_whitespace().map(|w| w.trim_start_matches('+')).collect();
            put(dir, "cgroup.controllers", &format!("{}\n", enabled.join(" ")));
            put(dir, "cgroup.subtree_control", "\n");
            put(dir, "cgroup.type", "domain\n");
            put(dir, "cgroup.kill", "");
            if enabled.contains(&"memory") {
                for (f, v) in [
                    ("memory.max", "max\n"),
                    ("memory.swap.max", "max\n"),
                    ("memory.current", "0\n"),
                    ("memory.swap.current", "0\n"),
                    ("memory.peak", "0\n"),
                    ("memory.reclaim", ""),
                    ("memory.stat", "anon 0\nfile 0\n"),
                    ("memory.events", "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n"),
                ] {
                    put(dir, f, v);
                }
            }
        }
        Version::V1 => {
            for (f, v) in [
                ("tasks", ""),
                ("memory.limit_in_bytes", "9223372036854771712\n"),
                ("memory.memsw.limit_in_bytes", "9223372036854771712\n"),
                ("memory.usage_in_bytes", "0\n"),
                ("memory.max_usage_in_bytes", "0\n"),
                ("memory.failcnt", "0\n"),
                ("memory.swappiness", "60\n"),
                ("memory.stat", "cache 0\nrss 0\n"),
                ("memory.oom_control", "oom_kill_disable 0\nunder_oom 0\noom_kill 0\n"),
            ] {
                put(dir, f, v);
            }
        }
    }
}

/// The kernel's `rmdir` of a group removes its interface files with it.
fn kernel_rmdir(dir: &Path) {
    for e in fs::read_dir(dir).unwrap() {
        fs::remove_file(e.unwrap().path()).unwrap();
    }
}

fn create(version: Version, root: &Path, name: &str) -> Group {
    let g = Hierarchy::new(version, root).create(name).unwrap();
    kernel_mkdir(version, g.dir());
    g
}

/// Removes a group the test created, emulating the kernel's rmdir.
fn remove(g: Group) {
    kernel_rmdir(g.dir());
    let dir = g.dir().to_path_buf();
    g.remove().unwrap();
    assert!(!dir.exists());
}

fn sleeper() -> Child {
    Command::new("sleep").arg("30").spawn().unwrap()
}

fn killed(mut c: Child) -> bool {
    c.wait().unwrap().signal() == Some(libc::SIGKILL)
}

const BOTH: [Version; 2] = [Version::V1, Version::V2];

#[test]
fn v2_create_enables_memory_in_the_parent() {
    let (_t, root) = fake_root(Version::V2);
    let g = create(Version::V2, &root, "g");
    assert_eq!(get(&root, "cgroup.subtree_control"), "+memory", "what the kernel was told");
    assert_eq!(get(g.dir(), "cgroup.controllers"), "memory\n");
    assert_eq!(g.version(), Version::V2);
    assert!(g.has_memory());
    remove(g);
    // Already enabled: left as it is.
    put(&root, "cgroup.subtree_control", "cpu memory\n");
    let g = create(Version::V2, &root, "h");
    assert_eq!(get(&root, "cgroup.subtree_control"), "cpu memory\n");
    remove(g);
}

#[test]
fn v2_create_refuses_a_parent_with_processes_of_its_own() {
    let (_t, root) = fake_root(Version::V2);
    let parent = root.join("busy");
    fs::create_dir(&parent).unwrap();
    put(&parent, "cgroup.type", "domain\n");
    put(&parent, "cgroup.controllers", "cpu memory\n");
    put(&parent, "cgroup.subtree_control", "\n");
    put(&parent, "cgroup.procs", "123\n456\n");
    let e = Hierarchy::new(Version::V2, &parent).create("g").unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, Error::Refused { .. }), "{e:?}");
    assert!(msg.contains("busy/cgroup.subtree_control"), "names the file: {msg}");
    assert!(msg.contains("processes of its own (2 of them: 123 456)"), "{msg}");
    assert!(msg.contains("MOE_CGROUP_PARENT"), "says what to do: {msg}");
    assert_eq!(get(&parent, "cgroup.subtree_control"), "\n", "nothing written");
    assert!(!parent.join("g").exists(), "no group made");
    // Without processes, a non-root parent is fine.
    put(&parent, "cgroup.procs", "");
    let g = create(Version::V2, &parent, "g");
    assert_eq!(get(&parent, "cgroup.subtree_control"), "+memory");
    remove(g);
    // The root is exempt from the rule (it has no cgroup.type): processes there do not matter.
    let g = create(Version::V2, &root, "r");
    assert_eq!(get(&root, "cgroup.procs"), "1\n");
    remove(g);
}

#[test]
fn v2_create_refuses_a_parent_without_the_memory_controller() {
    let (_t, root) = fake_root(Version::V2);
    put(&root, "cgroup.controllers", "hugetlb\n");
    let e = Hierarchy::new(Version::V2, &root).create("g").unwrap_err().to_string();
    assert!(e.contains("cgroup.controllers") && e.contains("lists [hugetlb] without memory"), "{e}");
    assert!(!root.join("g").exists());
}

#[test]
fn create_refuses_bad_names_and_existing_groups() {
    for v in BOTH {
        let (_t, root) = fake_root(v);
        for bad in ["", ".", "..", "a/b"] {
            let e = Hierarchy::new(v, &root).create(bad).unwrap_err().to_string();
            assert!(e.contains("is not a group name"), "{e}");
        }
        fs::create_dir(root.join("old")).unwrap();
        let e = Hierarchy::new(v, &root).create("old").unwrap_err().to_string();
        assert!(e.contains("mkdir") && e.contains("old") && e.contains("remove it with rmdir"), "{e}");
    }
}

#[test]
fn limits_per_version() {
    let (_t, root) = fake_root(Version::V1);
    let g = create(Version::V1, &root, "g");
    let e = g.set_swap_limit(Some(0)).unwrap_err().to_string();
    assert!(e.contains("set the memory limit first"), "v1 memsw needs the memory limit: {e}");
    assert_eq!(g.limit().unwrap(), None, "v1's unlimited value");
    g.set_limit(64 << 20).unwrap();
    assert_eq!(get(g.dir(), "memory.limit_in_bytes"), "67108864");
    assert_eq!(g.limit().unwrap(), Some(64 << 20));
    g.set_swap_limit(Some(16 << 20)).unwrap();
    assert_eq!(get(g.dir(), "memory.memsw.limit_in_bytes"), (80u64 << 20).to_string(), "memory + swap");
    g.set_swap_limit(None).unwrap();
    assert_eq!(get(g.dir(), "memory.memsw.limit_in_bytes"), "-1");
    g.set_swappiness(100).unwrap();
    assert_eq!(get(g.dir(), "memory.swappiness"), "100");
    remove(g);

    let (_t, root) = fake_root(Version::V2);
    let g = create(Version::V2, &root, "g");
    assert_eq!(g.limit().unwrap(), None, "max");
    g.set_limit(64 << 20).unwrap();
    assert_eq!(get(g.dir(), "memory.max"), "67108864");
    assert_eq!(g.limit().unwrap(), Some(64 << 20));
    g.set_swap_limit(Some(0)).unwrap();
    assert_eq!(get(g.dir(), "memory.swap.max"), "0", "swap alone");
    g.set_swap_limit(None).unwrap();
    assert_eq!(get(g.dir(), "memory.swap.max"), "max");
    let e = g.set_swappiness(100).unwrap_err().to_string();
    assert!(e.contains("vm.swappiness"), "{e}");
    remove(g);
}

#[test]
fn a_group_without_the_memory_files_says_so() {
    for v in BOTH {
        let (_t, root) = fake_root(v);
        let g = Hierarchy::new(v, &root).create("bare").unwrap();
        put(g.dir(), "cgroup.procs", ""); // a group, but the kernel gave it no memory.* files
        assert!(!g.has_memory());
        let e = g.set_limit(1 << 20).unwrap_err().to_string();
        assert!(e.contains("bare/memory.") && e.contains("memory controller is not enabled"), "{e}");
        let e = g.usage().unwrap_err().to_string();
        assert!(e.contains("reading") && e.contains("memory controller is not enabled"), "{e}");
        assert!(matches!(g.set_swap_limit(None), Err(Error::Unsupported { .. })));
        assert!(matches!(OomWatch::start(&g), Err(Error::Io { .. })));
        remove(g);
    }
}

#[test]
fn stat_usage_and_peak() {
    let (_t, root) = fake_root(Version::V1);
    let g = create(Version::V1, &root, "g");
    put(
        g.dir(),
        "memory.stat",
        "cache 1\nrss 2\nshmem 3\nmapped_file 4\ndirty 5\nswap 6\npgfault 7\npgmajfault 8\n\
         total_cache 4096\ntotal_rss 8192\ntotal_shmem 0\ntotal_mapped_file 1024\ntotal_dirty 0\ntotal_swap 65536\n\
         total_pgfault 70\ntotal_pgmajfault 80\n",
    );
    put(g.dir(), "memory.usage_in_bytes", "12288\n");
    put(g.dir(), "memory.max_usage_in_bytes", "20480\n");
    let s = g.stat().unwrap();
    assert_eq!(s.get(StatKey::File), Some(4096));
    assert_eq!(s.get(StatKey::Anon), Some(8192));
    assert_eq!(s.get(StatKey::FileMapped), Some(1024));
    assert_eq!(s.get(StatKey::Swap), Some(65536));
    assert_eq!(s.get(StatKey::PgMajFault), Some(80));
    assert_eq!(s.get(StatKey::Unevictable), None);
    assert_eq!((g.usage().unwrap(), g.peak().unwrap()), (12288, 20480));
    remove(g);

    let (_t, root) = fake_root(Version::V2);
    let g = create(Version::V2, &root, "g");
    put(g.dir(), "memory.stat", "anon 8192\nfile 4096\nfile_mapped 1024\nshmem 0\npgfault 70\npgmajfault 80\n");
    put(g.dir(), "memory.swap.current", "65536\n");
    put(g.dir(), "memory.current", "12288\n");
    put(g.dir(), "memory.peak", "20480\n");
    let s = g.stat().unwrap();
    assert_eq!(
        [StatKey::Anon, StatKey::File, StatKey::FileMapped, StatKey::Swap, StatKey::PgMajFault].map(|k| s.get(k)),
        [Some(8192), Some(4096), Some(1024), Some(65536), Some(80)]
    );
    assert_eq!((g.usage().unwrap(), g.peak().unwrap()), (12288, 20480));
    // A kernel older than 5.19 has no memory.peak; no swap accounting, no memory.swap.current.
    fs::remove_file(g.dir().join("memory.peak")).unwrap();
    fs::remove_file(g.dir().join("memory.swap.current")).unwrap();
    let e = g.peak().unwrap_err().to_string();
    assert!(e.contains("peak usage is not available") && e.contains("5.19"), "{e}");
    assert_eq!(g.stat().unwrap().get(StatKey::Swap), None, "not measured, not 0");
    remove(g);
}

#[test]
fn events_and_the_oom_watch() {
    let (_t, root) = fake_root(Version::V2);
    let g = create(Version::V2, &root, "g");
    put(g.dir(), "memory.events", "low 1\nhigh 2\nmax 3\noom 4\noom_kill 5\noom_group_kill 0\n");
    let e = g.events().unwrap();
    assert_eq!((e.low, e.high, e.max, e.oom, e.oom_kill), (Some(1), Some(2), Some(3), Some(4), Some(5)));
    let w = OomWatch::start(&g).unwrap();
    assert_eq!(w.kills().unwrap(), 0);
    put(g.dir(), "memory.events", "low 1\nhigh 2\nmax 9\noom 5\noom_kill 7\noom_group_kill 0\n");
    assert_eq!(w.kills().unwrap(), 2);
    remove(g);

    let (_t, root) = fake_root(Version::V1);
    let g = create(Version::V1, &root, "g");
    put(g.dir(), "memory.oom_control", "oom_kill_disable 0\nunder_oom 0\noom_kill 5\n");
    put(g.dir(), "memory.failcnt", "3\n");
    let e = g.events().unwrap();
    assert_eq!((e.low, e.high, e.max, e.oom, e.oom_kill), (None, None, Some(3), None, Some(5)));
    put(g.dir(), "memory.memsw.failcnt", "4\n"); // charges that failed at the memory+swap limit
    assert_eq!(g.events().unwrap().max, Some(7));
    let w = OomWatch::start(&g).unwrap();
    put(g.dir(), "memory.oom_control", "oom_kill_disable 0\nunder_oom 1\noom_kill 6\n");
    assert_eq!(w.kills().unwrap(), 1);
    // Before Linux 4.13, v1 had no oom_kill line.
    put(g.dir(), "memory.oom_control", "oom_kill_disable 0\nunder_oom 0\n");
    assert_eq!(g.events().unwrap().oom_kill, None);
    let e = OomWatch::start(&g).unwrap_err().to_string();
    assert!(e.contains("OOM-kill counter") && e.contains("4.13"), "{e}");
    put(g.dir(), "memory.failcnt", "lots\n");
    let e = g.events().unwrap_err().to_string();
    assert!(e.contains("memory.failcnt") && e.contains("unexpected contents"), "{e}");
    remove(g);
}

#[test]
fn reclaim_is_v2_only() {
    let (_t, root) = fake_root(Version::V2);
    let g = create(Version::V2, &root, "g");
    g.reclaim(1 << 20).unwrap();
    assert_eq!(get(g.dir(), "memory.reclaim"), "1048576");
    fs::remove_file(g.dir().join("memory.reclaim")).unwrap();
    let e = g.reclaim(1 << 20).unwrap_err().to_string();
    assert!(e.contains("proactive reclaim is not available") && e.contains("5.19"), "{e}");
    remove(g);

    let (_t, root) = fake_root(Version::V1);
    let g = create(Version::V1, &root, "g");
    let e = g.reclaim(1 << 20).unwrap_err();
    assert!(matches!(e, Error::Unsupported { version: Version::V1, .. }), "{e:?}");
    assert!(e.to_string().contains("force_empty"), "{e}");
    remove(g);
}

#[test]
fn place_members_and_child_join() {
    for v in BOTH {
        let (_t, root) = fake_root(v);
        let g = create(v, &root, "g");
        let c = sleeper();
        g.place(c.id() as i32).unwrap();
        assert_eq!(get(g.dir(), "cgroup.procs"), c.id().to_string());
        assert_eq!(g.procs().unwrap(), vec![c.id() as i32]);
        // Never the caller.
        let me = std::process::id() as i32;
        let e = g.place(me).unwrap_err().to_string();
        assert!(e.contains("refusing to move the calling process"), "{e}");
        assert_eq!(g.procs().unwrap(), vec![c.id() as i32], "untouched");
        // A child joins itself before exec.
        let join = g.child_join().unwrap();
        let mut cmd = Command::new("true");
        // SAFETY: ChildJoin::join is async-signal-safe.
        unsafe { cmd.pre_exec(move || join.join().map_err(std::io::Error::from_raw_os_error)) };
        let child = cmd.spawn().unwrap();
        let pid = child.id();
        assert!(child.wait_with_output().unwrap().status.success());
        assert_eq!(g.procs().unwrap(), vec![pid as i32], "the child wrote its own PID");
        put(g.dir(), "cgroup.procs", "garbage\n");
        let e = g.procs().unwrap_err().to_string();
        assert!(e.contains("cgroup.procs") && e.contains("garbage"), "{e}");
        put(g.dir(), "cgroup.procs", "");
        let mut c = c;
        c.kill().unwrap();
        c.wait().unwrap();
        remove(g);
    }
}

#[test]
fn kill_uses_cgroup_kill_or_signals_each_member() {
    // v2 with cgroup.kill (Linux 5.14+): one write, the kernel does the rest.
    let (_t, root) = fake_root(Version::V2);
    let g = create(Version::V2, &root, "g");
    g.kill().unwrap();
    assert_eq!(get(g.dir(), "cgroup.kill"), "1");
    remove(g);
    // v1, and v2 before 5.14: SIGKILL to every member, waiting until none is left.
    for v in BOTH {
        let (_t, root) = fake_root(v);
        let g = create(v, &root, "g");
        let _ = fs::remove_file(g.dir().join("cgroup.kill"));
        let (a, b) = (sleeper(), sleeper());
        put(g.dir(), "cgroup.procs", &format!("{}\n{}\n", a.id(), b.id()));
        g.kill_and_wait(Duration::from_secs(5)).unwrap();
        assert!(killed(a) && killed(b), "{v}: both members got SIGKILL");
        remove(g);
    }
}

#[test]
fn remove_and_drop_kill_the_members_first() {
    for v in BOTH {
        let (_t, root) = fake_root(v);
        let g = create(v, &root, "g");
        let _ = fs::remove_file(g.dir().join("cgroup.kill"));
        let dir = g.dir().to_path_buf();
        // An explicit remove with the interface files still there (a regular directory cannot
        // lose them): the member is killed, then rmdir fails with a clear error.
        let c = sleeper();
        put(&dir, "cgroup.procs", &format!("{}\n", c.id()));
        let e = Hierarchy::new(v, &root).open("g").unwrap().remove().unwrap_err().to_string();
        assert!(e.contains("rmdir") && e.contains("/g") && e.contains("still in it"), "{e}");
        assert!(killed(c), "{v}: killed before the rmdir");
        // Drop does the same: the member is killed (the rmdir fails here, as above).
        let c = sleeper();
        put(&dir, "cgroup.procs", &format!("{}\n", c.id()));
        drop(g);
        assert!(killed(c), "{v}: killed on drop");
        // Once the kernel's files are gone, the rmdir succeeds.
        let g = Hierarchy::new(v, &root).open("g").unwrap();
        kernel_rmdir(&dir);
        g.remove().unwrap();
        assert!(!dir.exists(), "{v}: removed");
        // Removing a group that is already gone is fine.
        let g = create(v, &root, "h");
        let h = g.dir().to_path_buf();
        kernel_rmdir(&h);
        fs::remove_dir(&h).unwrap();
        drop(g);
    }
}

#[test]
fn opened_groups_are_left_in_place() {
    let (_t, root) = fake_root(Version::V2);
    fs::create_dir(root.join("theirs")).unwrap();
    kernel_mkdir(Version::V2, &root.join("theirs"));
    let g = Group::open_as(Version::V2, &root.join("theirs")).unwrap();
    drop(g);
    assert!(root.join("theirs").exists(), "not ours to remove");
    fs::create_dir(root.join("plain")).unwrap();
    let e = Group::open_as(Version::V2, &root.join("plain")).unwrap_err().to_string();
    assert!(e.contains("plain") && e.contains("not a cgroup directory"), "{e}");
    let e = Group::open(&root).unwrap_err().to_string();
    assert!(e.contains("not a cgroup directory"), "a temp dir is no cgroupfs: {e}");
}
