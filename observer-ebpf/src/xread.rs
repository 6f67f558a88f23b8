//! Explicit reads of the model file per region (rule and layout: `observer_common::xread`).
//!
//! Driven from the syscall programs (`syscalls`): [`enter`] keeps a read's `fd` and offset (read
//! from the call's registers), [`exit`] charges its returned bytes to the churn interval of its
//! middle byte (found through churn's bucket index, `filemap::find`; `EVICT_CLASS` for its kind).
//! Off (`XREAD_CONFIG.enabled` 0) until user space has the churn intervals and their index in
//! place. Per read: one array lookup at entry for the role, at exit a hash lookup of the fd's
//! verdict, and for a model-file read the index entry and `log2(index_span)` search steps; a
//! ring-buffer record only for a read of a routed expert (asking whether to wake the reader only
//! every `QUERY_EVERY`th time).

use aya_ebpf::{
    helpers::bpf_probe_read_kernel,
    macros::map,
    maps::{Array, HashMap},
};
use observer_common::{
    attrib::{MAX_SLOTS, REC_FD, REC_READ},
    xread::{
        FD_MODEL, FD_PENDING, FdQuery, K_EXPERTS, K_OTHER, MAX_FDS, MAX_SYSCALL, N_TOTALS, QUERY_EVERY, R_CLOSE, R_DUP,
        R_OPEN, R_PREAD, R_READ, ReadOpen, ReadRecord, T_BYTES, T_CALLS, T_LOST_BYTES, T_LOST_EVENTS, T_NS,
        T_UNRESOLVED_BYTES, T_UNRESOLVED_CALLS, XreadConfig, fd_key, kind_of_class,
    },
};

use crate::{
    evict::EVICT_CLASS,
    filemap::{FILEMAP_CONFIG, find},
    maps::{BPF_RB_FORCE_WAKEUP, BPF_RB_NO_WAKEUP, EVENTS, EVENTS_BYTES, atomic_add, batch_wakeup},
};

// The lateness `QUERY_EVERY` allows the wake rule: every thread's records since its last query,
// each with the ring's 8-byte header, fit in an eighth of the ring beyond the eighth that wakes.
const _: () = assert!(
    MAX_SLOTS as usize * QUERY_EVERY as usize * (core::mem::size_of::<ReadRecord>() + 8) <= EVENTS_BYTES as usize / 8
);

#[map]
pub static XREAD_CONFIG: Array<XreadConfig> = Array::with_max_entries(1, 0);

/// System call number → role (`R_*`, 0: none).
#[map]
pub static XREAD_ROLES: Array<u32> = Array::with_max_entries(MAX_SYSCALL, 0);

/// `fd_key(tgid, fd)` → verdict (`FD_*`), written by user space (and `FD_PENDING` here).
#[map]
pub static XREAD_FDS: HashMap<u64, u32> = HashMap::with_max_entries(MAX_FDS, 0);

/// The read or open in progress of the thread at each slot of `THREADS` (`role` 0: none).
#[map]
pub static XREAD_OPEN: Array<ReadOpen> = Array::with_max_entries(MAX_SLOTS, 0);

/// Cumulative totals (`xread::T_*`), copied by every mark.
#[map]
pub static XREAD_TOTALS: Array<u64> = Array::with_max_entries(N_TOTALS as u32, 0);

#[inline(always)]
fn total_add(i: usize, v: u64) {
    if let Some(p) = XREAD_TOTALS.get_ptr_mut(i as u32) {
        atomic_add(p, v);
    }
}

#[inline(always)]
fn config() -> Option<&'static XreadConfig> {
    let c = XREAD_CONFIG.get(0)?;
    if c.enabled == 0 { None } else { Some(c) }
}

/// Argument `i` (0–3) of the system call whose registers are at `regs` (`XreadConfig::arg_regs`).
#[inline(always)]
fn arg(regs: u64, cfg: &XreadConfig, i: usize) -> u64 {
    let off = cfg.arg_regs[i & 3] as u64;
    // SAFETY: reads a kernel address through the helper, which fails cleanly on a bad one.
    unsafe { bpf_probe_read_kernel((regs + off) as *const u64) }.unwrap_or(0)
}

/// Ask user space for the verdict of `fd` of the current process, once.
#[inline(always)]
fn query(tgid: u32, fd: u32) {
    if XREAD_FDS.insert(&fd_key(tgid, fd), &FD_PENDING, 0).is_err() {
        return;
    }
    if let Some(mut e) = EVENTS.reserve::<FdQuery>(0) {
        // SAFETY: a reserved record of its type.
        unsafe { e.as_mut_ptr().write(FdQuery { kind: REC_FD, tgid, fd, _pad: 0 }) };
        // A question wakes the reader: its answer decides how the next reads are charged.
        e.submit(BPF_RB_FORCE_WAKEUP);
    } else {
        // Nobody will answer: forget it, so that the next read asks again.
        _ = XREAD_FDS.remove(&fd_key(tgid, fd));
    }
}

