//! Seeding the attribution state of threads that exist before the probes are
//! attached (`--pid`, and the spawned child held before `exec`), from
//! `/proc/PID/task/TID/{stat,syscall}`: on CPU or not, and in which
//! syscall. Accounting for them starts at the seeding instant, as
//! `unattributed` until each thread's first event (`attrib` module spec): the
//! probes are attached after the seed, and what `/proc` showed may not hold by
//! then. The seeded context only says which syscall a thread is blocked in,
//! for when its first event is a wakeup or a switch. A spawned child held
//! before `exec` is not seeded: its accounting starts at its first event after
//! the release, so the hold is charged to nothing.

use observer_common::attrib::{F_IN_SYSCALL, F_IO_SYSCALL, F_ON_CPU, F_SEEDED, F_UNKNOWN, ThreadState};

use crate::capture::syscalls;

/// CLOCK_MONOTONIC in nanoseconds: the clock of `bpf_ktime_get_ns`.
pub fn mono_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The threads of `pid` now.
pub fn tids(pid: u32) -> Vec<u32> {
    let tasks = procfs::process::Process::new(pid as i32).and_then(|p| p.tasks());
    let mut v: Vec<u32> = tasks.map(|t| t.flatten().map(|t| t.tid as u32).collect()).unwrap_or_default();
    v.sort_unstable();
    v
}

/// Initial state of one thread, or `None` when it is gone.
pub fn seed(pid: u32, tid: u32, now: u64) -> Option<ThreadState> {
    let task = procfs::process::Process::new(pid as i32).ok()?.task_from_tid(tid as i32).ok()?;
    let stat = task.stat().ok()?;
    // Unreadable (no ptrace rights) reads as not in a system call, as does "-1 sp pc" (blocked
    // outside one), which procfs does not parse.
    let syscall = match task.syscall() {
        Ok(procfs::process::Syscall::Blocked { syscall_number, .. }) => Some(syscall_number),
        _ => None,
    };
    let mut t = ThreadState::zeroed();
    t.tid = tid;
    t.tgid = pid;
    t.last_ts = now;
    t.first_ts = now;
    t.flags = F_SEEDED | F_UNKNOWN;
    let c = stat.comm.as_bytes();
    let n = c.len().min(15);
    t.comm[..n].copy_from_slice(&c[..n]);
    // `R` is on a CPU or waiting for one; anything else is blocked.
    if stat.state == 'R' {
        t.flags |= F_ON_CPU;
    }
    if let Some(nr) = syscall
        && nr >= 0
    {
        t.flags |= F_IN_SYSCALL;
        if syscalls::is_io(nr) {
            t.flags |= F_IO_SYSCALL;
        }
    }
    Some(t)
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;

    #[test]
    fn a_thread_blocked_in_read_is_seeded_in_an_io_syscall_with_its_name() {
        let (mut r, w) = std::io::pipe().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let reader = std::thread::Builder::new()
            .name("seed-reader".into())
            .spawn(move || {
                // SAFETY: gettid has no preconditions.
                tx.send(unsafe { libc::gettid() } as u32).unwrap();
                std::io::Read::read(&mut r, &mut [0u8; 1]).unwrap()
            })
            .unwrap();
        let (pid, tid) = (std::process::id(), rx.recv().unwrap());
        assert!(tids(pid).contains(&tid) && tids(pid).contains(&pid));
        // Only a blocked thread names a system call: wait until the reader is blocked in read(2).
        let deadline = Instant::now() + Duration::from_secs(60);
        let t = loop {
            let t = seed(pid, tid, 7).expect("a live thread");
            if t.flags & F_IN_SYSCALL != 0 {
                break t;
            }
            assert!(Instant::now() < deadline, "the reader was never seen blocked in a system call");
            std::thread::sleep(Duration::from_millis(1));
        };
        assert_eq!(t.flags & F_IO_SYSCALL, F_IO_SYSCALL, "read(2) is an I/O system call");
        assert_eq!(t.flags & F_ON_CPU, 0, "blocked, not on CPU");
        assert_eq!((t.tid, t.first_ts, t.last_ts), (tid, 7, 7));
        assert_eq!(&t.comm[..12], b"seed-reader\0");
        drop(w);
        assert_eq!(reader.join().unwrap(), 0, "end of file once the writer is closed");
        // The join returns when the thread's exit clears its tid, a moment before /proc drops it.
        while seed(pid, tid, 7).is_some() {
            assert!(Instant::now() < deadline + Duration::from_secs(60), "an exited thread stays in /proc");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(tids(u32::MAX - 1).is_empty(), "a process that does not exist");
    }
}
