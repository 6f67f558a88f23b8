//! The expert cache (`--experts cache`): the same tokens and logits as the mapping, the slot
//! table's contents against the file, and the budget's errors.
//!
//! The counters against the kernel's are in `tests/cache_io.rs` (a test binary of its own, so
//! that `/proc/self/io` counts nothing but the cache's reads).

mod common;

use std::sync::atomic::Ordering;
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};

use common::*;
use engine::cache::slots::{self, ExpertSlots, STATE_READY};
use engine::cache::{CacheConfig, ExpertCache};
use engine::model::{Model, Session};
use engine::placement::DensePolicy;
use engine::synth::{QuantMix, SynthConfig};

/// The `small` preset's shapes (Q4_K gate/up, Q6_K down, Q8_0 dense) in 3 layers with a 4k
/// vocabulary: ~80 MiB, the big model's kernels.
fn q4km_model() -> std::path::PathBuf {
    static M: OnceLock<std::path::PathBuf> = OnceLock::new();
    M.get_or_init(|| {
        let mut c = SynthConfig::preset("small").unwrap();
        c.layers = 3;
        c.vocab = 4096;
        c.quant = QuantMix::Q4KM;
        cached_model("cache-q4km", &c)
    })
    .clone()
}

fn tiny_model() -> std::path::PathBuf {
    static M: OnceLock<std::path::PathBuf> = OnceLock::new();
    M.get_or_init(|| cached_model("cache-tiny", &SynthConfig::preset("tiny").unwrap())).clone()
}

/// Caches made by the tests of this binary, one at a time: the slot table of the first live one
/// is the published one.
fn one_cache_at_a_time() -> MutexGuard<'static, ()> {
    static L: Mutex<()> = Mutex::new(());
    L.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A cache of `slots` slots of `m`'s experts.
fn cache(m: &Model, slots: usize, prefetch: bool) -> ExpertCache {
    let probe = ExpertCache::new(m, CacheConfig { bytes: 1 << 40, io_threads: 1, lock: false, prefetch }).unwrap();
    let bytes = (slots * probe.slot_bytes()) as u64;
    drop(probe);
    ExpertCache::new(m, CacheConfig { bytes, io_threads: 3, lock: false, prefetch }).unwrap()
}

/// Greedy decoding of `n` tokens after a batched prompt: the tokens and every step's logits.
fn decode(sess: &mut Session<'_>, n: usize) -> (Vec<u32>, Vec<Vec<u32>>) {
    let prompt: Vec<u32> = (0..12).map(|i| (i * 37 + 5) % 256).collect();
    let mut logits = vec![sess.step(&prompt).unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>()];
    let mut toks = vec![engine::sampling::argmax(sess.logits())];
    for _ in 0..n {
        let l = sess.step(&[*toks.last().unwrap()]).unwrap();
        logits.push(l.iter().map(|v| v.to_bits()).collect());
        toks.push(engine::sampling::argmax(l));
    }
    (toks, logits)
}

#[test]
fn cache_output_equals_mmap_token_for_token() {
    let _one = one_cache_at_a_time();
    for path in [tiny_model(), q4km_model()] {
        let m = Model::load_with(&path, DensePolicy::Anon).unwrap();
        let (k, e) = (m.cfg.n_expert_used, m.cfg.n_expert);
        let (want_toks, want_logits) = decode(&mut Session::new(&m, 2, 64), 40);
        // One layer's experts (the prompt batch needs more: the rest is read into the slots of
        // experts already computed), a third of the experts, every expert; with prefetch.
        for (slots, prefetch) in [(k, false), (m.cfg.n_layer * e / 3, false), (m.cfg.n_layer * e, false), (2 * k, true)]
        {
            let c = cache(&m, slots, prefetch);
            let mut sess = Session::new(&m, 2, 64).with_experts(&c);
            let (toks, logits) = decode(&mut sess, 40);
            let what = format!("{} with {slots} slots, prefetch {prefetch}", path.display());
            assert_eq!(toks, want_toks, "{what}: tokens");
            for (i, (a, b)) in logits.iter().zip(&want_logits).enumerate() {
                assert!(a == b, "{what}: logits of step {i} differ from the mapping's");
            }
            let s = c.stats();
            assert!(s.misses > 0 && s.read_bytes > 0, "{what}: {s:?}");
            if slots == m.cfg.n_layer * e {
                assert!(s.hits > s.misses, "{what}: a cache of every expert must hit after the first reads: {s:?}");
            }
            if prefetch {
                assert!(s.prefetched > 0, "{what}: prefetch read nothing: {s:?}");
            }
        }
    }
}

