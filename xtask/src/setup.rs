//! `cargo xtask setup`: install and check, idempotently, what building the eBPF
//! programs and running the tests need on a Debian machine, as root:
//!
//! 0. Print what this machine is (`detect.rs`: CPU, ISA flags, kernel, cgroups, probes).
//! 1. Debian packages: `rustc-web` + `libstd-rust-web-dev-bpf` (rustc 1.96 with a
//!    precompiled `core` for `bpfel-unknown-none`, so no `build-std`),
//!    `llvm-22-dev` (for bpf-linker), and the test tools (bpftool, bpftrace,
//!    perf, tmux, cmake, ccache, binutils).
//! 2. `bpf-linker` 0.13.0 built against LLVM 22 into `~/.cargo/bin`.
//! 3. tracefs mounted at /sys/kernel/tracing.
//! 4. Kernel facts: BTF present, perf events usable.
//!
//! Each step says exactly what is wrong where it cannot work.

use std::{path::Path, process::Command};

use anyhow::{Context, Result, bail};

use crate::cmd;

#[derive(Debug, Clone, Copy)]
pub enum Scope {
    All,
}

pub const LLVM_BIN: &str = "/usr/lib/llvm-22/bin";
const BPF_LINKER_VERSION: &str = "0.13.0";

/// Debian packages and why each is needed.
const PACKAGES: &[(&str, &str)] = &[
    ("rustc-web", "rustc 1.96 that compiles the eBPF crate"),
    ("libstd-rust-web-dev-bpf", "precompiled core/alloc for bpfel-unknown-none"),
    ("llvm-22-dev", "LLVM 22, which bpf-linker links against"),
    ("bpftool", "inspecting loaded programs in tests"),
    ("bpftrace", "independent probes in tests"),
    ("linux-perf", "`perf stat` as an independent reference in tests"),
    ("tmux", "end-to-end TUI tests"),
    ("cmake", "building llama.cpp, the engine's reference"),
    ("ccache", "the two llama.cpp builds (avx2, best ISA) share every object but ggml-cpu's"),
    ("binutils", "objdump, for the check that no llama.cpp build contains AMX instructions"),
    ("prometheus", "a real Prometheus server and promtool for the exporter's tests"),
];

pub(crate) fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

pub(crate) fn is_debian() -> bool {
    let Ok(os) = std::fs::read_to_string("/etc/os-release") else { return false };
    os.lines().any(|l| {
        let l = l.trim();
        l == "ID=debian" || (l.starts_with("ID_LIKE=") && l.contains("debian"))
    }) && cmd::on_path("apt-get")
        && cmd::on_path("dpkg-query")
}

pub(crate) fn installed(pkg: &str) -> bool {
    cmd::capture(Command::new("dpkg-query").args(["-W", "-f=${Status}", pkg]))
        .map(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
        .unwrap_or(false)
}

fn packages() -> Result<()> {
    ensure_packages(PACKAGES, "bookworm-security carries rustc-web and llvm-22")
}

/// Installs the missing ones of `packages` (name, why) with apt-get, as root on Debian;
/// elsewhere says what to install. `hint` says where the packages come from when apt fails.
pub(crate) fn ensure_packages(packages: &[(&str, &str)], hint: &str) -> Result<()> {
    if !is_debian() {
        let names: Vec<&str> = packages.iter().map(|(p, _)| *p).collect();
        bail!(
            "this is not a Debian system (no ID=debian in /etc/os-release, or no apt-get): \
             install the equivalents of {} by hand, then re-run",
            names.join(", ")
        );
    }
    let missing: Vec<&(&str, &str)> = packages.iter().filter(|(p, _)| !installed(p)).collect();
    if missing.is_empty() {
        eprintln!("setup: Debian packages: all present");
        return Ok(());
    }
    let names: Vec<&str> = missing.iter().map(|(p, _)| *p).collect();
    if !is_root() {
        let why: Vec<String> = missing.iter().map(|(p, w)| format!("{p} ({w})")).collect();
        bail!("missing Debian packages: {}; run as root: `apt-get install -y {}`", why.join(", "), names.join(" "));
    }
    eprintln!("setup: installing {}", names.join(" "));
    cmd::run(Command::new("apt-get").args(["update", "-q"]))?;
    cmd::run(
        Command::new("apt-get")
            .env("DEBIAN_FRONTEND", "noninteractive")
            .args(["install", "-y", "-q", "--no-install-recommends"])
            .args(&names),
    )
    .with_context(|| format!("apt-get install failed: check the package sources ({hint})"))?;
    Ok(())
}

pub(crate) fn cargo_bin_dir() -> Result<std::path::PathBuf> {
    let home = std::env::var_os("CARGO_HOME")
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".cargo")))
        .context("neither CARGO_HOME nor HOME is set")?;
    Ok(home.join("bin"))
}

