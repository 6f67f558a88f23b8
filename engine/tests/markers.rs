//! The token markers in the built `engine` binary (the release binary under `cargo xtask test`):
//! exported, at distinct addresses, probeable, and firing once per step under a real uprobe; and
//! the exported dense-regions header beside them.

mod common;

use std::collections::BTreeMap;
use std::process::Command;

use common::*;
use engine::markers::{MAGIC, SYM_BEGIN, SYM_END};
use object::{Object, ObjectSection, ObjectSymbol, SymbolKind};

#[test]
fn marker_symbols_are_exported_at_distinct_probeable_addresses() {
    let data = std::fs::read(ENGINE).unwrap_or_else(|e| panic!("{ENGINE}: {e}"));
    let file = object::File::parse(&*data).expect("engine is an ELF file");
    let mut addrs = Vec::new();
    for name in [SYM_BEGIN, SYM_END] {
        let sym = file
            .symbols()
            .find(|s| s.name() == Ok(name) && s.is_definition())
            .unwrap_or_else(|| panic!("{ENGINE} does not define {name} (stripped binary?)"));
        assert_eq!(sym.kind(), SymbolKind::Text, "{name} is not a function");
        assert!(sym.is_global(), "{name} is not a global symbol");
        assert!(sym.size() > 0, "{name} has no size");
        // The first instruction must not carry a `lock` prefix (x86 uprobes refuse it).
        let sec = file
            .sections()
            .find(|s| (s.address()..s.address() + s.size()).contains(&sym.address()))
            .expect("section of the marker");
        let code = sec.data().unwrap();
        let first = code[(sym.address() - sec.address()) as usize];
        assert_ne!(first, 0xF0, "{name} starts with a lock prefix");
        addrs.push(sym.address());
    }
    assert_ne!(addrs[0], addrs[1], "{SYM_BEGIN} and {SYM_END} were folded to one address");
}

/// The dense-regions header (`engine::dense_regions`): a global 32-byte data object in the
/// binary, kept although no code of the engine reads it, and initialised with the magic and
/// version and nothing published.
#[test]
fn dense_regions_header_is_exported_as_an_initialised_data_object() {
    use engine::dense_regions::{HEADER_SIZE, MAGIC, SYMBOL, VERSION};
    let data = std::fs::read(ENGINE).unwrap_or_else(|e| panic!("{ENGINE}: {e}"));
    let file = object::File::parse(&*data).expect("engine is an ELF file");
    let sym = file
        .symbols()
        .find(|s| s.name() == Ok(SYMBOL) && s.is_definition())
        .unwrap_or_else(|| panic!("{ENGINE} does not define {SYMBOL} (optimised away, or a stripped binary?)"));
    assert_eq!(sym.kind(), SymbolKind::Data, "{SYMBOL} is not a data object");
    assert!(sym.is_global(), "{SYMBOL} is not a global symbol");
    assert_eq!(sym.size(), HEADER_SIZE as u64, "{SYMBOL} size");
    let sec = file
        .sections()
        .find(|s| (s.address()..s.address() + s.size()).contains(&sym.address()))
        .expect("section of the header");
    let bytes = sec.data().unwrap();
    let at = (sym.address() - sec.address()) as usize;
    let h = &bytes[at..at + HEADER_SIZE];
    assert_eq!(u32::from_le_bytes(h[0..4].try_into().unwrap()), MAGIC, "magic");
    assert_eq!(u32::from_le_bytes(h[4..8].try_into().unwrap()), VERSION, "version");
    assert!(h[8..].iter().all(|&b| b == 0), "seq, count and table start at 0: {h:?}");
}

