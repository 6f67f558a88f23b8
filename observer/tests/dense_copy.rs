//! The engine's anonymous dense copy under `observer run`, end to end: the engine publishes
//! where the copy is (`moe_engine_dense_regions`), the observer measures it from
//! `/proc/PID/pagemap`, and the token records' `residency` says how much of it is in RAM and
//! how much in zram.
//!
//! Pressure runs use testkit's guards (zram swap, a memory cgroup limit below the model plus
//! a balloon in the same cgroup; only the engine joins it, through `observer run --cgroup`) and
//! restore the machine on drop.
//!
//! The independent source for `dense_swapped_frac` is the kernel's `/proc/PID/smaps` entry of
//! the copy's mapping, read by this test every few milliseconds while the engine runs: its
//! address and page count come from the engine's own log line (not from the symbol the
//! observer reads), and `Swap`/`Rss` are the kernel's page-table walk for that VMA. The
//! observer samples at token batches, a few milliseconds after a token's end, so each record is
//! compared with the smaps samples taken in a window after its token ended.

mod common;

use std::{
    io::{BufRead, BufReader, Read},
    os::unix::fs::FileExt,
    path::Path,
    process::{Command, Stdio},
    time::Duration,
};

use common::*;
use observer::capture::residency::anon::{DenseCopy, DenseRange};
use serde_json::Value;

const PAGE: u64 = 4096;
/// Memory for the engine beyond its dense weights (as in the engine's and trace's pressure
/// tests): with the balloon, the cgroup's limit is far below model + balloon.
const HEADROOM_MIB: u64 = 41;
const BALLOON_MIB: u64 = 64;
/// How long after a token's end the observer's sample of it may be taken (it polls every
/// 10 ms here; slack for a busy machine).
const WINDOW_NS: u64 = 250_000_000;
/// How old a residency sample the observer may reuse for a token (the test's
/// `--residency-interval`).
const REUSE_NS: u64 = 1_000_000;
/// |observer − smaps| allowed for a fraction of the copy's pages (1 % of ~11 500 pages).
const TOL: f64 = 0.01;

fn dense_mib(model: &Path) -> u64 {
    let g = engine::gguf::Gguf::open(model).unwrap();
    g.tensors.iter().filter(|t| !t.is_routed_expert()).map(|t| t.size).sum::<u64>() >> 20
}

fn pressure(name: &str, model: &Path) -> testkit::Pressure {
    testkit::Pressure::new(&testkit::PressureConfig {
        name: name.into(),
        limit_bytes: (dense_mib(model) + HEADROOM_MIB) << 20,
        zram_mib: Some(512),
        balloon_mib: BALLOON_MIB,
        balloon_touch: Duration::from_millis(100),
    })
    .expect("pressure setup (root, zram, a memory cgroup controller, v1 or v2)")
}

/// The one child process of `ppid` (the engine the observer spawned).
fn child_of(ppid: u32) -> Option<u32> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let ppid_field: u32 = stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse().ok()?;
        (ppid_field == ppid).then_some(pid)
    })
}

fn mono_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// `Rss`, `Swap`, `Locked` (pages) of the VMA of `pid` that starts at `addr`; `None` when the
/// process or the VMA is gone.
fn smaps_vma(pid: u32, addr: u64) -> Option<(u64, u64, u64)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/smaps")).ok()?;
    let (mut found, mut rss, mut swap, mut locked) = (false, None, None, None);
    for line in s.lines() {
        if let Some((range, _)) = line.split_once(' ')
            && let Some((a, _)) = range.split_once('-')
            && !a.is_empty()
            && a.chars().all(|c| c.is_ascii_hexdigit())
        {
            if found {
                break;
            }
            found = u64::from_str_radix(a, 16).ok() == Some(addr);
            continue;
        }
        if found {
            let pages = || Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024 / PAGE);
            match line.split(':').next() {
                Some("Rss") => rss = pages(),
                Some("Swap") => swap = pages(),
                Some("Locked") => locked = pages(),
                _ => {}
            }
        }
    }
    Some((rss?, swap?, locked?))
}

