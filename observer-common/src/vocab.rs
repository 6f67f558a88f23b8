//! The vocabulary: every name the observer prints, defined once.
//!
//! ## Spec
//! One table of [`Row`]s, one row per time component, other time, counter,
//! latency-histogram kind, residency field, model region, step kind, eviction
//! actor and per-entity breakdown. A row gives the name and everything every
//! output derives from it:
//! - `name`: the vocabulary name (`compute`, `majflt_file`, …);
//! - `json`: its key in JSON (summaries, traces, the heatmap): `<name>_ns` for a
//!   time, the name otherwise;
//! - `short`: its column label, at most [`SHORT_MAX`] characters, used by the
//!   TUI and by `observer run`'s per-token lines alike;
//! - `prom`: its Prometheus series: a [`Family`] of [`FAMILIES`] and, when the
//!   family holds several rows, the label that tells them apart
//!   (`moe_observer_time_seconds_total{component="compute"}`, node_exporter's
//!   `node_cpu_seconds_total{mode}` pattern: a family per kind of quantity);
//! - `help`: one line, for the README tables, `--help`-style text and the
//!   Prometheus `HELP` of single-row families;
//! - `aliases`: names that older traces used for it (read, never written);
//! - `status`: [`Status::Planned`] for a name chosen ahead of the issue that
//!   measures it: its value is `None` (not measured) until then.
//!
//! Rules: the time components of a thread add up to its wall time, with
//! unmeasured (`None`) components counted as absent; Prometheus labels are
//! bounded (fixed kinds, the model's layers, top-[`TOP_ACTOR_NAMES`] names plus
//! [`OTHER`]) and never a PID or TID; per-thread and per-process detail goes to
//! JSON, traces and the TUI only.
//!
//! The kernel side keeps components, counters and histograms in arrays
//! (`attrib::ThreadState::time`, `cnt`, the `HISTS` map); their indices
//! (`attrib::T_*`, `C_*`, `H_*`) are the rows' `slot`s, read from this table at
//! compile time, so the two cannot disagree.
//!
//! The tables of the README's "What the numbers mean" and "Prometheus" sections
//! and its "Changes" list are rendered from here (`readme_section`), and a
//! test compares them with the README.

/// Longest short label.
pub const SHORT_MAX: usize = 7;
/// Eviction actor names exported as `actor_name` values; the rest are [`OTHER`].
pub const TOP_ACTOR_NAMES: usize = 8;
/// The label value for everything beyond a bounded set.
pub const OTHER: &str = "other";
/// Prefix of every Prometheus metric.
pub const PROM_PREFIX: &str = "moe_observer";

/// What a row names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    /// A time component: the components of a thread add up to its wall time.
    Component,
    /// Another time: wall, residual, the engine's own compute, the hidden cost.
    Time,
    /// A count summed over threads.
    Counter,
    /// A kernel latency histogram: the latency of each event of one kind.
    Histogram,
    /// A residency field: a share of the model's weights in RAM.
    Residency,
    /// A region of the model file (heatmap JSON and CSV).
    Region,
    /// A kind of step (token record).
    Step,
    /// Who evicted model-file pages.
    EvictionActor,
    /// A kind of region explicit reads of the model file are charged to.
    ExplicitRead,
    /// A per-expert layer of the layer × expert grid (`model::ExpertGrid`).
    GridLayer,
    /// Per-entity rows in the JSON and the whole-run table.
    Breakdown,
    /// The observer's own health.
    Health,
}

/// Where a component's time is spent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cpu {
    Yes,
    No,
    /// On or off CPU; `mostly_on`: a thread with time here ran (`Component::on_cpu`).
    Both {
        mostly_on: bool,
    },
    /// Not known (the state was not seen).
    Unknown,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Measured,
    /// Named ahead of the issue that measures it; `None` until then.
    Planned(&'static str),
}

/// Prometheus metric types.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MetricType {
    Counter,
    Gauge,
    Histogram,
}

/// Base units of a family (appended to its name).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    Seconds,
    Bytes,
    Pages,
}

impl Unit {
    pub const fn name(self) -> &'static str {
        match self {
            Unit::Seconds => "seconds",
            Unit::Bytes => "bytes",
            Unit::Pages => "pages",
        }
    }
}

/// A Prometheus metric family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Family {
    /// Name without prefix, unit and `_total`.
    pub stem: &'static str,
    pub unit: Option<Unit>,
    pub metric: MetricType,
    /// Labels every series of the family has (a row's own label comes after).
    pub labels: &'static [&'static str],
    /// Labels that planned rows will add (not exported yet).
    pub planned_labels: &'static [&'static str],
    pub help: &'static str,
}

/// A row's Prometheus series: its family and, in a family of several rows,
/// the label (name, value) that tells it apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Series {
    pub family: &'static Family,
    pub label: Option<(&'static str, &'static str)>,
}

/// One name of the vocabulary (see the module spec).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Row {
    pub class: Class,
    pub name: &'static str,
    pub json: &'static str,
    pub short: &'static str,
    pub prom: Option<Series>,
    pub help: &'static str,
    pub aliases: &'static [&'static str],
    pub status: Status,
    /// Index in the kernel's arrays (components, counters, histograms), if it has one.
    pub slot: Option<usize>,
    /// Components only.
    pub cpu: Option<Cpu>,
}

const fn row(class: Class, name: &'static str, json: &'static str, short: &'static str, help: &'static str) -> Row {
    Row { class, name, json, short, prom: None, help, aliases: &[], status: Status::Measured, slot: None, cpu: None }
}

