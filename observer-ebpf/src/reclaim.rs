//! Reclaim: `vmscan:mm_vmscan_direct_reclaim_begin/end` (global pressure) and
//! `vmscan:mm_vmscan_memcg_reclaim_begin/end` (a cgroup at its limit). Both
//! run in the task that has to reclaim before it can allocate.

use aya_ebpf::{helpers::bpf_ktime_get_ns, macros::tracepoint, programs::TracePointContext};

use crate::maps::{current_state, target_tid, update};

#[inline(always)]
fn reclaim(begin: bool) -> u32 {
    let Some(tid) = target_tid() else { return 0 };
    // SAFETY: helper without preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    if let Some(s) = current_state(tid, now) {
        update(s, |s| s.reclaim(now, begin));
    }
    0
}

#[tracepoint]
pub fn reclaim_begin(_ctx: TracePointContext) -> u32 {
    reclaim(true)
}

#[tracepoint]
pub fn reclaim_end(_ctx: TracePointContext) -> u32 {
    reclaim(false)
}
