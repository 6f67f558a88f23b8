//! Prometheus / OpenMetrics exporter: a [`Sink`] that keeps a
//! `prometheus-client` registry up to date from the model stream, and a small
//! HTTP endpoint ([`http`]) that serves it.
//!
//! ## Spec of the exported metrics
//! Names follow Prometheus conventions (base units: seconds, bytes, ratios
//! 0..1; `_total` for counters) and the design's vocabulary, under the prefix
//! [`PREFIX`]. There are no PID or TID labels. A value that was never measured
//! has no series at all (never a 0).
//!
//! From each token record (one *step*: a generated token, the prompt, a
//! `--token-symbol` call or a `--window`), label `kind` =
//! `prompt|generate|call|window`:
//! - `steps_total`: step records; `tokens_total`: tokens processed (the step's
//!   `n_tokens`; windows are not tokens and are not counted);
//! - `wall_seconds_total`: the steps' wall time;
//! - `<component>_seconds_total` for `compute`, `fault_minor`, `swapin_zram`,
//!   `fault_io`, `io_wait`, `reclaim`, `syscall`, `runqueue`, `sleep`: the
//!   token record's components (the mean over the threads that ran, so they add
//!   up to `wall_seconds_total` less the unattributed residual);
//!   `rate(X_seconds_total) / rate(steps_total)` is the time per step;
//! - `engine_compute_seconds_total`: the engine's own `compute` (its residual),
//!   `engine_steps_total` and `engine_steps_compute_seconds_total` (the
//!   measured `compute` of the same steps): over the steps where both are known,
//!   so `engine_compute − engine_steps_compute` is exactly the hidden cost;
//! - counters summed over threads: `majflt_file_total`, `majflt_swap_total`,
//!   `minflt_total`, `swapins_total`, `read_bytes_total`, `pagecache_added_total`,
//!   `pagecache_evicted_total` (pages), `ctx_switches_total`;
//! - `token_duration_seconds` histogram of the steps' wall time, log2 buckets
//!   `le = 2^b ns` (b = 8..=38, the kernel's grid), with an exact `_sum`.
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
//! Kernel latency histograms: `<kind>_latency_seconds` for `fault_minor`,
//! `fault_major_file`, `fault_major_swap`, `zram_read`, `disk_read`: buckets only:
//! no `_sum` (the kernel keeps counts only), so no `_count` either; the
//! count is the `+Inf` bucket ([`kernel`]).
//!
//! The observer's health: `lost_events_total`, `probes_attached`,
//! `probes_missing` (gauges while a target runs), `bpf_run_seconds_total` and
//! `bpf_runs_total` (the observer's eBPF programs, when the kernel's BPF
//! statistics are available), `target_up` (1 while a target is observed) and
//! `runs_total` (targets observed; `observer serve` follows restarts).
//!
//! Counters never go down, also across target restarts: per-run cumulative
//! inputs (kernel histograms, lost events, BPF run time) are added as deltas.

pub mod http;
pub mod kernel;
pub mod value;

use std::sync::{Arc, Mutex};

use observer_common::model::{
    Component, Counter as ModelCounter, Event, LatencyHistograms, ObserverHealth, ProcessSample, StepKind, TokenRecord,
};
use prometheus_client::{
    encoding::{EncodeLabelSet, prometheus_text, text},
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::{Registry, Unit},
};

use crate::sinks::Sink;
pub use http::{Endpoint, MetricsError, parse_addr};
use kernel::KernelHists;
use value::{Count, Level, Seconds};

/// Prefix of every metric name.
pub const PREFIX: &str = "moe_observer";

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

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LayerLabel {
    pub layer: u32,
}

/// Name of a step kind as a label value.
pub const fn kind_name(k: StepKind) -> &'static str {
    match k {
        StepKind::Prompt => "prompt",
        StepKind::Generate => "generate",
        StepKind::Call => "call",
        StepKind::Window => "window",
    }
}

