//! The engine and the observer share one ABI, the `moe-abi` crate, so there are no two copies to
//! compare. What is checked here: the *built* `engine` binary exports what the ABI specifies, in
//! its layout, found the way the observer finds it; and the observer's reader reads what the
//! engine's placement publishes.

use std::{
    mem::size_of,
    path::{Path, PathBuf},
};

use engine::dense_regions as dr;
use moe_abi::{
    dense_regions::DenseRegions,
    expert_slots::{self, ExpertSlots},
    markers,
};
use object::{Object, ObjectSection, ObjectSymbol, SymbolKind};
use observer::capture::{
    bpf::elf_symbol_addr,
    residency::{
        anon::DenseCopy,
        slots::{SlotTable, hit_pct},
    },
};

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

    // The expert-cache slot table: the same checks.
    let h = symbol(expert_slots::SYMBOL)
        .unwrap_or_else(|| panic!("{} does not export {}", exe.display(), expert_slots::SYMBOL));
    assert_eq!(h.kind(), SymbolKind::Data, "{} is a data object", expert_slots::SYMBOL);
    assert_eq!(h.size(), size_of::<ExpertSlots>() as u64, "{} has the crate's size", expert_slots::SYMBOL);
    let sec = file.section_by_index(h.section_index().expect("a defined symbol has a section")).unwrap();
    let image = sec.data().unwrap();
    let at = (h.address() - sec.address()) as usize;
    let header = ExpertSlots::parse_header(&image[at..at + h.size() as usize]).expect("the header in the file");
    assert!(header.stable() && header.is_empty() && header.seq == 0, "nothing published in the image: {header:?}");
}

/// The `tiny` synthetic model (generated once per target directory).
fn tiny_model() -> PathBuf {
    // Tests of this binary run in parallel: one of them writes the file, the others wait.
    static ONCE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _once = ONCE.lock().unwrap_or_else(|e| e.into_inner());
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("engine-abi-dense.gguf");
    if !path.exists() {
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        let c = engine::synth::SynthConfig::preset("tiny").unwrap();
        engine::synth::write_model(&c, &tmp, 2, |_| {}).unwrap();
        std::fs::rename(&tmp, &path).unwrap();
    }
    path
}

/// This test binary exports the header as the `engine` binary does (`engine/src/main.rs`), so
/// that the observer's reader can find it in `/proc/self/exe`.
#[unsafe(no_mangle)]
#[used]
pub static moe_engine_dense_regions: DenseRegions = DenseRegions::new();

/// The engine's placement publishes its copy, the observer's reader finds it in this process
/// (symbol, load bias, `/proc/self/mem`, seqlock) with the same entries, `/proc/self/pagemap`
/// covers exactly the copy's pages, and dropping the model unpublishes it.
/// The tests that publish dense ranges (one process-wide table) run one at a time.
static PUBLISHING: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn observer_reads_what_the_engine_placement_publishes() {
    use engine::{model::Model, placement::DensePolicy};
    let _one = PUBLISHING.lock().unwrap_or_else(|e| e.into_inner());
    dr::export(&moe_engine_dense_regions);
    let path = tiny_model();
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

/// An engine unpublishes a copy before it unmaps it (`AnonCopy`'s drop), but the observer reads
/// the table, then the copy's pages: a copy that goes in between was read as 0 resident and 0
/// swapped (CI saw it at an engine's last token). Here a thread maps, touches and publishes a
/// 64-page copy, keeps it up to 350 µs, then unpublishes and unmaps it, while the reader samples:
/// every reading that stands has every page resident.
#[test]
fn a_copy_unmapped_while_its_pages_are_read_is_never_read_as_gone() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
    let _one = PUBLISHING.lock().unwrap_or_else(|e| e.into_inner());
    dr::export(&moe_engine_dense_regions);
    let page = engine::placement::page_size();
    let len = 64 * page;
    let (stop, cycles) = (AtomicBool::new(false), AtomicU64::new(0));
    let (mut stood, mut gone, mut changing) = (0u64, Vec::new(), 0u64);
    std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Relaxed) {
                // SAFETY: a fresh private anonymous mapping, touched, published, unpublished,
                // then unmapped; nothing else uses it.
                unsafe {
                    let p = testkit::map_anon(len);
                    assert_ne!(p, libc::MAP_FAILED);
                    for i in 0..64 {
                        p.cast::<u8>().add(i * page).write_volatile(1);
                    }
                    let publication =
                        dr::publish(vec![dr::DenseRange { addr: p as u64, len: len as u64, file_offset: 0 }]);
                    // Published for 0 to 350 µs, so that reads start at every point of its life.
                    let until =
                        std::time::Instant::now() + std::time::Duration::from_micros(50 * (cycles.load(Relaxed) % 8));
                    while std::time::Instant::now() < until {
                        std::hint::spin_loop();
                    }
                    drop(publication);
                    libc::munmap(p, len);
                }
                cycles.fetch_add(1, Relaxed);
            }
        });
        let mut reader = DenseCopy::new(std::process::id());
        let end = std::time::Instant::now() + std::time::Duration::from_secs(3);
        while std::time::Instant::now() < end {
            match reader.sample() {
                Ok(Some(a)) => {
                    stood += 1;
                    if a.present != a.pages {
                        gone.push(a);
                    }
                }
                Ok(None) => {}
                Err(e) if e.to_string().contains("kept changing") => changing += 1,
                Err(e) => panic!("{e}"),
            }
        }
        stop.store(true, Relaxed);
    });
    eprintln!(
        "{} copies came and went; {stood} readings stood, {changing} gave up on a changing table",
        cycles.load(Relaxed)
    );
    assert!(gone.is_empty(), "{} of {stood} readings counted pages already gone, e.g. {:?}", gone.len(), gone[0]);
    assert!(stood >= 100, "only {stood} readings stood in 3 s");
}

