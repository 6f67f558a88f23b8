//! The observed process: spawned by us (held before `exec` until the probes are
//! attached, so nothing it does is missed) or an existing PID.

use std::{
    ffi::{CString, OsStr, OsString},
    io,
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd},
        unix::{ffi::OsStrExt, ffi::OsStringExt, fs::PermissionsExt},
    },
    time::Duration,
};

use anyhow::{Context, Result, bail};
use tokio::io::unix::AsyncFd;

/// A process under observation. Either way its exit is seen through a pidfd.
#[derive(Debug)]
pub struct Target {
    pid: u32,
    pidfd: AsyncFd<OwnedFd>,
    /// Spawned by us: the pipe end that releases it into `exec`, and the pipe
    /// on which a failed `exec` reports its errno.
    spawned: Option<Spawned>,
}

#[derive(Debug)]
struct Spawned {
    release: Option<OwnedFd>,
    exec_error: OwnedFd,
    program: String,
    path: std::path::PathBuf,
    cgroup: Option<InCgroup>,
    /// Kills the target and its descendants if the observer dies (`guard`).
    _guard: super::guard::Guard,
}

/// The cgroup a spawned child joins (`--cgroup`), with its OOM-kill counter as
/// it was before the run.
#[derive(Debug)]
struct InCgroup {
    group: memcg::Group,
    oom: Option<memcg::OomWatch>,
}

impl InCgroup {
    fn open(dir: &std::path::Path) -> Result<Self> {
        let group = memcg::Group::open(dir).with_context(|| format!("--cgroup {}", dir.display()))?;
        let oom = match memcg::OomWatch::start(&group) {
            Ok(w) => Some(w),
            Err(e) => {
                log::warn!("--cgroup: {e}; an OOM kill of the target there cannot be reported");
                None
            }
        };
        Ok(InCgroup { group, oom })
    }
}

/// How the target ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// Exit status code, or 128 + signal.
    Exited(i32),
    /// The target went away but it was not our child (attach mode).
    Gone,
}

fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    // SAFETY: plain syscall with integer arguments.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just handed us this descriptor.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

fn register(fd: OwnedFd) -> Result<AsyncFd<OwnedFd>> {
    // SAFETY: we own `fd` and hand it to the AsyncFd, which keeps it open for
    // as long as it is registered.
    unsafe { AsyncFd::register(fd) }.map_err(|e| e.into_parts().1).context("registering pidfd")
}

fn pipe() -> Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0i32; 2];
    // SAFETY: fds is a valid 2-element array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error()).context("pipe2");
    }
    // SAFETY: fresh descriptors from pipe2.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// `prog` as `execvp` would find it, resolved before `fork` (after it only
/// async-signal-safe calls are allowed).
fn resolve_program(prog: &OsStr) -> Result<CString> {
    let bytes = prog.as_bytes();
    let executable = is_executable;
    let found = if bytes.contains(&b'/') {
        let p = std::path::PathBuf::from(prog);
        match p.metadata() {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                bail!("cannot start `{}`: no such file", prog.to_string_lossy())
            }
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied => bail!(
                "cannot start `{}`: permission denied (a directory on its path is not searchable by this user; \
                 check with `namei -l {}`)",
                prog.to_string_lossy(),
                prog.to_string_lossy()
            ),
            Err(e) => bail!("cannot start `{}`: {e}", prog.to_string_lossy()),
        }
        if !executable(&p) {
            bail!("cannot start `{}`: not an executable file", prog.to_string_lossy());
        }
        Some(p)
    } else {
        std::env::var_os("PATH")
            .and_then(|path| std::env::split_paths(&path).map(|d| d.join(prog)).find(|p| executable(p)))
    };
    let Some(path) = found else {
        bail!("cannot start `{}`: command not found in PATH", prog.to_string_lossy());
    };
    CString::new(path.into_os_string().into_vec())
        .with_context(|| format!("command `{}` contains a NUL byte", prog.to_string_lossy()))
}

