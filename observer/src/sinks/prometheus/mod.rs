//! Prometheus / OpenMetrics exporter: a [`Sink`] that keeps a
//! `prometheus-client` registry up to date from the model stream, and a small
//! HTTP endpoint ([`http`]) that serves it.
//!
//! ## Spec of the exported metrics
//! Every family, its name, type, labels and help text is a row of
//! `observer_common::vocab::FAMILIES` (rendered in the README's Prometheus
//! table); each vocabulary name that is exported points to its family and the
//! label value that tells it apart. Names follow Prometheus conventions: a
//! family per kind of quantity with the name as a label
//! (`moe_observer_time_seconds_total{component="compute"}`,
//! `moe_observer_faults_total{kind="file"}`, node_exporter's
//! `node_cpu_seconds_total{mode}` pattern), base units in the name (seconds,
//! bytes, pages), `_total` for counters. There are no PID or TID labels. A
//! value that was never measured has no series at all (never a 0).
//!
//! From each token record (one *step*: a generated token, the prompt, a
//! `--token-symbol` call or a `--window`), label `step` =
//! `prompt|generate|call|window`:
//! - `step_duration_seconds`: histogram of the steps' wall time, log2 buckets
//!   `le = 2^b ns` (b = 8..=38, the kernel's grid), exact `_sum` (the wall time)
//!   and `_count` (the steps); `tokens_total`: tokens processed (the step's
//!   `n_tokens`; windows are not tokens and are not counted);
//! - `time_seconds_total{component}`: the token record's components (the mean
//!   over the threads that ran), so that they add up to
//!   `step_duration_seconds_sum` less the residual;
//!   `rate(time_seconds_total) / rate(step_duration_seconds_count)` is the time
//!   per step;
//! - `engine_compute_seconds_total`: the engine's own `compute` (its residual),
//!   `engine_steps_total` and `engine_steps_compute_seconds_total` (the
//!   measured `compute` of the same steps): over the steps where both are known,
//!   so `engine_compute − engine_steps_compute` is exactly the hidden cost;
//! - counters summed over threads, each where the vocabulary puts it:
//!   `faults_total{kind="minor|file|swap"}`, `swapin_pages_total`,
//!   `read_bytes_total`, `pagecache_added_pages_total`,
//!   `pagecache_evicted_pages_total`, `context_switches_total`;
//!   `pagecache_evicted_pages_total` has a label `actor` (the kinds of
//!   `vocab::EVICTION_ACTORS`, every kind once measured) for steps whose record
//!   splits it by who evicted (`TokenRecord::evicted_by`), and none otherwise,
//!   so that the sum over the family is the evicted pages either way;
//! - refaults, from the steps whose record carries them (`TokenRecord::refaults`), each with the
//!   label `actor` (the kind of the eviction they undid): `refaulted_pages_total` (pages added
//!   back), `refault_faults_total` (the observed threads' faults that brought them back) and
//!   `refault_io_seconds_total` (those faults' `fault_io`).
//!
//! Who evicted, by process name, from the per-process eviction lists of the process samples and
//! the run's totals (`ProcessEvictions`, cumulative): `pagecache_evicted_by_name_pages_total`
//! with labels `actor` (the kind) and `actor_name` (the process's comm). The exporter gives at
//! most `vocab::TOP_ACTOR_NAMES` names a label of their own, for its whole life (a counter keeps
//! its label): names are admitted as they come, most pages first within a sample, until that many
//! are taken; every other name is `other`. Per kind, a name's series is its pages so far, and
//! `other` is the kind's total less the named series, so the series add up to the kind's total
//! exactly (counters never go down: in the rare case that a named process leaves the bounded
//! per-process list, evicts more and comes back, those pages are counted under `other` and again
//! under its name).
//! - `explicit_read_bytes_total{region}` and `explicit_read_time_seconds_total{region}`: the
//!   steps' `read`/`pread` calls on the model file by kind of region (`vocab::EXPLICIT_READS`:
//!   `dense`, `experts`, `other`; never per expert), when measured (`TokenRecord::explicit_reads`).
//!
//! Residency, from the latest token record that carries it (gauges):
//! `dense_resident_ratio`, `dense_swapped_ratio`, `experts_resident_ratio`,
//! and `layer_experts_resident_ratio{layer}` (mean over the layer's experts;
//! per layer, not per expert, to keep cardinality bounded).
//!
//! Process samples (gauges, absent when no target runs): `target_rss_bytes`,
//! `target_rss_anon_bytes`, `target_rss_file_bytes`, `target_swap_bytes`,
//! `mem_available_bytes` (the machine's).
//!
//! Kernel latency histograms ([`kernel`]): `fault_latency_seconds{kind}` and
//! `block_read_latency_seconds{kind}`, with the kernel's exact `_sum` and
//! `_count` (absent for a histogram replayed from a trace recorded before the
//! kernel kept sums).
//!
//! The observer's health: `lost_events_total`, `probes_attached`,
//! `probes_missing`, `degraded{feature}` (1 per feature the run lacks, from
//! the header's `degraded`; each also said once in `/healthz`; gauges while a
//! target runs), `bpf_run_seconds_total` and
//! `bpf_runs_total` (the observer's eBPF programs, when the kernel's BPF
//! statistics are available), `target_up`,
//! `runs_total` (targets observed; `observer serve` follows restarts) and
//! `build_info{version,trace_format}` (always 1). `target_up` is the number
//! of targets observed now (per label set under `serve --discover`; 0 or 1
//! otherwise).
//!
//! Counters never go down, also across target restarts: per-run cumulative
//! inputs (kernel histograms, lost events, BPF run time) are added as deltas.
//!
//! ## Several targets at once
//! Each target's sink ([`Exporter::target_sink`]) puts the target's labels
//! (`vocab::TARGET_LABELS`: engine, model, container) first on every series
//! of every per-target family (all but `vocab::MACHINE_FAMILIES`), so that
//! `observer serve --discover` exports the targets it observes side by side.
//! A sink without them ([`Exporter::sink`]: `observer run`, `serve --pid`,
//! `--name`, a command) exports the same series without those labels. When a
//! target ends its gauges are removed (they go stale) and `target_up` drops
//! by one; its counters stay, so rates over them stay right. Label sets are
//! bounded by the caller (`serve --max-targets`). Processes that share a
//! label set (two replicas of one model on the host) add into the same
//! counters, `target_up` counts them, and a gauge shows the latest sample of
//! either; its gauges go once the last of them ends. A target's labels may
//! change while it runs ([`MetricsSink::follow_labels`]: a model mapped after
//! it was found): its gauges and `target_up` move to the new label set, which
//! counts it as a run; its counters go on under the new set, and what they
//! counted before stays under the old one.

