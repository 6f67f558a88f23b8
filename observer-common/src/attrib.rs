//! Per-thread time attribution: the state machine shared by the eBPF programs
//! (which drive it from kernel events) and user space (which uses the same
//! code to close a snapshot at an arbitrary instant, and to test the rules).
//!
//! ## Measurement rule
//! Every thread of the target is, at every instant, in exactly one context.
//! Each kernel event first charges the interval since the thread's previous
//! event (`last_ts` → now) to the context it was in, then changes context:
//!
//! | on CPU? | innermost context                          | component     |
//! |---------|--------------------------------------------|---------------|
//! | yes     | direct / memcg reclaim                     | `reclaim`     |
//! | yes     | page fault, after it queued a zram read    | `swapin_zram` |
//! | yes     | page fault, disk read queued, not yet woken | `fault_io`   |
//! | yes     | page fault (otherwise)                     | `fault_minor` |
//! | yes     | explicit I/O syscall (read, pread, …)      | `io_wait`     |
//! | yes     | other syscall                              | `syscall`     |
//! | yes     | none (user mode)                           | `compute`     |
//! | no, runnable (preempted or woken) | any              | `runqueue`    |
//! | no, blocked | reclaim                                | `reclaim`     |
//! | no, blocked | page fault                             | `fault_io`    |
//! | no, blocked | explicit I/O syscall                   | `io_wait`     |
//! | no, blocked | anything else, woken by a peer's I/O   | `io_wait_peer` |
//! | no, blocked | anything else                          | `sleep`       |
//!
//! So `io_wait` is all the time in explicit I/O syscalls but run-queue waits
//! (what an engine measures around its reads as `io_ms`), and `fault_io` is a
//! fault's time from queueing a disk read until the wakeup that ends the wait
//! (the read's latency as the thread lives it), plus any other blocked time;
//! the CPU work of a fault before and after is `fault_minor`. A wakeup is the
//! `sched_waking` tracepoint: the moment the waker decides, so that the time
//! until the thread runs (IPI, queueing) is `runqueue`.
//!
//! Events: fault entry/exit (perf `page-faults` → `major-faults`/`minor-faults`),
//! `raw_syscalls:sys_enter/exit`, `vmscan:*reclaim_begin/end`,
//! `sched:sched_switch` (out: runnable when `prev_state & 0xff == 0`, i.e.
//! `TASK_RUNNING` or the preemption marker `TASK_REPORT_MAX`; in: on CPU),
//! `sched:sched_wakeup` (blocked → runnable), `sched:sched_process_exit`.
//! A zram read bio queued by the thread inside a fault switches that fault's
//! remaining on-CPU time to `swapin_zram` (the time before it stays
//! `fault_minor`). Fault *counts* are classified at exit: major with a zram or
//! swap-device read → `majflt_swap`; other majors → `majflt_file`.
//!
//! ## Waiting on a peer's I/O (`io_wait_peer`)
//! A blocked wait outside faults, reclaim and I/O syscalls (a futex, a
//! condvar, `poll`, …) is `sleep` unless the wakeup shows that it waited for
//! I/O. At `sched_waking` the program runs in the waker's context, so:
//! - a thread *did I/O* in an explicit I/O syscall or a fault that read from a
//!   device: it was woken from blocking on the read, or it queued a read bio
//!   (a read can complete before its thread blocks: on this project's VM the
//!   host sometimes completes a virtio read within the submission, and the
//!   thread never sleeps). Its I/O *ended* when that syscall or fault returned,
//!   which is when the data reached its code (`ThreadState::io_done`; the
//!   wakeup's instant until then; `F_DEVICE_IO` while in between). A `write` to
//!   the page cache or a `read` of cached data is not I/O in this sense.
//! - a wakeup is *by a peer's I/O* when the waker is a thread of the observed
//!   process, is inside a syscall (user code wakes another thread only through
//!   one: `futex`, `write` to an eventfd or pipe, …), and its I/O ended at or
//!   after the instant the wakee blocked (`ThreadState::wait_start`). The end,
//!   not the completion: a wakee that checked for the result, was delayed (or
//!   its vCPU stolen) and blocked after the disk completed but before the peer
//!   ran again still waited for that I/O's result. Then the
//!   wakee's wait is `io_wait_peer`: it waited for that I/O, including the
//!   peer's time to pick up the request and signal its end.
//! - Interrupt context: `sched_waking` in a hard or soft interrupt runs as the
//!   interrupted task, which is not the waker. A completion woken from an
//!   interrupt charges the I/O it completes, and that I/O is the wakee's own:
//!   the wakee's own context decides (`io_wait` in an I/O syscall, `fault_io`
//!   in a fault, `sleep` otherwise). The interrupted task is taken for a peer
//!   only if it is a thread of the process inside a syscall that did I/O during
//!   the wait; such an interrupt-driven wakeup (say a timer) is then counted as
//!   `io_wait_peer` — approximate, within the microseconds a peer spends in a
//!   syscall between its I/O and its wake call.
//! - Waits closed by a snapshot (a token mark) before the wakeup stay `sleep`:
//!   the waker is not known yet when they are charged ("Closed time stays closed").
//!
//! A thread that exists before the probes are attached is seeded at attach
//! (`F_SEEDED`) with what `/proc` shows, but the probes are attached after
//! the seed, so what it did in between is not known: its time is
//! `unattributed` (`F_UNKNOWN`) until its first event, which sets its context
//! (a switch, wakeup, syscall, fault or reclaim). Never `compute` by default.
//!
//! ## A switch-in without its event
//! Some kernels now and then put a thread on a CPU without a `sched_switch` naming it (seen on
//! this project's development VM: ftrace showed a thread run 1.6 ms on a CPU whose last switch
//! named another task). Until its next event such a thread would be charged `runqueue` or `sleep`
//! while it runs. `sched:sched_stat_runtime` repairs it: the scheduler charges the running task
//! its CPU time at every tick and switch-out (the event names the task, which is not always the
//! current one), so an event naming a thread our events have off the CPU puts it on the CPU
//! from `now - runtime` (`ThreadState::ran`; `runtime` is on the scheduler's task clock, which
//! leaves out IRQ and steal time where those are accounted, so the repaired switch-in is late by
//! them) and counts a missed switch-in (`C_MISSED_SWITCH_IN`).
//!
//! ## Closed time stays closed
//! A snapshot (a token mark, a window) closes each thread's copy at its instant with the
//! context the copy shows ([`ThreadState::account`] in user space), and a token is the
//! difference of two closed copies. Two events decide a context only later, for time the
//! kernel has not charged yet: a repaired switch-in (above) and a wakeup by a peer's I/O. If
//! they charged time before a snapshot differently than the snapshot did, the next token would
//! take it twice (a thread would show 4 ms of `compute` in a 1 ms token, seen in CI). So the
//! kernel keeps the instant the latest snapshot began (`closed`: the start of the latest mark,
//! or a window's instant written by user space), and these two charge their new context from
//! `closed` on at the earliest; the time before keeps the context the snapshot gave it. Exact
//! but for a thread whose event falls during a mark: the mark's own few µs may be counted
//! twice, and a token's component is then over by at most that.
//!
//! Hence the components of a thread add up to the time since it was first
//! seen, exactly, by construction; what is approximate is *which* component
//! gets a slice: user-mode time includes interrupts taken while in user mode
//! and the few hundred nanoseconds of kernel entry before a probe fires.

use crate::{
    hist::HIST_BUCKETS,
    vocab::{Component, Counter, LatencyKind, component_slot, counter_slot},
};

/// Time components the kernel measures (`ThreadState::time`). Their indices
/// are the components' `slot`s in the vocabulary (`vocab::COMPONENTS`).
pub const N_TIME: usize = 11;
pub const T_COMPUTE: usize = component_slot(Component::Compute);
pub const T_FAULT_MINOR: usize = component_slot(Component::FaultMinor);
pub const T_SWAPIN_ZRAM: usize = component_slot(Component::SwapinZram);
pub const T_FAULT_IO: usize = component_slot(Component::FaultIo);
pub const T_IO_WAIT: usize = component_slot(Component::IoWait);
pub const T_RECLAIM: usize = component_slot(Component::Reclaim);
pub const T_SYSCALL: usize = component_slot(Component::Syscall);
pub const T_RUNQUEUE: usize = component_slot(Component::Runqueue);
pub const T_SLEEP: usize = component_slot(Component::Sleep);
pub const T_UNATTRIBUTED: usize = component_slot(Component::Unattributed);
pub const T_IO_WAIT_PEER: usize = component_slot(Component::IoWaitPeer);

/// Per-thread counters (`ThreadState::cnt`). The vocabulary's counters that the
/// kernel keeps per thread sit at their `slot`s (`vocab::COUNTERS`); the rest
/// are observer-internal.
pub const N_CNT: usize = 16;
pub const C_MAJFLT_FILE: usize = counter_slot(Counter::MajfltFile);
pub const C_MAJFLT_SWAP: usize = counter_slot(Counter::MajfltSwap);
pub const C_MINFLT: usize = counter_slot(Counter::Minflt);
/// Pages read from swap devices (zram included) by this thread's faults.
pub const C_SWAPINS: usize = counter_slot(Counter::Swapins);
/// Bytes of read bios this thread queued, any block device.
pub const C_READ_BYTES: usize = counter_slot(Counter::ReadBytes);
/// Switch-ins the kernel did without a `sched_switch` event, repaired by
/// [`ThreadState::ran`] (module spec). Observer-internal: slot 5 is no vocabulary counter's
/// (page-cache churn is counted per file, not per thread).
pub const C_MISSED_SWITCH_IN: usize = 5;
/// Minor faults taken untimed in a fault storm (`observer_common::faults`, storm sampling): counted
/// in `cnt[C_MINFLT]`, their time estimated from the sample that stood for them.
pub const C_FAULT_UNTIMED: usize = counter_slot(Counter::MinfltUntimed);
/// All switches away from the CPU.
pub const C_CTX_SWITCHES: usize = counter_slot(Counter::CtxSwitches);
/// … of which the thread was still runnable (involuntary).
pub const C_CTX_INVOLUNTARY: usize = 8;
pub const C_SYSCALLS: usize = 9;
pub const C_RECLAIMS: usize = 10;
/// Read bios queued by this thread (count).
pub const C_READ_IOS: usize = 11;
/// Sum of queue→complete latency of this thread's read bios on non-zram devices.
pub const C_DISK_READ_NS: usize = 12;
/// Same for zram devices.
pub const C_ZRAM_READ_NS: usize = 13;
/// Fault entries while a fault was open (the earlier one failed).
pub const C_FAULT_UNMATCHED_ENTRY: usize = 14;
/// Fault exits without an entry.
pub const C_FAULT_UNMATCHED_EXIT: usize = 15;

