//! `cargo xtask vmtest`: the workspace's eBPF and cgroup tests on the kernels users run, each
//! booted under QEMU (TCG) from Debian's packages.
//!
//! For each kernel of the matrix ([`kernel::KERNELS`]): fetch its image and modules from Debian
//! (cached by version under `<cache>/vmtest/`, see [`debian`]), build an initramfs with busybox,
//! bpftool, the modules the tests need (zram, virtio) and the guest's `/init`, and an ext4 disk
//! with the observer, the engine, the test workloads and the test binaries at the paths they
//! were built for ([`image`]; an aarch64 guest's are cross-built, see [`Build`]); boot it with
//! a hard timeout ([`qemu`]); read one line per test back from the serial console
//! ([`plan`] specifies the protocol). Every planned test ends as `pass`, `fail` or
//! `not-runnable` (the kernel lacks a feature it needs, which the guest probed for real); a test
//! that never reported is a failure.
//! The command fails when any test failed; not-runnable tests are listed and counted.
//!
//! The tests are the repository's own (`observer/tests`, `memcg/tests/real.rs`, testkit's unit
//! tests), run unchanged: they compare the observer and the memcg crate with independent
//! sources on the same run, and on these kernels the memory controller is cgroup v2's.

mod cpio;
mod debian;
mod elf;
mod image;
mod kernel;
mod plan;
mod qemu;

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

use crate::{cache, cmd};
use kernel::{KERNELS, Kernel, KernelSpec};
use plan::{Feature, GuestTest, Outcome, Suite, TESTS};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    X86_64,
    Aarch64,
}

impl Arch {
    pub fn name(self) -> &'static str {
        match self {
            Arch::X86_64 => "x86_64",
            Arch::Aarch64 => "aarch64",
        }
    }

    /// Debian's name for it.
    pub fn debian(self) -> &'static str {
        match self {
            Arch::X86_64 => "amd64",
            Arch::Aarch64 => "arm64",
        }
    }

    pub fn triplet(self) -> &'static str {
        match self {
            Arch::X86_64 => "x86_64-linux-gnu",
            Arch::Aarch64 => "aarch64-linux-gnu",
        }
    }

    fn host() -> Option<Arch> {
        [Arch::X86_64, Arch::Aarch64].into_iter().find(|a| a.name() == std::env::consts::ARCH)
    }
}

const USAGE: &str = "usage: cargo xtask vmtest [OPTIONS]

