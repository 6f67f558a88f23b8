//! Text rendered from the vocabulary: Prometheus metric names and the README's tables.

extern crate alloc;

use alloc::{
    format,
    string::{String, ToString},
    vec::Vec,
};

use super::*;

/// A family's full metric name: `moe_observer_<stem>[_<unit>][_total]`
/// (`_total` for counters; a histogram's series add `_bucket`, `_sum`, `_count`).
pub fn metric_name(f: &Family) -> String {
    let mut s = format!("{PROM_PREFIX}_{}", f.stem);
    if let Some(u) = f.unit {
        s.push('_');
        s.push_str(u.name());
    }
    if f.metric == MetricType::Counter {
        s.push_str("_total");
    }
    s
}

/// A row's series without the prefix, e.g. `time_seconds_total{component="compute"}`.
pub fn series_text(r: &Row) -> Option<String> {
    let s = r.prom?;
    let name = metric_name(s.family);
    let name = name.strip_prefix(PROM_PREFIX).and_then(|n| n.strip_prefix('_')).unwrap_or(&name).to_string();
    Some(match s.label {
        Some((k, v)) => format!("{name}{{{k}=\"{v}\"}}"),
        None => name,
    })
}

/// Metric names of the releases before this vocabulary, and what replaced them.
pub static METRIC_RENAMES: [(&str, &str); 29] = [
    ("moe_observer_steps_total{kind}", "moe_observer_step_duration_seconds_count{step}"),
    ("moe_observer_tokens_total{kind}", "moe_observer_tokens_total{step}"),
    ("moe_observer_wall_seconds_total{kind}", "moe_observer_step_duration_seconds_sum{step}"),
    ("moe_observer_token_duration_seconds{kind}", "moe_observer_step_duration_seconds{step}"),
    ("moe_observer_compute_seconds_total{kind}", "moe_observer_time_seconds_total{step,component=\"compute\"}"),
    ("moe_observer_fault_minor_seconds_total{kind}", "moe_observer_time_seconds_total{step,component=\"fault_minor\"}"),
    ("moe_observer_swapin_zram_seconds_total{kind}", "moe_observer_time_seconds_total{step,component=\"swapin_zram\"}"),
    ("moe_observer_fault_io_seconds_total{kind}", "moe_observer_time_seconds_total{step,component=\"fault_io\"}"),
    ("moe_observer_io_wait_seconds_total{kind}", "moe_observer_time_seconds_total{step,component=\"io_wait\"}"),
    ("moe_observer_reclaim_seconds_total{kind}", "moe_observer_time_seconds_total{step,component=\"reclaim\"}"),
    ("moe_observer_syscall_seconds_total{kind}", "moe_observer_time_seconds_total{step,component=\"syscall\"}"),
    ("moe_observer_runqueue_seconds_total{kind}", "moe_observer_time_seconds_total{step,component=\"runqueue\"}"),
    ("moe_observer_sleep_seconds_total{kind}", "moe_observer_time_seconds_total{step,component=\"sleep\"}"),
    ("moe_observer_engine_compute_seconds_total{kind}", "moe_observer_engine_compute_seconds_total{step}"),
    ("moe_observer_engine_steps_total{kind}", "moe_observer_engine_steps_total{step}"),
    ("moe_observer_engine_steps_compute_seconds_total{kind}", "moe_observer_engine_steps_compute_seconds_total{step}"),
    ("moe_observer_majflt_file_total{kind}", "moe_observer_faults_total{step,kind=\"file\"}"),
    ("moe_observer_majflt_swap_total{kind}", "moe_observer_faults_total{step,kind=\"swap\"}"),
    ("moe_observer_minflt_total{kind}", "moe_observer_faults_total{step,kind=\"minor\"}"),
    ("moe_observer_swapins_total{kind}", "moe_observer_swapin_pages_total{step}"),
    ("moe_observer_read_bytes_total{kind}", "moe_observer_read_bytes_total{step}"),
    ("moe_observer_pagecache_added_total{kind}", "moe_observer_pagecache_added_pages_total{step}"),
    ("moe_observer_pagecache_evicted_total{kind}", "moe_observer_pagecache_evicted_pages_total{step}"),
    ("moe_observer_ctx_switches_total{kind}", "moe_observer_context_switches_total{step}"),
    ("moe_observer_fault_minor_latency_seconds", "moe_observer_fault_latency_seconds{kind=\"minor\"}"),
    ("moe_observer_fault_major_file_latency_seconds", "moe_observer_fault_latency_seconds{kind=\"file\"}"),
    ("moe_observer_fault_major_swap_latency_seconds", "moe_observer_fault_latency_seconds{kind=\"swap\"}"),
    ("moe_observer_zram_read_latency_seconds", "moe_observer_block_read_latency_seconds{kind=\"zram\"}"),
    ("moe_observer_disk_read_latency_seconds", "moe_observer_block_read_latency_seconds{kind=\"disk\"}"),
];

