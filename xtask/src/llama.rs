//! llama.cpp, the engine's correctness and speed reference, built into the cache with explicit
//! ISA options.
//!
//! Layout under `${XDG_CACHE_HOME:-$HOME/.cache}/moe-observer/llama.cpp/<llama-cpp-python version>/`:
//! `dl/` (the sdist from PyPI), `src/` (its vendored llama.cpp, shared by every build), `ccache/`
//! (the compiler cache the builds share), and one directory per ISA key, each with `build/`
//! (cmake, CPU only, shared libraries in `build/bin/`), `configure-args` (the cmake options it
//! was configured with; a difference reconfigures it) and `parity-llama-<hash>` (our reference
//! runner, `parity_llama.cpp`, compiled against that build's libllama).
//!
//! Two builds, never `GGML_NATIVE` (it compiles ggml's AMX path on CPUs that report AMX, and AMX
//! faults on VMs that expose it: see `amx.rs`) and never `GGML_CPU_ALL_VARIANTS` (it ships and
//! picks an AMX variant on such CPUs). Every ggml ISA option is set explicitly, AMX always off:
//! - `avx2` (the parity build): SSE4.2, AVX, AVX2, BMI2, FMA, F16C, i.e. ggml's `haswell`
//!   variant; every AVX-512, AVX-VNNI and AMX option off. The level the engine's AVX2 kernels
//!   implement.
//! - the speed build, the best this CPU offers without AMX: the `avx2` set plus `GGML_AVX512`
//!   (F, CD, BW, DQ, VL, all needed) and each of VBMI, AVX512-VNNI, AVX512-BF16, AVX-VNNI the CPU
//!   lists, keyed by what it has on (`avx512-vbmi-vnni-bf16-avxvnni` on a Sapphire Rapids).
//!   ggml has no option for AVX512-FP16 (only `-march=native` reaches it), so no build uses it.
//!   On a CPU without AVX-512 the speed build is the `avx2` build.
//! - `aarch64-<arch>` (`cargo xtask parity --target aarch64`): cross builds with Debian's
//!   `aarch64-linux-gnu` compilers, ggml-cpu at `-march=<arch>` (`GGML_CPU_ARM_ARCH`), one per
//!   ARM level ([`AARCH64_ARCHS`]: `armv8-a`, `armv8.2-a+dotprod`, `armv8.2-a+dotprod+i8mm`),
//!   each with its parity runner cross-compiled too; all run under `qemu-aarch64`.
//!
//! Sharing: the two builds configure separate trees from one source tree; only ggml-cpu's
//! compile commands differ between them (the ISA flags are ggml-cpu's private options), so the
//! second build gets libllama, ggml-base, ggml and the tools from ccache and compiles ggml-cpu
//! only (measured: 17 of its 71 objects compiled, 54 from ccache; each build says so). (One build
//! with two CPU backends would need `GGML_BACKEND_DL`, whose CPU variants exist only under
//! `GGML_CPU_ALL_VARIANTS`, and whose loader picks the variant with the best score from the
//! executable's directory: choosing the avx2 one on an AVX-512 CPU would need separate
//! directories anyway.)
//!
//! Only the targets a command uses are built ([`Target`]): `cargo xtask test` builds `llama`,
//! `llama-simple`, `llama-bench` and `llama-server` in the `avx2` build ([`TEST_TARGETS`]: the
//! programs `observer/tests/llama.rs` observes) and only what `parity` needs in the speed build
//! ([`PARITY_TARGETS`]); `bench engine` builds `llama-bench` in both. Every build is
//! configured with the server's targets (`LLAMA_BUILD_SERVER`, without its web UI, which would be
//! fetched from Hugging Face or built with npm), so asking for `llama-server` never reconfigures
//! a build; a cache entry configured without them (an older xtask) is reconfigured once, which
//! recompiles nothing, and a missing program is built on the next `ensure`. A directory `build/` directly under the version directory
//! is the old unkeyed `GGML_NATIVE` build: it is never used, and removed when found (unless a
//! process uses it). cmake and ccache are installed with apt-get when absent.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};