impl Row {
    const fn prom(mut self, family: &'static Family, label: Option<(&'static str, &'static str)>) -> Row {
        self.prom = Some(Series { family, label });
        self
    }
    const fn slot(mut self, s: usize) -> Row {
        self.slot = Some(s);
        self
    }
    const fn cpu(mut self, c: Cpu) -> Row {
        self.cpu = Some(c);
        self
    }
    const fn planned(mut self, by: &'static str) -> Row {
        self.status = Status::Planned(by);
        self
    }
    const fn aliases(mut self, a: &'static [&'static str]) -> Row {
        self.aliases = a;
        self
    }
    pub const fn measured(&self) -> bool {
        matches!(self.status, Status::Measured)
    }
}

// ---- Prometheus families ----------------------------------------------------------------------

const STEP: &[&str] = &["step"];

pub const F_STEP_DURATION: Family = Family {
    stem: "step_duration",
    unit: Some(Unit::Seconds),
    metric: MetricType::Histogram,
    labels: STEP,
    planned_labels: &[],
    help: "Wall time of each step (a generated token, the prompt, a --token-symbol call or a --window), log2 buckets (le = 2^b ns), exact _sum; _count counts the steps",
};
pub const F_TOKENS: Family = Family {
    stem: "tokens",
    unit: None,
    metric: MetricType::Counter,
    labels: STEP,
    planned_labels: &[],
    help: "Tokens processed (n_tokens of each step; windows are not tokens)",
};
pub const F_TIME: Family = Family {
    stem: "time",
    unit: Some(Unit::Seconds),
    metric: MetricType::Counter,
    labels: STEP,
    planned_labels: &[],
    help: "Time of the steps by component, mean over the threads that ran; the components add up to the steps' wall time (step_duration_seconds_sum) less the residual",
};
pub const F_ENGINE_COMPUTE: Family = Family {
    stem: "engine_compute",
    unit: Some(Unit::Seconds),
    metric: MetricType::Counter,
    labels: STEP,
    planned_labels: &[],
    help: "The engine's own compute (wall minus what it timed: a residual), over steps where the observer also measured compute",
};
pub const F_ENGINE_STEPS: Family = Family {
    stem: "engine_steps",
    unit: None,
    metric: MetricType::Counter,
    labels: STEP,
    planned_labels: &[],
    help: "Steps counted in engine_compute_seconds_total",
};
pub const F_ENGINE_STEPS_COMPUTE: Family = Family {
    stem: "engine_steps_compute",
    unit: Some(Unit::Seconds),
    metric: MetricType::Counter,
    labels: STEP,
    planned_labels: &[],
    help: "Measured compute of the steps counted in engine_compute_seconds_total; the difference is the hidden cost",
};
pub const F_FAULTS: Family = Family {
    stem: "faults",
    unit: None,
    metric: MetricType::Counter,
    labels: STEP,
    planned_labels: &[],
    help: "Page faults of the steps by kind (minor; major served from a file; major served from swap), summed over threads",
};
pub const F_FAULTS_UNTIMED: Family = Family {
    stem: "faults_untimed",
    unit: None,
    metric: MetricType::Counter,
    labels: STEP,
    planned_labels: &[],
    help: "Minor faults of the steps counted but not timed (fault-storm sampling: their time and latency are estimated from the timed ones), summed over threads",
};
pub const F_SWAPIN: Family = Family {
    stem: "swapin",
    unit: Some(Unit::Pages),
    metric: MetricType::Counter,
    labels: STEP,
    planned_labels: &[],
    help: "Pages read from swap devices (zram included) by the steps' faults, summed over threads",
};
pub const F_READ: Family = Family {
    stem: "read",
    unit: Some(Unit::Bytes),
    metric: MetricType::Counter,
    labels: STEP,
    planned_labels: &[],
    help: "Bytes of read requests queued on block devices during the steps, summed over threads",
};
pub const F_PAGECACHE_ADDED: Family = Family {
    stem: "pagecache_added",
    unit: Some(Unit::Pages),
    metric: MetricType::Counter,
    labels: STEP,
    planned_labels: &[],
    help: "Model-file pages added to the page cache during the steps",
};
pub const F_PAGECACHE_EVICTED: Family = Family {
    stem: "pagecache_evicted",
    unit: Some(Unit::Pages),
    metric: MetricType::Counter,
    labels: STEP,
    planned_labels: &[],
    help: "Model-file pages evicted from the page cache during the steps",
};
/// The label of an eviction actor kind ([`EVICTION_ACTORS`]' rows carry it).
pub const ACTOR_LABEL: &str = "actor";
/// The label of an evicting process's name: the top [`TOP_ACTOR_NAMES`] names, the rest [`OTHER`].
pub const ACTOR_NAME_LABEL: &str = "actor_name";
const STEP_ACTOR: &[&str] = &["step", ACTOR_LABEL];
pub const F_PAGECACHE_EVICTED_BY_NAME: Family = Family {
    stem: "pagecache_evicted_by_name",
    unit: Some(Unit::Pages),
    metric: MetricType::Counter,
    labels: &[ACTOR_LABEL, ACTOR_NAME_LABEL],
    planned_labels: &[],
    help: "Model-file pages evicted from the page cache, by actor kind and the evicting process's name (comm); the first 8 names (TOP_ACTOR_NAMES), taken most pages first, keep their own actor_name, the rest are other",
};
pub const F_REFAULTED: Family = Family {
    stem: "refaulted",
    unit: Some(Unit::Pages),
    metric: MetricType::Counter,
    labels: STEP_ACTOR,
    planned_labels: &[],
    help: "Model-file pages added back to the page cache during the steps after an eviction (refaults), by the actor kind of that eviction",
};
pub const F_REFAULT_FAULTS: Family = Family {
    stem: "refault_faults",
    unit: None,
    metric: MetricType::Counter,
    labels: STEP_ACTOR,
    planned_labels: &[],
    help: "Page faults of the observed threads during the steps that brought an evicted model-file page back, by the actor kind of that eviction",
};
pub const F_REFAULT_IO: Family = Family {
    stem: "refault_io",
    unit: Some(Unit::Seconds),
    metric: MetricType::Counter,
    labels: STEP_ACTOR,
    planned_labels: &[],
    help: "fault_io time of those faults, by the actor kind of the eviction they undid: what each kind of eviction cost the engine in waits for the disk",
};
const STEP_REGION: &[&str] = &["step", "region"];
pub const F_EXPLICIT_READ: Family = Family {
    stem: "explicit_read",
    unit: Some(Unit::Bytes),
    metric: MetricType::Counter,
    labels: STEP_REGION,
    planned_labels: &[],
    help: "Bytes the steps' read/pread system calls returned from the model file, by the region they read (label region: dense, experts, other), summed over threads",
};
pub const F_EXPLICIT_READ_TIME: Family = Family {
    stem: "explicit_read_time",
    unit: Some(Unit::Seconds),
    metric: MetricType::Counter,
    labels: STEP_REGION,
    planned_labels: &[],
    help: "Time inside those system calls (entry to exit), by region, summed over threads (overlapping reads can exceed the wall time)",
};
pub const F_CONTEXT_SWITCHES: Family = Family {
    stem: "context_switches",
    unit: None,
    metric: MetricType::Counter,
    labels: STEP,
    planned_labels: &[],
    help: "Switches away from the CPU during the steps, summed over threads",
};
pub const F_DENSE_RESIDENT: Family = Family {
    stem: "dense_resident_ratio",
    unit: None,
    metric: MetricType::Gauge,
    labels: &[],
    planned_labels: &[],
    help: "Share of the dense weights (dense tensors and shared experts) resident in RAM (latest token)",
};
pub const F_DENSE_SWAPPED: Family = Family {
    stem: "dense_swapped_ratio",
    unit: None,
    metric: MetricType::Gauge,
    labels: &[],
    planned_labels: &[],
    help: "Share of an anonymous copy of the dense weights in swap (latest token)",
};
pub const F_EXPERTS_RESIDENT: Family = Family {
    stem: "experts_resident_ratio",
    unit: None,
    metric: MetricType::Gauge,
    labels: &[],
    planned_labels: &[],
    help: "Share of the routed experts' bytes in the page cache (latest token)",
};
pub const F_LAYER_EXPERTS_RESIDENT: Family = Family {
    stem: "layer_experts_resident_ratio",
    unit: None,
    metric: MetricType::Gauge,
    labels: &["layer"],
    planned_labels: &[],
    help: "Mean resident share of the routed experts of each layer (latest token)",
};
pub const F_FAULT_LATENCY: Family = Family {
    stem: "fault_latency",
    unit: Some(Unit::Seconds),
    metric: MetricType::Histogram,
    labels: &[],
    planned_labels: &[],
    help: "Latency of the target's page faults by kind, entry to completion, log2 buckets kept in the kernel, with the kernel's exact sum (in fault storms, 1 minor fault in 8 timed, standing for the others)",
};
pub const F_BLOCK_READ_LATENCY: Family = Family {
    stem: "block_read_latency",
    unit: Some(Unit::Seconds),
    metric: MetricType::Histogram,
    labels: &[],
    planned_labels: &[],
    help: "Latency of the target's block reads by device kind, bio queued to completed, log2 buckets kept in the kernel, with the kernel's exact sum",
};
pub const F_TARGET_RSS: Family = Family {
    stem: "target_rss",
    unit: Some(Unit::Bytes),
    metric: MetricType::Gauge,
    labels: &[],
    planned_labels: &[],
    help: "Resident memory of the target",
};
pub const F_TARGET_RSS_ANON: Family = Family {
    stem: "target_rss_anon",
    unit: Some(Unit::Bytes),
    metric: MetricType::Gauge,
    labels: &[],
    planned_labels: &[],
    help: "Anonymous resident memory of the target",
};
pub const F_TARGET_RSS_FILE: Family = Family {
    stem: "target_rss_file",
    unit: Some(Unit::Bytes),
    metric: MetricType::Gauge,
    labels: &[],
    planned_labels: &[],
    help: "File-backed resident memory of the target",
};
pub const F_TARGET_SWAP: Family = Family {
    stem: "target_swap",
    unit: Some(Unit::Bytes),
    metric: MetricType::Gauge,
    labels: &[],
    planned_labels: &[],
    help: "Swapped-out memory of the target",
};
pub const F_MEM_AVAILABLE: Family = Family {
    stem: "mem_available",
    unit: Some(Unit::Bytes),
    metric: MetricType::Gauge,
    labels: &[],
    planned_labels: &[],
    help: "The machine's MemAvailable",
};
pub const F_LOST_EVENTS: Family = Family {
    stem: "lost_events",
    unit: None,
    metric: MetricType::Counter,
    labels: &[],
    planned_labels: &[],
    help: "Events the kernel side could not deliver",
};
pub const F_PROBES_ATTACHED: Family = Family {
    stem: "probes_attached",
    unit: None,
    metric: MetricType::Gauge,
    labels: &[],
    planned_labels: &[],
    help: "The observer's probes attached to the current target",
};
pub const F_PROBES_MISSING: Family = Family {
    stem: "probes_missing",
    unit: None,
    metric: MetricType::Gauge,
    labels: &[],
    planned_labels: &[],
    help: "Optional probes this kernel lacks",
};
pub const F_DEGRADED: Family = Family {
    stem: "degraded",
    unit: None,
    metric: MetricType::Gauge,
    labels: &["feature"],
    planned_labels: &[],
    help: "1 for each feature the observation of the current target lacks (ebpf: procfs fallback; tokens: no token boundaries; an optional probe's name); the log and /healthz say why",
};
pub const F_BPF_RUN: Family = Family {
    stem: "bpf_run",
    unit: Some(Unit::Seconds),
    metric: MetricType::Counter,
    labels: &[],
    planned_labels: &[],
    help: "Run time of the observer's eBPF programs (kernel BPF statistics: with `--bpf-stats`, or when the host has `kernel.bpf_stats_enabled=1`)",
};
pub const F_BPF_RUNS: Family = Family {
    stem: "bpf_runs",
    unit: None,
    metric: MetricType::Counter,
    labels: &[],
    planned_labels: &[],
    help: "Runs of the observer's eBPF programs (kernel BPF statistics)",
};
pub const F_TARGET_UP: Family = Family {
    stem: "target_up",
    unit: None,
    metric: MetricType::Gauge,
    labels: &[],
    planned_labels: &[],
    help: "Targets being observed now (1 while one is; under serve --discover, per label set)",
};
pub const F_RUNS: Family = Family {
    stem: "runs",
    unit: None,
    metric: MetricType::Counter,
    labels: &[],
    planned_labels: &[],
    help: "Targets observed (observer serve re-attaches after restarts)",
};
pub const F_BUILD_INFO: Family = Family {
    stem: "build_info",
    unit: None,
    metric: MetricType::Gauge,
    labels: &["version", "trace_format"],
    planned_labels: &[],
    help: "Always 1; the observer's version and the trace format version it writes",
};

