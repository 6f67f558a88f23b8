//! `cargo xtask parity [--threads N] [--arch A,B] [--level L]`: the engine against llama.cpp on the
//! same synthetic GGUF files, for every architecture the engine runs ([`CASES`]: the models and
//! quantizations per architecture, and each architecture's limit on the logit error), at each ISA
//! level the engine implements and this CPU has (`--level` picks one), each against the llama.cpp
//! build of the same level (`llama.rs`):
//! - `avx2`: the engine with `ENGINE_ISA=avx2` (its AVX2 kernels and the
//!   sums of a build without AVX-512) against the `avx2` build;
//! - `avx512` (CPUs with AVX-512 F, CD, BW, DQ, VL): the engine with `ENGINE_ISA=avx512` against
//!   the speed build (AVX-512 and the VNNI/BF16/VBMI the CPU has, never AMX).
//!
//! `--target aarch64` runs [`ARM_PLAN`] instead, at each ARM level ([`ARM_LEVELS`]: `neon`,
//! `dotprod`, `i8mm`; `--level` picks one): the engine cross-built for aarch64 against llama.cpp's
//! aarch64 cross build for that level, both under `qemu-aarch64` on a CPU model of that level
//! (where llama.cpp repacks weights with `dotprod` and `i8mm`, and the engine follows its repacked
//! orders); emulation checks correctness only, on a small set. There every kernel follows
//! llama.cpp's float order, so the final logits must be bit-identical (any other bits are a
//! mismatch). `--target aarch64 --negative-control` shows that this check can fail
//! ([`negative_control_aarch64`]): at the `neon` level an engine built with the test-only feature
//! `parity-negative-control` (its plain `Q8_0` kernel adds the same products in another float
//! order) must fail where the engine as built passes; `cargo xtask test --target aarch64` runs it.
//!
//! Each level prints its environment and build. Before any level, the AMX check (`amx.rs`)
//! runs on every build. At each level, for each model: the greedy continuation of three prompts
//! over 64 tokens must be identical token for token, and the logits that chose the last token
//! must agree: the error reported is `max_i |engine_i - llama_i| / max_i |llama_i|` (relative to
//! the logit scale). The aim is at most 1e-3; the architecture's limit (1e-2 unless [`CASES`]
//! says otherwise) or more counts as a mismatch. (The engine reproduces llama.cpp's arithmetic,
//! so on an x86 machine the logits are expected to be bit-identical, error 0; the run says how
//! many are.) A fourth, long prompt on one model per architecture (over 256 tokens, so that
//! llama.cpp's KV view grows to 512 cells and its flash attention splits the cells across
//! threads; for gpt-oss over 512 tokens, so that the sliding-window layers' 512-cell ring is
//! reused from cell 0) checks those paths. Tokenization of a set of strings must be identical
//! too. Exit status 1 on any mismatch at any level.
//!
//! llama.cpp runs with its default context parameters except where stated in
//! `parity_llama.cpp`: F16 KV cache and flash attention explicitly on (what `AUTO` resolves to
//! on the CPU backend, and what `llama-bench` measures in `cargo xtask bench engine`), and
//! `swa_full = false` (sliding-window layers in a ring of `pad(n_swa + n_ubatch, 256)` cells, as
//! llama-server, llama-cli and llama-bench run them and as the engine implements them).
//! Both sides process the prompt one token at a time (`UBATCH = 1`), so that both run their
//! matrix-vector kernels (llama.cpp's batched prompt path uses GEMM kernels and a tiled flash
//! attention whose roundings differ in the last bit). The engine's batched prompt must also
//! give the same bits as its token-by-token one (prompts up to 256 tokens). As a yardstick for how chaotic these
//! random models are, the run also compares llama.cpp with itself (prompt in one batch vs token
//! by token): on quantized MoE models a last-bit difference can move an 8-bit activation code,
//! an f16 rounding or a top-k expert choice, and from there the two runs drift apart.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::llama;

const PROMPTS: [&str; 3] = [
    "The quick brown fox",
    "Once upon a time there was a little language model that",
    "<|im_start|>user\nWhere does the time of a token go?<|im_end|>\n<|im_start|>assistant\n",
];