#[test]
fn the_cli_run_gives_the_same_tokens_with_the_cache() {
    let m = q4km_model();
    let m = m.to_str().unwrap();
    let args = ["run", "-m", m, "-p", "Once upon a time", "-n", "24", "--ignore-eos", "--json", "-t", "2"];
    let ids = |out: &std::process::Output| -> Vec<u64> {
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?["id"].as_u64())
            .collect()
    };
    let mmap = engine(&args);
    let cached = engine(&[&args[..], &["--dense", "anon", "--experts", "cache", "--cache-mib", "24"]].concat());
    assert_eq!(ids(&mmap).len(), 24);
    assert_eq!(ids(&cached), ids(&mmap), "tokens of --experts cache vs mmap");
    let s = summary(&cached);
    assert_eq!(s["experts"], "cache");
    let c = &s["cache"];
    assert!(c["misses"].as_u64().unwrap() > 0 && c["read_bytes"].as_u64().unwrap() > 0, "{c}");
    assert!(String::from_utf8_lossy(&cached.stderr).contains("published in moe_engine_expert_slots"));
}

#[test]
fn slots_hold_the_experts_the_table_names() {
    static HEADER: ExpertSlots = ExpertSlots::new();
    let _one = one_cache_at_a_time();
    slots::export(&HEADER);
    let path = q4km_model();
    let m = Model::load_with(&path, DensePolicy::Anon).unwrap();
    let c = cache(&m, 2 * m.cfg.n_expert, false);
    assert!(c.is_published(), "the only cache's table is the published one");
    assert_eq!(HEADER.n_slots.load(Ordering::SeqCst), c.n_slots() as u64);
    assert_eq!(HEADER.slots.load(Ordering::SeqCst).cast_const(), c.table().as_ptr());
    assert_eq!(HEADER.seq.load(Ordering::SeqCst) % 2, 0);
    let mut sess = Session::new(&m, 2, 64).with_experts(&c);
    decode(&mut sess, 8);
    let file = m.gguf.bytes();
    let mut ready = 0;
    for s in c.table() {
        if s.state.load(Ordering::SeqCst) != STATE_READY {
            continue;
        }
        ready += 1;
        let (il, e) = (s.layer.load(Ordering::SeqCst) as usize, s.expert.load(Ordering::SeqCst) as usize);
        let (addr, len) = (s.addr.load(Ordering::SeqCst) as usize, s.len.load(Ordering::SeqCst) as usize);
        assert_eq!(len, c.slot_bytes());
        let ranges = c.expert_file_ranges(il, e).expect("a MoE layer");
        for ((start, end), off) in ranges.iter().zip(c.part_offsets()) {
            let (start, end) = (*start as usize, *end as usize);
            let at = off + start % engine::cache::io::ALIGN;
            assert!(at + (end - start) <= len);
            // SAFETY: a ready slot of the live cache, which nothing writes between steps.
            let held = unsafe { std::slice::from_raw_parts((addr + at) as *const u8, end - start) };
            assert!(held == &file[start..end], "slot at {addr:#x} does not hold expert {e} of layer {il}");
        }
        assert!(s.last_use.load(Ordering::SeqCst) != u64::MAX, "a ready slot was used");
    }
    assert_eq!(ready, c.resident());
    assert!(ready >= m.cfg.n_expert_used, "only {ready} ready slots");
    drop(sess);
    drop(c);
    assert_eq!(HEADER.n_slots.load(Ordering::SeqCst), 0, "a dropped cache clears the table");
}

#[test]
fn the_binary_exports_the_slot_table() {
    use object::{Object, ObjectSymbol};
    let bin = std::fs::read(ENGINE).unwrap();
    let obj = object::File::parse(&*bin).unwrap();
    let sym = obj.symbols().find(|s| s.name() == Ok(slots::SYMBOL)).expect("moe_engine_expert_slots in .symtab");
    assert_eq!(sym.size(), slots::HEADER_SIZE as u64);
    assert_eq!(sym.kind(), object::SymbolKind::Data);
}

