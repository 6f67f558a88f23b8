//! `resid_standin`: a small stand-in for an MoE engine, for the residency tests. It reads a
//! GGUF's region map with the engine's reader and either
//! - `cycle`: touches (one byte per page, through a shared read-only mapping, as an mmap engine
//!   does) every expert of a chosen set in every MoE layer, round after round; or
//! - `dense-anon`: copies the dense weights into anonymous memory, publishes the copy through the
//!   dense-regions ABI (`observer::residency::anon`), optionally pushes every Nth page of it out
//!   with `MADV_PAGEOUT`, prints where the copy is, and waits for stdin to close;
//! - `sparse-model`: writes a GGUF of a synthetic preset's shapes whose tensor data is a hole
//!   (header and tensor table only, then `set_len`): a file of any size in no time, for
//!   `cargo xtask bench heatmap`.
//!
//! Output: one JSON object on stdout per command (what it did, measured by itself).

use std::{io::Read, path::PathBuf, ptr::read_volatile};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use engine::{
    gguf::Gguf,
    regions::{RegionKind, RegionMap},
};
use observer::residency::anon::{DenseRange, DenseRegionsV1};

/// The dense-regions ABI symbol (see `observer::residency::anon`).
#[unsafe(no_mangle)]
pub static moe_engine_dense_regions: DenseRegionsV1 = DenseRegionsV1::new();

#[derive(Debug, Parser)]
#[command(name = "resid_standin", about = "Stand-in engine for the residency tests")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Touch experts FIRST..LAST (inclusive) of every MoE layer, ROUNDS times.
    Cycle {
        #[arg(long)]
        model: PathBuf,
        #[arg(long, default_value_t = 0)]
        first: u32,
        #[arg(long)]
        last: u32,
        #[arg(long, default_value_t = 1)]
        rounds: u32,
    },
    /// Write a sparse GGUF: a real header and tensor table, the data a hole.
    SparseModel {
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value = "qwen3-30b-a3b")]
        preset: String,
        #[arg(long)]
        layers: Option<usize>,
    },
    /// Copy the dense weights to anonymous memory and publish them.
    DenseAnon {
        #[arg(long)]
        model: PathBuf,
        /// MADV_PAGEOUT every Nth page of the copy (0: none).
        #[arg(long, default_value_t = 0)]
        pageout_every: u64,
    },
}

fn page() -> usize {
    // SAFETY: no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 { p as usize } else { 4096 }
}

fn open(model: &PathBuf) -> Result<(Gguf, RegionMap)> {
    let g = Gguf::open(model).with_context(|| format!("opening {}", model.display()))?;
    let m = RegionMap::from_gguf(&g).with_context(|| format!("region map of {}", model.display()))?;
    Ok((g, m))
}

fn cycle(model: &PathBuf, first: u32, last: u32, rounds: u32) -> Result<String> {
    let (g, m) = open(model)?;
    if last >= m.n_experts {
        bail!("--last {last}: the model has {} experts", m.n_experts);
    }
    let bytes = g.bytes();
    let p = page();
    let mut touched = 0u64;
    let mut sum = 0u64;
    for _ in 0..rounds {
        for &layer in &m.moe_layers {
            for e in first..=last {
                for r in m.expert_ranges(layer, e) {
                    let mut off = r.start as usize;
                    while off < r.end as usize {
                        // SAFETY: in bounds of the mapping (ranges validated by the reader).
                        sum = sum.wrapping_add(unsafe { read_volatile(bytes.as_ptr().add(off)) } as u64);
                        touched += 1;
                        off = (off / p + 1) * p;
                    }
                }
            }
        }
    }
    Ok(format!(
        r#"{{"kind":"cycle","rounds":{rounds},"first":{first},"last":{last},"page_touches":{touched},"checksum":{sum}}}"#
    ))
}

