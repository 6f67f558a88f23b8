//! Soak run of `observer serve --discover` while targets come and go: the
//! driver behind `cargo xtask soak`.
//!
//! ## Spec
//! - The daemon: `OBSERVER serve --discover --name NAME --metrics-addr
//!   127.0.0.1:0` (NAME: the engine copy's file name, so that only this run's
//!   targets are followed).
//! - The targets: short `engine run` processes (`Config::engine_args`), at most
//!   [`CONCURRENT`] at once, each on one of the models in turn (so a bounded set
//!   of label sets recurs); a new one starts as soon as one ends, after a pause
//!   that alternates between [`PAUSES`] so that starts and ends interleave.
//! - Every `Config::sample_every` the driver reads the daemon's resident
//!   memory (`VmRSS` of `/proc/PID/status`), its open file descriptors
//!   (`/proc/PID/fd`) and the number of series in one `/metrics` scrape
//!   (sample lines, eviction actors' names left out: below), and prints them.
//! - Bounds, after `Config::warmup` (the maxima seen during the warm-up are the
//!   baseline): the median RSS of the samples after it at most
//!   [`RSS_SLACK_FRACTION`] above the baseline plus [`RSS_SLACK_BYTES`] (a
//!   median, because RSS spikes for a moment when two targets' sessions load
//!   their eBPF objects at once: 63 MB for one sample against 34-43 MB around
//!   it in a 45 s run; a leak moves the median); open fds at most [`FD_SLACK`]
//!   above the baseline in every sample; series at most the baseline in every
//!   sample (every label set has been seen by then, and a target's series are
//!   bounded by its labels). A run beyond a bound fails, and so does a daemon
//!   that exits on its own or fails to stop on SIGINT.
//!
//! ## At rest (the in-suite soak test)
//! The short soak in `observer/tests/metrics.rs` runs waves of targets and measures
//! the daemon at rest after each: every target has ended, its series are stale
//! and the daemon holds no BPF program, map, link or perf event ([`bpf_fds`] is
//! 0). What the daemon's memory is made of then ([`Memory`], from
//! `/proc/PID/status`): `RssFile`, its binary's and libraries' pages read so far
//! (bounded by their size); `RssAnon`, the heap and thread stacks, which glibc's
//! allocator keeps after a peak (so it depends on how many sessions overlapped,
//! not on how many came and went). A session's own memory is gone at rest: its
//! 4 MiB ring buffer (mapped into the daemon, counted in RSS while it lives), its
//! maps and its parsed kernel BTF and ELF object. That is why RSS is judged at
//! rest and not at its peaks (a peak measures how many sessions were loading at
//! that moment: 63 MB for one sample of a 45 s run against 34-43 MB around it).
//! Bounds after the warm-up waves ([`check_rest`], against the warm-up's last
//! rest): RSS at most [`rss_bound`] of it (a target that leaked its session
//! would keep at least its 4 MiB ring: a wave of three adds 12 MiB); open fds at
//! most [`REST_FD_SLACK`] more and series at most [`REST_SERIES_SLACK`] more
//! (a leak of one per target adds a wave's target count each wave). Between
//! rests, every sample's RSS stays under [`RSS_HARD_CAP`].
//!
//! ## Series that come with the machine, not with the targets
//! Every series bound (rests and samples) leaves out the series of eviction actors' names
//! ([`is_actor_name_series`]): one comes the first time a process evicts a model's pages, which
//! happens at any moment on a host whose DAMON pages out page cache left untouched for a minute
//! (`kdamond.0`, a CI run: 4 such series in the third wave), and the exporter bounds them itself
//! (its top names and `other`, per model and kind, however many targets come and go).

use std::{
    io::{BufRead, BufReader, Read, Write},
    net::{SocketAddr, TcpStream},
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex, mpsc},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

/// Targets alive at once.
pub const CONCURRENT: usize = 2;
/// The pauses between a target's end and the next start, in turn.
pub const PAUSES: [Duration; 3] = [Duration::from_millis(50), Duration::from_millis(700), Duration::from_millis(300)];
/// RSS may grow this fraction above the warm-up maximum...
pub const RSS_SLACK_FRACTION: f64 = 0.10;
/// ...plus this many bytes (allocator arenas settling).
pub const RSS_SLACK_BYTES: u64 = 8 << 20;
/// Open fds may exceed the warm-up maximum by this many.
pub const FD_SLACK: u64 = 8;

