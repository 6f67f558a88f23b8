//! Who kept the engine off a CPU: a reading of system-wide `sched_switch`
//! events from an ftrace instance's `trace` file (lines like
//! `  tmux: server-7  [001] d..2. 24914.537582: sched_switch: prev_comm=…`).
//! Not `perf record`: while a BPF program on the same tracepoint returns 0
//! (the observer's do), the kernel hands the event to no perf listener; the
//! ftrace ring buffer gets it regardless.
//!
//! Spec:
//! - Each `sched_switch` on CPU c at time t says `next` runs on c from t
//!   until c's next switch.
//! - An engine thread (comm starting with `engine`) is *waiting on CPU c* from
//!   a switch that takes it off c while runnable (`prev_state=R` or `R+`:
//!   preempted), or from a `sched_wakeup` of it on CPU c, until a switch puts
//!   it back on a CPU; a `sched_migrate_task` of it meanwhile moves it to the
//!   destination CPU's queue. Threads that block (sleep, I/O) are not waiting
//!   until they are woken: nothing kept them off a CPU.
//! - A task *displaces* the engine while it runs on a CPU where an engine
//!   thread is waiting. The sum of that time per group of tasks is the CPU
//!   time they took that the engine wanted; with engine threads that meet at a
//!   barrier it is also about the wall time the engine lost to them. A task
//!   running on another CPU (e.g. in the idle time of a thread waiting at the
//!   barrier) displaces nothing.
//! - Groups: `screen` (the TUI's screen thread, comm `observer-tui`),
//!   `reader` (its output reader, `observer-tui-ou…`), `terminal` (`tmux:
//!   server`), `observer` (the observer's other threads), `other` (anything
//!   else but the idle task, also kept per comm). Times are taken from the first to the
//!   last event that names an engine thread.
//! - Tokens: a `token_begin` event (an ftrace uprobe on the engine's
//!   `moe_engine_token_begin(index, …)` marker, printed as `token_begin: (0x…)
//!   index=N`) starts step N; step N ≥ 1 (a generated token; 0 is the prompt)
//!   spans from its begin to the next step's, so the spans cover the decode
//!   loop back to back; the last step (no next begin) is left out.
//! - Ticks: each `sched_wakeup` of the screen thread (it sleeps between the
//!   ticks at which it takes in events and draws).

use std::io::BufRead;

use anyhow::{Context, Result};

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Displaced {
    /// Seconds between the first and the last event naming an engine thread.
    pub span_s: f64,
    pub screen_s: f64,
    pub reader_s: f64,
    pub terminal_s: f64,
    pub observer_s: f64,
    pub other_s: f64,
    /// `other_s` per comm.
    pub others: std::collections::BTreeMap<String, f64>,
    /// The generated tokens' spans, in order (empty without `token_begin` events).
    pub tokens: Vec<TokenSpan>,
    /// Wake-ups of the TUI's screen thread (its ticks), in order.
    pub ticks: Vec<f64>,
}

/// One generated token's span (module spec).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TokenSpan {
    pub index: u64,
    pub begin_s: f64,
    pub dur_s: f64,
}

impl Displaced {
    /// The `n` comms of `others` that took the most, with their share of the span.
    pub fn top_others(&self, n: usize) -> Vec<(String, f64)> {
        let mut v: Vec<(String, f64)> = self.others.iter().map(|(k, s)| (k.clone(), s / self.span_s)).collect();
        v.sort_by(|a, b| b.1.total_cmp(&a.1));
        v.truncate(n);
        v
    }
}

/// The comm of the TUI's screen thread (`observer/src/cmd/tui.rs`); its
/// output reader is `observer-tui-ou(tput)`.
pub const SCREEN_THREAD: &str = "observer-tui";

#[derive(Clone, Copy, Debug, PartialEq)]
enum Group {
    Engine,
    Screen,
    Reader,
    Terminal,
    Observer,
    Other,
    Idle,
}

fn group(comm: &str, pid: u32) -> Group {
    if pid == 0 {
        Group::Idle
    } else if comm.starts_with("engine") {
        Group::Engine
    } else if comm == SCREEN_THREAD {
        Group::Screen
    } else if comm.starts_with(SCREEN_THREAD) {
        Group::Reader
    } else if comm == "tmux: server" {
        Group::Terminal
    } else if comm.starts_with("observer") {
        Group::Observer
    } else {
        Group::Other
    }
}

