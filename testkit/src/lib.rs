//! Machine-state harness for the project's tests and benchmarks.
//!
//! Every guard here changes machine state on creation and restores it on
//! drop (also when a test panics): zram swap ([`ZramSwap`]), a memory cgroup
//! with a limit ([`MemCgroup`], cgroup v1 or v2 through the `memcg` crate,
//! whichever holds this machine's memory controller), an anonymous-memory
//! [`Balloon`] in a cgroup, all three together as a memory-pressure setup
//! ([`Pressure`], also behind `cargo xtask pressure`), and a cross-process lock
//! ([`machine_lock`]) that serialises tests which measure the whole machine.
//! Nothing here ever moves the calling process into a cgroup: commands are
//! placed there from inside the child (`sh -c 'echo $$ > …/cgroup.procs; exec
//! CMD'`, or [`memcg::ChildJoin`] in a forked child). A DAMON `pageout` kdamond of a test's own
//! ([`damon::Damon`]) puts the DAMON admin tree back as it was. Beside the guards, two readers for
//! checks: a program's `--help` ([`help`]) and a plot's SVG ([`svg`]).

use std::{
    fs::File,
    os::fd::AsRawFd,
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use anyhow::{Context, Result, bail};

pub mod damon;
pub mod help;
pub mod kswapd;
pub mod soak;
pub mod svg;

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
    /// Index of a device this guard created with `hot_add` (removed on drop).
    added: Option<u32>,
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
        let mut added = None;
        if chosen.is_none() {
            // All in use (another user's swap): add a device of our own.
            let n: u32 = std::fs::read_to_string("/sys/class/zram-control/hot_add")
                .ok()
                .and_then(|s| s.trim().parse().ok())
                .context("no free zram device and /sys/class/zram-control/hot_add failed (is CONFIG_ZRAM set?)")?;
            added = Some(n);
            chosen = Some((format!("/dev/zram{n}"), PathBuf::from(format!("/sys/block/zram{n}"))));
        }
        let Some((dev, sys)) = chosen else {
            bail!("no free zram device (/sys/block/zram*/disksize all in use, or the kernel lacks CONFIG_ZRAM)");
        };
        let z = ZramSwap { dev, sys, added };
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
        if let Some(n) = self.added {
            let _ = write("/sys/class/zram-control/hot_remove", &n.to_string());
        }
    }
}

/// A memory cgroup with a limit, made under this machine's memory controller
/// ([`memcg::Hierarchy::detect`]: v2 or v1), removed on drop (its processes are
/// killed first so that `rmdir` succeeds).
///
/// Swap beyond the limit is allowed (v1 `memory.memsw.limit_in_bytes` and v2
/// `memory.swap.max` are unlimited in a new group); v1 gets `memory.swappiness`
/// 100, v2 has no per-group swappiness (the global `vm.swappiness` applies).
#[derive(Debug)]
pub struct MemCgroup {
    hierarchy: memcg::Hierarchy,
    group: memcg::Group,
}

impl MemCgroup {
    /// The group `NAME-PID` with a limit of `limit_bytes`.
    pub fn new(name: &str, limit_bytes: u64) -> Result<Self> {
        let hierarchy = memcg::Hierarchy::detect().context("finding the memory cgroup controller")?;
        let group = hierarchy
            .create(&format!("{name}-{}", std::process::id()))
            .with_context(|| format!("making a memory cgroup ({})", hierarchy.describe()))?;
        group.set_limit(limit_bytes)?;
        if group.version() == memcg::Version::V1 {
            group.set_swappiness(100)?;
        }
        Ok(MemCgroup { hierarchy, group })
    }

    pub fn dir(&self) -> &Path {
        self.group.dir()
    }

    pub fn group(&self) -> &memcg::Group {
        &self.group
    }

    /// Which cgroup version and where, e.g. `cgroup v1 (groups under /sys/fs/cgroup/memory)`.
    pub fn describe(&self) -> String {
        self.hierarchy.describe()
    }

    /// `sh -c 'echo $$ > DIR/cgroup.procs && exec "$@"' sh ARGS…`: runs `args` inside the
    /// cgroup (as the same PID the caller spawns), never moving the caller.
    pub fn wrap(&self, args: &[&str]) -> Vec<String> {
        let procs = self.dir().join("cgroup.procs");
        let quoted = format!("'{}'", procs.display().to_string().replace('\'', "'\\''"));
        let mut v = vec![
            "/bin/sh".to_string(),
            "-c".to_string(),
            format!("echo $$ > {quoted} && exec \"$@\""),
            "sh".to_string(),
        ];
        v.extend(args.iter().map(|s| s.to_string()));
        v
    }

