//! Token markers and the per-step record (version 1).
//!
//! ## Spec
//! The engine's executable exports two functions with C linkage, never inlined, each with a body
//! of its own (so that the linker cannot fold them to one address) and without an atomic
//! read-modify-write as first instruction (x86 uprobes refuse a `lock` prefix); [`crate::token_markers!`]
//! defines them so:
//!
//! ```c
//! void moe_engine_token_begin(uint64_t index, const struct moe_token_record *rec);
//! void moe_engine_token_end(uint64_t index, const struct moe_token_record *rec);
//! ```
//!
//! The engine calls `begin` before the work of a step and `end` after it, once `rec` is
//! complete; `rec` stays valid and unchanged until `end` returns. A step is the whole prompt
//! (kind 0, `n_tokens` = the prompt's length) or one generated token (kind 1, `n_tokens` = 1);
//! `index` counts steps from 0. An observer attaches uprobes to both symbols and copies `rec`
//! (exactly [`RECORD_SIZE`] bytes) at `end`.
//!
//! `struct moe_token_record` ([`TokenRecord`]), 152 bytes:
//!
//! | offset | type | field | meaning |
//! |---|---|---|---|
//! | 0 | u32 | `magic` | `0x4B4F544D` (`"MTOK"` in memory) |
//! | 4 | u32 | `version` | 1 |
//! | 8 | u32 | `size` | bytes of the record, ≥ 152 (a later revision may append fields without a new version; readers read the ones they know) |
//! | 12 | u32 | `kind` | 0 prompt, 1 generated token |
//! | 16 | u64 | `index` | the step's index, as passed to the markers |
//! | 24 | u64 | `n_tokens` | tokens processed in the step |
//! | 32 | u64 | `wall_ns` | the engine's own wall time of the step |
//! | 40 | u64 | `compute_ns` | the engine's `compute`: `wall − io − stall − mgmt`, a residual that silently contains whatever the kernel did on its threads (faults, swap-ins, reclaim) |
//! | 48 | u64 | `io_ns` | time in explicit reads of weights (`pread`, `O_DIRECT`, …; page faults are not explicit reads) |
//! | 56 | u64 | `stall_ns` | time waiting for reads it could not overlap with compute |
//! | 64 | u64 | `mgmt_ns` | the engine's own bookkeeping that it timed (expert-cache management, telemetry sampling) |
//! | 72 | u64 | `read_bytes` | bytes read explicitly |
//! | 80 | u64 | `majflt` | major faults of the process in the step (`getrusage(RUSAGE_SELF)` delta) |
//! | 88 | u64 | `cpu_ns` | user + system CPU time of all threads in the step (`getrusage` delta) |
//! | 96 | f64 | `cache_hit_pct` | expert-cache hit rate of the step in percent; negative (−1) when the engine has no expert cache |
//! | 104 | f64 | `dense_resident_frac` | share of the dense weights in RAM (0–1) as the engine sampled it; negative when not sampled |
//! | 112 | u64 | `rss_bytes` | `VmRSS` of `/proc/self/status` at the end of the step |
//! | 120 | u64 | `rss_anon_bytes` | `RssAnon`, likewise |
//! | 128 | u64 | `rss_file_bytes` | `RssFile`, likewise |
//! | 136 | u64 | `swap_bytes` | `VmSwap`, likewise |
//! | 144 | u64 | `mem_available_bytes` | `MemAvailable` of `/proc/meminfo` (machine-wide, not the cgroup's) |
//!
//! Not measured: `u64::MAX` in an integer field, a negative value in a float field (see the
//! crate's rules). What a given engine measures in each field is its own documentation's
//! business (the embedded engine's: `engine::telemetry`).

use crate::{AbiError, NOT_MEASURED, assert_layout};

/// `moe_engine_token_begin`.
pub const SYM_BEGIN: &str = "moe_engine_token_begin";
/// `moe_engine_token_end`.
pub const SYM_END: &str = "moe_engine_token_end";
pub const MAGIC: u32 = 0x4B4F_544D;
pub const VERSION: u32 = 1;
/// `sizeof(struct moe_token_record)` of version 1: what an observer copies at `end`.
pub const RECORD_SIZE: usize = 152;

/// Step kinds ([`TokenRecord::kind`]).
pub const KIND_PROMPT: u32 = 0;
pub const KIND_GENERATE: u32 = 1;

/// `struct moe_token_record`, version 1 (the table in the module docs).
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
// Every field at its offset and the size: the record has no padding.
assert_layout!(TokenRecord, RECORD_SIZE, align 8, {
    magic: 0, version: 4, size: 8, kind: 12, index: 16, n_tokens: 24, wall_ns: 32, compute_ns: 40,
    io_ns: 48, stall_ns: 56, mgmt_ns: 64, read_bytes: 72, majflt: 80, cpu_ns: 88, cache_hit_pct: 96,
    dense_resident_frac: 104, rss_bytes: 112, rss_anon_bytes: 120, rss_file_bytes: 128, swap_bytes: 136,
    mem_available_bytes: 144,
});