pub mod http;
pub mod kernel;
pub mod value;

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
};

use observer_common::{
    model::{
        Component, Event, LatencyHistograms, ObserverHealth, ProcessEvictions, ProcessSample, StepKind, TokenRecord,
    },
    vocab::{self, Family as VocabFamily, Row, Unit as VocabUnit},
};
use prometheus_client::{
    encoding::{EncodeMetric, prometheus_text, text},
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::{Registry, Unit},
};

use crate::sinks::Sink;
pub use http::{Endpoint, MetricsError, parse_addr};
use kernel::KernelHists;
use value::{Count, Level, Seconds};

/// Prefix of every metric name.
pub const PREFIX: &str = vocab::PROM_PREFIX;

/// Exposition formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// OpenMetrics 1.0 text.
    OpenMetrics,
    /// Prometheus text format 0.0.4 (what `promtool check metrics` reads).
    Text,
}

impl Format {
    pub const fn content_type(self) -> &'static str {
        match self {
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
            Format::Text => prometheus_text::CONTENT_TYPE,
        }
    }
}

/// A series' labels: (name, value) pairs, names from the vocabulary; a
/// target's labels (`vocab::TARGET_LABELS`) first, when it has them.
pub type Labels = Vec<(&'static str, String)>;

/// Exported log2 bounds of `step_duration_seconds` (same grid as the kernel's).
fn duration_buckets() -> impl Iterator<Item = f64> {
    (kernel::FIRST_BUCKET..=kernel::LAST_BUCKET).map(|b| (1u64 << b) as f64 / 1e9)
}

fn new_duration_histogram() -> Histogram {
    Histogram::new(duration_buckets())
}

type Steps = Family<Labels, Counter>;
type Times = Family<Labels, Seconds>;
/// Labels with computed values (a layer number, a version).
pub type OwnedLabels = Labels;
/// Per-target gauges: a series exists only while measured.
type Levels = Family<Labels, Level>;
type Counts = Family<Labels, Count>;

/// Register `metric` as the vocabulary's family `f` (name, unit, help).
fn register(
    r: &mut Registry,
    f: &VocabFamily,
    metric: impl EncodeMetric + Clone + Send + Sync + std::fmt::Debug + 'static,
) {
    match f.unit {
        Some(u) => r.register_with_unit(
            f.stem,
            f.help,
            match u {
                VocabUnit::Seconds => Unit::Seconds,
                VocabUnit::Bytes => Unit::Bytes,
                VocabUnit::Pages => Unit::Other(u.name().into()),
            },
            metric,
        ),
        None => r.register(f.stem, f.help, metric),
    }
}

/// The registry and the handles the sink updates. Shared (`Arc`) between the
/// run loop (sinks) and the HTTP endpoint; all updates are atomics or short
/// critical sections, so a scrape never holds up the run loop for long.
#[derive(Debug)]
pub struct Exporter {
    registry: Registry,
    tokens: Steps,
    duration: Family<Labels, Histogram, fn() -> Histogram>,
    /// Families of the vocabulary's components and counters, by stem.
    times: BTreeMap<&'static str, Times>,
    counts: BTreeMap<&'static str, Steps>,
    /// Explicit reads of the model by region (`vocab::EXPLICIT_READS`): bytes and time.
    explicit_read: Steps,
    explicit_read_time: Times,
    engine_compute: Times,
    engine_steps: Steps,
    engine_steps_compute: Times,
    dense_resident: Levels,
    dense_swapped: Levels,
    experts_resident: Levels,
    layer_resident: Levels,
    rss: Levels,
    rss_anon: Levels,
    rss_file: Levels,
    swap: Levels,
    mem_available: Level,
    lost_events: Counts,
    probes_attached: Levels,
    probes_missing: Levels,
    degraded_features: Levels,
    bpf_run: Times,
    bpf_runs: Counts,
    refaulted: Steps,
    refault_faults: Steps,
    refault_io: Times,
    evicted_by_name: Steps,
    /// The process names that have an `actor_name` of their own (at most `vocab::TOP_ACTOR_NAMES`).
    actor_names: Mutex<Vec<String>>,
    target_up: Family<Labels, Gauge>,
    runs: Steps,
    kernel: Mutex<KernelHists>,
    /// What does not work with the privileges or kernel given (`/healthz`).
    degraded: Mutex<Vec<String>>,
}

impl Exporter {
    /// An exporter for one target at a time, without target labels
    /// ([`Exporter::sink`]): `target_up` and `runs_total` are shown from the start.
    pub fn new() -> Arc<Exporter> {
        Exporter::build(true)
    }

    /// An exporter for several targets at once, each with its labels
    /// ([`Exporter::target_sink`]): a target's series appear with it.
    pub fn per_target() -> Arc<Exporter> {
        Exporter::build(false)
    }

    fn build(single: bool) -> Arc<Exporter> {
        let mut r = Registry::with_prefix(PREFIX);
        let duration = Family::<Labels, Histogram, fn() -> Histogram>::new_with_constructor(
            new_duration_histogram as fn() -> Histogram,
        );
        register(&mut r, &vocab::F_STEP_DURATION, duration.clone());
        let tokens = Steps::default();
        register(&mut r, &vocab::F_TOKENS, tokens.clone());
        // The families the vocabulary's components and counters point to.
        let mut times = BTreeMap::new();
        let mut counts = BTreeMap::new();
        let rows =
            Component::ALL.iter().map(|c| c.row()).chain(observer_common::model::Counter::ALL.iter().map(|c| c.row()));
        for row in rows {
            let Some(s) = row.prom else { continue };
            let f = s.family;
            if times.contains_key(f.stem) || counts.contains_key(f.stem) {
                continue;
            }
            if f.unit == Some(VocabUnit::Seconds) {
                let fam = Times::default();
                register(&mut r, f, fam.clone());
                times.insert(f.stem, fam);
            } else {
                let fam = Steps::default();
                register(&mut r, f, fam.clone());
                counts.insert(f.stem, fam);
            }
        }
        let explicit_read = Steps::default();
        register(&mut r, &vocab::F_EXPLICIT_READ, explicit_read.clone());
        let explicit_read_time = Times::default();
        register(&mut r, &vocab::F_EXPLICIT_READ_TIME, explicit_read_time.clone());
        let engine_compute = Times::default();
        register(&mut r, &vocab::F_ENGINE_COMPUTE, engine_compute.clone());
        let engine_steps = Steps::default();
        register(&mut r, &vocab::F_ENGINE_STEPS, engine_steps.clone());
        let engine_steps_compute = Times::default();
        register(&mut r, &vocab::F_ENGINE_STEPS_COMPUTE, engine_steps_compute.clone());
        let levels = |r: &mut Registry, f: &VocabFamily| {
            let l = Levels::default();
            register(r, f, l.clone());
            l
        };
        let dense_resident = levels(&mut r, &vocab::F_DENSE_RESIDENT);
        let dense_swapped = levels(&mut r, &vocab::F_DENSE_SWAPPED);
        let experts_resident = levels(&mut r, &vocab::F_EXPERTS_RESIDENT);
        let layer_resident = levels(&mut r, &vocab::F_LAYER_EXPERTS_RESIDENT);
        let rss = levels(&mut r, &vocab::F_TARGET_RSS);
        let rss_anon = levels(&mut r, &vocab::F_TARGET_RSS_ANON);
        let rss_file = levels(&mut r, &vocab::F_TARGET_RSS_FILE);
        let swap = levels(&mut r, &vocab::F_TARGET_SWAP);
        let mem_available = Level::default();
        register(&mut r, &vocab::F_MEM_AVAILABLE, mem_available.clone());
        let lost_events = Counts::default();
        register(&mut r, &vocab::F_LOST_EVENTS, lost_events.clone());
        let probes_attached = levels(&mut r, &vocab::F_PROBES_ATTACHED);
        let probes_missing = levels(&mut r, &vocab::F_PROBES_MISSING);
        let degraded_features = levels(&mut r, &vocab::F_DEGRADED);
        let bpf_run = Times::default();
        register(&mut r, &vocab::F_BPF_RUN, bpf_run.clone());
        let bpf_runs = Counts::default();
        register(&mut r, &vocab::F_BPF_RUNS, bpf_runs.clone());
        let steps = |r: &mut Registry, f: &VocabFamily| {
            let l = Steps::default();
            register(r, f, l.clone());
            l
        };
        let evicted_by_name = steps(&mut r, &vocab::F_PAGECACHE_EVICTED_BY_NAME);
        let refaulted = steps(&mut r, &vocab::F_REFAULTED);
        let refault_faults = steps(&mut r, &vocab::F_REFAULT_FAULTS);
        let refault_io = Times::default();
        register(&mut r, &vocab::F_REFAULT_IO, refault_io.clone());
        let target_up = Family::<Labels, Gauge>::default();
        let runs = Steps::default();
        if single {
            // Without target labels there is one target slot, shown from the start.
            target_up.get_or_create(&Vec::new()).set(0);
            let _created = runs.get_or_create(&Vec::new());
        }
        register(&mut r, &vocab::F_TARGET_UP, target_up.clone());
        register(&mut r, &vocab::F_RUNS, runs.clone());
        let build_info = Family::<OwnedLabels, Gauge>::default();
        build_info.get_or_create(&build_info_labels()).set(1);
        register(&mut r, &vocab::F_BUILD_INFO, build_info);
        Arc::new(Exporter {
            registry: r,
            tokens,
            duration,
            times,
            counts,
            explicit_read,
            explicit_read_time,
            engine_compute,
            engine_steps,
            engine_steps_compute,
            dense_resident,
            dense_swapped,
            experts_resident,
            layer_resident,
            rss,
            rss_anon,
            rss_file,
            swap,
            mem_available,
            lost_events,
            probes_attached,
            probes_missing,
            degraded_features,
            bpf_run,
            bpf_runs,
            refaulted,
            refault_faults,
            refault_io,
            evicted_by_name,
            actor_names: Mutex::new(Vec::new()),
            target_up,
            runs,
            kernel: Mutex::new(KernelHists::default()),
            degraded: Mutex::new(Vec::new()),
        })
    }

    /// The whole exposition in `format`.
    pub fn render(&self, format: Format) -> Result<String, std::fmt::Error> {
        let mut s = String::with_capacity(32 << 10);
        match format {
            Format::OpenMetrics => text::encode_registry(&mut s, &self.registry)?,
            Format::Text => prometheus_text::encode(&mut s, &self.registry)?,
        }
        // The sink takes this lock for each Histograms event: hold it only
        // for these few families.
        self.kernel.lock().unwrap_or_else(|p| p.into_inner()).encode(&mut s, format)?;
        if format == Format::OpenMetrics {
            text::encode_eof(&mut s)?;
        }
        Ok(s)
    }

    /// Record, once, a feature that cannot work here (shown by `/healthz`).
    pub fn degrade(&self, what: impl Into<String>) {
        let what = what.into();
        let mut d = self.degraded.lock().unwrap_or_else(|p| p.into_inner());
        if !d.contains(&what) {
            d.push(what);
        }
    }

    /// The `/healthz` body: `ok`, then one `degraded: …` line per feature
    /// that cannot work here.
    pub fn health(&self) -> String {
        let d = self.degraded.lock().unwrap_or_else(|p| p.into_inner());
        let mut s = String::from("ok\n");
        for what in d.iter() {
            s.push_str(&format!("degraded: {what}\n"));
        }
        s
    }

    /// A sink feeding this exporter (one per target lifetime), its series
    /// without target labels.
    pub fn sink(self: &Arc<Self>) -> MetricsSink {
        self.target_sink(Vec::new())
    }

    /// A sink feeding this exporter for one of several targets observed at
    /// once: `target` ([`target_labels`]) comes first on each of its series.
    pub fn target_sink(self: &Arc<Self>, target: Labels) -> MetricsSink {
        MetricsSink {
            ex: Arc::clone(self),
            target,
            relabel: None,
            running: false,
            degraded: Vec::new(),
            layers: Vec::new(),
            run: RunState::default(),
            steps: Default::default(),
            _endpoint: None,
        }
    }

    fn step_handles(&self, target: &Labels, k: StepKind) -> StepHandles {
        let mut step = target.clone();
        step.push((STEP_LABEL, k.name().to_string()));
        StepHandles {
            tokens: (k != StepKind::Window).then(|| self.tokens.get_or_create_owned(&step)),
            duration: self.duration.get_or_create_owned(&step),
            components: Default::default(),
            counters: Default::default(),
            evicted_by: Default::default(),
            refaults: Default::default(),
            explicit: Default::default(),
            engine: None,
            step,
        }
    }

    /// The series of `row` for a step: its family's, with the step label and the row's own label.
    fn labels(step: &Labels, row: &Row) -> Labels {
        let mut l = step.clone();
        if let Some((k, v)) = row.prom.and_then(|p| p.label) {
            l.push((k, v.to_string()));
        }
        l
    }

    /// Remove the gauges of `target` (it ended: they go stale); `layers`:
    /// the layers of its layer series, `degraded`: its degraded features.
    fn clear_target_gauges(&self, target: &Labels, layers: &[u32], degraded: &[String]) {
        for f in degraded {
            self.degraded_features.remove(&feature_labels(target, f));
        }
        for l in [
            &self.rss,
            &self.rss_anon,
            &self.rss_file,
            &self.swap,
            &self.dense_resident,
            &self.dense_swapped,
            &self.experts_resident,
            &self.probes_attached,
            &self.probes_missing,
        ] {
            l.remove(target);
        }
        for &layer in layers {
            self.layer_resident.remove(&layer_labels(target, layer));
        }
    }
}

/// A target's labels (`vocab::TARGET_LABELS`, in order) from their values.
pub fn target_labels(engine: &str, model: &str, container: &str) -> Labels {
    vocab::TARGET_LABELS.iter().copied().zip([engine, model, container].map(str::to_string)).collect()
}

/// Set `target`'s series of a gauge family, or remove it (`None`, or not finite).
fn set_level(fam: &Levels, target: &Labels, v: Option<f64>) {
    match v {
        Some(v) if v.is_finite() => fam.get_or_create(target).set(Some(v)),
        _ => {
            fam.remove(target);
        }
    }
}

/// The label every series of a token-derived family carries.
const STEP_LABEL: &str = vocab::F_TIME.labels[0];

/// `build_info`'s labels.
fn build_info_labels() -> OwnedLabels {
    vec![
        (vocab::F_BUILD_INFO.labels[0], env!("CARGO_PKG_VERSION").to_string()),
        (vocab::F_BUILD_INFO.labels[1], crate::store::trace::VERSION.to_string()),
    ]
}

/// Handles of one step kind, created on first use (a family member exists
/// only once measured).
struct StepHandles {
    step: Labels,
    tokens: Option<Counter>,
    duration: Histogram,
    components: [Option<Seconds>; Component::N],
    counters: [Option<Counter>; observer_common::model::Counter::N],
    /// `pagecache_evicted` per actor kind (`vocab::EVICTION_ACTORS`).
    evicted_by: [Option<Counter>; observer_common::model::N_EVICTION_ACTORS],
    /// Refaulted pages, refault faults and their `fault_io` per actor kind.
    refaults: [Option<(Counter, Counter, Seconds)>; observer_common::model::N_EVICTION_ACTORS],
    /// Explicit read bytes and time per region kind (`vocab::EXPLICIT_READS`).
    explicit: [Option<(Counter, Seconds)>; observer_common::xread::N_KINDS],
    engine: Option<(Seconds, Counter, Seconds)>,
}

/// Per-run baselines of the per-run cumulative inputs.
#[derive(Debug, Default)]
struct RunState {
    hists: BTreeMap<String, Vec<u64>>,
    hist_sums: BTreeMap<String, u64>,
    lost: u64,
    bpf_ns: u64,
    bpf_n: u64,
    /// Health samples arrived (eBPF mode): lost events are measured.
    health_seen: bool,
    /// What the `actor_name` series of each (kind, label) have counted this run, and the kind's
    /// total at the last per-process list.
    by_name: BTreeMap<(String, String), u64>,
}

/// `now − last` (0 if it went backwards), and remember `now`.
fn delta(last: &mut u64, now: u64) -> u64 {
    let d = now.saturating_sub(*last);
    *last = (*last).max(now);
    d
}

/// The exporter's sink: updates the registry from the model stream. Never
/// blocks beyond short critical sections shared with a scrape.
pub struct MetricsSink {
    ex: Arc<Exporter>,
    /// This target's labels (empty: none).
    target: Labels,
    /// Where its labels may change during the run ([`MetricsSink::follow_labels`]).
    relabel: Option<tokio::sync::watch::Receiver<Labels>>,
    /// Between the run's header and its end.
    running: bool,
    /// The features its run lacks (`RunHeader::degraded`), for the `degraded` gauge.
    degraded: Vec<String>,
    /// The layers of the `layer_experts_resident_ratio` series set for this target.
    layers: Vec<u32>,
    run: RunState,
    steps: [Option<StepHandles>; StepKind::ALL.len()],
    /// Keeps the endpoint of `observer run --metrics-addr` up for the run.
    _endpoint: Option<Endpoint>,
}

impl std::fmt::Debug for MetricsSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsSink").finish_non_exhaustive()
    }
}

