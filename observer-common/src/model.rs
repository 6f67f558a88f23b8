//! The model stream: what the observer knows about a run, in the design's
//! vocabulary. Live probes, the procfs fallback and recorded traces all produce
//! a sequence of [`Event`]s; the TUI, the Prometheus exporter, the recorder,
//! `report` and `diff` all consume it. (User-space only: `user` feature.)
//!
//! The names (JSON keys of components, counters, histogram kinds, residency
//! fields) are the rows of [`crate::vocab`]; times are nanoseconds, serialised
//! as `<name>_ns`. Reading also accepts the older names the vocabulary lists as
//! aliases (histogram kinds of traces recorded before the renames).
//!
//! Every measurement is an `Option`: `None` (JSON `null`) means *not measured*,
//! which is never the same as 0.
//!
//! Token-level components are the **mean over the threads that ran during the
//! token** (each thread's components add up to the token's wall time, so their
//! mean does too); `residual_ns` is what is left (wall − sum), reported, not
//! hidden. Token-level counters are sums over all threads. Per-thread detail is
//! in `threads`.

extern crate alloc;

use alloc::{collections::BTreeMap, string::String, vec::Vec};
use core::fmt;

pub use crate::totals::{DeviceReads, FaultTotals, RunTotals, ThreadTime, ThreadTotals};
use serde::{
    Deserialize, Deserializer, Serialize, Serializer,
    de::{MapAccess, Visitor},
    ser::SerializeMap,
};

pub use crate::vocab::{Component, Counter, LatencyKind};

macro_rules! named_array {
    ($ty:ident, $key:ident, $n:expr, $keyfn:ident) => {
        impl $ty {
            pub fn get(&self, k: $key) -> Option<u64> {
                self.0[k as usize]
            }
            pub fn set(&mut self, k: $key, v: Option<u64>) {
                self.0[k as usize] = v;
            }
            /// Add `v` to a measured value (an unmeasured one becomes measured).
            pub fn add(&mut self, k: $key, v: u64) {
                let slot = &mut self.0[k as usize];
                *slot = Some(slot.unwrap_or(0).saturating_add(v));
            }
            pub fn iter(&self) -> impl Iterator<Item = ($key, Option<u64>)> + '_ {
                $key::ALL.iter().map(move |&k| (k, self.0[k as usize]))
            }
        }
        impl Serialize for $ty {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                let mut m = s.serialize_map(Some($n))?;
                for k in $key::ALL {
                    m.serialize_entry(k.$keyfn(), &self.0[k as usize])?;
                }
                m.end()
            }
        }
        impl<'de> Deserialize<'de> for $ty {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                struct V;
                impl<'de> Visitor<'de> for V {
                    type Value = $ty;
                    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                        f.write_str(concat!("a map of ", stringify!($ty)))
                    }
                    fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<$ty, A::Error> {
                        let mut out = $ty::default();
                        while let Some(k) = a.next_key::<String>()? {
                            // Unknown keys (other flattened fields, newer
                            // versions) are skipped whatever their type.
                            match $key::ALL.iter().find(|c| c.$keyfn() == k) {
                                Some(c) => out.0[*c as usize] = a.next_value::<Option<u64>>()?,
                                None => {
                                    a.next_value::<serde::de::IgnoredAny>()?;
                                }
                            }
                        }
                        Ok(out)
                    }
                }
                d.deserialize_map(V)
            }
        }
    };
}

/// Nanoseconds per component; serialised as `{"compute_ns": …, …}`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Components(pub [Option<u64>; Component::N]);
named_array!(Components, Component, Component::N, json_key);

impl Components {
    /// Sum of the measured components (unmeasured ones count as absent).
    pub fn sum(&self) -> u64 {
        self.0.iter().flatten().sum()
    }
    /// The components the kernel measures, from its per-thread array
    /// (`attrib::ThreadState::time`, indexed by each component's `slot`); the
    /// others are not measured.
    pub fn from_kernel(t: &[u64; crate::attrib::N_TIME]) -> Self {
        let mut c = Components::default();
        for k in Component::ALL {
            if let Some(s) = k.slot() {
                c.set(k, Some(t[s]));
            }
        }
        c
    }
}

/// Counter values; serialised as `{"majflt_file": …, …}`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters(pub [Option<u64>; Counter::N]);
named_array!(Counters, Counter, Counter::N, json_key);

