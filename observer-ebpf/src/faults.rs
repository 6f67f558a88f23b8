//! Fault bracketing (rule: `observer_common::faults`, attribution:
//! `observer_common::attrib`).
//!
//! - `fault_entry_user` / `fault_entry_kernel`: the raw tracepoints
//!   `exceptions:page_fault_user` / `page_fault_kernel` (x86), at the start of every fault from
//!   user / kernel mode; a kernel-mode fault on a kernel address (top bit set) is no fault on the
//!   target's memory and is left out. A raw tracepoint runs its program directly; a perf event
//!   first goes through perf's overflow path (about 80 ns more per fault on the development VM,
//!   issue 19), so these are used where the kernel has them.
//! - `fault_entry`: perf software event `page-faults` (PERF_COUNT_SW_PAGE_FAULTS), raised in
//!   the fault handler for faults on user addresses: the entry where the raw tracepoints are
//!   missing (arm64, which has no `exceptions` events).
//! - `fault_exit_maj` / `fault_exit_min`: `major-faults` / `minor-faults`, which
//!   the kernel raises from `mm_account_fault` when a fault completes.
//! - `filemap_fault`: tracepoint `filemap:mm_filemap_fault` marks the open
//!   fault as a file fault (optional, Linux >= 6.8).
//!
//! All run synchronously in the faulting task, so the current TID is the
//! faulting thread. Minimum kernel: 4.9 (BPF on perf events).
//!
//! Cost (issue 19: about 100 ns of kernel work per fault): a fault's two
//! programs find the thread's slot in the per-CPU `SLOT_CACHE` and its state
//! and latencies in arrays, so a fault of an observed thread takes no hash
//! lookup; the refault record (`evict::fault_closed`) is looked up only when
//! the fault opened one (`F_FAULT_REFAULT`). Every fault is counted and timed.
//!
//! A thread without a slot (all given out) takes the overflow path
//! ([`overflow_enter`], [`overflow_exit`]: `observer_common::faults`), reached
//! only when the slot lookup has failed, so it costs the slot path nothing.

use aya_ebpf::{
    EbpfContext,
    helpers::bpf_ktime_get_ns,
    macros::{perf_event, raw_tracepoint, tracepoint},
    programs::{PerfEventContext, RawTracePointContext, TracePointContext},
};
use observer_common::{
    OverflowFaults,
    attrib::{F_FAULT_FILE, F_FAULT_REFAULT, H_MAJFLT_FILE, H_MAJFLT_SWAP, H_MINFLT, T_FAULT_IO},
    faults::{OTHER_MAJFLT, OTHER_MINFLT},
    hist::bucket_of,
};

use crate::maps::{
    FAULT_TIMES, HISTS, OTHER_FAULTS, OVERFLOW_FAULTS, OVERFLOW_TEMPLATE, THREADS, current_slot, current_state,
    target_tid, update,
};

#[perf_event]
pub fn fault_entry(_ctx: PerfEventContext) -> u32 {
    enter();
    0
}

#[raw_tracepoint(tracepoint = "page_fault_user")]
pub fn fault_entry_user(_ctx: RawTracePointContext) -> i32 {
    enter();
    0
}

#[raw_tracepoint(tracepoint = "page_fault_kernel")]
pub fn fault_entry_kernel(ctx: RawTracePointContext) -> i32 {
    // SAFETY: the tracepoint's first argument, `address` (`TP_PROTO(unsigned long address, …)`).
    let address = unsafe { *(ctx.as_ptr() as *const u64) };
    if address >> 63 == 0 {
        enter();
    }
    0
}

/// A fault of the current thread begins.
#[inline(always)]
fn enter() {
    let Some(tid) = target_tid() else { return };
    // SAFETY: helper without preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    match current_state(tid, now) {
        Some(s) => update(s, |s| s.fault_enter(now)),
        None => overflow_enter(tid, now),
    }
}

