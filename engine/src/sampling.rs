//! Token sampling: greedy (`temp <= 0`) or seeded temperature / top-k / top-p.
//!
//! The order is llama.cpp's usual chain: top-k, then temperature, softmax, top-p (keep the
//! smallest prefix of the sorted distribution whose mass reaches `top_p`), then a draw. Greedy
//! takes the first index of the maximum logit, like llama.cpp's greedy sampler. The random
//! stream is the engine's own (splitmix64), so seeded runs repeat, but they do not reproduce
//! llama.cpp's sampled tokens.

use crate::synth::SplitMix;

#[derive(Debug, Clone)]
pub struct SamplerConfig {
    pub temp: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub seed: u64,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig { temp: 0.8, top_k: 40, top_p: 0.95, seed: 0 }
    }
}

#[derive(Debug)]
pub struct Sampler {
    cfg: SamplerConfig,
    rng: SplitMix,
    cand: Vec<(u32, f32)>,
}

pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

impl Sampler {
    pub fn new(cfg: SamplerConfig) -> Sampler {
        let rng = SplitMix::new(cfg.seed);
        Sampler { cfg, rng, cand: Vec::new() }
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.cfg.temp <= 0.0 || logits.is_empty() {
            return argmax(logits);
        }
        self.cand.clear();
        self.cand.extend(logits.iter().enumerate().map(|(i, &l)| (i as u32, l)));
        self.cand.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if self.cfg.top_k > 0 {
            self.cand.truncate(self.cfg.top_k);
        }
        let max = self.cand[0].1;
        let mut sum = 0f64;
        for c in &mut self.cand {
            c.1 = ((c.1 - max) / self.cfg.temp).exp();
            sum += f64::from(c.1);
        }
        for c in &mut self.cand {
            c.1 = (f64::from(c.1) / sum) as f32;
        }
        if self.cfg.top_p < 1.0 {
            let mut acc = 0f32;
            let mut keep = self.cand.len();
            for (i, c) in self.cand.iter().enumerate() {
                acc += c.1;
                if acc >= self.cfg.top_p {
                    keep = i + 1;
                    break;
                }
            }
            self.cand.truncate(keep);
        }
        let total: f32 = self.cand.iter().map(|c| c.1).sum();
        let r = (self.rng.uniform() * 0.5 + 0.5) * total;
        let mut acc = 0f32;
        for c in &self.cand {
            acc += c.1;
            if r < acc {
                return c.0;
            }
        }
        self.cand.last().map_or(0, |c| c.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_maximum() {
        let mut s = Sampler::new(SamplerConfig { temp: 0.0, ..Default::default() });
        assert_eq!(s.sample(&[0.0, 3.0, 1.0, 3.0]), 1);
    }

    #[test]
    fn seeded_sampling_repeats_and_respects_top_k() {
        let logits: Vec<f32> = (0..100).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let cfg = SamplerConfig { temp: 1.0, top_k: 5, top_p: 1.0, seed: 7 };
        let run = || {
            let mut s = Sampler::new(cfg.clone());
            (0..50).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        let a = run();
        assert_eq!(a, run());
        let mut top: Vec<u32> = (0..100).collect();
        top.sort_by(|&x, &y| logits[y as usize].total_cmp(&logits[x as usize]));
        assert!(a.iter().all(|t| top[..5].contains(t)), "{a:?}");
        assert!(a.iter().collect::<std::collections::HashSet<_>>().len() > 1);
    }
}
