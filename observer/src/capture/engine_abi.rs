//! What an engine's token record says, in the observer's model: the record copied at an `end`
//! marker, decoded into [`EngineTelemetry`]. The ABI itself (the marker functions, the 152-byte
//! record, *not measured*) is specified in [`moe_abi::markers`].

use moe_abi::{
    markers::{KIND_PROMPT, TokenRecord},
    measured, measured_f64,
};
use observer_common::model::{EngineTelemetry, StepKind};

pub use moe_abi::markers::{SYM_BEGIN, SYM_END};

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
    let r = TokenRecord::from_bytes(b).ok()?;
    let t = EngineTelemetry {
        wall_ns: measured(r.wall_ns),
        compute_ns: measured(r.compute_ns),
        io_ns: measured(r.io_ns),
        stall_ns: measured(r.stall_ns),
        mgmt_ns: measured(r.mgmt_ns),
        read_bytes: measured(r.read_bytes),
        majflt: measured(r.majflt),
        cpu_ns: measured(r.cpu_ns),
        cache_hit_pct: measured_f64(r.cache_hit_pct),
        dense_resident_frac: measured_f64(r.dense_resident_frac),
        rss_bytes: measured(r.rss_bytes),
        rss_anon_bytes: measured(r.rss_anon_bytes),
        rss_file_bytes: measured(r.rss_file_bytes),
        swap_bytes: measured(r.swap_bytes),
        mem_available_bytes: measured(r.mem_available_bytes),
    };
    let kind = if r.kind == KIND_PROMPT { StepKind::Prompt } else { StepKind::Generate };
    Some(Decoded { kind, index: r.index, n_tokens: r.n_tokens.max(1), telemetry: t })
}

#[cfg(test)]
mod tests {
    use moe_abi::markers::KIND_GENERATE;

    use super::*;

    #[test]
    fn decodes_what_the_record_says() {
        let mut r = TokenRecord::new(KIND_PROMPT, 4, 12);
        r.compute_ns = 7_000;
        r.dense_resident_frac = 0.5;
        r.mem_available_bytes = 99;
        let d = decode(r.as_bytes()).unwrap();
        assert_eq!(d.kind, StepKind::Prompt);
        assert_eq!((d.index, d.n_tokens), (4, 12));
        assert_eq!(d.telemetry.compute_ns, Some(7_000));
        assert_eq!(d.telemetry.wall_ns, None, "u64::MAX is not measured");
        assert_eq!(d.telemetry.cache_hit_pct, None, "negative is not measured");
        assert_eq!(d.telemetry.dense_resident_frac, Some(0.5));
        assert_eq!(d.telemetry.mem_available_bytes, Some(99));
        let g = decode(TokenRecord::new(KIND_GENERATE, 5, 0).as_bytes()).unwrap();
        assert_eq!((g.kind, g.n_tokens), (StepKind::Generate, 1), "a step has at least one token");
    }

    #[test]
    fn rejects_other_bytes() {
        assert!(decode(&[0u8; 160]).is_none());
        assert!(decode(&[1, 2, 3]).is_none());
        let mut b = *TokenRecord::new(KIND_GENERATE, 0, 1).as_bytes();
        b[4] = 2;
        assert!(decode(&b).is_none(), "unknown version");
    }
}
