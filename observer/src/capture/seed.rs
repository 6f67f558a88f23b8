//! Seeding the attribution state of threads that exist before the probes are
//! attached (`--pid`, and the spawned child held before `exec`), from
//! `/proc/PID/task/TID/{stat,syscall,comm}`: on CPU or not, and in which
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
    let mut v: Vec<u32> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| d.flatten().filter_map(|e| e.file_name().to_str()?.parse().ok()).collect())
        .unwrap_or_default();
    v.sort_unstable();
    v
}

/// Initial state of one thread, or `None` when it is gone.
pub fn seed(pid: u32, tid: u32, now: u64) -> Option<ThreadState> {
    let base = format!("/proc/{pid}/task/{tid}");
    let stat = std::fs::read_to_string(format!("{base}/stat")).ok()?;
    // The state letter follows the parenthesised comm (which may contain spaces).
    let state = stat.rsplit_once(')')?.1.split_whitespace().next()?.chars().next()?;
    let syscall = std::fs::read_to_string(format!("{base}/syscall")).unwrap_or_default();
    let comm = std::fs::read_to_string(format!("{base}/comm")).unwrap_or_default();
    let mut t = ThreadState::zeroed();
    t.tid = tid;
    t.tgid = pid;
    t.last_ts = now;
    t.first_ts = now;
    t.flags = F_SEEDED | F_UNKNOWN;
    let c = comm.trim_end().as_bytes();
    let n = c.len().min(15);
    t.comm[..n].copy_from_slice(&c[..n]);
    // `R` is on a CPU or waiting for one; anything else is blocked.
    if state == 'R' {
        t.flags |= F_ON_CPU;
    }
    let first = syscall.split_whitespace().next().unwrap_or("");
    if let Ok(nr) = first.parse::<i64>()
        && nr >= 0
    {
        t.flags |= F_IN_SYSCALL;
        if syscalls::is_io(nr) {
            t.flags |= F_IO_SYSCALL;
        }
    }
    Some(t)
}
