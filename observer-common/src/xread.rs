//! Explicit reads of the model file, per region, counted in the kernel.
//!
//! ## Measurement rule
//! An *explicit read* is a `read`, `readv`, `pread64`, `preadv` or `preadv2` system call of an
//! observed thread on a file descriptor that refers to the model file (its `(st_dev, st_ino)`), as
//! seen by `raw_syscalls:sys_enter/sys_exit`: the program keeps the call's arguments at entry
//! (`fd`, and the file offset for the `pread` family) and at exit, when the call returned `n > 0`
//! bytes, charges it whole to one region and one *kind*:
//! - the region is the page interval of the model's churn map (`filemap`: a page belongs to the
//!   region holding its middle byte) that holds the read's middle byte `offset + n / 2`; the
//!   engine's cache reads one expert slice per call (widened to page boundaries), so its middle
//!   byte is that slice's, found through churn's bucket index (`filemap`, "Finding a page's
//!   interval"). A read that spans several regions counts for the middle one only;
//! - the kind ([`K_DENSE`], [`K_EXPERTS`], [`K_OTHER`]) is the interval's class
//!   (`evict::C_*`: dense tensors and shared experts are `dense`, routed experts `experts`, bytes
//!   outside tensors `other`). `read`/`readv`, and `preadv2` at offset −1 (the file position), give
//!   no offset: they count as `other`.
//!
//! Per kind the kernel adds the bytes, the call's duration (entry to exit: what the thread waited
//! for, `io_wait` and any run-queue time inside the call; summed over threads, so overlapping
//! reads of several I/O workers can add up to more than a token's wall time) and the calls, to
//! the cumulative array `XREAD_TOTALS` ([`N_TOTALS`] entries, indices `T_*`). A read charged to
//! a routed expert also sends one ring-buffer record ([`ReadRecord`]: the interval and the bytes),
//! without waking the reader (user space polls the ring), except that a thread's every
//! [`QUERY_EVERY`]th record wakes it when an eighth of the ring is unread.
//! A record that cannot be reserved is counted ([`T_LOST_EVENTS`], its bytes in
//! [`T_LOST_BYTES`]), never silently dropped.
//!
//! ## Spans: token records, `--window` records, heatmap refreshes
//! Explicit reads are reported per *span*, between two readings of the totals:
//! - per kind (and unresolved, lost): the difference of the totals at the span's two ends, exact
//!   for the calls that returned between them;
//! - per expert: the read records user space takes from the ring between the span's two ends,
//!   folded into `(layer, expert)` by their interval.
//!
//! The ends differ in how they meet the ring:
//! - **a token** (`begin` and `end` mark): the mark copies the totals into its own ring record
//!   (`attrib::MarkRecord::xread`), and the ring keeps the order of reservation, so a token's
//!   records are those between its two mark records: exact per token,
//!   `Σ experts' bytes + lost bytes == experts bytes`. Records between an `end` and the next
//!   `begin` are in no token.
//! - **a window** (`--window`, and each refresh of `observer heatmap --pid`): user space takes
//!   every record in the ring, then reads the totals. A read that returns in between is in this
//!   window's totals and the next window's records, so per expert only the sums over the run
//!   are exact (every window adds up, after the process has exited and the ring is empty).
//!   `observer heatmap --pid` attaches to a running process: a read that entered its call before
//!   the programs were attached is not counted; its open descriptors are resolved at once.
//!
//! File descriptors: the kernel does not resolve an fd to a file here (no BTF-relocated struct
//! reads on this project's kernels). User space does, once per `(tgid, fd)`, from
//! `/proc/PID/fd/N` (`stat`: the model's device and inode), and stores the verdict in `XREAD_FDS`
//! ([`FD_MODEL`], [`FD_OTHER`]). The programs ask for a verdict (a [`FdQuery`] record, and
//! [`FD_PENDING`] in the map) when an `open`-family call returns an fd and when a read meets an fd
//! without one; reads on a pending fd count as *unresolved* ([`T_UNRESOLVED_BYTES`], never charged
//! to a region). `close(fd)` and `dup2`/`dup3` onto `fd` forget its verdict at their entry.
//! At an `exec` of an observed process user space drops its verdicts and resolves its open fds
//! again (`O_CLOEXEC` closes without `close`). Not seen: fds closed by `close_range` whose number
//! is reused without an `open` (by `dup`; an `open` always asks again).
//!
//! io_uring: reads submitted through io_uring (`io_uring_enter`, or an SQ-polling kernel thread)
//! carry no fd or offset in any syscall tracepoint, so they are not explicit reads here; an
//! engine that reads that way is seen through its published slot table alone (`engine_cache`).

