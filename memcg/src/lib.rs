//! Memory cgroups behind one interface, with a cgroup v1 and a cgroup v2 backend.
//!
//! # Where the memory controller is ([`Hierarchy::detect`])
//!
//! 1. Override: `MOE_CGROUP_PARENT=DIR` ([`PARENT_ENV`]) makes groups under DIR, a directory of a
//!    cgroup filesystem; its version is that filesystem's (see [`version_of`]). For tests, and for
//!    hosts where the default parent is wrong (a v2 root whose processes must stay put, a delegated
//!    subtree).
//! 2. Otherwise `/proc/self/mountinfo` and `/proc/cgroups`. The `memory` line of /proc/cgroups must
//!    say `enabled 1` (0: the kernel was booted with `cgroup_disable=memory`). **v2** is a `cgroup2`
//!    mount whose `cgroup.controllers` lists `memory`; **v1** is a `cgroup` mount with `memory` in
//!    its super options. A controller is bound to one hierarchy at a time; should both be found,
//!    v2 wins. Groups are made directly under the mount point.
//!
//! Debian 11+ and most distributions mount only v2 (`/sys/fs/cgroup`). The development VM binds
//! the memory controller to v1 (`/sys/fs/cgroup/memory`; its v2 hierarchy at
//! `/sys/fs/cgroup/unified` has only `hugetlb`).
//!
//! # One interface, two sets of files ([`Group`])
//!
//! | operation | v1 | v2 |
//! |---|---|---|
//! | create ([`Hierarchy::create`]) | `mkdir` | the parent's `cgroup.controllers` must list `memory`; `+memory` is written to its `cgroup.subtree_control` when absent (refused for a non-root parent with processes of its own: the "no internal processes" rule); `mkdir` |
//! | memory limit | `memory.limit_in_bytes` | `memory.max` |
//! | swap limit (swap alone) | `memory.memsw.limit_in_bytes` = memory limit + swap limit (v1 limits the two together) | `memory.swap.max` |
//! | usage | `memory.usage_in_bytes` | `memory.current` |
//! | peak usage | `memory.max_usage_in_bytes` | `memory.peak` (Linux 5.19+) |
//! | stat | `memory.stat`, hierarchical `total_*` names mapped ([`StatKey`]) | `memory.stat` (hierarchical already); swap from `memory.swap.current` |
//! | events | `oom_kill` of `memory.oom_control` (4.13+), `max` = `memory.failcnt` + `memory.memsw.failcnt`; no `low`, `high`, `oom` counters | `memory.events` |
//! | proactive reclaim | unsupported (`memory.force_empty` empties a group without processes: not the same) | `memory.reclaim` (5.19+) |
//! | swappiness | `memory.swappiness` | unsupported (v2 uses the global `vm.swappiness`) |
//! | members, place a PID | `cgroup.procs` | `cgroup.procs` |
//! | kill the members | `SIGKILL` to each, until none is left | `cgroup.kill` (5.14+), else as v1 |
//! | remove (also on drop of a group this crate created) | kill, wait (5 s at most), `rmdir` | the same |
//!
//! A forked child joins a group itself, before `exec`, through [`ChildJoin`] (async-signal-safe);
//! [`Group::place`] refuses the calling process, so a caller is never moved into a group.
//!
//! Every error names the file or directory and says what to do ([`Error`]). The hierarchy's root
//! is a parameter ([`Hierarchy::new`], [`Group::open_as`]), so both backends run against a fake
//! cgroupfs tree of regular files (`tests/fake_tree.rs`).
//!
//! # What was checked where
//!
//! - Both backends, every operation: against a fake tree (`tests/fake_tree.rs`), with the kernel's
//!   part emulated as far as regular files allow (the test writes the interface files the kernel
//!   would create, and reads back what the crate wrote).
//! - v1, for real, on the development VM (`tests/real.rs`, as root): detection, create, limits,
//!   stat, a limit hit, a real OOM kill (against /proc/vmstat `oom_kill`), peak, place, members,
//!   kill, remove on drop; and through its users (testkit, `observer run --cgroup` with its OOM
//!   report in `observer/tests/cgroup.rs`, the pressure tests of the engine and the observer).
//! - v2, for real, on the development VM: everything that does not need the memory controller
//!   (filesystem detection, `cgroup.procs`, joining from a child, `cgroup.kill`, `rmdir`, and
//!   `observer run --cgroup` placing its child) in the cgroup2 mount `/sys/fs/cgroup/unified`,
//!   and the clear refusal to make a memory group there.
//! - v2 with the memory controller (`memory.max`, `memory.swap.max`, `memory.stat`,
//!   `memory.events`, `memory.reclaim`, `memory.peak`, `+memory` in `cgroup.subtree_control`),
//!   for real: in the kernel-matrix VM of a later issue, not here. The same tests run there
//!   unchanged: they use whichever backend [`Hierarchy::detect`] finds.

