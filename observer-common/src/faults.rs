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
//!
//! Threads without a slot (all `attrib::MAX_SLOTS` given out: a server with
//! more threads) keep their faults in [`OverflowFaults`], the value of the
//! `OVERFLOW_FAULTS` hash map keyed by TID, at most [`MAX_OVERFLOW_THREADS`]
//! entries, made at a thread's first fault event and never removed. Their
//! fault latencies are timed the same way; a major fault there is not split
//! into file and swap (that needs the attribution state), so only their minor
//! faults enter the global latency histograms. When that table is full too,
//! a further thread's completed faults are counted in the per-CPU
//! `OTHER_FAULTS` ([`OTHER_MAJFLT`], [`OTHER_MINFLT`]): every fault exit still
//! counted, none timed (one "other" row, `totals::OTHER_TID`). The slot path
//! never touches either map.

use crate::{attrib::Hist, hist::HIST_BUCKETS};

/// Entries of `OVERFLOW_FAULTS`: threads beyond the attribution slots whose faults keep a row.
pub const MAX_OVERFLOW_THREADS: u32 = 8192;

/// Index in the per-CPU `OTHER_FAULTS` array: major fault exits of threads with no row.
pub const OTHER_MAJFLT: u32 = 0;
/// Index in the per-CPU `OTHER_FAULTS` array: minor fault exits of threads with no row.
pub const OTHER_MINFLT: u32 = 1;

/// The faults of a thread without an attribution slot (module spec): counts, the open fault and
/// the latencies of its completed faults, as a slotted thread's state and [`FaultTimes`] keep them.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct OverflowFaults {
    /// Kernel time of the entry of the open fault, 0 when none.
    pub fault_start: u64,
    /// The thread's process.
    pub tgid: u32,
    pub _pad: u32,
    /// Thread name at its first fault event, NUL padded.
    pub comm: [u8; 16],
    pub majflt: u64,
    pub minflt: u64,
    /// An entry while another fault was still open (the earlier one failed).
    pub unmatched_entries: u64,
    /// An exit with no open entry (counted in `majflt`/`minflt`, no time).
    pub unmatched_exits: u64,
    pub times: FaultTimes,
}
const _: () = assert!(core::mem::size_of::<OverflowFaults>() == 8 * 8 + core::mem::size_of::<FaultTimes>());

impl OverflowFaults {
    /// A fault entry at `now` (the same rule as `ThreadState::fault_enter`).
    #[inline(always)]
    pub fn enter(&mut self, now: u64) {
        if self.fault_start != 0 {
            self.unmatched_entries += 1;
        }
        self.fault_start = now;
    }

    /// A fault exit at `now`: counted; returns its latency, 0 when its entry was not seen (the
    /// same rule as `ThreadState::fault_exit`), which the caller adds to [`Self::times`].
    #[inline(always)]
    pub fn exit(&mut self, now: u64, major: bool) -> u64 {
        if major {
            self.majflt += 1;
        } else {
            self.minflt += 1;
        }
        let lat = if self.fault_start == 0 || now < self.fault_start {
            self.unmatched_exits += 1;
            0
        } else {
            now - self.fault_start
        };
        self.fault_start = 0;
        lat
    }
}

/// Filter and options, written by user space into the `CONFIG` array (index 0)
/// before the programs are attached.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Config {
    /// Only events of this process (all its threads) are counted.
    pub target_tgid: u32,
    /// Block major number of zram devices (from /proc/devices), 0 when none.
    pub zram_major: u32,
    /// Non-zero: the process (TGID) to stop (SIGSTOP) when it `exec`s, so
    /// that user space can attach the new program's token markers before it
    /// runs on; user space continues it. Only the process the observer
    /// spawned (its parent is the observer) or one the user asked to hold:
    /// any other's parent would see it stop (`perf stat` ends when its
    /// child stops, a shell with job control reports it).
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
    // SAFETY: as above.
    unsafe impl aya::Pod for super::OverflowFaults {}
}
