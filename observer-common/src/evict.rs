//! Eviction blame: who evicted the model file's pages, counted per actor × region in the kernel.
//!
//! ## Measurement rule
//! Every page the churn counters count as evicted (`filemap`, `mm_filemap_delete_from_page_cache`)
//! is also counted, in the same program and the same event, for one *actor*: the task in whose
//! context the page left the page cache (`bpf_get_current_pid_tgid`, `bpf_get_current_comm`,
//! `bpf_get_current_cgroup_id`), with a *kind* decided in this order:
//! 1. the task is inside `vmscan:mm_vmscan_direct_reclaim_begin/end` → [`K_DIRECT`]; inside
//!    `vmscan:mm_vmscan_memcg_reclaim_begin/end` → [`K_MEMCG`] (a memcg at its limit, a process
//!    lowering `memory.limit_in_bytes`/`memory.max`, and `memory.reclaim` on cgroup v2 alike: this
//!    tracepoint does not tell them apart; the actor's system call, below, does);
//! 2. its comm starts with `kswapd` → [`K_KSWAPD`]; with `kdamond` (DAMON's worker, e.g. a
//!    `pageout` scheme) → [`K_PROACTIVE`];
//! 3. the system call the task is in (`orig_ax` of its saved user registers, x86-64):
//!    `fadvise64`, `madvise`, `process_madvise` → [`K_FADVISE`]; `truncate`, `ftruncate`,
//!    `fallocate`, `write`-family (`drop_caches` is a write), `open*` (`O_TRUNC`), `unlink*`,
//!    `rename*`, `close` (the last close of an unlinked file) → [`K_TRUNCATE`];
//! 4. anything else → [`K_OTHER`].
//!
//! The system call number is kept in the actor (`syscall`, [`NO_SYSCALL`] for kernel threads and
//! other architectures), so `write` by `sh` in `memcg_reclaim` reads "a shell wrote a cgroup file".
//!
//! Counts are exact in the churn counters' sense: per actor, `Σ pages[class] + spill` equals the
//! pages of its events, and `Σ` over actors plus [`ActorPages`] rows of the overflow array equals
//! the churn total `T_DEL_PAGES`. The actor table is a hash map of [`MAX_ACTORS`] entries; an
//! event whose actor does not fit is counted in `EVICT_OVERFLOW[kind]` (the "other" row of its
//! kind, never dropped). The per-task reclaim windows live in a hash map of [`MAX_WINDOWS`]; a
//! window that does not fit is counted in `EVICT_STATS[S_WINDOW_LOST]` (its evictions then fall
//! to the next rule).
//!
//! Per step: the pages of each kind are also added to `EVICT_KIND_PAGES[kind]`, in the same event
//! and after `T_DEL_PAGES`; a token mark copies them into its record (`MarkRecord::churn_evicted_by`)
//! *before* it reads `T_DEL_PAGES`, so at each mark `Σ kinds ≤ churn_evicted`, short only by the
//! evictions in flight on another CPU at that instant; a step's split is the difference of its two
//! marks (`model::EvictedBy`).
//!
//! Refaults: each evicted page is remembered with its actor's kind, per 64-page block of the file
//! (`EVICT_REMEMBER`, a hash map of [`MAX_REMEMBERED`] blocks, [`Remembered`]); when a page of
//! the file is added to the page cache again (`mm_filemap_add_to_page_cache`: a fault, a read or
//! read-ahead, by anyone) while remembered, it counts as a refault of that kind
//! (`EVICT_REFAULTS[kind]`) and is forgotten. Pages whose block does not fit in the map are
//! counted in `EVICT_STATS[S_NOT_REMEMBERED]` (their refaults are then not counted).
//!
//! Refault cost: when the refaulting add happens inside a page fault of an observed thread (the
//! thread's `ThreadState::fault_start` is set), that fault is a *refault fault* of the kind of the
//! first remembered page it added (`EVICT_REFAULT_OPEN[tid]`, [`RefaultFault`]: the fault's start
//! and the thread's `fault_io` time so far, the not yet charged interval included). At the fault's
//! exit its `fault_io` time since then (`attrib`'s rule: the disk read as the thread lives it) is
//! added to `EVICT_REFAULT_IO[kind]`, and the fault to `EVICT_REFAULT_FAULTS[kind]`. So a fault
//! that brings back pages of several kinds costs its first kind only, and refaults outside a fault
//! (`read(2)`, read-ahead by another task) have no `fault_io` (their wait is `io_wait`). A full
//! `EVICT_REFAULT_OPEN` is counted in `EVICT_STATS[S_REFAULT_FAULT_LOST]`. A token mark copies the
//! three per-kind arrays into its record, so a step's refaults and their cost are differences of
//! its two marks (`model::TokenRecord::refaulted_by`, `refault_io_ns`).
//!
//! Memcg: `bpf_get_current_cgroup_id` is the actor's cgroup on the v2 hierarchy. On a host whose
//! memory controller is on cgroup v1 (this VM) that is the v2 root for every task, and the memcg
//! of the reclaim is not in the tracepoints: user space reads the actor's memory cgroup from
//! `/proc/PID/cgroup` while the actor lives, and says "not known" otherwise.

/// Actor kinds, in the order of `vocab::EVICTION_ACTORS` (a compile-time check in `vocab`).
pub const K_KSWAPD: u32 = 0;
pub const K_DIRECT: u32 = 1;
pub const K_MEMCG: u32 = 2;
pub const K_PROACTIVE: u32 = 3;
pub const K_FADVISE: u32 = 4;
pub const K_TRUNCATE: u32 = 5;
pub const K_OTHER: u32 = 6;
pub const N_KINDS: u32 = 7;

