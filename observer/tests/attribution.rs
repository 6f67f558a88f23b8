//! Per-token attribution against independent references on the same run:
//! the workload's own clock, `getrusage`, the scheduler's `schedstat`,
//! `/proc/vmstat`. Each workload phase is one marked token (the workload
//! exports the engine's marker symbols).

mod common;

use common::*;
use observer_common::vocab::Component;
use serde_json::Value;

fn tokens(r: &ObserverRun) -> &Vec<Value> {
    r.summary["tokens"].as_array().expect("tokens array in the JSON summary")
}

fn ns(v: &Value, component: &str) -> u64 {
    u(v, &format!("{component}_ns"))
}

/// The sum of the measured components (from the vocabulary, so that a new one is counted).
fn components_sum(v: &Value) -> u64 {
    Component::measured().map(|c| ns(v, c.name())).sum()
}

/// For every token and every thread that lived through it, the components add
/// up to the token's wall time within 2 %.
fn assert_components_add_up(r: &ObserverRun) {
    for t in tokens(r) {
        let wall = u(t, "wall_ns");
        let sum = components_sum(t);
        let resid = t["residual_ns"].as_i64().unwrap();
        assert_eq!(wall as i64 - sum as i64, resid, "token residual is wall − sum: {t}");
        assert!(resid.unsigned_abs() <= wall / 50, "token components do not add up to wall: {t}");
        for th in t["threads"].as_array().unwrap() {
            let sum = components_sum(th);
            let diff = wall as i64 - sum as i64;
            assert!(diff.unsigned_abs() <= wall / 50, "thread {} components {sum} vs wall {wall}: {th}", th["tid"]);
        }
    }
}

fn single_token(r: &ObserverRun) -> (&Value, &Value) {
    let toks = tokens(r);
    assert_eq!(toks.len(), 1, "one marked phase, one token: {toks:?}");
    assert_eq!(r.workload.len(), 1);
    (&toks[0], &r.workload[0])
}

#[test]
fn busy_loop_is_compute() {
    busy_loop_is_compute_with(&[]);
}

/// The same through the scheduler's tracepoints (`--sched-hooks tracepoint`: the programs of
/// kernels without BTF or before 5.18, which `auto` chooses there).
#[test]
fn busy_loop_is_compute_through_sched_tracepoints() {
    busy_loop_is_compute_with(&["--sched-hooks", "tracepoint"]);
}

/// `busy_loop_is_compute`, with `observer run` arguments `hooks`.
fn busy_loop_is_compute_with(hooks: &[&str]) {
    let _l = machine_lock();
    let r = observe("busy.json", &[hooks, &["--", workload(), "busy", "--ms", "1500"]].concat());
    assert_components_add_up(&r);
    let (t, w) = single_token(&r);
    let compute = ns(t, "compute");
    let wall = u(w, "wall_ns");
    let cpu = u(w, "sched_cpu_ns");
    let waited = u(w, "sched_wait_ns");
    // Against the scheduler's own on-CPU time for the thread, which leaves out the time its virtual
    // CPU was stolen by the host (`PARAVIRT_TIME_ACCOUNTING`); the observer's wall-clock intervals
    // do not. The thread never blocks, so its stolen time is its wall less its on-CPU time and
    // run-queue wait, and the machine's steal over the phase (`/proc/stat`, all CPUs) bounds it
    // (a CI run here had 73 ms of 1.5 s stolen).
    let stolen = wall.saturating_sub(cpu + waited);
    assert!(stolen <= u(w, "steal_ns") + wall / 50, "time beyond on-CPU and run-queue is the VM's steal: {w}");
    assert_bracketed("compute vs on-CPU time (+ stolen)", compute, cpu, cpu + stolen, 0.02, w);
    // Against the workload's clock: all of it, once run-queue waits (which the
    // scheduler reports independently) are taken out.
    assert_within("compute vs wall − run-queue wait", compute, wall - waited, 0.02);
    if waited < wall / 100 {
        assert_within("compute vs wall (quiet machine)", compute, wall, 0.02);
    }
    // Run-queue waits against the scheduler's own run_delay, to 2 % of the token.
    assert!(
        ns(t, "runqueue").abs_diff(waited) <= wall / 50,
        "runqueue {} vs schedstat run_delay {waited} (wall {wall})",
        ns(t, "runqueue")
    );
}

