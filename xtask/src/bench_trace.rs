//! `cargo xtask bench trace`: bytes per token record in a trace, with the
//! expert grid packed (`observer/src/trace/grid.rs`) against the same records
//! as plain JSON (how traces stored them before).
//!
//! For each grid shape (MoE layers × experts; default 12 × 128, 40 × 256 and
//! 64 × 512, the largest the format's note names), a synthetic model of that
//! shape (small matrices, cached) is decoded by the engine under `observer
//! record --json` while another thread evicts the model file from the page
//! cache every 300 ms (so that the grid keeps changing, as under memory
//! pressure). The same run gives both numbers: the trace's token records as
//! written, and the same records as plain JSON, serialised from the run's
//! `--json` output (which holds them with plain grid arrays). Printed per
//! shape: tokens, tokens with a grid (the last record of each batch read from
//! the kernel carries a residency sample), bytes per token record with a grid
//! before and after, their ratio, and the largest packed record (a key frame).

use std::{
    path::Path,
    process::Command,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::{bench_util, llama};

/// Token records of a trace file: (payload bytes, the payload's JSON).
fn token_records(trace: &Path) -> Result<Vec<(usize, Value)>> {
    let b = std::fs::read(trace).with_context(|| format!("reading {}", trace.display()))?;
    if !b.starts_with(b"MOETRACE") || b.len() < 16 {
        bail!("{} is not a trace", trace.display());
    }
    let mut at = 16;
    let mut out = Vec::new();
    while at + 20 <= b.len() {
        let len = u32::from_le_bytes(b[at + 8..at + 12].try_into()?) as usize;
        let payload = b.get(at + 20..at + 20 + len).context("a truncated record")?;
        if b[at + 4] == 2 {
            out.push((len, serde_json::from_slice(payload).context("a token record's JSON")?));
        }
        at += 20 + len;
    }
    Ok(out)
}

struct Shape {
    layers: usize,
    experts: usize,
}

fn model(engine: &Path, s: &Shape) -> Result<std::path::PathBuf> {
    let (l, e) = (s.layers.to_string(), s.experts.to_string());
    llama::synth_model(
        engine,
        &format!("bench-trace-{}x{}", s.layers, s.experts),
        &[
            "--quant",
            "q8_0",
            "--layers",
            &l,
            "--hidden",
            "64",
            "--heads",
            "2",
            "--kv-heads",
            "1",
            "--head-dim",
            "32",
            "--experts",
            &e,
            "--experts-used",
            "8",
            "--expert-ffn",
            "32",
            "--vocab",
            "1024",
        ],
    )
}

pub fn main(args: &[String]) -> Result<()> {
    let mut n = 200usize;
    let mut shapes = vec![
        Shape { layers: 12, experts: 128 },
        Shape { layers: 40, experts: 256 },
        Shape { layers: 64, experts: 512 },
    ];
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = |name: &str| it.next().with_context(|| format!("{name} needs a value")).cloned();
        match a.as_str() {
            "-n" => n = val("-n")?.parse()?,
            "--shapes" => {
                shapes = val("--shapes")?
                    .split(',')
                    .map(|s| {
                        let (l, e) = s.split_once('x').with_context(|| format!("{s:?}: use LAYERSxEXPERTS"))?;
                        Ok(Shape { layers: l.parse()?, experts: e.parse()? })
                    })
                    .collect::<Result<_>>()?
            }
            _ => bail!("usage: cargo xtask bench trace [-n TOKENS] [--shapes 12x128,40x256,64x512]"),
        }
    }
    let bin = bench_util::build()?;
    let (engine, observer) = (bin.join("engine"), bin.join("observer"));
    let dir = crate::cache::target_dir().join("bench-trace");
    std::fs::create_dir_all(&dir)?;
    println!(
        "{:>9} {:>7} {:>10} {:>14} {:>14} {:>7} {:>14}",
        "grid", "tokens", "with grid", "plain B/token", "packed B/token", "ratio", "max packed B"
    );
    for s in &shapes {
        let m = model(&engine, s)?;
        let (trace, json) = (dir.join("run.trace"), dir.join("run.json"));
        let stop = Arc::new(AtomicBool::new(false));
        let churner = {
            let (stop, m) = (Arc::clone(&stop), m.clone());
            std::thread::spawn(move || {
                use std::os::fd::AsRawFd;
                while !stop.load(Ordering::Relaxed) {
                    if let Ok(f) = std::fs::File::open(&m) {
                        // SAFETY: a valid fd.
                        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
                    }
                    std::thread::sleep(Duration::from_millis(300));
                }
            })
        };
        let r = crate::cmd::output(
            Command::new(&observer)
                .args(["record", "-o"])
                .arg(&trace)
                .arg("--json")
                .arg(&json)
                .args(["--every", "0", "--residency-interval", "50ms", "--poll", "5ms", "--"])
                .arg(&engine)
                .args(["run", "-m"])
                .arg(&m)
                .args(["-p", "The observer measures where the time of a token goes", "-n", &n.to_string()])
                .args(["-t", "1", "--ignore-eos"]),
        );
        stop.store(true, Ordering::Relaxed);
        let _ = churner.join();
        r?;
        let written = token_records(&trace)?;
        let summary: Value = serde_json::from_str(&std::fs::read_to_string(&json)?)?;
        let plain = summary["tokens"].as_array().context("no tokens in the run's JSON")?;
        if plain.len() != written.len() {
            bail!("{} token records in the trace, {} in the JSON", written.len(), plain.len());
        }
        let (mut before, mut after, mut k, mut max) = (0usize, 0usize, 0usize, 0usize);
        for ((size, w), p) in written.iter().zip(plain) {
            if w["seq"] != p["seq"] {
                bail!("records out of step: {} vs {}", w["seq"], p["seq"]);
            }
            if !p["residency"]["grid"].is_object() {
                continue;
            }
            // The event as the recorder wrote it before: `{"type":"token",…}` with plain arrays.
            before += serde_json::to_vec(p)?.len() + r#""type":"token","#.len();
            after += size;
            max = max.max(*size);
            k += 1;
        }
        if k == 0 {
            bail!("no token record carried a grid");
        }
        println!(
            "{:>9} {:>7} {:>10} {:>14} {:>14} {:>6.3}x {:>14}",
            format!("{}x{}", s.layers, s.experts),
            written.len(),
            k,
            before / k,
            after / k,
            after as f64 / before as f64,
            max
        );
    }
    Ok(())
}
