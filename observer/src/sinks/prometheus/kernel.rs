//! The kernel's log2 latency histograms as Prometheus histograms.
//!
//! ## Spec
//! The kernel keeps per-bucket counts (`observer_common::hist`): bucket `i`
//! counts latencies in `(2^(i-1), 2^i]` ns, the last bucket everything larger
//! (+Inf). Rounding up in the kernel makes `2^i` ns a true `le` bound, so the
//! export is exact for every bound it names:
//! - `<prefix>_<kind>_latency_seconds_bucket{le="2^b/1e9"}` for
//!   `b = FIRST_BUCKET..=LAST_BUCKET` is the sum of kernel buckets `0..=b`
//!   (cumulative; lower buckets fold into the first exported one, which is
//!   still exact as `le` means "at most"), then `le="+Inf"`: all of them;
//! - **no `_sum`**: the kernel keeps counts only, and a sum estimated from the
//!   buckets would be a guess presented as a measurement; hence **no `_count`**
//!   either (OpenMetrics: a `_count` iff a `_sum`): the count is the `+Inf`
//!   bucket. `histogram_quantile` and the dashboards' heatmaps use buckets
//!   only.
//! - `le` values in the canonical rendering (Go's `%g`: `2.56e-07`,
//!   `0.000131072`, `274.877906944`), buckets in increasing order.
//!
//! Counts only grow: every run's counts (cumulative within the run) are added
//! as deltas to totals that survive target restarts (`observer serve`).
//!
//! `prometheus-client` always writes a `_sum` for histograms, so these few
//! families are written here, in both formats, after the registry's.

use std::{collections::BTreeMap, fmt::Write};

use observer_common::HIST_BUCKETS;

use super::Format;

/// First exported finite bound: 2^8 ns = 256 ns.
pub const FIRST_BUCKET: usize = 8;
/// Last exported finite bound: 2^38 ns ≈ 275 s (the kernel's last finite bucket).
pub const LAST_BUCKET: usize = HIST_BUCKETS - 2;

/// `le` of bucket `b`, in seconds, in the canonical rendering.
pub fn le_seconds(b: usize) -> String {
    canonical((1u64 << b) as f64 / 1e9)
}

