//! QEMU from Debian's packages, unpacked into the cache (never installed: bookworm's
//! `qemu-system-x86` conflicts with the backports `qemu-utils` some machines have), and a boot
//! with a hard timeout.
//!
//! The tree `<cache>/vmtest/qemu/<version>/` holds `qemu-system-x86` or `qemu-system-arm`,
//! `qemu-system-common` (the TCG accelerator is a loadable module there), `qemu-system-data`
//! (option ROMs such as `linuxboot_dma.bin`) and `seabios`, and every shared library the
//! emulator needs that this machine lacks: `ldd` names it, Debian's naming rule gives its
//! package ([`debian::package_for_soname`]), until `ldd` finds everything. The emulator runs with
//! `LD_LIBRARY_PATH` and `QEMU_MODULE_DIR` pointing into the tree.
//!
//! Always TCG (`-accel tcg`): `/dev/kvm` on the development VM fails on `int3`, `xrstor` and
//! `cmpxchg16b` and then hangs. Always a hard timeout: the process is killed when it passes.
//! On x86_64 `tsc=reliable`: under TCG the kernel finds the vCPUs' TSCs "unsynchronized", falls
//! back to the HPET clocksource, and every `clock_gettime` becomes a system call (the vDSO cannot
//! read the HPET); a busy loop that reads the clock then spends 20 % of its time in the kernel
//! (measured: utime 1.17 s, stime 0.35 s of 1.52 s), which no user's machine does. TCG's TSC is
//! one host-time-based counter for all vCPUs, so it is synchronized and the flag is true.
//! Also `no_timer_check`: on a loaded host (load 19 on 2 cores) TCG ran the early boot so slowly
//! that 6.12's check that the IO-APIC timer ticks failed and it panicked ("IO-APIC + timer doesn't
//! work!"); the check is for broken chipsets, not for a virtual one.
//! Also `tsc_early_khz=`, this machine's TSC rate measured here (`host_tsc_khz`): under TCG the
//! guest's TSC is the host's, and the guest's own calibration of it (against the emulated PIT) is
//! wrong when the host is loaded. Measured: a 6.1 guest whose boot shared 2 cores with seven
//! builds counted 560 s of uptime in 178 s of QEMU's life, every guest clock 3.1 times too fast
//! (the tests still passed: they compare times on the guest's one clock, but their timeouts and
//! any real-time rate were wrong). The arm64 guest's counter has a fixed frequency (`CNTFRQ`).
//! On x86_64 `-accel tcg,thread=single` (both vCPUs on one host thread, in turn): with a thread
//! per vCPU, a vCPU sometimes ran a breakpoint of the kernel's live text patching after the patch
//! had finished (`Oops: int3` in `sched_clock_cpu` during the boot's static-key updates, and in
//! `__schedule` when a test's BPF program enabled the `sched_switch` tracepoint; Debian's 6.12
//! under QEMU 7.2, twice in three runs of the matrix), and the guest panicked. x86 patches live
//! code with `int3` and relies on the CPUs' coherence, which TCG's threads do not give at once.
//! On arm64 `-cpu max,pauth-impdef=on`: the architected pointer-authentication algorithm costs
//! TCG most of its time (an empty boot took 35 s against 9 s with the implementation-defined one).