/// Region classes of the per-actor split (`EVICT_CLASS[interval]`).
pub const C_DENSE: u32 = 0;
pub const C_SHARED: u32 = 1;
pub const C_ROUTED: u32 = 2;
pub const C_OTHER: u32 = 3;
pub const N_CLASSES: usize = 4;

/// Capacity of the actor table.
pub const MAX_ACTORS: u32 = 1024;
/// Capacity of the per-task reclaim windows.
pub const MAX_WINDOWS: u32 = 16384;
/// `ActorKey::syscall` of an actor not in a system call (or where it is not known).
pub const NO_SYSCALL: u32 = u32::MAX;

/// Indices of `EVICT_STATS`.
pub const S_WINDOW_LOST: u32 = 0;
/// Evicted pages not remembered for refaults (the map was full).
pub const S_NOT_REMEMBERED: u32 = 1;
/// Refault faults not followed to their exit (`EVICT_REFAULT_OPEN` was full): their cost is missing.
pub const S_REFAULT_FAULT_LOST: u32 = 2;
pub const N_STATS: u32 = 3;

/// Value of `EVICT_REFAULT_OPEN` (key: TID): an open fault that refaulted a page.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RefaultFault {
    /// The fault's `ThreadState::fault_start`.
    pub fault_start: u64,
    /// The thread's `fault_io` time (ns) when the first refault of the fault was seen.
    pub io_at: u64,
    /// Kind of the eviction of that page.
    pub kind: u32,
    pub _pad: u32,
}
const _: () = assert!(core::mem::size_of::<RefaultFault>() == 24);

/// Pages per block of `EVICT_REMEMBER`.
pub const BLOCK_PAGES: u64 = 64;
/// Capacity of `EVICT_REMEMBER` in blocks (4 Mi pages: 16 GiB of 4 KiB pages).
pub const MAX_REMEMBERED: u32 = 65536;

/// Value of `EVICT_REMEMBER` (key: page index / [`BLOCK_PAGES`]): the evicted pages of the block
/// not added back yet (bit `i`: page `key * 64 + i`), and the kind that evicted each, as three bit
/// planes (bit `i` of `kind[j]` is bit `j` of page `i`'s kind).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Remembered {
    pub evicted: u64,
    pub kind: [u64; KIND_BITS],
}
/// Bits of a kind (`N_KINDS <= 1 << KIND_BITS`).
pub const KIND_BITS: usize = 3;
const _: () = assert!(N_KINDS <= 1 << KIND_BITS);
const _: () = assert!(core::mem::size_of::<Remembered>() == 32);

/// Who evicted: key of the `EVICT_ACTORS` hash map.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ActorKey {
    pub kind: u32,
    pub tgid: u32,
    pub syscall: u32,
    pub _pad: u32,
    /// `bpf_get_current_cgroup_id` (cgroup v2).
    pub cgroup: u64,
    pub comm: [u8; 16],
}
const _: () = assert!(core::mem::size_of::<ActorKey>() == 40);

/// What one actor evicted (pages, cumulative).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ActorPages {
    pub events: u64,
    /// Per region class (`C_*`).
    pub pages: [u64; N_CLASSES],
    /// Pages of folios spread over more intervals than the walk covers.
    pub spill: u64,
}
const _: () = assert!(core::mem::size_of::<ActorPages>() == 48);

impl ActorPages {
    pub fn total(&self) -> u64 {
        self.pages.iter().sum::<u64>() + self.spill
    }
}

/// x86-64 system call numbers of the rules above.
pub mod sys {
    pub const FADVISE: &[u32] = &[221, 28, 440]; // fadvise64, madvise, process_madvise
    pub const TRUNCATE: &[u32] = &[
        1, 18, 20, 296, 328, // write, pwrite64, writev, pwritev, pwritev2
        76, 77, 285, // truncate, ftruncate, fallocate
        2, 257, 437, 85, // open, openat, openat2, creat
        87, 263, 82, 264, 316, // unlink, unlinkat, rename, renameat, renameat2
        3,   // close
    ];
    /// Name of a system call of these lists, for tables.
    pub fn name(nr: u32) -> Option<&'static str> {
        Some(match nr {
            221 => "fadvise64",
            28 => "madvise",
            440 => "process_madvise",
            1 => "write",
            18 => "pwrite64",
            20 => "writev",
            296 => "pwritev",
            328 => "pwritev2",
            76 => "truncate",
            77 => "ftruncate",
            285 => "fallocate",
            2 => "open",
            257 => "openat",
            437 => "openat2",
            85 => "creat",
            87 => "unlink",
            263 => "unlinkat",
            82 => "rename",
            264 => "renameat",
            316 => "renameat2",
            3 => "close",
            _ => return None,
        })
    }
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: repr(C), only integer fields, explicit padding (size assertions above).
    unsafe impl aya::Pod for super::ActorKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::ActorPages {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::EvictConfig {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::Remembered {}
}

/// Index 0 of `EVICT_CONFIG`; `enabled == 0` leaves eviction blame off (churn still counts).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EvictConfig {
    pub enabled: u32,
    /// Offset of the system call number in the task's saved `pt_regs` (`orig_ax` on x86-64),
    /// [`NO_FIELD`](crate::filemap::NO_FIELD) where user space does not know it.
    pub syscall_off: u32,
}
const _: () = assert!(core::mem::size_of::<EvictConfig>() == 8);

/// Entries of `EVICT_SYSCALLS` (system call number → `kind + 1`, 0 = no rule).
pub const MAX_SYSCALL: u32 = 512;