/// Open fds at rest may exceed the warm-up's rest by this many (a fd opened once, late).
pub const REST_FD_SLACK: u64 = 2;
/// Series at rest may exceed the warm-up's rest by this many (a counter of a rare event, such
/// as a major fault of a kind not seen before, appears once it first happens).
pub const REST_SERIES_SLACK: usize = 2;
/// No sample's RSS may exceed this. The peak is the rest plus the sessions alive or detaching
/// at that moment (each with a 4 MiB ring buffer, its maps, and a parsed kernel BTF of a few
/// tens of MB while it loads); a few overlapping sessions stay far below it, a leak of a
/// session per target or a runaway allocation does not.
pub const RSS_HARD_CAP: u64 = 256 << 20;

/// The daemon's memory, from `/proc/PID/status` (bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Memory {
    pub rss: u64,
    pub anon: u64,
    pub file: u64,
}

/// `VmRSS`, `RssAnon` and `RssFile` of `pid`.
pub fn memory(pid: u32) -> Result<Memory> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kb = |key: &str| -> Result<u64> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().trim_end_matches(" kB").parse::<u64>().ok())
            .map(|k| k * 1024)
            .with_context(|| format!("{key} of pid {pid}"))
    };
    Ok(Memory { rss: kb("VmRSS:")?, anon: kb("RssAnon:")?, file: kb("RssFile:")? })
}

/// The open fds of `pid`.
pub fn open_fds(pid: u32) -> Result<u64> {
    Ok(std::fs::read_dir(format!("/proc/{pid}/fd"))?.count() as u64)
}

/// The fds of `pid` that are BPF objects or perf events (a session's probes).
pub fn bpf_fds(pid: u32) -> Result<u64> {
    let mut n = 0;
    for e in std::fs::read_dir(format!("/proc/{pid}/fd"))?.flatten() {
        let Ok(l) = std::fs::read_link(e.path()) else { continue };
        let l = l.to_string_lossy();
        n += u64::from(l.starts_with("anon_inode:bpf") || l == "anon_inode:[perf_event]");
    }
    Ok(n)
}

/// The series of a Prometheus text body: each sample line's name and labels.
pub fn series_of(body: &str) -> std::collections::BTreeSet<String> {
    body.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| l.rsplit_once(' ').map_or(l, |(k, _)| k).to_string())
        .collect()
}

/// Whether `series` names an eviction actor's process (module spec, "Series that come with the
/// machine"); the bounds leave these out.
pub fn is_actor_name_series(series: &str) -> bool {
    series.starts_with("moe_observer_pagecache_evicted_by_name_pages_total{")
}

/// The daemon at rest (module spec).
#[derive(Debug, Clone, PartialEq)]
pub struct Rest {
    pub memory: Memory,
    pub fds: u64,
    pub series: std::collections::BTreeSet<String>,
}

/// The bounds a rest after the warm-up keeps against the warm-up's last rest (module spec).
pub fn check_rest(base: &Rest, r: &Rest) -> Vec<String> {
    let mut out = Vec::new();
    let bound = rss_bound(base.memory.rss);
    if r.memory.rss > bound {
        out.push(format!("RSS at rest {:?} > bound {bound} B (warm-up rest {:?})", r.memory, base.memory));
    }
    if r.fds > base.fds + REST_FD_SLACK {
        out.push(format!("{} open fds at rest > warm-up rest {} + {REST_FD_SLACK}", r.fds, base.fds));
    }
    let bounded = |s: &Rest| s.series.iter().filter(|k| !is_actor_name_series(k)).count();
    if bounded(r) > bounded(base) + REST_SERIES_SLACK {
        let new: Vec<&String> = r.series.difference(&base.series).filter(|k| !is_actor_name_series(k)).collect();
        out.push(format!(
            "{} series at rest > warm-up rest {} + {REST_SERIES_SLACK} (eviction actors' names left out); new: {new:?}",
            bounded(r),
            bounded(base)
        ));
    }
    out
}