/// The sections of the README rendered from this table, by marker name
/// (`<!-- vocab:NAME -->` … `<!-- /vocab:NAME -->`).
pub const README_SECTIONS: [&str; 12] = [
    "components",
    "times",
    "counters",
    "residency",
    "grid",
    "histograms",
    "steps",
    "eviction_actors",
    "explicit_reads",
    "breakdowns",
    "prometheus",
    "changes",
];

fn code(s: &str) -> String {
    format!("`{s}`")
}

fn prom_cell(r: &Row) -> String {
    series_text(r).map(|s| code(&s)).unwrap_or_else(|| "—".into())
}

fn what(r: &Row) -> String {
    match r.status {
        Status::Measured => r.help.to_string(),
        Status::Planned(by) => format!("{} (not measured yet: {by})", r.help),
    }
}

fn cpu_cell(c: Option<Cpu>) -> &'static str {
    match c {
        Some(Cpu::Yes) => "yes",
        Some(Cpu::No) => "no",
        Some(Cpu::Both { .. }) => "both",
        Some(Cpu::Unknown) | None => "—",
    }
}

fn table(head: &[&str], rows: impl Iterator<Item = Vec<String>>) -> String {
    let mut s = format!("| {} |\n|", head.join(" | "));
    for _ in head {
        s.push_str("---|");
    }
    s.push('\n');
    for r in rows {
        s.push_str(&format!("| {} |\n", r.join(" | ")));
    }
    s
}

fn type_name(m: MetricType) -> &'static str {
    match m {
        MetricType::Counter => "counter",
        MetricType::Gauge => "gauge",
        MetricType::Histogram => "histogram",
    }
}

/// A family's labels: its own, then those of its measured rows; planned ones in parentheses.
fn labels_cell(f: &Family) -> String {
    let mut labels: Vec<&str> = f.labels.to_vec();
    for r in rows().filter(|r| r.measured()) {
        if let Some(Series { family, label: Some((k, _)) }) = r.prom
            && family.stem == f.stem
            && !labels.contains(&k)
        {
            labels.push(k);
        }
    }
    let mut s = labels.iter().map(|l| code(l)).collect::<Vec<_>>().join(", ");
    if !f.planned_labels.is_empty() {
        let p = f.planned_labels.iter().map(|l| code(l)).collect::<Vec<_>>().join(", ");
        s = if s.is_empty() { format!("(planned: {p})") } else { format!("{s} (planned: {p})") };
    }
    s
}