/// The labels of a target, declared once for every per-target family
/// (ebpf_exporter's style: a family's own labels come after them). Only
/// `observer serve --discover`, which observes several targets at once, sets
/// them: `engine` (`moe-engine`, an engine profile's name, or `gguf`),
/// `model` (the model's file name, as its process sees it), `container` (the
/// cgroup v2 container id, 12 hex digits, or empty on the host). Bounded and
/// stable: never a PID or a TID.
pub const TARGET_LABELS: [&str; 3] = ["engine", "model", "container"];

/// The families that describe the machine or the observer, not a target:
/// they never carry [`TARGET_LABELS`].
pub static MACHINE_FAMILIES: [&Family; 2] = [&F_MEM_AVAILABLE, &F_BUILD_INFO];

impl Family {
    /// Whether its series carry [`TARGET_LABELS`] (under `serve --discover`).
    pub fn per_target(&self) -> bool {
        !MACHINE_FAMILIES.iter().any(|f| f.stem == self.stem)
    }
}

/// Every family, in exposition order.
pub static FAMILIES: [&Family; 39] = [
    &F_STEP_DURATION,
    &F_TOKENS,
    &F_TIME,
    &F_ENGINE_COMPUTE,
    &F_ENGINE_STEPS,
    &F_ENGINE_STEPS_COMPUTE,
    &F_FAULTS,
    &F_FAULTS_UNTIMED,
    &F_SWAPIN,
    &F_READ,
    &F_PAGECACHE_ADDED,
    &F_PAGECACHE_EVICTED,
    &F_PAGECACHE_EVICTED_BY_NAME,
    &F_REFAULTED,
    &F_REFAULT_FAULTS,
    &F_REFAULT_IO,
    &F_CONTEXT_SWITCHES,
    &F_EXPLICIT_READ,
    &F_EXPLICIT_READ_TIME,
    &F_DENSE_RESIDENT,
    &F_DENSE_SWAPPED,
    &F_EXPERTS_RESIDENT,
    &F_LAYER_EXPERTS_RESIDENT,
    &F_FAULT_LATENCY,
    &F_BLOCK_READ_LATENCY,
    &F_TARGET_RSS,
    &F_TARGET_RSS_ANON,
    &F_TARGET_RSS_FILE,
    &F_TARGET_SWAP,
    &F_MEM_AVAILABLE,
    &F_LOST_EVENTS,
    &F_PROBES_ATTACHED,
    &F_PROBES_MISSING,
    &F_DEGRADED,
    &F_BPF_RUN,
    &F_BPF_RUNS,
    &F_TARGET_UP,
    &F_RUNS,
    &F_BUILD_INFO,
];

