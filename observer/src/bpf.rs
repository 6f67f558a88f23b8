//! Loading the embedded eBPF object and attaching its programs.
//!
//! The object is built from `observer-ebpf` by `build.rs` in the same build.
//! Everything attached here is owned by [`Probes`]: dropping it detaches every
//! link and unloads every program and map (nothing is pinned).

use std::io;

use aya::{
    Ebpf, EbpfError,
    maps::{Array, HashMap, MapError, PerCpuArray},
    programs::{
        PerfEvent, ProgramError,
        perf_event::{PerfEventConfig, PerfEventScope, SamplePolicy, SoftwareEvent},
    },
    util::online_cpus,
};
use observer_common::{Config, GlobalCounter, ThreadFaults, faults::GLOBAL_COUNTERS};

static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/observer-ebpf.o"));

/// Why the probes could not be set up; each variant's message names the fix.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error(
        "the kernel refused to load eBPF programs ({0}): run as root, or grant CAP_BPF and CAP_PERFMON (e.g. `sudo setcap cap_bpf,cap_perfmon+ep $(which observer)`)"
    )]
    Permission(String),
    #[error(
        "this kernel has no perf software event `{event}` ({source}); it needs CONFIG_PERF_EVENTS (Linux >= 4.9)"
    )]
    MissingPerfEvent { event: &'static str, source: io::Error },
    #[error("cannot list online CPUs ({path}): {source}")]
    Cpus { path: &'static str, source: io::Error },
    #[error("loading eBPF program `{program}` failed: {source}")]
    Program { program: &'static str, source: ProgramError },
    #[error("eBPF map `{map}`: {source}")]
    Map { map: &'static str, source: MapError },
    #[error("loading the eBPF object failed: {0}")]
    Load(#[from] EbpfError),
}

fn is_permission(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EPERM) | Some(libc::EACCES))
}

fn classify_load(e: EbpfError) -> ProbeError {
    let perm = match &e {
        EbpfError::MapError(MapError::CreateError { io_error, .. }) => is_permission(io_error),
        EbpfError::BtfError(_) => false,
        _ => false,
    };
    if perm { ProbeError::Permission(e.to_string()) } else { ProbeError::Load(e) }
}

fn program_error(program: &'static str, source: ProgramError) -> ProbeError {
    let perm = match &source {
        ProgramError::SyscallError(s) => is_permission(&s.io_error),
        ProgramError::LoadError { io_error, .. } => is_permission(io_error),
        _ => false,
    };
    if perm {
        ProbeError::Permission(format!("{program}: {source}"))
    } else {
        ProbeError::Program { program, source }
    }
}

/// A perf-software-event program: its name in the object and the event it rides.
struct PerfProbe {
    program: &'static str,
    event: SoftwareEvent,
    event_name: &'static str,
}

const FAULT_PROBES: [PerfProbe; 3] = [
    PerfProbe { program: "fault_entry", event: SoftwareEvent::PageFaults, event_name: "page-faults" },
    PerfProbe { program: "fault_exit_maj", event: SoftwareEvent::PageFaultsMaj, event_name: "major-faults" },
    PerfProbe { program: "fault_exit_min", event: SoftwareEvent::PageFaultsMin, event_name: "minor-faults" },
];

/// The loaded and attached programs with their maps.
pub struct Probes {
    ebpf: Ebpf,
    /// Human-readable list of what is attached, for headers and JSON.
    pub attached: Vec<String>,
}

impl std::fmt::Debug for Probes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Probes").field("attached", &self.attached).finish_non_exhaustive()
    }
}

impl Probes {
    /// Load the object, point its filter at `target_tgid` and attach the fault probes
    /// on every online CPU.
    pub fn attach(target_tgid: u32) -> Result<Self, ProbeError> {
        let mut ebpf = Ebpf::load(OBJECT).map_err(classify_load)?;
        {
            let map = ebpf.map_mut("CONFIG").ok_or(ProbeError::Map {
                map: "CONFIG",
                source: MapError::InvalidName { name: "CONFIG".into() },
            })?;
            let mut cfg: Array<_, Config> =
                Array::try_from(map).map_err(|source| ProbeError::Map { map: "CONFIG", source })?;
            cfg.set(0, Config { target_tgid, _pad: 0 }, 0)
                .map_err(|source| ProbeError::Map { map: "CONFIG", source })?;
        }
        let cpus = online_cpus().map_err(|(path, source)| ProbeError::Cpus { path, source })?;
        let mut attached = Vec::new();
        for probe in &FAULT_PROBES {
            let prog: &mut PerfEvent = ebpf
                .program_mut(probe.program)
                .ok_or_else(|| {
                    program_error(probe.program, ProgramError::UnexpectedProgramType)
                })?
                .try_into()
                .map_err(|e| program_error(probe.program, e))?;
            prog.load().map_err(|e| program_error(probe.program, e))?;
            for &cpu in &cpus {
                prog.attach(
                    PerfEventConfig::Software(probe.event),
                    PerfEventScope::AllProcessesOneCpu { cpu },
                    SamplePolicy::Period(1),
                    false,
                )
                .map_err(|e| match e {
                    ProgramError::SyscallError(s) if is_permission(&s.io_error) => {
                        ProbeError::Permission(format!("perf_event_open({}): {}", probe.event_name, s.io_error))
                    }
                    ProgramError::SyscallError(s) => {
                        ProbeError::MissingPerfEvent { event: probe.event_name, source: s.io_error }
                    }
                    other => program_error(probe.program, other),
                })?;
            }
            attached.push(format!("perf:{} ({})", probe.event_name, probe.program));
        }
        Ok(Self { ebpf, attached })
    }

    /// Per-thread fault accumulators, sorted by TID.
    pub fn thread_faults(&self) -> Result<Vec<(u32, ThreadFaults)>, ProbeError> {
        let map = self.ebpf.map("THREAD_FAULTS").ok_or(ProbeError::Map {
            map: "THREAD_FAULTS",
            source: MapError::InvalidName { name: "THREAD_FAULTS".into() },
        })?;
        let h: HashMap<_, u32, ThreadFaults> =
            HashMap::try_from(map).map_err(|source| ProbeError::Map { map: "THREAD_FAULTS", source })?;
        let mut rows = Vec::new();
        for item in h.iter() {
            let (tid, v) = item.map_err(|source| ProbeError::Map { map: "THREAD_FAULTS", source })?;
            rows.push((tid, v));
        }
        rows.sort_by_key(|(tid, _)| *tid);
        Ok(rows)
    }

    /// A global counter summed over CPUs.
    pub fn counter(&self, c: GlobalCounter) -> Result<u64, ProbeError> {
        let map = self.ebpf.map("COUNTERS").ok_or(ProbeError::Map {
            map: "COUNTERS",
            source: MapError::InvalidName { name: "COUNTERS".into() },
        })?;
        let a: PerCpuArray<_, u64> =
            PerCpuArray::try_from(map).map_err(|source| ProbeError::Map { map: "COUNTERS", source })?;
        debug_assert!((c as u32) < GLOBAL_COUNTERS);
        let v = a.get(&(c as u32), 0).map_err(|source| ProbeError::Map { map: "COUNTERS", source })?;
        Ok(v.iter().sum())
    }
}
