//! The metrics endpoint under hostile load (issue 19, item 1): `observer serve`
//! keeps answering `/metrics` and `/healthz` while 1000 connections sit idle or
//! trickle their request head, and its memory and open files stay bounded when
//! far more connections than it keeps are opened.
//!
//! The endpoint runs in its own process (`observer serve --name` of a program
//! that never starts: no probes are loaded, no root needed), so that its
//! memory (`VmRSS`) and its open sockets (`/proc/PID/fd`) are measured
//! independently of this test's own.

mod common;

use std::{
    io::{BufRead, BufReader, Read, Write},
    net::{SocketAddr, TcpStream},
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use common::OBSERVER;

/// A scrape this slow is blocked, not merely slow: before the fix, scrapes
/// waited 10 s behind 32 stalled connections.
const ANSWERED_WITHIN: Duration = Duration::from_secs(1);

struct Serve {
    child: Child,
    addr: SocketAddr,
}

impl Serve {
    fn start(extra: &[&str]) -> Serve {
        let mut child = Command::new(OBSERVER)
            .args(["serve", "--name", "no-such-program-endpoint-test", "--web.listen-address", "127.0.0.1:0"])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start observer serve");
        let (tx, rx) = mpsc::channel();
        let err = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                eprintln!("[serve] {line}");
                if let Some(a) = line.split("metrics at http://").nth(1) {
                    let _ = tx.send(a.trim_end_matches("/metrics").to_string());
                }
            }
        });
        let a = rx.recv_timeout(Duration::from_secs(30)).expect("serve printed its address");
        Serve { child, addr: a.parse().unwrap() }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn rss_kib(&self) -> u64 {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap();
        let l = s.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
        l.split_whitespace().nth(1).unwrap().parse().unwrap()
    }

    fn open_files(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid())).unwrap().count()
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Room for this test's own sockets.
fn raise_nofile() {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: plain syscalls on a valid struct.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut r), 0);
        r.rlim_cur = r.rlim_max;
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &r), 0);
    }
    assert!(r.rlim_cur >= 8192, "this test needs RLIMIT_NOFILE ≥ 8192 (hard limit is {})", r.rlim_max);
}

/// One GET; (status line, body) and how long it took, or why it failed.
fn get(addr: SocketAddr, path: &str) -> Result<(String, String, Duration), String> {
    let t0 = Instant::now();
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).map_err(|e| format!("connect: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").map_err(|e| format!("send: {e}"))?;
    let mut out = String::new();
    s.read_to_string(&mut out).map_err(|e| format!("read: {e}"))?;
    let dt = t0.elapsed();
    let (h, b) = out.split_once("\r\n\r\n").ok_or_else(|| format!("no HTTP head: {out:?}"))?;
    Ok((h.lines().next().unwrap_or("").to_string(), b.to_string(), dt))
}

/// `n` connections: even ones send nothing, odd ones one byte of a head, and
/// all of them then stall. The endpoint must take them all within 20 s.
fn hold(addr: SocketAddr, n: usize) -> Vec<TcpStream> {
    let t0 = Instant::now();
    (0..n)
        .map(|i| {
            assert!(t0.elapsed() < Duration::from_secs(20), "the endpoint took only {i} of {n} connections in 20 s");
            let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))
                .unwrap_or_else(|e| panic!("connection {i} of {n}: {e}"));
            if i % 2 == 1 {
                s.write_all(b"G").unwrap();
            }
            s
        })
        .collect()
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

#[test]
fn scrapes_are_answered_under_1000_idle_and_slow_connections() {
    raise_nofile();
    let serve = Serve::start(&[]);
    let (status, body, _) = get(serve.addr, "/metrics").expect("a first scrape");
    assert!(status.contains(" 200 ") && body.contains("moe_observer_build_info"), "{status}\n{body}");

    let held = hold(serve.addr, 1000);
    // Let the endpoint take them all in.
    std::thread::sleep(Duration::from_millis(300));
    let mut times = Vec::new();
    for i in 0..200 {
        let path = if i % 10 == 9 { "/healthz" } else { "/metrics" };
        match get(serve.addr, path) {
            Ok((status, _, dt)) => {
                assert!(status.contains(" 200 "), "scrape {i} of {path}: {status}");
                assert!(dt < ANSWERED_WITHIN, "scrape {i} of {path} waited {dt:?} behind the held connections");
                times.push(dt);
            }
            Err(e) => panic!("scrape {i} of {path} with {} connections held: {e}", held.len()),
        }
    }
    times.sort();
    let (p50, p99, max) = (percentile(&times, 0.5), percentile(&times, 0.99), *times.last().unwrap());
    println!("scrape latency with 1000 idle/slow connections held: p50 {p50:?} p99 {p99:?} max {max:?}");
    // The held connections are still open (nobody dropped them to make room).
    assert!(serve.open_files() >= 1000, "the endpoint holds {} files", serve.open_files());
    drop(held);
}

#[test]
fn memory_and_open_files_stay_bounded_beyond_the_connection_limit() {
    raise_nofile();
    let serve = Serve::start(&[]);
    let rss0 = serve.rss_kib();
    let fds0 = serve.open_files();
    let limit = observer::sinks::prometheus::http::MAX_CONNECTIONS;
    // Twice the limit: the oldest stalled connections are closed to make room.
    let held = hold(serve.addr, 2 * limit);
    std::thread::sleep(Duration::from_millis(500));
    let (status, _, dt) = get(serve.addr, "/metrics").expect("a scrape beyond the connection limit");
    assert!(status.contains(" 200 "), "{status}");
    let (rss1, fds1) = (serve.rss_kib(), serve.open_files());
    println!(
        "{} connections opened against a limit of {limit}: open files {fds0} → {fds1}, VmRSS {rss0} → {rss1} KiB, scrape {dt:?}",
        held.len()
    );
    // The held connections, the scrape's own and a few accepted while the oldest are being closed.
    assert!(fds1 <= fds0 + limit + 8, "the endpoint keeps {fds1} files open (limit {limit} connections)");
    // Each stalled connection costs at most its head buffer and a task.
    let budget_kib = limit as u64 * 12 + (16 << 10);
    assert!(rss1 < rss0 + budget_kib, "VmRSS grew from {rss0} to {rss1} KiB (budget {budget_kib} KiB)");
    // The closed ones were closed, not left half-open: reading gives EOF/reset.
    let mut closed = 0;
    for mut s in held {
        s.set_read_timeout(Some(Duration::from_millis(1))).unwrap();
        let mut b = [0u8; 1];
        let gone = match s.read(&mut b) {
            Ok(n) => n == 0,
            Err(e) => !matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut),
        };
        closed += usize::from(gone);
    }
    assert!(closed >= limit, "only {closed} connections were closed");
}
