//! `observer diff`, `report` and `export` on imported bmoe_metrics files (no
//! probes, no root). Expected numbers are computed here, independently, from
//! the CSV text.

#[path = "support/chrome.rs"]
mod chrome;

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use serde_json::Value;

const OBSERVER: &str = env!("CARGO_BIN_EXE_observer");

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(name)
}
const A: &str = "bmoe-20260721-090406.csv";
const B: &str = "bmoe-20260721-090539.csv";

fn scratch(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("diff").join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn observer(args: &[&str]) -> (bool, String, String) {
    let o = Command::new(OBSERVER).args(args).output().expect("run observer");
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

fn ok(args: &[&str]) -> String {
    let (ok, out, err) = observer(args);
    assert!(ok, "observer {args:?} failed:\n{err}");
    out
}

/// `column` of every token row, straight from the CSV.
fn column(path: &Path, column: &str) -> Vec<f64> {
    let text = std::fs::read_to_string(path).unwrap();
    let mut lines = text.lines().filter(|l| !l.starts_with('#'));
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let i = header.iter().position(|c| *c == column).unwrap();
    lines.filter(|l| !l.is_empty()).map(|l| l.split(',').nth(i).unwrap().parse().unwrap()).collect()
}

fn tok_s(path: &Path) -> f64 {
    let w = column(path, "wall_ms");
    w.len() as f64 / w.iter().sum::<f64>() * 1000.0
}

fn row<'a>(cmp: &'a Value, metric: &str) -> &'a Value {
    cmp["rows"].as_array().unwrap().iter().find(|r| r["metric"] == metric).unwrap_or_else(|| panic!("no row {metric}"))
}

#[test]
fn shared_samples_diff_prints_their_speeds_overlap_and_the_short_run_warning() {
    let (a, b) = (data(A), data(B));
    let (ta, tb) = (tok_s(&a), tok_s(&b));
    assert_eq!((format!("{ta:.3}"), format!("{tb:.3}")), ("2.981".into(), "2.955".into()));
    let out = ok(&["diff", a.to_str().unwrap(), b.to_str().unwrap()]);
    let line =
        out.lines().find(|l| l.trim_start().starts_with("tok/s")).unwrap_or_else(|| panic!("no tok/s row:\n{out}"));
    assert!(line.contains("2.981") && line.contains("2.955"), "{line}");
    assert!(line.contains("overlap"), "intervals overlap: {line}");
    assert!(out.contains("short run"), "short-run warning expected:\n{out}");
    assert!(out.contains("dense_weights=anon") && out.contains("dense_weights=ahwb"), "{out}");
    assert!(out.contains("resample"), "the output says how it resamples:\n{out}");

    let j: Value = serde_json::from_str(&ok(&["diff", "--json", a.to_str().unwrap(), b.to_str().unwrap()])).unwrap();
    let c = &j["comparisons"][0];
    let t = row(c, "tok_s");
    assert!((t["a"]["value"].as_f64().unwrap() - ta).abs() < 1e-9 * ta);
    assert!((t["b"]["value"].as_f64().unwrap() - tb).abs() < 1e-9 * tb);
    assert_eq!(t["disjoint"], false);
    let (lo, hi) = (t["a"]["ci95"]["lo"].as_f64().unwrap(), t["a"]["ci95"]["hi"].as_f64().unwrap());
    assert!(lo < ta && ta < hi, "[{lo}, {hi}] around {ta}");
    assert!((t["delta_pct"].as_f64().unwrap() - (tb - ta) / ta * 100.0).abs() < 1e-9);
    // The engine's own compute, mean over tokens.
    let ec = column(&a, "compute_ms");
    let mean = ec.iter().sum::<f64>() / ec.len() as f64;
    assert!((row(c, "engine_compute_ms")["a"]["value"].as_f64().unwrap() - mean).abs() < 1e-6);
    // -1 is "not measured": the first two rows of dense_resident_frac.
    let d: Vec<f64> = column(&a, "dense_resident_frac").into_iter().filter(|v| *v >= 0.0).collect();
    let r = row(c, "engine_dense_resident_frac");
    assert_eq!(r["a"]["n"].as_u64().unwrap() as usize, d.len());
    assert!((r["a"]["value"].as_f64().unwrap() - d.iter().sum::<f64>() / d.len() as f64).abs() < 1e-9);
    // The observer measured nothing in these runs: no component rows.
    assert!(c["rows"].as_array().unwrap().iter().all(|r| r["metric"] != "compute_ms"));
    // Coefficient of variation of wall (sample sd / mean).
    let w = column(&a, "wall_ms");
    let m = w.iter().sum::<f64>() / w.len() as f64;
    let sd = (w.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (w.len() - 1) as f64).sqrt();
    assert!((j["runs"][0]["wall_cv"].as_f64().unwrap() - sd / m).abs() < 1e-9);
    assert!(j["warnings"].as_array().unwrap().iter().any(|w| w["kind"] == "short_run"));
    assert!(j["comparisons"][0]["settings"].as_array().unwrap().len() == 1, "only dense_weights differs");

    let md = ok(&["diff", "--markdown", a.to_str().unwrap(), b.to_str().unwrap()]);
    assert!(md.contains("| tok/s (tok/s) |") || md.contains("| tok/s |"), "{md}");
    assert!(md.contains("2.981") && md.contains("**Warnings**"), "{md}");
}

