//! What a hostile but fair tester tried (issue 19): outputs checked before the
//! run and never overwritten silently, no target left behind by a killed
//! observer, non-regular inputs, bounds, duplicates, messages.

mod common;

use std::{
    path::{Path, PathBuf},
    process::{Command, Output},
};

use common::*;

fn dir(name: &str) -> PathBuf {
    let d = scratch_dir("hardening").join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn observer(args: &[&str]) -> Output {
    Command::new(OBSERVER).args(args).output().expect("run observer")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The files left in `d`, sorted.
fn entries(d: &Path) -> Vec<String> {
    let mut v: Vec<String> =
        std::fs::read_dir(d).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

/// The recorded test trace, copied into `d`.
fn a_trace(d: &Path) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/wave1-engine-tiny.trace");
    let p = d.join("run.trace");
    std::fs::copy(src, &p).unwrap();
    p
}

#[test]
fn an_unwritable_json_fails_before_the_target_runs() {
    let d = dir("json-before");
    let marker = d.join("ran");
    let o = observer(&["run", "--procfs", "--json", "/proc/observer.json", "--", "touch", s(&marker)]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("/proc/observer.json"), "{}", stderr(&o));
    assert!(!marker.exists(), "the target ran before the output was checked");
}

#[test]
fn an_existing_output_is_kept_without_force_and_replaced_with_it() {
    let d = dir("exists");
    let marker = d.join("ran");
    for flag in [["--json"], ["--record"]] {
        let out = d.join("old");
        std::fs::write(&out, "precious").unwrap();
        let o = observer(&["run", "--procfs", flag[0], s(&out), "--", "touch", s(&marker)]);
        assert_eq!(o.status.code(), Some(2), "{flag:?}: {}", stderr(&o));
        assert!(stderr(&o).contains("--force") && stderr(&o).contains(s(&out)), "{}", stderr(&o));
        assert_eq!(std::fs::read_to_string(&out).unwrap(), "precious", "{flag:?}");
        assert!(!marker.exists());
    }
    let o = observer(&["record", "--procfs", "-o", s(&d.join("old")), "--", "true"]);
    assert_eq!(o.status.code(), Some(2), "record -o: {}", stderr(&o));
    let o = observer(&["run", "--procfs", "--force", "--json", s(&d.join("old")), "--", "touch", s(&marker)]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(d.join("old")).unwrap()).unwrap();
    assert!(v.is_object());
    assert!(marker.exists());
    assert_eq!(entries(&d), ["old", "ran"], "no temporary file is left");
}

#[test]
fn export_never_writes_over_its_input() {
    let d = dir("export-input");
    let t = a_trace(&d);
    let before = std::fs::read(&t).unwrap();
    let link = d.join("link.json");
    std::os::unix::fs::symlink(&t, &link).unwrap();
    for out in [&t, &link] {
        let o = observer(&["export", "--force", "--chrome-trace", s(out), s(&t)]);
        assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
        assert!(stderr(&o).contains("input"), "{}", stderr(&o));
    }
    assert_eq!(std::fs::read(&t).unwrap(), before);
}

#[test]
fn a_symlinked_output_is_replaced_not_followed() {
    let d = dir("symlink");
    let t = a_trace(&d);
    let precious = d.join("precious");
    std::fs::write(&precious, "keep").unwrap();
    let link = d.join("out.json");
    std::os::unix::fs::symlink(&precious, &link).unwrap();
    let o = observer(&["export", "--chrome-trace", s(&link), s(&t)]);
    assert_eq!(o.status.code(), Some(2), "refused without --force: {}", stderr(&o));
    let o = observer(&["export", "--force", "--chrome-trace", s(&link), s(&t)]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(std::fs::read_to_string(&precious).unwrap(), "keep");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&link).unwrap()).unwrap();
    assert!(v["traceEvents"].is_array());
}

/// Whether `pid` is gone (or a zombie waiting for PID 1).
fn gone(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(s) => s.rsplit_once(") ").is_some_and(|(_, rest)| rest.starts_with('Z')),
    }
}

fn read_pid(p: &Path) -> Option<i32> {
    std::fs::read_to_string(p).ok()?.trim().parse().ok()
}

