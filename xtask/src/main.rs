//! `cargo xtask …`: the project's own scripts, in Rust.
//!
//! - `setup`: install and check everything the eBPF build and the tests need (idempotent).
//! - `test`: setup, build, run every test, say how many ran and how long each phase took.
//! - `test --target aarch64`: the engine cross-built for aarch64, its tests under qemu (`cross.rs`).
//! - `demo`: setup, build, observe a workload and print the observer's table.
//! - `parity`: the engine against llama.cpp on synthetic models, at each ISA level.
//! - `bench engine`: engine vs llama.cpp decode/prompt speed, same file, same run.
//! - `bench neon`: the aarch64 engine's `neon` vs `scalar` level, both under qemu (a sanity check
//!   that the SIMD path is taken, not a speed).
//! - `package`: the Debian package of the observer (dpkg-deb), built then checked as installed;
//!   `man`: its man pages and completions. Separate heavy commands (`package.rs`).
//! - `pressure`: run a command under a cgroup memory limit, optional zram and balloon.
//! - `bench cliff`: the expert cache vs the mapping vs llama.cpp under memory limits.
//! - `bench heatmap`: one residency refresh of a 20 GB (sparse) model vs `fincore`, same file.
//! - `bench storm`: a minor-fault storm alone and under the observer (slowdown, eBPF ns per fault).
//! - `bench trace`: bytes per token record with the expert grid packed vs plain JSON, same run.
//! - `experiment dense-weights`: the seeds' dense-weight A/B, written to `docs/findings/`.
//! - `experiment cliff`: `bench cliff` written up as `docs/findings/cliff.md` with its plot.
//! - `fuzz`: long coverage-guided fuzzing of every parser of untrusted input (libFuzzer).
//! - `vmtest`: the eBPF and cgroup tests on Debian's kernels (6.1 LTS, 6.12, arm64) under QEMU.

mod amx;
mod bench_cliff;
mod bench_engine;
mod bench_heatmap;
mod bench_metrics;
mod bench_neon;
mod bench_observer;
mod bench_storm;
mod bench_trace;
mod bench_tui;
mod bench_util;
mod bench_within;
mod cache;
mod cmd;
mod cross;
mod demo;
mod detect;
mod displace;
mod experiment;
mod experiment_cliff;
mod ftrace;
mod fuzz;
mod llama;
mod package;
mod parity;
mod pressure;
mod setup;
mod soak;
mod test;
mod ticklock;
mod vmtest;

use anyhow::Result;

const USAGE: &str = "usage: cargo xtask <command>

commands:
  setup              install and check the eBPF toolchain and test tools (root, Debian)
  test [ARGS]        setup, then run the whole test suite (ARGS go to `cargo test`)
  test --target aarch64  cross-build the engine for aarch64 and run its tests under qemu-aarch64
                     (installs ~700 MB of Debian packages; not part of `test`)
  demo               setup, then run the observer on a demo workload
  parity [OPTIONS]   engine vs llama.cpp: tokens, greedy continuations, logits (--arch A,B;
                     --target aarch64 [--level L | --negative-control] under qemu-aarch64)
  bench engine [..]  engine vs llama.cpp decode and prompt tok/s, printed as ratios (--arch A)
  bench neon [..]    aarch64 engine, neon vs scalar level, both under qemu-aarch64: tok/s ratio
                     (emulated: a check that the SIMD path is taken, not ARM speed)
  bench observer     engine decode tok/s with and without the observer, as a ratio
  bench tui          what `observer tui` costs the engine: decode speed around its ticks, as a ratio
  package            the Debian package (dpkg-deb): observer, its systemd unit, serve.toml, LICENSE,
                     man pages, completions; then checked as installed (dpkg-deb -x, --version)
  man [DIR]          man pages (clap_mangen) and shell completions of observer (default target/assets)
  image              the container image (buildah bud, packaging/Containerfile), checked; an OCI archive
  pressure [..] -- CMD  run CMD under a memory limit (+ zram, balloon); restores the machine
  bench heatmap [..] residency refresh of a 20 GB sparse model vs fincore, same run
  bench metrics      observed engine tok/s with and without bursts of /metrics scrapes
  bench cliff [..]   expert cache vs mmap vs llama.cpp under memory limits (none, 80/60/40 % of a 5.6 GB model)
  bench storm [..]   a minor-fault storm alone and under the observer: slowdown, eBPF ns per program and fault
  bench trace [..]   trace bytes per token record, expert grid packed vs plain JSON, same run
  experiment dense-weights [-n N] [-t T]  A-B-B-A of --dense anon vs locked under pressure:
                     docs/findings/dense-weights.md and its plots
  experiment cliff [--small] [--out DIR] [bench cliff options]  bench cliff written up:
                     docs/findings/cliff.md, cliff.svg, cliff.json (--small: a reduced run, into
                     target/experiment-cliff-small/)
  fuzz [TARGET]      fuzz every parser of untrusted input with libFuzzer: each target 600 s, or one
                     without end (--time 60s bounds it; --mutate: the stable fuzzer, --replay FILE, --list)
  vmtest [..]        the eBPF and cgroup tests in QEMU guests: Debian 6.1 LTS, 6.12, arm64 (--smoke, --list)
  soak [--minutes N] `observer serve --discover` while engines come and go (default 10 min): RSS, fds
                     and series over time, failing if they grow past their bounds after the warm-up
";

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let r: Result<()> = match args.iter().map(String::as_str).collect::<Vec<_>>().as_slice() {
        ["setup", ..] => setup::run(setup::Scope::All).map(|_| ()),
        ["test", "--target", "aarch64", ..] => cross::run(&args[3..]),
        ["test", ..] => test::run(&args[1..]),
        ["demo", ..] => demo::run(&args[1..]),
        ["parity", ..] => parity::main(&args[1..]),
        ["bench", "engine", ..] => bench_engine::main(&args[2..]),
        ["bench", "neon", ..] => bench_neon::main(&args[2..]),
        ["bench", "observer", ..] => bench_observer::main(&args[2..]),
        ["bench", "tui", ..] => bench_tui::main(&args[2..]),
        ["pressure", ..] => pressure::main(&args[1..]),
        ["package", ..] => package::main(&args[1..]),
        ["man", ..] => package::man(&args[1..]),
        ["image", ..] => package::image(&args[1..]),
        ["bench", "heatmap", ..] => bench_heatmap::main(&args[2..]),
        ["bench", "metrics", ..] => bench_metrics::main(&args[2..]),
        ["bench", "cliff", ..] => bench_cliff::main(&args[2..]),
        ["bench", "trace", ..] => bench_trace::main(&args[2..]),
        ["bench", "storm", ..] => bench_storm::main(&args[2..]),
        ["experiment", ..] => experiment::main(&args[1..]),
        ["vmtest", ..] => vmtest::main(&args[1..]),
        ["fuzz", ..] => fuzz::main(&args[1..]),
        ["soak", ..] => soak::main(&args[1..]),
        ["-h" | "--help" | "help"] | [] => {
            print!("{USAGE}");
            Ok(())
        }
        [other, ..] => {
            eprint!("unknown command `{other}`\n\n{USAGE}");
            std::process::exit(2);
        }
    };
    if let Err(e) = r {
        eprintln!("xtask: error: {e:#}");
        std::process::exit(1);
    }
}