impl Counters {
    /// The counters the kernel keeps per thread (`attrib::ThreadState::cnt`,
    /// indexed by each counter's `slot`); the others are not measured here.
    pub fn from_kernel(c: &[u64; crate::attrib::N_CNT]) -> Self {
        let mut m = Counters::default();
        for k in Counter::ALL {
            if let Some(s) = k.slot() {
                m.set(k, Some(c[s]));
            }
        }
        m
    }
}

/// What kind of step a token record covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StepKind {
    /// Prompt processing (one marked step for the whole prompt).
    Prompt,
    /// One generated token.
    Generate,
    /// A call of a `--token-symbol` function.
    Call,
    /// A fixed time window (no markers).
    Window,
}

impl StepKind {
    pub const ALL: [StepKind; 4] = [StepKind::Prompt, StepKind::Generate, StepKind::Call, StepKind::Window];
    /// Its row of the vocabulary (`vocab::STEPS`, same order).
    pub fn row(self) -> &'static crate::vocab::Row {
        &crate::vocab::STEPS[self as usize]
    }
    /// The label value and JSON name (`generate`, …).
    pub fn name(self) -> &'static str {
        self.row().name
    }
}

/// One thread's share of a token.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ThreadToken {
    pub tid: u32,
    pub comm: String,
    #[serde(flatten)]
    pub components: Components,
    #[serde(flatten)]
    pub counters: Counters,
    /// wall − sum(components): time not attributed (e.g. a thread that appeared
    /// mid-token). Negative when components overshoot.
    pub residual_ns: i64,
}

/// The engine's own per-token telemetry, as it reported it through its token
/// marker (`engine` ABI v1) or its metrics file. Names are the engine's columns.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct EngineTelemetry {
    pub wall_ns: Option<u64>,
    /// The engine's `compute_ms`: a residual (wall minus what it timed).
    pub compute_ns: Option<u64>,
    pub io_ns: Option<u64>,
    pub stall_ns: Option<u64>,
    pub mgmt_ns: Option<u64>,
    pub read_bytes: Option<u64>,
    pub cache_hit_pct: Option<f64>,
    pub majflt: Option<u64>,
    pub cpu_ns: Option<u64>,
    pub dense_resident_frac: Option<f64>,
    pub rss_bytes: Option<u64>,
    pub rss_anon_bytes: Option<u64>,
    pub rss_file_bytes: Option<u64>,
    pub swap_bytes: Option<u64>,
    pub mem_available_bytes: Option<u64>,
}

/// Residency of the model's weights at the time of a token.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Residency {
    pub dense_resident_frac: Option<f64>,
    pub dense_swapped_frac: Option<f64>,
    pub experts_resident_frac: Option<f64>,
    /// Layer × expert resident fractions, row-major (`row * n_experts + expert`; a row's layer:
    /// [`ExpertGrid::layer`]).
    pub grid: Option<ExpertGrid>,
    /// The engine's own expert cache, when the engine publishes its slot table.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine_cache: Option<EngineCache>,
}

/// The engine's expert cache as its published slot table (`moe_engine_expert_slots`) showed it
/// at a residency sample. Measurement rules: `observer::capture::residency::slots`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct EngineCache {
    /// The slot table's version counter (its seqlock `seq`) in the snapshot.
    pub version: u64,
    pub slots: u32,
    /// Slots with a read in flight.
    pub loading: u32,
    /// The grid cells (`row * n_experts + expert`, rows as in [`ExpertGrid`]) whose expert is
    /// ready in a slot, ascending.
    pub ready: Vec<u32>,
    /// Expert reads the cache started since the previous sample (from the version counter);
    /// `None` for the first snapshot of a table.
    pub reads: Option<u64>,
    /// The observer's hit rate (percent) over the generated tokens since the previous sample:
    /// 1 − reads / experts those tokens used; `None` when a prompt step is among them.
    pub hit_pct: Option<f64>,
}

