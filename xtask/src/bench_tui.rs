//! `cargo xtask bench tui`: what the live TUI costs the engine at its default
//! refresh. The same `engine run` (small synthetic model, every core, 2048
//! tokens) under `observer run` and under `observer tui`, each in its own tmux
//! server of the same size, A-B-B-A over several rounds in the same run, each
//! run after a seeded random pause of up to 3 s (so that periodic work of
//! other tasks does not keep its phase against the rounds). Both sides carry
//! the same probes, so the difference is the screen's own cost; `bench
//! observer` measures the probes'. An ftrace instance records each run: the
//! scheduler's switches, wake-ups and migrations on every CPU and the
//! engine's token begins (an ftrace uprobe on its marker), read by
//! [`displace`].
//!
//! Printed, per round and over the rounds:
//! - Between runs: each side's decode tok/s (the engine's own `gen_tok_s`),
//!   their ratio, and the geometric mean of the paired ratios with a 95 %
//!   bootstrap interval. On a virtual machine whose speed drifts by ±10 %
//!   over seconds, separate runs cannot resolve 1 % (`--control` runs
//!   `observer run` on both sides, A/A, to show what they say with no
//!   difference).
//! - The screen's CPU: the `observer-tui*` threads plus the terminal (the
//!   tmux server) while the engine ran, from `/proc/*/schedstat`, as a share
//!   of one core.
//! - The direct cost, from the scheduler's record: the time the TUI's
//!   threads, the terminal and the observer's other threads kept an engine
//!   thread off a CPU it was queued on, under `tui` minus under `run`; and
//!   the part of it not tied to the screen's ticks (the output reader, and
//!   the observer's extra work forwarding events).
//! - **The cost ratio, within runs** ([`ticklock`]): the screen thread sleeps
//!   between ticks, and the terminal works only on what a frame wrote, so
//!   the engine's token times just around each tick against those in the
//!   rest of the tick's interval give the time the ticks cost it, direct and
//!   indirect (caches, a barrier partner's wait), free of the drift between
//!   runs. The same estimator on the `run` side with ticks at a random phase
//!   is its control and must hold 1. The headline ratio is the tick-locked
//!   one times (1 − the direct cost away from the ticks); target >= 0.99.

use std::{
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use moe_stats::{SplitMix64, median};

use crate::{
    bench_util::{self, gen_tok_s, paired_ratio_ci},
    cache, cmd, displace, ftrace, ticklock,
};

/// Random phases of the control's ticks per `observer run` run: each moves
/// the near windows onto other tokens, so their mean is a steadier control.
const CONTROL_PHASES: usize = 16;

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
    /// Σ token spans / Σ the engine's own step times − 1.
    spans_vs_clock: f64,
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
        // The server may have ended with its session already.
        let _ = self.tmux(&["kill-server"]).stderr(std::process::Stdio::null()).status();
    }
}

/// `observer tui -- engine …` (or `observer run --every 0 -- engine …` when
/// `!tui`) in a detached tmux server of its own, so that both sides run in the
/// same kind of terminal and the terminal's work can be told apart; the
/// engine's output (printed by the TUI after it restores the terminal) goes
/// to `out`. The engine's end is watched through /proc, not `tmux
/// capture-pane`: a tmux client every half second would load the TUI side only.
fn in_tmux(tui: bool, observer: &Path, engine_cmd: &[String], marker: &ftrace::Marker, out: &Path) -> Result<Sample> {
    let _ = std::fs::remove_file(out);
    let sched = ftrace::Record::start("bench-tui", &ftrace::SCHED_EVENTS, marker)?;
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
    let displaced = displaced(sched)?;
    let csv = out.with_extension("csv");
    let clock = std::fs::read_to_string(&csv).with_context(|| format!("reading {}", csv.display()))?;
    let spans_vs_clock = spans_against_the_engines_clock(&displaced.tokens, &clock)?;
    let tok_s = gen_tok_s(&std::fs::read_to_string(out).with_context(|| format!("reading {}", out.display()))?)?;
    Ok(Sample { tok_s, wall, screen_ns, terminal_ns, steal, displaced, spans_vs_clock })
}

