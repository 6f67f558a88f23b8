//! Page-fault bracketing: per-thread accumulators.
//!
//! Measurement rule (see `observer-ebpf/src/faults.rs` for the probes): a fault *opens* where
//! it starts, in `do_user_addr_fault` (x86: the raw tracepoints `exceptions:page_fault_user` and
//! `page_fault_kernel` for a user address; elsewhere the perf software event `page-faults`), and
//! *closes* where the kernel accounts it, in `mm_account_fault` (once per fault, after any
//! retry). The time between the two, on or off CPU, is the fault's latency. Faults that fail
//! before the kernel handles them (SIGSEGV on no mapping) open and never close (`unmatched_entries`
//! counts an entry while one is open). One of two closes is chosen at attach:
//!
//! - **The memcg close** (Linux >= 6.14 with the memory controller on, unless `--fault-close
//!   perf`): the tracepoint `memcg:count_memcg_events` with item `PGFAULT`, which
//!   `mm_account_fault` raises just before the perf events, taken as a raw tracepoint: it spares
//!   every fault perf's overflow path (issue 19's fault storm). The fault is major when
//!   `PGMAJFAULT` was counted inside it (the kernel counts it where it returns `VM_FAULT_MAJOR`:
//!   the page was read from a file or swap). `getrusage` and perf also call major a fault the
//!   kernel retried twice (`FAULT_FLAG_TRIED`) without reading in it (it waited for a page another
//!   thread was reading): the perf event `major-faults` stays attached (it fires only for major
//!   faults), and moves such a fault's count from minor to major file; its latency stays in the
//!   minor histogram. `PGFAULT` is raised also for faults the handler failed (SIGBUS, a hardware
//!   poisoned page): counted here as minor, not by perf. It is raised as well for faults taken
//!   through `get_user_pages` (exec copying its arguments, `mlock`, `MAP_POPULATE`), which open
//!   nothing: a close without an open fault is not counted (perf does not count those either; a
//!   fault in progress at attach, which perf would count, is left out the same way).
//! - **The perf close** (other kernels, or `--fault-close perf`): the perf software events
//!   `major-faults` / `minor-faults`, raised in `mm_account_fault` for faults taken with user
//!   registers (not through `get_user_pages`) that did not fail, which say major or minor. An
//!   exit without an open fault (one in progress at attach) is counted, without a time
//!   (`unmatched_exits`).
//!
//! The counts and the open fault are the thread's attribution state
//! (`attrib::ThreadState`: `fault_start`, `cnt[C_MINFLT]`, `cnt[C_MAJFLT_*]`,
//! `cnt[C_FAULT_UNMATCHED_*]`); the latencies of its completed faults are
//! [`FaultTimes`], at the same slot. Every fault is counted; every fault is timed but in
//! fault storms:
//!
//! ## Storm sampling (issue 19: the observer's cost in a fault storm)
//! Timing a fault takes two clock reads, about half of what the probes cost a 1–2 µs fault.
//! Under the memcg close (unless `observer run --time-every-fault`), a thread whose faults come
//! in a *storm* has most of its user-mode faults counted but not timed:
//! - A thread's faults are taken in *windows* of `attrib::STORM_WINDOW` (64) faults. When a window
//!   is full, the next one is a storm if this one lasted less than `STORM_NS_PER_FAULT` (16 µs)
//!   per fault (where timing every fault would cost the thread over 1 % of its time) and none of
//!   its faults was *slow*: blocked or was preempted (`sched_switch`),
//!   reclaimed, queued a read bio, counted `PGMAJFAULT`, went through `filemap_fault`, or brought
//!   back an evicted page. The thread's first window is never a storm.
//! - In a storm, a user-mode fault enters *untimed* (no clock read, `attrib::F_FAULT_UNTIMED`)
//!   but about 1 in `STORM_SAMPLE` (8), at gaps drawn from 0 to 14 by the thread's own generator
//!   (`attrib::Storm::draw`; a fixed stride would keep timing the same kind of fault), which is
//!   timed. Kernel-mode faults (on user addresses, in
//!   syscalls) are always timed, and so are faults opened by the perf event `page-faults` (arm64:
//!   the sampling needs the x86 raw tracepoint `exceptions:page_fault_user`).
//! - An untimed fault's time stays in the context it interrupted, `compute`. If something slow
//!   happens in it, it is timed from that event on (`ThreadState::slow`): the slow part (I/O,
//!   zram, reclaim, a wait) is attributed exactly, the part before it stays in `compute`, and the
//!   storm ends at once (the rest of the window is timed, and it ends out of storm). Otherwise its close counts it as a minor fault (`cnt[C_MINFLT]`)
//!   and as untimed (`cnt[C_FAULT_UNTIMED]`: the vocabulary's counter `minflt_untimed`, per token,
//!   in the totals and in Prometheus' `faults_untimed_total`).
//! - The next timed minor fault in which nothing slow happened (a *sample*) stands for itself and
//!   the untimed faults before it: its latency enters the histograms with that weight
//!   (`Hist::add_weighted`), and `untimed × latency` moves from `compute` to `fault_minor`, at
//!   most the compute time since the last timed fault closed with none waiting (which holds the
//!   untimed faults' real time, so no time is invented and the components still add up).
//! - So counts stay exact; in a storm the minor-fault time and latency histograms are estimates
//!   from 1 fault in 8. A timed fault is slower than an untimed one by part of the probes' own
//!   work (its clock reads and state update fall inside it), so the estimate leans high by up to
//!   that, about 5 % of a 1.5 µs fault here. The rare slow faults that nothing marks as slow (an
//!   interrupt, the hypervisor taking the vCPU: 30–500 µs, about 1 in 3000 on these VMs) are
//!   sampled like the rest, 1 in 8 standing for 8, so one run's histogram mean moves with the
//!   few it caught. The test compares each run's time per fault as a share of the workload's own
//!   time per fault (the host's speed moves by ±15 % between adjacent runs here; the share by a
//!   few %), median of 5 alternating pairs: `fault_minor` 0.99–1.02 of timing every fault, the
//!   histogram mean 1.075–1.078 (3 runs with the vmtest guest beside). `fault_minor` is lower than
//!   the histogram because the cap trims a sample slower than the faults it stands for. The test
//!   allows 20 %, which a wrong weight or a lost estimate (a factor of 8) still fails. At a thread's end
//!   (or a mark), up to `2 × STORM_SAMPLE − 2` (14: the longest gap drawn) untimed faults may
//!   wait for a sample: counted, in no histogram, their
//!   time in `compute`.
//! - Overflow threads (no slot) and the perf close time every fault.
//!
//! Threads without a slot (all `attrib::MAX_SLOTS` given out: a server with
//! more threads) keep their faults in [`OverflowFaults`], the value of the
//! `OVERFLOW_FAULTS` hash map keyed by TID, at most [`MAX_OVERFLOW_THREADS`]
//! entries, made at a thread's first fault event and never removed. Their
//! fault latencies are timed the same way; a major fault there is not split
//! into file and swap (that needs the attribution state), so only their minor
//! faults enter the global latency histograms. When that table is full too,
//! a further thread's completed faults are counted in the per-CPU
//! `OTHER_FAULTS` ([`OTHER_MAJFLT`], [`OTHER_MINFLT`]; under the memcg close,
//! every close in [`OTHER_CLOSES`], majors included, a close without an open fault
//! too): every fault exit still counted, none timed (one "other" row, `totals::OTHER_TID`). The slot path
//! never touches either map.