/// The slot table, exported like `moe_engine_dense_regions` above.
#[unsafe(no_mangle)]
#[used]
pub static moe_engine_expert_slots: ExpertSlots = ExpertSlots::new();

/// The engine's expert cache publishes its slots; the observer's reader finds them in this
/// process (symbol, load bias, `/proc/self/mem`, seqlock). The reads it derives from the table's
/// version counter alone equal the cache's own miss count (counted where the layers ask for
/// their experts, not in the table), so its hit rate equals the engine's; its ready cells are
/// the slots' experts in the grid's rows; dropping the cache clears the table.
#[test]
fn observer_reads_the_engine_caches_slot_table() {
    use engine::{
        cache::{CacheConfig, ExpertCache},
        model::{Model, Session},
        placement::DensePolicy,
        regions::RegionMap,
    };
    engine::cache::slots::export(&moe_engine_expert_slots);
    // Dense weights on the mapping: an anonymous copy would be published to the dense-regions
    // table that the test above reads meanwhile.
    let m = Model::load_with(tiny_model(), DensePolicy::Mmap).unwrap();
    let map = RegionMap::from_gguf(&m.gguf).unwrap();
    let mut reader = SlotTable::new(std::process::id(), &map.moe_layers, map.n_experts);
    assert_eq!(reader.sample().unwrap(), None, "the symbol is found, no cache yet");

    // A third of the experts: misses on every token.
    let probe = ExpertCache::new(&m, CacheConfig { bytes: 1 << 40, io_threads: 1, lock: false, prefetch: false });
    let slot_bytes = probe.unwrap().slot_bytes();
    let n_slots = map.moe_layers.len() * map.n_experts as usize / 3;
    let cfg = CacheConfig { bytes: (n_slots * slot_bytes) as u64, io_threads: 2, lock: false, prefetch: false };
    let c = ExpertCache::new(&m, cfg).unwrap();
    let first = reader.sample().unwrap().expect("the cache publishes its table");
    assert_eq!((first.slots as usize, first.loading, first.reads), (c.n_slots(), 0, None));
    assert!(first.ready.is_empty());

    let mut sess = Session::new(&m, 2, 64).with_experts(&c);
    let prompt: Vec<u32> = (0..8).map(|i| (i * 37 + 5) % 256).collect();
    let mut tok = engine::sampling::argmax(sess.step(&prompt).unwrap());
    let after_prompt = c.stats();
    let p = reader.sample().unwrap().unwrap();
    assert_eq!(p.reads, Some(after_prompt.misses), "reads for the prompt (version counter) vs the cache's misses");
    let (layers, k) = (map.moe_layers.len() as u64, m.cfg.n_expert_used as u64);
    for _ in 0..16 {
        tok = engine::sampling::argmax(sess.step(&[tok]).unwrap());
    }
    let s = c.stats().since(&after_prompt);
    let g = reader.sample().unwrap().unwrap();
    assert_eq!(s.hits + s.misses, 16 * layers * k, "every generated token used k experts per MoE layer");
    assert!(s.misses > 0 && s.hits > 0, "{s:?}");
    assert_eq!(g.reads, Some(s.misses), "reads for 16 tokens (version counter) vs the cache's misses");
    let (ours, engine) = (hit_pct(g.reads.unwrap(), 16, layers, k).unwrap(), s.hit_pct().unwrap());
    assert!((ours - engine).abs() < 1e-9, "observer {ours} % vs engine {engine} %");
    assert!(g.version > p.version && g.loading == 0);

    let row = |layer: u32| map.moe_layers.iter().position(|&b| b == layer).unwrap() as u32;
    let mut want: Vec<u32> = c
        .table()
        .iter()
        .filter(|s| s.state.load(std::sync::atomic::Ordering::SeqCst) == expert_slots::STATE_READY)
        .map(|s| {
            let ld = |a: &std::sync::atomic::AtomicU32| a.load(std::sync::atomic::Ordering::SeqCst);
            row(ld(&s.layer)) * map.n_experts + ld(&s.expert)
        })
        .collect();
    want.sort_unstable();
    assert_eq!(g.ready, want, "the ready cells are the cache's slots");
    assert_eq!(g.ready.len(), n_slots, "a full cache after 17 steps");
    heatmap_shows_the_cache(&map, &want, n_slots);

    drop(sess);
    drop(c);
    assert_eq!(reader.sample().unwrap(), None, "unpublished when the cache is dropped");
}