impl MetricsSink {
    /// Take this target's labels from `labels` from now on (`serve --discover`:
    /// a target found before it mapped its model gets its `model` label once
    /// it has): see [`MetricsSink::relabel`].
    pub fn follow_labels(mut self, labels: tokio::sync::watch::Receiver<Labels>) -> MetricsSink {
        self.relabel = Some(labels);
        self
    }

    /// The target's labels became `new` (module doc, "Several targets at
    /// once"): from the next event on, its series carry `new`. A running
    /// target moves: its gauges and `degraded` go from the old label set (as
    /// at its end) to the new one, `target_up` with them, and it counts as a
    /// run of the new set. What its counters counted before stays under the
    /// old set (counters never go down).
    fn relabel(&mut self, new: Labels) {
        if new == self.target {
            return;
        }
        let features = std::mem::take(&mut self.degraded);
        if self.running {
            if self.ex.target_up.get_or_create(&self.target).dec() <= 1 {
                self.ex.clear_target_gauges(&self.target, &self.layers, &features);
            }
            self.ex.target_up.get_or_create(&new).inc();
            self.ex.runs.get_or_create(&new).inc();
            for f in &features {
                self.ex.degraded_features.get_or_create(&feature_labels(&new, f)).set(Some(1.0));
            }
            self.degraded = features;
        }
        self.target = new;
        self.layers.clear();
        self.steps = Default::default();
    }