use crate::{attrib::Hist, hist::HIST_BUCKETS};

/// Entries of `OVERFLOW_FAULTS`: threads beyond the attribution slots whose faults keep a row.
pub const MAX_OVERFLOW_THREADS: u32 = 8192;

/// Index in the per-CPU `OTHER_FAULTS` array: major fault exits of threads with no row.
pub const OTHER_MAJFLT: u32 = 0;
/// Index in the per-CPU `OTHER_FAULTS` array: minor fault exits of threads with no row.
pub const OTHER_MINFLT: u32 = 1;
/// Index in the per-CPU `OTHER_FAULTS` array, under the memcg close: fault closes of threads with
/// no row, major ones included (their minor faults are these less `OTHER_MAJFLT`).
pub const OTHER_CLOSES: u32 = 2;

/// The faults of a thread without an attribution slot (module spec): counts, the open fault and
/// the latencies of its completed faults, as a slotted thread's state and [`FaultTimes`] keep them.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct OverflowFaults {
    /// Kernel time of the entry of the open fault, 0 when none.
    pub fault_start: u64,
    /// The thread's process.
    pub tgid: u32,
    /// `OVF_*` bits: the memcg close's state of the open and the last fault.
    pub flags: u32,
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

/// `OverflowFaults::flags`: the open fault counted `PGMAJFAULT` (as `attrib::F_FAULT_MAJOR`).
pub const OVF_MAJOR: u32 = 1 << 0;
/// `OverflowFaults::flags`: the last fault closed as minor, none opened since (as
/// `attrib::F_CLOSED_MINOR`).
pub const OVF_CLOSED_MINOR: u32 = 1 << 1;

