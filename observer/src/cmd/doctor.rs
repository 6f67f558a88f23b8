//! `observer doctor`: what the observer needs on this host, and what to fix.
//!
//! ## Spec
//! One line per check, `ok   WHAT: detail` or `FIX  WHAT: detail — what to
//! do`; exit 0 when every check passes, 1 otherwise. Checks, in order:
//! - capabilities of this process, each the systemd unit grants
//!   (`packaging/moe-observer.service` says why each is needed);
//! - tracefs mounted and readable, the tracepoints the probes attach to, the
//!   uprobe PMU (tracepoints only when tracefs is readable), kernel BTF, BPF ring buffers (kernel ≥ 5.8);
//! - which event closes a fault under `observer run --fault-close auto` (an `info` line: the
//!   memcg close where the kernel has it, else the perf close and why; `observer_common::faults`),
//!   judged only when tracefs is readable;
//! - cgroup v2 and its controllers, `perf_event_paranoid`,
//!   `kernel.bpf_stats_enabled` (the observer's own cost metric);
//! - zram devices (swap experiments) and, with `--model FILE`, how much of the
//!   model is in the page cache (`cachestat`, which reads
//!   nothing into the cache).

use std::path::{Path, PathBuf};

use anyhow::Result;

#[derive(Debug, clap::Args)]
pub struct DoctorArgs {
    /// Also report how much of this model file is in the page cache.
    #[arg(long, value_name = "FILE")]
    pub model: Option<PathBuf>,
}

/// Capabilities the daemon is given (bit, name); the unit explains each.
const CAPS: [(u32, &str); 6] = [
    (39, "CAP_BPF"),
    (38, "CAP_PERFMON"),
    (2, "CAP_DAC_READ_SEARCH"),
    (21, "CAP_SYS_ADMIN"),
    (19, "CAP_SYS_PTRACE"),
    (3, "CAP_FOWNER"),
];
const TRACEFS: &str = "/sys/kernel/tracing";
/// The tracepoints the probes attach to.
const TRACEPOINTS: [&str; 4] =
    ["exceptions/page_fault_user", "sched/sched_switch", "block/block_rq_issue", "block/block_rq_complete"];

struct Report {
    failed: usize,
}

impl Report {
    fn check(&mut self, what: &str, ok: bool, detail: impl std::fmt::Display, fix: &str) {
        if ok {
            println!("ok   {what}: {detail}");
        } else {
            self.failed += 1;
            println!("FIX  {what}: {detail} — {fix}");
        }
    }
}

fn read(p: impl AsRef<Path>) -> Option<String> {
    std::fs::read_to_string(p).ok().map(|s| s.trim().to_string())
}

