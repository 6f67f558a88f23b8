//! What kind of machine this is, printed at the top of `cargo xtask setup` and `cargo xtask test`
//! so that a CI log says where it ran. Every line names its source:
//!
//! - `cpu`: the first `model name` of `/proc/cpuinfo`, the online CPU count
//!   (`available_parallelism`) and `MemTotal` of `/proc/meminfo`.
//! - `isa`: which of [`ISA_FLAGS`] the first `flags` line of `/proc/cpuinfo` lists (`+name`) and
//!   which it does not (`-name`). AMX is never used by the llama.cpp reference whatever this says
//!   (see `llama.rs`); a VM may also run on AMX hardware without listing it.
//! - `kernel`: `/proc/sys/kernel/osrelease`.
//! - `cgroup`: from `/proc/self/mounts`: `v2` when only `cgroup2` file systems are mounted, `v1`
//!   when only `cgroup` (v1) hierarchies are, `hybrid` when both are; and where the memory
//!   controller is bound: the v1 hierarchy whose mount options name `memory`, or the v2 mount
//!   whose `cgroup.controllers` lists `memory`, or nowhere.
//! - `features`: BTF (`/sys/kernel/btf/vmlinux` exists); tracefs (mounted, from the mount table);
//!   uprobes and kprobes: `yes` when tracefs has `uprobe_events`/`kprobe_events`, else what the
//!   kernel config (`/proc/config.gz`, or `/boot/config-<release>`) says of `CONFIG_UPROBE_EVENTS`
//!   / `CONFIG_KPROBES`, else `unknown`; fentry: `unknown` (only loading a tracing program would
//!   tell; the project does not depend on it).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The CPU flags (as `/proc/cpuinfo` spells them) that decide which code llama.cpp and the engine
/// can run here.
pub const ISA_FLAGS: [&str; 19] = [
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "bmi2",
    "avx512f",
    "avx512cd",
    "avx512bw",
    "avx512dq",
    "avx512vl",
    "avx512vbmi",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "avx_vnni",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
];

/// The flags of the first CPU in `/proc/cpuinfo` (empty when it cannot be read).
pub fn cpu_flags() -> BTreeSet<String> {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    cpuinfo_field(&info, "flags").map(|f| f.split_whitespace().map(str::to_owned).collect()).unwrap_or_default()
}

fn cpuinfo_field<'a>(info: &'a str, key: &str) -> Option<&'a str> {
    info.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        (k.trim() == key).then(|| v.trim())
    })
}

/// One mount of `/proc/self/mounts`.
#[derive(Debug, PartialEq, Eq)]
struct Mount {
    point: PathBuf,
    fstype: String,
    options: Vec<String>,
}

fn parse_mounts(text: &str) -> Vec<Mount> {
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let [_, point, fstype, options, ..] = f.as_slice() else { return None };
            // The kernel escapes spaces and the like as octal (`\040`); none of ours have any.
            Some(Mount {
                point: PathBuf::from(point.replace("\\040", " ")),
                fstype: (*fstype).to_owned(),
                options: options.split(',').map(str::to_owned).collect(),
            })
        })
        .collect()
}

/// The cgroup line: version and where the memory controller is bound. `controllers` reads a
/// v2 mount's `cgroup.controllers`.
fn cgroup_line(mounts: &[Mount], controllers: impl Fn(&Path) -> Option<String>) -> String {
    let v1: Vec<&Mount> = mounts.iter().filter(|m| m.fstype == "cgroup").collect();
    let v2: Vec<&Mount> = mounts.iter().filter(|m| m.fstype == "cgroup2").collect();
    let version = match (v1.is_empty(), v2.first()) {
        (true, Some(_)) => "v2".to_owned(),
        (false, None) => "v1".to_owned(),
        (false, Some(m)) => format!("hybrid (v1 hierarchies, v2 at {})", m.point.display()),
        (true, None) => "none mounted".to_owned(),
    };
    let memory = if let Some(m) = v1.iter().find(|m| m.options.iter().any(|o| o == "memory")) {
        format!("v1 at {}", m.point.display())
    } else if let Some(m) =
        v2.iter().find(|m| controllers(&m.point).is_some_and(|c| c.split_whitespace().any(|w| w == "memory")))
    {
        format!("v2 at {} (in its cgroup.controllers)", m.point.display())
    } else {
        "not bound (no v1 memory hierarchy, no v2 cgroup.controllers listing memory)".to_owned()
    };
    format!("{version}; memory controller {memory}")
}

/// `Some(true)` / `Some(false)` when a kernel config text sets / unsets `name`.
fn config_says(config: &str, name: &str) -> Option<bool> {
    config.lines().find_map(|l| {
        if l.strip_prefix(name).is_some_and(|r| r == "=y" || r == "=m") {
            Some(true)
        } else if l == format!("# {name} is not set") {
            Some(false)
        } else {
            None
        }
    })
}

/// The kernel's build configuration and where it came from, if the machine has it.
fn kernel_config(release: &str) -> Option<(String, String)> {
    if Path::new("/proc/config.gz").is_file() {
        let out = Command::new("zcat").arg("/proc/config.gz").output().ok()?;
        if out.status.success() {
            return Some((String::from_utf8_lossy(&out.stdout).into_owned(), "/proc/config.gz".to_owned()));
        }
    }
    let boot = format!("/boot/config-{release}");
    std::fs::read_to_string(&boot).ok().map(|c| (c, boot))
}

