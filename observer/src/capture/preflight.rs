//! Checks made before anything is loaded, each failing with one line that names
//! the problem and the fix.

use std::path::Path;

use anyhow::{Result, bail};

/// Capability numbers (linux/capability.h).
pub const CAP_FOWNER: u32 = 3;
const CAP_SYS_ADMIN: u32 = 21;
const CAP_PERFMON: u32 = 38;
const CAP_BPF: u32 = 39;

/// The effective capability set of this process (`CapEff:` of `/proc/self/status`, read by
/// procfs), as a mask of `1 << cap`; empty when that cannot be read.
pub fn effective_capabilities() -> u64 {
    procfs::process::Process::myself().and_then(|me| me.status()).map_or(0, |s| s.capeff)
}

/// Whether this process has capability `cap` in its effective set; no when that cannot be read.
pub fn has_capability(cap: u32) -> bool {
    effective_capabilities() & (1u64 << cap) != 0
}

/// Whether this process has what eBPF tracing needs: CAP_BPF + CAP_PERFMON (or CAP_SYS_ADMIN,
/// as root has).
pub fn privileged() -> bool {
    has_capability(CAP_SYS_ADMIN) || (has_capability(CAP_BPF) && has_capability(CAP_PERFMON))
}

/// What to do when the kernel refused an eBPF operation with EPERM or EACCES: the missing
/// privileges when this process lacks them; else the causes that refuse a privileged process.
pub fn permission_hint() -> &'static str {
    if privileged() {
        "this process has CAP_BPF and CAP_PERFMON, so the kernel refused for another reason: kernel lockdown \
         (`cat /sys/kernel/security/lockdown`: integrity or confidentiality forbid eBPF tracing), a security \
         module (SELinux, AppArmor), or RLIMIT_MEMLOCK before Linux 5.11 (`ulimit -l unlimited`)"
    } else {
        "run as root, or grant CAP_BPF and CAP_PERFMON (e.g. `sudo setcap cap_bpf,cap_perfmon+ep $(command -v observer)`)"
    }
}

/// eBPF tracing needs CAP_BPF + CAP_PERFMON (or CAP_SYS_ADMIN, as root has).
pub fn check_privileges() -> Result<()> {
    if privileged() {
        return Ok(());
    }
    bail!(
        "observer needs root or CAP_BPF+CAP_PERFMON to load eBPF programs: run it with sudo, or `sudo setcap cap_bpf,cap_perfmon,cap_dac_read_search+ep $(command -v observer)`"
    )
}

/// The tracing filesystem, where tracepoint IDs and formats live. Mounted here
/// when missing (root only).
pub const TRACEFS: &str = "/sys/kernel/tracing";

pub fn ensure_tracefs() -> Result<()> {
    if Path::new(TRACEFS).join("events").is_dir() {
        return Ok(());
    }
    let src = c"tracefs";
    let dst = c"/sys/kernel/tracing";
    // SAFETY: valid NUL-terminated strings, no data argument.
    let rc = unsafe { libc::mount(src.as_ptr(), dst.as_ptr(), src.as_ptr(), 0, std::ptr::null()) };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        bail!(
            "tracefs is not mounted at {TRACEFS} and mounting it failed ({e}): run `sudo mount -t tracefs tracefs {TRACEFS}`"
        );
    }
    Ok(())
}

/// Whether a tracepoint exists on this kernel (tracefs must be mounted).
pub fn tracepoint_exists(category: &str, name: &str) -> bool {
    Path::new(TRACEFS).join("events").join(category).join(name).is_dir()
}

/// Whether the running kernel (or a loaded module) has a function of this name, from
/// `/proc/kallsyms` (names are listed even where addresses are hidden).
/// Hand-read: the procfs crate has no parser for `/proc/kallsyms`.
pub fn kernel_function_exists(name: &str) -> bool {
    std::fs::read_to_string("/proc/kallsyms")
        .is_ok_and(|s| s.lines().any(|l| l.split_whitespace().nth(2) == Some(name)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_effective_set_is_what_capget_says() {
        // Independent source: capget(2), version 3 (two 32-bit words).
        #[repr(C)]
        struct Header {
            version: u32,
            pid: i32,
        }
        #[repr(C)]
        #[derive(Clone, Copy, Default)]
        struct Data {
            effective: u32,
            permitted: u32,
            inheritable: u32,
        }
        let mut h = Header { version: 0x2008_0522, pid: 0 };
        let mut d = [Data::default(); 2];
        // SAFETY: capget with a v3 header and room for its two data words.
        assert_eq!(unsafe { libc::syscall(libc::SYS_capget, &mut h, d.as_mut_ptr()) }, 0);
        let eff = u64::from(d[0].effective) | (u64::from(d[1].effective) << 32);
        assert_eq!(effective_capabilities(), eff);
        for cap in 0..64 {
            assert_eq!(has_capability(cap), eff & (1 << cap) != 0, "capability {cap}");
        }
    }

    #[test]
    fn kernel_functions_are_found_by_exact_name() {
        // Every kernel this runs on has vfs_read; no kernel has a function of this name.
        assert!(kernel_function_exists("vfs_read"));
        assert!(!kernel_function_exists("vfs_rea"));
        assert!(!kernel_function_exists("moe_observer_no_such_function"));
    }

    /// A privileged process refused by the kernel is not told to get the privileges it has.
    #[test]
    fn a_privileged_process_is_told_the_other_causes_of_a_refusal() {
        assert!(privileged(), "the tests run as root (cargo xtask test)");
        let h = permission_hint();
        assert!(!h.contains("run as root") && h.contains("lockdown") && h.contains("RLIMIT_MEMLOCK"), "{h}");
    }
}