/// The programs a command line names, in order: every word of its arguments (split at blanks
/// and shell punctuation, an assignment's value after `=`) that is a path to an executable file,
/// or a name found in `PATH`. At most [`MAX_NAMED`] words are looked at.
pub fn named_programs(cmd: &[OsString]) -> Vec<std::path::PathBuf> {
    let path_dirs: Vec<std::path::PathBuf> =
        std::env::var_os("PATH").map(|p| std::env::split_paths(&p).collect()).unwrap_or_default();
    let mut out: Vec<std::path::PathBuf> = Vec::new();
    let words = cmd.iter().skip(1).flat_map(|a| {
        a.as_bytes()
            .split(|b| b.is_ascii_whitespace() || b";|&()<>'\"`=$".contains(b))
            .filter(|w| !w.is_empty() && !w.starts_with(b"-"))
            .map(|w| std::path::PathBuf::from(OsStr::from_bytes(w)))
            .collect::<Vec<_>>()
    });
    for w in words.take(MAX_NAMED) {
        let found = if w.as_os_str().as_bytes().contains(&b'/') {
            is_executable(&w).then_some(w)
        } else {
            path_dirs.iter().map(|d| d.join(&w)).find(|p| is_executable(p))
        };
        if let Some(p) = found
            && !out.contains(&p)
        {
            out.push(p);
        }
    }
    out
}

/// The words of a command line [`named_programs`] looks at.
const MAX_NAMED: usize = 64;

/// A regular file with an execute bit.
fn is_executable(p: &std::path::Path) -> bool {
    p.metadata().map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0).unwrap_or(false)
}

impl Target {
    /// Fork `cmd`, with the child blocked before `exec` until [`Target::release`],
    /// so that the probes see everything it does.
    pub fn spawn(cmd: &[OsString]) -> Result<Self> {
        Self::spawn_in(cmd, None)
    }

