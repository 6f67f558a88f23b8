//! Scheduling: `sched:sched_switch` (on/off CPU, runnable or blocked),
//! `sched:sched_waking` (blocked → runnable, at the moment the waker decides;
//! `sched_wakeup` fires later, after any cross-CPU IPI; the waker's own state decides
//! whether the wait was for its I/O, `attrib`'s `io_wait_peer` rule), `sched:sched_process_exit`.
//! `task:task_newtask` grows the set of observed processes (`maps::TARGETS`),
//! `sched:sched_process_free` of a followed process's leader shrinks it.
//! Field offsets come from tracefs (`OFFSETS`). Minimum kernel: 4.7.
//!
//! `sched_switch` runs as the *previous* task; the next task is known only by
//! its TID, so only threads already tracked are switched in. Where the kernel passes the
//! previous task's state to the raw tracepoint (Linux >= 5.18) and has BTF, the scheduler's
//! events run BTF tracepoint programs (`tp_btf`: a raw tracepoint whose task pointers the
//! verifier knows, so a task's `pid` is a plain load at the offset the loader fixes,
//! `observer_common::attrib::TASK_PID`), and one of them (`switch_raw`) does the whole switch
//! and tells the programs that run in a task which one is current (`maps::SLOT_CACHE`'s
//! `CURRENT`): no record is built for every event on the host, and no helper reads a field.
//! Elsewhere the tracepoint's program (`sched_switch`) does, with `switch_forget`, a raw
//! tracepoint on the same event, to clear `CURRENT`. A thread's name is taken at its first event
//! and again when it changes (`task:task_rename`: `prctl(PR_SET_NAME)`, exec), not at every
//! switch.
//! `sched_waking` runs in the waker's context (any process): the wakee is looked up by TID.

use aya_ebpf::{
    EbpfContext,
    helpers::{bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_ktime_get_ns, bpf_send_signal},
    macros::{btf_tracepoint, raw_tracepoint, tracepoint},
    programs::{BtfTracePointContext, RawTracePointContext, TracePointContext},
};

use observer_common::{
    GlobalCounter,
    attrib::{ExecRecord, F_ON_CPU, REC_EXEC, switch_runnable},
};

use crate::maps::{
    BPF_RB_FORCE_WAKEUP, EVENTS, TARGETS, THREADS, bump, closed, config, current_known, current_slot, current_state,
    forget_current, offsets, retire, slot_of, state_of, switched_in, target_tid, update,
};

#[inline(always)]
fn clock() -> u64 {
    // SAFETY: helper without preconditions.
    unsafe { bpf_ktime_get_ns() }
}

/// `sched_switch` as a BTF tracepoint (`TP_PROTO(bool preempt, struct task_struct *prev, struct
/// task_struct *next, unsigned int prev_state)`, Linux >= 5.18; module doc), attached before any
/// fault program. The previous task is the current one: known since the CPU's last switch
/// (`CURRENT`), or named now. The next one is read from its task; a tracked one is this CPU's
/// current task from now on (`CURRENT` set), any other is not known (cleared). The clock is read
/// only when a tracked thread switches.
#[btf_tracepoint(function = "sched_switch")]
pub fn switch_raw(ctx: BtfTracePointContext) -> i32 {
    let args = ctx.as_ptr() as *const u64;
    // SAFETY: the tracepoint's arguments, one per u64 slot.
    let (preempt, next, prev_state) = unsafe { (*args, *args.add(2), *args.add(3)) };
    let mut now = 0;
    let prev = match current_known() {
        Some((_, slot)) => Some(slot),
        None => target_tid().and_then(|tid| {
            now = clock();
            current_slot(tid, now)
        }),
    };
    if let Some(s) = prev.and_then(|slot| THREADS.get_ptr_mut(slot)) {
        if now == 0 {
            now = clock();
        }
        update(s, |s| s.switch_out(now, switch_runnable(preempt, prev_state)));
    }
    let Some((tid, slot)) = task_tid(next).and_then(|tid| Some((tid, slot_of(tid)?))) else {
        forget_current();
        return 0;
    };
    switched_in(tid, slot);
    if let Some(s) = THREADS.get_ptr_mut(slot) {
        if now == 0 {
            now = clock();
        }
        update(s, |s| s.switch_in(now));
    }
    0
}

