//! The engine's output files follow `engine::output`'s rules: checked before the work, never
//! overwritten without `--force`, never the model, written aside and renamed into place.

mod common;

use std::{path::Path, process::Command};

use common::{ENGINE, scratch, small_model};

fn entries(d: &Path) -> Vec<String> {
    let mut v: Vec<String> =
        std::fs::read_dir(d).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

fn fresh_dir(name: &str) -> std::path::PathBuf {
    let d = scratch(&format!("outputs-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn engine(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(ENGINE).args(args).output().expect("run engine");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn synth_refuses_an_existing_file_without_force_and_replaces_it_whole_with_it() {
    let d = fresh_dir("synth");
    let out = d.join("m.gguf");
    std::fs::write(&out, "precious").unwrap();
    let o = out.to_str().unwrap();
    let (ok, _, err) = engine(&["synth", "-o", o, "--layers", "1"]);
    assert!(!ok && err.contains(o) && err.contains("--force"), "{err}");
    assert_eq!(std::fs::read_to_string(&out).unwrap(), "precious");
    let (ok, _, err) = engine(&["synth", "-o", o, "--layers", "1", "--force"]);
    assert!(ok, "{err}");
    assert_eq!(&std::fs::read(&out).unwrap()[..4], b"GGUF");
    engine::gguf::Gguf::open(&out).expect("a whole model");
    assert_eq!(entries(&d), ["m.gguf"], "no temporary file is left");
    // A symlink is replaced, its target left alone.
    let target = d.join("target");
    std::fs::write(&target, "keep").unwrap();
    let link = d.join("link.gguf");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let (ok, _, err) = engine(&["synth", "-o", link.to_str().unwrap(), "--layers", "1", "--force"]);
    assert!(ok, "{err}");
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "keep");
    assert!(!std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn run_checks_its_outputs_before_it_loads_the_model() {
    let m = small_model();
    let model = m.to_str().unwrap();
    let d = fresh_dir("run");
    let csv = d.join("run.csv");
    std::fs::write(&csv, "old").unwrap();
    let base = ["run", "-m", model, "-p", "Hello", "-n", "4", "-t", "1", "--ignore-eos"];
    fn with<'a>(base: &[&'a str], extra: &[&'a str]) -> Vec<&'a str> {
        [base, extra].concat()
    }
    // An existing output: refused before any token (nothing on stdout), the file as it was.
    let (ok, stdout, err) = engine(&with(&base, &["--metrics-csv", csv.to_str().unwrap()]));
    assert!(!ok && err.contains("run.csv") && err.contains("--force"), "{err}");
    assert!(stdout.is_empty() && !err.contains("loaded in"), "the model was loaded first: {err}");
    assert_eq!(std::fs::read_to_string(&csv).unwrap(), "old");
    // The model is never an output, even with --force, however named.
    let link = d.join("model-link.gguf");
    std::os::unix::fs::symlink(&m, &link).unwrap();
    let before = std::fs::metadata(&m).unwrap().len();
    for out in [model, link.to_str().unwrap()] {
        for flag in ["--metrics-csv", "--metrics-json", "--logits-out"] {
            let (ok, _, err) = engine(&with(&base, &["--force", flag, out]));
            assert!(!ok && err.contains("also an input"), "{flag} {out}: {err}");
        }
    }
    assert_eq!(std::fs::metadata(&m).unwrap().len(), before);
    engine::gguf::Gguf::open(&m).expect("the model is intact");
    // A directory that cannot be written fails at once.
    let (ok, stdout, err) = engine(&with(&base, &["--logits-out", "/proc/engine-logits.f32"]));
    assert!(!ok && stdout.is_empty() && err.contains("/proc/engine-logits.f32"), "{err}");
    // With --force: the whole new files, nothing else left in the directory.
    let (json, logits) = (d.join("run.jsonl"), d.join("logits.f32"));
    let (ok, _, err) = engine(&with(
        &base,
        &[
            "--force",
            "--metrics-csv",
            csv.to_str().unwrap(),
            "--metrics-json",
            json.to_str().unwrap(),
            "--logits-out",
            logits.to_str().unwrap(),
        ],
    ));
    assert!(ok, "{err}");
    let text = std::fs::read_to_string(&csv).unwrap();
    assert!(text.starts_with("# bmoe_metrics v1\n") && text.lines().count() == 4 + 3, "{text}");
    assert_eq!(std::fs::read_to_string(&json).unwrap().lines().count(), 1 + 3);
    let n_vocab =
        engine::gguf::Gguf::open(&m).unwrap().tensors.iter().find(|t| t.name == "token_embd.weight").unwrap().dims[1];
    assert_eq!(std::fs::metadata(&logits).unwrap().len(), 4 * n_vocab);
    assert_eq!(entries(&d), ["logits.f32", "model-link.gguf", "run.csv", "run.jsonl"]);
    std::fs::remove_dir_all(&d).unwrap();
}