/// `ThreadState::flags` bits.
pub const F_ON_CPU: u32 = 1 << 0;
pub const F_IN_SYSCALL: u32 = 1 << 1;
pub const F_IO_SYSCALL: u32 = 1 << 2;
pub const F_IN_RECLAIM: u32 = 1 << 3;
/// Off CPU but runnable (preempted, or woken and waiting for a CPU).
pub const F_RUNNABLE: u32 = 1 << 4;
pub const F_EXITED: u32 = 1 << 5;
/// The open fault queued a read on a zram device.
pub const F_FAULT_ZRAM: u32 = 1 << 6;
/// The open fault queued a read on a (non-zram) swap device.
pub const F_FAULT_SWAP: u32 = 1 << 7;
/// The open fault went through `filemap_fault`.
pub const F_FAULT_FILE: u32 = 1 << 8;
/// The open fault queued a read on a disk (not zram).
pub const F_FAULT_DISK: u32 = 1 << 10;
/// Seeded by user space at attach time (state before that is unknown).
pub const F_SEEDED: u32 = 1 << 9;
/// The thread's context is not known (seeded at attach, no event seen since):
/// its time is `unattributed` until its first event.
pub const F_UNKNOWN: u32 = 1 << 11;
/// The open fault brought back an evicted page (`observer_common::evict`: its
/// refault record is open and is closed with the fault).
pub const F_FAULT_REFAULT: u32 = 1 << 12;
/// The open syscall or fault read from a device (woken from blocked I/O, or queued a read
/// bio): its exit moves `io_done`.
pub const F_DEVICE_IO: u32 = 1 << 13;
/// The open fault counted `PGMAJFAULT` (the memcg close, `observer_common::faults`): it read its
/// page from a file or swap, and closes as a major fault.
pub const F_FAULT_MAJOR: u32 = 1 << 14;
/// The thread's last fault was closed as minor by the memcg close, and no fault has opened since:
/// a `major-faults` event now says the kernel counted it major ([`ThreadState::retried_major`]).
pub const F_CLOSED_MINOR: u32 = 1 << 15;
/// The open fault is *untimed* (storm sampling, `observer_common::faults`): entered without a
/// clock read, `fault_start` 0, its time left in the context it interrupted (compute) until it
/// closes, or until something slow happens in it ([`ThreadState::slow`]) and it is timed from then.
pub const F_FAULT_UNTIMED: u32 = 1 << 16;
/// The thread is in a fault storm: the last window of faults came fast and all were plain minor
/// faults, so 1 in [`STORM_SAMPLE`] of its user-mode faults is timed.
pub const F_STORM: u32 = 1 << 17;
/// A fault of the current window did something slow (module spec of `faults`): the window ends
/// out of storm.
pub const F_WINDOW_SLOW: u32 = 1 << 18;
/// The open fault did something slow: no sample of a storm's plain minor faults.
pub const F_FAULT_SLOW: u32 = 1 << 19;
/// The flags that describe the open fault, cleared when a fault enters or exits.
pub const F_FAULT_ANY: u32 = F_FAULT_ZRAM
    | F_FAULT_SWAP
    | F_FAULT_FILE
    | F_FAULT_DISK
    | F_FAULT_REFAULT
    | F_FAULT_MAJOR
    | F_FAULT_UNTIMED
    | F_FAULT_SLOW;

/// Storm sampling (`observer_common::faults`): faults per window, at whose end the thread's
/// storm state is decided again.
pub const STORM_WINDOW: u32 = 64;
/// In a storm, 1 user-mode fault in this many is timed, on average.
pub const STORM_SAMPLE: u32 = 8;
/// A window is a storm when its faults came faster than this on average (ns per fault, the
/// time between faults included) and none was slow. Timing a fault costs its thread about
/// 0.15–0.2 µs more than leaving it untimed, over 1 % of the thread's time below this rate; a
/// plain minor fault takes 1.3–2.5 µs from one to the next on this project's VMs and 5 µs on a
/// busier host (the CI's, two threads of one process faulting), so a lower bound (4 µs, the first
/// one) missed whole storms there.
pub const STORM_NS_PER_FAULT: u64 = 16_000;

/// One thread's attribution state and cumulative accumulators (nanoseconds).
/// Lives in the `THREADS` array map, one slot per thread of the target.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ThreadState {
    /// Odd while an update is in progress, moved to a later even value after it, so a reader
    /// on another CPU can tell a torn copy. Where the host keeps stores in program order (x86's
    /// TSO: [`STORES_IN_ORDER`]) with plain stores ([`seq_begin`], [`seq_end`]: safe with two
    /// writers), elsewhere with a fetch-and-add at each end (a full barrier on every BPF JIT).
    pub seq: u64,
    pub tid: u32,
    pub flags: u32,
    /// Time of the last transition: everything before it is accounted.
    pub last_ts: u64,
    /// When the thread was first seen (accounting starts there).
    pub first_ts: u64,
    /// Entry time of the open fault, 0 when none.
    pub fault_start: u64,
    pub comm: [u8; 16],
    /// The thread's process (thread group) ID.
    pub tgid: u32,
    /// Storm sampling (`observer_common::faults`): untimed faults still to come before the next
    /// timed one.
    pub storm_skip: u32,
    /// When the thread last blocked (switched out not runnable); 0 before it first did.
    pub wait_start: u64,
    /// When the thread's last device I/O (an explicit I/O syscall or a fault that read from a
    /// device) ended: the syscall's or fault's exit; between a wakeup from that read and the exit
    /// (`F_DEVICE_IO`), the wakeup (module spec). 0: never.
    pub io_done: u64,
    pub time: [u64; N_TIME],
    pub cnt: [u64; N_CNT],
}
const _: () = assert!(core::mem::size_of::<ThreadState>() == 8 * 7 + 16 + 8 + 8 * (N_TIME + N_CNT));

/// A thread's storm-sampling bookkeeping (`observer_common::faults`), beside its [`ThreadState`]
/// at the same slot (the `STORMS` array) and not in it: marks copy every thread's state, and what
/// they copy is kept as small as it was (the verifier of older kernels walks that copy once per
/// slot).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Storm {
    /// When the current window of faults began (0: the thread's first window).
    pub window_ts: u64,
    /// `time[T_COMPUTE]` when the last timed fault closed with no untimed fault waiting (the most
    /// a sample's estimate may move from compute: the untimed faults' real time is in there).
    pub compute_mark: u64,
    /// The faults entered in the current window.
    pub window_n: u32,
    /// The untimed faults since the last sample that stood for them.
    pub untimed: u32,
    /// The state of the thread's generator of gaps between samples ([`Storm::draw`]); 0 before
    /// its first draw.
    pub rng: u64,
}

impl Storm {
    pub const fn zeroed() -> Self {
        Storm { window_ts: 0, compute_mark: 0, window_n: 0, untimed: 0, rng: 0 }
    }

    /// The next number (any u32) of the thread's own generator, xorshift64* (Vigna 2016), seeded
    /// at the first draw from `seed` (the clock). In the thread's storm bookkeeping, so the draw
    /// calls no helper: `bpf_get_prandom_u32` cost a timed fault about 45 ns on the development
    /// VM (issue 19).
    #[inline(always)]
    pub fn draw(&mut self, seed: u64) -> u32 {
        // (The seed is spread over all bits, so that seeds a few ns apart start apart; never 0.)
        let mut x = if self.rng == 0 {
            (seed ^ 0x9E37_79B9_7F4A_7C15).wrapping_mul(0xBF58_476D_1CE4_E5B9) | 1
        } else {
            self.rng
        };
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng = x;
        (x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 32) as u32
    }
}

impl ThreadState {
    pub const fn zeroed() -> Self {
        ThreadState {
            seq: 0,
            tid: 0,
            flags: 0,
            last_ts: 0,
            first_ts: 0,
            fault_start: 0,
            comm: [0; 16],
            tgid: 0,
            storm_skip: 0,
            wait_start: 0,
            io_done: 0,
            time: [0; N_TIME],
            cnt: [0; N_CNT],
        }
    }

    /// The component the thread's current context charges.
    #[inline(always)]
    pub fn current_component(&self) -> usize {
        let f = self.flags;
        if f & F_UNKNOWN != 0 {
            T_UNATTRIBUTED
        } else if f & F_ON_CPU != 0 {
            if f & F_IN_RECLAIM != 0 {
                T_RECLAIM
            } else if self.fault_start != 0 {
                if f & F_FAULT_ZRAM != 0 {
                    T_SWAPIN_ZRAM
                } else if f & F_FAULT_DISK != 0 {
                    T_FAULT_IO
                } else {
                    T_FAULT_MINOR
                }
            } else if f & F_IN_SYSCALL != 0 {
                if f & F_IO_SYSCALL != 0 { T_IO_WAIT } else { T_SYSCALL }
            } else {
                T_COMPUTE
            }
        } else if f & F_RUNNABLE != 0 {
            T_RUNQUEUE
        } else if f & F_IN_RECLAIM != 0 {
            T_RECLAIM
        } else if self.fault_start != 0 {
            T_FAULT_IO
        } else if f & F_IN_SYSCALL != 0 && f & F_IO_SYSCALL != 0 {
            T_IO_WAIT
        } else {
            T_SLEEP
        }
    }

    /// Charge `last_ts → now` to the current context and move `last_ts`.
    #[inline(always)]
    pub fn account(&mut self, now: u64) {
        self.charge(now, self.current_component());
    }

    /// [`Self::account`]; with `peer_io`, a `sleep` is `io_wait_peer` from `closed` on (module
    /// spec, "Closed time stays closed").
    #[inline(always)]
    fn account_waiting(&mut self, now: u64, peer_io: bool, closed: u64) {
        if peer_io && self.current_component() == T_SLEEP {
            self.account(closed.min(now));
            self.charge(now, T_IO_WAIT_PEER);
        } else {
            self.charge(now, self.current_component());
        }
    }

    /// Charge `last_ts → now` to component `c` and move `last_ts`.
    #[inline(always)]
    fn charge(&mut self, now: u64, c: usize) {
        if self.flags & F_EXITED != 0 || now <= self.last_ts {
            return;
        }
        let dt = now - self.last_ts;
        self.last_ts = now;
        if let Some(t) = self.time.get_mut(c) {
            *t += dt;
        }
    }

    /// Whether this thread, as the waker of `wakee` (the current task at its
    /// `sched_waking`), wakes it with the end of an I/O (module spec): inside a
    /// syscall, and woken from blocked I/O since the wakee blocked.
    #[inline(always)]
    pub fn wakes_with_io(&self, wakee: &ThreadState) -> bool {
        self.flags & F_IN_SYSCALL != 0 && self.io_done != 0 && self.io_done >= wakee.wait_start
    }

    /// An event of the thread at `now`: charge the time before it, and from
    /// now on its context is known (the event sets it).
    #[inline(always)]
    fn event(&mut self, now: u64) {
        self.account(now);
        self.flags &= !F_UNKNOWN;
    }

    /// Total accounted time.
    pub fn accounted(&self) -> u64 {
        let mut s = 0;
        let mut i = 0;
        while i < N_TIME {
            s += self.time[i];
            i += 1;
        }
        s
    }

    /// Whether a fault is open, timed or not.
    #[inline(always)]
    pub fn fault_open(&self) -> bool {
        self.fault_start != 0 || self.flags & F_FAULT_UNTIMED != 0
    }

