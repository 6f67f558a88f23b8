//! Quantized tensor formats and kernels, compatible with ggml's CPU backend.
//!
//! # Scope
//! This module knows every ggml type id (so a GGUF loader can size any tensor) and
//! fully implements the ones a Qwen3-MoE GGUF uses: `F32`, `F16`, `BF16`, `Q8_0`,
//! `Q8_1`, `Q8_K` and the K-quants `Q2_K`..`Q6_K`, plus the legacy `Q4_0`, `Q4_1`,
//! `Q5_0`, `Q5_1`. "Implemented" means: [`dequantize_row`], [`quantize_row`] and
//! [`vec_dot`] against the type's [`GgmlType::vec_dot_type`].
//!
//! # ISA levels
//! A [`Backend`] is an ISA level: the instructions its kernels use *and* the llama.cpp build
//! whose numerics they reproduce. The process runs one level, [`isa`]: `ENGINE_ISA=scalar|avx2|
//! avx512|neon` from the environment, or by default the best the CPU has; a level the CPU lacks (or
//! an unknown name) is an error ([`QuantError::IsaUnavailable`], [`QuantError::IsaUnknown`]).
//! Every dispatching entry point ([`vec_dot`], [`matvec`], [`matvec_multi`], [`quantize_row`],
//! and `vmath`'s `exp`) follows it; the `*_on` functions run a given level (tests, benchmarks).
//!
//! | level | CPU features | reproduces the llama.cpp build |
//! |---|---|---|
//! | `scalar` | any | none (portable kernels, own summation order) |
//! | `avx2` | AVX2, FMA, F16C | AVX2+FMA+F16C, no AVX-512, no VNNI |
//! | `avx512` | + AVX-512 F, BW, DQ, VL (VNNI, BF16 used where present) | AVX-512 with VNNI and BF16 as the CPU has them; never AMX, never AVX512-FP16 |
//! | `neon` (aarch64) | ASIMD (`sdot` used where the CPU has `dotprod`) | ARMv8 NEON with `dotprod` and `i8mm` as the CPU has them (the weights repacked as that build repacks them on it) |
//!
//! # Numerics (why results match llama.cpp)
//! * `vec_dot` follows ggml's integer arithmetic exactly: per block the integer dot
//!   product of the quants (times the integer sub-block scales) is formed in `i32`,
//!   then scaled once by `d_w * d_x` in `f32`; the K-quant minimums are applied
//!   through the activation's `bsums`. Any instructions that give the same integers may
//!   be used (VNNI's `vpdpbusd`/`vpdpwssd` do: ggml's own VNNI variants of its
//!   `mul_sum_*` helpers change no integer).
//! * The `f32` arithmetic after that (products of scales, FMAs, horizontal sums) follows,
//!   in the SIMD kernels, the order of the kernel the level's llama.cpp build runs for one
//!   token (`cargo xtask parity` checks the logits bit for bit at each level):
//!   - `Q8_0`, `Q3_K`, `Q5_K`, `Q6_K`: ggml's x86 `ggml_vec_dot_*` (8 FMA lanes, one
//!     `hsum_float_8`); an AVX-512 build compiles the same `__AVX2__` code;
//!   - `Q4_K`: the repacked `ggml_gemv_q4_K_8x8_q8_K` (whole-block integers, two FMA chains)
//!     that llama.cpp uses for every `Q4_K` matrix with a multiple of 8 rows;
//!   - `Q2_K`: `ggml_vec_dot_q2_K_q8_K` at `avx2`; at `avx512` the repacked
//!     `ggml_gemv_q2_K_8x8_q8_K`, because ggml repacks `Q2_K` only when built with AVX-512;
//!   - `F32`/`F16`: `ggml_vec_dot_f32`/`_f16` in the AVX shape (4 x 8 lanes) at `avx2`, the
//!     AVX-512 shape (4 x 16 lanes, GCC's `_mm512_reduce_add_ps`) at `avx512`;
//!   - `BF16`: `ggml_vec_dot_bf16` in its AVX2 shape, its AVX512F shape, or with
//!     `vdpbf16ps` when the CPU has AVX512-BF16 (not checked by `parity`: no BF16 model);
//!   - at `neon`: ggml's NEON `ggml_vec_dot_*` (the `neon` module's docs), `F32`/`F16` in the
//!     NEON shape (4 x 4 lanes, `vaddvq_f32`), `BF16` in ggml's plain `f64` loop.
//!
//!   The scalar kernels, and the x86 `Q4_0` and `Q8_K` kernels, sum in their own order (last-bit
//!   differences from ggml).
//! * [`quantize_row`] for the activation types (`Q8_0`, `Q8_1`, `Q8_K`, `F16`, `BF16`)
//!   is bit-identical to ggml's reference quantizers (`quantize_row_q8_0_ref`,
//!   `quantize_row_q8_1_ref`, `quantize_row_q8_K_ref`, `ggml_compute_fp32_to_fp16`,
//!   `ggml_compute_fp32_to_bf16`).
//! * ggml's CPU backend does **not** use the `_ref` quantizer for `Q8_0`/`Q8_1` on
//!   x86 or ARM: its SIMD quantizers use a differently computed inverse scale and
//!   round half to even. [`quantize_activation`] therefore uses the flavour that
//!   llama.cpp's CPU backend runs on the current architecture
//!   ([`Q8Flavor::native`]); [`quantize_row_q8_0_with`] exposes all three.
//!   `Q8_K`, `F16` and `BF16` activations are the same in every flavour.
//!
//! # Block layouts
//! All multi-byte fields are little-endian; `f16` is IEEE binary16, `bf16` the top
//! half of an `f32`. Each file's header gives the byte layout of its types:
//! [`float`] (F32, F16, BF16), [`q8`] (Q8_0, Q8_1, Q8_K), [`legacy`] (Q4_0, Q4_1,
//! Q5_0, Q5_1) and [`kquants`] (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K).
//!
//! # Kernels
//! Scalar kernels exist for every supported type and every target. On x86_64:
//! * `avx2` (AVX2+FMA+F16C): `F32`, `F16`, `BF16`, `Q8_0`, `Q8_K`, `Q4_0`, `Q2_K`..`Q6_K`, and
//!   multi-activation kernels (prompt processing, 4 activations per pass) for `Q8_0`, `Q4_K`,
//!   `Q6_K`;
//! * `avx512`: its own `F32`, `F16`, `BF16` (ggml's AVX-512 shapes) and `Q2_K` (repacked
//!   order) kernels; with AVX512-VNNI, 512-bit `Q8_0` (two rows per vector), `Q4_K` (eight rows
//!   per step), `Q5_K`, `Q6_K` kernels and multi-activation kernels for those four (16
//!   activations per pass for `Q4_K`, 8 for the others); everything else (and the integer
//!   kernels on a CPU without VNNI) from `avx2`, whose numerics are the same there.
//!
//! On aarch64, `neon`: `Q8_0`, `Q4_0`, `Q2_K`..`Q6_K`, `MXFP4` and multi-activation kernels for
//! those (8 activations per pass), with `sdot` when the CPU has `dotprod` and ggml's emulation of
//! it otherwise, and `F32`/`F16`, in the float order of ggml's NEON `ggml_vec_dot_*` kernels, or,
//! on a CPU with `dotprod` (and `i8mm`), for the types llama.cpp then repacks, in the order of its
//! repacked GEMVs (the `neon` module's docs; checked bit for bit against models of those orders
//! in the tests, under `qemu-aarch64`); its scalar `BF16` kernel is ggml's NEON order too.
//!
//! The other supported types use the scalar kernels at every level. The `Q8_K`, `F16` and
//! x86 `Q8_0` activation quantizers have AVX2 versions, `Q8_K` a NEON one (same bytes; [`quantize_row_on`] picks
//! a backend). Per CPU-second on the development machine (Intel Xeon, Sapphire/Emerald Rapids
//! class, 2 vCPUs; `examples/quant_speed.rs` with `QS_LOOP`, cache-resident matrix of 2048
//! columns, a shared and noisy machine), the `avx512` kernels do about 1.2x (`Q4_K`), 1.25x
//! (`Q6_K`), 1.3x (`Q8_0`) the `avx2` ones for one activation, and 1.7-2x for 8 (`Q4_K`: 16) at a
//! time. There 512-bit shifts (port 0) and permutes (port 5) are single-port while the integer
//! multiplies use both ports (measured), which bounds the one-activation `Q4_K` gain.
//!
//! # Using it in a decode loop
//! * Quantize each activation vector once with [`quantize_activation`] (into a
//!   reused `Vec`), then call [`matvec`] on row ranges; split a matrix's rows
//!   across threads by giving each thread its own `rows` range and `out` slice.
//!   `matvec` is allocation-free and touches only the rows it is given.
//! * Prefer [`matvec`] to one [`vec_dot`] call per row: it hoists per-call work
//!   (dispatch, slicing, the activation's `Q8_K` pair sums) out of the row loop,
//!   which matters for short rows (e.g. 768-column `ffn_down` rows).
//! * Decode is memory-bound: the kernels stream each weight row once. On the
//!   2-core development machine (AMD EPYC, ~23 GB/s single-thread, ~30-33 GB/s
//!   two-thread DRAM read) `examples/quant_speed.rs` measured, for `Q4_K`, about
//!   26 GB/s from cache and ~20 GB/s (1 thread) / ~30 GB/s (2 threads) from DRAM,
//!   the same as ggml's repacked `Q4_K` path measured alternately on the same
//!   machine (the shared machine's bandwidth varies by +-30% from run to run).
//!   llama.cpp's CPU backend repacks `Q4_K`/`Q4_0` weights into 8-row
//!   interleaved blocks at load time (its float summation order then differs from
//!   ggml's plain `vec_dot`, the integer parts do not); this module keeps the GGUF
//!   layout and reproduces the repacked `Q4_K` order (row by row at `avx2`, eight rows at a
//!   time at `avx512`).

