//! `observer diff`: compare runs metric by metric, with bootstrap intervals.
//!
//! ## Rules
//! - Inputs are traces or imported CSVs (`crate::store::import`), one model stream
//!   each. The tokens compared are those `LoadedRun::summarised` picks
//!   (generated tokens; prompt steps are left out).
//! - Runs are grouped into *sides* by their engine configuration
//!   (`RunHeader::engine_config` without the output-only keys in
//!   [`IGNORED_KEYS`] and the user's `--ignore KEY`s), in the order the configurations first appear: side A
//!   is the baseline, B, C, … are each compared with A. Several runs of one
//!   configuration (e.g. A-B-B-A) are pooled (stratified, see `crate::analysis::stats`).
//!   When every run has the same configuration each file is its own side.
//! - Per metric ([`metrics`]): the point value over all tokens of a side, its
//!   95 % bootstrap interval, delta = B − A and delta % = (B − A) / A, and the
//!   verdict: **disjoint** intervals are a real difference, overlapping ones
//!   are inconclusive. tok/s is `tokens / Σ wall` (none for fixed windows,
//!   which are not tokens).
//! - Warnings: short runs (fewer than [`MIN_TOKENS`] tokens, or fewer than the
//!   per-token coefficient of variation of wall needs to resolve the observed
//!   tok/s difference, `stats::tokens_needed`); sides whose configurations
//!   differ in more than one setting; different model, host, kernel, CPU or
//!   observer mode; different boots, different (UTC) days, gaps of more than
//!   [`MAX_GAP_S`] between consecutive runs; an unbalanced run order (A-B-B-A is
//!   recognised as balanced); runs of one side whose own tok/s intervals are
//!   disjoint (variation between runs, which the token bootstrap does not
//!   see); lost or dropped events; damaged inputs.

use std::collections::BTreeMap;

use observer_common::{
    model::{Component, Counter, RunHeader, StepKind, TokenRecord},
    vocab::{ResidencyField, Time, Unit},
};
use serde::Serialize;

use crate::{
    analysis::stats::{self, Estimate, Interval, Stratum},
    store::import::{Format, LoadedRun},
};

