//! Syscalls: `raw_syscalls:sys_enter/sys_exit` (Linux >= 2.6.37). I/O syscalls
//! (a bitmap filled by user space per architecture) make blocked time
//! `io_wait`; other blocked syscalls are `sleep`. Reads of the model file are also charged to
//! its regions (`xread`).

use aya_ebpf::{helpers::bpf_ktime_get_ns, macros::tracepoint, programs::TracePointContext};

use crate::{
    maps::{IO_SYSCALLS, current_state, offsets, target_tid, update},
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

#[tracepoint]
pub fn sys_enter(ctx: TracePointContext) -> u32 {
    let Some(tid) = target_tid() else { return 0 };
    let Some(o) = offsets() else { return 0 };
    // SAFETY: offset from the tracepoint's format file.
    let id: i64 = unsafe { ctx.read_at(o.sys_id as usize) }.unwrap_or(-1);
    // SAFETY: helper without preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    let io = is_io(id);
    if let Some(s) = current_state(tid, now) {
        update(s, |s| s.syscall_enter(now, io));
    }
    xread::enter(&ctx, tid, id, now);
    0
}

#[tracepoint]
pub fn sys_exit(ctx: TracePointContext) -> u32 {
    let Some(tid) = target_tid() else { return 0 };
    // SAFETY: helper without preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    if let Some(s) = current_state(tid, now) {
        update(s, |s| s.syscall_exit(now));
    }
    xread::exit(&ctx, tid, now);
    0
}
