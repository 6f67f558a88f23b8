//! `cargo xtask bench tui`: what the live TUI costs the engine at its default
//! refresh. The same `engine run` (small synthetic model, every core) under
//! `observer run` and under `observer tui`, each in its own tmux server of the
//! same size, A-B-B-A over several rounds in the same run. Both sides carry
//! the same probes, so the difference is the screen's own cost; `bench
//! observer` measures the probes'.
//!
//! Printed:
//! - every round's decode tok/s on both sides (the engine's own `gen_tok_s`)
//!   and their ratio; the medians and their ratio; the geometric mean of the
//!   paired ratios with a 95 % bootstrap interval (target: >= 0.99). On a
//!   virtual machine identical runs differ by several %, so the interval, not
//!   one round, says what was shown; `--control` runs `observer run` on both
//!   sides (A/A) to show what the rounds say when there is no difference.
//!   Each run starts after a seeded random pause of up to 3 s, so that
//!   periodic work of other tasks does not fall on one side.
//! - the screen's CPU: the `observer-tui*` threads plus the terminal (the tmux
//!   server) while the engine ran, from `/proc/*/schedstat`, as a share of one
//!   core; the same terminal figure under `observer run` for comparison. This
//!   is the time the screen can take from the engine and is not subject to
//!   the run-to-run noise.
//! - who kept the engine's threads off a CPU while they were runnable, from
//!   system-wide `sched_switch` events recorded by `perf` over each run
//!   (`displace`). The TUI's direct cost is what its threads, the terminal
//!   and the observer's other threads took under `tui`, minus what the same
//!   took under `run`: measured on the scheduler's own record rather than
//!   inferred from noisy rates. It leaves out indirect costs (caches, the
//!   wake-up latency of a barrier partner).
//! - windows within runs: one long `observer tui` run whose screen is paused
//!   and resumed (the `p` key, through tmux) every second; the engine's own
//!   progress (rows of its `--metrics-csv`, flushed per token) is read at each
//!   switch, and each live window's rate is compared with the mean of the two
//!   paused windows around it, which cancels the drift that makes separate
//!   runs differ. Paused, the TUI still takes in events but draws nothing, so
//!   this isolates drawing and the terminal; the same windows under `observer
//!   run` (where `p` does nothing) are the method's A/A control.