use std::{
    ffi::{CStr, CString},
    fmt, io,
    os::unix::ffi::OsStrExt,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

/// The environment variable that overrides where groups are made (a cgroup directory).
pub const PARENT_ENV: &str = "MOE_CGROUP_PARENT";

/// How long [`Group::remove`] waits for killed members to leave.
pub const REMOVE_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Version {
    V1,
    V2,
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Version::V1 => "cgroup v1",
            Version::V2 => "cgroup v2",
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{op} {}: {err}{}", path.display(), hint_suffix(hint))]
    Io { op: String, path: PathBuf, err: io::Error, hint: &'static str },
    #[error("no memory cgroup controller: {0}")]
    NoController(String),
    #[error("{what} is not available in {} ({version}): {hint}", path.display())]
    Unsupported { what: &'static str, path: PathBuf, version: Version, hint: &'static str },
    #[error("{}: {why}", path.display())]
    Refused { path: PathBuf, why: String },
    #[error("{}: unexpected contents {text:?}; is it a cgroup file?", path.display())]
    Parse { path: PathBuf, text: String },
}

fn hint_suffix(hint: &str) -> String {
    if hint.is_empty() { String::new() } else { format!(" ({hint})") }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What to do about a failed file operation, from the errno and the file.
fn hint(op: &str, path: &Path, err: &io::Error) -> &'static str {
    let file = path.file_name().and_then(|f| f.to_str()).unwrap_or("");
    match err.raw_os_error() {
        Some(libc::EACCES | libc::EPERM) => "needs root, or write access delegated to this cgroup tree",
        Some(libc::ENOENT) if op == "statfs" => "no such directory: give a cgroup directory under /sys/fs/cgroup",
        Some(libc::ENOENT) if op == "mkdir" => "the parent directory does not exist: is the cgroup filesystem mounted?",
        Some(libc::ENOENT) if file.starts_with("memory.") => {
            "the memory controller is not enabled in this group (v2: `+memory` in the parent's \
             cgroup.subtree_control; v1: a directory of the memory hierarchy), or the kernel is too old for this file"
        }
        Some(libc::ENOENT) => "no such cgroup file: is this a cgroup directory, and does it still exist?",
        Some(libc::EEXIST) => "a group of that name exists, perhaps left by an earlier run: remove it with rmdir",
        Some(libc::EBUSY | libc::ENOTEMPTY) if op == "rmdir" => "processes or child groups are still in it",
        Some(libc::EBUSY) if file == "cgroup.subtree_control" => {
            "cgroup v2 enables controllers only in groups without processes of their own, except the root: \
             choose another parent with MOE_CGROUP_PARENT"
        }
        Some(libc::ESRCH) => "no such process",
        Some(libc::EAGAIN) if file == "memory.reclaim" => "the kernel reclaimed less than asked",
        Some(libc::EINVAL) => {
            "the kernel rejected the value (v1: memory.memsw.limit_in_bytes must stay at least \
             memory.limit_in_bytes, so set the memory limit first)"
        }
        _ => "",
    }
}

fn io_err(op: impl Into<String>, path: &Path, err: io::Error) -> Error {
    let op = op.into();
    let hint = hint(&op, path, &err);
    Error::Io { op, path: path.to_path_buf(), err, hint }
}

fn read(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|e| io_err("reading", path, e))
}

/// Writes `value` in one `write(2)` to an existing file (cgroup interface files are never
/// created by writing; a regular file of a fake tree is truncated first).
fn write(path: &Path, value: &str) -> Result<()> {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(path)
        .map_err(|e| io_err("opening for writing", path, e))?;
    f.write_all(value.as_bytes()).map_err(|e| io_err(format!("writing {value:?} to"), path, e))
}

fn parse_u64(path: &Path, text: &str) -> Result<u64> {
    text.trim().parse().map_err(|_| Error::Parse { path: path.to_path_buf(), text: text.to_string() })
}

fn read_u64(path: &Path) -> Result<u64> {
    parse_u64(path, &read(path)?)
}

/// `KEY VALUE` lines (memory.stat, memory.events, memory.oom_control).
fn keyed(path: &Path, text: &str) -> Result<Vec<(String, u64)>> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let (k, v) = l.split_once(' ').ok_or_else(|| Error::Parse { path: path.to_path_buf(), text: l.into() })?;
            Ok((k.to_string(), parse_u64(path, v)?))
        })
        .collect()
}

fn has_word(list: &str, word: &str) -> bool {
    list.split_whitespace().any(|w| w == word)
}

/// The cgroup version of the filesystem `dir` is on (statfs: `CGROUP2_SUPER_MAGIC` is v2,
/// `CGROUP_SUPER_MAGIC` is v1); an error for any other filesystem.
pub fn version_of(dir: &Path) -> Result<Version> {
    let c = CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| Error::Refused { path: dir.to_path_buf(), why: "the path contains a NUL byte".into() })?;
    // SAFETY: zeroed statfs is a valid out-parameter.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid C string and out-pointer.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return Err(io_err("statfs", dir, io::Error::last_os_error()));
    }
    match st.f_type {
        libc::CGROUP2_SUPER_MAGIC => Ok(Version::V2),
        libc::CGROUP_SUPER_MAGIC => Ok(Version::V1),
        other => Err(Error::Refused {
            path: dir.to_path_buf(),
            why: format!(
                "not a cgroup directory (filesystem type {other:#x}, neither cgroup2 {:#x} nor cgroup {:#x}): \
                 give a directory under /sys/fs/cgroup",
                libc::CGROUP2_SUPER_MAGIC,
                libc::CGROUP_SUPER_MAGIC
            ),
        }),
    }
}