    /// Like [`Target::spawn`], with the child joining the cgroup `DIR` (v1 or v2,
    /// from its filesystem) before `exec`, through its `cgroup.procs`. Only the
    /// child moves, never the observer.
    pub fn spawn_in(cmd: &[OsString], cgroup: Option<&std::path::Path>) -> Result<Self> {
        let (prog, _) = cmd.split_first().context("no command given after `--`")?;
        let path = resolve_program(prog)?;
        let cgroup = cgroup.map(InCgroup::open).transpose()?;
        let join = cgroup.as_ref().map(|c| c.group.child_join()).transpose()?;
        let argv_c: Vec<CString> = cmd
            .iter()
            .map(|a| CString::new(a.as_bytes().to_vec()))
            .collect::<Result<_, _>>()
            .context("an argument contains a NUL byte")?;
        let mut argv: Vec<*const libc::c_char> = argv_c.iter().map(|a| a.as_ptr()).collect();
        argv.push(std::ptr::null());
        let (go_rd, go_wr) = pipe()?;
        let (err_rd, err_wr) = pipe()?;
        // SAFETY: after fork the child only calls async-signal-safe functions
        // (sigaction, signal, pthread_sigmask, open, getpid, close, read, write, prctl, execv, _exit) on
        // memory prepared before the fork.
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            return Err(io::Error::last_os_error()).context("fork");
        }
        if pid == 0 {
            // SAFETY: see above; we never return from this block.
            unsafe {
                // The observer's signal handlers (SIGINT/SIGTERM, installed
                // before the fork) would swallow a signal forwarded while the
                // child is held; `exec` resets them to the default anyway.
                for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT] {
                    let mut old: libc::sigaction = std::mem::zeroed();
                    if libc::sigaction(sig, std::ptr::null(), &mut old) == 0 && old.sa_sigaction != libc::SIG_IGN {
                        libc::signal(sig, libc::SIG_DFL);
                    }
                }
                let mut none: libc::sigset_t = std::mem::zeroed();
                libc::sigemptyset(&mut none);
                libc::pthread_sigmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
                // Our copies of the parent's ends: if the observer dies before
                // releasing us, the read below sees end-of-file and we exit
                // instead of waiting forever.
                libc::close(go_wr.as_raw_fd());
                libc::close(err_rd.as_raw_fd());
                if let Some(join) = &join
                    && let Err(errno) = join.join()
                {
                    libc::write(err_wr.as_raw_fd(), (&errno as *const i32).cast(), 4);
                    libc::_exit(126);
                }
                let mut b = 0u8;
                loop {
                    let n = libc::read(go_rd.as_raw_fd(), (&mut b as *mut u8).cast(), 1);
                    if n >= 0 || *libc::__errno_location() != libc::EINTR {
                        break;
                    }
                }
                if n_is_go(b) {
                    // Orphaned descendants stay in the target's tree (see `guard`).
                    libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
                    libc::execv(path.as_ptr(), argv.as_ptr());
                    let errno = *libc::__errno_location();
                    libc::write(err_wr.as_raw_fd(), (&errno as *const i32).cast(), 4);
                }
                libc::_exit(127);
            }
        }
        drop(go_rd);
        drop(err_wr);
        let pid = pid as u32;
        let pidfd = register(pidfd_open(pid).with_context(|| format!("pidfd_open({pid})"))?)?;
        let guard = super::guard::Guard::start(pid, pipe()?).context("starting the guard process")?;
        Ok(Target {
            pid,
            pidfd,
            spawned: Some(Spawned {
                release: Some(go_wr),
                exec_error: err_rd,
                program: prog.to_string_lossy().into_owned(),
                path: std::path::PathBuf::from(std::ffi::OsStr::from_bytes(path.as_bytes())),
                cgroup,
                _guard: guard,
            }),
        })
    }

    /// Attach to a running process.
    pub fn attach(pid: u32) -> Result<Self> {
        if pid == 0 || !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            bail!("no process with PID {pid} (check `ps -p {pid}`)");
        }
        if is_kernel_thread(pid) {
            bail!(
                "PID {pid} is a kernel thread: it runs no program and has no user-space threads to observe \
                 (attach to a user process; `ps -o pid,comm --ppid 2 -N` lists them)"
            );
        }
        let fd = pidfd_open(pid).with_context(|| format!("no process with PID {pid} (pidfd_open)"))?;
        Ok(Target { pid, pidfd: register(fd)?, spawned: None })
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The executable the target runs (or will run, once released).
    pub fn exe(&self) -> Option<std::path::PathBuf> {
        match &self.spawned {
            Some(s) => Some(s.path.clone()),
            None => std::fs::read_link(format!("/proc/{}/exe", self.pid)).ok(),
        }
    }

    /// Let a spawned child run (`exec`), and report an `exec` failure; no-op
    /// when attached.
    pub fn release(&mut self) -> Result<()> {
        let Some(sp) = &mut self.spawned else { return Ok(()) };
        let Some(fd) = sp.release.take() else { return Ok(()) };
        // SAFETY: writing one byte from a valid buffer to our pipe end.
        let n = unsafe { libc::write(fd.as_raw_fd(), [GO].as_ptr().cast(), 1) };
        if n != 1 {
            return Err(io::Error::last_os_error()).context("releasing the child");
        }
        drop(fd);
        // The error pipe closes on a successful exec (CLOEXEC) or carries errno.
        let mut errno = 0i32;
        // SAFETY: reading at most 4 bytes into an i32.
        let n = unsafe { libc::read(sp.exec_error.as_raw_fd(), (&mut errno as *mut i32).cast(), 4) };
        if n == 4 {
            bail!(
                "cannot start `{}`: {} (joining the cgroup or exec failed)",
                sp.program,
                io::Error::from_raw_os_error(errno)
            );
        }
        Ok(())
    }

    /// Wait for the target to end, and reap it when it is our child.
    pub async fn wait(&mut self) -> Result<Ending> {
        self.exited().await?;
        self.reap()
    }

    /// Resolves when the target has exited; a spawned child stays a zombie
    /// (its final /proc counters readable) until [`Target::reap`].
    pub async fn exited(&self) -> Result<()> {
        // A pidfd becomes readable when the process exits.
        let mut guard = self.pidfd.readable().await.context("waiting on pidfd")?;
        guard.retain_ready();
        Ok(())
    }

    /// Collect the exit status of an exited target.
    pub fn reap(&mut self) -> Result<Ending> {
        if self.spawned.is_none() {
            return Ok(Ending::Gone);
        }
        let mut status = 0i32;
        // SAFETY: our own child, valid status pointer.
        let r = unsafe { libc::waitpid(self.pid as libc::pid_t, &mut status, 0) };
        if r < 0 {
            return Err(io::Error::last_os_error()).context("waitpid");
        }
        let code = if libc::WIFEXITED(status) {
            libc::WEXITSTATUS(status)
        } else if libc::WIFSIGNALED(status) {
            128 + libc::WTERMSIG(status)
        } else {
            -1
        };
        Ok(Ending::Exited(code))
    }

    /// Forward a signal to the target (spawned children only; an attached
    /// process belongs to someone else).
    pub fn signal(&self, sig: i32) {
        if self.spawned.is_some() {
            // SAFETY: kill with a PID we spawned and have not reaped yet.
            unsafe { libc::kill(self.pid as libc::pid_t, sig) };
        }
    }

    pub fn is_spawned(&self) -> bool {
        self.spawned.is_some()
    }

    /// After the run of a child spawned in a cgroup: a line when the cgroup's
    /// OOM killer killed processes during it (its counter, read before and
    /// after: v2 `memory.events`, v1 `memory.oom_control`), saying whether the
    /// target was one of them (it ended by SIGKILL, `exit_code` 137).
    pub fn oom_report(&self, exit_code: Option<i32>) -> Option<String> {
        let c = self.spawned.as_ref()?.cgroup.as_ref()?;
        let dir = c.group.dir().display();
        let kills = match c.oom.as_ref()?.kills() {
            Ok(0) => return None,
            Ok(n) => n,
            Err(e) => return Some(format!("cannot read the OOM-kill counter of the cgroup after the run: {e}")),
        };
        let limit = match c.group.limit() {
            Ok(Some(b)) => format!("its memory limit is {:.1} MiB", b as f64 / (1u64 << 20) as f64),
            Ok(None) => "it has no limit of its own, a parent's limit applies".to_string(),
            Err(e) => format!("its limit is unknown: {e}"),
        };
        Some(if exit_code == Some(128 + libc::SIGKILL) {
            format!(
                "the target was killed by the OOM killer of its cgroup {dir} ({}: {kills} OOM kill(s) there during \
                 the run; {limit}): it needed more memory than the cgroup allows",
                c.group.version()
            )
        } else {
            format!(
                "the OOM killer of the cgroup {dir} killed {kills} process(es) there during the run, not the target \
                 ({}; {limit})",
                c.group.version()
            )
        })
    }
}