    /// A fault enters from user mode, before any clock read: in a storm, all but 1 in
    /// [`STORM_SAMPLE`] faults enter untimed (`observer_common::faults`). Returns whether this one
    /// did; otherwise the caller reads the clock and calls [`Self::fault_enter`].
    #[inline(always)]
    pub fn fault_enter_untimed(&mut self, st: &mut Storm) -> bool {
        if self.flags & F_STORM == 0 || self.storm_skip == 0 || self.fault_open() {
            return false;
        }
        self.storm_skip -= 1;
        st.window_n += 1;
        self.flags = (self.flags & !(F_FAULT_ANY | F_DEVICE_IO | F_CLOSED_MINOR)) | F_FAULT_UNTIMED;
        true
    }

    /// A timed fault enters at `now`. Ends the storm window when it is full: the next one is a
    /// storm when `sampling` (the memcg close is in use) and this one's faults came fast and none
    /// was slow. In a storm, `random` (any u32) draws how many untimed faults come before the
    /// next timed one: 0 to `2 × STORM_SAMPLE − 2`, 1 in `STORM_SAMPLE` timed on average, at no
    /// fixed stride (a fixed one would keep timing the same kind of fault: with 8 page-table
    /// entries per cache line, every 8th page of a sequential storm is the one that misses).
    #[inline(always)]
    pub fn fault_enter(&mut self, now: u64, st: &mut Storm, sampling: bool, random: u32) {
        self.event(now);
        if self.fault_open() {
            self.cnt[C_FAULT_UNMATCHED_ENTRY] += 1;
        }
        self.fault_start = now;
        self.flags &= !(F_FAULT_ANY | F_DEVICE_IO | F_CLOSED_MINOR);
        if st.window_n >= STORM_WINDOW {
            // (The thread's first window has no start: no storm.)
            let fast = st.window_ts != 0 && now.saturating_sub(st.window_ts) < STORM_WINDOW as u64 * STORM_NS_PER_FAULT;
            if sampling && fast && self.flags & F_WINDOW_SLOW == 0 {
                self.flags |= F_STORM;
            } else {
                self.flags &= !F_STORM;
            }
            self.flags &= !F_WINDOW_SLOW;
            st.window_ts = now;
            st.window_n = 0;
        }
        st.window_n += 1;
        self.storm_skip = if self.flags & F_STORM != 0 { random % (2 * STORM_SAMPLE - 1) } else { 0 };
    }

    /// Something slow happens in the thread's open fault at `now` (it blocks or is preempted,
    /// reclaims, reads, counts `PGMAJFAULT`, goes through `filemap_fault`, brings back an evicted
    /// page): an untimed fault is timed from now on (its time before stays in compute), the fault
    /// stands for no storm's plain minor faults, and the storm ends at once (its window ends out
    /// of storm).
    #[inline(always)]
    pub fn slow(&mut self, now: u64) {
        if self.flags & F_FAULT_UNTIMED != 0 {
            self.account(now);
            self.fault_start = now.max(1);
            self.flags &= !F_FAULT_UNTIMED;
        }
        if self.fault_start != 0 {
            self.flags = (self.flags | F_FAULT_SLOW | F_WINDOW_SLOW) & !F_STORM;
        }
    }

    /// The memcg close of an untimed fault, with no clock read: nothing slow happened in it, so it
    /// is a minor fault; counted, and left for the next sample to stand for. False (nothing done)
    /// when the open fault is not untimed.
    #[inline(always)]
    pub fn fault_close_untimed(&mut self, st: &mut Storm) -> bool {
        if self.flags & F_FAULT_UNTIMED == 0 {
            return false;
        }
        self.flags = (self.flags & !F_FAULT_ANY) | F_CLOSED_MINOR;
        self.cnt[C_MINFLT] += 1;
        self.cnt[C_FAULT_UNTIMED] += 1;
        st.untimed += 1;
        true
    }

    /// The memcg close (`observer_common::faults`): the kernel accounted the current thread's
    /// timed fault at `now`. With a fault open, it exits as [`Self::fault_exit`] does, major when
    /// it counted `PGMAJFAULT`, and returns (latency, class, weight): the number of faults its
    /// latency stands for in the histograms ([`Self::sample`]). `None` without one (a
    /// `get_user_pages` fault, or one in progress at attach: not counted).
    #[inline(always)]
    pub fn fault_close(&mut self, now: u64, st: &mut Storm) -> Option<(u64, usize, u64)> {
        if self.fault_start == 0 {
            return None;
        }
        let major = self.flags & F_FAULT_MAJOR != 0;
        let plain = self.flags & F_FAULT_ANY == 0;
        let (lat, class) = self.fault_exit(now, major);
        if !major {
            self.flags |= F_CLOSED_MINOR;
        }
        Some((lat, class, self.sample(st, lat, plain && class == 0)))
    }

    /// A timed fault closed with latency `lat`; `plain`: a minor fault in which nothing slow
    /// happened. A plain fault stands for itself and the untimed faults since the last sample
    /// (its weight, returned); their estimated time, `untimed × lat` but at most the compute time
    /// since the last timed fault closed with none waiting (which holds their real time), moves
    /// from compute to `fault_minor`. Any other fault stands for itself.
    #[inline(always)]
    fn sample(&mut self, st: &mut Storm, lat: u64, plain: bool) -> u64 {
        let mut weight = 1;
        if plain && st.untimed != 0 && lat != 0 {
            let since = self.time[T_COMPUTE].saturating_sub(st.compute_mark);
            let est = (st.untimed as u64 * lat).min(since);
            self.time[T_COMPUTE] -= est;
            self.time[T_FAULT_MINOR] += est;
            weight += st.untimed as u64;
            st.untimed = 0;
        }
        if st.untimed == 0 {
            st.compute_mark = self.time[T_COMPUTE];
        }
        weight
    }

    /// A `major-faults` event under the memcg close: when the fault just closed as minor, the
    /// kernel counted it major (a fault it retried twice, `FAULT_FLAG_TRIED`, without reading
    /// in it): its count moves from minor to major file. Returns whether it moved.
    #[inline(always)]
    pub fn retried_major(&mut self) -> bool {
        if self.flags & F_CLOSED_MINOR == 0 {
            return false;
        }
        self.flags &= !F_CLOSED_MINOR;
        self.cnt[C_MINFLT] = self.cnt[C_MINFLT].saturating_sub(1);
        self.cnt[C_MAJFLT_FILE] += 1;
        true
    }

    /// Returns the fault's latency (0 when its entry was not seen) and its
    /// class: 0 minor, 1 major file, 2 major swap.
    #[inline(always)]
    pub fn fault_exit(&mut self, now: u64, major: bool) -> (u64, usize) {
        self.event(now);
        let class = if !major {
            self.cnt[C_MINFLT] += 1;
            0
        } else if self.flags & (F_FAULT_ZRAM | F_FAULT_SWAP) != 0 {
            self.cnt[C_MAJFLT_SWAP] += 1;
            2
        } else {
            self.cnt[C_MAJFLT_FILE] += 1;
            1
        };
        let lat = if self.fault_start == 0 || now < self.fault_start {
            self.cnt[C_FAULT_UNMATCHED_EXIT] += 1;
            0
        } else {
            now - self.fault_start
        };
        self.fault_start = 0;
        self.flags &= !F_FAULT_ANY;
        self.io_ended(now);
        (lat, class)
    }

    /// A read bio queued by this thread while in a fault: from now on the
    /// fault's on-CPU time is zram decompression (zram) or I/O (a disk).
    /// `swap`: the device is a swap device (classifies a major fault as swap).
    /// Outside a fault, a read queued in an explicit I/O syscall is device I/O (module spec).
    #[inline(always)]
    pub fn fault_read(&mut self, now: u64, zram: bool, swap: bool) {
        self.slow(now);
        if self.fault_start == 0 {
            if self.flags & (F_IN_SYSCALL | F_IO_SYSCALL) == F_IN_SYSCALL | F_IO_SYSCALL {
                self.flags |= F_DEVICE_IO;
            }
            return;
        }
        self.event(now);
        if zram {
            self.flags |= F_FAULT_ZRAM;
        } else {
            self.flags |= F_FAULT_DISK;
            if swap {
                self.flags |= F_FAULT_SWAP;
            }
        }
    }

    /// `filemap_fault` at `now`: the open fault is a file fault.
    #[inline(always)]
    pub fn file_fault(&mut self, now: u64) {
        self.slow(now);
        if self.fault_start != 0 {
            self.flags |= F_FAULT_FILE;
        }
    }

    /// `PGMAJFAULT` at `now` (the memcg close): the open fault reads its page from a file or swap.
    #[inline(always)]
    pub fn fault_major(&mut self, now: u64) {
        self.slow(now);
        if self.fault_start != 0 {
            self.flags |= F_FAULT_MAJOR;
        }
    }

    #[inline(always)]
    pub fn switch_out(&mut self, now: u64, runnable: bool) {
        self.slow(now);
        self.event(now);
        self.flags &= !F_ON_CPU;
        self.cnt[C_CTX_SWITCHES] += 1;
        if runnable {
            self.flags |= F_RUNNABLE;
            self.cnt[C_CTX_INVOLUNTARY] += 1;
        } else {
            self.flags &= !F_RUNNABLE;
            self.wait_start = now;
        }
    }

    #[inline(always)]
    pub fn switch_in(&mut self, now: u64) {
        self.event(now);
        self.flags = (self.flags | F_ON_CPU) & !F_RUNNABLE;
    }

    /// `sched:sched_stat_runtime`: the scheduler charged the thread `runtime` ns of CPU time
    /// up to `now`, the time since its switch-in or its previous charge, so it is running and has
    /// been since `now - runtime` at the latest. If our events have it off the CPU, its switch-in
    /// came without a `sched_switch` (module spec): it went on the CPU at `now - runtime`, or at
    /// `closed` if that is later (the latest snapshot's instant: "Closed time stays closed").
    #[inline(always)]
    pub fn ran(&mut self, now: u64, runtime: u64, closed: u64) {
        if self.flags & (F_ON_CPU | F_EXITED) != 0 {
            return;
        }
        self.account(now.saturating_sub(runtime).max(closed).min(now));
        self.flags = (self.flags | F_ON_CPU) & !(F_RUNNABLE | F_UNKNOWN);
        self.cnt[C_MISSED_SWITCH_IN] += 1;
    }

    /// A wakeup of a blocked thread: from now on it waits for a CPU. Inside a
    /// fault, the disk read it waited for is done: the rest of the fault's
    /// CPU work is `fault_minor` again (until it issues another read).
    /// `peer_io`: the waker woke it with the end of an I/O
    /// ([`Self::wakes_with_io`]), so a wait that would be `sleep` is `io_wait_peer`, from
    /// `closed` on (the latest snapshot's instant: "Closed time stays closed").
    #[inline(always)]
    pub fn wakeup(&mut self, now: u64, peer_io: bool, closed: u64) {
        // (An unknown context is no reason to ignore it: the thread was blocked.)
        if self.flags & F_UNKNOWN == 0 && self.flags & (F_ON_CPU | F_RUNNABLE) != 0 {
            return;
        }
        let f = self.flags;
        if f & F_UNKNOWN == 0
            && ((f & F_IN_SYSCALL != 0 && f & F_IO_SYSCALL != 0) || (self.fault_start != 0 && f & F_FAULT_DISK != 0))
        {
            self.io_done = now;
            self.flags |= F_DEVICE_IO;
        }
        self.account_waiting(now, peer_io, closed);
        self.flags &= !F_UNKNOWN;
        self.flags = (self.flags | F_RUNNABLE) & !(F_ON_CPU | F_FAULT_DISK);
    }