/// `observer heatmap --pid` on this process while its cache holds `want` (grid cells) in
/// `n_slots` slots and is idle: the JSON's `engine_cache` holds those cells, with no reads
/// between two refreshes; the terminal grid counts them per layer.
fn heatmap_shows_the_cache(map: &engine::regions::RegionMap, want: &[u32], n_slots: usize) {
    let model = tiny_model();
    let pid = std::process::id().to_string();
    let heatmap = |extra: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_observer"))
            .arg("heatmap")
            .arg(&model)
            .args(["--pid", &pid])
            .args(extra)
            .output()
            .expect("running observer heatmap");
        assert!(out.status.success(), "observer heatmap: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let text = heatmap(&["--json", "--watch", "--count", "2", "--interval", "20ms"]);
    let lines: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 2, "{text}");
    for (i, v) in lines.iter().enumerate() {
        let c = &v["engine_cache"];
        assert_eq!(c["pid"], std::process::id(), "{c}");
        assert_eq!(c["slots"].as_u64(), Some(n_slots as u64), "{c}");
        assert_eq!(c["loading"].as_u64(), Some(0), "{c}");
        let ready: Vec<u32> = c["ready"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
        assert_eq!(ready, want, "the heatmap's cells are the cache's slots (refresh {i})");
        // The first refresh has no baseline; the idle cache read nothing between the two.
        assert_eq!(c["reads"].as_u64(), if i == 0 { None } else { Some(0) }, "{c}");
    }

    let text = heatmap(&["--no-color", "--width", "200"]);
    let head = format!("in the engine's cache (process {pid}: {n_slots} slots, {} ready, 0 loading", want.len());
    assert!(text.contains(&head), "{head:?} in\n{text}");
    let grid = text.split(&head).nth(1).unwrap();
    let rows: Vec<&str> = grid.lines().skip(1).take(map.moe_layers.len()).collect();
    for (r, (layer, line)) in map.moe_layers.iter().zip(&rows).enumerate() {
        let n = want.iter().filter(|&&c| c / map.n_experts == r as u32).count();
        let fields: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(fields.first(), Some(&layer.to_string().as_str()), "{line}");
        assert_eq!(fields.last(), Some(&n.to_string().as_str()), "layer {layer}: {n} cached experts in {line:?}");
    }
}
