//! Block I/O attributed to the thread that caused it.
//!
//! `block:block_bio_queue` runs in the submitting task: reads queued by the
//! target's threads are counted (bytes, ios; pages from swap devices are
//! swap-ins) and remembered in `INFLIGHT` by (dev, sector). Completion:
//! `block:block_bio_complete` for bio-based devices (zram), and
//! `block:block_rq_complete` for blk-mq disks (which do not trace bio
//! completion); both share the dev/sector layout. Bios merged into a larger
//! request complete under the request's first sector only: the others age
//! out of the LRU map without a latency.
//!
//! zram before Linux 6.3 also has `rw_page`: `bdev_read_page` (swap-ins from
//! a `SWP_SYNCHRONOUS_IO` device) hands a page to `zram_rw_page` directly, no
//! bio is made and neither block tracepoint fires. A kprobe on `zram_rw_page`
//! counts those reads as `bio_queue` counts a zram bio (one 4 KiB page, a
//! swap-in, the fault's time from there on is zram's); its kretprobe times
//! it (the read is synchronous, in the same task). The observer attaches the
//! pair only where the symbol exists, so no read is counted twice. The pair also
//! gives the read its device's row in `DEV_IO`, as `bio_queue` and the completion
//! do: the device is the first argument's `bd_dev`, at the offset user space read
//! from the kernel's BTF (`TpOffsets::bdev_dev`).

use aya_ebpf::{
    helpers::{bpf_ktime_get_ns, bpf_probe_read_kernel},
    macros::{kprobe, kretprobe, tracepoint},
    programs::{ProbeContext, RetProbeContext, TracePointContext},
};
use observer_common::attrib::{
    BioInflight, BioKey, C_DISK_READ_NS, C_READ_BYTES, C_READ_IOS, C_SWAPINS, C_ZRAM_READ_NS, DEV_SWAP, DEV_ZRAM,
    DevIo, H_DISK_READ, H_ZRAM_READ,
};
use observer_common::filemap::NO_FIELD;

use crate::maps::{
    DEV_IO, DEVICES, INFLIGHT, SLOTS, THREADS, ZRAM_PAGE_START, atomic_add, config, current_state, hist_add, offsets,
    target_tid, update,
};

/// `rwbs` starts with the op: optional 'F' (preflush), then 'R' for reads.
#[inline(always)]
fn is_read(rwbs: [u8; 2]) -> bool {
    rwbs[0] == b'R' || (rwbs[0] == b'F' && rwbs[1] == b'R')
}

#[tracepoint]
pub fn bio_queue(ctx: TracePointContext) -> u32 {
    let Some(tid) = target_tid() else { return 0 };
    let Some(o) = offsets() else { return 0 };
    // SAFETY: offsets from the tracepoint's format file.
    let (dev, sector, nr, rwbs) = unsafe {
        (
            ctx.read_at::<u32>(o.bio_dev as usize).unwrap_or(0),
            ctx.read_at::<u64>(o.bio_sector as usize).unwrap_or(0),
            ctx.read_at::<u32>(o.bio_nr_sector as usize).unwrap_or(0),
            ctx.read_at::<[u8; 2]>(o.bio_rwbs as usize).unwrap_or([0; 2]),
        )
    };
    if !is_read(rwbs) {
        return 0;
    }
    // SAFETY: helper without preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    let zram_major = config().map(|c| c.zram_major).unwrap_or(0);
    let zram = zram_major != 0 && (dev >> 20) == zram_major;
    // SAFETY: plain map lookup.
    let kind = if zram { DEV_ZRAM } else { unsafe { DEVICES.get(&dev).copied().unwrap_or(0) } };
    let bytes = nr as u64 * 512;
    let Some(s) = current_state(tid, now) else { return 0 };
    update(s, |s| {
        s.cnt[C_READ_BYTES] += bytes;
        s.cnt[C_READ_IOS] += 1;
        if kind == DEV_ZRAM || kind == DEV_SWAP {
            s.cnt[C_SWAPINS] += bytes / 4096;
        }
        s.fault_read(now, kind == DEV_ZRAM, kind == DEV_SWAP);
    });
    // SAFETY: plain map lookup.
    let slot = unsafe { SLOTS.get(&tid).copied().unwrap_or(u32::MAX) };
    let key = BioKey { dev, _pad: 0, sector };
    let _ = INFLIGHT.insert(&key, &BioInflight { ts: now, slot, zram: zram as u32, dev, tid }, 0);
    device_read(dev, bytes);
    0
}

/// A read of `bytes` queued on device `dev`: its row of the per-device table.
#[inline(always)]
fn device_read(dev: u32, bytes: u64) {
    let d = match DEV_IO.get_ptr_mut(&dev) {
        Some(d) => Some(d),
        None => {
            let _ = DEV_IO.insert(&dev, &DevIo::default(), 1 /* BPF_NOEXIST */);
            DEV_IO.get_ptr_mut(&dev)
        }
    };
    if let Some(d) = d {
        // SAFETY: map value; other CPUs may update the same device.
        unsafe {
            atomic_add(&raw mut (*d).read_bytes, bytes);
            atomic_add(&raw mut (*d).read_ios, 1);
        }
    }
}