/// `observer_common::attrib::TASK_PID`, set by the loader.
#[unsafe(no_mangle)]
static TASK_PID: u32 = 0;

/// The TID of the task at `task` (a `struct task_struct *` argument of a BTF tracepoint): its
/// `pid`, loaded directly (module doc).
#[inline(always)]
fn task_tid(task: u64) -> Option<u32> {
    if task == 0 {
        return None;
    }
    // SAFETY: a read-only global; the verifier knows its value, and checks the load below
    // against the kernel's BTF of the task (a faulting load reads 0).
    let pid = unsafe {
        let off = core::ptr::read_volatile(&TASK_PID);
        core::ptr::read_volatile((task as *const u8).add(off as usize) as *const i32)
    };
    (pid > 0).then_some(pid as u32)
}

/// `sched_switch` as a raw tracepoint, for one thing: this CPU's current task changes, so the
/// fault programs no longer know it (`maps::forget_current`). Attached before any fault program,
/// beside the tracepoint's `sched_switch`, where `switch_raw` cannot be (module doc).
#[raw_tracepoint(tracepoint = "sched_switch")]
pub fn switch_forget(_ctx: RawTracePointContext) -> i32 {
    forget_current();
    0
}

#[tracepoint]
pub fn sched_switch(ctx: TracePointContext) -> u32 {
    let Some(o) = offsets() else { return 0 };
    let now = clock();
    // The previous task is the current one.
    if let Some(tid) = target_tid() {
        let state: u64 = if o.switch_prev_state_size == 8 {
            // SAFETY: offset from the tracepoint's format file.
            unsafe { ctx.read_at::<u64>(o.switch_prev_state as usize) }.unwrap_or(1)
        } else {
            // SAFETY: as above.
            unsafe { ctx.read_at::<u32>(o.switch_prev_state as usize) }.map(u64::from).unwrap_or(1)
        };
        let runnable = state & 0xff == 0;
        if let Some(s) = current_state(tid, now) {
            update(s, |s| s.switch_out(now, runnable));
        }
    }
    // SAFETY: offset from the tracepoint's format file.
    let next: i32 = unsafe { ctx.read_at(o.switch_next_pid as usize) }.unwrap_or(0);
    if next > 0
        && let Some(s) = state_of(next as u32)
    {
        update(s, |s| s.switch_in(now));
    }
    0
}

/// `sched:sched_stat_runtime`: the scheduler charged a task CPU time; the event names the
/// task (not always the current one). A tracked thread that our events have off the CPU had a
/// switch-in without `sched_switch` (`attrib`'s spec, `ThreadState::ran`).
#[tracepoint]
pub fn sched_runtime(ctx: TracePointContext) -> u32 {
    let Some(o) = offsets() else { return 0 };
    // SAFETY: offset from the tracepoint's format file.
    let pid: i32 = unsafe { ctx.read_at(o.runtime_pid as usize) }.unwrap_or(0);
    if pid > 0 {
        // SAFETY: offset from the tracepoint's format file.
        on_runtime(pid as u32, || unsafe { ctx.read_at(o.runtime_ns as usize) }.unwrap_or(0));
    }
    0
}

/// `sched_stat_runtime` as a BTF tracepoint (`TP_PROTO(struct task_struct *tsk, u64 runtime, …)`),
/// beside `switch_raw`.
#[btf_tracepoint(function = "sched_stat_runtime")]
pub fn runtime_raw(ctx: BtfTracePointContext) -> i32 {
    let args = ctx.as_ptr() as *const u64;
    // SAFETY: the tracepoint's arguments, one per u64 slot.
    let (task, runtime) = unsafe { (*args, *args.add(1)) };
    if let Some(pid) = task_tid(task) {
        on_runtime(pid, || runtime);
    }
    0
}