    #[inline(always)]
    pub fn syscall_enter(&mut self, now: u64, io: bool) {
        self.event(now);
        self.cnt[C_SYSCALLS] += 1;
        self.flags = (self.flags | F_IN_SYSCALL | F_ON_CPU) & !F_DEVICE_IO;
        if io {
            self.flags |= F_IO_SYSCALL;
        } else {
            self.flags &= !F_IO_SYSCALL;
        }
    }

    #[inline(always)]
    pub fn syscall_exit(&mut self, now: u64) {
        self.event(now);
        self.io_ended(now);
        self.flags = (self.flags | F_ON_CPU) & !(F_IN_SYSCALL | F_IO_SYSCALL);
    }

    /// The exit of a syscall or fault: if it read from a device (`F_DEVICE_IO`), that I/O ends now.
    #[inline(always)]
    fn io_ended(&mut self, now: u64) {
        if self.flags & F_DEVICE_IO != 0 {
            self.io_done = now;
            self.flags &= !F_DEVICE_IO;
        }
    }

    #[inline(always)]
    pub fn reclaim(&mut self, now: u64, begin: bool) {
        self.slow(now);
        self.event(now);
        if begin {
            self.flags |= F_IN_RECLAIM;
            self.cnt[C_RECLAIMS] += 1;
        } else {
            self.flags &= !F_IN_RECLAIM;
        }
    }

    #[inline(always)]
    pub fn exit(&mut self, now: u64) {
        self.account(now);
        self.flags |= F_EXITED;
    }
}

/// Global latency histograms (per-CPU array index): the `slot`s of the
/// vocabulary's histogram kinds (`vocab::HISTOGRAMS`).
pub const H_MINFLT: u32 = LatencyKind::Minflt.slot() as u32;
pub const H_MAJFLT_FILE: u32 = LatencyKind::MajfltFile.slot() as u32;
pub const H_MAJFLT_SWAP: u32 = LatencyKind::MajfltSwap.slot() as u32;
pub const H_ZRAM_READ: u32 = LatencyKind::ZramRead.slot() as u32;
pub const H_DISK_READ: u32 = LatencyKind::DiskRead.slot() as u32;
pub const N_HIST: u32 = LatencyKind::N as u32;

// Every slot the vocabulary names fits the kernel's arrays, and the
// observer-internal counters do not collide with a vocabulary counter.
const _: () = {
    let mut i = 0;
    while i < Component::N {
        if let Some(s) = Component::ALL[i].slot() {
            assert!(s < N_TIME);
        }
        i += 1;
    }
    let mut measured = 0;
    let mut i = 0;
    while i < Component::N {
        measured += Component::ALL[i].slot().is_some() as usize;
        i += 1;
    }
    assert!(measured == N_TIME, "every kernel time slot is a vocabulary component");
    let internal = [
        C_CTX_INVOLUNTARY,
        C_SYSCALLS,
        C_RECLAIMS,
        C_READ_IOS,
        C_DISK_READ_NS,
        C_ZRAM_READ_NS,
        C_FAULT_UNMATCHED_ENTRY,
        C_FAULT_UNMATCHED_EXIT,
    ];
    let mut i = 0;
    while i < Counter::N {
        if let Some(s) = Counter::ALL[i].slot() {
            assert!(s < N_CNT);
            let mut j = 0;
            while j < internal.len() {
                assert!(internal[j] != s, "an internal counter shares a vocabulary counter's slot");
                j += 1;
            }
        }
        i += 1;
    }
};

/// One log2 histogram (see `hist`) and the exact sum of its values (one add
/// per event), so that Prometheus' `_sum` and `_count` are measured; except in a fault storm,
/// where a minor-fault sample stands for the untimed faults before it
/// ([`Hist::add_weighted`], `observer_common::faults`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Hist {
    pub b: [u64; HIST_BUCKETS],
    /// Σ values, nanoseconds.
    pub sum: u64,
}
const _: () = assert!(core::mem::size_of::<Hist>() == 8 * (HIST_BUCKETS + 1));

impl Hist {
    pub const fn zeroed() -> Self {
        Hist { b: [0; HIST_BUCKETS], sum: 0 }
    }
    /// Count `v` (nanoseconds).
    #[inline(always)]
    pub fn add(&mut self, v: u64) {
        self.add_in(crate::hist::bucket_of(v), v);
    }
    /// Count `v` in bucket `b`, which is `bucket_of(v)` (computed once for several histograms).
    #[inline(always)]
    pub fn add_in(&mut self, b: usize, v: u64) {
        self.add_weighted(b, v, 1);
    }

    /// Count `w` values of `v` in bucket `b` (`bucket_of(v)`): a storm's sample standing for the
    /// untimed faults before it (`observer_common::faults`).
    #[inline(always)]
    pub fn add_weighted(&mut self, b: usize, v: u64, w: u64) {
        if let Some(c) = self.b.get_mut(b) {
            *c += w;
        }
        self.sum = self.sum.wrapping_add(v.wrapping_mul(w));
    }

    /// Add every count of `other` (user space: per-CPU and per-thread histograms summed).
    pub fn merge(&mut self, other: &Hist) {
        for (d, s) in self.b.iter_mut().zip(other.b.iter()) {
            *d += s;
        }
        self.sum = self.sum.wrapping_add(other.sum);
    }
}

/// Field offsets of the tracepoints we read, parsed by user space from
/// `/sys/kernel/tracing/events/*/*/format` (Rust eBPF has no CO-RE).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct TpOffsets {
    pub switch_prev_pid: u32,
    pub switch_prev_state: u32,
    pub switch_next_pid: u32,
    pub wakeup_pid: u32,
    pub exit_pid: u32,
    pub bio_dev: u32,
    pub bio_sector: u32,
    pub bio_nr_sector: u32,
    pub bio_rwbs: u32,
    pub biod_dev: u32,
    pub biod_sector: u32,
    pub biod_nr_sector: u32,
    /// Size in bytes of `prev_state` (4 or 8 depending on the kernel).
    pub switch_prev_state_size: u32,
    pub rqd_dev: u32,
    pub rqd_sector: u32,
    /// `task:task_newtask`: the new task's `pid` and its `clone_flags` (u64).
    pub newtask_pid: u32,
    pub newtask_clone_flags: u32,
    /// Not a tracepoint's: `struct block_device`'s `bd_dev` from the kernel's BTF, read by the
    /// `zram_rw_page` kprobe (its first argument) for the per-device row; `NO_FIELD` when unknown.
    pub bdev_dev: u32,
    /// `sched:sched_process_free`: the freed task's `pid` (its TID).
    pub free_pid: u32,
    /// `sched:sched_stat_runtime` (optional, used only when attached): the charged task's `pid`
    /// and its `runtime` (u64, ns).
    pub runtime_pid: u32,
    pub runtime_ns: u32,
    /// `task:task_rename`: the renamed task's `pid` and its `newcomm` (16 bytes).
    pub rename_pid: u32,
    pub rename_newcomm: u32,
    pub _pad: u32,
}
const _: () = assert!(core::mem::size_of::<TpOffsets>() == 24 * 4);

/// Whether a task that `sched_switch` takes off the CPU stays runnable (a preemption: an
/// involuntary switch) rather than blocking, from the raw tracepoint's `preempt` and
/// `prev_state` arguments (Linux >= 5.18; the state `__schedule` read before deciding): the
/// kernel's own rule for counting the switch in `nivcsw` rather than `nvcsw`, preempted or
/// still `TASK_RUNNING` (0). A sleep cut short by a signal is voluntary there (the state was
/// not 0) and blocked here, as `sched_switch`'s reported `prev_state` also has it.
#[inline(always)]
pub fn switch_runnable(preempt: u64, prev_state: u64) -> bool {
    preempt & 0xff != 0 || prev_state as u32 == 0
}

/// `DEVICES` map values: what a block device is to us.
pub const DEV_ZRAM: u32 = 1;
pub const DEV_SWAP: u32 = 2;

/// A read bio in flight, keyed by (dev, sector).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct BioKey {
    pub dev: u32,
    pub _pad: u32,
    pub sector: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct BioInflight {
    pub ts: u64,
    /// The queueing thread's slot, and its TID: the slot is charged the read's latency only
    /// while it is still that thread's (slots are given back: [`MAX_SLOTS`]).
    pub slot: u32,
    pub zram: u32,
    pub dev: u32,
    pub tid: u32,
}

/// Per-device totals of the target's reads (`DEV_IO` map, key: kernel dev_t).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct DevIo {
    pub read_bytes: u64,
    pub read_ios: u64,
    /// Σ queue→complete latency of the reads that completed under their key.
    pub read_ns: u64,
    pub completed: u64,
}

/// Ring-buffer records emitted at token boundaries.
pub const REC_THREAD: u32 = 1;
pub const REC_MARK: u32 = 2;
/// The target called `exec` (payload: `ExecRecord`).
pub const REC_EXEC: u32 = 3;
/// An explicit read charged to a routed expert (payload: `xread::ReadRecord`).
pub const REC_READ: u32 = 4;
/// The kernel asks for an fd's verdict (payload: `xread::FdQuery`).
pub const REC_FD: u32 = 5;
/// A thread's task was freed and its slot given back (payload: [`RetiredRecord`]; [`MAX_SLOTS`]).
pub const REC_RETIRED: u32 = 6;

/// The final state of a thread whose slot is given back ([`MAX_SLOTS`]): its attribution state
/// and its fault latencies, as they were when its task was freed.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RetiredRecord {
    pub kind: u32,
    pub _pad: u32,
    pub state: ThreadState,
    pub faults: crate::faults::FaultTimes,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ExecRecord {
    pub kind: u32,
    pub tid: u32,
    pub ts: u64,
}
pub const PHASE_BEGIN: u32 = 0;
pub const PHASE_END: u32 = 1;
/// Bytes of the engine's per-token record copied at an `end` mark: exactly the record of the
/// ABI (`moe_abi::markers`); a copy past its end could fault on the engine's next page.
pub const ENGINE_REC_BYTES: usize = core::mem::size_of::<moe_abi::markers::TokenRecord>();
const _: () = assert!(ENGINE_REC_BYTES == moe_abi::markers::RECORD_SIZE);

/// One thread's state at a mark, closed (`account`ed) at the mark's instant.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ThreadRecord {
    pub kind: u32,
    pub phase: u32,
    pub mark_seq: u64,
    pub state: ThreadState,
}

