//! `cargo xtask test`: the whole suite, in phases, each timed by the wall clock:
//!
//! 1. `setup` (`cargo xtask setup`, which first prints what this machine is: `detect.rs`);
//! 2. `build`: every binary of the workspace in release mode;
//! 3. `llama.cpp build`: the `avx2` and speed builds of the reference (`llama.rs`; taken from
//!    the cache when there), before the tests, which observe its programs (`observer/tests/llama.rs`);
//! 4. the tests: `cargo test --release --workspace --no-fail-fast` (arguments are passed on;
//!    `-p NAME` replaces `--workspace`), timed as `tests: compile`
//!    (until cargo runs the first test binary) and then one phase per test binary, from cargo's
//!    `Running …` / `Doc-tests …` line to the binary's `test result:` line; it says how many
//!    tests ran;
//! 5. `vmtest smoke`: `cargo xtask vmtest --smoke`, the smoke subset on Debian 12's 6.1 kernel
//!    under QEMU (`vmtest/`), its packages and QEMU from the vmtest cache. It runs as a child
//!    process *beside* phases 6–8 (its output in a log file, printed when it ends): QEMU's TCG
//!    keeps one core busy and the package fetch waits on the network, and none of the three
//!    measures time, so they share the machine and the smoke's 150 s (alone, empty cache)
//!    overlap the 225 s of parity and lints;
//! 6. `AMX check`: no AMX instruction in either build's ggml libraries (`amx.rs`);
//! 7. `parity <level>`: the engine against llama.cpp at each ISA level (`parity.rs`);
//! 8. `lints`: rustfmt check, clippy with warnings as errors.
//!
//! It ends with a table of the phases' wall times and their total, so that the budget (the
//! whole suite in well under 30 minutes on 2 cores from an empty cache) is visible in every log.
//! Phases 5–8 run even when a test failed, so that everything is reported; with arguments
//! (which select tests) they are skipped, saying so.
//!
//! Tests run in release so the binaries they drive (observer, engine, workload)
//! are the ones a user runs, and so nothing is compiled twice.

use std::io::{BufRead, BufReader};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::{cache, cmd, llama, parity, setup};

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Counts {
    pub(crate) passed: u64,
    pub(crate) failed: u64,
    pub(crate) ignored: u64,
    pub(crate) binaries: u64,
}

/// Parse cargo's `test result: ok. 5 passed; 0 failed; 1 ignored; …` line.
fn parse_result(line: &str) -> Option<Counts> {
    let rest = line.trim().strip_prefix("test result: ")?;
    let mut c = Counts { binaries: 1, ..Counts::default() };
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
    Some(c)
}

impl std::ops::AddAssign for Counts {
    fn add_assign(&mut self, o: Counts) {
        self.passed += o.passed;
        self.failed += o.failed;
        self.ignored += o.ignored;
        self.binaries += o.binaries;
    }
}

/// One timed phase of the suite.
#[derive(Debug, Clone, PartialEq)]
struct Phase {
    name: String,
    time: Duration,
    outcome: String,
}

/// The name of the test binary a cargo line starts, if it starts one: `Running unittests
/// src/lib.rs (target/release/deps/engine-0a1b…)` gives `engine (unittests src/lib.rs)`,
/// `Doc-tests engine` gives `doc-tests engine`.
fn binary_start(line: &str) -> Option<String> {
    let line = line.trim();
    if let Some(krate) = line.strip_prefix("Doc-tests ") {
        return Some(format!("doc-tests {krate}"));
    }
    let rest = line.strip_prefix("Running ")?;
    let (src, path) = rest.strip_suffix(')').and_then(|r| r.rsplit_once(" ("))?;
    let file = path.rsplit('/').next().unwrap_or(path);
    let stem = match file.rsplit_once('-') {
        Some((stem, hash)) if !hash.is_empty() && hash.bytes().all(|b| b.is_ascii_hexdigit()) => stem,
        _ => file,
    };
    Some(format!("{stem} ({src})"))
}