#[test]
fn same_seed_same_intervals_other_seed_other_intervals() {
    let (a, b) = (data(A), data(B));
    let run = |seed: &str| ok(&["diff", "--json", "--seed", seed, a.to_str().unwrap(), b.to_str().unwrap()]);
    let ci = |s: String| serde_json::from_str::<Value>(&s).unwrap()["comparisons"][0]["rows"][0]["a"]["ci95"].clone();
    assert_eq!(ci(run("1")), ci(run("1")));
    assert_ne!(ci(run("1")), ci(run("2")));
}

/// Copy a sample under a new name (start time) with the configuration line
/// edited.
fn variant(dir: &Path, from: &str, name: &str, edit: &dyn Fn(&str) -> String) -> PathBuf {
    let text = std::fs::read_to_string(data(from)).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, edit(&text)).unwrap();
    p
}

#[test]
fn abba_runs_are_pooled_and_the_order_recognised() {
    let d = scratch("abba");
    let same = |s: &str| s.to_string();
    let a1 = variant(&d, A, "bmoe-20260721-100000.csv", &same);
    let b1 = variant(&d, B, "bmoe-20260721-100100.csv", &same);
    let b2 = variant(&d, B, "bmoe-20260721-100200.csv", &same);
    let a2 = variant(&d, A, "bmoe-20260721-100300.csv", &same);
    let p = |x: &PathBuf| x.to_str().unwrap().to_string();
    // Given in any order: the start times decide.
    let j: Value = serde_json::from_str(&ok(&["diff", "--json", &p(&a1), &p(&a2), &p(&b1), &p(&b2)])).unwrap();
    assert_eq!(j["sides"].as_array().unwrap().len(), 2);
    assert_eq!(j["sides"][0]["runs"], serde_json::json!(["A1", "A2"]));
    let c = &j["comparisons"][0];
    assert_eq!(c["order"], "A-B-B-A");
    assert_eq!(c["order_balanced"], true);
    assert!(!j["warnings"].as_array().unwrap().iter().any(|w| w["kind"] == "order"), "{}", j["warnings"]);
    // Pooling two copies of a run gives the run's tok/s.
    let t = row(c, "tok_s");
    assert!((t["a"]["value"].as_f64().unwrap() - tok_s(&data(A))).abs() < 1e-9);

    // A-A-B-B is not balanced.
    let a2b = variant(&d, A, "bmoe-20260721-100030.csv", &same);
    let j: Value = serde_json::from_str(&ok(&["diff", "--json", &p(&a1), &p(&a2b), &p(&b1), &p(&b2)])).unwrap();
    assert_eq!(j["comparisons"][0]["order"], "A-A-B-B");
    let w = j["warnings"].as_array().unwrap().iter().find(|w| w["kind"] == "order").expect("an order warning");
    assert!(w["message"].as_str().unwrap().contains("A-B-B-A"), "{w}");
}