/// A mount of /proc/self/mountinfo: mount point, filesystem type, super options.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Mount {
    point: PathBuf,
    fstype: String,
    superopts: String,
}

/// `\040`-style octal escapes of mountinfo paths.
fn unescape(s: &str) -> PathBuf {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b.get(i + 1..i + 4).filter(|d| b[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match octal {
            Some(d) => {
                out.push(d.iter().fold(0u8, |a, c| a.wrapping_mul(8).wrapping_add(c - b'0')));
                i += 4;
            }
            None => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    PathBuf::from(std::ffi::OsStr::from_bytes(&out))
}

/// `ID PARENT MAJ:MIN ROOT POINT OPTS [OPTIONAL…] - FSTYPE SOURCE SUPEROPTS` lines.
fn mounts(mountinfo: &str) -> Vec<Mount> {
    mountinfo
        .lines()
        .filter_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            let point = left.split(' ').nth(4)?;
            let mut r = right.split(' ');
            let fstype = r.next()?.to_string();
            let superopts = r.nth(1).unwrap_or("").to_string();
            Some(Mount { point: unescape(point), fstype, superopts })
        })
        .collect()
}

/// Where groups are made: a directory of a hierarchy that has the memory controller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hierarchy {
    version: Version,
    parent: PathBuf,
}

impl Hierarchy {
    /// Groups of `version` under `parent` (any directory: a fake tree in tests).
    pub fn new(version: Version, parent: impl Into<PathBuf>) -> Hierarchy {
        Hierarchy { version, parent: parent.into() }
    }

    /// The memory controller of this machine (see the module doc), or [`PARENT_ENV`].
    pub fn detect() -> Result<Hierarchy> {
        if let Some(dir) = std::env::var_os(PARENT_ENV) {
            let dir = PathBuf::from(dir);
            let version = version_of(&dir).map_err(|e| Error::NoController(format!("{PARENT_ENV}: {e}")))?;
            return Ok(Hierarchy { version, parent: dir });
        }
        let mountinfo = read(Path::new("/proc/self/mountinfo"))?;
        let cgroups = std::fs::read_to_string("/proc/cgroups").ok();
        Self::from_mounts(&mountinfo, cgroups.as_deref(), |d| {
            std::fs::read_to_string(d.join("cgroup.controllers")).ok()
        })
    }

    /// [`Hierarchy::detect`] from the texts of /proc/self/mountinfo and /proc/cgroups (absent: not
    /// consulted), with `controllers(dir)` reading a v2 mount's `cgroup.controllers`.
    pub fn from_mounts(
        mountinfo: &str,
        proc_cgroups: Option<&str>,
        controllers: impl Fn(&Path) -> Option<String>,
    ) -> Result<Hierarchy> {
        let memory_line = proc_cgroups.and_then(|t| t.lines().find(|l| l.split_whitespace().next() == Some("memory")));
        if let Some(l) = memory_line
            && l.split_whitespace().nth(3) == Some("0")
        {
            return Err(Error::NoController(
                "/proc/cgroups says the memory controller is disabled (booted with cgroup_disable=memory?): \
                 remove that from the kernel command line"
                    .into(),
            ));
        }
        let all = mounts(mountinfo);
        let mut seen = Vec::new();
        for m in all.iter().filter(|m| m.fstype == "cgroup2") {
            let ctl = controllers(&m.point).unwrap_or_default();
            if has_word(&ctl, "memory") {
                return Ok(Hierarchy { version: Version::V2, parent: m.point.clone() });
            }
            seen.push(format!("cgroup2 at {} with controllers [{}]", m.point.display(), ctl.trim()));
        }
        if let Some(m) = all.iter().find(|m| m.fstype == "cgroup" && m.superopts.split(',').any(|o| o == "memory")) {
            return Ok(Hierarchy { version: Version::V1, parent: m.point.clone() });
        }
        Err(Error::NoController(format!(
            "no cgroup2 mount lists memory in cgroup.controllers and no cgroup v1 mount has it ({}): \
             mount cgroup2 (`mount -t cgroup2 none /sys/fs/cgroup`) or the v1 controller \
             (`mount -t cgroup -o memory none /sys/fs/cgroup/memory`), or name a parent with {PARENT_ENV}",
            if seen.is_empty() { "no cgroup2 mount either".to_string() } else { seen.join("; ") }
        )))
    }

    pub fn version(&self) -> Version {
        self.version
    }

    pub fn parent(&self) -> &Path {
        &self.parent
    }

    /// E.g. `cgroup v1 (groups under /sys/fs/cgroup/memory)`.
    pub fn describe(&self) -> String {
        format!("{} (groups under {})", self.version, self.parent.display())
    }

    /// A new group `parent/name` with the memory controller, removed when the [`Group`] drops.
    pub fn create(&self, name: &str) -> Result<Group> {
        if name.is_empty() || name == "." || name == ".." || name.contains('/') {
            return Err(Error::Refused {
                path: self.parent.clone(),
                why: format!("{name:?} is not a group name (one path component)"),
            });
        }
        if self.version == Version::V2 {
            self.enable_memory()?;
        }
        let dir = self.parent.join(name);
        std::fs::create_dir(&dir).map_err(|e| io_err("mkdir", &dir, e))?;
        Ok(Group { dir, version: self.version, owned: true })
    }

