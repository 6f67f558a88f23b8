//! kswapd slowed down for a test, and put back, also after a SIGKILL.
//!
//! ## Rule
//! Global *direct* reclaim happens when an allocation finds every zone it may use under its min
//! watermark: the allocating task then reclaims for itself. On a machine where kswapd (woken at the
//! low watermark) frees memory as fast as a reader fills the page cache, that never happens. A
//! test that needs it takes [`Idle::new`]: every `kswapdN` thread is set to `SCHED_IDLE` (it runs
//! only when no other task wants its CPU), so a busy allocator gets under the min watermark and
//! reclaims directly. Nothing is filled for it: the allocator's memory is page cache, which
//! reclaim frees.
//!
//! Drop (a passing or a panicking test) puts each thread's saved policy, real-time priority and
//! nice value back, and checks them.
//!
//! ## Surviving a SIGKILL
//! Before it changes anything, [`Idle::new`] writes what it saved to [`STATE_FILE`] (under `/run`,
//! a tmpfs: a reboot clears it and the change alike), one line per thread:
//! `PID COMM POLICY PRIORITY NICE`. A restore that checked removes the file. A guard killed with
//! SIGKILL leaves it, and [`recover`], which [`Idle::new`] calls first (and `cargo xtask setup`),
//! puts the threads back from it (a thread whose PID now names another task is left alone).

use anyhow::{Context, Result, bail, ensure};

/// What a live guard saved (module doc, "Surviving a SIGKILL").
pub const STATE_FILE: &str = "/run/moe-observer-tests/kswapd-saved";

/// One kswapd thread's scheduling, as saved.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Sched {
    pid: i32,
    comm: String,
    policy: i32,
    priority: i32,
    nice: i32,
}

fn comm(pid: i32) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/comm")).ok().map(|s| s.trim_end().to_string())
}

/// The `kswapdN` threads now.
fn threads() -> Result<Vec<i32>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").context("reading /proc")? {
        let Some(pid) = e?.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else { continue };
        if comm(pid).is_some_and(|c| c.starts_with("kswapd")) {
            out.push(pid);
        }
    }
    ensure!(!out.is_empty(), "no kswapd thread in /proc");
    Ok(out)
}

fn read(pid: i32) -> Result<Sched> {
    // SAFETY: plain queries of a task's scheduling; `param` is a valid out-pointer.
    let (policy, priority, nice) = unsafe {
        let policy = libc::sched_getscheduler(pid);
        let mut param = libc::sched_param { sched_priority: 0 };
        let rc = libc::sched_getparam(pid, &mut param);
        *libc::__errno_location() = 0;
        let nice = libc::getpriority(libc::PRIO_PROCESS, pid as libc::id_t);
        let err = *libc::__errno_location();
        if policy < 0 || rc != 0 || (nice == -1 && err != 0) {
            bail!("reading the scheduling of kswapd (pid {pid}): {}", std::io::Error::last_os_error());
        }
        (policy, param.sched_priority, nice)
    };
    Ok(Sched { pid, comm: comm(pid).unwrap_or_default(), policy, priority, nice })
}

fn write(s: &Sched) -> Result<()> {
    let param = libc::sched_param { sched_priority: s.priority };
    // SAFETY: plain calls with a valid `param`.
    let ok = unsafe {
        libc::sched_setscheduler(s.pid, s.policy, &param) == 0
            && (s.policy == libc::SCHED_IDLE || libc::setpriority(libc::PRIO_PROCESS, s.pid as libc::id_t, s.nice) == 0)
    };
    ensure!(ok, "setting the scheduling of {} (pid {}): {}", s.comm, s.pid, std::io::Error::last_os_error());
    Ok(())
}

fn encode(saved: &[Sched]) -> String {
    saved.iter().map(|s| format!("{} {} {} {} {}\n", s.pid, s.comm, s.policy, s.priority, s.nice)).collect()
}

fn decode(text: &str) -> Result<Vec<Sched>> {
    text.lines()
        .map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            ensure!(f.len() == 5, "{STATE_FILE}: bad line {l:?}");
            let n = |i: usize| f[i].parse::<i32>().with_context(|| format!("{STATE_FILE}: bad number in {l:?}"));
            Ok(Sched { pid: n(0)?, comm: f[1].to_string(), policy: n(2)?, priority: n(3)?, nice: n(4)? })
        })
        .collect()
}

/// Put back what `saved` says and check it; then remove [`STATE_FILE`].
fn restore(saved: &[Sched]) -> Result<()> {
    for s in saved {
        if comm(s.pid).as_deref() != Some(s.comm.as_str()) {
            continue; // gone, or the PID is another task's now
        }
        write(s)?;
        let now = read(s.pid)?;
        ensure!(now == *s, "{} (pid {}) reads {now:?} after restoring {s:?}", s.comm, s.pid);
    }
    match std::fs::remove_file(STATE_FILE) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("removing {STATE_FILE}")),
    }
}

/// Puts kswapd back from the [`STATE_FILE`] a killed guard left; `false` when there was none.
pub fn recover() -> Result<bool> {
    let text = match std::fs::read_to_string(STATE_FILE) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e).with_context(|| format!("reading {STATE_FILE}")),
    };
    eprintln!("testkit::kswapd: {STATE_FILE} was left by a guard that did not finish: restoring kswapd's scheduling");
    restore(&decode(&text)?)?;
    Ok(true)
}

/// kswapd at `SCHED_IDLE` while this lives (module doc). Take [`crate::machine_lock`] first.
#[derive(Debug)]
pub struct Idle {
    saved: Vec<Sched>,
}

impl Idle {
    pub fn new() -> Result<Idle> {
        recover()?;
        let saved = threads()?.into_iter().map(read).collect::<Result<Vec<_>>>()?;
        let dir = std::path::Path::new(STATE_FILE).parent().expect("a directory");
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        std::fs::write(STATE_FILE, encode(&saved)).with_context(|| format!("writing {STATE_FILE}"))?;
        let guard = Idle { saved };
        for s in &guard.saved {
            write(&Sched { policy: libc::SCHED_IDLE, priority: 0, ..s.clone() })?;
        }
        Ok(guard)
    }

    /// The PIDs of the kswapd threads it slowed down.
    pub fn pids(&self) -> Vec<u32> {
        self.saved.iter().map(|s| s.pid as u32).collect()
    }
}

impl Drop for Idle {
    fn drop(&mut self) {
        if let Err(e) = restore(&self.saved) {
            // A test that panics here leaves the file: the next guard or `xtask setup` retries.
            panic!("testkit::kswapd: restoring kswapd's scheduling failed: {e:#} (state kept in {STATE_FILE})");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_state_file_round_trips() {
        let s = vec![
            Sched { pid: 45, comm: "kswapd0".into(), policy: 0, priority: 0, nice: 0 },
            Sched { pid: 46, comm: "kswapd1".into(), policy: 5, priority: 0, nice: -5 },
        ];
        assert_eq!(decode(&encode(&s)).unwrap(), s);
        assert!(decode("45 kswapd0 0 0").is_err());
    }
}
