//! Attach mode (`--pid`): what cannot be observed is refused with a clear
//! line, never measured as if it were a user process.

mod common;

use std::{
    path::PathBuf,
    process::{Command, ExitStatus},
    time::Duration,
};

use common::*;

#[test]
fn a_kernel_thread_is_refused() {
    assert_root();
    // PID 2 is kthreadd on Linux; checked from its own stat flags (PF_KTHREAD).
    let stat = std::fs::read_to_string("/proc/2/stat").expect("/proc/2/stat");
    let flags: u64 = stat.rsplit_once(')').unwrap().1.split_whitespace().nth(6).unwrap().parse().unwrap();
    assert_ne!(flags & 0x0020_0000, 0, "PID 2 is not a kernel thread here: {stat}");
    let out = Command::new(OBSERVER).args(["run", "--pid", "2"]).output().expect("run observer");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(0), "{err}");
    assert!(err.contains("PID 2 is a kernel thread"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
}

/// A thread's on-CPU time by the scheduler's own accounting
/// (`/proc/PID/task/TID/schedstat`, first field, ns) and its utime+stime
/// (`stat`, clock ticks).
fn cpu_of(pid: u32, tid: u32) -> (u64, u64) {
    let base = format!("/proc/{pid}/task/{tid}");
    let sched = std::fs::read_to_string(format!("{base}/schedstat")).expect("schedstat");
    let run: u64 = sched.split_whitespace().next().unwrap().parse().unwrap();
    let stat = std::fs::read_to_string(format!("{base}/stat")).expect("stat");
    let f: Vec<u64> =
        stat.rsplit_once(')').unwrap().1.split_whitespace().skip(11).take(2).map(|v| v.parse().unwrap()).collect();
    (run, f[0] + f[1])
}

/// `observer run --pid PID --json FILE <args>` attached to a running process, stopped with SIGINT
/// `span` after its probes are attached: its exit status, its stderr and the JSON file.
fn observe_attached(pid: u32, json_name: &str, args: &[&str], span: Duration) -> (ExitStatus, String, PathBuf) {
    let json = scratch_dir("attach").join(json_name);
    let _ = std::fs::remove_file(&json);
    let mut obs = Command::new(OBSERVER)
        .args(["run", "--pid", &pid.to_string(), "--json"])
        .arg(&json)
        .args(args)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("observer");
    let mut err = std::io::BufReader::new(obs.stderr.take().unwrap());
    let mut seen = wait_attached(&mut err);
    std::thread::sleep(span);
    // SAFETY: kill(2) of our own child.
    unsafe { libc::kill(obs.id() as i32, libc::SIGINT) };
    std::io::Read::read_to_string(&mut err, &mut seen).unwrap();
    (obs.wait().unwrap(), seen, json)
}

/// Attached to a running process, a thread whose state cannot be known from
/// the attach until its first event is `unattributed` for that time, never
/// `compute`: each thread's compute stays within its on-CPU time by the
/// scheduler's accounting (schedstat) over a span that holds the whole
/// observation, and a thread blocked throughout is charged no CPU time at all
/// (its utime+stime do not move).
#[test]
fn attaching_mid_life_charges_nothing_unknown_to_compute() {
    use std::io::BufRead;
    let _l = machine_lock();
    assert_root();
    // Two spinners share one CPU, so each waits for it part of the time: a
    // thread that `/proc` shows as `R` may be off the CPU.
    let mut target = Command::new(workload())
        .args(["attachable", "--spinners", "2"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("workload");
    let pid = target.id();
    let mut line = String::new();
    std::io::BufReader::new(target.stdout.take().unwrap()).read_line(&mut line).expect("the workload's TIDs");
    let tids: serde_json::Value = serde_json::from_str(&line).expect("JSON TIDs");
    let spinners: Vec<u32> = tids["spinners"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    let reader = tids["reader"].as_u64().unwrap() as u32;
    let all: Vec<u32> = spinners.iter().copied().chain([reader, pid]).collect();
    let before: Vec<(u64, u64)> = all.iter().map(|&t| cpu_of(pid, t)).collect();

    let (status, seen, json) = observe_attached(pid, "attach-mid-life.json", &[], Duration::from_millis(1500));
    let after: Vec<(u64, u64)> = all.iter().map(|&t| cpu_of(pid, t)).collect();
    let _ = target.kill();
    let _ = target.wait();
    assert!(status.success(), "observer: {status}\n{seen}");

    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("the JSON summary")).expect("JSON");
    let threads = summary["threads"].as_array().expect("threads");
    for (i, &tid) in all.iter().enumerate() {
        let t = &threads.iter().find(|t| u(t, "tid") == tid as u64).unwrap_or_else(|| panic!("thread {tid}"))["attribution"];
        let (run_ns, ticks) = (after[i].0 - before[i].0, after[i].1 - before[i].1);
        let (compute, unattributed, wall) = (u(t, "compute_ns"), u(t, "unattributed_ns"), u(t, "wall_ns"));
        let sum: u64 = [
            "compute_ns",
            "fault_minor_ns",
            "swapin_zram_ns",
            "fault_io_ns",
            "io_wait_ns",
            "reclaim_ns",
            "syscall_ns",
            "runqueue_ns",
            "sleep_ns",
            "unattributed_ns",
        ]
        .iter()
        .map(|k| u(t, k))
        .sum();
        assert_eq!(sum, wall, "thread {tid}: the components add up to its wall time: {t}");
        assert!(unattributed > 0, "thread {tid}: the time from the attach to its first event is unattributed: {t}");
        // schedstat's sum lags a running thread by at most a tick: allow one
        // tick at the lowest HZ, and 1 %.
        let slack = 10_000_000 + run_ns / 100;
        assert!(
            compute <= run_ns + slack,
            "thread {tid}: compute {compute} ns but on a CPU only {run_ns} ns by schedstat (in a longer span): {t}"
        );
        eprintln!(
            "thread {tid}: wall {wall} compute {compute} unattributed {unattributed} runqueue {}; schedstat on-CPU \
             {run_ns} ns, utime+stime {ticks} ticks",
            u(t, "runqueue_ns")
        );
        if tid == reader {
            assert_eq!(ticks, 0, "the reader stayed blocked (utime+stime)");
            assert_eq!(compute, 0, "thread {tid} never ran: {t}");
            assert_eq!(unattributed, wall, "thread {tid} had no event: its whole time is unattributed: {t}");
        }
    }
}

/// A spawned command is held before `exec` (blocked in `read` on a pipe)
/// while the probes attach; that hold is not the program's time. Its `io_wait`
/// is at most the time its own I/O syscalls took after `exec`, as a bpftrace
/// count of the same syscalls (by the program's name, which the held child
/// does not have yet) measures it.
#[test]
fn the_hold_before_exec_is_not_charged_to_the_spawned_program() {
    let _l = machine_lock();
    assert_root();
    let ids: Vec<String> =
        (0..512).filter(|&nr| observer::capture::syscalls::is_io(nr)).map(|nr| format!("@io_nr[{nr}] = 1;")).collect();
    let script = format!(
        "BEGIN {{ {} }} \
         tracepoint:raw_syscalls:sys_enter /comm == \"workload\" && @io_nr[args->id]/ {{ @s[tid] = nsecs; }} \
         tracepoint:raw_syscalls:sys_exit /@s[tid]/ {{ @io = sum(nsecs - @s[tid]); delete(@s[tid]); }} \
         END {{ clear(@s); clear(@io_nr); }}",
        ids.join(" ")
    );
    let bt = Bpftrace::start(&script);
    let run = observe("held.json", &["--", workload(), "sleep", "--ms", "200"]);
    let text = bt.finish();
    let io_ns: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("@io: ")?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no @io from bpftrace:\n{text}"));
    let threads = run.summary["threads"].as_array().expect("threads");
    let t = &threads.iter().find(|t| t["comm"] == "workload").unwrap_or_else(|| panic!("{threads:?}"))["attribution"];
    let io_wait = u(t, "io_wait_ns");
    eprintln!("held child: io_wait {io_wait} ns vs bpftrace's {io_ns} ns in its I/O syscalls after exec; {t}");
    assert!(
        io_wait <= io_ns + io_ns / 50 + 100_000,
        "io_wait {io_wait} ns, but the program spent {io_ns} ns in I/O syscalls (bpftrace): the hold was charged"
    );
}

/// CLOCK_MONOTONIC now (the clock of the records' `start_ns`).
fn mono_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Attached to our engine in the middle of its decode loop, no record
/// absorbs time from before the attach: a token whose begin marker came
/// before the probes gets no record, so every record starts after the
/// observer was started (by the test's own clock) and ends before it
/// stopped, and the engine's thread lived all of its first record's time
/// (its components add up to the record's wall time).
#[test]
fn attached_mid_run_the_first_record_is_one_whole_token() {
    let _l = machine_lock();
    let model = tiny_model();
    let mut engine = Command::new(engine_bin())
        .args(["run", "-m", model.to_str().unwrap(), "-p", "the quick brown fox", "-n", "4000", "--ignore-eos"])
        .args(["-t", "1"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("engine");
    std::thread::sleep(std::time::Duration::from_millis(500)); // well into its decode loop
    let t0 = mono_ns();
    let (status, seen, json) =
        observe_attached(engine.id(), "attach-engine.json", &["--every", "0"], Duration::from_millis(1000));
    let t1 = mono_ns();
    let _ = engine.kill();
    let _ = engine.wait();
    assert!(status.success(), "{seen}");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let recs = v["tokens"].as_array().expect("token records");
    assert!(recs.len() >= 3, "decode steps were observed: {}\n{seen}", recs.len());
    for t in recs {
        let (start, wall) = (u(t, "start_ns"), u(t, "wall_ns"));
        assert!(
            t0 <= start && start + wall <= t1,
            "record {} at {start}+{wall} outside the observer's life {t0}..{t1}",
            u(t, "index")
        );
    }
    let first = &recs[0];
    let wall = u(first, "wall_ns");
    let main = first["threads"]
        .as_array()
        .unwrap()
        .iter()
        .find(|th| u(th, "tid") == engine.id() as u64)
        .unwrap_or_else(|| panic!("the engine's main thread in {first}"));
    let resid = main["residual_ns"].as_i64().unwrap();
    assert!(
        resid.unsigned_abs() <= wall / 50,
        "the main thread's components add up to the first record's wall: {main}"
    );
    eprintln!(
        "first record {}: wall {wall} ns, starting {} ms after the observer was started; {} records",
        u(first, "index"),
        (u(first, "start_ns") - t0) / 1_000_000,
        recs.len()
    );
}