    fn token(&mut self, t: &TokenRecord) {
        let ex = &self.ex;
        let target = &self.target;
        let h = self.steps[t.kind as usize].get_or_insert_with(|| ex.step_handles(target, t.kind));
        if let Some(tok) = &h.tokens {
            tok.inc_by(t.n_tokens);
        }
        h.duration.observe(t.wall_ns as f64 / 1e9);
        for (c, v) in t.components.iter() {
            let (Some(v), Some(p)) = (v, c.row().prom) else { continue };
            h.components[c as usize]
                .get_or_insert_with(|| ex.times[p.family.stem].get_or_create_owned(&Exporter::labels(&h.step, c.row())))
                .add_ns(v);
        }
        for (c, v) in t.counters.iter() {
            let (Some(v), Some(p)) = (v, c.row().prom) else { continue };
            if c == observer_common::model::Counter::PagecacheEvicted && t.evicted_by.is_some() {
                continue; // split by actor below
            }
            h.counters[c as usize]
                .get_or_insert_with(|| {
                    ex.counts[p.family.stem].get_or_create_owned(&Exporter::labels(&h.step, c.row()))
                })
                .inc_by(v);
        }
        if let Some(by) = &t.evicted_by {
            for ((row, v), handle) in vocab::EVICTION_ACTORS.iter().zip(by.0).zip(&mut h.evicted_by) {
                let Some(p) = row.prom else { continue };
                handle
                    .get_or_insert_with(|| {
                        ex.counts[p.family.stem].get_or_create_owned(&Exporter::labels(&h.step, row))
                    })
                    .inc_by(v);
            }
        }
        if let Some(r) = &t.refaults {
            for (i, row) in vocab::EVICTION_ACTORS.iter().enumerate() {
                let (pages, faults, io) = h.refaults[i].get_or_insert_with(|| {
                    let mut l = h.step.clone();
                    l.push((vocab::ACTOR_LABEL, row.name.to_string()));
                    (
                        ex.refaulted.get_or_create_owned(&l),
                        ex.refault_faults.get_or_create_owned(&l),
                        ex.refault_io.get_or_create_owned(&l),
                    )
                });
                pages.inc_by(r.pages.0[i]);
                faults.inc_by(r.faults.0[i]);
                io.add_ns(r.fault_io_ns.0[i]);
            }
        }
        if let Some(x) = &t.explicit_reads {
            for (((row, b), ns), handle) in vocab::EXPLICIT_READS.iter().zip(x.bytes.0).zip(x.ns.0).zip(&mut h.explicit)
            {
                let (bytes, time) = handle.get_or_insert_with(|| {
                    let l = Exporter::labels(&h.step, row);
                    (ex.explicit_read.get_or_create_owned(&l), ex.explicit_read_time.get_or_create_owned(&l))
                });
                bytes.inc_by(b);
                time.add_ns(ns);
            }
        }
        if let (Some(engine), Some(measured)) = (t.engine_compute_ns, t.components.get(Component::Compute)) {
            let (e, n, m) = h.engine.get_or_insert_with(|| {
                (
                    ex.engine_compute.get_or_create_owned(&h.step),
                    ex.engine_steps.get_or_create_owned(&h.step),
                    ex.engine_steps_compute.get_or_create_owned(&h.step),
                )
            });
            e.add_ns(engine);
            n.inc();
            m.add_ns(measured);
        }
        if let Some(r) = &t.residency {
            set_level(&ex.dense_resident, target, r.dense_resident_frac);
            set_level(&ex.dense_swapped, target, r.dense_swapped_frac);
            set_level(&ex.experts_resident, target, r.experts_resident_frac);
            let mut layers = Vec::new();
            if let Some(g) = r.grid.as_ref().filter(|g| g.n_experts > 0) {
                for (row, resident) in g.resident.chunks(g.n_experts as usize).enumerate().take(g.n_layers as usize) {
                    let mean = resident.iter().map(|v| f64::from(*v)).sum::<f64>() / resident.len() as f64;
                    set_level(&ex.layer_resident, &layer_labels(target, g.layer(row)), Some(mean));
                    layers.push(g.layer(row));
                }
            }
            for &layer in self.layers.iter().filter(|l| !layers.contains(l)) {
                ex.layer_resident.remove(&layer_labels(target, layer));
            }
            self.layers = layers;
        }
    }