#[test]
fn sleep_is_sleep() {
    let _l = machine_lock();
    let r = observe("sleep.json", &["--", workload(), "sleep", "--ms", "1000"]);
    assert_components_add_up(&r);
    let (t, w) = single_token(&r);
    let wall = u(w, "wall_ns");
    let waited = u(w, "sched_wait_ns");
    assert_within("sleep vs wall − run-queue wait", ns(t, "sleep"), wall - waited, 0.02);
    if waited < wall / 100 {
        assert_within("sleep vs wall (quiet machine)", ns(t, "sleep"), wall, 0.02);
    }
    // A sleep is not compute: the token's compute is bounded by the scheduler's own on-CPU time
    // of the thread around it (`sched_cpu_ns` brackets the markers), not by a share of the wall
    // time. The few microseconds of work around the sleep take milliseconds under QEMU's TCG on a
    // loaded host (18 ms of a 1 s sleep in a 6.1 guest): the guest's clock runs on host time
    // while its vCPU waits for a host CPU, so the guest's scheduler, its schedstat and the
    // observer all see that wait as the thread running. They agree with each other, and that is
    // what is checked; 2 % and 1 ms cover the two clocks' reads at the edges of the token.
    let cpu = u(w, "sched_cpu_ns");
    assert!(
        ns(t, "compute") <= cpu + cpu / 50 + 1_000_000,
        "a sleep is not compute: compute {} > schedstat's on-CPU time {cpu}: {t}",
        ns(t, "compute")
    );
    assert!(ns(t, "compute") < ns(t, "sleep") / 10, "a sleep is not compute: {t}");
}

#[test]
fn direct_reads_are_io_wait() {
    let _l = machine_lock();
    let file = scratch_dir("pread").join("direct.bin");
    let r = observe(
        "pread.json",
        &["--", workload(), "pread-direct", "--size", "256M", "--block", "1M", "--path", file.to_str().unwrap()],
    );
    assert_components_add_up(&r);
    let (t, w) = single_token(&r);
    let io = u(w, "io_ns");
    let waited = u(w, "sched_wait_ns");
    // The reads' own clock is their io_wait and the run-queue waits after their wakeups. The
    // observer's run queue starts at `sched_waking`, schedstat's `run_delay` at the enqueue, after
    // the wakeup's IPI reached the other (virtual) CPU: on this VM that grew to about 35 µs per
    // wakeup (9 ms over 256 reads; io_wait was then 5.8 % under the clock less `run_delay`). So
    // the sum is checked against the clock, and the run queue against `run_delay`, which it holds.
    let rq = ns(t, "runqueue");
    assert_within("io_wait + runqueue vs the reads' own clock", ns(t, "io_wait") + rq, io, 0.05);
    assert!(rq + u(w, "wall_ns") / 100 >= waited, "runqueue {rq} holds schedstat's run_delay {waited}: {t}");
    assert!(ns(t, "compute") < io / 20, "explicit reads are not compute: {t}");
    // The block layer saw the bytes.
    assert_within("read_bytes", u(t, "read_bytes"), 256 << 20, 0.01);
}

/// The thread of `t` named `comm`.
fn thread_named<'a>(t: &'a Value, comm: &str) -> &'a Value {
    t["threads"]
        .as_array()
        .unwrap()
        .iter()
        .find(|th| th["comm"] == comm)
        .unwrap_or_else(|| panic!("no thread {comm} in {t}"))
}

/// A token thread waiting on a worker's `O_DIRECT` preads is `io_wait_peer`, measured against the
/// token thread's blocked time by the scheduler (schedstat) and bounded by its own clock around
/// its waits; the same waits on a worker that only sleeps are
/// `sleep` (the rule follows the waker's I/O, not the wait). The worker's reads are its `io_wait`.
/// (The threads are found by the names they give themselves after their first event: a rename
/// must reach their rows.)
#[test]
fn waiting_on_a_peers_reads_is_io_wait_peer() {
    waiting_on_a_peers_reads_with(&[]);
}

