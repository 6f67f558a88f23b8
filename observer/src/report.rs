//! The fault summary: what `observer run` prints at the end and writes with
//! `--json`. Names follow the design's vocabulary (`majflt`, `minflt`,
//! `fault_ns`, …); times are nanoseconds in data, milliseconds/microseconds on
//! screen.

use std::io::Write;

use observer_common::{HIST_BUCKETS, ThreadFaults, hist::bucket_upper_ns};
use serde::Serialize;

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
}

/// A log2 histogram, buckets as in `observer_common::hist`: `le_ns` is the
/// inclusive upper bound, `null` for +Inf. Counts are per bucket (not cumulative).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Histogram {
    pub buckets: Vec<Bucket>,
    pub count: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Bucket {
    pub le_ns: Option<u64>,
    pub count: u64,
}

impl Histogram {
    fn from_counts(c: &[u64; HIST_BUCKETS]) -> Self {
        let mut h = Histogram::default();
        h.add(c);
        h
    }
    fn add(&mut self, c: &[u64; HIST_BUCKETS]) {
        if self.buckets.is_empty() {
            self.buckets = (0..HIST_BUCKETS)
                .map(|b| Bucket { le_ns: bucket_upper_ns(b), count: 0 })
                .collect();
        }
        for (dst, &n) in self.buckets.iter_mut().zip(c.iter()) {
            dst.count += n;
            self.count += n;
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
    pub kernel: String,
    pub target: TargetInfo,
    pub duration_ns: u64,
    pub probes: Vec<String>,
    pub totals: FaultCounts,
    pub majflt_hist: Histogram,
    pub minflt_hist: Histogram,
    pub threads: Vec<ThreadRow>,
    /// Events the kernel side could not record (full maps, full ring buffers).
    pub lost_events: u64,
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
            });
        }
        if maj.buckets.is_empty() {
            maj.add(&[0; HIST_BUCKETS]);
            min.add(&[0; HIST_BUCKETS]);
        }
        Summary {
            observer_version: env!("CARGO_PKG_VERSION"),
            kernel: kernel_release(),
            target,
            duration_ns,
            probes,
            totals,
            majflt_hist: maj,
            minflt_hist: min,
            threads,
            lost_events,
        }
    }

    /// The human table.
    pub fn print(&self, out: &mut impl Write) -> std::io::Result<()> {
        let secs = self.duration_ns as f64 / 1e9;
        writeln!(
            out,
            "observer: pid {} ({}) observed for {:.3} s, {} thread(s) faulted",
            self.target.pid,
            self.target.command.first().map(String::as_str).unwrap_or("?"),
            secs,
            self.threads.len()
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
        for t in &self.threads {
            line(out, &t.tid.to_string(), &t.comm, &t.counts)?;
        }
        line(out, "total", "", &self.totals)?;
        for (name, h) in [("major", &self.majflt_hist), ("minor", &self.minflt_hist)] {
            if h.count == 0 {
                continue;
            }
            writeln!(out, "{name}-fault latency ({} faults):", h.count)?;
            print_hist(out, h)?;
        }
        if self.totals.unmatched_entries + self.totals.unmatched_exits > 0 {
            writeln!(
                out,
                "unmatched: {} fault entries without exit (failed faults), {} exits without entry",
                self.totals.unmatched_entries, self.totals.unmatched_exits
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
