//! Loading the embedded eBPF object, configuring it for one target and
//! attaching its programs.
//!
//! The object is built from `observer-ebpf` by `build.rs` in the same build.
//! Everything attached here is owned by [`Probes`]: dropping it detaches every
//! link and unloads every program and map (nothing is pinned).

use std::{io, num::NonZeroU32, path::PathBuf};

use aya::{
    Btf, Ebpf, EbpfError, EbpfLoader, Pod,
    maps::{Array, HashMap, Map, MapData, MapError, PerCpuArray, RingBuf},
    programs::{
        BtfTracePoint, KProbe, PerfEvent, Program, ProgramError, RawTracePoint, TracePoint, UProbe,
        perf_event::{PerfEventConfig, PerfEventScope, SamplePolicy, SoftwareEvent},
        uprobe::{UProbeLinkId, UProbeScope},
    },
    util::online_cpus,
};
use observer_common::{
    Config, FaultTimes, GlobalCounter, OverflowFaults,
    attrib::{
        DEV_SWAP, DevIo, HOST_STORES_IN_ORDER, Hist, MAX_SLOTS, N_HIST, SEQ_CLOSED, SEQ_LAST_MISS, STORES_IN_ORDER,
        TASK_PID, TASK_START_TIME, ThreadState, TpOffsets,
    },
    faults::{GLOBAL_COUNTERS, OTHER_CLOSES, OTHER_MAJFLT, OTHER_MINFLT},
    filemap::NO_FIELD,
    model::ProgramCost,
};

use crate::capture::{
    btf, engine_abi, preflight,
    profile::{self, Found, Profile},
    seed, syscalls,
    tracefs::Format,
};

static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/observer-ebpf.o"));

/// Why the probes could not be set up; each variant's message names the fix.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("the kernel refused to load eBPF programs ({0}): {hint}", hint = preflight::permission_hint())]
    Permission(String),
    #[error("this kernel has no perf software event `{event}` ({source}); it needs CONFIG_PERF_EVENTS (Linux >= 4.9)")]
    MissingPerfEvent { event: &'static str, source: io::Error },
    #[error("{0}")]
    MissingTracepoint(String),
    #[error("{0}")]
    Markers(String),
    #[error("cannot list online CPUs ({path}): {source}")]
    Cpus { path: &'static str, source: io::Error },
    #[error("eBPF program `{program}`: {source}")]
    Program { program: &'static str, source: Box<ProgramError> },
    #[error("run-time statistics of eBPF program `{program}`: {source}")]
    ProgramInfo { program: String, source: Box<ProgramError> },
    #[error("uprobe on `{symbol}` in {path}: {source}: {hint}")]
    Uprobe { symbol: String, path: String, source: Box<ProgramError>, hint: String },
    #[error("eBPF map `{map}`: {source}")]
    Map { map: &'static str, source: Box<MapError> },
    #[error("loading the eBPF object failed: {0}")]
    Load(Box<EbpfError>),
}

impl ProbeError {
    /// The token boundaries asked for could not be probed (the kernel refused a
    /// uprobe, or a marker cannot carry one): the target can still be observed
    /// without tokens (`AttachOptions::markers_optional`).
    pub fn is_markers_refused(&self) -> bool {
        matches!(self, ProbeError::Uprobe { .. } | ProbeError::Markers(_))
    }
}

fn is_permission(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EPERM) | Some(libc::EACCES))
}

fn classify_load(e: EbpfError) -> ProbeError {
    let perm = match &e {
        EbpfError::MapError(MapError::CreateError { io_error, .. }) => is_permission(io_error),
        _ => false,
    };
    if perm { ProbeError::Permission(e.to_string()) } else { ProbeError::Load(Box::new(e)) }
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
        ProbeError::Program { program, source: Box::new(source) }
    }
}

fn map_err(map: &'static str) -> impl Fn(MapError) -> ProbeError {
    move |source| ProbeError::Map { map, source: Box::new(source) }
}

fn no_map(map: &'static str) -> ProbeError {
    ProbeError::Map { map, source: Box::new(MapError::InvalidName { name: map.into() }) }
}

/// Which engines' token boundaries to look for when no `--token-symbol` is given.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EngineChoice {
    /// Our engine's markers when the program has them, else the first engine
    /// profile it matches (`profile::PROFILES`).
    #[default]
    Auto,
    /// Only this profile.
    Profile(&'static Profile),
    /// Neither markers nor profiles.
    Off,
}

impl EngineChoice {
    /// `auto`, `none`, or a profile's name (`--engine`).
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(EngineChoice::Auto),
            "none" => Ok(EngineChoice::Off),
            _ => profile::by_name(s).map(EngineChoice::Profile).ok_or_else(|| {
                let names: Vec<&str> = profile::PROFILES.iter().map(|p| p.name).collect();
                format!("unknown engine `{s}`: use auto, none, or one of the profiles: {}", names.join(", "))
            }),
        }
    }

    fn profiles(self) -> Vec<&'static Profile> {
        match self {
            EngineChoice::Auto => profile::PROFILES.iter().collect(),
            EngineChoice::Profile(p) => vec![p],
            EngineChoice::Off => Vec::new(),
        }
    }
}

/// At most this many descendants are followed at once (`TARGETS` in the
/// kernel side, `observer-ebpf/src/maps.rs`).
pub const MAX_FOLLOWED: u32 = 256;

/// How token boundaries are found.
#[derive(Debug, Clone)]
pub enum Markers {
    /// The engine's marker symbols in the target executable, when present,
    /// else an engine profile's entry points (`engine`); `running`: the
    /// target runs `exe` now, so its mapped files are looked at too;
    /// `any_process`: the uprobes are attached for every process, the kernel
    /// side keeping the followed ones' calls (a program named on a spawned
    /// command line, marked before a descendant runs it).
    Auto { exe: PathBuf, engine: EngineChoice, running: bool, any_process: bool },
    /// uprobe/uretprobe on a function (`--token-symbol SYM[:LIB]`).
    Symbol { symbol: String, path: PathBuf },
    /// No markers.
    None,
}

#[derive(Debug, Clone)]
pub struct AttachOptions {
    pub target: u32,
    pub markers: Markers,
    /// Observe the processes the target forks, and theirs (`Config::follow_children`).
    pub follow_children: bool,
    /// The target is our child, held before `exec`: its thread is not seeded,
    /// so that the hold is charged to nothing (`seed` module doc).
    pub held: bool,
    /// A refused token uprobe (`ProbeError::is_markers_refused`) leaves the
    /// probes without markers (`Probes::markers_refused` says why) instead of
    /// failing the attach (`observer serve`, which serves what works).
    pub markers_optional: bool,
    /// Turn the kernel's BPF run-time statistics on while attached ([`Probes::bpf_stats`]).
    pub bpf_stats: bool,
    /// Which event closes a fault (`observer_common::faults`).
    pub fault_close: FaultClose,
    /// How the fault programs time faults (`observer_common::faults`).
    pub fault_timing: FaultTiming,
    /// Which programs follow the scheduler (`observer-ebpf/src/sched.rs`).
    pub sched_hooks: SchedHooks,
}

/// Which programs follow the scheduler's switches, wakeups and runtime updates
/// (`observer-ebpf/src/sched.rs`'s module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum SchedHooks {
    /// The BTF (raw) tracepoints where the kernel allows them ([`raw_sched_available`]), else the
    /// tracepoints.
    #[default]
    Auto,
    /// The BTF (raw) tracepoints ([`RAW_SCHED`]); an error where the kernel does not allow them.
    Raw,
    /// The tracepoints `sched:sched_switch` (with `switch_forget`), `sched:sched_waking` and
    /// `sched:sched_stat_runtime`.
    Tracepoint,
}