/// The pinned llama-cpp-python release; its sdist vendors llama.cpp.
pub const LLAMA_CPP_PYTHON: &str = "0.3.36";
const HARNESS_SRC: &str = include_str!("parity_llama.cpp");

/// A build target of llama.cpp and the file it produces in `build/bin/`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// libllama with libggml, libggml-base and libggml-cpu.
    Llama,
    /// `llama-simple`, the smallest generation program.
    Simple,
    /// `llama-bench` (links llama-common too).
    Bench,
    /// `llama-server` (llama-common, mtmd and the server's libraries; no web UI).
    Server,
}

impl Target {
    fn cmake_name(self) -> &'static str {
        match self {
            Target::Llama => "llama",
            Target::Simple => "llama-simple",
            Target::Bench => "llama-bench",
            Target::Server => "llama-server",
        }
    }

    fn file(self) -> &'static str {
        match self {
            Target::Llama => "libllama.so",
            Target::Simple => "llama-simple",
            Target::Bench => "llama-bench",
            Target::Server => "llama-server",
        }
    }
}

/// What `cargo xtask test` builds in the `avx2` build: what `observer/tests/llama.rs` observes.
pub const TEST_TARGETS: &[Target] = &[Target::Llama, Target::Simple, Target::Bench, Target::Server];
/// What `parity` needs of a build (libllama, for its runner), and all `cargo xtask test` builds
/// in the speed build: the observer's tests run only the `avx2` build's programs.
pub const PARITY_TARGETS: &[Target] = &[Target::Llama, Target::Simple];

/// Every ggml x86 ISA option; a build sets each explicitly, ON when listed in its [`Isa`].
const ISA_OPTIONS: [&str; 14] = [
    "GGML_SSE42",
    "GGML_AVX",
    "GGML_AVX2",
    "GGML_BMI2",
    "GGML_FMA",
    "GGML_F16C",
    "GGML_AVX_VNNI",
    "GGML_AVX512",
    "GGML_AVX512_VBMI",
    "GGML_AVX512_VNNI",
    "GGML_AVX512_BF16",
    "GGML_AMX_TILE",
    "GGML_AMX_INT8",
    "GGML_AMX_BF16",
];

/// The `avx2` level: the ggml options and the CPU flags they need.
const AVX2_SET: [(&str, &str); 6] = [
    ("GGML_SSE42", "sse4_2"),
    ("GGML_AVX", "avx"),
    ("GGML_AVX2", "avx2"),
    ("GGML_BMI2", "bmi2"),
    ("GGML_FMA", "fma"),
    ("GGML_F16C", "f16c"),
];

/// `GGML_AVX512` turns on `-mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw`.
const AVX512_FLAGS: [&str; 5] = ["avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"];

/// The speed build's extras on top of AVX-512: (CPU flag, ggml option, part of the key).
const AVX512_EXTRAS: [(&str, &str, &str); 4] = [
    ("avx512vbmi", "GGML_AVX512_VBMI", "vbmi"),
    ("avx512_vnni", "GGML_AVX512_VNNI", "vnni"),
    ("avx512_bf16", "GGML_AVX512_BF16", "bf16"),
    ("avx_vnni", "GGML_AVX_VNNI", "avxvnni"),
];

/// An ISA level of a llama.cpp build: its cache key and the ggml options it turns on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Isa {
    pub key: String,
    on: Vec<&'static str>,
    /// For an aarch64 cross build: the `-march` ggml-cpu is compiled for (`GGML_CPU_ARM_ARCH`).
    arm_arch: Option<&'static str>,
}