pub mod float;
pub mod kquants;
pub mod legacy;
pub mod mxfp4;
pub mod q8;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "aarch64")]
mod neon;

#[cfg(test)]
mod tests;

use std::ops::Range;
use std::sync::OnceLock;

/// Elements per K-quant super-block (ggml's `QK_K`).
pub const QK_K: usize = 256;

/// A ggml tensor type, with ggml's numeric ids (as stored in GGUF files).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[expect(non_camel_case_types, reason = "ggml's own type names, e.g. Q4_K")]
pub enum GgmlType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q8_1 = 9,
    Q2_K = 10,
    Q3_K = 11,
    Q4_K = 12,
    Q5_K = 13,
    Q6_K = 14,
    Q8_K = 15,
    IQ2_XXS = 16,
    IQ2_XS = 17,
    IQ3_XXS = 18,
    IQ1_S = 19,
    IQ4_NL = 20,
    IQ3_S = 21,
    IQ2_S = 22,
    IQ4_XS = 23,
    I8 = 24,
    I16 = 25,
    I32 = 26,
    I64 = 27,
    F64 = 28,
    IQ1_M = 29,
    BF16 = 30,
    TQ1_0 = 34,
    TQ2_0 = 35,
    MXFP4 = 39,
    NVFP4 = 40,
    Q1_0 = 41,
    Q2_0 = 42,
}

