//! Page-cache churn of the model file, per region (rule and layout:
//! `observer_common::filemap`).
//!
//! `filemap:mm_filemap_add_to_page_cache` / `mm_filemap_delete_from_page_cache` fire for every
//! file of the system; events not on the configured (device, inode) return after two loads. For
//! the model file the folio's pages are added to the cumulative per-interval counters that user
//! space maps, so heavy thrashing costs no ring-buffer traffic. These programs have their own
//! maps and do not depend on the target filter (`CONFIG`): the page cache is shared by every
//! process. Each eviction is also counted for its actor (`evict`). Minimum kernel: 5.5 (mmapable
//! arrays), 5.15 with BTF for the delete program (`evict`'s system-call rule). On kernels whose
//! format has no `order` field (before large folios in the page cache) every event counts one
//! page.

use core::ptr::{read_volatile, write_volatile};

use aya_ebpf::{
    EbpfContext,
    bindings::BPF_F_MMAPABLE,
    macros::{map, tracepoint},
    maps::{Array, PerCpuArray},
    programs::TracePointContext,
};
use observer_common::filemap::{
    Churn, DIRECT_FIELDS, FilemapConfig, FilemapFields, FilemapScratch, MAX_BUCKETS, MAX_INTERVALS, MAX_SPAN, N_TOTALS,
    NO_FIELD, SEARCH_STEPS, T_ADD_EVENTS, T_ADD_PAGES, T_ADD_SPILL, T_DEL_EVENTS, T_DEL_PAGES, T_DEL_SPILL,
    T_OTHER_DEV, T_OTHER_DEV_LAST,
};

use observer_common::evict::ActorPages;

use crate::{evict, maps::atomic_add};

#[map]
pub static FILEMAP_CONFIG: Array<FilemapConfig> = Array::with_max_entries(1, 0);

/// First page index of each interval, ascending; unused entries are `u64::MAX`.
#[map]
pub static FILEMAP_STARTS: Array<u64> = Array::with_max_entries(MAX_INTERVALS, BPF_F_MMAPABLE);

/// Cumulative pages added / evicted per interval.
#[map]
pub static FILEMAP_CHURN: Array<Churn> = Array::with_max_entries(MAX_INTERVALS, BPF_F_MMAPABLE);

#[map]
pub static FILEMAP_TOTALS: Array<u64> = Array::with_max_entries(N_TOTALS, BPF_F_MMAPABLE);

/// Per bucket of pages, the interval of its first page (`observer_common::filemap`, "Finding a
/// page's interval"), one value that [`find`] indexes directly.
#[map]
pub static FILEMAP_INDEX: Array<[u16; MAX_BUCKETS as usize]> = Array::with_max_entries(1, 0);

#[map]
pub static FILEMAP_SCRATCH: PerCpuArray<FilemapScratch> = PerCpuArray::with_max_entries(1, 0);

#[inline(always)]
fn total_add(i: u32, v: u64) {
    if let Some(p) = FILEMAP_TOTALS.get_ptr_mut(i) {
        atomic_add(p, v);
    }
}

/// All ones when `a < b`, else 0, in arithmetic: the borrow out of `a − b` (Hacker's Delight
/// 2-13) spread by an arithmetic shift written in assembly, which the compiler cannot turn back
/// into a comparison and a jump (as it does with `a < b`, and with the shift in Rust).
#[inline(always)]
fn below_mask(a: u64, b: u64) -> u64 {
    let mut borrow = (!a & b) | (!(a ^ b) & a.wrapping_sub(b));
    // SAFETY: register arithmetic only.
    unsafe { core::arch::asm!("{b} s>>= 63", b = inout(reg) borrow, options(pure, nomem, nostack)) };
    borrow
}

/// The interval holding page `page` (the last `i` with `start[i] <= page`): its bucket's entry
/// of `FILEMAP_INDEX`, then the steps below `index_span` (`observer_common::filemap`, "Finding a
/// page's interval"; `IntervalIndex::find` is the same in user space). The branches on
/// `index_span` go the same way on every call.
///
/// The bucket goes through this CPU's scratch before it indexes the map value: an offset
/// computed from `page` itself would make the verifier track `page` precisely back into the
/// caller's loops (`evict::refault`), whose states then no longer prune (`filemap_add` went past
/// the verifier's 1M instructions; 289 254 with the round trip, `verified_insns`).
#[inline(always)]
pub fn find(cfg: &FilemapConfig, page: u64) -> u32 {
    let (Some(index), Some(s)) = (FILEMAP_INDEX.get_ptr(0), FILEMAP_SCRATCH.get_ptr_mut(0)) else { return 0 };
    // SAFETY: this CPU's scratch; programs do not nest on one CPU, and callers write it only
    // after `find` returns.
    let bucket = unsafe {
        write_volatile(&raw mut (*s).lo, (page >> (cfg.index_shift & 63)).min(MAX_BUCKETS as u64 - 1));
        read_volatile(&raw const (*s).lo)
    } as usize;
    // SAFETY: the map's value, the index bounded into it.
    let mut pos = unsafe { read_volatile(&raw const (*index)[bucket & (MAX_BUCKETS as usize - 1)]) } as u32;
    let mut step = MAX_INTERVALS / 2;
    for _ in 0..SEARCH_STEPS {
        if step < cfg.index_span {
            let at = (pos + step) & (MAX_INTERVALS - 1);
            // SAFETY: map value; user space only writes it before enabling.
            let start = FILEMAP_STARTS.get(at).map(|v| unsafe { read_volatile(v) }).unwrap_or(u64::MAX);
            pos += step & !(below_mask(page, start) as u32);
        }
        step >>= 1;
    }
    pos & (MAX_INTERVALS - 1)
}

