//! The end-of-run summary: what `observer run` prints at the end and writes
//! with `--json`, and what `observer report` prints for a trace. Names follow
//! the design's vocabulary (`majflt`, `minflt`, `fault_ns`, …); times are
//! nanoseconds in data, milliseconds/microseconds on screen.
//!
//! Rule: the summary is a function of the model stream alone ([`Collector`]),
//! so a live run and its trace give the same table:
//! - target, mode, kernel and probes from the `header`; exit code and lost
//!   events from the `end`; the duration is `end.mono_ns − header.started_mono_ns`;
//! - the fault table, per-thread attribution and block reads from the
//!   `totals` event (none in the procfs fallback: faults not probed);
//! - per-process rows: the threads' totals summed by process (a wrapper and
//!   the engine it starts, a server and its workers), the process named by its
//!   main thread (TID = PID) when that was seen, else by its first thread;
//!   printed when more than one process was observed;
//! - latency histograms from the last `histograms` event, the observer's
//!   cost from the last `health` event;
//! - the per-token summary from the token records (the newest `keep` of them).

use std::io::Write;

use observer_common::{
    HIST_BUCKETS,
    hist::bucket_upper_ns,
    model::{
        Component, Counter, DeviceReads, Event, FaultTotals, LatencyHistograms, ObserverHealth, ProcessEvictions,
        ProgramCost, RunEnd, RunHeader, RunTotals, ThreadTime, TokenRecord,
    },
};
use serde::Serialize;

use crate::analysis::attribution;

#[derive(Debug, Clone, Default, Serialize)]
pub struct FaultCounts {
    pub majflt: u64,
    pub minflt: u64,
    /// Time inside faults (entry to exit, on and off CPU).
    pub fault_ns: u64,
    pub majflt_ns: u64,
    pub minflt_ns: u64,
    /// Fault entries never matched by an exit (failed faults).
    pub unmatched_entries: u64,
    /// Fault exits with no recorded entry (counted, without time).
    pub unmatched_exits: u64,
    /// Minor faults taken untimed in fault storms (`observer_common::faults`): in `minflt`, their
    /// time estimated.
    pub minflt_untimed: u64,
}

impl FaultCounts {
    /// Add another row's counts (a process's threads summed).
    fn merge(&mut self, o: &FaultCounts) {
        self.majflt += o.majflt;
        self.minflt += o.minflt;
        self.fault_ns += o.fault_ns;
        self.majflt_ns += o.majflt_ns;
        self.minflt_ns += o.minflt_ns;
        self.unmatched_entries += o.unmatched_entries;
        self.unmatched_exits += o.unmatched_exits;
        self.minflt_untimed += o.minflt_untimed;
    }

