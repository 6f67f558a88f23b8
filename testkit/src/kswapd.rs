//! kswapd kept off the CPU for a test, and put back, also after a SIGKILL.
//!
//! ## Rule
//! Global *direct* reclaim happens when an allocation finds every zone it may use under its min
//! watermark: the allocating task then reclaims for itself. On a machine where kswapd (woken at the
//! low watermark) frees memory as fast as a reader fills the page cache, that never happens.
//! `SCHED_IDLE` alone is not enough: on an idle machine with a free CPU, an idle-class kswapd runs
//! there at full speed and keeps up (a CI run: 0 model pages direct-reclaimed). A test that needs
//! direct reclaim takes [`Starved::new`]:
//! - every `kswapdN` thread is set to `SCHED_IDLE` and bound to one CPU, the *kswapd CPU* (the
//!   highest of this process's CPUs);
//! - a spinner thread of this process, bound to that CPU at nice −20 (weight 88761 against
//!   `SCHED_IDLE`'s 3), keeps it busy, so kswapd gets a few thousandths of a CPU whether the rest
//!   of the machine is idle or loaded;
//! - the allocator runs on the other CPUs ([`Starved::allocator_cpus`]), where it drives the free
//!   memory from the low watermark to the min watermark faster than kswapd can reclaim, and then
//!   reclaims directly. Nothing is filled for it: its memory is page cache, which reclaim frees.
//!
//! It needs two CPUs at least and says so otherwise. The spinner is a thread, so it dies with the
//! process, SIGKILL included.
//!
//! Drop (a passing or a panicking test) stops the spinner and puts each thread's saved policy,
//! real-time priority, nice value and CPU affinity back, and checks them.
//!
//! ## Surviving a SIGKILL
//! Before it changes anything, [`Starved::new`] writes what it saved to [`STATE_FILE`] (under
//! `/run`, a tmpfs: a reboot clears it and the change alike), one line per thread:
//! `PID COMM POLICY PRIORITY NICE CPUS` (`CPUS`: the allowed CPUs, comma-separated; a line of an
//! older guard without it has its affinity left alone). A restore that checked removes the file. A
//! guard killed with SIGKILL leaves it, and [`recover`], which [`Starved::new`] calls first (and
//! `cargo xtask setup`), puts the threads back from it (a thread whose PID now names another task
//! is left alone).

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
    /// Allowed CPUs; `None` when a state file of an older guard did not save them.
    cpus: Option<Vec<usize>>,
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
    Ok(Sched { pid, comm: comm(pid).unwrap_or_default(), policy, priority, nice, cpus: Some(affinity(pid)?) })
}

/// The CPUs task `pid` may run on (0 = the caller).
pub(crate) fn affinity(pid: i32) -> Result<Vec<usize>> {
    // SAFETY: `set` is a zeroed cpu_set_t we own, of the size we pass.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(pid, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            bail!("reading the CPU affinity of pid {pid}: {}", std::io::Error::last_os_error());
        }
        Ok((0..libc::CPU_SETSIZE as usize).filter(|&c| libc::CPU_ISSET(c, &set)).collect())
    }
}

/// Binds task `pid` (0 = the calling thread) to `cpus`.
pub(crate) fn set_affinity(pid: i32, cpus: &[usize]) -> Result<()> {
    // SAFETY: as in `affinity`.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cpus {
            libc::CPU_SET(c, &mut set);
        }
        if libc::sched_setaffinity(pid, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            bail!("binding pid {pid} to CPUs {cpus:?}: {}", std::io::Error::last_os_error());
        }
    }
    Ok(())
}

fn write(s: &Sched) -> Result<()> {
    let param = libc::sched_param { sched_priority: s.priority };
    // SAFETY: plain calls with a valid `param`.
    let ok = unsafe {
        libc::sched_setscheduler(s.pid, s.policy, &param) == 0
            && (s.policy == libc::SCHED_IDLE || libc::setpriority(libc::PRIO_PROCESS, s.pid as libc::id_t, s.nice) == 0)
    };
    ensure!(ok, "setting the scheduling of {} (pid {}): {}", s.comm, s.pid, std::io::Error::last_os_error());
    if let Some(cpus) = &s.cpus {
        set_affinity(s.pid, cpus).with_context(|| s.comm.clone())?;
    }
    Ok(())
}