// ---- the rows ---------------------------------------------------------------------------------

const fn component(name: &'static str, json: &'static str, short: &'static str, help: &'static str) -> Row {
    row(Class::Component, name, json, short, help).prom(&F_TIME, Some(("component", name)))
}

/// Time components, in display order (the order of [`Component::ALL`]).
pub static COMPONENTS: [Row; 11] = [
    component("compute", "compute_ns", "compute", "user-mode time: measured, not a residual").slot(0).cpu(Cpu::Yes),
    component(
        "fault_minor",
        "fault_minor_ns",
        "flt_min",
        "CPU time handling page faults (minor faults, and the set-up and tail of major ones)",
    )
    .slot(1)
    .cpu(Cpu::Yes),
    component(
        "swapin_zram",
        "swapin_zram_ns",
        "zram_in",
        "inside a fault, after it queued a read from zram: decompressing a swapped-out page",
    )
    .slot(2)
    .cpu(Cpu::Yes),
    component(
        "fault_io",
        "fault_io_ns",
        "flt_io",
        "inside a fault, from queueing a disk read until the wakeup (file refault or disk swap; the CPU part of issuing the read counts too), and any other blocked time in a fault",
    )
    .slot(3)
    .cpu(Cpu::No),
    component(
        "io_wait",
        "io_wait_ns",
        "io_wait",
        "time in explicit I/O syscalls (read, pread, readv, io_uring_enter, …)",
    )
    .slot(4)
    .cpu(Cpu::Both { mostly_on: false }),
    component(
        "io_wait_peer",
        "io_wait_peer_ns",
        "io_peer",
        "blocked (futex, condvar, …) until another thread of the process woke it in a syscall after one of its own device reads returned during the wait, e.g. an expert cache's I/O worker",
    )
    .slot(10)
    .cpu(Cpu::No),
    component(
        "reclaim",
        "reclaim_ns",
        "reclaim",
        "direct or memcg reclaim the thread had to do before it could allocate",
    )
    .slot(5)
    .cpu(Cpu::Both { mostly_on: true }),
    component("syscall", "syscall_ns", "syscall", "CPU time in other syscalls").slot(6).cpu(Cpu::Yes),
    component(
        "runqueue",
        "runqueue_ns",
        "runq",
        "runnable but waiting for a CPU (preempted, or woken and not yet running)",
    )
    .slot(7)
    .cpu(Cpu::No),
    component("sleep", "sleep_ns", "sleep", "blocked for anything else (futex, condvar, nanosleep, poll, …)")
        .slot(8)
        .cpu(Cpu::No),
    component(
        "unattributed",
        "unattributed_ns",
        "unattr",
        "a thread's time before its state is known (attached mid-life: from the attach until its first event); never `compute`",
    )
    .slot(9)
    .cpu(Cpu::Unknown),
];