const fn kind_index(k: StepKind) -> usize {
    match k {
        StepKind::Prompt => 0,
        StepKind::Generate => 1,
        StepKind::Call => 2,
        StepKind::Window => 3,
    }
}

/// Exported log2 bounds of `token_duration_seconds` (same grid as the kernel's).
fn duration_buckets() -> impl Iterator<Item = f64> {
    (kernel::FIRST_BUCKET..=kernel::LAST_BUCKET).map(|b| (1u64 << b) as f64 / 1e9)
}

fn new_duration_histogram() -> Histogram {
    Histogram::new(duration_buckets())
}

type Steps = Family<KindLabel, Counter>;
type Times = Family<KindLabel, Seconds>;

/// The registry and the handles the sink updates. Shared (`Arc`) between the
/// run loop (sinks) and the HTTP endpoint; all updates are atomics or short
/// critical sections, so a scrape never holds up the run loop for long.
#[derive(Debug)]
pub struct Exporter {
    registry: Registry,
    steps: Steps,
    tokens: Steps,
    wall: Times,
    components: [Times; 9],
    engine_compute: Times,
    engine_steps: Steps,
    engine_steps_compute: Times,
    counters: [Steps; 8],
    duration: Family<KindLabel, Histogram, fn() -> Histogram>,
    dense_resident: Level,
    dense_swapped: Level,
    experts_resident: Level,
    layer_resident: Family<LayerLabel, Gauge<f64, std::sync::atomic::AtomicU64>>,
    rss: Level,
    rss_anon: Level,
    rss_file: Level,
    swap: Level,
    mem_available: Level,
    lost_events: Count,
    probes_attached: Level,
    probes_missing: Level,
    bpf_run: Seconds,
    bpf_runs: Count,
    target_up: Gauge,
    runs: Counter,
    kernel: Mutex<KernelHists>,
}

fn component_help(c: Component) -> &'static str {
    match c {
        Component::Compute => {
            "User-mode CPU time of the steps (measured, not a residual), mean over the threads that ran"
        }
        Component::FaultMinor => "On-CPU time in minor page faults during the steps, mean over the threads that ran",
        Component::SwapinZram => {
            "On-CPU time in faults that swapped in from zram (decompression) during the steps, mean over the threads that ran"
        }
        Component::FaultIo => {
            "Time blocked inside page faults (file refault I/O, disk swap) during the steps, mean over the threads that ran"
        }
        Component::IoWait => "Time in explicit I/O syscalls during the steps, mean over the threads that ran",
        Component::Reclaim => "Time in direct or memcg reclaim during the steps, mean over the threads that ran",
        Component::Syscall => "On-CPU time in other syscalls during the steps, mean over the threads that ran",
        Component::Runqueue => "Time runnable but waiting for a CPU during the steps, mean over the threads that ran",
        Component::Sleep => {
            "Time blocked for anything else (futex, condvar, sleep) during the steps, mean over the threads that ran"
        }
    }
}

fn counter_meta(c: ModelCounter) -> (&'static str, Option<Unit>, &'static str) {
    match c {
        ModelCounter::MajfltFile => ("majflt_file", None, "Major page faults served from a file, summed over threads"),
        ModelCounter::MajfltSwap => ("majflt_swap", None, "Major page faults served from swap, summed over threads"),
        ModelCounter::Minflt => ("minflt", None, "Minor page faults, summed over threads"),
        ModelCounter::Swapins => ("swapins", None, "Pages swapped in, summed over threads"),
        ModelCounter::ReadBytes => ("read", Some(Unit::Bytes), "Bytes read from block devices, summed over threads"),
        ModelCounter::PagecacheAdded => ("pagecache_added", None, "Model-file pages added to the page cache"),
        ModelCounter::PagecacheEvicted => ("pagecache_evicted", None, "Model-file pages evicted from the page cache"),
        ModelCounter::CtxSwitches => ("ctx_switches", None, "Context switches, summed over threads"),
    }
}

