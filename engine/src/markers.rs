//! Token markers: the engine's side of the observer's token-marker ABI (version 1).
//!
//! ## Spec
//! The engine binary exports two functions with C linkage, never inlined, each with its own body
//! (so that the linker cannot fold them to one address) and without an atomic read-modify-write
//! as first instruction (x86 uprobes refuse a `lock` prefix):
//!
//! ```c
//! void moe_engine_token_begin(uint64_t index, const struct moe_token_record *rec);
//! void moe_engine_token_end(uint64_t index, const struct moe_token_record *rec);
//! ```
//!
//! `begin` is called before the work of a step, `end` after it, once `rec` is complete. A step is
//! the whole prompt (kind 0, `n_tokens` = prompt length, index 0) or one generated token (kind 1,
//! `n_tokens` = 1, index 1, 2, …). An observer attaches uprobes to both symbols of the binary
//! (`.symtab`; a stripped binary loses them) and copies `rec` at `end`.
//!
//! `struct moe_token_record` ([`TokenRecord`]), little-endian, 152 bytes, `repr(C)`:
//!
//! | offset | type | field | meaning |
//! |---|---|---|---|
//! | 0 | u32 | `magic` | `0x4B4F544D` (`"MTOK"`) |
//! | 4 | u32 | `version` | 1 |
//! | 8 | u32 | `size` | `sizeof(struct)`, 152 for v1 |
//! | 12 | u32 | `kind` | 0 prompt, 1 generated token |
//! | 16 | u64 | `index` | step index (same as the argument) |
//! | 24 | u64 | `n_tokens` | tokens processed in the step (prompt length, or 1) |
//! | 32 | u64 | `wall_ns` | the engine's wall time of the step |
//! | 40 | u64 | `compute_ns` | the engine's `compute`: `wall − io − stall − mgmt` (a residual) |
//! | 48 | u64 | `io_ns` | time in explicit reads (0: with `--experts mmap` the engine reads nothing explicitly) |
//! | 56 | u64 | `stall_ns` | time waiting for I/O it could not overlap (0, as above) |
//! | 64 | u64 | `mgmt_ns` | engine bookkeeping it timed: telemetry sampling (`/proc`, `mincore`) |
//! | 72 | u64 | `read_bytes` | bytes read explicitly (0, as above) |
//! | 80 | u64 | `majflt` | major faults, `getrusage(RUSAGE_SELF)` delta around the step |
//! | 88 | u64 | `cpu_ns` | user+system CPU time of all threads, `getrusage` delta |
//! | 96 | f64 | `cache_hit_pct` | expert-cache hit rate; −1 (no expert cache yet) |
//! | 104 | f64 | `dense_resident_frac` | dense weights resident (see [`crate::placement`]), < 0 when not sampled |
//! | 112 | u64 | `rss_bytes` | `VmRSS` of `/proc/self/status` at the end of the step |
//! | 120 | u64 | `rss_anon_bytes` | `RssAnon` |
//! | 128 | u64 | `rss_file_bytes` | `RssFile` |
//! | 136 | u64 | `swap_bytes` | `VmSwap` |
//! | 144 | u64 | `mem_available_bytes` | `MemAvailable` of `/proc/meminfo` (machine-wide, not the cgroup's) |
//!
//! An integer field of `u64::MAX` means *not measured*; a negative float likewise.
//!
//! The observer keeps its own definition of this record (`observer::engine_abi::TokenRecordV1`);
//! the engine does not depend on the observer, and a test in the observer crate checks that both
//! definitions have the same size and field offsets.

/// `moe_engine_token_begin`.
pub const SYM_BEGIN: &str = "moe_engine_token_begin";
/// `moe_engine_token_end`.
pub const SYM_END: &str = "moe_engine_token_end";
pub const MAGIC: u32 = 0x4B4F_544D;
pub const VERSION: u32 = 1;
pub const RECORD_SIZE: usize = 152;
/// Integer "not measured".
pub const NOT_MEASURED: u64 = u64::MAX;

