//! The kernel's log2 latency histograms as Prometheus histograms.
//!
//! ## Spec
//! The kernel keeps per-bucket counts and the exact sum of the values
//! (`observer_common::hist`, `attrib::Hist`): bucket `i` counts latencies in
//! `(2^(i-1), 2^i]` ns, the last bucket everything larger (+Inf). Rounding up
//! in the kernel makes `2^i` ns a true `le` bound, so the export is exact for
//! every bound it names. Each kind is a row of `vocab::HISTOGRAMS`, exported in
//! its family with its label (`fault_latency_seconds{kind="file"}`):
//! - `_bucket{kind,le="2^b/1e9"}` for `b = FIRST_BUCKET..=LAST_BUCKET` is the
//!   sum of kernel buckets `0..=b` (cumulative; lower buckets fold into the
//!   first exported one, which is still exact as `le` means "at most"), then
//!   `le="+Inf"`: all of them;
//! - `_sum{kind}`: the kernel's sum in seconds, and `_count{kind}` (= the
//!   `+Inf` bucket). A histogram without a measured sum (replayed from a trace
//!   recorded before the kernel kept one) has neither (OpenMetrics: a `_count`
//!   iff a `_sum`), never an estimate from the bucket bounds.
//! - `le` and `_sum` values in the canonical rendering (Go's `%g`: `2.56e-07`,
//!   `0.000131072`, `274.877906944`), buckets in increasing order.
//! - Kinds this observer has no row for are not exported.
//!
//! Under several targets (`observer serve --discover`) each target's
//! histograms are its own series, its labels (`vocab::TARGET_LABELS`) first:
//! `fault_latency_seconds_bucket{engine,model,container,kind,le}`.
//!
//! Counts only grow: every run's counts (cumulative within the run) are added
//! as deltas to totals that survive target restarts (`observer serve`).
//!
//! These families are written here, in both formats, after the registry's,
//! because `prometheus-client` histograms bucket values themselves, and the
//! kernel has already done it.

use std::{collections::BTreeMap, fmt::Write};

use observer_common::{HIST_BUCKETS, vocab, vocab::HISTOGRAMS};

use super::{Format, Labels};

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

