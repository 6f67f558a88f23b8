//! What the TUI's ticks cost the engine, measured within runs: the engine's
//! token times right after each tick of the screen, against its token times
//! in the rest of the ticks' intervals. The screen thread sleeps between
//! ticks (`tui::term::run`: it takes in the queued events and draws at each
//! tick, and does nothing else without a key), and the terminal works only
//! on what a frame wrote, so all of their work, with whatever it does to the
//! engine's caches or barrier partners, falls just after a tick. A
//! comparison of separate runs cannot see a cost below several % on a
//! virtual machine whose speed drifts by ±10 % over seconds; a comparison
//! within a second of each tick can.
//!
//! Spec (times in seconds, from one run's trace: [`crate::displace`]):
//! - Tokens `i` = 0, 1, … (generated tokens in order) with begin `b_i` and
//!   duration `d_i`; ticks `T_k` (wake-ups of the screen thread), sorted.
//! - Detrend: `e_i = d_i − s·i`, where `s` is the least-squares slope of `d`
//!   over `i` (attention makes each token a little slower than the last).
//! - Tokens are chosen by when they *begin*, never by their duration: a
//!   token's begin is the sum of the durations before it, so the choice does
//!   not favour long tokens (choosing the token under way at a moment would:
//!   a long token is more likely to cover it).
//! - *Near* tick `k`: tokens that begin in `[T_k − LEAD, T_k + NEAR)`, which
//!   holds the token under way at the tick (tokens last 5–40 ms here) and
//!   the time in which the screen's and the terminal's work gets a CPU.
//!   *Far* around tick `k`: tokens that begin in `[T_{k−1} + NEAR, T_k −
//!   LEAD)` or in `[T_k + NEAR, T_{k+1} − LEAD)`: one window on each side,
//!   whose mean centre is the near window's, so a linear drift cancels.
//! - Ticks used: those with a tick before and after, all three within the
//!   tokens' span, and at least [`MIN_FAR`] far tokens on each side.
//! - Lost at tick `k`: `Σ_near (e_i − mean_far e)`. The interval of tick `k`:
//!   `Σ d_i` over the tokens that begin in `[T_k, T_{k+1})`.
//! - A set of runs: the decode-speed ratio with ticks / without them is
//!   `1 − Σ lost / Σ interval` over every used tick of every run (time lost
//!   per time spent), with a 95 % percentile bootstrap interval over runs
//!   (runs resampled whole: 2000 resamples, fixed seed), since periodic work
//!   of other threads may keep its phase against the ticks within a run.
//! - The control: the same estimator on runs without a screen, with ticks at
//!   the same period from random phases ([`pseudo_ticks`]); it must hold 1.
//!   Whatever the estimator finds where nothing happens at the ticks (the
//!   count of tokens in a window of fixed time shrinks as they slow down, so
//!   a sum over it is not quite neutral; noise) is taken off: the *net*
//!   ratio is `1 − (Σ lost / Σ interval under the screen − the same in the
//!   control)`, bootstrapped over rounds (a round's screen run and control
//!   run resampled together).
//! - The profile: mean `e_i − mean_far e` of the tokens that begin in each
//!   25 ms bin from 100 ms before to 450 ms after a tick; it shows where the
//!   cost falls and that `near` covers it.

use moe_stats::SplitMix64;

use crate::{bench_util::bootstrap, displace::TokenSpan};

/// Far tokens needed on each side of a tick.
pub const MIN_FAR: usize = 4;
/// The near window: from `LEAD` before a tick to `NEAR` after it (seconds).
pub const LEAD: f64 = 0.05;
pub const NEAR: f64 = 0.1;
/// The profile's bins: width and the first bin's start, seconds from the tick.
pub const BIN_S: f64 = 0.025;
pub const PROFILE_FROM_S: f64 = -0.1;
pub const PROFILE_BINS: usize = 22;