/// The aarch64 cross builds' levels (ggml-cpu's `-march`, `GGML_CPU_ARM_ARCH`), one build each:
/// - `armv8-a`: NEON without `dotprod`: ggml runs its `ggml_vdotq_s32` emulation and never
///   repacks weights;
/// - `armv8.2-a+dotprod`: `sdot`; ggml repacks `Q4_0`, `Q4_K`, `Q5_K`, `Q6_K`, `Q8_0`, `MXFP4`
///   (and `IQ4_NL`) into its 4- and 8-row interleaved `dotprod` layouts;
/// - `armv8.2-a+dotprod+i8mm`: `smmla` too; the `Q4_K`, `Q5_K`, `Q6_K`, `Q8_0` layouts become the
///   `i8mm` ones (`MXFP4` keeps its `dotprod` layout).
///
/// Never `+fp16` or `+bf16` (nor an ARMv8.6 `-march`, which implies BF16): the engine reproduces
/// ggml's `F16` and `BF16` dot products without FP16 vector arithmetic or BF16 instructions.
pub const AARCH64_ARCHS: [&str; 3] = ["armv8-a", "armv8.2-a+dotprod", "armv8.2-a+dotprod+i8mm"];

/// The cmake options of a cross build for aarch64 (Debian's `g++-aarch64-linux-gnu`).
const AARCH64_CROSS: [&str; 4] = [
    "-DCMAKE_SYSTEM_NAME=Linux",
    "-DCMAKE_SYSTEM_PROCESSOR=aarch64",
    "-DCMAKE_C_COMPILER=aarch64-linux-gnu-gcc",
    "-DCMAKE_CXX_COMPILER=aarch64-linux-gnu-g++",
];

impl Isa {
    /// The parity build's level; fails on a CPU that cannot run it.
    pub fn avx2(flags: &BTreeSet<String>) -> Result<Isa> {
        let missing: Vec<&str> = AVX2_SET.iter().map(|(_, f)| *f).filter(|f| !flags.contains(*f)).collect();
        if !missing.is_empty() {
            bail!(
                "this CPU lacks {} (per /proc/cpuinfo): the llama.cpp reference is built at the engine's AVX2 level \
                 (SSE4.2, AVX, AVX2, BMI2, FMA, F16C) and cannot run here",
                missing.join(", ")
            );
        }
        Ok(Isa { key: "avx2".to_owned(), on: AVX2_SET.iter().map(|(o, _)| *o).collect(), arm_arch: None })
    }

    /// The speed build's level: the best this CPU offers without AMX.
    pub fn best(flags: &BTreeSet<String>) -> Result<Isa> {
        let mut isa = Isa::avx2(flags)?;
        if !AVX512_FLAGS.iter().all(|f| flags.contains(*f)) {
            return Ok(isa);
        }
        isa.key = "avx512".to_owned();
        isa.on.push("GGML_AVX512");
        for (flag, option, part) in AVX512_EXTRAS {
            if flags.contains(flag) {
                isa.key.push('-');
                isa.key.push_str(part);
                isa.on.push(option);
            }
        }
        Ok(isa)
    }

    /// The aarch64 cross build for `arch` (one of [`AARCH64_ARCHS`]).
    pub fn aarch64(arch: &'static str) -> Isa {
        Isa { key: format!("aarch64-{arch}"), on: Vec::new(), arm_arch: Some(arch) }
    }

    /// The C++ compiler of this build's programs (the parity runner).
    fn cxx(&self) -> &'static str {
        if self.arm_arch.is_some() { "aarch64-linux-gnu-g++" } else { "c++" }
    }

    /// Whether this level has AVX-512 on.
    pub fn avx512(&self) -> bool {
        self.on.contains(&"GGML_AVX512")
    }

    /// The cmake configure options: a Release CPU build with every ISA option explicit.
    fn configure_args(&self) -> Vec<String> {
        let mut args: Vec<String> = [
            "-DCMAKE_BUILD_TYPE=Release",
            "-DGGML_NATIVE=OFF",
            "-DGGML_CPU_ALL_VARIANTS=OFF",
            "-DGGML_BACKEND_DL=OFF",
            "-DLLAMA_CURL=OFF",
            "-DLLAMA_OPENSSL=OFF",
            "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=ON",
            // The server's targets exist (built only when asked for), without its web UI: the
            // UI is fetched from Hugging Face or built with npm, and the tests need neither.
            "-DLLAMA_BUILD_SERVER=ON",
            "-DLLAMA_BUILD_UI=OFF",
            "-DLLAMA_USE_PREBUILT_UI=OFF",
            "-DCMAKE_C_COMPILER_LAUNCHER=ccache",
            "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache",
        ]
        .map(str::to_owned)
        .to_vec();
        if let Some(arch) = self.arm_arch {
            args.extend(AARCH64_CROSS.map(str::to_owned));
            args.push(format!("-DGGML_CPU_ARM_ARCH={arch}"));
            return args;
        }
        args.extend(ISA_OPTIONS.iter().map(|o| format!("-D{o}={}", if self.on.contains(o) { "ON" } else { "OFF" })));
        args
    }
}