fn encode(saved: &[Sched]) -> String {
    let list = |c: &[usize]| c.iter().map(usize::to_string).collect::<Vec<_>>().join(",");
    saved
        .iter()
        .map(|s| {
            let cpus = s.cpus.as_deref().map(|c| format!(" {}", list(c))).unwrap_or_default();
            format!("{} {} {} {} {}{cpus}\n", s.pid, s.comm, s.policy, s.priority, s.nice)
        })
        .collect()
}

fn decode(text: &str) -> Result<Vec<Sched>> {
    text.lines()
        .map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            ensure!(f.len() == 5 || f.len() == 6, "{STATE_FILE}: bad line {l:?}");
            let n = |i: usize| f[i].parse::<i32>().with_context(|| format!("{STATE_FILE}: bad number in {l:?}"));
            let cpus = f.get(5).map(|c| {
                c.split(',')
                    .map(|x| x.parse::<usize>().with_context(|| format!("{STATE_FILE}: bad CPU in {l:?}")))
                    .collect()
            });
            Ok(Sched {
                pid: n(0)?,
                comm: f[1].to_string(),
                policy: n(2)?,
                priority: n(3)?,
                nice: n(4)?,
                cpus: cpus.transpose()?,
            })
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
        let now = Sched { cpus: s.cpus.as_ref().and(now.cpus.clone()), ..now };
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

/// kswapd at `SCHED_IDLE` on a CPU kept busy, while this lives (module doc). Take
/// [`crate::machine_lock`] first.
#[derive(Debug)]
pub struct Starved {
    saved: Vec<Sched>,
    kswapd_cpu: usize,
    allocator_cpus: Vec<usize>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    spinner: Option<std::thread::JoinHandle<Result<()>>>,
}

impl Starved {
    pub fn new() -> Result<Starved> {
        recover()?;
        let mine = affinity(0)?;
        let Some((&kswapd_cpu, rest)) = mine.split_last().filter(|(_, rest)| !rest.is_empty()) else {
            bail!(
                "starving kswapd needs two CPUs (one for kswapd and a spinner, one for the allocator); this process may run on {mine:?}"
            );
        };
        let saved = threads()?.into_iter().map(read).collect::<Result<Vec<_>>>()?;
        let dir = std::path::Path::new(STATE_FILE).parent().expect("a directory");
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        std::fs::write(STATE_FILE, encode(&saved)).with_context(|| format!("writing {STATE_FILE}"))?;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut guard = Starved { saved, kswapd_cpu, allocator_cpus: rest.to_vec(), stop: stop.clone(), spinner: None };
        let (tx, rx) = std::sync::mpsc::channel();
        guard.spinner = Some(std::thread::spawn(move || -> Result<()> {
            let setup = (|| {
                set_affinity(0, &[kswapd_cpu])?;
                // SAFETY: a plain call on the calling thread (who = 0).
                if unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, -20) } != 0 {
                    bail!("nice -20 for the spinner: {}", std::io::Error::last_os_error());
                }
                Ok(())
            })();
            let ok = setup.is_ok();
            let _ = tx.send(setup);
            while ok && !stop.load(std::sync::atomic::Ordering::Relaxed) {
                std::hint::spin_loop();
            }
            Ok(())
        }));
        rx.recv().context("the spinner thread ended before it started")??;
        for s in &guard.saved {
            write(&Sched { policy: libc::SCHED_IDLE, priority: 0, cpus: Some(vec![kswapd_cpu]), ..s.clone() })?;
        }
        Ok(guard)
    }

    /// The PIDs of the kswapd threads it starves.
    pub fn pids(&self) -> Vec<u32> {
        self.saved.iter().map(|s| s.pid as u32).collect()
    }

    /// The CPU kswapd and the spinner are bound to.
    pub fn kswapd_cpu(&self) -> usize {
        self.kswapd_cpu
    }

    /// The CPUs for the allocator: this process's others, e.g. `"0"` for `taskset -c`.
    pub fn allocator_cpus(&self) -> String {
        self.allocator_cpus.iter().map(usize::to_string).collect::<Vec<_>>().join(",")
    }
}

impl Drop for Starved {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(h) = self.spinner.take() {
            let _ = h.join();
        }
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
            Sched { pid: 45, comm: "kswapd0".into(), policy: 0, priority: 0, nice: 0, cpus: Some(vec![0, 1, 5]) },
            Sched { pid: 46, comm: "kswapd1".into(), policy: 5, priority: 0, nice: -5, cpus: None },
        ];
        assert_eq!(decode(&encode(&s)).unwrap(), s);
        assert!(decode("45 kswapd0 0 0").is_err());
        assert!(decode("45 kswapd0 0 0 0 1,x").is_err());
    }
}