/// The layer × expert grid of a token: one row per layer with routed experts, `n_experts` columns,
/// cells row-major (`row * n_experts + expert`). Its per-cell layers (the fields after `layers`)
/// are the rows of `vocab::GRID_LAYERS`, their JSON keys its names. The counts (`added`,
/// `evicted`, `read_bytes`, `read_calls`, `refault_faults`, `refault_io_ns`) are over the steps
/// since the previous record that carried a grid, this one included.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ExpertGrid {
    /// Rows: the layers with routed experts.
    pub n_layers: u32,
    pub n_experts: u32,
    /// The block index (`N` of `blk.N`, the model's layer) of each row, ascending: row `r` is layer
    /// `layers[r]` (a model with leading dense layers starts above 0). Empty in records written
    /// before the field existed; [`ExpertGrid::layer`] then reads row `r` as layer `r`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub layers: Vec<u32>,
    /// Resident fraction per (layer, expert), 0..=1.
    pub resident: Vec<f32>,
    /// Page-cache pages of each expert added during this token (churn), if measured.
    pub added: Option<Vec<u32>>,
    /// … and evicted.
    pub evicted: Option<Vec<u32>>,
    /// Bytes of explicit reads (`read`/`pread` family) charged to each expert
    /// ([`ExplicitReads::experts`] folded into cells), when explicit reads are measured. Absent in
    /// records written before the field existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_bytes: Option<Vec<u64>>,
    /// … and the calls.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_calls: Option<Vec<u32>>,
    /// Refault faults of the observed threads charged to each expert (`evict`'s refault cost per
    /// region: the fault's first page brought back after an eviction is the expert's), when
    /// eviction blame is measured. Absent in records written before the field existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refault_faults: Option<Vec<u32>>,
    /// … and their `fault_io` time (ns).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refault_io_ns: Option<Vec<u64>>,
}

impl ExpertGrid {
    /// The layer (block index) of row `row` ([`ExpertGrid::layers`]).
    pub fn layer(&self, row: usize) -> u32 {
        self.layers.get(row).copied().unwrap_or(row as u32)
    }

    /// The cell of expert `expert` of block `layer`, if the grid has it.
    pub fn cell(&self, layer: u32, expert: u32) -> Option<usize> {
        let row = if self.layers.is_empty() {
            (layer < self.n_layers).then_some(layer as usize)
        } else {
            self.layers.binary_search(&layer).ok()
        }?;
        (expert < self.n_experts).then(|| row * self.n_experts as usize + expert as usize)
    }

    /// Add a step's per-expert explicit reads to the grid's read layers (which become measured);
    /// returns the bytes of experts the grid has no cell for (none for reads of the same model).
    pub fn add_reads(&mut self, reads: &ExplicitReads) -> u64 {
        let n = self.n_layers as usize * self.n_experts as usize;
        let cells: Vec<Option<usize>> = reads.experts.iter().map(|r| self.cell(r.layer, r.expert)).collect();
        let bytes = self.read_bytes.get_or_insert_with(|| alloc::vec![0; n]);
        let calls = self.read_calls.get_or_insert_with(|| alloc::vec![0; n]);
        let mut outside = 0;
        for (r, cell) in reads.experts.iter().zip(cells) {
            match cell {
                Some(i) if i < bytes.len() && i < calls.len() => {
                    bytes[i] = bytes[i].saturating_add(r.bytes);
                    calls[i] = calls[i].saturating_add(r.calls);
                }
                _ => outside += r.bytes,
            }
        }
        outside
    }
}

/// One marked step (token), or one window.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TokenRecord {
    /// 0-based sequence number of this record in the run.
    pub seq: u64,
    /// The engine's own token index, when its marker carries one.
    pub index: Option<u64>,
    pub kind: StepKind,
    /// Tokens processed in this step (the prompt length for `prompt`, else 1).
    pub n_tokens: u64,
    /// Start, CLOCK_MONOTONIC nanoseconds.
    pub start_ns: u64,
    pub wall_ns: u64,
    /// Mean over the threads that ran during the step (see the module doc).
    #[serde(flatten)]
    pub components: Components,
    /// wall − sum(components) of that mean thread.
    pub residual_ns: i64,
    #[serde(flatten)]
    pub counters: Counters,
    /// The engine's residual `compute`, beside the measured one.
    pub engine_compute_ns: Option<u64>,
    pub threads: Vec<ThreadToken>,
    pub engine: Option<EngineTelemetry>,
    pub residency: Option<Residency>,
    /// Events the kernel side dropped during this step.
    pub lost_events: u64,
    /// `pagecache_evicted` split by who evicted, when eviction blame is measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evicted_by: Option<EvictedBy>,
    /// The step's refaults of the model file by the kind of the eviction they undid, and what
    /// they cost the observed threads, when eviction blame is measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refaults: Option<Refaults>,
    /// The step's explicit reads of the model file (`read`/`pread` family) per kind of region and
    /// per routed expert, when they are measured (rule: `observer_common::xread`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub explicit_reads: Option<ExplicitReads>,
}