/// Kinds of region an explicit read is charged to (the order of `vocab::EXPLICIT_READS`).
pub const K_DENSE: usize = 0;
pub const K_EXPERTS: usize = 1;
pub const K_OTHER: usize = 2;
pub const N_KINDS: usize = 3;

/// Indices of `XREAD_TOTALS` (all cumulative): bytes, ns and calls per kind, …
pub const T_BYTES: usize = 0;
pub const T_NS: usize = T_BYTES + N_KINDS;
pub const T_CALLS: usize = T_NS + N_KINDS;
/// … reads on an fd whose verdict was still pending (bytes, calls), …
pub const T_UNRESOLVED_BYTES: usize = T_CALLS + N_KINDS;
pub const T_UNRESOLVED_CALLS: usize = T_UNRESOLVED_BYTES + 1;
/// … per-expert records that could not be sent, and their bytes.
pub const T_LOST_EVENTS: usize = T_UNRESOLVED_CALLS + 1;
pub const T_LOST_BYTES: usize = T_LOST_EVENTS + 1;
pub const N_TOTALS: usize = 16;
const _: () = assert!(T_LOST_BYTES < N_TOTALS);

/// `XREAD_FDS` values (key: [`fd_key`]).
pub const FD_MODEL: u32 = 1;
pub const FD_OTHER: u32 = 2;
pub const FD_PENDING: u32 = 3;
/// Capacity of `XREAD_FDS`.
pub const MAX_FDS: u32 = 4096;

/// Key of `XREAD_FDS`: the process and the descriptor.
#[inline(always)]
pub const fn fd_key(tgid: u32, fd: u32) -> u64 {
    ((tgid as u64) << 32) | fd as u64
}

/// Roles of system calls (`XREAD_ROLES[nr]`; 0: none).
pub const R_PREAD: u32 = 1;
/// `read`, `readv`: no offset.
pub const R_READ: u32 = 2;
/// `close(fd)`: forget `args[0]`.
pub const R_CLOSE: u32 = 3;
/// `dup2`, `dup3`: forget `args[1]`.
pub const R_DUP: u32 = 4;
/// `open`, `openat`, `openat2`, `creat`: ask for the returned fd.
pub const R_OPEN: u32 = 5;
/// Entries of `XREAD_ROLES`.
pub const MAX_SYSCALL: u32 = 512;

/// Index 0 of `XREAD_CONFIG`; `enabled == 0` (the default) leaves the programs off.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct XreadConfig {
    pub enabled: u32,
    /// log2 of the page size of the churn intervals.
    pub page_shift: u32,
    /// Byte offsets in `struct pt_regs` of a system call's first four arguments
    /// (`sys::ARG_REGS`), read from the raw `sys_enter`'s `regs`.
    pub arg_regs: [u32; 4],
}
const _: () = assert!(core::mem::size_of::<XreadConfig>() == 24);

/// A read (or open) in progress, `XREAD_OPEN[tid]`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReadOpen {
    pub fd: u32,
    pub role: u32,
    /// File offset, `u64::MAX` when the call gives none.
    pub offset: u64,
    pub start: u64,
    /// The thread's expert-read records sent so far (wrapping): every [`QUERY_EVERY`]th asks
    /// whether the reader must be woken. Kept across the thread's calls.
    pub records: u32,
    pub _pad: u32,
}
const _: () = assert!(core::mem::size_of::<ReadOpen>() == 32);