/// At `sys_enter` of system call `id` by the observed thread at `slot` of `THREADS`, of process
/// `tgid`.
#[inline(always)]
pub fn enter(regs: u64, slot: u32, tgid: u32, id: i64, now: u64) {
    if !(0..MAX_SYSCALL as i64).contains(&id) {
        return;
    }
    let Some(cfg) = config() else { return };
    let role = XREAD_ROLES.get(id as u32).copied().unwrap_or(0);
    if role == 0 {
        return;
    }
    match role {
        R_CLOSE => {
            _ = XREAD_FDS.remove(&fd_key(tgid, arg(regs, cfg, 0) as u32));
        }
        R_DUP => {
            _ = XREAD_FDS.remove(&fd_key(tgid, arg(regs, cfg, 1) as u32));
        }
        R_PREAD | R_READ | R_OPEN => {
            let offset = if role == R_PREAD { arg(regs, cfg, 3) } else { u64::MAX };
            if let Some(p) = XREAD_OPEN.get_ptr_mut(slot) {
                // SAFETY: map value at the thread's slot; only its own syscall events write it.
                unsafe {
                    (*p).fd = arg(regs, cfg, 0) as u32;
                    (*p).role = role;
                    (*p).offset = offset;
                    (*p).start = now;
                }
            }
        }
        _ => {}
    }
}

/// At `sys_exit` of observed thread `tid`, at `slot` of `THREADS`, of process `tgid`.
#[inline(always)]
pub fn exit(ret: i64, tid: u32, slot: u32, tgid: u32, now: u64) {
    let Some(cfg) = config() else { return };
    let Some(p) = XREAD_OPEN.get_ptr_mut(slot) else { return };
    // SAFETY: map value at the thread's slot; only its own syscall events write it. Copied, then
    // closed.
    let open = unsafe { *p };
    if open.role == 0 {
        return;
    }
    // SAFETY: as above.
    unsafe { (*p).role = 0 };
    if ret < 0 {
        return;
    }
    if open.role == R_OPEN {
        // A new descriptor: any old verdict of its number is stale.
        _ = XREAD_FDS.remove(&fd_key(tgid, ret as u32));
        query(tgid, ret as u32);
        return;
    }
    if ret == 0 {
        return;
    }
    let bytes = ret as u64;
    // SAFETY: plain map lookup.
    match unsafe { XREAD_FDS.get(&fd_key(tgid, open.fd)) }.copied() {
        Some(FD_MODEL) => {}
        Some(FD_PENDING) => {
            total_add(T_UNRESOLVED_BYTES, bytes);
            total_add(T_UNRESOLVED_CALLS, 1);
            return;
        }
        Some(_) => return,
        None => {
            total_add(T_UNRESOLVED_BYTES, bytes);
            total_add(T_UNRESOLVED_CALLS, 1);
            query(tgid, open.fd);
            return;
        }
    }
    let mut kind = K_OTHER;
    let mut interval = 0u32;
    if open.offset != u64::MAX
        && let Some(churn) = FILEMAP_CONFIG.get(0)
    {
        let middle = open.offset.saturating_add(bytes / 2);
        interval = find(churn, middle >> (cfg.page_shift & 63));
        kind = kind_of_class(EVICT_CLASS.get(interval).copied().unwrap_or(u32::MAX));
    }
    let kind = kind.min(K_OTHER);
    total_add(T_BYTES + kind, bytes);
    total_add(T_NS + kind, now.saturating_sub(open.start));
    total_add(T_CALLS + kind, 1);
    if kind == K_EXPERTS {
        if let Some(mut e) = EVENTS.reserve::<ReadRecord>(0) {
            // SAFETY: a reserved record of its type.
            unsafe { e.as_mut_ptr().write(ReadRecord { kind: REC_READ, tid, interval, _pad: 0, bytes }) };
            let records = open.records.wrapping_add(1);
            // SAFETY: as above.
            unsafe { (*p).records = records };
            e.submit(if records % QUERY_EVERY == 0 { batch_wakeup() } else { BPF_RB_NO_WAKEUP });
        } else {
            total_add(T_LOST_EVENTS, 1);
            total_add(T_LOST_BYTES, bytes);
        }
    }
}
