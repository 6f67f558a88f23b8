//! The libFuzzer entry point (built by `cargo xtask fuzz TARGET` with sanitizer coverage);
//! `MOE_FUZZ_TARGET` names the target.

#![no_main]

use std::sync::OnceLock;

fn target() -> &'static fuzz::Target {
    static T: OnceLock<&'static fuzz::Target> = OnceLock::new();
    T.get_or_init(|| {
        let name = std::env::var("MOE_FUZZ_TARGET").unwrap_or_default();
        fuzz::target(&name).unwrap_or_else(|| {
            eprintln!("MOE_FUZZ_TARGET={name:?}: not a fuzz target; the targets are {}", fuzz::names());
            std::process::exit(2)
        })
    })
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| (target().run)(data));