/// Per kind of region of explicit reads, in the order of `vocab::EXPLICIT_READS`; JSON: an object
/// with every kind, e.g. `{"dense": 0, "experts": 418816, "other": 0}`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "BTreeMap<String, u64>", into = "BTreeMap<String, u64>")]
pub struct ReadKinds(pub [u64; crate::xread::N_KINDS]);

impl ReadKinds {
    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }
    /// `(kind name, value)` of every kind, in vocabulary order.
    pub fn iter(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        crate::vocab::EXPLICIT_READS.iter().zip(self.0).map(|(r, v)| (r.name, v))
    }
}

impl From<BTreeMap<String, u64>> for ReadKinds {
    fn from(m: BTreeMap<String, u64>) -> Self {
        let mut e = ReadKinds::default();
        for (k, v) in m {
            let i = crate::vocab::EXPLICIT_READS.iter().position(|r| r.name == k).unwrap_or(crate::xread::K_OTHER);
            e.0[i] += v;
        }
        e
    }
}

impl From<ReadKinds> for BTreeMap<String, u64> {
    fn from(e: ReadKinds) -> Self {
        e.iter().map(|(k, v)| (k.into(), v)).collect()
    }
}

/// A step's explicit reads of the model file (rule: `observer_common::xread`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ExplicitReads {
    /// Bytes the calls returned, per kind of region.
    pub bytes: ReadKinds,
    /// Time inside the calls (entry to exit, ns), per kind, summed over threads.
    pub ns: ReadKinds,
    /// Calls, per kind.
    pub calls: ReadKinds,
    /// Bytes and calls on a descriptor not resolved yet (not charged to any region).
    pub unresolved_bytes: u64,
    pub unresolved_calls: u64,
    /// The routed experts read during the step, by layer then expert (the `experts` bytes but
    /// `lost_bytes`).
    pub experts: Vec<ExpertRead>,
    /// `experts` bytes whose per-expert record the kernel could not send.
    pub lost_bytes: u64,
}

/// Explicit read bytes of one routed expert in one step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpertRead {
    /// The block index (`blk.N`).
    pub layer: u32,
    pub expert: u32,
    pub bytes: u64,
    /// The calls (one per-expert record each); 0 in records written before the field existed.
    #[serde(default)]
    pub calls: u32,
}

/// Refaults per actor kind (rule: `observer_common::evict`, "Refaults" and "Refault cost"):
/// `pages` added back to the page cache after an eviction of that kind (by anyone: a fault, a
/// read, read-ahead), the observed threads' page `faults` that brought such a page back, and
/// those faults' `fault_io` time. Each is an [`EvictedBy`]-shaped per-kind object in JSON.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refaults {
    pub pages: EvictedBy,
    pub faults: EvictedBy,
    pub fault_io_ns: EvictedBy,
}

impl Refaults {
    /// `self − base`, per kind and field.
    pub fn since(&self, base: &Refaults) -> Refaults {
        Refaults {
            pages: self.pages.since(&base.pages),
            faults: self.faults.since(&base.faults),
            fault_io_ns: self.fault_io_ns.since(&base.fault_io_ns),
        }
    }
}

/// Who evicted the model file's pages, per process: the cumulative pages of one (actor kind,
/// process) since the run's start (rule: `observer_common::evict`; the kernel's actors that differ
/// only in system call or cgroup are one row here). A list of these is bounded to
/// [`MAX_EVICTING_PROCESSES`] rows, most pages first; the pages of the processes beyond it, and
/// of the actors the kernel's bounded table could not hold, are in one row per kind with `pid` 0
/// and `comm` `other` ([`crate::vocab::OTHER`]), so the rows add up to the blame table's total.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessEvictions {
    /// The actor kind (`vocab::EVICTION_ACTORS`).
    pub kind: String,
    /// The process (the kernel's tgid); 0 for a kind's row of the rest.
    pub pid: u32,
    /// Its task name at the eviction (`other` for a kind's row of the rest).
    pub comm: String,
    pub pages: u64,
}