fn bpf_linker() -> Result<()> {
    let bin = cargo_bin_dir()?.join("bpf-linker");
    if bin.is_file() {
        let out = cmd::capture(Command::new(&bin).arg("--version"))?;
        let v = String::from_utf8_lossy(&out.stdout);
        if v.contains(BPF_LINKER_VERSION) {
            eprintln!("setup: bpf-linker {BPF_LINKER_VERSION}: present");
            return Ok(());
        }
        eprintln!("setup: bpf-linker is `{}`, want {BPF_LINKER_VERSION}: reinstalling", v.trim());
    }
    if !Path::new(LLVM_BIN).join("llvm-config").exists() {
        bail!("{LLVM_BIN}/llvm-config missing: the llvm-22-dev package is not installed correctly");
    }
    let path = format!("{LLVM_BIN}:{}", std::env::var("PATH").unwrap_or_default());
    eprintln!("setup: building bpf-linker {BPF_LINKER_VERSION} against LLVM 22 (1–2 minutes)");
    cmd::run(
        Command::new("cargo")
            .env("PATH", path)
            .args(["install", "bpf-linker", "--version", BPF_LINKER_VERSION, "--locked", "--force"])
            .args(["--no-default-features", "--features", "llvm-22"]),
    )
    .context("building bpf-linker failed (it needs llvm-22-dev and network access to crates.io)")
}

fn tracefs() -> Result<()> {
    if Path::new("/sys/kernel/tracing/events").is_dir() {
        eprintln!("setup: tracefs: mounted");
        return Ok(());
    }
    if !is_root() {
        bail!("tracefs is not mounted: run `sudo mount -t tracefs tracefs /sys/kernel/tracing`");
    }
    cmd::run(Command::new("mount").args(["-t", "tracefs", "tracefs", "/sys/kernel/tracing"]))
        .context("mounting tracefs failed: the kernel needs CONFIG_TRACING")
}

fn kernel_checks() -> Result<()> {
    if !Path::new("/usr/lib/rustlib/bpfel-unknown-none/lib").is_dir() {
        bail!("/usr/lib/rustlib/bpfel-unknown-none/lib missing: install libstd-rust-web-dev-bpf");
    }
    if Path::new("/sys/kernel/btf/vmlinux").exists() {
        eprintln!("setup: kernel BTF: present");
    } else {
        eprintln!(
            "setup: warning: /sys/kernel/btf/vmlinux is missing (kernel built without \
             CONFIG_DEBUG_INFO_BTF): the observer's programs do not need it, but bpftrace-based \
             tests and tools do"
        );
    }
    if !Path::new("/proc/sys/kernel/perf_event_paranoid").exists() {
        bail!("this kernel has no perf events (CONFIG_PERF_EVENTS): the observer cannot work here");
    }
    Ok(())
}

pub fn run(scope: Scope) -> Result<()> {
    let Scope::All = scope;
    if !cfg!(target_os = "linux") {
        bail!("the observer needs Linux");
    }
    crate::detect::print("setup");
    packages()?;
    bpf_linker()?;
    if is_root() {
        tracefs()?;
        // A DAMON test guard killed mid-test left the host's DAMON admin tree changed: put it back.
        if testkit::damon::recover()? {
            eprintln!("setup: DAMON admin tree restored from {}", testkit::damon::STATE_FILE);
        }
        // A direct-reclaim test guard killed mid-test left kswapd at SCHED_IDLE: put it back.
        if testkit::kswapd::recover()? {
            eprintln!("setup: kswapd's scheduling restored from {}", testkit::kswapd::STATE_FILE);
        }
    } else {
        eprintln!(
            "setup: not root: skipping the tracefs mount; the observer itself needs root (or CAP_BPF+CAP_PERFMON)"
        );
    }
    kernel_checks()?;
    eprintln!("setup: done");
    Ok(())
}
