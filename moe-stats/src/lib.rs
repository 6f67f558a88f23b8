//! Seeded random numbers, quantiles and percentile bootstrap intervals,
//! written once: the observer's `diff`/`report` intervals, the TUI's tok/s
//! interval, the benchmarks' medians and ratios and the test helpers' fill
//! patterns all use these.
//! No dependencies, so that every crate of the workspace can use it. (The
//! engine's synthetic-model generator keeps its own frozen copy of SplitMix64,
//! `engine::synth::SplitMix`: the files it writes must stay byte-identical
//! whatever happens to this crate.)
//!
//! ## SplitMix64
//! Steele, Lea and Flood (2014): the state advances by the golden-ratio
//! increment `0x9E37_79B9_7F4A_7C15`, and each output is the state through
//! the `(30, 27, 31)` xor-shift-multiply finaliser. `below(n)` maps the high
//! 32 bits to `0..n` by multiply-shift (bias below 2^-32 for the sizes used
//! here); `unit()` is the top 53 bits as a float in `[0, 1)`. Stream `s` of a
//! seed ([`SplitMix64::stream`]) starts from `seed ^ first output of SplitMix64(s)`,
//! so that strata or runs draw unrelated sequences from one seed.
//!
//! ## Percentile bootstrap
//! Data are one or more *strata* of sizes `n_s` (a single sample is one
//! stratum). One replicate draws, for each stratum in order, `n_s` indices
//! uniformly with replacement from `0..n_s` ([`resample`]); the statistic
//! is evaluated on the drawn indices. The 95 % interval is the 2.5th and
//! 97.5th percentile of the replicates' values ([`interval95`]), with linear
//! interpolation between order statistics ([`quantile`], Hyndman–Fan type 7);
//! replicates whose value is not finite are left out. The benchmarks' medians
//! and latency percentiles are the same quantiles ([`median`]).

/// SplitMix64 (module spec).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SplitMix64(u64);

/// The generator's increment (the golden ratio in 64-bit fixed point).
const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

impl SplitMix64 {
    pub const fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    /// Stream `stream` of `seed` (module spec).
    pub fn stream(seed: u64, stream: u64) -> Self {
        SplitMix64(seed ^ SplitMix64::new(stream).next_u64())
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GOLDEN);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (multiply-shift).
    pub fn below(&mut self, n: usize) -> usize {
        ((self.next_u64() >> 32).wrapping_mul(n as u64) >> 32) as usize
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// `resamples` bootstrap replicates of strata of sizes `sizes` (module spec):
/// `replicate` gets each replicate's draws, one slice of indices per stratum.
pub fn resample(sizes: &[usize], resamples: usize, rng: &mut SplitMix64, mut replicate: impl FnMut(&[Vec<usize>])) {
    let mut draws: Vec<Vec<usize>> = sizes.iter().map(|&n| Vec::with_capacity(n)).collect();
    for _ in 0..resamples {
        for (d, &n) in draws.iter_mut().zip(sizes) {
            d.clear();
            d.extend((0..n).map(|_| rng.below(n)));
        }
        replicate(&draws);
    }
}

/// Quantile `q` of sorted data, linear between order statistics (type 7);
/// NaN for no data.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    match sorted.len() {
        0 => f64::NAN,
        len => {
            let h = q.clamp(0.0, 1.0) * (len - 1) as f64;
            let lo = h.floor() as usize;
            let hi = (lo + 1).min(len - 1);
            sorted[lo] + (sorted[hi] - sorted[lo]) * (h - lo as f64)
        }
    }
}

/// The median: sorts `v` and takes its type-7 quantile 0.5 (the mean of the
/// two middle values for an even count); NaN for no data.
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    quantile(v, 0.5)
}

/// The arithmetic mean; `None` for no data.
pub fn mean(v: &[f64]) -> Option<f64> {
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}

/// The 95 % percentile interval of replicate values (the non-finite ones
/// left out); `None` when none is finite.
pub fn interval95(mut values: Vec<f64>) -> Option<(f64, f64)> {
    values.retain(|v| v.is_finite());
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    Some((quantile(&values, 0.025), quantile(&values, 0.975)))
}

/// `stat` over a whole sample of `n` units (`stat(&[0, 1, …, n − 1])`) and its
/// 95 % percentile bootstrap interval from `resamples` replicates: the point
/// value and `(low, high)`, `None` when the point value is not finite.
pub fn bootstrap(
    n: usize,
    resamples: usize,
    seed: u64,
    stat: impl Fn(&[usize]) -> f64,
) -> Option<(f64, Option<(f64, f64)>)> {
    let all: Vec<usize> = (0..n).collect();
    let point = stat(&all);
    if !point.is_finite() {
        return None;
    }
    let mut values = Vec::with_capacity(resamples);
    resample(&[n], resamples, &mut SplitMix64::new(seed), |d| values.push(stat(&d[0])));
    Some((point, interval95(values)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix64_matches_the_reference_outputs() {
        // The first outputs for seed 1234567 of the reference implementation
        // (Vigna's splitmix64.c).
        let mut r = SplitMix64::new(1234567);
        assert_eq!(
            [r.next_u64(), r.next_u64(), r.next_u64()],
            [6457827717110365317, 3203168211198807973, 9817491932198370423]
        );
    }

    #[test]
    fn draws_are_in_range_and_streams_differ() {
        let mut r = SplitMix64::new(7);
        for _ in 0..10_000 {
            assert!(r.below(13) < 13);
            let u = r.unit();
            assert!((0.0..1.0).contains(&u));
        }
        assert_ne!(SplitMix64::stream(7, 0).next_u64(), SplitMix64::stream(7, 1).next_u64());
    }

    #[test]
    fn quantiles_interpolate() {
        let v = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(quantile(&v, 0.0), 1.0);
        assert_eq!(quantile(&v, 0.5), 2.5);
        assert_eq!(quantile(&v, 1.0), 4.0);
        assert!(quantile(&[], 0.5).is_nan());
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&mut []).is_nan());
        assert_eq!(interval95(vec![f64::NAN, 2.0]), Some((2.0, 2.0)));
        assert_eq!(interval95(vec![f64::INFINITY]), None);
    }

    #[test]
    fn mean_interval_matches_the_normal_theory() {
        // Values 0..1000: mean 499.5, sd 288.8, se 9.13 → a half-width of about 17.9.
        let v: Vec<f64> = (0..1000).map(f64::from).collect();
        let mean = |p: &[usize]| p.iter().map(|&i| v[i]).sum::<f64>() / p.len() as f64;
        let (point, ci) = bootstrap(v.len(), 4000, 1, mean).unwrap();
        let (lo, hi) = ci.unwrap();
        assert_eq!(point, 499.5);
        assert!(((hi - lo) / 2.0 - 17.9).abs() < 1.5, "[{lo}, {hi}]");
        assert_eq!(bootstrap(3, 10, 1, |_| f64::NAN), None);
    }

    #[test]
    fn strata_keep_their_sizes_and_order() {
        let mut seen = Vec::new();
        resample(&[2, 3], 5, &mut SplitMix64::new(3), |d| {
            assert_eq!((d[0].len(), d[1].len()), (2, 3));
            assert!(d[0].iter().all(|&i| i < 2) && d[1].iter().all(|&i| i < 3));
            seen.push(d.to_vec());
        });
        assert_eq!(seen.len(), 5);
    }
}