/// What to run.
#[derive(Debug, Clone)]
pub struct Config {
    pub observer: PathBuf,
    /// The engine binary, under the name `serve --name` follows.
    pub engine: PathBuf,
    /// The models the targets load, in turn (one label set each).
    pub models: Vec<PathBuf>,
    /// Generated tokens per target run.
    pub tokens: u32,
    pub duration: Duration,
    pub warmup: Duration,
    pub sample_every: Duration,
}

impl Config {
    /// `engine run` arguments for one target on `model`.
    pub fn engine_args(&self, model: &std::path::Path) -> Vec<String> {
        let m = model.display().to_string();
        ["run", "-m", &m, "-p", "The daemon keeps serving", "-n", &self.tokens.to_string(), "--ignore-eos", "-t", "1"]
            .map(String::from)
            .to_vec()
    }
}

/// One sample of the daemon.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    pub t: Duration,
    pub rss_bytes: u64,
    pub fds: u64,
    /// Series, eviction actors' names left out ([`is_actor_name_series`]).
    pub series: u64,
    /// Targets started so far, and observed so far (`runs_total`, summed).
    pub started: u64,
    pub runs: u64,
}

/// The whole run.
#[derive(Debug, Clone)]
pub struct Report {
    pub samples: Vec<Sample>,
    /// The warm-up maxima: (RSS, fds, series).
    pub baseline: (u64, u64, u64),
    /// Samples after the warm-up beyond a bound, with what was exceeded.
    pub violations: Vec<String>,
}

impl Report {
    /// The largest (RSS, fds, series) after the warm-up.
    pub fn after_warmup_max(&self, warmup: Duration) -> (u64, u64, u64) {
        self.samples
            .iter()
            .filter(|s| s.t >= warmup)
            .fold((0, 0, 0), |(r, f, n), s| (r.max(s.rss_bytes), f.max(s.fds), n.max(s.series)))
    }
}

/// The bound on the median RSS after the warm-up (module spec), from the warm-up maximum.
pub fn rss_bound(warmup_max: u64) -> u64 {
    (warmup_max as f64 * (1.0 + RSS_SLACK_FRACTION)) as u64 + RSS_SLACK_BYTES
}

/// The median RSS of `samples`.
pub fn median_rss(samples: &[Sample]) -> u64 {
    let mut v: Vec<u64> = samples.iter().map(|s| s.rss_bytes).collect();
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or(0)
}

/// The bounds each sample after the warm-up must keep, from the warm-up maxima (fds, series).
pub fn check(baseline: (u64, u64, u64), s: &Sample) -> Vec<String> {
    let (_, fds, series) = baseline;
    let mut out = Vec::new();
    if s.fds > fds + FD_SLACK {
        out.push(format!("at {:.0} s {} open fds > bound {}", s.t.as_secs_f64(), s.fds, fds + FD_SLACK));
    }
    if s.series > series {
        out.push(format!("at {:.0} s {} series > bound {series}", s.t.as_secs_f64(), s.series));
    }
    out
}

/// The daemon under test.
struct Daemon {
    child: Child,
    addr: SocketAddr,
    log: Arc<Mutex<String>>,
}