/// Other times.
pub static TIMES: [Row; 4] = [
    row(Class::Time, "wall", "wall_ns", "wall", "the step's wall time: begin to end marker, or the window")
        .prom(&F_STEP_DURATION, None),
    row(
        Class::Time,
        "residual",
        "residual_ns",
        "resid",
        "wall − Σ components of the mean thread: time no component accounts for (negative when they overshoot); shown, not hidden",
    ),
    row(
        Class::Time,
        "engine_compute",
        "engine_compute_ns",
        "eng_cmp",
        "the engine's own `compute_ms` (wall minus what it timed): a residual",
    )
    .prom(&F_ENGINE_COMPUTE, None),
    row(
        Class::Time,
        "hidden",
        "hidden_ns",
        "hidden",
        "`engine_compute − compute`: the cost the engine's residual hides",
    ),
];

const fn counter(name: &'static str, short: &'static str, help: &'static str) -> Row {
    row(Class::Counter, name, name, short, help)
}

/// Counters, in display order (the order of [`Counter::ALL`]).
pub static COUNTERS: [Row; 9] = [
    counter("majflt_file", "majF", "major faults that read a page from a file (refaults)")
        .prom(&F_FAULTS, Some(("kind", "file")))
        .slot(0),
    counter("majflt_swap", "majS", "major faults that swapped a page in (zram included)")
        .prom(&F_FAULTS, Some(("kind", "swap")))
        .slot(1),
    counter("minflt", "minflt", "minor faults").prom(&F_FAULTS, Some(("kind", "minor"))).slot(2),
    counter(
        "minflt_untimed",
        "untimed",
        "of the minor faults, those counted but not timed in a fault storm (1 in 8 timed; their time and latency estimated from those)",
    )
    .prom(&F_FAULTS_UNTIMED, None)
    .slot(6),
    counter("swapins", "swapin", "pages read from swap devices by the thread's faults (zram included)")
        .prom(&F_SWAPIN, None)
        .slot(3),
    counter("read_bytes", "read", "bytes of read requests the thread queued on block devices")
        .prom(&F_READ, None)
        .slot(4),
    counter("pagecache_added", "pc_in", "model-file pages added to the page cache (by anyone; per expert in the grid)")
        .prom(&F_PAGECACHE_ADDED, None),
    counter(
        "pagecache_evicted",
        "pc_out",
        "model-file pages evicted from the page cache (by anyone; per expert in the grid)",
    )
    .prom(&F_PAGECACHE_EVICTED, None),
    counter("ctx_switches", "ctxsw", "switches away from the CPU").prom(&F_CONTEXT_SWITCHES, None).slot(7),
];

const fn latency(
    name: &'static str,
    short: &'static str,
    help: &'static str,
    f: &'static Family,
    kind: &'static str,
) -> Row {
    row(Class::Histogram, name, name, short, help).prom(f, Some(("kind", kind)))
}

/// Kernel latency histograms: named after the counter whose events they time.
pub static HISTOGRAMS: [Row; 5] = [
    latency("minflt", "minflt", "minor faults, entry to completion", &F_FAULT_LATENCY, "minor")
        .slot(0)
        .aliases(&["fault_minor"]),
    latency(
        "majflt_file",
        "majF",
        "major faults served from a file, entry to completion (the refault's I/O wait)",
        &F_FAULT_LATENCY,
        "file",
    )
    .slot(1)
    .aliases(&["fault_major_file"]),
    latency(
        "majflt_swap",
        "majS",
        "major faults served from swap, entry to completion (zram decompression or disk swap)",
        &F_FAULT_LATENCY,
        "swap",
    )
    .slot(2)
    .aliases(&["fault_major_swap"]),
    latency(
        "zram_read",
        "zram",
        "the target's zram reads, bio queued to completed (decompression)",
        &F_BLOCK_READ_LATENCY,
        "zram",
    )
    .slot(3),
    latency(
        "disk_read",
        "disk",
        "the target's block-device reads other than zram, bio queued to completed",
        &F_BLOCK_READ_LATENCY,
        "disk",
    )
    .slot(4),
];

/// Residency fields.
pub static RESIDENCY: [Row; 6] = [
    row(
        Class::Residency,
        "dense_resident_frac",
        "dense_resident_frac",
        "dense",
        "share of the dense weights (dense tensors and shared experts: what every token reads) resident in RAM; of an engine's anonymous copy when it publishes one (pagemap)",
    )
    .prom(&F_DENSE_RESIDENT, None),
    row(
        Class::Residency,
        "dense_swapped_frac",
        "dense_swapped_frac",
        "dswap",
        "share of an engine's anonymous copy of the dense weights in swap (zram included); file pages are never swapped",
    )
    .prom(&F_DENSE_SWAPPED, None),
    row(
        Class::Residency,
        "experts_resident_frac",
        "experts_resident_frac",
        "experts",
        "share of the routed experts' bytes in the page cache",
    )
    .prom(&F_EXPERTS_RESIDENT, None),
    row(
        Class::Residency,
        "grid",
        "grid",
        "grid",
        "layer × expert resident fractions (an expert: its slices of `ffn_*_exps`), with the pages each expert gained and lost during the token; Prometheus: the mean per layer",
    )
    .prom(&F_LAYER_EXPERTS_RESIDENT, None),
    row(
        Class::Residency,
        "file_resident_frac",
        "file_resident_frac",
        "file",
        "the whole model file: resident pages / pages, as `fincore` counts (heatmap)",
    ),
    row(
        Class::Residency,
        "engine_cache",
        "engine_cache",
        "ecache",
        "the engine's own expert cache, from the slot table it publishes: the grid cells of the experts ready in its slots, the reads it started since the previous sample (the table's version counter) and the observer's hit rate over the generated tokens in between",
    ),
];

