//! `cargo xtask test --target aarch64`: the engine cross-built for aarch64 and its tests run
//! under user-mode emulation (`qemu-aarch64`). A command of its own, never part of the default
//! `cargo xtask test`: its Debian packages alone are about 700 MB.
//!
//! 1. Packages (idempotent, as root): the `arm64` dpkg architecture, Debian's Rust std for
//!    aarch64 (`libstd-rust-web-dev:arm64`, rustc 1.96), the cross linker and C library
//!    (`gcc-aarch64-linux-gnu`, `libc6-dev-arm64-cross`), `qemu-user` and Debian's clippy for
//!    that compiler (`rust-web-clippy`).
//! 2. Build with Debian's compiler (`RUSTC=/usr/bin/rustc`, the only one here with an aarch64
//!    std), linked by `aarch64-linux-gnu-gcc`, in its own target directory (`target/cross`), so
//!    that the host build's artifacts are never touched.
//!    Then clippy on the engine for aarch64, warnings as errors ([`clippy`]: Debian's
//!    `cargo-clippy`, package `rust-web-clippy`, built for that compiler), which is what lints
//!    `quant/neon.rs` and everything else behind `cfg(target_arch = "aarch64")`.
//! 3. Run: cargo runs each test binary with plain `qemu-aarch64` (never `-L
//!    /usr/aarch64-linux-gnu`: that sysroot mixes a second glibc build into the process and
//!    thread creation then hangs; the `arm64` libraries installed in `/` are found without it).
//!    Tests that spawn the built `engine` need the kernel to run an aarch64 ELF: a binfmt_misc
//!    entry for `qemu-aarch64` is registered for the run and removed after it (and
//!    binfmt_misc unmounted again when this command mounted it).
//!
//! 4. Run the engine's kernel tests (`quant::`) a second time on an emulated CPU without
//!    `dotprod` ([`NO_DOTPROD_CPU`]), where the `neon` level runs its emulated-`sdot` kernels
//!    through the dispatch (qemu's default CPU has `dotprod`; both variants are also compared
//!    directly in the first pass), and a third time on one with `dotprod` but without `i8mm`
//!    ([`DOTPROD_CPU`]), where the dispatch picks llama.cpp's `dotprod` repacked orders (the
//!    default CPU, `max`, has `i8mm`: the `i8mm` orders).
//!
//! 5. The observer's eBPF object for an arm64 kernel: `observer-ebpf` built for `bpfel` with
//!    `AYA_BPF_TARGET_ARCH=aarch64` (as `observer/build.rs` does for an aarch64 observer), and
//!    the `pt_regs` offsets its `mark_end` uprobe reads its two arguments from checked against
//!    arm64's ([`ARM64_ARG_OFFSETS`]). qemu-user cannot load it; reading the instructions needs
//!    no arm64 kernel.
//!
//! 6. The negative control of `cargo xtask parity --target aarch64`
//!    (`parity::negative_control_aarch64`): the engine cross-built once more with its test-only
//!    feature `parity-negative-control` ([`build_perturbed_engine`]), which changes the float order
//!    of the plain `Q8_0` kernel; on qemu's `cortex-a72` against llama.cpp's cached `armv8-a`
//!    cross build (one model, one prompt), the engine as built must pass and the perturbed one
//!    must fail.
//!
//! Each step is a timed phase (a table at the end); the test phases all run, and the command
//! fails after them if any failed.
//!
//! What cannot run under emulation is printed with the reason ([`NOT_RUN`]), never skipped
//! silently. Emulation checks correctness only: emulated code runs tens of times slower than
//! native, so no speed is measured here.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};

use crate::{cache, cmd, setup, test};

/// The Rust target triple.
pub(crate) const TRIPLE: &str = "aarch64-unknown-linux-gnu";