/// Splits `cargo test`'s merged output into phases: compiling until the first test binary
/// starts, then each binary from its start line to its `test result:` line.
pub(crate) struct TestClock {
    current: Option<(String, Instant)>,
    phases: Vec<Phase>,
    pub(crate) counts: Counts,
}

impl TestClock {
    fn new(start: Instant) -> TestClock {
        TestClock { current: Some(("tests: compile".to_owned(), start)), phases: Vec::new(), counts: Counts::default() }
    }

    fn close(&mut self, at: Instant, outcome: String) {
        if let Some((name, since)) = self.current.take() {
            self.phases.push(Phase { name, time: at.saturating_duration_since(since), outcome });
        }
    }

    fn feed(&mut self, line: &str, at: Instant) {
        if let Some(name) = binary_start(line) {
            let compiling = self.current.as_ref().is_some_and(|(n, _)| n == "tests: compile");
            self.close(at, if compiling { "ok" } else { "no `test result` line" }.to_owned());
            self.current = Some((format!("test {name}"), at));
        } else if let Some(c) = parse_result(line) {
            self.counts += c;
            let mut outcome = format!("{} passed", c.passed);
            if c.failed > 0 {
                outcome += &format!(", {} FAILED", c.failed);
            }
            if c.ignored > 0 {
                outcome += &format!(", {} ignored", c.ignored);
            }
            self.close(at, outcome);
        }
    }

    fn finish(&mut self, at: Instant, ok: bool) {
        let outcome = if ok { "ok" } else { "cargo test failed (no `test result` line)" };
        self.close(at, outcome.to_owned());
    }
}

/// The suite's phases so far.
#[derive(Default)]
pub(crate) struct Phases(Vec<Phase>);

impl Phases {
    /// Runs one phase, timed; its result is recorded and returned.
    pub(crate) fn run<T>(&mut self, name: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
        eprintln!("xtask test: == phase: {name}");
        let t0 = Instant::now();
        let r = f();
        let time = t0.elapsed();
        let outcome = match &r {
            Ok(_) => "ok".to_owned(),
            Err(e) => format!("FAILED: {}", format!("{e:#}").lines().next().unwrap_or_default()),
        };
        eprintln!("xtask test: phase {name}: {:.1} s, {outcome}", time.as_secs_f64());
        self.0.push(Phase { name: name.to_owned(), time, outcome });
        r
    }

    /// A phase that ran elsewhere (a [`Beside`] child), with its own wall time.
    fn record(&mut self, name: &str, time: Duration, outcome: &Result<()>) {
        let outcome = match outcome {
            Ok(()) => "ok".to_owned(),
            Err(e) => format!("FAILED: {}", format!("{e:#}").lines().next().unwrap_or_default()),
        };
        eprintln!("xtask test: phase {name}: {:.1} s, {outcome}", time.as_secs_f64());
        self.0.push(Phase { name: name.to_owned(), time, outcome });
    }

    fn skipped(&mut self, name: &str, why: &str) {
        self.0.push(Phase { name: name.to_owned(), time: Duration::ZERO, outcome: format!("not run: {why}") });
    }

    pub(crate) fn table(&self, total: Duration) -> String {
        let width = self.0.iter().map(|p| p.name.chars().count()).max().unwrap_or(5).max(5);
        let mut s = format!("{:<width$} {:>9}  outcome\n", "phase", "wall s");
        for p in &self.0 {
            s += &format!("{:<width$} {:>9.1}  {}\n", p.name, p.time.as_secs_f64(), p.outcome);
        }
        s += &format!("{:<width$} {:>9.1}  ({:.1} min)\n", "total", total.as_secs_f64(), total.as_secs_f64() / 60.0);
        s
    }
}

/// A phase run as a child `xtask` process beside the phases that follow it: its stdout and
/// stderr go to a log file, printed whole when it is joined.
struct Beside {
    name: String,
    log: std::path::PathBuf,
    child: std::process::Child,
    start: Instant,
}

