//! `cargo xtask bench observer`, within runs: what the observer's probes cost the engine in steady
//! state, measured inside one decode, free of the drift between runs. Between-run ratios cannot
//! resolve 1 % on a virtual machine whose speed drifts by several % over seconds; alternating
//! windows of one run can.
//!
//! Spec:
//! - One run: `engine run` (small synthetic model, every core, greedy, enough tokens) and an
//!   ftrace record of its token begins ([`crate::ftrace`]: a uprobe on `moe_engine_token_begin`,
//!   the same in every window) and of the benchmark's own marks, on one clock. After a warm-up,
//!   `C` cycles of: an *off* window of `W` s; `observer run --pid ENGINE` started and waited for
//!   until it says its probes are attached, then `SETTLE` s; an *on* window of `W` s; SIGINT to the
//!   observer and a wait for its exit (detached, nothing left loaded). A last off window closes
//!   the run, then the engine is killed (its speed after that is not used).
//!   The attach and detach themselves (loading and verifying the programs: about 0.4 s of CPU
//!   here) fall between windows: this is the steady-state cost, which `bench observer`'s
//!   between-run ratio cannot see apart from them.
//! - Tokens are put in a window by when they *begin* (never by their duration; see
//!   [`crate::ticklock`]). Window `w` holds `n_w` tokens whose durations sum to `s_w`.
//! - On window `k` sits between off windows `k` and `k + 1`: the pace without the observer
//!   around it is `p_k = (s_k / n_k + s_{k+1} / n_{k+1}) / 2`, the mean of the two off windows'
//!   paces, each window weighted alike (they last as long as the on window, on either side of
//!   it, so a linear drift in time, the slower tokens of a longer context among it, cancels to
//!   first order; pooling their tokens would weigh the faster side more), and its *unit* is
//!   (`n_on · p_k`, `s_on`): the time its tokens would have taken without the observer, and the
//!   time they took. A set of units gives the ratio `Σ n_on · p_k / Σ s_on` (decode speed with the
//!   observer / without it).
//! - The control: the same run with the same windows and waits, but nothing attached (sleeps of
//!   the observed run's attach and detach times stand in for them): A/A, it must hold 1. Rounds
//!   are A-B-B-A (observed, control).
//! - The net ratio: observed / control, over units paired by round and cycle (a round's observed
//!   on window `k` with its control's `k`), with a 95 % percentile bootstrap interval over those
//!   pairs (2000 resamples, fixed seed). Goal: point ≥ 0.995, lower bound ≥ 0.99.
//! - Also printed: the observer's CPU over its on windows (`/proc/PID/stat` utime + stime, all
//!   its threads) as a share of one core, and its attach and detach times.

use std::{
    io::BufRead,
    path::Path,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

use crate::{bench_util, displace, ftrace};

/// Time after the attach message before an on window opens (the first residency scan, the
/// observer's first tokens).
const SETTLE: Duration = Duration::from_millis(500);
/// Time from the engine's start to the first window (model load, prompt).
const WARM_UP: Duration = Duration::from_secs(3);

pub struct Options {
    pub rounds: usize,
    pub cycles: usize,
    pub window: Duration,
    pub threads: usize,
    pub preset: String,
    pub tokens: usize,
}

/// One on window's unit: the time its tokens would have taken at the pace of the off windows
/// around it, and the time they took (seconds), with their count.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Unit {
    pub without_s: f64,
    pub with_s: f64,
    pub tokens: usize,
}