impl OverflowFaults {
    /// No faults yet, of a thread of process `tgid`.
    pub const fn zeroed(tgid: u32) -> Self {
        let h = Hist { b: [0; HIST_BUCKETS], sum: 0 };
        OverflowFaults {
            fault_start: 0,
            tgid,
            flags: 0,
            comm: [0; 16],
            majflt: 0,
            minflt: 0,
            unmatched_entries: 0,
            unmatched_exits: 0,
            times: FaultTimes { majflt: h, minflt: h },
        }
    }

    /// A fault entry at `now` (the same rule as `ThreadState::fault_enter`).
    #[inline(always)]
    pub fn enter(&mut self, now: u64) {
        if self.fault_start != 0 {
            self.unmatched_entries += 1;
        }
        self.fault_start = now;
        self.flags = 0;
    }

    /// The memcg close at `now` (the same rule as `ThreadState::fault_close`): with a fault open,
    /// [`Self::exit`] it, major when it counted `PGMAJFAULT`, and return (its latency, major);
    /// `None` without one.
    #[inline(always)]
    pub fn close(&mut self, now: u64) -> Option<(u64, bool)> {
        if self.fault_start == 0 {
            return None;
        }
        let major = self.flags & OVF_MAJOR != 0;
        let lat = self.exit(now, major);
        self.flags = if major { 0 } else { OVF_CLOSED_MINOR };
        Some((lat, major))
    }

    /// A `major-faults` event under the memcg close (as `ThreadState::retried_major`): the count
    /// of the fault just closed as minor moves to major. Returns whether it moved.
    #[inline(always)]
    pub fn retried_major(&mut self) -> bool {
        if self.flags & OVF_CLOSED_MINOR == 0 {
            return false;
        }
        self.flags = 0;
        self.minflt = self.minflt.saturating_sub(1);
        self.majflt += 1;
        true
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
    /// Non-zero: faults are closed by the tracepoint `memcg:count_memcg_events` (module spec:
    /// the memcg close), whose `item` is compared with the two values below.
    pub memcg_close: u32,
    /// `enum vm_event_item`'s `PGFAULT` in this kernel (from its BTF).
    pub pgfault_item: u32,
    /// `enum vm_event_item`'s `PGMAJFAULT` in this kernel (from its BTF).
    pub pgmajfault_item: u32,
    /// Non-zero (with the memcg close): fault storms are sampled (module spec).
    pub storm_sampling: u32,
}
const _: () = assert!(core::mem::size_of::<Config>() == 32);

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
    /// Thread copies a mark could not take whole: an update of the thread's state (on another
    /// CPU, or a switch of the marking thread itself) ran through every attempt (`observer-ebpf`'s
    /// `marks`). Each is also one of `LostEvents`.
    TornCopies = 3,
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