/// Sent after the thread records of a mark.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct MarkRecord {
    pub kind: u32,
    pub phase: u32,
    pub mark_seq: u64,
    pub ts: u64,
    /// The index argument of the marker (engine token index), or a call count.
    pub index: u64,
    /// Thread records sent for this mark.
    pub n_threads: u32,
    /// Thread records that could not be sent or were torn.
    pub n_lost: u32,
    /// `1` when `engine` holds a copy of the engine's per-token record.
    pub has_engine: u32,
    pub tid: u32,
    /// The step's token count read from the probed call's arguments
    /// ([`call_arg`]); meaningful only when `n_tokens_known` is 1.
    pub n_tokens: u32,
    pub n_tokens_known: u32,
    /// The model file's cumulative page-cache adds / evictions (pages) at the
    /// mark, from the churn counters (`filemap`); 0 while churn is not attached.
    pub churn_added: u64,
    pub churn_evicted: u64,
    /// The cumulative evictions per actor kind (`evict::EVICT_KIND_PAGES`), read before
    /// `churn_evicted`; 0 while eviction blame is not attached.
    pub churn_evicted_by: [u64; crate::evict::N_KINDS as usize],
    /// The cumulative refaults per kind of their eviction: pages, refault faults, and those
    /// faults' `fault_io` ns (`evict::EVICT_REFAULTS`, `EVICT_REFAULT_FAULTS`, `EVICT_REFAULT_IO`).
    pub churn_refaulted_by: [u64; crate::evict::N_KINDS as usize],
    pub churn_refault_faults: [u64; crate::evict::N_KINDS as usize],
    pub churn_refault_io_ns: [u64; crate::evict::N_KINDS as usize],
    /// The cumulative explicit reads of the model file (`xread::XREAD_TOTALS`, indices
    /// `xread::T_*`); 0 while they are not attached.
    pub xread: [u64; crate::xread::N_TOTALS],
    pub engine: [u8; ENGINE_REC_BYTES],
}

/// How a call probe reads its step's token count from the probed function's
/// arguments, passed to the program as the uprobe's attach cookie.
///
/// Spec: cookie 0 reads nothing (the count is unknown). Otherwise bits 0–7
/// hold a rule and the rest its operands:
/// - [`call_arg::STACK_I32`] (operand: the high 32 bits): a signed 32-bit
///   count at `sp + operand` at the function's entry (x86-64: a struct over 16
///   bytes passed by value lies on the stack after the return address, so its
///   first field is at `sp + 8`). A negative count is unknown, never clamped.
/// - [`call_arg::PTR_I32`] ([`call_arg::PtrI32`]): a signed 32-bit count at
///   byte `offset` of the struct that integer argument `arg` points to
///   (aarch64: a struct over 16 bytes passed by value is copied by the caller
///   and its address passed in the argument's register, AAPCS64 B.4). A
///   negative count is unknown.
/// - [`call_arg::PTR_VEC_LEN`] ([`call_arg::VecLen`]): the length of a C++
///   `std::vector` (three pointers: begin, end, end of storage, as in libstdc++
///   and libc++) at byte `vec_offset` of the struct that integer argument `arg`
///   points to, with elements of `elem_size` bytes. The count is unknown unless
///   begin ≤ end ≤ end of storage, both distances are whole elements, and, when
///   the layout names a capacity field (`bound_offset`: a `u64` in the same
///   struct), the count does not exceed it. These checks turn a layout that is
///   not the one described into an unknown count, not a wrong one.
pub mod call_arg {
    pub const NONE: u32 = 0;
    pub const STACK_I32: u32 = 1;
    pub const PTR_VEC_LEN: u32 = 2;
    pub const PTR_I32: u32 = 3;

    /// The attach cookie of `rule` with `operand` (rules with one operand).
    pub const fn cookie(rule: u32, operand: u32) -> u64 {
        ((operand as u64) << 32) | rule as u64
    }

    /// `(rule, operand)` of a cookie (the operand of one-operand rules).
    pub const fn split(cookie: u64) -> (u32, u32) {
        (cookie as u8 as u32, (cookie >> 32) as u32)
    }

    /// The operands of [`PTR_I32`] (module spec).
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct PtrI32 {
        /// Index of the integer argument holding the struct's address (0 = first).
        pub arg: u8,
        pub offset: u32,
    }

    impl PtrI32 {
        /// Bits 8–15 `arg`, 32–63 `offset`.
        pub const fn cookie(self) -> u64 {
            PTR_I32 as u64 | (self.arg as u64) << 8 | (self.offset as u64) << 32
        }

        pub const fn from_cookie(cookie: u64) -> PtrI32 {
            PtrI32 { arg: (cookie >> 8) as u8, offset: (cookie >> 32) as u32 }
        }
    }

    /// Where the `i32` count of a [`STACK_I32`] or [`PTR_I32`] cookie lies, from the probed
    /// thread's integer argument `int_arg(n)` and stack pointer `sp` at the function's entry;
    /// `None` for the other rules (or an argument not read).
    #[inline(always)]
    pub fn i32_address(cookie: u64, int_arg: impl Fn(u8) -> Option<u64>, sp: u64) -> Option<u64> {
        match split(cookie) {
            (STACK_I32, offset) => Some(sp.wrapping_add(offset as u64)),
            (PTR_I32, _) => {
                let p = PtrI32::from_cookie(cookie);
                Some(int_arg(p.arg)?.wrapping_add(p.offset as u64))
            }
            _ => None,
        }
    }

    /// The operands of [`PTR_VEC_LEN`] (module spec).
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct VecLen {
        /// Index of the integer argument holding the struct's address (0 = first).
        pub arg: u8,
        pub vec_offset: u16,
        pub elem_size: u16,
        /// Offset of a `u64` capacity the count may not exceed.
        pub bound_offset: Option<u16>,
    }

    impl VecLen {
        /// Bits 8–15 `arg`, 16–31 `bound_offset + 1` (0: none), 32–47
        /// `vec_offset`, 48–63 `elem_size`.
        pub const fn cookie(self) -> u64 {
            let bound = match self.bound_offset {
                Some(b) => b as u64 + 1,
                None => 0,
            };
            PTR_VEC_LEN as u64
                | (self.arg as u64) << 8
                | bound << 16
                | (self.vec_offset as u64) << 32
                | (self.elem_size as u64) << 48
        }

        pub const fn from_cookie(cookie: u64) -> VecLen {
            let bound = (cookie >> 16) as u16;
            VecLen {
                arg: (cookie >> 8) as u8,
                vec_offset: (cookie >> 32) as u16,
                elem_size: (cookie >> 48) as u16,
                bound_offset: if bound == 0 { None } else { Some(bound - 1) },
            }
        }

        /// The count from the vector's three pointers and the capacity field
        /// (module spec); `None` when any check fails.
        #[inline(always)]
        pub fn count(self, begin: u64, end: u64, storage_end: u64, bound: Option<u64>) -> Option<u32> {
            let elem = self.elem_size as u64;
            if elem == 0 || begin > end || end > storage_end {
                return None;
            }
            let (len, cap) = (end - begin, storage_end - begin);
            if len % elem != 0 || cap % elem != 0 {
                return None;
            }
            let n = len / elem;
            if n > i32::MAX as u64 || bound.is_some_and(|b| n > b) {
                return None;
            }
            Some(n as u32)
        }
    }
}

/// Threads tracked at once: slots of the `THREADS` array and the arrays beside it.
///
/// ## Slots
/// A thread gets a slot at its first event (or at attach, seeded from `/proc`), taken from the
/// queue of slots given back (`FREE_SLOTS`) when it has one, else the next never used
/// (`SEQS[0]`, the high-water mark that marks and snapshots read up to). A slot is given back
/// when its thread's task is freed (`sched:sched_process_free`, program `thread_free`): the
/// kernel frees a task only after its last context switch and a grace period, so no event of the
/// thread can come after it. There, in this order: the thread's final state and fault latencies
/// are sent to user space ([`RetiredRecord`]; when the ring buffer has no room the slot is kept,
/// as it was, and read at the run's end); its `SLOTS`, `TID_SLOTS` and `CALL_DEPTH` entries are
/// removed; its state (inside its update sequence), storm bookkeeping, fault latencies and read in
/// progress are zeroed; the slot joins the queue. A CPU's `SLOT_CACHE` word that still names the
/// thread is left where it is and believed only while the slot's state names the same TID (one
/// load where it is read), so giving a slot back costs the same on 2 CPUs as on 256. A zeroed
/// slot has TID 0, which user space skips in marks and snapshots. User space keeps each
/// retired thread's final state: a later mark or window that no longer finds it in the slots
/// takes it from there (`observer::capture::tokens`), and so does the run's table.
///
/// A thread has a slot for all of its observed life or never: one that started before the last
/// time a thread found no slot (`SEQS[2]`, [`SEQ_LAST_MISS`]: it may have had events then, and
/// its faults went to the overflow table or the other row) gets none later (its task's
/// `start_time`, at the offset the loader fixes from BTF, [`TASK_START_TIME`]; without BTF any
/// thread may get one late, and its row then holds only what came after). Seeding sets that
/// instant to the attach when the target has more threads than slots.
///
/// Approximate: a TID reused by a new thread before the old one's task is freed (the kernel's PID
/// allocator wrapping around within a grace period) shares the old thread's slot; an overflow
/// row's TID reused later keeps the new thread in that row. Where the kernel refuses
/// `thread_free` (listed among the probes missing) slots are never given back: the threads
/// beyond them get fault rows only (`observer_common::faults`).
pub const MAX_SLOTS: u32 = 256;

/// Index of `SEQS` (an array of u64) that holds when a thread last found no slot (ns,
/// CLOCK_MONOTONIC; 0: never) ([`MAX_SLOTS`], "Slots").
pub const SEQ_LAST_MISS: u32 = 2;

/// Index of `SEQS` that holds when the latest snapshot began (ns, CLOCK_MONOTONIC; 0: none): a
/// mark's start, written by the mark, or a window's instant, written by user space (module
/// spec, "Closed time stays closed").
pub const SEQ_CLOSED: u32 = 3;

/// Entries of `SEQS`.
pub const SEQS_N: u32 = 4;

/// Name of the programs' read-only global (a `u32`, 0 unless the loader sets it) that holds
/// `struct task_struct`'s `start_time` offset from the kernel's BTF ([`MAX_SLOTS`], "Slots").
pub const TASK_START_TIME: &str = "TASK_START_TIME";

/// The update sequence with plain stores ([`STORES_IN_ORDER`]): the value an update writes to
/// [`ThreadState::seq`] before it changes anything, given the value it read: always odd.
///
/// A thread's state has more than one writer: its own events on its CPU, and `sched_waking`
/// on the waker's CPU, which the scheduler runs under the wakee's `pi_lock` only, so at the same
/// time as the wakee's own `sched_switch` (under its run queue's lock). Two plain
/// read-modify-writes can lose one of their stores; with `seq + 1` at both ends a lost store
/// left the sequence odd for good, and every later mark then found the copy torn and lost the
/// thread (a token with no threads: `lost_events`, all components 0). Writing "odd" at the begin
/// and "the next even" at the end keeps every lost store harmless: the last store of any update
/// is even, so once the writers are done the sequence is even again. (A lost begin can let a
/// reader take one copy during the other writer's update: torn fields, as any two writers of the
/// same fields can give, never a thread lost for the rest of the run.)
#[inline(always)]
pub const fn seq_begin(read: u64) -> u64 {
    read | 1
}