/// Count the `1 << order` pages at `index` into the intervals they fall in, and for the
/// eviction's actor (`evict`: its counters and kind) when there is one.
#[inline(always)]
fn count(cfg: &FilemapConfig, index: u64, order: u32, evicted: bool, actor: Option<(*mut ActorPages, u32)>) {
    let pages = 1u64 << (order & 15);
    let end = index.saturating_add(pages);
    total_add(if evicted { T_DEL_EVENTS } else { T_ADD_EVENTS }, 1);
    total_add(if evicted { T_DEL_PAGES } else { T_ADD_PAGES }, pages);
    // After `T_DEL_PAGES` (the order a mark relies on, `observer_common::evict`).
    if let Some((a, kind)) = actor {
        evict::event(a);
        evict::kind_pages(kind, index, pages);
    } else if !evicted {
        evict::refault(index, pages);
    }
    let a = actor.map(|x| x.0);
    let Some(s) = FILEMAP_SCRATCH.get_ptr_mut(0) else {
        total_add(if evicted { T_DEL_SPILL } else { T_ADD_SPILL }, pages);
        if let Some(a) = a {
            evict::spill(a, pages);
        }
        return;
    };
    let first = find(cfg, index);
    // SAFETY: this CPU's scratch.
    unsafe {
        write_volatile(&raw mut (*s).lo, first as u64);
        write_volatile(&raw mut (*s).cur, index);
    }
    for _ in 0..MAX_SPAN {
        // SAFETY: this CPU's scratch.
        let (i, cur) = unsafe { (read_volatile(&raw const (*s).lo) as u32, read_volatile(&raw const (*s).cur)) };
        let i = i & (MAX_INTERVALS - 1);
        // SAFETY: map value.
        let next = FILEMAP_STARTS.get(i + 1).map(|v| unsafe { read_volatile(v) }).unwrap_or(u64::MAX);
        let stop = if next < end { next } else { end };
        if stop > cur
            && let Some(c) = FILEMAP_CHURN.get_ptr_mut(i)
        {
            // SAFETY: aligned u64 fields of a map value, updated from any CPU.
            let field = unsafe { if evicted { &raw mut (*c).evicted } else { &raw mut (*c).added } };
            atomic_add(field, stop - cur);
            if let Some(a) = a {
                evict::pages(a, i, stop - cur);
            }
        }
        if stop >= end {
            return;
        }
        // SAFETY: this CPU's scratch.
        unsafe {
            write_volatile(&raw mut (*s).lo, i as u64 + 1);
            write_volatile(&raw mut (*s).cur, stop);
        }
    }
    // SAFETY: this CPU's scratch.
    let cur = unsafe { read_volatile(&raw const (*s).cur) };
    if end > cur {
        total_add(if evicted { T_DEL_SPILL } else { T_ADD_SPILL }, end - cur);
        if let Some(a) = a {
            evict::spill(a, end - cur);
        }
    }
}

/// The event's field of type `T` at `off` (its format's offset): a plain load of the record at
/// `at`, a constant, when the formats match `DIRECT_FIELDS` (`FilemapConfig::direct`), else a
/// `bpf_probe_read` at `off`.
#[inline(always)]
fn field<T: Copy + Default>(ctx: &TracePointContext, direct: bool, at: usize, off: u32) -> T {
    if direct {
        // SAFETY: a tracepoint program's context is the event's record; user space compared the
        // format with `DIRECT_FIELDS`, whose offsets are inside it and aligned for `T`.
        unsafe { core::ptr::read((ctx.as_ptr() as *const u8).add(at).cast::<T>()) }
    } else {
        // SAFETY: an offset from the tracepoint's format file; the helper fails cleanly.
        unsafe { ctx.read_at::<T>(off as usize) }.unwrap_or_default()
    }
}

#[inline(always)]
fn on_event(ctx: &TracePointContext, evicted: bool) -> u32 {
    let Some(cfg) = FILEMAP_CONFIG.get(0) else { return 0 };
    if cfg.enabled == 0 {
        return 0;
    }
    let f: &FilemapFields = if evicted { &cfg.del } else { &cfg.add };
    let direct = cfg.direct != 0;
    let ino: u64 = field(ctx, direct, DIRECT_FIELDS.ino as usize, f.ino);
    if ino != cfg.ino {
        return 0;
    }
    let dev: u32 = field(ctx, direct, DIRECT_FIELDS.dev as usize, f.dev);
    if dev != cfg.dev {
        total_add(T_OTHER_DEV, 1);
        if let Some(p) = FILEMAP_TOTALS.get_ptr_mut(T_OTHER_DEV_LAST) {
            // SAFETY: map value; a racy store of a diagnostic.
            unsafe { write_volatile(p, dev as u64) };
        }
        return 0;
    }
    let index: u64 = field(ctx, direct, DIRECT_FIELDS.index as usize, f.index);
    let order =
        if f.order == NO_FIELD { 0 } else { field::<u8>(ctx, direct, DIRECT_FIELDS.order as usize, f.order) as u32 };
    count(cfg, index, order, evicted, if evicted { evict::actor() } else { None });
    0
}

#[tracepoint]
pub fn filemap_add(ctx: TracePointContext) -> u32 {
    on_event(&ctx, false)
}

#[tracepoint]
pub fn filemap_delete(ctx: TracePointContext) -> u32 {
    on_event(&ctx, true)
}
