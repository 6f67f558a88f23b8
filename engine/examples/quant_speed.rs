//! Throughput of `engine::quant::matvec` and `matvec_multi`, in GB/s of weight bytes, per ISA
//! level (`avx2`, `avx512`, as far as the CPU runs them).
//!
//! `cargo run -p engine --release --example quant_speed [MiB] [threads] [type...]`
//! (`QS_COLS=768` for rows of 768 columns instead of 2048)
//!
//! For each type and level: a matrix of about `MiB` MiB (default 256, far larger than the
//! caches: memory-bound, like decode) and one of 256 KiB (cache-resident: the kernel's compute
//! speed), both with 2048 columns; best of several runs, the levels measured alternately. A
//! plain streaming read of the big buffer gives the memory bandwidth for comparison. With
//! `threads > 1` the big matrix's rows are split across that many threads (scoped threads, as a
//! decode loop would) and the aggregate GB/s is reported. `multi x8` is the cache-resident
//! matrix against 8 activations at once (`matvec_multi_on`, prompt processing), in weight
//! GB/s times 8: the rate at which one-token products are done.
//!
//! For `perf stat`/`perf record`: `QS_LOOP=level[,multi]` runs only the cache-resident matrix of
//! the first type named, on that level (`matvec`, or `matvec_multi_on` x8 with `,multi`), for
//! about 3 s, and prints the blocks per second (times the activations, `QS_MULTI`, default 8).

use std::hint::black_box;
use std::time::Instant;

use engine::quant::{self, Backend, GgmlType};

/// Columns of the test matrices: 2048 (Qwen3-30B-A3B's hidden size) unless
/// `QS_COLS` says otherwise (e.g. 768, its expert width, for `ffn_down`).
fn cols() -> usize {
    std::env::var("QS_COLS").ok().and_then(|v| v.parse().ok()).unwrap_or(2048)
}

/// A `rows x cols()` matrix of `ty`: a few quantized random rows, repeated.
fn matrix(ty: GgmlType, rows: usize) -> Vec<u8> {
    let rb = ty.row_bytes(cols()).expect("row size");
    let mut seed = 0x1234_5678_9abc_def0u64 ^ ty as u64;
    let mut uniq = vec![0u8; rb * 16];
    let mut x = vec![0f32; cols()];
    for row in uniq.chunks_exact_mut(rb) {
        for v in x.iter_mut() {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            *v = ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1;
        }
        quant::quantize_row(ty, &x, row).expect("quantize");
    }
    let mut m = Vec::with_capacity(rb * rows);
    while m.len() < rb * rows {
        m.extend_from_slice(&uniq[..(rb * rows - m.len()).min(uniq.len())]);
    }
    m
}

fn best_secs(reps: usize, mut f: impl FnMut()) -> f64 {
    f(); // warm up
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

fn gbps(ty: GgmlType, backend: Backend, w: &[u8], xq: &[u8], reps: usize, inner: usize, threads: usize) -> f64 {
    let rows = w.len() / ty.row_bytes(cols()).expect("row size");
    let mut out = vec![0f32; rows];
    let per = rows.div_ceil(threads);
    let secs = best_secs(reps, || {
        for _ in 0..inner {
            std::thread::scope(|s| {
                for (t, o) in out.chunks_mut(per).enumerate() {
                    let r = t * per..t * per + o.len();
                    let run = move || quant::matvec_on(backend, ty, black_box(w), r, cols(), xq, o).expect("matvec");
                    if threads == 1 {
                        run();
                    } else {
                        s.spawn(run);
                    }
                }
            });
        }
        black_box(&out);
    });
    (w.len() * inner) as f64 / secs / 1e9
}

/// `matvec_multi_on` of the whole matrix against `n` copies of `xq`, in weight GB/s times `n`.
fn multi_gbps(ty: GgmlType, backend: Backend, w: &[u8], xq: &[u8], n: usize) -> f64 {
    let rows = w.len() / ty.row_bytes(cols()).expect("row size");
    let xs: Vec<&[u8]> = vec![xq; n];
    let mut outs = vec![vec![0f32; rows]; n];
    let inner = 5;
    let secs = best_secs(10, || {
        for _ in 0..inner {
            let mut os: Vec<&mut [f32]> = outs.iter_mut().map(Vec::as_mut_slice).collect();
            quant::matvec_multi_on(backend, ty, black_box(w), 0..rows, cols(), &xs, &mut os).expect("matvec_multi");
        }
        black_box(&outs);
    });
    (w.len() * inner * n) as f64 / secs / 1e9
}

/// The `QS_LOOP` mode (module docs).
fn perf_loop(spec: &str, ty_name: &str) {
    let ty = GgmlType::ALL.into_iter().find(|t| t.name() == ty_name).expect("type name, e.g. q4_K");
    let (level, multi) = spec.split_once(',').map_or((spec, false), |(l, m)| (l, m == "multi"));
    let level = Backend::from_name(level).expect("level: scalar, avx2 or avx512");
    let x: Vec<f32> = (0..cols()).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0).collect();
    let mut xq = Vec::new();
    quant::quantize_activation(ty, &x, &mut xq).expect("activation");
    let rb = ty.row_bytes(cols()).expect("row size");
    let w = matrix(ty, (256 << 10) / rb);
    let t = Instant::now();
    let mut bytes = 0usize;
    while t.elapsed().as_secs_f64() < 3.0 {
        if multi {
            let n = std::env::var("QS_MULTI").ok().and_then(|v| v.parse().ok()).unwrap_or(8);
            multi_gbps(ty, level, &w, &xq, n);
            bytes += w.len() * 5 * 11 * n;
        } else {
            gbps(ty, level, &w, &xq, 20, 20, 1);
            bytes += w.len() * 20 * 21;
        }
    }
    let blocks = bytes as f64 / ty.type_size() as f64;
    println!("{ty} {level} multi={multi}: {:.1} M blocks/s", blocks / t.elapsed().as_secs_f64() / 1e6);
}