/// The same through the scheduler's tracepoints (`--sched-hooks tracepoint`).
#[test]
fn waiting_on_a_peers_reads_is_io_wait_peer_through_sched_tracepoints() {
    waiting_on_a_peers_reads_with(&["--sched-hooks", "tracepoint"]);
}

/// `waiting_on_a_peers_reads_is_io_wait_peer`, with `observer run` arguments `hooks`.
fn waiting_on_a_peers_reads_with(hooks: &[&str]) {
    let _l = machine_lock();
    let file = scratch_dir("pread-peer").join("peer.bin");
    let target = ["--", workload(), "pread-peer", "--size", "64M", "--block", "256K", "--path", file.to_str().unwrap()];
    let r = observe("pread-peer.json", &[hooks, &target].concat());
    assert_components_add_up(&r);
    let toks = tokens(&r);
    assert_eq!((toks.len(), r.workload.len()), (2, 2), "two marked phases: {toks:?}");
    for (t, w) in toks.iter().zip(&r.workload) {
        let (main, worker) = (thread_named(t, "workload"), thread_named(t, "peer-io"));
        let wall = u(w, "wall_ns");
        // The token thread's waits by its own clock, less its run-queue waits (schedstat).
        // The token thread's blocked time by the scheduler's own accounting (schedstat): the wall
        // time less its on-CPU time and its run-queue waits. It does nothing but wait on the worker.
        let blocked = wall.saturating_sub(u(w, "sched_cpu_ns") + u(w, "sched_wait_ns"));
        let (peer, sleep) = (ns(main, "io_wait_peer"), ns(main, "sleep"));
        // Its own clock around the waits bounds them.
        assert!(peer + sleep <= u(w, "wait_ns") + wall / 50, "waits {peer} + {sleep} vs its clock {w}: {main}");
        match w["kind"].as_str().unwrap() {
            "pread-peer" => {
                // Off the CPU, by schedstat (wall less on-CPU time), is the peer waits, the short
                // sleeps around them and the run-queue waits. The split between run queue and
                // wait differs by definition: the observer's run queue starts at `sched_waking`,
                // schedstat's at the enqueue, after the wakeup's IPI on another CPU (about 6 µs
                // per wakeup on this VM: 2.8 ms over 486 switches in one run, and a CI run had
                // io_wait_peer + sleep 5.4 % under schedstat's blocked time). So the sum is
                // checked, and that the peer waits are the bulk of the blocked time.
                // Steal (the VM's vCPU not running while the thread was current) is off the CPU by the
                // scheduler's clock and on it by the observer's: the machine's steal over the phase
                // (`/proc/stat`, all CPUs) bounds what it moves (a CI run: 6.1 % under, at 8.5 ms).
                // Not explained yet, so the bound is 10 %: with no steal, the observer's off-CPU time
                // has exceeded the CPU clock's by 5.7 % (3.7 ms of 71 ms; its run queue 9.9 ms
                // against schedstat's run_delay of 0.6 ms) and by 7.4 % in a CI run. The thread
                // was on a CPU for some of what the observer charged to the run queue after a
                // wakeup; no repaired switch-in was counted (`missed_switch_ins` 0).
                let off_cpu = wall.saturating_sub(u(w, "sched_cpu_ns"));
                let rq = ns(main, "runqueue");
                assert_bracketed(
                    "token thread's io_wait_peer + sleep + runqueue vs off-CPU time (schedstat) less steal",
                    peer + sleep + rq,
                    off_cpu.saturating_sub(u(w, "steal_ns")),
                    off_cpu,
                    0.10,
                    w,
                );
                // The peer waits are the bulk of the blocked time, once the wake-to-enqueue intervals
                // that schedstat counts as blocked and the observer as run queue are given back
                // (7.4 ms of run queue against 49 ms blocked in one run: 89.8 % without them), and
                // the steal: schedstat's blocked time (wall less CPU and run queue) holds the time
                // the vCPU was stolen while the thread was current, which the observer charges to
                // what the thread was doing (here `syscall`, in `futex`). This VM's host steals
                // during virtio reads: 50–120 ms of steal in 120–200 ms phases, and 28 ms of
                // `syscall` against 5–8 ms of CPU time for the token thread in one run.
                let rq_beyond = rq.saturating_sub(u(w, "sched_wait_ns"));
                let blocked = blocked.saturating_sub(u(w, "steal_ns"));
                assert!(
                    peer + rq_beyond >= blocked - blocked / 10,
                    "io_wait_peer {peer} (+ {rq_beyond} run queue beyond schedstat's) is most of blocked {blocked}: {main}"
                );
                assert!(sleep < wall / 50, "waiting on reads is not sleep: {main}");
                // The worker's reads: its io_wait, and the wakeups after them its run-queue time.
                let (io, job) = (ns(worker, "io_wait"), u(w, "job_ns"));
                assert!(io <= job + job / 50, "worker io_wait {io} within its reads' clock {job}: {worker}");
                assert!(
                    io + ns(worker, "runqueue") >= job - job / 50,
                    "worker io_wait {io} + runqueue vs {job}: {worker}"
                );
                assert_within("read_bytes", u(t, "read_bytes"), 64 << 20, 0.01);
            }
            "sleep-peer" => {
                assert_bracketed(
                    "token thread's sleep vs its blocked time (schedstat) less steal",
                    sleep,
                    blocked.saturating_sub(u(w, "steal_ns")),
                    blocked,
                    0.05,
                    w,
                );
                assert!(peer < wall / 100, "waiting on a sleeping peer is not io_wait_peer: {main}");
            }
            k => panic!("unexpected phase {k}"),
        }
    }
}