/// A label value in the text formats: `\`, `"` and a line feed escaped.
pub fn escape(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// One kind as exported: cumulative buckets (`le` index, count), the count, the sum (ns).
pub type Exported = (Vec<(usize, u64)>, u64, Option<u64>);

/// Totals per kind, per kernel bucket (not cumulative), over all runs, and
/// the sums (`None` once any part of a total had no measured sum).
#[derive(Debug, Default)]
pub struct KernelHists {
    /// By (target labels, kind).
    totals: BTreeMap<(Labels, String), ([u64; HIST_BUCKETS], Option<u64>)>,
}

impl KernelHists {
    /// Add per-bucket increments of `kind` (a slice of any length: its last
    /// element is its +Inf bucket; finite buckets past ours fold into +Inf)
    /// and the increment of its sum (ns), when measured.
    pub fn add(&mut self, target: &Labels, kind: &str, delta: &[u64], sum_ns: Option<u64>) {
        let key = (target.clone(), kind.to_string());
        let (t, sum) = self.totals.entry(key).or_insert(([0; HIST_BUCKETS], Some(0)));
        let n = delta.len();
        for (i, d) in delta.iter().enumerate() {
            let slot = if i + 1 == n { HIST_BUCKETS - 1 } else { i.min(HIST_BUCKETS - 1) };
            t[slot] = t[slot].saturating_add(*d);
        }
        *sum = match (*sum, sum_ns) {
            (Some(a), Some(b)) => Some(a.saturating_add(b)),
            _ => None,
        };
    }

    /// Exported cumulative buckets (`le` index, count), the count and the sum (ns), for tests.
    pub fn cumulative(&self, target: &Labels, kind: &str) -> Option<Exported> {
        let (t, sum) = self.totals.get(&(target.clone(), kind.to_string()))?;
        let mut acc = 0u64;
        let mut out = Vec::new();
        for (b, v) in t.iter().enumerate().take(LAST_BUCKET + 1) {
            acc += v;
            if b >= FIRST_BUCKET {
                out.push((b, acc));
            }
        }
        Some((out, t.iter().sum(), *sum))
    }

    pub fn encode(&self, out: &mut String, format: Format) -> std::fmt::Result {
        let mut families: Vec<&'static vocab::Family> = Vec::new();
        for r in HISTOGRAMS.iter() {
            if let Some(p) = r.prom
                && !families.iter().any(|f| f.stem == p.family.stem)
            {
                families.push(p.family);
            }
        }
        for f in families {
            let rows: Vec<(&Labels, &vocab::Row, (&'static str, &'static str))> = self
                .totals
                .keys()
                .flat_map(|(target, kind)| HISTOGRAMS.iter().filter(move |r| r.name == kind).map(move |r| (target, r)))
                .filter_map(|(target, r)| {
                    let p = r.prom?;
                    (p.family.stem == f.stem).then_some((target, r, p.label?))
                })
                .collect();
            if rows.is_empty() {
                continue;
            }
            let name = vocab::metric_name(f);
            writeln!(out, "# TYPE {name} histogram")?;
            if format == Format::OpenMetrics {
                writeln!(out, "# UNIT {name} seconds")?;
            }
            writeln!(out, "# HELP {name} {}.", f.help)?;
            for (target, r, (k, v)) in rows {
                let Some((buckets, count, sum)) = self.cumulative(target, r.name) else { continue };
                let t: String = target.iter().map(|(k, v)| format!("{k}=\"{}\",", escape(v))).collect();
                for (b, c) in buckets {
                    writeln!(out, "{name}_bucket{{{t}{k}=\"{v}\",le=\"{}\"}} {c}", le_seconds(b))?;
                }
                writeln!(out, "{name}_bucket{{{t}{k}=\"{v}\",le=\"+Inf\"}} {count}")?;
                if let Some(sum) = sum {
                    writeln!(out, "{name}_sum{{{t}{k}=\"{v}\"}} {}", canonical(sum as f64 / 1e9))?;
                    writeln!(out, "{name}_count{{{t}{k}=\"{v}\"}} {count}")?;
                }
            }
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
        h.add(&Vec::new(), "minflt", &d, Some(1_500_000_000));
        h.add(&Vec::new(), "minflt", &d, Some(1_000));
        let (b, count, sum) = h.cumulative(&Vec::new(), "minflt").unwrap();
        assert_eq!((count, sum), (16, Some(1_500_001_000)));
        assert_eq!(b.first(), Some(&(FIRST_BUCKET, 10)));
        assert_eq!(b.iter().find(|(i, _)| *i == 9), Some(&(9, 10)));
        assert_eq!(b.iter().find(|(i, _)| *i == 10), Some(&(10, 14)));
        assert_eq!(b.last(), Some(&(LAST_BUCKET, 14)), "+Inf values are only in +Inf");
        let mut s = String::new();
        h.encode(&mut s, Format::Text).unwrap();
        for line in [
            "moe_observer_fault_latency_seconds_bucket{kind=\"minor\",le=\"2.56e-07\"} 10\n",
            "moe_observer_fault_latency_seconds_bucket{kind=\"minor\",le=\"1.024e-06\"} 14\n",
            "moe_observer_fault_latency_seconds_bucket{kind=\"minor\",le=\"+Inf\"} 16\n",
            "moe_observer_fault_latency_seconds_sum{kind=\"minor\"} 1.500001\n",
            "moe_observer_fault_latency_seconds_count{kind=\"minor\"} 16\n",
        ] {
            assert!(s.contains(line), "{line} not in {s}");
        }
        assert!(!s.contains("# UNIT") && !s.contains("block_read"), "{s}");
        let mut om = String::new();
        h.encode(&mut om, Format::OpenMetrics).unwrap();
        assert!(om.contains("# UNIT moe_observer_fault_latency_seconds seconds\n"), "{om}");
    }

    #[test]
    fn a_total_without_a_measured_sum_has_no_sum_and_no_count() {
        let mut h = KernelHists::default();
        h.add(&Vec::new(), "disk_read", &[1, 0, 0, 7], Some(10)); // last is +Inf
        h.add(&Vec::new(), "disk_read", &[0, 1, 0, 0], None); // replayed from an older trace
        let (b, count, sum) = h.cumulative(&Vec::new(), "disk_read").unwrap();
        assert_eq!((count, sum), (9, None));
        assert!(b.iter().all(|(_, c)| *c == 2));
        let mut s = String::new();
        h.encode(&mut s, Format::Text).unwrap();
        assert!(s.contains("moe_observer_block_read_latency_seconds_bucket{kind=\"disk\",le=\"+Inf\"} 9"), "{s}");
        assert!(!s.lines().any(|l| l.contains("_sum") || l.contains("_count")), "{s}");
        // Kinds the vocabulary has no row for are not exported.
        h.add(&Vec::new(), "x y", &[1], Some(1));
        let mut t = String::new();
        h.encode(&mut t, Format::Text).unwrap();
        assert_eq!(s, t);
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
