//! Maps shared by the programs, and small helpers around them.

use aya_ebpf::{
    helpers::bpf_get_current_pid_tgid,
    macros::map,
    maps::{Array, HashMap, PerCpuArray},
};
use observer_common::{Config, GlobalCounter, ThreadFaults, faults::GLOBAL_COUNTERS};

/// Upper bound on threads tracked per run; beyond it events count as lost.
pub const MAX_THREADS: u32 = 8192;

#[map]
pub static CONFIG: Array<Config> = Array::with_max_entries(1, 0);

#[map]
pub static THREAD_FAULTS: HashMap<u32, ThreadFaults> = HashMap::with_max_entries(MAX_THREADS, 0);

/// A zeroed value to insert new threads from (too large for the BPF stack).
#[map]
pub static FAULTS_TEMPLATE: PerCpuArray<ThreadFaults> = PerCpuArray::with_max_entries(1, 0);

#[map]
pub static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(GLOBAL_COUNTERS, 0);

/// The current thread's TID when it belongs to the target process.
#[inline(always)]
pub fn target_tid() -> Option<u32> {
    let id = bpf_get_current_pid_tgid();
    let tgid = (id >> 32) as u32;
    let cfg = CONFIG.get(0)?;
    if cfg.target_tgid == 0 || cfg.target_tgid != tgid {
        return None;
    }
    Some(id as u32)
}

#[inline(always)]
pub fn bump(counter: GlobalCounter) {
    if let Some(p) = COUNTERS.get_ptr_mut(counter as u32) {
        // SAFETY: per-CPU slot, programs do not nest on one CPU for these hooks.
        unsafe { *p += 1 };
    }
}
