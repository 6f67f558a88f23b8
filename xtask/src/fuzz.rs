//! `cargo xtask fuzz`: long fuzzing of every parser of untrusted input (the targets and the
//! rules are in the `fuzz` crate's doc). A separate heavy command; `cargo xtask test` runs only
//! the short seeded run of each target (`fuzz/tests/smoke.rs`).
//!
//! ```text
//! cargo xtask fuzz [--time T]             every target in turn, T each (default 600 s)
//! cargo xtask fuzz TARGET [--time T]      one target, without end unless --time (Ctrl-C stops)
//!                                         (T: seconds, or 60s, 10m, 2h)
//! cargo xtask fuzz TARGET --mutate [--seed N]   the stable seeded mutation fuzzer instead
//! cargo xtask fuzz TARGET --replay FILE…  run the target on saved inputs (a crash found)
//! cargo xtask fuzz --list                 the targets
//! ```
//!
//! The coverage-guided runs use libFuzzer (`libfuzzer-sys`, its C++ built by the `cc` crate),
//! with the sanitizer-coverage passes that stable rustc has (`-Cpasses=sancov-module` and LLVM's
//! options; no sanitizer, so no nightly), debug assertions and overflow checks on. The binary is
//! built into `target/fuzz/build`; its working corpus is `target/fuzz/corpus/TARGET` (seeded
//! from the target's seeds), crashes go to `target/fuzz/crashes/`. Inputs worth keeping (every
//! crash, once fixed) are copied to `fuzz/corpus/TARGET/`, which both engines replay.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};

/// The flags of cargo-fuzz's default build (`cargo fuzz build -s none`), all stable.
const COVERAGE_FLAGS: &[&str] = &[
    "-Cpasses=sancov-module",
    "-Cllvm-args=-sanitizer-coverage-level=4",
    "-Cllvm-args=-sanitizer-coverage-inline-8bit-counters",
    "-Cllvm-args=-sanitizer-coverage-pc-table",
    "-Cllvm-args=-sanitizer-coverage-trace-compares",
    "--cfg=fuzzing",
    "-Cdebug-assertions",
    "-Coverflow-checks",
];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn host_triple() -> Result<String> {
    let v = crate::cmd::output(Command::new("rustc").arg("-vV"))?;
    v.lines().find_map(|l| l.strip_prefix("host: ")).map(str::to_string).context("rustc -vV printed no host")
}

/// The stable fuzz tool (`fuzz/src/main.rs`), built as usual.
fn tool() -> Result<PathBuf> {
    crate::cmd::run(Command::new("cargo").current_dir(root()).args([
        "build",
        "--release",
        "-p",
        "fuzz",
        "--bin",
        "fuzz",
    ]))?;
    Ok(crate::cache::target_dir().join("release/fuzz"))
}

/// The libFuzzer binary, built with coverage.
fn libfuzzer() -> Result<PathBuf> {
    let triple = host_triple()?;
    let dir = crate::cache::target_dir().join("fuzz/build");
    eprintln!("fuzz: building the libFuzzer binary with sanitizer coverage into {}", dir.display());
    crate::cmd::run(
        Command::new("cargo")
            .current_dir(root())
            .args(["build", "--release", "-p", "fuzz", "--features", "libfuzzer", "--bin", "fuzz-libfuzzer"])
            .args(["--target", &triple, "--target-dir"])
            .arg(&dir)
            .env("RUSTFLAGS", COVERAGE_FLAGS.join(" "))
            .env_remove("CARGO_ENCODED_RUSTFLAGS"),
    )?;
    Ok(dir.join(triple).join("release/fuzz-libfuzzer"))
}

fn targets(tool: &Path) -> Result<Vec<String>> {
    let list = crate::cmd::output(Command::new(tool).arg("list"))?;
    Ok(list.lines().filter_map(|l| l.split_whitespace().next()).map(str::to_string).collect())
}