/// A read of device `dev` completed after `lat` ns.
#[inline(always)]
fn device_done(dev: u32, lat: u64) {
    if let Some(d) = DEV_IO.get_ptr_mut(&dev) {
        // SAFETY: map value; other CPUs may update the same device.
        unsafe {
            atomic_add(&raw mut (*d).read_ns, lat);
            atomic_add(&raw mut (*d).completed, 1);
        }
    }
}

#[inline(always)]
fn complete(ctx: &TracePointContext, rq: bool) -> u32 {
    let Some(o) = offsets() else { return 0 };
    let (dev_off, sector_off) = if rq { (o.rqd_dev, o.rqd_sector) } else { (o.biod_dev, o.biod_sector) };
    // SAFETY: offsets from the tracepoint's format file.
    let (dev, sector) = unsafe {
        (ctx.read_at::<u32>(dev_off as usize).unwrap_or(0), ctx.read_at::<u64>(sector_off as usize).unwrap_or(0))
    };
    let key = BioKey { dev, _pad: 0, sector };
    // SAFETY: plain map lookup; copied out before removal.
    let Some(inf) = (unsafe { INFLIGHT.get(&key).copied() }) else { return 0 };
    let _ = INFLIGHT.remove(&key);
    // SAFETY: helper without preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    if now <= inf.ts {
        return 0;
    }
    let lat = now - inf.ts;
    hist_add(if inf.zram != 0 { H_ZRAM_READ } else { H_DISK_READ }, lat);
    device_done(inf.dev, lat);
    if let Some(t) = THREADS.get_ptr_mut(inf.slot) {
        let idx = if inf.zram != 0 { C_ZRAM_READ_NS } else { C_DISK_READ_NS };
        // SAFETY: map value; completion may run on another CPU than the owner. The slot may have
        // been given back since the read was queued (`attrib::MAX_SLOTS`): charged only while it
        // is the queueing thread's.
        unsafe {
            if (*t).tid != inf.tid {
                return 0;
            }
            if let Some(c) = (*t).cnt.get_mut(idx) {
                atomic_add(c, lat);
            }
        }
    }
    0
}

#[tracepoint]
pub fn bio_complete(ctx: TracePointContext) -> u32 {
    complete(&ctx, false)
}

#[tracepoint]
pub fn rq_complete(ctx: TracePointContext) -> u32 {
    complete(&ctx, true)
}

/// `REQ_OP_READ` in `enum req_op`, the fourth argument of `zram_rw_page`.
const REQ_OP_READ: u64 = 0;

/// The device of `zram_rw_page`'s first argument (`struct block_device *`), at the offset of
/// `bd_dev` user space found in the kernel's BTF; `NO_DEV` when that offset is unknown.
#[inline(always)]
fn zram_rw_page_dev(ctx: &ProbeContext) -> u32 {
    let off = offsets().map_or(NO_FIELD, |o| o.bdev_dev);
    let bdev: u64 = ctx.arg(0).unwrap_or(0);
    if off == NO_FIELD || bdev == 0 {
        return NO_DEV;
    }
    // SAFETY: `bpf_probe_read_kernel` tolerates any address.
    unsafe { bpf_probe_read_kernel((bdev + off as u64) as *const u32).unwrap_or(NO_DEV) }
}

/// No device known (dev_t 0 is no device).
const NO_DEV: u32 = 0;

#[kprobe]
pub fn zram_rw_page(ctx: ProbeContext) -> u32 {
    let op: u64 = ctx.arg(3).unwrap_or(u64::MAX);
    // `enum req_op` is an int: only its low 8 bits are the op.
    if op & 0xff != REQ_OP_READ {
        return 0;
    }
    let Some(tid) = target_tid() else { return 0 };
    // SAFETY: helper without preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    let Some(s) = current_state(tid, now) else { return 0 };
    update(s, |s| {
        s.cnt[C_READ_BYTES] += 4096;
        s.cnt[C_READ_IOS] += 1;
        s.cnt[C_SWAPINS] += 1;
        s.fault_read(now, true, false);
    });
    let dev = zram_rw_page_dev(&ctx);
    if dev != NO_DEV {
        device_read(dev, 4096);
    }
    let _ = ZRAM_PAGE_START.insert(&tid, &[now, dev as u64], 0);
    0
}

#[kretprobe]
pub fn zram_rw_page_ret(_ctx: RetProbeContext) -> u32 {
    let Some(tid) = target_tid() else { return 0 };
    // SAFETY: plain map lookup; copied out before removal.
    let Some([start, dev]) = (unsafe { ZRAM_PAGE_START.get(&tid).copied() }) else { return 0 };
    let _ = ZRAM_PAGE_START.remove(&tid);
    // SAFETY: helper without preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    if now <= start {
        return 0;
    }
    let lat = now - start;
    hist_add(H_ZRAM_READ, lat);
    if dev as u32 != NO_DEV {
        device_done(dev as u32, lat);
    }
    // SAFETY: plain map lookup.
    let slot = unsafe { SLOTS.get(&tid).copied().unwrap_or(u32::MAX) };
    if let Some(t) = THREADS.get_ptr_mut(slot) {
        // SAFETY: map value; the owner runs this, other CPUs may read it.
        unsafe { atomic_add(&raw mut (*t).cnt[C_ZRAM_READ_NS], lat) };
    }
    0
}