/// One run's ticks, summed.
#[derive(Clone, Debug, PartialEq)]
pub struct Excess {
    pub ticks: usize,
    /// Σ lost over the used ticks.
    pub lost_s: f64,
    /// Σ of their intervals.
    pub interval_s: f64,
    /// Per profile bin: Σ of the tokens' excess, and their number.
    pub profile: Vec<(f64, usize)>,
}

/// One run (module spec).
pub fn excess(tokens: &[TokenSpan], ticks: &[f64]) -> Excess {
    let mut out = Excess::default();
    let (Some(first), Some(last)) = (tokens.first(), tokens.last()) else { return out };
    let (start, end) = (first.begin_s, last.begin_s + last.dur_s);
    let slope = slope(tokens);
    let e: Vec<f64> = tokens.iter().enumerate().map(|(i, t)| t.dur_s - slope * i as f64).collect();
    // Tokens are in time order: the range of those that begin in [a, b).
    let begins = |a: f64, b: f64| {
        let lo = tokens.partition_point(|t| t.begin_s < a);
        lo..tokens.partition_point(|t| t.begin_s < b).max(lo)
    };
    for w in ticks.windows(3) {
        let (prev, t, next) = (w[0], w[1], w[2]);
        if prev < start || next > end {
            continue;
        }
        let (before, after) = (begins(prev + NEAR, t - LEAD), begins(t + NEAR, next - LEAD));
        if before.len() < MIN_FAR || after.len() < MIN_FAR {
            continue;
        }
        let far = before.len() + after.len();
        let base = before.chain(after).map(|i| e[i]).sum::<f64>() / far as f64;
        out.lost_s += begins(t - LEAD, t + NEAR).map(|i| e[i] - base).sum::<f64>();
        out.interval_s += begins(t, next).map(|i| tokens[i].dur_s).sum::<f64>();
        out.ticks += 1;
        for i in begins(t + PROFILE_FROM_S, t + PROFILE_FROM_S + BIN_S * PROFILE_BINS as f64) {
            let bin = ((tokens[i].begin_s - t - PROFILE_FROM_S) / BIN_S) as usize;
            if let Some(b) = out.profile.get_mut(bin) {
                b.0 += e[i] - base;
                b.1 += 1;
            }
        }
    }
    out
}

/// The least-squares slope of the tokens' durations over their index.
fn slope(tokens: &[TokenSpan]) -> f64 {
    let n = tokens.len() as f64;
    if n < 2.0 {
        return 0.0;
    }
    let (mx, my) = ((n - 1.0) / 2.0, tokens.iter().map(|t| t.dur_s).sum::<f64>() / n);
    let (mut sxy, mut sxx) = (0.0, 0.0);
    for (i, t) in tokens.iter().enumerate() {
        sxy += (i as f64 - mx) * (t.dur_s - my);
        sxx += (i as f64 - mx) * (i as f64 - mx);
    }
    sxy / sxx
}

/// Ticks every `period` over the tokens' span from a phase drawn from `seed`:
/// where a screen would have ticked in a run without one.
pub fn pseudo_ticks(tokens: &[TokenSpan], period: f64, seed: &mut SplitMix64) -> Vec<f64> {
    let (Some(first), Some(last)) = (tokens.first(), tokens.last()) else { return Vec::new() };
    let phase = seed.unit() * period;
    let end = last.begin_s + last.dur_s;
    (0..).map(|k| first.begin_s + phase + k as f64 * period).take_while(|&t| t < end).collect()
}

impl Default for Excess {
    /// No tick, and every profile bin empty.
    fn default() -> Excess {
        Excess { ticks: 0, lost_s: 0.0, interval_s: 0.0, profile: vec![(0.0, 0); PROFILE_BINS] }
    }
}

impl Excess {
    /// `other`'s ticks added to these (the control's phases of one run).
    pub fn add(&mut self, other: &Excess) {
        self.ticks += other.ticks;
        self.lost_s += other.lost_s;
        self.interval_s += other.interval_s;
        for (a, b) in self.profile.iter_mut().zip(&other.profile) {
            a.0 += b.0;
            a.1 += b.1;
        }
    }
}

/// The bootstrap's seed (module spec: fixed).
const SEED: u64 = 0x7469_636b_6c6f_636b;

