//! Token boundaries: uprobes on the engine's marker functions
//! (`moe_engine_token_begin(index, record)` / `moe_engine_token_end(index,
//! record)`), or a uprobe/uretprobe pair on any function (`--token-symbol`, or
//! every decode entry point of an engine profile). Calls nest: only the
//! outermost call of a thread marks (`CALL_DEPTH`), so entry points that call
//! one another are not counted twice; its entry reads the step's token count
//! by the rule in its attach cookie (`observer_common::attrib::call_arg`).
//!
//! At a mark, every tracked thread's state is copied first, the marking
//! thread's last, then the mark's instant is read (so that no copy is newer
//! than the mark; the marking thread's copy and the instant are retaken if a
//! switch of that thread fell between them, see `emit_current`). Each copy (checking its update
//! sequence, so torn copies are retried, `COPY_ATTEMPTS` in all, and then counted as lost and
//! as torn) and
//! sent as a `ThreadRecord`; then one `MarkRecord` (with a copy of the
//! engine's per-token record at `end`, `moe_abi::markers`). User space closes each copy at the
//! mark's instant (`ThreadState::account`) and subtracts consecutive marks.
//! The mark's record wakes the reader only once an eighth of the ring is unread
//! (`maps::batch_wakeup`); otherwise user space polls. Minimum kernel: 5.8 (ring buffer).

use core::{
    ptr::{addr_of, addr_of_mut, read_volatile},
    sync::atomic::{Ordering, compiler_fence},
};

use aya_ebpf::{
    EbpfContext,
    helpers::{bpf_get_current_pid_tgid, bpf_ktime_get_ns, bpf_probe_read_user_buf, generated::bpf_get_attach_cookie},
    macros::{uprobe, uretprobe},
    programs::{ProbeContext, RetProbeContext},
};
use observer_common::{
    GlobalCounter,
    attrib::{MAX_SLOTS, MarkRecord, PHASE_BEGIN, PHASE_END, REC_MARK, REC_THREAD, SEQ_CLOSED, ThreadRecord, call_arg},
};

use observer_common::{
    evict::N_KINDS,
    filemap::{T_ADD_PAGES, T_DEL_PAGES},
};

use crate::maps::{
    BPF_RB_NO_WAKEUP, CALL_DEPTH, COUNTERS, EVENTS, MARK_LOST, MARK_N_TOKENS, SEQS, SLOTS, THREADS, batch_wakeup, bump,
    is_target, target_tid,
};
use crate::{
    evict::{EVICT_KIND_PAGES, EVICT_REFAULT_FAULTS, EVICT_REFAULT_IO, EVICT_REFAULTS},
    filemap::FILEMAP_TOTALS,
    xread::XREAD_TOTALS,
};
use observer_common::xread::N_TOTALS as XREAD_N;

/// Attempts at a whole copy of another thread's state. An update on another CPU takes well under
/// a microsecond, and an attempt about 50 ns; a copy torn through every attempt (an interrupt, or
/// on a VM a vCPU the host preempted, in the middle of an update) is counted as `TornCopies`, and
/// lost.
const COPY_ATTEMPTS: usize = 2;

/// Copy slot `i` into the ring buffer; false when it could not be sent.
#[inline(always)]
fn emit_thread(i: u32, phase: u32, mark_seq: u64) -> bool {
    let Some(t) = THREADS.get_ptr(i) else { return false };
    let Some(mut e) = EVENTS.reserve::<ThreadRecord>(0) else { return false };
    let r = e.as_mut_ptr();
    let mut ok = false;
    for _ in 0..COPY_ATTEMPTS {
        // SAFETY: `t` is a map value, `r` a reserved ring-buffer record of the right size.
        unsafe {
            let s1 = read_volatile(addr_of!((*t).seq));
            compiler_fence(Ordering::SeqCst);
            core::ptr::copy_nonoverlapping(t, addr_of_mut!((*r).state), 1);
            compiler_fence(Ordering::SeqCst);
            let s2 = read_volatile(addr_of!((*t).seq));
            if s1 == s2 && s1 & 1 == 0 {
                ok = true;
                break;
            }
        }
    }
    if !ok {
        e.discard(0);
        bump(GlobalCounter::TornCopies);
        return false;
    }
    // SAFETY: as above.
    unsafe {
        (*r).kind = REC_THREAD;
        (*r).phase = phase;
        (*r).mark_seq = mark_seq;
    }
    // Closing the copy at the mark's instant (`ThreadState::account`) is left
    // to user space: its branches, unrolled over every slot, would exceed the
    // verifier's budget.
    e.submit(BPF_RB_NO_WAKEUP);
    true
}