#[test]
fn other_settings_days_and_gaps_are_warned_about() {
    let d = scratch("settings");
    let a = variant(&d, A, "bmoe-20260721-090406.csv", &|s| s.to_string());
    let b = variant(&d, B, "bmoe-20260722-090539.csv", &|s| s.replace("cache_mb=3000", "cache_mb=2000"));
    let j: Value = serde_json::from_str(&ok(&["diff", "--json", a.to_str().unwrap(), b.to_str().unwrap()])).unwrap();
    let kinds: Vec<&str> = j["warnings"].as_array().unwrap().iter().map(|w| w["kind"].as_str().unwrap()).collect();
    assert!(kinds.contains(&"config"), "{kinds:?}");
    assert!(kinds.contains(&"day"), "{kinds:?}");
    assert!(kinds.contains(&"gap"), "{kinds:?}");
    let msg = j["warnings"].as_array().unwrap().iter().find(|w| w["kind"] == "config").unwrap()["message"].clone();
    assert!(msg.as_str().unwrap().contains("2 settings (cache_mb, dense_weights)"), "{msg}");
}

#[test]
fn identical_configurations_are_compared_file_by_file() {
    let d = scratch("aa");
    let a = variant(&d, A, "bmoe-20260721-090406.csv", &|s| s.to_string());
    let b = variant(&d, A, "bmoe-20260721-090500.csv", &|s| s.to_string());
    let j: Value = serde_json::from_str(&ok(&["diff", "--json", a.to_str().unwrap(), b.to_str().unwrap()])).unwrap();
    assert_eq!(j["sides"].as_array().unwrap().len(), 2);
    let t = row(&j["comparisons"][0], "tok_s");
    assert_eq!(t["delta"], 0.0);
    assert_eq!(t["disjoint"], false);
}

#[test]
fn report_summarises_a_csv() {
    let a = data(A);
    let j: Value = serde_json::from_str(&ok(&["report", "--json", a.to_str().unwrap()])).unwrap();
    assert_eq!(j["tokens"], 67);
    assert_eq!(j["format"], "bmoe_metrics");
    assert_eq!(j["header"]["engine_config"]["dense_weights"], "anon");
    let m = j["metrics"].as_array().unwrap();
    assert!((m[0]["value"].as_f64().unwrap() - tok_s(&a)).abs() < 1e-9, "{}", m[0]);
    let text = ok(&["report", a.to_str().unwrap()]);
    assert!(text.contains("2.981") && text.contains("short run"), "{text}");
}

#[test]
fn export_of_a_csv_is_a_valid_chrome_trace() {
    let a = data(A);
    let out = scratch("export").join("a.json");
    ok(&["export", "--chrome-trace", out.to_str().unwrap(), a.to_str().unwrap()]);
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let c = chrome::check(&v);
    let tokens: Vec<_> = c.tracks.values().flatten().filter(|s| s.0.starts_with("token ")).collect();
    assert_eq!(tokens.len(), 67);
    // Token slices are laid end to end with their wall times.
    let w = column(&a, "wall_ms");
    let total_us: f64 = tokens.iter().map(|t| t.2).sum();
    assert!((total_us - w.iter().sum::<f64>() * 1000.0).abs() < 1.0, "{total_us}");
}