/// Regions of the model file (heatmap JSON `regions`, CSV `kind`).
pub static REGIONS: [Row; 3] = [
    row(
        Class::Region,
        "dense_tensors",
        "dense_tensors",
        "dense",
        "tensors that are not experts (attention, norms, embeddings, router)",
    ),
    row(Class::Region, "shared_experts", "shared_experts", "shared", "shared experts (read by every token)"),
    row(Class::Region, "routed_experts", "routed_experts", "experts", "routed experts (chosen per token)"),
];

const fn step(name: &'static str, short: &'static str, help: &'static str) -> Row {
    row(Class::Step, name, name, short, help)
}

/// Step kinds (label `step`), in the order of `model::StepKind`.
pub static STEPS: [Row; 4] = [
    step("prompt", "prompt", "prompt processing: one step for the whole prompt"),
    step("generate", "gen", "one generated token"),
    step("call", "call", "one call of a `--token-symbol` function or an engine profile's entry point"),
    step("window", "window", "a fixed `--window` (no markers); windows are not tokens"),
];

const fn actor(name: &'static str, short: &'static str, help: &'static str) -> Row {
    row(Class::EvictionActor, name, name, short, help).prom(&F_PAGECACHE_EVICTED, Some((ACTOR_LABEL, name)))
}

/// Who evicted model-file pages (label `actor` of `pagecache_evicted_pages_total` and of the
/// refault families; with `actor_name` in `pagecache_evicted_by_name_pages_total`: the top
/// [`TOP_ACTOR_NAMES`] process names, the rest [`OTHER`]).
pub static EVICTION_ACTORS: [Row; 7] = [
    actor("kswapd", "kswapd", "background reclaim by kswapd"),
    actor("direct_reclaim", "direct", "direct reclaim by an allocating task"),
    actor("memcg_reclaim", "memcg", "reclaim at a memory cgroup's limit"),
    actor("proactive_reclaim", "proact", "proactive reclaim (DAMON, `memory.reclaim`)"),
    actor("fadvise", "fadvise", "`posix_fadvise(DONTNEED)` or `madvise` by a process"),
    actor("truncate", "trunc", "truncation, hole punching or `drop_caches`"),
    actor("other", "other", "anything else"),
];

const fn explicit(name: &'static str, short: &'static str, help: &'static str) -> Row {
    row(Class::ExplicitRead, name, name, short, help).prom(&F_EXPLICIT_READ, Some(("region", name)))
}

/// Kinds of region of explicit reads (rule: `xread`; token JSON `explicit_reads`, label `region`),
/// in the order of `xread::K_*` (a compile-time check below).
pub static EXPLICIT_READS: [Row; 3] = [
    explicit("dense", "rd_dns", "read/pread bytes of dense tensors and shared experts"),
    explicit("experts", "rd_exp", "read/pread bytes of routed experts (per expert: `explicit_reads.experts`)"),
    explicit(
        "other",
        "rd_oth",
        "read/pread bytes of the model file outside tensors, or at an offset the call does not give (`read`, `readv`)",
    ),
];
const _: () = {
    assert!(crate::xread::N_KINDS == EXPLICIT_READS.len());
    assert!(str_eq(EXPLICIT_READS[crate::xread::K_DENSE].name, "dense"));
    assert!(str_eq(EXPLICIT_READS[crate::xread::K_EXPERTS].name, "experts"));
    assert!(str_eq(EXPLICIT_READS[crate::xread::K_OTHER].name, "other"));
};

const fn grid_layer(name: &'static str, short: &'static str, help: &'static str) -> Row {
    row(Class::GridLayer, name, name, short, help)
}

/// The per-expert layers of the layer × expert grid (`model::ExpertGrid`: one field each, its JSON
/// key the name), as the token records, traces, the TUI heatmap and `observer heatmap` show them.
/// Counts are over the steps since the previous grid. Never Prometheus labels (per expert).
pub static GRID_LAYERS: [Row; 7] = [
    grid_layer(
        "resident",
        "res",
        "resident fraction of the expert's bytes (its slices of `ffn_*_exps`) in the page cache",
    ),
    grid_layer("added", "pc_in", "the expert's page-cache pages added (churn; by anyone)"),
    grid_layer("evicted", "pc_out", "the expert's page-cache pages evicted (churn; by anyone)"),
    grid_layer(
        "read_bytes",
        "rd_B",
        "bytes of explicit reads (`read`/`pread` family) charged to the expert: `explicit_reads.experts` folded into cells",
    ),
    grid_layer("read_calls", "rd_n", "explicit read calls charged to the expert"),
    grid_layer(
        "refault_faults",
        "rf_n",
        "page faults of the observed threads that brought back the expert's pages after an eviction (refault faults; a fault is the expert's whose first refaulted page it holds)",
    ),
    grid_layer(
        "refault_io_ns",
        "rf_io",
        "`fault_io` time of those refault faults (ns): what the evictions of the expert cost the engine",
    ),
];
/// Indices of [`GRID_LAYERS`].
pub const G_RESIDENT: usize = 0;
pub const G_ADDED: usize = 1;
pub const G_EVICTED: usize = 2;
pub const G_READ_BYTES: usize = 3;
pub const G_READ_CALLS: usize = 4;
pub const G_REFAULT_FAULTS: usize = 5;
pub const G_REFAULT_IO: usize = 6;
const _: () = {
    assert!(str_eq(GRID_LAYERS[G_RESIDENT].name, "resident"));
    assert!(str_eq(GRID_LAYERS[G_ADDED].name, "added"));
    assert!(str_eq(GRID_LAYERS[G_EVICTED].name, "evicted"));
    assert!(str_eq(GRID_LAYERS[G_READ_BYTES].name, "read_bytes"));
    assert!(str_eq(GRID_LAYERS[G_READ_CALLS].name, "read_calls"));
    assert!(str_eq(GRID_LAYERS[G_REFAULT_FAULTS].name, "refault_faults"));
    assert!(str_eq(GRID_LAYERS[G_REFAULT_IO].name, "refault_io_ns"));
};

