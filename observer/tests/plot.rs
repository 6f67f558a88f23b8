//! `observer plot`: each picture holds the numbers of its inputs. Checked on
//! the committed wave-1 engine trace (`tests/data`), with no probes: the data
//! of each plot against the trace's records and `diff`'s rows, and the drawn
//! SVG against that data (one bar per record and component, the vocabulary's
//! names in the legend), PNGs by their header.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use observer::{
    analysis::{diff, stats},
    plot::{self, cliff, compare::Comparison, residency::ResidencyMap, tokens::TokenSeries},
    store::import,
};
use observer_common::vocab::Component;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/wave1-engine-tiny.trace")
}

fn observer(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_observer")).args(args).output().expect("running observer")
}

fn hex(c: plotters::style::RGBColor) -> String {
    format!("#{:02X}{:02X}{:02X}", c.0, c.1, c.2)
}

/// `<rect … fill="#RRGGBB" …>` elements of an SVG, by fill.
fn rects_with_fill(svg: &str, fill: &str) -> usize {
    testkit::svg::rects(svg).iter().filter(|r| r.fill == fill).count()
}

/// Width and height from a PNG's IHDR.
fn png_size(bytes: &[u8]) -> (u32, u32) {
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "not a PNG");
    assert_eq!(&bytes[12..16], b"IHDR");
    let be = |o: usize| u32::from_be_bytes(bytes[o..o + 4].try_into().unwrap());
    (be(16), be(20))
}