    /// `pagecache_evicted_by_name_pages_total` from a cumulative per-process list (module spec).
    fn evicted_by_name(&mut self, rows: &[ProcessEvictions]) {
        let mut names = self.ex.actor_names.lock().unwrap_or_else(|p| p.into_inner());
        // Per (kind, label): the pages of the named rows now; per kind: the total.
        let mut named: BTreeMap<(String, String), u64> = BTreeMap::new();
        let mut totals: BTreeMap<String, u64> = BTreeMap::new();
        for r in rows {
            *totals.entry(r.kind.clone()).or_default() += r.pages;
            let rest = r.pid == 0 && r.comm == vocab::OTHER;
            if !rest && !names.contains(&r.comm) && names.len() < vocab::TOP_ACTOR_NAMES && r.comm != vocab::OTHER {
                names.push(r.comm.clone());
            }
            if !rest && names.contains(&r.comm) {
                *named.entry((r.kind.clone(), r.comm.clone())).or_default() += r.pages;
            }
        }
        drop(names);
        for (kind, total) in totals {
            let mut counted = 0;
            for ((k, name), pages) in named.range((kind.clone(), String::new())..).take_while(|x| x.0.0 == kind) {
                let last = self.run.by_name.entry((k.clone(), name.clone())).or_default();
                let d = delta(last, *pages);
                counted += *last;
                self.add_by_name(&kind, name, d);
            }
            // Named series that are not in this list keep what they counted.
            counted += self
                .run
                .by_name
                .iter()
                .filter(|((k, n), _)| *k == kind && n != vocab::OTHER && !named.contains_key(&(k.clone(), n.clone())))
                .map(|x| *x.1)
                .sum::<u64>();
            let other = self.run.by_name.entry((kind.clone(), vocab::OTHER.to_string())).or_default();
            let d = delta(other, total.saturating_sub(counted));
            self.add_by_name(&kind, vocab::OTHER, d);
        }
    }