/// The copy as the engine logs it: `engine: dense copy at 0xSTART-0xEND (N pages, …)`.
#[derive(Debug, Clone, Copy)]
struct CopyLine {
    start: u64,
    end: u64,
    pages: u64,
}

fn parse_copy_line(line: &str) -> Option<CopyLine> {
    let rest = line.strip_prefix("engine: dense copy at 0x")?;
    let (start, rest) = rest.split_once("-0x")?;
    let (end, rest) = rest.split_once(" (")?;
    let pages = rest.split_whitespace().next()?.parse().ok()?;
    Some(CopyLine { start: u64::from_str_radix(start, 16).ok()?, end: u64::from_str_radix(end, 16).ok()?, pages })
}

struct SmapsSample {
    t_ns: u64,
    rss: u64,
    swap: u64,
    locked: u64,
}

struct Observed {
    tokens: Vec<Value>,
    copy: Option<CopyLine>,
    /// The symbol as the observer's reader saw it just after the engine loaded the model.
    at_load: Option<Vec<DenseRange>>,
    /// First and last 64 bytes of each published range equal the file's at its offset.
    contents_match: bool,
    smaps: Vec<SmapsSample>,
    /// (begin, end) of each page-cache drop of the model file (`evict`).
    drops: Vec<(u64, u64)>,
    stderr: String,
}

/// `observer run --json F [--cgroup DIR] -- engine run -m MODEL … --dense DENSE`, with the
/// symbol read right after the engine loaded the model and the copy's smaps sampled throughout.
/// With `evict`, the model's page-cache pages that no process maps are dropped every 100 ms
/// while the engine runs (`POSIX_FADV_DONTNEED`; the times are in `Observed::drops`), so that
/// the file does not simply stay wholly resident after the first tokens.
fn observe_engine(name: &str, model: &Path, dense: &str, n: u32, cgroup: Option<&Path>, evict: bool) -> Observed {
    let json = scratch_dir("dense-copy").join(format!("{name}.json"));
    let _ = std::fs::remove_file(&json);
    let mut cmd = Command::new(OBSERVER);
    cmd.args([
        "run",
        "--every",
        "0",
        "--poll",
        "10ms",
        "--residency-interval",
        "1ms",
        "--json",
        json.to_str().unwrap(),
    ]);
    if let Some(cg) = cgroup {
        cmd.arg("--cgroup").arg(cg);
    }
    cmd.arg("--")
        .arg(engine_bin())
        .args(["run", "-m", model.to_str().unwrap(), "-p", "Once upon a time", "-n", &n.to_string(), "-t", "1"])
        .args(["--ignore-eos", "--resident-every-ms", "0", "--dense", dense]);
    let mut obs = cmd.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().expect("start the observer");
    let mut err = BufReader::new(obs.stderr.take().unwrap());
    let mut stderr = String::new();
    let mut line = String::new();
    let (mut at_load, mut copy, mut contents_match, mut pid) = (None, None, true, None);
    loop {
        line.clear();
        if err.read_line(&mut line).unwrap() == 0 {
            break;
        }
        stderr.push_str(&line);
        if line.starts_with("engine: ") && line.contains(" loaded in ") {
            // The copy (if any) is complete and published before the engine says it loaded.
            let p = child_of(obs.id()).unwrap_or_else(|| panic!("no engine process under the observer:\n{stderr}"));
            let ranges = DenseCopy::new(p)
                .ranges()
                .unwrap_or_else(|e| panic!("reading {} of pid {p}: {e}", engine::dense_regions::SYMBOL));
            if let Some(r) = &ranges {
                let mem = std::fs::File::open(format!("/proc/{p}/mem")).unwrap();
                let file = std::fs::File::open(model).unwrap();
                for d in r {
                    for off in [0, d.len.saturating_sub(64)] {
                        let n = d.len.min(64) as usize;
                        let (mut a, mut b) = (vec![0u8; n], vec![0u8; n]);
                        mem.read_exact_at(&mut a, d.addr + off).unwrap();
                        file.read_exact_at(&mut b, d.file_offset + off).unwrap();
                        contents_match &= a == b;
                    }
                }
            }
            at_load = ranges;
            pid = Some(p);
            if dense == "mmap" {
                break;
            }
        }
        if let Some(c) = parse_copy_line(line.trim_end()) {
            copy = Some(c);
            break;
        }
    }
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let evictor = evict.then(|| {
        let (stop, model) = (std::sync::Arc::clone(&stop), model.to_owned());
        std::thread::spawn(move || {
            use std::os::fd::AsRawFd;
            let f = std::fs::File::open(&model).unwrap();
            let mut drops = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let t0 = mono_ns();
                // SAFETY: advice on a valid descriptor.
                unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
                drops.push((t0, mono_ns()));
                std::thread::sleep(Duration::from_millis(100));
            }
            drops
        })
    });
    let drain = std::thread::spawn(move || {
        let mut rest = String::new();
        let _ = err.read_to_string(&mut rest);
        rest
    });
    let mut smaps = Vec::new();
    if let (Some(c), Some(p)) = (copy, pid) {
        while let Some((rss, swap, locked)) = smaps_vma(p, c.start) {
            smaps.push(SmapsSample { t_ns: mono_ns(), rss, swap, locked });
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    let st = obs.wait().unwrap();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let drops = evictor.map(|e| e.join().unwrap()).unwrap_or_default();
    stderr.push_str(&drain.join().unwrap());
    assert!(st.success(), "observer run failed: {st}\n{stderr}");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap_or_else(|e| panic!("{e}\n{stderr}")))
        .expect("the run's JSON");
    let tokens = v["tokens"].as_array().expect("tokens").clone();
    assert_eq!(tokens.len() as u32, n, "a record for every step:\n{stderr}");
    Observed { tokens, copy, at_load, contents_match, smaps, drops, stderr }
}