impl Exporter {
    pub fn new() -> Arc<Exporter> {
        let mut r = Registry::with_prefix(PREFIX);
        let steps = Steps::default();
        r.register(
            "steps",
            "Step records (a generated token, the prompt, a --token-symbol call, or a --window)",
            steps.clone(),
        );
        let tokens = Steps::default();
        r.register("tokens", "Tokens processed (n_tokens of each step; windows are not tokens)", tokens.clone());
        let wall = Times::default();
        r.register_with_unit("wall", "Wall time of the steps", Unit::Seconds, wall.clone());
        let components: [Times; 9] = std::array::from_fn(|_| Times::default());
        for (c, f) in Component::ALL.iter().zip(&components) {
            r.register_with_unit(c.name(), component_help(*c), Unit::Seconds, f.clone());
        }
        let engine_compute = Times::default();
        r.register_with_unit(
            "engine_compute",
            "The engine's own compute (wall minus what it timed: a residual), over steps where the observer also measured compute",
            Unit::Seconds,
            engine_compute.clone(),
        );
        let engine_steps = Steps::default();
        r.register("engine_steps", "Steps counted in engine_compute_seconds_total", engine_steps.clone());
        let engine_steps_compute = Times::default();
        r.register_with_unit(
            "engine_steps_compute",
            "Measured compute of the steps counted in engine_compute_seconds_total; the difference is the hidden cost",
            Unit::Seconds,
            engine_steps_compute.clone(),
        );
        let counters: [Steps; 8] = std::array::from_fn(|_| Steps::default());
        for (c, f) in ModelCounter::ALL.iter().zip(&counters) {
            let (name, unit, help) = counter_meta(*c);
            match unit {
                Some(u) => r.register_with_unit(name, help, u, f.clone()),
                None => r.register(name, help, f.clone()),
            }
        }
        let duration = Family::<KindLabel, Histogram, fn() -> Histogram>::new_with_constructor(
            new_duration_histogram as fn() -> Histogram,
        );
        r.register_with_unit(
            "token_duration",
            "Wall time of each step, log2 buckets (le = 2^b ns)",
            Unit::Seconds,
            duration.clone(),
        );
        let dense_resident = Level::default();
        r.register(
            "dense_resident_ratio",
            "Share of the dense weights resident in RAM (latest token)",
            dense_resident.clone(),
        );
        let dense_swapped = Level::default();
        r.register(
            "dense_swapped_ratio",
            "Share of an anonymous copy of the dense weights in swap (latest token)",
            dense_swapped.clone(),
        );
        let experts_resident = Level::default();
        r.register(
            "experts_resident_ratio",
            "Share of the routed experts' bytes in the page cache (latest token)",
            experts_resident.clone(),
        );
        let layer_resident = Family::<LayerLabel, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
        r.register(
            "layer_experts_resident_ratio",
            "Mean resident share of the routed experts of each layer (latest token)",
            layer_resident.clone(),
        );
        let rss = Level::default();
        r.register_with_unit("target_rss", "Resident memory of the target", Unit::Bytes, rss.clone());
        let rss_anon = Level::default();
        r.register_with_unit(
            "target_rss_anon",
            "Anonymous resident memory of the target",
            Unit::Bytes,
            rss_anon.clone(),
        );
        let rss_file = Level::default();
        r.register_with_unit(
            "target_rss_file",
            "File-backed resident memory of the target",
            Unit::Bytes,
            rss_file.clone(),
        );
        let swap = Level::default();
        r.register_with_unit("target_swap", "Swapped-out memory of the target", Unit::Bytes, swap.clone());
        let mem_available = Level::default();
        r.register_with_unit("mem_available", "The machine's MemAvailable", Unit::Bytes, mem_available.clone());
        let lost_events = Count::default();
        r.register("lost_events", "Events the kernel side could not deliver", lost_events.clone());
        let probes_attached = Level::default();
        r.register("probes_attached", "The observer's probes attached to the current target", probes_attached.clone());
        let probes_missing = Level::default();
        r.register("probes_missing", "Optional probes this kernel lacks", probes_missing.clone());
        let bpf_run = Seconds::default();
        r.register_with_unit(
            "bpf_run",
            "Run time of the observer's eBPF programs (kernel BPF statistics)",
            Unit::Seconds,
            bpf_run.clone(),
        );
        let bpf_runs = Count::default();
        r.register("bpf_runs", "Runs of the observer's eBPF programs (kernel BPF statistics)", bpf_runs.clone());
        let target_up = Gauge::default();
        r.register("target_up", "1 while a target is being observed", target_up.clone());
        let runs = Counter::default();
        r.register("runs", "Targets observed (observer serve re-attaches after restarts)", runs.clone());
        Arc::new(Exporter {
            registry: r,
            steps,
            tokens,
            wall,
            components,
            engine_compute,
            engine_steps,
            engine_steps_compute,
            counters,
            duration,
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
            bpf_run,
            bpf_runs,
            target_up,
            runs,
            kernel: Mutex::new(KernelHists::default()),
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
        self.kernel.lock().unwrap_or_else(|p| p.into_inner()).encode(&mut s, PREFIX, format)?;
        if format == Format::OpenMetrics {
            text::encode_eof(&mut s)?;
        }
        Ok(s)
    }

    /// A sink feeding this exporter (one per target lifetime).
    pub fn sink(self: &Arc<Self>) -> MetricsSink {
        MetricsSink { ex: Arc::clone(self), run: RunState::default(), kinds: Default::default(), _endpoint: None }
    }

    fn kind_handles(&self, k: StepKind) -> KindHandles {
        let l = KindLabel { kind: kind_name(k) };
        KindHandles {
            label: l.clone(),
            steps: self.steps.get_or_create_owned(&l),
            tokens: (k != StepKind::Window).then(|| self.tokens.get_or_create_owned(&l)),
            wall: self.wall.get_or_create_owned(&l),
            duration: self.duration.get_or_create_owned(&l),
            components: Default::default(),
            counters: Default::default(),
            engine: None,
        }
    }

    fn clear_target_gauges(&self) {
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
            l.set(None);
        }
        self.layer_resident.clear();
    }
}

/// Handles of one step kind, created on first use (a family member exists
/// only once measured).
struct KindHandles {
    label: KindLabel,
    steps: Counter,
    tokens: Option<Counter>,
    wall: Seconds,
    duration: Histogram,
    components: [Option<Seconds>; 9],
    counters: [Option<Counter>; 8],
    engine: Option<(Seconds, Counter, Seconds)>,
}

/// Per-run baselines of the per-run cumulative inputs.
#[derive(Debug, Default)]
struct RunState {
    hists: std::collections::BTreeMap<String, Vec<u64>>,
    lost: u64,
    bpf_ns: u64,
    bpf_n: u64,
    /// Health samples arrived (eBPF mode): lost events are measured.
    health_seen: bool,
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
    run: RunState,
    kinds: [Option<KindHandles>; 4],
    /// Keeps the endpoint of `observer run --metrics-addr` up for the run.
    _endpoint: Option<Endpoint>,
}

impl std::fmt::Debug for MetricsSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsSink").finish_non_exhaustive()
    }
}

