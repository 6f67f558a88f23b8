//! End-to-end tests of `observer tui` in a real terminal (tmux): the screen
//! shows token bars while the target runs, a tok/s figure that matches the
//! target's own clock within 5 % (`workload tokens`, and the engine on a
//! synthetic model), the final summary after it exits, replays of recorded
//! traces, and the terminal comes back when the user quits or the observer is
//! signalled. They load probes: root and the machine lock; tmux comes from
//! `cargo xtask setup`.

mod common;

use std::{
    process::Command,
    time::{Duration, Instant},
};

use common::{OBSERVER, Tmux, machine_lock, workload};

/// Token rows of the Tokens view: `   seq g  wall ms  hidden │███…`.
fn bar_rows(screen: &str) -> Vec<&str> {
    common::bar_rows(screen, 'g')
}

/// The number just before `tok/s` on the first line that starts (after
/// spaces) with `label` (the left column of the summary).
fn rate_after(screen: &str, label: &str) -> Option<f64> {
    let line = screen.lines().find(|l| l.trim_start().starts_with(label))?;
    let (before, _) = line.split_once(" tok/s")?;
    before.split_whitespace().last()?.parse().ok()
}

/// The workload's own rate: its JSON lines (`{"kind":"tokens",…,"wall_ns":…}`,
/// one per token, timed by its own clock around the markers) → tokens / Σ wall.
fn workload_rate(output: &str) -> Option<f64> {
    let (mut n, mut wall) = (0u64, 0u64);
    for l in output.lines().filter(|l| l.starts_with('{')) {
        let v: serde_json::Value = serde_json::from_str(l).ok()?;
        if v["kind"] == "tokens" {
            n += 1;
            wall += v["wall_ns"].as_u64()?;
        }
    }
    (wall > 0).then(|| n as f64 * 1e9 / wall as f64)
}

/// What `observer tui` printed after the screen closed (the captured output),
/// sent to `file` by the shell in tmux.
fn printed_after(file: &std::path::Path) -> String {
    std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()))
}

fn assert_within_5_percent(tui: f64, reference: f64, screen: &str) {
    let diff = (tui - reference).abs() / reference;
    eprintln!(
        "TUI {tui:.3} tok/s, the target's own clock {reference:.3} tok/s ({:+.2} %)",
        (tui / reference - 1.0) * 100.0
    );
    assert!(
        diff <= 0.05,
        "TUI {tui:.3} tok/s vs the target's own {reference:.3} tok/s: {:.1} % apart; screen:\n{screen}",
        diff * 100.0
    );
}

#[test]
fn live_screen_shows_bars_then_the_final_rate_matching_the_workload() {
    let _lock = machine_lock();
    let n = 30;
    let out = common::scratch_dir("tui-live").join("after.txt");
    let workload = workload();
    let cmd = format!(
        "{OBSERVER} tui -- {workload} tokens --n {n} --ms 100 2>{}; echo OBSERVER_EXIT=$?; sleep 600",
        out.display()
    );
    let tmux = Tmux::start("tui-live", 130, 48, &cmd);

    let live = tmux.wait("token bars while the target runs", Duration::from_secs(60), |s| {
        s.contains("RUNNING") && bar_rows(s).len() >= 3
    });
    assert!(live.contains("probes") && live.contains("lost 0"), "header:\n{live}");

    let fin = tmux.wait("the final summary", Duration::from_secs(60), |s| s.contains("EXITED 0"));
    assert!(fin.contains("final summary"), "{fin}");
    let tui_rate = rate_after(&fin, "run ").unwrap_or_else(|| panic!("no run tok/s on the final summary:\n{fin}"));
    assert!(fin.contains("95 % interval"), "{fin}");
    // It stays: the screen does not go away by itself.
    std::thread::sleep(Duration::from_millis(1500));
    assert!(tmux.screen().contains("EXITED 0"), "the final summary stays until the user quits");

    tmux.keys("1");
    let bars = tmux.wait("every token in the Tokens view", Duration::from_secs(10), |s| bar_rows(s).len() == n);
    assert!(bars.contains("#29 token: wall"), "detail of the last token:\n{bars}");

    tmux.keys("q");
    let after = tmux.wait("observer to exit", Duration::from_secs(30), |s| s.contains("OBSERVER_EXIT="));
    assert!(after.contains("OBSERVER_EXIT=0"), "{after}");
    assert!(!after.contains("1 Tokens │ 2 Summary"), "the alternate screen is gone:\n{after}");
    // The target's own output, captured while the TUI was up, is printed after it.
    let printed = printed_after(&out);
    let own = workload_rate(&printed).unwrap_or_else(|| panic!("no workload lines printed after the TUI:\n{printed}"));
    assert!(printed.contains("tokens: 30 records"), "the run's end report follows:\n{printed}");
    assert_within_5_percent(tui_rate, own, &fin);
}

