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
//! 3. the system call the task is in (from its saved user registers, [`sys::NR_FIELD`]; numbers
//!    per architecture in [`sys::RULES`]):
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
//! Refault cost per region: the same fault, with the same `fault_io` time, is also charged to the
//! churn interval (`filemap`) of that first remembered page (`RefaultFault::interval`) in
//! `EVICT_REFAULT_CELLS[interval]` ([`RefaultCost`], an mmapable array), in the same exit, so
//! `Σ_interval == Σ_kind` for faults and `fault_io` at any read that sees no fault closing. User
//! space folds intervals into expert cells (the grid layers `refault_faults`, `refault_io_ns`).
//!
//! Memcg: `bpf_get_current_cgroup_id` is the actor's cgroup on the v2 hierarchy. On a host whose
//! memory controller is on cgroup v1 (this VM) that is the v2 root for every task, and the memcg
//! of the reclaim is not in the tracepoints: user space reads the actor's memory cgroup from
//! `/proc/PID/cgroup` while the actor lives; once it has exited, on a host whose memory controller
//! is on cgroup v2 the group is the cgroup2 directory whose inode is that ID (while the group
//! exists); otherwise it says "not known".

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
    /// The churn interval (`filemap`) of that page.
    pub interval: u32,
}
const _: () = assert!(core::mem::size_of::<RefaultFault>() == 24);

/// Value of `EVICT_REFAULT_CELLS` (per churn interval, cumulative): refault faults whose first
/// refaulted page lies in the interval, and their `fault_io` ns.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RefaultCost {
    pub faults: u64,
    pub io_ns: u64,
}
const _: () = assert!(core::mem::size_of::<RefaultCost>() == 16);

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

/// The system calls of the rules above and where the kernel keeps the number of the one a task
/// is in, per architecture (the observer's target: these are user-side facts the kernel side is
/// configured with, `EVICT_SYSCALLS` and [`EvictConfig`]). Numbers are the kernel's tables:
/// x86-64 `arch/x86/entry/syscalls/syscall_64.tbl`; aarch64 the generic table
/// (`include/uapi/asm-generic/unistd.h`), which has no `open`, `creat`, `unlink` or `rename`
/// (only their `*at` forms). Other architectures have no rules: their evictions in a system call
/// count as [`K_OTHER`] with [`NO_SYSCALL`].
pub mod sys {
    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    use super::{K_FADVISE, K_TRUNCATE};

    /// A rule: the system call's name, its number, the kind of the evictions made in it.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct Rule {
        pub name: &'static str,
        pub nr: u32,
        pub kind: u32,
    }

    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    const fn r(name: &'static str, nr: u32, kind: u32) -> Rule {
        Rule { name, nr, kind }
    }

    /// Where the number of the system call a task is in lies in the kernel's saved user
    /// registers (`struct pt_regs`, at the top of the task's kernel stack).
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct NrField {
        /// Byte offset in `struct pt_regs`.
        pub offset: u32,
        /// Width in bytes, 8 or 4 (signed, little-endian; −1 outside a system call).
        pub bytes: u32,
    }

    /// x86-64: `orig_ax`, after `r15 … rdi` (the order of `user_regs_struct`).
    #[cfg(target_arch = "x86_64")]
    pub const NR_FIELD: Option<NrField> = Some(NrField { offset: 15 * 8, bytes: 8 });
    /// aarch64: `s32 syscallno`, after `regs[31]`, `sp`, `pc`, `pstate` (`user_pt_regs`) and
    /// `u64 orig_x0`; the 32 bits after it are another field (`pmr` on recent kernels).
    #[cfg(target_arch = "aarch64")]
    pub const NR_FIELD: Option<NrField> = Some(NrField { offset: 34 * 8 + 8, bytes: 4 });
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    pub const NR_FIELD: Option<NrField> = None;

    #[cfg(target_arch = "x86_64")]
    pub const RULES: &[Rule] = &[
        r("fadvise64", 221, K_FADVISE),
        r("madvise", 28, K_FADVISE),
        r("process_madvise", 440, K_FADVISE),
        r("write", 1, K_TRUNCATE), // `drop_caches` is a write
        r("pwrite64", 18, K_TRUNCATE),
        r("writev", 20, K_TRUNCATE),
        r("pwritev", 296, K_TRUNCATE),
        r("pwritev2", 328, K_TRUNCATE),
        r("truncate", 76, K_TRUNCATE),
        r("ftruncate", 77, K_TRUNCATE),
        r("fallocate", 285, K_TRUNCATE),
        r("open", 2, K_TRUNCATE), // O_TRUNC
        r("openat", 257, K_TRUNCATE),
        r("openat2", 437, K_TRUNCATE),
        r("creat", 85, K_TRUNCATE),
        r("unlink", 87, K_TRUNCATE),
        r("unlinkat", 263, K_TRUNCATE),
        r("rename", 82, K_TRUNCATE),
        r("renameat", 264, K_TRUNCATE),
        r("renameat2", 316, K_TRUNCATE),
        r("close", 3, K_TRUNCATE), // the last close of an unlinked file
    ];

    #[cfg(target_arch = "aarch64")]
    pub const RULES: &[Rule] = &[
        r("fadvise64", 223, K_FADVISE),
        r("madvise", 233, K_FADVISE),
        r("process_madvise", 440, K_FADVISE),
        r("write", 64, K_TRUNCATE), // `drop_caches` is a write
        r("pwrite64", 68, K_TRUNCATE),
        r("writev", 66, K_TRUNCATE),
        r("pwritev", 70, K_TRUNCATE),
        r("pwritev2", 287, K_TRUNCATE),
        r("truncate", 45, K_TRUNCATE),
        r("ftruncate", 46, K_TRUNCATE),
        r("fallocate", 47, K_TRUNCATE),
        r("openat", 56, K_TRUNCATE), // O_TRUNC
        r("openat2", 437, K_TRUNCATE),
        r("unlinkat", 35, K_TRUNCATE),
        r("renameat", 38, K_TRUNCATE),
        r("renameat2", 276, K_TRUNCATE),
        r("close", 57, K_TRUNCATE), // the last close of an unlinked file
    ];

    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    pub const RULES: &[Rule] = &[];

    /// Name of a system call of [`RULES`], for tables.
    pub fn name(nr: u32) -> Option<&'static str> {
        RULES.iter().find(|r| r.nr == nr).map(|r| r.name)
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
    /// Offset of the system call number in the task's saved `pt_regs` ([`sys::NR_FIELD`]),
    /// [`NO_FIELD`](crate::filemap::NO_FIELD) where user space does not know it.
    pub syscall_off: u32,
    /// Its width in bytes: 8, or 4 (a signed 32-bit field, sign-extended).
    pub syscall_bytes: u32,
    pub _pad: u32,
}
const _: () = assert!(core::mem::size_of::<EvictConfig>() == 16);

impl EvictConfig {
    /// The system call number from the `i64` read at `syscall_off` (little-endian: a 4-byte
    /// field is its low half), [`NO_SYSCALL`] outside `0..MAX_SYSCALL`.
    #[inline(always)]
    pub fn syscall_nr(&self, word: i64) -> u32 {
        let nr = if self.syscall_bytes == 4 { word as i32 as i64 } else { word };
        if (0..MAX_SYSCALL as i64).contains(&nr) { nr as u32 } else { NO_SYSCALL }
    }
}

/// Entries of `EVICT_SYSCALLS` (system call number → `kind + 1`, 0 = no rule).
pub const MAX_SYSCALL: u32 = 512;