pub fn doctor(args: DoctorArgs) -> Result<i32> {
    let mut r = Report { failed: 0 };
    let eff = observer::capture::preflight::effective_capabilities();
    for (bit, name) in CAPS {
        r.check(
            "capability",
            eff & (1 << bit) != 0,
            name,
            "run as root, or as the unit does (AmbientCapabilities in packaging/moe-observer.service)",
        );
    }
    let mounted = procfs::mounts().is_ok_and(|m| m.iter().any(|e| e.fs_file == TRACEFS));
    r.check(
        "tracefs",
        mounted,
        format!("mounted at {TRACEFS}"),
        "mount it in the node's setup: mount -t tracefs tracefs /sys/kernel/tracing",
    );
    let readable = std::fs::read_dir(Path::new(TRACEFS).join("events")).is_ok();
    r.check("tracefs", readable, "readable by this process", "it is 0700 root: give CAP_DAC_READ_SEARCH");
    for tp in TRACEPOINTS.iter().filter(|_| readable) {
        let id = Path::new(TRACEFS).join("events").join(tp).join("id");
        r.check(
            "tracepoint",
            id.exists(),
            tp,
            "a kernel without this tracepoint: the observer cannot attribute that time",
        );
    }
    if readable {
        println!(
            "info fault close: {}",
            match observer::capture::bpf::memcg_close_available() {
                Ok(()) => "memcg:count_memcg_events (a raw tracepoint, the cheaper close)".to_string(),
                Err(why) => format!("perf events minor-faults/major-faults (no memcg close: {why})"),
            }
        );
        println!(
            "info scheduler events: {}",
            match observer::capture::bpf::raw_sched_available() {
                Ok(_) => "raw tracepoints (no record built per switch or wakeup)".to_string(),
                Err(why) => format!("the sched:* tracepoints (no raw ones: {why})"),
            }
        );
        println!(
            "info attribution slots: {} threads at a time, a slot given back when its thread's task is freed \
             (program thread_free; a kernel that refuses it is named among a run's probes missing)",
            observer_common::attrib::MAX_SLOTS,
        );
    }
    r.check(
        "uprobes",
        Path::new("/sys/bus/event_source/devices/uprobe/type").exists(),
        "the uprobe PMU (the engine's token markers)",
        "a kernel built with CONFIG_UPROBE_EVENTS",
    );
    r.check(
        "BTF",
        Path::new("/sys/kernel/btf/vmlinux").exists(),
        "/sys/kernel/btf/vmlinux",
        "a kernel built with CONFIG_DEBUG_INFO_BTF",
    );
    let release = read("/proc/sys/kernel/osrelease").unwrap_or_default();
    let ringbuf = procfs::KernelVersion::current().is_ok_and(|v| v >= procfs::KernelVersion::new(5, 8, 0));
    r.check("ring buffers", ringbuf, format!("kernel {release} (BPF ring buffers need 5.8)"), "a kernel ≥ 5.8");
    let controllers = read("/sys/fs/cgroup/cgroup.controllers");
    r.check(
        "cgroup v2",
        controllers.is_some(),
        format!("controllers: {}", controllers.as_deref().unwrap_or("none (cgroup v1 or none)")),
        "container ids and `--cgroup` read the cgroup v2 path; v1 works for --cgroup only",
    );
    if let Some(c) = &controllers {
        r.check(
            "cgroup v2",
            c.split(' ').any(|x| x == "memory"),
            "memory controller",
            "enable it (cgroup_enable=memory)",
        );
    }
    let paranoid = read("/proc/sys/kernel/perf_event_paranoid").unwrap_or_else(|| "?".into());
    let perfmon = eff & (1 << 38) != 0;
    r.check(
        "perf_event_paranoid",
        perfmon || paranoid.parse::<i32>().is_ok_and(|p| p <= 1),
        format!("{paranoid}{}", if perfmon { " (CAP_PERFMON overrides it)" } else { "" }),
        "give CAP_PERFMON",
    );
    let stats = read("/proc/sys/kernel/bpf_stats_enabled").unwrap_or_else(|| "?".into());
    r.check(
        "bpf_stats_enabled",
        stats == "1" || eff & (1 << 21) != 0,
        format!("{stats} (the observer's own eBPF cost, bpf_run_seconds_total, measured with --bpf-stats)"),
        "run as root with --bpf-stats, or set kernel.bpf_stats_enabled=1 in the node's setup, or the metric is absent",
    );
    let zram: Vec<String> = std::fs::read_dir("/sys/block")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str().filter(|n| n.starts_with("zram")).map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    println!("info zram: {}", if zram.is_empty() { "no zram devices".to_string() } else { zram.join(", ") });
    if let Some(model) = &args.model {
        let page = observer::capture::residency::scan::page_size();
        let stat = std::fs::File::open(model).and_then(|f| {
            let pages = f.metadata()?.len().div_ceil(page);
            Ok((observer::capture::residency::scan::cachestat(&f, 0..0)?, pages))
        });
        match stat {
            Ok((c, pages)) => println!(
                "info model {}: {} of {pages} pages in the page cache ({:.1} %), {} evicted (cachestat)",
                model.display(),
                c.nr_cache,
                100.0 * c.nr_cache as f64 / pages.max(1) as f64,
                c.nr_evicted
            ),
            Err(e) => r.check("model", false, format!("{}: {e:#}", model.display()), "check the path and permissions"),
        }
    }
    println!(
        "{}",
        if r.failed == 0 { "all checks passed".to_string() } else { format!("{} check(s) to fix", r.failed) }
    );
    Ok(i32::from(r.failed > 0))
}