/// The token spans that the tick-locked estimate reads (ftrace: uprobe hits
/// on the begin marker) against the engine's own clock for the same steps
/// (`wall_ms` of its `--metrics-csv`): their sums' relative difference. More
/// than 2 % is an error: the spans would not be the engine's tokens.
fn spans_against_the_engines_clock(tokens: &[displace::TokenSpan], csv: &str) -> Result<f64> {
    let wall: std::collections::HashMap<u64, f64> = csv
        .lines()
        .filter(|l| l.starts_with(|c: char| c.is_ascii_digit()))
        .filter_map(|l| {
            let mut f = l.split(',');
            Some((f.next()?.parse().ok()?, f.nth(1)?.parse::<f64>().ok()? / 1e3))
        })
        .collect();
    let (mut spans, mut clock) = (0.0, 0.0);
    for t in tokens {
        let w = wall.get(&t.index).with_context(|| format!("the engine's metrics have no row for step {}", t.index))?;
        spans += t.dur_s;
        clock += w;
    }
    let diff = spans / clock - 1.0;
    if diff.abs() > 0.02 {
        bail!(
            "the token spans from ftrace ({spans:.3} s) and the engine's own clock for the same {} steps ({clock:.3} s) differ by {:.2} %",
            tokens.len(),
            100.0 * diff
        );
    }
    Ok(diff)
}