#[test]
fn file_refaults_are_fault_io() {
    let _l = machine_lock();
    let file = scratch_dir("refault-attr").join("refault.bin");
    let r = observe(
        "refault-attr.json",
        &["--", workload(), "file-refault", "--size", "128M", "--path", file.to_str().unwrap()],
    );
    assert_components_add_up(&r);
    let (t, w) = single_token(&r);
    assert_within("majflt_file vs getrusage", u(t, "majflt_file"), u(w, "majflt"), 0.02);
    assert_eq!(u(t, "majflt_swap"), 0);
    // fault_io against the block-layer latency of the same reads, as the
    // observer saw them (queue → completion of the thread's read bios).
    let th =
        &r.summary["threads"].as_array().unwrap().iter().find(|t| !t["attribution"].is_null()).unwrap()["attribution"];
    assert_within("fault_io vs block read latency", u(th, "fault_io_ns"), u(th, "disk_read_ns"), 0.10);
    assert!(ns(t, "fault_io") > ns(t, "compute"), "refault time is not compute: {t}");
}

#[test]
fn zram_swapins_are_measured_and_not_compute() {
    let _l = machine_lock();
    let zram = testkit::ZramSwap::new(2048).expect("zram swap (needs root and CONFIG_ZRAM)");
    let cg = testkit::MemCgroup::new("obs-zram", 200 << 20).expect("memory cgroup");
    let zram_sectors = || zram.stat().expect("the zram device's block stat")[2];
    let sectors0 = zram_sectors();
    let pswpin0 = testkit::vmstat("pswpin").unwrap();
    let dir = cg.dir().to_str().unwrap().to_string();
    let r = observe("zram.json", &["--cgroup", &dir, "--", workload(), "swap", "--size", "256M", "--balloon", "128M"]);
    let pswpin = testkit::vmstat("pswpin").unwrap() - pswpin0;
    let zram_bytes = (zram_sectors() - sectors0) * 512;
    assert_components_add_up(&r);
    let (t, w) = single_token(&r);
    assert!(u(w, "swapped_kib_before") > 64 * 1024, "the buffer was not pushed to swap: {w}");
    let swapins = u(t, "swapins");
    // Everything that swapped in during the run was the target's touches.
    let all_swapins = u(&r.summary["attribution_totals"], "swapins");
    assert_within("swapins vs /proc/vmstat pswpin", all_swapins, pswpin, 0.02);
    assert!(swapins > 10_000, "{t}");
    assert_within("majflt_swap vs swapins", u(t, "majflt_swap"), swapins, 0.02);
    assert!(ns(t, "swapin_zram") > 0, "{t}");
    assert!(ns(t, "compute") < ns(t, "swapin_zram"), "zram decompression must not be counted as compute: {t}");
    assert_within("major faults vs getrusage", u(t, "majflt_swap") + u(t, "majflt_file"), u(w, "majflt"), 0.02);
    // The zram device's row of the per-device read table: from the block tracepoints where zram
    // reads are bios (Linux 6.3+), from the kprobe pair on zram_rw_page before. Every swap-in of
    // the run was the target's (above), so the row is its swap-ins, within the device's own count.
    use std::os::unix::fs::MetadataExt;
    let rdev = std::fs::metadata(zram.device()).unwrap().rdev();
    let name = format!("{}:{}", libc::major(rdev), libc::minor(rdev));
    let devs = r.summary["devices"].as_array().unwrap();
    let d = devs.iter().find(|d| d["dev"] == name).unwrap_or_else(|| panic!("no row for zram {name}: {devs:?}"));
    assert!(u(d, "read_bytes") <= zram_bytes, "zram row {d} > the device's block stat {zram_bytes} bytes");
    assert_within("zram row read bytes vs swap-ins", u(d, "read_bytes"), all_swapins * 4096, 0.02);
    assert!(u(d, "completed") * 100 >= u(d, "read_ios") * 95, "latency matched for most zram reads: {d}");
}

