//! Builds the eBPF programs (`../observer-ebpf`) and leaves the object in
//! `$OUT_DIR/observer-ebpf.o` for `include_bytes_aligned!`.
//!
//! The programs compile for `bpfel-unknown-none` with Debian's `rustc-web`
//! (which ships a precompiled `core` for that target, so no `build-std`) and
//! link with `bpf-linker` built against LLVM 22. `cargo xtask setup` installs
//! all of it; this script only checks and explains.
//!
//! The programs read registers (uprobe arguments, syscall arguments) in the layout of the
//! kernel they run on, which is the observer's *target*, not the machine that builds it:
//! `AYA_BPF_TARGET_ARCH` is set from `CARGO_CFG_TARGET_ARCH` (aya-build would otherwise take
//! the host's, and a cross-built aarch64 observer would read x86-64 register offsets).

use std::{
    env,
    path::{Path, PathBuf},
    process::Command,
};

const DEBIAN_RUSTC: &str = "/usr/bin/rustc";
const LLVM_BIN: &str = "/usr/lib/llvm-22/bin";

fn fail(msg: &str) -> ! {
    eprintln!("\nerror: cannot build the observer's eBPF programs: {msg}\n");
    eprintln!("       run `cargo xtask setup` (as root) to install the eBPF toolchain.\n");
    std::process::exit(1);
}

fn fail_compile() -> ! {
    eprintln!("\nerror: compiling observer-ebpf failed (see the compiler output above)\n");
    std::process::exit(1);
}

fn main() {
    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let ebpf_dir = manifest.join("..").join("observer-ebpf");
    let common_dir = manifest.join("..").join("observer-common");
    let abi_dir = manifest.join("..").join("moe-abi");
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));

    for p in [
        ebpf_dir.join("src"),
        ebpf_dir.join("Cargo.toml"),
        ebpf_dir.join("Cargo.lock"),
        common_dir.join("src"),
        common_dir.join("Cargo.toml"),
        abi_dir.join("src"),
        abi_dir.join("Cargo.toml"),
    ] {
        println!("cargo:rerun-if-changed={}", p.display());
    }
    println!("cargo:rerun-if-env-changed=OBSERVER_EBPF_RUSTC");

    let rustc = env::var("OBSERVER_EBPF_RUSTC").unwrap_or_else(|_| DEBIAN_RUSTC.to_string());
    if !Path::new(&rustc).exists() {
        fail(&format!("{rustc} not found (Debian package `rustc-web`)"));
    }
    let home = env::var("HOME").unwrap_or_else(|_| "/root".to_string());
    let cargo_bin = PathBuf::from(&home).join(".cargo").join("bin");
    let path = format!("{LLVM_BIN}:{}:{}", cargo_bin.display(), env::var("PATH").unwrap_or_default());
    let linker_found = env::split_paths(&path).any(|d| d.join("bpf-linker").is_file());
    if !linker_found {
        fail("`bpf-linker` is not on PATH or in ~/.cargo/bin");
    }

    // aya's names (`x86_64`, `aarch64`, `riscv64`, …) are Rust's target_arch names.
    let target_arch = env::var("CARGO_CFG_TARGET_ARCH").expect("cargo sets CARGO_CFG_TARGET_ARCH");
    let target_dir = out_dir.join("ebpf-target");
    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(&ebpf_dir)
        .args(["build", "--release", "--locked", "--target", "bpfel-unknown-none", "--target-dir"])
        .arg(&target_dir)
        .env("RUSTC", &rustc)
        .env("RUSTC_BOOTSTRAP", "1")
        .env("AYA_BPF_TARGET_ARCH", &target_arch)
        .env("PATH", &path);
    // The outer build's compiler settings must not leak into the BPF build.
    for var in [
        "RUSTC_WRAPPER",
        "RUSTC_WORKSPACE_WRAPPER",
        "RUSTFLAGS",
        "CARGO_ENCODED_RUSTFLAGS",
        "CARGO_BUILD_TARGET",
        "CARGO_TARGET_DIR",
        "CARGO_BUILD_RUSTFLAGS",
        "RUSTDOCFLAGS",
        "CARGO_ENCODED_RUSTDOCFLAGS",
    ] {
        cmd.env_remove(var);
    }
    let status = cmd.status().unwrap_or_else(|e| fail(&format!("could not run cargo for observer-ebpf: {e}")));
    if !status.success() {
        fail_compile();
    }
    let obj = target_dir.join("bpfel-unknown-none").join("release").join("observer-ebpf");
    let dst = out_dir.join("observer-ebpf.o");
    std::fs::copy(&obj, &dst).unwrap_or_else(|e| fail(&format!("missing {}: {e}", obj.display())));
}
