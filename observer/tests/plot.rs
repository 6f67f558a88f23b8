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
    svg.match_indices("<rect")
        .filter(|(i, _)| svg[*i..].split('>').next().unwrap().contains(&format!("fill=\"{fill}\"")))
        .count()
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