/// A float as OpenMetrics' canonical numbers (and Go's `%g`, which
/// Prometheus' own clients use): the shortest round-trip digits, exponent form
/// when the decimal exponent is < -4 or >= 6 (`e-07`: at least two exponent
/// digits), and `.0` appended to an integer.
pub fn canonical(v: f64) -> String {
    if !v.is_finite() {
        return if v.is_nan() {
            "NaN".into()
        } else if v > 0.0 {
            "+Inf".into()
        } else {
            "-Inf".into()
        };
    }
    let e = format!("{v:e}");
    let (mant, exp) = e.split_once('e').unwrap_or((&e, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if v != 0.0 && !(-4..6).contains(&exp) {
        format!("{mant}e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.unsigned_abs())
    } else {
        let d = format!("{v}");
        if d.contains('.') { d } else { format!("{d}.0") }
    }
}

/// What each kind measures (kinds from `Probes::histograms_event`).
fn help(kind: &str) -> String {
    let what = match kind {
        "fault_minor" => "the target's minor page faults (entry to completion)",
        "fault_major_file" => "the target's major page faults served from a file (refault I/O)",
        "fault_major_swap" => "the target's major page faults served from swap (zram decompression or disk swap)",
        "zram_read" => "the target's zram reads (bio queued to completed: decompression)",
        "disk_read" => "the target's block-device reads other than zram (bio queued to completed)",
        other => {
            return format!(
                "Latency of kernel events `{other}`, log2 buckets from the kernel; no _sum or _count: the kernel keeps counts only (the count is the +Inf bucket)."
            );
        }
    };
    format!(
        "Latency of {what}, log2 buckets from the kernel; no _sum or _count: the kernel keeps counts only (the count is the +Inf bucket)."
    )
}

/// A kind as a metric-name part: `[a-z0-9_]`, anything else becomes `_`.
fn name_part(kind: &str) -> String {
    kind.chars().map(|c| if c.is_ascii_lowercase() || c.is_ascii_digit() { c } else { '_' }).collect()
}

/// Totals per kind, per kernel bucket (not cumulative), over all runs.
#[derive(Debug, Default)]
pub struct KernelHists {
    totals: BTreeMap<String, [u64; HIST_BUCKETS]>,
}

impl KernelHists {
    /// Add per-bucket increments of `kind` (a slice of any length: its last
    /// element is its +Inf bucket; finite buckets past ours fold into +Inf).
    pub fn add(&mut self, kind: &str, delta: &[u64]) {
        let t = self.totals.entry(kind.to_string()).or_insert([0; HIST_BUCKETS]);
        let n = delta.len();
        for (i, d) in delta.iter().enumerate() {
            let slot = if i + 1 == n { HIST_BUCKETS - 1 } else { i.min(HIST_BUCKETS - 1) };
            t[slot] = t[slot].saturating_add(*d);
        }
    }

    /// Exported cumulative buckets (`le` index, count) and the count, for tests.
    pub fn cumulative(&self, kind: &str) -> Option<(Vec<(usize, u64)>, u64)> {
        let t = self.totals.get(kind)?;
        let mut acc = 0u64;
        let mut out = Vec::new();
        for (b, v) in t.iter().enumerate().take(LAST_BUCKET + 1) {
            acc += v;
            if b >= FIRST_BUCKET {
                out.push((b, acc));
            }
        }
        Some((out, t.iter().sum()))
    }

    pub fn encode(&self, out: &mut String, prefix: &str, format: Format) -> std::fmt::Result {
        for kind in self.totals.keys() {
            let Some((buckets, count)) = self.cumulative(kind) else {
                continue;
            };
            let name = format!("{prefix}_{}_latency_seconds", name_part(kind));
            writeln!(out, "# TYPE {name} histogram")?;
            if format == Format::OpenMetrics {
                writeln!(out, "# UNIT {name} seconds")?;
            }
            writeln!(out, "# HELP {name} {}", help(kind))?;
            for (b, c) in buckets {
                writeln!(out, "{name}_bucket{{le=\"{}\"}} {c}", le_seconds(b))?;
            }
            writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_cumulative_and_exact_at_each_bound() {
        let mut h = KernelHists::default();
        let mut d = vec![0u64; HIST_BUCKETS];
        d[3] = 5; // <= 8 ns: folds into the first exported bound
        d[10] = 2; // (512, 1024] ns
        d[HIST_BUCKETS - 1] = 1; // +Inf
        h.add("fault_minor", &d);
        h.add("fault_minor", &d);
        let (b, count) = h.cumulative("fault_minor").unwrap();
        assert_eq!(count, 16);
        assert_eq!(b.first(), Some(&(FIRST_BUCKET, 10)));
        assert_eq!(b.iter().find(|(i, _)| *i == 9), Some(&(9, 10)));
        assert_eq!(b.iter().find(|(i, _)| *i == 10), Some(&(10, 14)));
        assert_eq!(b.last(), Some(&(LAST_BUCKET, 14)), "+Inf values are only in +Inf");
        let mut s = String::new();
        h.encode(&mut s, "p", Format::Text).unwrap();
        for line in [
            "p_fault_minor_latency_seconds_bucket{le=\"2.56e-07\"} 10\n",
            "p_fault_minor_latency_seconds_bucket{le=\"1.024e-06\"} 14\n",
            "p_fault_minor_latency_seconds_bucket{le=\"+Inf\"} 16\n",
        ] {
            assert!(s.contains(line), "{line} not in {s}");
        }
        assert!(!s.lines().any(|l| !l.starts_with('#') && (l.contains("_sum") || l.contains("_count"))), "{s}");
        assert!(!s.contains("# UNIT"), "{s}");
        let mut om = String::new();
        h.encode(&mut om, "p", Format::OpenMetrics).unwrap();
        assert!(om.contains("# UNIT p_fault_minor_latency_seconds seconds\n"), "{om}");
    }

    #[test]
    fn other_lengths_keep_le_semantics() {
        let mut h = KernelHists::default();
        h.add("x y", &[1, 0, 0, 7]); // last is +Inf
        let (b, count) = h.cumulative("x y").unwrap();
        assert_eq!(count, 8);
        assert!(b.iter().all(|(_, c)| *c == 1));
        let mut s = String::new();
        h.encode(&mut s, "p", Format::Text).unwrap();
        assert!(s.contains("p_x_y_latency_seconds_bucket{le=\"+Inf\"} 8"), "{s}");
    }

    #[test]
    fn le_strings_are_canonical() {
        assert_eq!(le_seconds(8), "2.56e-07");
        assert_eq!(le_seconds(16), "6.5536e-05");
        assert_eq!(le_seconds(17), "0.000131072");
        assert_eq!(le_seconds(30), "1.073741824");
        assert_eq!(le_seconds(LAST_BUCKET), "274.877906944");
        // The examples of the OpenMetrics spec's canonical numbers.
        for (v, s) in [
            (1e-10, "1e-10"),
            (1e-9, "1e-09"),
            (1e-5, "1e-05"),
            (1e-4, "0.0001"),
            (0.1, "0.1"),
            (1.0, "1.0"),
            (1e5, "100000.0"),
            (1e6, "1e+06"),
            (1e10, "1e+10"),
            (0.0, "0.0"),
            (0.999, "0.999"),
        ] {
            assert_eq!(canonical(v), s);
        }
    }
}