/// Per-entity rows (JSON and the whole-run table; never Prometheus labels).
pub static BREAKDOWNS: [Row; 2] = [
    row(
        Class::Breakdown,
        "threads",
        "threads",
        "threads",
        "per-thread rows (tid, comm): in each token record and the whole-run summary",
    ),
    row(
        Class::Breakdown,
        "processes",
        "processes",
        "procs",
        "per-process rows (pid, comm) of a spawned command and its descendants, in the whole-run table and JSON",
    )
    .planned("the children issue"),
];

/// The observer's own health.
pub static HEALTH: [Row; 1] = [row(
    Class::Health,
    "lost_events",
    "lost_events",
    "lost",
    "records the kernel side could not deliver (its 4 MiB ring was full: the observer reads it every 100 ms, and at once when an eighth of it is unread), and thread copies a token's mark could not take whole (an update of that thread on another CPU, for example on a vCPU the host preempted, ran through every attempt; their number is said at the end); shown in red when not 0",
)
.prom(&F_LOST_EVENTS, None)];

/// The whole table.
pub static TABLE: [&[Row]; 12] = [
    &COMPONENTS,
    &TIMES,
    &COUNTERS,
    &HISTOGRAMS,
    &RESIDENCY,
    &REGIONS,
    &STEPS,
    &EVICTION_ACTORS,
    &EXPLICIT_READS,
    &GRID_LAYERS,
    &BREAKDOWNS,
    &HEALTH,
];

/// Every row.
pub fn rows() -> impl Iterator<Item = &'static Row> {
    TABLE.iter().flat_map(|t| t.iter())
}

/// The row of `class` called `name`, or whose aliases include it.
pub fn lookup(class: Class, name: &str) -> Option<&'static Row> {
    rows().filter(|r| r.class == class).find(|r| r.name == name || r.aliases.contains(&name))
}

/// The current name of a `class` name that may be an older alias.
pub fn canonical(class: Class, name: &str) -> Option<&'static str> {
    lookup(class, name).map(|r| r.name)
}

// ---- the enums of the model ---------------------------------------------------------------------

/// Time components of the measurement model (rows of [`COMPONENTS`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Component {
    Compute,
    FaultMinor,
    SwapinZram,
    FaultIo,
    IoWait,
    IoWaitPeer,
    Reclaim,
    Syscall,
    Runqueue,
    Sleep,
    Unattributed,
}

impl Component {
    pub const N: usize = COMPONENTS.len();
    pub const ALL: [Component; Component::N] = [
        Component::Compute,
        Component::FaultMinor,
        Component::SwapinZram,
        Component::FaultIo,
        Component::IoWait,
        Component::IoWaitPeer,
        Component::Reclaim,
        Component::Syscall,
        Component::Runqueue,
        Component::Sleep,
        Component::Unattributed,
    ];
    pub const fn row(self) -> &'static Row {
        &COMPONENTS[self as usize]
    }
    pub const fn name(self) -> &'static str {
        self.row().name
    }
    /// `<name>_ns`.
    pub const fn json_key(self) -> &'static str {
        self.row().json
    }
    pub const fn short(self) -> &'static str {
        self.row().short
    }
    /// A thread with time here ran during the token (see `Cpu`).
    pub const fn on_cpu(self) -> bool {
        matches!(self.row().cpu, Some(Cpu::Yes | Cpu::Both { mostly_on: true }))
    }
    /// Index in the kernel's `ThreadState::time`, for the components the kernel measures.
    pub const fn slot(self) -> Option<usize> {
        self.row().slot
    }
    pub fn from_name(name: &str) -> Option<Component> {
        Component::ALL.into_iter().find(|c| c.name() == name)
    }
    /// The components this observer measures (the others are named ahead of
    /// the work that measures them): the columns of tables printed before the
    /// data is known.
    pub fn measured() -> impl Iterator<Item = Component> {
        Component::ALL.into_iter().filter(|c| c.row().measured())
    }
}

/// Counters of the measurement model (rows of [`COUNTERS`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Counter {
    MajfltFile,
    MajfltSwap,
    Minflt,
    MinfltUntimed,
    Swapins,
    ReadBytes,
    PagecacheAdded,
    PagecacheEvicted,
    CtxSwitches,
}

impl Counter {
    pub const N: usize = COUNTERS.len();
    pub const ALL: [Counter; Counter::N] = [
        Counter::MajfltFile,
        Counter::MajfltSwap,
        Counter::Minflt,
        Counter::MinfltUntimed,
        Counter::Swapins,
        Counter::ReadBytes,
        Counter::PagecacheAdded,
        Counter::PagecacheEvicted,
        Counter::CtxSwitches,
    ];
    pub const fn row(self) -> &'static Row {
        &COUNTERS[self as usize]
    }
    pub const fn name(self) -> &'static str {
        self.row().name
    }
    pub const fn json_key(self) -> &'static str {
        self.row().json
    }
    pub const fn short(self) -> &'static str {
        self.row().short
    }
    /// Index in the kernel's per-thread `ThreadState::cnt`, for the counters
    /// the kernel keeps per thread.
    pub const fn slot(self) -> Option<usize> {
        self.row().slot
    }
}

/// Other times (rows of [`TIMES`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Time {
    Wall,
    Residual,
    EngineCompute,
    Hidden,
}

