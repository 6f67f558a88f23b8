//! Machine-state harness for the project's tests and benchmarks.
//!
//! Every guard here changes machine state on creation and restores it on
//! drop (also when a test panics): zram swap ([`ZramSwap`]), a cgroup-v1
//! memory limit ([`MemCgroup`]), and a cross-process lock ([`machine_lock`])
//! that serialises tests which measure the whole machine. Nothing here ever
//! moves the calling process into a cgroup: commands are placed there from
//! inside the child (`sh -c 'echo $$ > …/tasks; exec CMD'`).

use std::{
    fs::File,
    os::fd::AsRawFd,
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use anyhow::{Context, Result, bail};

/// Serialises tests that load probes or measure the machine, across test
/// binaries and crates.
#[derive(Debug)]
pub struct MachineLock(#[expect(dead_code, reason = "held for its flock")] File);

pub fn machine_lock() -> MachineLock {
    let f = File::create("/tmp/moe-observer-tests.lock").expect("create /tmp/moe-observer-tests.lock");
    // SAFETY: valid fd; blocking exclusive lock, released when the file closes.
    let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) };
    assert_eq!(rc, 0, "flock /tmp/moe-observer-tests.lock failed");
    MachineLock(f)
}

pub fn is_root() -> bool {
    // SAFETY: no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn write(path: impl AsRef<Path>, v: &str) -> Result<()> {
    let p = path.as_ref();
    std::fs::write(p, v).with_context(|| format!("writing {v:?} to {}", p.display()))
}

fn run(cmd: &mut Command) -> Result<()> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

/// `/dev/zramN` set up as swap (lz4), torn down and reset on drop.
#[derive(Debug)]
pub struct ZramSwap {
    dev: String,
    sys: PathBuf,
}

impl ZramSwap {
    /// Use the first zram device that is not in use (disksize 0), with `size_mib`.
    pub fn new(size_mib: u64) -> Result<Self> {
        if !Path::new("/sys/class/zram-control").exists() && !Path::new("/sys/block/zram0").exists() {
            let _ = Command::new("modprobe").arg("zram").status();
        }
        let mut chosen = None;
        for i in 0..16 {
            let sys = PathBuf::from(format!("/sys/block/zram{i}"));
            if !sys.exists() {
                break;
            }
            let disksize = std::fs::read_to_string(sys.join("disksize")).unwrap_or_default();
            if disksize.trim() == "0" {
                chosen = Some((format!("/dev/zram{i}"), sys));
                break;
            }
        }
        let Some((dev, sys)) = chosen else {
            bail!("no free zram device (/sys/block/zram*/disksize all in use, or the kernel lacks CONFIG_ZRAM)");
        };
        let z = ZramSwap { dev, sys };
        // lz4 where available; the kernel's default otherwise.
        let _ = write(z.sys.join("comp_algorithm"), "lz4");
        write(z.sys.join("disksize"), &format!("{}", size_mib << 20))?;
        run(Command::new("mkswap").arg(&z.dev))?;
        run(Command::new("swapon").args(["-p", "100"]).arg(&z.dev))?;
        Ok(z)
    }

    pub fn device(&self) -> &str {
        &self.dev
    }

    /// Pages read from this device (the `reads` field of its block stat counts requests).
    pub fn stat(&self) -> Result<Vec<u64>> {
        let s = std::fs::read_to_string(self.sys.join("stat")).context("zram stat")?;
        Ok(s.split_whitespace().filter_map(|v| v.parse().ok()).collect())
    }
}

impl Drop for ZramSwap {
    fn drop(&mut self) {
        let _ = Command::new("swapoff").arg(&self.dev).status();
        let _ = write(self.sys.join("reset"), "1");
    }
}

/// A cgroup-v1 memory cgroup with a limit, removed on drop (its tasks are
/// killed first so that `rmdir` succeeds).
#[derive(Debug)]
pub struct MemCgroup {
    dir: PathBuf,
}

pub const MEMCG_ROOT: &str = "/sys/fs/cgroup/memory";