/// One parsed `sched_switch` line.
struct Switch<'a> {
    cpu: usize,
    prev_comm: &'a str,
    prev_pid: u32,
    preempted: bool,
    next_comm: &'a str,
    next_pid: u32,
}

fn field<'a>(line: &'a str, key: &str, until: &str) -> Option<&'a str> {
    let start = line.find(key)? + key.len();
    let rest = &line[start..];
    Some(match rest.find(until) {
        Some(e) if !until.is_empty() => &rest[..e],
        _ => rest,
    })
}

/// One line of the trace that matters here.
enum Event<'a> {
    /// `sched_migrate_task`: (pid, destination CPU).
    Migrate(u32, usize),
    /// `sched_wakeup` of an engine thread: (pid, target CPU).
    Wakeup(u32, usize),
    Switch(Switch<'a>),
    /// `token_begin` of step `index`.
    Token(u64),
    /// `sched_wakeup` of the screen thread.
    Tick,
}

/// A line's time and event; `None` for other lines (headers, other events,
/// wake-ups of threads that are not the engine's).
fn parse(line: &str) -> Option<(f64, Event<'_>)> {
    // `<comm>-<pid> [CPU] <flags> <seconds>: sched_<event>: <fields>`; comm may hold spaces.
    if let Some(at) = line.find(": token_begin: ") {
        let t = line[..at].rsplit(' ').next()?.parse().ok()?;
        return Some((t, Event::Token(field(&line[at..], " index=", " ")?.trim().parse().ok()?)));
    }
    let at = line.find(": sched_")?;
    let head = &line[..at];
    let t = head.rsplit(' ').next()?.parse().ok()?;
    let name = line[at + 2..].split(": ").next()?;
    // The fields, with the space before the first key (every key is matched with its space).
    let trace = &line[at + 2 + name.len() + 1..];
    let ev = match name {
        "sched_migrate_task" => Event::Migrate(
            field(trace, " pid=", " ")?.parse().ok()?,
            field(trace, " dest_cpu=", " ")?.trim().parse().ok()?,
        ),
        "sched_wakeup" => {
            let pid = field(trace, " pid=", " ")?.parse().ok()?;
            let comm = field(trace, " comm=", " pid=")?;
            if comm == SCREEN_THREAD {
                return Some((t, Event::Tick));
            }
            if group(comm, pid) != Group::Engine {
                return None;
            }
            Event::Wakeup(pid, field(trace, " target_cpu=", " ")?.trim().parse().ok()?)
        }
        // Each field ends where the next key starts.
        "sched_switch" => Event::Switch(Switch {
            cpu: head.rsplit_once('[')?.1.split(']').next()?.trim().parse().ok()?,
            prev_comm: field(trace, " prev_comm=", " prev_pid=")?,
            prev_pid: field(trace, " prev_pid=", " ")?.parse().ok()?,
            preempted: field(trace, " prev_state=", " ")?.starts_with('R'),
            next_comm: field(trace, "==> next_comm=", " next_pid=")?,
            next_pid: field(trace, " next_pid=", " ")?.parse().ok()?,
        }),
        _ => return None,
    };
    Some((t, ev))
}

