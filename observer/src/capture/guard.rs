//! The guard: a spawned target and its descendants do not outlive the
//! observer, however it dies (SIGKILL included).
//!
//! Rule: when the observer process ends without having disarmed the guard,
//! the target and every process descended from it are killed (SIGKILL).
//!
//! How:
//! - At spawn the observer forks a small guard process (no `exec`: after the
//!   fork it makes only system calls, on memory prepared before). It closes
//!   every descriptor but the read end of a pipe whose write end only the
//!   observer holds (close-on-exec, so the target never has it), ignores the
//!   terminal's signals, and blocks reading that pipe.
//! - The observer ending in any way closes the write end: the read returns
//!   end-of-file and the guard stops the target (SIGSTOP, so it cannot fork
//!   any more), then walks `/proc` for processes whose parent is already in
//!   the set, stopping each, until a pass finds none; then it SIGKILLs them
//!   all and exits. A descendant that left the target's process group or
//!   session (`setsid`) is still its descendant, so it is found.
//! - The target is made a child subreaper (`PR_SET_CHILD_SUBREAPER`, kept
//!   across `exec`) before `exec`, so a descendant whose parent exits (a
//!   double fork) is re-parented to the target, not to PID 1, and stays in
//!   the tree. The target may therefore see such orphans as its children.
//! - A run that ends normally disarms the guard ([`Guard::disarm`]: one
//!   byte on the pipe): it exits without killing anything, and is reaped.
//!
//! `PR_SET_PDEATHSIG` is not used: it reaches the direct child only, and it
//! would kill the target before the guard could find its children.

use std::{
    io,
    os::fd::{AsRawFd, OwnedFd},
};

/// The observer's side of the guard process.
#[derive(Debug)]
pub struct Guard {
    pid: libc::pid_t,
    arm: Option<OwnedFd>,
}

/// At most this many processes are killed (the guard allocates nothing after
/// the fork, so the set is a fixed array).
const MAX_TREE: usize = 4096;

impl Guard {
    /// Fork the guard of `target` (our child, not yet reaped).
    pub fn start(target: u32, pipe: (OwnedFd, OwnedFd)) -> io::Result<Guard> {
        let (rd, wr) = pipe;
        // SAFETY: after the fork the child only makes system calls (sigaction,
        // close_range, read, open, getdents64, kill, _exit) on its own stack;
        // it never returns from `run_guard`.
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            return Err(io::Error::last_os_error());
        }
        if pid == 0 {
            // SAFETY: see above.
            unsafe { run_guard(target as libc::pid_t, rd.as_raw_fd()) }
        }
        drop(rd);
        Ok(Guard { pid, arm: Some(wr) })
    }

    /// The run ended as it should: the guard exits without killing, and is reaped.
    pub fn disarm(&mut self) {
        let Some(fd) = self.arm.take() else { return };
        // SAFETY: one byte from a valid buffer to our pipe end; then waiting for our own child.
        unsafe {
            libc::write(fd.as_raw_fd(), [1u8].as_ptr().cast(), 1);
            drop(fd);
            let mut status = 0;
            libc::waitpid(self.pid, &mut status, 0);
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.disarm();
    }
}

/// The guard process. Never returns.
///
/// # Safety
/// Only in the child of a `fork`, with `fd` the read end of the guard's pipe.
unsafe fn run_guard(target: libc::pid_t, fd: i32) -> ! {
    // SAFETY: system calls on valid arguments; see the module doc.
    unsafe {
        for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT, libc::SIGTSTP, libc::SIGPIPE] {
            libc::signal(sig, libc::SIG_IGN);
        }
        let mut none: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut none);
        libc::pthread_sigmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
        // Every descriptor but the pipe: the guard must hold nothing of the
        // observer's (probes, sockets, files) while it waits.
        if fd > 0 {
            libc::syscall(libc::SYS_close_range, 0u32, (fd - 1) as u32, 0u32);
        }
        libc::syscall(libc::SYS_close_range, (fd + 1) as u32, u32::MAX, 0u32);
        let mut b = 0u8;
        let n = loop {
            let n = libc::read(fd, (&mut b as *mut u8).cast(), 1);
            if n >= 0 || *libc::__errno_location() != libc::EINTR {
                break n;
            }
        };
        if n == 0 {
            kill_tree(target);
        }
        libc::_exit(0)
    }
}