/// Rows of a per-process eviction list (see [`ProcessEvictions`]).
pub const MAX_EVICTING_PROCESSES: usize = 32;

/// Number of eviction actor kinds (`vocab::EVICTION_ACTORS`).
pub const N_EVICTION_ACTORS: usize = crate::evict::N_KINDS as usize;

/// A step's evicted model-file pages per actor kind, in the order of `vocab::EVICTION_ACTORS`
/// (measurement rule: `observer_common::evict`; the kernel reads the per-kind totals at each mark,
/// before the churn total, so at each mark their sum is at most `pagecache_evicted`'s total and
/// short only by evictions in flight on another CPU at that instant).
///
/// JSON: an object of the kinds that evicted pages, e.g. `{"fadvise": 512, "kswapd": 3}`; a kind
/// a reader does not know counts as `other`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "BTreeMap<String, u64>", into = "BTreeMap<String, u64>")]
pub struct EvictedBy(pub [u64; N_EVICTION_ACTORS]);

impl EvictedBy {
    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }
    /// `(actor kind name, pages)` of every kind, in vocabulary order.
    pub fn iter(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        crate::vocab::EVICTION_ACTORS.iter().zip(self.0).map(|(r, v)| (r.name, v))
    }
    /// `self − base`, per kind (0 where it went backwards).
    pub fn since(&self, base: &EvictedBy) -> EvictedBy {
        let mut d = *self;
        for (v, b) in d.0.iter_mut().zip(base.0) {
            *v = v.saturating_sub(b);
        }
        d
    }
}

impl From<BTreeMap<String, u64>> for EvictedBy {
    fn from(m: BTreeMap<String, u64>) -> Self {
        let other = N_EVICTION_ACTORS - 1;
        let mut e = EvictedBy::default();
        for (k, v) in m {
            let i = crate::vocab::EVICTION_ACTORS.iter().position(|r| r.name == k).unwrap_or(other);
            e.0[i] += v;
        }
        e
    }
}

impl From<EvictedBy> for BTreeMap<String, u64> {
    fn from(e: EvictedBy) -> Self {
        e.iter().filter(|(_, v)| *v > 0).map(|(k, v)| (k.into(), v)).collect()
    }
}

impl TokenRecord {
    /// engine_compute − compute: the cost the engine's residual hides.
    pub fn hidden_ns(&self) -> Option<i64> {
        Some(self.engine_compute_ns? as i64 - self.components.get(Component::Compute)? as i64)
    }
}

/// Facts about the run, written once at the start of a trace.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RunHeader {
    pub observer_version: String,
    /// `ebpf` or `procfs` (fallback).
    pub mode: String,
    pub kernel: String,
    pub host: String,
    pub cpu_model: String,
    pub n_cpus: u32,
    pub mem_total_bytes: u64,
    /// /proc/sys/kernel/random/boot_id: runs from different boots are flagged by `diff`.
    pub boot_id: String,
    /// Wall-clock start, Unix nanoseconds.
    pub started_unix_ns: u64,
    /// CLOCK_MONOTONIC at the same instant, to place `start_ns` of records.
    pub started_mono_ns: u64,
    pub target_pid: u32,
    pub target_command: Vec<String>,
    pub model: Option<ModelInfo>,
    /// Engine settings (`--dense`, threads, …) as key → value.
    pub engine_config: BTreeMap<String, String>,
    pub probes: Vec<String>,
    /// What marks the tokens: our engine's markers, an engine profile and its
    /// entry points (`llama.cpp: llama_decode, llama_process in …/libllama.so`),
    /// a `--token-symbol`, fixed windows, or none. Empty in older traces.
    #[serde(default)]
    pub tokens: String,
    /// What this run cannot measure, and why: each `FEATURE: WHY` ([`degraded_feature`]),
    /// FEATURE `ebpf` (the procfs fallback instead), `tokens` (no token
    /// boundaries: only process samples, kernel histograms and health), or the
    /// name of an optional probe not attached. Empty when all works, and in older traces.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub degraded: Vec<String>,
}

/// The FEATURE of a [`RunHeader::degraded`] entry (up to the first `": "`).
pub fn degraded_feature(entry: &str) -> &str {
    entry.split_once(": ").map_or(entry, |(f, _)| f)
}