/// Σ lost / Σ interval over the runs picked by `pick` (NaN without a used tick).
fn lost_share(runs: &[Excess], pick: &mut dyn Iterator<Item = usize>) -> f64 {
    let (lost, interval) = pick.fold((0.0, 0.0), |(l, s), i| (l + runs[i].lost_s, s + runs[i].interval_s));
    lost / interval
}

/// The decode-speed ratio with ticks / without over a set of runs, `1 − Σ
/// lost / Σ interval`, and its 95 % bootstrap interval over runs (module
/// spec); `None` without a used tick.
pub fn ratio(runs: &[Excess]) -> Option<(f64, f64, f64)> {
    bootstrap(runs.len(), SEED, |pick| 1.0 - lost_share(runs, &mut pick.iter().copied()))
}

/// The cost of the ticks net of the method's control: `Σ lost / Σ interval`
/// under the screen minus the same in the control, as a decode-speed ratio
/// `1 − difference`, with a 95 % bootstrap interval over rounds (each round's
/// pair resampled together).
pub fn net_ratio(screen: &[Excess], control: &[Excess]) -> Option<(f64, f64, f64)> {
    if screen.len() != control.len() {
        return None;
    }
    bootstrap(screen.len(), SEED, |pick| {
        1.0 - (lost_share(screen, &mut pick.iter().copied()) - lost_share(control, &mut pick.iter().copied()))
    })
}