/// Debian packages (after `dpkg --add-architecture arm64`) and why each is needed.
const PACKAGES: &[(&str, &str)] = &[
    ("libstd-rust-web-dev:arm64", "Debian's Rust std for aarch64 (rustc 1.96)"),
    ("gcc-aarch64-linux-gnu", "the cross linker"),
    ("libc6-dev-arm64-cross", "the aarch64 C library to link against"),
    ("qemu-user", "qemu-aarch64, which runs the tests"),
    // The aarch64 llama.cpp programs' runtime libraries (the parity runner, llama-simple): a fresh
    // machine has no libgomp1:arm64, and the runner failed to load without it.
    ("libstdc++6:arm64", "the C++ runtime of the aarch64 llama.cpp build"),
    ("libgomp1:arm64", "the OpenMP runtime of the aarch64 llama.cpp build (ggml's threads)"),
    ("rust-web-clippy", "Debian's clippy for rustc 1.96, which lints the aarch64 code"),
];

/// Debian's compiler, the one with an aarch64 std.
const RUSTC: &str = "/usr/bin/rustc";
/// Debian's `cargo-clippy` (`rust-web-clippy`), whose `clippy-driver` is built against that
/// compiler (rustup's clippy is another rustc's, which cannot read Debian's aarch64 std).
const CLIPPY: &str = "/usr/bin/cargo-clippy";
const LINKER: &str = "aarch64-linux-gnu-gcc";
pub(crate) const QEMU: &str = "/usr/bin/qemu-aarch64";

/// arm64's `struct user_pt_regs` offsets of the first two arguments (`regs[0]`, `regs[1]`);
/// x86-64's would be 112 (`di`) and 104 (`si`).
const ARM64_ARG_OFFSETS: [i16; 2] = [0, 8];