fn dense_anon(model: &PathBuf, pageout_every: u64) -> Result<String> {
    let (g, m) = open(model)?;
    let dense: Vec<_> = m.regions.iter().filter(|r| !matches!(r.kind, RegionKind::Expert { .. })).collect();
    let p = page();
    let total: usize = dense.iter().map(|r| (r.len() as usize).div_ceil(p) * p).sum();
    if total == 0 {
        bail!("{}: no dense weights", model.display());
    }
    // A PROT_NONE guard page on each side keeps the copy one VMA of its own (anonymous
    // neighbours with the same flags would merge with it and blur /proc/PID/smaps).
    // SAFETY: fresh private anonymous mapping.
    let outer = unsafe {
        libc::mmap(std::ptr::null_mut(), total + 2 * p, libc::PROT_NONE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
    };
    if outer == libc::MAP_FAILED {
        bail!("mmap of {total} anonymous bytes: {}", std::io::Error::last_os_error());
    }
    // SAFETY: the inner part of our own mapping.
    let base = unsafe { (outer as *mut u8).add(p) };
    // SAFETY: as above.
    if unsafe { libc::mprotect(base.cast(), total, libc::PROT_READ | libc::PROT_WRITE) } != 0 {
        bail!("mprotect: {}", std::io::Error::last_os_error());
    }
    let mut table = Vec::with_capacity(dense.len());
    let mut at = 0usize;
    for r in &dense {
        let src = &g.bytes()[r.range.start as usize..r.range.end as usize];
        // SAFETY: `at + len` stays inside the mapping (sized for page-rounded regions).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), base.add(at), src.len()) };
        // Make every page of the copy hold data (not the shared zero page), also the padding.
        // SAFETY: as above.
        unsafe { *base.add(at + (r.len() as usize).div_ceil(p) * p - 1) |= 1 };
        table.push(DenseRange { addr: base as u64 + at as u64, len: r.len(), file_offset: r.range.start });
        at += (r.len() as usize).div_ceil(p) * p;
    }
    moe_engine_dense_regions.publish(Vec::leak(table));
    let pages = (total / p) as u64;
    let mut paged_out = 0u64;
    if pageout_every > 0 {
        for i in (0..pages).step_by(pageout_every as usize) {
            // SAFETY: one page inside our own mapping.
            let rc = unsafe { libc::madvise(base.add(i as usize * p).cast(), p, libc::MADV_PAGEOUT) };
            if rc != 0 {
                bail!("MADV_PAGEOUT: {}", std::io::Error::last_os_error());
            }
            paged_out += 1;
        }
    }
    Ok(format!(
        r#"{{"kind":"dense-anon","addr":{},"len":{total},"pages":{pages},"pageout_requests":{paged_out}}}"#,
        base as u64
    ))
}

fn sparse_model(out: &PathBuf, preset: &str, layers: Option<usize>) -> Result<String> {
    use engine::gguf::{Value, encode_header};
    let mut c = engine::synth::SynthConfig::preset(preset).with_context(|| format!("unknown preset {preset}"))?;
    if let Some(l) = layers {
        c.layers = l;
    }
    let specs = engine::synth::tensor_specs(&c);
    let a = "qwen3moe";
    let meta = vec![
        ("general.architecture".to_owned(), Value::String(a.into())),
        ("general.alignment".to_owned(), Value::U32(32)),
        (format!("{a}.block_count"), Value::U32(c.layers as u32)),
        (format!("{a}.expert_count"), Value::U32(c.experts as u32)),
    ];
    let header = encode_header(&meta, &specs, 32);
    let data = (header.len() as u64).next_multiple_of(32);
    let mut end = data;
    for s in &specs {
        end = end.next_multiple_of(32) + s.size().context("tensor size")?;
    }
    let f = std::fs::File::create(out).with_context(|| format!("creating {}", out.display()))?;
    use std::io::Write;
    (&f).write_all(&header).with_context(|| format!("writing {}", out.display()))?;
    f.set_len(end).with_context(|| format!("extending {}", out.display()))?;
    f.sync_all()?;
    drop(f);
    let (_, m) = open(out)?;
    Ok(format!(
        r#"{{"kind":"sparse-model","size_bytes":{end},"tensors":{},"n_layers":{},"n_experts":{}}}"#,
        specs.len(),
        m.moe_layers.len(),
        m.n_experts
    ))
}

fn main() {
    let cli = Cli::parse();
    let wait = matches!(cli.cmd, Cmd::DenseAnon { .. });
    let r = match cli.cmd {
        Cmd::Cycle { model, first, last, rounds } => cycle(&model, first, last, rounds),
        Cmd::DenseAnon { model, pageout_every } => dense_anon(&model, pageout_every),
        Cmd::SparseModel { out, preset, layers } => sparse_model(&out, &preset, layers),
    };
    match r {
        Ok(line) => {
            println!("{line}");
            if wait {
                // Stay alive (with the copy published) until the test closes our stdin.
                let _ = std::io::stdin().read_to_end(&mut Vec::new());
            }
        }
        Err(e) => {
            eprintln!("resid_standin: error: {e:#}");
            std::process::exit(1);
        }
    }
}