/// The runs' profiles pooled: per bin, its start (seconds from the tick) and
/// the mean excess of its tokens (NaN without one).
pub fn pooled_profile(runs: &[Excess]) -> Vec<(f64, f64)> {
    (0..PROFILE_BINS)
        .map(|b| {
            let (s, n) = runs.iter().fold((0.0, 0), |(s, n), r| (s + r.profile[b].0, n + r.profile[b].1));
            (PROFILE_FROM_S + b as f64 * BIN_S, if n == 0 { f64::NAN } else { s / n as f64 })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Back-to-back tokens of `base` seconds, growing by `slope` per token, plus
    /// `extra(begin)`.
    fn tokens(n: usize, base: f64, slope: f64, extra: impl Fn(f64) -> f64) -> Vec<TokenSpan> {
        let mut t = 0.0;
        (0..n)
            .map(|i| {
                let dur = base + slope * i as f64 + extra(t);
                let span = TokenSpan { index: i as u64 + 1, begin_s: t, dur_s: dur };
                t += dur;
                span
            })
            .collect()
    }

    #[test]
    fn no_cost_and_a_linear_drift_give_a_ratio_of_one() {
        // 8 ms tokens slowing by 2 µs per token, ticks every 0.5 s.
        let toks = tokens(3000, 0.008, 2e-6, |_| 0.0);
        let ticks: Vec<f64> = (0..80).map(|k| 0.013 + 0.5 * k as f64).collect();
        let e = excess(&toks, &ticks);
        assert!(e.ticks > 40, "{e:?}");
        assert!(e.lost_s.abs() < 1e-9, "{e:?}");
        let (r, lo, hi) = ratio(&[e.clone(), e]).unwrap();
        assert!((r - 1.0).abs() < 1e-9 && (lo - 1.0).abs() < 1e-9 && (hi - 1.0).abs() < 1e-9);
    }

    #[test]
    fn time_lost_after_each_tick_is_found_and_profiled() {
        // Each tick makes the tokens that begin in its first 40 ms 1 ms slower.
        let period = 0.5;
        let hit = |t: f64| if (t - 0.013).rem_euclid(period) < 0.04 { 0.001 } else { 0.0 };
        let toks = tokens(3000, 0.008, 0.0, hit);
        let ticks: Vec<f64> = (0..80).map(|k| 0.013 + period * k as f64).collect();
        let e = excess(&toks, &ticks);
        // About 40 ms / 9 ms = 4–5 slower tokens per tick, ~1 ms each, per ~0.5 s.
        let per_tick = e.lost_s / e.ticks as f64;
        assert!((0.0035..0.0065).contains(&per_tick), "{per_tick} {e:?}");
        let (r, ..) = ratio(std::slice::from_ref(&e)).unwrap();
        assert!((r - (1.0 - e.lost_s / e.interval_s)).abs() < 1e-12);
        assert!((0.985..0.995).contains(&r), "{r}");
        let prof = pooled_profile(&[e]);
        // The bins from the tick to 25 ms carry the cost; bins well after it none.
        let at = |s: f64| prof.iter().find(|(b, _)| (b - s).abs() < 1e-9).unwrap().1;
        assert!(at(0.0) > 0.0008 && at(0.3).abs() < 1e-4 && at(-0.1).abs() < 1e-4, "{prof:?}");
    }

    #[test]
    fn long_tokens_are_not_favoured() {
        // Noisy tokens with a heavy tail (one in 20 takes 30 ms more), no cost at
        // the ticks: choosing the token under way at a tick would find ~0.9 % here (E[d²]/E[d] − E[d] per tick).
        let mut rng = SplitMix64::new(11);
        let mut u = || rng.unit();
        let durs: Vec<f64> = (0..60_000).map(|_| 0.006 + 0.004 * u() + if u() < 0.05 { 0.03 } else { 0.0 }).collect();
        let toks = tokens(durs.len(), 0.0, 0.0, |_| 0.0);
        let mut t = 0.0;
        let toks: Vec<TokenSpan> = toks
            .into_iter()
            .zip(&durs)
            .map(|(x, &d)| {
                let y = TokenSpan { begin_s: t, dur_s: d, ..x };
                t += d;
                y
            })
            .collect();
        let mut seed = SplitMix64::new(3);
        let e = excess(&toks, &pseudo_ticks(&toks, 0.5, &mut seed));
        assert!(e.ticks > 1000, "{e:?}");
        let (r, lo, hi) = ratio(&[e]).unwrap();
        assert!((r - 1.0).abs() < 0.0015 && lo <= hi, "{r}");
    }

    #[test]
    fn pseudo_ticks_cover_the_span_at_the_period() {
        let toks = tokens(1000, 0.008, 0.0, |_| 0.0);
        let mut seed = SplitMix64::new(7);
        let t = pseudo_ticks(&toks, 0.5, &mut seed);
        assert!(t[0] >= 0.0 && t[0] < 0.5 && t.len() == 16, "{t:?}");
        assert!(t.windows(2).all(|w| (w[1] - w[0] - 0.5).abs() < 1e-12));
        let mut seed2 = SplitMix64::new(8);
        assert_ne!(pseudo_ticks(&toks, 0.5, &mut seed2)[0], t[0]);
    }

    #[test]
    fn the_interval_spans_runs() {
        let a = Excess { ticks: 10, lost_s: 0.01, interval_s: 5.0, ..Excess::default() };
        let b = Excess { ticks: 10, lost_s: 0.03, interval_s: 5.0, ..a.clone() };
        let (r, lo, hi) = ratio(&[a.clone(), b.clone()]).unwrap();
        assert!((r - 0.996).abs() < 1e-12, "{r}");
        assert!((lo - 0.994).abs() < 1e-12 && (hi - 0.998).abs() < 1e-12 && lo <= r && r <= hi, "{lo} {hi}");
        assert!(ratio(&[]).is_none());
        // Net of a control that finds 0.1 % where nothing happens.
        let c = Excess { ticks: 10, lost_s: 0.005, interval_s: 5.0, ..a.clone() };
        let (n, lo, hi) = net_ratio(&[a.clone(), b.clone()], &[c.clone(), c.clone()]).unwrap();
        assert!((n - 0.997).abs() < 1e-12 && lo <= n && n <= hi, "{n} [{lo}, {hi}]");
        assert!(net_ratio(std::slice::from_ref(&a), &[]).is_none());
        let mut sum = a.clone();
        sum.add(&b);
        assert_eq!((sum.ticks, sum.lost_s, sum.interval_s), (20, 0.04, 10.0));
    }
}