impl MemCgroup {
    pub fn new(name: &str, limit_bytes: u64) -> Result<Self> {
        if !Path::new(MEMCG_ROOT).join("tasks").exists() {
            bail!("no cgroup-v1 memory controller at {MEMCG_ROOT}");
        }
        let dir = Path::new(MEMCG_ROOT).join(format!("{name}-{}", std::process::id()));
        if dir.exists() {
            let _ = std::fs::remove_dir(&dir);
        }
        std::fs::create_dir(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let cg = MemCgroup { dir };
        write(cg.dir.join("memory.limit_in_bytes"), &limit_bytes.to_string())?;
        // Swap beyond the limit is allowed (memsw is unlimited by default).
        let _ = write(cg.dir.join("memory.swappiness"), "100");
        Ok(cg)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `sh -c 'echo $$ > tasks; exec "$@"' sh ARGS…`: runs `args` inside the
    /// cgroup (as the same PID the caller spawns), never moving the caller.
    pub fn wrap(&self, args: &[&str]) -> Vec<String> {
        let tasks = self.dir.join("tasks");
        let mut v = vec![
            "/bin/sh".to_string(),
            "-c".to_string(),
            format!("echo $$ > {} && exec \"$@\"", tasks.display()),
            "sh".to_string(),
        ];
        v.extend(args.iter().map(|s| s.to_string()));
        v
    }

    pub fn stat(&self, key: &str) -> Option<u64> {
        let s = std::fs::read_to_string(self.dir.join("memory.stat")).ok()?;
        s.lines().find_map(|l| {
            let (k, v) = l.split_once(' ')?;
            (k == key).then(|| v.trim().parse().ok())?
        })
    }
}

impl Drop for MemCgroup {
    fn drop(&mut self) {
        for _ in 0..50 {
            let tasks = std::fs::read_to_string(self.dir.join("tasks")).unwrap_or_default();
            let pids: Vec<i32> = tasks.split_whitespace().filter_map(|p| p.parse().ok()).collect();
            if pids.is_empty() {
                break;
            }
            for p in pids {
                // SAFETY: plain kill of processes we placed in our own cgroup.
                unsafe { libc::kill(p, libc::SIGKILL) };
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// `sync; echo 3 > /proc/sys/vm/drop_caches`.
pub fn drop_caches() -> Result<()> {
    // SAFETY: no preconditions.
    unsafe { libc::sync() };
    write("/proc/sys/vm/drop_caches", "3")
}

/// A field of /proc/vmstat.
pub fn vmstat(key: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/vmstat").ok()?;
    s.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok())?
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrap_runs_in_the_child_not_the_caller() {
        let cg = MemCgroup { dir: PathBuf::from("/nonexistent/cg") };
        let v = cg.wrap(&["echo", "hi"]);
        assert_eq!(v[0], "/bin/sh");
        assert!(v[2].starts_with("echo $$ > /nonexistent/cg/tasks"));
        assert_eq!(&v[4..], &["echo".to_string(), "hi".to_string()]);
        std::mem::forget(cg); // nothing to clean up
    }

    #[test]
    fn vmstat_reads_a_counter() {
        assert!(vmstat("pgfault").is_some());
        assert!(vmstat("no_such_counter").is_none());
    }

    #[test]
    fn zram_and_cgroup_are_restored() {
        assert!(is_root(), "this test changes machine state and must run as root (CI does)");
        let _l = machine_lock();
        let swaps_before = std::fs::read_to_string("/proc/swaps").unwrap();
        let dev;
        {
            let z = ZramSwap::new(64).expect("zram setup");
            dev = z.device().to_string();
            let swaps = std::fs::read_to_string("/proc/swaps").unwrap();
            assert!(swaps.contains(&dev), "{dev} not in /proc/swaps: {swaps}");
            let cg = MemCgroup::new("testkit", 64 << 20).expect("cgroup");
            let dir = cg.dir().to_path_buf();
            let out = Command::new(&cg.wrap(&["cat", "/proc/self/cgroup"])[0])
                .args(&cg.wrap(&["cat", "/proc/self/cgroup"])[1..])
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout);
            let name = dir.file_name().unwrap().to_str().unwrap();
            assert!(text.lines().any(|l| l.contains("memory") && l.contains(name)), "{text}");
            let mine = std::fs::read_to_string("/proc/self/cgroup").unwrap();
            assert!(!mine.contains(name), "the test process must never join the cgroup");
            drop(cg);
            assert!(!dir.exists(), "cgroup not removed");
        }
        assert_eq!(std::fs::read_to_string("/proc/swaps").unwrap(), swaps_before);
        let size = std::fs::read_to_string(format!("/sys/block/{}/disksize", dev.trim_start_matches("/dev/"))).unwrap();
        assert_eq!(size.trim(), "0", "zram not reset");
    }
}