/// One cached llama.cpp build.
pub struct Build {
    pub isa: Isa,
    /// `build/bin/`: the libraries and programs.
    pub bin: PathBuf,
    /// The parity runner linked against this build.
    pub harness: PathBuf,
}

impl Build {
    pub fn program(&self, target: Target) -> PathBuf {
        self.bin.join(target.file())
    }

    /// `key (build/bin dir)`, for saying which build a result came from.
    pub fn describe(&self) -> String {
        format!("llama.cpp {} build ({})", self.isa.key, self.bin.display())
    }
}

/// The parity (`avx2`) build and, on a CPU with AVX-512, the speed build.
pub struct Builds {
    pub avx2: Build,
    speed: Option<Build>,
}

impl Builds {
    /// The fastest build for this CPU (the `avx2` one without AVX-512).
    pub fn best(&self) -> &Build {
        self.speed.as_ref().unwrap_or(&self.avx2)
    }

    /// Each distinct build, `avx2` first.
    pub fn all(&self) -> Vec<&Build> {
        std::iter::once(&self.avx2).chain(&self.speed).collect()
    }
}

fn have(tool: &str) -> bool {
    Command::new(tool).arg("--version").output().is_ok_and(|o| o.status.success())
}

/// Installs a Debian package with apt-get when its tool is missing (idempotent).
fn ensure_tool(tool: &str, package: &str) -> Result<()> {
    if have(tool) {
        return Ok(());
    }
    eprintln!("xtask: {tool} missing, installing {package} with apt-get");
    let install = || Command::new("apt-get").args(["install", "-y", package]).status();
    if !install().is_ok_and(|s| s.success()) {
        crate::cmd::run(Command::new("apt-get").arg("update"))?;
        crate::cmd::run(Command::new("apt-get").args(["install", "-y", package]))?;
    }
    if !have(tool) {
        bail!("{tool} is still not runnable after apt-get install -y {package}");
    }
    Ok(())
}

fn ensure_source(dir: &Path) -> Result<PathBuf> {
    let src = dir.join("src");
    if src.join("CMakeLists.txt").is_file() && src.join("src/models/qwen3moe.cpp").is_file() {
        return Ok(src);
    }
    let dl = dir.join("dl");
    std::fs::create_dir_all(&dl).with_context(|| format!("creating {}", dl.display()))?;
    let tarball = dl.join(format!("llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"));
    if !tarball.is_file() {
        eprintln!("xtask: downloading llama-cpp-python {LLAMA_CPP_PYTHON} (source) from PyPI");
        // Source for llama-cpp-python only: pip prepares the sdist's metadata, and with
        // `--no-binary :all:` it would first compile its build tools (ninja, …) from source.
        crate::cmd::run(
            Command::new("python3")
                .args(["-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python"])
                .arg(format!("llama-cpp-python=={LLAMA_CPP_PYTHON}"))
                .arg("-d")
                .arg(&dl),
        )?;
    }
    let tmp = dir.join("unpack.tmp");
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp)?;
    crate::cmd::run(Command::new("tar").arg("xzf").arg(&tarball).arg("-C").arg(&tmp))?;
    let vendored = tmp.join(format!("llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp"));
    if !vendored.join("CMakeLists.txt").is_file() {
        bail!("{}: no vendor/llama.cpp inside", tarball.display());
    }
    let _ = std::fs::remove_dir_all(&src);
    std::fs::rename(&vendored, &src).with_context(|| format!("moving {} to {}", vendored.display(), src.display()))?;
    let _ = std::fs::remove_dir_all(&tmp);
    Ok(src)
}