fn main() {
    let mib: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(256);
    let threads: usize = std::env::args().nth(2).and_then(|s| s.parse().ok()).unwrap_or(1).max(1);
    let only: Vec<String> = std::env::args().skip(3).collect();
    let big = mib << 20;
    if let Ok(spec) = std::env::var("QS_LOOP") {
        return perf_loop(&spec, only.first().map(String::as_str).unwrap_or("q4_K"));
    }

    let buf = vec![1u64; big / 8];
    let secs = best_secs(5, || {
        let s = buf.chunks_exact(8).fold([0u64; 8], |mut acc, c| {
            for (a, v) in acc.iter_mut().zip(c) {
                *a = a.wrapping_add(*v);
            }
            acc
        });
        black_box(s);
    });
    drop(buf);
    let levels: Vec<Backend> = [Backend::Avx2, Backend::Avx512].into_iter().filter(|b| b.is_available()).collect();
    println!("{}", quant::isa_report().expect("ENGINE_ISA"));
    println!("streaming read of {mib} MiB (1 thread): {:.1} GB/s", big as f64 / secs / 1e9);
    println!("big matrix: {mib} MiB on {threads} thread(s); cached: 256 KiB, 1 thread");
    println!(
        "{:<6} {:<7} {:>9} {:>12} {:>12} {:>14} {:>12}",
        "type", "level", "big GB/s", "cached GB/s", "multi x8", "scalar cached", "Mrows/s big"
    );

    let x: Vec<f32> = (0..cols()).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0).collect();
    let mut xq = Vec::new();
    for ty in [GgmlType::Q4_K, GgmlType::Q8_0, GgmlType::F16] {
        let reps = 2000;
        let secs = best_secs(5, || {
            for _ in 0..reps {
                quant::quantize_activation(ty, black_box(&x), &mut xq).expect("activation");
            }
        });
        println!(
            "quantize_activation for {} weights ({}): {:.2} us per {} floats",
            ty.name(),
            ty.vec_dot_type().name(),
            secs / reps as f64 * 1e6,
            cols()
        );
    }
    for ty in [
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q8_0,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::F32,
        GgmlType::Q4_0,
    ] {
        if !only.is_empty() && !only.iter().any(|o| o == ty.name()) {
            continue;
        }
        quant::quantize_activation(ty, &x, &mut xq).expect("activation");
        let rb = ty.row_bytes(cols()).expect("row size");
        let w_big = matrix(ty, big / rb);
        let w_small = matrix(ty, (256 << 10) / rb);
        // The machine's memory bandwidth is shared and noisy: alternate the levels'
        // big-matrix measurements and keep the best of each.
        let mut big_gbps = vec![0f64; levels.len()];
        for _ in 0..5 {
            for (l, &level) in levels.iter().enumerate() {
                big_gbps[l] = big_gbps[l].max(gbps(ty, level, &w_big, &xq, 1, 1, threads));
            }
        }
        let s = gbps(ty, Backend::Scalar, &w_small, &xq, 3, 4, 1);
        for (l, &level) in levels.iter().enumerate() {
            let c = gbps(ty, level, &w_small, &xq, 20, 20, 1);
            let m = multi_gbps(ty, level, &w_small, &xq, 8);
            println!(
                "{:<6} {:<7} {:>9.1} {:>12.1} {:>12.1} {:>14.1} {:>12.2}",
                ty.name(),
                level.name(),
                big_gbps[l],
                c,
                m,
                s,
                big_gbps[l] * 1e9 / rb as f64 / 1e6
            );
        }
    }
}