#[test]
fn bad_inputs_are_clear_errors() {
    let d = scratch("bad");
    let bad = variant(&d, A, "bad.csv", &|s| s.replacen("640.444", "x", 1));
    let (ok_, _, err) = observer(&["diff", bad.to_str().unwrap(), data(B).to_str().unwrap()]);
    assert!(!ok_);
    assert!(err.contains("bad.csv:5") && err.contains("not a number"), "{err}");
    let other = d.join("notes.txt");
    std::fs::write(&other, "hello\n").unwrap();
    let (ok_, _, err) = observer(&["report", other.to_str().unwrap()]);
    assert!(!ok_);
    assert!(err.contains("neither an observer trace") && err.contains("notes.txt"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    let (ok_, _, err) = observer(&["report", d.join("missing.trace").to_str().unwrap()]);
    assert!(!ok_ && err.contains("missing.trace"), "{err}");
    let (ok_, _, _) = observer(&["diff", data(A).to_str().unwrap()]);
    assert!(!ok_, "diff needs two files");
}

/// `wall_ms` (the third column) of every token row multiplied by `k`.
fn slower(text: &str, k: f64) -> String {
    text.lines()
        .map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            match f.get(2).and_then(|w| w.parse::<f64>().ok()) {
                Some(w) if !l.starts_with('#') => {
                    let mut g: Vec<String> = f.iter().map(|s| s.to_string()).collect();
                    g[2] = format!("{:.3}", w * k);
                    g.join(",")
                }
                _ => l.to_string(),
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
        + "\n"
}

#[test]
fn disagreeing_runs_of_one_side_are_flagged() {
    let d = scratch("between");
    let a1 = variant(&d, A, "bmoe-20260721-100000.csv", &|s| s.to_string());
    let b1 = variant(&d, B, "bmoe-20260721-100100.csv", &|s| s.to_string());
    let b2 = variant(&d, B, "bmoe-20260721-100200.csv", &|s| s.to_string());
    let a2 = variant(&d, A, "bmoe-20260721-100300.csv", &|s| slower(s, 2.5));
    let p = |x: &PathBuf| x.to_str().unwrap().to_string();
    let j: Value = serde_json::from_str(&ok(&["diff", "--json", &p(&a1), &p(&b1), &p(&b2), &p(&a2)])).unwrap();
    let w: Vec<&Value> = j["warnings"].as_array().unwrap().iter().filter(|w| w["kind"] == "between_runs").collect();
    assert_eq!(w.len(), 1, "{}", j["warnings"]);
    assert!(w[0]["message"].as_str().unwrap().contains("A1") && w[0]["message"].as_str().unwrap().contains("A2"));
    // A2's tok/s is 2.5 times lower than A1's, from its own file.
    let (t1, t2) = (j["runs"][0]["tok_s"]["value"].as_f64().unwrap(), j["runs"][3]["tok_s"]["value"].as_f64().unwrap());
    assert!((t1 / t2 - 2.5).abs() < 1e-3, "{t1} / {t2}");
}

#[test]
fn output_keys_can_be_ignored() {
    let d = scratch("ignore");
    let a = variant(&d, A, "bmoe-20260721-090406.csv", &|s| s.replace("prefetch=0", "prefetch=0 out_file=a.bin"));
    let b = variant(&d, B, "bmoe-20260721-090539.csv", &|s| s.replace("prefetch=0", "prefetch=0 out_file=b.bin"));
    let (a, b) = (a.to_str().unwrap(), b.to_str().unwrap());
    let settings = |extra: &[&str]| {
        let mut args = vec!["diff", "--json"];
        args.extend_from_slice(extra);
        args.extend([a, b]);
        let j: Value = serde_json::from_str(&ok(&args)).unwrap();
        j["comparisons"][0]["settings"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["key"].as_str().unwrap().to_string())
            .collect::<Vec<_>>()
    };
    assert_eq!(settings(&[]), ["dense_weights", "out_file"]);
    assert_eq!(settings(&["--ignore", "out_file"]), ["dense_weights"]);
}