/// Who kept the engine off a CPU over a record ([`displace`]), which must hold the engine's
/// switches and its tokens.
fn displaced(rec: ftrace::Record) -> Result<displace::Displaced> {
    let d = displace::read(rec.finish()?.as_bytes())?;
    if d.span_s <= 0.0 {
        bail!("ftrace recorded no scheduler switch of the engine's threads");
    }
    if d.tokens.is_empty() {
        bail!("ftrace recorded no token_begin of the engine (the uprobe on moe_engine_token_begin)");
    }
    Ok(d)
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
    let steal0 = testkit::steal_ticks();
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
    let steal = testkit::steal_ticks().zip(steal0).map_or(f64::NAN, |(b, a)| {
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
    let (mut rounds, mut n_gen) = (10usize, 2048usize);
    let mut control = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = |name: &str| it.next().with_context(|| format!("{name} needs a value")).cloned();
        match a.as_str() {
            "--rounds" => rounds = val("--rounds")?.parse()?,
            "-n" => n_gen = val("-n")?.parse()?,
            // A/A: `observer run` on both sides, to see what the rounds show without a screen.
            "--control" => control = true,
            _ => bail!("usage: cargo xtask bench tui [--rounds N] [-n TOKENS] [--control]"),
        }
    }
    let bin = bench_util::build()?;
    let (engine, observer) = (bin.join("engine"), bin.join("observer"));
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut engine_cmd = vec![engine.display().to_string()];
    engine_cmd.extend(bench_util::engine_args(&engine, "small", n_gen, threads)?);
    let model = engine_cmd[3].clone();
    // The engine's output; its per-token metrics go beside it (`.csv`).
    let out = cache::dir()?.join("bench-tui.out");
    engine_cmd.extend([
        "--force".to_string(),
        "--metrics-csv".to_string(),
        out.with_extension("csv").display().to_string(),
    ]);
    let marker = ftrace::Marker::token_begin(&engine)?;
    // A seeded random pause (0–3 s) before every run: periodic work of other
    // tasks (on the development VM, its agent's) would otherwise keep the
    // same phase against the rounds and fall on one side more often (the
    // `--control` A/A run showed a 6 % "cost" between two identical sides).
    let jitter = std::cell::RefCell::new(SplitMix64::new(0x6a69_7474_6572));
    let pause = || {
        let ms = jitter.borrow_mut().next_u64() % 3000;
        std::thread::sleep(Duration::from_millis(ms));
    };
    let under_run = || {
        pause();
        in_tmux(false, &observer, &engine_cmd, &marker, &out)
    };
    let under_tui = || {
        pause();
        in_tmux(!control, &observer, &engine_cmd, &marker, &out)
    };
    if control {
        println!("control (A/A): `observer run` on both sides; the \"tui\" columns below are a second `observer run`");
    }
    println!(
        "model {model} ({threads} threads, {n_gen} tokens), {rounds} rounds in A-B-B-A order, TUI at its default refresh"
    );
    let top = |d: &displace::Displaced| {
        d.top_others(3).iter().map(|(c, v)| format!("{c} {:.2}", 100.0 * v)).collect::<Vec<_>>().join(", ")
    };
    let mut pairs = Vec::new();
    let (mut screen_share, mut run_terminal_share, mut displaced, mut untimed) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut locked, mut locked_control) = (Vec::new(), Vec::new());
    let mut phase = SplitMix64::new(0x7068_6173_6573);
    for r in 0..rounds {
        let (a, b) = bench_util::abba_round(r, under_run, under_tui)?;
        let share = b.share(b.screen_ns + b.terminal_ns);
        let (da, db) = (&a.displaced, &b.displaced);
        let pct = |d: &displace::Displaced, v: f64| 100.0 * v / d.span_s;
        println!(
            "round {r}: observer run {:.2} tok/s, observer tui {:.2} tok/s, ratio {:.4}\n  \
             CPU: screen {:.0} ms + terminal {:.0} ms in {:.1} s = {:.2} % of a core (terminal under run: {:.2} %)\n  \
             engine kept off a CPU, % of the run, tui (run): screen thread {:.3} ({:.3}), output reader {:.3} ({:.3}), \
             terminal {:.3} ({:.3}), observer's other threads {:.3} ({:.3}), other tasks {:.2} ({:.2}; most: {} ({}))",
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
            pct(db, db.reader_s),
            pct(da, da.reader_s),
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
        let ours = |d: &displace::Displaced| (d.screen_s + d.reader_s + d.terminal_s + d.observer_s) / d.span_s;
        let cost = ours(db) - ours(da);
        // What of it is not tied to the screen's ticks: the output reader and the forwarding.
        let off_tick = (db.reader_s / db.span_s) + (db.observer_s / db.span_s - da.observer_s / da.span_s);
        // Ticks: the screen thread's wake-ups under tui; where they would have
        // been under run (the same period, a random phase), as the control.
        let mut gaps: Vec<f64> = db.ticks.windows(2).map(|w| w[1] - w[0]).collect();
        let period = if control { tui::term::DEFAULT_REFRESH.as_secs_f64() } else { median(&mut gaps) };
        if period.is_nan() || period <= 0.0 {
            bail!("round {r}: ftrace recorded fewer than two wake-ups of the TUI's screen thread");
        }
        let ticks = if control { ticklock::pseudo_ticks(&db.tokens, period, &mut phase) } else { db.ticks.clone() };
        let lb = ticklock::excess(&db.tokens, &ticks);
        let mut la = ticklock::Excess::default();
        for _ in 0..CONTROL_PHASES {
            la.add(&ticklock::excess(&da.tokens, &ticklock::pseudo_ticks(&da.tokens, period, &mut phase)));
        }
        let lost = |e: &ticklock::Excess| 100.0 * e.lost_s / e.interval_s;
        println!(
            "  the TUI's direct cost this round: {:.3} % of the run ({:.3} % not at its ticks); hypervisor steal {:.2} % of a CPU under tui ({:.2} % under run)\n  \
             tick-locked: {} ticks (every {:.0} ms) under tui, {:.3} % of the time lost near them; control under run ({CONTROL_PHASES} random phases): {} ticks, {:.3} %\n  \
             token spans (ftrace) against the engine's own clock for the same steps: {:+.3} % under tui, {:+.3} % under run",
            100.0 * cost,
            100.0 * off_tick,
            100.0 * b.steal,
            100.0 * a.steal,
            lb.ticks,
            1e3 * period,
            lost(&lb),
            la.ticks,
            lost(&la),
            100.0 * b.spans_vs_clock,
            100.0 * a.spans_vs_clock,
        );
        displaced.push(cost);
        untimed.push(off_tick);
        locked.push(lb);
        locked_control.push(la);
        pairs.push((a.tok_s, b.tok_s));
        screen_share.push(share);
        run_terminal_share.push(a.share(a.terminal_ns));
    }
    let (mut runs, mut tuis): (Vec<f64>, Vec<f64>) = pairs.iter().copied().unzip();
    let (mr, mt) = (median(&mut runs), median(&mut tuis));
    println!("median: under observer run {mr:.2} tok/s, under observer tui {mt:.2} tok/s, ratio {:.4}", mt / mr);
    match paired_ratio_ci(&pairs) {
        Some((g, lo, hi)) => println!(
            "between runs: decode speed ratio (tui / run), geometric mean of the rounds: {g:.4}, 95 % interval [{lo:.4}, {hi:.4}] \
             (separate runs; on a VM whose speed drifts by several % this cannot resolve 1 %)"
        ),
        None => println!("between runs: decode speed ratio (tui / run): {:.4} (one round: no interval)", mt / mr),
    }
    println!(
        "screen + terminal CPU while the engine ran: median {:.2} % of a core (the terminal alone under observer run: {:.2} %)",
        100.0 * median(&mut screen_share),
        100.0 * median(&mut run_terminal_share)
    );
    let untimed = median(&mut untimed).max(0.0);
    println!(
        "the TUI's direct cost (time the screen, the terminal and the observer's extra work kept the engine off a CPU it wanted, \
         tui minus run): median {:.3} % of the run, of which {:.3} % not at its ticks",
        100.0 * median(&mut displaced),
        100.0 * untimed,
    );
    let profile = ticklock::pooled_profile(&locked);
    println!(
        "tick-locked profile under tui (mean excess ms per token, by when it began, ms from the tick; near window [{:.0}, {:.0})):\n  {}",
        -1e3 * ticklock::LEAD,
        1e3 * ticklock::NEAR,
        profile.iter().map(|(at, v)| format!("{:.0}:{:+.3}", 1e3 * at, 1e3 * v)).collect::<Vec<_>>().join(" ")
    );
    let Some((c, clo, chi)) = ticklock::ratio(&locked_control) else { bail!("no tick-locked control: too few ticks") };
    println!(
        "tick-locked control (observer run, ticks at random phases): ratio {c:.4}, 95 % interval [{clo:.4}, {chi:.4}] (should hold 1)"
    );
    let Some((g, lo, hi)) = ticklock::ratio(&locked) else { bail!("no tick-locked estimate: too few ticks") };
    println!(
        "tick-locked under tui: decode speed ratio with the screen's ticks / without, {g:.4}, 95 % interval [{lo:.4}, {hi:.4}]"
    );
    let Some((g, lo, hi)) = ticklock::net_ratio(&locked, &locked_control) else { bail!("no tick-locked estimate") };
    println!("tick-locked, net of the control: {g:.4}, 95 % interval [{lo:.4}, {hi:.4}]");
    println!(
        "TUI cost ratio (tick-locked net of the control, times the {:.3} % of direct cost away from the ticks): {:.4}, 95 % interval [{:.4}, {:.4}] (target >= 0.99)",
        100.0 * untimed,
        g * (1.0 - untimed),
        lo * (1.0 - untimed),
        hi * (1.0 - untimed),
    );
    Ok(())
}