impl MetricsSink {
    fn token(&mut self, t: &TokenRecord) {
        let ex = &self.ex;
        let h = self.kinds[kind_index(t.kind)].get_or_insert_with(|| ex.kind_handles(t.kind));
        h.steps.inc();
        if let Some(tok) = &h.tokens {
            tok.inc_by(t.n_tokens);
        }
        h.wall.add_ns(t.wall_ns);
        h.duration.observe(t.wall_ns as f64 / 1e9);
        for (c, v) in t.components.iter() {
            if let Some(v) = v {
                h.components[c as usize]
                    .get_or_insert_with(|| ex.components[c as usize].get_or_create_owned(&h.label))
                    .add_ns(v);
            }
        }
        for (c, v) in t.counters.iter() {
            if let Some(v) = v {
                h.counters[c as usize]
                    .get_or_insert_with(|| ex.counters[c as usize].get_or_create_owned(&h.label))
                    .inc_by(v);
            }
        }
        if let (Some(engine), Some(measured)) = (t.engine_compute_ns, t.components.get(Component::Compute)) {
            let (e, n, m) = h.engine.get_or_insert_with(|| {
                (
                    ex.engine_compute.get_or_create_owned(&h.label),
                    ex.engine_steps.get_or_create_owned(&h.label),
                    ex.engine_steps_compute.get_or_create_owned(&h.label),
                )
            });
            e.add_ns(engine);
            n.inc();
            m.add_ns(measured);
        }
        if let Some(r) = &t.residency {
            ex.dense_resident.set(r.dense_resident_frac);
            ex.dense_swapped.set(r.dense_swapped_frac);
            ex.experts_resident.set(r.experts_resident_frac);
            match &r.grid {
                Some(g) if g.n_experts > 0 => {
                    for (layer, row) in g.resident.chunks(g.n_experts as usize).enumerate().take(g.n_layers as usize) {
                        let mean = row.iter().map(|v| f64::from(*v)).sum::<f64>() / row.len() as f64;
                        ex.layer_resident.get_or_create(&LayerLabel { layer: layer as u32 }).set(mean);
                    }
                }
                _ => ex.layer_resident.clear(),
            }
        }
    }