    /// v2: the memory controller in the parent's `cgroup.subtree_control`, so that children get it.
    fn enable_memory(&self) -> Result<()> {
        let p = &self.parent;
        let ctl = read(&p.join("cgroup.controllers"))?;
        if !has_word(&ctl, "memory") {
            return Err(Error::Refused {
                path: p.join("cgroup.controllers"),
                why: format!(
                    "lists [{}] without memory: the memory controller is bound to cgroup v1, disabled, or not \
                     enabled in the parent's own parent (its cgroup.subtree_control); choose a parent that has it \
                     with {PARENT_ENV}",
                    ctl.trim()
                ),
            });
        }
        let sub_path = p.join("cgroup.subtree_control");
        if has_word(&read(&sub_path)?, "memory") {
            return Ok(());
        }
        // Only non-root groups have cgroup.type; the root is exempt from the rule.
        if p.join("cgroup.type").exists() {
            let procs = read(&p.join("cgroup.procs"))?;
            let pids: Vec<&str> = procs.split_whitespace().collect();
            if !pids.is_empty() {
                return Err(internal_processes(&sub_path, &pids));
            }
        }
        write(&sub_path, "+memory").map_err(|e| match e {
            Error::Io { err, .. } if err.raw_os_error() == Some(libc::EBUSY) => {
                let procs = std::fs::read_to_string(p.join("cgroup.procs")).unwrap_or_default();
                internal_processes(&sub_path, &procs.split_whitespace().collect::<Vec<_>>())
            }
            e => e,
        })
    }

    /// An existing group `parent/name`, left in place on drop.
    pub fn open(&self, name: &str) -> Result<Group> {
        Group::open_as(self.version, &self.parent.join(name))
    }
}

fn internal_processes(subtree_control: &Path, pids: &[&str]) -> Error {
    Error::Refused {
        path: subtree_control.to_path_buf(),
        why: format!(
            "cannot enable the memory controller: the group has processes of its own ({} of them: {}) and cgroup v2 \
             enables controllers only in groups without processes, except the root; move them into a child group, \
             or choose another parent with {PARENT_ENV}",
            pids.len(),
            pids.iter().take(8).copied().collect::<Vec<_>>().join(" ")
        ),
    }
}

/// The normalised `memory.stat` keys callers use, and their names in each version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum StatKey {
    /// Anonymous memory (v1 `rss` also counts the swap cache; v2 `anon` does not, see `Swapcached`).
    Anon,
    /// Page cache, shmem included (v1 `cache`, v2 `file`).
    File,
    Shmem,
    FileMapped,
    FileDirty,
    FileWriteback,
    Swapcached,
    ActiveAnon,
    InactiveAnon,
    ActiveFile,
    InactiveFile,
    Unevictable,
    WorkingsetRefaultAnon,
    WorkingsetRefaultFile,
    /// Bytes of the group's memory in swap (v1 `swap` of memory.stat, v2 `memory.swap.current`).
    Swap,
    /// Event counts, not bytes.
    PgFault,
    PgMajFault,
}

impl StatKey {
    pub const ALL: [StatKey; 17] = [
        StatKey::Anon,
        StatKey::File,
        StatKey::Shmem,
        StatKey::FileMapped,
        StatKey::FileDirty,
        StatKey::FileWriteback,
        StatKey::Swapcached,
        StatKey::ActiveAnon,
        StatKey::InactiveAnon,
        StatKey::ActiveFile,
        StatKey::InactiveFile,
        StatKey::Unevictable,
        StatKey::WorkingsetRefaultAnon,
        StatKey::WorkingsetRefaultFile,
        StatKey::Swap,
        StatKey::PgFault,
        StatKey::PgMajFault,
    ];

    /// The name in v1 memory.stat (read as `total_NAME`, the group with its descendants, when
    /// present) and in v2 memory.stat (hierarchical already); `None`: read from another file.
    pub fn names(self) -> (&'static str, Option<&'static str>) {
        match self {
            StatKey::Anon => ("rss", Some("anon")),
            StatKey::File => ("cache", Some("file")),
            StatKey::Shmem => ("shmem", Some("shmem")),
            StatKey::FileMapped => ("mapped_file", Some("file_mapped")),
            StatKey::FileDirty => ("dirty", Some("file_dirty")),
            StatKey::FileWriteback => ("writeback", Some("file_writeback")),
            StatKey::Swapcached => ("swapcached", Some("swapcached")),
            StatKey::ActiveAnon => ("active_anon", Some("active_anon")),
            StatKey::InactiveAnon => ("inactive_anon", Some("inactive_anon")),
            StatKey::ActiveFile => ("active_file", Some("active_file")),
            StatKey::InactiveFile => ("inactive_file", Some("inactive_file")),
            StatKey::Unevictable => ("unevictable", Some("unevictable")),
            StatKey::WorkingsetRefaultAnon => ("workingset_refault_anon", Some("workingset_refault_anon")),
            StatKey::WorkingsetRefaultFile => ("workingset_refault_file", Some("workingset_refault_file")),
            StatKey::Swap => ("swap", None),
            StatKey::PgFault => ("pgfault", Some("pgfault")),
            StatKey::PgMajFault => ("pgmajfault", Some("pgmajfault")),
        }
    }
}

