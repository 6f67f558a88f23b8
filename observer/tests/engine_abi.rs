//! The engine defines its own copy of the token-marker record (it does not depend on the
//! observer): both definitions must have the same size, alignment and field offsets, and the
//! observer must decode what the engine writes.

use std::mem::{align_of, offset_of, size_of};

use engine::markers as eng;
use observer::engine_abi::{self as abi, TokenRecordV1};

macro_rules! same_offsets {
    ($($f:ident),* $(,)?) => {
        $(
            assert_eq!(
                offset_of!(eng::TokenRecord, $f),
                offset_of!(TokenRecordV1, $f),
                concat!("offset of `", stringify!($f), "`")
            );
        )*
    };
}

#[test]
fn engine_record_has_the_observers_layout() {
    assert_eq!(size_of::<eng::TokenRecord>(), size_of::<TokenRecordV1>());
    assert_eq!(size_of::<eng::TokenRecord>(), abi::RECORD_SIZE);
    assert_eq!(align_of::<eng::TokenRecord>(), align_of::<TokenRecordV1>());
    same_offsets!(
        magic,
        version,
        size,
        kind,
        index,
        n_tokens,
        wall_ns,
        compute_ns,
        io_ns,
        stall_ns,
        mgmt_ns,
        read_bytes,
        majflt,
        cpu_ns,
        cache_hit_pct,
        dense_resident_frac,
        rss_bytes,
        rss_anon_bytes,
        rss_file_bytes,
        swap_bytes,
        mem_available_bytes,
    );
    assert_eq!((eng::MAGIC, eng::VERSION, eng::RECORD_SIZE), (abi::MAGIC, abi::VERSION, abi::RECORD_SIZE));
    assert_eq!((eng::SYM_BEGIN, eng::SYM_END), (abi::SYM_BEGIN, abi::SYM_END));
}

#[test]
fn observer_decodes_an_engine_record() {
    let mut r = eng::TokenRecord::new(eng::KIND_GENERATE, 7, 1);
    r.wall_ns = 5_000_000;
    r.compute_ns = 4_900_000;
    r.mgmt_ns = 100_000;
    r.io_ns = 0;
    r.dense_resident_frac = 0.25;
    r.swap_bytes = 3 << 20;
    // SAFETY: repr(C) plain data of RECORD_SIZE bytes, read as bytes.
    let bytes = unsafe { std::slice::from_raw_parts((&r as *const eng::TokenRecord).cast::<u8>(), eng::RECORD_SIZE) };
    let d = abi::decode(bytes).expect("the observer decodes the engine's record");
    assert_eq!(d.kind, observer_common::model::StepKind::Generate);
    assert_eq!((d.index, d.n_tokens), (7, 1));
    let t = d.telemetry;
    assert_eq!((t.wall_ns, t.compute_ns, t.mgmt_ns, t.io_ns), (Some(5_000_000), Some(4_900_000), Some(100_000), Some(0)));
    assert_eq!(t.dense_resident_frac, Some(0.25));
    assert_eq!(t.swap_bytes, Some(3 << 20));
    assert_eq!((t.majflt, t.cache_hit_pct, t.rss_bytes), (None, None, None), "not measured");
}