impl Daemon {
    fn start(cfg: &Config) -> Result<Daemon> {
        let name = cfg.engine.file_name().and_then(|n| n.to_str()).context("the engine's file name")?;
        let mut child = Command::new(&cfg.observer)
            .args(["serve", "--discover", "--name", name, "--metrics-addr", "127.0.0.1:0"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {}", cfg.observer.display()))?;
        let (tx, rx) = mpsc::channel();
        let log = Arc::new(Mutex::new(String::new()));
        let err = child.stderr.take().context("stderr")?;
        let buf = Arc::clone(&log);
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                if let Some(a) = line.split("metrics at http://").nth(1) {
                    let _ = tx.send(a.trim_end_matches("/metrics").to_string());
                }
                let mut b = buf.lock().unwrap_or_else(|p| p.into_inner());
                // Keep the log bounded over a long run: its last 256 KiB.
                if b.len() > 512 << 10 {
                    let cut = b.len() - (256 << 10);
                    let cut = (cut..b.len()).find(|&i| b.is_char_boundary(i)).unwrap_or(b.len());
                    b.drain(..cut);
                }
                b.push_str(&line);
                b.push('\n');
            }
        });
        let Ok(addr) = rx.recv_timeout(Duration::from_secs(30)) else {
            let _ = child.kill();
            let _ = child.wait();
            bail!("serve printed no metrics address:\n{}", log.lock().unwrap_or_else(|p| p.into_inner()));
        };
        let addr = addr.parse().with_context(|| format!("serve's address {addr:?}"))?;
        Ok(Daemon { child, addr, log })
    }

    fn log(&self) -> String {
        self.log.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn sample(&mut self, t: Duration, started: u64) -> Result<Sample> {
        if let Some(st) = self.child.try_wait()? {
            bail!("serve exited on its own ({st}):\n{}", self.log());
        }
        let pid = self.child.id();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
        let kb: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches(" kB").parse().ok())
            .context("VmRSS of serve")?;
        let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))?.count() as u64;
        let body = scrape(self.addr)?;
        let lines = body.lines().filter(|l| !l.starts_with('#') && !l.is_empty());
        let (mut series, mut runs) = (0u64, 0.0f64);
        for l in lines {
            series += u64::from(!is_actor_name_series(l));
            if l.starts_with("moe_observer_runs_total{") {
                runs += l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
            }
        }
        Ok(Sample { t, rss_bytes: kb * 1024, fds, series, started, runs: runs as u64 })
    }

    /// SIGINT; an error unless it exits 0 within 20 s.
    fn stop(mut self) -> Result<()> {
        // SAFETY: kill(2) of our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        let t0 = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait()? {
                if !st.success() {
                    bail!("serve ended with {st} on SIGINT:\n{}", self.log());
                }
                return Ok(());
            }
            if t0.elapsed() > Duration::from_secs(20) {
                let _ = self.child.kill();
                let _ = self.child.wait();
                bail!("serve did not stop within 20 s of SIGINT:\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// One `/metrics` scrape (Prometheus text), its body.
fn scrape(addr: SocketAddr) -> Result<String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(10)).context("connecting to /metrics")?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    write!(s, "GET /metrics HTTP/1.0\r\nHost: {addr}\r\nAccept: text/plain\r\n\r\n")?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    let (head, body) = out.split_once("\r\n\r\n").context("no HTTP head")?;
    if !head.starts_with("HTTP/1.1 200") {
        bail!("/metrics answered {head}");
    }
    Ok(body.to_string())
}