/// A process using `dir` (its current directory or executable inside it, or a file of it mapped:
/// a program linked against its libraries), if any.
fn user_of(dir: &Path) -> Option<u32> {
    let procs = std::fs::read_dir("/proc").ok()?;
    let prefix = format!("{}/", dir.display());
    procs.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok()).find(|pid| {
        ["cwd", "exe"].iter().any(|l| std::fs::read_link(format!("/proc/{pid}/{l}")).is_ok_and(|p| p.starts_with(dir)))
            || std::fs::read_to_string(format!("/proc/{pid}/maps")).is_ok_and(|m| m.contains(&prefix))
    })
}

/// Removes the old unkeyed layout: `build/` (a `GGML_NATIVE` build, with AMX on CPUs that report
/// it) and the runners linked against it, saying so.
fn remove_old_layout(dir: &Path) {
    let old = dir.join("build");
    if old.is_dir() {
        if let Some(pid) = user_of(&old) {
            eprintln!(
                "xtask: {} is the old unkeyed GGML_NATIVE llama.cpp build and is never used; not removed now, \
                 process {pid} uses it",
                old.display()
            );
        } else {
            eprintln!(
                "xtask: removing {}: the old unkeyed GGML_NATIVE llama.cpp build (AMX on CPUs that report it), never reused",
                old.display()
            );
            if let Err(e) = std::fs::remove_dir_all(&old) {
                eprintln!("xtask: warning: could not remove {}: {e}", old.display());
            }
        }
    }
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for path in entries.filter_map(|e| e.ok().map(|e| e.path())) {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        if path.is_file() && (name.starts_with("parity-llama-") || name == "parity_llama.cpp") && !old.is_dir() {
            eprintln!("xtask: removing {}: a runner of the old unkeyed build", path.display());
            let _ = std::fs::remove_file(&path);
        }
    }
}

/// `ccache` statistics counters (`--print-stats`) of the shared cache: (hits, misses).
fn ccache_counts(ccache_dir: &Path) -> Option<(u64, u64)> {
    let out = Command::new("ccache").env("CCACHE_DIR", ccache_dir).arg("--print-stats").output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let get = |k: &str| -> u64 {
        text.lines()
            .find_map(|l| l.split_once('\t').filter(|(n, _)| *n == k).and_then(|(_, v)| v.trim().parse().ok()))
            .unwrap_or(0)
    };
    Some((get("direct_cache_hit") + get("preprocessed_cache_hit"), get("cache_miss")))
}

/// The cmake names of the `targets` whose file is not in `bin` (what a build must make).
fn missing_targets(bin: &Path, targets: &[Target]) -> Vec<&'static str> {
    targets.iter().filter(|t| !bin.join(t.file()).is_file()).map(|t| t.cmake_name()).collect()
}