impl GgmlType {
    /// Every type this module knows, in id order.
    pub const ALL: [GgmlType; 35] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q8_1,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::Q8_K,
        GgmlType::IQ2_XXS,
        GgmlType::IQ2_XS,
        GgmlType::IQ3_XXS,
        GgmlType::IQ1_S,
        GgmlType::IQ4_NL,
        GgmlType::IQ3_S,
        GgmlType::IQ2_S,
        GgmlType::IQ4_XS,
        GgmlType::I8,
        GgmlType::I16,
        GgmlType::I32,
        GgmlType::I64,
        GgmlType::F64,
        GgmlType::IQ1_M,
        GgmlType::BF16,
        GgmlType::TQ1_0,
        GgmlType::TQ2_0,
        GgmlType::MXFP4,
        GgmlType::NVFP4,
        GgmlType::Q1_0,
        GgmlType::Q2_0,
    ];

    /// The type with ggml id `v`, or `None` for ids ggml never assigned or removed.
    pub fn from_u32(v: u32) -> Option<GgmlType> {
        GgmlType::ALL.iter().copied().find(|t| *t as u32 == v)
    }

    /// ggml's name for the type (`ggml_type_name`), e.g. `"q4_K"`.
    pub fn name(self) -> &'static str {
        use GgmlType::*;
        match self {
            F32 => "f32",
            F16 => "f16",
            Q4_0 => "q4_0",
            Q4_1 => "q4_1",
            Q5_0 => "q5_0",
            Q5_1 => "q5_1",
            Q8_0 => "q8_0",
            Q8_1 => "q8_1",
            Q2_K => "q2_K",
            Q3_K => "q3_K",
            Q4_K => "q4_K",
            Q5_K => "q5_K",
            Q6_K => "q6_K",
            Q8_K => "q8_K",
            IQ2_XXS => "iq2_xxs",
            IQ2_XS => "iq2_xs",
            IQ3_XXS => "iq3_xxs",
            IQ1_S => "iq1_s",
            IQ4_NL => "iq4_nl",
            IQ3_S => "iq3_s",
            IQ2_S => "iq2_s",
            IQ4_XS => "iq4_xs",
            I8 => "i8",
            I16 => "i16",
            I32 => "i32",
            I64 => "i64",
            F64 => "f64",
            IQ1_M => "iq1_m",
            BF16 => "bf16",
            TQ1_0 => "tq1_0",
            TQ2_0 => "tq2_0",
            MXFP4 => "mxfp4",
            NVFP4 => "nvfp4",
            Q1_0 => "q1_0",
            Q2_0 => "q2_0",
        }
    }

    /// Elements per block (ggml's `blck_size`).
    pub fn block_size(self) -> usize {
        use GgmlType::*;
        match self {
            F32 | F16 | BF16 | I8 | I16 | I32 | I64 | F64 => 1,
            Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q8_1 | IQ4_NL | MXFP4 => 32,
            Q2_0 | NVFP4 => 64,
            Q1_0 => 128,
            Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | Q8_K | IQ2_XXS | IQ2_XS | IQ3_XXS | IQ1_S | IQ3_S | IQ2_S | IQ4_XS
            | IQ1_M | TQ1_0 | TQ2_0 => QK_K,
        }
    }

    /// Bytes per block (ggml's `type_size`).
    pub fn type_size(self) -> usize {
        use GgmlType::*;
        match self {
            F32 => 4,
            F16 | BF16 => 2,
            I8 => 1,
            I16 => 2,
            I32 => 4,
            I64 | F64 => 8,
            Q4_0 => legacy::Q4_0_BYTES,
            Q4_1 => legacy::Q4_1_BYTES,
            Q5_0 => legacy::Q5_0_BYTES,
            Q5_1 => legacy::Q5_1_BYTES,
            Q8_0 => q8::Q8_0_BYTES,
            Q8_1 => q8::Q8_1_BYTES,
            Q8_K => q8::Q8_K_BYTES,
            Q2_K => kquants::Q2_K_BYTES,
            Q3_K => kquants::Q3_K_BYTES,
            Q4_K => kquants::Q4_K_BYTES,
            Q5_K => kquants::Q5_K_BYTES,
            Q6_K => kquants::Q6_K_BYTES,
            // Not implemented here; sizes from ggml-common.h.
            IQ2_XXS => 2 + 64,
            IQ2_XS => 2 + 64 + 8,
            IQ3_XXS => 2 + 96,
            IQ1_S => 2 + 32 + 16,
            IQ4_NL => 2 + 16,
            IQ3_S => 2 + 64 + 8 + 32 + 4,
            IQ2_S => 2 + 64 + 16,
            IQ4_XS => 2 + 2 + 4 + 128,
            IQ1_M => 32 + 16 + 8,
            TQ1_0 => 48 + 4 + 2,
            TQ2_0 => 64 + 2,
            MXFP4 => 1 + 16,
            NVFP4 => 4 + 32,
            Q1_0 => 2 + 16,
            Q2_0 => 2 + 16,
        }
    }

    /// Bytes of a row of `n` elements; `None` when `n` is not a whole number of
    /// blocks or the size overflows `usize`.
    pub fn row_bytes(self, n: usize) -> Option<usize> {
        let bs = self.block_size();
        if !n.is_multiple_of(bs) {
            return None;
        }
        (n / bs).checked_mul(self.type_size())
    }

    /// The type the other operand of [`vec_dot`] must be in, as in ggml's CPU
    /// type traits: K-quants use `Q8_K`, `Q4_0`/`Q5_0`/`Q8_0` use `Q8_0`,
    /// `Q4_1`/`Q5_1` use `Q8_1`, float types use themselves.
    pub fn vec_dot_type(self) -> GgmlType {
        use GgmlType::*;
        match self {
            F32 => F32,
            F16 => F16,
            BF16 => BF16,
            Q4_0 | Q5_0 | Q8_0 | IQ4_NL | MXFP4 | NVFP4 | Q1_0 | Q2_0 => Q8_0,
            Q4_1 | Q5_1 | Q8_1 => Q8_1,
            Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | Q8_K | IQ2_XXS | IQ2_XS | IQ3_XXS | IQ1_S | IQ3_S | IQ2_S | IQ4_XS
            | IQ1_M | TQ1_0 | TQ2_0 => Q8_K,
            I8 | I16 | I32 | I64 | F64 => self,
        }
    }

    /// Whether this module implements [`dequantize_row`], [`quantize_row`] and
    /// [`vec_dot`] for the type.
    pub fn is_supported(self) -> bool {
        use GgmlType::*;
        matches!(
            self,
            F32 | F16
                | BF16
                | Q4_0
                | Q4_1
                | Q5_0
                | Q5_1
                | Q8_0
                | Q8_1
                | Q8_K
                | Q2_K
                | Q3_K
                | Q4_K
                | Q5_K
                | Q6_K
                | MXFP4
        )
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Errors of the checked entry points. Nothing in this module panics on bad
/// lengths or types except the documented unchecked hot-path functions.
#[derive(Clone, Debug, thiserror::Error)]
pub enum QuantError {
    #[error("type {0} is not supported by engine::quant")]
    Unsupported(GgmlType),
    #[error("{ty}: {n} elements is not a multiple of the block size {block}")]
    NotBlockMultiple { ty: GgmlType, n: usize, block: usize },
    #[error("{ty}: row of {n} elements does not fit in usize bytes")]
    Overflow { ty: GgmlType, n: usize },
    #[error("{ty}: {what} has length {got}, expected {expected}")]
    Length { ty: GgmlType, what: &'static str, expected: usize, got: usize },
    #[error("kernel backend {0} is not available on this CPU")]
    BackendUnavailable(Backend),
    #[error("ENGINE_ISA={0:?} is not an ISA level: use scalar, avx2, avx512 or neon (or unset it for the best one)")]
    IsaUnknown(String),
    #[error(
        "ENGINE_ISA={level}: this CPU lacks {missing}; the best level it runs is {best} (set ENGINE_ISA to that or unset it)"
    )]
    IsaUnavailable { level: Backend, missing: String, best: Backend },
}

/// Bytes of a row of `n` elements of `ty`, as a `Result`.
pub fn checked_row_bytes(ty: GgmlType, n: usize) -> Result<usize, QuantError> {
    let bs = ty.block_size();
    if !n.is_multiple_of(bs) {
        return Err(QuantError::NotBlockMultiple { ty, n, block: bs });
    }
    ty.row_bytes(n).ok_or(QuantError::Overflow { ty, n })
}

fn check_len(ty: GgmlType, what: &'static str, expected: usize, got: usize) -> Result<(), QuantError> {
    if expected == got { Ok(()) } else { Err(QuantError::Length { ty, what, expected, got }) }
}

