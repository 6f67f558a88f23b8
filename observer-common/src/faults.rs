//! Page-fault bracketing: per-thread accumulators.
//!
//! Measurement rule (see `observer-ebpf/src/faults.rs` for the probes):
//! a fault *enters* when the perf software event `page-faults` fires (in
//! `do_user_addr_fault`, for user- and kernel-mode faults on user addresses) and
//! *exits* when `major-faults` or `minor-faults` fires (in `mm_account_fault`,
//! once per completed fault, after any retry). The time between the two, on or
//! off CPU, is the fault's latency; the exit event says major or minor. Faults
//! that fail (SIGSEGV) have an entry and no exit; faults taken through
//! `get_user_pages` (no `pt_regs`) have neither — both are counted by the
//! kernel's `getrusage` but not here (`unmatched_*` counts what was seen).
//!
//! The counts and the open fault are the thread's attribution state
//! (`attrib::ThreadState`: `fault_start`, `cnt[C_MINFLT]`, `cnt[C_MAJFLT_*]`,
//! `cnt[C_FAULT_UNMATCHED_*]`); the latencies of its completed faults are
//! [`FaultTimes`], at the same slot. Every fault is counted and timed: nothing
//! here is sampled.

use crate::{attrib::Hist, hist::HIST_BUCKETS};

/// Filter and options, written by user space into the `CONFIG` array (index 0)
/// before the programs are attached.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Config {
    /// Only events of this process (all its threads) are counted.
    pub target_tgid: u32,
    /// Block major number of zram devices (from /proc/devices), 0 when none.
    pub zram_major: u32,
    /// Non-zero: stop the target (SIGSTOP) when it `exec`s, so that user
    /// space can attach the new program's token markers before it runs on;
    /// user space continues it. Only ever set for a target the observer
    /// spawned (an attached process's parent would see it stop).
    pub stop_on_exec: u32,
    /// Non-zero: a process the target (or a followed descendant) forks is
    /// observed too (`TARGETS`, bounded; `GlobalCounter::FollowOverflow`
    /// counts the processes not followed for want of room).
    pub follow_children: u32,
}
const _: () = assert!(core::mem::size_of::<Config>() == 16);

/// The latencies of one thread's completed faults (entry seen): the value of
/// the `FAULT_TIMES` array map at the thread's slot in `THREADS`. Each
/// histogram's `sum` is the total time in those faults, nanoseconds.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FaultTimes {
    pub majflt: Hist,
    pub minflt: Hist,
}
const _: () = assert!(core::mem::size_of::<FaultTimes>() == 2 * 8 * (HIST_BUCKETS + 1));

/// Indices of the per-CPU `COUNTERS` array: the observer's own health.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GlobalCounter {
    /// Events dropped because a map was full or a ring buffer had no room.
    LostEvents = 0,
    // Slot 1 is unused: the programs' runs are the kernel's `run_cnt` (`bpf_programs`).
    /// Descendants not followed because the set of followed processes was full.
    FollowOverflow = 2,
}
/// Number of slots in `COUNTERS`.
pub const GLOBAL_COUNTERS: u32 = 4;

#[cfg(feature = "user")]
mod pod {
    // SAFETY: repr(C), only integer fields and arrays, no padding holes
    // (checked by the size assertions above).
    unsafe impl aya::Pod for super::Config {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::FaultTimes {}
}
