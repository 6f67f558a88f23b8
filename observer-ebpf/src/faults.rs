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
//! - `fault_memcg`: the raw tracepoint `memcg:count_memcg_events`, the memcg close (Linux >=
//!   6.14): `PGMAJFAULT` marks the open fault major, `PGFAULT` (raised in `mm_account_fault`)
//!   closes it. A raw tracepoint, so the close, like the entry, costs no perf overflow path.
//! - `fault_exit_maj` / `fault_exit_min`: `major-faults` / `minor-faults`, which
//!   the kernel raises from `mm_account_fault` when a fault completes: the perf close, where the
//!   memcg close is not used. Under the memcg close only `major-faults` is attached, and
//!   `fault_exit_maj` only moves a retried fault's count to major
//!   (`observer_common::faults`).
//! - `filemap_fault`: tracepoint `filemap:mm_filemap_fault` marks the open
//!   fault as a file fault (optional, Linux >= 6.8).
//! - `fault_floor`: returns at once. `observer run --fault-dispatch-only` attaches it to the
//!   fault hooks in place of the programs above (the raw entries and the memcg close): what the
//!   kernel's dispatch of those hooks costs a fault with no work in them (`bench storm`'s floor).
//!
//! All run synchronously in the faulting task, so the current TID is the
//! faulting thread. Minimum kernel: 4.9 (BPF on perf events).
//!
//! Cost (issue 19: about 100 ns of kernel work per fault): a fault's
//! programs find the thread's slot in the per-CPU `SLOT_CACHE` and its state
//! and latencies in arrays, so a fault of an observed thread takes no hash
//! lookup, and, after the first fault since the thread came on the CPU, no helper call to
//! know which thread it is (`maps::current_known`: set at the switch that put a tracked thread
//! on the CPU, or by its first fault since, and forgotten at the next switch); the refault
//! record (`evict::fault_closed`) is looked up only when the fault opened one
//! (`F_FAULT_REFAULT`). Every fault is counted; in a fault storm most
//! user-mode faults are not timed (`observer_common::faults`, storm sampling): their entry and
//! close read no clock.
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
    attrib::{
        F_CLOSED_MINOR, F_FAULT_REFAULT, F_FAULT_UNTIMED, F_STORM, H_MAJFLT_FILE, H_MAJFLT_SWAP, H_MINFLT, T_FAULT_IO,
    },
    faults::{OTHER_CLOSES, OTHER_MAJFLT, OTHER_MINFLT, OVF_CLOSED_MINOR, OVF_MAJOR},
    hist::bucket_of,
};

use crate::maps::{
    FAULT_TIMES, HISTS, OTHER_FAULTS, OVERFLOW_FAULTS, OVERFLOW_TEMPLATE, STORMS, THREADS, config, current_slot,
    current_state, current_target, mark_current, state_of, target_tid, update,
};

#[perf_event]
pub fn fault_entry(_ctx: PerfEventContext) -> u32 {
    enter();
    0
}

#[raw_tracepoint(tracepoint = "page_fault_user")]
pub fn fault_entry_user(_ctx: RawTracePointContext) -> i32 {
    let Some((tid, slot)) = current_target() else { return 0 };
    // Storm sampling (`observer_common::faults`): in a storm, most user-mode faults enter untimed,
    // before any clock read.
    if let Some(slot) = slot
        && let Some(s) = THREADS.get_ptr_mut(slot)
        // SAFETY: map value; only this thread's own events write its flags.
        && unsafe { (*s).flags } & F_STORM != 0
        && let Some(st) = STORMS.get_ptr_mut(slot)
    {
        let mut untimed = false;
        // SAFETY: map value at the thread's slot; only its own fault events write it.
        update(s, |s| untimed = s.fault_enter_untimed(unsafe { &mut *st }));
        if untimed {
            return 0;
        }
    }
    enter_timed(tid);
    0
}

/// The dispatch floor (module doc): no work, so a run under it costs what the kernel's calls of
/// the fault hooks cost.
#[raw_tracepoint]
pub fn fault_floor(_ctx: RawTracePointContext) -> i32 {
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
    if let Some(tid) = target_tid() {
        enter_timed(tid);
    }
}