    /// The memory cgroup of processes in this group, as `/proc/PID/cgroup` names it (the
    /// `memory` controller's line on v1, the unified line on v2): what DAMON's `memcg_path`
    /// filter takes. Asked of a process started in the group.
    pub fn proc_path(&self) -> Result<String> {
        let argv = self.wrap(&["cat", "/proc/self/cgroup"]);
        let out = Command::new(&argv[0]).args(&argv[1..]).output()?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let line = |memory: bool| {
            text.lines().find_map(|l| {
                let mut it = l.splitn(3, ':');
                let (_, ctrl, path) = (it.next()?, it.next()?, it.next()?);
                (if memory { ctrl.split(',').any(|c| c == "memory") } else { ctrl.is_empty() })
                    .then(|| path.to_string())
            })
        };
        line(true).or_else(|| line(false)).ok_or_else(|| anyhow::anyhow!("no memory cgroup in {text:?}"))
    }
}

/// An anonymous-memory balloon: a child process, placed in a memory cgroup from inside the child,
/// that holds `mib` MiB of incompressible anonymous memory and reads one byte of every page
/// again every `touch` interval, so that its memory stays hot and competes with the workload's
/// (like another app in use). Killed on drop; dies with the process that spawned it.
#[derive(Debug)]
pub struct Balloon {
    pid: libc::pid_t,
    mib: u64,
}

impl Balloon {
    /// Forks the balloon into `cg` and returns once all of its memory has been written.
    pub fn spawn(cg: &MemCgroup, mib: u64, touch: Duration) -> Result<Balloon> {
        let join = cg.group().child_join()?;
        let len = usize::try_from(mib << 20).context("balloon size")?;
        let parent = std::process::id() as libc::pid_t;
        let mut fds = [0i32; 2];
        // SAFETY: valid out-array of two fds.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            bail!("pipe2: {}", std::io::Error::last_os_error());
        }
        let (rd, wr) = (fds[0], fds[1]);
        // SAFETY: the child only makes raw system calls on data prepared before the fork (no
        // allocation, no locks) and leaves with _exit; see `balloon_child`.
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            let e = std::io::Error::last_os_error();
            // SAFETY: our own fds.
            unsafe {
                libc::close(rd);
                libc::close(wr);
            }
            bail!("fork: {e}");
        }
        if pid == 0 {
            // SAFETY: in the freshly forked child; see above.
            unsafe { balloon_child(&join, len, touch, wr, parent) }
        }
        // SAFETY: our own fd.
        unsafe { libc::close(wr) };
        let mut b = [0u8; 1];
        // SAFETY: reading one byte into a valid buffer; blocks until the child is ready or dead.
        let n = unsafe { libc::read(rd, b.as_mut_ptr().cast(), 1) };
        // SAFETY: our own fd.
        unsafe { libc::close(rd) };
        let balloon = Balloon { pid, mib };
        match (n, b[0]) {
            (1, b'R') => Ok(balloon),
            (1, b'C') => bail!("balloon: cannot join the cgroup {}", cg.dir().display()),
            (1, b'M') => bail!("balloon: mmap of {mib} MiB failed"),
            _ => bail!("balloon of {mib} MiB died before it was filled (OOM-killed in {}?)", cg.dir().display()),
        }
    }

    pub fn pid(&self) -> i32 {
        self.pid
    }

    pub fn mib(&self) -> u64 {
        self.mib
    }

    /// Whether the balloon process is still alive (not OOM-killed).
    pub fn alive(&self) -> bool {
        let mut st = 0;
        // SAFETY: non-blocking wait on our own child.
        unsafe { libc::waitpid(self.pid, &mut st, libc::WNOHANG) == 0 }
    }
}

impl Drop for Balloon {
    fn drop(&mut self) {
        // SAFETY: kill and reap our own child.
        unsafe {
            libc::kill(self.pid, libc::SIGKILL);
            libc::waitpid(self.pid, std::ptr::null_mut(), 0);
        }
    }
}

/// A fresh private anonymous read-write mapping of `len` bytes, `MAP_FAILED` when refused. One
/// `mmap` system call and nothing else, so a forked child may call it too.
pub fn map_anon(len: usize) -> *mut libc::c_void {
    // SAFETY: a new mapping placed by the kernel; no existing memory is touched.
    unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    }
}