#[test]
fn bad_cache_sizes_are_clear_errors() {
    let m = tiny_model();
    let m = m.to_str().unwrap();
    let run = |mib: &str| {
        let out = std::process::Command::new(ENGINE)
            .args(["run", "-m", m, "-p", "hi", "-n", "2", "--experts", "cache", "--cache-mib", mib])
            .output()
            .unwrap();
        assert!(!out.status.success(), "--cache-mib {mib} must fail");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let e = run("0");
    assert!(e.contains("at least 2") && e.contains("--cache-mib"), "{e}");
    let e = run("lots");
    assert!(e.contains("--cache-mib \"lots\"") && e.contains("auto"), "{e}");
}

#[test]
fn auto_budget_follows_the_memory_cgroup_limit() {
    assert_root("the auto budget test (it makes a memory cgroup)");
    let _l = testkit::machine_lock();
    let limit = 600u64 << 20;
    let cg = testkit::MemCgroup::new("engine-cache-auto", limit).unwrap();
    let m = q4km_model();
    // A context of 4096 positions (the model's trained context): a KV cache of 12 MiB (3 layers of
    // 1 KiB cells), which the budget must leave free twice.
    let args =
        cg.wrap(&[ENGINE, "run", "-m", m.to_str().unwrap(), "-p", "hi", "-n", "4", "--ctx", "4096", "--dense", "anon"]);
    let args: Vec<&str> = args.iter().map(String::as_str).chain(["--experts", "cache"]).collect();
    let out = std::process::Command::new(args[0]).args(&args[1..]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let line = err.lines().find(|l| l.contains("expert cache budget")).unwrap_or_else(|| panic!("{err}"));
    let budget: f64 = line.split("budget ").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
    let anon: f64 = line.split("anon ").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
    assert!(line.contains(&cg.dir().display().to_string()) && line.contains("limit 600 MiB"), "{line}");
    // The state it subtracts is 2 x KV cache + recurrent state of the session's own report.
    let num = |s: &str, after: &str| -> f64 {
        s.split(after).nth(1).unwrap().split([' ', ',', ')']).next().unwrap().parse().unwrap()
    };
    let state = num(line, "KV + state ");
    let report = err.lines().find(|l| l.contains("KV + state for")).unwrap_or_else(|| panic!("{err}"));
    let (kv, recurrent) = (num(report, "KV cache "), num(report, "recurrent state "));
    assert!(kv > 10.0, "the KV cache at 4096 positions: {report}");
    assert!((state - (2.0 * kv + recurrent)).abs() <= 1.0, "state {state} MiB vs 2 x {kv} + {recurrent}: {line}");
    // limit − anon − state − headroom (64 MiB + 5 %): the budget is what the rule says, within the
    // MiB rounding of the printed numbers.
    let want = 600.0 - anon - state - (64.0 + 30.0);
    assert!(budget <= want + 1.0 && budget >= want - 2.0, "budget {budget} MiB, rule gives {want}: {line}");
    let dense: f64 = err.split("dense weights ").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
    assert!(anon >= dense, "the dense copy ({dense} MiB) is anonymous memory of the cgroup: {line}");
}

#[test]
fn a_cache_smaller_than_a_tokens_working_set_keeps_its_hot_experts() {
    let _one = one_cache_at_a_time();
    let m = Model::load_with(q4km_model(), DensePolicy::Anon).unwrap();
    // Two layers' worth of slots for three layers of experts per token: LRU would evict every
    // expert before its layer comes round again (0 % hits); the counts keep the hot ones.
    let working_set = m.cfg.n_layer * m.cfg.n_expert_used;
    let c = cache(&m, 2 * m.cfg.n_expert_used, false);
    assert!(c.n_slots() < working_set);
    let mut sess = Session::new(&m, 2, 128).with_experts(&c);
    decode(&mut sess, 16);
    let s0 = c.stats();
    decode_more(&mut sess, 48);
    let s = c.stats().since(&s0);
    let pct = s.hit_pct().unwrap();
    eprintln!("{} slots for a working set of {working_set}: {pct:.1} % hits ({s:?})", c.n_slots());
    assert!(pct >= 10.0, "{pct:.1} % hits with {} slots", c.n_slots());
}

/// `n` more greedy tokens.
fn decode_more(sess: &mut Session<'_>, n: usize) {
    let mut t = engine::sampling::argmax(sess.logits());
    for _ in 0..n {
        t = engine::sampling::argmax(sess.step(&[t]).unwrap());
    }
}