Boots the kernels users run (Debian's packages, under QEMU with TCG) and runs the workspace's
eBPF and cgroup tests inside: one result per test and kernel (pass, fail, not-runnable).

  --kernel NAME   only this kernel (repeatable); `--list` shows them
  --all           every kernel of the matrix (default: those `--list` marks `default`)
  --arch ARCH     only the kernels of x86_64 or aarch64 (an aarch64 guest runs the workspace
                  cross-built for it, as `cargo xtask test --target aarch64` builds it)
  --smoke         the smoke subset on debian-6.1: boot, attach/detach, a fault count, a cgroup v2 limit
  --test TEXT     only the tests whose name contains TEXT (repeatable)
  --refresh       update the cached Debian package lists first (newer kernels, QEMU)
  --list          list the kernels and the tests with what each needs, and exit

Everything it downloads and builds is cached under ${XDG_CACHE_HOME:-~/.cache}/moe-observer/vmtest/;
each kernel's console is kept in runs/<kernel>/console.log there. At the end: one line per test
and kernel (outcome, its time in the guest), and the time of each phase. Every guest has a hard
timeout (boot plus each test's own limit, which the guest enforces per test).
";

struct Options {
    kernels: Vec<String>,
    all: bool,
    arch: Option<Arch>,
    smoke: bool,
    tests: Vec<String>,
    refresh: bool,
    list: bool,
}

fn parse(args: &[String]) -> Result<Options> {
    let mut o =
        Options { kernels: vec![], all: false, arch: None, smoke: false, tests: vec![], refresh: false, list: false };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = || it.next().with_context(|| format!("{a} needs a value\n\n{USAGE}"));
        match a.as_str() {
            "--kernel" => {
                let k = value()?;
                if !KERNELS.iter().any(|s| s.name == k) {
                    let names: Vec<&str> = KERNELS.iter().map(|s| s.name).collect();
                    bail!("unknown kernel `{k}`: the matrix has {}", names.join(", "));
                }
                o.kernels.push(k.clone());
            }
            "--arch" => {
                let v = value()?;
                o.arch = Some(match v.as_str() {
                    "x86_64" | "amd64" => Arch::X86_64,
                    "aarch64" | "arm64" => Arch::Aarch64,
                    _ => bail!("--arch {v}: x86_64 or aarch64"),
                });
            }
            "--test" => o.tests.push(value()?.clone()),
            "--smoke" => o.smoke = true,
            "--all" => o.all = true,
            "--refresh" => o.refresh = true,
            "--list" => o.list = true,
            "-h" | "--help" => {
                print!("{USAGE}");
                std::process::exit(0);
            }
            _ => bail!("unknown option `{a}`\n\n{USAGE}"),
        }
    }
    Ok(o)
}

/// The smoke subset runs on this kernel.
const SMOKE_KERNEL: &str = "debian-6.1";

pub fn main(args: &[String]) -> Result<()> {
    let o = parse(args)?;
    if o.list {
        list();
        return Ok(());
    }
    let kernels: Vec<KernelSpec> = KERNELS
        .iter()
        .filter(|k| if o.kernels.is_empty() { o.all || k.default } else { o.kernels.iter().any(|n| n == k.name) })
        .filter(|k| o.arch.is_none_or(|a| a == k.arch))
        .filter(|k| !o.smoke || !o.kernels.is_empty() || k.name == SMOKE_KERNEL)
        .copied()
        .collect();
    let tests: Vec<GuestTest> = TESTS
        .iter()
        .filter(|t| !o.smoke || t.smoke)
        .filter(|t| o.tests.is_empty() || o.tests.iter().any(|s| t.name().contains(s.as_str())))
        .copied()
        .collect();
    if kernels.is_empty() {
        bail!("no kernel of the matrix matches the options (see --list)");
    }
    if tests.is_empty() {
        bail!("no test matches --test {}", o.tests.join(" --test "));
    }
    let start = Instant::now();
    let mut phases = Phases::default();
    let vmtest_dir = cache::dir()?.join("vmtest");
    let apt = phases.time("Debian package lists", || debian::Apt::open(&vmtest_dir, o.refresh))?;
    let mut builds: Vec<Build> = Vec::new();
    for arch in [Arch::X86_64, Arch::Aarch64] {
        if kernels.iter().any(|k| k.arch == arch) {
            let what = format!("workspace build for {} (release binaries, test binaries)", arch.name());
            builds.push(phases.time(&what, || Build::make(&tests, arch))?);
        }
    }
    // One guest at a time on this machine, whoever starts it (two `xtask test` runs, or a helper's
    // vmtest beside the suite's smoke phase): they share the cache's run directories, and two
    // TCG guests on a small machine would each take twice as long.
    let _lock = phases.time("waiting for other vmtest runs on this machine", || lock_guests(&vmtest_dir))?;
    let mut runs = Vec::new();
    for spec in kernels {
        let build = builds.iter().find(|b| b.arch == spec.arch);
        let run = run_kernel(&apt, &vmtest_dir, spec, &tests, build, &mut phases)
            .with_context(|| format!("kernel {}", spec.name))?;
        runs.push(run);
    }
    print_results(&runs);
    phases.print(start.elapsed());
    let failed: usize = runs.iter().map(|r| r.count(Outcome::Fail)).sum();
    if failed > 0 {
        bail!("{failed} guest test(s) failed (consoles: {})", vmtest_dir.join("runs").display());
    }
    Ok(())
}

fn list() {
    println!("kernels:");
    for k in KERNELS {
        let default = if k.default { "default" } else { "" };
        println!("  {:<18} {:<8} {default:<8} {} ({})", k.name, k.arch.name(), k.about, k.meta);
    }
    println!("\n(default: the kernels `cargo xtask vmtest` runs without --kernel or --all)");
    println!("\nfeatures the guest probes: {}", Feature::ALL.map(Feature::name).join(", "));
    println!("\ntests (timeout, needs; * = smoke):");
    for t in TESTS {
        let needs: Vec<&str> = t.needs.iter().map(|f| f.name()).collect();
        println!("  {} {} ({} s; {})", if t.smoke { "*" } else { " " }, t.name(), t.timeout_s, needs.join(", "));
    }
}

/// The workspace built for a guest's architecture: the binaries the tests run and the test
/// binaries. For this machine's architecture, in cargo's target directory; for aarch64 on an
/// x86-64 host, cross-built as `cargo xtask test --target aarch64` builds (`cross.rs`: Debian's
/// rustc with its aarch64 std, linked by `aarch64-linux-gnu-gcc`) into `target/cross`. The
/// observer's eBPF object is `bpfel` either way; `observer/build.rs` compiles it for the target's
/// register layout (`AYA_BPF_TARGET_ARCH` from the target's arch).
struct Build {
    arch: Arch,
    /// The target directory: the guest mounts its disk here, so the paths compiled into the test
    /// binaries (`CARGO_BIN_EXE_*`, `CARGO_TARGET_TMPDIR`) hold inside.
    target_dir: PathBuf,
    /// The directory of the release binaries (and of the fixtures, `MOE_FIXTURES_DIR`).
    bin_dir: PathBuf,
    /// observer, workload, resid_standin, engine.
    bins: Vec<PathBuf>,
    exes: BTreeMap<Suite, PathBuf>,
}

impl Build {
    fn make(tests: &[GuestTest], arch: Arch) -> Result<Build> {
        let root = cache::workspace_root();
        let native = Some(arch) == Arch::host();
        let (target_dir, env, target_args): (PathBuf, Vec<(&str, String)>, Vec<&str>) = if native {
            (cache::target_dir(), Vec::new(), Vec::new())
        } else if arch == Arch::Aarch64 && Arch::host() == Some(Arch::X86_64) {
            crate::cross::packages()?;
            let dir = crate::cross::target_dir();
            let env = crate::cross::cargo_env(&dir);
            (dir, env, vec!["--target", crate::cross::TRIPLE])
        } else {
            bail!("no build of the workspace for {} on this {} machine", arch.name(), std::env::consts::ARCH);
        };
        let bin_dir =
            if native { target_dir.join("release") } else { target_dir.join(crate::cross::TRIPLE).join("release") };
        // The fixtures too: the guest has no cargo to build them (`fixtures::binary`). For this
        // machine the packages are the workspace, as `cargo xtask test` selects them, so that
        // features unify as there and its smoke phase finds everything built; a cross build takes
        // only what the guest runs.
        let packages: &[&str] =
            if native { &["--workspace"] } else { &["-p", "observer", "-p", "engine", "-p", "fixtures"] };
        cmd::run(
            Command::new("cargo")
                .current_dir(&root)
                .envs(env.iter().map(|(k, v)| (k, v)))
                .args(["build", "--release", "--bins"])
                .args(packages)
                .args(&target_args),
        )?;
        let bins: Vec<PathBuf> =
            ["observer", "workload", "resid_standin", "engine"].iter().map(|b| bin_dir.join(b)).collect();
        let mut exes = BTreeMap::new();
        let mut suites: Vec<Suite> = tests.iter().map(|t| t.suite).collect();
        suites.sort();
        suites.dedup();
        for s in suites {
            let mut c = Command::new("cargo");
            c.current_dir(&root)
                .envs(env.iter().map(|(k, v)| (k, v)))
                .args(["test", "--release", "--no-run", "--message-format=json"])
                .args(&target_args);
            match s.target() {
                // `--workspace --test NAME` builds what `cargo test --workspace` builds for it.
                Some(t) if native => c.args(["--workspace", "--test", t]),
                Some(t) => c.args(["-p", s.package(), "--test", t]),
                None => c.args(["-p", s.package(), "--lib"]),
            };
            eprintln!("+ cargo test --release --no-run -p {} ({}, {})", s.package(), s.label(), arch.name());
            let out = c.stderr(std::process::Stdio::inherit()).output().context("running cargo test --no-run")?;
            if !out.status.success() {
                bail!("building the test binary of {} for {} failed", s.label(), arch.name());
            }
            let exe = String::from_utf8_lossy(&out.stdout)
                .lines()
                .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                .filter(|v| v["reason"] == "compiler-artifact" && v["profile"]["test"] == true)
                .filter(|v| v["target"]["name"] == s.target().unwrap_or(s.package()))
                .find_map(|v| v["executable"].as_str().map(PathBuf::from))
                .with_context(|| format!("cargo named no test executable for {}", s.label()))?;
            exes.insert(s, exe);
        }
        // A test the binary does not have is an error now, not a silent `0 passed` in the guest.
        // (A cross-built binary lists its tests under qemu-user.)
        for (s, exe) in &exes {
            let mut list = if native {
                Command::new(exe)
            } else {
                let mut c = Command::new(crate::cross::QEMU);
                c.arg(exe);
                c
            };
            let listed = cmd::output(list.args(["--list", "--format", "terse"]))?;
            for t in tests.iter().filter(|t| t.suite == *s) {
                if !listed.lines().any(|l| l == format!("{}: test", t.test)) {
                    bail!("{} has no test `{}`: update xtask/src/vmtest/plan.rs", exe.display(), t.test);
                }
            }
        }
        Ok(Build { arch, target_dir, bin_dir, bins, exes })
    }

    /// The command that runs `t` in the guest, in its package's directory as cargo would.
    fn command(&self, t: &GuestTest) -> String {
        let dir = cache::workspace_root().join(t.suite.package());
        format!(
            "mkdir -p {dir} && cd {dir} && exec {exe} --exact --test-threads=1 {name}",
            dir = dir.display(),
            exe = self.exes[&t.suite].display(),
            name = t.test
        )
    }
}

/// How long each phase took, in order, for the end of the run.
#[derive(Default)]
struct Phases(Vec<(String, Duration)>);

impl Phases {
    fn time<T>(&mut self, name: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let t = Instant::now();
        let r = f();
        self.0.push((name.to_string(), t.elapsed()));
        eprintln!("vmtest: {name}: {:.1} s", t.elapsed().as_secs_f64());
        r
    }

    fn print(&self, total: Duration) {
        println!("\nphases:");
        for (name, d) in &self.0 {
            println!("  {:>7.1} s  {name}", d.as_secs_f64());
        }
        println!("  {:>7.1} s  total", total.as_secs_f64());
    }
}

/// What one kernel gave.
struct Run {
    spec: KernelSpec,
    package: String,
    release: String,
    elapsed: Duration,
    features: BTreeMap<String, (bool, String)>,
    results: Vec<(String, Outcome, String)>,
    log: PathBuf,
}

impl Run {
    fn count(&self, o: Outcome) -> usize {
        self.results.iter().filter(|r| r.1 == o).count()
    }
}

/// Programs the tests run that busybox lacks or has with fewer options (`swapon -p`, `dd
/// iflag=nocache`, `nice`): util-linux's, coreutils' `dd` and `nice`, and perf (the tests' independent fault
/// counter). A guest of this machine's architecture gets this machine's; another architecture's
/// guest gets them from the Debian package named here.
const TOOLS: [(&str, &str); 7] = [
    ("fincore", "util-linux-extra"),
    ("dd", "coreutils"),
    ("nice", "coreutils"),
    ("mkswap", "util-linux"),
    ("swapon", "mount"),
    ("swapoff", "mount"),
    ("perf", "linux-perf"),
];

/// `tool` (an ELF program) from Debian's `package` for `arch`, unpacked in the cache.
fn debian_tool(apt: &debian::Apt, arch: Arch, tool: &str, package: &str) -> Result<PathBuf> {
    let p = apt.candidate(&format!("{package}:{}", arch.debian()), None)?;
    let dir = apt.unpacked(&p)?;
    let is_elf = |f: &Path| std::fs::read(f).is_ok_and(|d| d.starts_with(b"\x7fELF"));
    ["usr/bin", "usr/sbin", "bin", "sbin"]
        .iter()
        .map(|d| dir.join(d).join(tool))
        .find(|f| is_elf(f))
        .with_context(|| format!("{} {} ({}) has no program {tool}", p.name, p.version, arch.debian()))
}

/// Holds `<vmtest>/guest.lock` (flock) until dropped: one vmtest guest at a time on this machine.
fn lock_guests(vmtest_dir: &Path) -> Result<std::fs::File> {
    use std::os::fd::AsRawFd;
    let path = vmtest_dir.join("guest.lock");
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    // SAFETY: flock on a file descriptor we own.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        eprintln!("vmtest: another vmtest guest runs on this machine ({} is held): waiting for it", path.display());
        // SAFETY: as above, blocking.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
            bail!("locking {}: {}", path.display(), std::io::Error::last_os_error());
        }
    }
    Ok(f)
}