/// A thread's expert-read record decides whether to wake the reader (the ring's batch rule:
/// once an eighth of the ring is unread) only every `QUERY_EVERY`th time; the others submit
/// without waking. The query is a helper call, about 9 ns of a read's 130 on the development VM
/// (issue 19). The rule is then late by at most `QUERY_EVERY` records per thread:
/// `MAX_SLOTS × QUERY_EVERY` records of 32 bytes (24 and the ring's 8-byte header), 512 KiB,
/// beyond the eighth of the 4 MiB ring.
pub const QUERY_EVERY: u32 = 64;

/// Ring-buffer record of a read charged to a routed expert (kind `attrib::REC_READ`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReadRecord {
    pub kind: u32,
    pub tid: u32,
    /// The churn interval of the read's middle byte.
    pub interval: u32,
    pub _pad: u32,
    pub bytes: u64,
}
const _: () = assert!(core::mem::size_of::<ReadRecord>() == 24);

/// Ring-buffer record asking user space for an fd's verdict (kind `attrib::REC_FD`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FdQuery {
    pub kind: u32,
    pub tgid: u32,
    pub fd: u32,
    pub _pad: u32,
}
const _: () = assert!(core::mem::size_of::<FdQuery>() == 16);

/// The kind of a churn interval of class `class` (`evict::C_*`).
#[inline(always)]
pub const fn kind_of_class(class: u32) -> usize {
    match class {
        crate::evict::C_DENSE | crate::evict::C_SHARED => K_DENSE,
        crate::evict::C_ROUTED => K_EXPERTS,
        _ => K_OTHER,
    }
}

/// The system calls of the rule, per architecture (kernel tables as in `evict::sys`).
pub mod sys {
    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    use super::{R_CLOSE, R_DUP, R_OPEN, R_PREAD, R_READ};

    /// `(name, number, role)` of the system calls of the rule on the observer's target.
    #[cfg(target_arch = "x86_64")]
    pub const ROLES: &[(&str, u32, u32)] = &[
        ("read", 0, R_READ),
        ("readv", 19, R_READ),
        ("pread64", 17, R_PREAD),
        ("preadv", 295, R_PREAD),
        ("preadv2", 327, R_PREAD),
        ("close", 3, R_CLOSE),
        ("dup2", 33, R_DUP),
        ("dup3", 292, R_DUP),
        ("open", 2, R_OPEN),
        ("openat", 257, R_OPEN),
        ("openat2", 437, R_OPEN),
        ("creat", 85, R_OPEN),
    ];
    #[cfg(target_arch = "aarch64")]
    pub const ROLES: &[(&str, u32, u32)] = &[
        ("read", 63, R_READ),
        ("readv", 65, R_READ),
        ("pread64", 67, R_PREAD),
        ("preadv", 69, R_PREAD),
        ("preadv2", 286, R_PREAD),
        ("close", 57, R_CLOSE),
        ("dup3", 24, R_DUP),
        ("openat", 56, R_OPEN),
        ("openat2", 437, R_OPEN),
    ];
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    pub const ROLES: &[(&str, u32, u32)] = &[];

    /// Where the kernel keeps a system call's first four arguments: byte offsets in `struct
    /// pt_regs` of the registers the architecture's system-call ABI passes them in (x86-64:
    /// `di`, `si`, `dx`, `r10`; arm64: `regs[0..4]`).
    #[cfg(target_arch = "x86_64")]
    pub const ARG_REGS: [u32; 4] = [14 * 8, 13 * 8, 12 * 8, 7 * 8];
    #[cfg(target_arch = "aarch64")]
    pub const ARG_REGS: [u32; 4] = [0, 8, 16, 24];
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    pub const ARG_REGS: [u32; 4] = [0; 4];
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: repr(C), only integer fields, explicit padding (size assertions above).
    unsafe impl aya::Pod for super::XreadConfig {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::ReadOpen {}
}
