//! Small statistics for the views: token rates with a seeded bootstrap interval.
//!
//! Spec:
//! - A *step* is `(n_tokens, time_ns)` (the state passes each step's cycle on
//!   the decode clock, see `state`). The rate of a set of steps is
//!   `Σ n_tokens / Σ time_ns` in tokens per second.
//! - Its 95 % interval is a percentile bootstrap: `resamples` times, draw as
//!   many steps as there are, with replacement, and compute the same rate; the
//!   interval is the 2.5th and 97.5th percentiles of those rates (linear
//!   interpolation between order statistics).
//! - Draws and percentiles are `moe_stats`'s (SplitMix64 seeded with a fixed
//!   seed, so the same steps always give the same interval: snapshots and
//!   replays are reproducible).
//! - Fewer than two steps give a rate and no interval.

use moe_stats::SplitMix64;

/// The seed of every interval the TUI shows.
pub const SEED: u64 = 0x6F62_7365_7276_6572; // "observer"

/// A rate and, with at least two steps, its bootstrap 95 % interval.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RateInterval {
    /// Tokens per second over all steps.
    pub rate: f64,
    /// (low, high) tokens per second.
    pub ci95: Option<(f64, f64)>,
    /// Bootstrap resamples behind `ci95`.
    pub resamples: usize,
    /// Steps the rate is over.
    pub steps: usize,
}

/// Tokens per second of `steps` (`(n_tokens, wall_ns)`), or `None` without time.
pub fn rate(steps: impl IntoIterator<Item = (u64, u64)>) -> Option<f64> {
    let (mut n, mut wall) = (0u128, 0u128);
    for (t, w) in steps {
        n += t as u128;
        wall += w as u128;
    }
    (wall > 0).then(|| n as f64 * 1e9 / wall as f64)
}

/// Resamples for a final interval (once, at the end of a run), unless the run
/// is so long that this would take more than ~50 M draws.
pub const FINAL_RESAMPLES: usize = 2000;

pub fn final_resamples_for(n: usize) -> usize {
    (50_000_000 / n.max(1)).clamp(200, FINAL_RESAMPLES)
}

/// Resamples for an interval recomputed while tokens stream in: enough for
/// stable percentiles, bounded so that one costs about half a million draws
/// (a few ms) however long the run.
pub fn resamples_for(n: usize) -> usize {
    (500_000 / n.max(1)).clamp(200, FINAL_RESAMPLES)
}

/// The rate of `steps` with its percentile-bootstrap 95 % interval (module spec).
pub fn rate_interval(steps: &[(u64, u64)], resamples: usize, seed: u64) -> Option<RateInterval> {
    let r = rate(steps.iter().copied())?;
    let n = steps.len();
    if n < 2 || resamples == 0 {
        return Some(RateInterval { rate: r, ci95: None, resamples: 0, steps: n });
    }
    let mut rates = Vec::with_capacity(resamples);
    moe_stats::resample(&[n], resamples, &mut SplitMix64::new(seed), |d| {
        let (mut t, mut w) = (0u128, 0u128);
        for &i in &d[0] {
            let (st, sw) = steps[i];
            t += st as u128;
            w += sw as u128;
        }
        if w > 0 {
            rates.push(t as f64 * 1e9 / w as f64);
        }
    });
    let resamples = rates.len();
    let ci95 = moe_stats::interval95(rates);
    Some(RateInterval { rate: r, ci95, resamples: if ci95.is_some() { resamples } else { 0 }, steps: n })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Normal draws (Box–Muller) for synthetic step times.
    fn normal(rng: &mut SplitMix64, mean: f64, sd: f64) -> f64 {
        let u1 = rng.unit().max(1e-12);
        let u2 = rng.unit();
        mean + sd * (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }

    fn steps(rng: &mut SplitMix64, n: usize, mean_ms: f64, sd_ms: f64) -> Vec<(u64, u64)> {
        (0..n).map(|_| (1, (normal(rng, mean_ms, sd_ms).max(1.0) * 1e6) as u64)).collect()
    }

    #[test]
    fn rate_is_tokens_over_time_in_steps() {
        assert_eq!(rate([(1, 100_000_000), (1, 100_000_000)]), Some(10.0));
        assert_eq!(rate([(32, 1_000_000_000)]), Some(32.0));
        assert_eq!(rate([]), None);
        assert_eq!(rate([(1, 0)]), None);
    }

    #[test]
    fn one_step_has_no_interval_and_same_input_same_interval() {
        let one = rate_interval(&[(1, 50_000_000)], 500, SEED).unwrap();
        assert_eq!(one.ci95, None);
        assert!((one.rate - 20.0).abs() < 1e-9);
        let mut rng = SplitMix64::new(7);
        let s = steps(&mut rng, 100, 50.0, 5.0);
        let a = rate_interval(&s, 500, SEED).unwrap();
        let b = rate_interval(&s, 500, SEED).unwrap();
        assert_eq!(a, b);
        let c = rate_interval(&s, 500, SEED + 1).unwrap();
        assert_ne!(a.ci95, c.ci95, "a different seed draws different resamples");
    }

    #[test]
    fn interval_brackets_the_estimate_and_matches_the_delta_method() {
        let mut rng = SplitMix64::new(11);
        let s = steps(&mut rng, 400, 80.0, 12.0);
        let ri = rate_interval(&s, 2000, SEED).unwrap();
        let (lo, hi) = ri.ci95.unwrap();
        assert!(lo < ri.rate && ri.rate < hi, "{lo} < {} < {hi}", ri.rate);
        // Delta method: rate = 1e3/mean_ms, sd(rate) ≈ rate * sd/mean/√n.
        let walls: Vec<f64> = s.iter().map(|&(_, w)| w as f64 / 1e6).collect();
        let mean = walls.iter().sum::<f64>() / walls.len() as f64;
        let sd = (walls.iter().map(|w| (w - mean).powi(2)).sum::<f64>() / (walls.len() - 1) as f64).sqrt();
        let half = 1.96 * ri.rate * sd / mean / (walls.len() as f64).sqrt();
        let got = (hi - lo) / 2.0;
        assert!((got / half - 1.0).abs() < 0.15, "bootstrap half-width {got} vs delta method {half}");
    }

    #[test]
    fn interval_covers_the_true_rate_about_95_percent_of_the_time() {
        // True mean step 50 ms → 20 tok/s. 200 independent runs of 60 steps.
        let mut rng = SplitMix64::new(2024);
        let mut covered = 0;
        let runs = 200;
        for i in 0..runs {
            let s = steps(&mut rng, 60, 50.0, 10.0);
            let (lo, hi) = rate_interval(&s, 400, SEED + i).unwrap().ci95.unwrap();
            if lo <= 20.0 && 20.0 <= hi {
                covered += 1;
            }
        }
        let share = covered as f64 / runs as f64;
        assert!((0.89..=0.99).contains(&share), "coverage {share}");
    }

    #[test]
    fn resample_budget_is_bounded() {
        assert_eq!(resamples_for(10), 2000);
        assert_eq!(resamples_for(1000), 500);
        assert_eq!(resamples_for(1_000_000), 200);
        assert_eq!(final_resamples_for(10_000), 2000);
        assert_eq!(final_resamples_for(100_000), 500);
    }
}