/// Assert `inner·(1 − tol) ≤ observed ≤ outer·(1 + tol)`: a measure of a call lies between the
/// workload's timing of it from inside the called function and its timing of the marked token
/// around the call.
fn assert_bracketed(what: &str, observed: u64, inner: u64, outer: u64, tol: f64, w: &Value) {
    let (lo, hi) = (inner as f64 * (1.0 - tol), outer as f64 * (1.0 + tol));
    assert!(
        lo <= observed as f64 && observed as f64 <= hi,
        "{what}: observer {observed} not within [inner {inner} − {:.0} %, outer {outer} + {:.0} %]; workload: {w}",
        tol * 100.0,
        tol * 100.0
    );
}

/// A call token is the call, not the marked token around it. The workload times the call from
/// inside (`call_wall_ns`, `call_cpu_ns`: the clocks read first and last in `workload_phase`)
/// and from outside (`wall_ns`, `sched_cpu_ns`: around the token's markers, which enclose the
/// call); the observer's call lies between the two. With the machine busy the two differ by
/// what happened between a bracket and the call: a run-queue wait at a preemption point (a
/// probe's trap or a system call returning) is in the outer wall only, and the CPU time of the
/// markers and of the workload's own `/proc` reads in the outer CPU time only. A tolerance on
/// the outer numbers alone charged these to the observer: with a nice −20 spinner on the
/// workload's CPU the call got 3–8 ms of CPU, and the ~0.2 ms around it in the schedstat window
/// failed 2 % (the observer agreed with ftrace's `sched_switch` events to 10 µs).
/// The on-CPU bound also takes in time the thread was current but its virtual CPU was not running
/// (steal, on a guest with `PARAVIRT_TIME_ACCOUNTING`): the scheduler's clocks leave it out, the
/// observer's wall-clock intervals do not. The busy phase never blocks, so that time is what the
/// outer window's wall has beyond the thread's on-CPU time and run-queue wait.
/// On this host's kernel a context switch now and then emits no `sched_switch` (ftrace saw the
/// workload run 1.6 ms on a CPU whose last switch named another task, which then switched in on
/// the other CPU); the observer charged that run to `runqueue` and this test failed below the
/// inner bound (about 1 run in 20), until `sched:sched_stat_runtime` repaired such switch-ins
/// (`observer_common::attrib`'s spec).
#[test]
fn token_symbol_marks_calls_of_any_function() {
    let _l = machine_lock();
    // A function of the executable.
    let r = observe("call-exe.json", &["--token-symbol", "workload_phase", "--", workload(), "busy", "--ms", "400"]);
    assert_components_add_up(&r);
    let (t, w) = single_token(&r);
    assert_eq!(t["kind"], "call");
    assert_bracketed("call wall", u(t, "wall_ns"), u(w, "call_wall_ns"), u(w, "wall_ns"), 0.02, w);
    let (cpu, wait, wall) = (u(w, "sched_cpu_ns"), u(w, "sched_wait_ns"), u(w, "wall_ns"));
    let stolen = wall.saturating_sub(cpu + wait);
    assert_bracketed("call compute vs on-CPU time", ns(t, "compute"), u(w, "call_cpu_ns"), cpu + stolen, 0.02, w);
    // A function of a shared library: glibc's clock_nanosleep (std's sleep).
    let libc_path = ["/lib/x86_64-linux-gnu/libc.so.6", "/usr/lib/x86_64-linux-gnu/libc.so.6", "/lib64/libc.so.6"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
        .expect("glibc not found");
    let spec = format!("clock_nanosleep:{libc_path}");
    let r = observe("call-lib.json", &["--token-symbol", &spec, "--", workload(), "sleep", "--ms", "400"]);
    let (t, w) = single_token(&r);
    assert_eq!(t["kind"], "call");
    assert_within(
        "sleep in the call vs the workload's clock",
        ns(t, "sleep"),
        u(w, "wall_ns") - u(w, "sched_wait_ns"),
        0.02,
    );
}

#[test]
fn block_reads_per_device_match_sys_block() {
    let _l = machine_lock();
    let dir = scratch_dir("devio");
    let file = dir.join("refault.bin");
    // The device under the scratch directory, from /proc/self/mountinfo's st_dev.
    use std::os::unix::fs::MetadataExt;
    let st_dev = std::fs::metadata(&dir).unwrap().dev();
    let (major, minor) = (libc::major(st_dev), libc::minor(st_dev));
    let sys = format!("/sys/dev/block/{major}:{minor}/stat");
    let sectors_read = || -> u64 {
        let s = std::fs::read_to_string(&sys).unwrap_or_else(|e| panic!("{sys}: {e}"));
        s.split_whitespace().nth(2).unwrap().parse().unwrap()
    };
    let before = sectors_read();
    let r =
        observe("devio.json", &["--", workload(), "file-refault", "--size", "64M", "--path", file.to_str().unwrap()]);
    let sys_bytes = (sectors_read() - before) * 512;
    let devs = r.summary["devices"].as_array().unwrap();
    let d = devs
        .iter()
        .find(|d| d["dev"] == format!("{major}:{minor}"))
        .unwrap_or_else(|| panic!("no row for {major}:{minor}: {devs:?}"));
    // The device also serves other processes: the target's reads are at most
    // its total, and exactly what the kernel's per-process I/O accounting says.
    assert!(u(d, "read_bytes") <= sys_bytes, "observer {} > /sys/block {sys_bytes}", d["read_bytes"]);
    let w = &r.workload[0];
    assert_within("device read bytes vs /proc/self/io read_bytes", u(d, "read_bytes"), u(w, "io_read_bytes"), 0.02);
    let t = &tokens(&r)[0];
    assert_within("token read_bytes vs /proc/self/io", u(t, "read_bytes"), u(w, "io_read_bytes"), 0.02);
    assert!(u(d, "completed") * 100 >= u(d, "read_ios") * 95, "latency matched for most reads: {d}");
}

#[test]
fn markers_are_found_after_a_wrapper_execs() {
    let _l = machine_lock();
    // `sh -c 'exec workload …'`: the spawned program has no markers; the one it execs has.
    // - The path built at run time (no word of the command line names the program): the observer
    //   holds its own child at the exec until the markers are attached, so even a token that
    //   starts at once is seen.
    // - The path named on the command line: its markers are attached before the command starts.
    let workload = std::path::Path::new(workload());
    let (dir, name) = (workload.parent().unwrap().display(), workload.file_name().unwrap().to_string_lossy());
    for (script, says) in [
        (format!("exec $(printf %s {dir})/{name} busy --ms 200"), "engine markers attached"),
        (format!("exec {} busy --ms 200", workload.display()), "its token markers are attached before it runs"),
    ] {
        let r = observe("wrapped.json", &["--", "/bin/sh", "-c", &script]);
        let err = String::from_utf8_lossy(&r.output.stderr);
        assert!(err.contains(says), "{script}: {err}");
        let (t, w) = single_token(&r);
        assert_within("token wall vs the workload's clock", u(t, "wall_ns"), u(w, "wall_ns"), 0.02);
    }
}

/// Explicit reads of a file that is not the model are not charged to the model
/// (`observer_common::xread`): the workload's worker `pread`s 64 MiB of its own file while the
/// observer watches the model named by `--model`; the worker's reads are real (its own count, and
/// `io_wait` in the observer), and the model's explicit reads stay zero in every kind.
#[test]
fn reads_of_another_file_are_not_charged_to_the_model() {
    let _l = machine_lock();
    let file = scratch_dir("pread-peer").join("not-the-model.bin");
    let model = tiny_model();
    let r = observe(
        "xread-other.json",
        &[
            "--model",
            model.to_str().unwrap(),
            "--",
            workload(),
            "pread-peer",
            "--size",
            "64M",
            "--block",
            "256K",
            "--path",
            file.to_str().unwrap(),
        ],
    );
    let toks = tokens(&r);
    assert_eq!((toks.len(), r.workload.len()), (2, 2), "two marked phases: {toks:?}");
    let (t, w) = (&toks[0], &r.workload[0]);
    assert_eq!(w["kind"], "pread-peer");
    let jobs = u(w, "jobs");
    assert_eq!(jobs, 256);
    assert!(ns(thread_named(t, "peer-io"), "io_wait") > 0, "the worker's reads are its io_wait: {t}");
    let x = &t["explicit_reads"];
    assert!(x.is_object(), "explicit reads are measured (the model is known): {t}");
    for k in ["dense", "experts", "other"] {
        assert_eq!(
            (u(&x["bytes"], k), u(&x["calls"], k)),
            (0, 0),
            "{k}: another file's reads charged to the model: {x}"
        );
    }
    assert_eq!(x["experts"].as_array().map(Vec::len), Some(0), "{x}");
    // The descriptor is judged once user space answers the kernel's question (at the open); reads
    // before the answer are unresolved, never charged. Some came after it: the verdict was
    // "not the model", not a missing one.
    assert!(u(x, "unresolved_calls") < jobs, "every read was unresolved: {x}");
}

/// The kernel wakes the reader before expert-read records fill the ring (`maps::batch_wakeup`,
/// asked at every `xread::QUERY_EVERY`th record of a thread), so no poll is needed to keep up: a
/// storm of 400 000 4 KiB reads of the model, most of them of routed experts, makes records for
/// about 2.5 times the 4 MiB ring within one token, under `--poll 30s` (no poll comes during
/// the run). No record is lost, the per-expert bytes add up to the token's experts bytes, and
/// the kinds add up to the workload's own count of bytes read.
#[test]
fn an_expert_read_storm_wakes_the_reader_before_the_ring_fills() {
    let _l = machine_lock();
    let model = tiny_model();
    let m = model.to_str().unwrap();
    let calls = 400_000u64;
    let r = observe(
        "xread-wake.json",
        &["--poll", "30s", "--model", m, "--", workload(), "pread-storm", "--path", m, "--calls", &calls.to_string()],
    );
    // A full ring loses the token's own end record too: checked first, for the message.
    assert_eq!(u(&r.summary, "lost_events"), 0, "records lost: the reader was not woken before the ring filled");
    let toks = tokens(&r);
    assert_eq!((toks.len(), r.workload.len()), (1, 1), "one marked phase: {toks:?}");
    let (t, w) = (&toks[0], &r.workload[0]);
    assert_eq!(u(w, "calls"), calls);
    let x = &t["explicit_reads"];
    let kinds = ["dense", "experts", "other"];
    let bytes: u64 = kinds.iter().map(|k| u(&x["bytes"], k)).sum();
    let charged: u64 = kinds.iter().map(|k| u(&x["calls"], k)).sum::<u64>() + u(x, "unresolved_calls");
    assert_eq!(charged, calls, "every read charged: {x}");
    assert_eq!(bytes + u(x, "unresolved_bytes"), u(w, "bytes"), "bytes vs the workload's: {x}");
    // Each record takes 32 bytes of the ring (24 and its header).
    let records = u(&x["calls"], "experts");
    assert!(records * 32 > 2 * (4 << 20), "the storm must outgrow the 4 MiB ring: {records} expert reads");
    assert_eq!(u(x, "lost_bytes"), 0, "expert-read records lost: {x}");
    let per_expert: u64 = x["experts"].as_array().expect("experts").iter().map(|e| u(e, "bytes")).sum();
    assert_eq!(per_expert, u(&x["bytes"], "experts"), "the per-expert reads add up to the experts' bytes");
}
