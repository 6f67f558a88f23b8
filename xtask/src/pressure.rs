//! `cargo xtask pressure [OPTIONS] -- CMD [ARGS…]`: run a command under memory pressure.
//!
//! Sets up (as root) optional zram swap, a memory cgroup limit (cgroup v2 or v1, whichever holds
//! the memory controller, through the `memcg` crate; it says which) and an optional anonymous
//! balloon inside it (`testkit::Pressure`), runs CMD inside the cgroup (placed there from the
//! child, never moving this process), prints the cgroup's and the machine's swap and fault
//! counters, and always restores the machine: also on Ctrl-C, which reaches CMD (same process
//! group) while this process waits for it and then cleans up.
//!
//! Example: `cargo xtask pressure --limit-mib 400 --zram-mib 1024 --balloon-mib 256 --
//! target/release/engine run -m M.gguf -p "…" -n 64 --dense anon --metrics-csv anon.csv`

use std::time::Duration;

use anyhow::{Context, Result, bail};

const USAGE: &str =
    "usage: cargo xtask pressure --limit-mib N [--zram-mib M] [--balloon-mib B] [--touch-ms T] -- CMD [ARGS…]

  --limit-mib N    memory cgroup limit for CMD (and the balloon); cgroup v2 or v1, whichever
                   holds the memory controller (MOE_CGROUP_PARENT=DIR: make the group under DIR)
  --zram-mib M     enable zram swap of M MiB for the run (default: none)
  --balloon-mib B  an anonymous balloon of B MiB in the same cgroup (default: none)
  --touch-ms T     the balloon re-reads all its pages every T ms (default 100)
";

static INTERRUPTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// SIGINT/SIGTERM while the machine is set up: remember it and clean up (a handler, not
/// SIG_IGN, so that the command, which execs, gets the default disposition back).
extern "C" fn interrupted(_: libc::c_int) {
    INTERRUPTED.store(true, std::sync::atomic::Ordering::Relaxed);
}

pub fn main(args: &[String]) -> Result<()> {
    let split = args.iter().position(|a| a == "--").with_context(|| format!("missing `-- CMD`\n\n{USAGE}"))?;
    let (opts, cmd) = (&args[..split], &args[split + 1..]);
    if cmd.is_empty() {
        bail!("no command after `--`\n\n{USAGE}");
    }
    let mut limit = None;
    let mut zram = None;
    let mut balloon = 0u64;
    let mut touch_ms = 100u64;
    let mut it = opts.iter();
    while let Some(o) = it.next() {
        let mut val = |name: &str| -> Result<u64> {
            let v = it.next().with_context(|| format!("{name} needs a value\n\n{USAGE}"))?;
            v.parse().with_context(|| format!("{name} {v:?} is not a number"))
        };
        match o.as_str() {
            "--limit-mib" => limit = Some(val(o)?),
            "--zram-mib" => zram = Some(val(o)?),
            "--balloon-mib" => balloon = val(o)?,
            "--touch-ms" => touch_ms = val(o)?,
            "-h" | "--help" => {
                print!("{USAGE}");
                return Ok(());
            }
            other => bail!("unknown option {other}\n\n{USAGE}"),
        }
    }
    let limit = limit.with_context(|| format!("--limit-mib is required\n\n{USAGE}"))?;
    if !testkit::is_root() {
        bail!("cargo xtask pressure changes zram and cgroups: run it as root");
    }
    let _lock = testkit::machine_lock();
    // From here on Ctrl-C / SIGTERM never skip the cleanup: during the setup they cancel the
    // run, while CMD runs they reach CMD (same process group) and we clean up after it.
    // SAFETY: installing a handler that only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, interrupted as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, interrupted as *const () as libc::sighandler_t);
    }
    let cfg = testkit::PressureConfig {
        name: "xtask-pressure".into(),
        limit_bytes: limit << 20,
        zram_mib: zram,
        balloon_mib: balloon,
        balloon_touch: Duration::from_millis(touch_ms),
    };
    let before = testkit::vmstat_snapshot();
    let p = testkit::Pressure::new(&cfg).context("setting up memory pressure")?;
    eprintln!(
        "pressure: {}: cgroup {} limit {limit} MiB, zram {}, balloon {}",
        p.cgroup.describe(),
        p.cgroup.dir().display(),
        p.zram.as_ref().map_or("off".to_string(), |z| format!("{} {} MiB", z.device(), zram.unwrap_or(0))),
        p.balloon.as_ref().map_or("none".to_string(), |b| format!(
            "{} MiB (pid {}, touch {touch_ms} ms)",
            b.mib(),
            b.pid()
        ))
    );
    if INTERRUPTED.load(std::sync::atomic::Ordering::Relaxed) {
        drop(p);
        bail!("interrupted during the setup; machine restored");
    }
    let refs: Vec<&str> = cmd.iter().map(String::as_str).collect();
    let status = p.command(&refs).status().with_context(|| format!("running {}", cmd.join(" ")));
    let stats = p.stats(&before);
    let balloon_alive = p.balloon.as_ref().map(testkit::Balloon::alive);
    drop(p);
    let status = status?;
    let mib = |v: Option<u64>| v.map_or("n/a".to_string(), |v| format!("{:.1} MiB", v as f64 / (1u64 << 20) as f64));
    let n = |v: Option<u64>| v.map_or("n/a".to_string(), |v| v.to_string());
    eprintln!(
        "pressure: {status}; cgroup max usage {}, limit hits {}, OOM kills {}, in swap at the end {}; machine: pswpin {} pswpout {} pgmajfault {}{}",
        mib(stats.max_usage_bytes),
        n(stats.limit_hits),
        n(stats.oom_kills),
        mib(stats.swap_bytes),
        n(stats.pswpin),
        n(stats.pswpout),
        n(stats.pgmajfault),
        match balloon_alive {
            Some(false) => "; the balloon died (OOM-killed?)",
            _ => "",
        }
    );
    eprintln!(
        "pressure: machine restored (cgroup removed{})",
        if zram.is_some() { ", zram swap off and reset" } else { "" }
    );
    if !status.success() {
        bail!("{} failed under pressure ({status})", cmd.join(" "));
    }
    Ok(())
}