/// Decodes one row: `dst.len()` elements from `src`, which must hold exactly
/// `ty.row_bytes(dst.len())` bytes.
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    if !ty.is_supported() {
        return Err(QuantError::Unsupported(ty));
    }
    let nbytes = checked_row_bytes(ty, dst.len())?;
    check_len(ty, "quantized row", nbytes, src.len())?;
    use GgmlType::*;
    match ty {
        F32 => float::dequantize_f32(src, dst),
        F16 => float::dequantize_f16(src, dst),
        BF16 => float::dequantize_bf16(src, dst),
        Q4_0 => legacy::dequantize_q4_0(src, dst),
        Q4_1 => legacy::dequantize_q4_1(src, dst),
        Q5_0 => legacy::dequantize_q5_0(src, dst),
        Q5_1 => legacy::dequantize_q5_1(src, dst),
        Q8_0 => q8::dequantize_q8_0(src, dst),
        Q8_1 => q8::dequantize_q8_1(src, dst),
        Q8_K => q8::dequantize_q8_k(src, dst),
        Q2_K => kquants::dequantize_q2_k(src, dst),
        Q3_K => kquants::dequantize_q3_k(src, dst),
        Q4_K => kquants::dequantize_q4_k(src, dst),
        Q5_K => kquants::dequantize_q5_k(src, dst),
        Q6_K => kquants::dequantize_q6_k(src, dst),
        MXFP4 => mxfp4::dequantize(src, dst),
        _ => return Err(QuantError::Unsupported(ty)),
    }
    Ok(())
}