/// A group's memory statistics under [`StatKey`] names; a key the kernel did not report is
/// absent (`None`), never 0.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stat(std::collections::BTreeMap<StatKey, u64>);

impl Stat {
    pub fn get(&self, key: StatKey) -> Option<u64> {
        self.0.get(&key).copied()
    }

    /// From the text of memory.stat (and, for v2, of memory.swap.current).
    pub fn parse(version: Version, path: &Path, memory_stat: &str, swap_current: Option<u64>) -> Result<Stat> {
        let raw: std::collections::HashMap<String, u64> = keyed(path, memory_stat)?.into_iter().collect();
        let mut s = std::collections::BTreeMap::new();
        for key in StatKey::ALL {
            let v = match (version, key.names()) {
                (Version::V1, (n, _)) => raw.get(&format!("total_{n}")).or_else(|| raw.get(n)).copied(),
                (Version::V2, (_, Some(n))) => raw.get(n).copied(),
                (Version::V2, (_, None)) => swap_current,
            };
            if let Some(v) = v {
                s.insert(key, v);
            }
        }
        Ok(Stat(s))
    }
}

/// Counters of a group's memory events since it was created; `None`: not counted by this
/// version or kernel.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Events {
    /// Reclaimed while under its `memory.low` protection (v2 only).
    pub low: Option<u64>,
    /// Throttled at `memory.high` (v2 only).
    pub high: Option<u64>,
    /// Usage about to exceed the limit (v2 `max`; v1 failed charges at a limit: `memory.failcnt`
    /// plus `memory.memsw.failcnt`, where a charge that fails at the memory+swap limit counts).
    pub max: Option<u64>,
    /// Out of memory at the limit (v2 only; v1 shows a state, `under_oom`, not a count).
    pub oom: Option<u64>,
    /// Processes killed by the OOM killer (v2 `oom_kill`; v1 `oom_kill` of memory.oom_control, 4.13+).
    pub oom_kill: Option<u64>,
}

/// A group's `cgroup.procs`, prepared before `fork` for the child to join itself.
#[derive(Debug, Clone)]
pub struct ChildJoin(CString);

impl ChildJoin {
    pub fn path(&self) -> &CStr {
        &self.0
    }

    /// Writes the calling process's PID to the group's `cgroup.procs`, moving it there. Only
    /// async-signal-safe calls, no allocation: for a freshly forked child before `exec`.
    /// Returns the errno on failure.
    ///
    /// # Safety
    /// Call it in a forked child (it moves the calling process), where only async-signal-safe
    /// functions may run.
    pub unsafe fn join(&self) -> Result<(), i32> {
        // SAFETY: raw system calls on a valid C string and stack buffers.
        unsafe {
            let fd = libc::open(self.0.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
            if fd < 0 {
                return Err(*libc::__errno_location());
            }
            let mut buf = [0u8; 16];
            let mut pid = libc::getpid() as u32;
            let mut i = buf.len();
            loop {
                i -= 1;
                buf[i] = b'0' + (pid % 10) as u8;
                pid /= 10;
                if pid == 0 {
                    break;
                }
            }
            let n = buf.len() - i;
            let r = libc::write(fd, buf.as_ptr().add(i).cast(), n);
            let errno = *libc::__errno_location();
            libc::close(fd);
            if r == n as isize { Ok(()) } else { Err(if r < 0 { errno } else { libc::EIO }) }
        }
    }
}

/// A memory cgroup (a directory of a cgroup hierarchy). One made by [`Hierarchy::create`] is
/// removed on drop (members killed first); one opened with [`Group::open`] is left alone.
#[derive(Debug)]
pub struct Group {
    dir: PathBuf,
    version: Version,
    owned: bool,
}

impl Group {
    /// An existing group; its version from its filesystem ([`version_of`]).
    pub fn open(dir: &Path) -> Result<Group> {
        Group::open_as(version_of(dir)?, dir)
    }