/// The marking thread's own copy, and the mark's instant read right after it
/// with no scheduling event of that thread in between. A uprobe program is
/// preemptible: had the thread been switched out and back in between its
/// copy and the instant, the copy would say "on CPU" for the time it waited
/// on the run queue, and the next token would get that wait as runqueue and
/// lose it from compute. Its update sequence (bumped by every switch) proves
/// there was none; else copy and instant are taken again. Returns the instant.
#[inline(always)]
fn emit_current(i: u32, phase: u32, mark_seq: u64) -> Option<u64> {
    let t = THREADS.get_ptr(i)?;
    let mut e = EVENTS.reserve::<ThreadRecord>(0)?;
    let r = e.as_mut_ptr();
    for _ in 0..4 {
        // SAFETY: `t` is a map value and `r` a reserved record of its type.
        unsafe {
            let s1 = read_volatile(addr_of!((*t).seq));
            compiler_fence(Ordering::SeqCst);
            core::ptr::copy_nonoverlapping(t, addr_of_mut!((*r).state), 1);
            compiler_fence(Ordering::SeqCst);
            let now = bpf_ktime_get_ns();
            let s2 = read_volatile(addr_of!((*t).seq));
            if s1 == s2 && s1 & 1 == 0 {
                (*r).kind = REC_THREAD;
                (*r).phase = phase;
                (*r).mark_seq = mark_seq;
                e.submit(BPF_RB_NO_WAKEUP);
                return Some(now);
            }
        }
    }
    e.discard(0);
    bump(GlobalCounter::TornCopies);
    None
}

#[inline(always)]
fn mark(phase: u32, index: u64, engine_rec: u64, n_tokens: Option<u32>) -> u32 {
    if let Some(v) = MARK_N_TOKENS.get_ptr_mut(0) {
        // SAFETY: per-CPU scratch.
        unsafe { *v = n_tokens.map(|n| (1u64 << 32) | n as u64).unwrap_or(0) };
    }
    mark_inner(phase, index, engine_rec)
}