/// The long prompt: a sentence repeated `repeats` times; 8 repeats pass 256 tokens (312 with
/// the synthetic vocabulary), 16 pass 512 (624), past the 512 cells of the parity runner's
/// sliding-window cache, whose cells are then reused.
fn long_prompt(repeats: usize) -> String {
    vec!["The quick brown fox jumps over the lazy dog near the river bank."; repeats].join(" ")
}

const TOKENIZE: [&str; 8] = [
    "Hello world",
    "It's what they're saying: we've seen 12345 pages, I'm sure.",
    "  leading spaces and\ttabs\n\nnew lines  ",
    "mixture-of-experts (MoE) décodage — naïve café 東京 🚀",
    "<|im_start|>system\nYou are helpful.<|im_end|>",
    "numbers 3.14159 and 2026-11-29",
    "'s 'S 'll 'LL 'd",
    "",
];

const N_GEN: usize = 64;
const UBATCH: usize = 1;
const AIM_REL_ERR: f64 = 1e-3;

/// One architecture's parity models: `engine synth` arguments (a preset and shape overrides),
/// the quantizations, which of them also runs the long prompt, and the limit on the final-logit
/// error (see the module docs).
struct Case {
    arch: &'static str,
    shape: &'static [&'static str],
    quants: &'static [&'static str],
    long_prompt_quant: &'static str,
    /// Sentences in the long prompt ([`long_prompt`]).
    long_prompt_repeats: usize,
    max_rel_err: f64,
}

const CASES: [Case; 4] = [
    Case {
        arch: "qwen3moe",
        shape: &[
            "--preset",
            "tiny",
            "--layers",
            "4",
            "--hidden",
            "1024",
            "--heads",
            "16",
            "--kv-heads",
            "4",
            "--head-dim",
            "64",
            "--experts",
            "16",
            "--experts-used",
            "4",
            "--expert-ffn",
            "512",
            "--vocab",
            "4096",
            "--output-skew",
            "2.5",
        ],
        quants: &["q8_0", "q4_k", "q4_k_m"],
        long_prompt_quant: "q4_k_m",
        long_prompt_repeats: 8,
        max_rel_err: 1e-2,
    },
    Case {
        arch: "olmoe",
        shape: &[
            "--preset",
            "olmoe-tiny",
            "--layers",
            "4",
            "--hidden",
            "1024",
            "--heads",
            "16",
            "--kv-heads",
            "16",
            "--head-dim",
            "64",
            "--experts",
            "16",
            "--experts-used",
            "4",
            "--expert-ffn",
            "512",
            "--vocab",
            "4096",
            "--output-skew",
            "2.5",
        ],
        quants: &["q8_0", "q4_k_m"],
        long_prompt_quant: "q4_k_m",
        long_prompt_repeats: 8,
        max_rel_err: 1e-2,
    },
    // Layers 0-2 DeltaNet, 3 full attention (interval 4); real head and RoPE shapes, 4 Q/K and
    // 8 V heads (so V heads share Q/K heads as in the released model).
    Case {
        arch: "qwen35moe",
        shape: &[
            "--preset",
            "qwen35moe-tiny",
            "--layers",
            "4",
            "--hidden",
            "1024",
            "--heads",
            "8",
            "--kv-heads",
            "2",
            "--head-dim",
            "256",
            "--rope-dims",
            "64",
            "--rope-sections",
            "11,11,10,0",
            "--experts",
            "16",
            "--experts-used",
            "4",
            "--expert-ffn",
            "512",
            "--shared-ffn",
            "512",
            "--ssm-state",
            "128",
            "--ssm-k-heads",
            "4",
            "--ssm-v-heads",
            "8",
            "--vocab",
            "4096",
            "--output-skew",
            "2.5",
        ],
        quants: &["q8_0", "q4_k_m"],
        long_prompt_quant: "q4_k_m",
        long_prompt_repeats: 8,
        max_rel_err: 1e-2,
    },
    // Layers 0 and 2 slide over 32 positions, 1 and 3 attend to everything.
    Case {
        arch: "gpt-oss",
        shape: &[
            "--preset",
            "gpt-oss-tiny",
            "--layers",
            "4",
            "--hidden",
            "1024",
            "--heads",
            "16",
            "--kv-heads",
            "4",
            "--head-dim",
            "64",
            "--experts",
            "16",
            "--experts-used",
            "4",
            "--expert-ffn",
            "512",
            "--sliding-window",
            "32",
            "--vocab",
            "4096",
            "--output-skew",
            "2.5",
        ],
        quants: &["mxfp4", "q8_0"],
        long_prompt_quant: "mxfp4",
        long_prompt_repeats: 16,
        max_rel_err: 1e-2,
    },
];