impl Beside {
    fn start(name: &str, xtask_args: &[&str]) -> Result<Beside> {
        let dir = cache::target_dir().join("xtask");
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let log = dir.join(format!("{}.log", xtask_args.join("-").replace("--", "")));
        let file = std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        // The running executable through `/proc/self/exe`, not by its path: the suite's own
        // `cargo build` replaces `target/release/xtask` while it runs (a fresh clone's first run
        // did), and the old path then names nothing.
        let exe = "/proc/self/exe";
        eprintln!("xtask test: == phase: {name} (beside the next phases; its output in {})", log.display());
        let child = Command::new(exe)
            .args(xtask_args)
            .stdin(std::process::Stdio::null())
            .stdout(file.try_clone().context("duplicating a file handle")?)
            .stderr(file)
            .spawn()
            .with_context(|| format!("starting xtask {}", xtask_args.join(" ")))?;
        Ok(Beside { name: name.to_owned(), log, child, start: Instant::now() })
    }

    /// Waits for the child, prints its log and records its phase.
    fn join(mut self, phases: &mut Phases) -> Result<()> {
        let status = self.child.wait().context("waiting for a phase run beside the others");
        let time = self.start.elapsed();
        eprintln!("xtask test: == output of {} ({})", self.name, self.log.display());
        match std::fs::read_to_string(&self.log) {
            Ok(text) => print!("{text}"),
            Err(e) => eprintln!("xtask test: cannot read {}: {e}", self.log.display()),
        }
        let r = match status {
            Ok(s) if s.success() => Ok(()),
            Ok(s) => Err(anyhow::anyhow!("xtask exited with {s} (its output above, and in {})", self.log.display())),
            Err(e) => Err(e),
        };
        phases.record(&self.name, time, &r);
        r
    }
}

/// `cargo test`, its stdout and stderr merged in one pipe (so that cargo's `Running` lines and
/// the binaries' results arrive in order), each line printed and fed to a [`TestClock`]; `env` is
/// set for cargo (the cross run's compiler, linker and runner).
pub(crate) fn cargo_test(root: &std::path::Path, args: &[String], env: &[(&str, String)]) -> Result<(TestClock, bool)> {
    let (reader, writer) = std::io::pipe().context("creating a pipe for cargo test")?;
    let mut c = Command::new("cargo");
    c.current_dir(root)
        .args(test_args(args))
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdout(writer.try_clone().context("duplicating a pipe")?)
        .stderr(writer);
    eprintln!("+ cargo {}", test_args(args).join(" "));
    let start = Instant::now();
    let mut child = c.spawn().context("cannot run cargo test")?;
    drop(c); // closes our copies of the pipe's write end, so that the read end sees the end
    let mut clock = TestClock::new(start);
    for line in BufReader::new(reader).lines() {
        let line = line.context("reading cargo test output")?;
        println!("{line}");
        clock.feed(&line, Instant::now());
    }
    let status = child.wait()?;
    clock.finish(Instant::now(), status.success());
    Ok((clock, status.success()))
}

/// `cargo`'s arguments for the suite's tests: `test --release --no-fail-fast`, the whole workspace
/// unless the arguments select packages (`--workspace` would override a `-p NAME`), then `args`.
fn test_args(args: &[String]) -> Vec<String> {
    let packages = args.iter().take_while(|a| *a != "--").any(|a| a.starts_with("-p") || a.starts_with("--package"));
    let scope: &[&str] = if packages { &[] } else { &["--workspace"] };
    ["test", "--release", "--no-fail-fast"]
        .iter()
        .chain(scope)
        .map(|s| s.to_string())
        .chain(args.iter().cloned())
        .collect()
}

pub fn run(args: &[String]) -> Result<()> {
    let t0 = Instant::now();
    let mut phases = Phases::default();
    let root = cache::workspace_root();
    let result = suite(&root, args, &mut phases);
    println!("\nxtask test: wall time per phase\n{}", phases.table(t0.elapsed()));
    result
}