/// The units of one run's record: `marks` are (time, `off K` | `on K` | `end K`).
pub fn units(tokens: &[displace::TokenSpan], marks: &[(f64, String)]) -> Result<Vec<Unit>> {
    // Windows in order: (kind, begin, end).
    let mut windows: Vec<(&str, f64, f64)> = Vec::new();
    let mut open: Option<(&str, f64)> = None;
    for (t, m) in marks {
        let kind = m.split_whitespace().next().unwrap_or("");
        match (kind, open) {
            ("off" | "on", None) => open = Some((kind, *t)),
            ("end", Some((k, b))) => {
                windows.push((k, b, *t));
                open = None;
            }
            _ => bail!("the benchmark's marks are out of order at {t:.6} ({m:?})"),
        }
    }
    let sum = |b: f64, e: f64| {
        tokens.iter().filter(|s| s.begin_s >= b && s.begin_s < e).fold((0usize, 0.0), |(n, d), s| (n + 1, d + s.dur_s))
    };
    let mut out = Vec::new();
    for i in 1..windows.len().saturating_sub(1) {
        let [before, on, after] = [windows[i - 1], windows[i], windows[i + 1]];
        if on.0 != "on" || before.0 != "off" || after.0 != "off" {
            continue;
        }
        let ((n0, s0), (n, s), (n1, s1)) = (sum(before.1, before.2), sum(on.1, on.2), sum(after.1, after.2));
        if n == 0 {
            bail!("a window of {:.1} s held no token (the engine stalled or ended early)", on.2 - on.1);
        }
        if n0 == 0 || n1 == 0 {
            bail!("an off window held no token (the engine stalled or ended early)");
        }
        let pace = (s0 / n0 as f64 + s1 / n1 as f64) / 2.0;
        out.push(Unit { without_s: n as f64 * pace, with_s: s, tokens: n });
    }
    Ok(out)
}

/// `Σ without / Σ with` over `units`.
pub fn ratio<'a>(units: impl IntoIterator<Item = &'a Unit>) -> f64 {
    let (a, b) = units.into_iter().fold((0.0, 0.0), |(a, b), u| (a + u.without_s, b + u.with_s));
    a / b
}

/// What one run gave.
struct Run {
    units: Vec<Unit>,
    /// The observer's attach and detach times (observed runs).
    attach: Vec<Duration>,
    detach: Vec<Duration>,
    /// The observer's CPU over its on windows, and those windows' time.
    observer_cpu: Duration,
    on_time: Duration,
}

/// utime + stime of a process (all its threads) from `/proc/PID/stat`.
fn cpu_of(pid: u32) -> Result<Duration> {
    let p = format!("/proc/{pid}/stat");
    let s = std::fs::read_to_string(&p).with_context(|| format!("reading {p}"))?;
    let rest = s.rsplit_once(')').map(|(_, r)| r).context("no `)` in /proc/PID/stat")?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let field =
        |i: usize, name: &str| f.get(i).and_then(|u| u.parse::<u64>().ok()).with_context(|| format!("{name} in {p}"));
    let ticks = field(11, "utime")? + field(12, "stime")?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
    Ok(Duration::from_nanos(ticks * 1_000_000_000 / hz))
}