/// Fewer generated tokens than this per run is a short run.
pub const MIN_TOKENS: usize = 100;
/// Consecutive runs further apart than this are not "back to back".
pub const MAX_GAP_S: u64 = 30 * 60;
/// Configuration keys that name outputs, not settings.
pub const IGNORED_KEYS: &[&str] = &[
    "json",
    "logits-out",
    "output",
    "out",
    "o",
    "record",
    "metrics-csv",
    "metrics-json",
    "metrics-out",
    "log",
    "log-file",
    "force",
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngField {
    Io,
    Stall,
    Mgmt,
    Cpu,
    Majflt,
    ReadBytes,
    CacheHit,
    DenseResident,
    Rss,
    Swap,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    TokS,
    Wall,
    Comp(Component),
    EngineCompute,
    Hidden,
    Counter(Counter),
    /// `pagecache_evicted` of one actor kind (index in `vocab::EVICTION_ACTORS`).
    EvictedBy(usize),
    /// Refaulted pages (`TokenRecord::refaults`) of one actor kind's evictions.
    RefaultedBy(usize),
    /// Those refault faults' `fault_io` ns.
    RefaultIo(usize),
    Engine(EngField),
    DenseResident,
    DenseSwapped,
    ExpertsResident,
}

/// One row of the comparison.
#[derive(Debug, Clone)]
pub struct Metric {
    /// `<name>_ms` for a time, `<name>_mb` for bytes (the unit shown), else the name.
    pub key: String,
    pub label: &'static str,
    pub unit: &'static str,
    /// Data unit → display unit.
    pub scale: f64,
    /// `Some(true)` when higher is better (tok/s), `Some(false)` for times.
    pub higher_is_better: Option<bool>,
    pub source: Source,
}

impl Metric {
    /// `(num, den)` of this metric for one token (see `crate::analysis::stats`).
    pub fn term(&self, t: &TokenRecord) -> (f64, f64) {
        if self.source == Source::TokS {
            // Windows are not tokens: no token rate for them (as `attribution`).
            if t.kind == StepKind::Window {
                return (0.0, 0.0);
            }
            return (t.n_tokens as f64, t.wall_ns as f64 / 1e9);
        }
        stats::mean_term(self.value(t).map(|v| v * self.scale))
    }

    fn value(&self, t: &TokenRecord) -> Option<f64> {
        let f = |v: Option<u64>| v.map(|v| v as f64);
        let e = t.engine.as_ref();
        let r = t.residency.as_ref();
        match self.source {
            Source::TokS => None,
            Source::Wall => Some(t.wall_ns as f64),
            Source::Comp(c) => f(t.components.get(c)),
            Source::EngineCompute => f(t.engine_compute_ns),
            Source::Hidden => t.hidden_ns().map(|v| v as f64),
            Source::Counter(c) => f(t.counters.get(c)),
            Source::EvictedBy(k) => f(t.evicted_by.map(|e| e.0[k])),
            Source::RefaultedBy(k) => f(t.refaults.map(|r| r.pages.0[k])),
            Source::RefaultIo(k) => f(t.refaults.map(|r| r.fault_io_ns.0[k])),
            Source::Engine(x) => {
                let e = e?;
                match x {
                    EngField::Io => f(e.io_ns),
                    EngField::Stall => f(e.stall_ns),
                    EngField::Mgmt => f(e.mgmt_ns),
                    EngField::Cpu => f(e.cpu_ns),
                    EngField::Majflt => f(e.majflt),
                    EngField::ReadBytes => f(e.read_bytes),
                    EngField::CacheHit => e.cache_hit_pct.filter(|v| *v >= 0.0),
                    EngField::DenseResident => e.dense_resident_frac.filter(|v| *v >= 0.0),
                    EngField::Rss => f(e.rss_bytes),
                    EngField::Swap => f(e.swap_bytes),
                }
            }
            Source::DenseResident => r?.dense_resident_frac,
            Source::DenseSwapped => r?.dense_swapped_frac,
            Source::ExpertsResident => r?.experts_resident_frac,
        }
    }
}

const MS: f64 = 1e-6;
const MB: f64 = 1e-6;

/// All metrics, in display order; the observer's rows are the vocabulary's
/// (label: the name; key: the name with the unit shown). Rows measured in none
/// of the compared runs are not shown.
pub fn metrics() -> Vec<Metric> {
    let m = |key: &str, label, unit, scale, hib, source| Metric {
        key: key.to_string(),
        label,
        unit,
        scale,
        higher_is_better: hib,
        source,
    };
    let time = |name: &'static str, label, source| m(&format!("{name}_ms"), label, "ms/token", MS, Some(false), source);
    let mut v = vec![
        m("tok_s", "tok/s", "tok/s", 1.0, Some(true), Source::TokS),
        time(Time::Wall.name(), Time::Wall.name(), Source::Wall),
    ];
    for c in Component::ALL {
        v.push(time(c.name(), c.name(), Source::Comp(c)));
    }
    v.extend([
        time(Time::EngineCompute.name(), Time::EngineCompute.name(), Source::EngineCompute),
        time(Time::Hidden.name(), "hidden (engine_compute − compute)", Source::Hidden),
        m("engine_io_ms", "engine io", "ms/token", MS, Some(false), Source::Engine(EngField::Io)),
        m("engine_stall_ms", "engine stall", "ms/token", MS, Some(false), Source::Engine(EngField::Stall)),
        m("engine_mgmt_ms", "engine mgmt", "ms/token", MS, Some(false), Source::Engine(EngField::Mgmt)),
        m("engine_cpu_ms", "engine cpu", "ms/token", MS, None, Source::Engine(EngField::Cpu)),
    ]);
    for c in Counter::ALL {
        let bytes = c.row().prom.is_some_and(|p| p.family.unit == Some(Unit::Bytes));
        v.push(if bytes {
            m(&c.name().replace("_bytes", "_mb"), c.name(), "MB/token", MB, None, Source::Counter(c))
        } else {
            m(c.name(), c.name(), "/token", 1.0, None, Source::Counter(c))
        });
    }
    // Evictions by who evicted (label: the actor kind).
    for (k, a) in observer_common::vocab::EVICTION_ACTORS.iter().enumerate() {
        v.push(m(&format!("evicted_by_{}", a.name), a.name, "evicted pages/token", 1.0, None, Source::EvictedBy(k)));
    }
    // Refaults by the kind of the eviction they undid, and their faults' fault_io.
    for (k, a) in observer_common::vocab::EVICTION_ACTORS.iter().enumerate() {
        v.push(m(
            &format!("refaulted_by_{}", a.name),
            a.name,
            "refaulted pages/token",
            1.0,
            None,
            Source::RefaultedBy(k),
        ));
        v.push(m(
            &format!("refault_io_{}_ms", a.name),
            a.name,
            "refault fault_io ms/token",
            MS,
            Some(false),
            Source::RefaultIo(k),
        ));
    }
    let frac = |r: ResidencyField, hib, source| m(r.name(), r.name(), "", 1.0, Some(hib), source);
    v.extend([
        m("engine_majflt", "engine majflt", "/token", 1.0, None, Source::Engine(EngField::Majflt)),
        m("engine_read_mb", "engine read", "MB/token", MB, None, Source::Engine(EngField::ReadBytes)),
        m("engine_cache_hit_pct", "engine cache hit", "%", 1.0, Some(true), Source::Engine(EngField::CacheHit)),
        frac(ResidencyField::DenseResident, true, Source::DenseResident),
        frac(ResidencyField::DenseSwapped, false, Source::DenseSwapped),
        frac(ResidencyField::ExpertsResident, true, Source::ExpertsResident),
        m(
            "engine_dense_resident_frac",
            "engine dense_resident_frac",
            "",
            1.0,
            Some(true),
            Source::Engine(EngField::DenseResident),
        ),
        m("engine_rss_mb", "engine rss", "MB", MB, None, Source::Engine(EngField::Rss)),
        m("engine_swap_mb", "engine swap", "MB", MB, None, Source::Engine(EngField::Swap)),
    ]);
    v
}

/// How intervals are computed.
#[derive(Debug, Clone, Serialize)]
pub struct Options {
    pub resamples: usize,
    pub seed: u64,
    /// More configuration keys to leave out of the grouping (besides [`IGNORED_KEYS`]).
    pub ignore: Vec<String>,
}

impl Default for Options {
    fn default() -> Self {
        Options { resamples: stats::DEFAULT_RESAMPLES, seed: stats::DEFAULT_SEED, ignore: Vec::new() }
    }
}

impl Options {
    pub fn describe(&self) -> String {
        format!(
            "95 % percentile bootstrap: {} resamples; each resample draws every run's generated tokens with replacement, \
             as many as the run has (stratified by run), seed {}. tok/s = tokens / Σ wall of the drawn tokens; \
             other rows are means over the drawn tokens where measured. Disjoint intervals = a real difference.",
            self.resamples, self.seed
        )
    }
}

/// Estimates of `metrics` over the pooled tokens of `runs`.
pub fn estimate(runs: &[&LoadedRun], metrics: &[Metric], opts: &Options, stream: u64) -> Vec<Estimate> {
    let strata: Vec<Stratum> = runs
        .iter()
        .map(|r| {
            Stratum::new(metrics.len(), r.summarised().into_iter().map(|t| metrics.iter().map(|m| m.term(t)).collect()))
        })
        .collect();
    stats::bootstrap(&strata, metrics.len(), opts.resamples, opts.seed, stream)
}

/// Per-token coefficient of variation of wall time.
pub fn wall_cv(run: &LoadedRun) -> Option<f64> {
    let w: Vec<f64> = run.summarised().iter().map(|t| t.wall_ns as f64).collect();
    stats::cv(&w)
}

/// The configuration a run is grouped by.
pub fn config_of(h: &RunHeader, ignore: &[String]) -> BTreeMap<String, String> {
    h.engine_config
        .iter()
        .filter(|(k, _)| !IGNORED_KEYS.contains(&k.as_str()) && !ignore.contains(k))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

#[derive(Debug, Clone, Serialize)]
pub struct RunInfo {
    /// `A`, or `A1`, `A2` when a side has several runs.
    pub label: String,
    pub side: String,
    pub path: String,
    pub format: Format,
    pub tokens: usize,
    pub tok_s: Estimate,
    pub wall_cv: Option<f64>,
    pub started_unix_ns: Option<u64>,
    pub boot_id: Option<String>,
    pub lost_events: u64,
    pub notes: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct SideInfo {
    pub name: String,
    pub runs: Vec<String>,
    pub config: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub metric: String,
    pub label: &'static str,
    pub unit: &'static str,
    pub a: Estimate,
    pub b: Estimate,
    pub delta: Option<f64>,
    pub delta_pct: Option<f64>,
    /// Whether the 95 % intervals are disjoint (`None`: not measured on both sides).
    pub disjoint: Option<bool>,
    pub verdict: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Setting {
    pub key: String,
    pub a: Option<String>,
    pub b: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Comparison {
    pub a: String,
    pub b: String,
    /// Settings that differ between the two sides.
    pub settings: Vec<Setting>,
    /// Run order of these two sides, e.g. `A-B-B-A`.
    pub order: String,
    pub order_balanced: bool,
    pub rows: Vec<Row>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Warning {
    pub kind: &'static str,
    pub message: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct DiffReport {
    pub resampling: String,
    pub options: Options,
    pub runs: Vec<RunInfo>,
    pub sides: Vec<SideInfo>,
    pub comparisons: Vec<Comparison>,
    pub warnings: Vec<Warning>,
}

fn side_name(i: usize) -> String {
    let mut s = String::new();
    let mut i = i;
    loop {
        s.insert(0, (b'A' + (i % 26) as u8) as char);
        if i < 26 {
            break;
        }
        i = i / 26 - 1;
    }
    s
}

fn file_name(r: &LoadedRun) -> String {
    r.path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| r.path.display().to_string())
}

fn pct(v: f64) -> String {
    format!("{:.0} %", v * 100.0)
}

/// UTC `YYYY-MM-DD HH:MM:SS` of Unix nanoseconds.
pub fn utc(ns: u64) -> String {
    let secs = ns / 1_000_000_000;
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let (y, m, d) = civil_from_days(days);
    format!("{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// Inverse of `import::bmoe::days_from_civil` (H. Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = if z >= 0 { z } else { z - 146_096 } / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (if m <= 2 { yoe + era * 400 + 1 } else { yoe + era * 400 }, m, d)
}

fn known(s: &str) -> Option<&str> {
    (!s.is_empty()).then_some(s)
}

/// Wall-clock duration of a run, ns.
fn duration_ns(r: &LoadedRun) -> u64 {
    let end =
        r.end.as_ref().map(|e| e.mono_ns).or_else(|| r.tokens.last().map(|t| t.start_ns + t.wall_ns)).unwrap_or(0);
    end.saturating_sub(r.header.started_mono_ns)
}

/// Compare runs. `runs` in the order the user gave them.
pub fn diff(runs: &[LoadedRun], opts: &Options) -> DiffReport {
    let metrics = metrics();
    let mut warnings = Vec::new();

    // Sides by configuration.
    let mut sides: Vec<(BTreeMap<String, String>, Vec<usize>)> = Vec::new();
    for (i, r) in runs.iter().enumerate() {
        let c = config_of(&r.header, &opts.ignore);
        match sides.iter_mut().find(|(sc, _)| *sc == c) {
            Some((_, v)) => v.push(i),
            None => sides.push((c, vec![i])),
        }
    }
    if sides.len() == 1 && runs.len() > 1 {
        warnings.push(Warning {
            kind: "config",
            message: "all runs have the same configuration: compared file by file (an A/A test of the noise)".into(),
        });
        let c = sides[0].0.clone();
        sides = (0..runs.len()).map(|i| (c.clone(), vec![i])).collect();
    }
    let mut side_of = vec![0usize; runs.len()];
    let mut labels = vec![String::new(); runs.len()];
    for (s, (_, members)) in sides.iter().enumerate() {
        for (k, &i) in members.iter().enumerate() {
            side_of[i] = s;
            labels[i] = if members.len() > 1 { format!("{}{}", side_name(s), k + 1) } else { side_name(s) };
        }
    }

    // Per run.
    let tok = &metrics[..1];
    let infos: Vec<RunInfo> = runs
        .iter()
        .enumerate()
        .map(|(i, r)| RunInfo {
            label: labels[i].clone(),
            side: side_name(side_of[i]),
            path: r.path.display().to_string(),
            format: r.format,
            tokens: r.summarised().len(),
            tok_s: estimate(&[r], tok, opts, i as u64)[0],
            wall_cv: wall_cv(r),
            started_unix_ns: (r.header.started_unix_ns > 0).then_some(r.header.started_unix_ns),
            boot_id: known(&r.header.boot_id).map(String::from),
            lost_events: r.lost_events(),
            notes: r.notes.clone(),
        })
        .collect();

    // Per side.
    let side_est: Vec<Vec<Estimate>> = sides
        .iter()
        .map(|(_, members)| {
            // The stream of the side's first run: a one-run side gets the
            // same interval as that run's own line.
            let rs: Vec<&LoadedRun> = members.iter().map(|&i| &runs[i]).collect();
            estimate(&rs, &metrics, opts, members[0] as u64)
        })
        .collect();

    // Time order, when every run knows its start.
    let by_time = runs.iter().all(|r| r.header.started_unix_ns > 0);
    let mut order: Vec<usize> = (0..runs.len()).collect();
    if by_time {
        order.sort_by_key(|&i| runs[i].header.started_unix_ns);
    }

    let mut comparisons = Vec::new();
    for b in 1..sides.len() {
        let (ca, cb) = (&sides[0].0, &sides[b].0);
        let keys: std::collections::BTreeSet<&String> = ca.keys().chain(cb.keys()).collect();
        let settings: Vec<Setting> = keys
            .into_iter()
            .filter(|k| ca.get(*k) != cb.get(*k))
            .map(|k| Setting { key: k.clone(), a: ca.get(k).cloned(), b: cb.get(k).cloned() })
            .collect();
        if settings.len() > 1 {
            warnings.push(Warning {
                kind: "config",
                message: format!(
                    "{} and {} differ in {} settings ({}): a difference cannot be put down to one of them",
                    side_name(0),
                    side_name(b),
                    settings.len(),
                    settings.iter().map(|s| s.key.as_str()).collect::<Vec<_>>().join(", ")
                ),
            });
        }
        let seq: Vec<usize> = order.iter().map(|&i| side_of[i]).filter(|&s| s == 0 || s == b).collect();
        let order_str = seq.iter().map(|&s| side_name(s)).collect::<Vec<_>>().join("-");
        let mean_pos = |side: usize| {
            let p: Vec<f64> = seq.iter().enumerate().filter(|(_, s)| **s == side).map(|(k, _)| k as f64).collect();
            p.iter().sum::<f64>() / p.len() as f64
        };
        let balanced = seq.len() > 2 && (mean_pos(0) - mean_pos(b)).abs() < 1e-9;
        let how = if by_time { "by start time" } else { "in the order given (start times unknown)" };
        if !balanced {
            let (x, y) = (side_name(seq[0]), side_name(if seq[0] == 0 { b } else { 0 }));
            warnings.push(Warning {
                kind: "order",
                message: if seq.len() == 2 {
                    format!(
                        "run order {order_str} ({how}), one run each: the later run can gain from a warm page cache or lose to heat; \
                         record {x}-{y}-{y}-{x} and pass all four to cancel linear drift"
                    )
                } else {
                    format!("run order {order_str} ({how}) is unbalanced: drift favours one side; an order like {x}-{y}-{y}-{x} cancels linear drift")
                },
            });
        }
        let rows = metrics
            .iter()
            .enumerate()
            .filter(|&(k, _)| side_est[0][k].n > 0 || side_est[b][k].n > 0)
            .map(|(k, m)| row(m, side_est[0][k], side_est[b][k], &side_name(b)))
            .collect();
        comparisons.push(Comparison {
            a: side_name(0),
            b: side_name(b),
            settings,
            order: order_str,
            order_balanced: balanced,
            rows,
        });
    }

    // Short runs.
    for (i, r) in runs.iter().enumerate() {
        let info = &infos[i];
        let side = side_of[i];
        let rel = comparisons
            .iter()
            .find(|c| c.b == side_name(side) || (side == 0 && c.a == side_name(0)))
            .and_then(|c| c.rows.first())
            .and_then(|row| row.delta_pct)
            .map(|p| p / 100.0);
        let needed = match (info.wall_cv, rel) {
            (Some(cv), Some(rel)) => stats::tokens_needed(cv, rel),
            _ => None,
        };
        let short = info.tokens < MIN_TOKENS || needed.is_some_and(|n| n > info.tokens as u64);
        if !short {
            continue;
        }
        let mut msg = format!("short run: {} ({}) has {} tokens", info.label, file_name(r), info.tokens);
        if info.tokens < MIN_TOKENS {
            msg.push_str(&format!(" (fewer than {MIN_TOKENS})"));
        }
        if let Some(cv) = info.wall_cv {
            msg.push_str(&format!(" and a per-token coefficient of variation of wall of {}", pct(cv)));
        }
        if let (Some(v), Some(ci)) = (info.tok_s.value, info.tok_s.ci95) {
            msg.push_str(&format!("; its tok/s is only known to ±{:.1} %", (ci.hi - ci.lo) / 2.0 / v * 100.0));
        }
        match (needed, rel) {
            (Some(n), Some(rel)) => msg.push_str(&format!(
                "; resolving the observed {:+.1} % tok/s difference at this variability needs ≈ {n} tokens per run",
                rel * 100.0
            )),
            _ => msg.push_str("; results are inconclusive unless the difference is large"),
        }
        warnings.push(Warning { kind: "short_run", message: msg });
    }

    // Runs of one side whose own tok/s intervals are disjoint: the token
    // bootstrap does not see variation between runs.
    for (s, (_, members)) in sides.iter().enumerate() {
        for (x, &i) in members.iter().enumerate() {
            for &j in &members[x + 1..] {
                if let (Some(a), Some(b)) = (infos[i].tok_s.ci95, infos[j].tok_s.ci95)
                    && a.disjoint(&b)
                {
                    warnings.push(Warning {
                        kind: "between_runs",
                        message: format!(
                            "runs of side {} disagree: {} {} vs {} {} tok/s (disjoint intervals); the intervals above \
                             resample tokens within runs and miss this run-to-run variation: record more runs",
                            side_name(s),
                            labels[i],
                            est(&infos[i].tok_s),
                            labels[j],
                            est(&infos[j].tok_s)
                        ),
                    });
                }
            }
        }
    }
    environment_warnings(runs, &labels, &order, by_time, &mut warnings);

    for (i, info) in infos.iter().enumerate() {
        if info.lost_events > 0 {
            warnings.push(Warning {
                kind: "lost",
                message: format!(
                    "{}: {} events were lost or dropped: some tokens may be under-counted",
                    labels[i], info.lost_events
                ),
            });
        }
        for n in &info.notes {
            warnings.push(Warning { kind: "input", message: format!("{}: {n}", labels[i]) });
        }
    }

    DiffReport {
        resampling: opts.describe(),
        options: opts.clone(),
        runs: infos,
        sides: sides
            .iter()
            .enumerate()
            .map(|(s, (c, members))| SideInfo {
                name: side_name(s),
                runs: members.iter().map(|&i| labels[i].clone()).collect(),
                config: c.clone(),
            })
            .collect(),
        comparisons,
        warnings,
    }
}

fn environment_warnings(runs: &[LoadedRun], labels: &[String], order: &[usize], by_time: bool, w: &mut Vec<Warning>) {
    type Field = fn(&RunHeader) -> String;
    let fields: [(&str, Field); 6] = [
        ("model", |h| h.model.as_ref().map(|m| m.hash.clone()).unwrap_or_default()),
        ("host", |h| h.host.clone()),
        ("kernel", |h| h.kernel.clone()),
        ("CPU", |h| h.cpu_model.clone()),
        ("observer mode", |h| h.mode.clone()),
        ("boot", |h| h.boot_id.clone()),
    ];
    for (what, get) in fields {
        let vals: Vec<(usize, String)> =
            runs.iter().enumerate().map(|(i, r)| (i, get(&r.header))).filter(|(_, v)| !v.is_empty()).collect();
        let distinct: std::collections::BTreeSet<&String> = vals.iter().map(|(_, v)| v).collect();
        if distinct.len() > 1 {
            let list = vals.iter().map(|(i, v)| format!("{} {v}", labels[*i])).collect::<Vec<_>>().join(", ");
            let (kind, why) = if what == "boot" {
                ("boot", "runs from different boots: page cache, zram and memory fragmentation start differently")
            } else {
                ("environment", "the runs are not from the same setup")
            };
            w.push(Warning { kind, message: format!("different {what}: {list}; {why}") });
        }
    }
    if by_time {
        let days: std::collections::BTreeSet<String> =
            runs.iter().map(|r| utc(r.header.started_unix_ns)[..10].to_string()).collect();
        if days.len() > 1 {
            w.push(Warning {
                kind: "day",
                message: format!(
                    "runs from different days ({}): compare pairs run back to back on the same boot",
                    days.into_iter().collect::<Vec<_>>().join(", ")
                ),
            });
        }
        for pair in order.windows(2) {
            let (p, n) = (&runs[pair[0]], &runs[pair[1]]);
            let p_end = p.header.started_unix_ns + duration_ns(p);
            let gap = n.header.started_unix_ns.saturating_sub(p_end) / 1_000_000_000;
            if gap > MAX_GAP_S {
                w.push(Warning {
                    kind: "gap",
                    message: format!(
                        "{} started {} min after {} ended: not back to back",
                        labels[pair[1]],
                        gap / 60,
                        labels[pair[0]]
                    ),
                });
            }
        }
    }
}

fn row(m: &Metric, a: Estimate, b: Estimate, bname: &str) -> Row {
    let (delta, delta_pct) = match (a.value, b.value) {
        (Some(x), Some(y)) => (Some(y - x), (x != 0.0).then(|| (y - x) / x.abs() * 100.0)),
        _ => (None, None),
    };
    let disjoint = match (a.ci95, b.ci95) {
        (Some(x), Some(y)) => Some(x.disjoint(&y)),
        _ => None,
    };
    let verdict = match (disjoint, delta) {
        (None, _) => "not measured on both sides".to_string(),
        (Some(false), _) if a.ci95 == b.ci95 && a.ci95.is_some_and(|c: Interval| c.lo == c.hi) => "same".into(),
        (Some(false), _) => "overlap: inconclusive".into(),
        (Some(true), Some(d)) => {
            let word = match (m.source, d > 0.0) {
                (Source::TokS, true) => "faster",
                (Source::TokS, false) => "slower",
                (_, true) => "higher",
                (_, false) => "lower",
            };
            let judgement = match m.higher_is_better {
                Some(h) if m.source != Source::TokS => {
                    if h == (d > 0.0) {
                        " (better)"
                    } else {
                        " (worse)"
                    }
                }
                _ => "",
            };
            format!("disjoint: {bname} {word}{judgement}")
        }
        (Some(true), None) => "disjoint".into(),
    };
    Row { metric: m.key.clone(), label: m.label, unit: m.unit, a, b, delta, delta_pct, disjoint, verdict }
}

// ---- rendering -------------------------------------------------------------

/// A number with precision suited to its size.
pub fn num(v: f64) -> String {
    let a = v.abs();
    if a == 0.0 {
        "0".into()
    } else if a >= 1000.0 {
        format!("{v:.0}")
    } else if a >= 100.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.3}")
    } else if a >= 0.01 {
        format!("{v:.4}")
    } else {
        format!("{v:.2e}")
    }
}

pub fn est(e: &Estimate) -> String {
    match (e.value, e.ci95) {
        (Some(v), Some(ci)) => format!("{} [{}, {}]", num(v), num(ci.lo), num(ci.hi)),
        (Some(v), None) => num(v),
        _ => "-".into(),
    }
}

fn metric_label(r: &Row) -> String {
    if r.unit.is_empty() || r.unit == r.label { r.label.to_string() } else { format!("{} ({})", r.label, r.unit) }
}

fn delta_cells(r: &Row) -> (String, String) {
    (
        r.delta.map(|d| if d > 0.0 { format!("+{}", num(d)) } else { num(d) }).unwrap_or_else(|| "-".into()),
        r.delta_pct.map(|p| format!("{p:+.1} %")).unwrap_or_else(|| "-".into()),
    )
}

fn run_line(r: &RunInfo) -> String {
    let started = r.started_unix_ns.map(|t| format!(", started {} UTC", utc(t))).unwrap_or_default();
    let cv = r.wall_cv.map(|c| format!(", CV of wall {}", pct(c))).unwrap_or_default();
    format!("{:<4} {}  ({}, {} tokens{started}{cv}) tok/s {}", r.label, r.path, r.format, r.tokens, est(&r.tok_s))
}

fn config_str(c: &BTreeMap<String, String>, keys: &[String]) -> String {
    keys.iter()
        .map(|k| format!("{k}={}", c.get(k).map(String::as_str).unwrap_or("(unset)")))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The terminal table.
pub fn render_text(d: &DiffReport) -> String {
    let mut o = String::new();
    o.push_str(&format!("observer diff: {} runs, {} sides\n", d.runs.len(), d.sides.len()));
    for r in &d.runs {
        o.push_str(&format!("  {}\n", run_line(r)));
    }
    for c in &d.comparisons {
        let keys: Vec<String> = c.settings.iter().map(|s| s.key.clone()).collect();
        let sa = d.sides.iter().find(|s| s.name == c.a);
        let sb = d.sides.iter().find(|s| s.name == c.b);
        o.push_str(&format!("\n{} vs {}", c.a, c.b));
        if let (Some(sa), Some(sb)) = (sa, sb)
            && !keys.is_empty()
        {
            o.push_str(&format!(": {}  →  {}", config_str(&sa.config, &keys), config_str(&sb.config, &keys)));
        }
        o.push_str(&format!("   (order {}{})\n", c.order, if c.order_balanced { ", balanced" } else { "" }));
        let ha = format!("{} mean [95 % CI]", c.a);
        let hb = format!("{} mean [95 % CI]", c.b);
        let labels: Vec<String> = c.rows.iter().map(metric_label).collect();
        let w0 = labels.iter().map(|l| l.chars().count()).max().unwrap_or(6).max(6);
        let ea: Vec<String> = c.rows.iter().map(|r| est(&r.a)).collect();
        let eb: Vec<String> = c.rows.iter().map(|r| est(&r.b)).collect();
        let w1 = ea.iter().map(|s| s.chars().count()).max().unwrap_or(0).max(ha.chars().count());
        let w2 = eb.iter().map(|s| s.chars().count()).max().unwrap_or(0).max(hb.chars().count());
        o.push_str(&format!("  {:<w0$}  {:<w1$}  {:<w2$}  {:>10}  {:>9}  verdict\n", "metric", ha, hb, "Δ", "Δ %"));
        for (k, r) in c.rows.iter().enumerate() {
            let (dd, dp) = delta_cells(r);
            o.push_str(&format!(
                "  {:<w0$}  {:<w1$}  {:<w2$}  {:>10}  {:>9}  {}\n",
                labels[k], ea[k], eb[k], dd, dp, r.verdict
            ));
        }
    }
    o.push_str(&format!("\nintervals: {}\n", d.resampling));
    if !d.warnings.is_empty() {
        o.push_str("warnings:\n");
        for w in &d.warnings {
            o.push_str(&format!("  ! {}\n", w.message));
        }
    }
    o
}

/// The same as a Markdown document.
pub fn render_markdown(d: &DiffReport) -> String {
    let esc = |s: &str| s.replace('|', "\\|");
    let mut o = String::new();
    o.push_str("## observer diff\n\n| run | file | format | tokens | tok/s [95 % CI] | CV of wall |\n|---|---|---|---:|---|---:|\n");
    for r in &d.runs {
        o.push_str(&format!(
            "| {} | `{}` | {} | {} | {} | {} |\n",
            r.label,
            esc(&r.path),
            r.format,
            r.tokens,
            est(&r.tok_s),
            r.wall_cv.map(pct).unwrap_or_else(|| "-".into())
        ));
    }
    for c in &d.comparisons {
        o.push_str(&format!("\n### {} vs {}\n\n", c.a, c.b));
        if !c.settings.is_empty() {
            let s = c
                .settings
                .iter()
                .map(|s| {
                    format!(
                        "`{}`: {} → {}",
                        esc(&s.key),
                        s.a.as_deref().unwrap_or("(unset)"),
                        s.b.as_deref().unwrap_or("(unset)")
                    )
                })
                .collect::<Vec<_>>()
                .join(", ");
            o.push_str(&format!("Settings: {s}. "));
        }
        o.push_str(&format!("Order: {}{}.\n\n", c.order, if c.order_balanced { " (balanced)" } else { "" }));
        o.push_str(&format!(
            "| metric | {} mean [95 % CI] | {} mean [95 % CI] | Δ | Δ % | verdict |\n|---|---|---|---:|---:|---|\n",
            c.a, c.b
        ));
        for r in &c.rows {
            let (dd, dp) = delta_cells(r);
            o.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} |\n",
                esc(&metric_label(r)),
                est(&r.a),
                est(&r.b),
                dd,
                dp,
                r.verdict
            ));
        }
    }
    o.push_str(&format!("\nIntervals: {}\n", d.resampling));
    if !d.warnings.is_empty() {
        o.push_str("\n**Warnings**\n\n");
        for w in &d.warnings {
            o.push_str(&format!("- {}\n", esc(&w.message)));
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn side_names_and_dates() {
        assert_eq!(side_name(0), "A");
        assert_eq!(side_name(25), "Z");
        assert_eq!(side_name(26), "AA");
        assert_eq!(utc(1_784_624_646_000_000_000), "2026-07-21 09:04:06");
        for d in [-1000i64, 0, 11_017, 20_000, 60_000] {
            let (y, m, dd) = civil_from_days(d);
            assert_eq!(crate::store::import::bmoe::days_from_civil(y, m, dd), d);
        }
    }

    #[test]
    fn numbers() {
        assert_eq!(num(2.98098), "2.981");
        assert_eq!(num(471.629), "471.6");
        assert_eq!(num(0.852), "0.8520");
        assert_eq!(num(-0.0264), "-0.0264");
    }
}