/// The scheduler's BTF tracepoints, where the kernel allows them ([`raw_sched_available`]):
/// (program, tracepoint, the tracepoint program it replaces, required). `switch_raw` first.
const RAW_SCHED: [(&str, &str, &str, bool); 3] = [
    ("switch_raw", "sched_switch", "sched_switch", true),
    ("waking_raw", "sched_waking", "sched_wakeup", true),
    ("runtime_raw", "sched_stat_runtime", "sched_runtime", false),
];

/// The offset of `task_struct.pid` when the raw scheduler programs ([`RAW_SCHED`]) can run on
/// this kernel (its raw `sched_switch` passes `prev_state`, Linux >= 5.18, and its BTF names the
/// member), else why not (`observer doctor`).
pub fn raw_sched_available() -> Result<u32, String> {
    let args = btf::kernel_raw_tracepoint_args("sched_switch")?;
    if args < 4 {
        return Err(format!(
            "this kernel's raw sched_switch passes {args} arguments, not the previous task's state (Linux >= 5.18)"
        ));
    }
    btf::kernel_member_offset("task_struct", "pid")
}

/// How the fault programs time faults (`observer_common::faults`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FaultTiming {
    /// Storm sampling: in a fault storm 1 user-mode minor fault in 8 is timed (the default).
    #[default]
    Sampled,
    /// Every fault timed (`--time-every-fault`).
    EveryFault,
    /// The fault hooks (the raw entries and the memcg close) run `fault_floor`, which returns at
    /// once: no fault is counted or timed, and a run costs what the kernel's dispatch of those
    /// hooks costs (`--fault-dispatch-only`, the floor of `cargo xtask bench storm`).
    DispatchOnly,
}

/// Which event closes a fault (`observer_common::faults`: the memcg close and the perf close).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum FaultClose {
    /// The memcg close where the kernel has it (Linux >= 6.14, memory controller on), else perf.
    #[default]
    Auto,
    /// The tracepoint `memcg:count_memcg_events`; an error where the kernel lacks it.
    Memcg,
    /// The perf software events `minor-faults` / `major-faults`.
    Perf,
}

/// Whether `--fault-close auto` closes faults with `memcg:count_memcg_events` on this host, else
/// why not (`observer doctor`).
pub fn memcg_close_available() -> Result<(), String> {
    memcg_close_items().map(|_| ())
}

/// The `vm_event_item` values of `PGFAULT` and `PGMAJFAULT` when this kernel can close faults
/// with `memcg:count_memcg_events`, else why not.
fn memcg_close_items() -> Result<(u32, u32), String> {
    if !preflight::tracepoint_exists("memcg", "count_memcg_events") {
        return Err("this kernel has no tracepoint memcg:count_memcg_events (Linux >= 6.14)".into());
    }
    if !memory_controller_enabled()? {
        return Err("the memory controller is off (/proc/cgroups; cgroup_disable=memory?): \
                    memcg:count_memcg_events never fires"
            .into());
    }
    let item = |name| -> Result<u32, String> {
        let v = btf::kernel_enum_value("vm_event_item", name)?;
        u32::try_from(v).map_err(|_| format!("vm_event_item {name} = {v} in this kernel's BTF"))
    };
    Ok((item("PGFAULT")?, item("PGMAJFAULT")?))
}

/// Whether `/proc/cgroups` lists the memory controller as enabled; an error naming the file when
/// it cannot be read (not taken for "off").
fn memory_controller_enabled() -> Result<bool, String> {
    let t = std::fs::read_to_string("/proc/cgroups").map_err(|e| format!("/proc/cgroups: {e}"))?;
    Ok(t.lines().any(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        f.first() == Some(&"memory") && f.last() == Some(&"1")
    }))
}

/// The program a fault hook runs under `timing`: `program`, or under
/// [`FaultTiming::DispatchOnly`] `fault_floor` (named so in the probes list).
fn fault_hook(timing: FaultTiming, program: &'static str, probe: String) -> (&'static str, String) {
    match timing {
        FaultTiming::DispatchOnly => ("fault_floor", format!("{probe} (dispatch only)")),
        _ => (program, probe),
    }
}

/// Attaches the memcg close (`fault_memcg` on `memcg:count_memcg_events`, or the floor under
/// `timing`) as `close` asks; returns the `vm_event_item` values it compares, `None` when faults
/// are closed by perf.
fn attach_memcg_close(
    ebpf: &mut Ebpf,
    close: FaultClose,
    timing: FaultTiming,
    attached: &mut Vec<String>,
) -> Result<Option<(u32, u32)>, ProbeError> {
    let items = match (close, memcg_close_items()) {
        (FaultClose::Perf, _) => return Ok(None),
        (FaultClose::Auto, Err(why)) => {
            log::debug!("faults closed by perf events: {why}");
            return Ok(None);
        }
        (FaultClose::Memcg, Err(why)) => {
            return Err(ProbeError::MissingTracepoint(format!("--fault-close memcg: {why}")));
        }
        (_, Ok(items)) => items,
    };
    let (program, probe) = fault_hook(timing, "fault_memcg", "raw_tp:memcg:count_memcg_events".into());
    attach_raw_tracepoint(ebpf, program, "count_memcg_events")?;
    attached.push(probe);
    Ok(Some(items))
}

/// Load `program` (once: the floor is attached to several) and attach it to the raw tracepoint
/// `tp`.
/// Program `name` of `ebpf` as its kind `T` (`&mut RawTracePoint`, …).
fn program_of<'a, T>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<T, ProbeError>
where
    T: TryFrom<&'a mut Program, Error = ProgramError>,
{
    ebpf.program_mut(name)
        .ok_or_else(|| program_error(name, ProgramError::UnexpectedProgramType))?
        .try_into()
        .map_err(|e| program_error(name, e))
}

fn attach_raw_tracepoint(ebpf: &mut Ebpf, program: &'static str, tp: &str) -> Result<(), ProbeError> {
    let prog: &mut RawTracePoint = program_of(ebpf, program)?;
    if prog.fd().is_err() {
        prog.load().map_err(|e| program_error(program, e))?;
    }
    prog.attach(tp).map_err(|e| program_error(program, e))?;
    Ok(())
}

/// The scheduler's BTF programs ([`RAW_SCHED`]) loaded: (program, tracepoint) of each, and why
/// each optional one that was not (a required one's refusal is the error).
type BtfSched = (Vec<(&'static str, &'static str)>, Vec<String>);

/// Load the scheduler's BTF programs ([`BtfSched`]).
fn load_btf_sched(ebpf: &mut Ebpf) -> Result<BtfSched, ProbeError> {
    let btf = Btf::from_sys_fs().map_err(|e| ProbeError::MissingTracepoint(format!("{}: {e}", btf::VMLINUX)))?;
    let (mut loaded, mut missing) = (Vec::new(), Vec::new());
    for (program, tp, _, required) in RAW_SCHED {
        let prog: &mut BtfTracePoint = program_of(ebpf, program)?;
        match prog.load(tp, &btf) {
            Ok(()) => loaded.push((program, tp)),
            Err(e) if required => return Err(program_error(program, e)),
            Err(e) => missing.push(format!("tp_btf:sched:{tp} ({})", program_error(program, e))),
        }
    }
    Ok((loaded, missing))
}

/// Attach BTF tracepoint `program`, loaded ([`load_btf_sched`]).
fn attach_btf_tracepoint(ebpf: &mut Ebpf, program: &'static str) -> Result<(), ProbeError> {
    let prog: &mut BtfTracePoint = program_of(ebpf, program)?;
    prog.attach().map_err(|e| program_error(program, e))?;
    Ok(())
}