use std::{
    io::{BufRead, BufReader, Write},
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Command, ExitStatus, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

use super::{Arch, debian};

pub struct Qemu {
    root: PathBuf,
    pub version: String,
}

const HOST_LIBS: [&str; 2] = ["lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu"];

impl Qemu {
    /// QEMU for `arch`, unpacked (once) with what it needs.
    pub fn get(apt: &debian::Apt, vmtest_dir: &Path, arch: Arch) -> Result<Qemu> {
        if std::env::consts::ARCH != "x86_64" {
            bail!("vmtest runs QEMU from Debian's amd64 packages; this machine is {}", std::env::consts::ARCH);
        }
        let system = match arch {
            Arch::X86_64 => "qemu-system-x86",
            Arch::Aarch64 => "qemu-system-arm",
        };
        let common = apt.candidate("qemu-system-common", None)?;
        let root = vmtest_dir.join("qemu").join(common.version.replace(':', "%3a"));
        let mut pkgs = vec![common.clone(), apt.candidate(system, None)?, apt.candidate("qemu-system-data", None)?];
        if arch == Arch::X86_64 {
            pkgs.push(apt.candidate("seabios", None)?);
        }
        // Architecture-independent packages carry no binNMU suffix (`+b3`).
        let source_version =
            |v: &str| v.rsplit_once("+b").filter(|(_, n)| n.parse::<u32>().is_ok()).map_or(v, |(s, _)| s).to_string();
        for p in &pkgs {
            if p.name.starts_with("qemu-") && source_version(&p.version) != source_version(&common.version) {
                bail!(
                    "{} {} does not match qemu-system-common {}: run with --refresh",
                    p.name,
                    p.version,
                    common.version
                );
            }
            apt.unpack_into(p, &root)?;
        }
        let q = Qemu { root, version: common.version };
        q.complete_libraries(apt, &q.binary(arch))?;
        Ok(q)
    }

    fn binary(&self, arch: Arch) -> PathBuf {
        self.root.join("usr/bin").join(match arch {
            Arch::X86_64 => "qemu-system-x86_64",
            Arch::Aarch64 => "qemu-system-aarch64",
        })
    }

    fn library_path(&self) -> String {
        HOST_LIBS.iter().map(|d| self.root.join(d).display().to_string()).collect::<Vec<_>>().join(":")
    }

    /// Unpacks the package of every library `ldd` does not find, until it finds all.
    fn complete_libraries(&self, apt: &debian::Apt, bin: &Path) -> Result<()> {
        for _round in 0..8 {
            let out = crate::cmd::output(Command::new("ldd").arg(bin).env("LD_LIBRARY_PATH", self.library_path()))?;
            let missing: Vec<&str> = out
                .lines()
                .filter(|l| l.contains("=> not found"))
                .filter_map(|l| l.split_whitespace().next())
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect();
            if missing.is_empty() {
                return Ok(());
            }
            for so in missing {
                let pkg = debian::package_for_soname(so)
                    .with_context(|| format!("{} needs {so}, which names no Debian package", bin.display()))?;
                let p = apt.candidate(&pkg, None).with_context(|| format!("{so} (needed by {})", bin.display()))?;
                eprintln!("vmtest: {} needs {so}: unpacking {} {}", bin.display(), p.name, p.version);
                apt.unpack_into(&p, &self.root)?;
            }
        }
        bail!("{}: libraries still missing after 8 rounds (see `ldd`)", bin.display())
    }

    /// The command line of a boot (without the timeout, which [`Qemu::boot`] enforces).
    pub fn command(&self, spec: &BootSpec) -> Command {
        let mut c = Command::new(self.binary(spec.arch));
        c.env("LD_LIBRARY_PATH", self.library_path())
            .env("QEMU_MODULE_DIR", self.root.join("usr/lib/x86_64-linux-gnu/qemu"))
            .arg("-L")
            .arg(self.root.join("usr/share/qemu"));
        let console = match spec.arch {
            Arch::X86_64 => {
                c.arg("-L").arg(self.root.join("usr/share/seabios")).args(["-cpu", "max"]);
                format!("ttyS0 tsc=reliable no_timer_check tsc_early_khz={}", host_tsc_khz())
            }
            Arch::Aarch64 => {
                c.args(["-M", "virt", "-cpu", "max,pauth-impdef=on"]);
                "ttyAMA0".to_string()
            }
        };
        let accel = match spec.arch {
            Arch::X86_64 => "tcg,thread=single",
            Arch::Aarch64 => "tcg",
        };
        c.args(["-accel", accel, "-m", &format!("{}M", spec.mem_mib), "-smp", &spec.cpus.to_string()])
            .args(["-display", "none", "-serial", "stdio", "-monitor", "none", "-nic", "none", "-no-reboot"])
            .arg("-kernel")
            .arg(&spec.kernel)
            .arg("-initrd")
            .arg(&spec.initrd)
            .arg("-append")
            .arg(format!("console={console} panic=-1 loglevel=3 {}", spec.append));
        if let Some(disk) = &spec.disk {
            c.arg("-drive").arg(format!("file={},format=raw,if=virtio,cache=unsafe", disk.display()));
        }
        c
    }

    /// Boots and returns the console once the guest powers off, or kills QEMU at the timeout.
    /// Every console line goes to `spec.log` and to `on_line`.
    pub fn boot(&self, spec: &BootSpec, mut on_line: impl FnMut(&str)) -> Result<Boot> {
        let mut c = self.command(spec);
        c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        // SAFETY: prctl in the child before exec; async-signal-safe. QEMU dies with xtask.
        unsafe {
            c.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            })
        };
        let mut log = std::fs::File::create(&spec.log).with_context(|| format!("creating {}", spec.log.display()))?;
        writeln!(log, "+ {c:?}")?;
        let start = Instant::now();
        let mut child = c.spawn().with_context(|| format!("starting {}", self.binary(spec.arch).display()))?;
        let (tx, rx) = mpsc::channel::<String>();
        let readers: Vec<_> = [
            child.stdout.take().map(|o| Box::new(o) as Box<dyn std::io::Read + Send>),
            child.stderr.take().map(|e| Box::new(e) as Box<dyn std::io::Read + Send>),
        ]
        .into_iter()
        .flatten()
        .map(|r| {
            let tx = tx.clone();
            std::thread::spawn(move || {
                let mut r = BufReader::new(r);
                let mut buf = Vec::new();
                while r.read_until(b'\n', &mut buf).is_ok_and(|n| n > 0) {
                    let line = String::from_utf8_lossy(&buf).trim_end_matches(['\r', '\n']).to_string();
                    if tx.send(line).is_err() {
                        break;
                    }
                    buf.clear();
                }
            })
        })
        .collect();
        drop(tx);
        let deadline = start + spec.timeout;
        let mut console = String::new();
        let mut timed_out = false;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) => {
                    writeln!(log, "{line}")?;
                    on_line(&line);
                    console.push_str(&line);
                    console.push('\n');
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    timed_out = true;
                    let _ = child.kill();
                    writeln!(log, "vmtest: killed QEMU at the {} s timeout", spec.timeout.as_secs())?;
                    break;
                }
            }
        }
        let status = child.wait().context("waiting for QEMU")?;
        let elapsed = start.elapsed();
        for r in readers {
            let _ = r.join();
        }
        Ok(Boot { console, elapsed, timed_out, status })
    }
}