impl RunHeader {
    /// The header as it stands after `m`: what marks the tokens, the probes attached, and what
    /// the run cannot measure (the header's `degraded` and the marks', each once).
    pub fn apply(&mut self, m: &TokenMarks) {
        self.tokens.clone_from(&m.tokens);
        self.probes.clone_from(&m.probes);
        for d in &m.degraded {
            if !self.degraded.contains(d) {
                self.degraded.push(d.clone());
            }
        }
    }
}

/// What marks the tokens changed during the run: a process that exec'd (the child of a wrapper
/// such as `sh -c`) or a library loaded later brought our engine's markers or an engine profile
/// (or markers whose uprobes the kernel refused, or that were never called: `degraded`).
/// It restates the header's `tokens` and `probes` from `mono_ns` on ([`RunHeader::apply`]); the
/// header itself keeps what was known when the run started.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TokenMarks {
    pub mono_ns: u64,
    /// The process that carries them.
    pub pid: u32,
    /// As the header's `tokens`.
    pub tokens: String,
    /// Every probe attached now.
    pub probes: Vec<String>,
    /// What the run cannot measure from now on, as the header's `degraded` (e.g. `tokens: …`
    /// when the kernel refused the uprobes of markers found later). Empty in older traces.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub degraded: Vec<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelInfo {
    pub path: String,
    pub size_bytes: u64,
    /// Hex digest of the file's header and tensor table (not the whole file).
    pub hash: String,
    /// Bytes per page of the page-cache counts (`pagecache_*`, eviction blame, refaults): the
    /// kernel's page size; absent in traces written before it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub page_bytes: Option<u64>,
}

/// Process-level facts sampled during the run (memory, swap).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ProcessSample {
    pub mono_ns: u64,
    pub rss_bytes: Option<u64>,
    pub rss_anon_bytes: Option<u64>,
    pub rss_file_bytes: Option<u64>,
    pub swap_bytes: Option<u64>,
    pub mem_available_bytes: Option<u64>,
    /// Who evicted the model file's pages so far, per process ([`ProcessEvictions`]), when
    /// eviction blame is measured (empty otherwise, and in traces written before it).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub evicted_by_process: Vec<ProcessEvictions>,
}

/// Cumulative latency histograms kept in the kernel, by kind (the rows of
/// `vocab::HISTOGRAMS`: `minflt`, `majflt_file`, `majflt_swap`, `zram_read`,
/// `disk_read`; older traces' names are read as these). Per-bucket counts (not
/// cumulative): bucket `i` counts values in `(2^(i-1), 2^i]` ns
/// (`observer_common::hist`); the last is +Inf.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LatencyHistograms {
    pub mono_ns: u64,
    #[serde(deserialize_with = "histogram_kinds")]
    pub kinds: BTreeMap<String, Vec<u64>>,
    /// Exact sum of the values of each kind, nanoseconds (the kernel adds each
    /// event's value); absent in traces recorded before the kernel kept it.
    #[serde(default, deserialize_with = "histogram_kinds")]
    pub sum_ns: BTreeMap<String, u64>,
}

impl LatencyHistograms {
    /// From the kernel's histograms, indexed by the kinds' `slot`s.
    pub fn from_kernel(mono_ns: u64, hists: &[crate::attrib::Hist]) -> Self {
        let mut h = LatencyHistograms { mono_ns, ..Default::default() };
        for k in LatencyKind::ALL {
            if let Some(x) = hists.get(k.slot()) {
                h.kinds.insert(k.name().into(), x.b.to_vec());
                h.sum_ns.insert(k.name().into(), x.sum);
            }
        }
        h
    }
}

/// A map keyed by histogram kind, older names read as the current ones.
fn histogram_kinds<'de, D: Deserializer<'de>, V: Deserialize<'de>>(d: D) -> Result<BTreeMap<String, V>, D::Error> {
    let m = BTreeMap::<String, V>::deserialize(d)?;
    Ok(m.into_iter()
        .map(|(k, v)| (crate::vocab::canonical(crate::vocab::Class::Histogram, &k).map(String::from).unwrap_or(k), v))
        .collect())
}