/// What marked the tokens, once attached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MarkerKind {
    Engine {
        exe: String,
    },
    /// An engine profile's entry points.
    Profile(Found),
    Symbol {
        symbol: String,
        path: String,
    },
}

/// The kernel's BPF run-time statistics (`run_time_ns`, `run_cnt`: Linux >= 5.8), the
/// observer's own kernel-side cost. On, every program run reads the clock twice more (about
/// 80 ns per run on the development VM, a fifth of the observer's overhead in a fault storm),
/// so they are on only when asked for (`--bpf-stats`) or already on for the host
/// (`kernel.bpf_stats_enabled=1`); absent, the cost is reported as not measured.
enum Stats {
    /// Turned on by this process (`BPF_ENABLE_STATS`): on while the descriptor is held, the
    /// host's setting restored when it is closed.
    Ours(#[allow(dead_code, reason = "held for its lifetime")] std::os::fd::OwnedFd),
    /// On for the host (`kernel.bpf_stats_enabled`).
    Host,
}

impl Stats {
    fn get(ask: bool) -> Option<Stats> {
        let host = std::fs::read_to_string("/proc/sys/kernel/bpf_stats_enabled").is_ok_and(|s| s.trim() == "1");
        match (host, ask) {
            // Held even when on already: another holder may close its descriptor first.
            (_, true) => match aya::sys::enable_stats(aya::sys::Stats::RunTime) {
                Ok(fd) => Some(Stats::Ours(fd)),
                Err(e) => {
                    log::warn!(
                        "--bpf-stats: the kernel refused BPF_ENABLE_STATS ({e}; Linux >= 5.8, CAP_SYS_ADMIN): the programs' cost is not measured"
                    );
                    host.then_some(Stats::Host)
                }
            },
            (true, false) => Some(Stats::Host),
            (false, false) => None,
        }
    }
}

/// The loaded and attached programs with their maps.
pub struct Probes {
    ebpf: Ebpf,
    /// The kernel's BPF run-time statistics, when they are on ([`Stats`]).
    stats: Option<Stats>,
    /// What is attached, for headers and JSON.
    pub attached: Vec<String>,
    /// Optional probes that could not be attached, with the reason.
    pub missing: Vec<String>,
    pub markers: Option<MarkerKind>,
    /// Why the token markers asked for are not attached: the kernel refused
    /// them (`AttachOptions::markers_optional`); nothing of them is left attached.
    pub markers_refused: Option<String>,
    config: Config,
}

impl Drop for Probes {
    fn drop(&mut self) {
        detach_tracepoints(&mut self.ebpf);
    }
}

/// zram's `rw_page` (Linux < 6.3), through which swap-ins from zram bypass the block layer.
pub const ZRAM_RW_PAGE: &str = "zram_rw_page";

/// The named warning for a kernel whose zram swap-ins bypass the block layer and could not
/// be probed: swap-ins and zram time then miss every zram read (never a silent 0).
pub const ZRAM_NOT_MEASURED: &str = "zram-swapins-not-measured";

/// Where zram has `rw_page` (Linux < 6.3, zram loaded): the offset of `block_device.bd_dev` in
/// this kernel's BTF, which the kprobe reads from its first argument so that the read gets its
/// device's row in the per-device table. `None` where there is no `rw_page`.
fn zram_rw_page_bd_dev() -> Option<Result<u32, String>> {
    preflight::kernel_function_exists(ZRAM_RW_PAGE).then(|| btf::kernel_member_offset("block_device", "bd_dev"))
}

/// Attach the kprobe pair on `zram_rw_page` where zram has it (`bd_dev` is
/// [`zram_rw_page_bd_dev`]; see `observer-ebpf`'s `block.rs`): without it the block tracepoints
/// never see a zram swap-in on such kernels. Where zram has no `rw_page` (Linux 6.3+, or zram
/// not loaded) there is nothing to attach.
fn attach_zram_rw_page(
    ebpf: &mut Ebpf,
    bd_dev: Option<&Result<u32, String>>,
    attached: &mut Vec<String>,
    missing: &mut Vec<String>,
) {
    let Some(bd_dev) = bd_dev else { return };
    let mut attach = |program: &'static str| -> Result<(), ProbeError> {
        let prog: &mut KProbe = program_of(ebpf, program)?;
        prog.load().map_err(|e| program_error(program, e))?;
        prog.attach(ZRAM_RW_PAGE, 0).map_err(|e| program_error(program, e))?;
        Ok(())
    };
    match attach("zram_rw_page").and_then(|()| attach("zram_rw_page_ret")) {
        Ok(()) => {
            attached.push(format!("kprobe:{ZRAM_RW_PAGE}"));
            if let Err(e) = bd_dev {
                missing.push(format!(
                    "the zram rows of the per-device read table ({ZRAM_RW_PAGE} reads its device from \
                     block_device.bd_dev: {e})"
                ));
            }
        }
        Err(e) => {
            log::warn!(
                "{ZRAM_NOT_MEASURED}: zram on this kernel reads swapped pages through {ZRAM_RW_PAGE}, bypassing the \
                 block layer, and the kprobe on it failed ({e}): swap-ins from zram and their time are not measured \
                 (needs CONFIG_KPROBES)"
            );
            missing.push(format!("kprobe:{ZRAM_RW_PAGE} ({ZRAM_NOT_MEASURED}: {e})"));
        }
    }
}

/// Detach every tracepoint program of `ebpf`, all at once.
///
/// Unregistering a perf tracepoint waits for RCU grace periods in the kernel
/// (`tracepoint_synchronize_unregister`: about 75 ms each on 6.18), so the
/// sequential detach of `Ebpf`'s own drop keeps the observer alive a second
/// after its target. Programs detach on their own threads here, and the
/// waits overlap. What is left (perf events, uprobes, maps) goes with the
/// `Ebpf` as before.
pub fn detach_tracepoints(ebpf: &mut Ebpf) {
    std::thread::scope(|s| {
        for (_, prog) in ebpf.programs_mut() {
            if let Program::TracePoint(tp) = prog {
                // A failed detach leaves the link to `Ebpf`'s drop, which retries.
                s.spawn(move || tp.unload());
            }
        }
    });
}

/// The cumulative explicit-read totals (`observer_common::xread::T_*`) of a loaded object now.
pub fn xread_totals(ebpf: &Ebpf) -> Result<[u64; observer_common::xread::N_TOTALS], ProbeError> {
    let map = ebpf.map("XREAD_TOTALS").ok_or_else(|| no_map("XREAD_TOTALS"))?;
    let a: Array<_, u64> = Array::try_from(map).map_err(map_err("XREAD_TOTALS"))?;
    let mut t = [0u64; observer_common::xread::N_TOTALS];
    for (i, v) in t.iter_mut().enumerate() {
        *v = a.get(&(i as u32), 0).map_err(map_err("XREAD_TOTALS"))?;
    }
    Ok(t)
}

/// The raw tracepoints of system calls (`observer-ebpf/src/syscalls.rs`): (program, tracepoint).
const RAW_SYSCALLS: [(&str, &str); 2] = [("sys_enter", "sys_enter"), ("sys_exit", "sys_exit")];

/// Attach [`RAW_SYSCALLS`].
fn attach_raw_syscalls(ebpf: &mut Ebpf, attached: &mut Vec<String>) -> Result<(), ProbeError> {
    for (program, tp) in RAW_SYSCALLS {
        attach_raw_tracepoint(ebpf, program, tp)?;
        attached.push(format!("raw_tp:raw_syscalls:{tp}"));
    }
    Ok(())
}