/// libFuzzer on `target`, for `time` seconds (`None`: without end).
fn run_libfuzzer(tool: &Path, bin: &Path, target: &str, time: Option<u64>) -> Result<()> {
    let work = crate::cache::target_dir().join("fuzz");
    let corpus = work.join("corpus").join(target);
    let crashes = work.join("crashes");
    std::fs::create_dir_all(&crashes).with_context(|| format!("creating {}", crashes.display()))?;
    crate::cmd::run(Command::new(tool).arg("seeds").arg(target).arg(&corpus))?;
    let committed = root().join("fuzz/corpus").join(target);
    let mut c = Command::new(bin);
    c.env("MOE_FUZZ_TARGET", target)
        .arg(format!("-artifact_prefix={}/{target}-", crashes.display()))
        .args(["-timeout=60", "-rss_limit_mb=4096", "-max_len=1048576", "-print_final_stats=1"])
        .arg(&corpus);
    if committed.is_dir() {
        c.arg(&committed);
    }
    if let Some(t) = time {
        c.arg(format!("-max_total_time={t}"));
    }
    eprintln!(
        "fuzz {target}: libFuzzer{}",
        time.map_or(" without end (Ctrl-C stops)".into(), |t| format!(" for {t} s"))
    );
    let st = c.status().with_context(|| format!("running {}", bin.display()))?;
    if !st.success() {
        bail!(
            "fuzz {target}: libFuzzer found a failing input ({st}); it is in {}/{target}-*; replay it with \
             `cargo xtask fuzz {target} --replay FILE`, fix it, and add it to fuzz/corpus/{target}/",
            crashes.display()
        );
    }
    Ok(())
}

/// A duration in whole seconds: `60`, `60s`, `10m` or `2h`.
fn seconds(s: &str) -> Result<u64> {
    let (num, unit) = match s.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => s.split_at(i),
        None => (s, "s"),
    };
    let scale = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        _ => bail!("--time {s:?}: give seconds, or a number with s, m or h (60, 60s, 10m, 2h)"),
    };
    let n: u64 = num.parse().with_context(|| format!("--time {s:?}: give seconds, or a number with s, m or h"))?;
    if n == 0 {
        bail!("--time {s:?}: give a positive duration");
    }
    Ok(n * scale)
}

pub fn main(args: &[String]) -> Result<()> {
    let mut target = None;
    let (mut time, mut mutate, mut seed, mut replay, mut list) = (None, false, 1u64, None::<Vec<String>>, false);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--time" => time = Some(seconds(it.next().context("--time takes a duration: 60, 60s, 10m, 2h")?)?),
            "--mutate" => mutate = true,
            "--seed" => seed = it.next().context("--seed takes a number")?.parse().context("--seed N")?,
            "--replay" => replay = Some(it.by_ref().cloned().collect()),
            "--list" => list = true,
            s if !s.starts_with('-') && target.is_none() => target = Some(s.to_string()),
            s => bail!("fuzz: unknown argument {s:?} (see `cargo xtask help`)"),
        }
    }
    let tool = tool()?;
    let all = targets(&tool)?;
    if list {
        crate::cmd::run(Command::new(&tool).arg("list"))?;
        return Ok(());
    }
    if let Some(t) = &target
        && !all.contains(t)
    {
        bail!("fuzz: no target {t:?}; the targets are {}", all.join(", "));
    }
    if let Some(files) = replay {
        let t = target.context("--replay: name the target first: cargo xtask fuzz TARGET --replay FILE…")?;
        return crate::cmd::run(Command::new(&tool).arg("replay").arg(t).args(files));
    }
    if mutate {
        let t = target.context("--mutate: name the target: cargo xtask fuzz TARGET --mutate")?;
        return crate::cmd::run(Command::new(&tool).args(["mutate", &t, "--seed", &seed.to_string()]));
    }
    let bin = libfuzzer()?;
    match target {
        Some(t) => run_libfuzzer(&tool, &bin, &t, time),
        None => {
            let time = time.unwrap_or(600);
            for t in &all {
                run_libfuzzer(&tool, &bin, t, Some(time))?;
            }
            eprintln!("fuzz: {} targets ran {time} s each without a failure", all.len());
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn time_takes_seconds_or_a_unit() {
        for (arg, s) in [("60", 60), ("60s", 60), ("10m", 600), ("2h", 7200)] {
            assert_eq!(super::seconds(arg).unwrap(), s, "{arg}");
        }
        for bad in ["", "0", "s", "1d", "-5", "1.5m"] {
            assert!(super::seconds(bad).is_err(), "{bad:?} accepted");
        }
    }
}
