//! llama.cpp, the engine's correctness and speed reference, built once into the cache.
//!
//! Layout under `${XDG_CACHE_HOME:-$HOME/.cache}/moe-observer/llama.cpp/<llama-cpp-python version>/`:
//! `dl/` (the sdist from PyPI), `src/` (its vendored llama.cpp), `build/` (cmake, CPU only,
//! `-DGGML_NATIVE=ON -DLLAMA_CURL=OFF`, targets `llama` and `llama-bench`), and
//! `parity-llama-<hash>` (our reference runner, `parity_llama.cpp`, compiled against that
//! libllama). Anything missing is rebuilt; cmake is installed with apt-get when absent.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

/// The pinned llama-cpp-python release; its sdist vendors llama.cpp.
pub const LLAMA_CPP_PYTHON: &str = "0.3.36";
const HARNESS_SRC: &str = include_str!("parity_llama.cpp");

pub struct Llama {
    pub bench: PathBuf,
    pub harness: PathBuf,
}

fn have(tool: &str) -> bool {
    Command::new(tool).arg("--version").output().is_ok_and(|o| o.status.success())
}

/// Installs cmake with apt-get when it is missing (idempotent).
pub fn ensure_cmake() -> Result<()> {
    if have("cmake") {
        return Ok(());
    }
    eprintln!("xtask: cmake missing, installing it with apt-get");
    let install = || Command::new("apt-get").args(["install", "-y", "cmake"]).status();
    if !install().is_ok_and(|s| s.success()) {
        crate::cmd::run(Command::new("apt-get").arg("update"))?;
        crate::cmd::run(Command::new("apt-get").args(["install", "-y", "cmake"]))?;
    }
    if !have("cmake") {
        bail!("cmake is still not runnable after apt-get install -y cmake");
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
        crate::cmd::run(
            Command::new("python3")
                .args(["-m", "pip", "download", "--no-deps", "--no-binary", ":all:"])
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

/// Builds (if needed) llama.cpp and the reference runner; returns their paths.
pub fn ensure() -> Result<Llama> {
    let dir = crate::cache::dir()?.join("llama.cpp").join(LLAMA_CPP_PYTHON);
    let build = dir.join("build");
    let lib_dir = build.join("bin");
    let bench = lib_dir.join("llama-bench");
    if !bench.is_file() || !lib_dir.join("libllama.so").is_file() {
        ensure_cmake()?;
        let src = ensure_source(&dir)?;
        eprintln!("xtask: building llama.cpp ({LLAMA_CPP_PYTHON}) in {} — several minutes", build.display());
        crate::cmd::run(Command::new("cmake").arg("-S").arg(&src).arg("-B").arg(&build).args([
            "-DCMAKE_BUILD_TYPE=Release",
            "-DGGML_NATIVE=ON",
            "-DLLAMA_CURL=OFF",
            "-DLLAMA_OPENSSL=OFF",
            "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF",
            "-DLLAMA_BUILD_SERVER=OFF",
        ]))?;
        let jobs = std::thread::available_parallelism().map_or(1, |n| n.get()).to_string();
        crate::cmd::run(Command::new("cmake").arg("--build").arg(&build).args([
            "-j",
            &jobs,
            "--target",
            "llama-bench",
            "llama",
        ]))?;
    }
    let src = dir.join("src");
    let hash =
        HARNESS_SRC.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    let harness = dir.join(format!("parity-llama-{hash:016x}"));
    if !harness.is_file() {
        let cpp = dir.join("parity_llama.cpp");
        std::fs::write(&cpp, HARNESS_SRC).with_context(|| format!("writing {}", cpp.display()))?;
        crate::cmd::run(
            Command::new("c++")
                .args(["-O2", "-std=c++17", "-o"])
                .arg(&harness)
                .arg(&cpp)
                .arg(format!("-I{}", src.join("include").display()))
                .arg(format!("-I{}", src.join("ggml/include").display()))
                .arg(format!("-L{}", lib_dir.display()))
                .args(["-lllama", "-lggml", "-lggml-base"])
                .arg(format!("-Wl,-rpath,{}", lib_dir.display())),
        )?;
    }
    Ok(Llama { bench, harness })
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
    let cfg = crate::cmd::output(Command::new(engine).arg("synth").args(["-o", "/dev/null", "--dry-run"]).args(args))?;
    let hash = cfg.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    let dir = crate::cache::dir()?.join("models");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join(format!("{name}-{hash:016x}.gguf"));
    if !path.is_file() {
        let tmp = path.with_extension("gguf.tmp");
        crate::cmd::run(Command::new(engine).arg("synth").arg("-o").arg(&tmp).args(args))?;
        std::fs::rename(&tmp, &path).with_context(|| format!("renaming {}", tmp.display()))?;
    }
    Ok(path)
}