/// Builds `observer-ebpf` for an arm64 kernel and checks which `pt_regs` fields `mark_end`
/// (`moe_engine_token_end(u64 index, const record *rec)`) reads: the offsets of its loads from
/// the context register (`r1`) before the first call.
fn check_arm64_ebpf(root: &Path) -> Result<()> {
    let dir = target_dir().join("ebpf-aarch64");
    let path = format!(
        "{}:{}:{}",
        setup::LLVM_BIN,
        setup::cargo_bin_dir()?.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut c = Command::new("cargo");
    c.current_dir(root.join("observer-ebpf"))
        .args(["build", "--release", "--locked", "--target", "bpfel-unknown-none", "--target-dir"])
        .arg(&dir)
        .env("RUSTC", RUSTC)
        .env("RUSTC_BOOTSTRAP", "1")
        .env("AYA_BPF_TARGET_ARCH", "aarch64")
        .env("PATH", path)
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("RUSTFLAGS");
    cmd::run(&mut c).context("building observer-ebpf for an arm64 kernel")?;
    let obj = dir.join("bpfel-unknown-none/release/observer-ebpf");
    let data = std::fs::read(&obj).with_context(|| format!("reading {}", obj.display()))?;
    // The compiler orders the two loads as it likes: compare them sorted.
    let mut got = ctx_load_offsets(&data, "mark_end")?;
    got.sort_unstable();
    if got != ARM64_ARG_OFFSETS {
        bail!(
            "{}: mark_end reads its arguments at pt_regs offsets {got:?}, arm64's are {ARM64_ARG_OFFSETS:?}",
            obj.display()
        );
    }
    println!("cross: eBPF object for arm64: mark_end reads its arguments at pt_regs offsets {got:?} (arm64's)");
    Ok(())
}

/// Offsets of the 64-bit loads from `r1` (the program's context) in function `func` of a BPF
/// ELF object, in order, up to the first call or write to `r1`. A BPF instruction is 8 bytes:
/// opcode, registers (dst low nibble, src high), 16-bit offset, 32-bit immediate.
fn ctx_load_offsets(data: &[u8], func: &str) -> Result<Vec<i16>> {
    use object::{Object, ObjectSection, ObjectSymbol};
    let file = object::File::parse(data).context("parsing the eBPF object")?;
    let sym = file.symbols().find(|s| s.name() == Ok(func)).with_context(|| format!("no symbol {func}"))?;
    let sec = file.section_by_index(sym.section_index().context("symbol without section")?)?;
    let code = sec.data()?;
    let start = sym.address() as usize;
    let end = (start + sym.size() as usize).min(code.len());
    let mut offs = Vec::new();
    for insn in code[start..end].chunks_exact(8) {
        let (op, dst, src) = (insn[0], insn[1] & 0xf, insn[1] >> 4);
        let off = i16::from_le_bytes([insn[2], insn[3]]);
        if op == 0x85 || dst == 1 {
            break; // a call (clobbers r1) or r1 rewritten
        }
        if op == 0x79 && src == 1 {
            offs.push(off); // BPF_LDX | BPF_MEM | BPF_DW from r1
        }
    }
    Ok(offs)
}

/// An ARMv8.0 CPU model of qemu: NEON without `dotprod`, `i8mm` or SVE.
const NO_DOTPROD_CPU: &str = "cortex-a72";
/// An ARMv8.2 CPU model of qemu with `dotprod` but without `i8mm` (qemu's default, `max`, has
/// both): the `neon` level's `dotprod` repacked orders.
const DOTPROD_CPU: &str = "cortex-a76";

/// The engine's test targets that run under `qemu-aarch64` (besides its library tests).
const ENGINE_TESTS: &[&str] =
    &["blocks", "gguf_malformed", "markers", "metrics", "model_tiny", "placement", "pressure"];

/// The observer's library tests that run under `qemu-aarch64`: its per-architecture user-side
/// rules, which need no eBPF (test-name filters): the eviction rule's system calls and their
/// `pt_regs` field, the I/O system-call table, the `llama_decode` argument rule against the
/// compiler's calling convention, and the library search path. `observer-common`'s library
/// tests (the kernel rules' pure logic) run whole.
const OBSERVER_TESTS: &[&str] = &["capture::residency::evict::", "capture::syscalls::", "capture::profile::"];

/// Tests and suites that cannot run under user-mode emulation, and why.
pub const NOT_RUN: &[(&str, &str)] = &[
    (
        "engine: markers::markers_fire_once_per_step_under_a_uprobe",
        "a uprobe on the aarch64 binary never fires under qemu-user: the host kernel runs qemu's translated code, \
         not the binary's instructions",
    ),
    (
        "observer (all but OBSERVER_TESTS), tui (all tests; the arm64 eBPF object is built and its uprobe \
         argument offsets read)",
        "qemu-user does not emulate the bpf() syscall, so eBPF programs cannot be loaded",
    ),
    (
        "engine doc tests",
        "rustdoc does not cross-run doc tests on this toolchain; they run natively in `cargo xtask test`",
    ),
    (
        "parity with llama.cpp on aarch64",
        "a command of its own, `cargo xtask parity --target aarch64` (llama.cpp's aarch64 cross builds for the \
         neon, dotprod and i8mm levels, cached; both programs under qemu-aarch64, minutes per model); here the \
         NEON kernels are checked bit for bit against models of ggml's NEON and repacked orders, and against the \
         reference dequantizers, and the parity check's negative control runs (one model and prompt, neon level)",
    ),
    ("speed", "emulated code runs tens of times slower than native: emulation checks correctness, not speed"),
];

const BINFMT_DIR: &str = "/proc/sys/fs/binfmt_misc";
const BINFMT_NAME: &str = "moe-observer-qemu-aarch64";
/// qemu's own magic and mask for aarch64 ELF executables (`scripts/qemu-binfmt-conf.sh`), as the
/// kernel's register file parses them (escapes are literal backslashes).
const BINFMT_RULE: &str = concat!(
    r":moe-observer-qemu-aarch64:M::",
    r"\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00:",
    r"\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff:",
    "/usr/bin/qemu-aarch64:"
);

/// A binfmt_misc entry that runs aarch64 executables with `qemu-aarch64`, removed on drop.
struct Binfmt {
    mounted: bool,
}

impl Binfmt {
    fn register() -> Result<Binfmt> {
        let dir = Path::new(BINFMT_DIR);
        let mut mounted = false;
        if !dir.join("register").exists() {
            cmd::run(Command::new("mount").args(["-t", "binfmt_misc", "binfmt_misc", BINFMT_DIR]))
                .context("mounting binfmt_misc failed: the kernel needs CONFIG_BINFMT_MISC to run aarch64 binaries")?;
            mounted = true;
        }
        let entry = dir.join(BINFMT_NAME);
        if entry.exists() {
            eprintln!("cross: removing the binfmt entry {BINFMT_NAME} left by an earlier run");
            std::fs::write(&entry, "-1").with_context(|| format!("removing {}", entry.display()))?;
        }
        std::fs::write(dir.join("register"), BINFMT_RULE)
            .with_context(|| format!("registering qemu-aarch64 in {BINFMT_DIR}/register"))?;
        eprintln!("cross: binfmt entry {BINFMT_NAME} registered for this run");
        Ok(Binfmt { mounted })
    }
}

impl Drop for Binfmt {
    fn drop(&mut self) {
        let entry = Path::new(BINFMT_DIR).join(BINFMT_NAME);
        match std::fs::write(&entry, "-1") {
            Ok(()) => eprintln!("cross: binfmt entry {BINFMT_NAME} removed"),
            Err(e) => eprintln!(
                "cross: warning: could not remove {}: {e}; remove it with `echo -1 > {}`",
                entry.display(),
                entry.display()
            ),
        }
        if self.mounted && cmd::run(Command::new("umount").arg(BINFMT_DIR)).is_err() {
            eprintln!("cross: warning: could not unmount {BINFMT_DIR}: run `umount {BINFMT_DIR}`");
        }
    }
}

/// `dpkg --add-architecture arm64` unless dpkg already has it.
fn arm64_architecture() -> Result<()> {
    let foreign = cmd::output(Command::new("dpkg").arg("--print-foreign-architectures"))?;
    if foreign.lines().any(|l| l.trim() == "arm64") {
        return Ok(());
    }
    if !setup::is_root() {
        bail!("dpkg does not know the arm64 architecture: run as root `dpkg --add-architecture arm64`");
    }
    cmd::run(Command::new("dpkg").args(["--add-architecture", "arm64"]))
}

pub(crate) fn packages() -> Result<()> {
    if !setup::is_debian() {
        bail!(
            "the aarch64 cross test needs Debian's packages (no ID=debian in /etc/os-release, or no apt-get): \
             install an aarch64 Rust std for rustc 1.96, an aarch64 gcc and C library, and qemu-user by hand"
        );
    }
    arm64_architecture()?;
    setup::ensure_packages(PACKAGES, "bookworm-security carries libstd-rust-web-dev for arm64")?;
    if !Path::new("/usr/lib/rustlib").join(TRIPLE).join("lib").is_dir() {
        bail!("/usr/lib/rustlib/{TRIPLE}/lib is missing: reinstall libstd-rust-web-dev:arm64");
    }
    Ok(())
}

/// The environment cargo builds and runs the cross tests with.
pub(crate) fn cargo_env(target_dir: &Path) -> Vec<(&'static str, String)> {
    vec![
        ("RUSTC", RUSTC.to_owned()),
        ("CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER", LINKER.to_owned()),
        ("CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER", QEMU.to_owned()),
        ("CARGO_TARGET_DIR", target_dir.display().to_string()),
    ]
}

/// The arguments of `cargo test`: the engine's library and [`ENGINE_TESTS`], minus the tests in
/// [`NOT_RUN`] that live in those binaries; `extra` (the command line's) go before `--`.
fn cargo_args(extra: &[String]) -> Vec<String> {
    let mut a: Vec<String> = ["-p", "engine", "--target", TRIPLE, "--lib"].map(String::from).to_vec();
    for t in ENGINE_TESTS {
        a.extend(["--test".to_owned(), (*t).to_owned()]);
    }
    a.extend(extra.iter().cloned());
    a.extend(["--", "--skip", "markers_fire_once_per_step_under_a_uprobe"].map(String::from));
    a
}

/// Clippy on the engine for aarch64, warnings as errors, with the root manifest's lints: the code
/// behind `cfg(target_arch = "aarch64")` (`quant/neon.rs`, its dispatch and tests), which the
/// host's clippy never compiles.
pub(crate) fn clippy(root: &Path, env: &[(&'static str, String)]) -> Result<()> {
    eprintln!("cross: clippy on the engine for {TRIPLE} ({CLIPPY}, -D warnings)");
    let mut c = Command::new(CLIPPY);
    c.current_dir(root).envs(env.iter().cloned());
    c.args(["clippy", "--release", "-p", "engine", "--all-targets", "--target", TRIPLE, "--", "-D", "warnings"]);
    cmd::run(&mut c).context("clippy found warnings in the engine's aarch64 build")
}

/// The cross run's own target directory.
pub(crate) fn target_dir() -> PathBuf {
    cache::target_dir().join("cross")
}

/// The engine's test-only feature that perturbs the float order of its plain `Q8_0` NEON kernel
/// (`engine/Cargo.toml`): the parity check's negative control.
const CONTROL_FEATURE: &str = "parity-negative-control";

/// Cross-builds the engine with [`CONTROL_FEATURE`], copies it to
/// `target/cross/negative-control/engine` and returns that copy; then builds the normal engine
/// again (cargo keeps both builds' artifacts, so this only puts the normal binary back in place),
/// so that nothing else ever runs the perturbed one.
pub(crate) fn build_perturbed_engine() -> Result<PathBuf> {
    eprintln!("cross: building the engine for {TRIPLE} with the test-only feature {CONTROL_FEATURE}");
    let mut build = Command::new("cargo");
    build.current_dir(cache::workspace_root()).envs(cargo_env(&target_dir()));
    build.args(["build", "--release", "-p", "engine", "--bin", "engine", "--target", TRIPLE, "--features"]);
    build.arg(CONTROL_FEATURE);
    cmd::run(&mut build).context("cross-building the engine with its negative-control feature")?;
    let dir = target_dir().join("negative-control");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let dst = dir.join("engine");
    let src = target_dir().join(TRIPLE).join("release/engine");
    std::fs::copy(&src, &dst).with_context(|| format!("copying {} to {}", src.display(), dst.display()))?;
    build_engine()?;
    Ok(dst)
}

/// Cross-builds the engine's programs for aarch64 and returns the `engine` binary.
pub(crate) fn build_engine() -> Result<PathBuf> {
    eprintln!("cross: building the engine for {TRIPLE} with {RUSTC} and {LINKER}");
    let mut build = Command::new("cargo");
    build.current_dir(cache::workspace_root()).envs(cargo_env(&target_dir()));
    build.args(["build", "--release", "-p", "engine", "--bins", "--target", TRIPLE]);
    cmd::run(&mut build).context("cross-building the engine for aarch64")?;
    Ok(target_dir().join(TRIPLE).join("release/engine"))
}

pub fn run(args: &[String]) -> Result<()> {
    let t0 = Instant::now();
    if !cfg!(all(target_os = "linux", target_arch = "x86_64")) {
        bail!("`cargo xtask test --target aarch64` cross-builds from an x86-64 Linux host");
    }
    let mut phases = test::Phases::default();
    let result = phases_run(args, &mut phases, t0);
    println!("\ncross: wall time per phase\n{}", phases.table(t0.elapsed()));
    result
}

/// How many of one `cargo test` run's tests passed and failed, and whether cargo succeeded.
fn tally(what: &str, (clock, ok): (test::TestClock, bool)) -> Result<test::Counts> {
    let c = clock.counts;
    if !ok || c.failed > 0 {
        bail!("{what}: {} of {} failed", c.failed, c.passed + c.failed);
    }
    if c.passed == 0 {
        bail!("{what}: no test ran");
    }
    if c.ignored > 0 {
        bail!("{what}: {} tests are #[ignore]d: this project does not skip tests silently", c.ignored);
    }
    Ok(c)
}

fn phases_run(args: &[String], phases: &mut test::Phases, t0: Instant) -> Result<()> {
    phases.run("packages", packages)?;
    let root = cache::workspace_root();
    phases.run("ebpf object for arm64", || check_arm64_ebpf(&root))?;
    let env = cargo_env(&target_dir());
    let engine = phases.run("cross build of the engine", build_engine)?;
    phases.run("clippy (aarch64)", || clippy(&root, &env))?;

    // Each test phase runs to its end; the command fails after all of them if any failed.
    let mut failed = Vec::new();
    let binfmt = Binfmt::register()?;
    let c = phases.run("engine tests (qemu max)", || {
        tally("engine tests under qemu-aarch64", test::cargo_test(&root, &cargo_args(args), &env)?)
    });
    let observer = phases.run("observer rules (qemu max)", || {
        let mut obs_args: Vec<String> =
            ["-p", "observer", "--target", TRIPLE, "--lib", "--"].map(String::from).to_vec();
        obs_args.extend(OBSERVER_TESTS.iter().map(|t| (*t).to_owned()));
        let mut c = tally("observer tests", test::cargo_test(&root, &obs_args, &env)?)?;
        let common_args = ["-p", "observer-common", "--target", TRIPLE, "--lib"].map(String::from);
        let c2 = tally("observer-common tests", test::cargo_test(&root, &common_args, &env)?)?;
        c.passed += c2.passed;
        Ok(c)
    });
    let nd_args: Vec<String> =
        ["-p", "engine", "--target", TRIPLE, "--lib", "--", "quant::"].map(String::from).to_vec();
    let mut on_cpu = |cpu: &str, what: &str| {
        let mut env2 = env.clone();
        env2.push(("QEMU_CPU", cpu.to_owned()));
        phases.run(&format!("kernel tests (qemu {cpu})"), || {
            tally(&format!("kernel tests on {cpu} ({what})"), test::cargo_test(&root, &nd_args, &env2)?)
        })
    };
    let c2 = on_cpu(NO_DOTPROD_CPU, "no dotprod");
    let c5 = on_cpu(DOTPROD_CPU, "dotprod, no i8mm");
    let control = phases.run("parity negative control", || {
        let perturbed = build_perturbed_engine()?;
        // The models are written by the aarch64 engine (binfmt runs it): the file is the same
        // whoever writes it, and the host's engine is not built by this command.
        crate::parity::negative_control_aarch64(&engine, &perturbed, &engine, 2)
    });
    drop(binfmt);

    println!("\ncross: not run under emulation:");
    for (what, why) in NOT_RUN {
        println!("  - {what}: {why}");
    }
    println!();
    let mut report = |name: &str, r: &Result<test::Counts>| match r {
        Ok(c) => println!("cross: {name}: {} passed", c.passed),
        Err(e) => {
            println!("cross: {name}: FAILED: {e:#}");
            failed.push(name.to_owned());
        }
    };
    report("engine tests under qemu-aarch64 (library and integration tests)", &c);
    report(&format!("kernel tests (quant::) on qemu's {NO_DOTPROD_CPU}, no dotprod"), &c2);
    report(&format!("kernel tests (quant::) on qemu's {DOTPROD_CPU}, dotprod without i8mm"), &c5);
    report("observer tests (its aarch64 rules; observer-common whole)", &observer);
    match &control {
        Ok(()) => println!("cross: parity negative control: ok"),
        Err(e) => {
            println!("cross: parity negative control: FAILED: {e:#}");
            failed.push("parity negative control".to_owned());
        }
    }
    println!("cross: {:.1} min in all", t0.elapsed().as_secs_f64() / 60.0);
    if !failed.is_empty() {
        bail!("aarch64 checks failed: {}", failed.join("; "));
    }
    Ok(())
}