/// `yes (…)`, `no (…)` or `unknown (…)` for a probe type, from tracefs then the kernel config.
fn probe_support(tracefs: Option<&Path>, events: &str, config: Option<&(String, String)>, option: &str) -> String {
    if let Some(t) = tracefs
        && t.join(events).exists()
    {
        return format!("yes ({})", t.join(events).display());
    }
    let in_tracefs = match tracefs {
        Some(t) => format!("no {events} in {}", t.display()),
        None => "tracefs not mounted".to_owned(),
    };
    match config.map(|(text, from)| (config_says(text, option), from)) {
        Some((Some(true), from)) => format!("yes ({option} in {from}; {in_tracefs})"),
        Some((Some(false), from)) => format!("no ({option} is not set in {from})"),
        Some((None, from)) => format!("unknown ({in_tracefs}; {from} does not mention {option})"),
        None => format!("unknown ({in_tracefs}; no /proc/config.gz or /boot/config-*)"),
    }
}

/// The lines to print, `(label, text)`.
pub fn report() -> Vec<(&'static str, String)> {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo_field(&info, "model name").unwrap_or("unknown (no model name in /proc/cpuinfo)");
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mem_gib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        })
        .map_or("unknown memory".to_owned(), |kb| format!("{:.1} GiB", kb / 1048576.0));
    let flags = cpu_flags();
    let isa: Vec<String> =
        ISA_FLAGS.iter().map(|f| format!("{}{f}", if flags.contains(*f) { '+' } else { '-' })).collect();
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim().to_owned();
    let mounts = parse_mounts(&std::fs::read_to_string("/proc/self/mounts").unwrap_or_default());
    let cgroup = cgroup_line(&mounts, |p| std::fs::read_to_string(p.join("cgroup.controllers")).ok());
    let tracefs = mounts.iter().find(|m| m.fstype == "tracefs").map(|m| m.point.clone());
    let config = kernel_config(&release);
    let btf =
        if Path::new("/sys/kernel/btf/vmlinux").exists() { "yes" } else { "no (/sys/kernel/btf/vmlinux missing)" };
    vec![
        ("cpu", format!("{model}; {cpus} CPUs; {mem_gib}")),
        ("isa", isa.join(" ")),
        ("kernel", if release.is_empty() { "unknown".to_owned() } else { release.clone() }),
        ("cgroup", cgroup),
        ("btf", btf.to_owned()),
        ("tracefs", tracefs.as_ref().map_or("not mounted".to_owned(), |t| format!("mounted at {}", t.display()))),
        ("uprobes", probe_support(tracefs.as_deref(), "uprobe_events", config.as_ref(), "CONFIG_UPROBE_EVENTS")),
        ("kprobes", probe_support(tracefs.as_deref(), "kprobe_events", config.as_ref(), "CONFIG_KPROBES")),
        ("fentry", "unknown (not tested: only loading a tracing program would tell)".to_owned()),
    ]
}

/// Prints [`report`] under a heading, one `label: text` line each.
pub fn print(who: &str) {
    eprintln!("{who}: this machine:");
    for (label, text) in report() {
        eprintln!("  {label:<8} {text}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HYBRID: &str = "sysfs /sys sysfs rw,nosuid 0 0
tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0
cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0
cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
tracefs /sys/kernel/tracing tracefs rw,relatime 0 0
";

    #[test]
    fn cgroup_v1_memory_in_a_hybrid_layout() {
        let m = parse_mounts(HYBRID);
        assert_eq!(
            cgroup_line(&m, |_| Some("hugetlb".into())),
            "hybrid (v1 hierarchies, v2 at /sys/fs/cgroup/unified); memory controller v1 at /sys/fs/cgroup/memory"
        );
    }

    #[test]
    fn cgroup_v2_memory_from_its_controllers() {
        let m = parse_mounts("cgroup2 /sys/fs/cgroup cgroup2 rw,nsdelegate 0 0\n");
        assert_eq!(
            cgroup_line(&m, |p| (p == Path::new("/sys/fs/cgroup")).then(|| "cpuset cpu io memory pids".into())),
            "v2; memory controller v2 at /sys/fs/cgroup (in its cgroup.controllers)"
        );
        assert!(
            cgroup_line(&m, |_| Some("cpu io".into()))
                .ends_with("not bound (no v1 memory hierarchy, no v2 cgroup.controllers listing memory)")
        );
    }

    #[test]
    fn kernel_config_lines() {
        let c = "CONFIG_UPROBE_EVENTS=y\n# CONFIG_KPROBES is not set\nCONFIG_KPROBES_ON_FTRACE=y\n";
        assert_eq!(config_says(c, "CONFIG_UPROBE_EVENTS"), Some(true));
        assert_eq!(config_says(c, "CONFIG_KPROBES"), Some(false));
        assert_eq!(config_says(c, "CONFIG_FPROBE"), None);
        let cfg = (c.to_owned(), "/proc/config.gz".to_owned());
        assert_eq!(
            probe_support(None, "kprobe_events", Some(&cfg), "CONFIG_KPROBES"),
            "no (CONFIG_KPROBES is not set in /proc/config.gz)"
        );
    }

    #[test]
    fn cpuinfo_fields() {
        let info = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\nflags\t\t: fpu avx2 avx512f\n";
        assert_eq!(cpuinfo_field(info, "model name"), Some("Intel(R) Xeon(R) Processor"));
        assert_eq!(cpuinfo_field(info, "flags"), Some("fpu avx2 avx512f"));
    }
}
