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
    let executable =
        |p: &std::path::Path| p.metadata().map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0).unwrap_or(false);
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

impl Target {
    /// Fork `cmd`, with the child blocked before `exec` until [`Target::release`],
    /// so that the probes see everything it does.
    pub fn spawn(cmd: &[OsString]) -> Result<Self> {
        Self::spawn_in(cmd, None)
    }

    /// Like [`Target::spawn`], with the child joining a cgroup before `exec`
    /// (`DIR/cgroup.procs`, or `DIR/tasks` for cgroup v1). Only the child
    /// moves, never the observer.
    pub fn spawn_in(cmd: &[OsString], cgroup: Option<&std::path::Path>) -> Result<Self> {
        let (prog, _) = cmd.split_first().context("no command given after `--`")?;
        let path = resolve_program(prog)?;
        let procs = match cgroup {
            None => None,
            Some(dir) => {
                let f = ["cgroup.procs", "tasks"].iter().map(|n| dir.join(n)).find(|p| p.exists());
                let Some(f) = f else {
                    bail!("--cgroup {}: no cgroup.procs or tasks file there (not a cgroup directory?)", dir.display());
                };
                Some(CString::new(f.into_os_string().into_vec()).context("cgroup path contains a NUL byte")?)
            }
        };
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
        // (sigaction, signal, pthread_sigmask, close, read, write, execv, _exit) on
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
                if let Some(procs) = &procs
                    && !join_cgroup(procs)
                {
                    let errno = *libc::__errno_location();
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
        Ok(Target {
            pid,
            pidfd,
            spawned: Some(Spawned {
                release: Some(go_wr),
                exec_error: err_rd,
                program: prog.to_string_lossy().into_owned(),
                path: std::path::PathBuf::from(std::ffi::OsStr::from_bytes(path.as_bytes())),
            }),
        })
    }

    /// Attach to a running process.
    pub fn attach(pid: u32) -> Result<Self> {
        if pid == 0 || !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            bail!("no process with PID {pid} (check `ps -p {pid}`)");
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
}

const GO: u8 = 1;

/// Write our own PID into a cgroup's procs file, without allocating
/// (called between fork and exec).
///
/// # Safety
/// Only async-signal-safe calls; `procs` is a valid C string.
unsafe fn join_cgroup(procs: &CString) -> bool {
    // SAFETY: see the function's contract.
    unsafe {
        let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
        if fd < 0 {
            return false;
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
        let ok = libc::write(fd, buf.as_ptr().add(i).cast(), n) == n as isize;
        libc::close(fd);
        ok
    }
}

#[inline(always)]
fn n_is_go(b: u8) -> bool {
    b == GO
}

/// Grace period between forwarding SIGINT and giving up on a child.
pub const CHILD_GRACE: Duration = Duration::from_secs(5);