/// The observer's own health and cost, sampled during the run.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ObserverHealth {
    pub mono_ns: u64,
    /// Cumulative events the kernel side could not deliver.
    pub lost_events: u64,
    pub probes_attached: u32,
    /// Optional probes this kernel lacks.
    pub probes_missing: u32,
    /// Cumulative run time and run count of the observer's eBPF programs
    /// (kernel BPF stats), when the kernel exposes them.
    pub bpf_run_ns: Option<u64>,
    pub bpf_run_count: Option<u64>,
    /// The same per program, by the program's name (empty when the stats are off, and in
    /// traces written before it).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub bpf_programs: Vec<ProgramCost>,
}

/// One eBPF program's cumulative cost from the kernel's BPF run-time statistics
/// (`run_time_ns` and `run_cnt` of `bpf_prog_info`): every run counts, whichever process
/// caused it (the programs filter inside).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProgramCost {
    pub name: String,
    pub run_ns: u64,
    pub runs: u64,
}

impl ProgramCost {
    /// Kernel time per run, ns (`None` before the first run).
    pub fn ns_per_run(&self) -> Option<f64> {
        (self.runs > 0).then(|| self.run_ns as f64 / self.runs as f64)
    }
}

/// How the run ended.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RunEnd {
    pub mono_ns: u64,
    pub exit_code: Option<i32>,
    pub lost_events: u64,
}

