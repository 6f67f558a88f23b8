//! The observer's eBPF programs.
//!
//! Built for `bpfel-unknown-none` (see `observer/build.rs`) and embedded in the
//! `observer` binary. Programs are thin wrappers around `try_*` functions; all
//! shared types live in `observer-common`. No aya-log in hot probes.
#![no_std]
#![no_main]

mod faults;
mod maps;

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo<'_>) -> ! {
    // SAFETY: unreachable in verified programs: the verifier rejects any path
    // that could reach it, because this loop never terminates.
    loop {}
}