/// The update sequence with plain stores: the value an update writes to [`ThreadState::seq`]
/// when it is done, given the value it read then: the even number after it ([`seq_begin`]).
#[inline(always)]
pub const fn seq_end(read: u64) -> u64 {
    seq_begin(read) + 1
}

/// Name of the programs' read-only global (a `u8`, 0 unless the loader sets it) that says the
/// host's CPUs make plain stores visible in program order (x86-64: TSO), so that
/// [`ThreadState::seq`] needs no atomic read-modify-write around an update (the two locked
/// instructions of an update cost about 7 ns per program run under the kernel's statistics, in a
/// fault storm; issue 19). It is fixed before the verifier sees the programs, which drops the
/// branch not taken.
pub const STORES_IN_ORDER: &str = "STORES_IN_ORDER";

/// Name of the programs' read-only global (a `u32`, 0 unless the loader sets it) that holds
/// `struct task_struct`'s `pid` offset from the kernel's BTF, for the scheduler's BTF tracepoint
/// programs (`observer-ebpf/src/sched.rs`). Fixed before the verifier sees them, so it is a
/// constant to the verifier, which then lets them load the member from the tracepoint's task
/// pointer directly (checked against the BTF), where a raw tracepoint pays a
/// `bpf_probe_read_kernel` call.
pub const TASK_PID: &str = "TASK_PID";

/// Whether this build's CPUs keep plain stores in program order (the value the loader gives
/// [`STORES_IN_ORDER`]).
pub const HOST_STORES_IN_ORDER: bool = cfg!(any(target_arch = "x86_64", target_arch = "x86"));

#[cfg(feature = "user")]
mod pod {
    // SAFETY: repr(C), integer fields and arrays only, size asserted in the tests.
    unsafe impl aya::Pod for super::ThreadState {}
    // SAFETY: repr(C), integer fields and arrays only.
    unsafe impl aya::Pod for super::RetiredRecord {}
    // SAFETY: repr(C), integer fields and arrays only, size asserted in the tests.
    unsafe impl aya::Pod for super::Hist {}
    // SAFETY: repr(C), integer fields and arrays only, size asserted in the tests.
    unsafe impl aya::Pod for super::TpOffsets {}
    // SAFETY: repr(C), integer fields and arrays only, size asserted in the tests.
    unsafe impl aya::Pod for super::BioKey {}
    // SAFETY: repr(C), integer fields and arrays only, size asserted in the tests.
    unsafe impl aya::Pod for super::BioInflight {}
    // SAFETY: repr(C), integer fields and arrays only, size asserted in the tests.
    unsafe impl aya::Pod for super::DevIo {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_switch_is_runnable_when_preempted_or_still_running() {
        // (preempt, prev_state): TASK_RUNNING 0, TASK_INTERRUPTIBLE 1, TASK_UNINTERRUPTIBLE 2,
        // TASK_DEAD 0x80, TASK_IDLE 0x402, TASK_FROZEN 0x8000.
        assert!(switch_runnable(0, 0));
        assert!(switch_runnable(1, 1));
        assert!(switch_runnable(1, 2));
        for blocked in [1, 2, 0x80, 0x402, 0x8000] {
            assert!(!switch_runnable(0, blocked), "prev_state {blocked:#x}");
        }
        // `preempt` is a `bool` in a u64 slot, `prev_state` an `unsigned int`: the bytes above are
        // not the argument's.
        assert!(!switch_runnable(0x100, 1));
        assert!(switch_runnable(0, 1 << 32));
    }

    #[test]
    fn a_seeded_thread_is_unattributed_until_its_first_event() {
        // Seeded as `R` (on a CPU or waiting for one): not known which.
        let mut t = thread();
        t.flags |= F_SEEDED | F_UNKNOWN;
        t.account(1500); // a snapshot closes it: still unknown
        assert_eq!(t.time[T_UNATTRIBUTED], 500);
        assert_eq!(t.time[T_COMPUTE], 0, "never compute by default");
        t.switch_in(2000); // it was waiting for the CPU: that is known from now on only
        assert_eq!(t.time[T_UNATTRIBUTED], 1000);
        t.switch_out(2300, false);
        assert_eq!(t.time[T_COMPUTE], 300);
        assert_eq!(t.accounted(), 1300);
        // Seeded blocked, then woken: the wakeup ends the unknown time even if
        // the seed guessed "on CPU".
        let mut t = thread();
        t.flags |= F_SEEDED | F_UNKNOWN;
        t.wakeup(1400, false, 0);
        assert_eq!((t.time[T_UNATTRIBUTED], t.flags & (F_RUNNABLE | F_ON_CPU | F_UNKNOWN)), (400, F_RUNNABLE));
        t.switch_in(1450);
        assert_eq!(t.time[T_RUNQUEUE], 50);
    }

    #[test]
    fn a_switch_in_without_its_event_is_repaired_from_the_runtime_the_scheduler_charges() {
        let mut t = thread();
        t.switch_out(1100, true); // preempted at 1100
        // On a CPU again at 1300 without a `sched_switch`; the tick at 1500 charges it 200 ns.
        t.ran(1500, 200, 0);
        assert_eq!((t.time[T_RUNQUEUE], t.cnt[C_MISSED_SWITCH_IN]), (200, 1));
        t.ran(1600, 100, 0); // on the CPU by our events: nothing to repair
        t.switch_out(1700, false);
        assert_eq!((t.time[T_COMPUTE], t.time[T_RUNQUEUE], t.cnt[C_MISSED_SWITCH_IN]), (100 + 400, 200, 1));
        // Blocked, woken, then running unseen: the wait is charged up to the repaired switch-in.
        t.wakeup(1900, false, 0);
        t.ran(2100, 50, 0);
        assert_eq!((t.time[T_SLEEP], t.time[T_RUNQUEUE]), (200, 200 + 150));
        assert_eq!(t.accounted(), 2050 - 1000);
        // A charge longer than the time since the last event moves nothing back.
        let mut t = thread();
        t.switch_out(1100, true);
        t.ran(1150, 500, 0);
        assert_eq!((t.time[T_RUNQUEUE], t.time[T_COMPUTE], t.flags & F_ON_CPU), (0, 100, F_ON_CPU));
    }

    /// A token as user space takes it: the differences of two copies, each closed at its
    /// snapshot's instant. Panics if a component went down (time taken twice).
    fn token(begin: &ThreadState, end: &ThreadState, b_ts: u64, e_ts: u64) -> [u64; N_TIME] {
        let (mut b, mut e) = (*begin, *end);
        b.account(b_ts);
        e.account(e_ts);
        core::array::from_fn(|i| {
            e.time[i].checked_sub(b.time[i]).unwrap_or_else(|| panic!("component {i} went down: {b:?} → {e:?}"))
        })
    }

    #[test]
    fn a_repaired_switch_in_charges_no_time_a_snapshot_closed() {
        // Preempted at 1100; a mark at 1400 closes its copy as run-queue time; the tick at 1600
        // charges it 400 ns of CPU, a switch-in at 1200 that no `sched_switch` showed. The token
        // from 1400 to 1700 is 300 ns: 1400 → 1600 are not known to be run-queue time any more,
        // but 1100 → 1400 are closed.
        let mut t = thread();
        t.switch_out(1100, true);
        let begin = t;
        t.ran(1600, 400, 1400);
        let d = token(&begin, &t, 1400, 1700);
        assert_eq!((d[T_RUNQUEUE], d[T_COMPUTE]), (0, 300));
        assert_eq!(d.iter().sum::<u64>(), 300, "{d:?}");
        // A switch-in after the snapshot is repaired as before.
        let mut t = thread();
        t.switch_out(1100, true);
        let begin = t;
        t.ran(1600, 100, 1400);
        let d = token(&begin, &t, 1400, 1700);
        assert_eq!((d[T_RUNQUEUE], d[T_COMPUTE]), (100, 200));
    }

    #[test]
    fn a_wait_closed_as_sleep_stays_sleep_when_a_peer_s_io_ends_it() {
        // Blocked at 1000; a mark at 1300 closes the wait as sleep; a peer that did I/O wakes it
        // at 1500: the token from 1300 to 1600 has 200 ns of io_wait_peer and 100 of run queue.
        let mut t = thread();
        t.switch_out(1000, false);
        let begin = t;
        t.wakeup(1500, true, 1300);
        let d = token(&begin, &t, 1300, 1600);
        assert_eq!((d[T_SLEEP], d[T_IO_WAIT_PEER], d[T_RUNQUEUE]), (0, 200, 100));
        // Over the whole life, the closed part is sleep.
        assert_eq!((t.time[T_SLEEP], t.time[T_IO_WAIT_PEER]), (300, 200));
    }

    #[test]
    fn i32_rules_find_the_count_on_the_stack_or_behind_an_argument() {
        let regs = [10u64, 0x1000, 30];
        let arg = |n: u8| regs.get(n as usize).copied();
        let p = call_arg::PtrI32 { arg: 1, offset: 4 };
        assert_eq!(call_arg::PtrI32::from_cookie(p.cookie()), p);
        assert_eq!(call_arg::i32_address(p.cookie(), arg, 0x7000), Some(0x1004));
        let stack = call_arg::cookie(call_arg::STACK_I32, 8);
        assert_eq!(call_arg::i32_address(stack, arg, 0x7000), Some(0x7008));
        let beyond = call_arg::PtrI32 { arg: 5, offset: 0 }.cookie();
        assert_eq!(call_arg::i32_address(beyond, arg, 0x7000), None);
        assert_eq!(call_arg::i32_address(call_arg::cookie(call_arg::NONE, 0), arg, 0x7000), None);
    }

    #[test]
    fn vec_len_cookie_round_trips_and_refuses_a_layout_that_does_not_fit() {
        let v = call_arg::VecLen { arg: 2, vec_offset: 64, elem_size: 96, bound_offset: Some(0) };
        assert_eq!(call_arg::VecLen::from_cookie(v.cookie()), v);
        assert_eq!(call_arg::split(v.cookie()).0, call_arg::PTR_VEC_LEN);
        let none = call_arg::VecLen { bound_offset: None, ..v };
        assert_eq!(call_arg::VecLen::from_cookie(none.cookie()), none);
        assert_eq!(call_arg::split(call_arg::cookie(call_arg::STACK_I32, 8)), (call_arg::STACK_I32, 8));
        let b = 0x1000;
        assert_eq!(v.count(b, b + 3 * 96, b + 8 * 96, Some(8)), Some(3));
        assert_eq!(v.count(b, b, b, Some(8)), Some(0));
        assert_eq!(v.count(b, b + 3 * 96, b + 8 * 96, Some(2)), None, "over the capacity field");
        assert_eq!(v.count(b, b + 100, b + 8 * 96, None), None, "not whole elements");
        assert_eq!(v.count(b, b + 96, b + 8 * 96 + 1, None), None, "storage not whole elements");
        assert_eq!(v.count(b + 96, b, b + 8 * 96, None), None, "end before begin");
        assert_eq!(v.count(b, b + 2 * 96, b + 96, None), None, "end past the storage");
    }

