//! The fault summary: what `observer run` prints at the end and writes with
//! `--json`. Names follow the design's vocabulary (`majflt`, `minflt`,
//! `fault_ns`, …); times are nanoseconds in data, milliseconds/microseconds on
//! screen.

use std::io::Write;

use observer_common::{
    HIST_BUCKETS, ThreadFaults,
    attrib::{C_DISK_READ_NS, C_READ_IOS, C_ZRAM_READ_NS, Hist, ThreadState},
    hist::bucket_upper_ns,
    model::{Component, Components, Counter, Counters, LatencyKind, TokenRecord},
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
}

impl FaultCounts {
    fn add(&mut self, t: &ThreadFaults) {
        self.majflt += t.majflt;
        self.minflt += t.minflt;
        self.majflt_ns += t.majflt_ns;
        self.minflt_ns += t.minflt_ns;
        self.fault_ns += t.majflt_ns + t.minflt_ns;
        self.unmatched_entries += t.unmatched_entries;
        self.unmatched_exits += t.unmatched_exits;
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct ThreadRow {
    pub tid: u32,
    pub comm: String,
    #[serde(flatten)]
    pub counts: FaultCounts,
    pub majflt_hist: Histogram,
    pub minflt_hist: Histogram,
    /// Where this thread's time went since it was first seen (see `attrib`).
    pub attribution: Option<ThreadAttribution>,
}

/// A thread's whole-run attribution.
#[derive(Debug, Clone, Serialize)]
pub struct ThreadAttribution {
    /// Time accounted since the thread was first seen.
    pub wall_ns: u64,
    #[serde(flatten)]
    pub components: Components,
    /// The vocabulary's counters the kernel keeps per thread (the others `null`).
    #[serde(flatten)]
    pub counters: Counters,
    pub read_ios: u64,
    /// Σ queue→complete latency of the thread's read bios on disks / on zram.
    pub disk_read_ns: u64,
    pub zram_read_ns: u64,
    pub exited: bool,
}

impl ThreadAttribution {
    fn from_state(s: &ThreadState) -> Self {
        ThreadAttribution {
            wall_ns: s.accounted(),
            components: Components::from_kernel(&s.time),
            counters: Counters::from_kernel(&s.cnt),
            read_ios: s.cnt[C_READ_IOS],
            disk_read_ns: s.cnt[C_DISK_READ_NS],
            zram_read_ns: s.cnt[C_ZRAM_READ_NS],
            exited: s.flags & observer_common::attrib::F_EXITED != 0,
        }
    }

    /// Add another thread's totals (measured values add; unmeasured stay unmeasured).
    fn add(&mut self, a: &ThreadAttribution) {
        self.wall_ns += a.wall_ns;
        for (c, v) in a.components.iter() {
            if let Some(v) = v {
                self.components.add(c, v);
            }
        }
        for (c, v) in a.counters.iter() {
            if let Some(v) = v {
                self.counters.add(c, v);
            }
        }
        self.read_ios += a.read_ios;
        self.disk_read_ns += a.disk_read_ns;
        self.zram_read_ns += a.zram_read_ns;
        self.exited &= a.exited;
    }

    fn counter(&self, c: Counter) -> u64 {
        self.counters.get(c).unwrap_or(0)
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
    pub fn from_counts(c: &[u64; HIST_BUCKETS]) -> Self {
        let mut h = Histogram::default();
        h.add(c);
        h
    }
    fn add(&mut self, c: &[u64; HIST_BUCKETS]) {
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
    /// From the kernel's dev_t encoding `(major << 20) | minor`.
    pub fn new(kdev: u32, d: &observer_common::attrib::DevIo) -> Self {
        let (major, minor) = (kdev >> 20, kdev & 0xfffff);
        let name = std::fs::read_to_string(format!("/sys/dev/block/{major}:{minor}/uevent"))
            .ok()
            .and_then(|u| u.lines().find_map(|l| l.strip_prefix("DEVNAME=").map(str::to_string)));
        DeviceRow {
            dev: format!("{major}:{minor}"),
            name,
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
    /// Fault bracketing totals; `None` when faults were not probed (procfs fallback).
    pub totals: Option<FaultCounts>,
    pub majflt_hist: Option<Histogram>,
    pub minflt_hist: Option<Histogram>,
    pub threads: Vec<ThreadRow>,
    /// Events the kernel side could not record (full maps, full ring buffers).
    pub lost_events: u64,
    /// Latency histograms by kind (`vocab::HISTOGRAMS`: `minflt`,
    /// `majflt_file`, `majflt_swap`, `zram_read`, `disk_read`).
    pub latency: std::collections::BTreeMap<String, Histogram>,
    /// The target's block reads per device.
    pub devices: Vec<DeviceRow>,
    /// The observer's own cost: run time and run count of its eBPF programs
    /// (all processes' events, since filtering happens inside them), when the
    /// kernel's BPF statistics are available.
    pub bpf_run_ns: Option<u64>,
    pub bpf_run_count: Option<u64>,
    /// Whole-run attribution summed over threads.
    pub attribution_totals: Option<ThreadAttribution>,
    /// Per-token summary (when tokens were marked or windows used).
    pub attribution: Option<attribution::Summary>,
    /// Every token record, in order (the newest ones when `tokens_not_kept` > 0).
    pub tokens: Vec<TokenRecord>,
    /// Older token records left out of `tokens` and the per-token summary.
    pub tokens_not_kept: u64,
}

pub fn comm_str(c: &[u8; 16]) -> String {
    let end = c.iter().position(|&b| b == 0).unwrap_or(c.len());
    String::from_utf8_lossy(&c[..end]).into_owned()
}

impl Summary {
    pub fn build(
        target: TargetInfo,
        duration_ns: u64,
        probes: Vec<String>,
        rows: &[(u32, ThreadFaults)],
        lost_events: u64,
    ) -> Self {
        let mut totals = FaultCounts::default();
        let mut maj = Histogram::default();
        let mut min = Histogram::default();
        let mut threads = Vec::with_capacity(rows.len());
        for (tid, t) in rows {
            totals.add(t);
            maj.add(&t.majflt_hist);
            min.add(&t.minflt_hist);
            let mut counts = FaultCounts::default();
            counts.add(t);
            threads.push(ThreadRow {
                tid: *tid,
                comm: comm_str(&t.comm),
                counts,
                majflt_hist: Histogram::from_counts(&t.majflt_hist),
                minflt_hist: Histogram::from_counts(&t.minflt_hist),
                attribution: None,
            });
        }
        if maj.buckets.is_empty() {
            maj.add(&[0; HIST_BUCKETS]);
            min.add(&[0; HIST_BUCKETS]);
        }
        Summary {
            observer_version: env!("CARGO_PKG_VERSION"),
            mode: "ebpf".into(),
            kernel: kernel_release(),
            target,
            duration_ns,
            probes,
            totals: Some(totals),
            majflt_hist: Some(maj),
            minflt_hist: Some(min),
            threads,
            lost_events,
            latency: Default::default(),
            devices: Vec::new(),
            bpf_run_ns: None,
            bpf_run_count: None,
            attribution_totals: None,
            attribution: None,
            tokens: Vec::new(),
            tokens_not_kept: 0,
        }
    }

    /// Add the attribution results: final thread states, kernel histograms and
    /// the token records.
    pub fn add_attribution(&mut self, states: &[ThreadState], hists: &[Hist], tokens: Vec<TokenRecord>) {
        let mut total: Option<ThreadAttribution> = None;
        for st in states {
            let a = ThreadAttribution::from_state(st);
            match &mut total {
                None => total = Some(a.clone()),
                Some(t) => t.add(&a),
            }
            match self.threads.iter_mut().find(|r| r.tid == st.tid) {
                Some(row) => row.attribution = Some(a),
                None => self.threads.push(ThreadRow {
                    tid: st.tid,
                    comm: comm_str(&st.comm),
                    counts: FaultCounts::default(),
                    majflt_hist: Histogram::from_counts(&[0; HIST_BUCKETS]),
                    minflt_hist: Histogram::from_counts(&[0; HIST_BUCKETS]),
                    attribution: Some(a),
                }),
            }
        }
        self.threads.sort_by_key(|r| r.tid);
        self.attribution_totals = total;
        for k in LatencyKind::ALL {
            if let Some(h) = hists.get(k.slot()) {
                let mut hist = Histogram::from_counts(&h.b);
                hist.sum_ns = Some(h.sum);
                self.latency.insert(k.name().into(), hist);
            }
        }
        if !tokens.is_empty() {
            self.attribution = Some(attribution::summarise(&tokens));
        }
        self.tokens = tokens;
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
                line(out, &t.tid.to_string(), &t.comm, &t.counts)?;
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
            let row = |out: &mut dyn Write, tid: &str, comm: &str, a: &ThreadAttribution| {
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
                    row(out, &t.tid.to_string(), &t.comm, a)?;
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
        }
        if self.lost_events > 0 {
            writeln!(out, "\x1b[31mlost events: {}\x1b[0m", self.lost_events)?;
        } else {
            writeln!(out, "lost events: 0")?;
        }
        Ok(())
    }
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

pub fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}
