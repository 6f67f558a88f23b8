//! Least privilege: `observer serve` as an unprivileged user (`nobody`) with
//! exactly the capabilities the systemd unit grants observes a target, and
//! each capability the unit lists as proven needed is: without it, observing
//! fails. The capabilities are read from `packaging/moe-observer.service`, so
//! the unit and this test cannot drift apart.

mod common;

use std::{
    io::{BufRead, BufReader, Read, Write},
    net::TcpStream,
    path::PathBuf,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use common::*;

fn unit() -> String {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../packaging/moe-observer.service");
    std::fs::read_to_string(p).unwrap()
}

/// The unit's capabilities, and those its header says are proven needed.
fn caps() -> (Vec<String>, Vec<String>) {
    let u = unit();
    let all = u.lines().find_map(|l| l.strip_prefix("CapabilityBoundingSet=")).unwrap();
    let all: Vec<String> = all.split_whitespace().map(str::to_string).collect();
    let proven_block = u.split("# Proven needed").nth(1).unwrap().split("# By reason").next().unwrap();
    let proven = all.iter().filter(|c| proven_block.contains(&format!("#   {c} "))).cloned().collect();
    (all, proven)
}

/// `setpriv` arguments: user nobody, no groups, exactly `caps`.
fn as_nobody_with(caps: &[String]) -> Vec<String> {
    let list: String = caps.iter().map(|c| format!(",+{}", c.trim_start_matches("CAP_").to_lowercase())).collect();
    vec![
        "--reuid=65534".into(),
        "--regid=65534".into(),
        "--clear-groups".into(),
        format!("--inh-caps=-all{list}"),
        format!("--ambient-caps=-all{list}"),
        format!("--bounding-set=-all{list}"),
    ]
}

/// Copies `nobody` can run (the build tree may sit under a 0700 home).
fn binaries() -> (String, String) {
    let d = shared_dir("privileges");
    let copy = |from: &str, name: &str| {
        let to = d.join(name);
        let tmp = d.join(format!("{name}.tmp"));
        std::fs::copy(from, &tmp).unwrap();
        std::fs::rename(&tmp, &to).unwrap();
        to.to_str().unwrap().to_string()
    };
    (copy(OBSERVER, "observer"), copy(workload(), "workload"))
}

/// `observer serve -- workload busy` as nobody with `caps`: Ok(the scrape
/// after the target ended) or Err(what the observer said).
fn serve_as_nobody(caps: &[String], observer: &str, wl: &str) -> Result<String, String> {
    let mut child = Command::new("setpriv")
        .args(as_nobody_with(caps))
        .args([observer, "serve", "--metrics-addr", "127.0.0.1:0", "--", wl, "busy", "--ms", "300"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("setpriv (util-linux)");
    let (tx, rx) = std::sync::mpsc::channel();
    let err = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut said = String::new();
    let mut addr = None;
    let t0 = Instant::now();
    let result = loop {
        if t0.elapsed() > Duration::from_secs(60) {
            break Err(format!("no end of the target in 60 s:\n{said}"));
        }
        while let Ok(l) = rx.try_recv() {
            if let Some(a) = l.split("metrics at http://").nth(1) {
                addr = Some(a.trim_end_matches("/metrics").to_string());
            }
            said.push_str(&l);
            said.push('\n');
        }
        if let Ok(Some(st)) = child.try_wait() {
            std::thread::sleep(Duration::from_millis(100));
            while let Ok(l) = rx.try_recv() {
                said.push_str(&l);
                said.push('\n');
            }
            break Err(format!("serve exited ({st}):\n{said}"));
        }
        if said.contains("the target ended")
            && let Some(a) = &addr
        {
            let mut s = TcpStream::connect(a.as_str()).unwrap();
            write!(s, "GET /metrics HTTP/1.0\r\n\r\n").unwrap();
            let mut body = String::new();
            s.read_to_string(&mut body).unwrap();
            break Ok(body);
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let _ = child.wait();
    result
}

#[test]
fn serve_runs_as_nobody_with_exactly_the_units_capabilities_and_each_proven_one_is_needed() {
    let _l = machine_lock();
    let (all, proven) = caps();
    assert!(!proven.is_empty(), "the unit names no proven capability");
    let (observer, wl) = binaries();
    let body = serve_as_nobody(&all, &observer, &wl).unwrap_or_else(|e| panic!("with {all:?}: {e}"));
    assert!(body.contains("moe_observer_runs_total 1"), "{body}");
    assert!(body.contains("moe_observer_step_duration_seconds_count"), "the run was measured:\n{body}");
    for cap in &proven {
        let fewer: Vec<String> = all.iter().filter(|c| *c != cap).cloned().collect();
        match serve_as_nobody(&fewer, &observer, &wl) {
            // A refused token uprobe degrades the target instead of failing it (issue 22): the
            // capability is still proven needed when the target's steps went unmeasured (the
            // target's `degraded` series is gone with the target by the time of this scrape).
            Ok(body) if !body.contains("moe_observer_step_duration_seconds_count") => {
                println!("without {cap}: served, with no steps measured");
            }
            Ok(body) => panic!("without {cap} the target was still observed: the unit's proof is wrong\n{body}"),
            Err(e) => println!("without {cap}: {}", e.lines().rev().find(|l| l.contains("error")).unwrap_or(&e)),
        }
    }
}
