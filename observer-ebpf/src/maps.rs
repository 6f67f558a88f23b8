//! Maps shared by the programs, and the helpers that find a thread's state.

use core::sync::atomic::{Ordering, compiler_fence};

use aya_ebpf::{
    helpers::{bpf_get_current_comm, bpf_get_current_pid_tgid},
    macros::map,
    maps::{Array, HashMap, LruHashMap, PerCpuArray, Queue, RingBuf},
};
use observer_common::{
    Config, FaultTimes, GlobalCounter,
    attrib::{
        BioInflight, BioKey, DevIo, F_ON_CPU, Hist, MAX_SLOTS, N_HIST, REC_RETIRED, RetiredRecord, SEQ_CLOSED,
        SEQ_LAST_MISS, SEQS_N, Storm, ThreadState, TpOffsets, seq_begin, seq_end,
    },
    faults::{GLOBAL_COUNTERS, MAX_OVERFLOW_THREADS, OverflowFaults},
};

#[map]
pub static CONFIG: Array<Config> = Array::with_max_entries(1, 0);

#[map]
pub static OFFSETS: Array<TpOffsets> = Array::with_max_entries(1, 0);

/// Bitmap of syscall numbers that count as explicit I/O (512 bits).
#[map]
pub static IO_SYSCALLS: Array<u64> = Array::with_max_entries(8, 0);

#[map]
pub static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(GLOBAL_COUNTERS, 0);

/// TID → slot in `THREADS`. An entry never changes while its thread lives; it is removed when
/// the slot is given back ([`retire`]), with its copy in `TID_SLOTS`. Copies in other CPUs'
/// `SLOT_CACHE` words may outlive it: such a word is believed only while the slot's state still
/// names its thread ([`cached_slot`]).
#[map]
pub static SLOTS: HashMap<u32, u32> = HashMap::with_max_entries(MAX_SLOTS, 0);

/// Slots given back ([`retire`]), taken before a never-used one (`attrib::MAX_SLOTS`, "Slots").
#[map]
pub static FREE_SLOTS: Queue<u32> = Queue::with_max_entries(MAX_SLOTS, 0);

/// What a slot holds before its first thread, in each of the arrays indexed by slot; never
/// written, copied over a slot given back.
#[repr(C)]
pub struct BlankSlot {
    pub state: ThreadState,
    pub faults: FaultTimes,
    pub storm: Storm,
    pub open: observer_common::xread::ReadOpen,
}

#[map]
pub static BLANK_SLOT: Array<BlankSlot> = Array::with_max_entries(1, 0);

/// `SLOTS` again, direct-mapped: entry `tid % TID_SLOTS_N` is `tid << 32 | CACHED | slot` for
/// the last thread of that remainder whose slot a program looked up or made (0: none). An
/// array lookup, not a hash one (about 50 ns on the development VM: the scheduler's programs
/// look up a thread other than the current one at every switch, wakeup and runtime update).
/// One 8-byte word, checked against the TID, so a thread sharing the remainder only costs the
/// hash lookup; only found entries are kept (a thread without a slot may get one at any time).
#[map]
pub static TID_SLOTS: Array<u64> = Array::with_max_entries(TID_SLOTS_N, 0);

/// Entries of `TID_SLOTS` (a power of two: the threads of a process have TIDs close together).
const TID_SLOTS_N: u32 = 1024;

/// Per-CPU: the last `SLOTS` entry a thread's own event looked up or made,
/// `tid << 32 | CACHED | [CURRENT |] slot` (one 8-byte word, so a program that interrupts
/// another on this CPU reads either the old pair or the new one, never half of
/// each), 0 when none. A fault storm is one thread faulting on one CPU: its
/// events find their slot here without a hash lookup, and, while the thread stays on the CPU,
/// know that it is the current task without asking (`CURRENT`). A word may outlive its thread's
/// slot (given back on another CPU, [`retire`]): it is believed only while the slot's state still
/// names the thread ([`cached_slot`]), and with `CURRENT` only until the CPU's next switch, which
/// a freed thread never reaches.
#[map]
pub static SLOT_CACHE: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// `SLOT_CACHE`'s mark of a valid entry (slots are below `MAX_SLOTS`).
const CACHED: u64 = 1 << 31;