#[inline(always)]
fn mark_inner(phase: u32, index: u64, engine_rec: u64) -> u32 {
    let id = bpf_get_current_pid_tgid();
    if !is_target((id >> 32) as u32) {
        return 0;
    }
    // The snapshot begins: from now on no event charges a context it decides late to time
    // before this instant (`attrib`, "Closed time stays closed"). A plain store: two marks at
    // once may leave the earlier instant, off by their overlap.
    if let Some(c) = SEQS.get_ptr_mut(SEQ_CLOSED) {
        // SAFETY: map value, one 8-byte store; helper without preconditions.
        unsafe { core::ptr::write_volatile(c, bpf_ktime_get_ns()) };
    }
    let Some(seqs) = SEQS.get_ptr_mut(1) else { return 0 };
    // SAFETY: only the marking thread writes this slot.
    let mark_seq = unsafe {
        *seqs += 1;
        *seqs
    };
    // SAFETY: map value read.
    let used = SEQS.get(0).map(|v| *v).unwrap_or(0);
    let n = if used > MAX_SLOTS as u64 { MAX_SLOTS } else { used as u32 };
    // Counts live in a map, not in registers: distinct register values per
    // path would multiply the states the verifier has to walk per slot.
    if let Some(l) = MARK_LOST.get_ptr_mut(0) {
        // SAFETY: per-CPU scratch.
        unsafe { *l = 0 };
    }
    // The marking thread itself goes last (see `emit_current`): the others
    // are taken in slot order starting after it, wrapping around. No branch
    // on the slot inside the loop, which would double the verifier's states
    // per slot. (A marking thread without a slot yet: slot 0 goes last.)
    // SAFETY: plain map lookup.
    let cur = unsafe { SLOTS.get(&(id as u32)).map(|v| *v) }.unwrap_or(0);
    let cur = if cur < n { cur } else { 0 };
    let others = if n > 0 { n - 1 } else { 0 };
    for j in 0..MAX_SLOTS {
        if j >= others {
            break;
        }
        let i = (cur + 1 + j) % n;
        if !emit_thread(i, phase, mark_seq)
            && let Some(l) = MARK_LOST.get_ptr_mut(0)
        {
            // SAFETY: per-CPU scratch.
            unsafe { *l += 1 };
        }
    }
    // The mark's instant is taken after every thread was copied: no copy can
    // then hold a `last_ts` later than it, so closing each copy at this instant
    // (in user space) never has to undo time a thread accounted after it.
    let mut now = 0u64;
    if n > 0 {
        if let Some(t) = emit_current(cur, phase, mark_seq) {
            now = t;
        } else if let Some(l) = MARK_LOST.get_ptr_mut(0) {
            // SAFETY: per-CPU scratch.
            unsafe { *l += 1 };
        }
    }
    if now == 0 {
        // SAFETY: helper without preconditions.
        now = unsafe { bpf_ktime_get_ns() };
    }
    // SAFETY: per-CPU scratch.
    let lost = MARK_LOST.get(0).map(|v| *v).unwrap_or(0) as u32;
    // The threads not copied are lost whether or not the mark's own record can be sent.
    if lost > 0
        && let Some(c) = COUNTERS.get_ptr_mut(GlobalCounter::LostEvents as u32)
    {
        // SAFETY: per-CPU slot.
        unsafe { *c += lost as u64 };
    }
    let Some(mut e) = EVENTS.reserve::<MarkRecord>(0) else {
        bump(GlobalCounter::LostEvents);
        return 0;
    };
    let r = e.as_mut_ptr();
    // SAFETY: reserved record of the right size.
    unsafe {
        (*r).kind = REC_MARK;
        (*r).phase = phase;
        (*r).mark_seq = mark_seq;
        (*r).ts = now;
        (*r).index = index;
        (*r).n_threads = n - lost.min(n);
        (*r).n_lost = lost;
        (*r).tid = id as u32;
        (*r).has_engine = 0;
        let n = MARK_N_TOKENS.get(0).map(|v| read_volatile(v)).unwrap_or(0);
        (*r).n_tokens = n as u32;
        (*r).n_tokens_known = (n >> 32) as u32;
        (*r).churn_added = FILEMAP_TOTALS.get(T_ADD_PAGES).map(|v| read_volatile(v)).unwrap_or(0);
        // The kinds before the total: Σ kinds ≤ total at the mark (`observer_common::evict`).
        for k in 0..N_KINDS {
            (*r).churn_evicted_by[k as usize] = EVICT_KIND_PAGES.get(k).map(|v| read_volatile(v)).unwrap_or(0);
        }
        for k in 0..N_KINDS {
            let i = k as usize;
            (*r).churn_refaulted_by[i] = EVICT_REFAULTS.get(k).map(|v| read_volatile(v)).unwrap_or(0);
            (*r).churn_refault_faults[i] = EVICT_REFAULT_FAULTS.get(k).map(|v| read_volatile(v)).unwrap_or(0);
            (*r).churn_refault_io_ns[i] = EVICT_REFAULT_IO.get(k).map(|v| read_volatile(v)).unwrap_or(0);
        }
        (*r).churn_evicted = FILEMAP_TOTALS.get(T_DEL_PAGES).map(|v| read_volatile(v)).unwrap_or(0);
        for i in 0..XREAD_N {
            (*r).xread[i] = XREAD_TOTALS.get(i as u32).map(|v| read_volatile(v)).unwrap_or(0);
        }
        // Exactly the engine's record (`ENGINE_REC_BYTES` is its size in `moe_abi`): a byte more
        // could lie on an unmapped page and fail the whole copy.
        if engine_rec != 0 && bpf_probe_read_user_buf(engine_rec as *const u8, &mut *addr_of_mut!((*r).engine)).is_ok()
        {
            (*r).has_engine = 1;
        }
    }
    // The mark's record ends its batch: it wakes the reader once the ring fills (`batch_wakeup`).
    e.submit(batch_wakeup());
    0
}