/// Run the soak (module spec), printing a line per sample to `out`.
pub fn run(cfg: &Config, out: &mut dyn Write) -> Result<Report> {
    if cfg.models.is_empty() {
        bail!("the soak needs at least one model");
    }
    let mut daemon = Daemon::start(cfg)?;
    let t0 = Instant::now();
    let mut targets: Vec<Child> = Vec::new();
    let (mut started, mut next_start, mut pause) = (0u64, t0, 0usize);
    let mut samples = Vec::new();
    let mut next_sample = t0;
    writeln!(out, "{:>6} {:>10} {:>5} {:>7} {:>8} {:>6}", "t_s", "rss_kib", "fds", "series", "started", "runs")?;
    let result = (|| -> Result<()> {
        while t0.elapsed() < cfg.duration {
            // Reap the targets that ended; each must have succeeded.
            let mut i = 0;
            while i < targets.len() {
                if targets[i].try_wait()?.is_some() {
                    let st = targets.swap_remove(i).wait()?;
                    if !st.success() {
                        bail!("a target engine failed: {st}");
                    }
                    next_start = Instant::now() + PAUSES[pause % PAUSES.len()];
                    pause += 1;
                } else {
                    i += 1;
                }
            }
            if targets.len() < CONCURRENT && Instant::now() >= next_start {
                let model = &cfg.models[started as usize % cfg.models.len()];
                let child = Command::new(&cfg.engine)
                    .args(cfg.engine_args(model))
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .with_context(|| format!("starting {}", cfg.engine.display()))?;
                targets.push(child);
                started += 1;
                next_start = Instant::now() + PAUSES[pause % PAUSES.len()];
            }
            if Instant::now() >= next_sample {
                let s = daemon.sample(t0.elapsed(), started)?;
                writeln!(
                    out,
                    "{:>6.0} {:>10} {:>5} {:>7} {:>8} {:>6}",
                    s.t.as_secs_f64(),
                    s.rss_bytes / 1024,
                    s.fds,
                    s.series,
                    s.started,
                    s.runs
                )?;
                samples.push(s);
                next_sample += cfg.sample_every;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    })();
    for mut t in targets {
        let _ = t.kill();
        let _ = t.wait();
    }
    if let Err(e) = result {
        let log = daemon.log();
        let _ = daemon.stop();
        return Err(e.context(format!("serve's log:\n{log}")));
    }
    let log = daemon.log();
    daemon.stop()?;
    let warm: Vec<&Sample> = samples.iter().filter(|s| s.t < cfg.warmup).collect();
    if warm.is_empty() || warm.len() == samples.len() {
        bail!("no sample on both sides of the {:?} warm-up in {:?}", cfg.warmup, cfg.duration);
    }
    let baseline = warm.iter().fold((0, 0, 0), |(r, f, n), s| (r.max(s.rss_bytes), f.max(s.fds), n.max(s.series)));
    let after: Vec<Sample> = samples.iter().filter(|s| s.t >= cfg.warmup).copied().collect();
    let mut violations: Vec<String> = after.iter().flat_map(|s| check(baseline, s)).collect();
    let (median, bound) = (median_rss(&after), rss_bound(baseline.0));
    if median > bound {
        violations.push(format!("median RSS after the warm-up {median} B > bound {bound} B"));
    }
    let last = samples.last().map_or(0, |s| s.runs);
    if last == 0 {
        bail!("serve observed no target in {:?}:\n{log}", cfg.duration);
    }
    Ok(Report { samples, baseline, violations })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_are_checked_against_the_warm_up_maxima() {
        let base = (100 << 20, 20, 300);
        let s = |rss: u64, fds: u64, series: u64| Sample {
            t: Duration::from_secs(60),
            rss_bytes: rss,
            fds,
            series,
            started: 1,
            runs: 1,
        };
        assert!(check(base, &s(100 << 20, 20, 300)).is_empty());
        assert!(check(base, &s(500 << 20, 28, 300)).is_empty(), "within the slack; RSS is judged by its median");
        assert_eq!(check(base, &s(100 << 20, 29, 301)).len(), 2, "each bound is its own violation");
        assert_eq!(rss_bound(100 << 20), 118 << 20);
        let spike = [s(40 << 20, 1, 1), s(63 << 20, 1, 1), s(41 << 20, 1, 1)];
        assert_eq!(median_rss(&spike), 41 << 20, "a one-sample spike does not move the median");
    }

    #[test]
    fn a_rest_is_checked_against_the_warm_up_rest() {
        let rest = |rss: u64, fds: u64, series: &[&str]| Rest {
            memory: Memory { rss, anon: rss / 2, file: rss / 2 },
            fds,
            series: series.iter().map(|s| s.to_string()).collect(),
        };
        let base = rest(30 << 20, 40, &["a", "b"]);
        assert!(check_rest(&base, &rest(41 << 20, 42, &["a", "b", "c", "d"])).is_empty(), "within the slack");
        let v = check_rest(&base, &rest(42 << 20, 43, &["a", "b", "c", "d", "e"]));
        assert_eq!(v.len(), 3, "{v:?}");
        assert!(v[2].contains("\"e\""), "the new series are named: {v:?}");
        // An eviction actor's name that came meanwhile (DAMON's kdamond) is not a leak.
        let kdamond = "moe_observer_pagecache_evicted_by_name_pages_total{actor_name=\"kdamond.0\"}";
        let other = "moe_observer_pagecache_evicted_by_name_pages_total{actor_name=\"other\"}";
        assert!(check_rest(&base, &rest(30 << 20, 40, &["a", "b", "c", "d", kdamond, other])).is_empty());
        assert_eq!(check_rest(&base, &rest(30 << 20, 40, &["a", "b", "c", "d", "e", kdamond])).len(), 1);
        assert_eq!(series_of("# HELP x y\nx{a=\"1\"} 2\nx{a=\"2\"} 3\n\ny 1\n").len(), 3);
    }
}