fn f(v: &Value) -> Option<f64> {
    v.as_f64()
}

fn end_ns(t: &Value) -> u64 {
    u(t, "start_ns") + u(t, "wall_ns")
}

/// Records whose residency comes from the published copy (`dense_swapped_frac` set), checking
/// that the others (file numbers: the copy was gone when the observer sampled) only come at the
/// end of the run, after the engine exited.
fn anon_records(o: &Observed) -> Vec<&Value> {
    let with: Vec<&Value> = o.tokens.iter().filter(|t| t["residency"].is_object()).collect();
    let last_anon = with.iter().rposition(|t| f(&t["residency"]["dense_swapped_frac"]).is_some());
    let anon: Vec<&Value> =
        with.iter().copied().filter(|t| f(&t["residency"]["dense_swapped_frac"]).is_some()).collect();
    let last = last_anon.unwrap_or_else(|| panic!("no record measured the copy:\n{}", o.stderr));
    let gaps: Vec<_> = with[..last].iter().filter(|t| t["residency"]["dense_swapped_frac"].is_null()).collect();
    assert!(gaps.is_empty(), "records in the middle of the run fell back to the file: {gaps:?}");
    assert!(anon.len() >= 8, "only {} records measured the copy (of {}):\n{}", anon.len(), o.tokens.len(), o.stderr);
    anon
}