/// `moe_engine_token_begin(u64 index, const record *rec)`.
#[uprobe]
pub fn mark_begin(ctx: ProbeContext) -> u32 {
    let index: u64 = ctx.arg(0).unwrap_or(0);
    mark(PHASE_BEGIN, index, 0, None)
}

/// `moe_engine_token_end(u64 index, const record *rec)`: the record is complete.
#[uprobe]
pub fn mark_end(ctx: ProbeContext) -> u32 {
    let index: u64 = ctx.arg(0).unwrap_or(0);
    let rec: u64 = ctx.arg(1).unwrap_or(0);
    mark(PHASE_END, index, rec, None)
}

/// Integer argument `n` (0-based) at a probe's entry (x86-64's registers, as
/// `STACK_I32`). All six are read, each at its own constant offset, and one is
/// chosen after: `ctx.arg(n)` with a run-time `n` compiles to one load at a
/// computed offset of the context, which the verifier refuses.
#[cfg(bpf_target_arch = "x86_64")]
#[inline(always)]
fn int_arg(ctx: &ProbeContext, n: u8) -> Option<u64> {
    let r = ctx.regs;
    // SAFETY: `regs` is the probe's register frame; volatile reads are neither merged nor moved.
    let a = unsafe {
        [
            read_volatile(addr_of!((*r).rdi)),
            read_volatile(addr_of!((*r).rsi)),
            read_volatile(addr_of!((*r).rdx)),
            read_volatile(addr_of!((*r).rcx)),
            read_volatile(addr_of!((*r).r8)),
            read_volatile(addr_of!((*r).r9)),
        ]
    };
    match n {
        0 => Some(a[0]),
        1 => Some(a[1]),
        2 => Some(a[2]),
        3 => Some(a[3]),
        4 => Some(a[4]),
        5 => Some(a[5]),
        _ => None,
    }
}

/// [`int_arg`] on aarch64: x0..x5 of `user_pt_regs`.
#[cfg(bpf_target_arch = "aarch64")]
#[inline(always)]
fn int_arg(ctx: &ProbeContext, n: u8) -> Option<u64> {
    let r = ctx.regs as *const aya_ebpf::bindings::user_pt_regs;
    // SAFETY: `regs` is the probe's register frame; volatile reads are neither merged nor moved.
    let a = unsafe {
        [
            read_volatile(addr_of!((*r).regs[0])),
            read_volatile(addr_of!((*r).regs[1])),
            read_volatile(addr_of!((*r).regs[2])),
            read_volatile(addr_of!((*r).regs[3])),
            read_volatile(addr_of!((*r).regs[4])),
            read_volatile(addr_of!((*r).regs[5])),
        ]
    };
    a.get(n as usize).copied()
}

/// Other architectures: no register rule (the user side asks for none there).
#[cfg(not(any(bpf_target_arch = "x86_64", bpf_target_arch = "aarch64")))]
#[inline(always)]
fn int_arg(_ctx: &ProbeContext, _n: u8) -> Option<u64> {
    None
}

