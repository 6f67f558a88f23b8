//! Every eBPF program has a kernel-side budget (`observer_common::budget`), and every budget a
//! program: the programs are read from `observer-ebpf`'s sources (a function after an aya program
//! attribute), so a program added without a budget fails here.

use observer_common::budget::BUDGETS;

/// The program functions of one source file: `pub fn NAME` on the first line after a line that
/// starts with an aya program attribute (`#[raw_tracepoint`, `#[uprobe`, ...).
fn programs_in(text: &str) -> Vec<String> {
    const KINDS: [&str; 10] = [
        "raw_tracepoint",
        "tracepoint",
        "btf_tracepoint",
        "perf_event",
        "uprobe",
        "uretprobe",
        "kprobe",
        "kretprobe",
        "fentry",
        "fexit",
    ];
    let mut out = Vec::new();
    let mut after_attribute = false;
    for line in text.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("#[") {
            let kind = rest.split(['(', ']']).next().unwrap_or("");
            after_attribute |= KINDS.contains(&kind);
            continue;
        }
        if after_attribute && let Some(rest) = line.strip_prefix("pub fn ") {
            out.push(rest.split('(').next().unwrap_or("").to_string());
        }
        after_attribute = false;
    }
    out
}

#[test]
fn every_ebpf_program_has_a_budget_and_every_budget_a_program() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../observer-ebpf/src");
    let mut programs = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "rs") {
            programs.extend(programs_in(&std::fs::read_to_string(&path).unwrap()));
        }
    }
    assert!(programs.len() >= 30, "only {} programs found in {}: {programs:?}", programs.len(), dir.display());
    let without: Vec<_> = programs.iter().filter(|p| !BUDGETS.iter().any(|b| &b.program == p)).collect();
    assert!(without.is_empty(), "programs without a budget in observer_common::budget::BUDGETS: {without:?}");
    let stale: Vec<_> = BUDGETS.iter().filter(|b| !programs.iter().any(|p| p == b.program)).collect();
    assert!(stale.is_empty(), "budgets of no program: {stale:?}");
}

#[test]
fn the_reader_finds_programs_after_their_attribute_only() {
    let text = "#[raw_tracepoint(tracepoint = \"x\")]\npub fn a(ctx: C) -> i32 {}\n\
                #[inline(always)]\npub fn helper() {}\n#[uretprobe]\npub fn b(ctx: R) -> u32 {}\n";
    assert_eq!(programs_in(text), ["a", "b"]);
}