/// What one parity run covers and how its programs run.
struct Plan {
    cases: &'static [Case],
    prompts: &'static [&'static str],
    n_gen: usize,
    /// Each case's long prompt too.
    long_prompts: bool,
    /// Run the engine and the runner under `qemu-aarch64` with this `QEMU_CPU`.
    qemu_cpu: Option<&'static str>,
    /// Final logits that are not bit-identical count as a mismatch (whatever their error).
    bits: bool,
}

/// The x86-64 levels: every architecture, all prompts, natively.
const X86_PLAN: Plan =
    Plan { cases: &CASES, prompts: &PROMPTS, n_gen: N_GEN, long_prompts: true, qemu_cpu: None, bits: false };

/// The aarch64 levels under emulation, which runs tens of times slower: the tiny qwen3moe model
/// in `Q8_0` and `Q4_K_M` (the `Q8_0`, `Q4_K` and `Q6_K` kernels) and the tiny gpt-oss model in
/// `MXFP4`, the two short prompts, 16 tokens; on the qemu CPU of each level ([`ARM_LEVELS`]).
/// Every kernel of this set follows llama.cpp's float order at every level, so the final logits
/// must be bit-identical: any other bits are a mismatch.
const ARM_PLAN: Plan = Plan {
    cases: &ARM_CASES,
    prompts: &[PROMPTS[0], PROMPTS[1]],
    n_gen: 16,
    long_prompts: false,
    qemu_cpu: None,
    bits: true,
};

/// The negative control's set ([`negative_control_aarch64`]): the tiny qwen3moe model in `Q8_0`,
/// one prompt, 16 tokens, at the `neon` level (where the engine runs the plain `Q8_0` kernel
/// that the test-only feature perturbs).
const CONTROL_PLAN: Plan = Plan { cases: &CONTROL_CASES, prompts: &[PROMPTS[0]], ..ARM_PLAN };
const CONTROL_CASES: [Case; 1] = [Case { quants: &["q8_0"], ..ARM_CASES[0] }];
// The ARM plans require bit-identical logits (the control would show nothing otherwise); x86-64's
// counts them.
const _: () = assert!(ARM_PLAN.bits && CONTROL_PLAN.bits && !X86_PLAN.bits);

/// An aarch64 level: the qemu CPU both programs run on and the llama.cpp cross build for it
/// (`llama::AARCH64_ARCHS`). The engine runs `ENGINE_ISA=neon` at each: its kernels follow the
/// CPU's `dotprod` and `i8mm` at run time, as llama.cpp's repacking does.
struct ArmLevel {
    level: Level,
    qemu_cpu: &'static str,
    arch: &'static str,
}

const ARM_LEVELS: [ArmLevel; 3] = [
    // ARMv8.0: NEON without `dotprod`; ggml repacks nothing.
    ArmLevel { level: Level::Neon, qemu_cpu: "cortex-a72", arch: llama::AARCH64_ARCHS[0] },
    // ARMv8.2 with `dotprod`, without `i8mm`: ggml's `dotprod` layouts (`Q8_0` 4x4, `Q4_K`,
    // `Q5_K`, `Q6_K` 8x4, `MXFP4` 4x4).
    ArmLevel { level: Level::Dotprod, qemu_cpu: "cortex-a76", arch: llama::AARCH64_ARCHS[1] },
    // qemu's `max` is its one CPU with `i8mm` (it has SVE, BF16 and FP16 too, which neither
    // program's build uses): ggml's `i8mm` layouts (`Q8_0` 4x8, `Q4_K`, `Q5_K`, `Q6_K` 8x8;
    // `MXFP4` 4x4).
    ArmLevel { level: Level::I8mm, qemu_cpu: "max", arch: llama::AARCH64_ARCHS[2] },
];

const ARM_CASES: [Case; 2] = [
    Case {
        arch: "qwen3moe",
        shape: &["--preset", "tiny"],
        quants: &["q8_0", "q4_k_m"],
        long_prompt_quant: "",
        long_prompt_repeats: 0,
        max_rel_err: 1e-2,
    },
    // The `MXFP4` kernel (`ggml_vec_dot_mxfp4_q8_0`: llama.cpp repacks `MXFP4` only with `dotprod`).
    Case {
        arch: "gpt-oss",
        shape: &["--preset", "gpt-oss-tiny"],
        quants: &["mxfp4"],
        long_prompt_quant: "",
        long_prompt_repeats: 0,
        max_rel_err: 1e-2,
    },
];