/// Point a standalone object (`residency::churn::load_standalone`) at process `pid` (its threads
/// only, no descendants) and attach only the system-call programs, `switch_forget` and
/// `sched_process_exec`: what its explicit reads need (`residency::xread::Live`), without the
/// attribution of [`Probes`].
pub fn attach_syscalls(ebpf: &mut Ebpf, pid: u32) -> Result<(), ProbeError> {
    preflight::ensure_tracefs().map_err(|e| ProbeError::MissingTracepoint(format!("{e:#}")))?;
    let config = Config { target_tgid: pid, ..Config::default() };
    set(ebpf, "CONFIG", 0, config)?;
    set(ebpf, "OFFSETS", 0, tp_offsets()?.0)?;
    // Before the system-call programs, which remember the current thread of the target until
    // the CPU's next switch (`observer-ebpf/src/maps.rs`, `SLOT_CACHE`'s `CURRENT`).
    attach_raw_tracepoint(ebpf, "switch_forget", "sched_switch")?;
    attach_raw_syscalls(ebpf, &mut Vec::new())?;
    for &(program, category, name, _) in TRACEPOINTS.iter().filter(|t| t.0 == "sched_exec") {
        if !preflight::tracepoint_exists(category, name) {
            return Err(ProbeError::MissingTracepoint(format!(
                "this kernel has no tracepoint {category}:{name} (needs CONFIG_TRACEPOINTS and the {category} events)"
            )));
        }
        let prog: &mut TracePoint = program_of(ebpf, program)?;
        prog.load().map_err(|e| program_error(program, e))?;
        prog.attach(category, name).map_err(|e| program_error(program, e))?;
    }
    Ok(())
}

impl std::fmt::Debug for Probes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Probes").field("attached", &self.attached).finish_non_exhaustive()
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

/// The raw tracepoints that open a fault where the kernel has them (x86), before the perf event
/// `page-faults` (`observer-ebpf/src/faults.rs`: the same entry at a fraction of the cost):
/// (program, tracepoint in `exceptions`).
const RAW_FAULT_ENTRIES: [(&str, &str); 2] =
    [("fault_entry_user", "page_fault_user"), ("fault_entry_kernel", "page_fault_kernel")];

/// Attaches [`RAW_FAULT_ENTRIES`] (or the floor under `timing`) when this kernel has both
/// tracepoints; `false` when it has not (the perf event `page-faults` opens faults then).
fn attach_raw_fault_entry(
    ebpf: &mut Ebpf,
    timing: FaultTiming,
    attached: &mut Vec<String>,
) -> Result<bool, ProbeError> {
    if !RAW_FAULT_ENTRIES.iter().all(|(_, tp)| preflight::tracepoint_exists("exceptions", tp)) {
        return Ok(false);
    }
    for (program, tp) in RAW_FAULT_ENTRIES {
        let (program, probe) = fault_hook(timing, program, format!("raw_tp:exceptions:{tp}"));
        attach_raw_tracepoint(ebpf, program, tp)?;
        attached.push(probe);
    }
    Ok(true)
}

/// Tracepoints: (program, category, name, required).
const TRACEPOINTS: &[(&str, &str, &str, bool)] = &[
    ("sched_switch", "sched", "sched_switch", true),
    ("sched_wakeup", "sched", "sched_waking", true),
    ("sched_exit", "sched", "sched_process_exit", true),
    ("reclaim_begin", "vmscan", "mm_vmscan_direct_reclaim_begin", false),
    ("reclaim_end", "vmscan", "mm_vmscan_direct_reclaim_end", false),
    ("reclaim_begin", "vmscan", "mm_vmscan_memcg_reclaim_begin", false),
    ("reclaim_end", "vmscan", "mm_vmscan_memcg_reclaim_end", false),
    ("bio_queue", "block", "block_bio_queue", false),
    ("bio_complete", "block", "block_bio_complete", false),
    ("rq_complete", "block", "block_rq_complete", false),
    ("filemap_fault", "filemap", "mm_filemap_fault", false),
    ("sched_exec", "sched", "sched_process_exec", false),
    ("new_task", "task", "task_newtask", false),
    ("process_free", "sched", "sched_process_free", false),
    // Gives slots back (`observer_common::attrib::MAX_SLOTS`, "Slots").
    ("thread_free", "sched", "sched_process_free", false),
    ("sched_runtime", "sched", "sched_stat_runtime", false),
    ("task_rename", "task", "task_rename", false),
];

/// An optional tracepoint left unattached: its name, and why (the field its format lacks).
type Unusable = (&'static str, String);

/// Field offsets the programs need, from tracefs, and the optional tracepoints whose format
/// lacks a field their program reads (by name, with why): those are left unattached, since
/// their program would read offset 0 instead.
fn tp_offsets() -> Result<(TpOffsets, Vec<Unusable>), ProbeError> {
    let miss = |e: anyhow::Error| ProbeError::MissingTracepoint(format!("{e:#}"));
    let sw = Format::load("sched", "sched_switch").map_err(miss)?;
    let wk = Format::load("sched", "sched_waking").map_err(miss)?;
    let ex = Format::load("sched", "sched_process_exit").map_err(miss)?;
    let mut o = TpOffsets {
        switch_prev_pid: sw.offset("prev_pid").map_err(miss)?,
        switch_prev_state: sw.offset("prev_state").map_err(miss)?,
        switch_next_pid: sw.offset("next_pid").map_err(miss)?,
        switch_prev_state_size: sw.field("prev_state").map_err(miss)?.size,
        wakeup_pid: wk.offset("pid").map_err(miss)?,
        exit_pid: ex.offset("pid").map_err(miss)?,
        ..TpOffsets::default()
    };
    // Optional tracepoints: all of a tracepoint's fields, or it is not attached. One that does
    // not exist at all is reported as absent by the attach loop, not here.
    let mut unusable = Vec::new();
    let mut fields = |category: &'static str, name: &'static str, names: &[&str]| -> Option<Vec<u32>> {
        if !preflight::tracepoint_exists(category, name) {
            return None;
        }
        let r = Format::load(category, name).and_then(|f| f.offsets(names));
        r.map_err(|e| unusable.push((name, format!("{e:#}")))).ok()
    };
    if let Some(&[dev, sector, nr, rwbs]) =
        fields("block", "block_bio_queue", &["dev", "sector", "nr_sector", "rwbs"]).as_deref()
    {
        (o.bio_dev, o.bio_sector, o.bio_nr_sector, o.bio_rwbs) = (dev, sector, nr, rwbs);
    }
    if let Some(&[dev, sector, nr]) = fields("block", "block_bio_complete", &["dev", "sector", "nr_sector"]).as_deref()
    {
        (o.biod_dev, o.biod_sector, o.biod_nr_sector) = (dev, sector, nr);
    }
    if let Some(&[pid, flags]) = fields("task", "task_newtask", &["pid", "clone_flags"]).as_deref() {
        (o.newtask_pid, o.newtask_clone_flags) = (pid, flags);
    }
    if let Some(&[pid]) = fields("sched", "sched_process_free", &["pid"]).as_deref() {
        o.free_pid = pid;
    }
    if let Some(&[pid, runtime]) = fields("sched", "sched_stat_runtime", &["pid", "runtime"]).as_deref() {
        (o.runtime_pid, o.runtime_ns) = (pid, runtime);
    }
    if let Some(&[dev, sector]) = fields("block", "block_rq_complete", &["dev", "sector"]).as_deref() {
        (o.rqd_dev, o.rqd_sector) = (dev, sector);
    }
    if let Some(&[pid, newcomm]) = fields("task", "task_rename", &["pid", "newcomm"]).as_deref() {
        (o.rename_pid, o.rename_newcomm) = (pid, newcomm);
    }
    Ok((o, unusable))
}

/// Block major of zram devices, from /proc/devices (never hard-coded).
pub fn zram_major() -> u32 {
    use procfs::Current;
    let devices = procfs::Devices::current().map(|d| d.block_devices).unwrap_or_default();
    devices.iter().find(|d| d.name == "zram").map_or(0, |d| d.major as u32)
}

/// Swap devices (not files) from /proc/swaps, in the kernel's dev_t encoding.
/// Hand-read: the procfs crate has no parser for `/proc/swaps`.
fn swap_devices() -> Vec<u32> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let Ok(s) = std::fs::read_to_string("/proc/swaps") else { return Vec::new() };
    s.lines()
        .skip(1)
        .filter_map(|l| {
            let path = l.split_whitespace().next()?;
            let m = std::fs::metadata(path).ok()?;
            if !m.file_type().is_block_device() {
                return None;
            }
            let rdev = m.rdev();
            let (major, minor) = (libc::major(rdev), libc::minor(rdev));
            Some((major << 20) | minor)
        })
        .collect()
}