    fn thread() -> ThreadState {
        let mut t = ThreadState::zeroed();
        t.flags = F_ON_CPU;
        t.last_ts = 1000;
        t.first_ts = 1000;
        t
    }

    #[test]
    fn components_add_up_to_elapsed_time() {
        let mut t = thread();
        t.syscall_enter(1100, true); // 100 compute
        t.switch_out(1150, false); // 50 io_wait (on CPU, explicit I/O)
        t.wakeup(1400, false, 0); // 250 io_wait
        t.switch_in(1420); // 20 runqueue
        t.syscall_exit(1430); // 10 io_wait
        t.fault_enter(1500, &mut Storm::zeroed(), false, 0); // 70 compute
        t.switch_out(1510, false); // 10 fault_minor (on cpu, no zram)
        t.wakeup(1600, false, 0); // 90 fault_io
        t.switch_in(1605); // 5 runqueue
        t.fault_exit(1610, true); // 5 fault_minor ; major file
        t.switch_out(1700, true); // 90 compute, preempted
        t.switch_in(1720); // 20 runqueue
        t.account(2000); // 280 compute
        assert_eq!(t.accounted(), 1000);
        assert_eq!(t.time[T_COMPUTE], 100 + 70 + 90 + 280);
        assert_eq!(t.time[T_SYSCALL], 0);
        assert_eq!(t.time[T_IO_WAIT], 310);
        assert_eq!(t.time[T_RUNQUEUE], 45);
        assert_eq!(t.time[T_FAULT_MINOR], 15);
        assert_eq!(t.time[T_FAULT_IO], 90);
        assert_eq!(t.cnt[C_MAJFLT_FILE], 1);
        assert_eq!(t.cnt[C_CTX_SWITCHES], 3);
        assert_eq!(t.cnt[C_CTX_INVOLUNTARY], 1);
    }

    /// One user-mode fault at `at`, `lat` ns long, as the probes take it under the memcg close
    /// (`sampling`): untimed when the thread is in a storm and it is not a sample. The draw for
    /// the gap to the next sample is the one that makes it 7 faults (a stride of 8).
    /// Returns the close's (latency, class, weight), `None` for an untimed fault.
    fn user_fault(t: &mut ThreadState, st: &mut Storm, at: u64, lat: u64, sampling: bool) -> Option<(u64, usize, u64)> {
        user_fault_drawing(t, st, at, lat, sampling, STORM_SAMPLE - 1)
    }

    fn user_fault_drawing(
        t: &mut ThreadState,
        st: &mut Storm,
        at: u64,
        lat: u64,
        sampling: bool,
        random: u32,
    ) -> Option<(u64, usize, u64)> {
        if t.fault_enter_untimed(st) {
            assert!(t.fault_close_untimed(st));
            return None;
        }
        t.fault_enter(at, st, sampling, random);
        t.fault_close(at + lat, st)
    }

    /// Every interleaving of two writers' plain-store updates of the sequence (each: read, store
    /// the begin value, read, store the end value) leaves it even, so no mark loses the thread
    /// for good. The `+ 1` at both ends that it replaced leaves it odd in some.
    #[test]
    fn two_writers_of_the_update_sequence_always_leave_it_even() {
        fn run(order: &[usize], begin: fn(u64) -> u64, end: fn(u64) -> u64) -> u64 {
            let (mut seq, mut step, mut read) = (10u64, [0usize; 2], [0u64; 2]);
            for &w in order {
                match step[w] {
                    0 | 2 => read[w] = seq,
                    1 => seq = begin(read[w]),
                    _ => seq = end(read[w]),
                }
                step[w] += 1;
            }
            seq
        }
        // Bit b of m: which writer takes the (b + 1)th step; each takes four.
        let order = |m: u32| -> [usize; 8] { core::array::from_fn(|b| (m >> b & 1) as usize) };
        let orders = || (0u32..256).filter(|m| m.count_ones() == 4).map(order);
        assert_eq!(orders().count(), 70);
        for o in orders() {
            let seq = run(&o, seq_begin, seq_end);
            assert_eq!(seq % 2, 0, "writers in order {o:?} left {seq}");
            assert!(seq > 10);
        }
        let old_odd = orders().filter(|o| run(o, |s| s + 1, |s| s + 1) % 2 == 1).count();
        assert!(old_odd > 0, "read + 1 at both ends loses a store in some orders");
    }

    /// Storm sampling: the gaps between samples are drawn by the thread's generator (0 to 14
    /// untimed faults, 7 on average); whatever the draws, every fault is counted once and stands
    /// in exactly one sample.
    #[test]
    fn drawn_gaps_keep_every_fault_in_one_sample() {
        let mut t = thread();
        let mut st = Storm::zeroed();
        let (mut weights, mut timed) = (0, 0u64);
        let n = 100_000u64;
        for i in 0..n {
            let at = 2000 + i * 1000;
            let x = st.draw(at);
            if let Some((_, _, w)) = user_fault_drawing(&mut t, &mut st, at, 600, true, x) {
                weights += w;
                timed += 1;
            }
        }
        assert_eq!(t.cnt[C_MINFLT], n);
        assert_eq!(weights + st.untimed as u64, n);
        assert_eq!(t.cnt[C_FAULT_UNTIMED] + timed, n);
        let stride = n as f64 / timed as f64;
        assert!((stride - STORM_SAMPLE as f64).abs() < 0.3, "1 in {stride:.2} timed");
    }

    /// The thread's generator of gaps: each gap from 0 to 14 about as often as any other, in
    /// draws seeded from any clock value (0 too), and two threads seeded apart draw apart.
    #[test]
    fn the_generator_draws_every_gap_about_as_often() {
        for seed in [0, 1, 2_000_000_123, u64::MAX] {
            let mut st = Storm::zeroed();
            let mut counts = [0u32; 2 * STORM_SAMPLE as usize - 1];
            for _ in 0..150_000 {
                counts[(st.draw(seed) % (2 * STORM_SAMPLE - 1)) as usize] += 1;
            }
            let each = 150_000 / counts.len() as u32;
            assert!(counts.iter().all(|&c| c.abs_diff(each) < each / 10), "seed {seed}: {counts:?}");
        }
        let (mut a, mut b) = (Storm::zeroed(), Storm::zeroed());
        let same = (0..1000).filter(|_| a.draw(1000) == b.draw(1001)).count();
        assert!(same < 5, "{same} of 1000 draws alike");
    }

    /// Storm sampling (`faults` module spec): a window of 64 fast plain minor faults starts a storm
    /// in which 1 fault in 8 is timed and stands for the 7 before it; counts stay exact, and with
    /// faults all alike the estimate is the measured time.
    #[test]
    fn a_fast_window_of_plain_minor_faults_is_sampled_one_in_eight() {
        let mut t = thread();
        let mut st = Storm::zeroed();
        let (mut weights, mut timed) = (0, 0);
        // Two windows decide nothing (the first has no start), then 8 samples of 8 faults.
        let n = 2 * STORM_WINDOW as u64 + 64;
        for i in 0..n {
            if let Some((lat, class, w)) = user_fault(&mut t, &mut st, 2000 + i * 1000, 600, true) {
                assert_eq!((lat, class), (600, 0));
                weights += w;
                timed += 1;
            }
        }
        assert_eq!(t.cnt[C_MINFLT], n, "every fault counted");
        assert_eq!(timed, 2 * STORM_WINDOW as u64 + 8, "the first two windows timed in full, then 1 in 8");
        assert_eq!(t.cnt[C_FAULT_UNTIMED], 56);
        // The last fault was untimed (its window's eighth): 7 faults wait for the next sample.
        assert_eq!(st.untimed, 7);
        assert_eq!(weights + st.untimed as u64, n, "each fault stands in one sample, but those waiting");
        t.account(2000 + n * 1000);
        assert_eq!(t.accounted(), 1000 + n * 1000);
        assert_eq!(t.time[T_FAULT_MINOR], (n - 7) * 600, "estimates equal to the faults' time");
        // The next fault is the sample of those 7.
        assert_eq!(user_fault(&mut t, &mut st, 2000 + n * 1000, 600, true), Some((600, 0, 8)));
        assert_eq!(t.time[T_FAULT_MINOR], (n + 1) * 600);
        assert_eq!(t.time[T_FAULT_MINOR] + t.time[T_COMPUTE], t.accounted());
    }

    /// Storm sampling: no storm without the memcg close, nor when the faults come slower than
    /// `STORM_NS_PER_FAULT`; the estimate moves no more than the compute time since the last
    /// timed fault.
    #[test]
    fn only_fast_windows_under_the_memcg_close_are_storms() {
        for (sampling, every) in [(false, 1000), (true, STORM_NS_PER_FAULT + 100)] {
            let mut t = thread();
            let mut st = Storm::zeroed();
            for i in 0..4 * STORM_WINDOW as u64 {
                assert!(user_fault(&mut t, &mut st, 2000 + i * every, 600, sampling).is_some(), "{sampling} {every}");
            }
            assert_eq!((t.cnt[C_FAULT_UNTIMED], t.flags & F_STORM), (0, 0));
        }
        let mut t = thread();
        let mut st = Storm::zeroed();
        t.flags |= F_STORM;
        t.storm_skip = 2;
        st.compute_mark = t.time[T_COMPUTE];
        assert!(t.fault_enter_untimed(&mut st) && t.fault_close_untimed(&mut st));
        assert!(t.fault_enter_untimed(&mut st) && t.fault_close_untimed(&mut st));
        t.account(1100); // 100 compute, untimed faults included
        // A sample of 80 ns: 2 × 80 estimated, at most the 100 of compute since the mark.
        assert_eq!(user_fault(&mut t, &mut st, 1100, 80, true), Some((80, 0, 3)));
        assert_eq!((t.time[T_COMPUTE], t.time[T_FAULT_MINOR]), (0, 180));
    }

    /// Storm sampling: an untimed fault in which something slow happens is timed from then, the
    /// slow part attributed as any fault's; it stands for no untimed faults, and its window ends
    /// out of storm.
    #[test]
    fn a_slow_untimed_fault_is_timed_from_the_slow_event_and_ends_the_storm() {
        for slow in 0..5 {
            let mut t = thread();
            let mut st = Storm::zeroed();
            t.flags |= F_STORM;
            t.storm_skip = 1;
            st.untimed = 3;
            assert!(t.fault_enter_untimed(&mut st));
            t.account(1010); // 10 compute: the untimed fault's start
            match slow {
                0 => {
                    t.switch_out(1010, false);
                    t.wakeup(1050, false, 0); // 40 fault_io
                    t.switch_in(1050);
                }
                1 => t.fault_read(1010, true, true),
                2 => t.reclaim(1010, true),
                3 => t.fault_major(1010),
                _ => t.file_fault(1010),
            }
            assert!(!t.fault_close_untimed(&mut st), "timed since the slow event ({slow})");
            let (lat, _, weight) = t.fault_close(1060, &mut st).unwrap();
            assert_eq!((lat, weight), (50, 1), "{slow}");
            assert_eq!(t.time[T_COMPUTE], 10, "{slow}");
            assert_eq!(t.accounted(), 60, "{slow}");
            assert_eq!(st.untimed, 3, "the untimed faults wait for a plain sample ({slow})");
            assert_eq!(t.flags & (F_WINDOW_SLOW | F_STORM), F_WINDOW_SLOW, "the storm ends at once ({slow})");
            assert!(!t.fault_enter_untimed(&mut st), "the next fault is timed ({slow})");
            st.window_n = STORM_WINDOW;
            t.fault_enter(1070, &mut st, true, STORM_SAMPLE - 1);
            assert_eq!(t.flags & (F_STORM | F_WINDOW_SLOW), 0, "the window ends out of storm ({slow})");
        }
    }