/// Read an ftrace `trace` file's text (module spec).
pub fn read(input: impl BufRead) -> Result<Displaced> {
    // What runs on each CPU (unknown until its first switch), and where each
    // waiting engine thread is queued; both constant between two events.
    let mut running: Vec<Option<(Group, String)>> = Vec::new();
    let mut waiting: std::collections::HashMap<u32, usize> = std::collections::HashMap::new();
    let mut now = None::<f64>;
    let (mut first, mut last) = (None::<f64>, 0f64);
    let mut d = Displaced::default();
    // The step under way: (index, begin time).
    let mut step = None::<(u64, f64)>;
    for line in input.lines() {
        let line = line.context("reading the ftrace buffer")?;
        let Some((t, ev)) = parse(&line) else { continue };
        // Account the time since the previous event to the state it left.
        if let Some(t0) = now
            && !waiting.is_empty()
        {
            let dt = (t - t0).max(0.0);
            for (cpu, run) in running.iter().enumerate() {
                let Some((g, comm)) = run else { continue };
                if !waiting.values().any(|&c| c == cpu) {
                    continue;
                }
                match g {
                    Group::Screen => d.screen_s += dt,
                    Group::Reader => d.reader_s += dt,
                    Group::Terminal => d.terminal_s += dt,
                    Group::Observer => d.observer_s += dt,
                    Group::Other => {
                        d.other_s += dt;
                        *d.others.entry(comm.clone()).or_default() += dt;
                    }
                    Group::Engine | Group::Idle => {}
                }
            }
        }
        now = Some(t);
        let s = match ev {
            Event::Migrate(pid, cpu) => {
                if let Some(c) = waiting.get_mut(&pid) {
                    *c = cpu;
                }
                continue;
            }
            Event::Wakeup(pid, cpu) => {
                waiting.insert(pid, cpu);
                continue;
            }
            Event::Switch(s) => s,
            Event::Tick => {
                d.ticks.push(t);
                continue;
            }
            Event::Token(index) => {
                if let Some((i, begin)) = step.replace((index, t))
                    && i >= 1
                {
                    d.tokens.push(TokenSpan { index: i, begin_s: begin, dur_s: t - begin });
                }
                continue;
            }
        };
        if running.len() <= s.cpu {
            running.resize(s.cpu + 1, None);
        }
        let (pg, ng) = (group(s.prev_comm, s.prev_pid), group(s.next_comm, s.next_pid));
        if pg == Group::Engine && s.preempted {
            waiting.insert(s.prev_pid, s.cpu);
        }
        if ng == Group::Engine {
            waiting.remove(&s.next_pid);
        }
        if pg == Group::Engine || ng == Group::Engine {
            first.get_or_insert(t);
            last = t;
        }
        running[s.cpu] = Some((ng, s.next_comm.to_string()));
    }
    d.span_s = first.map_or(0.0, |f| last - f);
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sw(cpu: u32, t: f64, prev: (&str, u32, &str), next: (&str, u32)) -> String {
        format!(
            "  {}-{}  [{cpu:03}] d..2. {t:.6}: sched_switch: prev_comm={} prev_pid={} prev_prio=120 prev_state={} ==> next_comm={} next_pid={} next_prio=120\n",
            prev.0, prev.1, prev.0, prev.1, prev.2, next.0, next.1
        )
    }

    #[test]
    fn time_taken_from_a_waiting_engine_thread_is_counted_per_group() {
        let mut s = String::new();
        // CPU 0: the engine runs, is preempted by the terminal for 2 ms, then by the observer for 1 ms.
        s += &sw(0, 10.000, ("swapper/0", 0, "R"), ("engine", 100));
        // CPU 1: the worker runs, blocks (not waiting), the screen thread runs in the idle time.
        s += &sw(1, 10.000, ("swapper/1", 0, "R"), ("engine-worker-1", 101));
        s += &sw(0, 10.010, ("engine", 100, "R"), ("tmux: server", 7));
        s += &sw(1, 10.011, ("engine-worker-1", 101, "S"), ("observer-tui", 8));
        s += &sw(0, 10.012, ("tmux: server", 7, "S"), ("observer", 9));
        s += &sw(0, 10.013, ("observer", 9, "S"), ("engine", 100));
        s += &sw(1, 10.014, ("observer-tui", 8, "S"), ("engine-worker-1", 101));
        s += "# entries-in-buffer/entries-written: 7/7   #P:2\n";
        s += &sw(0, 10.020, ("engine", 100, "R+"), ("kworker/0:1", 20));
        s += &sw(0, 10.023, ("kworker/0:1", 20, "I"), ("engine", 100));
        let d = read(s.as_bytes()).unwrap();
        assert!((d.span_s - 0.023).abs() < 1e-9, "{d:?}");
        assert!((d.others["kworker/0:1"] - 0.003).abs() < 1e-9, "{d:?}");
        assert_eq!(d.top_others(1)[0].0, "kworker/0:1");
        // tmux 10.010–10.012 on the engine's CPU while it waits; observer-tui runs
        // on CPU 1 in the worker's idle time and displaces nothing...
        assert!((d.terminal_s - 0.002).abs() < 1e-9, "{d:?}");
        assert_eq!(d.screen_s, 0.0, "{d:?}");
        assert!((d.observer_s - 0.001).abs() < 1e-9, "{d:?}");
        assert!((d.other_s - 0.003).abs() < 1e-9, "{d:?}");
        // ...unless the waiting thread is moved to its queue.
        let mut m = String::new();
        m += &sw(0, 20.000, ("swapper/0", 0, "R"), ("engine", 100));
        m += &sw(1, 20.000, ("swapper/1", 0, "R"), ("observer-tui", 8));
        m += &sw(0, 20.001, ("engine", 100, "R"), ("kworker/0:1", 20));
        m += "  kworker/0:1-20  [000] d..2. 20.002000: sched_migrate_task: comm=engine pid=100 prio=120 orig_cpu=0 dest_cpu=1\n";
        m += &sw(1, 20.005, ("observer-tui", 8, "R"), ("engine", 100));
        // A woken engine thread waits on its target CPU until it runs.
        m += &sw(1, 20.006, ("engine", 100, "S"), ("observer-tui", 8));
        m += "  tmux: server-7  [000] d..2. 20.007000: sched_wakeup: comm=engine pid=100 prio=120 target_cpu=001\n";
        m += &sw(1, 20.0075, ("observer-tui", 8, "R"), ("engine", 100));
        let d = read(m.as_bytes()).unwrap();
        assert!((d.other_s - 0.001).abs() < 1e-9 && (d.screen_s - 0.0035).abs() < 1e-9, "{d:?}");
    }

    #[test]
    fn a_blocked_engine_is_not_displaced() {
        let mut s = String::new();
        s += &sw(0, 1.0, ("swapper/0", 0, "R"), ("engine", 100));
        s += &sw(0, 1.5, ("engine", 100, "S"), ("tmux: server", 7));
        s += &sw(0, 2.0, ("tmux: server", 7, "S"), ("engine", 100));
        let d = read(s.as_bytes()).unwrap();
        assert_eq!((d.terminal_s, d.span_s), (0.0, 1.0));
    }

    #[test]
    fn tokens_span_from_one_begin_to_the_next_and_ticks_are_the_screen_threads_wakeups() {
        let tb = |t: f64, i: u64| {
            format!("          engine-100     [000] ..... {t:.6}: token_begin: (0x55d0c3a1b2c0) index={i}\n")
        };
        let mut s = String::new();
        s += &sw(0, 1.000, ("swapper/0", 0, "R"), ("engine", 100));
        s += &tb(1.000, 0);
        s += &tb(1.100, 1);
        // Token 1: a kworker takes 1 ms from the waiting engine, the terminal 2 ms.
        s += &sw(0, 1.102, ("engine", 100, "R"), ("kworker/0:1", 20));
        s += &sw(0, 1.103, ("kworker/0:1", 20, "I"), ("tmux: server", 7));
        s += &sw(0, 1.105, ("tmux: server", 7, "S"), ("engine", 100));
        s += &tb(1.110, 2);
        s += "          <idle>-0       [001] dNh2. 1.111000: sched_wakeup: comm=observer-tui pid=8 prio=130 target_cpu=001\n";
        s += "          <idle>-0       [001] dNh2. 1.112000: sched_wakeup: comm=observer-tui-ou pid=9 prio=130 target_cpu=001\n";
        // Token 3 has no next begin and is left out.
        s += &tb(1.118, 3);
        s += &sw(0, 1.125, ("engine", 100, "S"), ("swapper/0", 0));
        let d = read(s.as_bytes()).unwrap();
        let near = |a: f64, b: f64| (a - b).abs() < 1e-9;
        assert_eq!(d.tokens.len(), 2, "{d:?}");
        let (a, b) = (&d.tokens[0], &d.tokens[1]);
        assert!(a.index == 1 && near(a.dur_s, 0.010) && b.index == 2 && near(b.dur_s, 0.008), "{d:?}");
        // Token lines do not disturb the run's accounting.
        assert!(near(d.other_s, 0.001) && near(d.terminal_s, 0.002), "{d:?}");
        assert!(near(a.begin_s, 1.100) && near(b.begin_s, 1.110), "{d:?}");
        // The screen thread's wake-up is a tick; the output reader's is not.
        assert_eq!(d.ticks, vec![1.111]);
    }
}