/// qemu for aarch64 programs (plain, never `-L`: see `cross.rs`).
const QEMU: &str = "/usr/bin/qemu-aarch64";

impl Plan {
    /// A command running `program` as this plan runs programs.
    fn command(&self, program: &Path) -> Command {
        match self.qemu_cpu {
            Some(cpu) => {
                let mut c = Command::new(QEMU);
                c.env("QEMU_CPU", cpu).arg(program);
                c
            }
            None => Command::new(program),
        }
    }
}

fn read_f32s(path: &Path) -> Result<Vec<f32>> {
    let b = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
}

/// `max_i |a_i - b_i| / max_i |b_i|`.
fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    if a.len() != b.len() || a.is_empty() {
        return f64::INFINITY;
    }
    let scale = b.iter().fold(0f64, |m, &v| m.max(f64::from(v).abs()));
    a.iter().zip(b).fold(0f64, |m, (&x, &y)| m.max((f64::from(x) - f64::from(y)).abs())) / scale
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array().map(|a| a.iter().filter_map(Value::as_u64).collect()).unwrap_or_default()
}

/// An ISA level of the engine (`ENGINE_ISA`), checked against the llama.cpp build of the same
/// level.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    /// The engine's AVX2 kernels and the numerics of a build without AVX-512, against the
    /// `avx2` build.
    Avx2,
    /// The engine's AVX-512 level, against the speed build (which has AVX-512 on).
    Avx512,
    /// The engine's aarch64 NEON kernels, cross-built, against the `armv8-a` cross build, both
    /// under `qemu-aarch64` on a CPU without `dotprod` ([`ARM_LEVELS`]).
    Neon,
    /// The same engine on a CPU with `dotprod` (its `sdot` kernels in ggml's repacked orders),
    /// against the `armv8.2-a+dotprod` cross build.
    Dotprod,
    /// The same engine on a CPU with `dotprod` and `i8mm` (ggml's `i8mm` repacked orders),
    /// against the `armv8.2-a+dotprod+i8mm` cross build.
    I8mm,
}

impl Level {
    pub fn name(self) -> &'static str {
        match self {
            Level::Avx2 => "avx2",
            Level::Avx512 => "avx512",
            Level::Neon => "neon",
            Level::Dotprod => "dotprod",
            Level::I8mm => "i8mm",
        }
    }

    /// The engine's environment at this level: `ENGINE_ISA` selects its kernels and the
    /// numerics of the llama.cpp build it reproduces (`engine/src/quant/mod.rs`); the aarch64
    /// levels are all `neon`, whose kernels follow the (emulated) CPU.
    fn env(self) -> (&'static str, &'static str) {
        match self {
            Level::Dotprod | Level::I8mm => ("ENGINE_ISA", Level::Neon.name()),
            _ => ("ENGINE_ISA", self.name()),
        }
    }

    fn describe_env(self) -> String {
        let (k, v) = self.env();
        format!("{k}={v}")
    }
}

/// The levels this CPU and these builds allow, each with its build: `avx2` always, `avx512`
/// when the speed build has AVX-512 (the CPU has AVX-512 F, CD, BW, DQ and VL).
pub fn levels(builds: &llama::Builds) -> Vec<(Level, &llama::Build)> {
    let mut v = vec![(Level::Avx2, &builds.avx2)];
    if builds.best().isa.avx512() {
        v.push((Level::Avx512, builds.best()));
    }
    v
}