/// One item of the model stream.
#[allow(clippy::large_enum_variant, reason = "most items are tokens: boxing would allocate for nearly every item")]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Event {
    Header(RunHeader),
    /// What marks the tokens changed (after an exec or a dlopen), at most once per process.
    Marks(TokenMarks),
    Token(TokenRecord),
    Process(ProcessSample),
    Histograms(LatencyHistograms),
    Health(ObserverHealth),
    /// Per-thread and per-device totals, once, before `End` (`crate::totals`).
    Totals(RunTotals),
    End(RunEnd),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_grid_layers_are_the_vocabularys_and_reads_fold_into_their_cells() {
        let mut g = ExpertGrid {
            n_layers: 2,
            n_experts: 3,
            layers: alloc::vec![1, 3],
            resident: alloc::vec![0.5; 6],
            added: Some(alloc::vec![0; 6]),
            evicted: Some(alloc::vec![0; 6]),
            refault_faults: Some(alloc::vec![0; 6]),
            refault_io_ns: Some(alloc::vec![0; 6]),
            ..Default::default()
        };
        let reads = |experts: Vec<ExpertRead>| ExplicitReads { experts, ..Default::default() };
        let r = |layer, expert, bytes, calls| ExpertRead { layer, expert, bytes, calls };
        // Two steps fold into one grid; a read of a block the grid has no row for stays outside.
        assert_eq!(g.add_reads(&reads(alloc::vec![r(1, 2, 4096, 1), r(3, 0, 100, 2)])), 0);
        assert_eq!(g.add_reads(&reads(alloc::vec![r(3, 0, 50, 1), r(2, 0, 7, 1), r(3, 3, 9, 1)])), 16);
        assert_eq!(g.read_bytes, Some(alloc::vec![0, 0, 4096, 150, 0, 0]));
        assert_eq!(g.read_calls, Some(alloc::vec![0, 0, 1, 3, 0, 0]));
        // Every per-cell field after the shape is a row of the vocabulary, named by its JSON key.
        let v = serde_json::to_value(&g).unwrap();
        let keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        for row in crate::vocab::GRID_LAYERS.iter() {
            assert!(keys.contains(&row.json), "{} is not a field of the grid", row.json);
        }
        let shape = ["n_layers", "n_experts", "layers"];
        for k in keys {
            assert!(
                shape.contains(&k) || crate::vocab::GRID_LAYERS.iter().any(|r| r.json == k),
                "{k} not in the vocabulary"
            );
        }
        // A grid written before the read layers existed reads back without them.
        let old: ExpertGrid =
            serde_json::from_str(r#"{"n_layers":1,"n_experts":1,"resident":[1.0],"added":null,"evicted":null}"#)
                .unwrap();
        assert_eq!((old.read_bytes, old.read_calls), (None, None));
        assert_eq!((old.refault_faults, old.refault_io_ns), (None, None));
        let old: ExpertRead = serde_json::from_str(r#"{"layer":1,"expert":2,"bytes":3}"#).unwrap();
        assert_eq!(old.calls, 0);
    }

    #[test]
    fn components_serialise_with_vocabulary_names_and_null_for_unmeasured() {
        let mut c = Components::default();
        c.set(Component::Compute, Some(5));
        let j = serde_json::to_string(&c).unwrap();
        assert!(j.contains("\"compute_ns\":5"), "{j}");
        assert!(j.contains("\"swapin_zram_ns\":null"), "{j}");
        let back: Components = serde_json::from_str(&j).unwrap();
        assert_eq!(back, c);
    }

    #[test]
    fn unknown_keys_of_any_type_are_skipped() {
        let c: Components =
            serde_json::from_str(r#"{"compute_ns": 3, "future": {"a": [1, "x"]}, "name": "t"}"#).unwrap();
        assert_eq!(c.get(Component::Compute), Some(3));
    }

    #[test]
    fn token_record_round_trips() {
        let mut t = TokenRecord {
            seq: 3,
            index: Some(7),
            kind: StepKind::Generate,
            n_tokens: 1,
            start_ns: 10,
            wall_ns: 100,
            components: Components::from_kernel(&[60, 10, 5, 5, 0, 0, 10, 5, 5, 0, 0]),
            residual_ns: 0,
            counters: Counters::default(),
            engine_compute_ns: Some(80),
            threads: Vec::new(),
            engine: None,
            residency: None,
            lost_events: 0,
            evicted_by: None,
            refaults: None,
            explicit_reads: None,
        };
        t.counters.set(Counter::Minflt, Some(12));
        let j = serde_json::to_string(&Event::Token(t.clone())).unwrap();
        assert!(j.contains("\"type\":\"token\""), "{j}");
        assert!(j.contains("\"minflt\":12") && j.contains("\"majflt_swap\":null"), "{j}");
        let back: Event = serde_json::from_str(&j).unwrap();
        assert_eq!(back, Event::Token(t.clone()));
        assert_eq!(t.hidden_ns(), Some(20));
        // Components not measured are `null`, and the measured ones add up.
        assert!(j.contains("\"io_wait_peer_ns\":0"), "{j}");
        t.components.set(Component::IoWaitPeer, None);
        let j = serde_json::to_string(&Event::Token(t.clone())).unwrap();
        assert!(j.contains("\"io_wait_peer_ns\":null"), "{j}");
        assert_eq!(t.components.sum(), 100);
    }

    #[test]
    fn older_histogram_names_read_as_the_vocabulary_s() {
        let h: Event = serde_json::from_str(
            r#"{"type":"histograms","mono_ns":1,"kinds":{"fault_major_file":[0,2],"fault_minor":[1],"zram_read":[3]}}"#,
        )
        .unwrap();
        let Event::Histograms(h) = h else { panic!("{h:?}") };
        assert_eq!(h.kinds.keys().collect::<Vec<_>>(), ["majflt_file", "minflt", "zram_read"]);
        assert!(h.sum_ns.is_empty(), "no sums in older traces");
    }

    #[test]
    fn residency_keys_are_the_vocabulary_s() {
        let r = Residency {
            dense_resident_frac: Some(1.0),
            dense_swapped_frac: Some(0.0),
            experts_resident_frac: Some(0.5),
            grid: None,
            engine_cache: Some(EngineCache::default()),
        };
        let j = serde_json::to_value(&r).unwrap();
        let keys: Vec<&str> = j.as_object().unwrap().keys().map(String::as_str).collect();
        let mut want: Vec<&str> = crate::vocab::ResidencyField::ALL
            .iter()
            .filter(|f| **f != crate::vocab::ResidencyField::File)
            .map(|f| f.json_key())
            .collect();
        want.sort();
        assert_eq!(keys, want);
    }

    #[test]
    fn step_kinds_are_the_vocabulary_s() {
        for k in StepKind::ALL {
            assert_eq!(serde_json::to_string(&k).unwrap(), alloc::format!("\"{}\"", k.name()));
        }
        assert_eq!(StepKind::ALL.len(), crate::vocab::STEPS.len());
    }

    #[test]
    fn kernel_slots_fill_the_measured_components() {
        let c = Components::from_kernel(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]);
        assert_eq!(c.get(Component::Compute), Some(1));
        assert_eq!(c.get(Component::IoWait), Some(5));
        assert_eq!(c.get(Component::IoWaitPeer), Some(11));
        assert_eq!(c.get(Component::Reclaim), Some(6));
        assert_eq!(c.get(Component::Sleep), Some(9));
        assert_eq!(c.get(Component::Unattributed), Some(10));
        assert_eq!(c.sum(), 66);
    }
}
