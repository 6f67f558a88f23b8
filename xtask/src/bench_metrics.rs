//! `cargo xtask bench metrics`: what a burst of scrapes of the metrics
//! endpoint costs the observed engine. The same observed `engine run` (small
//! synthetic model, greedy, fixed prompt and length) under `observer run
//! --metrics-addr 127.0.0.1:0 --window 100ms` (windows keep the registry
//! populated whether or not the engine has token markers), A: nobody scrapes,
//! B: bursts of concurrent scrapes on loopback while it decodes — every
//! `--period-ms` a burst of `--clients` simultaneous GETs of /metrics, bounded
//! in count (`--max-bursts`) and by the run's end. A-B-B-A order over
//! several rounds; prints every round, the medians and their ratio
//! (target >= 0.99), and the scrapes' latencies and sizes.
//!
//! On a shared machine the tok/s of single runs can vary by more than the
//! 1 % target, so the endpoint's own cost is also measured directly: the
//! on-CPU time of the observer's `metrics-http` thread (its schedstat, the
//! scheduler's own accounting) over the run, as a share of the CPU time the
//! machine had in that time (wall × CPUs) — an upper bound of what serving
//! the scrapes can take from the engine. (The scraping clients' CPU, this
//! process's, is the benchmark's, printed apart.)

use std::{
    io::{BufRead, BufReader, Read, Write},
    net::{SocketAddr, TcpStream},
    process::{Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
        mpsc,
    },
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

use moe_stats::{median, quantile};

use crate::bench_util::{self, gen_tok_s};

#[derive(Debug, Clone, Copy)]
struct Burst {
    clients: usize,
    period: Duration,
    max_bursts: usize,
}

#[derive(Debug, Default)]
struct ScrapeStats {
    ok: usize,
    failed: usize,
    latencies_us: Vec<f64>,
    bytes: usize,
}

/// What one observed run measured.
#[derive(Debug, Default)]
struct Observed {
    tok_s: f64,
    scrapes: ScrapeStats,
    /// On-CPU time of the endpoint's thread over the run.
    endpoint_cpu_ns: u64,
    wall_s: f64,
}

/// The on-CPU time of `pid`'s thread called `metrics-http`.
fn endpoint_cpu_ns(pid: u32) -> Option<u64> {
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).ok()?.flatten() {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        if comm.trim() == "metrics-http" {
            let s = std::fs::read_to_string(t.path().join("schedstat")).ok()?;
            return s.split_whitespace().next()?.parse().ok();
        }
    }
    None
}

/// One GET /metrics as Prometheus asks for it; returns the body size, or
/// `None` when the endpoint is gone (the run ended: connection refused).
fn scrape(addr: SocketAddr) -> Result<Option<usize>> {
    let mut s = match TcpStream::connect_timeout(&addr, Duration::from_secs(5)) {
        Ok(s) => s,
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.write_all(
        b"GET /metrics HTTP/1.1\r\nHost: bench\r\nAccept: application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5\r\nConnection: close\r\n\r\n",
    )?;
    let mut out = Vec::with_capacity(64 << 10);
    s.read_to_end(&mut out)?;
    if !out.starts_with(b"HTTP/1.1 200") {
        bail!("not 200: {}", String::from_utf8_lossy(&out[..out.len().min(80)]));
    }
    Ok(Some(out.len()))
}

/// Bursts until `stop` or `max_bursts`.
fn burst_loop(addr: SocketAddr, b: Burst, stop: &AtomicBool) -> ScrapeStats {
    let mut st = ScrapeStats::default();
    for _ in 0..b.max_bursts {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        let t0 = Instant::now();
        let results: Vec<(Result<Option<usize>>, Duration)> = std::thread::scope(|sc| {
            let hs: Vec<_> = (0..b.clients)
                .map(|_| {
                    sc.spawn(move || {
                        let t = Instant::now();
                        (scrape(addr), t.elapsed())
                    })
                })
                .collect();
            hs.into_iter().filter_map(|h| h.join().ok()).collect()
        });
        let mut gone = false;
        for (r, d) in results {
            match r {
                Ok(Some(n)) => {
                    st.ok += 1;
                    st.bytes = n;
                    st.latencies_us.push(d.as_secs_f64() * 1e6);
                }
                Ok(None) => gone = true,
                Err(_) => st.failed += 1,
            }
        }
        if gone {
            break;
        }
        let left = b.period.saturating_sub(t0.elapsed());
        let until = Instant::now() + left;
        while Instant::now() < until && !stop.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(5).min(left));
        }
    }
    st
}