/// A timed fault of the current thread `tid` begins.
#[inline(always)]
fn enter_timed(tid: u32) {
    // SAFETY: helper without preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    let sampling = config().is_some_and(|c| c.memcg_close != 0 && c.storm_sampling != 0);
    let Some(slot) = current_slot(tid, now) else { return overflow_enter(tid, now) };
    mark_current(tid);
    let (Some(s), Some(st)) = (THREADS.get_ptr_mut(slot), STORMS.get_ptr_mut(slot)) else { return };
    // SAFETY: map value at the thread's slot; only its own fault events write it.
    let st = unsafe { &mut *st };
    let random = st.draw(now);
    update(s, |s| s.fault_enter(now, st, sampling, random));
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

/// Count one fault of a thread with no row in `OTHER_FAULTS[i]`.
#[inline(always)]
fn count_other(i: u32) {
    if let Some(c) = OTHER_FAULTS.get_ptr_mut(i) {
        // SAFETY: per-CPU value; programs do not nest on one CPU for these hooks.
        unsafe { *c += 1 };
    }
}

/// A fault exit of a thread without a slot: counted in its overflow entry and timed, or, with the
/// table full, counted in `OTHER_FAULTS`.
#[inline(always)]
fn overflow_exit(tid: u32, now: u64, major: bool) -> u32 {
    let Some(f) = overflow_faults(tid) else {
        count_other(if major { OTHER_MAJFLT } else { OTHER_MINFLT });
        return 0;
    };
    // SAFETY: map value; only this thread's own fault events write it.
    let lat = unsafe { (*f).exit(now, major) };
    overflow_time(f, lat, major);
    0
}

/// Add a completed fault's latency (0: not timed) to an overflow entry's times (minor ones to
/// the global histogram too: `observer_common::faults`).
#[inline(always)]
fn overflow_time(f: *mut OverflowFaults, lat: u64, major: bool) {
    if lat == 0 {
        return;
    }
    let b = bucket_of(lat);
    // SAFETY: map value; only this thread's own fault events write it.
    unsafe {
        if major {
            (*f).times.majflt.add_in(b, lat);
        } else {
            (*f).times.minflt.add_in(b, lat);
            if let Some(p) = HISTS.get_ptr_mut(H_MINFLT) {
                (*p).add_in(b, lat);
            }
        }
    }
}

/// The perf close: a `major-faults` / `minor-faults` event of the current thread.
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
    closed(tid, slot, lat, class, 1, refault);
    0
}

/// After a fault of thread `tid` (at `slot`) closed: its refault record, if it opened one, and
/// its latency (`lat`, 0 when not timed) in the histograms of its class (0 minor, 1 major file,
/// 2 major swap), `weight` times (a storm's sample: `ThreadState::fault_close`).
#[inline(always)]
fn closed(tid: u32, slot: u32, lat: u64, class: usize, weight: u64, refault: Option<(u64, u64)>) {
    if let Some((start, io)) = refault {
        crate::evict::fault_closed(tid, start, io);
    }
    if lat == 0 {
        // The entry was not seen: counted, without a time.
        return;
    }
    let b = bucket_of(lat);
    let h = match class {
        0 => H_MINFLT,
        1 => H_MAJFLT_FILE,
        _ => H_MAJFLT_SWAP,
    };
    if let Some(p) = HISTS.get_ptr_mut(h) {
        // SAFETY: per-CPU value; programs do not nest on one CPU for these hooks.
        unsafe { (*p).add_weighted(b, lat, weight) };
    }
    if let Some(t) = FAULT_TIMES.get_ptr_mut(slot) {
        // SAFETY: map value; only this thread's own fault exits write it.
        unsafe {
            if class != 0 {
                (*t).majflt.add_weighted(b, lat, weight);
            } else {
                (*t).minflt.add_weighted(b, lat, weight);
            }
        }
    }
}

/// `memcg:count_memcg_events` (raw: `TP_PROTO(struct mem_cgroup *memcg, int item, unsigned long
/// val)`), the memcg close (`observer_common::faults`): `PGMAJFAULT` marks the current thread's
/// open fault major, `PGFAULT` closes it. Raised for every memcg event counted (on cgroup v1 also
/// `PGPGIN` per charged page), so the item is compared first.
#[raw_tracepoint(tracepoint = "count_memcg_events")]
pub fn fault_memcg(ctx: RawTracePointContext) -> i32 {
    // SAFETY: the tracepoint's second argument, `item` (an `int` in a u64 slot).
    let item = unsafe { *(ctx.as_ptr() as *const u64).add(1) } as u32;
    let Some(cfg) = config() else { return 0 };
    if item == cfg.pgfault_item {
        memcg_close();
    } else if item == cfg.pgmajfault_item {
        memcg_major();
    }
    0
}