#[test]
fn attaches_to_a_pid_and_keeps_the_final_summary_when_it_exits() {
    let _lock = machine_lock();
    let wl = Command::new(workload())
        // The delay lets the observer attach before the first token.
        .args(["tokens", "--n", "40", "--ms", "100", "--delay-ms", "3000"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start workload");
    let pid = wl.id();
    let cmd = format!("{OBSERVER} tui --pid {pid}; echo OBSERVER_EXIT=$?; sleep 600");
    let tmux = Tmux::start("tui-pid", 130, 40, &cmd);
    let live = tmux.wait("token bars of the attached process", Duration::from_secs(60), |s| bar_rows(s).len() >= 5);
    assert!(live.contains(&format!("pid {pid}")), "{live}");
    // An attached process is not our child: its end shows as ENDED.
    let fin = tmux.wait("the final summary", Duration::from_secs(60), |s| s.contains("ENDED"));
    let tui_rate = rate_after(&fin, "run ").unwrap_or_else(|| panic!("no run tok/s on the final summary:\n{fin}"));
    let out = wl.wait_with_output().expect("workload");
    assert!(out.status.success(), "the workload was not disturbed: {:?}", out.status);
    tmux.keys("q");
    let after = tmux.wait("observer to exit", Duration::from_secs(30), |s| s.contains("OBSERVER_EXIT="));
    assert!(after.contains("OBSERVER_EXIT=0"), "{after}");
    let own = workload_rate(&String::from_utf8_lossy(&out.stdout)).expect("workload rate");
    assert_within_5_percent(tui_rate, own, &fin);
}

#[test]
fn quitting_while_the_command_runs_stops_it_and_restores_the_terminal() {
    let _lock = machine_lock();
    let workload = workload();
    let cmd = format!("{OBSERVER} tui -- {workload} tokens --n 1000 --ms 100; echo OBSERVER_EXIT=$?; sleep 600");
    let tmux = Tmux::start("tui-quit", 120, 30, &cmd);
    tmux.wait("a few tokens", Duration::from_secs(60), |s| bar_rows(s).len() >= 3);
    // The screen and output threads yield to the target (SCHED_IDLE, nice 10);
    // the observer's main thread and the target keep the normal class and nice 0.
    let observer = tmux.observer_pid();
    // (policy, nice) of a task: fields 41 and 19 of stat, counted after the `)` that ends comm (state is field 3).
    let sched = |stat_path: String| -> (i64, i64) {
        let stat = std::fs::read_to_string(&stat_path).unwrap_or_else(|e| panic!("{stat_path}: {e}"));
        let f: Vec<i64> =
            stat.rsplit_once(')').unwrap().1.split_whitespace().skip(1).map(|v| v.parse().unwrap_or(-1)).collect();
        (f[41 - 4], f[19 - 4])
    };
    let mut threads = std::collections::BTreeMap::new();
    for t in std::fs::read_dir(format!("/proc/{observer}/task")).unwrap().flatten() {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default().trim().to_string();
        threads.insert(comm, sched(t.path().join("stat").display().to_string()));
    }
    let (normal, idle) = (libc::SCHED_OTHER as i64, libc::SCHED_IDLE as i64);
    assert_eq!(threads.get("observer-tui"), Some(&(idle, 10)), "{threads:?}");
    assert_eq!(threads.get("observer-tui-ou"), Some(&(idle, 10)), "{threads:?}");
    assert_eq!(threads.get("observer"), Some(&(normal, 0)), "{threads:?}");
    let target = std::fs::read_to_string(format!("/proc/{observer}/task/{observer}/children")).unwrap();
    let target = target.split_whitespace().next().expect("the spawned workload");
    assert_eq!(sched(format!("/proc/{target}/stat")), (normal, 0), "the spawned target keeps its class and priority");
    let t0 = Instant::now();
    tmux.keys("q");
    tmux.wait("observer to exit", Duration::from_secs(30), |s| s.contains("OBSERVER_EXIT="));
    assert!(t0.elapsed() < Duration::from_secs(10), "stopping took {:?}", t0.elapsed());
    let after = tmux.history();
    assert!(after.contains("observer tui: stopping the observation"), "{after}");
    assert!(!after.contains("1 Tokens │ 2 Summary"), "the alternate screen is gone:\n{after}");
    // The run's own end-of-run report (stderr captured during the TUI) follows.
    assert!(after.contains("tokens:") && after.contains("records"), "{after}");
}

#[test]
fn clear_errors_without_a_target_a_terminal_or_a_readable_trace() {
    use std::os::unix::process::CommandExt;
    let run = |args: &[&str]| {
        let mut c = Command::new(OBSERVER);
        c.arg("tui").args(args).stdin(std::process::Stdio::null());
        // SAFETY: setsid is async-signal-safe; it detaches the child from our
        // controlling terminal, so it has no /dev/tty.
        unsafe {
            c.pre_exec(|| {
                libc::setsid();
                Ok(())
            });
        }
        let out = c.output().expect("run observer");
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (code, err) = run(&[]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("nothing to observe"), "{err}");
    let (code, err) = run(&["--", "true"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("needs a terminal") && err.contains("observer run"), "{err}");
    let (code, err) = run(&["--replay", "/nonexistent/trace"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--replay: /nonexistent/trace: No such file"), "{err}");
    let junk = common::scratch_dir("tui-replay").join("junk.txt");
    std::fs::write(&junk, "not a trace\n").expect("write junk");
    let (code, err) = run(&["--replay", junk.to_str().unwrap()]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("neither an observer trace"), "{err}");
    let (code, err) = run(&["--refresh", "0", "--", "true"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--refresh"), "{err}");
}

#[test]
fn sigterm_closes_the_final_summary_and_restores_the_terminal() {
    let _lock = machine_lock();
    let workload = workload();
    let cmd = format!("{OBSERVER} tui -- {workload} tokens --n 5 --ms 50; echo OBSERVER_EXIT=$?; sleep 600");
    let tmux = Tmux::start("tui-term", 120, 30, &cmd);
    tmux.wait("the final summary", Duration::from_secs(60), |s| s.contains("EXITED 0"));
    let observer = tmux.observer_pid();
    // SAFETY: plain kill(2) of the observer we started.
    assert_eq!(unsafe { libc::kill(observer, libc::SIGTERM) }, 0);
    let after = tmux.wait("observer to exit", Duration::from_secs(15), |s| s.contains("OBSERVER_EXIT="));
    assert!(after.contains("OBSERVER_EXIT=0"), "{after}");
    assert!(!after.contains("1 Tokens │ 2 Summary"), "the alternate screen is gone:\n{after}");
}

#[test]
fn replays_a_recorded_trace_and_a_truncated_one() {
    let _lock = machine_lock();
    let dir = common::scratch_dir("tui-replay");
    let trace = dir.join("tokens.trace");
    let _ = std::fs::remove_file(&trace);
    let rec = Command::new(OBSERVER)
        .args(["record", "-o"])
        .arg(&trace)
        .args(["--", workload(), "tokens", "--n", "20", "--ms", "50"])
        .output()
        .expect("observer record");
    let stderr = String::from_utf8_lossy(&rec.stderr);
    assert!(rec.status.success(), "observer record failed:\n{stderr}");
    let stdout = String::from_utf8_lossy(&rec.stdout);
    let own = workload_rate(&stdout).unwrap_or_else(|| panic!("no workload lines in:\n{stdout}"));

    let cmd = format!("{OBSERVER} tui --replay {}; echo OBSERVER_EXIT=$?; sleep 600", trace.display());
    let tmux = Tmux::start("tui-replay", 130, 40, &cmd);
    let fin = tmux.wait("the recorded run's final summary", Duration::from_secs(30), |s| s.contains("EXITED 0"));
    let tui_rate = rate_after(&fin, "run ").unwrap_or_else(|| panic!("no run tok/s:\n{fin}"));
    assert_within_5_percent(tui_rate, own, &fin);
    tmux.keys("1");
    tmux.wait("the recorded tokens", Duration::from_secs(10), |s| bar_rows(s).len() == 20);
    tmux.keys("q");
    let after = tmux.wait("observer to exit", Duration::from_secs(10), |s| s.contains("OBSERVER_EXIT="));
    assert!(after.contains("OBSERVER_EXIT=0"), "{after}");
    drop(tmux);

    // Cut inside the last record (the end): every complete record still shows.
    let bytes = std::fs::read(&trace).expect("read trace");
    let cut = dir.join("cut.trace");
    std::fs::write(&cut, &bytes[..bytes.len() - 7]).expect("write cut trace");
    let cmd = format!("{OBSERVER} tui --replay {}; echo OBSERVER_EXIT=$?; sleep 600", cut.display());
    let tmux = Tmux::start("tui-replay-cut", 130, 40, &cmd);
    let s = tmux.wait("the cut trace", Duration::from_secs(30), |s| s.contains("TRACE ENDS (no end record)"));
    assert!(s.contains("no end record"), "{s}");
    tmux.keys("1");
    tmux.wait("the tokens before the cut", Duration::from_secs(10), |s| bar_rows(s).len() == 20);
    tmux.keys("q");
    tmux.wait("observer to exit", Duration::from_secs(10), |s| s.contains("OBSERVER_EXIT=0"));
}

/// `… | generation: N tokens, M steps, R tok/s | …` (the engine's own clock) → R.
fn engine_gen_rate(text: &str) -> Option<f64> {
    let line = text.lines().find(|l| l.contains("generation: ") && l.contains("tok/s"))?;
    let (_, after) = line.split_once("generation: ")?;
    let (before, _) = after.split_once(" tok/s")?;
    before.split_whitespace().last()?.parse().ok()
}

#[test]
fn the_engine_under_the_tui_shows_its_hidden_cost_and_its_own_rate() {
    let _lock = machine_lock();
    let engine = common::engine_bin();
    let model = common::tiny_model();
    let cmd = format!(
        "{OBSERVER} tui -- {} run -m {} -p 'The quick brown fox' -n 64 --ignore-eos -t 2; echo OBSERVER_EXIT=$?; sleep 600",
        engine.display(),
        model.display()
    );
    let tmux = Tmux::start("tui-engine", 130, 48, &cmd);
    // The tiny model decodes its 64 tokens in tens of ms, before the screen
    // could show them live: the bars are checked in the Tokens view of the
    // final screen.
    // The target's own last lines stay in the output pane; the observer's end report does not push
    // them away. (Its output pipe is read apart from its exit: the last line may come a frame later.)
    let fin = tmux.wait("the final summary and the engine's rate line", Duration::from_secs(120), |s| {
        s.contains("EXITED 0") && engine_gen_rate(s).is_some()
    });
    let tui_rate = rate_after(&fin, "run ").unwrap_or_else(|| panic!("no run tok/s:\n{fin}"));
    assert!(fin.contains("engine_compute") && fin.contains("hidden in it"), "{fin}");
    assert!(!fin.contains("where the time went"), "{fin}");
    let hidden = fin.lines().find(|l| l.trim_start().starts_with("hidden in it")).expect("hidden in it");
    let hidden = hidden.split_whitespace().nth(3).expect("its figure").to_string();
    tmux.keys("1");
    let bars = tmux.wait("the engine's token bars", Duration::from_secs(10), |s| bar_rows(s).len() >= 5);
    // The header says the run's rate and the hidden cost on every view: the Summary's figures.
    let header = bars.lines().next().unwrap_or("");
    assert!(
        header.contains(&format!("{tui_rate:.2} tok/s · hidden {hidden} ms/token")),
        "the header vs the Summary's run rate {tui_rate:.2} and hidden {hidden}:\n{bars}"
    );
    // The engine reports its own compute: every bar carries the ┃ marker and a hidden-cost figure.
    for row in bar_rows(&bars) {
        assert!(row.contains('┃'), "no engine-compute marker: {row}");
        let hidden = row.split_whitespace().nth(3).unwrap_or("");
        assert!(hidden.starts_with('+') || hidden.starts_with('−'), "no hidden cost in: {row}");
    }
    tmux.keys("q");
    tmux.wait("observer to exit", Duration::from_secs(30), |s| s.contains("OBSERVER_EXIT="));
    let after = tmux.history();
    assert!(after.contains("OBSERVER_EXIT=0"), "{after}");
    let own = engine_gen_rate(&after).unwrap_or_else(|| panic!("no engine rate printed after the TUI:\n{after}"));
    assert_within_5_percent(tui_rate, own, &fin);
}