/// The balloon's body after `fork`: only raw system calls, then `_exit`.
///
/// # Safety
/// Must run in a freshly forked child, with `wr` the write end of the readiness pipe.
unsafe fn balloon_child(join: &memcg::ChildJoin, len: usize, touch: Duration, wr: i32, parent: libc::pid_t) -> ! {
    // SAFETY: raw system calls on valid arguments; the child owns its copy of the address space.
    unsafe {
        let fail = |code: u8| -> ! {
            libc::write(wr, (&code as *const u8).cast(), 1);
            libc::_exit(1)
        };
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
        if libc::getppid() != parent {
            libc::_exit(1);
        }
        if join.join().is_err() {
            fail(b'C');
        }
        let p = map_anon(len);
        if p == libc::MAP_FAILED {
            fail(b'M');
        }
        // Incompressible contents (SplitMix64: plain arithmetic, safe after
        // fork), like the weights it competes with.
        let words = p.cast::<u64>();
        let mut rng = moe_stats::SplitMix64::new(libc::getpid() as u64);
        for w in 0..len / 8 {
            words.add(w).write(rng.next_u64());
        }
        let ready = b'R';
        libc::write(wr, (&ready as *const u8).cast(), 1);
        libc::close(wr);
        let ts =
            libc::timespec { tv_sec: touch.as_secs() as libc::time_t, tv_nsec: touch.subsec_nanos() as libc::c_long };
        let bytes = p.cast::<u8>();
        let mut sum = 0u8;
        loop {
            let mut off = 0;
            while off < len {
                sum = sum.wrapping_add(bytes.add(off).read_volatile());
                off += 4096;
            }
            std::hint::black_box(sum);
            libc::nanosleep(&ts, std::ptr::null_mut());
        }
    }
}

/// A memory-pressure setup: optional zram swap, a memory cgroup limit ([`MemCgroup`]) and an optional
/// [`Balloon`] inside it. Commands run in the cgroup through [`Pressure::command`]; the caller is
/// never moved. Dropping it kills what runs in the cgroup, removes the cgroup and tears down the
/// zram swap (fields drop in this order).
#[derive(Debug)]
pub struct Pressure {
    pub balloon: Option<Balloon>,
    pub cgroup: MemCgroup,
    pub zram: Option<ZramSwap>,
}

#[derive(Debug, Clone)]
pub struct PressureConfig {
    /// Name stem of the cgroup (the PID is appended).
    pub name: String,
    pub limit_bytes: u64,
    /// zram swap of this size, or none.
    pub zram_mib: Option<u64>,
    /// Balloon size (0 = no balloon) and how often it re-reads its pages.
    pub balloon_mib: u64,
    pub balloon_touch: Duration,
}

/// Counters of a pressure run: the cgroup's and the machine's.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PressureStats {
    /// The cgroup's peak usage since it was made ([`memcg::Group::peak`]).
    pub max_usage_bytes: Option<u64>,
    /// Times its usage hit the limit ([`memcg::Events::max`]).
    pub limit_hits: Option<u64>,
    /// Processes its OOM killer killed ([`memcg::Events::oom_kill`]).
    pub oom_kills: Option<u64>,
    /// Bytes of its memory in swap now ([`memcg::StatKey::Swap`]).
    pub swap_bytes: Option<u64>,
    /// /proc/vmstat deltas since [`Pressure::new`].
    pub pswpin: Option<u64>,
    pub pswpout: Option<u64>,
    pub pgmajfault: Option<u64>,
}

impl Pressure {
    pub fn new(cfg: &PressureConfig) -> Result<Pressure> {
        if !is_root() {
            bail!("memory pressure needs root (zram, cgroups): run as root");
        }
        let zram = cfg.zram_mib.map(ZramSwap::new).transpose()?;
        let cgroup = MemCgroup::new(&cfg.name, cfg.limit_bytes)?;
        let mut p = Pressure { balloon: None, cgroup, zram };
        if cfg.balloon_mib > 0 {
            p.balloon = Some(Balloon::spawn(&p.cgroup, cfg.balloon_mib, cfg.balloon_touch)?);
        }
        Ok(p)
    }

    /// `args` as a command that runs inside the cgroup (see [`MemCgroup::wrap`]).
    pub fn command(&self, args: &[&str]) -> Command {
        let v = self.cgroup.wrap(args);
        let mut c = Command::new(&v[0]);
        c.args(&v[1..]);
        c
    }

    /// Counters now; `since` is the /proc/vmstat state at the start, from [`vmstat_snapshot`].
    /// A counter this kernel or cgroup version lacks is `None`.
    pub fn stats(&self, since: &VmstatSnapshot) -> PressureStats {
        let now = vmstat_snapshot();
        let d = |a: Option<u64>, b: Option<u64>| Some(a?.saturating_sub(b?));
        let g = self.cgroup.group();
        let events = g.events().ok();
        PressureStats {
            max_usage_bytes: g.peak().ok(),
            limit_hits: events.and_then(|e| e.max),
            oom_kills: events.and_then(|e| e.oom_kill),
            swap_bytes: g.stat().ok().and_then(|s| s.get(memcg::StatKey::Swap)),
            pswpin: d(now.pswpin, since.pswpin),
            pswpout: d(now.pswpout, since.pswpout),
            pgmajfault: d(now.pgmajfault, since.pgmajfault),
        }
    }
}