/// Configures (when its options changed) and builds `targets` of one ISA level, and the parity
/// runner against it.
fn ensure_build(dir: &Path, src: &Path, isa: &Isa, targets: &[Target]) -> Result<Build> {
    let own = dir.join(&isa.key);
    let build = own.join("build");
    let bin = build.join("bin");
    let args = isa.configure_args();
    let stamp = own.join("configure-args");
    let configured = build.join("CMakeCache.txt").is_file()
        && std::fs::read_to_string(&stamp).is_ok_and(|s| s.lines().eq(args.iter().map(String::as_str)));
    let missing = missing_targets(&bin, targets);
    if !configured || !missing.is_empty() {
        ensure_tool("cmake", "cmake")?;
        ensure_tool("ccache", "ccache")?;
        if isa.arm_arch.is_some() {
            ensure_tool("aarch64-linux-gnu-g++", "g++-aarch64-linux-gnu")?;
        }
        let ccache_dir = dir.join("ccache");
        let t0 = Instant::now();
        if !configured {
            std::fs::create_dir_all(&own).with_context(|| format!("creating {}", own.display()))?;
            crate::cmd::run(Command::new("cmake").arg("-S").arg(src).arg("-B").arg(&build).args(&args))?;
            std::fs::write(&stamp, args.join("\n") + "\n").with_context(|| format!("writing {}", stamp.display()))?;
        }
        let names: Vec<&str> = targets.iter().map(|t| t.cmake_name()).collect();
        eprintln!(
            "xtask: building llama.cpp ({LLAMA_CPP_PYTHON}) {} [{}] in {}",
            isa.key,
            names.join(", "),
            build.display()
        );
        let before = ccache_counts(&ccache_dir);
        let jobs = std::thread::available_parallelism().map_or(1, |n| n.get()).to_string();
        let cpu = crate::cmd::run_cpu(
            Command::new("cmake")
                .env("CCACHE_DIR", &ccache_dir)
                .env("CCACHE_BASEDIR", dir)
                .env("CCACHE_MAXSIZE", "2G")
                .arg("--build")
                .arg(&build)
                .args(["-j", &jobs, "--target"])
                .args(&names),
        )?;
        let cache = match (before, ccache_counts(&ccache_dir)) {
            (Some((h0, m0)), Some((h1, m1))) => format!("; ccache: {} hits, {} compiled", h1 - h0, m1 - m0),
            _ => String::new(),
        };
        eprintln!(
            "xtask: llama.cpp {} built in {:.0} s wall, {:.0} s CPU in `cmake --build`{cache}",
            isa.key,
            t0.elapsed().as_secs_f64(),
            cpu
        );
    }
    for t in targets {
        if !bin.join(t.file()).is_file() {
            bail!("{}: the build did not produce {}", build.display(), bin.join(t.file()).display());
        }
    }
    let hash =
        HARNESS_SRC.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    let harness = own.join(format!("parity-llama-{hash:016x}"));
    if !harness.is_file() || !configured {
        let cpp = own.join("parity_llama.cpp");
        std::fs::write(&cpp, HARNESS_SRC).with_context(|| format!("writing {}", cpp.display()))?;
        let tmp = harness.with_extension("tmp");
        crate::cmd::run(
            Command::new(isa.cxx())
                .args(["-O2", "-std=c++17", "-o"])
                .arg(&tmp)
                .arg(&cpp)
                .arg(format!("-I{}", src.join("include").display()))
                .arg(format!("-I{}", src.join("ggml/include").display()))
                .arg(format!("-L{}", bin.display()))
                .args(["-lllama", "-lggml", "-lggml-base"])
                .arg(format!("-Wl,-rpath,{}", bin.display())),
        )?;
        std::fs::rename(&tmp, &harness).with_context(|| format!("renaming {}", tmp.display()))?;
    }
    Ok(Build { isa: isa.clone(), bin, harness })
}

/// Builds (where needed) `targets` at the `avx2` level and, on a CPU with AVX-512, at the best
/// level, each with its parity runner; returns them.
pub fn ensure(targets: &[Target]) -> Result<Builds> {
    ensure_for(targets, targets)
}

/// [`ensure`] with other targets for the speed build than for the `avx2` build.
pub fn ensure_for(avx2_targets: &[Target], speed_targets: &[Target]) -> Result<Builds> {
    let dir = crate::cache::dir()?.join("llama.cpp").join(LLAMA_CPP_PYTHON);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    remove_old_layout(&dir);
    let flags = crate::detect::cpu_flags();
    let (avx2, best) = (Isa::avx2(&flags)?, Isa::best(&flags)?);
    let src = ensure_source(&dir)?;
    let avx2 = ensure_build(&dir, &src, &avx2, avx2_targets)?;
    let speed = if best == avx2.isa { None } else { Some(ensure_build(&dir, &src, &best, speed_targets)?) };
    Ok(Builds { avx2, speed })
}