use std::{
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

use crate::{
    bench_util::{self, gen_tok_s, median, paired_ratio_ci},
    cache, cmd, displace,
};

/// One run's numbers.
#[derive(Clone, Debug)]
struct Sample {
    tok_s: f64,
    /// Wall time from the engine's start to its end.
    wall: Duration,
    /// CPU of the observer's TUI threads (screen, output reader).
    screen_ns: u64,
    /// CPU of the tmux server (the terminal) over the same span.
    terminal_ns: u64,
    /// Steal time while the engine ran, in CPUs (0.05 = 5 % of one CPU).
    steal: f64,
    /// Who kept the engine's threads off a CPU (`displace`).
    displaced: displace::Displaced,
}

impl Sample {
    fn share(&self, ns: u64) -> f64 {
        ns as f64 / self.wall.as_nanos() as f64
    }
}

/// A detached tmux server of our own (`-L socket`) running `observer tui|run
/// -- ARGS… REDIRECT` in a 160×45 session `bench`; killed when dropped.
struct Session {
    socket: String,
}

impl Session {
    fn start(socket: String, tui: bool, observer: &Path, args: &[String], redirect: &str) -> Result<Session> {
        let mut line = format!("{} {} --", observer.display(), if tui { "tui" } else { "run --every 0" });
        for a in args {
            line.push_str(&format!(" '{}'", a.replace('\'', "'\\''")));
        }
        line.push_str(redirect);
        let s = Session { socket };
        cmd::run(&mut s.tmux(&["new-session", "-d", "-s", "bench", "-x", "160", "-y", "45", &line]))?;
        Ok(s)
    }

    fn tmux(&self, args: &[&str]) -> Command {
        let mut c = Command::new("tmux");
        c.args(["-L", &self.socket]).args(args);
        c
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        let _ = self.tmux(&["kill-server"]).status();
    }
}

/// `observer tui -- engine …` (or `observer run --every 0 -- engine …` when
/// `!tui`) in a detached tmux server of its own, so that both sides run in the
/// same kind of terminal and the terminal's work can be told apart; the
/// engine's output (printed by the TUI after it restores the terminal) goes
/// to `out`. The engine's end is watched through /proc, not `tmux
/// capture-pane`: a tmux client every half second would load the TUI side only.
fn in_tmux(tui: bool, observer: &Path, engine_cmd: &[String], out: &Path) -> Result<Sample> {
    let _ = std::fs::remove_file(out);
    let sched = SchedRecord::start()?;
    let session = Session::start(
        format!("bench-tui-{}", std::process::id()),
        tui,
        observer,
        engine_cmd,
        &format!(" > {} 2>&1", out.display()),
    )?;
    let result = watch(tui, engine_cmd, &session.socket, &|a| session.tmux(a));
    drop(session);
    let (wall, screen_ns, terminal_ns, steal) = result?;
    let displaced = sched.finish()?;
    let tok_s = gen_tok_s(&std::fs::read_to_string(out).with_context(|| format!("reading {}", out.display()))?)?;
    Ok(Sample { tok_s, wall, screen_ns, terminal_ns, steal, displaced })
}

/// `sched_switch` events of every CPU over one run, in an ftrace instance
/// of our own (removed again), read by [`displace`].
struct SchedRecord {
    dir: std::path::PathBuf,
}

impl SchedRecord {
    fn start() -> Result<SchedRecord> {
        let dir = std::path::PathBuf::from(format!("/sys/kernel/tracing/instances/bench-tui-{}", std::process::id()));
        std::fs::create_dir(&dir).with_context(|| {
            format!("creating the ftrace instance {} (tracefs; `cargo xtask setup` mounts it)", dir.display())
        })?;
        let rec = SchedRecord { dir };
        // 2 x 32 MiB: about 10 minutes of a busy 2-core machine's switches.
        rec.write("buffer_size_kb", "32768")?;
        rec.write("trace_clock", "mono")?;
        rec.write("events/sched/sched_switch/enable", "1")?;
        rec.write("events/sched/sched_migrate_task/enable", "1")?;
        rec.write("events/sched/sched_wakeup/enable", "1")?;
        Ok(rec)
    }

    fn write(&self, file: &str, v: &str) -> Result<()> {
        let p = self.dir.join(file);
        std::fs::write(&p, v).with_context(|| format!("writing {v} to {}", p.display()))
    }

    fn finish(self) -> Result<displace::Displaced> {
        self.write("tracing_on", "0")?;
        let p = self.dir.join("trace");
        let text = std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
        // `# entries-in-buffer/entries-written: 1234/1234`: fewer in the buffer means lost events.
        if let Some(counts) = text.lines().find_map(|l| l.strip_prefix("# entries-in-buffer/entries-written: "))
            && let Some((kept, written)) = counts.split_whitespace().next().and_then(|c| c.split_once('/'))
            && kept != written
        {
            bail!("the ftrace buffer overflowed ({kept} of {written} scheduler events kept)");
        }
        let d = displace::read(text.as_bytes())?;
        if d.span_s <= 0.0 {
            bail!("ftrace recorded no scheduler switch of the engine's threads ({})", p.display());
        }
        Ok(d)
    }
}

impl Drop for SchedRecord {
    fn drop(&mut self) {
        let _ = std::fs::write(self.dir.join("events/sched/sched_switch/enable"), "0");
        let _ = std::fs::write(self.dir.join("events/sched/sched_migrate_task/enable"), "0");
        let _ = std::fs::write(self.dir.join("events/sched/sched_wakeup/enable"), "0");
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// Wait for the engine's start and end, taking the screen's and terminal's
/// CPU as it runs; quit the TUI (which keeps its final summary up) at the end.
fn watch(
    tui: bool,
    engine_cmd: &[String],
    socket: &str,
    tmux: &dyn Fn(&[&str]) -> Command,
) -> Result<(Duration, u64, u64, f64)> {
    let t0 = Instant::now();
    let timeout = |what: &str| -> Result<()> {
        if t0.elapsed() > Duration::from_secs(600) {
            bail!("the {} run: {what} within 10 minutes", if tui { "TUI" } else { "observer run" });
        }
        Ok(())
    };
    let pid = loop {
        if let Some(pid) = find_process(|_, cmdline| cmdline == join0(engine_cmd)) {
            break pid;
        }
        timeout("the engine did not start")?;
        std::thread::sleep(Duration::from_millis(20));
    };
    let start = Instant::now();
    let steal0 = steal_ticks();
    let observer = parent(pid).context("the engine's parent (the observer)")?;
    let server = find_process(|comm, cmdline| {
        comm == "tmux: server" && cmdline.split(|&b| b == 0).any(|a| a == socket.as_bytes())
    })
    .context("the tmux server of the benchmark")?;
    let terminal0 = cpu_ns(server, server).unwrap_or(0);
    let screen0 = screen_cpu_ns(observer);
    let (mut screen, mut terminal) = (screen0, terminal0);
    // The observer reaps its child: /proc/PID goes away (or turns zombie) at the engine's exit.
    while alive(pid) {
        screen = screen_cpu_ns(observer).max(screen);
        terminal = cpu_ns(server, server).unwrap_or(0).max(terminal);
        timeout("the engine did not end")?;
        std::thread::sleep(Duration::from_millis(200));
    }
    let wall = start.elapsed();
    let steal = steal_ticks().zip(steal0).map_or(f64::NAN, |(b, a)| {
        // SAFETY: sysconf has no preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
        (b - a) as f64 / hz / wall.as_secs_f64()
    });
    if tui {
        // Let the TUI take in the end, then quit it.
        std::thread::sleep(Duration::from_millis(500));
        cmd::run(&mut tmux(&["send-keys", "-t", "bench", "q"]))?;
    }
    wait_gone(observer, "the observer")?;
    Ok((wall, screen - screen0, terminal - terminal0, steal))
}

/// Rows of the engine's metrics CSV (one per token, flushed per row) read so
/// far from a file that grows.
struct RowCounter {
    file: Option<std::fs::File>,
    path: std::path::PathBuf,
    rows: u64,
}

impl RowCounter {
    fn count(&mut self) -> u64 {
        use std::io::Read;
        if self.file.is_none() {
            self.file = std::fs::File::open(&self.path).ok();
        }
        if let Some(f) = &mut self.file {
            let mut buf = [0u8; 64 << 10];
            while let Ok(n @ 1..) = f.read(&mut buf) {
                self.rows += buf[..n].iter().filter(|&&b| b == b'\n').count() as u64;
            }
        }
        self.rows
    }
}

/// One window: whether the screen was live, and the engine's tokens per second.
type Window = (bool, f64);

/// One long run (`observer tui` when `tui`, else `observer run`) with the
/// screen paused and resumed every `window` (module doc); the windows'
/// rates, in order, the first one live. Windows start once the decode has
/// made 64 tokens and stop a few windows before its end.
fn windows(
    tui: bool,
    observer: &Path,
    engine_cmd: &[String],
    csv: &Path,
    n_gen: usize,
    window: Duration,
) -> Result<Vec<Window>> {
    let _ = std::fs::remove_file(csv);
    let mut args = engine_cmd.to_vec();
    args.extend(["--metrics-csv".to_string(), csv.display().to_string()]);
    let session =
        Session::start(format!("bench-tui-w-{}", std::process::id()), tui, observer, &args, " > /dev/null 2>&1")?;
    let tmux = |a: &[&str]| session.tmux(a);
    let result = (|| -> Result<Vec<Window>> {
        let mut rows = RowCounter { file: None, path: csv.to_path_buf(), rows: 0 };
        let t0 = Instant::now();
        while rows.count() < 64 {
            if t0.elapsed() > Duration::from_secs(300) {
                bail!("the engine made no 64 tokens within 5 minutes");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let mut out = Vec::new();
        let (mut live, mut at, mut n) = (true, Instant::now(), rows.count());
        loop {
            std::thread::sleep(window.saturating_sub(at.elapsed()));
            let (now, m) = (Instant::now(), rows.count());
            let rate = (m - n) as f64 / (now - at).as_secs_f64();
            // Stop while the engine surely still runs: its last tokens are not a full window.
            if m as f64 + 3.0 * rate * window.as_secs_f64() > n_gen as f64 {
                break;
            }
            out.push((live, rate));
            live = !live;
            (at, n) = (now, m);
            cmd::run(&mut tmux(&["send-keys", "-t", "bench", "p"]))?;
        }
        if tui && !live {
            // Resume, so the end shows.
            cmd::run(&mut tmux(&["send-keys", "-t", "bench", "p"]))?;
        }
        // Wait for the end; then quit the TUI, which keeps its final summary up.
        let pid = find_process(|_, cmdline| cmdline.starts_with(&join0(engine_cmd))).context("the engine")?;
        let observer = parent(pid).context("the engine's parent (the observer)")?;
        wait_gone(pid, "the engine")?;
        if tui {
            std::thread::sleep(Duration::from_millis(500));
            cmd::run(&mut tmux(&["send-keys", "-t", "bench", "q"]))?;
        }
        wait_gone(observer, "the observer")?;
        Ok(out)
    })();
    drop(session);
    result
}

/// Each live window between two paused ones, as a pair (mean of the paused
/// neighbours' rates, live rate), for [`paired_ratio_ci`].
fn live_vs_paused(w: &[Window]) -> Vec<(f64, f64)> {
    w.windows(3).filter(|t| t[1].0 && !t[0].0 && !t[2].0).map(|t| ((t[0].1 + t[2].1) / 2.0, t[1].1)).collect()
}

/// Time the hypervisor ran something else on this machine's virtual CPUs
/// (`steal` of /proc/stat, all CPUs, clock ticks): invisible to the guest's
/// scheduler, it slows the engine all the same.
fn steal_ticks() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    stat.lines().next()?.split_whitespace().nth(8)?.parse().ok()
}

/// Whether `pid` runs (exists and is not a zombie).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|st| st.rsplit_once(')').is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z')))
}

/// Wait (at most a minute) for `pid` to end.
fn wait_gone(pid: u32, what: &str) -> Result<()> {
    let t0 = Instant::now();
    while alive(pid) {
        if t0.elapsed() > Duration::from_secs(60) {
            bail!("{what} (pid {pid}) did not exit within a minute");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

fn join0(args: &[String]) -> Vec<u8> {
    args.iter().flat_map(|a| a.bytes().chain([0])).collect()
}

/// The first process whose comm and command line (NUL-separated) satisfy `f`.
fn find_process(f: impl Fn(&str, &[u8]) -> bool) -> Option<u32> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
        f(comm.trim_end(), &std::fs::read(format!("/proc/{pid}/cmdline")).ok()?).then_some(pid)
    })
}

fn parent(pid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find_map(|l| l.strip_prefix("PPid:")).and_then(|v| v.trim().parse().ok())
}

/// CPU time of thread `tid` of `pid` (ns, first field of schedstat).
fn cpu_ns(pid: u32, tid: u32) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/schedstat")).ok()?.split_whitespace().next()?.parse().ok()
}

/// CPU time of the observer's TUI threads (`observer-tui`, `observer-tui-output`).
fn screen_cpu_ns(observer: u32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{observer}/task")) else { return 0 };
    tasks
        .flatten()
        .filter_map(|t| {
            let tid: u32 = t.file_name().to_str()?.parse().ok()?;
            let comm = std::fs::read_to_string(t.path().join("comm")).ok()?;
            comm.starts_with("observer-tui").then(|| cpu_ns(observer, tid)).flatten()
        })
        .sum()
}

pub fn main(args: &[String]) -> Result<()> {
    let (mut rounds, mut n_gen, mut window_runs) = (10usize, 1024usize, 2usize);
    let mut control = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = |name: &str| it.next().with_context(|| format!("{name} needs a value")).cloned();
        match a.as_str() {
            "--rounds" => rounds = val("--rounds")?.parse()?,
            "-n" => n_gen = val("-n")?.parse()?,
            "--window-runs" => window_runs = val("--window-runs")?.parse()?,
            // A/A: `observer run` on both sides, to see what the rounds show without a screen.
            "--control" => control = true,
            _ => bail!("usage: cargo xtask bench tui [--rounds N] [-n TOKENS] [--window-runs N] [--control]"),
        }
    }
    let bin = bench_util::build()?;
    let (engine, observer) = (bin.join("engine"), bin.join("observer"));
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut engine_cmd = vec![engine.display().to_string()];
    engine_cmd.extend(bench_util::engine_args(&engine, "small", n_gen, threads)?);
    let model = engine_cmd[3].clone();
    let out = cache::dir()?.join("bench-tui.out");
    // A seeded random pause (0–3 s) before every run: periodic work of other
    // tasks (on the development VM, its agent's) would otherwise keep the
    // same phase against the rounds and fall on one side more often (the
    // `--control` A/A run showed a 6 % "cost" between two identical sides).
    let jitter = std::cell::Cell::new(0x6a69_7474_6572u64);
    let pause = || {
        let mut state = jitter.get();
        let ms = bench_util::splitmix64(&mut state) % 3000;
        jitter.set(state);
        std::thread::sleep(Duration::from_millis(ms));
    };
    let under_run = || {
        pause();
        in_tmux(false, &observer, &engine_cmd, &out)
    };
    let under_tui = || {
        pause();
        in_tmux(!control, &observer, &engine_cmd, &out)
    };
    if control {
        println!("control (A/A): `observer run` on both sides; the \"tui\" columns below are a second `observer run`");
    }
    println!(
        "model {model} ({threads} threads, {n_gen} tokens), {rounds} rounds in A-B-B-A order, TUI at its default refresh"
    );
    let mut pairs = Vec::new();
    let top = |d: &displace::Displaced| {
        d.top_others(3).iter().map(|(c, v)| format!("{c} {:.2}", 100.0 * v)).collect::<Vec<_>>().join(", ")
    };
    let (mut screen_share, mut run_terminal_share, mut displaced) = (Vec::new(), Vec::new(), Vec::new());
    for r in 0..rounds {
        let (a, b) = bench_util::abba_round(r, under_run, under_tui)?;
        let share = b.share(b.screen_ns + b.terminal_ns);
        let (da, db) = (&a.displaced, &b.displaced);
        let pct = |d: &displace::Displaced, v: f64| 100.0 * v / d.span_s;
        println!(
            "round {r}: observer run {:.2} tok/s, observer tui {:.2} tok/s, ratio {:.4}\n  \
             CPU: screen {:.0} ms + terminal {:.0} ms in {:.1} s = {:.2} % of a core (terminal under run: {:.2} %)\n  \
             engine kept off a CPU, % of the run, tui (run): screen {:.3} ({:.3}), terminal {:.3} ({:.3}), \
             observer's other threads {:.3} ({:.3}), other tasks {:.2} ({:.2}; most: {} ({}))",
            a.tok_s,
            b.tok_s,
            b.tok_s / a.tok_s,
            b.screen_ns as f64 / 1e6,
            b.terminal_ns as f64 / 1e6,
            b.wall.as_secs_f64(),
            100.0 * share,
            100.0 * a.share(a.terminal_ns),
            pct(db, db.screen_s),
            pct(da, da.screen_s),
            pct(db, db.terminal_s),
            pct(da, da.terminal_s),
            pct(db, db.observer_s),
            pct(da, da.observer_s),
            pct(db, db.other_s),
            pct(da, da.other_s),
            top(db),
            top(da),
        );
        // The TUI's direct cost: its threads and the terminal, plus what more
        // the observer's other threads took under tui than under run (the
        // sink that forwards events to the screen runs on them).
        let ours = |d: &displace::Displaced| (d.screen_s + d.terminal_s + d.observer_s) / d.span_s;
        let cost = ours(db) - ours(da);
        println!(
            "  the TUI's direct cost this round: {:.3} % of the run; hypervisor steal {:.2} % of a CPU under tui ({:.2} % under run)",
            100.0 * cost,
            100.0 * b.steal,
            100.0 * a.steal
        );
        displaced.push(cost);
        pairs.push((a.tok_s, b.tok_s));
        screen_share.push(share);
        run_terminal_share.push(a.share(a.terminal_ns));
    }
    let (mut runs, mut tuis): (Vec<f64>, Vec<f64>) = pairs.iter().copied().unzip();
    let (mr, mt) = (median(&mut runs), median(&mut tuis));
    println!("median: under observer run {mr:.2} tok/s, under observer tui {mt:.2} tok/s, ratio {:.4}", mt / mr);
    match paired_ratio_ci(&pairs) {
        Some((g, lo, hi)) => println!(
            "TUI cost ratio (tui / run), geometric mean of the rounds: {g:.4}, 95 % interval [{lo:.4}, {hi:.4}] (target >= 0.99)"
        ),
        None => println!("TUI cost ratio (tui / run): {:.4} (one round: no interval; target >= 0.99)", mt / mr),
    }
    println!(
        "screen + terminal CPU while the engine ran: median {:.2} % of a core (the terminal alone under observer run: {:.2} %)",
        100.0 * median(&mut screen_share),
        100.0 * median(&mut run_terminal_share)
    );
    println!(
        "the TUI's direct cost (time the screen, the terminal and the observer's extra work kept the engine off a CPU it wanted, \
         tui minus run): median {:.3} % of the run (target < 1 %)",
        100.0 * median(&mut displaced)
    );
    if window_runs == 0 {
        return Ok(());
    }
    // Windows: long runs, so that there are many windows per run.
    let n_long = 3000;
    let mut long_cmd = vec![engine.display().to_string()];
    long_cmd.extend(bench_util::engine_args(&engine, "small", n_long, threads)?);
    let csv = cache::dir()?.join("bench-tui-windows.csv");
    let window = Duration::from_secs(1);
    println!(
        "windows: {window_runs} run(s) of {n_long} tokens under observer tui, the screen paused and resumed every {window:?}; one under observer run as the control"
    );
    let report = |what: &str, pairs: &[(f64, f64)]| match paired_ratio_ci(pairs) {
        Some((g, lo, hi)) => {
            println!("{what}: live / paused {g:.4}, 95 % interval [{lo:.4}, {hi:.4}] over {} live windows", pairs.len())
        }
        None => println!("{what}: too few windows"),
    };
    let mut all = Vec::new();
    for i in 0..window_runs {
        let w = windows(true, &observer, &long_cmd, &csv, n_long, window)?;
        let pairs = live_vs_paused(&w);
        report(&format!("windows, tui run {i}"), &pairs);
        all.extend(pairs);
    }
    let control = live_vs_paused(&windows(false, &observer, &long_cmd, &csv, n_long, window)?);
    report("windows, control (observer run, `p` does nothing)", &control);
    report("TUI drawing cost ratio, windows within runs (target >= 0.99)", &all);
    Ok(())
}