/// `SLOT_CACHE`'s mark that its thread is this CPU's current task. Set at every context switch
/// on the CPU that puts a tracked thread on it, and cleared at every other one, by the raw
/// `sched_switch` program (`sched::switch_raw`, [`switched_in`]; a raw tracepoint is skipped only
/// when it is already running on the CPU, never because another BPF program is, so no switch is
/// missed); where that program cannot run (no BTF) cleared at every switch (`sched::switch_forget`)
/// and set by a fault program running in the task once `target_tid` has named it
/// ([`mark_current`]). While it is set, the programs that run in the task take the current thread
/// of the target and its slot from here ([`current_known`]), without `bpf_get_current_pid_tgid` (a
/// helper call: 11–14 ns a fault program run on the development VM) and the target check. No
/// other program sets it: the fault programs never run inside a context switch, while the
/// tracepoint `sched_switch`'s program (which caches the previous task) may run after the
/// clearing.
const CURRENT: u64 = 1 << 30;

/// The slot bits of a `SLOT_CACHE` word.
const SLOT_BITS: u64 = CURRENT - 1;

/// Attribution state, one slot per thread of the target.
#[map]
pub static THREADS: Array<ThreadState> = Array::with_max_entries(MAX_SLOTS, 0);

/// Each thread's storm-sampling bookkeeping (`observer_common::faults`), at its slot in `THREADS`.
#[map]
pub static STORMS: Array<Storm> = Array::with_max_entries(MAX_SLOTS, 0);

/// Latencies of each thread's completed faults, at its slot in `THREADS`.
#[map]
pub static FAULT_TIMES: Array<FaultTimes> = Array::with_max_entries(MAX_SLOTS, 0);

/// TID → the faults of a thread without a slot in `THREADS` (`observer_common::faults`: the
/// overflow path, which the fault programs take only when `current_slot` finds none).
#[map]
pub static OVERFLOW_FAULTS: HashMap<u32, OverflowFaults> = HashMap::with_max_entries(MAX_OVERFLOW_THREADS, 0);

/// Per-CPU: a zeroed `OverflowFaults` to insert new entries from (too large for the BPF stack);
/// only `tgid` and `comm` are ever written.
#[map]
pub static OVERFLOW_TEMPLATE: PerCpuArray<OverflowFaults> = PerCpuArray::with_max_entries(1, 0);

/// Per-CPU fault exits of threads with neither a slot nor room in `OVERFLOW_FAULTS`
/// (`faults::OTHER_MAJFLT`, `faults::OTHER_MINFLT`, `faults::OTHER_CLOSES`).
#[map]
pub static OTHER_FAULTS: PerCpuArray<u64> = PerCpuArray::with_max_entries(3, 0);

/// Index 0: slots handed out so far (the high-water mark). Index 1: marks emitted so far.
/// Index 2 (`attrib::SEQ_LAST_MISS`): when a thread last found no slot. Index 3
/// (`attrib::SEQ_CLOSED`): when the latest snapshot began ([`closed`]).
#[map]
pub static SEQS: Array<u64> = Array::with_max_entries(SEQS_N, 0);

/// When the latest snapshot began (`attrib`, "Closed time stays closed"): no event charges a
/// context it decides late to time before it.
#[inline(always)]
pub fn closed() -> u64 {
    // SAFETY: map value, one 8-byte load.
    SEQS.get_ptr(SEQ_CLOSED).map(|v| unsafe { core::ptr::read_volatile(v) }).unwrap_or(0)
}