/// One observed engine run; with `burst`, scraped while it runs.
fn observed(
    observer: &std::path::Path,
    engine: &std::path::Path,
    engine_args: &[String],
    burst: Option<Burst>,
) -> Result<Observed> {
    let mut child = Command::new(observer)
        .args(["run", "--every", "0", "--window", "100ms", "--metrics-addr", "127.0.0.1:0", "--"])
        .arg(engine)
        .args(engine_args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting observer run")?;
    let (tx, rx) = mpsc::channel();
    let err = child.stderr.take().context("observer stderr")?;
    let err_thread = std::thread::spawn(move || {
        let mut all = String::new();
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            if let Some(a) = line.split("metrics at http://").nth(1) {
                let _ = tx.send(a.trim_end_matches("/metrics").to_string());
            }
            all.push_str(&line);
            all.push('\n');
        }
        all
    });
    let mut out = child.stdout.take().context("observer stdout")?;
    let out_thread = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let addr: SocketAddr = rx
        .recv_timeout(Duration::from_secs(60))
        .context("the observer printed no metrics address")?
        .parse()
        .context("parsing the metrics address")?;
    let stop = Arc::new(AtomicBool::new(false));
    let mut cpu_ns = 0u64;
    let scraper = burst.map(|b| {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || burst_loop(addr, b, &stop))
    });
    let t0 = Instant::now();
    // Sample the endpoint thread's CPU time until the observer exits.
    let pid = child.id();
    let status = loop {
        if let Some(st) = child.try_wait().context("waiting for observer run")? {
            break st;
        }
        if let Some(ns) = endpoint_cpu_ns(pid) {
            cpu_ns = ns;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let wall_s = t0.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let stats = scraper.map(|h| h.join().unwrap_or_default()).unwrap_or_default();
    let stdout = out_thread.join().unwrap_or_default();
    let stderr = err_thread.join().unwrap_or_default();
    if !status.success() {
        bail!("observer run failed: {status}\n{stderr}");
    }
    Ok(Observed { tok_s: gen_tok_s(&stdout)?, scrapes: stats, endpoint_cpu_ns: cpu_ns, wall_s })
}

pub fn main(args: &[String]) -> Result<()> {
    let mut rounds = 4usize;
    let mut n_gen = 96usize;
    let mut threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut preset = "small".to_string();
    let mut burst = Burst { clients: 32, period: Duration::from_millis(500), max_bursts: 2000 };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = |name: &str| it.next().with_context(|| format!("{name} needs a value")).cloned();
        match a.as_str() {
            "--rounds" => rounds = val("--rounds")?.parse()?,
            "-n" => n_gen = val("-n")?.parse()?,
            "--threads" => threads = val("--threads")?.parse()?,
            "--preset" => preset = val("--preset")?,
            "--clients" => burst.clients = val("--clients")?.parse()?,
            "--period-ms" => burst.period = Duration::from_millis(val("--period-ms")?.parse()?),
            "--max-bursts" => burst.max_bursts = val("--max-bursts")?.parse()?,
            _ => bail!(
                "usage: cargo xtask bench metrics [--rounds N] [-n TOKENS] [--threads T] [--preset small] [--clients C] [--period-ms MS] [--max-bursts B]"
            ),
        }
    }
    let bin = bench_util::build()?;
    let engine = bin.join("engine");
    let observer = bin.join("observer");
    let engine_args = bench_util::engine_args(&engine, &preset, n_gen, threads)?;
    let model = std::path::PathBuf::from(&engine_args[2]);
    println!(
        "model {} ({threads} threads, {n_gen} tokens), {rounds} rounds in A-B-B-A order; B: bursts of {} concurrent scrapes every {} ms",
        model.display(),
        burst.clients,
        burst.period.as_millis()
    );
    let (mut quiet, mut scraped) = (Vec::new(), Vec::new());
    let mut lat = Vec::new();
    let (mut ok, mut failed, mut bytes) = (0usize, 0usize, 0usize);
    let ncpu = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let (mut share_b, mut share_a, mut per_scrape_us, mut client_share) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for r in 0..rounds {
        let run_a = || observed(&observer, &engine, &engine_args, None);
        let run_b = || -> Result<(Observed, f64)> {
            let c0 = self_cpu_ns();
            let o = observed(&observer, &engine, &engine_args, Some(burst))?;
            Ok((o, (self_cpu_ns() - c0) as f64))
        };
        let (a, (b, client_ns)) = bench_util::abba_round(r, run_a, run_b)?;
        let st = &b.scrapes;
        let sb = b.endpoint_cpu_ns as f64 / (b.wall_s * 1e9 * ncpu);
        let sa = a.endpoint_cpu_ns as f64 / (a.wall_s * 1e9 * ncpu);
        println!(
            "round {r}: no scrapes {:.2} tok/s, scraped {:.2} tok/s ({} scrapes, {} failed), ratio {:.4}; \
             endpoint CPU {:.3} % of the machine ({:.3} % unscraped), {:.0} us per scrape",
            a.tok_s,
            b.tok_s,
            st.ok,
            st.failed,
            b.tok_s / a.tok_s,
            100.0 * sb,
            100.0 * sa,
            b.endpoint_cpu_ns as f64 / 1e3 / st.ok.max(1) as f64
        );
        quiet.push(a.tok_s);
        scraped.push(b.tok_s);
        share_b.push(sb);
        share_a.push(sa);
        per_scrape_us.push(b.endpoint_cpu_ns as f64 / 1e3 / st.ok.max(1) as f64);
        client_share.push(client_ns / (b.wall_s * 1e9 * ncpu));
        ok += st.ok;
        failed += st.failed;
        bytes = bytes.max(st.bytes);
        lat.extend(st.latencies_us.iter().copied());
    }
    let (mq, ms) = (median(&mut quiet), median(&mut scraped));
    lat.sort_by(f64::total_cmp);
    let p = |q: f64| quantile(&lat, q);
    println!(
        "scrapes: {ok} ok, {failed} failed, {bytes} bytes each; latency under the burst p50 {:.0} us, p99 {:.0} us, max {:.0} us",
        p(0.5),
        p(0.99),
        p(1.0)
    );
    println!(
        "endpoint CPU while scraped (median): {:.3} % of the machine, {:.0} us per scrape; unscraped {:.3} %; \
         the scraping clients (this process) {:.3} %",
        100.0 * median(&mut share_b),
        median(&mut per_scrape_us),
        100.0 * median(&mut share_a),
        100.0 * median(&mut client_share)
    );
    println!("median: no scrapes {mq:.2} tok/s, scraped {ms:.2} tok/s");
    println!("scrape cost ratio (scraped / not scraped): {:.4} (target >= 0.99)", ms / mq);
    if failed > 0 {
        bail!("{failed} scrapes failed");
    }
    Ok(())
}

/// This process's CPU time (user + system), for the scraping clients' cost.
fn self_cpu_ns() -> u64 {
    // SAFETY: zeroed rusage is a valid out-parameter.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointer to an rusage.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let ns = |t: libc::timeval| t.tv_sec as u64 * 1_000_000_000 + t.tv_usec as u64 * 1000;
    ns(ru.ru_utime) + ns(ru.ru_stime)
}
