//! The expert cache's per-step telemetry against independent counts on the same steps: the
//! kernel's `read_bytes` of this process (`/proc/self/io`, which counts O_DIRECT reads at bio
//! submission), the experts the router chose (the session's selection counts) and the bytes of
//! the experts that missed. One test in its own binary, so that no other test's reads land in
//! `/proc/self/io`.

mod common;

use std::time::Duration;

use common::*;
use engine::cache::{CacheConfig, ExpertCache};
use engine::markers::{KIND_GENERATE, KIND_PROMPT};
use engine::model::{Model, Session};
use engine::placement::DensePolicy;
use engine::synth::{QuantMix, SynthConfig};
use engine::telemetry::{Meter, MetricsHeader, MetricsWriter};

fn proc_read_bytes() -> u64 {
    let s = std::fs::read_to_string("/proc/self/io").expect("/proc/self/io (CONFIG_TASK_IO_ACCOUNTING)");
    s.lines().find_map(|l| l.strip_prefix("read_bytes: ")).unwrap().trim().parse().unwrap()
}

#[test]
fn cache_columns_match_the_kernel_and_the_routing() {
    let mut c = SynthConfig::preset("small").unwrap();
    c.layers = 3;
    c.vocab = 4096;
    c.quant = QuantMix::Q4KM;
    let path = cached_model("cache-q4km", &c);
    let m = Model::load_with(&path, DensePolicy::Anon).unwrap();
    let probe = ExpertCache::new(&m, CacheConfig { bytes: 1 << 40, io_threads: 1, lock: false, prefetch: false });
    let slot = probe.unwrap().slot_bytes() as u64;
    // A third of one layer's experts: most experts miss.
    let cache = ExpertCache::new(
        &m,
        CacheConfig { bytes: slot * m.cfg.n_expert as u64 / 3, io_threads: 3, lock: false, prefetch: false },
    )
    .unwrap();
    let mut sess = Session::new(&m, 2, 64).with_experts(&cache);
    let csv = scratch("cache-io.csv");
    let n = 24u64;
    let header = MetricsHeader::for_run(&m, Some(&cache), 2, 64, &[]);
    let out = engine::output::Output::create(&csv, engine::output::Policy { force: true, inputs: &[] }).unwrap();
    let writer = MetricsWriter::create(Some(out), None, &header, n).unwrap();
    let mut meter = Meter::new(&m, Duration::from_millis(100), Some(writer)).with_cache(Some(&cache));
    let prompt: Vec<u32> = (0..8).map(|i| i * 11 + 3).collect();
    let (mut tok, _) = meter
        .step(KIND_PROMPT, 0, 8, || -> Result<u32, engine::model::ModelError> {
            Ok(engine::sampling::argmax(sess.step(&prompt)?))
        })
        .unwrap();

    // The expert bytes of one expert (three parts) and its windows' bound.
    let ranges = cache.expert_file_ranges(0, 0).unwrap();
    let expert_bytes: u64 = ranges.iter().map(|(s, e)| e - s).sum();
    let k0 = proc_read_bytes();
    let mut used_per_step = Vec::new();
    let mut stats = Vec::new();
    for i in 1..=n {
        let before: u64 = sess.expert_counts.iter().flatten().sum();
        let s0 = cache.stats();
        let (t, sample) = meter
            .step(KIND_GENERATE, i, 1, || -> Result<u32, engine::model::ModelError> {
                Ok(engine::sampling::argmax(sess.step(&[tok])?))
            })
            .unwrap();
        tok = t;
        let d = cache.stats().since(&s0);
        used_per_step.push(sess.expert_counts.iter().flatten().sum::<u64>() - before);
        assert_eq!(sample.rec.read_bytes, d.read_bytes, "step {i}: the record's read_bytes");
        stats.push(d);
    }
    let k1 = proc_read_bytes();
    meter.finish().unwrap();

    let b = read_bmoe(&csv);
    assert_eq!(b.rows.len() as u64, n);
    assert_eq!(b.config("experts"), Some("cache"));
    assert_eq!(b.config("moe_stream"), Some("1"));
    assert_eq!(b.config("o_direct"), Some("1"));
    let (rb, hit, wall, stall, mgmt, compute, io, budget) = (
        b.col("read_bytes"),
        b.col("cache_hit_pct"),
        b.col("wall_ms"),
        b.col("stall_ms"),
        b.col("mgmt_ms"),
        b.col("compute_ms"),
        b.col("io_ms"),
        b.col("cache_budget_mib"),
    );
    let k = m.cfg.n_expert_used as u64 * m.cfg.n_layer as u64;
    let mut total = 0u64;
    for (i, d) in stats.iter().enumerate() {
        // Hits + misses = the experts the router chose this step (one token: k per layer).
        assert_eq!(d.hits + d.misses, used_per_step[i], "step {}: hits + misses vs the routing", i + 1);
        assert_eq!(used_per_step[i], k);
        assert_eq!(rb[i] as u64, d.read_bytes, "step {}: read_bytes column", i + 1);
        let pct = d.hits as f64 * 100.0 / (d.hits + d.misses) as f64;
        assert!((hit[i] - pct).abs() < 0.006, "step {}: cache_hit_pct {} vs {pct}", i + 1, hit[i]);
        // Without prefetch every miss is read once, as its three aligned windows.
        let lo = d.misses * expert_bytes;
        let hi = d.misses * (expert_bytes + 6 * engine::cache::io::ALIGN as u64);
        assert!(
            (lo..=hi).contains(&d.read_bytes),
            "step {}: {} bytes read for {} misses",
            i + 1,
            d.read_bytes,
            d.misses
        );
        assert!(stall[i] <= wall[i] + 0.001 && (compute[i] - (wall[i] - stall[i] - mgmt[i])).abs() < 0.003);
        assert!(d.read_bytes == 0 || io[i] > 0.0, "step {}: bytes read in no time", i + 1);
        assert!((budget[i] - cache.bytes() as f64 / 1048576.0).abs() < 0.06);
        total += d.read_bytes;
    }
    assert!(total > 16 << 20, "the test needs misses: {total} bytes read");
    // The kernel counted the same reads (plus, at most, a read-ahead window of a page fault of
    // this process's own text, should one have been evicted meanwhile).
    let kernel = k1 - k0;
    assert!(
        kernel >= total && kernel <= total + (8 << 20),
        "/proc/self/io read_bytes grew by {kernel}, the cache's columns sum to {total}"
    );
}