/// The aarch64 cross build for `arch` ([`Isa::aarch64`]) of `targets` and its parity runner,
/// built where needed; its programs run under `qemu-aarch64` with the arm64 libraries installed
/// in `/` (`cross.rs` installs them).
pub fn ensure_aarch64(arch: &'static str, targets: &[Target]) -> Result<Build> {
    let dir = crate::cache::dir()?.join("llama.cpp").join(LLAMA_CPP_PYTHON);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let src = ensure_source(&dir)?;
    ensure_build(&dir, &src, &Isa::aarch64(arch), targets)
}

/// The AMX check (`amx.rs`) over every build.
pub fn check_no_amx(builds: &Builds) -> Result<()> {
    let named: Vec<(String, PathBuf)> = builds.all().iter().map(|b| (b.isa.key.clone(), b.bin.clone())).collect();
    crate::amx::check(&named)
}

/// Builds the engine binary (release) and returns its path.
pub fn build_engine() -> Result<PathBuf> {
    let root = crate::cache::workspace_root();
    crate::cmd::run(
        Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())).current_dir(&root).args([
            "build",
            "--quiet",
            "--release",
            "--package",
            "engine",
        ]),
    )?;
    Ok(crate::cache::target_dir().join("release/engine"))
}

/// A synthetic model in the cache, generated when missing. `args` are `engine synth` options;
/// the file is keyed by the configuration the engine resolves them to (and its synth format).
pub fn synth_model(engine: &Path, name: &str, args: &[&str]) -> Result<PathBuf> {
    synth_model_by(|| Command::new(engine), name, args)
}