/// Step kinds (`TokenRecord::kind`).
pub const KIND_PROMPT: u32 = 0;
pub const KIND_GENERATE: u32 = 1;

/// `struct moe_token_record`, version 1 (layout in the module docs).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TokenRecord {
    pub magic: u32,
    pub version: u32,
    pub size: u32,
    pub kind: u32,
    pub index: u64,
    pub n_tokens: u64,
    pub wall_ns: u64,
    pub compute_ns: u64,
    pub io_ns: u64,
    pub stall_ns: u64,
    pub mgmt_ns: u64,
    pub read_bytes: u64,
    pub majflt: u64,
    pub cpu_ns: u64,
    pub cache_hit_pct: f64,
    pub dense_resident_frac: f64,
    pub rss_bytes: u64,
    pub rss_anon_bytes: u64,
    pub rss_file_bytes: u64,
    pub swap_bytes: u64,
    pub mem_available_bytes: u64,
}
const _: () = assert!(std::mem::size_of::<TokenRecord>() == RECORD_SIZE);
const _: () = assert!(std::mem::align_of::<TokenRecord>() == 8);

impl TokenRecord {
    /// A record for step `index` of `kind` with every measurement "not measured".
    pub const fn new(kind: u32, index: u64, n_tokens: u64) -> Self {
        TokenRecord {
            magic: MAGIC,
            version: VERSION,
            size: RECORD_SIZE as u32,
            kind,
            index,
            n_tokens,
            wall_ns: NOT_MEASURED,
            compute_ns: NOT_MEASURED,
            io_ns: NOT_MEASURED,
            stall_ns: NOT_MEASURED,
            mgmt_ns: NOT_MEASURED,
            read_bytes: NOT_MEASURED,
            majflt: NOT_MEASURED,
            cpu_ns: NOT_MEASURED,
            cache_hit_pct: -1.0,
            dense_resident_frac: -1.0,
            rss_bytes: NOT_MEASURED,
            rss_anon_bytes: NOT_MEASURED,
            rss_file_bytes: NOT_MEASURED,
            swap_bytes: NOT_MEASURED,
            mem_available_bytes: NOT_MEASURED,
        }
    }
}

/// Marker: step `index` begins; `rec` carries its kind, index and token count.
///
/// The body differs from [`moe_engine_token_end`]'s (`0xB` vs `0xE`) so that identical-code
/// folding cannot give both symbols one address, and starts with plain stores (no `lock`).
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn moe_engine_token_begin(index: u64, rec: *const TokenRecord) {
    std::hint::black_box((index, rec, 0xB_u8));
}

/// Marker: step `index` ended; `rec` is complete.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn moe_engine_token_end(index: u64, rec: *const TokenRecord) {
    std::hint::black_box((index, rec, 0xE_u8));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_matches_the_spec_table() {
        use std::mem::offset_of;
        let want = [
            (offset_of!(TokenRecord, magic), 0),
            (offset_of!(TokenRecord, kind), 12),
            (offset_of!(TokenRecord, index), 16),
            (offset_of!(TokenRecord, n_tokens), 24),
            (offset_of!(TokenRecord, wall_ns), 32),
            (offset_of!(TokenRecord, compute_ns), 40),
            (offset_of!(TokenRecord, mgmt_ns), 64),
            (offset_of!(TokenRecord, cpu_ns), 88),
            (offset_of!(TokenRecord, cache_hit_pct), 96),
            (offset_of!(TokenRecord, dense_resident_frac), 104),
            (offset_of!(TokenRecord, rss_bytes), 112),
            (offset_of!(TokenRecord, mem_available_bytes), 144),
        ];
        for (got, w) in want {
            assert_eq!(got, w);
        }
        let r = TokenRecord::new(KIND_PROMPT, 0, 7);
        assert_eq!((r.magic, r.version, r.size, r.n_tokens), (MAGIC, 1, 152, 7));
    }
}
