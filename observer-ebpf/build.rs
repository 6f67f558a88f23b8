//! Sets `cfg(bpf_target_arch = "…")` for this crate as `aya-ebpf` sets it for itself: the
//! architecture whose register layout (`pt_regs`) the programs read, from `AYA_BPF_TARGET_ARCH`
//! (`observer/build.rs` sets it to the observer's target architecture), else the host's (the
//! first part of the `HOST` triple, as `aya-build` does).

fn main() {
    println!(
        "cargo::rustc-check-cfg=cfg(bpf_target_arch, values(\"x86_64\", \"aarch64\", \"arm\", \"riscv64\", \"powerpc64\", \"s390x\", \"mips\", \"mips64\", \"loongarch64\"))"
    );
    println!("cargo::rerun-if-env-changed=AYA_BPF_TARGET_ARCH");
    let arch = std::env::var("AYA_BPF_TARGET_ARCH").unwrap_or_else(|_| {
        let host = std::env::var("HOST").expect("cargo sets HOST");
        host.split('-').next().unwrap_or_default().to_owned()
    });
    println!("cargo::rustc-cfg=bpf_target_arch=\"{arch}\"");
}