    /// An existing group of `version` (any directory with a `cgroup.procs`: a fake tree in tests).
    pub fn open_as(version: Version, dir: &Path) -> Result<Group> {
        let procs = dir.join("cgroup.procs");
        if !procs.exists() {
            return Err(Error::Refused {
                path: dir.to_path_buf(),
                why: "no cgroup.procs there: not a cgroup directory (give one under /sys/fs/cgroup)".into(),
            });
        }
        Ok(Group { dir: dir.to_path_buf(), version, owned: false })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn version(&self) -> Version {
        self.version
    }

    /// The interface file named `v1` or `v2` for this group's version.
    fn file(&self, v1: &str, v2: &str) -> PathBuf {
        self.dir.join(match self.version {
            Version::V1 => v1,
            Version::V2 => v2,
        })
    }

    /// An interface file that exists, or [`Error::Unsupported`] saying what is missing.
    fn optional(&self, v1: Option<&str>, v2: Option<&str>, what: &'static str, hint: &'static str) -> Result<PathBuf> {
        let name = match self.version {
            Version::V1 => v1,
            Version::V2 => v2,
        };
        match name.map(|n| self.dir.join(n)) {
            Some(p) if p.exists() => Ok(p),
            _ => Err(Error::Unsupported { what, path: self.dir.clone(), version: self.version, hint }),
        }
    }

    /// Whether the memory controller's files are here (a v1 directory of another controller's
    /// hierarchy, or a v2 group without `+memory` in its parent, has none).
    pub fn has_memory(&self) -> bool {
        self.file("memory.limit_in_bytes", "memory.max").exists()
    }

    /// The memory limit (v1 `memory.limit_in_bytes`, v2 `memory.max`).
    pub fn set_limit(&self, bytes: u64) -> Result<()> {
        write(&self.file("memory.limit_in_bytes", "memory.max"), &bytes.to_string())
    }

    /// The memory limit; `None`: unlimited.
    pub fn limit(&self) -> Result<Option<u64>> {
        let p = self.file("memory.limit_in_bytes", "memory.max");
        limit_value(&p, &read(&p)?)
    }

    /// The limit of swap alone; `None`: unlimited. v1 limits memory and swap together
    /// (`memory.memsw.limit_in_bytes`): set the memory limit first, this adds `bytes` to it.
    pub fn set_swap_limit(&self, bytes: Option<u64>) -> Result<()> {
        const HINT: &str = "swap accounting is off: boot with swapaccount=1 (v1) or a kernel with CONFIG_MEMCG_SWAP";
        let p = self.optional(Some("memory.memsw.limit_in_bytes"), Some("memory.swap.max"), "a swap limit", HINT)?;
        let value = match (self.version, bytes) {
            (Version::V1, None) => "-1".to_string(),
            (Version::V2, None) => "max".to_string(),
            (Version::V2, Some(b)) => b.to_string(),
            (Version::V1, Some(b)) => match self.limit()? {
                Some(limit) => (limit + b).to_string(),
                None => {
                    return Err(Error::Refused {
                        path: p,
                        why: "cgroup v1 limits memory and swap together: set the memory limit first".into(),
                    });
                }
            },
        };
        write(&p, &value)
    }

    /// v1 `memory.swappiness`; v2 has none (the global `vm.swappiness` applies).
    pub fn set_swappiness(&self, value: u32) -> Result<()> {
        let p = self.optional(
            Some("memory.swappiness"),
            None,
            "a per-group swappiness",
            "cgroup v2 uses the global vm.swappiness (sysctl)",
        )?;
        write(&p, &value.to_string())
    }

    /// Bytes charged to the group now (v1 `memory.usage_in_bytes`, v2 `memory.current`).
    pub fn usage(&self) -> Result<u64> {
        read_u64(&self.file("memory.usage_in_bytes", "memory.current"))
    }

    /// The largest usage since the group was made (v1 `memory.max_usage_in_bytes`, v2 `memory.peak`).
    pub fn peak(&self) -> Result<u64> {
        read_u64(&self.optional(
            Some("memory.max_usage_in_bytes"),
            Some("memory.peak"),
            "peak usage",
            "memory.peak needs Linux 5.19",
        )?)
    }

    pub fn stat(&self) -> Result<Stat> {
        let p = self.dir.join("memory.stat");
        let text = read(&p)?;
        let swap = match self.version {
            Version::V1 => None,
            Version::V2 => {
                let s = self.dir.join("memory.swap.current");
                if s.exists() { Some(read_u64(&s)?) } else { None }
            }
        };
        Stat::parse(self.version, &p, &text, swap)
    }

    pub fn events(&self) -> Result<Events> {
        match self.version {
            Version::V2 => {
                let p = self.dir.join("memory.events");
                let kv = keyed(&p, &read(&p)?)?;
                let get = |k: &str| kv.iter().find(|(n, _)| n == k).map(|(_, v)| *v);
                Ok(Events {
                    low: get("low"),
                    high: get("high"),
                    max: get("max"),
                    oom: get("oom"),
                    oom_kill: get("oom_kill"),
                })
            }
            Version::V1 => {
                let p = self.dir.join("memory.oom_control");
                let kv = keyed(&p, &read(&p)?)?;
                let oom_kill = kv.iter().find(|(n, _)| n == "oom_kill").map(|(_, v)| *v);
                // A charge that fails at the memory+swap limit is counted in memsw.failcnt only.
                let memsw = self.dir.join("memory.memsw.failcnt");
                let memsw = if memsw.exists() { read_u64(&memsw)? } else { 0 };
                let max = read_u64(&self.dir.join("memory.failcnt"))? + memsw;
                Ok(Events { max: Some(max), oom_kill, ..Events::default() })
            }
        }
    }

    /// Proactive reclaim of `bytes` from the group (v2 `memory.reclaim`).
    pub fn reclaim(&self, bytes: u64) -> Result<()> {
        let p = self.optional(
            None,
            Some("memory.reclaim"),
            "proactive reclaim",
            "memory.reclaim is cgroup v2 only, Linux 5.19+ (v1's memory.force_empty empties a group \
             without processes, which is not the same)",
        )?;
        write(&p, &bytes.to_string())
    }

    /// The PIDs in the group (`cgroup.procs`).
    pub fn procs(&self) -> Result<Vec<i32>> {
        let p = self.dir.join("cgroup.procs");
        let text = read(&p)?;
        text.split_whitespace()
            .map(|s| s.parse().map_err(|_| Error::Parse { path: p.clone(), text: text.clone() }))
            .collect()
    }

    /// Moves process `pid` into the group. Refuses the calling process itself: a command joins
    /// from inside its own child ([`Group::child_join`]), the caller never moves.
    pub fn place(&self, pid: i32) -> Result<()> {
        if pid == std::process::id() as i32 {
            return Err(Error::Refused {
                path: self.dir.clone(),
                why: format!(
                    "refusing to move the calling process ({pid}) into the group: start the command in a child \
                     that joins it before exec (ChildJoin)"
                ),
            });
        }
        write(&self.dir.join("cgroup.procs"), &pid.to_string())
    }

    /// The group's `cgroup.procs` prepared for a forked child to join ([`ChildJoin::join`]).
    pub fn child_join(&self) -> Result<ChildJoin> {
        let p = self.dir.join("cgroup.procs");
        CString::new(p.as_os_str().as_bytes())
            .map(ChildJoin)
            .map_err(|_| Error::Refused { path: p, why: "the path contains a NUL byte".into() })
    }

    /// Sends `SIGKILL` to every member: v2 `cgroup.kill` when the kernel has it (it also catches
    /// processes forked meanwhile), else to each PID of `cgroup.procs`.
    pub fn kill(&self) -> Result<()> {
        let kill = self.dir.join("cgroup.kill");
        if self.version == Version::V2 && kill.exists() {
            return write(&kill, "1");
        }
        for pid in self.live_members()? {
            // SAFETY: kill(2) of processes in a group this caller manages.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        Ok(())
    }

    /// Members that have not exited (a zombie has released its memory; it only waits for its
    /// parent). A group whose `cgroup.procs` is gone (removed meanwhile) has none.
    fn live_members(&self) -> Result<Vec<i32>> {
        match self.procs() {
            Ok(pids) => Ok(pids.into_iter().filter(|&p| !exited(p)).collect()),
            Err(Error::Io { err, .. }) if err.kind() == io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(e) => Err(e),
        }
    }

    /// Kills the members and waits until none is left, at most `timeout`.
    pub fn kill_and_wait(&self, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        loop {
            self.kill()?;
            let left = self.live_members()?;
            if left.is_empty() {
                return Ok(());
            }
            if start.elapsed() > timeout {
                return Err(Error::Refused {
                    path: self.dir.clone(),
                    why: format!(
                        "{} processes still in the group {:.1} s after SIGKILL (PIDs {left:?}): check them with ps",
                        left.len(),
                        timeout.as_secs_f64()
                    ),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills the members, waits for them ([`REMOVE_TIMEOUT`]) and removes the directory.
    pub fn remove(mut self) -> Result<()> {
        self.owned = false;
        self.remove_now()
    }

    fn remove_now(&self) -> Result<()> {
        if !self.dir.exists() {
            return Ok(());
        }
        self.kill_and_wait(REMOVE_TIMEOUT)?;
        // An exiting member may keep the group populated for a moment after it left cgroup.procs.
        let start = Instant::now();
        loop {
            match std::fs::remove_dir(&self.dir) {
                Ok(()) => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) && start.elapsed() < Duration::from_secs(1) => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                Err(e) => return Err(io_err("rmdir", &self.dir, e)),
            }
        }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        if self.owned
            && let Err(e) = self.remove_now()
        {
            eprintln!("memcg: could not remove the group: {e}; remove it with `rmdir {}`", self.dir.display());
        }
    }
}

/// A limit file's value; `None` for unlimited (v2 `max`; v1 the page counter's maximum, which
/// reads as a number near 2^63).
fn limit_value(path: &Path, text: &str) -> Result<Option<u64>> {
    if text.trim() == "max" {
        return Ok(None);
    }
    let v = parse_u64(path, text)?;
    Ok((v < 1 << 62).then_some(v))
}

/// Whether `pid` has exited (no /proc entry, or a zombie).
fn exited(pid: i32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return true };
    // The state follows the command name in parentheses, which may itself contain ") ".
    stat.rsplit_once(") ").is_none_or(|(_, rest)| rest.starts_with('Z') || rest.starts_with('X'))
}

/// Counts the OOM kills of a group over a run: read before, compared after.
#[derive(Debug, Clone)]
pub struct OomWatch {
    dir: PathBuf,
    version: Version,
    before: u64,
}

impl OomWatch {
    /// Reads the group's OOM-kill counter now; an error when the group has none (no memory
    /// controller there, or a v1 kernel older than 4.13).
    pub fn start(group: &Group) -> Result<OomWatch> {
        let before = oom_kills(group)?;
        Ok(OomWatch { dir: group.dir.clone(), version: group.version, before })
    }

    /// OOM kills in the group since [`OomWatch::start`].
    pub fn kills(&self) -> Result<u64> {
        let g = Group { dir: self.dir.clone(), version: self.version, owned: false };
        Ok(oom_kills(&g)?.saturating_sub(self.before))
    }
}

fn oom_kills(group: &Group) -> Result<u64> {
    group.events()?.oom_kill.ok_or_else(|| Error::Unsupported {
        what: "an OOM-kill counter",
        path: group.dir.clone(),
        version: group.version,
        hint: "memory.oom_control has no oom_kill line before Linux 4.13",
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO_V1: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";
    const MOUNTINFO_V2: &str = "\
22 1 0:21 / /proc rw,nosuid,nodev,noexec,relatime shared:12 - proc proc rw
26 25 0:24 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot
";
    const CGROUPS: &str = "#subsys_name\thierarchy\tnum_cgroups\tenabled\ncpu\t1\t1\t1\nmemory\t4\t49\t1\n";

    #[test]
    fn detects_v1_when_v2_lacks_memory() {
        let h = Hierarchy::from_mounts(MOUNTINFO_V1, Some(CGROUPS), |_| Some("hugetlb\n".into())).unwrap();
        assert_eq!(h, Hierarchy::new(Version::V1, "/sys/fs/cgroup/memory"));
        assert_eq!(h.describe(), "cgroup v1 (groups under /sys/fs/cgroup/memory)");
    }

    #[test]
    fn detects_v2_and_prefers_it() {
        let ctl = |d: &Path| (d == Path::new("/sys/fs/cgroup")).then(|| "cpuset cpu io memory pids\n".to_string());
        let h = Hierarchy::from_mounts(MOUNTINFO_V2, None, ctl).unwrap();
        assert_eq!(h, Hierarchy::new(Version::V2, "/sys/fs/cgroup"));
        // Both at once (not a state a kernel reaches, but the rule is v2 first).
        let both = format!("{MOUNTINFO_V1}{MOUNTINFO_V2}");
        let h = Hierarchy::from_mounts(&both, Some(CGROUPS), ctl).unwrap();
        assert_eq!(h.version(), Version::V2);
    }

    #[test]
    fn no_controller_is_a_clear_error() {
        let e = Hierarchy::from_mounts(MOUNTINFO_V2, None, |_| Some("cpu io\n".into())).unwrap_err().to_string();
        assert!(e.contains("cgroup2 at /sys/fs/cgroup with controllers [cpu io]"), "{e}");
        assert!(e.contains("MOE_CGROUP_PARENT"), "{e}");
        let disabled = CGROUPS.replace("memory\t4\t49\t1", "memory\t0\t1\t0");
        let e = Hierarchy::from_mounts(MOUNTINFO_V1, Some(&disabled), |_| None).unwrap_err().to_string();
        assert!(e.contains("cgroup_disable=memory"), "{e}");
    }

    #[test]
    fn mountinfo_escapes_and_optional_fields() {
        let m = mounts("36 25 0:31 / /mnt/a\\040b rw shared:5 master:1 - cgroup cgroup rw,memory,cpu\nbroken line\n");
        assert_eq!(
            m,
            vec![Mount {
                point: PathBuf::from("/mnt/a b"),
                fstype: "cgroup".into(),
                superopts: "rw,memory,cpu".into()
            }]
        );
    }

    #[test]
    fn stat_names_map_per_version() {
        let v1 = "cache 100\nrss 200\nswap 300\npgmajfault 4\ntotal_cache 1100\ntotal_rss 1200\ntotal_swap 1300\n";
        let s = Stat::parse(Version::V1, Path::new("memory.stat"), v1, None).unwrap();
        assert_eq!(s.get(StatKey::File), Some(1100), "v1 reads the hierarchical total_ value");
        assert_eq!(s.get(StatKey::Anon), Some(1200));
        assert_eq!(s.get(StatKey::Swap), Some(1300));
        assert_eq!(s.get(StatKey::PgMajFault), Some(4), "no total_pgmajfault: the local value");
        assert_eq!(s.get(StatKey::Shmem), None, "absent, not 0");
        let v2 = "anon 10\nfile 20\nfile_mapped 5\npgmajfault 7\nswap 99\n";
        let s = Stat::parse(Version::V2, Path::new("memory.stat"), v2, Some(4096)).unwrap();
        assert_eq!(
            (s.get(StatKey::Anon), s.get(StatKey::File), s.get(StatKey::FileMapped)),
            (Some(10), Some(20), Some(5))
        );
        assert_eq!(s.get(StatKey::Swap), Some(4096), "v2 swap is memory.swap.current, not a memory.stat line");
        assert!(Stat::parse(Version::V2, Path::new("x"), "anon ten\n", None).is_err());
    }

    #[test]
    fn limit_values() {
        let p = Path::new("memory.max");
        assert_eq!(limit_value(p, "max\n").unwrap(), None);
        assert_eq!(limit_value(p, "9223372036854771712\n").unwrap(), None);
        assert_eq!(limit_value(p, "67108864\n").unwrap(), Some(64 << 20));
    }

    #[test]
    fn exited_sees_zombies_and_missing_pids() {
        assert!(!exited(std::process::id() as i32));
        assert!(exited(i32::MAX));
    }

    #[test]
    fn version_of_refuses_other_filesystems() {
        let e = version_of(Path::new("/proc")).unwrap_err().to_string();
        assert!(e.contains("not a cgroup directory") && e.contains("/proc"), "{e}");
    }
}
