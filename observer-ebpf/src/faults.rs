//! Fault bracketing (rule: `observer_common::faults`, attribution:
//! `observer_common::attrib`).
//!
//! - `fault_entry`: perf software event `page-faults` (PERF_COUNT_SW_PAGE_FAULTS).
//! - `fault_exit_maj` / `fault_exit_min`: `major-faults` / `minor-faults`, which
//!   the kernel raises from `mm_account_fault` when a fault completes.
//! - `filemap_fault`: tracepoint `filemap:mm_filemap_fault` marks the open
//!   fault as a file fault (optional, Linux >= 6.8).
//!
//! All run synchronously in the faulting task, so the current TID is the
//! faulting thread. Minimum kernel: 4.9 (BPF on perf events).

use aya_ebpf::{
    helpers::{bpf_get_current_comm, bpf_ktime_get_ns},
    macros::{perf_event, tracepoint},
    programs::{PerfEventContext, TracePointContext},
};
use observer_common::{
    GlobalCounter, ThreadFaults,
    attrib::{F_FAULT_FILE, H_MAJFLT_FILE, H_MAJFLT_SWAP, H_MINFLT, T_FAULT_IO},
    hist::bucket_of,
};

use crate::maps::{FAULTS_TEMPLATE, THREAD_FAULTS, bump, current_state, hist_add, target_tid, update};

#[inline(always)]
fn thread_faults(tid: u32) -> Option<*mut ThreadFaults> {
    if let Some(p) = THREAD_FAULTS.get_ptr_mut(tid) {
        return Some(p);
    }
    let tmpl = FAULTS_TEMPLATE.get_ptr_mut(0)?;
    // SAFETY: per-CPU scratch value; only `comm` is ever written, the rest stays zero.
    unsafe {
        (*tmpl).comm = bpf_get_current_comm().unwrap_or([0; 16]);
        if THREAD_FAULTS.insert(&tid, &*tmpl, 0).is_err() {
            bump(GlobalCounter::LostEvents);
            return None;
        }
    }
    THREAD_FAULTS.get_ptr_mut(tid)
}

#[perf_event]
pub fn fault_entry(_ctx: PerfEventContext) -> u32 {
    let Some(tid) = target_tid() else { return 0 };
    bump(GlobalCounter::TargetEvents);
    // SAFETY: helper without preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    if let Some(s) = current_state(tid, now) {
        update(s, |s| s.fault_enter(now));
    }
    let Some(t) = thread_faults(tid) else { return 0 };
    // SAFETY: map value pointer; only this thread's own events write it.
    unsafe {
        if (*t).fault_start_ns != 0 {
            (*t).unmatched_entries += 1;
        }
        (*t).fault_start_ns = now;
    }
    0
}

#[inline(always)]
fn fault_exit(major: bool) -> u32 {
    let Some(tid) = target_tid() else { return 0 };
    bump(GlobalCounter::TargetEvents);
    // SAFETY: helper without preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    if let Some(s) = current_state(tid, now) {
        let mut res = (0u64, 0usize);
        let mut closed = (0u64, 0u64);
        update(s, |s| {
            let start = s.fault_start;
            res = s.fault_exit(now, major);
            closed = (start, s.time[T_FAULT_IO]);
        });
        crate::evict::fault_closed(tid, closed.0, closed.1);
        let (lat, class) = res;
        if lat != 0 {
            let h = match class {
                0 => H_MINFLT,
                1 => H_MAJFLT_FILE,
                _ => H_MAJFLT_SWAP,
            };
            hist_add(h, lat);
        }
    }
    let Some(t) = thread_faults(tid) else { return 0 };
    // SAFETY: map value pointer; only this thread's own events write it.
    unsafe {
        let start = (*t).fault_start_ns;
        (*t).fault_start_ns = 0;
        if major {
            (*t).majflt += 1;
        } else {
            (*t).minflt += 1;
        }
        if start == 0 || now < start {
            (*t).unmatched_exits += 1;
            return 0;
        }
        let dt = now - start;
        let b = bucket_of(dt);
        if major {
            (*t).majflt_ns += dt;
            if let Some(c) = (*t).majflt_hist.get_mut(b) {
                *c += 1;
            }
        } else {
            (*t).minflt_ns += dt;
            if let Some(c) = (*t).minflt_hist.get_mut(b) {
                *c += 1;
            }
        }
    }
    0
}

#[perf_event]
pub fn fault_exit_maj(_ctx: PerfEventContext) -> u32 {
    fault_exit(true)
}

#[perf_event]
pub fn fault_exit_min(_ctx: PerfEventContext) -> u32 {
    fault_exit(false)
}

#[tracepoint]
pub fn filemap_fault(_ctx: TracePointContext) -> u32 {
    let Some(tid) = target_tid() else { return 0 };
    // SAFETY: helper without preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    if let Some(s) = current_state(tid, now) {
        update(s, |s| {
            if s.fault_start != 0 {
                s.flags |= F_FAULT_FILE;
            }
        });
    }
    0
}