/// A SIGKILLed observer takes its target with it, and the target's
/// descendants: a child, a child in its own session (`setsid`, out of the
/// process group) and an orphan whose parent exited (a double fork).
#[test]
fn a_killed_observer_leaves_no_target_or_descendant_behind() {
    let d = dir("sigkill");
    let script = format!(
        "echo $$ > {d}/sh; sleep 1000 & echo $! > {d}/child; setsid sleep 1000 & echo $! > {d}/session; \
         (sleep 1000 & echo $! > {d}/orphan.tmp; mv {d}/orphan.tmp {d}/orphan) & wait",
        d = d.display()
    );
    let mut obs = Command::new(OBSERVER)
        .args(["run", "--procfs", "--every", "0", "--", "sh", "-c", &script])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let names = ["sh", "child", "session", "orphan"];
    let t0 = std::time::Instant::now();
    let pids = loop {
        let p: Vec<Option<i32>> = names.iter().map(|n| read_pid(&d.join(n))).collect();
        if p.iter().all(Option::is_some) {
            break p.into_iter().map(Option::unwrap).collect::<Vec<_>>();
        }
        assert!(t0.elapsed().as_secs() < 30, "the script did not start its processes");
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    // The orphan's parent (the subshell) has exited by now or soon; let it.
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert!(pids.iter().all(|&p| !gone(p)), "all four run before the kill");
    obs.kill().unwrap();
    obs.wait().unwrap();
    let t0 = std::time::Instant::now();
    while !pids.iter().all(|&p| gone(p)) && t0.elapsed().as_secs() < 5 {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let left: Vec<(&str, i32)> = names.iter().copied().zip(pids.iter().copied()).filter(|&(_, p)| !gone(p)).collect();
    for &(_, p) in &left {
        // SAFETY: plain kill(2); clean up what the observer left behind.
        unsafe { libc::kill(p, libc::SIGKILL) };
    }
    assert!(left.is_empty(), "still running 5 s after the observer was killed: {left:?}");
}

/// A run that ends normally leaves the guard reaped and the target's
/// leftover children alone (only a dying observer kills).
#[test]
fn a_normal_run_disarms_the_guard() {
    let d = dir("disarm");
    let o = observer(&[
        "run",
        "--procfs",
        "--every",
        "0",
        "--",
        "sh",
        "-c",
        &format!("setsid sleep 30 > /dev/null 2>&1 & echo $! > {}/kid", d.display()),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let kid = read_pid(&d.join("kid")).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(300));
    let alive = !gone(kid);
    // SAFETY: plain kill(2) of the sleep this test started.
    unsafe { libc::kill(kid, libc::SIGKILL) };
    assert!(alive, "a normal end must not kill what the target left running");
}

/// A FIFO (or a directory) as the model or the run is refused at once, by
/// every command that reads one, with what it is; nothing waits for a writer.
#[test]
fn a_fifo_or_a_directory_as_input_is_refused_not_waited_on() {
    let d = dir("fifo");
    let fifo = d.join("model.gguf");
    let c = std::ffi::CString::new(s(&fifo)).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
    // The engine is a sibling binary of the workspace (built by `cargo xtask test`).
    let engine = Path::new(OBSERVER).with_file_name("engine").to_str().unwrap().to_string();
    assert!(Path::new(&engine).exists(), "{engine} missing: run `cargo build --release -p engine`");
    for input in [&fifo, &d] {
        let cases: Vec<Vec<String>> = vec![
            vec![OBSERVER.into(), "report".into(), s(input).into()],
            vec![OBSERVER.into(), "diff".into(), s(input).into(), s(input).into()],
            vec![OBSERVER.into(), "heatmap".into(), s(input).into()],
            vec![OBSERVER.into(), "export".into(), "--chrome-trace".into(), "-".into(), s(input).into()],
            vec![engine.clone(), "inspect".into(), s(input).into()],
            vec![engine.clone(), "run".into(), "-m".into(), s(input).into(), "-p".into(), "hi".into()],
        ];
        for argv in cases {
            let mut child = Command::new(&argv[0])
                .args(&argv[1..])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap();
            let t0 = std::time::Instant::now();
            while child.try_wait().unwrap().is_none() && t0.elapsed().as_secs() < 10 {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            let hung = child.try_wait().unwrap().is_none();
            if hung {
                child.kill().unwrap();
            }
            let o = child.wait_with_output().unwrap();
            assert!(!hung, "{argv:?} still waiting after 10 s");
            let err = stderr(&o);
            assert_ne!(o.status.code(), Some(0), "{argv:?}");
            let kind = if input == &fifo { "FIFO" } else { "a directory" };
            assert!(err.contains(kind) && err.contains(s(input)), "{argv:?}: {err}");
            assert!(!err.contains("panicked") && !err.contains("No such device"), "{argv:?}: {err}");
        }
    }
}

/// An absurd resample count is refused with the bound, not allocated.
#[test]
fn resamples_are_bounded() {
    let d = dir("resamples");
    let t = a_trace(&d);
    for cmd in
        [vec!["report", "--resamples", "1000000000", s(&t)], vec!["diff", "--resamples", "1000000000", s(&t), s(&t)]]
    {
        let o = observer(&cmd);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{cmd:?}: {err}");
        assert!(err.contains("--resamples 1000000000") && err.contains("1000000"), "{err}");
        assert!(!err.contains("panicked") && !err.contains("memory allocation"), "{err}");
    }
}

/// A user error of either binary is one line, without a backtrace even under
/// `RUST_BACKTRACE=1`, and the OS error is said once.
#[test]
fn a_user_error_is_one_line_with_the_os_error_once() {
    let engine = Path::new(OBSERVER).with_file_name("engine");
    for (bin, args) in [
        (engine.as_path(), vec!["inspect", "/no/such/model.gguf"]),
        (engine.as_path(), vec!["run", "-m", "/no/such/model.gguf", "-p", "hi"]),
        (Path::new(OBSERVER), vec!["report", "/no/such/run.trace"]),
    ] {
        let o = Command::new(bin).args(&args).env("RUST_BACKTRACE", "1").output().unwrap();
        let err = stderr(&o);
        let lines: Vec<&str> = err.lines().filter(|l| !l.starts_with("engine: cpu:")).collect();
        assert_ne!(o.status.code(), Some(0), "{args:?}");
        assert_eq!(lines.len(), 1, "{args:?}: {err}");
        assert!(!err.contains("backtrace"), "{args:?}: {err}");
        assert_eq!(err.matches("No such file or directory").count(), 1, "{args:?}: {err}");
    }
}

/// `cat a.trace a.trace` and a CSV with its rows repeated are one run, said so.
#[test]
fn duplicated_runs_and_rows_are_not_merged_quietly() {
    let d = dir("dup");
    let t = a_trace(&d);
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data");
    let csv = std::fs::read_to_string(data.join("bmoe-20260721-090406.csv")).unwrap();
    let rows: Vec<&str> = csv.lines().filter(|l| !l.starts_with('#')).skip(1).collect();
    let dup_csv = d.join("dup.csv");
    std::fs::write(&dup_csv, format!("{csv}{}\n", rows.join("\n"))).unwrap();
    let dup_trace = d.join("dup.trace");
    std::fs::write(&dup_trace, [std::fs::read(&t).unwrap(), std::fs::read(&t).unwrap()].concat()).unwrap();
    let tokens = |p: &Path| {
        let o = observer(&["report", "--json", s(p)]);
        assert!(o.status.success(), "{}", stderr(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let notes = v["notes"].to_string();
        (v, notes)
    };
    let (one, _) = tokens(&t);
    let (two, err) = tokens(&dup_trace);
    assert_eq!(one["summary"], two["summary"], "the joined file reads as its first run");
    assert_eq!(one["tokens"], two["tokens"]);
    assert!(err.contains("holds 2 runs"), "{err}");
    let (orig, _) = tokens(&data.join("bmoe-20260721-090406.csv"));
    let (dup, err) = tokens(&dup_csv);
    assert_eq!(orig["summary"], dup["summary"]);
    assert_eq!(orig["tokens"], dup["tokens"]);
    assert!(err.contains(&format!("{} token records repeat", rows.len())), "{err}");
}

/// A reader of stderr that stalls costs printed lines, never the capture's events, also when the
/// observer has something to say mid-run (`observer::stderr`): here the target `exec`s the engine
/// after a first engine run has filled the stderr pipe with token lines, and the observer says
/// that it samples the model's residency from then on. Before stderr's queue, that diagnostic was
/// written in line with the capture and blocked it behind the full pipe: 6300 of 11 000 steps
/// kept, 9400 events lost. The steps are the engines' own counts of their marked steps.
#[test]
fn a_diagnostic_while_stderr_stalls_does_not_stop_the_capture() {
    let _lock = machine_lock();
    let d = dir("stalled-diagnostic");
    let model = synth_model("tiny-ctx12k.gguf", &["--context", "12256"]);
    let engine = engine_bin();
    let run = |n: u32, out: &str| {
        format!(
            "{} run -m {} -p hi -n {n} --ctx {} --ignore-eos -t 2 > {} 2>&1",
            engine.display(),
            model.display(),
            n + 8,
            d.join(out).display()
        )
    };
    let script = format!("{}; exec {}", run(3000, "first.txt"), run(8000, "second.txt"));
    let json = d.join("run.json");
    let mut obs = Command::new(OBSERVER)
        .args(["run", "--json", s(&json), "--", "sh", "-c", &script])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Nobody reads the observer's stderr until the second engine has said its last line.
    let t0 = std::time::Instant::now();
    while !std::fs::read_to_string(d.join("second.txt")).is_ok_and(|t| t.contains("marked steps")) {
        assert!(t0.elapsed().as_secs() < 120, "the second engine run did not end in 120 s");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let mut err = String::new();
    std::io::Read::read_to_string(&mut obs.stderr.take().unwrap(), &mut err).unwrap();
    let status = obs.wait().unwrap();
    assert!(status.success(), "observer: {status}\n{}", tail(&err));
    assert!(
        err.lines().any(|l| l.contains("mapped") && l.contains("its residency is sampled from now on")),
        "the mid-run diagnostic was said:\n{}",
        tail(&err)
    );
    let marked = |out: &str| -> u64 {
        let text = std::fs::read_to_string(d.join(out)).unwrap();
        let n = text.split(" marked steps").next().and_then(|l| l.rsplit(' ').next()).and_then(|n| n.parse().ok());
        n.unwrap_or_else(|| panic!("no marked steps in {out}: {text}"))
    };
    let steps = marked("first.txt") + marked("second.txt");
    let summary: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let records = summary["tokens"].as_array().unwrap().len() as u64;
    let lost = u(&summary, "lost_events");
    let torn = torn_copies(&err);
    eprintln!(
        "steps {steps} (the engines' own counts), records {records}, events lost {lost}, {torn} of them torn copies"
    );
    assert_eq!(records, steps, "every marked step a record\n{}", tail(&err));
    // A thread copy torn by an update through every attempt is lost whatever stderr does (on a VM
    // the host may preempt a vCPU in the middle of an update; 1 in 11 000 steps in one CI run):
    // counted apart, and bounded. Every other loss would be the capture falling behind.
    assert_eq!(lost, torn, "no event lost but torn thread copies\n{}", tail(&err));
    assert!(torn * 1000 <= steps, "at most one torn thread copy in 1000 steps: {torn}\n{}", tail(&err));
    // And the lines: printed, or counted as not printed.
    let (printed, skipped) = token_lines_printed_and_skipped(&err);
    assert_eq!(printed + skipped, records, "every record printed or counted as not printed");
}

/// The thread copies torn through every attempt, from the observer's closing warning (0 without it).
fn torn_copies(err: &str) -> u64 {
    let line = err.lines().find(|l| l.contains("lost events are thread copies"));
    line.map_or(0, |l| {
        let n = l.split(" of the ").next().and_then(|h| h.rsplit(' ').next()).and_then(|n| n.parse().ok());
        n.unwrap_or_else(|| panic!("a torn-copies line without its count: {l}"))
    })
}

/// The last lines of a long stderr.
fn tail(err: &str) -> String {
    let lines: Vec<&str> = err.lines().filter(|l| !l.starts_with(' ')).collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}