/// The overflow entry of thread `tid` (no slot), made at its first fault event; `None` when the
/// table is full.
#[inline(always)]
fn overflow_faults(tid: u32) -> Option<*mut OverflowFaults> {
    if let Some(p) = OVERFLOW_FAULTS.get_ptr_mut(&tid) {
        return Some(p);
    }
    let tmpl = OVERFLOW_TEMPLATE.get_ptr_mut(0)?;
    // SAFETY: per-CPU scratch value; only `tgid` and `comm` are ever written, the rest stays zero.
    unsafe {
        (*tmpl).tgid = (aya_ebpf::helpers::bpf_get_current_pid_tgid() >> 32) as u32;
        (*tmpl).comm = aya_ebpf::helpers::bpf_get_current_comm().unwrap_or([0; 16]);
        OVERFLOW_FAULTS.insert(&tid, &*tmpl, 0).ok()?;
    }
    OVERFLOW_FAULTS.get_ptr_mut(&tid)
}

/// A fault entry of a thread without a slot; with the overflow table full nothing is kept (its
/// exit is counted in `OTHER_FAULTS`).
#[inline(always)]
fn overflow_enter(tid: u32, now: u64) {
    if let Some(f) = overflow_faults(tid) {
        // SAFETY: map value; only this thread's own fault events write it.
        unsafe { (*f).enter(now) };
    }
}

/// A fault exit of a thread without a slot: counted in its overflow entry and timed, or, with the
/// table full, counted in `OTHER_FAULTS`.
#[inline(always)]
fn overflow_exit(tid: u32, now: u64, major: bool) -> u32 {
    let Some(f) = overflow_faults(tid) else {
        if let Some(c) = OTHER_FAULTS.get_ptr_mut(if major { OTHER_MAJFLT } else { OTHER_MINFLT }) {
            // SAFETY: per-CPU value; programs do not nest on one CPU for these hooks.
            unsafe { *c += 1 };
        }
        return 0;
    };
    // SAFETY: map value; only this thread's own fault events write it.
    unsafe {
        let lat = (*f).exit(now, major);
        if lat == 0 {
            return 0;
        }
        let b = bucket_of(lat);
        if major {
            (*f).times.majflt.add_in(b, lat);
        } else {
            (*f).times.minflt.add_in(b, lat);
            if let Some(p) = HISTS.get_ptr_mut(H_MINFLT) {
                (*p).add_in(b, lat);
            }
        }
    }
    0
}

#[inline(always)]
fn fault_exit(major: bool) -> u32 {
    let Some(tid) = target_tid() else { return 0 };
    // SAFETY: helper without preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    let Some(slot) = current_slot(tid, now) else { return overflow_exit(tid, now, major) };
    let Some(s) = THREADS.get_ptr_mut(slot) else { return 0 };
    let (mut lat, mut class, mut refault) = (0u64, 0usize, None);
    update(s, |s| {
        let start = s.fault_start;
        let opened = s.flags & F_FAULT_REFAULT != 0;
        (lat, class) = s.fault_exit(now, major);
        if opened {
            refault = Some((start, s.time[T_FAULT_IO]));
        }
    });
    if let Some((start, io)) = refault {
        crate::evict::fault_closed(tid, start, io);
    }
    if lat == 0 {
        // The entry was not seen: counted, without a time.
        return 0;
    }
    let b = bucket_of(lat);
    let h = match class {
        0 => H_MINFLT,
        1 => H_MAJFLT_FILE,
        _ => H_MAJFLT_SWAP,
    };
    if let Some(p) = HISTS.get_ptr_mut(h) {
        // SAFETY: per-CPU value; programs do not nest on one CPU for these hooks.
        unsafe { (*p).add_in(b, lat) };
    }
    if let Some(t) = FAULT_TIMES.get_ptr_mut(slot) {
        // SAFETY: map value; only this thread's own fault exits write it.
        unsafe {
            if major {
                (*t).majflt.add_in(b, lat);
            } else {
                (*t).minflt.add_in(b, lat);
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