fn set<V: Pod>(ebpf: &mut Ebpf, name: &'static str, index: u32, v: V) -> Result<(), ProbeError> {
    let map = ebpf.map_mut(name).ok_or_else(|| no_map(name))?;
    let mut a: Array<_, V> = Array::try_from(map).map_err(map_err(name))?;
    a.set(index, v, 0).map_err(map_err(name))
}

impl Probes {
    /// Load the object, point it at the target, seed the target's existing
    /// threads and attach every probe.
    pub fn attach(opts: &AttachOptions) -> Result<Self, ProbeError> {
        preflight::ensure_tracefs().map_err(|e| ProbeError::MissingTracepoint(format!("{e:#}")))?;
        let bd_dev = zram_rw_page_bd_dev();
        let (offsets, unusable) = tp_offsets()?;
        let offsets = TpOffsets {
            bdev_dev: bd_dev.as_ref().and_then(|r| r.as_ref().ok()).copied().unwrap_or(NO_FIELD),
            ..offsets
        };
        let raw_sched = match (opts.sched_hooks, raw_sched_available()) {
            (SchedHooks::Tracepoint, _) => None,
            (_, Ok(task_pid)) => Some(task_pid),
            (SchedHooks::Raw, Err(why)) => {
                return Err(ProbeError::MissingTracepoint(format!("--sched-hooks raw: {why}")));
            }
            (SchedHooks::Auto, Err(why)) => {
                log::info!("the scheduler's events through its tracepoints (sched:*): {why}");
                None
            }
        };
        let in_order = HOST_STORES_IN_ORDER as u8;
        let task_pid = raw_sched.unwrap_or(0);
        // Without it a thread may get a slot late (`observer_common::attrib::MAX_SLOTS`, "Slots").
        let task_start = btf::kernel_member_offset("task_struct", "start_time").unwrap_or_else(|e| {
            log::warn!(
                "no task_struct.start_time in the kernel's BTF ({e}): a thread that once found no attribution \
                 slot may get one later, and its row then holds only what came after"
            );
            0
        });
        let mut ebpf = EbpfLoader::new()
            .override_global(STORES_IN_ORDER, &in_order, true)
            .override_global(TASK_PID, &task_pid, true)
            .override_global(TASK_START_TIME, &task_start, true)
            .load(OBJECT)
            .map_err(classify_load)?;
        let target = opts.target;
        let mut config = Config {
            target_tgid: target,
            zram_major: zram_major(),
            follow_children: opts.follow_children as u32,
            ..Config::default()
        };
        let mut attached = Vec::new();
        // Before any fault program: what they know of a CPU's current task is set or forgotten at
        // each context switch from the first (`observer-ebpf/src/maps.rs`, `SLOT_CACHE`'s
        // `CURRENT`). The BTF programs do nothing before `CONFIG` is written.
        let mut missing = Vec::new();
        // Loaded first, all of them, so that a kernel that refuses one leaves `auto` on the
        // tracepoints with nothing attached.
        let btf_sched = match raw_sched.map(|_| load_btf_sched(&mut ebpf)) {
            None => None,
            Some(Ok(loaded)) => Some(loaded),
            Some(Err(e)) if opts.sched_hooks == SchedHooks::Auto => {
                log::warn!("the scheduler's BTF programs could not be loaded, its events go through sched:* ({e})");
                None
            }
            Some(Err(e)) => return Err(e),
        };
        match &btf_sched {
            Some((loaded, why)) => {
                for &(program, tp) in loaded {
                    attach_btf_tracepoint(&mut ebpf, program)?;
                    attached.push(format!("tp_btf:sched:{tp}"));
                }
                missing.extend(why.iter().cloned());
            }
            None => {
                attach_raw_tracepoint(&mut ebpf, "switch_forget", "sched_switch")?;
                attached.push("raw_tp:sched:sched_switch (forget)".into());
            }
        }
        // A tracepoint program runs unless a BTF program that replaces it is loaded.
        let replaced = |program: &str| {
            btf_sched.as_ref().is_some_and(|(loaded, _)| {
                RAW_SCHED.iter().any(|r| r.2 == program && loaded.iter().any(|l| l.0 == r.0))
            })
        };
        // The memcg close is chosen (and its item values read) before `CONFIG` is written; its
        // program runs from the attach on, returning until the target is set.
        if let Some((pgfault, pgmajfault)) =
            attach_memcg_close(&mut ebpf, opts.fault_close, opts.fault_timing, &mut attached)?
        {
            (config.memcg_close, config.pgfault_item, config.pgmajfault_item) = (1, pgfault, pgmajfault);
            config.storm_sampling = (opts.fault_timing == FaultTiming::Sampled) as u32;
        }
        set(&mut ebpf, "CONFIG", 0, config)?;
        set(&mut ebpf, "OFFSETS", 0, offsets)?;
        for (i, w) in syscalls::io_bitmap().into_iter().enumerate() {
            set(&mut ebpf, "IO_SYSCALLS", i as u32, w)?;
        }
        {
            let map = ebpf.map_mut("DEVICES").ok_or_else(|| no_map("DEVICES"))?;
            let mut h: HashMap<_, u32, u32> = HashMap::try_from(map).map_err(map_err("DEVICES"))?;
            for dev in swap_devices() {
                h.insert(dev, DEV_SWAP, 0).map_err(map_err("DEVICES"))?;
            }
        }
        if !opts.held {
            seed_threads(&mut ebpf, target)?;
        }

        let cpus = online_cpus().map_err(|(path, source)| ProbeError::Cpus { path, source })?;
        let raw_entry = attach_raw_fault_entry(&mut ebpf, opts.fault_timing, &mut attached)?;
        if opts.fault_timing == FaultTiming::DispatchOnly {
            if !raw_entry {
                return Err(ProbeError::MissingTracepoint(
                    "--fault-dispatch-only: this kernel has no exceptions:page_fault_user (x86's raw fault entry), \
                     the hook whose dispatch it measures"
                        .into(),
                ));
            }
            log::warn!(
                "--fault-dispatch-only: the fault hooks run a program that returns at once; no fault is counted or \
                 timed in this run"
            );
        }
        for probe in &FAULT_PROBES {
            if raw_entry && probe.program == "fault_entry"
                || config.memcg_close != 0 && probe.program == "fault_exit_min"
            {
                continue;
            }
            let prog: &mut PerfEvent = program_of(&mut ebpf, probe.program)?;
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
            attached.push(format!("perf:{}", probe.event_name));
        }
        attach_raw_syscalls(&mut ebpf, &mut attached)?;
        for &(program, category, name, required) in TRACEPOINTS {
            if replaced(program) {
                continue;
            }
            if !preflight::tracepoint_exists(category, name) {
                if required {
                    return Err(ProbeError::MissingTracepoint(format!(
                        "this kernel has no tracepoint {category}:{name} (needs CONFIG_TRACEPOINTS and the {category} events)"
                    )));
                }
                missing.push(format!(
                    "{category}:{name} (not on this kernel: no {}/events/{category}/{name})",
                    preflight::TRACEFS
                ));
                continue;
            }
            if let Some((_, why)) = unusable.iter().find(|(n, _)| *n == name) {
                missing.push(format!("{category}:{name} (its format lacks a field the program reads: {why})"));
                continue;
            }
            let prog: &mut TracePoint = program_of(&mut ebpf, program)?;
            // The same program may serve several tracepoints: load it once.
            if prog.fd().is_err() {
                match prog.load() {
                    Ok(()) => {}
                    Err(e) if required => return Err(program_error(program, e)),
                    Err(e) => {
                        log::debug!("loading {program}: {e}");
                        let why = match e {
                            ProgramError::LoadError { io_error, .. } => io_error.to_string(),
                            other => other.to_string(),
                        };
                        let hint =
                            if program == "thread_free" { "; slots are not given back when threads exit" } else { "" };
                        missing.push(format!("{category}:{name} (the kernel refused program {program}: {why}{hint})"));
                        continue;
                    }
                }
            }
            // A tracepoint with a second program is named with it.
            let probe = match TRACEPOINTS.iter().find(|t| t.2 == name).map(|t| t.0) {
                Some(first) if first != program => format!("tp:{category}:{name}:{program}"),
                _ => format!("tp:{category}:{name}"),
            };
            match prog.attach(category, name) {
                Ok(_) => attached.push(probe),
                Err(e) if required => return Err(program_error(program, e)),
                Err(e) => missing.push(format!("{category}:{name} ({e})")),
            }
        }
        attach_zram_rw_page(&mut ebpf, bd_dev.as_ref(), &mut attached, &mut missing);
        let (markers, markers_refused) = match attach_markers(&mut ebpf, opts, &mut attached) {
            Ok(m) => (m, None),
            Err(e) if opts.markers_optional && e.is_markers_refused() => (None, Some(e.to_string())),
            Err(e) => return Err(e),
        };
        // Markers may come later (a descendant exec'ing an engine, a library loaded by dlopen),
        // attached while that process runs on: the verifier's hundreds of milliseconds (on a
        // busy machine) are spent now, so that attaching then takes a few. Best effort: a program
        // this kernel refuses is the run's concern only when markers are found (the attach then
        // loads it again and says why), never for a run that has none (Debian's 6.1 refused one).
        if markers.is_none() && !matches!(opts.markers, Markers::None) {
            for program in MARKER_PROGRAMS {
                if let Err(e) = loaded_uprobe(&mut ebpf, program) {
                    log::debug!("preloading {program}: {e}");
                }
            }
        }
        let stats = Stats::get(opts.bpf_stats);
        Ok(Self { ebpf, stats, attached, missing, markers, markers_refused, config })
    }