/// This machine's TSC rate in kHz: TSC cycles against the monotonic clock over 3 × 200 ms, the
/// median (a preemption between the two reads skews one round, not the median).
#[cfg(target_arch = "x86_64")]
fn host_tsc_khz() -> u64 {
    let mut rounds: Vec<u64> = (0..3)
        .map(|_| {
            // SAFETY: `rdtsc` has no preconditions on x86-64.
            let tsc = || unsafe { core::arch::x86_64::_rdtsc() };
            let (t0, c0) = (Instant::now(), tsc());
            std::thread::sleep(Duration::from_millis(200));
            let (c1, t1) = (tsc(), Instant::now());
            ((c1 - c0) as u128 * 1_000_000 / (t1 - t0).as_nanos().max(1)) as u64
        })
        .collect();
    rounds.sort_unstable();
    rounds[1]
}

/// Never called: [`Qemu::get`] refuses a host other than x86-64.
#[cfg(not(target_arch = "x86_64"))]
fn host_tsc_khz() -> u64 {
    0
}

pub struct BootSpec {
    pub arch: Arch,
    pub kernel: PathBuf,
    pub initrd: PathBuf,
    pub disk: Option<PathBuf>,
    /// Extra kernel command line.
    pub append: String,
    pub mem_mib: u64,
    pub cpus: u32,
    pub timeout: Duration,
    pub log: PathBuf,
}

pub struct Boot {
    pub console: String,
    pub elapsed: Duration,
    pub timed_out: bool,
    pub status: ExitStatus,
}