/// Encodes one row: `src.len()` elements into `dst`, which must hold exactly
/// `ty.row_bytes(src.len())` bytes.
///
/// Activation types (`Q8_0`, `Q8_1`, `Q8_K`, `F16`, `BF16`) are bit-identical to
/// ggml's reference quantizers. Weight types follow ggml's `quantize_row_*_ref`
/// algorithms step by step (per-sub-block scale/min search, e.g.
/// `make_qkx2_quants`); they aim at ggml's bytes but only promise valid blocks
/// that decode close to the input.
pub fn quantize_row(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<(), QuantError> {
    quantize_row_with(table().backend, ty, src, dst)
}

/// [`quantize_row`] on a specific backend (for tests and benchmarks). Only the
/// `Q8_K` and `F16` quantizers have AVX2 versions, and `Q8_K` a NEON one; they give the same
/// bytes.
pub fn quantize_row_on(backend: Backend, ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<(), QuantError> {
    if !backend.is_available() {
        return Err(QuantError::BackendUnavailable(backend));
    }
    quantize_row_with(backend, ty, src, dst)
}

fn simd_quantizer(backend: Backend, ty: GgmlType) -> Option<QuantizeFn> {
    match backend {
        Backend::Scalar => None,
        // The AVX2 quantizers give the reference bytes; AVX-512 has nothing to add there.
        #[cfg(target_arch = "x86_64")]
        Backend::Avx2 | Backend::Avx512 => avx2::quantizer(ty),
        // NEON: `Q8_K` (the reference bytes); the other types with the scalar code (ggml's ARM
        // `Q8_0` flavour is chosen by `quantize_activation`, the others are the reference bytes).
        #[cfg(target_arch = "aarch64")]
        Backend::Neon => neon::quantizer(ty),
        _ => {
            let _ = ty;
            None
        }
    }
}

fn quantize_row_with(backend: Backend, ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<(), QuantError> {
    if !ty.is_supported() {
        return Err(QuantError::Unsupported(ty));
    }
    let nbytes = checked_row_bytes(ty, src.len())?;
    check_len(ty, "quantized row", nbytes, dst.len())?;
    if let Some(q) = simd_quantizer(backend, ty) {
        q(src, dst);
        return Ok(());
    }
    use GgmlType::*;
    match ty {
        F32 => float::quantize_f32(src, dst),
        F16 => float::quantize_f16(src, dst),
        BF16 => float::quantize_bf16(src, dst),
        Q4_0 => legacy::quantize_q4_0(src, dst),
        Q4_1 => legacy::quantize_q4_1(src, dst),
        Q5_0 => legacy::quantize_q5_0(src, dst),
        Q5_1 => legacy::quantize_q5_1(src, dst),
        Q8_0 => q8::quantize_q8_0(Q8Flavor::Reference, src, dst),
        Q8_1 => q8::quantize_q8_1(Q8Flavor::Reference, src, dst),
        Q8_K => q8::quantize_q8_k(src, dst),
        Q2_K => kquants::quantize_q2_k(src, dst),
        Q3_K => kquants::quantize_q3_k(src, dst),
        Q4_K => kquants::quantize_q4_k(src, dst),
        Q5_K => kquants::quantize_q5_k(src, dst),
        Q6_K => kquants::quantize_q6_k(src, dst),
        MXFP4 => mxfp4::quantize(src, dst),
        _ => return Err(QuantError::Unsupported(ty)),
    }
    Ok(())
}

/// Which of ggml's `Q8_0`/`Q8_1` quantizers to reproduce. They differ only in
/// rare rounding cases (exact halves, and one-ulp differences of the inverse
/// scale), but those decide whether activations are bit-identical to llama.cpp's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Q8Flavor {
    /// `quantize_row_q8_0_ref`: `id = 1/d`, `roundf` (halves away from zero).
    Reference,
    /// ggml-cpu's x86 AVX/AVX2 `quantize_row_q8_0`: `id = 127/amax`, halves to even.
    X86,
    /// ggml-cpu's ARM NEON `quantize_row_q8_0`: `id = 1/d`, halves to even.
    Arm,
}

impl Q8Flavor {
    /// The flavour llama.cpp's CPU backend uses on the architecture this was
    /// compiled for (x86_64: AVX path, aarch64: NEON path, others: reference).
    pub fn native() -> Q8Flavor {
        if cfg!(target_arch = "x86_64") {
            Q8Flavor::X86
        } else if cfg!(target_arch = "aarch64") {
            Q8Flavor::Arm
        } else {
            Q8Flavor::Reference
        }
    }
}

/// `Q8_0` (or `Q8_1` when `ty == Q8_1`) quantization in a chosen [`Q8Flavor`].
pub fn quantize_row_q8_0_with(ty: GgmlType, flavor: Q8Flavor, src: &[f32], dst: &mut [u8]) -> Result<(), QuantError> {
    let nbytes = checked_row_bytes(ty, src.len())?;
    check_len(ty, "quantized row", nbytes, dst.len())?;
    match ty {
        #[cfg(target_arch = "x86_64")]
        GgmlType::Q8_0 if flavor == Q8Flavor::X86 && backend() != Backend::Scalar => {
            // SAFETY: the avx2 and avx512 levels are granted only on CPUs with AVX2, FMA, F16C.
            unsafe { avx2::quantize_q8_0_x86(src, dst) }
        }
        GgmlType::Q8_0 => q8::quantize_q8_0(flavor, src, dst),
        GgmlType::Q8_1 => q8::quantize_q8_1(flavor, src, dst),
        _ => return Err(QuantError::Unsupported(ty)),
    }
    Ok(())
}

/// Quantizes the activation vector `x` into `weight_ty.vec_dot_type()`, the way
/// llama.cpp's CPU backend does on this architecture, into `buf` (resized to the
/// exact row size; no allocation once `buf` has the capacity).
pub fn quantize_activation(weight_ty: GgmlType, x: &[f32], buf: &mut Vec<u8>) -> Result<(), QuantError> {
    if !weight_ty.is_supported() {
        return Err(QuantError::Unsupported(weight_ty));
    }
    let ty = weight_ty.vec_dot_type();
    let nbytes = checked_row_bytes(ty, x.len())?;
    buf.resize(nbytes, 0);
    match ty {
        GgmlType::Q8_0 | GgmlType::Q8_1 => quantize_row_q8_0_with(ty, Q8Flavor::native(), x, buf),
        _ => quantize_row(ty, x, buf),
    }
}

// ---------------------------------------------------------------------------
// Kernel dispatch
// ---------------------------------------------------------------------------

/// A kernel set, which is also an ISA level: the instructions the kernels may use and the
/// llama.cpp build whose numerics they reproduce (module docs, "ISA levels").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Backend {
    /// Portable scalar Rust; every target. Reproduces no particular llama.cpp build.
    Scalar,
    /// x86_64 AVX2 + FMA + F16C: a llama.cpp build for AVX2+FMA+F16C without AVX-512.
    Avx2,
    /// x86_64 AVX-512 F/BW/DQ/VL (+ AVX2, FMA, F16C), with VNNI and BF16 where the CPU has
    /// them: a llama.cpp build for AVX-512 with VNNI and BF16 as this CPU has them.
    Avx512,
    /// aarch64 NEON (ASIMD), with `sdot` where the CPU has `dotprod`: ggml's NEON
    /// `ggml_vec_dot_*` kernels, and with `dotprod` (and `i8mm`) the orders of its repacked
    /// GEMVs (a llama.cpp build for ARMv8 NEON with `dotprod` and `i8mm` as the CPU has them).
    Neon,
}

/// The environment variable that chooses the ISA level (`scalar`, `avx2`, `avx512`, `neon`).
pub const ISA_ENV: &str = "ENGINE_ISA";

impl Backend {
    /// Every level: the portable one, then each architecture's lowest first.
    pub const ALL: [Backend; 4] = [Backend::Scalar, Backend::Avx2, Backend::Avx512, Backend::Neon];

    /// The level's name, as `ENGINE_ISA` spells it.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Scalar => "scalar",
            Backend::Avx2 => "avx2",
            Backend::Avx512 => "avx512",
            Backend::Neon => "neon",
        }
    }

    /// The level named `s` (as `ENGINE_ISA` spells it).
    pub fn from_name(s: &str) -> Option<Backend> {
        Backend::ALL.into_iter().find(|b| b.name() == s)
    }

    /// The CPU features (`/proc/cpuinfo` spelling) the level needs.
    pub fn required_features(self) -> &'static [&'static str] {
        match self {
            Backend::Scalar => &[],
            Backend::Avx2 => &["avx2", "fma", "f16c"],
            Backend::Avx512 => &["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl"],
            Backend::Neon => &["asimd"],
        }
    }

    /// The required features this CPU lacks.
    pub fn missing_features(self) -> Vec<&'static str> {
        self.required_features().iter().copied().filter(|f| !cpu_has(f)).collect()
    }

    /// Whether this CPU can run the backend.
    pub fn is_available(self) -> bool {
        self.missing_features().is_empty()
    }

    /// The highest level this CPU can run.
    pub fn best() -> Backend {
        Backend::ALL.into_iter().rev().find(|b| b.is_available()).unwrap_or(Backend::Scalar)
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The features that decide a level or a kernel choice on this architecture, in `/proc/cpuinfo`
/// spelling: on x86_64 (`amx_tile` is listed to say it is never used) ...
#[cfg(not(target_arch = "aarch64"))]
pub const CPU_FEATURES: &[&str] = &[
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512dq",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "avx_vnni",
    "avx512vbmi",
    "amx_tile",
];

/// ... and on aarch64 (`asimddp` is `dotprod`, whose `sdot` the `neon` kernels use; `i8mm` and
/// `sve` are listed to say they are not used).
#[cfg(target_arch = "aarch64")]
pub const CPU_FEATURES: &[&str] = &["asimd", "asimddp", "i8mm", "sve"];

/// Whether the CPU has `feature` (one of [`CPU_FEATURES`] or a required feature).
pub fn cpu_has(feature: &str) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        match feature {
            "avx2" => is_x86_feature_detected!("avx2"),
            "fma" => is_x86_feature_detected!("fma"),
            "f16c" => is_x86_feature_detected!("f16c"),
            "avx512f" => is_x86_feature_detected!("avx512f"),
            "avx512bw" => is_x86_feature_detected!("avx512bw"),
            "avx512dq" => is_x86_feature_detected!("avx512dq"),
            "avx512vl" => is_x86_feature_detected!("avx512vl"),
            "avx512_vnni" => is_x86_feature_detected!("avx512vnni"),
            "avx512_bf16" => is_x86_feature_detected!("avx512bf16"),
            "avx512_fp16" => is_x86_feature_detected!("avx512fp16"),
            "avx_vnni" => is_x86_feature_detected!("avxvnni"),
            "avx512vbmi" => is_x86_feature_detected!("avx512vbmi"),
            // Not detectable with `is_x86_feature_detected!` on stable Rust: CPUID leaf 7
            // EDX bit 24, which the kernel also shows only when it enabled the tile state.
            "amx_tile" => {
                let leaf7 = std::arch::x86_64::__cpuid_count(7, 0);
                leaf7.edx & (1 << 24) != 0
                    && <procfs::CpuInfo as procfs::Current>::current()
                        .is_ok_and(|c| c.flags(0).is_some_and(|f| f.contains(&"amx_tile")))
            }
            _ => false,
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        match feature {
            "asimd" => std::arch::is_aarch64_feature_detected!("neon"),
            "asimddp" => std::arch::is_aarch64_feature_detected!("dotprod"),
            "i8mm" => std::arch::is_aarch64_feature_detected!("i8mm"),
            "sve" => std::arch::is_aarch64_feature_detected!("sve"),
            _ => false,
        }
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        let _ = feature;
        false
    }
}

/// The level this process runs: `ENGINE_ISA` when set (an error if the name is unknown or the
/// CPU lacks a feature it needs), else the best the CPU has. Read once; every kernel,
/// [`vec_dot`], [`matvec`], [`matvec_multi`], [`quantize_row`] and `vmath` follow it.
pub fn isa() -> Result<Backend, QuantError> {
    static ISA: OnceLock<Result<Backend, QuantError>> = OnceLock::new();
    ISA.get_or_init(|| isa_from(std::env::var(ISA_ENV).ok().as_deref())).clone()
}