/// The markdown of one README section (see [`README_SECTIONS`]).
pub fn readme_section(name: &str) -> Option<String> {
    let plain = |rs: &[Row], head: [&str; 5]| {
        table(&head, rs.iter().map(|r| Vec::from([code(r.name), code(r.json), code(r.short), prom_cell(r), what(r)])))
    };
    Some(match name {
        "components" => table(
            &["component", "JSON", "short", "on CPU?", "Prometheus", "what it is"],
            COMPONENTS.iter().map(|r| {
                Vec::from([code(r.name), code(r.json), code(r.short), cpu_cell(r.cpu).into(), prom_cell(r), what(r)])
            }),
        ),
        "times" => plain(&TIMES, ["time", "JSON", "short", "Prometheus", "what it is"]),
        "counters" => {
            let rs: Vec<Row> = COUNTERS.iter().chain(HEALTH.iter()).copied().collect();
            plain(&rs, ["counter", "JSON", "short", "Prometheus", "what it counts"])
        }
        "residency" => plain(&RESIDENCY, ["residency", "JSON", "short", "Prometheus", "what it is"]),
        "grid" => table(
            &["grid layer (JSON key)", "short", "what it is, per expert"],
            GRID_LAYERS.iter().map(|r| Vec::from([code(r.json), code(r.short), what(r)])),
        ),
        "histograms" => table(
            &["latency of", "short", "Prometheus", "what it times", "older name"],
            HISTOGRAMS.iter().map(|r| {
                Vec::from([
                    code(r.name),
                    code(r.short),
                    prom_cell(r),
                    what(r),
                    r.aliases.iter().map(|a| code(a)).collect::<Vec<_>>().join(", "),
                ])
            }),
        ),
        "steps" => table(
            &["step (label `step`)", "short", "what it is"],
            STEPS.iter().map(|r| Vec::from([code(r.name), code(r.short), what(r)])),
        ),
        "eviction_actors" => table(
            &["actor (label `actor`)", "short", "who evicted"],
            EVICTION_ACTORS.iter().map(|r| Vec::from([code(r.name), code(r.short), what(r)])),
        ),
        "explicit_reads" => table(
            &["region (label `region`)", "short", "Prometheus", "what it counts"],
            EXPLICIT_READS.iter().map(|r| Vec::from([code(r.name), code(r.short), prom_cell(r), what(r)])),
        ),
        "breakdowns" => table(
            &["rows", "JSON", "what they are"],
            BREAKDOWNS.iter().map(|r| Vec::from([code(r.name), code(r.json), what(r)])),
        ),
        "prometheus" => {
            let mut t = table(
                &["metric", "type", "labels", "what"],
                FAMILIES.iter().map(|f| {
                    Vec::from([code(&metric_name(f)), type_name(f.metric).into(), labels_cell(f), f.help.into()])
                }),
            );
            let target = TARGET_LABELS.map(code).join(", ");
            let machine = MACHINE_FAMILIES.iter().map(|f| code(&metric_name(f))).collect::<Vec<_>>().join(" and ");
            t.push_str(&format!(
                "\nUnder `observer serve --discover` every series but those of {machine} carries the target labels {target} first.\n"
            ));
            t
        }
        "changes" => {
            table(&["before", "now"], METRIC_RENAMES.iter().map(|(old, new)| Vec::from([code(old), code(new)])))
        }
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_prometheus_conventions() {
        assert_eq!(metric_name(&F_TIME), "moe_observer_time_seconds_total");
        assert_eq!(metric_name(&F_FAULTS), "moe_observer_faults_total");
        assert_eq!(metric_name(&F_SWAPIN), "moe_observer_swapin_pages_total");
        assert_eq!(metric_name(&F_STEP_DURATION), "moe_observer_step_duration_seconds");
        assert_eq!(metric_name(&F_DENSE_RESIDENT), "moe_observer_dense_resident_ratio");
        assert_eq!(series_text(Component::Compute.row()).unwrap(), "time_seconds_total{component=\"compute\"}");
        assert_eq!(series_text(Counter::MajfltFile.row()).unwrap(), "faults_total{kind=\"file\"}");
        for f in FAMILIES {
            let n = metric_name(f);
            assert!(n.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'), "{n}");
            assert_eq!(FAMILIES.iter().filter(|g| metric_name(g) == n).count(), 1, "{n} twice");
            for l in f.labels.iter().chain(f.planned_labels) {
                assert!(!["pid", "tid"].contains(l), "{n}: unbounded label {l}");
            }
        }
        // The help of the name family says the bound the exporter applies.
        assert!(F_PAGECACHE_EVICTED_BY_NAME.help.contains(&format!("the first {TOP_ACTOR_NAMES} names")));
        // Every family a row points to is exported.
        for r in rows() {
            if let Some(s) = r.prom {
                assert!(FAMILIES.iter().any(|f| f.stem == s.family.stem), "{}: family not in FAMILIES", r.name);
            }
        }
    }

    #[test]
    fn old_histogram_names_map_to_the_new_ones() {
        assert_eq!(canonical(Class::Histogram, "fault_major_file"), Some("majflt_file"));
        assert_eq!(canonical(Class::Histogram, "majflt_file"), Some("majflt_file"));
        assert_eq!(canonical(Class::Histogram, "fault_minor"), Some("minflt"));
        assert_eq!(canonical(Class::Histogram, "nope"), None);
        // An alias never shadows a current name of the class.
        for r in HISTOGRAMS.iter() {
            for a in r.aliases {
                assert!(HISTOGRAMS.iter().all(|o| o.name != *a), "{a}");
            }
        }
    }

    #[test]
    fn every_section_renders() {
        for s in README_SECTIONS {
            let t = readme_section(s).unwrap();
            assert!(t.lines().count() > 2, "{s}");
        }
        assert!(readme_section("components").unwrap().contains(
            "| `compute` | `compute_ns` | `compute` | yes | `time_seconds_total{component=\"compute\"}` | user-mode time: measured, not a residual |"
        ));
        // A renamed metric is gone from the families.
        let base = |s: &str| s.split('{').next().unwrap().to_string();
        for (old, new) in METRIC_RENAMES.iter() {
            if base(old) != base(new) {
                assert!(FAMILIES.iter().all(|f| metric_name(f) != base(old)), "{old} still exported");
            }
        }
    }
}