/// `observer run --pid PID`, returned once it says its probes are attached (its stderr is then
/// drained by a thread, so it never blocks on it).
fn attach(observer: &Path, pid: u32) -> Result<Child> {
    let mut obs = Command::new(observer)
        .args(["run", "--every", "0", "--pid", &pid.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {}", observer.display()))?;
    let mut err = std::io::BufReader::new(obs.stderr.take().context("the observer's stderr")?);
    let mut seen = String::new();
    loop {
        let mut line = String::new();
        if err.read_line(&mut line).context("reading the observer's stderr")? == 0 {
            let st = obs.wait()?;
            bail!("the observer ended ({st}) before attaching:\n{seen}");
        }
        seen.push_str(&line);
        if line.contains("probes attached") {
            break;
        }
    }
    std::thread::spawn(move || std::io::copy(&mut err, &mut std::io::sink()));
    Ok(obs)
}

fn detach(mut obs: Child) -> Result<()> {
    // SAFETY: kill(2) of our own child.
    unsafe { libc::kill(obs.id() as i32, libc::SIGINT) };
    let st = obs.wait().context("waiting for the observer")?;
    if !st.success() {
        bail!("the observer ended with {st} after SIGINT");
    }
    Ok(())
}

/// One run: observed (`stand_in` is `None`) or the control (sleeps of `stand_in`'s attach and
/// detach times in their place).
fn run(
    o: &Options,
    engine: &Path,
    engine_args: &[String],
    observer: &Path,
    stand_in: Option<(Duration, Duration)>,
) -> Result<Run> {
    let rec = ftrace::Record::start("bench-observer", &[], &ftrace::Marker::token_begin(engine)?)?;
    let mut eng = Command::new(engine)
        .args(engine_args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {}", engine.display()))?;
    let pid = eng.id();
    let result = (|| -> Result<Run> {
        let mut r = Run {
            units: Vec::new(),
            attach: Vec::new(),
            detach: Vec::new(),
            observer_cpu: Duration::ZERO,
            on_time: Duration::ZERO,
        };
        std::thread::sleep(WARM_UP);
        let window = |kind: &str, k: usize| -> Result<Duration> {
            let t = Instant::now();
            rec.mark(&format!("{kind} {k}"))?;
            std::thread::sleep(o.window);
            rec.mark(&format!("end {k}"))?;
            Ok(t.elapsed())
        };
        for k in 0..o.cycles {
            window("off", k)?;
            match stand_in {
                None => {
                    let t = Instant::now();
                    let obs = attach(observer, pid)?;
                    r.attach.push(t.elapsed());
                    std::thread::sleep(SETTLE);
                    let c0 = cpu_of(obs.id())?;
                    r.on_time += window("on", k)?;
                    r.observer_cpu += cpu_of(obs.id())?.saturating_sub(c0);
                    let t = Instant::now();
                    detach(obs)?;
                    r.detach.push(t.elapsed());
                }
                Some((a, d)) => {
                    std::thread::sleep(a + SETTLE);
                    r.on_time += window("on", k)?;
                    std::thread::sleep(d);
                }
            }
        }
        window("off", o.cycles)?;
        if eng.try_wait()?.is_some() {
            bail!("the engine ended before the last window: give it more tokens (-n; {} now)", o.tokens);
        }
        Ok(r)
    })();
    let _ = eng.kill();
    let _ = eng.wait();
    let mut r = result?;
    let text = rec.finish()?;
    let tokens = displace::read(text.as_bytes())?.tokens;
    if tokens.is_empty() {
        bail!("ftrace recorded no token_begin of the engine (the uprobe on moe_engine_token_begin)");
    }
    r.units = units(&tokens, &ftrace::marks(&text))?;
    if r.units.len() != o.cycles {
        bail!("{} of {} on windows could be measured", r.units.len(), o.cycles);
    }
    Ok(r)
}

fn mean(d: &[Duration]) -> Duration {
    d.iter().sum::<Duration>() / d.len().max(1) as u32
}

pub fn main(o: &Options) -> Result<()> {
    let bin = bench_util::build()?;
    let (engine, observer) = (bin.join("engine"), bin.join("observer"));
    // The preset's model with a context for all the tokens (the small preset says 4096: at 85
    // tok/s, 47 s of decode, less than the 6 cycles' 55–60 s on a fast host).
    let context = (o.tokens + 256).to_string();
    let synth = ["--preset", o.preset.as_str(), "--context", context.as_str()];
    let engine_args =
        bench_util::engine_args_for(&engine, &format!("bench-{}-ctx{context}", o.preset), &synth, o.tokens, o.threads)?;
    println!(
        "\nwithin runs: {} ({} threads, up to {} tokens), {} rounds A-B-B-A (observed, control), {} cycles of \
         off {:.1} s / attach / on {:.1} s / detach per run",
        engine_args[2],
        o.threads,
        o.tokens,
        o.rounds,
        o.cycles,
        o.window.as_secs_f64(),
        o.window.as_secs_f64()
    );
    let mut stand_in = None;
    let (mut observed, mut control) = (Vec::new(), Vec::new());
    for round in 0..o.rounds {
        let observe = || run(o, &engine, &engine_args, &observer, None);
        // The control's stand-ins for attach and detach: the last observed run's (a first
        // control, before any observed run, takes 1 s and 0.3 s).
        let ctl = |s: Option<(Duration, Duration)>| {
            let s = s.unwrap_or((Duration::from_secs(1), Duration::from_millis(300)));
            run(o, &engine, &engine_args, &observer, Some(s))
        };
        let times = |a: &Run| Some((mean(&a.attach), mean(&a.detach)));
        let (a, b) = if round % 2 == 0 {
            let a = observe()?;
            stand_in = times(&a);
            let b = ctl(stand_in)?;
            (a, b)
        } else {
            let b = ctl(stand_in)?;
            let a = observe()?;
            stand_in = times(&a);
            (a, b)
        };
        println!(
            "round {round}: observed {:.4} ({} tokens in on windows), control {:.4}; attach {:.2} s, detach {:.2} s, \
             observer CPU {:.2} % of a core in its on windows",
            ratio(&a.units),
            a.units.iter().map(|u| u.tokens).sum::<usize>(),
            ratio(&b.units),
            mean(&a.attach).as_secs_f64(),
            mean(&a.detach).as_secs_f64(),
            100.0 * a.observer_cpu.as_secs_f64() / a.on_time.as_secs_f64()
        );
        observed.push(a);
        control.push(b);
    }
    let pairs: Vec<(Unit, Unit)> =
        observed.iter().zip(&control).flat_map(|(a, b)| a.units.iter().copied().zip(b.units.iter().copied())).collect();
    let net = |pick: &[usize]| ratio(pick.iter().map(|&i| &pairs[i].0)) / ratio(pick.iter().map(|&i| &pairs[i].1));
    let aa = |pick: &[usize]| ratio(pick.iter().map(|&i| &pairs[i].1));
    let seed = 0x7769_7468_696e;
    let ci = |f: &dyn Fn(&[usize]) -> f64| {
        bench_util::bootstrap(pairs.len(), seed, f).context("fewer than two windows to bootstrap over")
    };
    let (c, clo, chi) = ci(&aa)?;
    let (n, lo, hi) = ci(&net)?;
    let cpu: f64 = observed.iter().map(|r| r.observer_cpu.as_secs_f64()).sum::<f64>()
        / observed.iter().map(|r| r.on_time.as_secs_f64()).sum::<f64>();
    println!("control (A/A, nothing attached): {c:.4} [{clo:.4}, {hi_c:.4}] (must hold 1)", hi_c = chi);
    println!("observer's CPU in steady state: {:.2} % of one core", 100.0 * cpu);
    let met = n >= 0.995 && lo >= 0.99;
    println!(
        "observer cost ratio within runs, decode speed with / without, net of the control: {n:.4} [95 % {lo:.4}, \
         {hi:.4}] over {} windows (goal: >= 0.995, lower bound >= 0.99: {})",
        pairs.len(),
        if met { "met" } else { "missed" }
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens(from: f64, to: f64, dur: f64) -> Vec<displace::TokenSpan> {
        let mut v = Vec::new();
        let mut t = from;
        while t < to {
            v.push(displace::TokenSpan { index: v.len() as u64 + 1, begin_s: t, dur_s: dur });
            t += dur;
        }
        v
    }

    fn marks(spec: &[(f64, &str)]) -> Vec<(f64, String)> {
        spec.iter().map(|(t, m)| (*t, m.to_string())).collect()
    }

    #[test]
    fn an_on_window_is_held_against_the_off_windows_around_it() {
        // 10 ms tokens off, 11 ms on: speed with / without = 10/11.
        let mut t = tokens(0.0, 1.0, 0.010);
        t.extend(tokens(1.5, 2.5, 0.011));
        t.extend(tokens(3.0, 4.0, 0.010));
        let m = marks(&[(0.0, "off 0"), (1.0, "end 0"), (1.5, "on 0"), (2.5, "end 0"), (3.0, "off 1"), (4.0, "end 1")]);
        let u = units(&t, &m).unwrap();
        assert_eq!(u.len(), 1);
        assert!((ratio(&u) - 10.0 / 11.0).abs() < 1e-9, "{u:?}");
        // Tokens between windows (attach, detach) count nowhere.
        let mut t2 = t.clone();
        t2.extend(tokens(1.0, 1.5, 0.5));
        assert_eq!(units(&t2, &m).unwrap(), u);
    }

    #[test]
    fn a_linear_drift_cancels() {
        // Token durations grow linearly with time, the same in every window: ratio 1.
        let mut t = Vec::new();
        let mut x = 0.0;
        while x < 6.0 {
            let d = 0.010 + 0.001 * x;
            t.push(displace::TokenSpan { index: t.len() as u64 + 1, begin_s: x, dur_s: d });
            x += d;
        }
        let m = marks(&[(0.0, "off 0"), (2.0, "end 0"), (2.0, "on 0"), (4.0, "end 0"), (4.0, "off 1"), (6.0, "end 1")]);
        let r = ratio(&units(&t, &m).unwrap());
        assert!((r - 1.0).abs() < 2e-3, "{r}");
    }

    #[test]
    fn marks_out_of_order_and_empty_windows_are_errors() {
        let t = tokens(0.0, 1.0, 0.01);
        assert!(units(&t, &marks(&[(0.0, "on 0"), (0.5, "off 0")])).is_err());
        let m = marks(&[(0.0, "off 0"), (1.0, "end 0"), (5.0, "on 0"), (6.0, "end 0"), (6.0, "off 1"), (7.0, "end 1")]);
        assert!(units(&t, &m).is_err(), "an on window without tokens");
    }
}