    fn process(&self, p: &ProcessSample) {
        let f = |v: Option<u64>| v.map(|v| v as f64);
        self.ex.rss.set(f(p.rss_bytes));
        self.ex.rss_anon.set(f(p.rss_anon_bytes));
        self.ex.rss_file.set(f(p.rss_file_bytes));
        self.ex.swap.set(f(p.swap_bytes));
        self.ex.mem_available.set(f(p.mem_available_bytes));
    }

    fn histograms(&mut self, h: &LatencyHistograms) {
        let mut k = self.ex.kernel.lock().unwrap_or_else(|p| p.into_inner());
        for (kind, counts) in &h.kinds {
            let last = self.run.hists.entry(kind.clone()).or_default();
            if last.len() != counts.len() {
                last.resize(counts.len(), 0);
            }
            let d: Vec<u64> = counts.iter().zip(last.iter_mut()).map(|(now, last)| delta(last, *now)).collect();
            k.add(kind, &d);
        }
    }

    fn health(&mut self, h: &ObserverHealth) {
        self.run.health_seen = true;
        self.ex.lost_events.add(delta(&mut self.run.lost, h.lost_events));
        self.ex.probes_attached.set(Some(f64::from(h.probes_attached)));
        self.ex.probes_missing.set(Some(f64::from(h.probes_missing)));
        if let Some(ns) = h.bpf_run_ns {
            self.ex.bpf_run.add_ns(delta(&mut self.run.bpf_ns, ns));
        }
        if let Some(n) = h.bpf_run_count {
            self.ex.bpf_runs.add(delta(&mut self.run.bpf_n, n));
        }
    }
}

impl Sink for MetricsSink {
    fn event(&mut self, ev: &Event) -> anyhow::Result<()> {
        match ev {
            Event::Header(_) => {
                self.run = RunState::default();
                self.ex.runs.inc();
                self.ex.target_up.set(1);
            }
            Event::Token(t) => self.token(t),
            Event::Process(p) => self.process(p),
            Event::Histograms(h) => self.histograms(h),
            Event::Health(h) => self.health(h),
            Event::Totals(_) => {}
            Event::End(e) => {
                // The run's final count; the procfs fallback measures no lost
                // events (it sends no Health samples and reports 0 here).
                if self.run.health_seen {
                    self.ex.lost_events.add(delta(&mut self.run.lost, e.lost_events));
                }
                self.ex.target_up.set(0);
                self.ex.clear_target_gauges();
            }
        }
        Ok(())
    }
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