#[map]
pub static HISTS: PerCpuArray<Hist> = PerCpuArray::with_max_entries(N_HIST, 0);

/// Block devices of interest (dev_t in the kernel's encoding) → `DEV_*` kind.
#[map]
pub static DEVICES: HashMap<u32, u32> = HashMap::with_max_entries(64, 0);

/// Per-device read totals of the target.
#[map]
pub static DEV_IO: HashMap<u32, DevIo> = HashMap::with_max_entries(64, 0);

/// Read bios of the target in flight; LRU so that never-completed keys
/// (merged bios) age out.
#[map]
pub static INFLIGHT: LruHashMap<BioKey, BioInflight> = LruHashMap::with_max_entries(16384, 0);

/// TID → start of its `zram_rw_page` read and the read's device (Linux < 6.3; see
/// `block::zram_rw_page`).
#[map]
pub static ZRAM_PAGE_START: HashMap<u32, [u64; 2]> = HashMap::with_max_entries(MAX_SLOTS, 0);

/// TID → calls of probed decode entry points in progress on that thread
/// (`marks::call_begin`): a call nested in another one, or a return whose
/// entry was never seen (attached mid-call), marks nothing.
#[map]
pub static CALL_DEPTH: HashMap<u32, u32> = HashMap::with_max_entries(MAX_SLOTS, 0);

/// Per-CPU scratch: the token count the running mark carries, `1 << 32 | n`
/// when known, 0 when not (set by each marking program before `marks::mark`;
/// kept out of registers for the verifier, as `MARK_LOST`).
#[map]
pub static MARK_N_TOKENS: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// Per-CPU scratch: thread records a mark could not send.
#[map]
pub static MARK_LOST: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// The ring buffer's size in bytes.
pub const EVENTS_BYTES: u32 = 4 << 20;

/// Token-boundary records (and reads, execs, retired threads) to user space.
#[map]
pub static EVENTS: RingBuf = RingBuf::with_byte_size(EVENTS_BYTES, 0);

/// Submit without waking the reader (`bpf_ringbuf_submit` flags).
pub const BPF_RB_NO_WAKEUP: u64 = 1;
/// Submit and wake the reader.
pub const BPF_RB_FORCE_WAKEUP: u64 = 2;
/// `bpf_ringbuf_query`: bytes written and not yet consumed.
const BPF_RB_AVAIL_DATA: u64 = 0;
/// The unread bytes at which a batch's last record wakes the reader.
const WAKE_AT_BYTES: u64 = EVENTS_BYTES as u64 / 8;

/// The wakeup rule of a batch of records that ends with this one (a mark's thread records and
/// its mark record; an expert read): no wakeup per record, as waking the observer at every token
/// would make it compete with the engine for a CPU at exactly the wrong moment; user space polls
/// the ring on a timer. But once an eighth of the ring is unread, the batch wakes the reader, so
/// that a burst (thousands of steps a second across many threads: 9 KB a step for 11 threads)
/// is read before the ring fills rather than at the next poll.
#[inline(always)]
pub fn batch_wakeup() -> u64 {
    if EVENTS.query(BPF_RB_AVAIL_DATA) >= WAKE_AT_BYTES { BPF_RB_FORCE_WAKEUP } else { BPF_RB_NO_WAKEUP }
}

#[inline(always)]
pub fn config() -> Option<&'static Config> {
    CONFIG.get(0)
}

/// Upper bound on the descendants followed besides the target.
pub const MAX_FOLLOWED: u32 = 256;

/// Followed descendants of the target: tgid → 1 (`Config::follow_children`;
/// added at fork by `sched::new_task`, removed when their leader is freed: `sched::process_free`).
#[map]
pub static TARGETS: HashMap<u32, u32> = HashMap::with_max_entries(MAX_FOLLOWED, 0);