/// Task `pid` was charged `runtime()` ns of CPU time up to now (`sched_runtime`).
#[inline(always)]
fn on_runtime(pid: u32, runtime: impl FnOnce() -> u64) {
    let Some(s) = state_of(pid) else { return };
    // SAFETY: map value; a racing update on the thread's own CPU is redone by its next event.
    if unsafe { (*s).flags } & F_ON_CPU != 0 {
        return;
    }
    let runtime = runtime();
    let now = clock();
    let closed = closed();
    update(s, |s| s.ran(now, runtime, closed));
}

#[tracepoint]
pub fn sched_wakeup(ctx: TracePointContext) -> u32 {
    let Some(o) = offsets() else { return 0 };
    // SAFETY: offset from the tracepoint's format file.
    let pid: i32 = unsafe { ctx.read_at(o.wakeup_pid as usize) }.unwrap_or(0);
    if pid > 0 {
        on_waking(pid as u32);
    }
    0
}

/// `sched_waking` as a BTF tracepoint (`TP_PROTO(struct task_struct *p)`), beside `switch_raw`.
#[btf_tracepoint(function = "sched_waking")]
pub fn waking_raw(ctx: BtfTracePointContext) -> i32 {
    // SAFETY: the tracepoint's argument.
    let task = unsafe { *(ctx.as_ptr() as *const u64) };
    if let Some(pid) = task_tid(task) {
        on_waking(pid);
    }
    0
}

/// Task `pid` is woken, by the current task (`sched_wakeup`).
#[inline(always)]
fn on_waking(pid: u32) {
    let Some(s) = state_of(pid) else { return };
    let now = clock();
    // The current task: the waker when it is a thread of the target in a syscall
    // (`attrib`'s rule for `io_wait_peer`, interrupt context included). Known since the CPU's
    // last switch, or looked up (not marked current: a wakeup may come inside a switch).
    let waker = match current_known() {
        Some(known) => Some(known),
        None => target_tid().and_then(|t| Some((t, slot_of(t)?))),
    };
    let peer_io = match waker.filter(|&(t, _)| t != pid).and_then(|(_, slot)| THREADS.get_ptr_mut(slot)) {
        // SAFETY: map values; the waker's fields are read once, a torn read only misjudges this wait.
        Some(w) => unsafe { (*w).wakes_with_io(&*s) },
        None => false,
    };
    // The latest snapshot's instant matters only to a wait that becomes `io_wait_peer`.
    let closed = if peer_io { closed() } else { 0 };
    update(s, |s| s.wakeup(now, peer_io, closed));
}

/// `task:task_rename`: a task's name changes (`prctl(PR_SET_NAME)`, a write to its `comm` file,
/// exec), in any task: a tracked thread's row takes the new one.
#[tracepoint]
pub fn task_rename(ctx: TracePointContext) -> u32 {
    let Some(o) = offsets() else { return 0 };
    // SAFETY: offset from the tracepoint's format file.
    let pid: i32 = unsafe { ctx.read_at(o.rename_pid as usize) }.unwrap_or(0);
    if pid <= 0 {
        return 0;
    }
    let Some(s) = state_of(pid as u32) else { return 0 };
    // SAFETY: offset from the tracepoint's format file (`char newcomm[16]`).
    let Ok(comm) = (unsafe { ctx.read_at::<[u8; 16]>(o.rename_newcomm as usize) }) else { return 0 };
    update(s, |s| s.comm = comm);
    0
}

#[tracepoint]
pub fn sched_exit(_ctx: TracePointContext) -> u32 {
    // Runs in the exiting task.
    let Some(tid) = target_tid() else { return 0 };
    // SAFETY: helper without preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    if let Some(s) = state_of(tid) {
        update(s, |s| s.exit(now));
    } else if let Some(s) = current_state(tid, now) {
        update(s, |s| s.exit(now));
    }
    0
}