    /// The loaded object, for modules that attach their own programs or
    /// read their own maps (e.g. page-cache churn).
    pub fn ebpf_mut(&mut self) -> &mut Ebpf {
        &mut self.ebpf
    }

    pub fn ebpf(&self) -> &Ebpf {
        &self.ebpf
    }

    /// Every entry of a `u32`-keyed hash map, sorted by key.
    fn entries<V: Pod>(&self, name: &'static str) -> Result<Vec<(u32, V)>, ProbeError> {
        let map = self.ebpf.map(name).ok_or_else(|| no_map(name))?;
        let h: HashMap<_, u32, V> = HashMap::try_from(map).map_err(map_err(name))?;
        let mut rows = h.iter().collect::<Result<Vec<_>, _>>().map_err(map_err(name))?;
        rows.sort_by_key(|(k, _)| *k);
        Ok(rows)
    }

    /// The cumulative explicit-read totals (`observer_common::xread::T_*`) now, as a token mark
    /// copies them (for window boundaries).
    pub fn xread_totals(&self) -> Result<[u64; observer_common::xread::N_TOTALS], ProbeError> {
        xread_totals(&self.ebpf)
    }

    /// The faults of threads without a slot (`observer_common::faults`), sorted by TID.
    pub fn overflow_faults(&self) -> Result<Vec<(u32, OverflowFaults)>, ProbeError> {
        self.entries("OVERFLOW_FAULTS")
    }

    /// Fault exits of threads with neither a slot nor an overflow entry, summed over CPUs:
    /// (major, minor). Under the memcg close the minor ones are the closes less the majors.
    pub fn other_faults(&self) -> Result<(u64, u64), ProbeError> {
        let map = self.ebpf.map("OTHER_FAULTS").ok_or_else(|| no_map("OTHER_FAULTS"))?;
        let a: PerCpuArray<_, u64> = PerCpuArray::try_from(map).map_err(map_err("OTHER_FAULTS"))?;
        let sum = |i: u32| a.get(&i, 0).map(|v| v.iter().sum::<u64>()).map_err(map_err("OTHER_FAULTS"));
        let maj = sum(OTHER_MAJFLT)?;
        let min =
            if self.config.memcg_close != 0 { sum(OTHER_CLOSES)?.saturating_sub(maj) } else { sum(OTHER_MINFLT)? };
        Ok((maj, min))
    }

    /// A global counter summed over CPUs.
    pub fn counter(&self, c: GlobalCounter) -> Result<u64, ProbeError> {
        let map = self.ebpf.map("COUNTERS").ok_or_else(|| no_map("COUNTERS"))?;
        let a: PerCpuArray<_, u64> = PerCpuArray::try_from(map).map_err(map_err("COUNTERS"))?;
        debug_assert!((c as u32) < GLOBAL_COUNTERS);
        let v = a.get(&(c as u32), 0).map_err(map_err("COUNTERS"))?;
        Ok(v.iter().sum())
    }

    /// Latency histograms (`attrib::H_*`), summed over CPUs.
    pub fn hists(&self) -> Result<Vec<Hist>, ProbeError> {
        let map = self.ebpf.map("HISTS").ok_or_else(|| no_map("HISTS"))?;
        let a: PerCpuArray<_, Hist> = PerCpuArray::try_from(map).map_err(map_err("HISTS"))?;
        let mut out = Vec::new();
        for i in 0..N_HIST {
            let per_cpu = a.get(&i, 0).map_err(map_err("HISTS"))?;
            let mut h = Hist::zeroed();
            per_cpu.iter().for_each(|v| h.merge(v));
            out.push(h);
        }
        Ok(out)
    }

    /// Slots of `THREADS` given out so far.
    fn slots_used(&self) -> Result<u32, ProbeError> {
        let seqs = self.ebpf.map("SEQS").ok_or_else(|| no_map("SEQS"))?;
        let seqs: Array<_, u64> = Array::try_from(seqs).map_err(map_err("SEQS"))?;
        Ok(seqs.get(&0, 0).map_err(map_err("SEQS"))?.min(MAX_SLOTS as u64) as u32)
    }

    /// Every tracked thread's state now, closed at `now` (user-space twin of a
    /// mark, for `--window`). Torn copies are retried; slots given back are skipped.
    pub fn snapshot(&self, now: u64) -> Result<Vec<ThreadState>, ProbeError> {
        Ok(self.slots(now)?.into_iter().map(|(s, _)| s).collect())
    }

