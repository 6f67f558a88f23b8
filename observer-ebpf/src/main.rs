//! The observer's eBPF programs.
//!
//! Built for `bpfel-unknown-none` (see `observer/build.rs`) and embedded in the
//! `observer` binary. Programs are thin wrappers around shared state-machine
//! code in `observer_common::attrib`; all shared types live in
//! `observer-common`. No aya-log in hot probes.
#![no_std]
#![no_main]
#![feature(asm_experimental_arch)]

mod block;
mod evict;
mod faults;
mod filemap;
mod maps;
mod marks;
mod reclaim;
mod sched;
mod syscalls;
mod xread;

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo<'_>) -> ! {
    // Unreachable in verified programs: the verifier rejects any path that
    // could reach it, because this loop never terminates.
    loop {}
}
