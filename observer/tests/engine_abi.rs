//! The engine defines its own copy of the token-marker record (it does not depend on the
//! observer): both definitions must have the same size, alignment and field offsets, and the
//! observer must decode what the engine writes. The same for the dense-regions header the
//! engine publishes its anonymous dense copy in (`moe_engine_dense_regions`).

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
    assert_eq!(
        (t.wall_ns, t.compute_ns, t.mgmt_ns, t.io_ns),
        (Some(5_000_000), Some(4_900_000), Some(100_000), Some(0))
    );
    assert_eq!(t.dense_resident_frac, Some(0.25));
    assert_eq!(t.swap_bytes, Some(3 << 20));
    assert_eq!((t.majflt, t.cache_hit_pct, t.rss_bytes), (None, None, None), "not measured");
}

// ---- the dense-regions ABI (`moe_engine_dense_regions`) ------------------------

use engine::dense_regions as dr;
use observer::residency::anon::{self as oa, DenseCopy, DenseRegionsV1};

/// This test binary exports the header as the `engine` binary does (`engine/src/main.rs`), so
/// that the observer's reader can find it in `/proc/self/exe`.
#[unsafe(no_mangle)]
#[used]
pub static moe_engine_dense_regions: dr::DenseRegions = dr::DenseRegions::new();

#[test]
fn engine_dense_regions_have_the_observers_layout() {
    assert_eq!(size_of::<dr::DenseRegions>(), size_of::<DenseRegionsV1>());
    assert_eq!(size_of::<dr::DenseRegions>(), oa::HEADER_SIZE);
    assert_eq!(align_of::<dr::DenseRegions>(), align_of::<DenseRegionsV1>());
    for (e, o) in [
        (offset_of!(dr::DenseRegions, magic), offset_of!(DenseRegionsV1, magic)),
        (offset_of!(dr::DenseRegions, version), offset_of!(DenseRegionsV1, version)),
        (offset_of!(dr::DenseRegions, seq), offset_of!(DenseRegionsV1, seq)),
        (offset_of!(dr::DenseRegions, count), offset_of!(DenseRegionsV1, count)),
        (offset_of!(dr::DenseRegions, table), offset_of!(DenseRegionsV1, table)),
    ] {
        assert_eq!(e, o, "header field offsets");
    }
    assert_eq!(size_of::<dr::DenseRange>(), size_of::<oa::DenseRange>());
    assert_eq!(size_of::<dr::DenseRange>(), oa::ENTRY_SIZE);
    assert_eq!(offset_of!(dr::DenseRange, addr), offset_of!(oa::DenseRange, addr));
    assert_eq!(offset_of!(dr::DenseRange, len), offset_of!(oa::DenseRange, len));
    assert_eq!(offset_of!(dr::DenseRange, file_offset), offset_of!(oa::DenseRange, file_offset));
    assert_eq!((dr::MAGIC, dr::VERSION, dr::SYMBOL), (oa::MAGIC, oa::VERSION, oa::SYMBOL));
    let h = dr::DenseRegions::new();
    assert_eq!((h.magic, h.version), (oa::MAGIC, oa::VERSION));
}

/// The engine's placement publishes its copy, the observer's reader finds it in this process
/// (symbol, load bias, `/proc/self/mem`, seqlock) with the same entries, `/proc/self/pagemap`
/// covers exactly the copy's pages, and dropping the model unpublishes it.
#[test]
fn observer_reads_what_the_engine_placement_publishes() {
    use engine::{model::Model, placement::DensePolicy};
    dr::export(&moe_engine_dense_regions);
    let path = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("engine-abi-dense.gguf");
    if !path.exists() {
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        let c = engine::synth::SynthConfig::preset("tiny").unwrap();
        engine::synth::write_model(&c, &tmp, 2, |_| {}).unwrap();
        std::fs::rename(&tmp, &path).unwrap();
    }
    let mut reader = DenseCopy::new(std::process::id());
    assert_eq!(reader.ranges().unwrap(), Some(Vec::new()), "the symbol is found, nothing published yet");

    let m = Model::load_with(&path, DensePolicy::Anon).unwrap();
    let published = m.placement.published_ranges();
    assert!(!published.is_empty());
    let seen = reader.ranges().unwrap().expect("the symbol");
    let want: Vec<oa::DenseRange> =
        published.iter().map(|d| oa::DenseRange { addr: d.addr, len: d.len, file_offset: d.file_offset }).collect();
    assert_eq!(seen, want, "the observer reads the engine's entries");
    // Each entry is a copy of the file's bytes at its offset.
    for d in &published {
        // SAFETY: a published range of the live copy (the model is alive and never written).
        let copy = unsafe { std::slice::from_raw_parts(d.addr as *const u8, d.len as usize) };
        let off = d.file_offset as usize;
        assert!(copy == &m.gguf.bytes()[off..off + d.len as usize], "entry at file offset {off}");
    }
    // The entries' pages are exactly the copy's pages, each counted once.
    let copy = m.placement.copy_range().unwrap();
    let page = engine::placement::page_size() as u64;
    let a = reader.pagemap(&seen).unwrap();
    assert_eq!(a.pages, (copy.end - copy.start) as u64 / page, "pages of the entries vs the copy");
    assert_eq!(a.present, a.pages, "a fresh copy is resident");
    assert_eq!(a.swapped, 0);
    assert!(seen.iter().all(|d| d.addr >= copy.start as u64 && d.addr + d.len <= copy.end as u64));

    drop(m);
    assert_eq!(reader.ranges().unwrap(), Some(Vec::new()), "unpublished when the model is dropped");
}
