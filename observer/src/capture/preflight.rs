//! Checks made before anything is loaded, each failing with one line that names
//! the problem and the fix.

use std::path::Path;

use anyhow::{Result, bail};

const CAP_SYS_ADMIN: u32 = 21;
const CAP_PERFMON: u32 = 38;
const CAP_BPF: u32 = 39;

/// Effective capability set of this process, from `/proc/self/status`.
fn effective_caps() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("CapEff:"))?;
    u64::from_str_radix(line.trim_start_matches("CapEff:").trim(), 16).ok()
}

/// eBPF tracing needs CAP_BPF + CAP_PERFMON (or CAP_SYS_ADMIN, as root has).
pub fn check_privileges() -> Result<()> {
    let caps = effective_caps().unwrap_or(0);
    let has = |c: u32| caps & (1u64 << c) != 0;
    if has(CAP_SYS_ADMIN) || (has(CAP_BPF) && has(CAP_PERFMON)) {
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