/// `PGFAULT`: the kernel accounts the current thread's fault.
#[inline(always)]
fn memcg_close() {
    let Some((tid, slot)) = current_target() else { return };
    let Some(slot) = slot else {
        // No slot: none given yet (so no fault open; one is given now, as to any thread the
        // probes see), or none left (the overflow table).
        // SAFETY: helper without preconditions.
        let now = unsafe { bpf_ktime_get_ns() };
        if current_slot(tid, now).is_none() {
            overflow_close(tid, now);
        }
        return;
    };
    let (Some(s), Some(st)) = (THREADS.get_ptr_mut(slot), STORMS.get_ptr_mut(slot)) else { return };
    // SAFETY: map values at the thread's slot; only its own events write its open fault and its
    // storm bookkeeping.
    let (flags, start, st) = unsafe { ((*s).flags, (*s).fault_start, &mut *st) };
    if flags & F_FAULT_UNTIMED != 0 {
        // A storm's untimed fault: counted, no clock read.
        update(s, |s| {
            s.fault_close_untimed(st);
        });
        return;
    }
    if start == 0 {
        // A `get_user_pages` fault, or one in progress at attach: not counted.
        return;
    }
    // SAFETY: helper without preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    let (mut lat, mut class, mut weight, mut refault) = (0u64, 0usize, 1u64, None);
    update(s, |s| {
        let start = s.fault_start;
        let opened = s.flags & F_FAULT_REFAULT != 0;
        if let Some(c) = s.fault_close(now, st) {
            (lat, class, weight) = c;
        }
        if opened {
            refault = Some((start, s.time[T_FAULT_IO]));
        }
    });
    closed(tid, slot, lat, class, weight, refault);
}

/// The memcg close of a thread without a slot: in its overflow entry, or, with the table full,
/// counted in `OTHER_FAULTS[OTHER_CLOSES]`.
#[inline(always)]
fn overflow_close(tid: u32, now: u64) {
    let Some(f) = overflow_faults(tid) else { return count_other(OTHER_CLOSES) };
    // SAFETY: map value; only this thread's own fault events write it.
    if let Some((lat, major)) = unsafe { (*f).close(now) } {
        overflow_time(f, lat, major);
    }
}

/// `PGMAJFAULT`: the current thread's open fault reads its page (from a file or swap).
#[inline(always)]
fn memcg_major() {
    let Some(tid) = target_tid() else { return };
    if let Some(s) = state_of(tid) {
        // SAFETY: map value; only this thread's own events write its open fault.
        if unsafe { (*s).fault_open() } {
            // SAFETY: helper without preconditions.
            let now = unsafe { bpf_ktime_get_ns() };
            update(s, |s| s.fault_major(now));
        }
    } else if let Some(f) = OVERFLOW_FAULTS.get_ptr_mut(&tid) {
        // SAFETY: map value; only this thread's own fault events write it.
        unsafe {
            if (*f).fault_start != 0 {
                (*f).flags |= OVF_MAJOR;
            }
        }
    }
}

/// A `major-faults` event under the memcg close: the fault it counts closed already; if it closed
/// as minor, the kernel counted it major (`ThreadState::retried_major`). A thread with no row
/// counts it in `OTHER_FAULTS[OTHER_MAJFLT]` (its closes are in `OTHER_CLOSES`).
#[inline(always)]
fn memcg_major_exit() {
    let Some(tid) = target_tid() else { return };
    if let Some(s) = state_of(tid) {
        // SAFETY: map value; only this thread's own events write its flags.
        if unsafe { (*s).flags } & F_CLOSED_MINOR != 0 {
            update(s, |s| {
                s.retried_major();
            });
        }
    } else if let Some(f) = OVERFLOW_FAULTS.get_ptr_mut(&tid) {
        // SAFETY: map value; only this thread's own fault events write it.
        unsafe {
            if (*f).flags & OVF_CLOSED_MINOR != 0 {
                (*f).retried_major();
            }
        }
    } else {
        count_other(OTHER_MAJFLT);
    }
}

#[perf_event]
pub fn fault_exit_maj(_ctx: PerfEventContext) -> u32 {
    if config().is_some_and(|c| c.memcg_close != 0) {
        memcg_major_exit();
        return 0;
    }
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
        update(s, |s| s.file_fault(now));
    }
    0
}