/// `PF_KTHREAD` in the flags of `/proc/PID/stat` (include/linux/sched.h).
const PF_KTHREAD: u32 = 0x0020_0000;

/// Whether `pid` is a kernel thread (its `/proc/PID/stat` flags, field 9).
fn is_kernel_thread(pid: u32) -> bool {
    procfs::process::Process::new(pid as i32).and_then(|p| p.stat()).is_ok_and(|s| s.flags & PF_KTHREAD != 0)
}

const GO: u8 = 1;

#[inline(always)]
fn n_is_go(b: u8) -> bool {
    b == GO
}

/// Grace period between forwarding SIGINT and giving up on a child.
pub const CHILD_GRACE: Duration = Duration::from_secs(5);

#[cfg(test)]
mod tests {
    use super::*;

    fn words(args: &[&str]) -> Vec<std::path::PathBuf> {
        named_programs(&args.iter().map(OsString::from).collect::<Vec<_>>())
    }

    #[test]
    fn named_programs_are_the_executable_words_of_a_command_line() {
        let sh = std::path::PathBuf::from("/bin/sh").canonicalize().unwrap();
        let dir = std::env::temp_dir().join(format!("named-programs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (exe, data) = (dir.join("engine"), dir.join("model.gguf"));
        std::fs::write(&exe, "").unwrap();
        std::fs::write(&data, "").unwrap();
        std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
        let (e, d) = (exe.to_str().unwrap(), data.to_str().unwrap());
        // The program itself (the first word) is not looked at; a script's words, an assignment's
        // value and a perf-style `--` command are; a data file, an option and a missing path are not.
        assert_eq!(words(&[e, "-m", d]), Vec::<std::path::PathBuf>::new());
        assert_eq!(words(&["sh", "-c", &format!("{e} -m {d} >/dev/null 2>&1; echo done")]).first(), Some(&exe));
        assert_eq!(words(&["env", &format!("X={e}")]), vec![exe.clone()]);
        // (`stat` is a program in PATH too: a candidate, which the caller checks for markers.)
        assert_eq!(words(&["perf", "stat", "-e", "major-faults", "--", e, "-m", d]).last(), Some(&exe));
        assert_eq!(words(&["sh", "-c", &format!("'{e}'|cat;({e})")]).iter().filter(|p| **p == exe).count(), 1);
        assert!(words(&["x", "/nonexistent/engine", "--flag"]).is_empty());
        // A name is looked up in PATH, like the shell does.
        let found = words(&["x", "sh"]);
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].canonicalize().unwrap(), sh);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
