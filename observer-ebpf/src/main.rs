#![no_std]
#![no_main]

use aya_ebpf::{macros::perf_event, programs::PerfEventContext};

#[perf_event]
pub fn fault_exit_min(_ctx: PerfEventContext) -> u32 {
    0
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo<'_>) -> ! {
    loop {}
}