fn which(prog: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).chain(["/usr/sbin".into(), "/sbin".into()]).map(|d| d.join(prog)).find(|p| p.is_file())
}

/// Modules the guest loads: the payload disk's driver and file system, and zram (with lz4,
/// testkit's choice). Those the kernel has built in are skipped.
fn wanted_modules(arch: Arch) -> &'static [&'static str] {
    match arch {
        Arch::X86_64 => &["virtio_pci", "virtio_blk", "ext4", "zram", "lz4"],
        // `-M virt`: the disk is virtio-blk on PCIe or on virtio-mmio, whichever QEMU picks.
        Arch::Aarch64 => &["virtio_mmio", "virtio_pci", "virtio_blk", "ext4", "zram", "lz4"],
    }
}

fn run_kernel(
    apt: &debian::Apt,
    vmtest_dir: &Path,
    spec: KernelSpec,
    tests: &[GuestTest],
    build: Option<&Build>,
    phases: &mut Phases,
) -> Result<Run> {
    let (kernel, qemu) = phases.time(&format!("{}: kernel and QEMU packages (fetch, unpack)", spec.name), || {
        let kernel = Kernel::get(apt, spec)?;
        eprintln!("vmtest: {} = {} {} ({})", spec.name, kernel.pkg.name, kernel.pkg.version, kernel.release);
        Ok((kernel, qemu::Qemu::get(apt, vmtest_dir, spec.arch)?))
    })?;
    let image_start = Instant::now();
    let run_dir = vmtest_dir.join("runs").join(spec.name);
    std::fs::create_dir_all(&run_dir)?;
    let arch = spec.arch;
    let native = Some(arch) == Arch::host();
    let mut b = image::Builder::new(if native { image::Libs::Host } else { image::Libs::Debian(apt, arch) });

    let busybox = apt.unpacked(&apt.candidate(&format!("busybox-static:{}", arch.debian()), None)?)?;
    b.file("bin/busybox", std::fs::read(busybox.join("bin/busybox"))?, 0o755);
    b.archive.add("bin/sh", cpio::Entry::Symlink("busybox".into()));
    // bpftool from backports (7.5): `prog loadall … autoattach` attaches the feature probes.
    let bpftool = apt.unpacked(&apt.candidate(&format!("bpftool:{}", arch.debian()), Some("bookworm-backports"))?)?;
    b.program(&bpftool.join("usr/sbin/bpftool"), "usr/sbin/bpftool")?;
    for kind in ["kprobe", "fentry"] {
        b.file(&format!("vmtest/bpf/{kind}.o"), elf::probe_object(kind)?, 0o644);
    }
    b.file("init", include_bytes!("init.sh").to_vec(), 0o755);
    b.file(&format!("boot/config-{}", kernel.release), std::fs::read(&kernel.config)?, 0o644);
    b.file(
        "etc/passwd",
        b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n".to_vec(),
        0o644,
    );
    b.file("etc/group", b"root:x:0:\nnogroup:x:65534:\n".to_vec(), 0o644);
    let (loaded, absent) = b.modules(&kernel, wanted_modules(arch))?;
    eprintln!(
        "vmtest: modules {} (absent: {})",
        loaded.join(" "),
        if absent.is_empty() { "none".into() } else { absent.join(" ") }
    );

    let lib_path = format!("/lib/{t}:/usr/lib/{t}", t = arch.triplet());
    let (env, host_features, plan, disk) = match build {
        Some(build) => {
            for (tool, package) in TOOLS {
                let path = if native {
                    which(tool)
                        .with_context(|| format!("`{tool}` is not on this machine's PATH: run `cargo xtask setup`"))?
                } else {
                    debian_tool(apt, arch, tool, package)?
                };
                b.program(&path, &format!("usr/sbin/{tool}")).with_context(|| format!("{tool} for the guest"))?;
            }
            let mut files = Vec::new();
            for f in build.bins.iter().chain(build.exes.values()) {
                b.libraries_of(f)?;
                let rel = f
                    .strip_prefix(&build.target_dir)
                    .with_context(|| format!("{} outside the target dir", f.display()))?;
                files.push((f.clone(), rel.to_path_buf()));
            }
            let disk = run_dir.join("disk.img");
            let bytes = image::disk(&disk, &run_dir.join("staging"), &files, 6)?;
            eprintln!("vmtest: disk {} with {} files, {} MiB", disk.display(), files.len(), bytes >> 20);
            let env = format!(
                "VMTEST_DISK_AT={}\nLD_LIBRARY_PATH={lib_path}\nMOE_FIXTURES_DIR={}\n",
                build.target_dir.display(),
                build.bin_dir.display()
            );
            let feat = format!(
                "build yes the workspace's release binaries and {} test binaries for {}{}\n",
                build.exes.len(),
                arch.name(),
                if native { "" } else { " (cross-built)" }
            );
            (env, feat, plan::plan_text(tests, |t| build.command(t)), Some(disk))
        }
        None => {
            let env = format!("VMTEST_DISK_AT=\nLD_LIBRARY_PATH={lib_path}\n");
            let feat = format!("build no no {} build of the workspace was made for this run\n", arch.name());
            (env, feat, plan::plan_text(tests, |_| "exit 1".into()), None)
        }
    };
    b.file("vmtest/env", env.into_bytes(), 0o644);
    b.file("vmtest/host-features", host_features.into_bytes(), 0o644);
    b.file("vmtest/plan", plan.into_bytes(), 0o644);
    let initrd = run_dir.join("initramfs.cpio");
    let size = b.write(&initrd)?;
    eprintln!("vmtest: initramfs {} MiB", size >> 20);
    phases.0.push((format!("{}: initramfs and disk image", spec.name), image_start.elapsed()));

    // Boot and feature probes (10 s to a minute under TCG) plus every test's own limit, when
    // they can run at all.
    let test_limits: u64 = if build.is_some() { tests.iter().map(|t| u64::from(t.timeout_s)).sum() } else { 0 };
    let timeout = Duration::from_secs(240 + test_limits);
    let log = run_dir.join("console.log");
    let boot_spec = qemu::BootSpec {
        arch,
        kernel: kernel.image.clone(),
        initrd,
        disk,
        append: String::new(),
        mem_mib: 2048,
        cpus: 2,
        timeout,
        log: log.clone(),
    };
    eprintln!(
        "vmtest: booting {} (QEMU {}, TCG, timeout {} s; console in {})",
        spec.name,
        qemu.version,
        timeout.as_secs(),
        log.display()
    );
    let name = spec.name;
    let show = |l: &str| {
        if ["VMTEST", "VMFEATURE", "VMINFO", "Kernel panic"].iter().any(|k| l.contains(k)) {
            eprintln!("[{name}] {l}");
        }
    };
    let mut boot = qemu.boot(&boot_spec, show)?;
    let mut report = plan::Report::parse(&boot.console);
    if panicked_before_init(&boot.console, &report) {
        // QEMU's TCG sometimes runs a vCPU into a breakpoint of the kernel's live text patching
        // (`Oops: int3` in the boot's static-key updates, seen with Debian's 6.12 under QEMU 7.2):
        // the guest never reached /init, so nothing was tested. Once more, and said.
        let first = run_dir.join("console-panicked.log");
        std::fs::rename(&log, &first).with_context(|| format!("keeping {}", log.display()))?;
        eprintln!(
            "vmtest: {name}: the kernel panicked before /init ran (console kept in {}); booting once more",
            first.display()
        );
        phases.0.push((format!("{name}: QEMU (a boot that panicked before /init)"), boot.elapsed));
        boot = qemu.boot(&boot_spec, show)?;
        report = plan::Report::parse(&boot.console);
    }
    phases.0.push((format!("{}: QEMU (boot, feature probes, tests)", spec.name), boot.elapsed));
    let why = if boot.timed_out {
        format!("QEMU was killed at the {} s timeout", timeout.as_secs())
    } else if !report.ended {
        format!(
            "the guest stopped after {:.0} s without finishing the plan ({})",
            boot.elapsed.as_secs_f64(),
            boot.status
        )
    } else {
        "the guest skipped it".to_string()
    };
    if !report.ended {
        let lines: Vec<&str> = boot.console.lines().collect();
        eprintln!("vmtest: {why}; the console's last lines:");
        for l in &lines[lines.len().saturating_sub(40)..] {
            eprintln!("  | {l}");
        }
    }
    // The guest's clock against this machine's: the guest's uptime at the end against QEMU's
    // life (which also holds QEMU's start and the firmware, so the guest's is a little less).
    if let Some((_, up)) = report.info.iter().find(|(k, _)| k == "uptime") {
        eprintln!(
            "vmtest: {}: guest clock {up} s of uptime in {:.1} s of QEMU's life",
            spec.name,
            boot.elapsed.as_secs_f64()
        );
    }
    let planned: Vec<String> = tests.iter().map(GuestTest::name).collect();
    let results = report.reconcile(&planned, &why);
    for (name, text) in &report.logs {
        eprintln!("---- {name} (end of its output in the guest)\n{text}----");
    }
    Ok(Run {
        spec,
        package: format!("{} {}", kernel.pkg.name, kernel.pkg.version),
        release: kernel.release,
        elapsed: boot.elapsed,
        features: report.features,
        results,
        log,
    })
}