impl Time {
    pub const ALL: [Time; 4] = [Time::Wall, Time::Residual, Time::EngineCompute, Time::Hidden];
    pub const fn row(self) -> &'static Row {
        &TIMES[self as usize]
    }
    pub const fn name(self) -> &'static str {
        self.row().name
    }
    /// `<name>_ns`.
    pub const fn json_key(self) -> &'static str {
        self.row().json
    }
    pub const fn short(self) -> &'static str {
        self.row().short
    }
}

/// Residency fields (rows of [`RESIDENCY`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ResidencyField {
    DenseResident,
    DenseSwapped,
    ExpertsResident,
    Grid,
    File,
    EngineCache,
}

impl ResidencyField {
    pub const ALL: [ResidencyField; 6] = [
        ResidencyField::DenseResident,
        ResidencyField::DenseSwapped,
        ResidencyField::ExpertsResident,
        ResidencyField::Grid,
        ResidencyField::File,
        ResidencyField::EngineCache,
    ];
    pub const fn row(self) -> &'static Row {
        &RESIDENCY[self as usize]
    }
    pub const fn name(self) -> &'static str {
        self.row().name
    }
    pub const fn json_key(self) -> &'static str {
        self.row().json
    }
}

/// Regions of the model file (rows of [`REGIONS`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Region {
    DenseTensors,
    SharedExperts,
    RoutedExperts,
}

impl Region {
    pub const ALL: [Region; 3] = [Region::DenseTensors, Region::SharedExperts, Region::RoutedExperts];
    pub const fn row(self) -> &'static Row {
        &REGIONS[self as usize]
    }
    pub const fn name(self) -> &'static str {
        self.row().name
    }
}

/// Kernel latency histograms (rows of [`HISTOGRAMS`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LatencyKind {
    Minflt,
    MajfltFile,
    MajfltSwap,
    ZramRead,
    DiskRead,
}

impl LatencyKind {
    pub const N: usize = HISTOGRAMS.len();
    pub const ALL: [LatencyKind; LatencyKind::N] = [
        LatencyKind::Minflt,
        LatencyKind::MajfltFile,
        LatencyKind::MajfltSwap,
        LatencyKind::ZramRead,
        LatencyKind::DiskRead,
    ];
    pub const fn row(self) -> &'static Row {
        &HISTOGRAMS[self as usize]
    }
    pub const fn name(self) -> &'static str {
        self.row().name
    }
    /// Index in the kernel's `HISTS` map.
    pub const fn slot(self) -> usize {
        match self.row().slot {
            Some(s) => s,
            None => panic!("every latency histogram lives in the kernel"),
        }
    }
}

/// `slot` of a component (for the kernel's index constants; a compile error if it has none).
pub const fn component_slot(c: Component) -> usize {
    match c.slot() {
        Some(s) => s,
        None => panic!("this component is not measured in the kernel"),
    }
}

/// `slot` of a counter (for the kernel's index constants).
pub const fn counter_slot(c: Counter) -> usize {
    match c.slot() {
        Some(s) => s,
        None => panic!("this counter is not kept per thread in the kernel"),
    }
}

// ---- compile-time checks of the table ---------------------------------------------------------

const fn str_eq(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

const fn ends_with(s: &str, suffix: &str) -> bool {
    let (s, x) = (s.as_bytes(), suffix.as_bytes());
    if s.len() < x.len() {
        return false;
    }
    let mut i = 0;
    while i < x.len() {
        if s[s.len() - x.len() + i] != x[i] {
            return false;
        }
        i += 1;
    }
    true
}

const fn check_table() {
    let mut t = 0;
    while t < TABLE.len() {
        let rows = TABLE[t];
        let mut i = 0;
        while i < rows.len() {
            let r = &rows[i];
            assert!(r.short.len() <= SHORT_MAX, "a short label is too long");
            assert!(!r.short.is_empty() && !r.name.is_empty() && !r.help.is_empty());
            // Time keys are `<name>_ns`.
            if matches!(r.class, Class::Component | Class::Time) {
                assert!(ends_with(r.json, "_ns") && r.json.len() == r.name.len() + 3);
            }
            assert!(r.cpu.is_some() == matches!(r.class, Class::Component), "cpu is for components only");
            // Names are unique within a class.
            let mut j = i + 1;
            while j < rows.len() {
                assert!(!str_eq(r.name, rows[j].name), "a name is defined twice");
                assert!(!str_eq(r.short, rows[j].short), "a short label is used twice");
                j += 1;
            }
            i += 1;
        }
        t += 1;
    }
    // The enums follow their tables, and kernel slots are distinct.
    let mut i = 0;
    while i < Component::N {
        assert!(Component::ALL[i] as usize == i);
        let mut j = i + 1;
        while j < Component::N {
            if let (Some(a), Some(b)) = (COMPONENTS[i].slot, COMPONENTS[j].slot) {
                assert!(a != b, "two components share a kernel slot");
            }
            j += 1;
        }
        i += 1;
    }
    let mut i = 0;
    while i < Counter::N {
        assert!(Counter::ALL[i] as usize == i);
        i += 1;
    }
    let mut i = 0;
    while i < TIMES.len() {
        assert!(Time::ALL[i] as usize == i);
        i += 1;
    }
    let mut i = 0;
    while i < RESIDENCY.len() {
        assert!(ResidencyField::ALL[i] as usize == i);
        i += 1;
    }
    let mut i = 0;
    while i < REGIONS.len() {
        assert!(Region::ALL[i] as usize == i);
        i += 1;
    }
    let mut i = 0;
    while i < LatencyKind::N {
        assert!(LatencyKind::ALL[i] as usize == i && LatencyKind::ALL[i].slot() == i);
        i += 1;
    }
}
const _: () = check_table();

// ---- rendering (README tables, metric names) ----------------------------------------------------

#[cfg(feature = "user")]
mod render;
#[cfg(feature = "user")]
pub use render::*;