    /// [`Self::snapshot`], each state with the fault latencies at its slot (the run's table).
    pub fn slots(&self, now: u64) -> Result<Vec<(ThreadState, FaultTimes)>, ProbeError> {
        let used = self.slots_used()?;
        let map = self.ebpf.map("THREADS").ok_or_else(|| no_map("THREADS"))?;
        let a: Array<_, ThreadState> = Array::try_from(map).map_err(map_err("THREADS"))?;
        let map = self.ebpf.map("FAULT_TIMES").ok_or_else(|| no_map("FAULT_TIMES"))?;
        let faults: Array<_, FaultTimes> = Array::try_from(map).map_err(map_err("FAULT_TIMES"))?;
        let mut out = Vec::with_capacity(used as usize);
        for i in 0..used {
            let mut s = a.get(&i, 0).map_err(map_err("THREADS"))?;
            for _ in 0..3 {
                if s.seq & 1 == 0 {
                    break;
                }
                s = a.get(&i, 0).map_err(map_err("THREADS"))?;
            }
            if s.tid == 0 {
                continue; // given back (`observer_common::attrib::MAX_SLOTS`, "Slots")
            }
            s.account(now);
            out.push((s, faults.get(&i, 0).map_err(map_err("FAULT_TIMES"))?));
        }
        Ok(out)
    }

