//! The token-marker ABI between an engine and the observer (version 1).
//!
//! ## Spec
//! An engine exports two functions with C linkage that are never inlined:
//!
//! ```c
//! void moe_engine_token_begin(uint64_t index, const struct moe_token_record *rec);
//! void moe_engine_token_end(uint64_t index, const struct moe_token_record *rec);
//! ```
//!
//! and calls `begin` before the work of a step (a generated token, or the
//! whole prompt as one step) and `end` after it, once `rec` is complete. The
//! observer attaches uprobes to both by symbol; at `end` it copies `rec`.
//!
//! `struct moe_token_record`, little-endian, 152 bytes, `repr(C)`:
//!
//! | offset | type | field | meaning |
//! |---|---|---|---|
//! | 0 | u32 | `magic` | `0x4B4F544D` (`"MTOK"`) |
//! | 4 | u32 | `version` | 1 |
//! | 8 | u32 | `size` | `sizeof(struct)`, 152 for v1 |
//! | 12 | u32 | `kind` | 0 prompt, 1 generated token |
//! | 16 | u64 | `index` | token index (same as the argument) |
//! | 24 | u64 | `n_tokens` | tokens processed in the step (prompt length, or 1) |
//! | 32 | u64 | `wall_ns` | the engine's own wall time of the step |
//! | 40 | u64 | `compute_ns` | the engine's `compute`: wall minus what it timed (a residual) |
//! | 48 | u64 | `io_ns` | time in explicit reads |
//! | 56 | u64 | `stall_ns` | time waiting for I/O it could not overlap |
//! | 64 | u64 | `mgmt_ns` | cache management |
//! | 72 | u64 | `read_bytes` | bytes read explicitly |
//! | 80 | u64 | `majflt` | major faults (getrusage delta around the step) |
//! | 88 | u64 | `cpu_ns` | user+system CPU time (getrusage delta) |
//! | 96 | f64 | `cache_hit_pct` | expert-cache hit rate, < 0 without a cache |
//! | 104 | f64 | `dense_resident_frac` | dense weights resident, < 0 when not sampled |
//! | 112 | u64 | `rss_bytes` | |
//! | 120 | u64 | `rss_anon_bytes` | |
//! | 128 | u64 | `rss_file_bytes` | |
//! | 136 | u64 | `swap_bytes` | |
//! | 144 | u64 | `mem_available_bytes` | |
//!
//! An integer field of `u64::MAX` means *not measured*.

use observer_common::model::{EngineTelemetry, StepKind};

pub const SYM_BEGIN: &str = "moe_engine_token_begin";
pub const SYM_END: &str = "moe_engine_token_end";
pub const MAGIC: u32 = 0x4B4F_544D;
pub const VERSION: u32 = 1;
pub const RECORD_SIZE: usize = 152;

/// The record as an engine lays it out.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct TokenRecordV1 {
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
const _: () = assert!(std::mem::size_of::<TokenRecordV1>() == RECORD_SIZE);

impl TokenRecordV1 {
    pub const fn empty() -> Self {
        TokenRecordV1 {
            magic: MAGIC,
            version: VERSION,
            size: RECORD_SIZE as u32,
            kind: 1,
            index: 0,
            n_tokens: 1,
            wall_ns: u64::MAX,
            compute_ns: u64::MAX,
            io_ns: u64::MAX,
            stall_ns: u64::MAX,
            mgmt_ns: u64::MAX,
            read_bytes: u64::MAX,
            majflt: u64::MAX,
            cpu_ns: u64::MAX,
            cache_hit_pct: -1.0,
            dense_resident_frac: -1.0,
            rss_bytes: u64::MAX,
            rss_anon_bytes: u64::MAX,
            rss_file_bytes: u64::MAX,
            swap_bytes: u64::MAX,
            mem_available_bytes: u64::MAX,
        }
    }
}

fn u64_at(b: &[u8], off: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(off..off + 8)?.try_into().ok()?))
}
fn u32_at(b: &[u8], off: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(off..off + 4)?.try_into().ok()?))
}

fn measured(v: Option<u64>) -> Option<u64> {
    v.filter(|&v| v != u64::MAX)
}
fn measured_f(v: Option<u64>) -> Option<f64> {
    v.map(f64::from_bits).filter(|v| *v >= 0.0 && v.is_finite())
}

/// What a decoded record says about its step.
#[derive(Debug, Clone, PartialEq)]
pub struct Decoded {
    pub kind: StepKind,
    pub index: u64,
    pub n_tokens: u64,
    pub telemetry: EngineTelemetry,
}

/// Decode the bytes copied at an `end` mark; `None` when they are not a v1 record.
pub fn decode(b: &[u8]) -> Option<Decoded> {
    if u32_at(b, 0)? != MAGIC || u32_at(b, 4)? != VERSION || (u32_at(b, 8)? as usize) < RECORD_SIZE {
        return None;
    }
    let kind = if u32_at(b, 12)? == 0 { StepKind::Prompt } else { StepKind::Generate };
    let t = EngineTelemetry {
        wall_ns: measured(u64_at(b, 32)),
        compute_ns: measured(u64_at(b, 40)),
        io_ns: measured(u64_at(b, 48)),
        stall_ns: measured(u64_at(b, 56)),
        mgmt_ns: measured(u64_at(b, 64)),
        read_bytes: measured(u64_at(b, 72)),
        majflt: measured(u64_at(b, 80)),
        cpu_ns: measured(u64_at(b, 88)),
        cache_hit_pct: measured_f(u64_at(b, 96)),
        dense_resident_frac: measured_f(u64_at(b, 104)),
        rss_bytes: measured(u64_at(b, 112)),
        rss_anon_bytes: measured(u64_at(b, 120)),
        rss_file_bytes: measured(u64_at(b, 128)),
        swap_bytes: measured(u64_at(b, 136)),
        mem_available_bytes: measured(u64_at(b, 144)),
    };
    Some(Decoded { kind, index: u64_at(b, 16)?, n_tokens: u64_at(b, 24)?.max(1), telemetry: t })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(r: &TokenRecordV1) -> Vec<u8> {
        // SAFETY: repr(C) plain data, read as bytes.
        unsafe { std::slice::from_raw_parts((r as *const TokenRecordV1).cast::<u8>(), RECORD_SIZE) }.to_vec()
    }

    #[test]
    fn decodes_what_the_struct_lays_out() {
        let mut r = TokenRecordV1::empty();
        r.kind = 0;
        r.index = 4;
        r.n_tokens = 12;
        r.compute_ns = 7_000;
        r.dense_resident_frac = 0.5;
        r.mem_available_bytes = 99;
        let d = decode(&bytes(&r)).unwrap();
        assert_eq!(d.kind, StepKind::Prompt);
        assert_eq!((d.index, d.n_tokens), (4, 12));
        assert_eq!(d.telemetry.compute_ns, Some(7_000));
        assert_eq!(d.telemetry.wall_ns, None, "u64::MAX is not measured");
        assert_eq!(d.telemetry.cache_hit_pct, None, "negative is not measured");
        assert_eq!(d.telemetry.dense_resident_frac, Some(0.5));
        assert_eq!(d.telemetry.mem_available_bytes, Some(99));
    }

    #[test]
    fn rejects_other_bytes() {
        assert!(decode(&[0u8; 160]).is_none());
        assert!(decode(&[1, 2, 3]).is_none());
        let mut b = bytes(&TokenRecordV1::empty());
        b[4] = 2;
        assert!(decode(&b).is_none(), "unknown version");
    }
}