/// `sched:sched_process_free` (an RCU callback, in no particular task): a followed process
/// leaves the set when its leader's task is freed, so that its ID can be reused by another.
/// Not at the leader's exit: in an `exit_group` the leader usually exits first and its other
/// threads after it, and their events (their last switch, their exit, a first event that makes
/// a thread's row) still belong to the process. A leader is freed only once reaped, which is
/// after every thread of its group has exited; a non-leader's TID is never a key of the set.
/// The ID is given back a grace period before this runs: reusing it in that window takes the
/// kernel's PID allocator wrapping around, which this rule does not guard against.
#[tracepoint]
pub fn process_free(ctx: TracePointContext) -> u32 {
    if let Some(pid) = freed_pid(&ctx) {
        let _ = TARGETS.remove(&pid);
    }
    0
}

/// The TID of the task `sched:sched_process_free` frees.
#[inline(always)]
fn freed_pid(ctx: &TracePointContext) -> Option<u32> {
    let o = offsets()?;
    // SAFETY: offset from the tracepoint's format file.
    let pid: i32 = unsafe { ctx.read_at(o.free_pid as usize) }.unwrap_or(0);
    (pid > 0).then_some(pid as u32)
}

/// `sched:sched_process_free` again (any task's, in no particular task): a tracked thread's task
/// is freed, after its last event, so its slot is given back (`maps::retire`).
#[tracepoint]
pub fn thread_free(ctx: TracePointContext) -> u32 {
    if let Some(tid) = freed_pid(&ctx) {
        retire(tid);
    }
    0
}

/// `sched:sched_process_exec`: tell user space, at once (forced wakeup), so
/// that it can attach the token markers of the new program.
#[tracepoint]
pub fn sched_exec(_ctx: TracePointContext) -> u32 {
    let Some(tid) = target_tid() else { return 0 };
    // The new program's name (exec set it before this tracepoint).
    if let Some(s) = state_of(tid) {
        let comm = bpf_get_current_comm().unwrap_or([0; 16]);
        update(s, |s| s.comm = comm);
    }
    let held = config().map(|c| c.stop_on_exec).unwrap_or(0);
    if held != 0 && (bpf_get_current_pid_tgid() >> 32) as u32 == held {
        // SAFETY: signals the current (exec'ing) process; user space sends SIGCONT.
        unsafe { bpf_send_signal(SIGSTOP) };
    }
    let Some(mut e) = EVENTS.reserve::<ExecRecord>(0) else {
        bump(GlobalCounter::LostEvents);
        return 0;
    };
    // SAFETY: helper without preconditions.
    let ts = unsafe { bpf_ktime_get_ns() };
    e.write(ExecRecord { kind: REC_EXEC, tid, ts });
    e.submit(BPF_RB_FORCE_WAKEUP);
    0
}
const SIGSTOP: u32 = 19;

/// `CLONE_THREAD` (include/uapi/linux/sched.h): the new task is a thread of
/// the same process.
const CLONE_THREAD: u64 = 0x0001_0000;

/// `task:task_newtask`, in the forking task: a new process of an observed one
/// is observed too when `follow_children` is set (threads are tracked by
/// their process already).
#[tracepoint]
pub fn new_task(ctx: TracePointContext) -> u32 {
    if target_tid().is_none() || config().map(|c| c.follow_children == 0).unwrap_or(true) {
        return 0;
    }
    let Some(o) = offsets() else { return 0 };
    // SAFETY: offsets from the tracepoint's format file.
    let (pid, flags) = unsafe {
        (
            ctx.read_at::<i32>(o.newtask_pid as usize).unwrap_or(0),
            ctx.read_at::<u64>(o.newtask_clone_flags as usize).unwrap_or(CLONE_THREAD),
        )
    };
    if pid <= 0 || flags & CLONE_THREAD != 0 {
        return 0;
    }
    if TARGETS.insert(&(pid as u32), &1, 0).is_err() {
        bump(GlobalCounter::FollowOverflow);
    }
    0
}
