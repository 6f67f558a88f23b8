//! Eviction blame (rule and layout: `observer_common::evict`): the actor of each eviction the
//! churn program counts, found from per-task reclaim windows, the task's comm and the system call
//! it is in, and its pages counted per actor × region class.
//!
//! The system-call rule reads the task's saved registers with `bpf_get_current_task_btf` and
//! `bpf_task_pt_regs` (Linux >= 5.15 with BTF, `CONFIG_DEBUG_INFO_BTF`); the churn delete program
//! calls it, so it needs the same kernel.

use aya_ebpf::{
    bindings::{BPF_F_MMAPABLE, BPF_NOEXIST},
    helpers::{
        bpf_get_current_cgroup_id, bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_get_current_task_btf,
        bpf_ktime_get_ns, bpf_probe_read_kernel, bpf_task_pt_regs,
    },
    macros::{map, tracepoint},
    maps::{Array, HashMap},
    programs::TracePointContext,
};
use observer_common::{
    attrib::{F_FAULT_REFAULT, F_FAULT_UNTIMED, T_FAULT_IO},
    evict::{
        ActorKey, ActorPages, BLOCK_PAGES, EvictConfig, K_DIRECT, K_KSWAPD, K_MEMCG, K_OTHER, K_PROACTIVE, MAX_ACTORS,
        MAX_REMEMBERED, MAX_SYSCALL, MAX_WINDOWS, N_CLASSES, N_KINDS, N_STATS, NO_SYSCALL, RefaultCost, RefaultFault,
        Remembered, S_NOT_REMEMBERED, S_REFAULT_FAULT_LOST, S_WINDOW_LOST,
    },
    filemap::{MAX_INTERVALS, NO_FIELD},
};

use crate::{
    filemap::{FILEMAP_CONFIG, find},
    maps::{atomic_add, atomic_fetch_and, atomic_fetch_or, state_of, target_tid, update},
};

/// `BPF_F_NO_PREALLOC`: the remembered blocks are allocated as they are used.
const NO_PREALLOC: u32 = 1;
/// Blocks a folio of at most 512 pages (2 MiB, naturally aligned) spans; pages beyond are counted
/// as not remembered.
const MAX_FOLIO_BLOCKS: u64 = 512 / BLOCK_PAGES;

#[map]
pub static EVICT_CONFIG: Array<EvictConfig> = Array::with_max_entries(1, 0);

/// System call number → actor kind + 1 (0: no rule).
#[map]
pub static EVICT_SYSCALLS: Array<u32> = Array::with_max_entries(MAX_SYSCALL, 0);

/// Region class (`C_*`) of each churn interval.
#[map]
pub static EVICT_CLASS: Array<u32> = Array::with_max_entries(MAX_INTERVALS, 0);

/// TID → kind of the reclaim it is in.
#[map]
pub static EVICT_WINDOWS: HashMap<u32, u32> = HashMap::with_max_entries(MAX_WINDOWS, 0);

#[map]
pub static EVICT_ACTORS: HashMap<ActorKey, ActorPages> = HashMap::with_max_entries(MAX_ACTORS, 0);

/// Per kind: evictions whose actor did not fit in `EVICT_ACTORS`.
#[map]
pub static EVICT_OVERFLOW: Array<ActorPages> = Array::with_max_entries(N_KINDS, 0);

#[map]
pub static EVICT_STATS: Array<u64> = Array::with_max_entries(N_STATS, 0);

/// Pages per kind, cumulative (read at each token mark).
#[map]
pub static EVICT_KIND_PAGES: Array<u64> = Array::with_max_entries(N_KINDS, 0);

/// Evicted pages not added back yet, per block of the file (refaults).
#[map]
pub static EVICT_REMEMBER: HashMap<u64, Remembered> = HashMap::with_max_entries(MAX_REMEMBERED, NO_PREALLOC);

/// Pages added back to the page cache after an eviction, per kind of the eviction.
#[map]
pub static EVICT_REFAULTS: Array<u64> = Array::with_max_entries(N_KINDS, 0);

/// TID → the open fault of an observed thread that refaulted a page.
#[map]
pub static EVICT_REFAULT_OPEN: HashMap<u32, RefaultFault> = HashMap::with_max_entries(MAX_WINDOWS, 0);

/// Per kind of the eviction: refault faults closed, and their `fault_io` ns.
#[map]
pub static EVICT_REFAULT_FAULTS: Array<u64> = Array::with_max_entries(N_KINDS, 0);
#[map]
pub static EVICT_REFAULT_IO: Array<u64> = Array::with_max_entries(N_KINDS, 0);

/// Per churn interval: refault faults whose first refaulted page is in it, and their `fault_io`.
#[map]
pub static EVICT_REFAULT_CELLS: Array<RefaultCost> = Array::with_max_entries(MAX_INTERVALS, BPF_F_MMAPABLE);

