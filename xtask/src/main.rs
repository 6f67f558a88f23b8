//! `cargo xtask …`: the project's own scripts, in Rust.
//!
//! - `setup`: install and check everything the eBPF build and the tests need (idempotent).
//! - `test`: setup, build, run every test, say how many ran.
//! - `demo`: setup, build, observe a workload and print the observer's table.

mod cache;
mod cmd;
mod demo;
mod setup;
mod test;

use anyhow::Result;

const USAGE: &str = "usage: cargo xtask <command>

commands:
  setup          install and check the eBPF toolchain and test tools (root, Debian)
  test [ARGS]    setup, then run the whole test suite (ARGS go to `cargo test`)
  demo           setup, then run the observer on a demo workload
";

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let r: Result<()> = match args.first().map(String::as_str) {
        Some("setup") => setup::run(setup::Scope::All).map(|_| ()),
        Some("test") => test::run(&args[1..]),
        Some("demo") => demo::run(&args[1..]),
        Some("-h" | "--help" | "help") | None => {
            print!("{USAGE}");
            Ok(())
        }
        Some(other) => {
            eprint!("unknown command `{other}`\n\n{USAGE}");
            std::process::exit(2);
        }
    };
    if let Err(e) = r {
        eprintln!("xtask: error: {e:#}");
        std::process::exit(1);
    }
}