    fn add_by_name(&self, kind: &str, name: &str, pages: u64) {
        let mut l = self.target.clone();
        l.push((vocab::ACTOR_LABEL, kind.to_string()));
        l.push((vocab::ACTOR_NAME_LABEL, name.to_string()));
        self.ex.evicted_by_name.get_or_create(&l).inc_by(pages);
    }

    fn process(&mut self, p: &ProcessSample) {
        if !p.evicted_by_process.is_empty() {
            self.evicted_by_name(&p.evicted_by_process);
        }
        let f = |v: Option<u64>| v.map(|v| v as f64);
        let (ex, target) = (&self.ex, &self.target);
        set_level(&ex.rss, target, f(p.rss_bytes));
        set_level(&ex.rss_anon, target, f(p.rss_anon_bytes));
        set_level(&ex.rss_file, target, f(p.rss_file_bytes));
        set_level(&ex.swap, target, f(p.swap_bytes));
        ex.mem_available.set(f(p.mem_available_bytes));
    }

    fn histograms(&mut self, h: &LatencyHistograms) {
        let mut k = self.ex.kernel.lock().unwrap_or_else(|p| p.into_inner());
        for (kind, counts) in &h.kinds {
            let last = self.run.hists.entry(kind.clone()).or_default();
            if last.len() != counts.len() {
                last.resize(counts.len(), 0);
            }
            let d: Vec<u64> = counts.iter().zip(last.iter_mut()).map(|(now, last)| delta(last, *now)).collect();
            let sum = h.sum_ns.get(kind).map(|s| delta(self.run.hist_sums.entry(kind.clone()).or_default(), *s));
            k.add(&self.target, kind, &d, sum);
        }
    }