/// Stop `root` and its descendants, then kill them all (module doc).
///
/// # Safety
/// System calls only; for the guard process.
unsafe fn kill_tree(root: libc::pid_t) {
    let mut set = [0 as libc::pid_t; MAX_TREE];
    set[0] = root;
    let mut len = 1;
    // SAFETY: kill(2) of a process the guard was told to watch.
    unsafe { libc::kill(root, libc::SIGSTOP) };
    loop {
        let mut added = false;
        // SAFETY: system calls on buffers of this frame.
        unsafe {
            for_each_process(|pid, ppid| {
                if len < MAX_TREE && set[..len].contains(&ppid) && !set[..len].contains(&pid) {
                    libc::kill(pid, libc::SIGSTOP);
                    set[len] = pid;
                    len += 1;
                    added = true;
                }
            })
        };
        if !added {
            break;
        }
    }
    for &pid in &set[..len] {
        // SAFETY: kill(2) of a stopped descendant of the target.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
}

/// Call `f(pid, ppid)` for every process in `/proc`.
///
/// # Safety
/// System calls only; for the guard process.
unsafe fn for_each_process(mut f: impl FnMut(libc::pid_t, libc::pid_t)) {
    // SAFETY: open/getdents64/read/close on buffers of this frame; the
    // dirent records are read within the length getdents64 returned.
    unsafe {
        let dir = libc::open(c"/proc".as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC);
        if dir < 0 {
            return;
        }
        let mut buf = [0u8; 8192];
        loop {
            let n = libc::syscall(libc::SYS_getdents64, dir, buf.as_mut_ptr(), buf.len());
            if n <= 0 {
                break;
            }
            let mut off = 0usize;
            while off < n as usize {
                // struct linux_dirent64: u64 ino, i64 off, u16 reclen, u8 type, name…
                let reclen = u16::from_ne_bytes([buf[off + 16], buf[off + 17]]) as usize;
                let name = &buf[off + 19..off + reclen];
                if let Some(pid) = parse_pid(name)
                    && let Some(ppid) = ppid_of(pid)
                {
                    f(pid, ppid);
                }
                off += reclen;
            }
        }
        libc::close(dir);
    }
}

/// The decimal number at the start of `name` (up to its NUL), if it is all digits.
fn parse_pid(name: &[u8]) -> Option<libc::pid_t> {
    let end = name.iter().position(|&c| c == 0).unwrap_or(name.len());
    let digits = &name[..end];
    if digits.is_empty() || digits.len() > 9 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(digits.iter().fold(0, |v, &d| v * 10 + (d - b'0') as libc::pid_t))
}

/// The parent of `pid`, from `/proc/PID/stat` (`pid (comm) state ppid …`; the
/// comm may contain anything, so the fields start after its last `)`).
/// Hand-read, not procfs: the guard after `fork` may not allocate, and procfs does.
///
/// # Safety
/// System calls only; for the guard process.
unsafe fn ppid_of(pid: libc::pid_t) -> Option<libc::pid_t> {
    let mut path = *b"/proc/\0\0\0\0\0\0\0\0\0\0/stat\0\0";
    let mut digits = [0u8; 10];
    let mut n = 0;
    let mut v = pid;
    loop {
        digits[n] = b'0' + (v % 10) as u8;
        n += 1;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    let mut at = 6;
    for i in (0..n).rev() {
        path[at] = digits[i];
        at += 1;
    }
    path[at..at + 5].copy_from_slice(b"/stat");
    path[at + 5] = 0;
    let mut buf = [0u8; 512];
    // SAFETY: a NUL-terminated path and a buffer of this frame.
    let len = unsafe {
        let fd = libc::open(path.as_ptr().cast(), libc::O_RDONLY | libc::O_CLOEXEC);
        if fd < 0 {
            return None;
        }
        let len = libc::read(fd, buf.as_mut_ptr().cast(), buf.len());
        libc::close(fd);
        len
    };
    if len <= 0 {
        return None;
    }
    let stat = &buf[..len as usize];
    let close = stat.iter().rposition(|&c| c == b')')?;
    // ") S PPID "
    let rest = stat.get(close + 4..)?;
    let end = rest.iter().position(|&c| c == b' ')?;
    parse_pid(&rest[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ppid_and_pid_parse_like_procfs() {
        assert_eq!(parse_pid(b"1234\0\0"), Some(1234));
        assert_eq!(parse_pid(b"self\0"), None);
        assert_eq!(parse_pid(b"\0"), None);
        // SAFETY: reading our own /proc entry.
        let ppid = unsafe { ppid_of(std::process::id() as libc::pid_t) };
        // SAFETY: getppid has no preconditions.
        assert_eq!(ppid, Some(unsafe { libc::getppid() }));
    }
}