/// The published ranges lie in the copy the engine logged and cover its pages once each.
fn check_published(o: &Observed) -> CopyLine {
    let c = o.copy.unwrap_or_else(|| panic!("the engine did not log its copy:\n{}", o.stderr));
    assert_eq!((c.end - c.start) / PAGE, c.pages, "{c:?}");
    let r = o.at_load.as_ref().expect("the engine exports the symbol");
    assert!(!r.is_empty(), "nothing published after the copy was made");
    assert!(r.iter().all(|d| d.addr >= c.start && d.addr + d.len <= c.end), "{r:?} outside {c:?}");
    let pages: u64 = r.iter().map(|d| (d.addr + d.len).div_ceil(PAGE) - d.addr / PAGE).sum();
    assert_eq!(pages, c.pages, "the published ranges' pages are the copy's");
    assert!(o.contents_match, "a published range does not hold the file's bytes at its file_offset");
    c
}

#[test]
fn anon_copy_swapped_to_zram_is_measured_and_agrees_with_smaps() {
    let _l = machine_lock();
    let model = pressure_model();
    testkit::drop_caches().expect("drop caches");
    let since = testkit::vmstat_snapshot();
    let p = pressure("observer-dense-anon", &model);
    let o = observe_engine("anon", &model, "anon", 48, Some(p.cgroup.dir()), false);
    let stats = p.stats(&since);
    drop(p);
    let c = check_published(&o);
    assert!(stats.pswpout.unwrap_or(0) > 0, "no swap-out: {stats:?}");

    let anon = anon_records(&o);
    for t in &anon {
        let r = &t["residency"];
        let (res, swp) = (f(&r["dense_resident_frac"]).unwrap(), f(&r["dense_swapped_frac"]).unwrap());
        assert!(swp > 0.0 && res < 1.0, "token {}: resident {res}, swapped {swp}", t["index"]);
        // Every page of the copy was written: it is in RAM or in swap.
        assert!((res + swp - 1.0).abs() <= TOL, "token {}: resident {res} + swapped {swp}", t["index"]);
    }

    // The same pages counted by the kernel's smaps walk of the copy's VMA. The observer samples the
    // copy when it processes a token's end mark, or reuses a sample up to `--residency-interval`
    // (1 ms) old: some time in [end - 1 ms, end + WINDOW_NS]. The fraction keeps moving then (the
    // next tokens swap pages back in: a failure on the CI read 0.423 between smaps' 0.433 at
    // -1.4 ms and 0.412 at +4.3 ms), so the observer's value is compared with the smaps samples
    // spanning that interval: those inside it and the last one before it.
    assert!(o.smaps.len() >= 20, "only {} smaps samples", o.smaps.len());
    for s in &o.smaps {
        assert!(s.rss + s.swap <= c.pages + 1, "smaps {}+{} pages in a copy of {}", s.rss, s.swap, c.pages);
    }
    let mut compared = 0;
    for t in &anon {
        let end = end_ns(t);
        let from = end.saturating_sub(REUSE_NS);
        let Some(first) = o.smaps.iter().position(|s| s.t_ns >= from) else { continue };
        let span = &o.smaps[first.saturating_sub(1)..];
        let near: Vec<(u64, f64)> = span
            .iter()
            .take_while(|s| s.t_ns <= end + WINDOW_NS)
            .map(|s| (s.t_ns, s.swap as f64 / c.pages as f64))
            .collect();
        if !near.iter().any(|&(t_ns, _)| t_ns >= end) {
            continue;
        }
        let (lo, hi) = near.iter().fold((f64::MAX, f64::MIN), |(a, b), &(_, x)| (a.min(x), b.max(x)));
        let swp = f(&t["residency"]["dense_swapped_frac"]).unwrap();
        assert!(
            swp >= lo - TOL && swp <= hi + TOL,
            "token {}: observer dense_swapped_frac {swp:.4} vs smaps Swap {lo:.4}..{hi:.4} of the copy; smaps \
             (ms from the token's end, fraction): {:.3?}",
            t["index"],
            near.iter().map(|&(t_ns, x)| ((t_ns as f64 - end as f64) / 1e6, x)).collect::<Vec<_>>()
        );
        compared += 1;
    }
    assert!(compared * 2 >= anon.len(), "only {compared} of {} records had smaps samples near them", anon.len());
}