/// The kernel panicked before the guest's /init reported its boot: a failure of the emulator or
/// the kernel's start, before anything of ours ran.
fn panicked_before_init(console: &str, report: &plan::Report) -> bool {
    console.contains("Kernel panic") && !report.results.iter().any(|(n, ..)| n == "boot")
}

fn print_results(runs: &[Run]) {
    for r in runs {
        println!(
            "\n== {} ({}): {}, {} — {:.0} s in QEMU",
            r.spec.name,
            r.spec.arch.name(),
            r.package,
            r.release,
            r.elapsed.as_secs_f64()
        );
        let feats: Vec<String> =
            r.features.iter().map(|(n, (ok, _))| format!("{n} {}", if *ok { "yes" } else { "NO" })).collect();
        println!("features: {}", feats.join(", "));
        for (n, (ok, d)) in &r.features {
            if !ok {
                println!("  {n}: {d}");
            }
        }
        for (name, o, detail) in &r.results {
            println!("  {:<13} {name}  {detail}", o.word());
        }
        println!(
            "{}: {} passed, {} failed, {} not runnable (console: {})",
            r.spec.name,
            r.count(Outcome::Pass),
            r.count(Outcome::Fail),
            r.count(Outcome::NotRunnable),
            r.log.display()
        );
    }
    if !runs.is_empty() {
        println!("\nresults (P pass, F fail, - not runnable):");
        let names: Vec<&str> = runs[0].results.iter().map(|r| r.0.as_str()).collect();
        println!("  {}  test", runs.iter().map(|r| format!("{:<18}", r.spec.name)).collect::<String>());
        for n in names {
            let cells: String = runs
                .iter()
                .map(|r| {
                    let c = match r.results.iter().find(|x| x.0 == n).map(|x| x.1) {
                        Some(Outcome::Pass) => "P",
                        Some(Outcome::Fail) => "F",
                        Some(Outcome::NotRunnable) => "-",
                        None => "?",
                    };
                    format!("{c:<18}")
                })
                .collect();
            println!("  {cells}  {n}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_panic_before_init_reported_its_boot_is_booted_again() {
        let panic = "[    2.1] Oops: int3: 0000 [#1] PREEMPT SMP NOPTI\n[    2.2] Kernel panic - not syncing: Fatal exception\n";
        assert!(panicked_before_init(panic, &plan::Report::parse(panic)));
        let later = format!("VMTEST boot pass 6.12 up, init at 4.5 s\n{panic}");
        assert!(
            !panicked_before_init(&later, &plan::Report::parse(&later)),
            "a panic in a test is that test's failure"
        );
        let silent = "[    2.1] random: crng init done\n";
        assert!(!panicked_before_init(silent, &plan::Report::parse(silent)));
    }
}
