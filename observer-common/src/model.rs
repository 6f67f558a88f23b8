//! The model stream: what the observer knows about a run, in the design's
//! vocabulary. Live probes, the procfs fallback and recorded traces all produce
//! a sequence of [`Event`]s; the TUI, the Prometheus exporter, the recorder,
//! `report` and `diff` all consume it. (User-space only: `user` feature.)
//!
//! Spec of the names (JSON, traces, `diff`):
//! - time components, per token, nanoseconds: `compute`, `fault_minor`,
//!   `swapin_zram`, `fault_io`, `io_wait`, `reclaim`, `syscall`, `runqueue`,
//!   `sleep` (serialised as `<name>_ns`), plus `wall_ns` and `engine_compute_ns`;
//! - counters: `majflt_file`, `majflt_swap`, `minflt`, `swapins`, `read_bytes`,
//!   `pagecache_added`, `pagecache_evicted`, `ctx_switches`;
//! - residency: `dense_resident_frac`, `dense_swapped_frac`,
//!   `experts_resident_frac`, and a layer × expert grid.
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

/// Time components of the measurement model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Component {
    /// User-mode on-CPU time (measured, not a residual).
    Compute,
    /// On-CPU time handling minor faults.
    FaultMinor,
    /// On-CPU time inside faults that swapped in from zram (decompression).
    SwapinZram,
    /// Time inside faults spent blocked (file refault I/O, disk swap), and all
    /// of a major file fault.
    FaultIo,
    /// Blocked in explicit I/O syscalls (read, pread, io_uring waits, …).
    IoWait,
    /// Direct or memcg reclaim, on or off CPU.
    Reclaim,
    /// On-CPU time in syscalls.
    Syscall,
    /// Runnable but not running (preempted, or woken and waiting for a CPU).
    Runqueue,
    /// Blocked for anything else (futex, condvar, nanosleep, poll, …).
    Sleep,
}

impl Component {
    pub const ALL: [Component; 9] = [
        Component::Compute,
        Component::FaultMinor,
        Component::SwapinZram,
        Component::FaultIo,
        Component::IoWait,
        Component::Reclaim,
        Component::Syscall,
        Component::Runqueue,
        Component::Sleep,
    ];
    pub const fn name(self) -> &'static str {
        match self {
            Component::Compute => "compute",
            Component::FaultMinor => "fault_minor",
            Component::SwapinZram => "swapin_zram",
            Component::FaultIo => "fault_io",
            Component::IoWait => "io_wait",
            Component::Reclaim => "reclaim",
            Component::Syscall => "syscall",
            Component::Runqueue => "runqueue",
            Component::Sleep => "sleep",
        }
    }
    pub const fn json_key(self) -> &'static str {
        match self {
            Component::Compute => "compute_ns",
            Component::FaultMinor => "fault_minor_ns",
            Component::SwapinZram => "swapin_zram_ns",
            Component::FaultIo => "fault_io_ns",
            Component::IoWait => "io_wait_ns",
            Component::Reclaim => "reclaim_ns",
            Component::Syscall => "syscall_ns",
            Component::Runqueue => "runqueue_ns",
            Component::Sleep => "sleep_ns",
        }
    }
    /// On-CPU components (the rest are off-CPU).
    pub const fn on_cpu(self) -> bool {
        matches!(
            self,
            Component::Compute
                | Component::FaultMinor
                | Component::SwapinZram
                | Component::Reclaim
                | Component::Syscall
        )
    }
}

/// Counters of the measurement model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Counter {
    MajfltFile,
    MajfltSwap,
    Minflt,
    Swapins,
    ReadBytes,
    PagecacheAdded,
    PagecacheEvicted,
    CtxSwitches,
}

impl Counter {
    pub const ALL: [Counter; 8] = [
        Counter::MajfltFile,
        Counter::MajfltSwap,
        Counter::Minflt,
        Counter::Swapins,
        Counter::ReadBytes,
        Counter::PagecacheAdded,
        Counter::PagecacheEvicted,
        Counter::CtxSwitches,
    ];
    pub const fn name(self) -> &'static str {
        match self {
            Counter::MajfltFile => "majflt_file",
            Counter::MajfltSwap => "majflt_swap",
            Counter::Minflt => "minflt",
            Counter::Swapins => "swapins",
            Counter::ReadBytes => "read_bytes",
            Counter::PagecacheAdded => "pagecache_added",
            Counter::PagecacheEvicted => "pagecache_evicted",
            Counter::CtxSwitches => "ctx_switches",
        }
    }
}

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
pub struct Components(pub [Option<u64>; 9]);
named_array!(Components, Component, 9, json_key);

impl Components {
    /// Sum of the measured components.
    pub fn sum(&self) -> u64 {
        self.0.iter().flatten().sum()
    }
    pub fn all_measured(v: [u64; 9]) -> Self {
        Components(v.map(Some))
    }
}

/// Counter values; serialised as `{"majflt_file": …, …}`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters(pub [Option<u64>; 8]);
named_array!(Counters, Counter, 8, name);

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
    /// Layer × expert resident fractions, row-major (`layer * n_experts + expert`).
    pub grid: Option<ExpertGrid>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ExpertGrid {
    pub n_layers: u32,
    pub n_experts: u32,
    /// Resident fraction per (layer, expert), 0..=1.
    pub resident: Vec<f32>,
    /// Page-cache pages of each expert added during this token (churn), if measured.
    pub added: Option<Vec<u32>>,
    /// … and evicted.
    pub evicted: Option<Vec<u32>>,
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
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelInfo {
    pub path: String,
    pub size_bytes: u64,
    /// Hex digest of the file's header and tensor table (not the whole file).
    pub hash: String,
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
}

/// Cumulative latency histograms kept in the kernel, by kind
/// (`fault_minor`, `fault_major_file`, `fault_major_swap`, `zram_read`,
/// `disk_read`). Per-bucket counts (not cumulative): bucket `i` counts values
/// in `(2^(i-1), 2^i]` ns (`observer_common::hist`); the last is +Inf.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LatencyHistograms {
    pub mono_ns: u64,
    pub kinds: BTreeMap<String, Vec<u64>>,
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
            components: Components::all_measured([60, 10, 5, 5, 0, 0, 10, 5, 5]),
            residual_ns: 0,
            counters: Counters::default(),
            engine_compute_ns: Some(80),
            threads: Vec::new(),
            engine: None,
            residency: None,
            lost_events: 0,
        };
        t.counters.set(Counter::Minflt, Some(12));
        let j = serde_json::to_string(&Event::Token(t.clone())).unwrap();
        assert!(j.contains("\"type\":\"token\""), "{j}");
        assert!(j.contains("\"minflt\":12") && j.contains("\"majflt_swap\":null"), "{j}");
        let back: Event = serde_json::from_str(&j).unwrap();
        assert_eq!(back, Event::Token(t.clone()));
        assert_eq!(t.hidden_ns(), Some(20));
    }
}