/// [`synth_model`] with the engine run by `engine()` (e.g. an aarch64 engine under `qemu-aarch64`).
pub fn synth_model_by(engine: impl Fn() -> Command, name: &str, args: &[&str]) -> Result<PathBuf> {
    let cfg = crate::cmd::output(engine().arg("synth").args(["-o", "/dev/null", "--dry-run"]).args(args))?;
    let hash = cfg.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    let dir = crate::cache::dir()?.join("models");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join(format!("{name}-{hash:016x}.gguf"));
    if !path.is_file() {
        // synth writes aside and renames into place: the path never holds a part of a model.
        crate::cmd::run(engine().arg("synth").arg("-o").arg(&path).args(args))?;
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags(s: &str) -> BTreeSet<String> {
        s.split_whitespace().map(str::to_owned).collect()
    }

    const HASWELL: &str = "sse4_2 avx avx2 bmi2 fma f16c";
    const SAPPHIRE_RAPIDS: &str = "sse4_2 avx avx2 bmi2 fma f16c avx512f avx512cd avx512bw avx512dq avx512vl \
                                   avx512vbmi avx512_vnni avx512_bf16 avx512_fp16 avx_vnni amx_tile amx_int8 amx_bf16";

    #[test]
    fn the_speed_build_is_the_avx2_build_without_avx512() {
        let f = flags(&format!("{HASWELL} avx_vnni avx512f"));
        assert_eq!(Isa::best(&f).unwrap(), Isa::avx2(&f).unwrap());
        assert_eq!(Isa::avx2(&f).unwrap().key, "avx2");
    }

    #[test]
    fn the_speed_build_takes_what_the_cpu_lists_but_never_amx() {
        let best = Isa::best(&flags(SAPPHIRE_RAPIDS)).unwrap();
        assert_eq!(best.key, "avx512-vbmi-vnni-bf16-avxvnni");
        let args = best.configure_args();
        for on in ["GGML_AVX2", "GGML_AVX512", "GGML_AVX512_VBMI", "GGML_AVX512_VNNI", "GGML_AVX512_BF16"] {
            assert!(args.contains(&format!("-D{on}=ON")), "{on}: {args:?}");
        }
        for off in ["GGML_NATIVE", "GGML_CPU_ALL_VARIANTS", "GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16"] {
            assert!(args.contains(&format!("-D{off}=OFF")), "{off}: {args:?}");
        }
        let only_vnni =
            Isa::best(&flags(&format!("{HASWELL} avx512f avx512cd avx512bw avx512dq avx512vl avx512_vnni")));
        assert_eq!(only_vnni.unwrap().key, "avx512-vnni");
    }

    #[test]
    fn the_parity_build_has_exactly_the_engines_avx2_level() {
        let args = Isa::avx2(&flags(SAPPHIRE_RAPIDS)).unwrap().configure_args();
        let on: Vec<&str> = args.iter().filter_map(|a| a.strip_suffix("=ON")?.strip_prefix("-D")).collect();
        assert_eq!(
            on,
            [
                "LLAMA_BUILD_EXAMPLES",
                "LLAMA_BUILD_SERVER",
                "GGML_SSE42",
                "GGML_AVX",
                "GGML_AVX2",
                "GGML_BMI2",
                "GGML_FMA",
                "GGML_F16C"
            ]
        );
        assert_eq!(args.iter().filter(|a| a.starts_with("-DGGML_") && a.ends_with("=OFF")).count(), 3 + 8);
        // The server without its web UI: nothing is fetched or built with npm.
        for off in ["-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF"] {
            assert!(args.iter().any(|a| a == off), "{off}: {args:?}");
        }
    }

    #[test]
    fn a_target_whose_program_is_missing_is_built() {
        let bin = std::env::temp_dir().join(format!("llama-missing-{}", std::process::id()));
        std::fs::create_dir_all(&bin).unwrap();
        for f in ["libllama.so", "llama-simple"] {
            std::fs::write(bin.join(f), "").unwrap();
        }
        assert_eq!(missing_targets(&bin, TEST_TARGETS), ["llama-bench", "llama-server"]);
        assert!(missing_targets(&bin, &[Target::Llama, Target::Simple]).is_empty());
        std::fs::remove_dir_all(&bin).unwrap();
    }

    #[test]
    fn the_old_unkeyed_build_is_removed_unless_a_process_uses_it() {
        let dir = std::env::temp_dir().join(format!("llama-old-layout-{}", std::process::id()));
        let old = dir.join("build/bin");
        std::fs::create_dir_all(&old).unwrap();
        std::fs::create_dir_all(dir.join("avx2/build")).unwrap();
        std::fs::write(dir.join("parity-llama-0123456789abcdef"), "").unwrap();
        let mut user = Command::new("sleep").arg("30").current_dir(&old).spawn().unwrap();
        remove_old_layout(&dir);
        assert!(old.is_dir() && dir.join("parity-llama-0123456789abcdef").is_file(), "removed while in use");
        user.kill().unwrap();
        user.wait().unwrap();
        remove_old_layout(&dir);
        assert!(!dir.join("build").exists() && !dir.join("parity-llama-0123456789abcdef").exists());
        assert!(dir.join("avx2/build").is_dir(), "a keyed build was touched");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_aarch64_build_is_a_cross_build_at_an_explicit_arm_level() {
        for arch in AARCH64_ARCHS {
            let isa = Isa::aarch64(arch);
            assert_eq!(isa.key, format!("aarch64-{arch}"));
            let args = isa.configure_args();
            let march = format!("-DGGML_CPU_ARM_ARCH={arch}");
            for a in ["-DGGML_NATIVE=OFF", &march, "-DCMAKE_CXX_COMPILER=aarch64-linux-gnu-g++"] {
                assert!(args.iter().any(|x| x == a), "{a}: {args:?}");
            }
            assert!(!args.iter().any(|a| a.contains("AVX") || a.contains("AMX")), "x86 options: {args:?}");
            assert_eq!(isa.cxx(), "aarch64-linux-gnu-g++");
        }
        assert_eq!(Isa::aarch64(AARCH64_ARCHS[0]).key, "aarch64-armv8-a", "the cached NEON build keeps its key");
        assert!(AARCH64_ARCHS.iter().all(|a| !a.contains("fp16") && !a.contains("bf16") && !a.contains("8.6")));
    }

    #[test]
    fn a_cpu_without_avx2_is_refused_with_what_it_lacks() {
        let e = Isa::avx2(&flags("sse4_2 avx")).unwrap_err().to_string();
        assert!(e.contains("lacks avx2, bmi2, fma, f16c"), "{e}");
    }
}
