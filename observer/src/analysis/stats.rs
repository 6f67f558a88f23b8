//! Seeded bootstrap confidence intervals over tokens.
//!
//! ## Rule
//! Every statistic is a ratio of sums over tokens, `Σ num_i / Σ den_i`:
//! - a per-token mean of a metric is `num_i` = the token's value, `den_i` = 1,
//!   over the tokens where the metric was measured (`den_i` = 0 elsewhere, so
//!   unmeasured tokens count for nothing, never as 0);
//! - tok/s is `num_i` = tokens in the record, `den_i` = its wall seconds, i.e.
//!   `tokens / Σ wall` (a mean of per-token rates would weight fast tokens up).
//!
//! A *sample* is one or more runs (strata). One bootstrap replicate draws, for
//! each run separately, as many tokens as it has, uniformly with replacement,
//! and evaluates every statistic on the pooled draws (a stratified bootstrap:
//! each run keeps its size, so runs of one configuration recorded at
//! different times are not mixed up). The 95 % interval is the 2.5th–97.5th
//! percentile of the replicates (percentile bootstrap, linear interpolation
//! between order statistics). Replicates in which a metric has no measured
//! token are left out for that metric.
//!
//! Randomness: ChaCha8 seeded with `seed` on stream `stream` (the position
//! of the run, or of a side's first run), so the same inputs, seed and resample count give the same
//! intervals on every machine.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

pub const DEFAULT_RESAMPLES: usize = 2000;
pub const DEFAULT_SEED: u64 = 2026;

/// A closed interval.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Interval {
    pub lo: f64,
    pub hi: f64,
}

impl Interval {
    pub fn disjoint(&self, o: &Interval) -> bool {
        self.hi < o.lo || o.hi < self.lo
    }
}

/// A point estimate and its interval; `None` where nothing was measured.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Estimate {
    pub value: Option<f64>,
    pub ci95: Option<Interval>,
    /// Tokens with the metric measured.
    pub n: usize,
}

/// Per-token `(num, den)` pairs of several statistics, for one run.
#[derive(Debug, Clone, Default)]
pub struct Stratum {
    /// Row-major: token `i`, statistic `k` at `i * k_count + k`.
    num: Vec<f64>,
    den: Vec<f64>,
    n: usize,
}

impl Stratum {
    /// `rows[i][k]` = `(num, den)` of statistic `k` on token `i`.
    pub fn new(k_count: usize, rows: impl IntoIterator<Item = Vec<(f64, f64)>>) -> Self {
        let mut s = Stratum::default();
        for r in rows {
            assert_eq!(r.len(), k_count, "one (num, den) per statistic");
            for (a, b) in r {
                s.num.push(a);
                s.den.push(b);
            }
            s.n += 1;
        }
        s
    }
    pub fn len(&self) -> usize {
        self.n
    }
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }
}

/// `(num, den)` for a per-token mean of an optional value.
pub fn mean_term(v: Option<f64>) -> (f64, f64) {
    match v {
        Some(x) if x.is_finite() => (x, 1.0),
        _ => (0.0, 0.0),
    }
}

/// Quantile `q` of sorted data (type 7: linear interpolation).
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    let h = (sorted.len() - 1) as f64 * q;
    let lo = h.floor() as usize;
    let hi = h.ceil() as usize;
    sorted[lo] + (h - lo as f64) * (sorted[hi] - sorted[lo])
}

/// Point estimates and bootstrap intervals of `k_count` statistics over the
/// pooled strata.
pub fn bootstrap(strata: &[Stratum], k_count: usize, resamples: usize, seed: u64, stream: u64) -> Vec<Estimate> {
    let mut num = vec![0.0; k_count];
    let mut den = vec![0.0; k_count];
    let mut n = vec![0usize; k_count];
    for s in strata {
        for i in 0..s.n {
            for k in 0..k_count {
                num[k] += s.num[i * k_count + k];
                den[k] += s.den[i * k_count + k];
                n[k] += usize::from(s.den[i * k_count + k] != 0.0);
            }
        }
    }
    let point: Vec<Option<f64>> = (0..k_count).map(|k| (den[k] != 0.0).then(|| num[k] / den[k])).collect();

    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(stream);
    let mut reps: Vec<Vec<f64>> = vec![Vec::with_capacity(resamples); k_count];
    let mut bn = vec![0.0; k_count];
    let mut bd = vec![0.0; k_count];
    for _ in 0..resamples {
        bn.fill(0.0);
        bd.fill(0.0);
        for s in strata {
            if s.n == 0 {
                continue;
            }
            for _ in 0..s.n {
                let i = rng.random_range(0..s.n);
                let row = i * k_count;
                for k in 0..k_count {
                    bn[k] += s.num[row + k];
                    bd[k] += s.den[row + k];
                }
            }
        }
        for k in 0..k_count {
            if bd[k] != 0.0 {
                reps[k].push(bn[k] / bd[k]);
            }
        }
    }
    (0..k_count)
        .map(|k| {
            let r = &mut reps[k];
            r.sort_by(f64::total_cmp);
            let ci95 = (point[k].is_some() && !r.is_empty())
                .then(|| Interval { lo: quantile(r, 0.025), hi: quantile(r, 0.975) });
            Estimate { value: point[k], ci95, n: n[k] }
        })
        .collect()
}

