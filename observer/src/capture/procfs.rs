//! The fallback without eBPF (not root, or a kernel without BPF): per-thread
//! facts from procfs, sampled at window boundaries.
//!
//! Rule: per thread, from `/proc/PID/task/TID/`:
//! - `stat` field 14 `utime` → `compute` (user time; clock-tick resolution,
//!   usually 10 ms), field 10 `minflt` → `minflt`;
//! - `schedstat` field 2 `run_delay` → `runqueue` (nanoseconds);
//! - `io` `read_bytes` → `read_bytes` (storage reads this thread caused);
//! - `status` voluntary + nonvoluntary context switches → `ctx_switches`.
//!
//! Everything else (fault_minor, swapin_zram, fault_io, io_wait, reclaim,
//! syscall, sleep; majflt_file/majflt_swap, swapins, page-cache churn) cannot
//! be separated from procfs and is *not measured* (`None`), never 0; what is
//! not attributed shows in `residual_ns`.

use observer_common::{
    attrib::{C_CTX_SWITCHES, C_MINFLT, C_READ_BYTES, F_ON_CPU, T_COMPUTE, T_RUNQUEUE, ThreadState},
    model::{Component, Counter, TokenRecord},
};

use crate::capture::seed;

/// The one line printed at start in fallback mode.
pub const MEASURED: &str = "compute (user time, clock-tick resolution), runqueue, minflt, read_bytes, ctx_switches; everything else is not measured";

/// One thread's cumulative procfs counters as a `ThreadState` (the same
/// shape the eBPF side produces), so that token building is shared.
pub fn thread_state(pid: u32, tid: u32) -> Option<ThreadState> {
    let task = procfs::process::Process::new(pid as i32).ok()?.task_from_tid(tid as i32).ok()?;
    let stat = task.stat().ok()?;
    let mut t = ThreadState::zeroed();
    t.tid = tid;
    let n = stat.comm.len().min(15);
    t.comm[..n].copy_from_slice(&stat.comm.as_bytes()[..n]);
    t.time[T_COMPUTE] = stat.utime * 1_000_000_000 / procfs::ticks_per_second();
    t.cnt[C_MINFLT] = stat.minflt;
    if let Ok(ss) = task.schedstat() {
        t.time[T_RUNQUEUE] = ss.run_delay;
    }
    if let Ok(io) = task.io() {
        t.cnt[C_READ_BYTES] = io.read_bytes;
    }
    if let Ok(st) = task.status() {
        t.cnt[C_CTX_SWITCHES] = st.voluntary_ctxt_switches.unwrap_or(0) + st.nonvoluntary_ctxt_switches.unwrap_or(0);
    }
    t.flags = F_ON_CPU;
    Some(t)
}

/// All threads of `pid` now.
pub fn snapshot(pid: u32) -> Vec<ThreadState> {
    seed::tids(pid).into_iter().filter_map(|tid| thread_state(pid, tid)).collect()
}

/// Blank out what procfs cannot measure in a token built from procfs
/// snapshots, and recompute the residuals from what is measured.
pub fn mark_unmeasured(t: &mut TokenRecord) {
    let keep_c = |c: Component| matches!(c, Component::Compute | Component::Runqueue);
    let keep_n = |c: Counter| matches!(c, Counter::Minflt | Counter::ReadBytes | Counter::CtxSwitches);
    for c in Component::ALL {
        if !keep_c(c) {
            t.components.set(c, None);
        }
    }
    for c in Counter::ALL {
        if !keep_n(c) {
            t.counters.set(c, None);
        }
    }
    t.residual_ns = t.wall_ns as i64 - t.components.sum() as i64;
    for th in &mut t.threads {
        for c in Component::ALL {
            if !keep_c(c) {
                th.components.set(c, None);
            }
        }
        for c in Counter::ALL {
            if !keep_n(c) {
                th.counters.set(c, None);
            }
        }
        th.residual_ns = t.wall_ns as i64 - th.components.sum() as i64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_process() {
        let me = std::process::id();
        let s = snapshot(me);
        assert!(!s.is_empty());
        let main = s.iter().find(|t| t.tid == me).expect("main thread");
        assert!(main.cnt[C_MINFLT] > 0);
        assert!(thread_state(me, u32::MAX - 1).is_none(), "a thread that does not exist");
    }

    #[test]
    fn a_thread_reads_like_its_own_rusage() {
        // Independent source: getrusage(RUSAGE_THREAD) of the same thread, before and after.
        fn rusage() -> (u64, u64, u64) {
            // SAFETY: a zeroed rusage is a valid out-parameter.
            let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
            // SAFETY: valid pointer.
            unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) };
            let utime = ru.ru_utime.tv_sec as u64 * 1_000_000_000 + ru.ru_utime.tv_usec as u64 * 1000;
            (ru.ru_minflt as u64, (ru.ru_nvcsw + ru.ru_nivcsw) as u64, utime)
        }
        std::thread::spawn(|| {
            let v = std::hint::black_box(vec![1u8; 8 << 20]);
            std::thread::sleep(std::time::Duration::from_millis(5));
            // SAFETY: gettid has no preconditions.
            let tid = unsafe { libc::gettid() } as u32;
            let (f0, c0, _) = rusage();
            let t = thread_state(std::process::id(), tid).expect("this thread");
            let (f1, c1, u1) = rusage();
            assert!((f0..=f1).contains(&t.cnt[C_MINFLT]), "minflt {} not in {f0}..={f1}", t.cnt[C_MINFLT]);
            assert!((c0..=c1).contains(&t.cnt[C_CTX_SWITCHES]), "ctx {} not in {c0}..={c1}", t.cnt[C_CTX_SWITCHES]);
            // utime is in clock ticks in /proc, exact in getrusage: at most one tick apart.
            assert!(t.time[T_COMPUTE] <= u1 + 10_000_000, "utime {} vs {u1}", t.time[T_COMPUTE]);
            drop(v);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn unmeasured_fields_become_none() {
        use crate::capture::tokens::{Snapshot, build};
        use observer_common::model::StepKind;
        let mut a = ThreadState::zeroed();
        a.tid = 1;
        let mut b = a;
        b.time[T_COMPUTE] = 600;
        b.time[T_RUNQUEUE] = 100;
        b.cnt[C_MINFLT] = 5;
        let s = |ts, t| Snapshot::of_threads(ts, vec![t]);
        let mut t = build(&s(0, a), &s(1000, b), 0, StepKind::Window);
        mark_unmeasured(&mut t);
        assert_eq!(t.components.get(Component::Compute), Some(600));
        assert_eq!(t.components.get(Component::Sleep), None);
        assert_eq!(t.counters.get(Counter::MajfltFile), None);
        assert_eq!(t.counters.get(Counter::Minflt), Some(5));
        assert_eq!(t.residual_ns, 300);
    }
}
