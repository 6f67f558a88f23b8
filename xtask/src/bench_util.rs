//! Pieces shared by the engine-driving benchmarks (`bench observer|tui|metrics`):
//! the engine's own decode speed from its `--json` summary, the
//! A-B-B-A order of rounds, and the standard benchmark command line on the
//! cached `small` model.

use std::{path::Path, process::Command};

use anyhow::{Context, Result};
use serde_json::Value;

use crate::{cache, cmd, llama};

/// `gen_tok_s` of the engine's final JSON summary line in `text` (other
/// output, e.g. the observer's, may be mixed in).
pub fn gen_tok_s(text: &str) -> Result<f64> {
    let line = text.lines().rev().find(|l| l.contains("\"gen_tok_s\"")).context("no engine summary in the output")?;
    let v: Value = serde_json::from_str(line.trim()).context("parsing the engine's summary")?;
    v["gen_tok_s"].as_f64().context("no gen_tok_s in the engine's summary")
}

/// Round `r` of an A-B-B-A sequence: A then B in even rounds, B then A in
/// odd ones, so that drift over time falls on both sides alike. Returns (A, B).
pub fn abba_round<A, B>(r: usize, a: impl FnOnce() -> Result<A>, b: impl FnOnce() -> Result<B>) -> Result<(A, B)> {
    if r.is_multiple_of(2) {
        let x = a()?;
        Ok((x, b()?))
    } else {
        let y = b()?;
        Ok((a()?, y))
    }
}

/// `stat` over every unit (`stat(&[0, 1, …, n − 1])`) and its 95 %
/// percentile bootstrap interval from 2000 resamples of the `n` units
/// (`moe_stats::bootstrap`, seeded with `seed`, so the same data always give
/// the same interval): `(value, low, high)`, `None` when `stat` is not finite
/// over every unit or in any resample.
pub fn bootstrap(n: usize, seed: u64, stat: impl Fn(&[usize]) -> f64) -> Option<(f64, f64, f64)> {
    let (point, ci) = moe_stats::bootstrap(n, 2000, seed, stat)?;
    ci.map(|(lo, hi)| (point, lo, hi))
}

/// The geometric mean of paired ratios `b / a` and its 95 % [`bootstrap`]
/// interval over the pairs. `None` for fewer than two pairs.
pub fn paired_ratio_ci(pairs: &[(f64, f64)]) -> Option<(f64, f64, f64)> {
    let logs: Vec<f64> = pairs.iter().map(|(a, b)| (b / a).ln()).collect();
    let n = logs.len();
    if n < 2 || logs.iter().any(|l| !l.is_finite()) {
        return None;
    }
    bootstrap(n, 0x6265_6e63_6875_7469, |pick| (pick.iter().map(|&i| logs[i]).sum::<f64>() / n as f64).exp())
}

/// Set the machine up, build the observer and engine binaries, and return their directory.
pub fn build() -> Result<std::path::PathBuf> {
    crate::setup::run(crate::setup::Scope::All)?;
    let root = cache::workspace_root();
    cmd::run(Command::new("cargo").current_dir(&root).args([
        "build",
        "--release",
        "-p",
        "observer",
        "-p",
        "engine",
        "--bins",
    ]))?;
    Ok(cache::target_dir().join("release"))
}

/// `engine run` arguments (without the binary) on the cached synthetic model
/// of `preset`, greedy, `n` tokens, `threads` threads, JSON summary.
pub fn engine_args(engine: &Path, preset: &str, n: usize, threads: usize) -> Result<Vec<String>> {
    engine_args_for(engine, &format!("bench-{preset}"), &["--preset", preset], n, threads)
}

/// [`engine_args`] on the model `engine synth SYNTH` makes (cached under `name`).
pub fn engine_args_for(engine: &Path, name: &str, synth: &[&str], n: usize, threads: usize) -> Result<Vec<String>> {
    let model = llama::synth_model(engine, name, synth)?;
    Ok(vec![
        "run".into(),
        "-m".into(),
        model.display().to_string(),
        "-p".into(),
        "The observer measures where the time of a token goes".into(),
        "-n".into(),
        n.to_string(),
        "-t".into(),
        threads.to_string(),
        "--ignore-eos".into(),
        "--json".into(),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_alternate_a_b_b_a() {
        let order = std::cell::RefCell::new(String::new());
        for r in 0..4 {
            let got = abba_round(
                r,
                || {
                    order.borrow_mut().push('A');
                    Ok(1)
                },
                || {
                    order.borrow_mut().push('B');
                    Ok(2)
                },
            )
            .unwrap();
            assert_eq!(got, (1, 2), "results come back as (A, B) whatever the order");
        }
        assert_eq!(order.into_inner(), "ABBAABBA");
    }

    #[test]
    fn summaries_parse() {
        let out = "observer: x\n{\"id\":1}\n{\"gen_tok_s\":12.5,\"prompt_tok_s\":3}\n";
        assert_eq!(gen_tok_s(out).unwrap(), 12.5);
        assert!(gen_tok_s("nothing").is_err());
    }

    #[test]
    fn paired_ratio_interval() {
        assert!(paired_ratio_ci(&[(1.0, 1.0)]).is_none());
        // Identical ratios: a point interval.
        let (g, lo, hi) = paired_ratio_ci(&[(100.0, 99.0), (120.0, 118.8), (90.0, 89.1)]).unwrap();
        assert!((g - 0.99).abs() < 1e-12 && (lo - 0.99).abs() < 1e-12 && (hi - 0.99).abs() < 1e-12);
        // Spread ratios: the interval holds the geometric mean and lies within the extremes.
        let pairs: Vec<(f64, f64)> = (0..10).map(|i| (100.0, 95.0 + i as f64)).collect();
        let (g, lo, hi) = paired_ratio_ci(&pairs).unwrap();
        assert!(lo < g && g < hi && lo > 0.95 && hi < 1.04, "{g} [{lo}, {hi}]");
        let geo = (pairs.iter().map(|(a, b)| (b / a).ln()).sum::<f64>() / 10.0).exp();
        assert!((g - geo).abs() < 1e-12);
    }
}