/// The level `env` (the value of `ENGINE_ISA`, `None` when unset) asks for on this CPU.
pub fn isa_from(env: Option<&str>) -> Result<Backend, QuantError> {
    let Some(name) = env.map(str::trim).filter(|s| !s.is_empty()) else {
        return Ok(Backend::best());
    };
    let level = Backend::from_name(name).ok_or_else(|| QuantError::IsaUnknown(name.to_owned()))?;
    let missing = level.missing_features();
    if !missing.is_empty() {
        return Err(QuantError::IsaUnavailable { level, missing: missing.join(" "), best: Backend::best() });
    }
    Ok(level)
}

/// One line for a log: the CPU's features from [`CPU_FEATURES`] and the level in use, e.g.
/// `cpu: avx2 fma f16c avx512f … (no amx_tile); isa: avx512 (best available; ENGINE_ISA unset)`.
pub fn isa_report() -> Result<String, QuantError> {
    let level = isa()?;
    let (have, lack): (Vec<&str>, Vec<&str>) = CPU_FEATURES.iter().partition(|f| cpu_has(f));
    let how = match std::env::var(ISA_ENV) {
        Ok(v) if !v.trim().is_empty() => format!("{ISA_ENV}={v}"),
        _ => format!("best available; {ISA_ENV} unset"),
    };
    let lack = if lack.is_empty() { String::new() } else { format!(" (no {})", lack.join(" ")) };
    // Which AVX-512 kernels the level runs (none to add elsewhere).
    #[cfg(target_arch = "x86_64")]
    let extras: Vec<&str> = if level == Backend::Avx512 {
        vec![
            if avx512::vnni() { "vnni kernels" } else { "no vnni: avx2 integer kernels" },
            if avx512::bf16() { "bf16 dot: avx512_bf16" } else { "bf16 dot: avx512f" },
        ]
    } else {
        Vec::new()
    };
    #[cfg(target_arch = "aarch64")]
    let extras: Vec<&str> = if level == Backend::Neon {
        vec![match neon::layout() {
            neon::Layout::Plain => "no dotprod: emulated sdot",
            neon::Layout::Dotprod => "sdot kernels (dotprod), llama.cpp's dotprod repacked orders",
            neon::Layout::I8mm => "sdot kernels (dotprod), llama.cpp's i8mm repacked orders",
        }]
    } else {
        Vec::new()
    };
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let extras: Vec<&str> = Vec::new();
    let extras = if extras.is_empty() { String::new() } else { format!(", {}", extras.join(", ")) };
    Ok(format!("cpu: {}{lack}; isa: {level} ({how}{extras})", have.join(" ")))
}

/// `n` elements of weight row `w` dotted with `n` elements of `x` (already in the
/// weight's `vec_dot_type`). Slices have exactly the row lengths.
pub(crate) type VecDotFn = fn(n: usize, w: &[u8], x: &[u8]) -> f32;

/// Rows `0..out.len()` of `w` (row stride `row_bytes`, `cols` elements each)
/// dotted with `x`. `w` holds at least `out.len() * row_bytes` bytes, `x` exactly
/// one row of the `vec_dot_type`.
pub(crate) type MatVecFn = fn(w: &[u8], row_bytes: usize, cols: usize, x: &[u8], out: &mut [f32]);

/// Rows of `w` (row stride `row_bytes`) dotted with 1 to 4 activations: `outs[t][i]`
/// for row `i` and activation `xs[t]`; every `outs[t]` has one element per row.
pub(crate) type MultiFn = fn(w: &[u8], row_bytes: usize, xs: &[&[u8]], outs: &mut [&mut [f32]]);

/// A row quantizer: `src.len()` floats into exactly one row of bytes.
pub(crate) type QuantizeFn = fn(src: &[f32], dst: &mut [u8]);

#[derive(Clone, Copy)]
pub(crate) struct Kernel {
    pub(crate) vec_dot: VecDotFn,
    pub(crate) matvec: MatVecFn,
}

/// Generic row loop used by kernel sets without a dedicated matvec.
#[inline]
pub(crate) fn matvec_rows(dot: VecDotFn, w: &[u8], row_bytes: usize, cols: usize, x: &[u8], out: &mut [f32]) {
    for (row, o) in w.chunks_exact(row_bytes).zip(out.iter_mut()) {
        *o = dot(cols, row, x);
    }
}

macro_rules! scalar_kernel {
    ($dot:path) => {{
        fn mv(w: &[u8], row_bytes: usize, cols: usize, x: &[u8], out: &mut [f32]) {
            matvec_rows($dot, w, row_bytes, cols, x, out)
        }
        Kernel { vec_dot: $dot, matvec: mv }
    }};
}

fn scalar_kernel(ty: GgmlType) -> Option<Kernel> {
    use GgmlType::*;
    Some(match ty {
        F32 => scalar_kernel!(float::vec_dot_f32),
        F16 => scalar_kernel!(float::vec_dot_f16),
        BF16 => scalar_kernel!(float::vec_dot_bf16),
        Q4_0 => scalar_kernel!(legacy::vec_dot_q4_0_q8_0),
        Q4_1 => scalar_kernel!(legacy::vec_dot_q4_1_q8_1),
        Q5_0 => scalar_kernel!(legacy::vec_dot_q5_0_q8_0),
        Q5_1 => scalar_kernel!(legacy::vec_dot_q5_1_q8_1),
        Q8_0 => scalar_kernel!(q8::vec_dot_q8_0_q8_0),
        Q8_1 => scalar_kernel!(q8::vec_dot_q8_1_q8_1),
        Q8_K => scalar_kernel!(q8::vec_dot_q8_k_q8_k),
        Q2_K => scalar_kernel!(kquants::vec_dot_q2_k_q8_k),
        Q3_K => scalar_kernel!(kquants::vec_dot_q3_k_q8_k),
        Q4_K => scalar_kernel!(kquants::vec_dot_q4_k_q8_k),
        Q5_K => scalar_kernel!(kquants::vec_dot_q5_k_q8_k),
        Q6_K => scalar_kernel!(kquants::vec_dot_q6_k_q8_k),
        MXFP4 => mxfp4::scalar_kernel(),
        _ => return None,
    })
}

/// The AVX2 kernels: the `avx2` module's, and MXFP4's repacked-GEMV kernel.
#[cfg(target_arch = "x86_64")]
fn avx2_kernel(ty: GgmlType) -> Option<Kernel> {
    avx2::kernel(ty).or_else(|| if ty == GgmlType::MXFP4 { mxfp4::avx2_kernel() } else { None })
}

