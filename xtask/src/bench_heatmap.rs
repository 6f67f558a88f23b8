//! `cargo xtask bench heatmap`: the cost of one residency refresh of a 20 GB model, against
//! `fincore` (util-linux, `mincore` over the file) on the same file in the same run.
//!
//! The model is a *sparse* GGUF with Qwen3-30B-A3B's 48-layer tensor table (written by
//! `resid_standin sparse-model`): the header is real, the tensor data a hole. That is fine for
//! the scan cost, which depends on the page cache (lookups per page or per cached folio), not on
//! whether the file's blocks exist on disk; reading a hole puts real pages of zeros in the page
//! cache. Three states of the page cache are measured:
//! - `cold`: nothing of the file cached;
//! - `extents`: 2 GiB cached in 16 extents spread over the file, read as the kernel reads a
//!   file sequentially (large folios);
//! - `extents-4k`: the same extents read 4 KiB at a time without read-ahead (order-0 folios,
//!   the most work for `cachestat`);
//! - `sparse`: one page cached in every 16 MiB (every chunk is partly cached);
//! - `scattered`: one page in every 256 KiB (every `mincore` leaf is partly cached: the scan
//!   degenerates to `mincore` over the whole file, like `fincore`).
//!
//! For each state: `observer heatmap --json --watch` refreshes (each reports its own `scan_ns`),
//! `fincore` runs (wall clock), the one-shot `observer heatmap` process (open, parse, map, scan,
//! print), and the resident bytes both report (must agree within 1 %). The page cache of the
//! file is dropped again at the end. Takes the tests' machine lock.

use std::{
    fs::File,
    os::{fd::AsRawFd, unix::fs::FileExt},
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::{
    bench_util::median,
    cache::dir as cache_root,
    cmd::{output, run},
};

fn fadvise(f: &File, off: u64, len: u64, advice: i32) -> Result<()> {
    // SAFETY: plain advice on our own descriptor.
    let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), off as i64, len as i64, advice) };
    if rc != 0 {
        bail!("posix_fadvise failed: {}", std::io::Error::from_raw_os_error(rc));
    }
    Ok(())
}

fn lock() -> Result<File> {
    let f = File::create("/tmp/moe-observer-tests.lock").context("creating /tmp/moe-observer-tests.lock")?;
    // SAFETY: valid fd; blocking exclusive lock held until the file is closed.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
        bail!("flock /tmp/moe-observer-tests.lock: {}", std::io::Error::last_os_error());
    }
    Ok(f)
}

/// (wall s, CPU s, resident bytes) of one fincore run.
fn fincore(model: &Path) -> Result<(f64, f64, u64)> {
    let (t, c) = (Instant::now(), crate::cmd::children_cpu());
    let out = output(Command::new("fincore").args(["--bytes", "--noheadings", "--output", "RES"]).arg(model))?;
    Ok((t.elapsed().as_secs_f64(), crate::cmd::children_cpu() - c, out.trim().parse().context("fincore output")?))
}

