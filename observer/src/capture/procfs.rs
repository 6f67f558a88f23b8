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

fn clk_tck() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let v = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if v > 0 { v as u64 } else { 100 }
}

fn field_after_comm(stat: &str, n: usize) -> Option<u64> {
    // Fields after "pid (comm)": index 0 is field 3 (state).
    stat.rsplit_once(')')?.1.split_whitespace().nth(n - 3)?.parse().ok()
}

/// One thread's cumulative procfs counters as a `ThreadState` (the same
/// shape the eBPF side produces), so that token building is shared.
pub fn thread_state(pid: u32, tid: u32) -> Option<ThreadState> {
    let base = format!("/proc/{pid}/task/{tid}");
    let stat = std::fs::read_to_string(format!("{base}/stat")).ok()?;
    let mut t = ThreadState::zeroed();
    t.tid = tid;
    let comm = stat.split_once('(').and_then(|(_, r)| r.rsplit_once(')')).map(|(c, _)| c).unwrap_or("");
    let n = comm.len().min(15);
    t.comm[..n].copy_from_slice(&comm.as_bytes()[..n]);
    let utime = field_after_comm(&stat, 14)?;
    t.time[T_COMPUTE] = utime * 1_000_000_000 / clk_tck();
    t.cnt[C_MINFLT] = field_after_comm(&stat, 10)?;
    if let Ok(ss) = std::fs::read_to_string(format!("{base}/schedstat")) {
        let v: Vec<u64> = ss.split_whitespace().filter_map(|x| x.parse().ok()).collect();
        if let Some(&rd) = v.get(1) {
            t.time[T_RUNQUEUE] = rd;
        }
    }
    if let Ok(io) = std::fs::read_to_string(format!("{base}/io")) {
        t.cnt[C_READ_BYTES] =
            io.lines().find_map(|l| l.strip_prefix("read_bytes:").and_then(|v| v.trim().parse().ok())).unwrap_or(0);
    }
    if let Ok(st) = std::fs::read_to_string(format!("{base}/status")) {
        let get = |k: &str| st.lines().find_map(|l| l.strip_prefix(k)?.trim().parse::<u64>().ok()).unwrap_or(0);
        t.cnt[C_CTX_SWITCHES] = get("voluntary_ctxt_switches:") + get("nonvoluntary_ctxt_switches:");
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
    fn unmeasured_fields_become_none() {
        use crate::capture::tokens::{Snapshot, build};
        use observer_common::model::StepKind;
        let mut a = ThreadState::zeroed();
        a.tid = 1;
        let mut b = a;
        b.time[T_COMPUTE] = 600;
        b.time[T_RUNQUEUE] = 100;
        b.cnt[C_MINFLT] = 5;
        let s = |ts, t| Snapshot {
            ts,
            index: 0,
            threads: vec![t],
            engine: None,
            lost: 0,
            churn: None,
            evicted_by: None,
            n_tokens: None,
        };
        let mut t = build(&s(0, a), &s(1000, b), 0, StepKind::Window);
        mark_unmeasured(&mut t);
        assert_eq!(t.components.get(Component::Compute), Some(600));
        assert_eq!(t.components.get(Component::Sleep), None);
        assert_eq!(t.counters.get(Counter::MajfltFile), None);
        assert_eq!(t.counters.get(Counter::Minflt), Some(5));
        assert_eq!(t.residual_ns, 300);
    }
}