#[test]
fn tokens_plot_holds_each_records_components() {
    let run = import::load(&fixture()).unwrap();
    let s = TokenSeries::of(&run);
    let recs = run.summarised();
    assert_eq!(s.len(), recs.len());
    assert!(!s.is_empty());
    for (c, values) in &s.stacks {
        for (v, t) in values.iter().zip(&recs) {
            assert_eq!(*v, t.components.get(*c).map(|ns| ns as f64 * 1e-6), "{} of record {}", c.name(), t.seq);
        }
    }
    let engine = s.engine_compute.as_ref().expect("the engine's trace has its own compute");
    for (v, t) in engine.iter().zip(&recs) {
        assert_eq!(*v, t.engine_compute_ns.map(|ns| ns as f64 * 1e-6));
    }

    let dir = tempfile::tempdir().unwrap();
    let svg_path = dir.path().join("tokens.svg");
    let out = observer(&["plot", "tokens", fixture().to_str().unwrap(), "-o", svg_path.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let svg = std::fs::read_to_string(&svg_path).unwrap();
    for (c, values) in &s.stacks {
        let nonzero = values.iter().filter(|v| v.is_some_and(|v| v > 0.0)).count();
        // The bars plus the legend's swatch.
        let drawn = rects_with_fill(&svg, &hex(plot::component_colour(*c)));
        assert_eq!(drawn, nonzero + 1, "{}: bars drawn vs records with it", c.name());
        assert!(
            svg.contains(&format!("\n{}\n", c.name())) || svg.contains(&format!(">{}<", c.name())),
            "{} in the legend",
            c.name()
        );
    }
    assert!(svg.contains("engine_compute"), "the engine's line is labelled with its vocabulary name");

    let png_path = dir.path().join("tokens.png");
    let out = observer(&["plot", "tokens", fixture().to_str().unwrap(), "-o", png_path.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(png_size(&std::fs::read(&png_path).unwrap()), plot::SIZE);
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(".observer-plot-"))
        .collect();
    assert!(leftovers.is_empty(), "temporary files left: {leftovers:?}");
}

#[test]
fn compare_plot_holds_diffs_rows() {
    // The same run twice: two sides of one configuration each (every file its own side).
    let runs = vec![import::load(&fixture()).unwrap(), import::load(&fixture()).unwrap()];
    let opts = diff::Options { resamples: 1000, seed: stats::DEFAULT_SEED, ignore: vec![] };
    let d = diff::diff(&runs, &opts);
    let c = Comparison::of(&d).unwrap();
    let rows = &d.comparisons[0].rows;
    assert!(c.bars.iter().any(|b| b.name == "wall") && c.bars.iter().any(|b| b.name == "compute"));
    for b in &c.bars {
        let r = rows.iter().find(|r| r.metric == format!("{}_ms", b.name)).unwrap();
        assert_eq!((Some(b.a.0), b.a.1), (r.a.value, r.a.ci95), "{}", b.name);
        assert_eq!((Some(b.b.0), b.b.1), (r.b.value, r.b.ci95), "{}", b.name);
        if let Some(comp) = Component::from_name(&b.name) {
            assert_eq!(b.component, Some(comp));
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("cmp.svg");
    let f = fixture();
    let out = observer(&["plot", "compare", f.to_str().unwrap(), f.to_str().unwrap(), "-o", svg.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = std::fs::read_to_string(&svg).unwrap();
    // One error bar per bar and side: plotters draws each as three lines.
    let with_ci = c.bars.iter().map(|b| b.a.1.is_some() as usize + b.b.1.is_some() as usize).sum::<usize>();
    assert!(with_ci > 0);
    assert!(text.matches("<polyline").count() >= with_ci, "error bars drawn");
}

#[test]
fn residency_plot_holds_each_grids_layer_means() {
    let run = import::load(&fixture()).unwrap();
    let m = ResidencyMap::of(&run).unwrap();
    let grids: Vec<_> = run.tokens.iter().filter_map(|t| Some((t.seq, t.residency.as_ref()?.grid.as_ref()?))).collect();
    assert_eq!(m.columns.len(), grids.len());
    for ((seq, layers), (gseq, g)) in m.columns.iter().zip(&grids) {
        assert_eq!(seq, gseq);
        for (l, v) in layers.iter().enumerate() {
            let row = &g.resident[l * g.n_experts as usize..(l + 1) * g.n_experts as usize];
            let mean = row.iter().map(|&x| x as f64).sum::<f64>() / row.len() as f64;
            assert!((v - mean).abs() < 1e-12, "layer {l} of record {seq}");
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let png = dir.path().join("res.png");
    let out = observer(&["plot", "residency", fixture().to_str().unwrap(), "-o", png.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(png_size(&std::fs::read(&png).unwrap()), plot::SIZE);
}

#[test]
fn cliff_plot_reads_bench_json_and_draws_a_line_per_system() {
    let dir = tempfile::tempdir().unwrap();
    let cell = |system: &str, limit: Option<f64>, tok_s: f64| {
        serde_json::json!({"system": system, "round": 0, "limit_pct": limit, "tok_s": tok_s,
            "first_tok_s": null, "read_bytes_per_token": null, "hit_pct": null, "components_ms": null})
    };
    let bench = serde_json::json!({
        "format": cliff::FORMAT, "model": "/m/cliff.gguf", "model_bytes": 5_600_000_000u64,
        "cells": [cell("engine cache", None, 17.0), cell("engine cache", Some(60.0), 9.0),
                  cell("engine mmap", None, 17.5), cell("engine mmap", Some(60.0), 5.5),
                  cell("llama.cpp mmap", Some(60.0), 1.2)]
    });
    let json = dir.path().join("cliff.json");
    std::fs::write(&json, bench.to_string()).unwrap();
    let svg = dir.path().join("cliff.svg");
    let out = observer(&["plot", "cliff", json.to_str().unwrap(), "-o", svg.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = std::fs::read_to_string(&svg).unwrap();
    for s in ["engine cache", "engine mmap", "llama.cpp mmap"] {
        assert!(text.contains(s), "{s} in the legend");
    }
    // A file that is not a bench result is named in the error.
    std::fs::write(&json, "{\"format\": \"something else\"}").unwrap();
    let out = observer(&["plot", "cliff", json.to_str().unwrap(), "-o", svg.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cliff.json"), "{}", String::from_utf8_lossy(&out.stderr));
}

/// The split of a token per cell: a bar per (system, limit) with a split, unlimited first, then
/// the limits falling, a limit's systems in file order; each bar the stack of its cell's
/// component means over rounds (computed here from the JSON), in vocabulary order and colours,
/// drawn at one scale, with its total and the cell's label written beside it.
#[test]
fn cliff_split_plot_stacks_each_cells_mean_components() {
    use serde_json::json;
    let dir = tempfile::tempdir().unwrap();
    let cell = |system: &str, round: u32, limit: Option<f64>, tok_s: f64, split: serde_json::Value| {
        json!({"system": system, "round": round, "limit_pct": limit, "tok_s": tok_s, "first_tok_s": null,
            "read_bytes_per_token": null, "hit_pct": null, "components_ms": split})
    };
    let cells = vec![
        cell("warm (engine mmap)", 0, None, 20.0, json!({"compute": 40.0, "runqueue": 5.0, "sleep": 1.5})),
        cell("engine cache", 0, Some(60.0), 8.0, json!({"compute": 50.0, "io_wait_peer": 60.0, "fault_minor": 2.0})),
        cell("engine mmap", 0, Some(60.0), 4.0, json!({"compute": 45.0, "fault_io": 180.0, "reclaim": 20.0})),
        cell("llama.cpp mmap", 0, Some(60.0), 1.0, serde_json::Value::Null),
        cell("engine cache", 0, Some(80.0), 15.0, json!({"compute": 48.0, "io_wait_peer": 12.0})),
        cell("engine mmap", 1, Some(60.0), 5.0, json!({"compute": 47.0, "fault_io": 140.0, "reclaim": 10.0})),
        cell("engine cache", 1, Some(60.0), 10.0, json!({"compute": 54.0, "io_wait_peer": 30.0, "fault_minor": 0.0})),
    ];
    let bench = json!({"format": cliff::FORMAT, "model": "/m/cliff.gguf", "model_bytes": 5_600_000_000u64,
        "cells": cells});
    let json = dir.path().join("cliff.json");
    std::fs::write(&json, bench.to_string()).unwrap();

    // The data: each cell's rounds from the JSON, their means.
    let b = cliff::load(&json).unwrap();
    let p = cliff::SplitPlot::of(&[("cliff.json".into(), b.clone())]).unwrap();
    let labels: Vec<String> = p.bars.iter().map(|b| b.label()).collect();
    assert_eq!(
        labels,
        ["warm (engine mmap), unlimited", "engine cache, 80 %", "engine cache, 60 %", "engine mmap, 60 %"],
        "a bar per cell with a split, in the plot's order"
    );
    let measured =
        |c: Component| b.cells.iter().any(|x| x.components_ms.as_ref().is_some_and(|m| m.contains_key(c.name())));
    let want: Vec<Component> = Component::ALL.into_iter().filter(|&c| measured(c)).collect();
    assert_eq!(p.components, want, "the cells' components in vocabulary order");
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    for bar in &p.bars {
        let rounds: Vec<&cliff::Cell> = b
            .cells
            .iter()
            .filter(|c| c.system == bar.system && c.limit_pct == bar.limit_pct && c.components_ms.is_some())
            .collect();
        assert_eq!(bar.rounds, rounds.len(), "{}", bar.label());
        for (c, ms) in p.components.iter().zip(&bar.ms) {
            let v: Vec<f64> = rounds.iter().filter_map(|r| r.components_ms.as_ref()?.get(c.name()).copied()).collect();
            let want = if v.is_empty() { 0.0 } else { mean(&v) };
            assert!((ms - want).abs() < 1e-9, "{} of {}: {ms} vs {want}", c.name(), bar.label());
        }
        let wall = mean(&rounds.iter().map(|r| 1e3 / r.tok_s).collect::<Vec<_>>());
        assert!(bar.wall_ms.is_some_and(|w| (w - wall).abs() < 1e-9), "{}: {:?} vs {wall}", bar.label(), bar.wall_ms);
    }

    // The picture: the bars are those stacks, in the components' colours.
    let svg = dir.path().join("cliff-split.svg");
    let out = observer(&["plot", "cliff-split", json.to_str().unwrap(), "-o", svg.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = std::fs::read_to_string(&svg).unwrap();
    let rows = testkit::svg::bar_rows(&text, 12);
    let values: Vec<Vec<f64>> = p.bars.iter().map(|b| b.ms.clone()).collect();
    testkit::svg::check_stacks(&rows, &values, 2.0).unwrap();
    for (row, bar) in rows.iter().zip(&p.bars) {
        let fills: Vec<String> = row.iter().map(|r| r.fill.clone()).collect();
        let want: Vec<String> = p
            .components
            .iter()
            .zip(&bar.ms)
            .filter(|(_, ms)| **ms > 0.0)
            .map(|(c, _)| hex(plot::component_colour(*c)))
            .collect();
        assert_eq!(fills, want, "{}: segments in vocabulary order and colours", bar.label());
        assert!(text.contains(&bar.label()), "{} on the axis", bar.label());
        assert!(text.contains(&format!("{:.1} ms", bar.total())), "{}'s total written", bar.label());
    }
    for c in &p.components {
        assert!(
            text.contains(&format!(">{}<", c.name())) || text.contains(&format!("\n{}\n", c.name())),
            "{} in the legend",
            c.name()
        );
    }

    // A component the vocabulary does not know is an error naming the file, the cell and the name.
    let mut bad = bench.clone();
    bad["cells"][0]["components_ms"]["compute_typo"] = json!(1.0);
    std::fs::write(&json, bad.to_string()).unwrap();
    let out = observer(&["plot", "cliff-split", json.to_str().unwrap(), "-o", svg.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cliff.json") && err.contains("compute_typo") && err.contains("warm (engine mmap)"), "{err}");
    // Cells without a split are no plot.
    for c in bad["cells"].as_array_mut().unwrap() {
        c["components_ms"] = serde_json::Value::Null;
    }
    std::fs::write(&json, bad.to_string()).unwrap();
    let out = observer(&["plot", "cliff-split", json.to_str().unwrap(), "-o", svg.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("components_ms"), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn plot_refuses_to_write_over_its_input_or_an_unknown_format() {
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join("run.trace");
    std::fs::copy(fixture(), &copy).unwrap();
    let before = std::fs::read(&copy).unwrap();
    let out = observer(&["plot", "tokens", copy.to_str().unwrap(), "-o", copy.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("one of the inputs"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Not even through a differently spelled path to the same file.
    let alias = dir.path().join(".").join("run.trace");
    let out = observer(&["plot", "tokens", copy.to_str().unwrap(), "-o", alias.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(std::fs::read(&copy).unwrap(), before, "the input is untouched");
    let out = observer(&["plot", "tokens", copy.to_str().unwrap(), "-o", dir.path().join("x.jpg").to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains(".svg or .png"));
}