pub fn main(args: &[String]) -> Result<()> {
    let (mut rounds, mut layers) = (7usize, 48usize);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = |name: &str| it.next().with_context(|| format!("{name} needs a value")).cloned();
        match a.as_str() {
            "--rounds" => rounds = val("--rounds")?.parse()?,
            "--layers" => layers = val("--layers")?.parse()?,
            _ => bail!("usage: cargo xtask bench heatmap [--rounds N] [--layers L]"),
        }
    }
    if !crate::cmd::on_path("fincore") {
        bail!("fincore (util-linux) is not installed: `apt-get install util-linux`");
    }
    let root = crate::cache::workspace_root();
    run(Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())).current_dir(&root).args([
        "build",
        "--quiet",
        "--release",
        "--package",
        "observer",
        "--package",
        "fixtures",
        "--bins",
    ]))?;
    let target = std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from);
    let observer = target.join("release/observer");
    let standin = target.join("release/resid_standin");

    let dir = cache_root()?.join("bench");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let model = dir.join(format!("heatmap-qwen3-30b-a3b-{layers}l-sparse.gguf"));
    if !model.is_file() {
        let tmp = model.with_extension("gguf.tmp");
        run(Command::new(&standin).arg("sparse-model").arg("--out").arg(&tmp).args(["--layers", &layers.to_string()]))?;
        std::fs::rename(&tmp, &model).with_context(|| format!("renaming {}", tmp.display()))?;
    }
    let size = std::fs::metadata(&model)?.len();
    let page = 4096u64;
    let chunk = 16u64 << 20;
    let _lock = lock()?;
    let f = File::open(&model).with_context(|| format!("opening {}", model.display()))?;
    // Leave the page cache as it was, also when a step fails.
    struct Evict<'a>(&'a File);
    impl Drop for Evict<'_> {
        fn drop(&mut self) {
            let _ = fadvise(self.0, 0, 0, libc::POSIX_FADV_DONTNEED);
        }
    }
    let _evict = Evict(&f);
    println!(
        "model: {} ({:.1} GB sparse, {} pages), {rounds} refreshes / fincore runs per state",
        model.display(),
        size as f64 / 1e9,
        size.div_ceil(page)
    );
    println!(
        "{:<10} {:>11} {:>11} {:>10} {:>10} {:>11} {:>9} {:>12} {:>12} {:>8} {:>10}",
        "state",
        "refresh ms",
        "fincore ms",
        "ratio",
        "cpu ms",
        "fincore cpu",
        "ratio",
        "one-shot ms",
        "resident MiB",
        "mincore%",
        "vs fincore"
    );
    let mut buf = vec![0u8; 1 << 20];
    // Reads of holes: the pages become real page-cache pages of zeros.
    for state in ["cold", "extents", "extents-4k", "sparse", "scattered"] {
        fadvise(&f, 0, 0, libc::POSIX_FADV_DONTNEED)?;
        let every = |step: u64| -> Result<()> {
            let mut off = step / 2;
            while off < size {
                f.read_at(&mut [0u8; 1], off)?;
                off += step;
            }
            Ok(())
        };
        match state {
            "extents" | "extents-4k" => {
                let (advice, block) = if state == "extents" {
                    (libc::POSIX_FADV_NORMAL, 1 << 20)
                } else {
                    (libc::POSIX_FADV_RANDOM, page as usize)
                };
                fadvise(&f, 0, 0, advice)?;
                let ext = 128u64 << 20;
                for k in 0..16u64 {
                    let start = (size / 16 * k) / page * page;
                    let mut off = start;
                    while off < (start + ext).min(size) {
                        let n = f.read_at(&mut buf[..block], off)?;
                        if n == 0 {
                            break;
                        }
                        off += n as u64;
                    }
                }
            }
            "sparse" => {
                fadvise(&f, 0, 0, libc::POSIX_FADV_RANDOM)?;
                every(chunk)?;
            }
            "scattered" => {
                fadvise(&f, 0, 0, libc::POSIX_FADV_RANDOM)?;
                every(256 << 10)?;
            }
            _ => {}
        }
        let out = output(Command::new(&observer).arg("heatmap").arg(&model).args([
            "--json",
            "--watch",
            "--count",
            &rounds.to_string(),
            "--interval",
            "20ms",
        ]))?;
        let lines: Vec<Value> =
            out.lines().map(serde_json::from_str).collect::<Result<_, _>>().context("heatmap JSON")?;
        let mut scans: Vec<f64> = lines.iter().filter_map(|j| j["scan_ns"].as_f64()).map(|n| n / 1e6).collect();
        let mut cpus: Vec<f64> = lines.iter().filter_map(|j| j["scan_cpu_ns"].as_f64()).map(|n| n / 1e6).collect();
        let last = lines.last().context("no heatmap output")?;
        let mincore = last["mincore_pages"].as_f64().unwrap_or(0.0) / last["file_pages"].as_f64().unwrap_or(1.0);
        // fincore and a one-shot observer back to back, so that both see the same page cache
        // (other work on a shared machine evicts pages between runs).
        let (mut fin, mut fin_cpu, mut one, mut diffs) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut ours, mut fin_res) = (0u64, 0u64);
        for _ in 0..rounds {
            let (t, c, r) = fincore(&model)?;
            fin.push(t * 1e3);
            fin_cpu.push(c * 1e3);
            let t = Instant::now();
            let j: Value =
                serde_json::from_str(&output(Command::new(&observer).arg("heatmap").arg(&model).arg("--json"))?)?;
            one.push(t.elapsed().as_secs_f64() * 1e3);
            (ours, fin_res) = (j["file_resident_bytes"].as_u64().unwrap_or(0), r);
            diffs.push(if ours == fin_res { 0.0 } else { ours.abs_diff(fin_res) as f64 / fin_res.max(1) as f64 });
        }
        let diff = median(&mut diffs);
        let (s, fm, o) = (median(&mut scans), median(&mut fin), median(&mut one));
        let (sc, fc) = (median(&mut cpus), median(&mut fin_cpu));
        println!(
            "{state:<10} {s:>11.2} {fm:>11.2} {:>9.3}x {sc:>10.2} {fc:>11.2} {:>8.3}x {o:>12.2} {:>12.1} {:>7.1}% {:>9.3}%",
            s / fm,
            sc / fc,
            ours as f64 / 1048576.0,
            100.0 * mincore,
            100.0 * diff
        );
        if diff > 0.01 {
            bail!(
                "{state}: observer and fincore disagree by {:.2} % (median of back-to-back pairs; last {ours} vs {fin_res} bytes)",
                100.0 * diff
            );
        }
    }
    println!(
        "refresh = median wall time of one scan of `observer heatmap --watch` (its own scan_ns; the file is mapped once),\n\
         cpu = that scan's CPU time; fincore = a whole fincore process (mincore over the file), wall and CPU (user+sys);\n\
         one-shot = a whole `observer heatmap --json` process (parse, map, scan, print); mincore% = share of the file's\n\
         pages the scan asked mincore about (the other chunks were settled by cachestat); vs fincore = median difference\n\
         of resident bytes between back-to-back fincore / one-shot observer pairs."
    );
    Ok(())
}