/// Bits `lo..hi` of a u64 (`hi <= 64`).
#[inline(always)]
fn bits(lo: u64, hi: u64) -> u64 {
    let n = hi - lo;
    if n >= 64 { u64::MAX } else { ((1u64 << n) - 1) << (lo & 63) }
}

/// The block `b`'s part of pages `[index, end)`: `(lo, hi)` within the block.
#[inline(always)]
fn span(b: u64, index: u64, end: u64) -> (u64, u64) {
    let base = b * BLOCK_PAGES;
    let lo = if index > base { index - base } else { 0 };
    let hi = if end < base + BLOCK_PAGES { end - base } else { BLOCK_PAGES };
    (lo, hi)
}

/// Set bits `m` of `*p` when `on`, else clear them (atomically).
#[inline(always)]
fn set_bits(p: *mut u64, m: u64, on: bool) {
    // SAFETY: `p` is an aligned u64 of a map value.
    unsafe {
        if on {
            atomic_fetch_or(p, m);
        } else {
            atomic_fetch_and(p, !m);
        }
    }
}

/// Bits set in `x` (no loop: the verifier walks none).
#[inline(always)]
fn popcount(x: u64) -> u64 {
    let x = x - ((x >> 1) & 0x5555_5555_5555_5555);
    let x = (x & 0x3333_3333_3333_3333) + ((x >> 2) & 0x3333_3333_3333_3333);
    let x = (x + (x >> 4)) & 0x0f0f_0f0f_0f0f_0f0f;
    x.wrapping_mul(0x0101_0101_0101_0101) >> 56
}

/// Remember pages `[index, index + pages)` as evicted by `kind`.
#[inline(always)]
pub fn remember(index: u64, pages: u64, kind: u32) {
    let end = index.saturating_add(pages);
    let mut b = index / BLOCK_PAGES;
    // Made once: zeroing a value is a loop the verifier walks at each use.
    let zero = Remembered::default();
    for _ in 0..MAX_FOLIO_BLOCKS {
        if b * BLOCK_PAGES >= end {
            return;
        }
        let (lo, hi) = span(b, index, end);
        let m = bits(lo, hi);
        let p = match EVICT_REMEMBER.get_ptr_mut(&b) {
            Some(p) => Some(p),
            None => {
                let _ = EVICT_REMEMBER.insert(&b, &zero, BPF_NOEXIST as u64);
                EVICT_REMEMBER.get_ptr_mut(&b)
            }
        };
        match p {
            Some(p) => {
                // The kind first, then the page: a refault that sees the page sees its kind.
                // SAFETY: fields of a map value.
                unsafe {
                    set_bits(&raw mut (*p).kind[0], m, kind & 1 != 0);
                    set_bits(&raw mut (*p).kind[1], m, kind & 2 != 0);
                    set_bits(&raw mut (*p).kind[2], m, kind & 4 != 0);
                    atomic_fetch_or(&raw mut (*p).evicted, m);
                }
            }
            None => not_remembered(hi - lo),
        }
        b += 1;
    }
    let from = if index > b * BLOCK_PAGES { index } else { b * BLOCK_PAGES };
    if end > from {
        not_remembered(end - from);
    }
}

#[inline(always)]
fn not_remembered(pages: u64) {
    if let Some(s) = EVICT_STATS.get_ptr_mut(S_NOT_REMEMBERED) {
        atomic_add(s, pages);
    }
}

/// Pages `[index, index + pages)` were added to the page cache: count the remembered ones as
/// refaults of the kind that evicted them, and forget them.
#[inline(always)]
pub fn refault(index: u64, pages: u64) {
    if enabled().is_none() {
        return;
    }
    let end = index.saturating_add(pages);
    let mut b = index / BLOCK_PAGES;
    let mut first = N_KINDS;
    let mut first_page = 0;
    for _ in 0..MAX_FOLIO_BLOCKS {
        if b * BLOCK_PAGES >= end {
            break;
        }
        let (lo, hi) = span(b, index, end);
        let m = bits(lo, hi);
        if let Some(p) = EVICT_REMEMBER.get_ptr_mut(&b) {
            // SAFETY: fields of a map value.
            let hit = unsafe { atomic_fetch_and(&raw mut (*p).evicted, !m) } & m;
            if hit != 0 {
                // SAFETY: as above.
                let planes = unsafe { [(*p).kind[0], (*p).kind[1], (*p).kind[2]] };
                for k in 0..N_KINDS {
                    let mut of_k = hit;
                    for (j, plane) in planes.iter().enumerate() {
                        of_k &= if (k >> j) & 1 != 0 { *plane } else { !*plane };
                    }
                    let n = popcount(of_k);
                    if n > 0 && first == N_KINDS {
                        first = k;
                        // Its lowest page of this kind: the bits below the lowest set bit.
                        first_page = b * BLOCK_PAGES + popcount((of_k & of_k.wrapping_neg()) - 1);
                    }
                    if n > 0
                        && let Some(c) = EVICT_REFAULTS.get_ptr_mut(k)
                    {
                        atomic_add(c, n);
                    }
                }
            }
        }
        b += 1;
    }
    if first < N_KINDS {
        refault_in_fault(first, first_page);
    }
}