/// Coefficient of variation (sample standard deviation / mean), `None` for
/// fewer than two values or a zero mean.
pub fn cv(values: &[f64]) -> Option<f64> {
    if values.len() < 2 {
        return None;
    }
    let n = values.len() as f64;
    let mean = values.iter().sum::<f64>() / n;
    if mean == 0.0 {
        return None;
    }
    let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0);
    Some(var.sqrt() / mean.abs())
}

/// Tokens per run needed so that two runs' 95 % intervals of a mean separate
/// when the true relative difference is `rel_delta`: each half-width
/// `1.96·CV/√n` must be below `|rel_delta|/2`.
pub fn tokens_needed(cv: f64, rel_delta: f64) -> Option<u64> {
    if rel_delta == 0.0 || !rel_delta.is_finite() {
        return None;
    }
    let n = (2.0 * 1.96 * cv / rel_delta.abs()).powi(2);
    Some(n.ceil() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stratum(v: &[f64]) -> Stratum {
        Stratum::new(1, v.iter().map(|&x| vec![(x, 1.0)]))
    }

    #[test]
    fn mean_interval_matches_the_normal_theory_for_a_large_sample() {
        // Values 0..1000: mean 499.5, sd 288.8, se 9.13 → ±17.9.
        let v: Vec<f64> = (0..1000).map(f64::from).collect();
        let e = &bootstrap(&[stratum(&v)], 1, 4000, 1, 0)[0];
        assert_eq!(e.value, Some(499.5));
        let ci = e.ci95.unwrap();
        let half = (ci.hi - ci.lo) / 2.0;
        assert!((half - 17.9).abs() < 1.5, "half-width {half}");
        assert!(ci.lo < 499.5 && 499.5 < ci.hi);
    }

    #[test]
    fn seeded_and_reproducible() {
        let v = [1.0, 5.0, 2.0, 9.0, 3.0];
        let a = bootstrap(&[stratum(&v)], 1, 500, 7, 0);
        let b = bootstrap(&[stratum(&v)], 1, 500, 7, 0);
        let c = bootstrap(&[stratum(&v)], 1, 500, 8, 0);
        assert_eq!(a, b);
        assert_ne!(a[0].ci95, c[0].ci95);
    }

    #[test]
    fn ratio_of_sums_and_unmeasured_tokens() {
        // tok/s of two 1-token records of 0.5 s and 1.5 s is 2 / 2 s = 1, not mean(2, 0.667).
        let s = Stratum::new(2, [vec![(1.0, 0.5), mean_term(None)], vec![(1.0, 1.5), mean_term(Some(4.0))]]);
        let e = bootstrap(&[s], 2, 200, 1, 0);
        assert_eq!(e[0].value, Some(1.0));
        assert_eq!(e[1].value, Some(4.0), "the unmeasured token does not count as 0");
        assert_eq!(e[1].n, 1);
        let none = bootstrap(&[Stratum::new(1, [vec![mean_term(None)]])], 1, 10, 1, 0);
        assert_eq!(none[0], Estimate { value: None, ci95: None, n: 0 });
    }

    #[test]
    fn constant_data_has_a_point_interval() {
        let e = &bootstrap(&[stratum(&[3.0; 10])], 1, 100, 1, 0)[0];
        assert_eq!(e.ci95, Some(Interval { lo: 3.0, hi: 3.0 }));
    }

    #[test]
    fn strata_keep_their_sizes() {
        // Two runs of very different means: every replicate has 2 of each,
        // so the pooled mean never leaves [2.5 - spread, …]: here exactly 5.5.
        let a = stratum(&[1.0, 1.0]);
        let b = stratum(&[10.0, 10.0]);
        let e = &bootstrap(&[a, b], 1, 200, 3, 0)[0];
        assert_eq!(e.ci95, Some(Interval { lo: 5.5, hi: 5.5 }));
    }

    #[test]
    fn cv_and_tokens_needed() {
        assert_eq!(cv(&[1.0]), None);
        let c = cv(&[2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]).unwrap();
        assert!((c - 2.138_089_935 / 5.0).abs() < 1e-6, "{c}");
        // CV 0.5, 10 % difference: (2·1.96·0.5/0.1)² = 384.2 → 385.
        assert_eq!(tokens_needed(0.5, 0.1), Some(385));
        assert_eq!(tokens_needed(0.5, 0.0), None);
    }
}