    /// The run lacks `entries` (`RunHeader::degraded`): said once in `/healthz` (the session
    /// logged it), and as a gauge while it runs.
    fn degrade(&mut self, entries: &[String]) {
        let who: String =
            self.target.iter().map(|(_, v)| v.as_str()).filter(|v| !v.is_empty()).collect::<Vec<_>>().join(" ");
        for d in entries {
            self.ex.degrade(if who.is_empty() { d.clone() } else { format!("{who}: {d}") });
            let f = observer_common::model::degraded_feature(d).to_string();
            self.ex.degraded_features.get_or_create(&feature_labels(&self.target, &f)).set(Some(1.0));
            if !self.degraded.contains(&f) {
                self.degraded.push(f);
            }
        }
    }

    fn health(&mut self, h: &ObserverHealth) {
        self.run.health_seen = true;
        let (ex, target) = (&self.ex, &self.target);
        ex.lost_events.get_or_create(target).add(delta(&mut self.run.lost, h.lost_events));
        set_level(&ex.probes_attached, target, Some(f64::from(h.probes_attached)));
        set_level(&ex.probes_missing, target, Some(f64::from(h.probes_missing)));
        if let Some(ns) = h.bpf_run_ns {
            ex.bpf_run.get_or_create(target).add_ns(delta(&mut self.run.bpf_ns, ns));
        }
        if let Some(n) = h.bpf_run_count {
            ex.bpf_runs.get_or_create(target).add(delta(&mut self.run.bpf_n, n));
        }
    }
}