pub fn main(args: &[String]) -> Result<()> {
    let usage = "usage: cargo xtask parity [--threads N] [--arch A[,B…]] [--level avx2|avx512] [--target aarch64 [--level neon|dotprod|i8mm | --negative-control]] (architectures: qwen3moe, olmoe, qwen35moe, gpt-oss)";
    let mut threads = 2;
    let mut archs: Option<Vec<String>> = None;
    let mut only: Option<String> = None;
    let mut target: Option<String> = None;
    let mut control = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--threads" => threads = it.next().context(usage)?.parse().context("--threads N")?,
            "--arch" => archs = Some(it.next().context(usage)?.split(',').map(str::to_owned).collect()),
            "--level" => only = Some(it.next().context(usage)?.clone()),
            "--target" => target = Some(it.next().context(usage)?.clone()),
            "--negative-control" => control = true,
            _ => bail!("{usage}"),
        }
    }
    match target.as_deref() {
        None if control => bail!("--negative-control is a check of the aarch64 parity (--target aarch64)\n{usage}"),
        None => {}
        Some("aarch64") if control && (archs.is_some() || only.is_some()) => {
            bail!("--negative-control runs its own case (tiny qwen3moe Q8_0 at the neon level)\n{usage}")
        }
        Some("aarch64") if control => return control_aarch64(threads),
        Some("aarch64") if archs.is_none() => return run_aarch64(threads, only.as_deref()),
        Some("aarch64") => {
            bail!(
                "parity --target aarch64 runs its own set (tiny qwen3moe and gpt-oss; --level picks a level)\n{usage}"
            )
        }
        Some(t) => bail!("parity: unknown target {t:?} (aarch64 is the one cross target)\n{usage}"),
    }
    if let Some(l) = &only
        && ![Level::Avx2, Level::Avx512].iter().any(|v| v.name() == l.as_str())
    {
        bail!("parity: unknown level {l:?}\n{usage}");
    }
    if let Some(a) = &archs
        && let Some(bad) = a.iter().find(|a| !CASES.iter().any(|c| c.arch == a.as_str()))
    {
        bail!("parity: unknown architecture {bad:?}\n{usage}");
    }
    let builds = llama::ensure(llama::PARITY_TARGETS)?;
    llama::check_no_amx(&builds)?;
    let engine = llama::build_engine()?;
    let mut failed = Vec::new();
    let levels = levels(&builds);
    if let Some(l) = &only
        && !levels.iter().any(|(v, _)| v.name() == l.as_str())
    {
        bail!("parity: level {l} is not available on this CPU (it lacks AVX-512 F, CD, BW, DQ or VL)");
    }
    for (level, build) in levels.into_iter().filter(|(v, _)| only.as_deref().is_none_or(|l| l == v.name())) {
        if let Err(e) = run_archs(&X86_PLAN, level, build, &engine, &engine, threads, archs.as_deref()) {
            println!("parity at the {} level: {e:#}", level.name());
            failed.push(level.name());
        }
    }
    if !failed.is_empty() {
        bail!("parity failed at the {} level(s)", failed.join(", "));
    }
    Ok(())
}

/// Parity of the engine at `level` against `build` on every architecture: tokenization, greedy
/// continuations, logits.
pub fn run_level(level: Level, build: &llama::Build, engine: &Path, threads: usize) -> Result<()> {
    run_archs(&X86_PLAN, level, build, engine, engine, threads, None)
}

/// `cargo xtask parity --target aarch64 [--level L]`: the engine cross-built for aarch64 against
/// llama.cpp's aarch64 cross build of each level ([`ARM_LEVELS`], or the one named), both under
/// `qemu-aarch64` on that level's CPU ([`ARM_PLAN`]). The models are written by the host's engine
/// (the file is the same whoever writes it).
pub fn run_aarch64(threads: usize, only: Option<&str>) -> Result<()> {
    let names: Vec<&str> = ARM_LEVELS.iter().map(|l| l.level.name()).collect();
    if let Some(l) = only
        && !names.contains(&l)
    {
        bail!("parity --target aarch64: unknown level {l:?} (levels: {})", names.join(", "));
    }
    crate::cross::packages()?;
    let host_engine = llama::build_engine()?;
    let engine = crate::cross::build_engine()?;
    let mut failed = Vec::new();
    for arm in ARM_LEVELS.iter().filter(|l| only.is_none_or(|o| o == l.level.name())) {
        let build = llama::ensure_aarch64(arm.arch, llama::PARITY_TARGETS)?;
        let plan = Plan { qemu_cpu: Some(arm.qemu_cpu), ..ARM_PLAN };
        if let Err(e) = run_archs(&plan, arm.level, &build, &engine, &host_engine, threads, None) {
            println!("parity at the {} level: {e:#}", arm.level.name());
            failed.push(arm.level.name());
        }
    }
    if !failed.is_empty() {
        bail!("aarch64 parity failed at the {} level(s)", failed.join(", "));
    }
    Ok(())
}