    fn add(&mut self, t: &FaultTotals) {
        self.majflt += t.majflt;
        self.minflt += t.minflt;
        self.majflt_ns += t.majflt_ns;
        self.minflt_ns += t.minflt_ns;
        self.fault_ns += t.majflt_ns + t.minflt_ns;
        self.unmatched_entries += t.unmatched_entries;
        self.unmatched_exits += t.unmatched_exits;
        self.minflt_untimed += t.minflt_untimed;
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct ThreadRow {
    pub tid: u32,
    /// Its process (0: not known).
    pub pid: u32,
    pub comm: String,
    #[serde(flatten)]
    pub counts: FaultCounts,
    pub majflt_hist: Histogram,
    pub minflt_hist: Histogram,
    /// Where this thread's time went since it was first seen (see `attrib`).
    pub attribution: Option<ThreadTime>,
    /// Exited threads added to this row besides the one `tid` names
    /// (`observer_common::totals`, `folded`).
    #[serde(skip_serializing_if = "observer_common::totals::is_zero")]
    pub folded: u32,
}

impl ThreadRow {
    /// The row's name: its thread's, and how many more it holds.
    fn name(&self) -> String {
        match self.folded {
            0 => self.comm.clone(),
            n => format!("{} (+{n} exited)", self.comm),
        }
    }
}

/// One process's threads, summed (module rule).
#[derive(Debug, Clone, Serialize)]
pub struct ProcessRow {
    pub pid: u32,
    pub comm: String,
    pub threads: u32,
    #[serde(flatten)]
    pub counts: FaultCounts,
    /// Σ of its threads' attribution (`wall_ns` is thread-time: a sum over threads).
    pub attribution: Option<ThreadTime>,
}

impl ProcessRow {
    fn of(threads: &[ThreadRow]) -> Vec<ProcessRow> {
        let mut rows: Vec<ProcessRow> = Vec::new();
        for t in threads {
            let i = match rows.iter().position(|p| p.pid == t.pid) {
                Some(i) => i,
                None => {
                    rows.push(ProcessRow {
                        pid: t.pid,
                        comm: t.comm.clone(),
                        threads: 0,
                        counts: FaultCounts::default(),
                        attribution: None,
                    });
                    rows.len() - 1
                }
            };
            let p = &mut rows[i];
            p.threads += 1 + t.folded;
            if t.tid == t.pid {
                p.comm = t.comm.clone();
            }
            p.counts.merge(&t.counts);
            if let Some(a) = &t.attribution {
                match &mut p.attribution {
                    None => p.attribution = Some(a.clone()),
                    Some(sum) => sum.add(a),
                }
            }
        }
        rows.sort_by_key(|p| p.pid);
        rows
    }
}

/// A log2 histogram, buckets as in `observer_common::hist`: `le_ns` is the
/// inclusive upper bound, `null` for +Inf. Counts are per bucket (not cumulative).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Histogram {
    pub buckets: Vec<Bucket>,
    pub count: u64,
    /// Exact sum of the values, when it was kept (the kernel's latency histograms).
    pub sum_ns: Option<u64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Bucket {
    pub le_ns: Option<u64>,
    pub count: u64,
}

impl Histogram {
    /// From per-bucket counts (`observer_common::hist` buckets; missing ones are 0).
    pub fn from_counts(c: &[u64]) -> Self {
        let mut h = Histogram::default();
        h.add(c);
        h
    }
    fn add(&mut self, c: &[u64]) {
        if self.buckets.is_empty() {
            self.buckets = (0..HIST_BUCKETS).map(|b| Bucket { le_ns: bucket_upper_ns(b), count: 0 }).collect();
        }
        for (dst, &n) in self.buckets.iter_mut().zip(c.iter()) {
            dst.count += n;
            self.count += n;
        }
    }
}

/// Block reads the target caused on one device.
#[derive(Debug, Clone, Serialize)]
pub struct DeviceRow {
    /// `major:minor`.
    pub dev: String,
    /// Kernel name (`vda`, `zram0`, …) when known.
    pub name: Option<String>,
    pub read_bytes: u64,
    pub read_ios: u64,
    /// Σ queue→complete latency over the reads whose completion was matched.
    pub read_ns: u64,
    pub completed: u64,
}

impl DeviceRow {
    pub fn new(d: &DeviceReads) -> Self {
        DeviceRow {
            dev: d.dev.clone(),
            name: d.name.clone(),
            read_bytes: d.read_bytes,
            read_ios: d.read_ios,
            read_ns: d.read_ns,
            completed: d.completed,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct TargetInfo {
    pub pid: u32,
    pub command: Vec<String>,
    /// Exit code when the observer spawned it and it exited.
    pub exit_code: Option<i32>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub observer_version: &'static str,
    /// `ebpf`, or `procfs` for the fallback (most fields not measured).
    pub mode: String,
    pub kernel: String,
    pub target: TargetInfo,
    pub duration_ns: u64,
    pub probes: Vec<String>,
    /// What the run could not measure, and why (`RunHeader::degraded`, with
    /// those found during the run): each `FEATURE: WHY`.
    pub degraded: Vec<String>,
    /// Fault bracketing totals; `None` when faults were not probed (procfs fallback).
    pub totals: Option<FaultCounts>,
    pub majflt_hist: Option<Histogram>,
    pub minflt_hist: Option<Histogram>,
    pub threads: Vec<ThreadRow>,
    /// The threads' totals by process (module rule), by PID.
    pub processes: Vec<ProcessRow>,
    /// Events the kernel side could not record (full maps, full ring buffers).
    pub lost_events: u64,
    /// Latency histograms by kind (`vocab::HISTOGRAMS`: `minflt`,
    /// `majflt_file`, `majflt_swap`, `zram_read`, `disk_read`).
    pub latency: std::collections::BTreeMap<String, Histogram>,
    /// The target's block reads per device.
    pub devices: Vec<DeviceRow>,
    /// Who evicted the model file's pages over the run, per process (`model::ProcessEvictions`:
    /// the processes with the most pages, the rest in one `other` row per kind), when eviction
    /// blame was measured: the run's totals, else the last process sample that had them.
    pub evicted_by_process: Vec<ProcessEvictions>,
    /// The observer's own cost: run time and run count of its eBPF programs
    /// (all processes' events, since filtering happens inside them), when the
    /// kernel's BPF statistics are available.
    pub bpf_run_ns: Option<u64>,
    pub bpf_run_count: Option<u64>,
    /// The same per program (`name`, `run_ns`, `runs`), by name; empty when not measured.
    pub bpf_programs: Vec<ProgramCost>,
    /// Whole-run attribution summed over threads.
    pub attribution_totals: Option<ThreadTime>,
    /// Per-token summary (when tokens were marked or windows used).
    pub attribution: Option<attribution::Summary>,
    /// Every token record, in order (the newest ones when `tokens_not_kept` > 0).
    pub tokens: Vec<TokenRecord>,
    /// Older token records left out of `tokens` and the per-token summary.
    pub tokens_not_kept: u64,
}

impl Summary {
    /// The summary of a run from what [`Collector`] kept of its stream (module rule).
    fn from_stream(c: &Collector) -> Self {
        let header = c.header.clone().unwrap_or_default();
        let end = c.end.clone().unwrap_or_default();
        let mut s = Summary {
            observer_version: env!("CARGO_PKG_VERSION"),
            mode: header.mode,
            kernel: header.kernel,
            target: TargetInfo { pid: header.target_pid, command: header.target_command, exit_code: end.exit_code },
            duration_ns: end.mono_ns.saturating_sub(header.started_mono_ns),
            probes: header.probes,
            degraded: header.degraded,
            totals: None,
            majflt_hist: None,
            minflt_hist: None,
            threads: Vec::new(),
            processes: Vec::new(),
            lost_events: end.lost_events,
            latency: Default::default(),
            devices: Vec::new(),
            evicted_by_process: c.evicted_by_process.clone(),
            bpf_run_ns: c.health.as_ref().and_then(|h| h.bpf_run_ns),
            bpf_run_count: c.health.as_ref().and_then(|h| h.bpf_run_count),
            bpf_programs: c.health.as_ref().map(|h| h.bpf_programs.clone()).unwrap_or_default(),
            attribution_totals: None,
            attribution: None,
            tokens: c.tokens.clone(),
            tokens_not_kept: c.tokens_not_kept,
        };
        if let Some(t) = &c.totals {
            s.add_totals(t);
        }
        if let Some(h) = &c.latency {
            for (name, counts) in &h.kinds {
                let mut hist = Histogram::from_counts(counts);
                hist.sum_ns = h.sum_ns.get(name).copied();
                s.latency.insert(name.clone(), hist);
            }
        }
        if !s.tokens.is_empty() {
            s.attribution = Some(attribution::summarise(&s.tokens));
        }
        s
    }

    /// The fault table, the per-thread attribution and the block reads.
    fn add_totals(&mut self, run: &RunTotals) {
        let mut totals = FaultCounts::default();
        let mut maj = Histogram::default();
        let mut min = Histogram::default();
        let mut all: Option<ThreadTime> = None;
        for t in &run.threads {
            let mut counts = FaultCounts::default();
            if let Some(f) = &t.faults {
                totals.add(f);
                maj.add(&f.majflt_hist);
                min.add(&f.minflt_hist);
                counts.add(f);
            }
            let attribution = t.time.clone();
            if let Some(a) = &attribution {
                match &mut all {
                    None => all = Some(a.clone()),
                    Some(sum) => sum.add(a),
                }
            }
            let hist = |h: Option<&Vec<u64>>| Histogram::from_counts(h.map_or(&[][..], |v| v));
            self.threads.push(ThreadRow {
                tid: t.tid,
                pid: t.pid,
                comm: t.comm.clone(),
                counts,
                majflt_hist: hist(t.faults.as_ref().map(|f| &f.majflt_hist)),
                minflt_hist: hist(t.faults.as_ref().map(|f| &f.minflt_hist)),
                attribution,
                folded: t.folded,
            });
        }
        self.threads.sort_by_key(|r| r.tid);
        self.processes = ProcessRow::of(&self.threads);
        if maj.buckets.is_empty() {
            maj.add(&[]);
            min.add(&[]);
        }
        self.totals = Some(totals);
        self.majflt_hist = Some(maj);
        self.minflt_hist = Some(min);
        self.attribution_totals = all;
        self.devices = run.devices.iter().map(DeviceRow::new).collect();
    }

    /// The human table.
    pub fn print(&self, out: &mut impl Write) -> std::io::Result<()> {
        let secs = self.duration_ns as f64 / 1e9;
        let cmd = self.target.command.first().map(String::as_str).unwrap_or("?");
        if let Some(totals) = &self.totals {
            writeln!(
                out,
                "observer: pid {} ({}) observed for {:.3} s, {} thread(s) faulted",
                self.target.pid,
                cmd,
                secs,
                self.threads.iter().filter(|t| t.counts.majflt + t.counts.minflt > 0).count()
            )?;
            writeln!(
                out,
                "{:>8}  {:<16} {:>10} {:>10} {:>11} {:>11} {:>11}",
                "tid", "comm", "majflt", "minflt", "fault ms", "maj avg µs", "min avg µs"
            )?;
            let line = |out: &mut dyn Write, tid: &str, comm: &str, c: &FaultCounts| {
                writeln!(
                    out,
                    "{:>8}  {:<16} {:>10} {:>10} {:>11.2} {:>11} {:>11}",
                    tid,
                    comm,
                    c.majflt,
                    c.minflt,
                    c.fault_ns as f64 / 1e6,
                    avg_us(c.majflt_ns, c.majflt),
                    avg_us(c.minflt_ns, c.minflt),
                )
            };
            for t in self.threads.iter().filter(|t| t.counts.majflt + t.counts.minflt > 0) {
                line(out, &t.tid.to_string(), &t.name(), &t.counts)?;
            }
            line(out, "total", "", totals)?;
            for (name, h) in [("major", &self.majflt_hist), ("minor", &self.minflt_hist)] {
                let Some(h) = h else { continue };
                if h.count == 0 {
                    continue;
                }
                writeln!(out, "{name}-fault latency ({} faults):", h.count)?;
                print_hist(out, h)?;
            }
            if totals.minflt_untimed > 0 {
                writeln!(
                    out,
                    "sampled: {} of {} minor faults came in fault storms and were counted but not timed \
                     (1 in {} timed; their time and histogram counts are estimated from those)",
                    totals.minflt_untimed,
                    totals.minflt,
                    observer_common::attrib::STORM_SAMPLE
                )?;
            }
            if totals.unmatched_entries + totals.unmatched_exits > 0 {
                writeln!(
                    out,
                    "unmatched: {} fault entries without exit (failed faults), {} exits without entry",
                    totals.unmatched_entries, totals.unmatched_exits
                )?;
            }
        } else {
            writeln!(
                out,
                "observer: pid {} ({}) observed for {:.3} s in {} mode (faults not probed)",
                self.target.pid, cmd, secs, self.mode
            )?;
        }
        let with_attr: Vec<&ThreadRow> = self.threads.iter().filter(|t| t.attribution.is_some()).collect();
        if !with_attr.is_empty() {
            writeln!(out, "where the time went (ms, whole run, per thread; - not measured):")?;
            let mut h = format!("{:>8}  {:<16} {:>9}", "tid", "comm", "wall");
            for c in Component::measured() {
                h.push_str(&format!(" {:>9}", c.short()));
            }
            writeln!(out, "{h}")?;
            let row = |out: &mut dyn Write, tid: &str, comm: &str, a: &ThreadTime| {
                let mut l = format!("{:>8}  {:<16} {:>9.1}", tid, comm, a.wall_ns as f64 / 1e6);
                for c in Component::measured() {
                    match a.components.get(c) {
                        Some(v) => l.push_str(&format!(" {:>9.1}", v as f64 / 1e6)),
                        None => l.push_str(&format!(" {:>9}", "-")),
                    }
                }
                writeln!(out, "{l}")
            };
            for t in &with_attr {
                if let Some(a) = &t.attribution {
                    row(out, &t.tid.to_string(), &t.name(), a)?;
                }
            }
            if self.processes.len() > 1 {
                writeln!(out, "per process (Σ of its threads):")?;
                for p in &self.processes {
                    if let Some(a) = &p.attribution {
                        let comm = format!("{} ({} thr)", p.comm, p.threads);
                        row(out, &format!("pid {}", p.pid), &comm, a)?;
                    }
                }
            }
            if let Some(a) = &self.attribution_totals {
                row(out, "total", "", a)?;
                writeln!(
                    out,
                    "major faults: {} file, {} swap; swap-ins: {} pages; read: {:.1} MB in {} bios",
                    a.counter(Counter::MajfltFile),
                    a.counter(Counter::MajfltSwap),
                    a.counter(Counter::Swapins),
                    a.counter(Counter::ReadBytes) as f64 / 1e6,
                    a.read_ios
                )?;
            }
        }
        for d in &self.devices {
            writeln!(
                out,
                "block reads on {} ({}): {:.1} MB in {} requests, mean latency {}",
                d.name.as_deref().unwrap_or("?"),
                d.dev,
                d.read_bytes as f64 / 1e6,
                d.read_ios,
                d.read_ns.checked_div(d.completed).map_or_else(|| "-".into(), fmt_ns)
            )?;
        }
        if !self.evicted_by_process.is_empty() {
            writeln!(out, "who evicted the model file's pages (per process, most first):")?;
            for r in &self.evicted_by_process {
                let pid = if r.pid == 0 { "-".to_string() } else { r.pid.to_string() };
                writeln!(out, "  {:<18} {:>7} {:<16} {:>10} pages", r.kind, pid, r.comm, r.pages)?;
            }
        }
        if let Some(a) = &self.attribution {
            a.print(out)?;
            if self.tokens_not_kept > 0 {
                writeln!(
                    out,
                    "(the summary covers the newest {} tokens; {} older ones were not kept)",
                    self.tokens.len(),
                    self.tokens_not_kept
                )?;
            }
        }
        if let (Some(ns), Some(n)) = (self.bpf_run_ns, self.bpf_run_count) {
            writeln!(
                out,
                "observer cost: {:.1} ms of eBPF program time in {n} runs ({:.0} ns per run)",
                ns as f64 / 1e6,
                if n > 0 { ns as f64 / n as f64 } else { 0.0 }
            )?;
            let mut ran: Vec<&ProgramCost> = self.bpf_programs.iter().filter(|p| p.runs > 0).collect();
            ran.sort_by_key(|p| std::cmp::Reverse(p.run_ns));
            for p in ran {
                writeln!(
                    out,
                    "  {:<20} {:>8.1} ms {:>12} runs {:>7.0} ns per run",
                    p.name,
                    p.run_ns as f64 / 1e6,
                    p.runs,
                    p.ns_per_run().unwrap_or(0.0)
                )?;
            }
        }
        if self.lost_events > 0 {
            writeln!(
                out,
                "{}",
                crate::style::alarm(&format!("lost events: {}", self.lost_events), crate::style::Stream::Stderr)
            )?;
        } else {
            writeln!(out, "lost events: 0")?;
        }
        Ok(())
    }
}

/// What the summary needs from a model stream, kept as the events pass
/// (the last `histograms`, `health` and `totals`, the header and the end, and
/// the newest `keep` token records; older ones are counted).
#[derive(Debug, Clone)]
pub struct Collector {
    header: Option<RunHeader>,
    latency: Option<LatencyHistograms>,
    health: Option<ObserverHealth>,
    totals: Option<RunTotals>,
    end: Option<RunEnd>,
    evicted_by_process: Vec<ProcessEvictions>,
    tokens: Vec<TokenRecord>,
    keep: usize,
    tokens_not_kept: u64,
}

impl Collector {
    /// Keep at most `keep` token records (a standing `observer serve` must not
    /// grow without bound): when full, the older half is dropped and counted.
    pub fn new(keep: usize) -> Self {
        Collector {
            header: None,
            latency: None,
            health: None,
            totals: None,
            end: None,
            evicted_by_process: Vec::new(),
            tokens: Vec::new(),
            keep: keep.max(1),
            tokens_not_kept: 0,
        }
    }

    pub fn push(&mut self, ev: &Event) {
        match ev {
            Event::Header(h) => self.header = Some(h.clone()),
            Event::Marks(m) => {
                if let Some(h) = &mut self.header {
                    h.apply(m);
                }
            }
            Event::Token(t) => {
                if self.tokens.len() >= self.keep {
                    let n = self.tokens.len().div_ceil(2);
                    self.tokens.drain(..n);
                    self.tokens_not_kept += n as u64;
                }
                self.tokens.push(t.clone());
            }
            Event::Process(p) => {
                if !p.evicted_by_process.is_empty() {
                    self.evicted_by_process = p.evicted_by_process.clone();
                }
            }
            Event::Histograms(h) => self.latency = Some(h.clone()),
            Event::Health(h) => self.health = Some(h.clone()),
            Event::Totals(t) => {
                if !t.evicted_by_process.is_empty() {
                    self.evicted_by_process = t.evicted_by_process.clone();
                }
                self.totals = Some(t.clone());
            }
            Event::End(e) => self.end = Some(e.clone()),
        }
    }

    /// The summary of what was pushed (module rule).
    pub fn summary(&self) -> Summary {
        Summary::from_stream(self)
    }
}

/// The summary of a whole stream (e.g. a trace's events), every token kept.
pub fn summarise<'a>(events: impl IntoIterator<Item = &'a Event>) -> Summary {
    let mut c = Collector::new(usize::MAX);
    for ev in events {
        c.push(ev);
    }
    c.summary()
}

fn avg_us(ns: u64, n: u64) -> String {
    if n == 0 { "-".into() } else { format!("{:.2}", ns as f64 / n as f64 / 1e3) }
}

/// Three significant digits with a unit: 65536 ns -> "65.5 µs".
pub fn fmt_ns(ns: u64) -> String {
    let (v, unit) = if ns >= 1_000_000_000 {
        (ns as f64 / 1e9, "s")
    } else if ns >= 1_000_000 {
        (ns as f64 / 1e6, "ms")
    } else if ns >= 1_000 {
        (ns as f64 / 1e3, "µs")
    } else {
        return format!("{ns} ns");
    };
    if v >= 100.0 {
        format!("{v:.0} {unit}")
    } else if v >= 10.0 {
        format!("{v:.1} {unit}")
    } else {
        format!("{v:.2} {unit}")
    }
}

fn print_hist(out: &mut impl Write, h: &Histogram) -> std::io::Result<()> {
    let first = h.buckets.iter().position(|b| b.count > 0).unwrap_or(0);
    let last = h.buckets.iter().rposition(|b| b.count > 0).unwrap_or(0);
    let max = h.buckets.iter().map(|b| b.count).max().unwrap_or(1).max(1);
    for b in &h.buckets[first..=last] {
        let label = match b.le_ns {
            Some(le) => format!("≤ {}", fmt_ns(le)),
            None => "> 275 s".into(),
        };
        let width = (b.count * 40).div_ceil(max) as usize;
        writeln!(out, "  {:>10} |{:<40}| {}", label, "#".repeat(width), b.count)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use observer_common::model::{Components, Counters, StepKind, ThreadTotals};

    use super::*;

    fn tok(seq: u64) -> Event {
        Event::Token(TokenRecord {
            seq,
            index: Some(seq),
            kind: StepKind::Generate,
            n_tokens: 1,
            start_ns: seq * 10,
            wall_ns: 10,
            components: Components::default(),
            residual_ns: 0,
            counters: Counters::default(),
            engine_compute_ns: None,
            threads: Vec::new(),
            engine: None,
            residency: None,
            lost_events: 0,
            evicted_by: None,
            refaults: None,
            explicit_reads: None,
        })
    }

    #[test]
    fn kept_tokens_are_bounded_and_the_rest_counted() {
        let mut c = Collector::new(10);
        for i in 0..25 {
            c.push(&tok(i));
        }
        let s = c.summary();
        assert!(s.tokens.len() <= 10);
        assert_eq!(s.tokens.len() as u64 + s.tokens_not_kept, 25);
        assert_eq!(s.tokens.last().unwrap().seq, 24, "the newest are kept");
        let all = summarise(&(0..25).map(tok).collect::<Vec<_>>());
        assert_eq!((all.tokens.len(), all.tokens_not_kept), (25, 0));
    }

    #[test]
    fn threads_are_summed_by_process_and_a_process_is_named_by_its_main_thread() {
        let time = |compute: u64| {
            let mut t = ThreadTime { wall_ns: 100, ..Default::default() };
            t.components.set(Component::Compute, Some(compute));
            t.components.set(Component::Sleep, Some(100 - compute));
            Some(t)
        };
        let th = |tid, pid, comm: &str, c| ThreadTotals {
            tid,
            pid,
            comm: comm.into(),
            faults: None,
            time: time(c),
            folded: 0,
        };
        let totals = RunTotals {
            mono_ns: 5_000,
            // The wrapper `sh` (pid 5) and the engine it started (pid 7, two threads and a row of
            // four exited workers: one and three folded into it).
            threads: vec![
                th(9, 7, "worker", 60),
                th(5, 5, "sh", 1),
                th(7, 7, "llama-simple", 30),
                ThreadTotals { folded: 3, ..th(11, 7, "worker", 10) },
            ],
            devices: Vec::new(),
            evicted_by_process: Default::default(),
        };
        let s = summarise(&[Event::Header(RunHeader::default()), Event::Totals(totals)]);
        let rows: Vec<(u32, &str, u32, Option<u64>)> = s
            .processes
            .iter()
            .map(|p| {
                let compute = p.attribution.as_ref().and_then(|a| a.components.get(Component::Compute));
                (p.pid, p.comm.as_str(), p.threads, compute)
            })
            .collect();
        assert_eq!(rows, [(5, "sh", 1, Some(1)), (7, "llama-simple", 6, Some(100))]);
        let json = serde_json::to_value(&s).unwrap();
        assert_eq!(json["processes"][1]["wall_ns"], serde_json::Value::Null, "wall is inside attribution");
        assert_eq!(json["processes"][1]["attribution"]["wall_ns"], 300);
        let mut out = Vec::new();
        s.print(&mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(
            text.contains("per process") && text.contains("pid 7") && text.contains("llama-simple (6 thr)"),
            "{text}"
        );
        assert!(text.contains("worker (+3 exited)"), "a folded row says how many it holds: {text}");
        assert_eq!(json["threads"][3]["folded"], 3, "{json}");
        assert_eq!(json["threads"][0].get("folded"), None, "absent when 0");
    }

    #[test]
    fn the_summary_is_a_function_of_the_stream() {
        let header = RunHeader {
            mode: "ebpf".into(),
            target_pid: 7,
            target_command: vec!["engine".into()],
            started_mono_ns: 1_000,
            ..Default::default()
        };
        let mut f =
            FaultTotals { majflt: 2, majflt_ns: 4_000, majflt_hist: vec![0; HIST_BUCKETS], ..Default::default() };
        f.majflt_hist[12] = 2;
        let totals = RunTotals {
            mono_ns: 5_000,
            threads: vec![
                ThreadTotals {
                    tid: 9,
                    pid: 7,
                    comm: "worker".into(),
                    faults: None,
                    time: Some(ThreadTime::default()),
                    folded: 0,
                },
                ThreadTotals { tid: 7, pid: 7, comm: "engine".into(), faults: Some(f), time: None, folded: 0 },
            ],
            devices: Vec::new(),
            evicted_by_process: Default::default(),
        };
        let end = RunEnd { mono_ns: 3_001_000, exit_code: Some(0), lost_events: 3 };
        let s = summarise(&[Event::Header(header.clone()), Event::Totals(totals), Event::End(end.clone())]);
        assert_eq!((s.target.pid, s.target.exit_code, s.lost_events), (7, Some(0), 3));
        assert_eq!(s.duration_ns, 3_000_000, "end − header start");
        assert_eq!(s.threads.iter().map(|t| t.tid).collect::<Vec<_>>(), [7, 9], "by tid");
        assert_eq!(s.totals.as_ref().map(|t| (t.majflt, t.fault_ns)), Some((2, 4_000)));
        assert_eq!(s.majflt_hist.as_ref().map(|h| h.count), Some(2));
        assert!(s.threads[1].attribution.is_some() && s.threads[0].attribution.is_none());
        // Without totals (the procfs fallback): faults not probed.
        let header = RunHeader { mode: "procfs".into(), ..header };
        let s = summarise(&[Event::Header(header), Event::End(end)]);
        assert!(s.totals.is_none() && s.majflt_hist.is_none() && s.threads.is_empty());
        let mut out = Vec::new();
        s.print(&mut out).unwrap();
        assert!(String::from_utf8(out).unwrap().contains("in procfs mode (faults not probed)"));
    }

    #[test]
    fn marks_restate_the_probes_of_the_summary() {
        let header = RunHeader { probes: vec!["fault_entry".into()], ..Default::default() };
        let probes = vec!["fault_entry".to_string(), "uprobe:/l/libllama.so:llama_process".to_string()];
        let marks = observer_common::model::TokenMarks {
            mono_ns: 5,
            pid: 8,
            tokens: "engine profile llama.cpp: llama_process in /l/libllama.so".into(),
            probes: probes.clone(),
            degraded: vec!["tokens: refused".into()],
        };
        assert_eq!(summarise(&[Event::Header(header.clone())]).probes, header.probes);
        let s = summarise(&[Event::Header(header), Event::Marks(marks)]);
        assert_eq!(s.probes, probes);
        assert_eq!(s.degraded, ["tokens: refused"], "degradations found later are in the summary");
    }

    #[test]
    fn the_observer_cost_is_printed_per_program_from_the_last_health() {
        let cost = |name: &str, run_ns, runs| ProgramCost { name: name.into(), run_ns, runs };
        let health = |programs: Vec<ProgramCost>| {
            Event::Health(ObserverHealth {
                bpf_run_ns: Some(programs.iter().map(|p| p.run_ns).sum()),
                bpf_run_count: Some(programs.iter().map(|p| p.runs).sum()),
                bpf_programs: programs,
                ..Default::default()
            })
        };
        let s = summarise(&[
            Event::Header(RunHeader::default()),
            health(vec![cost("fault_entry", 10, 1)]),
            health(vec![cost("fault_entry", 12_500, 100), cost("sched_switch", 40_000, 200), cost("idle", 0, 0)]),
        ]);
        let json = serde_json::to_value(&s).unwrap();
        assert_eq!(json["bpf_programs"][0], serde_json::json!({"name": "fault_entry", "run_ns": 12_500, "runs": 100}));
        let mut out = Vec::new();
        s.print(&mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        let lines: Vec<&str> = text.lines().skip_while(|l| !l.starts_with("observer cost:")).take(3).collect();
        assert!(lines[0].contains("52500 ns") || lines[0].contains("300 runs"), "{text}");
        assert!(lines[1].contains("sched_switch") && lines[1].contains("200 ns per run"), "{text}");
        assert!(lines[2].contains("fault_entry") && lines[2].contains("125 ns per run"), "{text}");
        assert!(!text.contains("idle"), "a program that never ran is not listed: {text}");
    }
}