    #[test]
    fn zram_swapin_splits_the_fault() {
        let mut t = thread();
        t.fault_enter(1010, &mut Storm::zeroed(), false, 0);
        t.account(1012); // 2 fault_minor before the zram read
        t.fault_read(1012, true, true);
        let (lat, class) = t.fault_exit(1015, true); // 3 swapin_zram
        assert_eq!((lat, class), (5, 2));
        assert_eq!(t.time[T_FAULT_MINOR], 2);
        assert_eq!(t.time[T_SWAPIN_ZRAM], 3);
        assert_eq!(t.cnt[C_MAJFLT_SWAP], 1);
        assert_eq!(t.time[T_COMPUTE], 10);
    }

    #[test]
    fn a_disk_read_turns_the_rest_of_the_fault_into_fault_io() {
        let mut t = thread();
        t.fault_enter(1000, &mut Storm::zeroed(), false, 0);
        t.fault_read(1004, false, false); // 4 fault_minor (setting up)
        t.switch_out(1006, false); // 2 fault_io (on CPU, read in flight)
        t.wakeup(1050, false, 0); // 44 fault_io (blocked)
        t.switch_in(1060); // 10 runqueue
        let (_, class) = t.fault_exit(1063, true); // 3 fault_minor (after the read)
        assert_eq!(class, 1);
        assert_eq!(t.time[T_FAULT_MINOR], 7);
        assert_eq!(t.time[T_FAULT_IO], 46);
        assert_eq!(t.time[T_RUNQUEUE], 10);
        assert_eq!(t.cnt[C_MAJFLT_FILE], 1);
        // A disk swap device classifies the fault as swap.
        let mut t = thread();
        t.fault_enter(1000, &mut Storm::zeroed(), false, 0);
        t.fault_read(1001, false, true);
        assert_eq!(t.fault_exit(1002, true).1, 2);
        assert_eq!(t.cnt[C_MAJFLT_SWAP], 1);
    }

    /// The memcg close (`faults` module spec): major when `PGMAJFAULT` was counted inside the
    /// fault; a close with no open fault counts nothing; a `major-faults` event right after a
    /// minor close moves its count; one after the next entry does not.
    #[test]
    fn the_memcg_close_classifies_by_pgmajfault_and_moves_retried_faults() {
        let mut t = thread();
        assert_eq!(t.fault_close(1000, &mut Storm::zeroed()), None, "a get_user_pages fault: nothing open");
        t.fault_enter(1000, &mut Storm::zeroed(), false, 0);
        t.flags |= F_FAULT_MAJOR; // PGMAJFAULT
        t.fault_read(1010, false, false);
        assert_eq!(t.fault_close(1100, &mut Storm::zeroed()), Some((100, 1, 1)));
        assert!(!t.retried_major(), "a major close: its major-faults event moves nothing");
        t.fault_enter(1200, &mut Storm::zeroed(), false, 0);
        assert_eq!(t.fault_close(1250, &mut Storm::zeroed()), Some((50, 0, 1)));
        assert_eq!((t.cnt[C_MINFLT], t.cnt[C_MAJFLT_FILE]), (1, 1));
        assert!(t.retried_major(), "a minor close the kernel counted major");
        assert_eq!((t.cnt[C_MINFLT], t.cnt[C_MAJFLT_FILE]), (0, 2));
        assert!(!t.retried_major(), "moved once");
        t.fault_enter(1300, &mut Storm::zeroed(), false, 0);
        assert_eq!(t.fault_close(1310, &mut Storm::zeroed()), Some((10, 0, 1)));
        t.fault_enter(1400, &mut Storm::zeroed(), false, 0);
        assert!(!t.retried_major(), "an entry since the minor close");
        assert_eq!(t.fault_close(1450, &mut Storm::zeroed()), Some((50, 0, 1)));
        assert_eq!((t.cnt[C_MINFLT], t.cnt[C_MAJFLT_FILE], t.cnt[C_FAULT_UNMATCHED_EXIT]), (2, 2, 0));
        assert_eq!(t.flags & F_FAULT_MAJOR, 0, "the major mark ends with its fault");
    }

    #[test]
    fn sleep_and_reclaim() {
        let mut t = thread();
        t.syscall_enter(1000, false);
        t.switch_out(1000, false);
        t.wakeup(1500, false, 0);
        t.switch_in(1500);
        t.syscall_exit(1500);
        t.fault_enter(1500, &mut Storm::zeroed(), false, 0);
        t.reclaim(1500, true);
        t.switch_out(1600, false);
        t.switch_in(1700);
        t.reclaim(1750, false);
        t.fault_exit(1800, false);
        assert_eq!(t.time[T_SLEEP], 500);
        assert_eq!(t.time[T_RECLAIM], 250);
        assert_eq!(t.time[T_FAULT_MINOR], 50);
        assert_eq!(t.accounted(), 800);
    }

    #[test]
    fn a_wait_ended_by_a_peers_io_is_io_wait_peer() {
        // The worker blocks in pread (io_wait), its read completes (woken from blocked I/O),
        // it returns and wakes the waiter from inside futex(FUTEX_WAKE).
        let mut waiter = thread();
        let mut worker = thread();
        waiter.syscall_enter(1100, false); // futex wait: 100 compute
        waiter.switch_out(1110, false); // 10 syscall; blocked from here
        worker.syscall_enter(1120, true);
        worker.switch_out(1130, false);
        worker.wakeup(1500, false, 0); // the disk read completed
        assert_eq!(worker.io_done, 1500);
        worker.switch_in(1510);
        worker.syscall_exit(1520);
        assert_eq!(worker.io_done, 1520, "the I/O ends when its result reaches the worker's code");
        worker.syscall_enter(1530, false); // futex wake
        assert!(worker.wakes_with_io(&waiter));
        waiter.wakeup(1540, worker.wakes_with_io(&waiter), 0); // 430 io_wait_peer
        waiter.switch_in(1560); // 20 runqueue
        waiter.syscall_exit(1565); // 5 syscall
        waiter.account(1600); // 35 compute
        assert_eq!(waiter.time[T_IO_WAIT_PEER], 430);
        assert_eq!(waiter.time[T_SLEEP], 0);
        assert_eq!(waiter.time[T_RUNQUEUE], 20);
        assert_eq!(waiter.accounted(), 600);
        assert_eq!(worker.time[T_IO_WAIT], 1520 - 1120 - 10, "less its 10 ns in the run queue");
        // The next wait: the worker's last I/O ended before it began, so it is `sleep`.
        waiter.syscall_enter(1600, false);
        waiter.switch_out(1600, false);
        worker.syscall_enter(1700, false);
        assert!(!worker.wakes_with_io(&waiter), "I/O before the wait began");
        waiter.wakeup(1800, worker.wakes_with_io(&waiter), 0);
        assert_eq!((waiter.time[T_SLEEP], waiter.time[T_IO_WAIT_PEER]), (200, 430));
        // In user mode the current task is not the waker (an interrupt woke the wakee).
        waiter.switch_in(1800);
        waiter.switch_out(1900, false);
        worker.syscall_exit(1950);
        worker.io_done = 1950;
        assert!(!worker.wakes_with_io(&waiter), "a waker in user mode is an interrupt");
        // Only a `sleep` becomes `io_wait_peer`: a wait in the thread's own I/O stays `io_wait`.
        let mut t = thread();
        t.syscall_enter(1000, true);
        t.switch_out(1000, false);
        t.wakeup(1300, true, 0);
        assert_eq!((t.time[T_IO_WAIT], t.time[T_IO_WAIT_PEER]), (300, 0));
        // A non-blocking I/O syscall, or a fault without a disk read, is not I/O done.
        let mut w = thread();
        w.syscall_enter(1000, true);
        w.syscall_exit(1010);
        w.fault_enter(1020, &mut Storm::zeroed(), false, 0);
        w.switch_out(1030, false);
        w.wakeup(1040, false, 0);
        assert_eq!(w.io_done, 0);
        // A fault's disk read is.
        w.switch_in(1050);
        w.fault_read(1060, false, false);
        w.switch_out(1070, false);
        w.wakeup(1090, false, 0);
        assert_eq!(w.io_done, 1090);
        w.switch_in(1095);
        w.fault_exit(1100, true);
        assert_eq!(w.io_done, 1100);
    }

    #[test]
    fn a_wait_that_began_after_the_disk_completed_but_before_the_peer_ran_is_io_wait_peer() {
        // The read completes (1500) while the waiter, delayed, has not blocked yet; it blocks
        // at 1505, before the worker is back from pread (1520) with the result.
        let (mut waiter, mut worker) = (thread(), thread());
        worker.syscall_enter(1100, true);
        worker.switch_out(1110, false);
        waiter.syscall_enter(1200, false);
        worker.wakeup(1500, false, 0);
        waiter.switch_out(1505, false);
        worker.switch_in(1510);
        worker.syscall_exit(1520);
        worker.syscall_enter(1530, false); // futex wake
        assert!(worker.wakes_with_io(&waiter));
        waiter.wakeup(1540, true, 0);
        assert_eq!(waiter.time[T_IO_WAIT_PEER], 35);
        // A later non-I/O syscall does not move the end of that I/O.
        worker.syscall_exit(1550);
        worker.syscall_enter(1560, false);
        worker.syscall_exit(1570);
        assert_eq!(worker.io_done, 1520);
    }

    #[test]
    fn a_read_that_completes_before_its_thread_blocks_is_io_done_at_the_syscalls_exit() {
        let mut w = thread();
        w.syscall_enter(1000, true);
        w.fault_read(1010, false, false); // its bio, queued outside any fault
        w.syscall_exit(1200); // done without blocking
        assert_eq!(w.io_done, 1200);
        // A cached read queues nothing: no I/O.
        w.syscall_enter(1300, true);
        w.syscall_exit(1310);
        assert_eq!(w.io_done, 1200);
        // Nor does a bio queued in a non-I/O syscall (say, readahead by `madvise`).
        w.syscall_enter(1400, false);
        w.fault_read(1410, false, false);
        w.syscall_exit(1420);
        assert_eq!(w.io_done, 1200);
    }

    #[test]
    fn exited_threads_stop_accumulating() {
        let mut t = thread();
        t.exit(1100);
        t.account(5000);
        assert_eq!(t.accounted(), 100);
    }
}