/// Page `page`, evicted by `kind`, came back: when the current task is an observed thread inside a
/// page fault, that fault is a refault fault of `kind` and of `page`'s churn interval (its first
/// one; rule in `observer_common::evict`).
#[inline(always)]
fn refault_in_fault(kind: u32, page: u64) {
    let Some(tid) = target_tid() else { return };
    let Some(s) = state_of(tid) else { return };
    // SAFETY: as below.
    let (flags, open) = unsafe { ((*s).flags, (*s).fault_start) };
    // Outside a fault (an explicit read, another task's read-ahead) nothing below applies:
    // return before the clock read (issue 19: a one-page refault storm of reads).
    if flags & F_FAULT_UNTIMED == 0 && open == 0 {
        return;
    }
    // SAFETY: helper without preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    if flags & F_FAULT_UNTIMED != 0 {
        // Bringing back an evicted page is no plain minor fault: timed from here.
        update(s, |s| s.slow(now));
    }
    // SAFETY: the current thread's own state, read in its own context (only its events and marks
    // write it; a mark only closes the interval, which the pending part below counts the same).
    let (start, io_at) = unsafe {
        let s = &*s;
        if s.fault_start == 0 {
            return;
        }
        let pending = if s.current_component() == T_FAULT_IO && now > s.last_ts { now - s.last_ts } else { 0 };
        (s.fault_start, s.time[T_FAULT_IO] + pending)
    };
    // SAFETY: plain map lookup.
    if let Some(o) = unsafe { EVICT_REFAULT_OPEN.get(&tid) }
        && o.fault_start == start
    {
        return;
    }
    let Some(cfg) = FILEMAP_CONFIG.get(0) else { return };
    let interval = find(cfg, page);
    let v = RefaultFault { fault_start: start, io_at, kind, interval };
    if EVICT_REFAULT_OPEN.insert(&tid, &v, 0).is_err() {
        if let Some(s) = EVICT_STATS.get_ptr_mut(S_REFAULT_FAULT_LOST) {
            atomic_add(s, 1);
        }
        return;
    }
    // The fault's exit closes the record (`fault_closed`) only when this says there is one.
    update(s, |s| s.flags |= F_FAULT_REFAULT);
}

/// The fault that started at `start` closed with the thread's `fault_io` at `io_now`: when it was
/// a refault fault, charge its `fault_io` to the kind.
#[inline(always)]
pub fn fault_closed(tid: u32, start: u64, io_now: u64) {
    // SAFETY: plain map lookup.
    let Some(o) = (unsafe { EVICT_REFAULT_OPEN.get(&tid) }) else { return };
    let (fs, at, kind, interval) = (o.fault_start, o.io_at, o.kind, o.interval);
    let _ = EVICT_REFAULT_OPEN.remove(&tid);
    if fs != start || start == 0 {
        return;
    }
    let io = io_now.saturating_sub(at);
    if let Some(c) = EVICT_REFAULT_FAULTS.get_ptr_mut(kind) {
        atomic_add(c, 1);
    }
    if io > 0
        && let Some(c) = EVICT_REFAULT_IO.get_ptr_mut(kind)
    {
        atomic_add(c, io);
    }
    if let Some(c) = EVICT_REFAULT_CELLS.get_ptr_mut(interval) {
        // SAFETY: aligned u64 fields of a map value, updated from any CPU.
        unsafe {
            atomic_add(&raw mut (*c).faults, 1);
            if io > 0 {
                atomic_add(&raw mut (*c).io_ns, io);
            }
        }
    }
}

#[inline(always)]
fn enabled() -> Option<&'static EvictConfig> {
    EVICT_CONFIG.get(0).filter(|c| c.enabled != 0)
}

#[inline(always)]
fn starts_with(comm: &[u8; 16], prefix: &[u8]) -> bool {
    let mut i = 0;
    while i < prefix.len() && i < 16 {
        if comm[i] != prefix[i] {
            return false;
        }
        i += 1;
    }
    true
}

