//! `cargo xtask test`: setup, build every binary in release mode, run every
//! test of the workspace in release mode, say how many ran, then run
//! `cargo xtask parity` (the engine against llama.cpp; under a minute once llama.cpp
//! is built in the cache, about 12 minutes on 2 cores the first time), then
//! the lints (rustfmt check, clippy with warnings as errors).
//!
//! Tests run in release so the binaries they drive (observer, engine, workload)
//! are the ones a user runs, and so nothing is compiled twice.

use std::{
    io::{BufRead, BufReader},
    process::{Command, Stdio},
};

use anyhow::{Context, Result, bail};

use crate::{cache, cmd, parity, setup};

#[derive(Debug, Default)]
struct Counts {
    passed: u64,
    failed: u64,
    ignored: u64,
    binaries: u64,
}

/// Parse cargo's `test result: ok. 5 passed; 0 failed; 1 ignored; …` line.
fn parse_result(line: &str, c: &mut Counts) {
    let Some(rest) = line.trim().strip_prefix("test result: ") else { return };
    c.binaries += 1;
    for part in rest.split(';') {
        let words: Vec<&str> = part.split_whitespace().collect();
        let (n, what) = match words.as_slice() {
            [_, n, what, ..] if n.parse::<u64>().is_ok() => (n, what),
            [n, what, ..] => (n, what),
            _ => continue,
        };
        let Ok(n) = n.parse::<u64>() else { continue };
        match *what {
            "passed" => c.passed += n,
            "failed" => c.failed += n,
            "ignored" => c.ignored += n,
            _ => {}
        }
    }
}

pub fn run(args: &[String]) -> Result<()> {
    setup::run(setup::Scope::All)?;
    let root = cache::workspace_root();
    cmd::run(Command::new("cargo").current_dir(&root).args(["build", "--release", "--workspace", "--bins"]))?;

    let mut c = Command::new("cargo");
    c.current_dir(&root).args(["test", "--release", "--workspace", "--no-fail-fast"]).args(args).stdout(Stdio::piped());
    eprintln!("+ cargo test --release --workspace --no-fail-fast {}", args.join(" "));
    let mut child = c.spawn().context("cannot run cargo test")?;
    let out = child.stdout.take().context("no stdout")?;
    let mut counts = Counts::default();
    for line in BufReader::new(out).lines() {
        let line = line.context("reading cargo test output")?;
        println!("{line}");
        parse_result(&line, &mut counts);
    }
    let status = child.wait()?;
    let ran = counts.passed + counts.failed;
    println!(
        "\nxtask test: {ran} tests ran in {} test binaries: {} passed, {} failed, {} ignored",
        counts.binaries, counts.passed, counts.failed, counts.ignored
    );
    // Parity with llama.cpp is part of the suite (it needs no privileges and measures
    // nothing about the machine); it runs even when a test failed, so both are reported.
    let (parity, lint) = if args.is_empty() {
        eprintln!("+ cargo xtask parity");
        (parity::main(&[]), lint(&root))
    } else {
        eprintln!(
            "xtask test: arguments select tests, so parity with llama.cpp and the lints are not run (run `cargo xtask parity`)"
        );
        (Ok(()), Ok(()))
    };
    if !status.success() || counts.failed > 0 {
        bail!("test suite failed{}", if parity.is_err() { "; parity with llama.cpp failed too" } else { "" });
    }
    parity.context("parity with llama.cpp (cargo xtask parity)")?;
    lint?;
    if counts.ignored > 0 {
        bail!("{} tests are #[ignore]d: this project does not skip tests silently", counts.ignored);
    }
    if ran == 0 && args.is_empty() {
        bail!("no tests ran");
    }
    Ok(())
}

/// Formatting (`rustfmt.toml`) and clippy with the root manifest's lints, warnings as errors,
/// for the workspace and for the eBPF crate (its own workspace).
fn lint(root: &std::path::Path) -> Result<()> {
    for tool in ["clippy", "rustfmt"] {
        let has = Command::new("cargo").arg(if tool == "clippy" { "clippy" } else { "fmt" }).arg("--version").output();
        if !has.is_ok_and(|o| o.status.success()) {
            eprintln!("xtask test: `cargo {tool}` missing: rustup component add {tool}");
            cmd::run(Command::new("rustup").args(["component", "add", tool])).with_context(|| {
                format!("the lints need {tool}: install it (`rustup component add {tool}`) and run again")
            })?;
        }
    }
    for dir in [root.to_path_buf(), root.join("observer-ebpf")] {
        cmd::run(Command::new("cargo").current_dir(&dir).args(["fmt", "--all", "--check"]))
            .with_context(|| format!("formatting in {}: run `cargo fmt --all` there", dir.display()))?;
    }
    cmd::run(Command::new("cargo").current_dir(root).args([
        "clippy",
        "--release",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]))
    .context("clippy found warnings")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_cargo_result_line() {
        let mut c = Counts::default();
        parse_result(
            "test result: ok. 5 passed; 0 failed; 1 ignored; 0 measured; 2 filtered out; finished in 0.01s",
            &mut c,
        );
        parse_result("test result: FAILED. 3 passed; 2 failed; 0 ignored; 0 measured; 0 filtered out", &mut c);
        assert_eq!((c.passed, c.failed, c.ignored, c.binaries), (8, 2, 1, 2));
    }
}