fn backend_kernel(backend: Backend, ty: GgmlType) -> Option<Kernel> {
    if !backend.is_available() {
        return None;
    }
    match backend {
        Backend::Scalar => scalar_kernel(ty),
        #[cfg(target_arch = "x86_64")]
        Backend::Avx2 => avx2_kernel(ty).or_else(|| scalar_kernel(ty)),
        // The AVX-512 set has its own float kernels (ggml's 16-lane shapes); for the other
        // types it falls back to the AVX2 kernels, which have the same numerics there (MXFP4
        // included: ggml's repacked MXFP4 GEMV is AVX2 code in both builds).
        #[cfg(target_arch = "x86_64")]
        Backend::Avx512 => avx512::kernel(ty).or_else(|| avx2_kernel(ty)).or_else(|| scalar_kernel(ty)),
        #[cfg(target_arch = "aarch64")]
        Backend::Neon => neon::kernel(ty).or_else(|| scalar_kernel(ty)),
        _ => None,
    }
}

/// A multi-activation kernel and how many activations it takes per call.
#[derive(Clone, Copy)]
pub(crate) struct Multi {
    pub(crate) f: MultiFn,
    pub(crate) group: usize,
}

fn backend_multi(backend: Backend, ty: GgmlType) -> Option<Multi> {
    if !backend.is_available() {
        return None;
    }
    match backend {
        Backend::Scalar => None,
        #[cfg(target_arch = "x86_64")]
        Backend::Avx2 => avx2::multi_kernel(ty),
        #[cfg(target_arch = "x86_64")]
        Backend::Avx512 => avx512::multi_kernel(ty).or_else(|| avx2::multi_kernel(ty)),
        #[cfg(target_arch = "aarch64")]
        Backend::Neon => neon::multi_kernel(ty),
        _ => {
            let _ = ty;
            None
        }
    }
}

const TABLE_LEN: usize = 43;

struct Table {
    backend: Backend,
    kernels: [Option<Kernel>; TABLE_LEN],
    multi: [Option<Multi>; TABLE_LEN],
}

fn table() -> &'static Table {
    static TABLE: OnceLock<Table> = OnceLock::new();
    TABLE.get_or_init(|| {
        // A bad ENGINE_ISA is reported by `isa()`; binaries call it first (engine's main does).
        let backend = isa().unwrap_or_else(|e| panic!("engine::quant: {e}"));
        let mut kernels = [None; TABLE_LEN];
        let mut multi = [None; TABLE_LEN];
        for ty in GgmlType::ALL {
            kernels[ty as usize] = backend_kernel(backend, ty);
            multi[ty as usize] = backend_multi(backend, ty);
        }
        Table { backend, kernels, multi }
    })
}

#[inline]
fn kernel(ty: GgmlType) -> Option<Kernel> {
    table().kernels[ty as usize]
}

/// The backend [`vec_dot`] and [`matvec`] use: the ISA level [`isa`] (chosen once).
///
/// # Panics
/// When `ENGINE_ISA` is invalid for this CPU; call [`isa`] first to get that as an error.
pub fn backend() -> Backend {
    table().backend
}

/// Checks lengths for a dot product and returns the row sizes of `w` and `x`.
fn check_dot(ty: GgmlType, n: usize, w: &[u8], x: &[u8]) -> Result<(), QuantError> {
    if !ty.is_supported() {
        return Err(QuantError::Unsupported(ty));
    }
    let wb = checked_row_bytes(ty, n)?;
    let xt = ty.vec_dot_type();
    let xb = checked_row_bytes(xt, n)?;
    check_len(ty, "weight row", wb, w.len())?;
    check_len(xt, "activation row", xb, x.len())?;
    Ok(())
}

/// Dot product of `n` elements: weight row `w` (type `ty`) with activation `x`
/// (type `ty.vec_dot_type()`), using the fastest backend.
///
/// # Panics
/// On an unsupported type, `n` not a multiple of the block size, or slices that
/// are not exactly one row long (checked with `debug_assert`; in release builds
/// short slices still panic on indexing and longer ones are truncated). Use
/// [`try_vec_dot`] for untrusted input.
#[inline]
pub fn vec_dot(ty: GgmlType, n: usize, w: &[u8], x: &[u8]) -> f32 {
    #[cfg(debug_assertions)]
    if let Err(e) = check_dot(ty, n, w, x) {
        panic!("vec_dot: {e}");
    }
    let Some(k) = kernel(ty) else {
        panic!("vec_dot: type {ty} is not supported");
    };
    let bs = ty.block_size();
    assert!(n.is_multiple_of(bs), "vec_dot: n = {n} is not a multiple of {bs}");
    let nb = n / bs;
    let w = &w[..nb * ty.type_size()];
    let xt = ty.vec_dot_type();
    let x = &x[..n / xt.block_size() * xt.type_size()];
    (k.vec_dot)(n, w, x)
}

/// [`vec_dot`] with every length checked.
pub fn try_vec_dot(ty: GgmlType, n: usize, w: &[u8], x: &[u8]) -> Result<f32, QuantError> {
    check_dot(ty, n, w, x)?;
    let k = kernel(ty).ok_or(QuantError::Unsupported(ty))?;
    Ok((k.vec_dot)(n, w, x))
}

/// [`try_vec_dot`] on a specific backend (for tests and benchmarks).
pub fn vec_dot_on(backend: Backend, ty: GgmlType, n: usize, w: &[u8], x: &[u8]) -> Result<f32, QuantError> {
    if !backend.is_available() {
        return Err(QuantError::BackendUnavailable(backend));
    }
    check_dot(ty, n, w, x)?;
    let k = backend_kernel(backend, ty).ok_or(QuantError::Unsupported(ty))?;
    Ok((k.vec_dot)(n, w, x))
}

fn check_matvec(
    ty: GgmlType,
    w: &[u8],
    rows: &Range<usize>,
    cols: usize,
    xq: &[u8],
    out: &[f32],
) -> Result<(usize, usize), QuantError> {
    if !ty.is_supported() {
        return Err(QuantError::Unsupported(ty));
    }
    let rb = checked_row_bytes(ty, cols)?;
    let xt = ty.vec_dot_type();
    check_len(xt, "activation row", checked_row_bytes(xt, cols)?, xq.len())?;
    let nrows = rows.end.saturating_sub(rows.start);
    check_len(ty, "output", nrows, out.len())?;
    let need = rows.end.checked_mul(rb).ok_or(QuantError::Overflow { ty, n: cols })?;
    if rows.start > rows.end || w.len() < need {
        return Err(QuantError::Length { ty, what: "weight matrix", expected: need, got: w.len() });
    }
    Ok((rb, nrows))
}