impl TokenRecord {
    /// A record for step `index` of `kind` over `n_tokens` tokens, every measurement
    /// *not measured*.
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

    /// The record's bytes, as an observer copies them.
    pub fn as_bytes(&self) -> &[u8; RECORD_SIZE] {
        // SAFETY: `TokenRecord` is `repr(C)`, RECORD_SIZE bytes, without padding (asserted above),
        // so all its bytes are initialised; u8 has no alignment requirement.
        unsafe { &*(self as *const Self).cast::<[u8; RECORD_SIZE]>() }
    }

    /// The record in `bytes` (copied at an `end` marker), checked: at least [`RECORD_SIZE`]
    /// bytes, this magic and version, and a `size` of at least [`RECORD_SIZE`].
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, AbiError> {
        const WHAT: &str = "moe_token_record";
        crate::need(WHAT, bytes, RECORD_SIZE)?;
        crate::check_magic(WHAT, bytes, MAGIC, VERSION)?;
        // SAFETY: at least RECORD_SIZE bytes are readable; the record is `repr(C)` u32, u64 and
        // f64 fields without padding, for which every bit pattern is a value; `read_unaligned`
        // takes any alignment.
        let r: TokenRecord = unsafe { core::ptr::read_unaligned(bytes.as_ptr().cast()) };
        if (r.size as usize) < RECORD_SIZE {
            return Err(AbiError::Short { what: "moe_token_record.size", len: r.size as usize, need: RECORD_SIZE });
        }
        Ok(r)
    }
}

/// Defines the two marker functions, `moe_engine_token_begin` and `moe_engine_token_end`
/// (`extern "C" fn(u64, *const TokenRecord)`), as the spec wants them, in the module that
/// invokes it; the executable that calls them exports them.
///
/// The bodies differ (a different tag each) so that identical-code folding cannot give both
/// symbols one address, which would fire both probes on each call, and start with plain stores
/// (no `lock` prefix).
#[macro_export]
macro_rules! token_markers {
    () => {
        /// Marker: step `index` begins; `rec` carries its kind, index and token count.
        #[unsafe(no_mangle)]
        #[inline(never)]
        pub extern "C" fn moe_engine_token_begin(index: u64, rec: *const $crate::markers::TokenRecord) {
            ::core::hint::black_box((index, rec, 0xB_u8));
        }

        /// Marker: step `index` ended; `rec` is complete.
        #[unsafe(no_mangle)]
        #[inline(never)]
        pub extern "C" fn moe_engine_token_end(index: u64, rec: *const $crate::markers::TokenRecord) {
            ::core::hint::black_box((index, rec, 0xE_u8));
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_record_reads_back_from_its_bytes() {
        let mut r = TokenRecord::new(KIND_PROMPT, 0, 7);
        assert_eq!((r.magic, r.version, r.size, r.n_tokens), (MAGIC, 1, 152, 7));
        assert_eq!(&MAGIC.to_le_bytes(), b"MTOK");
        r.compute_ns = 7_000;
        r.dense_resident_frac = 0.5;
        let b = r.as_bytes();
        assert_eq!(u64::from_le_bytes(b[40..48].try_into().unwrap()), 7_000, "compute_ns at 40");
        assert_eq!(f64::from_le_bytes(b[104..112].try_into().unwrap()), 0.5, "dense_resident_frac at 104");
        assert_eq!(TokenRecord::from_bytes(b), Ok(r));
        // Unaligned, and longer (a later revision's record).
        let mut long = [0u8; RECORD_SIZE + 9];
        long[1..1 + RECORD_SIZE].copy_from_slice(b);
        long[9] = 160; // size 160
        assert_eq!(TokenRecord::from_bytes(&long[1..]).map(|r| (r.size, r.compute_ns)), Ok((160, 7_000)));
    }

    #[test]
    fn other_bytes_are_refused() {
        let r = TokenRecord::new(KIND_GENERATE, 3, 1);
        let b = *r.as_bytes();
        assert!(matches!(TokenRecord::from_bytes(&b[..RECORD_SIZE - 1]), Err(AbiError::Short { .. })));
        assert!(matches!(TokenRecord::from_bytes(&[0; 160]), Err(AbiError::Mismatch { magic: 0, .. })));
        let mut v2 = b;
        v2[4] = 2;
        assert!(matches!(TokenRecord::from_bytes(&v2), Err(AbiError::Mismatch { version: 2, .. })));
        let mut small = b;
        small[8] = 100;
        assert!(matches!(TokenRecord::from_bytes(&small), Err(AbiError::Short { len: 100, .. })));
    }

    crate::token_markers!();

    #[test]
    fn the_macro_defines_two_distinct_markers() {
        let r = TokenRecord::new(KIND_GENERATE, 1, 1);
        moe_engine_token_begin(1, &r);
        moe_engine_token_end(1, &r);
        let (b, e) = (moe_engine_token_begin as *const () as usize, moe_engine_token_end as *const () as usize);
        assert_ne!(b, e, "folded to one address");
    }
}