fn suite(root: &std::path::Path, args: &[String], phases: &mut Phases) -> Result<()> {
    phases.run("setup", || setup::run(setup::Scope::All))?;
    phases.run("build", || {
        cmd::run(Command::new("cargo").current_dir(root).args(["build", "--release", "--workspace", "--bins"]))
    })?;

    // The reference llama.cpp builds come before the tests: `observer/tests/llama.rs` observes
    // its programs. A failed build is reported at the end, beside the tests it broke. (Built
    // beside the workspace's build and test build instead, the three took 1015 s from an empty
    // cache on 2 idle cores against 981 s one after the other: the C++ and Rust compiles share
    // the same two cores, so they stay apart.)
    let builds = if args.is_empty() {
        Some(phases.run("llama.cpp build", || llama::ensure_for(llama::TEST_TARGETS, llama::PARITY_TARGETS)))
    } else {
        None
    };
    let (clock, test_ok) = cargo_test(root, args, &[])?;
    let counts = clock.counts;
    phases.0.extend(clock.phases);
    let ran = counts.passed + counts.failed;
    println!(
        "\nxtask test: {ran} tests ran in {} test binaries: {} passed, {} failed, {} ignored",
        counts.binaries, counts.passed, counts.failed, counts.ignored
    );

    // Parity with llama.cpp is part of the suite (it needs no privileges and measures
    // nothing about the machine); it runs even when a test failed, so both are reported.
    let mut late: Vec<anyhow::Error> = Vec::new();
    // The kernels users run: the smoke subset of `cargo xtask vmtest` on Debian 12's 6.1 LTS
    // kernel under QEMU (boot, attach/detach, a fault count against getrusage, a cgroup v2
    // limit). Its kernel and QEMU packages come from the vmtest cache (fetched once); when they
    // cannot be had, the phase fails and says why.
    const SMOKE: &str = "vmtest smoke (debian-6.1 guest, beside the phases below)";
    let smoke = if args.is_empty() {
        match Beside::start(SMOKE, &["vmtest", "--smoke"]) {
            Ok(b) => Some(b),
            Err(e) => {
                late.push(e.context("the vmtest smoke subset (`cargo xtask vmtest --smoke`)"));
                None
            }
        }
    } else {
        phases.skipped(SMOKE, "arguments select tests");
        None
    };
    if let Some(builds) = builds {
        match builds {
            Ok(builds) => {
                let amx = phases.run("AMX check", || llama::check_no_amx(&builds));
                // (No early return: the smoke beside must be joined.)
                let engine = llama::build_engine().unwrap_or_else(|e| {
                    late.push(e.context("building the engine for parity"));
                    std::path::PathBuf::new()
                });
                for (level, build) in parity::levels(&builds).into_iter().filter(|_| !engine.as_os_str().is_empty()) {
                    if let Err(e) =
                        phases.run(&format!("parity {}", level.name()), || parity::run_level(level, build, &engine, 2))
                    {
                        late.push(e.context(format!("parity with llama.cpp at the {} level", level.name())));
                    }
                }
                if let Err(e) = amx {
                    late.push(e);
                }
            }
            Err(e) => {
                phases.skipped("AMX check", "no llama.cpp build");
                phases.skipped("parity", "no llama.cpp build");
                late.push(e.context("building llama.cpp"));
            }
        }
        if let Err(e) = phases.run("lints", || lint(root)) {
            late.push(e);
        }
    }
    if let Some(smoke) = smoke
        && let Err(e) = smoke.join(phases)
    {
        late.push(e.context("the vmtest smoke subset (`cargo xtask vmtest --smoke`)"));
    }
    if !args.is_empty() {
        eprintln!(
            "xtask test: arguments select tests, so the llama.cpp build, the AMX check, parity and the lints are not \
             run (run `cargo xtask parity`)"
        );
        for name in ["llama.cpp build", "AMX check", "parity", "lints"] {
            phases.skipped(name, "arguments select tests");
        }
    }
    if !test_ok || counts.failed > 0 {
        let also: Vec<String> = late.iter().map(|e| format!("{e:#}")).collect();
        if also.is_empty() {
            bail!("test suite failed");
        }
        bail!("test suite failed; also: {}", also.join("; "));
    }
    if let Some(e) = late.into_iter().next() {
        return Err(e);
    }
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
        c += parse_result(
            "test result: ok. 5 passed; 0 failed; 1 ignored; 0 measured; 2 filtered out; finished in 0.01s",
        )
        .unwrap();
        c += parse_result("test result: FAILED. 3 passed; 2 failed; 0 ignored; 0 measured; 0 filtered out").unwrap();
        assert_eq!((c.passed, c.failed, c.ignored, c.binaries), (8, 2, 1, 2));
        assert_eq!(parse_result("running 5 tests"), None);
    }

    #[test]
    fn names_test_binaries() {
        assert_eq!(
            binary_start("     Running unittests src/lib.rs (target/release/deps/engine-4f0d2c9a1b3e5d7f)").as_deref(),
            Some("engine (unittests src/lib.rs)")
        );
        assert_eq!(
            binary_start("     Running tests/attach.rs (target/release/deps/attach-00ff)").as_deref(),
            Some("attach (tests/attach.rs)")
        );
        assert_eq!(binary_start("   Doc-tests observer_common").as_deref(), Some("doc-tests observer_common"));
        assert_eq!(binary_start("test running_things ... ok"), None);
    }

    #[test]
    fn times_compile_and_each_binary() {
        let t = Instant::now();
        let at = |s: u64| t + Duration::from_secs(s);
        let mut clock = TestClock::new(t);
        clock.feed("   Compiling engine v0.1.0", at(1));
        clock.feed("     Running unittests src/lib.rs (target/release/deps/engine-0123)", at(60));
        clock.feed("test quant::x ... ok", at(61));
        clock.feed("test result: ok. 3 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out", at(70));
        clock.feed("     Running tests/e2e.rs (target/release/deps/e2e-abcd)", at(71));
        clock.feed("test result: FAILED. 1 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out", at(100));
        clock.feed("     Running tests/crash.rs (target/release/deps/crash-abcd)", at(101));
        clock.finish(at(105), false);
        let got: Vec<(String, u64, String)> =
            clock.phases.iter().map(|p| (p.name.clone(), p.time.as_secs(), p.outcome.clone())).collect();
        let want = [
            ("tests: compile", 60, "ok"),
            ("test engine (unittests src/lib.rs)", 10, "3 passed"),
            ("test e2e (tests/e2e.rs)", 29, "1 passed, 1 FAILED"),
            ("test crash (tests/crash.rs)", 4, "cargo test failed (no `test result` line)"),
        ]
        .map(|(n, s, o)| (n.to_owned(), s, o.to_owned()));
        assert_eq!(got, want);
        assert_eq!(clock.counts, Counts { passed: 4, failed: 1, ignored: 0, binaries: 2 });
    }

    #[test]
    fn a_phase_beside_runs_this_executable_and_is_recorded_with_its_outcome() {
        // The test harness is this executable: `--list` succeeds, an unknown flag fails.
        let mut p = Phases::default();
        Beside::start("listing", &["--list"]).unwrap().join(&mut p).unwrap();
        let e = Beside::start("refusing", &["--no-such-flag"]).unwrap().join(&mut p).unwrap_err();
        assert!(format!("{e:#}").contains("exited with"), "{e:#}");
        let table = p.table(Duration::from_secs(1));
        assert!(table.lines().any(|l| l.starts_with("listing") && l.ends_with("ok")), "{table}");
        assert!(table.lines().any(|l| l.starts_with("refusing") && l.contains("FAILED")), "{table}");
    }

    #[test]
    fn the_table_lists_every_phase_and_the_total() {
        let mut p = Phases::default();
        p.run("setup", || Ok(())).unwrap();
        assert!(p.run("lints", || -> Result<()> { bail!("clippy found warnings") }).is_err());
        p.skipped("parity", "no llama.cpp build");
        let table = p.table(Duration::from_secs(90));
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 5, "{table}");
        assert!(lines[2].starts_with("lints") && lines[2].ends_with("FAILED: clippy found warnings"), "{table}");
        assert!(lines[3].ends_with("not run: no llama.cpp build"), "{table}");
        assert!(
            lines[4].starts_with("total") && lines[4].contains("90.0") && lines[4].contains("(1.5 min)"),
            "{table}"
        );
    }
}
