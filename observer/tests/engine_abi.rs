//! The engine and the observer share one ABI, the `moe-abi` crate, so there are no two copies to
//! compare. What is checked here: the *built* `engine` binary exports what the ABI specifies, in
//! its layout, found the way the observer finds it; and the observer's reader reads what the
//! engine's placement publishes.

use std::{
    mem::size_of,
    path::{Path, PathBuf},
};

use engine::dense_regions as dr;
use moe_abi::{dense_regions::DenseRegions, expert_slots, markers};
use object::{Object, ObjectSection, ObjectSymbol, SymbolKind};
use observer::capture::{bpf::elf_symbol_addr, residency::anon::DenseCopy};

/// The release `engine` binary beside the observer's (`cargo xtask test` builds both).
fn engine_bin() -> PathBuf {
    let p = Path::new(env!("CARGO_BIN_EXE_observer")).with_file_name("engine");
    assert!(p.exists(), "{} missing: run `cargo build --release -p engine` (cargo xtask test does)", p.display());
    p
}

#[test]
fn the_engine_binary_exports_the_abi_in_the_crates_layout() {
    let exe = engine_bin();
    let data = std::fs::read(&exe).unwrap_or_else(|e| panic!("{}: {e}", exe.display()));
    let file = object::File::parse(&*data).expect("the engine is an ELF file");
    let symbol = |name: &str| {
        let at = elf_symbol_addr(&exe, name);
        let sym = file.symbols().find(|s| s.name() == Ok(name) && s.is_definition());
        assert_eq!(sym.as_ref().map(|s| s.address()), at, "{name}: the observer's lookup finds the symbol");
        sym
    };
    // The token markers: two functions at distinct addresses.
    let marks: Vec<_> = [markers::SYM_BEGIN, markers::SYM_END]
        .map(|name| symbol(name).unwrap_or_else(|| panic!("{} does not export {name}", exe.display())))
        .into();
    for m in &marks {
        assert_eq!(m.kind(), SymbolKind::Text, "{:?} is a function", m.name());
    }
    assert_ne!(marks[0].address(), marks[1].address(), "the markers were folded to one address");

    // The dense-regions header: a data object of the crate's size, initialised to an empty table.
    let h = symbol(dr::SYMBOL).unwrap_or_else(|| panic!("{} does not export {}", exe.display(), dr::SYMBOL));
    assert_eq!(h.kind(), SymbolKind::Data, "{} is a data object", dr::SYMBOL);
    assert_eq!(h.size(), size_of::<DenseRegions>() as u64, "{} has the crate's size", dr::SYMBOL);
    let sec = file.section_by_index(h.section_index().expect("a defined symbol has a section")).unwrap();
    let image = sec.data().unwrap();
    let at = (h.address() - sec.address()) as usize;
    let header = DenseRegions::parse_header(&image[at..at + h.size() as usize]).expect("the header in the file");
    assert!(header.stable() && header.is_empty() && header.seq == 0, "nothing published in the image: {header:?}");

    // The expert-cache slot table is reserved: no engine writes it yet.
    assert!(
        symbol(expert_slots::SYMBOL).is_none(),
        "the engine now exports {}: check its size and image here like the dense-regions header's",
        expert_slots::SYMBOL
    );
}

/// This test binary exports the header as the `engine` binary does (`engine/src/main.rs`), so
/// that the observer's reader can find it in `/proc/self/exe`.
#[unsafe(no_mangle)]
#[used]
pub static moe_engine_dense_regions: DenseRegions = DenseRegions::new();

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
    assert_eq!(seen, published, "the observer reads the engine's entries");
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