    /// Each of the observer's programs' cumulative run time and run count, by name, when the
    /// kernel's BPF statistics are on (`None` otherwise): the kernel-side cost per event. A loaded
    /// program whose statistics cannot be read is an error naming it, not one left out of the sums.
    pub fn bpf_stats(&self) -> Result<Option<Vec<ProgramCost>>, ProbeError> {
        if self.stats.is_none() {
            return Ok(None);
        }
        let mut out = Vec::new();
        for (name, p) in self.ebpf.programs() {
            // An optional program this kernel did not get (see `missing`) has no statistics.
            let info = match p.info() {
                Ok(info) => info,
                Err(ProgramError::NotLoaded) => continue,
                Err(e) => return Err(ProbeError::ProgramInfo { program: name.to_string(), source: Box::new(e) }),
            };
            out.push(ProgramCost {
                name: name.to_string(),
                run_ns: info.run_time().as_nanos() as u64,
                runs: info.run_count(),
            });
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(Some(out))
    }

    /// The latency histograms as a model event.
    pub fn histograms_event(&self, mono_ns: u64) -> Result<observer_common::model::LatencyHistograms, ProbeError> {
        Ok(observer_common::model::LatencyHistograms::from_kernel(mono_ns, &self.hists()?))
    }

    /// Per-device totals of the target's block reads: (kernel dev_t, totals).
    pub fn devices(&self) -> Result<Vec<(u32, DevIo)>, ProbeError> {
        self.entries("DEV_IO")
    }

    /// A window's snapshot begins at `now`: no event charges a context it decides late to time
    /// before it (`observer_common::attrib`, "Closed time stays closed").
    pub fn close_at(&mut self, now: u64) -> Result<(), ProbeError> {
        set(&mut self.ebpf, "SEQS", SEQ_CLOSED, now)
    }

    /// Stop process `pid` at its next `exec`, or none (see `Config::stop_on_exec`).
    pub fn set_stop_on_exec(&mut self, pid: Option<u32>) -> Result<(), ProbeError> {
        self.config.stop_on_exec = pid.unwrap_or(0);
        set(&mut self.ebpf, "CONFIG", 0, self.config)
    }

    /// The target `exec`'d `exe`: attach the engine markers there when it has
    /// them and no markers are attached yet. Returns what is attached now.
    pub fn attach_after_exec(
        &mut self,
        exe: &std::path::Path,
        pid: u32,
        engine: EngineChoice,
    ) -> Result<Option<MarkerKind>, ProbeError> {
        if self.markers.is_some() {
            return Ok(None);
        }
        let opts = AttachOptions {
            target: pid,
            markers: Markers::Auto { exe: exe.to_path_buf(), engine, running: true, any_process: false },
            follow_children: self.config.follow_children != 0,
            held: false,
            markers_optional: false,
            bpf_stats: false,
            fault_close: FaultClose::Auto,
            fault_timing: FaultTiming::Sampled,
            sched_hooks: SchedHooks::Auto,
        };
        let m = attach_markers(&mut self.ebpf, &opts, &mut self.attached)?;
        self.markers = m.clone();
        Ok(m)
    }

    /// The ring buffer of token-boundary records (can be taken once).
    pub fn take_events(&mut self) -> Result<RingBuf<MapData>, ProbeError> {
        let map: Map = self.ebpf.take_map("EVENTS").ok_or_else(|| no_map("EVENTS"))?;
        RingBuf::try_from(map).map_err(map_err("EVENTS"))
    }
}

/// Seed the target's existing threads into slots 0..n.
fn seed_threads(ebpf: &mut Ebpf, pid: u32) -> Result<(), ProbeError> {
    let now = seed::mono_ns();
    let mut states: Vec<ThreadState> =
        seed::tids(pid).into_iter().filter_map(|tid| seed::seed(pid, tid, now)).collect();
    if states.len() > MAX_SLOTS as usize {
        // The others find none (`observer_common::attrib::MAX_SLOTS`, "Slots").
        states.truncate(MAX_SLOTS as usize);
        set(ebpf, "SEQS", SEQ_LAST_MISS, now)?;
    }
    {
        let map = ebpf.map_mut("THREADS").ok_or_else(|| no_map("THREADS"))?;
        let mut a: Array<_, ThreadState> = Array::try_from(map).map_err(map_err("THREADS"))?;
        for (i, s) in states.iter().enumerate() {
            a.set(i as u32, *s, 0).map_err(map_err("THREADS"))?;
        }
    }
    {
        let map = ebpf.map_mut("SLOTS").ok_or_else(|| no_map("SLOTS"))?;
        let mut h: HashMap<_, u32, u32> = HashMap::try_from(map).map_err(map_err("SLOTS"))?;
        for (i, s) in states.iter().enumerate() {
            h.insert(s.tid, i as u32, 0).map_err(map_err("SLOTS"))?;
        }
    }
    set(ebpf, "SEQS", 0, states.len() as u64)
}

/// The uprobe programs of token markers (engine markers and entry points).
const MARKER_PROGRAMS: [&str; 4] = ["mark_begin", "mark_end", "call_begin", "call_end"];

/// Uprobe `program`, loaded (verified) once.
fn loaded_uprobe<'a>(ebpf: &'a mut Ebpf, program: &'static str) -> Result<&'a mut UProbe, ProbeError> {
    let prog: &mut UProbe = program_of(ebpf, program)?;
    if prog.fd().is_err() {
        prog.load().map_err(|e| program_error(program, e))?;
    }
    Ok(prog)
}

/// Attach `program` at `symbol` of `path` for `pid`; the link is pushed on
/// `links` (so that a later failure can take back what was attached).
fn uprobe(
    ebpf: &mut Ebpf,
    links: &mut Vec<(&'static str, UProbeLinkId)>,
    program: &'static str,
    symbol: &str,
    path: &std::path::Path,
    pid: u32,
    cookie: Option<u64>,
) -> Result<(), ProbeError> {
    let prog = loaded_uprobe(ebpf, program)?;
    let scope = match NonZeroU32::new(pid) {
        Some(p) => UProbeScope::OneProcess(p),
        None => UProbeScope::AllProcesses,
    };
    let point = aya::programs::uprobe::UProbeAttachPoint { location: symbol.into(), cookie };
    let id = prog.attach(point, path, scope).map_err(|source| ProbeError::Uprobe {
        symbol: symbol.into(),
        path: path.display().to_string(),
        hint: uprobe_hint(&source, symbol, path),
        source: Box::new(source),
    })?;
    links.push((program, id));
    Ok(())
}

/// The OS error at the root of `e`, if there is one.
fn os_error(e: &ProgramError) -> Option<i32> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(x) = cur {
        if let Some(code) = x.downcast_ref::<io::Error>().and_then(io::Error::raw_os_error) {
            return Some(code);
        }
        if let Some(s) = x.downcast_ref::<aya::sys::SyscallError>() {
            return s.io_error.raw_os_error();
        }
        cur = x.source();
    }
    None
}

/// What to do about a uprobe the kernel refused, by its errno.
fn uprobe_hint(e: &ProgramError, symbol: &str, path: &std::path::Path) -> String {
    /// The kernel's ENOTSUPP (not ENOTSUP): an instruction uprobes cannot step over.
    const ENOTSUPP: i32 = 524;
    let file = path.display();
    if let Some(why) = elf_symbol_addr(path, symbol).and_then(|a| unprobeable_entry(path, a)) {
        return format!("`{symbol}`: {why}");
    }
    match os_error(e) {
        Some(libc::EPERM | libc::EACCES) => preflight::permission_hint().to_string(),
        Some(ENOTSUPP) => format!(
            "the kernel cannot probe the first instruction of `{symbol}` (see `objdump -d --disassemble={symbol} {file}`): give a function it can probe in --token-symbol"
        ),
        Some(libc::EIO) => format!(
            "the filesystem holding {file} does not support uprobes: run the program from a file on ext4, xfs, btrfs or tmpfs"
        ),
        Some(libc::EINVAL) => format!(
            "the kernel refused the probe point (an offset outside {file}, or not an instruction): check `nm -D {file}` for `{symbol}` and give a function in --token-symbol"
        ),
        Some(libc::ESRCH) => {
            "the process the probe was for exited while the observer was attaching (a uprobe for one process \
             needs it alive): observe a program that runs longer, or start it under `observer run -- …`"
                .to_string()
        }
        _ => format!("check that `{symbol}` is a function of {file} and that {file} can be probed"),
    }
}

/// Attach the token markers `opts` asks for, all or nothing: when one uprobe
/// is refused, those already attached are detached again (no half of a
/// begin/end pair is left to fire) and `attached` is left as it was.
fn attach_markers(
    ebpf: &mut Ebpf,
    opts: &AttachOptions,
    attached: &mut Vec<String>,
) -> Result<Option<MarkerKind>, ProbeError> {
    let mut links = Vec::new();
    let mut names = Vec::new();
    let res = attach_each_marker(ebpf, opts, &mut names, &mut links);
    if res.is_ok() {
        attached.append(&mut names);
        return res;
    }
    for (program, id) in links {
        let prog: Option<&mut UProbe> = ebpf.program_mut(program).and_then(|p| p.try_into().ok());
        if let Some(Err(e)) = prog.map(|p| p.detach(id)) {
            log::warn!("detaching the uprobe of `{program}` after a refused marker: {e}");
        }
    }
    res
}

fn attach_each_marker(
    ebpf: &mut Ebpf,
    opts: &AttachOptions,
    attached: &mut Vec<String>,
    links: &mut Vec<(&'static str, UProbeLinkId)>,
) -> Result<Option<MarkerKind>, ProbeError> {
    match &opts.markers {
        Markers::None => Ok(None),
        Markers::Auto { exe, engine, running, any_process } => {
            let scope = if *any_process { 0 } else { opts.target };
            let ours = match engine {
                EngineChoice::Auto => {
                    (elf_symbol_addr(exe, engine_abi::SYM_BEGIN)).zip(elf_symbol_addr(exe, engine_abi::SYM_END))
                }
                _ => None,
            };
            let Some((b, e)) = ours else {
                let pid = running.then_some(opts.target);
                let Some(found) = profile::detect(&engine.profiles(), exe, pid) else { return Ok(None) };
                for entry in &found.entries {
                    let cookie = Some(entry.n_tokens.cookie());
                    uprobe(ebpf, links, "call_begin", entry.symbol, &found.path, scope, cookie)?;
                    uprobe(ebpf, links, "call_end", entry.symbol, &found.path, scope, None)?;
                    attached.push(format!("uprobe+uretprobe:{}:{}", found.path.display(), entry.symbol));
                }
                return Ok(Some(MarkerKind::Profile(found)));
            };
            for (sym, addr) in [(engine_abi::SYM_BEGIN, b), (engine_abi::SYM_END, e)] {
                if let Some(why) = unprobeable_entry(exe, addr) {
                    return Err(ProbeError::Markers(format!("cannot uprobe {sym} in {}: {why}", exe.display())));
                }
            }
            if b == e {
                return Err(ProbeError::Markers(format!(
                    "{} defines {} and {} at the same address {b:#x} (the linker folded identical functions): give the two markers different bodies",
                    exe.display(),
                    engine_abi::SYM_BEGIN,
                    engine_abi::SYM_END
                )));
            }
            uprobe(ebpf, links, "mark_begin", engine_abi::SYM_BEGIN, exe, scope, None)?;
            uprobe(ebpf, links, "mark_end", engine_abi::SYM_END, exe, scope, None)?;
            attached.push(format!("uprobe:{}:{{{},{}}}", exe.display(), engine_abi::SYM_BEGIN, engine_abi::SYM_END));
            Ok(Some(MarkerKind::Engine { exe: exe.display().to_string() }))
        }
        Markers::Symbol { symbol, path } => {
            uprobe(ebpf, links, "call_begin", symbol, path, opts.target, None)?;
            uprobe(ebpf, links, "call_end", symbol, path, opts.target, None)?;
            attached.push(format!("uprobe+uretprobe:{}:{symbol}", path.display()));
            Ok(Some(MarkerKind::Symbol { symbol: symbol.clone(), path: path.display().to_string() }))
        }
    }
}

/// Whether `exe` (or a library it needs) carries token markers: the engine's marker symbols
/// or an engine profile's entry points.
pub fn carries_markers(exe: &std::path::Path, engine: EngineChoice) -> bool {
    (engine == EngineChoice::Auto && elf_has_symbol(exe, engine_abi::SYM_BEGIN))
        || profile::detect(&engine.profiles(), exe, None).is_some()
}

/// Why the first instruction at `addr` cannot carry a uprobe, when we can
/// tell (x86: a `lock` prefix makes the kernel refuse it, and when the
/// binary is not mapped yet the refusal is silent).
pub fn unprobeable_entry(path: &std::path::Path, addr: u64) -> Option<String> {
    if !cfg!(target_arch = "x86_64") {
        return None;
    }
    let data = map_elf(path).ok()?;
    let file = object::File::parse(&*data).ok()?;
    use object::{Object, ObjectSegment};
    let off = file.segments().find_map(|s| {
        let (a, size) = (s.address(), s.size());
        let (fo, _) = s.file_range();
        (addr >= a && addr < a + size).then(|| fo + (addr - a))
    })?;
    let first = *data.get(off as usize)?;
    (first == 0xf0).then(|| {
        "its first instruction has a `lock` prefix (an atomic read-modify-write), which x86 uprobes refuse: start the marker with a plain store".to_string()
    })
}

/// Whether an ELF file defines `symbol` (symtab or dynsym).
pub fn elf_has_symbol(path: &std::path::Path, symbol: &str) -> bool {
    elf_symbol_addr(path, symbol).is_some()
}

/// The address of a symbol an ELF file defines (symtab or dynsym).
/// An executable, mapped rather than read: an engine built with debug info is
/// tens of MiB, and only its headers and symbol tables are looked at.
pub fn map_elf(path: &std::path::Path) -> io::Result<memmap2::Mmap> {
    let f = std::fs::File::open(path)?;
    // SAFETY: a read-only mapping of an executable; truncating a file that a
    // running program executes is refused by the kernel (ETXTBSY).
    unsafe { memmap2::Mmap::map(&f) }
}

pub fn elf_symbol_addr(path: &std::path::Path, symbol: &str) -> Option<u64> {
    let data = std::fs::read(path).ok()?;
    let file = object::File::parse(&*data).ok()?;
    use object::{Object, ObjectSymbol};
    file.symbols()
        .chain(file.dynamic_symbols())
        .find(|s| s.name() == Ok(symbol) && s.is_definition())
        .map(|s| s.address())
}