/// `{"type": "map", "data": {"@name": {"key": value, …}}}` lines of `bpftrace -f json`.
fn maps(stdout: &str) -> BTreeMap<String, BTreeMap<u64, u64>> {
    let mut out = BTreeMap::new();
    for l in stdout.lines().filter(|l| l.starts_with('{')) {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(l) else { continue };
        if v["type"] != "map" {
            continue;
        }
        for (name, m) in v["data"].as_object().unwrap() {
            let entries = m
                .as_object()
                .unwrap_or_else(|| panic!("map {name}: {m}"))
                .iter()
                .map(|(k, n)| (k.parse().unwrap(), n.as_u64().unwrap()))
                .collect();
            out.insert(name.clone(), entries);
        }
    }
    out
}

#[test]
fn markers_fire_once_per_step_under_a_uprobe() {
    assert_root("this test attaches uprobes with bpftrace");
    let _l = testkit::machine_lock();
    let bpftrace = ["/usr/bin/bpftrace", "/usr/sbin/bpftrace", "/usr/local/bin/bpftrace"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
        .expect("bpftrace is not installed: run `cargo xtask setup`");
    let m = small_model();
    let json = scratch("markers.jsonl");
    let n = 24;
    let e = ENGINE;
    // Counts per step index, and what the record says at `end`.
    let script = format!(
        "uprobe:{e}:{SYM_BEGIN} {{ @begin[arg0] = count(); }}
         uprobe:{e}:{SYM_END} {{ @end[arg0] = count(); @magic[*(uint32*)arg1] = count();
           @kind[arg0] = *(uint32*)(arg1 + 12); @index[arg0] = *(uint64*)(arg1 + 16);
           @ntok[arg0] = *(uint64*)(arg1 + 24); @wall[arg0] = *(uint64*)(arg1 + 32); }}"
    );
    // bpftrace splits -c on spaces: no spaces in any argument.
    let cmd = format!(
        "{e} run -m {} -p The_quick_brown_fox,jumps. -n {n} -t 1 --ignore-eos --json --force --metrics-json {}",
        m.display(),
        json.display()
    );
    let out = Command::new(bpftrace).args(["-f", "json", "-e", &script, "-c", &cmd]).output().expect("run bpftrace");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "bpftrace failed: {}\n{}\n{stdout}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let summary = stdout
        .lines()
        .filter(|l| l.starts_with('{') && l.contains("marked_steps"))
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .next_back()
        .unwrap_or_else(|| panic!("no engine summary in:\n{stdout}"));
    let steps = summary["marked_steps"].as_u64().unwrap();
    assert_eq!(steps, n, "{n} tokens: the prompt step and {} generation steps", n - 1);
    let maps = maps(&stdout);
    let all: BTreeMap<u64, u64> = (0..steps).map(|i| (i, 1)).collect();
    assert_eq!(maps["@begin"], all, "begin calls per step index");
    assert_eq!(maps["@end"], all, "end calls per step index");
    assert_eq!(maps["@magic"], BTreeMap::from([(u64::from(MAGIC), steps)]), "record magic");
    let kinds: Vec<u64> = maps["@kind"].values().copied().collect();
    assert_eq!(kinds[0], 0, "step 0 is the prompt");
    assert!(kinds[1..].iter().all(|&k| k == 1), "{kinds:?}");
    assert!(maps["@index"].iter().all(|(k, v)| k == v), "record index = argument");
    let prompt_tokens = summary["prompt_tokens"].as_u64().unwrap();
    assert_eq!(maps["@ntok"][&0], prompt_tokens);
    assert!(maps["@ntok"].iter().skip(1).all(|(_, &v)| v == 1));
    // The record the probe read at `end` is the one the metrics file reports.
    let rows: Vec<serde_json::Value> =
        std::fs::read_to_string(&json).unwrap().lines().skip(1).map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(rows.len() as u64, steps - 1);
    for r in &rows {
        let step = r["step"].as_u64().unwrap();
        let wall_ns = (r["wall_ms"].as_f64().unwrap() * 1e6).round() as u64;
        let probed = maps["@wall"][&step];
        assert!(probed.abs_diff(wall_ns) <= 1, "step {step}: uprobe read wall {probed} ns, metrics say {wall_ns} ns");
    }
}