/// The step's token count by the rule of this attachment's cookie.
#[inline(always)]
fn call_n_tokens(ctx: &ProbeContext) -> Option<u32> {
    // SAFETY: the helper only reads the attach cookie of the running program.
    let cookie = unsafe { bpf_get_attach_cookie(ctx.as_ptr()) };
    match call_arg::split(cookie).0 {
        call_arg::STACK_I32 | call_arg::PTR_I32 => {
            let addr = call_arg::i32_address(cookie, |n| int_arg(ctx, n), stack_pointer(ctx))?;
            // SAFETY: a checked read of the target's memory.
            let n: i32 = unsafe { aya_ebpf::helpers::bpf_probe_read_user(addr as *const i32) }.ok()?;
            if n >= 0 { Some(n as u32) } else { None }
        }
        call_arg::PTR_VEC_LEN => {
            let v = call_arg::VecLen::from_cookie(cookie);
            let base = int_arg(ctx, v.arg)?;
            // SAFETY: checked reads of the target's memory.
            let p = unsafe { aya_ebpf::helpers::bpf_probe_read_user((base + v.vec_offset as u64) as *const [u64; 3]) }
                .ok()?;
            let bound = match v.bound_offset {
                // SAFETY: as above.
                Some(off) => {
                    Some(unsafe { aya_ebpf::helpers::bpf_probe_read_user((base + off as u64) as *const u64) }.ok()?)
                }
                None => None,
            };
            v.count(p[0], p[1], p[2], bound)
        }
        _ => None,
    }
}

/// The probed thread's stack pointer at entry (`STACK_I32`).
#[cfg(bpf_target_arch = "x86_64")]
#[inline(always)]
fn stack_pointer(ctx: &ProbeContext) -> u64 {
    // SAFETY: `regs` is the probe's register frame (x86-64's `pt_regs`).
    unsafe { read_volatile(addr_of!((*ctx.regs).rsp)) }
}

/// [`stack_pointer`] on aarch64: `sp` of `user_pt_regs`.
#[cfg(bpf_target_arch = "aarch64")]
#[inline(always)]
fn stack_pointer(ctx: &ProbeContext) -> u64 {
    let r = ctx.regs as *const aya_ebpf::bindings::user_pt_regs;
    // SAFETY: `regs` is the probe's register frame.
    unsafe { read_volatile(addr_of!((*r).sp)) }
}

/// Other architectures: no stack rule (the user side asks for none there); 0 reads nothing.
#[cfg(not(any(bpf_target_arch = "x86_64", bpf_target_arch = "aarch64")))]
#[inline(always)]
fn stack_pointer(_ctx: &ProbeContext) -> u64 {
    0
}

/// Entry of a probed call (`--token-symbol`, a profile's entry point): index =
/// marks so far / 2. Only the thread's outermost call marks.
#[uprobe]
pub fn call_begin(ctx: ProbeContext) -> u32 {
    let Some(tid) = target_tid() else { return 0 };
    // SAFETY: plain map lookup.
    let depth = unsafe { CALL_DEPTH.get(&tid).map(|v| *v) }.unwrap_or(0);
    if CALL_DEPTH.insert(&tid, &(depth + 1), 0).is_err() || depth > 0 {
        return 0;
    }
    let n = SEQS.get(1).map(|v| *v).unwrap_or(0);
    mark(PHASE_BEGIN, n / 2, 0, call_n_tokens(&ctx))
}

#[uretprobe]
pub fn call_end(_ctx: RetProbeContext) -> u32 {
    let tid = bpf_get_current_pid_tgid() as u32;
    // SAFETY: plain map lookup.
    let depth = unsafe { CALL_DEPTH.get(&tid).map(|v| *v) }.unwrap_or(0);
    if depth == 0 {
        return 0; // its entry was not seen
    }
    if depth > 1 {
        let _ = CALL_DEPTH.insert(&tid, &(depth - 1), 0);
        return 0;
    }
    let _ = CALL_DEPTH.remove(&tid);
    let n = SEQS.get(1).map(|v| *v).unwrap_or(0);
    mark(PHASE_END, n / 2, 0, None)
}