/// Whether `tgid` is observed: the target or a followed descendant.
#[inline(always)]
pub fn is_target(tgid: u32) -> bool {
    let Some(cfg) = config() else { return false };
    if cfg.target_tgid == 0 {
        return false;
    }
    // SAFETY: plain map lookup.
    tgid == cfg.target_tgid || (cfg.follow_children != 0 && unsafe { TARGETS.get(&tgid) }.is_some())
}

/// The current task's TID when it belongs to an observed process.
#[inline(always)]
pub fn target_tid() -> Option<u32> {
    let id = bpf_get_current_pid_tgid();
    if !is_target((id >> 32) as u32) {
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

/// Count `v` ns in latency histogram `h` (`attrib::H_*`): its bucket and the sum.
#[inline(always)]
pub fn hist_add(h: u32, v: u64) {
    if let Some(p) = HISTS.get_ptr_mut(h) {
        // SAFETY: per-CPU value; programs do not nest on one CPU for these hooks.
        unsafe { (*p).add(v) };
    }
}

/// This CPU's `SLOT_CACHE` word and where it lives, read in one 8-byte load.
#[inline(always)]
fn slot_cache() -> Option<(*mut u64, u64)> {
    let c = SLOT_CACHE.get_ptr_mut(0)?;
    // SAFETY: per-CPU map value, read in one 8-byte load.
    Some((c, unsafe { core::ptr::read_volatile(c) }))
}

/// The word of `SLOT_CACHE` or `TID_SLOTS` that says thread `tid` has `slot`: `tid << 32 | CACHED
/// | marks | slot` (`marks`: [`CURRENT`] or none).
#[inline(always)]
fn slot_word(tid: u32, slot: u32, marks: u64) -> u64 {
    (tid as u64) << 32 | CACHED | marks | slot as u64
}

/// Whether word `v` ([`slot_word`]) is a valid entry of thread `tid`.
#[inline(always)]
fn caches(v: u64, tid: u32) -> bool {
    v >> 32 == tid as u64 && v & CACHED != 0
}

/// The slot word `v` ([`slot_word`]) gives thread `tid`, if it names it.
#[inline(always)]
fn slot_in(v: u64, tid: u32) -> Option<u32> {
    caches(v, tid).then_some((v & SLOT_BITS) as u32)
}

/// The slot `SLOT_CACHE` remembers for `tid` on this CPU, while that slot's state still names
/// `tid`: the word may be older than the slot's last giving back ([`retire`] leaves other CPUs'
/// words alone), after which the slot is blank (TID 0) or another thread's.
#[inline(always)]
fn cached_slot(tid: u32) -> Option<u32> {
    let slot = slot_in(slot_cache()?.1, tid)?;
    let p = THREADS.get_ptr(slot)?;
    // SAFETY: map value; the TID is one aligned 4-byte load (written when the slot is given or
    // given back).
    (unsafe { core::ptr::read_volatile(&raw const (*p).tid) } == tid).then_some(slot)
}

/// The current task's TID and slot when a fault program on this CPU named it since the CPU's
/// last context switch ([`CURRENT`]).
#[inline(always)]
pub fn current_known() -> Option<(u32, u32)> {
    let (_, v) = slot_cache()?;
    (v & CURRENT != 0).then_some(((v >> 32) as u32, (v & SLOT_BITS) as u32))
}

/// Mark `SLOT_CACHE`'s entry as this CPU's current task when it is `tid`'s: called in the task by
/// a fault program, after `target_tid` named it and its slot was cached ([`CURRENT`]).
#[inline(always)]
pub fn mark_current(tid: u32) {
    if let Some((c, v)) = slot_cache()
        && caches(v, tid)
    {
        // SAFETY: per-CPU map value, written in one 8-byte store; programs on this CPU do not run
        // inside a context switch's clearing.
        unsafe { core::ptr::write_volatile(c, v | CURRENT) };
    }
}

/// A context switch on this CPU: its current task is no longer known ([`CURRENT`]).
#[inline(always)]
pub fn forget_current() {
    if let Some((c, v)) = slot_cache()
        && v & CURRENT != 0
    {
        // SAFETY: per-CPU map value, written in one 8-byte store.
        unsafe { core::ptr::write_volatile(c, v & !CURRENT) };
    }
}

/// The current thread of the target and its slot (`None` before it has one): known since this
/// CPU's last context switch, or named now ([`current_known`]); `None` for any other task. For
/// programs that run in the task, never inside a context switch ([`CURRENT`]).
#[inline(always)]
pub fn current_target() -> Option<(u32, Option<u32>)> {
    if let Some((tid, slot)) = current_known() {
        return Some((tid, Some(slot)));
    }
    let tid = target_tid()?;
    let slot = known_slot(tid);
    if slot.is_some() {
        mark_current(tid);
    }
    Some((tid, slot))
}

/// The slot and state of the current thread of the target ([`current_target`]): at `slot`, or
/// at a slot given now ([`current_slot`]).
#[inline(always)]
pub fn target_state(tid: u32, slot: Option<u32>, now: u64) -> Option<(u32, *mut ThreadState)> {
    let slot = match slot {
        Some(slot) => slot,
        None => current_slot(tid, now)?,
    };
    Some((slot, THREADS.get_ptr_mut(slot)?))
}

/// A context switch puts tracked thread `tid` (at `slot`) on this CPU: it is the current task
/// until the next switch ([`CURRENT`]).
#[inline(always)]
pub fn switched_in(tid: u32, slot: u32) {
    if let Some(c) = SLOT_CACHE.get_ptr_mut(0) {
        // SAFETY: per-CPU map value, written in one 8-byte store.
        unsafe { core::ptr::write_volatile(c, slot_word(tid, slot, CURRENT)) };
    }
}

/// `tid`'s slot in `TID_SLOTS`, when its entry is there.
#[inline(always)]
fn table_slot(tid: u32) -> Option<u32> {
    let p = TID_SLOTS.get_ptr(tid & (TID_SLOTS_N - 1))?;
    // SAFETY: map value, read in one 8-byte load.
    slot_in(unsafe { core::ptr::read_volatile(p) }, tid)
}

/// `SLOTS` has `tid` at `slot`: keep it in `TID_SLOTS`.
#[inline(always)]
fn table_remember(tid: u32, slot: u32) {
    if let Some(p) = TID_SLOTS.get_ptr_mut(tid & (TID_SLOTS_N - 1)) {
        // SAFETY: map value, written in one 8-byte store.
        unsafe { core::ptr::write_volatile(p, slot_word(tid, slot, 0)) };
    }
}

/// `tid`'s slot from `TID_SLOTS`, else from `SLOTS` (then kept in `TID_SLOTS`).
#[inline(always)]
fn lookup_slot(tid: u32) -> Option<u32> {
    if let Some(slot) = table_slot(tid) {
        return Some(slot);
    }
    // SAFETY: plain map lookup.
    let slot = unsafe { SLOTS.get(&tid).copied() }?;
    table_remember(tid, slot);
    Some(slot)
}

#[inline(always)]
fn remember_slot(tid: u32, slot: u32) {
    if let Some(c) = SLOT_CACHE.get_ptr_mut(0) {
        // SAFETY: per-CPU map value, written in one 8-byte store.
        unsafe { core::ptr::write_volatile(c, slot_word(tid, slot, 0)) };
    }
}

/// The slot of a tracked thread (no allocation; the cache is not changed,
/// so that looking up another thread — a wakee — keeps the current one's).
#[inline(always)]
pub fn slot_of(tid: u32) -> Option<u32> {
    if let Some(slot) = cached_slot(tid) {
        return Some(slot);
    }
    lookup_slot(tid)
}

/// The slot of the current thread when it has one (no allocation), remembered in `SLOT_CACHE`.
#[inline(always)]
pub fn known_slot(tid: u32) -> Option<u32> {
    if let Some(slot) = cached_slot(tid) {
        return Some(slot);
    }
    let slot = lookup_slot(tid)?;
    remember_slot(tid, slot);
    Some(slot)
}

/// The state of a tracked thread (no allocation).
#[inline(always)]
pub fn state_of(tid: u32) -> Option<*mut ThreadState> {
    THREADS.get_ptr_mut(slot_of(tid)?)
}

/// `observer_common::attrib::TASK_START_TIME`, set by the loader.
#[unsafe(no_mangle)]
static TASK_START_TIME: u32 = 0;

/// Whether the current task started before a thread last found no slot (`attrib::MAX_SLOTS`,
/// "Slots": then it gets none). False where its start is not known.
#[inline(always)]
fn started_before_a_miss() -> bool {
    // SAFETY: a read-only global.
    let off = unsafe { core::ptr::read_volatile(&TASK_START_TIME) };
    let miss = SEQS.get(SEQ_LAST_MISS).copied().unwrap_or(0);
    if off == 0 || miss == 0 {
        return false;
    }
    // SAFETY: the current task's `start_time`, read with the helper (a faulting read fails).
    let start = unsafe {
        let task = aya_ebpf::helpers::bpf_get_current_task() as *const u8;
        aya_ebpf::helpers::bpf_probe_read_kernel(task.add(off as usize) as *const u64).unwrap_or(0)
    };
    start != 0 && start < miss
}

/// A slot nobody has: one given back, else the next never used (`attrib::MAX_SLOTS`, "Slots").
#[inline(always)]
fn free_slot() -> Option<u32> {
    if let Ok(Some(slot)) = FREE_SLOTS.pop() {
        return Some(slot);
    }
    let next = SEQS.get_ptr_mut(0)?;
    // SAFETY: aligned map value; atomic so that two CPUs never get one slot.
    let slot = unsafe { atomic_fetch_add(next, 1) };
    (slot < MAX_SLOTS as u64).then_some(slot as u32)
}

/// The slot of the current thread of the target, allocated on first sight
/// as "on CPU, user mode, accounting from now"; remembered in `SLOT_CACHE`.
#[inline(always)]
pub fn current_slot(tid: u32, now: u64) -> Option<u32> {
    if let Some(slot) = known_slot(tid) {
        return Some(slot);
    }
    // A thread that once found none keeps its faults where they are (`observer_common::faults`,
    // the overflow path), never in two rows.
    // SAFETY: plain map lookup.
    if unsafe { OVERFLOW_FAULTS.get(&tid) }.is_some() || started_before_a_miss() {
        bump(GlobalCounter::LostEvents);
        return None;
    }
    let Some(slot) = free_slot() else {
        if let Some(miss) = SEQS.get_ptr_mut(SEQ_LAST_MISS) {
            // SAFETY: map value, one 8-byte store (any CPU's recent instant will do).
            unsafe { core::ptr::write_volatile(miss, now) };
        }
        bump(GlobalCounter::LostEvents);
        return None;
    };
    let p = THREADS.get_ptr_mut(slot)?;
    let comm = bpf_get_current_comm().unwrap_or([0; 16]);
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    // A slot nobody else has been given (a blank one: never used, or zeroed when given back);
    // inside its update sequence, for a mark copying it from another CPU.
    update(p, |s| {
        s.tid = tid;
        s.flags = F_ON_CPU;
        s.last_ts = now;
        s.first_ts = now;
        s.fault_start = 0;
        s.comm = comm;
        s.tgid = tgid;
    });
    if SLOTS.insert(&tid, &slot, 0).is_err() {
        bump(GlobalCounter::LostEvents);
        return None;
    }
    table_remember(tid, slot);
    remember_slot(tid, slot);
    Some(slot)
}

/// Give back thread `tid`'s slot, its task freed (`attrib::MAX_SLOTS`, "Slots", which this
/// follows step by step). Nothing is done for a thread without one, or when the ring buffer has
/// no room for its final state (the slot is then kept, and counted as a lost event).
#[inline(always)]
pub fn retire(tid: u32) {
    let Some(slot) = slot_of(tid) else { return };
    let (Some(p), Some(blank)) = (THREADS.get_ptr_mut(slot), BLANK_SLOT.get_ptr(0)) else { return };
    // SAFETY: map value.
    if unsafe { (*p).tid } != tid {
        return;
    }
    let Some(mut e) = EVENTS.reserve::<RetiredRecord>(0) else {
        bump(GlobalCounter::LostEvents);
        return;
    };
    let r = e.as_mut_ptr();
    // SAFETY: `r` is a reserved record of its type; `p` and the fault times are map values no
    // program writes any more but a read's completion (one atomic add of its latency).
    unsafe {
        (*r).kind = REC_RETIRED;
        (*r)._pad = 0;
        core::ptr::copy_nonoverlapping(p, &raw mut (*r).state, 1);
        match FAULT_TIMES.get_ptr(slot) {
            Some(f) => core::ptr::copy_nonoverlapping(f, &raw mut (*r).faults, 1),
            None => core::ptr::copy_nonoverlapping(&raw const (*blank).faults, &raw mut (*r).faults, 1),
        }
    }
    // No wakeup: user space polls (`batch_wakeup`), and a thread ends once.
    e.submit(BPF_RB_NO_WAKEUP);
    // Other CPUs' `SLOT_CACHE` words naming it stay: zeroing the state below makes them stale
    // (`cached_slot`), without a walk over every CPU.
    if let Some(w) = TID_SLOTS.get_ptr_mut(tid & (TID_SLOTS_N - 1)) {
        // SAFETY: map value, read and written in one 8-byte access each.
        unsafe {
            if caches(core::ptr::read_volatile(w), tid) {
                core::ptr::write_volatile(w, 0);
            }
        }
    }
    let _ = SLOTS.remove(&tid);
    // A call it was in never returns (a reused TID must not start nested in it).
    let _ = CALL_DEPTH.remove(&tid);
    // The state but its update sequence (the first field), which goes on.
    update(p, |s| {
        const SEQ: usize = core::mem::size_of::<u64>();
        // SAFETY: both are map values of the state's type; the sequence is left alone.
        unsafe {
            core::ptr::copy_nonoverlapping(
                (&raw const (*blank).state).cast::<u8>().add(SEQ),
                (s as *mut ThreadState).cast::<u8>().add(SEQ),
                core::mem::size_of::<ThreadState>() - SEQ,
            )
        }
    });
    // Copied in place (no helper call); nothing else writes them now.
    // SAFETY: map values of the arrays' types.
    unsafe {
        if let Some(f) = FAULT_TIMES.get_ptr_mut(slot) {
            core::ptr::copy_nonoverlapping(&raw const (*blank).faults, f, 1);
        }
        if let Some(st) = STORMS.get_ptr_mut(slot) {
            core::ptr::copy_nonoverlapping(&raw const (*blank).storm, st, 1);
        }
        if let Some(o) = crate::xread::XREAD_OPEN.get_ptr_mut(slot) {
            core::ptr::copy_nonoverlapping(&raw const (*blank).open, o, 1);
        }
    }
    if FREE_SLOTS.push(slot, 0).is_err() {
        bump(GlobalCounter::LostEvents);
    }
}

/// The state of the current thread of the target ([`current_slot`]).
#[inline(always)]
pub fn current_state(tid: u32, now: u64) -> Option<*mut ThreadState> {
    THREADS.get_ptr_mut(current_slot(tid, now)?)
}

/// Run `f` on a thread's state inside its update sequence (odd while updating),
/// so that marks reading it from another CPU can tell a torn copy.
#[inline(always)]
pub fn update(p: *mut ThreadState, f: impl FnOnce(&mut ThreadState)) {
    // SAFETY: `p` is a map value; `seq` is its first, 8-byte aligned field.
    unsafe {
        let seq = &raw mut (*p).seq;
        seq_bump::<false>(seq);
        f(&mut *p);
        seq_bump::<true>(seq);
    }
}

/// `observer_common::attrib::STORES_IN_ORDER`, set by the loader.
#[unsafe(no_mangle)]
static STORES_IN_ORDER: u8 = 0;

/// One end (`END`: the end, else the begin) of an update sequence (`ThreadState::seq`): where
/// the host keeps stores in order, a plain store of `attrib::seq_end` or `seq_begin` of the value
/// read (safe with a second writer on another CPU), kept in order by the compiler; else an atomic
/// fetch-and-add.
#[inline(always)]
fn seq_bump<const END: bool>(seq: *mut u64) {
    // SAFETY: a read-only global; `seq` points to an aligned u64 inside a map value.
    unsafe {
        if core::ptr::read_volatile(&STORES_IN_ORDER) != 0 {
            compiler_fence(Ordering::SeqCst);
            let read = core::ptr::read_volatile(seq);
            core::ptr::write_volatile(seq, if END { seq_end(read) } else { seq_begin(read) });
            compiler_fence(Ordering::SeqCst);
        } else {
            atomic_fetch_add(seq, 1);
        }
    }
}

/// Atomically add to a u64 that another CPU may also update (BPF_XADD, a
/// full barrier on x86). The BPF target has no `core` atomics, hence asm.
#[inline(always)]
pub fn atomic_add(p: *mut u64, v: u64) {
    // SAFETY: `p` points to an aligned u64 inside a map value.
    unsafe {
        core::arch::asm!(
            "lock *(u64 *)({p} + 0) += {v}",
            p = in(reg) p,
            v = in(reg) v,
            options(nostack),
        );
    }
}

/// Atomic fetch-and-add (BPF_ATOMIC | BPF_FETCH, Linux >= 5.12).
///
/// # Safety
/// `p` must point to an aligned u64 inside a map value.
#[inline(always)]
pub unsafe fn atomic_fetch_add(p: *mut u64, v: u64) -> u64 {
    let mut v = v;
    // SAFETY: guaranteed by the caller.
    unsafe {
        core::arch::asm!(
            "{v} = atomic_fetch_add((u64 *)({p} + 0), {v})",
            p = in(reg) p,
            v = inout(reg) v,
            options(nostack),
        );
    }
    v
}

/// Atomic fetch-and-or (Linux >= 5.12).
///
/// # Safety
/// As [`atomic_fetch_add`].
#[inline(always)]
pub unsafe fn atomic_fetch_or(p: *mut u64, v: u64) -> u64 {
    let mut v = v;
    // SAFETY: guaranteed by the caller.
    unsafe {
        core::arch::asm!(
            "{v} = atomic_fetch_or((u64 *)({p} + 0), {v})",
            p = in(reg) p,
            v = inout(reg) v,
            options(nostack),
        );
    }
    v
}

/// Atomic fetch-and-and (Linux >= 5.12).
///
/// # Safety
/// As [`atomic_fetch_add`].
#[inline(always)]
pub unsafe fn atomic_fetch_and(p: *mut u64, v: u64) -> u64 {
    let mut v = v;
    // SAFETY: guaranteed by the caller.
    unsafe {
        core::arch::asm!(
            "{v} = atomic_fetch_and((u64 *)({p} + 0), {v})",
            p = in(reg) p,
            v = inout(reg) v,
            options(nostack),
        );
    }
    v
}

#[inline(always)]
pub fn offsets() -> Option<&'static TpOffsets> {
    OFFSETS.get(0)
}