/// `cargo xtask parity --target aarch64 --negative-control`: [`negative_control_aarch64`] with the
/// engine and its perturbed build cross-built here (`cargo xtask test --target aarch64` runs it
/// too).
fn control_aarch64(threads: usize) -> Result<()> {
    crate::cross::packages()?;
    let host_engine = llama::build_engine()?;
    let perturbed = crate::cross::build_perturbed_engine()?;
    let engine = crate::cross::build_engine()?;
    negative_control_aarch64(&engine, &perturbed, &host_engine, threads)
}

/// [`run_level`] by `plan` on the architectures named in `archs` (all when `None`); `synth` is an
/// engine binary that runs here, to write the models. An error on any mismatch.
fn run_archs(
    plan: &Plan,
    level: Level,
    build: &llama::Build,
    engine: &Path,
    synth: &Path,
    threads: usize,
    archs: Option<&[String]>,
) -> Result<()> {
    let failures = compare(plan, level, build, engine, synth, threads, archs)?;
    if failures > 0 {
        bail!("{failures} mismatches against the {}", build.describe());
    }
    Ok(())
}

/// The comparisons of [`run_archs`], printed; the number of mismatches (an error only when a
/// program cannot be run or its output read).
fn compare(
    plan: &Plan,
    level: Level,
    build: &llama::Build,
    engine: &Path,
    synth: &Path,
    threads: usize,
    archs: Option<&[String]>,
) -> Result<usize> {
    let (t0, cpu0) = (std::time::Instant::now(), crate::cmd::children_cpu());
    let emulated = plan.qemu_cpu.map_or(String::new(), |cpu| format!(", both under qemu-aarch64 (QEMU_CPU={cpu})"));
    println!(
        "== parity at the {} level: engine with {} vs {}{emulated}",
        level.name(),
        level.describe_env(),
        build.describe()
    );
    let engine_cmd = || {
        let mut c = plan.command(engine);
        let (k, v) = level.env();
        c.env(k, v);
        c
    };
    let n_gen = plan.n_gen;
    // Per process: parity runs of other clones may share the cache.
    let tmp = crate::cache::dir()?.join("parity-tmp").join(std::process::id().to_string());
    std::fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    let mut failures = 0;
    let mut worst = 0f64;
    let (mut bit_identical, mut compared) = (0, 0);

    for case in plan.cases.iter().filter(|c| archs.is_none_or(|a| a.iter().any(|x| x == c.arch))) {
        for &quant in case.quants {
            let mut args: Vec<&str> = case.shape.to_vec();
            args.extend(["--quant", quant]);
            let name = if case.arch == "qwen3moe" {
                format!("parity-{quant}")
            } else {
                format!("parity-{}-{quant}", case.arch)
            };
            let model = llama::synth_model(synth, &name, &args)?;
            println!("== {} {quant}: {}", case.arch, model.display());

            // Tokenization.
            let mut cmd = plan.command(&build.harness);
            cmd.arg("tokenize").arg(&model).args(TOKENIZE);
            let reference: Value =
                serde_json::from_str(&crate::cmd::output(&mut cmd)?).context("parsing parity-llama tokenize output")?;
            let ref_tokens = reference["tokens"].as_array().cloned().unwrap_or_default();
            let mut tok_ok = 0;
            for (i, text) in TOKENIZE.iter().enumerate() {
                let ours: Value = serde_json::from_str(&crate::cmd::output(
                    engine_cmd().arg("tokenize").arg("--model").arg(&model).arg("--text").arg(text),
                )?)?;
                let theirs = ref_tokens.get(i).map(ids).unwrap_or_default();
                if ids(&ours) == theirs {
                    tok_ok += 1;
                } else {
                    failures += 1;
                    println!("  tokenize MISMATCH {text:?}\n    engine:    {ours}\n    llama.cpp: {theirs:?}");
                }
            }
            println!("  tokenization: {tok_ok}/{} strings identical", TOKENIZE.len());

            // Greedy continuation and final logits.
            let mut prompts: Vec<String> = plan.prompts.iter().map(|p| (*p).to_owned()).collect();
            if plan.long_prompts && quant == case.long_prompt_quant {
                prompts.push(long_prompt(case.long_prompt_repeats));
            }
            for (pi, prompt) in prompts.iter().enumerate() {
                let ll_logits = tmp.join(format!("{}-{quant}-{pi}.llama.f32", case.arch));
                let en_logits = tmp.join(format!("{}-{quant}-{pi}.engine.f32", case.arch));
                let r: Value = serde_json::from_str(&crate::cmd::output(
                    plan.command(&build.harness)
                        .arg("generate")
                        .arg(&model)
                        .arg(threads.to_string())
                        .arg(n_gen.to_string())
                        .arg(&ll_logits)
                        .arg(prompt)
                        .arg(UBATCH.to_string()),
                )?)
                .context("parsing parity-llama generate output")?;
                let out = crate::cmd::output(
                    engine_cmd()
                        .arg("run")
                        .arg("--model")
                        .arg(&model)
                        .args(["--prompt", prompt, "-n", &n_gen.to_string(), "--temp", "0", "--ignore-eos", "--json"])
                        .args(["--threads", &threads.to_string(), "--ubatch", &UBATCH.to_string()])
                        .args(["--force", "--logits-out"])
                        .arg(&en_logits),
                )?;
                // The engine's batched prompt must give the same bits as its token-by-token one
                // (its batched kernels compute every element like the one-token kernels); beyond
                // 256 positions llama.cpp splits single-token attention across threads and so does
                // the engine, which batches do not, as in llama.cpp.
                let en_batched = tmp.join(format!("{}-{quant}-{pi}.engine-batched.f32", case.arch));
                let out_b = crate::cmd::output(
                    engine_cmd()
                        .arg("run")
                        .arg("--model")
                        .arg(&model)
                        .args(["--prompt", prompt, "-n", &n_gen.to_string(), "--temp", "0", "--ignore-eos", "--json"])
                        .args(["--threads", &threads.to_string(), "--ubatch", "256"])
                        .args(["--force", "--logits-out"])
                        .arg(&en_batched),
                )?;
                let batched: Value = serde_json::from_str(&crate::cmd::output(
                    plan.command(&build.harness)
                        .arg("generate")
                        .arg(&model)
                        .arg(threads.to_string())
                        .arg(n_gen.to_string())
                        .arg(tmp.join("batched.f32"))
                        .arg(prompt)
                        .arg("256"),
                )?)
                .context("parsing parity-llama generate output")?;
                let self_same = ids(&batched["ids"]).iter().zip(&ids(&r["ids"])).take_while(|(a, b)| a == b).count();
                let self_rel = rel_err(&read_f32s(&tmp.join("batched.f32"))?, &read_f32s(&ll_logits)?);
                let lines: Vec<Value> =
                    out.lines().map(serde_json::from_str).collect::<Result<_, _>>().context("parsing engine --json")?;
                let ours: Vec<u64> = lines.iter().filter_map(|l| l.get("id").and_then(Value::as_u64)).collect();
                let summary = lines.last().context("engine printed nothing")?;
                let theirs = ids(&r["ids"]);
                let same_prompt = ids(&summary["prompt_ids"]) == ids(&r["prompt"]);
                let first_diff = ours.iter().zip(&theirs).position(|(a, b)| a != b);
                let (a, b) = (read_f32s(&en_logits)?, read_f32s(&ll_logits)?);
                let rel = rel_err(&a, &b);
                worst = worst.max(rel);
                compared += 1;
                let identical = a.len() == b.len() && a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits());
                bit_identical += usize::from(identical);
                let ours_b: Vec<u64> = out_b
                    .lines()
                    .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                    .filter_map(|l| l.get("id").and_then(Value::as_u64))
                    .collect();
                let batch_same = ours_b == ours && read_f32s(&en_batched)? == a;
                let batch_required = ids(&r["prompt"]).len() <= 256;
                let ok = same_prompt
                    && ours == theirs
                    && ours.len() == n_gen
                    && rel < case.max_rel_err
                    && (identical || !plan.bits)
                    && (batch_same || !batch_required);
                println!(
                    "  prompt {pi} ({} tokens): {}/{} generated tokens identical, final logits {} (max rel err {rel:.2e}) -> {}",
                    ids(&r["prompt"]).len(),
                    first_diff.unwrap_or(ours.len().min(theirs.len())),
                    n_gen,
                    if identical { "bit-identical" } else { "differ" },
                    if !ok {
                        if plan.bits && !identical { "MISMATCH (bit-identical logits required)" } else { "MISMATCH" }
                    } else if rel < AIM_REL_ERR {
                        "ok"
                    } else {
                        "ok (logits above the 1e-3 aim)"
                    }
                );
                println!(
                    "    engine, prompt batched vs token by token: {}{}",
                    if batch_same { "bit-identical" } else { "DIFFERENT" },
                    if batch_required { "" } else { " (not required: prompt longer than 256 tokens)" }
                );
                println!(
                    "    (llama.cpp vs itself, prompt batched vs token by token: {self_same}/{n_gen} identical, rel err {self_rel:.2e})"
                );
                if !ok {
                    failures += 1;
                    if !same_prompt {
                        println!(
                            "    prompt ids differ: engine {} vs llama.cpp {}",
                            summary["prompt_ids"], r["prompt"]
                        );
                    }
                    println!("    engine:    {ours:?}\n    llama.cpp: {theirs:?}");
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(&tmp);
    println!(
        "{} level: final logits bit-identical in {bit_identical}/{compared} runs; worst relative error: {worst:.2e} (aim {AIM_REL_ERR:.0e})",
        level.name()
    );
    let (wall, cpu) = (t0.elapsed().as_secs_f64(), crate::cmd::children_cpu() - cpu0);
    if failures > 0 {
        println!("parity at the {} level: {failures} mismatches; {wall:.0} s wall, {cpu:.0} s CPU", level.name());
    } else {
        println!(
            "parity at the {} level: engine matches the {} (llama-cpp-python {} sources); {wall:.0} s wall, {cpu:.0} s CPU",
            level.name(),
            build.describe(),
            llama::LLAMA_CPP_PYTHON,
        );
    }
    Ok(failures)
}

/// The negative control of the aarch64 check: at the `neon` level ([`CONTROL_PLAN`]: the tiny
/// qwen3moe `Q8_0` model, one prompt), `engine` must pass and `perturbed` (the same engine built
/// with the test-only feature `parity-negative-control`, whose plain `Q8_0` kernel adds the same
/// products in another float order) must fail, so that "bit-identical" cannot pass vacuously.
/// `synth` writes the model. Both programs run under `qemu-aarch64`.
pub fn negative_control_aarch64(engine: &Path, perturbed: &Path, synth: &Path, threads: usize) -> Result<()> {
    let arm = &ARM_LEVELS[0];
    let build = llama::ensure_aarch64(arm.arch, llama::PARITY_TARGETS)?;
    let plan = Plan { qemu_cpu: Some(arm.qemu_cpu), ..CONTROL_PLAN };
    println!("== negative control: the engine as built, then with its Q8_0 kernel's float order perturbed");
    let normal = compare(&plan, arm.level, &build, engine, synth, threads, None)?;
    if normal > 0 {
        bail!("negative control: the engine as built mismatches on the control's case, so the control shows nothing");
    }
    let perturbed = compare(&plan, arm.level, &build, perturbed, synth, threads, None)?;
    if perturbed == 0 {
        bail!(
            "negative control: the parity check passed an engine whose Q8_0 kernel sums in another float order: \
             it does not check the bits"
        );
    }
    println!(
        "negative control: ok (the engine as built passes; with its Q8_0 kernel's order perturbed, the check fails \
         with {perturbed} mismatch(es))"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The feature perturbs the plain layout's `Q8_0` kernel, which only the `neon` level (a CPU
    /// without `dotprod`) runs: the control must run there, on a `Q8_0` model.
    #[test]
    fn the_negative_control_runs_a_q8_0_model_at_the_plain_neon_level() {
        assert_eq!(ARM_LEVELS[0].level, Level::Neon);
        assert_eq!(ARM_LEVELS[0].qemu_cpu, "cortex-a72");
        assert_eq!(CONTROL_PLAN.cases.len(), 1);
        assert_eq!(CONTROL_PLAN.cases[0].quants, ["q8_0"]);
        assert_eq!(CONTROL_PLAN.cases[0].shape, ARM_CASES[0].shape);
    }

    #[test]
    fn rel_err_is_relative_to_the_reference_scale_and_infinite_on_a_length_mismatch() {
        assert_eq!(rel_err(&[1.0, 2.0], &[1.0, 4.0]), 0.5);
        assert_eq!(rel_err(&[1.0], &[1.0, 2.0]), f64::INFINITY);
    }
}