/// `out[i] = dot(row rows.start + i of w, xq)` for a row-major matrix `w` of
/// `cols`-element rows of type `ty` (row stride `ty.row_bytes(cols)`), `xq` being
/// the activation quantized with [`quantize_activation`]. Allocation-free and
/// single-threaded; callers split `rows` across threads.
///
/// # Panics
/// On an unsupported type or inconsistent lengths; [`try_matvec`] returns errors instead.
pub fn matvec(ty: GgmlType, w: &[u8], rows: Range<usize>, cols: usize, xq: &[u8], out: &mut [f32]) {
    if let Err(e) = try_matvec(ty, w, rows, cols, xq, out) {
        panic!("matvec: {e}");
    }
}

/// [`matvec`] returning errors instead of panicking.
pub fn try_matvec(
    ty: GgmlType,
    w: &[u8],
    rows: Range<usize>,
    cols: usize,
    xq: &[u8],
    out: &mut [f32],
) -> Result<(), QuantError> {
    let (rb, nrows) = check_matvec(ty, w, &rows, cols, xq, out)?;
    let k = kernel(ty).ok_or(QuantError::Unsupported(ty))?;
    if nrows == 0 || cols == 0 {
        out.fill(0.0);
        return Ok(());
    }
    (k.matvec)(&w[rows.start * rb..rows.end * rb], rb, cols, xq, out);
    Ok(())
}

/// Several activations against the same rows: for every `t`,
/// `outs[t][i] = dot(row rows.start + i of w, xs[t])`, each `xs[t]` quantized with
/// [`quantize_activation`]. Every output is bit-identical to [`matvec`] with `xs[t]` (the
/// same operations per element); where a multi-activation kernel exists (module docs,
/// "Kernels") each weight block is decoded once for up to 4 (`avx2`) or 8 to 16 (`avx512`)
/// activations, which is what prompt processing gains; a single activation goes to the
/// `matvec` kernel. Single-threaded; the `avx512` kernels keep their prepared activations in a
/// per-thread buffer that grows to the largest call and is then reused (no allocation per call
/// after that).
///
/// # Panics
/// On an unsupported type or inconsistent lengths, like [`matvec`].
pub fn matvec_multi(ty: GgmlType, w: &[u8], rows: Range<usize>, cols: usize, xs: &[&[u8]], outs: &mut [&mut [f32]]) {
    assert_eq!(xs.len(), outs.len(), "matvec_multi: {} activations but {} outputs", xs.len(), outs.len());
    let mut rb = 0;
    for (x, o) in xs.iter().zip(outs.iter()) {
        match check_matvec(ty, w, &rows, cols, x, o) {
            Ok((r, _)) => rb = r,
            Err(e) => panic!("matvec_multi: {e}"),
        }
    }
    let multi = table().multi[ty as usize];
    multi_with(multi, w, rows.clone(), cols, rb, xs, outs, |x, o| matvec(ty, w, rows.clone(), cols, x, o));
}

/// [`matvec_multi`] on a specific backend (for tests and benchmarks).
pub fn matvec_multi_on(
    backend: Backend,
    ty: GgmlType,
    w: &[u8],
    rows: Range<usize>,
    cols: usize,
    xs: &[&[u8]],
    outs: &mut [&mut [f32]],
) -> Result<(), QuantError> {
    if !backend.is_available() {
        return Err(QuantError::BackendUnavailable(backend));
    }
    check_len(ty, "outputs", xs.len(), outs.len())?;
    let mut rb = checked_row_bytes(ty, cols)?;
    for (x, o) in xs.iter().zip(outs.iter()) {
        rb = check_matvec(ty, w, &rows, cols, x, o)?.0;
    }
    let mut err = None;
    multi_with(backend_multi(backend, ty), w, rows.clone(), cols, rb, xs, outs, |x, o| {
        if let Err(e) = matvec_on(backend, ty, w, rows.clone(), cols, x, o) {
            err = Some(e);
        }
    });
    err.map_or(Ok(()), Err)
}

/// Runs `multi` over groups of activations, or `one` per activation when there is no
/// multi-activation kernel, nothing to compute, or a group of one. Lengths are checked by the
/// caller.
#[expect(clippy::too_many_arguments, reason = "the checked pieces of a matvec_multi call")]
fn multi_with(
    multi: Option<Multi>,
    w: &[u8],
    rows: Range<usize>,
    cols: usize,
    rb: usize,
    xs: &[&[u8]],
    outs: &mut [&mut [f32]],
    mut one: impl FnMut(&[u8], &mut [f32]),
) {
    let (Some(multi), true) = (multi, rows.end > rows.start && cols > 0) else {
        for (x, o) in xs.iter().zip(outs.iter_mut()) {
            one(x, o);
        }
        return;
    };
    let wr = &w[rows.start * rb..rows.end * rb];
    for (xg, og) in xs.chunks(multi.group).zip(outs.chunks_mut(multi.group)) {
        if let ([x], [o]) = (xg, &mut *og) {
            // One activation (decode): the matvec kernel, which is made for it.
            one(x, o);
        } else {
            (multi.f)(wr, rb, xg, og);
        }
    }
}

/// [`try_matvec`] on a specific backend (for tests and benchmarks).
pub fn matvec_on(
    backend: Backend,
    ty: GgmlType,
    w: &[u8],
    rows: Range<usize>,
    cols: usize,
    xq: &[u8],
    out: &mut [f32],
) -> Result<(), QuantError> {
    if !backend.is_available() {
        return Err(QuantError::BackendUnavailable(backend));
    }
    let (rb, nrows) = check_matvec(ty, w, &rows, cols, xq, out)?;
    let k = backend_kernel(backend, ty).ok_or(QuantError::Unsupported(ty))?;
    if nrows == 0 || cols == 0 {
        out.fill(0.0);
        return Ok(());
    }
    (k.matvec)(&w[rows.start * rb..rows.end * rb], rb, cols, xq, out);
    Ok(())
}

// ---------------------------------------------------------------------------
// Shared scalar helpers
// ---------------------------------------------------------------------------

#[inline(always)]
pub(crate) fn f16_to_f32(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32_const()
}

#[inline(always)]
pub(crate) fn rd_u16(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes([b[off], b[off + 1]])
}

#[inline(always)]
pub(crate) fn rd_f16(b: &[u8], off: usize) -> f32 {
    f16_to_f32(rd_u16(b, off))
}

#[inline(always)]
pub(crate) fn rd_f32(b: &[u8], off: usize) -> f32 {
    f32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

#[inline(always)]
pub(crate) fn wr_u16(b: &mut [u8], off: usize, v: u16) {
    b[off..off + 2].copy_from_slice(&v.to_le_bytes());
}

/// ggml's `nearest_int`: round to nearest, ties to even, by the `1.5 * 2^23`
/// trick. Exact for `|x| <= 4194303`; like ggml, garbage (but no UB) beyond.
#[inline(always)]
pub(crate) fn nearest_int(x: f32) -> i32 {
    let v = x + 12_582_912.0;
    (v.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}