/// The system call the current task is in, from its saved user registers.
#[inline(always)]
fn current_syscall(cfg: &EvictConfig) -> u32 {
    if cfg.syscall_off == NO_FIELD {
        return NO_SYSCALL;
    }
    // SAFETY: helpers without preconditions; the register block is read with
    // `bpf_probe_read_kernel`, which tolerates any address.
    unsafe {
        let task = bpf_get_current_task_btf();
        let regs = bpf_task_pt_regs(task) as u64;
        if regs == 0 {
            return NO_SYSCALL;
        }
        match bpf_probe_read_kernel((regs + cfg.syscall_off as u64) as *const i64) {
            Ok(word) => cfg.syscall_nr(word),
            Err(_) => NO_SYSCALL,
        }
    }
}

/// The counters of the current task as an evictor (created on first sight; the kind's overflow
/// row when the table is full), and its kind. `None` when blame is off.
#[inline(always)]
pub fn actor() -> Option<(*mut ActorPages, u32)> {
    let cfg = enabled()?;
    let id = bpf_get_current_pid_tgid();
    let tid = id as u32;
    let comm = bpf_get_current_comm().unwrap_or([0; 16]);
    let mut syscall = NO_SYSCALL;
    // SAFETY: plain map lookup.
    let kind = if let Some(k) = unsafe { EVICT_WINDOWS.get(&tid) } {
        syscall = current_syscall(cfg);
        *k
    } else if starts_with(&comm, b"kswapd") {
        K_KSWAPD
    } else if starts_with(&comm, b"kdamond") {
        K_PROACTIVE
    } else {
        syscall = current_syscall(cfg);
        match EVICT_SYSCALLS.get(syscall) {
            Some(&k) if k != 0 => k - 1,
            _ => K_OTHER,
        }
    };
    let key = ActorKey {
        kind,
        tgid: (id >> 32) as u32,
        syscall,
        _pad: 0,
        // SAFETY: helper without preconditions.
        cgroup: unsafe { bpf_get_current_cgroup_id() },
        comm,
    };
    if let Some(p) = EVICT_ACTORS.get_ptr_mut(&key) {
        return Some((p, kind));
    }
    // A concurrent insert of the same key fails with EEXIST; the lookup then finds it.
    let _ = EVICT_ACTORS.insert(&key, &ActorPages::default(), BPF_NOEXIST as u64);
    EVICT_ACTORS.get_ptr_mut(&key).or_else(|| EVICT_OVERFLOW.get_ptr_mut(kind)).map(|p| (p, kind))
}

/// Count one eviction event of `pages` pages at `index` for the actor of kind `kind`, and
/// remember them for refaults.
#[inline(always)]
pub fn kind_pages(kind: u32, index: u64, pages: u64) {
    if let Some(p) = EVICT_KIND_PAGES.get_ptr_mut(kind) {
        atomic_add(p, pages);
    }
    remember(index, pages, kind);
}

/// Count one eviction event of `a`.
#[inline(always)]
pub fn event(a: *mut ActorPages) {
    // SAFETY: a map value of `EVICT_ACTORS` or `EVICT_OVERFLOW`.
    atomic_add(unsafe { &raw mut (*a).events }, 1);
}

/// Count `pages` of interval `i` for `a`.
#[inline(always)]
pub fn pages(a: *mut ActorPages, i: u32, pages: u64) {
    let class = EVICT_CLASS.get(i).copied().unwrap_or(0) as usize & (N_CLASSES - 1);
    // SAFETY: as above; `class < N_CLASSES`.
    atomic_add(unsafe { (&raw mut (*a).pages).cast::<u64>().add(class) }, pages);
}

/// Count `pages` that the walk did not place in an interval.
#[inline(always)]
pub fn spill(a: *mut ActorPages, pages: u64) {
    // SAFETY: as above.
    atomic_add(unsafe { &raw mut (*a).spill }, pages);
}

#[inline(always)]
fn window(kind: Option<u32>) -> u32 {
    if enabled().is_none() {
        return 0;
    }
    let tid = bpf_get_current_pid_tgid() as u32;
    match kind {
        Some(k) => {
            if EVICT_WINDOWS.insert(&tid, &k, 0).is_err()
                && let Some(p) = EVICT_STATS.get_ptr_mut(S_WINDOW_LOST)
            {
                atomic_add(p, 1);
            }
        }
        None => {
            let _ = EVICT_WINDOWS.remove(&tid);
        }
    }
    0
}

#[tracepoint]
pub fn evict_direct_begin(_ctx: TracePointContext) -> u32 {
    window(Some(K_DIRECT))
}

#[tracepoint]
pub fn evict_memcg_begin(_ctx: TracePointContext) -> u32 {
    window(Some(K_MEMCG))
}

#[tracepoint]
pub fn evict_reclaim_end(_ctx: TracePointContext) -> u32 {
    window(None)
}