/// The /proc/vmstat counters [`PressureStats`] reports.
#[derive(Debug, Clone, Copy, Default)]
pub struct VmstatSnapshot {
    pub pswpin: Option<u64>,
    pub pswpout: Option<u64>,
    pub pgmajfault: Option<u64>,
}

pub fn vmstat_snapshot() -> VmstatSnapshot {
    VmstatSnapshot { pswpin: vmstat("pswpin"), pswpout: vmstat("pswpout"), pgmajfault: vmstat("pgmajfault") }
}

/// Drops a file's pages from the page cache: `fdatasync` (dirty pages are not dropped), then
/// `POSIX_FADV_DONTNEED` over the whole file. The next read of any page goes to the disk, and the
/// page cache it fills is charged to the memory cgroup of whoever reads it.
pub fn evict(path: &Path) -> Result<()> {
    let f = File::open(path).with_context(|| format!("opening {} to evict it from the page cache", path.display()))?;
    // SAFETY: fdatasync and advice on a descriptor we own.
    let (sync, rc) = unsafe {
        (libc::fdatasync(f.as_raw_fd()), libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED))
    };
    if sync != 0 {
        return Err(std::io::Error::last_os_error()).with_context(|| format!("fdatasync of {}", path.display()));
    }
    if rc != 0 {
        return Err(std::io::Error::from_raw_os_error(rc))
            .with_context(|| format!("posix_fadvise(DONTNEED) on {}", path.display()));
    }
    Ok(())
}

/// `sync; echo 3 > /proc/sys/vm/drop_caches`.
pub fn drop_caches() -> Result<()> {
    // SAFETY: no preconditions.
    unsafe { libc::sync() };
    write("/proc/sys/vm/drop_caches", "3")
}

/// The machine's stolen time so far (`steal` of `/proc/stat`'s `cpu` line, all CPUs, in clock
/// ticks): time the hypervisor ran something else on this machine's virtual CPUs, invisible to
/// its scheduler and left out of every task's utime and stime.
pub fn steal_ticks() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    stat.lines().find(|l| l.starts_with("cpu "))?.split_whitespace().nth(8)?.parse().ok()
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
        let dir = std::env::temp_dir().join(format!("testkit-wrap-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("cgroup.procs"), "").unwrap();
        let group = memcg::Group::open_as(memcg::Version::V2, &dir).unwrap(); // opened: left in place
        let cg = MemCgroup { hierarchy: memcg::Hierarchy::new(memcg::Version::V2, &dir), group };
        let v = cg.wrap(&["echo", "hi"]);
        assert_eq!(v[0], "/bin/sh");
        assert_eq!(v[2], format!("echo $$ > '{}/cgroup.procs' && exec \"$@\"", dir.display()));
        assert_eq!(&v[4..], &["echo".to_string(), "hi".to_string()]);
        let out = Command::new(&v[0]).args(&v[1..]).output().unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout), "hi\n");
        let joined: i32 = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap().trim().parse().unwrap();
        assert_ne!(joined, std::process::id() as i32, "the child wrote its own PID, not the caller's");
        drop(cg);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn vmstat_reads_a_counter() {
        assert!(vmstat("pgfault").is_some());
        assert!(vmstat("no_such_counter").is_none());
    }

    #[test]
    fn balloon_fills_its_cgroup_and_dies_on_drop() {
        assert!(is_root(), "this test creates a cgroup and must run as root (CI does)");
        let _l = machine_lock();
        let cg = MemCgroup::new("testkit-balloon", 512 << 20).expect("cgroup");
        let b = Balloon::spawn(&cg, 32, Duration::from_millis(10)).expect("balloon");
        let pid = b.pid();
        assert!(b.alive());
        let procs = cg.group().procs().unwrap();
        assert!(procs.contains(&pid), "balloon {pid} not in {procs:?}");
        let usage = cg.group().usage().unwrap();
        assert!(usage >= 32 << 20, "cgroup usage {usage} < the balloon's 32 MiB");
        let mine = std::fs::read_to_string("/proc/self/cgroup").unwrap();
        assert!(
            !mine.contains(cg.dir().file_name().unwrap().to_str().unwrap()),
            "the test process must never join the cgroup"
        );
        drop(b);
        assert!(!Path::new(&format!("/proc/{pid}")).exists(), "balloon {pid} still exists after drop");
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
            // v1: `N:memory:/NAME`; v2: `0::/NAME`.
            assert!(
                text.lines().any(|l| (l.contains(":memory:") || l.starts_with("0::")) && l.contains(name)),
                "{text}"
            );
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