#[test]
fn locked_copy_stays_resident_under_the_same_pressure() {
    let _l = machine_lock();
    let model = pressure_model();
    testkit::drop_caches().expect("drop caches");
    let since = testkit::vmstat_snapshot();
    let p = pressure("observer-dense-locked", &model);
    let o = observe_engine("locked", &model, "locked", 128, Some(p.cgroup.dir()), false);
    let stats = p.stats(&since);
    drop(p);
    let c = check_published(&o);
    // The pressure was real: the balloon (or the engine's other memory) went to swap.
    assert!(stats.pswpout.unwrap_or(0) > 0, "no swap-out: {stats:?}");
    for t in anon_records(&o) {
        let r = &t["residency"];
        assert_eq!(f(&r["dense_resident_frac"]), Some(1.0), "token {}: {r}", t["index"]);
        assert_eq!(f(&r["dense_swapped_frac"]), Some(0.0), "token {}: {r}", t["index"]);
    }
    assert!(!o.smaps.is_empty());
    for s in &o.smaps {
        assert_eq!((s.rss, s.swap, s.locked), (c.pages, 0, c.pages), "smaps of the locked copy");
    }
}

/// `--dense mmap`: the symbol is there with count 0, so the observer measures the dense weights
/// on the file (mincore; `dense_swapped_frac` not measured). The independent source is the
/// engine's own mincore over its mapping of the file, sampled at the end of every step and
/// carried in the same record. The observer samples a little later (a few ms, while the next
/// tokens run), so the check uses what holds between two page-cache drops: the file's resident
/// pages only grow, and the observer's number lies between the engine's at its token and the
/// engine's a few tokens later.
#[test]
fn mmap_publishes_nothing_and_the_observer_measures_the_file() {
    const AHEAD: usize = 4;
    let _l = machine_lock();
    let model = pressure_model();
    testkit::drop_caches().expect("drop caches");
    let o = observe_engine("mmap", &model, "mmap", 128, None, true);
    assert!(o.copy.is_none(), "a copy under --dense mmap:\n{}", o.stderr);
    assert_eq!(o.at_load.as_deref(), Some(&[][..]), "the symbol is there and publishes count 0");
    assert!(o.drops.len() >= 3, "{} page-cache drops", o.drops.len());
    let eng = |t: &Value| f(&t["engine"]["dense_resident_frac"]).expect("the engine sampled mincore every step");
    let (mut checked, mut partial) = (0, 0);
    for (k, t) in o.tokens.iter().enumerate() {
        let r = &t["residency"];
        if !r.is_object() {
            continue;
        }
        assert!(r["dense_swapped_frac"].is_null(), "file pages are never swapped: {r}");
        let obs = f(&r["dense_resident_frac"]).expect("dense_resident_frac from the file");
        let Some(later) = o.tokens.get(k + AHEAD) else { continue };
        // From the engine's sample at token k to its sample at token k + AHEAD.
        let from = end_ns(t) - u(&t["engine"], "mgmt_ns");
        if o.drops.iter().any(|&(a, b)| b >= from && a <= end_ns(later)) {
            continue;
        }
        let lo = eng(t);
        let hi = o.tokens[k..=k + AHEAD].iter().map(eng).fold(lo, f64::max);
        assert!(
            obs >= lo - 0.005 && obs <= hi + 0.005,
            "token {}: observer {obs:.4} outside the engine's mincore {lo:.4}..{hi:.4} (tokens {k}..{})",
            t["index"],
            k + AHEAD
        );
        checked += 1;
        partial += usize::from(obs < 0.95);
    }
    assert!(checked >= 8, "only {checked} records between drops:\n{}", o.stderr);
    assert!(partial >= 1, "the dense weights were never partly out of the page cache: the comparison is void");
}
