//! Syscalls: the raw tracepoints `sys_enter(struct pt_regs *regs, long id)` and
//! `sys_exit(struct pt_regs *regs, long ret)` (Linux >= 4.17: no record built for every
//! syscall on the host; the number and the return value are arguments, the call's own
//! arguments are read from `regs` only for the explicit reads). I/O syscalls
//! (a bitmap filled by user space per architecture) make blocked time
//! `io_wait`; other blocked syscalls are `sleep`. Reads of the model file are also charged to
//! its regions (`xread`).

use aya_ebpf::{EbpfContext, helpers::bpf_ktime_get_ns, macros::raw_tracepoint, programs::RawTracePointContext};

use crate::{
    maps::{IO_SYSCALLS, current_target, target_state, update},
    xread,
};

#[inline(always)]
fn is_io(id: i64) -> bool {
    if !(0..512).contains(&id) {
        return false;
    }
    let Some(word) = IO_SYSCALLS.get((id / 64) as u32) else { return false };
    word & (1u64 << (id % 64)) != 0
}

/// The tracepoint's two arguments: `regs` and the number (enter) or return value (exit).
#[inline(always)]
fn args(ctx: &RawTracePointContext) -> (u64, i64) {
    let a = ctx.as_ptr() as *const u64;
    // SAFETY: the tracepoint's arguments, one per u64 slot.
    unsafe { (*a, *a.add(1) as i64) }
}

#[raw_tracepoint(tracepoint = "sys_enter")]
pub fn sys_enter(ctx: RawTracePointContext) -> i32 {
    let Some((tid, slot)) = current_target() else { return 0 };
    let (regs, id) = args(&ctx);
    // SAFETY: helper without preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    let Some((slot, s)) = target_state(tid, slot, now) else { return 0 };
    update(s, |s| s.syscall_enter(now, is_io(id)));
    // SAFETY: map value; a thread's process does not change.
    xread::enter(regs, slot, unsafe { (*s).tgid }, id, now);
    0
}

#[raw_tracepoint(tracepoint = "sys_exit")]
pub fn sys_exit(ctx: RawTracePointContext) -> i32 {
    let Some((tid, slot)) = current_target() else { return 0 };
    let (_, ret) = args(&ctx);
    // SAFETY: helper without preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    let Some((slot, s)) = target_state(tid, slot, now) else { return 0 };
    update(s, |s| s.syscall_exit(now));
    // SAFETY: map value; a thread's process does not change.
    xread::exit(ret, tid, slot, unsafe { (*s).tgid }, now);
    0
}