impl Sink for MetricsSink {
    fn event(&mut self, ev: &Event) -> anyhow::Result<()> {
        if let Some(rx) = self.relabel.as_mut().filter(|rx| rx.has_changed().unwrap_or(false)) {
            let new = rx.borrow_and_update().clone();
            self.relabel(new);
        }
        match ev {
            Event::Header(h) => {
                self.run = RunState::default();
                self.running = true;
                self.degrade(&h.degraded);
                self.ex.runs.get_or_create(&self.target).inc();
                self.ex.target_up.get_or_create(&self.target).inc();
            }
            // Found during the run (markers refused after an exec or a dlopen).
            Event::Marks(m) => self.degrade(&m.degraded),
            Event::Token(t) => self.token(t),
            Event::Process(p) => self.process(p),
            Event::Histograms(h) => self.histograms(h),
            Event::Health(h) => self.health(h),
            Event::Totals(t) => {
                if !t.evicted_by_process.is_empty() {
                    self.evicted_by_name(&t.evicted_by_process);
                }
            }
            Event::End(e) => {
                // The run's final count; the procfs fallback measures no lost
                // events (it sends no Health samples and reports 0 here).
                if self.run.health_seen {
                    self.ex.lost_events.get_or_create(&self.target).add(delta(&mut self.run.lost, e.lost_events));
                }
                // Another live target with the same labels keeps the gauges. They go before
                // `target_up` drops, so that no scrape sees an ended target's gauges beside
                // `target_up` 0 (a scrape runs on another thread); the decrement's own answer
                // decides when two targets of those labels end at once.
                let up = self.ex.target_up.get_or_create(&self.target);
                let cleared = up.get() <= 1;
                if cleared {
                    self.ex.clear_target_gauges(&self.target, &self.layers, &self.degraded);
                }
                if up.dec() <= 1 && !cleared {
                    self.ex.clear_target_gauges(&self.target, &self.layers, &self.degraded);
                }
                self.layers.clear();
                self.degraded.clear();
                self.running = false;
            }
        }
        Ok(())
    }
}

/// `degraded`'s labels.
fn feature_labels(target: &Labels, feature: &str) -> Labels {
    let mut l = target.clone();
    l.push((vocab::F_DEGRADED.labels[0], feature.to_string()));
    l
}

/// `layer_experts_resident_ratio`'s labels (layers are bounded by the model).
/// The `layer` label is the block index of a grid row.
fn layer_labels(target: &Labels, layer: u32) -> Labels {
    let mut l = target.clone();
    l.push((vocab::F_LAYER_EXPERTS_RESIDENT.labels[0], layer.to_string()));
    l
}

/// Start an endpoint on `addr` with a fresh exporter and return its sink (for
/// `observer run --metrics-addr`): the endpoint lives as long as the sink.
pub fn run_sink(addr: &str) -> Result<MetricsSink, MetricsError> {
    let ex = Exporter::new();
    let ep = Endpoint::start(addr, Arc::clone(&ex))?;
    log::info!("metrics at http://{}/metrics", ep.local_addr());
    let mut s = ex.sink();
    s._endpoint = Some(ep);
    Ok(s)
}

#[cfg(test)]
mod tests;
